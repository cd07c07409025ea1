//! The `FilteringSucceed` message keeps HAMi's exact format whatever the scores (it reuses the
//! formatted score of equal neighbours, so equal, different, negative-zero and tiny scores are
//! all checked against the plain formatting).

use std::collections::BTreeMap;

use hami_contract::PodDevices;
use hami_contract::identity::AllocationSignature;
use tessera_scheduler_core::decide::{NodeFailure, Placement, success_summary};
use tessera_scheduler_core::fit::Charge;

fn placement(fitting: Vec<(String, f32)>, failed: usize) -> Placement {
    let fitting = fitting.into_iter().map(|(n, s)| (n.into(), s)).collect();
    let devices = PodDevices(Vec::new());
    Placement {
        node: "n1".to_owned(),
        signature: AllocationSignature::new(&devices, &BTreeMap::new()),
        devices,
        charge: Charge::default(),
        mig: Vec::new(),
        fitting,
        failed: (0..failed)
            .map(|i| (format!("f{i}"), NodeFailure::Unregistered("x".to_owned())))
            .collect(),
    }
}

fn plain(p: &Placement) -> String {
    let fits = p
        .fitting
        .iter()
        .map(|(n, s)| format!("{n}:{s:.2}"))
        .collect::<Vec<_>>()
        .join(",");
    format!(
        "find fit node({}), {} nodes not fit, {} nodes fit({fits})",
        p.node,
        p.failed.len(),
        p.fitting.len()
    )
}

#[test]
fn success_summary_matches_hami_format_for_any_scores() {
    let scores = [
        0.0f32, 0.0, -0.0, 1.5, 1.5, 1.505, 27.345, 27.345, 0.0, 1e-9, 3.0,
    ];
    let fitting: Vec<(String, f32)> = scores
        .iter()
        .enumerate()
        .map(|(i, s)| (format!("node-{i}"), *s))
        .collect();
    let p = placement(fitting, 2);
    assert_eq!(success_summary(&p), plain(&p));
    let single = placement(vec![("n1".to_owned(), 12.5)], 0);
    assert_eq!(
        success_summary(&single),
        "find fit node(n1), 0 nodes not fit, 1 nodes fit(n1:12.50)"
    );
    let none = placement(Vec::new(), 0);
    assert_eq!(success_summary(&none), plain(&none));
}

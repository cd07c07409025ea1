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
        failed_count: failed,
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

/// The pending-pods gauge's reason: what refused the most nodes; per node, what refused the most
/// of its devices; ties to the first in HAMi's order.
#[test]
fn a_pending_pod_waits_for_the_reason_that_refused_the_most_nodes() {
    use std::collections::BTreeMap;
    use tessera_scheduler_core::decide::{NodeFailure, pending_reason};
    use tessera_scheduler_core::fit::{FitFailure, FitReason, ReasonCounts};
    let devices = |pairs: &[(FitReason, usize)]| {
        let mut c = ReasonCounts::over(4);
        for &(r, n) in pairs {
            c.add(r, n);
        }
        NodeFailure::Fit(FitFailure::Devices(c))
    };
    assert_eq!(pending_reason(&BTreeMap::new()), "NoCandidateNodes");
    let failed: BTreeMap<String, NodeFailure> = [
        (
            "a".to_owned(),
            devices(&[
                (FitReason::CardInsufficientMemory, 3),
                (FitReason::CardNotHealth, 1),
            ]),
        ),
        (
            "b".to_owned(),
            devices(&[(FitReason::CardInsufficientMemory, 4)]),
        ),
        (
            "c".to_owned(),
            NodeFailure::Fit(FitFailure::NodeInsufficientDevice),
        ),
    ]
    .into();
    assert_eq!(pending_reason(&failed), "CardInsufficientMemory");
    // One node each: the first reason in HAMi's order wins.
    let tie: BTreeMap<String, NodeFailure> = [
        (
            "a".to_owned(),
            devices(&[(FitReason::CardInsufficientCore, 2)]),
        ),
        (
            "b".to_owned(),
            devices(&[(FitReason::CardInsufficientMemory, 2)]),
        ),
    ]
    .into();
    assert_eq!(pending_reason(&tie), "CardInsufficientMemory");
    let unregistered: BTreeMap<String, NodeFailure> =
        [("a".to_owned(), NodeFailure::Unknown)].into();
    assert_eq!(pending_reason(&unregistered), "NodeUnregistered");
}

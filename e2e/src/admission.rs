//! What a device plugin's log says about the kubelet's admissions: every served `Allocate`
//! (`Allocate serves pod pod=<ns/name> container=<name> … reason=<how>`), grouped into one run per
//! pod, and the checks both kubelets (the real one and the harness) must pass: one pod at a time,
//! its containers in kubelet order, each pod identified through pod-resources `List` at its first
//! call and continued after that, in the order the pods were bound.

use std::collections::{BTreeMap, BTreeSet};

/// One served `Allocate` call, from the plugin's log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Served {
    /// `namespace/name`.
    pub pod: String,
    pub container: String,
    /// `continuing`, `elimination`, `unique`, … (`identity::ChoiceReason`).
    pub reason: String,
}

/// The served calls in log order (text log format).
pub fn served_calls(log: &str) -> Vec<Served> {
    log.lines()
        .filter(|l| l.contains("Allocate serves pod"))
        .filter_map(|l| {
            let field = |key: &str| {
                l.split_whitespace()
                    .find_map(|t| t.strip_prefix(key)?.strip_prefix('='))
                    .map(|v| v.trim_matches('"').to_owned())
            };
            Some(Served {
                pod: field("pod")?,
                container: field("container")?,
                reason: field("reason")?,
            })
        })
        .collect()
}

/// One pod's admission: its consecutive calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Run {
    pub pod: String,
    /// `(container, reason)` in call order.
    pub calls: Vec<(String, String)>,
}

/// Groups consecutive calls of the same pod.
pub fn runs(calls: &[Served]) -> Vec<Run> {
    let mut out: Vec<Run> = Vec::new();
    for c in calls {
        match out.last_mut() {
            Some(r) if r.pod == c.pod => r.calls.push((c.container.clone(), c.reason.clone())),
            _ => out.push(Run {
                pod: c.pod.clone(),
                calls: vec![(c.container.clone(), c.reason.clone())],
            }),
        }
    }
    out
}

/// Checks the runs against the pods' GPU containers (`namespace/name` → container names in
/// kubelet order), their bind order and creation order (`namespace/name` → a sortable time).
/// Returns what differs, empty when the kubelet behaved as the identity design expects.
pub fn check(
    runs: &[Run],
    gpu_containers: &BTreeMap<String, Vec<String>>,
    bound: &[String],
    created: &BTreeMap<String, String>,
) -> Vec<String> {
    let mut problems = Vec::new();
    let mut seen = BTreeSet::new();
    for r in runs {
        if !seen.insert(r.pod.clone()) {
            problems.push(format!("{}: its calls are not contiguous", r.pod));
        }
        let called: Vec<&str> = r.calls.iter().map(|(c, _)| c.as_str()).collect();
        let want: Vec<&str> = gpu_containers
            .get(&r.pod)
            .map(|v| v.iter().map(String::as_str).collect())
            .unwrap_or_default();
        if called != want {
            problems.push(format!(
                "{}: calls for {called:?}, containers {want:?}",
                r.pod
            ));
        }
        for (i, (container, reason)) in r.calls.iter().enumerate() {
            let expected = if i == 0 { "elimination" } else { "continuing" };
            if reason != expected {
                problems.push(format!(
                    "{}/{container}: identified by {reason}, expected {expected}",
                    r.pod
                ));
            }
        }
    }
    for p in gpu_containers.keys() {
        if !seen.contains(p) {
            problems.push(format!("{p}: never served"));
        }
    }
    // Admission follows the watch (bind order); inside one batch of the kubelet's pod source the
    // kubelet sorts by creation time, which may invert two pods bound close together and created
    // in different seconds.
    let position: BTreeMap<&str, usize> = bound
        .iter()
        .enumerate()
        .map(|(i, p)| (p.as_str(), i))
        .collect();
    for (i, a) in runs.iter().enumerate() {
        for b in &runs[i + 1..] {
            let (Some(pa), Some(pb)) = (position.get(a.pod.as_str()), position.get(b.pod.as_str()))
            else {
                continue;
            };
            // Only a strictly earlier creation time excuses the inversion: pods created in the
            // same second are admitted in bind order (what the real kubelet showed).
            if pb < pa && created.get(&a.pod) >= created.get(&b.pod) {
                problems.push(format!(
                    "{} was admitted before {}, though bound after it and not created before it",
                    a.pod, b.pod
                ));
            }
        }
    }
    problems
}

/// How many pairs of pods were admitted in another order than they were bound.
pub fn inversions(runs: &[Run], bound: &[String]) -> usize {
    let position: BTreeMap<&str, usize> = bound
        .iter()
        .enumerate()
        .map(|(i, p)| (p.as_str(), i))
        .collect();
    let order: Vec<usize> = runs
        .iter()
        .filter_map(|r| position.get(r.pod.as_str()).copied())
        .collect();
    order
        .iter()
        .enumerate()
        .map(|(i, a)| order[i + 1..].iter().filter(|b| *b < a).count())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = "\
2026-12-01T22:40:01.1Z  INFO allocate: tessera_node::allocator: Allocate serves pod pod=ns/a container=init entry=0 reason=\"elimination\"
2026-12-01T22:40:01.2Z  INFO allocate: tessera_node::allocator: Allocate serves pod pod=ns/a container=app0 entry=1 reason=\"continuing\"
2026-12-01T22:40:01.3Z  INFO registered with the kubelet
2026-12-01T22:40:01.4Z  INFO allocate: tessera_node::allocator: Allocate serves pod pod=ns/b container=app0 entry=0 reason=\"elimination\"
";

    fn containers() -> BTreeMap<String, Vec<String>> {
        BTreeMap::from([
            (
                "ns/a".to_owned(),
                vec!["init".to_owned(), "app0".to_owned()],
            ),
            ("ns/b".to_owned(), vec!["app0".to_owned()]),
        ])
    }

    #[test]
    fn parses_served_calls_and_groups_them_by_pod() {
        let calls = served_calls(LOG);
        assert_eq!(calls.len(), 3);
        assert_eq!(calls[1].reason, "continuing");
        let r = runs(&calls);
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].calls.len(), 2);
        let created = BTreeMap::new();
        assert!(check(&r, &containers(), &["ns/a".into(), "ns/b".into()], &created).is_empty());
    }

    #[test]
    fn reports_interleaving_wrong_order_and_other_identification() {
        // b is admitted in the middle of a's run, and a before b although bound after it.
        let log = "\
Allocate serves pod pod=ns/a container=init entry=0 reason=\"elimination\"
Allocate serves pod pod=ns/b container=app0 entry=0 reason=\"elimination\"
Allocate serves pod pod=ns/a container=app0 entry=1 reason=\"continuing\"
";
        let r = runs(&served_calls(log));
        let created = BTreeMap::from([
            ("ns/a".to_owned(), "2".to_owned()),
            ("ns/b".to_owned(), "1".to_owned()),
        ]);
        let problems = check(&r, &containers(), &["ns/b".into(), "ns/a".into()], &created);
        assert!(
            problems.iter().any(|p| p.contains("not contiguous")),
            "{problems:?}"
        );
        assert!(
            problems.iter().any(|p| p.contains("admitted before")),
            "{problems:?}"
        );
        assert!(
            problems.iter().any(|p| p.contains("expected elimination")),
            "{problems:?}"
        );
        assert_eq!(inversions(&r, &["ns/b".into(), "ns/a".into()]), 1);
    }
}

//! The decision loop's bookkeeping: budgets, reservations, fencing, sweep, requeue.

use k8s_openapi::api::core::v1::{Pod, ResourceQuota};
use serde_json::json;
use tessera_scheduler::engine::{Engine, Observation, Refusal};
use tessera_scheduler_core::config::DecisionConfig;
use tessera_scheduler_core::decide::Verdict;
use tessera_scheduler_core::fixtures::{gpu_node, gpu_pod, running_pod};

fn quota(ns: &str, name: &str, hard: serde_json::Value) -> ResourceQuota {
    serde_json::from_value(
        json!({"metadata": {"name": name, "namespace": ns}, "spec": {"hard": hard}}),
    )
    .unwrap()
}

fn engine() -> Engine {
    let mut e = Engine::standalone(DecisionConfig::default());
    e.observe(Observation::NodeUpsert(Box::new(gpu_node(
        "n1", 2, 16000, 10,
    ))));
    e
}

fn placed(v: &Result<Verdict, Refusal>) -> Option<String> {
    match v {
        Ok(Verdict::Placed(p)) => Some(p.node.clone()),
        _ => None,
    }
}

fn reasons(v: &Result<Verdict, Refusal>) -> String {
    match v {
        Ok(Verdict::NoFit { failed, .. }) => failed
            .values()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; "),
        other => format!("{other:?}"),
    }
}

#[test]
fn the_smallest_quota_of_a_namespace_wins_and_in_flight_reservations_count() {
    let mut e = engine();
    e.observe(Observation::QuotaUpsert(Box::new(quota(
        "team",
        "big",
        json!({"limits.nvidia.com/gpumem": "20000"}),
    ))));
    e.observe(Observation::QuotaUpsert(Box::new(quota(
        "team",
        "small",
        json!({"limits.nvidia.com/gpumem": "5000"}),
    ))));
    let n = vec!["n1".to_owned()];
    assert_eq!(
        placed(&e.filter(&gpu_pod("team", "a", 1, 4000, 0), &n)).as_deref(),
        Some("n1")
    );
    // Not yet visible to any informer, still charged.
    let second = e.filter(&gpu_pod("team", "b", 1, 4000, 0), &n);
    assert_eq!(reasons(&second), "2/2 ResourceQuotaNotFit");
    // Other namespaces are not limited (on a second node: n1 has a's decision in flight).
    e.observe(Observation::NodeUpsert(Box::new(gpu_node(
        "n2", 2, 16000, 10,
    ))));
    let both = vec!["n1".to_owned(), "n2".to_owned()];
    assert!(placed(&e.filter(&gpu_pod("other", "c", 1, 4000, 0), &both)).is_some());
    // Releasing the reservation gives the budget back.
    e.filter_abort("uid-team-a");
    assert!(placed(&e.filter(&gpu_pod("team", "b", 1, 4000, 0), &n)).is_some());
}

#[test]
fn quota_count_and_cores_keys_are_enforced() {
    let mut e = engine();
    e.observe(Observation::QuotaUpsert(Box::new(quota(
        "team",
        "q",
        json!({"requests.nvidia.com/gpu": "1", "limits.nvidia.com/gpucores": "50"}),
    ))));
    let n = vec!["n1".to_owned()];
    assert_eq!(
        reasons(&e.filter(&gpu_pod("team", "two", 2, 100, 0), &n)),
        "1/2 AllocatedCardsInsufficientRequest, 1/2 ResourceQuotaNotFit"
    );
    assert_eq!(
        reasons(&e.filter(&gpu_pod("team", "hot", 1, 100, 60), &n)),
        "2/2 ResourceQuotaNotFit"
    );
    assert!(placed(&e.filter(&gpu_pod("team", "ok", 1, 100, 50), &n)).is_some());
}

#[test]
fn a_new_leader_decides_only_after_its_own_rebuild() {
    let mut e = Engine::new(DecisionConfig::default());
    let n = vec!["n1".to_owned()];
    assert_eq!(
        e.filter(&gpu_pod("d", "p", 1, 100, 0), &n),
        Err(Refusal::NotLeader)
    );
    e.set_leadership(Some(2));
    assert_eq!(
        e.filter(&gpu_pod("d", "p", 1, 100, 0), &n),
        Err(Refusal::NotSynced)
    );
    // A rebuild from an older term is discarded.
    e.rebuild(1, &[gpu_node("n1", 1, 16000, 10)], &[], &[]);
    assert_eq!(
        e.filter(&gpu_pod("d", "p", 1, 100, 0), &n),
        Err(Refusal::NotSynced)
    );
    let busy = running_pod("d", "busy", "n1", "GPU-n1-0,NVIDIA,16000,100:;");
    e.rebuild(2, &[gpu_node("n1", 1, 16000, 10)], &[busy], &[]);
    assert_eq!(
        reasons(&e.filter(&gpu_pod("d", "p", 1, 100, 0), &n)),
        "1/1 CardInsufficientMemory"
    );
}

#[test]
fn reservations_of_pods_that_never_appear_are_swept() {
    let mut e = engine();
    let n = vec!["n1".to_owned()];
    assert!(placed(&e.filter(&gpu_pod("d", "ghost", 1, 16000, 0), &n)).is_some());
    assert_eq!(e.state().reservations().count(), 1);
    for _ in 0..5 {
        e.sweep();
    }
    assert_eq!(e.state().reservations().count(), 0);
    // A reservation of a live pod survives the sweep.
    let live = gpu_pod("d", "live", 1, 16000, 0);
    e.observe(Observation::PodUpsert(Box::new(live.clone())));
    assert!(placed(&e.filter(&live, &n)).is_some());
    for _ in 0..5 {
        e.sweep();
    }
    assert_eq!(e.state().reservations().count(), 1);
}

fn with_phase(mut p: Pod, phase: &str, deleting: bool) -> Pod {
    p.status.get_or_insert_with(Default::default).phase = Some(phase.to_owned());
    if deleting {
        p.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
        ));
    }
    p
}

#[test]
fn terminating_pods_keep_their_usage_and_finished_pods_free_it() {
    let mut e = Engine::standalone(DecisionConfig::default());
    e.observe(Observation::NodeUpsert(Box::new(gpu_node(
        "n1", 1, 16000, 10,
    ))));
    let n = vec!["n1".to_owned()];
    let full = running_pod("d", "full", "n1", "GPU-n1-0,NVIDIA,16000,100:;");
    e.observe(Observation::PodUpsert(Box::new(with_phase(
        full.clone(),
        "Running",
        true,
    ))));
    assert_eq!(
        reasons(&e.filter(&gpu_pod("d", "p", 1, 100, 0), &n)),
        "1/1 CardInsufficientMemory"
    );
    e.observe(Observation::PodUpsert(Box::new(with_phase(
        full,
        "Succeeded",
        true,
    ))));
    assert!(placed(&e.filter(&gpu_pod("d", "p", 1, 100, 0), &n)).is_some());
}

#[test]
fn pending_pods_are_requeued_when_capacity_frees() {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut e = Engine::standalone(DecisionConfig::default()).with_requeue(tx);
    e.observe(Observation::NodeUpsert(Box::new(gpu_node(
        "n1", 1, 16000, 10,
    ))));
    let full = running_pod("d", "full", "n1", "GPU-n1-0,NVIDIA,16000,100:;");
    e.observe(Observation::PodUpsert(Box::new(full)));
    let waiting = gpu_pod("d", "waiting", 1, 8000, 0);
    assert!(placed(&e.filter(&waiting, &["n1".to_owned()])).is_none());
    assert!(rx.try_recv().is_err());
    e.observe(Observation::PodDelete {
        uid: "uid-d-full".to_owned(),
    });
    let nudged = rx.try_recv().expect("a requeue batch");
    assert_eq!(nudged.len(), 1);
    assert_eq!(nudged[0].name, "waiting");
}

/// A pod held back by a nominated pod's hold (issue 30 item 4) is requeued when the hold ends:
/// the nominated pod bound elsewhere, or deleted, without any booking changing.
#[test]
fn pods_held_back_by_a_nomination_are_requeued_when_it_ends() {
    for end in ["bound elsewhere", "deleted"] {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut e = Engine::standalone(DecisionConfig::default()).with_requeue(tx);
        for n in ["n1", "n2"] {
            e.observe(Observation::NodeUpsert(Box::new(gpu_node(n, 1, 16000, 10))));
        }
        let busy = running_pod("d", "busy", "n2", "GPU-n2-0,NVIDIA,16000,100:;");
        e.observe(Observation::PodUpsert(Box::new(busy)));
        let mut nominee = gpu_pod("d", "nominee", 1, 12000, 0);
        nominee.spec.as_mut().expect("spec").priority = Some(100);
        nominee.status = Some(k8s_openapi::api::core::v1::PodStatus {
            nominated_node_name: Some("n1".into()),
            phase: Some("Pending".into()),
            ..Default::default()
        });
        e.observe(Observation::PodUpsert(Box::new(nominee.clone())));
        let waiting = gpu_pod("d", "waiting", 1, 8000, 0);
        let nodes = ["n1".to_owned(), "n2".to_owned()];
        assert!(placed(&e.filter(&waiting, &nodes)).is_none(), "{end}: held");
        assert!(rx.try_recv().is_err());
        if end == "deleted" {
            e.observe(Observation::PodDelete {
                uid: "uid-d-nominee".to_owned(),
            });
        } else {
            nominee.spec.as_mut().expect("spec").node_name = Some("n3".into());
            e.observe(Observation::PodUpsert(Box::new(nominee)));
        }
        let nudged = rx.try_recv().expect("a requeue batch");
        assert_eq!(nudged.len(), 1, "{end}");
        assert_eq!(nudged[0].name, "waiting", "{end}");
    }
}

#[test]
fn a_refiltered_pod_with_a_stale_failed_phase_still_books_its_new_decision() {
    let mut e = Engine::standalone(DecisionConfig::default());
    e.observe(Observation::NodeUpsert(Box::new(gpu_node(
        "n1", 1, 16000, 10,
    ))));
    let n = vec!["n1".to_owned()];
    let p = gpu_pod("d", "p", 1, 16000, 0);
    assert!(placed(&e.filter(&p, &n)).is_some());
    // The informer shows the decision, plus `bind-phase: failed` left by an earlier failed bind.
    let mut seen = p.clone();
    seen.metadata.annotations = Some(
        [
            ("hami.io/vgpu-node", "n1"),
            (
                "hami.io/vgpu-devices-allocated",
                "GPU-n1-0,NVIDIA,16000,0:;",
            ),
            ("hami.io/bind-phase", "failed"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect(),
    );
    e.observe(Observation::PodUpsert(Box::new(seen)));
    assert_eq!(
        reasons(&e.filter(&gpu_pod("d", "q", 1, 1000, 0), &n)),
        "1/1 CardInsufficientMemory"
    );
}

#[test]
fn a_relist_removes_pods_deleted_while_the_watch_was_down() {
    use tessera_scheduler_core::state::ResyncKind;
    let mut e = Engine::standalone(DecisionConfig::default());
    e.observe(Observation::NodeUpsert(Box::new(gpu_node(
        "n1", 1, 16000, 10,
    ))));
    let n = vec!["n1".to_owned()];
    e.observe(Observation::PodUpsert(Box::new(running_pod(
        "d",
        "gone",
        "n1",
        "GPU-n1-0,NVIDIA,16000,0:;",
    ))));
    assert_eq!(
        reasons(&e.filter(&gpu_pod("d", "p", 1, 1000, 0), &n)),
        "1/1 CardInsufficientMemory"
    );
    e.observe(Observation::Resync {
        kind: ResyncKind::Pods,
        keep: vec!["uid-d-p".to_owned()],
    });
    assert!(placed(&e.filter(&gpu_pod("d", "p", 1, 1000, 0), &n)).is_some());
}

#[test]
fn nodes_outside_the_label_selector_take_no_gpu_pods() {
    let cfg = DecisionConfig {
        node_selector: vec![("gpu".to_owned(), "on".to_owned())],
        ..Default::default()
    };
    let mut e = Engine::standalone(cfg);
    e.observe(Observation::NodeUpsert(Box::new(gpu_node(
        "n1", 1, 16000, 10,
    ))));
    let v = e.filter(&gpu_pod("d", "p", 1, 100, 0), &["n1".to_owned()]);
    assert_eq!(
        reasons(&v),
        "node unregistered: does not match --node-label-selector"
    );
    let mut labelled = gpu_node("n1", 1, 16000, 10);
    labelled.metadata.labels = Some([("gpu".to_owned(), "on".to_owned())].into_iter().collect());
    e.observe(Observation::NodeUpsert(Box::new(labelled)));
    assert!(placed(&e.filter(&gpu_pod("d", "p", 1, 100, 0), &["n1".to_owned()])).is_some());
}

#[test]
fn large_candidate_lists_choose_like_a_sequential_pass() {
    let mut e = Engine::standalone(DecisionConfig {
        filter_threads: 3,
        reasons_when_placed: true,
        ..Default::default()
    });
    let names: Vec<String> = (0..900).map(|i| format!("n{i:03}")).collect();
    for n in &names {
        e.observe(Observation::NodeUpsert(Box::new(gpu_node(n, 2, 16000, 10))));
    }
    e.observe(Observation::PodUpsert(Box::new(running_pod(
        "d",
        "a",
        "n700",
        "GPU-n700-0,NVIDIA,4000,10:;",
    ))));
    e.observe(Observation::PodUpsert(Box::new(running_pod(
        "d",
        "b",
        "n650",
        "GPU-n650-0,NVIDIA,8000,10:;",
    ))));
    e.observe(Observation::PodUpsert(Box::new(running_pod(
        "d",
        "c",
        "n005",
        "GPU-n005-0,NVIDIA,16000,0:GPU-n005-1,NVIDIA,16000,0:;",
    ))));
    // Binpack: the fullest node that still fits.
    let v = e.filter(&gpu_pod("d", "p", 1, 1000, 0), &names);
    assert_eq!(placed(&v).as_deref(), Some("n650"));
    match &v {
        Ok(Verdict::Placed(p)) => {
            assert_eq!(p.fitting.len(), 899);
            assert_eq!(p.failed["n005"].to_string(), "2/2 CardInsufficientMemory");
        }
        other => panic!("{other:?}"),
    }
    e.filter_abort("uid-d-p");
    // Spread: the emptiest; ties go to the first candidate.
    let mut spread = gpu_pod("d", "s", 1, 1000, 0);
    spread.metadata.annotations = Some(
        [(
            "hami.io/node-scheduler-policy".to_owned(),
            "spread".to_owned(),
        )]
        .into_iter()
        .collect(),
    );
    assert_eq!(placed(&e.filter(&spread, &names)).as_deref(), Some("n000"));
}

fn failed_reasons(v: &Result<Verdict, Refusal>) -> std::collections::BTreeMap<String, String> {
    match v {
        Ok(Verdict::Placed(p)) => reason_strings(&p.failed),
        Ok(Verdict::NoFit { failed, .. }) => reason_strings(failed),
        other => panic!("{other:?}"),
    }
}

/// The reasons as the extender's `FailedNodes` carries them.
fn reason_strings(
    failed: &std::collections::BTreeMap<String, tessera_scheduler_core::decide::NodeFailure>,
) -> std::collections::BTreeMap<String, String> {
    failed
        .iter()
        .map(|(node, why)| (node.clone(), why.to_string()))
        .collect()
}

/// The pod as the informer shows it once a filter patch landed (`--write-decision-at-filter`,
/// or a decision written by another replica): decided, not bound.
fn decided_pod(pod: &Pod, v: &Result<Verdict, Refusal>) -> Pod {
    let Ok(Verdict::Placed(p)) = v else {
        panic!("{v:?}")
    };
    let patch = tessera_scheduler_core::patch::decision_patch(&p.node, &p.devices, &p.mig, 0);
    let mut pod = pod.clone();
    pod.metadata.annotations = Some(patch.annotations);
    pod.metadata.labels = Some(patch.labels);
    pod
}

/// kube-scheduler binds a filtered pod a moment after the filter answered; a confusable pod
/// filtered in between is steered to another node instead of being refused at bind (and
/// backed off by kube-scheduler for a second or more).
#[test]
fn a_confusable_pod_avoids_a_node_where_another_was_just_decided() {
    let mut e = Engine::standalone(DecisionConfig {
        reasons_when_placed: true,
        ..Default::default()
    });
    for n in ["n1", "n2"] {
        e.observe(Observation::NodeUpsert(Box::new(gpu_node(n, 2, 16000, 10))));
    }
    let nodes = vec!["n1".to_owned(), "n2".to_owned()];
    let a = gpu_pod("d", "a", 1, 3000, 10);
    let va = e.filter(&a, &nodes);
    assert_eq!(placed(&va).as_deref(), Some("n1"));
    // b asks for other limits: the device plugin could take one for the other.
    let b = gpu_pod("d", "b", 1, 2000, 10);
    let vb = e.filter(&b, &nodes);
    assert_eq!(placed(&vb).as_deref(), Some("n2"), "{vb:?}");
    assert!(
        failed_reasons(&vb)["n1"].starts_with("PendingAllocationConflict: pod d/a "),
        "{vb:?}"
    );
    // Still so once the informer shows a's decision (the reservation is then dropped).
    e.observe(Observation::PodUpsert(Box::new(decided_pod(&a, &va))));
    assert!(e.state().reservation("uid-d-a").is_none());
    e.filter_abort("uid-d-b");
    assert_eq!(placed(&e.filter(&b, &nodes)).as_deref(), Some("n2"));
    e.filter_abort("uid-d-b");
    // The bind gate is unchanged: a's own bind is admitted.
    let live = decided_pod(&a, &va);
    assert!(e.bind_begin(&live, "n1").is_ok());
}

#[test]
fn on_one_node_a_confusable_pod_waits_for_the_decided_one_and_identical_pods_do_not() {
    let mut e = Engine::standalone(DecisionConfig::default());
    e.observe(Observation::NodeUpsert(Box::new(gpu_node(
        "n1", 1, 16000, 10,
    ))));
    let n = vec!["n1".to_owned()];
    let a = gpu_pod("d", "a", 1, 3000, 10);
    let va = e.filter(&a, &n);
    assert_eq!(placed(&va).as_deref(), Some("n1"));
    // Identical to a, on the same (only) GPU: interchangeable, so both may be in flight.
    let same = gpu_pod("d", "same", 1, 3000, 10);
    assert_eq!(placed(&e.filter(&same, &n)).as_deref(), Some("n1"));
    let b = gpu_pod("d", "b", 1, 2000, 10);
    let vb = e.filter(&b, &n);
    assert!(
        reasons(&vb).starts_with("PendingAllocationConflict: pod d/"),
        "{vb:?}"
    );
    // a is bound and allocated, same is gone: b fits.
    let mut bound = decided_pod(&a, &va);
    bound
        .metadata
        .annotations
        .get_or_insert_with(Default::default)
        .insert("hami.io/bind-phase".into(), "success".into());
    bound.spec.get_or_insert_with(Default::default).node_name = Some("n1".into());
    e.observe(Observation::PodUpsert(Box::new(bound)));
    e.observe(Observation::PodDelete {
        uid: "uid-d-same".to_owned(),
    });
    assert_eq!(placed(&e.filter(&b, &n)).as_deref(), Some("n1"));
}

/// A GPU pod kube-scheduler marks for preemption (its `DisruptionTarget` condition, as the watch
/// keeps it) is reported once, with the slices its eviction frees; its Event says so.
#[test]
fn a_pod_marked_for_preemption_is_reported_once_with_its_slices() {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut e = engine().with_preempted(tx);
    let running = running_pod("ns", "victim", "n1", "GPU-n1-0,NVIDIA,10000,30:;");
    e.observe(Observation::PodUpsert(Box::new(running.clone())));
    assert!(rx.try_recv().is_err());
    let mut marked = running;
    marked
        .status
        .get_or_insert_with(Default::default)
        .conditions = Some(vec![
        serde_json::from_value(json!({"type": "DisruptionTarget", "status": "True",
            "reason": "PreemptionByScheduler",
            "message": "hami-scheduler: preempting to accommodate a higher priority pod"}))
        .unwrap(),
    ]);
    let marked = tessera_scheduler_core::state::slim_pod(marked);
    e.observe(Observation::PodUpsert(Box::new(marked.clone())));
    let p = rx.try_recv().expect("reported");
    assert_eq!((p.name.as_str(), p.node.as_str()), ("victim", "n1"));
    assert_eq!(p.slices, ["GPU-n1-0 10000 MiB 30%"]);
    let event = tessera_scheduler::http::preempted_event(&p);
    assert_eq!(event.reason, "GPUSlicePreempted");
    assert!(
        event
            .message
            .contains("frees GPU-n1-0 10000 MiB 30% on node n1")
    );
    e.observe(Observation::PodUpsert(Box::new(marked)));
    assert!(rx.try_recv().is_err(), "reported once");
}

/// The extender's default: a pod that fits is answered with its node and no other candidate's
/// reason (kube-scheduler reads `FailedNodes` only when nothing fits), the count kept for
/// HAMi's `FilteringSucceed` text; a pod that fits nowhere still gets every node's reason.
#[test]
fn reasons_are_built_only_when_nothing_fits_unless_asked() {
    let mut e = Engine::standalone(DecisionConfig::default());
    for n in ["n1", "n2", "n3"] {
        e.observe(Observation::NodeUpsert(Box::new(gpu_node(n, 1, 16000, 10))));
    }
    e.observe(Observation::PodUpsert(Box::new(running_pod(
        "d",
        "big",
        "n1",
        "GPU-n1-0,NVIDIA,15000,0:;",
    ))));
    let nodes: Vec<String> = ["n1", "n2", "n3", "gone"].map(str::to_owned).to_vec();
    let v = e.filter(&gpu_pod("d", "fits", 1, 4000, 0), &nodes);
    match &v {
        Ok(Verdict::Placed(p)) => {
            assert!(p.failed.is_empty(), "{v:?}");
            assert_eq!(p.failed_count, 2, "n1 is full, `gone` unknown");
            assert!(
                tessera_scheduler_core::decide::success_summary(p).contains("2 nodes not fit"),
                "{}",
                tessera_scheduler_core::decide::success_summary(p)
            );
        }
        other => panic!("{other:?}"),
    }
    e.filter_abort("uid-d-fits");
    let v = e.filter(&gpu_pod("d", "huge", 1, 20000, 0), &nodes);
    let reasons = failed_reasons(&v);
    assert_eq!(reasons.len(), 4, "{reasons:?}");
    assert!(
        reasons["n2"].contains("CardInsufficientMemory"),
        "{reasons:?}"
    );
}

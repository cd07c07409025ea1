//! Issue 30 item 3: a node where evicting pods cannot make room for the pod is answered as
//! `FailedAndUnresolvableNodes`, so kube-scheduler runs no preemption dry run there; a node the
//! pod would fit once its pods were gone stays in `FailedNodes`.

use k8s_openapi::api::core::v1::{Node, Pod};
use tessera_scheduler_core::config::DecisionConfig;
use tessera_scheduler_core::decide::{Verdict, filter_pod};
use tessera_scheduler_core::extender::ExtenderFilterResult;
use tessera_scheduler_core::fixtures::{gpu_node, gpu_pod, running_pod};
use tessera_scheduler_core::state::ClusterState;

fn state(nodes: &[Node], pods: &[Pod]) -> ClusterState {
    tessera_scheduler_core::fixtures::cluster_state(nodes, pods)
}

/// The wire answer for `pod` over `candidates`.
fn answer(s: &mut ClusterState, pod: &Pod, candidates: &[&str]) -> serde_json::Value {
    let names: Vec<String> = candidates.iter().map(|n| (*n).to_owned()).collect();
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    match filter_pod(s, &DecisionConfig::default(), pod, &uid, &names) {
        Verdict::NoFit {
            failed,
            unresolvable,
        } => serde_json::from_str(&ExtenderFilterResult::no_fit(failed, &unresolvable).to_json())
            .expect("JSON"),
        other => panic!("expected no fit, got {other:?}"),
    }
}

fn keys(v: &serde_json::Value) -> Vec<String> {
    v.as_object()
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default()
}

#[test]
fn only_nodes_that_eviction_could_free_are_left_to_preemption() {
    // full: one 15 GiB card, taken by a 15 GiB pod (evicting it would free the card).
    // small: one 8 GiB card (too small for 12 GiB, whatever runs there).
    // pair: one card, the pod asks for two.
    let nodes = [
        gpu_node("full", 1, 15360, 10),
        gpu_node("small", 1, 8192, 10),
        gpu_node("pair", 1, 15360, 10),
    ];
    let running = [running_pod(
        "ns",
        "holder",
        "full",
        "GPU-full-0,NVIDIA,15360,100:;",
    )];
    let mut s = state(&nodes, &running);
    let a = answer(
        &mut s,
        &gpu_pod("ns", "big", 1, 12288, 0),
        &["full", "small", "missing"],
    );
    assert_eq!(keys(&a["FailedNodes"]), ["full"], "{a}");
    assert_eq!(
        keys(&a["FailedAndUnresolvableNodes"]),
        ["missing", "small"],
        "{a}"
    );
    // HAMi's reason strings are kept in both maps.
    assert_eq!(
        a["FailedAndUnresolvableNodes"]["small"],
        "1/1 CardInsufficientMemory"
    );
    assert_eq!(a["FailedNodes"]["full"], "1/1 CardInsufficientMemory");
    let a = answer(&mut s, &gpu_pod("ns", "two", 2, 1000, 0), &["pair"]);
    assert_eq!(keys(&a["FailedAndUnresolvableNodes"]), ["pair"], "{a}");
    assert!(
        a["FailedNodes"].as_object().is_some_and(|m| m.is_empty()),
        "{a}"
    );
}

#[test]
fn a_type_or_uuid_the_pod_excludes_is_unresolvable_and_a_busy_card_is_not() {
    let nodes = [gpu_node("t4", 1, 15360, 1)];
    let running = [running_pod(
        "ns",
        "holder",
        "t4",
        "GPU-t4-0,NVIDIA,1000,0:;",
    )];
    let mut s = state(&nodes, &running);
    let mut wrong_type = gpu_pod("ns", "a100-only", 1, 1000, 0);
    wrong_type.metadata.annotations =
        Some([("nvidia.com/use-gputype".to_owned(), "A100".to_owned())].into());
    let a = answer(&mut s, &wrong_type, &["t4"]);
    assert_eq!(keys(&a["FailedAndUnresolvableNodes"]), ["t4"], "{a}");
    let mut not_this_card = gpu_pod("ns", "elsewhere", 1, 1000, 0);
    not_this_card.metadata.annotations =
        Some([("nvidia.com/nouse-gpuuuid".to_owned(), "GPU-t4-0".to_owned())].into());
    let a = answer(&mut s, &not_this_card, &["t4"]);
    assert_eq!(keys(&a["FailedAndUnresolvableNodes"]), ["t4"], "{a}");
    // The card's one replica is taken: evicting its holder would make room.
    let a = answer(&mut s, &gpu_pod("ns", "next", 1, 1000, 0), &["t4"]);
    assert_eq!(keys(&a["FailedNodes"]), ["t4"], "{a}");
    assert!(
        a.get("FailedAndUnresolvableNodes")
            .is_none_or(serde_json::Value::is_null),
        "{a}"
    );
}

//! Issue 30 item 1: the extender's preemption verb evicts exactly the lower-priority pods of one
//! GPU that the pod needs, says where preemption cannot help, follows PodDisruptionBudgets as
//! kube-scheduler ranks them, and (property) leaves a minimal victim set after which the pod
//! fits.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, Pod};
use proptest::prelude::*;
use serde_json::json;
use tessera_scheduler_core::config::DecisionConfig;
use tessera_scheduler_core::decide::{Verdict, filter_pod};
use tessera_scheduler_core::extender::{ExtenderPreemptionArgs, ExtenderPreemptionResult};
use tessera_scheduler_core::fixtures::{cluster_state, gpu_node, gpu_pod, running_pod};
use tessera_scheduler_core::preempt::{Budget, NoVictims, Victims, preempt};
use tessera_scheduler_core::state::ClusterState;

/// A running pod with a priority, a start time and labels.
fn tenant(name: &str, node: &str, allocated: &str, priority: i32, started: i64) -> Pod {
    let mut p = running_pod("ns", name, node, allocated);
    let spec = p.spec.get_or_insert_with(Default::default);
    spec.priority = Some(priority);
    p.metadata.labels = Some(BTreeMap::from([("app".to_owned(), name.to_owned())]));
    let status = p.status.get_or_insert_with(Default::default);
    status.start_time = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        k8s_openapi::jiff::Timestamp::from_second(started).expect("time"),
    ));
    p
}

fn preemptor(priority: i32, nums: u32, mem: u32) -> Pod {
    let mut p = gpu_pod("ns", "urgent", nums, mem, 0);
    p.spec.get_or_insert_with(Default::default).priority = Some(priority);
    p
}

fn ask(
    s: &mut ClusterState,
    pod: &Pod,
    nodes: &[&str],
    budgets: &[Budget],
) -> (
    BTreeMap<String, tessera_scheduler_core::preempt::NodeVictims>,
    BTreeMap<String, NoVictims>,
) {
    let proposed: BTreeMap<String, Victims> = nodes
        .iter()
        .map(|n| ((*n).to_owned(), Victims::default()))
        .collect();
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    preempt(s, &DecisionConfig::default(), pod, &uid, &proposed, budgets)
}

/// Whether the real `/filter` places `pod` (as `uid-ns-urgent`) on node `n`.
fn placed_on_n(s: &mut ClusterState, pod: &Pod) -> bool {
    matches!(
        filter_pod(
            s,
            &DecisionConfig::default(),
            pod,
            "uid-ns-urgent",
            &["n".to_owned()]
        ),
        Verdict::Placed(_)
    )
}

/// [`ask`] on node `n` with kube-scheduler's own victims there (UIDs, their PDB violations).
fn ask_with_victims(
    s: &mut ClusterState,
    pod: &Pod,
    victims: &[&str],
    pdb_violations: i64,
    budgets: &[Budget],
) -> (
    BTreeMap<String, tessera_scheduler_core::preempt::NodeVictims>,
    BTreeMap<String, NoVictims>,
) {
    let proposed = BTreeMap::from([(
        "n".to_owned(),
        Victims {
            pods: victims.iter().map(|v| (*v).to_owned()).collect(),
            pdb_violations,
        },
    )]);
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    preempt(s, &DecisionConfig::default(), pod, &uid, &proposed, budgets)
}

/// Two 16 GiB cards. GPU 0: `a` (6 GiB, priority 10) beside `keep` (6 GiB, priority 1000).
/// GPU 1: `b` (8 GiB, priority 10) and `c` (8 GiB, priority 5).
fn two_cards() -> (Vec<Node>, Vec<Pod>) {
    (
        vec![gpu_node("n", 2, 16384, 10)],
        vec![
            tenant("a", "n", "GPU-n-0,NVIDIA,6144,0:;", 10, 100),
            tenant("keep", "n", "GPU-n-0,NVIDIA,6144,0:;", 1000, 100),
            tenant("b", "n", "GPU-n-1,NVIDIA,8192,0:;", 10, 200),
            tenant("c", "n", "GPU-n-1,NVIDIA,8192,0:;", 5, 300),
        ],
    )
}

#[test]
fn the_cheapest_gpu_is_freed_and_nothing_else() {
    let (nodes, pods) = two_cards();
    let mut s = cluster_state(&nodes, &pods);
    let (chosen, refused) = ask(&mut s, &preemptor(100, 1, 10240), &["n"], &[]);
    assert!(refused.is_empty(), "{refused:?}");
    let v = &chosen["n"];
    // Evicting `a` frees 10 GiB on GPU 0; GPU 1 would cost two pods; `keep` outranks the pod.
    assert_eq!(v.pods, ["uid-ns-a"]);
    assert_eq!(v.gpus, ["GPU-n-0"]);
    assert_eq!(v.pdb_violations, 0);
    // After the eviction the real filter places the pod.
    s.remove_pod("uid-ns-a");
    assert!(placed_on_n(&mut s, &preemptor(100, 1, 10240)));
}

#[test]
fn a_budget_that_would_be_violated_moves_the_choice_to_another_gpu() {
    let (nodes, pods) = two_cards();
    let mut s = cluster_state(&nodes, &pods);
    let pdb = Budget {
        namespace: "ns".into(),
        allowed: 0,
        counted: ["uid-ns-a".to_owned()].into(),
    };
    let (chosen, _) = ask(
        &mut s,
        &preemptor(100, 1, 10240),
        &["n"],
        std::slice::from_ref(&pdb),
    );
    // Fewest PDB violations first: both of GPU 1's tenants, most important first.
    assert_eq!(chosen["n"].pods, ["uid-ns-b", "uid-ns-c"]);
    assert_eq!(chosen["n"].pdb_violations, 0);
    // With an allowance of one, evicting `a` violates nothing and wins again.
    let relaxed = Budget { allowed: 1, ..pdb };
    let (chosen, _) = ask(&mut s, &preemptor(100, 1, 10240), &["n"], &[relaxed]);
    assert_eq!(chosen["n"].pods, ["uid-ns-a"]);
}

/// kube-scheduler's own victims use a budget's allowance first: with one disruption allowed and
/// kube-scheduler already evicting `c` (covered), evicting `a` too would violate the budget, so
/// GPU 1's `b` (not covered) is chosen instead, and no violation is reported.
#[test]
fn kube_schedulers_victims_use_the_budget_first() {
    let (nodes, pods) = two_cards();
    let mut s = cluster_state(&nodes, &pods);
    let pdb = Budget {
        namespace: "ns".into(),
        allowed: 1,
        counted: ["uid-ns-a".to_owned(), "uid-ns-c".to_owned()].into(),
    };
    let pod = preemptor(100, 1, 10240);
    let (chosen, _) = ask_with_victims(&mut s, &pod, &["uid-ns-c"], 0, std::slice::from_ref(&pdb));
    assert_eq!(chosen["n"].pods, ["uid-ns-c", "uid-ns-b"]);
    assert_eq!(chosen["n"].pdb_violations, 0);
    // Without kube-scheduler's victim, `a` (GPU 0) is the cheapest again.
    let (chosen, _) = ask(&mut s, &pod, &["n"], &[pdb]);
    assert_eq!(chosen["n"].pods, ["uid-ns-a"]);
    assert_eq!(chosen["n"].pdb_violations, 0);
}

/// A pod already being evicted (`status.disruptedPods`) is not counted again.
#[test]
fn a_pod_the_budget_lists_as_disrupted_is_not_counted_again() {
    let pdb: k8s_openapi::api::policy::v1::PodDisruptionBudget = serde_json::from_value(json!({
        "metadata": {"name": "b", "namespace": "ns"},
        "status": {"disruptionsAllowed": 0, "currentHealthy": 1, "desiredHealthy": 1,
                   "expectedPods": 2, "disruptedPods": {"a": "2026-12-04T10:00:00Z"}}}))
    .expect("pdb");
    let budget = Budget::from_pdb(
        &pdb,
        [
            ("a".to_owned(), "uid-ns-a".to_owned()),
            ("b".to_owned(), "uid-ns-b".to_owned()),
        ],
    );
    assert_eq!(budget.namespace, "ns");
    assert_eq!(budget.allowed, 0);
    assert_eq!(budget.counted, ["uid-ns-b".to_owned()].into());
}

#[test]
fn where_preemption_cannot_help_nothing_is_evicted_and_the_reason_is_given() {
    let (nodes, pods) = two_cards();
    let mut s = cluster_state(&nodes, &pods);
    // Larger than a card; and a pod of lower priority than every tenant of GPU 0 and 1.
    let (chosen, refused) = ask(&mut s, &preemptor(100, 1, 20000), &["n", "gone"], &[]);
    assert!(chosen.is_empty(), "{chosen:?}");
    assert!(
        matches!(refused["n"], NoVictims::DoesNotFit(_)),
        "{refused:?}"
    );
    assert_eq!(refused["gone"], NoVictims::Unknown);
    let (chosen, refused) = ask(&mut s, &preemptor(1, 1, 10240), &["n"], &[]);
    assert!(chosen.is_empty(), "{chosen:?}");
    assert!(matches!(refused["n"], NoVictims::DoesNotFit(_)));
    // A pod that already fits needs no victim (kube-scheduler must not get an empty list).
    let (chosen, refused) = ask(&mut s, &preemptor(100, 1, 1024), &["n"], &[]);
    assert!(chosen.is_empty());
    assert_eq!(refused["n"], NoVictims::AlreadyFits);
}

#[test]
fn kube_schedulers_own_victims_are_kept_and_count() {
    let (nodes, pods) = two_cards();
    let mut s = cluster_state(&nodes, &pods);
    let pod = preemptor(100, 1, 10240);
    let (chosen, _) = ask_with_victims(&mut s, &pod, &["uid-ns-c", "uid-plain"], 1, &[]);
    // With `c` gone GPU 1 has 8 GiB free: `a` (one pod, priority 10) or `b` (one pod, priority
    // 10, started later): kube-scheduler's ranking ties, and the first GPU is taken.
    let v = &chosen["n"];
    assert_eq!(&v.pods[..2], ["uid-ns-c", "uid-plain"]);
    assert_eq!(v.pods.len(), 3, "{v:?}");
    assert_eq!(v.pdb_violations, 1);
}

#[test]
fn a_multi_gpu_pod_frees_whole_cards_and_a_tenant_spanning_both_counts_once() {
    let nodes = vec![gpu_node("n", 2, 16384, 10)];
    let pods = vec![
        tenant(
            "wide",
            "n",
            "GPU-n-0,NVIDIA,8192,0:GPU-n-1,NVIDIA,8192,0:;",
            10,
            100,
        ),
        tenant("small", "n", "GPU-n-1,NVIDIA,1024,0:;", 10, 100),
    ];
    let mut s = cluster_state(&nodes, &pods);
    let (chosen, _) = ask(&mut s, &preemptor(100, 2, 12288), &["n"], &[]);
    assert_eq!(chosen["n"].pods, ["uid-ns-wide"]);
    assert_eq!(chosen["n"].gpus, ["GPU-n-0", "GPU-n-1"]);
}

#[test]
fn the_wire_forms_decode_and_the_answer_is_what_kube_scheduler_reads() {
    let pod = serde_json::to_value(preemptor(100, 1, 1024)).expect("pod");
    let meta = json!({"Pod": pod, "NodeNameToMetaVictims": {
        "n": {"Pods": [{"UID": "u1"}], "NumPDBViolations": 2}, "m": {"Pods": null}}});
    let args = ExtenderPreemptionArgs::decode(meta.to_string().as_bytes()).expect("decode");
    assert_eq!(args.victims["n"].pods, ["u1"]);
    assert_eq!(args.victims["n"].pdb_violations, 2);
    assert!(args.victims["m"].pods.is_empty());
    let full = json!({"pod": pod, "nodeNameToVictims": {
        "n": {"pods": [{"metadata": {"uid": "u2"}}], "numPDBViolations": 0}}});
    let args = ExtenderPreemptionArgs::decode(full.to_string().as_bytes()).expect("decode");
    assert_eq!(args.victims["n"].pods, ["u2"]);
    for bad in [
        json!({"NodeNameToMetaVictims": {}}),
        json!({"Pod": pod, "NodeNameToMetaVictims": []}),
        json!({"Pod": pod, "NodeNameToMetaVictims": {"n": {"Pods": [{"UID": ""}]}}}),
        json!({"Pod": pod, "NodeNameToMetaVictims": {"n": {"Pods": [], "NumPDBViolations": "x"}}}),
    ] {
        assert!(
            ExtenderPreemptionArgs::decode(bad.to_string().as_bytes()).is_err(),
            "{bad}"
        );
    }
    let (nodes, pods) = two_cards();
    let mut s = cluster_state(&nodes, &pods);
    let (chosen, _) = ask(&mut s, &preemptor(100, 1, 10240), &["n"], &[]);
    let out: serde_json::Value =
        serde_json::from_str(&ExtenderPreemptionResult::from_victims(&chosen).to_json())
            .expect("json");
    assert_eq!(
        out,
        json!({"NodeNameToMetaVictims": {"n": {"Pods": [{"UID": "uid-ns-a"}], "NumPDBViolations": 0}}})
    );
}

/// A tenant of the property test: which GPUs (of 3), memory per GPU, priority.
#[derive(Debug, Clone)]
struct Tenant {
    gpus: Vec<usize>,
    mem: u32,
    priority: i32,
}

fn tenant_spec() -> impl Strategy<Value = Tenant> {
    (
        prop::collection::btree_set(0usize..3, 1..3),
        prop_oneof![Just(2048u32), Just(4096), Just(6144), 1000u32..8000],
        0i32..4,
    )
        .prop_map(|(gpus, mem, priority)| Tenant {
            gpus: gpus.into_iter().collect(),
            mem,
            priority: priority * 10,
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    /// Whatever the tenants: victims have lower priority than the pod; once they are gone the
    /// real filter places the pod; putting back any one of them makes it not fit (minimal); and
    /// where no victims are named, the pod does not fit even with every lower-priority pod gone.
    #[test]
    fn victims_are_lower_priority_sufficient_and_minimal(
        tenants in prop::collection::vec(tenant_spec(), 0..8),
        nums in 1u32..3,
        mem in prop_oneof![Just(4096u32), Just(8192), 1000u32..16000],
        priority in 0i32..5,
    ) {
        let priority = priority * 10 + 5;
        let nodes = vec![gpu_node("n", 3, 16384, 4)];
        // Tenants are added while they fit, as a scheduler would have placed them.
        let mut used = [(0u32, 0u32); 3];
        let mut pods = Vec::new();
        for (i, t) in tenants.iter().enumerate() {
            if t.gpus.iter().any(|&g| used[g].0 >= 4 || used[g].1 + t.mem > 16384) {
                continue;
            }
            let mut allocated = String::new();
            for &g in &t.gpus {
                used[g].0 += 1;
                used[g].1 += t.mem;
                allocated.push_str(&format!("GPU-n-{g},NVIDIA,{},0:", t.mem));
            }
            allocated.push(';');
            pods.push((format!("t{i}"), t.priority,
                tenant(&format!("t{i}"), "n", &allocated, t.priority, 100 + i as i64)));
        }
        let all: Vec<Pod> = pods.iter().map(|(_, _, p)| p.clone()).collect();
        let pod = preemptor(priority, nums, mem);
        let cfg = DecisionConfig::default();
        let fits_without = |gone: &[String]| {
            let mut s = cluster_state(&nodes, &all);
            for uid in gone {
                s.remove_pod(uid);
            }
            matches!(filter_pod(&mut s, &cfg, &pod, "uid-ns-urgent", &["n".to_owned()]),
                Verdict::Placed(_))
        };
        let mut s = cluster_state(&nodes, &all);
        let (chosen, refused) = ask(&mut s, &pod, &["n"], &[]);
        match chosen.get("n") {
            Some(v) => {
                prop_assert!(!v.pods.is_empty());
                for uid in &v.pods {
                    let (_, p, _) = pods.iter().find(|(n, _, _)| format!("uid-ns-{n}") == *uid)
                        .expect("a known tenant");
                    prop_assert!(*p < priority, "{uid} has priority {p} >= {priority}");
                }
                prop_assert!(fits_without(&v.pods), "does not fit after evicting {:?}", v.pods);
                for i in 0..v.pods.len() {
                    let mut fewer = v.pods.clone();
                    let back = fewer.remove(i);
                    prop_assert!(!fits_without(&fewer), "{back} need not be evicted: {:?}", v.pods);
                }
            }
            None => {
                let lower: Vec<String> = pods.iter().filter(|(_, p, _)| *p < priority)
                    .map(|(n, _, _)| format!("uid-ns-{n}")).collect();
                match &refused["n"] {
                    NoVictims::AlreadyFits => prop_assert!(fits_without(&[])),
                    other => prop_assert!(!fits_without(&lower), "{other}, yet fits without {lower:?}"),
                }
            }
        }
    }
}

/// `simulate` answers "what would this pod evict, where": a pending pod of priority 100 that fits
/// nowhere names the lower-priority tenant of one GPU, not the GPU's higher-priority tenant.
#[test]
fn simulate_says_what_a_pending_pod_would_evict() {
    let text = r#"
apiVersion: v1
kind: Node
metadata:
  name: n
  annotations:
    hami.io/node-nvidia-register: '[{"id":"GPU-n-0","count":10,"devmem":16384,"devcore":100,"type":"NVIDIA-Tesla T4","mode":"hami-core","health":true}]'
---
apiVersion: v1
kind: Pod
metadata:
  name: batch
  namespace: default
  annotations:
    hami.io/vgpu-node: n
    hami.io/vgpu-devices-allocated: "GPU-n-0,NVIDIA,10000,0:;"
    hami.io/bind-phase: success
spec:
  nodeName: n
  priority: 10
  containers: [{name: main, image: trainer}]
status: {phase: Running}
---
apiVersion: v1
kind: Pod
metadata:
  name: serving
  namespace: default
  annotations:
    hami.io/vgpu-node: n
    hami.io/vgpu-devices-allocated: "GPU-n-0,NVIDIA,4000,0:;"
    hami.io/bind-phase: success
spec:
  nodeName: n
  priority: 1000
  containers: [{name: main, image: server}]
status: {phase: Running}
---
apiVersion: v1
kind: Pod
metadata:
  name: urgent
  namespace: default
spec:
  priority: 100
  containers:
  - name: main
    image: app
    resources:
      limits: {nvidia.com/gpu: 1, nvidia.com/gpumem: 8000}
"#;
    let input = tessera_scheduler_core::simulate::Input::parse(text).expect("input");
    let results = tessera_scheduler_core::simulate::run(&input, &DecisionConfig::default());
    let urgent = results
        .iter()
        .find(|r| r.pod == "default/urgent")
        .expect("urgent");
    assert_eq!(urgent.node, None);
    assert_eq!(
        urgent.preemption["n"],
        "evicting default/batch (priority 10) frees GPU-n-0"
    );
    let table = tessera_scheduler_core::simulate::table(&results);
    assert!(
        table.contains("by preemption: n: evicting default/batch (priority 10) frees GPU-n-0"),
        "{table}"
    );
}

/// Issue 30 item 4: once kube-scheduler has evicted the victims and nominated the preemptor to
/// the node, the slice is held for it: a pod of no higher priority is not placed there, while the
/// victims are still terminating or after they are gone; a pod of higher priority is, and the
/// hold ends with the nomination.
#[test]
fn the_freed_slice_is_held_for_the_nominated_pod() {
    let nodes = vec![gpu_node("n", 1, 16384, 10)];
    let mut victim = tenant("victim", "n", "GPU-n-0,NVIDIA,10240,0:;", 10, 100);
    victim.metadata.deletion_timestamp =
        Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::from_second(200).expect("time"),
        ));
    let mut nominated = preemptor(100, 1, 12288);
    nominated.metadata.name = Some("nominated".into());
    nominated.metadata.uid = Some("uid-ns-nominated".into());
    nominated.status = Some(
        serde_json::from_value(json!({"phase": "Pending", "nominatedNodeName": "n"}))
            .expect("status"),
    );
    // What the extender's watch keeps of it.
    let nominated = tessera_scheduler_core::state::slim_pod(nominated);
    let mut s = cluster_state(&nodes, &[victim, nominated.clone()]);
    let cfg = DecisionConfig::default();
    let filter = |s: &mut ClusterState, priority: i32| {
        let mut p = gpu_pod("ns", &format!("p{priority}"), 1, 4096, 0);
        p.spec.as_mut().expect("spec").priority = Some(priority);
        let uid = p.metadata.uid.clone().expect("uid");
        filter_pod(s, &cfg, &p, &uid, &["n".to_owned()])
    };
    // The victim still terminates (10 GiB booked); the nominated pod's 12 GiB are held beside it.
    assert!(matches!(filter(&mut s, 10), Verdict::NoFit { .. }));
    assert!(
        matches!(filter(&mut s, 100), Verdict::NoFit { .. }),
        "equal priority waits too"
    );
    // The victim is gone: of 16 GiB, 12 are held; a 4 GiB pod fits, an 8 GiB one does not.
    s.remove_pod("uid-ns-victim");
    assert!(matches!(filter(&mut s, 10), Verdict::Placed(_)));
    let mut big = gpu_pod("ns", "big", 1, 8192, 0);
    big.spec.as_mut().expect("spec").priority = Some(10);
    assert!(matches!(
        filter_pod(&mut s, &cfg, &big, "uid-ns-big", &["n".to_owned()]),
        Verdict::NoFit { .. }
    ));
    // A pod of higher priority is not held back; nor is anyone once the nomination ends.
    big.spec.as_mut().expect("spec").priority = Some(1000);
    assert!(matches!(
        filter_pod(&mut s, &cfg, &big, "uid-ns-big", &["n".to_owned()]),
        Verdict::Placed(_)
    ));
    big.spec.as_mut().expect("spec").priority = Some(10);
    s.remove_pod("uid-ns-nominated");
    assert!(matches!(
        filter_pod(&mut s, &cfg, &big, "uid-ns-big", &["n".to_owned()]),
        Verdict::Placed(_)
    ));
    // The nominated pod itself is never held back by its own nomination.
    let mut s = cluster_state(&nodes, std::slice::from_ref(&nominated));
    assert!(matches!(
        filter_pod(
            &mut s,
            &cfg,
            &nominated,
            "uid-ns-nominated",
            &["n".to_owned()]
        ),
        Verdict::Placed(_)
    ));
}

/// Issue 30 item 6: in a cluster where HAMi's own scheduler placed some pods, those pods are
/// victims like Tessera's. The pod below is what HAMi v2.10 leaves on a pod it placed and its
/// device plugin allocated: two containers sharing GPU 1, `vgpu-devices-to-allocate` consumed
/// down to its separators, no `spec.priority` (HAMi's charts set no priority class: 0), no
/// Tessera annotation. It is also a victim while HAMi's plugin has not allocated it yet
/// (`bind-phase: allocating`): it is bound, so kube-scheduler finds it on the node.
#[test]
fn pods_hamis_scheduler_placed_are_victims_like_any_other() {
    let hami_placed = |phase: &str| -> Pod {
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "hami-job", "namespace": "ml", "uid": "uid-hami-job",
                "annotations": {
                    "hami.io/vgpu-node": "n",
                    "hami.io/vgpu-time": "1733300000",
                    "hami.io/vgpu-devices-to-allocate": if phase == "success" {
                        ";;".to_owned()
                    } else {
                        "GPU-n-1,NVIDIA,4096,0:;GPU-n-1,NVIDIA,4096,0:;".to_owned()
                    },
                    "hami.io/vgpu-devices-allocated": "GPU-n-1,NVIDIA,4096,0:;GPU-n-1,NVIDIA,4096,0:;",
                    "hami.io/bind-phase": phase,
                    "hami.io/bind-time": "1733300001"}},
            "spec": {"nodeName": "n", "schedulerName": "hami-scheduler", "containers": [
                {"name": "a", "image": "app", "resources": {"limits": {
                    "nvidia.com/gpu": "1", "nvidia.com/gpumem": "4096"}}},
                {"name": "b", "image": "app", "resources": {"limits": {
                    "nvidia.com/gpu": "1", "nvidia.com/gpumem": "4096"}}}]},
            "status": {"phase": if phase == "success" { "Running" } else { "Pending" }},
        }))
        .expect("a HAMi-placed pod")
    };
    for phase in ["success", "allocating"] {
        // GPU 0: `a` (priority 10) and `keep` (1000) leave 4 GiB, 10 GiB without `a`: too
        // little. GPU 1: HAMi's pod holds 8 GiB in two containers.
        let nodes = vec![gpu_node("n", 2, 16384, 10)];
        let pods = vec![
            tenant("a", "n", "GPU-n-0,NVIDIA,6144,0:;", 10, 100),
            tenant("keep", "n", "GPU-n-0,NVIDIA,6144,0:;", 1000, 100),
            hami_placed(phase),
        ];
        let mut s = cluster_state(&nodes, &pods);
        let pod = preemptor(100, 1, 12288);
        let (chosen, refused) = ask(&mut s, &pod, &["n"], &[]);
        assert!(refused.is_empty(), "{phase}: {refused:?}");
        assert_eq!(chosen["n"].pods, ["uid-hami-job"], "{phase}");
        assert_eq!(chosen["n"].gpus, ["GPU-n-1"], "{phase}");
        // Both containers' memory is freed: the real filter places the pod once it is gone.
        s.remove_pod("uid-hami-job");
        assert!(placed_on_n(&mut s, &pod), "{phase}");
    }
}

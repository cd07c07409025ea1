//! The cluster state's records: what the daemon slims from listed objects builds the same
//! records as the full objects.

use k8s_openapi::api::core::v1::Pod;
use serde_json::json;
use tessera_scheduler_core::config::DecisionConfig;
use tessera_scheduler_core::fixtures::gpu_node;
use tessera_scheduler_core::state::{NodeRecord, PodRecord, slim_node, slim_pod};

/// The daemon keeps only what the state reads of each listed object; the state built from the
/// reduced objects must be exactly the one built from the full ones.
#[test]
fn slimmed_pods_and_nodes_build_the_same_records() {
    let full: Pod = serde_json::from_value(json!({
        "metadata": {"name": "p", "namespace": "team-a", "uid": "u1",
            "deletionTimestamp": "2026-11-30T10:00:00Z",
            "labels": {"app": "x"},
            "annotations": {
                "hami.io/vgpu-node": "n1",
                "hami.io/vgpu-devices-allocated": "GPU-a,NVIDIA,1000,10:;GPU-b,NVIDIA,2000,20:;",
                "hami.io/bind-phase": "allocating",
                "nvidia.com/use-gputype": "A100",
                "hami.io/gpu-scheduler-policy": "binpack",
                "kubectl.kubernetes.io/last-applied-configuration": "{\"huge\": true}"},
            "managedFields": [{"manager": "kubectl", "operation": "Update"}]},
        "spec": {"nodeName": "n1",
            "initContainers": [{"name": "init", "image": "busybox",
                "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
            "containers": [{"name": "main", "image": "app", "env": [{"name": "A", "value": "b"}]}]},
        "status": {"phase": "Running",
            "initContainerStatuses": [{"name": "init", "image": "busybox", "imageID": "", "ready": false,
                "restartCount": 0, "state": {"terminated": {"exitCode": 0}}}],
            "containerStatuses": [{"name": "main", "image": "app", "imageID": "", "ready": true,
                "restartCount": 0}]}
    }))
    .unwrap();
    let slim = slim_pod(full.clone());
    assert_eq!(PodRecord::from_pod(&slim), PodRecord::from_pod(&full));
    assert!(PodRecord::from_pod(&full).is_some());
    assert!(slim.metadata.managed_fields.is_none() && slim.metadata.labels.is_none());
    assert_eq!(slim.metadata.annotations.as_ref().map(|a| a.len()), Some(5));

    let cfg = DecisionConfig {
        node_selector: vec![("gpu".into(), "on".into())],
        ..Default::default()
    };
    let mut node = gpu_node("n1", 2, 16000, 10);
    node.metadata.labels = Some([("gpu".to_owned(), "on".to_owned())].into());
    let annotations = node
        .metadata
        .annotations
        .get_or_insert_with(Default::default);
    annotations.insert("hami.io/device-cordon".into(), "GPU-n1-1".into());
    annotations.insert("node.alpha.kubernetes.io/ttl".into(), "0".into());
    node.status = serde_json::from_value(json!({"allocatable": {"nvidia.com/gpu": "0"},
        "images": [{"names": ["registry/x:1"], "sizeBytes": 1}]}))
    .unwrap();
    let slim = slim_node(node.clone());
    let rec = NodeRecord::from_node(&node, &cfg);
    assert_eq!(NodeRecord::from_node(&slim, &cfg), rec);
    // The allocatable 0 and the cordon survived the reduction.
    let rec = rec.unwrap();
    assert!(rec.unregistered.is_some_and(|r| r.contains("allocatable")));
    assert_eq!(rec.cordoned.len(), 1);
    assert!(slim.status.is_some_and(|s| s.images.is_none()));
}

/// A node that registered an empty device list is "node unregistered" (HAMi keeps no device
/// entry for it), and a malformed register annotation names the JSON error.
#[test]
fn empty_or_malformed_register_annotations_leave_the_node_unregistered() {
    let cfg = DecisionConfig::default();
    for (value, reason) in [
        (
            "[]",
            "node unregistered: its register annotation lists no device",
        ),
        (
            "{not json",
            "node unregistered: node register annotation is not valid JSON",
        ),
    ] {
        let mut node = gpu_node("n1", 2, 16000, 10);
        node.metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert("hami.io/node-nvidia-register".into(), value.into());
        let rec = NodeRecord::from_node(&node, &cfg).expect("a node record");
        let why = rec.unregistered.unwrap_or_default();
        assert!(why.starts_with(reason), "{value}: {why}");
    }
}

/// A pod as the informer shows it, for the state round trip below.
#[allow(clippy::too_many_arguments)]
fn pod(
    uid: &str,
    node: Option<&str>,
    bound: bool,
    allocated: Option<&str>,
    bind_phase: Option<&str>,
    constraint: Option<(&str, &str)>,
    init: usize,
    init_done: bool,
    phase: &str,
    deleting: bool,
) -> Pod {
    let mut annotations = serde_json::Map::new();
    if let Some(n) = node {
        annotations.insert("hami.io/vgpu-node".into(), json!(n));
    }
    if let Some(a) = allocated {
        annotations.insert("hami.io/vgpu-devices-allocated".into(), json!(a));
    }
    if let Some(p) = bind_phase {
        annotations.insert("hami.io/bind-phase".into(), json!(p));
    }
    if let Some((k, v)) = constraint {
        annotations.insert(k.into(), json!(v));
    }
    annotations.insert("hami.io/vgpu-time".into(), json!("1764493200"));
    let mut meta = json!({"name": format!("name-{uid}"), "namespace": "team-a", "uid": uid,
        "annotations": annotations});
    if deleting {
        meta["deletionTimestamp"] = json!("2026-11-30T10:00:00Z");
    }
    let mut spec = json!({"containers": [{"name": "main", "image": "app"}]});
    if bound {
        spec["nodeName"] = json!(node.unwrap_or("elsewhere"));
    }
    let inits: Vec<_> = (0..init)
        .map(|i| json!({"name": format!("init-{i}"), "image": "x"}))
        .collect();
    if init > 0 {
        spec["initContainers"] = json!(inits);
    }
    let statuses: Vec<_> = (0..init)
        .map(|i| {
            json!({"name": format!("init-{i}"), "image": "x", "imageID": "", "ready": false,
            "restartCount": 0,
            "state": if init_done {json!({"terminated": {"exitCode": 0}})} else {json!({"running": {}})}})
        })
        .collect();
    serde_json::from_value(json!({"metadata": meta, "spec": spec,
        "status": {"phase": phase, "initContainerStatuses": statuses}}))
    .unwrap()
}

proptest::proptest! {
    /// The state keeps pods in a compact form; the record it gives back is the one
    /// `PodRecord::from_pod` builds, from the full object and from the slimmed one, and the
    /// pod's usage, pending and decided indexes and liveness follow from it as before.
    #[test]
    fn the_state_gives_back_the_record_from_pod(
        node in proptest::option::of(proptest::sample::select(vec!["n1", "n2"])),
        bound in proptest::bool::ANY,
        allocated in proptest::option::of(proptest::sample::select(vec![
            "GPU-a,NVIDIA,1000,10:;",
            "GPU-a,NVIDIA,1000,10:GPU-b,NVIDIA,2000,20:;GPU-a,NVIDIA,500,5:;",
            "GPU-a,NVIDIA,1000,10:;;GPU-c,Ascend,10,1:GPU-a,NVIDIA,3,3:;",
            "",
            ";;",
            "GPU-a,NVIDIA:;",
        ])),
        bind_phase in proptest::option::of(proptest::sample::select(vec![
            "allocating", "success", "failed", "other",
        ])),
        constraint in proptest::option::of(proptest::sample::select(vec![
            ("nvidia.com/use-gputype", "A100"),
            ("hami.io/gpu-scheduler-policy", "binpack"),
            ("nvidia.com/numa-bind", "true"),
        ])),
        init in 0usize..3,
        init_done in proptest::bool::ANY,
        phase in proptest::sample::select(vec!["Running", "Pending", "Succeeded", "Failed"]),
        deleting in proptest::bool::ANY,
    ) {
        use tessera_scheduler_core::state::ClusterState;
        let full = pod("u1", node, bound, allocated, bind_phase, constraint, init, init_done, phase, deleting);
        let expected = PodRecord::from_pod(&full);
        for p in [full.clone(), slim_pod(full.clone())] {
            proptest::prop_assert_eq!(PodRecord::from_pod(&p), expected.clone());
            let mut state = ClusterState::new();
            state.upsert_node(NodeRecord::from_node(&gpu_node("n1", 3, 16000, 10), &DecisionConfig::default()).unwrap());
            state.upsert_pod(&p);
            proptest::prop_assert_eq!(state.pod("u1"), expected.clone());
            proptest::prop_assert_eq!(
                state.pod_books_capacity("u1"),
                expected.as_ref().is_some_and(PodRecord::books_capacity)
            );
            proptest::prop_assert!(state.is_live("u1"));
            let keep = std::collections::HashSet::new();
            proptest::prop_assert_eq!(state.missing(tessera_scheduler_core::state::ResyncKind::Pods, &keep), vec!["u1".to_owned()]);
            // The usage the node books, and the namespace's charge.
            state.prepare();
            let booked: Vec<(u32, u32, u32)> = state
                .node_state("n1", None)
                .map(|n| n.gpus.iter().map(|g| (g.used, g.usedmem, g.usedcores)).collect())
                .unwrap_or_default();
            let mut reference = tessera_scheduler_core::fit::NodeState {
                gpus: NodeRecord::from_node(&gpu_node("n1", 3, 16000, 10), &DecisionConfig::default())
                    .unwrap()
                    .devices
                    .iter()
                    .map(tessera_scheduler_core::fit::GpuState::from_registered)
                    .collect(),
                ..Default::default()
            };
            let mut charge = tessera_scheduler_core::fit::Charge::default();
            if let Some(r) = &expected
                && r.books_capacity()
                && r.node.as_deref() == Some("n1")
            {
                tessera_scheduler_core::fit::book_pod(&mut reference, &r.usage);
            }
            if let Some(r) = &expected
                && r.books_capacity()
            {
                charge = tessera_scheduler_core::state::usage_charge(&r.usage);
            }
            let want: Vec<(u32, u32, u32)> = reference.gpus.iter().map(|g| (g.used, g.usedmem, g.usedcores)).collect();
            proptest::prop_assert_eq!(booked, want);
            proptest::prop_assert_eq!(state.namespace_usage("team-a", None), charge);
            // The gate sees the pod exactly when the record says it is pending or decided.
            let pending = state.pending_on("n1", "other").len();
            let in_flight = state.in_flight_on("n1", "other").len();
            let on_n1 = expected.as_ref().is_some_and(|r| r.node.as_deref() == Some("n1"));
            let is_pending = on_n1 && expected.as_ref().is_some_and(PodRecord::is_pending_allocation);
            let is_decided = on_n1 && expected.as_ref().is_some_and(PodRecord::is_decided_unbound);
            proptest::prop_assert_eq!(pending, usize::from(is_pending));
            proptest::prop_assert_eq!(in_flight, usize::from(is_pending) + usize::from(is_decided));
            if is_pending {
                let sig = &expected.as_ref().unwrap().signature;
                proptest::prop_assert_eq!(state.pending_on("n1", "other")[0].signature, sig);
            }
            state.remove_pod("u1");
            proptest::prop_assert!(!state.is_live("u1") && state.pod("u1").is_none());
        }
    }
}

proptest::proptest! {
    /// A namespace's charge is the sum of its own pods' bookings, each pod's in-flight
    /// reservation counted instead of its record, less the pod being filtered, however pods and
    /// reservations of several namespaces came, changed and went (the state keeps a running
    /// total per namespace).
    #[test]
    fn a_namespace_is_charged_for_its_own_pods_only(
        ops in proptest::collection::vec((0usize..6, 0usize..3, 1u32..5000, 0u8..4), 1..40),
    ) {
        use std::collections::HashMap;
        use hami_contract::identity::AllocationSignature;
        use hami_contract::usage::DeviceUsage;
        use tessera_scheduler_core::fit::Charge;
        use tessera_scheduler_core::fixtures::running_pod;
        use tessera_scheduler_core::state::{BindStage, ClusterState, Reservation};
        const NAMESPACES: [&str; 3] = ["team-a", "team-b", "team-c"];
        let mut state = ClusterState::new();
        // uid → (namespace, MiB) of the pods the informer shows, and of the reservations.
        let mut pods: HashMap<String, (&str, u32)> = HashMap::new();
        let mut reserved: HashMap<String, (&str, u32)> = HashMap::new();
        for (pod, ns, mem, op) in ops {
            let (namespace, name) = (NAMESPACES[ns], format!("p{pod}"));
            let uid = format!("uid-{namespace}-{name}");
            match op {
                0 => {
                    let allocated = format!("GPU-n1-0,NVIDIA,{mem},10:;");
                    state.upsert_pod(&running_pod(namespace, &name, "n1", &allocated));
                    pods.insert(uid, (namespace, mem));
                }
                1 => {
                    state.remove_pod(&uid);
                    pods.remove(&uid);
                    reserved.remove(&uid);
                }
                2 => {
                    let usage = vec![DeviceUsage { uuid: "GPU-n1-0".into(), vendor: "NVIDIA".into(), slots: 1, mem, cores: 10 }];
                    state.reserve(Reservation {
                        uid: uid.clone(),
                        namespace: namespace.into(),
                        name,
                        node: "n1".into(),
                        devices: Default::default(),
                        usage,
                        signature: AllocationSignature::new(&Default::default(), &Default::default()),
                        mig: Vec::new(),
                        stage: BindStage::Decided,
                        created_tick: 0,
                    });
                    reserved.insert(uid, (namespace, mem));
                }
                _ => {
                    state.release(&uid);
                    reserved.remove(&uid);
                }
            }
            let effective = |uid: &String| reserved.get(uid).or_else(|| pods.get(uid)).copied();
            let mut uids: Vec<&String> = pods.keys().chain(reserved.keys()).collect();
            uids.sort();
            uids.dedup();
            for namespace in NAMESPACES {
                for exclude in [None, Some("uid-team-a-p0")] {
                    let want = uids
                        .iter()
                        .filter(|uid| Some(uid.as_str()) != exclude)
                        .filter_map(|uid| effective(uid))
                        .filter(|(ns, _)| *ns == namespace)
                        .fold(Charge::default(), |c, (_, mem)| Charge {
                            mem: c.mem + u64::from(mem),
                            cores: c.cores + 10,
                            count: c.count + 1,
                        });
                    proptest::prop_assert_eq!(state.namespace_usage(namespace, exclude), want);
                }
            }
        }
    }
}

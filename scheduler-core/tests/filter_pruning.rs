//! The filter's quick path (per-node summaries, `fit::QuickAsk`) answers exactly what the full
//! evaluation of every candidate answers: same chosen node and devices, same fitting list with
//! scores, same reason for every failed node. Random clusters (device types and modes, health,
//! cordons, topology, unregistered nodes), running, pending, decided and terminal pods,
//! reservations in every stage, quotas, and random requests (counts, memory in MiB or percent,
//! cores up to exclusive, init and several containers, type/UUID/mode selectors, NUMA binding,
//! every GPU and node policy), filtered one after the other with each placement reserved.

use std::collections::{BTreeMap, HashMap, HashSet};

use hami_contract::identity::AllocationSignature;
use hami_contract::usage::collapse_pod_usage;
use hami_contract::{NodeDevice, PodDevices};
use k8s_openapi::api::core::v1::{Pod, ResourceQuota};
use proptest::prelude::*;
use serde_json::json;
use tessera_scheduler_core::config::DecisionConfig;
use tessera_scheduler_core::decide::{Verdict, filter_pod_unpruned, filter_pod_with};
use tessera_scheduler_core::fit::{
    self, GpuPolicyKey, GpuState, NodeState, NodeSummary, PlacementOptions, PodAsk, QuickAsk,
    QuotaBudget, gpu_request,
};
use tessera_scheduler_core::quota::QuotaKeys;
use tessera_scheduler_core::state::{BindStage, ClusterState, NodeRecord, Reservation};

const TYPES: &[&str] = &["NVIDIA-Tesla T4", "NVIDIA-A100", "AMD-MI300", "x-nvidia-y"];
const NAMESPACES: &[&str] = &["ns-a", "ns-b"];

#[derive(Debug, Clone)]
struct GpuSpec {
    count: u32,
    mem: u32,
    core: u32,
    ty: usize,
    mig: bool,
    health: bool,
    numa: u32,
    cordoned: bool,
}

#[derive(Debug, Clone)]
struct NodeSpec {
    gpus: Vec<GpuSpec>,
    unregistered: bool,
    exact_identity: bool,
    /// HAMi's own device plugin serves the node: any pending pod blocks it.
    hami_plugin: bool,
    topology: bool,
}

/// How a booked pod is known: 0 running, 1 allocating (pending), 2 decided and not bound,
/// 3 ended, 4/5/6 a reservation decided / binding / bound, 7 running with bind failed.
#[derive(Debug, Clone)]
struct Booking {
    node: usize,
    gpus: Vec<usize>,
    mem: u32,
    cores: u32,
    kind: u8,
    ns: usize,
}

#[derive(Debug, Clone)]
struct Container {
    nums: u32,
    mem: u32,
    pct: Option<u32>,
    cores: Option<u32>,
}

#[derive(Debug, Clone)]
struct Request {
    ns: usize,
    init: Option<Container>,
    app: Vec<Option<Container>>,
    annotations: Vec<(&'static str, String)>,
}

fn gpu_spec() -> impl Strategy<Value = GpuSpec> {
    (
        prop_oneof![3 => Just(4u32), 1 => 1u32..3, 1 => Just(0)],
        prop_oneof![Just(8000u32), Just(16000), Just(1000)],
        prop_oneof![4 => Just(100u32), 1 => Just(0), 1 => Just(50)],
        prop_oneof![3 => Just(0usize), 1 => 1usize..4],
        proptest::bool::weighted(0.1),
        proptest::bool::weighted(0.9),
        0u32..2,
        proptest::bool::weighted(0.1),
    )
        .prop_map(
            |(count, mem, core, ty, mig, health, numa, cordoned)| GpuSpec {
                count,
                mem,
                core,
                ty,
                mig,
                health,
                numa,
                cordoned,
            },
        )
}

fn node_spec() -> impl Strategy<Value = NodeSpec> {
    (
        prop::collection::vec(gpu_spec(), 0..5),
        proptest::bool::weighted(0.1),
        proptest::bool::weighted(0.2),
        proptest::bool::weighted(0.15),
        proptest::bool::weighted(0.3),
    )
        .prop_map(
            |(gpus, unregistered, exact_identity, hami_plugin, topology)| NodeSpec {
                gpus,
                unregistered,
                exact_identity,
                hami_plugin,
                topology,
            },
        )
}

fn booking() -> impl Strategy<Value = Booking> {
    (
        0usize..8,
        prop::collection::vec(0usize..5, 1..3),
        prop_oneof![Just(0u32), 1000u32..9000],
        prop_oneof![Just(0u32), 1u32..60, Just(100)],
        prop_oneof![6 => Just(0u8), 1 => 1u8..8],
        0usize..2,
    )
        .prop_map(|(node, gpus, mem, cores, kind, ns)| Booking {
            node,
            gpus,
            mem,
            cores,
            kind,
            ns,
        })
}

fn container() -> impl Strategy<Value = Container> {
    (
        prop_oneof![4 => Just(1u32), 1 => 2u32..4],
        prop_oneof![Just(0u32), 500u32..12000],
        prop_oneof![3 => Just(None), 1 => (0u32..101).prop_map(Some)],
        prop_oneof![Just(None), (0u32..101).prop_map(Some), Just(Some(100))],
    )
        .prop_map(|(nums, mem, pct, cores)| Container {
            nums,
            mem,
            pct,
            cores,
        })
}

fn annotation() -> impl Strategy<Value = (&'static str, String)> {
    use hami_contract::annotations as ann;
    prop_oneof![
        Just((ann::USE_GPU_TYPE, "a100".to_owned())),
        Just((ann::NOUSE_GPU_TYPE, "t4".to_owned())),
        Just((ann::USE_GPU_UUID, "GPU-n0-0,GPU-n1-1,GPU-n2-0".to_owned())),
        Just((ann::NOUSE_GPU_UUID, "GPU-n0-1".to_owned())),
        Just((ann::VGPU_MODE, "hami-core".to_owned())),
        Just((ann::NUMA_BIND, "true".to_owned())),
        Just((ann::GPU_SCHEDULER_POLICY, "binpack".to_owned())),
        Just((ann::GPU_SCHEDULER_POLICY, "spread".to_owned())),
        Just((ann::GPU_SCHEDULER_POLICY, "mutex".to_owned())),
        Just((ann::GPU_SCHEDULER_POLICY, "topology-aware".to_owned())),
        Just((ann::GPU_SCHEDULER_POLICY, "binpack,numa".to_owned())),
        Just((ann::NODE_SCHEDULER_POLICY, "spread".to_owned())),
        Just((ann::NODE_SCHEDULER_POLICY, "binpack".to_owned())),
        Just((
            ann::DEVICE_SCORING_WEIGHTS,
            "slot=2,core=1,memory=3".to_owned()
        )),
    ]
}

fn request() -> impl Strategy<Value = Request> {
    (
        0usize..2,
        prop_oneof![4 => Just(None), 1 => container().prop_map(Some)],
        prop_oneof![
            6 => container().prop_map(|c| vec![Some(c)]),
            1 => prop::collection::vec(prop_oneof![Just(None), container().prop_map(Some)], 1..3),
        ],
        prop_oneof![
            2 => Just(Vec::new()),
            2 => prop::collection::vec(annotation(), 1..3),
        ],
    )
        .prop_map(|(ns, init, app, annotations)| Request {
            ns,
            init,
            app,
            annotations,
        })
}

fn uuid(node: usize, gpu: usize) -> String {
    format!("GPU-n{node}-{gpu}")
}

fn node_record(i: usize, spec: &NodeSpec) -> NodeRecord {
    let name = format!("n{i}");
    let devices: Vec<NodeDevice> = spec
        .gpus
        .iter()
        .enumerate()
        .map(|(g, s)| NodeDevice {
            id: uuid(i, g),
            index: g as u32,
            count: s.count,
            devmem: s.mem,
            devcore: s.core,
            device_type: TYPES[s.ty].to_owned(),
            numa: s.numa,
            mode: if s.mig { "mig" } else { "hami-core" }.to_owned(),
            // MIG GPUs register A100-40GB-like profiles (contract §6.4), so that MIG requests
            // fit, fill placements and get refused (`CardMigTopologyInfeasible`) on both paths.
            mig_profiles: if s.mig {
                hami_contract::mig::encode_profiles(
                    &tessera_scheduler_core::fixtures::a100_mig_profiles(),
                )
            } else {
                Vec::new()
            },
            health: s.health,
        })
        .collect();
    let cordoned = spec
        .gpus
        .iter()
        .enumerate()
        .filter(|(_, s)| s.cordoned)
        .map(|(g, _)| uuid(i, g))
        .collect();
    let topology = spec.topology.then(|| {
        let ids: Vec<String> = (0..spec.gpus.len()).map(|g| uuid(i, g)).collect();
        ids.iter()
            .enumerate()
            .map(|(a, ua)| {
                let row: HashMap<String, i64> = ids
                    .iter()
                    .enumerate()
                    .filter(|(b, _)| *b != a)
                    .map(|(b, ub)| (ub.clone(), ((a * 7 + b * 3) % 5) as i64))
                    .collect();
                (ua.clone(), row)
            })
            .collect()
    });
    NodeRecord {
        name,
        devices,
        cordoned,
        topology,
        unregistered: spec
            .unregistered
            .then(|| "node unregistered: test".to_owned()),
        exact_identity: spec.exact_identity,
        hami_plugin: spec.hami_plugin,
        hami_lock: None,
    }
}

fn allocation(node: usize, b: &Booking, spec: &NodeSpec) -> Option<String> {
    let n = spec.gpus.len();
    if n == 0 {
        return None;
    }
    let mut gpus: Vec<usize> = b.gpus.iter().map(|g| g % n).collect();
    gpus.dedup();
    let devices: Vec<String> = gpus
        .iter()
        .map(|g| format!("{},NVIDIA,{},{}", uuid(node, *g), b.mem, b.cores))
        .collect();
    Some(format!("{}:;", devices.join(":")))
}

/// A pod `(namespace, name, uid)` on `node` with the allocation `alloc`.
fn pod_object(
    (ns, name, uid): (&str, &str, &str),
    node: &str,
    alloc: &str,
    bind_phase: Option<&str>,
    bound: bool,
    phase: &str,
) -> Pod {
    let mut annotations = serde_json::Map::new();
    annotations.insert("hami.io/vgpu-node".into(), json!(node));
    annotations.insert("hami.io/vgpu-devices-allocated".into(), json!(alloc));
    if let Some(p) = bind_phase {
        annotations.insert("hami.io/bind-phase".into(), json!(p));
    }
    let mut spec = json!({"containers": [{"name": "main", "image": "app"}]});
    if bound {
        spec["nodeName"] = json!(node);
    }
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": ns, "uid": uid, "annotations": annotations},
        "spec": spec,
        "status": {"phase": phase},
    }))
    .expect("pod")
}

fn book(state: &mut ClusterState, nodes: &[NodeSpec], i: usize, b: &Booking, uid: &str) {
    let node = b.node % nodes.len();
    let Some(alloc) = allocation(node, b, &nodes[node]) else {
        return;
    };
    let ns = NAMESPACES[b.ns];
    let name = format!("p{i}");
    let node_name = format!("n{node}");
    // Kinds 0-3 and 7 are pods as the informer shows them: (bind-phase, bound, phase).
    let informer = match b.kind {
        0 => Some((Some("success"), true, "Running")),
        1 => Some((Some("allocating"), true, "Pending")),
        2 => Some((None, false, "Pending")),
        3 => Some((Some("success"), true, "Succeeded")),
        7 => Some((Some("failed"), false, "Pending")),
        _ => None,
    };
    match (informer, b.kind) {
        (Some((bind_phase, bound, phase)), _) => state.upsert_pod(&pod_object(
            (ns, &name, uid),
            &node_name,
            &alloc,
            bind_phase,
            bound,
            phase,
        )),
        (None, k) => {
            let devices = PodDevices::decode(&alloc).expect("allocation");
            let nvidia = devices.of_vendor(hami_contract::NVIDIA_VENDOR);
            state.reserve(Reservation {
                uid: uid.to_owned(),
                namespace: ns.to_owned(),
                name,
                node: node_name,
                usage: collapse_pod_usage(&nvidia, 0, false),
                signature: AllocationSignature::new(&devices, &BTreeMap::new()),
                mig: Vec::new(),
                devices,
                stage: match k {
                    4 => BindStage::Decided,
                    5 => BindStage::Binding,
                    _ => BindStage::Bound,
                },
                created_tick: 0,
            });
        }
    }
}

fn container_json(name: &str, c: &Option<Container>) -> serde_json::Value {
    let mut limits = serde_json::Map::new();
    if let Some(c) = c {
        limits.insert("nvidia.com/gpu".into(), json!(c.nums.to_string()));
        if c.mem > 0 {
            limits.insert("nvidia.com/gpumem".into(), json!(c.mem.to_string()));
        }
        if let Some(p) = c.pct {
            limits.insert("nvidia.com/gpumem-percentage".into(), json!(p.to_string()));
        }
        if let Some(cores) = c.cores {
            limits.insert("nvidia.com/gpucores".into(), json!(cores.to_string()));
        }
    }
    json!({"name": name, "image": "app", "resources": {"limits": limits}})
}

fn request_pod(r: &Request, name: &str) -> Pod {
    let annotations: serde_json::Map<String, serde_json::Value> = r
        .annotations
        .iter()
        .map(|(k, v)| ((*k).to_owned(), json!(v)))
        .collect();
    let containers: Vec<serde_json::Value> = r
        .app
        .iter()
        .enumerate()
        .map(|(i, c)| container_json(&format!("c{i}"), c))
        .collect();
    let mut spec = json!({ "containers": containers });
    if let Some(init) = &r.init {
        spec["initContainers"] = json!([container_json("init", &Some(init.clone()))]);
    }
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": NAMESPACES[r.ns], "uid": format!("uid-{name}"),
                     "annotations": annotations},
        "spec": spec,
    }))
    .expect("request pod")
}

fn quota(ns: &str, mem: Option<u64>, count: Option<u64>) -> ResourceQuota {
    let mut hard = serde_json::Map::new();
    if let Some(m) = mem {
        hard.insert("limits.nvidia.com/gpumem".into(), json!(m.to_string()));
    }
    if let Some(c) = count {
        hard.insert("limits.nvidia.com/gpu".into(), json!(c.to_string()));
    }
    serde_json::from_value(json!({
        "metadata": {"namespace": ns, "name": "gpu"},
        "spec": {"hard": hard},
    }))
    .expect("quota")
}

#[derive(Debug, Clone)]
struct Scenario {
    nodes: Vec<NodeSpec>,
    bookings: Vec<Booking>,
    /// `(memory limit, count limit)` of namespace `ns-a`.
    quota: Option<(Option<u64>, Option<u64>)>,
    /// Candidate positions (the last position names a node the cluster does not have).
    candidates: Vec<usize>,
    requests: Vec<Request>,
    /// After each placement: reserve it (else leave the state as it is).
    reserve: Vec<bool>,
    /// The first request's pod already has a booking (its earlier decision).
    own_booking: Option<Booking>,
    avoid_decided: bool,
    /// Before each request after the first: remove this node (and register it again when
    /// `true`), and remove this booking's pod.
    churn: Vec<(usize, bool, usize)>,
}

fn scenario() -> impl Strategy<Value = Scenario> {
    (
        prop::collection::vec(node_spec(), 1..7),
        prop::collection::vec(booking(), 0..14),
        prop_oneof![
            2 => Just(None),
            1 => (
                prop_oneof![Just(None), (0u64..30000).prop_map(Some)],
                prop_oneof![Just(None), (0u64..6).prop_map(Some)],
            )
                .prop_map(Some),
        ],
        prop::collection::vec(0usize..8, 0..12),
        prop::collection::vec(request(), 1..4),
        prop::collection::vec(any::<bool>(), 4),
        prop_oneof![3 => Just(None), 1 => booking().prop_map(Some)],
        any::<bool>(),
        prop::collection::vec((0usize..10, any::<bool>(), 0usize..16), 3),
    )
        .prop_map(
            |(
                nodes,
                bookings,
                quota,
                candidates,
                requests,
                reserve,
                own_booking,
                avoid_decided,
                churn,
            )| {
                Scenario {
                    nodes,
                    bookings,
                    quota,
                    candidates,
                    requests,
                    reserve,
                    own_booking,
                    avoid_decided,
                    churn,
                }
            },
        )
}

fn run(s: &Scenario) -> Result<(), TestCaseError> {
    let cfg = DecisionConfig::default();
    let keys = QuotaKeys::new(&cfg.nvidia.resources, cfg.nvidia.effective_memory_factor());
    let mut state = ClusterState::new();
    for (i, n) in s.nodes.iter().enumerate() {
        state.upsert_node(node_record(i, n));
    }
    for (i, b) in s.bookings.iter().enumerate() {
        book(&mut state, &s.nodes, i, b, &format!("uid-p{i}"));
    }
    if let Some(b) = &s.own_booking {
        book(&mut state, &s.nodes, 99, b, "uid-r0");
    }
    if let Some((mem, count)) = s.quota {
        state.upsert_quota(&quota("ns-a", mem, count), &keys);
    }
    let candidates: Vec<String> = s
        .candidates
        .iter()
        .map(|c| {
            if *c < s.nodes.len() {
                format!("n{c}")
            } else {
                "ghost".to_owned()
            }
        })
        .collect();
    let all: Vec<String> = (0..s.nodes.len()).map(|i| format!("n{i}")).collect();
    for (i, r) in s.requests.iter().enumerate() {
        if i > 0 {
            let (node, again, pod) = s.churn[(i - 1) % s.churn.len()];
            if node < s.nodes.len() {
                state.remove_node(&format!("n{node}"));
                if again {
                    state.upsert_node(node_record(node, &s.nodes[node]));
                }
            }
            state.remove_pod(&format!("uid-p{pod}"));
        }
        let name = format!("r{i}");
        let pod = request_pod(r, &name);
        let uid = format!("uid-{name}");
        for names in [&candidates, &all] {
            let pruned = filter_pod_with(&mut state, &cfg, &pod, &uid, names, s.avoid_decided);
            let full = filter_pod_unpruned(&mut state, &cfg, &pod, &uid, names, s.avoid_decided);
            prop_assert_eq!(&pruned, &full, "request {} over {:?}", i, names);
        }
        let v = filter_pod_with(&mut state, &cfg, &pod, &uid, &all, s.avoid_decided);
        check_unresolvable(s, &cfg, &pod, &uid, &v)?;
        if let Verdict::Placed(p) = &v
            && s.reserve[i % s.reserve.len()]
        {
            state.reserve(tessera_scheduler_core::decide::reservation_for(
                &pod, &uid, p, 1,
            ));
        }
    }
    Ok(())
}

/// Issue 30 item 3: of the nodes a pod fits nowhere on, exactly those it would not fit with
/// every pod gone (the node alone in a cluster, no quota) are beyond preemption. Nodes kube-
/// scheduler does not know as registered GPU nodes and pending conflicts are left out; a node
/// with a `mig` GPU only needs to be right when it is marked.
fn check_unresolvable(
    s: &Scenario,
    cfg: &DecisionConfig,
    pod: &Pod,
    uid: &str,
    v: &Verdict,
) -> Result<(), TestCaseError> {
    use tessera_scheduler_core::decide::NodeFailure;
    let Verdict::NoFit {
        failed,
        unresolvable,
    } = v
    else {
        return Ok(());
    };
    for (name, failure) in failed {
        let Some(i) = name.strip_prefix('n').and_then(|x| x.parse::<usize>().ok()) else {
            continue;
        };
        let marked = unresolvable.contains(name);
        if !matches!(failure, NodeFailure::Fit(_))
            || s.nodes[i].unregistered
            || (s.nodes[i].gpus.iter().any(|g| g.mig) && !marked)
        {
            continue;
        }
        let mut alone = ClusterState::new();
        alone.upsert_node(node_record(i, &s.nodes[i]));
        let fits_alone = matches!(
            filter_pod_unpruned(&mut alone, cfg, pod, uid, std::slice::from_ref(name), false),
            Verdict::Placed(_)
        );
        prop_assert_eq!(
            fits_alone,
            !marked,
            "node {} ({}): fits with no pod on it: {}, marked beyond preemption: {}",
            name,
            failure,
            fits_alone,
            marked
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// The pruned filter and the full evaluation of every candidate give the same verdict.
    #[test]
    fn pruned_filter_equals_the_full_evaluation(s in scenario()) {
        run(&s)?;
    }
}

fn gpu_state() -> impl Strategy<Value = GpuState> {
    (gpu_spec(), 0u32..6, 0u32..17000, 0u32..120, any::<bool>()).prop_map(
        |(s, used, usedmem, usedcores, cordon_me)| GpuState {
            uuid: if cordon_me {
                "C".to_owned()
            } else {
                "U".to_owned()
            },
            index: 0,
            count: s.count,
            totalmem: s.mem,
            totalcore: s.core,
            device_type: TYPES[s.ty].to_owned(),
            numa: s.numa,
            mode: if s.mig { "mig" } else { "hami-core" }.to_owned(),
            health: s.health,
            used,
            usedmem,
            usedcores: usedcores.min(s.core.max(1)),
            mig: s.mig.then(|| {
                let mut in_use = Vec::new();
                // Some placements already in use, from the unused numbers.
                for start in [0u32, 2, 4, 6] {
                    if used & (1 << (start / 2)) != 0 {
                        in_use.push(hami_contract::mig::MigAllocation {
                            gpu_uuid: "x".into(),
                            profile: "1g.5gb".into(),
                            placement: hami_contract::mig::MigPlacement { start, size: 1 },
                            ..Default::default()
                        });
                    }
                }
                Box::new(fit::MigGpu {
                    profiles: tessera_scheduler_core::fixtures::a100_mig_profiles(),
                    in_use,
                })
            }),
        },
    )
}

fn policy() -> impl Strategy<Value = Vec<GpuPolicyKey>> {
    prop_oneof![
        Just(vec![]),
        Just(vec![GpuPolicyKey::Binpack]),
        Just(vec![GpuPolicyKey::Spread]),
        Just(vec![GpuPolicyKey::Mutex]),
        Just(vec![GpuPolicyKey::TopologyAware]),
        Just(vec![GpuPolicyKey::Numa, GpuPolicyKey::Binpack]),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

    /// On one node: the quick check answers exactly what `evaluate_picks` answers (fit or the
    /// same reason), for every request it accepts; it refuses the ones it cannot answer.
    #[test]
    fn quick_check_equals_evaluate_picks(
        gpus in prop::collection::vec(gpu_state(), 0..6),
        cordon in any::<bool>(),
        nums in prop_oneof![4 => Just(1u32), 1 => 0u32..3],
        memreq in prop_oneof![Just(0u32), 1u32..17000],
        pct in prop_oneof![Just(fit::MEM_PERCENTAGE_UNSET), 0u32..101],
        cores in 0u32..120,
        two in proptest::bool::weighted(0.1),
        init in proptest::bool::weighted(0.1),
        policy in policy(),
        numa_bind in proptest::bool::weighted(0.1),
        use_type in proptest::bool::weighted(0.1),
        quota in prop_oneof![
            2 => Just(None),
            1 => (0u64..20000, 0u64..20000, 0u64..3).prop_map(|(l, u, c)| Some(QuotaBudget {
                mem_limit: Some(l),
                cores_limit: (c > 0).then_some(150),
                count_limit: Some(c),
                used_mem: u,
                used_cores: 0,
                used_count: 0,
            })),
        ],
    ) {
        let node = NodeState {
            name: "n".to_owned(),
            gpus,
            cordoned: if cordon { HashSet::from(["C".to_owned()]) } else { HashSet::new() },
            topology: None,
        };
        let req = gpu_request(nums, memreq, pct, cores);
        let mut ask = PodAsk { init: vec![], app: vec![Some(req.clone()), None] };
        if two {
            ask.app.push(Some(req.clone()));
        }
        if init {
            ask.init.push(Some(req));
        }
        let mut opts = PlacementOptions { gpu_policy: policy, ..Default::default() };
        opts.selectors.numa_bind = numa_bind;
        if use_type {
            opts.selectors.use_type = vec!["t4".to_owned()];
        }
        let mask = fit::nvidia_mask(&node.gpus);
        let full = fit::evaluate_picks(&node, Some(&mask), &ask, &opts, quota.as_ref()).map(|_| ());
        let quick = QuickAsk::new(&ask, &opts);
        let expect_quick = nums == 1 && !two && !init && !numa_bind && !use_type
            && !opts.gpu_policy.contains(&GpuPolicyKey::TopologyAware);
        prop_assert_eq!(quick.is_some(), expect_quick);
        if let Some(q) = quick {
            let summary = NodeSummary::new(&node, &mask);
            prop_assert_eq!(summary.score.to_bits(), fit::node_score(&node.gpus).to_bits());
            prop_assert_eq!(q.check(&summary, quota.as_ref()), full);
        }
    }
}

/// With `--filter-threads`, large candidate lists are split across threads: the quick path
/// merges them into the same verdict as one sequential full pass.
#[test]
fn threaded_pruned_filter_equals_the_sequential_full_evaluation() {
    let mut state = ClusterState::new();
    let nodes: Vec<NodeSpec> = (0..900)
        .map(|i| NodeSpec {
            gpus: (0..(i % 5))
                .map(|g| GpuSpec {
                    count: [4, 1, 2][(i + g) % 3] as u32,
                    mem: [8000, 16000][(i / 3 + g) % 2],
                    core: [100, 100, 50][(i + 2 * g) % 3],
                    ty: usize::from((i * 7 + g) % 11 == 0),
                    mig: (i * 13 + g) % 17 == 0,
                    health: (i + g) % 19 != 0,
                    numa: (g % 2) as u32,
                    cordoned: (i * 3 + g) % 23 == 0,
                })
                .collect(),
            unregistered: i % 31 == 0,
            exact_identity: false,
            hami_plugin: false,
            topology: false,
        })
        .collect();
    for (i, n) in nodes.iter().enumerate() {
        state.upsert_node(node_record(i, n));
    }
    for i in 0..2000usize {
        let b = Booking {
            node: (i * 37) % nodes.len(),
            gpus: vec![i % 4],
            mem: [1000, 3000, 6000][i % 3],
            cores: [10, 30, 0][i % 3],
            kind: [0, 0, 0, 1, 2, 4][i % 6],
            ns: i % 2,
        };
        book(&mut state, &nodes, i, &b, &format!("uid-p{i}"));
    }
    let names: Vec<String> = (0..nodes.len())
        .rev()
        .map(|i| format!("n{i}"))
        .chain(["ghost".to_owned()])
        .collect();
    // Every reason kept, so the pruned and threaded passes are compared on them too.
    let sequential = DecisionConfig {
        reasons_when_placed: true,
        ..DecisionConfig::default()
    };
    let threaded = DecisionConfig {
        filter_threads: 3,
        ..sequential.clone()
    };
    let mut placed_with_failures = 0;
    for (mem, cores, policy) in [
        (2000, 10, None),
        (7000, 60, Some("spread")),
        (500, 100, None),
        (15000, 0, Some("spread")),
    ] {
        let mut annotations = Vec::new();
        if let Some(p) = policy {
            annotations.push((
                hami_contract::annotations::NODE_SCHEDULER_POLICY,
                p.to_owned(),
            ));
        }
        let r = Request {
            ns: 0,
            init: None,
            app: vec![Some(Container {
                nums: 1,
                mem,
                pct: None,
                cores: Some(cores),
            })],
            annotations,
        };
        let pod = request_pod(&r, "t");
        for avoid in [false, true] {
            let full = filter_pod_unpruned(&mut state, &sequential, &pod, "uid-t", &names, avoid);
            if let Verdict::Placed(p) = &full {
                placed_with_failures += usize::from(
                    p.fitting.len() > 256
                        && p.failed.len() > 256
                        && p.failed_count == p.failed.len(),
                );
            }
            let pruned = filter_pod_with(&mut state, &threaded, &pod, "uid-t", &names, avoid);
            assert_eq!(pruned, full, "mem {mem} cores {cores} policy {policy:?}");
            let pruned = filter_pod_with(&mut state, &sequential, &pod, "uid-t", &names, avoid);
            assert_eq!(pruned, full);
        }
    }
    // The cluster has both many fitting and many refusing nodes for most requests.
    assert!(placed_with_failures >= 4, "{placed_with_failures}");
}

//! Table tests for HAMi's Fit/score rules (contract §5.2–§5.5) and the over-booking property.

use std::collections::HashMap;

use hami_contract::policy::PodSchedulingOptions;
use proptest::prelude::*;
use tessera_scheduler_core::fit::{
    self, Charge, GpuPolicyKey, GpuState, NodePolicyKey, NodeState, PlacementOptions, PodAsk,
    QuotaBudget, gpu_request,
};

const UNSET: u32 = fit::MEM_PERCENTAGE_UNSET;

fn gpu(uuid: &str, index: u32, numa: u32) -> GpuState {
    GpuState {
        uuid: uuid.to_owned(),
        index,
        count: 10,
        totalmem: 16000,
        totalcore: 100,
        device_type: "NVIDIA-Tesla T4".to_owned(),
        numa,
        mode: "hami-core".to_owned(),
        health: true,
        used: 0,
        usedmem: 0,
        usedcores: 0,
        mig: None,
    }
}

fn node(gpus: Vec<GpuState>) -> NodeState {
    NodeState {
        name: "node1".to_owned(),
        gpus,
        ..Default::default()
    }
}

fn opts(policy: &[GpuPolicyKey]) -> PlacementOptions {
    PlacementOptions {
        gpu_policy: policy.to_vec(),
        ..Default::default()
    }
}

fn with(f: impl FnOnce(&mut PodSchedulingOptions)) -> PlacementOptions {
    let mut o = opts(&[GpuPolicyKey::Spread]);
    f(&mut o.selectors);
    o
}

fn one(nums: u32, mem: u32, pct: u32, cores: u32) -> PodAsk {
    PodAsk {
        init: vec![],
        app: vec![Some(gpu_request(nums, mem, pct, cores))],
    }
}

fn eval(n: &NodeState, ask: &PodAsk, o: &PlacementOptions) -> Result<String, String> {
    fit::evaluate_node(n, ask, o, None)
        .map(|f| f.devices.encode())
        .map_err(|e| e.to_string())
}

#[test]
fn spread_takes_the_least_used_card_and_binpack_the_most_used() {
    let mut used = gpu("GPU-a", 0, 0);
    used.used = 1;
    used.usedmem = 4000;
    let n = node(vec![used, gpu("GPU-b", 1, 0)]);
    let ask = one(1, 1000, UNSET, 10);
    assert_eq!(
        eval(&n, &ask, &opts(&[GpuPolicyKey::Spread])).unwrap(),
        "GPU-b,NVIDIA,1000,10:;"
    );
    assert_eq!(
        eval(&n, &ask, &opts(&[GpuPolicyKey::Binpack])).unwrap(),
        "GPU-a,NVIDIA,1000,10:;"
    );
}

#[test]
fn equal_cards_are_tried_from_the_end_of_the_sorted_list() {
    // Go's sort is stable at this size, so ties keep the list's order, and Fit walks from the end.
    let n = node(vec![gpu("GPU-a", 0, 0), gpu("GPU-b", 1, 0)]);
    assert_eq!(
        eval(&n, &one(1, 1000, UNSET, 0), &opts(&[GpuPolicyKey::Spread])).unwrap(),
        "GPU-b,NVIDIA,1000,0:;"
    );
}

#[test]
fn equal_cards_keep_the_register_order_not_the_index_order() {
    // The register annotation lists index 1 before index 0. A single policy has no index key,
    // so HAMi keeps the listed order and takes the last listed card: index 0.
    let n = node(vec![gpu("GPU-one", 1, 0), gpu("GPU-zero", 0, 0)]);
    for policy in [GpuPolicyKey::Spread, GpuPolicyKey::Binpack] {
        assert_eq!(
            eval(&n, &one(1, 1000, UNSET, 0), &opts(&[policy])).unwrap(),
            "GPU-zero,NVIDIA,1000,0:;",
            "{policy:?}"
        );
    }
    // A comma chain ends on the device index (`lessByChain`): index 1 sorts last.
    assert_eq!(
        eval(
            &n,
            &one(1, 1000, UNSET, 0),
            &opts(&[GpuPolicyKey::Spread, GpuPolicyKey::Numa])
        )
        .unwrap(),
        "GPU-one,NVIDIA,1000,0:;"
    );
}

#[test]
fn device_scores_are_float32_so_nearly_equal_cards_tie_as_in_hami() {
    // 81,921 and 81,920 MiB cards score the same in f32 for a small request (they differ in f64),
    // so the stable sort keeps the listed order and spread takes the second listed card; with
    // f64 scores the larger card would sort last and be taken.
    let mut a = gpu("GPU-a", 0, 0);
    a.totalmem = 81921;
    let mut b = gpu("GPU-b", 1, 0);
    b.totalmem = 81920;
    let req = gpu_request(1, 10, UNSET, 0);
    let w = fit::Weights::default();
    assert_eq!(
        fit::device_score(&a, &req, w),
        fit::device_score(&b, &req, w)
    );
    let n = node(vec![a, b]);
    assert_eq!(
        eval(&n, &one(1, 10, UNSET, 0), &opts(&[GpuPolicyKey::Spread])).unwrap(),
        "GPU-b,NVIDIA,10,0:;"
    );
}

#[test]
fn a_later_app_container_starts_from_the_order_the_one_before_left() {
    // HAMi sorts one device list in place per app container. Here the first container (4000 MiB)
    // sorts Y before X; for the second (1000 MiB) X and Y tie, so they stay in that order, and
    // binpack, after the full card Z, takes X. Sorting afresh from the register order would
    // give Y.
    let card = |uuid: &str, index: u32, totalmem: u32, used: u32, usedmem: u32| {
        let mut g = gpu(uuid, index, 0);
        (g.totalmem, g.used, g.usedmem) = (totalmem, used, usedmem);
        g
    };
    let n = node(vec![
        card("GPU-x", 0, 10000, 1, 500),
        card("GPU-y", 1, 20000, 1, 2000),
        card("GPU-z", 2, 9500, 5, 5000),
    ]);
    let ask = PodAsk {
        init: vec![],
        app: vec![
            Some(gpu_request(1, 4000, UNSET, 0)),
            Some(gpu_request(1, 1000, UNSET, 0)),
        ],
    };
    assert_eq!(
        eval(&n, &ask, &opts(&[GpuPolicyKey::Binpack])).unwrap(),
        "GPU-z,NVIDIA,4000,0:;GPU-x,NVIDIA,1000,0:;"
    );
}

/// (name, how to prepare the card, request, options, expected reason)
type Case = (
    &'static str,
    Box<dyn Fn(&mut GpuState)>,
    PodAsk,
    PlacementOptions,
    &'static str,
);

#[test]
fn every_card_reason_is_reported_in_hami_format() {
    let cases: Vec<Case> = vec![
        (
            "unhealthy",
            Box::new(|g| g.health = false),
            one(1, 1000, UNSET, 0),
            opts(&[]),
            "1/1 CardNotHealth",
        ),
        (
            "time slicing",
            Box::new(|g| {
                g.count = 2;
                g.used = 2
            }),
            one(1, 1000, UNSET, 0),
            opts(&[]),
            "1/1 CardTimeSlicingExhausted",
        ),
        (
            "memory",
            Box::new(|g| g.usedmem = 15500),
            one(1, 1000, UNSET, 0),
            opts(&[]),
            "1/1 CardInsufficientMemory",
        ),
        (
            "cores",
            Box::new(|g| {
                g.used = 1;
                g.usedcores = 80
            }),
            one(1, 1000, UNSET, 30),
            opts(&[]),
            "1/1 CardInsufficientCore",
        ),
        (
            "exclusive 100 cores on a used card",
            Box::new(|g| {
                g.used = 1;
                g.usedcores = 0
            }),
            one(1, 1000, UNSET, 100),
            opts(&[]),
            "1/1 ExclusiveDeviceAllocateConflict",
        ),
        (
            "mutex on a used card",
            Box::new(|g| g.used = 1),
            one(1, 1000, UNSET, 0),
            opts(&[GpuPolicyKey::Mutex]),
            "1/1 ExclusiveDeviceAllocateConflict",
        ),
        (
            "compute units exhausted",
            Box::new(|g| {
                g.used = 1;
                g.usedcores = 100
            }),
            one(1, 1000, UNSET, 0),
            opts(&[]),
            "1/1 CardComputeUnitsExhausted",
        ),
        (
            "type",
            Box::new(|_| {}),
            one(1, 1000, UNSET, 0),
            with(|s| s.use_type = vec!["A100".into()]),
            "1/1 CardTypeMismatch",
        ),
        (
            "nouse type",
            Box::new(|_| {}),
            one(1, 1000, UNSET, 0),
            with(|s| s.nouse_type = vec!["t4".into()]),
            "1/1 CardTypeMismatch",
        ),
        (
            "vgpu-mode",
            Box::new(|_| {}),
            one(1, 1000, UNSET, 0),
            with(|s| s.vgpu_mode = Some("mig".into())),
            "1/1 CardTypeMismatch",
        ),
        (
            "uuid",
            Box::new(|_| {}),
            one(1, 1000, UNSET, 0),
            with(|s| s.use_uuid = vec!["GPU-x".into()]),
            "1/1 CardUuidMismatch",
        ),
        (
            "nouse uuid",
            Box::new(|_| {}),
            one(1, 1000, UNSET, 0),
            with(|s| s.nouse_uuid = vec!["GPU-a".into()]),
            "1/1 CardUuidMismatch",
        ),
        (
            "mig GPU without profiles",
            Box::new(|g| g.mode = "mig".into()),
            one(1, 1000, UNSET, 0),
            opts(&[]),
            "1/1 CardMigTopologyInfeasible",
        ),
    ];
    for (name, prep, ask, o, want) in cases {
        let mut g = gpu("GPU-a", 0, 0);
        prep(&mut g);
        let n = node(vec![g]);
        assert_eq!(eval(&n, &ask, &o), Err(want.to_owned()), "case {name}");
    }
}

#[test]
fn cordoned_cards_are_skipped_and_counted() {
    let mut n = node(vec![gpu("GPU-a", 0, 0), gpu("GPU-b", 1, 0)]);
    n.cordoned = ["GPU-a".to_owned(), "GPU-b".to_owned()]
        .into_iter()
        .collect();
    assert_eq!(
        eval(&n, &one(1, 1000, UNSET, 0), &opts(&[])),
        Err("2/2 CardCordoned".to_owned())
    );
    n.cordoned.remove("GPU-a");
    assert_eq!(
        eval(&n, &one(1, 1000, UNSET, 0), &opts(&[])).unwrap(),
        "GPU-a,NVIDIA,1000,0:;"
    );
}

#[test]
fn node_with_fewer_cards_than_asked_is_node_insufficient_device() {
    let n = node(vec![gpu("GPU-a", 0, 0), gpu("GPU-b", 1, 0)]);
    assert_eq!(
        eval(&n, &one(3, 1000, UNSET, 0), &opts(&[])),
        Err("NodeInsufficientDevice".to_owned())
    );
}

#[test]
fn partial_sets_report_allocated_cards_insufficient_request_sorted() {
    let mut full = gpu("GPU-a", 0, 0);
    full.usedmem = 16000;
    full.used = 1;
    let n = node(vec![full, gpu("GPU-b", 1, 0)]);
    assert_eq!(
        eval(&n, &one(2, 1000, UNSET, 0), &opts(&[])),
        Err("1/2 AllocatedCardsInsufficientRequest, 1/2 CardInsufficientMemory".to_owned())
    );
}

#[test]
fn numa_bind_keeps_a_container_on_one_numa_node() {
    let n = node(vec![gpu("GPU-a", 0, 0), gpu("GPU-b", 1, 1)]);
    let o = with(|s| s.numa_bind = true);
    assert_eq!(
        eval(&n, &one(2, 1000, UNSET, 0), &o),
        Err("1/2 AllocatedCardsInsufficientRequest, 1/2 NumaNotFit".to_owned())
    );
    let n = node(vec![
        gpu("GPU-a", 0, 0),
        gpu("GPU-b", 1, 1),
        gpu("GPU-c", 2, 1),
    ]);
    // Spread + numa-bind sorts NUMA ascending: NUMA 1 cards are tried first.
    assert_eq!(
        eval(&n, &one(2, 1000, UNSET, 0), &o).unwrap(),
        "GPU-c,NVIDIA,1000,0:GPU-b,NVIDIA,1000,0:;"
    );
}

#[test]
fn cores_above_100_are_clamped_and_percentages_resolved_per_card() {
    let n = node(vec![gpu("GPU-a", 0, 0)]);
    assert_eq!(
        eval(&n, &one(1, 0, 50, 150), &opts(&[])).unwrap(),
        "GPU-a,NVIDIA,8000,100:;"
    );
    assert_eq!(
        eval(&n, &one(1, 0, 100, 0), &opts(&[])).unwrap(),
        "GPU-a,NVIDIA,16000,0:;"
    );
}

#[test]
fn app_containers_accumulate_and_init_containers_start_fresh() {
    let n = node(vec![gpu("GPU-a", 0, 0)]);
    let two_app = PodAsk {
        init: vec![],
        app: vec![
            Some(gpu_request(1, 10000, UNSET, 0)),
            Some(gpu_request(1, 10000, UNSET, 0)),
        ],
    };
    assert_eq!(
        eval(&n, &two_app, &opts(&[])),
        Err("1/1 CardInsufficientMemory".to_owned())
    );
    let init_then_app = PodAsk {
        init: vec![Some(gpu_request(1, 10000, UNSET, 0))],
        app: vec![Some(gpu_request(1, 10000, UNSET, 0))],
    };
    assert_eq!(
        eval(&n, &init_then_app, &opts(&[])).unwrap(),
        "GPU-a,NVIDIA,10000,0:;GPU-a,NVIDIA,10000,0:;"
    );
}

#[test]
fn containers_without_gpus_get_aligned_empty_entries() {
    let n = node(vec![gpu("GPU-a", 0, 0)]);
    let ask = PodAsk {
        init: vec![None],
        app: vec![None, Some(gpu_request(1, 1000, UNSET, 30)), None],
    };
    assert_eq!(
        eval(&n, &ask, &opts(&[])).unwrap(),
        ";;GPU-a,NVIDIA,1000,30:;;"
    );
}

#[test]
fn quota_blocks_cards_over_the_namespace_budget() {
    let n = node(vec![gpu("GPU-a", 0, 0)]);
    let q = QuotaBudget {
        mem_limit: Some(4000),
        used_mem: 3500,
        ..Default::default()
    };
    let r = fit::evaluate_node(&n, &one(1, 1000, UNSET, 0), &opts(&[]), Some(&q));
    assert_eq!(
        r.map(|f| f.node).map_err(|e| e.to_string()),
        Err("1/1 ResourceQuotaNotFit".to_owned())
    );
    let zero = QuotaBudget {
        cores_limit: Some(0),
        ..Default::default()
    };
    assert!(fit::evaluate_node(&n, &one(1, 1000, UNSET, 10), &opts(&[]), Some(&zero)).is_err());
    // The pod's own earlier containers count against the budget.
    let q = QuotaBudget {
        mem_limit: Some(1500),
        ..Default::default()
    };
    let two = PodAsk {
        init: vec![],
        app: vec![
            Some(gpu_request(1, 1000, UNSET, 0)),
            Some(gpu_request(1, 1000, UNSET, 0)),
        ],
    };
    assert_eq!(
        fit::evaluate_node(&n, &two, &opts(&[]), Some(&q))
            .map(|f| f.charge)
            .map_err(|e| e.to_string()),
        Err("1/1 ResourceQuotaNotFit".to_owned())
    );
    let ok = fit::evaluate_node(&n, &one(1, 1000, UNSET, 20), &opts(&[]), Some(&q)).unwrap();
    assert_eq!(
        ok.charge,
        Charge {
            mem: 1000,
            cores: 20,
            count: 1
        }
    );
}

#[test]
fn mutex_prefers_idle_cards() {
    let mut a = gpu("GPU-a", 0, 0);
    a.used = 1;
    let n = node(vec![gpu("GPU-b", 1, 0), a]);
    assert_eq!(
        eval(&n, &one(1, 1000, UNSET, 0), &opts(&[GpuPolicyKey::Mutex])).unwrap(),
        "GPU-b,NVIDIA,1000,0:;"
    );
}

fn topology_node() -> NodeState {
    let mut n = node(vec![
        gpu("GPU-a", 0, 0),
        gpu("GPU-b", 1, 0),
        gpu("GPU-c", 2, 0),
        gpu("GPU-d", 3, 0),
    ]);
    let mut t: HashMap<String, HashMap<String, i64>> = HashMap::new();
    let mut set = |x: &str, y: &str, s: i64| {
        t.entry(x.into()).or_default().insert(y.into(), s);
        t.entry(y.into()).or_default().insert(x.into(), s);
    };
    set("GPU-a", "GPU-b", 20);
    set("GPU-a", "GPU-c", 600);
    set("GPU-a", "GPU-d", 20);
    set("GPU-b", "GPU-c", 20);
    set("GPU-b", "GPU-d", 20);
    set("GPU-c", "GPU-d", 10);
    n.topology = Some(t);
    n
}

#[test]
fn topology_aware_picks_the_best_linked_pair_and_the_loneliest_single() {
    let n = topology_node();
    let o = opts(&[GpuPolicyKey::TopologyAware]);
    let pair = eval(&n, &one(2, 1000, UNSET, 0), &o).unwrap();
    assert!(pair.contains("GPU-a") && pair.contains("GPU-c"), "{pair}");
    // Single: the card with the lowest sum of scores to the others (GPU-d: 50; GPU-b: 60).
    assert_eq!(
        eval(&n, &one(1, 1000, UNSET, 0), &o).unwrap(),
        "GPU-d,NVIDIA,1000,0:;"
    );
}

#[test]
fn comma_chains_apply_keys_in_order() {
    // binpack,numa: score ascending first; the used card (higher score) sits last ⇒ first tried.
    let mut a = gpu("GPU-a", 0, 1);
    a.used = 1;
    a.usedmem = 1000;
    let n = node(vec![a, gpu("GPU-b", 1, 0)]);
    assert_eq!(
        eval(
            &n,
            &one(1, 1000, UNSET, 0),
            &opts(&[GpuPolicyKey::Binpack, GpuPolicyKey::Numa])
        )
        .unwrap(),
        "GPU-a,NVIDIA,1000,0:;"
    );
    // numa,spread: NUMA ascending first ⇒ the NUMA 1 card is last ⇒ first tried.
    let n = node(vec![gpu("GPU-a", 0, 1), gpu("GPU-b", 1, 0)]);
    assert_eq!(
        eval(
            &n,
            &one(1, 1000, UNSET, 0),
            &opts(&[GpuPolicyKey::Numa, GpuPolicyKey::Spread])
        )
        .unwrap(),
        "GPU-a,NVIDIA,1000,0:;"
    );
}

#[test]
fn node_policy_binpack_picks_the_fullest_node_and_spread_the_emptiest() {
    let mut busy = node(vec![gpu("GPU-a", 0, 0)]);
    busy.name = "busy".into();
    busy.gpus[0].used = 1;
    busy.gpus[0].usedmem = 8000;
    let mut idle = node(vec![gpu("GPU-b", 0, 0)]);
    idle.name = "idle".into();
    let ask = one(1, 1000, UNSET, 0);
    let mut o = opts(&[]);
    let out = fit::filter([&busy, &idle], &ask, &o, None);
    assert_eq!(out.chosen.map(|f| f.node), Some("busy".to_owned()));
    o.node_policy = NodePolicyKey::Spread;
    let out = fit::filter([&busy, &idle], &ask, &o, None);
    assert_eq!(out.chosen.map(|f| f.node), Some("idle".to_owned()));
}

#[test]
fn node_score_matches_hami_formula() {
    let mut g = gpu("GPU-a", 0, 0);
    g.used = 5;
    g.usedcores = 50;
    g.usedmem = 8000;
    assert!((fit::node_score(&[g]) - 15.0).abs() < 1e-4);
    assert_eq!(fit::node_score(&[]), 0.0);
}

#[test]
fn device_score_uses_the_scoring_weights() {
    let g = gpu("GPU-a", 0, 0);
    let r = gpu_request(1, 8000, UNSET, 50);
    let w = fit::Weights {
        slot: 1,
        core: 0,
        memory: 2,
    };
    // 10 × (1 × 1/10 + 0 + 2 × 8000/16000) = 11
    assert!((fit::device_score(&g, &r, w) - 11.0).abs() < 1e-9);
}

proptest! {
    /// Whatever the requests, no card ever ends up over its count, memory or cores.
    #[test]
    fn no_sequence_of_decisions_overbooks_a_gpu(
        reqs in proptest::collection::vec(
            (1u32..4, 0u32..9000, prop_oneof![Just(UNSET), 1u32..=100], 0u32..130, any::<bool>(), 0usize..3),
            1..40),
        counts in proptest::collection::vec(1u32..5, 4),
        policy in 0usize..4,
    ) {
        let policies = [GpuPolicyKey::Spread, GpuPolicyKey::Binpack, GpuPolicyKey::Mutex, GpuPolicyKey::TopologyAware];
        let mut n = node((0..4).map(|i| { let mut g = gpu(&format!("GPU-{i}"), i, i % 2); g.count = counts[i as usize]; g }).collect());
        let o = opts(&[policies[policy]]);
        for (nums, mem, pct, cores, with_init, extra_app) in reqs {
            let r = gpu_request(nums, mem, pct, cores);
            let ask = PodAsk {
                init: if with_init { vec![Some(r.clone())] } else { vec![] },
                app: std::iter::repeat_n(Some(r), 1 + extra_app).collect(),
            };
            if let Ok(f) = fit::evaluate_node(&n, &ask, &o, None) {
                let usage = hami_contract::usage::collapse_pod_usage(&f.devices, ask.init.len(), false);
                fit::book_pod(&mut n, &usage);
            }
            for g in &n.gpus {
                prop_assert!(g.used <= g.count, "count {} > {}", g.used, g.count);
                prop_assert!(g.usedmem <= g.totalmem, "mem {} > {}", g.usedmem, g.totalmem);
                prop_assert!(g.usedcores <= g.totalcore, "cores {} > {}", g.usedcores, g.totalcore);
            }
        }
    }
}

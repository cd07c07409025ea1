//! Preemption decision latency (issue 30): p50/p99/min/max of one `Engine::preempt` at 1,000
//! nodes × 8 GPUs with 10 running pods per node, every GPU half or wholly taken by pods of
//! priority 0, for a pod of priority 1000 asking 60,000 MiB of one GPU (it fits nowhere; one
//! eviction on any half-taken GPU makes room):
//!
//! * the 100 candidate nodes kube-scheduler v1.34 proposes at this size (10 % of the nodes, at
//!   least 100), and all 1,000 (the most it could propose);
//! * the baseline, in the same run and rounds: `/filter` of a pod that fits (8,192 MiB) over the
//!   same 1,000 nodes, in process.
//!
//! Rounds are interleaved. Run: `cargo bench -p tessera-scheduler --bench preempt_latency`
//! (optional argument: iterations per case, default 500; `TESSERA_BENCH_QUICK=1`: 20). With
//! `TESSERA_BENCH_CSV_DIR` set, rows go to `preempt_latency.csv` there.

use std::collections::BTreeMap;
use tokio::time::Instant;

use k8s_openapi::api::core::v1::Pod;
use tessera_scheduler::engine::{Engine, Observation};
use tessera_scheduler_core::config::DecisionConfig;
use tessera_scheduler_core::decide::Verdict;
use tessera_scheduler_core::fixtures::{gpu_node, gpu_pod, running_pod};
use tessera_scheduler_core::preempt::Victims;

use results::{Csv, Row, Stats};
use tessera_bench_results as results;

const NODES: usize = 1_000;
const PODS_PER_NODE: usize = 10;

fn engine() -> (Engine, Vec<String>) {
    let mut engine = Engine::standalone(DecisionConfig::default());
    let mut names = Vec::with_capacity(NODES);
    for n in 0..NODES {
        let name = format!("node-{n:05}");
        engine.observe(Observation::NodeUpsert(Box::new(gpu_node(
            &name, 8, 81920, 10,
        ))));
        // GPUs 0 and 1 hold two pods of 40,000 MiB (full), the other six one each.
        for p in 0..PODS_PER_NODE {
            let alloc = format!("GPU-{name}-{},NVIDIA,40000,10:;", p % 8);
            let mut pod = running_pod("bench", &format!("{name}-p{p}"), &name, &alloc);
            if let Some(spec) = pod.spec.as_mut() {
                spec.priority = Some(0);
            }
            engine.observe(Observation::PodUpsert(Box::new(pod)));
        }
        names.push(name);
    }
    (engine, names)
}

fn with_priority(mut pod: Pod, priority: i32) -> Pod {
    if let Some(spec) = pod.spec.as_mut() {
        spec.priority = Some(priority);
    }
    pod
}

struct Case {
    name: String,
    samples: Vec<f64>,
    run: Box<dyn FnMut(&mut Engine) -> f64>,
}

fn main() {
    let quick = results::quick();
    let iterations = std::env::args()
        .skip(1)
        .find_map(|a| a.parse::<usize>().ok())
        .unwrap_or(if quick { 20 } else { 500 });
    let rounds = if quick { 2 } else { 5 };
    let per_round = (iterations / rounds).max(1);
    let (mut engine, names) = engine();
    let urgent = with_priority(gpu_pod("bench", "urgent", 1, 60000, 0), 1000);
    let fitting = gpu_pod("bench", "candidate", 1, 8192, 20);
    let proposal = |n: usize| -> BTreeMap<String, Victims> {
        names[..n]
            .iter()
            .map(|name| (name.clone(), Victims::default()))
            .collect()
    };
    let mut cases: Vec<Case> = Vec::new();
    for n in [100, NODES] {
        let proposed = proposal(n);
        let pod = urgent.clone();
        cases.push(Case {
            name: format!("{NODES} nodes x 8 GPUs; 10 pods/node; {n} candidate nodes"),
            samples: Vec::new(),
            run: Box::new(move |engine: &mut Engine| {
                let t = Instant::now();
                let found = engine.preempt(&pod, &proposed, &[]).expect("leader");
                let d = t.elapsed();
                assert_eq!(found.chosen.len(), n, "every node can make room");
                assert!(found.chosen.values().all(|v| v.pods.len() == 1));
                d.as_secs_f64() * 1e6
            }),
        });
    }
    let all = names.clone();
    cases.push(Case {
        name: format!("{NODES} nodes x 8 GPUs; 10 pods/node; /filter of a pod that fits"),
        samples: Vec::new(),
        run: Box::new(move |engine: &mut Engine| {
            let t = Instant::now();
            let v = engine.filter(&fitting, &all);
            engine.filter_abort("uid-bench-candidate");
            let d = t.elapsed();
            assert!(matches!(v, Ok(Verdict::Placed(_))));
            d.as_secs_f64() * 1e6
        }),
    });
    for c in cases.iter_mut() {
        for _ in 0..(per_round / 10).max(1) {
            (c.run)(&mut engine);
        }
    }
    for _ in 0..rounds {
        for c in cases.iter_mut() {
            for _ in 0..per_round {
                let us = (c.run)(&mut engine);
                c.samples.push(us);
            }
        }
    }
    let csv = Csv::open("preempt_latency");
    let baseline = cases
        .last()
        .map(|c| Stats::of(&c.samples).median)
        .unwrap_or(f64::NAN);
    for (i, c) in cases.iter().enumerate() {
        let s = Stats::of(&c.samples);
        let metric = if i + 1 == cases.len() {
            "filter+score in-process (baseline)"
        } else {
            "preempt decision in-process"
        };
        let mut row = Row::new(c.name.clone(), metric, "us", s);
        if i + 1 < cases.len() {
            row = row.baseline(baseline).ratio(s.median / baseline);
        }
        // The goal is for what kube-scheduler sends at this size (100 candidates); 1,000 shows
        // how the cost grows with the candidates.
        if i == 0 {
            row = row.goal("p99 < 10000 us", s.p99 < 10_000.0);
        }
        csv.row(&row);
    }
}

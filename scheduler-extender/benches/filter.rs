//! Filter + score for one pod through the decision loop at 100 / 1,000 / 5,000 nodes × 8 GPUs
//! with 10 running pods per node. Each iteration decides, reserves and releases (the reservation
//! invalidates one node's cached usage, as in production).
//!
//! After criterion's own report, each benchmark's samples (criterion's `sample.json`: mean time
//! per iteration of each of its samples) go to `filter.csv` when `TESSERA_BENCH_CSV_DIR` is set;
//! `TESSERA_BENCH_QUICK=1` measures each for about a second.

use std::path::PathBuf;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion};
use tessera_scheduler::engine::{Engine, Observation};
use tessera_scheduler_core::config::DecisionConfig;
use tessera_scheduler_core::fixtures::{gpu_node, gpu_pod, running_pod};

use results::{Csv, Row, Stats};
use tessera_bench_results as results;

fn cluster(nodes: usize) -> (Engine, Vec<String>) {
    cluster_with(nodes, 1)
}

fn cluster_with(nodes: usize, filter_threads: usize) -> (Engine, Vec<String>) {
    let mut e = Engine::standalone(DecisionConfig {
        filter_threads,
        ..Default::default()
    });
    let mut names = Vec::with_capacity(nodes);
    for n in 0..nodes {
        let name = format!("node-{n:05}");
        e.observe(Observation::NodeUpsert(Box::new(gpu_node(
            &name, 8, 81920, 10,
        ))));
        for p in 0..10 {
            let gpu = p % 8;
            let alloc = format!("GPU-{name}-{gpu},NVIDIA,4096,10:;");
            e.observe(Observation::PodUpsert(Box::new(running_pod(
                "bench",
                &format!("{name}-p{p}"),
                &name,
                &alloc,
            ))));
        }
        names.push(name);
    }
    (e, names)
}

fn filter(c: &mut Criterion) {
    let mut group = c.benchmark_group("filter_one_pod");
    group.sample_size(if results::quick() { 10 } else { 20 });
    for nodes in [100usize, 1_000, 5_000] {
        let (mut engine, names) = cluster(nodes);
        let pod = gpu_pod("bench", "candidate", 1, 8192, 20);
        group.bench_with_input(BenchmarkId::from_parameter(nodes), &nodes, |b, _| {
            b.iter(|| {
                let v = engine.filter(&pod, &names);
                engine.filter_abort("uid-bench-candidate");
                v
            })
        });
    }
    group.finish();
    // The same at 5,000 nodes with `--filter-threads 4`, to measure on real control-plane hardware.
    let mut group = c.benchmark_group("filter_threads_4");
    group.sample_size(if results::quick() { 10 } else { 20 });
    let (mut engine, names) = cluster_with(5_000, 4);
    let pod = gpu_pod("bench", "candidate", 1, 8192, 20);
    group.bench_function("5000", |b| {
        b.iter(|| {
            let v = engine.filter(&pod, &names);
            engine.filter_abort("uid-bench-candidate");
            v
        })
    });
    group.finish();
}

/// Where criterion writes its results (as criterion decides it, minus `cargo metadata`).
fn criterion_home() -> PathBuf {
    if let Some(h) = std::env::var_os("CRITERION_HOME") {
        return PathBuf::from(h);
    }
    if let Some(t) = std::env::var_os("CARGO_TARGET_DIR") {
        return PathBuf::from(t).join("criterion");
    }
    test_paths::manifest_dir().join("../target/criterion")
}

/// Per-iteration times (µs) of each criterion sample of `group/id`.
fn samples(group: &str, id: &str) -> Option<Vec<f64>> {
    let path = criterion_home()
        .join(group)
        .join(id)
        .join("new/sample.json");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).ok()?).ok()?;
    let iters = v["iters"].as_array()?;
    let times = v["times"].as_array()?;
    Some(
        iters
            .iter()
            .zip(times)
            .filter_map(|(i, t)| Some(t.as_f64()? / i.as_f64()? / 1e3))
            .collect(),
    )
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    if results::quick() {
        c = c
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_secs(1));
    }
    filter(&mut c);
    c.final_summary();
    let csv = Csv::open("filter");
    for (group, id, case) in [
        ("filter_one_pod", "100", "100 nodes x 8 GPUs; 10 pods/node"),
        (
            "filter_one_pod",
            "1000",
            "1000 nodes x 8 GPUs; 10 pods/node",
        ),
        (
            "filter_one_pod",
            "5000",
            "5000 nodes x 8 GPUs; 10 pods/node",
        ),
        (
            "filter_threads_4",
            "5000",
            "5000 nodes x 8 GPUs; 10 pods/node; --filter-threads 4",
        ),
    ] {
        match samples(group, id) {
            Some(v) => csv.row(
                &Row::new(
                    case,
                    "filter+score+reserve+release (criterion sample means)",
                    "us",
                    Stats::of(&v),
                )
                .without_p99(),
            ),
            None => eprintln!(
                "no criterion samples for {group}/{id} under {}",
                criterion_home().display()
            ),
        }
    }
}

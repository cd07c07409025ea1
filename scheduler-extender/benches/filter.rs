//! Filter + score for one pod through the decision loop at 100 / 1,000 / 5,000 nodes × 8 GPUs
//! with 10 running pods per node. Each iteration decides, reserves and releases (the reservation
//! invalidates one node's cached usage, as in production).

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use tessera_scheduler::decide::DecisionConfig;
use tessera_scheduler::engine::{Engine, Observation};
use tessera_scheduler::testing::{gpu_node, gpu_pod, running_pod};

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
    group.sample_size(20);
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
    group.sample_size(20);
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

criterion_group!(benches, filter);
criterion_main!(benches);

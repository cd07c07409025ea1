//! `Allocate` latency with the pod already in the informer cache (issue target: p99 < 20 ms).
//! In-memory apiserver edges (no network), real response building and cache-dir creation.
//! Run: `cargo bench -p tessera-node --bench allocate_latency` (rows also go to
//! `allocate_latency.csv` under `TESSERA_BENCH_CSV_DIR`; `TESSERA_BENCH_QUICK=1`: 200 rounds).

use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use hami_contract::annotations as keys;
use kubelet_proto::deviceplugin::v1beta1 as dp;
use tessera_node::allocator::Allocator;
use tessera_node::edges::NoPodResources;
use tessera_node::identity::PodSnapshot;
use tessera_node::testing::{MemoryApi, NODE, bound_pod, response_settings};

use results::{Csv, Row, Stats};
use tessera_bench_results as results;

/// Pod `pod-<i>`: one container on `GPU-<i % 8>` with `1000 + i` MiB, in bind-phase `phase`.
fn pod(i: usize, phase: &str) -> PodSnapshot {
    let gpu = format!("GPU-{}", i % 8);
    let mem = u32::try_from(1000 + i).expect("small");
    let mut pod = bound_pod(NODE, &format!("pod-{i}"), &[&[(&gpu, mem, 30)]], i as u64);
    pod.annotations
        .insert(keys::BIND_PHASE.to_owned(), phase.to_owned());
    if phase == keys::BIND_PHASE_SUCCESS {
        // Served and running: no restarted kubelet asks for it again.
        pod.started_containers = pod.containers.iter().map(|c| c.name.clone()).collect();
    }
    pod
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let hook = tempfile::tempdir().expect("tempdir");
    let api = MemoryApi::default();
    // 110 pods on the node already served: the realistic cache the plugin scans on every call.
    for i in 0..110 {
        api.add_pod(pod(i, keys::BIND_PHASE_SUCCESS));
    }
    let uuids = (0..8).map(|i| format!("GPU-{i}")).collect();
    let allocator = Allocator::new(
        NODE.into(),
        response_settings(hook.path()),
        Arc::new(std::sync::RwLock::new(uuids)),
        Arc::new(api.clone()),
        Arc::new(api.clone()),
        Arc::new(NoPodResources),
    );
    let rounds = if results::quick() { 200 } else { 2000 };
    let mut samples = Vec::with_capacity(rounds);
    for n in 0..rounds {
        let i = 1000 + n;
        api.add_pod(pod(i, keys::BIND_PHASE_ALLOCATING));
        let req = dp::AllocateRequest {
            container_requests: vec![dp::ContainerAllocateRequest {
                devices_ids: vec![format!("GPU-{}-0", i % 8)],
            }],
        };
        let t = Instant::now();
        let resp = rt.block_on(allocator.allocate(req)).expect("allocated");
        samples.push(t.elapsed());
        assert_eq!(
            resp.container_responses[0].envs["CUDA_DEVICE_MEMORY_LIMIT_0"],
            format!("{}m", 1000 + i)
        );
        // Keep the node's pod count steady (a served pod leaves the cache eventually).
        api.remove_pod(&format!("default/pod-{i}"));
    }
    samples.sort();
    let pct = |p: f64| samples[((samples.len() as f64 - 1.0) * p) as usize];
    let mean: Duration = samples.iter().sum::<Duration>() / rounds as u32;
    println!(
        "Allocate (cached pod, 110 other pods on the node, in-memory apiserver): n={rounds} mean={mean:?} p50={:?} p99={:?} max={:?}",
        pct(0.50),
        pct(0.99),
        samples[samples.len() - 1]
    );
    let ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    let s = Stats::of(&ms);
    Csv::open("allocate_latency").row(
        &Row::new(
            "Allocator in process: pod in the informer cache  110 other pods on the node  in-memory API edge",
            "Allocate latency",
            "ms",
            s,
        )
        .goal("p99 < 20 ms", s.p99 < 20.0),
    );
}

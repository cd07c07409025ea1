//! `Allocate` latency with the pod already in the informer cache (issue target: p99 < 20 ms).
//! In-memory apiserver edges (no network), real response building and cache-dir creation.
//! Run: `cargo bench -p tessera-device-plugin --bench allocate_latency` (rows also go to
//! `allocate_latency.csv` under `TESSERA_BENCH_CSV_DIR`; `TESSERA_BENCH_QUICK=1`: 200 rounds).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use hami_contract::annotations as keys;
use kubelet_proto::deviceplugin::v1beta1 as dp;
use tessera_device_plugin::allocator::{
    Allocator, EdgeError, NoPodResources, PodPatcher, PodSource,
};
use tessera_device_plugin::container_env::ResponseSettings;
use tessera_device_plugin::identity::{ContainerSpec, PodSnapshot};

use results::{Csv, Row, Stats};
use tessera_bench_results as results;

#[derive(Clone, Default)]
struct MemoryApi {
    pods: Arc<Mutex<Vec<PodSnapshot>>>,
}

impl PodSource for MemoryApi {
    fn cached(&self) -> Vec<PodSnapshot> {
        self.pods.lock().map(|p| p.clone()).unwrap_or_default()
    }
    fn fresh(&self) -> BoxFuture<'_, Result<Vec<PodSnapshot>, EdgeError>> {
        let pods = self.cached();
        Box::pin(async move { Ok(pods) })
    }
    fn hami_lock(&self) -> Option<String> {
        None
    }
}

impl PodPatcher for MemoryApi {
    fn patch_pod_annotations(
        &self,
        ns: &str,
        name: &str,
        _uid: &str,
        a: BTreeMap<String, String>,
    ) -> BoxFuture<'_, Result<(), EdgeError>> {
        if let Ok(mut pods) = self.pods.lock()
            && let Some(p) = pods
                .iter_mut()
                .find(|p| p.namespace == ns && p.name == name)
        {
            p.annotations.extend(a);
        }
        Box::pin(async { Ok(()) })
    }
    fn release_hami_lock(&self, _: &str, _: &str) -> BoxFuture<'_, Result<(), EdgeError>> {
        Box::pin(async { Ok(()) })
    }
}

fn pod(i: usize, phase: &str) -> PodSnapshot {
    let value = format!("GPU-{},NVIDIA,{},30:;", i % 8, 1000 + i);
    let mut annotations = BTreeMap::new();
    annotations.insert(keys::VGPU_NODE.to_owned(), "node-a".to_owned());
    annotations.insert(keys::DEVICES_TO_ALLOCATE.to_owned(), value.clone());
    annotations.insert(keys::DEVICES_ALLOCATED.to_owned(), value);
    annotations.insert(keys::BIND_PHASE.to_owned(), phase.to_owned());
    annotations.insert(keys::BIND_TIME.to_owned(), i.to_string());
    PodSnapshot {
        namespace: "bench".into(),
        name: format!("pod-{i}"),
        uid: format!("uid-{i}"),
        node_name: Some("node-a".into()),
        scheduler_name: Some("hami-scheduler".into()),
        annotations,
        terminal: false,
        deleting: false,
        init_containers: Vec::new(),
        containers: vec![ContainerSpec {
            name: "main".into(),
            requests_resource: true,
            restartable_init: false,
            disable_control: false,
        }],
    }
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let hook = tempfile::tempdir().expect("tempdir");
    let api = MemoryApi::default();
    // 110 pods on the node already served: the realistic cache the plugin scans on every call.
    api.pods
        .lock()
        .expect("lock")
        .extend((0..110).map(|i| pod(i, keys::BIND_PHASE_SUCCESS)));
    let uuids = (0..8).map(|i| format!("GPU-{i}")).collect();
    let allocator = Allocator::new(
        "node-a".into(),
        ResponseSettings {
            hook_path: hook.path().display().to_string(),
            memory_scaling: 1.0,
            lib_cuda_log_level: "1".into(),
            disable_core_limit: false,
            shim_host_path: "/usr/local/vgpu/libvgpu.so".into(),
            license_present: false,
            cdi_devices: false,
        },
        Arc::new(std::sync::RwLock::new(uuids)),
        Arc::new(api.clone()),
        Arc::new(api.clone()),
        Arc::new(NoPodResources),
    );
    let rounds = if results::quick() { 200 } else { 2000 };
    let mut samples = Vec::with_capacity(rounds);
    for n in 0..rounds {
        let i = 1000 + n;
        api.pods
            .lock()
            .expect("lock")
            .push(pod(i, keys::BIND_PHASE_ALLOCATING));
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
        api.pods
            .lock()
            .expect("lock")
            .retain(|p| p.name != format!("pod-{i}"));
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

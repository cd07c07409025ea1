//! Kubernetes objects for tests, benchmarks and fuzz targets (feature `testing`): a registered GPU
//! node, a pending GPU pod, a pod already running with an allocation, an A100's MIG profiles.

use k8s_openapi::api::core::v1::{Node, Pod};
use serde_json::json;

use crate::config::DecisionConfig;
use crate::state::{ClusterState, NodeRecord};

/// A cluster state holding `nodes` (those that register GPUs) and `pods`, with the default
/// decision config.
pub fn cluster_state(nodes: &[Node], pods: &[Pod]) -> ClusterState {
    let cfg = DecisionConfig::default();
    let mut s = ClusterState::new();
    for n in nodes {
        if let Some(r) = NodeRecord::from_node(n, &cfg) {
            s.upsert_node(r);
        }
    }
    for p in pods {
        s.upsert_pod(p);
    }
    s
}

/// A node registering `gpus` cards of `mem` MiB, `count` replicas each.
pub fn gpu_node(name: &str, gpus: u32, mem: u32, count: u32) -> Node {
    let devices: Vec<serde_json::Value> = (0..gpus)
        .map(|i| {
            json!({"id": format!("GPU-{name}-{i}"), "index": i, "count": count, "devmem": mem,
                   "devcore": 100, "type": "NVIDIA-Tesla T4", "mode": "hami-core", "health": true})
        })
        .collect();
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "annotations": {
            "hami.io/node-nvidia-register": serde_json::to_string(&devices).unwrap_or_default()}},
    }))
    .unwrap_or_default()
}

/// A pending pod asking one container for `nums` GPUs of `mem` MiB and `cores` percent.
pub fn gpu_pod(namespace: &str, name: &str, nums: u32, mem: u32, cores: u32) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "uid": format!("uid-{namespace}-{name}")},
        "spec": {"containers": [{"name": "main", "image": "app", "resources": {"limits": {
            "nvidia.com/gpu": nums.to_string(), "nvidia.com/gpumem": mem.to_string(),
            "nvidia.com/gpucores": cores.to_string()}}}]},
    }))
    .unwrap_or_default()
}

/// A pod already running on `node` with the given allocation annotation.
pub fn running_pod(namespace: &str, name: &str, node: &str, allocated: &str) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "uid": format!("uid-{namespace}-{name}"),
            "annotations": {"hami.io/vgpu-node": node, "hami.io/vgpu-devices-allocated": allocated,
                            "hami.io/bind-phase": "success"}},
        "spec": {"nodeName": node, "containers": [{"name": "main", "image": "app"}]},
        "status": {"phase": "Running"},
    }))
    .unwrap_or_default()
}

/// A100-40GB's MIG profiles as HAMi's device plugin registers them (memory, core, placements).
pub fn a100_mig_profiles() -> Vec<hami_contract::mig::MigProfile> {
    use hami_contract::mig::{MigPlacement, MigProfile};
    let p = |name: &str, memory_mb, core, slice_count, starts: &[u32], size| MigProfile {
        name: name.to_owned(),
        memory_mb,
        core,
        slice_count,
        placements: starts
            .iter()
            .map(|&start| MigPlacement { start, size })
            .collect(),
    };
    vec![
        p("1g.5gb", 4864, 15, 1, &[0, 1, 2, 3, 4, 5, 6], 1),
        p("2g.10gb", 9856, 29, 2, &[0, 2, 4], 2),
        p("3g.20gb", 19968, 43, 3, &[0, 4], 4),
        p("4g.20gb", 19968, 58, 4, &[0], 4),
        p("7g.40gb", 40192, 100, 7, &[0], 8),
    ]
}

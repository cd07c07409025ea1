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

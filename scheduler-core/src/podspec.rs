//! From a Kubernetes Pod to the fit module's inputs, through `hami-contract`'s request resolution
//! and annotation parsing (the codecs live there, not here).

use std::collections::BTreeMap;

use hami_contract::NvidiaConfig;
use hami_contract::policy::{AnnotationError, NodePolicy, PodSchedulingOptions};
use hami_contract::request::{ContainerResources, resolve_pod};
use k8s_openapi::api::core::v1::{Container, Pod};

use crate::fit::{GpuPolicyKey, NodePolicyKey, PlacementOptions, PodAsk, Weights};

/// Daemon-wide defaults (`--gpu-scheduler-policy`, `--node-scheduler-policy`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyDefaults {
    pub gpu: Vec<GpuPolicyKey>,
    pub node: NodePolicyKey,
}

impl Default for PolicyDefaults {
    /// HAMi's chart defaults: GPU `spread`, node `binpack`.
    fn default() -> Self {
        PolicyDefaults {
            gpu: vec![GpuPolicyKey::Spread],
            node: NodePolicyKey::Binpack,
        }
    }
}

impl PolicyDefaults {
    /// Parses the two flag values with the same codec as the pod annotations.
    pub fn parse(gpu: &str, node: &str) -> Result<Self, AnnotationError> {
        let mut annotations = BTreeMap::new();
        annotations.insert(
            hami_contract::annotations::GPU_SCHEDULER_POLICY.to_owned(),
            gpu.to_owned(),
        );
        annotations.insert(
            hami_contract::annotations::NODE_SCHEDULER_POLICY.to_owned(),
            node.to_owned(),
        );
        let o = PodSchedulingOptions::from_annotations(&annotations)?;
        Ok(PolicyDefaults {
            gpu: o
                .gpu_policy
                .map(|c| c.0.iter().map(GpuPolicyKey::from).collect())
                .unwrap_or_else(|| vec![GpuPolicyKey::Spread]),
            node: node_key(o.node_policy),
        })
    }
}

fn node_key(p: Option<NodePolicy>) -> NodePolicyKey {
    match p {
        Some(NodePolicy::Spread) => NodePolicyKey::Spread,
        _ => NodePolicyKey::Binpack,
    }
}

/// The API's view of one container, as `hami-contract` wants it.
pub fn container_resources(c: &Container) -> ContainerResources {
    let quantities =
        |m: Option<&BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>>| {
            m.map(|m| m.iter().map(|(k, v)| (k.clone(), v.0.clone())).collect())
                .unwrap_or_default()
        };
    let resources = c.resources.as_ref();
    ContainerResources {
        name: c.name.clone(),
        limits: quantities(resources.and_then(|r| r.limits.as_ref())),
        requests: quantities(resources.and_then(|r| r.requests.as_ref())),
        env: c
            .env
            .iter()
            .flatten()
            .filter_map(|e| e.value.clone().map(|v| (e.name.clone(), v)))
            .collect(),
    }
}

/// The pod's per-container GPU requests (init containers first) and any resolution warnings.
pub fn pod_ask(pod: &Pod, cfg: &NvidiaConfig) -> (PodAsk, Vec<String>) {
    let spec = pod.spec.as_ref();
    let init: Vec<ContainerResources> = spec
        .and_then(|s| s.init_containers.as_ref())
        .map(|v| v.iter().map(container_resources).collect())
        .unwrap_or_default();
    let app: Vec<ContainerResources> = spec
        .map(|s| s.containers.iter().map(container_resources).collect())
        .unwrap_or_default();
    let resolved = resolve_pod(&init, &app, cfg);
    let conv = |v: &[Option<hami_contract::ContainerDeviceRequest>]| {
        v.iter().map(|r| r.clone().filter(|r| r.nums > 0)).collect()
    };
    let ask = PodAsk {
        init: conv(&resolved.init),
        app: conv(&resolved.app),
    };
    let warnings = resolved.warnings.iter().map(|w| w.to_string()).collect();
    (ask, warnings)
}

/// Placement options from the pod's annotations over the daemon defaults. An invalid
/// annotation (e.g. malformed `hami.io/device-scoring-weights`) is an error, as in HAMi.
pub fn placement_options(
    annotations: &BTreeMap<String, String>,
    defaults: &PolicyDefaults,
) -> Result<PlacementOptions, AnnotationError> {
    let o = PodSchedulingOptions::from_annotations(annotations)?;
    let gpu_policy = o
        .gpu_policy
        .as_ref()
        .map(|c| c.0.iter().map(GpuPolicyKey::from).collect())
        .unwrap_or_else(|| defaults.gpu.clone());
    let node_policy = o.node_policy.map_or(defaults.node, |p| node_key(Some(p)));
    let weights = Weights {
        slot: o.scoring_weights.slot,
        core: o.scoring_weights.core,
        memory: o.scoring_weights.memory,
    };
    Ok(PlacementOptions {
        selectors: o,
        gpu_policy,
        node_policy,
        weights,
    })
}

/// How many init containers the pod's spec has (the first entries of its device list).
pub fn init_container_count(pod: &Pod) -> usize {
    pod.spec
        .as_ref()
        .and_then(|s| s.init_containers.as_ref())
        .map_or(0, Vec::len)
}

/// The scheduler whose pods the extender's pod watch leaves out at the API server (field selector
/// `spec.schedulerName!=default-scheduler`), unless the GPU scheduler is that one (or unnamed:
/// `--scheduler-name ""`, where the webhook leaves GPU pods' scheduler as it is). Most of a mixed
/// cluster's pods are its, and none of them holds a booking of this extender: the webhook hands
/// GPU pods to the GPU scheduler, the extender refuses to book pods of this scheduler
/// ([`outside_pod_watch`]), the booking annotations are the scheduler's and the plugin's alone
/// (the booking-annotations admission policy), and the device plugin serves no other
/// scheduler's pods. `spec.schedulerName` is immutable, so a pod never enters or leaves the
/// watched set.
pub const UNWATCHED_SCHEDULER: &str = "default-scheduler";

/// The field selector of the extender's pod watch for GPU scheduler `scheduler_name`
/// ([`UNWATCHED_SCHEDULER`]); `None`: every pod.
pub fn pod_watch_fields(scheduler_name: &str) -> Option<String> {
    (!scheduler_name.is_empty() && scheduler_name != UNWATCHED_SCHEDULER)
        .then(|| format!("spec.schedulerName!={UNWATCHED_SCHEDULER}"))
}

/// True when `pod` is outside the extender's pod watch ([`pod_watch_fields`]): the state would
/// never see its booking, so the extender must not book it. A pod without a scheduler name (only
/// in tests: the API server defaults it) is inside.
pub fn outside_pod_watch(pod: &Pod, scheduler_name: &str) -> bool {
    pod_watch_fields(scheduler_name).is_some()
        && pod.spec.as_ref().and_then(|s| s.scheduler_name.as_deref()) == Some(UNWATCHED_SCHEDULER)
}

/// `namespace/name` of a pod, for messages and simulate output.
pub fn pod_key(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or("default"),
        pod.metadata.name.as_deref().unwrap_or("")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod_of(scheduler: Option<&str>) -> Pod {
        Pod {
            spec: Some(k8s_openapi::api::core::v1::PodSpec {
                scheduler_name: scheduler.map(str::to_owned),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn the_pod_watch_leaves_out_the_default_schedulers_pods_unless_it_is_the_gpu_scheduler() {
        assert_eq!(
            pod_watch_fields("hami-scheduler").as_deref(),
            Some("spec.schedulerName!=default-scheduler")
        );
        assert_eq!(pod_watch_fields("default-scheduler"), None);
        assert_eq!(pod_watch_fields(""), None);
        assert!(!outside_pod_watch(&pod_of(Some("default-scheduler")), ""));
        assert!(outside_pod_watch(
            &pod_of(Some("default-scheduler")),
            "hami-scheduler"
        ));
        assert!(!outside_pod_watch(
            &pod_of(Some("default-scheduler")),
            "default-scheduler"
        ));
        // Another profile that calls this extender keeps its pods watched.
        assert!(!outside_pod_watch(
            &pod_of(Some("hami-scheduler-qps1000")),
            "hami-scheduler"
        ));
        assert!(!outside_pod_watch(&pod_of(None), "hami-scheduler"));
    }
}

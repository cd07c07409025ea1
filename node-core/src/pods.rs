//! Kubernetes `Pod` → [`PodSnapshot`]: the pure conversion at the edge of the identity logic.

use k8s_openapi::api::core::v1::{Container, Pod};

use crate::identity::{ContainerSpec, PodSnapshot};
use vgpu_region::protocol::env::DISABLE_CONTROL as DISABLE_CONTROL_ENV;

fn container_spec(c: &Container, resource: &str, restartable_init: bool) -> ContainerSpec {
    let requests_resource = c
        .resources
        .as_ref()
        .and_then(|r| r.limits.as_ref())
        .and_then(|l| l.get(resource))
        // Extended resources are integers; anything else the kubelet would refuse, so treat a
        // present but odd value as "requests" to stay conservative.
        .is_some_and(|q| q.0.trim().parse::<i64>().map_or(true, |n| n > 0));
    let disable_control = c
        .env
        .as_ref()
        .and_then(|env| env.iter().find(|e| e.name == DISABLE_CONTROL_ENV))
        .and_then(|e| e.value.as_deref())
        .and_then(hami_contract::node::parse_go_bool)
        .unwrap_or(false);
    ContainerSpec {
        name: c.name.clone(),
        requests_resource,
        restartable_init,
        disable_control,
    }
}

/// Reduces a pod to what the plugin needs; `resource` is the kubelet resource (`nvidia.com/gpu`).
pub fn snapshot(pod: &Pod, resource: &str) -> PodSnapshot {
    let spec = pod.spec.as_ref();
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    PodSnapshot {
        namespace: pod.metadata.namespace.clone().unwrap_or_default(),
        name: pod.metadata.name.clone().unwrap_or_default(),
        uid: pod.metadata.uid.clone().unwrap_or_default(),
        node_name: spec.and_then(|s| s.node_name.clone()),
        scheduler_name: spec.and_then(|s| s.scheduler_name.clone()),
        annotations: pod.metadata.annotations.clone().unwrap_or_default(),
        terminal: matches!(phase, Some("Succeeded" | "Failed")),
        deleting: pod.metadata.deletion_timestamp.is_some(),
        init_containers: spec
            .and_then(|s| s.init_containers.as_ref())
            .map(|cs| {
                cs.iter()
                    .map(|c| {
                        container_spec(c, resource, c.restart_policy.as_deref() == Some("Always"))
                    })
                    .collect()
            })
            .unwrap_or_default(),
        containers: spec
            .map(|s| {
                s.containers
                    .iter()
                    .map(|c| container_spec(c, resource, false))
                    .collect()
            })
            .unwrap_or_default(),
        started_containers: container_statuses(pod)
            .filter(|cs| {
                let ran = |st: Option<&k8s_openapi::api::core::v1::ContainerState>| {
                    st.is_some_and(|st| st.running.is_some() || st.terminated.is_some())
                };
                ran(cs.state.as_ref()) || ran(cs.last_state.as_ref())
            })
            .map(|cs| cs.name.clone())
            .collect(),
        container_ids: container_statuses(pod)
            .filter_map(|cs| {
                let id = cs.container_id.as_deref()?;
                let id = id.split_once("://").map_or(id, |(_, id)| id);
                (!id.is_empty()).then(|| (id.to_owned(), cs.name.clone()))
            })
            .collect(),
        resource_version: pod.metadata.resource_version.clone().unwrap_or_default(),
    }
}

/// The statuses of the pod's init and app containers.
fn container_statuses(
    pod: &Pod,
) -> impl Iterator<Item = &k8s_openapi::api::core::v1::ContainerStatus> {
    pod.status.as_ref().into_iter().flat_map(|s| {
        s.init_container_statuses
            .iter()
            .flatten()
            .chain(s.container_statuses.iter().flatten())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn converts_limits_env_sidecars_and_phase() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1",
                         "annotations": {"hami.io/bind-phase": "allocating"}},
            "spec": {
                "nodeName": "node-a",
                "initContainers": [
                    {"name": "init", "resources": {"limits": {"nvidia.com/gpu": "1"}}},
                    {"name": "side", "restartPolicy": "Always"}
                ],
                "containers": [
                    {"name": "main", "resources": {"limits": {"nvidia.com/gpu": "2"}},
                     "env": [{"name": "CUDA_DISABLE_CONTROL", "value": "true"}]},
                    {"name": "zero", "resources": {"limits": {"nvidia.com/gpu": "0"}}}
                ]
            },
            "status": {"phase": "Failed"}
        }))
        .expect("valid pod");
        let s = snapshot(&pod, "nvidia.com/gpu");
        assert_eq!(s.key(), "ns/p");
        assert!(s.terminal);
        assert!(s.init_containers[0].requests_resource);
        assert!(!s.init_containers[0].restartable_init);
        assert!(s.init_containers[1].restartable_init);
        assert!(s.containers[0].requests_resource && s.containers[0].disable_control);
        assert!(!s.containers[1].requests_resource);
        let names: Vec<_> = s.gpu_containers().iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["init", "main"]);
    }
}

//! Pods as users write them: HAMi's resource names in `limits`, no scheduler name (the webhook
//! sets it).

use k8s_openapi::api::core::v1::Pod;
use serde_json::json;

/// One container's GPU request.
#[derive(Debug, Clone, Copy, Default)]
pub struct GpuRequest {
    pub count: u32,
    pub mem_mib: Option<u64>,
    pub mem_percentage: Option<u32>,
    pub cores: Option<u32>,
}

impl GpuRequest {
    pub fn mem(count: u32, mem_mib: u64) -> GpuRequest {
        GpuRequest {
            count,
            mem_mib: Some(mem_mib),
            ..Default::default()
        }
    }

    /// `count` GPUs with no memory or cores given (whole cards, as HAMi resolves it).
    pub fn whole(count: u32) -> GpuRequest {
        GpuRequest {
            count,
            ..Default::default()
        }
    }

    pub fn with_cores(mut self, cores: u32) -> GpuRequest {
        self.cores = Some(cores);
        self
    }

    fn limits(&self) -> serde_json::Value {
        let mut l = json!({"cpu": "10m", "nvidia.com/gpu": self.count.to_string()});
        if let Some(m) = self.mem_mib {
            l["nvidia.com/gpumem"] = json!(m.to_string());
        }
        if let Some(p) = self.mem_percentage {
            l["nvidia.com/gpumem-percentage"] = json!(p.to_string());
        }
        if let Some(c) = self.cores {
            l["nvidia.com/gpucores"] = json!(c.to_string());
        }
        l
    }
}

/// A single-container GPU pod.
pub fn gpu_pod(namespace: &str, name: &str, req: GpuRequest) -> Pod {
    multi_container_pod(namespace, name, &[req])
}

/// One container per request, named `c0`, `c1`, ….
pub fn multi_container_pod(namespace: &str, name: &str, reqs: &[GpuRequest]) -> Pod {
    let containers: Vec<_> = reqs
        .iter()
        .enumerate()
        .map(|(i, r)| {
            json!({"name": format!("c{i}"), "image": "registry.example/cuda-app:1",
                   "resources": {"limits": r.limits()}})
        })
        .collect();
    from_json(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app": "e2e"}},
        "spec": {"containers": containers, "terminationGracePeriodSeconds": 0},
    }))
}

/// A pod without GPU resources.
pub fn plain_pod(namespace: &str, name: &str) -> Pod {
    from_json(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"containers": [{"name": "main", "image": "registry.example/app:1",
                                 "resources": {"limits": {"cpu": "10m"}}}]},
    }))
}

fn from_json(v: serde_json::Value) -> Pod {
    // The literals above are valid Pods; a failure here is a bug in this file.
    serde_json::from_value(v).unwrap_or_default()
}

/// `spec.nodeName` of a pod, if bound.
pub fn node_of(p: &Pod) -> Option<String> {
    p.spec.as_ref().and_then(|s| s.node_name.clone())
}

pub fn annotation<'a>(p: &'a Pod, key: &str) -> Option<&'a str> {
    p.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .map(String::as_str)
}

/// Deletes every pod of `api`'s namespace and waits until they are all gone.
pub async fn delete_all(api: &kube::Api<Pod>, within: std::time::Duration) -> crate::Result<()> {
    use kube::api::{DeleteParams, ListParams};
    api.delete_collection(&DeleteParams::default(), &ListParams::default())
        .await?;
    crate::eventually(
        "the namespace's pods to be gone",
        within,
        std::time::Duration::from_millis(500),
        || async {
            api.list(&ListParams::default())
                .await
                .ok()
                .filter(|l| l.items.is_empty())
        },
    )
    .await?;
    Ok(())
}

//! The apiserver edges: pod cache + bounded fresh reads, pod annotation patches, HAMi lock
//! release, and the node register annotation loop. Patch bodies are built by pure functions.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::future::BoxFuture;
use hami_contract::annotations as keys;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::{Value, json};
use tokio::sync::watch;

use crate::allocator::{EdgeError, PodPatcher, PodSource};
use crate::identity::PodSnapshot;
use crate::metrics::PluginMetrics;
use crate::pods::snapshot;
use crate::service::DeviceState;

/// `{"metadata":{"annotations":{…}}}`; `None` values delete the key (JSON merge patch null).
pub fn annotations_patch(annotations: &BTreeMap<String, Option<String>>) -> Value {
    let map: serde_json::Map<String, Value> = annotations
        .iter()
        .map(|(k, v)| (k.clone(), v.clone().map_or(Value::Null, Value::String)))
        .collect();
    json!({"metadata": {"annotations": map}})
}

/// The lock release patch: conditional on the node's resourceVersion, so a lock taken by
/// another bind in between is never removed.
pub fn lock_release_patch(resource_version: &str) -> Value {
    json!({"metadata": {"resourceVersion": resource_version, "annotations": {keys::NODE_LOCK: null}}})
}

/// Opt-in node capacity for the memory and cores resources (HAMi #2839): totals over the
/// node's registered GPUs, as a merge patch of the node's status subresource.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CapacityNames {
    /// e.g. `nvidia.com/gpumem` (MiB).
    pub memory: String,
    /// e.g. `nvidia.com/gpucores` (percent per GPU, summed).
    pub cores: String,
}

/// `{"status":{"capacity":{<memory>: "<sum devmem>", <cores>: "<sum devcore>"}}}`.
pub fn capacity_patch(names: &CapacityNames, devices: &[hami_contract::node::NodeDevice]) -> Value {
    let memory: u64 = devices.iter().map(|d| u64::from(d.devmem)).sum();
    let cores: u64 = devices.iter().map(|d| u64::from(d.devcore)).sum();
    json!({"status": {"capacity": {names.memory.clone(): memory.to_string(), names.cores.clone(): cores.to_string()}}})
}

/// True when HAMi's lock value (`<time>,<ns>,<name>`) names this pod.
pub fn lock_names(value: &str, namespace: &str, name: &str) -> bool {
    value.ends_with(&format!(",{namespace},{name}"))
}

/// `<ns>/<name>` from a lock value; `None` for the legacy timestamp-only form.
pub fn lock_holder(value: &str) -> Option<String> {
    let mut parts = value.splitn(3, ',');
    let _time = parts.next()?;
    let ns = parts.next()?;
    let name = parts.next()?;
    (!ns.is_empty() && !name.is_empty()).then(|| format!("{ns}/{name}"))
}

/// Pods on this node from an informer, plus bounded LISTs.
#[derive(Clone)]
pub struct KubePodSource {
    pods: Api<Pod>,
    node_name: String,
    resource: String,
    pod_store: Store<Pod>,
    node_store: Store<Node>,
}

impl std::fmt::Debug for KubePodSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubePodSource")
            .field("node", &self.node_name)
            .finish_non_exhaustive()
    }
}

impl KubePodSource {
    /// Starts the pod and node informers (background tasks that retry with backoff).
    pub fn start(client: kube::Client, node_name: &str, resource: &str) -> Self {
        let pods: Api<Pod> = Api::all(client.clone());
        let nodes: Api<Node> = Api::all(client);
        let (pod_store, pod_writer) = reflector::store();
        let (node_store, node_writer) = reflector::store();
        let pod_cfg = watcher::Config::default().fields(&format!("spec.nodeName={node_name}"));
        let node_cfg = watcher::Config::default().fields(&format!("metadata.name={node_name}"));
        let pod_stream = reflector::reflector(pod_writer, watcher(pods.clone(), pod_cfg))
            .default_backoff()
            .touched_objects();
        tokio::spawn(async move {
            futures::pin_mut!(pod_stream);
            while let Some(ev) = pod_stream.next().await {
                if let Err(e) = ev {
                    tracing::warn!(error = %e, "pod watch error; retrying");
                }
            }
        });
        let node_stream = reflector::reflector(node_writer, watcher(nodes, node_cfg))
            .default_backoff()
            .touched_objects();
        tokio::spawn(async move {
            futures::pin_mut!(node_stream);
            while let Some(ev) = node_stream.next().await {
                if let Err(e) = ev {
                    tracing::warn!(error = %e, "node watch error; retrying");
                }
            }
        });
        KubePodSource {
            pods,
            node_name: node_name.to_owned(),
            resource: resource.to_owned(),
            pod_store,
            node_store,
        }
    }
}

impl PodSource for KubePodSource {
    fn cached(&self) -> Vec<PodSnapshot> {
        self.pod_store
            .state()
            .iter()
            .map(|p| snapshot(p, &self.resource))
            .collect()
    }

    fn fresh(&self) -> BoxFuture<'_, Result<Vec<PodSnapshot>, EdgeError>> {
        Box::pin(async move {
            let lp = ListParams::default().fields(&format!("spec.nodeName={}", self.node_name));
            let list = self
                .pods
                .list(&lp)
                .await
                .map_err(|e| EdgeError(e.to_string()))?;
            Ok(list
                .items
                .iter()
                .map(|p| snapshot(p, &self.resource))
                .collect())
        })
    }

    fn hami_lock(&self) -> Option<String> {
        self.node_store
            .state()
            .iter()
            .find_map(|n| {
                n.metadata
                    .annotations
                    .as_ref()?
                    .get(keys::NODE_LOCK)
                    .cloned()
            })
            .and_then(|v| lock_holder(&v))
    }
}

/// Pod and node patches through the apiserver.
#[derive(Clone)]
pub struct KubePatcher {
    client: kube::Client,
    node_name: String,
}

impl std::fmt::Debug for KubePatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubePatcher")
            .field("node", &self.node_name)
            .finish_non_exhaustive()
    }
}

impl KubePatcher {
    pub fn new(client: kube::Client, node_name: &str) -> Self {
        KubePatcher {
            client,
            node_name: node_name.to_owned(),
        }
    }

    /// Merge-patches the node's status capacity (opt-in extended resources).
    pub async fn patch_node_capacity(&self, body: Value) -> Result<(), EdgeError> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        nodes
            .patch_status(
                &self.node_name,
                &PatchParams::default(),
                &Patch::Merge(body),
            )
            .await
            .map(|_| ())
            .map_err(|e| EdgeError(e.to_string()))
    }

    /// Merge-patches node annotations.
    pub async fn patch_node_annotations(
        &self,
        annotations: &BTreeMap<String, Option<String>>,
    ) -> Result<(), EdgeError> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        nodes
            .patch(
                &self.node_name,
                &PatchParams::default(),
                &Patch::Merge(annotations_patch(annotations)),
            )
            .await
            .map(|_| ())
            .map_err(|e| EdgeError(e.to_string()))
    }
}

impl PodPatcher for KubePatcher {
    fn patch_pod_annotations(
        &self,
        namespace: &str,
        name: &str,
        annotations: BTreeMap<String, String>,
    ) -> BoxFuture<'_, Result<(), EdgeError>> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        let name = name.to_owned();
        let body = annotations_patch(&annotations.into_iter().map(|(k, v)| (k, Some(v))).collect());
        Box::pin(async move {
            pods.patch(&name, &PatchParams::default(), &Patch::Merge(body))
                .await
                .map(|_| ())
                .map_err(|e| EdgeError(e.to_string()))
        })
    }

    fn release_hami_lock(
        &self,
        namespace: &str,
        name: &str,
    ) -> BoxFuture<'_, Result<(), EdgeError>> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let (namespace, name) = (namespace.to_owned(), name.to_owned());
        Box::pin(async move {
            let node = nodes
                .get(&self.node_name)
                .await
                .map_err(|e| EdgeError(e.to_string()))?;
            let Some(value) = node
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(keys::NODE_LOCK))
            else {
                return Ok(());
            };
            if !lock_names(value, &namespace, &name) {
                return Ok(());
            }
            let rv = node.metadata.resource_version.clone().unwrap_or_default();
            nodes
                .patch(
                    &self.node_name,
                    &PatchParams::default(),
                    &Patch::Merge(lock_release_patch(&rv)),
                )
                .await
                .map(|_| ())
                .map_err(|e| EdgeError(e.to_string()))
        })
    }
}

/// Keeps `hami.io/node-nvidia-register` current: on every device change and every `period`.
/// The value comes from the device state, which only changes on successful discovery and on
/// health events, so a transient NVML error never wipes it. Apiserver errors are logged and
/// retried after 5 s (HAMi's pace).
pub async fn annotation_loop(
    patcher: KubePatcher,
    state: Arc<DeviceState>,
    period: Duration,
    metrics: Option<PluginMetrics>,
    capacity: Option<CapacityNames>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut changes = state.subscribe();
    loop {
        let value = state.register_annotation();
        let mut ann = BTreeMap::new();
        ann.insert(keys::NODE_REGISTER.to_owned(), Some(value));
        let mut result = patcher.patch_node_annotations(&ann).await;
        if let (Ok(()), Some(names)) = (&result, &capacity) {
            result = patcher
                .patch_node_capacity(capacity_patch(names, &state.register_devices()))
                .await;
        }
        let wait = match result {
            Ok(()) => {
                tracing::debug!("node register annotation written");
                if let Some(m) = &metrics {
                    m.annotation_patch(true);
                }
                period
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot write the node register annotation; retrying in 5 s");
                if let Some(m) = &metrics {
                    m.annotation_patch(false);
                }
                Duration::from_secs(5)
            }
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            r = changes.changed() => { if r.is_err() { return; } }
            _ = shutdown.wait_for(|s| *s) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_helpers_follow_hami_format() {
        let v = "2025-06-13T09:07:40+08:00,default,gpu-pod-1";
        assert!(lock_names(v, "default", "gpu-pod-1"));
        assert!(!lock_names(v, "default", "pod-1"));
        assert_eq!(lock_holder(v).as_deref(), Some("default/gpu-pod-1"));
        assert_eq!(lock_holder("2025-06-13T09:07:40+08:00"), None);
    }

    #[test]
    fn capacity_body_sums_registered_devices() {
        let names = CapacityNames {
            memory: "nvidia.com/gpumem".into(),
            cores: "nvidia.com/gpucores".into(),
        };
        let dev = |devmem, devcore| hami_contract::node::NodeDevice {
            devmem,
            devcore,
            ..Default::default()
        };
        assert_eq!(
            capacity_patch(&names, &[dev(15360, 100), dev(23040, 200)]).to_string(),
            r#"{"status":{"capacity":{"nvidia.com/gpucores":"300","nvidia.com/gpumem":"38400"}}}"#
        );
    }

    #[test]
    fn patch_bodies() {
        let mut a = BTreeMap::new();
        a.insert("x".to_owned(), Some("1".to_owned()));
        a.insert("y".to_owned(), None);
        assert_eq!(
            annotations_patch(&a).to_string(),
            r#"{"metadata":{"annotations":{"x":"1","y":null}}}"#
        );
        assert_eq!(
            lock_release_patch("42").to_string(),
            r#"{"metadata":{"annotations":{"hami.io/mutex.lock":null},"resourceVersion":"42"}}"#
        );
    }
}

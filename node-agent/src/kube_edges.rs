//! The apiserver edges: pod cache + bounded fresh reads, pod annotation patches, HAMi lock
//! release, and the node register annotation loop. Patch bodies are built by pure functions.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::future::BoxFuture;
use hami_contract::annotations as keys;
use hami_contract::nodelock::{NodeLock, is_held_by};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::{Value, json};
use tessera_runtime::{DisplayChain, spawn_task};
use tokio_util::sync::CancellationToken;

use crate::device_state::DeviceState;
use crate::edges::{EdgeError, PodPatcher, PodResourcesSource, PodSource};
use crate::identity::PodSnapshot;
use crate::metrics::PluginMetrics;
use crate::pods::snapshot;

/// `{"metadata":{"annotations":{…}}}`; `None` values delete the key (JSON merge patch null).
pub fn annotations_patch(annotations: &BTreeMap<String, Option<String>>) -> Value {
    let map: serde_json::Map<String, Value> = annotations
        .iter()
        .map(|(k, v)| (k.clone(), v.clone().map_or(Value::Null, Value::String)))
        .collect();
    json!({"metadata": {"annotations": map}})
}

/// A merge patch of pod annotations with the pod's UID as a precondition: the API server
/// refuses it (409 Conflict) when `namespace/name` is now another pod (deleted and recreated).
pub fn pod_annotations_patch(uid: &str, annotations: &BTreeMap<String, Option<String>>) -> Value {
    let mut body = annotations_patch(annotations);
    body["metadata"]["uid"] = Value::String(uid.to_owned());
    body
}

/// HAMi's node lock expiry: a lock older than this is stale (HAMi releases it, and so does not
/// honour it; `nodelock` in HAMi v2.10).
pub const HAMI_LOCK_EXPIRY: Duration = Duration::from_secs(300);

/// `<ns>/<name>` from a lock value ([`NodeLock::parse`], HAMi's rule), only while the lock is
/// live: its time parses (RFC 3339) and lies within [`HAMI_LOCK_EXPIRY`] of `now` (either way,
/// so a clock skewed into the future cannot pin a lock). Expired, malformed (`t,ns,a,b`) and
/// legacy holder-less locks name nobody; nor does an empty namespace or name (HAMi's own
/// dangling-lock check skips those too).
pub fn live_lock_holder(value: &str, now: k8s_openapi::jiff::Timestamp) -> Option<String> {
    let lock = NodeLock::parse(value)?;
    let (ns, name) = lock
        .holder
        .as_ref()
        .filter(|(ns, name)| !ns.is_empty() && !name.is_empty())?;
    let at: k8s_openapi::jiff::Timestamp = lock.time.parse().ok()?;
    let age = now.as_second().abs_diff(at.as_second());
    (age <= HAMI_LOCK_EXPIRY.as_secs()).then(|| format!("{ns}/{name}"))
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

/// Drains an informer's event stream (the reflector fills its store as a side effect) until
/// shutdown; errors are logged and retried with the stream's backoff.
async fn drain_watch<S, K>(stream: S, what: &'static str, shutdown: CancellationToken)
where
    S: futures::Stream<Item = Result<K, watcher::Error>>,
{
    futures::pin_mut!(stream);
    shutdown
        .run_until_cancelled(async {
            while let Some(ev) = stream.next().await {
                if let Err(e) = ev {
                    tracing::warn!(error = %DisplayChain(&e), "{what} watch error; retrying");
                }
            }
        })
        .await;
}

impl KubePodSource {
    /// Starts the pod and node informers (tasks `pod-watch` and `node-watch`, retrying with
    /// backoff until `shutdown`).
    pub fn start(
        client: kube::Client,
        node_name: &str,
        resource: &str,
        shutdown: &CancellationToken,
    ) -> Self {
        Self::start_informers(client, node_name, resource, true, shutdown)
    }

    /// Starts the pod informer only (task `pod-watch`): for the DRA plugin, which needs the
    /// node's pods (the unaccounted-process watch) but neither honours HAMi's node lock nor may
    /// list Nodes. [`PodSource::hami_lock`] is then always `None`.
    pub fn start_pods_only(
        client: kube::Client,
        node_name: &str,
        resource: &str,
        shutdown: &CancellationToken,
    ) -> Self {
        Self::start_informers(client, node_name, resource, false, shutdown)
    }

    fn start_informers(
        client: kube::Client,
        node_name: &str,
        resource: &str,
        watch_node: bool,
        shutdown: &CancellationToken,
    ) -> Self {
        let pods: Api<Pod> = Api::all(client.clone());
        let (pod_store, pod_writer) = reflector::store();
        // Without the node informer the store's writer is dropped here: the store stays empty.
        let (node_store, node_writer) = reflector::store();
        let pod_cfg = watcher::Config::default().fields(&format!("spec.nodeName={node_name}"));
        let pod_stream = reflector::reflector(pod_writer, watcher(pods.clone(), pod_cfg))
            .default_backoff()
            .touched_objects();
        spawn_task(
            "pod-watch",
            drain_watch(pod_stream, "pod", shutdown.clone()),
        );
        if watch_node {
            let nodes: Api<Node> = Api::all(client);
            let node_cfg = watcher::Config::default().fields(&format!("metadata.name={node_name}"));
            let node_stream = reflector::reflector(node_writer, watcher(nodes, node_cfg))
                .default_backoff()
                .touched_objects();
            spawn_task(
                "node-watch",
                drain_watch(node_stream, "node", shutdown.clone()),
            );
        }
        KubePodSource {
            pods,
            node_name: node_name.to_owned(),
            resource: resource.to_owned(),
            pod_store,
            node_store,
        }
    }
}

impl KubePodSource {
    /// Known GPU device-plugin pods running on this node ([`known_gpu_plugin`]), from the
    /// informer's cache: evidence of a second plugin for the same GPUs.
    ///
    /// [`known_gpu_plugin`]: crate::conflict::known_gpu_plugin
    pub fn gpu_plugin_pods(&self) -> Vec<crate::conflict::PluginConflict> {
        self.pod_store
            .state()
            .iter()
            .filter(|p| {
                let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
                !matches!(phase, Some("Succeeded" | "Failed"))
                    && p.metadata.deletion_timestamp.is_none()
            })
            .filter_map(|p| {
                let labels = p.metadata.labels.clone().unwrap_or_default();
                let images: Vec<&str> = p
                    .spec
                    .iter()
                    .flat_map(|s| s.containers.iter())
                    .filter_map(|c| c.image.as_deref())
                    .collect();
                let what = crate::conflict::known_gpu_plugin(&labels, &images)?;
                Some(crate::conflict::PluginConflict::PluginPod {
                    pod: format!(
                        "{}/{}",
                        p.metadata.namespace.as_deref().unwrap_or_default(),
                        p.metadata.name.as_deref().unwrap_or_default()
                    ),
                    what,
                })
            })
            .collect()
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
            let list = self.pods.list(&lp).await.map_err(EdgeError::kube(format!(
                "cannot list the pods of node {}",
                self.node_name
            )))?;
            Ok(list
                .items
                .iter()
                .map(|p| snapshot(p, &self.resource))
                .collect())
        })
    }

    fn get<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<PodSnapshot>, EdgeError>> {
        Box::pin(async move {
            let api: Api<Pod> = Api::namespaced(self.pods.clone().into_client(), namespace);
            let pod = api.get_opt(name).await.map_err(EdgeError::kube(format!(
                "cannot read pod {namespace}/{name}"
            )))?;
            Ok(pod.map(|p| snapshot(&p, &self.resource)))
        })
    }

    fn kubelet_version(&self) -> Option<String> {
        self.node_store.state().iter().find_map(|n| {
            Some(
                n.status
                    .as_ref()?
                    .node_info
                    .as_ref()?
                    .kubelet_version
                    .clone(),
            )
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
            .and_then(|v| {
                let holder = live_lock_holder(&v, k8s_openapi::jiff::Timestamp::now());
                if holder.is_none() {
                    tracing::debug!(lock = %v, "HAMi node lock expired or unreadable; not honoured");
                }
                holder
            })
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
            .map_err(EdgeError::kube(format!(
                "cannot patch the capacity of node {}",
                self.node_name
            )))
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
            .map_err(EdgeError::kube(format!(
                "cannot patch the annotations of node {}",
                self.node_name
            )))
    }
}

impl PodPatcher for KubePatcher {
    fn patch_pod_annotations(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
        annotations: BTreeMap<String, String>,
    ) -> BoxFuture<'_, Result<(), EdgeError>> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        let name = name.to_owned();
        let what = format!("cannot patch pod {namespace}/{name}");
        let body = pod_annotations_patch(
            uid,
            &annotations.into_iter().map(|(k, v)| (k, Some(v))).collect(),
        );
        Box::pin(async move {
            pods.patch(&name, &PatchParams::default(), &Patch::Merge(body))
                .await
                .map(|_| ())
                .map_err(EdgeError::kube(what))
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
                .map_err(EdgeError::kube(format!(
                    "cannot get node {}",
                    self.node_name
                )))?;
            let Some(value) = node
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(keys::NODE_LOCK))
            else {
                return Ok(());
            };
            // HAMi's release rule: only a lock naming this pod.
            if !is_held_by(value, &namespace, &name) {
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
                .map_err(EdgeError::kube(format!(
                    "cannot release the HAMi node lock on {}",
                    self.node_name
                )))
        })
    }
}

/// Keeps `hami.io/node-nvidia-register` current: on every device change and every `period`.
/// `hami.io/node-nvidia-score` goes in the same patch when the device state has topology
/// (`ENABLE_TOPOLOGY_SCORE`, contract §2.2).
/// The value comes from the device state, which only changes on successful discovery and on
/// health events, so a transient NVML error never wipes it. Apiserver errors are logged and
/// retried after `retry` (HAMi's pace: 5 s).
#[derive(Debug, Clone)]
pub struct NodeAnnotator {
    pub patcher: KubePatcher,
    pub state: Arc<DeviceState>,
    pub period: Duration,
    pub retry: Duration,
    pub metrics: Option<PluginMetrics>,
    /// Also patch the node's capacity (opt-in, HAMi #2839).
    pub capacity: Option<CapacityNames>,
    /// Probed on every write for `tessera.io/allocation-identity` (whether the kubelet's
    /// pod-resources `List` answers); `None` writes nothing.
    pub pod_resources: Option<Arc<dyn PodResourcesSource>>,
}

impl NodeAnnotator {
    /// Writes the annotation (and capacity) once.
    async fn write(&self) -> Result<(), EdgeError> {
        let mut ann = BTreeMap::new();
        ann.insert(
            keys::NODE_REGISTER.to_owned(),
            Some(self.state.register_annotation()),
        );
        if let Some(scores) = self.state.score_annotation() {
            ann.insert(keys::NODE_SCORE.to_owned(), Some(scores));
        }
        if let Some(source) = &self.pod_resources {
            let mode = match source.list().await {
                Ok(Some(_)) => keys::IDENTITY_POD_RESOURCES,
                Ok(None) => keys::IDENTITY_SIGNATURE,
                Err(e) => {
                    tracing::debug!(error = %DisplayChain(&e), "pod-resources List failed");
                    keys::IDENTITY_SIGNATURE
                }
            };
            ann.insert(keys::ALLOCATION_IDENTITY.to_owned(), Some(mode.to_owned()));
        }
        self.patcher.patch_node_annotations(&ann).await?;
        if let Some(names) = &self.capacity {
            self.patcher
                .patch_node_capacity(capacity_patch(names, &self.state.register_devices()))
                .await?;
        }
        Ok(())
    }

    /// Runs until `shutdown` is cancelled (or the device state is dropped).
    pub async fn run(self, shutdown: CancellationToken) {
        let mut changes = self.state.subscribe();
        loop {
            let wait = match self.write().await {
                Ok(()) => {
                    tracing::debug!("node register annotation written");
                    if let Some(m) = &self.metrics {
                        m.annotation_patch(true);
                    }
                    self.period
                }
                Err(e) => {
                    tracing::warn!(error = %DisplayChain(&e), retry = ?self.retry, "cannot write the node register annotation; retrying");
                    if let Some(m) = &self.metrics {
                        m.annotation_patch(false);
                    }
                    self.retry
                }
            };
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                r = changes.changed() => { if r.is_err() { return; } }
                _ = shutdown.cancelled() => return,
            }
        }
    }
}

/// The `reportingController` of the device plugin's Events.
pub const EVENT_REPORTER: &str = "tessera-device-plugin";

/// Writes the device plugin's Node Events (task `node-events`) until every [`NodeEvents`]
/// handle is gone. Kubernetes deduplicates repeats into a series on the Event (kube-rs'
/// recorder), so a GPU that flaps does not flood etcd.
///
/// [`NodeEvents`]: crate::node_events::NodeEvents
pub fn spawn_node_event_writer(
    client: kube::Client,
    node: &str,
    rx: tokio::sync::mpsc::Receiver<crate::node_events::NodeEvent>,
) {
    spawn_event_writer(client, node, EVENT_REPORTER, rx);
}

/// [`spawn_node_event_writer`] for another daemon: its Events name `controller` as their
/// `reportingController` (the DRA plugin's say `tessera-dra-plugin`), so `kubectl get events`
/// tells which plugin wrote them.
pub fn spawn_event_writer(
    client: kube::Client,
    node: &str,
    controller: &str,
    rx: tokio::sync::mpsc::Receiver<crate::node_events::NodeEvent>,
) {
    let reporter = kube::runtime::events::Reporter {
        controller: controller.to_owned(),
        instance: Some(node.to_owned()),
    };
    let recorder = kube::runtime::events::Recorder::new(client.clone(), reporter);
    spawn_task(
        "node-events",
        write_node_events(Api::all(client), node.to_owned(), recorder, rx),
    );
}

async fn write_node_events(
    nodes: Api<Node>,
    node: String,
    recorder: kube::runtime::events::Recorder,
    mut rx: tokio::sync::mpsc::Receiver<crate::node_events::NodeEvent>,
) {
    use crate::node_events::NodeEventType;
    use kube::runtime::events::{Event, EventType};
    // `kubectl describe node` selects the node's Events by UID too: read it once.
    let mut uid: Option<String> = None;
    // Events the API server would not take: a warning a minute at most, with the count.
    let mut failures = tessera_runtime::RateLimitedLog::new(std::time::Duration::from_secs(60));
    while let Some(event) = rx.recv().await {
        if uid.is_none() {
            match nodes.get_opt(&node).await {
                Ok(found) => uid = found.and_then(|n| n.metadata.uid),
                Err(e) => tracing::debug!(error = %DisplayChain(&e), "cannot read the node's UID"),
            }
        }
        let reference = match &event.regarding {
            crate::node_events::EventObject::Node => k8s_openapi::api::core::v1::ObjectReference {
                api_version: Some("v1".to_owned()),
                kind: Some("Node".to_owned()),
                name: Some(node.clone()),
                uid: uid.clone(),
                ..Default::default()
            },
            crate::node_events::EventObject::Pod {
                namespace,
                name,
                uid,
            } => k8s_openapi::api::core::v1::ObjectReference {
                api_version: Some("v1".to_owned()),
                kind: Some("Pod".to_owned()),
                namespace: Some(namespace.clone()),
                name: Some(name.clone()),
                uid: Some(uid.clone()),
                ..Default::default()
            },
        };
        let ev = Event {
            type_: match event.kind {
                NodeEventType::Normal => EventType::Normal,
                NodeEventType::Warning => EventType::Warning,
            },
            reason: event.reason.to_owned(),
            note: Some(event.message),
            action: event.reason.to_owned(),
            secondary: None,
        };
        if let Err(e) = recorder.publish(&ev, &reference).await {
            match failures.note(tokio::time::Instant::now()) {
                Some(left_out) => tracing::warn!(
                    error = %DisplayChain(&e),
                    reason = event.reason,
                    left_out,
                    "an Event could not be recorded (and left_out more since the last such line)"
                ),
                None => {
                    tracing::debug!(error = %DisplayChain(&e), reason = event.reason, "an Event could not be recorded")
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_helpers_follow_hami_format() {
        let at = |s: &str| -> k8s_openapi::jiff::Timestamp { s.parse().expect("timestamp") };
        let now = at("2025-06-13T01:08:00Z");
        let v = NodeLock::for_pod("2025-06-13T09:07:40+08:00", "default", "gpu-pod-1").encode();
        assert_eq!(v, "2025-06-13T09:07:40+08:00,default,gpu-pod-1");
        assert!(is_held_by(&v, "default", "gpu-pod-1"));
        assert!(!is_held_by(&v, "default", "pod-1"));
        assert_eq!(
            live_lock_holder(&v, now).as_deref(),
            Some("default/gpu-pod-1")
        );
        assert_eq!(live_lock_holder("2025-06-13T09:07:40+08:00", now), None);
        // HAMi v2.10 refuses four fields ("expected 3 parts"): the lock names nobody, neither
        // `ns/a,b` (the old splitn reading) nor `ns,a/b`.
        assert_eq!(
            live_lock_holder("2025-06-13T09:07:40+08:00,ns,a,b", now),
            None
        );
        assert_eq!(live_lock_holder("2025-06-13T09:07:40+08:00,,", now), None);
    }

    #[test]
    fn only_live_hami_locks_name_a_holder() {
        let at = |s: &str| -> k8s_openapi::jiff::Timestamp { s.parse().expect("timestamp") };
        let v = "2025-06-13T09:07:40+08:00,default,gpu-pod-1";
        // 4 min 59 s later: live.
        assert_eq!(
            live_lock_holder(v, at("2025-06-13T01:12:39Z")).as_deref(),
            Some("default/gpu-pod-1")
        );
        // 5 min 1 s later: expired, not honoured.
        assert_eq!(live_lock_holder(v, at("2025-06-13T01:12:41Z")), None);
        // Far in the future (skewed clock): not honoured either.
        assert_eq!(live_lock_holder(v, at("2025-06-13T00:57:00Z")), None);
        assert_eq!(
            live_lock_holder("garbage,default,p", at("2025-06-13T01:08:00Z")),
            None
        );
        assert_eq!(
            live_lock_holder("2025-06-13T01:08:00Z", at("2025-06-13T01:08:00Z")),
            None
        );
    }

    #[test]
    fn pod_patches_carry_the_uid_precondition() {
        let mut a = BTreeMap::new();
        a.insert("hami.io/bind-phase".to_owned(), Some("failed".to_owned()));
        assert_eq!(
            pod_annotations_patch("uid-1", &a).to_string(),
            r#"{"metadata":{"annotations":{"hami.io/bind-phase":"failed"},"uid":"uid-1"}}"#
        );
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

/// Why no Kubernetes client could be made.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot read kubeconfig {}", path.display())]
    ReadKubeconfig {
        path: std::path::PathBuf,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error("invalid kubeconfig")]
    Kubeconfig(#[source] kube::config::KubeconfigError),
    #[error("cannot build the Kubernetes client")]
    Client(#[source] kube::Error),
    #[error("no Kubernetes configuration (in-cluster or KUBECONFIG)")]
    NoKubernetesConfig(#[source] kube::Error),
}

/// The Kubernetes client of both plugins: `kubeconfig` when given, otherwise the inferred
/// configuration (in-cluster, KUBECONFIG, ~/.kube/config).
pub async fn client(kubeconfig: Option<&std::path::Path>) -> Result<kube::Client, ClientError> {
    match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path).map_err(|source| {
                ClientError::ReadKubeconfig {
                    path: path.to_path_buf(),
                    source,
                }
            })?;
            let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
                .await
                .map_err(ClientError::Kubeconfig)?;
            kube::Client::try_from(cfg).map_err(ClientError::Client)
        }
        None => kube::Client::try_default()
            .await
            .map_err(ClientError::NoKubernetesConfig),
    }
}

/// [`crate::process_watch::PodEvictor`]: deletes the pod with its UID as a precondition, as
/// the kubelet's own evictions do (a PodDisruptionBudget does not hold back the removal of a
/// pod that uses GPUs outside its booking); the device-plugin-scope and dra-plugin-scope
/// admission policies allow each plugin this for pods on its own node only.
#[derive(Clone)]
pub struct KubeEvictor {
    pub client: kube::Client,
}

impl std::fmt::Debug for KubeEvictor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeEvictor").finish_non_exhaustive()
    }
}

impl crate::process_watch::PodEvictor for KubeEvictor {
    fn evict(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
    ) -> futures::future::BoxFuture<'_, Result<(), EdgeError>> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        let what = format!("cannot evict pod {namespace}/{name}");
        let name = name.to_owned();
        let params = kube::api::DeleteParams {
            preconditions: Some(kube::api::Preconditions {
                uid: Some(uid.to_owned()),
                resource_version: None,
            }),
            ..Default::default()
        };
        Box::pin(async move {
            pods.delete(&name, &params)
                .await
                .map(|_| ())
                .map_err(EdgeError::kube(what))
        })
    }
}

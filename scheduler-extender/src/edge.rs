//! The daemon's side effects on the cluster, behind one small trait so the HTTP layer and the
//! decision loop can be tested against an in-process fake.

use std::future::Future;

use k8s_openapi::api::core::v1::Pod;
use tessera_scheduler_core::patch::MetadataPatch;

/// A failed API call. `retryable` is true for conflicts, timeouts and server errors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct EdgeError {
    pub message: String,
    pub not_found: bool,
}

impl EdgeError {
    pub fn new(message: impl Into<String>) -> Self {
        EdgeError {
            message: message.into(),
            not_found: false,
        }
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        EdgeError {
            message: message.into(),
            not_found: true,
        }
    }
}

/// Event severity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    Normal,
    Warning,
}

/// A Kubernetes Event about a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodEvent {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub kind: EventType,
    pub reason: String,
    pub message: String,
}

/// What the extender does to the cluster.
pub trait ClusterEdge: Send + Sync + 'static {
    /// Reads the pod past any cache.
    fn get_pod(
        &self,
        namespace: &str,
        name: &str,
    ) -> impl Future<Output = Result<Option<Pod>, EdgeError>> + Send;

    /// Merge-patches the pod's annotations and labels. `uid` guards against a recreated pod of
    /// the same name.
    fn patch_pod(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
        patch: MetadataPatch,
    ) -> impl Future<Output = Result<(), EdgeError>> + Send;

    /// POSTs `pods/<name>/binding` with `metadata` in the Binding (the API server merges its
    /// annotations into the pod in the same update that binds it). `uid` is a precondition.
    fn bind_pod(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
        node: &str,
        metadata: MetadataPatch,
    ) -> impl Future<Output = Result<(), EdgeError>> + Send;

    /// Takes HAMi's node lock (`hami.io/mutex.lock`) for `namespace/name` on `node` by HAMi's
    /// `LockNode` rules ([`hami_contract::nodelock::acquire_step`]); an error when another pod
    /// holds it. Only for nodes that run HAMi's device plugin.
    fn lock_hami_node(
        &self,
        node: &str,
        namespace: &str,
        name: &str,
    ) -> impl Future<Output = Result<(), EdgeError>> + Send;

    /// Removes HAMi's node lock from `node` if it names `namespace/name` (HAMi's
    /// `ReleaseNodeLock` rule, [`hami_contract::nodelock::is_held_by`]).
    fn release_hami_node_lock(
        &self,
        node: &str,
        namespace: &str,
        name: &str,
    ) -> impl Future<Output = Result<(), EdgeError>> + Send;

    /// Removes HAMi's node lock from `node` if its value is still `value` (a lock someone has
    /// taken since is left alone).
    fn clear_hami_node_lock(
        &self,
        node: &str,
        value: &str,
    ) -> impl Future<Output = Result<(), EdgeError>> + Send;

    /// Records an Event (best effort).
    fn event(&self, event: PodEvent) -> impl Future<Output = ()> + Send;
}

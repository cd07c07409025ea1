//! The daemon's side effects on the cluster, behind one small trait so the HTTP layer and the
//! decision loop can be tested against an in-process fake.

use std::future::Future;

use k8s_openapi::api::core::v1::Pod;
use tessera_scheduler_core::patch::MetadataPatch;

/// Why a side effect on the cluster failed, with its cause.
#[derive(Debug, thiserror::Error)]
pub enum EdgeError {
    /// The API call failed (the API server refused it, or it did not get there).
    #[error("{0}")]
    Api(#[source] Box<kube::Error>),
    /// HAMi's node lock on `node` names another pod (`value`).
    #[error("node {node} is locked by HAMi's node lock ({value})")]
    HamiLockBusy { node: String, value: String },
    /// HAMi's node lock on `node` names a pod that still exists.
    #[error("node {node} is locked for pod {namespace}/{name} (HAMi's node lock)")]
    HamiLockHeld {
        node: String,
        namespace: String,
        name: String,
    },
    /// Every attempt to write HAMi's node lock on `node` met a newer version of the node.
    #[error("node {node}: HAMi's node lock kept changing while it was being taken")]
    HamiLockContended { node: String },
}

impl From<kube::Error> for EdgeError {
    fn from(e: kube::Error) -> Self {
        EdgeError::Api(Box::new(e))
    }
}

impl EdgeError {
    /// An error answer of the API server (`code`, `reason`, `message`), as the client reports
    /// it; for fakes of the edge.
    pub fn status(code: u16, reason: &str, message: &str) -> Self {
        kube::Error::Api(Box::new(
            kube::core::Status::failure(message, reason).with_code(code),
        ))
        .into()
    }

    /// The API server answered 404: the object does not exist.
    pub fn is_not_found(&self) -> bool {
        matches!(self, EdgeError::Api(e) if matches!(e.as_ref(), kube::Error::Api(s) if s.is_not_found()))
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

    /// The PodDisruptionBudgets of `namespaces`, each with the UIDs of the pods it selects, read
    /// when kube-scheduler asks for victims (allowances change with every eviction, so they are
    /// read then, not cached; and the state keeps no pod labels).
    fn disruption_budgets(
        &self,
        namespaces: &std::collections::BTreeSet<String>,
    ) -> impl Future<Output = Result<Vec<tessera_scheduler_core::preempt::Budget>, EdgeError>> + Send;

    /// Records an Event (best effort).
    fn event(&self, event: PodEvent) -> impl Future<Output = ()> + Send;
}

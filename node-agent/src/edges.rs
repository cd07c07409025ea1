//! The daemon's I/O edges as the allocator and the monitor see them: the node's pods (informer
//! and fresh list), pod patches, the kubelet's pod-resources `List`, and why a call failed. The
//! implementations live in `kube_edges` and `pod_resources`; tests swap them (`testing`).

use std::collections::BTreeMap;

use futures::future::BoxFuture;

use crate::identity::{PodResourcesView, PodSnapshot};

/// Why a call to an I/O edge (the apiserver, the kubelet's pod-resources socket) failed. The
/// cause stays the error's source: log it with [`DisplayChain`].
#[derive(Debug, thiserror::Error)]
pub enum EdgeError {
    /// An apiserver request failed; `what` says which (`cannot patch pod ns/name`).
    #[error("{what}")]
    Kube {
        what: String,
        #[source]
        source: kube::Error,
    },
    /// The kubelet's socket could not be reached.
    #[error(transparent)]
    KubeletSocket(#[from] crate::uds::ConnectError),
    /// The kubelet answered pod-resources `List` with an error.
    #[error("pod-resources List failed")]
    PodResourcesList(#[source] tonic::Status),
}

impl EdgeError {
    /// The API server says the pod is gone: not found, or a UID precondition failed (the name
    /// now belongs to another pod).
    pub fn pod_gone(&self) -> bool {
        match self {
            EdgeError::Kube {
                source: kube::Error::Api(status),
                ..
            } => status.code == 404 || status.code == 409,
            _ => false,
        }
    }

    /// For `map_err`: an apiserver error while doing `what`.
    pub fn kube(what: impl Into<String>) -> impl FnOnce(kube::Error) -> EdgeError {
        let what = what.into();
        move |source| EdgeError::Kube { what, source }
    }
}

/// The node's pods, as the informer has them and (bounded) fresh from the apiserver.
pub trait PodSource: Send + Sync + 'static {
    fn cached(&self) -> Vec<PodSnapshot>;
    fn fresh(&self) -> BoxFuture<'_, Result<Vec<PodSnapshot>, EdgeError>>;
    /// Pod `namespace/name` read from the apiserver now; `None`: there is none.
    fn get<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<PodSnapshot>, EdgeError>>;
    /// The node's `status.nodeInfo.kubeletVersion`, as the node informer has it.
    fn kubelet_version(&self) -> Option<String>;
    /// `<namespace>/<name>` from HAMi's `hami.io/mutex.lock` on this node, if any.
    fn hami_lock(&self) -> Option<String>;
}

/// Writes pod annotations and releases HAMi's node lock.
pub trait PodPatcher: Send + Sync + 'static {
    /// Patches the annotations of pod `namespace/name` only if its UID is still `uid` (a
    /// recreated pod of the same name is never patched).
    fn patch_pod_annotations(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
        annotations: BTreeMap<String, String>,
    ) -> BoxFuture<'_, Result<(), EdgeError>>;
    /// Removes `hami.io/mutex.lock` if (and only if) it still names this pod.
    fn release_hami_lock(
        &self,
        namespace: &str,
        name: &str,
    ) -> BoxFuture<'_, Result<(), EdgeError>>;
}

/// The kubelet's pod-resources `List`; `Ok(None)` when the kubelet does not serve it.
pub trait PodResourcesSource: Send + Sync + std::fmt::Debug + 'static {
    fn list(&self) -> BoxFuture<'_, Result<Option<PodResourcesView>, EdgeError>>;
}

/// A source that never has pod-resources (old kubelets, tests of the fallback).
#[derive(Debug, Clone, Copy, Default)]
pub struct NoPodResources;

impl PodResourcesSource for NoPodResources {
    fn list(&self) -> BoxFuture<'_, Result<Option<PodResourcesView>, EdgeError>> {
        Box::pin(async { Ok(None) })
    }
}

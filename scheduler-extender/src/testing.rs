//! An in-process fake of the cluster edge for tests and benchmarks (feature `testing`): pods live
//! in a map, patches merge into them, bindings set `spec.nodeName` and their annotations, and every change can be fed
//! back to a decision loop as an informer would (optionally late). The Kubernetes objects to feed
//! it are `tessera_scheduler_core::fixtures`.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use k8s_openapi::api::core::v1::Pod;
use tessera_scheduler_core::patch::{MetadataPatch, bind_phase_patch};

use crate::edge::{ClusterEdge, EdgeError, PodEvent};
use crate::engine::{Command, EngineHandle, Observation};

/// The fake API server.
#[derive(Debug, Default)]
pub struct FakeEdge {
    pods: Mutex<HashMap<(String, String), Pod>>,
    /// HAMi node lock values by node (the only node field the extender writes).
    hami_locks: Mutex<HashMap<String, String>>,
    events: Mutex<Vec<PodEvent>>,
    /// What `disruption_budgets` answers.
    budgets: Mutex<Vec<tessera_scheduler_core::preempt::Budget>>,
    informer: Mutex<Vec<EngineHandle>>,
    /// Fail the next N Binding calls.
    pub fail_binds: std::sync::atomic::AtomicUsize,
    /// Every API call made through the edge, in order: `get|patch|bind <namespace>/<name>`
    /// (events excluded).
    calls: Mutex<Vec<String>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl FakeEdge {
    pub fn new() -> Self {
        Self::default()
    }

    /// Sends every later pod change to `engine` as an informer event.
    pub fn watch(&self, engine: EngineHandle) {
        lock(&self.informer).push(engine);
    }

    pub fn stop_watching(&self) {
        lock(&self.informer).clear();
    }

    pub fn add_pod(&self, pod: Pod) {
        let key = (
            pod.metadata.namespace.clone().unwrap_or_default(),
            pod.metadata.name.clone().unwrap_or_default(),
        );
        lock(&self.pods).insert(key, pod);
    }

    pub fn set_budgets(&self, budgets: Vec<tessera_scheduler_core::preempt::Budget>) {
        *lock(&self.budgets) = budgets;
    }

    pub fn pods(&self) -> Vec<Pod> {
        lock(&self.pods).values().cloned().collect()
    }

    pub fn events(&self) -> Vec<PodEvent> {
        lock(&self.events).clone()
    }

    /// The API calls made so far (see the field), and forgets them.
    pub fn take_calls(&self) -> Vec<String> {
        std::mem::take(&mut *lock(&self.calls))
    }

    fn call(&self, verb: &str, namespace: &str, name: &str) {
        lock(&self.calls).push(format!("{verb} {namespace}/{name}"));
    }

    async fn publish(&self, pod: Pod) {
        let engines: Vec<EngineHandle> = lock(&self.informer).clone();
        for e in engines {
            e.send(Command::Observe(Observation::PodUpsert(Box::new(
                pod.clone(),
            ))))
            .await;
        }
    }

    /// The node's `hami.io/mutex.lock`, if any.
    pub fn hami_lock(&self, node: &str) -> Option<String> {
        lock(&self.hami_locks).get(node).cloned()
    }

    /// Sets (`Some`) or removes the node's `hami.io/mutex.lock`, as HAMi's plugin does.
    pub fn set_hami_lock(&self, node: &str, value: Option<&str>) {
        let mut locks = lock(&self.hami_locks);
        match value {
            Some(v) => locks.insert(node.to_owned(), v.to_owned()),
            None => locks.remove(node),
        };
    }

    /// The kubelet's status update: sets the pod's phase (e.g. `Failed` when admission rejected
    /// it) and publishes.
    pub async fn set_phase(&self, namespace: &str, name: &str, phase: &str) {
        let updated = {
            let mut pods = lock(&self.pods);
            pods.get_mut(&(namespace.to_owned(), name.to_owned()))
                .map(|pod| {
                    pod.status.get_or_insert_with(Default::default).phase = Some(phase.to_owned());
                    pod.clone()
                })
        };
        if let Some(pod) = updated {
            self.publish(pod).await;
        }
    }

    /// The device plugin's answer: sets `hami.io/bind-phase` and publishes.
    pub async fn set_bind_phase(&self, namespace: &str, name: &str, phase: &str) {
        let _ = self
            .patch_pod(namespace, name, "", bind_phase_patch(phase))
            .await;
    }
}

impl ClusterEdge for FakeEdge {
    async fn get_pod(&self, namespace: &str, name: &str) -> Result<Option<Pod>, EdgeError> {
        self.call("get", namespace, name);
        Ok(lock(&self.pods)
            .get(&(namespace.to_owned(), name.to_owned()))
            .cloned())
    }

    async fn patch_pod(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
        patch: MetadataPatch,
    ) -> Result<(), EdgeError> {
        self.call("patch", namespace, name);
        let updated = {
            let mut pods = lock(&self.pods);
            let Some(pod) = pods.get_mut(&(namespace.to_owned(), name.to_owned())) else {
                return Err(EdgeError::status(
                    404,
                    "NotFound",
                    &format!("pods \"{name}\" not found"),
                ));
            };
            if !uid.is_empty() && pod.metadata.uid.as_deref() != Some(uid) {
                return Err(EdgeError::status(
                    409,
                    "Conflict",
                    "precondition failed: UID mismatch",
                ));
            }
            pod.metadata
                .annotations
                .get_or_insert_with(BTreeMap::new)
                .extend(patch.annotations);
            if !patch.labels.is_empty() {
                pod.metadata
                    .labels
                    .get_or_insert_with(BTreeMap::new)
                    .extend(patch.labels);
            }
            pod.clone()
        };
        self.publish(updated).await;
        Ok(())
    }

    async fn bind_pod(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
        node: &str,
        metadata: MetadataPatch,
    ) -> Result<(), EdgeError> {
        self.call("bind", namespace, name);
        if self
            .fail_binds
            .fetch_update(
                std::sync::atomic::Ordering::SeqCst,
                std::sync::atomic::Ordering::SeqCst,
                |n| n.checked_sub(1),
            )
            .is_ok()
        {
            return Err(EdgeError::status(
                500,
                "InternalError",
                "injected Binding failure",
            ));
        }
        let updated = {
            let mut pods = lock(&self.pods);
            let Some(pod) = pods.get_mut(&(namespace.to_owned(), name.to_owned())) else {
                return Err(EdgeError::status(
                    404,
                    "NotFound",
                    &format!("pods \"{name}\" not found"),
                ));
            };
            if pod.metadata.uid.as_deref() != Some(uid) {
                return Err(EdgeError::status(
                    409,
                    "Conflict",
                    "precondition failed: UID mismatch",
                ));
            }
            let spec = pod.spec.get_or_insert_with(Default::default);
            if spec.node_name.is_some() {
                return Err(EdgeError::status(
                    409,
                    "Conflict",
                    &format!("pod {name} is already assigned"),
                ));
            }
            spec.node_name = Some(node.to_owned());
            // As the API server does: the Binding's annotations, in the same update; its labels
            // only with the PodTopologyLabelsAdmission gate (off by default), so not here.
            pod.metadata
                .annotations
                .get_or_insert_with(BTreeMap::new)
                .extend(metadata.annotations);
            pod.clone()
        };
        self.publish(updated).await;
        Ok(())
    }

    async fn lock_hami_node(
        &self,
        node: &str,
        namespace: &str,
        name: &str,
    ) -> Result<(), EdgeError> {
        use hami_contract::nodelock::{AcquireStep, NodeLock, acquire_step};
        self.call("lock", "node", node);
        let current = self.hami_lock(node);
        // The fake's locks are always fresh: its clock does not move.
        match acquire_step(current.as_deref(), namespace, name, Some(0)) {
            AcquireStep::Held => return Ok(()),
            AcquireStep::Busy => {
                return Err(EdgeError::HamiLockBusy {
                    node: node.to_owned(),
                    value: current.clone().unwrap_or_default(),
                });
            }
            AcquireStep::TakeIfGone {
                namespace: ns,
                name: holder,
            } => {
                if lock(&self.pods).contains_key(&(ns.clone(), holder.clone())) {
                    return Err(EdgeError::HamiLockHeld {
                        node: node.to_owned(),
                        namespace: ns,
                        name: holder,
                    });
                }
            }
            AcquireStep::Take => {}
        }
        let value = NodeLock::for_pod("2026-01-01T00:00:00Z", namespace, name).encode();
        self.set_hami_lock(node, Some(&value));
        Ok(())
    }

    async fn release_hami_node_lock(
        &self,
        node: &str,
        namespace: &str,
        name: &str,
    ) -> Result<(), EdgeError> {
        self.call("unlock", "node", node);
        let mut locks = lock(&self.hami_locks);
        if locks
            .get(node)
            .is_some_and(|v| hami_contract::nodelock::is_held_by(v, namespace, name))
        {
            locks.remove(node);
        }
        Ok(())
    }

    async fn clear_hami_node_lock(&self, node: &str, value: &str) -> Result<(), EdgeError> {
        self.call("unlock", "node", node);
        let mut locks = lock(&self.hami_locks);
        if locks.get(node).map(String::as_str) == Some(value) {
            locks.remove(node);
        }
        Ok(())
    }

    async fn disruption_budgets(
        &self,
        namespaces: &std::collections::BTreeSet<String>,
    ) -> Result<Vec<tessera_scheduler_core::preempt::Budget>, EdgeError> {
        for ns in namespaces {
            self.call("list", ns, "poddisruptionbudgets");
        }
        Ok(lock(&self.budgets)
            .iter()
            .filter(|b| namespaces.contains(&b.namespace))
            .cloned()
            .collect())
    }

    async fn event(&self, event: PodEvent) {
        lock(&self.events).push(event);
    }
}

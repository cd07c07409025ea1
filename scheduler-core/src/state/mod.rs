//! The extender's view of the cluster: nodes, GPU pods and quotas decoded from Kubernetes objects,
//! plus the in-memory reservation overlay the decision loop writes.
//!
//! Pure data and functions, no I/O: the decision loop feeds it from reflectors, `simulate` from a
//! file, the tests and benchmarks directly.
//!
//! By concern: [`records`] (what is kept of a Node and a pod), [`books`] (per-pod usage),
//! [`ledger`] (in-flight decisions and the bind rule), [`budget`] (the quota view),
//! [`node_cache`] (the per-node states the filter reads). [`ClusterState`] ties them together.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use hami_contract::annotations as ann;
use hami_contract::identity::AllocationSignature;
use hami_contract::mig::MigAllocation;
use hami_contract::usage::{DeviceUsage, collapse_pod_usage};
use hami_contract::{NodeDevice, PodDevices};
use k8s_openapi::api::core::v1::{Node, Pod, ResourceQuota};

use crate::config::DecisionConfig;
use crate::fit::{self, Charge, GpuState, NodeState, NodeSummary, QuotaBudget, TopologyScores};
use crate::quota::{QuotaKeys, QuotaRecord, Quotas};

mod books;
mod budget;
mod ledger;
mod node_cache;
mod nominations;
mod records;
mod victims;

use books::*;
use node_cache::*;
use records::*;

pub use books::{SharedBooking, usage_charge};
pub use ledger::{BindStage, PendingPod, Reservation, confusable_pending};
pub use node_cache::{Candidate, NameHash, NodeSet, NodeSlot, QuickCandidate};
pub use nominations::Nomination;
pub use records::{NOT_REGISTERED, NodeRecord, PodRecord, Standing, slim_node, slim_pod};
pub use victims::BoundGpuPod;

/// A kind of object a watcher lists, for [`ClusterState::missing`]: its keys are node names, pod
/// UIDs, and `namespace/name` of quotas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResyncKind {
    Nodes,
    Pods,
    Quotas,
}

/// Nodes, GPU pods, quotas and the reservation overlay.
#[derive(Debug, Default)]
pub struct ClusterState {
    nodes: BTreeMap<String, NodeRecord>,
    /// GPU pods by UID.
    pods: HashMap<Box<str>, PodEntry>,
    /// The strings pod entries share.
    strings: Strings,
    /// UIDs of the other pods known to exist (no GPU decision): with the keys of `pods`, every
    /// pod known to exist, for the reservation sweep.
    live: HashSet<Box<str>>,
    by_node: HashMap<String, BTreeSet<String>>,
    /// What each namespace's pods book ([`PodEntry::charge`]), kept as pods come and go: a
    /// budget check then adds the few in-flight reservations instead of summing pods.
    charged: HashMap<std::sync::Arc<str>, Charge>,
    /// Pods pending allocation (bind-phase `allocating`, alive) per node: the gate's index.
    pending_by_node: HashMap<String, BTreeSet<String>>,
    /// Pods decided for a node and not bound yet ([`PodRecord::is_decided_unbound`]) per node.
    decided_by_node: HashMap<String, BTreeSet<String>>,
    /// Reservation UIDs per node.
    res_by_node: HashMap<String, BTreeSet<String>>,
    quotas: Quotas,
    reservations: HashMap<String, Reservation>,
    /// Pods nominated to a node and not bound yet, by UID ([`Nomination`]).
    nominations: HashMap<Box<str>, Nomination>,
    /// Node states with all effective usage applied, rebuilt lazily.
    cache: NodeCache,
    dirty: HashSet<String>,
}

/// Takes `uid` out of `node`'s set of a per-node index, and the set out once empty: the filter
/// walks the pending indexes' sets every time, and after a burst every node had one.
fn unindex(index: &mut HashMap<String, BTreeSet<String>>, node: &str, uid: &str) {
    if let Some(set) = index.get_mut(node) {
        set.remove(uid);
        if set.is_empty() {
            index.remove(node);
        }
    }
}

impl ClusterState {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn nodes(&self) -> impl Iterator<Item = &NodeRecord> {
        self.nodes.values()
    }

    pub fn node(&self, name: &str) -> Option<&NodeRecord> {
        self.nodes.get(name)
    }

    /// The record of a GPU pod, as [`PodRecord::from_pod`] built it (rebuilt from the state's
    /// compact entry; for a plain question, [`Self::pod_books_capacity`] builds nothing).
    pub fn pod(&self, uid: &str) -> Option<PodRecord> {
        self.pods.get(uid).map(|p| p.record(uid))
    }

    /// [`PodRecord::preempted`] of the pod `uid`; false when the state has no record of it.
    pub fn pod_preempted(&self, uid: &str) -> bool {
        self.pods.get(uid).is_some_and(|p| p.preempted)
    }

    /// [`PodRecord::books_capacity`] of the pod `uid`; false when the state has no record of it.
    pub fn pod_books_capacity(&self, uid: &str) -> bool {
        self.pods.get(uid).is_some_and(PodEntry::books_capacity)
    }

    pub fn reservation(&self, uid: &str) -> Option<&Reservation> {
        self.reservations.get(uid)
    }

    pub fn reservations(&self) -> impl Iterator<Item = &Reservation> {
        self.reservations.values()
    }

    pub fn quotas(&self) -> impl Iterator<Item = &QuotaRecord> {
        self.quotas.iter()
    }

    pub fn is_live(&self, uid: &str) -> bool {
        self.live.contains(uid) || self.pods.contains_key(uid)
    }

    fn touch(&mut self, node: Option<&str>) {
        if let Some(n) = node {
            self.dirty.insert(n.to_owned());
        }
    }

    pub fn upsert_node(&mut self, rec: NodeRecord) {
        self.touch(Some(&rec.name.clone()));
        self.nodes.insert(rec.name.clone(), rec);
    }

    pub fn remove_node(&mut self, name: &str) {
        self.nodes.remove(name);
        self.cache.remove(name);
        self.dirty.remove(name);
    }

    /// Records a pod seen by the informer (any pod: non-GPU pods only mark liveness).
    pub fn upsert_pod(&mut self, pod: &Pod) {
        let Some(uid) = pod.metadata.uid.clone() else {
            return;
        };
        self.drop_pod_record(&uid);
        let Some(rec) = PodRecord::from_pod(pod) else {
            self.note_nomination(&uid, Nomination::of(pod));
            self.live.insert(uid.into_boxed_str());
            return;
        };
        self.note_nomination(&uid, None);
        self.live.remove(uid.as_str());
        {
            // The informer caught up with our decision: the overlay is no longer needed. A
            // reservation in bind stays until the bind has returned and its phase is visible,
            // so the pending-allocation gate never loses sight of it.
            if let Some(r) = self.reservations.get(uid.as_str())
                && rec.node.as_deref() == Some(r.node.as_str())
                && rec.devices == r.devices
                && rec.books_capacity()
                && match r.stage {
                    BindStage::Decided => true,
                    BindStage::Binding => false,
                    BindStage::Bound => rec.bind_phase.is_some(),
                }
            {
                self.release(&uid);
            }
            // A pod that ended (the kubelet rejected it at admission, say, before the informer
            // ever showed it allocating) will never allocate: its reservation must not keep it
            // pending on the node, or every confusable pod waits there for good.
            if rec.terminal
                && self
                    .reservations
                    .get(uid.as_str())
                    .is_some_and(|r| r.stage != BindStage::Binding)
            {
                self.release(&uid);
            }
            if let Some(n) = rec.node.clone() {
                self.by_node
                    .entry(n.clone())
                    .or_default()
                    .insert(uid.clone());
                if rec.is_pending_allocation() {
                    self.pending_by_node
                        .entry(n.clone())
                        .or_default()
                        .insert(uid.clone());
                }
                if rec.is_decided_unbound() {
                    self.decided_by_node
                        .entry(n.clone())
                        .or_default()
                        .insert(uid.clone());
                }
                self.touch(Some(&n));
            }
            let entry = PodEntry::new(rec, &mut self.strings);
            if let Some(c) = entry.charge() {
                *self.charged.entry(entry.namespace.clone()).or_default() += c;
            }
            self.pods.insert(uid.into_boxed_str(), entry);
        }
    }

    fn drop_pod_record(&mut self, uid: &str) {
        let Some(old) = self.pods.remove(uid) else {
            return;
        };
        if let Some(n) = old.node.as_deref() {
            for index in [
                &mut self.by_node,
                &mut self.pending_by_node,
                &mut self.decided_by_node,
            ] {
                unindex(index, n, uid);
            }
            self.touch(Some(n));
        }
        if let Some(c) = old.charge()
            && let Some(total) = self.charged.get_mut(&*old.namespace)
        {
            *total -= c;
            if *total == Charge::default() {
                self.charged.remove(&*old.namespace);
            }
        }
        drop(old);
        self.strings.entry_dropped();
    }

    /// The pod is gone: forget it and release any reservation it held.
    pub fn remove_pod(&mut self, uid: &str) {
        self.live.remove(uid);
        self.nominations.remove(uid);
        self.drop_pod_record(uid);
        self.release(uid);
    }

    /// Usage of `uid` that counts now, and where: the reservation wins over the informer.
    fn effective(&self, uid: &str) -> Option<(&str, UsageRef<'_>)> {
        if let Some(r) = self.reservations.get(uid) {
            return Some((r.node.as_str(), UsageRef::Full(&r.usage)));
        }
        let p = self.pods.get(uid)?;
        if !p.books_capacity() {
            return None;
        }
        Some((p.node.as_deref()?, UsageRef::Compact(&p.usage)))
    }

    /// The MIG reservations of `uid`'s effective usage ([`Self::effective`]).
    fn effective_mig(&self, uid: &str) -> &[MigAllocation] {
        if let Some(r) = self.reservations.get(uid) {
            return &r.mig;
        }
        self.pods
            .get(uid)
            .and_then(|p| p.mig.as_deref())
            .unwrap_or_default()
    }

    /// The node `uid`'s effective usage is on (its reservation's, else its pod's), if any.
    pub fn effective_node(&self, uid: &str) -> Option<&str> {
        self.effective(uid).map(|(n, _)| n)
    }

    /// Keys of known objects of `kind` that are not in `keep` (a watcher re-listed them all).
    pub fn missing(&self, kind: ResyncKind, keep: &HashSet<String>) -> Vec<String> {
        match kind {
            ResyncKind::Nodes => self
                .nodes
                .keys()
                .filter(|k| !keep.contains(*k))
                .cloned()
                .collect(),
            ResyncKind::Pods => self
                .live
                .iter()
                .chain(self.pods.keys())
                .filter(|k| !keep.contains(&***k))
                .map(|k| k.to_string())
                .collect(),
            ResyncKind::Quotas => self
                .quotas
                .keys()
                .map(|(ns, n)| format!("{ns}/{n}"))
                .filter(|k| !keep.contains(k))
                .collect(),
        }
    }

    /// Clears everything (before a full rebuild).
    pub fn clear(&mut self) {
        *self = ClusterState::default();
    }
}

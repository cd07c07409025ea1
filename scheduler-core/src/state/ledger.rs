//! The in-flight ledger and the bind rule: decisions the informer does not show yet
//! ([`Reservation`], [`BindStage`]), which of them still count on a node, and which pending pod
//! keeps another off a node until the device plugin has served it ([`confusable_pending`]).

use super::*;

/// How far a reservation's pod has got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BindStage {
    /// Filter chose the node; no bind yet.
    Decided,
    /// The loop admitted the bind; the Binding call is in flight.
    Binding,
    /// The Binding call succeeded; pending until the informer shows the bind phase.
    Bound,
}

/// A decision the loop made that the informer may not show yet.
#[derive(Debug, Clone, PartialEq)]
pub struct Reservation {
    pub uid: String,
    pub namespace: String,
    pub name: String,
    pub node: String,
    pub devices: PodDevices,
    pub usage: Vec<DeviceUsage>,
    pub signature: AllocationSignature,
    /// The MIG instances of the decision (`hami.io/vgpu-mig-allocations`), empty for most pods:
    /// they occupy their placements while the pod is in flight.
    pub mig: Vec<MigAllocation>,
    pub stage: BindStage,
    /// Loop tick at creation, for the sweep.
    pub created_tick: u64,
}

impl ClusterState {
    /// Adds (or replaces) a reservation; it supersedes the informer's view of that pod.
    pub fn reserve(&mut self, r: Reservation) {
        self.release(&r.uid);
        self.touch(Some(&r.node.clone()));
        self.res_by_node
            .entry(r.node.clone())
            .or_default()
            .insert(r.uid.clone());
        self.reservations.insert(r.uid.clone(), r);
    }

    /// Drops the reservation of `uid`, if any. Returns whether there was one.
    pub fn release(&mut self, uid: &str) -> bool {
        match self.reservations.remove(uid) {
            Some(r) => {
                unindex(&mut self.res_by_node, &r.node, uid);
                self.touch(Some(&r.node));
                true
            }
            None => false,
        }
    }

    pub fn set_stage(&mut self, uid: &str, stage: BindStage) {
        if let Some(r) = self.reservations.get_mut(uid) {
            r.stage = stage;
        }
        // The pod ended while its Binding was in flight: no later update will release it.
        if stage == BindStage::Bound && self.pods.get(uid).is_some_and(|p| p.terminal) {
            self.release(uid);
        }
    }

    /// Releases reservations whose pod no longer exists and that are older than `grace_ticks`.
    /// Returns the released UIDs.
    pub fn sweep(&mut self, now_tick: u64, grace_ticks: u64) -> Vec<String> {
        let stale: Vec<String> = self
            .reservations
            .values()
            .filter(|r| {
                !self.is_live(&r.uid) && now_tick.saturating_sub(r.created_tick) >= grace_ticks
            })
            .map(|r| r.uid.clone())
            .collect();
        for uid in &stale {
            self.release(uid);
        }
        stale
    }

    /// Nodes where some pod may be pending allocation (a superset of the nodes for which
    /// [`Self::pending_on`] is not empty), so the filter asks only about those.
    pub fn nodes_with_pending(&self) -> NodeSet<'_> {
        let mut out = NodeSet::default();
        for r in self.reservations.values() {
            if r.stage != BindStage::Decided && self.gated(&r.node) {
                out.insert(r.node.as_str());
            }
        }
        for (node, uids) in &self.pending_by_node {
            if !uids.is_empty() && self.gated(node) {
                out.insert(node.as_str());
            }
        }
        out
    }

    /// Whether the pending-allocation gate applies on `node`: not where its device plugin tells
    /// admitted pods apart by pod-resources ([`NodeRecord::exact_identity`]). Such nodes stay off
    /// [`Self::nodes_with_pending`], so the filter's quick path answers for them even while pods
    /// are being allocated there.
    fn gated(&self, node: &str) -> bool {
        !self.nodes.get(node).is_some_and(|n| n.exact_identity)
    }

    /// The filter's superset of [`Self::nodes_with_pending`]: also the nodes where a pod was
    /// decided and is not bound yet (see [`Self::in_flight_on`]).
    pub fn nodes_in_flight(&self) -> NodeSet<'_> {
        let mut out = self.nodes_with_pending();
        for r in self.reservations.values() {
            if self.gated(&r.node) {
                out.insert(r.node.as_str());
            }
        }
        for (node, uids) in &self.decided_by_node {
            if !uids.is_empty() && self.gated(node) {
                out.insert(node.as_str());
            }
        }
        out
    }

    /// Whether `usage` still fits on `node` next to every other pod's effective usage (the
    /// bind-time re-check of a decision, e.g. one a previous leader made).
    pub fn usage_fits(&self, node: &str, uid: &str, usage: &[DeviceUsage]) -> bool {
        let Some(state) = self.build_node(node, Some(uid)) else {
            return false;
        };
        usage.iter().all(|u| {
            state
                .gpus
                .iter()
                .find(|g| g.uuid == u.uuid)
                .is_some_and(|g| {
                    u64::from(g.used) + u64::from(u.slots.max(1)) <= u64::from(g.count)
                        && u64::from(g.usedmem) + u64::from(u.mem) <= u64::from(g.totalmem)
                        && u64::from(g.usedcores) + u64::from(u.cores) <= u64::from(g.totalcore)
                })
        })
    }

    /// Whether the MIG reservations `mig` still fit on `node` next to every other pod's (the
    /// bind-time re-check): each names a healthy `mig` GPU of the node, and no two placements on
    /// one GPU overlap.
    pub fn mig_fits(&self, node: &str, uid: &str, mig: &[MigAllocation]) -> bool {
        if mig.is_empty() {
            return true;
        }
        let Some(state) = self.build_node(node, Some(uid)) else {
            return false;
        };
        let mut taken: Vec<(&str, hami_contract::mig::MigPlacement)> = Vec::new();
        for a in mig {
            let Some(g) = state.gpus.iter().find(|g| g.uuid == a.gpu_uuid) else {
                return false;
            };
            let Some(m) = g.mig.as_deref().filter(|_| g.health) else {
                return false;
            };
            if m.occupied().any(|p| p.overlaps(&a.placement))
                || taken
                    .iter()
                    .any(|(u, p)| *u == a.gpu_uuid && p.overlaps(&a.placement))
            {
                return false;
            }
            taken.push((&a.gpu_uuid, a.placement));
        }
        true
    }

    /// Pods pending allocation on `node` (informer view and binds the loop has accepted),
    /// except `exclude`.
    pub fn pending_on(&self, node: &str, exclude: &str) -> Vec<PendingPod<'_>> {
        let mut out = Vec::new();
        // The node's plugin tells admitted pods apart by pod-resources: nothing to wait for.
        if !self.gated(node) {
            return out;
        }
        self.push_pending(node, exclude, &mut out);
        out
    }

    fn push_pending<'s>(&'s self, node: &str, exclude: &str, out: &mut Vec<PendingPod<'s>>) {
        for uid in self.res_by_node.get(node).into_iter().flatten() {
            if let Some(r) = self.reservations.get(uid)
                && r.stage != BindStage::Decided
                && r.uid != exclude
            {
                out.push(PendingPod::of_reservation(r));
            }
        }
        if let Some(uids) = self.pending_by_node.get(node) {
            for uid in uids {
                // A pod whose bind the loop accepted is in the list already, as its reservation.
                if uid == exclude
                    || self
                        .reservations
                        .get(uid)
                        .is_some_and(|r| r.stage != BindStage::Decided && r.node == node)
                {
                    continue;
                }
                if let Some(p) = self.pods.get(uid.as_str())
                    && p.is_pending_allocation()
                    && let Some(signature) = p.signature.as_deref()
                {
                    out.push(PendingPod {
                        namespace: &p.namespace,
                        name: &p.name,
                        signature,
                    });
                }
            }
        }
    }

    /// What the filter checks on `node` before choosing it: [`Self::pending_on`], plus the pods
    /// a filter has already decided for `node` whose bind has not begun (reservations in
    /// [`BindStage::Decided`], and unbound pods whose decision the informer shows). kube-scheduler
    /// is about to bind those; a confusable pod decided for the same node now would have its
    /// bind refused by the gate and wait out kube-scheduler's error backoff (1 s, doubling to
    /// 10 s), while a filter answer that avoids the node costs nothing on a cluster with other
    /// nodes, and on a single node only waits for the next pod update. The bind gate itself
    /// ([`Self::pending_on`]) is unchanged: two decided pods must not refuse each other's bind.
    pub fn in_flight_on(&self, node: &str, exclude: &str) -> Vec<PendingPod<'_>> {
        let mut out = Vec::new();
        if !self.gated(node) {
            return out;
        }
        self.push_pending(node, exclude, &mut out);
        for uid in self.res_by_node.get(node).into_iter().flatten() {
            if let Some(r) = self.reservations.get(uid)
                && r.stage == BindStage::Decided
                && r.uid != exclude
            {
                out.push(PendingPod::of_reservation(r));
            }
        }
        for uid in self.decided_by_node.get(node).into_iter().flatten() {
            if uid == exclude || self.reservations.contains_key(uid) {
                continue;
            }
            if let Some(p) = self.pods.get(uid.as_str())
                && p.is_decided_unbound()
                && let Some(signature) = p.signature.as_deref()
            {
                out.push(PendingPod {
                    namespace: &p.namespace,
                    name: &p.name,
                    signature,
                });
            }
        }
        out
    }
}

/// A pod the gate compares a decision with ([`ClusterState::pending_on`]): borrowed from the
/// state, named only when it blocks one (a filter looks at every pending pod of every node it
/// evaluates fully).
#[derive(Debug, Clone, Copy)]
pub struct PendingPod<'a> {
    pub namespace: &'a str,
    pub name: &'a str,
    pub signature: &'a AllocationSignature,
}

impl<'a> PendingPod<'a> {
    fn of_reservation(r: &'a Reservation) -> Self {
        PendingPod {
            namespace: &r.namespace,
            name: &r.name,
            signature: &r.signature,
        }
    }
}

/// `namespace/name`.
impl std::fmt::Display for PendingPod<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

impl ClusterState {
    /// The pod that keeps `sig` off `node` now, out of `pending` ([`Self::pending_on`] or
    /// [`Self::in_flight_on`]): on a HAMi-plugin node any of them (that plugin serves whichever
    /// pod holds the node lock, so one bind at a time), elsewhere a confusable one
    /// ([`confusable_pending`]).
    pub fn blocking_pending<'a>(
        &self,
        node: &str,
        sig: &AllocationSignature,
        pending: &[PendingPod<'a>],
    ) -> Option<PendingPod<'a>> {
        if self.nodes.get(node).is_some_and(|n| n.hami_plugin) {
            return pending.first().copied();
        }
        confusable_pending(sig, pending)
    }

    /// Whether HAMi's device plugin serves `node` ([`NodeRecord::hami_plugin`]).
    pub fn is_hami_plugin_node(&self, node: &str) -> bool {
        self.nodes.get(node).is_some_and(|n| n.hami_plugin)
    }

    /// HAMi node locks the extender should remove: on HAMi-plugin nodes, a lock (`(node,
    /// value)`) whose holder is no longer pending allocation there (deleted, finished, failed,
    /// or allocated: HAMi's plugin releases the lock at `Allocate`, so a lock outliving that is
    /// one whose pod never reached or never finished it). HAMi leaves such a lock until its
    /// 5 minutes expire, and no other pod is placed on the node meanwhile.
    pub fn stale_hami_locks(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for (name, node) in &self.nodes {
            let Some(value) = node.hami_lock.as_deref().filter(|_| node.hami_plugin) else {
                continue;
            };
            let holder = hami_contract::nodelock::NodeLock::parse(value)
                .and_then(|l| l.holder)
                .map(|(ns, n)| format!("{ns}/{n}"));
            let live = holder.is_some_and(|h| {
                self.pending_on(name, "")
                    .iter()
                    .any(|pending| pending.to_string() == h)
            });
            if !live {
                out.push((name.clone(), value.to_owned()));
            }
        }
        out
    }
}

/// The bind gate of the allocation-identity protocol: the first pending pod on the node that the
/// device plugin could take for `sig` while it would get the wrong limits, if any.
pub fn confusable_pending<'a>(
    sig: &AllocationSignature,
    pending: &[PendingPod<'a>],
) -> Option<PendingPod<'a>> {
    pending
        .iter()
        .find(|p| sig.confusable_with(p.signature) && !sig.interchangeable_with(p.signature))
        .copied()
}

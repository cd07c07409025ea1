//! The extender's view of the cluster: nodes, GPU pods and quotas decoded from Kubernetes objects,
//! plus the in-memory reservation overlay the decision loop writes.
//!
//! Pure data and functions, no I/O: the decision loop feeds it from reflectors, `simulate` from a
//! file, the tests and benchmarks directly.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use hami_contract::annotations as ann;
use hami_contract::identity::AllocationSignature;
use hami_contract::usage::{DeviceUsage, collapse_pod_usage};
use hami_contract::{NodeDevice, PodDevices};
use k8s_openapi::api::core::v1::{Node, Pod, ResourceQuota};

use crate::config::DecisionConfig;
use crate::fit::{self, Charge, GpuState, NodeState, QuotaBudget, TopologyScores};
use crate::quota::{QuotaKeys, QuotaRecord, Quotas};

/// A node as registered by the device plugin.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeRecord {
    pub name: String,
    pub devices: Vec<NodeDevice>,
    pub cordoned: HashSet<String>,
    pub topology: Option<TopologyScores>,
    /// Why the node cannot take GPU pods (no or bad register annotation, no allocatable GPUs).
    pub unregistered: Option<String>,
    /// The node's device plugin identifies the pod under admission exactly
    /// (`tessera.io/allocation-identity: pod-resources`): the bind rule does not apply there.
    pub exact_identity: bool,
}

/// The topology scores of `hami.io/node-nvidia-score`, as fit wants them. An undecodable value
/// means "no topology information" (HAMi scores such pairs 0).
fn topology_scores(value: &str) -> Option<TopologyScores> {
    let entries = hami_contract::node::decode_pair_scores(value).ok()?;
    Some(
        entries
            .into_iter()
            .map(|e| (e.uuid, e.score.into_iter().collect()))
            .collect(),
    )
}

impl NodeRecord {
    pub fn from_node(node: &Node, cfg: &DecisionConfig) -> Option<Self> {
        let count_resource = cfg.nvidia.resources.count.as_str();
        let name = node.metadata.name.clone()?;
        let annotations = node.metadata.annotations.clone().unwrap_or_default();
        let cordoned: HashSet<String> = annotations
            .get(ann::DEVICE_CORDON)
            .map(|v| {
                hami_contract::policy::parse_device_cordon(v)
                    .into_iter()
                    .collect()
            })
            .unwrap_or_default();
        let topology = annotations
            .get(ann::NODE_SCORE)
            .and_then(|v| topology_scores(v));
        let (devices, mut unregistered) = match annotations.get(ann::NODE_REGISTER) {
            None => (Vec::new(), Some("node unregistered".to_owned())),
            Some(v) => match hami_contract::node::decode_node_devices(v) {
                Ok(d) => (d, None),
                Err(e) => (Vec::new(), Some(format!("node unregistered: {e}"))),
            },
        };
        // HAMi drops a node whose kubelet reports no allocatable GPUs (handshake, contract §2.3).
        let allocatable_zero = node
            .status
            .as_ref()
            .and_then(|s| s.allocatable.as_ref())
            .and_then(|a| a.get(count_resource))
            .is_some_and(|q| q.0.trim() == "0");
        let labels = node.metadata.labels.as_ref();
        let selected = cfg
            .node_selector
            .iter()
            .all(|(k, v)| labels.and_then(|l| l.get(k)) == Some(v));
        if unregistered.is_none() && !selected {
            unregistered =
                Some("node unregistered: does not match --node-label-selector".to_owned());
        }
        if unregistered.is_none() && allocatable_zero {
            unregistered = Some(format!(
                "node unregistered: allocatable {count_resource} is 0"
            ));
        }
        let exact_identity = annotations
            .get(ann::ALLOCATION_IDENTITY)
            .map(String::as_str)
            == Some(ann::IDENTITY_POD_RESOURCES);
        Some(NodeRecord {
            name,
            devices,
            cordoned,
            topology,
            unregistered,
            exact_identity,
        })
    }

    fn base_state(&self) -> NodeState {
        NodeState {
            name: self.name.clone(),
            gpus: self.devices.iter().map(GpuState::from_registered).collect(),
            cordoned: self.cordoned.clone(),
            topology: self.topology.clone(),
        }
    }
}

/// A pod carrying (or about to carry) an extender decision.
#[derive(Debug, Clone, PartialEq)]
pub struct PodRecord {
    pub uid: String,
    pub namespace: String,
    pub name: String,
    /// `hami.io/vgpu-node` (HAMi's accounting key), else `spec.nodeName`.
    pub node: Option<String>,
    /// `spec.nodeName`.
    pub bound_node: Option<String>,
    pub devices: PodDevices,
    pub usage: Vec<DeviceUsage>,
    pub bind_phase: Option<String>,
    pub terminal: bool,
    pub deleting: bool,
    pub signature: AllocationSignature,
    /// Problem decoding the allocation (the pod then books nothing).
    pub decode_error: Option<String>,
}

fn all_init_done(pod: &Pod) -> bool {
    let spec_init = pod
        .spec
        .as_ref()
        .and_then(|s| s.init_containers.as_ref())
        .map_or(0, Vec::len);
    if spec_init == 0 {
        return false;
    }
    let statuses = pod
        .status
        .as_ref()
        .and_then(|s| s.init_container_statuses.as_ref());
    match statuses {
        None => false,
        Some(st) => {
            st.len() == spec_init
                && st.iter().all(|c| {
                    c.state
                        .as_ref()
                        .and_then(|s| s.terminated.as_ref())
                        .is_some_and(|t| t.exit_code == 0)
                })
        }
    }
}

impl PodRecord {
    /// Reads a pod; `None` when it has no UID or carries no extender decision.
    pub fn from_pod(pod: &Pod) -> Option<Self> {
        let uid = pod.metadata.uid.clone()?;
        let annotations = pod.metadata.annotations.clone().unwrap_or_default();
        let allocated = annotations.get(ann::DEVICES_ALLOCATED)?;
        let bound_node = pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .filter(|n| !n.is_empty());
        let node = annotations
            .get(ann::VGPU_NODE)
            .cloned()
            .filter(|n| !n.is_empty())
            .or_else(|| bound_node.clone());
        let init_count = pod
            .spec
            .as_ref()
            .and_then(|s| s.init_containers.as_ref())
            .map_or(0, Vec::len);
        let (devices, decode_error) = match PodDevices::decode(allocated) {
            Ok(d) => (d, None),
            Err(e) => (PodDevices::default(), Some(e.to_string())),
        };
        let nvidia = devices.of_vendor(hami_contract::NVIDIA_VENDOR);
        let usage = collapse_pod_usage(&nvidia, init_count, all_init_done(pod));
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        let terminal = matches!(phase, Some("Succeeded") | Some("Failed"));
        let signature = AllocationSignature::new(&devices, &annotations);
        Some(PodRecord {
            uid,
            namespace: pod.metadata.namespace.clone().unwrap_or_default(),
            name: pod.metadata.name.clone().unwrap_or_default(),
            node,
            bound_node,
            devices,
            usage,
            bind_phase: annotations.get(ann::BIND_PHASE).cloned(),
            terminal,
            deleting: pod.metadata.deletion_timestamp.is_some(),
            signature,
            decode_error,
        })
    }

    /// Whether the pod books GPU capacity (contract §5.1), with one Tessera deviation: a pod that was
    /// never bound and whose bind failed books nothing (HAMi keeps it until rescheduled).
    pub fn books_capacity(&self) -> bool {
        !self.terminal
            && self.node.is_some()
            && !(self.bound_node.is_none()
                && self.bind_phase.as_deref() == Some(ann::BIND_PHASE_FAILED))
    }

    /// Pending on its node: bind started, the device plugin has not answered yet, the pod lives.
    pub fn is_pending_allocation(&self) -> bool {
        self.bind_phase.as_deref() == Some(ann::BIND_PHASE_ALLOCATING)
            && !self.terminal
            && !self.deleting
    }

    /// Decided for its node by a filter and not bound, with no bind begun (no bind phase yet):
    /// kube-scheduler is about to bind it there.
    pub fn is_decided_unbound(&self) -> bool {
        self.node.is_some()
            && self.bound_node.is_none()
            && self.bind_phase.is_none()
            && !self.terminal
            && !self.deleting
    }
}

/// Whether the state reads this annotation of a pod or node (HAMi's own `hami.io/` keys and the
/// `nvidia.com/` placement hints); others, such as `kubectl.kubernetes.io/last-applied-configuration`,
/// are dropped by [`slim_pod`] and [`slim_node`].
fn annotation_read(key: &str) -> bool {
    key.starts_with("hami.io/") || key.starts_with("nvidia.com/") || key == ann::ALLOCATION_IDENTITY
}

fn read_annotations(
    annotations: Option<BTreeMap<String, String>>,
) -> Option<BTreeMap<String, String>> {
    annotations.map(|mut a| {
        a.retain(|k, _| annotation_read(k));
        a
    })
}

/// A pod reduced to what [`ClusterState::upsert_pod`] reads (identity, HAMi annotations, node,
/// deletion, phase, init containers' names and statuses), so that a full List can be held until
/// the rebuild without holding every pod's spec, status and managed fields: at 10,000 pods that is
/// most of the daemon's memory (docs/benchmarks.md). The record built from it is the same.
pub fn slim_pod(pod: Pod) -> Pod {
    use k8s_openapi::api::core::v1::{Container, PodSpec, PodStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    let Pod {
        metadata,
        spec,
        status,
    } = pod;
    Pod {
        metadata: ObjectMeta {
            name: metadata.name,
            namespace: metadata.namespace,
            uid: metadata.uid,
            annotations: read_annotations(metadata.annotations),
            deletion_timestamp: metadata.deletion_timestamp,
            ..Default::default()
        },
        spec: spec.map(|s| PodSpec {
            node_name: s.node_name,
            init_containers: s.init_containers.map(|v| {
                v.into_iter()
                    .map(|c| Container {
                        name: c.name,
                        ..Default::default()
                    })
                    .collect()
            }),
            ..Default::default()
        }),
        status: status.map(|s| PodStatus {
            phase: s.phase,
            init_container_statuses: s.init_container_statuses,
            ..Default::default()
        }),
    }
}

/// A node reduced to what [`NodeRecord::from_node`] reads (name, labels, HAMi annotations,
/// allocatable), for the same reason as [`slim_pod`]: a Node's status (images, conditions) and
/// managed fields are most of its size.
pub fn slim_node(node: Node) -> Node {
    use k8s_openapi::api::core::v1::NodeStatus;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    let Node {
        metadata, status, ..
    } = node;
    Node {
        metadata: ObjectMeta {
            name: metadata.name,
            labels: metadata.labels,
            annotations: read_annotations(metadata.annotations),
            ..Default::default()
        },
        spec: None,
        status: status.map(|s| NodeStatus {
            allocatable: s.allocatable,
            ..Default::default()
        }),
    }
}

/// Charge of a collapsed usage against a namespace budget.
pub fn usage_charge(usage: &[DeviceUsage]) -> Charge {
    usage.iter().fold(Charge::default(), |c, u| Charge {
        mem: c.mem + u64::from(u.mem),
        cores: c.cores + u64::from(u.cores),
        count: c.count + u64::from(u.slots.max(1)),
    })
}

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
    pub stage: BindStage,
    /// Loop tick at creation, for the sweep.
    pub created_tick: u64,
}

/// A node's state with every effective usage applied, and why it cannot take GPU pods (copied
/// from its record so a filter needs one lookup per candidate).
#[derive(Debug, Clone)]
struct CachedNode {
    unregistered: Option<String>,
    /// The node's name, shared: a filter lists every fitting node by name, and cloning this
    /// costs a reference count instead of an allocation per node (the largest cost in the
    /// per-candidate loop after the lookups, by `perf`).
    name: std::sync::Arc<str>,
    state: NodeState,
    /// `fit::nvidia_mask` of `state.gpus`.
    nvidia: Vec<bool>,
}

/// A candidate node as the filter sees it.
#[derive(Debug)]
pub enum Candidate<'a> {
    /// Not registered, or registered with no usable GPUs: the reason string.
    Unregistered(&'a str),
    /// The node with usage, its `fit::nvidia_mask`, and its name (shared).
    Usable(
        std::borrow::Cow<'a, NodeState>,
        &'a [bool],
        &'a std::sync::Arc<str>,
    ),
}

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
    pods: HashMap<String, PodRecord>,
    /// UIDs of every pod known to exist (GPU or not), for the reservation sweep.
    live: HashSet<String>,
    by_node: HashMap<String, BTreeSet<String>>,
    /// Pods pending allocation (bind-phase `allocating`, alive) per node: the gate's index.
    pending_by_node: HashMap<String, BTreeSet<String>>,
    /// Pods decided for a node and not bound yet ([`PodRecord::is_decided_unbound`]) per node.
    decided_by_node: HashMap<String, BTreeSet<String>>,
    /// Reservation UIDs per node.
    res_by_node: HashMap<String, BTreeSet<String>>,
    quotas: Quotas,
    reservations: HashMap<String, Reservation>,
    /// Node states with all effective usage applied, rebuilt lazily.
    cache: HashMap<String, CachedNode>,
    dirty: HashSet<String>,
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

    pub fn pod(&self, uid: &str) -> Option<&PodRecord> {
        self.pods.get(uid)
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
        self.live.contains(uid)
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
        self.live.insert(uid.clone());
        self.drop_pod_record(&uid);
        if let Some(rec) = PodRecord::from_pod(pod) {
            // The informer caught up with our decision: the overlay is no longer needed. A
            // reservation in bind stays until the bind has returned and its phase is visible,
            // so the pending-allocation gate never loses sight of it.
            if let Some(r) = self.reservations.get(&uid)
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
                    .get(&uid)
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
            self.pods.insert(uid, rec);
        }
    }

    fn drop_pod_record(&mut self, uid: &str) {
        if let Some(old) = self.pods.remove(uid)
            && let Some(n) = old.node
        {
            if let Some(set) = self.by_node.get_mut(&n) {
                set.remove(uid);
            }
            if let Some(set) = self.pending_by_node.get_mut(&n) {
                set.remove(uid);
            }
            if let Some(set) = self.decided_by_node.get_mut(&n) {
                set.remove(uid);
            }
            self.touch(Some(&n));
        }
    }

    /// The pod is gone: forget it and release any reservation it held.
    pub fn remove_pod(&mut self, uid: &str) {
        self.live.remove(uid);
        self.drop_pod_record(uid);
        self.release(uid);
    }

    pub fn upsert_quota(&mut self, q: &ResourceQuota, keys: &QuotaKeys) {
        self.quotas.upsert(
            q.metadata.namespace.as_deref().unwrap_or_default(),
            q.metadata.name.as_deref().unwrap_or_default(),
            QuotaRecord::from_quota(q, keys),
        );
    }

    pub fn remove_quota(&mut self, namespace: &str, name: &str) {
        self.quotas.remove(namespace, name);
    }

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
                if let Some(set) = self.res_by_node.get_mut(&r.node) {
                    set.remove(uid);
                }
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
                !self.live.contains(&r.uid)
                    && now_tick.saturating_sub(r.created_tick) >= grace_ticks
            })
            .map(|r| r.uid.clone())
            .collect();
        for uid in &stale {
            self.release(uid);
        }
        stale
    }

    /// Usage of `uid` that counts now, and where: the reservation wins over the informer.
    fn effective(&self, uid: &str) -> Option<(&str, &[DeviceUsage])> {
        if let Some(r) = self.reservations.get(uid) {
            return Some((r.node.as_str(), r.usage.as_slice()));
        }
        let p = self.pods.get(uid)?;
        if !p.books_capacity() {
            return None;
        }
        Some((p.node.as_deref()?, p.usage.as_slice()))
    }

    fn build_node(&self, name: &str, exclude: Option<&str>) -> Option<NodeState> {
        let rec = self.nodes.get(name)?;
        let mut state = rec.base_state();
        let mut uids: BTreeSet<&str> = self
            .by_node
            .get(name)
            .map(|s| s.iter().map(String::as_str).collect())
            .unwrap_or_default();
        if let Some(res) = self.res_by_node.get(name) {
            uids.extend(res.iter().map(String::as_str));
        }
        for uid in uids {
            if Some(uid) == exclude {
                continue;
            }
            if let Some((n, usage)) = self.effective(uid)
                && n == name
            {
                fit::book_pod(&mut state, usage);
            }
        }
        Some(state)
    }

    fn refresh(&mut self) {
        let dirty: Vec<String> = self.dirty.drain().collect();
        for name in dirty {
            match self.build_node(&name, None) {
                Some(state) => {
                    let unregistered = self.nodes.get(&name).and_then(|r| r.unregistered.clone());
                    let nvidia = fit::nvidia_mask(&state.gpus);
                    self.cache.insert(
                        name,
                        CachedNode {
                            unregistered,
                            name: std::sync::Arc::from(state.name.as_str()),
                            state,
                            nvidia,
                        },
                    );
                }
                None => {
                    self.cache.remove(&name);
                }
            }
        }
    }

    /// Makes every node's usage current; call before [`Self::node_state`].
    pub fn prepare(&mut self) {
        self.refresh();
        // The cache only ever holds registered nodes, so equal sizes mean nothing is missing:
        // the per-filter cost stays independent of the cluster size when nothing changed.
        if self.cache.len() == self.nodes.len() {
            return;
        }
        for name in self.nodes.keys() {
            if !self.cache.contains_key(name) {
                self.dirty.insert(name.clone());
            }
        }
        self.refresh();
    }

    /// The node with all effective usage except that of `exclude` (the pod being filtered,
    /// whose previous decision HAMi drops first). Call [`Self::prepare`] first.
    pub fn node_state(
        &self,
        name: &str,
        exclude: Option<&str>,
    ) -> Option<std::borrow::Cow<'_, NodeState>> {
        if let Some(uid) = exclude
            && self.effective(uid).is_some_and(|(n, _)| n == name)
        {
            return self.build_node(name, exclude).map(std::borrow::Cow::Owned);
        }
        self.cache
            .get(name)
            .map(|c| std::borrow::Cow::Borrowed(&c.state))
    }

    /// The node `uid`'s effective usage is on (its reservation's, else its pod's), if any.
    pub fn effective_node(&self, uid: &str) -> Option<&str> {
        self.effective(uid).map(|(n, _)| n)
    }

    /// A filter candidate: `None` for a node the cluster does not have. `exclude_on` is
    /// [`Self::effective_node`] of `exclude`, computed once per filter. Call [`Self::prepare`]
    /// first.
    pub fn candidate(
        &self,
        name: &str,
        exclude: &str,
        exclude_on: Option<&str>,
    ) -> Option<Candidate<'_>> {
        let cached = self.cache.get(name)?;
        if let Some(why) = &cached.unregistered {
            return Some(Candidate::Unregistered(why));
        }
        if exclude_on == Some(name) {
            return self.build_node(name, Some(exclude)).map(|s| {
                Candidate::Usable(std::borrow::Cow::Owned(s), &cached.nvidia, &cached.name)
            });
        }
        Some(Candidate::Usable(
            std::borrow::Cow::Borrowed(&cached.state),
            &cached.nvidia,
            &cached.name,
        ))
    }

    /// Nodes where some pod may be pending allocation (a superset of the nodes for which
    /// [`Self::pending_on`] is not empty), so the filter asks only about those.
    pub fn nodes_with_pending(&self) -> HashSet<&str> {
        let mut out = HashSet::new();
        for r in self.reservations.values() {
            if r.stage != BindStage::Decided {
                out.insert(r.node.as_str());
            }
        }
        for (node, uids) in &self.pending_by_node {
            if !uids.is_empty() {
                out.insert(node.as_str());
            }
        }
        out
    }

    /// The filter's superset of [`Self::nodes_with_pending`]: also the nodes where a pod was
    /// decided and is not bound yet (see [`Self::in_flight_on`]).
    pub fn nodes_in_flight(&self) -> HashSet<&str> {
        let mut out = self.nodes_with_pending();
        for r in self.reservations.values() {
            out.insert(r.node.as_str());
        }
        for (node, uids) in &self.decided_by_node {
            if !uids.is_empty() {
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

    /// The namespace's budget: the minimum of every quota object's limits, and the usage of
    /// every pod and reservation of the namespace except `exclude`. `None` when unlimited.
    pub fn quota_budget(&self, namespace: &str, exclude: Option<&str>) -> Option<QuotaBudget> {
        let limits = self.quotas.namespace_limits(namespace);
        if limits.is_empty() {
            return None;
        }
        let used = self.namespace_usage(namespace, exclude);
        Some(QuotaBudget {
            mem_limit: limits.mem.map(|l| l.value),
            cores_limit: limits.cores.map(|l| l.value),
            count_limit: limits.count.map(|l| l.value),
            used_mem: used.mem,
            used_cores: used.cores,
            used_count: used.count,
        })
    }

    /// GPU usage charged to a namespace (placed pods plus in-flight reservations).
    pub fn namespace_usage(&self, namespace: &str, exclude: Option<&str>) -> Charge {
        let mut total = Charge::default();
        let uids = self
            .pods
            .values()
            .filter(|p| p.namespace == namespace)
            .map(|p| p.uid.as_str())
            .chain(
                self.reservations
                    .values()
                    .filter(|r| r.namespace == namespace)
                    .map(|r| r.uid.as_str()),
            )
            .collect::<BTreeSet<&str>>();
        for uid in uids {
            if Some(uid) == exclude {
                continue;
            }
            if let Some((_, usage)) = self.effective(uid) {
                let c = usage_charge(usage);
                total.mem += c.mem;
                total.cores += c.cores;
                total.count += c.count;
            }
        }
        total
    }

    /// Pods pending allocation on `node` (informer view and binds the loop has accepted),
    /// except `exclude`: `(namespace/name, signature)`.
    pub fn pending_on(&self, node: &str, exclude: &str) -> Vec<(String, &AllocationSignature)> {
        let mut out = Vec::new();
        // The node's plugin tells admitted pods apart by pod-resources: nothing to wait for.
        if self.nodes.get(node).is_some_and(|n| n.exact_identity) {
            return out;
        }
        let mut seen = HashSet::new();
        for uid in self.res_by_node.get(node).into_iter().flatten() {
            if let Some(r) = self.reservations.get(uid)
                && r.stage != BindStage::Decided
                && r.uid != exclude
            {
                seen.insert(r.uid.as_str());
                out.push((format!("{}/{}", r.namespace, r.name), &r.signature));
            }
        }
        if let Some(uids) = self.pending_by_node.get(node) {
            for uid in uids {
                if uid == exclude || seen.contains(uid.as_str()) {
                    continue;
                }
                if let Some(p) = self.pods.get(uid)
                    && p.is_pending_allocation()
                {
                    out.push((format!("{}/{}", p.namespace, p.name), &p.signature));
                }
            }
        }
        out
    }

    /// What the filter checks on `node` before choosing it: [`Self::pending_on`], plus the pods
    /// a filter has already decided for `node` whose bind has not begun (reservations in
    /// [`BindStage::Decided`], and unbound pods whose decision the informer shows). kube-scheduler
    /// is about to bind those; a confusable pod decided for the same node now would have its
    /// bind refused by the gate and wait out kube-scheduler's error backoff (1 s, doubling to
    /// 10 s), while a filter answer that avoids the node costs nothing on a cluster with other
    /// nodes, and on a single node only waits for the next pod update. The bind gate itself
    /// ([`Self::pending_on`]) is unchanged: two decided pods must not refuse each other's bind.
    pub fn in_flight_on(&self, node: &str, exclude: &str) -> Vec<(String, &AllocationSignature)> {
        let mut out = self.pending_on(node, exclude);
        if self.nodes.get(node).is_some_and(|n| n.exact_identity) {
            return out;
        }
        for uid in self.res_by_node.get(node).into_iter().flatten() {
            if let Some(r) = self.reservations.get(uid)
                && r.stage == BindStage::Decided
                && r.uid != exclude
            {
                out.push((format!("{}/{}", r.namespace, r.name), &r.signature));
            }
        }
        for uid in self.decided_by_node.get(node).into_iter().flatten() {
            if uid == exclude || self.reservations.contains_key(uid) {
                continue;
            }
            if let Some(p) = self.pods.get(uid)
                && p.is_decided_unbound()
            {
                out.push((format!("{}/{}", p.namespace, p.name), &p.signature));
            }
        }
        out
    }

    /// Every pod that books capacity now (informer view, reservations winning):
    /// `(namespace, name, node, collapsed usage)`.
    pub fn booked_pods(&self) -> Vec<(&str, &str, &str, &[DeviceUsage])> {
        let mut out = Vec::new();
        for r in self.reservations.values() {
            out.push((
                r.namespace.as_str(),
                r.name.as_str(),
                r.node.as_str(),
                r.usage.as_slice(),
            ));
        }
        for p in self.pods.values() {
            if self.reservations.contains_key(&p.uid) || !p.books_capacity() {
                continue;
            }
            if let Some(n) = p.node.as_deref() {
                out.push((p.namespace.as_str(), p.name.as_str(), n, p.usage.as_slice()));
            }
        }
        out
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
                .filter(|k| !keep.contains(*k))
                .cloned()
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

/// The bind gate of the allocation-identity protocol: the first pending pod on the node that the
/// device plugin could take for `sig` while it would get the wrong limits, if any.
pub fn confusable_pending<'a>(
    sig: &AllocationSignature,
    pending: &'a [(String, &AllocationSignature)],
) -> Option<&'a str> {
    pending
        .iter()
        .find(|(_, other)| sig.confusable_with(other) && !sig.interchangeable_with(other))
        .map(|(name, _)| name.as_str())
}

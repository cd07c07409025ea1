//! The extender's view of the cluster: nodes, GPU pods and quotas decoded from Kubernetes objects,
//! plus the in-memory reservation overlay the decision loop writes.
//!
//! Pure data and functions, no I/O: the decision loop feeds it from reflectors, `simulate` from a
//! file, the tests and benchmarks directly.

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
    /// HAMi's own device plugin serves the node (label `tessera.io/device-plugin: hami`): binds
    /// take HAMi's node lock and only one is in flight at a time, since that plugin finds the pod
    /// under admission by the lock alone.
    pub hami_plugin: bool,
    /// The node's `hami.io/mutex.lock` value, on HAMi-plugin nodes.
    pub hami_lock: Option<String>,
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
                // HAMi keeps no device entry for a node that registered none: "node
                // unregistered", not NodeInsufficientDevice.
                Ok(d) if d.is_empty() => (
                    d,
                    Some("node unregistered: its register annotation lists no device".to_owned()),
                ),
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
        let hami_plugin = labels
            .and_then(|l| l.get(ann::DEVICE_PLUGIN_LABEL))
            .map(String::as_str)
            == Some(ann::DEVICE_PLUGIN_HAMI);
        let hami_lock = hami_plugin
            .then(|| annotations.get(ann::NODE_LOCK).cloned())
            .flatten();
        Some(NodeRecord {
            name,
            devices,
            cordoned,
            topology,
            unregistered,
            exact_identity,
            hami_plugin,
            hami_lock,
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
    /// `hami.io/vgpu-mig-allocations` (contract §6.4); empty when absent or undecodable (HAMi
    /// ignores an undecodable value).
    pub mig: Vec<MigAllocation>,
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
        let mig = annotations
            .get(ann::MIG_ALLOCATIONS)
            .and_then(|v| hami_contract::mig::decode_allocations(v).ok())
            .unwrap_or_default();
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
            mig,
        })
    }

    fn phase(&self) -> PodPhase<'_> {
        PodPhase {
            has_node: self.node.is_some(),
            bound: self.bound_node.is_some(),
            bind_phase: self.bind_phase.as_deref(),
            terminal: self.terminal,
            deleting: self.deleting,
        }
    }

    /// Whether the pod books GPU capacity (contract §5.1), with one Tessera deviation: a pod that was
    /// never bound and whose bind failed books nothing (HAMi keeps it until rescheduled).
    pub fn books_capacity(&self) -> bool {
        self.phase().books_capacity()
    }

    /// Pending on its node: bind started, the device plugin has not answered yet, the pod lives.
    pub fn is_pending_allocation(&self) -> bool {
        self.phase().is_pending_allocation()
    }

    /// Decided for its node by a filter and not bound, with no bind begun (no bind phase yet):
    /// kube-scheduler is about to bind it there.
    pub fn is_decided_unbound(&self) -> bool {
        self.phase().is_decided_unbound()
    }
}

/// What the predicates of [`PodRecord`] read, shared with the state's compact [`PodEntry`].
#[derive(Debug, Clone, Copy)]
struct PodPhase<'a> {
    has_node: bool,
    bound: bool,
    bind_phase: Option<&'a str>,
    terminal: bool,
    deleting: bool,
}

impl PodPhase<'_> {
    fn books_capacity(self) -> bool {
        // A bind that failed before the pod was ever bound leaves nothing booked.
        let bind_failed_unbound = !self.bound && self.bind_phase == Some(ann::BIND_PHASE_FAILED);
        !self.terminal && self.has_node && !bind_failed_unbound
    }

    fn is_pending_allocation(self) -> bool {
        self.bind_phase == Some(ann::BIND_PHASE_ALLOCATING) && !self.terminal && !self.deleting
    }

    fn is_decided_unbound(self) -> bool {
        self.has_node
            && !self.bound
            && self.bind_phase.is_none()
            && !self.terminal
            && !self.deleting
    }
}

/// Strings many pod entries repeat (node names, namespaces, GPU UUIDs, vendors, bind phases),
/// kept once. Strings no entry holds any more are dropped from time to time.
#[derive(Debug, Default)]
struct Strings {
    /// The default (keyed) hasher: pods name these strings.
    set: HashSet<std::sync::Arc<str>>,
    /// Entries dropped since the last collection.
    dropped: usize,
}

impl Strings {
    fn get(&mut self, s: &str) -> std::sync::Arc<str> {
        if let Some(a) = self.set.get(s) {
            return a.clone();
        }
        let a: std::sync::Arc<str> = std::sync::Arc::from(s);
        self.set.insert(a.clone());
        a
    }

    /// An entry holding some of these strings went away: collect once as many entries went as
    /// there are strings (amortised O(1) per entry).
    fn entry_dropped(&mut self) {
        self.dropped += 1;
        if self.dropped > self.set.len().max(1024) {
            self.set.retain(|a| std::sync::Arc::strong_count(a) > 1);
            self.set.shrink_to_fit();
            self.dropped = 0;
        }
    }
}

/// One device of a pod's container device list, with shared strings.
#[derive(Debug, Clone)]
struct Device {
    uuid: std::sync::Arc<str>,
    vendor: std::sync::Arc<str>,
    usedmem: u32,
    usedcores: u32,
}

/// One collapsed usage entry ([`DeviceUsage`]), with shared strings.
#[derive(Debug, Clone)]
struct Usage {
    uuid: std::sync::Arc<str>,
    vendor: std::sync::Arc<str>,
    slots: u32,
    mem: u32,
    cores: u32,
}

/// A [`PodRecord`] as the state keeps it: the same information in a fifth of the memory (at
/// 50,000 pods the records were most of the loop's state). Repeated strings are shared, lists
/// are exact-sized, and the allocation signature is kept only for the pods the bind gate reads
/// it of (pending allocation, decided and not bound); for the others it is derived again from
/// the devices and the pod's placement constraints when the record is asked for.
#[derive(Debug, Clone)]
struct PodEntry {
    namespace: std::sync::Arc<str>,
    name: Box<str>,
    node: Option<std::sync::Arc<str>>,
    bound_node: Option<std::sync::Arc<str>>,
    bind_phase: Option<std::sync::Arc<str>>,
    terminal: bool,
    deleting: bool,
    devices: Box<[Box<[Device]>]>,
    usage: Box<[Usage]>,
    signature: Option<Box<AllocationSignature>>,
    /// The signature's placement constraints when the signature is not kept.
    constraints: Box<[(Box<str>, Box<str>)]>,
    decode_error: Option<Box<str>>,
    /// [`PodRecord::mig`], kept only for the pods that have MIG reservations.
    mig: Option<Box<[MigAllocation]>>,
}

impl PodEntry {
    fn new(rec: PodRecord, strings: &mut Strings) -> PodEntry {
        let keep_signature = rec.is_pending_allocation() || rec.is_decided_unbound();
        let PodRecord {
            uid: _,
            namespace,
            name,
            node,
            bound_node,
            devices,
            usage,
            bind_phase,
            terminal,
            deleting,
            signature,
            decode_error,
            mig,
        } = rec;
        let devices = devices
            .0
            .iter()
            .map(|c| {
                c.iter()
                    .map(|d| Device {
                        uuid: strings.get(&d.uuid),
                        vendor: strings.get(&d.vendor),
                        usedmem: d.usedmem,
                        usedcores: d.usedcores,
                    })
                    .collect()
            })
            .collect();
        let usage = usage
            .iter()
            .map(|u| Usage {
                uuid: strings.get(&u.uuid),
                vendor: strings.get(&u.vendor),
                slots: u.slots,
                mem: u.mem,
                cores: u.cores,
            })
            .collect();
        let (signature, constraints) = if keep_signature {
            (Some(Box::new(signature)), Box::default())
        } else {
            let constraints = signature
                .constraints
                .into_iter()
                .map(|(k, v)| (k.into_boxed_str(), v.into_boxed_str()))
                .collect();
            (None, constraints)
        };
        PodEntry {
            namespace: strings.get(&namespace),
            name: name.into_boxed_str(),
            node: node.map(|n| strings.get(&n)),
            bound_node: bound_node.map(|n| strings.get(&n)),
            bind_phase: bind_phase.map(|p| strings.get(&p)),
            terminal,
            deleting,
            devices,
            usage,
            signature,
            constraints,
            decode_error: decode_error.map(String::into_boxed_str),
            mig: (!mig.is_empty()).then(|| mig.into_boxed_slice()),
        }
    }

    fn phase(&self) -> PodPhase<'_> {
        PodPhase {
            has_node: self.node.is_some(),
            bound: self.bound_node.is_some(),
            bind_phase: self.bind_phase.as_deref(),
            terminal: self.terminal,
            deleting: self.deleting,
        }
    }

    fn books_capacity(&self) -> bool {
        self.phase().books_capacity()
    }

    fn is_pending_allocation(&self) -> bool {
        self.phase().is_pending_allocation()
    }

    fn is_decided_unbound(&self) -> bool {
        self.phase().is_decided_unbound()
    }

    /// The record [`PodRecord::from_pod`] built.
    fn record(&self, uid: &str) -> PodRecord {
        let devices = PodDevices(
            self.devices
                .iter()
                .map(|c| {
                    c.iter()
                        .map(|d| hami_contract::ContainerDevice {
                            uuid: d.uuid.to_string(),
                            vendor: d.vendor.to_string(),
                            usedmem: d.usedmem,
                            usedcores: d.usedcores,
                        })
                        .collect()
                })
                .collect(),
        );
        let signature = match &self.signature {
            Some(s) => (**s).clone(),
            None => {
                let constraints: BTreeMap<String, String> = self
                    .constraints
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect();
                AllocationSignature::new(&devices, &constraints)
            }
        };
        PodRecord {
            uid: uid.to_owned(),
            namespace: self.namespace.to_string(),
            name: self.name.to_string(),
            node: self.node.as_deref().map(str::to_owned),
            bound_node: self.bound_node.as_deref().map(str::to_owned),
            devices,
            usage: UsageRef::Compact(&self.usage).to_vec(),
            bind_phase: self.bind_phase.as_deref().map(str::to_owned),
            terminal: self.terminal,
            deleting: self.deleting,
            signature,
            decode_error: self.decode_error.as_deref().map(str::to_owned),
            mig: self.mig.as_deref().map(<[_]>::to_vec).unwrap_or_default(),
        }
    }
}

/// A pod's collapsed usage as the state holds it: a reservation's list, or a pod entry's.
#[derive(Debug, Clone, Copy)]
enum UsageRef<'a> {
    Full(&'a [DeviceUsage]),
    Compact(&'a [Usage]),
}

impl<'a> UsageRef<'a> {
    /// `(uuid, slots, mem, cores)` of every entry.
    fn each(self, mut f: impl FnMut(&str, u32, u32, u32)) {
        match self {
            UsageRef::Full(u) => u.iter().for_each(|u| f(&u.uuid, u.slots, u.mem, u.cores)),
            UsageRef::Compact(u) => u.iter().for_each(|u| f(&u.uuid, u.slots, u.mem, u.cores)),
        }
    }

    fn to_vec(self) -> Vec<DeviceUsage> {
        self.to_cow().into_owned()
    }

    fn to_cow(self) -> std::borrow::Cow<'a, [DeviceUsage]> {
        match self {
            UsageRef::Full(u) => std::borrow::Cow::Borrowed(u),
            UsageRef::Compact(u) => std::borrow::Cow::Owned(
                u.iter()
                    .map(|u| DeviceUsage {
                        uuid: u.uuid.to_string(),
                        vendor: u.vendor.to_string(),
                        slots: u.slots,
                        mem: u.mem,
                        cores: u.cores,
                    })
                    .collect(),
            ),
        }
    }

    /// [`usage_charge`].
    fn charge(self) -> Charge {
        let mut c = Charge::default();
        self.each(|_, slots, mem, cores| {
            c.mem += u64::from(mem);
            c.cores += u64::from(cores);
            c.count += u64::from(slots.max(1));
        });
        c
    }

    /// [`fit::book_pod`].
    fn book(self, node: &mut NodeState) {
        self.each(|uuid, slots, mem, cores| {
            if let Some(g) = node.gpus.iter_mut().find(|g| g.uuid == uuid) {
                g.book_usage(slots, mem, cores);
            }
        });
    }
}

/// Whether the state reads this annotation of a node (HAMi's own `hami.io/` keys and the
/// `nvidia.com/` placement hints); others, such as `kubectl.kubernetes.io/last-applied-configuration`,
/// are dropped by [`slim_node`].
fn annotation_read(key: &str) -> bool {
    key.starts_with("hami.io/") || key.starts_with("nvidia.com/") || key == ann::ALLOCATION_IDENTITY
}

/// Whether [`PodRecord::from_pod`] reads this annotation of a pod: the decision, its node, the
/// bind phase, and the placement constraints of the allocation signature. The rest of HAMi's
/// (`hami.io/vgpu-time`, `hami.io/bind-time`, `hami.io/vgpu-devices-to-allocate`, …) is dropped
/// by [`slim_pod`]: at 50,000 pods they were 12 MiB of the List buffers.
fn pod_annotation_read(key: &str) -> bool {
    key == ann::DEVICES_ALLOCATED
        || key == ann::MIG_ALLOCATIONS
        || key == ann::VGPU_NODE
        || key == ann::BIND_PHASE
        || hami_contract::identity::PLACEMENT_CONSTRAINT_ANNOTATIONS.contains(&key)
}

fn read_annotations(
    annotations: Option<BTreeMap<String, String>>,
) -> Option<BTreeMap<String, String>> {
    annotations.map(|mut a| {
        a.retain(|k, _| annotation_read(k));
        a
    })
}

/// A pod reduced to what [`ClusterState::upsert_pod`] reads (identity, the HAMi annotations
/// [`PodRecord::from_pod`] reads, node, deletion, phase, init containers' names and statuses), so that a full List can be held until
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
            // A pod without a decision only marks liveness: nothing of its annotations is read.
            annotations: metadata
                .annotations
                .filter(|a| a.contains_key(ann::DEVICES_ALLOCATED))
                .map(|mut a| {
                    a.retain(|k, _| pod_annotation_read(k));
                    a
                }),
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

/// A pod that books capacity: `(namespace, name, node, collapsed usage)`.
pub type BookedPod<'a> = (
    &'a str,
    &'a str,
    &'a str,
    std::borrow::Cow<'a, [DeviceUsage]>,
);

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

/// A node's state with every effective usage applied, and why it cannot take GPU pods (copied
/// from its record so a filter needs one lookup per candidate).
#[derive(Debug, Clone)]
struct CachedNode {
    unregistered: Option<String>,
    state: NodeState,
    /// `fit::nvidia_mask` of `state.gpus`.
    nvidia: Vec<bool>,
}

/// What the filter's quick path reads of a cached node, kept apart from the rest in one dense
/// array: at 5,000 candidates the filter's cost was the cache misses of reaching each node
/// (the hash map's entry, the key's buffer, the node's GPUs), by `perf`.
/// Line-aligned, with what a fitting node is decided by in its first line.
#[derive(Debug)]
#[repr(C, align(64))]
struct HotNode {
    /// The slot holds a node (a removed node's slot waits for reuse).
    occupied: bool,
    registered: bool,
    summary: NodeSummary,
}

/// Bytes of a node name kept inside the cache's hash table (longer names go to the heap).
const INLINE_NAME: usize = 22;

/// A node name as the cache's hash table keeps it: inline when short (most are), so that
/// finding a node does not read a separate buffer to compare the key.
#[derive(Debug, Clone)]
enum NodeKey {
    Inline(u8, [u8; INLINE_NAME]),
    Heap(Box<[u8]>),
}

impl NodeKey {
    fn new(name: &str) -> Self {
        let b = name.as_bytes();
        match u8::try_from(b.len()) {
            Ok(n) if b.len() <= INLINE_NAME => {
                let mut bytes = [0u8; INLINE_NAME];
                bytes[..b.len()].copy_from_slice(b);
                NodeKey::Inline(n, bytes)
            }
            _ => NodeKey::Heap(b.into()),
        }
    }

    fn bytes(&self) -> &[u8] {
        match self {
            NodeKey::Inline(n, bytes) => &bytes[..usize::from(*n)],
            NodeKey::Heap(b) => b,
        }
    }
}

impl std::borrow::Borrow<[u8]> for NodeKey {
    fn borrow(&self) -> &[u8] {
        self.bytes()
    }
}

impl PartialEq for NodeKey {
    fn eq(&self, other: &Self) -> bool {
        self.bytes() == other.bytes()
    }
}

impl Eq for NodeKey {}

impl std::hash::Hash for NodeKey {
    /// As the borrowed form (`[u8]`) hashes, which lookups use.
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.bytes().hash(state);
    }
}

/// The per-node usage cache, in slots: the full state for the full evaluation, and the quick
/// path's [`HotNode`]s in a dense array beside it.
#[derive(Debug, Default)]
struct NodeCache {
    slot_of: HashMap<NodeKey, usize, NameHash>,
    cold: Vec<Option<CachedNode>>,
    hot: Vec<HotNode>,
    /// Each slot's node name, shared: a filter lists every fitting node by name, and cloning
    /// this costs a reference count instead of an allocation per node. Kept across refreshes.
    names: Vec<std::sync::Arc<str>>,
    free: Vec<usize>,
}

impl NodeCache {
    fn len(&self) -> usize {
        self.slot_of.len()
    }

    fn contains(&self, name: &str) -> bool {
        self.slot_of.contains_key(name.as_bytes())
    }

    fn get(&self, name: &str) -> Option<(&CachedNode, &std::sync::Arc<str>)> {
        let slot = *self.slot_of.get(name.as_bytes())?;
        Some((self.cold[slot].as_ref()?, &self.names[slot]))
    }

    fn insert(&mut self, name: String, node: CachedNode, summary: NodeSummary) {
        let registered = node.unregistered.is_none();
        if let Some(&slot) = self.slot_of.get(name.as_bytes()) {
            self.cold[slot] = Some(node);
            let hot = &mut self.hot[slot];
            hot.registered = registered;
            hot.summary = summary;
            return;
        }
        let hot = HotNode {
            occupied: true,
            registered,
            summary,
        };
        let shared = std::sync::Arc::from(name.as_str());
        let slot = match self.free.pop() {
            Some(slot) => {
                self.cold[slot] = Some(node);
                self.hot[slot] = hot;
                self.names[slot] = shared;
                slot
            }
            None => {
                self.cold.push(Some(node));
                self.hot.push(hot);
                self.names.push(shared);
                self.cold.len() - 1
            }
        };
        self.slot_of.insert(NodeKey::new(&name), slot);
    }

    fn remove(&mut self, name: &str) {
        if let Some(slot) = self.slot_of.remove(name.as_bytes()) {
            self.cold[slot] = None;
            let hot = &mut self.hot[slot];
            hot.occupied = false;
            hot.registered = false;
            hot.summary = NodeSummary::default();
            self.free.push(slot);
        }
    }
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

/// Where the state's cache keeps a node ([`ClusterState::node_slot`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeSlot(usize);

/// A candidate node as the filter's quick path sees it ([`ClusterState::quick_candidate`]).
#[derive(Debug)]
pub enum QuickCandidate<'a> {
    /// Not registered, or registered with no usable GPUs: the reason string.
    Unregistered(&'a str),
    /// The node's name (shared) and the summary of its cached state.
    Usable(&'a std::sync::Arc<str>, &'a NodeSummary),
}

/// The hasher of the maps and sets keyed by node name, which the filter reads once per
/// candidate: SipHash was 9 % of the per-candidate cost (docs/benchmarks.md). foldhash is
/// hashbrown's default: a few multiplications per word, seeded per process.
pub type NameHash = foldhash::fast::RandomState;

/// A set of node names, as [`ClusterState::nodes_in_flight`] returns it.
pub type NodeSet<'a> = HashSet<&'a str, NameHash>;

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
    /// Pods pending allocation (bind-phase `allocating`, alive) per node: the gate's index.
    pending_by_node: HashMap<String, BTreeSet<String>>,
    /// Pods decided for a node and not bound yet ([`PodRecord::is_decided_unbound`]) per node.
    decided_by_node: HashMap<String, BTreeSet<String>>,
    /// Reservation UIDs per node.
    res_by_node: HashMap<String, BTreeSet<String>>,
    quotas: Quotas,
    reservations: HashMap<String, Reservation>,
    /// Node states with all effective usage applied, rebuilt lazily.
    cache: NodeCache,
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

    /// The record of a GPU pod, as [`PodRecord::from_pod`] built it (rebuilt from the state's
    /// compact entry; for a plain question, [`Self::pod_books_capacity`] builds nothing).
    pub fn pod(&self, uid: &str) -> Option<PodRecord> {
        self.pods.get(uid).map(|p| p.record(uid))
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
            self.live.insert(uid.into_boxed_str());
            return;
        };
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
            self.pods.insert(uid.into_boxed_str(), entry);
        }
    }

    fn drop_pod_record(&mut self, uid: &str) {
        let Some(old) = self.pods.remove(uid) else {
            return;
        };
        if let Some(n) = old.node.as_deref() {
            if let Some(set) = self.by_node.get_mut(n) {
                set.remove(uid);
            }
            if let Some(set) = self.pending_by_node.get_mut(n) {
                set.remove(uid);
            }
            if let Some(set) = self.decided_by_node.get_mut(n) {
                set.remove(uid);
            }
            self.touch(Some(n));
        }
        drop(old);
        self.strings.entry_dropped();
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
                !self.is_live(&r.uid) && now_tick.saturating_sub(r.created_tick) >= grace_ticks
            })
            .map(|r| r.uid.clone())
            .collect();
        for uid in &stale {
            self.release(uid);
        }
        stale
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

    fn build_node(&self, name: &str, exclude: Option<&str>) -> Option<NodeState> {
        let rec = self.nodes.get(name)?;
        let mut state = rec.base_state();
        let has_mig = state.gpus.iter().any(|g| g.mode == fit::MIG_MODE);
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
                usage.book(&mut state);
                // HAMi's occupancy rebuild of MIG reservations (contract §6.4), only where
                // there is something to do: a `mig` GPU on the node, or reservations.
                let mig = self.effective_mig(uid);
                if has_mig || !mig.is_empty() {
                    let mut used: Vec<String> = Vec::new();
                    usage.each(|u, _, _, _| used.push(u.to_owned()));
                    fit::book_pod_mig(&mut state, used.iter().map(String::as_str), mig);
                }
            }
        }
        Some(state)
    }

    fn refresh(&mut self) {
        let mut dirty: Vec<String> = self.dirty.drain().collect();
        // In name order: a new cluster's nodes then take slots (and their shared names memory)
        // in the order candidate lists usually come in, which the filter's reads then follow.
        dirty.sort_unstable();
        for name in dirty {
            match self.build_node(&name, None) {
                Some(state) => {
                    let unregistered = self.nodes.get(&name).and_then(|r| r.unregistered.clone());
                    let nvidia = fit::nvidia_mask(&state.gpus);
                    let summary = NodeSummary::new(&state, &nvidia);
                    self.cache.insert(
                        name,
                        CachedNode {
                            unregistered,
                            state,
                            nvidia,
                        },
                        summary,
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
            if !self.cache.contains(name) {
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
            .map(|(c, _)| std::borrow::Cow::Borrowed(&c.state))
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
        let (cached, shared) = self.cache.get(name)?;
        if let Some(why) = &cached.unregistered {
            return Some(Candidate::Unregistered(why));
        }
        if exclude_on == Some(name) {
            return self
                .build_node(name, Some(exclude))
                .map(|s| Candidate::Usable(std::borrow::Cow::Owned(s), &cached.nvidia, shared));
        }
        Some(Candidate::Usable(
            std::borrow::Cow::Borrowed(&cached.state),
            &cached.nvidia,
            shared,
        ))
    }

    /// A filter candidate for the quick path: its summary reflects every effective usage, so
    /// it is not for the node the filtered pod's own earlier decision is on (use
    /// [`Self::candidate`] there). `None` for a node the cluster does not have. Call
    /// [`Self::prepare`] first.
    pub fn quick_candidate(&self, name: &str) -> Option<QuickCandidate<'_>> {
        self.node_slot(name).map(|s| self.quick_at(s))
    }

    /// Where the cache keeps node `name`, for [`Self::quick_at`]; `None` for a node the
    /// cluster does not have. Valid until the state changes. Finding every candidate's slot
    /// first, in one pass, lets the processor overlap the lookups' memory reads.
    pub fn node_slot(&self, name: &str) -> Option<NodeSlot> {
        self.cache
            .slot_of
            .get(name.as_bytes())
            .map(|s| NodeSlot(*s))
    }

    /// [`Self::node_slot`] when node `name` is at `guess` (`None` when it is not there, which
    /// says nothing of where it is). Candidate lists tend to name nodes in the order the cache
    /// took them (by name, when it was built), and checking the next slot reads memory the
    /// quick path reads anyway, where a lookup reads the hash table at random.
    pub fn node_slot_at(&self, name: &str, guess: NodeSlot) -> Option<NodeSlot> {
        let hot = self.cache.hot.get(guess.0)?;
        (hot.occupied && *self.cache.names[guess.0] == *name).then_some(guess)
    }

    /// The slot after `slot`, as a guess for [`Self::node_slot_at`].
    pub fn next_slot(slot: NodeSlot) -> NodeSlot {
        NodeSlot(slot.0 + 1)
    }

    /// [`Self::quick_candidate`] of the node at `slot`.
    pub fn quick_at(&self, slot: NodeSlot) -> QuickCandidate<'_> {
        let hot = &self.cache.hot[slot.0];
        if !hot.registered {
            let why = self.cache.cold[slot.0]
                .as_ref()
                .and_then(|c| c.unregistered.as_deref());
            return QuickCandidate::Unregistered(why.unwrap_or_default());
        }
        QuickCandidate::Usable(&self.cache.names[slot.0], &hot.summary)
    }

    /// Nodes where some pod may be pending allocation (a superset of the nodes for which
    /// [`Self::pending_on`] is not empty), so the filter asks only about those.
    pub fn nodes_with_pending(&self) -> NodeSet<'_> {
        let mut out = NodeSet::default();
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
    pub fn nodes_in_flight(&self) -> NodeSet<'_> {
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
            .iter()
            .filter(|(_, p)| *p.namespace == *namespace)
            .map(|(uid, _)| &**uid)
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
                let c = usage.charge();
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
                if let Some(p) = self.pods.get(uid.as_str())
                    && p.is_pending_allocation()
                    && let Some(sig) = p.signature.as_deref()
                {
                    out.push((format!("{}/{}", p.namespace, p.name), sig));
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
            if let Some(p) = self.pods.get(uid.as_str())
                && p.is_decided_unbound()
                && let Some(sig) = p.signature.as_deref()
            {
                out.push((format!("{}/{}", p.namespace, p.name), sig));
            }
        }
        out
    }

    /// Every pod that books capacity now (informer view, reservations winning):
    /// `(namespace, name, node, collapsed usage)`.
    pub fn booked_pods(&self) -> Vec<BookedPod<'_>> {
        let mut out = Vec::new();
        for r in self.reservations.values() {
            out.push((
                r.namespace.as_str(),
                r.name.as_str(),
                r.node.as_str(),
                std::borrow::Cow::Borrowed(r.usage.as_slice()),
            ));
        }
        for (uid, p) in &self.pods {
            if self.reservations.contains_key(&**uid) || !p.books_capacity() {
                continue;
            }
            if let Some(n) = p.node.as_deref() {
                out.push((
                    &*p.namespace,
                    &*p.name,
                    n,
                    UsageRef::Compact(&p.usage).to_cow(),
                ));
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

impl ClusterState {
    /// The pod that keeps `sig` off `node` now, out of `pending` ([`Self::pending_on`] or
    /// [`Self::in_flight_on`]): on a HAMi-plugin node any of them (that plugin serves whichever
    /// pod holds the node lock, so one bind at a time), elsewhere a confusable one
    /// ([`confusable_pending`]).
    pub fn blocking_pending<'a>(
        &self,
        node: &str,
        sig: &AllocationSignature,
        pending: &'a [(String, &AllocationSignature)],
    ) -> Option<&'a str> {
        if self.nodes.get(node).is_some_and(|n| n.hami_plugin) {
            return pending.first().map(|(name, _)| name.as_str());
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
                    .any(|(pending, _)| *pending == h)
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
    pending: &'a [(String, &AllocationSignature)],
) -> Option<&'a str> {
    pending
        .iter()
        .find(|(_, other)| sig.confusable_with(other) && !sig.interchangeable_with(other))
        .map(|(name, _)| name.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The quick path's node is four cache lines, the first holding what decides a fitting
    /// node (its score, the fixed reason's word, the first GPU).
    #[test]
    fn a_hot_node_is_four_cache_lines() {
        assert_eq!(std::mem::size_of::<HotNode>(), 256);
        assert_eq!(std::mem::align_of::<HotNode>(), 64);
    }
}

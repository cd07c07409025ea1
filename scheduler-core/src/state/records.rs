//! What the state keeps of a Node and of a GPU pod ([`NodeRecord`], [`PodRecord`]), decoded from
//! the Kubernetes objects, and the slimming that lets a full List be held until a rebuild
//! ([`slim_pod`], [`slim_node`]).

use super::*;

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
pub(super) fn topology_scores(value: &str) -> Option<TopologyScores> {
    let entries = hami_contract::node::decode_pair_scores(value).ok()?;
    Some(
        entries
            .into_iter()
            .map(|e| (e.uuid, e.score.into_iter().collect()))
            .collect(),
    )
}

/// Why a node without HAMi's register annotation takes no GPU pod (HAMi's words): a node with no
/// GPU device plugin, such as every CPU node.
pub const NOT_REGISTERED: &str = "node unregistered";

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
            None => (Vec::new(), Some(NOT_REGISTERED.to_owned())),
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

    pub(super) fn base_state(&self) -> NodeState {
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
    /// What preemption ranks the pod by as a victim.
    pub standing: Standing,
    /// kube-scheduler has marked it for eviction to make room for a higher-priority pod (the
    /// `DisruptionTarget` condition with reason `PreemptionByScheduler`).
    pub preempted: bool,
}

/// The condition kube-scheduler sets on a victim before deleting it.
fn preempted_by_scheduler(c: &k8s_openapi::api::core::v1::PodCondition) -> bool {
    c.type_ == "DisruptionTarget"
        && c.status == "True"
        && c.reason.as_deref() == Some("PreemptionByScheduler")
}

/// What preemption reads of a pod that could be a victim: kube-scheduler's order of importance
/// (priority, then the earlier start). (Which PodDisruptionBudgets cover it is read from the API
/// server when kube-scheduler asks: keeping every pod's labels here cost 40 % more memory at
/// 50,000 pods.)
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Standing {
    /// `spec.priority` (0 when unset, as kube-scheduler reads it).
    pub priority: i32,
    /// `status.startTime` in seconds since the epoch; `None` before the kubelet started it.
    pub started: Option<i64>,
}

impl Standing {
    pub fn of(pod: &Pod) -> Self {
        Standing {
            priority: pod.spec.as_ref().and_then(|s| s.priority).unwrap_or(0),
            started: pod
                .status
                .as_ref()
                .and_then(|s| s.start_time.as_ref())
                .map(|t| t.0.as_second()),
        }
    }
}

pub(super) fn all_init_done(pod: &Pod) -> bool {
    let spec_init = crate::podspec::init_container_count(pod);
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
        let init_count = crate::podspec::init_container_count(pod);
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
            standing: Standing::of(pod),
            preempted: pod
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| c.iter().any(preempted_by_scheduler)),
        })
    }

    pub(super) fn phase(&self) -> PodPhase<'_> {
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
pub(super) struct PodPhase<'a> {
    pub(super) has_node: bool,
    pub(super) bound: bool,
    pub(super) bind_phase: Option<&'a str>,
    pub(super) terminal: bool,
    pub(super) deleting: bool,
}

impl PodPhase<'_> {
    pub(super) fn books_capacity(self) -> bool {
        // A bind that failed before the pod was ever bound leaves nothing booked.
        let bind_failed_unbound = !self.bound && self.bind_phase == Some(ann::BIND_PHASE_FAILED);
        !self.terminal && self.has_node && !bind_failed_unbound
    }

    pub(super) fn is_pending_allocation(self) -> bool {
        self.bind_phase == Some(ann::BIND_PHASE_ALLOCATING) && !self.terminal && !self.deleting
    }

    pub(super) fn is_decided_unbound(self) -> bool {
        self.has_node
            && !self.bound
            && self.bind_phase.is_none()
            && !self.terminal
            && !self.deleting
    }
}

/// Whether the state reads this annotation of a node (HAMi's own `hami.io/` keys and the
/// `nvidia.com/` placement hints); others, such as `kubectl.kubernetes.io/last-applied-configuration`,
/// are dropped by [`slim_node`].
pub(super) fn annotation_read(key: &str) -> bool {
    key.starts_with("hami.io/") || key.starts_with("nvidia.com/") || key == ann::ALLOCATION_IDENTITY
}

/// Whether [`PodRecord::from_pod`] reads this annotation of a pod: the decision, its node, the
/// bind phase, and the placement constraints of the allocation signature. The rest of HAMi's
/// (`hami.io/vgpu-time`, `hami.io/bind-time`, `hami.io/vgpu-devices-to-allocate`, …) is dropped
/// by [`slim_pod`]: at 50,000 pods they were 12 MiB of the List buffers.
pub(super) fn pod_annotation_read(key: &str) -> bool {
    key == ann::DEVICES_ALLOCATED
        || key == ann::MIG_ALLOCATIONS
        || key == ann::VGPU_NODE
        || key == ann::BIND_PHASE
        || hami_contract::identity::PLACEMENT_CONSTRAINT_ANNOTATIONS.contains(&key)
}

pub(super) fn read_annotations(
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
    let has_decision = metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(ann::DEVICES_ALLOCATED));
    let nominated = !has_decision
        && status
            .as_ref()
            .and_then(|s| s.nominated_node_name.as_deref())
            .is_some_and(|n| !n.is_empty());
    if nominated {
        // A pod nominated after preemption (few at a time): what the filter needs to hold its
        // slice ([`Nomination`](super::Nomination)): its GPU requests and placement annotations.
        let keep = |c: Container| Container {
            name: c.name,
            resources: c.resources,
            ..Default::default()
        };
        return Pod {
            metadata: ObjectMeta {
                name: metadata.name,
                namespace: metadata.namespace,
                uid: metadata.uid,
                annotations: metadata.annotations,
                deletion_timestamp: metadata.deletion_timestamp,
                ..Default::default()
            },
            spec: spec.map(|s| PodSpec {
                node_name: s.node_name,
                priority: s.priority,
                containers: s.containers.into_iter().map(keep).collect(),
                init_containers: s.init_containers.map(|v| v.into_iter().map(keep).collect()),
                ..Default::default()
            }),
            status: status.map(|s| PodStatus {
                phase: s.phase,
                nominated_node_name: s.nominated_node_name,
                ..Default::default()
            }),
        };
    }
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
            priority: s.priority,
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
            start_time: s.start_time,
            init_container_statuses: s.init_container_statuses,
            // Only kube-scheduler's preemption mark, only on pods with a decision.
            conditions: s
                .conditions
                .filter(|_| has_decision)
                .map(|c| {
                    c.into_iter()
                        .filter(preempted_by_scheduler)
                        .collect::<Vec<_>>()
                })
                .filter(|c| !c.is_empty()),
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

//! The single decision loop: one task owns the cluster state and the reservation overlay; every
//! filter decision, bind admission, release and informer update is a command on one channel.
//!
//! The loop never awaits an API call: it decides, records the reservation, and answers; the
//! caller performs the API call and reports back (`FilterAbort`, `BindDone`). The next decision
//! therefore sees the previous one immediately, before any informer does.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use hami_contract::PodDevices;
use k8s_openapi::api::core::v1::{Node, Pod, ResourceQuota};
use tessera_scheduler_core::config::DecisionConfig;
use tessera_scheduler_core::decide::{self, Verdict};
use tessera_scheduler_core::fit::Charge;
use tessera_scheduler_core::fit::NodeState;
use tessera_scheduler_core::quota::QuotaKeys;
use tessera_scheduler_core::state::{
    BindStage, ClusterState, NodeRecord, Reservation, ResyncKind, SharedBooking,
};
use tessera_scheduler_core::{podspec, preempt};
use tokio::sync::{mpsc, oneshot};

/// Why the loop will not decide now. Always retryable by kube-scheduler.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("this tessera-scheduler replica is not the leader; retry")]
    NotLeader,
    #[error("tessera-scheduler is rebuilding its cluster state after a leadership change; retry")]
    NotSynced,
    #[error("{0}")]
    Rejected(String),
    #[error("decision loop stopped")]
    Stopped,
}

/// A cluster object change from the informers.
#[derive(Debug, Clone)]
pub enum Observation {
    NodeUpsert(Box<Node>),
    NodeDelete(String),
    PodUpsert(Box<Pod>),
    PodDelete {
        uid: String,
    },
    QuotaUpsert(Box<ResourceQuota>),
    QuotaDelete {
        namespace: String,
        name: String,
    },
    /// A watcher re-listed: every object of `kind` not in `keep` is gone (node names, pod UIDs,
    /// `namespace/name` of quotas).
    Resync {
        kind: ResyncKind,
        keep: Vec<String>,
    },
}

/// What the bind caller must do after the loop admitted the bind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BindPlan {
    /// The devices to write with the Binding; `None` for pods with no GPU request (a plain
    /// Binding, no annotations).
    pub devices: Option<PodDevices>,
    /// `hami.io/vgpu-mig-allocations` to write with the devices (empty: none).
    pub mig: Vec<hami_contract::mig::MigAllocation>,
    /// The node runs HAMi's device plugin: take HAMi's node lock for the pod before binding.
    pub hami_lock: bool,
}

/// Per-GPU numbers for metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuMetrics {
    pub node: String,
    pub uuid: String,
    pub index: u32,
    pub device_type: String,
    pub count: u32,
    pub totalmem: u32,
    pub totalcore: u32,
    pub used: u32,
    pub usedmem: u32,
    pub usedcores: u32,
    /// The GPU's operating mode as registered (`hami-core`, `mig`, …).
    pub mode: String,
    /// On a `mig` GPU, the instances in use (placed pods' reservations and in-flight ones).
    pub mig: Vec<hami_contract::mig::MigAllocation>,
}

/// Per-quota numbers for metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct QuotaMetrics {
    pub namespace: String,
    pub name: String,
    /// `(resource key, limit, used)`.
    pub items: Vec<(String, u64, u64)>,
}

/// One collapsed device entry of a scheduled pod (HAMi's per-container metrics; the index is
/// the collapsed entry's, Appendix B #14).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerDeviceMetrics {
    pub namespace: String,
    pub node: String,
    pub pod: String,
    pub container_index: usize,
    pub uuid: String,
    pub mem: u32,
    pub cores: u32,
}

/// A consistent view of the state for `/metrics`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MetricsSnapshot {
    pub leader: bool,
    pub gpus: Vec<GpuMetrics>,
    pub containers: Vec<ContainerDeviceMetrics>,
    pub quotas: Vec<QuotaMetrics>,
    pub reservations: usize,
    /// GPU pods that fit no node at their last filter, by why ([`decide::pending_reason`]).
    pub pending: BTreeMap<&'static str, usize>,
}

/// What the decision loop hands a metrics scrape: its state's parts, shared (the nodes' cached
/// states, the booked pods' entries), so that taking a consistent view costs the loop a
/// reference count per node and per pod; [`StateView::expand`] builds the rows off the loop.
/// At 5,000 nodes and 50,000 pods the rows took the loop 64 ms, during which nothing was
/// filtered or bound.
#[derive(Debug, Default)]
pub struct StateView {
    leader: bool,
    nodes: Vec<(Arc<str>, Arc<NodeState>)>,
    bookings: Vec<SharedBooking>,
    quotas: Vec<QuotaView>,
    reservations: usize,
    pending: BTreeMap<&'static str, usize>,
}

impl StateView {
    /// The rows `/metrics` encodes (off the decision loop).
    pub fn expand(self) -> MetricsSnapshot {
        let mut containers = Vec::new();
        for pod in &self.bookings {
            for (container_index, (uuid, mem, cores)) in pod.usage().into_iter().enumerate() {
                containers.push(ContainerDeviceMetrics {
                    namespace: pod.namespace.to_string(),
                    node: pod.node.to_string(),
                    pod: pod.name.to_string(),
                    container_index,
                    uuid: uuid.to_owned(),
                    mem,
                    cores,
                });
            }
        }
        // What each namespace uses, from the same bookings: what the loop's budget check sums.
        let mut used: HashMap<&str, Charge> = HashMap::new();
        for pod in &self.bookings {
            *used.entry(&pod.namespace).or_default() += pod.charge();
        }
        let quotas = self
            .quotas
            .into_iter()
            .map(|q| {
                let used = used.get(q.namespace.as_str()).copied().unwrap_or_default();
                QuotaMetrics {
                    items: q
                        .limits
                        .into_iter()
                        .map(|(key, limit, of)| (key, limit, of.of(&used)))
                        .collect(),
                    namespace: q.namespace,
                    name: q.name,
                }
            })
            .collect();
        MetricsSnapshot {
            leader: self.leader,
            gpus: gpu_rows(&self.nodes),
            containers,
            quotas,
            reservations: self.reservations,
            pending: self.pending,
        }
    }
}

/// A quota's limits, by resource key; what its namespace uses is summed off the loop.
#[derive(Debug)]
struct QuotaView {
    namespace: String,
    name: String,
    limits: Vec<(String, u64, Charged)>,
}

/// Which part of a namespace's [`Charge`] a quota's limit is on.
#[derive(Debug, Clone, Copy)]
enum Charged {
    Mem,
    Cores,
    Count,
}

impl Charged {
    fn of(self, c: &Charge) -> u64 {
        match self {
            Charged::Mem => c.mem,
            Charged::Cores => c.cores,
            Charged::Count => c.count,
        }
    }
}

/// Every GPU of `nodes` with its booking, node by node.
fn gpu_rows(nodes: &[(Arc<str>, Arc<NodeState>)]) -> Vec<GpuMetrics> {
    let mut out = Vec::new();
    for (name, state) in nodes {
        for g in &state.gpus {
            out.push(GpuMetrics {
                node: name.to_string(),
                uuid: g.uuid.clone(),
                index: g.index,
                device_type: g.device_type.clone(),
                count: g.count,
                totalmem: g.totalmem,
                totalcore: g.totalcore,
                used: g.used,
                usedmem: g.usedmem,
                usedcores: g.usedcores,
                mode: g.mode.clone(),
                mig: g.mig.as_ref().map(|m| m.in_use.clone()).unwrap_or_default(),
            });
        }
    }
    out
}

/// Commands to the loop.
#[derive(Debug)]
pub enum Command {
    /// Shared with the HTTP handler, which still needs the pod for its answer and events and the
    /// names for a pod that asks for no GPU: hundreds of names are not copied per cycle.
    Filter {
        pod: Arc<Pod>,
        node_names: Arc<[String]>,
        reply: oneshot::Sender<Result<Verdict, Refusal>>,
    },
    /// kube-scheduler's preemption verb: the victims per candidate node.
    Preempt {
        pod: Box<Pod>,
        proposed: BTreeMap<String, preempt::Victims>,
        budgets: Vec<preempt::Budget>,
        reply: oneshot::Sender<Result<Preemption, Refusal>>,
    },
    /// The namespaces of the possible victims ([`Engine::victim_namespaces`]).
    VictimNamespaces {
        pod: Box<Pod>,
        proposed: BTreeMap<String, preempt::Victims>,
        reply: oneshot::Sender<std::collections::BTreeSet<String>>,
    },
    /// Writing the filter decision to the pod failed: drop the reservation.
    FilterAbort {
        uid: String,
    },
    /// Bind a pod this loop decided (`None` back: it holds no decision; read the pod and send
    /// `BindBegin`).
    BindReserved {
        uid: String,
        node: String,
        reply: oneshot::Sender<Result<Option<BindPlan>, Refusal>>,
    },
    /// `live` is the pod as just read from the API server.
    BindBegin {
        live: Box<Pod>,
        node: String,
        reply: oneshot::Sender<Result<BindPlan, Refusal>>,
    },
    BindDone {
        uid: String,
        ok: bool,
    },
    Observe(Observation),
    /// Leadership gained (`Some(term)`) or lost (`None`).
    Leadership(Option<u64>),
    /// Leadership given up on purpose (the Lease is about to be released): like
    /// `Leadership(None)`, answered once done, so every command queued before it was decided
    /// under the old term and none after it is.
    StepDown {
        reply: oneshot::Sender<()>,
    },
    /// Full state from uncached Lists, for `term`.
    Rebuild {
        term: u64,
        nodes: Vec<Node>,
        pods: Vec<Pod>,
        quotas: Vec<ResourceQuota>,
    },
    Sweep,
    /// HAMi node locks to remove ([`ClusterState::stale_hami_locks`]).
    StaleHamiLocks {
        reply: oneshot::Sender<Vec<(String, String)>>,
    },
    Metrics {
        reply: oneshot::Sender<StateView>,
    },
    /// Answered once every command sent before it has been handled.
    Barrier {
        reply: oneshot::Sender<()>,
    },
    /// For tests and the concurrency check: every GPU's booking.
    Bookings {
        reply: oneshot::Sender<Vec<GpuMetrics>>,
    },
}

/// What the preemption verb concluded: the victims per node where preemption helps, and why it
/// does not help on the others.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Preemption {
    pub chosen: BTreeMap<String, preempt::NodeVictims>,
    pub refused: BTreeMap<String, preempt::NoVictims>,
}

/// A pod that failed filtering for lack of capacity, to be nudged when capacity frees.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Unschedulable {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

/// The loop's state.
#[derive(Debug)]
pub struct Engine {
    state: ClusterState,
    cfg: DecisionConfig,
    keys: QuotaKeys,
    term: Option<u64>,
    synced: Option<u64>,
    tick: u64,
    /// Ticks a reservation of a pod the informer has never shown may live.
    sweep_grace: u64,
    unschedulable: BTreeMap<String, Unschedulable>,
    /// Each GPU pod that fit no node at its last filter, with why
    /// ([`decide::pending_reason`]), until it is placed, bound or gone: the pending-pods gauge.
    /// Unlike `unschedulable` it is not emptied by a requeue nudge.
    pending: BTreeMap<String, &'static str>,
    requeue: Option<mpsc::UnboundedSender<Vec<Unschedulable>>>,
    /// Where the GPU pods kube-scheduler marks for preemption are reported.
    preempted: Option<mpsc::UnboundedSender<PreemptedPod>>,
}

/// A GPU pod kube-scheduler has marked for eviction to make room for a higher-priority pod, with
/// the slices it held: what its Event says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreemptedPod {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub node: String,
    /// `GPU-… 10000 MiB 30%` per GPU it held.
    pub slices: Vec<String>,
}

impl Engine {
    pub fn new(cfg: DecisionConfig) -> Self {
        let keys = QuotaKeys::new(&cfg.nvidia.resources, cfg.nvidia.effective_memory_factor());
        Engine {
            state: ClusterState::new(),
            cfg,
            keys,
            term: None,
            synced: None,
            tick: 0,
            sweep_grace: 3,
            unschedulable: BTreeMap::new(),
            pending: BTreeMap::new(),
            requeue: None,
            preempted: None,
        }
    }

    /// Where to send pods worth retrying when capacity frees.
    pub fn with_requeue(mut self, tx: mpsc::UnboundedSender<Vec<Unschedulable>>) -> Self {
        self.requeue = Some(tx);
        self
    }

    /// Reports each GPU pod kube-scheduler marks for preemption, once, on `tx`.
    pub fn with_preempted(mut self, tx: mpsc::UnboundedSender<PreemptedPod>) -> Self {
        self.preempted = Some(tx);
        self
    }

    /// A loop that is leader and synced from the start (single replica, tests, benchmarks).
    pub fn standalone(cfg: DecisionConfig) -> Self {
        let mut e = Engine::new(cfg);
        e.term = Some(0);
        e.synced = Some(0);
        e
    }

    pub fn state(&self) -> &ClusterState {
        &self.state
    }

    fn ready(&self) -> Result<(), Refusal> {
        match self.term {
            None => Err(Refusal::NotLeader),
            Some(t) if self.synced == Some(t) => Ok(()),
            Some(_) => Err(Refusal::NotSynced),
        }
    }

    pub fn observe(&mut self, o: Observation) {
        match o {
            Observation::NodeUpsert(n) => {
                if let Some(rec) = NodeRecord::from_node(&n, &self.cfg) {
                    let grew = self.state.node(&rec.name).is_none_or(|old| {
                        old.devices != rec.devices || old.cordoned != rec.cordoned
                    });
                    self.state.upsert_node(rec);
                    if grew {
                        self.capacity_freed();
                    }
                }
            }
            Observation::NodeDelete(name) => self.state.remove_node(&name),
            Observation::PodUpsert(p) => {
                let uid = p.metadata.uid.clone().unwrap_or_default();
                let booked_before = self.state.pod(&uid).is_some_and(|r| r.books_capacity());
                let preempted_before = self.state.pod_preempted(&uid);
                let held_before = self.state.nomination_of(&uid).map(str::to_owned);
                self.state.upsert_pod(&p);
                if !preempted_before && self.state.pod_preempted(&uid) {
                    self.report_preempted(&uid);
                }
                let booked_after = self.state.pod(&uid).is_some_and(|r| r.books_capacity());
                // A hold that ends (the nominated pod bound, anywhere, or its nomination
                // cleared or moved) frees the slice it kept from the pods it held back.
                let hold_ended = held_before.is_some()
                    && held_before.as_deref() != self.state.nomination_of(&uid);
                if (booked_before && !booked_after) || hold_ended {
                    self.capacity_freed();
                }
                if p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some() {
                    self.unschedulable.remove(&uid);
                    self.pending.remove(&uid);
                }
            }
            Observation::PodDelete { uid } => {
                let booked = self.state.pod(&uid).is_some_and(|r| r.books_capacity())
                    || self.state.reservation(&uid).is_some()
                    || self.state.nomination_of(&uid).is_some();
                self.state.remove_pod(&uid);
                self.unschedulable.remove(&uid);
                self.pending.remove(&uid);
                if booked {
                    self.capacity_freed();
                }
            }
            Observation::QuotaUpsert(q) => {
                self.state.upsert_quota(&q, &self.keys);
                self.capacity_freed();
            }
            Observation::QuotaDelete { namespace, name } => {
                self.state.remove_quota(&namespace, &name);
                self.capacity_freed();
            }
            Observation::Resync { kind, keep } => {
                let keep: std::collections::HashSet<String> = keep.into_iter().collect();
                let gone = self.state.missing(kind, &keep);
                for key in gone {
                    match kind {
                        ResyncKind::Nodes => self.observe(Observation::NodeDelete(key)),
                        ResyncKind::Pods => self.observe(Observation::PodDelete { uid: key }),
                        ResyncKind::Quotas => {
                            let (namespace, name) = key.split_once('/').unwrap_or(("", &key));
                            self.observe(Observation::QuotaDelete {
                                namespace: namespace.to_owned(),
                                name: name.to_owned(),
                            });
                        }
                    }
                }
            }
        }
    }

    /// Sends the slices of pod `uid`, just marked for preemption, to the reporter.
    fn report_preempted(&self, uid: &str) {
        let (Some(tx), Some(rec)) = (&self.preempted, self.state.pod(uid)) else {
            return;
        };
        let Some(node) = rec.node.clone() else {
            return;
        };
        let slices = rec
            .usage
            .iter()
            .map(|u| format!("{} {} MiB {}%", u.uuid, u.mem, u.cores))
            .collect();
        let _ = tx.send(PreemptedPod {
            namespace: rec.namespace,
            name: rec.name,
            uid: rec.uid,
            node,
            slices,
        });
    }

    fn capacity_freed(&mut self) {
        if self.unschedulable.is_empty() || self.ready().is_err() {
            return;
        }
        if let Some(tx) = &self.requeue {
            // The pending-pods gauge keeps them: a nudge is not a placement.
            let pods: Vec<Unschedulable> = self.unschedulable.values().cloned().collect();
            self.unschedulable.clear();
            let _ = tx.send(pods);
        }
    }

    /// Filters and, on success, reserves. When the caller writes the decision to the pod at
    /// filter (HAMi's order) and that fails, it reports it with [`Engine::filter_abort`].
    pub fn filter(&mut self, pod: &Pod, node_names: &[String]) -> Result<Verdict, Refusal> {
        self.ready()?;
        self.tick += 1;
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        if uid.is_empty() {
            return Err(Refusal::Rejected("pod has no metadata.uid".to_owned()));
        }
        // A new filter for the same pod replaces its earlier decision (HAMi: TakeAndDeletePod).
        if self
            .state
            .reservation(&uid)
            .is_some_and(|r| r.stage != BindStage::Decided)
        {
            return Err(Refusal::Rejected(format!(
                "pod {} is being bound; retry",
                podspec::pod_key(pod)
            )));
        }
        self.state.release(&uid);
        let verdict =
            decide::filter_pod_with(&mut self.state, &self.cfg, pod, &uid, node_names, true);
        match &verdict {
            Verdict::Placed(p) => {
                let r = decide::reservation_for(pod, &uid, p, self.tick);
                self.state.reserve(r);
                self.unschedulable.remove(&uid);
                self.pending.remove(&uid);
            }
            Verdict::NoFit { failed, .. } => {
                self.pending
                    .insert(uid.clone(), decide::pending_reason(failed));
                self.unschedulable.insert(
                    uid.clone(),
                    Unschedulable {
                        namespace: pod.metadata.namespace.clone().unwrap_or_default(),
                        name: pod.metadata.name.clone().unwrap_or_default(),
                        uid,
                    },
                );
            }
            Verdict::NotGpu | Verdict::Invalid(_) => {}
        }
        Ok(verdict)
    }

    /// The victims per candidate node that let `pod` fit ([`preempt::preempt`]); decided by
    /// the leader only, on the same state as its filters.
    pub fn preempt(
        &mut self,
        pod: &Pod,
        proposed: &BTreeMap<String, preempt::Victims>,
        budgets: &[preempt::Budget],
    ) -> Result<Preemption, Refusal> {
        self.ready()?;
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let (chosen, refused) =
            preempt::preempt(&mut self.state, &self.cfg, pod, &uid, proposed, budgets);
        Ok(Preemption { chosen, refused })
    }

    /// [`preempt::victim_namespaces`]: where the PodDisruptionBudgets that can matter are.
    pub fn victim_namespaces(
        &self,
        pod: &Pod,
        proposed: &BTreeMap<String, preempt::Victims>,
    ) -> std::collections::BTreeSet<String> {
        preempt::victim_namespaces(&self.state, pod, proposed)
    }

    pub fn filter_abort(&mut self, uid: &str) {
        if self.state.release(uid) {
            self.capacity_freed();
        }
    }

    /// Admits the bind of a pod this loop decided, without reading the pod: the Binding's UID
    /// precondition stands in for the read. `Ok(None)`: this loop holds no decision for the pod
    /// (another replica filtered it, or the loop restarted); the caller reads the pod and calls
    /// [`Engine::bind_begin`].
    pub fn bind_reserved(&mut self, uid: &str, node: &str) -> Result<Option<BindPlan>, Refusal> {
        self.ready()?;
        let Some(r) = self.state.reservation(uid).cloned() else {
            return Ok(None);
        };
        self.tick += 1;
        let key = format!("{}/{}", r.namespace, r.name);
        self.admit_bind(&key, node, r).map(Some)
    }

    /// Admits a bind from the pod as just read from the API server: the decision is this loop's
    /// reservation, or the one the pod carries (written at filter, HAMi's order), or else made
    /// now for `node` (the filter ran on a replica that has lost the lead since, and wrote
    /// nothing). No pod pending on the node may be confusable with it.
    pub fn bind_begin(&mut self, live: &Pod, node: &str) -> Result<BindPlan, Refusal> {
        self.ready()?;
        self.tick += 1;
        let uid = live.metadata.uid.clone().unwrap_or_default();
        let key = podspec::pod_key(live);
        let (ask, _) = podspec::pod_ask(live, &self.cfg.nvidia);
        if ask.is_empty() {
            return Ok(BindPlan {
                devices: None,
                mig: Vec::new(),
                hami_lock: false,
            });
        }
        // Read past the cache: the live object may show a decision before the informer does.
        self.state.upsert_pod(live);
        let reservation = match self.state.reservation(&uid) {
            Some(r) => r.clone(),
            None => match self.state.pod(&uid).and_then(|p| {
                let n = p.node.clone()?;
                Some(Reservation {
                    uid: uid.clone(),
                    namespace: p.namespace.clone(),
                    name: p.name.clone(),
                    node: n,
                    devices: p.devices.clone(),
                    usage: p.usage.clone(),
                    signature: p.signature.clone(),
                    mig: p.mig.clone(),
                    stage: BindStage::Decided,
                    created_tick: self.tick,
                })
            }) {
                Some(r) => r,
                None => self.decide_at_bind(live, &uid, &key, node)?,
            },
        };
        self.admit_bind(&key, node, reservation)
    }

    /// The filter's decision for `node` alone, made at bind.
    fn decide_at_bind(
        &mut self,
        live: &Pod,
        uid: &str,
        key: &str,
        node: &str,
    ) -> Result<Reservation, Refusal> {
        if uid.is_empty() {
            return Err(Refusal::Rejected("pod has no metadata.uid".to_owned()));
        }
        let verdict = decide::filter_pod_with(
            &mut self.state,
            &self.cfg,
            live,
            uid,
            &[node.to_owned()],
            true,
        );
        match verdict {
            Verdict::Placed(p) => Ok(decide::reservation_for(live, uid, &p, self.tick)),
            Verdict::NoFit { failed, .. } => Err(Refusal::Rejected(format!(
                "pod {key} was filtered by another tessera-scheduler replica and no longer fits node {node} ({}); it will be filtered again",
                failed
                    .get(node)
                    .map_or_else(|| "not a candidate".to_owned(), ToString::to_string)
            ))),
            Verdict::Invalid(e) => Err(Refusal::Rejected(format!("pod {key}: {e}"))),
            Verdict::NotGpu => Err(Refusal::Rejected(format!(
                "pod {key} asks for no GPU by this replica's configuration"
            ))),
        }
    }

    /// The bind gate: the decision is for `node`, still fits, and no confusable pod is pending
    /// allocation there.
    fn admit_bind(
        &mut self,
        key: &str,
        node: &str,
        mut reservation: Reservation,
    ) -> Result<BindPlan, Refusal> {
        let uid = reservation.uid.clone();
        if reservation.node != node {
            return Err(Refusal::Rejected(format!(
                "pod {key} was filtered to node {}, not {node}; retry scheduling",
                reservation.node
            )));
        }
        if !self.state.usage_fits(node, &uid, &reservation.usage)
            || !self.state.mig_fits(node, &uid, &reservation.mig)
        {
            self.state.release(&uid);
            return Err(Refusal::Rejected(format!(
                "the GPU decision of pod {key} no longer fits node {node} (another placement took the capacity); it will be filtered again"
            )));
        }
        let pending = self.state.pending_on(node, &uid);
        let hami_lock = self.state.is_hami_plugin_node(node);
        if let Some(other) = self
            .state
            .blocking_pending(node, &reservation.signature, &pending)
        {
            return Err(Refusal::Rejected(if hami_lock {
                format!(
                    "pod {other} is still being allocated on node {node}, whose HAMi device plugin takes one pod at a time; retry when it has started"
                )
            } else {
                format!(
                    "pod {other} is still being allocated on node {node} and the device plugin could take it for {key}; retry when it has started"
                )
            }));
        }
        reservation.stage = BindStage::Binding;
        let devices = reservation.devices.clone();
        let mig = reservation.mig.clone();
        self.state.reserve(reservation);
        Ok(BindPlan {
            devices: Some(devices),
            mig,
            hami_lock,
        })
    }

    pub fn bind_done(&mut self, uid: &str, ok: bool) {
        if ok {
            self.state.set_stage(uid, BindStage::Bound);
        } else if self.state.release(uid) {
            self.capacity_freed();
        }
    }

    pub fn set_leadership(&mut self, term: Option<u64>) {
        if term != self.term {
            self.term = term;
            self.synced = None;
            self.state.clear();
            self.unschedulable.clear();
        }
    }

    pub fn rebuild(&mut self, term: u64, nodes: &[Node], pods: &[Pod], quotas: &[ResourceQuota]) {
        if self.term != Some(term) {
            // A rebuild from an older term: discard (fencing by term).
            return;
        }
        self.state.clear();
        for n in nodes {
            if let Some(rec) = NodeRecord::from_node(n, &self.cfg) {
                self.state.upsert_node(rec);
            }
        }
        for p in pods {
            self.state.upsert_pod(p);
        }
        for q in quotas {
            self.state.upsert_quota(q, &self.keys);
        }
        self.synced = Some(term);
    }

    pub fn sweep(&mut self) -> Vec<String> {
        self.tick += 1;
        let released = self.state.sweep(self.tick, self.sweep_grace);
        if !released.is_empty() {
            self.capacity_freed();
        }
        released
    }

    pub fn bookings(&mut self) -> Vec<GpuMetrics> {
        gpu_rows(&self.state.node_states())
    }

    /// The view a `/metrics` scrape encodes ([`StateView`]); empty unless leading.
    pub fn metrics(&mut self) -> StateView {
        let leader = self.ready().is_ok();
        if !leader {
            return StateView::default();
        }
        let nodes = self.state.node_states();
        let quotas = self
            .state
            .quotas()
            .map(|q| {
                let limits = [
                    (self.keys.memory.clone(), q.mem_limit, Charged::Mem),
                    (self.keys.cores.clone(), q.cores_limit, Charged::Cores),
                    (
                        format!("limits.{}", self.cfg.nvidia.resources.count),
                        q.count_limit,
                        Charged::Count,
                    ),
                ];
                QuotaView {
                    namespace: q.namespace.clone(),
                    name: q.name.clone(),
                    limits: limits
                        .into_iter()
                        .filter_map(|(key, limit, of)| Some((key, limit?, of)))
                        .collect(),
                }
            })
            .collect();
        StateView {
            leader,
            nodes,
            bookings: self.state.shared_bookings(),
            quotas,
            reservations: self.state.reservations().count(),
            pending: self
                .pending
                .values()
                .fold(BTreeMap::new(), |mut by, reason| {
                    *by.entry(*reason).or_default() += 1;
                    by
                }),
        }
    }

    /// Handles one command.
    pub fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Filter {
                pod,
                node_names,
                reply,
            } => {
                let r = self.filter(&pod, &node_names);
                let _ = reply.send(r);
            }
            Command::Preempt {
                pod,
                proposed,
                budgets,
                reply,
            } => {
                let _ = reply.send(self.preempt(&pod, &proposed, &budgets));
            }
            Command::VictimNamespaces {
                pod,
                proposed,
                reply,
            } => {
                let _ = reply.send(self.victim_namespaces(&pod, &proposed));
            }
            Command::FilterAbort { uid } => self.filter_abort(&uid),
            Command::BindReserved { uid, node, reply } => {
                let _ = reply.send(self.bind_reserved(&uid, &node));
            }
            Command::BindBegin { live, node, reply } => {
                let r = self.bind_begin(&live, &node);
                let _ = reply.send(r);
            }
            Command::BindDone { uid, ok } => self.bind_done(&uid, ok),
            Command::Observe(o) => self.observe(o),
            Command::Leadership(t) => self.set_leadership(t),
            Command::StepDown { reply } => {
                self.set_leadership(None);
                let _ = reply.send(());
            }
            Command::Rebuild {
                term,
                nodes,
                pods,
                quotas,
            } => self.rebuild(term, &nodes, &pods, &quotas),
            Command::Sweep => {
                let released = self.sweep();
                if !released.is_empty() {
                    tracing::info!(
                        count = released.len(),
                        "released reservations of pods that no longer exist"
                    );
                }
            }
            Command::Metrics { reply } => {
                let _ = reply.send(self.metrics());
            }
            Command::StaleHamiLocks { reply } => {
                let stale = if self.ready().is_ok() {
                    self.state.stale_hami_locks()
                } else {
                    Vec::new()
                };
                let _ = reply.send(stale);
            }
            Command::Bookings { reply } => {
                let _ = reply.send(self.bookings());
            }
            Command::Barrier { reply } => {
                let _ = reply.send(());
            }
        }
    }

    /// Runs until every sender is dropped.
    pub async fn run(mut self, mut rx: mpsc::Receiver<Command>) {
        while let Some(cmd) = rx.recv().await {
            self.handle(cmd);
        }
    }
}

/// The handle the servers use to talk to the loop.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
}

impl EngineHandle {
    /// Starts the loop on the current runtime.
    pub fn spawn(engine: Engine) -> Self {
        let (tx, rx) = mpsc::channel(1024);
        tessera_runtime::spawn_task("decision-loop", engine.run(rx));
        EngineHandle { tx }
    }

    pub async fn send(&self, cmd: Command) {
        let _ = self.tx.send(cmd).await;
    }

    pub async fn filter(
        &self,
        pod: Arc<Pod>,
        node_names: Arc<[String]>,
    ) -> Result<Verdict, Refusal> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Filter {
            pod,
            node_names,
            reply,
        })
        .await;
        rx.await.unwrap_or(Err(Refusal::Stopped))
    }

    pub async fn victim_namespaces(
        &self,
        pod: Pod,
        proposed: BTreeMap<String, preempt::Victims>,
    ) -> std::collections::BTreeSet<String> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::VictimNamespaces {
            pod: Box::new(pod),
            proposed,
            reply,
        })
        .await;
        rx.await.unwrap_or_default()
    }

    pub async fn preempt(
        &self,
        pod: Pod,
        proposed: BTreeMap<String, preempt::Victims>,
        budgets: Vec<preempt::Budget>,
    ) -> Result<Preemption, Refusal> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Preempt {
            pod: Box::new(pod),
            proposed,
            budgets,
            reply,
        })
        .await;
        rx.await.unwrap_or(Err(Refusal::Stopped))
    }

    pub async fn bind_reserved(
        &self,
        uid: String,
        node: String,
    ) -> Result<Option<BindPlan>, Refusal> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::BindReserved { uid, node, reply }).await;
        rx.await.unwrap_or(Err(Refusal::Stopped))
    }

    pub async fn bind_begin(&self, live: Pod, node: String) -> Result<BindPlan, Refusal> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::BindBegin {
            live: Box::new(live),
            node,
            reply,
        })
        .await;
        rx.await.unwrap_or(Err(Refusal::Stopped))
    }

    /// Returns once the loop has handled every command sent before.
    pub async fn barrier(&self) {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Barrier { reply }).await;
        let _ = rx.await;
    }

    /// Stops deciding and returns once the loop has done so (see [`Command::StepDown`]).
    pub async fn step_down(&self) {
        let (reply, rx) = oneshot::channel();
        self.send(Command::StepDown { reply }).await;
        let _ = rx.await;
    }

    /// HAMi node locks to remove, `(node, value)`; none while not leading.
    pub async fn stale_hami_locks(&self) -> Vec<(String, String)> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::StaleHamiLocks { reply }).await;
        rx.await.unwrap_or_default()
    }

    /// The loop's [`StateView`]: expand and encode it off the loop.
    pub async fn metrics(&self) -> StateView {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Metrics { reply }).await;
        rx.await.unwrap_or_default()
    }

    pub async fn bookings(&self) -> Vec<GpuMetrics> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Bookings { reply }).await;
        rx.await.unwrap_or_default()
    }
}

//! Which pod does this `GetPreferredAllocation` / `Allocate` call serve?
//!
//! The kubelet's call carries device IDs only. This module decides from a snapshot of the
//! node's pods (scheduler annotations + spec), the plugin's own ledger of what it already
//! served, and — when the kubelet exposes it — a pod-resources `List` taken during the call.
//! The protocol and its proof sketch are in `docs/design/allocation-identity.md`. Pure: no I/O.
//!
//! Rule of thumb: serve only what is certain (unique, confirmed, or interchangeable); otherwise
//! fail closed with an error that names the candidates. Never guess.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use hami_contract::annotations as keys;
use hami_contract::devices::{ContainerDevices, PodDevices};
use hami_contract::identity::AllocationSignature;

/// A container as the identity logic needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerSpec {
    pub name: String,
    /// The container's limit for the plugin's resource is > 0 (the kubelet calls the plugin).
    pub requests_resource: bool,
    /// Restartable ("sidecar") init container: reported by pod-resources, unlike regular ones.
    pub restartable_init: bool,
    /// `CUDA_DISABLE_CONTROL` is Go-true in the container's env.
    pub disable_control: bool,
}

/// A pod on (or bound to) this node, reduced to what identity needs.
#[derive(Debug, Clone, PartialEq)]
pub struct PodSnapshot {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub node_name: Option<String>,
    /// `spec.schedulerName`.
    pub scheduler_name: Option<String>,
    pub annotations: BTreeMap<String, String>,
    /// Phase `Succeeded` / `Failed`.
    pub terminal: bool,
    /// `metadata.deletionTimestamp` is set.
    pub deleting: bool,
    pub init_containers: Vec<ContainerSpec>,
    pub containers: Vec<ContainerSpec>,
    /// Containers (init or app) the kubelet has started: their status is running or terminated.
    pub started_containers: BTreeSet<String>,
    /// The runtime's container IDs in the pod's status (without the `containerd://` scheme),
    /// each with its container's name.
    pub container_ids: BTreeMap<String, String>,
    /// `metadata.resourceVersion` of the object this snapshot was taken from. Used only to
    /// guess which pod the kubelet admits next ([`likely_admitting`]), never to decide.
    pub resource_version: String,
}

impl PodSnapshot {
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    pub(crate) fn annotation(&self, key: &str) -> Option<&str> {
        self.annotations.get(key).map(String::as_str)
    }

    /// Seconds of `hami.io/bind-time`; unparsable or absent sorts last.
    pub fn bind_time(&self) -> u64 {
        self.annotation(keys::BIND_TIME)
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(u64::MAX)
    }

    /// The containers the kubelet calls the plugin for, in kubelet order.
    pub fn gpu_containers(&self) -> Vec<&ContainerSpec> {
        self.init_containers
            .iter()
            .chain(self.containers.iter())
            .filter(|c| c.requests_resource)
            .collect()
    }

    /// The kubelet's pod-resources `List` reports every container of the pod that requests the
    /// resource: none is a regular init container (those are never reported).
    pub fn gpu_containers_all_reported(&self) -> bool {
        self.init_containers
            .iter()
            .all(|c| !c.requests_resource || c.restartable_init)
    }

    /// Every container that requests the resource has started: the kubelet's allocation for the
    /// pod is complete and checkpointed, so no restarted kubelet asks for it again.
    pub(crate) fn gpu_containers_started(&self) -> bool {
        self.gpu_containers()
            .iter()
            .all(|c| self.started_containers.contains(&c.name))
    }
}

/// One pending allocation derived from a pod: its non-empty entries in kubelet order, each paired
/// with the container it belongs to.
#[derive(Debug, Clone, PartialEq)]
pub struct PendingPod<'a> {
    pub pod: &'a PodSnapshot,
    /// `(entry index in the annotation, devices, container)` for every non-empty entry.
    pub entries: Vec<(usize, ContainerDevices, ContainerSpec)>,
    /// Entry indexes already served (annotation emptied them, or the ledger recorded them).
    pub served: BTreeSet<usize>,
    pub signature: AllocationSignature,
    /// Served (in part or whole) by an earlier kubelet instance, or before this plugin process
    /// started, and not yet running: a restarted kubelet that had not checkpointed the pod's
    /// allocation admits it again and asks again for containers already served.
    pub reaskable: bool,
}

impl PendingPod<'_> {
    /// Its entry at `position` (in kubelet order) asks for `count` devices.
    fn count_at(&self, position: usize, count: usize) -> bool {
        self.entries
            .get(position)
            .is_some_and(|(_, d, _)| d.len() == count)
    }

    /// A fresh candidate for a call for `count` devices: nothing of it served yet, its first
    /// entry has the count.
    fn fresh_for(&self, count: usize) -> bool {
        !self.started() && self.count_at(0, count)
    }

    fn started(&self) -> bool {
        !self.served.is_empty()
    }

    fn remaining_after(&self, index: usize) -> usize {
        self.entries
            .iter()
            .filter(|(i, _, _)| *i != index && !self.served.contains(i))
            .count()
    }
}

/// Why a pod on the node is not a pending allocation at all (logged, never fatal).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PodRejection {
    #[error("pod {pod}: {annotation} is unreadable")]
    BadAnnotation {
        pod: String,
        annotation: &'static str,
        #[source]
        source: hami_contract::devices::DeviceListError,
    },
    #[error(
        "pod {pod}: {entries} non-empty device entries but {containers} containers request the resource"
    )]
    ContainerMismatch {
        pod: String,
        entries: usize,
        containers: usize,
    },
    #[error("pod {pod}: annotated for node {annotated:?}, but this is node {node:?}")]
    OtherNode {
        pod: String,
        annotated: String,
        node: String,
    },
    #[error(
        "pod {pod}: spec.schedulerName is {scheduler:?}, not the GPU scheduler's ({expected}); its booking annotations are not trusted"
    )]
    ForeignScheduler {
        pod: String,
        scheduler: String,
        expected: String,
    },
    #[error("pod {pod}: booking without {annotation} naming this node {node:?}")]
    MissingNode {
        pod: String,
        annotation: &'static str,
        node: String,
    },
    #[error("pod {pod}: booked for node {node:?}, but bound to node {bound:?}")]
    BoundElsewhere {
        pod: String,
        node: String,
        bound: String,
    },
    #[error("pod {pod}: booked GPU {uuid} does not exist on this node")]
    UnknownDevice { pod: String, uuid: String },
}

/// What a booking must satisfy before the plugin believes it (docs/design/allocation-identity.md,
/// "Who may book"): the pod is the GPU scheduler's, its `hami.io/vgpu-node` names this node (and
/// its `spec.nodeName`, when set, too), and every GPU it books is one this plugin manages.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BookingPolicy {
    /// Accepted `spec.schedulerName` values; empty accepts any (tests of the identity logic).
    pub scheduler_names: BTreeSet<String>,
    /// The GPUs of this node; `None` skips the check (tests of the identity logic).
    pub managed_uuids: Option<BTreeSet<String>>,
    /// Require `hami.io/vgpu-node` (HAMi's scheduler always writes it) instead of falling back
    /// to `spec.nodeName`.
    pub require_node_annotation: bool,
}

impl BookingPolicy {
    /// The plugin's policy: only `scheduler_names`, only this node's `managed_uuids`.
    pub fn strict(scheduler_names: BTreeSet<String>, managed_uuids: BTreeSet<String>) -> Self {
        BookingPolicy {
            scheduler_names,
            managed_uuids: Some(managed_uuids),
            require_node_annotation: true,
        }
    }

    /// Checks a pod that claims a pending booking (bind-phase `allocating`) on `node`.
    pub fn check(&self, node: &str, pod: &PodSnapshot) -> Result<(), PodRejection> {
        if !self.scheduler_names.is_empty() {
            let scheduler = pod.scheduler_name.as_deref().unwrap_or("default-scheduler");
            if !self.scheduler_names.contains(scheduler) {
                return Err(PodRejection::ForeignScheduler {
                    pod: pod.key(),
                    scheduler: scheduler.to_owned(),
                    expected: self
                        .scheduler_names
                        .iter()
                        .cloned()
                        .collect::<Vec<_>>()
                        .join(", "),
                });
            }
        }
        if self.require_node_annotation {
            if pod.annotation(keys::VGPU_NODE) != Some(node) {
                return Err(PodRejection::MissingNode {
                    pod: pod.key(),
                    annotation: keys::VGPU_NODE,
                    node: node.to_owned(),
                });
            }
            if let Some(bound) = pod.node_name.as_deref()
                && bound != node
            {
                return Err(PodRejection::BoundElsewhere {
                    pod: pod.key(),
                    node: node.to_owned(),
                    bound: bound.to_owned(),
                });
            }
        }
        if let Some(managed) = &self.managed_uuids {
            for key in [keys::DEVICES_TO_ALLOCATE, keys::DEVICES_ALLOCATED] {
                let Some(devices) = decode(pod, key)? else {
                    continue;
                };
                if let Some(d) = devices
                    .0
                    .iter()
                    .flat_map(|c| c.iter())
                    .find(|d| !managed.contains(&d.uuid))
                {
                    return Err(PodRejection::UnknownDevice {
                        pod: pod.key(),
                        uuid: d.uuid.clone(),
                    });
                }
            }
        }
        Ok(())
    }
}

/// The plugin's own memory of what it served: the informer cache may lag its own patches.
#[derive(Debug, Clone, Default)]
pub struct Ledger {
    served: HashMap<String, BTreeSet<usize>>,
    /// The pod the previous call served and the position (in its entries) the next call of its
    /// run must be, while the pod has entries after the one served.
    continuing: Option<(String, usize)>,
    /// The kubelet instance the plugin serves now (bumped when the plugin registers with a
    /// restarted kubelet).
    kubelet: u64,
    /// The kubelet instance that last had each pod served.
    served_by: HashMap<String, u64>,
    /// A consistent read of the node's pods since this kubelet instance registered showed no
    /// pod it could ask for again; pods served later are this instance's, so none can appear.
    reasks_ruled_out: bool,
}

impl Ledger {
    /// Records a served call: the entry is served, the pod's run continues at `choice.next`.
    pub fn record(&mut self, choice: &Choice) {
        self.record_served(&choice.uid, choice.entry_index, choice.next);
    }

    /// Records that entry `entry` of pod `uid` was served by the current kubelet; the pod's run
    /// continues with the entry at position `next` (none: the run is over).
    pub fn record_served(&mut self, uid: &str, entry: usize, next: Option<usize>) {
        self.served.entry(uid.to_owned()).or_default().insert(entry);
        self.served_by.insert(uid.to_owned(), self.kubelet);
        self.continuing = next.map(|pos| (uid.to_owned(), pos));
    }

    /// A call failed or was refused: no pod continues.
    pub fn break_run(&mut self) {
        self.continuing = None;
    }

    /// The plugin now serves kubelet instance `generation`. A new instance starts no run where
    /// the old one stopped, and may ask again for pods the old one was served.
    pub fn set_kubelet(&mut self, generation: u64) {
        if generation != self.kubelet {
            self.kubelet = generation;
            self.continuing = None;
            self.reasks_ruled_out = false;
        }
    }

    /// `pending` was derived from a consistent read of the node's pods (a LIST issued after the
    /// call began): when none of them may be asked for again, no re-ask can come from this
    /// kubelet instance any more.
    pub fn note_consistent_read(&mut self, pending: &[PendingPod<'_>]) {
        if pending.iter().all(|p| !p.reaskable) {
            self.reasks_ruled_out = true;
        }
    }

    /// No pod can be asked for again by this kubelet instance (see
    /// [`Ledger::note_consistent_read`]); until then only a LIST decides (`cached_identity`).
    pub fn reasks_ruled_out(&self) -> bool {
        self.reasks_ruled_out
    }

    /// `(pod UID, position of its next entry)` of the run in progress.
    pub fn continuing(&self) -> Option<(&str, usize)> {
        self.continuing
            .as_ref()
            .map(|(uid, pos)| (uid.as_str(), *pos))
    }

    fn served_by_this_kubelet(&self, uid: &str) -> bool {
        self.served_by.get(uid) == Some(&self.kubelet)
    }

    /// Forgets pods that are gone or terminal (`live`: the UIDs of the node's other pods).
    pub fn retain(&mut self, live: &BTreeSet<&str>) {
        self.served.retain(|uid, _| live.contains(uid.as_str()));
        self.served_by.retain(|uid, _| live.contains(uid.as_str()));
        if let Some((uid, _)) = &self.continuing
            && !live.contains(uid.as_str())
        {
            self.continuing = None;
        }
    }

    pub fn served(&self, uid: &str) -> Option<&BTreeSet<usize>> {
        self.served.get(uid)
    }

    /// This plugin served an entry for each of `pod`'s GPU containers and its run is over.
    pub fn served_all(&self, pod: &PodSnapshot) -> bool {
        let gpu_containers = pod.gpu_containers().len();
        gpu_containers > 0
            && self.continuing().is_none_or(|(uid, _)| uid != pod.uid)
            && self
                .served(&pod.uid)
                .is_some_and(|served| served.len() >= gpu_containers)
    }
}

/// Whether HAMi's node lock naming `holder` (`namespace/name`) is one nobody will release: its
/// pod is not waiting for `Allocate` on `node` (gone, deleting, finished, or already allocated).
/// HAMi's device plugin and this one release the lock at `Allocate`, so a lock outliving that
/// was left behind: by HAMi's plugin, stopped before it released it, on a cluster taken over
/// from HAMi. HAMi honours a lock for 5 minutes, so a rollback to HAMi would wait it out.
pub fn hami_lock_is_stale(node: &str, holder: &str, pods: &[PodSnapshot]) -> bool {
    !pods.iter().any(|p| {
        p.key() == holder
            && !p.terminal
            && !p.deleting
            && p.node_name.as_deref() == Some(node)
            && p.annotation(keys::BIND_PHASE) == Some(keys::BIND_PHASE_ALLOCATING)
    })
}

/// Derives the pending allocations of this node from a snapshot, believing every booking
/// (no [`BookingPolicy`]; the identity logic's tests).
pub fn pending_pods<'a>(
    node: &str,
    pods: &'a [PodSnapshot],
    ledger: &Ledger,
) -> (Vec<PendingPod<'a>>, Vec<PodRejection>) {
    pending_pods_checked(node, &BookingPolicy::default(), pods, ledger)
}

/// Derives the pending allocations of this node from a snapshot; a pod whose booking fails
/// `policy` is never a candidate (it is reported, so the caller logs why).
pub fn pending_pods_checked<'a>(
    node: &str,
    policy: &BookingPolicy,
    pods: &'a [PodSnapshot],
    ledger: &Ledger,
) -> (Vec<PendingPod<'a>>, Vec<PodRejection>) {
    let mut pending = Vec::new();
    let mut rejected = Vec::new();
    for pod in pods {
        if pod.terminal || pod.deleting {
            continue;
        }
        // A served pod (`success`) matters only while a restarted kubelet may ask for it again;
        // what is wrong with its booking was reported while it was allocating.
        let served_pod = match pod.annotation(keys::BIND_PHASE) {
            Some(keys::BIND_PHASE_ALLOCATING) => false,
            Some(keys::BIND_PHASE_SUCCESS) if !pod.gpu_containers_started() => true,
            _ => continue,
        };
        let mut report = |e: PodRejection| {
            if !served_pod {
                rejected.push(e);
            }
        };
        let annotated = pod.annotation(keys::VGPU_NODE);
        match (annotated, pod.node_name.as_deref()) {
            (Some(a), _) if a != node => {
                report(PodRejection::OtherNode {
                    pod: pod.key(),
                    annotated: a.to_owned(),
                    node: node.to_owned(),
                });
                continue;
            }
            (None, Some(n)) if n != node => continue,
            (None, None) if !policy.require_node_annotation => continue,
            _ => {}
        }
        if let Err(e) = policy.check(node, pod) {
            report(e);
            continue;
        }
        match pending_pod(pod, ledger) {
            Ok(Some(p)) => pending.push(p),
            Ok(None) => {}
            Err(e) => report(e),
        }
    }
    (pending, rejected)
}

fn decode(pod: &PodSnapshot, key: &'static str) -> Result<Option<PodDevices>, PodRejection> {
    match pod.annotation(key) {
        None => Ok(None),
        Some(v) => PodDevices::decode(v)
            .map(|d| Some(d.of_vendor(hami_contract::NVIDIA_VENDOR)))
            .map_err(|source| PodRejection::BadAnnotation {
                pod: pod.key(),
                annotation: key,
                source,
            }),
    }
}

fn pending_pod<'a>(
    pod: &'a PodSnapshot,
    ledger: &Ledger,
) -> Result<Option<PendingPod<'a>>, PodRejection> {
    let Some(to_allocate) = decode(pod, keys::DEVICES_TO_ALLOCATE)? else {
        return Ok(None);
    };
    let allocated = decode(pod, keys::DEVICES_ALLOCATED)?.unwrap_or_else(|| to_allocate.clone());
    let gpu_containers = pod.gpu_containers();
    // Entries are matched to containers by rank among non-empty entries, so HAMi v2.10's
    // unaligned padding (appendix B.1) still names the right container.
    let non_empty: Vec<(usize, &ContainerDevices)> = allocated
        .0
        .iter()
        .enumerate()
        .filter(|(_, d)| !d.is_empty())
        .collect();
    if non_empty.len() != gpu_containers.len() {
        return Err(PodRejection::ContainerMismatch {
            pod: pod.key(),
            entries: non_empty.len(),
            containers: gpu_containers.len(),
        });
    }
    let mut served: BTreeSet<usize> = ledger.served(&pod.uid).cloned().unwrap_or_default();
    let mut entries = Vec::new();
    for ((index, devices), container) in non_empty.into_iter().zip(gpu_containers) {
        let still = to_allocate.0.get(index).is_some_and(|d| !d.is_empty());
        if !still {
            served.insert(index);
        }
        entries.push((index, devices.clone(), container.clone()));
    }
    let started = !served.is_empty();
    let reaskable =
        started && !pod.gpu_containers_started() && !ledger.served_by_this_kubelet(&pod.uid);
    let continuing = ledger.continuing().is_some_and(|(uid, _)| uid == pod.uid);
    let unserved = entries.iter().any(|(i, _, _)| !served.contains(i));
    if !(unserved || reaskable || continuing) {
        return Ok(None);
    }
    let signature = AllocationSignature::new(&allocated, &pod.annotations);
    Ok(Some(PendingPod {
        pod,
        entries,
        served,
        signature,
        reaskable,
    }))
}

/// A pod-resources `List`, reduced to the plugin's resource.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodResourcesView {
    /// `namespace/name` → container name → device IDs recorded for the resource.
    pub pods: BTreeMap<String, BTreeMap<String, Vec<String>>>,
}

impl PodResourcesView {
    fn listed(&self, key: &str) -> bool {
        self.pods.contains_key(key)
    }

    /// The pod could be the one under admission: it is listed and has a container that requests
    /// the resource but shows no devices (regular init containers are never reported, so a pod
    /// with one counts as possibly unallocated).
    fn possibly_admitting(&self, pod: &PodSnapshot) -> bool {
        let Some(containers) = self.pods.get(&pod.key()) else {
            return false;
        };
        let reported_unallocated = pod
            .init_containers
            .iter()
            .filter(|c| c.restartable_init)
            .chain(pod.containers.iter())
            .filter(|c| c.requests_resource)
            .any(|c| containers.get(&c.name).is_none_or(Vec::is_empty));
        // A regular init container is allocated before every app container: once all reported
        // containers have devices, the unreported ones have them too.
        let reported_any = pod
            .init_containers
            .iter()
            .filter(|c| c.restartable_init)
            .chain(pod.containers.iter())
            .any(|c| c.requests_resource);
        reported_unallocated || (!pod.gpu_containers_all_reported() && !reported_any)
    }
}

/// What the call tells us.
#[derive(Debug, Clone, Copy)]
pub struct CallFacts<'a> {
    /// Device count of the container request.
    pub count: usize,
    /// `must_include_deviceIDs` was non-empty: only the pod whose init container's devices are
    /// being reused can be served.
    pub must_include: bool,
    /// `<namespace>/<name>` from HAMi's `hami.io/mutex.lock` on the node, if any.
    pub hami_lock: Option<&'a str>,
    /// A pod-resources `List` taken during the call, when the kubelet serves it.
    pub pod_resources: Option<&'a PodResourcesView>,
}

/// How the pod was determined (logged and counted in metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChoiceReason {
    /// The previous call served this pod's earlier container; a pod's calls are contiguous.
    Continuing,
    /// Pod-resources elimination left only this pod.
    Elimination,
    /// HAMi's scheduler's node lock names this pod.
    HamiLock,
    /// The only pending pod with this device count.
    Unique,
    /// The oldest of a class of interchangeable pods.
    OldestOfClass,
    /// A restarted kubelet asks again for a pod served before its restart, and nothing else
    /// could be meant.
    Reask,
}

impl ChoiceReason {
    pub fn as_str(self) -> &'static str {
        match self {
            ChoiceReason::Continuing => "continuing",
            ChoiceReason::Elimination => "elimination",
            ChoiceReason::HamiLock => "hami_lock",
            ChoiceReason::Unique => "unique",
            ChoiceReason::OldestOfClass => "oldest_of_class",
            ChoiceReason::Reask => "reask",
        }
    }
}

/// The pod and container entry to serve.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub entry_index: usize,
    pub devices: ContainerDevices,
    pub container: ContainerSpec,
    /// Entries of this pod still unserved after this one.
    pub entries_left: usize,
    /// Position (in the pod's entries) of the container the pod's next call must be, if any.
    pub next: Option<usize>,
    pub reason: ChoiceReason,
}

/// Why no pod can be served: the call must fail (the kubelet rejects the pod; its owner
/// recreates it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    #[error(
        "no pod bound to this node is waiting for a container with {count} device(s) (bind-phase allocating, hami.io/vgpu-devices-to-allocate)"
    )]
    NoCandidate { count: usize },
    #[error(
        "the kubelet is reusing init-container devices, but no pod is in the middle of its allocation"
    )]
    NoContinuingPod,
    #[error(
        "refusing to guess: {} pods could be the one being admitted for {count} device(s) and their limits differ: {}",
        candidates.len(),
        candidates.join(", ")
    )]
    Ambiguous {
        count: usize,
        candidates: Vec<String>,
    },
    #[error(
        "the kubelet is admitting pod {pod} (pod-resources), but it has no pending allocation for {count} device(s)"
    )]
    AdmittedPodNotPending { pod: String, count: usize },
    #[error(
        "refusing to guess: the restarted kubelet may be asking again for pod {pod}, whose containers with {count} device(s) have different limits or GPUs"
    )]
    AmbiguousReask { pod: String, count: usize },
}

/// `(mem, cores)` per device of an entry: what the container's limits are made of.
fn payload(entry: Option<&(usize, ContainerDevices, ContainerSpec)>) -> Vec<(u32, u32)> {
    entry
        .map(|(_, d, _)| d.iter().map(|x| (x.usedmem, x.usedcores)).collect())
        .unwrap_or_default()
}

/// Serves the entry at `position` of `p`.
fn choice(p: &PendingPod<'_>, position: usize, reason: ChoiceReason) -> Option<Choice> {
    let (index, devices, container) = p.entries.get(position)?;
    Some(Choice {
        namespace: p.pod.namespace.clone(),
        name: p.pod.name.clone(),
        uid: p.pod.uid.clone(),
        entry_index: *index,
        devices: devices.clone(),
        container: container.clone(),
        entries_left: p.remaining_after(*index),
        next: (position + 1 < p.entries.len()).then_some(position + 1),
        reason,
    })
}

/// Serves a fresh pod's first entry.
fn first(p: &PendingPod<'_>, reason: ChoiceReason) -> Option<Choice> {
    choice(p, 0, reason)
}

/// A re-asked pod: the call can be any of its containers with the call's count whose allocation
/// the restarted kubelet did not keep, so it is served only if all of them carry the same GPUs
/// and limits.
fn reask(p: &PendingPod<'_>, positions: &[usize], count: usize) -> Result<Choice, IdentityError> {
    let entry = |pos: &usize| p.entries.get(*pos).map(|(_, d, _)| d);
    let identical = positions.windows(2).all(|w| entry(&w[0]) == entry(&w[1]));
    positions
        .first()
        .filter(|_| identical)
        .and_then(|pos| choice(p, *pos, ChoiceReason::Reask))
        .ok_or_else(|| IdentityError::AmbiguousReask {
            pod: p.pod.key(),
            count,
        })
}

/// Decides which pod a call serves. See the module documentation and the design document.
pub fn select(
    call: CallFacts<'_>,
    pending: &[PendingPod<'_>],
    ledger: &Ledger,
) -> Result<Choice, IdentityError> {
    // With pod-resources, a pod the kubelet has not reached yet is not in its pod manager, and
    // a pod whose containers all show devices is not under admission.
    let admitting = |p: &PendingPod<'_>| {
        call.pod_resources
            .is_none_or(|v| v.possibly_admitting(p.pod))
    };

    // 1. The continuing pod: its earlier container was the previous call (F2).
    let continuing = continuing_pod(pending, ledger, call.count)
        // With pod-resources (1.34+), a pod rejected mid-run has left the active list.
        .filter(|(p, _)| call.pod_resources.is_none_or(|v| v.listed(&p.pod.key())));
    if call.must_include {
        // Init-container devices are reused only inside one pod: this is a continuation.
        return continuing
            .and_then(|(p, pos)| choice(p, pos, ChoiceReason::Continuing))
            .ok_or(IdentityError::NoContinuingPod);
    }

    // 2. Fresh candidates: pending pods not yet started whose first entry has this count.
    // A started pod that is not continuing had its run aborted by the kubelet, unless the
    // kubelet restarted since (3).
    let fresh: Vec<&PendingPod<'_>> = pending
        .iter()
        .filter(|p| p.fresh_for(call.count) && admitting(p))
        .collect();

    // 3. Re-asks: every container with this count of a pod a restarted kubelet may admit again
    // (its allocation up to any container may be lost, so any of them can be asked first).
    let continuing_uid = continuing.map(|(p, _)| p.pod.uid.as_str());
    let reasks: Vec<(&PendingPod<'_>, Vec<usize>)> = pending
        .iter()
        .filter(|p| p.reaskable && Some(p.pod.uid.as_str()) != continuing_uid && admitting(p))
        .map(|p| {
            let positions = (0..p.entries.len())
                .filter(|pos| p.count_at(*pos, call.count))
                .collect();
            (p, positions)
        })
        .filter(|(_, positions): &(_, Vec<usize>)| !positions.is_empty())
        .collect();
    let ambiguous = |extra: Option<&PendingPod<'_>>| {
        let mut names: Vec<String> = fresh
            .iter()
            .map(|q| q.pod.key())
            .chain(reasks.iter().map(|(q, _)| q.pod.key()))
            .chain(extra.map(|q| q.pod.key()))
            .collect();
        names.sort();
        IdentityError::Ambiguous {
            count: call.count,
            candidates: names,
        }
    };

    // The continuing pod is served unless the call could also be another pod's container (the
    // continuing pod's run was aborted without a trace) with different limits.
    if let Some((p, pos)) = continuing {
        let limits = payload(p.entries.get(pos));
        let others_agree = fresh
            .iter()
            .map(|q| payload(q.entries.first()))
            .chain(
                reasks
                    .iter()
                    .flat_map(|(q, ps)| ps.iter().map(|i| payload(q.entries.get(*i)))),
            )
            .all(|other| other == limits);
        if others_agree {
            return choice(p, pos, ChoiceReason::Continuing)
                .ok_or(IdentityError::NoCandidate { count: call.count });
        }
        return Err(ambiguous(Some(p)));
    }

    // 4. Elimination through pod-resources.
    if let Some(view) = call.pod_resources {
        match (fresh.as_slice(), reasks.as_slice()) {
            ([], []) => {
                let admitting: Vec<&PodSnapshot> = pending
                    .iter()
                    .map(|p| p.pod)
                    .filter(|pod| view.possibly_admitting(pod))
                    .collect();
                if let [only] = admitting.as_slice() {
                    return Err(IdentityError::AdmittedPodNotPending {
                        pod: only.key(),
                        count: call.count,
                    });
                }
                return Err(IdentityError::NoCandidate { count: call.count });
            }
            ([only], []) => {
                return first(only, ChoiceReason::Elimination)
                    .ok_or(IdentityError::NoCandidate { count: call.count });
            }
            ([], [(only, positions)]) => return reask(only, positions, call.count),
            _ => {}
        }
    }

    // 5. After a kubelet restart a call is served only when nothing else could be meant.
    if !reasks.is_empty() {
        return match (fresh.as_slice(), reasks.as_slice()) {
            ([], [(only, positions)]) => reask(only, positions, call.count),
            _ => Err(ambiguous(None)),
        };
    }

    // 6. HAMi's scheduler told us (compatibility with HAMi's node lock).
    if let Some(lock) = call.hami_lock
        && let Some(p) = fresh.iter().find(|p| p.pod.key() == lock)
    {
        return first(p, ChoiceReason::HamiLock)
            .ok_or(IdentityError::NoCandidate { count: call.count });
    }

    match fresh.as_slice() {
        [] => Err(IdentityError::NoCandidate { count: call.count }),
        [only] => first(only, ChoiceReason::Unique)
            .ok_or(IdentityError::NoCandidate { count: call.count }),
        [head, rest @ ..] => {
            if rest
                .iter()
                .all(|p| p.signature.interchangeable_with(&head.signature))
            {
                let oldest = fresh
                    .iter()
                    .min_by(|a, b| {
                        (a.pod.bind_time(), a.pod.key()).cmp(&(b.pod.bind_time(), b.pod.key()))
                    })
                    .copied()
                    .unwrap_or(head);
                first(oldest, ChoiceReason::OldestOfClass)
                    .ok_or(IdentityError::NoCandidate { count: call.count })
            } else {
                Err(ambiguous(None))
            }
        }
    }
}

/// The pod the kubelet most likely asks for in a call for `count` devices, guessed from the
/// cache before the call's pod-resources `List` answers, so that reading that pod by name can
/// start at once and overlap the `List` instead of following it (issue 29: the kubelet admits
/// one pod at a time, so the call's latency is paid once per pod). A guess only: it decides
/// what is read early, never what is served; a wrong guess costs one read.
///
/// The continuing pod, when its next entry has the call's count (F2). Otherwise the fresh
/// candidate bound first: the kubelet admits pods in the order its watch delivers their
/// bindings, and the cached object of a bound pod the kubelet has not admitted is usually that
/// binding, so the lowest `resourceVersion` (compared as the number etcd writes; one that is
/// not a number sorts last) is the likeliest, then the oldest `bind-time`, then the name.
pub fn likely_admitting<'a>(
    count: usize,
    pending: &[PendingPod<'a>],
    ledger: &Ledger,
) -> Option<&'a PodSnapshot> {
    if let Some((p, _)) = continuing_pod(pending, ledger, count) {
        return Some(p.pod);
    }
    pending
        .iter()
        .filter(|p| p.fresh_for(count))
        .min_by_key(|p| {
            (
                p.pod.resource_version.parse::<u64>().unwrap_or(u64::MAX),
                p.pod.bind_time(),
                p.pod.key(),
            )
        })
        .map(|p| p.pod)
}

/// The pod whose run the previous call served part of, with the position of its next entry,
/// when that entry asks for `count` devices (F2: a pod's calls are contiguous).
fn continuing_pod<'p, 'a>(
    pending: &'p [PendingPod<'a>],
    ledger: &Ledger,
    count: usize,
) -> Option<(&'p PendingPod<'a>, usize)> {
    ledger
        .continuing()
        .and_then(|(uid, pos)| pending.iter().find(|p| p.pod.uid == uid).map(|p| (p, pos)))
        .filter(|(p, pos)| p.count_at(*pos, count))
}

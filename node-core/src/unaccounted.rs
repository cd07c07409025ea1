//! Unaccounted GPU processes (pure): each monitor pass compares the processes NVML reports on
//! each GPU with what the node's allocations account for, and names every process that no
//! booking covers, with a reason a user understands (issue 28, item 3).
//!
//! A process on GPU `G` is **accounted** when its cgroup puts it in pod `U`, `U` was booked `G`
//! (its HAMi annotations, or a DRA claim `U` uses that holds `G`), and a shim region of `U`'s
//! (of the same container when its name is known, or of that claim) names `G` and lists the
//! process in a live slot. Otherwise it is **unaccounted**, for one [`Reason`]:
//!
//! * [`Reason::NotBooked`]: its pod has no allocation on `G`, whether or not a region lists it;
//! * [`Reason::NoShimRegion`]: booked, but no region of its pod lists it on `G` (a static binary,
//!   a custom loader, a removed `/etc/ld.so.preload`): its limits do not apply;
//! * [`Reason::NotInAPod`]: its cgroup is no pod's. Host services that legitimately use GPUs (an
//!   MPS control daemon, Xorg, DCGM) are allowed by cgroup ([`Exemptions::host_cgroups`]) and
//!   counted apart, never reported.
//!
//! A process accounted on one GPU and also using another that its pod did not book is
//! unaccounted on that other one: every (GPU, PID) pair is judged on its own.
//!
//! # Trust
//!
//! NVML and the cgroup (kernel) are trusted; a region's contents are the container's (the shim
//! writes them inside the container), so a region only ever vouches for processes of its own
//! pod: the cgroup, not the region, says which pod a process is in. The UUIDs a region names
//! count only on GPUs the pod was booked. The region is matched on the host PID a HAMi-core shim
//! records (`hostpid`) or on the PID inside the container's PID namespace (the innermost of
//! `/proc/<pid>/status` `NSpid`, which is what Tessera's shim records: it leaves `hostpid` 0).
//! A tenant who forges a slot in its own region for a process without the shim is not caught
//! by [`classify`]; [`over_booked`] catches what such a process takes beyond the booking, from
//! NVML's per-process memory alone.
//!
//! # How the monitor calls it
//!
//! ```text
//! let processes = gpu_processes::list_all(&source, &gpu_uuids)          // (a) per GPU, deduped
//! let identities = gpu_processes::identify(&proc_root, pids)            // (d) cgroup + NSpid
//! let regions = scanned.map(|(path, snap)| ShimRegion::from_snapshot(region_owner(&path), &snap))
//! let obs = Observation { processes, regions, booked: monitor::booked_gpus(&pods),
//!                         identities, ..Default::default() }
//! let findings = classify(&obs, &exemptions);
//! for p in confirmer.confirm(&findings.unaccounted) { … }               // seen two passes running
//! findings.pod_summary(uid)   → the Event message / eviction reason of one pod
//! p.reason.code()            → the Event reason / metric label
//! ```
//!
//! Processes whose identity could not be read (they exited between the NVML call and the
//! `/proc` read, or `/proc` is not the host's) are returned as [`Findings::undetermined`], never
//! guessed: a plugin without `hostPID` would see them all there, and should say so.

use std::collections::{BTreeMap, BTreeSet};

use vgpu_region::{MAX_DEVICES, RegionSnapshot};

pub use crate::pod_cgroup::{CgroupOwner, PodCgroup};

/// The NVML list a process was found in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ProcessKind {
    /// A compute (CUDA) context; under MPS, the MPS server.
    Compute,
    /// A graphics (OpenGL, Vulkan) context.
    Graphics,
    /// A client of an MPS server.
    Mps,
}

impl ProcessKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ProcessKind::Compute => "compute",
            ProcessKind::Graphics => "graphics",
            ProcessKind::Mps => "mps",
        }
    }
}

/// (a) One process NVML reports on one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuProcess {
    pub gpu_uuid: String,
    /// The host PID (NVML's, as the plugin with `hostPID` sees it).
    pub pid: u32,
    /// Bytes it uses on this GPU; `None` when NVML cannot tell.
    pub used_bytes: Option<u64>,
    /// The lists it was found in (a CUDA + OpenGL process is in two).
    pub kinds: BTreeSet<ProcessKind>,
}

/// Who a shim region belongs to: where the plugin put it, not what it says.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RegionOwner {
    /// `<containers>/<podUID>_<container>/`.
    Container { pod_uid: String, container: String },
    /// `<claims>/<claimUID>/`: shared by every container using a DRA claim.
    Claim { claim_uid: String },
}

impl RegionOwner {
    /// The owner of a region file found by `tessera_node::monitor::region_paths` (container) or
    /// `tessera_node::monitor::claim_region_paths` (claim: `pod_uid` holds the claim's UID and
    /// `container` is empty).
    pub fn of_path(path: &crate::accounting::RegionPath) -> Self {
        if path.container.is_empty() {
            RegionOwner::Claim {
                claim_uid: path.pod_uid.clone(),
            }
        } else {
            RegionOwner::Container {
                pod_uid: path.pod_uid.clone(),
                container: path.container.clone(),
            }
        }
    }
}

/// One live process slot of a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RegionSlot {
    /// The PID inside the container's PID namespace (`getpid()` in the shim).
    pub pid: u32,
    /// The host PID, when the shim recorded one (HAMi-core does; Tessera's shim does not).
    pub host_pid: Option<u32>,
}

/// (b) A shim region the monitor read this pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShimRegion {
    pub owner: RegionOwner,
    /// The GPUs the shim tracks (its device list).
    pub gpu_uuids: BTreeSet<String>,
    /// Its live process slots.
    pub slots: Vec<RegionSlot>,
}

impl ShimRegion {
    /// The accounting facts of a parsed region: its first `device_num` UUIDs (at most
    /// [`MAX_DEVICES`]) and its live slots (not exited, PID set).
    pub fn from_snapshot(owner: RegionOwner, region: &RegionSnapshot) -> Self {
        let devices = usize::try_from(region.device_num)
            .unwrap_or(MAX_DEVICES)
            .min(MAX_DEVICES);
        let gpu_uuids = region
            .uuids
            .iter()
            .take(devices)
            .filter(|u| !u.is_empty())
            .cloned()
            .collect();
        let slots = region
            .live_procs()
            .filter_map(|slot| {
                Some(RegionSlot {
                    pid: u32::try_from(slot.pid).ok().filter(|p| *p > 0)?,
                    host_pid: u32::try_from(slot.hostpid).ok().filter(|p| *p > 0),
                })
            })
            .collect();
        ShimRegion {
            owner,
            gpu_uuids,
            slots,
        }
    }
}

/// A DRA claim's booking: the GPUs allocated to it and the pods that use it (its
/// `status.reservedFor`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClaimBooking {
    pub gpus: BTreeSet<String>,
    pub pods: BTreeSet<String>,
}

/// (d) What `/proc/<pid>` says about a host PID.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessIdentity {
    /// From `/proc/<pid>/cgroup`.
    pub owner: CgroupOwner,
    /// Its PID in its own (innermost) PID namespace, from `/proc/<pid>/status` `NSpid`; `None`
    /// when unknown, and then the host PID is used (a `hostPID` pod's PIDs are the same).
    pub ns_pid: Option<u32>,
}

/// A container's name, known from its ID (the pod's `status.containerStatuses[].containerID`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerName {
    pub pod_uid: String,
    pub name: String,
}

/// Everything one pass looked at. Fields left empty mean "none".
#[derive(Debug, Clone, Default)]
pub struct Observation {
    /// (a) Every process NVML reported, per GPU (duplicates are merged).
    pub processes: Vec<GpuProcess>,
    /// (b) Every shim region read this pass (containers' and claims').
    pub regions: Vec<ShimRegion>,
    /// (c) The GPUs each pod (by UID) was booked: [`crate::accounting::booked_gpus`].
    pub booked: BTreeMap<String, BTreeSet<String>>,
    /// (c) The GPU memory (MiB) each pod was booked on each GPU, summed over its containers:
    /// [`crate::accounting::booked_memory`]. Only [`over_booked`] reads it.
    pub booked_mib: BTreeMap<String, BTreeMap<String, u64>>,
    /// (c) DRA claims on this node, by claim UID.
    pub claims: BTreeMap<String, ClaimBooking>,
    /// (d) Per host PID; a PID absent here is [`Findings::undetermined`].
    pub identities: BTreeMap<u32, ProcessIdentity>,
    /// Optional: container ID → name. When a process's container is named here, only that
    /// container's regions account for it; otherwise any region of its pod does.
    pub container_names: BTreeMap<String, ContainerName>,
}

/// What the operator allows.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Exemptions {
    /// Host cgroups whose processes may use GPUs, each a path prefix matched on `/` boundaries
    /// (`/system.slice/nvidia-mps.service` allows that service and its children; `/` allows
    /// every host process).
    pub host_cgroups: Vec<String>,
    /// Pods (by UID) allowed to run without the shim on the GPUs they were booked: a process of
    /// theirs is accounted without a region, never on a GPU they were not booked.
    pub shimless_pods: BTreeSet<String>,
}

impl Exemptions {
    /// Whether a host process in `cgroup` is allowed.
    pub fn allows_host_cgroup(&self, cgroup: &str) -> bool {
        // An empty entry (an empty flag value, a stray comma) allows nothing.
        self.host_cgroups
            .iter()
            .filter(|p| !p.is_empty())
            .any(|prefix| {
                cgroup.strip_prefix(prefix.as_str()).is_some_and(|rest| {
                    rest.is_empty() || rest.starts_with('/') || prefix.ends_with('/')
                })
            })
    }
}

/// Why a process is unaccounted. The order is the report's (booking problems first).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Reason {
    /// Its pod has no allocation on this GPU.
    NotBooked,
    /// Its pod was booked the GPU, but no shim region of its pod lists it there.
    NoShimRegion,
    /// It is in no pod's cgroup; `cgroup` is where it is.
    NotInAPod { cgroup: String },
    /// Its pod's processes on this GPU use more memory than the pod was booked there
    /// ([`over_booked`]): `booked_mib`, plus the per-process allowance, gives `allowed_mib`
    /// for `processes` processes.
    OverBooking {
        booked_mib: u64,
        allowed_mib: u64,
        processes: u64,
    },
}

impl Reason {
    /// Every [`Reason::code`], in the report's order: the metric has a series for each.
    pub const CODES: [&'static str; 4] = [
        "GpuNotBooked",
        "GpuProcessWithoutShim",
        "GpuProcessOutsidePods",
        "GpuMemoryOverBooking",
    ];

    /// A stable machine name: the Event reason and the metric label.
    pub fn code(&self) -> &'static str {
        match self {
            Reason::NotBooked => Self::CODES[0],
            Reason::NoShimRegion => Self::CODES[1],
            Reason::NotInAPod { .. } => Self::CODES[2],
            Reason::OverBooking { .. } => Self::CODES[3],
        }
    }
}

/// A process no booking covers, on one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnaccountedProcess {
    pub gpu_uuid: String,
    /// Host PID.
    pub pid: u32,
    /// Its pod, from its cgroup; `None` for [`Reason::NotInAPod`].
    pub pod_uid: Option<String>,
    pub container_id: Option<String>,
    /// Its container's name, when [`Observation::container_names`] knows it.
    pub container: Option<String>,
    pub used_bytes: Option<u64>,
    pub kinds: BTreeSet<ProcessKind>,
    pub reason: Reason,
}

/// Longest piece of untrusted text (a cgroup path, a container name) quoted in a message.
const MAX_QUOTED: usize = 160;

/// `text` with control characters escaped, cut to [`MAX_QUOTED`] characters: it goes into
/// Events and logs.
fn quoted(text: &str) -> String {
    let mut out: String = text
        .chars()
        .take(MAX_QUOTED)
        .flat_map(char::escape_debug)
        .collect();
    if text.chars().nth(MAX_QUOTED).is_some() {
        out.push('…');
    }
    out
}

impl UnaccountedProcess {
    /// Whether a pod can be evicted for it (only a pod's process can).
    pub fn evictable(&self) -> bool {
        self.pod_uid.is_some()
    }

    /// One sentence for an Event, an eviction reason or a log line.
    pub fn message(&self) -> String {
        let container = self
            .container
            .as_deref()
            .map(|c| format!(" in container \"{}\"", quoted(c)))
            .unwrap_or_default();
        let usage = self
            .used_bytes
            .map(|b| format!(" ({} MiB)", b >> 20))
            .unwrap_or_default();
        let pid = self.pid;
        let gpu = quoted(&self.gpu_uuid);
        match &self.reason {
            Reason::NotBooked => format!(
                "process {pid}{container} uses GPU {gpu}{usage}, which was not allocated to this \
                 pod; a pod may use only the GPUs it was scheduled with"
            ),
            Reason::NoShimRegion => format!(
                "process {pid}{container} uses GPU {gpu}{usage} without Tessera's GPU-sharing \
                 library, so the pod's GPU memory and compute limits do not apply to it (a \
                 statically linked program, a custom loader or a removed /etc/ld.so.preload does \
                 this); run it as an ordinary dynamically linked CUDA program"
            ),
            Reason::NotInAPod { cgroup } => format!(
                "process {pid} outside any Kubernetes pod (cgroup \"{}\") uses GPU {gpu}{usage}, \
                 which no booking accounts for; if it is a host service meant to use GPUs, add \
                 its cgroup to the device plugin's allowed host processes",
                quoted(cgroup)
            ),
            Reason::OverBooking {
                booked_mib,
                allowed_mib,
                processes,
            } => {
                let used = self.used_bytes.unwrap_or(0) >> 20;
                let (others, verb) = match processes.saturating_sub(1) {
                    0 => (String::new(), "uses"),
                    1 => (" and 1 other process".to_owned(), "use"),
                    n => (format!(" and {n} other processes"), "use"),
                };
                format!(
                    "process {pid}{container}{others} of this pod {verb} {used} MiB of GPU {gpu}, \
                     more than the {booked_mib} MiB it was allocated there (at most {allowed_mib} \
                     MiB with the driver's own reservations); its GPU memory limit did not hold, \
                     as happens when a program reaches the driver around Tessera's GPU-sharing \
                     library"
                )
            }
        }
    }
}

/// A (GPU, host PID) pair.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ProcessOnGpu {
    pub gpu_uuid: String,
    pub pid: u32,
}

/// The outcome of one pass. Every (GPU, PID) NVML reported is in exactly one place: accounted
/// (counted), unaccounted, allowed host process, or undetermined. Lists are sorted by GPU UUID,
/// then PID.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Findings {
    pub unaccounted: Vec<UnaccountedProcess>,
    /// How many (GPU, PID) pairs a booking accounts for.
    pub accounted: usize,
    /// Host processes in an allowed cgroup.
    pub allowed_host: Vec<ProcessOnGpu>,
    /// Processes whose `/proc` entry could not be read (exited meanwhile, or no `hostPID`).
    pub undetermined: Vec<ProcessOnGpu>,
}

/// Most processes one pod's summary names; the rest are counted.
const MAX_IN_SUMMARY: usize = 3;

impl Findings {
    /// The unaccounted processes of each pod, by pod UID.
    pub fn by_pod(&self) -> BTreeMap<&str, Vec<&UnaccountedProcess>> {
        let mut out: BTreeMap<&str, Vec<&UnaccountedProcess>> = BTreeMap::new();
        for p in &self.unaccounted {
            if let Some(uid) = p.pod_uid.as_deref() {
                out.entry(uid).or_default().push(p);
            }
        }
        out
    }

    /// The unaccounted processes in no pod (reported on the node).
    pub fn outside_pods(&self) -> impl Iterator<Item = &UnaccountedProcess> {
        self.unaccounted.iter().filter(|p| p.pod_uid.is_none())
    }

    /// One message for pod `pod_uid` (its Event, or the reason it is evicted), or `None` when
    /// it has no unaccounted process: the first processes' sentences, then how many more.
    pub fn pod_summary(&self, pod_uid: &str) -> Option<String> {
        let mine: Vec<&UnaccountedProcess> = self
            .unaccounted
            .iter()
            .filter(|p| p.pod_uid.as_deref() == Some(pod_uid))
            .collect();
        if mine.is_empty() {
            return None;
        }
        let mut text = format!(
            "Tessera found {} GPU process{} of this pod outside its GPU booking: ",
            mine.len(),
            if mine.len() == 1 { "" } else { "es" }
        );
        let shown: Vec<String> = mine
            .iter()
            .take(MAX_IN_SUMMARY)
            .map(|p| p.message())
            .collect();
        text.push_str(&shown.join("; "));
        if mine.len() > MAX_IN_SUMMARY {
            text.push_str(&format!("; and {} more", mine.len() - MAX_IN_SUMMARY));
        }
        Some(text)
    }
}

/// Judges every (GPU, PID) pair of `observation` (see the module docs). Deterministic: the same
/// facts in any order give the same findings.
pub fn classify(observation: &Observation, exemptions: &Exemptions) -> Findings {
    let processes = merged(&observation.processes);
    let mut regions_of_pod: BTreeMap<&str, Vec<&ShimRegion>> = BTreeMap::new();
    let mut regions_of_claim: BTreeMap<&str, Vec<&ShimRegion>> = BTreeMap::new();
    for region in &observation.regions {
        match &region.owner {
            RegionOwner::Container { pod_uid, .. } => {
                regions_of_pod.entry(pod_uid).or_default().push(region)
            }
            RegionOwner::Claim { claim_uid } => {
                regions_of_claim.entry(claim_uid).or_default().push(region)
            }
        }
    }
    let mut findings = Findings::default();
    for ((gpu, pid), (used_bytes, kinds)) in processes {
        let at = ProcessOnGpu {
            gpu_uuid: gpu.to_owned(),
            pid,
        };
        let Some(identity) = observation.identities.get(&pid) else {
            findings.undetermined.push(at);
            continue;
        };
        let unaccounted = |reason: Reason, pod: Option<&PodCgroup>, container: Option<String>| {
            UnaccountedProcess {
                gpu_uuid: gpu.to_owned(),
                pid,
                pod_uid: pod.map(|p| p.pod_uid.clone()),
                container_id: pod.and_then(|p| p.container_id.clone()),
                container,
                used_bytes,
                kinds: kinds.clone(),
                reason,
            }
        };
        let resolved = resolved_container(identity, observation);
        let pod = match (&identity.owner, &resolved) {
            (_, Some(pod)) => pod,
            (CgroupOwner::Host { cgroup } | CgroupOwner::Container { cgroup, .. }, None) => {
                if exemptions.allows_host_cgroup(cgroup) {
                    findings.allowed_host.push(at);
                } else {
                    let reason = Reason::NotInAPod {
                        cgroup: cgroup.clone(),
                    };
                    findings.unaccounted.push(unaccounted(reason, None, None));
                }
                continue;
            }
            (CgroupOwner::Pod(pod), None) => pod,
        };
        let uid = pod.pod_uid.as_str();
        // The container's name, only when the name map agrees on the pod.
        let container = pod
            .container_id
            .as_ref()
            .and_then(|id| observation.container_names.get(id))
            .filter(|n| n.pod_uid == uid)
            .map(|n| n.name.clone());
        let claims_on_gpu: Vec<&str> = observation
            .claims
            .iter()
            .filter(|(_, c)| c.pods.contains(uid) && c.gpus.contains(gpu))
            .map(|(claim_uid, _)| claim_uid.as_str())
            .collect();
        let booked = observation
            .booked
            .get(uid)
            .is_some_and(|gpus| gpus.contains(gpu))
            || !claims_on_gpu.is_empty();
        if !booked {
            findings
                .unaccounted
                .push(unaccounted(Reason::NotBooked, Some(pod), container));
            continue;
        }
        if exemptions.shimless_pods.contains(uid) {
            findings.accounted += 1;
            continue;
        }
        let ns_pid = identity.ns_pid.unwrap_or(pid);
        let lists_it = |region: &ShimRegion| {
            region.gpu_uuids.contains(gpu)
                && region
                    .slots
                    .iter()
                    .any(|s| s.host_pid == Some(pid) || s.pid == ns_pid)
        };
        let own_container = |region: &&ShimRegion| match (&region.owner, &container) {
            (RegionOwner::Container { container: c, .. }, Some(name)) => c == name,
            _ => true,
        };
        let container_regions = regions_of_pod.get(uid).into_iter().flatten().copied();
        let claim_regions = claims_on_gpu
            .iter()
            .filter_map(|claim| regions_of_claim.get(claim))
            .flatten()
            .copied();
        let covered = container_regions
            .filter(own_container)
            .chain(claim_regions)
            .any(lists_it);
        if covered {
            findings.accounted += 1;
        } else {
            findings
                .unaccounted
                .push(unaccounted(Reason::NoShimRegion, Some(pod), container));
        }
    }
    findings
}

/// A container outside pod cgroups (a kubelet without per-pod cgroups) belongs to the pod whose
/// status names its ID.
fn resolved_container(identity: &ProcessIdentity, observation: &Observation) -> Option<PodCgroup> {
    match &identity.owner {
        CgroupOwner::Container { container_id, .. } => observation
            .container_names
            .get(container_id)
            .map(|n| PodCgroup {
                pod_uid: n.pod_uid.clone(),
                container_id: Some(container_id.clone()),
            }),
        _ => None,
    }
}

/// The pod a process is in, from the kernel's facts only (its cgroup, or its container's ID
/// named in a pod's status); `None` outside pods or when `/proc` could not be read.
fn pod_of(pid: u32, observation: &Observation) -> Option<PodCgroup> {
    let identity = observation.identities.get(&pid)?;
    resolved_container(identity, observation).or_else(|| match &identity.owner {
        CgroupOwner::Pod(pod) => Some(pod.clone()),
        _ => None,
    })
}

/// A host PID a container's region should record for one of its slots (issue 31: the shim
/// keeps NVML's lists and utilization to the container's own processes by these).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct HostPidRecord {
    /// Index into [`Observation::regions`].
    pub region: usize,
    /// The slot's PID in the container.
    pub pid: u32,
    /// Its host PID, as NVML lists it.
    pub host_pid: u32,
}

/// The host PIDs to write into the containers' regions: for each process NVML lists, in a
/// container the pod's status names (its cgroup, not anything the container wrote), the slot
/// of that container's region with the same PID in the container's namespace, when the slot
/// does not record that host PID yet. A DRA claim's region (several containers, several PID
/// namespaces) gets none: a PID there does not say whose it is.
pub fn host_pids_to_record(observation: &Observation) -> Vec<HostPidRecord> {
    let mut out = BTreeSet::new();
    for process in &observation.processes {
        let Some(identity) = observation.identities.get(&process.pid) else {
            continue;
        };
        let Some(pod) = pod_of(process.pid, observation) else {
            continue;
        };
        let Some(name) = pod
            .container_id
            .as_ref()
            .and_then(|id| observation.container_names.get(id))
            .filter(|n| n.pod_uid == pod.pod_uid)
        else {
            continue;
        };
        let ns_pid = identity.ns_pid.unwrap_or(process.pid);
        for (i, region) in observation.regions.iter().enumerate() {
            let RegionOwner::Container { pod_uid, container } = &region.owner else {
                continue;
            };
            if *pod_uid != name.pod_uid || *container != name.name {
                continue;
            }
            if region
                .slots
                .iter()
                .any(|s| s.pid == ns_pid && s.host_pid != Some(process.pid))
            {
                out.insert(HostPidRecord {
                    region: i,
                    pid: ns_pid,
                    host_pid: process.pid,
                });
            }
        }
    }
    out.into_iter().collect()
}

/// Memory over the booking (beyond HAMi; issue 28): the processes of pod `U` on GPU `G`
/// together use, by NVML's per-process counts, more than `U` was booked on `G` plus
/// `allowance_mib` for each of those processes (what the driver reserves for a process outside
/// any allocation the shim sees: its context, local memory, the printf FIFO). One finding per
/// (pod, GPU), named after the pod's lowest PID there, so the same excess is confirmed across
/// passes while that process lives; its `used_bytes` is the pod's total on the GPU.
///
/// This does not depend on the shim or on anything a container writes: whatever lifted the
/// limit (raw driver calls, a second copy of the driver loaded where the preload cannot reach,
/// a forged region slot), NVML still counts the memory. Pods without a memory booking on `G`
/// (not booked it: [`Reason::NotBooked`] covers them) and pods exempt from the shim are not
/// judged; processes NVML gives no usage for count
/// as zero.
pub fn over_booked(
    observation: &Observation,
    exemptions: &Exemptions,
    allowance_mib: u64,
) -> Vec<UnaccountedProcess> {
    #[derive(Default)]
    struct Usage {
        bytes: u64,
        lowest: Option<(u32, Option<String>, BTreeSet<ProcessKind>)>,
        processes: u64,
    }
    let mut usage: BTreeMap<(String, &str), Usage> = BTreeMap::new();
    for ((gpu, pid), (used_bytes, kinds)) in merged(&observation.processes) {
        let Some(pod) = pod_of(pid, observation) else {
            continue;
        };
        let entry = usage.entry((pod.pod_uid.clone(), gpu)).or_default();
        entry.bytes = entry.bytes.saturating_add(used_bytes.unwrap_or(0));
        entry.processes += 1;
        if entry.lowest.as_ref().is_none_or(|(low, _, _)| pid < *low) {
            entry.lowest = Some((pid, pod.container_id.clone(), kinds));
        }
    }
    let mut out = Vec::new();
    for ((uid, gpu), used) in usage {
        if exemptions.shimless_pods.contains(&uid) {
            continue;
        }
        let Some(&booked_mib) = observation.booked_mib.get(&uid).and_then(|g| g.get(gpu)) else {
            continue;
        };
        let allowed_mib = booked_mib.saturating_add(allowance_mib.saturating_mul(used.processes));
        let Some((pid, container_id, kinds)) = used.lowest else {
            continue;
        };
        if used.bytes <= allowed_mib.saturating_mul(1 << 20) {
            continue;
        }
        let container = container_id
            .as_ref()
            .and_then(|id| observation.container_names.get(id))
            .filter(|n| n.pod_uid == uid)
            .map(|n| n.name.clone());
        out.push(UnaccountedProcess {
            gpu_uuid: gpu.to_owned(),
            pid,
            pod_uid: Some(uid),
            container_id,
            container,
            used_bytes: Some(used.bytes),
            kinds,
            reason: Reason::OverBooking {
                booked_mib,
                allowed_mib,
                processes: used.processes,
            },
        });
    }
    out
}

/// NVML's processes merged per (GPU, PID), in that order: the kinds together, the largest usage.
type Merged<'a> = BTreeMap<(&'a str, u32), (Option<u64>, BTreeSet<ProcessKind>)>;

fn merged(processes: &[GpuProcess]) -> Merged<'_> {
    let mut out: Merged<'_> = BTreeMap::new();
    for p in processes {
        let (used, kinds) = out.entry((p.gpu_uuid.as_str(), p.pid)).or_default();
        *used = (*used).max(p.used_bytes);
        kinds.extend(p.kinds.iter().copied());
    }
    out
}

/// Reports a finding only once it has been seen in two passes running: a process can be listed
/// by NVML a moment before its shim has recorded it, or exit between the NVML call and the
/// `/proc` read. With a pass every `T`, a lasting unaccounted process is confirmed within `2T`.
#[derive(Debug, Clone, Default)]
pub struct Confirmer {
    previous: BTreeSet<(String, u32, Reason)>,
}

impl Confirmer {
    /// The findings of this pass that the previous pass had too (same GPU, PID and reason).
    pub fn confirm(&mut self, unaccounted: &[UnaccountedProcess]) -> Vec<UnaccountedProcess> {
        let now: BTreeSet<(String, u32, Reason)> = unaccounted
            .iter()
            .map(|p| (p.gpu_uuid.clone(), p.pid, p.reason.clone()))
            .collect();
        let confirmed = unaccounted
            .iter()
            .filter(|p| {
                self.previous
                    .contains(&(p.gpu_uuid.clone(), p.pid, p.reason.clone()))
            })
            .cloned()
            .collect();
        self.previous = now;
        confirmed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Issue 31: the node tells each container's region the host PIDs of its processes, so
    /// the shim can keep NVML's answers to them. Only the container the kernel puts the process
    /// in, matched by its PID inside; a slot that already says so, another container's slot with
    /// the same inner PID, a claim's region and a process outside pods get nothing.
    #[test]
    fn host_pids_go_to_the_slot_of_the_same_container_and_inner_pid() {
        let mut obs = Observation {
            processes: vec![
                proc_on(G0, 1001, ProcessKind::Compute),
                proc_on(G1, 1001, ProcessKind::Compute),
                proc_on(G0, 2002, ProcessKind::Compute),
                proc_on(G0, 3003, ProcessKind::Compute),
            ],
            regions: vec![
                region("pod-a", "main", &[G0, G1], &[7, 9]),
                region("pod-b", "main", &[G0], &[7]),
                ShimRegion {
                    owner: RegionOwner::Claim {
                        claim_uid: "claim".into(),
                    },
                    gpu_uuids: [G0.to_owned()].into(),
                    slots: vec![RegionSlot {
                        pid: 7,
                        host_pid: None,
                    }],
                },
            ],
            ..Default::default()
        };
        obs.identities.insert(1001, in_pod("pod-a", "ctr-a", 7));
        obs.identities.insert(2002, in_pod("pod-b", "ctr-b", 7));
        obs.identities
            .insert(3003, on_host("/system.slice/x.service"));
        for (id, pod) in [("ctr-a", "pod-a"), ("ctr-b", "pod-b")] {
            obs.container_names.insert(
                id.into(),
                ContainerName {
                    pod_uid: pod.into(),
                    name: "main".into(),
                },
            );
        }
        let records = host_pids_to_record(&obs);
        assert_eq!(
            records,
            [
                HostPidRecord {
                    region: 0,
                    pid: 7,
                    host_pid: 1001
                },
                HostPidRecord {
                    region: 1,
                    pid: 7,
                    host_pid: 2002
                },
            ]
        );
        // Recorded already: nothing to write.
        obs.regions[0].slots[0].host_pid = Some(1001);
        obs.regions[1].slots[0].host_pid = Some(2002);
        assert!(host_pids_to_record(&obs).is_empty());
    }

    #[test]
    fn an_empty_allowed_cgroup_allows_nothing() {
        let ex = Exemptions {
            host_cgroups: vec![String::new()],
            ..Default::default()
        };
        assert!(!ex.allows_host_cgroup("/user.slice/session-1.scope"));
        assert!(!ex.allows_host_cgroup("/"));
    }

    const G0: &str = "GPU-0";
    const G1: &str = "GPU-1";

    fn proc_on(gpu: &str, pid: u32, kind: ProcessKind) -> GpuProcess {
        GpuProcess {
            gpu_uuid: gpu.into(),
            pid,
            used_bytes: Some(256 << 20),
            kinds: [kind].into(),
        }
    }

    fn in_pod(uid: &str, container_id: &str, ns_pid: u32) -> ProcessIdentity {
        ProcessIdentity {
            owner: CgroupOwner::Pod(PodCgroup {
                pod_uid: uid.into(),
                container_id: Some(container_id.into()),
            }),
            ns_pid: Some(ns_pid),
        }
    }

    fn on_host(cgroup: &str) -> ProcessIdentity {
        ProcessIdentity {
            owner: CgroupOwner::Host {
                cgroup: cgroup.into(),
            },
            ns_pid: None,
        }
    }

    fn region(pod: &str, container: &str, gpus: &[&str], pids: &[u32]) -> ShimRegion {
        ShimRegion {
            owner: RegionOwner::Container {
                pod_uid: pod.into(),
                container: container.into(),
            },
            gpu_uuids: gpus.iter().map(|g| g.to_string()).collect(),
            slots: pids
                .iter()
                .map(|&pid| RegionSlot {
                    pid,
                    host_pid: None,
                })
                .collect(),
        }
    }

    fn booked(entries: &[(&str, &[&str])]) -> BTreeMap<String, BTreeSet<String>> {
        entries
            .iter()
            .map(|(pod, gpus)| {
                (
                    pod.to_string(),
                    gpus.iter().map(|g| g.to_string()).collect(),
                )
            })
            .collect()
    }

    fn reasons(f: &Findings) -> Vec<(&str, u32, Reason)> {
        f.unaccounted
            .iter()
            .map(|p| (p.gpu_uuid.as_str(), p.pid, p.reason.clone()))
            .collect()
    }

    /// The usual case: a shim-tracked process of a booked pod, matched on its PID inside the
    /// container (Tessera's shim records no host PID).
    #[test]
    fn a_tracked_process_of_a_booked_pod_is_accounted() {
        let obs = Observation {
            processes: vec![proc_on(G0, 4242, ProcessKind::Compute)],
            regions: vec![region("pod-a", "main", &[G0], &[7])],
            booked: booked(&[("pod-a", &[G0])]),
            identities: [(4242, in_pod("pod-a", "c1", 7))].into(),
            ..Default::default()
        };
        let f = classify(&obs, &Exemptions::default());
        assert!(f.unaccounted.is_empty(), "{f:?}");
        assert_eq!(f.accounted, 1);
    }

    #[test]
    fn a_hami_core_host_pid_also_matches() {
        let mut r = region("pod-a", "main", &[G0], &[]);
        r.slots.push(RegionSlot {
            pid: 1,
            host_pid: Some(4242),
        });
        let obs = Observation {
            processes: vec![proc_on(G0, 4242, ProcessKind::Compute)],
            regions: vec![r],
            booked: booked(&[("pod-a", &[G0])]),
            identities: [(4242, in_pod("pod-a", "c1", 99))].into(),
            ..Default::default()
        };
        assert_eq!(classify(&obs, &Exemptions::default()).accounted, 1);
    }

    /// A static binary or a removed preload: the GPU shows a process no region lists.
    #[test]
    fn a_booked_process_without_a_region_is_reported_with_a_reason_a_user_reads() {
        let obs = Observation {
            processes: vec![proc_on(G0, 4242, ProcessKind::Compute)],
            regions: vec![region("pod-a", "main", &[G0], &[8])],
            booked: booked(&[("pod-a", &[G0])]),
            identities: [(4242, in_pod("pod-a", "c1", 7))].into(),
            container_names: [(
                "c1".to_string(),
                ContainerName {
                    pod_uid: "pod-a".into(),
                    name: "main".into(),
                },
            )]
            .into(),
            ..Default::default()
        };
        let f = classify(&obs, &Exemptions::default());
        assert_eq!(reasons(&f), vec![(G0, 4242, Reason::NoShimRegion)]);
        let p = &f.unaccounted[0];
        assert_eq!(p.pod_uid.as_deref(), Some("pod-a"));
        assert_eq!(p.container.as_deref(), Some("main"));
        assert!(p.evictable());
        let msg = p.message();
        assert!(
            msg.contains("process 4242 in container \"main\" uses GPU GPU-0 (256 MiB)"),
            "{msg}"
        );
        assert!(msg.contains("limits do not apply"), "{msg}");
        assert_eq!(p.reason.code(), "GpuProcessWithoutShim");
    }

    /// One region per container: another container's slot with the same namespace PID does not
    /// cover a process whose container is known.
    #[test]
    fn another_containers_region_does_not_cover_a_named_container() {
        let names = [(
            "c2".to_string(),
            ContainerName {
                pod_uid: "pod-a".into(),
                name: "sidecar".into(),
            },
        )]
        .into();
        let obs = Observation {
            processes: vec![proc_on(G0, 4242, ProcessKind::Compute)],
            regions: vec![region("pod-a", "main", &[G0], &[1])],
            booked: booked(&[("pod-a", &[G0])]),
            identities: [(4242, in_pod("pod-a", "c2", 1))].into(),
            container_names: names,
            ..Default::default()
        };
        let f = classify(&obs, &Exemptions::default());
        assert_eq!(reasons(&f), vec![(G0, 4242, Reason::NoShimRegion)]);
        // Without the name map, any region of the pod counts.
        let obs = Observation {
            container_names: BTreeMap::new(),
            ..obs
        };
        assert!(
            classify(&obs, &Exemptions::default())
                .unaccounted
                .is_empty()
        );
    }

    /// Accounted on its own GPU, unaccounted on the one it did not book; a region naming the
    /// other GPU does not make it booked.
    #[test]
    fn a_second_gpu_the_pod_did_not_book_is_reported_on_that_gpu() {
        let obs = Observation {
            processes: vec![
                proc_on(G0, 4242, ProcessKind::Compute),
                proc_on(G1, 4242, ProcessKind::Compute),
            ],
            regions: vec![region("pod-a", "main", &[G0, G1], &[7])],
            booked: booked(&[("pod-a", &[G0])]),
            identities: [(4242, in_pod("pod-a", "c1", 7))].into(),
            ..Default::default()
        };
        let f = classify(&obs, &Exemptions::default());
        assert_eq!(reasons(&f), vec![(G1, 4242, Reason::NotBooked)]);
        assert_eq!(f.accounted, 1);
        let msg = f.unaccounted[0].message();
        assert!(msg.contains("which was not allocated to this pod"), "{msg}");
    }

    /// `NVIDIA_VISIBLE_DEVICES=all` in a pod with no GPU request: not booked anywhere.
    #[test]
    fn a_pod_without_any_booking_is_not_booked_even_with_a_region() {
        let obs = Observation {
            processes: vec![proc_on(G0, 500, ProcessKind::Graphics)],
            regions: vec![region("pod-x", "main", &[G0], &[500])],
            identities: [(500, in_pod("pod-x", "c9", 500))].into(),
            ..Default::default()
        };
        let f = classify(&obs, &Exemptions::default());
        assert_eq!(reasons(&f), vec![(G0, 500, Reason::NotBooked)]);
        assert_eq!(
            f.unaccounted[0].kinds,
            BTreeSet::from([ProcessKind::Graphics])
        );
    }

    /// A region vouches only for its own pod's processes, whatever PIDs it lists.
    #[test]
    fn another_pods_region_never_covers_a_process() {
        let obs = Observation {
            processes: vec![proc_on(G0, 4242, ProcessKind::Compute)],
            regions: vec![ShimRegion {
                slots: vec![RegionSlot {
                    pid: 7,
                    host_pid: Some(4242),
                }],
                ..region("pod-b", "main", &[G0], &[])
            }],
            booked: booked(&[("pod-a", &[G0]), ("pod-b", &[G0])]),
            identities: [(4242, in_pod("pod-a", "c1", 7))].into(),
            ..Default::default()
        };
        let f = classify(&obs, &Exemptions::default());
        assert_eq!(reasons(&f), vec![(G0, 4242, Reason::NoShimRegion)]);
    }

    #[test]
    fn host_processes_are_reported_on_the_node_unless_their_cgroup_is_allowed() {
        let obs = Observation {
            processes: vec![
                proc_on(G0, 10, ProcessKind::Compute),
                proc_on(G0, 11, ProcessKind::Graphics),
                proc_on(G1, 12, ProcessKind::Compute),
            ],
            identities: [
                (10, on_host("/system.slice/nvidia-mps.service")),
                (11, on_host("/system.slice/display-manager.service/x")),
                (12, on_host("/user.slice/user-1000.slice/session-4.scope")),
            ]
            .into(),
            ..Default::default()
        };
        let exemptions = Exemptions {
            host_cgroups: vec![
                "/system.slice/nvidia-mps.service".into(),
                "/system.slice/display-manager.service".into(),
            ],
            ..Default::default()
        };
        let f = classify(&obs, &exemptions);
        assert_eq!(
            reasons(&f),
            vec![(
                G1,
                12,
                Reason::NotInAPod {
                    cgroup: "/user.slice/user-1000.slice/session-4.scope".into()
                }
            )]
        );
        assert_eq!(f.allowed_host.len(), 2);
        assert!(!f.unaccounted[0].evictable());
        assert_eq!(f.outside_pods().count(), 1);
        let msg = f.unaccounted[0].message();
        assert!(msg.contains("outside any Kubernetes pod"), "{msg}");
        assert!(msg.contains("allowed host processes"), "{msg}");
        // Without exemptions all three are reported; with "/" none is.
        assert_eq!(classify(&obs, &Exemptions::default()).unaccounted.len(), 3);
        let all = Exemptions {
            host_cgroups: vec!["/".into()],
            ..Default::default()
        };
        assert_eq!(classify(&obs, &all).allowed_host.len(), 3);
    }

    #[test]
    fn host_cgroup_prefixes_match_whole_segments_only() {
        let e = Exemptions {
            host_cgroups: vec!["/system.slice/dcgm.service".into()],
            ..Default::default()
        };
        assert!(e.allows_host_cgroup("/system.slice/dcgm.service"));
        assert!(e.allows_host_cgroup("/system.slice/dcgm.service/child"));
        assert!(!e.allows_host_cgroup("/system.slice/dcgm.service-evil"));
        assert!(!e.allows_host_cgroup("/system.slice"));
    }

    #[test]
    fn a_shimless_pod_is_accounted_on_its_booked_gpus_only() {
        let obs = Observation {
            processes: vec![
                proc_on(G0, 4242, ProcessKind::Compute),
                proc_on(G1, 4242, ProcessKind::Compute),
            ],
            booked: booked(&[("pod-a", &[G0])]),
            identities: [(4242, in_pod("pod-a", "c1", 7))].into(),
            ..Default::default()
        };
        let e = Exemptions {
            shimless_pods: ["pod-a".to_string()].into(),
            ..Default::default()
        };
        let f = classify(&obs, &e);
        assert_eq!(reasons(&f), vec![(G1, 4242, Reason::NotBooked)]);
        assert_eq!(f.accounted, 1);
    }

    #[test]
    fn a_dra_claims_region_accounts_for_the_pods_that_use_the_claim() {
        let claim_region = ShimRegion {
            owner: RegionOwner::Claim {
                claim_uid: "claim-1".into(),
            },
            ..region("", "", &[G0], &[7])
        };
        let claims: BTreeMap<String, ClaimBooking> = [(
            "claim-1".to_string(),
            ClaimBooking {
                gpus: [G0.to_string()].into(),
                pods: ["pod-a".to_string()].into(),
            },
        )]
        .into();
        let obs = Observation {
            processes: vec![
                proc_on(G0, 4242, ProcessKind::Compute),
                proc_on(G0, 5353, ProcessKind::Compute),
            ],
            regions: vec![claim_region],
            claims,
            identities: [
                (4242, in_pod("pod-a", "c1", 7)),
                // pod-b does not use the claim, whatever PID it has.
                (5353, in_pod("pod-b", "c2", 7)),
            ]
            .into(),
            ..Default::default()
        };
        let f = classify(&obs, &Exemptions::default());
        assert_eq!(reasons(&f), vec![(G0, 5353, Reason::NotBooked)]);
        assert_eq!(f.accounted, 1);
    }

    #[test]
    fn unreadable_identities_are_undetermined_not_guessed() {
        let obs = Observation {
            processes: vec![proc_on(G0, 4242, ProcessKind::Compute)],
            ..Default::default()
        };
        let f = classify(&obs, &Exemptions::default());
        assert!(f.unaccounted.is_empty());
        assert_eq!(
            f.undetermined,
            vec![ProcessOnGpu {
                gpu_uuid: G0.into(),
                pid: 4242
            }]
        );
    }

    #[test]
    fn duplicates_across_lists_are_one_process_with_every_kind() {
        let mut graphics = proc_on(G0, 9, ProcessKind::Graphics);
        graphics.used_bytes = Some(1 << 30);
        let mut mps = proc_on(G0, 9, ProcessKind::Mps);
        mps.used_bytes = None;
        let obs = Observation {
            processes: vec![proc_on(G0, 9, ProcessKind::Compute), graphics, mps],
            identities: [(9, in_pod("pod-x", "c", 9))].into(),
            ..Default::default()
        };
        let f = classify(&obs, &Exemptions::default());
        assert_eq!(f.unaccounted.len(), 1);
        let p = &f.unaccounted[0];
        assert_eq!(p.kinds.len(), 3);
        assert_eq!(p.used_bytes, Some(1 << 30));
    }

    #[test]
    fn pod_summary_names_the_first_processes_and_counts_the_rest() {
        let obs = Observation {
            processes: (1..=5)
                .map(|pid| proc_on(G0, pid, ProcessKind::Compute))
                .collect(),
            identities: (1..=5)
                .map(|pid| (pid, in_pod("pod-x", "c", pid)))
                .collect(),
            ..Default::default()
        };
        let f = classify(&obs, &Exemptions::default());
        let text = f.pod_summary("pod-x").expect("summary");
        assert!(
            text.starts_with(
                "Tessera found 5 GPU processes of this pod outside its GPU booking: process 1 "
            ),
            "{text}"
        );
        assert!(text.ends_with("; and 2 more"), "{text}");
        assert!(f.pod_summary("pod-y").is_none());
        assert_eq!(f.by_pod()["pod-x"].len(), 5);
    }

    fn mib(n: u64) -> Option<u64> {
        Some(n << 20)
    }

    fn booked_mib(entries: &[(&str, &str, u64)]) -> BTreeMap<String, BTreeMap<String, u64>> {
        let mut out: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
        for (pod, gpu, m) in entries {
            out.entry(pod.to_string())
                .or_default()
                .insert(gpu.to_string(), *m);
        }
        out
    }

    /// The bypass the region cannot show: a process the shim tracks (its region lists it, so
    /// [`classify`] accounts it) that allocated 4096 MiB through a second copy of the driver, in
    /// a pod booked 1000 MiB. NVML's count alone reports it, once, on the pod, with both figures.
    #[test]
    fn memory_beyond_the_booking_is_reported_even_for_a_tracked_process() {
        let mut big = proc_on(G0, 4242, ProcessKind::Compute);
        big.used_bytes = mib(4096);
        let mut small = proc_on(G0, 4243, ProcessKind::Compute);
        small.used_bytes = mib(10);
        let obs = Observation {
            processes: vec![big, small],
            regions: vec![region("pod-a", "main", &[G0], &[7, 8])],
            booked: booked(&[("pod-a", &[G0])]),
            booked_mib: booked_mib(&[("pod-a", G0, 1000)]),
            identities: [
                (4242, in_pod("pod-a", "c1", 7)),
                (4243, in_pod("pod-a", "c1", 8)),
            ]
            .into(),
            container_names: [(
                "c1".to_string(),
                ContainerName {
                    pod_uid: "pod-a".into(),
                    name: "main".into(),
                },
            )]
            .into(),
            ..Default::default()
        };
        assert!(
            classify(&obs, &Exemptions::default())
                .unaccounted
                .is_empty()
        );
        let found = over_booked(&obs, &Exemptions::default(), 512);
        assert_eq!(found.len(), 1, "{found:?}");
        let p = &found[0];
        assert_eq!((p.pid, p.pod_uid.as_deref()), (4242, Some("pod-a")));
        assert_eq!(p.reason.code(), "GpuMemoryOverBooking");
        assert_eq!(
            p.reason,
            Reason::OverBooking {
                booked_mib: 1000,
                allowed_mib: 2024,
                processes: 2
            }
        );
        let text = p.message();
        for part in [
            "process 4242 in container \"main\" and 1 other process",
            "use 4106 MiB of GPU GPU-0",
            "the 1000 MiB it was allocated",
            "at most 2024 MiB",
        ] {
            assert!(text.contains(part), "{part:?} not in {text}");
        }
        // Within the allowance, or exempt from the shim: nothing.
        assert!(over_booked(&obs, &Exemptions::default(), 2000).is_empty());
        let shimless = Exemptions {
            shimless_pods: ["pod-a".to_string()].into(),
            ..Default::default()
        };
        assert!(over_booked(&obs, &shimless, 0).is_empty());
    }

    /// Pods are judged per GPU on their own booking there; a GPU the pod was not booked (no
    /// memory booking) is left to [`Reason::NotBooked`]; processes in no pod are not judged.
    #[test]
    fn each_pod_is_judged_on_each_gpu_against_its_own_booking() {
        let with = |gpu: &str, pid: u32, m: u64| {
            let mut p = proc_on(gpu, pid, ProcessKind::Compute);
            p.used_bytes = mib(m);
            p
        };
        let obs = Observation {
            processes: vec![
                with(G0, 10, 900),  // pod-a on G0: 900 of 1000
                with(G1, 11, 3000), // pod-a on G1: not booked there
                with(G0, 20, 600),  // pod-b on G0: 600 of 500
                with(G0, 30, 9000), // a host process
                GpuProcess {
                    used_bytes: None,
                    ..proc_on(G0, 21, ProcessKind::Graphics)
                },
            ],
            booked_mib: booked_mib(&[("pod-a", G0, 1000), ("pod-b", G0, 500)]),
            identities: [
                (10, in_pod("pod-a", "a", 1)),
                (11, in_pod("pod-a", "a", 2)),
                (20, in_pod("pod-b", "b", 1)),
                (21, in_pod("pod-b", "b", 2)),
                (30, on_host("/user.slice")),
            ]
            .into(),
            ..Default::default()
        };
        let found = over_booked(&obs, &Exemptions::default(), 0);
        let got: Vec<_> = found
            .iter()
            .map(|p| {
                (
                    p.pod_uid.as_deref(),
                    p.gpu_uuid.as_str(),
                    p.pid,
                    p.used_bytes,
                )
            })
            .collect();
        assert_eq!(got, [(Some("pod-b"), G0, 20, mib(600))]);
    }

    #[test]
    fn hostile_names_are_escaped_and_cut_in_messages() {
        let cgroup = format!("/evil\n{}", "x".repeat(1000));
        let obs = Observation {
            processes: vec![proc_on(G0, 1, ProcessKind::Compute)],
            identities: [(1, on_host(&cgroup))].into(),
            ..Default::default()
        };
        let msg = classify(&obs, &Exemptions::default()).unaccounted[0].message();
        assert!(!msg.contains('\n'), "{msg}");
        assert!(msg.contains("/evil\\n"), "{msg}");
        assert!(msg.len() < 600, "{}", msg.len());
    }

    #[test]
    fn the_confirmer_reports_what_two_passes_running_saw() {
        let p = |pid, reason| UnaccountedProcess {
            gpu_uuid: G0.into(),
            pid,
            pod_uid: Some("pod-a".into()),
            container_id: None,
            container: None,
            used_bytes: None,
            kinds: BTreeSet::new(),
            reason,
        };
        let mut c = Confirmer::default();
        assert!(c.confirm(&[p(1, Reason::NoShimRegion)]).is_empty());
        // Pass 2: pid 1 still there (confirmed), pid 2 new.
        let second = c.confirm(&[p(1, Reason::NoShimRegion), p(2, Reason::NotBooked)]);
        assert_eq!(second, vec![p(1, Reason::NoShimRegion)]);
        // Pass 3: pid 1 changed reason (a new finding), pid 2 confirmed.
        let third = c.confirm(&[p(1, Reason::NotBooked), p(2, Reason::NotBooked)]);
        assert_eq!(third, vec![p(2, Reason::NotBooked)]);
        // A pass without it forgets it.
        assert!(c.confirm(&[]).is_empty());
        assert!(c.confirm(&[p(2, Reason::NotBooked)]).is_empty());
    }

    #[test]
    fn from_snapshot_takes_the_named_devices_and_live_slots() {
        let mut bytes = vec![0u8; vgpu_region::FILE_SIZE];
        let put = |b: &mut Vec<u8>, at: usize, v: &[u8]| b[at..at + v.len()].copy_from_slice(v);
        put(
            &mut bytes,
            vgpu_region::offset::INITIALIZED_FLAG,
            &vgpu_region::MAGIC.to_ne_bytes(),
        );
        put(
            &mut bytes,
            vgpu_region::offset::MAJOR_VERSION,
            &vgpu_region::MAJOR_VERSION.to_ne_bytes(),
        );
        put(
            &mut bytes,
            vgpu_region::offset::DEVICE_NUM,
            &1u64.to_ne_bytes(),
        );
        put(&mut bytes, vgpu_region::offset::UUIDS, b"GPU-0");
        put(
            &mut bytes,
            vgpu_region::offset::UUIDS + vgpu_region::UUID_LEN,
            b"GPU-1",
        );
        put(
            &mut bytes,
            vgpu_region::offset::PROC_NUM,
            &3i32.to_ne_bytes(),
        );
        let slot = |i| vgpu_region::slot::base(i);
        for (i, (pid, hostpid, status)) in
            [(7, 0, 1), (8, 900, 1), (9, 0, 0)].into_iter().enumerate()
        {
            put(
                &mut bytes,
                slot(i) + vgpu_region::slot::PID,
                &i32::to_ne_bytes(pid),
            );
            put(
                &mut bytes,
                slot(i) + vgpu_region::slot::HOSTPID,
                &i32::to_ne_bytes(hostpid),
            );
            put(
                &mut bytes,
                slot(i) + vgpu_region::slot::STATUS,
                &i32::to_ne_bytes(status),
            );
        }
        let snapshot = RegionSnapshot::parse(&bytes).expect("region");
        let owner = RegionOwner::Container {
            pod_uid: "pod-a".into(),
            container: "main".into(),
        };
        let r = ShimRegion::from_snapshot(owner, &snapshot);
        assert_eq!(r.gpu_uuids, BTreeSet::from(["GPU-0".to_string()]));
        assert_eq!(
            r.slots,
            vec![
                RegionSlot {
                    pid: 7,
                    host_pid: None
                },
                RegionSlot {
                    pid: 8,
                    host_pid: Some(900)
                },
            ]
        );
    }

    // ---- properties ----

    const GPUS: [&str; 3] = ["GPU-a", "GPU-b", "GPU-c"];
    const PODS: [&str; 3] = ["pod-1", "pod-2", "pod-3"];
    const CONTAINERS: [&str; 2] = ["main", "side"];

    fn gpu_set() -> impl Strategy<Value = BTreeSet<String>> {
        proptest::collection::btree_set(0..GPUS.len(), 0..=GPUS.len())
            .prop_map(|s| s.into_iter().map(|i| GPUS[i].to_string()).collect())
    }

    fn process() -> impl Strategy<Value = GpuProcess> {
        (
            0..GPUS.len(),
            1u32..12,
            proptest::option::of(0u64..1 << 34),
            0..3usize,
        )
            .prop_map(|(g, pid, used, k)| GpuProcess {
                gpu_uuid: GPUS[g].into(),
                pid,
                used_bytes: used,
                kinds: [[
                    ProcessKind::Compute,
                    ProcessKind::Graphics,
                    ProcessKind::Mps,
                ][k]]
                .into(),
            })
    }

    fn shim_region() -> impl Strategy<Value = ShimRegion> {
        (
            0..PODS.len(),
            0..CONTAINERS.len(),
            gpu_set(),
            proptest::collection::vec((1u32..12, proptest::option::of(1u32..12)), 0..4),
        )
            .prop_map(|(p, c, gpus, slots)| ShimRegion {
                owner: RegionOwner::Container {
                    pod_uid: PODS[p].into(),
                    container: CONTAINERS[c].into(),
                },
                gpu_uuids: gpus,
                slots: slots
                    .into_iter()
                    .map(|(pid, host_pid)| RegionSlot { pid, host_pid })
                    .collect(),
            })
    }

    fn identity() -> impl Strategy<Value = Option<ProcessIdentity>> {
        prop_oneof![
            1 => Just(None),
            1 => Just(Some(on_host("/system.slice/a.service"))),
            1 => Just(Some(on_host("/user.slice"))),
            5 => (0..PODS.len(), proptest::option::of(1u32..12)).prop_map(|(p, ns)| Some(ProcessIdentity {
                owner: CgroupOwner::Pod(PodCgroup { pod_uid: PODS[p].into(), container_id: Some("c".into()) }),
                ns_pid: ns,
            })),
        ]
    }

    fn observation() -> impl Strategy<Value = Observation> {
        (
            proptest::collection::vec(process(), 0..16),
            proptest::collection::vec(shim_region(), 0..6),
            proptest::collection::vec(gpu_set(), PODS.len()),
            proptest::collection::vec(identity(), 12),
        )
            .prop_map(|(processes, regions, bookings, identities)| Observation {
                processes,
                regions,
                booked: PODS
                    .iter()
                    .zip(bookings)
                    .filter(|(_, gpus)| !gpus.is_empty())
                    .map(|(p, gpus)| (p.to_string(), gpus))
                    .collect(),
                identities: identities
                    .into_iter()
                    .enumerate()
                    .filter_map(|(i, id)| Some((u32::try_from(i).ok()? + 1, id?)))
                    .collect(),
                ..Default::default()
            })
    }

    fn exemptions() -> impl Strategy<Value = Exemptions> {
        (any::<bool>(), proptest::option::of(0..PODS.len())).prop_map(|(allow, shimless)| {
            Exemptions {
                host_cgroups: if allow {
                    vec!["/system.slice".into()]
                } else {
                    vec![]
                },
                shimless_pods: shimless.map(|p| PODS[p].to_string()).into_iter().collect(),
            }
        })
    }

    proptest! {
        /// Over-booking is exactly "the pod's NVML total on a GPU exceeds its booking there plus
        /// the allowance per process": never below, always above, whatever the regions say.
        #[test]
        fn over_booking_is_reported_exactly_above_the_booking_and_allowance(
            obs in observation(),
            booking in proptest::collection::vec(0u64..4096, PODS.len()),
            allowance in 0u64..1024,
        ) {
            let mut obs = obs;
            obs.booked_mib = PODS
                .iter()
                .zip(&booking)
                .filter_map(|(p, m)| Some((p.to_string(), [(obs.booked.get(*p)?.first()?.clone(), *m)].into())))
                .collect();
            let found = over_booked(&obs, &Exemptions::default(), allowance);
            let mut expected = BTreeSet::new();
            for (uid, gpus) in &obs.booked_mib {
                for (gpu, m) in gpus {
                    let mine: BTreeMap<u32, u64> = obs
                        .processes
                        .iter()
                        .filter(|p| &p.gpu_uuid == gpu && pod_of(p.pid, &obs).is_some_and(|c| &c.pod_uid == uid))
                        .fold(BTreeMap::new(), |mut acc, p| {
                            let e = acc.entry(p.pid).or_insert(0);
                            *e = (*e).max(p.used_bytes.unwrap_or(0));
                            acc
                        });
                    let total: u64 = mine.values().sum();
                    let n = mine.len() as u64;
                    if n > 0 && total > (m + allowance * n) << 20 {
                        expected.insert((uid.clone(), gpu.clone()));
                    }
                }
            }
            let got: BTreeSet<(String, String)> = found
                .iter()
                .map(|p| (p.pod_uid.clone().unwrap_or_default(), p.gpu_uuid.clone()))
                .collect();
            prop_assert_eq!(got, expected);
        }

        /// A process of pod U on GPU G, U booked on G, listed (host PID or namespace PID) in a
        /// live slot of a region of U's that names G, is never reported.
        #[test]
        fn a_listed_process_of_a_booked_pod_is_never_reported(obs in observation(), e in exemptions()) {
            let f = classify(&obs, &e);
            for p in &obs.processes {
                let Some(ProcessIdentity { owner: CgroupOwner::Pod(pod), ns_pid }) = obs.identities.get(&p.pid) else {
                    continue;
                };
                let booked = obs.booked.get(&pod.pod_uid).is_some_and(|g| g.contains(&p.gpu_uuid));
                let listed = obs.regions.iter().any(|r| {
                    matches!(&r.owner, RegionOwner::Container { pod_uid, .. } if *pod_uid == pod.pod_uid)
                        && r.gpu_uuids.contains(&p.gpu_uuid)
                        && r.slots.iter().any(|s| s.host_pid == Some(p.pid) || s.pid == ns_pid.unwrap_or(p.pid))
                });
                if booked && listed {
                    prop_assert!(
                        !f.unaccounted.iter().any(|u| u.gpu_uuid == p.gpu_uuid && u.pid == p.pid),
                        "{p:?} reported: {f:?}"
                    );
                }
            }
        }

        /// Every finding is a (GPU, PID) NVML listed, with the pod its cgroup names; every pair
        /// NVML listed is in exactly one outcome.
        #[test]
        fn findings_come_from_nvml_and_partition_it(obs in observation(), e in exemptions()) {
            let f = classify(&obs, &e);
            let listed: BTreeSet<(String, u32)> =
                obs.processes.iter().map(|p| (p.gpu_uuid.clone(), p.pid)).collect();
            for u in &f.unaccounted {
                prop_assert!(listed.contains(&(u.gpu_uuid.clone(), u.pid)));
                let pod = match obs.identities.get(&u.pid).map(|i| &i.owner) {
                    Some(CgroupOwner::Pod(p)) => Some(p.pod_uid.clone()),
                    _ => None,
                };
                prop_assert_eq!(&u.pod_uid, &pod);
                prop_assert_eq!(matches!(u.reason, Reason::NotInAPod { .. }), pod.is_none());
                prop_assert!(!u.message().is_empty());
            }
            for a in f.allowed_host.iter().chain(&f.undetermined) {
                prop_assert!(listed.contains(&(a.gpu_uuid.clone(), a.pid)));
            }
            prop_assert_eq!(
                f.accounted + f.unaccounted.len() + f.allowed_host.len() + f.undetermined.len(),
                listed.len()
            );
        }

        /// Sorted by (GPU, PID), one finding per pair, and the same whatever the input order or
        /// repetition.
        #[test]
        fn findings_are_deterministic(obs in observation(), e in exemptions()) {
            let f = classify(&obs, &e);
            let keys: Vec<(&str, u32)> = f.unaccounted.iter().map(|u| (u.gpu_uuid.as_str(), u.pid)).collect();
            prop_assert!(keys.windows(2).all(|w| w[0] < w[1]), "{keys:?}");
            prop_assert!(f.allowed_host.windows(2).all(|w| w[0] < w[1]));
            prop_assert!(f.undetermined.windows(2).all(|w| w[0] < w[1]));
            let mut shuffled = obs.clone();
            shuffled.processes.reverse();
            shuffled.processes.extend(obs.processes.iter().cloned());
            shuffled.regions.reverse();
            prop_assert_eq!(classify(&shuffled, &e), f);
        }
    }
}

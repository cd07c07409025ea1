//! What a node and a namespace have left: a node's GPUs with their bookings, which of them are
//! NVIDIA cards, and the namespace's quota budget.

use std::collections::{HashMap, HashSet};

use hami_contract::mig::{MigAllocation, MigPlacement, MigProfile};

/// The operating mode of a GPU whose instances the scheduler places (HAMi's `MigMode`).
pub const MIG_MODE: &str = "mig";

/// What a GPU in `mig` mode adds to its state (contract §6.4): the profiles its device plugin
/// registered and the instances in use (placed pods' `hami.io/vgpu-mig-allocations`, in-flight
/// reservations, and the earlier containers of the pod being fitted).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MigGpu {
    /// As registered (`migProfiles`), in registration order.
    pub profiles: Vec<MigProfile>,
    /// HAMi's `MigAllocationsInUse`: profile, placement and, once the device plugin realized it,
    /// the instance's identity (container and device indices are not meaningful here).
    pub in_use: Vec<MigAllocation>,
}

impl MigGpu {
    /// The placements in use (`occupiedMigPlacements`).
    pub fn occupied(&self) -> impl Iterator<Item = MigPlacement> + '_ {
        self.in_use.iter().map(|a| a.placement)
    }

    /// `selectMigCandidate` (HAMi `pkg/device/nvidia/device.go`): of the profiles with at least
    /// `memory` MiB, by memory then slice count (stable), the first that has a placement
    /// overlapping none of `occupied`; its placement is chosen by [`select_placement`].
    pub fn select(
        &self,
        occupied: &[MigPlacement],
        memory: u32,
    ) -> Option<(&MigProfile, MigPlacement)> {
        let mut candidates: Vec<&MigProfile> = self.profiles.iter().collect();
        candidates.sort_by_key(|p| (p.memory_mb, p.slice_count));
        candidates
            .into_iter()
            .filter(|p| p.memory_mb >= memory)
            .find_map(|p| select_placement(&self.profiles, occupied, &p.name).map(|pl| (p, pl)))
    }

    /// Per registered profile, the placements free now, in the order HAMi tries them: what
    /// `simulate` shows when a MIG GPU refuses a pod.
    pub fn free_placements(&self) -> Vec<(&MigProfile, Vec<MigPlacement>)> {
        let occupied: Vec<MigPlacement> = self.occupied().collect();
        self.profiles
            .iter()
            .map(|p| (p, free_in_order(p, &occupied)))
            .collect()
    }

    /// The largest profile memory that [`Self::select`] could give now (`None`: no profile has a
    /// free placement): a request fits iff its memory is at most this.
    pub fn max_free_memory(&self) -> Option<u32> {
        let occupied: Vec<MigPlacement> = self.occupied().collect();
        self.profiles
            .iter()
            .filter(|p| select_placement(&self.profiles, &occupied, &p.name).is_some())
            .map(|p| p.memory_mb)
            .max()
    }
}

/// Whether a profile's placements are tried from the highest start (`preferHighMigPlacement`,
/// HAMi `mig_topology.go`: `1g.` and `3g.` profiles, which keeps the low slices free for the
/// larger profiles that can only start there).
pub fn prefers_high_placement(profile: &str) -> bool {
    profile.starts_with("1g.") || profile.starts_with("3g.")
}

/// `selectMigPlacement` (HAMi `mig_topology.go`): the first placement of the profile named
/// `name` (the first profile of that name), in `orderedMigPlacements` order, that overlaps
/// nothing in `occupied`. A placement of size 0 is never chosen (Tessera: HAMi would hand it
/// out, and it would occupy nothing).
pub fn select_placement(
    profiles: &[MigProfile],
    occupied: &[MigPlacement],
    name: &str,
) -> Option<MigPlacement> {
    let profile = profiles.iter().find(|p| p.name == name)?;
    free_in_order(profile, occupied).into_iter().next()
}

/// The placements of `profile` that overlap nothing in `occupied` (size 0 never counts), in
/// `orderedMigPlacements` order: `1g.`/`3g.` profiles from the highest start, others from the
/// lowest; a stable sort, so of equal starts the first listed.
fn free_in_order(profile: &MigProfile, occupied: &[MigPlacement]) -> Vec<MigPlacement> {
    let mut free: Vec<MigPlacement> = profile
        .placements
        .iter()
        .filter(|c| c.size > 0 && !occupied.iter().any(|o| c.overlaps(o)))
        .copied()
        .collect();
    if prefers_high_placement(&profile.name) {
        free.sort_by_key(|c| std::cmp::Reverse(c.start));
    } else {
        free.sort_by_key(|c| c.start);
    }
    free
}

/// One registered GPU with its current booking.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuState {
    pub uuid: String,
    pub index: u32,
    /// Replicas (how many containers may share the card).
    pub count: u32,
    pub totalmem: u32,
    pub totalcore: u32,
    /// Model type as registered, e.g. `NVIDIA-Tesla T4`.
    pub device_type: String,
    pub numa: u32,
    pub mode: String,
    pub health: bool,
    pub used: u32,
    pub usedmem: u32,
    pub usedcores: u32,
    /// Set for a GPU in `mig` mode ([`MIG_MODE`]), else `None`.
    pub mig: Option<Box<MigGpu>>,
}

impl GpuState {
    /// A registered device with no usage yet.
    pub fn from_registered(d: &hami_contract::NodeDevice) -> Self {
        GpuState {
            uuid: d.id.clone(),
            index: d.index,
            count: d.count,
            totalmem: d.devmem,
            totalcore: d.devcore,
            device_type: d.device_type.clone(),
            numa: d.numa,
            mode: d.mode.clone(),
            health: d.health,
            used: 0,
            usedmem: 0,
            usedcores: 0,
            mig: (d.mode == MIG_MODE).then(|| {
                Box::new(MigGpu {
                    // An undecodable list offers nothing: every request is then refused with
                    // `CardMigTopologyInfeasible`.
                    profiles: hami_contract::mig::decode_profiles(&d.mig_profiles)
                        .unwrap_or_default(),
                    in_use: Vec::new(),
                })
            }),
        }
    }

    /// Books one MIG instance on this GPU (the MIG half of `AddResourceUsage`); ignored on a GPU
    /// not in `mig` mode.
    pub fn book_mig(&mut self, a: MigAllocation) {
        if let Some(m) = self.mig.as_deref_mut() {
            m.in_use.push(a);
        }
    }

    /// Books one container's share (`AddResourceUsage`).
    pub fn book(&mut self, mem: u32, cores: u32) {
        self.used = self.used.saturating_add(1);
        self.usedmem = self.usedmem.saturating_add(mem);
        self.usedcores = self.usedcores.saturating_add(cores);
    }

    /// Books a collapsed pod usage entry (contract §5.1: `Used += max(Slots, 1)`).
    pub fn book_usage(&mut self, slots: u32, mem: u32, cores: u32) {
        self.used = self.used.saturating_add(slots.max(1));
        self.usedmem = self.usedmem.saturating_add(mem);
        self.usedcores = self.usedcores.saturating_add(cores);
    }

    /// Takes a collapsed pod usage entry off again (what evicting the pod frees).
    pub fn unbook_usage(&mut self, slots: u32, mem: u32, cores: u32) {
        self.used = self.used.saturating_sub(slots.max(1));
        self.usedmem = self.usedmem.saturating_sub(mem);
        self.usedcores = self.usedcores.saturating_sub(cores);
    }
}

/// Pairwise GPU topology scores from `hami.io/node-nvidia-score` (contract §2.2).
pub type TopologyScores = HashMap<String, HashMap<String, i64>>;

/// A candidate node: its GPUs with usage, and the node-level inputs of Fit.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeState {
    pub name: String,
    pub gpus: Vec<GpuState>,
    /// UUIDs from `hami.io/device-cordon`.
    pub cordoned: HashSet<String>,
    pub topology: Option<TopologyScores>,
}

impl NodeState {
    /// [`GpuState::book_usage`] on the GPU `uuid`; nothing when the node has no such GPU.
    pub fn book_usage(&mut self, uuid: &str, slots: u32, mem: u32, cores: u32) {
        if let Some(g) = self.gpus.iter_mut().find(|g| g.uuid == uuid) {
            g.book_usage(slots, mem, cores);
        }
    }

    /// [`GpuState::unbook_usage`] on the GPU `uuid`; nothing when the node has no such GPU.
    pub fn unbook_usage(&mut self, uuid: &str, slots: u32, mem: u32, cores: u32) {
        if let Some(g) = self.gpus.iter_mut().find(|g| g.uuid == uuid) {
            g.unbook_usage(slots, mem, cores);
        }
    }
}

/// `node` as it would be with no pod on any of its GPUs: the same cards, health, cordons and
/// topology, no usage. What the pod could have if every pod there were evicted.
pub fn emptied(node: &NodeState) -> NodeState {
    let mut empty = node.clone();
    for g in &mut empty.gpus {
        g.used = 0;
        g.usedmem = 0;
        g.usedcores = 0;
    }
    empty
}

/// The namespace's GPU budget (contract §5.7): limits are the minimum over all ResourceQuota objects of the
/// namespace, memory already multiplied by `memoryFactor`; `used_*` include in-flight
/// reservations.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QuotaBudget {
    pub mem_limit: Option<u64>,
    pub cores_limit: Option<u64>,
    pub count_limit: Option<u64>,
    pub used_mem: u64,
    pub used_cores: u64,
    pub used_count: u64,
}

/// Extra charge on top of `QuotaBudget::used_*` while one pod is being fitted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Charge {
    pub mem: u64,
    pub cores: u64,
    pub count: u64,
}

impl Charge {
    /// The charge with one more device of `mem` MiB and `cores` percent.
    pub(super) fn add(self, mem: u32, cores: u32) -> Charge {
        Charge {
            mem: self.mem + u64::from(mem),
            cores: self.cores + u64::from(cores),
            count: self.count + 1,
        }
    }
}

impl std::ops::AddAssign for Charge {
    fn add_assign(&mut self, c: Charge) {
        self.mem = self.mem.saturating_add(c.mem);
        self.cores = self.cores.saturating_add(c.cores);
        self.count = self.count.saturating_add(c.count);
    }
}

impl std::ops::SubAssign for Charge {
    fn sub_assign(&mut self, c: Charge) {
        self.mem = self.mem.saturating_sub(c.mem);
        self.cores = self.cores.saturating_sub(c.cores);
        self.count = self.count.saturating_sub(c.count);
    }
}

impl QuotaBudget {
    /// True when no quota object limits the namespace.
    pub fn is_unlimited(&self) -> bool {
        self.mem_limit.is_none() && self.cores_limit.is_none() && self.count_limit.is_none()
    }

    /// Whether `extra` more fits under every limit (a limit of 0 blocks any GPU use).
    pub fn allows(&self, extra: Charge) -> bool {
        let within = |limit: Option<u64>, used: u64, add: u64| match limit {
            None => true,
            Some(l) => used.saturating_add(add) <= l,
        };
        within(self.mem_limit, self.used_mem, extra.mem)
            && within(self.cores_limit, self.used_cores, extra.cores)
            && within(self.count_limit, self.used_count, extra.count)
    }

    /// The budget with `freed` no longer charged (a pod of the namespace evicted).
    pub fn give_back(&mut self, freed: Charge) {
        self.used_mem = self.used_mem.saturating_sub(freed.mem);
        self.used_cores = self.used_cores.saturating_sub(freed.cores);
        self.used_count = self.used_count.saturating_sub(freed.count);
    }
}

/// Whether a device `type` names an NVIDIA card (case-insensitive substring, as HAMi). Real
/// types start with `NVIDIA`, so that is checked first.
pub fn is_nvidia(device_type: &str) -> bool {
    const NEEDLE: &str = "nvidia";
    device_type
        .get(..NEEDLE.len())
        .is_some_and(|p| p.eq_ignore_ascii_case(NEEDLE))
        || contains_ignore_ascii_case(device_type, NEEDLE)
}

/// Which of a node's GPUs are NVIDIA devices ([`is_nvidia`] of each `type`), for callers that
/// keep it with the node so the filter does not read every type string on every request.
pub fn nvidia_mask(gpus: &[GpuState]) -> Vec<bool> {
    gpus.iter().map(|g| is_nvidia(&g.device_type)).collect()
}

fn contains_ignore_ascii_case(haystack: &str, needle: &str) -> bool {
    haystack
        .as_bytes()
        .windows(needle.len())
        .any(|w| w.eq_ignore_ascii_case(needle.as_bytes()))
}

/// Applies a placed pod's devices to a node's usage (the reservation overlay), collapsing init
/// and app containers like HAMi's accounting does.
pub fn book_pod(node: &mut NodeState, usage: &[hami_contract::usage::DeviceUsage]) {
    for u in usage {
        if let Some(g) = node.gpus.iter_mut().find(|g| g.uuid == u.uuid) {
            g.book_usage(u.slots, u.mem, u.cores);
        }
    }
}

/// The MIG half of HAMi's occupancy rebuild for one placed pod (`getNodesUsage`,
/// `pkg/scheduler/scheduler.go`), on a node whose usage `book_pod` already applied.
/// `used` are the GPUs the pod's collapsed usage names (one entry per GPU), `allocations` its
/// decoded `hami.io/vgpu-mig-allocations`. Per GPU the pod uses: a reservation there on a
/// `hami-core` GPU marks the GPU unhealthy; else the GPU's first reservation is taken into
/// use; with none, a `mig` GPU is marked unhealthy (its instance is somewhere unknown). The
/// reservations left over are all taken into use on a `mig` GPU and mark any other GPU
/// unhealthy. Tessera ignores reservations naming a GPU the node does not register, where
/// HAMi marks every `mig` GPU of the node unhealthy (deviation G2).
pub fn book_pod_mig<'a>(
    node: &mut NodeState,
    used: impl IntoIterator<Item = &'a str>,
    allocations: &[MigAllocation],
) {
    let mut by_gpu: Vec<(&str, std::collections::VecDeque<&MigAllocation>)> = Vec::new();
    for a in allocations {
        match by_gpu.iter_mut().find(|(u, _)| *u == a.gpu_uuid) {
            Some((_, l)) => l.push_back(a),
            None => by_gpu.push((&a.gpu_uuid, std::iter::once(a).collect())),
        }
    }
    for uuid in used {
        let Some(g) = node.gpus.iter_mut().find(|g| g.uuid == uuid) else {
            continue;
        };
        let list = by_gpu.iter_mut().find(|(u, _)| *u == uuid).map(|(_, l)| l);
        match list {
            Some(l) if !l.is_empty() => {
                if g.mode == "hami-core" {
                    g.health = false;
                    continue;
                }
                if let Some(a) = l.pop_front() {
                    g.book_mig(a.clone());
                }
            }
            _ => {
                if g.mode == MIG_MODE {
                    g.health = false;
                }
            }
        }
    }
    for (uuid, rest) in by_gpu {
        if rest.is_empty() {
            continue;
        }
        if let Some(g) = node.gpus.iter_mut().find(|g| g.uuid == uuid) {
            if g.mode != MIG_MODE {
                g.health = false;
                continue;
            }
            for a in rest {
                g.book_mig(a.clone());
            }
        }
    }
}

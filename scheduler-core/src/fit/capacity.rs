//! What a node and a namespace have left: a node's GPUs with their bookings, which of them are
//! NVIDIA cards, and the namespace's quota budget.

use std::collections::{HashMap, HashSet};

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

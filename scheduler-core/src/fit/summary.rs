//! A node's GPUs reduced to what Fit's per-device checks read, kept by the cluster state with
//! each node's usage, so that the filter can answer the common request (one container asking
//! for one GPU, no device selectors, no NUMA binding, no topology policy) on a node without the
//! full evaluation, and with the same answer: fits, or the same reason string.
//!
//! The full evaluation ([`super::evaluate_picks`]) stays the reference: a [`QuickAsk`] exists
//! only for requests whose outcome depends on nothing but the numbers kept here, and the
//! capacity checks are one function ([`check_load`]) that both paths call. The device a fitting
//! node would give is not computed here: the filter evaluates fully the node it chooses.

use super::capacity::{Charge, GpuState, NodeState, QuotaBudget};
use super::input::{GpuPolicyKey, GpuRequest, PlacementOptions, PodAsk};
use super::reason::{FitFailure, FitReason, ReasonCounts};
use super::score::node_score;

/// The numbers of one GPU that Fit's capacity checks read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Load {
    pub(super) count: u32,
    pub(super) used: u32,
    pub(super) totalmem: u32,
    pub(super) usedmem: u32,
    pub(super) totalcore: u32,
    pub(super) usedcores: u32,
}

impl Load {
    pub(super) fn of(g: &GpuState) -> Load {
        Load {
            count: g.count,
            used: g.used,
            totalmem: g.totalmem,
            usedmem: g.usedmem,
            totalcore: g.totalcore,
            usedcores: g.usedcores,
        }
    }
}

/// NVIDIA `Fit`'s capacity checks of one device, in HAMi's order: what comes after the UUID
/// selectors and before the MIG rule. `extra` is the quota charge of everything picked before
/// this device; `coresreq` is already clamped to 100. Returns the memory the device would book.
pub(super) fn check_load(
    g: &Load,
    req: &GpuRequest,
    mutex: bool,
    quota: Option<&QuotaBudget>,
    extra: Charge,
    coresreq: u32,
) -> Result<u32, FitReason> {
    if g.count <= g.used {
        return Err(FitReason::CardTimeSlicingExhausted);
    }
    if mutex && g.used > 0 {
        return Err(FitReason::ExclusiveDeviceAllocateConflict);
    }
    let memreq = req.memory_on(g.totalmem);
    if let Some(q) = quota
        && !q.allows(extra.add(memreq, coresreq))
    {
        return Err(FitReason::ResourceQuotaNotFit);
    }
    if i64::from(g.totalmem) - i64::from(g.usedmem) < i64::from(memreq) {
        return Err(FitReason::CardInsufficientMemory);
    }
    if i64::from(g.totalcore) - i64::from(g.usedcores) < i64::from(coresreq) {
        return Err(FitReason::CardInsufficientCore);
    }
    if g.totalcore == 100 && coresreq == 100 && g.used > 0 {
        return Err(FitReason::ExclusiveDeviceAllocateConflict);
    }
    if g.totalcore != 0 && g.usedcores == g.totalcore && coresreq == 0 {
        return Err(FitReason::CardComputeUnitsExhausted);
    }
    Ok(memreq)
}

const NVIDIA: u8 = 1;
const UNHEALTHY: u8 = 2;
const CORDONED: u8 = 4;
const MIG: u8 = 8;

/// One GPU as the quick check reads it: its load and the request-independent facts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct HotGpu {
    load: Load,
    flags: u8,
}

/// GPUs per node kept inline in a [`NodeSummary`] (more go to the heap).
const INLINE_GPUS: usize = 8;

/// A node's GPUs for the quick check: inline for the usual node, so that the check reads one
/// place in memory per node (the size difference is the point).
#[derive(Debug, Clone, PartialEq)]
#[allow(clippy::large_enum_variant)]
enum HotGpus {
    Inline(u8, [HotGpu; INLINE_GPUS]),
    Heap(Box<[HotGpu]>),
}

impl HotGpus {
    fn as_slice(&self) -> &[HotGpu] {
        match self {
            HotGpus::Inline(n, gpus) => &gpus[..usize::from(*n)],
            HotGpus::Heap(gpus) => gpus,
        }
    }
}

/// Everything the quick check reads of one node, kept with the node's usage. The fields a
/// fitting node is decided by (score, no fixed reason, the first GPUs) come first, so that
/// such a node is usually decided from one cache line.
#[derive(Debug, Clone, PartialEq)]
#[repr(C)]
pub struct NodeSummary {
    /// [`node_score`] of the node's GPUs (it depends on the existing usage only).
    pub score: f32,
    /// The reason every request a [`QuickAsk`] stands for gets on this node, when that does not
    /// depend on the request: each NVIDIA GPU is unhealthy, cordoned or has no free slot (all
    /// checked before anything the request changes), or the node has none. The node is then
    /// rejected in O(1), with the reason the full evaluation gives; and, for a node with GPUs
    /// in `mig` mode, what their MIG check reads. (Boxed: one word here, `None` for the usual
    /// node.)
    cold: Option<Box<Cold>>,
    gpus: HotGpus,
}

/// The rarely set part of a [`NodeSummary`].
#[derive(Debug, Clone, PartialEq)]
struct Cold {
    /// See [`NodeSummary::cold`].
    fixed: Option<FitFailure>,
    /// Per GPU (in node order), for a `mig` GPU: the largest profile memory with a free
    /// placement ([`super::capacity::MigGpu::max_free_memory`]). A request passes the GPU's
    /// `CustomFilterRule` iff its memory is at most that, so the summary answers it exactly.
    mig_max: Box<[Option<u32>]>,
}

impl Default for NodeSummary {
    /// A node with no GPU.
    fn default() -> Self {
        NodeSummary {
            score: 0.0,
            gpus: HotGpus::Inline(0, [HotGpu::default(); INLINE_GPUS]),
            cold: Some(Box::new(Cold {
                fixed: Some(FitFailure::NodeInsufficientDevice),
                mig_max: Box::default(),
            })),
        }
    }
}

impl NodeSummary {
    /// The summary of `node` as it is now; `nvidia` is its [`nvidia_mask`](super::nvidia_mask).
    pub fn new(node: &NodeState, nvidia: &[bool]) -> Self {
        let hot = node.gpus.iter().enumerate().map(|(i, g)| {
            let mut flags = 0;
            if nvidia
                .get(i)
                .copied()
                .unwrap_or_else(|| super::is_nvidia(&g.device_type))
            {
                flags |= NVIDIA;
            }
            if !g.health {
                flags |= UNHEALTHY;
            }
            if node.cordoned.contains(&g.uuid) {
                flags |= CORDONED;
            }
            if g.mig.is_some() {
                flags |= MIG;
            }
            HotGpu {
                load: Load::of(g),
                flags,
            }
        });
        let gpus = match u8::try_from(node.gpus.len()) {
            Ok(n) if usize::from(n) <= INLINE_GPUS => {
                let mut inline = [HotGpu::default(); INLINE_GPUS];
                for (slot, g) in inline.iter_mut().zip(hot) {
                    *slot = g;
                }
                HotGpus::Inline(n, inline)
            }
            _ => HotGpus::Heap(hot.collect()),
        };
        let mut counts = ReasonCounts::default();
        let mut selected = 0usize;
        let mut fixed = true;
        for g in gpus.as_slice().iter().filter(|g| g.flags & NVIDIA != 0) {
            selected += 1;
            match fixed_reason(g) {
                Some(r) => counts.bump(r),
                None => {
                    fixed = false;
                    break;
                }
            }
        }
        let fixed = fixed.then(|| {
            if selected == 0 {
                FitFailure::NodeInsufficientDevice
            } else {
                FitFailure::Devices(counts.with_total(selected))
            }
        });
        let any_mig = node.gpus.iter().any(|g| g.mig.is_some());
        let cold = (fixed.is_some() || any_mig).then(|| {
            Box::new(Cold {
                fixed,
                mig_max: if any_mig {
                    node.gpus
                        .iter()
                        .map(|g| g.mig.as_deref().and_then(|m| m.max_free_memory()))
                        .collect()
                } else {
                    Box::default()
                },
            })
        });
        NodeSummary {
            score: node_score(&node.gpus),
            gpus,
            cold,
        }
    }
}

/// The reason a GPU fails every quick request for, before any check the request changes.
fn fixed_reason(g: &HotGpu) -> Option<FitReason> {
    if g.flags & UNHEALTHY != 0 {
        Some(FitReason::CardNotHealth)
    } else if g.flags & CORDONED != 0 {
        Some(FitReason::CardCordoned)
    } else if g.load.count <= g.load.used {
        Some(FitReason::CardTimeSlicingExhausted)
    } else {
        None
    }
}

/// A request the quick check answers exactly: the pod's only GPU container (no init container
/// asks for one) wants one device, with no UUID, type or mode selector, no NUMA binding and no
/// topology-aware policy. Fit then takes the single-device path (`ContainerFit::one_device`),
/// whose outcome depends on nothing but each device's load and flags.
#[derive(Debug, Clone)]
pub struct QuickAsk {
    req: GpuRequest,
    mutex: bool,
    coresreq: u32,
}

impl QuickAsk {
    /// `None` when the request needs the full evaluation.
    pub fn new(ask: &PodAsk, opts: &PlacementOptions) -> Option<QuickAsk> {
        if ask.init.iter().any(Option::is_some) {
            return None;
        }
        let mut gpu = ask.app.iter().flatten();
        let req = gpu.next()?;
        let s = &opts.selectors;
        let plain = gpu.next().is_none()
            && req.nums == 1
            && !s.numa_bind
            && !opts.has(GpuPolicyKey::TopologyAware)
            && s.use_uuid.is_empty()
            && s.nouse_uuid.is_empty()
            && s.use_type.is_empty()
            && s.nouse_type.is_empty()
            && s.vgpu_mode.is_none();
        plain.then(|| QuickAsk {
            req: req.clone(),
            mutex: opts.has(GpuPolicyKey::Mutex),
            coresreq: req.coresreq.min(100),
        })
    }

    /// What the full evaluation of the request on the summarised node answers, but for the
    /// device: `Ok` when it fits, else why not.
    pub fn check(&self, node: &NodeSummary, quota: Option<&QuotaBudget>) -> Result<(), FitFailure> {
        let mut mig_max: &[Option<u32>] = &[];
        if let Some(c) = &node.cold {
            if let Some(r) = &c.fixed {
                return Err(r.clone());
            }
            mig_max = &c.mig_max;
        }
        let mut counts = ReasonCounts::default();
        let mut selected = 0usize;
        for (i, g) in node.gpus.as_slice().iter().enumerate() {
            if g.flags & NVIDIA == 0 {
                continue;
            }
            selected += 1;
            let r = match fixed_reason(g) {
                Some(r) => r,
                None => match check_load(
                    &g.load,
                    &self.req,
                    self.mutex,
                    quota,
                    Charge::default(),
                    self.coresreq,
                ) {
                    Err(r) => r,
                    // HAMi: `CustomFilterRule` of a `mig` GPU (pkg/device/nvidia/device.go).
                    Ok(memreq) if g.flags & MIG != 0 => match mig_max.get(i).copied().flatten() {
                        Some(max) if max >= memreq => return Ok(()),
                        _ => FitReason::CardMigTopologyInfeasible,
                    },
                    Ok(_) => return Ok(()),
                },
            };
            counts.bump(r);
        }
        if selected == 0 {
            return Err(FitFailure::NodeInsufficientDevice);
        }
        Err(FitFailure::Devices(counts.with_total(selected)))
    }
}

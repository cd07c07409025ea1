//! One container's request onto one node's NVIDIA devices (`fitInDevices` + NVIDIA `Fit`), every
//! check and reason in HAMi's order (contract §5.3).

use hami_contract::mig::MigPlacement;

use super::capacity::{Charge, GpuState, MIG_MODE, NodeState, QuotaBudget, is_nvidia};
use super::input::{GpuPolicyKey, GpuRequest, PlacementOptions};
use super::reason::{FitFailure, FitReason, ReasonCounts};
use super::score::{DeviceScorer, compare_gpus, sort_keys, sort_order};
use super::summary::{Load, check_load};
use super::topology::pick_by_topology;

/// GPUs per node handled without a heap allocation in [`ContainerFit::picks`].
const STACK_GPUS: usize = 16;

/// One accepted device for one container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pick {
    /// Position in [`NodeState::gpus`].
    pub gpu: usize,
    /// While fitting, the request's memory and cores (what HAMi's `Fit` records); once the pod
    /// is placed on a `mig` GPU ([`super::node::evaluate_picks`]), the chosen profile's memory and
    /// core (`AddResourceUsage`), which is what the device annotations carry.
    pub mem: u32,
    pub cores: u32,
    /// On a GPU in `mig` mode: the profile and placement of the instance.
    pub mig: Option<MigPick>,
}

/// The MIG instance a [`Pick`] on a `mig` GPU reserves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigPick {
    pub profile: String,
    pub placement: MigPlacement,
}

/// One container's request against one node: what every step of fitting it reads.
#[derive(Debug, Clone, Copy)]
pub struct ContainerFit<'a> {
    pub node: &'a NodeState,
    /// The node's GPUs with the usage to fit against: `node.gpus`, or a copy on which the pod's
    /// earlier app containers are booked.
    pub gpus: &'a [GpuState],
    pub req: &'a GpuRequest,
    pub opts: &'a PlacementOptions,
    pub quota: Option<&'a QuotaBudget>,
    /// Quota charge of the pod's containers fitted before this one.
    pub charged: Charge,
    /// The node's [`nvidia_mask`](super::nvidia_mask) when the caller keeps one (it must match
    /// `gpus`), so that the type strings are not read again; `None`: read them.
    pub nvidia: Option<&'a [bool]>,
}

impl ContainerFit<'_> {
    /// Fits the request onto the node's NVIDIA devices. On failure returns why not (HAMi's
    /// reason string as `Display`).
    pub fn picks(&self) -> Result<Vec<Pick>, FitFailure> {
        if self.req.nums == 1
            && !self.opts.selectors.numa_bind
            && !self.opts.has(GpuPolicyKey::TopologyAware)
        {
            return self.one_device();
        }
        self.sorted()
    }

    /// [`is_nvidia`] of GPU `i`, from the precomputed mask when there is one.
    fn is_nvidia_at(&self, i: usize, g: &GpuState) -> bool {
        match self.nvidia.and_then(|m| m.get(i)) {
            Some(b) => *b,
            None => is_nvidia(&g.device_type),
        }
    }

    /// Whether the pod restricts device types: `type_allowed` allocates, and without type
    /// selectors it is always true.
    fn has_type_selectors(&self) -> bool {
        !(self.opts.selectors.use_type.is_empty() && self.opts.selectors.nouse_type.is_empty())
    }

    /// The per-device checks of NVIDIA `Fit` that come before the NUMA grouping, in HAMi's order.
    fn check_device_first(&self, g: &GpuState, type_selectors: bool) -> Result<(), FitReason> {
        let opts = self.opts;
        if !g.health {
            return Err(FitReason::CardNotHealth);
        }
        if self.node.cordoned.contains(&g.uuid) {
            return Err(FitReason::CardCordoned);
        }
        if !((!type_selectors || opts.selectors.type_allowed(&g.device_type))
            && (opts.selectors.vgpu_mode.is_none() || opts.selectors.mode_allowed(&g.mode)))
        {
            return Err(FitReason::CardTypeMismatch);
        }
        Ok(())
    }

    /// The per-device checks after the NUMA grouping, in HAMi's order; `extra` is the quota
    /// charge of everything picked before this device.
    fn check_device_rest(
        &self,
        g: &GpuState,
        i: usize,
        mutex: bool,
        extra: Charge,
        coresreq: u32,
        earlier: &[Pick],
    ) -> Result<Pick, FitReason> {
        let opts = self.opts;
        // Without UUID selectors every card is allowed (skips a call per device).
        let uuid_selectors =
            !(opts.selectors.use_uuid.is_empty() && opts.selectors.nouse_uuid.is_empty());
        if uuid_selectors && !opts.selectors.uuid_allowed(&g.uuid) {
            return Err(FitReason::CardUuidMismatch);
        }
        let memreq = check_load(&Load::of(g), self.req, mutex, self.quota, extra, coresreq)?;
        // HAMi: `CustomFilterRule` (pkg/device/nvidia/device.go), the last check of `Fit`.
        let mig = if g.mode == MIG_MODE {
            Some(mig_candidate(g, i, earlier, memreq).ok_or(FitReason::CardMigTopologyInfeasible)?)
        } else {
            None
        };
        Ok(Pick {
            gpu: i,
            mem: memreq,
            cores: coresreq,
            mig,
        })
    }

    /// HAMi's `isMIGRequest`: the pod does not exclude `mig` by `nvidia.com/vgpu-mode` and one of
    /// the node's NVIDIA GPUs is in `mig` mode.
    fn is_mig_request(&self, selected: &[usize]) -> bool {
        self.opts
            .selectors
            .vgpu_mode
            .as_deref()
            .is_none_or(|m| m.contains(MIG_MODE))
            && selected.iter().any(|&i| self.gpus[i].mode == MIG_MODE)
    }

    /// [`Self::picks`] for the common request of one device without NUMA binding or topology:
    /// the result is the greatest passing device in HAMi's order (Fit walks the sorted list from
    /// its end and stops at the first that passes), and on failure the reason counts do not
    /// depend on the order. So one pass without sorting gives the same answer.
    fn one_device(&self) -> Result<Vec<Pick>, FitFailure> {
        let (gpus, req, opts) = (self.gpus, self.req, self.opts);
        let keys = sort_keys(opts);
        let keys = keys.as_slice();
        let type_selectors = self.has_type_selectors();
        let mutex = opts.has(GpuPolicyKey::Mutex);
        let coresreq = req.coresreq.min(100);
        let scorer = DeviceScorer::new(req, opts.weights);
        let mut counts = ReasonCounts::default();
        let mut selected = 0usize;
        let mut best: Option<(usize, f32, Pick)> = None;
        for (i, g) in gpus.iter().enumerate() {
            if !self.is_nvidia_at(i, g) {
                continue;
            }
            selected += 1;
            let checked = self
                .check_device_first(g, type_selectors)
                .and_then(|()| self.check_device_rest(g, i, mutex, self.charged, coresreq, &[]));
            match checked {
                Err(r) => counts.bump(r),
                Ok(pick) => {
                    let score = scorer.score(g);
                    // The stable sort keeps equal devices in list order, so of equals the later
                    // one is nearer the end.
                    let take = best.as_ref().is_none_or(|(j, sj, _)| {
                        compare_gpus(keys, g, score, &gpus[*j], *sj).is_ge()
                    });
                    if take {
                        best = Some((i, score, pick));
                    }
                }
            }
        }
        if selected == 0 {
            return Err(FitFailure::NodeInsufficientDevice);
        }
        match best {
            Some((_, _, pick)) => Ok(vec![pick]),
            None => Err(FitFailure::Devices(counts.with_total(selected))),
        }
    }

    /// [`Self::picks`] the way HAMi does it: sort, then walk the sorted list from its end.
    fn sorted(&self) -> Result<Vec<Pick>, FitFailure> {
        let n = self.gpus.len();
        let mut order_stack = [0usize; STACK_GPUS];
        let mut order_heap = Vec::new();
        let order: &mut [usize] = if n <= STACK_GPUS {
            &mut order_stack[..n]
        } else {
            order_heap.resize(n, 0);
            &mut order_heap
        };
        for (i, o) in order.iter_mut().enumerate() {
            *o = i;
        }
        self.picks_in_order(order)
    }

    /// Fits the request the way HAMi does for a pod's later app containers: `order` (positions
    /// of `gpus`, every one once) is the node's device list as the previous container left it;
    /// it is sorted in place for this request, and stays sorted for the next container.
    pub fn picks_in_order(&self, order: &mut [usize]) -> Result<Vec<Pick>, FitFailure> {
        let (gpus, req, opts) = (self.gpus, self.req, self.opts);
        // Scratch space on the stack for the usual node size (this runs for every candidate node
        // of every filter).
        let n = gpus.len();
        if order.len() != n {
            // A caller's bug, not input: answer as HAMi would for an empty device list.
            return Err(FitFailure::NodeInsufficientDevice);
        }
        let mut score_stack = [0f32; STACK_GPUS];
        let mut score_heap = Vec::new();
        let scores: &mut [f32] = if n <= STACK_GPUS {
            &mut score_stack[..n]
        } else {
            score_heap.resize(n, 0.0);
            &mut score_heap
        };
        let scorer = DeviceScorer::new(req, opts.weights);
        for (s, g) in scores.iter_mut().zip(gpus) {
            *s = scorer.score(g);
        }
        sort_order(order, gpus, scores, opts);
        // The NVIDIA devices, in order.
        let mut kept_stack = [0usize; STACK_GPUS];
        let mut kept_heap = Vec::new();
        let kept_buf: &mut [usize] = if n <= STACK_GPUS {
            &mut kept_stack[..n]
        } else {
            kept_heap.resize(n, 0);
            &mut kept_heap
        };
        let mut kept = 0;
        for &i in order.iter() {
            if self.is_nvidia_at(i, &gpus[i]) {
                kept_buf[kept] = i;
                kept += 1;
            }
        }
        let selected: &[usize] = &kept_buf[..kept];
        let nums = req.nums as usize;
        if nums == 0 {
            return Ok(Vec::new());
        }
        // HAMi: `isMIGRequest` (pkg/scheduler/score.go) lifts this check when a `mig` GPU may
        // serve several of the devices.
        if nums > selected.len() && !self.is_mig_request(selected) {
            return Err(FitFailure::NodeInsufficientDevice);
        }
        let type_selectors = self.has_type_selectors();
        let topology = opts.has(GpuPolicyKey::TopologyAware);
        let mutex = opts.has(GpuPolicyKey::Mutex);
        let mut counts = ReasonCounts::default();
        let mut bump = |r: FitReason, n: usize| counts.add(r, n);
        let mut remaining = nums;
        let mut collected: Vec<Pick> = Vec::with_capacity(nums);
        let mut prev_numa: Option<u32> = None;
        let mut coresreq = req.coresreq;

        for &i in selected.iter().rev() {
            let g = &gpus[i];
            if let Err(r) = self.check_device_first(g, type_selectors) {
                bump(r, 1);
                continue;
            }
            if opts.selectors.numa_bind && prev_numa != Some(g.numa) {
                if !collected.is_empty() {
                    bump(FitReason::NumaNotFit, collected.len());
                }
                remaining = nums;
                collected.clear();
                prev_numa = Some(g.numa);
            }
            // HAMi: `Fit` visits a `mig` GPU again after each device it gave (`i++`), so that one
            // GPU can serve several devices of the container; the checks run again, and
            // `CustomFilterRule` sees the earlier instances.
            loop {
                coresreq = coresreq.min(100);
                let mut extra = self.charged;
                if self.quota.is_some() {
                    for p in &collected {
                        extra = extra.add(p.mem, p.cores);
                    }
                }
                let pick = match self.check_device_rest(g, i, mutex, extra, coresreq, &collected) {
                    Ok(p) => p,
                    Err(r) => {
                        bump(r, 1);
                        break;
                    }
                };
                collected.push(pick);
                if !topology {
                    remaining -= 1;
                    if remaining == 0 {
                        return Ok(collected);
                    }
                }
                if g.mode != MIG_MODE {
                    break;
                }
            }
        }

        if topology {
            if collected.len() == nums {
                return Ok(collected);
            }
            if collected.len() > nums {
                return Ok(pick_by_topology(self.node, gpus, collected, nums));
            }
        }
        if !collected.is_empty() {
            bump(
                FitReason::AllocatedCardsInsufficientRequest,
                collected.len(),
            );
        }
        Err(FitFailure::Devices(counts.with_total(selected.len())))
    }
}

/// `CustomFilterRule` of a `mig` GPU (HAMi `pkg/device/nvidia/device.go`): the instances in use,
/// plus those the container's earlier devices on this GPU took (each chosen again by
/// `selectMigCandidate`, as HAMi does), must leave a profile of at least `memreq` MiB with a free
/// placement. Returns that profile and placement.
fn mig_candidate(g: &GpuState, i: usize, earlier: &[Pick], memreq: u32) -> Option<MigPick> {
    let m = g.mig.as_deref()?;
    let mut occupied: Vec<MigPlacement> = m.occupied().collect();
    for p in earlier.iter().filter(|p| p.gpu == i) {
        let (_, placement) = m.select(&occupied, p.mem)?;
        occupied.push(placement);
    }
    let (profile, placement) = m.select(&occupied, memreq)?;
    Some(MigPick {
        profile: profile.name.clone(),
        placement,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fit::{MEM_PERCENTAGE_UNSET, gpu_request, nvidia_mask};
    use proptest::prelude::*;

    fn arb_gpu(i: u32) -> impl Strategy<Value = GpuState> {
        (
            1u32..4,
            0u32..4,
            prop_oneof![Just(1000u32), Just(4000), Just(8000)],
            0u32..9000,
            prop_oneof![Just(100u32), Just(0)],
            0u32..120,
            0u32..2,
            prop_oneof![
                Just("NVIDIA-T4"),
                Just("NVIDIA-A100"),
                Just("AMD-MI300"),
                Just("x-nvidia")
            ],
            prop_oneof![Just("hami-core"), Just("mig")],
            proptest::bool::weighted(0.9),
        )
            .prop_map(
                move |(
                    count,
                    used,
                    totalmem,
                    usedmem,
                    totalcore,
                    usedcores,
                    numa,
                    ty,
                    mode,
                    health,
                )| {
                    GpuState {
                        uuid: format!("GPU-{i}"),
                        index: i % 3,
                        count,
                        totalmem,
                        totalcore,
                        device_type: ty.to_owned(),
                        numa,
                        mode: mode.to_owned(),
                        health,
                        used,
                        usedmem,
                        usedcores: usedcores.min(totalcore),
                        mig: None,
                    }
                },
            )
    }

    proptest! {
        /// The single-device shortcut answers exactly what HAMi's sort-and-walk answers.
        #[test]
        fn one_device_shortcut_equals_the_sorted_walk(
            gpus in (0usize..7).prop_flat_map(|n| (0..n as u32).map(arb_gpu).collect::<Vec<_>>()),
            memreq in prop_oneof![Just(0u32), 1u32..9000],
            pct in prop_oneof![Just(MEM_PERCENTAGE_UNSET), 0u32..101],
            cores in 0u32..120,
            policy in prop_oneof![
                Just(vec![]),
                Just(vec![GpuPolicyKey::Binpack]),
                Just(vec![GpuPolicyKey::Spread]),
                Just(vec![GpuPolicyKey::Mutex]),
                Just(vec![GpuPolicyKey::Numa, GpuPolicyKey::Binpack]),
                Just(vec![GpuPolicyKey::Binpack, GpuPolicyKey::Mutex]),
            ],
            cordon_first in any::<bool>(),
            quota_mem in prop_oneof![Just(None), (0u64..10000).prop_map(Some)],
            charged_mem in 0u64..5000,
            use_uuid in prop_oneof![Just(vec![]), Just(vec!["GPU-1".to_owned(), "GPU-3".to_owned()])],
            nouse_type in prop_oneof![Just(vec![]), Just(vec!["a100".to_owned()])],
            vgpu_mode in prop_oneof![Just(None), Just(Some("hami-core".to_owned()))],
        ) {
            let mut node = NodeState { name: "n".to_owned(), gpus: gpus.clone(), ..Default::default() };
            if cordon_first {
                node.cordoned.insert("GPU-0".to_owned());
            }
            let req = gpu_request(1, memreq, pct, cores);
            let mut opts = PlacementOptions { gpu_policy: policy, ..Default::default() };
            opts.selectors.use_uuid = use_uuid;
            opts.selectors.nouse_type = nouse_type;
            opts.selectors.vgpu_mode = vgpu_mode;
            let quota = quota_mem.map(|l| QuotaBudget { mem_limit: Some(l), used_mem: 100, ..Default::default() });
            let charged = Charge { mem: charged_mem, cores: 0, count: 0 };
            let mask = nvidia_mask(&gpus);
            let fit = ContainerFit {
                node: &node,
                gpus: &gpus,
                req: &req,
                opts: &opts,
                quota: quota.as_ref(),
                charged,
                nvidia: None,
            };
            let expected = fit.sorted();
            prop_assert_eq!(&fit.one_device(), &expected);
            prop_assert_eq!(&ContainerFit { nvidia: Some(&mask), ..fit }.one_device(), &expected);
        }
    }
}

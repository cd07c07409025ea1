//! HAMi's scores and device order: the node score that picks among nodes, the device score and
//! the per-policy sort keys that order a node's devices for Fit (contract §5.2, §5.4).

use super::capacity::GpuState;
use super::input::{GpuPolicyKey, GpuRequest, MEM_PERCENTAGE_UNSET, PlacementOptions, Weights};

/// Node score (`ComputeDefaultScore`): existing usage only, computed in `f32` like HAMi.
pub fn node_score(gpus: &[GpuState]) -> f32 {
    let (mut used, mut count, mut ucores, mut tcores, mut umem, mut tmem) =
        (0u64, 0u64, 0u64, 0u64, 0u64, 0u64);
    for g in gpus {
        used += u64::from(g.used);
        count += u64::from(g.count);
        ucores += u64::from(g.usedcores);
        tcores += u64::from(g.totalcore);
        umem += u64::from(g.usedmem);
        tmem += u64::from(g.totalmem);
    }
    if count == 0 || tcores == 0 || tmem == 0 {
        return 0.0;
    }
    10.0 * (used as f32 / count as f32 + ucores as f32 / tcores as f32 + umem as f32 / tmem as f32)
}

/// Device score (`ComputeScore`) for one container's request, in `f32` like HAMi.
///
/// HAMi v2.10 counts the request only when the device `type` equals the request type (`NVIDIA`)
/// exactly, which real devices (`NVIDIA-Tesla T4`) never do (Appendix B #3). Tessera always counts
/// the request on NVIDIA devices, as HAMi's own unit tests expect; see docs/scheduler.md.
pub fn device_score(g: &GpuState, req: &GpuRequest, w: Weights) -> f32 {
    DeviceScorer::new(req, w).score(g)
}

/// [`device_score`] with the request's side converted once. Fit scores every device of a node
/// for the same request; read through the fitting context in that loop, the request's fields
/// were loaded and converted again for every device (3% of a filter's instructions, by
/// callgrind).
///
/// The arithmetic is HAMi's, operation for operation: integer sums, one `f32` conversion of
/// each, `f32` division, then `f32` weights. The precision is part of the contract: two cards of
/// 81,921 and 81,920 MiB score the same in `f32`, so HAMi's stable sort keeps them in list order,
/// where `f64` would order them by size and pick the other card.
#[derive(Debug, Clone, Copy)]
pub(super) struct DeviceScorer {
    cores: i64,
    /// The percentage of each card's memory, when the request is one.
    mem_percentage: Option<i64>,
    mem: i64,
    slot_weight: f32,
    core_weight: f32,
    memory_weight: f32,
}

/// HAMi's `util.Weight`, the factor of every device score.
const SCORE_FACTOR: f32 = 10.0;

impl DeviceScorer {
    pub(super) fn new(req: &GpuRequest, w: Weights) -> Self {
        let pct = req.mem_percentage_req;
        DeviceScorer {
            cores: i64::from(req.coresreq),
            mem_percentage: (pct != 0 && pct != MEM_PERCENTAGE_UNSET).then(|| i64::from(pct)),
            mem: i64::from(req.memreq),
            slot_weight: w.slot as f32,
            core_weight: w.core as f32,
            memory_weight: w.memory as f32,
        }
    }

    pub(super) fn score(&self, g: &GpuState) -> f32 {
        if g.count == 0 || g.totalcore == 0 || g.totalmem == 0 {
            return 0.0;
        }
        // One container asks for one slot on each device it gets (`request += 1`).
        let slots = 1 + i64::from(g.used);
        let mem = match self.mem_percentage {
            // HAMi: `int64(Totalmem) * pct / 100`, integer division.
            Some(pct) => i64::from(g.totalmem) * pct / 100,
            None => self.mem,
        };
        let used_score = slots as f32 / g.count as f32;
        let core_score = (self.cores + i64::from(g.usedcores)) as f32 / g.totalcore as f32;
        let mem_score = (mem + i64::from(g.usedmem)) as f32 / g.totalmem as f32;
        SCORE_FACTOR
            * (self.slot_weight * used_score
                + self.core_weight * core_score
                + self.memory_weight * mem_score)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SortKey {
    ScoreAsc,
    ScoreDesc,
    NumaAsc,
    NumaDesc,
    UsedDesc,
    /// The device index: the last key of a comma-separated chain (HAMi's `lessByChain`). The
    /// single-policy forms have no such key, so equal devices keep the order the list had.
    IndexAsc,
}

/// At most one key per dimension (score, NUMA) and the `UsedDesc` of mutex or the `IndexAsc` of
/// a chain: never more than [`MAX_SORT_KEYS`] keys, so they live on the stack.
const MAX_SORT_KEYS: usize = 4;

/// The sort keys of one policy chain, in priority order.
#[derive(Debug, Clone, Copy)]
pub(super) struct SortKeys {
    keys: [SortKey; MAX_SORT_KEYS],
    len: usize,
}

impl SortKeys {
    fn of(keys: &[SortKey]) -> Self {
        let mut out = SortKeys {
            keys: [SortKey::ScoreDesc; MAX_SORT_KEYS],
            len: 0,
        };
        for k in keys {
            out.push(*k);
        }
        out
    }

    fn push(&mut self, k: SortKey) {
        // Unreachable overflow (one key per dimension); dropping a key would only change ties.
        if self.len < MAX_SORT_KEYS {
            self.keys[self.len] = k;
            self.len += 1;
        }
    }

    pub(super) fn as_slice(&self) -> &[SortKey] {
        &self.keys[..self.len]
    }
}

/// The sort keys for a policy chain (contract §5.4 table). Fit consumes the sorted list from its end.
pub(super) fn sort_keys(opts: &PlacementOptions) -> SortKeys {
    use GpuPolicyKey::*;
    let chain = &opts.gpu_policy;
    match chain.as_slice() {
        [Binpack] if opts.selectors.numa_bind => {
            SortKeys::of(&[SortKey::NumaDesc, SortKey::ScoreAsc])
        }
        [Binpack] => SortKeys::of(&[SortKey::ScoreAsc, SortKey::NumaAsc]),
        [Mutex] => SortKeys::of(&[SortKey::UsedDesc, SortKey::NumaAsc]),
        [Spread] | [TopologyAware] | [] if opts.selectors.numa_bind => {
            SortKeys::of(&[SortKey::NumaAsc, SortKey::ScoreDesc])
        }
        [Spread] | [TopologyAware] | [] => SortKeys::of(&[SortKey::ScoreDesc, SortKey::NumaAsc]),
        _ => {
            let mut keys = SortKeys::of(&[]);
            if opts.selectors.numa_bind {
                keys.push(SortKey::NumaAsc);
            }
            for p in chain {
                let k = match p {
                    Binpack => SortKey::ScoreAsc,
                    Spread => SortKey::ScoreDesc,
                    Numa => SortKey::NumaAsc,
                    Mutex | TopologyAware => continue,
                };
                let same_dimension = |a: SortKey| match k {
                    SortKey::ScoreAsc | SortKey::ScoreDesc => {
                        matches!(a, SortKey::ScoreAsc | SortKey::ScoreDesc)
                    }
                    _ => matches!(a, SortKey::NumaAsc | SortKey::NumaDesc),
                };
                if !keys.as_slice().iter().any(|a| same_dimension(*a)) {
                    keys.push(k);
                }
            }
            if !keys
                .as_slice()
                .iter()
                .any(|k| matches!(k, SortKey::ScoreAsc | SortKey::ScoreDesc))
            {
                keys.push(SortKey::ScoreDesc);
            }
            keys.push(SortKey::IndexAsc);
            keys
        }
    }
}

/// HAMi's order of two devices (with their device scores) under `keys`. Devices equal under
/// every key compare equal: the stable sort then keeps them in the order the list already had
/// (HAMi's `sort.Sort` is an insertion sort, so stable, up to 12 devices; docs/scheduler.md).
pub(super) fn compare_gpus(
    keys: &[SortKey],
    ga: &GpuState,
    sa: f32,
    gb: &GpuState,
    sb: f32,
) -> std::cmp::Ordering {
    for k in keys {
        let o = match k {
            SortKey::ScoreAsc => sa.total_cmp(&sb),
            SortKey::ScoreDesc => sb.total_cmp(&sa),
            SortKey::NumaAsc => ga.numa.cmp(&gb.numa),
            SortKey::NumaDesc => gb.numa.cmp(&ga.numa),
            SortKey::UsedDesc => gb.used.cmp(&ga.used),
            SortKey::IndexAsc => ga.index.cmp(&gb.index),
        };
        if o.is_ne() {
            return o;
        }
    }
    std::cmp::Ordering::Equal
}

/// Sorts `order` (indices of `gpus`) in HAMi's order, starting from the order it already has:
/// HAMi sorts the node's device list in place, so a pod's second container starts from the order
/// the first one left (`fitInDevices`), and equal devices stay where the last sort put them.
pub(super) fn sort_order(
    order: &mut [usize],
    gpus: &[GpuState],
    scores: &[f32],
    opts: &PlacementOptions,
) {
    let keys = sort_keys(opts);
    let keys = keys.as_slice();
    order.sort_by(|&a, &b| compare_gpus(keys, &gpus[a], scores[a], &gpus[b], scores[b]));
}

//! Fit and score: HAMi v2.10's placement rules as pure functions (contract §5.2–§5.5, §5.7).
//!
//! Nothing here does I/O or reads a clock. The decision loop, `simulate` and the benchmarks all
//! call [`evaluate_node`] and [`select_node`]; what differs between them is only where the
//! [`NodeState`]s and the [`QuotaBudget`] come from.

use std::collections::{BTreeMap, HashMap, HashSet};

use hami_contract::{ContainerDevice, NVIDIA_VENDOR, PodDevices};

/// Fit reason constants (`pkg/device/common/common.go`).
pub mod reason {
    pub const CARD_TYPE_MISMATCH: &str = "CardTypeMismatch";
    pub const CARD_UUID_MISMATCH: &str = "CardUuidMismatch";
    pub const CARD_TIME_SLICING_EXHAUSTED: &str = "CardTimeSlicingExhausted";
    pub const CARD_COMPUTE_UNITS_EXHAUSTED: &str = "CardComputeUnitsExhausted";
    pub const CARD_INSUFFICIENT_MEMORY: &str = "CardInsufficientMemory";
    pub const CARD_INSUFFICIENT_CORE: &str = "CardInsufficientCore";
    pub const CARD_NOT_HEALTH: &str = "CardNotHealth";
    pub const CARD_CORDONED: &str = "CardCordoned";
    pub const NUMA_NOT_FIT: &str = "NumaNotFit";
    pub const EXCLUSIVE_DEVICE_ALLOCATE_CONFLICT: &str = "ExclusiveDeviceAllocateConflict";
    pub const CARD_NOT_FOUND_CUSTOM_FILTER_RULE: &str = "CardNotFoundCustomFilterRule";
    pub const NODE_INSUFFICIENT_DEVICE: &str = "NodeInsufficientDevice";
    pub const ALLOCATED_CARDS_INSUFFICIENT_REQUEST: &str = "AllocatedCardsInsufficientRequest";
    pub const RESOURCE_QUOTA_NOT_FIT: &str = "ResourceQuotaNotFit";
}

pub use hami_contract::MEM_PERCENTAGE_UNSET;

/// One container's NVIDIA request, already resolved (contract §1.2).
pub type GpuRequest = hami_contract::ContainerDeviceRequest;

/// Builds an NVIDIA request (tests, benchmarks).
pub fn gpu_request(nums: u32, memreq: u32, mem_percentage_req: u32, coresreq: u32) -> GpuRequest {
    GpuRequest {
        nums,
        vendor: hami_contract::NVIDIA_VENDOR.to_owned(),
        memreq,
        mem_percentage_req,
        coresreq,
    }
}

/// A pod's requests: one optional request per container, init containers separately.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodAsk {
    pub init: Vec<Option<GpuRequest>>,
    pub app: Vec<Option<GpuRequest>>,
}

impl PodAsk {
    /// True when no container asks for a GPU: such pods are none of the extender's business.
    pub fn is_empty(&self) -> bool {
        self.init.iter().chain(&self.app).all(Option::is_none)
    }
}

/// One key of a GPU scheduler policy chain (`hami.io/gpu-scheduler-policy`, §3.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GpuPolicyKey {
    Binpack,
    Spread,
    TopologyAware,
    Mutex,
    Numa,
}

impl From<&hami_contract::policy::GpuPolicy> for GpuPolicyKey {
    fn from(p: &hami_contract::policy::GpuPolicy) -> Self {
        use hami_contract::policy::GpuPolicy;
        match p {
            GpuPolicy::Binpack => GpuPolicyKey::Binpack,
            GpuPolicy::Spread => GpuPolicyKey::Spread,
            GpuPolicy::TopologyAware => GpuPolicyKey::TopologyAware,
            GpuPolicy::Mutex => GpuPolicyKey::Mutex,
            GpuPolicy::Numa => GpuPolicyKey::Numa,
        }
    }
}

/// Node-level policy (§5.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NodePolicyKey {
    #[default]
    Binpack,
    Spread,
}

/// `hami.io/device-scoring-weights` (§3.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Weights {
    pub slot: u32,
    pub core: u32,
    pub memory: u32,
}

impl Default for Weights {
    fn default() -> Self {
        Weights {
            slot: 1,
            core: 1,
            memory: 1,
        }
    }
}

/// Everything the pod's annotations say about placement, already parsed and defaulted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PlacementOptions {
    /// UUID/type/mode selectors and numa-bind, as `hami-contract` parsed them.
    pub selectors: hami_contract::policy::PodSchedulingOptions,
    /// The effective GPU policy chain (pod annotation, else the daemon default). Empty ⇒ spread.
    pub gpu_policy: Vec<GpuPolicyKey>,
    pub node_policy: NodePolicyKey,
    pub weights: Weights,
}

impl PlacementOptions {
    fn has(&self, key: GpuPolicyKey) -> bool {
        self.gpu_policy.contains(&key)
    }
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

    /// Books a collapsed pod usage entry (§5.1: `Used += max(Slots, 1)`).
    pub fn book_usage(&mut self, slots: u32, mem: u32, cores: u32) {
        self.used = self.used.saturating_add(slots.max(1));
        self.usedmem = self.usedmem.saturating_add(mem);
        self.usedcores = self.usedcores.saturating_add(cores);
    }
}

/// Pairwise GPU topology scores from `hami.io/node-nvidia-score` (§2.2).
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

/// The namespace's GPU budget (§5.7): limits are the minimum over all ResourceQuota objects of the
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

/// Extra charge on top of [`QuotaBudget::used_*`] while one pod is being fitted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Charge {
    pub mem: u64,
    pub cores: u64,
    pub count: u64,
}

impl Charge {
    fn add(self, mem: u32, cores: u32) -> Charge {
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

/// HAMi's reason string: `"<count>/<N> <Reason>"` per reason, sorted as strings, `", "`-joined.
pub fn format_reasons(counts: &BTreeMap<&'static str, usize>, total: usize) -> String {
    let mut parts: Vec<String> = counts
        .iter()
        .filter(|(_, n)| **n > 0)
        .map(|(r, n)| format!("{n}/{total} {r}"))
        .collect();
    parts.sort();
    parts.join(", ")
}

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

/// Device score (`ComputeScore`) for one container's request.
///
/// HAMi v2.10 counts the request only when the device `type` equals the request type (`NVIDIA`)
/// exactly, which real devices (`NVIDIA-Tesla T4`) never do (Appendix B #3). Tessera always counts
/// the request on NVIDIA devices, as HAMi's own unit tests expect; see docs/scheduler.md.
pub fn device_score(g: &GpuState, req: &GpuRequest, w: Weights) -> f64 {
    if g.count == 0 || g.totalcore == 0 || g.totalmem == 0 {
        return 0.0;
    }
    let r = 1.0;
    let c = f64::from(req.coresreq);
    let pct = req.mem_percentage_req;
    let m = if pct != 0 && pct != MEM_PERCENTAGE_UNSET {
        (f64::from(g.totalmem) * f64::from(pct) / 100.0).floor()
    } else {
        f64::from(req.memreq)
    };
    10.0 * (f64::from(w.slot) * (r + f64::from(g.used)) / f64::from(g.count)
        + f64::from(w.core) * (c + f64::from(g.usedcores)) / f64::from(g.totalcore)
        + f64::from(w.memory) * (m + f64::from(g.usedmem)) / f64::from(g.totalmem))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SortKey {
    ScoreAsc,
    ScoreDesc,
    NumaAsc,
    NumaDesc,
    UsedDesc,
}

/// At most one key per dimension (score, NUMA) and the `UsedDesc` of mutex: never more than
/// [`MAX_SORT_KEYS`] keys, so they live on the stack.
const MAX_SORT_KEYS: usize = 4;

/// The sort keys of one policy chain, in priority order.
#[derive(Debug, Clone, Copy)]
struct SortKeys {
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

    fn as_slice(&self) -> &[SortKey] {
        &self.keys[..self.len]
    }
}

/// The sort keys for a policy chain (§5.4 table). Fit consumes the sorted list from its end.
fn sort_keys(opts: &PlacementOptions) -> SortKeys {
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
            keys
        }
    }
}

/// HAMi's order of two devices (with their device scores) under `keys`; ties end on `Index`
/// ascending (deterministic where Go's sort is not, Appendix B #4).
fn compare_gpus(
    keys: &[SortKey],
    ga: &GpuState,
    sa: f64,
    gb: &GpuState,
    sb: f64,
) -> std::cmp::Ordering {
    for k in keys {
        let o = match k {
            SortKey::ScoreAsc => sa.total_cmp(&sb),
            SortKey::ScoreDesc => sb.total_cmp(&sa),
            SortKey::NumaAsc => ga.numa.cmp(&gb.numa),
            SortKey::NumaDesc => gb.numa.cmp(&ga.numa),
            SortKey::UsedDesc => gb.used.cmp(&ga.used),
        };
        if o.is_ne() {
            return o;
        }
    }
    ga.index.cmp(&gb.index)
}

/// Sorts `order` (indices of `gpus`) in HAMi's order. Stable, like the original pass.
fn sort_order(order: &mut [usize], gpus: &[GpuState], scores: &[f64], opts: &PlacementOptions) {
    let keys = sort_keys(opts);
    let keys = keys.as_slice();
    order.sort_by(|&a, &b| compare_gpus(keys, &gpus[a], scores[a], &gpus[b], scores[b]));
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

/// [`is_nvidia`] of GPU `i`, from a precomputed [`nvidia_mask`] when there is one.
#[derive(Debug, Clone, Copy, Default)]
struct NvidiaMask<'a>(Option<&'a [bool]>);

impl NvidiaMask<'_> {
    fn is(&self, i: usize, g: &GpuState) -> bool {
        match self.0.and_then(|m| m.get(i)) {
            Some(b) => *b,
            None => is_nvidia(&g.device_type),
        }
    }
}

/// GPUs per node handled without a heap allocation in [`fit_container`].
const STACK_GPUS: usize = 16;

fn contains_ignore_ascii_case(haystack: &str, needle: &str) -> bool {
    haystack
        .as_bytes()
        .windows(needle.len())
        .any(|w| w.eq_ignore_ascii_case(needle.as_bytes()))
}

/// One accepted device for one container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pick {
    /// Position in [`NodeState::gpus`].
    pub gpu: usize,
    pub mem: u32,
    pub cores: u32,
}

/// The per-device checks of NVIDIA `Fit` that come before the NUMA grouping, in HAMi's order.
fn check_device_first(
    node: &NodeState,
    g: &GpuState,
    opts: &PlacementOptions,
    type_selectors: bool,
) -> Result<(), &'static str> {
    if !g.health {
        return Err(reason::CARD_NOT_HEALTH);
    }
    if node.cordoned.contains(&g.uuid) {
        return Err(reason::CARD_CORDONED);
    }
    // `type_allowed` allocates; without type selectors it is always true.
    if !((!type_selectors || opts.selectors.type_allowed(&g.device_type))
        && (opts.selectors.vgpu_mode.is_none() || opts.selectors.mode_allowed(&g.mode)))
    {
        return Err(reason::CARD_TYPE_MISMATCH);
    }
    Ok(())
}

/// The per-device checks after the NUMA grouping, in HAMi's order; `extra` is the quota charge
/// of everything picked before this device.
#[allow(clippy::too_many_arguments)]
fn check_device_rest(
    g: &GpuState,
    i: usize,
    req: &GpuRequest,
    opts: &PlacementOptions,
    mutex: bool,
    quota: Option<&QuotaBudget>,
    extra: Charge,
    coresreq: u32,
) -> Result<Pick, &'static str> {
    // Without UUID selectors every card is allowed (skips a call per device).
    let uuid_selectors =
        !(opts.selectors.use_uuid.is_empty() && opts.selectors.nouse_uuid.is_empty());
    if uuid_selectors && !opts.selectors.uuid_allowed(&g.uuid) {
        return Err(reason::CARD_UUID_MISMATCH);
    }
    if g.count <= g.used {
        return Err(reason::CARD_TIME_SLICING_EXHAUSTED);
    }
    if mutex && g.used > 0 {
        return Err(reason::EXCLUSIVE_DEVICE_ALLOCATE_CONFLICT);
    }
    let memreq = req.memory_on(g.totalmem);
    if let Some(q) = quota
        && !q.allows(extra.add(memreq, coresreq))
    {
        return Err(reason::RESOURCE_QUOTA_NOT_FIT);
    }
    if i64::from(g.totalmem) - i64::from(g.usedmem) < i64::from(memreq) {
        return Err(reason::CARD_INSUFFICIENT_MEMORY);
    }
    if i64::from(g.totalcore) - i64::from(g.usedcores) < i64::from(coresreq) {
        return Err(reason::CARD_INSUFFICIENT_CORE);
    }
    if g.totalcore == 100 && coresreq == 100 && g.used > 0 {
        return Err(reason::EXCLUSIVE_DEVICE_ALLOCATE_CONFLICT);
    }
    if g.totalcore != 0 && g.usedcores == g.totalcore && coresreq == 0 {
        return Err(reason::CARD_COMPUTE_UNITS_EXHAUSTED);
    }
    if g.mode == "mig" {
        // MIG placement is not implemented in Tessera (docs/scheduler.md): never hand out a
        // MIG-mode card as if it were a shareable one.
        return Err(reason::CARD_NOT_FOUND_CUSTOM_FILTER_RULE);
    }
    Ok(Pick {
        gpu: i,
        mem: memreq,
        cores: coresreq,
    })
}

/// [`fit_container`] for the common request of one device without NUMA binding or topology:
/// the result is the greatest passing device in HAMi's order (Fit walks the sorted list from
/// its end and stops at the first that passes), and on failure the reason counts do not depend
/// on the order. So one pass without sorting gives the same answer.
fn fit_one_device(
    node: &NodeState,
    nvidia: NvidiaMask<'_>,
    gpus: &[GpuState],
    req: &GpuRequest,
    opts: &PlacementOptions,
    quota: Option<&QuotaBudget>,
    charged: Charge,
) -> Result<Vec<Pick>, String> {
    let keys = sort_keys(opts);
    let keys = keys.as_slice();
    let type_selectors =
        !(opts.selectors.use_type.is_empty() && opts.selectors.nouse_type.is_empty());
    let mutex = opts.has(GpuPolicyKey::Mutex);
    let coresreq = req.coresreq.min(100);
    let mut counts: BTreeMap<&'static str, usize> = BTreeMap::new();
    let mut selected = 0usize;
    let mut best: Option<(usize, f64, Pick)> = None;
    for (i, g) in gpus.iter().enumerate() {
        if !nvidia.is(i, g) {
            continue;
        }
        selected += 1;
        let checked = check_device_first(node, g, opts, type_selectors)
            .and_then(|()| check_device_rest(g, i, req, opts, mutex, quota, charged, coresreq));
        match checked {
            Err(r) => *counts.entry(r).or_insert(0) += 1,
            Ok(pick) => {
                let score = device_score(g, req, opts.weights);
                // The stable sort keeps equal devices in list order, so of equals the later
                // one is nearer the end.
                let take = best
                    .as_ref()
                    .is_none_or(|(j, sj, _)| compare_gpus(keys, g, score, &gpus[*j], *sj).is_ge());
                if take {
                    best = Some((i, score, pick));
                }
            }
        }
    }
    if selected == 0 {
        return Err(reason::NODE_INSUFFICIENT_DEVICE.to_owned());
    }
    match best {
        Some((_, _, pick)) => Ok(vec![pick]),
        None => Err(format_reasons(&counts, selected)),
    }
}

/// Fits one container's request onto the node's NVIDIA devices (`fitInDevices` + NVIDIA `Fit`).
/// On failure returns HAMi's reason string.
pub fn fit_container(
    node: &NodeState,
    gpus: &[GpuState],
    req: &GpuRequest,
    opts: &PlacementOptions,
    quota: Option<&QuotaBudget>,
    charged: Charge,
) -> Result<Vec<Pick>, String> {
    if req.nums == 1 && !opts.selectors.numa_bind && !opts.has(GpuPolicyKey::TopologyAware) {
        return fit_one_device(node, NvidiaMask::default(), gpus, req, opts, quota, charged);
    }
    fit_container_sorted(node, NvidiaMask::default(), gpus, req, opts, quota, charged)
}

/// [`fit_container`] with the node's [`nvidia_mask`].
fn fit_container_masked(
    node: &NodeState,
    nvidia: NvidiaMask<'_>,
    gpus: &[GpuState],
    req: &GpuRequest,
    opts: &PlacementOptions,
    quota: Option<&QuotaBudget>,
    charged: Charge,
) -> Result<Vec<Pick>, String> {
    if req.nums == 1 && !opts.selectors.numa_bind && !opts.has(GpuPolicyKey::TopologyAware) {
        return fit_one_device(node, nvidia, gpus, req, opts, quota, charged);
    }
    fit_container_sorted(node, nvidia, gpus, req, opts, quota, charged)
}

/// [`fit_container`] the way HAMi does it: sort, then walk the sorted list from its end.
fn fit_container_sorted(
    node: &NodeState,
    nvidia: NvidiaMask<'_>,
    gpus: &[GpuState],
    req: &GpuRequest,
    opts: &PlacementOptions,
    quota: Option<&QuotaBudget>,
    charged: Charge,
) -> Result<Vec<Pick>, String> {
    // Scratch space on the stack for the usual node size (this runs for every candidate node
    // of every filter).
    let n = gpus.len();
    let mut score_stack = [0f64; STACK_GPUS];
    let mut score_heap = Vec::new();
    let scores: &mut [f64] = if n <= STACK_GPUS {
        &mut score_stack[..n]
    } else {
        score_heap.resize(n, 0.0);
        &mut score_heap
    };
    for (s, g) in scores.iter_mut().zip(gpus) {
        *s = device_score(g, req, opts.weights);
    }
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
    sort_order(order, gpus, scores, opts);
    // Keep the NVIDIA devices, in order, as a prefix.
    let mut kept = 0;
    for k in 0..n {
        let i = order[k];
        if nvidia.is(i, &gpus[i]) {
            order[kept] = i;
            kept += 1;
        }
    }
    let selected: &[usize] = &order[..kept];
    let nums = req.nums as usize;
    if nums == 0 {
        return Ok(Vec::new());
    }
    if nums > selected.len() {
        return Err(reason::NODE_INSUFFICIENT_DEVICE.to_owned());
    }
    // `type_allowed` allocates; without type selectors it is always true.
    let type_selectors =
        !(opts.selectors.use_type.is_empty() && opts.selectors.nouse_type.is_empty());
    let topology = opts.has(GpuPolicyKey::TopologyAware);
    let mutex = opts.has(GpuPolicyKey::Mutex);
    let mut counts: BTreeMap<&'static str, usize> = BTreeMap::new();
    let mut bump = |r: &'static str, n: usize| *counts.entry(r).or_insert(0) += n;
    let mut remaining = nums;
    let mut collected: Vec<Pick> = Vec::with_capacity(nums);
    let mut prev_numa: Option<u32> = None;
    let mut coresreq = req.coresreq;

    for &i in selected.iter().rev() {
        let g = &gpus[i];
        if let Err(r) = check_device_first(node, g, opts, type_selectors) {
            bump(r, 1);
            continue;
        }
        if opts.selectors.numa_bind && prev_numa != Some(g.numa) {
            if !collected.is_empty() {
                bump(reason::NUMA_NOT_FIT, collected.len());
            }
            remaining = nums;
            collected.clear();
            prev_numa = Some(g.numa);
        }
        coresreq = coresreq.min(100);
        let mut extra = charged;
        if quota.is_some() {
            for p in &collected {
                extra = extra.add(p.mem, p.cores);
            }
        }
        let pick = match check_device_rest(g, i, req, opts, mutex, quota, extra, coresreq) {
            Ok(p) => p,
            Err(r) => {
                bump(r, 1);
                continue;
            }
        };
        collected.push(pick);
        if !topology {
            remaining -= 1;
            if remaining == 0 {
                return Ok(collected);
            }
        }
    }

    if topology {
        if collected.len() == nums {
            return Ok(collected);
        }
        if collected.len() > nums {
            return Ok(pick_by_topology(node, gpus, collected, nums));
        }
    }
    if !collected.is_empty() {
        bump(
            reason::ALLOCATED_CARDS_INSUFFICIENT_REQUEST,
            collected.len(),
        );
    }
    Err(format_reasons(&counts, selected.len()))
}

fn pair_score(node: &NodeState, gpus: &[GpuState], a: usize, b: usize) -> i64 {
    node.topology
        .as_ref()
        .and_then(|t| t.get(&gpus[a].uuid))
        .and_then(|m| m.get(&gpus[b].uuid))
        .copied()
        .unwrap_or(0)
}

/// The topology-aware choice among more candidates than needed (§5.3, after the loop).
fn pick_by_topology(
    node: &NodeState,
    gpus: &[GpuState],
    collected: Vec<Pick>,
    nums: usize,
) -> Vec<Pick> {
    if nums == 1 {
        let mut best: Option<(i64, usize)> = None;
        for (i, p) in collected.iter().enumerate() {
            let sum: i64 = collected
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .map(|(_, q)| pair_score(node, gpus, p.gpu, q.gpu))
                .sum();
            if best.is_none_or(|(s, _)| sum < s) {
                best = Some((sum, i));
            }
        }
        let i = best.map_or(0, |(_, i)| i);
        return vec![collected[i].clone()];
    }
    // Lexicographic combinations over collection order; the first maximum wins.
    let n = collected.len();
    let mut idx: Vec<usize> = (0..nums).collect();
    let mut best: Option<(i64, Vec<usize>)> = None;
    loop {
        let mut sum = 0i64;
        for x in 0..nums {
            for y in (x + 1)..nums {
                sum += pair_score(node, gpus, collected[idx[x]].gpu, collected[idx[y]].gpu);
            }
        }
        if best.as_ref().is_none_or(|(s, _)| sum > *s) {
            best = Some((sum, idx.clone()));
        }
        // Next combination.
        let mut k = nums;
        loop {
            if k == 0 {
                let chosen = best.map(|(_, v)| v).unwrap_or_default();
                return chosen.into_iter().map(|i| collected[i].clone()).collect();
            }
            k -= 1;
            if idx[k] != k + n - nums {
                break;
            }
        }
        idx[k] += 1;
        for j in (k + 1)..nums {
            idx[j] = idx[j - 1] + 1;
        }
    }
}

/// A node that can take the pod: its score and the per-container devices.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeFit {
    pub node: String,
    /// Node score (existing usage only, §5.2 step 1).
    pub score: f32,
    /// One entry per container, init containers first.
    pub devices: PodDevices,
    /// Quota charge of the pod as placed (collapsed: max over init, sum over app).
    pub charge: Charge,
}

/// What fitting one node found, before anything is copied out of the node: per container
/// (init containers first) the picked GPU positions. [`NodePicks::into_fit`] builds the
/// [`NodeFit`]; the filter does that only for the node it keeps.
#[derive(Debug, Clone, PartialEq)]
pub struct NodePicks {
    /// Node score (existing usage only, §5.2 step 1).
    pub score: f32,
    pub containers: Vec<Vec<Pick>>,
    pub charge: Charge,
}

impl NodePicks {
    /// The container device list (UUIDs of `node`'s GPUs).
    pub fn devices(&self, node: &NodeState) -> PodDevices {
        PodDevices(
            self.containers
                .iter()
                .map(|picks| to_devices(&node.gpus, picks))
                .collect(),
        )
    }

    pub fn into_fit(self, node: &NodeState) -> NodeFit {
        NodeFit {
            node: node.name.clone(),
            score: self.score,
            devices: self.devices(node),
            charge: self.charge,
        }
    }
}

/// Evaluates one node for one pod (`scoreNode`): init containers each on a fresh copy, app
/// containers cumulatively. Returns the node's reason string on failure.
pub fn evaluate_node(
    node: &NodeState,
    ask: &PodAsk,
    opts: &PlacementOptions,
    quota: Option<&QuotaBudget>,
) -> Result<NodeFit, String> {
    evaluate_picks(node, None, ask, opts, quota).map(|p| p.into_fit(node))
}

/// [`evaluate_node`] without building the device list. `nvidia` is the node's
/// [`nvidia_mask`] when the caller keeps one (it must match `node.gpus`), else `None`.
pub fn evaluate_picks(
    node: &NodeState,
    nvidia: Option<&[bool]>,
    ask: &PodAsk,
    opts: &PlacementOptions,
    quota: Option<&QuotaBudget>,
) -> Result<NodePicks, String> {
    let nvidia = NvidiaMask(nvidia.filter(|m| m.len() == node.gpus.len()));
    let score = node_score(&node.gpus);
    let mut containers: Vec<Vec<Pick>> = Vec::with_capacity(ask.init.len() + ask.app.len());
    let mut init_charge = Charge::default();
    for req in &ask.init {
        match req {
            None => containers.push(Vec::new()),
            Some(r) => {
                let picks = fit_container_masked(
                    node,
                    nvidia,
                    &node.gpus,
                    r,
                    opts,
                    quota,
                    Charge::default(),
                )?;
                let c = picks
                    .iter()
                    .fold(Charge::default(), |c, p| c.add(p.mem, p.cores));
                if (c.count, c.mem) > (init_charge.count, init_charge.mem) {
                    init_charge = c;
                }
                containers.push(picks);
            }
        }
    }
    // Only pods with several GPU app containers need a scratch copy of the usage.
    let multi = ask.app.iter().filter(|r| r.is_some()).count() > 1;
    let mut gpus = if multi {
        std::borrow::Cow::Owned(node.gpus.clone())
    } else {
        std::borrow::Cow::Borrowed(node.gpus.as_slice())
    };
    let mut app_charge = Charge::default();
    for req in &ask.app {
        match req {
            None => containers.push(Vec::new()),
            Some(r) => {
                let picks = fit_container_masked(node, nvidia, &gpus, r, opts, quota, app_charge)?;
                for p in &picks {
                    if multi {
                        gpus.to_mut()[p.gpu].book(p.mem, p.cores);
                    }
                    app_charge = app_charge.add(p.mem, p.cores);
                }
                containers.push(picks);
            }
        }
    }
    let charge = Charge {
        mem: init_charge.mem.max(app_charge.mem),
        cores: init_charge.cores.max(app_charge.cores),
        count: init_charge.count.max(app_charge.count),
    };
    Ok(NodePicks {
        score,
        containers,
        charge,
    })
}

fn to_devices(gpus: &[GpuState], picks: &[Pick]) -> Vec<ContainerDevice> {
    picks
        .iter()
        .map(|p| ContainerDevice {
            uuid: gpus[p.gpu].uuid.clone(),
            vendor: NVIDIA_VENDOR.to_owned(),
            usedmem: p.mem,
            usedcores: p.cores,
        })
        .collect()
}

/// Picks the node (§5.5): binpack ⇒ the highest node score, spread ⇒ the lowest. Ties go to
/// the earliest candidate (HAMi: Go map order, i.e. random).
pub fn select_node(fits: &[NodeFit], policy: NodePolicyKey) -> Option<&NodeFit> {
    let mut best: Option<&NodeFit> = None;
    for f in fits {
        best = match best {
            None => Some(f),
            Some(b) => {
                let better = match policy {
                    NodePolicyKey::Binpack => f.score > b.score,
                    NodePolicyKey::Spread => f.score < b.score,
                };
                Some(if better { f } else { b })
            }
        };
    }
    best
}

/// The outcome of filtering one pod over a set of candidate nodes.
#[derive(Debug, Clone, PartialEq)]
pub struct FilterOutcome {
    pub chosen: Option<NodeFit>,
    /// All fitting nodes with their scores (for the `FilteringSucceed` event).
    pub fitting: Vec<(String, f32)>,
    /// Reason per failed node.
    pub failed: BTreeMap<String, String>,
}

/// Evaluates every candidate and selects one.
pub fn filter<'a>(
    nodes: impl IntoIterator<Item = &'a NodeState>,
    ask: &PodAsk,
    opts: &PlacementOptions,
    quota: Option<&QuotaBudget>,
) -> FilterOutcome {
    let mut fits = Vec::new();
    let mut failed = BTreeMap::new();
    for n in nodes {
        match evaluate_node(n, ask, opts, quota) {
            Ok(f) => fits.push(f),
            Err(r) => {
                failed.insert(n.name.clone(), r);
            }
        }
    }
    let fitting = fits.iter().map(|f| (f.node.clone(), f.score)).collect();
    let chosen = select_node(&fits, opts.node_policy).cloned();
    FilterOutcome {
        chosen,
        fitting,
        failed,
    }
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

#[cfg(test)]
mod tests {
    use super::*;
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
            let expected =
                fit_container_sorted(&node, NvidiaMask::default(), &gpus, &req, &opts, quota.as_ref(), charged);
            prop_assert_eq!(
                &fit_one_device(&node, NvidiaMask::default(), &gpus, &req, &opts, quota.as_ref(), charged),
                &expected
            );
            prop_assert_eq!(
                &fit_one_device(&node, NvidiaMask(Some(&mask)), &gpus, &req, &opts, quota.as_ref(), charged),
                &expected
            );
        }
    }
}

//! What a pod asks for and how it wants to be placed, as Fit reads it: per-container NVIDIA
//! requests and the placement options parsed from its annotations over the daemon defaults.

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

/// One key of a GPU scheduler policy chain (`hami.io/gpu-scheduler-policy`, contract §3.3).
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

/// Node-level policy (contract §5.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NodePolicyKey {
    #[default]
    Binpack,
    Spread,
}

impl NodePolicyKey {
    /// Node selection order (contract §5.5): binpack prefers the higher node score, spread the lower.
    /// Equal scores are not preferred, so ties keep the earlier candidate.
    pub fn prefers(self, candidate: f32, current: f32) -> bool {
        match self {
            NodePolicyKey::Binpack => candidate > current,
            NodePolicyKey::Spread => candidate < current,
        }
    }
}

/// `hami.io/device-scoring-weights` (contract §3.3).
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
    pub(super) fn has(&self, key: GpuPolicyKey) -> bool {
        self.gpu_policy.contains(&key)
    }
}

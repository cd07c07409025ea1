//! Resource names (contract §1.1) and the request sentinels.

use serde::{Deserialize, Serialize};

/// Default count resource: the number of distinct physical GPUs per container. The only resource
/// the device plugin advertises to kubelet.
pub const DEFAULT_COUNT_NAME: &str = "nvidia.com/gpu";
/// Default memory resource: MiB per GPU, a plain integer.
pub const DEFAULT_MEMORY_NAME: &str = "nvidia.com/gpumem";
/// Default memory-percentage resource: percent of the chosen card's memory.
pub const DEFAULT_MEMORY_PERCENTAGE_NAME: &str = "nvidia.com/gpumem-percentage";
/// Default cores resource: percent of the GPU's SMs (100 = exclusive card).
pub const DEFAULT_CORES_NAME: &str = "nvidia.com/gpucores";
/// Default priority resource: becomes `CUDA_TASK_PRIORITY` (0 high, 1 low) via the webhook.
pub const DEFAULT_PRIORITY_NAME: &str = "nvidia.com/priority";

/// HAMi's `MemPercentagereq` sentinel meaning "no percentage was asked".
pub const MEM_PERCENTAGE_UNSET: u32 = 101;

/// The five configurable resource names of HAMi's `nvidia:` config section
/// (`resourceCountName`, `resourceMemoryName`, `resourceMemoryPercentageName`,
/// `resourceCoreName`, `resourcePriorityName`).
///
/// An empty name means "this resource is not used" (HAMi skips lookups of empty names).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ResourceNames {
    /// `resourceCountName`, default `nvidia.com/gpu`.
    pub count: String,
    /// `resourceMemoryName`, default `nvidia.com/gpumem`.
    pub memory: String,
    /// `resourceMemoryPercentageName`, default `nvidia.com/gpumem-percentage`.
    pub memory_percentage: String,
    /// `resourceCoreName`, default `nvidia.com/gpucores`.
    pub cores: String,
    /// `resourcePriorityName`, default `nvidia.com/priority`.
    pub priority: String,
}

impl Default for ResourceNames {
    fn default() -> Self {
        ResourceNames {
            count: DEFAULT_COUNT_NAME.to_owned(),
            memory: DEFAULT_MEMORY_NAME.to_owned(),
            memory_percentage: DEFAULT_MEMORY_PERCENTAGE_NAME.to_owned(),
            cores: DEFAULT_CORES_NAME.to_owned(),
            priority: DEFAULT_PRIORITY_NAME.to_owned(),
        }
    }
}

impl ResourceNames {
    /// The ResourceQuota keys HAMi tracks (contract §5.7): `limits.<memory>` and `limits.<cores>`.
    pub fn quota_keys(&self) -> (String, String) {
        (
            format!("limits.{}", self.memory),
            format!("limits.{}", self.cores),
        )
    }
}

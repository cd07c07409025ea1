//! Fit reasons (`pkg/device/common/common.go`) and how HAMi joins them into one node's reason.

use std::collections::BTreeMap;

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
/// A `mig` GPU has no allowed profile with enough memory and a free placement (HAMi v2.10).
pub const CARD_MIG_TOPOLOGY_INFEASIBLE: &str = "CardMigTopologyInfeasible";
pub const NODE_INSUFFICIENT_DEVICE: &str = "NodeInsufficientDevice";
pub const ALLOCATED_CARDS_INSUFFICIENT_REQUEST: &str = "AllocatedCardsInsufficientRequest";
pub const RESOURCE_QUOTA_NOT_FIT: &str = "ResourceQuotaNotFit";

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

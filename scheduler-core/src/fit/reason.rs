//! Fit reasons (`pkg/device/common/common.go`) and how HAMi joins them into one node's reason:
//! [`FitReason`] is one reason, [`ReasonCounts`] the per-reason device counts of a refusal, and
//! [`FitFailure`] why a pod does not fit a node, whose `Display` is HAMi's reason string.

use std::fmt;

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

/// One of HAMi's fit reasons.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FitReason {
    CardTypeMismatch,
    CardUuidMismatch,
    CardTimeSlicingExhausted,
    CardComputeUnitsExhausted,
    CardInsufficientMemory,
    CardInsufficientCore,
    CardNotHealth,
    CardCordoned,
    NumaNotFit,
    ExclusiveDeviceAllocateConflict,
    CardNotFoundCustomFilterRule,
    CardMigTopologyInfeasible,
    NodeInsufficientDevice,
    AllocatedCardsInsufficientRequest,
    ResourceQuotaNotFit,
}

impl FitReason {
    /// How many reasons there are.
    pub const COUNT: usize = 15;

    /// Every reason, in declaration order (the index of [`ReasonCounts`]).
    pub const ALL: [FitReason; Self::COUNT] = [
        FitReason::CardTypeMismatch,
        FitReason::CardUuidMismatch,
        FitReason::CardTimeSlicingExhausted,
        FitReason::CardComputeUnitsExhausted,
        FitReason::CardInsufficientMemory,
        FitReason::CardInsufficientCore,
        FitReason::CardNotHealth,
        FitReason::CardCordoned,
        FitReason::NumaNotFit,
        FitReason::ExclusiveDeviceAllocateConflict,
        FitReason::CardNotFoundCustomFilterRule,
        FitReason::CardMigTopologyInfeasible,
        FitReason::NodeInsufficientDevice,
        FitReason::AllocatedCardsInsufficientRequest,
        FitReason::ResourceQuotaNotFit,
    ];

    /// HAMi's name of the reason.
    pub const fn as_str(self) -> &'static str {
        match self {
            FitReason::CardTypeMismatch => CARD_TYPE_MISMATCH,
            FitReason::CardUuidMismatch => CARD_UUID_MISMATCH,
            FitReason::CardTimeSlicingExhausted => CARD_TIME_SLICING_EXHAUSTED,
            FitReason::CardComputeUnitsExhausted => CARD_COMPUTE_UNITS_EXHAUSTED,
            FitReason::CardInsufficientMemory => CARD_INSUFFICIENT_MEMORY,
            FitReason::CardInsufficientCore => CARD_INSUFFICIENT_CORE,
            FitReason::CardNotHealth => CARD_NOT_HEALTH,
            FitReason::CardCordoned => CARD_CORDONED,
            FitReason::NumaNotFit => NUMA_NOT_FIT,
            FitReason::ExclusiveDeviceAllocateConflict => EXCLUSIVE_DEVICE_ALLOCATE_CONFLICT,
            FitReason::CardNotFoundCustomFilterRule => CARD_NOT_FOUND_CUSTOM_FILTER_RULE,
            FitReason::CardMigTopologyInfeasible => CARD_MIG_TOPOLOGY_INFEASIBLE,
            FitReason::NodeInsufficientDevice => NODE_INSUFFICIENT_DEVICE,
            FitReason::AllocatedCardsInsufficientRequest => ALLOCATED_CARDS_INSUFFICIENT_REQUEST,
            FitReason::ResourceQuotaNotFit => RESOURCE_QUOTA_NOT_FIT,
        }
    }
}

impl FitReason {
    /// What the reason means, for a person reading why a pod is pending.
    pub const fn meaning(self) -> &'static str {
        match self {
            FitReason::CardTypeMismatch => {
                "the GPU's model is not one the pod allows (nvidia.com/use-gputype, nouse-gputype)"
            }
            FitReason::CardUuidMismatch => {
                "the GPU is not one the pod allows (nvidia.com/use-gpuuuid, nouse-gpuuuid)"
            }
            FitReason::CardTimeSlicingExhausted => {
                "every share of the GPU is taken (deviceSplitCount pods already use it)"
            }
            FitReason::CardComputeUnitsExhausted => {
                "the GPU's SMs are fully booked, or the pod asks for the whole GPU (gpucores: 100) \
                 and others use it"
            }
            FitReason::CardInsufficientMemory => "not enough GPU memory left unbooked on the GPU",
            FitReason::CardInsufficientCore => "not enough SM percentage left unbooked on the GPU",
            FitReason::CardNotHealth => "the device plugin reports the GPU unhealthy",
            FitReason::CardCordoned => "the GPU is cordoned (hami.io/device-cordon)",
            FitReason::NumaNotFit => {
                "the GPUs that fit are not on one NUMA node (nvidia.com/numa-bind)"
            }
            FitReason::ExclusiveDeviceAllocateConflict => {
                "the GPU is held exclusively by another pod, or the pod wants it exclusively"
            }
            FitReason::CardNotFoundCustomFilterRule => "no GPU matches the pod's filter rules",
            FitReason::CardMigTopologyInfeasible => {
                "no allowed MIG profile with enough memory has a free placement on the GPU"
            }
            FitReason::NodeInsufficientDevice => {
                "the node has fewer usable GPUs than the pod asks for"
            }
            FitReason::AllocatedCardsInsufficientRequest => {
                "too few of the node's GPUs fit the pod's request together"
            }
            FitReason::ResourceQuotaNotFit => {
                "the namespace's GPU ResourceQuota has no room for the pod"
            }
        }
    }

    /// The reason named `name` (HAMi's name).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.as_str() == name)
    }
}

impl fmt::Display for FitReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How many devices refused for each reason, out of `total` devices examined (a `mig` GPU may
/// refuse several of a container's devices, so a count can exceed the total). Fixed size, on the
/// stack: a refusal is built for every node that does not fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct ReasonCounts {
    counts: [u32; FitReason::COUNT],
    total: u32,
}

fn saturating_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

impl ReasonCounts {
    /// No reason yet, out of `total` devices.
    pub fn over(total: usize) -> Self {
        ReasonCounts {
            counts: [0; FitReason::COUNT],
            total: saturating_u32(total),
        }
    }

    /// One more device refused for `reason`.
    pub fn bump(&mut self, reason: FitReason) {
        self.add(reason, 1);
    }

    /// `n` more devices refused for `reason`.
    pub fn add(&mut self, reason: FitReason, n: usize) {
        let c = &mut self.counts[reason as usize];
        *c = c.saturating_add(saturating_u32(n));
    }

    /// The same counts out of `total` devices.
    pub fn with_total(self, total: usize) -> Self {
        ReasonCounts {
            total: saturating_u32(total),
            ..self
        }
    }

    /// Devices refused for `reason`.
    pub fn count(&self, reason: FitReason) -> u32 {
        self.counts[reason as usize]
    }

    /// Devices examined.
    pub fn total(&self) -> u32 {
        self.total
    }

    /// The reasons with a count, in declaration order.
    pub fn reasons(&self) -> impl Iterator<Item = (FitReason, u32)> + '_ {
        FitReason::ALL
            .iter()
            .zip(&self.counts)
            .filter(|(_, n)| **n > 0)
            .map(|(r, n)| (*r, *n))
    }
}

impl fmt::Display for ReasonCounts {
    /// HAMi's reason string: `"<count>/<N> <Reason>"` per reason, sorted as strings,
    /// `", "`-joined.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut reasons = self.reasons();
        let Some((r, n)) = reasons.next() else {
            return Ok(());
        };
        let total = self.total;
        if reasons.next().is_none() {
            // One reason (the usual refusal): no sorting, no allocation.
            return write!(f, "{n}/{total} {r}");
        }
        let mut parts: Vec<String> = self
            .reasons()
            .map(|(r, n)| format!("{n}/{total} {r}"))
            .collect();
        parts.sort();
        f.write_str(&parts.join(", "))
    }
}

/// Why a pod (or one of its containers) does not fit a node. `Display` is HAMi's reason string
/// for the node, as kube-scheduler shows it in `FailedNodes`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FitFailure {
    /// The node has no NVIDIA device, or fewer than the container asks for (HAMi writes the
    /// reason without a count).
    #[error("NodeInsufficientDevice")]
    NodeInsufficientDevice,
    /// Every device examined refused; the reasons with their counts.
    #[error("{0}")]
    Devices(ReasonCounts),
    /// The MIG half of `AddResourceUsage` found no instance for a device fit had accepted.
    #[error(
        "AddResourceUsage failed for device {device}: MIG profile and placement allocation failed"
    )]
    MigAllocation { device: String },
}

impl FitFailure {
    /// Whether `reason` is among the reasons of the refusal.
    pub fn has(&self, reason: FitReason) -> bool {
        match self {
            FitFailure::NodeInsufficientDevice => reason == FitReason::NodeInsufficientDevice,
            FitFailure::Devices(c) => c.count(reason) > 0,
            FitFailure::MigAllocation { .. } => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_render_as_hami_joins_them() {
        assert_eq!(
            FitFailure::NodeInsufficientDevice.to_string(),
            "NodeInsufficientDevice"
        );
        let mut c = ReasonCounts::over(12);
        assert_eq!(c.to_string(), "");
        c.add(FitReason::CardNotHealth, 2);
        assert_eq!(FitFailure::Devices(c).to_string(), "2/12 CardNotHealth");
        // Sorted as strings: "10/12 …" before "2/12 …".
        c.add(FitReason::CardCordoned, 10);
        c.bump(FitReason::AllocatedCardsInsufficientRequest);
        assert_eq!(
            c.to_string(),
            "1/12 AllocatedCardsInsufficientRequest, 10/12 CardCordoned, 2/12 CardNotHealth"
        );
        assert!(FitFailure::Devices(c).has(FitReason::CardCordoned));
        assert!(!FitFailure::Devices(c).has(FitReason::NumaNotFit));
        for r in FitReason::ALL {
            assert_eq!(FitReason::ALL[r as usize], r);
        }
    }
}

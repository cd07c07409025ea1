//! User annotations that steer scheduling (contract §3.3, §2.5), parsed into typed values.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use crate::annotations;
use crate::node::parse_go_bool;

/// One GPU-level policy of `hami.io/gpu-scheduler-policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GpuPolicy {
    /// `binpack`: fill the most-used GPU first.
    Binpack,
    /// `spread`: use the least-used GPU first (HAMi chart default).
    Spread,
    /// `topology-aware`: pick GPU sets with the best pair scores (`hami.io/node-nvidia-score`).
    TopologyAware,
    /// `mutex`: only GPUs with no other tenant.
    Mutex,
    /// `numa`: NUMA node as a sort key (tie-breaker in a chain).
    Numa,
}

impl GpuPolicy {
    /// The annotation spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            GpuPolicy::Binpack => "binpack",
            GpuPolicy::Spread => "spread",
            GpuPolicy::TopologyAware => "topology-aware",
            GpuPolicy::Mutex => "mutex",
            GpuPolicy::Numa => "numa",
        }
    }

    /// Every policy, in documentation order.
    pub const ALL: [GpuPolicy; 5] = [
        GpuPolicy::Binpack,
        GpuPolicy::Spread,
        GpuPolicy::TopologyAware,
        GpuPolicy::Mutex,
        GpuPolicy::Numa,
    ];

    /// Parses one exact (case-sensitive) policy name.
    pub fn parse(item: &str) -> Option<Self> {
        GpuPolicy::ALL.into_iter().find(|p| p.as_str() == item)
    }
}

impl fmt::Display for GpuPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `hami.io/gpu-scheduler-policy`: one policy or a comma chain (`binpack,numa`), in written
/// order. Duplicates are kept as written (the sort removes them).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GpuPolicyChain(pub Vec<GpuPolicy>);

impl GpuPolicyChain {
    /// Parses `binpack`, `spread,numa`, … Items are trimmed and empty items skipped; an unknown
    /// item is an error naming it (HAMi silently falls back to spread ordering, see
    /// `docs/contract-deviations.md`); a value with no item at all is an error.
    pub fn parse(value: &str) -> Result<Self, AnnotationError> {
        let mut chain = Vec::new();
        for item in value.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let policy = GpuPolicy::parse(item).ok_or_else(|| AnnotationError::GpuPolicy {
                value: value.to_owned(),
                item: item.to_owned(),
            })?;
            chain.push(policy);
        }
        if chain.is_empty() {
            return Err(AnnotationError::GpuPolicy {
                value: value.to_owned(),
                item: String::new(),
            });
        }
        Ok(GpuPolicyChain(chain))
    }

    /// True when the chain contains `policy`.
    pub fn contains(&self, policy: GpuPolicy) -> bool {
        self.0.contains(&policy)
    }
}

impl FromStr for GpuPolicyChain {
    type Err = AnnotationError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        GpuPolicyChain::parse(s)
    }
}

impl fmt::Display for GpuPolicyChain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            f.write_str(p.as_str())?;
        }
        Ok(())
    }
}

/// `hami.io/node-scheduler-policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NodePolicy {
    /// `binpack`: the most-used node first (chart default).
    Binpack,
    /// `spread`: the least-used node first.
    Spread,
}

impl NodePolicy {
    /// The annotation spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            NodePolicy::Binpack => "binpack",
            NodePolicy::Spread => "spread",
        }
    }

    /// HAMi's reading: `spread` is spread, anything else behaves as binpack. The second value is
    /// true when the input was neither `binpack` nor `spread` (worth a warning).
    pub fn parse_lenient(value: &str) -> (NodePolicy, bool) {
        match value {
            "spread" => (NodePolicy::Spread, false),
            "binpack" => (NodePolicy::Binpack, false),
            _ => (NodePolicy::Binpack, true),
        }
    }
}

impl fmt::Display for NodePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `hami.io/device-scoring-weights` (v2.10): weights of the slot, core and memory terms of the
/// device score.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ScoringWeights {
    /// Weight of `(requests + Used) / Count`.
    pub slot: u32,
    /// Weight of `(cores + Usedcores) / Totalcore`.
    pub core: u32,
    /// Weight of `(mem + Usedmem) / Totalmem`.
    pub memory: u32,
}

impl Default for ScoringWeights {
    /// All 1: HAMi's score before v2.10.
    fn default() -> Self {
        ScoringWeights {
            slot: 1,
            core: 1,
            memory: 1,
        }
    }
}

impl ScoringWeights {
    /// HAMi's `ParseDeviceScoringWeights`, rule for rule: exactly three comma-separated
    /// `key=value` entries (whitespace around entries, keys and values trimmed); keys `slot`,
    /// `core`, `memory`, each once; values base-10 integers (`+`/`-` sign allowed), not negative;
    /// not all zero. Values above `u32::MAX` are refused too (HAMi takes int64).
    pub fn parse(value: &str) -> Result<Self, AnnotationError> {
        let err = |problem: String| AnnotationError::ScoringWeights {
            value: value.to_owned(),
            problem,
        };
        let parts: Vec<&str> = value.split(',').collect();
        if parts.len() != 3 {
            return Err(err("expected slot, core, and memory weights".into()));
        }
        let (mut slot, mut core, mut memory) = (None, None, None);
        for part in parts {
            let Some((key, weight)) = part.trim().split_once('=') else {
                return Err(err("expected key=value entries".into()));
            };
            let key = key.trim();
            // HAMi's check order: duplicate, integer, sign, then the key name.
            let seen = match key {
                "slot" => slot.is_some(),
                "core" => core.is_some(),
                "memory" => memory.is_some(),
                _ => false,
            };
            if seen {
                return Err(err(format!("duplicate {key:?} weight")));
            }
            let w = parse_go_int(weight.trim())
                .ok_or_else(|| err(format!("{key:?} weight must be an integer")))?;
            if w < 0 {
                return Err(err(format!("{key:?} weight must not be negative")));
            }
            let target = match key {
                "slot" => &mut slot,
                "core" => &mut core,
                "memory" => &mut memory,
                _ => return Err(err(format!("unknown weight {key:?}"))),
            };
            let w =
                u32::try_from(w).map_err(|_| err(format!("{key:?} weight {w} is too large")))?;
            *target = Some(w);
        }
        let (Some(slot), Some(core), Some(memory)) = (slot, core, memory) else {
            return Err(err("expected slot, core, and memory weights".into()));
        };
        if slot == 0 && core == 0 && memory == 0 {
            return Err(err("at least one weight must be positive".into()));
        }
        Ok(ScoringWeights { slot, core, memory })
    }
}

/// Go's `strconv.ParseInt(s, 10, 64)`.
fn parse_go_int(s: &str) -> Option<i64> {
    let digits = s.strip_prefix(['+', '-']).unwrap_or(s);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse::<i64>().ok()
}

impl fmt::Display for ScoringWeights {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "slot={},core={},memory={}",
            self.slot, self.core, self.memory
        )
    }
}

/// A user annotation the scheduler refuses (HAMi's Filter returns an error for these).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AnnotationError {
    /// `hami.io/device-scoring-weights` breaks one of its rules; `problem` says which.
    #[error("invalid hami.io/device-scoring-weights annotation {value:?}: {problem}")]
    ScoringWeights {
        /// The annotation value.
        value: String,
        /// HAMi's wording of the broken rule.
        problem: String,
    },
    /// `hami.io/gpu-scheduler-policy` has an unknown item (empty `item`: no item at all).
    #[error(
        "invalid hami.io/gpu-scheduler-policy annotation {value:?}: unknown policy {item:?}; expected binpack, spread, topology-aware, mutex or numa, or a comma-separated chain of them (e.g. binpack,numa)"
    )]
    GpuPolicy {
        /// The annotation value.
        value: String,
        /// The offending item.
        item: String,
    },
}

/// A user annotation HAMi tolerates by falling back to a default; the user should hear of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AnnotationWarning {
    /// `hami.io/node-scheduler-policy` was neither `binpack` nor `spread`; binpack is used.
    UnknownNodePolicy {
        /// The annotation value.
        value: String,
    },
    /// `nvidia.com/numa-bind` was not a Go boolean; false is used.
    InvalidNumaBind {
        /// The annotation value.
        value: String,
    },
}

impl fmt::Display for AnnotationWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AnnotationWarning::UnknownNodePolicy { value } => write!(
                f,
                "{}={value:?} is neither \"binpack\" nor \"spread\"; binpack is used",
                annotations::NODE_SCHEDULER_POLICY
            ),
            AnnotationWarning::InvalidNumaBind { value } => write!(
                f,
                "{}={value:?} is not a boolean (true/false, 1/0, t/f); false is used",
                annotations::NUMA_BIND
            ),
        }
    }
}

/// Everything a pod's annotations say about where its GPUs may go and how they are chosen.
/// `Default` is a pod without any of these annotations.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodSchedulingOptions {
    /// `nvidia.com/use-gpuuuid`: only these UUIDs (empty = no constraint).
    pub use_uuid: Vec<String>,
    /// `nvidia.com/nouse-gpuuuid`: never these UUIDs.
    pub nouse_uuid: Vec<String>,
    /// `nvidia.com/use-gputype`: the device type must contain one of these (case-insensitive);
    /// empty = no constraint.
    pub use_type: Vec<String>,
    /// `nvidia.com/nouse-gputype`: the device type must contain none of these.
    pub nouse_type: Vec<String>,
    /// `nvidia.com/vgpu-mode`: the device mode must be a substring of this value.
    pub vgpu_mode: Option<String>,
    /// `nvidia.com/numa-bind`: all GPUs of a container on one NUMA node.
    pub numa_bind: bool,
    /// `hami.io/gpu-scheduler-policy`; `None` = the scheduler's `--gpu-scheduler-policy`.
    pub gpu_policy: Option<GpuPolicyChain>,
    /// `hami.io/node-scheduler-policy`; `None` = the scheduler's `--node-scheduler-policy`.
    pub node_policy: Option<NodePolicy>,
    /// `hami.io/device-scoring-weights` (default all 1).
    pub scoring_weights: ScoringWeights,
    /// Values HAMi tolerates but the user should hear about.
    pub warnings: Vec<AnnotationWarning>,
}

/// Comma-separated list, items trimmed, empty items dropped.
fn comma_list(value: &str) -> Vec<String> {
    value
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

impl PodSchedulingOptions {
    /// Reads every scheduling annotation of a pod. Errors for an invalid
    /// `device-scoring-weights` (as HAMi) and for an unknown GPU policy (Tessera; HAMi falls back
    /// to spread). An empty or whitespace-only policy annotation counts as absent.
    pub fn from_annotations(a: &BTreeMap<String, String>) -> Result<Self, AnnotationError> {
        let mut o = PodSchedulingOptions::default();
        let get = |k: &str| a.get(k).map(String::as_str);
        if let Some(v) = get(annotations::USE_GPU_UUID) {
            o.use_uuid = comma_list(v);
        }
        if let Some(v) = get(annotations::NOUSE_GPU_UUID) {
            o.nouse_uuid = comma_list(v);
        }
        if let Some(v) = get(annotations::USE_GPU_TYPE) {
            o.use_type = comma_list(v);
        }
        if let Some(v) = get(annotations::NOUSE_GPU_TYPE) {
            o.nouse_type = comma_list(v);
        }
        o.vgpu_mode = get(annotations::VGPU_MODE).map(str::to_owned);
        if let Some(v) = get(annotations::NUMA_BIND) {
            match parse_go_bool(v) {
                Some(b) => o.numa_bind = b,
                None => o.warnings.push(AnnotationWarning::InvalidNumaBind {
                    value: v.to_owned(),
                }),
            }
        }
        if let Some(v) = get(annotations::GPU_SCHEDULER_POLICY).filter(|v| !v.trim().is_empty()) {
            o.gpu_policy = Some(GpuPolicyChain::parse(v)?);
        }
        if let Some(v) = get(annotations::NODE_SCHEDULER_POLICY).filter(|v| !v.trim().is_empty()) {
            let (policy, unknown) = NodePolicy::parse_lenient(v);
            if unknown {
                o.warnings.push(AnnotationWarning::UnknownNodePolicy {
                    value: v.to_owned(),
                });
            }
            o.node_policy = Some(policy);
        }
        if let Some(v) = get(annotations::DEVICE_SCORING_WEIGHTS) {
            o.scoring_weights = ScoringWeights::parse(v)?;
        }
        Ok(o)
    }

    /// The UUID selectors (`CardUuidMismatch` when false): in `use_uuid` if that is non-empty,
    /// and not in `nouse_uuid`.
    pub fn uuid_allowed(&self, uuid: &str) -> bool {
        (self.use_uuid.is_empty() || self.use_uuid.iter().any(|u| u == uuid))
            && !self.nouse_uuid.iter().any(|u| u == uuid)
    }

    /// The type selectors (`CardTypeMismatch` when false): case-insensitive substring match of
    /// the device `type` (e.g. `NVIDIA-Tesla T4`) against `use_type` / `nouse_type`.
    pub fn type_allowed(&self, device_type: &str) -> bool {
        (self.use_type.is_empty()
            || self
                .use_type
                .iter()
                .any(|u| contains_ignore_case(device_type, u)))
            && !self
                .nouse_type
                .iter()
                .any(|u| contains_ignore_case(device_type, u))
    }

    /// `nvidia.com/vgpu-mode`: the device mode (`hami-core`, `mig`, `mps`) must be a substring of
    /// the annotation value; no annotation = any mode.
    pub fn mode_allowed(&self, device_mode: &str) -> bool {
        self.vgpu_mode
            .as_deref()
            .is_none_or(|m| m.contains(device_mode))
    }
}

/// Go's `strings.Contains(strings.ToUpper(h), strings.ToUpper(n))`, without allocating for the
/// ASCII names GPUs have (the scheduler calls this per GPU per candidate node).
fn contains_ignore_case(haystack: &str, needle: &str) -> bool {
    if haystack.is_ascii() && needle.is_ascii() {
        needle.is_empty()
            || haystack
                .as_bytes()
                .windows(needle.len())
                .any(|w| w.eq_ignore_ascii_case(needle.as_bytes()))
    } else {
        haystack.to_uppercase().contains(&needle.to_uppercase())
    }
}

/// `hami.io/device-cordon` on a node: GPU UUIDs excluded from new allocations (Fit reason
/// `CardCordoned`). Comma-separated, whitespace trimmed, empty items skipped.
pub fn parse_device_cordon(value: &str) -> Vec<String> {
    comma_list(value)
}

#[cfg(test)]
mod type_match_tests {
    use super::contains_ignore_case;

    #[test]
    fn case_insensitive_substring_as_go_upper_contains() {
        assert!(contains_ignore_case("NVIDIA-Tesla T4", "t4"));
        assert!(contains_ignore_case("NVIDIA A100-SXM4-40GB", "a100"));
        assert!(!contains_ignore_case("NVIDIA-Tesla T4", "A100"));
        assert!(contains_ignore_case("T4", ""));
        assert!(!contains_ignore_case("T4", "Tesla T4"));
        // Non-ASCII falls back to Unicode upper-casing, as Go's ToUpper.
        assert!(contains_ignore_case("Gerät-ä", "ät-Ä"));
    }
}

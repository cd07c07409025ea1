//! Dynamic MIG as HAMi v2.10 writes it (contract §2.1 `migProfiles`, contract §6.4): the MIG profiles a
//! node registers, the reservation the scheduler writes into `hami.io/vgpu-mig-allocations`, and
//! the `migProfileAllowlist` policy ([`crate::config::validate_allowlist`]).
//!
//! HAMi v2.10's model is reservation-first: the device plugin publishes, per GPU in `mig`
//! operating mode, the allowed profiles with the placements NVML reports; the scheduler picks a
//! profile and a free placement for each requested device and writes them into the pod; the
//! device plugin carves exactly that instance at `Allocate` and adds its runtime identity (MIG
//! UUID, GPU-instance and compute-instance ids) to the same annotation.

use serde::{Deserialize, Serialize};

/// Where a GPU instance sits: memory slices `start .. start + size` (NVML's placement).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
pub struct MigPlacement {
    pub start: u32,
    pub size: u32,
}

impl MigPlacement {
    /// Whether two placements share a memory slice (HAMi's `migPlacementsOverlap`).
    pub fn overlaps(&self, other: &MigPlacement) -> bool {
        u64::from(self.start) < u64::from(other.start) + u64::from(other.size)
            && u64::from(other.start) < u64::from(self.start) + u64::from(self.size)
    }
}

/// One MIG profile of a GPU as registered in `migProfiles` (HAMi's `device.MigProfile`; the JSON
/// keys in HAMi's order).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigProfile {
    /// NVIDIA's profile name, e.g. `1g.10gb`.
    pub name: String,
    /// Memory of one instance, MiB, as NVML reports it (less than the name says).
    #[serde(rename = "memoryMB")]
    pub memory_mb: u32,
    /// Percent of the GPU's multiprocessors, rounded up ([`profile_core`]).
    pub core: u32,
    /// Memory slices of one instance.
    #[serde(rename = "sliceCount")]
    pub slice_count: u32,
    /// Every placement NVML allows for the profile on an empty GPU.
    #[serde(default)]
    pub placements: Vec<MigPlacement>,
}

/// A profile's `core`: its multiprocessors as a percentage of the largest profile's, rounded up,
/// as HAMi's `discoverMigProfiles` computes it. 0 when the GPU reported no multiprocessors.
pub fn profile_core(multiprocessors: u32, full_gpu_multiprocessors: u32) -> u32 {
    if full_gpu_multiprocessors == 0 {
        return 0;
    }
    let full = u64::from(full_gpu_multiprocessors);
    let pct = (u64::from(multiprocessors) * 100).div_ceil(full);
    u32::try_from(pct).unwrap_or(u32::MAX)
}

/// Why `migProfiles` of a register annotation could not be read as profiles.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("migProfiles entry {index}: {problem}")]
pub struct MigProfileError {
    pub index: usize,
    pub problem: String,
}

/// Reads the `migProfiles` of a registered device ([`crate::NodeDevice::mig_profiles`]).
pub fn decode_profiles(values: &[serde_json::Value]) -> Result<Vec<MigProfile>, MigProfileError> {
    values
        .iter()
        .enumerate()
        .map(|(index, v)| {
            MigProfile::deserialize(v).map_err(|e| MigProfileError {
                index,
                problem: e.to_string(),
            })
        })
        .collect()
}

/// The `migProfiles` values for a registered device, in HAMi's key order once serialized.
pub fn encode_profiles(profiles: &[MigProfile]) -> Vec<serde_json::Value> {
    profiles
        .iter()
        .filter_map(|p| serde_json::to_value(p).ok())
        .collect()
}

/// One entry of `hami.io/vgpu-mig-allocations` (HAMi's `MigAllocation`): the scheduler's
/// reservation for one device of one container, and, once the device plugin has carved it, the
/// instance's runtime identity.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigAllocation {
    /// Position of the container: init containers first, then app containers.
    #[serde(rename = "containerIndex")]
    pub container_index: u32,
    /// Position of the device in the container's device list.
    #[serde(rename = "deviceIndex")]
    pub device_index: u32,
    /// The parent GPU.
    #[serde(rename = "gpuUUID")]
    pub gpu_uuid: String,
    pub profile: String,
    pub placement: MigPlacement,
    #[serde(rename = "migUUID", default, skip_serializing_if = "String::is_empty")]
    pub mig_uuid: String,
    #[serde(
        rename = "gpuInstanceID",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub gpu_instance_id: Option<u32>,
    #[serde(
        rename = "computeInstanceID",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub compute_instance_id: Option<u32>,
}

impl MigAllocation {
    /// Whether the device plugin has recorded the carved instance (all three runtime fields).
    pub fn is_realized(&self) -> bool {
        !self.mig_uuid.is_empty()
            && self.gpu_instance_id.is_some()
            && self.compute_instance_id.is_some()
    }
}

/// Why `hami.io/vgpu-mig-allocations` was refused (HAMi's `DecodeMigAllocations` checks).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MigAllocationError {
    #[error("hami.io/vgpu-mig-allocations is not a JSON list of allocations: {0}")]
    Json(String),
    #[error(
        "MIG allocation {0} is incomplete (gpuUUID, profile and a placement of size > 0 are required)"
    )]
    Incomplete(usize),
    #[error(
        "MIG allocation {0} has partial runtime identity (migUUID, gpuInstanceID and computeInstanceID go together)"
    )]
    PartialRuntime(usize),
    #[error("duplicate MIG allocation for container {container} device {device}")]
    Duplicate { container: u32, device: u32 },
}

/// Decodes `hami.io/vgpu-mig-allocations`. An empty value is no allocations.
pub fn decode_allocations(raw: &str) -> Result<Vec<MigAllocation>, MigAllocationError> {
    if raw.is_empty() {
        return Ok(Vec::new());
    }
    let out: Vec<MigAllocation> =
        serde_json::from_str(raw).map_err(|e| MigAllocationError::Json(e.to_string()))?;
    let mut seen = std::collections::HashSet::with_capacity(out.len());
    for (i, a) in out.iter().enumerate() {
        if a.gpu_uuid.is_empty() || a.profile.is_empty() || a.placement.size == 0 {
            return Err(MigAllocationError::Incomplete(i));
        }
        let runtime = usize::from(!a.mig_uuid.is_empty())
            + usize::from(a.gpu_instance_id.is_some())
            + usize::from(a.compute_instance_id.is_some());
        if runtime != 0 && runtime != 3 {
            return Err(MigAllocationError::PartialRuntime(i));
        }
        if !seen.insert((a.container_index, a.device_index)) {
            return Err(MigAllocationError::Duplicate {
                container: a.container_index,
                device: a.device_index,
            });
        }
    }
    Ok(out)
}

/// Encodes `hami.io/vgpu-mig-allocations` (keys in HAMi's order, runtime fields only when set).
pub fn encode_allocations(allocations: &[MigAllocation]) -> String {
    serde_json::to_string(allocations).unwrap_or_else(|_| "[]".to_owned())
}

/// The memory-slice group of a profile name (`1g` of `1g.10gb`), HAMi's `profileSliceKey`.
pub fn slice_group(profile: &str) -> &str {
    match profile.find('.') {
        Some(i) if i > 0 => &profile[..i],
        _ => profile,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alloc(c: u32, d: u32) -> MigAllocation {
        MigAllocation {
            container_index: c,
            device_index: d,
            gpu_uuid: "GPU-a".into(),
            profile: "1g.10gb".into(),
            placement: MigPlacement { start: 6, size: 1 },
            ..MigAllocation::default()
        }
    }

    #[test]
    fn allocations_encode_in_hamis_key_order_and_round_trip() {
        let mut a = alloc(0, 0);
        assert_eq!(
            encode_allocations(std::slice::from_ref(&a)),
            r#"[{"containerIndex":0,"deviceIndex":0,"gpuUUID":"GPU-a","profile":"1g.10gb","placement":{"start":6,"size":1}}]"#
        );
        a.mig_uuid = "MIG-x".into();
        a.gpu_instance_id = Some(7);
        a.compute_instance_id = Some(0);
        let raw = encode_allocations(std::slice::from_ref(&a));
        assert_eq!(
            raw,
            r#"[{"containerIndex":0,"deviceIndex":0,"gpuUUID":"GPU-a","profile":"1g.10gb","placement":{"start":6,"size":1},"migUUID":"MIG-x","gpuInstanceID":7,"computeInstanceID":0}]"#
        );
        assert_eq!(decode_allocations(&raw), Ok(vec![a]));
    }

    #[test]
    fn allocations_are_refused_as_hamis_decoder_refuses_them() {
        // pkg/device/nvidia/mig_allocations.go, DecodeMigAllocations.
        assert_eq!(decode_allocations(""), Ok(vec![]));
        assert!(matches!(
            decode_allocations("{"),
            Err(MigAllocationError::Json(_))
        ));
        let mut bad = alloc(0, 0);
        bad.placement.size = 0;
        assert_eq!(
            decode_allocations(&encode_allocations(&[bad])),
            Err(MigAllocationError::Incomplete(0))
        );
        let mut partial = alloc(0, 0);
        partial.mig_uuid = "MIG-x".into();
        assert_eq!(
            decode_allocations(&encode_allocations(&[partial])),
            Err(MigAllocationError::PartialRuntime(0))
        );
        assert_eq!(
            decode_allocations(&encode_allocations(&[alloc(1, 0), alloc(1, 0)])),
            Err(MigAllocationError::Duplicate {
                container: 1,
                device: 0
            })
        );
        assert!(decode_allocations(r#"[{"containerIndex":-1}]"#).is_err());
    }

    #[test]
    fn profiles_keep_hamis_key_order_in_the_register_annotation() {
        let p = MigProfile {
            name: "1g.5gb".into(),
            memory_mb: 4864,
            core: 15,
            slice_count: 1,
            placements: vec![MigPlacement { start: 6, size: 1 }],
        };
        let dev = crate::NodeDevice {
            id: "GPU-a".into(),
            mode: "mig".into(),
            mig_profiles: encode_profiles(std::slice::from_ref(&p)),
            health: true,
            ..crate::NodeDevice::default()
        };
        let json = serde_json::to_string(&dev).unwrap_or_default();
        assert!(json.contains(
            r#""migProfiles":[{"name":"1g.5gb","memoryMB":4864,"core":15,"sliceCount":1,"placements":[{"start":6,"size":1}]}]"#
        ), "{json}");
        assert_eq!(decode_profiles(&dev.mig_profiles), Ok(vec![p]));
        assert!(decode_profiles(&[serde_json::json!({"name": 3})]).is_err());
    }

    #[test]
    fn core_is_the_multiprocessor_share_rounded_up() {
        // A100: 1g has 14 of 98 SMs ⇒ 15 %, 3g 42 ⇒ 43 %, 7g 98 ⇒ 100 %.
        assert_eq!(profile_core(14, 98), 15);
        assert_eq!(profile_core(42, 98), 43);
        assert_eq!(profile_core(98, 98), 100);
        assert_eq!(profile_core(14, 0), 0);
        assert_eq!(slice_group("1g.10gb+me"), "1g");
        assert_eq!(slice_group("7g"), "7g");
    }

    #[test]
    fn placements_overlap_like_hamis_rule() {
        let p = |start, size| MigPlacement { start, size };
        assert!(p(0, 4).overlaps(&p(2, 2)));
        assert!(!p(0, 4).overlaps(&p(4, 4)));
        assert!(!p(6, 1).overlaps(&p(4, 2)));
        assert!(!p(u32::MAX, u32::MAX).overlaps(&p(0, 1)));
    }
}

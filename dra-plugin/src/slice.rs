//! This node's GPUs as the devices of its ResourceSlice. Pure: the caller supplies the GPUs, their
//! health and whether the API server keeps consumable-capacity fields.
//!
//! One device per GPU, named `gpu-<index>`. Attributes (in the driver's domain, so a CEL selector
//! reads `device.attributes["gpu.tessera.dev"].productName`): `uuid`, `index`, `productName`,
//! `pciBusID`, `numaNode` (when known), `cudaComputeCapability` and `driverVersion` (semantic
//! versions, when known), `nvlinkDomain` (for GPUs with NVLink: a claim's `matchAttribute` on it
//! keeps its shares on GPUs that reach each other over NVLink), `type` = `gpu`. Capacity: `memory` in bytes and `cores` = 100 (percent).
//!
//! With [`Sharing::Consumable`] a device allows multiple allocations and each capacity has a
//! request policy: memory in steps of 1 MiB from 1 MiB (a claim that asks for none takes all of
//! it), cores in steps of 1 from 1 to 100 (a claim that asks for none takes 100). With
//! [`Sharing::Exclusive`] (the API server's `DRAConsumableCapacity` gate is off) a device is
//! allocated whole, to one claim at a time.
//!
//! An unhealthy GPU is left out of the slice, so nothing new is allocated on it; claims already
//! allocated there keep running (health is not a scheduling input for them).

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceAttribute, DeviceCapacity,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::{CORES, MEMORY};
use tessera_node::gpu::GpuInfo;

/// How the devices of the slice may be shared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sharing {
    /// Several claims each consume part of a GPU's memory and cores (`DRAConsumableCapacity`).
    Consumable,
    /// One claim takes a whole GPU.
    Exclusive,
}

/// What NVML says about one GPU beyond [`GpuInfo`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GpuFacts {
    /// CUDA compute capability (major, minor).
    pub compute_capability: Option<(u32, u32)>,
    /// The GPU's NVLink domain: GPUs with the same one reach each other over NVLink
    /// ([`hami_contract::topology::NodeTopology::nvlink_domains`]).
    pub nvlink_domain: Option<u32>,
}

/// A GPU the slice can offer, or why it cannot.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unpublishable {
    #[error("GPU {uuid} is in MIG mode; the DRA driver offers whole GPUs and shares of them only")]
    Mig { uuid: String },
    #[error("NVML does not report GPU {uuid}'s memory, so no share of it can be offered")]
    UnknownMemory { uuid: String },
}

/// The device name of the GPU with NVML index `index`.
pub fn device_name(index: u32) -> String {
    format!("gpu-{index}")
}

/// A driver version in semantic-version form (`535.104.05` → `535.104.5`, `550.54` →
/// `550.54.0`); `None` when it is not made of two or three numbers.
pub fn semver(version: &str) -> Option<String> {
    let parts: Vec<u64> = version
        .trim()
        .split('.')
        .map(|p| p.parse::<u64>().ok())
        .collect::<Option<_>>()?;
    match parts.as_slice() {
        [a, b] => Some(format!("{a}.{b}.0")),
        [a, b, c] => Some(format!("{a}.{b}.{c}")),
        _ => None,
    }
}

fn string(v: impl Into<String>) -> DeviceAttribute {
    DeviceAttribute {
        string: Some(v.into()),
        ..Default::default()
    }
}

fn int(v: i64) -> DeviceAttribute {
    DeviceAttribute {
        int: Some(v),
        ..Default::default()
    }
}

fn version(v: String) -> DeviceAttribute {
    DeviceAttribute {
        version: Some(v),
        ..Default::default()
    }
}

/// The memory a device offers, as the quantity the slice carries (`<MiB>Mi`).
pub fn memory_quantity(mib: u32) -> Quantity {
    Quantity(format!("{mib}Mi"))
}

/// The device for one GPU.
pub fn gpu_device(
    gpu: &GpuInfo,
    facts: &GpuFacts,
    driver_version: Option<&str>,
    sharing: Sharing,
) -> Result<Device, Unpublishable> {
    if gpu.mig_enabled {
        return Err(Unpublishable::Mig {
            uuid: gpu.uuid.clone(),
        });
    }
    let mib =
        gpu.memory_total_mib
            .filter(|m| *m > 0)
            .ok_or_else(|| Unpublishable::UnknownMemory {
                uuid: gpu.uuid.clone(),
            })?;
    let mut attributes = BTreeMap::from([
        ("uuid".to_owned(), string(&gpu.uuid)),
        ("index".to_owned(), int(i64::from(gpu.index))),
        ("productName".to_owned(), string(&gpu.name)),
        ("pciBusID".to_owned(), string(&gpu.pci_bus_id)),
        ("type".to_owned(), string("gpu")),
    ]);
    if let Some(numa) = gpu.numa_node {
        attributes.insert("numaNode".to_owned(), int(i64::from(numa)));
    }
    if let Some((major, minor)) = facts.compute_capability {
        attributes.insert(
            "cudaComputeCapability".to_owned(),
            version(format!("{major}.{minor}.0")),
        );
    }
    if let Some(domain) = facts.nvlink_domain {
        attributes.insert("nvlinkDomain".to_owned(), int(i64::from(domain)));
    }
    if let Some(v) = driver_version.and_then(semver) {
        attributes.insert("driverVersion".to_owned(), version(v));
    }
    let consumable = sharing == Sharing::Consumable;
    let policy = |default: Quantity, min: &str, max: Option<&str>, step: &str| {
        consumable.then(|| CapacityRequestPolicy {
            default: Some(default),
            valid_range: Some(CapacityRequestPolicyRange {
                min: Quantity(min.to_owned()),
                max: max.map(|m| Quantity(m.to_owned())),
                step: Some(Quantity(step.to_owned())),
            }),
            valid_values: None,
        })
    };
    let capacity = BTreeMap::from([
        (
            MEMORY.to_owned(),
            DeviceCapacity {
                value: memory_quantity(mib),
                request_policy: policy(memory_quantity(mib), "1Mi", None, "1Mi"),
            },
        ),
        (
            CORES.to_owned(),
            DeviceCapacity {
                value: Quantity("100".to_owned()),
                request_policy: policy(Quantity("100".to_owned()), "1", Some("100"), "1"),
            },
        ),
    ]);
    Ok(Device {
        name: device_name(gpu.index),
        attributes: Some(attributes),
        capacity: Some(capacity),
        allow_multiple_allocations: consumable.then_some(true),
        ..Default::default()
    })
}

/// The slice's devices: every healthy GPU that can be offered, in index order, and the GPUs left
/// out with why (unhealthy GPUs are left out silently: health has its own reporting).
pub fn slice_devices(
    gpus: &[(GpuInfo, GpuFacts)],
    driver_version: Option<&str>,
    healthy: &dyn Fn(&str) -> bool,
    sharing: Sharing,
) -> (Vec<Device>, Vec<Unpublishable>) {
    let mut sorted: Vec<&(GpuInfo, GpuFacts)> = gpus.iter().collect();
    sorted.sort_by_key(|(g, _)| g.index);
    let mut devices = Vec::new();
    let mut skipped = Vec::new();
    for (gpu, facts) in sorted {
        if !healthy(&gpu.uuid) {
            continue;
        }
        match gpu_device(gpu, facts, driver_version, sharing) {
            Ok(d) => devices.push(d),
            Err(e) => skipped.push(e),
        }
    }
    (devices, skipped)
}

/// True when the API server dropped the consumable-capacity fields of `sent` from `stored`:
/// its `DRAConsumableCapacity` gate is off, and every device is allocated whole.
pub fn consumable_fields_dropped(sent: &[Device], stored: &[Device]) -> bool {
    sent.iter()
        .any(|d| d.allow_multiple_allocations == Some(true))
        && stored
            .iter()
            .all(|d| d.allow_multiple_allocations.is_none())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(index: u32, mib: Option<u32>) -> GpuInfo {
        GpuInfo {
            uuid: format!("GPU-{index:08}"),
            index,
            name: "NVIDIA H100 80GB HBM3".into(),
            memory_total_mib: mib,
            pci_bus_id: format!("00000000:{:02X}:00.0", 0x18 + index),
            numa_node: Some(index / 4),
            mig_enabled: false,
            mig: None,
        }
    }

    fn facts() -> GpuFacts {
        GpuFacts {
            compute_capability: Some((9, 0)),
            nvlink_domain: Some(0),
        }
    }

    #[test]
    fn a_shareable_gpu_offers_its_memory_and_cores_to_several_claims() {
        let d = gpu_device(
            &gpu(1, Some(81559)),
            &facts(),
            Some("570.133.07"),
            Sharing::Consumable,
        )
        .unwrap();
        assert_eq!(d.name, "gpu-1");
        assert_eq!(d.allow_multiple_allocations, Some(true));
        let attrs = d.attributes.as_ref().unwrap();
        assert_eq!(attrs["uuid"].string.as_deref(), Some("GPU-00000001"));
        assert_eq!(attrs["index"].int, Some(1));
        assert_eq!(
            attrs["cudaComputeCapability"].version.as_deref(),
            Some("9.0.0")
        );
        assert_eq!(attrs["driverVersion"].version.as_deref(), Some("570.133.7"));
        assert_eq!(attrs["numaNode"].int, Some(0));
        assert_eq!(attrs["nvlinkDomain"].int, Some(0));
        let cap = d.capacity.as_ref().unwrap();
        assert_eq!(cap["memory"].value.0, "81559Mi");
        let mem = cap["memory"].request_policy.as_ref().unwrap();
        assert_eq!(mem.default.as_ref().unwrap().0, "81559Mi");
        let range = mem.valid_range.as_ref().unwrap();
        assert_eq!((range.min.0.as_str(), range.max.as_ref()), ("1Mi", None));
        let cores = cap["cores"].request_policy.as_ref().unwrap();
        assert_eq!(
            cores.valid_range.as_ref().unwrap().max.as_ref().unwrap().0,
            "100"
        );
        // The API server's limit: attributes and capacities together at most 32.
        assert!(attrs.len() + cap.len() <= 32);
    }

    #[test]
    fn without_the_gate_a_gpu_is_offered_whole() {
        let d = gpu_device(&gpu(0, Some(15360)), &facts(), None, Sharing::Exclusive).unwrap();
        assert_eq!(d.allow_multiple_allocations, None);
        let cap = d.capacity.unwrap();
        assert!(cap.values().all(|c| c.request_policy.is_none()));
        assert!(!d.attributes.unwrap().contains_key("driverVersion"));
    }

    #[test]
    fn unhealthy_mig_and_memoryless_gpus_are_left_out() {
        let mut mig = gpu(2, Some(40960));
        mig.mig_enabled = true;
        let gpus = vec![
            (gpu(3, Some(15360)), facts()),
            (gpu(0, Some(15360)), facts()),
            (gpu(1, None), facts()),
            (mig, facts()),
            (gpu(4, Some(15360)), facts()),
        ];
        let (devices, skipped) =
            slice_devices(&gpus, None, &|u| u != "GPU-00000004", Sharing::Consumable);
        let names: Vec<&str> = devices.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["gpu-0", "gpu-3"]);
        assert_eq!(skipped.len(), 2);
    }

    #[test]
    fn driver_versions_become_semantic_versions() {
        assert_eq!(semver("535.104.05").as_deref(), Some("535.104.5"));
        assert_eq!(semver("550.54").as_deref(), Some("550.54.0"));
        assert_eq!(semver("r570"), None);
        assert_eq!(semver("1.2.3.4"), None);
    }

    #[test]
    fn a_dropped_allow_multiple_allocations_means_the_gate_is_off() {
        let sent =
            vec![gpu_device(&gpu(0, Some(1024)), &facts(), None, Sharing::Consumable).unwrap()];
        let mut stored = sent.clone();
        assert!(!consumable_fields_dropped(&sent, &stored));
        stored[0].allow_multiple_allocations = None;
        assert!(consumable_fields_dropped(&sent, &stored));
        let exclusive =
            vec![gpu_device(&gpu(0, Some(1024)), &facts(), None, Sharing::Exclusive).unwrap()];
        assert!(!consumable_fields_dropped(&exclusive, &exclusive));
    }
}

//! The metadata the scheduler writes on a pod (contract §3.1), built here so that what the filter
//! and the bind write is decided with the rest, and the daemon only sends it.
//!
//! By default the whole decision travels in the Binding: the API server copies a Binding's
//! `metadata.annotations` onto the pod in the same guarded update that sets `spec.nodeName`
//! (`setPodNodeAndMetadata` in kube-apiserver's pod storage), so the device plugin never sees
//! the pod bound without them, and the filter writes nothing (docs/scheduler.md, "One write per
//! placed pod"). HAMi's order (decision patched at filter, `allocating` patched before the
//! Binding) remains available for clusters that need the decision on unbound pods.

use std::collections::BTreeMap;

use hami_contract::PodDevices;
use hami_contract::annotations as ann;
use hami_contract::mig::MigAllocation;

/// Metadata to merge into a pod (JSON merge patch on `metadata.annotations` / `labels`), or to
/// carry in a Binding's `metadata`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MetadataPatch {
    pub annotations: BTreeMap<String, String>,
    pub labels: BTreeMap<String, String>,
}

/// The decision: node and devices (`hami.io/vgpu-node`, `vgpu-time`, `vgpu-devices-to-allocate`,
/// `vgpu-devices-allocated`, and `vgpu-mig-allocations` when a device is on a `mig` GPU) and
/// the `hami.io/vgpu-node` label. HAMi writes it at filter (`PatchAnnotations`).
pub fn decision_patch(
    node: &str,
    devices: &PodDevices,
    mig: &[MigAllocation],
    unix_now: u64,
) -> MetadataPatch {
    let devices = devices.encode();
    let mut patch = MetadataPatch::default();
    if !mig.is_empty() {
        patch.annotations.insert(
            ann::MIG_ALLOCATIONS.to_owned(),
            hami_contract::mig::encode_allocations(mig),
        );
    }
    patch
        .annotations
        .insert(ann::VGPU_NODE.to_owned(), node.to_owned());
    patch
        .annotations
        .insert(ann::VGPU_TIME.to_owned(), unix_now.to_string());
    patch
        .annotations
        .insert(ann::DEVICES_TO_ALLOCATE.to_owned(), devices.clone());
    patch
        .annotations
        .insert(ann::DEVICES_ALLOCATED.to_owned(), devices);
    patch
        .labels
        .insert(ann::VGPU_NODE.to_owned(), node.to_owned());
    patch
}

/// Sets `hami.io/bind-phase` to `phase` (the bind writes `allocating` or `failed`, the device
/// plugin `success` or `failed`).
pub fn bind_phase_patch(phase: &str) -> MetadataPatch {
    let mut patch = MetadataPatch::default();
    patch
        .annotations
        .insert(ann::BIND_PHASE.to_owned(), phase.to_owned());
    patch
}

/// What the bind writes before (or with) the Binding: the pod is pending allocation since
/// `unix_now`.
pub fn bind_allocating_patch(unix_now: u64) -> MetadataPatch {
    let mut patch = bind_phase_patch(ann::BIND_PHASE_ALLOCATING);
    patch
        .annotations
        .insert(ann::BIND_TIME.to_owned(), unix_now.to_string());
    patch
}

/// Everything the device plugin reads, for the Binding's metadata: the decision and
/// `bind-phase: allocating` with its time. The label is sent too, but the API server copies a
/// Binding's labels only with the `PodTopologyLabelsAdmission` gate (alpha, off, in 1.34).
pub fn binding_metadata(
    node: &str,
    devices: &PodDevices,
    mig: &[MigAllocation],
    unix_now: u64,
) -> MetadataPatch {
    let mut patch = decision_patch(node, devices, mig, unix_now);
    patch
        .annotations
        .extend(bind_allocating_patch(unix_now).annotations);
    patch
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_binding_carries_every_annotation_the_device_plugin_reads() {
        let devices = PodDevices::decode("GPU-a,NVIDIA,1000,10:;").expect("devices");
        let m = binding_metadata("n1", &devices, &[], 42);
        let keys: Vec<&str> = m.annotations.keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            [
                ann::BIND_PHASE,
                ann::BIND_TIME,
                ann::DEVICES_ALLOCATED,
                ann::DEVICES_TO_ALLOCATE,
                ann::VGPU_NODE,
                ann::VGPU_TIME,
            ]
        );
        assert_eq!(m.annotations[ann::BIND_PHASE], ann::BIND_PHASE_ALLOCATING);
        assert_eq!(m.annotations[ann::DEVICES_TO_ALLOCATE], devices.encode());
        assert_eq!(m.annotations[ann::BIND_TIME], "42");
        assert_eq!(m.labels[ann::VGPU_NODE], "n1");
    }

    /// HAMi: `PatchAnnotations` + `EncodeMigAllocations` (pkg/device/nvidia/device.go,
    /// mig_allocations.go): the reservation travels with the devices.
    #[test]
    fn a_mig_decision_carries_its_reservations() {
        let devices = PodDevices::decode("GPU-a,NVIDIA,9856,15:;").expect("devices");
        let mig = [MigAllocation {
            gpu_uuid: "GPU-a".into(),
            profile: "1g.10gb".into(),
            placement: hami_contract::mig::MigPlacement { start: 6, size: 1 },
            ..MigAllocation::default()
        }];
        let m = binding_metadata("n1", &devices, &mig, 42);
        assert_eq!(
            m.annotations[ann::MIG_ALLOCATIONS],
            r#"[{"containerIndex":0,"deviceIndex":0,"gpuUUID":"GPU-a","profile":"1g.10gb","placement":{"start":6,"size":1}}]"#
        );
    }
}

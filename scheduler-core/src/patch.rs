//! The metadata the scheduler writes on a pod (contract §3.1), built here so that what the filter
//! and the bind write is decided with the rest, and the daemon only sends it.

use std::collections::BTreeMap;

use hami_contract::annotations as ann;

use crate::decide::Placement;

/// Metadata to merge into a pod (JSON merge patch on `metadata.annotations` / `labels`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MetadataPatch {
    pub annotations: BTreeMap<String, String>,
    pub labels: BTreeMap<String, String>,
}

/// The annotations and label Filter writes for a placement.
pub fn filter_patch(p: &Placement, unix_now: u64) -> MetadataPatch {
    let devices = p.devices.encode();
    let mut patch = MetadataPatch::default();
    patch
        .annotations
        .insert(ann::VGPU_NODE.to_owned(), p.node.clone());
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
        .insert(ann::VGPU_NODE.to_owned(), p.node.clone());
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

/// What Bind writes before the Binding call: the pod is pending allocation since `unix_now`.
pub fn bind_allocating_patch(unix_now: u64) -> MetadataPatch {
    let mut patch = bind_phase_patch(ann::BIND_PHASE_ALLOCATING);
    patch
        .annotations
        .insert(ann::BIND_TIME.to_owned(), unix_now.to_string());
    patch
}

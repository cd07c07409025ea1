//! MIG (Multi-Instance GPU) through NVML: what a GPU can be carved into, what is carved, and
//! carving and destroying instances.
//!
//! nvml-wrapper 0.13 reads the MIG mode, the GPU-instance profiles and their placements, but it
//! wraps none of the calls on GPU and compute instances. This crate makes those calls through
//! nvml-wrapper's loaded library ([`nvml_wrapper::Nvml::lib`]) and returns plain data, so the
//! device plugin stays free of `unsafe`. The device plugin reaches it through [`MigControl`], which
//! its tests can replace.
//!
//! Terms (NVIDIA's): a GPU instance (GI) owns `size` memory slices starting at slice `start` (its
//! placement); a compute instance (CI) runs inside a GI. Tessera always creates one CI that spans
//! its GI, as NVIDIA's device plugin and HAMi do, so "an instance" below is one GI with its one CI,
//! visible to CUDA as one MIG device with a `MIG-…` UUID.
// Daemon and library code returns errors; only tests may unwrap (clippy.toml allows it there).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

use nvml_wrapper::Nvml;

mod nvml_impl;
pub use nvml_impl::{mig_memory_size_gb, profile_name};

/// Why a MIG call failed.
#[derive(Debug, thiserror::Error)]
pub enum MigError {
    /// An NVML call returned an error code.
    #[error("{call} failed on GPU {gpu_index}: NVML error {code} ({message})")]
    Nvml {
        call: &'static str,
        gpu_index: u32,
        code: u32,
        message: String,
    },
    /// NVML's library does not export a MIG call (an old driver).
    #[error("the loaded NVML library has no {call}")]
    Missing { call: &'static str },
    /// The GPU is not in MIG mode (or its MIG mode change is still pending a reset).
    #[error("GPU {gpu_index} is not in MIG mode (current {current}, pending {pending})")]
    NotMigMode {
        gpu_index: u32,
        current: bool,
        pending: bool,
    },
    /// No GPU-instance profile of this name on this GPU.
    #[error("GPU {gpu_index} has no MIG profile {profile}")]
    UnknownProfile { gpu_index: u32, profile: String },
    /// The placement is not one NVML lists for the profile, or it overlaps a live instance.
    #[error("GPU {gpu_index}: placement {start}+{size} is not free for profile {profile}")]
    PlacementUnavailable {
        gpu_index: u32,
        profile: String,
        start: u32,
        size: u32,
    },
}

/// A GPU's MIG mode: `pending` differs from `current` until the GPU is reset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigModeState {
    pub current: bool,
    pub pending: bool,
}

/// Where a GPU instance sits: memory slices `start .. start + size`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Placement {
    pub start: u32,
    pub size: u32,
}

/// One GPU-instance profile the GPU supports, as NVML reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GiProfile {
    /// NVML's profile id (`NVML_GPU_INSTANCE_PROFILE_*`).
    pub id: u32,
    /// NVIDIA's name, e.g. `1g.10gb`, `1g.10gb+me`, `7g.80gb` (the name `nvidia-smi mig -lgip`
    /// prints without its `MIG ` prefix, and the `nvidia.com/mig-<name>` resource suffix).
    pub name: String,
    /// Compute slices of one instance: NVML's `sliceCount`, the `<g>` of the name (3 for a
    /// `3g.40gb`). The memory slices it occupies are the `size` of its [`placements`](Self::placements)
    /// (4 for a `3g.40gb`).
    pub slice_count: u32,
    /// How many instances of this profile fit on an empty GPU.
    pub instance_count: u32,
    /// Memory of one instance, MiB.
    pub memory_mib: u64,
    /// Streaming multiprocessors of one instance.
    pub multiprocessor_count: u32,
    /// Every placement NVML allows for this profile on an empty GPU.
    pub placements: Vec<Placement>,
}

/// A carved instance: one GPU instance and its one compute instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigInstance {
    /// The MIG device's UUID (`MIG-…`), what `NVIDIA_VISIBLE_DEVICES` names; empty for a GPU
    /// instance without a compute instance (no MIG device exists for it).
    pub uuid: String,
    /// Its GPU-instance profile ([`GiProfile::id`]) and name.
    pub profile_id: u32,
    pub profile: String,
    pub placement: Placement,
    pub gpu_instance_id: u32,
    /// `None` for a GPU instance without a compute instance (carved by someone else, half done).
    pub compute_instance_id: Option<u32>,
    /// Memory of the instance, MiB.
    pub memory_mib: u64,
}

/// The MIG operations the device plugin needs, by NVML GPU index.
pub trait MigControl: Send + Sync {
    fn mig_mode(&self, gpu_index: u32) -> Result<MigModeState, MigError>;
    /// The GPU-instance profiles the GPU supports, with their placements (an empty list for a
    /// GPU that cannot do MIG).
    fn profiles(&self, gpu_index: u32) -> Result<Vec<GiProfile>, MigError>;
    /// Every GPU instance on the GPU now.
    fn instances(&self, gpu_index: u32) -> Result<Vec<MigInstance>, MigError>;
    /// Creates a GPU instance of `profile` (a [`GiProfile::name`]) at exactly `placement`, and
    /// one compute instance spanning it. Never tries another placement. On a failure after the
    /// GPU instance was made, destroys it again.
    fn create(
        &self,
        gpu_index: u32,
        profile: &str,
        placement: Placement,
    ) -> Result<MigInstance, MigError>;
    /// Destroys a GPU instance and its compute instances. An instance that is already gone is
    /// not an error.
    fn destroy(&self, gpu_index: u32, gpu_instance_id: u32) -> Result<(), MigError>;
}

/// [`MigControl`] on a loaded NVML.
#[derive(Debug)]
pub struct NvmlMig<'n> {
    pub nvml: &'n Nvml,
}

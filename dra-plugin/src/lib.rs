//! Tessera's DRA driver (`gpu.tessera.dev`): the kubelet plugin that publishes this node's GPUs
//! as a ResourceSlice and prepares the ResourceClaims kube-scheduler allocated on them
//! (docs/dra.md).
//!
//! Under DRA the scheduler itself books each claim's share of a GPU: with consumable capacity
//! (`DRAConsumableCapacity`) every GPU is one device whose `memory` (bytes) and `cores` (percent)
//! several claims consume, and the allocation records how much each claim got. The kubelet then
//! names the claim it is preparing, so the identity problem of the device-plugin `Allocate` does
//! not arise: preparing a claim writes a CDI spec that gives the container the GPU, the shim and
//! the limits of exactly that claim.
//!
//! Pure logic: [`slice`] (GPUs → ResourceSlice devices), [`claim`] (an allocated claim → what the
//! container gets). Edges: [`cdi`] and [`checkpoint`] (files), [`plugin`] (the kubelet's gRPC
//! APIs), [`publish`] (the API server), [`metrics`] (Prometheus), [`daemon`] (the `tessera-dra-plugin` binary).
// Daemon and library code returns errors; only tests may unwrap (clippy.toml allows it there).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

pub mod authority;
pub mod cdi;
pub mod checkpoint;
pub mod claim;
pub mod daemon;
pub mod metrics;
pub mod plugin;
pub mod publish;
pub mod slice;

/// The driver name: ResourceSlices' `spec.driver`, allocation results' `driver`, the kubelet
/// plugin's registered name, and the domain of the devices' attributes and capacities.
pub const DRIVER: &str = "gpu.tessera.dev";
/// The capacity a claim consumes of a GPU's memory, in bytes.
pub const MEMORY: &str = "memory";
/// The capacity a claim consumes of a GPU's streaming multiprocessors, in percent.
pub const CORES: &str = "cores";

//! HAMi's wire vocabulary, shared by Tessera's device plugin and scheduler extender.
//!
//! Everything here is pure: strings in, typed values out (and back). No I/O, no clocks, no async.
//! The contract is HAMi v2.10 (`shared/docs/hami-contract.md`); where Tessera deliberately
//! differs, the item's documentation says so and why.

pub mod annotations;
pub mod devices;
pub mod node;

pub use devices::{ContainerDevice, ContainerDevices, PodDevices};
pub use node::NodeDevice;

/// HAMi's vendor key for NVIDIA devices: the `Type` field of container device entries.
pub const NVIDIA_VENDOR: &str = "NVIDIA";

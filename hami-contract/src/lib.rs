//! HAMi's wire vocabulary, shared by Tessera's device plugin and scheduler extender.
//!
//! Everything here is pure: strings in, typed values out (and back). No I/O, no clocks, no async.
//! The contract is HAMi v2.10 (`docs/contract/hami.md`); where Tessera deliberately
//! differs, the item's documentation says so and why (collected in `docs/contract-deviations.md`).
//!
//! Modules, in the order a pod meets them:
//! - [`config`]: `device-config.yaml` (`nvidia:` section) and the per-node `config.json`;
//! - [`resources`]: the configurable resource names (`nvidia.com/gpu`, …);
//! - [`quantity`]: Kubernetes quantity strings, as far as HAMi reads them;
//! - [`request`]: a container's resources → HAMi's `ContainerDeviceRequest`, and the webhook's
//!   mutation of a container;
//! - [`policy`]: the user annotations that steer scheduling;
//! - [`devices`]: the container device list written into pod annotations;
//! - [`usage`]: how a pod's device list counts against a GPU;
//! - [`node`], [`handshake`], [`nodelock`]: the node annotations;
//! - [`mig`]: dynamic MIG: registered profiles, the scheduler's reservation, the allowlist;
//! - [`topology`]: NVML's GPU links → the pair scores of `hami.io/node-nvidia-score`;
//! - [`identity`]: the allocation signature used to tell pending pods apart;
//! - [`verbosity`]: HAMi's logging flags (klog `-v`, `--debug`) as a log filter;
//! - [`metrics`]: HAMi's metric names and labels, and a reader of the text format to check them.
// Daemon and library code returns errors; only tests may unwrap (clippy.toml allows it there).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

pub mod annotations;
pub mod config;
pub mod devices;
pub mod handshake;
pub mod identity;
pub mod metrics;
pub mod mig;
pub mod node;
pub mod nodelock;
pub mod policy;
pub mod quantity;
pub mod request;
pub mod resources;
pub mod topology;
pub mod usage;
pub mod verbosity;

pub use config::{DeviceConfig, NodeConfig, NodeConfigFile, NvidiaConfig};
pub use devices::{ContainerDevice, ContainerDevices, PodDevices};
pub use node::NodeDevice;
pub use request::{ContainerDeviceRequest, ContainerResources};
pub use resources::{MEM_PERCENTAGE_UNSET, ResourceNames};

/// HAMi's vendor key for NVIDIA devices: the `Type` field of container device entries.
pub const NVIDIA_VENDOR: &str = "NVIDIA";

//! Tessera's node agent: what the kubelet device plugin (`tessera-device-plugin`) and the DRA
//! kubelet plugin (`tessera-dra-plugin`) share. Both daemons are thin wiring over this library;
//! neither depends on the other (docs/architecture.md).
//!
//! The pure decisions live in `tessera-node-core` (identity, container env and mounts, the
//! runtime's verdict, conflicts, unaccounted processes), re-exported here; [`gpu`] and [`health`]
//! are pure too but speak the kubelet's and tokio's types. The I/O edges
//! ([`nvml`], [`kube_edges`], [`pod_resources`], [`gpu_processes`], [`pod_cgroup`]) sit behind
//! small traits so tests drive the real services with in-memory fakes ([`testing`], feature
//! `testing`). [`device_state`] holds the GPUs a node advertises and their health, [`allocator`]
//! answers the device plugin's `Allocate`, [`monitor`] is the usage monitor and its feedback
//! loop, [`mig`] carves and destroys the MIG instances the scheduler reserves (dynamic MIG).
// Daemon and library code returns errors; only tests may unwrap (clippy.toml allows it there).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

// The pure decisions, under the paths the agent's modules and the daemons use.
pub use tessera_node_core::{
    cached_identity, conflict, identity, nvidia_runtime, pod_cgroup, pods, unaccounted,
};

pub mod allocator;
pub mod cache_dir;
pub mod container_env;
pub mod device_state;
pub mod edges;
pub mod gpu;
pub mod gpu_processes;
pub mod health;
pub mod kube_edges;
pub mod metrics;
pub mod mig;
pub mod monitor;
pub mod node_events;
pub mod nvml;
pub mod pod_resources;
pub mod process_watch;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod uds;

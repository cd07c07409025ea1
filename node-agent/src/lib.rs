//! Tessera's node agent: what the kubelet device plugin (`tessera-device-plugin`) and the DRA
//! kubelet plugin (`tessera-dra-plugin`) share. Both daemons are thin wiring over this library;
//! neither depends on the other (docs/architecture.md).
//!
//! Pure logic lives in [`gpu`], [`container_env`]'s env and mount rules, [`identity`],
//! [`health`], [`pods`], [`conflict`], [`nvidia_runtime`] and [`unaccounted`]; the I/O edges
//! ([`nvml`], [`kube_edges`], [`pod_resources`], [`gpu_processes`], [`pod_cgroup`]) sit behind
//! small traits so tests drive the real services with in-memory fakes ([`testing`], feature
//! `testing`). [`device_state`] holds the GPUs a node advertises and their health, [`allocator`]
//! answers the device plugin's `Allocate`, [`monitor`] is the usage monitor and its feedback
//! loop, [`mig`] carves and destroys the MIG instances the scheduler reserves (dynamic MIG).
// Daemon and library code returns errors; only tests may unwrap (clippy.toml allows it there).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

pub mod allocator;
pub mod conflict;
pub mod container_env;
pub mod device_state;
pub mod edges;
pub mod gpu;
pub mod gpu_processes;
pub mod health;
pub mod identity;
pub mod kube_edges;
pub mod metrics;
pub mod mig;
pub mod monitor;
pub mod node_events;
pub mod nvidia_runtime;
pub mod nvml;
pub mod pod_cgroup;
pub mod pod_resources;
pub mod pods;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod uds;
pub mod unaccounted;

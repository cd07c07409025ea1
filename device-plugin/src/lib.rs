//! Tessera's device plugin: NVML discovery, the kubelet device plugin API, HAMi's node and pod
//! annotations, and `Allocate` that puts the HAMi-core shim in place with each pod's own limits.
//!
//! Pure logic lives in [`gpu`], [`container_env`], [`identity`], [`health`] and [`pods`]; the
//! I/O edges ([`nvml`], [`kubelet`], [`kube_edges`], [`pod_resources`]) sit behind small traits
//! so tests drive the real gRPC service with in-memory fakes ([`testing`], feature `testing`).
//! [`mig`] carves and destroys the MIG instances the scheduler reserves (dynamic MIG).
//! [`daemon`] wires it all together for the binary.

pub mod allocator;
pub mod cli;
pub mod conflict;
pub mod container_env;
pub mod daemon;
pub mod dra;
pub mod edges;
pub mod gpu;
pub mod gpu_processes;
pub mod health;
pub mod identity;
pub mod kube_edges;
pub mod kubelet;
pub mod metrics;
pub mod mig;
pub mod monitor;
pub mod node_events;
pub mod nvidia_runtime;
pub mod nvml;
pub mod pod_cgroup;
pub mod pod_resources;
pub mod pods;
pub mod service;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod uds;
pub mod unaccounted;

//! Tessera's node decisions, pure: what the node agent (`tessera-node`) decides, with no I/O
//! crate in the dependency tree (`scripts/check-core-deps.sh` checks it, as it does for
//! `tessera-scheduler-core`). Files, NVML, the kubelet and the API server stay at the agent's edge.
//!
//! - [`identity`]: which pod an `Allocate` call is for (docs/design/allocation-identity.md);
//!   [`cached_identity`]: the same answer from the informer's cache and one read by name.
//! - [`container_env`]: the env and mounts that put the shim into a container with its limits.
//! - [`accounting`]: the GPUs each pod was booked and who owns each shim region file.
//! - [`unaccounted`]: GPU processes the bookings do not account for, confirmed over two passes.
//! - [`pod_cgroup`]: the pod and container a process belongs to, from its cgroup path.
//! - [`nvidia_runtime`]: whether the node's NVIDIA runtime honours a container's own env.
//! - [`conflict`]: another device plugin serving the same GPUs.
//! - [`pods`]: a pod as the identity rules see it.
// Daemon and library code returns errors; only tests may unwrap (clippy.toml allows it there).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

pub mod accounting;
pub mod cached_identity;
pub mod conflict;
pub mod container_env;
pub mod identity;
pub mod nvidia_runtime;
pub mod pod_cgroup;
pub mod pods;
pub mod unaccounted;

//! `tessera-device-plugin`: the kubelet device plugin daemon. It wires the node library
//! ([`tessera_node`]) to the kubelet's device plugin API: [`cli`] (flags), [`service`] (the
//! `DevicePlugin` gRPC service), [`kubelet`] (registration and restarts), [`daemon`] (the tasks
//! of one run).
// Daemon and library code returns errors; only tests may unwrap (clippy.toml allows it there).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

pub mod cli;
pub mod daemon;
pub mod kubelet;
pub mod service;

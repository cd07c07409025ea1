//! Tessera's control-plane daemon: a kube-scheduler extender (filter, bind), the admission
//! webhook, per-namespace GPU budgets and the offline `simulate` tool.
//!
//! This crate is the I/O shell around `tessera_scheduler_core`, which holds every decision as pure
//! data and functions (fit and score, cluster state, budgets, the webhook and extender rules,
//! leader election, `simulate`). Here: [`engine`] (the one decision loop that owns the cluster
//! state, and its handle), [`edge`] (the side effects on the cluster, behind a trait),
//! [`kube_edge`] (that trait and the watches on the Kubernetes API), [`http`] (the extender,
//! webhook and metrics routes), the listener (`tessera_http`), [`metrics`], and the
//! binary (`serve`, `simulate`). `testing` (feature `testing`) is an in-process fake of the edge
//! for tests and benchmarks.
// Daemon and library code returns errors; only tests may unwrap (clippy.toml allows it there).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

pub mod edge;
pub mod engine;
pub mod http;
pub mod kube_edge;
pub mod metrics;
#[cfg(feature = "testing")]
pub mod testing;

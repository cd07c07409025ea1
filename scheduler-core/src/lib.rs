//! The scheduler's decisions, with no I/O: everything `tessera-scheduler` decides, as pure data
//! and functions that the daemon, `simulate`, the benchmarks and the fuzz targets share.
//!
//! What lives here:
//! - [`fit`]: HAMi's placement rules (fit and score of one pod on one node, the choice of node);
//! - [`podspec`]: from a Pod to fit's inputs; [`config`]: what every decision is configured with;
//! - [`state`]: the cluster model (nodes, GPU pods, quotas) and the reservation overlay;
//!   [`quota`]: ResourceQuota limits and the tightest of them per namespace;
//! - [`decide`]: one filter decision over the state; [`patch`]: what the filter and the bind
//!   write on the pod;
//! - [`extender`]: kube-scheduler's extender wire types; [`webhook`]: the admission webhook as a
//!   function of the AdmissionReview and the [`facts`] every replica keeps;
//! - [`preempt`]: the extender's preemption verb (which pods to evict for a pod, per node);
//! - [`lease`]: the leader-election decision; [`simulate`]: the offline `simulate` tool;
//!   [`inventory`]: who uses which GPU (`kubectl tessera gpus`); [`text`]: terminal tables;
//! - `fixtures` (feature `testing`): Kubernetes objects for tests, benchmarks and fuzzing.
//!
//! What does not: the decision loop that owns the state, the Kubernetes client, the HTTP and TLS
//! servers and the metrics, all in `tessera-scheduler`. The dependency tree has no async runtime,
//! client or server crate; `scripts/check-core-deps.sh` checks that.
// Daemon and library code returns errors; only tests may unwrap (clippy.toml allows it there).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

pub mod config;
pub mod decide;
pub mod dra;
pub mod extender;
pub mod facts;
pub mod fit;
#[cfg(feature = "testing")]
pub mod fixtures;
pub mod inventory;
pub mod lease;
pub mod patch;
pub mod podspec;
pub mod preempt;
pub mod quota;
pub mod simulate;
pub mod state;
pub mod text;
pub mod webhook;

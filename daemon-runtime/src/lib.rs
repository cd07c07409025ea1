//! What both Tessera daemons share at run time:
//!
//! - [`logging`]: the `--log-format` and klog verbosity flags (`-v N`, `--v N`, `--debug`) as a
//!   `clap::Args` struct to flatten, and the `tracing` subscriber they configure;
//! - [`shutdown`]: SIGTERM / SIGINT as a [`CancellationToken`];
//! - [`task`]: named background and periodic tasks, each in a `tracing` span named after it,
//!   stopping on shutdown and logging failures with their whole error chain;
//! - [`DisplayChain`]: an error and its causes on one line, for logs;
//! - [`RateLimitedLog`]: one log line per period for a repeated event, with the count left out;
//! - [`build_info_labels`], [`register_build_info`]: HAMi's `hami_build_info` gauge;
//! - [`RuntimeArgs`]: `--worker-threads` and the async runtime it sizes (node agents).
// Daemon and library code returns errors; only tests may unwrap (clippy.toml allows it there).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

pub mod build_info;
pub mod chain;
pub mod input;
pub mod logging;
pub mod rate_limited;
pub mod shutdown;
pub mod task;
pub mod threads;

pub use build_info::{build_info_labels, register_build_info};
pub use chain::DisplayChain;
pub use logging::{LogArgs, LogFormat, LoggingError, Verbosity};
pub use rate_limited::{RateLimitedLog, SharedRateLimitedLog};
pub use shutdown::{
    ShutdownSignal, cancel_on_signals, shutdown_on_signals, wait_for_shutdown_signal,
};
pub use task::{
    Schedule, TaskOutcome, spawn_blocking_in_span, spawn_periodic, spawn_task, task_span,
};
pub use threads::RuntimeArgs;
pub use tokio_util::sync::CancellationToken;

//! The async runtime of a node agent, sized by a flag rather than by the node.
//!
//! Tokio's default is one worker thread per CPU the process may use. A DaemonSet without a CPU
//! limit on a GPU node sees every core (64 to 256 on the nodes GPUs come in), so a plugin that
//! answers the kubelet one call at a time would start that many threads, each with its own stack
//! and, once it allocates, its own malloc arena. Two workers are what the plugins use: the
//! kubelet's calls, the informers and the metrics server are I/O; NVML and file work runs on
//! tokio's blocking pool, which is separate and grows only on demand.

/// `--worker-threads` for a daemon's command line (`#[command(flatten)]`).
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
#[command(about = None, long_about = None)]
pub struct RuntimeArgs {
    /// Worker threads of the async runtime (not the node's CPU count: see the crate docs).
    #[arg(long, env = "WORKER_THREADS", default_value_t = 2,
        value_parser = clap::value_parser!(u16).range(1..=64))]
    pub worker_threads: u16,
}

impl RuntimeArgs {
    /// A multi-threaded runtime with [`RuntimeArgs::worker_threads`] workers, I/O and timers on.
    pub fn build(&self) -> std::io::Result<tokio::runtime::Runtime> {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(usize::from(self.worker_threads))
            .enable_all()
            .build()
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::RuntimeArgs;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        runtime: RuntimeArgs,
    }

    #[test]
    fn two_workers_unless_told_and_never_zero() {
        assert_eq!(Cli::parse_from(["d"]).runtime.worker_threads, 2);
        assert_eq!(
            Cli::parse_from(["d", "--worker-threads", "8"])
                .runtime
                .worker_threads,
            8
        );
        assert!(Cli::try_parse_from(["d", "--worker-threads", "0"]).is_err());
        let rt = RuntimeArgs { worker_threads: 3 }.build().unwrap();
        assert_eq!(rt.metrics().num_workers(), 3);
    }
}

//! `tessera-demo`: the README's first command (`make demo`). See `tessera_e2e::demo`.
#![allow(
    clippy::disallowed_types,
    reason = "the e2e harness times real processes and clusters: wall-clock std::time::Instant"
)]

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

/// Start a local cluster of three real nodes with simulated GPUs (kubelet + containerd each) and
/// Tessera installed by helm, submit the example pods and show where each one went, why the
/// others wait, and what each placed pod sees inside. Ctrl-C stops and removes everything.
/// Needs root.
#[derive(Debug, Parser)]
#[command(name = "tessera-demo", version)]
struct Cli {
    /// Multi-document YAML of the pods to submit, in order.
    #[arg(short = 'f', long, default_value = "examples/demo/pods.yaml")]
    file: PathBuf,
    /// Print the table and exit (removing everything) instead of waiting for Ctrl-C.
    #[arg(long)]
    once: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error,kube_client=off")),
        )
        .with_writer(std::io::stderr)
        .init();
    match tessera_e2e::demo::main(&cli.file, cli.once) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tessera-demo: {e}");
            ExitCode::FAILURE
        }
    }
}

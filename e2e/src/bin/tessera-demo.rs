//! `tessera-demo`: the README's first command (`make demo`). See `tessera_e2e::demo`.

use std::path::PathBuf;

use clap::Parser;

/// Start a local cluster with three simulated GPU nodes and Tessera, submit the example pods and
/// show where each one went and why the others wait. Ctrl-C stops everything.
#[derive(Debug, Parser)]
#[command(name = "tessera-demo", version)]
struct Cli {
    /// Multi-document YAML of the pods to submit.
    #[arg(short = 'f', long, default_value = "examples/demo/pods.yaml")]
    file: PathBuf,
    /// Print the table and exit instead of waiting for Ctrl-C.
    #[arg(long)]
    once: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error,kube_client=off")),
        )
        .with_writer(std::io::stderr)
        .init();
    tessera_e2e::demo::main(&cli.file, cli.once).await?;
    Ok(())
}

//! `tessera-device-plugin`: parses the command line, installs logging and runs the daemon
//! ([`tessera_device_plugin::daemon`]).
// Daemon and library code returns errors; only tests may unwrap (clippy.toml allows it there).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

use std::process::ExitCode;

use clap::Parser;
use tessera_device_plugin::cli::{Cli, OWN_CRATES};
use tessera_runtime::DisplayChain;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(e) = cli.logging.init(OWN_CRATES) {
        eprintln!("Error: {}", DisplayChain(&e));
        return ExitCode::FAILURE;
    }
    match tessera_device_plugin::daemon::run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line with every cause: it is what `kubectl logs` shows of a crash loop.
            eprintln!("Error: {}", DisplayChain(&e));
            ExitCode::FAILURE
        }
    }
}

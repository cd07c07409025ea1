//! `tessera-device-plugin`: parses the command line, installs logging and runs the daemon
//! ([`tessera_device_plugin::daemon`]).
// Daemon and library code returns errors; only tests may unwrap (clippy.toml allows it there).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

use std::process::ExitCode;

use clap::Parser;
use tessera_device_plugin::cli::{Cli, OWN_CRATES};
use tessera_runtime::DisplayChain;

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(e) = cli.logging.init(OWN_CRATES) {
        eprintln!("Error: {}", DisplayChain(&e));
        return ExitCode::FAILURE;
    }
    // Sized by --worker-threads, not by the node's cores (tessera_runtime::threads).
    let runtime = match cli.runtime.build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("Error: starting the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(tessera_device_plugin::daemon::run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line with every cause: it is what `kubectl logs` shows of a crash loop.
            eprintln!("Error: {}", DisplayChain(&e));
            ExitCode::FAILURE
        }
    }
}

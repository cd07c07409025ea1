//! `tessera-dra-plugin`: parses the command line, installs logging and runs the DRA kubelet
//! plugin ([`tessera_dra_plugin::daemon`]).
// Daemon and library code returns errors; only tests may unwrap (clippy.toml allows it there).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

use std::process::ExitCode;

use clap::Parser;
use tessera_dra_plugin::daemon::{DraCli, OWN_CRATES, run};
use tessera_runtime::DisplayChain;

fn main() -> ExitCode {
    let cli = DraCli::parse();
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
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("Error: {}", DisplayChain(&e));
            ExitCode::FAILURE
        }
    }
}

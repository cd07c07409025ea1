//! `tessera-dra-plugin`: parses the command line, installs logging and runs the DRA kubelet
//! plugin ([`tessera_device_plugin::dra::daemon`]).

use std::process::ExitCode;

use clap::Parser;
use tessera_device_plugin::dra::daemon::{DraCli, OWN_CRATES, run};
use tessera_runtime::DisplayChain;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = DraCli::parse();
    if let Err(e) = cli.logging.init(OWN_CRATES) {
        eprintln!("Error: {}", DisplayChain(&e));
        return ExitCode::FAILURE;
    }
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("Error: {}", DisplayChain(&e));
            ExitCode::FAILURE
        }
    }
}

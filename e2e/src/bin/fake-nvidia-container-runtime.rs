//! `fake-nvidia-container-runtime --driver-config <path> [runc arguments...]`: the e2e nodes'
//! containerd runtime. Puts the fake GPU driver into containers that ask for GPUs, then execs
//! runc with its arguments unchanged. See `tessera_e2e::fake_nvidia_runtime`. Test support, never
//! shipped.
#![allow(
    clippy::disallowed_types,
    reason = "the e2e harness times real processes and clusters: wall-clock std::time::Instant"
)]

use std::os::unix::process::CommandExt;
use std::process::{Command, ExitCode};

use tessera_e2e::fake_nvidia_runtime::{RuntimeError, log_line, prepare};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let cwd = std::env::current_dir().unwrap_or_else(|_| "/".into());
    let fail = |log: Option<&std::path::Path>, e: &RuntimeError| {
        let msg = format!("fake-nvidia-container-runtime: {e}");
        log_line(log, &format!("error: {e}"));
        eprintln!("{msg}");
        ExitCode::from(1)
    };
    let (cfg, runc_args) = match prepare(&args, &cwd) {
        Ok(v) => v,
        // The config's log is unknown when the config itself is the problem: stderr only
        // (containerd puts it in the shim's error).
        Err(e) => return fail(None, &e),
    };
    // Only returns on failure; on success runc replaces this process (same pid, fds, cwd).
    let source = Command::new(&cfg.runc).args(&runc_args).exec();
    fail(
        cfg.log.as_deref(),
        &RuntimeError::Exec {
            runc: cfg.runc.clone(),
            source,
        },
    )
}

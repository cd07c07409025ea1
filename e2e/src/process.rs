//! Child processes owned by a test: stdout and stderr go to a log file, and the process is
//! killed (SIGKILL) and reaped when its handle drops, including when the test panics.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

#[derive(Debug)]
pub struct Proc {
    pub name: String,
    pub log: PathBuf,
    child: Option<Child>,
}

impl Proc {
    /// Spawns `cmd`, appending its output to `<log_dir>/<name>.log`.
    pub fn spawn(name: &str, log_dir: &Path, cmd: &mut Command) -> std::io::Result<Proc> {
        let log = log_dir.join(format!("{name}.log"));
        let out = File::options().create(true).append(true).open(&log)?;
        let err = out.try_clone()?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .spawn()?;
        Ok(Proc {
            name: name.to_owned(),
            log,
            child: Some(child),
        })
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// True while the process has not exited.
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// SIGKILL and reap (what `kill -9` of a pod's container does).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM, then SIGKILL after `grace` if still running.
    pub fn terminate(&mut self, grace: std::time::Duration) {
        if let Some(mut c) = self.child.take() {
            // The workspace forbids `unsafe`, so the signal goes through kill(1).
            let _ = Command::new("kill")
                .arg("-TERM")
                .arg(c.id().to_string())
                .status();
            let deadline = std::time::Instant::now() + grace;
            while std::time::Instant::now() < deadline {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The last `n` lines of the log, for failure messages.
    pub fn tail(&self, n: usize) -> String {
        tail(&self.log, n)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// At a cluster's end: keeps its run directory when asked (`keep`, a panicking test, or
/// `TESSERA_E2E_KEEP`) and says where, else removes it.
pub fn keep_or_remove_run_dir(dir: &Path, keep: bool) {
    if keep || std::thread::panicking() || std::env::var_os("TESSERA_E2E_KEEP").is_some() {
        eprintln!("e2e: logs and state kept in {}", dir.display());
    } else {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// The last `n` lines of every log file in `dir`, each under its name, for failure messages.
pub fn tail_all(dir: &Path, n: usize) -> String {
    let mut out = String::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        let mut paths: Vec<_> = rd.flatten().map(|e| e.path()).collect();
        paths.sort();
        for p in paths {
            out.push_str(&format!("==> {} <==\n{}\n", p.display(), tail(&p, n)));
        }
    }
    out
}

pub fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// The first port of the kernel's ephemeral range (`net.ipv4.ip_local_port_range`), from which
/// it picks the local port of every outgoing connection and of a bind to port 0.
fn ephemeral_low() -> u32 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768)
}

/// A listener on a loopback port below the kernel's ephemeral range, picked pseudo-randomly (by
/// process and time, then in steps), or on a port the kernel picks when none is free there.
///
/// A port from the ephemeral range that was free a moment ago can be taken by any outgoing
/// connection before the process meant to listen on it has started (a kube-scheduler failed so,
/// "address already in use", at a benchmark's start); ports below the range are handed out only
/// to whoever binds them by number.
fn bind_unused() -> Option<std::net::TcpListener> {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    const LOW: u32 = 20_000;
    let high = ephemeral_low();
    if high > LOW + 1_000 {
        let span = high - LOW;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let seed = std::process::id().wrapping_mul(7_919).wrapping_add(nanos);
        for _ in 0..256 {
            let step = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            // 7,919 is prime and no span here is a multiple of it: successive steps spread.
            let port = LOW + seed.wrapping_add(step.wrapping_mul(7_919)) % span;
            let Ok(port) = u16::try_from(port) else {
                continue;
            };
            if let Ok(l) = std::net::TcpListener::bind(("127.0.0.1", port)) {
                return Some(l);
            }
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0").ok()
}

/// A loopback port that was free a moment ago, outside the ephemeral range ([`bind_unused`]).
pub fn free_port() -> u16 {
    bind_unused()
        .and_then(|l| l.local_addr().ok())
        .map_or(0, |a| a.port())
}

/// `N` distinct free loopback ports: the listeners are held until all are taken, since two
/// [`free_port`] calls in a row could return the same port (a benchmark saw it).
pub fn free_ports<const N: usize>() -> [u16; N] {
    let listeners: Vec<Option<std::net::TcpListener>> = (0..N).map(|_| bind_unused()).collect();
    std::array::from_fn(|i| {
        listeners[i]
            .as_ref()
            .and_then(|l| l.local_addr().ok())
            .map_or(0, |a| a.port())
    })
}

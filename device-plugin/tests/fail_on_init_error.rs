//! `--fail-on-init-error` (NVIDIA's setting) with the real binary and an NVML that cannot be
//! used: the fake NVML made to fail `nvmlInit` (`FAKE_NVML_FAIL_INIT=1`), and a library path
//! with no `libnvidia-ml.so.1` at all.
//!
//! * true (the binary's default): a non-zero exit with one error line naming the cause;
//! * false (the chart's default): the cause logged once, /healthz answering, nothing registered
//!   with the kubelet, no apiserver contact (so no node annotation), a clean exit 0 on SIGTERM.

mod support;

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;
use tokio::time::Instant;

use support::kubelet_harness::FakeKubelet;

/// How NVML is made unusable.
#[derive(Debug, Clone, Copy)]
enum Broken {
    /// The fake library loads, but `nvmlInit` returns NVML_ERROR_DRIVER_NOT_LOADED.
    InitFails,
    /// No `libnvidia-ml.so.1` in the directory the plugin is pointed at.
    NoLibrary,
}

struct Setup {
    dir: tempfile::TempDir,
    nvml_lib: PathBuf,
    kubeconfig: PathBuf,
    /// Stands in for the apiserver: nothing may ever connect to it.
    apiserver: TcpListener,
}

fn setup(broken: Broken) -> Setup {
    let dir = tempfile::tempdir().expect("tempdir");
    let nvml_lib = match broken {
        Broken::InitFails => nvidia_ml::locate::install_as_soname(dir.path()).expect("fake NVML"),
        Broken::NoLibrary => {
            let empty = dir.path().join("no-driver");
            std::fs::create_dir(&empty).expect("mkdir");
            empty.join("libnvidia-ml.so.1")
        }
    };
    let apiserver = TcpListener::bind("127.0.0.1:0").expect("bind");
    apiserver.set_nonblocking(true).expect("nonblocking");
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters: [{{name: c, cluster: {{server: \"http://{}\"}}}}]\n\
             users: [{{name: u, user: {{}}}}]\ncontexts: [{{name: x, context: {{cluster: c, user: u}}}}]\ncurrent-context: x\n",
            apiserver.local_addr().expect("addr")
        ),
    )
    .expect("kubeconfig");
    Setup {
        dir,
        nvml_lib,
        kubeconfig,
        apiserver,
    }
}

fn command(s: &Setup, socket_dir: &Path, metrics: SocketAddr, broken: Broken) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tessera-device-plugin"));
    cmd.args(["--node-name", "node-a"])
        .arg(format!("--metrics-addr={metrics}"))
        .arg("--nvml-lib")
        .arg(&s.nvml_lib)
        .arg("--kubeconfig")
        .arg(&s.kubeconfig)
        .arg("--config-file")
        .arg(s.dir.path().join("absent.yaml"))
        .arg("--socket-dir")
        .arg(socket_dir)
        .arg("--hook-path")
        .arg(s.dir.path().join("hook"))
        .env_remove("FAIL_ON_INIT_ERROR")
        .env_remove("RUST_LOG")
        .env_remove("FAKE_NVML_SCENARIO")
        // The error line alone, as in a pod (the test runner may ask for backtraces).
        .env_remove("RUST_BACKTRACE")
        .env_remove("RUST_LIB_BACKTRACE")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    if matches!(broken, Broken::InitFails) {
        cmd.env("FAKE_NVML_FAIL_INIT", "1");
    }
    cmd
}

/// What the error says for each way NVML is broken.
fn cause(broken: Broken) -> &'static str {
    match broken {
        Broken::InitFails => "NVIDIA driver is not loaded",
        Broken::NoLibrary => "cannot open shared object file",
    }
}

fn free_port() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr")
}

fn wait_with_deadline(mut child: Child, within: Duration) -> Output {
    let deadline = Instant::now() + within;
    loop {
        if child.try_wait().expect("try_wait").is_some() {
            return child.wait_with_output().expect("output");
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!(
                "no exit within {within:?}; stderr:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// GET /healthz; Some(body) on a 200.
fn healthz(addr: SocketAddr) -> Option<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut response = String::new();
    s.read_to_string(&mut response).ok()?;
    response
        .starts_with("HTTP/1.1 200")
        .then(|| response.rsplit("\r\n\r\n").next().unwrap_or("").to_string())
}

fn fails_fast(broken: Broken, flag: Option<&str>) {
    let s = setup(broken);
    let mut cmd = command(&s, &s.dir.path().join("plugins"), free_port(), broken);
    if let Some(flag) = flag {
        cmd.arg(flag);
    }
    // Only errors: the expected line must be the whole of stderr.
    let out = wait_with_deadline(
        cmd.env("RUST_LOG", "error").spawn().expect("spawn"),
        Duration::from_secs(20),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "must fail: {stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one error line: {stderr}");
    assert!(
        lines[0].contains("no NVIDIA driver usable on this node")
            && lines[0].contains(&s.nvml_lib.display().to_string()),
        "{stderr}"
    );
    assert!(
        lines[0].contains(cause(broken)),
        "names the cause: {stderr}"
    );
    assert!(
        matches!(s.apiserver.accept(), Err(ref e) if e.kind() == ErrorKind::WouldBlock),
        "the apiserver must not be contacted"
    );
}

async fn idles_until_sigterm(broken: Broken, via_env: bool) {
    let s = setup(broken);
    let mut kubelet = FakeKubelet::start(s.dir.path(), false).await;
    let metrics = free_port();
    let mut cmd = command(&s, &kubelet.device_plugin_dir, metrics, broken);
    if via_env {
        cmd.env("FAIL_ON_INIT_ERROR", "false");
    } else {
        cmd.arg("--fail-on-init-error=false");
    }
    let child = cmd.spawn().expect("spawn");

    let deadline = Instant::now() + Duration::from_secs(20);
    let body = loop {
        if let Some(body) = healthz(metrics) {
            break body;
        }
        assert!(Instant::now() < deadline, "/healthz never answered");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(body, "ok");
    // Still healthy a little later, with nothing registered and the apiserver never contacted.
    assert!(
        kubelet
            .next_registration(Duration::from_secs(2))
            .await
            .is_none(),
        "registered with the kubelet without NVML"
    );
    assert_eq!(healthz(metrics).as_deref(), Some("ok"));
    assert!(
        std::fs::read_dir(&kubelet.device_plugin_dir)
            .expect("plugin dir")
            .filter_map(Result::ok)
            .all(|e| e.file_name() == "kubelet.sock"),
        "no plugin socket"
    );
    assert!(
        matches!(s.apiserver.accept(), Err(ref e) if e.kind() == ErrorKind::WouldBlock),
        "the apiserver must not be contacted (no node annotation)"
    );

    let status = Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .status()
        .expect("kill");
    assert!(status.success());
    let out =
        tokio::task::spawn_blocking(move || wait_with_deadline(child, Duration::from_secs(10)))
            .await
            .expect("join");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "clean exit on SIGTERM: {stderr}");
    assert_eq!(
        stderr
            .matches("no NVIDIA driver usable on this node")
            .count(),
        1,
        "the cause is logged once: {stderr}"
    );
    assert!(
        stderr.contains(&s.nvml_lib.display().to_string()) && stderr.contains(cause(broken)),
        "names the library and the cause: {stderr}"
    );
}

#[test]
fn init_failure_exits_by_default() {
    fails_fast(Broken::InitFails, None);
}

#[test]
fn missing_library_exits_with_true() {
    fails_fast(Broken::NoLibrary, Some("--fail-on-init-error=true"));
}

#[tokio::test]
async fn init_failure_idles_healthy_with_false() {
    idles_until_sigterm(Broken::InitFails, false).await;
}

#[tokio::test]
async fn missing_library_idles_healthy_with_false_from_env() {
    idles_until_sigterm(Broken::NoLibrary, true).await;
}

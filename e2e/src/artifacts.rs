//! Where the binaries an e2e cluster runs come from:
//!
//! * the upstream control plane (kube-apiserver, kube-scheduler, etcd) from
//!   `e2e/control-plane.sh`, which builds them from released Go modules once and caches them by
//!   version;
//! * `helm` from `e2e/tools.sh` (the webhook configuration is the chart's own, rendered);
//! * Tessera's daemons, the shim and the fake driver libraries from this workspace's target
//!   directory (`make e2e` builds them first);
//! * the C probe of the shim's tests, compiled here against the fake `libcuda.so.1`.
//!
//! Environment variables with the scripts' names (`KUBE_APISERVER`, `HELM`, …) override the
//! scripts, so a caller that already ran them pays nothing twice.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

#[derive(Debug, thiserror::Error)]
pub enum ArtifactError {
    #[error("{script} failed ({status}; its progress is above); its output:\n{output}")]
    Script {
        script: String,
        status: String,
        output: String,
    },
    #[error("{0} not found: run `make e2e` (or `cargo build --workspace`) first")]
    Missing(PathBuf),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("compiling the CUDA probe failed:\n{0}")]
    Probe(String),
}

#[derive(Debug, Clone)]
pub struct Artifacts {
    pub root: PathBuf,
    pub kube_apiserver: PathBuf,
    pub kube_scheduler: PathBuf,
    /// A newer kube-scheduler (`e2e/control-plane.sh`: v1.38.0-beta.0) for what only newer
    /// releases do.
    pub kube_scheduler_next: PathBuf,
    /// `v1.38.0-beta.0`: the release of [`Artifacts::kube_scheduler_next`].
    pub kube_scheduler_next_version: String,
    pub kube_controller_manager: PathBuf,
    pub kubelet: PathBuf,
    pub etcd: PathBuf,
    pub k8s_version: String,
    pub helm: PathBuf,
    /// The Prometheus server `e2e/tools.sh` builds (the monitoring test).
    pub prometheus: PathBuf,
    /// Kueue's manager, its Helm chart (`charts/kueue` of its module) and its release, which
    /// `e2e/tools.sh` builds and copies (the queueing test).
    pub kueue: PathBuf,
    pub kueue_chart: PathBuf,
    pub kueue_version: String,
    pub tessera_scheduler: PathBuf,
    pub tessera_device_plugin: PathBuf,
    pub tessera_dra_plugin: PathBuf,
    /// `kubectl tessera` (the operator's plugin); not checked here: only the tests that run it
    /// need it built.
    pub kubectl_tessera: PathBuf,
    pub shim: PathBuf,
    /// A directory holding `libcuda.so.1`/`libcuda.so` (fake CUDA) and `libnvidia-ml.so.1` (fake
    /// NVML) under their real names.
    pub driver_dir: PathBuf,
    pub cuda_probe: PathBuf,
}

/// The workspace root (the parent of this crate). Read at run time first (cargo sets
/// `CARGO_MANIFEST_DIR` for tests and benches): the compiled-in path is the checkout the binary
/// was built in, and cargo reuses a binary across checkouts that share a target directory (a CI
/// clone and a working tree), which would run one checkout's tests against the other's scripts.
pub fn workspace_root() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

fn target_profile_dir(root: &Path) -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    let profile = std::env::var("TESSERA_E2E_PROFILE").unwrap_or_else(|_| "debug".to_owned());
    target.join(profile)
}

/// Runs a `NAME=PATH`-printing script unless every wanted variable is already in the
/// environment.
fn script_vars(
    root: &Path,
    script: &str,
    wanted: &[&str],
) -> Result<BTreeMap<String, String>, ArtifactError> {
    let mut vars = BTreeMap::new();
    if wanted.iter().all(|w| std::env::var_os(w).is_some()) {
        for w in wanted {
            vars.insert((*w).to_owned(), std::env::var(w).unwrap_or_default());
        }
        return Ok(vars);
    }
    // Progress (and the one-time build's output) goes straight to the terminal.
    let out = Command::new(root.join(script))
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|source| ArtifactError::Io {
            what: format!("running {script}"),
            source,
        })?;
    if !out.status.success() {
        return Err(ArtifactError::Script {
            script: script.to_owned(),
            status: out.status.to_string(),
            output: String::from_utf8_lossy(&out.stdout).into_owned(),
        });
    }
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        if let Some((k, v)) = line.split_once('=') {
            vars.insert(k.trim().to_owned(), v.trim().to_owned());
        }
    }
    Ok(vars)
}

fn existing(p: PathBuf) -> Result<PathBuf, ArtifactError> {
    if p.is_file() {
        Ok(p)
    } else {
        Err(ArtifactError::Missing(p))
    }
}

fn var_path(vars: &BTreeMap<String, String>, name: &str) -> Result<PathBuf, ArtifactError> {
    existing(PathBuf::from(vars.get(name).cloned().unwrap_or_default()))
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ArtifactError {
    let what = what.into();
    move |source| ArtifactError::Io { what, source }
}

fn symlink_fresh(src: &Path, dst: &Path) -> Result<(), ArtifactError> {
    let _ = std::fs::remove_file(dst);
    std::os::unix::fs::symlink(src, dst).map_err(io(format!("symlink {}", dst.display())))
}

fn discover() -> Result<Artifacts, ArtifactError> {
    let root = workspace_root();
    let cp = script_vars(
        &root,
        "e2e/control-plane.sh",
        &[
            "KUBE_APISERVER",
            "KUBE_SCHEDULER",
            "KUBE_SCHEDULER_NEXT",
            "KUBE_CONTROLLER_MANAGER",
            "KUBELET",
            "ETCD",
            "K8S_VERSION",
        ],
    )?;
    let tools = script_vars(
        &root,
        "e2e/tools.sh",
        &[
            "HELM",
            "PROMETHEUS",
            "KUEUE",
            "KUEUE_CHART",
            "KUEUE_VERSION",
        ],
    )?;
    let target = target_profile_dir(&root);
    let driver_dir = target.join("e2e-drivers");
    std::fs::create_dir_all(&driver_dir).map_err(io("creating the driver dir"))?;
    let cuda = existing(target.join("libcuda.so"))?;
    let nvml = existing(target.join("libnvidia_ml.so"))?;
    symlink_fresh(&cuda, &driver_dir.join("libcuda.so.1"))?;
    symlink_fresh(&cuda, &driver_dir.join("libcuda.so"))?;
    symlink_fresh(&nvml, &driver_dir.join("libnvidia-ml.so.1"))?;
    let probe = driver_dir.join("cuda_probe");
    let src = root.join("libvgpu-shim/tests/c/cuda_probe.c");
    let out = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(["-O1", "-Wall", "-o"])
        .arg(&probe)
        .arg(&src)
        .arg(format!("-L{}", driver_dir.display()))
        .args(["-lcuda", "-ldl", "-lpthread"])
        .output()
        .map_err(io("running cc"))?;
    if !out.status.success() {
        return Err(ArtifactError::Probe(
            String::from_utf8_lossy(&out.stderr).into_owned(),
        ));
    }
    Ok(Artifacts {
        kube_apiserver: var_path(&cp, "KUBE_APISERVER")?,
        kube_scheduler: var_path(&cp, "KUBE_SCHEDULER")?,
        kube_scheduler_next: var_path(&cp, "KUBE_SCHEDULER_NEXT")?,
        kube_scheduler_next_version: cp
            .get("KUBE_SCHEDULER_NEXT_VERSION")
            .cloned()
            .unwrap_or_default(),
        kube_controller_manager: var_path(&cp, "KUBE_CONTROLLER_MANAGER")?,
        kubelet: var_path(&cp, "KUBELET")?,
        etcd: var_path(&cp, "ETCD")?,
        k8s_version: cp.get("K8S_VERSION").cloned().unwrap_or_default(),
        helm: var_path(&tools, "HELM")?,
        // Only the test that runs it needs it (checked there).
        prometheus: PathBuf::from(tools.get("PROMETHEUS").cloned().unwrap_or_default()),
        kueue: PathBuf::from(tools.get("KUEUE").cloned().unwrap_or_default()),
        kueue_chart: PathBuf::from(tools.get("KUEUE_CHART").cloned().unwrap_or_default()),
        kueue_version: tools.get("KUEUE_VERSION").cloned().unwrap_or_default(),
        tessera_scheduler: existing(target.join("tessera-scheduler"))?,
        tessera_device_plugin: existing(target.join("tessera-device-plugin"))?,
        tessera_dra_plugin: existing(target.join("tessera-dra-plugin"))?,
        // Only the tests that run it need it (the benchmarks build no release of it).
        kubectl_tessera: target.join("kubectl-tessera"),
        shim: existing(target.join("libvgpu.so"))?,
        driver_dir,
        cuda_probe: probe,
        root,
    })
}

/// Discovered once per process; every cluster of a test binary shares them.
pub fn artifacts() -> Result<&'static Artifacts, &'static ArtifactError> {
    static A: OnceLock<Result<Artifacts, ArtifactError>> = OnceLock::new();
    A.get_or_init(discover).as_ref()
}

/// The release an upgrade starts from (`e2e/previous-release.sh`): its daemons and shim, built
/// from this repository's history, and its chart's source.
#[derive(Debug, Clone)]
pub struct PreviousRelease {
    /// The commit it was built from.
    pub rev: String,
    pub tessera_scheduler: PathBuf,
    pub tessera_device_plugin: PathBuf,
    pub tessera_dra_plugin: PathBuf,
    pub shim: PathBuf,
    /// `charts/tessera` of that commit.
    pub chart_dir: PathBuf,
}

impl PreviousRelease {
    /// The image tag its images carry: `prev-<short commit>` (never the workspace's version,
    /// which the current images carry).
    pub fn tag(&self) -> String {
        format!("prev-{}", &self.rev[..self.rev.len().min(12)])
    }
}

fn discover_previous() -> Result<PreviousRelease, ArtifactError> {
    let root = workspace_root();
    let vars = script_vars(
        &root,
        "e2e/previous-release.sh",
        &["PREVIOUS_REV", "PREVIOUS_DIR"],
    )?;
    let dir = PathBuf::from(vars.get("PREVIOUS_DIR").cloned().unwrap_or_default());
    let chart_dir = dir.join("chart/tessera");
    if !chart_dir.join("Chart.yaml").is_file() {
        return Err(ArtifactError::Missing(chart_dir.join("Chart.yaml")));
    }
    Ok(PreviousRelease {
        rev: vars.get("PREVIOUS_REV").cloned().unwrap_or_default(),
        tessera_scheduler: existing(dir.join("bin/tessera-scheduler"))?,
        tessera_device_plugin: existing(dir.join("bin/tessera-device-plugin"))?,
        tessera_dra_plugin: existing(dir.join("bin/tessera-dra-plugin"))?,
        shim: existing(dir.join("bin/libvgpu.so"))?,
        chart_dir,
    })
}

/// Discovered (and built, the first time on a machine) once per process, by the tests that
/// upgrade from it.
pub fn previous_release() -> Result<&'static PreviousRelease, &'static ArtifactError> {
    static P: OnceLock<Result<PreviousRelease, ArtifactError>> = OnceLock::new();
    P.get_or_init(discover_previous).as_ref()
}

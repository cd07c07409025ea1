//! The logic of `fake-nvidia-container-runtime` (test support, never shipped): the e2e nodes'
//! containerd runs it instead of runc, as a GPU node runs `nvidia-container-runtime`.
//!
//! Like the real one, it only touches `create`: when the container's `process.env` asks for GPUs
//! (`NVIDIA_VISIBLE_DEVICES` set to anything but empty, `void` or `none`), it adds to the bundle's
//! `config.json` read-only bind mounts of the node's (fake) driver files and the node's driver
//! environment (`FAKE_NVML_SCENARIO=…`, `FAKE_CUDA_MEMORY_MIB=…`), writes the file back
//! atomically, then `exec`s the real runc with the arguments it was given, unchanged. Every other
//! command, and every container that does not ask for GPUs, goes to runc untouched: the bundle is
//! not even written.
//!
//! Its configuration is the node's driver file, `--driver-config <path>` (first argument; the
//! node's containerd runs a wrapper script
//! `exec fake-nvidia-container-runtime --driver-config /node/driver.json "$@"`):
//!
//! ```json
//! {"runc": "/usr/sbin/runc",
//!  "mounts": [{"host": "/node/driver/libcuda.so.1",
//!              "container": "/usr/lib/x86_64-linux-gnu/libcuda.so.1"}],
//!  "env": ["FAKE_NVML_SCENARIO=/run/fake-gpu/scenario.json"],
//!  "log": "/node/logs/nvidia-runtime.log"}
//! ```
//!
//! [`DriverConfig::fake_driver`] writes the usual one. The spec is edited as plain JSON
//! (`serde_json::Value`), not through typed OCI structs, so that fields this code does not know
//! (containerd's, newer runc's) pass through untouched.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tessera_node::nvidia_runtime::{RuntimeConfig, devices_from_mounts};

/// Where the fake driver libraries go inside a container (Debian/Ubuntu's multiarch directory,
/// where the NVIDIA container toolkit puts the real ones).
pub const DRIVER_LIB_DIR: &str = "/usr/lib/x86_64-linux-gnu";
/// The driver libraries a GPU container gets, by name in [`DriverConfig::fake_driver`]'s
/// `driver_dir`.
pub const DRIVER_LIBS: &[&str] = &["libcuda.so.1", "libnvidia-ml.so.1"];
/// The variable that asks for GPUs (the device plugin's `Allocate` sets it).
pub const VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriverMount {
    /// The file on the node.
    pub host: PathBuf,
    /// Where it appears in the container (absolute).
    pub container: String,
    /// Mounted read-write (the node's shared simulated GPU state); read-only otherwise.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub writable: bool,
}

/// The node's driver file, `--driver-config <path>`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DriverConfig {
    /// The real runc.
    pub runc: PathBuf,
    /// Read-only bind mounts added to GPU containers.
    #[serde(default)]
    pub mounts: Vec<DriverMount>,
    /// `KEY=VALUE` entries added to GPU containers' environment (replacing the same keys).
    #[serde(default)]
    pub env: Vec<String>,
    /// A file to append what it did to (besides stderr for errors).
    #[serde(default)]
    pub log: Option<PathBuf>,
    /// The NVIDIA container toolkit's `config.toml` (`/etc/nvidia-container-runtime/config.toml`
    /// on a real node), read at every `create` as the toolkit reads it; absent: the toolkit's
    /// defaults (the variable accepted from any container, no volume mounts).
    #[serde(default)]
    pub runtime_config: Option<PathBuf>,
}

impl DriverConfig {
    /// The usual configuration: the fake `libcuda.so.1` and `libnvidia-ml.so.1` from `driver_dir`
    /// (a directory holding them under those names, e.g. `Artifacts::driver_dir`) mounted at
    /// [`DRIVER_LIB_DIR`], plus `extra` mounts and `env`.
    pub fn fake_driver(
        runc: impl Into<PathBuf>,
        driver_dir: &Path,
        extra: Vec<DriverMount>,
        env: Vec<String>,
        log: Option<PathBuf>,
    ) -> DriverConfig {
        let mut mounts: Vec<DriverMount> = DRIVER_LIBS
            .iter()
            .map(|lib| DriverMount {
                host: driver_dir.join(lib),
                container: format!("{DRIVER_LIB_DIR}/{lib}"),
                writable: false,
            })
            .collect();
        mounts.extend(extra);
        DriverConfig {
            runc: runc.into(),
            mounts,
            env,
            log,
            runtime_config: None,
        }
    }

    pub fn from_file(path: &Path) -> Result<DriverConfig, RuntimeError> {
        let text = std::fs::read(path).map_err(|e| RuntimeError::Config {
            path: path.to_owned(),
            why: e.to_string(),
        })?;
        let cfg: DriverConfig =
            serde_json::from_slice(&text).map_err(|e| RuntimeError::Config {
                path: path.to_owned(),
                why: e.to_string(),
            })?;
        for m in &cfg.mounts {
            if !m.container.starts_with('/') {
                return Err(RuntimeError::Config {
                    path: path.to_owned(),
                    why: format!("mount destination {:?} is not absolute", m.container),
                });
            }
        }
        for e in &cfg.env {
            if !e.contains('=') || e.starts_with('=') {
                return Err(RuntimeError::Config {
                    path: path.to_owned(),
                    why: format!("env entry {e:?} is not KEY=VALUE"),
                });
            }
        }
        Ok(cfg)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("usage: fake-nvidia-container-runtime --driver-config <path> [runc arguments...]")]
    Usage,
    #[error("driver config {path}: {why}")]
    Config { path: PathBuf, why: String },
    #[error("bundle {path}: {why}")]
    Bundle { path: PathBuf, why: String },
    #[error("runtime config {path}: {source}")]
    RuntimeConfig {
        path: PathBuf,
        #[source]
        source: tessera_node::nvidia_runtime::ConfigError,
    },
    #[error("exec {runc}: {source}")]
    Exec {
        runc: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The runc global flags that take a value (`runc --help`); the command is the first argument
/// that is neither such a flag, its value, nor another flag.
const RUNC_VALUE_FLAGS: &[&str] = &["--log", "--log-format", "--root", "--criu", "--rootless"];

/// What `argv` (without the program name and `--driver-config`) asks runc to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invocation {
    /// The runc command (`create`, `start`, `delete`, `state`, …), if any.
    pub command: Option<String>,
    /// For `create`: the bundle directory (`--bundle`/`-b`, default the working directory).
    pub bundle: Option<PathBuf>,
}

/// Splits `args` (everything after the program name) into the driver config path and runc's
/// arguments, which are returned unchanged.
pub fn split_driver_config(args: &[String]) -> Result<(PathBuf, &[String]), RuntimeError> {
    match args {
        [flag, path, rest @ ..] if flag == "--driver-config" => Ok((PathBuf::from(path), rest)),
        [flag, rest @ ..] if flag.starts_with("--driver-config=") => {
            Ok((PathBuf::from(&flag["--driver-config=".len()..]), rest))
        }
        _ => Err(RuntimeError::Usage),
    }
}

/// Reads runc's command line as runc would (global flags first, then the command and its flags).
pub fn parse_runc_args(args: &[String], cwd: &Path) -> Invocation {
    let mut i = 0;
    let mut command = None;
    while i < args.len() {
        let a = args[i].as_str();
        if a == "--" {
            command = args.get(i + 1).cloned();
            i += 2;
            break;
        }
        if a.starts_with('-') {
            let takes_value = !a.contains('=') && RUNC_VALUE_FLAGS.contains(&a);
            i += if takes_value { 2 } else { 1 };
            continue;
        }
        command = Some(a.to_owned());
        i += 1;
        break;
    }
    let mut bundle = None;
    if command.as_deref() == Some("create") {
        let rest = args.get(i..).unwrap_or_default();
        let mut j = 0;
        while j < rest.len() {
            let a = rest[j].as_str();
            if a == "--" {
                break;
            }
            if a == "--bundle" || a == "-b" {
                bundle = rest.get(j + 1).map(PathBuf::from);
                j += 2;
                continue;
            }
            if let Some(v) = a
                .strip_prefix("--bundle=")
                .or_else(|| a.strip_prefix("-b="))
            {
                bundle = Some(PathBuf::from(v));
            }
            j += 1;
        }
        let b = bundle.unwrap_or_else(|| cwd.to_owned());
        bundle = Some(if b.is_absolute() { b } else { cwd.join(b) });
    }
    Invocation { command, bundle }
}

/// Whether an environment (`KEY=VALUE` entries) asks for GPUs.
pub fn wants_gpus(env: &[Value]) -> bool {
    let prefix = format!("{VISIBLE_DEVICES}=");
    // The last entry wins, as in execve's environment lookups by runc and libc.
    env.iter()
        .filter_map(Value::as_str)
        .filter_map(|e| e.strip_prefix(&prefix))
        .next_back()
        .is_some_and(|v| {
            let v = v.trim();
            !v.is_empty() && v != "void" && v != "none"
        })
}

/// Whether the container's spec gets GPUs from a runtime configured as `runtime`, as the NVIDIA
/// container toolkit decides: with volume mounts accepted, mounts under
/// `/var/run/nvidia-container-devices` name the devices and the variable is not read; otherwise
/// the variable, which an unprivileged container (no `CAP_SYS_ADMIN` in its bounding set) may
/// use only when `accept-nvidia-visible-devices-envvar-when-unprivileged` is on.
pub fn gets_gpus(spec: &Value, runtime: &RuntimeConfig) -> bool {
    if runtime.volume_mounts {
        let destinations = spec["mounts"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|m| m["destination"].as_str());
        if !devices_from_mounts(destinations).is_empty() {
            return true;
        }
    }
    let privileged = spec["process"]["capabilities"]["bounding"]
        .as_array()
        .is_some_and(|caps| caps.iter().any(|c| c.as_str() == Some("CAP_SYS_ADMIN")));
    (runtime.env_when_unprivileged || privileged)
        && spec["process"]["env"]
            .as_array()
            .is_some_and(|env| wants_gpus(env))
}

/// Edits an OCI runtime spec for a GPU container. Returns `false` (and leaves `spec` as it was)
/// when the container gets no GPUs ([`gets_gpus`]).
pub fn inject(
    spec: &mut Value,
    cfg: &DriverConfig,
    runtime: &RuntimeConfig,
) -> Result<bool, String> {
    if !gets_gpus(spec, runtime) {
        return Ok(false);
    }
    let Some(obj) = spec.as_object_mut() else {
        return Err("config.json is not a JSON object".into());
    };
    let env = obj
        .get_mut("process")
        .and_then(|p| p.get_mut("env"))
        .and_then(Value::as_array_mut)
        .ok_or("process.env vanished")?;
    for entry in &cfg.env {
        let key = entry.split_once('=').map_or(entry.as_str(), |(k, _)| k);
        let prefix = format!("{key}=");
        env.retain(|e| !e.as_str().is_some_and(|s| s.starts_with(&prefix)));
        env.push(Value::String(entry.clone()));
    }
    let mounts = obj
        .entry("mounts")
        .or_insert_with(|| Value::Array(Vec::new()))
        .as_array_mut()
        .ok_or("config.json's mounts is not an array")?;
    for m in &cfg.mounts {
        // The driver's file wins over anything the container had at that path.
        mounts.retain(|e| e.get("destination").and_then(Value::as_str) != Some(&m.container));
        mounts.push(serde_json::json!({
            "destination": m.container,
            "type": "bind",
            "source": m.host,
            "options": if m.writable {
                serde_json::json!(["rbind", "rprivate", "nosuid", "nodev"])
            } else {
                serde_json::json!(["rbind", "rprivate", "nosuid", "nodev", "ro"])
            },
        }));
    }
    Ok(true)
}

/// Reads `<bundle>/config.json`, and when the container asks for GPUs writes the edited spec
/// back atomically (a temporary file in the bundle, then a rename). Returns whether it wrote.
pub fn rewrite_bundle(bundle: &Path, cfg: &DriverConfig) -> Result<bool, RuntimeError> {
    let runtime = match &cfg.runtime_config {
        None => RuntimeConfig::default(),
        Some(p) => match std::fs::read_to_string(p) {
            Ok(text) => {
                RuntimeConfig::parse(&text).map_err(|source| RuntimeError::RuntimeConfig {
                    path: p.clone(),
                    source,
                })?
            }
            // As the toolkit: no file, its defaults.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => RuntimeConfig::default(),
            Err(e) => {
                return Err(RuntimeError::Config {
                    path: p.clone(),
                    why: e.to_string(),
                });
            }
        },
    };
    let path = bundle.join("config.json");
    let err = |why: String| RuntimeError::Bundle {
        path: path.clone(),
        why,
    };
    let text = std::fs::read(&path).map_err(|e| err(format!("reading: {e}")))?;
    let mut spec: Value =
        serde_json::from_slice(&text).map_err(|e| err(format!("not JSON: {e}")))?;
    if !inject(&mut spec, cfg, &runtime).map_err(err)? {
        return Ok(false);
    }
    let out = serde_json::to_vec(&spec).map_err(|e| err(e.to_string()))?;
    let perms = std::fs::metadata(&path)
        .map_err(|e| err(e.to_string()))?
        .permissions();
    let tmp = bundle.join(format!(".config.json.fake-nvidia.{}", std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&out)?;
        f.set_permissions(perms)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        err(format!("writing: {e}"))
    })?;
    Ok(true)
}

/// Appends one line to the configured log, if any (best effort: logging never fails a
/// container).
pub fn log_line(cfg_log: Option<&Path>, msg: &str) {
    let Some(path) = cfg_log else { return };
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or_default();
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        let _ = writeln!(f, "{secs:.3} pid={} {msg}", std::process::id());
    }
}

/// The whole program, up to the `exec`: returns the runc to run and its arguments (unchanged).
pub fn prepare(args: &[String], cwd: &Path) -> Result<(DriverConfig, Vec<String>), RuntimeError> {
    let (cfg_path, runc_args) = split_driver_config(args)?;
    let cfg = DriverConfig::from_file(&cfg_path)?;
    let inv = parse_runc_args(runc_args, cwd);
    if let (Some("create"), Some(bundle)) = (inv.command.as_deref(), inv.bundle.as_deref()) {
        match rewrite_bundle(bundle, &cfg) {
            Ok(true) => log_line(
                cfg.log.as_deref(),
                &format!(
                    "create {}: GPU container, added {} mounts and {} env entries",
                    bundle.display(),
                    cfg.mounts.len(),
                    cfg.env.len()
                ),
            ),
            Ok(false) => log_line(
                cfg.log.as_deref(),
                &format!("create {}: no GPUs asked for", bundle.display()),
            ),
            Err(e) => {
                log_line(cfg.log.as_deref(), &format!("error: {e}"));
                return Err(e);
            }
        }
    }
    Ok((cfg, runc_args.to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cfg() -> DriverConfig {
        DriverConfig::fake_driver(
            "/usr/sbin/runc",
            Path::new("/node/driver"),
            vec![DriverMount {
                host: "/node/scenario.json".into(),
                container: "/run/fake-gpu/scenario.json".into(),
                writable: false,
            }],
            vec![
                "FAKE_NVML_SCENARIO=/run/fake-gpu/scenario.json".into(),
                "FAKE_CUDA_MEMORY_MIB=15360".into(),
            ],
            None,
        )
    }

    /// A trimmed config.json as containerd 1.6's CRI writes it.
    fn sample(env: &[&str]) -> Value {
        json!({
            "ociVersion": "1.0.2-dev",
            "process": {
                "user": {"uid": 0, "gid": 0},
                "args": ["/usr/bin/cuda_probe", "alloc", "1024"],
                "env": env,
                "cwd": "/",
                "capabilities": {"bounding": ["CAP_CHOWN"]},
                "oomScoreAdj": 1000
            },
            "root": {"path": "rootfs"},
            "hostname": "gpu-pod",
            "mounts": [
                {"destination": "/proc", "type": "proc", "source": "proc",
                 "options": ["nosuid", "noexec", "nodev"]},
                {"destination": "/usr/lib/x86_64-linux-gnu/libcuda.so.1", "type": "bind",
                 "source": "/var/lib/kubelet/pods/x/volumes/fake", "options": ["rbind"]}
            ],
            "annotations": {"io.kubernetes.cri.container-type": "container"},
            "linux": {"namespaces": [{"type": "pid"}], "unknownFutureField": {"x": 1}}
        })
    }

    #[test]
    fn gpu_container_gets_mounts_and_env_and_keeps_the_rest() {
        let mut spec = sample(&[
            "PATH=/usr/bin:/bin",
            "NVIDIA_VISIBLE_DEVICES=GPU-0c8e3b5a-1111-2222-3333-444455556666",
            "FAKE_CUDA_MEMORY_MIB=99",
        ]);
        let before = spec.clone();
        assert!(inject(&mut spec, &cfg(), &RuntimeConfig::default()).unwrap());
        let env: Vec<&str> = spec["process"]["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        assert_eq!(
            env,
            [
                "PATH=/usr/bin:/bin",
                "NVIDIA_VISIBLE_DEVICES=GPU-0c8e3b5a-1111-2222-3333-444455556666",
                "FAKE_NVML_SCENARIO=/run/fake-gpu/scenario.json",
                "FAKE_CUDA_MEMORY_MIB=15360",
            ]
        );
        let mounts = spec["mounts"].as_array().unwrap();
        let dests: Vec<&str> = mounts
            .iter()
            .map(|m| m["destination"].as_str().unwrap())
            .collect();
        assert_eq!(
            dests,
            [
                "/proc",
                "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
                "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
                "/run/fake-gpu/scenario.json",
            ]
        );
        assert_eq!(
            mounts[1],
            json!({"destination": "/usr/lib/x86_64-linux-gnu/libcuda.so.1", "type": "bind",
                   "source": "/node/driver/libcuda.so.1",
                   "options": ["rbind", "rprivate", "nosuid", "nodev", "ro"]})
        );
        // Everything else is as it was, unknown fields included.
        for key in ["ociVersion", "root", "hostname", "annotations", "linux"] {
            assert_eq!(spec[key], before[key], "{key}");
        }
        assert_eq!(spec["process"]["args"], before["process"]["args"]);
        assert_eq!(spec["process"]["oomScoreAdj"], 1000);
        // A second pass changes nothing (containerd never creates twice, but it is harmless).
        let once = spec.clone();
        assert!(inject(&mut spec, &cfg(), &RuntimeConfig::default()).unwrap());
        assert_eq!(spec, once);
    }

    #[test]
    fn containers_that_do_not_ask_for_gpus_are_untouched() {
        for env in [
            &["PATH=/bin"][..],
            &["NVIDIA_VISIBLE_DEVICES="],
            &["NVIDIA_VISIBLE_DEVICES=void"],
            &["NVIDIA_VISIBLE_DEVICES=none"],
            &["NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_VISIBLE_DEVICES=void"],
            &["XNVIDIA_VISIBLE_DEVICES=all"],
        ] {
            let mut spec = sample(env);
            let before = spec.clone();
            assert!(
                !inject(&mut spec, &cfg(), &RuntimeConfig::default()).unwrap(),
                "{env:?}"
            );
            assert_eq!(spec, before);
        }
        // No process at all (a malformed spec is runc's to refuse, not ours).
        let mut spec = json!({"ociVersion": "1.0.2"});
        assert!(!inject(&mut spec, &cfg(), &RuntimeConfig::default()).unwrap());
    }

    #[test]
    fn all_asks_for_gpus() {
        let mut spec = sample(&["NVIDIA_VISIBLE_DEVICES=all"]);
        spec.as_object_mut().unwrap().remove("mounts");
        assert!(inject(&mut spec, &cfg(), &RuntimeConfig::default()).unwrap());
        assert_eq!(spec["mounts"].as_array().unwrap().len(), 3);
    }

    #[test]
    fn a_safe_runtime_reads_only_mounts_from_unprivileged_containers() {
        let safe = RuntimeConfig {
            env_when_unprivileged: false,
            volume_mounts: true,
        };
        // The variable, however it got there (spec, envFrom, image): ignored.
        let mut spec = sample(&["NVIDIA_VISIBLE_DEVICES=all"]);
        assert!(!inject(&mut spec, &cfg(), &safe).unwrap());
        // The mounts the device plugin's Allocate (or a DRA claim's CDI spec) adds: honoured.
        let mut spec = sample(&["NVIDIA_VISIBLE_DEVICES=/var/run/nvidia-container-devices"]);
        spec["mounts"].as_array_mut().unwrap().push(json!({
            "destination": "/var/run/nvidia-container-devices/GPU-a",
            "type": "bind", "source": "/dev/null", "options": ["rbind", "ro"],
        }));
        assert!(inject(&mut spec, &cfg(), &safe).unwrap());
        // A privileged container may still name GPUs in its environment (it sees every device
        // node anyway).
        let mut spec = sample(&["NVIDIA_VISIBLE_DEVICES=all"]);
        spec["process"]["capabilities"]["bounding"] = json!(["CAP_CHOWN", "CAP_SYS_ADMIN"]);
        assert!(inject(&mut spec, &cfg(), &safe).unwrap());
    }

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn runc_command_lines_as_containerd_shim_writes_them() {
        let cwd = Path::new("/run/cwd");
        let inv = parse_runc_args(
            &s(&[
                "--root",
                "/run/containerd/runc/k8s.io",
                "--log",
                "/run/containerd/io.containerd.runtime.v2.task/k8s.io/abc/log.json",
                "--log-format",
                "json",
                "--systemd-cgroup",
                "create",
                "--bundle",
                "/run/containerd/io.containerd.runtime.v2.task/k8s.io/abc",
                "--pid-file",
                "/run/x/init.pid",
                "abc",
            ]),
            cwd,
        );
        assert_eq!(inv.command.as_deref(), Some("create"));
        assert_eq!(
            inv.bundle.as_deref(),
            Some(Path::new(
                "/run/containerd/io.containerd.runtime.v2.task/k8s.io/abc"
            ))
        );
        let inv = parse_runc_args(&s(&["--root=/r", "create", "-b", "rel", "id"]), cwd);
        assert_eq!(inv.bundle.as_deref(), Some(Path::new("/run/cwd/rel")));
        let inv = parse_runc_args(&s(&["create", "--bundle=/b", "id"]), cwd);
        assert_eq!(inv.bundle.as_deref(), Some(Path::new("/b")));
        let inv = parse_runc_args(&s(&["--debug", "create", "id"]), cwd);
        assert_eq!(inv.bundle.as_deref(), Some(cwd));
        let inv = parse_runc_args(&s(&["--root", "/r", "start", "abc"]), cwd);
        assert_eq!(inv.command.as_deref(), Some("start"));
        assert_eq!(inv.bundle, None);
        assert_eq!(parse_runc_args(&s(&["--version"]), cwd).command, None);
    }

    #[test]
    fn driver_config_comes_first() {
        let args = s(&[
            "--driver-config",
            "/node/driver.json",
            "--root",
            "/r",
            "state",
            "x",
        ]);
        let (p, rest) = split_driver_config(&args).unwrap();
        assert_eq!(p, Path::new("/node/driver.json"));
        assert_eq!(rest, &args[2..]);
        let args = s(&["--driver-config=/d.json", "delete", "x"]);
        assert_eq!(split_driver_config(&args).unwrap().1, &args[1..]);
        assert!(split_driver_config(&s(&["create"])).is_err());
    }

    #[test]
    fn bundle_rewrite_is_atomic_and_only_for_gpu_containers() {
        let dir = tempfile::tempdir().unwrap();
        let driver = dir.path().join("driver.json");
        let mut c = cfg();
        c.log = Some(dir.path().join("runtime.log"));
        std::fs::write(&driver, serde_json::to_vec(&c).unwrap()).unwrap();

        let plain = dir.path().join("plain");
        std::fs::create_dir(&plain).unwrap();
        let text = serde_json::to_vec_pretty(&sample(&["PATH=/bin"])).unwrap();
        std::fs::write(plain.join("config.json"), &text).unwrap();
        let args = s(&[
            "--driver-config",
            driver.to_str().unwrap(),
            "--root",
            "/r",
            "create",
            "--bundle",
            plain.to_str().unwrap(),
            "id1",
        ]);
        let (got, runc_args) = prepare(&args, dir.path()).unwrap();
        assert_eq!(got.runc, Path::new("/usr/sbin/runc"));
        assert_eq!(runc_args, args[2..]);
        // Byte for byte the same file: not rewritten.
        assert_eq!(std::fs::read(plain.join("config.json")).unwrap(), text);

        let gpu = dir.path().join("gpu");
        std::fs::create_dir(&gpu).unwrap();
        std::fs::write(
            gpu.join("config.json"),
            serde_json::to_vec(&sample(&["NVIDIA_VISIBLE_DEVICES=0"])).unwrap(),
        )
        .unwrap();
        prepare(
            &s(&[
                "--driver-config",
                driver.to_str().unwrap(),
                "create",
                "--bundle",
                gpu.to_str().unwrap(),
                "id2",
            ]),
            dir.path(),
        )
        .unwrap();
        let spec: Value =
            serde_json::from_slice(&std::fs::read(gpu.join("config.json")).unwrap()).unwrap();
        assert_eq!(spec["mounts"].as_array().unwrap().len(), 4);
        let leftovers: Vec<_> = std::fs::read_dir(&gpu).unwrap().collect();
        assert_eq!(leftovers.len(), 1, "only config.json in the bundle");
        let log = std::fs::read_to_string(dir.path().join("runtime.log")).unwrap();
        assert!(log.contains("no GPUs asked for"), "{log}");
        assert!(
            log.contains("GPU container, added 3 mounts and 2 env entries"),
            "{log}"
        );

        // A broken driver config is an error, whatever the command.
        std::fs::write(&driver, b"{\"runc\": 1}").unwrap();
        assert!(matches!(
            prepare(&args, dir.path()),
            Err(RuntimeError::Config { .. })
        ));
    }
}

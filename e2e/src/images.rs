//! Container images for the e2e nodes, built here from the workspace's build outputs (test
//! support, never shipped).
//!
//! The e2e nodes run a real kubelet on their own containerd, with no registry and no image
//! builder, so the images the chart and the tests name are built as OCI image layouts and
//! imported with `ctr -a <sock> -n k8s.io images import <tar>`:
//!
//! * `oci-layout`, `index.json` and `blobs/sha256/…` in a plain tar; `index.json` holds one
//!   manifest descriptor per name, each with the annotation `io.containerd.image.name` (what
//!   containerd 1.6's importer names the image by), all pointing at the same manifest;
//! * one uncompressed layer per image (`application/vnd.oci.image.layer.v1.tar`): the layer digest
//!   is then also the diff ID, and nothing is spent on compression for a local import;
//! * deterministic: entries sorted by path, every parent directory listed, mtime 0, uid/gid 0
//!   unless stated, no user or group names, no `created` time, so the same inputs give the same
//!   digests.
//!
//! The images mirror what `docker/*.Dockerfile` would build (a unit test parses the Dockerfiles'
//! final stages and compares): the "distroless" base is the host's dynamic loader and the shared
//! libraries the binaries need (resolved with `ldd`, copied to the same paths), `/etc/passwd` and
//! `/etc/group` with `root` and `nonroot` (65532), `/tmp` (1777) and the host's CA bundle.
//!
//! Host requirements: `cc` with glibc's static `libc.a` (Debian `libc6-dev`) for the pause
//! program, `ldd`, and a **static** busybox at `/bin/busybox` (Debian `busybox-static`, which
//! `e2e/node-tools.sh` installs; `TESSERA_BUSYBOX` overrides the path).
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use tessera_e2e::images::{self, ImageNames};
//! let a = tessera_e2e::artifacts::artifacts()?;
//! let names = ImageNames {
//!     kube_scheduler: vec![
//!         "registry.cn-hangzhou.aliyuncs.com/google_containers/kube-scheduler:v1.34.4".into(),
//!     ],
//!     ..ImageNames::default()
//! };
//! for img in images::build_all(a, &names, &images::default_out_dir())? {
//!     // ctr -a <sock> -n k8s.io images import <img.tar>
//!     println!("{} -> {}", img.names.join(", "), img.tar.display());
//! }
//! # Ok(()) }
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};
use std::process::Command;

use oci_spec::image::{
    Arch, ConfigBuilder, Descriptor, ImageConfiguration, ImageConfigurationBuilder, ImageIndex,
    ImageIndexBuilder, ImageManifest, ImageManifestBuilder, MediaType, Os, PlatformBuilder,
    RootFsBuilder, Sha256Digest,
};
use sha2::{Digest as _, Sha256};

use crate::artifacts::Artifacts;

/// The sandbox image; containerd's `sandbox_image` must name it (or one of the extra pause
/// names given in [`ImageNames::pause`]).
pub const PAUSE_IMAGE: &str = "registry.k8s.io/pause:3.10";
/// The workload image of the GPU tests: the shim's C probe and a busybox shell.
pub const CUDA_PROBE_IMAGE: &str = "tessera.local/cuda-probe:e2e";
/// containerd's annotation for an image's name in an OCI archive's `index.json`.
pub const CONTAINERD_IMAGE_NAME: &str = "io.containerd.image.name";
/// Where Debian's `busybox-static` installs busybox.
pub const DEFAULT_BUSYBOX: &str = "/bin/busybox";
/// The environment of the distroless images (theirs, verbatim).
pub const DISTROLESS_PATH: &str =
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
pub const DISTROLESS_SSL: &str = "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt";

/// Bumped when the layout of the images changes, so cached tars are rebuilt.
const FORMAT: &str = "tessera-e2e-images/1";
/// Every entry's modification time (the epoch; containerd and runc do not care).
const MTIME: u64 = 0;
/// Driver libraries never go into an image: the (fake) NVIDIA container runtime mounts them.
const DRIVER_LIB_PREFIXES: &[&str] = &["libcuda.so", "libnvidia-ml.so"];

/// The Tessera image `repository` (e.g. `tessera-scheduler`) at this workspace's version, as
/// the chart names it by default (`ghcr.io/tessera-gpu/…:<appVersion>`).
pub fn tessera_image(repository: &str) -> String {
    format!(
        "ghcr.io/tessera-gpu/{repository}:{}",
        env!("CARGO_PKG_VERSION")
    )
}

/// `<target>/e2e-images`, beside the build outputs the images are made of.
pub fn default_out_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::artifacts::workspace_root().join("target"))
        .join("e2e-images")
}

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Msg(String),
    #[error("OCI types: {0}")]
    Oci(#[from] oci_spec::OciSpecError),
    #[error("JSON: {0}")]
    Json(#[from] serde_json::Error),
}

pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ImageError {
    let what = what.into();
    move |source| ImageError::Io { what, source }
}

pub(crate) fn msg(m: impl Into<String>) -> ImageError {
    ImageError::Msg(m.into())
}

/// Where a file of an image comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageSource {
    /// A host file (followed if a symlink), copied with the entry's mode.
    HostFile(PathBuf),
    Bytes(Vec<u8>),
    /// An (empty) directory.
    Dir,
    /// A symbolic link to this target.
    Symlink(String),
    /// A C program compiled with `cc -static -O2 -s` (or `$CC`) when the image is built.
    StaticC(PathBuf),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageFile {
    /// Absolute path inside the image.
    pub path_in_image: String,
    pub source: ImageSource,
    /// Permission bits (with setuid/setgid/sticky); ignored for symlinks.
    pub mode: u32,
}

impl ImageFile {
    pub fn host(path_in_image: impl Into<String>, host: impl Into<PathBuf>, mode: u32) -> Self {
        ImageFile {
            path_in_image: path_in_image.into(),
            source: ImageSource::HostFile(host.into()),
            mode,
        }
    }

    pub fn bytes(path_in_image: impl Into<String>, data: impl Into<Vec<u8>>, mode: u32) -> Self {
        ImageFile {
            path_in_image: path_in_image.into(),
            source: ImageSource::Bytes(data.into()),
            mode,
        }
    }

    pub fn dir(path_in_image: impl Into<String>, mode: u32) -> Self {
        ImageFile {
            path_in_image: path_in_image.into(),
            source: ImageSource::Dir,
            mode,
        }
    }

    pub fn symlink(path_in_image: impl Into<String>, target: impl Into<String>) -> Self {
        ImageFile {
            path_in_image: path_in_image.into(),
            source: ImageSource::Symlink(target.into()),
            mode: 0o777,
        }
    }
}

/// One image, declaratively: its files and the runtime part of its config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageSpec {
    /// A short name for file names and messages (`pause`, `tessera-scheduler`, …).
    pub id: String,
    /// Full image names (`registry/repository:tag`), the first being the main one.
    pub names: Vec<String>,
    pub files: Vec<ImageFile>,
    pub user: Option<String>,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    /// `port/proto`, e.g. `443/tcp`.
    pub exposed_ports: Vec<String>,
    pub env: Vec<String>,
    pub working_dir: Option<String>,
}

/// Extra names per image, beside the defaults ([`PAUSE_IMAGE`], [`tessera_image`],
/// `registry.k8s.io/kube-scheduler:<k8s_version>`, [`CUDA_PROBE_IMAGE`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImageNames {
    pub pause: Vec<String>,
    pub device_plugin: Vec<String>,
    pub scheduler: Vec<String>,
    pub kube_scheduler: Vec<String>,
    pub cuda_probe: Vec<String>,
    pub simulated_gpu: Vec<String>,
}

/// The host files the images are made of (normally from [`Artifacts`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostInputs {
    pub tessera_scheduler: PathBuf,
    pub tessera_device_plugin: PathBuf,
    pub tessera_dra_plugin: PathBuf,
    pub shim: PathBuf,
    pub kube_scheduler: PathBuf,
    /// `v1.34.4`: the tag of the default kube-scheduler name.
    pub k8s_version: String,
    pub cuda_probe: PathBuf,
    /// The (fake) driver libraries the runtime mounts into GPU containers: not in any image,
    /// but the libraries they load are (the fakes are Rust and need `libgcc_s.so.1`).
    pub driver_libs: Vec<PathBuf>,
    /// A statically linked busybox.
    pub busybox: PathBuf,
    /// `e2e/images/pause.c`.
    pub pause_c: PathBuf,
}

/// A copy of `binary` without its debug sections (`objcopy --strip-debug`), kept beside the
/// images and reused while the binary is the same file: debug builds are ~250 MB, mostly DWARF,
/// and every node imports every image, so this is most of a cluster's start-up time. Symbols
/// stay, so backtraces still name functions.
fn without_debug_info(binary: &Path) -> Result<PathBuf, ImageError> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(binary).map_err(io(format!("reading {}", binary.display())))?;
    let name = binary
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let dir = default_out_dir().join("stripped");
    std::fs::create_dir_all(&dir).map_err(io(format!("creating {}", dir.display())))?;
    let out = dir.join(format!(
        "{name}-{}-{}-{}",
        meta.ino(),
        meta.size(),
        meta.mtime_nsec() + meta.mtime() * 1_000_000_000
    ));
    if out.is_file() {
        return Ok(out);
    }
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let status = std::process::Command::new("objcopy")
        .arg("--strip-debug")
        .arg(binary)
        .arg(&tmp)
        .status()
        .map_err(io("running objcopy (binutils)"))?;
    if !status.success() {
        let _ = std::fs::remove_file(&tmp);
        return Err(msg(format!(
            "objcopy --strip-debug {} failed",
            binary.display()
        )));
    }
    // Older copies of the same binary are of no further use.
    if let Ok(rd) = std::fs::read_dir(&dir) {
        for e in rd.flatten() {
            if e.file_name()
                .to_string_lossy()
                .strip_prefix(&format!("{name}-"))
                .is_some_and(|rest| rest.bytes().all(|b| b.is_ascii_digit() || b == b'-'))
            {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    std::fs::rename(&tmp, &out).map_err(io(format!("renaming to {}", out.display())))?;
    Ok(out)
}

impl HostInputs {
    /// The workspace's build outputs, the workspace's pause source, and the host's busybox
    /// (`TESSERA_BUSYBOX` or [`DEFAULT_BUSYBOX`], which must be static).
    pub fn from_artifacts(a: &Artifacts) -> Result<HostInputs, ImageError> {
        let busybox = std::env::var_os("TESSERA_BUSYBOX")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(DEFAULT_BUSYBOX));
        if !busybox.is_file() {
            return Err(msg(format!(
                "{} not found: the images need a static busybox (Debian: apt-get install \
                 busybox-static; e2e/node-tools.sh installs it)",
                busybox.display()
            )));
        }
        if !shared_libs(&busybox)?.is_empty() {
            return Err(msg(format!(
                "{} is dynamically linked: the images need busybox-static's",
                busybox.display()
            )));
        }
        Ok(HostInputs {
            tessera_scheduler: without_debug_info(&a.tessera_scheduler)?,
            tessera_device_plugin: without_debug_info(&a.tessera_device_plugin)?,
            tessera_dra_plugin: without_debug_info(&a.tessera_dra_plugin)?,
            shim: a.shim.clone(),
            kube_scheduler: a.kube_scheduler.clone(),
            k8s_version: a.k8s_version.clone(),
            cuda_probe: a.cuda_probe.clone(),
            driver_libs: crate::fake_nvidia_runtime::DRIVER_LIBS
                .iter()
                .map(|l| a.driver_dir.join(l))
                .collect(),
            busybox,
            pause_c: a.root.join("e2e/images/pause.c"),
        })
    }
}

/// The shared libraries (and dynamic loader) `binary` loads, as `ldd` resolves them on this
/// host; empty for a static binary. The (fake) driver libraries are left out: the container
/// runtime delivers them.
pub fn shared_libs(binary: &Path) -> Result<Vec<PathBuf>, ImageError> {
    let out = Command::new("ldd")
        .arg(binary)
        // The host's resolution, not whatever a test put in front of it.
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("LD_PRELOAD")
        .output()
        .map_err(io("running ldd"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if stdout.contains("not a dynamic executable")
        || stderr.contains("not a dynamic executable")
        || stdout.contains("statically linked")
    {
        return Ok(Vec::new());
    }
    if !out.status.success() {
        return Err(msg(format!(
            "ldd {} failed ({}): {stdout}{stderr}",
            binary.display(),
            out.status
        )));
    }
    let is_driver = |name: &str| {
        let base = name.rsplit('/').next().unwrap_or(name);
        DRIVER_LIB_PREFIXES.iter().any(|p| base.starts_with(p))
    };
    let mut libs = Vec::new();
    for line in stdout.lines().map(str::trim) {
        let without_addr = line.split(" (0x").next().unwrap_or(line).trim();
        if let Some((name, path)) = without_addr.split_once(" => ") {
            if is_driver(name) {
                continue;
            }
            if path == "not found" {
                return Err(msg(format!(
                    "{} needs {name}, which ldd does not find on this host",
                    binary.display()
                )));
            }
            if !path.is_empty() {
                libs.push(PathBuf::from(path));
            }
        } else if without_addr.starts_with('/') {
            // The dynamic loader (PT_INTERP), and where its link points (Debian's
            // `/lib64/ld-linux-x86-64.so.2` → `/lib/x86_64-linux-gnu/…`): a second link-map
            // namespace (`dlmopen`) loads it again by name from the library directories, as
            // in any distribution's image.
            let loader = PathBuf::from(without_addr);
            if let Ok(target) = std::fs::canonicalize(&loader)
                && target != loader
            {
                libs.push(target);
            }
            libs.push(loader);
        }
        // linux-vdso.so.1: the kernel's.
    }
    Ok(libs)
}

const PASSWD: &str = "root:x:0:0:root:/root:/sbin/nologin\n\
nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\n\
nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n";
const GROUP: &str = "root:x:0:\nnobody:x:65534:\ntty:x:5:\nstaff:x:50:\nnonroot:x:65532:\n";
const NSSWITCH: &str = "passwd: files\ngroup: files\nshadow: files\nhosts: files dns\n\
networks: files\nprotocols: files\nservices: files\nethers: files\nrpc: files\n";

/// distroless/static: users, groups, `/tmp`, CA certificates.
pub(crate) fn distroless_static() -> Vec<ImageFile> {
    let mut files = vec![
        ImageFile::bytes("/etc/passwd", PASSWD, 0o644),
        ImageFile::bytes("/etc/group", GROUP, 0o644),
        ImageFile::bytes("/etc/nsswitch.conf", NSSWITCH, 0o644),
        ImageFile::dir("/tmp", 0o1777),
        ImageFile::dir("/root", 0o700),
    ];
    let ca = Path::new("/etc/ssl/certs/ca-certificates.crt");
    if ca.is_file() {
        files.push(ImageFile::host(ca.to_string_lossy(), ca, 0o644));
    }
    files
}

/// distroless/cc: the static base plus the loader and every library `binaries` need.
pub(crate) fn distroless_cc(binaries: &[&Path]) -> Result<Vec<ImageFile>, ImageError> {
    let mut files = distroless_static();
    let mut libs = BTreeSet::new();
    for b in binaries {
        libs.extend(shared_libs(b)?);
    }
    for lib in libs {
        files.push(ImageFile::host(
            lib.to_string_lossy().into_owned(),
            lib,
            0o755,
        ));
    }
    Ok(files)
}

fn names(default: String, extra: &[String]) -> Vec<String> {
    let mut v = vec![default];
    for n in extra {
        if !v.contains(n) {
            v.push(n.clone());
        }
    }
    v
}

/// The six images, declaratively, from the workspace's build outputs.
pub fn image_specs(a: &Artifacts, names: &ImageNames) -> Result<Vec<ImageSpec>, ImageError> {
    specs_for(&HostInputs::from_artifacts(a)?, names)
}

/// The six images from any host files (the unit tests use stand-ins).
pub fn specs_for(h: &HostInputs, extra: &ImageNames) -> Result<Vec<ImageSpec>, ImageError> {
    let distroless_env = vec![DISTROLESS_PATH.to_owned(), DISTROLESS_SSL.to_owned()];
    let k8s_tag = if h.k8s_version.starts_with('v') {
        h.k8s_version.clone()
    } else {
        format!("v{}", h.k8s_version)
    };

    // As registry.k8s.io/pause: one static binary, entrypoint, the nobody-ish user.
    let pause = ImageSpec {
        id: "pause".into(),
        names: names(PAUSE_IMAGE.into(), &extra.pause),
        files: vec![ImageFile {
            path_in_image: "/pause".into(),
            source: ImageSource::StaticC(h.pause_c.clone()),
            mode: 0o755,
        }],
        user: Some("65535:65535".into()),
        entrypoint: vec!["/pause".into()],
        cmd: vec![],
        exposed_ports: vec![],
        env: vec![DISTROLESS_PATH.into()],
        working_dir: None,
    };

    // docker/device-plugin.Dockerfile, final stage (FROM gcr.io/distroless/cc-debian12: root).
    // The musl shim (/opt/tessera/lib/musl/) is optional there and left out here.
    let mut dp_files = distroless_cc(&[&h.tessera_device_plugin, &h.tessera_dra_plugin, &h.shim])?;
    dp_files.extend([
        ImageFile::host(
            "/usr/bin/tessera-device-plugin",
            &h.tessera_device_plugin,
            0o755,
        ),
        ImageFile::host("/usr/bin/tessera-dra-plugin", &h.tessera_dra_plugin, 0o755),
        ImageFile::host("/opt/tessera/lib/libvgpu.so", &h.shim, 0o644),
        ImageFile::host("/opt/tessera/bin/busybox", &h.busybox, 0o755),
    ]);
    let device_plugin = ImageSpec {
        id: "tessera-device-plugin".into(),
        names: names(tessera_image("tessera-device-plugin"), &extra.device_plugin),
        files: dp_files,
        user: None,
        entrypoint: vec!["/usr/bin/tessera-device-plugin".into()],
        cmd: vec![],
        exposed_ports: vec!["9394/tcp".into()],
        env: distroless_env.clone(),
        working_dir: None,
    };

    // docker/scheduler.Dockerfile, final stage (FROM gcr.io/distroless/cc-debian12:nonroot).
    let mut sched_files = distroless_cc(&[&h.tessera_scheduler])?;
    sched_files.push(ImageFile::host(
        "/usr/bin/tessera-scheduler",
        &h.tessera_scheduler,
        0o755,
    ));
    let scheduler = ImageSpec {
        id: "tessera-scheduler".into(),
        names: names(tessera_image("tessera-scheduler"), &extra.scheduler),
        files: sched_files,
        user: Some("65532:65532".into()),
        entrypoint: vec!["/usr/bin/tessera-scheduler".into()],
        cmd: vec!["serve".into()],
        exposed_ports: vec!["443/tcp".into(), "9395/tcp".into()],
        env: distroless_env.clone(),
        working_dir: None,
    };

    let kube_scheduler = kube_scheduler_spec(
        "kube-scheduler",
        &h.kube_scheduler,
        names(
            format!("registry.k8s.io/kube-scheduler:{k8s_tag}"),
            &extra.kube_scheduler,
        ),
    )?;

    // The GPU workload: the probe, glibc, a busybox shell. No driver: the runtime mounts it; but
    // what the driver and the shim (mounted by the device plugin) load must be there, as in any
    // glibc image (libgcc_s: distroless/cc has it too). Also under the name `make release`
    // publishes it by, so the simulated GPUs' example pod runs here as written.
    let mut needs: Vec<&Path> = vec![&h.cuda_probe, &h.shim];
    needs.extend(h.driver_libs.iter().map(PathBuf::as_path));
    let mut probe_names = names(CUDA_PROBE_IMAGE.into(), &extra.cuda_probe);
    probe_names.push(tessera_image(GPU_PROBE_REPOSITORY));
    let cuda_probe = gpu_probe_spec(
        probe_names,
        distroless_cc(&needs)?,
        &h.cuda_probe,
        &h.busybox,
        distroless_env,
    );

    let driver_lib = |name: &str| {
        h.driver_libs
            .iter()
            .find(|l| l.file_name().is_some_and(|f| f == name))
            .cloned()
            .unwrap_or_else(|| PathBuf::from(name))
    };
    let (libcuda, libnvml) = (driver_lib("libcuda.so.1"), driver_lib("libnvidia-ml.so.1"));
    let simulated_gpu = simulated_gpu_spec(
        names(tessera_image("tessera-simulated-gpu"), &extra.simulated_gpu),
        &libcuda,
        &libnvml,
        &h.busybox,
    );

    Ok(vec![
        pause,
        device_plugin,
        scheduler,
        kube_scheduler,
        cuda_probe,
        simulated_gpu,
    ])
}

/// The repository `make release` publishes the probe workload under (the simulated GPUs'
/// example, `examples/simulated-gpus/probe.yaml`).
pub const GPU_PROBE_REPOSITORY: &str = "tessera-gpu-probe";

/// The probe workload: `cuda_probe` (`libvgpu-shim/tests/c/cuda_probe.c`: what CUDA and NVML
/// report, the limit allocatable and one byte more refused) and a busybox shell on `base` (glibc
/// and what the driver and the shim load; no driver: the runtime or the simulated GPUs mount it).
pub fn gpu_probe_spec(
    names: Vec<String>,
    mut base: Vec<ImageFile>,
    probe: &Path,
    busybox: &Path,
    env: Vec<String>,
) -> ImageSpec {
    base.extend([
        ImageFile::host("/usr/bin/cuda_probe", probe, 0o755),
        ImageFile::host("/bin/busybox", busybox, 0o755),
        ImageFile::symlink("/bin/sh", "busybox"),
    ]);
    ImageSpec {
        id: "cuda-probe".into(),
        names,
        files: base,
        user: None,
        entrypoint: vec![],
        cmd: vec!["/bin/sh".into()],
        exposed_ports: vec![],
        env,
        working_dir: None,
    }
}

/// The chart's simulated GPUs (`simulatedGpus`): the fake driver (`libcuda.so.1`,
/// `libnvidia-ml.so.1`) under `/opt/tessera/simulated/` and a static busybox, with which the
/// device plugin's init container installs them on the node. An image of its own, so the
/// device plugin's never carries a fake driver; the e2e and `make release` build it alike.
pub fn simulated_gpu_spec(
    names: Vec<String>,
    libcuda: &Path,
    libnvml: &Path,
    busybox: &Path,
) -> ImageSpec {
    ImageSpec {
        id: "tessera-simulated-gpu".into(),
        names,
        files: vec![
            ImageFile::host("/opt/tessera/simulated/libcuda.so.1", libcuda, 0o644),
            ImageFile::host("/opt/tessera/simulated/libnvidia-ml.so.1", libnvml, 0o644),
            ImageFile::host("/opt/tessera/bin/busybox", busybox, 0o755),
        ],
        user: None,
        entrypoint: vec!["/opt/tessera/bin/busybox".into()],
        cmd: vec!["true".into()],
        exposed_ports: vec![],
        env: vec![DISTROLESS_PATH.into()],
        working_dir: None,
    }
}

/// A built image tar.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuiltImage {
    pub id: String,
    pub names: Vec<String>,
    pub tar: PathBuf,
    /// `sha256:…` of the manifest (what `ctr images ls` shows as the digest).
    pub manifest_digest: String,
    /// Size of the tar in bytes.
    pub size: u64,
    /// Whether an earlier build with the same inputs was reused.
    pub reused: bool,
}

fn put(h: &mut Sha256, bytes: &[u8]) {
    h.update((bytes.len() as u64).to_le_bytes());
    h.update(bytes);
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A digest of everything an image is made of: the spec, and per host file its identity and
/// modification time (a rebuilt binary is a new file; hashing 300 MB of debug binaries per
/// cluster would cost more than the check saves), per C source its content.
pub fn input_key(spec: &ImageSpec) -> Result<String, ImageError> {
    let mut h = Sha256::new();
    put(&mut h, FORMAT.as_bytes());
    put(&mut h, spec.id.as_bytes());
    for list in [
        &spec.names,
        &spec.entrypoint,
        &spec.cmd,
        &spec.exposed_ports,
        &spec.env,
    ] {
        put(&mut h, &(list.len() as u64).to_le_bytes());
        for s in list {
            put(&mut h, s.as_bytes());
        }
    }
    put(&mut h, format!("{:?}", spec.user).as_bytes());
    put(&mut h, format!("{:?}", spec.working_dir).as_bytes());
    for f in &spec.files {
        put(&mut h, f.path_in_image.as_bytes());
        put(&mut h, &f.mode.to_le_bytes());
        match &f.source {
            ImageSource::HostFile(p) => {
                let m = std::fs::metadata(p).map_err(io(format!("{}", p.display())))?;
                put(&mut h, b"host");
                put(&mut h, p.as_os_str().as_encoded_bytes());
                for n in [
                    m.dev(),
                    m.ino(),
                    m.len(),
                    m.mtime() as u64,
                    m.mtime_nsec() as u64,
                ] {
                    h.update(n.to_le_bytes());
                }
            }
            ImageSource::Bytes(b) => {
                put(&mut h, b"bytes");
                put(&mut h, b);
            }
            ImageSource::Dir => put(&mut h, b"dir"),
            ImageSource::Symlink(t) => {
                put(&mut h, b"symlink");
                put(&mut h, t.as_bytes());
            }
            ImageSource::StaticC(p) => {
                put(&mut h, b"static-c");
                put(
                    &mut h,
                    &std::fs::read(p).map_err(io(format!("{}", p.display())))?,
                );
                put(&mut h, cc().as_bytes());
            }
        }
    }
    Ok(hex(&h.finalize())[..16].to_owned())
}

fn cc() -> String {
    std::env::var("CC").unwrap_or_else(|_| "cc".into())
}

/// Compiles a C program statically.
fn compile_static(src: &Path, out: &Path) -> Result<(), ImageError> {
    let libc_a = [
        "/usr/lib/x86_64-linux-gnu/libc.a",
        "/usr/lib/aarch64-linux-gnu/libc.a",
        "/usr/lib/libc.a",
        "/usr/lib64/libc.a",
    ];
    let result = Command::new(cc())
        .args(["-static", "-O2", "-s", "-o"])
        .arg(out)
        .arg(src)
        .output()
        .map_err(io(format!("running {}", cc())))?;
    if !result.status.success() {
        let hint = if libc_a.iter().any(|p| Path::new(p).exists()) {
            ""
        } else {
            " (glibc's static libc.a is missing: Debian's libc6-dev has it)"
        };
        return Err(msg(format!(
            "{} -static {} failed{hint}:\n{}",
            cc(),
            src.display(),
            String::from_utf8_lossy(&result.stderr)
        )));
    }
    Ok(())
}

enum Kind {
    Dir,
    File(PathBuf),
    Bytes(Vec<u8>),
    Symlink(String),
}

struct Entry {
    mode: u32,
    kind: Kind,
}

/// `/usr/bin/x` → `usr/bin/x`, refusing anything that could leave the root.
fn image_path(p: &str) -> Result<String, ImageError> {
    let path = Path::new(p);
    if !path.is_absolute() {
        return Err(msg(format!("image path {p:?} is not absolute")));
    }
    let mut parts = Vec::new();
    for c in path.components() {
        match c {
            Component::RootDir => {}
            Component::Normal(s) => parts.push(
                s.to_str()
                    .ok_or_else(|| msg(format!("image path {p:?} is not UTF-8")))?,
            ),
            _ => return Err(msg(format!("image path {p:?} is not normal"))),
        }
    }
    if parts.is_empty() {
        return Err(msg("an image file cannot be /"));
    }
    Ok(parts.join("/"))
}

/// A writer that hashes and counts what passes through.
struct Hashing<W> {
    inner: W,
    hash: Sha256,
    len: u64,
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        self.len += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

fn header(kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_mode(mode);
    h.set_size(size);
    h.set_mtime(MTIME);
    h.set_uid(0);
    h.set_gid(0);
    h
}

fn write_layer(entries: &BTreeMap<String, Entry>, out: &Path) -> Result<(String, u64), ImageError> {
    let file = std::fs::File::create(out).map_err(io(format!("creating {}", out.display())))?;
    let mut w = Hashing {
        inner: std::io::BufWriter::new(file),
        hash: Sha256::new(),
        len: 0,
    };
    {
        let mut b = tar::Builder::new(&mut w);
        for (path, e) in entries {
            let err = io(format!("layer entry {path}"));
            match &e.kind {
                Kind::Dir => {
                    let mut h = header(tar::EntryType::Directory, e.mode, 0);
                    b.append_data(&mut h, format!("{path}/"), std::io::empty())
                        .map_err(err)?;
                }
                Kind::Bytes(data) => {
                    let mut h = header(tar::EntryType::Regular, e.mode, data.len() as u64);
                    b.append_data(&mut h, path, data.as_slice()).map_err(err)?;
                }
                Kind::File(host) => {
                    let f = std::fs::File::open(host)
                        .map_err(io(format!("opening {}", host.display())))?;
                    let len = f
                        .metadata()
                        .map_err(io(format!("{}", host.display())))?
                        .len();
                    let mut h = header(tar::EntryType::Regular, e.mode, len);
                    // Exactly `len` bytes, even if the file grows meanwhile.
                    b.append_data(&mut h, path, f.take(len)).map_err(err)?;
                }
                Kind::Symlink(target) => {
                    let mut h = header(tar::EntryType::Symlink, 0o777, 0);
                    b.append_link(&mut h, path, target).map_err(err)?;
                }
            }
        }
        b.finish().map_err(io("finishing the layer"))?;
    }
    w.flush().map_err(io("writing the layer"))?;
    Ok((hex(&w.hash.finalize()), w.len))
}

/// JSON with every object's keys in sorted order: the OCI types keep some maps (exposed ports,
/// annotations) in `HashMap`s, whose order changes from run to run.
fn canonical_json<T: serde::Serialize>(value: &T) -> Result<Vec<u8>, ImageError> {
    fn sort(v: serde_json::Value) -> serde_json::Value {
        match v {
            serde_json::Value::Object(m) => {
                let sorted: BTreeMap<String, serde_json::Value> =
                    m.into_iter().map(|(k, v)| (k, sort(v))).collect();
                serde_json::Value::Object(sorted.into_iter().collect())
            }
            serde_json::Value::Array(a) => {
                serde_json::Value::Array(a.into_iter().map(sort).collect())
            }
            other => other,
        }
    }
    Ok(serde_json::to_vec(&sort(serde_json::to_value(value)?))?)
}

fn sha256_hex(data: &[u8]) -> String {
    hex(&Sha256::digest(data))
}

fn digest(hex: &str) -> Result<Sha256Digest, ImageError> {
    Ok(hex.parse::<Sha256Digest>()?)
}

fn this_arch() -> Arch {
    match std::env::consts::ARCH {
        "aarch64" => Arch::ARM64,
        _ => Arch::Amd64,
    }
}

/// The entries of a spec's layer: its files, their parent directories, C programs compiled into
/// `scratch`.
fn layout(spec: &ImageSpec, scratch: &Path) -> Result<BTreeMap<String, Entry>, ImageError> {
    let mut entries: BTreeMap<String, Entry> = BTreeMap::new();
    let mut explicit = BTreeSet::new();
    for f in &spec.files {
        let path = image_path(&f.path_in_image)?;
        let clash = || {
            msg(format!(
                "image {}: {} is given twice, or as a file and a directory",
                spec.id, f.path_in_image
            ))
        };
        if !explicit.insert(path.clone()) {
            return Err(clash());
        }
        let mut parent = Path::new(&path).parent();
        while let Some(p) = parent.filter(|p| !p.as_os_str().is_empty()) {
            let p_str = p.to_string_lossy().into_owned();
            match entries.get(&p_str) {
                Some(e) if !matches!(e.kind, Kind::Dir) => return Err(clash()),
                Some(_) => {}
                None => {
                    entries.insert(
                        p_str,
                        Entry {
                            mode: 0o755,
                            kind: Kind::Dir,
                        },
                    );
                }
            }
            parent = p.parent();
        }
        let kind = match &f.source {
            ImageSource::HostFile(p) => Kind::File(p.clone()),
            ImageSource::Bytes(b) => Kind::Bytes(b.clone()),
            ImageSource::Dir => Kind::Dir,
            ImageSource::Symlink(t) => Kind::Symlink(t.clone()),
            ImageSource::StaticC(src) => {
                let out = scratch.join(format!("{}.{}.bin", spec.id, entries.len()));
                compile_static(src, &out)?;
                Kind::File(out)
            }
        };
        // An implied parent directory may be given explicitly (for its mode), not replaced by a
        // file.
        if entries.contains_key(&path) && !matches!(kind, Kind::Dir) {
            return Err(clash());
        }
        entries.insert(path, Entry { mode: f.mode, kind });
    }
    Ok(entries)
}

/// What an image's config carries beyond its spec: the platform, the creation time and labels
/// (a release's; the e2e images have none and are of this machine's architecture).
#[derive(Debug, Clone, Default)]
pub struct ImageMeta {
    pub arch: Option<Arch>,
    /// RFC 3339; none: no `created` field, so the digest does not depend on the time.
    pub created: Option<String>,
    pub labels: std::collections::HashMap<String, String>,
}

/// The blobs of one single-platform image.
struct ImageBlobs {
    arch: Arch,
    config_json: Vec<u8>,
    manifest_json: Vec<u8>,
    layer_path: PathBuf,
    layer_hex: String,
    layer_len: u64,
}

impl ImageBlobs {
    fn manifest_descriptor(&self) -> Result<Descriptor, ImageError> {
        Ok(Descriptor::new(
            MediaType::ImageManifest,
            self.manifest_json.len() as u64,
            digest(&sha256_hex(&self.manifest_json))?,
        ))
    }

    fn platform(&self) -> Result<oci_spec::image::Platform, ImageError> {
        Ok(PlatformBuilder::default()
            .architecture(self.arch.clone())
            .os(Os::Linux)
            .build()?)
    }
}

/// The layer, config and manifest of `spec`, written or kept in `scratch`.
fn image_blobs(
    spec: &ImageSpec,
    meta: &ImageMeta,
    scratch: &Path,
) -> Result<ImageBlobs, ImageError> {
    let entries = layout(spec, scratch)?;
    let layer_path = scratch.join(format!("{}-layer.tar", spec.id));
    let (layer_hex, layer_len) = write_layer(&entries, &layer_path)?;
    let layer_digest = digest(&layer_hex)?;
    let arch = meta.arch.clone().unwrap_or_else(this_arch);

    let mut config = ConfigBuilder::default();
    if let Some(u) = &spec.user {
        config = config.user(u.clone());
    }
    if !spec.exposed_ports.is_empty() {
        config = config.exposed_ports(spec.exposed_ports.clone());
    }
    if !spec.env.is_empty() {
        config = config.env(spec.env.clone());
    }
    if !spec.entrypoint.is_empty() {
        config = config.entrypoint(spec.entrypoint.clone());
    }
    if !spec.cmd.is_empty() {
        config = config.cmd(spec.cmd.clone());
    }
    if let Some(w) = &spec.working_dir {
        config = config.working_dir(w.clone());
    }
    if !meta.labels.is_empty() {
        config = config.labels(meta.labels.clone());
    }
    let mut image_config = ImageConfigurationBuilder::default()
        .architecture(arch.clone())
        .os(Os::Linux)
        .config(config.build()?)
        .rootfs(
            RootFsBuilder::default()
                .typ("layers")
                .diff_ids(vec![format!("sha256:{layer_hex}")])
                .build()?,
        )
        .build()?;
    image_config.set_created(meta.created.clone());
    let config_json = canonical_json(&image_config)?;
    let config_hex = sha256_hex(&config_json);

    let manifest = ImageManifestBuilder::default()
        .schema_version(2u32)
        .media_type(MediaType::ImageManifest)
        .config(Descriptor::new(
            MediaType::ImageConfig,
            config_json.len() as u64,
            digest(&config_hex)?,
        ))
        .layers(vec![Descriptor::new(
            MediaType::ImageLayer,
            layer_len,
            layer_digest,
        )])
        .build()?;
    let manifest_json = canonical_json(&manifest)?;
    Ok(ImageBlobs {
        arch,
        config_json,
        manifest_json,
        layer_path,
        layer_hex,
        layer_len,
    })
}

/// Writes an OCI archive (`oci-layout`, `index.json`, then every blob) to `tmp_tar`; `extra`
/// are small blobs beside the images' (a nested index).
fn write_archive(
    tmp_tar: &Path,
    index_json: &[u8],
    images: &[ImageBlobs],
    extra: &[&[u8]],
) -> Result<(), ImageError> {
    let layout_json = br#"{"imageLayoutVersion":"1.0.0"}"#;
    let file =
        std::fs::File::create(tmp_tar).map_err(io(format!("creating {}", tmp_tar.display())))?;
    let mut b = tar::Builder::new(std::io::BufWriter::new(file));
    let err = || io(format!("writing {}", tmp_tar.display()));
    let small = |b: &mut tar::Builder<_>, path: &str, data: &[u8]| {
        let mut h = header(tar::EntryType::Regular, 0o644, data.len() as u64);
        b.append_data(&mut h, path, data)
    };
    small(&mut b, "oci-layout", layout_json).map_err(err())?;
    small(&mut b, "index.json", index_json).map_err(err())?;
    for d in ["blobs/", "blobs/sha256/"] {
        let mut h = header(tar::EntryType::Directory, 0o755, 0);
        b.append_data(&mut h, d, std::io::empty()).map_err(err())?;
    }
    for blob in extra {
        small(&mut b, &format!("blobs/sha256/{}", sha256_hex(blob)), blob).map_err(err())?;
    }
    for i in images {
        for json in [&i.config_json, &i.manifest_json] {
            small(&mut b, &format!("blobs/sha256/{}", sha256_hex(json)), json).map_err(err())?;
        }
        let layer = std::fs::File::open(&i.layer_path).map_err(err())?;
        let mut h = header(tar::EntryType::Regular, 0o644, i.layer_len);
        b.append_data(
            &mut h,
            format!("blobs/sha256/{}", i.layer_hex),
            layer.take(i.layer_len),
        )
        .map_err(err())?;
    }
    let mut w = b.into_inner().map_err(err())?;
    w.flush().map_err(err())?;
    Ok(())
}

/// An OCI image index of `manifests`.
fn image_index(manifests: Vec<Descriptor>) -> Result<ImageIndex, ImageError> {
    Ok(ImageIndexBuilder::default()
        .schema_version(2u32)
        .media_type(MediaType::ImageIndex)
        .manifests(manifests)
        .build()?)
}

/// A scratch directory beside `out_tar`.
fn scratch_beside(out_tar: &Path, id: &str) -> Result<tempfile::TempDir, ImageError> {
    let dir = out_tar
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(io(format!("creating {}", dir.display())))?;
    tempfile::Builder::new()
        .prefix(&format!(".{id}-build-"))
        .tempdir_in(dir)
        .map_err(io(format!("a scratch directory in {}", dir.display())))
}

fn finish(
    tmp_tar: &Path,
    out_tar: &Path,
    id: &str,
    names: &[String],
    digest_hex: String,
) -> Result<BuiltImage, ImageError> {
    std::fs::rename(tmp_tar, out_tar).map_err(io(format!("renaming to {}", out_tar.display())))?;
    let size = std::fs::metadata(out_tar)
        .map_err(io(format!("{}", out_tar.display())))?
        .len();
    Ok(BuiltImage {
        id: id.to_owned(),
        names: names.to_vec(),
        tar: out_tar.to_owned(),
        manifest_digest: format!("sha256:{digest_hex}"),
        size,
        reused: false,
    })
}

/// Builds `spec` into an OCI archive at `out_tar` (written to a temporary file beside it, then
/// renamed).
pub fn build_image(spec: &ImageSpec, out_tar: &Path) -> Result<BuiltImage, ImageError> {
    if spec.names.is_empty() {
        return Err(msg(format!("image {} has no name", spec.id)));
    }
    let scratch = scratch_beside(out_tar, &spec.id)?;
    let image = image_blobs(spec, &ImageMeta::default(), scratch.path())?;
    let platform = image.platform()?;
    let mut descriptors = Vec::new();
    for name in &spec.names {
        let mut d = image.manifest_descriptor()?;
        // One annotation per descriptor: a HashMap of one key serializes the same every time.
        d.set_annotations(Some(
            [(CONTAINERD_IMAGE_NAME.to_owned(), name.clone())].into(),
        ));
        d.set_platform(Some(platform.clone()));
        descriptors.push(d);
    }
    let index = image_index(descriptors)?;
    let tmp_tar = scratch.path().join("image.tar");
    write_archive(
        &tmp_tar,
        &canonical_json(&index)?,
        std::slice::from_ref(&image),
        &[],
    )?;
    let manifest_hex = sha256_hex(&image.manifest_json);
    finish(&tmp_tar, out_tar, &spec.id, &spec.names, manifest_hex)
}

/// Builds one image for several platforms into an OCI archive at `out_tar`: `index.json` holds
/// one image index (tagged `ref_name` with `org.opencontainers.image.ref.name`, and named `name`
/// for containerd) whose manifests are the platforms' images, as a registry serves a
/// multi-platform image (`skopeo copy --all oci-archive:<tar>:<ref_name> docker://…` pushes it).
/// The returned digest is the image index's: what a pod pins the image by.
pub fn build_multi_platform(
    id: &str,
    name: &str,
    ref_name: &str,
    platforms: &[(&ImageSpec, ImageMeta)],
    out_tar: &Path,
) -> Result<BuiltImage, ImageError> {
    let scratch = scratch_beside(out_tar, id)?;
    let mut images = Vec::new();
    let mut manifests = Vec::new();
    for (i, (spec, meta)) in platforms.iter().enumerate() {
        let dir = scratch.path().join(i.to_string());
        std::fs::create_dir_all(&dir).map_err(io(format!("creating {}", dir.display())))?;
        let image = image_blobs(spec, meta, &dir)?;
        let mut d = image.manifest_descriptor()?;
        d.set_platform(Some(image.platform()?));
        manifests.push(d);
        images.push(image);
    }
    let nested = image_index(manifests)?;
    let nested_json = canonical_json(&nested)?;
    let nested_hex = sha256_hex(&nested_json);
    let mut top = Descriptor::new(
        MediaType::ImageIndex,
        nested_json.len() as u64,
        digest(&nested_hex)?,
    );
    top.set_annotations(Some(
        [
            (
                "org.opencontainers.image.ref.name".to_owned(),
                ref_name.to_owned(),
            ),
            (CONTAINERD_IMAGE_NAME.to_owned(), name.to_owned()),
        ]
        .into(),
    ));
    let index = image_index(vec![top])?;
    let tmp_tar = scratch.path().join("image.tar");
    write_archive(&tmp_tar, &canonical_json(&index)?, &images, &[&nested_json])?;
    finish(&tmp_tar, out_tar, id, &[name.to_owned()], nested_hex)
}

/// What an OCI archive holds: `index.json` and, by digest, the small blobs (manifests and
/// configs; layers are only listed, with their sizes).
#[derive(Debug)]
pub struct ArchiveContents {
    pub oci_layout: Option<Vec<u8>>,
    pub index: ImageIndex,
    /// `sha256:…` → bytes, for blobs under 1 MiB.
    pub small_blobs: BTreeMap<String, Vec<u8>>,
    /// `sha256:…` → (size, whether the content hashes to its name), for every blob.
    pub blobs: BTreeMap<String, (u64, bool)>,
    /// Entry paths in archive order.
    pub paths: Vec<String>,
}

impl ArchiveContents {
    pub fn manifest(&self, digest: &str) -> Result<ImageManifest, ImageError> {
        let b = self
            .small_blobs
            .get(digest)
            .ok_or_else(|| msg(format!("no blob {digest}")))?;
        Ok(ImageManifest::from_reader(b.as_slice())?)
    }

    pub fn config(&self, digest: &str) -> Result<ImageConfiguration, ImageError> {
        let b = self
            .small_blobs
            .get(digest)
            .ok_or_else(|| msg(format!("no blob {digest}")))?;
        Ok(ImageConfiguration::from_reader(b.as_slice())?)
    }
}

/// Reads an OCI archive back, checking every blob's digest.
pub fn read_archive(tar_path: &Path) -> Result<ArchiveContents, ImageError> {
    let file = std::fs::File::open(tar_path).map_err(io(format!("{}", tar_path.display())))?;
    let mut ar = tar::Archive::new(std::io::BufReader::new(file));
    let mut index = None;
    let mut oci_layout = None;
    let mut small_blobs = BTreeMap::new();
    let mut blobs = BTreeMap::new();
    let mut paths = Vec::new();
    let err = || io(format!("reading {}", tar_path.display()));
    for entry in ar.entries().map_err(err())? {
        let mut entry = entry.map_err(err())?;
        let path = entry.path().map_err(err())?.to_string_lossy().into_owned();
        paths.push(path.clone());
        if path == "index.json" {
            let mut b = Vec::new();
            entry.read_to_end(&mut b).map_err(err())?;
            index = Some(ImageIndex::from_reader(b.as_slice())?);
        } else if path == "oci-layout" {
            let mut b = Vec::new();
            entry.read_to_end(&mut b).map_err(err())?;
            oci_layout = Some(b);
        } else if let Some(name) = path.strip_prefix("blobs/sha256/").filter(|n| !n.is_empty()) {
            let size = entry.header().size().map_err(err())?;
            let mut h = Sha256::new();
            let mut keep = Vec::new();
            let mut buf = vec![0u8; 1 << 16];
            loop {
                let n = entry.read(&mut buf).map_err(err())?;
                if n == 0 {
                    break;
                }
                h.update(&buf[..n]);
                if size < (1 << 20) {
                    keep.extend_from_slice(&buf[..n]);
                }
            }
            let ok = hex(&h.finalize()) == name;
            let key = format!("sha256:{name}");
            if size < (1 << 20) {
                small_blobs.insert(key.clone(), keep);
            }
            blobs.insert(key, (size, ok));
        }
    }
    Ok(ArchiveContents {
        oci_layout,
        index: index.ok_or_else(|| msg(format!("{}: no index.json", tar_path.display())))?,
        small_blobs,
        blobs,
        paths,
    })
}

/// The manifest digest and names an archive's `index.json` gives (cheap: index.json is the
/// second entry).
fn read_index(tar_path: &Path) -> Result<(String, Vec<String>), ImageError> {
    let file = std::fs::File::open(tar_path).map_err(io(format!("{}", tar_path.display())))?;
    let mut ar = tar::Archive::new(file);
    let err = || io(format!("reading {}", tar_path.display()));
    for entry in ar.entries().map_err(err())? {
        let mut entry = entry.map_err(err())?;
        if entry.path().map_err(err())?.as_os_str() == "index.json" {
            let mut b = Vec::new();
            entry.read_to_end(&mut b).map_err(err())?;
            let index = ImageIndex::from_reader(b.as_slice())?;
            let digest = index
                .manifests()
                .first()
                .map(|d| d.digest().to_string())
                .ok_or_else(|| msg(format!("{}: empty index", tar_path.display())))?;
            let names = index
                .manifests()
                .iter()
                .filter_map(|d| {
                    d.annotations()
                        .as_ref()?
                        .get(CONTAINERD_IMAGE_NAME)
                        .cloned()
                })
                .collect();
            return Ok((digest, names));
        }
    }
    Err(msg(format!("{}: no index.json", tar_path.display())))
}

/// Builds `spec` into `out_dir/<id>-<names key>-<input key>.tar` unless that file is already
/// there (same inputs), and removes the stale tars of earlier inputs under the same names.
pub fn build_cached(spec: &ImageSpec, out_dir: &Path) -> Result<BuiltImage, ImageError> {
    let key = input_key(spec)?;
    // Callers that name an image differently (extra tags) keep their own tars: neither prunes
    // the other's.
    let mut names_hash = Sha256::new();
    for n in &spec.names {
        put(&mut names_hash, n.as_bytes());
    }
    let names_key = hex(&names_hash.finalize())[..8].to_owned();
    let prefix = format!("{}-{names_key}-", spec.id);
    let tar = out_dir.join(format!("{prefix}{key}.tar"));
    if tar.is_file()
        && let Ok((manifest_digest, names)) = read_index(&tar)
        && names == spec.names
    {
        let size = std::fs::metadata(&tar)
            .map_err(io(format!("{}", tar.display())))?
            .len();
        return Ok(BuiltImage {
            id: spec.id.clone(),
            names,
            tar,
            manifest_digest,
            size,
            reused: true,
        });
    }
    let built = build_image(spec, &tar)?;
    if let Ok(dir) = std::fs::read_dir(out_dir) {
        for e in dir.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let stale = name
                .strip_prefix(&prefix)
                .and_then(|rest| rest.strip_suffix(".tar"))
                .is_some_and(|k| k.len() == 16 && k.bytes().all(|c| c.is_ascii_hexdigit()));
            if stale && e.path() != tar {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    Ok(built)
}

/// An image as registry.k8s.io/kube-scheduler is made: `binary` at /usr/local/bin on a
/// distroless base; the chart runs `command: [kube-scheduler, …]`, found through PATH. The Go
/// build is static (CGO_ENABLED=0); should it not be, its libraries come along.
fn kube_scheduler_spec(
    id: &str,
    binary: &Path,
    names: Vec<String>,
) -> Result<ImageSpec, ImageError> {
    let mut files = distroless_cc(&[binary])?;
    files.push(ImageFile::host(
        "/usr/local/bin/kube-scheduler",
        binary,
        0o755,
    ));
    Ok(ImageSpec {
        id: id.into(),
        names,
        files,
        user: None,
        entrypoint: vec!["/usr/local/bin/kube-scheduler".into()],
        cmd: vec![],
        exposed_ports: vec![],
        env: vec![DISTROLESS_PATH.to_owned(), DISTROLESS_SSL.to_owned()],
        working_dir: None,
    })
}

/// The newer kube-scheduler ([`Artifacts::kube_scheduler_next`]) as
/// `registry.k8s.io/kube-scheduler:<its release>`: what the chart's `kubeScheduler.image.tag`
/// set to that release runs.
pub fn build_kube_scheduler_next(a: &Artifacts, out_dir: &Path) -> Result<BuiltImage, ImageError> {
    std::fs::create_dir_all(out_dir).map_err(io(format!("creating {}", out_dir.display())))?;
    let spec = kube_scheduler_spec(
        "kube-scheduler-next",
        &a.kube_scheduler_next,
        vec![format!(
            "registry.k8s.io/kube-scheduler:{}",
            a.kube_scheduler_next_version
        )],
    )?;
    build_cached(&spec, out_dir)
}

/// Kueue's manager ([`Artifacts::kueue`]) as its release image is made: `/manager` on a
/// distroless/static base, run as `nonroot` (the chart asks for `runAsNonRoot`), under the
/// name `registry.k8s.io/kueue/kueue:<release>` that the test's chart values name.
pub fn build_kueue(a: &Artifacts, out_dir: &Path) -> Result<BuiltImage, ImageError> {
    std::fs::create_dir_all(out_dir).map_err(io(format!("creating {}", out_dir.display())))?;
    let mut files = distroless_static();
    files.push(ImageFile::host("/manager", &a.kueue, 0o755));
    let spec = ImageSpec {
        id: "kueue".into(),
        names: vec![format!("{KUEUE_REPOSITORY}:{}", a.kueue_version)],
        files,
        user: Some("65532:65532".into()),
        entrypoint: vec!["/manager".into()],
        cmd: vec![],
        exposed_ports: vec![],
        env: vec![DISTROLESS_PATH.to_owned(), DISTROLESS_SSL.to_owned()],
        working_dir: None,
    };
    build_cached(&spec, out_dir)
}

/// The repository of [`build_kueue`]'s image.
pub const KUEUE_REPOSITORY: &str = "registry.k8s.io/kueue/kueue";

/// The previous release's two Tessera images ([`crate::artifacts::PreviousRelease`]): its
/// device plugin (with its shim) and its scheduler, each only under
/// `ghcr.io/tessera-gpu/<repository>:<its tag>`, so they never shadow the current ones.
pub fn build_previous_release(
    a: &Artifacts,
    previous: &crate::artifacts::PreviousRelease,
    out_dir: &Path,
) -> Result<Vec<BuiltImage>, ImageError> {
    std::fs::create_dir_all(out_dir).map_err(io(format!("creating {}", out_dir.display())))?;
    let host = HostInputs {
        tessera_scheduler: previous.tessera_scheduler.clone(),
        tessera_device_plugin: previous.tessera_device_plugin.clone(),
        tessera_dra_plugin: previous.tessera_dra_plugin.clone(),
        shim: previous.shim.clone(),
        ..HostInputs::from_artifacts(a)?
    };
    let tag = previous.tag();
    specs_for(&host, &ImageNames::default())?
        .into_iter()
        .filter_map(|mut spec| {
            let repository = match spec.id.as_str() {
                "tessera-device-plugin" | "tessera-scheduler" => spec.id.clone(),
                _ => return None,
            };
            spec.names = vec![format!("ghcr.io/tessera-gpu/{repository}:{tag}")];
            spec.id = format!("{repository}-previous");
            Some(build_cached(&spec, out_dir))
        })
        .collect()
}

/// Builds (or reuses) every image of [`image_specs`] into `out_dir`.
pub fn build_all(
    a: &Artifacts,
    names: &ImageNames,
    out_dir: &Path,
) -> Result<Vec<BuiltImage>, ImageError> {
    std::fs::create_dir_all(out_dir).map_err(io(format!("creating {}", out_dir.display())))?;
    image_specs(a, names)?
        .iter()
        .map(|s| build_cached(s, out_dir))
        .collect()
}

/// `ctr -a <address> -n k8s.io images import [flags] <tar>`: how a node's containerd gets an
/// image (the CRI plugin's namespace; unpacked for the default snapshotter unless `flags` say
/// otherwise, e.g. `["--snapshotter", "native"]`).
pub fn ctr_import(address: &Path, flags: &[&str], tar: &Path) -> Command {
    let mut c = Command::new("ctr");
    c.arg("-a")
        .arg(address)
        .args(["-n", "k8s.io", "images", "import"])
        .args(flags)
        .arg(tar);
    c
}

#[cfg(test)]
mod tests;

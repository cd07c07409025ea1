//! Harness of `libvgpu-shim`'s integration tests and overhead bench: builds `libvgpu.so` and
//! the fake driver libraries, exposes the fakes under their real names in a temp dir, compiles
//! the C probe (`libvgpu-shim/tests/c/cuda_probe.c`) with `cc`, and runs it under `LD_PRELOAD`
//! with a clean environment.
//!
//! A crate rather than a module of the shim's tests so that the bench, a separate target, uses
//! the same code.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

/// The shim's package directory: the harness builds that package and compiles its C probe.
/// Found at run time from the package under test ([`test_paths`]): a compiled-in path is the
/// checkout this harness was built in, which a target directory shared by two checkouts (a CI
/// clone and a working tree) silently points at, and which was gone once that clone was.
fn shim_dir() -> PathBuf {
    test_paths::workspace_root().join("libvgpu-shim")
}

/// What [`artifacts`] built: a directory with the fakes under their real names (the
/// `LD_LIBRARY_PATH` of a probe), the shim to preload, and the compiled probe.
#[derive(Debug)]
pub struct Artifacts {
    pub dir: PathBuf,
    pub shim: PathBuf,
    pub probe: PathBuf,
}

fn target_dir() -> PathBuf {
    // target/<profile>/deps/<test-binary>
    let exe = std::env::current_exe().expect("current exe");
    exe.parent()
        .and_then(Path::parent)
        .expect("target profile dir")
        .to_path_buf()
}

/// Builds the shim and the fakes. Cargo does not build a `cdylib`-only package's library for
/// its own integration tests, so without this the tests could load a stale `libvgpu.so`. The
/// nested build uses its own target dir (`<target>/shim-tests`): the outer cargo may still hold
/// the lock on the main one.
fn build_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let profile_dir = target_dir();
        let release = profile_dir.file_name().is_some_and(|n| n == "release");
        let target = profile_dir.parent().expect("target dir").join("shim-tests");
        let mut cmd = Command::new(env!("CARGO"));
        cmd.args([
            "build",
            "-p",
            "libvgpu-shim",
            "-p",
            "fake-cuda",
            "-p",
            "fake-nvml",
        ])
        .arg("--manifest-path")
        .arg(shim_dir().join("Cargo.toml"))
        .env("CARGO_TARGET_DIR", &target);
        if release {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("run cargo build");
        assert!(status.success(), "cargo build of the shim and fakes failed");
        target.join(if release { "release" } else { "debug" })
    })
    .clone()
}

fn find_built(name: &str) -> Option<PathBuf> {
    let p = build_dir().join(name);
    p.is_file().then_some(p)
}

pub fn artifacts() -> &'static Artifacts {
    static A: OnceLock<Artifacts> = OnceLock::new();
    A.get_or_init(|| {
        // Under the nested build's target dir (so `cargo clean` removes it), one per test binary.
        let dir = build_dir().join(format!("probe-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let cuda = find_built("libcuda.so").expect("libcuda.so built");
        let nvml = find_built("libnvidia_ml.so").expect("libnvidia_ml.so built");
        let shim = find_built("libvgpu.so").expect("libvgpu.so built");
        for (src, names) in [
            (&cuda, &["libcuda.so.1", "libcuda.so"][..]),
            (&nvml, &["libnvidia-ml.so.1"][..]),
        ] {
            for n in names {
                let dst = dir.join(n);
                let _ = std::fs::remove_file(&dst);
                std::os::unix::fs::symlink(src, &dst).expect("symlink");
            }
        }
        let probe = dir.join("cuda_probe");
        let src = shim_dir().join("tests/c/cuda_probe.c");
        let out = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
            .args(["-O1", "-Wall", "-o"])
            .arg(&probe)
            .arg(&src)
            .arg(format!("-L{}", dir.display()))
            .args(["-lcuda", "-ldl"])
            .output()
            .expect("run cc");
        assert!(
            out.status.success(),
            "cc failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Artifacts { dir, shim, probe }
    })
}

/// A probe command with a clean environment: the shim preloaded, the fakes on the library
/// path, a private region file.
pub fn probe(cache: &Path, vars: &[(&str, &str)], args: &[&str]) -> Command {
    let a = artifacts();
    let mut cmd = Command::new(&a.probe);
    cmd.args(args)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("LD_LIBRARY_PATH", &a.dir)
        .env("LD_PRELOAD", &a.shim)
        .env("CUDA_DEVICE_MEMORY_SHARED_CACHE", cache)
        .env("FAKE_CUDA_MEMORY_MIB", "1024");
    for (k, v) in vars {
        cmd.env(k, v);
    }
    cmd
}

/// Runs a probe to completion, collecting its output.
pub fn run(cmd: &mut Command) -> Output {
    cmd.output().expect("run probe")
}

/// A probe's status, stdout and stderr, for assertion messages.
pub fn text(out: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Fails the test with the probe's output unless it exited successfully.
pub fn assert_ok(out: &Output) {
    assert!(out.status.success(), "{}", text(out));
}

pub const MIB: u64 = 1 << 20;

/// The switch CI sets (`TESSERA_NO_SKIP=1`) so that no test passes without having run.
pub const NO_SKIP_ENV: &str = "TESSERA_NO_SKIP";

/// A test (or half of one) that cannot run on this machine says why and returns; with
/// [`NO_SKIP_ENV`] set to `1`, as CI sets it, the skip is a failure instead.
pub fn skip(why: &str) {
    if std::env::var_os(NO_SKIP_ENV).is_some_and(|v| v == "1") {
        panic!("{why}: {NO_SKIP_ENV}=1 makes this skip a failure");
    }
    eprintln!("skipped: {why}");
}

/// The region file at `cache`, decoded (the test fails if it is missing or not a valid region).
pub fn region_snapshot(cache: &Path) -> vgpu_region::RegionSnapshot {
    let bytes = std::fs::read(cache).expect("read region");
    vgpu_region::RegionSnapshot::parse(&bytes).expect("a valid region")
}

/// Child processes killed and reaped when dropped, so a test that fails before collecting
/// them leaves none behind.
#[derive(Debug)]
pub struct Children(pub Vec<std::process::Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

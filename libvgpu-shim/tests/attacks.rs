//! The attacks a security review demonstrated against the shim, performed again: each test does
//! what the attack did and shows it now does no harm (README, "Attacks the shim resists").

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use shim_harness::*;

const LIMIT_64M: &[(&str, &str)] = &[("CUDA_DEVICE_MEMORY_LIMIT", "64m")];

fn limit_64m() -> String {
    (64 * MIB).to_string()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A root-owned file the attacker wants changed: its bytes and mode must survive.
fn victim(dir: &Path) -> (PathBuf, Vec<u8>) {
    let p = dir.join("victim");
    let bytes = b"root:secret\n".to_vec();
    std::fs::write(&p, &bytes).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    (p, bytes)
}

fn assert_untouched(p: &Path, bytes: &[u8]) {
    let m = std::fs::metadata(p).unwrap();
    assert_eq!(m.mode() & 0o7777, 0o600, "mode of {} changed", p.display());
    assert_eq!(
        std::fs::read(p).unwrap(),
        bytes,
        "{} was written",
        p.display()
    );
}

/// Attack 1: the region path is a symlink to a root-owned file. HAMi-core and the old shim
/// followed it, then `fchmod 0666` and `ftruncate` made the target a world-writable 2 MB file.
/// Now the link is not followed, the target is untouched, and the process still enforces its
/// limit (private accounting), without aborting.
#[test]
fn a_symlinked_region_file_is_not_followed_and_its_target_untouched() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let (target, bytes) = victim(dir.path());
    let cache = dir.path().join("region.cache");
    std::os::unix::fs::symlink(&target, &cache).unwrap();
    let out = run(&mut probe(&cache, LIMIT_64M, &["limit", &limit_64m()]));
    assert_ok(&out);
    assert!(stderr(&out).contains("symbolic link"), "{}", text(&out));
    assert_untouched(&target, &bytes);
    // A dangling link: the old `open(O_CREAT)` created its target, anywhere.
    let elsewhere = dir.path().join("created-through-the-link");
    let dangling = dir.path().join("dangling.cache");
    std::os::unix::fs::symlink(&elsewhere, &dangling).unwrap();
    assert_ok(&run(&mut probe(
        &dangling,
        LIMIT_64M,
        &["limit", &limit_64m()],
    )));
    assert!(!elsewhere.exists(), "the link's target was created");
}

/// The same through a hard link (same inode, so `O_NOFOLLOW` alone would not stop it).
#[test]
fn a_hard_linked_region_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (target, bytes) = victim(dir.path());
    let cache = dir.path().join("region.cache");
    std::fs::hard_link(&target, &cache).unwrap();
    let out = run(&mut probe(&cache, LIMIT_64M, &["limit", &limit_64m()]));
    assert_ok(&out);
    assert!(stderr(&out).contains("hard links"), "{}", text(&out));
    assert_untouched(&target, &bytes);
}

/// Not a regular file (a FIFO would have blocked `open`; a directory or device is refused), or a
/// regular file owned by another user: refused without blocking, limits still enforced.
#[test]
fn fifos_and_files_of_other_users_are_refused_without_blocking() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo.cache");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo on a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o666) }, 0);
    let out = run(&mut probe(&fifo, LIMIT_64M, &["limit", &limit_64m()]));
    assert_ok(&out);
    assert!(
        stderr(&out).contains("not a regular file"),
        "{}",
        text(&out)
    );

    let other = dir.path().join("other.cache");
    std::fs::write(&other, b"x").unwrap();
    std::os::unix::fs::chown(&other, Some(4242), Some(4242)).unwrap();
    std::fs::set_permissions(&other, std::fs::Permissions::from_mode(0o666)).unwrap();
    let out = run(&mut probe(&other, LIMIT_64M, &["limit", &limit_64m()]));
    assert_ok(&out);
    assert!(stderr(&out).contains("owned by uid 4242"), "{}", text(&out));
    assert_eq!(std::fs::read(&other).unwrap(), b"x");
}

/// No world-writable file without a reason: a region file created by root is 0666 (the
/// container's other users share it), one created by another user 0600 (nobody else would
/// accept it); neither depends on the umask.
#[test]
fn created_region_files_have_exactly_the_documented_mode() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let by_root = dir.path().join("root.cache");
    assert_ok(&run(&mut probe(
        &by_root,
        LIMIT_64M,
        &["limit", &limit_64m()],
    )));
    assert_eq!(std::fs::metadata(&by_root).unwrap().mode() & 0o7777, 0o666);

    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        skip("not root: the other-user half");
        return;
    }
    // The other user must be able to reach the probe, the shim and the fakes: a checkout under
    // a root-only directory (e.g. /root) hides them from uid 65534.
    let a = shim_harness::artifacts();
    let reachable = [&a.probe, &a.shim, &a.dir].iter().all(|p| {
        p.ancestors().skip(1).all(|d| {
            std::fs::metadata(d).is_ok_and(|m| d.as_os_str().is_empty() || m.mode() & 0o001 != 0)
        })
    });
    if !reachable {
        skip(
            "the build outputs are not reachable by uid 65534 here (a target directory under a \
             root-only directory): the other-user half",
        );
        return;
    }
    use std::os::unix::process::CommandExt;
    let by_user = dir.path().join("user.cache");
    let out = run(probe(&by_user, LIMIT_64M, &["limit", &limit_64m()])
        .uid(65534)
        .gid(65534));
    assert_ok(&out);
    let m = std::fs::metadata(&by_user).unwrap();
    assert_eq!((m.uid(), m.mode() & 0o7777), (65534, 0o600));
}

/// Runs `cmd` in a private mount namespace where `/usr/local/vgpu` is a fresh tmpfs holding
/// `limits` as `vgpu-limits` (root-owned, mode `mode`), bind-mounted read-only over itself when
/// `read_only`, as the device plugin's `Allocate` mounts it. `None` when mount namespaces are
/// not available here (not root, no `unshare`).
fn with_limits_file(cmd: &Command, limits: &str, mode: u32, read_only: bool) -> Option<Output> {
    let script = format!(
        "set -e; mount -t tmpfs tmpfs /usr/local/vgpu; printf '%s' \"$LIMITS\" > {f}; chmod {mode:o} {f}; \
         {ro} exec \"$@\"",
        f = "/usr/local/vgpu/vgpu-limits",
        ro = if read_only {
            "mount --bind /usr/local/vgpu/vgpu-limits /usr/local/vgpu/vgpu-limits; \
             mount -o remount,bind,ro /usr/local/vgpu/vgpu-limits;"
        } else {
            ""
        }
    );
    let probe_check = Command::new("unshare")
        .args([
            "-m",
            "sh",
            "-c",
            "mkdir -p /usr/local/vgpu && mount -t tmpfs tmpfs /usr/local/vgpu",
        ])
        .output()
        .ok()?;
    if !probe_check.status.success() {
        skip(&format!(
            "mount namespaces unavailable ({})",
            String::from_utf8_lossy(&probe_check.stderr)
        ));
        return None;
    }
    let mut wrapped = Command::new("unshare");
    wrapped
        .args(["-m", "sh", "-c", &script, "sh"])
        .arg(cmd.get_program())
        .args(cmd.get_args())
        .env_clear();
    for (k, v) in cmd.get_envs() {
        if let Some(v) = v {
            wrapped.env(k, v);
        }
    }
    wrapped.env("LIMITS", limits);
    Some(wrapped.output().expect("run unshare"))
}

fn total_of(out: &Output) -> u64 {
    let stdout = String::from_utf8_lossy(&out.stdout);
    stdout
        .split_whitespace()
        .find_map(|w| w.strip_prefix("total="))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no total in {}", text(out)))
}

/// What the node writes, the shim reads: the limits file the node agent builds for a container
/// booked 1536 MiB and 30 % of a GPU (`Allocate` and DRA prepare build it the same way), mounted
/// as the node mounts it, is what the shim enforces, whatever the container's environment says.
#[test]
fn the_limits_file_the_node_writes_is_what_the_shim_enforces() {
    let dir = tempfile::tempdir().unwrap();
    let settings = tessera_node::testing::response_settings(Path::new("/usr/local"));
    let booked = [hami_contract::devices::ContainerDevice {
        uuid: "GPU-protocol-0".into(),
        vendor: "NVIDIA".into(),
        usedmem: 1536,
        usedcores: 30,
    }];
    let response = tessera_node::container_env::shim_response(
        &booked,
        dir.path().display().to_string(),
        "protocol-test",
        false,
        false,
        &settings,
    )
    .expect("a response for one booked GPU");
    let environment = [
        ("FAKE_CUDA_MEMORY_MIB", "16384"),
        ("CUDA_DEVICE_MEMORY_LIMIT_0", "16384m"),
    ];
    let cmd = probe(&dir.path().join("unused.cache"), &environment, &["info"]);
    let Some(out) = with_limits_file(&cmd, &response.limits_file.content, 0o444, true) else {
        return;
    };
    assert_ok(&out);
    assert_eq!(total_of(&out), 1536 * MIB, "{}", text(&out));
}

/// Attack 2a: inside the container, point `CUDA_DEVICE_MEMORY_SHARED_CACHE` at a new file and
/// raise `CUDA_DEVICE_MEMORY_LIMIT_0`: the review saw 16384 MiB against a 1024 MiB limit. With
/// the device plugin's read-only limits file, the environment's values are ignored (and said to
/// be), the plugin's region path is used, and a region file rewritten to larger limits is put
/// back.
#[test]
fn in_container_environment_overrides_do_not_lift_the_plugins_limits() {
    let dir = tempfile::tempdir().unwrap();
    let plugin_cache = dir.path().join("plugin.cache");
    let attacker_cache = dir.path().join("attacker.cache");
    let limits = format!(
        "CUDA_DEVICE_MEMORY_LIMIT_0=1024m\nCUDA_DEVICE_SM_LIMIT=100\nCUDA_DEVICE_MEMORY_SHARED_CACHE={}\n",
        plugin_cache.display()
    );
    let attack = [
        ("FAKE_CUDA_MEMORY_MIB", "16384"),
        ("CUDA_DEVICE_MEMORY_LIMIT_0", "16384m"),
        ("CUDA_DEVICE_MEMORY_LIMIT", "16g"),
    ];
    let cmd = probe(&attacker_cache, &attack, &["info"]);
    let Some(out) = with_limits_file(&cmd, &limits, 0o444, true) else {
        return;
    };
    assert_ok(&out);
    assert_eq!(total_of(&out), 1024 * MIB, "{}", text(&out));
    assert!(stderr(&out).contains("ignoring"), "{}", text(&out));
    assert!(
        !attacker_cache.exists(),
        "the environment's region path was used"
    );
    let region = std::fs::read(&plugin_cache).expect("the plugin's region file");
    let limit_at = |b: &[u8]| {
        u64::from_ne_bytes(
            b[vgpu_region::offset::LIMIT..vgpu_region::offset::LIMIT + 8]
                .try_into()
                .unwrap(),
        )
    };
    assert_eq!(limit_at(&region), 1024 * MIB);

    // The region file is writable in the container: raise its limit there. Still 1024 MiB, and
    // the region's copy (what the monitor reads) is restored.
    let mut forged = region.clone();
    forged[vgpu_region::offset::LIMIT..vgpu_region::offset::LIMIT + 8]
        .copy_from_slice(&(16384 * MIB).to_ne_bytes());
    std::fs::write(&plugin_cache, &forged).unwrap();
    let out = with_limits_file(&cmd, &limits, 0o444, true).unwrap();
    assert_ok(&out);
    assert_eq!(total_of(&out), 1024 * MIB, "{}", text(&out));
    assert_eq!(limit_at(&std::fs::read(&plugin_cache).unwrap()), 1024 * MIB);

    // Allocation is held to the file's limit too (64 MiB here, whatever the environment says).
    let small = limits.replace("1024m", "64m");
    let cmd = probe(
        &attacker_cache,
        &[("CUDA_DEVICE_MEMORY_LIMIT_0", "16384m")],
        &["limit", &limit_64m()],
    );
    assert_ok(&with_limits_file(&cmd, &small, 0o444, true).unwrap());
}

/// A limits file the container could have written itself (writable, or on a writable mount) is
/// not the plugin's: ignored with a warning, and the environment is read as under HAMi.
#[test]
fn a_limits_file_the_container_could_write_is_ignored() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("c.cache");
    let limits = "CUDA_DEVICE_MEMORY_LIMIT_0=16384m\n";
    let cmd = probe(
        &cache,
        &[
            ("FAKE_CUDA_MEMORY_MIB", "16384"),
            ("CUDA_DEVICE_MEMORY_LIMIT_0", "1024m"),
        ],
        &["info"],
    );
    for (mode, ro) in [(0o666, true), (0o444, false)] {
        let Some(out) = with_limits_file(&cmd, limits, mode, ro) else {
            return;
        };
        assert_ok(&out);
        assert_eq!(
            total_of(&out),
            1024 * MIB,
            "mode {mode:o} ro {ro}: {}",
            text(&out)
        );
        assert!(
            stderr(&out).contains("not the device plugin's"),
            "{}",
            text(&out)
        );
        let _ = std::fs::remove_file(&cache);
    }
}

/// Attack 2b: the legacy `cuMemAlloc` (pre-3.2 ABI) was not counted: 7 × 1536 MiB under a
/// 1024 MiB limit. Every legacy allocation symbol, reached directly, through `dlsym` and through
/// `cuGetProcAddress` with version 3010, is now counted and refused past the limit.
#[test]
fn legacy_v1_allocation_entry_points_are_counted_every_way_they_are_reached() {
    let dir = tempfile::tempdir().unwrap();
    let limit = (1024 * MIB).to_string();
    let out = run(&mut probe(
        &dir.path().join("c.cache"),
        &[
            ("CUDA_DEVICE_MEMORY_LIMIT", "1024m"),
            ("FAKE_CUDA_MEMORY_MIB", "16384"),
        ],
        &["legacy", &limit],
    ));
    assert_ok(&out);
}

/// Attack 3 (fork safety): a forked child is charged in its own slot, not for its parent's
/// allocations, gets the parent's share back when the parent exits, and what it holds counts
/// for the rest of the container.
#[test]
fn forked_children_are_counted_after_the_parent_exits() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("f.cache");
    let out = run(&mut probe(&cache, LIMIT_64M, &["forkexit", &limit_64m()]));
    assert_ok(&out);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("child OK") && !stdout.contains("FAIL"),
        "{}",
        text(&out)
    );
    let snap = vgpu_region::RegionSnapshot::parse(&std::fs::read(&cache).unwrap()).unwrap();
    assert_eq!(snap.live_procs().count(), 0, "every slot released at exit");
    assert_eq!(snap.device_usage(0), 0);
}

/// Fork while other threads allocate and free: no child inherits a lock held by a thread that
/// does not exist in it (each child allocates, frees and exits within 10 s).
#[test]
fn forking_while_threads_allocate_never_deadlocks_the_child() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(&mut probe(
        &dir.path().join("s.cache"),
        LIMIT_64M,
        &["forkstorm", &limit_64m()],
    ));
    assert_ok(&out);
}

/// Issue 28 (a known limit of any preloaded library, docs/security.md): a second copy of the
/// driver loaded with `dlmopen` into a new link-map namespace, where no preload is loaded,
/// allocates past the limit unseen by the shim. The region still lists the process, with none
/// of that memory, so the region cannot be trusted to tell; the driver's own per-process count
/// (what NVML reports) shows all of it, and that is what the device plugin compares with the
/// booking (`tessera_node_core::unaccounted::over_booked`). The fake driver allows the second
/// copy; NVIDIA's driver 580 on an H200 refuses it (`cuInit` 304: `e2e/gpu/run.sh` check 8), so
/// on real GPUs this stands for the class (raw driver calls, a forged slot), not a live route.
#[test]
fn a_second_driver_copy_escapes_the_shims_count_but_not_the_drivers() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("b.cache");
    let state = dir.path().join("gpu.state");
    let report = dir.path().join("held");
    let gpu = fake_gpu_state::open_path(Some(state.clone().into_os_string())).expect("state");
    let mut child = probe(
        &cache,
        &[
            ("CUDA_DEVICE_MEMORY_LIMIT", "1024m"),
            ("FAKE_CUDA_MEMORY_MIB", "16384"),
            ("FAKE_GPU_STATE", state.to_str().unwrap()),
        ],
        &["bypass", "3000", report.to_str().unwrap()],
    )
    .stdout(std::process::Stdio::piped())
    .spawn()
    .expect("bypass");
    // Up to 30 s in 50 ms steps.
    let mut waited = 0;
    while std::fs::read_to_string(&report).map_or(true, |t| t.trim().is_empty()) {
        waited += 1;
        if waited > 600 || child.try_wait().unwrap().is_some() {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!("the bypass never reported: {}", text(&out));
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let held: u64 = std::fs::read_to_string(&report)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let pid = u64::from(child.id());
    let snapshot = vgpu_region::RegionSnapshot::parse(&std::fs::read(&cache).unwrap()).unwrap();
    let listed = snapshot
        .live_procs()
        .any(|s| u64::try_from(s.pid).ok() == Some(pid));
    let shim_counted = snapshot.device_usage(0);
    let driver_counted = gpu
        .devices
        .iter()
        .flat_map(|d| d.processes())
        .filter(|&(p, _)| p == pid)
        .map(|(_, b)| b)
        .sum::<u64>();
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(
        held, 3000,
        "the second copy allocated past the 1024 MiB limit"
    );
    assert!(listed, "the region lists the process");
    assert!(shim_counted < 1024 * MIB, "the shim counted {shim_counted}");
    assert!(
        driver_counted >= 3000 * MIB,
        "the driver counted {driver_counted} bytes for pid {pid}"
    );
}

/// A container fills its own size-limited cache directory (the node's tmpfs, issue 28) before
/// its CUDA process starts. The region file then cannot get its blocks: with a sparse file the
/// first store to a page without one was SIGBUS, killing the application. Now the blocks are
/// allocated when the region is opened, the failure is an error, and the process enforces its
/// limit with private accounting (the node then sees a GPU process without a region, which its
/// watch reports). Needs root to mount the tmpfs.
#[test]
fn a_full_cache_directory_leaves_the_application_running_and_limited() {
    let root = Command::new("id").arg("-u").output().unwrap();
    if String::from_utf8_lossy(&root.stdout).trim() != "0" {
        skip("mounting a tmpfs needs root");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // Half a region's size: the file fits in the table, its pages do not.
    let size = vgpu_region::FILE_SIZE / 2;
    let mounted = Command::new("mount")
        .args([
            "-t",
            "tmpfs",
            "-o",
            &format!("size={size},mode=0777"),
            "tessera-test",
        ])
        .arg(dir.path())
        .status()
        .unwrap();
    assert!(mounted.success(), "mount tmpfs");
    struct Unmount<'a>(&'a Path);
    impl Drop for Unmount<'_> {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg("-l").arg(self.0).status();
        }
    }
    let _unmount = Unmount(dir.path());
    let cache = dir.path().join("region.cache");
    let out = run(&mut probe(&cache, LIMIT_64M, &["limit", &limit_64m()]));
    assert_ok(&out);
    assert!(
        stderr(&out).contains("accounts privately"),
        "{}",
        text(&out)
    );
}

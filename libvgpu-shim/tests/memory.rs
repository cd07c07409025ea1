//! Memory limits under `LD_PRELOAD` against the fake driver: direct calls, `cuGetProcAddress`,
//! `dlsym`, the environment's edge cases and the symbol surface.
#![allow(
    clippy::disallowed_types,
    reason = "times real processes and threads, no tokio clock"
)]

use shim_harness::*;

fn cache(dir: &tempfile::TempDir) -> std::path::PathBuf {
    dir.path().join("region.cache")
}

/// Runs the probe with `args` followed by a ready and a go file, reads the region at the point
/// where the probe says it is ready, lets it go on, and returns that snapshot (the probe must
/// have succeeded).
fn region_at_checkpoint(
    dir: &tempfile::TempDir,
    vars: &[(&str, &str)],
    args: &[&str],
) -> vgpu_region::RegionSnapshot {
    let cache = cache(dir);
    let (ready, go) = (dir.path().join("ready"), dir.path().join("go"));
    let mut args = args.to_vec();
    args.extend([ready.to_str().unwrap(), go.to_str().unwrap()]);
    let mut child = probe(&cache, vars, &args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn probe");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !ready.exists() && std::time::Instant::now() < deadline {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let snap = std::fs::read(&cache)
        .ok()
        .and_then(|b| vgpu_region::RegionSnapshot::parse(&b).ok());
    std::fs::write(&go, "").unwrap();
    let out = child.wait_with_output().expect("probe output");
    assert_ok(&out);
    snap.expect("a valid region at the checkpoint")
}

#[test]
fn limit_exactly_reached_then_one_byte_over_on_every_allocation_path() {
    let dir = tempfile::tempdir().unwrap();
    let limit = (64 * MIB).to_string();
    let out = run(&mut probe(
        &cache(&dir),
        &[("CUDA_DEVICE_MEMORY_LIMIT", "64m")],
        &["limit", &limit],
    ));
    assert_ok(&out);
    // The per-device variable overrides the fallback.
    let out = run(&mut probe(
        &cache(&tempfile::tempdir().unwrap()),
        &[
            ("CUDA_DEVICE_MEMORY_LIMIT", "1g"),
            ("CUDA_DEVICE_MEMORY_LIMIT_0", "65536k"),
        ],
        &["limit", &limit],
    ));
    assert_ok(&out);
}

/// A whole-card limit (the fake card has 1024 MiB): every path reaches the last byte, which
/// needs the pool's memory back on the card after a stream-ordered free and a synchronisation
/// (the real-node pipeline's whole-T4 pod found the probe missing that synchronisation).
#[test]
fn a_limit_as_large_as_the_card_is_usable_to_the_last_byte() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(&mut probe(
        &cache(&dir),
        &[("CUDA_DEVICE_MEMORY_LIMIT", "1024m")],
        &["limit", &(1024 * MIB).to_string()],
    ));
    assert_ok(&out);
}

/// Issue #16 item 6: module loads and the memory a pool keeps after a free count against the
/// limit (refused with OOM beyond it, given back at unload / trim / threshold 0 / destroy), and
/// the monitor sees them in the slot's `module_size` and `data_size` (buffer).
#[test]
fn module_loads_and_memory_kept_by_pools_are_counted_and_visible_to_the_monitor() {
    let dir = tempfile::tempdir().unwrap();
    let limit = 64 * MIB;
    let snap = region_at_checkpoint(
        &dir,
        &[("CUDA_DEVICE_MEMORY_LIMIT", "64m")],
        &["modpool", &limit.to_string()],
    );
    let slot = snap.live_procs().next().expect("the probe's slot");
    let used = slot.used[0];
    assert_eq!(used.module_size, 16 * MIB, "{used:?}");
    assert_eq!(used.data_size, limit - 16 * MIB, "{used:?}");
    assert_eq!(used.total, limit, "{used:?}");
    assert_eq!(snap.device_usage(0), limit);
}

/// A module is charged what its load took, not what other threads of the container allocated
/// or freed (counted) while it loaded: the fake's 300 ms load overlaps an 8 MiB allocation and
/// a 4 MiB free on another thread.
#[test]
fn a_module_is_charged_only_its_own_memory_when_others_allocate_during_the_load() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(&mut probe(
        &cache(&dir),
        &[
            ("CUDA_DEVICE_MEMORY_LIMIT", "64m"),
            ("FAKE_CUDA_MODULE_LOAD_MS", "300"),
        ],
        &["modrace", &(64 * MIB).to_string()],
    ));
    assert_ok(&out);
}

#[test]
fn nvml_memory_info_shows_the_limit_and_container_usage() {
    let dir = tempfile::tempdir().unwrap();
    let scenario = dir.path().join("scenario.json");
    std::fs::write(
        &scenario,
        r#"{"devices": [{"uuid": "GPU-1", "memory_total_mib": 16384, "memory_used_mib": 300}]}"#,
    )
    .unwrap();
    let limit = (64 * MIB).to_string();
    let out = run(&mut probe(
        &cache(&dir),
        &[
            ("CUDA_DEVICE_MEMORY_LIMIT", "64m"),
            ("FAKE_NVML_SCENARIO", scenario.to_str().unwrap()),
        ],
        &["nvml", &limit],
    ));
    assert_ok(&out);
}

#[test]
fn cu_get_proc_address_returns_the_drivers_variant_wrapped() {
    let limit = (64 * MIB).to_string();
    for version in ["11000", "12000", "12080"] {
        for flags in ["0", "2"] {
            let dir = tempfile::tempdir().unwrap();
            let out = run(&mut probe(
                &cache(&dir),
                &[("CUDA_DEVICE_MEMORY_LIMIT", "64m")],
                &["procaddr", &limit, version, flags],
            ));
            assert!(
                out.status.success(),
                "version {version} flags {flags}: {}",
                text(&out)
            );
        }
    }
}

/// Some drivers return internal entry points from `cuGetProcAddress`, not their exported
/// symbols: the shim still recognises (and wraps) them.
#[test]
fn cu_get_proc_address_wraps_internal_driver_entry_points() {
    let limit = (64 * MIB).to_string();
    for flags in ["0", "2"] {
        let dir = tempfile::tempdir().unwrap();
        let out = run(&mut probe(
            &cache(&dir),
            &[
                ("CUDA_DEVICE_MEMORY_LIMIT", "64m"),
                ("FAKE_CUDA_PROC_INTERNAL", "1"),
            ],
            &["procaddr", &limit, "12080", flags],
        ));
        assert!(out.status.success(), "flags {flags}: {}", text(&out));
    }
}

/// Issue #28 item 11: a driver whose `cuGetProcAddress` returns the same entry point for every
/// requested version of a name. Asked for `cuMemGetInfo`, `cuMemAlloc` and `cuMemFree` at
/// version 12000, the shim hands out its v2 (64-bit) wrappers in every call order (before the
/// fix, a probe of the driver's table that ran first mapped them to the pre-3.2 wrappers:
/// `cuMemGetInfo` reported a wrong total and `cuMemFree` failed with 500), with internal entry
/// points and with exported ones; asked at 3010 (a pre-3.2 caller), the legacy wrappers.
#[test]
fn cu_get_proc_address_with_a_version_agnostic_driver_gives_v2_hooks_in_any_call_order() {
    let limit = (64 * MIB).to_string();
    for internal in ["1", "0"] {
        for order in ["probe-first", "legacy-first", "direct"] {
            let dir = tempfile::tempdir().unwrap();
            let out = run(&mut probe(
                &cache(&dir),
                &[
                    ("CUDA_DEVICE_MEMORY_LIMIT", "64m"),
                    ("FAKE_CUDA_PROC_AGNOSTIC", "1"),
                    ("FAKE_CUDA_PROC_INTERNAL", internal),
                ],
                &["agnostic", &limit, order],
            ));
            assert!(
                out.status.success(),
                "internal entry points {internal}, order {order}: {}",
                text(&out)
            );
        }
    }
}

/// Issue #28 item 10: graph memory nodes. Before, `cuGraphAddMemAllocNode` was not counted at
/// all: a graph could map any amount of device memory. Now a graph whose allocations do not
/// fit is refused at instantiation (every instantiation entry point, directly and through
/// `cuGetProcAddress`), an instantiated graph's allocations count until it is destroyed, an
/// allocation that outlives its launch counts until it is freed, and memory the driver keeps
/// cached for graphs counts until `cuDeviceGraphMemTrim`; the simulated card never holds more
/// than the limit.
#[test]
fn graph_memory_nodes_are_counted_and_refused_over_the_limit() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(&mut probe(
        &cache(&dir),
        &[("CUDA_DEVICE_MEMORY_LIMIT", "64m")],
        &["graphmem", &(64 * MIB).to_string()],
    ));
    assert_ok(&out);
}

#[test]
fn dlsym_override_keeps_rtld_next_caller_relative() {
    let dir = tempfile::tempdir().unwrap();
    assert_ok(&run(&mut probe(&cache(&dir), &[], &["dlsym"])));
}

fn info(vars: &[(&str, &str)]) -> (u64, u64, String) {
    let dir = tempfile::tempdir().unwrap();
    let mut all = vec![("FAKE_CUDA_MEMORY_MIB", "16384")];
    all.extend_from_slice(vars);
    let out = run(&mut probe(&cache(&dir), &all, &["info"]));
    assert_ok(&out);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let field = |name: &str| -> u64 {
        stdout
            .split_whitespace()
            .find_map(|w| w.strip_prefix(name))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {stdout}"))
    };
    (
        field("total="),
        field("totalmem="),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn environment_edge_cases_parse_like_hami_and_warn() {
    const G: u64 = 1 << 30;
    let physical = 16 * G;
    // (value, total the process sees, warning expected)
    let cases: &[(&str, u64, bool)] = &[
        ("2g", 2 * G, false),
        ("2048m", 2 * G, false),
        // HAMi reads the last character as the unit: "4Gi" is 4 bytes.
        ("4Gi", 4, true),
        // strtoul base 0: a leading 0 is octal, 010g = 8 GiB.
        ("010g", 8 * G, true),
        // Empty: no limit.
        ("", physical, true),
        // -1 wraps to 2^64-1: no limit in effect; totals are clamped to the physical size.
        ("-1", physical, true),
        // Overflow of value × unit gives 0: no limit.
        ("99999999999999g", physical, true),
        ("abc", physical, true),
    ];
    for &(value, total, warns) in cases {
        let (t, tm, stderr) = info(&[("CUDA_DEVICE_MEMORY_LIMIT", value)]);
        assert_eq!(t, total, "CUDA_DEVICE_MEMORY_LIMIT={value:?}: {stderr}");
        assert_eq!(tm, total, "cuDeviceTotalMem for {value:?}");
        assert_eq!(
            stderr.contains("CUDA_DEVICE_MEMORY_LIMIT"),
            warns,
            "{value:?}: {stderr}"
        );
    }
    // Unset: the physical size (HAMi-core's cuDeviceTotalMem said 0 here).
    let (t, tm, _) = info(&[]);
    assert_eq!((t, tm), (physical, physical));
}

#[test]
fn corrupt_truncated_and_foreign_region_files_never_crash() {
    let limit = (64 * MIB).to_string();
    let vars = [("CUDA_DEVICE_MEMORY_LIMIT", "64m")];
    // Garbage: reinitialised.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(cache(&dir), vec![0xa5u8; 5000]).unwrap();
    let out = run(&mut probe(&cache(&dir), &vars, &["limit", &limit]));
    assert_ok(&out);
    assert!(String::from_utf8_lossy(&out.stderr).contains("reinitialising"));
    assert_eq!(
        std::fs::metadata(cache(&dir)).unwrap().len(),
        vgpu_region::FILE_SIZE as u64
    );
    // Truncated with a valid header.
    let dir = tempfile::tempdir().unwrap();
    let mut head = vec![0u8; 100];
    head[..4].copy_from_slice(&vgpu_region::MAGIC.to_ne_bytes());
    head[4..8].copy_from_slice(&1u32.to_ne_bytes());
    std::fs::write(cache(&dir), &head).unwrap();
    assert_ok(&run(&mut probe(&cache(&dir), &vars, &["limit", &limit])));
    // A future layout version: left alone, the process accounts privately (limit still holds).
    let dir = tempfile::tempdir().unwrap();
    let mut future = vec![0u8; vgpu_region::FILE_SIZE];
    future[..4].copy_from_slice(&vgpu_region::MAGIC.to_ne_bytes());
    future[4..8].copy_from_slice(&2u32.to_ne_bytes());
    std::fs::write(cache(&dir), &future).unwrap();
    let out = run(&mut probe(&cache(&dir), &vars, &["limit", &limit]));
    assert_ok(&out);
    assert!(String::from_utf8_lossy(&out.stderr).contains("foreign layout version 2"));
    assert_eq!(
        std::fs::read(cache(&dir)).unwrap(),
        future,
        "foreign file untouched"
    );
    // An unwritable path: private accounting, still limited.
    let out = run(&mut probe(
        std::path::Path::new("/nonexistent-dir/region.cache"),
        &vars,
        &["limit", &limit],
    ));
    assert_ok(&out);
}

#[test]
fn exports_only_the_hooks() {
    let a = artifacts();
    let out = std::process::Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(&a.shim)
        .output()
        .expect("nm");
    assert!(out.status.success());
    let mut names: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2).map(str::to_owned))
        .collect();
    names.sort();
    let mut expected = vec![
        "cuArray3DCreate_v2",
        "cuArrayCreate_v2",
        "cuArray3DCreate",
        "cuArrayCreate",
        "cuDeviceTotalMem",
        "cuMemAlloc",
        "cuMemAllocPitch",
        "cuMemFree",
        "cuMemGetInfo",
        "cuArrayDestroy",
        "cuMipmappedArrayCreate",
        "cuMipmappedArrayDestroy",
        "cuDeviceTotalMem_v2",
        "cuGetProcAddress",
        "cuGetProcAddress_v2",
        "cuGraphLaunch",
        "cuGraphLaunch_ptsz",
        "cuLaunch",
        "cuLaunchGrid",
        "cuLaunchGridAsync",
        "cuLaunchCooperativeKernelMultiDevice",
        "cuGraphInstantiate",
        "cuGraphInstantiate_v2",
        "cuGraphInstantiateWithFlags",
        "cuGraphInstantiateWithParams",
        "cuGraphInstantiateWithParams_ptsz",
        "cuGraphExecDestroy",
        "cuDeviceGraphMemTrim",
        "cuInit",
        "cuLaunchCooperativeKernel",
        "cuLaunchCooperativeKernel_ptsz",
        "cuLaunchKernel",
        "cuLaunchKernelEx",
        "cuLaunchKernelEx_ptsz",
        "cuLaunchKernel_ptsz",
        "cuMemAllocAsync",
        "cuMemAllocAsync_ptsz",
        "cuMemAllocFromPoolAsync",
        "cuMemAllocFromPoolAsync_ptsz",
        "cuMemAllocManaged",
        "cuMemAllocPitch_v2",
        "cuMemAlloc_v2",
        "cuMemCreate",
        "cuMemFreeAsync",
        "cuMemFreeAsync_ptsz",
        "cuMemFree_v2",
        "cuMemGetInfo_v2",
        "cuMemRelease",
        "cuModuleLoad",
        "cuModuleLoadData",
        "cuModuleLoadDataEx",
        "cuModuleLoadFatBinary",
        "cuModuleUnload",
        "cuLibraryLoadData",
        "cuLibraryLoadFromFile",
        "cuLibraryUnload",
        "cuMemPoolTrimTo",
        "cuMemPoolSetAttribute",
        "cuMemPoolDestroy",
        "cuCtxSetLimit",
        "dlsym",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetMemoryInfo_v2",
        "nvmlDeviceGetComputeRunningProcesses",
        "nvmlDeviceGetComputeRunningProcesses_v2",
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetGraphicsRunningProcesses",
        "nvmlDeviceGetGraphicsRunningProcesses_v2",
        "nvmlDeviceGetGraphicsRunningProcesses_v3",
        "nvmlDeviceGetMPSComputeRunningProcesses",
        "nvmlDeviceGetMPSComputeRunningProcesses_v2",
        "nvmlDeviceGetMPSComputeRunningProcesses_v3",
        "nvmlDeviceGetUtilizationRates",
        "nvmlDeviceGetProcessUtilization",
        "nvmlDeviceGetRunningProcessDetailList",
        "nvmlDeviceGetProcessesUtilizationInfo",
        "nvmlDeviceGetAccountingPids",
    ];
    expected.sort();
    assert_eq!(names, expected);
    // And no DT_NEEDED on the driver libraries: they are dlopened.
    let out = std::process::Command::new("readelf")
        .arg("-d")
        .arg(&a.shim)
        .output()
        .expect("readelf");
    let dynamic = String::from_utf8_lossy(&out.stdout);
    assert!(
        !dynamic.contains("libcuda") && !dynamic.contains("nvidia-ml"),
        "{dynamic}"
    );
}

/// Issue #31 item 2, opt-in oversubscription: a container booked 64 MiB with a 16 MiB device
/// share (`TESSERA_DEVICE_MEMORY_SHARE_0`, which the node writes into the limits file) gets
/// `cuMemAlloc` past the share from host memory: the card never holds more than the share, the
/// booking stops everything, `cuMemGetInfo` shows the booking, and the monitor reads the host
/// memory in the slot's host counter (device usage stays device memory only). Without the
/// share, the same probe's second allocation would take the card's memory (HAMi's behaviour).
#[test]
fn past_the_device_share_allocations_come_from_host_memory_up_to_the_booking() {
    let dir = tempfile::tempdir().unwrap();
    let (limit, share) = (64 * MIB, 16 * MIB);
    let snap = region_at_checkpoint(
        &dir,
        &[
            ("CUDA_DEVICE_MEMORY_LIMIT", "64m"),
            ("TESSERA_DEVICE_MEMORY_SHARE_0", "16m"),
        ],
        &["oversub", &limit.to_string(), &share.to_string()],
    );
    assert_eq!(snap.device_usage(0), share);
    assert_eq!(snap.host_usage(0), limit - share);
    let after = vgpu_region::RegionSnapshot::parse(&std::fs::read(cache(&dir)).unwrap()).unwrap();
    assert_eq!(after.host_usage(0), 0, "host memory given back at exit");
}

/// Context limits are device memory: `cuCtxSetLimit` of a stack size (reserved for every thread
/// the GPU can hold), a `malloc` heap or a printf FIFO is measured and counted, refused and set
/// back when it does not fit, and given back when lowered. Before, a 32 KiB stack on a 132-SM
/// GPU took about 8.6 GiB beside any limit.
#[test]
fn context_limits_are_counted_and_refused_over_the_limit() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(&mut probe(
        &cache(&dir),
        &[("CUDA_DEVICE_MEMORY_LIMIT", "64m")],
        &["ctxlimit", &(64 * MIB).to_string()],
    ));
    assert_ok(&out);
}

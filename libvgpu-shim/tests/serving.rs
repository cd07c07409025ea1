//! Multi-process and LLM-serving workloads held to their share (issue #31 item 3), with the
//! patterns of vLLM, SGLang and PyTorch distributed played against the fake driver:
//!
//! * tensor parallelism: one worker process per GPU (2 and 4 GPUs), all of one container
//!   sharing one region file, each filling its own device to that device's limit and launching
//!   kernels under `CUDA_DEVICE_SM_LIMIT` at the same time (HAMi-core #142: vLLM with TP > 1
//!   failed when gpucores was set); and one process touching every GPU in turn, as the driver
//!   and NCCL initialise. Several processes on *one* GPU sharing one limit is
//!   `tests/multiprocess.rs`;
//! * vLLM's memory profiling: `cuMemGetInfo` around a warm-up, with another process of the
//!   container allocating meanwhile; a CUDA graph replayed hundreds of times;
//! * memory shared between processes (CUDA IPC handles, VMM handles exported as file
//!   descriptors) counted once, by the exporter; one serving process's allocators (managed,
//!   stream-ordered, a pool that keeps memory, expandable segments) stopping together at the
//!   limit;
//! * CUDA 13's cudart, which resolves every driver function through `cuGetProcAddress_v2` at
//!   version 13000 (HAMi-core #233).
#![allow(
    clippy::disallowed_types,
    reason = "times real processes and threads, no tokio clock"
)]

use std::path::Path;
use std::process::{Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use shim_harness::*;

/// What the serving tests do with their probe processes.
trait Probes {
    fn spawn(&mut self, cmd: std::process::Command) -> usize;
    fn wait_for(&mut self, path: &Path, within: Duration);
    fn finish(self, within: Duration) -> Vec<Output>;
}

impl Probes for Children {
    fn spawn(&mut self, mut cmd: std::process::Command) -> usize {
        let child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn probe");
        self.0.push(child);
        self.0.len() - 1
    }

    /// Waits for `path` while every child is still running (a child that exits early has
    /// failed: its output says why).
    fn wait_for(&mut self, path: &Path, within: Duration) {
        let deadline = Instant::now() + within;
        while !path.exists() {
            for i in 0..self.0.len() {
                if self.0[i].try_wait().unwrap().is_some() {
                    let out = self.0.remove(i).wait_with_output().unwrap();
                    panic!("a probe exited before {}: {}", path.display(), text(&out));
                }
            }
            assert!(
                Instant::now() < deadline,
                "no {} within {within:?}",
                path.display()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Every child's output, each within `within` of now (killed, and the test failed, if one
    /// hangs).
    fn finish(mut self, within: Duration) -> Vec<Output> {
        let deadline = Instant::now() + within;
        let mut outs = Vec::new();
        for mut child in std::mem::take(&mut self.0) {
            while child.try_wait().unwrap().is_none() {
                if Instant::now() > deadline {
                    let _ = child.kill();
                    let out = child.wait_with_output().unwrap();
                    panic!("a probe hung past {within:?}: {}", text(&out));
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            outs.push(child.wait_with_output().unwrap());
        }
        outs
    }
}

/// The SM-limited runs take turns: each measures the utilization of the fake devices.
static SERIAL: Mutex<()> = Mutex::new(());

/// Per-device limits of the tensor-parallel tests: different on every GPU, so a limit applied
/// to the wrong device shows.
const TP_LIMITS_MIB: [u64; 4] = [64, 96, 48, 80];
const SM_LIMIT: u32 = 40;

fn tp_scenario(dir: &Path, n: usize) -> std::path::PathBuf {
    let devices: Vec<String> = (0..n)
        .map(|i| {
            format!(r#"{{"uuid": "GPU-00000000-0000-0000-0000-00000000000{i}", "memory_total_mib": 1024}}"#)
        })
        .collect();
    let path = dir.join(format!("scenario-{n}.json"));
    std::fs::write(&path, format!(r#"{{"devices": [{}]}}"#, devices.join(", "))).unwrap();
    path
}

/// The environment of a container with `n` GPUs, each with its own memory limit, and the SM
/// limit: the fake driver and NVML share the simulated GPUs' state file `state`.
fn tp_env(n: usize, state: &Path, scenario: &Path) -> Vec<(String, String)> {
    let mut vars: Vec<(String, String)> = vec![
        ("FAKE_CUDA_DEVICES".into(), n.to_string()),
        ("CUDA_DEVICE_SM_LIMIT".into(), SM_LIMIT.to_string()),
        ("GPU_CORE_UTILIZATION_POLICY".into(), "force".into()),
        ("FAKE_GPU_STATE".into(), state.to_str().unwrap().into()),
        (
            "FAKE_NVML_SCENARIO".into(),
            scenario.to_str().unwrap().into(),
        ),
        ("FAKE_CUDA_SM_COUNT".into(), "40".into()),
        ("FAKE_CUDA_BLOCK_NS".into(), "200000".into()),
    ];
    for (d, mib) in TP_LIMITS_MIB.iter().enumerate().take(n) {
        vars.push((format!("CUDA_DEVICE_MEMORY_LIMIT_{d}"), format!("{mib}m")));
    }
    vars
}

fn as_refs(vars: &[(String, String)]) -> Vec<(&str, &str)> {
    vars.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}

/// vLLM's tensor parallelism over `n` GPUs: `n` workers, one per device, released at once.
/// Returns each device's measured utilization (%) while all of them run kernels.
fn tensor_parallel(n: usize) -> Vec<f64> {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("container.cache");
    let state = dir.path().join("gpu.state");
    let scenario = tp_scenario(dir.path(), n);
    let gpu = fake_gpu_state::open_path(Some(state.clone().into_os_string())).expect("state");
    let vars = tp_env(n, &state, &scenario);
    let start = dir.path().join("start");
    let ready: Vec<_> = (0..n)
        .map(|d| dir.path().join(format!("ready{d}")))
        .collect();
    let mut procs = Children(Vec::new());
    artifacts();
    let t0 = Instant::now();
    for (d, ready) in ready.iter().enumerate() {
        let limit = (TP_LIMITS_MIB[d] * MIB).to_string();
        procs.spawn(probe(
            &cache,
            &as_refs(&vars),
            &[
                "tpworker",
                &d.to_string(),
                &limit,
                "6",
                start.to_str().unwrap(),
                ready.to_str().unwrap(),
            ],
        ));
    }
    std::thread::sleep(Duration::from_millis(200));
    std::fs::write(&start, "").unwrap();
    for r in &ready {
        procs.wait_for(r, Duration::from_secs(20));
    }
    // Every worker holds its device's whole limit, in its own slot, on its own device only.
    let snap = region_snapshot(&cache);
    assert_eq!(snap.live_procs().count(), n);
    for (d, mib) in TP_LIMITS_MIB.iter().enumerate().take(n) {
        let limit = mib * MIB;
        assert_eq!(snap.limit[d], limit, "device {d}");
        assert_eq!(snap.sm_limit[d], u64::from(SM_LIMIT), "device {d}");
        assert_eq!(snap.device_usage(d), limit, "device {d}");
        assert_eq!(gpu.devices[d].used_bytes(), limit, "the simulated GPU {d}");
    }
    for (d, child) in procs.0.iter().enumerate() {
        let slot = snap
            .procs
            .iter()
            .find(|p| p.pid == child.id() as i32)
            .expect("each worker has a slot");
        for e in 0..n {
            let want = if e == d { TP_LIMITS_MIB[d] * MIB } else { 0 };
            assert_eq!(slot.used[e].total, want, "worker {d} on device {e}");
        }
    }
    // The SM limit holds on every device while all of them launch.
    std::thread::sleep(Duration::from_millis(2500));
    let before: Vec<_> = (0..n)
        .map(|d| (fake_gpu_state::now_ns(), gpu.devices[d].busy_done_ns()))
        .collect();
    std::thread::sleep(Duration::from_millis(2500));
    let util: Vec<f64> = before
        .iter()
        .enumerate()
        .map(|(d, &(t1, b1))| {
            let (t2, b2) = (fake_gpu_state::now_ns(), gpu.devices[d].busy_done_ns());
            (b2 - b1) as f64 * 100.0 / (t2 - t1) as f64
        })
        .collect();
    for out in procs.finish(Duration::from_secs(30)) {
        assert_ok(&out);
    }
    assert!(
        t0.elapsed() < Duration::from_secs(40),
        "TP={n} took {:?}",
        t0.elapsed()
    );
    // Every slot released at exit.
    let after = region_snapshot(&cache);
    assert_eq!(after.live_procs().count(), 0);
    for d in 0..n {
        assert_eq!(after.device_usage(d), 0, "device {d} after exit");
    }
    util
}

#[test]
fn tensor_parallel_workers_on_2_and_4_gpus_each_get_their_device_limit_and_sm_share() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for n in [2, 4] {
        let util = tensor_parallel(n);
        println!("TP={n}: utilization per device {util:.1?}");
        for (d, u) in util.iter().enumerate() {
            assert!(
                (u - f64::from(SM_LIMIT)).abs() <= 10.0,
                "TP={n}: device {d} ran at {u:.1}% under a {SM_LIMIT}% SM limit (all: {util:.1?})"
            );
        }
    }
}

/// The driver's and NCCL's initialisation: one process makes each of 4 GPUs current in turn,
/// reads its memory, allocates and launches there (with the SM limit set), then fills each
/// device to its own limit: one byte past it is refused on that device only.
#[test]
fn one_process_touching_every_gpu_in_turn_sees_each_device_limit_separately() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let n = 4;
    let state = dir.path().join("gpu.state");
    let scenario = tp_scenario(dir.path(), n);
    let vars = tp_env(n, &state, &scenario);
    let limits: Vec<String> = TP_LIMITS_MIB
        .iter()
        .map(|m| (m * MIB).to_string())
        .collect();
    let mut args = vec!["tpinit".to_string(), n.to_string()];
    args.extend(limits);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    artifacts();
    let t0 = Instant::now();
    let mut procs = Children(Vec::new());
    procs.spawn(probe(&dir.path().join("c.cache"), &as_refs(&vars), &args));
    for out in procs.finish(Duration::from_secs(20)) {
        assert_ok(&out);
    }
    println!("4 GPUs initialised in {:?}", t0.elapsed());
}

/// vLLM's `determine_available_memory`: free memory before and after a warm-up differs by
/// exactly the warm-up's allocations, total is the limit, and an allocation by another process
/// of the same container meanwhile shows in free memory too (and is given back when it exits),
/// so the KV cache sized from it fits exactly.
#[test]
fn vllm_memory_profiling_sees_its_warm_up_and_other_processes_in_free_memory() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("c.cache");
    let vars = [("CUDA_DEVICE_MEMORY_LIMIT", "64m")];
    let (warm, other) = (10 * MIB + 12345, 7 * MIB + 4096);
    let d = dir.path();
    let mut profiler = Children(Vec::new());
    profiler.spawn(probe(
        &cache,
        &vars,
        &[
            "memprofile",
            &(64 * MIB).to_string(),
            &warm.to_string(),
            &other.to_string(),
            d.to_str().unwrap(),
        ],
    ));
    profiler.wait_for(&d.join("a1"), Duration::from_secs(20));
    let mut neighbour = Children(Vec::new());
    neighbour.spawn(probe(
        &cache,
        &vars,
        &[
            "allochold",
            &other.to_string(),
            d.join("b-ready").to_str().unwrap(),
            d.join("b-go").to_str().unwrap(),
        ],
    ));
    neighbour.wait_for(&d.join("b-ready"), Duration::from_secs(20));
    std::fs::write(d.join("b"), "").unwrap();
    profiler.wait_for(&d.join("a2"), Duration::from_secs(20));
    std::fs::write(d.join("b-go"), "").unwrap();
    for out in neighbour.finish(Duration::from_secs(20)) {
        assert_ok(&out);
    }
    std::fs::write(d.join("bgone"), "").unwrap();
    for out in profiler.finish(Duration::from_secs(20)) {
        assert_ok(&out);
    }
}

/// CUDA graphs as vLLM replays them for every decode step: two executable graphs with memory
/// nodes (an in-graph workspace, and an output the program frees after each replay) launched
/// 300 times; the count stays what instantiation charged, the card holds only the memory the
/// driver caches for graphs, and the rest of the limit stays usable to the byte. (Refusal at
/// instantiation, every instantiation entry point and the cache's trim are
/// `graph_memory_nodes_are_counted_and_refused_over_the_limit` in `tests/memory.rs`.)
#[test]
fn a_cuda_graph_replayed_300_times_is_counted_once() {
    let dir = tempfile::tempdir().unwrap();
    let cmd = &mut probe(
        &dir.path().join("c.cache"),
        &[("CUDA_DEVICE_MEMORY_LIMIT", "64m")],
        &["graphreplay", &(64 * MIB).to_string()],
    );
    let t0 = Instant::now();
    assert_ok(&run(cmd));
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
}

/// CUDA graph capture with the stream-ordered allocator (PyTorch's `cudaMallocAsync` backend
/// under `torch.cuda.graph`): a workspace allocated and freed on the captured stream and an
/// output left to the program become memory nodes; the capture puts nothing on the card,
/// instantiation counts both, 300 replays (the output freed after each) keep the count, and
/// the memory the driver caches for graphs stays counted after destruction until trimmed.
#[test]
fn a_graph_captured_with_stream_ordered_allocations_is_counted_once_across_300_replays() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(&mut probe(
        &dir.path().join("c.cache"),
        &[("CUDA_DEVICE_MEMORY_LIMIT", "64m")],
        &["graphcapture", &(64 * MIB).to_string()],
    ));
    println!("{}", text(&out));
    assert_ok(&out);
}

/// Memory one process shares with another (vLLM's custom all-reduce buffers, PyTorch tensors
/// sent to another process): a `cuMemAlloc` allocation exported with `cuIpcGetMemHandle` and
/// opened with `cuIpcOpenMemHandle`, and a `cuMemCreate` allocation exported as a file
/// descriptor (`cuMemExportToShareableHandle`), imported and `cuMemMap`ped. Each is counted
/// once, by the exporter: the importer's slot holds nothing, its free memory is the limit less
/// the exporter's share (and exactly that is allocatable), the simulated GPU holds each byte
/// once; closing and releasing on the importer's side uncounts nothing.
#[test]
fn ipc_and_vmm_memory_opened_by_another_process_is_counted_once_by_the_exporter() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cache = d.join("c.cache");
    let state = d.join("gpu.state");
    let gpu = fake_gpu_state::open_path(Some(state.clone().into_os_string())).expect("state");
    let vars = [
        ("CUDA_DEVICE_MEMORY_LIMIT", "64m"),
        ("FAKE_GPU_STATE", state.to_str().unwrap()),
    ];
    let (limit, ipc, vmm) = (64 * MIB, 16 * MIB, 8 * MIB);
    let sizes = [limit.to_string(), ipc.to_string(), vmm.to_string()];
    let mut procs = Children(Vec::new());
    procs.spawn(probe(
        &cache,
        &vars,
        &[
            "ipcexport",
            &sizes[0],
            &sizes[1],
            &sizes[2],
            d.to_str().unwrap(),
        ],
    ));
    let (ready, go) = (d.join("ready"), d.join("go"));
    procs.spawn(probe(
        &cache,
        &vars,
        &[
            "ipcimport",
            &sizes[0],
            &sizes[1],
            &sizes[2],
            d.to_str().unwrap(),
            ready.to_str().unwrap(),
            go.to_str().unwrap(),
        ],
    ));
    procs.wait_for(&ready, Duration::from_secs(20));
    // The monitor's view while the importer has everything open and mapped.
    let snap = region_snapshot(&cache);
    let slot = |i: usize| {
        let pid = procs.0[i].id() as i32;
        snap.procs
            .iter()
            .find(|p| p.pid == pid)
            .expect("a slot")
            .used[0]
    };
    assert_eq!(slot(0).total, ipc + vmm, "the exporter: {:?}", slot(0));
    assert_eq!(slot(1).total, 0, "the importer: {:?}", slot(1));
    assert_eq!(snap.device_usage(0), ipc + vmm);
    assert_eq!(gpu.devices[0].used_bytes(), ipc + vmm, "the simulated GPU");
    std::fs::write(&go, "").unwrap();
    for out in procs.finish(Duration::from_secs(20)) {
        assert_ok(&out);
    }
    assert_eq!(region_snapshot(&cache).device_usage(0), 0);
    assert_eq!(gpu.devices[0].used_bytes(), 0);
}

/// One serving process's allocators together, as PyTorch's expandable segments and
/// `cudaMallocAsync` backend use them: managed weights, stream-ordered activations and a pool
/// that keeps what is freed, then 2 MiB `cuMemCreate` chunks mapped into a large reserved
/// address range until the limit. The chunk past it is OOM, and so is every other path; the
/// segment shrinking gives the pool exactly what it released.
#[test]
fn managed_async_pool_and_expandable_segment_memory_stop_together_at_the_limit() {
    let dir = tempfile::tempdir().unwrap();
    for limit in [64 * MIB, 65 * MIB + 4096] {
        let out = run(&mut probe(
            &dir.path().join(format!("c{limit}.cache")),
            &[("CUDA_DEVICE_MEMORY_LIMIT", &format!("{}k", limit / 1024))],
            &["serve", &limit.to_string()],
        ));
        assert!(out.status.success(), "limit {limit}: {}", text(&out));
    }
}

/// CUDA 13's cudart resolves every driver function with `cuGetProcAddress_v2(name, …, 13000,
/// flags)` (HAMi-core #233). Every hooked name gives the shim's wrapper of the variant the
/// driver picks (`cuMemAlloc` → `cuMemAlloc_v2`, `cuGraphInstantiate` →
/// `cuGraphInstantiateWithFlags`, `_ptsz` with per-thread streams…), unhooked names the
/// driver's own function, with every flag, with a version-agnostic driver and with internal
/// entry points; the functions so obtained enforce the limit.
#[test]
fn cuda_13_cu_get_proc_address_gives_the_hook_of_every_variant() {
    let limit = (64 * MIB).to_string();
    for (agnostic, internal) in [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")] {
        for version in ["13000", "13010"] {
            for flags in ["0", "1", "2"] {
                let dir = tempfile::tempdir().unwrap();
                let out = run(&mut probe(
                    &dir.path().join("c.cache"),
                    &[
                        ("CUDA_DEVICE_MEMORY_LIMIT", "64m"),
                        ("FAKE_CUDA_PROC_AGNOSTIC", agnostic),
                        ("FAKE_CUDA_PROC_INTERNAL", internal),
                    ],
                    &["procall", &limit, version, flags],
                ));
                assert!(
                    out.status.success(),
                    "version {version} flags {flags}, agnostic driver {agnostic}, internal entry points {internal}: {}",
                    text(&out)
                );
            }
        }
    }
}

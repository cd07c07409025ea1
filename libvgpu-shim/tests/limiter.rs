//! The SM limiter against the simulated GPU: a launch loop under `CUDA_DEVICE_SM_LIMIT=L`
//! keeps the device's measured utilization within ±5 points of L over a 5-second window, also
//! when the host's CPUs are oversubscribed.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use shim_harness::*;
use tessera_bench_results as results;

const SCENARIO: &str = r#"{"devices": [{"uuid": "GPU-00000000-0000-0000-0000-000000000001", "memory_total_mib": 16384}, {"uuid": "GPU-00000000-0000-0000-0000-000000000002", "memory_total_mib": 16384}]}"#;

/// Runs the busy loop under `limit` and returns the device utilization (%) over five seconds,
/// after a 3.5 s settling time.
fn measure(dir: &std::path::Path, limit: u32) -> f64 {
    measure_path(dir, limit, "kernel")
}

/// [`measure`] with the busy loop launching through `path` (see `mode_busy` in the probe); the
/// utilization of the device the path launches on (device 1 for `multidevice-other`, whose
/// launches run on another device than the current context's; two simulated devices).
fn measure_path(dir: &std::path::Path, limit: u32, path: &str) -> f64 {
    let dev = usize::from(path == "multidevice-other");
    let state = dir.join(format!("gpu-{limit}-{path}.state"));
    let scenario = dir.join(format!("scenario-{limit}-{path}.json"));
    std::fs::write(&scenario, SCENARIO).unwrap();
    let cache = dir.join(format!("region-{limit}-{path}.cache"));
    let gpu = fake_gpu_state::open_path(Some(state.clone().into_os_string())).expect("state");
    let limit_s = limit.to_string();
    let mut child = probe(
        &cache,
        &[
            ("CUDA_DEVICE_SM_LIMIT", limit_s.as_str()),
            ("GPU_CORE_UTILIZATION_POLICY", "force"),
            ("FAKE_GPU_STATE", state.to_str().unwrap()),
            ("FAKE_NVML_SCENARIO", scenario.to_str().unwrap()),
            ("FAKE_CUDA_SM_COUNT", "40"),
            ("FAKE_CUDA_BLOCK_NS", "200000"),
            ("FAKE_CUDA_DEVICES", "2"),
        ],
        &["busy", "9", "40", path],
    )
    .stdout(std::process::Stdio::null())
    .spawn()
    .expect("busy");
    std::thread::sleep(Duration::from_millis(3500));
    let (t1, b1) = (fake_gpu_state::now_ns(), gpu.devices[dev].busy_done_ns());
    std::thread::sleep(Duration::from_secs(5));
    let (t2, b2) = (fake_gpu_state::now_ns(), gpu.devices[dev].busy_done_ns());
    let status = child.wait().expect("wait");
    assert!(status.success(), "busy loop through {path} failed");
    (b2 - b1) as f64 * 100.0 / (t2 - t1) as f64
}

/// One measurement at a time: the CPU-starved test must not starve the other one.
static SERIAL: Mutex<()> = Mutex::new(());

#[test]
fn utilization_converges_to_the_sm_limit() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    // Unlimited first: the loop saturates the simulated device.
    let handles: Vec<_> = [10u32, 30, 50, 70]
        .into_iter()
        .map(|limit| {
            let dir = dir.path().to_path_buf();
            std::thread::spawn(move || (limit, measure(&dir, limit)))
        })
        .collect();
    let full = measure(dir.path(), 100);
    assert!(
        full > 95.0,
        "unlimited loop should saturate, got {full:.1}%"
    );
    let mut report = Vec::new();
    // `bench/run.sh` collects these (`shim_limiter.csv` under `TESSERA_BENCH_CSV_DIR`).
    let csv = results::Csv::open("shim_limiter");
    csv.row(&results::Row::new(
        "no limit",
        "utilization over 5 s (fake GPU)",
        "%",
        results::Stats::single(full),
    ));
    for h in handles {
        let (limit, util) = h.join().unwrap();
        csv.row(
            &results::Row::new(
                format!("CUDA_DEVICE_SM_LIMIT={limit}"),
                "utilization over 5 s (fake GPU; four limits at once)",
                "%",
                results::Stats::single(util),
            )
            .without_p99()
            .baseline(f64::from(limit))
            .goal(
                "within 5 points of the limit",
                (util - f64::from(limit)).abs() <= 5.0,
            ),
        );
        report.push(format!("limit {limit}%: measured {util:.1}%"));
        assert!(
            (util - limit as f64).abs() <= 5.0,
            "limit {limit}%: measured {util:.1}% ({report:?})"
        );
    }
    std::thread::sleep(Duration::from_millis(1));
    println!("{}", report.join("\n"));
}

/// A launcher that shares its CPUs with busy neighbours (a node packed with CPU work, a container
/// throttled by its CPU limit) wakes late from every pacing sleep; the user still gets the SM
/// share they asked for, not several points less (before the controller corrected for it, 70 %
/// measured 59.9–65.2 % here).
#[test]
fn utilization_holds_the_sm_limit_on_an_oversubscribed_host() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let hogs: Vec<_> = (0..cpus * 4)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        })
        .collect();
    let handles: Vec<_> = [30u32, 70]
        .into_iter()
        .map(|limit| {
            let dir = dir.path().to_path_buf();
            std::thread::spawn(move || (limit, measure(&dir, limit)))
        })
        .collect();
    let measured: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    stop.store(true, Ordering::Relaxed);
    for h in hogs {
        h.join().unwrap();
    }
    for (limit, util) in &measured {
        assert!(
            (util - f64::from(*limit)).abs() <= 5.0,
            "{} CPU hogs: limit {limit}%: measured {util:.1}% (all: {measured:?})",
            cpus * 4
        );
    }
}

/// Issue #28 item 10: the launch entry points that went past the limiter (the pre-4.0
/// `cuLaunch`, `cuLaunchGrid`, `cuLaunchGridAsync`, and `cuLaunchCooperativeKernelMultiDevice`
/// on a stream of its own) are held to the SM limit like `cuLaunchKernel`, and so are graph
/// launches. A multi-device launch is paced on the device of each entry's stream: with the
/// current context on device 0 and the kernel on device 1, device 1 is held to the limit.
/// Unlimited, the same loop through `cuLaunchGrid` saturates the device: without the pacer each
/// of these paths took the whole device.
#[test]
fn every_launch_entry_point_is_held_to_the_sm_limit() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let limit = 30u32;
    let handles: Vec<_> = [
        "launch",
        "grid",
        "gridasync",
        "multidevice",
        "multidevice-other",
        "graph",
    ]
    .into_iter()
    .map(|path| {
        let dir = dir.path().to_path_buf();
        std::thread::spawn(move || (path, measure_path(&dir, limit, path)))
    })
    .collect();
    let full = measure_path(dir.path(), 100, "grid");
    let measured: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(
        full > 95.0,
        "unlimited cuLaunchGrid loop should saturate, got {full:.1}%"
    );
    for (path, util) in &measured {
        assert!(
            (util - f64::from(limit)).abs() <= 5.0,
            "{path}: limit {limit}%: measured {util:.1}% (all: {measured:?})"
        );
    }
    println!("{measured:?}");
}

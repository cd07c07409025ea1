//! The vGPU monitor's feedback against the real shim on the simulated GPU: the monitor's own
//! pass ([`feedback_pass`]: the decision and the region writer the daemon's `vgpu-feedback` task
//! runs, here every second instead of five) over the region files of shim-preloaded launch loops.
//!
//! Each container gets its own simulated device (its own `FAKE_GPU_STATE`), so its utilization
//! is measured alone; the fake driver gives every device the same UUID, so the monitor sees the
//! containers sharing one GPU. Margins are wide: a lifted loop keeps its device near 100 %, a
//! limited one near its 30 %; the assertions only tell those apart.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use shim_harness::probe;
use tessera_node::monitor::feedback_pass;
use vgpu_region::RegionSnapshot;
use vgpu_region::feedback::{CorePolicy, FeedbackClock};

/// The UUID the fake driver gives device 0 in every process.
const GPU: &str = "GPU-0c0c0c0c-0c0c-0c0c-0c0c-0c0c0c0c0c00";
const SCENARIO: &str = r#"{"devices": [{"uuid": "GPU-0c0c0c0c-0c0c-0c0c-0c0c-0c0c0c0c0c00", "memory_total_mib": 16384}]}"#;
const PERIOD: Duration = Duration::from_secs(1);
/// Above: the loop runs unthrottled (alone it saturates its device).
const UNTHROTTLED: f64 = 70.0;
/// Below: the loop is held near its 30 % limit.
const THROTTLED: f64 = 50.0;

/// One container: a launch loop under `gpucores: 30` with its region in the containers
/// directory, on its own simulated device.
struct Container {
    child: std::process::Child,
    region: PathBuf,
    gpu: &'static fake_gpu_state::GpuState,
}

impl Container {
    fn start(containers: &Path, name: &str, policy: Option<&str>) -> Container {
        let dir = containers.join(format!("uid-{name}_main"));
        std::fs::create_dir_all(&dir).expect("container dir");
        let region = dir.join("region.cache");
        let state = containers.join(format!("{name}.gpu-state"));
        let scenario = containers.join(format!("{name}.scenario.json"));
        std::fs::write(&scenario, SCENARIO).expect("scenario");
        let gpu = fake_gpu_state::open_path(Some(state.clone().into_os_string())).expect("state");
        let mut vars = vec![
            ("CUDA_DEVICE_SM_LIMIT", "30"),
            ("FAKE_GPU_STATE", state.to_str().expect("utf-8")),
            ("FAKE_NVML_SCENARIO", scenario.to_str().expect("utf-8")),
            ("FAKE_CUDA_SM_COUNT", "40"),
            ("FAKE_CUDA_BLOCK_NS", "200000"),
        ];
        if let Some(p) = policy {
            vars.push(("GPU_CORE_UTILIZATION_POLICY", p));
        }
        let child = probe(&region, &vars, &["busy", "60", "40"])
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("launch loop");
        Container { child, region, gpu }
    }

    /// The device's utilization (%) over `window`.
    fn utilization(&self, window: Duration) -> f64 {
        let (t1, b1) = (fake_gpu_state::now_ns(), self.gpu.devices[0].busy_done_ns());
        std::thread::sleep(window);
        let (t2, b2) = (fake_gpu_state::now_ns(), self.gpu.devices[0].busy_done_ns());
        (b2 - b1) as f64 * 100.0 / (t2 - t1) as f64
    }

    /// `utilization_switch` as the monitor last wrote it (None until the region exists).
    fn switch(&self) -> Option<i32> {
        let bytes = std::fs::read(&self.region).ok()?;
        let region = RegionSnapshot::parse(&bytes).ok()?;
        assert!(
            region.uuids[0].is_empty() || region.uuids[0] == GPU,
            "the fake driver's UUID changed: {}",
            region.uuids[0]
        );
        Some(region.utilization_switch)
    }

    fn wait_for_switch(&self, want: i32, within: Duration) {
        let deadline = std::time::SystemTime::now() + within;
        while self.switch() != Some(want) {
            assert!(
                std::time::SystemTime::now() < deadline,
                "utilization_switch never became {want} (now {:?})",
                self.switch()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The monitor's feedback loop over `containers`, every [`PERIOD`], until dropped.
struct Monitor(Arc<AtomicBool>, Option<std::thread::JoinHandle<()>>);

impl Monitor {
    fn start(containers: &Path, policy: CorePolicy) -> Monitor {
        let stop = Arc::new(AtomicBool::new(false));
        let dir = containers.to_path_buf();
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            while !stopped.load(Ordering::Relaxed) {
                let now_secs = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .expect("clock")
                    .as_secs();
                let clock = FeedbackClock {
                    now_secs,
                    period_secs: PERIOD.as_secs(),
                };
                // Both containers' pods were booked the GPU (what the pods' annotations say).
                let booked = ["uid-a", "uid-b"]
                    .into_iter()
                    .map(|uid| (uid.to_owned(), [GPU.to_owned()].into()))
                    .collect();
                let (outcomes, _) = feedback_pass(&dir, policy, clock, &booked);
                for o in &outcomes {
                    assert!(o.written.is_ok(), "{o:?}");
                }
                std::thread::sleep(PERIOD);
            }
        });
        Monitor(stop, Some(thread))
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
        if let Some(t) = self.1.take() {
            let _ = t.join();
        }
    }
}

/// `gpuCorePolicy: default` (HAMi #737): a container alone on its GPU runs unthrottled once the
/// monitor lifts its limit, and is held to its 30 % again within a control period (plus the
/// shim's 500 ms check and one controller window) after a second container starts on the GPU.
#[test]
fn default_policy_lifts_the_limit_of_a_lone_container_until_a_second_one_starts() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _monitor = Monitor::start(dir.path(), CorePolicy::Default);
    let a = Container::start(dir.path(), "a", None);
    a.wait_for_switch(0, Duration::from_secs(20));
    std::thread::sleep(Duration::from_secs(1));
    let alone = a.utilization(Duration::from_secs(3));
    assert!(
        alone > UNTHROTTLED,
        "alone on the GPU under default the loop should run unthrottled: {alone:.1}%"
    );

    let b = Container::start(dir.path(), "b", None);
    b.wait_for_switch(1, Duration::from_secs(20));
    a.wait_for_switch(1, PERIOD * 3);
    std::thread::sleep(PERIOD + Duration::from_secs(2));
    let shared = a.utilization(Duration::from_secs(3));
    assert!(
        shared < THROTTLED,
        "with a second container on the GPU the limit should apply again: {shared:.1}% (alone: {alone:.1}%)"
    );
    let other = b.utilization(Duration::from_secs(2));
    assert!(
        other < THROTTLED,
        "the second container is limited too: {other:.1}%"
    );
    println!("alone {alone:.1}%, shared {shared:.1}%, second {other:.1}%");
}

/// `gpuCorePolicy: force`: the monitor lifts the switch of a lone container as for any other,
/// and the shim ignores it: the loop stays at its limit.
#[test]
fn force_policy_is_never_lifted() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _monitor = Monitor::start(dir.path(), CorePolicy::Force);
    let a = Container::start(dir.path(), "a", Some("force"));
    a.wait_for_switch(0, Duration::from_secs(20));
    std::thread::sleep(Duration::from_secs(3));
    let util = a.utilization(Duration::from_secs(3));
    assert!(
        util < THROTTLED,
        "under force the loop stays limited alone on its GPU: {util:.1}%"
    );
    println!("force, alone: {util:.1}%");
}

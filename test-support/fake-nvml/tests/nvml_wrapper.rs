//! Loads the fake through the real `nvml-wrapper` crate, the way the device plugin does.
#![allow(
    clippy::disallowed_types,
    reason = "test support: times real processes and threads, no tokio clock"
)]

use std::io::Write;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;

/// The library's state and the environment are per process: tests take turns.
static SERIAL: Mutex<()> = Mutex::new(());

const SCENARIO: &str = r#"{
  "driver_version": "550.54.15",
  "cuda_driver_version": 12040,
  "devices": [
    {"uuid": "GPU-0c8e3b5a-1111-2222-3333-444455556666", "name": "Tesla T4", "memory_total_mib": 15360,
     "memory_used_mib": 0, "memory_info_unsupported": false, "pci_bus_id": "00000000:3B:00.0",
     "mig_mode": false, "utilization_gpu": 0, "utilization_memory": 0,
     "processes": [{"pid": 1234, "used_memory_mib": 100}]},
    {"uuid": "GPU-0c8e3b5a-1111-2222-3333-777777777777", "name": "NVIDIA A100-SXM4-40GB", "memory_total_mib": 40960,
     "memory_used_mib": 2048, "memory_info_unsupported": true, "pci_bus_id": "00000000:AF:00.0",
     "mig_mode": true, "utilization_gpu": 42, "utilization_memory": 7, "processes": []}
  ]
}"#;

struct Env {
    _dir: tempfile::TempDir,
    lib: std::path::PathBuf,
    events: std::path::PathBuf,
}

fn setup(scenario: &str) -> Env {
    let dir = tempfile::tempdir().expect("tempdir");
    let lib = nvidia_ml::locate::install_as_soname(dir.path()).expect("fake built");
    let path = dir.path().join("scenario.json");
    std::fs::write(&path, scenario).expect("write scenario");
    let events = dir.path().join("events.jsonl");
    std::fs::write(&events, "").expect("write events");
    // SAFETY: tests hold SERIAL, so no other thread reads the environment meanwhile.
    unsafe {
        std::env::set_var("FAKE_NVML_SCENARIO", &path);
        std::env::set_var("FAKE_NVML_EVENTS", &events);
        std::env::remove_var("FAKE_NVML_FAIL_INIT");
        std::env::remove_var("FAKE_GPU_STATE");
    }
    Env {
        _dir: dir,
        lib,
        events,
    }
}

fn init(env: &Env) -> Result<Nvml, NvmlError> {
    Nvml::builder().lib_path(env.lib.as_os_str()).init()
}

fn lock() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn device_queries_return_the_scenario() {
    let _g = lock();
    let env = setup(SCENARIO);
    let nvml = init(&env).expect("init");
    assert_eq!(nvml.sys_driver_version().unwrap(), "550.54.15");
    assert_eq!(nvml.sys_cuda_driver_version().unwrap(), 12040);
    assert_eq!(nvml.device_count().unwrap(), 2);

    let d0 = nvml.device_by_index(0).unwrap();
    assert_eq!(
        d0.uuid().unwrap(),
        "GPU-0c8e3b5a-1111-2222-3333-444455556666"
    );
    assert_eq!(d0.name().unwrap(), "Tesla T4");
    assert_eq!(d0.index().unwrap(), 0);
    let mem = d0.memory_info().unwrap();
    assert_eq!(mem.total, 15360 << 20);
    assert_eq!(mem.used, 0);
    assert_eq!(mem.free, 15360 << 20);
    let pci = d0.pci_info().unwrap();
    assert_eq!(pci.bus_id, "00000000:3B:00.0");
    assert_eq!(pci.bus, 0x3b);
    // A T4 cannot do MIG: NVML answers NOT_SUPPORTED.
    assert!(matches!(d0.mig_mode(), Err(NvmlError::NotSupported)));
    let procs = d0.running_compute_processes().unwrap();
    assert_eq!(procs.len(), 1);
    assert_eq!(procs[0].pid, 1234);
    assert_eq!(procs[0].used_gpu_memory, UsedGpuMemory::Used(100 << 20));
    assert_eq!(d0.utilization_rates().unwrap().gpu, 0);

    let d1 = nvml
        .device_by_uuid("GPU-0c8e3b5a-1111-2222-3333-777777777777")
        .unwrap();
    assert_eq!(d1.index().unwrap(), 1);
    assert!(matches!(d1.memory_info(), Err(NvmlError::NotSupported)));
    assert_eq!(d1.mig_mode().unwrap().current, 1);
    assert_eq!(d1.utilization_rates().unwrap().gpu, 42);
    assert!(d1.running_compute_processes().unwrap().is_empty());
    assert!(matches!(
        nvml.device_by_index(2),
        Err(NvmlError::InvalidArg)
    ));
    assert!(matches!(
        nvml.device_by_uuid("GPU-nope"),
        Err(NvmlError::NotFound)
    ));
}

#[test]
fn missing_invalid_or_failing_init_is_an_error_not_a_crash() {
    let _g = lock();
    let env = setup("{ not json");
    assert!(matches!(init(&env), Err(NvmlError::Unknown)));
    let env = setup(r#"{"devices": [{"uuid": "", "memory_total_mib": 1}]}"#);
    assert!(init(&env).is_err());
    // SAFETY: SERIAL held.
    unsafe { std::env::set_var("FAKE_NVML_SCENARIO", "/nonexistent/scenario.json") };
    assert!(matches!(init(&env), Err(NvmlError::DriverNotLoaded)));
    let env = setup(SCENARIO);
    // SAFETY: SERIAL held.
    unsafe { std::env::set_var("FAKE_NVML_FAIL_INIT", "1") };
    assert!(matches!(init(&env), Err(NvmlError::DriverNotLoaded)));
    // SAFETY: SERIAL held.
    unsafe { std::env::remove_var("FAKE_NVML_FAIL_INIT") };
    assert!(init(&env).is_ok());
}

fn append(path: &std::path::Path, line: &str) {
    let mut f = std::fs::OpenOptions::new().append(true).open(path).unwrap();
    writeln!(f, "{line}").unwrap();
}

#[test]
fn scripted_events_xid_lost_and_recovered() {
    let _g = lock();
    let env = setup(SCENARIO);
    let nvml = init(&env).expect("init");
    let set = nvml.create_event_set().unwrap();
    let d0 = nvml.device_by_index(0).unwrap();
    let d1 = nvml.device_by_index(1).unwrap();
    assert!(
        d0.supported_event_types()
            .unwrap()
            .contains(EventTypes::CRITICAL_XID_ERROR)
    );
    let set = d0
        .register_events(EventTypes::CRITICAL_XID_ERROR, set)
        .unwrap();
    let set = d1
        .register_events(EventTypes::CRITICAL_XID_ERROR, set)
        .unwrap();

    // Nothing scripted yet: the wait times out after about its timeout.
    let t = Instant::now();
    assert!(matches!(set.wait(100), Err(NvmlError::Timeout)));
    assert!(t.elapsed() >= Duration::from_millis(90));

    // A line appended while a wait is in progress is delivered by that wait.
    let events = env.events.clone();
    let writer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        append(&events, r#"{"device": 0, "kind": "xid", "xid": 79}"#);
    });
    let ev = set.wait(2000).expect("xid event");
    writer.join().unwrap();
    assert!(ev.event_type.contains(EventTypes::CRITICAL_XID_ERROR));
    assert_eq!(ev.event_data, Some(XidError::Value(79)));
    assert_eq!(
        ev.device.uuid().unwrap(),
        "GPU-0c8e3b5a-1111-2222-3333-444455556666"
    );

    append(&env.events, r#"{"device": 1, "kind": "lost"}"#);
    let ev = set.wait(1000).expect("lost event");
    assert_eq!(ev.event_data, Some(XidError::Value(79)));
    assert!(matches!(d1.uuid(), Err(NvmlError::GpuLost)));
    assert!(matches!(nvml.device_by_index(1), Err(NvmlError::GpuLost)));
    assert_eq!(d0.index().unwrap(), 0, "other devices are unaffected");

    append(&env.events, r#"{"device": 1, "kind": "recovered"}"#);
    assert_eq!(d1.index().unwrap(), 1);
    assert!(matches!(set.wait(50), Err(NvmlError::Timeout)));
}

#[test]
fn events_for_unregistered_devices_are_not_delivered() {
    let _g = lock();
    let env = setup(SCENARIO);
    let nvml = init(&env).expect("init");
    let set = nvml.create_event_set().unwrap();
    let set = nvml
        .device_by_index(0)
        .unwrap()
        .register_events(EventTypes::CRITICAL_XID_ERROR, set)
        .unwrap();
    append(&env.events, r#"{"device": 1, "kind": "xid", "xid": 48}"#);
    append(&env.events, "this line is not json");
    append(&env.events, r#"{"device": 0, "kind": "xid", "xid": 31}"#);
    let ev = set.wait(1000).expect("event for device 0");
    assert_eq!(ev.event_data, Some(XidError::Value(31)));
}

/// The shipped scenario files (`examples/device-plugin/`).
fn example_scenario(name: &str) -> String {
    let path = test_paths::manifest_dir()
        .join("../../examples/device-plugin")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn dgx1_scenario_reports_its_nvlinks_and_pcie_tree() {
    use nvml_wrapper::enum_wrappers::device::TopologyLevel;
    let _g = lock();
    let env = setup(&example_scenario("fake-nvml-dgx1-nvlink.json"));
    let nvml = init(&env).expect("init");
    assert_eq!(nvml.device_count().unwrap(), 8);
    let dev = |i| nvml.device_by_index(i).unwrap();
    let level = |a, b| dev(a).topology_common_ancestor(dev(b)).unwrap();
    assert_eq!(level(0, 1), TopologyLevel::Single, "one PCIe switch");
    assert_eq!(
        level(0, 2),
        TopologyLevel::Node,
        "same socket, other host bridge"
    );
    assert_eq!(level(0, 4), TopologyLevel::System, "across sockets");
    // GPU 0: links 0–5 active, to GPUs 1, 2, 3, 3, 4, 4; link 6 does not exist.
    let d0 = dev(0);
    let remotes: Vec<String> = (0..6)
        .map(|l| {
            let link = d0.link_wrapper_for(l);
            assert!(link.is_active().unwrap(), "link {l}");
            link.remote_pci_info().unwrap().bus_id
        })
        .collect();
    assert_eq!(
        remotes,
        [
            "00000000:07:00.0",
            "00000000:0A:00.0",
            "00000000:0B:00.0",
            "00000000:0B:00.0",
            "00000000:85:00.0",
            "00000000:85:00.0"
        ]
    );
    assert!(matches!(
        d0.link_wrapper_for(6).is_active(),
        Err(NvmlError::InvalidArg)
    ));
}

#[test]
fn pcie_only_scenario_has_every_pcie_level_and_no_nvlink() {
    use nvml_wrapper::enum_wrappers::device::TopologyLevel;
    let _g = lock();
    let env = setup(&example_scenario("fake-nvml-pcie-only.json"));
    let nvml = init(&env).expect("init");
    let dev = |i| nvml.device_by_index(i).unwrap();
    let level = |a, b| dev(a).topology_common_ancestor(dev(b)).unwrap();
    assert_eq!(level(0, 1), TopologyLevel::Single);
    assert_eq!(level(0, 2), TopologyLevel::Multiple);
    assert_eq!(level(0, 3), TopologyLevel::HostBridge);
    assert_eq!(level(0, 4), TopologyLevel::Node);
    assert_eq!(level(0, 5), TopologyLevel::System);
    assert_eq!(level(5, 0), TopologyLevel::System);
    assert!(matches!(
        dev(0).link_wrapper_for(0).is_active(),
        Err(NvmlError::NotSupported)
    ));
    // Old scenarios (no `pcie_path`) parse and answer "not supported".
    drop(nvml);
    let env = setup(SCENARIO);
    let nvml = init(&env).expect("init");
    let (a, b) = (
        nvml.device_by_index(0).unwrap(),
        nvml.device_by_index(1).unwrap(),
    );
    assert!(matches!(
        a.topology_common_ancestor(b),
        Err(NvmlError::NotSupported)
    ));
}

/// A canary: nvml-wrapper 0.13's `remote_device_type` hands NVML a temporary and returns
/// `Unknown` whatever NVML answered. The device plugin works around it (deviation T1 in
/// `docs/contract-deviations.md`); when this test fails, the wrapper reads the answer and the
/// workaround can go.
#[test]
fn nvml_wrapper_reads_every_remote_device_type_as_unknown() {
    use nvml_wrapper::enum_wrappers::nv_link::IntDeviceType;
    let _g = lock();
    let env = setup(
        r#"{"devices":[{"uuid":"GPU-a","memory_total_mib":1,"pci_bus_id":"00000000:07:00.0",
            "nvlinks":[{"remote_pci_bus_id":"00000000:C0:00.0","remote_device_type":"switch"}]}]}"#,
    );
    let nvml = init(&env).expect("init");
    let d = nvml.device_by_index(0).unwrap();
    assert_eq!(
        d.link_wrapper_for(0).remote_device_type(0).unwrap(),
        IntDeviceType::Unknown
    );
}

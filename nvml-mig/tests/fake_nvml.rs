//! `NvmlMig` against the fake `libnvidia-ml.so.1` (test-support/fake-nvml), through the real
//! nvml-wrapper.

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};

use nvml_mig::{MigControl, MigError, MigModeState, NvmlMig, Placement};
use nvml_wrapper::Nvml;
use nvml_wrapper::error::NvmlError;

/// The fake's state and the environment are per process: tests take turns.
static SERIAL: Mutex<()> = Mutex::new(());

fn lock() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

struct Env {
    dir: tempfile::TempDir,
    lib: PathBuf,
}

impl Env {
    /// Installs the fake and points it at `scenario`; `state` ⇒ `FAKE_NVML_MIG_STATE` in the
    /// temp dir.
    fn new(scenario: &str, state: bool) -> Env {
        let dir = tempfile::tempdir().expect("tempdir");
        let lib = nvidia_ml::locate::install_as_soname(dir.path()).expect("fake built");
        let path = dir.path().join("scenario.json");
        std::fs::write(&path, scenario).expect("write scenario");
        // SAFETY: tests hold SERIAL, so no other thread reads the environment meanwhile.
        unsafe {
            std::env::set_var("FAKE_NVML_SCENARIO", &path);
            std::env::remove_var("FAKE_NVML_EVENTS");
            std::env::remove_var("FAKE_NVML_FAIL_INIT");
            std::env::remove_var("FAKE_GPU_STATE");
            std::env::remove_var("FAKE_NVML_FAIL_CI_CREATE");
            if state {
                std::env::set_var("FAKE_NVML_MIG_STATE", dir.path().join("mig-state.json"));
            } else {
                std::env::remove_var("FAKE_NVML_MIG_STATE");
            }
        }
        Env { dir, lib }
    }

    fn state_path(&self) -> PathBuf {
        self.dir.path().join("mig-state.json")
    }

    fn init(&self) -> Nvml {
        Nvml::builder()
            .lib_path(self.lib.as_os_str())
            .init()
            .expect("init")
    }
}

const MODELS: &str = r#"{"devices": [
  {"uuid": "GPU-40", "name": "NVIDIA A100-SXM4-40GB", "memory_total_mib": 40960, "mig_mode": true},
  {"uuid": "GPU-80", "name": "NVIDIA A100-SXM4-80GB", "memory_total_mib": 81920, "mig_mode": true},
  {"uuid": "GPU-H100", "name": "NVIDIA H100 80GB HBM3", "memory_total_mib": 81559, "mig_mode": true},
  {"uuid": "GPU-H200", "name": "NVIDIA H200", "memory_total_mib": 143771, "mig_mode": true},
  {"uuid": "GPU-T4", "name": "Tesla T4", "memory_total_mib": 15360},
  {"uuid": "GPU-P80", "name": "NVIDIA A100 80GB PCIe", "memory_total_mib": 81920, "mig_mode": false}
]}"#;

fn pl(start: u32, size: u32) -> Placement {
    Placement { start, size }
}

fn starts(v: &[u32], size: u32) -> Vec<Placement> {
    v.iter().map(|&s| pl(s, size)).collect()
}

/// (name, NVML id, slices, instances, MiB, SMs) per model, as the fake's cited tables give them.
type Row = (&'static str, u32, u32, u32, u64, u32);

fn check_model(mig: &NvmlMig<'_>, gpu: u32, rows: &[Row]) {
    let profiles = mig.profiles(gpu).expect("profiles");
    let got: Vec<Row> = profiles
        .iter()
        .map(|p| {
            (
                leak(&p.name),
                p.id,
                p.slice_count,
                p.instance_count,
                p.memory_mib,
                p.multiprocessor_count,
            )
        })
        .collect();
    let mut want = rows.to_vec();
    want.sort_by_key(|r| r.1);
    assert_eq!(got, want, "GPU {gpu}");
    for p in &profiles {
        let expected = match p.id {
            0 | 7 => starts(&[0, 1, 2, 3, 4, 5, 6], 1),
            9 => starts(&[0, 2, 4, 6], 2),
            1 => starts(&[0, 2, 4], 2),
            2 => starts(&[0, 4], 4),
            3 => starts(&[0], 4),
            4 => starts(&[0], 8),
            other => panic!("unexpected profile {other}"),
        };
        assert_eq!(p.placements, expected, "GPU {gpu} {}", p.name);
    }
}

fn leak(s: &str) -> &'static str {
    Box::leak(s.to_owned().into_boxed_str())
}

#[test]
fn profiles_of_each_model_follow_the_tables() {
    let _g = lock();
    let env = Env::new(MODELS, false);
    let nvml = env.init();
    let mig = NvmlMig::new(&nvml);
    check_model(
        &mig,
        0,
        &[
            ("1g.5gb", 0, 1, 7, 4864, 14),
            ("1g.5gb+me", 7, 1, 1, 4864, 14),
            ("1g.10gb", 9, 1, 4, 9856, 14),
            ("2g.10gb", 1, 2, 3, 9856, 28),
            ("3g.20gb", 2, 3, 2, 19968, 42),
            ("4g.20gb", 3, 4, 1, 19968, 56),
            ("7g.40gb", 4, 7, 1, 40192, 98),
        ],
    );
    let a100_80: &[Row] = &[
        ("1g.10gb", 0, 1, 7, 9856, 14),
        ("1g.10gb+me", 7, 1, 1, 9856, 14),
        ("1g.20gb", 9, 1, 4, 19968, 14),
        ("2g.20gb", 1, 2, 3, 19968, 28),
        ("3g.40gb", 2, 3, 2, 40192, 42),
        ("4g.40gb", 3, 4, 1, 40192, 56),
        ("7g.80gb", 4, 7, 1, 80384, 98),
    ];
    check_model(&mig, 1, a100_80);
    check_model(
        &mig,
        2,
        &[
            ("1g.10gb", 0, 1, 7, 9856, 16),
            ("1g.10gb+me", 7, 1, 1, 9856, 16),
            ("1g.20gb", 9, 1, 4, 19968, 16),
            ("2g.20gb", 1, 2, 3, 19968, 32),
            ("3g.40gb", 2, 3, 2, 40192, 60),
            ("4g.40gb", 3, 4, 1, 40192, 64),
            ("7g.80gb", 4, 7, 1, 81152, 132),
        ],
    );
    check_model(
        &mig,
        3,
        &[
            ("1g.18gb", 0, 1, 7, 16384, 16),
            ("1g.18gb+me", 7, 1, 1, 16384, 16),
            ("1g.35gb", 9, 1, 4, 33024, 16),
            ("2g.35gb", 1, 2, 3, 33024, 32),
            ("3g.71gb", 2, 3, 2, 66304, 60),
            ("4g.71gb", 3, 4, 1, 66304, 64),
            ("7g.141gb", 4, 7, 1, 132608, 132),
        ],
    );
    // A GPU that cannot do MIG: no profiles, and its MIG mode is "not supported".
    assert!(mig.profiles(4).expect("profiles").is_empty());
    assert!(matches!(
        mig.mig_mode(4),
        Err(MigError::Nvml { code: 3, .. })
    ));
    // The PCIe 80GB name variant has the 80GB table, whether or not MIG is on.
    check_model(&mig, 5, a100_80);
    // The names NVML gives agree with NVIDIA's rule for naming from memory (go-nvlib).
    let total = 81920u64 << 20;
    for p in mig.profiles(1).expect("profiles") {
        assert_eq!(
            nvml_mig::profile_name(p.id, p.slice_count, p.memory_mib, total),
            p.name
        );
    }
}

const ONE_A100: &str = r#"{"devices": [
  {"uuid": "GPU-aaaa", "name": "NVIDIA A100-SXM4-80GB", "memory_total_mib": 81920, "mig_mode": true},
  {"uuid": "GPU-bbbb", "name": "NVIDIA A100-SXM4-80GB", "memory_total_mib": 81920,
   "mig_mode": false, "mig_mode_pending": true}
]}"#;

#[test]
fn create_overlap_destroy_and_recreate() {
    let _g = lock();
    let env = Env::new(ONE_A100, false);
    let nvml = env.init();
    let mig = NvmlMig::new(&nvml);
    assert!(mig.instances(0).expect("instances").is_empty());

    let a = mig.create(0, "3g.40gb", pl(4, 4)).expect("create 3g");
    assert!(a.uuid.starts_with("MIG-"), "{}", a.uuid);
    assert_eq!(a.profile, "3g.40gb");
    assert_eq!(a.profile_id, 2);
    assert_eq!(a.placement, pl(4, 4));
    assert_eq!(a.memory_mib, 40192);
    assert!(a.compute_instance_id.is_some());
    assert_eq!(mig.instances(0).expect("instances"), vec![a.clone()]);

    // The MIG device is visible to the rest of NVML.
    let d = nvml.device_by_uuid(a.uuid.as_str()).expect("MIG uuid");
    assert!(d.mig_is_mig_device_handle().expect("is mig"));
    assert_eq!(d.memory_info().expect("memory").total, 40192 << 20);

    // Overlapping a live instance, not a placement of the profile, a profile the GPU lacks.
    for (profile, p) in [
        ("1g.10gb", pl(5, 1)),
        ("3g.40gb", pl(4, 4)),
        ("2g.20gb", pl(4, 2)),
    ] {
        match mig.create(0, profile, p) {
            Err(MigError::PlacementUnavailable { start, size, .. }) => {
                assert_eq!((start, size), (p.start, p.size))
            }
            other => panic!("{profile} at {p:?}: {other:?}"),
        }
    }
    assert!(matches!(
        mig.create(0, "3g.40gb", pl(1, 4)),
        Err(MigError::PlacementUnavailable { .. })
    ));
    assert!(matches!(
        mig.create(0, "9g.99gb", pl(0, 8)),
        Err(MigError::UnknownProfile { .. })
    ));

    // 4g at 0 and 3g at 4 fill the GPU together (a configuration NVIDIA lists).
    let b = mig.create(0, "4g.40gb", pl(0, 4)).expect("4g next to 3g");
    assert_ne!(a.gpu_instance_id, b.gpu_instance_id);
    assert_ne!(a.uuid, b.uuid);
    assert_eq!(mig.instances(0).expect("instances").len(), 2);

    // Destroy, destroy again (gone is fine), and the slices are free again.
    mig.destroy(0, a.gpu_instance_id).expect("destroy");
    mig.destroy(0, a.gpu_instance_id)
        .expect("destroy a gone instance");
    assert_eq!(mig.instances(0).expect("instances"), vec![b.clone()]);
    let again = mig.create(0, "3g.40gb", pl(4, 4)).expect("recreate");
    assert_eq!(again.placement, pl(4, 4));
    assert_ne!(again.uuid, a.uuid, "a new creation has a new MIG UUID");
    mig.destroy(0, b.gpu_instance_id).expect("destroy 4g");
    mig.destroy(0, again.gpu_instance_id).expect("destroy 3g");
    assert!(mig.instances(0).expect("instances").is_empty());

    // Seven 1g, then nothing more fits.
    for s in 0..7 {
        mig.create(0, "1g.10gb", pl(s, 1)).expect("1g");
    }
    assert!(matches!(
        mig.create(0, "2g.20gb", pl(0, 2)),
        Err(MigError::PlacementUnavailable { .. })
    ));
    for i in mig.instances(0).expect("instances") {
        mig.destroy(0, i.gpu_instance_id).expect("destroy");
    }
}

#[test]
fn a_failed_compute_instance_rolls_the_gpu_instance_back() {
    let _g = lock();
    let env = Env::new(ONE_A100, false);
    let nvml = env.init();
    let mig = NvmlMig::new(&nvml);
    // SAFETY: SERIAL held.
    unsafe { std::env::set_var("FAKE_NVML_FAIL_CI_CREATE", "1") };
    let r = mig.create(0, "3g.40gb", pl(0, 4));
    // SAFETY: SERIAL held.
    unsafe { std::env::remove_var("FAKE_NVML_FAIL_CI_CREATE") };
    match r {
        Err(MigError::Nvml {
            call: "nvmlGpuInstanceCreateComputeInstance",
            gpu_index: 0,
            code: 23,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    assert!(
        mig.instances(0).expect("instances").is_empty(),
        "GI rolled back"
    );
    let ok = mig
        .create(0, "3g.40gb", pl(0, 4))
        .expect("the slices are free again");
    mig.destroy(0, ok.gpu_instance_id).expect("destroy");
}

#[test]
fn a_gpu_not_in_mig_mode_is_refused() {
    let _g = lock();
    let env = Env::new(ONE_A100, false);
    let nvml = env.init();
    let mig = NvmlMig::new(&nvml);
    assert_eq!(
        mig.mig_mode(1).expect("mode"),
        MigModeState {
            current: false,
            pending: true
        }
    );
    for r in [
        mig.create(1, "1g.10gb", pl(0, 1)).map(|_| ()),
        mig.instances(1).map(|_| ()),
        mig.destroy(1, 1),
    ] {
        match r {
            Err(MigError::NotMigMode {
                gpu_index: 1,
                current: false,
                pending: true,
            }) => {}
            other => panic!("{other:?}"),
        }
    }
    // Profiles are known whether or not MIG is on (NVML lists them either way).
    assert_eq!(mig.profiles(1).expect("profiles").len(), 7);
}

#[test]
fn set_mig_mode_never_succeeds() {
    let _g = lock();
    let env = Env::new(ONE_A100, false);
    let nvml = env.init();
    for i in 0..2 {
        let d = nvml.device_by_index(i).expect("device");
        for on in [true, false] {
            assert!(matches!(d.set_mig_mode(on), Err(NvmlError::NoPermission)));
        }
    }
    let mig = NvmlMig::new(&nvml);
    assert!(mig.mig_mode(0).expect("mode").current);
    assert!(!mig.mig_mode(1).expect("mode").current);
}

fn example_scenario() -> String {
    let path = test_paths::manifest_dir().join("../examples/device-plugin/fake-nvml-mig-a100.json");
    std::fs::read_to_string(path).expect("example scenario")
}

#[test]
fn pre_carved_instances_of_the_example_scenario_are_listed() {
    let _g = lock();
    let env = Env::new(&example_scenario(), false);
    let nvml = env.init();
    let mig = NvmlMig::new(&nvml);
    assert_eq!(nvml.device_count().expect("count"), 8);
    assert!(mig.instances(0).expect("GPU 0").is_empty());
    let carved = mig.instances(1).expect("GPU 1");
    assert_eq!(carved.len(), 1);
    let c = &carved[0];
    assert_eq!(c.profile, "3g.40gb");
    assert_eq!(c.placement, pl(0, 4));
    assert_eq!(c.uuid, "MIG-5f2c1e7a-3b1d-5c9e-8a44-1f0d2c3b4a51");
    assert_eq!(c.compute_instance_id, Some(0));
    // The carved slices are taken; the other half is free.
    assert!(matches!(
        mig.create(1, "4g.40gb", pl(0, 4)),
        Err(MigError::PlacementUnavailable { .. })
    ));
    let other = mig.create(1, "3g.40gb", pl(4, 4)).expect("other half");
    mig.destroy(1, other.gpu_instance_id).expect("destroy");
    for gpu in 2..8 {
        assert!(matches!(
            mig.instances(gpu),
            Err(MigError::NotMigMode { .. })
        ));
    }
}

#[test]
fn carved_state_survives_a_restart_through_the_state_file() {
    let _g = lock();
    let env = Env::new(&example_scenario(), true);
    let made = {
        let nvml = env.init();
        let mig = NvmlMig::new(&nvml);
        let made = mig.create(0, "2g.20gb", pl(2, 2)).expect("create");
        nvml.shutdown().expect("shutdown");
        made
    };
    let text = std::fs::read_to_string(env.state_path()).expect("state file written");
    assert!(text.contains(&made.uuid), "{text}");
    assert!(
        text.contains("MIG-5f2c1e7a-3b1d-5c9e-8a44-1f0d2c3b4a51"),
        "{text}"
    );

    // A "restarted" plugin finds what it carved (and the scenario's pre-carved instance).
    let nvml = env.init();
    let mig = NvmlMig::new(&nvml);
    assert_eq!(mig.instances(0).expect("instances"), vec![made.clone()]);
    assert_eq!(mig.instances(1).expect("instances").len(), 1);
    nvml.shutdown().expect("shutdown");

    // It is the file that holds it: another state file starts from the scenario again.
    // SAFETY: SERIAL held.
    unsafe { std::env::set_var("FAKE_NVML_MIG_STATE", env.dir.path().join("other.json")) };
    let nvml = env.init();
    let mig = NvmlMig::new(&nvml);
    assert!(mig.instances(0).expect("instances").is_empty());
    assert_eq!(mig.instances(1).expect("instances").len(), 1);
    nvml.shutdown().expect("shutdown");

    // SAFETY: SERIAL held.
    unsafe { std::env::set_var("FAKE_NVML_MIG_STATE", env.state_path()) };
    let nvml = env.init();
    let mig = NvmlMig::new(&nvml);
    mig.destroy(0, made.gpu_instance_id).expect("destroy");
    nvml.shutdown().expect("shutdown");
    let text = std::fs::read_to_string(env.state_path()).expect("state file");
    assert!(!text.contains(&made.uuid), "{text}");
}

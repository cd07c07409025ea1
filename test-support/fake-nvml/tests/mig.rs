//! The fake's MIG model through the real nvml-wrapper, and raw calls (through the library
//! nvml-wrapper loaded) for what it does not wrap.

use std::os::raw::c_uint;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, MutexGuard};

use nvml_wrapper::Nvml;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper_sys::bindings::{
    nvmlComputeInstance_t, nvmlComputeInstanceInfo_t, nvmlDevice_t, nvmlGpuInstance_t,
    nvmlGpuInstanceInfo_t, nvmlGpuInstancePlacement_t, nvmlGpuInstanceProfileInfo_v2_t,
    nvmlGpuInstanceProfileInfo_v3_t,
};

static SERIAL: Mutex<()> = Mutex::new(());

fn lock() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

const SCENARIO: &str = r#"{"devices": [
  {"uuid": "GPU-40", "name": "NVIDIA A100-SXM4-40GB", "memory_total_mib": 40960, "mig_mode": true},
  {"uuid": "GPU-80", "name": "NVIDIA A100-SXM4-80GB", "memory_total_mib": 81920, "mig_mode": false,
   "mig_mode_pending": true},
  {"uuid": "GPU-T4", "name": "Tesla T4", "memory_total_mib": 15360},
  {"uuid": "GPU-A30", "name": "A30", "memory_total_mib": 24576, "mig_mode": true},
  {"uuid": "GPU-H", "name": "NVIDIA H100 80GB HBM3", "memory_total_mib": 81559, "mig_mode": true,
   "mig_instances": [{"profile": "MIG 1g.10gb", "start": 6},
                     {"profile": "2g.20gb", "start": 0, "ci": false}]}
]}"#;

/// Sets the environment up for `scenario`; returns (temp dir, library path).
fn setup(scenario: &str, state: Option<&Path>) -> (tempfile::TempDir, PathBuf) {
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
        match state {
            Some(s) => std::env::set_var("FAKE_NVML_MIG_STATE", s),
            None => std::env::remove_var("FAKE_NVML_MIG_STATE"),
        }
    }
    (dir, lib)
}

fn init(lib: &Path) -> Nvml {
    Nvml::builder()
        .lib_path(lib.as_os_str())
        .init()
        .expect("init")
}

fn handle(nvml: &Nvml, i: u32) -> nvmlDevice_t {
    let d = nvml.device_by_index(i).expect("device");
    // SAFETY: the handle stays valid while `nvml` lives.
    unsafe { d.handle() }
}

fn create_gi(
    nvml: &Nvml,
    dev: nvmlDevice_t,
    profile: u32,
    at: Option<(u32, u32)>,
) -> Result<nvmlGpuInstance_t, u32> {
    let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
    let rc = match at {
        Some((start, size)) => {
            let p = nvmlGpuInstancePlacement_t { start, size };
            // SAFETY: valid handle and pointers.
            unsafe {
                nvml.lib()
                    .nvmlDeviceCreateGpuInstanceWithPlacement(dev, profile, &p, &mut gi)
            }
        }
        // SAFETY: valid handle and pointers.
        None => unsafe {
            nvml.lib()
                .nvmlDeviceCreateGpuInstance(dev, profile, &mut gi)
        },
    };
    if rc == 0 { Ok(gi) } else { Err(rc) }
}

fn gi_info(nvml: &Nvml, gi: nvmlGpuInstance_t) -> nvmlGpuInstanceInfo_t {
    // SAFETY: plain C struct.
    let mut info: nvmlGpuInstanceInfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: live GI handle.
    assert_eq!(
        unsafe { nvml.lib().nvmlGpuInstanceGetInfo(gi, &mut info) },
        0
    );
    info
}

#[test]
fn mig_mode_current_and_pending() {
    let _g = lock();
    let (_dir, lib) = setup(SCENARIO, None);
    let nvml = init(&lib);
    let mode = |i| nvml.device_by_index(i).unwrap().mig_mode();
    let m = mode(0).unwrap();
    assert_eq!((m.current, m.pending), (1, 1));
    let m = mode(1).unwrap();
    assert_eq!((m.current, m.pending), (0, 1));
    // No MIG table and MIG off: not supported. A scenario that turns MIG on for a model the fake
    // has no table for (an A30 here) still answers, as before.
    assert!(matches!(mode(2), Err(NvmlError::NotSupported)));
    assert_eq!(mode(3).unwrap().current, 1);
    // Nobody may change the mode.
    let d = nvml.device_by_index(0).unwrap();
    assert!(matches!(
        d.set_mig_mode(false),
        Err(NvmlError::NoPermission)
    ));
    assert_eq!(mode(0).unwrap().current, 1);
}

#[test]
fn profile_info_v1_v2_v3() {
    let _g = lock();
    let (_dir, lib) = setup(SCENARIO, None);
    let nvml = init(&lib);
    let d = nvml.device_by_index(0).unwrap();
    let p = d.profile_info(0).expect("1g");
    assert_eq!(
        (
            p.slice_count,
            p.instance_count,
            p.memory_size_mb,
            p.multiprocessor_count
        ),
        (1, 7, 4864, 14)
    );
    let p = d.profile_info(4).expect("7g");
    assert_eq!((p.slice_count, p.memory_size_mb), (7, 40192));
    assert!(matches!(d.profile_info(5), Err(NvmlError::NotSupported)));
    assert!(matches!(d.profile_info(99), Err(NvmlError::InvalidArg)));
    assert!(matches!(
        nvml.device_by_index(2).unwrap().profile_info(0),
        Err(NvmlError::NotSupported)
    ));

    let h = handle(&nvml, 0);
    // SAFETY: plain C structs; versions set as NVML_STRUCT_VERSION does.
    unsafe {
        let mut v3: nvmlGpuInstanceProfileInfo_v3_t = std::mem::zeroed();
        v3.version = std::mem::size_of::<nvmlGpuInstanceProfileInfo_v3_t>() as c_uint | (3 << 24);
        let rc = nvml.lib().nvmlDeviceGetGpuInstanceProfileInfoV(
            h,
            7,
            (&mut v3 as *mut nvmlGpuInstanceProfileInfo_v3_t).cast(),
        );
        assert_eq!(rc, 0);
        let name = std::ffi::CStr::from_ptr(v3.name.as_ptr()).to_str().unwrap();
        assert_eq!(
            (name, v3.instanceCount, v3.memorySizeMB),
            ("MIG 1g.5gb+me", 1, 4864)
        );

        let mut v2: nvmlGpuInstanceProfileInfo_v2_t = std::mem::zeroed();
        v2.version = std::mem::size_of::<nvmlGpuInstanceProfileInfo_v2_t>() as c_uint | (2 << 24);
        assert_eq!(
            nvml.lib()
                .nvmlDeviceGetGpuInstanceProfileInfoV(h, 2, &mut v2),
            0
        );
        let name = std::ffi::CStr::from_ptr(v2.name.as_ptr()).to_str().unwrap();
        assert_eq!((name, v2.sliceCount), ("MIG 3g.20gb", 3));

        v2.version = 1;
        assert_eq!(
            nvml.lib()
                .nvmlDeviceGetGpuInstanceProfileInfoV(h, 2, &mut v2),
            25
        );

        // Placements: the count first, then the list.
        let mut n: c_uint = 0;
        let get = |p, n: &mut c_uint| {
            nvml.lib()
                .nvmlDeviceGetGpuInstancePossiblePlacements_v2(h, 2, p, n)
        };
        assert_eq!(get(std::ptr::null_mut(), &mut n), 0);
        assert_eq!(n, 2);
        let mut buf = [nvmlGpuInstancePlacement_t { start: 9, size: 9 }; 2];
        let mut small: c_uint = 1;
        assert_eq!(get(buf.as_mut_ptr(), &mut small), 7);
        assert_eq!(get(buf.as_mut_ptr(), &mut n), 0);
        assert_eq!(buf.map(|p| (p.start, p.size)), [(0, 4), (4, 4)]);
    }
}

#[test]
fn gpu_and_compute_instances_and_mig_devices() {
    let _g = lock();
    let (_dir, lib) = setup(SCENARIO, None);
    let nvml = init(&lib);
    let lib_ = nvml.lib();
    let h = handle(&nvml, 0);

    let gi = create_gi(&nvml, h, 2, Some((4, 4))).expect("3g at 4");
    let info = gi_info(&nvml, gi);
    assert_eq!(
        (info.profileId, info.placement.start, info.placement.size),
        (2, 4, 4)
    );
    assert_eq!(create_gi(&nvml, h, 0, Some((5, 1))), Err(23), "overlap");
    assert_eq!(
        create_gi(&nvml, h, 2, Some((1, 4))),
        Err(23),
        "not a placement"
    );
    assert_eq!(create_gi(&nvml, h, 99, Some((0, 1))), Err(2), "bad profile");
    assert_eq!(
        create_gi(&nvml, handle(&nvml, 1), 0, None),
        Err(3),
        "MIG off"
    );
    let mut left: c_uint = 9;
    // SAFETY: valid handle and pointer.
    assert_eq!(
        unsafe { lib_.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 2, &mut left) },
        0
    );
    assert_eq!(left, 1);

    // One CI spanning the GI (CI profile 3_SLICE = 2, engine SHARED).
    let mut ci: nvmlComputeInstance_t = std::ptr::null_mut();
    // SAFETY: live GI handle.
    assert_eq!(
        unsafe { lib_.nvmlGpuInstanceCreateComputeInstance(gi, 2, &mut ci) },
        0
    );
    // SAFETY: plain C struct; live CI handle.
    let mut cinfo: nvmlComputeInstanceInfo_t = unsafe { std::mem::zeroed() };
    assert_eq!(
        unsafe { lib_.nvmlComputeInstanceGetInfo_v2(ci, &mut cinfo) },
        0
    );
    assert_eq!((cinfo.id, cinfo.profileId), (0, 2));
    // SAFETY: live GI handle: destroying it with a CI inside is refused.
    assert_eq!(unsafe { lib_.nvmlGpuInstanceDestroy(gi) }, 19);

    // The MIG device.
    let d = nvml.device_by_index(0).unwrap();
    assert_eq!(d.mig_device_count().unwrap(), 7);
    let m = d.mig_device_by_index(0).expect("MIG device 0");
    assert!(matches!(d.mig_device_by_index(1), Err(NvmlError::NotFound)));
    assert!(m.mig_is_mig_device_handle().unwrap());
    assert!(!d.mig_is_mig_device_handle().unwrap());
    let uuid = m.uuid().unwrap();
    assert!(uuid.starts_with("MIG-") && uuid.len() == 40, "{uuid}");
    assert_eq!(m.name().unwrap(), "NVIDIA A100-SXM4-40GB MIG 3g.20gb");
    assert_eq!(m.memory_info().unwrap().total, 19968 << 20);
    assert_eq!(m.mig_parent_device().unwrap().index().unwrap(), 0);
    let by_uuid = nvml.device_by_uuid(uuid.as_str()).expect("MIG uuid");
    assert_eq!(by_uuid.uuid().unwrap(), uuid);
    let (mut g, mut c): (c_uint, c_uint) = (99, 99);
    // SAFETY: valid MIG device handle.
    unsafe {
        assert_eq!(lib_.nvmlDeviceGetGpuInstanceId(m.handle(), &mut g), 0);
        assert_eq!(lib_.nvmlDeviceGetComputeInstanceId(m.handle(), &mut c), 0);
        assert_eq!(lib_.nvmlDeviceGetGpuInstanceId(d.handle(), &mut g), 3);
    }
    assert_eq!((g, c), (info.id, 0));

    // Tear down: CI, then GI; the id is gone.
    // SAFETY: live handles.
    unsafe {
        assert_eq!(lib_.nvmlComputeInstanceDestroy(ci), 0);
        assert_eq!(lib_.nvmlGpuInstanceDestroy(gi), 0);
        let mut again: nvmlGpuInstance_t = std::ptr::null_mut();
        assert_eq!(lib_.nvmlDeviceGetGpuInstanceById(h, info.id, &mut again), 6);
    }
    assert!(matches!(d.mig_device_by_index(0), Err(NvmlError::NotFound)));
    assert!(matches!(
        nvml.device_by_uuid(uuid.as_str()),
        Err(NvmlError::NotFound)
    ));

    // Without a placement: the first free one.
    let gi = create_gi(&nvml, h, 1, None).expect("2g");
    assert_eq!(gi_info(&nvml, gi).placement.start, 0);
    // SAFETY: live handle.
    assert_eq!(unsafe { lib_.nvmlGpuInstanceDestroy(gi) }, 0);
}

#[test]
fn scenario_instances_seed_the_state() {
    let _g = lock();
    let (_dir, lib) = setup(SCENARIO, None);
    let nvml = init(&lib);
    let h = handle(&nvml, 4);
    let lib_ = nvml.lib();
    let mut gis = [std::ptr::null_mut(); 7];
    let mut n: c_uint = 0;
    // SAFETY: the array holds the 1g profile's 7 instances.
    assert_eq!(
        unsafe { lib_.nvmlDeviceGetGpuInstances(h, 0, gis.as_mut_ptr(), &mut n) },
        0
    );
    assert_eq!(n, 1);
    assert_eq!(gi_info(&nvml, gis[0]).placement.start, 6);
    // SAFETY: as above, 2g holds 3.
    assert_eq!(
        unsafe { lib_.nvmlDeviceGetGpuInstances(h, 1, gis.as_mut_ptr(), &mut n) },
        0
    );
    assert_eq!(n, 1);
    // The 2g has no compute instance ("ci": false), so one MIG device only.
    let d = nvml.device_by_index(4).unwrap();
    assert!(d.mig_device_by_index(0).is_ok());
    assert!(matches!(d.mig_device_by_index(1), Err(NvmlError::NotFound)));
    // SAFETY: live GI without CIs.
    assert_eq!(unsafe { lib_.nvmlGpuInstanceDestroy(gis[0]) }, 0);

    // A scenario whose instances cannot exist is refused at init.
    let bad = SCENARIO.replace("\"start\": 6", "\"start\": 1");
    let (_dir2, lib2) = setup(&bad, None);
    assert!(Nvml::builder().lib_path(lib2.as_os_str()).init().is_err());
}

/// Run by `state_is_shared_between_processes` in child processes only.
#[test]
fn child_carves_three_1g() {
    if std::env::var_os("FAKE_NVML_MIG_CHILD").is_none() {
        return;
    }
    let lib = PathBuf::from(std::env::var_os("FAKE_NVML_MIG_CHILD").unwrap());
    let nvml = init(&lib);
    let h = handle(&nvml, 0);
    for _ in 0..3 {
        let gi = create_gi(&nvml, h, 0, None).expect("1g");
        let mut ci: nvmlComputeInstance_t = std::ptr::null_mut();
        // SAFETY: live GI handle.
        assert_eq!(
            unsafe {
                nvml.lib()
                    .nvmlGpuInstanceCreateComputeInstance(gi, 0, &mut ci)
            },
            0
        );
    }
}

#[test]
fn state_is_shared_between_processes() {
    let _g = lock();
    let tmp = tempfile::tempdir().expect("tempdir");
    let state = tmp.path().join("mig.json");
    let (_dir, lib) = setup(SCENARIO, Some(&state));
    let children: Vec<_> = (0..2)
        .map(|_| {
            Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "child_carves_three_1g", "--nocapture"])
                .env("FAKE_NVML_MIG_CHILD", &lib)
                .spawn()
                .expect("spawn")
        })
        .collect();
    for mut c in children {
        assert!(c.wait().expect("wait").success());
    }
    // Six 1g from two processes, all at different placements, and six MIG devices here.
    let nvml = init(&lib);
    let d = nvml.device_by_index(0).unwrap();
    let mut uuids: Vec<String> = (0..6)
        .map(|i| {
            d.mig_device_by_index(i)
                .expect("MIG device")
                .uuid()
                .unwrap()
        })
        .collect();
    uuids.sort();
    uuids.dedup();
    assert_eq!(uuids.len(), 6);
    let mut left: c_uint = 9;
    // SAFETY: valid handle.
    assert_eq!(
        unsafe {
            nvml.lib()
                .nvmlDeviceGetGpuInstanceRemainingCapacity(handle(&nvml, 0), 0, &mut left)
        },
        0
    );
    assert_eq!(left, 1);
    let text = std::fs::read_to_string(&state).expect("state file");
    assert!(uuids.iter().all(|u| text.contains(u.as_str())));
}

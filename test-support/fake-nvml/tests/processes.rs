//! The per-GPU process lists (compute, graphics, MPS; v1, v2, v3 entry points): what the node's
//! unaccounted-process check reads. Through the real nvml-wrapper (as the device plugin calls
//! them), and raw, with nvml-wrapper-sys's struct layouts, for the two-call count protocol and
//! the entry points nvml-wrapper does not call.

use std::ffi::{c_uint, c_void};
use std::sync::{Mutex, MutexGuard};

use nvml_wrapper::Nvml;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper_sys::bindings::{nvmlProcessInfo_t, nvmlProcessInfo_v1_t, nvmlProcessInfo_v2_t};

/// The library's state and the environment are per process: tests take turns.
static SERIAL: Mutex<()> = Mutex::new(());

fn lock() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// GPU 0: two compute processes, a graphics one, one process with both contexts, two MPS
/// clients (one whose memory NVML cannot tell). GPU 1: nothing. GPU 2: graphics only.
const SCENARIO: &str = r#"{"devices": [
  {"uuid": "GPU-0", "memory_total_mib": 15360, "processes": [
     {"pid": 100, "used_memory_mib": 512},
     {"pid": 101, "used_memory_mib": 256, "kind": "compute"},
     {"pid": 200, "used_memory_mib": 64, "kind": "graphics"},
     {"pid": 300, "used_memory_mib": 32, "kind": "graphics"},
     {"pid": 300, "used_memory_mib": 128, "kind": "compute"},
     {"pid": 400, "used_memory_mib": 1024, "kind": "mps"},
     {"pid": 401, "kind": "mps", "used_memory_unavailable": true}
  ]},
  {"uuid": "GPU-1", "memory_total_mib": 15360},
  {"uuid": "GPU-2", "memory_total_mib": 15360, "processes": [
     {"pid": 500, "used_memory_mib": 8, "kind": "graphics"}
  ]}
]}"#;

const MIB: u64 = 1 << 20;

/// Points the environment at `scenario`; returns the temp dir (keep it) and the library path.
fn setup(scenario: &str) -> (tempfile::TempDir, std::path::PathBuf) {
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
        std::env::remove_var("FAKE_NVML_MIG_STATE");
    }
    (dir, lib)
}

fn pids_and_memory(
    list: Vec<nvml_wrapper::struct_wrappers::device::ProcessInfo>,
) -> Vec<(u32, UsedGpuMemory)> {
    list.into_iter()
        .map(|p| {
            assert_eq!(
                (p.gpu_instance_id, p.compute_instance_id),
                (None, None),
                "no MIG: NVML gives no instance ids"
            );
            (p.pid, p.used_gpu_memory)
        })
        .collect()
}

#[test]
fn nvml_wrapper_lists_each_kind_on_its_own_gpu() {
    let _g = lock();
    let (_dir, lib) = setup(SCENARIO);
    let nvml = Nvml::builder()
        .lib_path(lib.as_os_str())
        .init()
        .expect("init");
    let d0 = nvml.device_by_index(0).expect("GPU 0");
    assert_eq!(
        pids_and_memory(d0.running_compute_processes().expect("compute")),
        vec![
            (100, UsedGpuMemory::Used(512 * MIB)),
            (101, UsedGpuMemory::Used(256 * MIB)),
            (300, UsedGpuMemory::Used(128 * MIB)),
        ]
    );
    assert_eq!(
        pids_and_memory(d0.running_graphics_processes().expect("graphics")),
        vec![
            (200, UsedGpuMemory::Used(64 * MIB)),
            (300, UsedGpuMemory::Used(32 * MIB)),
        ]
    );
    assert_eq!(
        pids_and_memory(d0.mps_running_compute_processes().expect("mps")),
        vec![
            (400, UsedGpuMemory::Used(1024 * MIB)),
            (401, UsedGpuMemory::Unavailable),
        ]
    );
    assert_eq!(d0.running_compute_processes_count().expect("count"), 3);
    assert_eq!(d0.running_graphics_processes_count().expect("count"), 2);

    let d1 = nvml.device_by_index(1).expect("GPU 1");
    assert!(d1.running_compute_processes().expect("compute").is_empty());
    assert!(
        d1.running_graphics_processes()
            .expect("graphics")
            .is_empty()
    );
    assert!(d1.mps_running_compute_processes().expect("mps").is_empty());
    assert_eq!(d1.running_graphics_processes_count().expect("count"), 0);

    // A graphics-only GPU: its process is in no compute list, which is why the node check reads
    // every list.
    let d2 = nvml.device_by_uuid("GPU-2").expect("GPU 2");
    assert!(d2.running_compute_processes().expect("compute").is_empty());
    assert_eq!(
        pids_and_memory(d2.running_graphics_processes().expect("graphics")),
        vec![(500, UsedGpuMemory::Used(8 * MIB))]
    );
}

#[test]
fn an_unknown_process_kind_is_an_invalid_scenario() {
    let _g = lock();
    let (_dir, lib) = setup(
        r#"{"devices": [{"uuid": "GPU-0", "memory_total_mib": 1,
            "processes": [{"pid": 1, "kind": "video"}]}]}"#,
    );
    assert!(matches!(
        Nvml::builder().lib_path(lib.as_os_str()).init(),
        Err(NvmlError::Unknown)
    ));
}

/// The three layouts NVML's process lists use, as nvml-wrapper-sys declares them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layout {
    V1,
    V2,
    V3,
}

type RawV1 =
    unsafe extern "C" fn(*mut c_void, *mut c_uint, *mut nvidia_ml::NvmlProcessInfoV1) -> c_uint;
type RawV2 =
    unsafe extern "C" fn(*mut c_void, *mut c_uint, *mut nvidia_ml::NvmlProcessInfo) -> c_uint;

#[derive(Clone, Copy)]
enum Entry {
    V1(RawV1),
    V2(RawV2),
}

/// Every exported process-list entry point: name, layout, function.
fn entry_points() -> Vec<(&'static str, Layout, Entry)> {
    use nvidia_ml as f;
    vec![
        (
            "compute",
            Layout::V1,
            Entry::V1(f::nvmlDeviceGetComputeRunningProcesses),
        ),
        (
            "compute",
            Layout::V2,
            Entry::V2(f::nvmlDeviceGetComputeRunningProcesses_v2),
        ),
        (
            "compute",
            Layout::V3,
            Entry::V2(f::nvmlDeviceGetComputeRunningProcesses_v3),
        ),
        (
            "graphics",
            Layout::V1,
            Entry::V1(f::nvmlDeviceGetGraphicsRunningProcesses),
        ),
        (
            "graphics",
            Layout::V2,
            Entry::V2(f::nvmlDeviceGetGraphicsRunningProcesses_v2),
        ),
        (
            "graphics",
            Layout::V3,
            Entry::V2(f::nvmlDeviceGetGraphicsRunningProcesses_v3),
        ),
        (
            "mps",
            Layout::V1,
            Entry::V1(f::nvmlDeviceGetMPSComputeRunningProcesses),
        ),
        (
            "mps",
            Layout::V2,
            Entry::V2(f::nvmlDeviceGetMPSComputeRunningProcesses_v2),
        ),
        (
            "mps",
            Layout::V3,
            Entry::V2(f::nvmlDeviceGetMPSComputeRunningProcesses_v3),
        ),
    ]
}

/// What GPU 0 of [`SCENARIO`] lists for `kind`: (pid, bytes).
fn expected(kind: &str) -> Vec<(u32, u64)> {
    match kind {
        "compute" => vec![(100, 512 * MIB), (101, 256 * MIB), (300, 128 * MIB)],
        "graphics" => vec![(200, 64 * MIB), (300, 32 * MIB)],
        _ => vec![(400, 1024 * MIB), (401, u64::MAX)],
    }
}

/// One entry of the caller's buffer after a call: (pid, bytes, GPU instance, compute instance).
type Written = (u32, u64, u32, u32);

/// A sentinel no entry point writes: entries past the answer must keep it.
const UNTOUCHED_PID: u32 = 0xdead_beef;

/// One raw call with a buffer of `capacity` entries (`None`: a NULL buffer). Returns the NVML
/// code, the count it left, and the buffer as (pid, bytes, gpu instance, compute instance) with
/// `u32::MAX` instance ids for the v1 layout, which has none.
fn call(
    entry: Entry,
    device: *mut c_void,
    capacity: Option<u32>,
    count_in: u32,
) -> (c_uint, u32, Vec<Written>) {
    let mut count = count_in;
    match entry {
        Entry::V1(f) => {
            // The caller's struct as the real bindings declare it: the fake must fill exactly it.
            let mut buf = vec![
                nvmlProcessInfo_v1_t {
                    pid: UNTOUCHED_PID,
                    usedGpuMemory: 0,
                };
                capacity.unwrap_or(0) as usize
            ];
            let ptr = if capacity.is_some() {
                buf.as_mut_ptr().cast()
            } else {
                std::ptr::null_mut()
            };
            // SAFETY: `buf` holds `capacity` entries of the v1 layout (or `ptr` is NULL).
            let rc = unsafe { f(device, &mut count, ptr) };
            let out = buf
                .iter()
                .map(|p| (p.pid, p.usedGpuMemory, u32::MAX, u32::MAX))
                .collect();
            (rc, count, out)
        }
        Entry::V2(f) => {
            let zero = nvmlProcessInfo_v2_t {
                pid: UNTOUCHED_PID,
                usedGpuMemory: 0,
                gpuInstanceId: 0,
                computeInstanceId: 0,
            };
            // `_v3` takes `nvmlProcessInfo_t`, the same struct as `_v2`'s in every header.
            let _: nvmlProcessInfo_t = zero;
            let mut buf = vec![zero; capacity.unwrap_or(0) as usize];
            let ptr = if capacity.is_some() {
                buf.as_mut_ptr().cast()
            } else {
                std::ptr::null_mut()
            };
            // SAFETY: `buf` holds `capacity` entries of the v2 layout (or `ptr` is NULL).
            let rc = unsafe { f(device, &mut count, ptr) };
            let out = buf
                .iter()
                .map(|p| (p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId))
                .collect();
            (rc, count, out)
        }
    }
}

fn raw_handle(index: u32) -> *mut c_void {
    let mut handle = std::ptr::null_mut();
    // SAFETY: a valid out pointer.
    let rc = unsafe { nvidia_ml::nvmlDeviceGetHandleByIndex_v2(index, &mut handle) };
    assert_eq!(rc, nvidia_ml::NVML_SUCCESS);
    handle
}

#[test]
fn every_entry_point_follows_nvmls_two_call_protocol_with_its_own_layout() {
    use nvidia_ml::{NVML_ERROR_INSUFFICIENT_SIZE, NVML_ERROR_INVALID_ARGUMENT, NVML_SUCCESS};
    let _g = lock();
    let (_dir, _lib) = setup(SCENARIO);
    assert_eq!(nvidia_ml::nvmlInit_v2(), NVML_SUCCESS);
    let busy = raw_handle(0);
    let idle = raw_handle(1);
    for (kind, layout, entry) in entry_points() {
        let want = expected(kind);
        let n = want.len() as u32;
        let what = format!("{kind} {layout:?}");

        // The size query: count 0, NULL buffer ⇒ INSUFFICIENT_SIZE with the number.
        let (rc, count, _) = call(entry, busy, None, 0);
        assert_eq!(
            (rc, count),
            (NVML_ERROR_INSUFFICIENT_SIZE, n),
            "{what}: size query"
        );

        // One short: INSUFFICIENT_SIZE, the number, nothing written.
        let (rc, count, buf) = call(entry, busy, Some(n - 1), n - 1);
        assert_eq!(
            (rc, count),
            (NVML_ERROR_INSUFFICIENT_SIZE, n),
            "{what}: short buffer"
        );
        assert!(
            buf.iter().all(|e| e.0 == UNTOUCHED_PID),
            "{what}: short buffer written"
        );

        // Room to spare (nvml-wrapper asks for 5 more): SUCCESS, the number, the entries in
        // order in the caller's layout, the rest untouched.
        let (rc, count, buf) = call(entry, busy, Some(n + 5), n + 5);
        assert_eq!((rc, count), (NVML_SUCCESS, n), "{what}: roomy buffer");
        let got: Vec<(u32, u64)> = buf[..n as usize].iter().map(|e| (e.0, e.1)).collect();
        assert_eq!(got, want, "{what}: entries");
        if layout != Layout::V1 {
            assert!(
                buf[..n as usize]
                    .iter()
                    .all(|e| (e.2, e.3) == (u32::MAX, u32::MAX)),
                "{what}: no MIG instance ids"
            );
        }
        assert!(
            buf[n as usize..].iter().all(|e| e.0 == UNTOUCHED_PID),
            "{what}: wrote past the answer"
        );

        // Exactly the room needed works too.
        let (rc, count, _) = call(entry, busy, Some(n), n);
        assert_eq!((rc, count), (NVML_SUCCESS, n), "{what}: exact buffer");

        // A buffer size with no buffer, when there is something to write: INVALID_ARGUMENT.
        let (rc, _, _) = call(entry, busy, None, n);
        assert_eq!(rc, NVML_ERROR_INVALID_ARGUMENT, "{what}: NULL buffer");

        // A GPU with nothing of this kind: SUCCESS and 0, with or without a buffer.
        let (rc, count, _) = call(entry, idle, None, 0);
        assert_eq!((rc, count), (NVML_SUCCESS, 0), "{what}: idle size query");
        let (rc, count, buf) = call(entry, idle, Some(4), 4);
        assert_eq!((rc, count), (NVML_SUCCESS, 0), "{what}: idle");
        assert!(buf.iter().all(|e| e.0 == UNTOUCHED_PID));

        // A NULL count and a handle that is not a device: INVALID_ARGUMENT.
        let rc = match entry {
            // SAFETY: a NULL count is what is tested; nothing is written.
            Entry::V1(f) => unsafe { f(busy, std::ptr::null_mut(), std::ptr::null_mut()) },
            // SAFETY: as above.
            Entry::V2(f) => unsafe { f(busy, std::ptr::null_mut(), std::ptr::null_mut()) },
        };
        assert_eq!(rc, NVML_ERROR_INVALID_ARGUMENT, "{what}: NULL count");
        let (rc, _, _) = call(entry, std::ptr::null_mut(), None, 0);
        assert_eq!(rc, NVML_ERROR_INVALID_ARGUMENT, "{what}: bad handle");
    }
    assert_eq!(nvidia_ml::nvmlShutdown(), NVML_SUCCESS);

    // Before init (or after the last shutdown) every list is UNINITIALIZED.
    for (kind, layout, entry) in entry_points() {
        let (rc, _, _) = call(entry, busy, None, 0);
        assert_eq!(
            rc,
            nvidia_ml::NVML_ERROR_UNINITIALIZED,
            "{kind} {layout:?} uninitialized"
        );
    }
}

#[test]
fn the_layouts_are_nvmls() {
    // v1: pid, usedGpuMemory. v2/v3: pid, usedGpuMemory, gpuInstanceId, computeInstanceId.
    assert_eq!(
        std::mem::size_of::<nvidia_ml::NvmlProcessInfoV1>(),
        std::mem::size_of::<nvmlProcessInfo_v1_t>()
    );
    assert_eq!(
        std::mem::size_of::<nvidia_ml::NvmlProcessInfo>(),
        std::mem::size_of::<nvmlProcessInfo_v2_t>()
    );
    assert_eq!(std::mem::size_of::<nvmlProcessInfo_v1_t>(), 16);
    assert_eq!(std::mem::size_of::<nvmlProcessInfo_v2_t>(), 24);
}

//! A fake `libnvidia-ml.so.1` for tests: a scenario file describes the GPUs, a JSON-lines file
//! scripts events (XID, GPU lost, recovered), and the simulated GPU shared with the fake
//! `libcuda.so.1` supplies utilization and per-process memory. See `README.md` for the formats.
//!
//! Test support only, never shipped. Every entry point catches panics and returns an NVML error
//! code instead, so a bug here shows up as a failed call, not as an abort of the test process.
#![allow(
    clippy::disallowed_types,
    reason = "test support: times real processes and threads, no tokio clock"
)]
#![allow(non_snake_case, clippy::missing_safety_doc)]

pub mod mig;
mod mig_entry;
pub mod scenario;

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void};
use std::io::{Read, Seek, SeekFrom};
use std::sync::atomic::AtomicU8;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use scenario::{EventLine, ProcessKind, Scenario};

pub type NvmlReturn = c_uint;
pub const NVML_SUCCESS: NvmlReturn = 0;
pub const NVML_ERROR_UNINITIALIZED: NvmlReturn = 1;
pub const NVML_ERROR_INVALID_ARGUMENT: NvmlReturn = 2;
pub const NVML_ERROR_NOT_SUPPORTED: NvmlReturn = 3;
pub const NVML_ERROR_NO_PERMISSION: NvmlReturn = 4;
pub const NVML_ERROR_NOT_FOUND: NvmlReturn = 6;
pub const NVML_ERROR_INSUFFICIENT_SIZE: NvmlReturn = 7;
pub const NVML_ERROR_DRIVER_NOT_LOADED: NvmlReturn = 9;
pub const NVML_ERROR_TIMEOUT: NvmlReturn = 10;
pub const NVML_ERROR_GPU_IS_LOST: NvmlReturn = 15;
pub const NVML_ERROR_IN_USE: NvmlReturn = 19;
pub const NVML_ERROR_INSUFFICIENT_RESOURCES: NvmlReturn = 23;
pub const NVML_ERROR_ARGUMENT_VERSION_MISMATCH: NvmlReturn = 25;
pub const NVML_ERROR_UNKNOWN: NvmlReturn = 999;

pub const EVENT_TYPE_XID_CRITICAL_ERROR: c_ulonglong = 8;
/// The XID NVIDIA uses for "GPU has fallen off the bus"; delivered with a `lost` event.
pub const XID_GPU_LOST: c_ulonglong = 79;
const SUPPORTED_EVENTS: c_ulonglong = 0x1 | 0x2 | 0x4 | 0x8 | 0x10;

/// `nvmlDevice_t` values are addresses inside this array, so they are real, stable pointers.
static DEVICE_HANDLES: [AtomicU8; 64] = [const { AtomicU8::new(0) }; 64];

#[repr(C)]
pub struct NvmlMemory {
    pub total: c_ulonglong,
    pub free: c_ulonglong,
    pub used: c_ulonglong,
}

#[repr(C)]
pub struct NvmlMemoryV2 {
    pub version: c_uint,
    pub total: c_ulonglong,
    pub reserved: c_ulonglong,
    pub free: c_ulonglong,
    pub used: c_ulonglong,
}
/// `NVML_STRUCT_VERSION(Memory, 2)`.
pub const NVML_MEMORY_V2_VERSION: c_uint =
    (std::mem::size_of::<NvmlMemoryV2>() as c_uint) | (2 << 24);

#[repr(C)]
pub struct NvmlPciInfo {
    pub bus_id_legacy: [c_char; 16],
    pub domain: c_uint,
    pub bus: c_uint,
    pub device: c_uint,
    pub pci_device_id: c_uint,
    pub pci_sub_system_id: c_uint,
    pub bus_id: [c_char; 32],
}

#[repr(C)]
pub struct NvmlUtilization {
    pub gpu: c_uint,
    pub memory: c_uint,
}

/// `nvmlProcessInfo_t` of the `_v2`/`_v3` calls.
#[repr(C)]
pub struct NvmlProcessInfo {
    pub pid: c_uint,
    pub used_gpu_memory: c_ulonglong,
    pub gpu_instance_id: c_uint,
    pub compute_instance_id: c_uint,
}

/// `nvmlProcessInfo_v1_t` of the unversioned call.
#[repr(C)]
pub struct NvmlProcessInfoV1 {
    pub pid: c_uint,
    pub used_gpu_memory: c_ulonglong,
}

#[repr(C)]
pub struct NvmlProcessUtilizationSample {
    pub pid: c_uint,
    pub time_stamp: c_ulonglong,
    pub sm_util: c_uint,
    pub mem_util: c_uint,
    pub enc_util: c_uint,
    pub dec_util: c_uint,
}

#[repr(C)]
pub struct NvmlEventData {
    pub device: *mut c_void,
    pub event_type: c_ulonglong,
    pub event_data: c_ulonglong,
    pub gpu_instance_id: c_uint,
    pub compute_instance_id: c_uint,
}

/// One queued event: device index, type, data.
#[derive(Clone, Copy, Debug)]
struct PendingEvent {
    device: usize,
    event_type: c_ulonglong,
    data: c_ulonglong,
}

#[derive(Debug, Default)]
struct EventSet {
    /// Registered event-type mask per device index.
    masks: Vec<(usize, c_ulonglong)>,
}

#[derive(Default)]
struct Global {
    init_count: u32,
    scenario: Option<Scenario>,
    events_path: Option<std::path::PathBuf>,
    events_offset: u64,
    lost: Vec<bool>,
    pending: std::collections::VecDeque<PendingEvent>,
    sets: Vec<Option<EventSet>>,
    /// Where the MIG state lives (`FAKE_NVML_MIG_STATE`), chosen at init.
    mig_store: Option<mig::Store>,
}

static GLOBAL: Mutex<Option<Global>> = Mutex::new(None);
static EVENT_ARRIVED: Condvar = Condvar::new();

fn global() -> MutexGuard<'static, Option<Global>> {
    GLOBAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs an entry point body; a panic becomes `NVML_ERROR_UNKNOWN`.
fn guard(f: impl FnOnce() -> NvmlReturn) -> NvmlReturn {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or(NVML_ERROR_UNKNOWN)
}

fn gpu() -> Option<&'static fake_gpu_state::GpuState> {
    static STATE: std::sync::OnceLock<Option<&'static fake_gpu_state::GpuState>> =
        std::sync::OnceLock::new();
    *STATE.get_or_init(|| {
        std::env::var_os("FAKE_GPU_STATE")
            .filter(|p| !p.is_empty())
            .and_then(|_| fake_gpu_state::open())
    })
}

impl Global {
    /// Reads lines appended to the events file since the last call and applies them.
    fn poll_events(&mut self) {
        let Some(path) = self.events_path.clone() else {
            return;
        };
        let Ok(mut file) = std::fs::File::open(&path) else {
            return;
        };
        if file.seek(SeekFrom::Start(self.events_offset)).is_err() {
            return;
        }
        let mut text = String::new();
        if file.read_to_string(&mut text).is_err() {
            return;
        }
        // Only complete lines: a writer may be half-way through the last one.
        let Some(end) = text.rfind('\n') else {
            return;
        };
        self.events_offset += end as u64 + 1;
        for line in text[..end].lines() {
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            match serde_json::from_str::<EventLine>(line) {
                Ok(ev) => self.apply_event(ev),
                Err(e) => eprintln!("fake-nvml: ignoring bad event line {line:?}: {e}"),
            }
        }
    }

    fn apply_event(&mut self, ev: EventLine) {
        let count = self.scenario.as_ref().map_or(0, |s| s.devices.len());
        if ev.device >= count {
            eprintln!("fake-nvml: event for unknown device {}", ev.device);
            return;
        }
        match ev.kind.as_str() {
            "xid" => self.pending.push_back(PendingEvent {
                device: ev.device,
                event_type: EVENT_TYPE_XID_CRITICAL_ERROR,
                data: ev.xid.unwrap_or(0),
            }),
            "lost" => {
                self.lost[ev.device] = true;
                self.pending.push_back(PendingEvent {
                    device: ev.device,
                    event_type: EVENT_TYPE_XID_CRITICAL_ERROR,
                    data: XID_GPU_LOST,
                });
            }
            "recovered" => self.lost[ev.device] = false,
            other => eprintln!("fake-nvml: unknown event kind {other:?}"),
        }
    }

    /// The device index behind a handle, or the NVML error the real library would give.
    fn device(&mut self, handle: *mut c_void) -> Result<usize, NvmlReturn> {
        self.poll_events();
        let count = self.scenario.as_ref().map_or(0, |s| s.devices.len());
        let base = DEVICE_HANDLES.as_ptr() as usize;
        let idx = (handle as usize).wrapping_sub(base);
        if idx >= count {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        if self.lost[idx] {
            return Err(NVML_ERROR_GPU_IS_LOST);
        }
        Ok(idx)
    }
}

/// Runs `f` with the initialised global state, or returns `NVML_ERROR_UNINITIALIZED`.
fn with_init(f: impl FnOnce(&mut Global) -> NvmlReturn) -> NvmlReturn {
    guard(|| {
        let mut g = global();
        match g.as_mut() {
            Some(state) if state.init_count > 0 && state.scenario.is_some() => f(state),
            _ => NVML_ERROR_UNINITIALIZED,
        }
    })
}

/// Runs `f` with the device index and its scenario entry.
fn with_device(
    handle: *mut c_void,
    f: impl FnOnce(&mut Global, usize) -> NvmlReturn,
) -> NvmlReturn {
    with_init(|g| match g.device(handle) {
        Ok(idx) => f(g, idx),
        Err(code) => code,
    })
}

fn handle_of(idx: usize) -> *mut c_void {
    DEVICE_HANDLES[idx].as_ptr().cast()
}

/// Copies `s` NUL-terminated into `buf` of `len` bytes.
unsafe fn write_cstr(s: &str, buf: *mut c_char, len: c_uint) -> NvmlReturn {
    if buf.is_null() {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    let bytes = s.as_bytes();
    if bytes.len() + 1 > len as usize {
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    // SAFETY: the caller promises `buf` holds `len` bytes; we checked the length.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr().cast::<c_char>(), buf, bytes.len());
        *buf.add(bytes.len()) = 0;
    }
    NVML_SUCCESS
}

fn init_impl() -> NvmlReturn {
    if std::env::var("FAKE_NVML_FAIL_INIT").is_ok_and(|v| v == "1") {
        return NVML_ERROR_DRIVER_NOT_LOADED;
    }
    // A scenario's carved MIG instances must be possible ones (checked here, not in `scenario`,
    // which knows nothing of the MIG tables).
    let scenario = match scenario::load_from_env().and_then(|s| {
        for d in &s.devices {
            mig::seed_device(d).map_err(scenario::ScenarioError::Invalid)?;
        }
        Ok(s)
    }) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("fake-nvml: nvmlInit fails: {e}");
            return e.nvml_code();
        }
    };
    let mut g = global();
    let state = g.get_or_insert_with(Global::default);
    let events_path = std::env::var_os("FAKE_NVML_EVENTS")
        .filter(|p| !p.is_empty())
        .map(std::path::PathBuf::from);
    if events_path != state.events_path {
        state.events_path = events_path;
        state.events_offset = 0;
        state.pending.clear();
        state.lost.clear();
    }
    state.lost.resize(scenario.devices.len(), false);
    // The MIG state: the same file is kept; an in-process state lives until the last shutdown.
    let fresh = mig::Store::from_env();
    let keep = match (&state.mig_store, &fresh) {
        (Some(mig::Store::File(a)), mig::Store::File(b)) => a == b,
        (Some(mig::Store::Memory(_)), mig::Store::Memory(_)) => state.init_count > 0,
        _ => false,
    };
    if !keep {
        state.mig_store = Some(fresh);
    }
    state.scenario = Some(scenario);
    state.init_count += 1;
    NVML_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit_v2() -> NvmlReturn {
    guard(init_impl)
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit() -> NvmlReturn {
    guard(init_impl)
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> NvmlReturn {
    guard(init_impl)
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlShutdown() -> NvmlReturn {
    guard(|| {
        let mut g = global();
        match g.as_mut() {
            Some(state) if state.init_count > 0 => {
                state.init_count -= 1;
                NVML_SUCCESS
            }
            _ => NVML_ERROR_UNINITIALIZED,
        }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlErrorString(result: NvmlReturn) -> *const c_char {
    let s: &'static [u8] = match result {
        NVML_SUCCESS => b"Success\0",
        NVML_ERROR_UNINITIALIZED => b"Uninitialized\0",
        NVML_ERROR_INVALID_ARGUMENT => b"Invalid Argument\0",
        NVML_ERROR_NOT_SUPPORTED => b"Not Supported\0",
        NVML_ERROR_NO_PERMISSION => b"Insufficient Permissions\0",
        NVML_ERROR_IN_USE => b"In use by another client\0",
        NVML_ERROR_INSUFFICIENT_RESOURCES => b"Insufficient resources\0",
        NVML_ERROR_NOT_FOUND => b"Not Found\0",
        NVML_ERROR_INSUFFICIENT_SIZE => b"Insufficient Size\0",
        NVML_ERROR_DRIVER_NOT_LOADED => b"Driver Not Loaded\0",
        NVML_ERROR_TIMEOUT => b"Timeout\0",
        NVML_ERROR_GPU_IS_LOST => b"GPU is lost\0",
        NVML_ERROR_ARGUMENT_VERSION_MISMATCH => b"Argument version mismatch\0",
        _ => b"Unknown Error\0",
    };
    s.as_ptr().cast()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(
    version: *mut c_char,
    len: c_uint,
) -> NvmlReturn {
    with_init(|g| {
        let v = g
            .scenario
            .as_ref()
            .map_or("", |s| s.driver_version.as_str());
        // SAFETY: caller's buffer contract.
        unsafe { write_cstr(v, version, len) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetNVMLVersion(version: *mut c_char, len: c_uint) -> NvmlReturn {
    with_init(|g| {
        let v = g
            .scenario
            .as_ref()
            .map_or(String::new(), |s| format!("12.{}", s.driver_version));
        // SAFETY: caller's buffer contract.
        unsafe { write_cstr(&v, version, len) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion(version: *mut c_int) -> NvmlReturn {
    with_init(|g| {
        if version.is_null() {
            return NVML_ERROR_INVALID_ARGUMENT;
        }
        let v = g.scenario.as_ref().map_or(0, |s| s.cuda_driver_version);
        // SAFETY: checked non-null.
        unsafe { *version = v };
        NVML_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(version: *mut c_int) -> NvmlReturn {
    // SAFETY: same contract.
    unsafe { nvmlSystemGetCudaDriverVersion(version) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> NvmlReturn {
    with_init(|g| {
        if count.is_null() {
            return NVML_ERROR_INVALID_ARGUMENT;
        }
        g.poll_events();
        let n = g.scenario.as_ref().map_or(0, |s| s.devices.len());
        // SAFETY: checked non-null.
        unsafe { *count = n as c_uint };
        NVML_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount(count: *mut c_uint) -> NvmlReturn {
    // SAFETY: same contract.
    unsafe { nvmlDeviceGetCount_v2(count) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device: *mut *mut c_void,
) -> NvmlReturn {
    with_init(|g| {
        if device.is_null() {
            return NVML_ERROR_INVALID_ARGUMENT;
        }
        g.poll_events();
        let idx = index as usize;
        let n = g.scenario.as_ref().map_or(0, |s| s.devices.len());
        if idx >= n {
            return NVML_ERROR_INVALID_ARGUMENT;
        }
        if g.lost[idx] {
            return NVML_ERROR_GPU_IS_LOST;
        }
        // SAFETY: checked non-null.
        unsafe { *device = handle_of(idx) };
        NVML_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex(
    index: c_uint,
    device: *mut *mut c_void,
) -> NvmlReturn {
    // SAFETY: same contract.
    unsafe { nvmlDeviceGetHandleByIndex_v2(index, device) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(
    uuid: *const c_char,
    device: *mut *mut c_void,
) -> NvmlReturn {
    with_init(|g| {
        if uuid.is_null() || device.is_null() {
            return NVML_ERROR_INVALID_ARGUMENT;
        }
        // SAFETY: caller passes a NUL-terminated string.
        let wanted = unsafe { std::ffi::CStr::from_ptr(uuid) }.to_string_lossy();
        g.poll_events();
        let found = g
            .scenario
            .as_ref()
            .and_then(|s| s.devices.iter().position(|d| d.uuid == wanted));
        if found.is_none() && wanted.starts_with("MIG-") {
            return match mig_entry::mig_handle_by_uuid(g, &wanted) {
                Ok(h) => {
                    // SAFETY: checked non-null.
                    unsafe { *device = h };
                    NVML_SUCCESS
                }
                Err(c) => c,
            };
        }
        match found {
            Some(idx) if g.lost[idx] => NVML_ERROR_GPU_IS_LOST,
            Some(idx) => {
                // SAFETY: checked non-null.
                unsafe { *device = handle_of(idx) };
                NVML_SUCCESS
            }
            None => NVML_ERROR_NOT_FOUND,
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetIndex(device: *mut c_void, index: *mut c_uint) -> NvmlReturn {
    with_device(device, |_, idx| {
        if index.is_null() {
            return NVML_ERROR_INVALID_ARGUMENT;
        }
        // SAFETY: checked non-null.
        unsafe { *index = idx as c_uint };
        NVML_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMinorNumber(
    device: *mut c_void,
    minor: *mut c_uint,
) -> NvmlReturn {
    with_device(device, |g, idx| {
        if minor.is_null() {
            return NVML_ERROR_INVALID_ARGUMENT;
        }
        let m = g
            .scenario
            .as_ref()
            .and_then(|s| s.devices[idx].minor_number)
            .unwrap_or(idx as u32);
        // SAFETY: checked non-null.
        unsafe { *minor = m };
        NVML_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    device: *mut c_void,
    uuid: *mut c_char,
    len: c_uint,
) -> NvmlReturn {
    if mig_entry::is_mig_handle(device) {
        // SAFETY: caller's buffer contract.
        return unsafe { mig_entry::mig_string(device, false, uuid, len) };
    }
    with_device(device, |g, idx| {
        let s = g
            .scenario
            .as_ref()
            .map_or("", |s| s.devices[idx].uuid.as_str());
        // SAFETY: caller's buffer contract.
        unsafe { write_cstr(s, uuid, len) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetName(
    device: *mut c_void,
    name: *mut c_char,
    len: c_uint,
) -> NvmlReturn {
    if mig_entry::is_mig_handle(device) {
        // SAFETY: caller's buffer contract.
        return unsafe { mig_entry::mig_string(device, true, name, len) };
    }
    with_device(device, |g, idx| {
        let s = g
            .scenario
            .as_ref()
            .map_or("", |s| s.devices[idx].name.as_str());
        // SAFETY: caller's buffer contract.
        unsafe { write_cstr(s, name, len) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCudaComputeCapability(
    device: *mut c_void,
    major: *mut c_int,
    minor: *mut c_int,
) -> NvmlReturn {
    with_device(device, |g, idx| {
        if major.is_null() || minor.is_null() {
            return NVML_ERROR_INVALID_ARGUMENT;
        }
        let (ma, mi) = g
            .scenario
            .as_ref()
            .map_or((7, 5), |s| s.devices[idx].compute_capability());
        // SAFETY: checked non-null.
        unsafe {
            *major = ma;
            *minor = mi;
        }
        NVML_SUCCESS
    })
}

fn fill_pci(info: &mut NvmlPciInfo, bus_id: &str) {
    let parsed = scenario::parse_pci_bus_id(bus_id);
    let (domain, bus, dev) = parsed.unwrap_or((0, 0, 0));
    info.domain = domain;
    info.bus = bus;
    info.device = dev;
    info.pci_device_id = 0x1eb8_10de;
    info.pci_sub_system_id = 0x12a2_10de;
    info.bus_id = [0; 32];
    info.bus_id_legacy = [0; 16];
    for (dst, src) in info.bus_id.iter_mut().zip(bus_id.bytes().take(31)) {
        *dst = src as c_char;
    }
    // The legacy field holds the 8-hex-digit-domain form cut to 15 characters.
    let legacy = format!("{domain:04x}:{bus:02x}:{dev:02x}.0").to_uppercase();
    for (dst, src) in info.bus_id_legacy.iter_mut().zip(legacy.bytes().take(15)) {
        *dst = src as c_char;
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v3(
    device: *mut c_void,
    pci: *mut NvmlPciInfo,
) -> NvmlReturn {
    with_device(device, |g, idx| {
        if pci.is_null() {
            return NVML_ERROR_INVALID_ARGUMENT;
        }
        let bus_id = g
            .scenario
            .as_ref()
            .map_or(String::new(), |s| s.devices[idx].pci_bus_id.clone());
        // SAFETY: checked non-null; the caller owns a full struct.
        fill_pci(unsafe { &mut *pci }, &bus_id);
        NVML_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v2(
    device: *mut c_void,
    pci: *mut NvmlPciInfo,
) -> NvmlReturn {
    // SAFETY: same contract and layout.
    unsafe { nvmlDeviceGetPciInfo_v3(device, pci) }
}

/// `nvmlEnableState_t`.
pub const NVML_FEATURE_DISABLED: c_uint = 0;
pub const NVML_FEATURE_ENABLED: c_uint = 1;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTopologyCommonAncestor(
    device1: *mut c_void,
    device2: *mut c_void,
    level: *mut c_uint,
) -> NvmlReturn {
    with_device(device1, |g, a| {
        let b = match g.device(device2) {
            Ok(b) => b,
            Err(code) => return code,
        };
        if level.is_null() {
            return NVML_ERROR_INVALID_ARGUMENT;
        }
        let Some(s) = g.scenario.as_ref() else {
            return NVML_ERROR_UNINITIALIZED;
        };
        match scenario::common_ancestor(&s.devices[a], &s.devices[b]) {
            Some(l) => {
                // SAFETY: checked non-null.
                unsafe { *level = l };
                NVML_SUCCESS
            }
            None => NVML_ERROR_NOT_SUPPORTED,
        }
    })
}

/// Runs `f` with the scenario's NVLink `link` of the device: `NVML_ERROR_NOT_SUPPORTED` for a
/// device without NVLinks, `NVML_ERROR_INVALID_ARGUMENT` for a link it does not have.
fn with_nvlink(
    device: *mut c_void,
    link: c_uint,
    f: impl FnOnce(&scenario::ScenarioNvLink) -> NvmlReturn,
) -> NvmlReturn {
    with_device(device, |g, idx| {
        let Some(s) = g.scenario.as_ref() else {
            return NVML_ERROR_UNINITIALIZED;
        };
        let links = &s.devices[idx].nvlinks;
        if links.is_empty() {
            return NVML_ERROR_NOT_SUPPORTED;
        }
        match links.get(link as usize) {
            Some(l) => f(l),
            None => NVML_ERROR_INVALID_ARGUMENT,
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkState(
    device: *mut c_void,
    link: c_uint,
    is_active: *mut c_uint,
) -> NvmlReturn {
    with_nvlink(device, link, |l| {
        if is_active.is_null() {
            return NVML_ERROR_INVALID_ARGUMENT;
        }
        let state = if l.active {
            NVML_FEATURE_ENABLED
        } else {
            NVML_FEATURE_DISABLED
        };
        // SAFETY: checked non-null.
        unsafe { *is_active = state };
        NVML_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkRemotePciInfo_v2(
    device: *mut c_void,
    link: c_uint,
    pci: *mut NvmlPciInfo,
) -> NvmlReturn {
    with_nvlink(device, link, |l| {
        if pci.is_null() {
            return NVML_ERROR_INVALID_ARGUMENT;
        }
        // SAFETY: checked non-null; the caller owns a full struct.
        fill_pci(unsafe { &mut *pci }, &l.remote_pci_bus_id);
        NVML_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkRemotePciInfo(
    device: *mut c_void,
    link: c_uint,
    pci: *mut NvmlPciInfo,
) -> NvmlReturn {
    // SAFETY: same contract and layout.
    unsafe { nvmlDeviceGetNvLinkRemotePciInfo_v2(device, link, pci) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkRemoteDeviceType(
    device: *mut c_void,
    link: c_uint,
    remote_type: *mut c_uint,
) -> NvmlReturn {
    with_nvlink(device, link, |l| {
        if remote_type.is_null() {
            return NVML_ERROR_INVALID_ARGUMENT;
        }
        // SAFETY: checked non-null.
        unsafe { *remote_type = l.remote_device_type_code() };
        NVML_SUCCESS
    })
}

/// (total, used) bytes for a device: the scenario plus memory the fake CUDA allocated.
fn memory_of(g: &Global, idx: usize) -> Result<(u64, u64), NvmlReturn> {
    let Some(dev) = g.scenario.as_ref().map(|s| &s.devices[idx]) else {
        return Err(NVML_ERROR_UNINITIALIZED);
    };
    if dev.memory_info_unsupported {
        return Err(NVML_ERROR_NOT_SUPPORTED);
    }
    let mib = 1u64 << 20;
    let total = dev.memory_total_mib.saturating_mul(mib);
    let simulated = gpu().map_or(0, |s| {
        s.devices[idx.min(fake_gpu_state::MAX_DEVICES - 1)].used_bytes()
    });
    let used = dev
        .memory_used_mib
        .saturating_mul(mib)
        .saturating_add(simulated)
        .min(total);
    Ok((total, used))
}

/// Like `with_device`, for calls that also answer on a MIG device handle: `Err(total bytes)` of
/// the MIG device instead of a device index.
fn with_any_device(
    handle: *mut c_void,
    f: impl FnOnce(&mut Global, Result<usize, u64>) -> NvmlReturn,
) -> NvmlReturn {
    if mig_entry::is_mig_handle(handle) {
        return with_init(|g| match mig_entry::mig_device_facts(g, handle) {
            Ok((_, _, mib)) => f(g, Err(mib << 20)),
            Err(c) => c,
        });
    }
    with_device(handle, |g, idx| f(g, Ok(idx)))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    device: *mut c_void,
    memory: *mut NvmlMemory,
) -> NvmlReturn {
    with_any_device(device, |g, idx| {
        if memory.is_null() {
            return NVML_ERROR_INVALID_ARGUMENT;
        }
        match idx.map_or_else(|mig| Ok((mig, 0)), |idx| memory_of(g, idx)) {
            Ok((total, used)) => {
                // SAFETY: checked non-null.
                unsafe {
                    *memory = NvmlMemory {
                        total,
                        free: total - used,
                        used,
                    }
                };
                NVML_SUCCESS
            }
            Err(code) => code,
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: *mut c_void,
    memory: *mut NvmlMemoryV2,
) -> NvmlReturn {
    with_any_device(device, |g, idx| {
        if memory.is_null() {
            return NVML_ERROR_INVALID_ARGUMENT;
        }
        // SAFETY: checked non-null; `version` is the first field of the caller's struct.
        if unsafe { (*memory).version } != NVML_MEMORY_V2_VERSION {
            return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
        }
        match idx.map_or_else(|mig| Ok((mig, 0)), |idx| memory_of(g, idx)) {
            Ok((total, used)) => {
                // SAFETY: checked non-null.
                unsafe {
                    (*memory).total = total;
                    (*memory).reserved = 0;
                    (*memory).free = total - used;
                    (*memory).used = used;
                }
                NVML_SUCCESS
            }
            Err(code) => code,
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigMode(
    device: *mut c_void,
    current: *mut c_uint,
    pending: *mut c_uint,
) -> NvmlReturn {
    with_device(device, |g, idx| {
        if current.is_null() || pending.is_null() {
            return NVML_ERROR_INVALID_ARGUMENT;
        }
        match mig_entry::mig_mode(g, idx) {
            Ok((cur, pend)) => {
                // SAFETY: checked non-null.
                unsafe {
                    *current = cur as c_uint;
                    *pending = pend as c_uint;
                }
                NVML_SUCCESS
            }
            Err(code) => code,
        }
    })
}

/// Utilization window of the simulated GPU, like NVML's ~1 s sample period.
const UTIL_WINDOW_NS: u64 = 1_000_000_000;

fn simulated_percent(
    idx: usize,
    pid: Option<fake_gpu_state::ProcId>,
    window_ns: u64,
) -> Option<u32> {
    let state = gpu()?;
    let dev = &state.devices[idx.min(fake_gpu_state::MAX_DEVICES - 1)];
    let now = fake_gpu_state::now_ns();
    let from = now.saturating_sub(window_ns);
    let busy = dev.busy_ns(pid, from, now);
    Some(((busy.saturating_mul(100) + window_ns / 2) / window_ns.max(1)).min(100) as u32)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    device: *mut c_void,
    util: *mut NvmlUtilization,
) -> NvmlReturn {
    with_device(device, |g, idx| {
        if util.is_null() {
            return NVML_ERROR_INVALID_ARGUMENT;
        }
        let dev = g.scenario.as_ref().map(|s| &s.devices[idx]);
        let scripted = dev.map_or(0, |d| d.utilization_gpu);
        let gpu_util =
            simulated_percent(idx, None, UTIL_WINDOW_NS).map_or(scripted, |u| u.max(scripted));
        // SAFETY: checked non-null.
        unsafe {
            *util = NvmlUtilization {
                gpu: gpu_util.min(100),
                memory: dev.map_or(0, |d| d.utilization_memory),
            }
        };
        NVML_SUCCESS
    })
}

/// NVML's `NVML_VALUE_NOT_AVAILABLE`: a process's memory NVML cannot tell.
pub const NVML_VALUE_NOT_AVAILABLE: c_ulonglong = c_ulonglong::MAX;

/// What `gpuInstanceId` / `computeInstanceId` hold for a process on a GPU without MIG.
const NO_INSTANCE: c_uint = c_uint::MAX;

/// The processes NVML's `kind` list reports on device `idx`, in order: the scenario's processes
/// of that kind, then (compute only: the fake CUDA makes compute contexts) the live processes of
/// the simulated GPU not already listed. `(pid, used bytes or NVML_VALUE_NOT_AVAILABLE)`.
fn process_list(g: &Global, idx: usize, kind: ProcessKind) -> Vec<(u32, u64)> {
    let mib = 1u64 << 20;
    let offset = g.scenario.as_ref().map_or(0, |s| s.pid_offset);
    let mut list: Vec<(u32, u64)> = g
        .scenario
        .as_ref()
        .map(|s| {
            s.devices[idx]
                .processes
                .iter()
                .filter(|p| p.kind == kind)
                .map(|p| {
                    let bytes = if p.used_memory_unavailable {
                        NVML_VALUE_NOT_AVAILABLE
                    } else {
                        p.used_memory_mib.saturating_mul(mib)
                    };
                    (p.pid, bytes)
                })
                .collect()
        })
        .unwrap_or_default();
    if kind == ProcessKind::Compute
        && let Some(state) = gpu()
    {
        for (pid, bytes) in
            state.devices[idx.min(fake_gpu_state::MAX_DEVICES - 1)].reported_processes()
        {
            let host_pid = (pid as u32).wrapping_add(offset);
            if !list.iter().any(|&(p, _)| p == host_pid) {
                list.push((host_pid, bytes));
            }
        }
    }
    list
}

/// The body every `nvmlDevice*RunningProcesses*` entry point shares: NVML's two-call protocol.
///
/// * `count` NULL ⇒ `NVML_ERROR_INVALID_ARGUMENT`.
/// * `*count` smaller than the number of processes ⇒ `*count` = that number and
///   `NVML_ERROR_INSUFFICIENT_SIZE`, nothing written. `infos` may be NULL then: that is how a
///   caller asks for the number (`*count = 0`).
/// * No process ⇒ `*count = 0`, `NVML_SUCCESS` (NULL `infos` allowed: nothing to write).
/// * Otherwise `infos` NULL ⇒ `NVML_ERROR_INVALID_ARGUMENT`; else the processes are written to
///   `infos[0..n]`, `*count = n`, `NVML_SUCCESS`. Entries past `n` are left untouched.
///
/// `write(i, pid, bytes)` stores entry `i` in the caller's layout (v1 or v2/v3).
unsafe fn running_processes(
    device: *mut c_void,
    count: *mut c_uint,
    kind: ProcessKind,
    infos_null: bool,
    mut write: impl FnMut(usize, u32, u64),
) -> NvmlReturn {
    with_device(device, |g, idx| {
        if count.is_null() {
            return NVML_ERROR_INVALID_ARGUMENT;
        }
        let list = process_list(g, idx, kind);
        // SAFETY: checked non-null.
        let capacity = unsafe { *count } as usize;
        // SAFETY: checked non-null.
        unsafe { *count = list.len() as c_uint };
        if capacity < list.len() {
            return NVML_ERROR_INSUFFICIENT_SIZE;
        }
        if list.is_empty() {
            return NVML_SUCCESS;
        }
        if infos_null {
            return NVML_ERROR_INVALID_ARGUMENT;
        }
        for (i, &(pid, bytes)) in list.iter().enumerate() {
            write(i, pid, bytes);
        }
        NVML_SUCCESS
    })
}

/// [`running_processes`] into `nvmlProcessInfo_t` (the layout of `_v2` and `_v3`).
///
/// # Safety
/// `count` is NULL or valid; `infos` is NULL or holds `*count` entries.
unsafe fn running_processes_v2(
    device: *mut c_void,
    count: *mut c_uint,
    infos: *mut NvmlProcessInfo,
    kind: ProcessKind,
) -> NvmlReturn {
    // SAFETY: entries are written only below the capacity the caller gave, into a non-NULL
    // `infos` (checked by `running_processes` before any write).
    unsafe {
        running_processes(device, count, kind, infos.is_null(), |i, pid, bytes| {
            *infos.add(i) = NvmlProcessInfo {
                pid,
                used_gpu_memory: bytes,
                gpu_instance_id: NO_INSTANCE,
                compute_instance_id: NO_INSTANCE,
            };
        })
    }
}

/// [`running_processes`] into `nvmlProcessInfo_v1_t` (the unversioned entry points).
///
/// # Safety
/// As [`running_processes_v2`].
unsafe fn running_processes_v1(
    device: *mut c_void,
    count: *mut c_uint,
    infos: *mut NvmlProcessInfoV1,
    kind: ProcessKind,
) -> NvmlReturn {
    // SAFETY: as in `running_processes_v2`, with the v1 layout.
    unsafe {
        running_processes(device, count, kind, infos.is_null(), |i, pid, bytes| {
            *infos.add(i) = NvmlProcessInfoV1 {
                pid,
                used_gpu_memory: bytes,
            };
        })
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    device: *mut c_void,
    count: *mut c_uint,
    infos: *mut NvmlProcessInfo,
) -> NvmlReturn {
    // SAFETY: the NVML contract: `infos` holds `*count` entries.
    unsafe { running_processes_v2(device, count, infos, ProcessKind::Compute) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v2(
    device: *mut c_void,
    count: *mut c_uint,
    infos: *mut NvmlProcessInfo,
) -> NvmlReturn {
    // SAFETY: same contract and layout as `_v3`.
    unsafe { running_processes_v2(device, count, infos, ProcessKind::Compute) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses(
    device: *mut c_void,
    count: *mut c_uint,
    infos: *mut NvmlProcessInfoV1,
) -> NvmlReturn {
    // SAFETY: as for `_v3`, with the v1 layout.
    unsafe { running_processes_v1(device, count, infos, ProcessKind::Compute) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGraphicsRunningProcesses_v3(
    device: *mut c_void,
    count: *mut c_uint,
    infos: *mut NvmlProcessInfo,
) -> NvmlReturn {
    // SAFETY: the NVML contract: `infos` holds `*count` entries.
    unsafe { running_processes_v2(device, count, infos, ProcessKind::Graphics) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGraphicsRunningProcesses_v2(
    device: *mut c_void,
    count: *mut c_uint,
    infos: *mut NvmlProcessInfo,
) -> NvmlReturn {
    // SAFETY: same contract and layout as `_v3`.
    unsafe { running_processes_v2(device, count, infos, ProcessKind::Graphics) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGraphicsRunningProcesses(
    device: *mut c_void,
    count: *mut c_uint,
    infos: *mut NvmlProcessInfoV1,
) -> NvmlReturn {
    // SAFETY: as for `_v3`, with the v1 layout.
    unsafe { running_processes_v1(device, count, infos, ProcessKind::Graphics) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMPSComputeRunningProcesses_v3(
    device: *mut c_void,
    count: *mut c_uint,
    infos: *mut NvmlProcessInfo,
) -> NvmlReturn {
    // SAFETY: the NVML contract: `infos` holds `*count` entries.
    unsafe { running_processes_v2(device, count, infos, ProcessKind::Mps) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMPSComputeRunningProcesses_v2(
    device: *mut c_void,
    count: *mut c_uint,
    infos: *mut NvmlProcessInfo,
) -> NvmlReturn {
    // SAFETY: same contract and layout as `_v3`.
    unsafe { running_processes_v2(device, count, infos, ProcessKind::Mps) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMPSComputeRunningProcesses(
    device: *mut c_void,
    count: *mut c_uint,
    infos: *mut NvmlProcessInfoV1,
) -> NvmlReturn {
    // SAFETY: as for `_v3`, with the v1 layout.
    unsafe { running_processes_v1(device, count, infos, ProcessKind::Mps) }
}

/// `(host pid, SM %)` of each process active on device `idx` since `last_seen_us` (µs, wall
/// clock; at most the last second).
fn process_samples(g: &Global, idx: usize, last_seen_us: c_ulonglong) -> Vec<(u32, u32)> {
    let now_us = fake_gpu_state::realtime_us();
    let window_ns = if last_seen_us == 0 || last_seen_us >= now_us {
        UTIL_WINDOW_NS
    } else {
        ((now_us - last_seen_us) * 1000).min(UTIL_WINDOW_NS)
    };
    let offset = g.scenario.as_ref().map_or(0, |s| s.pid_offset);
    let mut list: Vec<(u32, u32)> = Vec::new();
    if let Some(state) = gpu() {
        let dev = &state.devices[idx.min(fake_gpu_state::MAX_DEVICES - 1)];
        let now = fake_gpu_state::now_ns();
        for id in dev.active_pids(now.saturating_sub(window_ns), now) {
            let Some(reported) = dev.reported_pid(id) else {
                continue;
            };
            let util = simulated_percent(idx, Some(id), window_ns).unwrap_or(0);
            list.push(((reported as u32).wrapping_add(offset), util));
        }
    }
    list
}

/// `nvmlProcessDetail_v1_t`.
#[repr(C)]
pub struct NvmlProcessDetail {
    pub pid: c_uint,
    pub used_gpu_memory: c_ulonglong,
    pub gpu_instance_id: c_uint,
    pub compute_instance_id: c_uint,
    pub used_gpu_cc_protected_memory: c_ulonglong,
}

/// `nvmlProcessDetailList_v1_t`.
#[repr(C)]
pub struct NvmlProcessDetailList {
    pub version: c_uint,
    /// 0 compute, 1 graphics, 2 MPS.
    pub mode: c_uint,
    pub num_proc_array_entries: c_uint,
    pub proc_array: *mut NvmlProcessDetail,
}

/// `nvmlProcessUtilizationInfo_v1_t`.
#[repr(C)]
pub struct NvmlProcessUtilizationInfo {
    pub time_stamp: c_ulonglong,
    pub pid: c_uint,
    pub sm_util: c_uint,
    pub mem_util: c_uint,
    pub enc_util: c_uint,
    pub dec_util: c_uint,
    pub jpg_util: c_uint,
    pub ofa_util: c_uint,
}

/// `nvmlProcessesUtilizationInfo_v1_t`.
#[repr(C)]
pub struct NvmlProcessesUtilizationInfo {
    pub version: c_uint,
    pub process_samples_count: c_uint,
    pub last_seen_time_stamp: c_ulonglong,
    pub proc_util_array: *mut NvmlProcessUtilizationInfo,
}

/// NVML's version word of a versioned struct: its size and version 1.
const fn version_1<T>() -> c_uint {
    std::mem::size_of::<T>() as c_uint | (1 << 24)
}

/// The processes of one kind (`mode`), NVML 12.4's one call for the three lists. Asked with too
/// few entries (or no array), it says how many and `INSUFFICIENT_SIZE`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetRunningProcessDetailList(
    device: *mut c_void,
    list: *mut NvmlProcessDetailList,
) -> NvmlReturn {
    with_device(device, |g, idx| {
        // SAFETY: NULL checked first.
        let Some(list) = (unsafe { list.as_mut() }) else {
            return NVML_ERROR_INVALID_ARGUMENT;
        };
        if list.version != version_1::<NvmlProcessDetailList>() {
            return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
        }
        let kind = match list.mode {
            0 => ProcessKind::Compute,
            1 => ProcessKind::Graphics,
            2 => ProcessKind::Mps,
            _ => return NVML_ERROR_INVALID_ARGUMENT,
        };
        let found = process_list(g, idx, kind);
        let capacity = list.num_proc_array_entries as usize;
        list.num_proc_array_entries = found.len() as c_uint;
        if found.is_empty() {
            return NVML_SUCCESS;
        }
        if list.proc_array.is_null() || capacity < found.len() {
            return NVML_ERROR_INSUFFICIENT_SIZE;
        }
        for (i, &(pid, bytes)) in found.iter().enumerate() {
            // SAFETY: the array holds `capacity` entries.
            unsafe {
                *list.proc_array.add(i) = NvmlProcessDetail {
                    pid,
                    used_gpu_memory: bytes,
                    gpu_instance_id: NO_INSTANCE,
                    compute_instance_id: NO_INSTANCE,
                    used_gpu_cc_protected_memory: 0,
                }
            };
        }
        NVML_SUCCESS
    })
}

/// Per-process utilization, NVML 12.4's form of [`nvmlDeviceGetProcessUtilization`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetProcessesUtilizationInfo(
    device: *mut c_void,
    info: *mut NvmlProcessesUtilizationInfo,
) -> NvmlReturn {
    with_device(device, |g, idx| {
        // SAFETY: NULL checked first.
        let Some(info) = (unsafe { info.as_mut() }) else {
            return NVML_ERROR_INVALID_ARGUMENT;
        };
        if info.version != version_1::<NvmlProcessesUtilizationInfo>() {
            return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
        }
        let now_us = fake_gpu_state::realtime_us();
        let found = process_samples(g, idx, info.last_seen_time_stamp);
        let capacity = info.process_samples_count as usize;
        info.process_samples_count = found.len() as c_uint;
        if found.is_empty() {
            return NVML_ERROR_NOT_FOUND;
        }
        if info.proc_util_array.is_null() || capacity < found.len() {
            return NVML_ERROR_INSUFFICIENT_SIZE;
        }
        for (i, &(pid, util)) in found.iter().enumerate() {
            // SAFETY: the array holds `capacity` entries.
            unsafe {
                *info.proc_util_array.add(i) = NvmlProcessUtilizationInfo {
                    time_stamp: now_us,
                    pid,
                    sm_util: util,
                    mem_util: 0,
                    enc_util: 0,
                    dec_util: 0,
                    jpg_util: 0,
                    ofa_util: 0,
                }
            };
        }
        NVML_SUCCESS
    })
}

/// The PIDs accounting mode recorded: here every compute process of the device (accounting
/// is taken as on).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAccountingPids(
    device: *mut c_void,
    count: *mut c_uint,
    pids: *mut c_uint,
) -> NvmlReturn {
    // SAFETY: entries are written below the caller's capacity only.
    unsafe {
        running_processes(
            device,
            count,
            ProcessKind::Compute,
            pids.is_null(),
            |i, pid, _| {
                *pids.add(i) = pid;
            },
        )
    }
}

/// Per-process SM utilization over the window since `last_seen` (µs, wall clock), at most 1 s.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetProcessUtilization(
    device: *mut c_void,
    samples: *mut NvmlProcessUtilizationSample,
    count: *mut c_uint,
    last_seen_us: c_ulonglong,
) -> NvmlReturn {
    with_device(device, |g, idx| {
        if count.is_null() {
            return NVML_ERROR_INVALID_ARGUMENT;
        }
        let now_us = fake_gpu_state::realtime_us();
        let list = process_samples(g, idx, last_seen_us);
        if list.is_empty() {
            // Real NVML: no sample newer than `last_seen`.
            // SAFETY: checked non-null.
            unsafe { *count = 0 };
            return NVML_ERROR_NOT_FOUND;
        }
        // SAFETY: checked non-null.
        let capacity = unsafe { *count } as usize;
        // SAFETY: checked non-null.
        unsafe { *count = list.len() as c_uint };
        if samples.is_null() || capacity < list.len() {
            return NVML_ERROR_INSUFFICIENT_SIZE;
        }
        for (i, &(pid, util)) in list.iter().enumerate() {
            // SAFETY: `samples` holds `capacity` entries.
            unsafe {
                *samples.add(i) = NvmlProcessUtilizationSample {
                    pid,
                    time_stamp: now_us,
                    sm_util: util,
                    mem_util: 0,
                    enc_util: 0,
                    dec_util: 0,
                };
            }
        }
        NVML_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSupportedEventTypes(
    device: *mut c_void,
    types: *mut c_ulonglong,
) -> NvmlReturn {
    with_device(device, |_, _| {
        if types.is_null() {
            return NVML_ERROR_INVALID_ARGUMENT;
        }
        // SAFETY: checked non-null.
        unsafe { *types = SUPPORTED_EVENTS };
        NVML_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetCreate(set: *mut *mut c_void) -> NvmlReturn {
    with_init(|g| {
        if set.is_null() {
            return NVML_ERROR_INVALID_ARGUMENT;
        }
        g.sets.push(Some(EventSet::default()));
        // Handles are 1-based indices into `sets`, disguised as pointers.
        // SAFETY: checked non-null.
        unsafe { *set = g.sets.len() as *mut c_void };
        NVML_SUCCESS
    })
}

fn set_index(g: &Global, set: *mut c_void) -> Option<usize> {
    let i = (set as usize).checked_sub(1)?;
    g.sets.get(i)?.as_ref()?;
    Some(i)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceRegisterEvents(
    device: *mut c_void,
    types: c_ulonglong,
    set: *mut c_void,
) -> NvmlReturn {
    with_device(device, |g, idx| {
        let Some(si) = set_index(g, set) else {
            return NVML_ERROR_INVALID_ARGUMENT;
        };
        if types & !SUPPORTED_EVENTS != 0 {
            return NVML_ERROR_NOT_SUPPORTED;
        }
        if let Some(es) = g.sets[si].as_mut() {
            es.masks.retain(|&(d, _)| d != idx);
            es.masks.push((idx, types));
        }
        NVML_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait_v2(
    set: *mut c_void,
    data: *mut NvmlEventData,
    timeout_ms: c_uint,
) -> NvmlReturn {
    guard(|| {
        let deadline = Instant::now() + Duration::from_millis(timeout_ms as u64);
        let mut g = global();
        loop {
            let Some(state) = g.as_mut().filter(|s| s.init_count > 0) else {
                return NVML_ERROR_UNINITIALIZED;
            };
            let Some(si) = set_index(state, set) else {
                return NVML_ERROR_INVALID_ARGUMENT;
            };
            if data.is_null() {
                return NVML_ERROR_INVALID_ARGUMENT;
            }
            state.poll_events();
            while let Some(ev) = state.pending.pop_front() {
                let wanted = state.sets[si].as_ref().is_some_and(|es| {
                    es.masks
                        .iter()
                        .any(|&(d, m)| d == ev.device && m & ev.event_type != 0)
                });
                if wanted {
                    // SAFETY: checked non-null.
                    unsafe {
                        *data = NvmlEventData {
                            device: handle_of(ev.device),
                            event_type: ev.event_type,
                            event_data: ev.data,
                            gpu_instance_id: u32::MAX,
                            compute_instance_id: u32::MAX,
                        }
                    };
                    return NVML_SUCCESS;
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return NVML_ERROR_TIMEOUT;
            }
            // Poll the file every 20 ms; lines are appended by another process or thread.
            let step = (deadline - now).min(Duration::from_millis(20));
            g = EVENT_ARRIVED
                .wait_timeout(g, step)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait(
    set: *mut c_void,
    data: *mut NvmlEventData,
    timeout_ms: c_uint,
) -> NvmlReturn {
    // SAFETY: same contract.
    unsafe { nvmlEventSetWait_v2(set, data, timeout_ms) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetFree(set: *mut c_void) -> NvmlReturn {
    guard(|| {
        let mut g = global();
        let Some(state) = g.as_mut() else {
            return NVML_ERROR_UNINITIALIZED;
        };
        match set_index(state, set) {
            Some(i) => {
                state.sets[i] = None;
                NVML_SUCCESS
            }
            None => NVML_ERROR_INVALID_ARGUMENT,
        }
    })
}

/// Helpers for tests that load this fake through its real name.
pub mod locate {
    use std::path::{Path, PathBuf};

    /// The built `libnvidia_ml.so`, found next to the running test executable: the newest of
    /// `target/<profile>/deps/libnvidia_ml.so` (where cargo writes it when `fake-nvml` is a
    /// dependency) and `target/<profile>/libnvidia_ml.so` (when it is built directly).
    pub fn cdylib_path() -> Option<PathBuf> {
        let exe = std::env::current_exe().ok()?;
        let deps = exe.parent()?;
        [
            deps.parent()?.join("libnvidia_ml.so"),
            deps.join("libnvidia_ml.so"),
        ]
        .into_iter()
        .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
        .max_by_key(|(t, _)| *t)
        .map(|(_, p)| p)
    }

    /// Symlinks the fake as `dir/libnvidia-ml.so.1` and returns that path.
    pub fn install_as_soname(dir: &Path) -> std::io::Result<PathBuf> {
        let src = cdylib_path().ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "libnvidia_ml.so not built (cargo build -p fake-nvml)",
            )
        })?;
        let dst = dir.join("libnvidia-ml.so.1");
        let _ = std::fs::remove_file(&dst);
        std::os::unix::fs::symlink(src, &dst)?;
        Ok(dst)
    }
}

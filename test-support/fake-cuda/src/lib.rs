//! A fake `libcuda.so.1` for tests, never shipped: the ~90 driver entry points the shim and its
//! tests use, over a simulated GPU (memory capacity, allocations, kernels that occupy the device
//! for a simulated time), plus `cuGetProcAddress(_v2)` with a versioned symbol table.
//!
//! Configuration (environment, read once at `cuInit`):
//! * `FAKE_CUDA_DEVICES` (default 1, at most 16) and `FAKE_CUDA_MEMORY_MIB` (default 16384);
//! * `FAKE_CUDA_SM_COUNT` (default 40) and `FAKE_CUDA_BLOCK_NS` (default 100000): a kernel of `b`
//!   blocks occupies the device for `ceil(b / SM) × BLOCK_NS` nanoseconds;
//! * `FAKE_CUDA_DRIVER_VERSION` (default 12080);
//! * `FAKE_CUDA_QUEUE_NS` (default 20 ms): a launch blocks while more than this much work is
//!   queued, like a real launch queue that is full;
//! * `FAKE_GPU_STATE`: the state file shared with the fake NVML (see
//!   `test-support/fake-nvml/README.md`);
//! * `FAKE_CUDA_MODULE_BYTES` (default 0): device memory a module or library load takes
//!   (`cuModuleLoad*`, `cuLibraryLoad*`), given back at unload. An image (or, for
//!   `cuModuleLoad` / `cuLibraryLoadFromFile`, a file) that starts with `fake-module:<bytes>`
//!   takes that many bytes instead. `FAKE_CUDA_MODULE_LOAD_MS` (default 0): how long a load
//!   takes (after its memory is taken), so tests can allocate during one.
//!
//! Memory pools: each device has a default pool (`cuDeviceGetMemPool`), `cuMemPoolCreate` makes
//! more. A pool reserves device memory as its allocations need it and keeps freed blocks for
//! reuse; at `cuCtxSynchronize` / `cuStreamSynchronize` it gives back what it holds beyond
//! `max(release threshold, live bytes)` (threshold 0 by default, like the driver), and
//! `cuMemPoolTrimTo` gives back down to its argument. `cuMemPoolGetAttribute` reports the
//! threshold, `RESERVED_MEM_CURRENT/HIGH` and `USED_MEM_CURRENT/HIGH`.
//!
//! Graphs with memory nodes: `cuGraphCreate`, `cuGraphAddMemAllocNode` (the address is assigned
//! when the node is added), `cuGraphAddMemFreeNode`, `cuGraphAddEmptyNode`, the node queries and
//! every `cuGraphInstantiate*`. A launch maps the executable graph's allocations from a per-device
//! graph pool (growing it, OOM when the card is full; relaunching over an unfreed allocation
//! fails) and frees what its free nodes free; an allocation no free node frees stays mapped after
//! the launch and `cuGraphExecDestroy` until `cuMemFreeAsync` / `cuMemFree_v2`. Freed graph
//! memory stays reserved in the pool until `cuDeviceGraphMemTrim`;
//! `cuDeviceGetGraphMemAttribute` reports `USED_MEM_CURRENT` and `RESERVED_MEM_CURRENT`.
//! Stream capture (`cuStreamBeginCapture_v2`, `cuStreamEndCapture`, `cuStreamIsCapturing`):
//! stream-ordered allocations and frees on a captured stream become memory nodes.
//!
//! Launches: `cuLaunch` (1 block), `cuLaunchGrid(Async)`, and
//! `cuLaunchCooperativeKernelMultiDevice`, each entry on the device of its stream
//! (`cuStreamCreate` makes a stream of the current context's device; `cuStreamGetCtx`).
//!
//! `fake_cuda_device_used(dev)` (exported) is what the simulated card holds for this process.
//!
//! Sharing between processes: `cuIpcGetMemHandle` / `cuIpcOpenMemHandle_v2` /
//! `cuIpcCloseMemHandle`, and `cuMemExportToShareableHandle` /
//! `cuMemImportFromShareableHandle` for POSIX file descriptors (a memfd). What another process
//! opens or imports stays the exporter's memory: nothing is charged to the importer.
//!
//! `cuGetProcAddress(_v2)`: `FAKE_CUDA_PROC_INTERNAL=1` returns internal entry points (same
//! behaviour, other addresses than the exported symbols) for a few names, as some drivers do;
//! `FAKE_CUDA_PROC_AGNOSTIC=1` answers every requested version of a name with its newest
//! variant, as a version-agnostic driver or stub does.
//!
//! `fake_cuda_calls(name)` (exported) counts calls per entry point, so tests can check which
//! exact variant (`_v2`, `_ptsz`…) a call reached.

#![allow(non_snake_case, non_camel_case_types, clippy::missing_safety_doc)]

use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

pub type CUresult = c_int;
pub type CUdevice = c_int;
pub type CUdeviceptr = u64;

pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
pub const CUDA_ERROR_NOT_INITIALIZED: CUresult = 3;
pub const CUDA_ERROR_INVALID_DEVICE: CUresult = 101;
pub const CUDA_ERROR_INVALID_CONTEXT: CUresult = 201;
pub const CUDA_ERROR_NOT_FOUND: CUresult = 500;
pub const CUDA_ERROR_NOT_SUPPORTED: CUresult = 801;
pub const CUDA_ERROR_UNKNOWN: CUresult = 999;

const ATTR_MAX_THREADS_PER_BLOCK: c_int = 1;
const ATTR_MULTIPROCESSOR_COUNT: c_int = 16;
const ATTR_MAX_THREADS_PER_MULTIPROCESSOR: c_int = 39;

struct Config {
    devices: usize,
    memory_bytes: u64,
    sm_count: u64,
    block_ns: u64,
    driver_version: c_int,
    queue_ns: u64,
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default)
}

fn config() -> &'static Config {
    static CONFIG: OnceLock<Config> = OnceLock::new();
    CONFIG.get_or_init(|| Config {
        devices: env_u64("FAKE_CUDA_DEVICES", 1).clamp(1, 16) as usize,
        memory_bytes: env_u64("FAKE_CUDA_MEMORY_MIB", 16384).saturating_mul(1 << 20),
        sm_count: env_u64("FAKE_CUDA_SM_COUNT", 40).max(1),
        block_ns: env_u64("FAKE_CUDA_BLOCK_NS", 100_000),
        driver_version: env_u64("FAKE_CUDA_DRIVER_VERSION", 12080) as c_int,
        queue_ns: env_u64("FAKE_CUDA_QUEUE_NS", 20_000_000),
    })
}

fn gpu() -> Option<&'static fake_gpu_state::GpuState> {
    static STATE: OnceLock<Option<&'static fake_gpu_state::GpuState>> = OnceLock::new();
    *STATE.get_or_init(fake_gpu_state::open)
}

static INITIALIZED: AtomicBool = AtomicBool::new(false);

#[derive(Clone, Copy)]
enum Kind {
    Device,
    Managed,
    Async,
}

struct Alloc {
    dev: usize,
    size: u64,
    #[allow(dead_code)]
    kind: Kind,
    /// The memory pool it came from (stream-ordered allocations).
    pool: Option<u64>,
}

/// A memory pool (`CUmemoryPool`).
struct Pool {
    dev: usize,
    reserved: u64,
    used: u64,
    threshold: u64,
    reserved_high: u64,
    used_high: u64,
}

#[derive(Default)]
struct Memory {
    next_addr: u64,
    /// Lowest address for the legacy (CUDA 3.1 ABI) entry points, whose pointers are 32-bit.
    next_low_addr: u64,
    allocs: HashMap<u64, Alloc>,
    /// VMM handles: handle → (device, size).
    handles: HashMap<u64, (usize, u64)>,
    /// Arrays: handle → (device, size).
    arrays: HashMap<u64, (usize, u64)>,
    next_handle: u64,
    /// Per-device bytes allocated by this process (the GPU-wide view is in `fake_gpu_state`).
    local_used: [u64; 16],
    /// Memory pools by handle; `default_pools[dev]` is the device's (0 until first asked for).
    pools: HashMap<u64, Pool>,
    default_pools: [u64; 16],
    /// Loaded modules and libraries: handle → (device, bytes).
    modules: HashMap<u64, (usize, u64)>,
    /// Graphs (`cuGraphCreate`): handle → its nodes, in the order they were added.
    graphs: HashMap<u64, Vec<u64>>,
    /// Graph nodes: handle → (graph, what it does).
    graph_nodes: HashMap<u64, (u64, GraphNode)>,
    /// Executable graphs: handle → the memory nodes of the graph it was made from.
    graph_execs: HashMap<u64, Vec<GraphNode>>,
    /// Graph allocations mapped now: address → (device, bytes).
    graph_live: HashMap<u64, (usize, u64)>,
    /// Per device: (reserved, used) bytes of the graph memory pool. Freed graph memory stays
    /// reserved (cached for later launches) until `cuDeviceGraphMemTrim`.
    graph_pool: [(u64, u64); 16],
    /// IPC mappings opened here (`cuIpcOpenMemHandle_v2`): address → (device, bytes). The memory
    /// is the exporter's allocation, charged once, to the exporter.
    ipc_opened: HashMap<u64, (usize, u64)>,
    /// VMM handles imported here (`cuMemImportFromShareableHandle`): handle → (device, bytes).
    /// They reference the exporter's `cuMemCreate` allocation: nothing is charged here.
    imported: HashMap<u64, (usize, u64)>,
    /// Streams being captured (`cuStreamBeginCapture_v2`): stream → the graph being built.
    capturing: HashMap<u64, u64>,
    /// `cuCtxSetLimit` values per (device, limit): (value, device bytes the driver reserved).
    ctx_limits: HashMap<(usize, c_int), (usize, u64)>,
}

/// A graph node as the fake models it.
#[derive(Clone, Copy)]
enum GraphNode {
    MemAlloc { dev: usize, bytes: u64, dptr: u64 },
    MemFree { dptr: u64 },
    Empty,
}

static MEMORY: Mutex<Option<Memory>> = Mutex::new(None);

fn memory() -> MutexGuard<'static, Option<Memory>> {
    MEMORY.lock().unwrap_or_else(|e| e.into_inner())
}

type ForkGuards = (
    MutexGuard<'static, Option<HashMap<&'static str, u64>>>,
    MutexGuard<'static, Option<Memory>>,
);

thread_local! {
    static FORK_GUARDS: std::cell::RefCell<Option<ForkGuards>> = const { std::cell::RefCell::new(None) };
}

/// Fork safety of the fake itself (so the shim's fork tests test the shim): the forking thread
/// holds the fake's locks across `fork`, and both sides release them.
extern "C" fn fork_prepare() {
    let calls = CALLS.lock().unwrap_or_else(|e| e.into_inner());
    let mem = memory();
    let _ = FORK_GUARDS.try_with(|g| *g.borrow_mut() = Some((calls, mem)));
}

extern "C" fn fork_release() {
    let _ = FORK_GUARDS.try_with(|g| g.borrow_mut().take());
}

extern "C" fn on_load() {
    // SAFETY: registering plain extern "C" handlers.
    unsafe {
        libc::pthread_atfork(Some(fork_prepare), Some(fork_release), Some(fork_release));
    }
}

#[used]
#[unsafe(link_section = ".init_array")]
static ON_LOAD: extern "C" fn() = on_load;

thread_local! {
    /// The current context's device (+1; 0 = no current context).
    static CURRENT: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    static CTX_STACK: std::cell::RefCell<Vec<usize>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Context handles are addresses inside this array.
static CONTEXTS: [u8; 16] = [0; 16];

fn ctx_handle(dev: usize) -> *mut c_void {
    (&CONTEXTS[dev] as *const u8).cast_mut().cast()
}
fn ctx_device(ctx: *mut c_void) -> Option<usize> {
    let i = (ctx as usize).wrapping_sub(CONTEXTS.as_ptr() as usize);
    (i < config().devices).then_some(i)
}

fn current_device() -> Option<usize> {
    CURRENT.with(|c| c.get().checked_sub(1))
}

/// Call counters per entry point name.
static CALLS: Mutex<Option<HashMap<&'static str, u64>>> = Mutex::new(None);
static COUNT_CALLS: OnceLock<bool> = OnceLock::new();

fn count(name: &'static str) {
    // Counting costs a lock; benchmarks turn it off with FAKE_CUDA_COUNT_CALLS=0.
    if !*COUNT_CALLS
        .get_or_init(|| std::env::var("FAKE_CUDA_COUNT_CALLS").map_or(true, |v| v != "0"))
    {
        return;
    }
    let mut calls = CALLS.lock().unwrap_or_else(|e| e.into_inner());
    *calls
        .get_or_insert_with(HashMap::new)
        .entry(name)
        .or_insert(0) += 1;
}

/// Test hook: how many times the entry point `name` was called in this process.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fake_cuda_calls(name: *const c_char) -> u64 {
    if name.is_null() {
        return 0;
    }
    // SAFETY: caller passes a NUL-terminated string.
    let name = unsafe { CStr::from_ptr(name) }.to_string_lossy();
    let calls = CALLS.lock().unwrap_or_else(|e| e.into_inner());
    calls
        .as_ref()
        .and_then(|m| m.get(name.as_ref()).copied())
        .unwrap_or(0)
}

fn guard(f: impl FnOnce() -> CUresult) -> CUresult {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or(CUDA_ERROR_UNKNOWN)
}

fn initialized() -> bool {
    INITIALIZED.load(Ordering::Acquire)
}

macro_rules! require_init {
    () => {
        if !initialized() {
            return CUDA_ERROR_NOT_INITIALIZED;
        }
    };
}

fn valid_device(dev: CUdevice) -> Option<usize> {
    (dev >= 0 && (dev as usize) < config().devices).then_some(dev as usize)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuInit(flags: c_uint) -> CUresult {
    count("cuInit");
    if flags != 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    guard(|| {
        let _ = config();
        INITIALIZED.store(true, Ordering::Release);
        CUDA_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CUresult {
    count("cuDriverGetVersion");
    if version.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: checked non-null.
    unsafe { *version = config().driver_version };
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorString(error: CUresult, out: *mut *const c_char) -> CUresult {
    if out.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let s: &'static [u8] = match error {
        CUDA_SUCCESS => b"no error\0",
        CUDA_ERROR_INVALID_VALUE => b"invalid argument\0",
        CUDA_ERROR_OUT_OF_MEMORY => b"out of memory\0",
        CUDA_ERROR_NOT_INITIALIZED => b"initialization error\0",
        CUDA_ERROR_INVALID_CONTEXT => b"invalid device context\0",
        CUDA_ERROR_NOT_FOUND => b"named symbol not found\0",
        _ => b"unknown error\0",
    };
    // SAFETY: checked non-null.
    unsafe { *out = s.as_ptr().cast() };
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorName(error: CUresult, out: *mut *const c_char) -> CUresult {
    if out.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let s: &'static [u8] = match error {
        CUDA_SUCCESS => b"CUDA_SUCCESS\0",
        CUDA_ERROR_OUT_OF_MEMORY => b"CUDA_ERROR_OUT_OF_MEMORY\0",
        _ => b"CUDA_ERROR_UNKNOWN\0",
    };
    // SAFETY: checked non-null.
    unsafe { *out = s.as_ptr().cast() };
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetCount(n: *mut c_int) -> CUresult {
    count("cuDeviceGetCount");
    require_init!();
    if n.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: checked non-null.
    unsafe { *n = config().devices as c_int };
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGet(dev: *mut CUdevice, ordinal: c_int) -> CUresult {
    count("cuDeviceGet");
    require_init!();
    if dev.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if valid_device(ordinal).is_none() {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    // SAFETY: checked non-null.
    unsafe { *dev = ordinal };
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    count("cuDeviceGetName");
    require_init!();
    if valid_device(dev).is_none() {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    let text = b"Fake CUDA GPU\0";
    if name.is_null() || len < text.len() as c_int {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: the caller's buffer holds `len` bytes.
    unsafe { std::ptr::copy_nonoverlapping(text.as_ptr().cast(), name, text.len()) };
    CUDA_SUCCESS
}

/// The UUIDs of the GPUs the container was given, in device order, as a real driver numbers
/// them: `NVIDIA_VISIBLE_DEVICES` when it lists UUIDs, else the device list mounted under
/// `/var/run/nvidia-container-devices` (`volume-mounts`). Empty: every device keeps the fixed
/// `0c0c…` UUID the tests without a device list expect.
fn visible_uuids() -> &'static [String] {
    static UUIDS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    UUIDS.get_or_init(|| {
        let from_env: Vec<String> = std::env::var("NVIDIA_VISIBLE_DEVICES")
            .unwrap_or_default()
            .split(',')
            .map(str::trim)
            .filter(|u| u.starts_with("GPU-"))
            .map(str::to_owned)
            .collect();
        if !from_env.is_empty() {
            return from_env;
        }
        let mut mounted: Vec<String> = std::fs::read_dir("/var/run/nvidia-container-devices")
            .map(|dir| {
                dir.flatten()
                    .filter_map(|e| e.file_name().into_string().ok())
                    .filter(|n| n.starts_with("GPU-"))
                    .collect()
            })
            .unwrap_or_default();
        mounted.sort();
        mounted
    })
}

/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` as the 16 bytes `cuDeviceGetUuid` returns.
fn uuid_bytes(uuid: &str) -> Option<[u8; 16]> {
    let hex: String = uuid
        .strip_prefix("GPU-")?
        .chars()
        .filter(|c| *c != '-')
        .collect();
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

unsafe fn device_uuid(uuid: *mut u8, dev: CUdevice) -> CUresult {
    require_init!();
    if valid_device(dev).is_none() {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    if uuid.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let bytes = visible_uuids()
        .get(dev as usize)
        .and_then(|u| uuid_bytes(u))
        .unwrap_or_else(|| {
            let mut bytes = [0x0cu8; 16];
            bytes[15] = dev as u8;
            bytes
        });
    // SAFETY: CUuuid is 16 bytes.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), uuid, 16) };
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid(uuid: *mut u8, dev: CUdevice) -> CUresult {
    count("cuDeviceGetUuid");
    // SAFETY: same contract.
    unsafe { device_uuid(uuid, dev) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid: *mut u8, dev: CUdevice) -> CUresult {
    count("cuDeviceGetUuid_v2");
    // SAFETY: same contract.
    unsafe { device_uuid(uuid, dev) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetAttribute(
    value: *mut c_int,
    attrib: c_int,
    dev: CUdevice,
) -> CUresult {
    count("cuDeviceGetAttribute");
    require_init!();
    if value.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if valid_device(dev).is_none() {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    let v = match attrib {
        ATTR_MULTIPROCESSOR_COUNT => config().sm_count as c_int,
        ATTR_MAX_THREADS_PER_MULTIPROCESSOR => 2048,
        ATTR_MAX_THREADS_PER_BLOCK => 1024,
        _ => 0,
    };
    // SAFETY: checked non-null.
    unsafe { *value = v };
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    count("cuDeviceTotalMem_v2");
    require_init!();
    if bytes.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if valid_device(dev).is_none() {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    // SAFETY: checked non-null.
    unsafe { *bytes = config().memory_bytes as usize };
    CUDA_SUCCESS
}

fn make_current(dev: usize) {
    CURRENT.with(|c| c.set(dev + 1));
    // A context makes the process visible on the GPU (nvidia-smi lists it).
    if let Some(state) = gpu() {
        state.devices[dev].add_memory(std::process::id() as u64, 0);
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(
    ctx: *mut *mut c_void,
    dev: CUdevice,
) -> CUresult {
    count("cuDevicePrimaryCtxRetain");
    require_init!();
    let Some(d) = valid_device(dev) else {
        return CUDA_ERROR_INVALID_DEVICE;
    };
    if ctx.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: checked non-null.
    unsafe { *ctx = ctx_handle(d) };
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    count("cuDevicePrimaryCtxRelease_v2");
    require_init!();
    if valid_device(dev).is_none() {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v2(
    ctx: *mut *mut c_void,
    _flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    count("cuCtxCreate_v2");
    require_init!();
    let Some(d) = valid_device(dev) else {
        return CUDA_ERROR_INVALID_DEVICE;
    };
    if ctx.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    make_current(d);
    // SAFETY: checked non-null.
    unsafe { *ctx = ctx_handle(d) };
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxDestroy_v2(ctx: *mut c_void) -> CUresult {
    count("cuCtxDestroy_v2");
    require_init!();
    if ctx_device(ctx).is_none() {
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    CURRENT.with(|c| c.set(0));
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSetCurrent(ctx: *mut c_void) -> CUresult {
    count("cuCtxSetCurrent");
    require_init!();
    if ctx.is_null() {
        CURRENT.with(|c| c.set(0));
        return CUDA_SUCCESS;
    }
    match ctx_device(ctx) {
        Some(d) => {
            make_current(d);
            CUDA_SUCCESS
        }
        None => CUDA_ERROR_INVALID_CONTEXT,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetCurrent(ctx: *mut *mut c_void) -> CUresult {
    count("cuCtxGetCurrent");
    require_init!();
    if ctx.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let c = current_device().map_or(std::ptr::null_mut(), ctx_handle);
    // SAFETY: checked non-null.
    unsafe { *ctx = c };
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetDevice(dev: *mut CUdevice) -> CUresult {
    count("cuCtxGetDevice");
    require_init!();
    if dev.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    match current_device() {
        Some(d) => {
            // SAFETY: checked non-null.
            unsafe { *dev = d as CUdevice };
            CUDA_SUCCESS
        }
        None => CUDA_ERROR_INVALID_CONTEXT,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxPushCurrent_v2(ctx: *mut c_void) -> CUresult {
    count("cuCtxPushCurrent_v2");
    require_init!();
    let Some(d) = ctx_device(ctx) else {
        return CUDA_ERROR_INVALID_CONTEXT;
    };
    CTX_STACK.with(|s| s.borrow_mut().push(CURRENT.with(|c| c.get())));
    make_current(d);
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(ctx: *mut *mut c_void) -> CUresult {
    count("cuCtxPopCurrent_v2");
    require_init!();
    let popped = current_device();
    let prev = CTX_STACK.with(|s| s.borrow_mut().pop()).unwrap_or(0);
    CURRENT.with(|c| c.set(prev));
    if !ctx.is_null() {
        // SAFETY: checked non-null.
        unsafe { *ctx = popped.map_or(std::ptr::null_mut(), ctx_handle) };
    }
    CUDA_SUCCESS
}

fn sync_device(dev: usize) {
    if let Some(state) = gpu() {
        let until = state.devices[dev].busy_until_ns.load(Ordering::Acquire);
        let now = fake_gpu_state::now_ns();
        if until > now {
            std::thread::sleep(std::time::Duration::from_nanos(until - now));
        }
    }
}

/// Resident threads whose stack the fake reserves per byte of `CU_LIMIT_STACK_SIZE` (a real
/// driver reserves the stack size for every thread the GPU can hold: SMs × threads per SM).
pub const FAKE_STACK_THREADS: u64 = 65_536;

/// Device memory a context limit reserves in the fake: the stack for every resident thread,
/// the device `malloc` heap and the printf FIFO at their size; other limits reserve nothing.
fn limit_bytes(limit: c_int, value: usize) -> u64 {
    match limit {
        0 => (value as u64).saturating_mul(FAKE_STACK_THREADS),
        1 | 2 => value as u64,
        _ => 0,
    }
}

/// `cuCtxSetLimit`: the reservation is replaced by the new one, refused with OOM when the card
/// cannot hold it (as a real driver refuses).
#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSetLimit(limit: c_int, value: usize) -> CUresult {
    count("cuCtxSetLimit");
    require_init!();
    let Some(dev) = current_device() else {
        return CUDA_ERROR_INVALID_CONTEXT;
    };
    let new = limit_bytes(limit, value);
    with_memory(|m| {
        let old = m.ctx_limits.get(&(dev, limit)).map_or(0, |&(_, b)| b);
        if new > old {
            if let Err(e) = charge(m, dev, new - old) {
                return e;
            }
        } else {
            uncharge(m, dev, old - new);
        }
        m.ctx_limits.insert((dev, limit), (value, new));
        CUDA_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetLimit(value: *mut usize, limit: c_int) -> CUresult {
    count("cuCtxGetLimit");
    require_init!();
    let Some(dev) = current_device() else {
        return CUDA_ERROR_INVALID_CONTEXT;
    };
    if value.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let v = with_memory(|m| m.ctx_limits.get(&(dev, limit)).map_or(0, |&(v, _)| v));
    // SAFETY: checked non-null.
    unsafe { *value = v };
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSynchronize() -> CUresult {
    count("cuCtxSynchronize");
    require_init!();
    match current_device() {
        Some(d) => {
            sync_device(d);
            release_pools(d);
            CUDA_SUCCESS
        }
        None => CUDA_ERROR_INVALID_CONTEXT,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamSynchronize(_stream: *mut c_void) -> CUresult {
    count("cuStreamSynchronize");
    cuCtxSynchronize()
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamSynchronize_ptsz(_stream: *mut c_void) -> CUresult {
    count("cuStreamSynchronize_ptsz");
    cuCtxSynchronize()
}

// ---------------------------------------------------------------- memory

fn with_memory<R>(f: impl FnOnce(&mut Memory) -> R) -> R {
    let mut m = memory();
    f(m.get_or_insert_with(|| Memory {
        next_addr: 0x7f00_0000_0000,
        next_low_addr: 0x1000_0000,
        next_handle: 1,
        ..Memory::default()
    }))
}

/// The simulated GPU shared with other processes (and the fake NVML), if `FAKE_GPU_STATE` is
/// set; without it memory is tracked per process only.
fn shared_gpu() -> Option<&'static fake_gpu_state::GpuState> {
    static SHARED: OnceLock<bool> = OnceLock::new();
    if *SHARED.get_or_init(|| std::env::var_os("FAKE_GPU_STATE").is_some_and(|p| !p.is_empty())) {
        gpu()
    } else {
        None
    }
}

/// Bytes used on `dev` by every live process (the simulated GPU), or by this one.
fn device_used(m: &Memory, dev: usize) -> u64 {
    match shared_gpu() {
        Some(state) => state.devices[dev].used_bytes(),
        None => m.local_used[dev],
    }
}

fn charge(m: &mut Memory, dev: usize, size: u64) -> Result<(), CUresult> {
    if device_used(m, dev).saturating_add(size) > config().memory_bytes {
        return Err(CUDA_ERROR_OUT_OF_MEMORY);
    }
    m.local_used[dev] += size;
    if let Some(state) = shared_gpu() {
        state.devices[dev].add_memory(std::process::id() as u64, size as i64);
    }
    Ok(())
}

fn uncharge(m: &mut Memory, dev: usize, size: u64) {
    m.local_used[dev] = m.local_used[dev].saturating_sub(size);
    if let Some(state) = shared_gpu() {
        state.devices[dev].add_memory(std::process::id() as u64, -(size as i64));
    }
}

unsafe fn alloc(dptr: *mut CUdeviceptr, size: usize, kind: Kind) -> CUresult {
    // SAFETY: same contract.
    unsafe { alloc_in(dptr, size, kind, false) }
}

/// `low`: a 32-bit address (the legacy entry points); the low 4 GiB of addresses run out like a
/// 32-bit address space would.
unsafe fn alloc_in(dptr: *mut CUdeviceptr, size: usize, kind: Kind, low: bool) -> CUresult {
    require_init!();
    if dptr.is_null() || size == 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let Some(dev) = current_device() else {
        return CUDA_ERROR_INVALID_CONTEXT;
    };
    with_memory(|m| {
        if let Err(e) = charge(m, dev, size as u64) {
            return e;
        }
        let step = (size as u64).div_ceil(512) * 512;
        let addr = if low {
            // First fit below 4 GiB (addresses are reused, as a 32-bit space must).
            let mut used: Vec<(u64, u64)> = m
                .allocs
                .iter()
                .filter(|(a, _)| **a <= u32::MAX as u64)
                .map(|(a, x)| (*a, x.size.div_ceil(512) * 512))
                .collect();
            used.sort_unstable();
            let mut at = m.next_low_addr;
            for (a, len) in used {
                if at.saturating_add(step) <= a {
                    break;
                }
                at = at.max(a + len);
            }
            if at.saturating_add(step) > u32::MAX as u64 {
                uncharge(m, dev, size as u64);
                return CUDA_ERROR_OUT_OF_MEMORY;
            }
            at
        } else {
            m.next_addr += step;
            m.next_addr - step
        };
        m.allocs.insert(
            addr,
            Alloc {
                dev,
                size: size as u64,
                kind,
                pool: None,
            },
        );
        // SAFETY: checked non-null.
        unsafe { *dptr = addr };
        CUDA_SUCCESS
    })
}

fn free(dptr: CUdeviceptr) -> CUresult {
    require_init!();
    if dptr == 0 {
        return CUDA_SUCCESS;
    }
    with_memory(|m| match m.allocs.remove(&dptr) {
        None if m.graph_live.contains_key(&dptr) => {
            graph_free(m, dptr);
            CUDA_SUCCESS
        }
        Some(a) => {
            // A pool keeps a freed block (until a synchronisation or a trim gives it back).
            match a.pool.and_then(|p| m.pools.get_mut(&p)) {
                Some(pool) => pool.used = pool.used.saturating_sub(a.size),
                None => uncharge(m, a.dev, a.size),
            }
            CUDA_SUCCESS
        }
        None => CUDA_ERROR_INVALID_VALUE,
    })
}

// ---------------------------------------------------------------- memory pools

const POOL_ATTR_RELEASE_THRESHOLD: c_int = 4;
const POOL_ATTR_RESERVED_MEM_CURRENT: c_int = 5;
const POOL_ATTR_RESERVED_MEM_HIGH: c_int = 6;
const POOL_ATTR_USED_MEM_CURRENT: c_int = 7;
const POOL_ATTR_USED_MEM_HIGH: c_int = 8;

fn new_pool(m: &mut Memory, dev: usize) -> u64 {
    // Pool handles are opaque pointers to the program: odd values far from anything else.
    let h = 0x5000_0000_0001 + 2 * m.next_handle;
    m.next_handle += 1;
    m.pools.insert(
        h,
        Pool {
            dev,
            reserved: 0,
            used: 0,
            threshold: 0,
            reserved_high: 0,
            used_high: 0,
        },
    );
    h
}

fn default_pool(m: &mut Memory, dev: usize) -> u64 {
    if m.default_pools[dev] == 0 {
        m.default_pools[dev] = new_pool(m, dev);
    }
    m.default_pools[dev]
}

/// Gives back what `pool` reserves beyond `max(keep, used)`.
fn shrink_pool(m: &mut Memory, pool: u64, keep: u64) {
    let Some(p) = m.pools.get_mut(&pool) else {
        return;
    };
    let floor = keep.max(p.used);
    if p.reserved > floor {
        let (dev, extra) = (p.dev, p.reserved - floor);
        p.reserved = floor;
        uncharge(m, dev, extra);
    }
}

/// A synchronisation: every pool on `dev` gives back what it holds beyond its threshold.
fn release_pools(dev: usize) {
    with_memory(|m| {
        let pools: Vec<(u64, u64)> = m
            .pools
            .iter()
            .filter(|(_, p)| p.dev == dev)
            .map(|(h, p)| (*h, p.threshold))
            .collect();
        for (h, threshold) in pools {
            shrink_pool(m, h, threshold);
        }
    });
}

/// A stream-ordered allocation from `pool` (the current device's pool when `None`): served
/// from what the pool holds, the pool growing by what is missing.
unsafe fn pool_alloc(dptr: *mut CUdeviceptr, size: usize, pool: Option<u64>) -> CUresult {
    require_init!();
    if dptr.is_null() || size == 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let Some(cur) = current_device() else {
        return CUDA_ERROR_INVALID_CONTEXT;
    };
    let size = size as u64;
    with_memory(|m| {
        let h = match pool {
            Some(h) => h,
            None => default_pool(m, cur),
        };
        let Some(p) = m.pools.get(&h) else {
            return CUDA_ERROR_INVALID_VALUE;
        };
        let (dev, spare) = (p.dev, p.reserved - p.used);
        if spare < size
            && let Err(e) = charge(m, dev, size - spare)
        {
            return e;
        }
        let p = m.pools.get_mut(&h).expect("pool");
        p.reserved = p.reserved.max(p.used + size);
        p.used += size;
        p.reserved_high = p.reserved_high.max(p.reserved);
        p.used_high = p.used_high.max(p.used);
        let step = size.div_ceil(512) * 512;
        m.next_addr += step;
        let addr = m.next_addr - step;
        m.allocs.insert(
            addr,
            Alloc {
                dev,
                size,
                kind: Kind::Async,
                pool: Some(h),
            },
        );
        // SAFETY: checked non-null.
        unsafe { *dptr = addr };
        CUDA_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetMemPool(pool: *mut u64, dev: CUdevice) -> CUresult {
    count("cuDeviceGetMemPool");
    require_init!();
    let Some(d) = valid_device(dev) else {
        return CUDA_ERROR_INVALID_DEVICE;
    };
    if pool.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let h = with_memory(|m| default_pool(m, d));
    // SAFETY: checked non-null.
    unsafe { *pool = h };
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetDefaultMemPool(pool: *mut u64, dev: CUdevice) -> CUresult {
    count("cuDeviceGetDefaultMemPool");
    // SAFETY: same contract.
    unsafe { cuDeviceGetMemPool(pool, dev) }
}

/// `CUmemPoolProps` up to the location (type at byte 8, id at byte 12).
#[repr(C)]
pub struct CUmemPoolPropsHead {
    pub alloc_type: c_int,
    pub handle_types: c_int,
    pub location_type: c_int,
    pub location_id: c_int,
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolCreate(
    pool: *mut u64,
    props: *const CUmemPoolPropsHead,
) -> CUresult {
    count("cuMemPoolCreate");
    require_init!();
    if pool.is_null() || props.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: checked non-null.
    let props = unsafe { &*props };
    if props.location_type != CU_MEM_LOCATION_TYPE_DEVICE {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let Some(dev) = valid_device(props.location_id) else {
        return CUDA_ERROR_INVALID_DEVICE;
    };
    let h = with_memory(|m| new_pool(m, dev));
    // SAFETY: checked non-null.
    unsafe { *pool = h };
    CUDA_SUCCESS
}

/// The pool goes away; what it holds beyond live allocations is given back at once, live
/// allocations when they are freed.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemPoolDestroy(pool: u64) -> CUresult {
    count("cuMemPoolDestroy");
    require_init!();
    with_memory(|m| {
        let Some(p) = m.pools.remove(&pool) else {
            return CUDA_ERROR_INVALID_VALUE;
        };
        uncharge(m, p.dev, p.reserved - p.used);
        for a in m.allocs.values_mut() {
            if a.pool == Some(pool) {
                a.pool = None;
            }
        }
        m.default_pools.iter_mut().for_each(|d| {
            if *d == pool {
                *d = 0;
            }
        });
        CUDA_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemPoolTrimTo(pool: u64, min_bytes_to_keep: usize) -> CUresult {
    count("cuMemPoolTrimTo");
    require_init!();
    with_memory(|m| {
        if !m.pools.contains_key(&pool) {
            return CUDA_ERROR_INVALID_VALUE;
        }
        shrink_pool(m, pool, min_bytes_to_keep as u64);
        CUDA_SUCCESS
    })
}

/// Test hook: the pool gives back what it keeps, as a synchronisation the shim does not see
/// would (the shim's charge is then stale until it next asks the driver).
#[unsafe(no_mangle)]
pub extern "C" fn fake_cuda_pool_release(pool: u64) -> CUresult {
    require_init!();
    with_memory(|m| shrink_pool(m, pool, 0));
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolGetAttribute(
    pool: u64,
    attr: c_int,
    value: *mut c_void,
) -> CUresult {
    count("cuMemPoolGetAttribute");
    require_init!();
    if value.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    with_memory(|m| {
        let Some(p) = m.pools.get(&pool) else {
            return CUDA_ERROR_INVALID_VALUE;
        };
        let v = match attr {
            POOL_ATTR_RELEASE_THRESHOLD => p.threshold,
            POOL_ATTR_RESERVED_MEM_CURRENT => p.reserved,
            POOL_ATTR_RESERVED_MEM_HIGH => p.reserved_high,
            POOL_ATTR_USED_MEM_CURRENT => p.used,
            POOL_ATTR_USED_MEM_HIGH => p.used_high,
            1..=3 => {
                // The reuse policies: int, all enabled.
                // SAFETY: checked non-null; these attributes are `int`.
                unsafe { *value.cast::<c_int>() = 1 };
                return CUDA_SUCCESS;
            }
            _ => return CUDA_ERROR_INVALID_VALUE,
        };
        // SAFETY: checked non-null; these attributes are `cuuint64_t`.
        unsafe { *value.cast::<u64>() = v };
        CUDA_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolSetAttribute(
    pool: u64,
    attr: c_int,
    value: *mut c_void,
) -> CUresult {
    count("cuMemPoolSetAttribute");
    require_init!();
    if value.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    with_memory(|m| {
        let Some(p) = m.pools.get_mut(&pool) else {
            return CUDA_ERROR_INVALID_VALUE;
        };
        match attr {
            // SAFETY: checked non-null; `cuuint64_t`.
            POOL_ATTR_RELEASE_THRESHOLD => p.threshold = unsafe { *value.cast::<u64>() },
            POOL_ATTR_RESERVED_MEM_HIGH => p.reserved_high = p.reserved,
            POOL_ATTR_USED_MEM_HIGH => p.used_high = p.used,
            1..=3 => {}
            _ => return CUDA_ERROR_INVALID_VALUE,
        }
        CUDA_SUCCESS
    })
}

// ---------------------------------------------------------------- modules

const CUDA_ERROR_FILE_NOT_FOUND: CUresult = 301;

/// Device bytes a module image takes: `fake-module:<bytes>` at its start, else the
/// `FAKE_CUDA_MODULE_BYTES` default.
fn module_bytes(head: &[u8]) -> u64 {
    if let Some(rest) = head.strip_prefix(b"fake-module:") {
        let digits: Vec<u8> = rest
            .iter()
            .copied()
            .take_while(u8::is_ascii_digit)
            .collect();
        if let Some(n) = std::str::from_utf8(&digits)
            .ok()
            .and_then(|d| d.parse().ok())
        {
            return n;
        }
    }
    env_u64("FAKE_CUDA_MODULE_BYTES", 0)
}

/// The first bytes of an in-memory image (up to a NUL or 64 bytes).
unsafe fn image_head(image: *const c_void) -> Vec<u8> {
    let mut head = Vec::new();
    let p = image.cast::<u8>();
    for i in 0..64 {
        // SAFETY: the caller's image is at least this long or NUL-terminated before.
        let b = unsafe { *p.add(i) };
        if b == 0 {
            break;
        }
        head.push(b);
    }
    head
}

unsafe fn file_head(path: *const c_char) -> Option<Vec<u8>> {
    if path.is_null() {
        return None;
    }
    // SAFETY: the caller passes a NUL-terminated path.
    let path = unsafe { CStr::from_ptr(path) }.to_str().ok()?;
    let mut bytes = std::fs::read(path).ok()?;
    bytes.truncate(64);
    Some(bytes)
}

/// Loads a module of `bytes` into the current context: its memory is taken from the device.
unsafe fn load_module(out: *mut u64, head: Option<Vec<u8>>) -> CUresult {
    require_init!();
    if out.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let Some(head) = head else {
        return CUDA_ERROR_FILE_NOT_FOUND;
    };
    let Some(dev) = current_device() else {
        return CUDA_ERROR_INVALID_CONTEXT;
    };
    let bytes = module_bytes(&head);
    let r = with_memory(|m| {
        if let Err(e) = charge(m, dev, bytes) {
            return e;
        }
        let h = 0x6000_0000_0001 + 2 * m.next_handle;
        m.next_handle += 1;
        m.modules.insert(h, (dev, bytes));
        // SAFETY: checked non-null.
        unsafe { *out = h };
        CUDA_SUCCESS
    });
    let ms = env_u64("FAKE_CUDA_MODULE_LOAD_MS", 0);
    if r == CUDA_SUCCESS && ms > 0 {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
    r
}

fn unload_module(h: u64) -> CUresult {
    require_init!();
    with_memory(|m| match m.modules.remove(&h) {
        Some((dev, bytes)) => {
            uncharge(m, dev, bytes);
            CUDA_SUCCESS
        }
        None => CUDA_ERROR_INVALID_VALUE,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoad(module: *mut u64, fname: *const c_char) -> CUresult {
    count("cuModuleLoad");
    // SAFETY: same contract.
    unsafe { load_module(module, file_head(fname)) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoadData(module: *mut u64, image: *const c_void) -> CUresult {
    count("cuModuleLoadData");
    if image.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: same contract.
    unsafe { load_module(module, Some(image_head(image))) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoadDataEx(
    module: *mut u64,
    image: *const c_void,
    _num_options: c_uint,
    _options: *mut c_int,
    _values: *mut *mut c_void,
) -> CUresult {
    count("cuModuleLoadDataEx");
    if image.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: same contract.
    unsafe { load_module(module, Some(image_head(image))) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoadFatBinary(module: *mut u64, image: *const c_void) -> CUresult {
    count("cuModuleLoadFatBinary");
    if image.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: same contract.
    unsafe { load_module(module, Some(image_head(image))) }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuModuleUnload(module: u64) -> CUresult {
    count("cuModuleUnload");
    unload_module(module)
}

#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cuLibraryLoadData(
    library: *mut u64,
    code: *const c_void,
    _jit_options: *mut c_int,
    _jit_values: *mut *mut c_void,
    _num_jit: c_uint,
    _lib_options: *mut c_int,
    _lib_values: *mut *mut c_void,
    _num_lib: c_uint,
) -> CUresult {
    count("cuLibraryLoadData");
    if code.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: same contract.
    unsafe { load_module(library, Some(image_head(code))) }
}

#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cuLibraryLoadFromFile(
    library: *mut u64,
    file_name: *const c_char,
    _jit_options: *mut c_int,
    _jit_values: *mut *mut c_void,
    _num_jit: c_uint,
    _lib_options: *mut c_int,
    _lib_values: *mut *mut c_void,
    _num_lib: c_uint,
) -> CUresult {
    count("cuLibraryLoadFromFile");
    // SAFETY: same contract.
    unsafe { load_module(library, file_head(file_name)) }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuLibraryUnload(library: u64) -> CUresult {
    count("cuLibraryUnload");
    unload_module(library)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, size: usize) -> CUresult {
    count("cuMemAlloc_v2");
    // SAFETY: same contract.
    unsafe { alloc(dptr, size, Kind::Device) }
}

/// The CUDA 3.1 ABI (32-bit size); what `cuGetProcAddress("cuMemAlloc", …, 3010)` returns.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc(dptr: *mut c_uint, size: c_uint) -> CUresult {
    count("cuMemAlloc");
    if dptr.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let mut wide: CUdeviceptr = 0;
    // SAFETY: local out-pointer.
    let r = unsafe { alloc_in(&mut wide, size as usize, Kind::Device, true) };
    if r == CUDA_SUCCESS {
        // SAFETY: checked non-null.
        unsafe { *dptr = wide as c_uint };
    }
    r
}

/// The CUDA 3.1 ABI of `cuMemAllocPitch` (32-bit pointer, pitch and sizes).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocPitch(
    dptr: *mut c_uint,
    pitch: *mut c_uint,
    width: c_uint,
    height: c_uint,
    element_size: c_uint,
) -> CUresult {
    count("cuMemAllocPitch");
    if dptr.is_null() || pitch.is_null() || !matches!(element_size, 4 | 8 | 16) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let p = (width as usize).div_ceil(512).saturating_mul(512);
    let mut wide: CUdeviceptr = 0;
    // SAFETY: local out-pointer.
    let r = unsafe {
        alloc_in(
            &mut wide,
            p.saturating_mul(height as usize),
            Kind::Device,
            true,
        )
    };
    if r == CUDA_SUCCESS {
        // SAFETY: checked non-null.
        unsafe {
            *dptr = wide as c_uint;
            *pitch = p as c_uint;
        }
    }
    r
}

/// The CUDA 3.1 ABI of `cuMemFree` (32-bit pointer).
#[unsafe(no_mangle)]
pub extern "C" fn cuMemFree(dptr: c_uint) -> CUresult {
    count("cuMemFree");
    free(dptr as CUdeviceptr)
}

/// The CUDA 3.1 ABI of `cuMemGetInfo` (32-bit sizes, saturated).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo(free_bytes: *mut c_uint, total: *mut c_uint) -> CUresult {
    count("cuMemGetInfo");
    let (mut f, mut t) = (0usize, 0usize);
    // SAFETY: local out-pointers.
    let r = unsafe { cuMemGetInfo_v2(&mut f, &mut t) };
    if r == CUDA_SUCCESS {
        if free_bytes.is_null() || total.is_null() {
            return CUDA_ERROR_INVALID_VALUE;
        }
        // SAFETY: checked non-null.
        unsafe {
            *free_bytes = f.min(u32::MAX as usize) as c_uint;
            *total = t.min(u32::MAX as usize) as c_uint;
        }
    }
    r
}

/// The CUDA 3.1 ABI of `cuDeviceTotalMem` (32-bit size, saturated).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem(bytes: *mut c_uint, dev: CUdevice) -> CUresult {
    count("cuDeviceTotalMem");
    if bytes.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let mut b = 0usize;
    // SAFETY: local out-pointer.
    let r = unsafe { cuDeviceTotalMem_v2(&mut b, dev) };
    if r == CUDA_SUCCESS {
        // SAFETY: checked non-null.
        unsafe { *bytes = b.min(u32::MAX as usize) as c_uint };
    }
    r
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocManaged(
    dptr: *mut CUdeviceptr,
    size: usize,
    _flags: c_uint,
) -> CUresult {
    count("cuMemAllocManaged");
    // SAFETY: same contract.
    unsafe { alloc(dptr, size, Kind::Managed) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    dptr: *mut CUdeviceptr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    element_size: c_uint,
) -> CUresult {
    count("cuMemAllocPitch_v2");
    if pitch.is_null() || !matches!(element_size, 4 | 8 | 16) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // The real driver rounds rows up to its texture alignment; 512 bytes here.
    let p = width.div_ceil(512).saturating_mul(512);
    // SAFETY: same contract.
    let r = unsafe { alloc(dptr, p.saturating_mul(height), Kind::Device) };
    if r == CUDA_SUCCESS {
        // SAFETY: checked non-null.
        unsafe { *pitch = p };
    }
    r
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    count("cuMemFree_v2");
    free(dptr)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocAsync(
    dptr: *mut CUdeviceptr,
    size: usize,
    stream: *mut c_void,
) -> CUresult {
    count("cuMemAllocAsync");
    if let Some(r) = captured_alloc(dptr, size, stream) {
        return r;
    }
    // SAFETY: same contract.
    unsafe { pool_alloc(dptr, size, None) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocAsync_ptsz(
    dptr: *mut CUdeviceptr,
    size: usize,
    stream: *mut c_void,
) -> CUresult {
    count("cuMemAllocAsync_ptsz");
    if let Some(r) = captured_alloc(dptr, size, stream) {
        return r;
    }
    // SAFETY: same contract.
    unsafe { pool_alloc(dptr, size, None) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync(
    dptr: *mut CUdeviceptr,
    size: usize,
    pool: *mut c_void,
    stream: *mut c_void,
) -> CUresult {
    count("cuMemAllocFromPoolAsync");
    if let Some(r) = captured_alloc(dptr, size, stream) {
        return r;
    }
    // A NULL pool is the current device's (lenient: the driver refuses it).
    // SAFETY: same contract.
    unsafe { pool_alloc(dptr, size, (!pool.is_null()).then_some(pool as u64)) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync_ptsz(
    dptr: *mut CUdeviceptr,
    size: usize,
    pool: *mut c_void,
    stream: *mut c_void,
) -> CUresult {
    count("cuMemAllocFromPoolAsync_ptsz");
    if let Some(r) = captured_alloc(dptr, size, stream) {
        return r;
    }
    // A NULL pool is the current device's (lenient: the driver refuses it).
    // SAFETY: same contract.
    unsafe { pool_alloc(dptr, size, (!pool.is_null()).then_some(pool as u64)) }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemFreeAsync(dptr: CUdeviceptr, stream: *mut c_void) -> CUresult {
    count("cuMemFreeAsync");
    if let Some(r) = captured_free(dptr, stream) {
        return r;
    }
    free(dptr)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemFreeAsync_ptsz(dptr: CUdeviceptr, stream: *mut c_void) -> CUresult {
    count("cuMemFreeAsync_ptsz");
    if let Some(r) = captured_free(dptr, stream) {
        return r;
    }
    free(dptr)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free_bytes: *mut usize, total: *mut usize) -> CUresult {
    count("cuMemGetInfo_v2");
    require_init!();
    if free_bytes.is_null() || total.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let Some(dev) = current_device() else {
        return CUDA_ERROR_INVALID_CONTEXT;
    };
    let used = with_memory(|m| device_used(m, dev));
    let cap = config().memory_bytes;
    // SAFETY: checked non-null.
    unsafe {
        *total = cap as usize;
        *free_bytes = cap.saturating_sub(used) as usize;
    }
    CUDA_SUCCESS
}

/// `CUmemAllocationProp`: type, handle types, location {type, id}, …
#[repr(C)]
pub struct CUmemAllocationProp {
    pub kind: c_int,
    pub requested_handle_types: c_int,
    pub location_type: c_int,
    pub location_id: c_int,
    pub win32_handle_meta_data: *mut c_void,
    pub alloc_flags: [u8; 8],
}
const CU_MEM_LOCATION_TYPE_DEVICE: c_int = 1;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut u64,
    size: usize,
    prop: *const CUmemAllocationProp,
    _flags: u64,
) -> CUresult {
    count("cuMemCreate");
    require_init!();
    if handle.is_null() || prop.is_null() || size == 0 || !size.is_multiple_of(2 << 20) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: checked non-null.
    let prop = unsafe { &*prop };
    if prop.location_type != CU_MEM_LOCATION_TYPE_DEVICE {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let Some(dev) = valid_device(prop.location_id) else {
        return CUDA_ERROR_INVALID_DEVICE;
    };
    with_memory(|m| {
        if let Err(e) = charge(m, dev, size as u64) {
            return e;
        }
        let h = m.next_handle;
        m.next_handle += 1;
        m.handles.insert(h, (dev, size as u64));
        // SAFETY: checked non-null.
        unsafe { *handle = h };
        CUDA_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemRelease(handle: u64) -> CUresult {
    count("cuMemRelease");
    require_init!();
    with_memory(|m| match m.handles.remove(&handle) {
        Some((dev, size)) => {
            uncharge(m, dev, size);
            CUDA_SUCCESS
        }
        // An imported handle's memory is the exporter's: releasing it gives nothing back here.
        None if m.imported.remove(&handle).is_some() => CUDA_SUCCESS,
        None => CUDA_ERROR_INVALID_VALUE,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetAllocationGranularity(
    granularity: *mut usize,
    _prop: *const CUmemAllocationProp,
    _option: c_int,
) -> CUresult {
    count("cuMemGetAllocationGranularity");
    if granularity.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: checked non-null.
    unsafe { *granularity = 2 << 20 };
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAddressReserve(
    ptr: *mut CUdeviceptr,
    size: usize,
    _align: usize,
    _addr: CUdeviceptr,
    _flags: u64,
) -> CUresult {
    count("cuMemAddressReserve");
    require_init!();
    if ptr.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let addr = with_memory(|m| {
        let a = m.next_addr;
        m.next_addr += (size as u64).div_ceil(512) * 512;
        a
    });
    // SAFETY: checked non-null.
    unsafe { *ptr = addr };
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemAddressFree(_ptr: CUdeviceptr, _size: usize) -> CUresult {
    count("cuMemAddressFree");
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemMap(
    _ptr: CUdeviceptr,
    _size: usize,
    _offset: usize,
    handle: u64,
    _flags: u64,
) -> CUresult {
    count("cuMemMap");
    require_init!();
    with_memory(|m| {
        if m.handles.contains_key(&handle) || m.imported.contains_key(&handle) {
            CUDA_SUCCESS
        } else {
            CUDA_ERROR_INVALID_VALUE
        }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemUnmap(_ptr: CUdeviceptr, _size: usize) -> CUresult {
    count("cuMemUnmap");
    CUDA_SUCCESS
}

/// `cuMemSetAccess`: every mapping is accessible in the fake.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemSetAccess(
    _ptr: CUdeviceptr,
    _size: usize,
    desc: *const c_void,
    n: usize,
) -> CUresult {
    count("cuMemSetAccess");
    require_init!();
    if desc.is_null() || n == 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    CUDA_SUCCESS
}

// ---------------------------------------------------------------- inter-process sharing
//
// Both kinds of handle carry the exporter's allocation as a record `[magic, pid, key, device,
// bytes]` (five u64). The importer charges nothing: the memory is the exporter's allocation,
// counted once, on the exporter's side (and in the shared simulated GPU under the exporter's
// pid); closing or releasing the imported mapping gives nothing back. The exporter is not told
// of imports (a real driver keeps the memory until the last importer lets go even after the
// exporter frees it; the fake frees it with the exporter).

const IPC_MAGIC: u64 = 0x3143_5049_4b41_4646; // "FFAKIPC1"
const VMM_MAGIC: u64 = 0x314d_4d56_4b41_4646; // "FFAKVMM1"
/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`.
const HANDLE_TYPE_POSIX_FD: c_int = 1;
/// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`, the one flag `cuIpcOpenMemHandle` takes.
const IPC_LAZY_ENABLE_PEER_ACCESS: c_uint = 1;

/// `CUipcMemHandle`: 64 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUipcMemHandle {
    pub reserved: [u8; 64],
}

fn share_record(magic: u64, key: u64, dev: usize, bytes: u64) -> [u8; 40] {
    let mut r = [0u8; 40];
    for (i, v) in [magic, std::process::id() as u64, key, dev as u64, bytes]
        .into_iter()
        .enumerate()
    {
        r[i * 8..i * 8 + 8].copy_from_slice(&v.to_ne_bytes());
    }
    r
}

/// `(pid, key, device, bytes)` of a record with `magic`, if the device exists and the exporter
/// is alive.
fn read_share_record(magic: u64, r: &[u8]) -> Option<(u64, u64, usize, u64)> {
    let field = |i: usize| u64::from_ne_bytes(r[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
    if r.len() < 40 || field(0) != magic {
        return None;
    }
    let (pid, key, dev, bytes) = (field(1), field(2), field(3) as usize, field(4));
    (dev < config().devices && bytes > 0 && fake_gpu_state::pid_alive(pid))
        .then_some((pid, key, dev, bytes))
}

/// `cuIpcGetMemHandle`: a handle for an allocation of `cuMemAlloc*` (its base address).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuIpcGetMemHandle(
    handle: *mut CUipcMemHandle,
    dptr: CUdeviceptr,
) -> CUresult {
    count("cuIpcGetMemHandle");
    require_init!();
    if handle.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let Some((dev, size)) = with_memory(|m| {
        m.allocs
            .get(&dptr)
            .filter(|a| a.pool.is_none())
            .map(|a| (a.dev, a.size))
    }) else {
        return CUDA_ERROR_INVALID_VALUE;
    };
    let mut h = CUipcMemHandle { reserved: [0; 64] };
    h.reserved[..40].copy_from_slice(&share_record(IPC_MAGIC, dptr, dev, size));
    // SAFETY: checked non-null.
    unsafe { *handle = h };
    CUDA_SUCCESS
}

/// `cuIpcOpenMemHandle_v2`: maps another process's allocation at a new address of this one.
/// Opening a handle of this process fails, as with the driver.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuIpcOpenMemHandle_v2(
    dptr: *mut CUdeviceptr,
    handle: CUipcMemHandle,
    flags: c_uint,
) -> CUresult {
    count("cuIpcOpenMemHandle_v2");
    require_init!();
    if dptr.is_null() || flags & !IPC_LAZY_ENABLE_PEER_ACCESS != 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if current_device().is_none() {
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    let Some((pid, _, dev, bytes)) = read_share_record(IPC_MAGIC, &handle.reserved) else {
        return CUDA_ERROR_INVALID_VALUE;
    };
    if pid == std::process::id() as u64 {
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    let addr = with_memory(|m| {
        let step = bytes.div_ceil(512) * 512;
        m.next_addr += step;
        let addr = m.next_addr - step;
        m.ipc_opened.insert(addr, (dev, bytes));
        addr
    });
    // SAFETY: checked non-null.
    unsafe { *dptr = addr };
    CUDA_SUCCESS
}

/// `cuIpcCloseMemHandle`: unmaps an opened allocation (the exporter still holds it).
#[unsafe(no_mangle)]
pub extern "C" fn cuIpcCloseMemHandle(dptr: CUdeviceptr) -> CUresult {
    count("cuIpcCloseMemHandle");
    require_init!();
    with_memory(|m| match m.ipc_opened.remove(&dptr) {
        Some(_) => CUDA_SUCCESS,
        None => CUDA_ERROR_INVALID_VALUE,
    })
}

/// `cuMemExportToShareableHandle` for `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`: a new file
/// descriptor (a memfd holding the record), written as an `int` at `shareable`. Other handle
/// types are not supported by the fake.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemExportToShareableHandle(
    shareable: *mut c_void,
    handle: u64,
    handle_type: c_int,
    flags: u64,
) -> CUresult {
    count("cuMemExportToShareableHandle");
    require_init!();
    if shareable.is_null() || flags != 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if handle_type != HANDLE_TYPE_POSIX_FD {
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    let record = match with_memory(|m| {
        m.handles
            .get(&handle)
            .or_else(|| m.imported.get(&handle))
            .copied()
    }) {
        Some((dev, size)) => share_record(VMM_MAGIC, handle, dev, size),
        None => return CUDA_ERROR_INVALID_VALUE,
    };
    // SAFETY: a plain memfd, written whole, handed to the caller (who closes it).
    let fd = unsafe { libc::memfd_create(c"fake-cuda-vmm".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return CUDA_ERROR_UNKNOWN;
    }
    // SAFETY: `record` is 40 readable bytes.
    let n = unsafe { libc::pwrite(fd, record.as_ptr().cast(), record.len(), 0) };
    if n != record.len() as isize {
        // SAFETY: our own fd.
        unsafe { libc::close(fd) };
        return CUDA_ERROR_UNKNOWN;
    }
    // SAFETY: checked non-null; the caller passes room for an `int`.
    unsafe { *shareable.cast::<c_int>() = fd };
    CUDA_SUCCESS
}

/// `cuMemImportFromShareableHandle` for a file descriptor (passed as the pointer's value): a
/// handle of this process that maps (`cuMemMap`) the exporter's memory; nothing is charged.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemImportFromShareableHandle(
    handle: *mut u64,
    os_handle: *mut c_void,
    handle_type: c_int,
) -> CUresult {
    count("cuMemImportFromShareableHandle");
    require_init!();
    if handle.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if handle_type != HANDLE_TYPE_POSIX_FD {
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    let fd = os_handle as usize as c_int;
    let mut record = [0u8; 40];
    // SAFETY: reads at most 40 bytes into `record`; a bad fd fails.
    let n = unsafe { libc::pread(fd, record.as_mut_ptr().cast(), record.len(), 0) };
    if n != record.len() as isize {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let Some((_, _, dev, bytes)) = read_share_record(VMM_MAGIC, &record) else {
        return CUDA_ERROR_INVALID_VALUE;
    };
    let h = with_memory(|m| {
        let h = m.next_handle;
        m.next_handle += 1;
        m.imported.insert(h, (dev, bytes));
        h
    });
    // SAFETY: checked non-null.
    unsafe { *handle = h };
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostAlloc(
    pp: *mut *mut c_void,
    size: usize,
    _flags: c_uint,
) -> CUresult {
    count("cuMemHostAlloc");
    require_init!();
    if pp.is_null() || size == 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: plain malloc; freed by cuMemFreeHost.
    let p = unsafe { libc::malloc(size) };
    if p.is_null() {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    // SAFETY: checked non-null.
    unsafe { *pp = p };
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFreeHost(p: *mut c_void) -> CUresult {
    count("cuMemFreeHost");
    // SAFETY: `p` came from cuMemHostAlloc.
    unsafe { libc::free(p) };
    CUDA_SUCCESS
}

/// Pins host memory for the device: the fake only records the range (device memory is not
/// touched, as on a real card).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostRegister_v2(
    p: *mut c_void,
    size: usize,
    _flags: c_uint,
) -> CUresult {
    count("cuMemHostRegister_v2");
    require_init!();
    if p.is_null() || size == 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostUnregister(p: *mut c_void) -> CUresult {
    count("cuMemHostUnregister");
    if p.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    CUDA_SUCCESS
}

/// Under unified addressing a mapped host allocation's device pointer is its host pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostGetDevicePointer_v2(
    dptr: *mut u64,
    p: *mut c_void,
    flags: c_uint,
) -> CUresult {
    count("cuMemHostGetDevicePointer_v2");
    require_init!();
    if dptr.is_null() || p.is_null() || flags != 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: checked non-null.
    unsafe { *dptr = p as u64 };
    CUDA_SUCCESS
}

/// `CUDA_ARRAY_DESCRIPTOR`.
#[repr(C)]
pub struct ArrayDescriptor {
    pub width: usize,
    pub height: usize,
    pub format: c_int,
    pub num_channels: c_uint,
}

/// `CUDA_ARRAY3D_DESCRIPTOR`.
#[repr(C)]
pub struct Array3dDescriptor {
    pub width: usize,
    pub height: usize,
    pub depth: usize,
    pub format: c_int,
    pub num_channels: c_uint,
    pub flags: c_uint,
}

pub fn format_bytes(format: c_int) -> Option<u64> {
    Some(match format {
        0x01 | 0x08 => 1,
        0x02 | 0x09 | 0x10 => 2,
        0x03 | 0x0a | 0x20 => 4,
        _ => return None,
    })
}

/// Creates an array (or a mipmapped array of `levels` levels, each present dimension halved per
/// level and never below 1) and charges its bytes to the current device.
fn create_array(
    arr: *mut u64,
    w: usize,
    h: usize,
    d: usize,
    format: c_int,
    channels: c_uint,
    levels: c_uint,
) -> CUresult {
    require_init!();
    let Some(elem) = format_bytes(format) else {
        return CUDA_ERROR_INVALID_VALUE;
    };
    if arr.is_null() || w == 0 || !matches!(channels, 1 | 2 | 4) || !(1..=32).contains(&levels) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let Some(dev) = current_device() else {
        return CUDA_ERROR_INVALID_CONTEXT;
    };
    let size = (0..levels)
        .map(|level| {
            let at_level = |x: usize| {
                if x == 0 {
                    1
                } else {
                    (x >> level).max(1) as u64
                }
            };
            at_level(w)
                .saturating_mul(at_level(h))
                .saturating_mul(at_level(d))
                .saturating_mul(elem * channels as u64)
        })
        .fold(0, u64::saturating_add);
    with_memory(|m| {
        if let Err(e) = charge(m, dev, size) {
            return e;
        }
        let h = m.next_handle;
        m.next_handle += 1;
        m.arrays.insert(h, (dev, size));
        // SAFETY: checked non-null.
        unsafe { *arr = h };
        CUDA_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayCreate_v2(arr: *mut u64, desc: *const ArrayDescriptor) -> CUresult {
    count("cuArrayCreate_v2");
    if desc.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: checked non-null.
    let d = unsafe { &*desc };
    create_array(arr, d.width, d.height, 1, d.format, d.num_channels, 1)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArray3DCreate_v2(
    arr: *mut u64,
    desc: *const Array3dDescriptor,
) -> CUresult {
    count("cuArray3DCreate_v2");
    if desc.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: checked non-null.
    let d = unsafe { &*desc };
    create_array(arr, d.width, d.height, d.depth, d.format, d.num_channels, 1)
}

/// `CUDA_ARRAY_DESCRIPTOR_v1` (32-bit sizes).
#[repr(C)]
pub struct ArrayDescriptorV1 {
    pub width: c_uint,
    pub height: c_uint,
    pub format: c_int,
    pub num_channels: c_uint,
}

/// `CUDA_ARRAY3D_DESCRIPTOR_v1` (32-bit sizes).
#[repr(C)]
pub struct Array3dDescriptorV1 {
    pub width: c_uint,
    pub height: c_uint,
    pub depth: c_uint,
    pub format: c_int,
    pub num_channels: c_uint,
    pub flags: c_uint,
}

/// The CUDA 3.1 ABI of `cuArrayCreate`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayCreate(arr: *mut u64, desc: *const ArrayDescriptorV1) -> CUresult {
    count("cuArrayCreate");
    if desc.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: checked non-null.
    let d = unsafe { &*desc };
    create_array(
        arr,
        d.width as usize,
        d.height as usize,
        1,
        d.format,
        d.num_channels,
        1,
    )
}

/// The CUDA 3.1 ABI of `cuArray3DCreate`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArray3DCreate(
    arr: *mut u64,
    desc: *const Array3dDescriptorV1,
) -> CUresult {
    count("cuArray3DCreate");
    if desc.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: checked non-null.
    let d = unsafe { &*desc };
    create_array(
        arr,
        d.width as usize,
        d.height as usize,
        d.depth as usize,
        d.format,
        d.num_channels,
        1,
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMipmappedArrayCreate(
    handle: *mut u64,
    desc: *const Array3dDescriptor,
    levels: c_uint,
) -> CUresult {
    count("cuMipmappedArrayCreate");
    if desc.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: checked non-null.
    let d = unsafe { &*desc };
    create_array(
        handle,
        d.width,
        d.height,
        d.depth,
        d.format,
        d.num_channels,
        levels,
    )
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMipmappedArrayDestroy(handle: u64) -> CUresult {
    count("cuMipmappedArrayDestroy");
    cuArrayDestroy(handle)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuArrayDestroy(arr: u64) -> CUresult {
    count("cuArrayDestroy");
    require_init!();
    with_memory(|m| match m.arrays.remove(&arr) {
        Some((dev, size)) => {
            uncharge(m, dev, size);
            CUDA_SUCCESS
        }
        None => CUDA_ERROR_INVALID_VALUE,
    })
}

// ---------------------------------------------------------------- launches

/// Queues a kernel of `blocks` blocks on the current device's simulated timeline.
fn launch(blocks: u64) -> CUresult {
    require_init!();
    let Some(dev) = current_device() else {
        return CUDA_ERROR_INVALID_CONTEXT;
    };
    launch_on(dev, blocks)
}

/// Queues a kernel of `blocks` blocks on `dev`'s simulated timeline.
fn launch_on(dev: usize, blocks: u64) -> CUresult {
    let cfg = config();
    let waves = blocks.div_ceil(cfg.sm_count).max(1);
    let duration = waves.saturating_mul(cfg.block_ns);
    // Zero-cost kernels (FAKE_CUDA_BLOCK_NS=0, used by benchmarks) leave no trace on the timeline.
    if duration == 0 {
        LAUNCHES.fetch_add(1, Ordering::Relaxed);
        return CUDA_SUCCESS;
    }
    if let Some(state) = gpu() {
        let d = &state.devices[dev];
        // A full launch queue blocks the launching thread, as on a real GPU.
        loop {
            let until = d.busy_until_ns.load(Ordering::Acquire);
            let now = fake_gpu_state::now_ns();
            if until <= now + cfg.queue_ns {
                break;
            }
            std::thread::sleep(std::time::Duration::from_nanos(until - now - cfg.queue_ns));
        }
        d.launch(std::process::id() as u64, duration);
    }
    LAUNCHES.fetch_add(1, Ordering::Relaxed);
    CUDA_SUCCESS
}

static LAUNCHES: AtomicU64 = AtomicU64::new(0);

fn grid_blocks(x: c_uint, y: c_uint, z: c_uint) -> u64 {
    x as u64 * y.max(1) as u64 * z.max(1) as u64
}

#[unsafe(no_mangle)]
pub extern "C" fn cuLaunchKernel(
    _f: *mut c_void,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    _bx: c_uint,
    _by: c_uint,
    _bz: c_uint,
    _shared: c_uint,
    _stream: *mut c_void,
    _params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CUresult {
    count("cuLaunchKernel");
    launch(grid_blocks(gx, gy, gz))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuLaunchKernel_ptsz(
    _f: *mut c_void,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    _bx: c_uint,
    _by: c_uint,
    _bz: c_uint,
    _shared: c_uint,
    _stream: *mut c_void,
    _params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CUresult {
    count("cuLaunchKernel_ptsz");
    launch(grid_blocks(gx, gy, gz))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuLaunchCooperativeKernel(
    _f: *mut c_void,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    _bx: c_uint,
    _by: c_uint,
    _bz: c_uint,
    _shared: c_uint,
    _stream: *mut c_void,
    _params: *mut *mut c_void,
) -> CUresult {
    count("cuLaunchCooperativeKernel");
    launch(grid_blocks(gx, gy, gz))
}

/// `CUlaunchConfig`: grid, block, shared memory, stream, attributes.
#[repr(C)]
pub struct CUlaunchConfig {
    pub grid_dim_x: c_uint,
    pub grid_dim_y: c_uint,
    pub grid_dim_z: c_uint,
    pub block_dim_x: c_uint,
    pub block_dim_y: c_uint,
    pub block_dim_z: c_uint,
    pub shared_mem_bytes: c_uint,
    pub h_stream: *mut c_void,
    pub attrs: *mut c_void,
    pub num_attrs: c_uint,
}

unsafe fn launch_ex(config: *const CUlaunchConfig) -> CUresult {
    if config.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: checked non-null.
    let c = unsafe { &*config };
    launch(grid_blocks(c.grid_dim_x, c.grid_dim_y, c.grid_dim_z))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernelEx(
    config: *const CUlaunchConfig,
    _f: *mut c_void,
    _params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CUresult {
    count("cuLaunchKernelEx");
    // SAFETY: same contract.
    unsafe { launch_ex(config) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernelEx_ptsz(
    config: *const CUlaunchConfig,
    _f: *mut c_void,
    _params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CUresult {
    count("cuLaunchKernelEx_ptsz");
    // SAFETY: same contract.
    unsafe { launch_ex(config) }
}

/// A graph launch runs one simulated kernel of `FAKE_CUDA_SM_COUNT` blocks; an executable graph
/// with memory nodes first maps its allocations and frees what its free nodes free.
#[unsafe(no_mangle)]
pub extern "C" fn cuGraphLaunch(exec: *mut c_void, _stream: *mut c_void) -> CUresult {
    count("cuGraphLaunch");
    graph_launch(exec as u64)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuGraphLaunch_ptsz(exec: *mut c_void, _stream: *mut c_void) -> CUresult {
    count("cuGraphLaunch_ptsz");
    graph_launch(exec as u64)
}

// ---------------------------------------------------------------- legacy and multi-device launches

/// `cuLaunch`: a 1 × 1 grid.
#[unsafe(no_mangle)]
pub extern "C" fn cuLaunch(_f: *mut c_void) -> CUresult {
    count("cuLaunch");
    launch(1)
}

fn legacy_grid(w: c_int, h: c_int) -> Result<u64, CUresult> {
    if w <= 0 || h <= 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok(w as u64 * h as u64)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuLaunchGrid(_f: *mut c_void, w: c_int, h: c_int) -> CUresult {
    count("cuLaunchGrid");
    legacy_grid(w, h).map_or_else(|e| e, launch)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuLaunchGridAsync(
    _f: *mut c_void,
    w: c_int,
    h: c_int,
    _stream: *mut c_void,
) -> CUresult {
    count("cuLaunchGridAsync");
    legacy_grid(w, h).map_or_else(|e| e, launch)
}

/// `CUDA_LAUNCH_PARAMS`.
#[repr(C)]
pub struct LaunchParams {
    pub function: *mut c_void,
    pub grid_dim_x: c_uint,
    pub grid_dim_y: c_uint,
    pub grid_dim_z: c_uint,
    pub block_dim_x: c_uint,
    pub block_dim_y: c_uint,
    pub block_dim_z: c_uint,
    pub shared_mem_bytes: c_uint,
    pub h_stream: *mut c_void,
    pub kernel_params: *mut *mut c_void,
}

/// One kernel per entry, each on the device of its stream (at most one entry per device).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchCooperativeKernelMultiDevice(
    list: *mut LaunchParams,
    num_devices: c_uint,
    _flags: c_uint,
) -> CUresult {
    count("cuLaunchCooperativeKernelMultiDevice");
    require_init!();
    if list.is_null() || num_devices == 0 || num_devices as usize > config().devices {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: the caller's array of `num_devices` entries.
    let entries = unsafe { std::slice::from_raw_parts(list, num_devices as usize) };
    let mut devices = Vec::new();
    for e in entries {
        let Some(dev) = stream_device(e.h_stream) else {
            return CUDA_ERROR_INVALID_CONTEXT;
        };
        if devices.contains(&dev) {
            return CUDA_ERROR_INVALID_VALUE;
        }
        devices.push(dev);
    }
    for (e, dev) in entries.iter().zip(devices) {
        let r = launch_on(dev, grid_blocks(e.grid_dim_x, e.grid_dim_y, e.grid_dim_z));
        if r != CUDA_SUCCESS {
            return r;
        }
    }
    CUDA_SUCCESS
}

// ---------------------------------------------------------------- streams

/// Stream handles are addresses inside this array, one per device (a stream belongs to the
/// context current when it was created; the NULL stream to the current context).
static STREAMS: [u8; 16] = [0; 16];

fn stream_device(stream: *mut c_void) -> Option<usize> {
    let i = (stream as usize).wrapping_sub(STREAMS.as_ptr() as usize);
    if i < config().devices {
        Some(i)
    } else {
        current_device()
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreate(stream: *mut *mut c_void, _flags: c_uint) -> CUresult {
    count("cuStreamCreate");
    require_init!();
    let Some(dev) = current_device() else {
        return CUDA_ERROR_INVALID_CONTEXT;
    };
    if stream.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: checked non-null.
    unsafe { *stream = (&STREAMS[dev] as *const u8).cast_mut().cast() };
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamDestroy_v2(_stream: *mut c_void) -> CUresult {
    count("cuStreamDestroy_v2");
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamGetCtx(stream: *mut c_void, ctx: *mut *mut c_void) -> CUresult {
    count("cuStreamGetCtx");
    require_init!();
    if ctx.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let Some(dev) = stream_device(stream) else {
        return CUDA_ERROR_INVALID_CONTEXT;
    };
    // SAFETY: checked non-null.
    unsafe { *ctx = ctx_handle(dev) };
    CUDA_SUCCESS
}

// ---------------------------------------------------------------- stream capture
//
// A captured stream records instead of running: `cuMemAllocAsync` / `cuMemAllocFromPoolAsync`
// add an allocation node (an address, no memory: the graph maps it when it runs), and
// `cuMemFreeAsync` a free node, to the graph `cuStreamEndCapture` returns. Kernels launched on
// a captured stream still run at once (the fake records no kernel nodes). The NULL stream
// cannot be captured.

const CUDA_ERROR_ILLEGAL_STATE: CUresult = 401;
const CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: CUresult = 900;

/// The graph `stream` is being captured into.
fn capture_graph(m: &Memory, stream: *mut c_void) -> Option<u64> {
    if stream.is_null() {
        return None;
    }
    m.capturing.get(&(stream as u64)).copied()
}

/// A stream-ordered allocation on a captured stream: an allocation node of the capture graph.
fn captured_alloc(dptr: *mut CUdeviceptr, size: usize, stream: *mut c_void) -> Option<CUresult> {
    if !initialized() {
        return None;
    }
    let graph = with_memory(|m| capture_graph(m, stream))?;
    if dptr.is_null() || size == 0 {
        return Some(CUDA_ERROR_INVALID_VALUE);
    }
    let dev = stream_device(stream)?;
    let bytes = size as u64;
    let mut node = 0u64;
    let mut addr = 0;
    let r = add_node(&mut node, graph, |m| {
        let step = bytes.div_ceil(512) * 512;
        m.next_addr += step;
        addr = m.next_addr - step;
        GraphNode::MemAlloc {
            dev,
            bytes,
            dptr: addr,
        }
    });
    if r == CUDA_SUCCESS {
        // SAFETY: checked non-null.
        unsafe { *dptr = addr };
    }
    Some(r)
}

/// A stream-ordered free on a captured stream: a free node of the capture graph.
fn captured_free(dptr: CUdeviceptr, stream: *mut c_void) -> Option<CUresult> {
    if !initialized() {
        return None;
    }
    let graph = with_memory(|m| capture_graph(m, stream))?;
    let mut node = 0u64;
    Some(add_node(&mut node, graph, |_| GraphNode::MemFree { dptr }))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamBeginCapture_v2(stream: *mut c_void, _mode: c_int) -> CUresult {
    count("cuStreamBeginCapture_v2");
    require_init!();
    if stream.is_null() || stream as usize <= 2 {
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
    with_memory(|m| {
        if m.capturing.contains_key(&(stream as u64)) {
            return CUDA_ERROR_ILLEGAL_STATE;
        }
        let g = new_handle(m);
        m.graphs.insert(g, Vec::new());
        m.capturing.insert(stream as u64, g);
        CUDA_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamEndCapture(stream: *mut c_void, graph: *mut u64) -> CUresult {
    count("cuStreamEndCapture");
    require_init!();
    if graph.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    match with_memory(|m| m.capturing.remove(&(stream as u64))) {
        Some(g) => {
            // SAFETY: checked non-null.
            unsafe { *graph = g };
            CUDA_SUCCESS
        }
        None => CUDA_ERROR_ILLEGAL_STATE,
    }
}

/// `CUstreamCaptureStatus`: 0 none, 1 active.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamIsCapturing(stream: *mut c_void, status: *mut c_int) -> CUresult {
    count("cuStreamIsCapturing");
    require_init!();
    if status.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let on = with_memory(|m| capture_graph(m, stream).is_some());
    // SAFETY: checked non-null.
    unsafe { *status = c_int::from(on) };
    CUDA_SUCCESS
}

// ---------------------------------------------------------------- graphs with memory nodes

const NODE_TYPE_EMPTY: c_int = 5;
const NODE_TYPE_MEM_ALLOC: c_int = 10;
const NODE_TYPE_MEM_FREE: c_int = 11;
const GRAPH_MEM_ATTR_USED_MEM_CURRENT: c_int = 0;
const GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT: c_int = 2;

/// `CUDA_MEM_ALLOC_NODE_PARAMS`.
#[repr(C)]
pub struct MemAllocNodeParams {
    pub alloc_type: c_int,
    pub handle_types: c_int,
    pub location_type: c_int,
    pub location_id: c_int,
    pub win32_security_attributes: *mut c_void,
    pub pool_props_tail: [u8; 64],
    pub access_descs: *const c_void,
    pub access_desc_count: usize,
    pub bytesize: usize,
    pub dptr: u64,
}

/// Graph, node and executable-graph handles: odd values far from anything else.
fn new_handle(m: &mut Memory) -> u64 {
    m.next_handle += 1;
    0x6000_0000_0001 + 2 * m.next_handle
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphCreate(graph: *mut u64, _flags: c_uint) -> CUresult {
    count("cuGraphCreate");
    require_init!();
    if graph.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    with_memory(|m| {
        let h = new_handle(m);
        m.graphs.insert(h, Vec::new());
        // SAFETY: checked non-null.
        unsafe { *graph = h };
        CUDA_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuGraphDestroy(graph: u64) -> CUresult {
    count("cuGraphDestroy");
    require_init!();
    with_memory(|m| match m.graphs.remove(&graph) {
        Some(nodes) => {
            for n in nodes {
                m.graph_nodes.remove(&n);
            }
            CUDA_SUCCESS
        }
        None => CUDA_ERROR_INVALID_VALUE,
    })
}

/// Adds `node` to `graph` and writes its handle.
fn add_node(out: *mut u64, graph: u64, node: impl FnOnce(&mut Memory) -> GraphNode) -> CUresult {
    require_init!();
    if out.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    with_memory(|m| {
        if !m.graphs.contains_key(&graph) {
            return CUDA_ERROR_INVALID_VALUE;
        }
        let kind = node(m);
        let h = new_handle(m);
        m.graph_nodes.insert(h, (graph, kind));
        m.graphs.entry(graph).or_default().push(h);
        // SAFETY: checked non-null.
        unsafe { *out = h };
        CUDA_SUCCESS
    })
}

/// An allocation node: its address is reserved now, its memory mapped at each launch.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphAddMemAllocNode(
    node: *mut u64,
    graph: u64,
    _deps: *const u64,
    _num_deps: usize,
    params: *mut MemAllocNodeParams,
) -> CUresult {
    count("cuGraphAddMemAllocNode");
    if params.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: checked non-null.
    let p = unsafe { &mut *params };
    let dev = match usize::try_from(p.location_id) {
        Ok(d) if p.location_type == 1 && d < config().devices => d,
        _ => return CUDA_ERROR_INVALID_VALUE,
    };
    if p.bytesize == 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let bytes = p.bytesize as u64;
    let mut dptr = 0;
    let r = add_node(node, graph, |m| {
        let step = bytes.div_ceil(512) * 512;
        m.next_addr += step;
        dptr = m.next_addr - step;
        GraphNode::MemAlloc { dev, bytes, dptr }
    });
    if r == CUDA_SUCCESS {
        p.dptr = dptr;
    }
    r
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphAddMemFreeNode(
    node: *mut u64,
    graph: u64,
    _deps: *const u64,
    _num_deps: usize,
    dptr: u64,
) -> CUresult {
    count("cuGraphAddMemFreeNode");
    add_node(node, graph, |_| GraphNode::MemFree { dptr })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphAddEmptyNode(
    node: *mut u64,
    graph: u64,
    _deps: *const u64,
    _num_deps: usize,
) -> CUresult {
    count("cuGraphAddEmptyNode");
    add_node(node, graph, |_| GraphNode::Empty)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphGetNodes(graph: u64, nodes: *mut u64, num: *mut usize) -> CUresult {
    count("cuGraphGetNodes");
    require_init!();
    if num.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    with_memory(|m| {
        let Some(list) = m.graphs.get(&graph) else {
            return CUDA_ERROR_INVALID_VALUE;
        };
        // SAFETY: checked non-null; `nodes` has room for `*num` handles when given.
        unsafe {
            if !nodes.is_null() {
                let room = *num;
                for i in 0..room {
                    *nodes.add(i) = list.get(i).copied().unwrap_or(0);
                }
                *num = room.min(list.len());
            } else {
                *num = list.len();
            }
        }
        CUDA_SUCCESS
    })
}

fn graph_node(node: u64) -> Option<GraphNode> {
    with_memory(|m| m.graph_nodes.get(&node).map(|(_, n)| *n))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphNodeGetType(node: u64, kind: *mut c_int) -> CUresult {
    count("cuGraphNodeGetType");
    require_init!();
    let (Some(n), false) = (graph_node(node), kind.is_null()) else {
        return CUDA_ERROR_INVALID_VALUE;
    };
    let t = match n {
        GraphNode::MemAlloc { .. } => NODE_TYPE_MEM_ALLOC,
        GraphNode::MemFree { .. } => NODE_TYPE_MEM_FREE,
        GraphNode::Empty => NODE_TYPE_EMPTY,
    };
    // SAFETY: checked non-null.
    unsafe { *kind = t };
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphMemAllocNodeGetParams(
    node: u64,
    params: *mut MemAllocNodeParams,
) -> CUresult {
    count("cuGraphMemAllocNodeGetParams");
    require_init!();
    let (Some(GraphNode::MemAlloc { dev, bytes, dptr }), false) =
        (graph_node(node), params.is_null())
    else {
        return CUDA_ERROR_INVALID_VALUE;
    };
    // SAFETY: checked non-null.
    let p = unsafe { &mut *params };
    p.alloc_type = 1;
    p.location_type = 1;
    p.location_id = dev as c_int;
    p.bytesize = bytes as usize;
    p.dptr = dptr;
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphMemFreeNodeGetParams(node: u64, dptr: *mut u64) -> CUresult {
    count("cuGraphMemFreeNodeGetParams");
    require_init!();
    let (Some(GraphNode::MemFree { dptr: d }), false) = (graph_node(node), dptr.is_null()) else {
        return CUDA_ERROR_INVALID_VALUE;
    };
    // SAFETY: checked non-null.
    unsafe { *dptr = d };
    CUDA_SUCCESS
}

/// Makes an executable graph of `graph` (its nodes copied, as the driver does).
fn instantiate(exec: *mut u64, graph: u64) -> CUresult {
    require_init!();
    if exec.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    with_memory(|m| {
        let Some(list) = m.graphs.get(&graph) else {
            return CUDA_ERROR_INVALID_VALUE;
        };
        let nodes: Vec<GraphNode> = list
            .iter()
            .filter_map(|n| m.graph_nodes.get(n).map(|(_, k)| *k))
            .collect();
        let h = new_handle(m);
        m.graph_execs.insert(h, nodes);
        // SAFETY: checked non-null.
        unsafe { *exec = h };
        CUDA_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphInstantiate(
    exec: *mut u64,
    graph: u64,
    _error_node: *mut u64,
    _log: *mut c_char,
    _log_size: usize,
) -> CUresult {
    count("cuGraphInstantiate");
    instantiate(exec, graph)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphInstantiate_v2(
    exec: *mut u64,
    graph: u64,
    _error_node: *mut u64,
    _log: *mut c_char,
    _log_size: usize,
) -> CUresult {
    count("cuGraphInstantiate_v2");
    instantiate(exec, graph)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphInstantiateWithFlags(
    exec: *mut u64,
    graph: u64,
    _flags: u64,
) -> CUresult {
    count("cuGraphInstantiateWithFlags");
    instantiate(exec, graph)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphInstantiateWithParams(
    exec: *mut u64,
    graph: u64,
    _params: *mut c_void,
) -> CUresult {
    count("cuGraphInstantiateWithParams");
    instantiate(exec, graph)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphInstantiateWithParams_ptsz(
    exec: *mut u64,
    graph: u64,
    _params: *mut c_void,
) -> CUresult {
    count("cuGraphInstantiateWithParams_ptsz");
    instantiate(exec, graph)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuGraphExecDestroy(exec: u64) -> CUresult {
    count("cuGraphExecDestroy");
    require_init!();
    // Allocations that outlive their launch stay mapped (the program frees them).
    with_memory(|m| match m.graph_execs.remove(&exec) {
        Some(_) => CUDA_SUCCESS,
        None => CUDA_ERROR_INVALID_VALUE,
    })
}

/// A freed graph allocation goes back to the graph pool, which keeps the memory.
fn graph_free(m: &mut Memory, dptr: u64) {
    if let Some((dev, bytes)) = m.graph_live.remove(&dptr) {
        m.graph_pool[dev].1 = m.graph_pool[dev].1.saturating_sub(bytes);
    }
}

/// Maps the allocations of an executable graph (the pool grows by what it lacks, failing with
/// OOM when the device is full), frees what its free nodes free, then runs one kernel of
/// `FAKE_CUDA_SM_COUNT` blocks. Unknown handles (tests that launch a dummy) just run the kernel.
fn graph_launch(exec: u64) -> CUresult {
    require_init!();
    let r = with_memory(|m| {
        let Some(nodes) = m.graph_execs.get(&exec).cloned() else {
            return CUDA_SUCCESS;
        };
        for n in nodes {
            match n {
                GraphNode::MemAlloc { dev, bytes, dptr } => {
                    if m.graph_live.contains_key(&dptr) {
                        // The last launch's allocation was never freed.
                        return CUDA_ERROR_INVALID_VALUE;
                    }
                    let (reserved, used) = m.graph_pool[dev];
                    let grow = (used + bytes).saturating_sub(reserved);
                    if grow > 0 {
                        if let Err(e) = charge(m, dev, grow) {
                            return e;
                        }
                        m.graph_pool[dev].0 += grow;
                    }
                    m.graph_pool[dev].1 += bytes;
                    m.graph_live.insert(dptr, (dev, bytes));
                }
                GraphNode::MemFree { dptr } => graph_free(m, dptr),
                GraphNode::Empty => {}
            }
        }
        CUDA_SUCCESS
    });
    if r != CUDA_SUCCESS {
        return r;
    }
    launch(config().sm_count)
}

/// Gives the graph pool's unused memory back to the device.
#[unsafe(no_mangle)]
pub extern "C" fn cuDeviceGraphMemTrim(dev: CUdevice) -> CUresult {
    count("cuDeviceGraphMemTrim");
    require_init!();
    let Some(d) = valid_device(dev) else {
        return CUDA_ERROR_INVALID_DEVICE;
    };
    with_memory(|m| {
        let (reserved, used) = m.graph_pool[d];
        if reserved > used {
            uncharge(m, d, reserved - used);
            m.graph_pool[d].0 = used;
        }
    });
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetGraphMemAttribute(
    dev: CUdevice,
    attr: c_int,
    value: *mut u64,
) -> CUresult {
    count("cuDeviceGetGraphMemAttribute");
    require_init!();
    let Some(d) = valid_device(dev) else {
        return CUDA_ERROR_INVALID_DEVICE;
    };
    if value.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let (reserved, used) = with_memory(|m| m.graph_pool[d]);
    let v = match attr {
        GRAPH_MEM_ATTR_USED_MEM_CURRENT => used,
        GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT => reserved,
        _ => return CUDA_ERROR_INVALID_VALUE,
    };
    // SAFETY: checked non-null.
    unsafe { *value = v };
    CUDA_SUCCESS
}

/// Test hook: device memory this process holds on `dev` as the simulated GPU sees it (every
/// allocation, pool and graph reservation, module), whatever the shim counts.
#[unsafe(no_mangle)]
pub extern "C" fn fake_cuda_device_used(dev: c_int) -> u64 {
    usize::try_from(dev)
        .ok()
        .filter(|&d| d < 16)
        .map_or(0, |d| with_memory(|m| m.local_used[d]))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuGetExportTable(_table: *mut *const c_void, _id: *const c_void) -> CUresult {
    count("cuGetExportTable");
    CUDA_ERROR_NOT_SUPPORTED
}

// ---------------------------------------------------------------- cuGetProcAddress

pub const CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM: u64 = 2;
const STATUS_SUCCESS: c_int = 0;
const STATUS_SYMBOL_NOT_FOUND: c_int = 1;
const STATUS_VERSION_NOT_SUFFICIENT: c_int = 2;

struct ProcEntry {
    api: &'static str,
    /// The first CUDA version whose headers map `api` to this symbol.
    since: c_int,
    /// Only returned with `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`.
    per_thread: bool,
    symbol: &'static str,
    ptr: *const c_void,
}

// SAFETY: function pointers are immutable addresses.
unsafe impl Sync for ProcEntry {}
// SAFETY: as above.
unsafe impl Send for ProcEntry {}

macro_rules! entry {
    ($api:literal, $since:literal, $pt:literal, $sym:ident) => {
        ProcEntry {
            api: $api,
            since: $since,
            per_thread: $pt,
            symbol: stringify!($sym),
            ptr: $sym as *const c_void,
        }
    };
}

/// Internal entry points, as some drivers return from `cuGetProcAddress` instead of their
/// exported symbols (`FAKE_CUDA_PROC_INTERNAL=1`): same behaviour, different address.
mod internal {
    use super::*;
    pub unsafe extern "C" fn mem_alloc_v2(dptr: *mut CUdeviceptr, size: usize) -> CUresult {
        count("cuMemAlloc_v2");
        // SAFETY: same contract as cuMemAlloc_v2.
        unsafe { alloc(dptr, size, Kind::Device) }
    }
    pub extern "C" fn mem_free_v2(dptr: CUdeviceptr) -> CUresult {
        count("cuMemFree_v2");
        free(dptr)
    }
    pub unsafe extern "C" fn mem_get_info_v2(
        free_bytes: *mut usize,
        total: *mut usize,
    ) -> CUresult {
        // SAFETY: same contract.
        unsafe { cuMemGetInfo_v2(free_bytes, total) }
    }
    #[allow(clippy::too_many_arguments)]
    pub extern "C" fn launch_kernel_ptsz(
        f: *mut c_void,
        gx: c_uint,
        gy: c_uint,
        gz: c_uint,
        bx: c_uint,
        by: c_uint,
        bz: c_uint,
        shared: c_uint,
        stream: *mut c_void,
        params: *mut *mut c_void,
        extra: *mut *mut c_void,
    ) -> CUresult {
        cuLaunchKernel_ptsz(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra)
    }
}

fn internal_pointer(symbol: &str) -> Option<*const c_void> {
    static ON: OnceLock<bool> = OnceLock::new();
    if !*ON.get_or_init(|| std::env::var("FAKE_CUDA_PROC_INTERNAL").is_ok_and(|v| v == "1")) {
        return None;
    }
    Some(match symbol {
        "cuMemAlloc_v2" => internal::mem_alloc_v2 as *const c_void,
        "cuMemGetInfo_v2" => internal::mem_get_info_v2 as *const c_void,
        "cuMemFree_v2" => internal::mem_free_v2 as *const c_void,
        "cuLaunchKernel_ptsz" => internal::launch_kernel_ptsz as *const c_void,
        _ => return None,
    })
}

fn proc_table() -> &'static [ProcEntry] {
    static TABLE: OnceLock<Vec<ProcEntry>> = OnceLock::new();
    TABLE.get_or_init(|| {
        vec![
            entry!("cuInit", 2000, false, cuInit),
            entry!("cuDriverGetVersion", 2020, false, cuDriverGetVersion),
            entry!("cuGetErrorString", 6000, false, cuGetErrorString),
            entry!("cuGetErrorName", 6000, false, cuGetErrorName),
            entry!("cuDeviceGet", 2000, false, cuDeviceGet),
            entry!("cuDeviceGetCount", 2000, false, cuDeviceGetCount),
            entry!("cuDeviceGetName", 2000, false, cuDeviceGetName),
            entry!("cuDeviceGetUuid", 9020, false, cuDeviceGetUuid),
            entry!("cuDeviceGetUuid", 11040, false, cuDeviceGetUuid_v2),
            entry!("cuDeviceGetAttribute", 2000, false, cuDeviceGetAttribute),
            entry!("cuDeviceTotalMem", 2000, false, cuDeviceTotalMem),
            entry!("cuDeviceTotalMem", 3020, false, cuDeviceTotalMem_v2),
            entry!(
                "cuDevicePrimaryCtxRetain",
                7000,
                false,
                cuDevicePrimaryCtxRetain
            ),
            entry!(
                "cuDevicePrimaryCtxRelease",
                11000,
                false,
                cuDevicePrimaryCtxRelease_v2
            ),
            entry!("cuCtxCreate", 3020, false, cuCtxCreate_v2),
            entry!("cuCtxDestroy", 4000, false, cuCtxDestroy_v2),
            entry!("cuCtxSetCurrent", 4000, false, cuCtxSetCurrent),
            entry!("cuCtxGetCurrent", 4000, false, cuCtxGetCurrent),
            entry!("cuCtxGetDevice", 2000, false, cuCtxGetDevice),
            entry!("cuCtxPushCurrent", 4000, false, cuCtxPushCurrent_v2),
            entry!("cuCtxPopCurrent", 4000, false, cuCtxPopCurrent_v2),
            entry!("cuCtxSynchronize", 2000, false, cuCtxSynchronize),
            entry!("cuCtxSetLimit", 3010, false, cuCtxSetLimit),
            entry!("cuCtxGetLimit", 3010, false, cuCtxGetLimit),
            entry!("cuStreamSynchronize", 2000, false, cuStreamSynchronize),
            entry!("cuStreamSynchronize", 7000, true, cuStreamSynchronize_ptsz),
            entry!("cuMemGetInfo", 2000, false, cuMemGetInfo),
            entry!("cuMemGetInfo", 3020, false, cuMemGetInfo_v2),
            entry!("cuMemAlloc", 2000, false, cuMemAlloc),
            entry!("cuMemAlloc", 3020, false, cuMemAlloc_v2),
            entry!("cuMemAllocManaged", 6000, false, cuMemAllocManaged),
            entry!("cuMemAllocPitch", 2000, false, cuMemAllocPitch),
            entry!("cuMemAllocPitch", 3020, false, cuMemAllocPitch_v2),
            entry!("cuMemFree", 2000, false, cuMemFree),
            entry!("cuMemFree", 3020, false, cuMemFree_v2),
            entry!("cuMemAllocAsync", 11020, false, cuMemAllocAsync),
            entry!("cuMemAllocAsync", 11020, true, cuMemAllocAsync_ptsz),
            entry!(
                "cuMemAllocFromPoolAsync",
                11020,
                false,
                cuMemAllocFromPoolAsync
            ),
            entry!(
                "cuMemAllocFromPoolAsync",
                11020,
                true,
                cuMemAllocFromPoolAsync_ptsz
            ),
            entry!("cuMemFreeAsync", 11020, false, cuMemFreeAsync),
            entry!("cuMemFreeAsync", 11020, true, cuMemFreeAsync_ptsz),
            entry!("cuMemCreate", 10020, false, cuMemCreate),
            entry!("cuMemRelease", 10020, false, cuMemRelease),
            entry!("cuMemMap", 10020, false, cuMemMap),
            entry!("cuMemUnmap", 10020, false, cuMemUnmap),
            entry!("cuMemSetAccess", 10020, false, cuMemSetAccess),
            entry!(
                "cuMemExportToShareableHandle",
                10020,
                false,
                cuMemExportToShareableHandle
            ),
            entry!(
                "cuMemImportFromShareableHandle",
                10020,
                false,
                cuMemImportFromShareableHandle
            ),
            entry!("cuIpcGetMemHandle", 4010, false, cuIpcGetMemHandle),
            entry!("cuIpcOpenMemHandle", 11000, false, cuIpcOpenMemHandle_v2),
            entry!("cuIpcCloseMemHandle", 4010, false, cuIpcCloseMemHandle),
            entry!("cuMemAddressReserve", 10020, false, cuMemAddressReserve),
            entry!("cuMemAddressFree", 10020, false, cuMemAddressFree),
            entry!(
                "cuMemGetAllocationGranularity",
                10020,
                false,
                cuMemGetAllocationGranularity
            ),
            entry!("cuMemHostAlloc", 2020, false, cuMemHostAlloc),
            entry!("cuMemFreeHost", 2000, false, cuMemFreeHost),
            entry!("cuArrayCreate", 2000, false, cuArrayCreate),
            entry!("cuArrayCreate", 3020, false, cuArrayCreate_v2),
            entry!("cuArray3DCreate", 2000, false, cuArray3DCreate),
            entry!("cuArray3DCreate", 3020, false, cuArray3DCreate_v2),
            entry!("cuArrayDestroy", 2000, false, cuArrayDestroy),
            entry!(
                "cuMipmappedArrayCreate",
                5000,
                false,
                cuMipmappedArrayCreate
            ),
            entry!(
                "cuMipmappedArrayDestroy",
                5000,
                false,
                cuMipmappedArrayDestroy
            ),
            entry!("cuLaunchKernel", 4000, false, cuLaunchKernel),
            entry!("cuLaunchKernel", 7000, true, cuLaunchKernel_ptsz),
            entry!("cuLaunchKernelEx", 11060, false, cuLaunchKernelEx),
            entry!("cuLaunchKernelEx", 11060, true, cuLaunchKernelEx_ptsz),
            entry!(
                "cuLaunchCooperativeKernel",
                9000,
                false,
                cuLaunchCooperativeKernel
            ),
            entry!("cuGraphLaunch", 10000, false, cuGraphLaunch),
            entry!("cuGraphLaunch", 10000, true, cuGraphLaunch_ptsz),
            entry!("cuGetExportTable", 3000, false, cuGetExportTable),
            entry!("cuLaunch", 2000, false, cuLaunch),
            entry!("cuLaunchGrid", 2000, false, cuLaunchGrid),
            entry!("cuLaunchGridAsync", 2000, false, cuLaunchGridAsync),
            entry!(
                "cuLaunchCooperativeKernelMultiDevice",
                9000,
                false,
                cuLaunchCooperativeKernelMultiDevice
            ),
            entry!("cuStreamCreate", 2000, false, cuStreamCreate),
            entry!("cuStreamDestroy", 4000, false, cuStreamDestroy_v2),
            entry!("cuStreamGetCtx", 9020, false, cuStreamGetCtx),
            entry!(
                "cuStreamBeginCapture",
                10010,
                false,
                cuStreamBeginCapture_v2
            ),
            entry!("cuStreamEndCapture", 10000, false, cuStreamEndCapture),
            entry!("cuStreamIsCapturing", 10000, false, cuStreamIsCapturing),
            entry!("cuGraphCreate", 10000, false, cuGraphCreate),
            entry!("cuGraphDestroy", 10000, false, cuGraphDestroy),
            entry!(
                "cuGraphAddMemAllocNode",
                11040,
                false,
                cuGraphAddMemAllocNode
            ),
            entry!("cuGraphAddMemFreeNode", 11040, false, cuGraphAddMemFreeNode),
            entry!("cuGraphAddEmptyNode", 10000, false, cuGraphAddEmptyNode),
            entry!("cuGraphGetNodes", 10000, false, cuGraphGetNodes),
            entry!("cuGraphNodeGetType", 10000, false, cuGraphNodeGetType),
            entry!(
                "cuGraphMemAllocNodeGetParams",
                11040,
                false,
                cuGraphMemAllocNodeGetParams
            ),
            entry!(
                "cuGraphMemFreeNodeGetParams",
                11040,
                false,
                cuGraphMemFreeNodeGetParams
            ),
            entry!("cuGraphInstantiate", 10000, false, cuGraphInstantiate),
            entry!("cuGraphInstantiate", 11000, false, cuGraphInstantiate_v2),
            entry!(
                "cuGraphInstantiate",
                12000,
                false,
                cuGraphInstantiateWithFlags
            ),
            entry!(
                "cuGraphInstantiateWithFlags",
                11040,
                false,
                cuGraphInstantiateWithFlags
            ),
            entry!(
                "cuGraphInstantiateWithParams",
                12000,
                false,
                cuGraphInstantiateWithParams
            ),
            entry!(
                "cuGraphInstantiateWithParams",
                12000,
                true,
                cuGraphInstantiateWithParams_ptsz
            ),
            entry!("cuGraphExecDestroy", 10000, false, cuGraphExecDestroy),
            entry!("cuDeviceGraphMemTrim", 11040, false, cuDeviceGraphMemTrim),
            entry!(
                "cuDeviceGetGraphMemAttribute",
                11040,
                false,
                cuDeviceGetGraphMemAttribute
            ),
            entry!("cuDeviceGetMemPool", 11020, false, cuDeviceGetMemPool),
            entry!(
                "cuDeviceGetDefaultMemPool",
                11020,
                false,
                cuDeviceGetDefaultMemPool
            ),
            entry!("cuMemPoolCreate", 11020, false, cuMemPoolCreate),
            entry!("cuMemPoolDestroy", 11020, false, cuMemPoolDestroy),
            entry!("cuMemPoolTrimTo", 11020, false, cuMemPoolTrimTo),
            entry!("cuMemPoolGetAttribute", 11020, false, cuMemPoolGetAttribute),
            entry!("cuMemPoolSetAttribute", 11020, false, cuMemPoolSetAttribute),
            entry!("cuModuleLoad", 2000, false, cuModuleLoad),
            entry!("cuModuleLoadData", 2000, false, cuModuleLoadData),
            entry!("cuModuleLoadDataEx", 2010, false, cuModuleLoadDataEx),
            entry!("cuModuleLoadFatBinary", 2000, false, cuModuleLoadFatBinary),
            entry!("cuModuleUnload", 2000, false, cuModuleUnload),
            entry!("cuLibraryLoadData", 12000, false, cuLibraryLoadData),
            entry!("cuLibraryLoadFromFile", 12000, false, cuLibraryLoadFromFile),
            entry!("cuLibraryUnload", 12000, false, cuLibraryUnload),
            entry!("cuGetProcAddress", 11030, false, cuGetProcAddress),
            entry!("cuGetProcAddress", 12000, false, cuGetProcAddress_v2),
        ]
    })
}

/// `FAKE_CUDA_PROC_AGNOSTIC=1`: `cuGetProcAddress` answers every requested version of a name
/// with the same entry point (the newest variant), as a version-agnostic driver or stub does.
fn version_agnostic() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("FAKE_CUDA_PROC_AGNOSTIC").is_ok_and(|v| v == "1"))
}

/// The driver's rule: the newest variant of `api` that `cuda_version` knows, preferring the
/// per-thread-stream variant when asked for and one exists. A version-agnostic driver ignores
/// the version (the newest variant, whatever was asked for).
fn resolve(api: &str, cuda_version: c_int, flags: u64) -> Result<&'static ProcEntry, c_int> {
    let cuda_version = if version_agnostic() {
        c_int::MAX
    } else {
        cuda_version
    };
    let per_thread = flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM != 0;
    let candidates: Vec<&ProcEntry> = proc_table().iter().filter(|e| e.api == api).collect();
    if candidates.is_empty() {
        return Err(STATUS_SYMBOL_NOT_FOUND);
    }
    let best = |pt: bool| {
        candidates
            .iter()
            .filter(|e| e.per_thread == pt && e.since <= cuda_version)
            .max_by_key(|e| e.since)
            .copied()
    };
    let found = if per_thread {
        best(true).or_else(|| best(false))
    } else {
        best(false)
    };
    found.ok_or(STATUS_VERSION_NOT_SUFFICIENT)
}

/// Test hook: the symbol name the fake resolves `(api, version, flags)` to (NULL if none).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fake_cuda_resolve_name(
    api: *const c_char,
    cuda_version: c_int,
    flags: u64,
) -> *const c_char {
    if api.is_null() {
        return std::ptr::null();
    }
    // SAFETY: caller passes a NUL-terminated string.
    let api = unsafe { CStr::from_ptr(api) }.to_string_lossy();
    static NAMES: Mutex<Vec<std::ffi::CString>> = Mutex::new(Vec::new());
    match resolve(&api, cuda_version, flags) {
        Ok(e) => {
            let mut names = NAMES.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(n) = names.iter().find(|n| n.to_bytes() == e.symbol.as_bytes()) {
                return n.as_ptr();
            }
            let Ok(c) = std::ffi::CString::new(e.symbol) else {
                return std::ptr::null();
            };
            let p = c.as_ptr();
            names.push(c);
            p
        }
        Err(_) => std::ptr::null(),
    }
}

unsafe fn get_proc_address(
    symbol: *const c_char,
    pfn: *mut *const c_void,
    cuda_version: c_int,
    flags: u64,
    status: *mut c_int,
) -> CUresult {
    if symbol.is_null() || pfn.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: caller passes a NUL-terminated string.
    let api = unsafe { CStr::from_ptr(symbol) }.to_string_lossy();
    let (r, st, ptr) = match resolve(&api, cuda_version, flags) {
        Ok(e) => (
            CUDA_SUCCESS,
            STATUS_SUCCESS,
            internal_pointer(e.symbol).unwrap_or(e.ptr),
        ),
        Err(st) => (CUDA_ERROR_NOT_FOUND, st, std::ptr::null()),
    };
    // SAFETY: checked non-null; `status` is optional.
    unsafe {
        *pfn = ptr;
        if !status.is_null() {
            *status = st;
        }
    }
    r
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *const c_void,
    cuda_version: c_int,
    flags: u64,
) -> CUresult {
    count("cuGetProcAddress");
    // SAFETY: same contract.
    unsafe { get_proc_address(symbol, pfn, cuda_version, flags, std::ptr::null_mut()) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *const c_void,
    cuda_version: c_int,
    flags: u64,
    status: *mut c_int,
) -> CUresult {
    count("cuGetProcAddress_v2");
    // SAFETY: same contract.
    unsafe { get_proc_address(symbol, pfn, cuda_version, flags, status) }
}

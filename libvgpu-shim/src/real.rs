//! Finding the real functions: the real `dlsym` (glibc before and after 2.34; musl), the real
//! driver libraries (`dlopen` on first use, never linked), and a pointer per hooked symbol.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::atomic::{AtomicPtr, AtomicU8, Ordering};

pub type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

/// The real `dlsym`, set by the load-time constructor (or on first need).
pub static REAL_DLSYM: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());

/// Every symbol the shim defines, in one list: the exported wrapper lives in
/// `crate::hooks` under the same name, and `REAL[F::name]` is the driver's function.
macro_rules! hooked {
    ($($name:ident),* $(,)?) => {
        #[allow(non_camel_case_types)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        #[repr(usize)]
        pub enum F { $($name),* }

        pub const ALL: &[F] = &[$(F::$name),*];

        /// NUL-terminated names.
        pub const NAMES: &[&str] = &[$(concat!(stringify!($name), "\0")),*];

        pub fn wrapper(f: F) -> *mut c_void {
            match f { $(F::$name => crate::hooks::$name as *mut c_void),* }
        }
    };
}

hooked!(
    cuInit,
    cuGetProcAddress,
    cuGetProcAddress_v2,
    cuMemAlloc_v2,
    cuMemAlloc,
    cuMemAllocManaged,
    cuMemAllocPitch,
    cuMemFree,
    cuArrayCreate,
    cuArray3DCreate,
    cuMemGetInfo,
    cuDeviceTotalMem,
    cuMemAllocPitch_v2,
    cuMemFree_v2,
    cuMemAllocAsync,
    cuMemAllocAsync_ptsz,
    cuMemAllocFromPoolAsync,
    cuMemAllocFromPoolAsync_ptsz,
    cuMemFreeAsync,
    cuMemFreeAsync_ptsz,
    cuMemCreate,
    cuMemRelease,
    cuArrayCreate_v2,
    cuArray3DCreate_v2,
    cuArrayDestroy,
    cuMipmappedArrayCreate,
    cuMipmappedArrayDestroy,
    cuMemGetInfo_v2,
    cuDeviceTotalMem_v2,
    cuLaunchKernel,
    cuLaunchKernel_ptsz,
    cuLaunchKernelEx,
    cuLaunchKernelEx_ptsz,
    cuLaunchCooperativeKernel,
    cuLaunchCooperativeKernel_ptsz,
    cuGraphLaunch,
    cuGraphLaunch_ptsz,
    cuLaunch,
    cuLaunchGrid,
    cuLaunchGridAsync,
    cuLaunchCooperativeKernelMultiDevice,
    cuGraphInstantiate,
    cuGraphInstantiate_v2,
    cuGraphInstantiateWithFlags,
    cuGraphInstantiateWithParams,
    cuGraphInstantiateWithParams_ptsz,
    cuGraphExecDestroy,
    cuDeviceGraphMemTrim,
    cuModuleLoad,
    cuModuleLoadData,
    cuModuleLoadDataEx,
    cuModuleLoadFatBinary,
    cuModuleUnload,
    cuLibraryLoadData,
    cuLibraryLoadFromFile,
    cuLibraryUnload,
    cuMemPoolTrimTo,
    cuMemPoolSetAttribute,
    cuMemPoolDestroy,
    cuCtxSetLimit,
    nvmlDeviceGetMemoryInfo,
    nvmlDeviceGetMemoryInfo_v2,
    nvmlDeviceGetComputeRunningProcesses,
    nvmlDeviceGetComputeRunningProcesses_v2,
    nvmlDeviceGetComputeRunningProcesses_v3,
    nvmlDeviceGetGraphicsRunningProcesses,
    nvmlDeviceGetGraphicsRunningProcesses_v2,
    nvmlDeviceGetGraphicsRunningProcesses_v3,
    nvmlDeviceGetMPSComputeRunningProcesses,
    nvmlDeviceGetMPSComputeRunningProcesses_v2,
    nvmlDeviceGetMPSComputeRunningProcesses_v3,
    nvmlDeviceGetUtilizationRates,
    nvmlDeviceGetProcessUtilization,
    nvmlDeviceGetRunningProcessDetailList,
    nvmlDeviceGetProcessesUtilizationInfo,
    nvmlDeviceGetAccountingPids,
);

/// Driver functions the shim calls but does not hook.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug)]
#[repr(usize)]
pub enum Aux {
    cuCtxGetDevice,
    cuDeviceGetCount,
    cuDeviceGetUuid_v2,
    cuDeviceGetMemPool,
    cuMemPoolGetAttribute,
    cuStreamGetCtx,
    cuCtxPushCurrent_v2,
    cuCtxPopCurrent_v2,
    cuGraphGetNodes,
    cuGraphNodeGetType,
    cuGraphMemAllocNodeGetParams,
    cuGraphMemFreeNodeGetParams,
    cuGraphChildGraphNodeGetGraph,
    cuDeviceGetGraphMemAttribute,
    nvmlInit_v2,
    nvmlDeviceGetIndex,
    nvmlDeviceGetHandleByIndex_v2,
    cuMemHostRegister_v2,
    cuMemHostUnregister,
    cuMemHostGetDevicePointer_v2,
    cuStreamSynchronize,
    cuStreamIsCapturing,
    cuCtxGetLimit,
}
const AUX_NAMES: &[&str] = &[
    "cuCtxGetDevice\0",
    "cuDeviceGetCount\0",
    "cuDeviceGetUuid_v2\0",
    "cuDeviceGetMemPool\0",
    "cuMemPoolGetAttribute\0",
    "cuStreamGetCtx\0",
    "cuCtxPushCurrent_v2\0",
    "cuCtxPopCurrent_v2\0",
    "cuGraphGetNodes\0",
    "cuGraphNodeGetType\0",
    "cuGraphMemAllocNodeGetParams\0",
    "cuGraphMemFreeNodeGetParams\0",
    "cuGraphChildGraphNodeGetGraph\0",
    "cuDeviceGetGraphMemAttribute\0",
    "nvmlInit_v2\0",
    "nvmlDeviceGetIndex\0",
    "nvmlDeviceGetHandleByIndex_v2\0",
    "cuMemHostRegister_v2\0",
    "cuMemHostUnregister\0",
    "cuMemHostGetDevicePointer_v2\0",
    "cuStreamSynchronize\0",
    "cuStreamIsCapturing\0",
    "cuCtxGetLimit\0",
];

const N: usize = NAMES.len();
static REAL: [AtomicPtr<c_void>; N] = [const { AtomicPtr::new(std::ptr::null_mut()) }; N];
static REAL_AUX: [AtomicPtr<c_void>; AUX_NAMES.len()] =
    [const { AtomicPtr::new(std::ptr::null_mut()) }; AUX_NAMES.len()];

const UNLOADED: u8 = 0;
const LOADING: u8 = 1;
const LOADED: u8 = 2;

static CUDA_STATE: AtomicU8 = AtomicU8::new(UNLOADED);
static NVML_STATE: AtomicU8 = AtomicU8::new(UNLOADED);

pub fn is_nvml(name: &str) -> bool {
    name.starts_with("nvml")
}

/// Glibc versions of `dlsym`: 2.34 moved it into libc; older ones per architecture.
#[cfg(target_env = "gnu")]
const DLSYM_VERSIONS: &[&CStr] = &[
    c"GLIBC_2.34",
    c"GLIBC_2.2.5",
    c"GLIBC_2.17",
    c"GLIBC_2.0",
    c"GLIBC_2.3",
    c"GLIBC_2.4",
    c"GLIBC_2.10",
    c"GLIBC_2.18",
    c"GLIBC_2.22",
    c"GLIBC_2.27",
];

/// Finds the real `dlsym` without calling `dlsym` (which would be ours).
pub fn init_real_dlsym() -> *mut c_void {
    let cur = REAL_DLSYM.load(Ordering::Acquire);
    if !cur.is_null() {
        return cur;
    }
    let ours = crate::hooks::dlsym as *mut c_void;
    let found = find_real_dlsym(ours);
    if !found.is_null() {
        REAL_DLSYM.store(found, Ordering::Release);
    }
    found
}

/// glibc: `dlvsym` with the known versions of `dlsym`.
#[cfg(target_env = "gnu")]
fn find_real_dlsym(ours: *mut c_void) -> *mut c_void {
    let mut found = std::ptr::null_mut();
    for ver in DLSYM_VERSIONS {
        // SAFETY: `dlvsym` with constant NUL-terminated strings.
        let p = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), ver.as_ptr()) };
        if !p.is_null() && p != ours {
            found = p;
            break;
        }
    }
    if found.is_null() {
        // Last resort: ask libc itself by handle (a handle lookup never returns our symbol).
        for lib in [c"libc.so.6", c"libdl.so.2"] {
            // SAFETY: dlopen/dlvsym with constant strings; the handle stays open on purpose.
            unsafe {
                let h = libc::dlopen(lib.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
                if h.is_null() {
                    continue;
                }
                for ver in DLSYM_VERSIONS {
                    let p = libc::dlvsym(h, c"dlsym".as_ptr(), ver.as_ptr());
                    if !p.is_null() && p != ours {
                        found = p;
                        break;
                    }
                }
            }
            if !found.is_null() {
                break;
            }
        }
    }
    found
}

/// musl: no `dlvsym`, one unversioned `dlsym`; read from the C library's dynamic symbol table
/// (see `crate::musl_dlsym`). musl always defines it; should the search fail anyway, it is not
/// repeated and is said once on stderr: every `dlsym` call then returns NULL, and so do the
/// shim's own driver lookups (hooked calls return `CUDA_ERROR_NOT_FOUND`), as on glibc when
/// `dlvsym` finds nothing.
#[cfg(target_env = "musl")]
fn find_real_dlsym(ours: *mut c_void) -> *mut c_void {
    static FAILED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if FAILED.load(Ordering::Acquire) {
        return std::ptr::null_mut();
    }
    let found = crate::musl_dlsym::find_real_dlsym(ours);
    if found.is_null() && !FAILED.swap(true, Ordering::AcqRel) {
        crate::log::error!(
            "cannot find the C library's dlsym: dlsym() returns NULL in this process and CUDA calls \
             through the shim find no driver"
        );
    }
    found
}

/// `dlsym` without interposition. NULL if the real one cannot be found.
pub unsafe fn real_dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    let p = init_real_dlsym();
    if p.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: `p` is the real dlsym.
    unsafe {
        let f: DlsymFn = std::mem::transmute::<*mut c_void, DlsymFn>(p);
        f(handle, name)
    }
}

fn lib_name(env: &str, default: &'static CStr) -> std::ffi::CString {
    // Test hook and escape hatch: load the driver from an explicit path.
    std::env::var(env)
        .ok()
        .filter(|v| !v.is_empty())
        .and_then(|v| std::ffi::CString::new(v).ok())
        .unwrap_or_else(|| default.to_owned())
}

/// Loads one library and resolves the hooked and auxiliary names of one family.
fn load(state: &AtomicU8, lib: std::ffi::CString, nvml: bool) -> bool {
    match state.compare_exchange(UNLOADED, LOADING, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => {}
        Err(LOADED) => return true,
        Err(_) => {
            // Another thread is loading: wait for it (bounded). A re-entrant call from the
            // loading thread itself (a constructor calling back) gets "not loaded".
            for _ in 0..20_000 {
                match state.load(Ordering::Acquire) {
                    LOADED => return true,
                    UNLOADED => return false,
                    _ => std::thread::sleep(std::time::Duration::from_micros(100)),
                }
            }
            return false;
        }
    }
    // SAFETY: dlopen with a NUL-terminated name; RTLD_NODELETE keeps it for the process life.
    let handle = unsafe { libc::dlopen(lib.as_ptr(), libc::RTLD_NOW | libc::RTLD_NODELETE) };
    if handle.is_null() {
        crate::log::warning!(
            "cannot load {}; calls pass through unchanged",
            lib.to_string_lossy()
        );
        state.store(LOADED, Ordering::Release);
        return true;
    }
    for (i, name) in NAMES.iter().enumerate() {
        if is_nvml(name) == nvml {
            // SAFETY: handle lookup of a NUL-terminated name.
            let p = unsafe { real_dlsym(handle, name.as_ptr().cast()) };
            REAL[i].store(p, Ordering::Release);
        }
    }
    for (i, name) in AUX_NAMES.iter().enumerate() {
        if is_nvml(name) == nvml {
            // SAFETY: as above.
            let p = unsafe { real_dlsym(handle, name.as_ptr().cast()) };
            REAL_AUX[i].store(p, Ordering::Release);
        }
    }
    state.store(LOADED, Ordering::Release);
    true
}

pub fn ensure_cuda() -> bool {
    if CUDA_STATE.load(Ordering::Acquire) == LOADED {
        return true;
    }
    load(
        &CUDA_STATE,
        lib_name("TESSERA_REAL_LIBCUDA", c"libcuda.so.1"),
        false,
    )
}

pub fn ensure_nvml() -> bool {
    if NVML_STATE.load(Ordering::Acquire) == LOADED {
        return true;
    }
    load(
        &NVML_STATE,
        lib_name("TESSERA_REAL_LIBNVML", c"libnvidia-ml.so.1"),
        true,
    )
}

/// The real function behind hook `f`: the driver's exported symbol, else the entry point its
/// `cuGetProcAddress` names that variant with (a driver that exports less than it hands out);
/// NULL if the driver lacks it or is not loaded.
#[inline]
pub fn get(f: F) -> *mut c_void {
    let p = REAL[f as usize].load(Ordering::Acquire);
    if !p.is_null() {
        return p;
    }
    let loaded = if is_nvml(NAMES[f as usize]) {
        ensure_nvml()
    } else {
        ensure_cuda()
    };
    if !loaded {
        return std::ptr::null_mut();
    }
    let p = REAL[f as usize].load(Ordering::Acquire);
    if p.is_null() { probed_for(f) } else { p }
}

pub fn aux(a: Aux) -> *mut c_void {
    let p = REAL_AUX[a as usize].load(Ordering::Acquire);
    if !p.is_null() {
        return p;
    }
    if is_nvml(AUX_NAMES[a as usize]) {
        ensure_nvml();
    } else {
        ensure_cuda();
    }
    REAL_AUX[a as usize].load(Ordering::Acquire)
}

/// The hook for a name, if the shim hooks it.
pub fn hook_for(name: &[u8]) -> Option<F> {
    NAMES
        .iter()
        .position(|n| &n.as_bytes()[..n.len() - 1] == name)
        .map(|i| ALL[i])
}

/// How `cuGetProcAddress` names each hooked symbol: (hook, API name, the CUDA version whose
/// headers first map the name to this variant, per-thread-default-stream variant). A hook may
/// appear under more than one name.
const PROC_NAMES: &[(F, &CStr, c_int, bool)] = &[
    (F::cuInit, c"cuInit", 2000, false),
    (F::cuGetProcAddress, c"cuGetProcAddress", 11030, false),
    (F::cuGetProcAddress_v2, c"cuGetProcAddress", 12000, false),
    (F::cuMemAlloc_v2, c"cuMemAlloc", 3020, false),
    // The legacy (CUDA 3.1 ABI, 32-bit) variants the driver still hands out for old versions.
    (F::cuMemAlloc, c"cuMemAlloc", 2000, false),
    (F::cuMemAllocPitch, c"cuMemAllocPitch", 2000, false),
    (F::cuMemFree, c"cuMemFree", 2000, false),
    (F::cuArrayCreate, c"cuArrayCreate", 2000, false),
    (F::cuArray3DCreate, c"cuArray3DCreate", 2000, false),
    (F::cuMemGetInfo, c"cuMemGetInfo", 2000, false),
    (F::cuDeviceTotalMem, c"cuDeviceTotalMem", 2000, false),
    (F::cuMemAllocManaged, c"cuMemAllocManaged", 6000, false),
    (F::cuMemAllocPitch_v2, c"cuMemAllocPitch", 3020, false),
    (F::cuMemFree_v2, c"cuMemFree", 3020, false),
    (F::cuMemAllocAsync, c"cuMemAllocAsync", 11020, false),
    (F::cuMemAllocAsync_ptsz, c"cuMemAllocAsync", 11020, true),
    (
        F::cuMemAllocFromPoolAsync,
        c"cuMemAllocFromPoolAsync",
        11020,
        false,
    ),
    (
        F::cuMemAllocFromPoolAsync_ptsz,
        c"cuMemAllocFromPoolAsync",
        11020,
        true,
    ),
    (F::cuMemFreeAsync, c"cuMemFreeAsync", 11020, false),
    (F::cuMemFreeAsync_ptsz, c"cuMemFreeAsync", 11020, true),
    (F::cuMemCreate, c"cuMemCreate", 10020, false),
    (F::cuMemRelease, c"cuMemRelease", 10020, false),
    (F::cuArrayCreate_v2, c"cuArrayCreate", 3020, false),
    (F::cuArray3DCreate_v2, c"cuArray3DCreate", 3020, false),
    (F::cuArrayDestroy, c"cuArrayDestroy", 2000, false),
    (
        F::cuMipmappedArrayCreate,
        c"cuMipmappedArrayCreate",
        5000,
        false,
    ),
    (
        F::cuMipmappedArrayDestroy,
        c"cuMipmappedArrayDestroy",
        5000,
        false,
    ),
    (F::cuMemGetInfo_v2, c"cuMemGetInfo", 3020, false),
    (F::cuDeviceTotalMem_v2, c"cuDeviceTotalMem", 3020, false),
    (F::cuLaunchKernel, c"cuLaunchKernel", 4000, false),
    (F::cuLaunchKernel_ptsz, c"cuLaunchKernel", 7000, true),
    (F::cuLaunchKernelEx, c"cuLaunchKernelEx", 11060, false),
    (F::cuLaunchKernelEx_ptsz, c"cuLaunchKernelEx", 11060, true),
    (
        F::cuLaunchCooperativeKernel,
        c"cuLaunchCooperativeKernel",
        9000,
        false,
    ),
    (
        F::cuLaunchCooperativeKernel_ptsz,
        c"cuLaunchCooperativeKernel",
        9000,
        true,
    ),
    (F::cuGraphLaunch, c"cuGraphLaunch", 10000, false),
    (F::cuGraphLaunch_ptsz, c"cuGraphLaunch", 10000, true),
    (F::cuLaunch, c"cuLaunch", 2000, false),
    (F::cuLaunchGrid, c"cuLaunchGrid", 2000, false),
    (F::cuLaunchGridAsync, c"cuLaunchGridAsync", 2000, false),
    (
        F::cuLaunchCooperativeKernelMultiDevice,
        c"cuLaunchCooperativeKernelMultiDevice",
        9000,
        false,
    ),
    // CUDA 12's headers define `cuGraphInstantiate` as `cuGraphInstantiateWithFlags`.
    (F::cuGraphInstantiate, c"cuGraphInstantiate", 10000, false),
    (
        F::cuGraphInstantiate_v2,
        c"cuGraphInstantiate",
        11000,
        false,
    ),
    (
        F::cuGraphInstantiateWithFlags,
        c"cuGraphInstantiate",
        12000,
        false,
    ),
    (
        F::cuGraphInstantiateWithFlags,
        c"cuGraphInstantiateWithFlags",
        11040,
        false,
    ),
    (
        F::cuGraphInstantiateWithParams,
        c"cuGraphInstantiateWithParams",
        12000,
        false,
    ),
    (
        F::cuGraphInstantiateWithParams_ptsz,
        c"cuGraphInstantiateWithParams",
        12000,
        true,
    ),
    (F::cuGraphExecDestroy, c"cuGraphExecDestroy", 10000, false),
    (
        F::cuDeviceGraphMemTrim,
        c"cuDeviceGraphMemTrim",
        11040,
        false,
    ),
    (F::cuModuleLoad, c"cuModuleLoad", 2000, false),
    (F::cuModuleLoadData, c"cuModuleLoadData", 2000, false),
    (F::cuModuleLoadDataEx, c"cuModuleLoadDataEx", 2010, false),
    (
        F::cuModuleLoadFatBinary,
        c"cuModuleLoadFatBinary",
        2000,
        false,
    ),
    (F::cuModuleUnload, c"cuModuleUnload", 2000, false),
    (F::cuLibraryLoadData, c"cuLibraryLoadData", 12000, false),
    (
        F::cuLibraryLoadFromFile,
        c"cuLibraryLoadFromFile",
        12000,
        false,
    ),
    (F::cuLibraryUnload, c"cuLibraryUnload", 12000, false),
    (F::cuMemPoolTrimTo, c"cuMemPoolTrimTo", 11020, false),
    (
        F::cuMemPoolSetAttribute,
        c"cuMemPoolSetAttribute",
        11020,
        false,
    ),
    (F::cuMemPoolDestroy, c"cuMemPoolDestroy", 11020, false),
    (F::cuCtxSetLimit, c"cuCtxSetLimit", 3010, false),
];

/// What the driver's `cuGetProcAddress` returned for each entry of [`PROC_NAMES`] (same index),
/// asked at that entry's version and flags; NULL where it named no variant of its own (see
/// [`probe_driver_table`]). A driver may hand out internal entry points that differ from its
/// exported symbols, or (a version-agnostic driver or stub) one entry point for every version
/// of a name: the probe is how the substitution recognises both.
static PROBED: [AtomicPtr<c_void>; PROC_NAMES.len()] =
    [const { AtomicPtr::new(std::ptr::null_mut()) }; PROC_NAMES.len()];
static PROBE_STATE: AtomicU8 = AtomicU8::new(UNLOADED);

pub const PER_THREAD_DEFAULT_STREAM: u64 = 2;

/// Asks the real `cuGetProcAddress(_v2)` for `api` at `version` with `flags`.
fn driver_proc_address(api: &CStr, version: c_int, flags: u64) -> *mut c_void {
    let v2 = REAL[F::cuGetProcAddress_v2 as usize].load(Ordering::Acquire);
    let v1 = REAL[F::cuGetProcAddress as usize].load(Ordering::Acquire);
    let mut p: *mut c_void = std::ptr::null_mut();
    let r = if !v2.is_null() {
        let mut status: c_int = 0;
        // SAFETY: the driver's cuGetProcAddress_v2(name, void**, int, cuuint64_t, status*).
        unsafe {
            let g: unsafe extern "C" fn(
                *const c_char,
                *mut *mut c_void,
                c_int,
                u64,
                *mut c_int,
            ) -> c_int = std::mem::transmute(v2);
            g(api.as_ptr(), &mut p, version, flags, &mut status)
        }
    } else if !v1.is_null() {
        // SAFETY: the driver's cuGetProcAddress(name, void**, int, cuuint64_t).
        unsafe {
            let g: unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64) -> c_int =
                std::mem::transmute(v1);
            g(api.as_ptr(), &mut p, version, flags)
        }
    } else {
        -1
    };
    crate::log::write(
        crate::log::INFO + 1,
        &format!("probe {api:?}@{version} flags {flags}: {r} {p:?}"),
    );
    if r == 0 { p } else { std::ptr::null_mut() }
}

/// Asks the driver once for every entry of [`PROC_NAMES`], after the exported symbols are
/// resolved (the answers are compared with them). An answer is not recorded when it says the
/// driver has no such variant of its own:
/// * a per-thread request answered with what the default-stream request gets (the API has no
///   per-thread variant in this driver);
/// * an answer that is the exported symbol of an *older* variant of the same name (this driver
///   maps that version to the older ABI: the entry is not how it names the variant). A driver
///   never answers a version with a newer ABI than it asked for, unless it ignores the version:
///   that answer is recorded, and the caller's version decides (see [`hook_for_proc`]).
fn probe_driver_table() {
    if PROBE_STATE
        .compare_exchange(UNLOADED, LOADING, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        return;
    }
    if !ensure_cuda() {
        // Not loaded yet (a re-entrant call from the driver's own initialisation): try again
        // at the next lookup, never with a half-resolved table.
        PROBE_STATE.store(UNLOADED, Ordering::Release);
        return;
    }
    for (i, &(f, api, since, per_thread)) in PROC_NAMES.iter().enumerate() {
        let flags = if per_thread {
            PER_THREAD_DEFAULT_STREAM
        } else {
            0
        };
        let p = driver_proc_address(api, since, flags);
        if p.is_null() {
            continue;
        }
        if per_thread && p == driver_proc_address(api, since, 0) {
            continue;
        }
        let older_variant = PROC_NAMES.iter().any(|&(g, other, other_since, _)| {
            other == api
                && g != f
                && other_since < since
                && REAL[g as usize].load(Ordering::Acquire) == p
        });
        if older_variant {
            continue;
        }
        PROBED[i].store(p, Ordering::Release);
    }
    PROBE_STATE.store(LOADED, Ordering::Release);
}

/// The driver's table has been probed (probing it now if needed; waiting, bounded, for another
/// thread that is probing).
fn ensure_probed() -> bool {
    if PROBE_STATE.load(Ordering::Acquire) != LOADED {
        probe_driver_table();
        // Another thread may be probing: wait for it (the probe only calls the driver).
        for _ in 0..100_000 {
            if PROBE_STATE.load(Ordering::Acquire) == LOADED {
                break;
            }
            std::thread::yield_now();
        }
    }
    PROBE_STATE.load(Ordering::Acquire) == LOADED
}

/// What the driver's `cuGetProcAddress` named variant `f` with, when it does not export `f`
/// itself (NULL if it did not, or the table is not probed yet).
fn probed_for(f: F) -> *mut c_void {
    if PROBE_STATE.load(Ordering::Acquire) != LOADED {
        return std::ptr::null_mut();
    }
    PROC_NAMES
        .iter()
        .zip(PROBED.iter())
        .filter(|((g, ..), _)| *g == f)
        .map(|(_, p)| p.load(Ordering::Acquire))
        .find(|p| !p.is_null())
        .unwrap_or(std::ptr::null_mut())
}

/// The hook to hand out for `cuGetProcAddress(name, version, flags)` when the driver answered
/// `p`, or `None` when `p` is no variant the shim hooks (it is then returned unchanged).
///
/// The entries whose exported symbol or probed answer is `p` are the candidates. One variant
/// among them: that one (the driver's own choice, whatever name it was asked for). Several: the
/// driver hands this entry point out for several variants (it ignores the version, or exports
/// aliases), so its ABI cannot be told from the pointer; the caller's request decides, as a
/// version-aware driver would: among the candidates named `name`, the newest at or below
/// `version`, the per-thread variant only when `flags` asks for it. The exported symbols are
/// resolved and the table probed before any of this, so the answer does not depend on which
/// lookups came first.
pub fn hook_for_proc(name: &[u8], version: c_int, flags: u64, p: *mut c_void) -> Option<F> {
    if p.is_null() || !ensure_cuda() {
        return None;
    }
    let probed = ensure_probed();
    let is_candidate = |i: usize| {
        let f = PROC_NAMES[i].0;
        REAL[f as usize].load(Ordering::Acquire) == p
            || (probed && PROBED[i].load(Ordering::Acquire) == p)
    };
    // Exported symbols that are not in the table (none today) still map by identity.
    let by_symbol = REAL
        .iter()
        .position(|r| r.load(Ordering::Acquire) == p)
        .map(|i| ALL[i]);
    let Some(first) = (0..PROC_NAMES.len()).find(|&i| is_candidate(i)) else {
        return by_symbol;
    };
    let first_f = PROC_NAMES[first].0;
    if (0..PROC_NAMES.len())
        .filter(|&i| is_candidate(i))
        .all(|i| PROC_NAMES[i].0 == first_f)
    {
        return Some(first_f);
    }
    let per_thread = flags & PER_THREAD_DEFAULT_STREAM != 0;
    (0..PROC_NAMES.len())
        .filter(|&i| is_candidate(i) && PROC_NAMES[i].1.to_bytes() == name)
        .max_by_key(|&i| {
            let (_, _, since, pt) = PROC_NAMES[i];
            let fits = since <= version;
            (fits, pt == per_thread, if fits { since } else { -since })
        })
        .map(|i| PROC_NAMES[i].0)
        .or(Some(first_f))
}

/// The real device of the calling thread's current context.
pub fn current_device() -> Option<usize> {
    let p = aux(Aux::cuCtxGetDevice);
    if p.is_null() {
        return None;
    }
    let mut dev: c_int = -1;
    // SAFETY: `cuCtxGetDevice(CUdevice*)`.
    let r = unsafe {
        let f: unsafe extern "C" fn(*mut c_int) -> c_int = std::mem::transmute(p);
        f(&mut dev)
    };
    (r == 0 && (0..vgpu_region::MAX_DEVICES as c_int).contains(&dev)).then_some(dev as usize)
}

/// The device of `stream`'s context (`cuStreamGetCtx`, then that context made current for one
/// `cuCtxGetDevice`); the current context's device for the NULL stream, the special stream
/// handles, or when the driver cannot say.
pub fn stream_device(stream: *mut c_void) -> Option<usize> {
    // CU_STREAM_LEGACY and CU_STREAM_PER_THREAD: the current context's streams.
    if (stream as usize) <= 2 {
        return current_device();
    }
    let (get_ctx, push, pop) = (
        aux(Aux::cuStreamGetCtx),
        aux(Aux::cuCtxPushCurrent_v2),
        aux(Aux::cuCtxPopCurrent_v2),
    );
    if get_ctx.is_null() || push.is_null() || pop.is_null() {
        return current_device();
    }
    let mut ctx: *mut c_void = std::ptr::null_mut();
    // SAFETY: `cuStreamGetCtx(CUstream, CUcontext*)`, `cuCtxPushCurrent_v2(CUcontext)`,
    // `cuCtxPopCurrent_v2(CUcontext*)`; the push is undone before returning.
    unsafe {
        let get_ctx: unsafe extern "C" fn(*mut c_void, *mut *mut c_void) -> c_int =
            std::mem::transmute(get_ctx);
        if get_ctx(stream, &mut ctx) != 0 || ctx.is_null() {
            return current_device();
        }
        let push: unsafe extern "C" fn(*mut c_void) -> c_int = std::mem::transmute(push);
        if push(ctx) != 0 {
            return current_device();
        }
        let dev = current_device();
        let pop: unsafe extern "C" fn(*mut *mut c_void) -> c_int = std::mem::transmute(pop);
        let mut popped: *mut c_void = std::ptr::null_mut();
        pop(&mut popped);
        dev
    }
}

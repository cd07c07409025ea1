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
    nvmlDeviceGetMemoryInfo,
    nvmlDeviceGetMemoryInfo_v2,
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
    nvmlInit_v2,
    nvmlDeviceGetIndex,
    nvmlDeviceGetHandleByIndex_v2,
    nvmlDeviceGetProcessUtilization,
    nvmlDeviceGetUtilizationRates,
}
const AUX_NAMES: &[&str] = &[
    "cuCtxGetDevice\0",
    "cuDeviceGetCount\0",
    "cuDeviceGetUuid_v2\0",
    "cuDeviceGetMemPool\0",
    "cuMemPoolGetAttribute\0",
    "nvmlInit_v2\0",
    "nvmlDeviceGetIndex\0",
    "nvmlDeviceGetHandleByIndex_v2\0",
    "nvmlDeviceGetProcessUtilization\0",
    "nvmlDeviceGetUtilizationRates\0",
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

/// The real function behind hook `f` (NULL if the driver lacks it or is not loaded).
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
    if loaded {
        REAL[f as usize].load(Ordering::Acquire)
    } else {
        std::ptr::null_mut()
    }
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

/// How `cuGetProcAddress` names each hooked symbol: (API name, the CUDA version that
/// introduced this variant, per-thread-default-stream variant).
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
];

/// What the driver's `cuGetProcAddress` returns for each hooked symbol. A driver may hand out
/// internal entry points that differ from its exported symbols; asking it once for each hooked
/// variant (at the version that introduced it) lets the substitution recognise those too.
static PROBED: [AtomicPtr<c_void>; N] = [const { AtomicPtr::new(std::ptr::null_mut()) }; N];
static PROBE_STATE: AtomicU8 = AtomicU8::new(UNLOADED);

const PER_THREAD_DEFAULT_STREAM: u64 = 2;

fn probe_driver_table() {
    if PROBE_STATE
        .compare_exchange(UNLOADED, LOADING, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        return;
    }
    let v2 = get(F::cuGetProcAddress_v2);
    let v1 = get(F::cuGetProcAddress);
    for &(f, api, since, per_thread) in PROC_NAMES {
        let flags = if per_thread {
            PER_THREAD_DEFAULT_STREAM
        } else {
            0
        };
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
                g(api.as_ptr(), &mut p, since, flags, &mut status)
            }
        } else if !v1.is_null() {
            // SAFETY: the driver's cuGetProcAddress(name, void**, int, cuuint64_t).
            unsafe {
                let g: unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64) -> c_int =
                    std::mem::transmute(v1);
                g(api.as_ptr(), &mut p, since, flags)
            }
        } else {
            -1
        };
        crate::log::write(
            crate::log::INFO + 1,
            &format!("probe {api:?}@{since} flags {flags}: {r} {p:?}"),
        );
        // A per-thread request for an API without such a variant returns the legacy one;
        // record it only when it differs from that, so it maps to the right wrapper.
        if r == 0 && !p.is_null() && !PROBED.iter().any(|q| q.load(Ordering::Relaxed) == p) {
            PROBED[f as usize].store(p, Ordering::Release);
        }
    }
    PROBE_STATE.store(LOADED, Ordering::Release);
}

/// The hook to hand out for `cuGetProcAddress(name, version, flags)` that returned `p`.
///
/// For a name the shim hooks in several variants (`cuMemGetInfo` and `cuMemGetInfo_v2`, `_ptsz`),
/// the variant is the one the requested version selects: the newest whose version is at most
/// the requested one, per-thread when `flags` ask for it. Pointer identity ([`hook_for_real`])
/// only picks between those two candidates (the driver decides per-thread or legacy stream),
/// never an older ABI: a driver that returns the same entry point for every version would
/// otherwise get the 32-bit wrappers, depending on which symbols happened to be resolved first.
pub fn hook_for_request(name: &[u8], version: c_int, flags: u64, p: *mut c_void) -> Option<F> {
    let newest = |per_thread: bool| {
        PROC_NAMES
            .iter()
            .filter(|&&(_, api, since, pt)| {
                api.to_bytes() == name && pt == per_thread && since <= version
            })
            .max_by_key(|&&(_, _, since, _)| since)
            .map(|&(f, _, _, _)| f)
    };
    let (plain, per_thread) = (newest(false), newest(true));
    if plain.is_none() && per_thread.is_none() {
        return hook_for_real(p);
    }
    match hook_for_real(p) {
        Some(f) if Some(f) == plain || Some(f) == per_thread => Some(f),
        _ if flags & PER_THREAD_DEFAULT_STREAM != 0 => per_thread.or(plain),
        _ => plain.or(per_thread),
    }
}

/// The hook whose real function is `p`: by identity with the exported symbol, else with what
/// the driver's `cuGetProcAddress` returned for that variant.
pub fn hook_for_real(p: *mut c_void) -> Option<F> {
    if p.is_null() {
        return None;
    }
    if let Some(i) = REAL.iter().position(|r| r.load(Ordering::Acquire) == p) {
        return Some(ALL[i]);
    }
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
    PROBED
        .iter()
        .position(|r| r.load(Ordering::Acquire) == p)
        .map(|i| ALL[i])
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

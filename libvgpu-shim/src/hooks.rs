//! The exported entry points. Each one catches panics (a panic never crosses the C boundary:
//! the call returns an error and the shim degrades to pass-through, said once on stderr).

use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::real::{self, F};
use crate::{limiter, log, region, watcher};

pub type CUresult = c_int;
pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
pub const CUDA_ERROR_NOT_FOUND: CUresult = 500;
pub const CUDA_ERROR_UNKNOWN: CUresult = 999;
const NVML_ERROR_UNKNOWN: c_uint = 999;
use crate::nvml_api::{NVML_ERROR_FUNCTION_NOT_FOUND, NVML_SUCCESS};

/// Set after an internal failure: from then on every hook only forwards.
static DEGRADED: AtomicBool = AtomicBool::new(false);

fn degrade(what: &str) {
    if !DEGRADED.swap(true, Ordering::AcqRel) {
        log::error!(
            "internal error in {what}; limits are off for this process, calls pass through"
        );
    }
}

#[inline]
fn degraded() -> bool {
    DEGRADED.load(Ordering::Relaxed)
}

/// Runs a hook body; a panic becomes `on_panic` and degrades the shim.
#[inline]
fn guarded<R>(what: &str, on_panic: R, f: impl FnOnce() -> R) -> R {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(_) => {
            degrade(what);
            on_panic
        }
    }
}

/// Calls the real function of hook `$f` with type `$ty`, or returns `CUDA_ERROR_NOT_FOUND` if
/// the driver lacks it.
macro_rules! real_call {
    ($f:ident : $ty:ty, $($arg:expr),* $(,)?) => {{
        let p = real::get(F::$f);
        if p.is_null() {
            CUDA_ERROR_NOT_FOUND
        } else {
            // SAFETY: `p` is the driver's `$f`, whose C signature is `$ty`.
            unsafe { std::mem::transmute::<*mut c_void, $ty>(p)($($arg),*) }
        }
    }};
}

// ---------------------------------------------------------------- the region

/// The shared region, attached on first use, with this process's watcher thread running. The
/// entry points start the watcher, not `region`: the watcher reads the region, so the region
/// starting it would make the two modules depend on each other. Every use of the region by a
/// hook goes through here, so the watcher starts with the first one, as the region is attached,
/// and a forked child (which has no watcher thread) starts its own on its first such call.
fn region_with_watcher() -> &'static region::Region {
    let r = region::get();
    watcher::start();
    r
}

// ---------------------------------------------------------------- allocation tracking

/// The pointer or handle a driver call returned through `out`, or 0 when the call failed.
///
/// # Safety
/// `out` must be readable whenever `r` is `CUDA_SUCCESS` (the driver wrote it).
unsafe fn written(r: CUresult, out: *const u64) -> (CUresult, u64) {
    // SAFETY: the caller's contract.
    (
        r,
        if r == CUDA_SUCCESS {
            unsafe { *out }
        } else {
            0
        },
    )
}

/// A multiplicative hash for pointer and handle keys (SipHash costs ~100 ns per alloc/free
/// pair here; keys are addresses, not attacker-chosen strings).
#[derive(Default, Clone, Copy)]
struct KeyHasher(u64);

impl std::hash::Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(5) ^ b as u64).wrapping_mul(0x517c_c1b7_2722_0a95);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (v ^ (v >> 29)).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

type KeyMap = HashMap<u64, (usize, u64), std::hash::BuildHasherDefault<KeyHasher>>;

#[derive(Default)]
struct Tracker {
    /// Device pointers → (region device, bytes charged).
    ptrs: KeyMap,
    /// VMM allocation handles.
    handles: KeyMap,
    /// CUDA arrays.
    arrays: KeyMap,
    /// Loaded modules and libraries (`CUmodule` / `CUlibrary`) → (device, bytes measured),
    /// charged to the slot's `module_size`.
    modules: KeyMap,
    /// Memory-pool bookkeeping (`pools.rs`).
    pools: pools::PoolTracker,
    /// Graph memory nodes (`graphs.rs`).
    graphs: graphs::GraphTracker,
    /// Device pointers served from host memory (`host_backed.rs`).
    host: host_backed::HostMap,
    /// Context limits (`modules.rs`): (device << 32 | limit) → (device, bytes measured).
    context_limits: KeyMap,
}

static TRACKER: Mutex<Option<Tracker>> = Mutex::new(None);

thread_local! {
    /// The tracker's lock, held by the forking thread from `pthread_atfork`'s prepare handler
    /// until the parent and child handlers (so no child inherits it locked by another thread).
    static FORK_GUARD: std::cell::RefCell<Option<std::sync::MutexGuard<'static, Option<Tracker>>>> =
        const { std::cell::RefCell::new(None) };
}

/// `pthread_atfork` prepare: take the tracker's lock.
pub fn fork_prepare() {
    let g = TRACKER.lock().unwrap_or_else(|e| e.into_inner());
    let _ = FORK_GUARD.try_with(|slot| *slot.borrow_mut() = Some(g));
}

/// `pthread_atfork` parent: give the lock back.
pub fn fork_parent() {
    let _ = FORK_GUARD.try_with(|slot| slot.borrow_mut().take());
}

/// `pthread_atfork` child: the parent's allocations are the parent's (its slot is charged for
/// them), so the child forgets them: freeing one in the child is forwarded, not uncounted from
/// the child's own slot.
pub fn fork_child() {
    let held = FORK_GUARD
        .try_with(|slot| slot.borrow_mut().take())
        .ok()
        .flatten();
    // Without the prepared guard, `try_lock`: a lock another (now gone) thread held stays as is.
    let guard = held.or_else(|| match TRACKER.try_lock() {
        Ok(g) => Some(g),
        Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    });
    if let Some(mut g) = guard {
        *g = None;
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Ptr,
    Handle,
    Array,
    Module,
    /// What the driver reserves for a context limit (`cuCtxSetLimit`), keyed by device and limit.
    ContextLimit,
}

impl Kind {
    /// The slot's breakdown field this kind is charged to (`total` is charged as well).
    fn field(self) -> usize {
        match self {
            Kind::Module => vgpu_region::slot::MEM_MODULE_SIZE,
            Kind::ContextLimit => vgpu_region::slot::MEM_CONTEXT_SIZE,
            _ => vgpu_region::slot::MEM_DATA_SIZE,
        }
    }
}

/// Runs `f` on the tracker (created on first use). Never call the region or the driver inside:
/// `fork`'s prepare handler takes the region's locks before this one.
fn with_tracker<R>(f: impl FnOnce(&mut Tracker) -> R) -> R {
    let mut t = TRACKER.lock().unwrap_or_else(|e| e.into_inner());
    f(t.get_or_insert_with(Tracker::default))
}

fn map_of(t: &mut Tracker, kind: Kind) -> &mut KeyMap {
    match kind {
        Kind::Ptr => &mut t.ptrs,
        Kind::Handle => &mut t.handles,
        Kind::Array => &mut t.arrays,
        Kind::Module => &mut t.modules,
        Kind::ContextLimit => &mut t.context_limits,
    }
}

fn track(kind: Kind, key: u64, dev: usize, bytes: u64) {
    with_tracker(|t| map_of(t, kind).insert(key, (dev, bytes)));
}

fn untrack(kind: Kind, key: u64) -> Option<(usize, u64)> {
    let mut t = TRACKER.lock().unwrap_or_else(|e| e.into_inner());
    let t = t.as_mut()?;
    if matches!(kind, Kind::Ptr) {
        t.pools.forget_ptr(key);
    }
    map_of(t, kind).remove(&key)
}

/// Check-and-add of `bytes` on `dev` into `kind`'s field; when it does not fit, the charges
/// for memory this process's pools retain are brought up to date with the driver (they may
/// have shrunk) and the check is made once more.
fn reserve(region: &region::Region, dev: usize, kind: Kind, bytes: u64) -> Result<(), ()> {
    region.reserve_as(dev, kind.field(), bytes).or_else(|()| {
        if pools::reconcile_all() | graphs::reconcile_all() {
            region.reserve_as(dev, kind.field(), bytes)
        } else {
            Err(())
        }
    })
}

/// Reserve, allocate, record; on failure of the real call the reservation is returned.
/// `alloc` performs the real call and yields the key of the new object.
fn counted(
    kind: Kind,
    dev: Option<usize>,
    bytes: u64,
    alloc: impl FnOnce() -> (CUresult, u64),
) -> CUresult {
    let Some(dev) = dev else {
        // No current context: the driver will fail or allocate nothing we can attribute.
        return alloc().0;
    };
    let region = region_with_watcher();
    if reserve(region, dev, kind, bytes).is_err() {
        log::info!(
            "device {dev}: OOM, {bytes} bytes requested, {} of {} in use",
            region.usage(dev),
            region.limit(dev)
        );
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    let (r, key) = alloc();
    if r == CUDA_SUCCESS {
        track(kind, key, dev, bytes);
    } else {
        region.release_as(dev, kind.field(), bytes);
    }
    r
}

fn uncount(kind: Kind, key: u64) {
    if let Some((dev, bytes)) = untrack(kind, key) {
        region_with_watcher().release_as(dev, kind.field(), bytes);
    }
}

/// The driver's auxiliary entry point `a` as the function type `T`, or `None` when the driver
/// lacks it. `T` must be `a`'s C signature (each caller names it).
fn aux_fn<T: Copy>(a: real::Aux) -> Option<T> {
    let p = real::aux(a);
    // SAFETY: the caller's `T` is the C signature of the driver's `a`; a function pointer has
    // the size of `*mut c_void`.
    (!p.is_null()).then(|| unsafe { std::mem::transmute_copy::<*mut c_void, T>(&p) })
}

/// A lock between the threads of one process that a `fork` cannot leave held: it stores the
/// holder's pid, and a pid other than ours is a lock inherited from a thread that does not
/// exist in this process, taken over. Waiters sleep (the sections it guards call the driver).
pub(crate) struct PidLock(std::sync::atomic::AtomicI32);

pub(crate) struct PidGuard(&'static PidLock);

impl PidLock {
    pub(crate) const fn new() -> PidLock {
        PidLock(std::sync::atomic::AtomicI32::new(0))
    }

    pub(crate) fn lock(&'static self) -> PidGuard {
        loop {
            let me = region::my_pid();
            match self
                .0
                .compare_exchange(0, me, Ordering::Acquire, Ordering::Relaxed)
            {
                Ok(_) => return PidGuard(self),
                Err(holder)
                    if holder != me
                        && self
                            .0
                            .compare_exchange(holder, me, Ordering::Acquire, Ordering::Relaxed)
                            .is_ok() =>
                {
                    return PidGuard(self);
                }
                Err(_) => std::thread::sleep(std::time::Duration::from_micros(200)),
            }
        }
    }
}

impl Drop for PidGuard {
    fn drop(&mut self) {
        self.0.0.store(0, Ordering::Release);
    }
}

mod graphs;
mod host_backed;
mod launch;
mod legacy;
mod modules;
mod nvml;
mod pools;
pub use graphs::*;
pub use launch::*;
pub use legacy::*;
pub use modules::*;
pub use nvml::*;
pub use pools::*;

// ---------------------------------------------------------------- init and symbol lookup

#[unsafe(no_mangle)]
pub extern "C" fn cuInit(flags: c_uint) -> CUresult {
    guarded("cuInit", CUDA_ERROR_UNKNOWN, || {
        let r = real_call!(cuInit: unsafe extern "C" fn(c_uint) -> CUresult, flags);
        if r == CUDA_SUCCESS && !degraded() {
            let region = region_with_watcher();
            region.register();
            let p = real::aux(real::Aux::cuDeviceGetCount);
            if !p.is_null() {
                let mut n: c_int = 0;
                // SAFETY: `cuDeviceGetCount(int*)`.
                let ok = unsafe {
                    std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*mut c_int) -> CUresult>(
                        p,
                    )(&mut n)
                };
                if ok == CUDA_SUCCESS {
                    region.set_device_num(n.max(0) as u64);
                    write_uuids(region, n.clamp(0, vgpu_region::MAX_DEVICES as c_int));
                }
            }
        }
        r
    })
}

/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, the form NVML and HAMi's monitor use.
pub fn format_uuid(b: &[u8; 16]) -> String {
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// Records each visible device's UUID in the region (HAMi-core does it from NVML at `nvmlInit`).
fn write_uuids(region: &region::Region, count: c_int) {
    let p = real::aux(real::Aux::cuDeviceGetUuid_v2);
    if p.is_null() {
        return;
    }
    // SAFETY: `cuDeviceGetUuid_v2(CUuuid*, CUdevice)`, CUuuid being 16 bytes.
    let get = unsafe {
        std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*mut [u8; 16], c_int) -> CUresult>(
            p,
        )
    };
    for dev in 0..count {
        let mut raw = [0u8; 16];
        // SAFETY: valid 16-byte out buffer.
        if unsafe { get(&mut raw, dev) } == CUDA_SUCCESS {
            region.set_uuid(dev as usize, &format_uuid(&raw));
        }
    }
}

type GetProcAddressV1 =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64) -> CUresult;
type GetProcAddressV2 =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> CUresult;

/// Swaps the driver's answer to `cuGetProcAddress(symbol, …, cuda_version, flags)` for the
/// wrapper of the same variant (`_vN` / `_ptsz`), so the caller gets the ABI it asked for,
/// wrapped; see [`real::hook_for_proc`] for how the variant is told.
unsafe fn substitute(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: u64,
) {
    if pfn.is_null() || symbol.is_null() || degraded() {
        return;
    }
    // SAFETY: the caller's NUL-terminated name (the driver just read it) and out-pointer, just
    // written by the driver.
    let (name, p) = unsafe { (CStr::from_ptr(symbol).to_bytes(), *pfn) };
    if let Some(f) = real::hook_for_proc(name, cuda_version, flags, p) {
        // SAFETY: as above.
        unsafe { *pfn = real::wrapper(f) };
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: u64,
) -> CUresult {
    guarded("cuGetProcAddress", CUDA_ERROR_UNKNOWN, || {
        let r = real_call!(cuGetProcAddress: GetProcAddressV1, symbol, pfn, cuda_version, flags);
        if r == CUDA_SUCCESS {
            // SAFETY: `pfn` was written by the driver.
            unsafe { substitute(symbol, pfn, cuda_version, flags) };
        }
        r
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: u64,
    status: *mut c_int,
) -> CUresult {
    guarded("cuGetProcAddress_v2", CUDA_ERROR_UNKNOWN, || {
        let r = real_call!(cuGetProcAddress_v2: GetProcAddressV2, symbol, pfn, cuda_version, flags, status);
        if r == CUDA_SUCCESS {
            // SAFETY: `pfn` was written by the driver.
            unsafe { substitute(symbol, pfn, cuda_version, flags) };
        }
        r
    })
}

/// `dlsym`: RTLD_NEXT requests jump straight to the real `dlsym` with the caller's return
/// address intact (so "next" stays relative to the caller); other requests go to
/// [`dlsym_impl`].
#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlsym(_handle: *mut c_void, _symbol: *const c_char) -> *mut c_void {
    core::arch::naked_asm!(
        "cmp rdi, -1",
        "jne 2f",
        "mov rax, qword ptr [rip + {real}]",
        "test rax, rax",
        "je 2f",
        "jmp rax",
        "2:",
        "jmp {imp}",
        real = sym crate::real::REAL_DLSYM,
        imp = sym dlsym_impl,
    )
}

#[cfg(target_arch = "aarch64")]
#[unsafe(naked)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlsym(_handle: *mut c_void, _symbol: *const c_char) -> *mut c_void {
    core::arch::naked_asm!(
        "cmn x0, #1",
        "b.ne 2f",
        "adrp x16, {real}",
        "ldr x16, [x16, :lo12:{real}]",
        "cbz x16, 2f",
        "br x16",
        "2:",
        "b {imp}",
        real = sym crate::real::REAL_DLSYM,
        imp = sym dlsym_impl,
    )
}

/// The body of `dlsym` for every handle but RTLD_NEXT (and for RTLD_NEXT before the real
/// `dlsym` is known, where "next" becomes relative to the shim: the best available).
///
/// A hooked name is answered with the wrapper only if the real lookup on the caller's handle
/// found the symbol, so feature probes still see what the driver really has.
unsafe extern "C" fn dlsym_impl(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    // SAFETY: forwarding the caller's arguments.
    let found = unsafe { real::real_dlsym(handle, symbol) };
    if found.is_null() || symbol.is_null() || degraded() {
        return found;
    }
    // SAFETY: the caller passes a NUL-terminated name (dlsym's contract).
    let name = unsafe { CStr::from_ptr(symbol) }.to_bytes();
    if !(name.starts_with(b"cu") || name.starts_with(b"nvml")) {
        return found;
    }
    match real::hook_for(name) {
        Some(f) => real::wrapper(f),
        None => found,
    }
}

// ---------------------------------------------------------------- allocations

type Stream = *mut c_void;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut u64, bytes: usize) -> CUresult {
    guarded("cuMemAlloc_v2", CUDA_ERROR_UNKNOWN, || {
        let call = || {
            let r = real_call!(cuMemAlloc_v2: unsafe extern "C" fn(*mut u64, usize) -> CUresult, dptr, bytes);
            // SAFETY: the driver wrote `*dptr` if it succeeded.
            unsafe { written(r, dptr) }
        };
        if degraded() || dptr.is_null() || bytes == 0 {
            return call().0;
        }
        let dev = real::current_device();
        let r = counted(Kind::Ptr, dev, bytes as u64, call);
        // Past the device share (or when the card is full), an oversubscribed container's
        // allocation comes from host memory; otherwise the OOM stands.
        match (r, dev) {
            (CUDA_ERROR_OUT_OF_MEMORY, Some(dev)) => {
                host_backed::alloc(dptr, bytes as u64, dev).unwrap_or(r)
            }
            _ => r,
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocManaged(
    dptr: *mut u64,
    bytes: usize,
    flags: c_uint,
) -> CUresult {
    guarded("cuMemAllocManaged", CUDA_ERROR_UNKNOWN, || {
        let call = || {
            let r = real_call!(cuMemAllocManaged: unsafe extern "C" fn(*mut u64, usize, c_uint) -> CUresult, dptr, bytes, flags);
            // SAFETY: the driver wrote `*dptr` if it succeeded.
            unsafe { written(r, dptr) }
        };
        if degraded() || dptr.is_null() || bytes == 0 {
            return call().0;
        }
        counted(Kind::Ptr, real::current_device(), bytes as u64, call)
    })
}

/// Pitched allocations are charged the real `pitch × height`, known only after the call: the
/// shim allocates, then reserves, and frees again if the reservation fails.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    dptr: *mut u64,
    pitch: *mut usize,
    width: usize,
    height: usize,
    element_size: c_uint,
) -> CUresult {
    guarded("cuMemAllocPitch_v2", CUDA_ERROR_UNKNOWN, || {
        let r = real_call!(
            cuMemAllocPitch_v2: unsafe extern "C" fn(*mut u64, *mut usize, usize, usize, c_uint) -> CUresult,
            dptr, pitch, width, height, element_size
        );
        if r != CUDA_SUCCESS || degraded() || dptr.is_null() || pitch.is_null() {
            return r;
        }
        let Some(dev) = real::current_device() else {
            return r;
        };
        // SAFETY: written by the driver on success.
        let (ptr, p) = unsafe { (*dptr, *pitch) };
        let bytes = (p as u64).saturating_mul(height as u64);
        if region_with_watcher().reserve(dev, bytes).is_err() {
            real_call!(cuMemFree_v2: unsafe extern "C" fn(u64) -> CUresult, ptr);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        track(Kind::Ptr, ptr, dev, bytes);
        r
    })
}

/// Frees are always forwarded, tracked or not (HAMi-core returned -1 for untracked pointers and
/// leaked them).
#[unsafe(no_mangle)]
pub extern "C" fn cuMemFree_v2(dptr: u64) -> CUresult {
    guarded("cuMemFree_v2", CUDA_ERROR_UNKNOWN, || {
        if dptr != 0
            && !degraded()
            && let Some(r) = host_backed::free(dptr, None)
        {
            return r;
        }
        let r = real_call!(cuMemFree_v2: unsafe extern "C" fn(u64) -> CUresult, dptr);
        if r == CUDA_SUCCESS && dptr != 0 && !degraded() {
            uncount(Kind::Ptr, dptr);
            graphs::freed(dptr);
        }
        r
    })
}

macro_rules! alloc_async {
    ($name:ident) => {
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(dptr: *mut u64, bytes: usize, stream: Stream) -> CUresult {
            guarded(stringify!($name), CUDA_ERROR_UNKNOWN, || {
                let call = || {
                    let r = real_call!($name: unsafe extern "C" fn(*mut u64, usize, Stream) -> CUresult, dptr, bytes, stream);
                    // SAFETY: the driver wrote `*dptr` if it succeeded.
                    unsafe { written(r, dptr) }
                };
                if degraded() || dptr.is_null() || bytes == 0 || graphs::capturing(stream) {
                    return call().0;
                }
                pools::pool_alloc(None, bytes as u64, call)
            })
        }
    };
}
alloc_async!(cuMemAllocAsync);
alloc_async!(cuMemAllocAsync_ptsz);

macro_rules! alloc_from_pool {
    ($name:ident) => {
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(dptr: *mut u64, bytes: usize, pool: *mut c_void, stream: Stream) -> CUresult {
            guarded(stringify!($name), CUDA_ERROR_UNKNOWN, || {
                let call = || {
                    let r = real_call!($name: unsafe extern "C" fn(*mut u64, usize, *mut c_void, Stream) -> CUresult, dptr, bytes, pool, stream);
                    // SAFETY: the driver wrote `*dptr` if it succeeded.
                    unsafe { written(r, dptr) }
                };
                if degraded() || dptr.is_null() || bytes == 0 || graphs::capturing(stream) {
                    return call().0;
                }
                pools::pool_alloc(Some(pool as u64), bytes as u64, call)
            })
        }
    };
}
alloc_from_pool!(cuMemAllocFromPoolAsync);
alloc_from_pool!(cuMemAllocFromPoolAsync_ptsz);

macro_rules! free_async {
    ($name:ident) => {
        #[unsafe(no_mangle)]
        pub extern "C" fn $name(dptr: u64, stream: Stream) -> CUresult {
            guarded(stringify!($name), CUDA_ERROR_UNKNOWN, || {
                // A free on a stream being captured is a node of the graph, not a free now.
                let counted = dptr != 0 && !degraded() && !graphs::capturing(stream);
                if counted && let Some(r) = host_backed::free(dptr, Some(stream)) {
                    return r;
                }
                let r = real_call!($name: unsafe extern "C" fn(u64, Stream) -> CUresult, dptr, stream);
                if r == CUDA_SUCCESS && counted {
                    pools::pool_free(dptr);
                    graphs::freed(dptr);
                }
                r
            })
        }
    };
}
free_async!(cuMemFreeAsync);
free_async!(cuMemFreeAsync_ptsz);

/// `CUmemAllocationProp` up to the location (type at byte 8, id at byte 12).
#[repr(C)]
pub struct MemAllocationPropHead {
    pub kind: c_int,
    pub requested_handle_types: c_int,
    pub location_type: c_int,
    pub location_id: c_int,
}
const CU_MEM_LOCATION_TYPE_DEVICE: c_int = 1;

/// VMM physical memory: charged to the device named in the properties (not the current
/// context's, which may not exist on NCCL's threads), keyed by the allocation handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut u64,
    bytes: usize,
    prop: *const MemAllocationPropHead,
    flags: u64,
) -> CUresult {
    guarded("cuMemCreate", CUDA_ERROR_UNKNOWN, || {
        let call = || {
            let r = real_call!(
                cuMemCreate: unsafe extern "C" fn(*mut u64, usize, *const MemAllocationPropHead, u64) -> CUresult,
                handle, bytes, prop, flags
            );
            // SAFETY: the driver wrote `*handle` if it succeeded.
            unsafe { written(r, handle) }
        };
        if degraded() || handle.is_null() || prop.is_null() || bytes == 0 {
            return call().0;
        }
        // SAFETY: checked non-null; the caller's struct starts with these fields.
        let (lt, id) = unsafe { ((*prop).location_type, (*prop).location_id) };
        let dev = (lt == CU_MEM_LOCATION_TYPE_DEVICE
            && (0..vgpu_region::MAX_DEVICES as c_int).contains(&id))
        .then_some(id as usize);
        counted(Kind::Handle, dev, bytes as u64, call)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemRelease(handle: u64) -> CUresult {
    guarded("cuMemRelease", CUDA_ERROR_UNKNOWN, || {
        let r = real_call!(cuMemRelease: unsafe extern "C" fn(u64) -> CUresult, handle);
        if r == CUDA_SUCCESS && !degraded() {
            uncount(Kind::Handle, handle);
        }
        r
    })
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

/// Bytes of an array: width × height × depth × channels × element size (unknown formats count
/// 4 bytes, the widest basic format, so the estimate errs on the safe side).
pub fn array_bytes(w: usize, h: usize, d: usize, format: c_int, channels: c_uint) -> u64 {
    let elem: u64 = match format {
        0x01 | 0x08 => 1,
        0x02 | 0x09 | 0x10 => 2,
        _ => 4,
    };
    (w as u64)
        .saturating_mul(h.max(1) as u64)
        .saturating_mul(d.max(1) as u64)
        .saturating_mul(elem)
        .saturating_mul(channels.max(1) as u64)
}

/// Bytes of a mipmapped array: the sum over its levels, each present dimension halved per level
/// and never below 1. Levels past 64 cannot shrink anything further and no driver accepts them;
/// they are not counted (the driver refuses the call anyway).
pub fn mipmapped_array_bytes(d: &Array3dDescriptor, levels: c_uint) -> u64 {
    (0..levels.clamp(1, 64))
        .map(|level| {
            let at_level = |x: usize| if x == 0 { 0 } else { (x >> level).max(1) };
            array_bytes(
                at_level(d.width),
                at_level(d.height),
                at_level(d.depth),
                d.format,
                d.num_channels,
            )
        })
        .fold(0, u64::saturating_add)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayCreate_v2(arr: *mut u64, desc: *const ArrayDescriptor) -> CUresult {
    guarded("cuArrayCreate_v2", CUDA_ERROR_UNKNOWN, || {
        let call = || {
            let r = real_call!(cuArrayCreate_v2: unsafe extern "C" fn(*mut u64, *const ArrayDescriptor) -> CUresult, arr, desc);
            // SAFETY: the driver wrote `*arr` if it succeeded.
            unsafe { written(r, arr) }
        };
        if degraded() || arr.is_null() || desc.is_null() {
            return call().0;
        }
        // SAFETY: checked non-null.
        let d = unsafe { &*desc };
        let bytes = array_bytes(d.width, d.height, 1, d.format, d.num_channels);
        counted(Kind::Array, real::current_device(), bytes, call)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArray3DCreate_v2(
    arr: *mut u64,
    desc: *const Array3dDescriptor,
) -> CUresult {
    guarded("cuArray3DCreate_v2", CUDA_ERROR_UNKNOWN, || {
        let call = || {
            let r = real_call!(cuArray3DCreate_v2: unsafe extern "C" fn(*mut u64, *const Array3dDescriptor) -> CUresult, arr, desc);
            // SAFETY: the driver wrote `*arr` if it succeeded.
            unsafe { written(r, arr) }
        };
        if degraded() || arr.is_null() || desc.is_null() {
            return call().0;
        }
        // SAFETY: checked non-null.
        let d = unsafe { &*desc };
        let bytes = array_bytes(d.width, d.height, d.depth, d.format, d.num_channels);
        counted(Kind::Array, real::current_device(), bytes, call)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuArrayDestroy(arr: u64) -> CUresult {
    guarded("cuArrayDestroy", CUDA_ERROR_UNKNOWN, || {
        let r = real_call!(cuArrayDestroy: unsafe extern "C" fn(u64) -> CUresult, arr);
        if r == CUDA_SUCCESS && !degraded() {
            uncount(Kind::Array, arr);
        }
        r
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMipmappedArrayCreate(
    handle: *mut u64,
    desc: *const Array3dDescriptor,
    levels: c_uint,
) -> CUresult {
    guarded("cuMipmappedArrayCreate", CUDA_ERROR_UNKNOWN, || {
        let call = || {
            let r = real_call!(cuMipmappedArrayCreate: unsafe extern "C" fn(*mut u64, *const Array3dDescriptor, c_uint) -> CUresult, handle, desc, levels);
            // SAFETY: the driver wrote `*handle` if it succeeded.
            unsafe { written(r, handle) }
        };
        if degraded() || handle.is_null() || desc.is_null() {
            return call().0;
        }
        // SAFETY: checked non-null.
        let bytes = mipmapped_array_bytes(unsafe { &*desc }, levels);
        counted(Kind::Array, real::current_device(), bytes, call)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMipmappedArrayDestroy(handle: u64) -> CUresult {
    guarded("cuMipmappedArrayDestroy", CUDA_ERROR_UNKNOWN, || {
        let r = real_call!(cuMipmappedArrayDestroy: unsafe extern "C" fn(u64) -> CUresult, handle);
        if r == CUDA_SUCCESS && !degraded() {
            uncount(Kind::Array, handle);
        }
        r
    })
}

/// How much of its memory limit a container has on a device, as `cuMemGetInfo` and NVML show
/// it: the limit, whether past the device share host memory serves allocations
/// (oversubscription), and what is in use (device and host memory together).
#[derive(Debug, Clone, Copy)]
pub struct MemoryBooking {
    pub limit: u64,
    pub oversubscribed: bool,
    pub in_use: u64,
}

impl MemoryBooking {
    fn of(region: &region::Region, dev: usize) -> Self {
        MemoryBooking {
            limit: region.limit(dev),
            oversubscribed: region.share(dev) > 0,
            in_use: region.usage(dev).saturating_add(region.host_usage(dev)),
        }
    }
}

/// `(total, free)` as the container should see them: total = min(limit, physical), free =
/// min(total − container usage, physically free). Oversubscribed, the whole limit is shown
/// and free is what is left of it (host memory serves what the card cannot). Never an error,
/// never a wrap.
pub fn virtual_mem(booking: MemoryBooking, phys_total: u64, phys_free: u64) -> (u64, u64) {
    let MemoryBooking {
        limit,
        oversubscribed,
        in_use,
    } = booking;
    if limit == 0 {
        return (phys_total, phys_free);
    }
    if oversubscribed {
        return (limit, limit.saturating_sub(in_use));
    }
    let total = limit.min(phys_total);
    (total, total.saturating_sub(in_use).min(phys_free))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    guarded("cuMemGetInfo_v2", CUDA_ERROR_UNKNOWN, || {
        let r = real_call!(cuMemGetInfo_v2: unsafe extern "C" fn(*mut usize, *mut usize) -> CUresult, free, total);
        if r != CUDA_SUCCESS || degraded() || free.is_null() || total.is_null() {
            return r;
        }
        let Some(dev) = real::current_device() else {
            return r;
        };
        let region = region_with_watcher();
        // SAFETY: written by the driver.
        let (pt, pf) = unsafe { (*total as u64, *free as u64) };
        let (t, f) = virtual_mem(MemoryBooking::of(region, dev), pt, pf);
        // SAFETY: as above.
        unsafe {
            *total = t as usize;
            *free = f as usize;
        }
        r
    })
}

/// `totalGlobalMem`: the limit, clamped to the physical size (and the physical size when there
/// is no limit; HAMi-core reported 0 then).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: c_int) -> CUresult {
    guarded("cuDeviceTotalMem_v2", CUDA_ERROR_UNKNOWN, || {
        let r = real_call!(cuDeviceTotalMem_v2: unsafe extern "C" fn(*mut usize, c_int) -> CUresult, bytes, dev);
        if r != CUDA_SUCCESS || degraded() || bytes.is_null() || dev < 0 {
            return r;
        }
        let limit = region_with_watcher().limit(dev as usize);
        if limit != 0 {
            // SAFETY: written by the driver.
            unsafe { *bytes = (*bytes as u64).min(limit) as usize };
        }
        r
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn booked(limit: u64, in_use: u64) -> MemoryBooking {
        MemoryBooking {
            limit,
            oversubscribed: false,
            in_use,
        }
    }

    #[test]
    fn memory_view_never_wraps() {
        const G: u64 = 1 << 30;
        assert_eq!(
            virtual_mem(booked(0, 5 * G), 16 * G, 10 * G),
            (16 * G, 10 * G)
        );
        assert_eq!(
            virtual_mem(booked(4 * G, G), 16 * G, 15 * G),
            (4 * G, 3 * G)
        );
        // Usage above the limit (limit lowered, or foreign writers): free is 0, not an error.
        assert_eq!(
            virtual_mem(booked(4 * G, 5 * G), 16 * G, 15 * G),
            (4 * G, 0)
        );
        // A limit above the physical size is clamped (cuDNN broke on total > physical).
        assert_eq!(
            virtual_mem(booked(32 * G, G), 16 * G, 15 * G),
            (16 * G, 15 * G)
        );
        // Other tenants filled the card: physical free wins.
        assert_eq!(virtual_mem(booked(4 * G, G), 16 * G, G / 2), (4 * G, G / 2));
        // Oversubscribed: the whole booking is shown, host memory serves what the card cannot.
        let over = MemoryBooking {
            oversubscribed: true,
            ..booked(32 * G, 20 * G)
        };
        assert_eq!(virtual_mem(over, 16 * G, G), (32 * G, 12 * G));
    }

    #[test]
    fn uuid_format_matches_nvml() {
        let b = [
            0x0c, 0x8e, 0x3b, 0x5a, 0x11, 0x11, 0x22, 0x22, 0x33, 0x33, 0x44, 0x44, 0x55, 0x55,
            0x66, 0x66,
        ];
        assert_eq!(format_uuid(&b), "GPU-0c8e3b5a-1111-2222-3333-444455556666");
    }

    #[test]
    fn array_sizes() {
        assert_eq!(array_bytes(2048, 2048, 0, 0x03, 2), 2048 * 2048 * 4 * 2);
        assert_eq!(array_bytes(16, 0, 0, 0x01, 1), 16);
        assert_eq!(array_bytes(usize::MAX, usize::MAX, 2, 0x20, 4), u64::MAX);
    }
}

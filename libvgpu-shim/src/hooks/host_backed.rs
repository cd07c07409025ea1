//! Opt-in oversubscription (docs/oversubscription.md): when the node gave the container a
//! device share below its memory limit (`TESSERA_DEVICE_MEMORY_SHARE_<i>` in the limits file),
//! a `cuMemAlloc` that does not fit the share, or that the card itself cannot serve, is served
//! from host memory mapped into the device's address space, up to the memory limit.
//!
//! The memory is the process's own anonymous mapping, touched in by the process and then
//! pinned and mapped for the device (`cuMemHostRegister`): the pod's memory cgroup pays for
//! every page, as for any memory the container allocates (pinned memory the driver allocates
//! itself, `cuMemHostAlloc`, may be charged to no one). It never occupies the GPU (no migration,
//! unlike managed memory, so the container cannot move it onto the card behind the count), and
//! it is counted on the slot's host counter (`used[dev].unused[0]`). Kernels reach it over the
//! bus: correct, slower (`e2e/gpu/run.sh` check 9 measures how much).

use super::*;

/// `CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP`: usable from every context,
/// mapped.
const HOST_REGISTER_FLAGS: c_uint = 0x01 | 0x02;

/// Set at the first host-backed allocation: until then a free need not look for one (the
/// common case, a container without oversubscription, pays no lookup per free).
static IN_USE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// One host-backed allocation: its region device, bytes charged and the host pointer to free.
#[derive(Clone, Copy)]
pub(super) struct HostBacked {
    dev: usize,
    bytes: u64,
    host: u64,
}

pub(super) type HostMap = HashMap<u64, HostBacked, std::hash::BuildHasherDefault<super::KeyHasher>>;

/// Serves `bytes` on `dev` from mapped host memory if the container is oversubscribed there
/// and its limit still has room; `None` when oversubscription does not apply (the caller
/// answers as without it).
pub(super) fn alloc(dptr: *mut u64, bytes: u64, dev: usize) -> Option<CUresult> {
    let region = region_with_watcher();
    if region.share(dev) == 0 {
        return None;
    }
    if region.reserve_host(dev, bytes).is_err() {
        log::info!(
            "device {dev}: OOM, {bytes} bytes requested past the device share; {} on the device and {} on the host of {}",
            region.usage(dev),
            region.host_usage(dev),
            region.limit(dev)
        );
        return Some(CUDA_ERROR_OUT_OF_MEMORY);
    }
    type Register = unsafe extern "C" fn(*mut c_void, usize, c_uint) -> CUresult;
    type DevicePointer = unsafe extern "C" fn(*mut u64, *mut c_void, c_uint) -> CUresult;
    let (Some(register), Some(device_pointer)) = (
        aux_fn::<Register>(real::Aux::cuMemHostRegister_v2),
        aux_fn::<DevicePointer>(real::Aux::cuMemHostGetDevicePointer_v2),
    ) else {
        region.release_host(dev, bytes);
        return Some(CUDA_ERROR_OUT_OF_MEMORY);
    };
    let Some(host) = map_host(bytes) else {
        region.release_host(dev, bytes);
        return Some(CUDA_ERROR_OUT_OF_MEMORY);
    };
    // SAFETY: `cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int Flags)` on the
    // mapping just made.
    let r = unsafe { register(host, bytes as usize, HOST_REGISTER_FLAGS) };
    if r != CUDA_SUCCESS {
        unmap_host(host, bytes);
        region.release_host(dev, bytes);
        return Some(CUDA_ERROR_OUT_OF_MEMORY);
    }
    let mut device: u64 = 0;
    // SAFETY: `cuMemHostGetDevicePointer_v2(CUdeviceptr *pdptr, void *p, unsigned int Flags)`
    // on the registered mapping.
    let r = unsafe { device_pointer(&mut device, host, 0) };
    if r != CUDA_SUCCESS || device == 0 {
        unregister(host);
        unmap_host(host, bytes);
        region.release_host(dev, bytes);
        return Some(CUDA_ERROR_OUT_OF_MEMORY);
    }
    IN_USE.store(true, Ordering::Release);
    with_tracker(|t| {
        t.host.insert(
            device,
            HostBacked {
                dev,
                bytes,
                host: host as u64,
            },
        )
    });
    log::info!("device {dev}: {bytes} bytes past the device share served from host memory");
    // SAFETY: the caller checked `dptr` is non-null.
    unsafe { *dptr = device };
    Some(CUDA_SUCCESS)
}

/// A private anonymous mapping of `bytes`, every page touched in by this process (so the
/// pod's memory cgroup is charged now, and a pod without the memory fails here rather than at
/// a kernel's first access) and not inherited by a forked child (pinned pages must not become
/// copy-on-write).
fn map_host(bytes: u64) -> Option<*mut c_void> {
    let len = usize::try_from(bytes).ok()?;
    // SAFETY: a new anonymous mapping; checked below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return None;
    }
    // SAFETY: the mapping just made. Failure only means a fork would share the pages.
    unsafe { libc::madvise(p, len, libc::MADV_DONTFORK) };
    Some(p)
}

fn unmap_host(host: *mut c_void, bytes: u64) {
    // SAFETY: a mapping `map_host` made of `bytes`, no longer registered.
    unsafe { libc::munmap(host, bytes as usize) };
}

fn unregister(host: *mut c_void) -> CUresult {
    type Unregister = unsafe extern "C" fn(*mut c_void) -> CUresult;
    match aux_fn::<Unregister>(real::Aux::cuMemHostUnregister) {
        // SAFETY: `cuMemHostUnregister(void *p)` on a registered mapping.
        Some(f) => unsafe { f(host) },
        None => CUDA_ERROR_NOT_FOUND,
    }
}

/// Frees `dptr` if it is host-backed (`None`: it is not, the caller frees it as device
/// memory). `stream`: a stream-ordered free waits for the stream first, since the host
/// memory is given back at once.
pub(super) fn free(dptr: u64, stream: Option<Stream>) -> Option<CUresult> {
    if !IN_USE.load(Ordering::Acquire) {
        return None;
    }
    let entry = with_tracker(|t| t.host.remove(&dptr))?;
    if let Some(stream) = stream {
        type Sync = unsafe extern "C" fn(Stream) -> CUresult;
        if let Some(sync) = aux_fn::<Sync>(real::Aux::cuStreamSynchronize) {
            // SAFETY: `cuStreamSynchronize(CUstream)` on the caller's stream.
            let r = unsafe { sync(stream) };
            if r != CUDA_SUCCESS {
                with_tracker(|t| t.host.insert(dptr, entry));
                return Some(r);
            }
        }
    }
    let r = unregister(entry.host as *mut c_void);
    if r == CUDA_SUCCESS {
        unmap_host(entry.host as *mut c_void, entry.bytes);
        region_with_watcher().release_host(entry.dev, entry.bytes);
    } else {
        with_tracker(|t| t.host.insert(dptr, entry));
    }
    Some(r)
}

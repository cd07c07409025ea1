//! The legacy (CUDA 3.1 ABI) entry points: `cuMemAlloc`, `cuMemAllocPitch`, `cuMemFree`,
//! `cuArrayCreate`, `cuArray3DCreate`, `cuMemGetInfo` and `cuDeviceTotalMem` without `_v2` take
//! 32-bit device pointers and sizes. Drivers still export them, and `cuGetProcAddress(name, …,
//! < 3020)` returns them; each is counted (or virtualised) like its `_v2` twin. A 32-bit pointer
//! is tracked zero-extended, so a `_v2` free of it uncounts too.

use super::*;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc(dptr: *mut c_uint, bytes: c_uint) -> CUresult {
    guarded("cuMemAlloc", CUDA_ERROR_UNKNOWN, || {
        let call = || {
            let r = real_call!(cuMemAlloc: unsafe extern "C" fn(*mut c_uint, c_uint) -> CUresult, dptr, bytes);
            // SAFETY: the driver wrote `*dptr` if it succeeded.
            (
                r,
                if r == CUDA_SUCCESS {
                    unsafe { *dptr as u64 }
                } else {
                    0
                },
            )
        };
        if degraded() || dptr.is_null() || bytes == 0 {
            return call().0;
        }
        counted(Kind::Ptr, real::current_device(), bytes as u64, call)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocPitch(
    dptr: *mut c_uint,
    pitch: *mut c_uint,
    width: c_uint,
    height: c_uint,
    element_size: c_uint,
) -> CUresult {
    guarded("cuMemAllocPitch", CUDA_ERROR_UNKNOWN, || {
        let r = real_call!(
            cuMemAllocPitch: unsafe extern "C" fn(*mut c_uint, *mut c_uint, c_uint, c_uint, c_uint) -> CUresult,
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
            real_call!(cuMemFree: unsafe extern "C" fn(c_uint) -> CUresult, ptr);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        track(Kind::Ptr, ptr as u64, dev, bytes);
        r
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemFree(dptr: c_uint) -> CUresult {
    guarded("cuMemFree", CUDA_ERROR_UNKNOWN, || {
        let r = real_call!(cuMemFree: unsafe extern "C" fn(c_uint) -> CUresult, dptr);
        if r == CUDA_SUCCESS && dptr != 0 && !degraded() {
            uncount(Kind::Ptr, dptr as u64);
            graphs::freed(dptr as u64);
        }
        r
    })
}

/// `CUDA_ARRAY_DESCRIPTOR_v1`.
#[repr(C)]
pub struct ArrayDescriptorV1 {
    pub width: c_uint,
    pub height: c_uint,
    pub format: c_int,
    pub num_channels: c_uint,
}

/// `CUDA_ARRAY3D_DESCRIPTOR_v1`.
#[repr(C)]
pub struct Array3dDescriptorV1 {
    pub width: c_uint,
    pub height: c_uint,
    pub depth: c_uint,
    pub format: c_int,
    pub num_channels: c_uint,
    pub flags: c_uint,
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayCreate(arr: *mut u64, desc: *const ArrayDescriptorV1) -> CUresult {
    guarded("cuArrayCreate", CUDA_ERROR_UNKNOWN, || {
        let call = || {
            let r = real_call!(cuArrayCreate: unsafe extern "C" fn(*mut u64, *const ArrayDescriptorV1) -> CUresult, arr, desc);
            // SAFETY: the driver wrote `*arr` if it succeeded.
            unsafe { written(r, arr) }
        };
        if degraded() || arr.is_null() || desc.is_null() {
            return call().0;
        }
        // SAFETY: checked non-null.
        let d = unsafe { &*desc };
        let bytes = array_bytes(
            d.width as usize,
            d.height as usize,
            1,
            d.format,
            d.num_channels,
        );
        counted(Kind::Array, real::current_device(), bytes, call)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArray3DCreate(
    arr: *mut u64,
    desc: *const Array3dDescriptorV1,
) -> CUresult {
    guarded("cuArray3DCreate", CUDA_ERROR_UNKNOWN, || {
        let call = || {
            let r = real_call!(cuArray3DCreate: unsafe extern "C" fn(*mut u64, *const Array3dDescriptorV1) -> CUresult, arr, desc);
            // SAFETY: the driver wrote `*arr` if it succeeded.
            unsafe { written(r, arr) }
        };
        if degraded() || arr.is_null() || desc.is_null() {
            return call().0;
        }
        // SAFETY: checked non-null.
        let d = unsafe { &*desc };
        let bytes = array_bytes(
            d.width as usize,
            d.height as usize,
            d.depth as usize,
            d.format,
            d.num_channels,
        );
        counted(Kind::Array, real::current_device(), bytes, call)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo(free: *mut c_uint, total: *mut c_uint) -> CUresult {
    guarded("cuMemGetInfo", CUDA_ERROR_UNKNOWN, || {
        let r = real_call!(cuMemGetInfo: unsafe extern "C" fn(*mut c_uint, *mut c_uint) -> CUresult, free, total);
        if r != CUDA_SUCCESS || degraded() || free.is_null() || total.is_null() {
            return r;
        }
        let Some(dev) = real::current_device() else {
            return r;
        };
        let region = region_with_watcher();
        // SAFETY: written by the driver.
        let (pt, pf) = unsafe { (*total as u64, *free as u64) };
        // Both results are at most the driver's own 32-bit values, except an oversubscribed
        // booking's, which saturate.
        let (t, f) = virtual_mem(MemoryBooking::of(region, dev), pt, pf);
        // SAFETY: as above.
        unsafe {
            *total = t.min(c_uint::MAX as u64) as c_uint;
            *free = f.min(c_uint::MAX as u64) as c_uint;
        }
        r
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem(bytes: *mut c_uint, dev: c_int) -> CUresult {
    guarded("cuDeviceTotalMem", CUDA_ERROR_UNKNOWN, || {
        let r = real_call!(cuDeviceTotalMem: unsafe extern "C" fn(*mut c_uint, c_int) -> CUresult, bytes, dev);
        if r != CUDA_SUCCESS || degraded() || bytes.is_null() || dev < 0 {
            return r;
        }
        let limit = region_with_watcher().limit(dev as usize);
        if limit != 0 {
            // SAFETY: written by the driver.
            unsafe { *bytes = (*bytes as u64).min(limit) as c_uint };
        }
        r
    })
}

// ---------------------------------------------------------------- memory queries

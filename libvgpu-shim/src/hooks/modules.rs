//! Module and library loads (`cuModuleLoad*`, `cuLibraryLoad*`): the device memory a load takes
//! is measured, charged to the slot's `module_size`, and refused over the limit.
//!
//! The driver API does not say how much device memory a module needs (code, constant banks,
//! `__device__` globals, JIT output), so the shim measures it: the device's free memory (the
//! real `cuMemGetInfo_v2`) before and after the real load, less what the container's counted
//! allocations changed in between (other threads and processes of the container). A load whose
//! charge does not fit is unloaded again and returns `CUDA_ERROR_OUT_OF_MEMORY`; the charge is
//! given back at `cuModuleUnload` / `cuLibraryUnload`. Loads in one process are measured one at
//! a time. What the measurement cannot see (documented in the README): memory another container
//! takes on the same GPU during the load (charged to the module), code a lazy-loading driver
//! (`CUDA_MODULE_LOADING=LAZY`) loads later at first use, and a library's copies in other
//! contexts than the current one.

use std::ffi::{c_char, c_int, c_uint, c_void};

use super::*;

/// Held while a load is measured: loads in one process are measured one at a time.
static MEASURING: PidLock = PidLock::new();

/// The device's free memory as the real driver reports it (current context's device).
fn device_free() -> Option<u64> {
    let (mut free, mut total) = (0usize, 0usize);
    let r = real_call!(cuMemGetInfo_v2: unsafe extern "C" fn(*mut usize, *mut usize) -> CUresult, &mut free, &mut total);
    (r == CUDA_SUCCESS).then_some(free as u64)
}

/// Bytes a load took: the drop in the device's free memory less the change in the container's
/// counted usage over the same window; never negative.
pub fn module_bytes(free_before: u64, free_after: u64, usage_before: u64, usage_after: u64) -> u64 {
    let taken = free_before as i128 - free_after as i128;
    let counted = usage_after as i128 - usage_before as i128;
    (taken - counted).clamp(0, u64::MAX as i128) as u64
}

/// Runs the real load `load` (which writes the new handle to `out`), measures it and charges
/// it; over the limit, `unload` undoes it and the caller gets `CUDA_ERROR_OUT_OF_MEMORY`.
fn measured_load(
    what: &str,
    out: *mut u64,
    load: impl FnOnce() -> CUresult,
    unload: impl FnOnce(u64) -> CUresult,
) -> CUresult {
    if degraded() || out.is_null() {
        return load();
    }
    let Some(dev) = real::current_device() else {
        // No current context: the driver fails the load, or loads nothing we can attribute.
        return load();
    };
    let region = region_with_watcher();
    let _one_at_a_time = MEASURING.lock();
    let before = (device_free(), region.usage(dev));
    let r = load();
    if r != CUDA_SUCCESS {
        return r;
    }
    let after = (device_free(), region.usage(dev));
    let (Some(free_before), Some(free_after)) = (before.0, after.0) else {
        return r;
    };
    let bytes = module_bytes(free_before, free_after, before.1, after.1);
    if bytes == 0 {
        return r;
    }
    // SAFETY: the driver wrote the handle (the load succeeded); checked non-null.
    let handle = unsafe { *out };
    if reserve(region, dev, Kind::Module, bytes).is_err() {
        log::info!(
            "device {dev}: OOM, {what} took {bytes} bytes of device memory, {} of {} in use; unloaded",
            region.usage(dev),
            region.limit(dev)
        );
        let _ = unload(handle);
        // SAFETY: as above.
        unsafe { *out = 0 };
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    track(Kind::Module, handle, dev, bytes);
    r
}

fn unload_module(h: u64) -> CUresult {
    real_call!(cuModuleUnload: unsafe extern "C" fn(u64) -> CUresult, h)
}

fn unload_library(h: u64) -> CUresult {
    real_call!(cuLibraryUnload: unsafe extern "C" fn(u64) -> CUresult, h)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoad(module: *mut u64, fname: *const c_char) -> CUresult {
    guarded("cuModuleLoad", CUDA_ERROR_UNKNOWN, || {
        let load = || real_call!(cuModuleLoad: unsafe extern "C" fn(*mut u64, *const c_char) -> CUresult, module, fname);
        measured_load("cuModuleLoad", module, load, unload_module)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoadData(module: *mut u64, image: *const c_void) -> CUresult {
    guarded("cuModuleLoadData", CUDA_ERROR_UNKNOWN, || {
        let load = || real_call!(cuModuleLoadData: unsafe extern "C" fn(*mut u64, *const c_void) -> CUresult, module, image);
        measured_load("cuModuleLoadData", module, load, unload_module)
    })
}

/// The JIT path: PTX in `image` is compiled by the driver inside this call, so the measured
/// memory includes the JIT output.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoadDataEx(
    module: *mut u64,
    image: *const c_void,
    num_options: c_uint,
    options: *mut c_int,
    values: *mut *mut c_void,
) -> CUresult {
    guarded("cuModuleLoadDataEx", CUDA_ERROR_UNKNOWN, || {
        let load = || {
            real_call!(
                cuModuleLoadDataEx: unsafe extern "C" fn(*mut u64, *const c_void, c_uint, *mut c_int, *mut *mut c_void) -> CUresult,
                module, image, num_options, options, values
            )
        };
        measured_load("cuModuleLoadDataEx", module, load, unload_module)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoadFatBinary(
    module: *mut u64,
    fat_cubin: *const c_void,
) -> CUresult {
    guarded("cuModuleLoadFatBinary", CUDA_ERROR_UNKNOWN, || {
        let load = || real_call!(cuModuleLoadFatBinary: unsafe extern "C" fn(*mut u64, *const c_void) -> CUresult, module, fat_cubin);
        measured_load("cuModuleLoadFatBinary", module, load, unload_module)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuModuleUnload(module: u64) -> CUresult {
    guarded("cuModuleUnload", CUDA_ERROR_UNKNOWN, || {
        let r = unload_module(module);
        if r == CUDA_SUCCESS && !degraded() {
            uncount(Kind::Module, module);
        }
        r
    })
}

type LibraryLoadData = unsafe extern "C" fn(
    *mut u64,
    *const c_void,
    *mut c_int,
    *mut *mut c_void,
    c_uint,
    *mut c_int,
    *mut *mut c_void,
    c_uint,
) -> CUresult;

type LibraryLoadFromFile = unsafe extern "C" fn(
    *mut u64,
    *const c_char,
    *mut c_int,
    *mut *mut c_void,
    c_uint,
    *mut c_int,
    *mut *mut c_void,
    c_uint,
) -> CUresult;

/// Context-independent loading (CUDA 12): measured in the current context, if there is one.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cuLibraryLoadData(
    library: *mut u64,
    code: *const c_void,
    jit_options: *mut c_int,
    jit_values: *mut *mut c_void,
    num_jit_options: c_uint,
    library_options: *mut c_int,
    library_values: *mut *mut c_void,
    num_library_options: c_uint,
) -> CUresult {
    guarded("cuLibraryLoadData", CUDA_ERROR_UNKNOWN, || {
        let load = || {
            real_call!(
                cuLibraryLoadData: LibraryLoadData,
                library, code, jit_options, jit_values, num_jit_options, library_options,
                library_values, num_library_options
            )
        };
        measured_load("cuLibraryLoadData", library, load, unload_library)
    })
}

#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cuLibraryLoadFromFile(
    library: *mut u64,
    file_name: *const c_char,
    jit_options: *mut c_int,
    jit_values: *mut *mut c_void,
    num_jit_options: c_uint,
    library_options: *mut c_int,
    library_values: *mut *mut c_void,
    num_library_options: c_uint,
) -> CUresult {
    guarded("cuLibraryLoadFromFile", CUDA_ERROR_UNKNOWN, || {
        let load = || {
            real_call!(
                cuLibraryLoadFromFile: LibraryLoadFromFile,
                library, file_name, jit_options, jit_values, num_jit_options, library_options,
                library_values, num_library_options
            )
        };
        measured_load("cuLibraryLoadFromFile", library, load, unload_library)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuLibraryUnload(library: u64) -> CUresult {
    guarded("cuLibraryUnload", CUDA_ERROR_UNKNOWN, || {
        let r = unload_library(library);
        if r == CUDA_SUCCESS && !degraded() {
            uncount(Kind::Module, library);
        }
        r
    })
}

#[cfg(test)]
mod tests {
    use super::module_bytes;

    #[test]
    fn module_bytes_subtracts_counted_changes_and_never_goes_negative() {
        const M: u64 = 1 << 20;
        // 100 MiB gone, nothing counted meanwhile: the module took 100 MiB.
        assert_eq!(module_bytes(1000 * M, 900 * M, 0, 0), 100 * M);
        // Another thread counted 300 MiB meanwhile: still 100 MiB for the module.
        assert_eq!(module_bytes(1000 * M, 600 * M, 50 * M, 350 * M), 100 * M);
        // Another process freed 500 MiB meanwhile (counted): still 100 MiB.
        assert_eq!(module_bytes(1000 * M, 1400 * M, 600 * M, 100 * M), 100 * M);
        // More free memory than before, nothing counted: 0, not a wrap.
        assert_eq!(module_bytes(900 * M, 1000 * M, 0, 0), 0);
        assert_eq!(module_bytes(u64::MAX, 0, 0, 0), u64::MAX);
        assert_eq!(module_bytes(u64::MAX, 0, 0, u64::MAX), 0);
    }
}

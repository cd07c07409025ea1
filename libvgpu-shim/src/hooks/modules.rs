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

// ---------------------------------------------------------------- context limits

/// What the limit reserves now, measured as a load is, starting from `old` (the charge of the
/// value before): the drop in free memory, less the container's counted changes, added to it;
/// a smaller value gives memory back. Never negative.
pub fn limit_charge(
    old: u64,
    free_before: u64,
    free_after: u64,
    usage_before: u64,
    usage_after: u64,
) -> u64 {
    let taken = free_before as i128 - free_after as i128;
    let counted = usage_after as i128 - usage_before as i128;
    (old as i128 + taken - counted).clamp(0, u64::MAX as i128) as u64
}

/// `cuCtxSetLimit`: the stack size (reserved for every thread the GPU can hold: 32 KiB on a
/// 132-SM GPU is about 8.6 GiB), the device `malloc` heap and the printf FIFO are device memory
/// the driver reserves for the program. Measured like a module load and charged to the slot's
/// `context_size` per device and limit (a new value replaces the old charge); a value whose
/// memory does not fit the limit is set back to the old value and refused with
/// `CUDA_ERROR_OUT_OF_MEMORY`. Local memory a later launch grows for a kernel with a larger
/// stack frame is not seen (no call to measure).
#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSetLimit(limit: c_int, value: usize) -> CUresult {
    guarded("cuCtxSetLimit", CUDA_ERROR_UNKNOWN, || {
        let set = |v: usize| real_call!(cuCtxSetLimit: unsafe extern "C" fn(c_int, usize) -> CUresult, limit, v);
        if degraded() {
            return set(value);
        }
        let Some(dev) = real::current_device() else {
            return set(value);
        };
        let region = region_with_watcher();
        let _one_at_a_time = MEASURING.lock();
        type GetLimit = unsafe extern "C" fn(*mut usize, c_int) -> CUresult;
        let old_value = aux_fn::<GetLimit>(real::Aux::cuCtxGetLimit).and_then(|get| {
            let mut v = 0usize;
            // SAFETY: `cuCtxGetLimit(size_t *pvalue, CUlimit limit)`.
            (unsafe { get(&mut v, limit) } == CUDA_SUCCESS).then_some(v)
        });
        let before = (device_free(), region.usage(dev));
        let r = set(value);
        if r != CUDA_SUCCESS {
            return r;
        }
        let after = (device_free(), region.usage(dev));
        let (Some(free_before), Some(free_after)) = (before.0, after.0) else {
            return r;
        };
        let key = ((dev as u64) << 32) | (limit as u32 as u64);
        let old = with_tracker(|t| t.context_limits.get(&key).map_or(0, |&(_, b)| b));
        let new = limit_charge(old, free_before, free_after, before.1, after.1);
        if new > old {
            if reserve(region, dev, Kind::ContextLimit, new - old).is_err() {
                log::info!(
                    "device {dev}: OOM, context limit {limit} = {value} reserves {new} bytes of device memory, {} of {} in use; set back",
                    region.usage(dev),
                    region.limit(dev)
                );
                if old_value.is_some_and(|v| set(v) == CUDA_SUCCESS) {
                    return CUDA_ERROR_OUT_OF_MEMORY;
                }
                // The old value cannot be restored: the memory is held, so it is counted (past
                // the limit: later allocations are refused until it is back).
                region.charge_as(dev, Kind::ContextLimit.field(), new - old);
            }
        } else {
            region.release_as(dev, Kind::ContextLimit.field(), old - new);
        }
        track(Kind::ContextLimit, key, dev, new);
        r
    })
}

#[cfg(test)]
mod tests {
    use super::{limit_charge, module_bytes};

    #[test]
    fn a_new_limit_value_replaces_the_old_charge() {
        const M: u64 = 1 << 20;
        // 16 MiB held, the new value takes 48 MiB more: 64 MiB.
        assert_eq!(limit_charge(16 * M, 100 * M, 52 * M, 0, 0), 64 * M);
        // Lowered: 12 MiB come back.
        assert_eq!(limit_charge(16 * M, 52 * M, 64 * M, 0, 0), 4 * M);
        // Another thread allocated 8 MiB (counted) meanwhile: not the limit's.
        assert_eq!(limit_charge(0, 100 * M, 84 * M, 0, 8 * M), 8 * M);
        // Freed more than was charged (a foreign free): never negative.
        assert_eq!(limit_charge(M, 10 * M, 20 * M, 0, 0), 0);
    }

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

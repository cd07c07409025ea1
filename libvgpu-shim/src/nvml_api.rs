//! The NVML calls both the hooks and the SM limiter's watcher make on the real library: its
//! functions by name, NVML's list protocol, the per-process utilization samples. No hook here.

use std::ffi::{c_uint, c_void};

use crate::real::{self, F};

pub(crate) const NVML_SUCCESS: c_uint = 0;
pub(crate) const NVML_ERROR_NOT_FOUND: c_uint = 6;
pub(crate) const NVML_ERROR_INSUFFICIENT_SIZE: c_uint = 7;
pub(crate) const NVML_ERROR_FUNCTION_NOT_FOUND: c_uint = 13;

/// `nvmlProcessUtilizationSample_t`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ProcessSample {
    pub pid: c_uint,
    pub time_stamp: u64,
    pub sm_util: c_uint,
    pub mem_util: c_uint,
    pub enc_util: c_uint,
    pub dec_util: c_uint,
}

/// `nvmlUtilization_t`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct Utilization {
    pub gpu: c_uint,
    pub memory: c_uint,
}

/// NVML's own function `f` as the C type `T`, or `None` when the library lacks it.
///
/// # Safety
/// `T` must be the `extern "C" fn` type of `f`'s C signature.
pub(crate) unsafe fn real_nvml<T: Copy>(f: F) -> Option<T> {
    const { assert!(std::mem::size_of::<T>() == std::mem::size_of::<*mut c_void>()) };
    let p = real::get(f);
    // SAFETY: the caller's contract; `T` is a function pointer, as large as `p`.
    (!p.is_null()).then(|| unsafe { std::mem::transmute_copy::<*mut c_void, T>(&p) })
}

/// Calls a real NVML list query (`count`, buffer) until the buffer is large enough, at most a
/// few times (the list may grow between calls). `Err` is NVML's error.
pub(crate) fn real_list<T: Copy + Default>(
    mut call: impl FnMut(*mut c_uint, *mut T) -> c_uint,
) -> Result<Vec<T>, c_uint> {
    let mut capacity: usize = 64;
    for _ in 0..4 {
        let mut buf = vec![T::default(); capacity];
        let mut count = capacity as c_uint;
        match call(&mut count, buf.as_mut_ptr()) {
            NVML_SUCCESS => {
                buf.truncate((count as usize).min(capacity));
                return Ok(buf);
            }
            NVML_ERROR_INSUFFICIENT_SIZE => capacity = (count as usize).max(capacity) + 16,
            e => return Err(e),
        }
    }
    Err(NVML_ERROR_INSUFFICIENT_SIZE)
}

/// `nvmlDeviceGetProcessUtilization`'s C signature.
pub(crate) type ProcessUtilizationFn =
    unsafe extern "C" fn(*mut c_void, *mut ProcessSample, *mut c_uint, u64) -> c_uint;

/// NVML's per-process utilization samples of `device` newer than `since_us` (NVML's `NOT_FOUND`
/// when there is none is an empty list).
pub(crate) fn real_process_samples(
    device: *mut c_void,
    since_us: u64,
) -> Result<Vec<ProcessSample>, c_uint> {
    // SAFETY: `nvmlDeviceGetProcessUtilization(dev, samples*, unsigned*, u64)`.
    let Some(real) =
        (unsafe { real_nvml::<ProcessUtilizationFn>(F::nvmlDeviceGetProcessUtilization) })
    else {
        return Err(NVML_ERROR_FUNCTION_NOT_FOUND);
    };
    // SAFETY: a buffer of `count` samples.
    match real_list(|n, buf| unsafe { real(device, buf, n, since_us) }) {
        Err(NVML_ERROR_NOT_FOUND) => Ok(Vec::new()),
        r => r,
    }
}

/// Wall-clock µs, NVML's timestamps' clock.
pub(crate) fn realtime_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

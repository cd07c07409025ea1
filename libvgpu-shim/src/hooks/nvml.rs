//! NVML's memory queries as the container should see them: its limit as the total, its own
//! usage within it (`nvidia-smi` in the container shows its slice).

use super::*;

#[repr(C)]
pub struct NvmlMemory {
    pub total: u64,
    pub free: u64,
    pub used: u64,
}

#[repr(C)]
pub struct NvmlMemoryV2 {
    pub version: c_uint,
    pub total: u64,
    pub reserved: u64,
    pub free: u64,
    pub used: u64,
}

/// The region device of an NVML device (its NVML index mapped through a numeric
/// `CUDA_VISIBLE_DEVICES`, identity otherwise).
fn nvml_region_device(device: *mut c_void) -> Option<usize> {
    let p = real::aux(real::Aux::nvmlDeviceGetIndex);
    if p.is_null() {
        return None;
    }
    let mut idx: c_uint = 0;
    // SAFETY: `nvmlDeviceGetIndex(nvmlDevice_t, unsigned*)`.
    let r = unsafe {
        std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*mut c_void, *mut c_uint) -> c_uint>(
            p,
        )(device, &mut idx)
    };
    if r != NVML_SUCCESS {
        return None;
    }
    crate::visible::nvml_to_cuda(idx as usize)
}

/// (total, used, free) for nvidia-smi: total = limit (≤ physical), used = container usage,
/// free = total − used, saturating (HAMi-core wrapped to ~18 EB).
fn nvml_virtual(dev: usize, phys_total: u64, phys_used: u64, phys_free: u64) -> (u64, u64, u64) {
    let region = region_with_watcher();
    let limit = region.limit(dev);
    let usage = region.usage(dev);
    if limit == 0 {
        return (phys_total, phys_used, phys_free);
    }
    let total = limit.min(phys_total);
    (total, usage, total.saturating_sub(usage))
}

/// The fields both NVML memory structs share, so one wrapper serves `_v1` and `_v2`.
trait NvmlMemoryFields {
    fn fields(&mut self) -> (&mut u64, &mut u64, &mut u64);
}

impl NvmlMemoryFields for NvmlMemory {
    fn fields(&mut self) -> (&mut u64, &mut u64, &mut u64) {
        (&mut self.total, &mut self.used, &mut self.free)
    }
}

impl NvmlMemoryFields for NvmlMemoryV2 {
    fn fields(&mut self) -> (&mut u64, &mut u64, &mut u64) {
        (&mut self.total, &mut self.used, &mut self.free)
    }
}

/// Calls the real NVML memory query `f` and replaces its answer with the container's view.
fn nvml_memory_info<M: NvmlMemoryFields>(f: F, device: *mut c_void, memory: *mut M) -> c_uint {
    let p = real::get(f);
    if p.is_null() {
        return NVML_ERROR_FUNCTION_NOT_FOUND;
    }
    // SAFETY: `p` is NVML's `f`, whose C signature takes the device and `M`.
    let r = unsafe {
        std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*mut c_void, *mut M) -> c_uint>(p)(
            device, memory,
        )
    };
    if r != NVML_SUCCESS || memory.is_null() || degraded() {
        return r;
    }
    if let Some(dev) = nvml_region_device(device) {
        // SAFETY: written by NVML, checked non-null.
        let (total, used, free) = unsafe { &mut *memory }.fields();
        (*total, *used, *free) = nvml_virtual(dev, *total, *used, *free);
    }
    r
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    device: *mut c_void,
    memory: *mut NvmlMemory,
) -> c_uint {
    guarded("nvmlDeviceGetMemoryInfo", NVML_ERROR_UNKNOWN, || {
        nvml_memory_info(F::nvmlDeviceGetMemoryInfo, device, memory)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: *mut c_void,
    memory: *mut NvmlMemoryV2,
) -> c_uint {
    guarded("nvmlDeviceGetMemoryInfo_v2", NVML_ERROR_UNKNOWN, || {
        nvml_memory_info(F::nvmlDeviceGetMemoryInfo_v2, device, memory)
    })
}

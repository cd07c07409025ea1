//! NVML's memory queries as the container should see them: its limit as the total, its own
//! usage within it (`nvidia-smi` in the container shows its slice).

use super::*;
use crate::nvml_api::*;

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
    let booking = MemoryBooking::of(region_with_watcher(), dev);
    if booking.limit == 0 {
        return (phys_total, phys_used, phys_free);
    }
    // Oversubscribed: the whole booking, host memory in use included (deviation Z2).
    let total = if booking.oversubscribed {
        booking.limit
    } else {
        booking.limit.min(phys_total)
    };
    (total, booking.in_use, total.saturating_sub(booking.in_use))
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

// ---------------------------------------------------------------- processes and utilization
//
// What the container sees of the GPU's processes is its own (issue 31): NVML lists every
// process on the card, with host PIDs, so without this a container learns how many processes
// other tenants run and what each uses. The lists are answered from the container's region
// (compute) or from NVML's list kept to the container's processes by their host PIDs, which the
// node's watch writes into the region (graphics, MPS, utilization); a process whose host PID is
// not known yet is left out, never someone else's shown.

const NVML_ERROR_INVALID_ARGUMENT: c_uint = 2;
/// `NVML_VALUE_NOT_AVAILABLE` for an unknown instance id (not a MIG device).
const NO_INSTANCE: c_uint = 0xFFFF_FFFF;

/// `nvmlProcessInfo_t`: the layout of the `_v2` and `_v3` process lists.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct NvmlProcessInfo {
    pub pid: c_uint,
    pub used_gpu_memory: u64,
    pub gpu_instance_id: c_uint,
    pub compute_instance_id: c_uint,
}

/// `nvmlProcessInfo_v1_t`: the layout of the unversioned process lists.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct NvmlProcessInfoV1 {
    pub pid: c_uint,
    pub used_gpu_memory: u64,
}

/// An entry of a process list in either layout.
trait ProcessEntry: Copy + Default {
    fn new(pid: u32, used: u64) -> Self;
    fn pid(&self) -> u32;
    fn used(&self) -> u64;
}

impl ProcessEntry for NvmlProcessInfo {
    fn new(pid: u32, used: u64) -> Self {
        NvmlProcessInfo {
            pid,
            used_gpu_memory: used,
            gpu_instance_id: NO_INSTANCE,
            compute_instance_id: NO_INSTANCE,
        }
    }
    fn pid(&self) -> u32 {
        self.pid
    }
    fn used(&self) -> u64 {
        self.used_gpu_memory
    }
}

impl ProcessEntry for NvmlProcessInfoV1 {
    fn new(pid: u32, used: u64) -> Self {
        NvmlProcessInfoV1 {
            pid,
            used_gpu_memory: used,
        }
    }
    fn pid(&self) -> u32 {
        self.pid
    }
    fn used(&self) -> u64 {
        self.used_gpu_memory
    }
}

/// The container's processes, with their use of an NVML device, or `None` when the device is
/// not one of the container's (then it has none there).
fn own_processes(device: *mut c_void) -> Option<Vec<region::ProcessUse>> {
    let dev = nvml_region_device(device)?;
    Some(region_with_watcher().processes_on(dev))
}

/// NVML's two-call protocol for `list` into the caller's `count`/`infos`: too small a buffer
/// gets the number needed and `INSUFFICIENT_SIZE`, nothing written.
///
/// # Safety
/// `count` is NULL or valid; `infos` is NULL or holds `*count` entries.
unsafe fn answer_list<T: Copy>(count: *mut c_uint, infos: *mut T, list: &[T]) -> c_uint {
    if count.is_null() {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: checked non-null.
    let capacity = unsafe { *count } as usize;
    // SAFETY: checked non-null.
    unsafe { *count = list.len() as c_uint };
    if capacity < list.len() {
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    if list.is_empty() {
        return NVML_SUCCESS;
    }
    if infos.is_null() {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    for (i, e) in list.iter().enumerate() {
        // SAFETY: `infos` holds `capacity` ≥ `list.len()` entries.
        unsafe { *infos.add(i) = *e };
    }
    NVML_SUCCESS
}

/// A running-process list of kind `f`. Compute: the container's processes from its region (its
/// PIDs, the bytes the shim counted) that have memory on the device or that NVML lists there.
/// Graphics and MPS: NVML's list kept to the processes whose host PID the region knows, each
/// shown with its container PID.
///
/// # Safety
/// As [`answer_list`].
unsafe fn running_processes<T: ProcessEntry>(
    f: F,
    compute: bool,
    device: *mut c_void,
    count: *mut c_uint,
    infos: *mut T,
) -> c_uint {
    // SAFETY: NVML's `f`: (device, unsigned*, T*) -> nvmlReturn_t.
    let Some(real) = (unsafe {
        real_nvml::<unsafe extern "C" fn(*mut c_void, *mut c_uint, *mut T) -> c_uint>(f)
    }) else {
        return NVML_ERROR_FUNCTION_NOT_FOUND;
    };
    if degraded() {
        // SAFETY: the caller's arguments, forwarded.
        return unsafe { real(device, count, infos) };
    }
    let own = own_processes(device).unwrap_or_default();
    // SAFETY: a buffer of `count` entries, as NVML asks.
    let listed = real_list(|n, buf| unsafe { real(device, n, buf) })
        .map(|all: Vec<T>| all.iter().map(|e| (e.pid(), e.used())).collect());
    let list: Vec<T> = match shown_processes(&own, listed, compute) {
        Ok(shown) => shown
            .into_iter()
            .map(|(pid, used)| T::new(pid, used))
            .collect(),
        Err(e) => return e,
    };
    // SAFETY: the caller's buffer, as NVML's contract gives it.
    unsafe { answer_list(count, infos, &list) }
}

/// What a container's list shows, `(its PID, bytes)`, given its processes and NVML's list of
/// the kind, `(host PID, bytes)`. Compute: every process with memory counted on the device by
/// the shim, and one NVML lists there under a recorded host PID with only a context; the bytes
/// are the shim's count. Graphics and MPS: NVML's entries whose host PID the region records.
fn shown_processes(
    own: &[region::ProcessUse],
    listed: Result<Vec<(u32, u64)>, c_uint>,
    compute: bool,
) -> Result<Vec<(u32, u64)>, c_uint> {
    let on_card = |p: &region::ProcessUse| -> Option<u64> {
        let all = listed.as_ref().ok()?;
        all.iter()
            .find(|&&(pid, _)| p.host_pid != 0 && pid == p.host_pid)
            .map(|&(_, used)| used)
    };
    if compute {
        return Ok(own
            .iter()
            .filter(|p| p.used > 0 || on_card(p).is_some())
            .map(|p| (p.pid, p.used))
            .collect());
    }
    if let Err(e) = &listed {
        return Err(*e);
    }
    Ok(own
        .iter()
        .filter_map(|p| Some((p.pid, on_card(p)?)))
        .collect())
}

macro_rules! process_list_hook {
    ($name:ident, $entry:ty, $compute:expr) => {
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            device: *mut c_void,
            count: *mut c_uint,
            infos: *mut $entry,
        ) -> c_uint {
            guarded(stringify!($name), NVML_ERROR_UNKNOWN, || {
                // SAFETY: NVML's contract for the caller's arguments.
                unsafe { running_processes(F::$name, $compute, device, count, infos) }
            })
        }
    };
}

process_list_hook!(
    nvmlDeviceGetComputeRunningProcesses,
    NvmlProcessInfoV1,
    true
);
process_list_hook!(
    nvmlDeviceGetComputeRunningProcesses_v2,
    NvmlProcessInfo,
    true
);
process_list_hook!(
    nvmlDeviceGetComputeRunningProcesses_v3,
    NvmlProcessInfo,
    true
);
process_list_hook!(
    nvmlDeviceGetGraphicsRunningProcesses,
    NvmlProcessInfoV1,
    false
);
process_list_hook!(
    nvmlDeviceGetGraphicsRunningProcesses_v2,
    NvmlProcessInfo,
    false
);
process_list_hook!(
    nvmlDeviceGetGraphicsRunningProcesses_v3,
    NvmlProcessInfo,
    false
);
process_list_hook!(
    nvmlDeviceGetMPSComputeRunningProcesses,
    NvmlProcessInfoV1,
    false
);
process_list_hook!(
    nvmlDeviceGetMPSComputeRunningProcesses_v2,
    NvmlProcessInfo,
    false
);
process_list_hook!(
    nvmlDeviceGetMPSComputeRunningProcesses_v3,
    NvmlProcessInfo,
    false
);

/// The container's samples among `samples` (by the host PIDs its region knows), each with its
/// container PID.
fn own_samples(own: &[region::ProcessUse], samples: &[ProcessSample]) -> Vec<ProcessSample> {
    samples
        .iter()
        .filter_map(|s| {
            let mine = own
                .iter()
                .find(|p| p.host_pid != 0 && p.host_pid == s.pid)?;
            Some(ProcessSample {
                pid: mine.pid,
                ..*s
            })
        })
        .collect()
}

/// The container's utilization from its processes' samples: per process the average of its
/// samples, summed, at most 100. The scale is NVML's, a percentage of the whole GPU, so a
/// container held to `gpucores: 30` and busy all the time reads about 30.
pub(crate) fn container_utilization(samples: &[ProcessSample]) -> Utilization {
    let mut by_pid: HashMap<u32, (u64, u64, u64)> = HashMap::new();
    for s in samples {
        let e = by_pid.entry(s.pid).or_default();
        e.0 += u64::from(s.sm_util);
        e.1 += u64::from(s.mem_util);
        e.2 += 1;
    }
    let (mut gpu, mut memory) = (0u64, 0u64);
    for (sm, mem, n) in by_pid.values() {
        gpu += sm / n;
        memory += mem / n;
    }
    Utilization {
        gpu: gpu.min(100) as c_uint,
        memory: memory.min(100) as c_uint,
    }
}

/// The window `nvmlDeviceGetUtilizationRates` reports over (NVML's own is 1/6 s to 1 s).
const UTILIZATION_WINDOW_US: u64 = 1_000_000;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    device: *mut c_void,
    utilization: *mut Utilization,
) -> c_uint {
    guarded("nvmlDeviceGetUtilizationRates", NVML_ERROR_UNKNOWN, || {
        // SAFETY: `nvmlDeviceGetUtilizationRates(dev, nvmlUtilization_t*)`.
        let Some(real) = (unsafe {
            real_nvml::<unsafe extern "C" fn(*mut c_void, *mut Utilization) -> c_uint>(
                F::nvmlDeviceGetUtilizationRates,
            )
        }) else {
            return NVML_ERROR_FUNCTION_NOT_FOUND;
        };
        // SAFETY: the caller's arguments, forwarded.
        let r = unsafe { real(device, utilization) };
        if r != NVML_SUCCESS || utilization.is_null() || degraded() {
            return r;
        }
        let own = own_processes(device).unwrap_or_default();
        let since = realtime_us().saturating_sub(UTILIZATION_WINDOW_US);
        let samples = real_process_samples(device, since).unwrap_or_default();
        // SAFETY: written by NVML, checked non-null.
        unsafe { *utilization = container_utilization(&own_samples(&own, &samples)) };
        NVML_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetProcessUtilization(
    device: *mut c_void,
    samples: *mut ProcessSample,
    count: *mut c_uint,
    last_seen_us: u64,
) -> c_uint {
    guarded(
        "nvmlDeviceGetProcessUtilization",
        NVML_ERROR_UNKNOWN,
        || {
            if degraded() {
                // SAFETY: NVML's own function, with the caller's arguments.
                return match unsafe {
                    real_nvml::<ProcessUtilizationFn>(F::nvmlDeviceGetProcessUtilization)
                } {
                    // SAFETY: as above.
                    Some(real) => unsafe { real(device, samples, count, last_seen_us) },
                    None => NVML_ERROR_FUNCTION_NOT_FOUND,
                };
            }
            if count.is_null() {
                return NVML_ERROR_INVALID_ARGUMENT;
            }
            let all = match real_process_samples(device, last_seen_us) {
                Ok(all) => all,
                Err(e) => return e,
            };
            let own = own_samples(&own_processes(device).unwrap_or_default(), &all);
            if own.is_empty() {
                // NVML's answer when no sample is newer than `last_seen`.
                // SAFETY: checked non-null.
                unsafe { *count = 0 };
                return NVML_ERROR_NOT_FOUND;
            }
            // NVML's protocol here: a NULL buffer or too small a count asks for the size.
            // SAFETY: checked non-null.
            if samples.is_null() && unsafe { *count } != 0 {
                return NVML_ERROR_INVALID_ARGUMENT;
            }
            // SAFETY: the caller's buffer holds `*count` samples.
            unsafe { answer_list(count, samples, &own) }
        },
    )
}

// ---------------------------------------------------------------- NVML 12.4+ forms

/// `nvmlProcessDetail_v1_t`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ProcessDetail {
    pub pid: c_uint,
    pub used_gpu_memory: u64,
    pub gpu_instance_id: c_uint,
    pub compute_instance_id: c_uint,
    pub used_gpu_cc_protected_memory: u64,
}

/// `nvmlProcessDetailList_v1_t`.
#[repr(C)]
pub struct ProcessDetailList {
    pub version: c_uint,
    /// 0 compute, 1 graphics, 2 MPS.
    pub mode: c_uint,
    pub num_proc_array_entries: c_uint,
    pub proc_array: *mut ProcessDetail,
}

/// `nvmlProcessUtilizationInfo_v1_t`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ProcessUtilizationInfo {
    pub time_stamp: u64,
    pub pid: c_uint,
    pub sm_util: c_uint,
    pub mem_util: c_uint,
    pub enc_util: c_uint,
    pub dec_util: c_uint,
    pub jpg_util: c_uint,
    pub ofa_util: c_uint,
}

/// `nvmlProcessesUtilizationInfo_v1_t`.
#[repr(C)]
pub struct ProcessesUtilizationInfo {
    pub version: c_uint,
    pub process_samples_count: c_uint,
    pub last_seen_time_stamp: u64,
    pub proc_util_array: *mut ProcessUtilizationInfo,
}

/// `list` into a caller's array of `capacity` entries, which `count` then holds the length of:
/// too small (or no array) and not empty is `INSUFFICIENT_SIZE`, nothing written; `empty` is
/// the answer for an empty list.
///
/// # Safety
/// `array` is NULL or holds `capacity` entries.
unsafe fn answer_array<T: Copy>(
    list: &[T],
    capacity: usize,
    count: &mut c_uint,
    array: *mut T,
    empty: c_uint,
) -> c_uint {
    *count = list.len() as c_uint;
    if list.is_empty() {
        return empty;
    }
    if array.is_null() || capacity < list.len() {
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (i, e) in list.iter().enumerate() {
        // SAFETY: `array` holds `capacity` ≥ `list.len()` entries.
        unsafe { *array.add(i) = *e };
    }
    NVML_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetRunningProcessDetailList(
    device: *mut c_void,
    list: *mut ProcessDetailList,
) -> c_uint {
    guarded(
        "nvmlDeviceGetRunningProcessDetailList",
        NVML_ERROR_UNKNOWN,
        || {
            // SAFETY: `nvmlDeviceGetRunningProcessDetailList(dev, nvmlProcessDetailList_t*)`.
            let Some(real) = (unsafe {
                real_nvml::<unsafe extern "C" fn(*mut c_void, *mut ProcessDetailList) -> c_uint>(
                    F::nvmlDeviceGetRunningProcessDetailList,
                )
            }) else {
                return NVML_ERROR_FUNCTION_NOT_FOUND;
            };
            if degraded() || list.is_null() {
                // SAFETY: the caller's arguments, forwarded.
                return unsafe { real(device, list) };
            }
            // SAFETY: checked non-null; the caller's struct.
            let caller = unsafe { &mut *list };
            let (version, mode) = (caller.version, caller.mode);
            let listed = real_list(|n, buf: *mut ProcessDetail| {
                let mut ask = ProcessDetailList {
                    version,
                    mode,
                    // SAFETY: `real_list` passes its own counter.
                    num_proc_array_entries: unsafe { *n },
                    proc_array: buf,
                };
                // SAFETY: our struct and buffer of `num_proc_array_entries` entries.
                let r = unsafe { real(device, &mut ask) };
                // SAFETY: as above.
                unsafe { *n = ask.num_proc_array_entries };
                r
            })
            .map(|all| {
                all.iter()
                    .map(|e| (e.pid, e.used_gpu_memory))
                    .collect::<Vec<_>>()
            });
            let own = own_processes(device).unwrap_or_default();
            let shown = match shown_processes(&own, listed, mode == 0) {
                Ok(shown) => shown,
                Err(e) => return e,
            };
            let entries: Vec<ProcessDetail> = shown
                .into_iter()
                .map(|(pid, used)| ProcessDetail {
                    pid,
                    used_gpu_memory: used,
                    gpu_instance_id: NO_INSTANCE,
                    compute_instance_id: NO_INSTANCE,
                    used_gpu_cc_protected_memory: 0,
                })
                .collect();
            let capacity = caller.num_proc_array_entries as usize;
            // SAFETY: the caller's array holds `capacity` entries.
            unsafe {
                answer_array(
                    &entries,
                    capacity,
                    &mut caller.num_proc_array_entries,
                    caller.proc_array,
                    NVML_SUCCESS,
                )
            }
        },
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetProcessesUtilizationInfo(
    device: *mut c_void,
    info: *mut ProcessesUtilizationInfo,
) -> c_uint {
    guarded(
        "nvmlDeviceGetProcessesUtilizationInfo",
        NVML_ERROR_UNKNOWN,
        || {
            // SAFETY: `nvmlDeviceGetProcessesUtilizationInfo(dev, nvmlProcessesUtilizationInfo_t*)`.
            let Some(real) = (unsafe {
                real_nvml::<
                    unsafe extern "C" fn(*mut c_void, *mut ProcessesUtilizationInfo) -> c_uint,
                >(F::nvmlDeviceGetProcessesUtilizationInfo)
            }) else {
                return NVML_ERROR_FUNCTION_NOT_FOUND;
            };
            if degraded() || info.is_null() {
                // SAFETY: the caller's arguments, forwarded.
                return unsafe { real(device, info) };
            }
            // SAFETY: checked non-null; the caller's struct.
            let caller = unsafe { &mut *info };
            let (version, since) = (caller.version, caller.last_seen_time_stamp);
            let sampled = real_list(|n, buf: *mut ProcessUtilizationInfo| {
                let mut ask = ProcessesUtilizationInfo {
                    version,
                    // SAFETY: `real_list` passes its own counter.
                    process_samples_count: unsafe { *n },
                    last_seen_time_stamp: since,
                    proc_util_array: buf,
                };
                // SAFETY: our struct and buffer of `process_samples_count` entries.
                let r = unsafe { real(device, &mut ask) };
                // SAFETY: as above.
                unsafe { *n = ask.process_samples_count };
                r
            });
            let all = match sampled {
                Ok(all) => all,
                Err(NVML_ERROR_NOT_FOUND) => Vec::new(),
                Err(e) => return e,
            };
            let own = own_processes(device).unwrap_or_default();
            let mine: Vec<ProcessUtilizationInfo> = all
                .iter()
                .filter_map(|s| {
                    let p = own
                        .iter()
                        .find(|p| p.host_pid != 0 && p.host_pid == s.pid)?;
                    Some(ProcessUtilizationInfo { pid: p.pid, ..*s })
                })
                .collect();
            let capacity = caller.process_samples_count as usize;
            // SAFETY: the caller's array holds `capacity` entries.
            unsafe {
                answer_array(
                    &mine,
                    capacity,
                    &mut caller.process_samples_count,
                    caller.proc_util_array,
                    NVML_ERROR_NOT_FOUND,
                )
            }
        },
    )
}

/// The PIDs accounting mode recorded on the device, kept to the container's processes whose
/// host PID its region records, with their container PIDs.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAccountingPids(
    device: *mut c_void,
    count: *mut c_uint,
    pids: *mut c_uint,
) -> c_uint {
    guarded("nvmlDeviceGetAccountingPids", NVML_ERROR_UNKNOWN, || {
        // SAFETY: `nvmlDeviceGetAccountingPids(dev, unsigned*, unsigned*)`.
        let Some(real) = (unsafe {
            real_nvml::<unsafe extern "C" fn(*mut c_void, *mut c_uint, *mut c_uint) -> c_uint>(
                F::nvmlDeviceGetAccountingPids,
            )
        }) else {
            return NVML_ERROR_FUNCTION_NOT_FOUND;
        };
        if degraded() {
            // SAFETY: the caller's arguments, forwarded.
            return unsafe { real(device, count, pids) };
        }
        // SAFETY: a buffer of `count` entries, as NVML asks.
        let all = match real_list(|n, buf: *mut c_uint| unsafe { real(device, n, buf) }) {
            Ok(all) => all,
            Err(e) => return e,
        };
        let own = own_processes(device).unwrap_or_default();
        let mine: Vec<c_uint> = all
            .iter()
            .filter_map(|&host| {
                own.iter()
                    .find(|p| p.host_pid != 0 && p.host_pid == host)
                    .map(|p| p.pid)
            })
            .collect();
        // SAFETY: the caller's buffer, as NVML's contract gives it.
        unsafe { answer_list(count, pids, &mine) }
    })
}

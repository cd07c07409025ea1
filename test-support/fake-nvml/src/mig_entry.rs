//! The MIG entry points: profiles, GPU and compute instances, MIG device handles. The model and
//! the shared state are in `mig.rs`; `README.md` lists the error codes.

use std::ffi::{c_char, c_uint, c_void};
use std::sync::atomic::AtomicU8;

use crate::mig::{self, GiProfileSpec, MigResult, MigState, ModelTable};
use crate::*;

const MAX_DEVICES: usize = 64;
const GI_SLOTS: usize = mig::MAX_GI_IDS as usize;
const CI_SLOTS: usize = mig::MAX_CI_IDS as usize;

/// `nvmlGpuInstance_t`: an address in here, indexed by (device, GI id).
static GI_HANDLES: [AtomicU8; MAX_DEVICES * GI_SLOTS] =
    [const { AtomicU8::new(0) }; MAX_DEVICES * GI_SLOTS];
/// `nvmlComputeInstance_t`: indexed by (device, GI id, CI id).
static CI_HANDLES: [AtomicU8; MAX_DEVICES * GI_SLOTS * CI_SLOTS] =
    [const { AtomicU8::new(0) }; MAX_DEVICES * GI_SLOTS * CI_SLOTS];
/// MIG device handles (`nvmlDevice_t` of a MIG device): indexed like compute instances.
static MIG_HANDLES: [AtomicU8; MAX_DEVICES * GI_SLOTS * CI_SLOTS] =
    [const { AtomicU8::new(0) }; MAX_DEVICES * GI_SLOTS * CI_SLOTS];

fn index_in(table: &[AtomicU8], handle: *mut c_void) -> Option<usize> {
    let i = (handle as usize).wrapping_sub(table.as_ptr() as usize);
    (i < table.len()).then_some(i)
}

fn gi_handle(dev: usize, gi: u32) -> *mut c_void {
    GI_HANDLES[dev * GI_SLOTS + gi as usize].as_ptr().cast()
}
fn ci_index(dev: usize, gi: u32, ci: u32) -> usize {
    (dev * GI_SLOTS + gi as usize) * CI_SLOTS + ci as usize
}
fn ci_handle(dev: usize, gi: u32, ci: u32) -> *mut c_void {
    CI_HANDLES[ci_index(dev, gi, ci)].as_ptr().cast()
}
fn mig_handle(dev: usize, gi: u32, ci: u32) -> *mut c_void {
    MIG_HANDLES[ci_index(dev, gi, ci)].as_ptr().cast()
}
fn split_ci(i: usize) -> (usize, u32, u32) {
    (
        i / (GI_SLOTS * CI_SLOTS),
        ((i / CI_SLOTS) % GI_SLOTS) as u32,
        (i % CI_SLOTS) as u32,
    )
}

/// Whether `handle` is one of the fake's MIG device handles (whatever its state).
pub(crate) fn is_mig_handle(handle: *mut c_void) -> bool {
    index_in(&MIG_HANDLES, handle).is_some()
}

/// `NVML_STRUCT_VERSION(GpuInstanceProfileInfo, 2/3)`: both structs are 152 bytes.
const GI_INFO_V2: c_uint = (std::mem::size_of::<GiProfileInfoV2>() as c_uint) | (2 << 24);
const GI_INFO_V3: c_uint = (std::mem::size_of::<GiProfileInfoV3>() as c_uint) | (3 << 24);
const CI_INFO_V2: c_uint = (std::mem::size_of::<CiProfileInfoV2>() as c_uint) | (2 << 24);
const CI_INFO_V3: c_uint = (std::mem::size_of::<CiProfileInfoV3>() as c_uint) | (3 << 24);

#[repr(C)]
pub struct GiProfileInfo {
    pub id: c_uint,
    pub is_p2p_supported: c_uint,
    pub slice_count: c_uint,
    pub instance_count: c_uint,
    pub multiprocessor_count: c_uint,
    pub copy_engine_count: c_uint,
    pub decoder_count: c_uint,
    pub encoder_count: c_uint,
    pub jpeg_count: c_uint,
    pub ofa_count: c_uint,
    pub memory_size_mb: u64,
}

#[repr(C)]
pub struct GiProfileInfoV2 {
    pub version: c_uint,
    pub id: c_uint,
    pub is_p2p_supported: c_uint,
    pub slice_count: c_uint,
    pub instance_count: c_uint,
    pub multiprocessor_count: c_uint,
    pub copy_engine_count: c_uint,
    pub decoder_count: c_uint,
    pub encoder_count: c_uint,
    pub jpeg_count: c_uint,
    pub ofa_count: c_uint,
    pub memory_size_mb: u64,
    pub name: [c_char; 96],
}

#[repr(C)]
pub struct GiProfileInfoV3 {
    pub version: c_uint,
    pub id: c_uint,
    pub slice_count: c_uint,
    pub instance_count: c_uint,
    pub multiprocessor_count: c_uint,
    pub copy_engine_count: c_uint,
    pub decoder_count: c_uint,
    pub encoder_count: c_uint,
    pub jpeg_count: c_uint,
    pub ofa_count: c_uint,
    pub memory_size_mb: u64,
    pub name: [c_char; 96],
    pub capabilities: c_uint,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct Placement {
    pub start: c_uint,
    pub size: c_uint,
}

#[repr(C)]
pub struct GpuInstanceInfo {
    pub device: *mut c_void,
    pub id: c_uint,
    pub profile_id: c_uint,
    pub placement: Placement,
}

#[repr(C)]
pub struct CiProfileInfo {
    pub id: c_uint,
    pub slice_count: c_uint,
    pub instance_count: c_uint,
    pub multiprocessor_count: c_uint,
    pub shared_copy_engine_count: c_uint,
    pub shared_decoder_count: c_uint,
    pub shared_encoder_count: c_uint,
    pub shared_jpeg_count: c_uint,
    pub shared_ofa_count: c_uint,
}

#[repr(C)]
pub struct CiProfileInfoV2 {
    pub version: c_uint,
    pub info: CiProfileInfo,
    pub name: [c_char; 96],
}

#[repr(C)]
pub struct CiProfileInfoV3 {
    pub version: c_uint,
    pub info: CiProfileInfo,
    pub name: [c_char; 96],
    pub capabilities: c_uint,
}

#[repr(C)]
pub struct ComputeInstanceInfo {
    pub device: *mut c_void,
    pub gpu_instance: *mut c_void,
    pub id: c_uint,
    pub profile_id: c_uint,
    pub placement: Placement,
}

fn name_field(s: &str) -> [c_char; 96] {
    let mut out = [0 as c_char; 96];
    for (d, b) in out.iter_mut().zip(s.bytes().take(95)) {
        *d = b as c_char;
    }
    out
}

/// What the MIG calls need to know about a device.
struct DevCtx {
    uuid: String,
    name: String,
    table: Option<&'static ModelTable>,
    mig_current: bool,
}

fn ctx(g: &Global, idx: usize) -> DevCtx {
    let d = g.scenario.as_ref().map(|s| &s.devices[idx]);
    DevCtx {
        uuid: d.map_or(String::new(), |d| d.uuid.clone()),
        name: d.map_or(String::new(), |d| d.name.clone()),
        table: d.and_then(|d| mig::table_for(&d.name)),
        mig_current: d.is_some_and(|d| d.mig_mode),
    }
}

impl DevCtx {
    /// The profile, or the NVML error for a bad id (`INVALID_ARGUMENT`), a GPU without MIG or a
    /// profile this model lacks (`NOT_SUPPORTED`).
    fn profile(&self, id: c_uint) -> MigResult<&'static GiProfileSpec> {
        let table = self.table.ok_or(NVML_ERROR_NOT_SUPPORTED)?;
        if id >= mig::GPU_INSTANCE_PROFILE_COUNT {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        table.profile(id).ok_or(NVML_ERROR_NOT_SUPPORTED)
    }
    /// `NOT_SUPPORTED` unless the GPU can do MIG and is in MIG mode now.
    fn require_mig(&self) -> MigResult<&'static ModelTable> {
        match self.table {
            Some(t) if self.mig_current => Ok(t),
            _ => Err(NVML_ERROR_NOT_SUPPORTED),
        }
    }
}

/// Runs `f` on the shared MIG state.
fn with_mig<T>(g: &mut Global, f: impl FnOnce(&mut MigState) -> MigResult<T>) -> MigResult<T> {
    let Some(scenario) = g.scenario.as_ref() else {
        return Err(NVML_ERROR_UNINITIALIZED);
    };
    let store = g.mig_store.get_or_insert_with(mig::Store::from_env);
    mig::with_state(store, &scenario.devices, f)
}

fn code<T>(r: MigResult<T>) -> NvmlReturn {
    match r {
        Ok(_) => NVML_SUCCESS,
        Err(c) => c,
    }
}

/// Runs `f` with a device handle's index and context.
fn on_device(
    device: *mut c_void,
    f: impl FnOnce(&mut Global, usize, DevCtx) -> MigResult<()>,
) -> NvmlReturn {
    with_device(device, |g, idx| {
        let c = ctx(g, idx);
        code(f(g, idx, c))
    })
}

/// Resolves a GPU-instance handle: (device index, GI id), checked against the current state.
fn on_gi(
    gi: *mut c_void,
    f: impl FnOnce(&mut Global, usize, u32, DevCtx) -> MigResult<()>,
) -> NvmlReturn {
    with_init(|g| {
        let Some(i) = index_in(&GI_HANDLES, gi) else {
            return NVML_ERROR_INVALID_ARGUMENT;
        };
        let (dev, id) = (i / GI_SLOTS, (i % GI_SLOTS) as u32);
        if let Err(c) = g.device(handle_of_dev(dev)) {
            return c;
        }
        let c = ctx(g, dev);
        let exists = with_mig(g, |s| {
            Ok(s.gpus.get(&c.uuid).and_then(|m| m.gi(id)).is_some())
        });
        match exists {
            Ok(true) => code(f(g, dev, id, c)),
            Ok(false) => NVML_ERROR_INVALID_ARGUMENT,
            Err(e) => e,
        }
    })
}

/// Resolves a compute-instance or MIG-device handle: (device index, GI id, CI id, CI uuid).
fn resolve_ci(
    g: &mut Global,
    table: &[AtomicU8],
    handle: *mut c_void,
) -> MigResult<(usize, u32, u32, String)> {
    let i = index_in(table, handle).ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
    let (dev, gi, ci) = split_ci(i);
    g.device(handle_of_dev(dev))?;
    let c = ctx(g, dev);
    let uuid = with_mig(g, |s| {
        Ok(s.gpus
            .get(&c.uuid)
            .and_then(|m| m.gi(gi))
            .and_then(|x| x.compute_instances.iter().find(|x| x.id == ci))
            .map(|x| x.uuid.clone()))
    })?;
    let uuid = uuid.ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
    Ok((dev, gi, ci, uuid))
}

fn handle_of_dev(idx: usize) -> *mut c_void {
    if idx >= MAX_DEVICES {
        return std::ptr::null_mut();
    }
    handle_of(idx)
}

/// `nvmlDeviceGetMigMode`: current = `mig_mode`, pending = `mig_mode_pending` (default
/// `mig_mode`); a GPU the fake has no MIG table for and whose scenario does not turn MIG on
/// answers `NVML_ERROR_NOT_SUPPORTED`, like a pre-Ampere GPU.
pub(crate) fn mig_mode(g: &Global, idx: usize) -> MigResult<(bool, bool)> {
    let d = &g.scenario.as_ref().ok_or(NVML_ERROR_UNINITIALIZED)?.devices[idx];
    let pending = d.mig_mode_pending.unwrap_or(d.mig_mode);
    if mig::table_for(&d.name).is_none() && !d.mig_mode && !pending {
        return Err(NVML_ERROR_NOT_SUPPORTED);
    }
    Ok((d.mig_mode, pending))
}

unsafe fn out<T>(p: *mut T, v: T) -> MigResult<()> {
    if p.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: non-null; the caller's NVML contract makes it point at a `T`.
    unsafe { p.write(v) };
    Ok(())
}

/// Tessera never changes MIG mode: the fake refuses like NVML does for an unprivileged caller.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceSetMigMode(
    device: *mut c_void,
    _mode: c_uint,
    _activation_status: *mut NvmlReturn,
) -> NvmlReturn {
    on_device(device, |_, _, _| Err(NVML_ERROR_NO_PERMISSION))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfo(
    device: *mut c_void,
    profile: c_uint,
    info: *mut GiProfileInfo,
) -> NvmlReturn {
    on_device(device, |_, _, c| {
        let p = c.profile(profile)?;
        // SAFETY: NVML contract: `info` points at the v1 struct.
        unsafe {
            out(
                info,
                GiProfileInfo {
                    id: p.id,
                    is_p2p_supported: 0,
                    slice_count: p.slice_count,
                    instance_count: p.instance_count,
                    multiprocessor_count: p.multiprocessor_count,
                    copy_engine_count: p.copy_engine_count,
                    decoder_count: p.decoder_count,
                    encoder_count: 0,
                    jpeg_count: p.jpeg_count,
                    ofa_count: p.ofa_count,
                    memory_size_mb: p.memory_mib,
                },
            )
        }
    })
}

/// v2 and v3 (told apart by `version`, as NVML does); `name` is `MIG <profile>`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfoV(
    device: *mut c_void,
    profile: c_uint,
    info: *mut GiProfileInfoV2,
) -> NvmlReturn {
    on_device(device, |_, _, c| {
        if info.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: non-null; `version` is the first field of both layouts.
        let version = unsafe { (*info).version };
        if version != GI_INFO_V2 && version != GI_INFO_V3 {
            return Err(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
        }
        let p = c.profile(profile)?;
        let name = name_field(&format!("MIG {}", p.name));
        if version == GI_INFO_V2 {
            // SAFETY: the caller's struct is a v2 (its version says so).
            unsafe {
                info.write(GiProfileInfoV2 {
                    version,
                    id: p.id,
                    is_p2p_supported: 0,
                    slice_count: p.slice_count,
                    instance_count: p.instance_count,
                    multiprocessor_count: p.multiprocessor_count,
                    copy_engine_count: p.copy_engine_count,
                    decoder_count: p.decoder_count,
                    encoder_count: 0,
                    jpeg_count: p.jpeg_count,
                    ofa_count: p.ofa_count,
                    memory_size_mb: p.memory_mib,
                    name,
                })
            };
        } else {
            // SAFETY: the caller's struct is a v3 (its version says so).
            unsafe {
                info.cast::<GiProfileInfoV3>().write(GiProfileInfoV3 {
                    version,
                    id: p.id,
                    slice_count: p.slice_count,
                    instance_count: p.instance_count,
                    multiprocessor_count: p.multiprocessor_count,
                    copy_engine_count: p.copy_engine_count,
                    decoder_count: p.decoder_count,
                    encoder_count: 0,
                    jpeg_count: p.jpeg_count,
                    ofa_count: p.ofa_count,
                    memory_size_mb: p.memory_mib,
                    name,
                    capabilities: 0,
                })
            };
        }
        Ok(())
    })
}

/// NULL `placements` ⇒ only the count; a smaller `*count` ⇒ `INSUFFICIENT_SIZE`. Works whether or
/// not MIG is on, as NVML documents.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstancePossiblePlacements_v2(
    device: *mut c_void,
    profile: c_uint,
    placements: *mut Placement,
    count: *mut c_uint,
) -> NvmlReturn {
    on_device(device, |_, _, c| {
        let p = c.profile(profile)?;
        if count.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let n = p.placements.len();
        // SAFETY: non-null.
        let capacity = unsafe { *count } as usize;
        // SAFETY: non-null.
        unsafe { *count = n as c_uint };
        if placements.is_null() {
            return Ok(());
        }
        if capacity < n {
            return Err(NVML_ERROR_INSUFFICIENT_SIZE);
        }
        for (i, &(start, size)) in p.placements.iter().enumerate() {
            // SAFETY: the caller's array holds `capacity` ≥ n entries.
            unsafe { placements.add(i).write(Placement { start, size }) };
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceRemainingCapacity(
    device: *mut c_void,
    profile: c_uint,
    count: *mut c_uint,
) -> NvmlReturn {
    on_device(device, |g, _, c| {
        c.require_mig()?;
        let p = c.profile(profile)?;
        let n = with_mig(g, |s| Ok(s.gpus.get(&c.uuid).map_or(0, |m| m.remaining(p))))?;
        // SAFETY: NVML contract.
        unsafe { out(count, n) }
    })
}

fn create_gi(
    device: *mut c_void,
    profile: c_uint,
    placement: Option<(u32, u32)>,
    gi: *mut *mut c_void,
) -> NvmlReturn {
    on_device(device, |g, idx, c| {
        if gi.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        c.require_mig()?;
        let p = c.profile(profile)?;
        let id = with_mig(g, |s| {
            s.gpus
                .entry(c.uuid.clone())
                .or_default()
                .create_gi(p, placement)
        })?;
        // SAFETY: checked non-null.
        unsafe { out(gi, gi_handle(idx, id)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceCreateGpuInstance(
    device: *mut c_void,
    profile: c_uint,
    gi: *mut *mut c_void,
) -> NvmlReturn {
    create_gi(device, profile, None, gi)
}

/// A placement that is not one of the profile's, or that overlaps a live GPU instance, gets
/// `NVML_ERROR_INSUFFICIENT_RESOURCES`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceCreateGpuInstanceWithPlacement(
    device: *mut c_void,
    profile: c_uint,
    placement: *const Placement,
    gi: *mut *mut c_void,
) -> NvmlReturn {
    if placement.is_null() {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: non-null; NVML contract.
    let p = unsafe { *placement };
    create_gi(device, profile, Some((p.start, p.size)), gi)
}

/// The caller's array must hold the profile's `instanceCount` handles (NVML's contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstances(
    device: *mut c_void,
    profile: c_uint,
    gis: *mut *mut c_void,
    count: *mut c_uint,
) -> NvmlReturn {
    on_device(device, |g, idx, c| {
        if count.is_null() || gis.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        c.require_mig()?;
        let p = c.profile(profile)?;
        let ids: Vec<u32> = with_mig(g, |s| {
            Ok(s.gpus.get(&c.uuid).map_or(Vec::new(), |m| {
                m.gpu_instances
                    .iter()
                    .filter(|x| x.profile_id == p.id)
                    .map(|x| x.id)
                    .collect()
            }))
        })?;
        for (i, id) in ids.iter().take(p.instance_count as usize).enumerate() {
            // SAFETY: the array holds `instanceCount` entries.
            unsafe { gis.add(i).write(gi_handle(idx, *id)) };
        }
        // SAFETY: checked non-null.
        unsafe { *count = ids.len().min(p.instance_count as usize) as c_uint };
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceById(
    device: *mut c_void,
    id: c_uint,
    gi: *mut *mut c_void,
) -> NvmlReturn {
    on_device(device, |g, idx, c| {
        c.require_mig()?;
        let found = with_mig(g, |s| {
            Ok(s.gpus.get(&c.uuid).and_then(|m| m.gi(id)).is_some())
        })?;
        if !found {
            return Err(NVML_ERROR_NOT_FOUND);
        }
        // SAFETY: NVML contract.
        unsafe { out(gi, gi_handle(idx, id)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetInfo(
    gi: *mut c_void,
    info: *mut GpuInstanceInfo,
) -> NvmlReturn {
    on_gi(gi, |g, dev, id, c| {
        let x = with_mig(g, |s| {
            s.gpus
                .get(&c.uuid)
                .and_then(|m| m.gi(id))
                .cloned()
                .ok_or(NVML_ERROR_INVALID_ARGUMENT)
        })?;
        // SAFETY: NVML contract.
        unsafe {
            out(
                info,
                GpuInstanceInfo {
                    device: handle_of(dev),
                    id,
                    profile_id: x.profile_id,
                    placement: Placement {
                        start: x.start,
                        size: x.size,
                    },
                },
            )
        }
    })
}

/// `NVML_ERROR_IN_USE` while the GPU instance still has compute instances.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceDestroy(gi: *mut c_void) -> NvmlReturn {
    on_gi(gi, |g, _, id, c| {
        with_mig(g, |s| {
            let m = s.gpus.entry(c.uuid.clone()).or_default();
            match m.gi(id) {
                None => Err(NVML_ERROR_INVALID_ARGUMENT),
                Some(x) if !x.compute_instances.is_empty() => Err(NVML_ERROR_IN_USE),
                Some(_) => {
                    m.gpu_instances.retain(|x| x.id != id);
                    Ok(())
                }
            }
        })
    })
}

/// The GI's profile spec.
fn gi_profile(g: &mut Global, c: &DevCtx, id: u32) -> MigResult<&'static GiProfileSpec> {
    let profile_id = with_mig(g, |s| {
        s.gpus
            .get(&c.uuid)
            .and_then(|m| m.gi(id))
            .map(|x| x.profile_id)
            .ok_or(NVML_ERROR_INVALID_ARGUMENT)
    })?;
    c.profile(profile_id)
}

/// (CI profile id, slices, instance count, SMs) of a CI profile of this GI, or the NVML error.
fn ci_profile(
    gp: &GiProfileSpec,
    profile: c_uint,
    eng_profile: c_uint,
) -> MigResult<(u32, u32, u32, u32)> {
    if profile >= mig::COMPUTE_INSTANCE_PROFILE_COUNT {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    if eng_profile != 0 {
        return Err(NVML_ERROR_NOT_SUPPORTED);
    }
    let (id, slices, count) = mig::ci_profiles(gp)
        .into_iter()
        .find(|(id, _, _)| *id == profile)
        .ok_or(NVML_ERROR_NOT_SUPPORTED)?;
    let sm = gp.multiprocessor_count / gp.slice_count.max(1) * slices;
    let sm = if slices == gp.slice_count {
        gp.multiprocessor_count
    } else {
        sm
    };
    Ok((id, slices, count, sm))
}

fn ci_info(gp: &GiProfileSpec, (id, slices, count, sm): (u32, u32, u32, u32)) -> CiProfileInfo {
    CiProfileInfo {
        id,
        slice_count: slices,
        instance_count: count,
        multiprocessor_count: sm,
        shared_copy_engine_count: gp.copy_engine_count,
        shared_decoder_count: gp.decoder_count,
        shared_encoder_count: 0,
        shared_jpeg_count: gp.jpeg_count,
        shared_ofa_count: gp.ofa_count,
    }
}

fn ci_name(gp: &GiProfileSpec, slices: u32) -> String {
    if slices == gp.slice_count {
        format!("MIG {}", gp.name)
    } else {
        format!("MIG {slices}c.{}", gp.name)
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceProfileInfo(
    gi: *mut c_void,
    profile: c_uint,
    eng_profile: c_uint,
    info: *mut CiProfileInfo,
) -> NvmlReturn {
    on_gi(gi, |g, _, id, c| {
        let gp = gi_profile(g, &c, id)?;
        let p = ci_profile(gp, profile, eng_profile)?;
        // SAFETY: NVML contract.
        unsafe { out(info, ci_info(gp, p)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceProfileInfoV(
    gi: *mut c_void,
    profile: c_uint,
    eng_profile: c_uint,
    info: *mut CiProfileInfoV2,
) -> NvmlReturn {
    on_gi(gi, |g, _, id, c| {
        if info.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: non-null; `version` comes first in both layouts.
        let version = unsafe { (*info).version };
        if version != CI_INFO_V2 && version != CI_INFO_V3 {
            return Err(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
        }
        let gp = gi_profile(g, &c, id)?;
        let p = ci_profile(gp, profile, eng_profile)?;
        let name = name_field(&ci_name(gp, p.1));
        // SAFETY: the caller's struct has the layout its version names; v3 only adds a field.
        unsafe {
            info.write(CiProfileInfoV2 {
                version,
                info: ci_info(gp, p),
                name,
            });
            if version == CI_INFO_V3 {
                (*info.cast::<CiProfileInfoV3>()).capabilities = 0;
            }
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceCreateComputeInstance(
    gi: *mut c_void,
    profile: c_uint,
    ci: *mut *mut c_void,
) -> NvmlReturn {
    on_gi(gi, |g, dev, id, c| {
        if ci.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let gp = gi_profile(g, &c, id)?;
        ci_profile(gp, profile, 0)?;
        // Fault injection: lets a test see what its caller does when the second step fails.
        if std::env::var("FAKE_NVML_FAIL_CI_CREATE").is_ok_and(|v| v == "1") {
            return Err(NVML_ERROR_INSUFFICIENT_RESOURCES);
        }
        let ci_id = with_mig(g, |s| {
            s.gpus
                .entry(c.uuid.clone())
                .or_default()
                .create_ci(&c.uuid, gp, id, profile, None)
        })?;
        // SAFETY: checked non-null.
        unsafe { out(ci, ci_handle(dev, id, ci_id)) }
    })
}

/// The caller's array must hold the CI profile's `instanceCount` handles (NVML's contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstances(
    gi: *mut c_void,
    profile: c_uint,
    cis: *mut *mut c_void,
    count: *mut c_uint,
) -> NvmlReturn {
    on_gi(gi, |g, dev, id, c| {
        if cis.is_null() || count.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let gp = gi_profile(g, &c, id)?;
        let (_, _, max, _) = ci_profile(gp, profile, 0)?;
        let ids: Vec<u32> = with_mig(g, |s| {
            Ok(s.gpus
                .get(&c.uuid)
                .and_then(|m| m.gi(id))
                .map_or(Vec::new(), |x| {
                    x.compute_instances
                        .iter()
                        .filter(|ci| ci.profile_id == profile)
                        .map(|ci| ci.id)
                        .collect()
                }))
        })?;
        let n = ids.len().min(max as usize);
        for (i, ci_id) in ids.iter().take(n).enumerate() {
            // SAFETY: the array holds `instanceCount` entries.
            unsafe { cis.add(i).write(ci_handle(dev, id, *ci_id)) };
        }
        // SAFETY: checked non-null.
        unsafe { *count = n as c_uint };
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceById(
    gi: *mut c_void,
    ci_id: c_uint,
    ci: *mut *mut c_void,
) -> NvmlReturn {
    on_gi(gi, |g, dev, id, c| {
        let found = with_mig(g, |s| {
            Ok(s.gpus
                .get(&c.uuid)
                .and_then(|m| m.gi(id))
                .is_some_and(|x| x.compute_instances.iter().any(|x| x.id == ci_id)))
        })?;
        if !found {
            return Err(NVML_ERROR_NOT_FOUND);
        }
        // SAFETY: NVML contract.
        unsafe { out(ci, ci_handle(dev, id, ci_id)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlComputeInstanceGetInfo_v2(
    ci: *mut c_void,
    info: *mut ComputeInstanceInfo,
) -> NvmlReturn {
    with_init(|g| {
        let r = (|| {
            let (dev, gi, ci_id, _) = resolve_ci(g, &CI_HANDLES, ci)?;
            let c = ctx(g, dev);
            let profile_id = with_mig(g, |s| {
                Ok(s.gpus
                    .get(&c.uuid)
                    .and_then(|m| m.gi(gi))
                    .and_then(|x| x.compute_instances.iter().find(|x| x.id == ci_id))
                    .map_or(0, |x| x.profile_id))
            })?;
            let slices = mig::ci_slices(profile_id);
            // SAFETY: NVML contract.
            unsafe {
                out(
                    info,
                    ComputeInstanceInfo {
                        device: handle_of(dev),
                        gpu_instance: gi_handle(dev, gi),
                        id: ci_id,
                        profile_id,
                        placement: Placement {
                            start: 0,
                            size: slices,
                        },
                    },
                )
            }
        })();
        code(r)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlComputeInstanceGetInfo(
    ci: *mut c_void,
    info: *mut ComputeInstanceInfo,
) -> NvmlReturn {
    // SAFETY: same contract and layout.
    unsafe { nvmlComputeInstanceGetInfo_v2(ci, info) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlComputeInstanceDestroy(ci: *mut c_void) -> NvmlReturn {
    with_init(|g| {
        let r = (|| {
            let (dev, gi, ci_id, _) = resolve_ci(g, &CI_HANDLES, ci)?;
            let c = ctx(g, dev);
            with_mig(g, |s| {
                if let Some(x) = s.gpus.get_mut(&c.uuid).and_then(|m| m.gi_mut(gi)) {
                    x.compute_instances.retain(|x| x.id != ci_id);
                }
                Ok(())
            })
        })();
        code(r)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMaxMigDeviceCount(
    device: *mut c_void,
    count: *mut c_uint,
) -> NvmlReturn {
    on_device(device, |_, _, c| {
        let n = c.table.map_or(0, |t| t.max_instances());
        // SAFETY: NVML contract.
        unsafe { out(count, n) }
    })
}

/// MIG devices in (GI id, CI id) order; an index past the last one ⇒ `NVML_ERROR_NOT_FOUND`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigDeviceHandleByIndex(
    device: *mut c_void,
    index: c_uint,
    mig_device: *mut *mut c_void,
) -> NvmlReturn {
    on_device(device, |g, idx, c| {
        let table = c.require_mig()?;
        if index >= table.max_instances() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let found = with_mig(g, |s| {
            Ok(s.gpus.get(&c.uuid).and_then(|m| {
                m.mig_devices()
                    .get(index as usize)
                    .map(|(gi, ci)| (*gi, ci.id))
            }))
        })?;
        let (gi, ci) = found.ok_or(NVML_ERROR_NOT_FOUND)?;
        // SAFETY: NVML contract.
        unsafe { out(mig_device, mig_handle(idx, gi, ci)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceIsMigDeviceHandle(
    device: *mut c_void,
    is_mig: *mut c_uint,
) -> NvmlReturn {
    with_init(|g| {
        let r = if is_mig_handle(device) {
            resolve_ci(g, &MIG_HANDLES, device).map(|_| 1)
        } else {
            g.device(device).map(|_| 0)
        };
        // SAFETY: NVML contract.
        code(r.and_then(|v| unsafe { out(is_mig, v) }))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
    mig_device: *mut c_void,
    device: *mut *mut c_void,
) -> NvmlReturn {
    with_init(|g| {
        let r = resolve_ci(g, &MIG_HANDLES, mig_device);
        // SAFETY: NVML contract.
        code(r.and_then(|(dev, ..)| unsafe { out(device, handle_of(dev)) }))
    })
}

/// On a GPU handle: `NVML_ERROR_NOT_SUPPORTED`, as NVML answers for a non-MIG device.
fn instance_id(device: *mut c_void, id: *mut c_uint, ci: bool) -> NvmlReturn {
    with_init(|g| {
        if !is_mig_handle(device) {
            return match g.device(device) {
                Ok(_) => NVML_ERROR_NOT_SUPPORTED,
                Err(c) => c,
            };
        }
        let r = resolve_ci(g, &MIG_HANDLES, device);
        // SAFETY: NVML contract.
        code(r.and_then(|(_, gi, c, _)| unsafe { out(id, if ci { c } else { gi }) }))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceId(
    device: *mut c_void,
    id: *mut c_uint,
) -> NvmlReturn {
    instance_id(device, id, false)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeInstanceId(
    device: *mut c_void,
    id: *mut c_uint,
) -> NvmlReturn {
    instance_id(device, id, true)
}

/// What the device calls report for a MIG device handle: (uuid, name, memory MiB).
pub(crate) fn mig_device_facts(
    g: &mut Global,
    handle: *mut c_void,
) -> MigResult<(String, String, u64)> {
    let (dev, gi, _, uuid) = resolve_ci(g, &MIG_HANDLES, handle)?;
    let c = ctx(g, dev);
    let gp = gi_profile(g, &c, gi)?;
    Ok((uuid, format!("{} MIG {}", c.name, gp.name), gp.memory_mib))
}

/// `nvmlDeviceGetHandleByUUID` for a `MIG-…` UUID.
pub(crate) fn mig_handle_by_uuid(g: &mut Global, uuid: &str) -> MigResult<*mut c_void> {
    let Some(devices) = g.scenario.as_ref().map(|s| s.devices.clone()) else {
        return Err(NVML_ERROR_UNINITIALIZED);
    };
    let found = with_mig(g, |s| {
        for (idx, d) in devices.iter().enumerate() {
            if let Some(m) = s.gpus.get(&d.uuid)
                && let Some((gi, ci)) = m.mig_devices().iter().find(|(_, c)| c.uuid == uuid)
            {
                return Ok(Some((idx, *gi, ci.id)));
            }
        }
        Ok(None)
    })?;
    let (idx, gi, ci) = found.ok_or(NVML_ERROR_NOT_FOUND)?;
    g.device(handle_of(idx))?;
    Ok(mig_handle(idx, gi, ci))
}

/// Writes a MIG device's UUID or name.
pub(crate) unsafe fn mig_string(
    handle: *mut c_void,
    name: bool,
    buf: *mut c_char,
    len: c_uint,
) -> NvmlReturn {
    with_init(|g| match mig_device_facts(g, handle) {
        // SAFETY: caller's buffer contract.
        Ok((uuid, n, _)) => unsafe { write_cstr(if name { &n } else { &uuid }, buf, len) },
        Err(c) => c,
    })
}

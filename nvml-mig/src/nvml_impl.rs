//! [`MigControl`] for [`NvmlMig`]: nvml-wrapper where it has the call, raw NVML through
//! [`Nvml::lib`] where it does not. Every raw symbol is looked up first (a missing one is
//! [`MigError::Missing`], never a panic), and every NVML answer is checked.

use std::collections::HashMap;
use std::os::raw::c_uint;

use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings::{
    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, NVML_COMPUTE_INSTANCE_PROFILE_COUNT,
    NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME, NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX,
    NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME, NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1,
    NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME, NVML_GPU_INSTANCE_PROFILE_2_SLICE_GFX,
    NVML_GPU_INSTANCE_PROFILE_2_SLICE_NO_ME, NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1,
    NVML_GPU_INSTANCE_PROFILE_4_SLICE_GFX, NVML_GPU_INSTANCE_PROFILE_COUNT, nvmlComputeInstance_t,
    nvmlComputeInstanceInfo_t, nvmlComputeInstanceProfileInfo_t, nvmlDevice_t, nvmlGpuInstance_t,
    nvmlGpuInstanceInfo_t, nvmlGpuInstancePlacement_t, nvmlGpuInstanceProfileInfo_v2_t,
    nvmlGpuInstanceProfileInfo_v3_t, nvmlReturn_t,
};

use crate::{GiProfile, MigControl, MigError, MigInstance, MigModeState, NvmlMig, Placement};

const SUCCESS: nvmlReturn_t = 0;
const ERROR_INVALID_ARGUMENT: nvmlReturn_t = 2;
const ERROR_NOT_SUPPORTED: nvmlReturn_t = 3;
const ERROR_NOT_FOUND: nvmlReturn_t = 6;
const ERROR_INSUFFICIENT_SIZE: nvmlReturn_t = 7;
const ERROR_INSUFFICIENT_RESOURCES: nvmlReturn_t = 23;
const ERROR_ARGUMENT_VERSION_MISMATCH: nvmlReturn_t = 25;

/// `NVML_STRUCT_VERSION(GpuInstanceProfileInfo, 3)` / `(…, 2)`.
const GI_PROFILE_INFO_V3: c_uint =
    (std::mem::size_of::<nvmlGpuInstanceProfileInfo_v3_t>() as c_uint) | (3 << 24);
const GI_PROFILE_INFO_V2: c_uint =
    (std::mem::size_of::<nvmlGpuInstanceProfileInfo_v2_t>() as c_uint) | (2 << 24);

/// NVML's text for the codes MIG calls return (what `nvmlErrorString` says).
fn message(code: nvmlReturn_t) -> &'static str {
    match code {
        1 => "Uninitialized",
        2 => "Invalid Argument",
        3 => "Not Supported",
        4 => "Insufficient Permissions",
        6 => "Not Found",
        7 => "Insufficient Size",
        9 => "Driver Not Loaded",
        15 => "GPU is lost",
        19 => "In use by another client",
        23 => "Insufficient resources",
        25 => "Argument version mismatch",
        _ => "Unknown Error",
    }
}

/// NVIDIA's profile name from a profile's memory, the way go-nvlib names profiles that NVML
/// gives no name for: the instance's share of the GPU's memory, rounded up to eighths, times the
/// GPU's memory in whole GiB (rounded up), rounded to the nearest GB; `<g>g.<mem>gb` plus the
/// media-engine suffix of the profile id (`+me` for `1_SLICE_REV1`/`2_SLICE_REV1`, `+me.all`,
/// `-me`, `+gfx`).
///
/// Source: github.com/NVIDIA/go-nvlib, `pkg/nvlib/device/mig_profile.go`
/// (`getMigMemorySizeGB`, and the attribute suffixes of `newMigProfile`).
pub fn profile_name(
    profile_id: u32,
    slice_count: u32,
    memory_mib: u64,
    total_bytes: u64,
) -> String {
    format!(
        "{slice_count}g.{}gb{}",
        mig_memory_size_gb(total_bytes, memory_mib),
        profile_suffix(profile_id)
    )
}

/// go-nvlib's `getMigMemorySizeGB(totalDeviceMemory, migMemorySizeMB)`.
pub fn mig_memory_size_gb(total_bytes: u64, memory_mib: u64) -> u64 {
    const FRACTION_DENOMINATOR: f64 = 8.0;
    const MIB: f64 = (1u64 << 20) as f64;
    const GIB: u64 = 1 << 30;
    if total_bytes == 0 {
        return memory_mib.div_ceil(1024);
    }
    let fraction = memory_mib as f64 * MIB / total_bytes as f64;
    let fraction = (fraction * FRACTION_DENOMINATOR).ceil() / FRACTION_DENOMINATOR;
    let total_gb = total_bytes.div_ceil(GIB) as f64;
    (fraction * total_gb).round() as u64
}

fn profile_suffix(profile_id: u32) -> &'static str {
    match profile_id {
        NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1 | NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1 => "+me",
        NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME | NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME => {
            "+me.all"
        }
        NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME | NVML_GPU_INSTANCE_PROFILE_2_SLICE_NO_ME => "-me",
        NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX
        | NVML_GPU_INSTANCE_PROFILE_2_SLICE_GFX
        | NVML_GPU_INSTANCE_PROFILE_4_SLICE_GFX => "+gfx",
        _ => "",
    }
}

/// A NUL-terminated name field, without NVML's `MIG ` prefix.
fn name_of(field: &[std::os::raw::c_char]) -> Option<String> {
    let bytes: Vec<u8> = field
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    let s = String::from_utf8_lossy(&bytes).trim().to_owned();
    let s = s.strip_prefix("MIG ").unwrap_or(&s).trim().to_owned();
    (!s.is_empty()).then_some(s)
}

/// Looks up a raw NVML symbol of the loaded library, or says it is missing.
macro_rules! sym {
    ($self:expr, $name:ident) => {
        $self
            .nvml
            .lib()
            .$name
            .as_ref()
            .map_err(|_| MigError::Missing {
                call: stringify!($name),
            })
    };
}

impl<'n> NvmlMig<'n> {
    /// MIG control on a loaded NVML.
    pub fn new(nvml: &'n Nvml) -> Self {
        NvmlMig { nvml }
    }

    fn err(call: &'static str, gpu_index: u32, code: nvmlReturn_t) -> MigError {
        MigError::Nvml {
            call,
            gpu_index,
            code,
            message: message(code).to_owned(),
        }
    }

    fn check(call: &'static str, gpu_index: u32, code: nvmlReturn_t) -> Result<(), MigError> {
        if code == SUCCESS {
            Ok(())
        } else {
            Err(Self::err(call, gpu_index, code))
        }
    }

    fn wrapper_err(call: &'static str, gpu_index: u32, e: NvmlError) -> MigError {
        if let NvmlError::FailedToLoadSymbol(_) = e {
            return MigError::Missing { call };
        }
        let message = e.to_string();
        let code: nvmlReturn_t = e.into();
        MigError::Nvml {
            call,
            gpu_index,
            code,
            message,
        }
    }

    fn device(&self, gpu_index: u32) -> Result<Device<'n>, MigError> {
        self.nvml
            .device_by_index(gpu_index)
            .map_err(|e| Self::wrapper_err("nvmlDeviceGetHandleByIndex", gpu_index, e))
    }

    /// The device, after checking that it is in MIG mode now.
    fn mig_device(&self, gpu_index: u32) -> Result<Device<'n>, MigError> {
        let mode = self.mig_mode(gpu_index)?;
        if !mode.current {
            return Err(MigError::NotMigMode {
                gpu_index,
                current: mode.current,
                pending: mode.pending,
            });
        }
        self.device(gpu_index)
    }

    /// One profile's info, or `None` when the GPU does not have it (NVML answers
    /// `NOT_SUPPORTED` or `INVALID_ARGUMENT`). Prefers `nvmlDeviceGetGpuInstanceProfileInfoV`
    /// (v3, then v2), whose answer carries NVIDIA's name; falls back to the v1 call and go-nvlib's
    /// naming rule.
    fn profile_info(
        &self,
        gpu_index: u32,
        device: &Device<'n>,
        id: u32,
        total_bytes: u64,
    ) -> Result<Option<GiProfile>, MigError> {
        // SAFETY: the handle belongs to a `Device` of this live `Nvml`.
        let handle: nvmlDevice_t = unsafe { device.handle() };
        let skip = |code| code == ERROR_NOT_SUPPORTED || code == ERROR_INVALID_ARGUMENT;
        let mut found: Option<(u32, u32, u32, u64, Option<String>)> = None;
        if let Ok(get_v) = sym!(self, nvmlDeviceGetGpuInstanceProfileInfoV) {
            // SAFETY: plain C struct; all-zero is a valid value.
            let mut v3: nvmlGpuInstanceProfileInfo_v3_t = unsafe { std::mem::zeroed() };
            v3.version = GI_PROFILE_INFO_V3;
            // SAFETY: `handle` is valid; `v3` is a live struct whose `version` tells NVML its
            // layout (the binding types the pointer as v2; v3 has the same size).
            let rc = unsafe {
                get_v(
                    handle,
                    id,
                    (&mut v3 as *mut nvmlGpuInstanceProfileInfo_v3_t).cast(),
                )
            };
            match rc {
                SUCCESS => {
                    found = Some((
                        v3.sliceCount,
                        v3.instanceCount,
                        v3.multiprocessorCount,
                        v3.memorySizeMB,
                        name_of(&v3.name),
                    ))
                }
                ERROR_ARGUMENT_VERSION_MISMATCH => {
                    // SAFETY: as above.
                    let mut v2: nvmlGpuInstanceProfileInfo_v2_t = unsafe { std::mem::zeroed() };
                    v2.version = GI_PROFILE_INFO_V2;
                    // SAFETY: `handle` is valid; `v2` is the struct the binding names.
                    let rc = unsafe { get_v(handle, id, &mut v2) };
                    match rc {
                        SUCCESS => {
                            found = Some((
                                v2.sliceCount,
                                v2.instanceCount,
                                v2.multiprocessorCount,
                                v2.memorySizeMB,
                                name_of(&v2.name),
                            ))
                        }
                        c if skip(c) => return Ok(None),
                        ERROR_ARGUMENT_VERSION_MISMATCH => {}
                        c => {
                            return Err(Self::err(
                                "nvmlDeviceGetGpuInstanceProfileInfoV",
                                gpu_index,
                                c,
                            ));
                        }
                    }
                }
                c if skip(c) => return Ok(None),
                c => {
                    return Err(Self::err(
                        "nvmlDeviceGetGpuInstanceProfileInfoV",
                        gpu_index,
                        c,
                    ));
                }
            }
        }
        let (slices, instances, sms, memory, name) = match found {
            Some(f) => f,
            None => match device.profile_info(id) {
                Ok(p) => (
                    p.slice_count,
                    p.instance_count,
                    p.multiprocessor_count,
                    p.memory_size_mb,
                    None,
                ),
                Err(NvmlError::NotSupported | NvmlError::InvalidArg) => return Ok(None),
                Err(e) => {
                    return Err(Self::wrapper_err(
                        "nvmlDeviceGetGpuInstanceProfileInfo",
                        gpu_index,
                        e,
                    ));
                }
            },
        };
        let name = name.unwrap_or_else(|| profile_name(id, slices, memory, total_bytes));
        let placements = self.placements(gpu_index, handle, id)?;
        Ok(Some(GiProfile {
            id,
            name,
            slice_count: slices,
            instance_count: instances,
            memory_mib: memory,
            multiprocessor_count: sms,
            placements,
        }))
    }

    /// `nvmlDeviceGetGpuInstancePossiblePlacements_v2` (nvml-wrapper 0.13's `possible_placements`
    /// never sets the length of its vector, so it always returns an empty list).
    fn placements(
        &self,
        gpu_index: u32,
        handle: nvmlDevice_t,
        id: u32,
    ) -> Result<Vec<Placement>, MigError> {
        let call = "nvmlDeviceGetGpuInstancePossiblePlacements_v2";
        let get = sym!(self, nvmlDeviceGetGpuInstancePossiblePlacements_v2)?;
        let mut count: c_uint = 0;
        // SAFETY: valid handle; a NULL array asks for the count only.
        let rc = unsafe { get(handle, id, std::ptr::null_mut(), &mut count) };
        if rc != SUCCESS && rc != ERROR_INSUFFICIENT_SIZE {
            return Err(Self::err(call, gpu_index, rc));
        }
        let empty = nvmlGpuInstancePlacement_t { start: 0, size: 0 };
        let mut buf = vec![empty; count as usize];
        if buf.is_empty() {
            return Ok(Vec::new());
        }
        // SAFETY: `buf` holds `count` placements, as `count` tells NVML.
        let rc = unsafe { get(handle, id, buf.as_mut_ptr(), &mut count) };
        Self::check(call, gpu_index, rc)?;
        buf.truncate(count as usize);
        Ok(buf
            .into_iter()
            .map(|p| Placement {
                start: p.start,
                size: p.size,
            })
            .collect())
    }

    /// `(CI profile id, instance count)` of the GI's compute-instance profiles (engine SHARED).
    fn ci_profiles(&self, gi: nvmlGpuInstance_t) -> Result<Vec<(u32, u32, u32)>, MigError> {
        let get = sym!(self, nvmlGpuInstanceGetComputeInstanceProfileInfo)?;
        let mut out = Vec::new();
        for id in 0..NVML_COMPUTE_INSTANCE_PROFILE_COUNT {
            // SAFETY: plain C struct; all-zero is valid.
            let mut info: nvmlComputeInstanceProfileInfo_t = unsafe { std::mem::zeroed() };
            // SAFETY: `gi` is a live GPU-instance handle; `info` is the v1 struct.
            let rc = unsafe {
                get(
                    gi,
                    id,
                    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
                    &mut info,
                )
            };
            if rc == SUCCESS {
                out.push((id, info.sliceCount, info.instanceCount));
            }
        }
        Ok(out)
    }

    /// The compute instances of a GI (all profiles), by CI id.
    fn compute_instances(
        &self,
        gpu_index: u32,
        gi: nvmlGpuInstance_t,
    ) -> Result<Vec<(u32, nvmlComputeInstance_t)>, MigError> {
        let list = sym!(self, nvmlGpuInstanceGetComputeInstances)?;
        let info = sym!(self, nvmlComputeInstanceGetInfo_v2)?;
        let mut out = Vec::new();
        for (pid, _, capacity) in self.ci_profiles(gi)? {
            let mut buf: Vec<nvmlComputeInstance_t> =
                vec![std::ptr::null_mut(); capacity.max(1) as usize];
            let mut count: c_uint = 0;
            // SAFETY: `buf` holds the profile's instance count of handles, as NVML requires.
            let rc = unsafe { list(gi, pid, buf.as_mut_ptr(), &mut count) };
            if rc == ERROR_NOT_FOUND || rc == ERROR_NOT_SUPPORTED {
                continue;
            }
            Self::check("nvmlGpuInstanceGetComputeInstances", gpu_index, rc)?;
            for &ci in buf.iter().take((count as usize).min(buf.len())) {
                // SAFETY: plain C struct; all-zero is valid.
                let mut i: nvmlComputeInstanceInfo_t = unsafe { std::mem::zeroed() };
                // SAFETY: `ci` was just returned by NVML for this GI.
                let rc = unsafe { info(ci, &mut i) };
                Self::check("nvmlComputeInstanceGetInfo_v2", gpu_index, rc)?;
                out.push((i.id, ci));
            }
        }
        out.sort_by_key(|(id, _)| *id);
        Ok(out)
    }

    /// `(GI id, CI id) → MIG UUID` of every MIG device of the GPU.
    fn mig_uuids(
        &self,
        gpu_index: u32,
        device: &Device<'n>,
    ) -> Result<HashMap<(u32, u32), String>, MigError> {
        let gi_id = sym!(self, nvmlDeviceGetGpuInstanceId)?;
        let ci_id = sym!(self, nvmlDeviceGetComputeInstanceId)?;
        let max = device
            .mig_device_count()
            .map_err(|e| Self::wrapper_err("nvmlDeviceGetMaxMigDeviceCount", gpu_index, e))?;
        let mut out = HashMap::new();
        for i in 0..max {
            let mig = match device.mig_device_by_index(i) {
                Ok(m) => m,
                Err(NvmlError::NotFound | NvmlError::InvalidArg) => continue,
                Err(e) => {
                    return Err(Self::wrapper_err(
                        "nvmlDeviceGetMigDeviceHandleByIndex",
                        gpu_index,
                        e,
                    ));
                }
            };
            // SAFETY: a handle NVML just returned, owned by this `Nvml`.
            let h = unsafe { mig.handle() };
            let (mut g, mut c): (c_uint, c_uint) = (0, 0);
            // SAFETY: valid MIG device handle, valid out pointers.
            let rc = unsafe { gi_id(h, &mut g) };
            Self::check("nvmlDeviceGetGpuInstanceId", gpu_index, rc)?;
            // SAFETY: as above.
            let rc = unsafe { ci_id(h, &mut c) };
            Self::check("nvmlDeviceGetComputeInstanceId", gpu_index, rc)?;
            let uuid = mig
                .uuid()
                .map_err(|e| Self::wrapper_err("nvmlDeviceGetUUID", gpu_index, e))?;
            out.insert((g, c), uuid);
        }
        Ok(out)
    }

    fn gi_info(
        &self,
        gpu_index: u32,
        gi: nvmlGpuInstance_t,
    ) -> Result<nvmlGpuInstanceInfo_t, MigError> {
        let get = sym!(self, nvmlGpuInstanceGetInfo)?;
        // SAFETY: plain C struct (a null device pointer is a valid value).
        let mut info: nvmlGpuInstanceInfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: `gi` is a live GPU-instance handle.
        let rc = unsafe { get(gi, &mut info) };
        Self::check("nvmlGpuInstanceGetInfo", gpu_index, rc)?;
        Ok(info)
    }

    /// Destroys every compute instance of the GI, then the GI (best effort on the CIs: the GI
    /// destroy reports what is left).
    fn destroy_gi(&self, gpu_index: u32, gi: nvmlGpuInstance_t) -> Result<(), MigError> {
        let destroy_ci = sym!(self, nvmlComputeInstanceDestroy)?;
        let destroy_gi = sym!(self, nvmlGpuInstanceDestroy)?;
        for (_, ci) in self.compute_instances(gpu_index, gi)? {
            // SAFETY: `ci` was just listed by NVML for this GI.
            let rc = unsafe { destroy_ci(ci) };
            if rc != SUCCESS && rc != ERROR_NOT_FOUND {
                return Err(Self::err("nvmlComputeInstanceDestroy", gpu_index, rc));
            }
        }
        // SAFETY: `gi` is a live GPU-instance handle.
        let rc = unsafe { destroy_gi(gi) };
        if rc == SUCCESS || rc == ERROR_NOT_FOUND {
            Ok(())
        } else {
            Err(Self::err("nvmlGpuInstanceDestroy", gpu_index, rc))
        }
    }

    /// After the GI exists: one CI spanning it, and its MIG UUID.
    fn finish_create(
        &self,
        gpu_index: u32,
        device: &Device<'n>,
        profile: &GiProfile,
        gi: nvmlGpuInstance_t,
    ) -> Result<MigInstance, MigError> {
        let info = self.gi_info(gpu_index, gi)?;
        let ci_profile = self
            .ci_profiles(gi)?
            .into_iter()
            .find(|(_, slices, _)| *slices == profile.slice_count)
            .map(|(id, _, _)| id)
            .ok_or_else(|| {
                Self::err(
                    "nvmlGpuInstanceGetComputeInstanceProfileInfo",
                    gpu_index,
                    ERROR_NOT_SUPPORTED,
                )
            })?;
        let create = sym!(self, nvmlGpuInstanceCreateComputeInstance)?;
        let ci_info = sym!(self, nvmlComputeInstanceGetInfo_v2)?;
        let mut ci: nvmlComputeInstance_t = std::ptr::null_mut();
        // SAFETY: `gi` is live; `ci` is a valid out pointer.
        let rc = unsafe { create(gi, ci_profile, &mut ci) };
        Self::check("nvmlGpuInstanceCreateComputeInstance", gpu_index, rc)?;
        // SAFETY: plain C struct.
        let mut cinfo: nvmlComputeInstanceInfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: `ci` was just created.
        let rc = unsafe { ci_info(ci, &mut cinfo) };
        Self::check("nvmlComputeInstanceGetInfo_v2", gpu_index, rc)?;
        let uuid = self
            .mig_uuids(gpu_index, device)?
            .remove(&(info.id, cinfo.id))
            .ok_or_else(|| {
                Self::err(
                    "nvmlDeviceGetMigDeviceHandleByIndex",
                    gpu_index,
                    ERROR_NOT_FOUND,
                )
            })?;
        Ok(instance(profile, &info, Some(cinfo.id), uuid))
    }
}

/// A GPU instance of `profile` as NVML describes it, with its compute instance and MIG UUID.
fn instance(
    profile: &GiProfile,
    info: &nvmlGpuInstanceInfo_t,
    compute_instance_id: Option<u32>,
    uuid: String,
) -> MigInstance {
    MigInstance {
        uuid,
        profile_id: profile.id,
        profile: profile.name.clone(),
        placement: Placement {
            start: info.placement.start,
            size: info.placement.size,
        },
        gpu_instance_id: info.id,
        compute_instance_id,
        memory_mib: profile.memory_mib,
    }
}

impl MigControl for NvmlMig<'_> {
    fn mig_mode(&self, gpu_index: u32) -> Result<MigModeState, MigError> {
        let m = self
            .device(gpu_index)?
            .mig_mode()
            .map_err(|e| Self::wrapper_err("nvmlDeviceGetMigMode", gpu_index, e))?;
        Ok(MigModeState {
            current: m.current == 1,
            pending: m.pending == 1,
        })
    }

    fn profiles(&self, gpu_index: u32) -> Result<Vec<GiProfile>, MigError> {
        let device = self.device(gpu_index)?;
        match device.mig_mode() {
            Ok(_) => {}
            Err(NvmlError::NotSupported) => return Ok(Vec::new()),
            Err(e) => return Err(Self::wrapper_err("nvmlDeviceGetMigMode", gpu_index, e)),
        }
        let total = device.memory_info().map(|m| m.total).unwrap_or(0);
        let mut out = Vec::new();
        for id in 0..NVML_GPU_INSTANCE_PROFILE_COUNT {
            if let Some(p) = self.profile_info(gpu_index, &device, id, total)? {
                out.push(p);
            }
        }
        Ok(out)
    }

    fn instances(&self, gpu_index: u32) -> Result<Vec<MigInstance>, MigError> {
        let device = self.mig_device(gpu_index)?;
        // SAFETY: the handle belongs to a `Device` of this live `Nvml`.
        let handle = unsafe { device.handle() };
        let list = sym!(self, nvmlDeviceGetGpuInstances)?;
        let uuids = self.mig_uuids(gpu_index, &device)?;
        let mut out = Vec::new();
        for profile in self.profiles(gpu_index)? {
            let mut buf: Vec<nvmlGpuInstance_t> =
                vec![std::ptr::null_mut(); profile.instance_count.max(1) as usize];
            let mut count: c_uint = 0;
            // SAFETY: `buf` holds the profile's instance count of handles, as NVML requires.
            let rc = unsafe { list(handle, profile.id, buf.as_mut_ptr(), &mut count) };
            if rc == ERROR_NOT_FOUND || rc == ERROR_NOT_SUPPORTED {
                continue;
            }
            Self::check("nvmlDeviceGetGpuInstances", gpu_index, rc)?;
            for &gi in buf.iter().take((count as usize).min(buf.len())) {
                let info = self.gi_info(gpu_index, gi)?;
                let ci = self
                    .compute_instances(gpu_index, gi)?
                    .first()
                    .map(|(id, _)| *id);
                let uuid = ci
                    .and_then(|c| uuids.get(&(info.id, c)).cloned())
                    .unwrap_or_default();
                out.push(instance(&profile, &info, ci, uuid));
            }
        }
        out.sort_by_key(|i| (i.placement, i.gpu_instance_id));
        Ok(out)
    }

    fn create(
        &self,
        gpu_index: u32,
        profile: &str,
        placement: Placement,
    ) -> Result<MigInstance, MigError> {
        let device = self.mig_device(gpu_index)?;
        let wanted = profile.strip_prefix("MIG ").unwrap_or(profile);
        let spec = self
            .profiles(gpu_index)?
            .into_iter()
            .find(|p| p.name == wanted)
            .ok_or_else(|| MigError::UnknownProfile {
                gpu_index,
                profile: profile.to_owned(),
            })?;
        let unavailable = || MigError::PlacementUnavailable {
            gpu_index,
            profile: spec.name.clone(),
            start: placement.start,
            size: placement.size,
        };
        if !spec.placements.contains(&placement) {
            return Err(unavailable());
        }
        let create = sym!(self, nvmlDeviceCreateGpuInstanceWithPlacement)?;
        // SAFETY: the handle belongs to a `Device` of this live `Nvml`.
        let handle = unsafe { device.handle() };
        let raw = nvmlGpuInstancePlacement_t {
            start: placement.start,
            size: placement.size,
        };
        let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
        // SAFETY: valid handle; `raw` and `gi` outlive the call.
        let rc = unsafe { create(handle, spec.id, &raw, &mut gi) };
        match rc {
            SUCCESS => {}
            ERROR_INSUFFICIENT_RESOURCES => return Err(unavailable()),
            c => {
                return Err(Self::err(
                    "nvmlDeviceCreateGpuInstanceWithPlacement",
                    gpu_index,
                    c,
                ));
            }
        }
        match self.finish_create(gpu_index, &device, &spec, gi) {
            Ok(i) => Ok(i),
            Err(e) => {
                // Roll back: the caller must not be left with a half-made instance. The first
                // error is the one to report.
                let _ = self.destroy_gi(gpu_index, gi);
                Err(e)
            }
        }
    }

    fn destroy(&self, gpu_index: u32, gpu_instance_id: u32) -> Result<(), MigError> {
        let device = self.mig_device(gpu_index)?;
        let by_id = sym!(self, nvmlDeviceGetGpuInstanceById)?;
        // SAFETY: the handle belongs to a `Device` of this live `Nvml`.
        let handle = unsafe { device.handle() };
        let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
        // SAFETY: valid handle and out pointer.
        let rc = unsafe { by_id(handle, gpu_instance_id, &mut gi) };
        match rc {
            SUCCESS => self.destroy_gi(gpu_index, gi),
            ERROR_NOT_FOUND => Ok(()),
            c => Err(Self::err("nvmlDeviceGetGpuInstanceById", gpu_index, c)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_nvlib_names() {
        let gib = 1u64 << 30;
        // A100-SXM4-40GB (40960 MiB), memory sizes as NVML reports them.
        assert_eq!(profile_name(0, 1, 4864, 40 * gib), "1g.5gb");
        assert_eq!(profile_name(7, 1, 4864, 40 * gib), "1g.5gb+me");
        assert_eq!(profile_name(1, 2, 9856, 40 * gib), "2g.10gb");
        assert_eq!(profile_name(2, 3, 19968, 40 * gib), "3g.20gb");
        assert_eq!(profile_name(4, 7, 40192, 40 * gib), "7g.40gb");
        // A100-SXM4-80GB.
        assert_eq!(profile_name(9, 1, 19968, 80 * gib), "1g.20gb");
        assert_eq!(profile_name(2, 3, 40192, 80 * gib), "3g.40gb");
        assert_eq!(profile_name(4, 7, 80384, 80 * gib), "7g.80gb");
        // H200 (143771 MiB).
        assert_eq!(profile_name(0, 1, 16384, 143771 << 20), "1g.18gb");
        assert_eq!(profile_name(2, 3, 66304, 143771 << 20), "3g.71gb");
        assert_eq!(mig_memory_size_gb(0, 4864), 5);
    }

    #[test]
    fn names_drop_the_mig_prefix() {
        let mut f = [0 as std::os::raw::c_char; 96];
        for (d, b) in f.iter_mut().zip(b"MIG 1g.10gb+me") {
            *d = *b as std::os::raw::c_char;
        }
        assert_eq!(name_of(&f).as_deref(), Some("1g.10gb+me"));
        assert_eq!(name_of(&[0; 4]), None);
    }
}

//! The fake's model of MIG: the GPU-instance profile tables of the GPU models it knows, the carved
//! state (GPU instances and their compute instances), and the file that shares that state between
//! processes (env `FAKE_NVML_MIG_STATE`). Pure Rust; the C entry points are in `mig_entry.rs`.

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;

use serde::{Deserialize, Serialize};

use crate::scenario::ScenarioDevice;

/// One GPU-instance profile as `nvmlDeviceGetGpuInstanceProfileInfo*` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GiProfileSpec {
    /// `NVML_GPU_INSTANCE_PROFILE_*`.
    pub id: u32,
    /// NVIDIA's name without the `MIG ` prefix.
    pub name: &'static str,
    /// Compute slices (the `g` of the name).
    pub slice_count: u32,
    pub instance_count: u32,
    pub memory_mib: u64,
    pub multiprocessor_count: u32,
    pub copy_engine_count: u32,
    pub decoder_count: u32,
    pub jpeg_count: u32,
    pub ofa_count: u32,
    /// `(start, size)` in memory slices, as `nvidia-smi mig -lgipp` prints them.
    pub placements: &'static [(u32, u32)],
}

/// The GPU instances of one GPU model.
#[derive(Debug)]
pub struct ModelTable {
    pub model: &'static str,
    pub profiles: &'static [GiProfileSpec],
}

impl ModelTable {
    pub fn profile(&self, id: u32) -> Option<&'static GiProfileSpec> {
        self.profiles.iter().find(|p| p.id == id)
    }
    pub fn profile_by_name(&self, name: &str) -> Option<&'static GiProfileSpec> {
        let name = name.strip_prefix("MIG ").unwrap_or(name);
        self.profiles.iter().find(|p| p.name == name)
    }
    /// `nvmlDeviceGetMaxMigDeviceCount`: the most instances the GPU holds (seven 1g).
    pub fn max_instances(&self) -> u32 {
        self.profiles
            .iter()
            .map(|p| p.instance_count)
            .max()
            .unwrap_or(0)
    }
}

// Placements, in memory slices (8 per GPU), from the `nvidia-smi mig -lgipp` output that NVIDIA's
// MIG User Guide prints for A100 and H100 ("Getting Started with MIG" → "List GPU Instance
// Profiles", https://docs.nvidia.com/datacenter/tesla/mig-user-guide/), identical on A100, H100
// and H200 (all have 8 memory slices and 7 compute slices):
//   Profile ID 19 (1g)    Placements: {0,1,2,3,4,5,6}:1
//   Profile ID 20 (1g+me) Placements: {0,1,2,3,4,5,6}:1
//   Profile ID 15 (1g, 2 memory slices) Placements: {0,2,4,6}:2
//   Profile ID 14 (2g)    Placements: {0,2,4}:2
//   Profile ID  9 (3g)    Placements: {0,4}:4
//   Profile ID  5 (4g)    Placement : {0}:4
//   Profile ID  0 (7g)    Placement : {0}:8
// (nvidia-smi numbers profiles its own way; the NVML ids are `NVML_GPU_INSTANCE_PROFILE_*`.)
const P_1G: &[(u32, u32)] = &[(0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (5, 1), (6, 1)];
const P_1G_2M: &[(u32, u32)] = &[(0, 2), (2, 2), (4, 2), (6, 2)];
const P_2G: &[(u32, u32)] = &[(0, 2), (2, 2), (4, 2)];
const P_3G: &[(u32, u32)] = &[(0, 4), (4, 4)];
const P_4G: &[(u32, u32)] = &[(0, 4)];
const P_7G: &[(u32, u32)] = &[(0, 8)];

pub const PROFILE_1_SLICE: u32 = 0;
pub const PROFILE_2_SLICE: u32 = 1;
pub const PROFILE_3_SLICE: u32 = 2;
pub const PROFILE_4_SLICE: u32 = 3;
pub const PROFILE_7_SLICE: u32 = 4;
pub const PROFILE_1_SLICE_REV1: u32 = 7;
pub const PROFILE_1_SLICE_REV2: u32 = 9;
/// `NVML_GPU_INSTANCE_PROFILE_COUNT` of the NVML headers nvml-wrapper-sys 0.10 binds.
pub const GPU_INSTANCE_PROFILE_COUNT: u32 = 17;
/// `NVML_COMPUTE_INSTANCE_PROFILE_COUNT`.
pub const COMPUTE_INSTANCE_PROFILE_COUNT: u32 = 8;

#[allow(clippy::too_many_arguments)]
const fn gi(
    id: u32,
    name: &'static str,
    slice_count: u32,
    instance_count: u32,
    memory_mib: u64,
    multiprocessor_count: u32,
    decoder_count: u32,
    media: u32,
    placements: &'static [(u32, u32)],
) -> GiProfileSpec {
    GiProfileSpec {
        id,
        name,
        slice_count,
        instance_count,
        memory_mib,
        multiprocessor_count,
        copy_engine_count: slice_count,
        decoder_count,
        jpeg_count: media,
        ofa_count: media,
        placements,
    }
}

/// A100-SXM4-40GB / A100-PCIE-40GB. Memory (MiB) and SMs: the `nvidia-smi mig -lgip` output of
/// an A100-SXM4-40GB in NVIDIA's MIG User Guide (1g.5gb 4.75 GiB 14 SMs, 1g.10gb and 2g.10gb 9.62
/// GiB, 3g.20gb and 4g.20gb 19.50 GiB, 7g.40gb 39.25 GiB 98 SMs), which agree with NVIDIA's
/// go-nvml mock (github.com/NVIDIA/go-nvml, pkg/nvml/mock/shared/gpus/a100.go,
/// `a100_40gb_GpuInstanceProfiles`: 4864, 9856, 19968, 40192 MB). Newer drivers print 9.75 / 19.62
/// GiB for some of these; the fake keeps the go-nvml numbers.
pub static A100_40GB: ModelTable = ModelTable {
    model: "A100-40GB",
    profiles: &[
        gi(PROFILE_1_SLICE, "1g.5gb", 1, 7, 4864, 14, 0, 0, P_1G),
        gi(
            PROFILE_1_SLICE_REV1,
            "1g.5gb+me",
            1,
            1,
            4864,
            14,
            1,
            1,
            P_1G,
        ),
        gi(
            PROFILE_1_SLICE_REV2,
            "1g.10gb",
            1,
            4,
            9856,
            14,
            1,
            0,
            P_1G_2M,
        ),
        gi(PROFILE_2_SLICE, "2g.10gb", 2, 3, 9856, 28, 1, 0, P_2G),
        gi(PROFILE_3_SLICE, "3g.20gb", 3, 2, 19968, 42, 2, 0, P_3G),
        gi(PROFILE_4_SLICE, "4g.20gb", 4, 1, 19968, 56, 2, 0, P_4G),
        gi(PROFILE_7_SLICE, "7g.40gb", 7, 1, 40192, 98, 5, 1, P_7G),
    ],
};

/// A100-SXM4-80GB / A100 80GB PCIe. Memory (MiB) and SMs: NVIDIA's go-nvml mock
/// (github.com/NVIDIA/go-nvml, pkg/nvml/mock/shared/gpus/a100.go, `a100_80gb_GpuInstanceProfiles`);
/// names from the MIG User Guide's "Supported MIG Profiles" (A100-80GB: 1g.10gb, 1g.10gb+me,
/// 1g.20gb, 2g.20gb, 3g.40gb, 4g.40gb, 7g.80gb).
pub static A100_80GB: ModelTable = ModelTable {
    model: "A100-80GB",
    profiles: &[
        gi(PROFILE_1_SLICE, "1g.10gb", 1, 7, 9856, 14, 0, 0, P_1G),
        gi(
            PROFILE_1_SLICE_REV1,
            "1g.10gb+me",
            1,
            1,
            9856,
            14,
            1,
            1,
            P_1G,
        ),
        gi(
            PROFILE_1_SLICE_REV2,
            "1g.20gb",
            1,
            4,
            19968,
            14,
            1,
            0,
            P_1G_2M,
        ),
        gi(PROFILE_2_SLICE, "2g.20gb", 2, 3, 19968, 28, 1, 0, P_2G),
        gi(PROFILE_3_SLICE, "3g.40gb", 3, 2, 40192, 42, 2, 0, P_3G),
        gi(PROFILE_4_SLICE, "4g.40gb", 4, 1, 40192, 56, 2, 0, P_4G),
        gi(PROFILE_7_SLICE, "7g.80gb", 7, 1, 80384, 98, 5, 1, P_7G),
    ],
};

/// H100 80GB (SXM5 "NVIDIA H100 80GB HBM3", PCIe). Memory and SMs: `nvidia-smi mig -lgip` outputs
/// published by NVIDIA (vGPU user guide, H100 PCIe: 1g.10gb 9.62 GiB 16 SMs, 2g.20gb 19.50 GiB 32
/// SMs, 3g.40gb 39.25 GiB 60 SMs) and an H100 SXM5 listing (7g.80gb 79.25 GiB, 132 SMs); the
/// 1g.20gb and 4g.40gb rows follow the same memory-slice sizes (2 and 4 slices), 4g has 64 SMs as
/// in go-nvml's pkg/nvml/mock/shared/gpus/h100.go. Names: MIG User Guide, "H100 MIG Profiles".
pub static H100_80GB: ModelTable = ModelTable {
    model: "H100-80GB",
    profiles: &[
        gi(PROFILE_1_SLICE, "1g.10gb", 1, 7, 9856, 16, 1, 0, P_1G),
        gi(
            PROFILE_1_SLICE_REV1,
            "1g.10gb+me",
            1,
            1,
            9856,
            16,
            1,
            1,
            P_1G,
        ),
        gi(
            PROFILE_1_SLICE_REV2,
            "1g.20gb",
            1,
            4,
            19968,
            16,
            1,
            0,
            P_1G_2M,
        ),
        gi(PROFILE_2_SLICE, "2g.20gb", 2, 3, 19968, 32, 2, 0, P_2G),
        gi(PROFILE_3_SLICE, "3g.40gb", 3, 2, 40192, 60, 3, 0, P_3G),
        gi(PROFILE_4_SLICE, "4g.40gb", 4, 1, 40192, 64, 4, 0, P_4G),
        gi(PROFILE_7_SLICE, "7g.80gb", 7, 1, 81152, 132, 7, 1, P_7G),
    ],
};

/// H200 141GB ("NVIDIA H200"). Names and instance counts: MIG User Guide, "H200 MIG Profiles"
/// (1g.18gb ×7, 1g.18gb+me ×1, 1g.35gb ×4, 2g.35gb ×3, 3g.71gb ×2, 4g.71gb ×1, 7g.141gb ×1).
/// UNCONFIRMED memory sizes: 1g.18gb = 16384 MiB follows two published H200 listings ("MIG
/// 1g.18gb … 16.00 GiB", "16.0 GiB usable"); the others are derived from it the way the A100/H100
/// sizes grow (2 slices = 2×1g + 256 MiB, 4 slices = 2×2-slice + 256 MiB, 8 slices = 2×4-slice).
/// go-nvml's mock (pkg/nvml/mock/shared/gpus/h200.go) uses round numbers instead (18432, 35840,
/// 72704, 144384), which exceed 1/8 of the H200's 143771 MiB and so would make NVIDIA's own
/// name rule (go-nvlib getMigMemorySizeGB) call the 1g profile "1g.35gb". SMs as on H100.
pub static H200_141GB: ModelTable = ModelTable {
    model: "H200-141GB",
    profiles: &[
        gi(PROFILE_1_SLICE, "1g.18gb", 1, 7, 16384, 16, 1, 0, P_1G),
        gi(
            PROFILE_1_SLICE_REV1,
            "1g.18gb+me",
            1,
            1,
            16384,
            16,
            1,
            1,
            P_1G,
        ),
        gi(
            PROFILE_1_SLICE_REV2,
            "1g.35gb",
            1,
            4,
            33024,
            16,
            1,
            0,
            P_1G_2M,
        ),
        gi(PROFILE_2_SLICE, "2g.35gb", 2, 3, 33024, 32, 2, 0, P_2G),
        gi(PROFILE_3_SLICE, "3g.71gb", 3, 2, 66304, 60, 3, 0, P_3G),
        gi(PROFILE_4_SLICE, "4g.71gb", 4, 1, 66304, 64, 4, 0, P_4G),
        gi(PROFILE_7_SLICE, "7g.141gb", 7, 1, 132608, 132, 7, 1, P_7G),
    ],
};

/// The table for a device name as NVML reports it, or `None` (the GPU cannot do MIG, as far as
/// the fake knows).
pub fn table_for(name: &str) -> Option<&'static ModelTable> {
    let n = name.to_ascii_uppercase();
    if n.contains("A100") {
        return Some(if n.contains("80GB") {
            &A100_80GB
        } else {
            &A100_40GB
        });
    }
    if n.contains("H100") && !n.contains("94GB") && !n.contains("96GB") {
        return Some(&H100_80GB);
    }
    if n.contains("H200") {
        return Some(&H200_141GB);
    }
    None
}

/// `NVML_COMPUTE_INSTANCE_PROFILE_*` for a compute-slice count.
pub fn ci_profile_for_slices(slices: u32) -> Option<u32> {
    match slices {
        1 => Some(0),
        2 => Some(1),
        3 => Some(2),
        4 => Some(3),
        7 => Some(4),
        8 => Some(5),
        6 => Some(6),
        _ => None,
    }
}

/// The compute-instance profiles of a GPU instance: `(ci profile id, slices, instance count)`.
/// Like go-nvml's mock tables: the full-GI profile, and 1-, 2- (and, in a 7g, 3-) slice ones.
pub fn ci_profiles(gi: &GiProfileSpec) -> Vec<(u32, u32, u32)> {
    let g = gi.slice_count;
    [1u32, 2, 3, 4, 7]
        .into_iter()
        .filter(|&c| c == g || (c < g && (c <= 2 || (c == 3 && g == 7))))
        .filter_map(|c| Some((ci_profile_for_slices(c)?, c, g / c)))
        .collect()
}

/// The persisted MIG state of every GPU, by GPU UUID.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct MigState {
    #[serde(default)]
    pub gpus: BTreeMap<String, GpuMig>,
}

/// One GPU's GPU instances, in creation order.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct GpuMig {
    /// How many compute instances were ever created on this GPU (makes MIG UUIDs distinct).
    #[serde(default)]
    pub creations: u64,
    #[serde(default)]
    pub gpu_instances: Vec<GiState>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct GiState {
    pub id: u32,
    pub profile_id: u32,
    pub start: u32,
    pub size: u32,
    #[serde(default)]
    pub compute_instances: Vec<CiState>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct CiState {
    pub id: u32,
    pub profile_id: u32,
    /// The MIG device's UUID (`MIG-…`).
    pub uuid: String,
}

/// Largest GPU-instance id + 1 (handles are indexed by it).
pub const MAX_GI_IDS: u32 = 16;
/// Largest compute-instance id + 1.
pub const MAX_CI_IDS: u32 = 8;

/// Why a MIG request fails, as the NVML code to return.
pub type MigResult<T> = Result<T, u32>;

impl GpuMig {
    pub fn gi(&self, id: u32) -> Option<&GiState> {
        self.gpu_instances.iter().find(|g| g.id == id)
    }
    pub fn gi_mut(&mut self, id: u32) -> Option<&mut GiState> {
        self.gpu_instances.iter_mut().find(|g| g.id == id)
    }

    fn overlaps(&self, start: u32, size: u32) -> bool {
        self.gpu_instances
            .iter()
            .any(|g| start < g.start + g.size && g.start < start + size)
    }

    /// Whether `profile` can be created at `(start, size)` now.
    pub fn placement_free(&self, profile: &GiProfileSpec, start: u32, size: u32) -> bool {
        profile.placements.contains(&(start, size))
            && !self.overlaps(start, size)
            && self.count_of(profile.id) < profile.instance_count
    }

    fn count_of(&self, profile_id: u32) -> u32 {
        self.gpu_instances
            .iter()
            .filter(|g| g.profile_id == profile_id)
            .count() as u32
    }

    /// `nvmlDeviceGetGpuInstanceRemainingCapacity`: how many more of `profile` fit, taking free
    /// placements in order.
    pub fn remaining(&self, profile: &GiProfileSpec) -> u32 {
        let mut taken: Vec<(u32, u32)> = Vec::new();
        for &(s, z) in profile.placements {
            let clash = taken.iter().any(|&(ts, tz)| s < ts + tz && ts < s + z);
            if !clash && !self.overlaps(s, z) {
                taken.push((s, z));
            }
        }
        (taken.len() as u32).min(
            profile
                .instance_count
                .saturating_sub(self.count_of(profile.id)),
        )
    }

    /// Creates a GPU instance; `NVML_ERROR_INSUFFICIENT_RESOURCES` when the placement is not one
    /// of the profile's or not free.
    pub fn create_gi(
        &mut self,
        profile: &GiProfileSpec,
        placement: Option<(u32, u32)>,
    ) -> MigResult<u32> {
        let (start, size) = match placement {
            Some(p) => p,
            None => *profile
                .placements
                .iter()
                .find(|&&(s, z)| self.placement_free(profile, s, z))
                .ok_or(crate::NVML_ERROR_INSUFFICIENT_RESOURCES)?,
        };
        if !self.placement_free(profile, start, size) {
            return Err(crate::NVML_ERROR_INSUFFICIENT_RESOURCES);
        }
        let id = (1..MAX_GI_IDS)
            .find(|id| self.gi(*id).is_none())
            .ok_or(crate::NVML_ERROR_INSUFFICIENT_RESOURCES)?;
        self.gpu_instances.push(GiState {
            id,
            profile_id: profile.id,
            start,
            size,
            compute_instances: Vec::new(),
        });
        Ok(id)
    }

    /// Creates a compute instance of `slices` compute slices in GI `gi_id`.
    pub fn create_ci(
        &mut self,
        parent_uuid: &str,
        gi_profile: &GiProfileSpec,
        gi_id: u32,
        ci_profile_id: u32,
        uuid: Option<String>,
    ) -> MigResult<u32> {
        let Some(&(_, slices, max)) = ci_profiles(gi_profile)
            .iter()
            .find(|(id, _, _)| *id == ci_profile_id)
        else {
            return Err(crate::NVML_ERROR_NOT_SUPPORTED);
        };
        self.creations += 1;
        let creation = self.creations;
        let gi = self.gi_mut(gi_id).ok_or(crate::NVML_ERROR_NOT_FOUND)?;
        let used: u32 = gi
            .compute_instances
            .iter()
            .map(|c| ci_slices(c.profile_id))
            .sum();
        let same = gi
            .compute_instances
            .iter()
            .filter(|c| c.profile_id == ci_profile_id)
            .count() as u32;
        if used + slices > gi_profile.slice_count || same >= max {
            return Err(crate::NVML_ERROR_INSUFFICIENT_RESOURCES);
        }
        let id = (0..MAX_CI_IDS)
            .find(|id| gi.compute_instances.iter().all(|c| c.id != *id))
            .ok_or(crate::NVML_ERROR_INSUFFICIENT_RESOURCES)?;
        let uuid = uuid.unwrap_or_else(|| mig_uuid(parent_uuid, gi_id, id, creation));
        gi.compute_instances.push(CiState {
            id,
            profile_id: ci_profile_id,
            uuid,
        });
        Ok(id)
    }

    /// Every (GI id, CI) pair in MIG-device order (GI id, then CI id).
    pub fn mig_devices(&self) -> Vec<(u32, &CiState)> {
        let mut v: Vec<(u32, &CiState)> = self
            .gpu_instances
            .iter()
            .flat_map(|g| g.compute_instances.iter().map(move |c| (g.id, c)))
            .collect();
        v.sort_by_key(|(g, c)| (*g, c.id));
        v
    }
}

/// Compute slices of a CI profile id.
pub fn ci_slices(ci_profile_id: u32) -> u32 {
    match ci_profile_id {
        0 => 1,
        1 => 2,
        2 => 3,
        3 => 4,
        4 => 7,
        5 => 8,
        6 => 6,
        _ => 1,
    }
}

/// A MIG UUID in NVIDIA's `MIG-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` form, derived from the parent
/// UUID, the instance ids and the creation counter (FNV-1a), so the same history gives the same
/// UUID and every creation a new one.
pub fn mig_uuid(parent: &str, gi: u32, ci: u32, creation: u64) -> String {
    let hash = |seed: u64| {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ seed;
        for b in format!("{parent}/{gi}/{ci}/{creation}").bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h
    };
    let a = hash(1);
    let b = hash(2);
    format!(
        "MIG-{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0xffff,
        b >> 48,
        b & 0xffff_ffff_ffff
    )
}

/// The state of one scenario device as seeded from its `mig_instances`.
pub fn seed_device(dev: &ScenarioDevice) -> Result<GpuMig, String> {
    let mut gpu = GpuMig::default();
    if dev.mig_instances.is_empty() {
        return Ok(gpu);
    }
    let table = table_for(&dev.name)
        .ok_or_else(|| format!("{}: mig_instances on a GPU without MIG", dev.uuid))?;
    for inst in &dev.mig_instances {
        let profile = table
            .profile_by_name(&inst.profile)
            .ok_or_else(|| format!("{}: no MIG profile {:?}", dev.uuid, inst.profile))?;
        let placement = profile
            .placements
            .iter()
            .copied()
            .find(|&(s, _)| s == inst.start)
            .ok_or_else(|| {
                format!(
                    "{}: {} cannot start at {}",
                    dev.uuid, inst.profile, inst.start
                )
            })?;
        let gi_id = gpu.create_gi(profile, Some(placement)).map_err(|_| {
            format!(
                "{}: {} at {} overlaps another instance",
                dev.uuid, inst.profile, inst.start
            )
        })?;
        if inst.ci {
            let ci_profile = ci_profile_for_slices(profile.slice_count).unwrap_or(0);
            gpu.create_ci(&dev.uuid, profile, gi_id, ci_profile, inst.uuid.clone())
                .map_err(|c| format!("{}: compute instance: NVML error {c}", dev.uuid))?;
        }
    }
    Ok(gpu)
}

/// Where the state lives: in the process, or in a file shared by processes.
#[derive(Debug)]
pub enum Store {
    Memory(MigState),
    File(std::path::PathBuf),
}

impl Store {
    pub fn from_env() -> Store {
        match std::env::var_os("FAKE_NVML_MIG_STATE").filter(|p| !p.is_empty()) {
            Some(p) => Store::File(p.into()),
            None => Store::Memory(MigState::default()),
        }
    }
}

/// Runs `f` on the state of every scenario GPU (seeded from the scenario for a GPU the state does
/// not know yet) and keeps what it changed. With a file: read-modify-write under an exclusive
/// `flock`, so processes take turns. An unreadable or corrupt file is an `NVML_ERROR_UNKNOWN`.
pub fn with_state<T>(
    store: &mut Store,
    devices: &[ScenarioDevice],
    f: impl FnOnce(&mut MigState) -> MigResult<T>,
) -> MigResult<T> {
    let seed = |state: &mut MigState| {
        for d in devices {
            if !state.gpus.contains_key(&d.uuid) {
                // Scenarios are checked at init; a bad entry here just seeds nothing.
                let gpu = seed_device(d).unwrap_or_default();
                state.gpus.insert(d.uuid.clone(), gpu);
            }
        }
    };
    match store {
        Store::Memory(state) => {
            seed(state);
            f(state)
        }
        Store::File(path) => {
            let mut file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&*path)
                .map_err(|e| {
                    eprintln!("fake-nvml: MIG state {}: {e}", path.display());
                    crate::NVML_ERROR_UNKNOWN
                })?;
            let _lock = Flock::exclusive(&file)?;
            let mut text = String::new();
            file.read_to_string(&mut text)
                .map_err(|_| crate::NVML_ERROR_UNKNOWN)?;
            let mut state: MigState = if text.trim().is_empty() {
                MigState::default()
            } else {
                serde_json::from_str(&text).map_err(|e| {
                    eprintln!("fake-nvml: MIG state {} is corrupt: {e}", path.display());
                    crate::NVML_ERROR_UNKNOWN
                })?
            };
            let before = state.clone();
            seed(&mut state);
            let out = f(&mut state);
            if state != before {
                let json =
                    serde_json::to_string_pretty(&state).map_err(|_| crate::NVML_ERROR_UNKNOWN)?;
                file.set_len(0).map_err(|_| crate::NVML_ERROR_UNKNOWN)?;
                file.seek(SeekFrom::Start(0))
                    .map_err(|_| crate::NVML_ERROR_UNKNOWN)?;
                file.write_all(json.as_bytes())
                    .and_then(|()| file.write_all(b"\n"))
                    .and_then(|()| file.sync_data())
                    .map_err(|_| crate::NVML_ERROR_UNKNOWN)?;
            }
            out
        }
    }
}

/// An exclusive `flock` held until dropped.
struct Flock(std::os::fd::RawFd);

impl Flock {
    fn exclusive(file: &std::fs::File) -> MigResult<Flock> {
        let fd = file.as_raw_fd();
        loop {
            // SAFETY: `fd` is an open descriptor owned by `file`, which outlives the lock.
            let rc = unsafe { libc::flock(fd, libc::LOCK_EX) };
            if rc == 0 {
                return Ok(Flock(fd));
            }
            if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                return Err(crate::NVML_ERROR_UNKNOWN);
            }
        }
    }
}

impl Drop for Flock {
    fn drop(&mut self) {
        // SAFETY: the descriptor is still open (the file is dropped after the lock).
        unsafe { libc::flock(self.0, libc::LOCK_UN) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_are_consistent() {
        for t in [&A100_40GB, &A100_80GB, &H100_80GB, &H200_141GB] {
            for p in t.profiles {
                assert!(!p.placements.is_empty(), "{} {}", t.model, p.name);
                assert!(p.placements.iter().all(|&(s, z)| s + z <= 8));
                assert!(
                    ci_profiles(p)
                        .iter()
                        .any(|&(_, c, n)| c == p.slice_count && n == 1)
                );
            }
        }
        assert_eq!(
            table_for("NVIDIA A100-SXM4-80GB").unwrap().model,
            "A100-80GB"
        );
        assert_eq!(
            table_for("NVIDIA A100 80GB PCIe").unwrap().model,
            "A100-80GB"
        );
        assert_eq!(
            table_for("NVIDIA A100-SXM4-40GB").unwrap().model,
            "A100-40GB"
        );
        assert_eq!(
            table_for("NVIDIA H100 80GB HBM3").unwrap().model,
            "H100-80GB"
        );
        assert_eq!(table_for("NVIDIA H200").unwrap().model, "H200-141GB");
        assert!(table_for("Tesla T4").is_none());
    }

    #[test]
    fn placements_and_capacity() {
        let mut g = GpuMig::default();
        let p3 = A100_80GB.profile_by_name("3g.40gb").unwrap();
        let p1 = A100_80GB.profile_by_name("1g.10gb").unwrap();
        assert_eq!(g.remaining(p3), 2);
        assert_eq!(g.remaining(p1), 7);
        g.create_gi(p3, Some((4, 4))).unwrap();
        assert_eq!(g.remaining(p3), 1);
        assert_eq!(g.remaining(p1), 4);
        assert_eq!(
            g.create_gi(p1, Some((5, 1))),
            Err(crate::NVML_ERROR_INSUFFICIENT_RESOURCES)
        );
        assert_eq!(
            g.create_gi(p3, Some((1, 4))),
            Err(crate::NVML_ERROR_INSUFFICIENT_RESOURCES)
        );
        assert_ne!(mig_uuid("GPU-a", 1, 0, 1), mig_uuid("GPU-a", 1, 0, 2));
        assert!(mig_uuid("GPU-a", 1, 0, 1).starts_with("MIG-"));
        assert_eq!(mig_uuid("GPU-a", 1, 0, 1).len(), 40);
    }
}

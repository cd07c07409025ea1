//! Discovered GPUs → what the plugin advertises: kubelet replicas (`<UUID>-<i>`, contract §6.2)
//! and the node register annotation (contract §2.1). Pure: no NVML, no I/O.

use hami_contract::config::{FilterDevices, MigProfileAllow, NvidiaConfig, allowed_profiles};
use hami_contract::mig::{MigPlacement, MigProfile, encode_profiles, profile_core};
use hami_contract::node::{MODE_HAMI_CORE, NodeDevice, model_type_name};
use kubelet_proto::deviceplugin::v1beta1 as dp;

/// One physical GPU as NVML (or a fake) reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuInfo {
    /// `GPU-…` UUID.
    pub uuid: String,
    /// NVML index.
    pub index: u32,
    /// NVML product name, e.g. `Tesla T4`.
    pub name: String,
    /// Total memory in MiB; `None` when NVML cannot tell (unified-memory GPUs).
    pub memory_total_mib: Option<u32>,
    /// PCI bus id, e.g. `00000000:3B:00.0`.
    pub pci_bus_id: String,
    /// NUMA node from sysfs; `None` when unknown or negative.
    pub numa_node: Option<u32>,
    /// MIG mode is enabled on this GPU.
    pub mig_enabled: bool,
    /// What the GPU can be carved into and what is carved, when MIG mode is enabled now and
    /// stays enabled after a reset (read only then).
    pub mig: Option<MigLayout>,
}

/// The operating mode of a node whose GPUs are carved into MIG instances on demand.
pub const MODE_MIG: &str = "mig";

/// What a GPU already carved into MIG instances offers on a node in operating mode `hami-core`
/// (NVIDIA's device plugin's `--mig-strategy`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum MigStrategy {
    /// Nothing: the GPU is not advertised.
    #[default]
    None,
    /// Each instance as one `nvidia.com/gpu` device of its own, never shared.
    Single,
    /// Each instance as a device of `nvidia.com/mig-<profile>`.
    Mixed,
}

/// NVML's placement in the contract's type (whose `overlaps` is the one overlap rule).
pub fn contract_placement(p: nvml_mig::Placement) -> MigPlacement {
    MigPlacement {
        start: p.start,
        size: p.size,
    }
}

/// The kubelet resource of a MIG profile under the `mixed` strategy (NVIDIA's names).
pub fn mig_resource_name(profile: &str) -> String {
    format!("nvidia.com/mig-{}", profile.replace('+', "."))
}

/// A GPU in MIG mode as NVML reports it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MigLayout {
    /// Every GPU-instance profile the GPU supports, with its placements on an empty GPU.
    pub profiles: Vec<nvml_mig::GiProfile>,
    /// The instances carved now (by Tessera or anyone else).
    pub instances: Vec<nvml_mig::MigInstance>,
}

/// The settings that shape what the plugin advertises, after per-node overrides.
#[derive(Debug, Clone, PartialEq)]
pub struct AdvertiseSettings {
    pub split_count: u32,
    pub memory_scaling: f64,
    pub core_scaling: f64,
    pub pre_configured_memory_mib: u32,
    pub enable_numa_topology: bool,
    pub filter: FilterDevices,
    pub operating_mode: String,
    /// `migProfileAllowlist`: the profiles a GPU in MIG mode offers, by model.
    pub mig_allowlist: Vec<MigProfileAllow>,
    /// `--mig-strategy` (operating mode `hami-core` only).
    pub mig_strategy: MigStrategy,
}

impl AdvertiseSettings {
    /// `cfg` must already carry the per-node override ([`NvidiaConfig::with_node_override`]);
    /// `filter` and `mode` come from the node entry (they have no YAML equivalent).
    pub fn new(cfg: &NvidiaConfig, filter: FilterDevices, operating_mode: &str) -> Self {
        AdvertiseSettings {
            split_count: cfg.device_split_count,
            memory_scaling: cfg.device_memory_scaling,
            core_scaling: cfg.device_core_scaling,
            pre_configured_memory_mib: cfg.pre_configured_device_memory,
            enable_numa_topology: cfg.enable_numa_topology,
            filter,
            operating_mode: if operating_mode.is_empty() {
                MODE_HAMI_CORE.to_owned()
            } else {
                operating_mode.to_owned()
            },
            mig_allowlist: cfg.mig_profile_allowlist.clone(),
            mig_strategy: MigStrategy::None,
        }
    }
}

/// A GPU the plugin manages, with its registered (scaled) capacity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManagedGpu {
    pub uuid: String,
    pub index: u32,
    /// `NVIDIA-` prefixed model name.
    pub model_type: String,
    /// Registered memory in MiB after scaling.
    pub devmem: u32,
    /// Registered cores (scaling × 100).
    pub devcore: u32,
    pub numa: Option<u32>,
    pub replicas: u32,
    pub mode: String,
    /// MIG mode only: the allowed profiles with the placements the scheduler may choose.
    pub mig_profiles: Vec<MigProfile>,
}

/// Why a discovered GPU is not advertised. Each one is logged; none stops the others.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SkippedGpu {
    #[error("GPU {uuid} (index {index}) is hidden by filterdevices in the node configuration")]
    Filtered { uuid: String, index: u32 },
    #[error(
        "GPU {uuid} (index {index}) has MIG mode enabled, and a MIG GPU is not shared through the shim on a node in operating mode {mode}; it is not advertised (--mig-strategy single or mixed offers its carved instances; operatingmode: mig in the node configuration carves them on demand)"
    )]
    MigEnabled {
        uuid: String,
        index: u32,
        mode: String,
    },
    #[error(
        "GPU {uuid} (index {index}) is in MIG mode, but a change of its MIG mode waits for a GPU reset or its MIG layout could not be read (logged above); it is not advertised until then (Tessera never changes MIG mode)"
    )]
    MigModePending { uuid: String, index: u32 },
    #[error(
        "GPU {uuid} (index {index}) is in MIG mode: its carved instances are offered as nvidia.com/mig-<profile> devices (--mig-strategy mixed), not as nvidia.com/gpu"
    )]
    MigMixed { uuid: String, index: u32 },
    #[error(
        "GPU {uuid} (index {index}, {model}) is in MIG mode but offers no MIG profile: migProfileAllowlist has no entry for this model, or none of its profiles exists on this GPU"
    )]
    MigNoProfiles {
        uuid: String,
        index: u32,
        model: String,
    },
    #[error(
        "GPU {uuid} (index {index}): NVML cannot report its memory and preConfiguredDeviceMemory is 0; set preConfiguredDeviceMemory"
    )]
    UnknownMemory { uuid: String, index: u32 },
}

/// Invalid settings: the plugin refuses to start rather than advertise nonsense.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SettingsError {
    #[error("deviceSplitCount must be at least 1, got {0}")]
    SplitCount(u32),
    #[error("deviceMemoryScaling must be a positive finite number, got {0}")]
    MemoryScaling(f64),
    #[error("deviceCoreScaling must be a positive finite number, got {0}")]
    CoreScaling(f64),
}

impl AdvertiseSettings {
    pub fn validate(&self) -> Result<(), SettingsError> {
        if self.split_count == 0 {
            return Err(SettingsError::SplitCount(self.split_count));
        }
        if !(self.memory_scaling.is_finite() && self.memory_scaling > 0.0) {
            return Err(SettingsError::MemoryScaling(self.memory_scaling));
        }
        if !(self.core_scaling.is_finite() && self.core_scaling > 0.0) {
            return Err(SettingsError::CoreScaling(self.core_scaling));
        }
        Ok(())
    }
}

/// Applies config to discovered GPUs: filters, MIG, memory fallback and scaling. `owned_mig`
/// tells whether a carved MIG instance (by its `MIG-…` UUID) is one Tessera carved for a pod;
/// placements overlapping any other instance are not offered.
pub fn plan_gpus(
    gpus: &[GpuInfo],
    settings: &AdvertiseSettings,
    owned_mig: &dyn Fn(&str) -> bool,
) -> (Vec<ManagedGpu>, Vec<SkippedGpu>) {
    let mut managed = Vec::new();
    let mut skipped = Vec::new();
    for gpu in gpus {
        if settings.filter.hides(&gpu.uuid, gpu.index) {
            skipped.push(SkippedGpu::Filtered {
                uuid: gpu.uuid.clone(),
                index: gpu.index,
            });
            continue;
        }
        if gpu.mig_enabled {
            if settings.operating_mode != MODE_MIG && settings.mig_strategy == MigStrategy::Single {
                match static_instances(gpu) {
                    Ok(instances) => managed.extend(instances.into_iter().map(|(_, d)| d)),
                    Err(s) => skipped.push(s),
                }
                continue;
            }
            if settings.operating_mode != MODE_MIG && settings.mig_strategy == MigStrategy::Mixed {
                skipped.push(SkippedGpu::MigMixed {
                    uuid: gpu.uuid.clone(),
                    index: gpu.index,
                });
                continue;
            }
            match plan_mig_gpu(gpu, settings, owned_mig) {
                Ok(m) => managed.push(m),
                Err(s) => skipped.push(s),
            }
            continue;
        }
        let total = match gpu.memory_total_mib.filter(|m| *m > 0) {
            Some(m) => m,
            None if settings.pre_configured_memory_mib > 0 => settings.pre_configured_memory_mib,
            None => {
                skipped.push(SkippedGpu::UnknownMemory {
                    uuid: gpu.uuid.clone(),
                    index: gpu.index,
                });
                continue;
            }
        };
        managed.push(ManagedGpu {
            uuid: gpu.uuid.clone(),
            index: gpu.index,
            model_type: model_type_name(&gpu.name),
            devmem: scale(total, settings.memory_scaling),
            devcore: scale(100, settings.core_scaling),
            numa: gpu.numa_node,
            replicas: settings.split_count,
            // A GPU not in MIG mode on a `mig` node is shared through the shim (deviation Q1:
            // Tessera never turns MIG mode on, so such a GPU would otherwise be lost).
            mode: if settings.operating_mode == MODE_MIG {
                MODE_HAMI_CORE.to_owned()
            } else {
                settings.operating_mode.clone()
            },
            mig_profiles: Vec::new(),
        });
    }
    (managed, skipped)
}

/// The carved instances of a GPU in MIG mode, each as a device of its own with one replica
/// (`single` and `mixed` strategies): the `MIG-…` UUID, the instance's memory, the parent's
/// index, and NVML's MIG device name (`NVIDIA A100-SXM4-40GB MIG 1g.5gb`) as its type. Only
/// instances with a compute instance can run work. Each comes with its profile name.
fn static_instances(gpu: &GpuInfo) -> Result<Vec<(&str, ManagedGpu)>, SkippedGpu> {
    let Some(layout) = &gpu.mig else {
        return Err(SkippedGpu::MigModePending {
            uuid: gpu.uuid.clone(),
            index: gpu.index,
        });
    };
    let model = model_type_name(&gpu.name);
    Ok(layout
        .instances
        .iter()
        .filter(|i| i.compute_instance_id.is_some())
        .map(|i| {
            let device = ManagedGpu {
                uuid: i.uuid.clone(),
                index: gpu.index,
                model_type: format!("{model} MIG {}", i.profile),
                devmem: u32::try_from(i.memory_mib).unwrap_or(u32::MAX),
                devcore: 100,
                numa: gpu.numa_node,
                replicas: 1,
                mode: MODE_HAMI_CORE.to_owned(),
                mig_profiles: Vec::new(),
            };
            (i.profile.as_str(), device)
        })
        .collect())
}

/// The `mixed` strategy: the carved instances of the node's MIG GPUs by kubelet resource
/// (`nvidia.com/mig-<profile>`), each one device of one replica.
pub fn mixed_resources(
    gpus: &[GpuInfo],
    settings: &AdvertiseSettings,
) -> std::collections::BTreeMap<String, Vec<ManagedGpu>> {
    let mut out: std::collections::BTreeMap<String, Vec<ManagedGpu>> = Default::default();
    if settings.operating_mode == MODE_MIG || settings.mig_strategy != MigStrategy::Mixed {
        return out;
    }
    for gpu in gpus.iter().filter(|g| g.mig_enabled) {
        if settings.filter.hides(&gpu.uuid, gpu.index) {
            continue;
        }
        for (profile, device) in static_instances(gpu).unwrap_or_default() {
            out.entry(mig_resource_name(profile))
                .or_default()
                .push(device);
        }
    }
    out
}

/// A GPU in MIG mode on a node in operating mode `mig`: registered with its allowed profiles
/// (HAMi's `discoverMigProfiles`), unscaled memory, `devcore` 100 and, as `count`, the largest
/// instance count of those profiles.
fn plan_mig_gpu(
    gpu: &GpuInfo,
    settings: &AdvertiseSettings,
    owned_mig: &dyn Fn(&str) -> bool,
) -> Result<ManagedGpu, SkippedGpu> {
    let model = model_type_name(&gpu.name);
    if settings.operating_mode != MODE_MIG {
        return Err(SkippedGpu::MigEnabled {
            uuid: gpu.uuid.clone(),
            index: gpu.index,
            mode: settings.operating_mode.clone(),
        });
    }
    let Some(layout) = &gpu.mig else {
        return Err(SkippedGpu::MigModePending {
            uuid: gpu.uuid.clone(),
            index: gpu.index,
        });
    };
    let no_profiles = || SkippedGpu::MigNoProfiles {
        uuid: gpu.uuid.clone(),
        index: gpu.index,
        model: model.clone(),
    };
    let allowed = allowed_profiles(&model, &settings.mig_allowlist).ok_or_else(no_profiles)?;
    let full_gpu_sms = layout
        .profiles
        .iter()
        .map(|p| p.multiprocessor_count)
        .max()
        .unwrap_or(0);
    // Slices held by instances someone else carved: the scheduler cannot know of them.
    let foreign: Vec<MigPlacement> = layout
        .instances
        .iter()
        .filter(|i| !owned_mig(&i.uuid))
        .map(|i| contract_placement(i.placement))
        .collect();
    let mut count = 0;
    let mut profiles = Vec::new();
    for name in allowed {
        let Some(p) = layout.profiles.iter().find(|p| &p.name == name) else {
            continue;
        };
        count = count.max(p.instance_count);
        profiles.push(MigProfile {
            name: p.name.clone(),
            memory_mb: u32::try_from(p.memory_mib).unwrap_or(u32::MAX),
            core: profile_core(p.multiprocessor_count, full_gpu_sms),
            slice_count: p.slice_count,
            placements: p
                .placements
                .iter()
                .map(|pl| contract_placement(*pl))
                .filter(|pl| !foreign.iter().any(|f| f.overlaps(pl)))
                .collect(),
        });
    }
    if profiles.is_empty() {
        return Err(no_profiles());
    }
    Ok(ManagedGpu {
        uuid: gpu.uuid.clone(),
        index: gpu.index,
        model_type: model,
        devmem: gpu.memory_total_mib.unwrap_or(0),
        devcore: 100,
        numa: gpu.numa_node,
        replicas: count,
        mode: MODE_MIG.to_owned(),
        mig_profiles: profiles,
    })
}

/// `floor(value × factor)`, saturating at `u32::MAX` (HAMi truncates through Go's int).
fn scale(value: u32, factor: f64) -> u32 {
    let scaled = (f64::from(value) * factor).floor();
    if scaled >= f64::from(u32::MAX) {
        u32::MAX
    } else if scaled <= 0.0 {
        0
    } else {
        scaled as u32
    }
}

/// Merges a fresh discovery into the current list. GPUs only ever appear or change here: a GPU
/// missing from a discovery stays advertised (the health check marks it unhealthy if it is
/// really gone), so a transient NVML hiccup never wipes the node's GPUs from the kubelet or from
/// the register annotation. Returns `None` when nothing changed.
pub fn merge_rediscovered(current: &[ManagedGpu], fresh: &[ManagedGpu]) -> Option<Vec<ManagedGpu>> {
    let mut merged: Vec<ManagedGpu> = current.to_vec();
    for gpu in fresh {
        match merged.iter_mut().find(|g| g.uuid == gpu.uuid) {
            Some(existing) => *existing = gpu.clone(),
            None => merged.push(gpu.clone()),
        }
    }
    merged.sort_by_key(|g| g.index);
    (merged != current).then_some(merged)
}

/// HAMi's replica id: `<UUID>-<i>`.
pub fn replica_id(uuid: &str, replica: u32) -> String {
    format!("{uuid}-{replica}")
}

/// The physical GPU UUID of a replica id (`<UUID>-<i>`), or `None` when the id is not of that form.
pub fn physical_uuid(replica_id: &str) -> Option<&str> {
    let (uuid, suffix) = replica_id.rsplit_once('-')?;
    if suffix.is_empty() || !suffix.bytes().all(|b| b.is_ascii_digit()) || uuid.is_empty() {
        return None;
    }
    Some(uuid)
}

/// The full device list for `ListAndWatch`: every replica of every GPU, with its health and,
/// when enabled, its NUMA node.
pub fn kubelet_devices(
    gpus: &[ManagedGpu],
    healthy: &dyn Fn(&str) -> bool,
    numa_topology: bool,
) -> Vec<dp::Device> {
    let mut out = Vec::new();
    for gpu in gpus {
        let health = if healthy(&gpu.uuid) {
            dp::HEALTHY
        } else {
            dp::UNHEALTHY
        };
        let topology = if numa_topology {
            gpu.numa.map(|n| dp::TopologyInfo {
                nodes: vec![dp::NumaNode { id: i64::from(n) }],
            })
        } else {
            None
        };
        for replica in 0..gpu.replicas {
            out.push(dp::Device {
                id: replica_id(&gpu.uuid, replica),
                health: health.to_owned(),
                topology: topology.clone(),
            });
        }
    }
    out
}

/// The register annotation entries (contract §2.1), health included.
pub fn register_devices(gpus: &[ManagedGpu], healthy: &dyn Fn(&str) -> bool) -> Vec<NodeDevice> {
    gpus.iter()
        .map(|gpu| NodeDevice {
            id: gpu.uuid.clone(),
            index: gpu.index,
            count: gpu.replicas,
            devmem: gpu.devmem,
            devcore: gpu.devcore,
            device_type: gpu.model_type.clone(),
            numa: gpu.numa.unwrap_or(0),
            mode: gpu.mode.clone(),
            mig_profiles: encode_profiles(&gpu.mig_profiles),
            health: healthy(&gpu.uuid),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use hami_contract::node::encode_node_devices;

    fn t4(uuid: &str, index: u32, numa: Option<u32>) -> GpuInfo {
        GpuInfo {
            uuid: uuid.to_owned(),
            index,
            name: "Tesla T4".to_owned(),
            memory_total_mib: Some(15360),
            pci_bus_id: format!("00000000:3{index}:00.0"),
            numa_node: numa,
            mig_enabled: false,
            mig: None,
        }
    }

    fn settings() -> AdvertiseSettings {
        AdvertiseSettings::new(&NvidiaConfig::default(), FilterDevices::default(), "")
    }

    #[test]
    fn default_config_registers_like_hami_example() {
        let gpus = [t4("GPU-a", 0, Some(0)), t4("GPU-b", 1, Some(1))];
        let (managed, skipped) = plan_gpus(&gpus, &settings(), &|_| false);
        assert!(skipped.is_empty());
        let json = encode_node_devices(&register_devices(&managed, &|_| true));
        assert_eq!(
            json,
            r#"[{"id":"GPU-a","count":10,"devmem":15360,"devcore":100,"type":"NVIDIA-Tesla T4","mode":"hami-core","health":true},{"id":"GPU-b","index":1,"count":10,"devmem":15360,"devcore":100,"type":"NVIDIA-Tesla T4","numa":1,"mode":"hami-core","health":true}]"#
        );
    }

    #[test]
    fn scaling_split_and_unhealthy_show_in_annotation() {
        let mut s = settings();
        s.split_count = 4;
        s.memory_scaling = 1.5;
        s.core_scaling = 2.0;
        let (managed, _) = plan_gpus(&[t4("GPU-a", 0, None)], &s, &|_| false);
        let devs = register_devices(&managed, &|_| false);
        assert_eq!(devs[0].count, 4);
        assert_eq!(devs[0].devmem, 23040);
        assert_eq!(devs[0].devcore, 200);
        assert!(!encode_node_devices(&devs).contains("health"));
    }

    #[test]
    fn filter_mig_and_unknown_memory_are_skipped_with_reasons() {
        let mut s = settings();
        s.filter = FilterDevices {
            uuid: vec!["GPU-a".into()],
            index: vec![1],
        };
        let mut mig = t4("GPU-c", 2, None);
        mig.mig_enabled = true;
        let mut unified = t4("GPU-d", 3, None);
        unified.memory_total_mib = None;
        let gpus = [
            t4("GPU-a", 0, None),
            t4("GPU-b", 1, None),
            mig,
            unified.clone(),
        ];
        let (managed, skipped) = plan_gpus(&gpus, &s, &|_| false);
        assert!(managed.is_empty());
        assert_eq!(skipped.len(), 4);
        assert!(skipped[2].to_string().contains("MIG mode"));
        assert!(skipped[3].to_string().contains("preConfiguredDeviceMemory"));

        s.pre_configured_memory_mib = 8192;
        let (managed, _) = plan_gpus(&[unified], &s, &|_| false);
        assert_eq!(managed[0].devmem, 8192);
    }

    #[test]
    fn replicas_have_hami_ids_and_numa_only_when_enabled() {
        let mut s = settings();
        s.split_count = 3;
        let (managed, _) = plan_gpus(&[t4("GPU-a", 0, Some(1))], &s, &|_| false);
        let devs = kubelet_devices(&managed, &|_| true, false);
        let ids: Vec<_> = devs.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(ids, ["GPU-a-0", "GPU-a-1", "GPU-a-2"]);
        assert!(
            devs.iter()
                .all(|d| d.topology.is_none() && d.health == "Healthy")
        );
        let devs = kubelet_devices(&managed, &|_| false, true);
        assert_eq!(devs[0].topology.as_ref().map(|t| t.nodes[0].id), Some(1));
        assert_eq!(devs[0].health, "Unhealthy");
    }

    #[test]
    fn physical_uuid_strips_numeric_suffix_only() {
        let id = "GPU-0c8e3b5a-1111-2222-3333-444455556666";
        assert_eq!(physical_uuid(&format!("{id}-9")), Some(id));
        assert_eq!(physical_uuid(&format!("{id}-12")), Some(id));
        assert_eq!(physical_uuid("GPU-x-"), None);
        assert_eq!(physical_uuid("nodash"), None);
        assert_eq!(physical_uuid("-3"), None);
    }

    #[test]
    fn rediscovery_adds_and_updates_but_never_drops() {
        let (two, _) = plan_gpus(
            &[t4("GPU-a", 0, None), t4("GPU-b", 1, None)],
            &settings(),
            &|_| false,
        );
        let (only_b, _) = plan_gpus(&[t4("GPU-b", 1, None)], &settings(), &|_| false);
        assert_eq!(
            merge_rediscovered(&two, &only_b),
            None,
            "a GPU missing from NVML stays"
        );
        assert_eq!(
            merge_rediscovered(&two, &[]),
            None,
            "an empty discovery changes nothing"
        );
        let (three, _) = plan_gpus(
            &[
                t4("GPU-a", 0, None),
                t4("GPU-b", 1, None),
                t4("GPU-c", 2, None),
            ],
            &settings(),
            &|_| false,
        );
        let merged = merge_rediscovered(&two, &three).expect("a new GPU");
        assert_eq!(merged.len(), 3);
    }

    #[test]
    fn invalid_settings_are_refused() {
        let mut s = settings();
        s.split_count = 0;
        assert!(s.validate().is_err());
        let mut s = settings();
        s.memory_scaling = f64::NAN;
        assert!(s.validate().is_err());
    }

    fn a100(uuid: &str, index: u32, instances: Vec<nvml_mig::MigInstance>) -> GpuInfo {
        GpuInfo {
            name: "NVIDIA A100-SXM4-40GB".into(),
            memory_total_mib: Some(40960),
            mig_enabled: true,
            mig: Some(MigLayout {
                profiles: crate::testing::a100_profiles(),
                instances,
            }),
            ..t4(uuid, index, None)
        }
    }

    fn mig_settings(profiles: &[&str]) -> AdvertiseSettings {
        let mut s =
            AdvertiseSettings::new(&NvidiaConfig::default(), FilterDevices::default(), "mig");
        s.memory_scaling = 2.0;
        s.mig_allowlist = vec![MigProfileAllow {
            models: vec!["A100".into()],
            profiles: profiles.iter().map(|p| p.to_string()).collect(),
        }];
        s
    }

    #[test]
    fn a_mig_gpu_registers_its_allowed_profiles_as_hamis_plugin_does() {
        // HAMi: pkg/device-plugin/nvidiadevice/nvinternal/plugin/register.go (getAPIDevices,
        // discoverMigProfiles): unscaled memory, devcore 100, count = the largest instance count.
        let gpus = [a100("GPU-a", 0, vec![]), t4("GPU-b", 1, None)];
        let (managed, skipped) = plan_gpus(
            &gpus,
            &mig_settings(&["3g.20gb", "1g.5gb", "2g.10gb"]),
            &|_| false,
        );
        assert!(skipped.is_empty());
        let json = encode_node_devices(&register_devices(&managed, &|_| true));
        assert_eq!(
            json,
            r#"[{"id":"GPU-a","count":7,"devmem":40960,"devcore":100,"type":"NVIDIA A100-SXM4-40GB","mode":"mig","migProfiles":[{"name":"3g.20gb","memoryMB":19968,"core":43,"sliceCount":3,"placements":[{"start":0,"size":4},{"start":4,"size":4}]},{"name":"1g.5gb","memoryMB":4864,"core":15,"sliceCount":1,"placements":[{"start":0,"size":1},{"start":1,"size":1},{"start":2,"size":1},{"start":3,"size":1},{"start":4,"size":1},{"start":5,"size":1},{"start":6,"size":1}]}],"health":true},{"id":"GPU-b","index":1,"count":10,"devmem":30720,"devcore":100,"type":"NVIDIA-Tesla T4","mode":"hami-core","health":true}]"#,
            "the T4 (not in MIG mode) is shared through the shim on the same node"
        );
    }

    #[test]
    fn slices_of_instances_someone_else_carved_are_not_offered() {
        let foreign = nvml_mig::MigInstance {
            uuid: "MIG-admin".into(),
            profile_id: 0,
            profile: "1g.5gb".into(),
            placement: nvml_mig::Placement { start: 5, size: 1 },
            gpu_instance_id: 9,
            compute_instance_id: Some(0),
            memory_mib: 4864,
        };
        let mine = nvml_mig::MigInstance {
            uuid: "MIG-ours".into(),
            placement: nvml_mig::Placement { start: 0, size: 1 },
            ..foreign.clone()
        };
        let gpus = [a100("GPU-a", 0, vec![foreign, mine])];
        let (managed, _) = plan_gpus(&gpus, &mig_settings(&["1g.5gb", "3g.20gb"]), &|u| {
            u == "MIG-ours"
        });
        let starts = |name: &str| -> Vec<u32> {
            managed[0]
                .mig_profiles
                .iter()
                .find(|p| p.name == name)
                .map(|p| p.placements.iter().map(|pl| pl.start).collect())
                .unwrap_or_default()
        };
        assert_eq!(starts("1g.5gb"), [0, 1, 2, 3, 4, 6]);
        assert_eq!(
            starts("3g.20gb"),
            [0],
            "4..8 holds the foreign 1g at slice 5"
        );
    }

    #[test]
    fn a_mig_gpu_is_skipped_with_a_reason_when_it_cannot_be_served() {
        let plain = AdvertiseSettings::new(&NvidiaConfig::default(), FilterDevices::default(), "");
        let (m, skipped) = plan_gpus(&[a100("GPU-a", 0, vec![])], &plain, &|_| false);
        assert!(m.is_empty());
        assert!(
            skipped[0].to_string().contains("operatingmode: mig"),
            "{}",
            skipped[0]
        );
        let (m, skipped) = plan_gpus(
            &[a100("GPU-a", 0, vec![])],
            &mig_settings(&["9g.99gb"]),
            &|_| false,
        );
        assert!(m.is_empty());
        assert!(skipped[0].to_string().contains("migProfileAllowlist"));
        let mut pending = a100("GPU-a", 0, vec![]);
        pending.mig = None;
        let (m, skipped) = plan_gpus(&[pending], &mig_settings(&["1g.5gb"]), &|_| false);
        assert!(m.is_empty());
        assert!(skipped[0].to_string().contains("reset"));
    }

    #[test]
    fn carved_instances_are_whole_devices_under_the_single_and_mixed_strategies() {
        let instance =
            |uuid: &str, profile: &str, start: u32, ci: Option<u32>| nvml_mig::MigInstance {
                uuid: uuid.into(),
                profile_id: 0,
                profile: profile.into(),
                placement: nvml_mig::Placement { start, size: 1 },
                gpu_instance_id: start + 1,
                compute_instance_id: ci,
                memory_mib: 4864,
            };
        let gpus = [
            a100(
                "GPU-a",
                0,
                vec![
                    instance("MIG-1", "1g.5gb", 0, Some(0)),
                    instance("MIG-2", "1g.5gb", 1, Some(0)),
                    instance("MIG-3", "1g.5gb", 2, None),
                ],
            ),
            t4("GPU-b", 1, None),
        ];
        let mut s = settings();
        s.mig_strategy = MigStrategy::Single;
        let (managed, skipped) = plan_gpus(&gpus, &s, &|_| false);
        assert!(skipped.is_empty());
        let ids: Vec<_> = managed
            .iter()
            .map(|m| (m.uuid.as_str(), m.replicas, m.devmem))
            .collect();
        assert_eq!(
            ids,
            [("MIG-1", 1, 4864), ("MIG-2", 1, 4864), ("GPU-b", 10, 15360)]
        );
        assert_eq!(managed[0].model_type, "NVIDIA A100-SXM4-40GB MIG 1g.5gb");
        assert!(mixed_resources(&gpus, &s).is_empty());

        s.mig_strategy = MigStrategy::Mixed;
        let (managed, skipped) = plan_gpus(&gpus, &s, &|_| false);
        assert_eq!(managed.len(), 1, "only the T4 is nvidia.com/gpu");
        assert!(skipped[0].to_string().contains("nvidia.com/mig-"));
        let mixed = mixed_resources(&gpus, &s);
        let uuids: Vec<_> = mixed["nvidia.com/mig-1g.5gb"]
            .iter()
            .map(|m| m.uuid.as_str())
            .collect();
        assert_eq!(uuids, ["MIG-1", "MIG-2"]);
        assert_eq!(mig_resource_name("1g.10gb+me"), "nvidia.com/mig-1g.10gb.me");
    }
}

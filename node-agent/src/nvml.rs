//! NVML behind a small trait. The real implementation loads `libnvidia-ml.so.1` at run time
//! (nvml-wrapper uses `dlopen`), so the plugin starts on a machine without a driver and says so.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use hami_contract::node::P2pLink;
use hami_contract::topology::{GpuLinks, NVLINK_MAX_LINKS, NodeTopology, NvLinkEnd, NvLinkRemote};
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::nv_link::IntDeviceType;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{EventSet, Nvml};

use crate::gpu::{GpuInfo, MigLayout};
use crate::health::HealthEvent;

/// Why NVML could not be used; NVML's own error is the source.
#[derive(Debug, thiserror::Error)]
pub enum InventoryError {
    #[error(
        "cannot load NVML from {} (is the NVIDIA driver installed and its library mounted? see --nvml-lib)",
        path.display()
    )]
    Load {
        path: PathBuf,
        #[source]
        source: NvmlError,
    },
    #[error("NVML {call} failed")]
    Call {
        call: &'static str,
        #[source]
        source: NvmlError,
    },
    /// NVML gave a PCIe topology level outside `nvmlGpuTopologyLevel_t`.
    #[error("NVML reports an unknown PCIe topology level {level} between GPUs {a} and {b}")]
    UnknownTopologyLevel { level: u32, a: u32, b: u32 },
    /// A thread panicked while waiting for NVML events; events are no longer watched.
    #[error("the NVML event set lock is poisoned")]
    EventSetPoisoned,
    #[error("reading the MIG layout of GPU {index} failed")]
    Mig {
        index: u32,
        #[source]
        source: nvml_mig::MigError,
    },
}

/// Usage figures for metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuSample {
    pub index: u32,
    pub uuid: String,
    pub memory_used_bytes: u64,
    pub utilization_gpu: u32,
    /// Percent of time the memory controller was busy (NVML `utilization.memory`).
    pub utilization_memory: u32,
}

/// What the plugin needs from NVML.
pub trait GpuInventory: Send + Sync + 'static {
    fn discover(&self) -> Result<Vec<GpuInfo>, InventoryError>;
    /// The GPU answers NVML (used for recovery).
    fn answers(&self, uuid: &str) -> bool;
    fn sample(&self) -> Vec<GpuSample>;
    /// Blocks up to `timeout` for the next health event; `Ok(None)` on timeout.
    fn wait_event(&self, timeout: Duration) -> Result<Option<HealthEvent>, InventoryError>;
    /// The PCIe and NVLink links between every pair of GPUs NVML lists, for
    /// `hami.io/node-nvidia-score` (contract §2.2). Read as HAMi's `links.go` reads them: a link
    /// or GPU that does not support a question (`NotSupported`, `InvalidArg`) is skipped, any
    /// other NVML error fails the whole read.
    fn topology(&self) -> Result<NodeTopology, InventoryError>;
    /// The CUDA compute capability (major, minor) of GPU `index`, when NVML tells.
    fn compute_capability(&self, _index: u32) -> Option<(u32, u32)> {
        None
    }
    /// The driver's version string (`570.133.20`), when NVML tells.
    fn driver_version(&self) -> Option<String> {
        None
    }
}

/// NVML's answer to a per-link question, with "this link or GPU cannot tell" as `None`.
fn unless_unsupported<T>(
    call: &'static str,
    answer: Result<T, NvmlError>,
) -> Result<Option<T>, InventoryError> {
    match answer {
        Ok(v) => Ok(Some(v)),
        Err(NvmlError::NotSupported | NvmlError::InvalidArg) => Ok(None),
        Err(source) => Err(InventoryError::Call { call, source }),
    }
}

fn nvlink_remote(kind: IntDeviceType) -> NvLinkRemote {
    match kind {
        IntDeviceType::Gpu => NvLinkRemote::Gpu,
        IntDeviceType::Switch => NvLinkRemote::Switch,
        IntDeviceType::Ibmnpu => NvLinkRemote::IbmNpu,
        IntDeviceType::Unknown => NvLinkRemote::Unknown,
    }
}

/// NVML through nvml-wrapper.
pub struct NvmlInventory {
    nvml: &'static Nvml,
    sysfs_root: PathBuf,
    events: Mutex<Option<EventSet<'static>>>,
}

impl std::fmt::Debug for NvmlInventory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlInventory")
            .field("sysfs_root", &self.sysfs_root)
            .finish_non_exhaustive()
    }
}

fn call_err(call: &'static str) -> impl Fn(NvmlError) -> InventoryError {
    move |source| InventoryError::Call { call, source }
}

impl NvmlInventory {
    /// Loads NVML from `lib_path` and initialises it. `sysfs_root` is `/sys` (tests: a temp dir).
    pub fn load(lib_path: &Path, sysfs_root: PathBuf) -> Result<Self, InventoryError> {
        let nvml = Nvml::builder()
            .lib_path(lib_path.as_os_str())
            .init()
            .map_err(|source| InventoryError::Load {
                path: lib_path.to_path_buf(),
                source,
            })?;
        // An event set borrows NVML for its whole life. The plugin keeps one NVML handle for
        // the life of the process, so leaking it gives the event set the lifetime it needs.
        let nvml: &'static Nvml = Box::leak(Box::new(nvml));
        let inventory = NvmlInventory {
            nvml,
            sysfs_root,
            events: Mutex::new(None),
        };
        match inventory.register_events() {
            Ok(set) => {
                if let Ok(mut guard) = inventory.events.lock() {
                    *guard = Some(set);
                }
            }
            Err(e) => {
                tracing::warn!(error = %tessera_runtime::DisplayChain(&e), "NVML events unavailable; GPU health is not watched")
            }
        }
        Ok(inventory)
    }

    fn register_events(&self) -> Result<EventSet<'static>, InventoryError> {
        let mut set = self
            .nvml
            .create_event_set()
            .map_err(call_err("nvmlEventSetCreate"))?;
        let count = self
            .nvml
            .device_count()
            .map_err(call_err("nvmlDeviceGetCount"))?;
        for i in 0..count {
            let device = self
                .nvml
                .device_by_index(i)
                .map_err(call_err("nvmlDeviceGetHandleByIndex"))?;
            set = device
                .register_events(EventTypes::CRITICAL_XID_ERROR, set)
                .map_err(|e| InventoryError::Call {
                    call: "nvmlDeviceRegisterEvents",
                    source: e.error,
                })?;
        }
        Ok(set)
    }

    /// The MIG calls on this NVML (GPU and compute instances).
    pub fn mig(&self) -> nvml_mig::NvmlMig<'static> {
        nvml_mig::NvmlMig { nvml: self.nvml }
    }

    fn mig_layout(&self, index: u32) -> Result<MigLayout, InventoryError> {
        use nvml_mig::MigControl;
        let mig = self.mig();
        let profiles = mig
            .profiles(index)
            .map_err(|source| InventoryError::Mig { index, source })?;
        let instances = mig
            .instances(index)
            .map_err(|source| InventoryError::Mig { index, source })?;
        Ok(MigLayout {
            profiles,
            instances,
        })
    }

    fn device(&self, index: u32) -> Result<nvml_wrapper::Device<'static>, InventoryError> {
        self.nvml
            .device_by_index(index)
            .map_err(call_err("nvmlDeviceGetHandleByIndex"))
    }

    /// The active NVLinks of GPU `index`, links 0..18 (`NVML_NVLINK_MAX_LINKS`).
    fn nvlinks(&self, index: u32) -> Result<Vec<NvLinkEnd>, InventoryError> {
        let device = self.device(index)?;
        let mut links = Vec::new();
        for link in 0..NVLINK_MAX_LINKS {
            let wrapper = device.link_wrapper_for(link);
            let active = unless_unsupported("nvmlDeviceGetNvLinkState", wrapper.is_active())?;
            if active != Some(true) {
                continue;
            }
            let remote_pci_bus_id = unless_unsupported(
                "nvmlDeviceGetNvLinkRemotePciInfo_v2",
                wrapper.remote_pci_info(),
            )?
            .map(|p| p.bus_id);
            let remote = unless_unsupported(
                "nvmlDeviceGetNvLinkRemoteDeviceType",
                wrapper.remote_device_type(link),
            )?
            .map(nvlink_remote);
            links.push(NvLinkEnd {
                remote_pci_bus_id,
                remote,
            });
        }
        Ok(links)
    }

    fn numa_node(&self, pci_bus_id: &str) -> Option<u32> {
        // sysfs names devices by the lower-case 4-hex-digit domain form (`0000:3b:00.0`).
        let id = pci_bus_id.to_ascii_lowercase();
        let short = if id.len() > 12 {
            &id[id.len() - 12..]
        } else {
            id.as_str()
        };
        let path = self
            .sysfs_root
            .join("bus/pci/devices")
            .join(short)
            .join("numa_node");
        let text = std::fs::read_to_string(path).ok()?;
        let n: i64 = text.trim().parse().ok()?;
        u32::try_from(n).ok()
    }
}

impl GpuInventory for NvmlInventory {
    fn discover(&self) -> Result<Vec<GpuInfo>, InventoryError> {
        let count = self
            .nvml
            .device_count()
            .map_err(call_err("nvmlDeviceGetCount"))?;
        let mut gpus = Vec::new();
        for i in 0..count {
            let d = self
                .nvml
                .device_by_index(i)
                .map_err(call_err("nvmlDeviceGetHandleByIndex"))?;
            let uuid = d.uuid().map_err(call_err("nvmlDeviceGetUUID"))?;
            let name = d.name().map_err(call_err("nvmlDeviceGetName"))?;
            let memory_total_mib = match d.memory_info() {
                Ok(m) => Some(u32::try_from(m.total / (1024 * 1024)).unwrap_or(u32::MAX)),
                Err(NvmlError::NotSupported) => None,
                Err(e) => return Err(call_err("nvmlDeviceGetMemoryInfo")(e)),
            };
            let pci_bus_id = d.pci_info().map(|p| p.bus_id).unwrap_or_default();
            let mig_mode = d.mig_mode().ok();
            let mig_enabled = mig_mode.as_ref().is_some_and(|m| m.current == 1);
            // The layout is read only for a GPU that stays in MIG mode after a reset.
            let mig = if mig_enabled && mig_mode.as_ref().is_some_and(|m| m.pending == 1) {
                match self.mig_layout(d.index().unwrap_or(i)) {
                    Ok(layout) => Some(layout),
                    Err(e) => {
                        tracing::warn!(gpu = %uuid, error = %tessera_runtime::DisplayChain(&e), "cannot read the GPU's MIG layout; it is not advertised");
                        None
                    }
                }
            } else {
                None
            };
            let numa_node = self.numa_node(&pci_bus_id);
            gpus.push(GpuInfo {
                uuid,
                index: d.index().unwrap_or(i),
                name,
                memory_total_mib,
                pci_bus_id,
                numa_node,
                mig_enabled,
                mig,
            });
        }
        Ok(gpus)
    }

    fn compute_capability(&self, index: u32) -> Option<(u32, u32)> {
        let cc = self.device(index).ok()?.cuda_compute_capability().ok()?;
        Some((u32::try_from(cc.major).ok()?, u32::try_from(cc.minor).ok()?))
    }

    fn driver_version(&self) -> Option<String> {
        self.nvml.sys_driver_version().ok()
    }

    fn answers(&self, uuid: &str) -> bool {
        // `name` works on every GPU that is present; memory info is unsupported on some
        // (unified memory), which must not read as "lost".
        self.nvml
            .device_by_uuid(uuid)
            .and_then(|d| d.name())
            .is_ok()
    }

    fn sample(&self) -> Vec<GpuSample> {
        let Ok(count) = self.nvml.device_count() else {
            return Vec::new();
        };
        (0..count)
            .filter_map(|i| {
                let d = self.nvml.device_by_index(i).ok()?;
                let utilization = d.utilization_rates().ok();
                Some(GpuSample {
                    index: i,
                    uuid: d.uuid().ok()?,
                    memory_used_bytes: d.memory_info().map(|m| m.used).unwrap_or(0),
                    utilization_gpu: utilization.as_ref().map_or(0, |u| u.gpu),
                    utilization_memory: utilization.as_ref().map_or(0, |u| u.memory),
                })
            })
            .collect()
    }

    fn wait_event(&self, timeout: Duration) -> Result<Option<HealthEvent>, InventoryError> {
        let guard = self
            .events
            .lock()
            .map_err(|_| InventoryError::EventSetPoisoned)?;
        let Some(set) = guard.as_ref() else {
            drop(guard);
            std::thread::sleep(timeout);
            return Ok(None);
        };
        let ms = u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX);
        match set.wait(ms) {
            Ok(data) => {
                // A GPU that fell off the bus no longer tells its UUID; the periodic
                // `lost_gpus` poll marks it.
                let Ok(uuid) = data.device.uuid() else {
                    return Ok(None);
                };
                let xid = match data.event_data {
                    Some(XidError::Value(x)) => x,
                    // Unknown XID: treat as critical (NVIDIA's plugin does).
                    _ => 0,
                };
                Ok(Some(HealthEvent::Xid { uuid, xid }))
            }
            Err(NvmlError::Timeout) => Ok(None),
            Err(NvmlError::GpuLost) => Ok(None),
            Err(e) => Err(call_err("nvmlEventSetWait")(e)),
        }
    }

    fn topology(&self) -> Result<NodeTopology, InventoryError> {
        self.read_topology()
    }
}

impl NvmlInventory {
    fn read_topology(&self) -> Result<NodeTopology, InventoryError> {
        let count = self
            .nvml
            .device_count()
            .map_err(call_err("nvmlDeviceGetCount"))?;
        let mut topology = NodeTopology::default();
        for i in 0..count {
            let d = self.device(i)?;
            topology.gpus.push(GpuLinks {
                uuid: d.uuid().map_err(call_err("nvmlDeviceGetUUID"))?,
                pci_bus_id: d
                    .pci_info()
                    .map_err(call_err("nvmlDeviceGetPciInfo"))?
                    .bus_id,
                nvlinks: self.nvlinks(i)?,
            });
        }
        // Both orders of each pair, as HAMi asks (NVML answers the same both ways).
        let mut pcie = BTreeMap::new();
        for a in 0..count {
            for b in (0..count).filter(|b| *b != a) {
                let level = self
                    .device(a)?
                    .topology_common_ancestor(self.device(b)?)
                    .map_err(call_err("nvmlDeviceGetTopologyCommonAncestor"))?
                    .as_c();
                let link = P2pLink::from_nvml_topology_level(level)
                    .ok_or(InventoryError::UnknownTopologyLevel { level, a, b })?;
                pcie.insert((a as usize, b as usize), link);
            }
        }
        topology.pcie = pcie;
        Ok(topology)
    }
}

/// Finds GPUs that stopped answering (GPU lost): NVML reports no event for that on every driver.
pub fn lost_gpus(inventory: &dyn GpuInventory, uuids: &[String]) -> Vec<HealthEvent> {
    uuids
        .iter()
        .filter(|u| !inventory.answers(u))
        .map(|u| HealthEvent::Lost { uuid: u.clone() })
        .collect()
}

impl crate::gpu_processes::GpuProcessSource for NvmlInventory {
    fn processes_on(
        &self,
        gpu_uuid: &str,
    ) -> Result<crate::gpu_processes::ProcessesOnGpu, crate::gpu_processes::GpuProcessError> {
        self.nvml.processes_on(gpu_uuid)
    }
}

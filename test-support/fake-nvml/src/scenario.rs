//! The scenario file (env `FAKE_NVML_SCENARIO`) and the event lines (env `FAKE_NVML_EVENTS`).
//! The format is fixed (the device plugin's tests write it); fields marked optional were added
//! later and default as documented in `README.md`.

use serde::Deserialize;

#[derive(Debug, Clone, Deserialize)]
pub struct Scenario {
    #[serde(default = "default_driver_version")]
    pub driver_version: String,
    #[serde(default = "default_cuda_driver_version")]
    pub cuda_driver_version: i32,
    pub devices: Vec<ScenarioDevice>,
    /// Optional: added to simulated-GPU pids to make "host" pids (PID-namespace tests).
    #[serde(default)]
    pub pid_offset: u32,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ScenarioDevice {
    pub uuid: String,
    #[serde(default = "default_name")]
    pub name: String,
    pub memory_total_mib: u64,
    #[serde(default)]
    pub memory_used_mib: u64,
    #[serde(default)]
    pub memory_info_unsupported: bool,
    #[serde(default)]
    pub pci_bus_id: String,
    /// MIG mode, current and pending (unless `mig_mode_pending` says otherwise).
    #[serde(default)]
    pub mig_mode: bool,
    /// Optional: the pending MIG mode (applies after a GPU reset the fake never does); default
    /// `mig_mode`.
    #[serde(default)]
    pub mig_mode_pending: Option<bool>,
    /// Optional: MIG instances carved before the test starts (seed of the MIG state).
    #[serde(default)]
    pub mig_instances: Vec<ScenarioMigInstance>,
    #[serde(default)]
    pub utilization_gpu: u32,
    #[serde(default)]
    pub utilization_memory: u32,
    #[serde(default)]
    pub processes: Vec<ScenarioProcess>,
    /// Optional: `/dev/nvidia<minor>`; defaults to the index.
    #[serde(default)]
    pub minor_number: Option<u32>,
    /// Optional: `[major, minor]`, default `[7, 5]`.
    #[serde(default)]
    pub cuda_compute_capability: Option<[i32; 2]>,
    /// Optional: the device's place in the PCIe tree, root first: CPU socket, host bridge, then
    /// the PCIe switches down to the GPU (`["cpu0", "hb0", "plx0"]`). Two devices' common
    /// ancestor follows from their paths (`README.md`); empty ⇒
    /// `nvmlDeviceGetTopologyCommonAncestor` is not supported for the device.
    #[serde(default)]
    pub pcie_path: Vec<String>,
    /// Optional: the device is on the same board as every device with the same `board`
    /// (`NVML_TOPOLOGY_INTERNAL`, e.g. the two GPUs of a Tesla K80).
    #[serde(default)]
    pub board: Option<String>,
    /// Optional: the device's NVLinks, link 0 first; empty ⇒ the NVLink calls are not supported
    /// for the device.
    #[serde(default)]
    pub nvlinks: Vec<ScenarioNvLink>,
}

/// A GPU instance (and, by default, its one compute instance) carved before the test starts.
#[derive(Debug, Clone, Deserialize)]
pub struct ScenarioMigInstance {
    /// A profile name of the GPU's model, e.g. `3g.40gb` (a `MIG ` prefix is accepted).
    pub profile: String,
    /// First memory slice: one of the profile's placements.
    pub start: u32,
    /// Optional: also create the compute instance spanning the GPU instance. Default `true`.
    #[serde(default = "default_true")]
    pub ci: bool,
    /// Optional: the MIG device's UUID; default derived from the GPU's UUID and the instance.
    #[serde(default)]
    pub uuid: Option<String>,
}

/// One NVLink of a device.
#[derive(Debug, Clone, Deserialize)]
pub struct ScenarioNvLink {
    /// The PCI bus id at the other end: the peer GPU's, or the NVSwitch's.
    pub remote_pci_bus_id: String,
    /// `gpu` (default), `switch`, `ibmnpu` or `unknown`.
    #[serde(default = "default_remote_device_type")]
    pub remote_device_type: String,
    /// Optional: `false` ⇒ `nvmlDeviceGetNvLinkState` reports the link disabled. Default `true`.
    #[serde(default = "default_true")]
    pub active: bool,
}

impl ScenarioNvLink {
    /// `nvmlIntNvLinkDeviceType_t`: GPU 0, IBMNPU 1, SWITCH 2, UNKNOWN 255.
    pub fn remote_device_type_code(&self) -> u32 {
        match self.remote_device_type.as_str() {
            "gpu" => 0,
            "ibmnpu" => 1,
            "switch" => 2,
            _ => 255,
        }
    }
}

/// `nvmlGpuTopologyLevel_t` of two devices from their scenario entries, or `None` when either
/// has no `pcie_path` (see `README.md` for the rule).
pub fn common_ancestor(a: &ScenarioDevice, b: &ScenarioDevice) -> Option<u32> {
    if a.board.is_some() && a.board == b.board {
        return Some(0);
    }
    if a.pcie_path.is_empty() || b.pcie_path.is_empty() {
        return None;
    }
    let common = a
        .pcie_path
        .iter()
        .zip(&b.pcie_path)
        .take_while(|(x, y)| x == y)
        .count();
    Some(match common {
        0 => 50,
        1 => 40,
        2 => 30,
        // Below the host bridge: both directly under the same switch, or a path through more.
        _ if a.pcie_path.len() == common && b.pcie_path.len() == common => 10,
        _ => 20,
    })
}

impl ScenarioDevice {
    pub fn compute_capability(&self) -> (i32, i32) {
        self.cuda_compute_capability.map_or((7, 5), |[a, b]| (a, b))
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct ScenarioProcess {
    pub pid: u32,
    #[serde(default)]
    pub used_memory_mib: u64,
    /// Optional: which of NVML's process lists reports it. Default `compute`.
    #[serde(default)]
    pub kind: ProcessKind,
    /// Optional: NVML cannot tell the process's memory (`NVML_VALUE_NOT_AVAILABLE`, as under
    /// Windows WDDM or without the permission to see it); `used_memory_mib` is then ignored.
    #[serde(default)]
    pub used_memory_unavailable: bool,
}

/// The NVML list a scripted process appears in. A process with contexts of two kinds (CUDA and
/// OpenGL interop) is scripted once per kind, as NVML lists it once per list.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProcessKind {
    /// `nvmlDeviceGetComputeRunningProcesses*`: a CUDA (or other compute) context; under MPS
    /// that is the MPS server, not its clients.
    #[default]
    Compute,
    /// `nvmlDeviceGetGraphicsRunningProcesses*`: an OpenGL, Vulkan or DirectX context.
    Graphics,
    /// `nvmlDeviceGetMPSComputeRunningProcesses*`: a client of the MPS server.
    Mps,
}

/// One line of the events file.
#[derive(Debug, Clone, Deserialize)]
pub struct EventLine {
    pub device: usize,
    pub kind: String,
    #[serde(default)]
    pub xid: Option<u64>,
}

fn default_driver_version() -> String {
    "550.54.15".to_owned()
}
fn default_cuda_driver_version() -> i32 {
    12040
}
fn default_remote_device_type() -> String {
    "gpu".to_owned()
}
fn default_true() -> bool {
    true
}
fn default_name() -> String {
    "Tesla T4".to_owned()
}

#[derive(Debug)]
pub enum ScenarioError {
    /// `FAKE_NVML_SCENARIO` unset or the file unreadable.
    Missing(String),
    /// The file is not a valid scenario.
    Invalid(String),
}

impl std::fmt::Display for ScenarioError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ScenarioError::Missing(m) => write!(f, "scenario missing: {m}"),
            ScenarioError::Invalid(m) => write!(f, "scenario invalid: {m}"),
        }
    }
}

impl ScenarioError {
    pub fn nvml_code(&self) -> u32 {
        match self {
            ScenarioError::Missing(_) => crate::NVML_ERROR_DRIVER_NOT_LOADED,
            ScenarioError::Invalid(_) => crate::NVML_ERROR_UNKNOWN,
        }
    }
}

/// NVML's `NVML_NVLINK_MAX_LINKS`.
pub const NVLINK_MAX_LINKS: usize = 18;

pub fn parse(text: &str) -> Result<Scenario, ScenarioError> {
    let s: Scenario =
        serde_json::from_str(text).map_err(|e| ScenarioError::Invalid(e.to_string()))?;
    if s.devices.len() > 64 {
        return Err(ScenarioError::Invalid("more than 64 devices".into()));
    }
    for d in &s.devices {
        if d.uuid.is_empty() {
            return Err(ScenarioError::Invalid("a device has an empty uuid".into()));
        }
        if d.nvlinks.len() > NVLINK_MAX_LINKS {
            return Err(ScenarioError::Invalid(format!(
                "device {} has more than {NVLINK_MAX_LINKS} nvlinks",
                d.uuid
            )));
        }
    }
    Ok(s)
}

pub fn load_from_env() -> Result<Scenario, ScenarioError> {
    let path = std::env::var_os("FAKE_NVML_SCENARIO")
        .filter(|p| !p.is_empty())
        .ok_or_else(|| ScenarioError::Missing("FAKE_NVML_SCENARIO is not set".into()))?;
    let text = std::fs::read_to_string(&path)
        .map_err(|e| ScenarioError::Missing(format!("{}: {e}", path.to_string_lossy())))?;
    parse(&text)
}

/// `"00000000:3B:00.0"` (or the short `"0000:3b:00.0"`) → (domain, bus, device).
pub fn parse_pci_bus_id(s: &str) -> Option<(u32, u32, u32)> {
    let mut parts = s.split(':');
    let domain = u32::from_str_radix(parts.next()?, 16).ok()?;
    let bus = u32::from_str_radix(parts.next()?, 16).ok()?;
    let dev_fn = parts.next()?;
    let dev = u32::from_str_radix(dev_fn.split('.').next()?, 16).ok()?;
    Some((domain, bus, dev))
}

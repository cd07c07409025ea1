//! HAMi's device configuration: `device-config.yaml` (`nvidia:` section, contract §1.4) and the
//! per-node overrides in `/config/config.json` (contract §1.5).
//!
//! Parsing is tolerant where HAMi is (unknown keys, other vendors' sections) and strict where a
//! mistake would silently change scheduling: a wrong type is an error whose message starts with
//! the key's path, e.g. `nvidia.deviceSplitCount: invalid type: string "ten", expected u32`.

use std::collections::BTreeSet;
use std::fmt;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::resources::ResourceNames;

/// Why a configuration file was refused. The message names the offending key's path.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The text is not valid YAML / JSON at all.
    #[error("{file}: {message}")]
    Syntax {
        /// `device-config.yaml` or `config.json`.
        file: &'static str,
        /// The parser's message, with line and column where it has them.
        message: String,
    },
    /// A key has a value of the wrong type or outside its range.
    #[error("{path}: {message}")]
    Invalid {
        /// Dotted key path, e.g. `nvidia.deviceSplitCount` or `nodeconfig[0].devicesplitcount`.
        path: String,
        /// What is wrong with the value.
        message: String,
    },
}

/// HAMi's `gpuCorePolicy`: how HAMi-core enforces `nvidia.com/gpucores`. A non-default value is
/// injected by the webhook as env `GPU_CORE_UTILIZATION_POLICY=<value>` into every container.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum GpuCorePolicy {
    /// `default` (or empty): limit cores only while other tasks share the GPU.
    #[default]
    Default,
    /// `force`: always limit to `gpucores`.
    Force,
    /// `disable`: never limit cores.
    Disable,
}

impl GpuCorePolicy {
    /// The config / env spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            GpuCorePolicy::Default => "default",
            GpuCorePolicy::Force => "force",
            GpuCorePolicy::Disable => "disable",
        }
    }

    /// Parses the config value; empty means `default` (as in HAMi). Unknown values are refused
    /// (HAMi would pass them to HAMi-core, which ignores them).
    pub fn parse(value: &str) -> Option<Self> {
        match value {
            "" | "default" => Some(GpuCorePolicy::Default),
            "force" => Some(GpuCorePolicy::Force),
            "disable" => Some(GpuCorePolicy::Disable),
            _ => None,
        }
    }
}

impl fmt::Display for GpuCorePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for GpuCorePolicy {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = Option::<String>::deserialize(d)?.unwrap_or_default();
        GpuCorePolicy::parse(&text).ok_or_else(|| {
            de::Error::custom(format!(
                "unknown gpuCorePolicy {text:?}, expected one of \"default\", \"force\", \"disable\""
            ))
        })
    }
}

/// One `migProfileAllowlist` entry: the MIG profiles allowed on GPUs whose model matches.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigProfileAllow {
    /// Model name fragments (`A100`, `H100`), matched against the device type.
    #[serde(default, deserialize_with = "nullable")]
    pub models: Vec<String>,
    /// Profile names (`1g.5gb`, `3g.20gb`).
    #[serde(default, deserialize_with = "nullable")]
    pub profiles: Vec<String>,
}

/// Why a `migProfileAllowlist` was refused (HAMi's `ValidateMigProfileAllowlist`, which stops the
/// scheduler and the device plugin at start-up).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllowlistError {
    #[error("migProfileAllowlist entry {0} must list both models and profiles")]
    Empty(usize),
    #[error(
        "migProfileAllowlist entry {entry}: invalid MIG profile {profile:?} (expected a name like 1g.10gb)"
    )]
    BadProfile { entry: usize, profile: String },
}

/// Checks a `migProfileAllowlist`: every entry names models and profiles, every profile looks like
/// `<n>g.<…>`.
pub fn validate_allowlist(allowlist: &[MigProfileAllow]) -> Result<(), AllowlistError> {
    for (entry, a) in allowlist.iter().enumerate() {
        if a.models.is_empty() || a.profiles.is_empty() {
            return Err(AllowlistError::Empty(entry));
        }
        for p in &a.profiles {
            let ok = match p.split_once('.') {
                Some((slices, _)) => slices.len() >= 2 && slices.ends_with('g'),
                None => false,
            };
            if !ok {
                return Err(AllowlistError::BadProfile {
                    entry,
                    profile: p.clone(),
                });
            }
        }
    }
    Ok(())
}

/// The profiles allowed on a GPU of `model` (its registered type): those of the first entry one
/// of whose models is a substring of `model`, as HAMi matches them. `None`: no entry matches, so
/// the GPU offers no MIG profile.
pub fn allowed_profiles<'a>(model: &str, allowlist: &'a [MigProfileAllow]) -> Option<&'a [String]> {
    allowlist
        .iter()
        .find(|a| a.models.iter().any(|m| model.contains(m.as_str())))
        .map(|a| a.profiles.as_slice())
}

/// The `nvidia:` section of `device-config.yaml` (HAMi `NvidiaConfig` with its inlined
/// `NodeDefaultConfig`). Every absent key takes the HAMi chart default ([`Default`]).
#[derive(Debug, Clone, PartialEq)]
pub struct NvidiaConfig {
    /// `resourceCountName` … `resourcePriorityName`.
    pub resources: ResourceNames,
    /// `overwriteEnv`: containers without HAMi GPU resources get `NVIDIA_VISIBLE_DEVICES=none`.
    pub overwrite_env: bool,
    /// `defaultMemory`: MiB booked when a request names neither memory nor a percentage.
    pub default_memory: u32,
    /// `defaultCores`: cores booked when a request has no `gpucores`.
    pub default_cores: u32,
    /// `defaultGPUNum`: count the webhook adds when only memory/cores are given.
    pub default_gpu_num: u32,
    /// `memoryFactor`: multiplies `gpumem` requests and memory quota limits when > 1.
    pub memory_factor: u32,
    /// `preConfiguredDeviceMemory`: MiB to register when NVML reports none (unified memory).
    pub pre_configured_device_memory: u32,
    /// `deviceSplitCount`: vGPU replicas per physical GPU (the register annotation's `count`).
    pub device_split_count: u32,
    /// `deviceMemoryScaling`: registered devmem = floor(total MiB × scaling); > 1 oversubscribes.
    pub device_memory_scaling: f64,
    /// `deviceCoreScaling`: registered devcore = int(scaling × 100).
    pub device_core_scaling: f64,
    /// `enableNumaTopology`: advertise NUMA `TopologyInfo` to kubelet.
    pub enable_numa_topology: bool,
    /// `gpuCorePolicy`.
    pub gpu_core_policy: GpuCorePolicy,
    /// `libCudaLogLevel`: env `LIBCUDA_LOG_LEVEL` (`0` error, `1` warn, `3` info, `4` debug).
    pub lib_cuda_log_level: String,
    /// `runtimeClassName`: set by the webhook on GPU pods without one; empty = leave alone.
    pub runtime_class_name: String,
    /// `disableCoreLimit`: the device plugin injects `GPU_CORE_UTILIZATION_POLICY=disable`.
    pub disable_core_limit: bool,
    /// `migProfileAllowlist` (MIG mode only).
    pub mig_profile_allowlist: Vec<MigProfileAllow>,
}

impl Default for NvidiaConfig {
    /// HAMi's chart defaults (`charts/hami/values.yaml`, contract §1.4).
    fn default() -> Self {
        NvidiaConfig {
            resources: ResourceNames::default(),
            overwrite_env: false,
            default_memory: 0,
            default_cores: 0,
            default_gpu_num: 1,
            memory_factor: 1,
            pre_configured_device_memory: 0,
            device_split_count: 10,
            device_memory_scaling: 1.0,
            device_core_scaling: 1.0,
            enable_numa_topology: false,
            gpu_core_policy: GpuCorePolicy::Default,
            lib_cuda_log_level: "1".to_owned(),
            runtime_class_name: String::new(),
            disable_core_limit: false,
            mig_profile_allowlist: Vec::new(),
        }
    }
}

impl NvidiaConfig {
    /// Applies a per-node entry of `config.json` the way HAMi does (mergo `WithOverride`): every
    /// field the entry sets to a non-zero value replaces the YAML value; zero / absent values
    /// (`0`, `0.0`, `""`, `false`) leave it unchanged.
    pub fn with_node_override(&self, node: &NodeConfig) -> NvidiaConfig {
        let mut merged = self.clone();
        if let Some(v) = node.devicesplitcount.filter(|v| *v != 0) {
            merged.device_split_count = v;
        }
        if let Some(v) = node.devicememoryscaling.filter(|v| *v != 0.0) {
            merged.device_memory_scaling = v;
        }
        if let Some(v) = node.devicecorescaling.filter(|v| *v != 0.0) {
            merged.device_core_scaling = v;
        }
        if let Some(v) = node.preconfigureddevicememory.filter(|v| *v != 0) {
            merged.pre_configured_device_memory = v;
        }
        if let Some(v) = node.libcudaloglevel.as_ref().filter(|v| !v.is_empty()) {
            merged.lib_cuda_log_level = v.clone();
        }
        if node.enablenumatopology == Some(true) {
            merged.enable_numa_topology = true;
        }
        merged
    }

    /// The multiplier HAMi applies to `gpumem` requests: `memoryFactor` when > 1, else 1.
    pub fn effective_memory_factor(&self) -> u32 {
        self.memory_factor.max(1)
    }
}

/// `device-config.yaml`. Only the `nvidia:` section is read; other vendors' sections and unknown
/// keys are tolerated and ignored.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DeviceConfig {
    /// The `nvidia:` section (chart defaults when absent).
    pub nvidia: NvidiaConfig,
}

impl DeviceConfig {
    /// Parses the YAML text. An empty document or a missing `nvidia:` section gives the chart
    /// defaults. Errors name the key path (`nvidia.defaultMemory: invalid type: …`).
    pub fn from_yaml(text: &str) -> Result<Self, ConfigError> {
        // A syntax error surfaces mid-walk with a half-built path; report it against the file.
        yaml_serde::from_str::<yaml_serde::Value>(text).map_err(|e| ConfigError::Syntax {
            file: "device-config.yaml",
            message: e.to_string(),
        })?;
        let de = yaml_serde::Deserializer::from_str(text);
        let raw: Option<RawDeviceConfig> = serde_path_to_error::deserialize(de)
            .map_err(|e| path_error("device-config.yaml", e))?;
        let raw_nvidia = raw.and_then(|r| r.nvidia).unwrap_or_default();
        raw_nvidia
            .into_config()
            .map(|nvidia| DeviceConfig { nvidia })
    }
}

fn path_error<E: fmt::Display>(
    file: &'static str,
    e: serde_path_to_error::Error<E>,
) -> ConfigError {
    let path = e.path().to_string();
    let message = e.inner().to_string();
    // yaml_serde prefixes nested errors with its own idea of the path (wrong for custom errors);
    // the path from serde_path_to_error is the right one, so drop yaml_serde's. Its path never
    // contains whitespace, while every serde message does before its first ": ".
    let message = match message.split_once(": ") {
        Some((prefix, rest)) if !prefix.is_empty() && !prefix.contains(char::is_whitespace) => {
            rest.to_owned()
        }
        _ => message,
    };
    if path.is_empty() || path == "." {
        ConfigError::Syntax { file, message }
    } else {
        ConfigError::Invalid { path, message }
    }
}

#[derive(Deserialize)]
struct RawDeviceConfig {
    #[serde(default)]
    nvidia: Option<RawNvidiaConfig>,
}

#[derive(Default, Deserialize)]
struct RawNvidiaConfig {
    #[serde(
        rename = "resourceCountName",
        default,
        deserialize_with = "scalar_string"
    )]
    resource_count_name: Option<String>,
    #[serde(
        rename = "resourceMemoryName",
        default,
        deserialize_with = "scalar_string"
    )]
    resource_memory_name: Option<String>,
    #[serde(
        rename = "resourceMemoryPercentageName",
        default,
        deserialize_with = "scalar_string"
    )]
    resource_memory_percentage_name: Option<String>,
    #[serde(
        rename = "resourceCoreName",
        default,
        deserialize_with = "scalar_string"
    )]
    resource_core_name: Option<String>,
    #[serde(
        rename = "resourcePriorityName",
        default,
        deserialize_with = "scalar_string"
    )]
    resource_priority_name: Option<String>,
    #[serde(rename = "overwriteEnv", default, deserialize_with = "yaml11_bool")]
    overwrite_env: Option<bool>,
    #[serde(rename = "defaultMemory", default)]
    default_memory: Option<u32>,
    #[serde(rename = "defaultCores", default)]
    default_cores: Option<u32>,
    #[serde(rename = "defaultGPUNum", default)]
    default_gpu_num: Option<u32>,
    #[serde(rename = "memoryFactor", default)]
    memory_factor: Option<u32>,
    #[serde(rename = "preConfiguredDeviceMemory", default)]
    pre_configured_device_memory: Option<u32>,
    #[serde(rename = "deviceSplitCount", default)]
    device_split_count: Option<u32>,
    #[serde(rename = "deviceMemoryScaling", default)]
    device_memory_scaling: Option<f64>,
    #[serde(rename = "deviceCoreScaling", default)]
    device_core_scaling: Option<f64>,
    #[serde(
        rename = "enableNumaTopology",
        default,
        deserialize_with = "yaml11_bool"
    )]
    enable_numa_topology: Option<bool>,
    #[serde(rename = "gpuCorePolicy", default)]
    gpu_core_policy: Option<GpuCorePolicy>,
    #[serde(
        rename = "libCudaLogLevel",
        default,
        deserialize_with = "scalar_string"
    )]
    lib_cuda_log_level: Option<String>,
    #[serde(
        rename = "runtimeClassName",
        default,
        deserialize_with = "scalar_string"
    )]
    runtime_class_name: Option<String>,
    #[serde(rename = "disableCoreLimit", default, deserialize_with = "yaml11_bool")]
    disable_core_limit: Option<bool>,
    #[serde(rename = "migProfileAllowlist", default)]
    mig_profile_allowlist: Option<Vec<MigProfileAllow>>,
}

impl RawNvidiaConfig {
    fn into_config(self) -> Result<NvidiaConfig, ConfigError> {
        let d = NvidiaConfig::default();
        let names = ResourceNames::default();
        let invalid = |key: &str, message: String| ConfigError::Invalid {
            path: format!("nvidia.{key}"),
            message,
        };
        // HAMi holds these as int32: larger values do not load there either.
        for (key, value) in [
            ("defaultMemory", self.default_memory),
            ("defaultCores", self.default_cores),
            ("defaultGPUNum", self.default_gpu_num),
            ("memoryFactor", self.memory_factor),
        ] {
            if let Some(v) = value.filter(|v| i32::try_from(*v).is_err()) {
                return Err(invalid(
                    key,
                    format!("{v} does not fit in a signed 32-bit integer"),
                ));
            }
        }
        for (key, value) in [
            ("deviceMemoryScaling", self.device_memory_scaling),
            ("deviceCoreScaling", self.device_core_scaling),
        ] {
            if let Some(v) = value.filter(|v| !(v.is_finite() && *v > 0.0)) {
                return Err(invalid(key, format!("must be a positive number, got {v}")));
            }
        }
        let mig_profile_allowlist = self.mig_profile_allowlist.unwrap_or_default();
        // HAMi stops the scheduler and the device plugin on a bad allowlist; so does Tessera.
        validate_allowlist(&mig_profile_allowlist)
            .map_err(|e| invalid("migProfileAllowlist", e.to_string()))?;
        Ok(NvidiaConfig {
            resources: ResourceNames {
                count: self.resource_count_name.unwrap_or(names.count),
                memory: self.resource_memory_name.unwrap_or(names.memory),
                memory_percentage: self
                    .resource_memory_percentage_name
                    .unwrap_or(names.memory_percentage),
                cores: self.resource_core_name.unwrap_or(names.cores),
                priority: self.resource_priority_name.unwrap_or(names.priority),
            },
            overwrite_env: self.overwrite_env.unwrap_or(d.overwrite_env),
            default_memory: self.default_memory.unwrap_or(d.default_memory),
            default_cores: self.default_cores.unwrap_or(d.default_cores),
            default_gpu_num: self.default_gpu_num.unwrap_or(d.default_gpu_num),
            memory_factor: self.memory_factor.unwrap_or(d.memory_factor),
            pre_configured_device_memory: self
                .pre_configured_device_memory
                .unwrap_or(d.pre_configured_device_memory),
            device_split_count: self.device_split_count.unwrap_or(d.device_split_count),
            device_memory_scaling: self
                .device_memory_scaling
                .unwrap_or(d.device_memory_scaling),
            device_core_scaling: self.device_core_scaling.unwrap_or(d.device_core_scaling),
            enable_numa_topology: self.enable_numa_topology.unwrap_or(d.enable_numa_topology),
            gpu_core_policy: self.gpu_core_policy.unwrap_or(d.gpu_core_policy),
            lib_cuda_log_level: self.lib_cuda_log_level.unwrap_or(d.lib_cuda_log_level),
            runtime_class_name: self.runtime_class_name.unwrap_or(d.runtime_class_name),
            disable_core_limit: self.disable_core_limit.unwrap_or(d.disable_core_limit),
            mig_profile_allowlist,
        })
    }
}

/// Go's `yaml.v2` stores a scalar of any kind into a string field (`libCudaLogLevel: 1`).
fn scalar_string<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    struct ScalarString;
    impl<'de> Visitor<'de> for ScalarString {
        type Value = Option<String>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a string (or a scalar)")
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
            Ok(Some(v.to_owned()))
        }
        fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
            Ok(Some(v.to_string()))
        }
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
            Ok(Some(v.to_string()))
        }
        fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
            Ok(Some(v.to_string()))
        }
        fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
            Ok(Some(v.to_string()))
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_some<D2: Deserializer<'de>>(self, d: D2) -> Result<Self::Value, D2::Error> {
            d.deserialize_any(ScalarString)
        }
    }
    d.deserialize_any(ScalarString)
}

/// Go's `yaml.v2` is YAML 1.1: `yes`/`no`/`on`/`off` are booleans there.
fn yaml11_bool<'de, D: Deserializer<'de>>(d: D) -> Result<Option<bool>, D::Error> {
    struct Yaml11Bool;
    impl<'de> Visitor<'de> for Yaml11Bool {
        type Value = Option<bool>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a boolean")
        }
        fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
            Ok(Some(v))
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
            match v {
                "y" | "Y" | "yes" | "Yes" | "YES" | "on" | "On" | "ON" => Ok(Some(true)),
                "n" | "N" | "no" | "No" | "NO" | "off" | "Off" | "OFF" => Ok(Some(false)),
                _ => Err(E::invalid_type(de::Unexpected::Str(v), &self)),
            }
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_some<D2: Deserializer<'de>>(self, d: D2) -> Result<Self::Value, D2::Error> {
            d.deserialize_any(Yaml11Bool)
        }
    }
    d.deserialize_any(Yaml11Bool)
}

/// Go's decoders leave a field at its zero value when the input says `null`.
fn nullable<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// `filterdevices` of a per-node entry: GPUs neither registered with kubelet nor annotated.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FilterDevices {
    /// GPU UUIDs to hide.
    #[serde(default, deserialize_with = "nullable")]
    pub uuid: Vec<String>,
    /// NVML indexes to hide.
    #[serde(default, deserialize_with = "nullable")]
    pub index: Vec<u32>,
}

impl FilterDevices {
    /// HAMi's `FilterDeviceToRegister`: true when the GPU must be hidden.
    pub fn hides(&self, uuid: &str, index: u32) -> bool {
        self.uuid.iter().any(|u| u == uuid) || self.index.contains(&index)
    }
}

/// One `nodeconfig` entry of `/config/config.json` (HAMi `DevicePluginConfigs.Nodeconfig[i]`).
/// `Option` fields are HAMi's pointer fields: `None` = absent or `null`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeConfig {
    /// Node name; the entry applies to the node whose `NODE_NAME` equals it.
    #[serde(default, deserialize_with = "nullable")]
    pub name: String,
    /// `hami-core` (default when empty), `mig` or `mps` (a stub in HAMi).
    #[serde(default, deserialize_with = "nullable")]
    pub operatingmode: String,
    /// Overrides `deviceMemoryScaling` when non-zero.
    #[serde(default)]
    pub devicememoryscaling: Option<f64>,
    /// Overrides `deviceSplitCount` when non-zero.
    #[serde(default)]
    pub devicesplitcount: Option<u32>,
    /// Overrides `deviceCoreScaling` when non-zero.
    #[serde(default)]
    pub devicecorescaling: Option<f64>,
    /// Overrides `preConfiguredDeviceMemory` when non-zero.
    #[serde(default)]
    pub preconfigureddevicememory: Option<u32>,
    /// Overrides `libCudaLogLevel` when non-empty.
    #[serde(default)]
    pub libcudaloglevel: Option<String>,
    /// Overrides `enableNumaTopology` when `true`.
    #[serde(default)]
    pub enablenumatopology: Option<bool>,
    /// Parsed but unused by HAMi.
    #[serde(default, deserialize_with = "nullable")]
    pub migstrategy: String,
    /// GPUs to hide on this node.
    #[serde(default, deserialize_with = "nullable")]
    pub filterdevices: FilterDevices,
    /// Value advertised to kubelet as `GetPreferredAllocationAvailable` (default false).
    #[serde(default)]
    pub enablegetpreferredallocation: Option<bool>,
}

/// `/config/config.json`: `{"nodeconfig":[…]}`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeConfigFile {
    /// Per-node entries, in file order.
    #[serde(default, deserialize_with = "nullable")]
    pub nodeconfig: Vec<NodeConfig>,
}

impl NodeConfigFile {
    /// Parses the JSON. Keys match case-insensitively, as Go's `encoding/json` does (an exact
    /// lowercase key wins over another spelling); unknown keys are ignored; wrong types are
    /// errors naming the path, e.g. `nodeconfig[0].devicesplitcount: invalid type: …`.
    pub fn from_json(text: &str) -> Result<Self, ConfigError> {
        let value: Value = serde_json::from_str(text).map_err(|e| ConfigError::Syntax {
            file: "config.json",
            message: e.to_string(),
        })?;
        let value = lowercase_keys(value);
        if value.is_null() {
            return Ok(NodeConfigFile::default());
        }
        serde_path_to_error::deserialize(value).map_err(|e| path_error("config.json", e))
    }

    /// The entry for a node, if any. HAMi merges every entry carrying the name, in order; Tessera
    /// takes the first ([`NodeConfigFile::duplicate_names`] finds files where that differs).
    pub fn for_node(&self, name: &str) -> Option<&NodeConfig> {
        self.nodeconfig.iter().find(|n| n.name == name)
    }

    /// Names that appear in more than one entry (a configuration mistake worth a warning).
    pub fn duplicate_names(&self) -> Vec<String> {
        let mut seen = BTreeSet::new();
        let mut dup = BTreeSet::new();
        for n in &self.nodeconfig {
            if !seen.insert(n.name.as_str()) {
                dup.insert(n.name.clone());
            }
        }
        dup.into_iter().collect()
    }
}

/// Lowercases object keys recursively; an already-lowercase key wins over other spellings.
fn lowercase_keys(value: Value) -> Value {
    match value {
        Value::Object(map) => {
            let mut out = serde_json::Map::new();
            let mut others = Vec::new();
            for (k, v) in map {
                if k.chars().any(|c| c.is_uppercase()) {
                    others.push((k.to_lowercase(), v));
                } else {
                    out.insert(k, lowercase_keys(v));
                }
            }
            for (k, v) in others {
                if !out.contains_key(&k) {
                    out.insert(k, lowercase_keys(v));
                }
            }
            Value::Object(out)
        }
        Value::Array(items) => Value::Array(items.into_iter().map(lowercase_keys).collect()),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allowlist_rules_follow_hami() {
        let entry = |models: &[&str], profiles: &[&str]| MigProfileAllow {
            models: models.iter().map(|s| s.to_string()).collect(),
            profiles: profiles.iter().map(|s| s.to_string()).collect(),
        };
        assert_eq!(
            validate_allowlist(&[entry(&["A100"], &["1g.10gb", "7g.80gb"])]),
            Ok(())
        );
        assert_eq!(
            validate_allowlist(&[entry(&[], &["1g.10gb"])]),
            Err(AllowlistError::Empty(0))
        );
        for bad in ["1g", "g.10gb", "10gb", "1x.10gb"] {
            assert!(
                validate_allowlist(&[entry(&["A100"], &[bad])]).is_err(),
                "{bad}"
            );
        }
        let list = [
            entry(&["H100"], &["1g.10gb"]),
            entry(&["A100-SXM4-80GB", "A100"], &["3g.40gb"]),
            entry(&["A100"], &["7g.80gb"]),
        ];
        assert_eq!(
            allowed_profiles("NVIDIA A100-SXM4-80GB", &list),
            Some(&["3g.40gb".to_owned()][..])
        );
        assert_eq!(allowed_profiles("NVIDIA-Tesla T4", &list), None);
    }
}

//! How a container's GPUs are named to the NVIDIA container runtime, and whether the node's
//! runtime would also take that list from the container's own environment.
//!
//! The NVIDIA container toolkit decides which GPUs a container gets from `NVIDIA_VISIBLE_DEVICES`
//! in its environment, or (with `accept-nvidia-visible-devices-as-volume-mounts`) from bind
//! mounts under `/var/run/nvidia-container-devices`. The environment is the pod author's: a pod
//! can set the variable through `envFrom` (which admission cannot inspect) or inherit it from its
//! image, and then sees every GPU of the node. A node is safe only when its runtime ignores the
//! variable in unprivileged containers (`accept-nvidia-visible-devices-envvar-when-unprivileged
//! = false`) and the device plugin names the GPUs as volume mounts, which only the kubelet (from
//! `Allocate`) or the runtime's CDI injection can add (docs/security.md, "Node runtime").
//!
//! Pure: the daemon reads the file and reports what [`assess`] says.

use std::fmt;
use std::str::FromStr;

/// The toolkit's configuration file on the node.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/nvidia-container-runtime/config.toml";
/// The directory under which a volume-mount device list lives (one `/dev/null` mount per GPU,
/// named by its UUID), and the value of `NVIDIA_VISIBLE_DEVICES` that points the runtime there.
pub const VOLUME_MOUNT_DIR: &str = "/var/run/nvidia-container-devices";
/// The environment variable that names a container's GPUs.
pub const VISIBLE_DEVICES_ENV: &str = "NVIDIA_VISIBLE_DEVICES";

/// How `Allocate` (and a DRA claim's CDI spec) names a container's GPUs to the runtime: HAMi's
/// and NVIDIA's device plugin's `deviceListStrategy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceListStrategy {
    /// `NVIDIA_VISIBLE_DEVICES=<UUIDs>` (HAMi's default).
    #[default]
    Envvar,
    /// `/dev/null` bind mounts at `/var/run/nvidia-container-devices/<UUID>`, and
    /// `NVIDIA_VISIBLE_DEVICES=/var/run/nvidia-container-devices` for runtimes that read only
    /// the environment.
    VolumeMounts,
}

impl DeviceListStrategy {
    pub fn as_str(self) -> &'static str {
        match self {
            DeviceListStrategy::Envvar => "envvar",
            DeviceListStrategy::VolumeMounts => "volume-mounts",
        }
    }
}

impl fmt::Display for DeviceListStrategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A `deviceListStrategy` this plugin does not implement.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "device list strategy {0:?} is not supported: use envvar or volume-mounts (for CDI, add \
     --cdi-devices, which names the GPUs as CDI devices as well)"
)]
pub struct UnknownStrategy(pub String);

impl FromStr for DeviceListStrategy {
    type Err = UnknownStrategy;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "envvar" | "" => Ok(DeviceListStrategy::Envvar),
            "volume-mounts" => Ok(DeviceListStrategy::VolumeMounts),
            other => Err(UnknownStrategy(other.to_owned())),
        }
    }
}

/// What the node's NVIDIA container runtime accepts as a device list (the two keys of its
/// `config.toml` that matter here, with the toolkit's defaults).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RuntimeConfig {
    /// `accept-nvidia-visible-devices-envvar-when-unprivileged` (toolkit default `true`).
    pub env_when_unprivileged: bool,
    /// `accept-nvidia-visible-devices-as-volume-mounts` (toolkit default `false`).
    pub volume_mounts: bool,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig {
            env_when_unprivileged: true,
            volume_mounts: false,
        }
    }
}

/// The toolkit's `config.toml` could not be read as TOML.
#[derive(Debug, thiserror::Error)]
#[error("not a valid NVIDIA container runtime configuration")]
pub struct ConfigError(#[source] pub toml::de::Error);

impl RuntimeConfig {
    /// Parses the toolkit's `config.toml`: the two keys are top-level booleans; a missing key
    /// takes the toolkit's default, a key of another type is an error (the toolkit refuses it
    /// too).
    pub fn parse(text: &str) -> Result<RuntimeConfig, ConfigError> {
        #[derive(serde::Deserialize)]
        struct Raw {
            #[serde(rename = "accept-nvidia-visible-devices-envvar-when-unprivileged")]
            env_when_unprivileged: Option<bool>,
            #[serde(rename = "accept-nvidia-visible-devices-as-volume-mounts")]
            volume_mounts: Option<bool>,
        }
        let raw: Raw = toml::from_str(text).map_err(ConfigError)?;
        let d = RuntimeConfig::default();
        Ok(RuntimeConfig {
            env_when_unprivileged: raw.env_when_unprivileged.unwrap_or(d.env_when_unprivileged),
            volume_mounts: raw.volume_mounts.unwrap_or(d.volume_mounts),
        })
    }
}

/// What the plugin concludes about its node at start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The runtime ignores the variable in unprivileged containers and reads the mounts this
    /// plugin writes.
    Safe,
    /// An unprivileged container that sets `NVIDIA_VISIBLE_DEVICES` (in its spec, through
    /// `envFrom`, or in its image) gets the GPUs it names, beyond what it booked.
    AcceptsEnv,
    /// The runtime ignores the variable but also the mounts, or the plugin names the GPUs only
    /// in the variable: GPU containers would start without their GPUs.
    IgnoresDeviceList,
    /// No configuration file: the node may inject GPUs through CDI only, or run another
    /// runtime; nothing can be said.
    Unknown,
}

impl Verdict {
    /// The metric label.
    pub fn label(&self) -> &'static str {
        match self {
            Verdict::Safe => "safe",
            Verdict::AcceptsEnv => "accepts_env",
            Verdict::IgnoresDeviceList => "ignores_device_list",
            Verdict::Unknown => "unknown",
        }
    }

    /// One sentence for the log and the Node's Event.
    pub fn explain(&self, strategy: DeviceListStrategy) -> String {
        match self {
            Verdict::Safe => format!(
                "the NVIDIA container runtime ignores {VISIBLE_DEVICES_ENV} in unprivileged \
                 containers and reads the device list as volume mounts ({strategy})"
            ),
            Verdict::AcceptsEnv => format!(
                "the NVIDIA container runtime accepts {VISIBLE_DEVICES_ENV} from unprivileged \
                 containers (accept-nvidia-visible-devices-envvar-when-unprivileged is not false): \
                 any pod on this node, GPU request or not, can see every GPU by setting it \
                 (envFrom, or its image's environment); set it to false with \
                 accept-nvidia-visible-devices-as-volume-mounts = true and \
                 devicePlugin.deviceListStrategy=volume-mounts (docs/security.md)"
            ),
            Verdict::IgnoresDeviceList => format!(
                "the NVIDIA container runtime ignores {VISIBLE_DEVICES_ENV} in unprivileged \
                 containers but this plugin names GPUs with device list strategy {strategy} (or \
                 the runtime does not accept volume mounts): GPU containers start without their \
                 GPUs; use devicePlugin.deviceListStrategy=volume-mounts and \
                 accept-nvidia-visible-devices-as-volume-mounts = true"
            ),
            Verdict::Unknown => format!(
                "no NVIDIA container runtime configuration was found; if this node's runtime \
                 honours {VISIBLE_DEVICES_ENV} from unprivileged containers, any pod can see \
                 every GPU (docs/security.md)"
            ),
        }
    }
}

/// The verdict for a node whose runtime configuration is `config` (`None`: no file) when the
/// plugin names GPUs with `strategy`.
pub fn assess(config: Option<RuntimeConfig>, strategy: DeviceListStrategy) -> Verdict {
    let Some(c) = config else {
        return Verdict::Unknown;
    };
    if c.env_when_unprivileged {
        return Verdict::AcceptsEnv;
    }
    if c.volume_mounts && strategy == DeviceListStrategy::VolumeMounts {
        Verdict::Safe
    } else {
        Verdict::IgnoresDeviceList
    }
}

/// How a container's GPUs are named: the value of [`VISIBLE_DEVICES_ENV`] and the container
/// paths of read-only bind mounts of [`DEVICE_LIST_MOUNT_SOURCE`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceList {
    pub visible_devices: String,
    pub mounts: Vec<String>,
}

/// What every volume-mount device list entry is a bind mount of (the runtime reads only names).
pub const DEVICE_LIST_MOUNT_SOURCE: &str = "/dev/null";

/// The device list of a container given `uuids`.
pub fn device_list(uuids: &[&str], strategy: DeviceListStrategy) -> DeviceList {
    match strategy {
        DeviceListStrategy::Envvar => DeviceList {
            visible_devices: uuids.join(","),
            mounts: Vec::new(),
        },
        DeviceListStrategy::VolumeMounts => DeviceList {
            visible_devices: VOLUME_MOUNT_DIR.to_owned(),
            mounts: uuids
                .iter()
                .map(|u| format!("{VOLUME_MOUNT_DIR}/{u}"))
                .collect(),
        },
    }
}

/// The GPUs a volume-mount device list names: the last element of every mount destination
/// directly under [`VOLUME_MOUNT_DIR`] (what the toolkit reads; used by the e2e nodes' runtime).
pub fn devices_from_mounts<'a>(destinations: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    destinations
        .into_iter()
        .filter_map(|d| d.strip_prefix(VOLUME_MOUNT_DIR)?.strip_prefix('/'))
        .filter(|rest| !rest.is_empty() && !rest.contains('/'))
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_toolkits_defaults_accept_the_variable_from_any_container() {
        let c = RuntimeConfig::parse("").expect("empty is valid");
        assert_eq!(c, RuntimeConfig::default());
        assert_eq!(
            assess(Some(c), DeviceListStrategy::VolumeMounts),
            Verdict::AcceptsEnv
        );
        // The keys under a table (the toolkit reads them only at the top level) do not count.
        let nested = RuntimeConfig::parse(
            "[nvidia-container-cli]\naccept-nvidia-visible-devices-envvar-when-unprivileged = false\n",
        )
        .expect("valid");
        assert!(nested.env_when_unprivileged);
    }

    #[test]
    fn only_env_off_with_volume_mounts_on_both_sides_is_safe() {
        let safe = RuntimeConfig::parse(
            "disable-require = false\n\
             accept-nvidia-visible-devices-envvar-when-unprivileged = false\n\
             accept-nvidia-visible-devices-as-volume-mounts = true\n\
             [nvidia-container-cli]\nldconfig = \"@/sbin/ldconfig\"\n",
        )
        .expect("valid");
        assert_eq!(
            assess(Some(safe), DeviceListStrategy::VolumeMounts),
            Verdict::Safe
        );
        assert_eq!(
            assess(Some(safe), DeviceListStrategy::Envvar),
            Verdict::IgnoresDeviceList
        );
        let no_mounts = RuntimeConfig {
            volume_mounts: false,
            ..safe
        };
        assert_eq!(
            assess(Some(no_mounts), DeviceListStrategy::VolumeMounts),
            Verdict::IgnoresDeviceList
        );
        assert_eq!(
            assess(None, DeviceListStrategy::VolumeMounts),
            Verdict::Unknown
        );
    }

    #[test]
    fn a_key_of_the_wrong_type_or_broken_toml_is_an_error_not_a_default() {
        assert!(
            RuntimeConfig::parse("accept-nvidia-visible-devices-envvar-when-unprivileged = \"no\"")
                .is_err()
        );
        assert!(RuntimeConfig::parse("accept-nvidia = [").is_err());
    }

    #[test]
    fn strategies_read_as_helm_values_and_flags() {
        assert_eq!("envvar".parse(), Ok(DeviceListStrategy::Envvar));
        assert_eq!(
            "volume-mounts".parse(),
            Ok(DeviceListStrategy::VolumeMounts)
        );
        let e = "cdi-cri".parse::<DeviceListStrategy>().unwrap_err();
        assert!(e.to_string().contains("--cdi-devices"), "{e}");
    }

    #[test]
    fn a_volume_mount_list_round_trips_through_the_runtimes_reading() {
        let list = device_list(&["GPU-a", "GPU-b"], DeviceListStrategy::VolumeMounts);
        assert_eq!(list.visible_devices, VOLUME_MOUNT_DIR);
        let read = devices_from_mounts(list.mounts.iter().map(String::as_str));
        assert_eq!(read, vec!["GPU-a", "GPU-b"]);
        // Nothing deeper, nothing beside it.
        assert!(
            devices_from_mounts([
                "/var/run/nvidia-container-devices-x/GPU-a",
                "/var/run/nvidia-container-devices/a/b",
                "/var/run/nvidia-container-devices/",
            ])
            .is_empty()
        );
        let list = device_list(&["GPU-a", "GPU-b"], DeviceListStrategy::Envvar);
        assert_eq!(list.visible_devices, "GPU-a,GPU-b");
        assert!(list.mounts.is_empty());
    }
}

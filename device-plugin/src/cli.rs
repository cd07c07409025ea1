//! Command line (clap derive, every flag with an env fallback).

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Parser, ValueEnum};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// Tessera device plugin: advertises GPUs to the kubelet and HAMi's scheduler, and gives each
/// container its scheduler-decided share through the HAMi-core shim.
#[derive(Debug, Clone, Parser)]
#[command(name = "tessera-device-plugin", version)]
pub struct Cli {
    /// This node's name (the DaemonSet sets it from the downward API).
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,
    /// Kubeconfig file; without it, KUBECONFIG, ~/.kube/config or the in-cluster config.
    #[arg(long, env = "KUBECONFIG_PATH")]
    pub kubeconfig: Option<PathBuf>,
    /// HAMi's device-config.yaml. A missing file means chart defaults; an unreadable one is an error.
    #[arg(long, env = "CONFIG_FILE", default_value = "/device-config.yaml")]
    pub config_file: PathBuf,
    /// Per-node overrides (config.json with `nodeconfig`); optional.
    #[arg(long, env = "NODE_CONFIG_FILE", default_value = "/config/config.json")]
    pub node_config: PathBuf,
    /// The kubelet's device-plugin directory.
    #[arg(
        long,
        env = "DEVICE_PLUGIN_DIR",
        default_value = "/var/lib/kubelet/device-plugins"
    )]
    pub socket_dir: PathBuf,
    /// The kubelet's pod-resources socket (used when present).
    #[arg(
        long,
        env = "POD_RESOURCES_SOCKET",
        default_value = "/var/lib/kubelet/pod-resources/kubelet.sock"
    )]
    pub pod_resources_socket: PathBuf,
    /// Host directory holding `vgpu/libvgpu.so` (HAMi's HOOK_PATH).
    #[arg(long, env = "HOOK_PATH", default_value = "/usr/local")]
    pub hook_path: String,
    /// Address of the Prometheus /metrics and /healthz endpoint.
    #[arg(long, env = "METRICS_ADDR", default_value = "0.0.0.0:9394")]
    pub metrics_addr: SocketAddr,
    /// NVML library to load at run time.
    #[arg(long, env = "NVML_LIB", default_value = "libnvidia-ml.so.1")]
    pub nvml_lib: PathBuf,
    /// sysfs root (NUMA nodes are read from `<root>/bus/pci/devices/<bus id>/numa_node`).
    #[arg(long, env = "SYSFS_ROOT", default_value = "/sys")]
    pub sysfs_root: PathBuf,
    /// Log format.
    #[arg(long, env = "LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
    /// Seconds between rewrites of the node register annotation (also rewritten on change).
    #[arg(long, env = "ANNOTATION_PERIOD_SECONDS", default_value_t = 30)]
    pub annotation_period_seconds: u64,
    /// Seconds a GPU must stay free of errors (and answer NVML) before it is healthy again.
    #[arg(long, env = "HEALTH_RECOVERY_SECONDS", default_value_t = 60)]
    pub health_recovery_seconds: u64,
    /// NVIDIA's DP_DISABLE_HEALTHCHECKS: `all`, `xids`, or extra XIDs to ignore (comma list).
    #[arg(long, env = "DP_DISABLE_HEALTHCHECKS", default_value = "")]
    pub disable_healthchecks: String,
    /// Also return the GPUs as CDI devices (`nvidia.com/gpu=<UUID>`) in Allocate responses
    /// (needs a CDI-enabled runtime with NVIDIA's CDI spec generated on the node).
    #[arg(long, env = "CDI_DEVICES")]
    pub cdi_devices: bool,
    /// Opt-in: also publish the memory and cores resources (e.g. nvidia.com/gpumem in MiB,
    /// nvidia.com/gpucores in percent) as node capacity, totals over the registered GPUs (HAMi
    /// #2839). With them in allocatable the kubelet admits those requests against the totals.
    #[arg(long, env = "PUBLISH_CAPACITY")]
    pub publish_capacity: bool,
    /// Also export HAMi's pre-v2.9 metric names (HostGPUMemoryUsage, vGPU_device_memory_usage_in_bytes, …).
    #[arg(long, env = "LEGACY_METRIC_NAMES")]
    pub legacy_metric_names: bool,
    /// Discover GPUs, print the register annotation value and exit (no kubelet, no apiserver).
    #[arg(long)]
    pub print_register: bool,
    /// With --print-register: keep watching GPU health for this many seconds and print the
    /// annotation value again whenever it changes (a dry run of health handling).
    #[arg(long, default_value_t = 0, requires = "print_register")]
    pub watch_seconds: u64,
}

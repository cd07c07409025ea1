//! Command line (clap derive, every flag with an env fallback).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::builder::BoolishValueParser;
use clap::{ArgAction, Parser};
use tessera_runtime::LogArgs;

/// The crates whose logs `-v`/`--debug` raise first.
pub const OWN_CRATES: &[&str] = &[
    "tessera_device_plugin",
    "tessera_node",
    "hami_contract",
    "vgpu_region",
];

/// Tessera device plugin: advertises GPUs to the kubelet and HAMi's scheduler, and gives each
/// container its scheduler-decided share through the HAMi-core shim.
#[derive(Debug, Clone, Parser)]
#[command(name = "tessera-device-plugin", version = tessera_runtime::build_info::version())]
// The plugin has always read `LOG_FORMAT` (not the runtime's `TESSERA_LOG_FORMAT`).
#[command(mut_arg("log_format", |a| a.env("LOG_FORMAT")))]
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
    /// `--log-format`, `-v`/`--v` (klog verbosity) and HAMi's `--debug`.
    #[command(flatten)]
    pub logging: LogArgs,
    /// `--worker-threads`: the async runtime's size, not the node's core count.
    #[command(flatten)]
    pub runtime: tessera_runtime::RuntimeArgs,
    /// NVIDIA's `--fail-on-init-error`: when NVML cannot be loaded or initialised, exit with an
    /// error (true), or log the cause once and idle, serving only /healthz and /metrics, until
    /// SIGTERM (false: no kubelet registration, no node annotation).
    #[arg(
        long,
        env = "FAIL_ON_INIT_ERROR",
        action = ArgAction::Set,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true",
        default_value = "true",
        value_parser = BoolishValueParser::new()
    )]
    pub fail_on_init_error: bool,
    /// Seconds between rewrites of the node register annotation (also rewritten on change).
    #[arg(long, env = "ANNOTATION_PERIOD_SECONDS", default_value_t = 30)]
    pub annotation_period_seconds: u64,
    /// Seconds between the vGPU monitor's feedback passes (HAMi's vGPU monitor: 5): each pass
    /// decays `recent_kernel`, blocks lower-priority containers and switches the core limit of
    /// `gpuCorePolicy: default` containers on while they share a GPU and off while alone
    /// (docs/design/sm-limiter.md). 0 turns the feedback off: every core limit then stays on,
    /// as under `force`. Also 0 where HAMi's own vGPU monitor runs on the node (two loops would
    /// decay `recent_kernel` twice per period).
    #[arg(long, env = "VGPU_FEEDBACK_PERIOD_SECONDS", default_value_t = vgpu_region::feedback::HAMI_PERIOD_SECS)]
    pub vgpu_feedback_period_seconds: u64,
    /// Seconds an `Allocate` may take before it fails closed and the kubelet rejects the pod
    /// (`UnexpectedAdmissionError`). The kubelet admits one pod at a time and sets no timeout of
    /// its own, so this bounds how long a hung API server can stall the node's admissions;
    /// shorter rejects pods whose reads are merely slow on a busy node. At least 10 on a node in
    /// operating mode `mig` (carving an instance takes NVML seconds).
    #[arg(long, env = "ALLOCATE_TIMEOUT_SECONDS", default_value_t = 10,
        value_parser = clap::value_parser!(u64).range(1..=300))]
    pub allocate_timeout_seconds: u64,
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
    /// How GPUs are named to the NVIDIA container runtime (HAMi's and NVIDIA's
    /// `deviceListStrategy`): `envvar` (`NVIDIA_VISIBLE_DEVICES=<UUIDs>`) or `volume-mounts`
    /// (`/dev/null` mounts under /var/run/nvidia-container-devices, which a runtime that ignores
    /// the variable in unprivileged containers still reads; docs/security.md, "Node runtime").
    #[arg(long, env = "DEVICE_LIST_STRATEGY", default_value = "envvar")]
    pub device_list_strategy: tessera_node::nvidia_runtime::DeviceListStrategy,
    /// The node's NVIDIA container runtime configuration, read at start to report a runtime that
    /// would give any container the GPUs its own environment names.
    #[arg(long, env = "NVIDIA_RUNTIME_CONFIG", default_value = tessera_node::nvidia_runtime::DEFAULT_CONFIG_PATH)]
    pub nvidia_runtime_config: std::path::PathBuf,
    /// Simulated GPUs (the chart's `simulatedGpus`, for trying Tessera without GPUs): the host
    /// directory of the fake driver libraries and the node's `scenario.json`, which `Allocate`
    /// mounts into every GPU container where an NVIDIA runtime would mount the driver. Never on a
    /// node with real GPUs: the plugin then loads the fake NVML too (`--nvml-lib`).
    #[arg(long, env = "SIMULATED_GPUS_DIR")]
    pub simulated_gpus_dir: Option<String>,
    /// With --simulated-gpus-dir: the memory of each simulated GPU, in MiB.
    #[arg(
        long,
        env = "SIMULATED_GPU_MEMORY_MIB",
        default_value_t = 16384,
        requires = "simulated_gpus_dir"
    )]
    pub simulated_gpu_memory_mib: u64,
    /// The unaccounted-process watch (`--unaccounted-*`, `--proc-root`).
    #[command(flatten)]
    pub watch: tessera_node::process_watch::WatchArgs,
    /// Who may read /metrics (`--metrics-authorization`).
    #[command(flatten)]
    pub metrics_access: tessera_http::metrics_access::MetricsAccessArgs,
    /// The cache directories' limit (`--cache-dir-limit-mib`, `--cache-dir-limit-files`).
    #[command(flatten)]
    pub cache_dir: tessera_node::cache_dir::CacheDirArgs,
    /// Opt-in: also publish the memory and cores resources (e.g. nvidia.com/gpumem in MiB,
    /// nvidia.com/gpucores in percent) as node capacity, totals over the registered GPUs (HAMi
    /// #2839). With them in allocatable the kubelet admits those requests against the totals.
    #[arg(long, env = "PUBLISH_CAPACITY")]
    pub publish_capacity: bool,
    /// The GPU scheduler's name: `Allocate` believes a pod's booking annotations only when its
    /// `spec.schedulerName` is one of these (repeatable; HAMi's `hami-scheduler` by default).
    #[arg(
        long = "scheduler-name",
        env = "SCHEDULER_NAME",
        value_delimiter = ',',
        default_value = "hami-scheduler"
    )]
    pub scheduler_names: Vec<String>,
    /// HAMi's ENABLE_TOPOLOGY_SCORE: read the PCIe and NVLink links between the GPUs from NVML
    /// and write their pair scores as `hami.io/node-nvidia-score` with the register annotation,
    /// for the scheduler's `topology-aware` GPU policy (the chart sets it with that policy).
    #[arg(long, env = "ENABLE_TOPOLOGY_SCORE")]
    pub enable_topology_score: bool,
    /// What a GPU in MIG mode offers on a node in operating mode `hami-core` (NVIDIA's and
    /// HAMi's `--mig-strategy`): `none` (nothing), `single` (each carved instance as one
    /// unshared `nvidia.com/gpu` device) or `mixed` (each carved instance as a
    /// `nvidia.com/mig-<profile>` device). A node in operating mode `mig` carves on demand instead.
    #[arg(long, env = "MIG_STRATEGY", value_enum, default_value_t = tessera_node::gpu::MigStrategy::None)]
    pub mig_strategy: tessera_node::gpu::MigStrategy,
    /// Also export HAMi's pre-v2.9 metric names (HostGPUMemoryUsage, vGPU_device_memory_usage_in_bytes, …).
    #[arg(long, alias = "legacy-metrics", env = "LEGACY_METRIC_NAMES")]
    pub legacy_metric_names: bool,
    /// Discover GPUs, print the register annotation value and exit (no kubelet, no apiserver).
    /// With --enable-topology-score, a second line holds the `hami.io/node-nvidia-score` value.
    #[arg(long)]
    pub print_register: bool,
    /// With --print-register: keep watching GPU health for this many seconds and print the
    /// annotation value again whenever it changes (a dry run of health handling).
    #[arg(long, default_value_t = 0, requires = "print_register")]
    pub watch_seconds: u64,
}

impl Cli {
    /// The log filter asked for by `-v`/`--debug`; `None` keeps the default. RUST_LOG wins.
    #[must_use]
    pub fn log_directive(&self) -> Option<String> {
        self.logging.directive(OWN_CRATES)
    }

    /// The daemon's periods: the defaults, with the node annotation's and the vGPU feedback's
    /// from the command line.
    #[must_use]
    pub fn periods(&self) -> Periods {
        Periods {
            annotation: Duration::from_secs(self.annotation_period_seconds.max(1)),
            vgpu_feedback: (self.vgpu_feedback_period_seconds > 0)
                .then(|| Duration::from_secs(self.vgpu_feedback_period_seconds)),
            unaccounted: Duration::from_secs(self.watch.unaccounted_period_seconds.max(1)),
            ..Periods::default()
        }
    }
}

/// Every period and time limit of the daemon's background work, in one place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Periods {
    /// Rewrite of the node register annotation (`--annotation-period-seconds`).
    pub annotation: Duration,
    /// Retry of a failed node annotation write (HAMi's pace).
    pub annotation_retry: Duration,
    /// vGPU monitor pass: container usage metrics, gone pods' directories.
    pub vgpu_monitor: Duration,
    /// vGPU monitor feedback into the regions (`--vgpu-feedback-period-seconds`); `None`: off.
    pub vgpu_feedback: Option<Duration>,
    /// The unaccounted-process watch (`--unaccounted-period-seconds`).
    pub unaccounted: Duration,
    /// Age a container directory must reach before it may be removed as a gone pod's (it is
    /// made at `Allocate`, before its pod could be missing from a list).
    pub orphan_dir_grace: Duration,
    /// Allocation ledger garbage collection (first run one period after start).
    pub ledger_gc: Duration,
    /// Dynamic MIG: destroying the instances no live pod reserves (HAMi's 5 s).
    pub mig_reconcile: Duration,
    /// Kubelet socket check (restart detection).
    pub kubelet_poll: Duration,
    /// Registration retry while the kubelet does not answer.
    pub register_retry: Duration,
    /// Longest blocking wait for one NVML event (also the health thread's shutdown latency).
    pub nvml_event_wait: Duration,
    /// Lost-GPU poll, recovery probes and host GPU metrics.
    pub health_poll: Duration,
    /// NVML rediscovery (GPUs appearing or vanishing).
    pub rediscovery: Duration,
    /// How long a stopping server may take before it is abandoned.
    pub stop_grace: Duration,
}

impl Default for Periods {
    fn default() -> Self {
        Periods {
            annotation: Duration::from_secs(30),
            annotation_retry: Duration::from_secs(5),
            vgpu_monitor: Duration::from_secs(15),
            vgpu_feedback: Some(Duration::from_secs(vgpu_region::feedback::HAMI_PERIOD_SECS)),
            unaccounted: Duration::from_secs(15),
            orphan_dir_grace: Duration::from_secs(30),
            ledger_gc: Duration::from_secs(30),
            mig_reconcile: Duration::from_secs(5),
            kubelet_poll: Duration::from_millis(100),
            register_retry: Duration::from_secs(1),
            nvml_event_wait: Duration::from_secs(1),
            health_poll: Duration::from_secs(1),
            rediscovery: Duration::from_secs(60),
            stop_grace: Duration::from_secs(5),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--help` starts with what the program is, not with the doc comment of a group of flags
    /// it flattens (issue 34).
    #[test]
    fn help_starts_with_what_the_program_is() {
        use clap::CommandFactory;
        let help = Cli::command().render_help().to_string();
        assert!(
            help.starts_with("Tessera device plugin: advertises GPUs"),
            "{help}"
        );
    }

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(
            ["tessera-device-plugin", "--node-name", "n"]
                .iter()
                .chain(args.iter()),
        )
    }

    #[test]
    fn klog_verbosity_in_every_form() {
        for form in [
            &["-v=4"][..],
            &["--v=4"],
            &["-v", "4"],
            &["--v", "4"],
            &["-v4"],
        ] {
            let cli = parse(form).unwrap_or_else(|e| panic!("{form:?}: {e}"));
            assert_eq!(cli.logging.verbosity.verbosity, Some(4), "{form:?}");
            assert!(!cli.logging.verbosity.debug);
            assert_eq!(
                cli.log_directive().as_deref(),
                Some(
                    "info,tessera_device_plugin=debug,tessera_node=debug,hami_contract=debug,vgpu_region=debug"
                )
            );
        }
        let cli = parse(&["-v=6"]).expect("v6");
        assert!(cli.log_directive().is_some_and(|d| d.starts_with("debug,")));
        assert!(parse(&["-v=lots"]).is_err());
        assert!(parse(&["-v=-1"]).is_err());
    }

    #[test]
    fn hami_debug_flag() {
        let cli = parse(&["--debug"]).expect("--debug");
        assert!(cli.logging.verbosity.debug);
        assert!(cli.log_directive().is_some());
        assert!(
            parse(&["--debug=true"])
                .expect("=true")
                .logging
                .verbosity
                .debug
        );
        assert!(
            !parse(&["--debug=false"])
                .expect("=false")
                .logging
                .verbosity
                .debug
        );
        let none = parse(&[]).expect("no flags");
        assert!(!none.logging.verbosity.debug);
        assert_eq!(none.logging.verbosity.verbosity, None);
        assert_eq!(none.log_directive(), None);
        assert_eq!(parse(&["-v=2"]).expect("v2").log_directive(), None);
    }

    #[test]
    fn env_names_the_chart_and_scripts_use() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
        let env_of = |id: &str| {
            Cli::command()
                .get_arguments()
                .find(|a| a.get_id() == id)
                .and_then(|a| a.get_env().map(|e| e.to_string_lossy().into_owned()))
        };
        assert_eq!(env_of("log_format").as_deref(), Some("LOG_FORMAT"));
        assert_eq!(env_of("verbosity").as_deref(), Some("TESSERA_VERBOSITY"));
        assert_eq!(env_of("debug").as_deref(), Some("TESSERA_DEBUG"));
        assert_eq!(env_of("node_name").as_deref(), Some("NODE_NAME"));
        assert_eq!(
            env_of("vgpu_feedback_period_seconds").as_deref(),
            Some("VGPU_FEEDBACK_PERIOD_SECONDS")
        );
        // HAMi's name, so a chart or DaemonSet written for HAMi's plugin turns it on.
        assert_eq!(
            env_of("enable_topology_score").as_deref(),
            Some("ENABLE_TOPOLOGY_SCORE")
        );
        let json = parse(&["--log-format=json"]).expect("json");
        assert_eq!(json.logging.log_format, tessera_runtime::LogFormat::Json);
    }

    #[test]
    fn periods_are_todays_and_the_annotation_period_has_a_floor() {
        let p = parse(&[]).expect("defaults").periods();
        assert_eq!(p.annotation, Duration::from_secs(30));
        assert_eq!(
            p,
            Periods {
                annotation: Duration::from_secs(30),
                ..Periods::default()
            }
        );
        let zero = parse(&["--annotation-period-seconds", "0"]).expect("0");
        assert_eq!(zero.periods().annotation, Duration::from_secs(1));
    }

    #[test]
    fn the_feedback_runs_at_hamis_period_unless_turned_off() {
        assert_eq!(
            parse(&[]).expect("defaults").periods().vgpu_feedback,
            Some(Duration::from_secs(5))
        );
        let off = parse(&["--vgpu-feedback-period-seconds", "0"]).expect("0");
        assert_eq!(off.periods().vgpu_feedback, None);
        let two = parse(&["--vgpu-feedback-period-seconds=2"]).expect("2");
        assert_eq!(two.periods().vgpu_feedback, Some(Duration::from_secs(2)));
    }

    #[test]
    fn fail_on_init_error_defaults_true_as_nvidia() {
        assert!(parse(&[]).expect("default").fail_on_init_error);
        assert!(
            parse(&["--fail-on-init-error"])
                .expect("bare")
                .fail_on_init_error
        );
        assert!(
            parse(&["--fail-on-init-error=true"])
                .expect("true")
                .fail_on_init_error
        );
        assert!(
            !parse(&["--fail-on-init-error=false"])
                .expect("false")
                .fail_on_init_error
        );
        assert!(parse(&["--fail-on-init-error=maybe"]).is_err());
    }
}

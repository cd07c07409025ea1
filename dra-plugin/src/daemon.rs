//! `tessera-dra-plugin`: the DRA kubelet plugin's command line and wiring.
//!
//! A daemon of its own over the node library (`tessera_node`: NVML discovery, health rules, the
//! shim's container environment), shipped in the device plugin's image: a node runs either the device plugin or
//! the DRA plugin (the chart's `dra.enabled` picks which DaemonSet a node gets), and the two
//! take different flags (no HAMi device-config, node annotations or scheduler names here). Both
//! run the unaccounted-process watch (task `gpu-process-watch`, `--unaccounted-process-policy`),
//! here against the claims prepared on the node.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use tessera_runtime::{DisplayChain, LogArgs, Schedule, spawn_periodic, spawn_task};
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use vgpu_region::feedback::FeedbackClock;

use super::DRIVER;
use super::checkpoint::PreparedClaims;
use super::plugin::{DraDriver, KubeClaims, ListenError};
use super::publish::{ConsumableMode, SlicePublisher};
use super::slice::{GpuFacts, slice_devices};
use tessera_http::metrics_access::{MetricsAccessArgs, MetricsGate};
use tessera_node::container_env::ResponseSettings;
use tessera_node::gpu::GpuInfo;
use tessera_node::gpu_processes::ProcReader;
use tessera_node::health::{DisableSpecError, HealthPolicy, HealthTracker};
use tessera_node::kube_edges::{KubeEvictor, KubePodSource};
use tessera_node::node_events::NodeEvents;
use tessera_node::nvml::{GpuInventory, InventoryError, NvmlInventory, lost_gpus};
use tessera_node::process_watch::{ProcessWatch, UnaccountedPolicy, WatchArgs};

/// The crates whose logs `-v` raises first.
pub const OWN_CRATES: &[&str] = &[
    "tessera_dra_plugin",
    "tessera_node",
    "hami_contract",
    "vgpu_region",
];

/// Tessera's DRA driver (gpu.tessera.dev): publishes this node's GPUs as a ResourceSlice and
/// prepares the ResourceClaims kube-scheduler allocates on them, each with the memory and cores
/// it was given enforced in the container by the HAMi-core shim.
#[derive(Debug, Clone, Parser)]
#[command(name = "tessera-dra-plugin", version = tessera_runtime::build_info::version())]
pub struct DraCli {
    /// This node's name (the DaemonSet sets it from the downward API).
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,
    /// Kubeconfig file; without it, KUBECONFIG, ~/.kube/config or the in-cluster config.
    #[arg(long, env = "KUBECONFIG_PATH")]
    pub kubeconfig: Option<PathBuf>,
    /// Host directory holding `vgpu/libvgpu.so` (HAMi's HOOK_PATH); claims' directories go in
    /// `<hook>/vgpu/claims`.
    #[arg(long, env = "HOOK_PATH", default_value = "/usr/local")]
    pub hook_path: String,
    /// NVML library to load at run time.
    #[arg(long, env = "NVML_LIB", default_value = "libnvidia-ml.so.1")]
    pub nvml_lib: PathBuf,
    /// sysfs root (NUMA nodes are read from `<root>/bus/pci/devices/<bus id>/numa_node`).
    #[arg(long, env = "SYSFS_ROOT", default_value = "/sys")]
    pub sysfs_root: PathBuf,
    /// The plugin's socket directory; the kubelet dials `<dir>/dra.sock` (the same path on the
    /// node and in the plugin's container).
    #[arg(
        long,
        env = "DRA_PLUGIN_DIR",
        default_value = "/var/lib/kubelet/plugins/gpu.tessera.dev"
    )]
    pub plugin_dir: PathBuf,
    /// The kubelet's plugin registry directory.
    #[arg(
        long,
        env = "DRA_REGISTRY_DIR",
        default_value = kubelet_proto::pluginregistration::REGISTRY_DIR
    )]
    pub registry_dir: PathBuf,
    /// Where the CDI specs of prepared claims are written (a directory the runtime reads).
    #[arg(long, env = "CDI_SPEC_DIR", default_value = "/var/run/cdi")]
    pub cdi_spec_dir: PathBuf,
    /// Offer shares of each GPU (`DRAConsumableCapacity`): `auto` (when the API server keeps the
    /// fields), `on` or `off` (whole GPUs).
    #[arg(long, env = "CONSUMABLE_CAPACITY", value_enum, default_value_t = ConsumableMode::Auto)]
    pub consumable_capacity: ConsumableMode,
    /// Also name the GPUs by NVIDIA's CDI names (`nvidia.com/gpu=<UUID>`) for runtimes that
    /// inject the driver through NVIDIA's CDI spec.
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
    /// `libCudaLogLevel` for the shim (`LIBCUDA_LOG_LEVEL`); empty: not set.
    #[arg(long, env = "LIBCUDA_LOG_LEVEL", default_value = "")]
    pub lib_cuda_log_level: String,
    /// Seconds a GPU must stay free of errors (and answer NVML) before it is offered again.
    #[arg(long, env = "HEALTH_RECOVERY_SECONDS", default_value_t = 60)]
    pub health_recovery_seconds: u64,
    /// NVIDIA's DP_DISABLE_HEALTHCHECKS: `all`, `xids`, or extra XIDs to ignore (comma list).
    #[arg(long, env = "DP_DISABLE_HEALTHCHECKS", default_value = "")]
    pub disable_healthchecks: String,
    /// Seconds between checks of the node's ResourceSlice (it is also checked at once after a
    /// registration and a health change).
    #[arg(long, env = "SLICE_CHECK_SECONDS", default_value_t = 15)]
    pub slice_check_seconds: u64,
    /// Address of the Prometheus /metrics, /healthz and /readyz (registered with the kubelet)
    /// endpoint.
    #[arg(long, env = "METRICS_ADDR", default_value = "0.0.0.0:9394")]
    pub metrics_addr: std::net::SocketAddr,
    /// Seconds between looks for prepared claims whose ResourceClaim is gone.
    #[arg(long, env = "STALE_CLAIM_SECONDS", default_value_t = 60)]
    pub stale_claim_seconds: u64,
    /// Seconds between reads of the prepared claims' shim regions into the
    /// `tessera_dra_claim_*` usage metrics.
    #[arg(long, env = "USAGE_MONITOR_SECONDS", default_value_t = 15)]
    pub usage_monitor_seconds: u64,
    /// Seconds between the vGPU monitor's feedback passes over the claims' regions (HAMi: 5):
    /// a claim alone on its GPU runs without its core limit, claims sharing a GPU get theirs
    /// back, a more important one (`CUDA_TASK_PRIORITY`) holds the others
    /// (docs/design/sm-limiter.md). 0 turns it off: every core limit then stays on.
    #[arg(long, env = "VGPU_FEEDBACK_PERIOD_SECONDS", default_value_t = vgpu_region::feedback::HAMI_PERIOD_SECS)]
    pub vgpu_feedback_period_seconds: u64,
    /// The unaccounted-process watch (`--unaccounted-*`, `--proc-root`), as the device
    /// plugin's.
    #[command(flatten)]
    pub watch: WatchArgs,
    /// Each claim directory's limit (`--cache-dir-limit-mib`, `--cache-dir-limit-files`), as the
    /// device plugin's for a container's.
    #[command(flatten)]
    pub cache_dir: tessera_node::cache_dir::CacheDirArgs,
    /// Who may read /metrics (`--metrics-authorization`), as the device plugin's.
    #[command(flatten)]
    pub metrics_access: MetricsAccessArgs,
    /// `--log-format`, `-v`/`--v` (klog verbosity) and `--debug`.
    #[command(flatten)]
    pub logging: LogArgs,
    /// `--worker-threads`: the async runtime's size, not the node's core count.
    #[command(flatten)]
    pub runtime: tessera_runtime::RuntimeArgs,
}

/// The `reportingController` of the DRA plugin's Events (the device plugin's say
/// `tessera-device-plugin`).
pub const EVENT_REPORTER: &str = "tessera-dra-plugin";

/// Why the DRA plugin could not start.
#[derive(Debug, thiserror::Error)]
pub enum DraStartError {
    #[error("cannot use NVML")]
    Nvml(#[source] InventoryError),
    #[error(transparent)]
    HealthChecks(#[from] DisableSpecError),
    #[error(transparent)]
    Kube(#[from] tessera_node::kube_edges::ClientError),
    #[error(transparent)]
    Listen(#[from] ListenError),
    #[error("cannot install the signal handlers")]
    Signals(#[source] std::io::Error),
    #[error("cannot start the GPU health thread")]
    HealthThread(#[source] std::io::Error),
    #[error(transparent)]
    Metrics(#[from] tessera_node::metrics::MetricsListenError),
}

/// Each NVLinked GPU's domain: the NVML index of the lowest GPU it reaches over NVLink. A
/// topology NVML cannot give leaves every GPU without the attribute.
fn nvlink_domains(inventory: &dyn GpuInventory) -> BTreeMap<String, u32> {
    let topology = match inventory.topology() {
        Ok(t) => t,
        Err(e) => {
            tracing::warn!(error = %DisplayChain(&e), "cannot read the NVLink topology; GPUs are published without nvlinkDomain");
            return BTreeMap::new();
        }
    };
    topology
        .nvlink_domains()
        .into_iter()
        .zip(&topology.gpus)
        .filter_map(|(root, g)| {
            let root = u32::try_from(root?).ok()?;
            Some((g.uuid.clone(), root))
        })
        .collect()
}

/// The shim's settings for claims (no oversubscription, HAMi's default core policy).
fn response_settings(cli: &DraCli) -> ResponseSettings {
    ResponseSettings {
        hook_path: cli.hook_path.clone(),
        memory_scaling: 1.0,
        lib_cuda_log_level: cli.lib_cuda_log_level.clone(),
        disable_core_limit: false,
        core_policy: hami_contract::config::GpuCorePolicy::Default,
        shim_host_path: tessera_node::container_env::resolve_shim_host_path(&cli.hook_path),
        license_present: false,
        cdi_devices: cli.cdi_devices,
        device_list: cli.device_list_strategy,
        simulated_driver: None,
    }
}

/// Runs the plugin until SIGTERM/SIGINT: both sockets removed at the end (the kubelet then
/// deregisters the driver and, 30 s later, deletes its slice unless a new plugin registered).
pub async fn run(cli: DraCli) -> Result<(), DraStartError> {
    let policy = HealthPolicy {
        recovery_quiet: Duration::from_secs(cli.health_recovery_seconds),
        ..HealthPolicy::default()
    }
    .with_disable_spec(&cli.disable_healthchecks)?;
    let inventory = Arc::new(
        NvmlInventory::load(&cli.nvml_lib, cli.sysfs_root.clone()).map_err(DraStartError::Nvml)?,
    );
    let gpus: Vec<GpuInfo> = inventory.discover().map_err(DraStartError::Nvml)?;
    let domains = nvlink_domains(inventory.as_ref());
    let facts: Vec<(GpuInfo, GpuFacts)> = gpus
        .iter()
        .map(|g| {
            let f = GpuFacts {
                compute_capability: inventory.compute_capability(g.index),
                nvlink_domain: domains.get(&g.uuid).copied(),
            };
            (g.clone(), f)
        })
        .collect();
    let driver_version = inventory.driver_version();
    tracing::info!(gpus = gpus.len(), driver = DRIVER, "GPUs discovered");

    let shutdown = CancellationToken::new();
    tessera_runtime::shutdown::cancel_on_signals(&shutdown).map_err(DraStartError::Signals)?;
    let (unhealthy_tx, unhealthy_rx) = watch::channel(BTreeSet::<String>::new());
    spawn_health_thread(
        inventory.clone(),
        policy,
        gpus.iter().map(|g| g.uuid.clone()).collect(),
        unhealthy_tx,
        shutdown.clone(),
    )?;

    let client = tessera_node::kube_edges::client(cli.kubeconfig.as_deref()).await?;
    let prepared = PreparedClaims::load(cli.cdi_spec_dir.clone(), response_settings(&cli))
        .with_cache_dirs(cli.cache_dir.cache_dirs(&cli.watch.proc_root));
    tracing::info!(
        claims = prepared.all().len(),
        "prepared claims read back from the CDI spec directory"
    );
    let driver = Arc::new(
        DraDriver::new(
            cli.node_name.clone(),
            gpus,
            Arc::new(KubeClaims(client.clone())),
            prepared,
        )
        .with_memory_allowance_mib(cli.watch.unaccounted_memory_allowance_mib),
    );
    let metrics = driver.metrics().clone();
    for (g, _) in &facts {
        metrics.gpu_health(&g.uuid, true);
    }
    let encode = metrics.clone();
    let metrics_server = tessera_node::metrics::serve_http(
        cli.metrics_addr,
        Arc::new(move || encode.encode()),
        driver.readiness().clone(),
        MetricsGate::from_args(&cli.metrics_access, &client),
        shutdown.clone(),
    )
    .await?;
    let registered = Arc::new(Notify::new());

    let publisher = SlicePublisher::new(
        client.clone(),
        cli.node_name.clone(),
        cli.consumable_capacity,
    );
    spawn_task(
        "resource-slice",
        publish_slices(
            publisher,
            metrics,
            NodeGpus {
                gpus: facts,
                driver_version,
            },
            unhealthy_rx,
            registered.clone(),
            Duration::from_secs(cli.slice_check_seconds.max(1)),
            shutdown.clone(),
        ),
    );
    let stale = driver.clone();
    let stale_period = Duration::from_secs(cli.stale_claim_seconds.max(1));
    spawn_periodic(
        "stale-claims",
        Schedule::every(stale_period).first_after(stale_period),
        shutdown.clone(),
        move || {
            let driver = stale.clone();
            async move {
                driver.remove_stale().await;
            }
        },
    );
    let usage = driver.clone();
    spawn_periodic(
        "claim-usage",
        Duration::from_secs(cli.usage_monitor_seconds.max(1)),
        shutdown.clone(),
        move || {
            let driver = usage.clone();
            async move { driver.record_usage().await }
        },
    );
    spawn_process_watch(&cli, &client, &driver, &inventory, &shutdown);
    if cli.vgpu_feedback_period_seconds > 0 {
        let feedback = driver.clone();
        let period_secs = cli.vgpu_feedback_period_seconds;
        spawn_periodic(
            "vgpu-feedback",
            Duration::from_secs(period_secs),
            shutdown.clone(),
            move || {
                let driver = feedback.clone();
                async move {
                    let now_secs = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_secs());
                    driver
                        .feedback(FeedbackClock {
                            now_secs,
                            period_secs,
                        })
                        .await;
                }
            },
        );
    }
    super::plugin::serve(
        driver,
        cli.plugin_dir.join("dra.sock"),
        cli.registry_dir.join(format!("{DRIVER}-reg.sock")),
        registered,
        shutdown,
    )
    .await?;
    let _ = tokio::time::timeout(Duration::from_secs(5), metrics_server).await;
    Ok(())
}

/// Task `gpu-process-watch`: the device plugin's unaccounted-process watch over this node's
/// claims ([`ProcessWatch`], the driver as its [`tessera_node::process_watch::BookingSource`]):
/// a process on a GPU that no claim of its pod holds, a claim's process no region of that claim
/// lists, or a process in no pod is reported (Event, metric, log) and under `evict` its pod
/// evicted. With `off` nothing starts: no pod informer, no Event writer (the chart then grants
/// neither).
fn spawn_process_watch(
    cli: &DraCli,
    client: &kube::Client,
    driver: &Arc<DraDriver>,
    inventory: &Arc<NvmlInventory>,
    shutdown: &CancellationToken,
) {
    if cli.watch.unaccounted_process_policy == UnaccountedPolicy::Off {
        return;
    }
    // The resource name only marks the containers that request a device plugin's resource,
    // which the watch does not look at: a DRA node has none.
    let pods = Arc::new(KubePodSource::start_pods_only(
        client.clone(),
        &cli.node_name,
        "",
        shutdown,
    ));
    let (events, events_rx) = NodeEvents::channel();
    tessera_node::kube_edges::spawn_event_writer(
        client.clone(),
        &cli.node_name,
        EVENT_REPORTER,
        events_rx,
    );
    let watch = ProcessWatch {
        bookings: driver.clone(),
        gpus: inventory.clone(),
        proc: Arc::new(ProcReader::new(&cli.watch.proc_root)),
        pods,
        // An empty entry (the flag's default) allows nothing: `Exemptions::allows_host_cgroup`.
        allowed_host_cgroups: cli.watch.unaccounted_allowed_host_cgroups.clone(),
        policy: cli.watch.unaccounted_process_policy,
        evictor: Arc::new(KubeEvictor {
            client: client.clone(),
        }),
        events,
        metrics: driver.metrics().clone(),
        confirmer: Arc::default(),
        said_blind: Arc::default(),
    };
    spawn_periodic(
        "gpu-process-watch",
        Duration::from_secs(cli.watch.unaccounted_period_seconds.max(1)),
        shutdown.clone(),
        move || {
            let watch = watch.clone();
            async move { watch.pass().await.map(|_| ()) }
        },
    );
}

/// What the node offers: its GPUs with their facts, and the driver version.
struct NodeGpus {
    gpus: Vec<(GpuInfo, GpuFacts)>,
    driver_version: Option<String>,
}

async fn publish_slices(
    mut publisher: SlicePublisher,
    metrics: super::metrics::DraMetrics,
    NodeGpus {
        gpus,
        driver_version,
    }: NodeGpus,
    mut unhealthy: watch::Receiver<BTreeSet<String>>,
    registered: Arc<Notify>,
    period: Duration,
    shutdown: CancellationToken,
) {
    let mut retry = Duration::from_secs(1);
    loop {
        let bad = unhealthy.borrow_and_update().clone();
        for (g, _) in &gpus {
            metrics.gpu_health(&g.uuid, !bad.contains(&g.uuid));
        }
        let devices_for = |sharing| {
            let (devices, skipped) = slice_devices(
                &gpus,
                driver_version.as_deref(),
                &|u| !bad.contains(u),
                sharing,
            );
            for s in skipped {
                tracing::debug!(reason = %s, "GPU not offered");
            }
            devices
        };
        let synced = publisher.sync(&devices_for).await;
        metrics.slice_sync(synced.is_ok());
        let wait = match synced {
            Ok(_) => {
                retry = Duration::from_secs(1);
                period
            }
            Err(e) => {
                tracing::warn!(error = %DisplayChain(&e), "cannot publish the ResourceSlice; retrying");
                retry = (retry * 2).min(period);
                retry
            }
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = registered.notified() => {}
            changed = unhealthy.changed() => {
                if changed.is_err() {
                    return;
                }
            }
            _ = shutdown.cancelled() => return,
        }
    }
}

/// How long one NVML event wait blocks, and how often lost GPUs are polled and quiet ones
/// probed.
const EVENT_WAIT: Duration = Duration::from_secs(1);
const HEALTH_POLL: Duration = Duration::from_secs(5);

/// NVML events, lost-GPU polling and recovery on a blocking thread (NVML's event wait blocks);
/// every change of the unhealthy set goes to `unhealthy`.
fn spawn_health_thread(
    inventory: Arc<NvmlInventory>,
    policy: HealthPolicy,
    uuids: Vec<String>,
    unhealthy: watch::Sender<BTreeSet<String>>,
    shutdown: CancellationToken,
) -> Result<(), DraStartError> {
    let span = tessera_runtime::task_span("gpu-health");
    std::thread::Builder::new()
        .name("gpu-health".into())
        .spawn(move || {
            let _entered = span.enter();
            let mut tracker = HealthTracker::new(policy, uuids.iter().cloned());
            let mut last_poll = Instant::now();
            while !shutdown.is_cancelled() {
                let mut changed = false;
                match inventory.wait_event(EVENT_WAIT) {
                    Ok(Some(ev)) => changed |= tracker.apply(&ev, Instant::now()),
                    Ok(None) => {}
                    Err(e) => {
                        tracing::warn!(error = %DisplayChain(&e), "NVML event wait failed");
                        std::thread::sleep(EVENT_WAIT);
                    }
                }
                if last_poll.elapsed() >= HEALTH_POLL {
                    last_poll = Instant::now();
                    let healthy: Vec<String> = uuids
                        .iter()
                        .filter(|u| tracker.is_healthy(u))
                        .cloned()
                        .collect();
                    for ev in lost_gpus(inventory.as_ref(), &healthy) {
                        changed |= tracker.apply(&ev, Instant::now());
                    }
                    for uuid in tracker.due_for_probe(Instant::now()) {
                        changed |=
                            tracker.probe_result(&uuid, inventory.answers(&uuid), Instant::now());
                    }
                }
                if changed {
                    let bad: BTreeSet<String> =
                        tracker.unhealthy().into_iter().map(str::to_owned).collect();
                    tracing::warn!(unhealthy = ?bad, "GPU health changed");
                    let _ = unhealthy.send(bad);
                }
            }
        })
        .map_err(DraStartError::HealthThread)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--help` starts with what the program is, not with the doc comment of a group of flags
    /// it flattens (issue 34).
    #[test]
    fn help_starts_with_what_the_program_is() {
        use clap::CommandFactory;
        let help = DraCli::command().render_help().to_string();
        assert!(
            help.starts_with("Tessera's DRA driver (gpu.tessera.dev)"),
            "{help}"
        );
    }

    fn parse(args: &[&str]) -> Result<DraCli, clap::Error> {
        DraCli::try_parse_from(
            ["tessera-dra-plugin", "--node-name", "n"]
                .iter()
                .chain(args.iter()),
        )
    }

    #[test]
    fn the_unaccounted_process_watch_takes_the_device_plugins_flags_and_defaults() {
        use clap::CommandFactory;
        DraCli::command().debug_assert();
        let cli = parse(&[]).expect("defaults");
        assert_eq!(
            cli.watch.unaccounted_process_policy,
            UnaccountedPolicy::Report
        );
        assert_eq!(cli.watch.unaccounted_period_seconds, 15);
        assert_eq!(cli.watch.proc_root, PathBuf::from("/proc"));
        // The flag's empty default is one empty entry, which allows nothing.
        assert!(
            cli.watch
                .unaccounted_allowed_host_cgroups
                .iter()
                .all(String::is_empty)
        );
        let cli = parse(&[
            "--unaccounted-process-policy=evict",
            "--unaccounted-allowed-host-cgroups=/system.slice/a.service,/system.slice/b.service",
            "--unaccounted-period-seconds=5",
            "--proc-root=/host/proc",
        ])
        .expect("the chart's flags");
        assert_eq!(
            cli.watch.unaccounted_process_policy,
            UnaccountedPolicy::Evict
        );
        assert_eq!(
            cli.watch.unaccounted_allowed_host_cgroups,
            ["/system.slice/a.service", "/system.slice/b.service"]
        );
        assert_eq!(cli.watch.unaccounted_period_seconds, 5);
        assert_eq!(cli.watch.proc_root, PathBuf::from("/host/proc"));
        assert!(parse(&["--unaccounted-process-policy=kill"]).is_err());
        let env_of = |id: &str| {
            DraCli::command()
                .get_arguments()
                .find(|a| a.get_id() == id)
                .and_then(|a| a.get_env().map(|e| e.to_string_lossy().into_owned()))
        };
        for (id, env) in [
            ("unaccounted_process_policy", "UNACCOUNTED_PROCESS_POLICY"),
            (
                "unaccounted_allowed_host_cgroups",
                "UNACCOUNTED_ALLOWED_HOST_CGROUPS",
            ),
            ("unaccounted_period_seconds", "UNACCOUNTED_PERIOD_SECONDS"),
            ("proc_root", "PROC_ROOT"),
        ] {
            assert_eq!(env_of(id).as_deref(), Some(env), "{id}");
        }
    }
}

//! The daemon: configuration, NVML, the kubelet server and the background tasks, wired
//! together. `main` parses the command line, installs logging and calls [`run`].
//!
//! Background work, each a named task (its logs carry `task{name=…}`):
//!
//! | task | what | when |
//! |---|---|---|
//! | `gpu-health` (thread) | NVML events, lost GPUs, recovery, host metrics, rediscovery | [`Periods::health_poll`], [`Periods::rediscovery`] |
//! | `node-annotation` | `hami.io/node-nvidia-register` (and opt-in `hami.io/node-nvidia-score`, capacity) | on change and [`Periods::annotation`] |
//! | `vgpu-monitor` | container usage metrics, gone pods' directories | [`Periods::vgpu_monitor`] |
//! | `gpu-process-watch` | GPU processes no allocation accounts for: Event, metric, log; eviction under `evict` (`--unaccounted-process-policy`) | [`Periods::unaccounted`] |
//! | `vgpu-feedback` | `recent_kernel` and `utilization_switch` into the regions (priority, elastic core limit) | [`Periods::vgpu_feedback`] |
//! | `ledger-gc` | drops ledger entries of pods no longer pending; releases a HAMi node lock no pod waits on | [`Periods::ledger_gc`] |
//! | `pod-watch`, `node-watch` | informers | continuously |
//! | `metrics-server` | `/metrics`, `/healthz` | continuously |
//! | `sighup`, `signals` | restart on SIGHUP; shutdown on SIGTERM / SIGINT | on signal |
//! | `device-plugin-server` | the kubelet-facing gRPC server | per registration |

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tessera_http::metrics_access::MetricsGate;
use tokio::time::Instant;

use hami_contract::config::{ConfigError, DeviceConfig, NodeConfigFile};
use tessera_runtime::{CancellationToken, DisplayChain, Schedule, spawn_periodic, spawn_task};
use vgpu_region::feedback::CorePolicy;

use crate::cli::{Cli, Periods};
use crate::kubelet::{KubeletError, KubeletSettings, socket_name_for};
use crate::service::DevicePluginService;
use tessera_node::allocator::Allocator;
use tessera_node::conflict::{ConflictTracker, PluginConflict, ids_naming_our_gpus};
use tessera_node::container_env::ResponseSettings;
use tessera_node::device_state::DeviceState;
use tessera_node::edges::{PodResourcesSource, PodSource};
use tessera_node::gpu::{
    AdvertiseSettings, MODE_MIG, SettingsError, merge_rediscovered, plan_gpus,
};
use tessera_node::gpu_processes::ProcReader;
use tessera_node::health::{DisableSpecError, HealthPolicy, HealthTracker};
use tessera_node::kube_edges::KubeEvictor;
use tessera_node::kube_edges::{CapacityNames, KubePatcher, KubePodSource, NodeAnnotator};
use tessera_node::metrics::PluginMetrics;
use tessera_node::metrics::Readiness;
use tessera_node::mig::{MigManager, active_reservations};
use tessera_node::monitor::{VgpuFeedback, VgpuMonitor};
use tessera_node::node_events::{NodeEvent, NodeEvents};
use tessera_node::nvml::{GpuInventory, InventoryError, NvmlInventory, lost_gpus};
use tessera_node::pod_resources::KubeletPodResources;
use tessera_node::process_watch::{HamiBookings, ProcessWatch, UnaccountedPolicy};

/// Why the daemon could not start (or its kubelet server could not run). `main` prints it with
/// its whole chain on one line.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot read {}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid device config {}", path.display())]
    DeviceConfig {
        path: PathBuf,
        #[source]
        source: ConfigError,
    },
    #[error("invalid node config {}", path.display())]
    NodeConfig {
        path: PathBuf,
        #[source]
        source: ConfigError,
    },
    #[error("invalid configuration")]
    Settings(#[source] SettingsError),
    #[error(transparent)]
    DisableHealthchecks(#[from] DisableSpecError),
    #[error("--scheduler-name: at least one scheduler name is needed")]
    NoSchedulerName,
    #[error("no NVIDIA driver usable on this node")]
    NoDriver(#[source] InventoryError),
    #[error("GPU discovery failed")]
    Discovery(#[source] InventoryError),
    #[error("cannot start the health thread")]
    HealthThread(#[source] std::io::Error),
    #[error(transparent)]
    Kube(#[from] tessera_node::kube_edges::ClientError),
    #[error("cannot listen on {addr}")]
    MetricsListen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot watch SIGTERM and SIGINT")]
    Signals(#[source] std::io::Error),
    #[error("device plugin server failed")]
    Kubelet(#[source] KubeletError),
}

/// A file's text; `None` when it does not exist.
fn read_optional(path: &Path) -> Result<Option<String>, StartError> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(StartError::Read {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// What the configuration files and flags decide, checked before anything is touched.
struct Config {
    nvidia: hami_contract::config::NvidiaConfig,
    advertise: AdvertiseSettings,
    preferred_allocation: bool,
    health: HealthPolicy,
}

fn load_config(cli: &Cli) -> Result<Config, StartError> {
    let device_config = match read_optional(&cli.config_file)? {
        Some(text) => {
            DeviceConfig::from_yaml(&text).map_err(|source| StartError::DeviceConfig {
                path: cli.config_file.clone(),
                source,
            })?
        }
        None => {
            tracing::warn!(path = %cli.config_file.display(), "device config not found; using HAMi chart defaults");
            DeviceConfig::default()
        }
    };
    let node_entry = match read_optional(&cli.node_config)? {
        Some(text) => NodeConfigFile::from_json(&text)
            .map_err(|source| StartError::NodeConfig {
                path: cli.node_config.clone(),
                source,
            })?
            .for_node(&cli.node_name)
            .cloned(),
        None => None,
    };
    let nvidia = match &node_entry {
        Some(n) => device_config.nvidia.with_node_override(n),
        None => device_config.nvidia.clone(),
    };
    let advertise = AdvertiseSettings::new(
        &nvidia,
        node_entry
            .as_ref()
            .map(|n| n.filterdevices.clone())
            .unwrap_or_default(),
        node_entry
            .as_ref()
            .map(|n| n.operatingmode.as_str())
            .unwrap_or(""),
    );
    let mut advertise = advertise;
    advertise.mig_strategy = cli.mig_strategy;
    advertise.validate().map_err(StartError::Settings)?;
    let preferred_allocation = node_entry
        .as_ref()
        .and_then(|n| n.enablegetpreferredallocation)
        .unwrap_or(false);
    let health = HealthPolicy {
        recovery_quiet: Duration::from_secs(cli.health_recovery_seconds),
        ..HealthPolicy::default()
    }
    .with_disable_spec(&cli.disable_healthchecks)?;
    Ok(Config {
        nvidia,
        advertise,
        preferred_allocation,
        health,
    })
}

/// Runs the device plugin until SIGTERM or SIGINT (or, with `--print-register`, prints and
/// exits).
pub async fn run(cli: Cli) -> Result<(), StartError> {
    let periods = cli.periods();
    let config = load_config(&cli)?;

    // NVML, loaded at run time.
    let inventory = match NvmlInventory::load(&cli.nvml_lib, cli.sysfs_root.clone()) {
        Ok(i) => Arc::new(i),
        Err(e) if cli.fail_on_init_error || cli.print_register => {
            return Err(StartError::NoDriver(e));
        }
        Err(e) => return idle_without_nvml(&cli, &periods, &e).await,
    };
    let metrics = PluginMetrics::with_legacy_names(cli.legacy_metric_names);
    let NodeGpus {
        mig,
        discovered,
        state,
    } = node_gpus(&cli, &config, &inventory, &metrics)?;
    let shutdown = CancellationToken::new();
    spawn_health_thread(
        HealthThread {
            node: cli.node_name.clone(),
            state: state.clone(),
            inventory: inventory.clone(),
            metrics: metrics.clone(),
            advertise: config.advertise.clone(),
            topology_score: cli.enable_topology_score,
            periods,
            mig: mig.clone(),
        },
        shutdown.clone(),
    )?;
    if cli.print_register {
        if cli.enable_topology_score {
            state.read_topology(inventory.as_ref());
        }
        print_register(&state, Duration::from_secs(cli.watch_seconds)).await;
        shutdown.cancel();
        return Ok(());
    }
    tessera_runtime::shutdown::cancel_on_signals(&shutdown).map_err(StartError::Signals)?;

    let client = tessera_node::kube_edges::client(cli.kubeconfig.as_deref()).await?;
    let (events, events_rx) = NodeEvents::channel();
    tessera_node::kube_edges::spawn_node_event_writer(client.clone(), &cli.node_name, events_rx);
    check_node_runtime(&cli, &metrics, &events);
    let node_events = events.clone();
    state.attach_events(events);
    // After the Events are attached, so asymmetric links reach the node's Events; before the
    // annotation task starts, so its first write carries the scores.
    if cli.enable_topology_score {
        state.read_topology(inventory.as_ref());
    }
    let resource = config.nvidia.resources.count.clone();
    let pods: Arc<KubePodSource> = Arc::new(KubePodSource::start(
        client.clone(),
        &cli.node_name,
        &resource,
        &shutdown,
    ));
    let evict_client = client.clone();
    let metrics_gate = MetricsGate::from_args(&cli.metrics_access, &client);
    let patcher = KubePatcher::new(client, &cli.node_name);
    let mut allocator = allocator(&cli, &config, &state, pods.clone(), &patcher, &metrics)?;
    if let Some(manager) = &mig {
        allocator.mig = Some(manager.clone());
        allocator.mig_gpus = state.mig_gpus.clone();
        // Carving a GPU instance takes NVML up to seconds on real hardware.
        allocator.budget = allocator.budget.max(MIG_ALLOCATE_BUDGET);
        spawn_mig_reconciler(
            manager.clone(),
            state.clone(),
            pods.clone(),
            cli.node_name.clone(),
            periods.mig_reconcile,
            shutdown.clone(),
        );
    }
    let allocator = Arc::new(allocator);

    let readiness = Readiness::default();
    serve_metrics(
        cli.metrics_addr,
        &metrics,
        readiness.clone(),
        metrics_gate,
        shutdown.clone(),
    )
    .await?;
    spawn_task(
        "node-annotation",
        NodeAnnotator {
            patcher,
            state: state.clone(),
            period: periods.annotation,
            retry: periods.annotation_retry,
            metrics: Some(metrics.clone()),
            capacity: cli.publish_capacity.then(|| CapacityNames {
                memory: config.nvidia.resources.memory.clone(),
                cores: config.nvidia.resources.cores.clone(),
            }),
            pod_resources: Some(pod_resources_source(&cli, &config)),
        }
        .run(shutdown.clone()),
    );
    spawn_usage_monitors(
        UsageMonitors {
            cli: &cli,
            config: &config,
            periods,
            pods: pods.clone(),
            state: state.clone(),
            gpus: inventory.clone(),
            metrics: metrics.clone(),
            events: node_events,
            evictor: Arc::new(KubeEvictor {
                client: evict_client,
            }),
        },
        &shutdown,
    );
    spawn_ledger_gc(&allocator, &periods, &shutdown);
    spawn_conflict_scan(&cli, &resource, &pods, &state, &metrics, &shutdown);
    let restart = restart_on_sighup();
    spawn_mixed_mig_resources(
        &cli,
        &config,
        &discovered,
        &allocator,
        &periods,
        &restart,
        &shutdown,
    );

    let settings = KubeletSettings {
        socket_dir: cli.socket_dir.clone(),
        socket_name: socket_name_for(&resource),
        resource_name: resource,
        preferred_allocation: config.preferred_allocation,
        poll_interval: periods.kubelet_poll,
        register_retry: periods.register_retry,
        stop_grace: periods.stop_grace,
        restart,
        readiness,
    };
    let preferred_allocation = config.preferred_allocation;
    // One service per kubelet instance the plugin registers with.
    let make = move |stop| {
        allocator.kubelet_restarted();
        DevicePluginService {
            state: state.clone(),
            allocator: allocator.clone(),
            preferred_allocation,
            stop,
            exclusive: false,
        }
    };
    crate::kubelet::run(settings, make, shutdown, Some(metrics))
        .await
        .map_err(StartError::Kubelet)
}

/// What NVML shows of the node, as the plugin will advertise it.
struct NodeGpus {
    /// Dynamic MIG: the node carves the instances the scheduler reserves (contract §6.4).
    mig: Option<Arc<MigManager>>,
    discovered: Vec<tessera_node::gpu::GpuInfo>,
    state: Arc<DeviceState>,
}

/// Discovers the GPUs, decides which are advertised (and how), and starts their device state.
fn node_gpus(
    cli: &Cli,
    config: &Config,
    inventory: &NvmlInventory,
    metrics: &PluginMetrics,
) -> Result<NodeGpus, StartError> {
    let mig = (config.advertise.operating_mode == MODE_MIG).then(|| {
        Arc::new(MigManager::load(
            Arc::new(inventory.mig()),
            Some(mig_checkpoint_path(cli)),
        ))
    });
    let discovered = inventory.discover().map_err(StartError::Discovery)?;
    let (managed, skipped) = plan_gpus(&discovered, &config.advertise, &owned_by(&mig));
    for s in &skipped {
        tracing::warn!(reason = %s, "GPU not advertised");
    }
    tracing::info!(
        gpus = managed.len(),
        split = config.advertise.split_count,
        "GPUs discovered"
    );
    let tracker = HealthTracker::new(
        config.health.clone(),
        managed.iter().map(|g| g.uuid.clone()),
    );
    let state = DeviceState::new(
        managed,
        tracker,
        config.advertise.enable_numa_topology,
        Some(metrics.clone()),
    );
    Ok(NodeGpus {
        mig,
        discovered,
        state,
    })
}

/// Drops ledger entries of pods no longer pending, and releases a HAMi node lock no pod waits
/// on (first run one period after start).
fn spawn_ledger_gc(allocator: &Arc<Allocator>, periods: &Periods, shutdown: &CancellationToken) {
    let allocator = allocator.clone();
    spawn_periodic(
        "ledger-gc",
        Schedule::every(periods.ledger_gc).first_after(periods.ledger_gc),
        shutdown.clone(),
        move || {
            let allocator = allocator.clone();
            async move {
                allocator.gc_ledger().await;
                allocator.release_stale_hami_lock().await;
            }
        },
    );
}

/// Watches for another device plugin serving this node's GPUs.
fn spawn_conflict_scan(
    cli: &Cli,
    resource: &str,
    pods: &Arc<KubePodSource>,
    state: &Arc<DeviceState>,
    metrics: &PluginMetrics,
    shutdown: &CancellationToken,
) {
    let scan = ConflictScan {
        socket_dir: cli.socket_dir.clone(),
        own_socket: socket_name_for(resource),
        pods: pods.clone(),
        state: state.clone(),
        metrics: metrics.clone(),
        tracker: Arc::default(),
    };
    spawn_periodic(
        "plugin-conflicts",
        Schedule::every(CONFLICT_SCAN).first_after(CONFLICT_SCAN_FIRST),
        shutdown.clone(),
        move || {
            let scan = scan.clone();
            async move { scan.pass().await }
        },
    );
}

/// What the usage monitors share.
struct UsageMonitors<'a> {
    cli: &'a Cli,
    config: &'a Config,
    periods: Periods,
    pods: Arc<KubePodSource>,
    state: Arc<DeviceState>,
    gpus: Arc<NvmlInventory>,
    metrics: PluginMetrics,
    events: NodeEvents,
    evictor: Arc<KubeEvictor>,
}

/// The vGPU monitor (usage metrics, gone pods' directories), its feedback loop into the
/// regions, and the unaccounted-process watch.
fn spawn_usage_monitors(m: UsageMonitors<'_>, shutdown: &CancellationToken) {
    let containers_dir = PathBuf::from(format!(
        "{}/vgpu/containers",
        m.cli.hook_path.trim_end_matches('/')
    ));
    if let Some(period) = m.periods.vgpu_feedback {
        let feedback = VgpuFeedback {
            containers_dir: containers_dir.clone(),
            pods: m.pods.clone(),
            policy: node_core_policy(&m.config.nvidia),
            period,
        };
        spawn_periodic("vgpu-feedback", period, shutdown.clone(), move || {
            let feedback = feedback.clone();
            async move { feedback.pass().await }
        });
    }
    let monitor = VgpuMonitor {
        containers_dir: containers_dir.clone(),
        pods: m.pods.clone(),
        metrics: m.metrics.clone(),
        orphan_grace: m.periods.orphan_dir_grace,
        skip_log: Default::default(),
    };
    spawn_periodic(
        "vgpu-monitor",
        m.periods.vgpu_monitor,
        shutdown.clone(),
        move || {
            let monitor = monitor.clone();
            async move { monitor.pass().await }
        },
    );
    if m.cli.watch.unaccounted_process_policy == UnaccountedPolicy::Off {
        return;
    }
    let watch = ProcessWatch {
        bookings: Arc::new(HamiBookings {
            containers_dir,
            state: m.state,
            memory_allowance_mib: m.cli.watch.unaccounted_memory_allowance_mib,
        }),
        gpus: m.gpus,
        proc: Arc::new(ProcReader::new(&m.cli.watch.proc_root)),
        pods: m.pods,
        // An empty entry (the flag's default) allows nothing: `Exemptions::allows_host_cgroup`.
        allowed_host_cgroups: m.cli.watch.unaccounted_allowed_host_cgroups.clone(),
        policy: m.cli.watch.unaccounted_process_policy,
        evictor: m.evictor,
        events: m.events,
        metrics: m.metrics,
        confirmer: Arc::default(),
        said_blind: Arc::default(),
    };
    spawn_periodic(
        "gpu-process-watch",
        m.periods.unaccounted,
        shutdown.clone(),
        move || {
            let watch = watch.clone();
            async move { watch.pass().await.map(|_| ()) }
        },
    );
}

/// The kubelet's pod-resources `List`, for `Allocate` and for the node's
/// `tessera.io/allocation-identity`.
/// Reads the node's NVIDIA container runtime configuration once at start and reports (log,
/// metric, and a Warning Event on the Node) a runtime that would give any container the GPUs its
/// own environment names, or none to GPU containers.
fn check_node_runtime(cli: &Cli, metrics: &PluginMetrics, events: &NodeEvents) {
    use tessera_node::nvidia_runtime::{RuntimeConfig, Verdict, assess};
    if let Some(dir) = &cli.simulated_gpus_dir {
        // No NVIDIA runtime on a node with simulated GPUs: the plugin hands out the driver.
        tracing::warn!(%dir, "simulated GPUs: every GPU container gets the fake driver from this directory; not for nodes with real GPUs");
        return;
    }
    let path = &cli.nvidia_runtime_config;
    let config = match std::fs::read_to_string(path) {
        Ok(text) => match RuntimeConfig::parse(&text) {
            Ok(c) => Some(c),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %DisplayChain(&e), "NVIDIA container runtime configuration unreadable");
                None
            }
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "NVIDIA container runtime configuration unreadable");
            None
        }
    };
    let strategy = cli.device_list_strategy;
    let verdict = assess(config, strategy);
    metrics.runtime_verdict(&verdict);
    if verdict == Verdict::Safe {
        tracing::info!(path = %path.display(), "{}", verdict.explain(strategy));
    } else {
        tracing::warn!(path = %path.display(), verdict = verdict.label(), "{}", verdict.explain(strategy));
        events.emit(NodeEvent::runtime_device_list(&verdict, strategy));
    }
}

fn pod_resources_source(cli: &Cli, config: &Config) -> Arc<dyn PodResourcesSource> {
    Arc::new(KubeletPodResources {
        socket: cli.pod_resources_socket.clone(),
        resource: config.nvidia.resources.count.clone(),
    })
}

/// `--print-register`: the register annotation value now (then, with topology, the score
/// annotation value), and the register value again on every change for `watch`.
async fn print_register(state: &DeviceState, watch: Duration) {
    // Subscribe before reading the first value: a change between printing it and subscribing
    // would otherwise be lost (CI saw an XID land in that gap, and the unhealthy state was
    // never printed).
    let mut changes = state.subscribe();
    changes.mark_unchanged();
    let mut printed = state.register_annotation();
    println!("{printed}");
    if let Some(scores) = state.score_annotation() {
        println!("{scores}");
    }
    let until = tokio::time::Instant::now() + watch;
    while let Ok(Ok(())) = tokio::time::timeout_at(until, changes.changed()).await {
        // A notification is not always a change of the value (a rediscovery or probe that
        // found the same GPUs): print only what differs, so each line is a new state.
        let now = state.register_annotation();
        if now != printed {
            println!("{now}");
            printed = now;
        }
    }
}

/// The core policy `Allocate` gives every container of the node (`GPU_CORE_UTILIZATION_POLICY`):
/// `disable` with `disableCoreLimit`, else `gpuCorePolicy`.
fn node_core_policy(nvidia: &hami_contract::config::NvidiaConfig) -> CorePolicy {
    use hami_contract::config::GpuCorePolicy;
    if nvidia.disable_core_limit {
        return CorePolicy::Disable;
    }
    match nvidia.gpu_core_policy {
        GpuCorePolicy::Default => CorePolicy::Default,
        GpuCorePolicy::Force => CorePolicy::Force,
        GpuCorePolicy::Disable => CorePolicy::Disable,
    }
}

fn allocator(
    cli: &Cli,
    config: &Config,
    state: &DeviceState,
    pods: Arc<dyn PodSource>,
    patcher: &KubePatcher,
    metrics: &PluginMetrics,
) -> Result<Allocator, StartError> {
    let vgpu_dir = format!("{}/vgpu", cli.hook_path.trim_end_matches('/'));
    let shim_host_path = tessera_node::container_env::resolve_shim_host_path(&cli.hook_path);
    let mut allocator = Allocator::new(
        cli.node_name.clone(),
        ResponseSettings {
            hook_path: cli.hook_path.clone(),
            memory_scaling: config.nvidia.device_memory_scaling,
            lib_cuda_log_level: config.nvidia.lib_cuda_log_level.clone(),
            disable_core_limit: config.nvidia.disable_core_limit,
            core_policy: config.nvidia.gpu_core_policy,
            shim_host_path,
            license_present: Path::new(&format!("{vgpu_dir}/license")).exists(),
            cdi_devices: cli.cdi_devices,
            device_list: cli.device_list_strategy,
            simulated_driver: cli.simulated_gpus_dir.as_ref().map(|dir| {
                tessera_node::container_env::SimulatedDriver {
                    host_dir: dir.clone(),
                    memory_mib: cli.simulated_gpu_memory_mib,
                }
            }),
        },
        state.managed_uuids.clone(),
        pods,
        Arc::new(patcher.clone()),
        pod_resources_source(cli, config),
    );
    allocator.metrics = Some(metrics.clone());
    allocator.budget = Duration::from_secs(cli.allocate_timeout_seconds);
    allocator.cache_dirs = cli.cache_dir.cache_dirs(&cli.watch.proc_root);
    allocator.scheduler_names = cli
        .scheduler_names
        .iter()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .collect();
    if allocator.scheduler_names.is_empty() {
        return Err(StartError::NoSchedulerName);
    }
    Ok(allocator)
}

/// `--mig-strategy mixed`: one more kubelet resource per MIG profile carved on the node
/// (`nvidia.com/mig-<profile>`), each instance one unshared device. The set of instances is read
/// at start; carving or destroying instances takes a plugin restart to show (as NVIDIA's plugin).
fn spawn_mixed_mig_resources(
    cli: &Cli,
    config: &Config,
    discovered: &[tessera_node::gpu::GpuInfo],
    allocator: &Arc<Allocator>,
    periods: &Periods,
    restart: &Arc<tokio::sync::Notify>,
    shutdown: &CancellationToken,
) {
    for (resource, instances) in tessera_node::gpu::mixed_resources(discovered, &config.advertise) {
        tracing::info!(%resource, devices = instances.len(), "serving MIG instances (migStrategy mixed)");
        let tracker = HealthTracker::new(
            config.health.clone(),
            instances.iter().map(|g| g.uuid.clone()),
        );
        let state = DeviceState::new(instances, tracker, false, None);
        let settings = KubeletSettings {
            socket_dir: cli.socket_dir.clone(),
            socket_name: socket_name_for(&resource),
            resource_name: resource.clone(),
            preferred_allocation: true,
            poll_interval: periods.kubelet_poll,
            register_retry: periods.register_retry,
            stop_grace: periods.stop_grace,
            restart: restart.clone(),
            readiness: Readiness::default(),
        };
        let allocator = allocator.clone();
        let make = move |stop| DevicePluginService {
            state: state.clone(),
            allocator: allocator.clone(),
            preferred_allocation: true,
            stop,
            exclusive: true,
        };
        let shutdown = shutdown.clone();
        spawn_task("mig-resource-server", async move {
            if let Err(e) = crate::kubelet::run(settings, make, shutdown, None).await {
                tracing::error!(%resource, error = %DisplayChain(&e), "MIG resource server stopped");
            }
        });
    }
}

/// `Allocate`'s budget on a node in operating mode `mig`.
const MIG_ALLOCATE_BUDGET: Duration = Duration::from_secs(10);

/// Where the MIG records live on the host: beside the shim, in the directory the DaemonSet
/// already mounts from the host (so they outlive the plugin's container).
fn mig_checkpoint_path(cli: &Cli) -> PathBuf {
    PathBuf::from(format!(
        "{}/vgpu/tessera-mig-instances.json",
        cli.hook_path.trim_end_matches('/')
    ))
}

/// Whether a MIG instance is one Tessera carved (none without dynamic MIG).
fn owned_by(mig: &Option<Arc<MigManager>>) -> impl Fn(&str) -> bool + '_ {
    move |uuid| mig.as_ref().is_some_and(|m| m.owns(uuid))
}

/// Task `mig-reconcile`: on the first pass adopts the instances of running pods (after a
/// restart without its records), then each pass destroys the instances no live pod reserves.
/// Only a complete, fresh list of the node's pods authorizes a destroy.
fn spawn_mig_reconciler(
    manager: Arc<MigManager>,
    state: Arc<DeviceState>,
    pods: Arc<KubePodSource>,
    node: String,
    period: Duration,
    shutdown: CancellationToken,
) {
    let adopted = Arc::new(std::sync::atomic::AtomicBool::new(false));
    spawn_periodic("mig-reconcile", period, shutdown, move || {
        let (manager, state, pods, node, adopted) = (
            manager.clone(),
            state.clone(),
            pods.clone(),
            node.clone(),
            adopted.clone(),
        );
        async move {
            let list = match pods.fresh().await {
                Ok(list) => list,
                Err(e) => {
                    tracing::warn!(error = %DisplayChain(&e), "cannot list the node's pods; no MIG instance is destroyed this pass");
                    return;
                }
            };
            let gpus = state.mig_gpus.read().map(|m| m.clone()).unwrap_or_default();
            let work = move || {
                if !adopted.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    manager.adopt(&gpus, &list);
                }
                let Some(active) = active_reservations(&node, &list) else {
                    return;
                };
                let done = manager.reconcile(&gpus, &active);
                for (instance, reason) in &done.failed {
                    tracing::warn!(mig = %instance.mig_uuid, gpu = %instance.gpu_uuid, %reason, "cannot destroy a MIG instance no pod reserves; trying again next pass");
                }
            };
            if let Err(e) = tokio::task::spawn_blocking(work).await {
                tracing::error!(error = %e, "MIG reconcile pass panicked");
            }
        }
    });
}

/// SIGHUP restarts the kubelet server and re-registers (as HAMi's plugin does).
fn restart_on_sighup() -> Arc<tokio::sync::Notify> {
    let restart = Arc::new(tokio::sync::Notify::new());
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(mut hup) => {
            let restart = restart.clone();
            spawn_task("sighup", async move {
                while hup.recv().await.is_some() {
                    tracing::info!("SIGHUP: restarting the device plugin server");
                    restart.notify_one();
                }
            });
        }
        Err(e) => tracing::warn!(error = %DisplayChain(&e), "cannot watch SIGHUP"),
    }
    restart
}

/// The device plugin's /metrics, /healthz and /readyz listener ([`tessera_node::metrics::serve_http`]).
async fn serve_metrics(
    addr: SocketAddr,
    metrics: &PluginMetrics,
    readiness: Readiness,
    access: Option<Arc<MetricsGate>>,
    shutdown: CancellationToken,
) -> Result<tokio::task::JoinHandle<()>, StartError> {
    let metrics = metrics.clone();
    tessera_node::metrics::serve_http(
        addr,
        Arc::new(move || metrics.encode()),
        readiness,
        access,
        shutdown,
    )
    .await
    .map_err(|e| StartError::MetricsListen {
        addr: e.addr,
        source: e.source,
    })
}

/// `--fail-on-init-error=false` and no usable NVML: say why once, keep /healthz (the
/// DaemonSet's liveness probe) and /metrics answering, advertise nothing (no kubelet
/// registration, no node annotation, no apiserver at all), and exit 0 on SIGTERM or SIGINT.
async fn idle_without_nvml(
    cli: &Cli,
    periods: &Periods,
    cause: &InventoryError,
) -> Result<(), StartError> {
    tracing::error!(
        error = %DisplayChain(cause),
        "no NVIDIA driver usable on this node; --fail-on-init-error=false, so this node advertises no GPUs and the plugin waits for SIGTERM"
    );
    let shutdown = tessera_runtime::shutdown_on_signals().map_err(StartError::Signals)?;
    let metrics = PluginMetrics::with_legacy_names(cli.legacy_metric_names);
    // Open even with --metrics-authorization: there is no API client here, and these metrics
    // say only that the plugin runs without a driver (no GPU, no pod).
    let server = serve_metrics(
        cli.metrics_addr,
        &metrics,
        Readiness::always(),
        None,
        shutdown.clone(),
    )
    .await?;
    shutdown.cancelled().await;
    let _ = tokio::time::timeout(periods.stop_grace, server).await;
    Ok(())
}

/// What the health thread works with.
struct HealthThread {
    node: String,
    state: Arc<DeviceState>,
    inventory: Arc<NvmlInventory>,
    metrics: PluginMetrics,
    advertise: AdvertiseSettings,
    /// `--enable-topology-score`: a changed GPU list re-reads the GPU links first.
    topology_score: bool,
    periods: Periods,
    /// Dynamic MIG: which instances are Tessera's (rediscovery withholds the others' slices).
    mig: Option<Arc<MigManager>>,
}

/// NVML events, lost-GPU polling, recovery, host metrics and rediscovery, on one blocking
/// thread (NVML's event wait blocks) in the span of task `gpu-health`, until `shutdown`.
fn spawn_health_thread(work: HealthThread, shutdown: CancellationToken) -> Result<(), StartError> {
    let span = tessera_runtime::task_span("gpu-health");
    std::thread::Builder::new()
        .name("gpu-health".into())
        .spawn(move || {
            let _entered = span.enter();
            work.run(&shutdown);
        })
        .map_err(StartError::HealthThread)?;
    Ok(())
}

impl HealthThread {
    // The health tracker's clock is `std`'s: this is a blocking thread, not async code.
    fn run(&self, shutdown: &CancellationToken) {
        let HealthThread {
            node,
            state,
            inventory,
            metrics,
            advertise,
            topology_score,
            periods,
            mig,
        } = self;
        let mut last_poll = Instant::now();
        let mut last_discovery = Instant::now();
        while !shutdown.is_cancelled() {
            match inventory.wait_event(periods.nvml_event_wait) {
                Ok(Some(ev)) => state.health_event(&ev, Instant::now()),
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(error = %DisplayChain(&e), "NVML event wait failed");
                    std::thread::sleep(periods.nvml_event_wait);
                }
            }
            if last_discovery.elapsed() >= periods.rediscovery {
                last_discovery = Instant::now();
                match inventory.discover() {
                    Ok(found) => {
                        let (fresh, _) = plan_gpus(&found, advertise, &owned_by(mig));
                        if let Some(merged) = merge_rediscovered(&state.gpus(), &fresh) {
                            tracing::info!(gpus = merged.len(), "GPU list changed");
                            // Links first, so the annotation written on the change has the new
                            // GPU's scores.
                            if *topology_score {
                                state.read_topology(inventory.as_ref());
                            }
                            state.set_gpus(merged);
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %DisplayChain(&e), "GPU rediscovery failed; keeping the current list")
                    }
                }
            }
            if last_poll.elapsed() >= periods.health_poll {
                last_poll = Instant::now();
                for ev in lost_gpus(inventory.as_ref(), &state.healthy_uuids()) {
                    state.health_event(&ev, Instant::now());
                }
                state.recover(&|u| inventory.answers(u), Instant::now());
                let gpus = state.gpus();
                for s in inventory.sample() {
                    let model = gpus
                        .iter()
                        .find(|g| g.uuid == s.uuid)
                        .map(|g| g.model_type.as_str())
                        .unwrap_or("");
                    metrics.host_gpu(node, model, &s);
                }
            }
        }
    }
}

/// How often the node is checked for another device plugin serving its GPUs, and the delay of
/// the first check (the other plugin's pod and socket need a moment after a node boots).
const CONFLICT_SCAN: Duration = Duration::from_secs(60);
const CONFLICT_SCAN_FIRST: Duration = Duration::from_secs(15);
/// How long another plugin's socket may take to list its devices.
const CONFLICT_PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// One pass of task `plugin-conflicts`: the other sockets in the kubelet's directory that list
/// this node's GPUs, and known GPU device-plugin pods on the node. A conflict is reported (Warning
/// Event `DevicePluginConflict`, metric `tessera_device_plugin_conflict`) when it appears; its
/// series is removed when it is gone.
#[derive(Clone)]
struct ConflictScan {
    socket_dir: PathBuf,
    own_socket: String,
    pods: Arc<KubePodSource>,
    state: Arc<DeviceState>,
    metrics: PluginMetrics,
    tracker: Arc<std::sync::Mutex<ConflictTracker>>,
}

impl ConflictScan {
    async fn pass(&self) {
        let ours: BTreeSet<String> = self.state.gpus().into_iter().map(|g| g.uuid).collect();
        let mut seen: BTreeSet<PluginConflict> = self.pods.gpu_plugin_pods().into_iter().collect();
        for (socket, ids) in crate::kubelet::foreign_plugin_devices(
            &self.socket_dir,
            &self.own_socket,
            CONFLICT_PROBE_TIMEOUT,
        )
        .await
        {
            let devices = ids_naming_our_gpus(&ours, &ids);
            if !devices.is_empty() {
                seen.insert(PluginConflict::SameGpus { socket, devices });
            }
        }
        let Ok(change) = self.tracker.lock().map(|mut t| t.update(seen)) else {
            return;
        };
        for c in &change.appeared {
            tracing::warn!(message = %c.message(), "another device plugin serves this node's GPUs");
            self.metrics.plugin_conflict(c, true);
            self.state.emit(NodeEvent::plugin_conflict(c));
        }
        for c in &change.gone {
            tracing::info!(
                kind = c.kind(),
                source = c.source(),
                "the other device plugin is gone"
            );
            self.metrics.plugin_conflict(c, false);
        }
    }
}

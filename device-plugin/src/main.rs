//! `tessera-device-plugin`: wires the library's pieces to NVML, the kubelet and the apiserver.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use hami_contract::config::{DeviceConfig, NodeConfigFile};
use tessera_device_plugin::allocator::{Allocator, PodSource};
use tessera_device_plugin::cli::{Cli, LogFormat};
use tessera_device_plugin::container_env::ResponseSettings;
use tessera_device_plugin::gpu::{AdvertiseSettings, merge_rediscovered, plan_gpus};
use tessera_device_plugin::health::{HealthPolicy, HealthTracker};
use tessera_device_plugin::kube_edges::{
    CapacityNames, KubePatcher, KubePodSource, annotation_loop,
};
use tessera_device_plugin::kubelet::{KubeletSettings, socket_name_for};
use tessera_device_plugin::metrics::PluginMetrics;
use tessera_device_plugin::nvml::{GpuInventory, InventoryError, NvmlInventory, lost_gpus};
use tessera_device_plugin::pod_resources::KubeletPodResources;
use tessera_device_plugin::service::{DevicePluginService, DeviceState};
use tokio::sync::watch;

/// RUST_LOG wins; otherwise `-v`/`--debug` (HAMi's flags), otherwise `info`.
fn init_logging(format: LogFormat, directive: Option<String>) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new(directive.as_deref().unwrap_or("info"))
    });
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        // Colour only on a terminal: container logs (`kubectl logs`) must stay plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    init_logging(cli.log_format, cli.log_directive());

    // Configuration: refuse bad input before touching anything.
    let device_config = match std::fs::read_to_string(&cli.config_file) {
        Ok(text) => DeviceConfig::from_yaml(&text)
            .with_context(|| format!("invalid device config {}", cli.config_file.display()))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            tracing::warn!(path = %cli.config_file.display(), "device config not found; using HAMi chart defaults");
            DeviceConfig::default()
        }
        Err(e) => {
            return Err(e).with_context(|| format!("cannot read {}", cli.config_file.display()));
        }
    };
    let node_entry = match std::fs::read_to_string(&cli.node_config) {
        Ok(text) => NodeConfigFile::from_json(&text)
            .with_context(|| format!("invalid node config {}", cli.node_config.display()))?
            .for_node(&cli.node_name)
            .cloned(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => {
            return Err(e).with_context(|| format!("cannot read {}", cli.node_config.display()));
        }
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
    advertise.validate().context("invalid configuration")?;
    let preferred_allocation = node_entry
        .as_ref()
        .and_then(|n| n.enablegetpreferredallocation)
        .unwrap_or(false);
    let policy = HealthPolicy {
        recovery_quiet: Duration::from_secs(cli.health_recovery_seconds),
        ..HealthPolicy::default()
    }
    .with_disable_spec(&cli.disable_healthchecks)
    .map_err(anyhow::Error::msg)?;

    // NVML, loaded at run time.
    let inventory = match NvmlInventory::load(&cli.nvml_lib, cli.sysfs_root.clone()) {
        Ok(i) => Arc::new(i),
        Err(e) if cli.fail_on_init_error || cli.print_register => {
            bail!("no NVIDIA driver usable on this node: {e}")
        }
        Err(e) => return idle_without_nvml(&cli, &e).await,
    };
    let discovered = inventory.discover().context("GPU discovery failed")?;
    let (managed, skipped) = plan_gpus(&discovered, &advertise);
    for s in &skipped {
        tracing::warn!(reason = %s, "GPU not advertised");
    }
    tracing::info!(
        gpus = managed.len(),
        split = advertise.split_count,
        "GPUs discovered"
    );

    let metrics = PluginMetrics::with_legacy_names(cli.legacy_metric_names);
    let tracker = HealthTracker::new(policy, managed.iter().map(|g| g.uuid.clone()));
    let state = DeviceState::new(
        managed.clone(),
        tracker,
        advertise.enable_numa_topology,
        Some(metrics.clone()),
    );
    let (shutdown_tx, shutdown) = watch::channel(false);
    spawn_health_thread(
        &cli,
        &state,
        &inventory,
        &metrics,
        &advertise,
        shutdown.clone(),
    )?;
    if cli.print_register {
        println!("{}", state.register_annotation());
        let mut changes = state.subscribe();
        changes.mark_unchanged();
        let until = tokio::time::Instant::now() + Duration::from_secs(cli.watch_seconds);
        while let Ok(Ok(())) = tokio::time::timeout_at(until, changes.changed()).await {
            println!("{}", state.register_annotation());
        }
        let _ = shutdown_tx.send(true);
        return Ok(());
    }

    let client = match &cli.kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("cannot read kubeconfig {}", path.display()))?;
            let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
                .await
                .context("invalid kubeconfig")?;
            kube::Client::try_from(cfg).context("cannot build the Kubernetes client")?
        }
        None => kube::Client::try_default()
            .await
            .context("no Kubernetes configuration (in-cluster or KUBECONFIG)")?,
    };
    let resource = nvidia.resources.count.clone();
    let pod_source = Arc::new(KubePodSource::start(
        client.clone(),
        &cli.node_name,
        &resource,
    ));
    let pod_source_for_monitor = pod_source.clone();
    let patcher = KubePatcher::new(client, &cli.node_name);
    let vgpu_dir = format!("{}/vgpu", cli.hook_path.trim_end_matches('/'));
    let versioned = format!("{vgpu_dir}/libvgpu.so.{}", env!("CARGO_PKG_VERSION"));
    let shim_host_path = if std::path::Path::new(&versioned).exists() {
        versioned
    } else {
        format!("{vgpu_dir}/libvgpu.so")
    };
    let mut allocator = Allocator::new(
        cli.node_name.clone(),
        ResponseSettings {
            hook_path: cli.hook_path.clone(),
            memory_scaling: nvidia.device_memory_scaling,
            lib_cuda_log_level: nvidia.lib_cuda_log_level.clone(),
            disable_core_limit: nvidia.disable_core_limit,
            shim_host_path,
            license_present: std::path::Path::new(&format!("{vgpu_dir}/license")).exists(),
            cdi_devices: cli.cdi_devices,
        },
        state.managed_uuids.clone(),
        pod_source,
        Arc::new(patcher.clone()),
        Arc::new(KubeletPodResources {
            socket: cli.pod_resources_socket.clone(),
            resource: resource.clone(),
        }),
    );
    allocator.metrics = Some(metrics.clone());
    allocator.scheduler_names = cli
        .scheduler_names
        .iter()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .collect();
    if allocator.scheduler_names.is_empty() {
        anyhow::bail!("--scheduler-name: at least one scheduler name is needed");
    }
    let allocator = Arc::new(allocator);

    // Metrics and health endpoint.
    serve_metrics(&cli, &metrics, shutdown.clone()).await?;

    // Node annotation.
    tokio::spawn(annotation_loop(
        patcher,
        state.clone(),
        Duration::from_secs(cli.annotation_period_seconds.max(1)),
        Some(metrics.clone()),
        cli.publish_capacity.then(|| CapacityNames {
            memory: nvidia.resources.memory.clone(),
            cores: nvidia.resources.cores.clone(),
        }),
        shutdown.clone(),
    ));

    // vGPU monitor: per-container usage from the shim's region files.
    {
        let metrics = metrics.clone();
        let pods = pod_source_for_monitor.clone();
        let dir = std::path::PathBuf::from(format!(
            "{}/vgpu/containers",
            cli.hook_path.trim_end_matches('/')
        ));
        let mut stop = shutdown.clone();
        tokio::spawn(async move {
            loop {
                let scan_dir = dir.clone();
                let scanned = tokio::task::spawn_blocking(move || {
                    tessera_device_plugin::monitor::scan(&scan_dir)
                })
                .await;
                if let Ok((samples, skipped)) = scanned {
                    for s in &skipped {
                        tracing::warn!(path = %s.path, reason = %s.reason, "region file skipped");
                    }
                    let names = pods
                        .cached()
                        .into_iter()
                        .map(|p| (p.uid, (p.namespace, p.name)))
                        .collect();
                    metrics.set_vgpu(&samples, &names);
                }
                // A deleted pod's container directories (region files included) go with it.
                // Only against a fresh list: an informer that has not synced yet would make
                // every directory look orphaned.
                if let Ok(live) = pods.fresh().await {
                    let live: std::collections::BTreeSet<String> =
                        live.into_iter().map(|p| p.uid).collect();
                    let dir = dir.clone();
                    let removed = tokio::task::spawn_blocking(move || {
                        tessera_device_plugin::monitor::remove_stale_container_dirs(
                            &dir,
                            &live,
                            Duration::from_secs(30),
                        )
                    })
                    .await
                    .unwrap_or_default();
                    for (name, r) in removed {
                        match r {
                            Ok(()) => {
                                tracing::info!(dir = %name, "removed a gone pod's container directory")
                            }
                            Err(e) => {
                                tracing::warn!(dir = %name, error = %e, "cannot remove a gone pod's container directory")
                            }
                        }
                    }
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(15)) => {}
                    _ = async { let _ = stop.wait_for(|s| *s).await; } => return,
                }
            }
        });
    }

    // Ledger housekeeping.
    {
        let allocator = allocator.clone();
        let mut stop = shutdown.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(30)) => allocator.gc_ledger().await,
                    _ = async { let _ = stop.wait_for(|s| *s).await; } => return,
                }
            }
        });
    }

    // Signals.
    let restart = Arc::new(tokio::sync::Notify::new());
    {
        let restart = restart.clone();
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
            Ok(mut hup) => {
                tokio::spawn(async move {
                    while hup.recv().await.is_some() {
                        tracing::info!("SIGHUP: restarting the device plugin server");
                        restart.notify_one();
                    }
                });
            }
            Err(e) => tracing::warn!(error = %e, "cannot watch SIGHUP"),
        }
    }
    tokio::spawn(async move {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(e) => {
                    tracing::error!(error = %e, "cannot watch SIGTERM");
                    return;
                }
            };
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: shutting down"),
        }
        let _ = shutdown_tx.send(true);
    });

    let settings = KubeletSettings {
        socket_dir: cli.socket_dir.clone(),
        socket_name: socket_name_for(&resource),
        resource_name: resource,
        preferred_allocation,
        poll_interval: Duration::from_secs(1),
        restart: restart.clone(),
    };
    let make = {
        let state = state.clone();
        move |stop| DevicePluginService {
            state: state.clone(),
            allocator: allocator.clone(),
            preferred_allocation,
            stop,
        }
    };
    tessera_device_plugin::kubelet::run(settings, make, shutdown, Some(metrics))
        .await
        .context("device plugin server failed")?;
    Ok(())
}

/// The Prometheus /metrics and /healthz listener, until `shutdown`.
async fn serve_metrics(
    cli: &Cli,
    metrics: &PluginMetrics,
    shutdown: watch::Receiver<bool>,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let metrics = metrics.clone();
    let listener = tokio::net::TcpListener::bind(cli.metrics_addr)
        .await
        .with_context(|| format!("cannot listen on {}", cli.metrics_addr))?;
    let app = axum::Router::new()
        .route(
            "/metrics",
            axum::routing::get(move || {
                let m = metrics.clone();
                async move { m.encode() }
            }),
        )
        .route("/healthz", axum::routing::get(|| async { "ok" }));
    let mut stop = shutdown;
    Ok(tokio::spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = stop.wait_for(|s| *s).await;
            })
            .await;
        if let Err(e) = served {
            tracing::warn!(error = %e, "metrics server stopped");
        }
    }))
}

/// `--fail-on-init-error=false` and no usable NVML: say why once, keep /healthz (the
/// DaemonSet's liveness probe) and /metrics answering, advertise nothing (no kubelet
/// registration, no node annotation, no apiserver at all), and exit 0 on SIGTERM or SIGINT.
async fn idle_without_nvml(cli: &Cli, cause: &InventoryError) -> anyhow::Result<()> {
    tracing::error!(
        error = %cause,
        "no NVIDIA driver usable on this node; --fail-on-init-error=false, so this node advertises no GPUs and the plugin waits for SIGTERM"
    );
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("cannot watch SIGTERM")?;
    let (shutdown_tx, shutdown) = watch::channel(false);
    let metrics = PluginMetrics::with_legacy_names(cli.legacy_metric_names);
    let server = serve_metrics(cli, &metrics, shutdown).await?;
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: shutting down"),
    }
    let _ = shutdown_tx.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
    Ok(())
}

/// NVML events, lost-GPU polling, recovery and host metrics, on one blocking thread.
fn spawn_health_thread(
    cli: &Cli,
    state: &Arc<DeviceState>,
    inventory: &Arc<NvmlInventory>,
    metrics: &PluginMetrics,
    advertise: &AdvertiseSettings,
    shutdown: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let state = state.clone();
    let inventory = inventory.clone();
    let metrics = metrics.clone();
    let node = cli.node_name.clone();
    let advertise = advertise.clone();
    std::thread::Builder::new()
        .name("gpu-health".into())
        .spawn(move || {
            let mut last_poll = Instant::now();
            let mut last_discovery = Instant::now();
            while !*shutdown.borrow() {
                match inventory.wait_event(Duration::from_secs(1)) {
                    Ok(Some(ev)) => state.health_event(&ev, Instant::now()),
                    Ok(None) => {}
                    Err(e) => {
                        tracing::warn!(error = %e, "NVML event wait failed");
                        std::thread::sleep(Duration::from_secs(1));
                    }
                }
                if last_discovery.elapsed() >= Duration::from_secs(60) {
                    last_discovery = Instant::now();
                    match inventory.discover() {
                        Ok(found) => {
                            let (fresh, _) = plan_gpus(&found, &advertise);
                            if let Some(merged) = merge_rediscovered(&state.gpus(), &fresh) {
                                tracing::info!(gpus = merged.len(), "GPU list changed");
                                state.set_gpus(merged);
                            }
                        }
                        Err(e) => tracing::warn!(error = %e, "GPU rediscovery failed; keeping the current list"),
                    }
                }
                if last_poll.elapsed() >= Duration::from_secs(1) {
                    last_poll = Instant::now();
                    for ev in lost_gpus(inventory.as_ref(), &state.healthy_uuids()) {
                        state.health_event(&ev, Instant::now());
                    }
                    state.recover(&|u| inventory.answers(u), Instant::now());
                    let gpus = state.gpus();
                    for s in inventory.sample() {
                        let t = gpus
                            .iter()
                            .find(|g| g.uuid == s.uuid)
                            .map(|g| g.model_type.as_str())
                            .unwrap_or("");
                        metrics.host_gpu(
                            &node,
                            s.index,
                            &s.uuid,
                            t,
                            s.memory_used_bytes as f64,
                            f64::from(s.utilization_gpu),
                        );
                    }
                }
            }
        })
        .context("cannot start the health thread")?;
    Ok(())
}

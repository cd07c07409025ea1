//! Prometheus metrics: the plugin's own health plus HAMi's host GPU names (contract §8.2).

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tessera_http::listen::{ServeLimits, serve_listener};
use tessera_http::metrics_access::{MetricsGate, protect};

type Labels = Vec<(String, String)>;

/// The metrics listener could not bind its address.
#[derive(Debug, thiserror::Error)]
#[error("cannot listen on {addr}")]
pub struct MetricsListenError {
    pub addr: std::net::SocketAddr,
    #[source]
    pub source: std::io::Error,
}

/// The metrics listener's bounds: a scraper, the kubelet's probes and little else ever connect,
/// so a tenant's pod that opens many connections is held to a few and cannot keep the kubelet's
/// liveness probe out (which would restart the plugin) (listener: [`tessera_http::listen`]).
pub const METRICS_LISTENER_LIMITS: ServeLimits = ServeLimits {
    handshake_timeout: Duration::from_secs(10),
    header_timeout: Duration::from_secs(5),
    body_timeout: Duration::from_secs(3),
    idle_timeout: Duration::from_secs(90),
    max_connections: 128,
    max_connections_per_peer: 16,
    max_requests_per_peer: 16,
};

/// Serves `/metrics` (the text `encode` gives; behind `access` when set), `/healthz` (the
/// process answers) and `/readyz` (503 while `readiness` is unset: not registered with the
/// kubelet) as task `metrics-server`, until `shutdown`. Both plugins' DaemonSets probe the last
/// two, which stay open.
pub async fn serve_http(
    addr: std::net::SocketAddr,
    encode: Arc<dyn Fn() -> String + Send + Sync>,
    readiness: Readiness,
    access: Option<Arc<MetricsGate>>,
    shutdown: tokio_util::sync::CancellationToken,
) -> Result<tokio::task::JoinHandle<()>, MetricsListenError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| MetricsListenError { addr, source })?;
    let metrics = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let text = encode();
            async move { text }
        }),
    );
    let probes = axum::Router::new()
        .route("/healthz", axum::routing::get(|| async { "ok" }))
        .route(
            "/readyz",
            axum::routing::get(move || {
                let ready = readiness.is_ready();
                async move {
                    if ready {
                        (axum::http::StatusCode::OK, "ok")
                    } else {
                        (
                            axum::http::StatusCode::SERVICE_UNAVAILABLE,
                            "not registered with the kubelet",
                        )
                    }
                }
            }),
        );
    let app = protect(metrics, access).merge(probes);
    Ok(tessera_runtime::spawn_task("metrics-server", async move {
        tokio::select! {
            () = serve_listener(listener, app, None, METRICS_LISTENER_LIMITS) => {}
            () = shutdown.cancelled() => {}
        }
    }))
}

/// All metrics the plugin exports. Cheap to clone (shared handles).
#[derive(Clone)]
pub struct PluginMetrics {
    registry: ExposedRegistry,
    allocate_seconds: Histogram,
    allocate_steps: Family<Labels, Histogram, fn() -> Histogram>,
    allocations: Family<Labels, Counter>,
    identity: Family<Labels, Counter>,
    early_reads: Family<Labels, Counter>,
    registrations: Counter,
    gpu_healthy: Family<Labels, Gauge>,
    xid_errors: Family<Labels, Counter>,
    plugin_conflicts: Family<Labels, Gauge>,
    runtime_device_list: Family<Labels, Gauge>,
    annotation_patches: Family<Labels, Counter>,
    unaccounted_processes: Family<Labels, Gauge>,
    undetermined_processes: Gauge,
    unaccounted_actions: Family<Labels, Counter>,
    host_memory_used: Family<Labels, Gauge<f64, AtomicU64>>,
    host_utilization: Family<Labels, Gauge<f64, AtomicU64>>,
    host_memory_controller: Family<Labels, Gauge<f64, AtomicU64>>,
    /// `hami_vgpu_*` and `hami_container_*`: one series per (container, device).
    vgpu: SampleSeries,
    mig_device: Family<Labels, Gauge<f64, AtomicU64>>,
    legacy: Option<Legacy>,
}

/// HAMi's pre-v2.9 metric names and labels (contract §8.2), exported only on request.
#[derive(Clone)]
struct Legacy {
    host_memory: Family<Labels, Gauge<f64, AtomicU64>>,
    host_core: Family<Labels, Gauge<f64, AtomicU64>>,
    vgpu_used: Family<Labels, Gauge<f64, AtomicU64>>,
    vgpu_limit: Family<Labels, Gauge<f64, AtomicU64>>,
    container_memory: Family<Labels, Gauge<f64, AtomicU64>>,
    container_utilization: Family<Labels, Gauge<f64, AtomicU64>>,
    container_last_kernel: Family<Labels, Gauge<f64, AtomicU64>>,
    mig_device: Family<Labels, Gauge<f64, AtomicU64>>,
}

impl std::fmt::Debug for PluginMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginMetrics").finish_non_exhaustive()
    }
}

impl Default for PluginMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl PluginMetrics {
    pub fn new() -> Self {
        Self::with_legacy_names(false)
    }

    /// `legacy`: also export HAMi's pre-v2.9 names (`HostGPUMemoryUsage`, …).
    pub fn with_legacy_names(legacy: bool) -> Self {
        let mut registry = Registry::default();
        let allocate_seconds = registered(
            &mut registry,
            "tessera_device_plugin_allocate_duration_seconds",
            "Time to answer a kubelet Allocate call",
            Histogram::new(exponential_buckets(0.0005, 2.0, 14)),
        );
        let allocate_steps = registered(
            &mut registry,
            "tessera_device_plugin_allocate_step_duration_seconds",
            "Time an Allocate call spent in each step (step: pod_resources, the kubelet's List; identify, the reads by name or the LIST; files, the cache directory and limits file; patch, the pod's record when written before the answer)",
            Family::<Labels, Histogram, fn() -> Histogram>::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.0001, 2.0, 16))
            }),
        );
        let allocations = registered(
            &mut registry,
            "tessera_device_plugin_allocations",
            "Allocate calls by result (success, failure)",
            Family::<Labels, Counter>::default(),
        );
        let identity = registered(
            &mut registry,
            "tessera_device_plugin_identity_choices",
            "How Allocate identified the pod (reason: continuing, elimination, hami_lock, unique, oldest_of_class, reask) and on what it decided (read: cache_confirmed, list)",
            Family::<Labels, Counter>::default(),
        );
        let early_reads = registered(
            &mut registry,
            "tessera_device_plugin_early_reads",
            "Reads by name Allocate started before the kubelet's pod-resources List answered, of the pod the cache said the kubelet most likely admits (outcome: used, the call read that pod; unused, it did not and the read was dropped)",
            Family::<Labels, Counter>::default(),
        );
        let registrations = registered(
            &mut registry,
            "tessera_device_plugin_kubelet_registrations",
            "Successful registrations with the kubelet",
            Counter::default(),
        );
        let gpu_healthy = registered(
            &mut registry,
            "tessera_device_plugin_gpu_healthy",
            "1 when the GPU is healthy, 0 when its replicas are reported unhealthy",
            Family::<Labels, Gauge>::default(),
        );
        let xid_errors = registered(
            &mut registry,
            "tessera_device_plugin_xid_errors",
            "XID errors NVML reported per GPU (xid: the code; the ignored application XIDs included, which leave the GPU healthy)",
            Family::<Labels, Counter>::default(),
        );
        let plugin_conflicts = registered(
            &mut registry,
            "tessera_device_plugin_conflict",
            "1 while another device plugin is seen serving this node's GPUs (kind: socket_replaced, same_gpus, plugin_pod; source: the socket or pod); a replaced socket stays 1 until the plugin restarts",
            Family::<Labels, Gauge>::default(),
        );
        let runtime_device_list = registered(
            &mut registry,
            "tessera_device_plugin_runtime_device_list",
            "1 for this node's verdict on its NVIDIA container runtime (verdict: safe, accepts_env: any container can name GPUs in its environment, ignores_device_list: GPU containers get no GPU, unknown: no runtime configuration found)",
            Family::<Labels, Gauge>::default(),
        );
        let annotation_patches = registered(
            &mut registry,
            "tessera_device_plugin_node_annotation_patches",
            "Node register annotation patches by result",
            Family::<Labels, Counter>::default(),
        );
        let unaccounted_processes = registered(
            &mut registry,
            "tessera_device_plugin_unaccounted_gpu_processes",
            "GPU processes no allocation accounts for, confirmed over two monitor passes (reason: GpuNotBooked, GpuProcessWithoutShim, GpuProcessOutsidePods, as the Events)",
            Family::<Labels, Gauge>::default(),
        );
        let undetermined_processes = registered(
            &mut registry,
            "tessera_device_plugin_undetermined_gpu_processes",
            "GPU processes whose /proc entry could not be read in the last pass (exited meanwhile; all of them without hostPID)",
            Gauge::default(),
        );
        let unaccounted_actions = registered(
            &mut registry,
            "tessera_device_plugin_unaccounted_actions",
            "What the plugin did about pods with unaccounted GPU processes (action: reported, evicted, eviction_failed)",
            Family::<Labels, Counter>::default(),
        );
        let host_memory_used = registered(
            &mut registry,
            "hami_host_gpu_memory_used_bytes",
            "GPU device memory used on the host",
            Family::<Labels, Gauge<f64, AtomicU64>>::default(),
        );
        let host_utilization = registered(
            &mut registry,
            "hami_host_gpu_utilization_ratio",
            "GPU core utilization on the host (0-100)",
            Family::<Labels, Gauge<f64, AtomicU64>>::default(),
        );
        let host_memory_controller = registered(
            &mut registry,
            "hami_host_gpu_memory_controller_utilization_ratio",
            "GPU memory controller utilization on the host (0-100)",
            Family::<Labels, Gauge<f64, AtomicU64>>::default(),
        );
        tessera_runtime::register_build_info(&mut registry, env!("CARGO_PKG_VERSION"));
        let mut vgpu = |name: &str, help: &str| register_values(&mut registry, name, help);
        let vgpu_series = SampleSeries(vec![
            (
                vgpu(
                    "hami_vgpu_memory_used_bytes",
                    "Device memory used by a container (shim accounting)",
                ),
                sample::memory_used,
            ),
            (
                vgpu(
                    "hami_vgpu_memory_limit_bytes",
                    "Device memory limit of a container",
                ),
                sample::memory_limit,
            ),
            (
                vgpu(
                    "hami_vgpu_memory_context_bytes",
                    "CUDA context memory of a container",
                ),
                |s, _| Some(s.context_bytes as f64),
            ),
            (
                vgpu(
                    "hami_vgpu_memory_module_bytes",
                    "CUDA module memory of a container",
                ),
                |s, _| Some(s.module_bytes as f64),
            ),
            (
                vgpu(
                    "hami_vgpu_memory_buffer_bytes",
                    "Buffer (data) memory of a container",
                ),
                |s, _| Some(s.buffer_bytes as f64),
            ),
            (
                vgpu(
                    "hami_container_device_memory_bytes",
                    "Device memory used by a container (shim accounting; as hami_vgpu_memory_used_bytes)",
                ),
                sample::memory_used,
            ),
            (
                vgpu(
                    "tessera_vgpu_host_memory_bytes",
                    "Host memory a container holds in place of device memory past its device share (opt-in oversubscription, docs/oversubscription.md)",
                ),
                |s, _| Some(s.host_memory_bytes as f64),
            ),
            (
                vgpu(
                    "hami_container_device_utilization_ratio",
                    "SM utilization of a container's processes on the device (0-100, as the shim measures it)",
                ),
                sample::sm_util,
            ),
            (
                vgpu(
                    "hami_container_last_kernel_elapsed_seconds",
                    "Seconds since the container last launched a kernel (absent before its first)",
                ),
                sample::last_kernel_elapsed,
            ),
        ]);
        let mig_device = vgpu(
            "hami_mig_device_info",
            "MIG runtime identity for a container allocation",
        );
        let legacy = legacy.then(|| Legacy {
            host_memory: vgpu(
                "HostGPUMemoryUsage",
                "GPU device memory usage (legacy name)",
            ),
            host_core: vgpu("HostCoreUtilization", "GPU core utilization (legacy name)"),
            vgpu_used: vgpu(
                "vGPU_device_memory_usage_in_bytes",
                "vGPU device usage (legacy name)",
            ),
            vgpu_limit: vgpu(
                "vGPU_device_memory_limit_in_bytes",
                "vGPU device limit (legacy name)",
            ),
            container_memory: vgpu(
                "Device_memory_desc_of_container",
                "Container device memory description (legacy name)",
            ),
            container_utilization: vgpu(
                "Device_utilization_desc_of_container",
                "Container device utilization description (legacy name)",
            ),
            container_last_kernel: vgpu(
                "Device_last_kernel_of_container",
                "Container device last kernel description (legacy name)",
            ),
            mig_device: vgpu(
                "MigInfo",
                "Mig device information for container (legacy name)",
            ),
        });
        PluginMetrics {
            registry: ExposedRegistry::new(registry),
            vgpu: vgpu_series,
            mig_device,
            legacy,
            allocate_seconds,
            allocate_steps,
            allocations,
            identity,
            early_reads,
            registrations,
            gpu_healthy,
            xid_errors,
            plugin_conflicts,
            runtime_device_list,
            annotation_patches,
            unaccounted_processes,
            undetermined_processes,
            unaccounted_actions,
            host_memory_used,
            host_utilization,
            host_memory_controller,
        }
    }

    pub fn observe_allocate(&self, took: Duration, ok: bool) {
        self.allocate_seconds.observe(took.as_secs_f64());
        self.allocations.get_or_create(&result_labels(ok)).inc();
    }

    /// One step of an `Allocate` call (`pod_resources`, `identify`, `files`, `patch`): where
    /// the kubelet's wait goes.
    pub fn observe_allocate_step(&self, step: &'static str, took: Duration) {
        self.allocate_steps
            .get_or_create(&vec![("step".into(), step.into())])
            .observe(took.as_secs_f64());
    }

    /// `reason`: how the pod was determined; `read`: on what (`cache_confirmed`, `list`).
    pub fn identity_choice(&self, reason: &str, read: &str) {
        self.identity
            .get_or_create(&vec![
                ("reason".into(), reason.into()),
                ("read".into(), read.into()),
            ])
            .inc();
    }

    /// An early read was `used` by the call, or dropped unused.
    pub fn early_read(&self, used: bool) {
        let outcome = if used { "used" } else { "unused" };
        self.early_reads
            .get_or_create(&vec![("outcome".into(), outcome.into())])
            .inc();
    }

    /// The confirmed unaccounted processes of the last pass, counted per reason code; reasons
    /// with none read 0.
    pub fn set_unaccounted(&self, per_reason: &[(&'static str, usize)], undetermined: usize) {
        for (reason, count) in per_reason {
            self.unaccounted_processes
                .get_or_create(&vec![("reason".into(), (*reason).into())])
                .set(i64::try_from(*count).unwrap_or(i64::MAX));
        }
        self.undetermined_processes
            .set(i64::try_from(undetermined).unwrap_or(i64::MAX));
    }

    /// One action on a pod with unaccounted processes (`reported`, `evicted`, `eviction_failed`).
    pub fn unaccounted_action(&self, action: &'static str) {
        self.unaccounted_actions
            .get_or_create(&vec![("action".into(), action.into())])
            .inc();
    }

    pub fn registered(&self) {
        self.registrations.inc();
    }

    pub fn gpu_health(&self, uuid: &str, healthy: bool) {
        self.gpu_healthy
            .get_or_create(&vec![("device_uuid".into(), uuid.into())])
            .set(i64::from(healthy));
    }

    pub fn xid_error(&self, uuid: &str, xid: u64) {
        self.xid_errors
            .get_or_create(&vec![
                ("device_uuid".into(), uuid.into()),
                ("xid".into(), xid.to_string()),
            ])
            .inc();
    }

    /// Sets (`seen`) or removes the conflict's series.
    pub fn plugin_conflict(&self, conflict: &crate::conflict::PluginConflict, seen: bool) {
        let labels = vec![
            ("kind".into(), conflict.kind().into()),
            ("source".into(), conflict.source().into()),
        ];
        if seen {
            self.plugin_conflicts.get_or_create(&labels).set(1);
        } else {
            self.plugin_conflicts.remove(&labels);
        }
    }

    /// The node's runtime verdict (one series, the current one).
    pub fn runtime_verdict(&self, verdict: &crate::nvidia_runtime::Verdict) {
        self.registry.replace(|| {
            self.runtime_device_list.clear();
            self.runtime_device_list
                .get_or_create(&vec![("verdict".into(), verdict.label().into())])
                .set(1);
        });
    }

    pub fn annotation_patch(&self, ok: bool) {
        self.annotation_patches
            .get_or_create(&result_labels(ok))
            .inc();
    }

    /// HAMi's host metrics; labels `node, device_index, device_uuid, device_type` (the memory
    /// controller's without `node`, as HAMi's).
    pub fn host_gpu(&self, node: &str, device_type: &str, s: &crate::nvml::GpuSample) {
        let (index, uuid) = (s.index.to_string(), s.uuid.as_str());
        let labels = vec![
            ("node".into(), node.into()),
            ("device_index".into(), index.clone()),
            ("device_uuid".into(), uuid.into()),
            ("device_type".into(), device_type.into()),
        ];
        let used_bytes = s.memory_used_bytes as f64;
        let utilization = f64::from(s.utilization_gpu);
        self.host_memory_used.get_or_create(&labels).set(used_bytes);
        self.host_utilization
            .get_or_create(&labels)
            .set(utilization);
        self.host_memory_controller
            .get_or_create(&labels[1..].to_vec())
            .set(f64::from(s.utilization_memory));
        if let Some(l) = &self.legacy {
            let labels = vec![
                ("nodeid".into(), node.into()),
                ("deviceidx".into(), index),
                ("deviceuuid".into(), uuid.into()),
                ("devicetype".into(), device_type.into()),
            ];
            l.host_memory.get_or_create(&labels).set(used_bytes);
            l.host_core.get_or_create(&labels).set(utilization);
        }
    }

    /// Replaces the `hami_mig_device_info` series with one per realized MIG reservation of the
    /// node's pods (HAMi's `collectPodAndContainerMigInfo`).
    pub fn set_mig(&self, pods: &[crate::identity::PodSnapshot]) {
        self.registry.replace(|| self.replace_mig(pods));
    }

    fn replace_mig(&self, pods: &[crate::identity::PodSnapshot]) {
        self.mig_device.clear();
        if let Some(l) = &self.legacy {
            l.mig_device.clear();
        }
        for pod in pods {
            let Some(raw) = pod
                .annotations
                .get(hami_contract::annotations::MIG_ALLOCATIONS)
            else {
                continue;
            };
            let Ok(allocations) = hami_contract::mig::decode_allocations(raw) else {
                continue;
            };
            for a in allocations.iter().filter(|a| a.is_realized()) {
                // HAMi's container index space: init containers first.
                let Some(container) = usize::try_from(a.container_index).ok().and_then(|i| {
                    pod.init_containers
                        .iter()
                        .chain(&pod.containers)
                        .nth(i)
                        .map(|c| c.name.clone())
                }) else {
                    continue;
                };
                let gi = a.gpu_instance_id.unwrap_or_default().to_string();
                let ci = a.compute_instance_id.unwrap_or_default().to_string();
                let labels = vec![
                    ("namespace".to_owned(), pod.namespace.clone()),
                    ("pod".to_owned(), pod.name.clone()),
                    ("container".to_owned(), container.clone()),
                    ("vdevice_index".to_owned(), a.device_index.to_string()),
                    ("device_uuid".to_owned(), a.gpu_uuid.clone()),
                    ("mig_uuid".to_owned(), a.mig_uuid.clone()),
                    ("profile".to_owned(), a.profile.clone()),
                    ("gpu_instance_id".to_owned(), gi.clone()),
                    ("compute_instance_id".to_owned(), ci),
                ];
                self.mig_device.get_or_create(&labels).set(1.0);
                if let Some(l) = &self.legacy {
                    let labels = vec![
                        ("podnamespace".to_owned(), pod.namespace.clone()),
                        ("podname".to_owned(), pod.name.clone()),
                        ("ctrname".to_owned(), container),
                        ("vdeviceid".to_owned(), a.device_index.to_string()),
                        ("deviceuuid".to_owned(), a.gpu_uuid.clone()),
                        ("instanceid".to_owned(), gi),
                    ];
                    l.mig_device.get_or_create(&labels).set(1.0);
                }
            }
        }
    }

    /// Replaces all per-container series with `samples` (containers that went away disappear).
    /// Samples of pods not in `names` (deleted pods whose directories wait for their removal) are
    /// left out: a series must name its pod's namespace and name, which the dashboard and
    /// Prometheus' `honorLabels` rely on (a real Prometheus showed series of deleted pods named
    /// by UID, without a namespace). `now_unix_secs` dates
    /// `hami_container_last_kernel_elapsed_seconds`.
    pub fn set_vgpu(&self, samples: &[VgpuSample], names: &PodNames, now_unix_secs: u64) {
        self.registry
            .replace(|| self.replace_vgpu(samples, names, now_unix_secs));
    }

    fn replace_vgpu(&self, samples: &[VgpuSample], names: &PodNames, now_unix_secs: u64) {
        self.vgpu.clear();
        if let Some(l) = &self.legacy {
            for f in [
                &l.vgpu_used,
                &l.vgpu_limit,
                &l.container_memory,
                &l.container_utilization,
                &l.container_last_kernel,
            ] {
                f.clear();
            }
        }
        for s in samples {
            let Some((ns, pod)) = names.get(&s.pod_uid).cloned() else {
                continue;
            };
            let labels = vec![
                ("namespace".into(), ns),
                ("pod".into(), pod),
                ("container".into(), s.container.clone()),
                ("vdevice_index".into(), s.vdevice_index.to_string()),
                ("device_uuid".into(), s.device_uuid.clone()),
            ];
            self.vgpu.set(&labels, s, now_unix_secs);
            let elapsed = sample::last_kernel_elapsed(s, now_unix_secs);
            if let Some(l) = &self.legacy {
                // HAMi's legacy label names, same order.
                let legacy_names = [
                    "podnamespace",
                    "podname",
                    "ctrname",
                    "vdeviceid",
                    "deviceuuid",
                ];
                let legacy_labels: Labels = legacy_names
                    .iter()
                    .zip(labels.iter())
                    .map(|(k, (_, v))| ((*k).to_owned(), v.clone()))
                    .collect();
                l.vgpu_used
                    .get_or_create(&legacy_labels)
                    .set(s.memory_used_bytes as f64);
                l.vgpu_limit
                    .get_or_create(&legacy_labels)
                    .set(s.memory_limit_bytes as f64);
                // HAMi's old description: the breakdown in labels, the rest as `offset`.
                let mut described = legacy_labels.clone();
                let offset = s
                    .memory_used_bytes
                    .saturating_sub(s.context_bytes)
                    .saturating_sub(s.module_bytes)
                    .saturating_sub(s.buffer_bytes);
                for (k, v) in [
                    ("context", s.context_bytes),
                    ("module", s.module_bytes),
                    ("data", s.buffer_bytes),
                    ("offset", offset),
                ] {
                    described.push((k.to_owned(), v.to_string()));
                }
                l.container_memory
                    .get_or_create(&described)
                    .set(s.memory_used_bytes as f64);
                l.container_utilization
                    .get_or_create(&legacy_labels)
                    .set(s.sm_util as f64);
                if let Some(e) = elapsed {
                    l.container_last_kernel.get_or_create(&legacy_labels).set(e);
                }
            }
        }
    }

    /// Text exposition format.
    pub fn encode(&self) -> String {
        self.registry.encode()
    }
}

/// A registry some of whose families are replaced whole (cleared, then refilled) by a pass. A
/// scrape waits for a replacement under way, so it never answers those families empty or half
/// refilled: Prometheus would mark the missing series stale and graphs would show a gap.
#[derive(Clone)]
pub struct ExposedRegistry {
    registry: Arc<Registry>,
    replacing: Arc<std::sync::RwLock<()>>,
}

impl std::fmt::Debug for ExposedRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExposedRegistry").finish_non_exhaustive()
    }
}

impl ExposedRegistry {
    pub fn new(registry: Registry) -> Self {
        ExposedRegistry {
            registry: Arc::new(registry),
            replacing: Arc::default(),
        }
    }

    /// Runs `update`, which may clear families and refill them, with no scrape in between.
    pub fn replace<R>(&self, update: impl FnOnce() -> R) -> R {
        let _alone = self
            .replacing
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        update()
    }

    /// The text exposition format, between replacements.
    pub fn encode(&self) -> String {
        let _between = self
            .replacing
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        encode_text(&self.registry)
    }
}

/// Gauges of `f64` values, one series per label set.
pub type Values = Family<Labels, Gauge<f64, AtomicU64>>;

/// `metric`, registered as `name` (the registry keeps a handle to the same values).
pub fn registered<M: prometheus_client::registry::Metric + Clone>(
    registry: &mut Registry,
    name: &str,
    help: &str,
    metric: M,
) -> M {
    registry.register(name, help, metric.clone());
    metric
}

/// A family of `f64` gauges registered as `name`.
pub fn register_values(registry: &mut Registry, name: &str, help: &str) -> Values {
    registered(registry, name, help, Values::default())
}

/// `result="success"` or `result="failure"`.
pub fn result_labels(ok: bool) -> Labels {
    vec![(
        "result".into(),
        if ok { "success" } else { "failure" }.into(),
    )]
}

/// A registry in the text exposition format (empty if it cannot be written, which a `String`
/// never refuses).
pub fn encode_text(registry: &Registry) -> String {
    let mut out = String::new();
    if prometheus_client::encoding::text::encode(&mut out, registry).is_err() {
        out.clear();
    }
    out
}

/// One value of a usage sample at a time (Unix seconds); `None` leaves the series out.
pub type SampleValue = fn(&VgpuSample, u64) -> Option<f64>;

/// The families that show usage samples, each with the value it shows: replaced whole on every
/// pass, so the series of containers (or claims) that went away disappear.
#[derive(Clone)]
pub struct SampleSeries(pub Vec<(Values, SampleValue)>);

impl std::fmt::Debug for SampleSeries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SampleSeries")
            .field("families", &self.0.len())
            .finish()
    }
}

impl SampleSeries {
    pub fn clear(&self) {
        for (family, _) in &self.0 {
            family.clear();
        }
    }

    /// Sets every family's series for `labels` from `sample`.
    pub fn set(&self, labels: &Labels, sample: &VgpuSample, now_unix_secs: u64) {
        for (family, value) in &self.0 {
            if let Some(v) = value(sample, now_unix_secs) {
                family.get_or_create(labels).set(v);
            }
        }
    }
}

/// The values of a usage sample the families show.
pub mod sample {
    use super::VgpuSample;

    pub fn memory_used(s: &VgpuSample, _: u64) -> Option<f64> {
        Some(s.memory_used_bytes as f64)
    }

    pub fn memory_limit(s: &VgpuSample, _: u64) -> Option<f64> {
        Some(s.memory_limit_bytes as f64)
    }

    pub fn sm_util(s: &VgpuSample, _: u64) -> Option<f64> {
        Some(s.sm_util as f64)
    }

    pub fn sm_limit(s: &VgpuSample, _: u64) -> Option<f64> {
        Some(s.sm_limit as f64)
    }

    /// HAMi: only once a kernel ran; never negative (a clock behind the shim's).
    pub fn last_kernel_elapsed(s: &VgpuSample, now_unix_secs: u64) -> Option<f64> {
        (s.last_kernel_time > 0).then(|| now_unix_secs.saturating_sub(s.last_kernel_time) as f64)
    }
}

/// One (container, virtual device) usage sample.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VgpuSample {
    pub pod_uid: String,
    pub container: String,
    pub vdevice_index: usize,
    pub device_uuid: String,
    pub memory_used_bytes: u64,
    pub memory_limit_bytes: u64,
    pub context_bytes: u64,
    pub module_bytes: u64,
    pub buffer_bytes: u64,
    /// Host memory given in place of device memory (oversubscription); not in
    /// `memory_used_bytes`, which is device memory.
    pub host_memory_bytes: u64,
    pub sm_limit: u64,
    /// SM utilization of the container's live processes on the device, summed (HAMi's
    /// `DeviceSmUtil`), as the shim measures it.
    pub sm_util: u64,
    /// Unix seconds of the container's last kernel launch; 0 = none yet.
    pub last_kernel_time: u64,
}

/// Pod UID → (namespace, name), from the pod cache.
pub type PodNames = std::collections::BTreeMap<String, (String, String)>;

/// Whether the plugin serves the kubelet now: `/readyz`, the DaemonSet's readiness probe. A
/// pod the kubelet admits while the plugin is not registered (after a kubelet restart, or while
/// a new plugin pod starts) is rejected with `UnexpectedAdmissionError`, so a rollout must wait
/// for this, not for the process to run.
#[derive(Debug, Clone, Default)]
pub struct Readiness(Arc<std::sync::atomic::AtomicBool>);

impl Readiness {
    /// Ready from the start: a plugin with nothing to serve (no usable driver) is not waited for.
    pub fn always() -> Readiness {
        let r = Readiness::default();
        r.set(true);
        r
    }

    pub fn set(&self, ready: bool) {
        self.0.store(ready, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn is_ready(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu_sample(
        index: u32,
        memory_used_bytes: u64,
        utilization_gpu: u32,
    ) -> crate::nvml::GpuSample {
        crate::nvml::GpuSample {
            index,
            uuid: "GPU-a".into(),
            memory_used_bytes,
            utilization_gpu,
            utilization_memory: 7,
        }
    }

    #[test]
    fn exports_hami_and_plugin_names() {
        let m = PluginMetrics::new();
        m.observe_allocate(Duration::from_millis(3), true);
        m.identity_choice("unique", "cache_confirmed");
        m.observe_allocate_step("patch", Duration::from_millis(2));
        m.gpu_health("GPU-a", false);
        m.xid_error("GPU-a", 79);
        m.host_gpu("node-a", "NVIDIA-Tesla T4", &gpu_sample(1, 1048576, 42));
        let sample = VgpuSample {
            memory_used_bytes: 1024,
            memory_limit_bytes: 2048,
            ..container_sample("u1")
        };
        let names = [("u1".to_owned(), ("ns".to_owned(), "web".to_owned()))].into();
        m.set_vgpu(std::slice::from_ref(&sample), &names, 100);
        let text = m.encode();
        assert!(text.contains(
            "hami_vgpu_memory_limit_bytes{namespace=\"ns\",pod=\"web\",container=\"main\",vdevice_index=\"0\",device_uuid=\"GPU-a\"} 2048.0"
        ), "{text}");
        m.set_vgpu(&[], &names, 100);
        assert!(!m.encode().contains("pod=\"web\""), "stale series removed");
        // A deleted pod whose directory is not removed yet has no series.
        let gone = VgpuSample {
            pod_uid: "u-gone".into(),
            ..sample.clone()
        };
        m.set_vgpu(&[gone], &names, 100);
        assert!(
            !m.encode().contains("u-gone"),
            "a series of a pod the node no longer has"
        );
        assert!(
            !text.contains("HostGPUMemoryUsage"),
            "legacy names only on request"
        );
        let legacy = PluginMetrics::with_legacy_names(true);
        legacy.host_gpu("node-a", "NVIDIA-Tesla T4", &gpu_sample(0, 1, 2));
        assert!(legacy.encode().contains(
            "HostCoreUtilization{nodeid=\"node-a\",deviceidx=\"0\",deviceuuid=\"GPU-a\",devicetype=\"NVIDIA-Tesla T4\"} 2.0"
        ));
        assert!(text.contains("tessera_device_plugin_allocations_total{result=\"success\"} 1"));
        assert!(text.contains("tessera_device_plugin_gpu_healthy{device_uuid=\"GPU-a\"} 0"));
        assert!(text.contains(
            "tessera_device_plugin_xid_errors_total{device_uuid=\"GPU-a\",xid=\"79\"} 1"
        ));
        assert!(text.contains(
            "hami_host_gpu_utilization_ratio{node=\"node-a\",device_index=\"1\",device_uuid=\"GPU-a\",device_type=\"NVIDIA-Tesla T4\"} 42.0"
        ));
        assert!(text.contains(
            "hami_host_gpu_memory_controller_utilization_ratio{device_index=\"1\",device_uuid=\"GPU-a\",device_type=\"NVIDIA-Tesla T4\"} 7.0"
        ), "{text}");
        assert!(text.contains("hami_build_info{version=\""), "{text}");
        assert!(
            text.contains(
                "tessera_device_plugin_allocate_step_duration_seconds_count{step=\"patch\"} 1"
            ),
            "{text}"
        );
    }

    /// One container's usage on GPU-a: 10 of 20 bytes, SM limit 30 %, 25 % used.
    fn container_sample(pod_uid: &str) -> VgpuSample {
        VgpuSample {
            pod_uid: pod_uid.into(),
            container: "main".into(),
            vdevice_index: 0,
            device_uuid: "GPU-a".into(),
            memory_used_bytes: 10,
            memory_limit_bytes: 20,
            context_bytes: 1,
            module_bytes: 2,
            buffer_bytes: 3,
            host_memory_bytes: 0,
            sm_limit: 30,
            sm_util: 25,
            last_kernel_time: 90,
        }
    }

    /// A scrape during the monitor's pass sees the previous pass's series or the new ones, never
    /// the families emptied or half refilled.
    #[test]
    fn a_scrape_never_sees_the_container_series_half_replaced() {
        let m = PluginMetrics::with_legacy_names(true);
        let samples: Vec<VgpuSample> = (0..50)
            .map(|i| container_sample(&format!("u{i}")))
            .collect();
        let names: PodNames = (0..50)
            .map(|i| (format!("u{i}"), ("ns".to_owned(), format!("p{i}"))))
            .collect();
        m.set_vgpu(&samples, &names, 100);
        let series = |text: &str| {
            text.lines()
                .filter(|l| l.starts_with("hami_vgpu_memory_limit_bytes{"))
                .count()
        };
        let writer = {
            let m = m.clone();
            std::thread::spawn(move || {
                for _ in 0..300 {
                    m.set_vgpu(&samples, &names, 100);
                }
            })
        };
        let mut scrapes = 0;
        while !writer.is_finished() || scrapes == 0 {
            assert_eq!(series(&m.encode()), 50);
            scrapes += 1;
        }
        writer.join().unwrap();
    }

    /// Every metric of HAMi's vGPU monitor (the inventory extracted from its source) is exported
    /// with HAMi's label names in HAMi's order, or is a listed deviation.
    #[test]
    fn every_hami_monitor_metric_is_exported_or_a_listed_deviation() {
        use hami_contract::metrics::{MetricComponent, check_exposition};
        let deviations = include_str!("../../docs/contract-deviations.md");
        let fill = |m: &PluginMetrics| {
            m.host_gpu("node-a", "NVIDIA-Tesla T4", &gpu_sample(0, 1, 2));
            let sample = container_sample("u1");
            let names = [("u1".to_owned(), ("ns".to_owned(), "web".to_owned()))].into();
            m.set_vgpu(&[sample], &names, 100);
            let mut pod = crate::testing::bound_pod("node-a", "sliced", &[&[("GPU-a", 0, 0)]], 1);
            pod.annotations.insert(
                hami_contract::annotations::MIG_ALLOCATIONS.into(),
                r#"[{"containerIndex":0,"deviceIndex":0,"gpuUUID":"GPU-a","profile":"1g.10gb","placement":{"start":6,"size":1},"migUUID":"MIG-x","gpuInstanceID":13,"computeInstanceID":0},{"containerIndex":0,"deviceIndex":1,"gpuUUID":"GPU-a","profile":"1g.10gb","placement":{"start":5,"size":1}}]"#.into(),
            );
            m.set_mig(&[pod]);
            m.encode()
        };
        let text = fill(&PluginMetrics::with_legacy_names(true));
        let checked = check_exposition(
            MetricComponent::Monitor,
            &text,
            &fill(&PluginMetrics::new()),
            deviations,
        )
        .unwrap_or_else(|p| panic!("{}\n{text}", p.join("\n")));
        assert!(checked >= 15, "{checked} rows checked");
        assert!(text.contains(
            "hami_container_last_kernel_elapsed_seconds{namespace=\"ns\",pod=\"web\",container=\"main\",vdevice_index=\"0\",device_uuid=\"GPU-a\"} 10.0"
        ), "{text}");
        assert!(text.contains(
            "hami_mig_device_info{namespace=\"default\",pod=\"sliced\",container=\"c0\",vdevice_index=\"0\",device_uuid=\"GPU-a\",mig_uuid=\"MIG-x\",profile=\"1g.10gb\",gpu_instance_id=\"13\",compute_instance_id=\"0\"} 1.0"
        ), "{text}");
        assert_eq!(
            text.matches("hami_mig_device_info{").count(),
            1,
            "only realized reservations"
        );
        assert!(text.contains(
            "Device_memory_desc_of_container{podnamespace=\"ns\",podname=\"web\",ctrname=\"main\",vdeviceid=\"0\",deviceuuid=\"GPU-a\",context=\"1\",module=\"2\",data=\"3\",offset=\"4\"} 10.0"
        ), "{text}");
    }
}

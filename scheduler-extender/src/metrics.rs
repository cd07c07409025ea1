//! Prometheus metrics: request latencies and decisions (every replica), GPU and quota state in
//! HAMi's names (contract §8.1; the leader only, HAMi #1512).
//!
//! The registries are built once; a scrape clears the state families, sets them from the decision
//! loop's snapshot and encodes.

use std::sync::{Arc, Mutex};

use prometheus_client::encoding::text::{encode_eof, encode_registry};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::engine::{ContainerDeviceMetrics, GpuMetrics, MetricsSnapshot, QuotaMetrics};

type Labels = Vec<(String, String)>;

/// Metrics that live across scrapes.
#[derive(Debug, Clone)]
pub struct Metrics {
    pub filter_seconds: Histogram,
    pub bind_seconds: Histogram,
    pub preempt_seconds: Histogram,
    /// GPU pods kube-scheduler marked for preemption (leader only: its loop sees them).
    pub preemption_victims: Counter,
    /// `verb` (filter|bind|preempt), `result` (a reason code or `success`).
    pub decisions: Family<Labels, Counter>,
    pub webhook_seconds: Histogram,
    /// `result`: allowed, mutated, denied or error (no AdmissionReview answer).
    pub webhook_reviews: Family<Labels, Counter>,
    /// Also export HAMi's pre-v2.9 names and labels (`--legacy-metrics`, chart `legacyMetrics`).
    pub legacy: bool,
    /// The registries and the state they export, shared by every clone; one scrape at a time.
    exposition: Arc<Mutex<Exposition>>,
}

impl Default for Metrics {
    fn default() -> Self {
        let buckets = || Histogram::new(exponential_buckets(0.0001, 2.0, 16));
        let (filter_seconds, bind_seconds, webhook_seconds) = (buckets(), buckets(), buckets());
        let (decisions, webhook_reviews) = (Family::default(), Family::default());
        let mut exposition = Exposition::new(&filter_seconds, &bind_seconds, &decisions);
        let preempt_seconds = buckets();
        exposition.always.register(
            "tessera_preempt_duration_seconds",
            "Latency of /preempt (kube-scheduler asking which GPU pods to evict)",
            preempt_seconds.clone(),
        );
        let preemption_victims = Counter::default();
        exposition.always.register(
            "tessera_preemption_victims",
            "GPU pods kube-scheduler marked for eviction to make room for a higher-priority pod",
            preemption_victims.clone(),
        );
        exposition.always.register(
            "tessera_webhook_duration_seconds",
            "Latency of the admission webhook's answer",
            webhook_seconds.clone(),
        );
        exposition.always.register(
            "tessera_webhook_reviews",
            "Admission reviews answered, by result (allowed, mutated, denied, error)",
            webhook_reviews.clone(),
        );
        Metrics {
            filter_seconds,
            bind_seconds,
            preempt_seconds,
            preemption_victims,
            decisions,
            webhook_seconds,
            webhook_reviews,
            legacy: false,
            exposition: Arc::new(Mutex::new(exposition)),
        }
    }
}

type FloatFamily = Family<Labels, Gauge<f64, std::sync::atomic::AtomicU64>>;

/// Bytes in a MiB (HAMi exports memory in bytes).
const MIB: f64 = 1_048_576.0;

/// What `/metrics` encodes: three registries, encoded in this order, the latter two only when
/// they apply.
struct Exposition {
    /// Every replica: build info, latencies, decisions, leadership.
    always: Registry,
    /// The leader only: reservations and the state in HAMi's names.
    leader_only: Registry,
    /// The leader with `--legacy-metrics`: HAMi's pre-v2.9 names.
    legacy: Registry,
    leader: Gauge<i64>,
    reservations: Gauge<i64>,
    pending: Family<Labels, Gauge<i64>>,
    state: StateFamilies,
    old: LegacyFamilies,
}

impl std::fmt::Debug for Exposition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exposition").finish_non_exhaustive()
    }
}

impl Exposition {
    fn new(
        filter_seconds: &Histogram,
        bind_seconds: &Histogram,
        decisions: &Family<Labels, Counter>,
    ) -> Self {
        let mut always = Registry::default();
        tessera_runtime::register_build_info(&mut always, env!("CARGO_PKG_VERSION"));
        always.register(
            "tessera_filter_duration_seconds",
            "Latency of /filter",
            filter_seconds.clone(),
        );
        always.register(
            "tessera_bind_duration_seconds",
            "Latency of /bind",
            bind_seconds.clone(),
        );
        always.register(
            "tessera_scheduler_decisions",
            "Filter, bind and preempt outcomes by reason",
            decisions.clone(),
        );
        let leader = Gauge::<i64>::default();
        always.register(
            "tessera_scheduler_leader",
            "1 on the elected leader",
            leader.clone(),
        );
        let mut leader_only = Registry::default();
        let reservations = Gauge::<i64>::default();
        leader_only.register(
            "tessera_scheduler_reservations",
            "Decisions not yet visible in the informer",
            reservations.clone(),
        );
        let pending = Family::<Labels, Gauge<i64>>::default();
        leader_only.register(
            "tessera_pending_gpu_pods",
            "GPU pods that fit no node at their last filter, by the reason that refused the most nodes",
            pending.clone(),
        );
        let state = StateFamilies::default();
        state.register(leader_only.sub_registry_with_label(vgpu_zone()));
        let mut legacy = Registry::default();
        let old = LegacyFamilies::default();
        old.register(legacy.sub_registry_with_label(vgpu_zone()));
        Exposition {
            always,
            leader_only,
            legacy,
            leader,
            reservations,
            pending,
            state,
            old,
        }
    }

    /// Sets every value from `snap` (the state families emptied first: series of objects gone
    /// since the last scrape must not linger).
    fn update(&self, snap: &MetricsSnapshot, legacy: bool) {
        self.leader.set(i64::from(snap.leader));
        self.state.clear();
        self.old.clear();
        if !snap.leader {
            return;
        }
        self.reservations
            .set(i64::try_from(snap.reservations).unwrap_or(i64::MAX));
        self.pending.clear();
        for (reason, n) in &snap.pending {
            self.pending
                .get_or_create(&vec![("reason".to_owned(), (*reason).to_owned())])
                .set(i64::try_from(*n).unwrap_or(i64::MAX));
        }
        let old = legacy.then_some(&self.old);
        for g in &snap.gpus {
            self.state.set_gpu(g);
            if let Some(old) = old {
                old.set_gpu(g);
            }
        }
        for g in snap.gpus.iter().filter(|g| g.mode == "mig") {
            self.state.set_mig_instances(g, old);
        }
        for c in &snap.containers {
            self.state.set_container(c);
            if let Some(old) = old {
                old.set_container(c);
            }
        }
        for q in &snap.quotas {
            self.state.set_quota(q, old);
        }
    }

    /// The text exposition format of what applies.
    fn encode(&self, leader: bool, legacy: bool) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        encode_registry(&mut out, &self.always)?;
        if leader {
            encode_registry(&mut out, &self.leader_only)?;
            if legacy {
                encode_registry(&mut out, &self.legacy)?;
            }
        }
        encode_eof(&mut out)?;
        Ok(out)
    }
}

/// The constant label of the state metrics.
fn vgpu_zone() -> (
    std::borrow::Cow<'static, str>,
    std::borrow::Cow<'static, str>,
) {
    ("zone".into(), "vGPU".into())
}

/// `(name, value)` label pairs.
fn labels<const N: usize>(pairs: [(&str, String); N]) -> Labels {
    pairs.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()
}

/// Families registered once and replaced whole on every scrape, by name and help.
trait NamedFamilies {
    fn families(&self) -> Vec<(&'static str, &'static str, &FloatFamily)>;

    fn register(&self, reg: &mut Registry) {
        for (name, help, family) in self.families() {
            reg.register(name, help, family.clone());
        }
    }

    fn clear(&self) {
        for (_, _, family) in self.families() {
            family.clear();
        }
    }
}

impl NamedFamilies for StateFamilies {
    fn families(&self) -> Vec<(&'static str, &'static str, &FloatFamily)> {
        self.named().to_vec()
    }
}

impl NamedFamilies for LegacyFamilies {
    fn families(&self) -> Vec<(&'static str, &'static str, &FloatFamily)> {
        self.named().to_vec()
    }
}

/// The leader's state in HAMi's names (`zone="vGPU"`).
#[derive(Default)]
struct StateFamilies {
    mem_limit: FloatFamily,
    core_limit: FloatFamily,
    mem_alloc: FloatFamily,
    shared: FloatFamily,
    core_alloc: FloatFamily,
    overview: FloatFamily,
    mem_ratio: FloatFamily,
    mig_instance: FloatFamily,
    v_mem: FloatFamily,
    v_cores: FloatFamily,
    q_used: FloatFamily,
    q_limit: FloatFamily,
}

impl StateFamilies {
    /// Every family with its name and help, in exposition order.
    fn named(&self) -> [(&'static str, &'static str, &FloatFamily); 12] {
        [
            (
                "hami_gpu_memory_limit_bytes",
                "GPU memory limit",
                &self.mem_limit,
            ),
            (
                "hami_gpu_core_limit_ratio",
                "GPU core limit",
                &self.core_limit,
            ),
            (
                "hami_gpu_memory_allocated_bytes",
                "GPU memory allocated",
                &self.mem_alloc,
            ),
            (
                "hami_gpu_shared_count",
                "Containers sharing the GPU",
                &self.shared,
            ),
            (
                "hami_gpu_core_allocated_ratio",
                "GPU cores allocated",
                &self.core_alloc,
            ),
            ("hami_node_gpu_overview", "GPU overview", &self.overview),
            (
                "hami_node_gpu_memory_allocated_ratio",
                "GPU memory allocated ratio",
                &self.mem_ratio,
            ),
            // HAMi v2.10 `cmd/scheduler/metrics.go`: one series per realized MIG instance (the
            // device plugin wrote its identity into the pod's reservation) on a `mig` GPU.
            (
                "hami_node_gpu_mig_instance_info",
                "Realized MIG instance identity and scheduler placement",
                &self.mig_instance,
            ),
            (
                "hami_vgpu_memory_allocated_bytes",
                "GPU memory allocated to a scheduled container",
                &self.v_mem,
            ),
            (
                "hami_vgpu_core_allocated_ratio",
                "GPU cores allocated to a scheduled container",
                &self.v_cores,
            ),
            (
                "hami_resource_quota_used",
                "Namespace GPU quota used",
                &self.q_used,
            ),
            (
                "hami_resource_quota_limit",
                "Namespace GPU quota limit",
                &self.q_limit,
            ),
        ]
    }

    fn set_gpu(&self, g: &GpuMetrics) {
        let base = vec![
            ("node".to_owned(), g.node.clone()),
            ("device_uuid".to_owned(), g.uuid.clone()),
            ("device_index".to_owned(), g.index.to_string()),
            ("device_type".to_owned(), g.device_type.clone()),
        ];
        self.mem_limit
            .get_or_create(&base)
            .set(f64::from(g.totalmem) * MIB);
        self.core_limit
            .get_or_create(&base)
            .set(f64::from(g.totalcore));
        self.shared.get_or_create(&base).set(f64::from(g.used));
        self.core_alloc
            .get_or_create(&base)
            .set(f64::from(g.usedcores));
        let mut with_cores = base.clone();
        with_cores.insert(3, ("device_cores".to_owned(), g.totalcore.to_string()));
        self.mem_alloc
            .get_or_create(&with_cores)
            .set(f64::from(g.usedmem) * MIB);
        let mut ov = with_cores;
        ov.insert(
            4,
            ("device_memory_limit".to_owned(), g.totalmem.to_string()),
        );
        self.overview
            .get_or_create(&ov)
            .set(f64::from(g.usedmem) * MIB);
        self.mem_ratio.get_or_create(&base).set(memory_ratio(g));
    }

    /// The realized MIG instances of a `mig` GPU (and their legacy series with `old`).
    fn set_mig_instances(&self, g: &GpuMetrics, old: Option<&LegacyFamilies>) {
        for a in g.mig.iter().filter(|a| a.is_realized()) {
            let (gi, ci) = (
                a.gpu_instance_id.unwrap_or_default().to_string(),
                a.compute_instance_id.unwrap_or_default().to_string(),
            );
            self.mig_instance
                .get_or_create(&labels([
                    ("node", g.node.clone()),
                    ("device_uuid", g.uuid.clone()),
                    ("device_index", g.index.to_string()),
                    ("mig_uuid", a.mig_uuid.clone()),
                    ("profile", a.profile.clone()),
                    ("gpu_instance_id", gi.clone()),
                    ("compute_instance_id", ci),
                    ("placement_start", a.placement.start.to_string()),
                    ("placement_size", a.placement.size.to_string()),
                ]))
                .set(1.0);
            if let Some(old) = old {
                old.mig_instance
                    .get_or_create(&labels([
                        ("nodeid", g.node.clone()),
                        ("deviceuuid", g.uuid.clone()),
                        ("deviceidx", g.index.to_string()),
                        ("migname", format!("{}-{gi}", a.profile)),
                    ]))
                    .set(1.0);
            }
        }
    }

    fn set_container(&self, c: &ContainerDeviceMetrics) {
        let labels = vec![
            ("namespace".to_owned(), c.namespace.clone()),
            ("node".to_owned(), c.node.clone()),
            ("pod".to_owned(), c.pod.clone()),
            ("container_index".to_owned(), c.container_index.to_string()),
            ("device_uuid".to_owned(), c.uuid.clone()),
        ];
        self.v_mem
            .get_or_create(&labels)
            .set(f64::from(c.mem) * MIB);
        self.v_cores.get_or_create(&labels).set(f64::from(c.cores));
    }

    /// A quota's limits and usage (and their legacy series with `old`).
    fn set_quota(&self, q: &QuotaMetrics, old: Option<&LegacyFamilies>) {
        for (key, limit, used) in &q.items {
            let base = vec![
                ("namespace".to_owned(), q.namespace.clone()),
                ("quota_name".to_owned(), key.clone()),
            ];
            self.q_limit.get_or_create(&base).set(*limit as f64);
            let mut u = base;
            u.push(("limit".to_owned(), limit.to_string()));
            self.q_used.get_or_create(&u).set(*used as f64);
            if let Some(old) = old {
                old.quota_used
                    .get_or_create(&labels([
                        ("quotanamespace", q.namespace.clone()),
                        ("quotaName", key.clone()),
                        ("limit", limit.to_string()),
                    ]))
                    .set(*used as f64);
            }
        }
    }
}

/// The share of a GPU's memory allocated (0 for a GPU without memory).
fn memory_ratio(g: &GpuMetrics) -> f64 {
    if g.totalmem == 0 {
        0.0
    } else {
        f64::from(g.usedmem) / f64::from(g.totalmem)
    }
}

/// HAMi's pre-v2.9 scheduler metrics: the same values under the old names and label names
/// (HAMi v2.10 `cmd/scheduler/metrics.go`, `--legacy-metrics`).
#[derive(Default)]
struct LegacyFamilies {
    memory_limit: FloatFamily,
    core_limit: FloatFamily,
    memory_allocated: FloatFamily,
    shared_num: FloatFamily,
    core_allocated: FloatFamily,
    overview: FloatFamily,
    memory_percentage: FloatFamily,
    quota_used: FloatFamily,
    vgpu_memory_allocated: FloatFamily,
    vgpu_core_allocated: FloatFamily,
    mig_instance: FloatFamily,
}

impl LegacyFamilies {
    /// Every family with its name and help, in exposition order.
    fn named(&self) -> [(&'static str, &'static str, &FloatFamily); 11] {
        [
            (
                "GPUDeviceMemoryLimit",
                "Device memory limit for a certain GPU",
                &self.memory_limit,
            ),
            (
                "GPUDeviceCoreLimit",
                "Device core limit for a certain GPU",
                &self.core_limit,
            ),
            (
                "GPUDeviceMemoryAllocated",
                "Device memory allocated for a certain GPU",
                &self.memory_allocated,
            ),
            (
                "GPUDeviceSharedNum",
                "Number of containers sharing this GPU",
                &self.shared_num,
            ),
            (
                "GPUDeviceCoreAllocated",
                "Device core allocated for a certain GPU",
                &self.core_allocated,
            ),
            (
                "nodeGPUOverview",
                "GPU overview on a certain node",
                &self.overview,
            ),
            (
                "nodeGPUMemoryPercentage",
                "GPU memory allocated percentage on a certain GPU",
                &self.memory_percentage,
            ),
            (
                "QuotaUsed",
                "resourcequota usage for a certain device",
                &self.quota_used,
            ),
            (
                "vGPUMemoryAllocated",
                "vGPU memory allocated from a container",
                &self.vgpu_memory_allocated,
            ),
            (
                "vGPUCoreAllocated",
                "vGPU core allocated from a container",
                &self.vgpu_core_allocated,
            ),
            (
                "nodeGPUMigInstance",
                "GPU Sharing mode. 0 for hami-core, 1 for mig, 2 for mps",
                &self.mig_instance,
            ),
        ]
    }

    fn set_gpu(&self, g: &GpuMetrics) {
        let (node, uuid, idx, ty) = (
            g.node.clone(),
            g.uuid.clone(),
            g.index.to_string(),
            g.device_type.clone(),
        );
        let old = labels([
            ("nodeid", node.clone()),
            ("deviceuuid", uuid.clone()),
            ("deviceidx", idx.clone()),
            ("devicetype", ty.clone()),
        ]);
        self.memory_limit
            .get_or_create(&old)
            .set(f64::from(g.totalmem) * MIB);
        self.core_limit
            .get_or_create(&old)
            .set(f64::from(g.totalcore));
        self.shared_num.get_or_create(&old).set(f64::from(g.used));
        self.core_allocated
            .get_or_create(&old)
            .set(f64::from(g.usedcores));
        let with_cores = labels([
            ("nodeid", node.clone()),
            ("deviceuuid", uuid.clone()),
            ("deviceidx", idx.clone()),
            ("devicecores", g.totalcore.to_string()),
            ("devicetype", ty.clone()),
        ]);
        self.memory_allocated
            .get_or_create(&with_cores)
            .set(f64::from(g.usedmem) * MIB);
        let ov = labels([
            ("nodeid", node.clone()),
            ("deviceuuid", uuid.clone()),
            ("deviceidx", idx.clone()),
            ("devicecores", g.totalcore.to_string()),
            ("devicememorylimit", g.totalmem.to_string()),
            ("devicetype", ty),
        ]);
        self.overview
            .get_or_create(&ov)
            .set(f64::from(g.usedmem) * MIB);
        // HAMi sends the percentage only for cards with memory, without the type.
        if g.totalmem > 0 {
            self.memory_percentage
                .get_or_create(&labels([
                    ("nodeid", node),
                    ("deviceuuid", uuid),
                    ("deviceidx", idx),
                ]))
                .set(memory_ratio(g));
        }
    }

    fn set_container(&self, c: &ContainerDeviceMetrics) {
        let old = labels([
            ("podnamespace", c.namespace.clone()),
            ("nodename", c.node.clone()),
            ("podname", c.pod.clone()),
            ("containeridx", c.container_index.to_string()),
            ("deviceuuid", c.uuid.clone()),
        ]);
        self.vgpu_memory_allocated
            .get_or_create(&old)
            .set(f64::from(c.mem) * MIB);
        self.vgpu_core_allocated
            .get_or_create(&old)
            .set(f64::from(c.cores));
    }
}

impl Metrics {
    /// The metrics, with HAMi's pre-v2.9 names too when `legacy`.
    pub fn new(legacy: bool) -> Self {
        Metrics {
            legacy,
            ..Metrics::default()
        }
    }

    /// One admission review answered in `seconds`.
    pub fn webhook_review(&self, result: &str, seconds: f64) {
        self.webhook_seconds.observe(seconds);
        self.webhook_reviews
            .get_or_create(&vec![("result".to_owned(), result.to_owned())])
            .inc();
    }

    pub fn decision(&self, verb: &str, result: &str) {
        self.decisions
            .get_or_create(&vec![
                ("verb".to_owned(), verb.to_owned()),
                ("result".to_owned(), result.to_owned()),
            ])
            .inc();
    }

    /// Renders the text exposition format; state gauges come from `snap`.
    pub fn render(&self, snap: &MetricsSnapshot) -> String {
        let exposition = self
            .exposition
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        exposition.update(snap, self.legacy);
        exposition
            .encode(snap.leader, self.legacy)
            .unwrap_or_else(|_| "# metrics encoding failed\n".to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hami_contract::metrics::{MetricComponent, check_exposition};

    fn snapshot() -> MetricsSnapshot {
        MetricsSnapshot {
            leader: true,
            gpus: vec![
                GpuMetrics {
                    node: "n1".into(),
                    uuid: "GPU-a".into(),
                    index: 0,
                    device_type: "NVIDIA-A100".into(),
                    count: 10,
                    totalmem: 40960,
                    totalcore: 100,
                    used: 1,
                    usedmem: 1024,
                    usedcores: 30,
                    mode: "hami-core".into(),
                    mig: Vec::new(),
                },
                GpuMetrics {
                    node: "n1".into(),
                    uuid: "GPU-m".into(),
                    index: 1,
                    device_type: "NVIDIA-A100".into(),
                    count: 7,
                    totalmem: 40960,
                    totalcore: 100,
                    used: 1,
                    usedmem: 9856,
                    usedcores: 15,
                    mode: "mig".into(),
                    mig: vec![
                        hami_contract::mig::MigAllocation {
                            gpu_uuid: "GPU-m".into(),
                            profile: "2g.10gb".into(),
                            placement: hami_contract::mig::MigPlacement { start: 0, size: 2 },
                            mig_uuid: "MIG-runtime".into(),
                            gpu_instance_id: Some(4),
                            compute_instance_id: Some(0),
                            ..Default::default()
                        },
                        hami_contract::mig::MigAllocation {
                            // Not realized yet: no series.
                            gpu_uuid: "GPU-m".into(),
                            profile: "1g.5gb".into(),
                            placement: hami_contract::mig::MigPlacement { start: 6, size: 1 },
                            ..Default::default()
                        },
                    ],
                },
            ],
            containers: vec![ContainerDeviceMetrics {
                namespace: "ns".into(),
                node: "n1".into(),
                pod: "web".into(),
                container_index: 0,
                uuid: "GPU-a".into(),
                mem: 1024,
                cores: 30,
            }],
            quotas: vec![QuotaMetrics {
                namespace: "ns".into(),
                name: "q".into(),
                items: vec![("nvidia.com/gpumem".into(), 4096, 1024)],
            }],
            reservations: 0,
            pending: [("CardInsufficientMemory", 2), ("NoCandidateNodes", 1)].into(),
        }
    }

    /// Every metric of HAMi's scheduler (the inventory extracted from its source) is exported
    /// with HAMi's label names in HAMi's order, or is a listed deviation.
    #[test]
    fn every_hami_scheduler_metric_is_exported_or_a_listed_deviation() {
        let deviations = include_str!("../../docs/contract-deviations.md");
        let metrics = Metrics {
            legacy: true,
            ..Metrics::default()
        };
        let text = metrics.render(&snapshot());
        let checked = check_exposition(
            MetricComponent::Scheduler,
            &text,
            &Metrics::default().render(&snapshot()),
            deviations,
        )
        .unwrap_or_else(|p| panic!("{}\n{text}", p.join("\n")));
        assert!(checked >= 15, "{checked} rows checked");
    }

    /// The registries live across scrapes: a series of an object gone since the previous
    /// scrape is gone, and a replica that stops leading exports no state.
    #[test]
    fn each_scrape_exports_the_current_snapshot_only() {
        let metrics = Metrics::new(true);
        let full = metrics.render(&snapshot());
        assert!(full.contains(r#"device_uuid="GPU-a""#), "{full}");
        assert!(full.contains("GPUDeviceMemoryLimit"), "{full}");
        assert!(
            full.contains(r#"tessera_pending_gpu_pods{reason="CardInsufficientMemory"} 2"#),
            "{full}"
        );
        let mut fewer = snapshot();
        fewer.gpus.retain(|g| g.uuid == "GPU-m");
        fewer.containers.clear();
        fewer.pending.remove("NoCandidateNodes");
        let text = metrics.render(&fewer);
        assert!(!text.contains(r#"device_uuid="GPU-a""#), "{text}");
        assert!(text.contains(r#"device_uuid="GPU-m""#), "{text}");
        assert!(
            !text.contains("NoCandidateNodes"),
            "a reason no pod waits for any more: {text}"
        );
        // The same series again (a family's series come in no fixed order).
        let lines = |text: &str| {
            let mut l: Vec<String> = text.lines().map(str::to_owned).collect();
            l.sort();
            l
        };
        assert_eq!(lines(&metrics.render(&snapshot())), lines(&full));
        let standby = metrics.render(&MetricsSnapshot::default());
        assert!(standby.contains("tessera_scheduler_leader 0"), "{standby}");
        assert!(!standby.contains("zone=\"vGPU\""), "{standby}");
        assert!(
            !standby.contains("tessera_scheduler_reservations")
                && !standby.contains("tessera_pending_gpu_pods{"),
            "{standby}"
        );
        assert!(standby.ends_with("# EOF\n"), "{standby}");
        assert_eq!(standby.matches("# EOF").count(), 1, "{standby}");
    }

    /// HAMi v2.10 `cmd/scheduler/metrics_test.go`
    /// `TestClusterManagerCollectorExposesDynamicMigRuntimeIdentity`: the realized instance only.
    #[test]
    fn realized_mig_instances_are_exported_as_hami_does() {
        let text = Metrics::default().render(&snapshot());
        let rows: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("hami_node_gpu_mig_instance_info{"))
            .collect();
        assert_eq!(rows.len(), 1, "{text}");
        for part in [
            r#"node="n1""#,
            r#"device_uuid="GPU-m""#,
            r#"device_index="1""#,
            r#"mig_uuid="MIG-runtime""#,
            r#"profile="2g.10gb""#,
            r#"gpu_instance_id="4""#,
            r#"compute_instance_id="0""#,
            r#"placement_start="0""#,
            r#"placement_size="2""#,
        ] {
            assert!(rows[0].contains(part), "{part} in {}", rows[0]);
        }
        let legacy = Metrics {
            legacy: true,
            ..Metrics::default()
        }
        .render(&snapshot());
        assert!(legacy.contains(r#"migname="2g.10gb-4""#), "{legacy}");
    }
}

//! Prometheus metrics: request latencies and decisions (every replica), GPU and quota state in
//! HAMi's names (contract §8.1; the leader only, HAMi #1512).
//!
//! The registries are built once. The state is not kept in them: a scrape encodes it straight
//! from the decision loop's snapshot through two collectors, and drops the snapshot after.

use std::sync::{Arc, Mutex};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::text::{encode_eof, encode_registry};
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeLabelSet, EncodeLabelValue, EncodeMetric, LabelValueEncoder,
};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::engine::{ContainerDeviceMetrics, GpuMetrics, MetricsSnapshot, QuotaMetrics};
use hami_contract::mig::MigAllocation;

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
    /// The snapshot the state collectors encode during a scrape.
    scrape: Arc<ScrapeSlot>,
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
        let scrape = Arc::new(ScrapeSlot::default());
        leader_only
            .sub_registry_with_label(vgpu_zone())
            .register_collector(Box::new(StateCollector {
                slot: Arc::clone(&scrape),
                legacy: false,
            }));
        let mut legacy = Registry::default();
        legacy
            .sub_registry_with_label(vgpu_zone())
            .register_collector(Box::new(StateCollector {
                slot: Arc::clone(&scrape),
                legacy: true,
            }));
        Exposition {
            always,
            leader_only,
            legacy,
            leader,
            reservations,
            pending,
            scrape,
        }
    }

    /// The text exposition format of what applies, the state from `snap`.
    fn encode(&self, snap: MetricsSnapshot, legacy: bool) -> Result<String, std::fmt::Error> {
        self.leader.set(i64::from(snap.leader));
        let mut out = String::new();
        encode_registry(&mut out, &self.always)?;
        if snap.leader {
            self.reservations
                .set(i64::try_from(snap.reservations).unwrap_or(i64::MAX));
            // A reason no pod waits for any more must not linger.
            self.pending.clear();
            for (reason, n) in &snap.pending {
                self.pending
                    .get_or_create(&vec![("reason".to_owned(), (*reason).to_owned())])
                    .set(i64::try_from(*n).unwrap_or(i64::MAX));
            }
            let slot = Some(snap);
            *self.scrape.lock() = slot;
            let encoded = encode_registry(&mut out, &self.leader_only).and_then(|()| {
                if legacy {
                    encode_registry(&mut out, &self.legacy)
                } else {
                    Ok(())
                }
            });
            // The snapshot goes with the scrape: nothing of it is kept until the next one.
            *self.scrape.lock() = None;
            encoded?;
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

/// A label value of the state metrics, borrowed from the snapshot where it can be.
#[derive(Debug)]
enum Val<'a> {
    Text(&'a str),
    Owned(String),
    Num(u64),
}

impl EncodeLabelValue for Val<'_> {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> std::fmt::Result {
        match self {
            Val::Text(s) => s.encode(encoder),
            Val::Owned(s) => s.encode(encoder),
            Val::Num(n) => n.encode(encoder),
        }
    }
}

fn text(s: &str) -> Val<'_> {
    Val::Text(s)
}

fn num(n: impl Into<u64>) -> Val<'static> {
    Val::Num(n.into())
}

/// One gauge family: its descriptor and a series per item. An empty family is left out, as the
/// registry leaves out a family without series.
fn gauge<L: EncodeLabelSet>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    series: impl IntoIterator<Item = (L, f64)>,
) -> std::fmt::Result {
    let mut series = series.into_iter().peekable();
    if series.peek().is_none() {
        return Ok(());
    }
    let mut family = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, value) in series {
        ConstGauge::new(value).encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

/// The snapshot a scrape is encoding, shared by the two collectors below; empty between scrapes.
#[derive(Debug, Default)]
struct ScrapeSlot(Mutex<Option<MetricsSnapshot>>);

impl ScrapeSlot {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<MetricsSnapshot>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The leader's state, encoded straight from the decision loop's snapshot during a scrape: no
/// series are kept between scrapes. At 5,000 nodes and 50,000 pods one scrape is about 380,000
/// series; kept as label-keyed families they held 270 MiB and took a second to refill
/// (`benches/memory.rs`).
#[derive(Debug)]
struct StateCollector {
    slot: Arc<ScrapeSlot>,
    /// HAMi's pre-v2.9 names and label names instead of today's.
    legacy: bool,
}

impl Collector for StateCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        match self.slot.lock().as_ref() {
            Some(snap) if self.legacy => encode_legacy(snap, &mut enc),
            Some(snap) => encode_state(snap, &mut enc),
            None => Ok(()),
        }
    }
}

/// The realized MIG instances of the `mig` GPUs, each with its GPU.
fn realized_mig(snap: &MetricsSnapshot) -> impl Iterator<Item = (&GpuMetrics, &MigAllocation)> {
    snap.gpus.iter().filter(|g| g.mode == "mig").flat_map(|g| {
        g.mig
            .iter()
            .filter(|a| a.is_realized())
            .map(move |a| (g, a))
    })
}

type GpuLabels<'a> = [(&'static str, Val<'a>); 4];
type ContainerLabels<'a> = [(&'static str, Val<'a>); 5];

fn gpu_labels(g: &GpuMetrics) -> GpuLabels<'_> {
    [
        ("node", text(&g.node)),
        ("device_uuid", text(&g.uuid)),
        ("device_index", num(g.index)),
        ("device_type", text(&g.device_type)),
    ]
}

fn container_labels(c: &ContainerDeviceMetrics) -> ContainerLabels<'_> {
    [
        ("namespace", text(&c.namespace)),
        ("node", text(&c.node)),
        ("pod", text(&c.pod)),
        ("container_index", num(c.container_index as u64)),
        ("device_uuid", text(&c.uuid)),
    ]
}

fn legacy_gpu_labels(g: &GpuMetrics) -> GpuLabels<'_> {
    [
        ("nodeid", text(&g.node)),
        ("deviceuuid", text(&g.uuid)),
        ("deviceidx", num(g.index)),
        ("devicetype", text(&g.device_type)),
    ]
}

fn legacy_container_labels(c: &ContainerDeviceMetrics) -> ContainerLabels<'_> {
    [
        ("podnamespace", text(&c.namespace)),
        ("nodename", text(&c.node)),
        ("podname", text(&c.pod)),
        ("containeridx", num(c.container_index as u64)),
        ("deviceuuid", text(&c.uuid)),
    ]
}

/// The state in HAMi's names (contract §8.1), each family in HAMi's label order.
fn encode_state(snap: &MetricsSnapshot, enc: &mut DescriptorEncoder) -> std::fmt::Result {
    let gpus = &snap.gpus;
    let per_gpu = |name, help, value: fn(&GpuMetrics) -> f64, enc: &mut DescriptorEncoder| {
        gauge(
            enc,
            name,
            help,
            gpus.iter().map(|g| (gpu_labels(g), value(g))),
        )
    };
    per_gpu(
        "hami_gpu_memory_limit_bytes",
        "GPU memory limit.",
        |g| f64::from(g.totalmem) * MIB,
        enc,
    )?;
    per_gpu(
        "hami_gpu_core_limit_ratio",
        "GPU core limit.",
        |g| f64::from(g.totalcore),
        enc,
    )?;
    gauge(
        enc,
        "hami_gpu_memory_allocated_bytes",
        "GPU memory allocated.",
        gpus.iter().map(|g| {
            let [node, uuid, index, ty] = gpu_labels(g);
            (
                [node, uuid, index, ("device_cores", num(g.totalcore)), ty],
                f64::from(g.usedmem) * MIB,
            )
        }),
    )?;
    per_gpu(
        "hami_gpu_shared_count",
        "Containers sharing the GPU.",
        |g| f64::from(g.used),
        enc,
    )?;
    per_gpu(
        "hami_gpu_core_allocated_ratio",
        "GPU cores allocated.",
        |g| f64::from(g.usedcores),
        enc,
    )?;
    gauge(
        enc,
        "hami_node_gpu_overview",
        "GPU overview.",
        gpus.iter().map(|g| {
            let [node, uuid, index, ty] = gpu_labels(g);
            let cores = ("device_cores", num(g.totalcore));
            let limit = ("device_memory_limit", num(g.totalmem));
            (
                [node, uuid, index, cores, limit, ty],
                f64::from(g.usedmem) * MIB,
            )
        }),
    )?;
    per_gpu(
        "hami_node_gpu_memory_allocated_ratio",
        "GPU memory allocated ratio.",
        memory_ratio,
        enc,
    )?;
    // HAMi v2.10 `cmd/scheduler/metrics.go`: one series per realized MIG instance (the device
    // plugin wrote its identity into the pod's reservation) on a `mig` GPU.
    gauge(
        enc,
        "hami_node_gpu_mig_instance_info",
        "Realized MIG instance identity and scheduler placement.",
        realized_mig(snap).map(|(g, a)| {
            (
                [
                    ("node", text(&g.node)),
                    ("device_uuid", text(&g.uuid)),
                    ("device_index", num(g.index)),
                    ("mig_uuid", text(&a.mig_uuid)),
                    ("profile", text(&a.profile)),
                    (
                        "gpu_instance_id",
                        num(a.gpu_instance_id.unwrap_or_default()),
                    ),
                    (
                        "compute_instance_id",
                        num(a.compute_instance_id.unwrap_or_default()),
                    ),
                    ("placement_start", num(a.placement.start)),
                    ("placement_size", num(a.placement.size)),
                ],
                1.0,
            )
        }),
    )?;
    gauge(
        enc,
        "hami_vgpu_memory_allocated_bytes",
        "GPU memory allocated to a scheduled container.",
        snap.containers
            .iter()
            .map(|c| (container_labels(c), f64::from(c.mem) * MIB)),
    )?;
    gauge(
        enc,
        "hami_vgpu_core_allocated_ratio",
        "GPU cores allocated to a scheduled container.",
        snap.containers
            .iter()
            .map(|c| (container_labels(c), f64::from(c.cores))),
    )?;
    gauge(
        enc,
        "hami_resource_quota_used",
        "Namespace GPU quota used.",
        quota_items(snap).map(|(q, key, limit, used)| {
            (
                [
                    ("namespace", text(&q.namespace)),
                    ("quota_name", text(key)),
                    ("limit", num(limit)),
                ],
                used as f64,
            )
        }),
    )?;
    gauge(
        enc,
        "hami_resource_quota_limit",
        "Namespace GPU quota limit.",
        quota_items(snap).map(|(q, key, limit, _)| {
            (
                [("namespace", text(&q.namespace)), ("quota_name", text(key))],
                limit as f64,
            )
        }),
    )
}

/// Every quota's items: `(quota, resource key, limit, used)`.
fn quota_items(snap: &MetricsSnapshot) -> impl Iterator<Item = (&QuotaMetrics, &str, u64, u64)> {
    snap.quotas.iter().flat_map(|q| {
        q.items
            .iter()
            .map(move |(key, limit, used)| (q, key.as_str(), *limit, *used))
    })
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
fn encode_legacy(snap: &MetricsSnapshot, enc: &mut DescriptorEncoder) -> std::fmt::Result {
    let gpus = &snap.gpus;
    let per_gpu = |name, help, value: fn(&GpuMetrics) -> f64, enc: &mut DescriptorEncoder| {
        gauge(
            enc,
            name,
            help,
            gpus.iter().map(|g| (legacy_gpu_labels(g), value(g))),
        )
    };
    per_gpu(
        "GPUDeviceMemoryLimit",
        "Device memory limit for a certain GPU.",
        |g| f64::from(g.totalmem) * MIB,
        enc,
    )?;
    per_gpu(
        "GPUDeviceCoreLimit",
        "Device core limit for a certain GPU.",
        |g| f64::from(g.totalcore),
        enc,
    )?;
    gauge(
        enc,
        "GPUDeviceMemoryAllocated",
        "Device memory allocated for a certain GPU.",
        gpus.iter().map(|g| {
            let [node, uuid, idx, ty] = legacy_gpu_labels(g);
            (
                [node, uuid, idx, ("devicecores", num(g.totalcore)), ty],
                f64::from(g.usedmem) * MIB,
            )
        }),
    )?;
    per_gpu(
        "GPUDeviceSharedNum",
        "Number of containers sharing this GPU.",
        |g| f64::from(g.used),
        enc,
    )?;
    per_gpu(
        "GPUDeviceCoreAllocated",
        "Device core allocated for a certain GPU.",
        |g| f64::from(g.usedcores),
        enc,
    )?;
    gauge(
        enc,
        "nodeGPUOverview",
        "GPU overview on a certain node.",
        gpus.iter().map(|g| {
            let [node, uuid, idx, ty] = legacy_gpu_labels(g);
            let cores = ("devicecores", num(g.totalcore));
            let limit = ("devicememorylimit", num(g.totalmem));
            (
                [node, uuid, idx, cores, limit, ty],
                f64::from(g.usedmem) * MIB,
            )
        }),
    )?;
    // HAMi sends the percentage only for cards with memory, without the type.
    gauge(
        enc,
        "nodeGPUMemoryPercentage",
        "GPU memory allocated percentage on a certain GPU.",
        gpus.iter().filter(|g| g.totalmem > 0).map(|g| {
            let [node, uuid, idx, _] = legacy_gpu_labels(g);
            ([node, uuid, idx], memory_ratio(g))
        }),
    )?;
    gauge(
        enc,
        "QuotaUsed",
        "resourcequota usage for a certain device.",
        quota_items(snap).map(|(q, key, limit, used)| {
            (
                [
                    ("quotanamespace", text(&q.namespace)),
                    ("quotaName", text(key)),
                    ("limit", num(limit)),
                ],
                used as f64,
            )
        }),
    )?;
    gauge(
        enc,
        "vGPUMemoryAllocated",
        "vGPU memory allocated from a container.",
        snap.containers
            .iter()
            .map(|c| (legacy_container_labels(c), f64::from(c.mem) * MIB)),
    )?;
    gauge(
        enc,
        "vGPUCoreAllocated",
        "vGPU core allocated from a container.",
        snap.containers
            .iter()
            .map(|c| (legacy_container_labels(c), f64::from(c.cores))),
    )?;
    gauge(
        enc,
        "nodeGPUMigInstance",
        "GPU Sharing mode. 0 for hami-core, 1 for mig, 2 for mps.",
        realized_mig(snap).map(|(g, a)| {
            let migname = format!("{}-{}", a.profile, a.gpu_instance_id.unwrap_or_default());
            (
                [
                    ("nodeid", text(&g.node)),
                    ("deviceuuid", text(&g.uuid)),
                    ("deviceidx", num(g.index)),
                    ("migname", Val::Owned(migname)),
                ],
                1.0,
            )
        }),
    )
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
    pub fn render(&self, snap: MetricsSnapshot) -> String {
        let exposition = self
            .exposition
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        exposition
            .encode(snap, self.legacy)
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
        let text = metrics.render(snapshot());
        let checked = check_exposition(
            MetricComponent::Scheduler,
            &text,
            &Metrics::default().render(snapshot()),
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
        let full = metrics.render(snapshot());
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
        let text = metrics.render(fewer);
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
        assert_eq!(lines(&metrics.render(snapshot())), lines(&full));
        let standby = metrics.render(MetricsSnapshot::default());
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

    /// The state's exposition, byte for byte: HAMi's names, label order, escaping and values, the
    /// series in the snapshot's order. The file was written by the registry-backed families this
    /// encoder replaced (the same lines, in their hash order) and checked equal line for line.
    #[test]
    fn the_state_is_encoded_exactly_as_the_registry_families_encoded_it() {
        let mut snap = snapshot();
        snap.containers[0].namespace = "a\"b\\c\nd".into();
        let text = Metrics::new(true).render(snap);
        let start = text.find("# HELP hami_gpu_memory_limit_bytes").unwrap();
        let end = text.find("# EOF").unwrap();
        assert_eq!(
            &text[start..end],
            include_str!("testdata/state_exposition.txt")
        );
        assert!(text.contains(r#"namespace="a\"b\\c\nd""#), "{text}");
    }

    /// HAMi v2.10 `cmd/scheduler/metrics_test.go`
    /// `TestClusterManagerCollectorExposesDynamicMigRuntimeIdentity`: the realized instance only.
    #[test]
    fn realized_mig_instances_are_exported_as_hami_does() {
        let text = Metrics::default().render(snapshot());
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
        .render(snapshot());
        assert!(legacy.contains(r#"migname="2g.10gb-4""#), "{legacy}");
    }
}

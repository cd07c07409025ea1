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
    /// Where a `/filter` or `/bind` spends its time (`verb`, `step`): see [`Metrics::observe_step`].
    step_seconds: Family<Labels, Histogram, fn() -> Histogram>,
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
        let step_seconds =
            Family::<Labels, Histogram, fn() -> Histogram>::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.0001, 2.0, 16))
            });
        exposition.always.register(
            "tessera_scheduler_step_duration_seconds",
            "Time a /filter or /bind spent in each step (verb: filter, bind; step: decision_loop, waiting for the decision loop and its decision, with the read of the pod for a bind the loop had not reserved; api, the Binding POST); the rest of the call's latency is reading and answering the request",
            step_seconds.clone(),
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
            step_seconds,
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
                names: &CURRENT,
            }));
        let mut legacy = Registry::default();
        legacy
            .sub_registry_with_label(vgpu_zone())
            .register_collector(Box::new(StateCollector {
                slot: Arc::clone(&scrape),
                names: &LEGACY,
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
    (name, help): FamilyName,
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
    /// Today's names or HAMi's pre-v2.9 ones.
    names: &'static StateNames,
}

impl Collector for StateCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        match self.slot.lock().as_ref() {
            Some(snap) => encode_state(snap, self.names, &mut enc),
            None => Ok(()),
        }
    }
}

/// A family's name and help.
type FamilyName = (&'static str, &'static str);

/// The names of the state's families and labels in one of HAMi's two namings (today's `hami_*`,
/// contract §8.1; the names before v2.9, `--legacy-metrics`, contract §8.2). The values are the
/// same.
#[derive(Debug)]
struct StateNames {
    memory_limit: FamilyName,
    core_limit: FamilyName,
    memory_allocated: FamilyName,
    shared: FamilyName,
    core_allocated: FamilyName,
    overview: FamilyName,
    memory_ratio: FamilyName,
    mig_instance: FamilyName,
    container_memory: FamilyName,
    container_cores: FamilyName,
    quota_used: FamilyName,
    /// None before v2.9.
    quota_limit: Option<FamilyName>,
    /// A GPU's: node, UUID, index, type; then the cores and the memory limit of the overview.
    gpu: [&'static str; 4],
    cores: &'static str,
    memory: &'static str,
    /// A scheduled container's device: namespace, node, pod, container index, GPU UUID.
    container: [&'static str; 5],
    /// A quota's: namespace, resource key, limit.
    quota: [&'static str; 3],
    legacy: bool,
}

const CURRENT: StateNames = StateNames {
    memory_limit: ("hami_gpu_memory_limit_bytes", "GPU memory limit."),
    core_limit: ("hami_gpu_core_limit_ratio", "GPU core limit."),
    memory_allocated: ("hami_gpu_memory_allocated_bytes", "GPU memory allocated."),
    shared: ("hami_gpu_shared_count", "Containers sharing the GPU."),
    core_allocated: ("hami_gpu_core_allocated_ratio", "GPU cores allocated."),
    overview: ("hami_node_gpu_overview", "GPU overview."),
    memory_ratio: (
        "hami_node_gpu_memory_allocated_ratio",
        "GPU memory allocated ratio.",
    ),
    // HAMi v2.10 `cmd/scheduler/metrics.go`: one series per realized MIG instance (the device
    // plugin wrote its identity into the pod's reservation) on a `mig` GPU.
    mig_instance: (
        "hami_node_gpu_mig_instance_info",
        "Realized MIG instance identity and scheduler placement.",
    ),
    container_memory: (
        "hami_vgpu_memory_allocated_bytes",
        "GPU memory allocated to a scheduled container.",
    ),
    container_cores: (
        "hami_vgpu_core_allocated_ratio",
        "GPU cores allocated to a scheduled container.",
    ),
    quota_used: ("hami_resource_quota_used", "Namespace GPU quota used."),
    quota_limit: Some(("hami_resource_quota_limit", "Namespace GPU quota limit.")),
    gpu: ["node", "device_uuid", "device_index", "device_type"],
    cores: "device_cores",
    memory: "device_memory_limit",
    container: ["namespace", "node", "pod", "container_index", "device_uuid"],
    quota: ["namespace", "quota_name", "limit"],
    legacy: false,
};

/// HAMi's pre-v2.9 scheduler metrics (HAMi v2.10 `cmd/scheduler/metrics.go`).
const LEGACY: StateNames = StateNames {
    memory_limit: (
        "GPUDeviceMemoryLimit",
        "Device memory limit for a certain GPU.",
    ),
    core_limit: ("GPUDeviceCoreLimit", "Device core limit for a certain GPU."),
    memory_allocated: (
        "GPUDeviceMemoryAllocated",
        "Device memory allocated for a certain GPU.",
    ),
    shared: (
        "GPUDeviceSharedNum",
        "Number of containers sharing this GPU.",
    ),
    core_allocated: (
        "GPUDeviceCoreAllocated",
        "Device core allocated for a certain GPU.",
    ),
    overview: ("nodeGPUOverview", "GPU overview on a certain node."),
    memory_ratio: (
        "nodeGPUMemoryPercentage",
        "GPU memory allocated percentage on a certain GPU.",
    ),
    mig_instance: (
        "nodeGPUMigInstance",
        "GPU Sharing mode. 0 for hami-core, 1 for mig, 2 for mps.",
    ),
    container_memory: (
        "vGPUMemoryAllocated",
        "vGPU memory allocated from a container.",
    ),
    container_cores: ("vGPUCoreAllocated", "vGPU core allocated from a container."),
    quota_used: ("QuotaUsed", "resourcequota usage for a certain device."),
    quota_limit: None,
    gpu: ["nodeid", "deviceuuid", "deviceidx", "devicetype"],
    cores: "devicecores",
    memory: "devicememorylimit",
    container: [
        "podnamespace",
        "nodename",
        "podname",
        "containeridx",
        "deviceuuid",
    ],
    quota: ["quotanamespace", "quotaName", "limit"],
    legacy: true,
};

/// `names` zipped with `values`: one label set.
fn labeled<'a, const N: usize>(
    names: [&'static str; N],
    values: [Val<'a>; N],
) -> [(&'static str, Val<'a>); N] {
    let mut values = values.into_iter();
    names.map(|name| (name, values.next().unwrap_or(Val::Num(0))))
}

/// A GPU's four labels' values: node, UUID, index, type.
fn gpu_values(g: &GpuMetrics) -> [Val<'_>; 4] {
    [
        text(&g.node),
        text(&g.uuid),
        num(g.index),
        text(&g.device_type),
    ]
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

/// The state under `names`, each family in HAMi's label order.
fn encode_state(
    snap: &MetricsSnapshot,
    names: &StateNames,
    enc: &mut DescriptorEncoder,
) -> std::fmt::Result {
    let gpus = &snap.gpus;
    let (n, l) = (names, names.gpu);
    let per_gpu =
        |family: FamilyName, value: fn(&GpuMetrics) -> f64, enc: &mut DescriptorEncoder| {
            let series = gpus.iter().map(|g| (labeled(l, gpu_values(g)), value(g)));
            gauge(enc, family, series)
        };
    per_gpu(n.memory_limit, |g| f64::from(g.totalmem) * MIB, enc)?;
    per_gpu(n.core_limit, |g| f64::from(g.totalcore), enc)?;
    gauge(
        enc,
        n.memory_allocated,
        gpus.iter().map(|g| {
            let [node, uuid, index, ty] = gpu_values(g);
            let values = [node, uuid, index, num(g.totalcore), ty];
            let labels = labeled([l[0], l[1], l[2], n.cores, l[3]], values);
            (labels, f64::from(g.usedmem) * MIB)
        }),
    )?;
    per_gpu(n.shared, |g| f64::from(g.used), enc)?;
    per_gpu(n.core_allocated, |g| f64::from(g.usedcores), enc)?;
    gauge(
        enc,
        n.overview,
        gpus.iter().map(|g| {
            let [node, uuid, index, ty] = gpu_values(g);
            let values = [node, uuid, index, num(g.totalcore), num(g.totalmem), ty];
            let labels = labeled([l[0], l[1], l[2], n.cores, n.memory, l[3]], values);
            (labels, f64::from(g.usedmem) * MIB)
        }),
    )?;
    if names.legacy {
        // HAMi sends the old percentage only for cards with memory, without the type.
        gauge(
            enc,
            n.memory_ratio,
            gpus.iter().filter(|g| g.totalmem > 0).map(|g| {
                let [node, uuid, index, _] = gpu_values(g);
                (
                    labeled([l[0], l[1], l[2]], [node, uuid, index]),
                    memory_ratio(g),
                )
            }),
        )?;
    } else {
        per_gpu(n.memory_ratio, memory_ratio, enc)?;
    }
    encode_mig_instances(snap, names, enc)?;
    for (family, value) in [
        (
            n.container_memory,
            (|c| f64::from(c.mem) * MIB) as fn(&ContainerDeviceMetrics) -> f64,
        ),
        (n.container_cores, |c| f64::from(c.cores)),
    ] {
        let series = snap.containers.iter().map(|c| {
            let values = [
                text(&c.namespace),
                text(&c.node),
                text(&c.pod),
                num(c.container_index as u64),
                text(&c.uuid),
            ];
            (labeled(n.container, values), value(c))
        });
        gauge(enc, family, series)?;
    }
    let [ns, key, limit] = n.quota;
    gauge(
        enc,
        n.quota_used,
        quota_items(snap).map(|(q, k, l, used)| {
            let labels = labeled([ns, key, limit], [text(&q.namespace), text(k), num(l)]);
            (labels, used as f64)
        }),
    )?;
    if let Some(family) = n.quota_limit {
        gauge(
            enc,
            family,
            quota_items(snap)
                .map(|(q, k, l, _)| (labeled([ns, key], [text(&q.namespace), text(k)]), l as f64)),
        )?;
    }
    Ok(())
}

/// The realized MIG instances: today's names carry the instance's identity and placement,
/// the old ones a `migname` of profile and GPU instance.
fn encode_mig_instances(
    snap: &MetricsSnapshot,
    names: &StateNames,
    enc: &mut DescriptorEncoder,
) -> std::fmt::Result {
    let l = names.gpu;
    if names.legacy {
        return gauge(
            enc,
            names.mig_instance,
            realized_mig(snap).map(|(g, a)| {
                let [node, uuid, index, _] = gpu_values(g);
                let migname = format!("{}-{}", a.profile, a.gpu_instance_id.unwrap_or_default());
                let labels = labeled(
                    [l[0], l[1], l[2], "migname"],
                    [node, uuid, index, Val::Owned(migname)],
                );
                (labels, 1.0)
            }),
        );
    }
    gauge(
        enc,
        names.mig_instance,
        realized_mig(snap).map(|(g, a)| {
            let [node, uuid, index, _] = gpu_values(g);
            let labels = labeled(
                [
                    l[0],
                    l[1],
                    l[2],
                    "mig_uuid",
                    "profile",
                    "gpu_instance_id",
                    "compute_instance_id",
                    "placement_start",
                    "placement_size",
                ],
                [
                    node,
                    uuid,
                    index,
                    text(&a.mig_uuid),
                    text(&a.profile),
                    num(a.gpu_instance_id.unwrap_or_default()),
                    num(a.compute_instance_id.unwrap_or_default()),
                    num(a.placement.start),
                    num(a.placement.size),
                ],
            );
            (labels, 1.0)
        }),
    )
}

impl Metrics {
    /// One step of a `/filter` or `/bind` (`verb`): `decision_loop` (the round trip through the
    /// decision loop: its queue and its decision) or `api` (the Binding POST), issue 29's T4.
    pub fn observe_step(&self, verb: &'static str, step: &'static str, took: std::time::Duration) {
        self.step_seconds
            .get_or_create(&vec![
                ("verb".into(), verb.into()),
                ("step".into(), step.into()),
            ])
            .observe(took.as_secs_f64());
    }

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
    /// series in the snapshot's order. When this encoder replaced the registry-backed families,
    /// the file's lines were checked equal, as a set, to what those families wrote.
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

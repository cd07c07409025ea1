//! Prometheus metrics: request latencies and decisions (every replica), GPU and quota state in
//! HAMi's names (contract §8.1; the leader only, HAMi #1512).

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::engine::MetricsSnapshot;

type Labels = Vec<(String, String)>;

/// Metrics that live across scrapes.
#[derive(Debug, Clone)]
pub struct Metrics {
    pub filter_seconds: Histogram,
    pub bind_seconds: Histogram,
    /// `verb` (filter|bind), `result` (a reason code or `success`).
    pub decisions: Family<Labels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        let buckets = || Histogram::new(exponential_buckets(0.0001, 2.0, 16));
        Metrics {
            filter_seconds: buckets(),
            bind_seconds: buckets(),
            decisions: Family::default(),
        }
    }
}

impl Metrics {
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
        let mut reg = Registry::default();
        reg.register(
            "tessera_filter_duration_seconds",
            "Latency of /filter",
            self.filter_seconds.clone(),
        );
        reg.register(
            "tessera_bind_duration_seconds",
            "Latency of /bind",
            self.bind_seconds.clone(),
        );
        reg.register(
            "tessera_scheduler_decisions",
            "Filter and bind outcomes by reason",
            self.decisions.clone(),
        );
        let leader = Gauge::<i64>::default();
        leader.set(i64::from(snap.leader));
        reg.register(
            "tessera_scheduler_leader",
            "1 on the elected leader",
            leader,
        );
        if snap.leader {
            let reservations = Gauge::<i64>::default();
            reservations.set(i64::try_from(snap.reservations).unwrap_or(i64::MAX));
            reg.register(
                "tessera_scheduler_reservations",
                "Decisions not yet visible in the informer",
                reservations,
            );
            let vgpu = reg.sub_registry_with_label(("zone".into(), "vGPU".into()));
            let family = || Family::<Labels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
            let (mem_limit, core_limit, mem_alloc, shared, core_alloc, overview, mem_ratio) = (
                family(),
                family(),
                family(),
                family(),
                family(),
                family(),
                family(),
            );
            for g in &snap.gpus {
                let base = vec![
                    ("node".to_owned(), g.node.clone()),
                    ("device_uuid".to_owned(), g.uuid.clone()),
                    ("device_index".to_owned(), g.index.to_string()),
                    ("device_type".to_owned(), g.device_type.clone()),
                ];
                let mib = 1_048_576.0;
                mem_limit
                    .get_or_create(&base)
                    .set(f64::from(g.totalmem) * mib);
                core_limit.get_or_create(&base).set(f64::from(g.totalcore));
                shared.get_or_create(&base).set(f64::from(g.used));
                core_alloc.get_or_create(&base).set(f64::from(g.usedcores));
                let mut with_cores = base.clone();
                with_cores.insert(3, ("device_cores".to_owned(), g.totalcore.to_string()));
                mem_alloc
                    .get_or_create(&with_cores)
                    .set(f64::from(g.usedmem) * mib);
                let mut ov = with_cores.clone();
                ov.insert(
                    4,
                    ("device_memory_limit".to_owned(), g.totalmem.to_string()),
                );
                overview.get_or_create(&ov).set(f64::from(g.usedmem) * mib);
                let ratio = if g.totalmem == 0 {
                    0.0
                } else {
                    f64::from(g.usedmem) / f64::from(g.totalmem)
                };
                mem_ratio.get_or_create(&base).set(ratio);
            }
            vgpu.register("hami_gpu_memory_limit_bytes", "GPU memory limit", mem_limit);
            vgpu.register("hami_gpu_core_limit_ratio", "GPU core limit", core_limit);
            vgpu.register(
                "hami_gpu_memory_allocated_bytes",
                "GPU memory allocated",
                mem_alloc,
            );
            vgpu.register(
                "hami_gpu_shared_count",
                "Containers sharing the GPU",
                shared,
            );
            vgpu.register(
                "hami_gpu_core_allocated_ratio",
                "GPU cores allocated",
                core_alloc,
            );
            vgpu.register("hami_node_gpu_overview", "GPU overview", overview);
            vgpu.register(
                "hami_node_gpu_memory_allocated_ratio",
                "GPU memory allocated ratio",
                mem_ratio,
            );
            let (v_mem, v_cores) = (family(), family());
            for c in &snap.containers {
                let labels = vec![
                    ("namespace".to_owned(), c.namespace.clone()),
                    ("node".to_owned(), c.node.clone()),
                    ("pod".to_owned(), c.pod.clone()),
                    ("container_index".to_owned(), c.container_index.to_string()),
                    ("device_uuid".to_owned(), c.uuid.clone()),
                ];
                v_mem
                    .get_or_create(&labels)
                    .set(f64::from(c.mem) * 1_048_576.0);
                v_cores.get_or_create(&labels).set(f64::from(c.cores));
            }
            vgpu.register(
                "hami_vgpu_memory_allocated_bytes",
                "GPU memory allocated to a scheduled container",
                v_mem,
            );
            vgpu.register(
                "hami_vgpu_core_allocated_ratio",
                "GPU cores allocated to a scheduled container",
                v_cores,
            );
            let (q_used, q_limit) = (family(), family());
            for q in &snap.quotas {
                for (key, limit, used) in &q.items {
                    let base = vec![
                        ("namespace".to_owned(), q.namespace.clone()),
                        ("quota_name".to_owned(), key.clone()),
                    ];
                    q_limit.get_or_create(&base).set(*limit as f64);
                    let mut u = base.clone();
                    u.push(("limit".to_owned(), limit.to_string()));
                    q_used.get_or_create(&u).set(*used as f64);
                }
            }
            vgpu.register(
                "hami_resource_quota_used",
                "Namespace GPU quota used",
                q_used,
            );
            vgpu.register(
                "hami_resource_quota_limit",
                "Namespace GPU quota limit",
                q_limit,
            );
        }
        let mut out = String::new();
        if encode(&mut out, &reg).is_err() {
            return "# metrics encoding failed\n".to_owned();
        }
        out
    }
}

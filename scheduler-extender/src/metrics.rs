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
    /// Also export HAMi's pre-v2.9 names and labels (`--legacy-metrics`, chart `legacyMetrics`).
    pub legacy: bool,
}

impl Default for Metrics {
    fn default() -> Self {
        let buckets = || Histogram::new(exponential_buckets(0.0001, 2.0, 16));
        Metrics {
            filter_seconds: buckets(),
            bind_seconds: buckets(),
            decisions: Family::default(),
            legacy: false,
        }
    }
}

type FloatFamily = Family<Labels, Gauge<f64, std::sync::atomic::AtomicU64>>;

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

/// `(name, value)` label pairs.
fn labels<const N: usize>(pairs: [(&str, String); N]) -> Labels {
    pairs.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()
}

impl LegacyFamilies {
    fn register(self, reg: &mut Registry) {
        let named = [
            (
                "GPUDeviceMemoryLimit",
                "Device memory limit for a certain GPU",
                self.memory_limit,
            ),
            (
                "GPUDeviceCoreLimit",
                "Device core limit for a certain GPU",
                self.core_limit,
            ),
            (
                "GPUDeviceMemoryAllocated",
                "Device memory allocated for a certain GPU",
                self.memory_allocated,
            ),
            (
                "GPUDeviceSharedNum",
                "Number of containers sharing this GPU",
                self.shared_num,
            ),
            (
                "GPUDeviceCoreAllocated",
                "Device core allocated for a certain GPU",
                self.core_allocated,
            ),
            (
                "nodeGPUOverview",
                "GPU overview on a certain node",
                self.overview,
            ),
            (
                "nodeGPUMemoryPercentage",
                "GPU memory allocated percentage on a certain GPU",
                self.memory_percentage,
            ),
            (
                "QuotaUsed",
                "resourcequota usage for a certain device",
                self.quota_used,
            ),
            (
                "vGPUMemoryAllocated",
                "vGPU memory allocated from a container",
                self.vgpu_memory_allocated,
            ),
            (
                "vGPUCoreAllocated",
                "vGPU core allocated from a container",
                self.vgpu_core_allocated,
            ),
            (
                "nodeGPUMigInstance",
                "GPU Sharing mode. 0 for hami-core, 1 for mig, 2 for mps",
                self.mig_instance,
            ),
        ];
        for (name, help, family) in named {
            reg.register(name, help, family);
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
        tessera_runtime::register_build_info(&mut reg, env!("CARGO_PKG_VERSION"));
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
            let family = FloatFamily::default;
            let legacy = LegacyFamilies::default();
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
                if self.legacy {
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
                    legacy
                        .memory_limit
                        .get_or_create(&old)
                        .set(f64::from(g.totalmem) * mib);
                    legacy
                        .core_limit
                        .get_or_create(&old)
                        .set(f64::from(g.totalcore));
                    legacy.shared_num.get_or_create(&old).set(f64::from(g.used));
                    legacy
                        .core_allocated
                        .get_or_create(&old)
                        .set(f64::from(g.usedcores));
                    let with_cores = labels([
                        ("nodeid", node.clone()),
                        ("deviceuuid", uuid.clone()),
                        ("deviceidx", idx.clone()),
                        ("devicecores", g.totalcore.to_string()),
                        ("devicetype", ty.clone()),
                    ]);
                    legacy
                        .memory_allocated
                        .get_or_create(&with_cores)
                        .set(f64::from(g.usedmem) * mib);
                    let ov = labels([
                        ("nodeid", node.clone()),
                        ("deviceuuid", uuid.clone()),
                        ("deviceidx", idx.clone()),
                        ("devicecores", g.totalcore.to_string()),
                        ("devicememorylimit", g.totalmem.to_string()),
                        ("devicetype", ty),
                    ]);
                    legacy
                        .overview
                        .get_or_create(&ov)
                        .set(f64::from(g.usedmem) * mib);
                    // HAMi sends the percentage only for cards with memory, without the type.
                    if g.totalmem > 0 {
                        legacy
                            .memory_percentage
                            .get_or_create(&labels([
                                ("nodeid", node),
                                ("deviceuuid", uuid),
                                ("deviceidx", idx),
                            ]))
                            .set(ratio);
                    }
                }
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
            // HAMi v2.10 `cmd/scheduler/metrics.go`: one series per realized MIG instance (the
            // device plugin wrote its identity into the pod's reservation) on a `mig` GPU.
            let mig_instance = family();
            for g in snap.gpus.iter().filter(|g| g.mode == "mig") {
                for a in g.mig.iter().filter(|a| a.is_realized()) {
                    let (gi, ci) = (
                        a.gpu_instance_id.unwrap_or_default().to_string(),
                        a.compute_instance_id.unwrap_or_default().to_string(),
                    );
                    mig_instance
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
                    if self.legacy {
                        legacy
                            .mig_instance
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
            vgpu.register(
                "hami_node_gpu_mig_instance_info",
                "Realized MIG instance identity and scheduler placement",
                mig_instance,
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
                if self.legacy {
                    let old = self::labels([
                        ("podnamespace", c.namespace.clone()),
                        ("nodename", c.node.clone()),
                        ("podname", c.pod.clone()),
                        ("containeridx", c.container_index.to_string()),
                        ("deviceuuid", c.uuid.clone()),
                    ]);
                    legacy
                        .vgpu_memory_allocated
                        .get_or_create(&old)
                        .set(f64::from(c.mem) * 1_048_576.0);
                    legacy
                        .vgpu_core_allocated
                        .get_or_create(&old)
                        .set(f64::from(c.cores));
                }
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
                    if self.legacy {
                        legacy
                            .quota_used
                            .get_or_create(&labels([
                                ("quotanamespace", q.namespace.clone()),
                                ("quotaName", key.clone()),
                                ("limit", limit.to_string()),
                            ]))
                            .set(*used as f64);
                    }
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
            if self.legacy {
                legacy.register(vgpu);
            }
        }
        let mut out = String::new();
        if encode(&mut out, &reg).is_err() {
            return "# metrics encoding failed\n".to_owned();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{ContainerDeviceMetrics, GpuMetrics, QuotaMetrics};
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

//! The burst on a real node (issue 14, item 3): 100 identical pods (`gpumem 2000, gpucores 5`)
//! created at once onto one 8-GPU node (split 16) run by a real kubelet and containerd, Tessera
//! installed by `helm install`. Measured from the first create: every `Allocate` served (the
//! plugin's `hami.io/bind-phase: success` on every pod, seen on a watch) and every pod Running;
//! per pod: create -> bound and bound -> allocated.
//!
//! Two cases in one run, on the same cluster: the device plugin with the kubelet's pod-resources
//! socket (it identifies the pod under admission exactly and says so on its node, so the extender
//! lets several pods be in flight there), then without it (`devicePlugin.podResourcesPath`
//! pointing at an empty directory: the bind rule keeps one confusable pod in flight per node).
//!
//! `TESSERA_E2E_PROFILE=release cargo bench -p tessera-e2e --bench real_burst` after a release
//! build of the daemons (`bench/run.sh` does both); root, like every real-node scenario.
//! `TESSERA_BENCH_QUICK=1`: 24 pods, one round per case.
#![allow(
    clippy::disallowed_types,
    reason = "the e2e harness times real processes and clusters: wall-clock std::time::Instant"
)]

use hami_contract::annotations::{BIND_PHASE, BIND_PHASE_SUCCESS};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::future::join_all;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::PostParams;
use kube::runtime::watcher;
use serde_json::json;
use tessera_e2e::node::NodeSpec;
use tessera_e2e::real::{
    self, ChartValues, PROBE_IMAGE, RealCluster, RealClusterOptions, RealNodeSpec,
};
use tessera_e2e::{Error, Result};

use results::{Csv, Row, Stats};
use tessera_bench_results as results;

const NODE: &str = "burst-node";
const NS: &str = "burst";
const A100_MIB: u64 = 40960;

/// When each pod was first seen bound, allocated and Running.
#[derive(Debug, Default, Clone, Copy)]
struct Seen {
    bound: Option<Instant>,
    allocated: Option<Instant>,
    running: Option<Instant>,
    failed: bool,
}

fn burst_pod(i: usize) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("burst-{i:03}"), "namespace": NS},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "containers": [{
                "name": "c0", "image": PROBE_IMAGE, "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", "sleep 3600"],
                "resources": {"limits": {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 2000,
                                         "nvidia.com/gpucores": 5}},
            }],
        },
    }))
    .expect("pod")
}

struct Round {
    all_allocated: f64,
    all_running: f64,
    create_to_bound: Vec<f64>,
    bound_to_allocated: Vec<f64>,
}

async fn round(c: &RealCluster, pods: usize) -> Result<Round> {
    let api: Api<Pod> = Api::namespaced(c.admin().clone(), NS);
    let user: Api<Pod> = Api::namespaced(c.user().clone(), NS);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(String, Seen)>();
    let watch_api = api.clone();
    let watch = tokio::spawn(async move {
        let mut seen: BTreeMap<String, Seen> = BTreeMap::new();
        let mut stream = watcher(watch_api, watcher::Config::default()).boxed();
        while let Some(ev) = stream.next().await {
            let pods = match ev {
                Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p)) => vec![p],
                _ => continue,
            };
            let now = Instant::now();
            for p in pods {
                let name = p.metadata.name.clone().unwrap_or_default();
                let s = seen.entry(name.clone()).or_default();
                let before = *s;
                if s.bound.is_none() && p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some()
                {
                    s.bound = Some(now);
                }
                let phase = tessera_e2e::pods::annotation(&p, BIND_PHASE);
                if s.allocated.is_none() && phase == Some(BIND_PHASE_SUCCESS) {
                    s.allocated = Some(now);
                }
                let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
                if s.running.is_none() && phase == Some("Running") {
                    s.running = Some(now);
                }
                if phase == Some("Failed") && !s.failed {
                    // Rejected at admission or evicted: it will never run. Say why at once
                    // instead of waiting for the deadline.
                    s.failed = true;
                    eprintln!(
                        "burst: pod {name} failed: {:?}",
                        p.status.as_ref().map(|s| (&s.reason, &s.message))
                    );
                }
                if before.bound != s.bound
                    || before.allocated != s.allocated
                    || before.running != s.running
                    || before.failed != s.failed
                {
                    let _ = tx.send((name, *s));
                }
            }
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;

    let t0 = Instant::now();
    let created: BTreeMap<String, Instant> = join_all((0..pods).map(|i| {
        let user = user.clone();
        async move {
            let p = burst_pod(i);
            user.create(&PostParams::default(), &p)
                .await
                .map(|_| (p.metadata.name.unwrap_or_default(), Instant::now()))
        }
    }))
    .await
    .into_iter()
    .collect::<std::result::Result<_, _>>()?;

    let mut seen: BTreeMap<String, Seen> = BTreeMap::new();
    let deadline = t0 + Duration::from_secs(if results::quick() { 180 } else { 600 });
    let (mut all_allocated, mut all_running) = (None, None);
    while all_running.is_none() {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, rx.recv()).await {
            Ok(Some((name, s))) if s.failed => {
                watch.abort();
                return Err(Error::msg(format!(
                    "burst: pod {name} failed; every pod must run\n{}",
                    c.describe_pods(NS).await
                )));
            }
            Ok(Some((name, s))) => {
                seen.insert(name, s);
            }
            _ => {
                watch.abort();
                return Err(Error::msg(format!(
                    "burst: {} of {pods} allocated, {} running when the deadline passed\n{}",
                    seen.values().filter(|s| s.allocated.is_some()).count(),
                    seen.values().filter(|s| s.running.is_some()).count(),
                    c.describe_pods(NS).await
                )));
            }
        }
        let done = |f: fn(&Seen) -> Option<Instant>| {
            (seen.len() >= pods && seen.values().all(|s| f(s).is_some()))
                .then(|| seen.values().filter_map(f).max())
                .flatten()
        };
        if all_allocated.is_none() {
            all_allocated = done(|s| s.allocated);
        }
        all_running = done(|s| s.running);
    }
    watch.abort();
    let secs = |t: Option<Instant>| t.map_or(f64::NAN, |t| t.duration_since(t0).as_secs_f64());
    let r = Round {
        all_allocated: secs(all_allocated),
        all_running: secs(all_running),
        create_to_bound: seen
            .iter()
            .filter_map(|(n, s)| {
                Some(
                    s.bound?
                        .saturating_duration_since(*created.get(n)?)
                        .as_secs_f64()
                        * 1e3,
                )
            })
            .collect(),
        bound_to_allocated: seen
            .values()
            .filter_map(|s| {
                Some(
                    s.allocated?
                        .saturating_duration_since(s.bound?)
                        .as_secs_f64()
                        * 1e3,
                )
            })
            .collect(),
    };
    tessera_e2e::pods::delete_all(&api, Duration::from_secs(300)).await?;
    Ok(r)
}

fn main() -> Result<()> {
    let quick = results::quick();
    let pods = if quick { 24 } else { 100 };
    let rounds = if quick { 1 } else { 2 };
    let csv = Csv::open("real_burst");
    real::run(1, move |net| async move {
        let c = RealCluster::start(
            net,
            RealClusterOptions {
                name: "bench-real-burst".into(),
                nodes: vec![RealNodeSpec::gpu(
                    NodeSpec::uniform(NODE, 8, "NVIDIA A100-SXM4-40GB", A100_MIB)
                        .with_split_count(16),
                )],
                chart: ChartValues::Recommended(vec![(
                    "devicePlugin.deviceSplitCount".into(),
                    "16".into(),
                )]),
            },
        )
        .await?;
        c.tenant_namespace(NS).await?;
        let cases = [
            (
                "with pod-resources (exact identity; several pods in flight)",
                None,
            ),
            (
                "without pod-resources (bind rule: one confusable pod in flight)",
                Some("/var/lib/kubelet/no-pod-resources"),
            ),
        ];
        for (label, pod_resources) in cases {
            if let Some(path) = pod_resources {
                c.helm_upgrade_set(&[("devicePlugin.podResourcesPath", path)])
                    .await?;
                c.wait_plugin_rolled_out().await?;
            }
            let mut rs = Vec::new();
            for i in 0..rounds {
                let r = round(&c, pods).await?;
                eprintln!(
                    "real burst, {label}, round {i}: all allocated {:.2} s, all running {:.2} s",
                    r.all_allocated, r.all_running
                );
                rs.push(r);
            }
            let case = format!(
                "real node: {pods} identical pods (gpumem 2000 gpucores 5) onto one 8-GPU node \
                 (split 16), {label}"
            );
            let allocated = Stats::of(&rs.iter().map(|r| r.all_allocated).collect::<Vec<_>>());
            csv.row(
                &Row::new(
                    case.clone(),
                    "first create -> all allocated",
                    "s",
                    allocated,
                )
                .without_p99()
                .goal("< 5 s", allocated.median < 5.0),
            );
            csv.row(
                &Row::new(
                    case.clone(),
                    "first create -> all Running",
                    "s",
                    Stats::of(&rs.iter().map(|r| r.all_running).collect::<Vec<_>>()),
                )
                .without_p99(),
            );
            csv.row(&Row::new(
                case.clone(),
                "per pod: create -> bound",
                "ms",
                Stats::of(
                    &rs.iter()
                        .flat_map(|r| r.create_to_bound.clone())
                        .collect::<Vec<_>>(),
                ),
            ));
            csv.row(&Row::new(
                case,
                "per pod: bound -> allocated (kubelet admission + Allocate + patch)",
                "ms",
                Stats::of(
                    &rs.iter()
                        .flat_map(|r| r.bound_to_allocated.clone())
                        .collect::<Vec<_>>(),
                ),
            ));
        }
        Ok(())
    })
}

//! Claim to Running (issue 18): a burst of 50 pods onto one GPU node, each with its own share
//! (800 MiB, 2 % of the cores), through DRA (one ResourceClaim per pod from a template, allocated
//! by kube-scheduler, prepared by Tessera's DRA plugin, injected by containerd v2 through CDI) and,
//! in the same run and cluster, through the device plugin (`nvidia.com/gpumem: 800`,
//! `gpucores: 2`, placed by Tessera's extender, served by `Allocate`). Both nodes have one A100;
//! the device-plugin node is split 64 ways so 50 pods fit. Measured from the first create: every
//! pod Running, and per pod create -> Running.
//!
//! `TESSERA_E2E_PROFILE=release cargo bench -p tessera-e2e --bench dra_burst` after a release
//! build of the daemons (`bench/run.sh` does both); root, like every real-node scenario.
//! `TESSERA_BENCH_QUICK=1`: 12 pods per path.
#![allow(
    clippy::disallowed_types,
    reason = "the e2e harness times real processes and clusters: wall-clock std::time::Instant"
)]

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::future::join_all;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaimTemplate;
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::runtime::watcher;
use serde_json::json;
use tessera_e2e::node::NodeSpec;
use tessera_e2e::real::{
    self, ChartValues, PROBE_IMAGE, RealCluster, RealClusterOptions, RealNodeSpec,
};
use tessera_e2e::{Error, Result, eventually};

use results::{Csv, Row, Stats};
use tessera_bench_results as results;

const NS: &str = "burst";
const A100_MIB: u64 = 40960;
const SHARE_MIB: u64 = 800;
const SHARE_CORES: u32 = 2;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    Dra,
    DevicePlugin,
}

fn burst_pod(path: Path, i: usize) -> Pod {
    let mut container = json!({
        "name": "c0", "image": PROBE_IMAGE, "imagePullPolicy": "Never",
        "command": ["/bin/sh", "-c", "sleep 3600"],
    });
    let mut spec = json!({"terminationGracePeriodSeconds": 0});
    match path {
        Path::Dra => {
            container["resources"] = json!({"claims": [{"name": "gpu"}]});
            spec["resourceClaims"] = json!([{"name": "gpu", "resourceClaimTemplateName": "share"}]);
            spec["nodeSelector"] = json!({"kubernetes.io/hostname": "dra-node"});
        }
        Path::DevicePlugin => {
            container["resources"] = json!({"limits": {
                "nvidia.com/gpu": 1, "nvidia.com/gpumem": SHARE_MIB, "nvidia.com/gpucores": SHARE_CORES,
            }});
        }
    }
    spec["containers"] = json!([container]);
    let prefix = match path {
        Path::Dra => "dra",
        Path::DevicePlugin => "dp",
    };
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("{prefix}-{i:03}"), "namespace": NS},
        "spec": spec,
    }))
    .expect("pod")
}

struct Round {
    all_running: f64,
    create_to_running: Vec<f64>,
    /// Pods the kubelet rejected at admission and the bench recreated.
    rejected: usize,
}

async fn round(c: &RealCluster, path: Path, pods: usize) -> Result<Round> {
    let api: Api<Pod> = Api::namespaced(c.admin().clone(), NS);
    // (name, UID, when, failed): a pod's phase as the watch first saw it, per UID.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(String, String, Instant, bool)>();
    let watch_api = api.clone();
    let watch = tokio::spawn(async move {
        let mut stream = watcher(watch_api, watcher::Config::default()).boxed();
        while let Some(ev) = stream.next().await {
            let Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p)) = ev else {
                continue;
            };
            let phase = p.status.as_ref().and_then(|s| s.phase.clone());
            let name = p.metadata.name.clone().unwrap_or_default();
            let uid = p.metadata.uid.clone().unwrap_or_default();
            match phase.as_deref() {
                Some("Running") => {
                    let _ = tx.send((name, uid, Instant::now(), false));
                }
                Some("Failed") => {
                    eprintln!(
                        "burst: pod {name} failed: {:?}",
                        p.status.as_ref().map(|s| (&s.reason, &s.message))
                    );
                    let _ = tx.send((name, uid, Instant::now(), true));
                }
                _ => {}
            }
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;

    let t0 = Instant::now();
    let created: BTreeMap<String, Instant> = join_all((0..pods).map(|i| {
        let api = api.clone();
        async move {
            let p = burst_pod(path, i);
            api.create(&PostParams::default(), &p)
                .await
                .map(|_| (p.metadata.name.unwrap_or_default(), Instant::now()))
        }
    }))
    .await
    .into_iter()
    .collect::<std::result::Result<_, _>>()?;

    let mut running: BTreeMap<String, Instant> = BTreeMap::new();
    // The UIDs already recreated: a failed pod is seen by several watch events.
    let mut rejected: BTreeSet<String> = BTreeSet::new();
    let deadline = t0 + Duration::from_secs(if results::quick() { 180 } else { 600 });
    while running.len() < pods {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, rx.recv()).await {
            Ok(Some((_, uid, _, true))) if rejected.contains(&uid) => {}
            Ok(Some((name, uid, _, true))) => {
                // Rejected at the kubelet's admission (the device-plugin path can refuse a pod it
                // cannot tell apart: docs/design/allocation-identity.md): recreated, as its owner
                // would, and timed from its first create.
                rejected.insert(uid.clone());
                if rejected.len() > pods {
                    watch.abort();
                    return Err(Error::msg(format!(
                        "{path:?} burst: more rejections than pods\n{}",
                        c.describe_pods(NS).await
                    )));
                }
                // Only that pod: never a recreated one of the same name.
                let dp = DeleteParams::default().preconditions(kube::api::Preconditions {
                    uid: Some(uid),
                    resource_version: None,
                });
                api.delete(&name, &dp).await?;
                let gone = || async {
                    api.get_opt(&name)
                        .await
                        .ok()
                        .flatten()
                        .is_none()
                        .then_some(())
                };
                eventually(
                    "the rejected pod to be gone",
                    Duration::from_secs(60),
                    Duration::from_millis(200),
                    gone,
                )
                .await?;
                let i: usize = name
                    .rsplit('-')
                    .next()
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(0);
                api.create(&PostParams::default(), &burst_pod(path, i))
                    .await?;
            }
            Ok(Some((name, _, at, false))) => {
                running.entry(name).or_insert(at);
            }
            _ => {
                watch.abort();
                return Err(Error::msg(format!(
                    "{path:?} burst: {} of {pods} running when the deadline passed\n{}",
                    running.len(),
                    c.describe_pods(NS).await
                )));
            }
        }
    }
    watch.abort();
    let last = running.values().max().copied().unwrap_or(t0);
    let r = Round {
        rejected: rejected.len(),
        all_running: last.duration_since(t0).as_secs_f64(),
        create_to_running: running
            .iter()
            .filter_map(|(n, at)| {
                Some(at.saturating_duration_since(*created.get(n)?).as_secs_f64() * 1e3)
            })
            .collect(),
    };
    tessera_e2e::pods::delete_all(&api, Duration::from_secs(300)).await?;
    Ok(r)
}

fn main() -> Result<()> {
    let quick = results::quick();
    let pods = if quick { 12 } else { 50 };
    let rounds = if quick { 1 } else { 2 };
    let csv = Csv::open("dra_burst");
    // Built from its Go module on first use, outside the test's network namespace.
    real::containerd_v2()?;
    real::run(2, move |net| async move {
        let c = RealCluster::start(
            net,
            RealClusterOptions {
                name: "bench-dra-burst".into(),
                nodes: vec![
                    RealNodeSpec::gpu(
                        NodeSpec::uniform("dp-node", 1, "NVIDIA A100-SXM4-40GB", A100_MIB)
                            .with_split_count(64),
                    ),
                    RealNodeSpec::dra(NodeSpec::uniform(
                        "dra-node",
                        1,
                        "NVIDIA A100-SXM4-40GB",
                        A100_MIB,
                    )),
                ],
                chart: ChartValues::Recommended(vec![
                    ("devicePlugin.deviceSplitCount".into(), "64".into()),
                    ("dra.enabled".into(), "true".into()),
                ]),
            },
        )
        .await?;
        c.tenant_namespace(NS).await?;
        let template: ResourceClaimTemplate = serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": "share", "namespace": NS},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": "gpu.tessera.dev",
                "capacity": {"requests": {"memory": format!("{SHARE_MIB}Mi"), "cores": SHARE_CORES.to_string()}},
            }}]}}},
        }))?;
        Api::<ResourceClaimTemplate>::namespaced(c.admin().clone(), NS)
            .create(&PostParams::default(), &template)
            .await?;
        // The DRA node's slice must exist before the burst, as the device plugin's registration
        // must (both are part of the node coming up, not of the burst).
        let slices: Api<k8s_openapi::api::resource::v1::ResourceSlice> =
            Api::all(c.admin().clone());
        eventually(
            "the DRA node's ResourceSlice",
            Duration::from_secs(90),
            Duration::from_millis(500),
            || async {
                slices
                    .list(&ListParams::default())
                    .await
                    .ok()
                    .filter(|l| !l.items.is_empty())
            },
        )
        .await?;
        for (path, label) in [
            (
                Path::Dra,
                "DRA: a ResourceClaim per pod, kube-scheduler, CDI",
            ),
            (Path::DevicePlugin, "device plugin: extender, Allocate"),
        ] {
            let mut rs = Vec::new();
            for i in 0..rounds {
                let r = round(&c, path, pods).await?;
                eprintln!(
                    "{label}, round {i}: all running {:.2} s ({} rejected at admission and recreated)",
                    r.all_running, r.rejected
                );
                rs.push(r);
            }
            let case = format!(
                "real node: {pods} pods ({SHARE_MIB} MiB, {SHARE_CORES} % each) onto one A100, {label}"
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
            csv.row(
                &Row::new(
                    case.clone(),
                    "pods rejected at admission (recreated)",
                    "pods",
                    Stats::of(&rs.iter().map(|r| r.rejected as f64).collect::<Vec<_>>()),
                )
                .without_p99(),
            );
            csv.row(&Row::new(
                case,
                "per pod: create -> Running",
                "ms",
                Stats::of(
                    &rs.iter()
                        .flat_map(|r| r.create_to_running.clone())
                        .collect::<Vec<_>>(),
                ),
            ));
        }
        Ok(())
    })
}

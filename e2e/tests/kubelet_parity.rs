//! One burst, two kubelets (issue #14): the harness kubelet, which stays for the scale runs, must
//! admit as the real kubelet does. The same twelve pods (six shapes, two GPU init-container
//! shapes among them) are created at once in the same shuffled order onto one 8-GPU node of a
//! harness cluster, then of a real-node cluster (kubelet + containerd). On both, the device
//! plugin's log must show: one pod admitted at a time, its containers in kubelet order (init
//! containers first), the pod found through pod-resources `List` at its first call
//! (`elimination`: `List` already shows it, and every earlier pod's devices) and its later
//! containers `continuing`, pods admitted in the order they were bound (the kubelet sorts one
//! batch of its pod source by creation time, nothing else). Run with `--nocapture` to see both
//! sequences.
#![allow(
    clippy::disallowed_types,
    reason = "the e2e harness times real processes and clusters: wall-clock std::time::Instant"
)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use hami_contract::annotations::{BIND_PHASE, BIND_PHASE_SUCCESS};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{ListParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use rand::SeedableRng;
use rand::seq::SliceRandom;
use tessera_e2e::admission::{self, Run};
use tessera_e2e::cluster::{Cluster, ClusterOptions};
use tessera_e2e::node::NodeSpec;
use tessera_e2e::pods;
use tessera_e2e::probe::{SHAPE_CARD_MIB, SHAPES};
use tessera_e2e::real::{
    self, ChartValues, NAMESPACE, RealCluster, RealClusterOptions, RealNodeSpec,
};
use tessera_e2e::{Error, Result, eventually};

const NODE: &str = "parity-node";
const MODEL: &str = "NVIDIA A100-SXM4-40GB";

/// The burst: two pods of six shapes (the GPU init-container shapes among them) in one shuffled
/// order, the same for both kubelets.
fn burst(namespace: &str) -> Vec<Pod> {
    let mut pods: Vec<Pod> = SHAPES
        .iter()
        .filter(|s| !matches!(s.tag, "m3000" | "pct25"))
        .flat_map(|s| (0..2).map(move |i| s.pod(namespace, &format!("{}-{i}", s.tag))))
        .collect();
    pods.shuffle(&mut rand::rngs::StdRng::seed_from_u64(14));
    pods
}

fn key(p: &Pod) -> String {
    format!(
        "{}/{}",
        p.metadata.namespace.as_deref().unwrap_or_default(),
        p.metadata.name.as_deref().unwrap_or_default()
    )
}

/// Each pod's GPU containers in kubelet order.
fn gpu_containers(pods: &[Pod]) -> BTreeMap<String, Vec<String>> {
    pods.iter()
        .map(|p| {
            let spec = p.spec.clone().unwrap_or_default();
            let names = spec
                .init_containers
                .unwrap_or_default()
                .into_iter()
                .chain(spec.containers)
                .map(|c| c.name)
                .collect();
            (key(p), names)
        })
        .collect()
}

/// Records the order in which pods of `namespace` are seen bound (what a kubelet's watch sees).
fn watch_binds(
    client: kube::Client,
    namespace: &str,
) -> (Arc<Mutex<Vec<String>>>, tokio::task::JoinHandle<()>) {
    let bound = Arc::new(Mutex::new(Vec::new()));
    let out = bound.clone();
    let api: Api<Pod> = Api::namespaced(client, namespace);
    let task = tokio::spawn(async move {
        let mut events = watcher(api, watcher::Config::default())
            .default_backoff()
            .boxed();
        while let Some(ev) = events.next().await {
            let Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p)) = ev else {
                continue;
            };
            if p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_none() {
                continue;
            }
            if let Ok(mut v) = out.lock()
                && !v.contains(&key(&p))
            {
                v.push(key(&p));
            }
        }
    });
    (bound, task)
}

/// Waits until the plugin served every container of every pod (`bind-phase: success`); fails
/// at once on a pod the kubelet rejected.
async fn all_served(client: &kube::Client, namespace: &str, count: usize) -> Result<Vec<Pod>> {
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    eventually(
        "every pod's Allocate served",
        Duration::from_secs(180),
        Duration::from_millis(500),
        || async {
            let pods = api.list(&ListParams::default()).await.ok()?.items;
            let served = pods
                .iter()
                .filter(|p| pods::annotation(p, BIND_PHASE) == Some(BIND_PHASE_SUCCESS))
                .count();
            (served == count).then_some(pods)
        },
    )
    .await
}

/// What one kubelet did with the burst.
struct Observed {
    runs: Vec<Run>,
    problems: Vec<String>,
    inversions: usize,
}

fn observe(log: &str, pods: &[Pod], bound: &[String]) -> Observed {
    let ours: Vec<_> = admission::served_calls(log)
        .into_iter()
        .filter(|c| pods.iter().any(|p| key(p) == c.pod))
        .collect();
    let runs = admission::runs(&ours);
    let created: BTreeMap<String, String> = pods
        .iter()
        .map(|p| {
            let t = p
                .metadata
                .creation_timestamp
                .as_ref()
                .map(|t| t.0.to_string())
                .unwrap_or_default();
            (key(p), t)
        })
        .collect();
    Observed {
        problems: admission::check(&runs, &gpu_containers(pods), bound, &created),
        inversions: admission::inversions(&runs, bound),
        runs,
    }
}

fn report(kind: &str, o: &Observed, bound: &[String]) {
    println!("{kind}: bound in order {bound:?}");
    for r in &o.runs {
        println!("{kind}:   {} {:?}", r.pod, r.calls);
    }
    println!(
        "{kind}: {} pods admitted, {} pairs out of bind order",
        o.runs.len(),
        o.inversions
    );
}

async fn on_harness() -> Result<Observed> {
    let node = NodeSpec::uniform(NODE, 8, MODEL, SHAPE_CARD_MIB);
    let c = Cluster::start(ClusterOptions::new("parity-harness", vec![node])).await?;
    let pods = burst("default");
    let (bound, watch) = watch_binds(c.admin().clone(), "default");
    let api: Api<Pod> = Api::namespaced(c.user().clone(), "default");
    let post = PostParams::default();
    for r in futures::future::join_all(pods.iter().map(|p| api.create(&post, p))).await {
        r?;
    }
    let served = all_served(c.admin(), "default", pods.len()).await?;
    watch.abort();
    let log = std::fs::read_to_string(
        c.node(NODE)
            .ok_or_else(|| Error::msg("no harness node"))?
            .plugin_log_path(),
    )?;
    let bound = bound.lock().map(|v| v.clone()).unwrap_or_default();
    let o = observe(&log, &served, &bound);
    report("harness", &o, &bound);
    Ok(o)
}

async fn on_real(net: tessera_e2e::netns::ClusterNetwork) -> Result<Observed> {
    let c = RealCluster::start(
        net,
        RealClusterOptions {
            name: "parity-real".into(),
            nodes: vec![RealNodeSpec::gpu(NodeSpec::uniform(
                NODE,
                8,
                MODEL,
                SHAPE_CARD_MIB,
            ))],
            chart: ChartValues::Recommended(Vec::new()),
        },
    )
    .await?;
    let tenant = "parity";
    c.tenant_namespace(tenant).await?;
    c.wait_release_serving().await?;
    let pods = burst(tenant);
    let (bound, watch) = watch_binds(c.admin().clone(), tenant);
    for r in futures::future::join_all(pods.iter().map(|p| c.create_pod_as_user(p))).await {
        r?;
    }
    let served = all_served(c.admin(), tenant, pods.len()).await?;
    watch.abort();
    let plugin_pods: Api<Pod> = Api::namespaced(c.admin().clone(), NAMESPACE);
    let lp = ListParams::default().labels("app.kubernetes.io/component=device-plugin");
    let mut log = String::new();
    for p in plugin_pods.list(&lp).await?.items {
        let name = p.metadata.name.unwrap_or_default();
        log.push_str(&c.logs(NAMESPACE, &name, "tessera-device-plugin").await?);
    }
    let bound = bound.lock().map(|v| v.clone()).unwrap_or_default();
    let o = observe(&log, &served, &bound);
    report("real", &o, &bound);
    Ok(o)
}

#[test]
fn the_harness_kubelet_admits_a_burst_as_the_real_kubelet_does() -> Result<()> {
    let harness = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()?
        .block_on(on_harness())?;
    let real_result = Arc::new(Mutex::new(None));
    let slot = real_result.clone();
    real::run(1, move |net| async move {
        let o = on_real(net).await?;
        if let Ok(mut s) = slot.lock() {
            *s = Some(o);
        }
        Ok(())
    })?;
    let real = real_result
        .lock()
        .ok()
        .and_then(|mut s| s.take())
        .ok_or_else(|| Error::msg("the real-node run reported nothing"))?;
    assert!(
        real.problems.is_empty(),
        "the real kubelet: {:#?}",
        real.problems
    );
    assert!(
        harness.problems.is_empty(),
        "the harness kubelet differs: {:#?}",
        harness.problems
    );
    assert_eq!(
        harness.runs.len(),
        real.runs.len(),
        "both admitted every pod once"
    );
    Ok(())
}

//! The burst on a real node (issues 14 and 29): 100 identical pods created at once onto one
//! 8-GPU node (split 16) run by a real kubelet and containerd, Tessera installed by `helm
//! install`, against the same 100 pods without a GPU (same image and command, the default
//! scheduler) on the same node, rounds interleaved. Measured from the first create on a watch:
//! every pod bound, admitted by the kubelet (`status.startTime`), its `Allocate` served (the
//! plugin's `hami.io/bind-phase: success`) and Running; per pod: create -> bound and bound ->
//! allocated; and from the kubelet's own metrics, the time its `Allocate` calls took
//! (`kubelet_device_plugin_alloc_duration_seconds`) against the round's admission window.
//!
//! A third kind of round, beside the first case's: the same pods each asking for one device of a
//! null device plugin the bench serves on the node (`tessera_e2e::null_plugin`: answers at once,
//! no API call), so the kubelet's own cost of a pod with a device is told apart from Tessera's.
//!
//! Two GPU cases on the same cluster, each interleaved with plain rounds: the device plugin with
//! the kubelet's pod-resources socket (it identifies the pod under admission exactly and says so
//! on its node, so the extender lets several pods be in flight there), then without it
//! (`devicePlugin.podResourcesPath` pointing at an empty directory: the bind rule keeps one
//! confusable pod in flight per node).
//!
//! `TESSERA_E2E_PROFILE=release cargo bench -p tessera-e2e --bench real_burst` after a release
//! build of the daemons (`bench/run.sh` does both); root, like every real-node scenario.
//! `TESSERA_BENCH_QUICK=1`: 24 pods, one round per case.
#![allow(
    clippy::disallowed_types,
    reason = "the e2e harness times real processes and clusters: wall-clock std::time::Instant"
)]

use hami_contract::annotations::{BIND_PHASE, BIND_PHASE_SUCCESS};
use std::collections::{BTreeMap, BTreeSet};
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

/// When each pod was first seen bound, admitted, allocated and Running.
#[derive(Debug, Default, Clone, Copy)]
struct Seen {
    bound: Option<Instant>,
    admitted: Option<Instant>,
    allocated: Option<Instant>,
    running: Option<Instant>,
    failed: bool,
}

/// A burst's pods: GPU pods Tessera places, the same pods without a GPU (the baseline), or
/// with one device of a plugin that does nothing (the kubelet's own cost of a device).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Gpu,
    Plain,
    NullDevice,
}

/// The null device plugin's resource (`tessera_e2e::null_plugin`).
const NULL_RESOURCE: &str = "bench.tessera.dev/null";

impl Kind {
    /// The resource whose `Allocate` calls the kubelet's metric counts in this kind's rounds.
    fn device_resource(self) -> &'static str {
        match self {
            Kind::Gpu | Kind::Plain => "nvidia.com/gpu",
            Kind::NullDevice => NULL_RESOURCE,
        }
    }
}

fn burst_pod(i: usize, kind: Kind) -> Pod {
    let (name, resources) = match kind {
        Kind::Gpu => (
            format!("burst-{i:03}"),
            json!({"limits": {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 2000,
                              "nvidia.com/gpucores": 5}}),
        ),
        Kind::Plain => (format!("plain-{i:03}"), json!({})),
        Kind::NullDevice => (
            format!("null-{i:03}"),
            json!({"limits": {NULL_RESOURCE: 1}}),
        ),
    };
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "containers": [{
                "name": "c0", "image": PROBE_IMAGE, "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", "sleep 3600"],
                "resources": resources,
            }],
        },
    }))
    .expect("pod")
}

/// One burst, in seconds from the first create (NaN where it does not apply: a plain pod is
/// never allocated).
struct Round {
    all_bound: f64,
    all_admitted: f64,
    all_allocated: f64,
    all_running: f64,
    create_to_bound: Vec<f64>,
    bound_to_allocated: Vec<f64>,
    /// The kubelet's time in `Allocate` during the round, in seconds (GPU rounds).
    allocate_seconds: f64,
    /// The plugin's `Allocate` calls during the round, in milliseconds per call: the whole
    /// call (`call`) and each step (`tessera_device_plugin_allocate_step_duration_seconds`).
    allocate_steps: BTreeMap<String, f64>,
    /// The plugin's reads started beside the kubelet's `List` during the round, by outcome
    /// (`used`, `unused`: `tessera_device_plugin_early_reads`).
    early_reads: BTreeMap<String, f64>,
    /// The API server's requests during the round (every client: kubelet, scheduler, plugin,
    /// controllers, the bench's watch) by `VERB resource[/subresource]`: (requests, seconds).
    api_requests: Totals,
}

/// A histogram's (count, sum) per key, summed over the series that share the key.
type Totals = BTreeMap<String, (f64, f64)>;

/// The (count, sum) of histogram `name` in the exposition `text`, per the key `key` gives each
/// series (series it gives none are left out).
fn histogram_totals(
    text: &str,
    name: &str,
    key: impl Fn(&hami_contract::metrics::Sample) -> Option<String>,
) -> Totals {
    let (count, sum) = (format!("{name}_count"), format!("{name}_sum"));
    let mut totals = Totals::new();
    for s in hami_contract::metrics::samples(text).0 {
        let is_count = if s.name == count {
            true
        } else if s.name == sum {
            false
        } else {
            continue;
        };
        let Some(k) = key(&s) else { continue };
        let e = totals.entry(k).or_default();
        if is_count {
            e.0 += s.value;
        } else {
            e.1 += s.value;
        }
    }
    totals
}

/// What happened between two readings: (count, sum) differences, keys with no new observation
/// left out.
fn totals_between(before: &Totals, after: &Totals) -> Totals {
    after
        .iter()
        .filter_map(|(key, (n, sum))| {
            let (n0, sum0) = before.get(key).copied().unwrap_or_default();
            (n - n0 >= 1.0).then(|| (key.clone(), (n - n0, sum - sum0)))
        })
        .collect()
}

/// The API server's requests (`apiserver_request_duration_seconds`) by `VERB
/// resource[/subresource]`; long-running WATCHes, which have no duration, left out.
async fn api_requests(c: &RealCluster) -> Result<Totals> {
    let text = metrics_text(c, "/metrics").await?;
    Ok(histogram_totals(
        &text,
        "apiserver_request_duration_seconds",
        |s| {
            let (verb, resource) = (s.label("verb")?, s.label("resource")?);
            (verb != "WATCH").then(|| match s.label("subresource").filter(|r| !r.is_empty()) {
                Some(sub) => format!("{verb} {resource}/{sub}"),
                None => format!("{verb} {resource}"),
            })
        },
    ))
}

/// The plugin's `Allocate` figures at one moment: its calls (`call`) and their steps (`step`
/// label) as histogram (count, sum), and its early reads by outcome (a counter, as the count).
/// Empty when the plugin's metrics cannot be read.
#[derive(Debug, Default)]
struct PluginAllocate {
    steps: Totals,
    early_reads: Totals,
}

impl PluginAllocate {
    async fn read(c: &RealCluster) -> Self {
        let Some(text) = c.device_plugin_metrics(NODE).await else {
            return Self::default();
        };
        let early_reads = hami_contract::metrics::samples(&text)
            .0
            .into_iter()
            .filter(|s| s.name == "tessera_device_plugin_early_reads_total")
            .filter_map(|s| Some((s.label("outcome")?.to_owned(), (s.value, 0.0))))
            .collect();
        PluginAllocate {
            steps: allocate_steps(&text),
            early_reads,
        }
    }
}

/// The plugin's `Allocate` calls (`call`) and their steps (`step` label) in its exposition.
fn allocate_steps(text: &str) -> Totals {
    let mut totals = histogram_totals(
        text,
        "tessera_device_plugin_allocate_duration_seconds",
        |_| Some("call".to_owned()),
    );
    totals.extend(histogram_totals(
        text,
        "tessera_device_plugin_allocate_step_duration_seconds",
        |s| s.label("step").map(str::to_owned),
    ));
    totals
}

/// The kubelet's `kubelet_device_plugin_alloc_duration_seconds_sum` for `resource`, read
/// through the API server's node proxy (0 before its first `Allocate`).
async fn kubelet_allocate_seconds(c: &RealCluster, resource: &str) -> Result<f64> {
    let text = metrics_text(c, &format!("/api/v1/nodes/{NODE}/proxy/metrics")).await?;
    let totals = histogram_totals(&text, "kubelet_device_plugin_alloc_duration_seconds", |s| {
        (s.label("resource_name") == Some(resource)).then(String::new)
    });
    Ok(totals.values().map(|(_, secs)| secs).sum())
}

/// The metrics exposition at `path` of the API server (`/metrics`, or a node's through its proxy).
async fn metrics_text(c: &RealCluster, path: &str) -> Result<String> {
    let request = http::Request::get(path)
        .body(Vec::new())
        .map_err(|e| Error::msg(e.to_string()))?;
    Ok(c.admin().request_text(request).await?)
}

async fn round(c: &RealCluster, pods: usize, kind: Kind) -> Result<Round> {
    let allocate_before = kubelet_allocate_seconds(c, kind.device_resource()).await?;
    let requests_before = api_requests(c).await?;
    let plugin_before = match kind {
        Kind::Gpu => PluginAllocate::read(c).await,
        Kind::Plain | Kind::NullDevice => PluginAllocate::default(),
    };
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
                if s.admitted.is_none()
                    && p.status
                        .as_ref()
                        .and_then(|s| s.start_time.as_ref())
                        .is_some()
                {
                    s.admitted = Some(now);
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
                    || before.admitted != s.admitted
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
            let p = burst_pod(i, kind);
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
    let mut all_running = None;
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
                    "burst: {} of {pods} admitted, {} running when the deadline passed\n{}",
                    seen.values().filter(|s| s.admitted.is_some()).count(),
                    seen.values().filter(|s| s.running.is_some()).count(),
                    c.describe_pods(NS).await
                )));
            }
        }
        all_running = done(&seen, pods, |s| s.running);
    }
    watch.abort();
    let requests_after = api_requests(c).await?;
    let plugin_after = match kind {
        Kind::Gpu => PluginAllocate::read(c).await,
        Kind::Plain | Kind::NullDevice => PluginAllocate::default(),
    };
    let secs = |t: Option<Instant>| t.map_or(f64::NAN, |t| t.duration_since(t0).as_secs_f64());
    let r = Round {
        all_bound: secs(done(&seen, pods, |s| s.bound)),
        all_admitted: secs(done(&seen, pods, |s| s.admitted)),
        all_allocated: secs(done(&seen, pods, |s| s.allocated)),
        all_running: secs(all_running),
        allocate_seconds: kubelet_allocate_seconds(c, kind.device_resource()).await?
            - allocate_before,
        api_requests: totals_between(&requests_before, &requests_after),
        allocate_steps: totals_between(&plugin_before.steps, &plugin_after.steps)
            .into_iter()
            .map(|(step, (calls, secs))| (step, secs * 1e3 / calls))
            .collect(),
        early_reads: totals_between(&plugin_before.early_reads, &plugin_after.early_reads)
            .into_iter()
            .map(|(outcome, (reads, _))| (outcome, reads))
            .collect(),
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

/// Waits until `node`'s allocatable shows at least `count` of `resource` (the kubelet reports a
/// newly registered plugin's devices with its next node status update).
async fn wait_allocatable(c: &RealCluster, resource: &str, count: usize) -> Result<()> {
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(c.admin().clone());
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let node = nodes.get(NODE).await?;
        let have = node
            .status
            .and_then(|s| s.allocatable)
            .and_then(|a| a.get(resource).and_then(|q| q.0.parse::<usize>().ok()))
            .unwrap_or(0);
        if have >= count {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(Error::msg(format!(
                "{NODE} shows {have} {resource} after 90 s, want {count}"
            )));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The null device's rounds against the plain and GPU rounds they were interleaved with: the
/// kubelet's own cost of a device (null ÷ plain) and what Tessera adds to it (GPU ÷ null).
fn null_device_rows(
    csv: &Csv,
    pods: usize,
    gpu_case: &str,
    gpu: &[Round],
    plain: &[Round],
    null: &[Round],
) {
    let case = format!(
        "real node: the same {pods} pods each with one device of a null device plugin (answers \
         at once; no API call), interleaved with the plain and GPU rounds"
    );
    let of = |rs: &[Round], f: fn(&Round) -> f64| rs.iter().map(f).collect::<Vec<_>>();
    for (metric, f) in [
        (
            "first create -> all admitted (kubelet startTime)",
            (|r: &Round| r.all_admitted) as fn(&Round) -> f64,
        ),
        ("first create -> all Running", |r| r.all_running),
    ] {
        csv.row(
            &Row::new(case.clone(), metric, "s", Stats::of(&of(null, f)))
                .without_p99()
                .baseline(Stats::of(&of(plain, f)).median)
                .ratio(ratio_of_rounds(&of(null, f), &of(plain, f))),
        );
        csv.row(
            &Row::new(
                gpu_case,
                format!("{metric}: GPU / null device (what Tessera adds to a device)"),
                "s",
                Stats::of(&of(gpu, f)),
            )
            .without_p99()
            .baseline(Stats::of(&of(null, f)).median)
            .ratio(ratio_of_rounds(&of(gpu, f), &of(null, f))),
        );
    }
    let share = Stats::of(
        &null
            .iter()
            .map(|r| r.allocate_seconds / r.all_admitted)
            .collect::<Vec<_>>(),
    );
    csv.row(
        &Row::new(
            case,
            "kubelet time in Allocate / admission window",
            "ratio",
            share,
        )
        .without_p99(),
    );
}

/// When the last of `pods` pods reached what `f` reads, once all have.
fn done(
    seen: &BTreeMap<String, Seen>,
    pods: usize,
    f: fn(&Seen) -> Option<Instant>,
) -> Option<Instant> {
    (seen.len() >= pods && seen.values().all(|s| f(s).is_some()))
        .then(|| seen.values().filter_map(f).max())
        .flatten()
}

/// The median of per-round ratios `gpu[i] / plain[i]` (rounds interleaved, so each pair shared
/// the machine's state).
fn ratio_of_rounds(gpu: &[f64], plain: &[f64]) -> f64 {
    Stats::of(
        &gpu.iter()
            .zip(plain)
            .map(|(g, p)| g / p)
            .collect::<Vec<_>>(),
    )
    .median
}

fn main() -> Result<()> {
    let quick = results::quick();
    let pods = if quick { 24 } else { 100 };
    let rounds = if quick { 1 } else { 3 };
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
        // The kubelet's own cost of a pod with a device: a plugin that answers at once, beside
        // Tessera's on the same node, its devices advertised before the first round.
        let node = c
            .node(NODE)
            .ok_or_else(|| Error::msg("the burst node is not running"))?;
        let _null_plugin = tessera_e2e::null_plugin::start(
            &node.device_plugin_dir()?,
            NULL_RESOURCE,
            pods + 28,
            true,
        )
        .await?;
        wait_allocatable(&c, NULL_RESOURCE, pods).await?;
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
            let (mut gpu, mut plain, mut null) = (Vec::new(), Vec::new(), Vec::new());
            // The null device's rounds do not depend on Tessera's settings: the first case only.
            let with_null = pod_resources.is_none();
            for i in 0..rounds {
                let p = round(&c, pods, Kind::Plain).await?;
                if with_null {
                    let n = round(&c, pods, Kind::NullDevice).await?;
                    eprintln!(
                        "real burst, null device, round {i}: all admitted {:.2} s, all running \
                         {:.2} s, the kubelet's Allocate {:.3} s in all",
                        n.all_admitted, n.all_running, n.allocate_seconds
                    );
                    null.push(n);
                }
                let g = round(&c, pods, Kind::Gpu).await?;
                eprintln!(
                    "real burst, {label}, round {i}: GPU all admitted {:.2} s, all running {:.2} s; \
                     plain all admitted {:.2} s, all running {:.2} s; the plugin's Allocate, ms \
                     per call: {:?}; early reads: {:?}",
                    g.all_admitted,
                    g.all_running,
                    p.all_admitted,
                    p.all_running,
                    g.allocate_steps,
                    g.early_reads
                );
                plain.push(p);
                gpu.push(g);
            }
            let case = format!(
                "real node: {pods} identical pods (gpumem 2000 gpucores 5) onto one 8-GPU node \
                 (split 16), {label}"
            );
            let plain_case = format!(
                "real node: the same {pods} pods without a GPU (default scheduler), interleaved \
                 with the rounds of: {label}"
            );
            let of = |rs: &[Round], f: fn(&Round) -> f64| rs.iter().map(f).collect::<Vec<_>>();
            let per_round = |rs: &[Round], f: fn(&Round) -> f64| Stats::of(&of(rs, f));
            // R1: all Running, GPU / plain.
            let running = per_round(&gpu, |r| r.all_running);
            let running_ratio =
                ratio_of_rounds(&of(&gpu, |r| r.all_running), &of(&plain, |r| r.all_running));
            csv.row(
                &Row::new(case.clone(), "first create -> all Running", "s", running)
                    .without_p99()
                    .baseline(per_round(&plain, |r| r.all_running).median)
                    .ratio(running_ratio)
                    .goal("GPU / plain <= 1.2", running_ratio <= 1.2),
            );
            // R2: the admission window, GPU / plain, or at most 20 ms more per pod.
            let admitted = per_round(&gpu, |r| r.all_admitted);
            let plain_admitted = per_round(&plain, |r| r.all_admitted);
            let admitted_ratio = ratio_of_rounds(
                &of(&gpu, |r| r.all_admitted),
                &of(&plain, |r| r.all_admitted),
            );
            let added_per_pod_ms = (admitted.median - plain_admitted.median) * 1e3 / pods as f64;
            csv.row(
                &Row::new(
                    case.clone(),
                    "first create -> all admitted (kubelet startTime)",
                    "s",
                    admitted,
                )
                .without_p99()
                .baseline(plain_admitted.median)
                .ratio(admitted_ratio)
                .goal(
                    "GPU / plain <= 1.5 or <= 20 ms added per pod",
                    admitted_ratio <= 1.5 || added_per_pod_ms <= 20.0,
                ),
            );
            csv.row(
                &Row::new(
                    case.clone(),
                    "first create -> all bound",
                    "s",
                    per_round(&gpu, |r| r.all_bound),
                )
                .without_p99()
                .baseline(per_round(&plain, |r| r.all_bound).median)
                .ratio(ratio_of_rounds(
                    &of(&gpu, |r| r.all_bound),
                    &of(&plain, |r| r.all_bound),
                )),
            );
            csv.row(
                &Row::new(
                    case.clone(),
                    "first create -> all allocated",
                    "s",
                    per_round(&gpu, |r| r.all_allocated),
                )
                .without_p99(),
            );
            // R3: the kubelet's time in Allocate against the admission window.
            let share = Stats::of(
                &gpu.iter()
                    .map(|r| r.allocate_seconds / r.all_admitted)
                    .collect::<Vec<_>>(),
            );
            csv.row(
                &Row::new(
                    case.clone(),
                    "kubelet time in Allocate / admission window",
                    "ratio",
                    share,
                )
                .without_p99()
                .goal("<= 0.10", share.median <= 0.10),
            );
            if !null.is_empty() {
                null_device_rows(&csv, pods, &case, &gpu, &plain, &null);
            }
            // T2 on the real node: the API server's requests per placed pod by kind, GPU and
            // plain rounds side by side, and the API server's own time per request of the
            // kinds Allocate makes (against the plugin's steps: the difference is the client's
            // wait, on two shared cores).
            let kinds: BTreeSet<&String> = gpu
                .iter()
                .chain(&plain)
                .flat_map(|r| r.api_requests.keys())
                .collect();
            for kind in kinds {
                let per_pod = |rs: &[Round]| {
                    Stats::of(
                        &rs.iter()
                            .map(|r| {
                                r.api_requests
                                    .get(kind)
                                    .map_or(0.0, |(n, _)| n / pods as f64)
                            })
                            .collect::<Vec<_>>(),
                    )
                };
                let (g, p) = (per_pod(&gpu), per_pod(&plain));
                if g.median < 0.05 && p.median < 0.05 {
                    continue;
                }
                let mut row = Row::new(
                    case.clone(),
                    format!("API requests per pod: {kind}"),
                    "requests",
                    g,
                )
                .without_p99()
                .baseline(p.median);
                if p.median > 0.0 {
                    row = row.ratio(g.median / p.median);
                }
                csv.row(&row);
                if kind == "GET pods" || kind == "PATCH pods" || kind == "LIST pods" {
                    let ms = Stats::of(
                        &gpu.iter()
                            .filter_map(|r| {
                                let (n, secs) = r.api_requests.get(kind)?;
                                Some(secs * 1e3 / n)
                            })
                            .collect::<Vec<_>>(),
                    );
                    csv.row(
                        &Row::new(
                            case.clone(),
                            format!("the API server's time per request: {kind}"),
                            "ms",
                            ms,
                        )
                        .without_p99(),
                    );
                }
            }
            // Where the kubelet's wait in Allocate goes: the plugin's own steps, per call.
            let steps: BTreeSet<&String> =
                gpu.iter().flat_map(|r| r.allocate_steps.keys()).collect();
            for step in steps {
                let per_round: Vec<f64> = gpu
                    .iter()
                    .filter_map(|r| r.allocate_steps.get(step).copied())
                    .collect();
                let what = if step == "call" {
                    "the plugin's Allocate: whole call, mean per call".to_owned()
                } else {
                    format!("the plugin's Allocate: step {step}, mean per call")
                };
                csv.row(&Row::new(case.clone(), what, "ms", Stats::of(&per_round)).without_p99());
            }
            // How often the read started beside the kubelet's List was the pod it admitted.
            let outcomes: BTreeSet<&String> =
                gpu.iter().flat_map(|r| r.early_reads.keys()).collect();
            for outcome in outcomes {
                let per_round: Vec<f64> = gpu
                    .iter()
                    .map(|r| r.early_reads.get(outcome).copied().unwrap_or(0.0))
                    .collect();
                csv.row(
                    &Row::new(
                        case.clone(),
                        format!(
                            "the plugin's Allocate: early read {outcome} (reads started beside the kubelet's List), per round"
                        ),
                        "reads",
                        Stats::of(&per_round),
                    )
                    .without_p99(),
                );
            }
            csv.row(&Row::new(
                case.clone(),
                "per pod: create -> bound",
                "ms",
                Stats::of(
                    &gpu.iter()
                        .flat_map(|r| r.create_to_bound.clone())
                        .collect::<Vec<_>>(),
                ),
            ));
            csv.row(&Row::new(
                case,
                "per pod: bound -> allocated (kubelet admission + Allocate + patch)",
                "ms",
                Stats::of(
                    &gpu.iter()
                        .flat_map(|r| r.bound_to_allocated.clone())
                        .collect::<Vec<_>>(),
                ),
            ));
            for (metric, f) in [
                (
                    "first create -> all bound",
                    (|r: &Round| r.all_bound) as fn(&Round) -> f64,
                ),
                ("first create -> all admitted (kubelet startTime)", |r| {
                    r.all_admitted
                }),
                ("first create -> all Running", |r| r.all_running),
            ] {
                csv.row(
                    &Row::new(plain_case.clone(), metric, "s", per_round(&plain, f)).without_p99(),
                );
            }
            csv.row(&Row::new(
                plain_case,
                "per pod: create -> bound",
                "ms",
                Stats::of(
                    &plain
                        .iter()
                        .flat_map(|r| r.create_to_bound.clone())
                        .collect::<Vec<_>>(),
                ),
            ));
        }
        Ok(())
    })
}

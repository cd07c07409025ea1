//! Scheduling through the real kube-scheduler on the e2e control plane (issue 7, item 3).
//!
//! One cluster (etcd, kube-apiserver with the chart's webhook, the chart's kube-scheduler beside
//! `tessera-scheduler`), then:
//!
//! * **burst**: 100 identical fractional pods onto one plugin-backed 8-GPU node (split 16; the
//!   real device plugin behind the harness kubelet), time from the first create until the
//!   kubelet has admitted (allocated) all of them;
//! * **throughput** (issue 15, item 2): 2,000 one-GPU pods on 500 simulated nodes, placed
//!   (a) by a second, plain kube-scheduler (profile `default-scheduler`, no extender) with
//!   `nvidia.com/gpu: 1` against 8 GPUs of node extended resources, (a') the same with client
//!   QPS 1000 instead of the default 50 (which caps (a)'s Binding calls), (b) by the chart's
//!   kube-scheduler + Tessera with fractional requests (`gpu: 1, gpumem: 4000, gpucores: 10`)
//!   on nodes registered as 8 × A100 40 GB (split 10), (b') by a kube-scheduler with the chart's
//!   configuration but client QPS 1000 calling the same extender, (p') as (b') but with the
//!   chart's `admissionPolicy.podMutation` policies mutating the pods inside the API server
//!   instead of the webhook (its namespaces labeled for them; the cluster's API server then serves
//!   MutatingAdmissionPolicy), and (h) by the chart's
//!   configuration calling a second extender in HAMi's write order (`--write-decision-at-filter
//!   --pod-events all`, not leader-elected), all in the same run, the order rotating every round.
//!   Pods of (b'), (h) and (a') name their profile (the webhook leaves such pods alone). (a) and
//!   (a') share one node set, the Tessera variants another (`tessera.io/bench-set` label and pod
//!   `nodeSelector`); a run's pods are deleted before the next run. The nodes are bare (a `Node`
//!   object, no kubelet): for the Tessera variants a task plays the device plugin's part and
//!   marks each pod bound to a bare node `hami.io/bind-phase: success`, as the plugin does after
//!   `Allocate`, so Tessera's bind gate sees allocations complete. Every scheduler runs
//!   throughout (each watches every pod), as the extenders do.
//!
//! Pods are created by 32 concurrent clients as the ordinary user. Placement rate: pods /
//! (last bound − first create started); latency: create started → `spec.nodeName` seen on a
//! watch. Figures: median over rounds (throughput; the ratio is the median of per-round
//! ratios), over all pods of all rounds (latency). Also per run: CPU seconds of every process of
//! the cluster per placed pod, and the extender's mean `/filter` and `/bind` handler times.
//!
//! Run with release daemons: `cargo build --release -p tessera-scheduler -p tessera-device-plugin
//! -p fake-nvml -p fake-cuda -p libvgpu-shim && TESSERA_E2E_PROFILE=release cargo bench -p
//! tessera-e2e --bench scheduling` (`bench/run.sh` does both). `TESSERA_BENCH_QUICK=1`: 50 nodes,
//! 200 pods, one round, a 24-pod burst. Options: `--nodes N --pods N --rounds N --burst N
//! --burst-rounds N --running N --admission N --csv NAME`. With `--running N` (issue 15, item 3), N pods are
//! already bound and booked on each node set before the runs, and the leading extender is
//! restarted once to measure a leader change against that many objects in the API server.
//! `TESSERA_BENCH_PERF_DIR=<dir>`: a system-wide `perf record` of every placement run.
//! The Tessera node set carries what the device plugin writes on a kubelet with pod-resources
//! (`tessera.io/allocation-identity: pod-resources`: the chart's default on 1.34); with
//! `--signature-identity` what it writes without (`signature`: the bind rule keeps one
//! confusable pod in flight per node, and the filter evaluates such nodes fully).
//! `--apf` (issue 29, APF): the components authenticate as service accounts and
//! `system:kube-scheduler` instead of `system:masters` (bound to `cluster-admin`), so API
//! Priority and Fairness classifies their requests, with the chart's FlowSchemas installed; the
//! rows add each variant's requests and mean wait for a seat per priority level, and the
//! requests refused. The benchmark's own client (the creates, the gate lifts) stays exempt.
//!
//! `--gated` (issue 29, T3): every run's pods are created behind a scheduling gate, and once all
//! exist the gates are lifted (one PATCH per pod, the same 32 clients), so the placement rate is
//! pods / (last bound − first lift) and latency runs from each pod's lift: placement without the
//! creation competing for the cores. CPU per placed pod still counts the creates and the lifts
//! (the same for every variant).
//!
//! (d) and (d') (issue 29, T3 through DRA): the same 4000 MiB / 10 % shares through Tessera's
//! DRA path with no extender: each pod names its own ResourceClaim (created by the bench before
//! the pod, as the resourceclaim controller would from a template; no kube-controller-manager
//! runs here) of the chart's DeviceClass, and (a)'s or (a')'s plain kube-scheduler allocates it
//! on a third set of bare nodes (d), each with the ResourceSlice Tessera's DRA plugin publishes
//! for 8 × A100 with consumable capacity (its own builder and publisher; the API server and every
//! kube-scheduler run with `DRAConsumableCapacity`). Compared with (a) and (a'); the claims'
//! writes are counted beside the pods'. After a run the bench deletes the claims and removes the
//! finalizer kube-scheduler put on them.
//!
//! With (p') among the variants, first the admission alone (issue 29, T1/T2): `--admission N`
//! (default 1,000; quick 200; 0 skips it) dry-run creates per round of a plain pod, of a GPU pod
//! through the webhook and of the same GPU pod through the policies, rounds interleaved; CPU per
//! admitted pod by process and create latency, each GPU path against the plain pod and the
//! policies against the webhook ([`admission_cost`]).
#![allow(
    clippy::disallowed_types,
    reason = "the e2e harness times real processes and clusters: wall-clock std::time::Instant"
)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use hami_contract::annotations as ann;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim};
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::json;
use tessera_e2e::cluster::{
    Cluster, ClusterOptions, DEVICE_PLUGIN_USER, KUBE_SCHEDULER_USER, SCHEDULER_USER,
    policy_namespace,
};
use tessera_e2e::node::NodeSpec;

use results::{Csv, Row, Stats};
use tessera_bench_results as results;

const A100: &str = "NVIDIA A100-SXM4-40GB";
const A100_MIB: u64 = 40960;
const SET: &str = "tessera.io/bench-set";
const RUN: &str = "tessera.io/bench-run";
const CREATORS: usize = 32;

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

#[derive(Debug, Clone)]
struct Params {
    nodes: usize,
    pods: usize,
    rounds: usize,
    burst: usize,
    burst_rounds: usize,
    /// Pods already running on each node set before the runs (bound, booked), spread evenly.
    running: usize,
    /// The variants to run (`--variants plain,tessera,…`, by [`Variant::short`]); all by default.
    variants: Vec<Variant>,
    /// `--gated`: pods created behind a scheduling gate, lifted once all exist (module docs).
    gated: bool,
    /// `--admission N`: dry-run creates per admission path and round ([`admission_cost`]), when
    /// the policy variant runs; 0: none.
    admission: usize,
    /// `--signature-identity`: the Tessera node set registered as the device plugin registers a
    /// node whose kubelet has no pod-resources socket (the bind rule then applies there); by
    /// default as on the harness's 1.34 kubelet with the chart's pod-resources mount.
    signature_identity: bool,
    /// `--apf`: the components outside `system:masters`, their requests classified by API
    /// Priority and Fairness under the chart's FlowSchemas ([`ClusterOptions::apf`]); the
    /// benchmark's own client stays exempt.
    apf: bool,
}

fn params() -> Params {
    let quick = results::quick();
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str, default: usize| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    Params {
        nodes: arg("--nodes", if quick { 50 } else { 500 }),
        pods: arg("--pods", if quick { 200 } else { 2000 }),
        rounds: arg("--rounds", if quick { 1 } else { 3 }),
        burst: arg("--burst", if quick { 24 } else { 100 }),
        burst_rounds: arg("--burst-rounds", if quick { 1 } else { 3 }),
        running: arg("--running", 0),
        variants: variants_arg(&args),
        gated: args.iter().any(|a| a == "--gated"),
        admission: arg("--admission", if quick { 200 } else { 1000 }),
        signature_identity: args.iter().any(|a| a == "--signature-identity"),
        apf: args.iter().any(|a| a == "--apf"),
    }
}

/// `--variants a,b,…` by short name, in [`Variant::ALL`]'s order; every variant without it. An
/// unknown name is reported and ends the run before a cluster is started.
fn variants_arg(args: &[String]) -> Vec<Variant> {
    let Some(list) = args
        .iter()
        .position(|a| a == "--variants")
        .and_then(|i| args.get(i + 1))
    else {
        return Variant::ALL.to_vec();
    };
    let wanted: Vec<&str> = list.split(',').map(str::trim).collect();
    if let Some(bad) = wanted
        .iter()
        .find(|w| !Variant::ALL.iter().any(|v| v.short() == **w))
    {
        let known: Vec<&str> = Variant::ALL.iter().map(|v| v.short()).collect();
        eprintln!(
            "scheduling bench: unknown variant {bad:?}; known: {}",
            known.join(", ")
        );
        std::process::exit(2);
    }
    Variant::ALL
        .into_iter()
        .filter(|v| wanted.contains(&v.short()))
        .collect()
}

async fn client_for(path: &std::path::Path) -> Res<kube::Client> {
    let kc = kube::config::Kubeconfig::read_from(path)?;
    let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?;
    Ok(kube::Client::try_from(cfg)?)
}

/// The scheduling gate of `--gated` runs.
const HOLD: &str = "bench.tessera.dev/hold";

fn pod_object(ns: &str, name: &str, run: &str, v: Variant, gated: bool) -> Pod {
    let mut labels = json!({ RUN: run });
    let resources = if v.tessera() {
        json!({"limits": {"cpu": "10m", "nvidia.com/gpu": "1", "nvidia.com/gpumem": "4000",
                          "nvidia.com/gpucores": "10"}})
    } else if v.dra() {
        // No `nvidia.com/` resource: the webhook's match condition skips the pod.
        json!({"limits": {"cpu": "10m"}, "claims": [{"name": "gpu"}]})
    } else {
        // The webhook would otherwise hand the GPU pod to Tessera.
        labels["hami.io/webhook"] = json!("ignore");
        json!({"limits": {"cpu": "10m", "nvidia.com/gpu": "1"}})
    };
    let mut spec = json!({
        "containers": [{"name": "c0", "image": "registry.example/cuda-app:1",
                        "resources": resources}],
        "nodeSelector": { SET: v.node_set() },
        "terminationGracePeriodSeconds": 0,
    });
    if v.dra() {
        spec["resourceClaims"] = json!([{"name": "gpu", "resourceClaimName": name}]);
    }
    let pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": spec,
    }));
    let mut pod: Pod = pod.unwrap_or_default();
    if let Some(spec) = pod.spec.as_mut() {
        if let Some(name) = v.scheduler_name() {
            spec.scheduler_name = Some(name.to_owned());
        }
        if gated {
            spec.scheduling_gates = Some(vec![k8s_openapi::api::core::v1::PodSchedulingGate {
                name: HOLD.to_owned(),
            }]);
        }
    }
    pod
}

/// The ResourceClaim of the DRA variants' pod `name` (its own claim, named after it): one share
/// of a GPU the size of the Tessera variants' (4000 MiB, 10 % of the cores), of the chart's
/// DeviceClass. In a cluster the resourceclaim controller creates it from the pod's template;
/// here no kube-controller-manager runs, so the bench creates it before the pod.
fn claim_object(ns: &str, name: &str, run: &str) -> Res<ResourceClaim> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": ns, "labels": { RUN: run }},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": DEVICE_CLASS,
            "capacity": {"requests": {"memory": "4000Mi", "cores": "10"}},
        }}]}},
    }))?)
}

/// The chart's DeviceClass (`dra.deviceClassName`'s default; `templates/dra/deviceclass.yaml`).
const DEVICE_CLASS: &str = "gpu.tessera.dev";

/// The second plain kube-scheduler's profile: client QPS raised from the default 50 (burst
/// 100), which caps a plain kube-scheduler's Binding calls, to 1000.
const UNTHROTTLED: &str = "plain-unthrottled";

/// Who places the pods of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Variant {
    /// (a) kube-scheduler alone, default configuration.
    Plain,
    /// (a') kube-scheduler alone with `clientConnection.qps: 1000`.
    PlainUnthrottled,
    /// (b) kube-scheduler + Tessera (the chart's configuration).
    Tessera,
    /// (b') kube-scheduler with `clientConnection.qps: 1000` + the same Tessera extender.
    TesseraUnthrottled,
    /// (h) the chart's kube-scheduler configuration + a second Tessera extender in HAMi's write
    /// order (`--write-decision-at-filter --pod-events all`).
    TesseraHamiOrder,
    /// (p') as (b'), but the pods are mutated by the chart's `admissionPolicy.podMutation`
    /// policies inside the API server instead of the webhook (issue 29, T1/T2): they name no
    /// scheduler and the policy hands them to (b')'s profile.
    TesseraPolicy,
    /// (d) kube-scheduler alone, default configuration, each pod with its own ResourceClaim for a
    /// share of a GPU of Tessera's DRA driver (consumable capacity), no extender (issue 29's T3
    /// through DRA).
    Dra,
    /// (d') as (d), placed by (a')'s kube-scheduler (`clientConnection.qps: 1000`).
    DraUnthrottled,
}

impl Variant {
    /// Every variant, in the order a round runs them.
    const ALL: [Variant; 8] = [
        Variant::Plain,
        Variant::Tessera,
        Variant::Dra,
        Variant::PlainUnthrottled,
        Variant::TesseraUnthrottled,
        Variant::TesseraPolicy,
        Variant::DraUnthrottled,
        Variant::TesseraHamiOrder,
    ];

    fn node_set(self) -> &'static str {
        match self {
            Variant::Plain | Variant::PlainUnthrottled => "a",
            Variant::Dra | Variant::DraUnthrottled => "d",
            _ => "b",
        }
    }
    fn short(self) -> &'static str {
        match self {
            Variant::Plain => "plain",
            Variant::PlainUnthrottled => "plain-qps1000",
            Variant::Tessera => "tessera",
            Variant::TesseraUnthrottled => "tessera-qps1000",
            Variant::TesseraHamiOrder => "tessera-hami-order",
            Variant::TesseraPolicy => "tessera-policy-qps1000",
            Variant::Dra => "dra",
            Variant::DraUnthrottled => "dra-qps1000",
        }
    }
    fn tessera(self) -> bool {
        self.node_set() == "b"
    }
    /// Each pod has its own ResourceClaim, placed by a plain kube-scheduler on set d.
    fn dra(self) -> bool {
        self.node_set() == "d"
    }
    /// The pods are admitted by the pod-mutation policies (their namespace is labeled for them).
    fn policy(self) -> bool {
        self == Variant::TesseraPolicy
    }
    /// The profile that places this variant's pods (`None`: the webhook's or the default).
    fn scheduler_name(self) -> Option<&'static str> {
        match self {
            Variant::PlainUnthrottled | Variant::DraUnthrottled => Some(UNTHROTTLED),
            Variant::TesseraUnthrottled => Some(TESSERA_UNTHROTTLED),
            Variant::TesseraHamiOrder => Some(TESSERA_HAMI_ORDER),
            Variant::Plain | Variant::Tessera | Variant::TesseraPolicy | Variant::Dra => None,
        }
    }
    fn label(self) -> &'static str {
        match self {
            Variant::Plain => "(a) kube-scheduler alone",
            Variant::PlainUnthrottled => "(a') kube-scheduler alone  QPS 1000",
            Variant::Tessera => "(b) kube-scheduler + Tessera",
            Variant::TesseraUnthrottled => "(b') kube-scheduler QPS 1000 + Tessera",
            Variant::TesseraHamiOrder => "(h) kube-scheduler + Tessera in HAMi's write order",
            Variant::TesseraPolicy => {
                "(p') kube-scheduler QPS 1000 + Tessera via admission policies (no webhook)"
            }
            Variant::Dra => "(d) kube-scheduler alone + DRA  a ResourceClaim per pod",
            Variant::DraUnthrottled => {
                "(d') kube-scheduler alone  QPS 1000 + DRA  a ResourceClaim per pod"
            }
        }
    }
}

/// kube-scheduler profiles of the extra Tessera schedulers (pods naming a scheduler other than
/// the webhook's are left to it by the webhook).
const TESSERA_UNTHROTTLED: &str = "hami-scheduler-qps1000";
const TESSERA_HAMI_ORDER: &str = "hami-scheduler-hami-order";

/// A kube-scheduler with the chart's configuration (extender, mutual TLS), profile `profile`,
/// calling the extender on `extender_port`; `qps`: `clientConnection.qps` (burst twice that).
fn spawn_tessera_kube_scheduler(
    c: &Cluster,
    profile: &str,
    extender_port: u16,
    qps: Option<u32>,
) -> Res<tessera_e2e::process::Proc> {
    let text = tessera_e2e::cluster::scheduler_config(
        &c.artifacts.root,
        "kube-scheduler-config.yaml",
        &c.kubeconfig(KUBE_SCHEDULER_USER),
        extender_port,
        &c.dir,
    )?;
    let mut cfg: yaml_serde::Value = yaml_serde::from_str(&text)?;
    if let Some(q) = qps {
        cfg["clientConnection"]["qps"] = q.into();
        cfg["clientConnection"]["burst"] = (2 * q).into();
    }
    cfg["leaderElection"] = yaml_serde::to_value(json!({"leaderElect": false}))?;
    cfg["profiles"][0]["schedulerName"] = profile.into();
    let path = c.dir.join(format!("{profile}.yaml"));
    std::fs::write(&path, yaml_serde::to_string(&cfg)?)?;
    spawn_kube_scheduler(c, &path, &format!("{profile}-kube-scheduler"))
}

/// kube-scheduler with the configuration file `config`, serving on a free loopback port.
fn spawn_kube_scheduler(
    c: &Cluster,
    config: &std::path::Path,
    name: &str,
) -> Res<tessera_e2e::process::Proc> {
    let mut cmd = std::process::Command::new(&c.artifacts.kube_scheduler);
    cmd.arg(format!("--config={}", config.display()))
        .arg("--bind-address=127.0.0.1")
        .arg(format!(
            "--secure-port={}",
            tessera_e2e::process::free_port()
        ))
        .arg("--v=1")
        .args(c.kube_scheduler_gates());
    Ok(tessera_e2e::process::Proc::spawn(
        name,
        &c.dir.join("logs"),
        &mut cmd,
    )?)
}

/// A second tessera-scheduler in HAMi's write order, not leader-elected; returns it with its
/// extender and metrics ports.
fn spawn_hami_order_extender(c: &Cluster) -> Res<(tessera_e2e::process::Proc, u16, u16)> {
    let [port, metrics] = tessera_e2e::process::free_ports();
    let mut cmd = c.tessera_command(port, metrics);
    cmd.arg("--leader-elect=false")
        .arg("--write-decision-at-filter=true")
        .arg("--pod-events=all");
    let proc =
        tessera_e2e::process::Proc::spawn("tessera-hami-order", &c.dir.join("logs"), &mut cmd)?;
    Ok((proc, port, metrics))
}

/// A plain kube-scheduler with profile [`UNTHROTTLED`] and client QPS 1000 (burst 2000).
fn spawn_unthrottled_kube_scheduler(c: &Cluster) -> Res<tessera_e2e::process::Proc> {
    let config = c.dir.join("plain-unthrottled.yaml");
    let doc = json!({
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "clientConnection": {"kubeconfig": c.kubeconfig(KUBE_SCHEDULER_USER),
                             "qps": 1000, "burst": 2000},
        "leaderElection": {"leaderElect": false},
        "profiles": [{"schedulerName": UNTHROTTLED}],
    });
    std::fs::write(&config, serde_json::to_string(&doc)?)?;
    spawn_kube_scheduler(c, &config, "plain-unthrottled-kube-scheduler")
}

/// A create's result with "already exists" (409) counted as done: the runs' namespaces, pods and
/// claims, and the DeviceClass, may be left from an earlier run or a retried request.
fn created<T>(r: Result<T, kube::Error>) -> Result<(), kube::Error> {
    match r {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(e) => Err(e),
    }
}

/// `policy`: labeled so that the pod-mutation policies, not the webhook, admit its pods.
async fn ensure_namespace(admin: &kube::Client, ns: &str, policy: bool) -> Res<()> {
    let obj: Namespace = if policy {
        policy_namespace(ns)
    } else {
        serde_json::from_value(json!({"metadata": {"name": ns}}))?
    };
    Ok(created(
        Api::<Namespace>::all(admin.clone())
            .create(&PostParams::default(), &obj)
            .await,
    )?)
}

/// What one run observed, per pod name.
#[derive(Debug, Default)]
struct Seen {
    created: HashMap<String, Instant>,
    bound: HashMap<String, Instant>,
    /// When `hami.io/bind-phase: success` (the device plugin's answer) was first seen.
    allocated: HashMap<String, Instant>,
}

/// Watches the run's pods: records when each is first seen bound; with `plugin`, marks pods
/// bound with `bind-phase: allocating` as allocated (the device plugin's patch).
fn spawn_watch(
    admin: kube::Client,
    plugin: Option<kube::Client>,
    ns: String,
    run: String,
    seen: Arc<Mutex<Seen>>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let api: Api<Pod> = Api::namespaced(admin, &ns);
        let cfg = watcher::Config::default().labels(&format!("{RUN}={run}"));
        let mut stream = watcher(api, cfg).default_backoff().boxed();
        let mut patched: std::collections::HashSet<String> = Default::default();
        while let Ok(Some(ev)) = stream.try_next().await {
            let pods = match ev {
                watcher::Event::Apply(p) | watcher::Event::InitApply(p) => vec![p],
                _ => continue,
            };
            let now = Instant::now();
            for p in pods {
                let name = p.metadata.name.clone().unwrap_or_default();
                if tessera_e2e::pods::node_of(&p).is_none() {
                    continue;
                }
                let phase = tessera_e2e::pods::annotation(&p, "hami.io/bind-phase");
                if let Ok(mut s) = seen.lock() {
                    s.bound.entry(name.clone()).or_insert(now);
                    if phase == Some("success") {
                        s.allocated.entry(name.clone()).or_insert(now);
                    }
                }
                let allocating =
                    tessera_e2e::pods::annotation(&p, "hami.io/bind-phase") == Some("allocating");
                if let Some(c) = &plugin
                    && allocating
                    && patched.insert(name.clone())
                {
                    let api: Api<Pod> = Api::namespaced(c.clone(), &ns);
                    tokio::spawn(async move {
                        let patch = json!({"metadata": {"annotations": {
                            "hami.io/bind-phase": "success",
                            "hami.io/vgpu-devices-to-allocate": ";"}}});
                        let _ = api
                            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                            .await;
                    });
                }
            }
        }
    })
}

/// Writes every pod of `items` (its name, what to write) with [`CREATORS`] concurrent clients,
/// recording when each pod's write started as its start (`seen.created`). A failed write (a
/// webhook timeout under load) is retried, as a controller would, up to five times; returns how
/// many succeeded. `what` names the write in the log.
async fn write_all<T>(
    what: &str,
    items: Vec<(String, T)>,
    seen: &Arc<Mutex<Seen>>,
    write: impl AsyncFn(&str, &T) -> Result<(), kube::Error>,
) -> usize {
    let write = &write;
    futures::stream::iter(items)
        .map(|(name, item)| {
            let seen = seen.clone();
            async move {
                if let Ok(mut s) = seen.lock() {
                    s.created.insert(name.clone(), Instant::now());
                }
                for _ in 0..5 {
                    match write(&name, &item).await {
                        Ok(()) => return true,
                        Err(e) => {
                            eprintln!("{what} {name}: {e}; retrying");
                            tokio::time::sleep(Duration::from_millis(200)).await;
                        }
                    }
                }
                false
            }
        })
        .buffer_unordered(CREATORS)
        .filter(|ok| futures::future::ready(*ok))
        .count()
        .await
}

/// Creates `objects` ([`write_all`]); a pod that already exists counts as created.
async fn create_all(
    user: &kube::Client,
    ns: &str,
    objects: Vec<Pod>,
    seen: &Arc<Mutex<Seen>>,
) -> usize {
    let api: Api<Pod> = Api::namespaced(user.clone(), ns);
    let items = objects
        .into_iter()
        .map(|pod| (pod.metadata.name.clone().unwrap_or_default(), pod))
        .collect();
    write_all("create", items, seen, async |_, pod: &Pod| {
        created(api.create(&PostParams::default(), pod).await)
    })
    .await
}

/// Lifts the scheduling gate of every pod in `names` ([`write_all`]: each lift is the pod's
/// start). Returns how many were lifted.
async fn lift_all(
    user: &kube::Client,
    ns: &str,
    names: Vec<String>,
    seen: &Arc<Mutex<Seen>>,
) -> usize {
    let api: Api<Pod> = Api::namespaced(user.clone(), ns);
    // The pod has only the bench's gate: remove the list.
    let lift = json!({"spec": {"schedulingGates": null}});
    let items = names.into_iter().map(|name| (name, ())).collect();
    write_all("lift the gate of", items, seen, async |name, ()| {
        api.patch(name, &PatchParams::default(), &Patch::Merge(&lift))
            .await
            .map(drop)
    })
    .await
}

/// Deletes every pod of `ns` (no kubelet: grace period 0) and waits until they are gone.
///
/// One DeleteCollection of 20,000 pods can outlive the API server's 60 s request timeout, which
/// ends the request with a broken connection (the first full-size run failed there, `client
/// error (SendRequest)`): a failed call is logged and issued again until the namespace is empty.
async fn delete_all(admin: &kube::Client, ns: &str) -> Res<()> {
    let api: Api<Pod> = Api::namespaced(admin.clone(), ns);
    let dp = DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    let deadline = Instant::now() + Duration::from_secs(900);
    let mut next_delete = Instant::now();
    while Instant::now() < deadline {
        if Instant::now() >= next_delete {
            if let Err(e) = api.delete_collection(&dp, &ListParams::default()).await {
                eprintln!("delete the pods of {ns}: {e}; retrying");
            }
            next_delete = Instant::now() + Duration::from_secs(15);
        }
        match api.list(&ListParams::default().limit(1)).await {
            Ok(l) if l.items.is_empty() => return Ok(()),
            Ok(_) => {}
            Err(e) => eprintln!("list the pods of {ns}: {e}; retrying"),
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    Err(format!("the pods of {ns} not gone after 900 s").into())
}

/// Deletes every ResourceClaim of `ns` once its pods are gone, and waits until they are. No
/// kube-controller-manager runs here, so nothing removes the finalizer kube-scheduler puts on a
/// claim it allocates: the bench removes it, which frees the claim's share in kube-scheduler's
/// view for the next run.
async fn delete_claims(admin: &kube::Client, ns: &str) -> Res<()> {
    let api: Api<ResourceClaim> = Api::namespaced(admin.clone(), ns);
    let unfinalize = json!({"metadata": {"finalizers": null}});
    let deadline = Instant::now() + Duration::from_secs(900);
    while Instant::now() < deadline {
        if let Err(e) = api
            .delete_collection(&DeleteParams::default(), &ListParams::default())
            .await
        {
            eprintln!("delete the claims of {ns}: {e}; retrying");
        }
        let left = match api.list(&ListParams::default()).await {
            Ok(l) => l.items,
            Err(e) => {
                eprintln!("list the claims of {ns}: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(300)).await;
                continue;
            }
        };
        if left.is_empty() {
            return Ok(());
        }
        futures::stream::iter(left)
            .filter_map(|claim| futures::future::ready(claim.metadata.name))
            .for_each_concurrent(CREATORS, |name| {
                let api = api.clone();
                let unfinalize = &unfinalize;
                async move {
                    if let Err(e) = api
                        .patch(&name, &PatchParams::default(), &Patch::Merge(unfinalize))
                        .await
                    {
                        eprintln!("remove the finalizer of claim {name}: {e}");
                    }
                }
            })
            .await;
    }
    Err(format!("the claims of {ns} not gone after 900 s").into())
}

/// One placement run's figures.
#[derive(Debug, Clone)]
struct RunResult {
    placed: usize,
    wanted: usize,
    pods_per_s: f64,
    /// CPU seconds per component during the run (creates to last bind).
    cpu: BTreeMap<String, f64>,
    /// Mean time in each of [`HANDLER_PARTS`], ms (Tessera runs only).
    handler_ms: [f64; HANDLER_PARTS.len()],
    /// The API server's own mean time per Binding POST during the run, ms (every variant: the
    /// plain kube-scheduler's Bindings and the extender's alike).
    binding_ms: f64,
    /// The p99 of the same, from its histogram ([`histogram_quantile_ms`]).
    binding_p99_ms: f64,
    /// T2, per placed pod: writes of pods (every client: the creates, gate lifts, Bindings, the
    /// plugin's record, kube-scheduler's status updates), and calls of the webhook.
    pod_writes: f64,
    /// T2 of the DRA variants: writes of ResourceClaims and their status (the creates,
    /// kube-scheduler's allocation), per placed pod.
    claim_writes: f64,
    webhook_calls: f64,
    /// `--apf`: each priority level's counters over the run ([`ApfLevel`]), and the requests
    /// refused per placed pod.
    apf_levels: BTreeMap<String, ApfLevel>,
    apf_rejected: f64,
    create_s: f64,
    latencies_ms: Vec<f64>,
}

/// What one placement run places, and how.
#[derive(Debug, Clone, Copy)]
struct RunSpec {
    v: Variant,
    pods: usize,
    /// Created behind a scheduling gate, lifted once all exist.
    gated: bool,
}

#[allow(clippy::too_many_arguments)]
async fn placement_run(
    c: &Cluster,
    plugin: &kube::Client,
    ns: &str,
    run: &str,
    spec: RunSpec,
    within: Duration,
    metrics_port: u16,
) -> Res<RunResult> {
    let RunSpec { v, pods, gated } = spec;
    let tessera = v.tessera();
    ensure_namespace(c.admin(), ns, v.policy()).await?;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let watch = spawn_watch(
        c.admin().clone(),
        tessera.then(|| plugin.clone()),
        ns.to_owned(),
        run.to_owned(),
        seen.clone(),
    );
    // Let the watch start before the first create.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let objects: Vec<Pod> = (0..pods)
        .map(|i| pod_object(ns, &format!("p-{i:05}"), run, v, gated))
        .collect();
    let names: Vec<String> = objects
        .iter()
        .filter_map(|p| p.metadata.name.clone())
        .collect();
    let cpu_before = cpu_by_component(&c.dir);
    let handlers_before = handler_seconds(metrics_port).await;
    let api_before = ApiCounts::read(c.admin()).await;
    let perf = start_perf(run);
    let pprof = start_apiserver_pprof(c.admin().clone(), run);
    if v.dra() {
        // Each pod's own claim, before the pods (their CPU counted, as the resourceclaim
        // controller's creates would be); their start times are not the pods'.
        let claims: Api<ResourceClaim> = Api::namespaced(c.user().clone(), ns);
        let items = names
            .iter()
            .map(|name| Ok((name.clone(), claim_object(ns, name, run)?)))
            .collect::<Res<Vec<_>>>()?;
        let made = write_all(
            "create the claim of",
            items,
            &Arc::default(),
            async |_, claim: &ResourceClaim| {
                created(claims.create(&PostParams::default(), claim).await)
            },
        )
        .await;
        if made < pods {
            return Err(format!("{run}: only {made} of {pods} ResourceClaims created").into());
        }
    }
    let t0 = Instant::now();
    let mut created = create_all(c.user(), ns, objects, &seen).await;
    let create_s = t0.elapsed().as_secs_f64();
    if gated {
        created = lift_all(c.user(), ns, names, &seen).await;
    }
    let deadline = Instant::now() + within;
    loop {
        let bound = seen.lock().map(|s| s.bound.len()).unwrap_or(0);
        if bound >= created || Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let cpu = cpu_diff(&cpu_by_component(&c.dir), &cpu_before);
    stop_perf(perf);
    if let Some(t) = pprof {
        let _ = t.await;
    }
    let handlers = handler_seconds(metrics_port).await;
    let api = ApiCounts::read(c.admin()).await;
    let binding_ms = mean_ms(
        api.binding_seconds - api_before.binding_seconds,
        api.bindings - api_before.bindings,
    );
    let handler_ms = std::array::from_fn(|i| {
        mean_ms(
            handlers[i].0 - handlers_before[i].0,
            handlers[i].1 - handlers_before[i].1,
        )
    });
    watch.abort();
    let s = seen.lock().map_err(|_| "poisoned")?;
    let first = s.created.values().min().copied().unwrap_or(t0);
    let last = s.bound.values().max().copied().unwrap_or(first);
    let latencies_ms: Vec<f64> = s
        .bound
        .iter()
        .filter_map(|(n, b)| {
            s.created
                .get(n)
                .map(|c| b.saturating_duration_since(*c).as_secs_f64() * 1e3)
        })
        .collect();
    let placed = s.bound.len();
    let per_pod = |n: f64| n / placed.max(1) as f64;
    let span = last.saturating_duration_since(first).as_secs_f64();
    Ok(RunResult {
        placed,
        wanted: pods,
        pods_per_s: if span > 0.0 {
            placed as f64 / span
        } else {
            0.0
        },
        cpu,
        handler_ms,
        binding_ms,
        binding_p99_ms: histogram_quantile_ms(
            0.99,
            &api_before.binding_buckets,
            &api.binding_buckets,
        ),
        pod_writes: per_pod(api.pod_writes - api_before.pod_writes),
        claim_writes: per_pod(api.claim_writes - api_before.claim_writes),
        webhook_calls: per_pod(api.webhook_calls - api_before.webhook_calls),
        apf_levels: api
            .apf_levels
            .iter()
            .map(|(name, l)| {
                let before = api_before.apf_levels.get(name).copied().unwrap_or_default();
                (name.clone(), l.since(before))
            })
            .collect(),
        apf_rejected: per_pod(api.apf_rejected - api_before.apf_rejected),
        create_s,
        latencies_ms,
    })
}

/// `seconds / count` in ms; 0 without any.
fn mean_ms(seconds: f64, count: f64) -> f64 {
    if count > 0.0 {
        seconds * 1e3 / count
    } else {
        0.0
    }
}

/// With `TESSERA_BENCH_PERF_DIR` set: a system-wide `perf record` (99 Hz, call graphs) of the
/// run, written to `<dir>/perf-<run>.data` (`perf report --sort comm,dso,sym` reads it).
fn start_perf(run: &str) -> Option<std::process::Child> {
    let dir = std::env::var_os("TESSERA_BENCH_PERF_DIR")?;
    let out = std::path::Path::new(&dir).join(format!("perf-{run}.data"));
    std::process::Command::new("perf")
        .args(["record", "-a", "-g", "-F", "99", "-o"])
        .arg(out)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| eprintln!("perf record: {e}"))
        .ok()
}

/// With `TESSERA_BENCH_PERF_DIR` set: kube-apiserver's own CPU profile (Go pprof, 20 s from the
/// first create; its binary is stripped, so perf cannot name its functions), written to
/// `<dir>/apiserver-<run>.pprof` (`go tool pprof -top` reads it).
fn start_apiserver_pprof(admin: kube::Client, run: &str) -> Option<tokio::task::JoinHandle<()>> {
    let dir = std::env::var_os("TESSERA_BENCH_PERF_DIR")?;
    let out = std::path::Path::new(&dir).join(format!("apiserver-{run}.pprof"));
    Some(tokio::spawn(async move {
        let req = http::Request::get("/debug/pprof/profile?seconds=20")
            .body(Vec::new())
            .expect("request");
        let profile = async {
            use futures::AsyncReadExt;
            let mut body = Box::pin(admin.request_stream(req).await?);
            let mut buf = Vec::new();
            body.read_to_end(&mut buf).await?;
            std::fs::write(&out, buf)?;
            Res::Ok(())
        };
        if let Err(e) = profile.await {
            eprintln!("apiserver pprof: {e}");
        }
    }))
}

fn stop_perf(perf: Option<std::process::Child>) {
    if let Some(mut child) = perf {
        let _ = std::process::Command::new("kill")
            .args(["-INT", &child.id().to_string()])
            .status();
        let _ = child.wait();
    }
}

/// What a node set offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SetKind {
    /// Plain extended resources (`nvidia.com/gpu: 8`), no register annotation.
    Plain,
    /// 8 × A100 registered as Tessera's device plugin registers them.
    Tessera,
    /// No GPU resources and no register annotation; the ResourceSlice Tessera's DRA plugin
    /// publishes for 8 × A100 (consumable capacity), and the chart's DeviceClass.
    Dra,
}

/// Registers `n` bare nodes of one set ([`SetKind`]).
async fn register_set(
    admin: &kube::Client,
    set: &str,
    n: usize,
    kind: SetKind,
    running_per_node: usize,
    identity: &str,
) -> Res<()> {
    if kind == SetKind::Dra {
        create_device_class(admin).await?;
    }
    let nodes: Api<Node> = Api::all(admin.clone());
    let results: Vec<Res<()>> = futures::stream::iter(0..n)
        .map(|i| {
            let admin = admin.clone();
            let nodes = nodes.clone();
            async move {
                let name = format!("{set}-node-{i:04}");
                let spec = NodeSpec::uniform(&name, 8, A100, A100_MIB);
                tessera_e2e::node::register_bare_node(&admin, &spec)
                    .await
                    .map_err(|e| format!("{name}: {e}"))?;
                let mut meta = json!({"labels": { SET: set }});
                meta["annotations"] = if kind == SetKind::Tessera {
                    let mut a = serde_json::Map::new();
                    a.insert(ann::ALLOCATION_IDENTITY.to_owned(), identity.into());
                    a.into()
                } else {
                    json!({"hami.io/node-nvidia-register": null})
                };
                nodes
                    .patch(
                        &name,
                        &PatchParams::default(),
                        &Patch::Merge(&json!({ "metadata": meta })),
                    )
                    .await?;
                if kind == SetKind::Dra {
                    publish_slice(&admin, &spec).await?;
                }
                if kind == SetKind::Plain {
                    let gpus = json!({"nvidia.com/gpu": (8 + running_per_node).to_string()});
                    nodes
                        .patch_status(
                            &name,
                            &PatchParams::default(),
                            &Patch::Merge(
                                &json!({"status": {"capacity": gpus, "allocatable": gpus}}),
                            ),
                        )
                        .await?;
                }
                Ok(())
            }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    for r in results {
        r?;
    }
    Ok(())
}

/// The chart's DeviceClass: every device of driver `gpu.tessera.dev`.
async fn create_device_class(admin: &kube::Client) -> Res<()> {
    let class: DeviceClass = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
        "metadata": {"name": DEVICE_CLASS},
        "spec": {"selectors": [{"cel": {
            "expression": format!("device.driver == \"{}\"", tessera_dra_plugin::DRIVER)}}]},
    }))?;
    Ok(created(
        Api::<DeviceClass>::all(admin.clone())
            .create(&PostParams::default(), &class)
            .await,
    )?)
}

/// Publishes the ResourceSlice of bare node `spec` with the DRA plugin's own builder and
/// publisher, as shares of its GPUs; fails when the API server drops the consumable-capacity
/// fields (its `DRAConsumableCapacity` gate is off), which would make every claim take a whole GPU.
async fn publish_slice(admin: &kube::Client, spec: &NodeSpec) -> Res<()> {
    use tessera_dra_plugin::publish::{ConsumableMode, SlicePublisher};
    use tessera_dra_plugin::slice::{GpuFacts, Sharing, slice_devices};
    let gpus: Vec<(tessera_node::gpu::GpuInfo, GpuFacts)> = spec
        .gpus
        .iter()
        .zip(0u32..)
        .map(|(g, index)| {
            let gpu = tessera_node::gpu::GpuInfo {
                uuid: g.uuid.clone(),
                index,
                name: g.model.clone(),
                memory_total_mib: u32::try_from(g.memory_mib).ok(),
                pci_bus_id: format!("00000000:{:02X}:00.0", 0x10 + index),
                numa_node: None,
                mig_enabled: false,
                mig: None,
            };
            (gpu, GpuFacts::default())
        })
        .collect();
    let mut publisher = SlicePublisher::new(admin.clone(), spec.name.clone(), ConsumableMode::Auto);
    publisher
        .sync(&|sharing| slice_devices(&gpus, Some("550.54.15"), &|_| true, sharing).0)
        .await?;
    if publisher.sharing() != Sharing::Consumable {
        return Err(format!(
            "{}: the API server dropped the slice's consumable-capacity fields \
             (DRAConsumableCapacity off): claims would take whole GPUs",
            spec.name
        )
        .into());
    }
    Ok(())
}

/// `running` pods on each node set, `running / nodes` per node, created bound (as pods that
/// were placed earlier): on set b booked as Tessera books them (one GPU, 4000 MiB, 10 %,
/// `bind-phase: success`), on set a asking `nvidia.com/gpu: 1`. The webhook is skipped (label),
/// as for pods created before Tessera was installed. `client`: the scheduler's identity.
async fn create_running(client: &kube::Client, nodes: usize, running: usize) -> Res<()> {
    let ns = "bench-running";
    ensure_namespace(client, ns, false).await?;
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let objects = (0..running).flat_map(|i| {
        let node = i % nodes.max(1);
        let slot = i / nodes.max(1);
        ["a", "b"].map(|set| {
            let name = format!("{set}-node-{node:04}");
            let mut limits = json!({"cpu": "10m", "nvidia.com/gpu": "1"});
            let mut annotations = json!({});
            if set == "b" {
                let spec = NodeSpec::uniform(&name, 8, A100, A100_MIB);
                let uuid = &spec.gpus[slot % spec.gpus.len()].uuid;
                limits["nvidia.com/gpumem"] = json!("4000");
                limits["nvidia.com/gpucores"] = json!("10");
                let devices = format!("{uuid},NVIDIA,4000,10:;");
                annotations = json!({
                    "hami.io/vgpu-node": name,
                    "hami.io/vgpu-devices-allocated": devices,
                    "hami.io/vgpu-devices-to-allocate": ";",
                    "hami.io/bind-phase": "success",
                });
            }
            json!({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": format!("r-{set}-{i:06}"), "namespace": ns,
                             "labels": {"hami.io/webhook": "ignore"}, "annotations": annotations},
                "spec": {"nodeName": name, "terminationGracePeriodSeconds": 0,
                         "containers": [{"name": "c0", "image": "registry.example/cuda-app:1",
                                         "resources": {"limits": limits}}]},
            })
        })
    });
    let failed = futures::stream::iter(objects)
        .map(|obj| {
            let api = api.clone();
            async move {
                let pod: Pod = serde_json::from_value(obj).ok()?;
                for _ in 0..5 {
                    match api.create(&PostParams::default(), &pod).await {
                        Ok(_) => return None,
                        Err(kube::Error::Api(s)) if s.code == 409 => return None,
                        Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                    }
                }
                pod.metadata.name
            }
        })
        .buffer_unordered(64)
        .filter_map(futures::future::ready)
        .count()
        .await;
    if failed > 0 {
        return Err(format!("{failed} running pods could not be created").into());
    }
    Ok(())
}

/// Restarts the leading tessera-scheduler and measures how long until it serves again: the whole
/// change (process start, Lease, List of every node and pod, rebuild) from outside, and the
/// List + rebuild the daemon logs.
async fn leader_change(c: &mut Cluster, p: &Params, csv: &Csv) -> Res<()> {
    let log = c
        .dir
        .join("logs")
        .join(format!("{}.log", c.scheduler_pods[0].name));
    let rebuilt_lines = |text: &str| {
        text.lines()
            .filter(|l| l.contains("cluster state rebuilt"))
            .count()
    };
    let before = rebuilt_lines(&std::fs::read_to_string(&log).unwrap_or_default());
    let t = Instant::now();
    c.restart_tessera(0)?;
    let line = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if rebuilt_lines(&text) > before {
            break text
                .lines()
                .rfind(|l| l.contains("cluster state rebuilt"))
                .unwrap_or_default()
                .to_owned();
        }
        if t.elapsed() > Duration::from_secs(300) {
            return Err("the restarted extender did not rebuild within 300 s".into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let total = t.elapsed().as_secs_f64();
    let list_rebuild = line
        .split_whitespace()
        .find_map(|f| f.strip_prefix("list_and_rebuild_seconds="))
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(f64::NAN);
    eprintln!(
        "leader change: {total:.2} s to serving, of which List + rebuild {list_rebuild:.2} s ({line})"
    );
    let case = format!(
        "{} nodes x 8 GPUs x 2 sets; {} running pods per set",
        p.nodes, p.running
    );
    csv.row(
        &Row::new(
            &case,
            "leader change: extender restarted -> serving (process start, Lease, Lists, rebuild)",
            "s",
            Stats::single(total),
        )
        .without_p99(),
    );
    csv.row(
        &Row::new(
            &case,
            "  of which the term's Lists (every node and pod, from the API server) and the loop's rebuild",
            "s",
            Stats::single(list_rebuild),
        )
        .without_p99(),
    );
    Ok(())
}

/// CPU seconds (user + system) used so far by each process of the cluster (found by the run
/// directory in its command line), by component, and by this benchmark process (the pod
/// creators, the watch and the device plugin stand-in).
fn cpu_by_component(dir: &std::path::Path) -> BTreeMap<String, f64> {
    let tick = std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .trim()
                .parse::<f64>()
                .ok()
        })
        .unwrap_or(100.0);
    let cpu_of = |stat: &str| -> Option<f64> {
        let rest = &stat[stat.rfind(')')? + 2..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        // Fields 14 and 15 of /proc/<pid>/stat (utime, stime), counted after the comm field.
        let user: f64 = f.get(11)?.parse().ok()?;
        let sys: f64 = f.get(12)?.parse().ok()?;
        Some((user + sys) / tick)
    };
    let mut out = BTreeMap::new();
    let needle = dir.display().to_string();
    if let Ok(rd) = std::fs::read_dir("/proc") {
        for e in rd.flatten() {
            let pid = e.file_name().to_string_lossy().into_owned();
            if !pid.bytes().all(|b| b.is_ascii_digit()) {
                continue;
            }
            let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
                continue;
            };
            let args: Vec<String> = cmd
                .split(|b| *b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            if !args.iter().any(|a| a.contains(&needle)) {
                continue;
            }
            let exe = args
                .first()
                .and_then(|a| a.rsplit('/').next())
                .unwrap_or("?")
                .to_owned();
            if exe == "unshare" || exe == "sh" {
                continue;
            }
            let name = if exe == "kube-scheduler" && args.iter().any(|a| a.contains("plain-")) {
                "kube-scheduler (plain)".to_owned()
            } else if exe == "kube-scheduler" {
                "kube-scheduler (Tessera profile)".to_owned()
            } else {
                exe
            };
            if let Some(c) = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| cpu_of(&s))
            {
                *out.entry(name).or_insert(0.0) += c;
            }
        }
    }
    if let Some(c) = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| cpu_of(&s))
    {
        out.insert("benchmark client".to_owned(), c);
    }
    out
}

/// `after - before`, per component.
fn cpu_diff(
    after: &BTreeMap<String, f64>,
    before: &BTreeMap<String, f64>,
) -> BTreeMap<String, f64> {
    after
        .iter()
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0.0)))
        .collect()
}

/// `tessera_scheduler_decisions{verb,result}` of the extender on `metrics_port`, summed per
/// `verb/result`.
async fn decisions(metrics_port: u16) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    let Some(text) = tessera_e2e::cluster::http_get(metrics_port, "/metrics").await else {
        return out;
    };
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("tessera_scheduler_decisions")
            && let Some((labels, v)) = rest.rsplit_once(' ')
        {
            let get = |k: &str| {
                labels
                    .split([',', '{', '}'])
                    .find_map(|kv| kv.strip_prefix(&format!("{k}=")))
                    .map(|v| v.trim_matches('"').to_owned())
                    .unwrap_or_default()
            };
            let key = format!("{}/{}", get("verb"), get("result"));
            *out.entry(key).or_insert(0.0) += v.parse::<f64>().unwrap_or(0.0);
        }
    }
    out
}

/// The extender's timed parts of `/filter` and `/bind` (what the row says; the histogram; its
/// labels), in the order of [`RunResult::handler_ms`]: the whole handlers, HTTP included, and
/// their steps (issue 29's T4).
const HANDLER_PARTS: [(&str, &str, &str); 5] = [
    (
        "/filter handler (API calls included)",
        "tessera_filter_duration_seconds",
        "",
    ),
    (
        "/bind handler (API calls included)",
        "tessera_bind_duration_seconds",
        "",
    ),
    (
        "/filter: decision loop (its queue and the decision)",
        "tessera_scheduler_step_duration_seconds",
        r#"{verb="filter",step="decision_loop"}"#,
    ),
    (
        "/bind: decision loop (its queue and the admission)",
        "tessera_scheduler_step_duration_seconds",
        r#"{verb="bind",step="decision_loop"}"#,
    ),
    (
        "/bind: the Binding POST",
        "tessera_scheduler_step_duration_seconds",
        r#"{verb="bind",step="api"}"#,
    ),
];

/// The API server's own counters a run reads (T2, T4), over every series (codes, scopes);
/// zeros when `/metrics` cannot be read.
#[derive(Debug, Default, Clone)]
struct ApiCounts {
    /// `apiserver_request_duration_seconds` sum and count for `POST pods/binding`.
    binding_seconds: f64,
    bindings: f64,
    /// Its histogram: cumulative count per upper bound in microseconds (`+Inf`: `u64::MAX`).
    binding_buckets: BTreeMap<u64, f64>,
    /// Writes (POST, PUT, PATCH, DELETE) of pods and their subresources, every client.
    pod_writes: f64,
    /// The same of ResourceClaims.
    claim_writes: f64,
    /// Calls of the chart's webhook (`apiserver_admission_webhook_request_total`).
    webhook_calls: f64,
    /// API Priority and Fairness (`--apf`), per priority level but `exempt`: the time its
    /// requests waited for a seat and how many waited
    /// (`apiserver_flowcontrol_request_wait_duration_seconds`), and how many it dispatched.
    apf_levels: BTreeMap<String, ApfLevel>,
    /// The requests APF refused, every level.
    apf_rejected: f64,
}

/// One APF priority level's counters ([`ApiCounts::apf_levels`]; a run's:
/// [`RunResult::apf_levels`]).
#[derive(Debug, Default, Clone, Copy)]
struct ApfLevel {
    wait_seconds: f64,
    waits: f64,
    dispatched: f64,
}

impl ApfLevel {
    /// What was counted after `before`.
    fn since(self, before: ApfLevel) -> ApfLevel {
        ApfLevel {
            wait_seconds: self.wait_seconds - before.wait_seconds,
            waits: self.waits - before.waits,
            dispatched: self.dispatched - before.dispatched,
        }
    }

    /// Mean wait for a seat, ms.
    fn wait_ms(&self) -> f64 {
        mean_ms(self.wait_seconds, self.waits)
    }
}

impl ApiCounts {
    fn level(&mut self, priority_level: &str) -> &mut ApfLevel {
        self.apf_levels
            .entry(priority_level.to_owned())
            .or_default()
    }

    async fn read(admin: &kube::Client) -> ApiCounts {
        let mut out = ApiCounts::default();
        let Ok(request) = http::Request::get("/metrics").body(Vec::new()) else {
            return out;
        };
        let Ok(text) = admin.request_text(request).await else {
            return out;
        };
        for s in hami_contract::metrics::samples(&text).0 {
            let pods = s.label("resource") == Some("pods");
            let write = matches!(s.label("verb"), Some("POST" | "PUT" | "PATCH" | "DELETE"));
            let binding = pods
                && s.label("verb") == Some("POST")
                && s.label("subresource") == Some("binding");
            let priority_level = s.label("priority_level").unwrap_or_default();
            let exempt = priority_level == "exempt";
            match s.name.as_str() {
                "apiserver_request_duration_seconds_sum" if binding => {
                    out.binding_seconds += s.value
                }
                "apiserver_request_duration_seconds_count" if binding => out.bindings += s.value,
                "apiserver_request_duration_seconds_bucket" if binding => {
                    let le = match s.label("le") {
                        Some("+Inf") => u64::MAX,
                        Some(v) => match v.parse::<f64>() {
                            // Microseconds: the API server's bounds are whole milliseconds.
                            Ok(secs) => (secs * 1e6).round() as u64,
                            Err(_) => continue,
                        },
                        None => continue,
                    };
                    *out.binding_buckets.entry(le).or_default() += s.value;
                }
                "apiserver_request_total" if pods && write => out.pod_writes += s.value,
                "apiserver_request_total"
                    if write && s.label("resource") == Some("resourceclaims") =>
                {
                    out.claim_writes += s.value
                }
                "apiserver_admission_webhook_request_total"
                    if s.label("name") == Some("vgpu.hami.io") =>
                {
                    out.webhook_calls += s.value
                }
                "apiserver_flowcontrol_request_wait_duration_seconds_sum" if !exempt => {
                    out.level(priority_level).wait_seconds += s.value
                }
                "apiserver_flowcontrol_request_wait_duration_seconds_count" if !exempt => {
                    out.level(priority_level).waits += s.value
                }
                "apiserver_flowcontrol_dispatched_requests_total" if !exempt => {
                    out.level(priority_level).dispatched += s.value
                }
                "apiserver_flowcontrol_rejected_requests_total" => out.apf_rejected += s.value,
                _ => {}
            }
        }
        out
    }
}

/// The `q` quantile, in ms, of the Bindings between two reads of the API server's histogram
/// (`before`, `after`: cumulative counts per upper bound in µs), interpolated inside its bucket as
/// Prometheus's `histogram_quantile` does; 0 without Bindings. The bounds are coarse (100, 200,
/// 400, 600, 800 ms, 1 s, …), so it says which bucket, not the exact time.
fn histogram_quantile_ms(q: f64, before: &BTreeMap<u64, f64>, after: &BTreeMap<u64, f64>) -> f64 {
    let counts: Vec<(u64, f64)> = after
        .iter()
        .map(|(le, c)| (*le, c - before.get(le).copied().unwrap_or(0.0)))
        .collect();
    let Some(&(_, total)) = counts.last() else {
        return 0.0;
    };
    if total <= 0.0 {
        return 0.0;
    }
    let rank = q * total;
    let (mut lower, mut below) = (0u64, 0.0);
    for (le, count) in counts {
        if count >= rank {
            if le == u64::MAX {
                return lower as f64 / 1e3;
            }
            let inside = count - below;
            let frac = if inside > 0.0 {
                (rank - below) / inside
            } else {
                1.0
            };
            return (lower as f64 + (le - lower) as f64 * frac) / 1e3;
        }
        (lower, below) = (le, count);
    }
    lower as f64 / 1e3
}

/// `(sum, count)` of each of [`HANDLER_PARTS`] on the extender's `/metrics`.
async fn handler_seconds(metrics_port: u16) -> [(f64, f64); HANDLER_PARTS.len()] {
    let mut out = [(0.0, 0.0); HANDLER_PARTS.len()];
    let Some(text) = tessera_e2e::cluster::http_get(metrics_port, "/metrics").await else {
        return out;
    };
    for line in text.lines() {
        let Some((k, v)) = line.rsplit_once(' ') else {
            continue;
        };
        let v: f64 = v.parse().unwrap_or(0.0);
        for (i, (_, base, labels)) in HANDLER_PARTS.iter().enumerate() {
            if k == format!("{base}_sum{labels}") {
                out[i].0 = v;
            } else if k == format!("{base}_count{labels}") {
                out[i].1 = v;
            }
        }
    }
    out
}

fn diff(after: &BTreeMap<String, f64>, before: &BTreeMap<String, f64>) -> String {
    after
        .iter()
        .filter_map(|(k, v)| {
            let d = v - before.get(k).copied().unwrap_or(0.0);
            (d > 0.0).then(|| format!("{k}={d}"))
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// 100 identical pods onto one plugin-backed node; seconds until all are admitted.
async fn burst(c: &mut Cluster, p: &Params, csv: &Csv) -> Res<()> {
    let node = "burst-node";
    c.add_node(NodeSpec::uniform(node, 8, A100, A100_MIB).with_split_count(16))
        .await?;
    Api::<Node>::all(c.admin().clone())
        .patch(
            node,
            &PatchParams::default(),
            &Patch::Merge(&json!({"metadata": {"labels": { SET: "burst" }}})),
        )
        .await?;
    let mut took = Vec::new();
    let mut latencies = Vec::new();
    let mut to_allocated = Vec::new();
    let mut to_next_bind = Vec::new();
    for round in 0..p.burst_rounds {
        let ns = format!("bench-burst-{round}");
        let run = format!("burst-{round}");
        ensure_namespace(c.admin(), &ns, false).await?;
        let seen = Arc::new(Mutex::new(Seen::default()));
        let watch = spawn_watch(
            c.admin().clone(),
            None,
            ns.clone(),
            run.clone(),
            seen.clone(),
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
        let before = decisions(c.scheduler_pods[0].metrics_port).await;
        let admitted_before = c.node(node).map(|n| n.admitted().len()).unwrap_or(0);
        let objects: Vec<Pod> = (0..p.burst)
            .map(|i| {
                let mut pod: Pod = serde_json::from_value(json!({
                    "apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": format!("burst-{i:03}"), "namespace": ns,
                                 "labels": { RUN: run }},
                    "spec": {"containers": [{"name": "c0", "image": "registry.example/cuda-app:1",
                        "resources": {"limits": {"cpu": "10m", "nvidia.com/gpu": "1",
                            "nvidia.com/gpumem": "2000", "nvidia.com/gpucores": "5"}}}],
                        "nodeSelector": { SET: "burst" }, "terminationGracePeriodSeconds": 0},
                }))
                .unwrap_or_default();
                pod.metadata.namespace = Some(ns.clone());
                pod
            })
            .collect();
        let t0 = Instant::now();
        let created = create_all(c.user(), &ns, objects, &seen).await;
        let deadline = t0 + Duration::from_secs(if results::quick() { 60 } else { 240 });
        let mut all_at = None;
        while Instant::now() < deadline {
            let n = c.node(node).map(|n| n.admitted().len()).unwrap_or(0);
            if n >= admitted_before + created {
                all_at = Some(t0.elapsed());
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let after = decisions(c.scheduler_pods[0].metrics_port).await;
        watch.abort();
        let Some(all_at) = all_at else {
            return Err(format!(
                "burst round {round}: not all {created} pods admitted within the deadline\n{}",
                c.logs_tail(30)
            )
            .into());
        };
        eprintln!(
            "burst round {round}: {created} pods admitted in {:.2} s; extender decisions: {}",
            all_at.as_secs_f64(),
            diff(&after, &before)
        );
        took.push(all_at.as_secs_f64());
        if let Ok(s) = seen.lock() {
            // Where the time goes: each pod's bound -> allocated (harness kubelet + plugin), and
            // the gap from one allocation to the next pod's bind (the scheduler's reaction).
            let mut bound: Vec<(Instant, &String)> = s.bound.iter().map(|(n, t)| (*t, n)).collect();
            bound.sort();
            let mut allocs: Vec<Instant> = s.allocated.values().copied().collect();
            allocs.sort();
            for (t, n) in &bound {
                if let Some(a) = s.allocated.get(*n) {
                    to_allocated.push(a.saturating_duration_since(*t).as_secs_f64() * 1e3);
                }
                if let Some(prev) = allocs.iter().rev().find(|a| *a < t) {
                    to_next_bind.push(t.saturating_duration_since(*prev).as_secs_f64() * 1e3);
                }
            }
            latencies.extend(s.bound.iter().filter_map(|(n, b)| {
                s.created
                    .get(n)
                    .map(|c| b.saturating_duration_since(*c).as_secs_f64() * 1e3)
            }));
        }
        delete_all(c.admin(), &ns).await?;
        // The harness kubelet forgets deleted pods on its next tick.
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline && c.node(node).map(|n| n.admitted().len()).unwrap_or(0) > 0
        {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let case = format!(
        "{} identical pods (gpumem 2000 gpucores 5) onto one 8-GPU node (split 16)",
        p.burst
    );
    let s = Stats::of(&took);
    csv.row(
        &Row::new(case.clone(), "first create -> all allocated", "s", s)
            .without_p99()
            .goal("< 5 s", s.median < 5.0),
    );
    csv.row(&Row::new(
        case.clone(),
        "per pod: create -> bound",
        "ms",
        Stats::of(&latencies),
    ));
    csv.row(&Row::new(
        case.clone(),
        "per pod: bound -> allocated (harness kubelet poll + Allocate + patch)",
        "ms",
        Stats::of(&to_allocated),
    ));
    csv.row(&Row::new(
        case,
        "per pod: latest earlier allocation -> bound (scheduler's reaction)",
        "ms",
        Stats::of(&to_next_bind),
    ));
    Ok(())
}

async fn run(p: Params) -> Res<()> {
    // `--csv NAME`: the rows' file (the scale run of bench/run.sh writes its own table).
    let args: Vec<String> = std::env::args().collect();
    let name = args
        .iter()
        .position(|a| a == "--csv")
        .and_then(|i| args.get(i + 1))
        .map_or("scheduling", String::as_str);
    let csv = Csv::open(name);
    let mut opts = ClusterOptions::new("bench-scheduling", vec![]);
    if p.variants.contains(&Variant::TesseraPolicy) {
        // The policy hands the pods it mutates to (b')'s kube-scheduler profile.
        opts.pod_mutation_policy = Some(vec![format!("schedulerName={TESSERA_UNTHROTTLED}")]);
    }
    let dra = p.variants.iter().any(|v| v.dra());
    if dra {
        // GPU shares through DRA (alpha in 1.34), on the API server and every kube-scheduler.
        opts.feature_gates = vec!["DRAConsumableCapacity=true".to_owned()];
    }
    opts.apf = p.apf;
    let mut c = Cluster::start(opts).await?;
    eprintln!("cluster up: {}", c.dir.display());
    if p.burst > 0 && p.burst_rounds > 0 {
        burst(&mut c, &p, &csv).await?;
    }
    if p.variants.contains(&Variant::TesseraPolicy) && p.admission > 0 {
        admission_cost(&c, &p, &csv).await?;
    }
    if p.pods == 0 || p.rounds == 0 {
        return Ok(());
    }
    let t = Instant::now();
    let per_node = p.running.div_ceil(p.nodes.max(1));
    // What the device plugin writes of how it identifies the pod an `Allocate` serves.
    let identity = if p.signature_identity {
        ann::IDENTITY_SIGNATURE
    } else {
        ann::IDENTITY_POD_RESOURCES
    };
    register_set(c.admin(), "a", p.nodes, SetKind::Plain, per_node, identity).await?;
    register_set(
        c.admin(),
        "b",
        p.nodes,
        SetKind::Tessera,
        per_node,
        identity,
    )
    .await?;
    // `--running` fills sets a and b only.
    if dra {
        register_set(c.admin(), "d", p.nodes, SetKind::Dra, 0, identity).await?;
    }
    eprintln!(
        "{} bare nodes in each of {} sets registered in {:.1} s",
        p.nodes,
        if dra { 3 } else { 2 },
        t.elapsed().as_secs_f64()
    );
    if p.running > 0 {
        let t = Instant::now();
        // Booked as the scheduler books them: only its identity may write the booking
        // annotations (the chart's booking-annotations admission policy).
        let scheduler = client_for(&c.kubeconfig(SCHEDULER_USER)).await?;
        create_running(&scheduler, p.nodes, p.running).await?;
        eprintln!(
            "{} running pods on each node set created in {:.1} s",
            p.running,
            t.elapsed().as_secs_f64()
        );
        leader_change(&mut c, &p, &csv).await?;
    }
    // Only the schedulers the chosen variants use: an idle one would still watch every node
    // and pod and share the cores.
    let wants = |v: Variant| p.variants.contains(&v);
    let _plain = (wants(Variant::Plain) || wants(Variant::Dra))
        .then(|| c.spawn_plain_kube_scheduler("plain-kube-scheduler"))
        .transpose()?;
    let _unthrottled = (wants(Variant::PlainUnthrottled) || wants(Variant::DraUnthrottled))
        .then(|| spawn_unthrottled_kube_scheduler(&c))
        .transpose()?;
    let leader_port = c.scheduler_pods[0].extender_port;
    let leader_metrics = c.scheduler_pods[0].metrics_port;
    let _tessera_unthrottled = (wants(Variant::TesseraUnthrottled)
        || wants(Variant::TesseraPolicy))
    .then(|| spawn_tessera_kube_scheduler(&c, TESSERA_UNTHROTTLED, leader_port, Some(1000)))
    .transpose()?;
    let (_hami_order, hami_metrics) = if wants(Variant::TesseraHamiOrder) {
        let (extender, hami_port, hami_metrics) = spawn_hami_order_extender(&c)?;
        let ks = spawn_tessera_kube_scheduler(&c, TESSERA_HAMI_ORDER, hami_port, None)?;
        (Some((extender, ks)), hami_metrics)
    } else {
        (None, leader_metrics)
    };
    let plugin = client_for(&c.kubeconfig(DEVICE_PLUGIN_USER)).await?;
    // Every scheduler and the extenders' informers have seen every node.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let within = Duration::from_secs(if results::quick() { 90 } else { 600 });
    let mut by: BTreeMap<Variant, Vec<RunResult>> = BTreeMap::new();
    let variants = p.variants.clone();
    let metrics_of = |v: Variant| {
        if v == Variant::TesseraHamiOrder {
            hami_metrics
        } else {
            leader_metrics
        }
    };
    for round in 0..p.rounds {
        // Rotate the order, so no variant always runs first (or right after another).
        let mut order = variants.clone();
        order.rotate_left(round % variants.len().max(1));
        for v in order {
            let who = v.short();
            let ns = format!("bench-{who}-{round}");
            let before = decisions(metrics_of(v)).await;
            let spec = RunSpec {
                v,
                pods: p.pods,
                gated: p.gated,
            };
            let r = placement_run(
                &c,
                &plugin,
                &ns,
                &format!("{who}-{round}"),
                spec,
                within,
                metrics_of(v),
            )
            .await?;
            let lat = Stats::of(&r.latencies_ms);
            eprintln!(
                "round {round} {who}: {}/{} placed, {:.1} pods/s (creates took {:.1} s), create->bound p50 {:.0} ms p99 {:.0} ms{}",
                r.placed,
                r.wanted,
                r.pods_per_s,
                r.create_s,
                lat.median,
                lat.p99,
                if v.tessera() {
                    format!(
                        "; extender decisions: {}",
                        diff(&decisions(metrics_of(v)).await, &before)
                    )
                } else {
                    String::new()
                }
            );
            if r.placed < r.wanted {
                return Err(format!(
                    "{who} round {round}: only {} of {} pods placed\n{}",
                    r.placed,
                    r.wanted,
                    c.logs_tail(20)
                )
                .into());
            }
            delete_all(c.admin(), &ns).await?;
            if v.dra() {
                delete_claims(c.admin(), &ns).await?;
            }
            by.entry(v).or_default().push(r);
        }
    }
    report(&p, &by, &csv);
    Ok(())
}

/// The rows: rates and latencies of every variant, each Tessera variant against the plain
/// kube-scheduler with the same client settings (ratios: median of per-round ratios), the
/// extender's handler times, and CPU per placed pod by process.
fn report(p: &Params, by: &BTreeMap<Variant, Vec<RunResult>>, csv: &Csv) {
    let gated = if p.gated {
        ", created behind a scheduling gate"
    } else {
        ""
    };
    let case = |who: &str| {
        format!(
            "{} GPU pods on {} nodes x 8 GPUs{gated}: {who}",
            p.pods, p.nodes
        )
    };
    let rates = |v: Variant| by[&v].iter().map(|r| r.pods_per_s).collect::<Vec<_>>();
    let start_to_bound = if p.gated {
        "gate lifted -> bound"
    } else {
        "create -> bound"
    };
    let lat = |v: Variant| {
        Stats::of(
            &by[&v]
                .iter()
                .flat_map(|r| r.latencies_ms.iter().copied())
                .collect::<Vec<_>>(),
        )
    };
    for v in [Variant::Plain, Variant::PlainUnthrottled] {
        if !by.contains_key(&v) {
            continue;
        }
        csv.row(
            &Row::new(
                case(v.label()),
                "pods placed per second",
                "pods/s",
                Stats::of(&rates(v)),
            )
            .without_p99(),
        );
        csv.row(&Row::new(case(v.label()), start_to_bound, "ms", lat(v)));
    }
    // (Tessera variant, the plain one with the same client settings, throughput goal): issue
    // 15's 0.8 for both; with the creates out of the way (issue 29's T3), 0.8 at the default QPS
    // and 0.75 at QPS 1000.
    let unthrottled_goal = if p.gated { 0.75 } else { 0.8 };
    let pairs = [
        (Variant::Tessera, Variant::Plain, Some(0.8)),
        (
            Variant::TesseraUnthrottled,
            Variant::PlainUnthrottled,
            Some(unthrottled_goal),
        ),
        (
            Variant::TesseraPolicy,
            Variant::PlainUnthrottled,
            Some(unthrottled_goal),
        ),
        (Variant::TesseraPolicy, Variant::TesseraUnthrottled, None),
        // T3 through DRA: 0.9 with the creates out of the way.
        (Variant::Dra, Variant::Plain, p.gated.then_some(0.9)),
        (
            Variant::DraUnthrottled,
            Variant::PlainUnthrottled,
            p.gated.then_some(0.9),
        ),
        (Variant::TesseraHamiOrder, Variant::Plain, None),
        (Variant::TesseraHamiOrder, Variant::PlainUnthrottled, None),
    ];
    // Only the pairs whose two variants ran (`--variants`).
    let pairs: Vec<(Variant, Variant, Option<f64>)> = pairs
        .into_iter()
        .filter(|(t, base, _)| by.contains_key(t) && by.contains_key(base))
        .collect();
    for &(t, base, goal) in &pairs {
        let per_round: Vec<f64> = rates(t)
            .iter()
            .zip(rates(base))
            .map(|(x, y)| x / y)
            .collect();
        let ratio = Stats::of(&per_round).median;
        let who = format!(
            "{} [vs {}]",
            t.label(),
            base.label().split_whitespace().next().unwrap_or("")
        );
        let mut row = Row::new(
            case(&who),
            "pods placed per second",
            "pods/s",
            Stats::of(&rates(t)),
        )
        .without_p99()
        .baseline(Stats::of(&rates(base)).median)
        .ratio(ratio);
        if let Some(goal) = goal {
            row = row.goal(&format!("ratio >= {goal}"), ratio >= goal);
        }
        csv.row(&row);
        let (lt, lb) = (lat(t), lat(base));
        let p99_ratio = lt.p99 / lb.p99;
        let mut row = Row::new(
            case(&who),
            format!("{start_to_bound} (ratio of the p99s)"),
            "ms",
            lt,
        )
        .baseline(lb.p99)
        .ratio(p99_ratio);
        if goal.is_some() {
            row = row.goal("p99 ratio <= 1.5", p99_ratio <= 1.5);
        }
        csv.row(&row);
    }
    // T4: the API server's time per Binding POST (its mean and its histogram's p99), the
    // extender's against kube-scheduler's own.
    type Figure = fn(&RunResult) -> f64;
    let of = |v: Variant, f: Figure| Stats::of(&by[&v].iter().map(f).collect::<Vec<_>>());
    let binding_rows: [(&str, &str, Figure); 2] = [
        (
            "the API server's mean time per Binding POST (run median)",
            "ratio <= 1.5",
            |r| r.binding_ms,
        ),
        (
            "the API server's p99 per Binding POST (its histogram  interpolated; run median)",
            "p99 ratio <= 1.5",
            |r| r.binding_p99_ms,
        ),
    ];
    for &(t, base, goal) in &pairs {
        for (metric, goal_text, f) in binding_rows {
            let (bt, bb) = (of(t, f), of(base, f));
            let ratio = bt.median / bb.median;
            let mut row = Row::new(
                case(&format!(
                    "{} [vs {}]",
                    t.label(),
                    base.label().split_whitespace().next().unwrap_or("")
                )),
                metric,
                "ms",
                bt,
            )
            .without_p99()
            .baseline(bb.median)
            .ratio(ratio);
            if goal.is_some() {
                row = row.goal(goal_text, ratio <= 1.5);
            }
            csv.row(&row);
        }
    }
    // T2: the API server's work per placed pod by kind, every variant that ran.
    for v in Variant::ALL {
        let Some(runs) = by.get(&v) else {
            continue;
        };
        // (what, the figure, only for the DRA variants)
        let counts: [(&str, Figure, bool); 3] = [
            (
                "pod writes per placed pod (every client; run median)",
                |r| r.pod_writes,
                false,
            ),
            (
                "webhook calls per placed pod (run median)",
                |r| r.webhook_calls,
                false,
            ),
            (
                "ResourceClaim writes per placed pod (every client; run median)",
                |r| r.claim_writes,
                true,
            ),
        ];
        for (what, of, dra_only) in counts {
            if dra_only && !v.dra() {
                continue;
            }
            csv.row(
                &Row::new(
                    case(v.label()),
                    what,
                    "requests",
                    Stats::of(&runs.iter().map(of).collect::<Vec<_>>()),
                )
                .without_p99(),
            );
        }
        if p.apf {
            let stats =
                |f: &dyn Fn(&RunResult) -> f64| Stats::of(&runs.iter().map(f).collect::<Vec<_>>());
            let mut rows = vec![
                (
                    "APF: mean wait for a seat of a request not exempt (run median)".to_owned(),
                    "ms",
                    stats(&|r| {
                        let (seconds, waits) = r
                            .apf_levels
                            .values()
                            .fold((0.0, 0.0), |(s, n), l| (s + l.wait_seconds, n + l.waits));
                        mean_ms(seconds, waits)
                    }),
                ),
                (
                    "APF: requests rejected per placed pod (run median)".to_owned(),
                    "requests",
                    stats(&|r| r.apf_rejected),
                ),
            ];
            let levels: BTreeSet<&String> = runs.iter().flat_map(|r| r.apf_levels.keys()).collect();
            for level in levels {
                let at = |r: &RunResult| r.apf_levels.get(level).copied().unwrap_or_default();
                rows.push((
                    format!("APF: requests at priority level {level} per placed pod (run median)"),
                    "requests",
                    stats(&|r| at(r).dispatched / r.placed.max(1) as f64),
                ));
                rows.push((
                    format!("APF: mean wait for a seat at priority level {level} (run median)"),
                    "ms",
                    stats(&|r| at(r).wait_ms()),
                ));
            }
            for (what, unit, stats) in rows {
                csv.row(&Row::new(case(v.label()), &what, unit, stats).without_p99());
            }
        }
    }
    // The extender's share of kube-scheduler's serial scheduling cycle (1 / pods per second).
    for t in [
        Variant::Tessera,
        Variant::TesseraUnthrottled,
        Variant::TesseraPolicy,
        Variant::TesseraHamiOrder,
    ] {
        if !by.contains_key(&t) {
            continue;
        }
        for (i, (part, _, _)) in HANDLER_PARTS.iter().enumerate() {
            csv.row(
                &Row::new(
                    case(t.label()),
                    format!("mean time in the extender's {part} (run median)"),
                    "ms",
                    Stats::of(&by[&t].iter().map(|r| r.handler_ms[i]).collect::<Vec<_>>()),
                )
                .without_p99(),
            );
        }
    }
    // Where the time goes on a machine whose cores every component shares: CPU per placed
    // pod by component, median over rounds, each Tessera variant against its plain one.
    let per_pod = |t: Variant, comp: &str| {
        Stats::of(
            &by[&t]
                .iter()
                .map(|r| {
                    let cpu = if comp == "all processes" {
                        r.cpu.values().sum::<f64>()
                    } else {
                        r.cpu.get(comp).copied().unwrap_or(0.0)
                    };
                    cpu * 1e3 / r.placed.max(1) as f64
                })
                .collect::<Vec<_>>(),
        )
    };
    let mut comps: Vec<String> = by
        .values()
        .flatten()
        .flat_map(|r| r.cpu.keys().cloned())
        .collect();
    comps.sort();
    comps.dedup();
    comps.push("all processes".to_owned());
    // The first pair of each Tessera variant (HAMi's order only against the default QPS).
    let mut seen = Vec::new();
    for (t, base, _) in &pairs {
        if seen.contains(t) {
            continue;
        }
        seen.push(*t);
        for comp in &comps {
            let (a, b) = (per_pod(*base, comp), per_pod(*t, comp));
            if a.median == 0.0 && b.median == 0.0 {
                continue;
            }
            let mut row = Row::new(
                format!("{} GPU pods on {} nodes: {comp}", p.pods, p.nodes),
                format!(
                    "CPU per placed pod, {} [baseline: {}]",
                    t.label(),
                    base.label()
                ),
                "ms",
                b,
            )
            .without_p99();
            if a.median > 0.0 {
                row = row.baseline(a.median);
            }
            csv.row(&row);
        }
    }
}

/// How a pod is admitted in [`admission_cost`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum AdmissionPath {
    /// A pod without GPU resources: no webhook call, no pod-mutation policy (the baseline).
    Plain,
    /// A GPU pod through the chart's webhook.
    Webhook,
    /// A GPU pod through the chart's `admissionPolicy.podMutation` policies.
    Policy,
}

impl AdmissionPath {
    const ALL: [AdmissionPath; 3] = [
        AdmissionPath::Plain,
        AdmissionPath::Webhook,
        AdmissionPath::Policy,
    ];
    fn label(self) -> &'static str {
        match self {
            AdmissionPath::Plain => "a plain pod",
            AdmissionPath::Webhook => "a GPU pod through the webhook",
            AdmissionPath::Policy => "a GPU pod through the admission policies",
        }
    }
    fn namespace(self) -> &'static str {
        match self {
            AdmissionPath::Plain => "bench-admission-plain",
            AdmissionPath::Webhook => "bench-admission-webhook",
            AdmissionPath::Policy => "bench-admission-policy",
        }
    }
}

/// What one round of one admission path cost: CPU per create by process, and each create's
/// latency.
#[derive(Debug, Default)]
struct AdmissionRun {
    cpu_ms: BTreeMap<String, f64>,
    latencies_ms: Vec<f64>,
}

/// Issue 29 (T1, T2): admitting a GPU pod through the webhook against through the
/// pod-mutation policies, with a plain pod's admission as the baseline. Per round and path
/// (rounds interleaved, the order rotating), `--admission N` dry-run creates as the ordinary
/// user by [`CREATORS`] concurrent clients: a dry run goes through the whole admission chain
/// and no further (nothing is stored, watched or scheduled), so what the cluster's processes
/// spend meanwhile is admission's. The GPU pod is written as users write one (no scheduler
/// named), so the webhook and the policy both mutate it.
async fn admission_cost(c: &Cluster, p: &Params, csv: &Csv) -> Res<()> {
    for path in AdmissionPath::ALL {
        ensure_namespace(c.admin(), path.namespace(), path == AdmissionPath::Policy).await?;
    }
    let pod = |path: AdmissionPath, i: usize| -> Res<Pod> {
        let limits = if path == AdmissionPath::Plain {
            json!({"cpu": "10m"})
        } else {
            json!({"cpu": "10m", "nvidia.com/gpu": "1", "nvidia.com/gpumem": "4000",
                   "nvidia.com/gpucores": "10"})
        };
        Ok(serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": format!("admit-{i:05}"), "namespace": path.namespace()},
            "spec": {"containers": [{"name": "c0", "image": "registry.example/cuda-app:1",
                                     "resources": {"limits": limits}}]},
        }))?)
    };
    let dry_run = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let mut by: BTreeMap<AdmissionPath, Vec<AdmissionRun>> = BTreeMap::new();
    for round in 0..p.rounds {
        let mut order = AdmissionPath::ALL.to_vec();
        order.rotate_left(round % AdmissionPath::ALL.len());
        for path in order {
            let api: Api<Pod> = Api::namespaced(c.user().clone(), path.namespace());
            let pods = (0..p.admission)
                .map(|i| pod(path, i))
                .collect::<Res<Vec<_>>>()?;
            let cpu_before = cpu_by_component(&c.dir);
            let results: Vec<Option<f64>> = futures::stream::iter(pods)
                .map(|pod| {
                    let (api, dry_run) = (&api, &dry_run);
                    async move {
                        let t = Instant::now();
                        let created = api.create(dry_run, &pod).await;
                        created.ok().map(|_| t.elapsed().as_secs_f64() * 1e3)
                    }
                })
                .buffer_unordered(CREATORS)
                .collect()
                .await;
            let cpu = cpu_diff(&cpu_by_component(&c.dir), &cpu_before);
            let latencies_ms: Vec<f64> = results.iter().flatten().copied().collect();
            if latencies_ms.len() < p.admission {
                return Err(format!(
                    "admission round {round}, {}: {} of {} dry-run creates failed",
                    path.label(),
                    p.admission - latencies_ms.len(),
                    p.admission
                )
                .into());
            }
            let n = latencies_ms.len() as f64;
            let mut cpu_ms: BTreeMap<String, f64> =
                cpu.iter().map(|(k, v)| (k.clone(), v * 1e3 / n)).collect();
            cpu_ms.insert(
                "all processes".to_owned(),
                cpu.values().sum::<f64>() * 1e3 / n,
            );
            eprintln!(
                "admission round {round}, {}: {:.2} ms CPU per create (API server {:.2}), latency p50 {:.1} ms",
                path.label(),
                cpu_ms["all processes"],
                cpu_ms.get("kube-apiserver").copied().unwrap_or(0.0),
                Stats::of(&latencies_ms).median,
            );
            by.entry(path).or_default().push(AdmissionRun {
                cpu_ms,
                latencies_ms,
            });
        }
    }
    let case = |path: AdmissionPath| {
        format!(
            "{} dry-run creates per round, {CREATORS} clients: {}",
            p.admission,
            path.label()
        )
    };
    let cpu = |path: AdmissionPath, comp: &str| {
        Stats::of(
            &by[&path]
                .iter()
                .map(|r| r.cpu_ms.get(comp).copied().unwrap_or(0.0))
                .collect::<Vec<_>>(),
        )
    };
    for comp in ["all processes", "kube-apiserver", "tessera-scheduler"] {
        for path in AdmissionPath::ALL {
            let mut row = Row::new(
                case(path),
                format!("CPU per admitted pod, {comp} (run median)"),
                "ms",
                cpu(path, comp),
            )
            .without_p99();
            let plain = cpu(AdmissionPath::Plain, comp).median;
            if path != AdmissionPath::Plain && plain > 0.0 {
                row = row.baseline(plain).ratio(cpu(path, comp).median / plain);
            }
            csv.row(&row);
        }
        // The question of the variant: what the policies cost against the webhook.
        let (policy, webhook) = (
            cpu(AdmissionPath::Policy, comp),
            cpu(AdmissionPath::Webhook, comp),
        );
        if webhook.median > 0.0 {
            let ratio = policy.median / webhook.median;
            csv.row(
                &Row::new(
                    case(AdmissionPath::Policy).replace(
                        AdmissionPath::Policy.label(),
                        "the admission policies [vs the webhook]",
                    ),
                    format!("CPU per admitted GPU pod, {comp} (run median)"),
                    "ms",
                    policy,
                )
                .without_p99()
                .baseline(webhook.median)
                .ratio(ratio),
            );
        }
    }
    for path in AdmissionPath::ALL {
        let all: Vec<f64> = by[&path]
            .iter()
            .flat_map(|r| r.latencies_ms.iter().copied())
            .collect();
        csv.row(&Row::new(
            case(path),
            "create latency",
            "ms",
            Stats::of(&all),
        ));
    }
    Ok(())
}

fn main() {
    let p = params();
    eprintln!("scheduling bench: {p:?}");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("tokio runtime");
    if let Err(e) = rt.block_on(run(p)) {
        eprintln!("scheduling bench failed: {e}");
        std::process::exit(1);
    }
}

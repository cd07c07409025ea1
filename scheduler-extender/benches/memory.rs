//! Memory of the extender's state at 1,000 nodes × 8 GPUs with 10,000 running GPU pods, held the
//! way the daemon holds it: on a new term, `sync_term` buffers the complete Lists (`Vec<Node>`,
//! `Vec<Pod>`, `Vec<ResourceQuota>`, objects as the API server sends them, decoded from JSON),
//! hands them to the loop's `rebuild`, and drops them; the first filter fills the per-node usage
//! cache. Every replica also keeps the webhook's facts (from node metadata). Objects carry what a
//! real cluster's do (node status with images and conditions, pod status, owner references,
//! managed fields), since the List buffers are the peak.
//!
//! Prints VmRSS / VmHWM from /proc/self/status after each stage.
//!
//! ```text
//! cargo bench -p tessera-scheduler --bench memory                    # 1,000 nodes, 10,000 pods
//! cargo bench -p tessera-scheduler --bench memory -- --nodes 5000 --pods 50000 --other-pods 20000
//! ```
//!
//! With `TESSERA_BENCH_CSV_DIR` set, the figures also go to `memory.csv` there (one row set per
//! run; `bench/run.sh` runs both sizes above).
//!
//! `--other-pods N` adds pods without GPUs (DaemonSets, system pods): the daemon lists and
//! buffers every pod, and remembers each one's UID. `--full-objects` buffers the objects whole,
//! as the daemon did before it reduced them on arrival (`state::slim_pod`, `slim_node`).

use tokio::time::Instant;

use serde_json::{Value, json};
use tessera_scheduler::engine::Engine;
use tessera_scheduler::metrics::Metrics;
use tessera_scheduler_core::config::DecisionConfig;
use tessera_scheduler_core::facts::ClusterFacts;
use tessera_scheduler_core::fixtures::gpu_pod;
use tessera_scheduler_core::state::{NodeRecord, slim_node, slim_pod};
use tessera_scheduler_core::webhook::{self, WebhookConfig};

use results::{Csv, Row, Stats};
use tessera_bench_results as results;

const GPUS_PER_NODE: usize = 8;

#[derive(Debug, Clone, Copy)]
struct Mem {
    rss_kib: u64,
    hwm_kib: u64,
}

fn mem() -> Mem {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    Mem {
        rss_kib: field("VmRSS:"),
        hwm_kib: field("VmHWM:"),
    }
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

fn report(stage: &str, m: Mem, base: Mem) {
    println!(
        "{stage:<58} VmRSS {:>7.1} MiB (+{:>6.1})   VmHWM {:>7.1} MiB",
        mib(m.rss_kib),
        mib(m.rss_kib.saturating_sub(base.rss_kib)),
        mib(m.hwm_kib)
    );
}

/// A GPU UUID in NVML's format.
fn uuid(node: usize, gpu: usize) -> String {
    format!("GPU-{node:08x}-{gpu:04x}-4a1b-9c2d-{:012x}", node * 8 + gpu)
}

fn node_name(n: usize) -> String {
    format!(
        "ip-10-{}-{}-{}.ec2.internal",
        n / 65536,
        (n / 256) % 256,
        n % 256
    )
}

fn managed_fields(manager: &str) -> Value {
    json!([{"manager": manager, "operation": "Update", "apiVersion": "v1",
        "time": "2026-11-30T10:00:00Z", "fieldsType": "FieldsV1",
        "fieldsV1": {"f:metadata": {"f:annotations": {".": {}, "f:hami.io/node-nvidia-register": {}},
            "f:labels": {".": {}, "f:gpu": {}}},
            "f:status": {"f:allocatable": {"f:nvidia.com/gpu": {}}, "f:capacity": {"f:nvidia.com/gpu": {}}}}}])
}

/// A Node as the API server lists it: the device plugin's register annotation (8 × 80 GiB),
/// the usual labels, and a status with conditions, addresses and an image list.
fn node(n: usize) -> Value {
    let name = node_name(n);
    let devices: Vec<Value> = (0..GPUS_PER_NODE)
        .map(|i| {
            json!({"id": uuid(n, i), "index": i, "count": 10, "devmem": 81920, "devcore": 100,
                   "type": "NVIDIA H100 80GB HBM3", "numa": i / 4, "mode": "hami-core", "health": true})
        })
        .collect();
    let images: Vec<Value> = (0..25)
        .map(|i| {
            json!({"names": [format!("registry.example.com/team-{i}/image-{i}@sha256:{:064x}", i * 7919 + n),
                              format!("registry.example.com/team-{i}/image-{i}:v1.{i}.0")],
                   "sizeBytes": 400_000_000 + i * 1_000_000})
        })
        .collect();
    let conditions: Vec<Value> = ["MemoryPressure", "DiskPressure", "PIDPressure", "Ready"]
        .iter()
        .map(|t| {
            json!({"type": t, "status": if *t == "Ready" {"True"} else {"False"},
                   "lastHeartbeatTime": "2026-11-30T10:00:00Z", "lastTransitionTime": "2026-11-01T00:00:00Z",
                   "reason": format!("Kubelet{t}"), "message": format!("kubelet reports {t}")})
        })
        .collect();
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {
        "name": name, "uid": format!("{n:08x}-0000-4000-8000-000000000000"), "resourceVersion": "123456789",
        "creationTimestamp": "2026-11-01T00:00:00Z",
        "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
            "beta.kubernetes.io/os": "linux", "beta.kubernetes.io/arch": "amd64",
            "node.kubernetes.io/instance-type": "p5.48xlarge", "topology.kubernetes.io/region": "us-east-1",
            "topology.kubernetes.io/zone": "us-east-1a", "gpu": "on",
            "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        "annotations": {
            "hami.io/node-nvidia-register": serde_json::to_string(&devices).unwrap_or_default(),
            "node.alpha.kubernetes.io/ttl": "0",
            "volumes.kubernetes.io/controller-managed-attach-detach": "true"},
        "managedFields": managed_fields("tessera-device-plugin")},
      "spec": {"podCIDR": format!("10.{}.{}.0/24", n / 256, n % 256),
               "providerID": format!("aws:///us-east-1a/i-{n:017x}")},
      "status": {
        "capacity": {"cpu": "192", "memory": "2097152Mi", "pods": "110", "nvidia.com/gpu": "80",
                     "ephemeral-storage": "3750Gi", "hugepages-1Gi": "0", "hugepages-2Mi": "0"},
        "allocatable": {"cpu": "191", "memory": "2090000Mi", "pods": "110", "nvidia.com/gpu": "80",
                        "ephemeral-storage": "3500Gi", "hugepages-1Gi": "0", "hugepages-2Mi": "0"},
        "conditions": conditions,
        "addresses": [{"type": "InternalIP", "address": format!("10.0.{}.{}", n / 256, n % 256)},
                      {"type": "Hostname", "address": name}],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
        "nodeInfo": {"machineID": format!("{n:032x}"), "systemUUID": format!("{n:032x}"),
            "bootID": format!("{n:032x}"), "kernelVersion": "6.8.0-1015-aws", "osImage": "Ubuntu 24.04.1 LTS",
            "containerRuntimeVersion": "containerd://1.7.22", "kubeletVersion": "v1.34.2",
            "kubeProxyVersion": "", "operatingSystem": "linux", "architecture": "amd64"},
        "images": images}})
}

fn pod_conditions() -> Vec<Value> {
    [
        "PodReadyToStartContainers",
        "Initialized",
        "Ready",
        "ContainersReady",
        "PodScheduled",
    ]
    .iter()
    .map(|t| json!({"type": t, "status": "True", "lastTransitionTime": "2026-11-30T09:00:05Z"}))
    .collect()
}

/// A running GPU pod as the API server lists it, placed by the extender on one GPU of `node`.
fn gpu_pod_object(i: usize, node: usize, gpu: usize) -> Value {
    let ns = format!("team-{:02}", i % 50);
    let name = format!("train-{:05}-7f9c8d6b5-x2k4p", i);
    let node_name = node_name(node);
    let alloc = format!("{},NVIDIA,8192,10:;", uuid(node, gpu));
    let env: Vec<Value> = (0..6)
        .map(|e| json!({"name": format!("APP_SETTING_{e}"), "value": format!("value-{e}")}))
        .collect();
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": name, "namespace": ns, "uid": format!("{i:08x}-1111-4222-8333-{i:012x}"),
        "resourceVersion": "123456789", "creationTimestamp": "2026-11-30T09:00:00Z",
        "generateName": format!("train-{:05}-7f9c8d6b5-", i),
        "labels": {"app": format!("train-{:05}", i), "pod-template-hash": "7f9c8d6b5",
                   "hami.io/vgpu-node": node_name},
        "annotations": {"hami.io/vgpu-node": node_name, "hami.io/vgpu-time": "1764493200",
            "hami.io/vgpu-devices-to-allocate": alloc, "hami.io/vgpu-devices-allocated": alloc,
            "hami.io/bind-phase": "success", "hami.io/bind-time": "1764493201"},
        "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": format!("train-{:05}-7f9c8d6b5", i),
            "uid": format!("{i:08x}-2222-4222-8333-{i:012x}"), "controller": true, "blockOwnerDeletion": true}],
        "managedFields": managed_fields("kube-controller-manager")},
      "spec": {"schedulerName": "hami-scheduler", "nodeName": node_name, "restartPolicy": "Always",
        "serviceAccountName": "default", "terminationGracePeriodSeconds": 30, "dnsPolicy": "ClusterFirst",
        "containers": [{"name": "main", "image": format!("registry.example.com/{ns}/trainer:v3.1.{}", i % 10),
            "imagePullPolicy": "IfNotPresent", "env": env,
            "resources": {"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "8192", "nvidia.com/gpucores": "10",
                                     "cpu": "8", "memory": "64Gi"},
                          "requests": {"cpu": "4", "memory": "32Gi"}},
            "volumeMounts": [{"name": "data", "mountPath": "/data"},
                             {"name": "kube-api-access-abcde", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "readOnly": true}],
            "terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File"}],
        "volumes": [{"name": "data", "emptyDir": {}},
                    {"name": "kube-api-access-abcde", "projected": {"defaultMode": 420, "sources": [
                        {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}}]}}],
        "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
                        {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}]},
      "status": {"phase": "Running", "hostIP": "10.0.0.1", "podIP": format!("10.{}.{}.{}", node / 256, node % 256, i % 250),
        "startTime": "2026-11-30T09:00:02Z", "qosClass": "Burstable",
        "conditions": pod_conditions(),
        "containerStatuses": [{"name": "main", "ready": true, "started": true, "restartCount": 0,
            "image": format!("registry.example.com/{ns}/trainer:v3.1.{}", i % 10),
            "imageID": format!("registry.example.com/{ns}/trainer@sha256:{:064x}", i % 10),
            "containerID": format!("containerd://{:064x}", i),
            "state": {"running": {"startedAt": "2026-11-30T09:00:04Z"}}}]}})
}

/// A pod without GPUs (DaemonSet-like), listed and remembered by UID only.
fn other_pod_object(i: usize, node: usize) -> Value {
    let mut p = gpu_pod_object(i, node, 0);
    p["metadata"]["uid"] = json!(format!("{i:08x}-3333-4222-8333-{i:012x}"));
    p["metadata"]["name"] = json!(format!("node-agent-{i:06}"));
    if let Some(a) = p["metadata"].as_object_mut() {
        a.remove("annotations");
    }
    p["spec"]["containers"][0]["resources"] = json!({"limits": {"cpu": "1", "memory": "1Gi"}});
    p
}

thread_local! {
    /// Seconds spent decoding JSON text into typed objects (the daemon's share of a List).
    static DECODE_S: std::cell::Cell<f64> = const { std::cell::Cell::new(0.0) };
}

fn decode<T: serde::de::DeserializeOwned + Default>(v: Value) -> T {
    // As kube's watcher does: the API server's JSON text into the typed object.
    let text = v.to_string();
    let t = Instant::now();
    let out = serde_json::from_str(&text).unwrap_or_default();
    DECODE_S.with(|d| d.set(d.get() + t.elapsed().as_secs_f64()));
    out
}

fn arg(args: &[String], name: &str, default: usize) -> usize {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.replace('_', "").parse().ok())
        .unwrap_or(default)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let nodes_n = arg(&args, "--nodes", 1_000);
    let pods_n = arg(&args, "--pods", 10_000);
    let other_n = arg(&args, "--other-pods", 0);
    let full = args.iter().any(|a| a == "--full-objects");
    // What sync_term does with each listed object before buffering it.
    let keep_pod = |p: k8s_openapi::api::core::v1::Pod| if full { p } else { slim_pod(p) };
    let keep_node = |n: k8s_openapi::api::core::v1::Node| if full { n } else { slim_node(n) };
    let cfg = DecisionConfig::default();
    println!(
        "{nodes_n} nodes × {GPUS_PER_NODE} GPUs, {pods_n} running GPU pods (1 GPU, 8 GiB each), {other_n} other pods; List buffers hold {} objects",
        if full { "whole" } else { "reduced" }
    );
    {
        use k8s_openapi::api::core::v1 as core;
        use std::mem::size_of;
        println!(
            "size_of (inline, before heap data): Pod {} B, Node {} B, Container {} B, Volume {} B, EnvVar {} B, ContainerStatus {} B",
            size_of::<core::Pod>(),
            size_of::<core::Node>(),
            size_of::<core::Container>(),
            size_of::<core::Volume>(),
            size_of::<core::EnvVar>(),
            size_of::<core::ContainerStatus>(),
        );
    }
    let base = mem();
    report("start", base, base);

    // The List buffers sync_term collects before the rebuild.
    let t = Instant::now();
    let nodes: Vec<k8s_openapi::api::core::v1::Node> =
        (0..nodes_n).map(|n| keep_node(decode(node(n)))).collect();
    let nodes_listed = mem();
    report("node List buffer", nodes_listed, base);
    let mut pods: Vec<k8s_openapi::api::core::v1::Pod> = Vec::with_capacity(pods_n + other_n);
    for i in 0..pods_n {
        let n = i % nodes_n.max(1);
        let gpu = (i / nodes_n.max(1)) % GPUS_PER_NODE;
        pods.push(keep_pod(decode(gpu_pod_object(i, n, gpu))));
    }
    for i in 0..other_n {
        pods.push(keep_pod(decode(other_pod_object(i, i % nodes_n.max(1)))));
    }
    // With room at both sizes: the timed filters below are placed, as most filters are.
    let quotas: Vec<k8s_openapi::api::core::v1::ResourceQuota> = (0..50)
        .map(|i| {
            decode(json!({"metadata": {"namespace": format!("team-{i:02}"), "name": "gpu"},
                "spec": {"hard": {"limits.nvidia.com/gpumem": "10000000", "limits.nvidia.com/gpu": "100000"}}}))
        })
        .collect();
    let decode_s = DECODE_S.with(std::cell::Cell::get);
    let listed = mem();
    report(
        &format!(
            "+ pod and quota List buffers ({:.1} s)",
            t.elapsed().as_secs_f64()
        ),
        listed,
        base,
    );

    // Rebuild, then the buffers go away, as in sync_term.
    let mut engine = Engine::standalone(cfg.clone());
    let t = Instant::now();
    engine.rebuild(0, &nodes, &pods, &quotas);
    let rebuild_s = t.elapsed().as_secs_f64();
    // The webhook's facts, kept on every replica (from node metadata in the daemon).
    let mut facts = ClusterFacts::new();
    let recs: Vec<NodeRecord> = nodes
        .iter()
        .filter_map(|n| NodeRecord::from_node(n, &cfg))
        .collect();
    facts.replace_nodes(&recs);
    drop(recs);
    let rebuilt = mem();
    report(
        &format!("engine rebuilt, buffers still held ({rebuild_s:.2} s)"),
        rebuilt,
        base,
    );
    let names: Vec<String> = nodes
        .iter()
        .filter_map(|n| n.metadata.name.clone())
        .collect();
    drop(nodes);
    drop(pods);
    drop(quotas);
    let dropped = mem();
    report("List buffers dropped", dropped, base);

    // The first filter fills the per-node usage cache (every node's GPUs with usage applied).
    let pod = gpu_pod("team-00", "candidate", 1, 8192, 20);
    let t = Instant::now();
    let verdict = engine.filter(&pod, &names);
    let first_ms = t.elapsed().as_secs_f64() * 1e3;
    engine.filter_abort("uid-team-00-candidate");
    let placed = matches!(
        verdict,
        Ok(tessera_scheduler_core::decide::Verdict::Placed(_))
    );
    let steady = mem();
    report(
        &format!("first filter (usage cache built, {first_ms:.0} ms, placed: {placed})"),
        steady,
        base,
    );
    // A filter once the cache is built, of a pod whose namespace has a quota (its budget is
    // summed over the namespace's pods) and of one whose namespace has none, interleaved.
    let (mut quota_ms, mut free_ms) = (Vec::new(), Vec::new());
    for round in 0..21 {
        for (namespace, out) in [("team-01", &mut quota_ms), ("no-quota", &mut free_ms)] {
            let pod = gpu_pod(namespace, &format!("timed-{round}"), 1, 8192, 20);
            let t = Instant::now();
            let _ = engine.filter(&pod, &names);
            out.push(t.elapsed().as_secs_f64() * 1e3);
            engine.filter_abort(&format!("uid-{namespace}-timed-{round}"));
        }
    }
    let (quota_ms, free_ms) = (Stats::of(&quota_ms), Stats::of(&free_ms));
    // A metrics scrape on the leader takes a view of the state on the decision loop (no filter
    // or bind is decided meanwhile), then builds the rows and encodes them off the loop.
    let t = Instant::now();
    let view = engine.metrics();
    let snapshot_ms = t.elapsed().as_secs_f64() * 1e3;
    let exposition = Metrics::default();
    let t = Instant::now();
    let snap = view.expand();
    let (gpus_n, containers_n) = (snap.gpus.len(), snap.containers.len());
    let scraped = mem();
    let text = exposition.render(snap);
    let render_ms = t.elapsed().as_secs_f64() * 1e3;
    report(
        &format!(
            "a /metrics scrape ({gpus_n} GPUs, {containers_n} containers; {snapshot_ms:.2} ms on the decision loop)"
        ),
        scraped,
        base,
    );
    let during = mem();
    report(
        &format!(
            "after encoding it ({render_ms:.1} ms off the loop, {} lines, {:.1} MiB of text)",
            text.lines().count(),
            text.len() as f64 / 1_048_576.0
        ),
        during,
        base,
    );
    drop(text);
    report(
        "after the answer went (nothing of the scrape is kept)",
        mem(),
        base,
    );
    drop(exposition);

    // The webhook's read of the facts at this size.
    let review = json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {"uid": "r", "operation": "CREATE", "namespace": "team-01", "userInfo": {"username": "u"},
        "object": {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "main", "image": "x",
            "resources": {"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "90000"}}}]}}}})
    .to_string()
    .into_bytes();
    let wh = WebhookConfig {
        scheduler_name: "hami-scheduler".into(),
        force_overwrite_default_scheduler: true,
        ..Default::default()
    };
    let rounds = 2_000u32;
    let t = Instant::now();
    let mut denied = 0;
    for _ in 0..rounds {
        let a = webhook::handle(&review, &wh, &facts);
        if a.body["response"]["allowed"] == false {
            denied += 1;
        }
    }
    let per_call = t.elapsed().as_secs_f64() * 1e6 / f64::from(rounds);
    let t = Instant::now();
    let mut largest = 0u32;
    for _ in 0..rounds {
        largest = largest.max(facts.largest_gpu().map_or(0, |l| l.mem));
    }
    let per_lookup = t.elapsed().as_secs_f64() * 1e6 / f64::from(rounds);
    println!(
        "webhook at this size: {per_call:.1} µs per AdmissionReview ({denied}/{rounds} denied), largest-GPU lookup {per_lookup:.2} µs ({largest} MiB)"
    );
    println!(
        "steady state: VmRSS {:.1} MiB ({:.1} MiB above start); peak VmHWM {:.1} MiB",
        mib(scraped.rss_kib),
        mib(scraped.rss_kib.saturating_sub(base.rss_kib)),
        mib(scraped.hwm_kib)
    );
    let csv = Csv::open("memory");
    let case = format!(
        "{nodes_n} nodes x {GPUS_PER_NODE} GPUs; {pods_n} GPU pods; {other_n} other pods{}",
        if full { "; whole objects buffered" } else { "" }
    );
    let one = |x: f64| Stats::single(x);
    let steady = mib(scraped.rss_kib);
    let mut row = Row::new(
        case.clone(),
        "extender RSS steady (state + usage cache; List buffers dropped)",
        "MiB",
        one(steady),
    )
    .without_p99();
    if nodes_n == 1_000 && pods_n == 10_000 {
        row = row.goal("< 200 MiB", steady < 200.0);
    }
    csv.row(&row);
    csv.row(
        &Row::new(
            case.clone(),
            "extender peak RSS (VmHWM; List buffers held during the rebuild)",
            "MiB",
            one(mib(scraped.hwm_kib)),
        )
        .without_p99(),
    );
    csv.row(
        &Row::new(
            case.clone(),
            "a /metrics scrape: the state view (on the decision loop)",
            "ms",
            one(snapshot_ms),
        )
        .without_p99(),
    );
    csv.row(
        &Row::new(
            case.clone(),
            "a /metrics scrape: building and encoding the rows (off the loop)",
            "ms",
            one(render_ms),
        )
        .without_p99(),
    );
    csv.row(
        &Row::new(
            case.clone(),
            "extender RSS during a /metrics scrape (the encoded answer held)",
            "MiB",
            one(mib(during.rss_kib)),
        )
        .without_p99()
        .baseline(steady),
    );
    csv.row(
        &Row::new(
            case.clone(),
            "state rebuild after a leader change: decode the Lists' JSON + rebuild (API server List time not included)",
            "s",
            one(decode_s + rebuild_s),
        )
        .without_p99(),
    );
    csv.row(
        &Row::new(
            case.clone(),
            "  of which the loop's rebuild",
            "s",
            one(rebuild_s),
        )
        .without_p99(),
    );
    csv.row(
        &Row::new(
            case.clone(),
            "first filter after the rebuild (builds every node's usage cache)",
            "ms",
            one(first_ms),
        )
        .without_p99(),
    );
    csv.row(
        &Row::new(
            case.clone(),
            "a /filter in a namespace with a quota (baseline: one without)",
            "ms",
            quota_ms,
        )
        .baseline(free_ms.median),
    );
    csv.row(
        &Row::new(
            case,
            "webhook AdmissionReview with both cluster checks",
            "us",
            one(per_call),
        )
        .without_p99(),
    );
    // Keep the state alive until here.
    drop(engine);
}

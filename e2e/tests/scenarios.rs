//! Scenarios on the real control plane (issue #6). Each test owns a whole cluster; run them one
//! at a time (`--test-threads=1`): two cores cannot host several apiservers at once.
#![allow(
    clippy::disallowed_types,
    reason = "the e2e harness times real processes and clusters: wall-clock std::time::Instant"
)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::PostParams;
use tessera_e2e::cluster::{Cluster, ClusterOptions};
use tessera_e2e::eventually;
use tessera_e2e::node::NodeSpec;
use tessera_e2e::pods::{GpuRequest, gpu_pod};

const A100_MIB: u64 = 40960;

fn a100_nodes(n: usize, gpus: usize) -> Vec<NodeSpec> {
    (0..n)
        .map(|i| {
            NodeSpec::uniform(
                &format!("gpu-node-{i}"),
                gpus,
                "NVIDIA A100-SXM4-40GB",
                A100_MIB,
            )
        })
        .collect()
}

async fn start(opts: ClusterOptions) -> Cluster {
    match Cluster::start(opts).await {
        Ok(c) => c,
        Err(e) => panic!("cluster did not start: {e}"),
    }
}

async fn create_as_user(c: &Cluster, pod: &Pod) -> Result<Pod, kube::Error> {
    let ns = pod
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    Api::<Pod>::namespaced(c.user().clone(), &ns)
        .create(&PostParams::default(), pod)
        .await
}

/// Creates one pod per name, all at once (as a controller scaling up would); returns how many
/// the API server accepted.
async fn create_concurrently(c: &Cluster, names: &[String], req: GpuRequest) -> usize {
    let creates = names.iter().map(|n| {
        let pod = gpu_pod("default", n, req);
        async move { create_as_user(c, &pod).await }
    });
    futures::future::join_all(creates)
        .await
        .into_iter()
        .filter(Result::is_ok)
        .count()
}

/// Waits until every named pod of `default` is admitted by its node; returns them by name.
async fn wait_admitted(
    c: &Cluster,
    names: &[String],
    within: Duration,
) -> BTreeMap<String, (Pod, tessera_e2e::node::Admitted)> {
    let r = eventually(
        "pods admitted",
        within,
        Duration::from_millis(200),
        || async {
            let pods = c.pods("default").await.ok()?;
            let mut out = BTreeMap::new();
            for p in pods {
                let name = p.metadata.name.clone().unwrap_or_default();
                if !names.contains(&name) {
                    continue;
                }
                let uid = p.metadata.uid.clone().unwrap_or_default();
                let a = c.admitted(&uid)?;
                out.insert(name, (p, a));
            }
            (out.len() == names.len()).then_some(out)
        },
    )
    .await;
    match r {
        Ok(v) => v,
        Err(e) => panic!("{e}\n{}", c.logs_tail(15)),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn full_pipeline_gives_each_container_the_limit_its_pod_asked_for() {
    let c = start(ClusterOptions::new("pipeline", a100_nodes(2, 4))).await;
    let cases: Vec<(&str, GpuRequest, u64, Option<&str>)> = vec![
        ("mem-3000", GpuRequest::mem(1, 3000), 3000, None),
        (
            "mem-pct-25",
            GpuRequest {
                count: 1,
                mem_percentage: Some(25),
                ..Default::default()
            },
            A100_MIB / 4,
            None,
        ),
        (
            "cores-30",
            GpuRequest::mem(1, 2048).with_cores(30),
            2048,
            Some("30"),
        ),
        ("two-gpus", GpuRequest::mem(2, 4096), 4096, None),
        ("whole-card", GpuRequest::whole(1), A100_MIB, None),
        ("mem-1000", GpuRequest::mem(1, 1000), 1000, None),
    ];
    for (name, req, _, _) in &cases {
        let pod = gpu_pod("default", name, *req);
        if let Err(e) = create_as_user(&c, &pod).await {
            panic!("create {name}: {e}");
        }
    }
    let names: Vec<String> = cases.iter().map(|c| c.0.to_owned()).collect();
    let admitted = wait_admitted(&c, &names, Duration::from_secs(90)).await;
    for (name, req, mem_mib, cores) in &cases {
        let (pod, a) = &admitted[*name];
        assert_eq!(
            pod.spec.as_ref().and_then(|s| s.scheduler_name.as_deref()),
            Some("hami-scheduler"),
            "{name}: the webhook routes GPU pods to Tessera"
        );
        assert_eq!(a.containers.len(), 1, "{name}");
        let ctr = &a.containers[0];
        let envs = &ctr.response.envs;
        for i in 0..req.count {
            assert_eq!(
                envs.get(&format!("CUDA_DEVICE_MEMORY_LIMIT_{i}"))
                    .map(String::as_str),
                Some(format!("{mem_mib}m").as_str()),
                "{name}: memory limit of GPU {i}; env {envs:?}"
            );
        }
        if let Some(cores) = cores {
            assert_eq!(
                envs.get("CUDA_DEVICE_SM_LIMIT").map(String::as_str),
                Some(*cores),
                "{name}"
            );
        }
        // The shim, loaded as Allocate's mounts load it, enforces exactly that limit: the whole
        // limit can be allocated and one byte more cannot.
        let bytes = (mem_mib << 20).to_string();
        let out = c
            .run_container(ctr, A100_MIB, &["limit", &bytes])
            .expect("run probe");
        assert!(
            out.status.success(),
            "{name}: probe under the pod's environment:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

async fn all_nodes(c: &Cluster) -> Vec<k8s_openapi::api::core::v1::Node> {
    Api::<k8s_openapi::api::core::v1::Node>::all(c.admin().clone())
        .list(&Default::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
}

async fn assert_no_overbooking(c: &Cluster) {
    let pods = c.pods("default").await.expect("list pods");
    let v = tessera_e2e::booking::violations(&all_nodes(c).await, &pods);
    assert!(v.is_empty(), "over-booked GPUs:\n{}", v.join("\n"));
}

fn uid(p: &Pod) -> String {
    p.metadata.uid.clone().unwrap_or_default()
}

/// 100 replicas of one Deployment-style pod onto one 8-GPU node (split 16, so 128 slots).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn burst_of_100_pods_onto_one_node_all_get_their_limits() {
    let node =
        NodeSpec::uniform("gpu-node-0", 8, "NVIDIA A100-SXM4-40GB", A100_MIB).with_split_count(16);
    let c = start(ClusterOptions::new("burst", vec![node])).await;
    let started = Instant::now();
    let names: Vec<String> = (0..100).map(|i| format!("burst-{i:03}")).collect();
    let req = GpuRequest::mem(1, 2000).with_cores(5);
    assert_eq!(create_concurrently(&c, &names, req).await, names.len());
    let admitted = wait_admitted(&c, &names, Duration::from_secs(240)).await;
    let took = started.elapsed();
    eprintln!(
        "e2e burst: 100 pods bound and allocated on one node in {:.2} s",
        took.as_secs_f64()
    );
    for (name, (_, a)) in &admitted {
        let envs = &a.containers[0].response.envs;
        assert_eq!(
            envs.get("CUDA_DEVICE_MEMORY_LIMIT_0").map(String::as_str),
            Some("2000m"),
            "{name}"
        );
        assert_eq!(
            envs.get("CUDA_DEVICE_SM_LIMIT").map(String::as_str),
            Some("5"),
            "{name}"
        );
    }
    assert_no_overbooking(&c).await;
}

/// A whole-card pod waits for a busy single-GPU node and is placed within seconds of the
/// blocking pod's deletion, not after kube-scheduler's 5-minute unschedulable timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pending_pod_is_scheduled_promptly_when_capacity_frees() {
    let c = start(ClusterOptions::new("requeue", a100_nodes(1, 1))).await;
    let whole = GpuRequest::whole(1);
    create_as_user(&c, &gpu_pod("default", "blocker", whole))
        .await
        .expect("create");
    wait_admitted(&c, &["blocker".to_owned()], Duration::from_secs(60)).await;
    create_as_user(&c, &gpu_pod("default", "waiter", whole))
        .await
        .expect("create");
    let api: Api<Pod> = Api::namespaced(c.admin().clone(), "default");
    // Let kube-scheduler try and fail a few times, so the pod sits in its unschedulable queue.
    tokio::time::sleep(Duration::from_secs(8)).await;
    let waiter = api.get("waiter").await.expect("get");
    assert!(
        tessera_e2e::pods::node_of(&waiter).is_none(),
        "waiter must not fit yet"
    );
    let deleted = Instant::now();
    api.delete("blocker", &Default::default())
        .await
        .expect("delete");
    wait_admitted(&c, &["waiter".to_owned()], Duration::from_secs(60)).await;
    let took = deleted.elapsed();
    eprintln!(
        "e2e requeue: waiter placed {:.2} s after the blocker's deletion",
        took.as_secs_f64()
    );
    assert!(
        took < Duration::from_secs(20),
        "requeue took {took:?}\n{}",
        c.logs_tail(20)
    );
}

/// A namespace budget (`limits.nvidia.com/gpumem: 10000`) under a burst of 3000 MiB pods admits
/// exactly three.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn namespace_budget_admits_exactly_what_fits_under_a_burst() {
    let c = start(ClusterOptions::new("budget", a100_nodes(2, 4))).await;
    let quota: k8s_openapi::api::core::v1::ResourceQuota =
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "gpu-budget", "namespace": "default"},
            "spec": {"hard": {"limits.nvidia.com/gpumem": "10000"}},
        }))
        .expect("quota");
    Api::<k8s_openapi::api::core::v1::ResourceQuota>::namespaced(c.admin().clone(), "default")
        .create(&PostParams::default(), &quota)
        .await
        .expect("create quota");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let names: Vec<String> = (0..10).map(|i| format!("budget-{i}")).collect();
    assert_eq!(
        create_concurrently(&c, &names, GpuRequest::mem(1, 3000)).await,
        names.len()
    );
    let bound = eventually(
        "three pods bound",
        Duration::from_secs(60),
        Duration::from_millis(300),
        || async {
            let pods = c.pods("default").await.ok()?;
            let n = pods
                .iter()
                .filter(|p| tessera_e2e::pods::node_of(p).is_some())
                .count();
            (n >= 3).then_some(n)
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", c.logs_tail(20)));
    // Give the rest every chance to be (wrongly) placed.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let pods = c.pods("default").await.expect("list");
    let bound_now = pods
        .iter()
        .filter(|p| tessera_e2e::pods::node_of(p).is_some())
        .count();
    assert_eq!(
        (bound, bound_now),
        (3, 3),
        "3 x 3000 MiB fit in 10000 MiB, a 4th does not"
    );
}

/// Scheduler-owned annotations from a user are refused on create and on update.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn forged_allocation_annotations_are_denied() {
    let c = start(ClusterOptions::new("forged", a100_nodes(1, 2))).await;
    let mut pod = gpu_pod("default", "forger", GpuRequest::mem(1, 1000));
    pod.metadata.annotations = Some(
        [(
            "hami.io/vgpu-devices-allocated".to_owned(),
            "GPU-00000000-0000-4000-8000-000000000000,NVIDIA,40960,100:;".to_owned(),
        )]
        .into(),
    );
    let err = create_as_user(&c, &pod)
        .await
        .expect_err("forged create must be denied");
    let msg = err.to_string();
    assert!(msg.contains("hami.io/vgpu-devices-allocated"), "{msg}");
    // A plain pod carrying the annotation is refused too (the chart's match conditions send it).
    let mut plain = tessera_e2e::pods::plain_pod("default", "plain-forger");
    plain.metadata.annotations = pod.metadata.annotations.clone();
    create_as_user(&c, &plain)
        .await
        .expect_err("forged plain pod must be denied");
    // An honest pod, then a forged update of it.
    create_as_user(&c, &gpu_pod("default", "honest", GpuRequest::mem(1, 1000)))
        .await
        .expect("create");
    let api: Api<Pod> = Api::namespaced(c.user().clone(), "default");
    let patch = serde_json::json!({"metadata": {"annotations": {"hami.io/bind-phase": "success"}}});
    let err = api
        .patch(
            "honest",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await
        .expect_err("forged update must be denied");
    assert!(err.to_string().contains("hami.io/bind-phase"), "{err}");
}

/// An XID on one GPU takes it out of placement; after recovery it takes pods again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failed_gpu_is_avoided_and_comes_back_after_recovery() {
    let c = start(ClusterOptions::new("xid", a100_nodes(1, 2))).await;
    let node = c.node("gpu-node-0").expect("node");
    let bad = node.spec.gpus[0].uuid.clone();
    let good = node.spec.gpus[1].uuid.clone();
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(c.admin().clone());
    let register_health = |uuid: String| {
        let nodes = nodes.clone();
        async move {
            let n = nodes.get("gpu-node-0").await.ok()?;
            let v = n
                .metadata
                .annotations
                .as_ref()?
                .get(hami_contract::annotations::NODE_REGISTER)?
                .clone();
            let devs = hami_contract::node::decode_node_devices(&v).ok()?;
            devs.iter().find(|d| d.id == uuid).map(|d| d.health)
        }
    };
    node.nvml_event(serde_json::json!({"device": 0, "kind": "xid", "xid": 48}))
        .expect("event");
    eventually(
        "GPU 0 unhealthy in the register annotation",
        Duration::from_secs(30),
        Duration::from_millis(200),
        || {
            let f = register_health(bad.clone());
            async move { (f.await == Some(false)).then_some(()) }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", c.logs_tail(20)));
    let whole = GpuRequest::whole(1);
    create_as_user(&c, &gpu_pod("default", "first", whole))
        .await
        .expect("create");
    let a = wait_admitted(&c, &["first".to_owned()], Duration::from_secs(60)).await;
    let alloc = tessera_e2e::pods::annotation(&a["first"].0, "hami.io/vgpu-devices-allocated")
        .unwrap_or("")
        .to_owned();
    assert!(
        alloc.contains(&good) && !alloc.contains(&bad),
        "placed on the healthy GPU: {alloc}"
    );
    // The failed GPU recovers (no error for the recovery period); a second whole card fits again.
    create_as_user(&c, &gpu_pod("default", "second", whole))
        .await
        .expect("create");
    let a = wait_admitted(&c, &["second".to_owned()], Duration::from_secs(90)).await;
    let alloc = tessera_e2e::pods::annotation(&a["second"].0, "hami.io/vgpu-devices-allocated")
        .unwrap_or("")
        .to_owned();
    assert!(alloc.contains(&bad), "placed on the recovered GPU: {alloc}");
    // Both changes are Events on the node, for `kubectl describe node`.
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(c.admin().clone(), "default");
    eventually(
        "GPUUnhealthy and GPURecovered events on the node",
        Duration::from_secs(30),
        Duration::from_millis(500),
        || {
            let events = events.clone();
            let bad = bad.clone();
            async move {
                let list = events.list(&Default::default()).await.ok()?;
                let on_node = |reason: &str, kind: &str| {
                    list.items.iter().any(|e| {
                        e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("gpu-node-0")
                            && e.reason.as_deref() == Some(reason)
                            && e.type_.as_deref() == Some(kind)
                            && e.note.as_deref().is_some_and(|n| n.contains(&bad))
                    })
                };
                (on_node("GPUUnhealthy", "Warning") && on_node("GPURecovered", "Normal"))
                    .then_some(())
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", c.logs_tail(20)));
}

/// Kubelet restart: the plugin registers again and new pods are still allocated.
/// Extender restart and apiserver restart: nothing booked is lost or doubled, and both daemons
/// go on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn restarts_of_kubelet_extender_and_apiserver_lose_nothing() {
    let mut c = start(ClusterOptions::new("restarts", a100_nodes(2, 2))).await;
    let first: Vec<String> = (0..4).map(|i| format!("before-{i}")).collect();
    for n in &first {
        create_as_user(&c, &gpu_pod("default", n, GpuRequest::mem(1, 10000)))
            .await
            .expect("create");
    }
    let before = wait_admitted(&c, &first, Duration::from_secs(90)).await;
    let allocations: BTreeMap<String, String> = before
        .iter()
        .map(|(n, (p, _))| {
            (
                n.clone(),
                tessera_e2e::pods::annotation(p, "hami.io/vgpu-devices-allocated")
                    .unwrap_or("")
                    .to_owned(),
            )
        })
        .collect();

    // Kubelet restart on node 0.
    let regs = c.nodes[0].registrations();
    c.nodes[0].restart_kubelet();
    eventually(
        "the plugin registers again",
        Duration::from_secs(30),
        Duration::from_millis(100),
        || {
            let n = c.nodes[0].registrations();
            async move { (n > regs).then_some(()) }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", c.nodes[0].plugin_log()));

    // Extender restart while pods arrive.
    let during: Vec<String> = (0..4).map(|i| format!("during-{i}")).collect();
    for n in &during[..2] {
        create_as_user(&c, &gpu_pod("default", n, GpuRequest::mem(1, 10000)))
            .await
            .expect("create");
    }
    c.restart_tessera(0).expect("restart tessera");
    for n in &during[2..] {
        // The webhook is down for a moment: the chart's failurePolicy Fail refuses, the user
        // (a controller, in real life) retries.
        let pod = gpu_pod("default", n, GpuRequest::mem(1, 10000));
        eventually(
            "create while the extender restarts",
            Duration::from_secs(30),
            Duration::from_millis(300),
            || async { create_as_user(&c, &pod).await.ok().map(|_| ()) },
        )
        .await
        .expect("create");
    }
    let after = wait_admitted(&c, &during, Duration::from_secs(120)).await;
    assert_eq!(after.len(), 4);

    // Apiserver restart; then one more pod goes all the way through.
    c.restart_apiserver(Duration::from_secs(3))
        .await
        .expect("apiserver back");
    let pods = c.pods("default").await.expect("list");
    for p in &pods {
        let name = p.metadata.name.clone().unwrap_or_default();
        if let Some(want) = allocations.get(&name) {
            assert_eq!(
                tessera_e2e::pods::annotation(p, "hami.io/vgpu-devices-allocated").unwrap_or(""),
                want,
                "{name} kept its GPUs"
            );
            assert!(c.admitted(&uid(p)).is_some(), "{name} still admitted");
        }
    }
    // 8 pods x 10000 MiB on 4 x 40960 MiB: full. Free one, then a new pod must be placed.
    Api::<Pod>::namespaced(c.admin().clone(), "default")
        .delete("before-0", &Default::default())
        .await
        .expect("delete");
    let last = vec!["after-apiserver".to_owned()];
    eventually(
        "create after the apiserver restart",
        Duration::from_secs(30),
        Duration::from_millis(300),
        || async {
            create_as_user(&c, &gpu_pod("default", &last[0], GpuRequest::mem(1, 10000)))
                .await
                .ok()
                .map(|_| ())
        },
    )
    .await
    .expect("create");
    wait_admitted(&c, &last, Duration::from_secs(90)).await;
    assert_no_overbooking(&c).await;
}

/// 500 pods race for 64 GPUs on 8 nodes (room for 320) with two scheduler pods; the leading one
/// is killed mid-run. Afterwards no GPU holds more than its count, memory or cores, and the
/// survivor has placed what fits.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_overbooking_with_two_replicas_and_the_leader_killed() {
    let mut opts = ClusterOptions::new("overbooking", a100_nodes(8, 8));
    opts.scheduler_pods = 2;
    let mut c = start(opts).await;
    let leader = c.wait_leader().await.expect("leader");
    let names: Vec<String> = (0..500).map(|i| format!("race-{i:03}")).collect();
    let req = GpuRequest::mem(1, 8000).with_cores(20);
    let mut created = 0;
    for chunk in names.chunks(50) {
        created += create_concurrently(&c, chunk, req).await;
        if created >= 250 && c.scheduler_pods[leader].is_up() {
            c.kill_scheduler_pod(leader);
            eprintln!("e2e overbooking: killed scheduler pod {leader} after {created} creates");
        }
    }
    assert!(created >= 250, "created {created}");
    let survivor = c.wait_leader().await.expect("a new leader");
    assert_ne!(survivor, leader);
    // Wait until placement settles: every GPU slot the pods can use is taken, or nothing moves.
    let mut last = usize::MAX;
    let mut stable = 0;
    for _ in 0..120 {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let pods = c.pods("default").await.expect("list");
        let bound = pods
            .iter()
            .filter(|p| tessera_e2e::pods::node_of(p).is_some())
            .count();
        if bound == last {
            stable += 1;
        } else {
            stable = 0;
        }
        last = bound;
        if bound >= 320 || stable >= 10 {
            break;
        }
    }
    eprintln!("e2e overbooking: {last} of {created} pods bound (320 fit)");
    assert_no_overbooking(&c).await;
    assert_eq!(
        last,
        320,
        "every slot is used once the survivor leads\n{}",
        c.logs_tail(20)
    );
}

/// POSTs `body` to one scheduler pod's extender as kube-scheduler does (mutual TLS with the
/// extender client certificate), with curl.
async fn extender_post(c: &Cluster, pod: usize, path: &str, body: &serde_json::Value) -> String {
    let port = c.scheduler_pods[pod].extender_port;
    let out = tokio::process::Command::new("curl")
        .args([
            "-sS",
            "--max-time",
            "20",
            "-H",
            "Content-Type: application/json",
        ])
        .arg("--cacert")
        .arg(c.dir.join("ca.crt"))
        .arg("--cert")
        .arg(c.dir.join("extender-client.crt"))
        .arg("--key")
        .arg(c.dir.join("extender-client.key"))
        .args(["--data-binary", &body.to_string()])
        .arg(format!("https://127.0.0.1:{port}{path}"))
        .output()
        .await
        .expect("curl runs");
    assert!(
        out.status.success(),
        "curl {path}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn scheduler_annotations(p: &Pod) -> BTreeMap<String, String> {
    p.metadata
        .annotations
        .iter()
        .flatten()
        .filter(|(k, _)| k.starts_with("hami.io/"))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// Issue 15, item 1: `/filter` writes nothing, and the Binding carries the decision. Every
/// version of a pod on a watch, from its creation: none before the bind carries a `hami.io/`
/// annotation, and the first one with `spec.nodeName` carries all the device plugin reads. Then
/// the leader filters a pod, is killed, and the new leader binds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_binding_carries_the_decision_and_filter_writes_nothing() {
    use futures::StreamExt;
    use hami_contract::annotations as ann;
    let mut opts = ClusterOptions::new("one-write", a100_nodes(1, 2));
    opts.scheduler_pods = 2;
    let mut c = start(opts).await;
    let leader = c.wait_leader().await.expect("leader");

    // 1. Through kube-scheduler, watched from before the create.
    let api: Api<Pod> = Api::namespaced(c.admin().clone(), "default");
    let params = kube::api::WatchParams::default().fields("metadata.name=watched");
    let mut stream = api.watch(&params, "0").await.expect("watch").boxed();
    let versions = tokio::spawn(async move {
        let mut seen: Vec<Pod> = Vec::new();
        while let Some(Ok(ev)) = stream.next().await {
            if let kube::api::WatchEvent::Added(p) | kube::api::WatchEvent::Modified(p) = ev {
                let bound = tessera_e2e::pods::node_of(&p).is_some();
                seen.push(p);
                if bound {
                    break;
                }
            }
        }
        seen
    });
    let req = GpuRequest::mem(1, 3000).with_cores(30);
    create_as_user(&c, &gpu_pod("default", "watched", req))
        .await
        .expect("create");
    let seen = tokio::time::timeout(Duration::from_secs(60), versions)
        .await
        .expect("the pod is bound within a minute")
        .expect("watch task");
    let (bound, before) = seen.split_last().expect("versions");
    for p in before {
        assert_eq!(
            scheduler_annotations(p),
            BTreeMap::new(),
            "an unbound version carries part of the decision"
        );
    }
    let a = scheduler_annotations(bound);
    assert_eq!(a[ann::VGPU_NODE], "gpu-node-0");
    assert_eq!(a[ann::BIND_PHASE], ann::BIND_PHASE_ALLOCATING, "{a:?}");
    assert!(a.contains_key(ann::BIND_TIME) && a.contains_key(ann::VGPU_TIME));
    assert!(
        a[ann::DEVICES_ALLOCATED].contains(",NVIDIA,3000,30:"),
        "{a:?}"
    );
    assert_eq!(a[ann::DEVICES_ALLOCATED], a[ann::DEVICES_TO_ALLOCATE]);
    wait_admitted(&c, &["watched".to_owned()], Duration::from_secs(60)).await;

    // 2. Filtered by the leader, which then dies; bound by the next one. The pod names a
    //    scheduler nobody runs, so only these calls place it (and the device plugin, which
    //    trusts only the GPU scheduler's pods, will not run it: the Binding is what is checked).
    let mut pod = gpu_pod(
        "default",
        "handover",
        GpuRequest::mem(1, 4000).with_cores(20),
    );
    pod.spec.as_mut().expect("spec").scheduler_name = Some("e2e-manual".to_owned());
    let pod = create_as_user(&c, &pod).await.expect("create");
    let filter = serde_json::json!({"Pod": pod, "Nodes": null, "NodeNames": ["gpu-node-0"]});
    let out = extender_post(&c, leader, "/filter", &filter).await;
    assert!(out.contains(r#""NodeNames":["gpu-node-0"]"#), "{out}");
    let stored = api.get("handover").await.expect("get");
    assert_eq!(
        scheduler_annotations(&stored),
        BTreeMap::new(),
        "filter wrote"
    );
    c.kill_scheduler_pod(leader);
    let next = c.wait_leader().await.expect("a new leader");
    assert_ne!(next, leader);
    let bind = serde_json::json!({
        "PodName": "handover", "PodNamespace": "default",
        "PodUID": pod.metadata.uid, "Node": "gpu-node-0",
    });
    let out = extender_post(&c, next, "/bind", &bind).await;
    assert_eq!(out, r#"{"Error":""}"#);
    let bound = api.get("handover").await.expect("get");
    assert_eq!(
        tessera_e2e::pods::node_of(&bound).as_deref(),
        Some("gpu-node-0")
    );
    let a = scheduler_annotations(&bound);
    assert!(
        a[ann::DEVICES_ALLOCATED].contains(",NVIDIA,4000,20:"),
        "{a:?}"
    );
    assert_eq!(a[ann::BIND_PHASE], ann::BIND_PHASE_ALLOCATING);
    // Both pods booked on the node's two GPUs, within capacity.
    assert_no_overbooking(&c).await;
}

/// The README's first command's pods on harness nodes, submitted in file order as `make demo`
/// submits them to its real nodes (`e2e/tests/demo.rs`): they land where the table says, and the
/// two that cannot be placed say why.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn demo_places_the_example_pods_and_explains_the_rest() {
    let file = tessera_e2e::artifacts::workspace_root().join("examples/demo/pods.yaml");
    let (cluster, rows) = match tessera_e2e::demo::run_harness(&file).await {
        Ok(v) => v,
        Err(e) => panic!("demo: {e}"),
    };
    let table = tessera_e2e::demo::render(&rows);
    eprintln!("{table}");
    let row = |n: &str| {
        rows.iter()
            .find(|r| r.pod == n)
            .unwrap_or_else(|| panic!("{n} missing\n{table}"))
    };
    let node = |n: &str| {
        row(n)
            .node
            .clone()
            .unwrap_or_else(|| panic!("{n} not placed\n{table}\n{}", cluster.logs_tail(10)))
    };
    assert_eq!(node("whole-h100"), "h100-node", "{table}");
    assert_eq!(node("notebook"), "t4-node", "{table}");
    assert_eq!(node("a100-only"), "a100-node", "{table}");
    for inference in ["inference-a", "inference-b"] {
        assert_ne!(node(inference), "h100-node", "{table}");
    }
    assert!(
        row("too-big")
            .why
            .contains("no GPU in the cluster has that much"),
        "{table}"
    );
    let four = row("four-whole-cards");
    assert!(
        four.node.is_none() && four.why.contains("nodes are available"),
        "{table}"
    );
}

/// The chart runs kube-scheduler and tessera-scheduler in one pod, and kube-scheduler only calls
/// its own pod's extender. When kube-scheduler's leadership moves to the other pod while the
/// extender's stays, the extender hands its lease over, so pods are still placed (without that,
/// nothing would ever be scheduled again).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn extender_leadership_follows_kube_scheduler_to_the_other_pod() {
    let mut opts = ClusterOptions::new("follow-lease", a100_nodes(1, 2));
    opts.scheduler_pods = 2;
    let mut c = start(opts).await;
    assert_eq!(
        c.wait_leader().await.expect("leader"),
        0,
        "pod 0 started first and leads"
    );
    let holder = |leases: &[(String, String)]| {
        leases
            .iter()
            .find(|(l, _)| l == tessera_e2e::cluster::KUBE_SCHEDULER_LEASE)
            .map(|(_, h)| h.clone())
            .unwrap_or_default()
    };
    assert!(holder(&c.leases().await).starts_with("tessera-scheduler-0_"));
    c.kill_kube_scheduler(0);
    let moved = Instant::now();
    let r = eventually(
        "tessera leadership in pod 1",
        Duration::from_secs(60),
        Duration::from_millis(200),
        || async { (c.leader().await == Some(1)).then_some(()) },
    )
    .await;
    if let Err(e) = r {
        panic!("{e}\nleases: {:?}\n{}", c.leases().await, c.logs_tail(15));
    }
    eprintln!(
        "e2e follow-lease: extender leadership moved {:.1} s after kube-scheduler 0 died",
        moved.elapsed().as_secs_f64()
    );
    assert!(holder(&c.leases().await).starts_with("tessera-scheduler-1_"));
    create_as_user(
        &c,
        &gpu_pod("default", "after-move", GpuRequest::mem(1, 1000)),
    )
    .await
    .expect("create");
    wait_admitted(&c, &["after-move".to_owned()], Duration::from_secs(60)).await;
}

/// `topology-aware` on a DGX-1-style node: the device plugin writes `hami.io/node-nvidia-score`
/// from the fake NVML's NVLinks and PCIe tree (`--enable-topology-score`), and a 2-GPU pod gets
/// two GPUs joined by NVLink, where `spread` alone would not look at links.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn topology_aware_pods_get_gpus_joined_by_nvlink() {
    let path = tessera_e2e::artifacts::workspace_root()
        .join("examples/device-plugin/fake-nvml-dgx1-nvlink.json");
    let text = std::fs::read_to_string(&path).expect("scenario");
    let node = NodeSpec::from_scenario("dgx-node", &text)
        .expect("scenario")
        .with_plugin_args(&["--enable-topology-score"]);
    let mut opts = ClusterOptions::new("topology", vec![node]);
    opts.tessera_args = vec!["--gpu-scheduler-policy=topology-aware".to_owned()];
    let c = start(opts).await;
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(c.admin().clone());
    let score = eventually(
        "the plugin's hami.io/node-nvidia-score",
        Duration::from_secs(30),
        Duration::from_millis(200),
        || {
            let nodes = nodes.clone();
            async move {
                let n = nodes.get("dgx-node").await.ok()?;
                n.metadata
                    .annotations?
                    .get(hami_contract::annotations::NODE_SCORE)
                    .cloned()
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", c.logs_tail(20)));
    assert!(score.contains("GPU-dgx1-"), "{score}");

    create_as_user(&c, &gpu_pod("default", "pair", GpuRequest::whole(2)))
        .await
        .expect("create");
    let a = wait_admitted(&c, &["pair".to_owned()], Duration::from_secs(60)).await;
    let alloc = tessera_e2e::pods::annotation(&a["pair"].0, "hami.io/vgpu-devices-allocated")
        .unwrap_or("")
        .to_owned();
    // NVLinks between the two chosen GPUs, counted from the scenario itself.
    let scenario: serde_json::Value = serde_json::from_str(&text).expect("json");
    let devices = scenario["devices"].as_array().expect("devices");
    let bus_of = |uuid: &str| {
        devices
            .iter()
            .find(|d| d["uuid"] == uuid)
            .and_then(|d| d["pci_bus_id"].as_str())
            .unwrap_or_default()
            .to_owned()
    };
    let chosen: Vec<&str> = alloc
        .split([';', ':'])
        .filter_map(|entry| entry.split(',').next())
        .filter(|u| u.starts_with("GPU-"))
        .collect();
    assert_eq!(chosen.len(), 2, "{alloc}");
    let links = devices
        .iter()
        .find(|d| d["uuid"] == chosen[0])
        .and_then(|d| d["nvlinks"].as_array())
        .map(|l| {
            l.iter()
                .filter(|link| link["remote_pci_bus_id"] == bus_of(chosen[1]).as_str())
                .count()
        })
        .unwrap_or(0);
    assert!(
        links >= 2,
        "topology-aware chose {chosen:?} with {links} NVLink(s) between them: {alloc}\nscore: {score}"
    );
}

/// Issue 30 on the real kube-scheduler (v1.34): a pod of priority 100 that needs both CPU and
/// GPU memory on a node held by lower-priority pods. kube-scheduler's own dry run picks the victim
/// its CPU needs (`low-a`: `low-b` is more important and is put back first); the extender's
/// `/preempt` adds the GPU pod whose slice is also needed (`low-b`) and never the higher-priority
/// tenant (`keep`). Both are evicted,
/// the pod is placed, and `keep` is untouched. A pod asking more cards than the node has is beyond
/// preemption and evicts nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn preemption_evicts_the_gpu_slice_kube_scheduler_alone_would_not_free() {
    let c = start(ClusterOptions::new("preempt", a100_nodes(1, 1))).await;
    priority_classes(
        &c,
        &[("low", 10), ("lowish", 20), ("mid", 100), ("top", 1000)],
    )
    .await;
    let pod = prioritized_pod;
    // (name, class, CPU, GPU MiB): 40,000 of the A100's 40,960 MiB and 41 of the node's 64 CPUs.
    place_in_order(
        &c,
        vec![
            pod("low-a", "low", 10, 8000),
            pod("low-b", "lowish", 30, 28000),
            pod("keep", "top", 1, 4000),
        ],
    )
    .await;
    let keep_uid = {
        let api: Api<Pod> = Api::namespaced(c.admin().clone(), "default");
        uid(&api.get("keep").await.expect("keep"))
    };
    // 30 CPUs: kube-scheduler must free 7; evicting low-a (10) does. 20,000 MiB: evicting low-a
    // frees 8,000, so low-b's 28,000 must go too; keep outranks the pod.
    place_in_order(&c, vec![pod("urgent", "mid", 30, 20000)]).await;
    let pods = c.pods("default").await.expect("pods");
    let alive = alive_pods(&c).await;
    assert!(
        !alive.contains(&"low-a".to_owned()) && !alive.contains(&"low-b".to_owned()),
        "both low-priority tenants evicted: {alive:?}"
    );
    let keep = pods
        .iter()
        .find(|p| p.metadata.name.as_deref() == Some("keep"))
        .expect("keep still exists");
    assert_eq!(uid(keep), keep_uid, "keep was never recreated");
    assert!(keep.metadata.deletion_timestamp.is_none());
    let urgent = pods
        .iter()
        .find(|p| p.metadata.name.as_deref() == Some("urgent"))
        .expect("urgent");
    assert!(tessera_e2e::pods::node_of(urgent).is_some());
    // The preemptor's Event names the GPU slice and both victims.
    let message = preemption_event(&c, "urgent").await;
    assert!(
        message.contains("evicting default/low-b (priority 20) frees GPU-")
            && message.contains("with 1 pod(s) kube-scheduler chose"),
        "{message}"
    );
    // Each victim is told which slice its eviction frees.
    for (victim, mib) in [("low-a", 8000), ("low-b", 28000)] {
        let message = pod_event(&c, victim, "GPUSlicePreempted").await;
        assert!(
            message.contains(&format!(" {mib} MiB ")) && message.contains("on node gpu-node-0"),
            "{victim}: {message}"
        );
    }
    // Two cards on a one-card node: beyond preemption (the webhook already refuses a card larger
    // than any), so nothing is evicted, whatever the priority.
    let mut pair = pod("pair", "top", 1, 1000);
    pair.spec.as_mut().expect("spec").containers[0]
        .resources
        .as_mut()
        .and_then(|r| r.limits.as_mut())
        .expect("limits")
        .insert(
            "nvidia.com/gpu".into(),
            k8s_openapi::apimachinery::pkg::api::resource::Quantity("2".into()),
        );
    create_as_user(&c, &pair).await.expect("create");
    tokio::time::sleep(Duration::from_secs(8)).await;
    let api: Api<Pod> = Api::namespaced(c.admin().clone(), "default");
    let pair = api.get("pair").await.expect("pair");
    assert!(tessera_e2e::pods::node_of(&pair).is_none());
    for name in ["keep", "urgent"] {
        let p = api.get(name).await.expect("still there");
        assert!(
            p.metadata.deletion_timestamp.is_none(),
            "{name} evicted for nothing"
        );
    }
    assert_no_overbooking(&c).await;
}

/// Creates PriorityClasses `(name, value)`.
async fn priority_classes(c: &Cluster, classes: &[(&str, i32)]) {
    use k8s_openapi::api::scheduling::v1::PriorityClass;
    let api: Api<PriorityClass> = Api::all(c.admin().clone());
    for (name, value) in classes {
        let pc: PriorityClass = serde_json::from_value(serde_json::json!({
            "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
            "metadata": {"name": name}, "value": value}))
        .expect("class");
        api.create(&PostParams::default(), &pc)
            .await
            .expect("create class");
    }
}

/// A pod of `default` in priority class `class` asking `cpu` CPUs and one GPU of `mib` MiB,
/// labelled `app: <name>`.
fn prioritized_pod(name: &str, class: &str, cpu: u32, mib: u64) -> Pod {
    let mut p = gpu_pod("default", name, GpuRequest::mem(1, mib));
    p.metadata.labels = Some(BTreeMap::from([("app".to_owned(), name.to_owned())]));
    let spec = p.spec.as_mut().expect("spec");
    spec.priority_class_name = Some(class.to_owned());
    let limits = spec.containers[0]
        .resources
        .get_or_insert_with(Default::default)
        .limits
        .get_or_insert_with(Default::default);
    limits.insert(
        "cpu".into(),
        k8s_openapi::apimachinery::pkg::api::resource::Quantity(cpu.to_string()),
    );
    p
}

/// The message of the extender's `PreemptionCandidates` Event on pod `name` of `default`.
async fn preemption_event(c: &Cluster, name: &str) -> String {
    pod_event(c, name, "PreemptionCandidates").await
}

/// The message of an Event with `reason` on pod `name` of `default`.
async fn pod_event(c: &Cluster, name: &str, reason: &str) -> String {
    let found = eventually(
        &format!("a {reason} Event on {name}"),
        Duration::from_secs(30),
        Duration::from_millis(300),
        || async {
            let evs: Api<k8s_openapi::api::core::v1::Event> =
                Api::namespaced(c.admin().clone(), "default");
            let list = evs.list(&Default::default()).await.ok()?;
            list.items.into_iter().find(|e| {
                e.reason.as_deref() == Some(reason)
                    && e.involved_object.name.as_deref() == Some(name)
            })
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", c.logs_tail(30)));
    found.message.unwrap_or_default()
}

/// Names of the pods of `default` not being deleted.
async fn alive_pods(c: &Cluster) -> Vec<String> {
    c.pods("default")
        .await
        .expect("pods")
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter_map(|p| p.metadata.name.clone())
        .collect()
}

/// Creates each pod as the tenant and waits for its node to admit it before the next (so each
/// placement is known when the next is decided; two minutes each, for preemption's few
/// scheduling cycles).
async fn place_in_order(c: &Cluster, pods: Vec<Pod>) {
    for pod in pods {
        let name = pod.metadata.name.clone().expect("name");
        create_as_user(c, &pod).await.expect("create");
        wait_admitted(c, &[name], Duration::from_secs(120)).await;
    }
}

/// One pod spec for the admission comparison: `containers` (and `initContainers`) as JSON, with
/// extra `spec` and `metadata` fields.
fn admission_case(name: &str, ns: &str, spec: serde_json::Value, meta: serde_json::Value) -> Pod {
    let mut pod = serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns},
        "spec": spec,
    });
    if let (Some(m), Some(extra)) = (pod["metadata"].as_object_mut(), meta.as_object()) {
        m.extend(extra.clone());
    }
    serde_json::from_value(pod).expect("admission case")
}

/// What a user sees of a pod after admission: who schedules it, its runtime class, and each
/// container's limits and env; or the refusal's reason.
fn admitted_view(r: Result<Pod, kube::Error>) -> Result<serde_json::Value, String> {
    match r {
        Ok(p) => {
            let spec = p.spec.unwrap_or_default();
            let containers: Vec<_> = spec
                .init_containers
                .unwrap_or_default()
                .into_iter()
                .chain(spec.containers)
                .map(|c| {
                    let limits = c.resources.and_then(|r| r.limits).unwrap_or_default();
                    let env: Vec<(String, Option<String>)> = c
                        .env
                        .unwrap_or_default()
                        .into_iter()
                        .map(|e| (e.name, e.value))
                        .collect();
                    serde_json::json!({"name": c.name, "limits": limits, "env": env})
                })
                .collect();
            Ok(serde_json::json!({
                "schedulerName": spec.scheduler_name,
                "runtimeClassName": spec.runtime_class_name,
                "containers": containers,
            }))
        }
        // The status code and the message a client shows.
        Err(kube::Error::Api(status)) => Err(format!("{} {}", status.code, status.message)),
        Err(e) => Err(e.to_string()),
    }
}

/// `admissionPolicy.podMutation` (a MutatingAdmissionPolicy and a ValidatingAdmissionPolicy the
/// API server evaluates itself) admits, changes and refuses pods exactly as the webhook does,
/// with the one documented exception (deviation W3: a request no GPU could ever hold is left to
/// kube-scheduler); and a pod it admitted is scheduled and gets its limits on the node. The same
/// specs go, as the ordinary user, in dry runs, to a namespace of the webhook and to one of the
/// policies, in one cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_pod_mutation_policy_admits_and_refuses_as_the_webhook_does() {
    use serde_json::json;
    let mut opts = ClusterOptions::new("pod-mutation-policy", a100_nodes(1, 2));
    opts.pod_mutation_policy = Some(vec![]);
    let c = start(opts).await;
    let policy_ns = "via-policy";
    Api::<k8s_openapi::api::core::v1::Namespace>::all(c.admin().clone())
        .create(
            &PostParams::default(),
            &tessera_e2e::cluster::policy_namespace(policy_ns),
        )
        .await
        .expect("create the policy namespace");

    let ctr = |name: &str, limits: serde_json::Value| {
        json!({"name": name, "image": "registry.example/cuda-app:1",
               "resources": {"limits": limits}})
    };
    let none = json!({});
    let cases: Vec<(&str, serde_json::Value, serde_json::Value)> = vec![
        (
            "fraction",
            json!({"containers": [ctr("c", json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "4000", "nvidia.com/gpucores": "10"}))]}),
            none.clone(),
        ),
        (
            "whole-by-percentage",
            json!({"containers": [ctr("c", json!({"nvidia.com/gpumem-percentage": "100"}))]}),
            none.clone(),
        ),
        (
            "memory-without-count",
            json!({"containers": [ctr("c", json!({"nvidia.com/gpumem": "3000"}))]}),
            none.clone(),
        ),
        (
            "count-only",
            json!({"containers": [ctr("c", json!({"nvidia.com/gpu": "2"}))]}),
            none.clone(),
        ),
        (
            "init-gpu-app-plain",
            json!({"initContainers": [ctr("init", json!({"nvidia.com/gpucores": "50"}))],
                                       "containers": [ctr("app", json!({"cpu": "10m"}))]}),
            none.clone(),
        ),
        (
            "priority",
            json!({"containers": [ctr("c", json!({"nvidia.com/gpu": "1", "nvidia.com/priority": "1"}))]}),
            none.clone(),
        ),
        (
            "two-containers",
            json!({"containers": [ctr("a", json!({"nvidia.com/gpumem": "1000"})), ctr("b", json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem-percentage": "50"}))]}),
            none.clone(),
        ),
        (
            "other-scheduler",
            json!({"schedulerName": "someone-else", "containers": [ctr("c", json!({"nvidia.com/gpumem": "1000"}))]}),
            none.clone(),
        ),
        (
            "default-scheduler",
            json!({"schedulerName": "default-scheduler", "containers": [ctr("c", json!({"nvidia.com/gpu": "1"}))]}),
            none.clone(),
        ),
        (
            "no-gpu",
            json!({"containers": [ctr("c", json!({"cpu": "10m"}))]}),
            none.clone(),
        ),
        (
            "oversubscription-host",
            json!({"containers": [ctr("c", json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1000"}))]}),
            json!({"annotations": {"tessera.io/memory-oversubscription": "host"}}),
        ),
        // Refused by both.
        (
            "percentage-101",
            json!({"containers": [ctr("c", json!({"nvidia.com/gpumem-percentage": "101"}))]}),
            none.clone(),
        ),
        (
            "cores-120",
            json!({"containers": [ctr("c", json!({"nvidia.com/gpu": "1", "nvidia.com/gpucores": "120"}))]}),
            none.clone(),
        ),
        (
            "memory-in-gi",
            json!({"containers": [ctr("c", json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1Gi"}))]}),
            none.clone(),
        ),
        (
            "memory-over-int32",
            json!({"containers": [ctr("c", json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "3000000000"}))]}),
            none.clone(),
        ),
        (
            "privileged",
            json!({"containers": [{"name": "c", "image": "x", "securityContext": {"privileged": true},
                                             "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}),
            none.clone(),
        ),
        (
            "node-named",
            json!({"nodeName": "gpu-node-0", "containers": [ctr("c", json!({"nvidia.com/gpu": "1"}))]}),
            none.clone(),
        ),
        (
            "oversubscription-unknown",
            json!({"containers": [ctr("c", json!({"nvidia.com/gpu": "1"}))]}),
            json!({"annotations": {"tessera.io/memory-oversubscription": "swap"}}),
        ),
    ];
    let dry_run = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let mut refused = 0;
    for (name, spec, meta) in &cases {
        let mut views = Vec::new();
        for ns in ["default", policy_ns] {
            let pod = admission_case(name, ns, spec.clone(), meta.clone());
            let api = Api::<Pod>::namespaced(c.user().clone(), ns);
            views.push(admitted_view(api.create(&dry_run, &pod).await));
        }
        match (&views[0], &views[1]) {
            (Ok(webhook), Ok(policy)) => {
                assert_eq!(webhook, policy, "{name}: the pod as admitted")
            }
            (Err(webhook), Err(policy)) => {
                // The same status code, and the webhook's reason word for word inside the
                // policy's refusal.
                let (code, reason) = webhook
                    .split_once(" denied the request: ")
                    .map(|(head, r)| (head.split(' ').next().unwrap_or_default(), r))
                    .unwrap_or_default();
                assert!(
                    !reason.is_empty() && policy.starts_with(code) && policy.contains(reason),
                    "{name}: the webhook says {webhook:?}, the policy {policy:?}"
                );
                refused += 1;
            }
            (w, p) => panic!("{name}: the webhook {w:?}, the policy {p:?}"),
        }
    }
    assert_eq!(refused, 7, "the refused cases");

    // W3: more memory than any GPU has is refused at create by the webhook only; under the
    // policy the pod stays Pending and kube-scheduler's event says why.
    let huge = || json!({"containers": [ctr("c", json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "100000"}))]});
    let webhook = Api::<Pod>::namespaced(c.user().clone(), "default")
        .create(
            &dry_run,
            &admission_case("huge", "default", huge(), none.clone()),
        )
        .await;
    assert!(
        webhook.is_err(),
        "the webhook refuses 100000 MiB: {webhook:?}"
    );
    let policy_pods = Api::<Pod>::namespaced(c.user().clone(), policy_ns);
    policy_pods
        .create(
            &PostParams::default(),
            &admission_case("huge", policy_ns, huge(), none.clone()),
        )
        .await
        .expect("the policy admits it");

    // A pod the policy handed to Tessera is placed, and its container gets the limit it asked for.
    let pod = gpu_pod(policy_ns, "placed", GpuRequest::mem(1, 3000).with_cores(30));
    policy_pods
        .create(&PostParams::default(), &pod)
        .await
        .expect("create through the policy");
    let admitted = eventually(
        "the policy's pod admitted by its node",
        Duration::from_secs(90),
        Duration::from_millis(200),
        || async {
            let p = policy_pods.get("placed").await.ok()?;
            c.admitted(&uid(&p))
        },
    )
    .await
    .expect("admitted");
    let envs = &admitted.containers[0].response.envs;
    assert_eq!(
        envs.get("CUDA_DEVICE_MEMORY_LIMIT_0").map(String::as_str),
        Some("3000m"),
        "{envs:?}"
    );
    assert_eq!(
        envs.get("CUDA_DEVICE_SM_LIMIT").map(String::as_str),
        Some("30")
    );
    let events = eventually(
        "kube-scheduler's reason for the pod no GPU can hold",
        Duration::from_secs(60),
        Duration::from_millis(500),
        || async {
            let events =
                Api::<k8s_openapi::api::core::v1::Event>::namespaced(c.admin().clone(), policy_ns)
                    .list(&Default::default())
                    .await
                    .ok()?;
            events
                .items
                .into_iter()
                .find(|e| {
                    e.involved_object.name.as_deref() == Some("huge")
                        && e.reason.as_deref() == Some("FailedScheduling")
                })
                .and_then(|e| e.message)
        },
    )
    .await
    .expect("a FailedScheduling event");
    assert!(events.contains("0/1 nodes are available"), "{events}");

    // Every optional part of the mutation, with the values of
    // charts/tessera/ci/pod-mutation-policy-values.yaml: the API server takes the policies and
    // applies them as the webhook would (env on every container, NVIDIA_VISIBLE_DEVICES=none on
    // the one without a GPU, the runtime class, memoryFactor in the memory bound).
    let sets: Vec<String> = [
        "devices.nvidia.gpuCorePolicy=force",
        "devices.nvidia.runtimeClassName=nvidia",
        "devices.nvidia.memoryFactor=2",
        "devices.nvidia.overwriteEnv=true",
    ]
    .map(str::to_owned)
    .to_vec();
    tessera_e2e::cluster::install_pod_mutation_policy(c.artifacts, c.admin(), &sets)
        .await
        .expect("the CI values' policies are accepted and applied");
    let class: k8s_openapi::api::node::v1::RuntimeClass =
        serde_json::from_value(json!({"metadata": {"name": "nvidia"}, "handler": "nvidia"}))
            .expect("runtime class");
    Api::<k8s_openapi::api::node::v1::RuntimeClass>::all(c.admin().clone())
        .create(&PostParams::default(), &class)
        .await
        .expect("create the runtime class");
    let spec = json!({"containers": [ctr("gpu", json!({"nvidia.com/gpumem": "1000"})),
                                     ctr("sidecar", json!({"cpu": "10m"}))]});
    let all_options = admission_case("all-options", policy_ns, spec, none.clone());
    let force = json!(["GPU_CORE_UTILIZATION_POLICY", "force"]);
    let want = json!({
        "schedulerName": "hami-scheduler",
        "runtimeClassName": "nvidia",
        "containers": [
            {"name": "gpu", "limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1k"},
             "env": [force]},
            {"name": "sidecar", "limits": {"cpu": "10m"},
             "env": [force, ["NVIDIA_VISIBLE_DEVICES", "none"]]},
        ],
    });
    // The API server takes up a changed policy within seconds.
    let seen = std::sync::Mutex::new(None);
    let applied = eventually(
        "the CI values' mutation applied",
        Duration::from_secs(30),
        Duration::from_millis(200),
        || async {
            let view = admitted_view(policy_pods.create(&dry_run, &all_options).await);
            let done = view.as_ref().ok() == Some(&want);
            *seen
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(view);
            done.then_some(())
        },
    )
    .await;
    assert!(applied.is_ok(), "last seen: {:?}", seen.lock().ok());
    let spec = json!({"containers": [ctr("c", json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1100000000"}))]});
    let refused = admitted_view(
        policy_pods
            .create(
                &dry_run,
                &admission_case("factor", policy_ns, spec, none.clone()),
            )
            .await,
    )
    .expect_err("1100000000 MiB x 2 overflows int32");
    assert!(refused.contains("after memoryFactor 2"), "{refused}");
}

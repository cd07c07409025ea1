//! Faults on real nodes. Long-running GPU jobs hold most of the cluster's GPU memory; then one
//! thing breaks at a time: the kubelet, containerd, the device-plugin pod, the plugin's image
//! upgraded by `helm upgrade`, the tessera-scheduler Deployment rolled during a burst, the API
//! server, a Node object deleted under its running GPU pods. After each, the running jobs still
//! run with their own devices and limits (their latest report from inside), new pods are placed
//! and see their own limits, a pod that only fits if the books forgot a running job is not
//! placed, and no GPU is over-booked.
#![allow(
    clippy::disallowed_types,
    reason = "the e2e harness times real processes and clusters: wall-clock std::time::Instant"
)]

use std::collections::BTreeMap;
use std::time::Duration;

use futures::future::join_all;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use serde_json::json;
use tessera_e2e::node::NodeSpec;
use tessera_e2e::probe::{self, Report, Slice};
use tessera_e2e::real::{
    self, ChartValues, NAMESPACE, RealCluster, RealClusterOptions, RealNodeSpec, UPGRADE_PLUGIN_TAG,
};
use tessera_e2e::{Error, Result, eventually};

const TENANT: &str = "jobs";
const A100: &str = "a100-node";
const T4: &str = "t4-node";
const A100_MIB: u64 = 40960;
const T4_MIB: u64 = 15360;

/// The long-running jobs: 30000 MiB on each A100, 12000 MiB on the T4. Afterwards no GPU has
/// 20000 MiB free.
const JOBS: [(&str, &str, Slice); 3] = [
    ("job-a", A100, Slice::mib(1, 30000)),
    ("job-b", A100, Slice::mib(1, 30000)),
    ("job-t4", T4, Slice::mib(1, 12000).with_cores(40)),
];
/// Fits only if the books forgot a job.
const TOO_BIG: Slice = Slice::mib(1, 20000);

fn pod(name: &str, node: Option<&str>, slice: &Slice, forever: bool) -> Pod {
    let main = probe::container("main", slice, forever);
    probe::pod(TENANT, name, node, Vec::new(), vec![main])
}

/// The running jobs' containers: same container (no restart), Running, and their latest
/// report is their own slice.
async fn jobs_keep_their_limits(c: &RealCluster, after: &str, uids: &BTreeMap<String, String>) {
    let pods: Api<Pod> = Api::namespaced(c.admin().clone(), TENANT);
    for (name, _, slice) in JOBS.iter().filter(|(n, _, _)| uids.contains_key(*n)) {
        let name = *name;
        let slice = *slice;
        let r = eventually(
            &format!("{name} to report its own limits after {after}"),
            Duration::from_secs(90),
            Duration::from_secs(1),
            || async {
                let p = pods.get_opt(name).await.ok().flatten()?;
                let st = p.status.clone()?;
                let cs = st.container_statuses.clone()?.into_iter().next()?;
                let running = cs.state.as_ref().and_then(|s| s.running.as_ref()).is_some();
                let logs = c.logs(TENANT, name, "main").await.ok()?;
                (running && probe::judge(&logs, &slice, true) == Report::Own)
                    .then_some((p.metadata.uid.clone().unwrap_or_default(), cs.restart_count))
            },
        )
        .await;
        match r {
            Ok((uid, restarts)) => {
                assert_eq!(
                    Some(&uid),
                    uids.get(name),
                    "{name} was replaced after {after}"
                );
                assert_eq!(restarts, 0, "{name} restarted after {after}");
            }
            Err(e) => panic!("{e}\n{}", c.describe_pods(TENANT).await),
        }
    }
}

async fn no_gpu_overbooked(c: &RealCluster, after: &str) -> Result<()> {
    let nodes = Api::<Node>::all(c.admin().clone())
        .list(&ListParams::default())
        .await?
        .items;
    let pods = Api::<Pod>::all(c.admin().clone())
        .list(&ListParams::default())
        .await?
        .items;
    let v = tessera_e2e::booking::violations(&nodes, &pods);
    assert!(v.is_empty(), "over-booked after {after}:\n{}", v.join("\n"));
    Ok(())
}

/// A new small pod on `node` runs with its own limits, and a pod that fits only if the books
/// forgot a running job stays unplaced meanwhile.
async fn new_pods_are_placed_and_nothing_overbooked(
    c: &RealCluster,
    after: &str,
    node: &str,
) -> Result<()> {
    let small = Slice::mib(1, 1000 + after.len() as u64);
    let small_name = format!("new-{after}");
    let big_name = format!("too-big-{after}");
    c.create_pod_as_user(&pod(&big_name, None, &TOO_BIG, false))
        .await?;
    c.create_pod_as_user(&pod(&small_name, Some(node), &small, false))
        .await?;
    let done = c
        .wait_finished(TENANT, &small_name, Duration::from_secs(120))
        .await?;
    assert_eq!(
        done.status.and_then(|s| s.phase).as_deref(),
        Some("Succeeded"),
        "{small_name}\n{}",
        c.describe_pods(TENANT).await
    );
    let logs = c.logs(TENANT, &small_name, "main").await?;
    assert_eq!(
        probe::judge(&logs, &small, false),
        Report::Own,
        "{small_name}: {logs}"
    );
    let pods: Api<Pod> = Api::namespaced(c.admin().clone(), TENANT);
    let big = pods.get(&big_name).await?;
    assert_eq!(
        big.spec.and_then(|s| s.node_name),
        None,
        "{big_name} was placed after {after}: the books forgot a running job"
    );
    no_gpu_overbooked(c, after).await?;
    c.delete_pod(TENANT, &small_name).await?;
    c.delete_pod(TENANT, &big_name).await?;
    Ok(())
}

/// The node is Ready and advertises its GPUs again (the plugin registered with the kubelet).
async fn node_serves_gpus(c: &RealCluster, node: &str) -> Result<()> {
    let nodes: Api<Node> = Api::all(c.admin().clone());
    eventually(
        &format!("{node} Ready with nvidia.com/gpu allocatable"),
        Duration::from_secs(120),
        Duration::from_millis(500),
        || async {
            let n = nodes.get_opt(node).await.ok().flatten()?;
            let st = n.status?;
            let ready = st
                .conditions?
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True");
            let gpus = st
                .allocatable?
                .get("nvidia.com/gpu")
                .is_some_and(|q| q.0 != "0");
            (ready && gpus).then_some(())
        },
    )
    .await
}

async fn scheduler_rolled_out(c: &RealCluster) -> Result<()> {
    let deploys: Api<Deployment> = Api::namespaced(c.admin().clone(), NAMESPACE);
    eventually(
        "the tessera-scheduler Deployment rolled out",
        Duration::from_secs(180),
        Duration::from_millis(500),
        || async {
            let list = deploys.list(&ListParams::default()).await.ok()?;
            list.items
                .iter()
                .all(|d| {
                    let st = d.status.clone().unwrap_or_default();
                    let want = d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
                    st.observed_generation == d.metadata.generation
                        && st.updated_replicas.unwrap_or(0) == want
                        && st.available_replicas.unwrap_or(0) == want
                        && st.replicas.unwrap_or(0) == want
                })
                .then_some(())
        },
    )
    .await
}

/// Twelve small pods at once while the scheduler Deployment rolls: each runs with its own
/// limits (a pod may be refused at admission and recreated, as its owner would; counted).
async fn burst_during_scheduler_rollout(c: &RealCluster) -> Result<()> {
    let deploys: Api<Deployment> = Api::namespaced(c.admin().clone(), NAMESPACE);
    let patch = json!({"spec": {"template": {"metadata": {"annotations": {
        "kubectl.kubernetes.io/restartedAt": "e2e-rollout"}}}}});
    let slices: Vec<(String, Slice)> = (0..12)
        .map(|i| (format!("roll-{i}"), Slice::mib(1, 300 + 10 * i)))
        .collect();
    let creates = slices
        .iter()
        .map(|(n, s)| async { c.create_pod_as_user(&pod(n, None, s, false)).await });
    let roll = async {
        for d in deploys.list(&ListParams::default()).await?.items {
            let name = d.metadata.name.unwrap_or_default();
            deploys
                .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await?;
        }
        Ok::<(), Error>(())
    };
    let (created, rolled) = tokio::join!(join_all(creates), roll);
    rolled?;
    for r in created {
        r?;
    }
    for (name, slice) in &slices {
        let done = c
            .wait_finished(TENANT, name, Duration::from_secs(240))
            .await?;
        assert_eq!(
            done.status.and_then(|s| s.phase).as_deref(),
            Some("Succeeded"),
            "{name}\n{}",
            c.describe_pods(TENANT).await
        );
        let logs = c.logs(TENANT, name, "main").await?;
        assert_eq!(
            probe::judge(&logs, slice, false),
            Report::Own,
            "{name}: {logs}"
        );
    }
    no_gpu_overbooked(c, "scheduler rollout").await?;
    for (name, _) in &slices {
        c.delete_pod(TENANT, name).await?;
    }
    scheduler_rolled_out(c).await
}

/// The device-plugin pod on `node`, if any.
async fn plugin_pod_on(c: &RealCluster, node: &str) -> Result<Option<Pod>> {
    let pods: Api<Pod> = Api::namespaced(c.admin().clone(), NAMESPACE);
    let lp = ListParams::default().labels("app.kubernetes.io/component=device-plugin");
    Ok(pods
        .list(&lp)
        .await?
        .items
        .into_iter()
        .find(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node)))
}

/// Waits until the device-plugin pod on `node` is Ready (its readiness probe passes only once it
/// is registered with the kubelet) and is not the pod `replaced` (a UID).
async fn plugin_ready_on(c: &RealCluster, node: &str, replaced: Option<&str>) -> Result<()> {
    eventually(
        &format!("a Ready device-plugin pod on {node}"),
        Duration::from_secs(120),
        Duration::from_millis(250),
        || async {
            let p = plugin_pod_on(c, node).await.ok().flatten()?;
            let uid = p.metadata.uid.clone().unwrap_or_default();
            let ready = p
                .status?
                .conditions?
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True");
            (ready && Some(uid.as_str()) != replaced && p.metadata.deletion_timestamp.is_none())
                .then_some(())
        },
    )
    .await
}

/// Deletes the device-plugin pod on `node` and waits for its replacement to be Ready.
async fn replace_plugin_pod_on(c: &RealCluster, node: &str) -> Result<()> {
    let pods: Api<Pod> = Api::namespaced(c.admin().clone(), NAMESPACE);
    let old = plugin_pod_on(c, node)
        .await?
        .ok_or_else(|| Error::msg(format!("no device-plugin pod on {node}")))?;
    pods.delete(
        old.metadata.name.as_deref().unwrap_or_default(),
        &DeleteParams::default(),
    )
    .await?;
    plugin_ready_on(c, node, old.metadata.uid.as_deref()).await
}

#[test]
fn real_nodes_running_jobs_survive_faults_and_nothing_is_overbooked() -> Result<()> {
    real::run(2, |net| async move {
        let mut c = RealCluster::start(
            net,
            RealClusterOptions {
                name: "real-faults".into(),
                nodes: vec![
                    RealNodeSpec::gpu(NodeSpec::uniform(
                        A100,
                        2,
                        "NVIDIA A100-SXM4-40GB",
                        A100_MIB,
                    )),
                    RealNodeSpec::gpu(NodeSpec::uniform(T4, 1, "Tesla T4", T4_MIB)),
                ],
                chart: ChartValues::Recommended(Vec::new()),
            },
        )
        .await?;
        c.tenant_namespace(TENANT).await?;
        let r = faults(&mut c).await;
        if let Err(e) = r {
            panic!("{e}\n{}", c.describe_pods(TENANT).await);
        }
        Ok(())
    })
}

async fn faults(c: &mut RealCluster) -> Result<()> {
    for (name, node, slice) in JOBS {
        c.create_pod_as_user(&pod(name, Some(node), &slice, true))
            .await?;
    }
    let pods: Api<Pod> = Api::namespaced(c.admin().clone(), TENANT);
    let mut uids = BTreeMap::new();
    for (name, _, _) in JOBS {
        let p = eventually(
            &format!("{name} running"),
            Duration::from_secs(120),
            Duration::from_millis(500),
            || async {
                pods.get_opt(name).await.ok().flatten().filter(|p| {
                    p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
                })
            },
        )
        .await?;
        uids.insert(name.to_owned(), p.metadata.uid.unwrap_or_default());
    }
    jobs_keep_their_limits(c, "start", &uids).await;
    new_pods_are_placed_and_nothing_overbooked(c, "start", A100).await?;

    println!("fault: kubelet restart");
    c.node(A100)
        .ok_or_else(|| Error::msg("no node"))?
        .restart_kubelet()?;
    node_serves_gpus(c, A100).await?;
    jobs_keep_their_limits(c, "kubelet restart", &uids).await;
    new_pods_are_placed_and_nothing_overbooked(c, "kubelet", A100).await?;

    println!("fault: containerd restart");
    c.node(A100)
        .ok_or_else(|| Error::msg("no node"))?
        .restart_containerd()?;
    node_serves_gpus(c, A100).await?;
    jobs_keep_their_limits(c, "containerd restart", &uids).await;
    new_pods_are_placed_and_nothing_overbooked(c, "containerd", A100).await?;

    println!("fault: device-plugin pod deleted");
    replace_plugin_pod_on(c, A100).await?;
    node_serves_gpus(c, A100).await?;
    jobs_keep_their_limits(c, "plugin pod deleted", &uids).await;
    new_pods_are_placed_and_nothing_overbooked(c, "plugin", A100).await?;

    println!("fault: helm upgrade of the plugin's image");
    c.helm_upgrade_set(&[("devicePlugin.image.tag", UPGRADE_PLUGIN_TAG)])
        .await?;
    c.wait_plugin_rolled_out().await?;
    plugin_ready_on(c, A100, None).await?;
    plugin_ready_on(c, T4, None).await?;
    node_serves_gpus(c, A100).await?;
    node_serves_gpus(c, T4).await?;
    jobs_keep_their_limits(c, "plugin upgrade", &uids).await;
    new_pods_are_placed_and_nothing_overbooked(c, "upgrade", T4).await?;

    println!("fault: tessera-scheduler rollout during a burst");
    burst_during_scheduler_rollout(c).await?;
    jobs_keep_their_limits(c, "scheduler rollout", &uids).await;

    println!("fault: kube-apiserver restart");
    c.restart_apiserver(Duration::from_secs(3)).await?;
    node_serves_gpus(c, A100).await?;
    jobs_keep_their_limits(c, "apiserver restart", &uids).await;
    new_pods_are_placed_and_nothing_overbooked(c, "apiserver", A100).await?;

    // The Node object of the T4 node is deleted under its running job. Kubernetes' pod garbage
    // collector deletes pods bound to a node that no longer exists; the kubelet, restarted by
    // the operator, registers the node again and the plugin publishes its GPUs again. The job's
    // booking must not survive it, and nothing may be placed on the node while it is gone.
    println!("fault: node object deleted under a running GPU job");
    let nodes: Api<Node> = Api::all(c.admin().clone());
    nodes.delete(T4, &DeleteParams::default()).await?;
    eventually(
        "the pod garbage collector to delete job-t4",
        Duration::from_secs(120),
        Duration::from_secs(1),
        || async {
            pods.get_opt("job-t4")
                .await
                .ok()
                .and_then(|p| p.is_none().then_some(()))
        },
    )
    .await?;
    c.node(T4)
        .ok_or_else(|| Error::msg("no node"))?
        .restart_kubelet()?;
    node_serves_gpus(c, T4).await?;
    // 12000 MiB fit on the T4 again only if the deleted job's booking is gone.
    let again = Slice::mib(1, 12000).with_cores(40);
    c.create_pod_as_user(&pod("t4-again", Some(T4), &again, false))
        .await?;
    let done = c
        .wait_finished(TENANT, "t4-again", Duration::from_secs(120))
        .await?;
    assert_eq!(
        done.status.and_then(|s| s.phase).as_deref(),
        Some("Succeeded")
    );
    let logs = c.logs(TENANT, "t4-again", "main").await?;
    assert_eq!(
        probe::judge(&logs, &again, false),
        Report::Own,
        "t4-again: {logs}"
    );
    uids.remove("job-t4");
    jobs_keep_their_limits(c, "node deletion", &uids).await;
    no_gpu_overbooked(c, "node deletion").await?;
    Ok(())
}

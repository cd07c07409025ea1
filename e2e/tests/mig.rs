//! Dynamic MIG end to end (issue 17, item 5) on the real control plane: a node in operating mode
//! `mig` (fake A100-80GB GPUs, two in MIG mode, one of them with an instance someone else carved)
//! next to a shared node. Pods asking for MIG slices and shared slices are placed, allocated and
//! released; a burst of MIG pods never double-books a placement; a plugin restart loses nothing.
#![allow(
    clippy::disallowed_types,
    reason = "the e2e harness times real processes and clusters: wall-clock std::time::Instant"
)]

use std::collections::BTreeMap;
use std::time::Duration;

use hami_contract::mig::{MigAllocation, decode_allocations};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use tessera_e2e::cluster::{Cluster, ClusterOptions};
use tessera_e2e::eventually;
use tessera_e2e::node::NodeSpec;
use tessera_e2e::pods::{GpuRequest, gpu_pod};

const MIG_NODE: &str = "mig-node";

/// The profiles the cluster allows on A100s (`migProfileAllowlist`, as HAMi's chart writes it).
const ALLOWLIST: &str = "  migProfileAllowlist:\n    - models: [\"A100\"]\n      profiles: [\"1g.10gb\", \"2g.20gb\", \"3g.40gb\", \"7g.80gb\"]\n";

async fn start(opts: ClusterOptions) -> Cluster {
    match Cluster::start(opts).await {
        Ok(c) => c,
        Err(e) => panic!("cluster did not start: {e}"),
    }
}

fn mig_pod(name: &str, mem_mib: u64, mode: &str) -> Pod {
    let mut pod = gpu_pod("default", name, GpuRequest::mem(1, mem_mib));
    pod.metadata
        .annotations
        .get_or_insert_with(Default::default)
        .insert("nvidia.com/vgpu-mode".into(), mode.into());
    pod
}

async fn create(c: &Cluster, pod: &Pod) {
    Api::<Pod>::namespaced(c.user().clone(), "default")
        .create(&PostParams::default(), pod)
        .await
        .unwrap_or_else(|e| panic!("create {:?}: {e}", pod.metadata.name));
}

/// The pod's MIG reservations once the device plugin has realized all of them.
async fn realized(c: &Cluster, name: &str) -> Vec<MigAllocation> {
    let pods: Api<Pod> = Api::namespaced(c.admin().clone(), "default");
    eventually(
        &format!("pod {name} allocated with its MIG instance recorded"),
        Duration::from_secs(60),
        Duration::from_millis(200),
        || {
            let pods = pods.clone();
            async move {
                let p = pods.get(name).await.ok()?;
                let ann = p.metadata.annotations?;
                if ann.get("hami.io/bind-phase").map(String::as_str) != Some("success") {
                    return None;
                }
                let list = decode_allocations(ann.get("hami.io/vgpu-mig-allocations")?).ok()?;
                (!list.is_empty() && list.iter().all(MigAllocation::is_realized)).then_some(list)
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", c.logs_tail(30)))
}

/// Instances in the fake NVML's MIG state of `node`, as (GPU UUID, start, size, MIG UUID)
/// (state file format: test-support/fake-nvml/README.md).
fn carved(c: &Cluster, node: &str) -> Vec<(String, u64, u64, String)> {
    let dir = &c.node(node).expect("node").dir;
    let text = std::fs::read_to_string(dir.join("nvml-mig-state.json")).unwrap_or_default();
    let state: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
    let mut out = Vec::new();
    for (gpu, g) in state["gpus"].as_object().into_iter().flatten() {
        for gi in g["gpu_instances"].as_array().into_iter().flatten() {
            out.push((
                gpu.clone(),
                gi["start"].as_u64().unwrap_or_default(),
                gi["size"].as_u64().unwrap_or_default(),
                gi["compute_instances"][0]["uuid"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            ));
        }
    }
    out.sort();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mig_and_shared_pods_share_a_cluster_and_mig_slices_are_never_double_booked() {
    let scenario = tessera_e2e::artifacts::workspace_root()
        .join("examples/device-plugin/fake-nvml-mig-a100.json");
    let text = std::fs::read_to_string(&scenario).expect("scenario");
    let mig_node = NodeSpec::from_scenario(MIG_NODE, &text)
        .expect("scenario")
        .with_device_config(ALLOWLIST)
        .with_node_config(&format!(
            r#"{{"nodeconfig":[{{"name":"{MIG_NODE}","operatingmode":"mig"}}]}}"#
        ));
    let shared = NodeSpec::uniform("shared-node", 2, "NVIDIA A100-SXM4-40GB", 40960);
    let mut c = start(ClusterOptions::new("mig", vec![mig_node, shared])).await;
    let before = carved(&c, MIG_NODE);

    // One MIG slice and one shared slice.
    create(&c, &mig_pod("slice", 9000, "mig")).await;
    create(&c, &mig_pod("shared", 3000, "hami-core")).await;
    let slice = realized(&c, "slice").await;
    assert_eq!(slice.len(), 1);
    assert_eq!(
        slice[0].profile, "1g.10gb",
        "the smallest profile with 9000 MiB"
    );
    let admitted = c
        .node(MIG_NODE)
        .expect("node")
        .state
        .lock()
        .expect("state")
        .admitted
        .clone();
    let response = &admitted
        .values()
        .find(|a| a.name == "slice")
        .expect("slice admitted on the MIG node")
        .containers[0]
        .response;
    assert_eq!(response.envs["NVIDIA_VISIBLE_DEVICES"], slice[0].mig_uuid);
    assert!(response.mounts.is_empty(), "no shim in a MIG container");
    assert!(
        carved(&c, MIG_NODE)
            .iter()
            .any(|i| i.3 == slice[0].mig_uuid)
    );

    // The plugin restarts (killed, as a crashed pod): it finds what it carved, and the next pod
    // is carved beside it.
    let registrations = c.node(MIG_NODE).expect("node").registrations();
    c.node_mut(MIG_NODE)
        .expect("node")
        .restart_plugin()
        .expect("plugin restarted");
    eventually(
        "the restarted plugin registered again",
        Duration::from_secs(30),
        Duration::from_millis(200),
        || {
            let again = c.node(MIG_NODE).map(|n| n.registrations()).unwrap_or(0) > registrations;
            async move { again.then_some(()) }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", c.logs_tail(30)));
    create(&c, &mig_pod("after-restart", 9000, "mig")).await;
    let after = realized(&c, "after-restart").await;
    assert_ne!(
        (&after[0].gpu_uuid, after[0].placement),
        (&slice[0].gpu_uuid, slice[0].placement)
    );
    assert!(
        carved(&c, MIG_NODE)
            .iter()
            .any(|i| i.3 == slice[0].mig_uuid),
        "kept"
    );

    // A burst of MIG pods: every reservation on its own slices.
    let names: Vec<String> = (0..7).map(|i| format!("burst-{i}")).collect();
    let burst: Vec<Pod> = names.iter().map(|n| mig_pod(n, 9000, "mig")).collect();
    futures::future::join_all(burst.iter().map(|p| create(&c, p))).await;
    let mut placements: BTreeMap<String, Vec<(u32, u32)>> = BTreeMap::new();
    for a in [slice.clone(), after.clone()].into_iter().chain({
        let mut all = Vec::new();
        for n in &names {
            all.push(realized(&c, n).await);
        }
        all
    }) {
        for r in a {
            placements
                .entry(r.gpu_uuid.clone())
                .or_default()
                .push((r.placement.start, r.placement.size));
        }
    }
    for (gpu, list) in &placements {
        for (i, a) in list.iter().enumerate() {
            for b in &list[i + 1..] {
                assert!(
                    a.0 + a.1 <= b.0 || b.0 + b.1 <= a.0,
                    "GPU {gpu}: placements {a:?} and {b:?} overlap: {placements:?}"
                );
            }
        }
    }
    let live = carved(&c, MIG_NODE);
    assert_eq!(live.len(), before.len() + 9, "{live:?}");

    // Released: the instances go once their pods are gone; the pre-carved one stays.
    let pods: Api<Pod> = Api::namespaced(c.admin().clone(), "default");
    for n in names
        .iter()
        .chain(["slice".to_owned(), "after-restart".to_owned()].iter())
    {
        let _ = pods
            .delete(n, &DeleteParams::default().grace_period(0))
            .await;
    }
    eventually(
        "the MIG instances of deleted pods destroyed",
        Duration::from_secs(60),
        Duration::from_millis(500),
        || {
            let now = carved(&c, MIG_NODE);
            let before = before.clone();
            async move { (now == before).then_some(()) }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}: {:?}\n{}", carved(&c, MIG_NODE), c.logs_tail(30)));
}

//! The apiserver edge against a `tower-test` mock: exact PATCH bodies for pod annotations, the
//! node register annotation (with an apiserver outage in between), and HAMi lock release.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use hami_contract::nodelock::NodeLock;
use http::Method;
use serde_json::json;
use tessera_node::device_state::DeviceState;
use tessera_node::edges::{EdgeError, NoPodResources, PodPatcher, PodResourcesSource};
use tessera_node::gpu::{AdvertiseSettings, plan_gpus};
use tessera_node::health::{HealthPolicy, HealthTracker};
use tessera_node::kube_edges::{KubePatcher, NodeAnnotator};
use tessera_node::testing::apiserver::{mock_client, node, ok, pod, unavailable};
use tessera_node::testing::t4;
use tessera_runtime::DisplayChain;
use tokio_util::sync::CancellationToken;

/// The node register annotation's writer for `state`, every 30 s, retrying after 5 s.
fn annotator(
    patcher: KubePatcher,
    state: Arc<DeviceState>,
    capacity: Option<tessera_node::kube_edges::CapacityNames>,
) -> NodeAnnotator {
    NodeAnnotator {
        patcher,
        state,
        period: Duration::from_secs(30),
        retry: Duration::from_secs(5),
        metrics: None,
        capacity,
        pod_resources: None,
    }
}

/// A kubelet whose pod-resources `List` answers (with no pods).
#[derive(Debug)]
struct AnsweringPodResources;

impl PodResourcesSource for AnsweringPodResources {
    fn list(
        &self,
    ) -> futures::future::BoxFuture<
        '_,
        Result<Option<tessera_node::identity::PodResourcesView>, EdgeError>,
    > {
        Box::pin(async { Ok(Some(Default::default())) })
    }
}

/// `tessera.io/allocation-identity` says whether the kubelet's pod-resources answers: the
/// extender lets several confusable pods be in flight only on a node that says `pod-resources`.
#[tokio::test]
async fn node_says_whether_pod_resources_identifies_pods() {
    for (source, want) in [
        (
            Arc::new(AnsweringPodResources) as Arc<dyn PodResourcesSource>,
            "pod-resources",
        ),
        (Arc::new(NoPodResources), "signature"),
    ] {
        let (client, mut handle) = mock_client();
        let patcher = KubePatcher::new(client, "node-a");
        let (managed, _) = plan_gpus(
            &[t4("GPU-a", 0)],
            &AdvertiseSettings::new(&Default::default(), Default::default(), ""),
            &|_| false,
        );
        let state = DeviceState::new(
            managed,
            HealthTracker::new(HealthPolicy::default(), ["GPU-a".to_owned()]),
            false,
            None,
        );
        let mut a = annotator(patcher, state, None);
        a.pod_resources = Some(source);
        let stop = CancellationToken::new();
        let task = tokio::spawn(a.run(stop.clone()));
        let (body, send) = handle.expect_patch("/api/v1/nodes/node-a").await;
        assert_eq!(
            body["metadata"]["annotations"]["tessera.io/allocation-identity"],
            want
        );
        send.send_response(ok(node("node-a", "78", json!({}))));
        stop.cancel();
        task.await.expect("no panic");
    }
}

#[tokio::test]
async fn pod_patch_is_a_merge_patch_of_exactly_the_annotations_with_the_uid_precondition() {
    let (client, mut handle) = mock_client();
    let patcher = KubePatcher::new(client, "node-a");
    let task = tokio::spawn(async move {
        let mut a = BTreeMap::new();
        a.insert(
            "hami.io/vgpu-devices-to-allocate".to_owned(),
            ";".to_owned(),
        );
        a.insert("hami.io/bind-phase".to_owned(), "success".to_owned());
        patcher
            .patch_pod_annotations("ns", "web", "uid-web", a)
            .await
    });
    let (body, send) = handle.expect_patch("/api/v1/namespaces/ns/pods/web").await;
    assert_eq!(
        body,
        json!({"metadata": {"uid": "uid-web", "annotations": {"hami.io/bind-phase": "success", "hami.io/vgpu-devices-to-allocate": ";"}}})
    );
    send.send_response(ok(pod("ns", "web")));
    task.await.expect("no panic").expect("patched");
}

#[tokio::test]
async fn hami_lock_is_released_only_when_it_names_the_pod() {
    let (client, mut handle) = mock_client();
    let patcher = KubePatcher::new(client, "node-a");
    let p = patcher.clone();
    let task = tokio::spawn(async move { p.release_hami_lock("ns", "web").await });
    let (_, send) = handle.expect(Method::GET, "/api/v1/nodes/node-a").await;
    let lock = NodeLock::for_pod("2025-06-13T09:07:40+08:00", "ns", "web").encode();
    send.send_response(ok(node(
        "node-a",
        "77",
        json!({"hami.io/mutex.lock": lock}),
    )));
    let (body, send) = handle.expect_patch("/api/v1/nodes/node-a").await;
    assert_eq!(
        body,
        json!({"metadata": {"resourceVersion": "77", "annotations": {"hami.io/mutex.lock": null}}})
    );
    send.send_response(ok(node("node-a", "78", json!({}))));
    task.await.expect("no panic").expect("released");

    // Another pod's lock: GET only, no PATCH.
    let p = patcher.clone();
    let task = tokio::spawn(async move { p.release_hami_lock("ns", "web").await });
    let (_, send) = handle.expect(Method::GET, "/api/v1/nodes/node-a").await;
    let other = NodeLock::for_pod("2025-06-13T09:07:40+08:00", "ns", "other").encode();
    send.send_response(ok(node(
        "node-a",
        "78",
        json!({"hami.io/mutex.lock": other}),
    )));
    task.await.expect("no panic").expect("nothing to do");

    // An apiserver error keeps its cause: the log line names it.
    let task = tokio::spawn(async move { patcher.release_hami_lock("ns", "web").await });
    let (_, send) = handle.expect(Method::GET, "/api/v1/nodes/node-a").await;
    send.send_response(unavailable());
    let err = task.await.expect("no panic").expect_err("503");
    let line = DisplayChain(&err).to_string();
    assert!(
        line.starts_with("cannot get node node-a: ") && line.contains("unavailable"),
        "{line}"
    );
}

#[tokio::test(start_paused = true)]
async fn register_annotation_survives_an_apiserver_outage_and_follows_health() {
    let (client, mut handle) = mock_client();
    let patcher = KubePatcher::new(client, "node-a");
    let (managed, _) = plan_gpus(
        &[t4("GPU-a", 0)],
        &AdvertiseSettings::new(&Default::default(), Default::default(), ""),
        &|_| false,
    );
    let state = DeviceState::new(
        managed,
        HealthTracker::new(HealthPolicy::default(), ["GPU-a".to_owned()]),
        false,
        None,
    );
    let stop = CancellationToken::new();
    let task = tokio::spawn(annotator(patcher, Arc::clone(&state), None).run(stop.clone()));
    let healthy = r#"[{"id":"GPU-a","count":10,"devmem":15360,"devcore":100,"type":"NVIDIA-Tesla T4","mode":"hami-core","health":true}]"#;

    let (body, send) = handle.expect_patch("/api/v1/nodes/node-a").await;
    assert_eq!(
        body,
        json!({"metadata": {"annotations": {"hami.io/node-nvidia-register": healthy}}})
    );
    // Apiserver outage: a 503, then the loop retries with the same value.
    send.send_response(unavailable());
    let (body, send) = handle.expect_patch("/api/v1/nodes/node-a").await;
    assert_eq!(
        body["metadata"]["annotations"]["hami.io/node-nvidia-register"],
        healthy
    );
    send.send_response(ok(node("node-a", "78", json!({}))));

    // A health change is written at once, without waiting for the period.
    state.health_event(
        &tessera_node::health::HealthEvent::Xid {
            uuid: "GPU-a".into(),
            xid: 79,
        },
        tokio::time::Instant::now(),
    );
    let (body, send) = handle.expect_patch("/api/v1/nodes/node-a").await;
    let value = body["metadata"]["annotations"]["hami.io/node-nvidia-register"]
        .as_str()
        .expect("string")
        .to_owned();
    assert!(!value.contains("health"), "{value}");
    send.send_response(ok(node("node-a", "78", json!({}))));

    // And periodically after that.
    let (_, send) = handle.expect_patch("/api/v1/nodes/node-a").await;
    send.send_response(ok(node("node-a", "78", json!({}))));
    stop.cancel();
    task.await.expect("no panic");
}

#[tokio::test(start_paused = true)]
async fn opt_in_capacity_is_patched_on_the_status_subresource() {
    let (client, mut handle) = mock_client();
    let patcher = KubePatcher::new(client, "node-a");
    let gpus: Vec<_> = (0..2).map(|i| t4(&format!("GPU-{i}"), i)).collect();
    let (managed, _) = plan_gpus(
        &gpus,
        &AdvertiseSettings::new(&Default::default(), Default::default(), ""),
        &|_| false,
    );
    let state = DeviceState::new(
        managed,
        HealthTracker::new(
            HealthPolicy::default(),
            ["GPU-0".to_owned(), "GPU-1".to_owned()],
        ),
        false,
        None,
    );
    let stop = CancellationToken::new();
    let names = tessera_node::kube_edges::CapacityNames {
        memory: "nvidia.com/gpumem".into(),
        cores: "nvidia.com/gpucores".into(),
    };
    let task = tokio::spawn(annotator(patcher, state, Some(names)).run(stop.clone()));
    let (_, send) = handle.expect_patch("/api/v1/nodes/node-a").await;
    send.send_response(ok(node("node-a", "78", json!({}))));
    let (body, send) = handle.expect_patch("/api/v1/nodes/node-a/status").await;
    assert_eq!(
        body,
        json!({"status": {"capacity": {"nvidia.com/gpumem": "30720", "nvidia.com/gpucores": "200"}}})
    );
    send.send_response(ok(node("node-a", "78", json!({}))));
    stop.cancel();
    task.await.expect("no panic");
}

/// With topology (`--enable-topology-score`), `hami.io/node-nvidia-score` goes in the same patch
/// as the register annotation.
#[tokio::test(start_paused = true)]
async fn topology_scores_are_patched_with_the_register_annotation() {
    use hami_contract::node::P2pLink;
    use hami_contract::topology::{GpuLinks, NodeTopology};
    let (client, mut handle) = mock_client();
    let patcher = KubePatcher::new(client, "node-a");
    let (managed, _) = plan_gpus(
        &[t4("GPU-a", 0), t4("GPU-b", 1)],
        &AdvertiseSettings::new(&Default::default(), Default::default(), ""),
        &|_| false,
    );
    let state = DeviceState::new(
        managed,
        HealthTracker::new(
            HealthPolicy::default(),
            ["GPU-a".to_owned(), "GPU-b".to_owned()],
        ),
        false,
        None,
    );
    let gpu = |uuid: &str| GpuLinks {
        uuid: uuid.into(),
        pci_bus_id: String::new(),
        nvlinks: Vec::new(),
    };
    state.set_topology(NodeTopology {
        gpus: vec![gpu("GPU-a"), gpu("GPU-b")],
        pcie: [((0, 1), P2pLink::CrossCpu), ((1, 0), P2pLink::CrossCpu)].into(),
    });
    let stop = CancellationToken::new();
    let task = tokio::spawn(annotator(patcher, Arc::clone(&state), None).run(stop.clone()));
    let (body, send) = handle.expect_patch("/api/v1/nodes/node-a").await;
    let annotations = &body["metadata"]["annotations"];
    assert!(
        annotations["hami.io/node-nvidia-register"]
            .as_str()
            .is_some_and(|v| v.contains("GPU-b")),
        "{body}"
    );
    assert_eq!(
        annotations["hami.io/node-nvidia-score"],
        r#"[{"uuid":"GPU-a","score":{"GPU-b":10}},{"uuid":"GPU-b","score":{"GPU-a":10}}]"#
    );
    send.send_response(ok(node("node-a", "78", json!({}))));
    stop.cancel();
    task.await.expect("no panic");
}

//! The apiserver edge against a `tower-test` mock: exact PATCH bodies for pod annotations, the
//! node register annotation (with an apiserver outage in between), and HAMi lock release.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use kube::client::Body;
use serde_json::{Value, json};
use tessera_device_plugin::allocator::PodPatcher;
use tessera_device_plugin::gpu::{AdvertiseSettings, GpuInfo, plan_gpus};
use tessera_device_plugin::health::{HealthPolicy, HealthTracker};
use tessera_device_plugin::kube_edges::{KubePatcher, annotation_loop};
use tessera_device_plugin::service::DeviceState;
use tower_test::mock::{self, Handle};

type MockHandle = Handle<Request<Body>, Response<Body>>;

fn client() -> (kube::Client, MockHandle) {
    let (svc, handle) = mock::pair::<Request<Body>, Response<Body>>();
    (kube::Client::new(svc, "default"), handle)
}

async fn expect_patch(
    handle: &mut MockHandle,
    path: &str,
) -> (Value, mock::SendResponse<Response<Body>>) {
    let (req, send) = tokio::time::timeout(Duration::from_secs(60), handle.next_request())
        .await
        .expect("a request in time")
        .expect("a request");
    assert_eq!(req.method(), Method::PATCH);
    assert_eq!(req.uri().path(), path);
    assert_eq!(
        req.headers()["content-type"],
        "application/merge-patch+json"
    );
    let body = req.into_body().collect_bytes().await.expect("body");
    (serde_json::from_slice(&body).expect("json body"), send)
}

fn ok(object: Value) -> Response<Body> {
    Response::builder()
        .body(Body::from(serde_json::to_vec(&object).expect("json")))
        .expect("response")
}

fn pod(name: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "ns"}})
}

fn node(annotations: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Node",
           "metadata": {"name": "node-a", "resourceVersion": "77", "annotations": annotations}})
}

#[tokio::test]
async fn pod_patch_is_a_merge_patch_of_exactly_the_annotations_with_the_uid_precondition() {
    let (client, mut handle) = client();
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
    let (body, send) = expect_patch(&mut handle, "/api/v1/namespaces/ns/pods/web").await;
    assert_eq!(
        body,
        json!({"metadata": {"uid": "uid-web", "annotations": {"hami.io/bind-phase": "success", "hami.io/vgpu-devices-to-allocate": ";"}}})
    );
    send.send_response(ok(pod("web")));
    task.await.expect("no panic").expect("patched");
}

#[tokio::test]
async fn hami_lock_is_released_only_when_it_names_the_pod() {
    let (client, mut handle) = client();
    let patcher = KubePatcher::new(client, "node-a");
    let p = patcher.clone();
    let task = tokio::spawn(async move { p.release_hami_lock("ns", "web").await });
    let (req, send) = handle.next_request().await.expect("GET node");
    assert_eq!(
        (req.method(), req.uri().path()),
        (&Method::GET, "/api/v1/nodes/node-a")
    );
    send.send_response(ok(node(
        json!({"hami.io/mutex.lock": "2025-06-13T09:07:40+08:00,ns,web"}),
    )));
    let (body, send) = expect_patch(&mut handle, "/api/v1/nodes/node-a").await;
    assert_eq!(
        body,
        json!({"metadata": {"resourceVersion": "77", "annotations": {"hami.io/mutex.lock": null}}})
    );
    send.send_response(ok(node(json!({}))));
    task.await.expect("no panic").expect("released");

    // Another pod's lock: GET only, no PATCH.
    let task = tokio::spawn(async move { patcher.release_hami_lock("ns", "web").await });
    let (_, send) = handle.next_request().await.expect("GET node");
    send.send_response(ok(node(
        json!({"hami.io/mutex.lock": "2025-06-13T09:07:40+08:00,ns,other"}),
    )));
    task.await.expect("no panic").expect("nothing to do");
}

#[tokio::test(start_paused = true)]
async fn register_annotation_survives_an_apiserver_outage_and_follows_health() {
    let (client, mut handle) = client();
    let patcher = KubePatcher::new(client, "node-a");
    let gpu = GpuInfo {
        uuid: "GPU-a".into(),
        index: 0,
        name: "Tesla T4".into(),
        memory_total_mib: Some(15360),
        pci_bus_id: String::new(),
        numa_node: None,
        mig_enabled: false,
    };
    let (managed, _) = plan_gpus(
        &[gpu],
        &AdvertiseSettings::new(&Default::default(), Default::default(), ""),
    );
    let state = DeviceState::new(
        managed,
        HealthTracker::new(HealthPolicy::default(), ["GPU-a".to_owned()]),
        false,
        None,
    );
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(annotation_loop(
        patcher,
        Arc::clone(&state),
        Duration::from_secs(30),
        None,
        None,
        stop,
    ));
    let healthy = r#"[{"id":"GPU-a","count":10,"devmem":15360,"devcore":100,"type":"NVIDIA-Tesla T4","mode":"hami-core","health":true}]"#;

    let (body, send) = expect_patch(&mut handle, "/api/v1/nodes/node-a").await;
    assert_eq!(
        body,
        json!({"metadata": {"annotations": {"hami.io/node-nvidia-register": healthy}}})
    );
    // Apiserver outage: a 503, then the loop retries with the same value.
    send.send_response(
        Response::builder()
            .status(StatusCode::SERVICE_UNAVAILABLE)
            .body(Body::from(br#"{"kind":"Status","apiVersion":"v1","status":"Failure","message":"unavailable","code":503}"#.to_vec()))
            .expect("response"),
    );
    let (body, send) = expect_patch(&mut handle, "/api/v1/nodes/node-a").await;
    assert_eq!(
        body["metadata"]["annotations"]["hami.io/node-nvidia-register"],
        healthy
    );
    send.send_response(ok(node(json!({}))));

    // A health change is written at once, without waiting for the period.
    state.health_event(
        &tessera_device_plugin::health::HealthEvent::Xid {
            uuid: "GPU-a".into(),
            xid: 79,
        },
        std::time::Instant::now(),
    );
    let (body, send) = expect_patch(&mut handle, "/api/v1/nodes/node-a").await;
    let value = body["metadata"]["annotations"]["hami.io/node-nvidia-register"]
        .as_str()
        .expect("string")
        .to_owned();
    assert!(!value.contains("health"), "{value}");
    send.send_response(ok(node(json!({}))));

    // And periodically after that.
    let (_, send) = expect_patch(&mut handle, "/api/v1/nodes/node-a").await;
    send.send_response(ok(node(json!({}))));
    stop_tx.send(true).expect("stop");
    task.await.expect("no panic");
}

#[tokio::test(start_paused = true)]
async fn opt_in_capacity_is_patched_on_the_status_subresource() {
    let (client, mut handle) = client();
    let patcher = KubePatcher::new(client, "node-a");
    let gpus: Vec<GpuInfo> = (0..2)
        .map(|i| GpuInfo {
            uuid: format!("GPU-{i}"),
            index: i,
            name: "Tesla T4".into(),
            memory_total_mib: Some(15360),
            pci_bus_id: String::new(),
            numa_node: None,
            mig_enabled: false,
        })
        .collect();
    let (managed, _) = plan_gpus(
        &gpus,
        &AdvertiseSettings::new(&Default::default(), Default::default(), ""),
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
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let names = tessera_device_plugin::kube_edges::CapacityNames {
        memory: "nvidia.com/gpumem".into(),
        cores: "nvidia.com/gpucores".into(),
    };
    let task = tokio::spawn(annotation_loop(
        patcher,
        state,
        Duration::from_secs(30),
        None,
        Some(names),
        stop,
    ));
    let (_, send) = expect_patch(&mut handle, "/api/v1/nodes/node-a").await;
    send.send_response(ok(node(json!({}))));
    let (body, send) = expect_patch(&mut handle, "/api/v1/nodes/node-a/status").await;
    assert_eq!(
        body,
        json!({"status": {"capacity": {"nvidia.com/gpumem": "30720", "nvidia.com/gpucores": "200"}}})
    );
    send.send_response(ok(node(json!({}))));
    stop_tx.send(true).expect("stop");
    task.await.expect("no panic");
}

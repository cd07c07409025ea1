//! Golden tests of the extender HTTP API through the real router, against the fake cluster edge.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::{Value, json};
use tessera_http::metrics_access::{Access, MetricsGate, ReviewError, TokenReviewer};
use tessera_scheduler::engine::{Command, Engine, EngineHandle, Observation};
use tessera_scheduler::http::{App, Auth, metrics_router, router};
use tessera_scheduler::metrics::Metrics;
use tessera_scheduler::testing::FakeEdge;
use tessera_scheduler_core::config::{DecisionConfig, WriteOptions};
use tessera_scheduler_core::fixtures::{gpu_node, gpu_pod};
use tessera_scheduler_core::webhook::WebhookConfig;
use tower::ServiceExt;

struct Harness {
    app: Arc<App<FakeEdge>>,
    edge: Arc<FakeEdge>,
    engine: EngineHandle,
}

async fn harness_with(engine: Engine, auth: Auth) -> Harness {
    harness_config(engine, auth, DecisionConfig::default()).await
}

async fn harness_config(engine: Engine, auth: Auth, decision: DecisionConfig) -> Harness {
    harness_webhook(engine, auth, decision, Default::default()).await
}

async fn harness_webhook(
    engine: Engine,
    auth: Auth,
    decision: DecisionConfig,
    webhook: WebhookConfig,
) -> Harness {
    let engine = EngineHandle::spawn(engine);
    let edge = Arc::new(FakeEdge::new());
    edge.watch(engine.clone());
    for n in [gpu_node("node1", 1, 16000, 10)] {
        engine
            .send(Command::Observe(Observation::NodeUpsert(Box::new(n))))
            .await;
    }
    let app = Arc::new(App {
        engine: engine.clone(),
        edge: edge.clone(),
        auth: Arc::new(auth),
        decision,
        webhook,
        facts: Default::default(),
        metrics: Metrics::default(),
        ready: Arc::new(AtomicBool::new(true)),
    });
    Harness { app, edge, engine }
}

async fn harness() -> Harness {
    harness_with(
        Engine::standalone(DecisionConfig::default()),
        Auth::default(),
    )
    .await
}

/// HAMi's write order: the decision patched at filter, success Events.
async fn hami_order_harness() -> Harness {
    let cfg = DecisionConfig {
        writes: WriteOptions {
            decision_at_filter: true,
            success_events: true,
        },
        ..Default::default()
    };
    harness_config(Engine::standalone(cfg.clone()), Auth::default(), cfg).await
}

/// Adds pod `default/p1` (one GPU, 3000 MiB, 30 %) to the fake API server and filters it onto
/// node1; returns `/filter`'s status and body.
async fn filter_p1(h: &Harness) -> (StatusCode, String) {
    let pod = gpu_pod("default", "p1", 1, 3000, 30);
    h.edge.add_pod(pod.clone());
    post(h, "/filter", filter_args(&pod, &["node1"]), None).await
}

fn stored(h: &Harness, name: &str) -> k8s_openapi::api::core::v1::Pod {
    h.edge
        .pods()
        .into_iter()
        .find(|p| p.metadata.name.as_deref() == Some(name))
        .unwrap()
}

/// The annotations the device plugin reads, for one 3000 MiB / 30 % device on node1's GPU 0.
fn assert_decision_on(pod: &k8s_openapi::api::core::v1::Pod) {
    let a = pod.metadata.annotations.clone().unwrap_or_default();
    assert_eq!(a["hami.io/vgpu-node"], "node1");
    assert_eq!(
        a["hami.io/vgpu-devices-allocated"],
        "GPU-node1-0,NVIDIA,3000,30:;"
    );
    assert_eq!(
        a["hami.io/vgpu-devices-to-allocate"],
        "GPU-node1-0,NVIDIA,3000,30:;"
    );
    assert!(a["hami.io/vgpu-time"].parse::<u64>().is_ok());
}

async fn post(
    h: &Harness,
    path: &str,
    body: impl Into<Body>,
    token: Option<&str>,
) -> (StatusCode, String) {
    let mut req = Request::post(path).header("content-type", "application/json");
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let resp = router(h.app.clone())
        .oneshot(req.body(body.into()).unwrap())
        .await
        .unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

fn filter_args(pod: &k8s_openapi::api::core::v1::Pod, nodes: &[&str]) -> String {
    json!({"Pod": pod, "Nodes": null, "NodeNames": nodes}).to_string()
}

fn bind_args(ns: &str, name: &str, node: &str) -> String {
    json!({"PodName": name, "PodNamespace": ns, "PodUID": format!("uid-{ns}-{name}"), "Node": node})
        .to_string()
}

async fn booked(h: &Harness) -> (u32, u32, u32) {
    h.engine.bookings().await.iter().fold((0, 0, 0), |a, g| {
        (a.0 + g.used, a.1 + g.usedmem, a.2 + g.usedcores)
    })
}

#[tokio::test]
async fn filter_returns_exactly_one_node_and_writes_nothing() {
    let h = harness().await;
    let (status, body) = filter_p1(&h).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        body,
        r#"{"Nodes":null,"NodeNames":["node1"],"FailedNodes":null,"FailedAndUnresolvableNodes":null,"Error":""}"#
    );
    assert_eq!(h.edge.take_calls(), Vec::<String>::new());
    assert_eq!(stored(&h, "p1").metadata.annotations, None);
    // The decision is booked in the loop all the same.
    assert_eq!(booked(&h).await, (1, 3000, 30));
    assert!(h.edge.events().is_empty(), "{:?}", h.edge.events());
}

#[tokio::test]
async fn in_hami_order_filter_writes_hami_annotations_and_events() {
    let h = hami_order_harness().await;
    let (status, body) = filter_p1(&h).await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.contains(r#""NodeNames":["node1"]"#), "{body}");
    assert_eq!(h.edge.take_calls(), ["patch default/p1"]);
    let p = stored(&h, "p1");
    assert_decision_on(&p);
    assert_eq!(p.metadata.labels.unwrap()["hami.io/vgpu-node"], "node1");
    assert!(
        h.edge
            .events()
            .iter()
            .any(|e| e.reason == "FilteringSucceed")
    );
    let (_, out) = post(&h, "/bind", bind_args("default", "p1", "node1"), None).await;
    assert_eq!(out, r#"{"Error":""}"#);
    // The informer showed the patched decision and the loop let its reservation go: the bind
    // reads the decision from the pod.
    assert_eq!(h.edge.take_calls(), ["get default/p1", "bind default/p1"]);
    let ev = h.edge.events();
    let ok = ev.iter().find(|e| e.reason == "BindingSucceed").unwrap();
    assert_eq!(
        ok.message,
        "Successfully binding node [node1] to default/p1"
    );
}

#[tokio::test]
async fn filter_args_are_decoded_case_insensitively() {
    let h = harness().await;
    let pod = gpu_pod("default", "p1", 1, 3000, 30);
    h.edge.add_pod(pod.clone());
    let body = json!({"pod": pod, "nodenames": ["node1"]}).to_string();
    let (_, out) = post(&h, "/filter", body, None).await;
    assert!(out.contains(r#""NodeNames":["node1"]"#), "{out}");
}

/// The pod watch leaves `default-scheduler`'s pods out (`podspec::pod_watch_fields`), so a GPU
/// pod of that scheduler sent to `/filter` (a kube-scheduler profile configured by hand to call
/// the extender) is refused, never booked where the state could not see the booking; its other
/// pods pass untouched.
#[tokio::test]
async fn a_gpu_pod_of_the_unwatched_default_scheduler_is_refused_not_booked() {
    let webhook = WebhookConfig {
        scheduler_name: "hami-scheduler".to_owned(),
        ..Default::default()
    };
    let cfg = DecisionConfig::default();
    let h = harness_webhook(
        Engine::standalone(cfg.clone()),
        Auth::default(),
        cfg,
        webhook,
    )
    .await;
    let mut pod = gpu_pod("default", "p1", 1, 3000, 30);
    pod.spec.as_mut().unwrap().scheduler_name = Some("default-scheduler".to_owned());
    h.edge.add_pod(pod.clone());
    let (status, out) = post(&h, "/filter", filter_args(&pod, &["node1"]), None).await;
    assert_eq!(status, StatusCode::OK);
    let v: Value = serde_json::from_str(&out).unwrap();
    let error = v["Error"].as_str().unwrap_or_default();
    assert!(
        error.contains("names schedulerName default-scheduler, whose pods Tessera does not watch"),
        "{out}"
    );
    assert_eq!(booked(&h).await, (0, 0, 0));
    // The same pod under the GPU scheduler's name is placed.
    pod.spec.as_mut().unwrap().scheduler_name = Some("hami-scheduler".to_owned());
    let (_, out) = post(&h, "/filter", filter_args(&pod, &["node1"]), None).await;
    assert!(out.contains(r#""NodeNames":["node1"]"#), "{out}");
    // A default-scheduler pod without a GPU passes every candidate.
    let plain: k8s_openapi::api::core::v1::Pod = serde_json::from_value(json!({
        "metadata": {"name": "plain", "namespace": "default", "uid": "uid-plain"},
        "spec": {"schedulerName": "default-scheduler",
                 "containers": [{"name": "c", "image": "x"}]},
    }))
    .unwrap();
    let (_, out) = post(&h, "/filter", filter_args(&plain, &["node1"]), None).await;
    assert!(out.contains(r#""NodeNames":["node1"]"#), "{out}");
}

#[tokio::test]
async fn filter_reports_the_reason_per_node() {
    let h = harness().await;
    let pod = gpu_pod("default", "big", 1, 20000, 0);
    let (_, body) = post(&h, "/filter", filter_args(&pod, &["node1", "ghost"]), None).await;
    // HAMi's reason strings; both nodes are beyond preemption (the card is smaller than the
    // pod asks, the other node is unknown), so they go to `FailedAndUnresolvableNodes`
    // (deviation L4; HAMi puts every node in `FailedNodes`).
    assert_eq!(
        body,
        r#"{"Nodes":null,"NodeNames":null,"FailedNodes":{},"FailedAndUnresolvableNodes":{"ghost":"node unregistered","node1":"1/1 CardInsufficientMemory"},"Error":""}"#
    );
    let ev = h.edge.events();
    let failed = ev.iter().find(|e| e.reason == "FilteringFailed").unwrap();
    assert_eq!(
        failed.message,
        "1 nodes CardInsufficientMemory(node1); 1 nodes node unregistered(ghost)"
    );
}

#[tokio::test]
async fn missing_pod_empty_and_oversized_bodies() {
    let h = harness().await;
    let (status, body) = post(&h, "/filter", r#"{"NodeNames":["node1"]}"#, None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        body,
        r#"{"Nodes":null,"NodeNames":null,"FailedNodes":null,"FailedAndUnresolvableNodes":null,"Error":"extender args missing pod"}"#
    );
    let (status, body) = post(&h, "/filter", "", None).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::BAD_REQUEST, "Please send a request body")
    );
    let pod = gpu_pod("default", "p1", 1, 3000, 30);
    let mut big = json!({"Pod": pod, "NodeNames": ["node1"]});
    big["Padding"] = json!("x".repeat(1 << 20));
    let (status, body) = post(&h, "/filter", big.to_string(), None).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(body.contains("larger than"), "{body}");
    assert_eq!(
        booked(&h).await,
        (0, 0, 0),
        "an oversized request changes nothing"
    );
    let (status, _) = post(&h, "/bind", "", None).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn pods_without_gpu_requests_pass_through_untouched() {
    let h = harness().await;
    let mut pod = gpu_pod("default", "cpu", 1, 1, 1);
    pod.spec.as_mut().unwrap().containers[0].resources = None;
    let (_, body) = post(&h, "/filter", filter_args(&pod, &["node1", "other"]), None).await;
    assert_eq!(
        body,
        r#"{"Nodes":null,"NodeNames":["node1","other"],"FailedNodes":null,"FailedAndUnresolvableNodes":null,"Error":""}"#
    );
}

#[tokio::test]
async fn full_nodes_form_answers_with_the_chosen_node_object_and_writes_nothing() {
    let h = harness().await;
    let pod = gpu_pod("default", "p1", 1, 3000, 30);
    h.edge.add_pod(pod.clone());
    let nodes = json!({"metadata": {}, "items": [gpu_node("n-a", 1, 8000, 10), gpu_node("n-b", 1, 2000, 10)]});
    let body = json!({"Pod": pod, "Nodes": nodes, "NodeNames": null}).to_string();
    let (_, out) = post(&h, "/filter", body, None).await;
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["Nodes"]["items"][0]["metadata"]["name"], "n-a");
    // A pod that fits carries no other node's reason (deviation L7): kube-scheduler would
    // not read them.
    assert_eq!(v["FailedNodes"], Value::Null, "{v}");
    assert_eq!(v["NodeNames"], Value::Null);
    let stored = h.edge.pods().pop().unwrap();
    assert!(
        stored.metadata.annotations.is_none(),
        "no side effects in Nodes mode"
    );
}

#[tokio::test]
async fn bind_is_one_binding_that_carries_the_decision_and_allocating() {
    let h = harness().await;
    filter_p1(&h).await;
    let (status, body) = post(&h, "/bind", bind_args("default", "p1", "node1"), None).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, r#"{"Error":""}"#));
    // One API call for the placed pod: no read, no patch.
    assert_eq!(h.edge.take_calls(), ["bind default/p1"]);
    let p = stored(&h, "p1");
    assert_eq!(p.spec.as_ref().unwrap().node_name.as_deref(), Some("node1"));
    assert_decision_on(&p);
    let a = p.metadata.annotations.unwrap();
    assert_eq!(a["hami.io/bind-phase"], "allocating");
    assert!(a["hami.io/bind-time"].parse::<u64>().is_ok());
    assert!(h.edge.events().is_empty(), "{:?}", h.edge.events());
}

/// The replica that filtered the pod lost the lead before kube-scheduler's bind reached the
/// new leader: the new one holds no decision, the pod carries none, so it reads the pod and
/// decides for the node kube-scheduler chose.
#[tokio::test]
async fn a_bind_on_a_new_leader_decides_for_the_chosen_node() {
    let old = harness().await;
    let pod = gpu_pod("default", "p1", 1, 3000, 30);
    old.edge.add_pod(pod.clone());
    post(&old, "/filter", filter_args(&pod, &["node1"]), None).await;
    let new = harness().await;
    new.edge.add_pod(pod.clone());
    let (_, out) = post(&new, "/bind", bind_args("default", "p1", "node1"), None).await;
    assert_eq!(out, r#"{"Error":""}"#);
    assert_eq!(new.edge.take_calls(), ["get default/p1", "bind default/p1"]);
    assert_decision_on(&stored(&new, "p1"));
    assert_eq!(booked(&new).await, (1, 3000, 30));

    // Where the node filled up meanwhile, the bind is refused and nothing is written.
    let late = gpu_pod("default", "late", 1, 16000, 30);
    new.edge.add_pod(late);
    let (_, out) = post(&new, "/bind", bind_args("default", "late", "node1"), None).await;
    assert!(
        out.contains("filtered by another tessera-scheduler replica")
            && out.contains("no longer fits node node1"),
        "{out}"
    );
    assert_eq!(new.edge.take_calls(), ["get default/late"]);
    assert_eq!(stored(&new, "late").metadata.annotations, None);
}

#[tokio::test]
async fn bind_refuses_a_pod_confusable_with_one_still_pending_on_the_node() {
    let h = harness().await;
    let a = gpu_pod("default", "a", 1, 3000, 30);
    let b = gpu_pod("default", "b", 1, 2000, 30);
    let c = gpu_pod("default", "c", 1, 3000, 30);
    for p in [&a, &b, &c] {
        h.edge.add_pod(p.clone());
    }
    post(&h, "/filter", filter_args(&a, &["node1"]), None).await;
    assert_eq!(
        post(&h, "/bind", bind_args("default", "a", "node1"), None)
            .await
            .1,
        r#"{"Error":""}"#
    );
    // b differs in memory: the device plugin could serve it a's limits. Filter steers away…
    let (_, out) = post(&h, "/filter", filter_args(&b, &["node1"]), None).await;
    assert!(
        out.contains("PendingAllocationConflict: pod default/a"),
        "{out}"
    );
    // …and c, identical to a, may go to the same node at once.
    let (_, out) = post(&h, "/filter", filter_args(&c, &["node1"]), None).await;
    assert!(out.contains(r#""NodeNames":["node1"]"#), "{out}");
    assert_eq!(
        post(&h, "/bind", bind_args("default", "c", "node1"), None)
            .await
            .1,
        r#"{"Error":""}"#
    );
    // Once the device plugin reports a and c, b fits and binds.
    h.edge.set_bind_phase("default", "a", "success").await;
    h.edge.set_bind_phase("default", "c", "success").await;
    let (_, out) = post(&h, "/filter", filter_args(&b, &["node1"]), None).await;
    assert!(out.contains(r#""NodeNames":["node1"]"#), "{out}");
    assert_eq!(
        post(&h, "/bind", bind_args("default", "b", "node1"), None)
            .await
            .1,
        r#"{"Error":""}"#
    );
}

/// Found on a real kubelet: a pod rejected at admission (its plugin was restarting) whose first
/// update the informer saw was already `Failed` kept its bind reservation, so every confusable
/// pod waited on that node for good.
#[tokio::test]
async fn a_pod_rejected_at_admission_no_longer_holds_its_node() {
    let h = harness().await;
    let a = gpu_pod("default", "a", 1, 3000, 30);
    let b = gpu_pod("default", "b", 1, 2000, 30);
    for p in [&a, &b] {
        h.edge.add_pod(p.clone());
    }
    post(&h, "/filter", filter_args(&a, &["node1"]), None).await;
    // The informer misses the bind's own patch (it is slower than the kubelet)…
    h.edge.stop_watching();
    assert_eq!(
        post(&h, "/bind", bind_args("default", "a", "node1"), None)
            .await
            .1,
        r#"{"Error":""}"#
    );
    let (_, out) = post(&h, "/filter", filter_args(&b, &["node1"]), None).await;
    assert!(out.contains("PendingAllocationConflict"), "{out}");
    // …and its first update is the kubelet's rejection.
    h.edge.watch(h.engine.clone());
    h.edge.set_phase("default", "a", "Failed").await;
    let (_, out) = post(&h, "/filter", filter_args(&b, &["node1"]), None).await;
    assert!(out.contains(r#""NodeNames":["node1"]"#), "{out}");
}

/// A node whose plugin identifies pods through pod-resources takes confusable pods at once.
#[tokio::test]
async fn a_node_with_exact_identity_takes_confusable_pods_at_once() {
    let h = harness().await;
    let mut node = gpu_node("node1", 1, 16000, 10);
    node.metadata
        .annotations
        .get_or_insert_with(Default::default)
        .insert(
            "tessera.io/allocation-identity".into(),
            "pod-resources".into(),
        );
    h.engine
        .send(Command::Observe(Observation::NodeUpsert(Box::new(node))))
        .await;
    let a = gpu_pod("default", "a", 1, 3000, 30);
    let b = gpu_pod("default", "b", 1, 2000, 30);
    for p in [&a, &b] {
        h.edge.add_pod(p.clone());
    }
    for (p, name) in [(&a, "a"), (&b, "b")] {
        let (_, out) = post(&h, "/filter", filter_args(p, &["node1"]), None).await;
        assert!(out.contains(r#""NodeNames":["node1"]"#), "{name}: {out}");
        assert_eq!(
            post(&h, "/bind", bind_args("default", name, "node1"), None)
                .await
                .1,
            r#"{"Error":""}"#,
            "{name}"
        );
    }
}

#[tokio::test]
async fn a_failed_binding_releases_the_reservation_at_once() {
    let h = harness().await;
    filter_p1(&h).await;
    assert_eq!(booked(&h).await, (1, 3000, 30));
    h.edge
        .fail_binds
        .store(1, std::sync::atomic::Ordering::SeqCst);
    let (_, body) = post(&h, "/bind", bind_args("default", "p1", "node1"), None).await;
    assert!(body.contains("injected Binding failure"), "{body}");
    assert_eq!(booked(&h).await, (0, 0, 0));
    // The failed Binding wrote nothing, so there is nothing to undo.
    assert_eq!(h.edge.take_calls(), ["bind default/p1"]);
    assert_eq!(stored(&h, "p1").metadata.annotations, None);
}

#[tokio::test]
async fn in_hami_order_a_failed_binding_marks_the_pod_failed() {
    let h = hami_order_harness().await;
    filter_p1(&h).await;
    h.edge
        .fail_binds
        .store(1, std::sync::atomic::Ordering::SeqCst);
    let (_, body) = post(&h, "/bind", bind_args("default", "p1", "node1"), None).await;
    assert!(body.contains("injected Binding failure"), "{body}");
    assert_eq!(booked(&h).await, (0, 0, 0));
    assert_eq!(
        stored(&h, "p1").metadata.annotations.unwrap()["hami.io/bind-phase"],
        "failed"
    );
}

#[tokio::test]
async fn bind_of_an_unknown_pod_or_stale_uid_is_an_error() {
    let h = harness().await;
    let (_, body) = post(&h, "/bind", bind_args("default", "ghost", "node1"), None).await;
    assert_eq!(body, r#"{"Error":"pod default/ghost not found"}"#);
    let pod = gpu_pod("default", "p1", 1, 3000, 30);
    h.edge.add_pod(pod);
    let body =
        json!({"PodName": "p1", "PodNamespace": "default", "PodUID": "old", "Node": "node1"})
            .to_string();
    let (_, out) = post(&h, "/bind", body, None).await;
    assert!(out.contains("recreated"), "{out}");
}

#[tokio::test]
async fn callers_must_authenticate_when_a_token_is_configured() {
    let auth = Auth {
        token: std::sync::RwLock::new(Some("s3cret".to_owned())),
        client_ca: false,
        scheduler_client: None,
        webhook_client: None,
    };
    let h = harness_with(Engine::standalone(DecisionConfig::default()), auth).await;
    let pod = gpu_pod("default", "p1", 1, 3000, 30);
    h.edge.add_pod(pod.clone());
    let (status, _) = post(&h, "/filter", filter_args(&pod, &["node1"]), None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _) = post(
        &h,
        "/bind",
        bind_args("default", "p1", "node1"),
        Some("wrong"),
    )
    .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    // Whoever may not filter may not ask which pods to evict either (nothing is read for it).
    h.edge.take_calls();
    let preempt = json!({"Pod": pod, "NodeNameToMetaVictims": {"node1": {"Pods": []}}});
    let (status, _) = post(&h, "/preempt", preempt.to_string(), Some("wrong")).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert!(h.edge.take_calls().is_empty());
    assert_eq!(booked(&h).await, (0, 0, 0));
    let (status, body) = post(&h, "/filter", filter_args(&pod, &["node1"]), Some("s3cret")).await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.contains(r#""NodeNames":["node1"]"#));
}

#[tokio::test]
async fn a_replica_that_is_not_leader_answers_a_retryable_error() {
    let h = harness_with(Engine::new(DecisionConfig::default()), Auth::default()).await;
    let pod = gpu_pod("default", "p1", 1, 3000, 30);
    let (status, body) = post(&h, "/filter", filter_args(&pod, &["node1"]), None).await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.contains("not the leader"), "{body}");
}

#[tokio::test]
async fn metrics_expose_hami_gpu_names_on_the_leader() {
    let h = harness().await;
    filter_p1(&h).await;
    let view = h.engine.metrics().await;
    let text = h.app.metrics.render(view.expand());
    assert!(text.contains(r#"hami_gpu_memory_allocated_bytes{zone="vGPU",node="node1",device_uuid="GPU-node1-0",device_index="0",device_cores="100",device_type="NVIDIA-Tesla T4"} 3145728000"#), "{text}");
    assert!(
        text.contains("tessera_filter_duration_seconds_count 1"),
        "{text}"
    );
    assert!(text.contains(r#"hami_vgpu_core_allocated_ratio{zone="vGPU",namespace="default",node="node1",pod="p1",container_index="0",device_uuid="GPU-node1-0"} 30"#), "{text}");
}

/// A scrape's view is taken on the decision loop and encoded after it: decisions the loop makes
/// meanwhile neither show in it nor tear it, and the next scrape sees them.
#[tokio::test]
async fn a_scrape_encodes_the_state_as_it_was_when_its_view_was_taken() {
    let h = harness().await;
    filter_p1(&h).await;
    let before = h.engine.metrics().await;
    h.engine
        .send(Command::Observe(Observation::NodeUpsert(Box::new(
            gpu_node("node2", 1, 16000, 10),
        ))))
        .await;
    let pod = gpu_pod("default", "p2", 1, 2000, 20);
    h.edge.add_pod(pod.clone());
    let (status, body) = post(&h, "/filter", filter_args(&pod, &["node2"]), None).await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.contains(r#""NodeNames":["node2"]"#), "{body}");
    let used = |text: &str| {
        text.lines()
            .filter(|l| l.starts_with("hami_vgpu_core_allocated_ratio{"))
            .count()
    };
    let old = h.app.metrics.render(before.expand());
    assert_eq!(used(&old), 1, "{old}");
    assert!(!old.contains(r#"node="node2""#), "{old}");
    let new = h.app.metrics.render(h.engine.metrics().await.expand());
    assert_eq!(used(&new), 2, "{new}");
    assert!(new.contains(r#"hami_vgpu_core_allocated_ratio{zone="vGPU",namespace="default",node="node2",pod="p2",container_index="0",device_uuid="GPU-node2-0"} 20"#), "{new}");
}

/// A namespace's quota series: its limits, and what its pods and in-flight decisions use, the
/// pods of other namespaces not counted.
#[tokio::test]
async fn a_scrape_shows_each_quota_with_what_its_namespace_uses() {
    let h = harness().await;
    let quota: k8s_openapi::api::core::v1::ResourceQuota = serde_json::from_value(json!({
        "metadata": {"namespace": "team-a", "name": "gpu"},
        "spec": {"hard": {"limits.nvidia.com/gpumem": "10000", "limits.nvidia.com/gpu": "4"}}}))
    .unwrap();
    h.engine
        .send(Command::Observe(Observation::QuotaUpsert(Box::new(quota))))
        .await;
    h.engine
        .send(Command::Observe(Observation::NodeUpsert(Box::new(
            gpu_node("node2", 1, 16000, 10),
        ))))
        .await;
    // One in-flight decision per node (a second pod would wait for the first's allocation).
    for (namespace, name, mem, node) in [
        ("team-a", "a1", 3000, "node1"),
        ("team-b", "b1", 2000, "node2"),
    ] {
        let pod = gpu_pod(namespace, name, 1, mem, 10);
        h.edge.add_pod(pod.clone());
        let (_, body) = post(&h, "/filter", filter_args(&pod, &[node]), None).await;
        assert!(
            body.contains(&format!(r#""NodeNames":["{node}"]"#)),
            "{body}"
        );
    }
    let text = h.app.metrics.render(h.engine.metrics().await.expand());
    let series = |name: &str| {
        text.lines()
            .filter(|l| l.starts_with(name))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        series("hami_resource_quota_used{"),
        vec![
            r#"hami_resource_quota_used{zone="vGPU",namespace="team-a",quota_name="limits.nvidia.com/gpumem",limit="10000"} 3000.0"#,
            r#"hami_resource_quota_used{zone="vGPU",namespace="team-a",quota_name="limits.nvidia.com/gpu",limit="4"} 1.0"#,
        ],
        "{text}"
    );
}

#[tokio::test]
async fn malformed_args_are_reported_in_error_with_http_200() {
    let h = harness().await;
    let (status, body) = post(&h, "/filter", "{not json", None).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        body.contains(r#""Error":"request body is not valid JSON"#),
        "{body}"
    );
    let (_, body) = post(
        &h,
        "/filter",
        r#"{"Pod": {"metadata": {"name": "p"}}, "NodeNames": "node1"}"#,
        None,
    )
    .await;
    assert!(body.contains("NodeNames: invalid type"), "{body}");
    let (status, body) = post(
        &h,
        "/bind",
        r#"{"PodName":"p","PodNamespace":"default","Node":"node1"}"#,
        None,
    )
    .await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::OK, r#"{"Error":"PodUID: missing"}"#)
    );
}

/// `/webhook` answers from the replica's cluster facts, whether or not it leads.
#[tokio::test]
async fn the_webhook_denies_memory_above_the_largest_gpu_from_the_replicas_facts_even_as_standby() {
    let h = harness_with(Engine::new(DecisionConfig::default()), Auth::default()).await;
    let review = json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {"uid": "r1", "operation": "CREATE", "namespace": "default",
            "userInfo": {"username": "alice"},
            "object": {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "big"},
                "spec": {"containers": [{"name": "main", "image": "app", "resources": {"limits":
                    {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "20000"}}}]}}}})
    .to_string();
    // Nothing seen yet: admitted (the filter would refuse it, with reasons).
    let (status, body) = post(&h, "/webhook", review.clone(), None).await;
    assert_eq!(status, StatusCode::OK);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["response"]["allowed"], true, "{body}");
    // The replica's watch registers node1 (16000 MiB).
    {
        let rec = tessera_scheduler_core::state::NodeRecord::from_node(
            &gpu_node("node1", 1, 16000, 10),
            &DecisionConfig::default(),
        )
        .unwrap();
        h.app.facts.write().unwrap().upsert_node(&rec);
    }
    let (_, body) = post(&h, "/webhook", review, None).await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["response"]["allowed"], false, "{body}");
    assert_eq!(
        v["response"]["status"]["message"],
        "container main asks for 20000 MiB of GPU memory per GPU (nvidia.com/gpumem); no GPU in the cluster has that much: no node can ever run this pod; lower nvidia.com/gpumem or use nvidia.com/gpumem-percentage"
    );
    // Both reviews are counted by result and timed (the webhook alerts read these).
    let (_, text) = get_metrics_listener(&h, &None, "/metrics", None).await;
    assert!(
        text.contains(r#"tessera_webhook_reviews_total{result="denied"} 1"#),
        "{text}"
    );
    assert!(
        text.contains(r#"tessera_webhook_reviews_total{result="allowed"} 1"#),
        "{text}"
    );
    assert!(
        text.contains("tessera_webhook_duration_seconds_count 2"),
        "{text}"
    );
}

/// A reviewer that knows two tokens: Prometheus' (allowed) and a tenant's (a real user, not
/// allowed); anything else is not a token the API server accepts.
struct TwoTokens;

impl TokenReviewer for TwoTokens {
    fn review<'a>(
        &'a self,
        token: &'a str,
    ) -> futures::future::BoxFuture<'a, Result<Access, ReviewError>> {
        Box::pin(async move {
            Ok(match token {
                "prometheus" => Access::Allowed,
                "tenant" => Access::Forbidden,
                _ => Access::Unauthenticated,
            })
        })
    }
}

async fn get_metrics_listener(
    h: &Harness,
    gate: &Option<Arc<MetricsGate>>,
    path: &str,
    token: Option<&str>,
) -> (StatusCode, String) {
    let mut req = Request::get(path);
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let resp = metrics_router(h.app.clone(), gate.clone())
        .oneshot(req.body(Body::empty()).unwrap())
        .await
        .unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

#[tokio::test]
async fn metrics_behind_authorization_answer_only_an_allowed_token_and_probes_stay_open() {
    let h = harness().await;
    let gate = Some(Arc::new(MetricsGate::new(Arc::new(TwoTokens))));
    let (status, body) = get_metrics_listener(&h, &gate, "/metrics", None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
    assert!(!body.contains("hami_"), "{body}");
    let (status, body) = get_metrics_listener(&h, &gate, "/metrics", Some("made-up")).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
    let (status, body) = get_metrics_listener(&h, &gate, "/metrics", Some("tenant")).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
    assert!(!body.contains("hami_"), "{body}");
    let (status, body) = get_metrics_listener(&h, &gate, "/metrics", Some("prometheus")).await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.contains("tessera_scheduler_leader"), "{body}");
    for probe in ["/healthz", "/readyz"] {
        let (status, _) = get_metrics_listener(&h, &gate, probe, None).await;
        assert_eq!(status, StatusCode::OK, "{probe} without a token");
    }
    // Without the gate (HAMi's behaviour) anyone reads them.
    let (status, _) = get_metrics_listener(&h, &None, "/metrics", None).await;
    assert_eq!(status, StatusCode::OK);
}

/// Issue 34: a gauge of the GPU pods waiting, by why. A pod that fits no node counts under the
/// reason that refused it until it is gone (or placed); a requeue nudge does not clear it.
#[tokio::test]
async fn pending_gpu_pods_are_counted_by_reason_until_they_go() {
    // With the requeue channel the daemon has, so that freed capacity nudges the waiting pod.
    let (requeue, mut nudges) = tokio::sync::mpsc::unbounded_channel();
    let engine = Engine::standalone(DecisionConfig::default()).with_requeue(requeue);
    let h = harness_with(engine, Auth::default()).await;
    let big = gpu_pod("default", "big", 1, 64000, 10);
    h.edge.add_pod(big.clone());
    let (status, body) = post(&h, "/filter", filter_args(&big, &["node1"]), None).await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.contains("CardInsufficientMemory"), "{body}");
    let series = r#"tessera_pending_gpu_pods{reason="CardInsufficientMemory"} 1"#;
    let (_, text) = get_metrics_listener(&h, &None, "/metrics", None).await;
    assert!(text.contains(series), "{text}");
    // Another pod frees nothing, but a node that changes nudges the waiting pods: still waiting.
    h.engine
        .send(Command::Observe(Observation::NodeUpsert(Box::new(
            gpu_node("node1", 2, 16000, 10),
        ))))
        .await;
    let nudged = nudges.recv().await.unwrap_or_default();
    assert_eq!(nudged.len(), 1, "the waiting pod was nudged");
    let (_, text) = get_metrics_listener(&h, &None, "/metrics", None).await;
    assert!(text.contains(series), "a nudge is not a placement: {text}");
    h.engine
        .send(Command::Observe(Observation::PodDelete {
            uid: big.metadata.uid.clone().unwrap(),
        }))
        .await;
    let (_, text) = get_metrics_listener(&h, &None, "/metrics", None).await;
    assert!(!text.contains("tessera_pending_gpu_pods{"), "{text}");
}

/// `/preempt` (issue 30): a high-priority pod gets the lower-priority tenant of node1's GPU as
/// its victim (UIDs, kube-scheduler's `nodeCacheCapable` form), the PodDisruptionBudgets are
/// read for the ranking, the pod gets an Event naming the GPU, and a body that is not
/// `ExtenderPreemptionArgs` is a 400 kube-scheduler reads as the extender's error.
#[tokio::test]
async fn preempt_names_the_lower_priority_tenant_of_the_gpu_and_only_it() {
    let h = harness().await;
    let mut low = tessera_scheduler_core::fixtures::running_pod(
        "default",
        "low",
        "node1",
        "GPU-node1-0,NVIDIA,12000,0:;",
    );
    low.spec.as_mut().unwrap().priority = Some(1);
    let mut high = tessera_scheduler_core::fixtures::running_pod(
        "default",
        "high",
        "node1",
        "GPU-node1-0,NVIDIA,2000,0:;",
    );
    high.spec.as_mut().unwrap().priority = Some(1000);
    for p in [low, high] {
        h.engine
            .send(Command::Observe(Observation::PodUpsert(Box::new(p))))
            .await;
    }
    let mut urgent = gpu_pod("default", "urgent", 1, 10000, 0);
    urgent.spec.as_mut().unwrap().priority = Some(100);
    let args = json!({"Pod": urgent, "NodeNameToMetaVictims": {
        "node1": {"Pods": [], "NumPDBViolations": 0}}});
    h.edge.take_calls();
    let (status, body) = post(&h, "/preempt", args.to_string(), None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        v,
        json!({"NodeNameToMetaVictims": {"node1": {
            "Pods": [{"UID": "uid-default-low"}], "NumPDBViolations": 0}}})
    );
    // Only the namespaces of possible victims are asked for their budgets.
    assert_eq!(h.edge.take_calls(), ["list default/poddisruptionbudgets"]);
    let events = h.edge.events();
    let e = events.last().unwrap();
    assert_eq!(e.reason, "PreemptionCandidates");
    assert!(
        e.message.contains("default/low (priority 1)") && e.message.contains("GPU-node1-0"),
        "{}",
        e.message
    );
    // Too large for the card: no node is offered, and the Event says why.
    let mut huge = gpu_pod("default", "huge", 1, 20000, 0);
    huge.spec.as_mut().unwrap().priority = Some(100);
    let args = json!({"Pod": huge, "NodeNameToMetaVictims": {"node1": {"Pods": []}}});
    let (status, body) = post(&h, "/preempt", args.to_string(), None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap(),
        json!({"NodeNameToMetaVictims": {}})
    );
    assert_eq!(
        h.edge.events().last().unwrap().reason,
        "PreemptionNotHelpful"
    );
    let (status, body) = post(&h, "/preempt", r#"{"NodeNameToMetaVictims": {}}"#, None).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body.contains("Pod: missing"), "{body}");
}

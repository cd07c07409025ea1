//! Nodes that run HAMi's own device plugin (label `tessera.io/device-plugin: hami`): the extender
//! takes HAMi's node lock at bind, keeps one bind in flight, and clears a lock whose pod never
//! reaches `Allocate`. HAMi is not on the Go module proxy, so its plugin's choice of pod is a
//! test double that follows HAMi v2.10's rules, cited below.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use axum::body::Body;
use axum::http::Request;
use http_body_util::BodyExt;
use k8s_openapi::api::core::v1::Pod;
use serde_json::json;
use tessera_scheduler::engine::{Command, Engine, EngineHandle, Observation};
use tessera_scheduler::http::{App, Auth, router};
use tessera_scheduler::metrics::Metrics;
use tessera_scheduler::testing::FakeEdge;
use tessera_scheduler_core::config::DecisionConfig;
use tessera_scheduler_core::fixtures::{gpu_node, gpu_pod};
use tower::ServiceExt;

struct Harness {
    app: Arc<App<FakeEdge>>,
    edge: Arc<FakeEdge>,
    engine: EngineHandle,
}

/// One node with one 16 GB GPU (10 slots); `hami_plugin` labels it as HAMi's plugin's.
async fn harness(hami_plugin: bool) -> Harness {
    let engine = EngineHandle::spawn(Engine::standalone(DecisionConfig::default()));
    let edge = Arc::new(FakeEdge::new());
    edge.watch(engine.clone());
    let mut node = gpu_node("node1", 1, 16000, 10);
    if hami_plugin {
        node.metadata
            .labels
            .get_or_insert_with(Default::default)
            .insert("tessera.io/device-plugin".into(), "hami".into());
    }
    engine
        .send(Command::Observe(Observation::NodeUpsert(Box::new(node))))
        .await;
    let app = Arc::new(App {
        engine: engine.clone(),
        edge: edge.clone(),
        auth: Arc::new(Auth::default()),
        decision: DecisionConfig::default(),
        webhook: Default::default(),
        facts: Default::default(),
        metrics: Metrics::default(),
        ready: Arc::new(AtomicBool::new(true)),
    });
    Harness { app, edge, engine }
}

async fn post(h: &Harness, path: &str, body: String) -> String {
    let req = Request::post(path)
        .header("content-type", "application/json")
        .body(Body::from(body))
        .unwrap();
    let resp = router(h.app.clone()).oneshot(req).await.unwrap();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Filters and binds `default/<name>` onto node1; the bind's answer (`{"Error":""}` on success).
async fn place(h: &Harness, name: &str, mem: u32) -> String {
    let pod = gpu_pod("default", name, 1, mem, 10);
    h.edge.add_pod(pod.clone());
    let filter = post(
        h,
        "/filter",
        json!({"Pod": pod, "Nodes": null, "NodeNames": ["node1"]}).to_string(),
    )
    .await;
    assert!(filter.contains("node1"), "{filter}");
    post(
        h,
        "/bind",
        json!({"PodName": name, "PodNamespace": "default", "PodUID": format!("uid-default-{name}"), "Node": "node1"})
            .to_string(),
    )
    .await
}

fn annotation(p: &Pod, key: &str) -> Option<String> {
    p.metadata.annotations.as_ref()?.get(key).cloned()
}

/// HAMi v2.10's `util.GetPendingPod` (`pkg/util/util.go`), the pod its device plugin serves an
/// `Allocate` for: the holder of the node lock when there is one (`GetAllocatePodByNode`), else
/// the first pod of the node's list (the API server lists by namespace, then name) that is in
/// phase Pending, has `hami.io/bind-time`, `hami.io/bind-phase` `allocating` or `success` and
/// `hami.io/vgpu-node` naming the node.
fn hami_pending_pod(edge: &FakeEdge, node: &str) -> Option<Pod> {
    let mut pods = edge.pods();
    if let Some(lock) = edge.hami_lock(node) {
        let (_, holder) = lock.split_once(',')?;
        let (ns, name) = holder.split_once(',')?;
        return pods.into_iter().find(|p| {
            p.metadata.namespace.as_deref() == Some(ns) && p.metadata.name.as_deref() == Some(name)
        });
    }
    pods.sort_by_key(|p| (p.metadata.namespace.clone(), p.metadata.name.clone()));
    pods.into_iter().find(|p| {
        let pending = p
            .status
            .as_ref()
            .and_then(|s| s.phase.as_deref())
            .is_none_or(|ph| ph == "Pending");
        pending
            && annotation(p, "hami.io/bind-time").is_some()
            && matches!(
                annotation(p, "hami.io/bind-phase").as_deref(),
                Some("allocating" | "success")
            )
            && annotation(p, "hami.io/vgpu-node").as_deref() == Some(node)
    })
}

/// HAMi's plugin's `Allocate` for the pod [`hami_pending_pod`] names: it serves that pod's
/// devices, marks it `success` and releases the lock (`plugin.go` `Allocate`:
/// `PodAllocationTrySuccess`, then `nodelock.ReleaseNodeLock`). Returns the served pod's name.
async fn hami_allocate(edge: &FakeEdge, node: &str) -> Option<String> {
    let pod = hami_pending_pod(edge, node)?;
    let (ns, name) = (pod.metadata.namespace.clone()?, pod.metadata.name.clone()?);
    edge.set_bind_phase(&ns, &name, "success").await;
    if edge
        .hami_lock(node)
        .is_some_and(|v| hami_contract::nodelock::is_held_by(&v, &ns, &name))
    {
        edge.set_hami_lock(node, None);
    }
    Some(name)
}

/// The defect the mode exists for. Without it, an allocated pod that is still Pending (its
/// image is being pulled) is what HAMi's plugin finds for the next pod's `Allocate`: the next
/// pod would run with the first one's limits.
#[tokio::test]
async fn without_the_node_lock_hamis_plugin_serves_an_earlier_pod() {
    let h = harness(false).await;
    assert_eq!(place(&h, "a", 3000).await, r#"{"Error":""}"#);
    assert_eq!(hami_allocate(&h.edge, "node1").await.as_deref(), Some("a"));
    assert_eq!(place(&h, "b", 2000).await, r#"{"Error":""}"#);
    assert_eq!(
        h.edge.hami_lock("node1"),
        None,
        "no lock on an ordinary node"
    );
    assert_eq!(
        hami_allocate(&h.edge, "node1").await.as_deref(),
        Some("a"),
        "HAMi's plugin takes the still-Pending pod a for b's Allocate"
    );
}

/// With the mode, the lock names each pod at bind, so HAMi's plugin serves the right one, and a
/// second bind waits until the first pod was allocated.
#[tokio::test]
async fn the_node_lock_names_each_pod_and_binds_go_one_at_a_time() {
    let h = harness(true).await;
    assert_eq!(place(&h, "a", 3000).await, r#"{"Error":""}"#);
    let lock = h.edge.hami_lock("node1").expect("a lock");
    assert!(lock.ends_with(",default,a"), "{lock}");
    // Any second pod waits, whatever its limits: HAMi's plugin takes one at a time. The filter
    // steers it away, and a bind (kube-scheduler may still send one) is refused.
    let refused = place(&h, "b", 3000).await;
    assert!(
        refused.contains("pod default/a is still being allocated here and HAMi's device plugin here takes one pod at a time"),
        "{refused}"
    );
    assert!(h.edge.hami_lock("node1").unwrap().ends_with(",default,a"));
    // HAMi's plugin allocates a (and releases the lock); b then binds and gets the lock.
    assert_eq!(hami_allocate(&h.edge, "node1").await.as_deref(), Some("a"));
    assert_eq!(
        post(
            &h,
            "/bind",
            json!({"PodName": "b", "PodNamespace": "default", "PodUID": "uid-default-b", "Node": "node1"})
                .to_string(),
        )
        .await,
        r#"{"Error":""}"#
    );
    assert!(h.edge.hami_lock("node1").unwrap().ends_with(",default,b"));
    // a is still Pending (image pull), but the lock makes HAMi's plugin serve b.
    assert_eq!(hami_allocate(&h.edge, "node1").await.as_deref(), Some("b"));
}

/// A lock whose pod will never reach `Allocate` (deleted after its bind) is cleared by the
/// extender's sweep; HAMi would keep it for 5 minutes, and place nothing there meanwhile.
#[tokio::test]
async fn a_lock_whose_pod_is_gone_is_cleared() {
    let h = harness(true).await;
    assert_eq!(place(&h, "a", 3000).await, r#"{"Error":""}"#);
    let lock = h.edge.hami_lock("node1").expect("a lock");
    assert!(
        h.engine.stale_hami_locks().await.is_empty(),
        "a is pending allocation"
    );
    // The lock reaches the extender's node informer; then the pod is deleted before Allocate.
    let mut node = gpu_node("node1", 1, 16000, 10);
    node.metadata
        .labels
        .get_or_insert_with(Default::default)
        .insert("tessera.io/device-plugin".into(), "hami".into());
    node.metadata
        .annotations
        .get_or_insert_with(Default::default)
        .insert("hami.io/mutex.lock".into(), lock.clone());
    h.engine
        .send(Command::Observe(Observation::NodeUpsert(Box::new(node))))
        .await;
    h.engine
        .send(Command::Observe(Observation::PodDelete {
            uid: "uid-default-a".into(),
        }))
        .await;
    let stale = h.engine.stale_hami_locks().await;
    assert_eq!(stale, [("node1".to_owned(), lock.clone())]);
    use tessera_scheduler::edge::ClusterEdge;
    h.edge.clear_hami_node_lock("node1", &lock).await.unwrap();
    assert_eq!(h.edge.hami_lock("node1"), None);
}

/// A failed Binding releases the lock it took, as HAMi's scheduler does.
#[tokio::test]
async fn a_failed_binding_releases_its_lock() {
    let h = harness(true).await;
    h.edge
        .fail_binds
        .store(1, std::sync::atomic::Ordering::SeqCst);
    let out = place(&h, "a", 3000).await;
    assert!(out.contains("injected Binding failure"), "{out}");
    assert_eq!(h.edge.hami_lock("node1"), None);
    // A lock held by a pod that still exists keeps the node: the bind is refused.
    h.edge
        .set_hami_lock("node1", Some("2026-01-01T00:00:00Z,default,a"));
    let out = place(&h, "b", 2000).await;
    assert!(out.contains("locked for pod default/a"), "{out}");
}

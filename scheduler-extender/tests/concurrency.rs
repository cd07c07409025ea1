//! Hundreds of concurrent /filter + /bind calls for one scarce node through the HTTP layer, with
//! a lagging informer, a fake device plugin and a leadership change: afterwards no GPU is booked
//! beyond its count, memory or cores (HAMi #1330 reached 11 of 10).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use axum::body::Body;
use axum::http::Request;
use http_body_util::BodyExt;
use serde_json::json;
use tessera_scheduler::engine::{Command, Engine, EngineHandle, Observation};
use tessera_scheduler::http::{App, Auth, router};
use tessera_scheduler::metrics::Metrics;
use tessera_scheduler::testing::FakeEdge;
use tessera_scheduler_core::config::DecisionConfig;
use tessera_scheduler_core::fixtures::{gpu_node, gpu_pod};
use tower::ServiceExt;

const GPUS: u32 = 2;
const COUNT: u32 = 4;
const MEM: u32 = 16000;

fn app(engine: &EngineHandle, edge: &Arc<FakeEdge>) -> Arc<App<FakeEdge>> {
    Arc::new(App {
        engine: engine.clone(),
        edge: edge.clone(),
        auth: Arc::new(Auth::default()),
        decision: DecisionConfig::default(),
        webhook: Default::default(),
        facts: Default::default(),
        metrics: Metrics::default(),
        ready: Arc::new(AtomicBool::new(true)),
    })
}

async fn call(app: &Arc<App<FakeEdge>>, path: &str, body: String) -> serde_json::Value {
    let resp = router(app.clone())
        .oneshot(Request::post(path).body(Body::from(body)).unwrap())
        .await
        .unwrap();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null)
}

/// Schedules one pod like kube-scheduler would: filter, then bind, retrying on errors.
async fn schedule(
    apps: Vec<Arc<App<FakeEdge>>>,
    edge: Arc<FakeEdge>,
    ns: String,
    name: String,
) -> bool {
    let pod = edge.get_pod_now(&ns, &name);
    for attempt in 0..40usize {
        let app = &apps[attempt % apps.len()];
        let f = call(
            app,
            "/filter",
            json!({"Pod": pod, "NodeNames": ["scarce"]}).to_string(),
        )
        .await;
        let Some(node) = f["NodeNames"][0].as_str().map(str::to_owned) else {
            tokio::task::yield_now().await;
            continue;
        };
        let uid = format!("uid-{ns}-{name}");
        let b = call(
            app,
            "/bind",
            json!({"PodName": name, "PodNamespace": ns, "PodUID": uid, "Node": node}).to_string(),
        )
        .await;
        if b["Error"] == "" {
            // The device plugin answers a little later.
            let edge = edge.clone();
            let (ns, name) = (ns.clone(), name.clone());
            tokio::spawn(async move {
                tokio::time::sleep(std::time::Duration::from_millis(2)).await;
                edge.set_bind_phase(&ns, &name, "success").await;
            });
            return true;
        }
        tokio::task::yield_now().await;
    }
    false
}

trait Now {
    fn get_pod_now(&self, ns: &str, name: &str) -> k8s_openapi::api::core::v1::Pod;
}

impl Now for FakeEdge {
    fn get_pod_now(&self, ns: &str, name: &str) -> k8s_openapi::api::core::v1::Pod {
        self.pods()
            .into_iter()
            .find(|p| {
                p.metadata.namespace.as_deref() == Some(ns)
                    && p.metadata.name.as_deref() == Some(name)
            })
            .unwrap()
    }
}

/// Booking per GPU as the API server records it: bound pods' allocation annotations.
fn api_bookings(edge: &FakeEdge) -> HashMap<String, (u32, u32, u32)> {
    let mut per_gpu: HashMap<String, (u32, u32, u32)> = HashMap::new();
    for p in edge.pods() {
        let bound = p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some();
        let a = p.metadata.annotations.clone().unwrap_or_default();
        if !bound {
            continue;
        }
        let devices =
            hami_contract::PodDevices::decode(&a["hami.io/vgpu-devices-allocated"]).unwrap();
        for d in devices.0.iter().flatten() {
            let e = per_gpu.entry(d.uuid.clone()).or_default();
            e.0 += 1;
            e.1 += d.usedmem;
            e.2 += d.usedcores;
        }
    }
    per_gpu
}

fn assert_within_capacity(edge: &FakeEdge) -> u32 {
    let per_gpu = api_bookings(edge);
    let mut total = 0;
    for (uuid, (slots, mem, cores)) in &per_gpu {
        assert!(*slots <= COUNT, "{uuid}: {slots} containers > {COUNT}");
        assert!(*mem <= MEM, "{uuid}: {mem} MiB > {MEM}");
        assert!(*cores <= 100, "{uuid}: {cores} cores > 100");
        total += slots;
    }
    total
}

async fn setup_pods(edge: &FakeEdge, n: usize) -> Vec<(String, String)> {
    (0..n)
        .map(|i| {
            // Two shapes: the gate must keep them apart while one is pending.
            let mem = if i % 3 == 0 { 1500 } else { 1000 };
            let name = format!("p{i}");
            edge.add_pod(gpu_pod("default", &name, 1, mem, 10));
            ("default".to_owned(), name)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hundreds_of_concurrent_filter_and_bind_never_overbook() {
    let engine = EngineHandle::spawn(Engine::standalone(DecisionConfig::default()));
    let edge = Arc::new(FakeEdge::new());
    edge.watch(engine.clone());
    engine
        .send(Command::Observe(Observation::NodeUpsert(Box::new(
            gpu_node("scarce", GPUS, MEM, COUNT),
        ))))
        .await;
    let pods = setup_pods(&edge, 300).await;
    let a = app(&engine, &edge);
    let tasks: Vec<_> = pods
        .into_iter()
        .map(|(ns, name)| tokio::spawn(schedule(vec![a.clone()], edge.clone(), ns, name)))
        .collect();
    let mut bound = 0;
    for t in tasks {
        bound += u32::from(t.await.unwrap());
    }
    let total = assert_within_capacity(&edge);
    assert_eq!(total, bound);
    assert_eq!(bound, GPUS * COUNT, "every slot is used, none twice");
    for g in engine.bookings().await {
        assert!(
            g.used <= g.count && g.usedmem <= g.totalmem && g.usedcores <= g.totalcore,
            "{g:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_leadership_change_mid_stream_never_overbooks() {
    let first = EngineHandle::spawn(Engine::new(DecisionConfig::default()));
    let second = EngineHandle::spawn(Engine::new(DecisionConfig::default()));
    let edge = Arc::new(FakeEdge::new());
    edge.watch(first.clone());
    edge.watch(second.clone());
    let node = gpu_node("scarce", GPUS, MEM, COUNT);
    first.send(Command::Leadership(Some(1))).await;
    first
        .send(Command::Rebuild {
            term: 1,
            nodes: vec![node.clone()],
            pods: vec![],
            quotas: vec![],
        })
        .await;
    let pods = setup_pods(&edge, 200).await;
    let apps = vec![app(&first, &edge), app(&second, &edge)];
    let tasks: Vec<_> = pods
        .into_iter()
        .map(|(ns, name)| tokio::spawn(schedule(apps.clone(), edge.clone(), ns, name)))
        .collect();
    // Hand over while requests are in flight: the old leader stops, the new one rebuilds from
    // the API server's current objects before it decides.
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    first.send(Command::Leadership(None)).await;
    second.send(Command::Leadership(Some(2))).await;
    second
        .send(Command::Rebuild {
            term: 2,
            nodes: vec![node],
            pods: edge.pods(),
            quotas: vec![],
        })
        .await;
    for t in tasks {
        t.await.unwrap();
    }
    assert_within_capacity(&edge);
}

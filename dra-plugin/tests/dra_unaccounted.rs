//! The unaccounted-process watch on a DRA node: the device plugin's pass
//! (`tessera_node::process_watch`) fed by the DRA driver itself, with claims prepared through
//! the driver, their ResourceClaims (and `status.reservedFor`) read from a fake API server, the
//! shim's regions in the claims' directories, a fake `/proc` and scripted NVML process lists.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::json;
use tessera_dra_plugin::checkpoint::{ClaimRef, PreparedClaims};
use tessera_dra_plugin::plugin::{ClaimSource, DraDriver};
use tessera_node::edges::EdgeError;
use tessera_node::gpu::GpuInfo;
use tessera_node::gpu_processes::ProcReader;
use tessera_node::node_events::{EventObject, NodeEvent, NodeEvents};
use tessera_node::process_watch::{ProcessWatch, REASON_EVICTING, UnaccountedPolicy, WatchError};
use tessera_node::testing::{
    MemoryApi, RecordingEvictor, ScriptedProcesses, bound_pod, pod_cgroup, proc_entry,
    region_with_process, response_settings, t4,
};

const NODE: &str = "node-a";
/// Pod using claim `shared` (uid-1, a share of gpu-0); its process is in the claim's region.
const SHARER: &str = "0f1e2d3c-aaaa-bbbb-cccc-00000000000a";
/// Pod using claim `static` (uid-2, a share of gpu-0); its process has no shim.
const STATIC: &str = "0f1e2d3c-aaaa-bbbb-cccc-00000000000b";
/// Pod using no claim.
const STRANGER: &str = "0f1e2d3c-aaaa-bbbb-cccc-00000000000c";
/// Pod using claim `monitor` (uid-3, gpu-0 with admin access: no shim, by design).
const MONITOR: &str = "0f1e2d3c-aaaa-bbbb-cccc-00000000000d";

/// ResourceClaims by `namespace/name`; `fail` makes every read fail (an API server away).
#[derive(Default, Clone)]
struct Claims {
    claims: Arc<Mutex<BTreeMap<String, ResourceClaim>>>,
    fail: Arc<std::sync::atomic::AtomicBool>,
}

impl ClaimSource for Claims {
    fn claim(
        &self,
        namespace: &str,
        name: &str,
    ) -> BoxFuture<'_, Result<Option<ResourceClaim>, EdgeError>> {
        let found = self
            .claims
            .lock()
            .unwrap()
            .get(&format!("{namespace}/{name}"))
            .cloned();
        let fail = self.fail.load(std::sync::atomic::Ordering::Relaxed);
        let what = format!("cannot read ResourceClaim {namespace}/{name}");
        Box::pin(async move {
            if fail {
                return Err(EdgeError::Kube {
                    what,
                    source: kube::Error::ReadEvents(std::io::Error::other(
                        "the API server is away",
                    )),
                });
            }
            Ok(found)
        })
    }
}

impl Claims {
    /// Claim `name` (UID `uid`) allocated `device` (a share of it, or with admin access the
    /// whole of it), reserved for pod `pod`.
    fn add(&self, name: &str, uid: &str, device: &str, admin: bool, pod: &str) {
        self.add_share(name, uid, device, (!admin).then_some("1Gi"), &[pod]);
    }

    /// Claim `name` (UID `uid`) allocated `memory` of `device` (`None`: the whole of it with
    /// admin access), reserved for `pods`.
    fn add_share(&self, name: &str, uid: &str, device: &str, memory: Option<&str>, pods: &[&str]) {
        let mut result = json!({
            "request": "gpu", "driver": "gpu.tessera.dev", "pool": NODE, "device": device,
        });
        match memory {
            None => result["adminAccess"] = json!(true),
            Some(m) => result["consumedCapacity"] = json!({"memory": m, "cores": "10"}),
        }
        let reserved: Vec<_> = pods
            .iter()
            .map(|uid| json!({"resource": "pods", "name": format!("pod-{uid}"), "uid": uid}))
            .collect();
        let claim: ResourceClaim = serde_json::from_value(json!({
            "metadata": {"namespace": "ml", "name": name, "uid": uid},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.tessera.dev"}}]}},
            "status": {
                "allocation": {"devices": {"results": [result]}},
                "reservedFor": reserved,
            },
        }))
        .unwrap();
        self.claims
            .lock()
            .unwrap()
            .insert(format!("ml/{name}"), claim);
    }
}

fn gpus() -> Vec<GpuInfo> {
    (0..2).map(|i| t4(&format!("GPU-{i}"), i)).collect()
}

fn drain(rx: &mut tokio::sync::mpsc::Receiver<NodeEvent>) -> Vec<NodeEvent> {
    let mut out = Vec::new();
    while let Ok(e) = rx.try_recv() {
        out.push(e);
    }
    out
}

struct Node {
    watch: ProcessWatch<tessera_dra_plugin::metrics::DraMetrics>,
    driver: Arc<DraDriver>,
    claims: Claims,
    evictor: Arc<RecordingEvictor>,
    events: tokio::sync::mpsc::Receiver<NodeEvent>,
    _dirs: (tempfile::TempDir, tempfile::TempDir),
}

/// The DRA plugin's watch over `driver`'s claims, as the daemon builds it, with scripted NVML
/// process lists, a fake `/proc` at `proc` and the pods `api` lists.
fn watch_of(
    driver: &Arc<DraDriver>,
    processes: Arc<ScriptedProcesses>,
    proc: &std::path::Path,
    api: MemoryApi,
    policy: UnaccountedPolicy,
    evictor: Arc<RecordingEvictor>,
    events: NodeEvents,
) -> ProcessWatch<tessera_dra_plugin::metrics::DraMetrics> {
    ProcessWatch {
        bookings: driver.clone(),
        gpus: processes,
        proc: Arc::new(ProcReader::new(proc)),
        pods: Arc::new(api),
        allowed_host_cgroups: Vec::new(),
        policy,
        evictor,
        events,
        metrics: driver.metrics().clone(),
        confirmer: Arc::default(),
        said_blind: Arc::default(),
    }
}

/// A DRA node with GPU-0 and GPU-1 and four claims prepared on gpu-0 (GPU-0) through the
/// driver. On GPU-0 NVML lists: 100 (the sharer's, PID 7 in its container, which the region
/// of claim `shared` lists), 200 (the static binary's, PID 7 too: no region of claim
/// `static`; `shared`'s region does not vouch for another claim's pod), 300 (the stranger's:
/// no claim; its HAMi booking annotations name GPU-0, which books nothing on a DRA node), 400
/// (the monitor's, admin access: no shim by design). On GPU-1: 101 (the sharer's again, on a
/// GPU its claim does not hold, although its region is made to name GPU-1 too).
async fn dra_node(policy: UnaccountedPolicy) -> Node {
    let root = tempfile::tempdir().unwrap();
    let proc = tempfile::tempdir().unwrap();
    let claims = Claims::default();
    claims.add("shared", "uid-1", "gpu-0", false, SHARER);
    claims.add("static", "uid-2", "gpu-0", false, STATIC);
    claims.add("monitor", "uid-3", "gpu-0", true, MONITOR);
    let prepared = PreparedClaims::load(
        root.path().join("cdi"),
        response_settings(&root.path().join("hook")),
    );
    let driver = Arc::new(DraDriver::new(
        NODE.into(),
        gpus(),
        Arc::new(claims.clone()),
        prepared,
    ));
    for (name, uid) in [
        ("shared", "uid-1"),
        ("static", "uid-2"),
        ("monitor", "uid-3"),
    ] {
        let claim = ClaimRef {
            namespace: "ml".into(),
            name: name.into(),
            uid: uid.into(),
        };
        driver.prepare(&claim).await.unwrap();
    }
    let claim_dir = root.path().join("hook/vgpu/claims/uid-1");
    std::fs::write(
        claim_dir.join("shim.cache"),
        region_with_process("GPU-0", 7),
    )
    .unwrap();
    std::fs::write(
        claim_dir.join("other.cache"),
        region_with_process("GPU-1", 7),
    )
    .unwrap();

    proc_entry(proc.path(), 100, &pod_cgroup(SHARER), 7);
    proc_entry(proc.path(), 101, &pod_cgroup(SHARER), 7);
    proc_entry(proc.path(), 200, &pod_cgroup(STATIC), 7);
    proc_entry(proc.path(), 300, &pod_cgroup(STRANGER), 7);
    proc_entry(proc.path(), 400, &pod_cgroup(MONITOR), 7);
    let api = MemoryApi::default();
    for (name, uid) in [("sharer", SHARER), ("static", STATIC), ("monitor", MONITOR)] {
        let mut pod = bound_pod(NODE, name, &[], 1);
        pod.namespace = "ml".into();
        pod.annotations.clear();
        pod.uid = uid.into();
        api.add_pod(pod);
    }
    let mut stranger = bound_pod(NODE, "stranger", &[&[("GPU-0", 1000, 30)]], 1);
    stranger.namespace = "ml".into();
    stranger.uid = STRANGER.into();
    api.add_pod(stranger);
    let processes = Arc::new(ScriptedProcesses::default());
    processes.0.lock().unwrap().extend([
        ("GPU-0".into(), vec![100, 200, 300, 400]),
        ("GPU-1".into(), vec![101]),
    ]);
    let evictor = Arc::new(RecordingEvictor::default());
    let (events, rx) = NodeEvents::channel();
    let watch = watch_of(
        &driver,
        processes,
        proc.path(),
        api,
        policy,
        evictor.clone(),
        events,
    );
    Node {
        watch,
        driver,
        claims,
        evictor,
        events: rx,
        _dirs: (root, proc),
    }
}

/// The reasons of the (non-eviction) Events on pod `uid`.
fn reasons_on(events: &[NodeEvent], uid: &str) -> Vec<&'static str> {
    events
        .iter()
        .filter(|e| e.reason != REASON_EVICTING)
        .filter(|e| matches!(&e.regarding, EventObject::Pod { uid: u, .. } if u == uid))
        .map(|e| e.reason)
        .collect()
}

#[tokio::test]
async fn a_dra_node_sees_every_process_on_its_gpus_against_its_claims() {
    let mut node = dra_node(UnaccountedPolicy::Report).await;
    let first = node.watch.pass().await.unwrap();
    assert_eq!(first.confirmed, 0, "one sighting is not enough");
    assert!(drain(&mut node.events).is_empty());

    let second = node.watch.pass().await.unwrap();
    // 101 (the sharer on GPU-1), 200 (no region of its claim), 300 (no claim).
    assert_eq!(second.confirmed, 3);
    assert_eq!(
        second.reported,
        [SHARER.to_owned(), STATIC.to_owned(), STRANGER.to_owned()].into()
    );
    assert!(second.evicted.is_empty());
    assert!(
        node.evictor.0.lock().unwrap().is_empty(),
        "report never evicts"
    );
    let events = drain(&mut node.events);
    assert_eq!(reasons_on(&events, STRANGER), ["GpuNotBooked"]);
    assert_eq!(reasons_on(&events, STATIC), ["GpuProcessWithoutShim"]);
    // The sharer's process on GPU-0 is accounted by its claim's region; on GPU-1, which its
    // claim does not hold, it is not (whatever the region, which its container writes, names).
    assert_eq!(reasons_on(&events, SHARER), ["GpuNotBooked"]);
    let sharer = events
        .iter()
        .find(|e| matches!(&e.regarding, EventObject::Pod { uid, .. } if uid == SHARER))
        .unwrap();
    assert!(sharer.message.contains("101"), "{}", sharer.message);
    assert!(
        !sharer.message.contains("process 100"),
        "{}",
        sharer.message
    );
    assert!(
        reasons_on(&events, MONITOR).is_empty(),
        "an admin-access claim runs without the shim by design: {events:?}"
    );

    let text = node.driver.metrics().encode();
    for line in [
        r#"tessera_dra_plugin_unaccounted_gpu_processes{reason="GpuNotBooked"} 2"#,
        r#"tessera_dra_plugin_unaccounted_gpu_processes{reason="GpuProcessWithoutShim"} 1"#,
        r#"tessera_dra_plugin_unaccounted_gpu_processes{reason="GpuProcessOutsidePods"} 0"#,
        "tessera_dra_plugin_undetermined_gpu_processes 0",
        r#"tessera_dra_plugin_unaccounted_actions_total{action="reported"} 3"#,
    ] {
        assert!(text.contains(line), "{line} missing from:\n{text}");
    }
}

#[tokio::test]
async fn under_evict_a_dra_node_evicts_the_pods_and_a_claim_it_cannot_read_stops_the_pass() {
    let mut node = dra_node(UnaccountedPolicy::Evict).await;
    node.watch.pass().await.unwrap();
    let second = node.watch.pass().await.unwrap();
    assert_eq!(
        second.evicted,
        [SHARER.to_owned(), STATIC.to_owned(), STRANGER.to_owned()].into()
    );
    let mut evicted = node.evictor.0.lock().unwrap().clone();
    evicted.sort();
    assert_eq!(
        evicted,
        [
            format!("ml/sharer/{SHARER}"),
            format!("ml/static/{STATIC}"),
            format!("ml/stranger/{STRANGER}")
        ]
    );
    let events = drain(&mut node.events);
    assert_eq!(
        events
            .iter()
            .filter(|e| e.reason == REASON_EVICTING)
            .count(),
        3
    );

    // Without the claims' pods every claim's processes would look unbooked: nothing is judged.
    node.claims
        .fail
        .store(true, std::sync::atomic::Ordering::Relaxed);
    let failed = node.watch.pass().await;
    assert!(matches!(failed, Err(WatchError::Bookings(_))), "{failed:?}");
    assert!(drain(&mut node.events).is_empty());
    assert_eq!(node.evictor.0.lock().unwrap().len(), 3);
}

/// The memory check on a DRA node (issue 28): NVML's count of a pod's processes on a GPU against
/// the memory of the claims it holds there, plus the allowance per process. Each process here
/// uses 1 GiB, the allowance is 256 MiB. `small` (512 MiB of GPU-1) is exceeded by its pod; the
/// two pods of `pair` (1 GiB of GPU-1, reserved for both) are each held to the claim's whole
/// share and stay within it; a pod holding `small` and `extra` (another 512 MiB of GPU-1) is
/// judged against their sum and stays within it too. Every process is in its claim's region,
/// so nothing else is reported.
#[tokio::test]
async fn a_dra_pod_beyond_the_memory_of_its_claims_is_reported() {
    const SMALL: &str = "0f1e2d3c-aaaa-bbbb-cccc-0000000000a1";
    const PAIR_A: &str = "0f1e2d3c-aaaa-bbbb-cccc-0000000000a2";
    const PAIR_B: &str = "0f1e2d3c-aaaa-bbbb-cccc-0000000000a3";
    const TWO_CLAIMS: &str = "0f1e2d3c-aaaa-bbbb-cccc-0000000000a4";
    let root = tempfile::tempdir().unwrap();
    let proc = tempfile::tempdir().unwrap();
    let claims = Claims::default();
    claims.add_share("small", "uid-4", "gpu-1", Some("512Mi"), &[SMALL]);
    claims.add_share("pair", "uid-5", "gpu-1", Some("1Gi"), &[PAIR_A, PAIR_B]);
    claims.add_share("half", "uid-6", "gpu-1", Some("512Mi"), &[TWO_CLAIMS]);
    claims.add_share("extra", "uid-7", "gpu-1", Some("512Mi"), &[TWO_CLAIMS]);
    let prepared = PreparedClaims::load(
        root.path().join("cdi"),
        response_settings(&root.path().join("hook")),
    );
    let driver = Arc::new(
        DraDriver::new(NODE.into(), gpus(), Arc::new(claims.clone()), prepared)
            .with_memory_allowance_mib(256),
    );
    for (name, uid) in [
        ("small", "uid-4"),
        ("pair", "uid-5"),
        ("half", "uid-6"),
        ("extra", "uid-7"),
    ] {
        let claim = ClaimRef {
            namespace: "ml".into(),
            name: name.into(),
            uid: uid.into(),
        };
        driver.prepare(&claim).await.unwrap();
        std::fs::write(
            root.path()
                .join(format!("hook/vgpu/claims/{uid}/shim.cache")),
            region_with_process("GPU-1", 7),
        )
        .unwrap();
    }
    let api = MemoryApi::default();
    for (pid, uid) in [
        (500, SMALL),
        (501, PAIR_A),
        (502, PAIR_B),
        (503, TWO_CLAIMS),
    ] {
        proc_entry(proc.path(), pid, &pod_cgroup(uid), 7);
        let mut pod = bound_pod(NODE, &format!("pod-{uid}"), &[], 1);
        pod.namespace = "ml".into();
        pod.annotations.clear();
        pod.uid = uid.into();
        api.add_pod(pod);
    }
    let processes = Arc::new(ScriptedProcesses::default());
    processes
        .0
        .lock()
        .unwrap()
        .insert("GPU-1".into(), vec![500, 501, 502, 503]);
    let (events, mut rx) = NodeEvents::channel();
    let watch = watch_of(
        &driver,
        processes,
        proc.path(),
        api,
        UnaccountedPolicy::Report,
        Arc::new(RecordingEvictor::default()),
        events,
    );
    watch.pass().await.unwrap();
    let second = watch.pass().await.unwrap();
    assert_eq!(second.reported, [SMALL.to_owned()].into(), "{second:?}");
    let events = drain(&mut rx);
    assert_eq!(reasons_on(&events, SMALL), ["GpuMemoryOverBooking"]);
    for uid in [PAIR_A, PAIR_B, TWO_CLAIMS] {
        assert!(reasons_on(&events, uid).is_empty(), "{uid}: {events:?}");
    }
}

//! Test doubles shared by this crate's tests and benchmarks (feature `testing`, never in the
//! shipped binary): an in-memory apiserver for the allocator ([`MemoryApi`]), pod and GPU
//! builders, and a `tower-test` mock of the apiserver's HTTP for the kube edge ([`apiserver`]).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test doubles (feature `testing`): a failed unwrap is a failed test"
)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use futures::future::BoxFuture;
use hami_contract::annotations as keys;

use crate::container_env::ResponseSettings;
use crate::edges::{EdgeError, PodPatcher, PodSource};
use crate::gpu::GpuInfo;
use crate::identity::{ContainerSpec, PodSnapshot};

/// The node the builders book pods on.
pub const NODE: &str = "node-a";
/// The plugin's resource.
pub const RESOURCE: &str = "nvidia.com/gpu";

/// A pod patch the fake apiserver accepted: `namespace/name` and the annotations written.
pub type Patch = (String, BTreeMap<String, String>);

/// The node's pods in memory, standing in for both the informer cache and the apiserver:
/// `cached` and `fresh` both answer the current list, and accepted patches apply to it (with the
/// apiserver's UID precondition).
#[derive(Debug, Clone, Default)]
pub struct MemoryApi {
    pub pods: Arc<Mutex<Vec<PodSnapshot>>>,
    /// Every accepted pod patch, in order.
    pub patches: Arc<Mutex<Vec<Patch>>>,
    /// `namespace/name` of every `release_hami_lock` call, in order.
    pub lock_releases: Arc<Mutex<Vec<String>>>,
    /// What `hami_lock` answers (`namespace/name` of a live lock).
    pub hami_lock: Arc<Mutex<Option<String>>>,
    /// What `kubelet_version` answers (none: the allocator decides on a LIST).
    pub kubelet_version: Arc<Mutex<Option<String>>>,
    /// A lagging informer cache: `cached` answers this instead of the current pods.
    pub stale_cache: Arc<Mutex<Option<Vec<PodSnapshot>>>>,
    /// `namespace/name` of every read by name, in order.
    pub reads: Arc<Mutex<Vec<String>>>,
    /// How many LISTs (`fresh`) were answered.
    pub lists: Arc<Mutex<usize>>,
}

fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A test that panicked while holding the lock has failed already; keep the data readable.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl MemoryApi {
    pub fn add_pod(&self, pod: PodSnapshot) {
        locked(&self.pods).push(pod);
    }

    /// The pods as they are now (patches applied).
    pub fn pods(&self) -> Vec<PodSnapshot> {
        locked(&self.pods).clone()
    }

    /// `namespace/name` of every accepted patch, in order.
    pub fn patched(&self) -> Vec<String> {
        locked(&self.patches)
            .iter()
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// The accepted patches, in order.
    pub fn patches(&self) -> Vec<Patch> {
        locked(&self.patches).clone()
    }

    /// Drops pod `namespace/name`.
    pub fn remove_pod(&self, key: &str) {
        locked(&self.pods).retain(|p| p.key() != key);
    }
}

/// The apiserver's answer to a patch whose UID precondition does not hold (409 Conflict).
fn uid_conflict(uid: &str, actual: &str, key: &str) -> EdgeError {
    patch_refused(
        key,
        409,
        "Conflict",
        &format!("Precondition failed: UID in precondition: {uid}, UID in object meta: {actual}"),
    )
}

/// The apiserver's refusal of a patch of pod `key` with HTTP `code`.
pub fn patch_refused(key: &str, code: u16, reason: &str, message: &str) -> EdgeError {
    let status = kube::core::Status::failure(message, reason).with_code(code);
    EdgeError::Kube {
        what: format!("cannot patch pod {key}"),
        source: kube::Error::Api(status.boxed()),
    }
}

impl PodSource for MemoryApi {
    fn cached(&self) -> Vec<PodSnapshot> {
        locked(&self.stale_cache)
            .clone()
            .unwrap_or_else(|| self.pods())
    }
    fn fresh(&self) -> BoxFuture<'_, Result<Vec<PodSnapshot>, EdgeError>> {
        *locked(&self.lists) += 1;
        let pods = self.pods();
        Box::pin(async move { Ok(pods) })
    }
    fn get<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<PodSnapshot>, EdgeError>> {
        let key = format!("{namespace}/{name}");
        let pod = self.pods().into_iter().find(|p| p.key() == key);
        locked(&self.reads).push(key);
        Box::pin(async move { Ok(pod) })
    }
    fn kubelet_version(&self) -> Option<String> {
        locked(&self.kubelet_version).clone()
    }
    fn hami_lock(&self) -> Option<String> {
        locked(&self.hami_lock).clone()
    }
}

impl PodPatcher for MemoryApi {
    fn patch_pod_annotations(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
        annotations: BTreeMap<String, String>,
    ) -> BoxFuture<'_, Result<(), EdgeError>> {
        let key = format!("{namespace}/{name}");
        let result = {
            let mut pods = locked(&self.pods);
            match pods.iter_mut().find(|p| p.key() == key) {
                Some(p) if p.uid != uid => Err(uid_conflict(uid, &p.uid, &key)),
                Some(p) => {
                    p.annotations.extend(annotations.clone());
                    Ok(())
                }
                // A merge patch of a missing pod is a 404 in a real apiserver; the allocator
                // tests never need it, so it is accepted and only logged.
                None => Ok(()),
            }
        };
        if result.is_ok() {
            locked(&self.patches).push((key, annotations));
        }
        Box::pin(async move { result })
    }

    fn release_hami_lock(
        &self,
        namespace: &str,
        name: &str,
    ) -> BoxFuture<'_, Result<(), EdgeError>> {
        locked(&self.lock_releases).push(format!("{namespace}/{name}"));
        Box::pin(async { Ok(()) })
    }
}

/// A pod the GPU scheduler (`hami-scheduler`) booked on and bound to `node`, in namespace
/// `default` with UID `uid-<name>`: one container `c<i>` per entry of `entries`, each entry the
/// container's devices as `(GPU UUID, MiB, cores)`; bind-phase `allocating` at `bind_time`.
pub fn bound_pod(
    node: &str,
    name: &str,
    entries: &[&[(&str, u32, u32)]],
    bind_time: u64,
) -> PodSnapshot {
    let value: String = entries
        .iter()
        .map(|c| {
            let devs: String = c
                .iter()
                .map(|(u, m, k)| format!("{u},NVIDIA,{m},{k}:"))
                .collect();
            format!("{devs};")
        })
        .collect();
    let annotations = BTreeMap::from([
        (keys::VGPU_NODE.to_owned(), node.to_owned()),
        (keys::DEVICES_TO_ALLOCATE.to_owned(), value.clone()),
        (keys::DEVICES_ALLOCATED.to_owned(), value),
        (
            keys::BIND_PHASE.to_owned(),
            keys::BIND_PHASE_ALLOCATING.to_owned(),
        ),
        (keys::BIND_TIME.to_owned(), bind_time.to_string()),
    ]);
    PodSnapshot {
        namespace: "default".into(),
        name: name.into(),
        uid: format!("uid-{name}"),
        node_name: Some(node.into()),
        scheduler_name: Some(crate::allocator::DEFAULT_SCHEDULER_NAME.into()),
        annotations,
        terminal: false,
        deleting: false,
        init_containers: Vec::new(),
        containers: (0..entries.len())
            .map(|i| ContainerSpec {
                name: format!("c{i}"),
                requests_resource: true,
                restartable_init: false,
                disable_control: false,
            })
            .collect(),
        started_containers: Default::default(),
        container_ids: Default::default(),
        resource_version: String::new(),
    }
}

/// A running pod on `node` with one container, `c0`, that requests no GPU (a DaemonSet's, a
/// plain workload's), as the informer has it.
pub fn gpu_less_pod(node: &str, namespace: &str, name: &str, uid: &str) -> PodSnapshot {
    PodSnapshot {
        namespace: namespace.into(),
        name: name.into(),
        uid: uid.into(),
        node_name: Some(node.into()),
        scheduler_name: None,
        annotations: BTreeMap::new(),
        terminal: false,
        deleting: false,
        init_containers: Vec::new(),
        containers: vec![ContainerSpec {
            name: "c0".into(),
            requests_resource: false,
            restartable_init: false,
            disable_control: false,
        }],
        started_containers: BTreeSet::from(["c0".to_owned()]),
        container_ids: BTreeMap::new(),
        resource_version: String::new(),
    }
}

/// A Tesla T4 (15360 MiB) as NVML reports it, with no NUMA node and no PCI bus ID.
pub fn t4(uuid: &str, index: u32) -> GpuInfo {
    GpuInfo {
        uuid: uuid.into(),
        index,
        name: "Tesla T4".into(),
        memory_total_mib: Some(15360),
        pci_bus_id: String::new(),
        numa_node: None,
        mig_enabled: false,
        mig: None,
    }
}

/// Response settings with `hook` as HAMi's HOOK_PATH (the shim at `<hook>/vgpu/libvgpu.so`).
pub fn response_settings(hook: &Path) -> ResponseSettings {
    ResponseSettings {
        hook_path: hook.display().to_string(),
        memory_scaling: 1.0,
        lib_cuda_log_level: "1".into(),
        disable_core_limit: false,
        core_policy: hami_contract::config::GpuCorePolicy::Default,
        shim_host_path: format!("{}/vgpu/libvgpu.so", hook.display()),
        license_present: false,
        cdi_devices: false,
        device_list: Default::default(),
        simulated_driver: None,
    }
}

/// The apiserver's HTTP, mocked with `tower-test`: a [`kube::Client`] whose every request the
/// test receives, checks and answers.
pub mod apiserver {
    use std::time::Duration;

    use http::{Method, Request, Response, StatusCode};
    use kube::client::Body;
    use serde_json::{Value, json};
    use tower_test::mock::{self, Handle, SendResponse};

    /// The test's end of the mock.
    pub struct MockApiserver(Handle<Request<Body>, Response<Body>>);

    impl std::fmt::Debug for MockApiserver {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("MockApiserver").finish_non_exhaustive()
        }
    }

    /// A client talking to a fresh mock.
    pub fn mock_client() -> (kube::Client, MockApiserver) {
        let (svc, handle) = mock::pair::<Request<Body>, Response<Body>>();
        (kube::Client::new(svc, "default"), MockApiserver(handle))
    }

    impl MockApiserver {
        /// The next request, which must be `method path` (60 s at most: paused-clock tests
        /// advance through it at once).
        pub async fn expect(
            &mut self,
            method: Method,
            path: &str,
        ) -> (Request<Body>, SendResponse<Response<Body>>) {
            let (req, send) = tokio::time::timeout(Duration::from_secs(60), self.0.next_request())
                .await
                .expect("a request in time")
                .expect("a request");
            assert_eq!((req.method(), req.uri().path()), (&method, path));
            (req, send)
        }

        /// The next request, which must be a JSON merge patch of `path`; its body as JSON.
        pub async fn expect_patch(&mut self, path: &str) -> (Value, SendResponse<Response<Body>>) {
            let (req, send) = self.expect(Method::PATCH, path).await;
            assert_eq!(
                req.headers()["content-type"],
                "application/merge-patch+json"
            );
            let body = req.into_body().collect_bytes().await.expect("body");
            (serde_json::from_slice(&body).expect("json body"), send)
        }
    }

    /// 200 with `object` as the body.
    pub fn ok(object: Value) -> Response<Body> {
        Response::builder()
            .body(Body::from(serde_json::to_vec(&object).expect("json")))
            .expect("response")
    }

    /// 503 with a Kubernetes `Status` body (an apiserver outage).
    pub fn unavailable() -> Response<Body> {
        let status = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                            "message": "unavailable", "code": 503});
        Response::builder()
            .status(StatusCode::SERVICE_UNAVAILABLE)
            .body(Body::from(serde_json::to_vec(&status).expect("json")))
            .expect("response")
    }

    /// A pod object `namespace/name`.
    pub fn pod(namespace: &str, name: &str) -> Value {
        json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace}})
    }

    /// Node `name` at `resource_version` with `annotations`.
    pub fn node(name: &str, resource_version: &str, annotations: Value) -> Value {
        json!({"apiVersion": "v1", "kind": "Node",
               "metadata": {"name": name, "resourceVersion": resource_version, "annotations": annotations}})
    }
}

/// An in-memory MIG GPU set for unit tests: carving checks only the placement list and overlaps
/// (the fake NVML library models NVIDIA's tables; this double only has to be predictable).
#[derive(Debug, Default)]
pub struct MemoryMig {
    /// Per GPU index: the profiles offered.
    pub profiles: std::sync::Mutex<BTreeMap<u32, Vec<nvml_mig::GiProfile>>>,
    /// Per GPU index: the live instances.
    pub instances: std::sync::Mutex<BTreeMap<u32, Vec<nvml_mig::MigInstance>>>,
    /// Creations so far (also makes every MIG UUID distinct).
    pub created: std::sync::atomic::AtomicU32,
    /// GPU indexes whose `destroy` fails (a busy instance).
    pub busy: std::sync::Mutex<BTreeSet<u32>>,
}

/// Two A100-40GB profiles: `1g.5gb` (7 × 1 slice) and `3g.20gb` (at slices 0 and 4).
pub fn a100_profiles() -> Vec<nvml_mig::GiProfile> {
    use nvml_mig::{GiProfile, Placement};
    vec![
        GiProfile {
            id: 0,
            name: "1g.5gb".into(),
            slice_count: 1,
            instance_count: 7,
            memory_mib: 4864,
            multiprocessor_count: 14,
            placements: (0..7).map(|start| Placement { start, size: 1 }).collect(),
        },
        GiProfile {
            id: 2,
            name: "3g.20gb".into(),
            slice_count: 3,
            instance_count: 2,
            memory_mib: 19968,
            multiprocessor_count: 42,
            placements: vec![
                Placement { start: 0, size: 4 },
                Placement { start: 4, size: 4 },
            ],
        },
        GiProfile {
            id: 4,
            name: "7g.40gb".into(),
            slice_count: 7,
            instance_count: 1,
            memory_mib: 40192,
            multiprocessor_count: 98,
            placements: vec![Placement { start: 0, size: 8 }],
        },
    ]
}

impl MemoryMig {
    /// GPUs `0..gpus`, each with [`a100_profiles`].
    pub fn a100s(gpus: u32) -> Self {
        let m = MemoryMig::default();
        if let Ok(mut p) = m.profiles.lock() {
            for i in 0..gpus {
                p.insert(i, a100_profiles());
            }
        }
        m
    }
}

impl nvml_mig::MigControl for MemoryMig {
    fn mig_mode(&self, _: u32) -> Result<nvml_mig::MigModeState, nvml_mig::MigError> {
        Ok(nvml_mig::MigModeState {
            current: true,
            pending: true,
        })
    }
    fn profiles(&self, gpu: u32) -> Result<Vec<nvml_mig::GiProfile>, nvml_mig::MigError> {
        Ok(self
            .profiles
            .lock()
            .ok()
            .and_then(|p| p.get(&gpu).cloned())
            .unwrap_or_default())
    }
    fn instances(&self, gpu: u32) -> Result<Vec<nvml_mig::MigInstance>, nvml_mig::MigError> {
        Ok(self
            .instances
            .lock()
            .ok()
            .and_then(|i| i.get(&gpu).cloned())
            .unwrap_or_default())
    }
    fn create(
        &self,
        gpu: u32,
        profile: &str,
        placement: nvml_mig::Placement,
    ) -> Result<nvml_mig::MigInstance, nvml_mig::MigError> {
        let unavailable = || nvml_mig::MigError::PlacementUnavailable {
            gpu_index: gpu,
            profile: profile.to_owned(),
            start: placement.start,
            size: placement.size,
        };
        let p = self
            .profiles(gpu)?
            .into_iter()
            .find(|p| p.name == profile)
            .ok_or_else(|| nvml_mig::MigError::UnknownProfile {
                gpu_index: gpu,
                profile: profile.to_owned(),
            })?;
        if !p.placements.contains(&placement) {
            return Err(unavailable());
        }
        let mut all = self.instances.lock().map_err(|_| unavailable())?;
        let live = all.entry(gpu).or_default();
        let wanted = crate::gpu::contract_placement(placement);
        if live
            .iter()
            .any(|i| crate::gpu::contract_placement(i.placement).overlaps(&wanted))
        {
            return Err(unavailable());
        }
        let n = self
            .created
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let instance = nvml_mig::MigInstance {
            uuid: format!("MIG-{gpu}-{n}"),
            profile_id: p.id,
            profile: p.name,
            placement,
            gpu_instance_id: n + 1,
            compute_instance_id: Some(0),
            memory_mib: p.memory_mib,
        };
        live.push(instance.clone());
        Ok(instance)
    }
    fn destroy(&self, gpu: u32, gpu_instance_id: u32) -> Result<(), nvml_mig::MigError> {
        if self.busy.lock().is_ok_and(|b| b.contains(&gpu)) {
            return Err(nvml_mig::MigError::Nvml {
                call: "nvmlGpuInstanceDestroy",
                gpu_index: gpu,
                code: 19,
                message: "In use by another client".into(),
            });
        }
        if let Ok(mut all) = self.instances.lock()
            && let Some(live) = all.get_mut(&gpu)
        {
            live.retain(|i| i.gpu_instance_id != gpu_instance_id);
        }
        Ok(())
    }
}

/// NVML's process lists for the unaccounted-process watch, scripted per GPU UUID: each listed
/// PID is a compute process using 1 GiB.
#[derive(Debug, Default)]
pub struct ScriptedProcesses(pub Mutex<BTreeMap<String, Vec<u32>>>);

impl crate::gpu_processes::GpuProcessSource for ScriptedProcesses {
    fn processes_on(
        &self,
        gpu_uuid: &str,
    ) -> Result<crate::gpu_processes::ProcessesOnGpu, crate::gpu_processes::GpuProcessError> {
        use crate::unaccounted::{GpuProcess, ProcessKind};
        let pids = self
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(gpu_uuid)
            .cloned()
            .unwrap_or_default();
        Ok(crate::gpu_processes::ProcessesOnGpu {
            processes: pids
                .into_iter()
                .map(|pid| GpuProcess {
                    gpu_uuid: gpu_uuid.to_owned(),
                    pid,
                    used_bytes: Some(1 << 30),
                    kinds: [ProcessKind::Compute].into(),
                })
                .collect(),
            unsupported: Vec::new(),
        })
    }
}

/// An evictor that records each eviction as `namespace/name/uid` and succeeds.
#[derive(Debug, Default)]
pub struct RecordingEvictor(pub Mutex<Vec<String>>);

impl crate::process_watch::PodEvictor for RecordingEvictor {
    fn evict(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
    ) -> BoxFuture<'_, Result<(), EdgeError>> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(format!("{namespace}/{name}/{uid}"));
        Box::pin(async { Ok(()) })
    }
}

/// The cgroup of a container of pod `uid` under a systemd kubelet (`/proc/<pid>/cgroup`).
pub fn pod_cgroup(uid: &str) -> String {
    format!(
        "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/cri-containerd-{}.scope",
        uid.replace('-', "_"),
        "c".repeat(64)
    )
}

/// `<root>/<pid>` as `/proc` shows a process in `cgroup` whose PID in its own namespace is
/// `ns_pid`: its `cgroup` and `status` files.
pub fn proc_entry(root: &Path, pid: u32, cgroup: &str, ns_pid: u32) {
    let dir = root.join(pid.to_string());
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("cgroup"), format!("0::{cgroup}\n")).unwrap();
    std::fs::write(
        dir.join("status"),
        format!("Name:\tx\nNSpid:\t{pid}\t{ns_pid}\n"),
    )
    .unwrap();
}

/// A shim region file as the shim leaves it: GPU `uuid`, one live process whose PID in its
/// container is `ns_pid` (Tessera's shim leaves `hostpid` 0).
pub fn region_with_process(uuid: &str, ns_pid: i32) -> Vec<u8> {
    use vgpu_region::{offset, slot};
    let mut b = vec![0u8; vgpu_region::FILE_SIZE];
    let mut put = |off: usize, v: &[u8]| b[off..off + v.len()].copy_from_slice(v);
    put(offset::INITIALIZED_FLAG, &vgpu_region::MAGIC.to_ne_bytes());
    put(offset::MAJOR_VERSION, &1u32.to_ne_bytes());
    put(offset::MINOR_VERSION, &2u32.to_ne_bytes());
    put(offset::DEVICE_NUM, &1u64.to_ne_bytes());
    put(offset::UUIDS, uuid.as_bytes());
    put(offset::PROC_NUM, &1i32.to_ne_bytes());
    put(offset::PROCS + slot::PID, &ns_pid.to_ne_bytes());
    put(offset::PROCS + slot::STATUS, &1i32.to_ne_bytes());
    b
}

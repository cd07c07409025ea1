//! The real gRPC service on a real unix socket, driven by a fake kubelet: registration,
//! ListAndWatch, GetPreferredAllocation, Allocate for bound pods, kubelet restart, stream drop,
//! health, shutdown.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use hami_contract::annotations as keys;
use kubelet_proto::deviceplugin::v1beta1 as dp;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use support::kubelet_harness::FakeKubelet;
use tessera_device_plugin::allocator::{
    Allocator, EdgeError, NoPodResources, PodPatcher, PodResourcesSource, PodSource,
};
use tessera_device_plugin::container_env::ResponseSettings;
use tessera_device_plugin::gpu::{AdvertiseSettings, GpuInfo, plan_gpus};
use tessera_device_plugin::health::{HealthEvent, HealthPolicy, HealthTracker};
use tessera_device_plugin::identity::{ContainerSpec, PodSnapshot};
use tessera_device_plugin::kubelet::{KubeletSettings, run};
use tessera_device_plugin::pod_resources::KubeletPodResources;
use tessera_device_plugin::service::{DevicePluginService, DeviceState};
use tokio::sync::watch;

const NODE: &str = "node-a";
const RESOURCE: &str = "nvidia.com/gpu";

type PatchLog = Arc<Mutex<Vec<(String, BTreeMap<String, String>)>>>;

/// Pods in memory; patches apply to them (the "apiserver").
#[derive(Clone, Default)]
struct MemoryApi {
    pods: Arc<Mutex<Vec<PodSnapshot>>>,
    patches: PatchLog,
}

impl PodSource for MemoryApi {
    fn cached(&self) -> Vec<PodSnapshot> {
        self.pods.lock().expect("lock").clone()
    }
    fn fresh(&self) -> BoxFuture<'_, Result<Vec<PodSnapshot>, EdgeError>> {
        let pods = self.cached();
        Box::pin(async move { Ok(pods) })
    }
    fn hami_lock(&self) -> Option<String> {
        None
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
        {
            let mut pods = self.pods.lock().expect("lock");
            if let Some(p) = pods.iter_mut().find(|p| p.key() == key) {
                // The API server's UID precondition.
                if p.uid != uid {
                    let msg = format!(
                        "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                        p.uid
                    );
                    return Box::pin(async move { Err(EdgeError(msg)) });
                }
                p.annotations.extend(annotations.clone());
            }
        }
        self.patches.lock().expect("lock").push((key, annotations));
        Box::pin(async { Ok(()) })
    }
    fn release_hami_lock(&self, _: &str, _: &str) -> BoxFuture<'_, Result<(), EdgeError>> {
        Box::pin(async { Ok(()) })
    }
}

fn gpus() -> Vec<GpuInfo> {
    (0..2)
        .map(|i| GpuInfo {
            uuid: format!("GPU-{i}"),
            index: i,
            name: "Tesla T4".into(),
            memory_total_mib: Some(15360),
            pci_bus_id: String::new(),
            numa_node: Some(i),
            mig_enabled: false,
        })
        .collect()
}

fn bound_pod(name: &str, entries: &[&[(&str, u32, u32)]], bind_time: u64) -> PodSnapshot {
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
    let mut annotations = BTreeMap::new();
    annotations.insert(keys::VGPU_NODE.to_owned(), NODE.to_owned());
    annotations.insert(keys::DEVICES_TO_ALLOCATE.to_owned(), value.clone());
    annotations.insert(keys::DEVICES_ALLOCATED.to_owned(), value);
    annotations.insert(
        keys::BIND_PHASE.to_owned(),
        keys::BIND_PHASE_ALLOCATING.to_owned(),
    );
    annotations.insert(keys::BIND_TIME.to_owned(), bind_time.to_string());
    PodSnapshot {
        namespace: "default".into(),
        name: name.into(),
        uid: format!("uid-{name}"),
        node_name: Some(NODE.into()),
        scheduler_name: Some("hami-scheduler".into()),
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
    }
}

struct Plugin {
    kubelet: FakeKubelet,
    restart: Arc<tokio::sync::Notify>,
    api: MemoryApi,
    state: Arc<DeviceState>,
    shutdown: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
    _root: tempfile::TempDir,
    hook: tempfile::TempDir,
}

async fn start_plugin(with_pod_resources: bool) -> Plugin {
    start_plugin_split(with_pod_resources, 4).await
}

async fn start_plugin_split(with_pod_resources: bool, split: u32) -> Plugin {
    let root = tempfile::tempdir().expect("tempdir");
    let hook = tempfile::tempdir().expect("tempdir");
    let kubelet = FakeKubelet::start(root.path(), with_pod_resources).await;
    let mut settings = AdvertiseSettings::new(&Default::default(), Default::default(), "");
    settings.split_count = split;
    let (managed, _) = plan_gpus(&gpus(), &settings);
    let tracker = HealthTracker::new(
        HealthPolicy {
            recovery_quiet: Duration::from_millis(0),
            ..Default::default()
        },
        managed.iter().map(|g| g.uuid.clone()),
    );
    let state = DeviceState::new(managed, tracker, true, None);
    let api = MemoryApi::default();
    let pod_resources: Arc<dyn PodResourcesSource> = if with_pod_resources {
        Arc::new(KubeletPodResources {
            socket: kubelet.pod_resources_socket.clone(),
            resource: RESOURCE.into(),
        })
    } else {
        Arc::new(NoPodResources)
    };
    let allocator = Arc::new(Allocator::new(
        NODE.into(),
        ResponseSettings {
            hook_path: hook.path().display().to_string(),
            memory_scaling: 1.0,
            lib_cuda_log_level: "1".into(),
            disable_core_limit: false,
            shim_host_path: format!("{}/vgpu/libvgpu.so", hook.path().display()),
            license_present: false,
            cdi_devices: false,
        },
        state.managed_uuids.clone(),
        Arc::new(api.clone()),
        Arc::new(api.clone()),
        pod_resources,
    ));
    let restart = Arc::new(tokio::sync::Notify::new());
    let ks = KubeletSettings {
        socket_dir: kubelet.device_plugin_dir.clone(),
        socket_name: "nvidia-gpu.sock".into(),
        resource_name: RESOURCE.into(),
        preferred_allocation: true,
        poll_interval: Duration::from_millis(200),
        restart: restart.clone(),
    };
    let (shutdown, shutdown_rx) = watch::channel(false);
    let st = state.clone();
    let task = tokio::spawn(async move {
        let make = move |stop| DevicePluginService {
            state: st.clone(),
            allocator: allocator.clone(),
            preferred_allocation: true,
            stop,
        };
        run(ks, make, shutdown_rx, None).await.expect("plugin runs");
    });
    Plugin {
        kubelet,
        restart,
        api,
        state,
        shutdown,
        task,
        _root: root,
        hook,
    }
}

async fn allocate(
    client: &mut kubelet_proto::deviceplugin::v1beta1::device_plugin_client::DevicePluginClient<
        tonic::transport::Channel,
    >,
    ids: &[&str],
) -> Result<dp::ContainerAllocateResponse, tonic::Status> {
    let resp = client
        .allocate(dp::AllocateRequest {
            container_requests: vec![dp::ContainerAllocateRequest {
                devices_ids: ids.iter().map(|s| s.to_string()).collect(),
            }],
        })
        .await?;
    Ok(resp.into_inner().container_responses.remove(0))
}

#[tokio::test]
async fn registers_streams_allocates_and_reregisters_after_kubelet_restart() {
    let mut p = start_plugin(false).await;
    let reg = p
        .kubelet
        .next_registration(Duration::from_secs(5))
        .await
        .expect("registered");
    assert_eq!(reg.version, "v1beta1");
    assert_eq!(reg.endpoint, "nvidia-gpu.sock");
    assert_eq!(reg.resource_name, RESOURCE);
    assert!(
        reg.options
            .expect("options")
            .get_preferred_allocation_available
    );

    let mut client = p.kubelet.plugin(&reg.endpoint).await;
    let opts = client
        .get_device_plugin_options(dp::Empty {})
        .await
        .expect("options")
        .into_inner();
    assert!(opts.get_preferred_allocation_available && !opts.pre_start_required);
    let mut stream = client
        .list_and_watch(dp::Empty {})
        .await
        .expect("stream")
        .into_inner();
    let first = stream.message().await.expect("ok").expect("a list");
    assert_eq!(first.devices.len(), 8);
    assert_eq!(first.devices[5].id, "GPU-1-1");
    assert_eq!(
        first.devices[5].topology.as_ref().map(|t| t.nodes[0].id),
        Some(1)
    );
    assert!(first.devices.iter().all(|d| d.health == "Healthy"));

    // A bound pod with one container on GPU-1.
    p.api
        .pods
        .lock()
        .expect("lock")
        .push(bound_pod("web", &[&[("GPU-1", 3000, 30)]], 1));
    let available: Vec<String> = first.devices.iter().map(|d| d.id.clone()).collect();
    let pref = client
        .get_preferred_allocation(dp::PreferredAllocationRequest {
            container_requests: vec![dp::ContainerPreferredAllocationRequest {
                available_device_i_ds: available,
                must_include_device_i_ds: Vec::new(),
                allocation_size: 1,
            }],
        })
        .await
        .expect("preferred")
        .into_inner();
    assert_eq!(pref.container_responses[0].device_i_ds, ["GPU-1-0"]);
    let resp = allocate(&mut client, &["GPU-1-0"])
        .await
        .expect("allocated");
    assert_eq!(resp.envs["NVIDIA_VISIBLE_DEVICES"], "GPU-1");
    assert_eq!(resp.envs["CUDA_DEVICE_MEMORY_LIMIT_0"], "3000m");
    assert_eq!(resp.envs["CUDA_DEVICE_SM_LIMIT"], "30");
    let cache_dir = p.hook.path().join("vgpu/containers/uid-web_c0");
    assert!(cache_dir.is_dir(), "per-container cache dir created");
    assert!(
        resp.mounts
            .iter()
            .any(|m| m.container_path == "/etc/ld.so.preload")
    );
    {
        let patches = p.api.patches.lock().expect("lock");
        assert_eq!(patches.len(), 1);
        assert_eq!(patches[0].1[keys::DEVICES_TO_ALLOCATE], ";");
        assert_eq!(patches[0].1[keys::BIND_PHASE], keys::BIND_PHASE_SUCCESS);
    }
    // A second identical call has no pod left: refused with a clear message.
    let err = allocate(&mut client, &["GPU-1-1"])
        .await
        .expect_err("nothing pending");
    assert!(
        err.message().contains("no pod bound to this node"),
        "{}",
        err.message()
    );

    // Kubelet restart: re-registration within 5 s, old stream ends.
    let restarted = Instant::now();
    p.kubelet.restart().await;
    let reg2 = p
        .kubelet
        .next_registration(Duration::from_secs(5))
        .await
        .expect("re-registered");
    assert!(restarted.elapsed() < Duration::from_secs(5));
    assert_eq!(reg2.endpoint, "nvidia-gpu.sock");
    let ended = tokio::time::timeout(Duration::from_secs(5), async {
        while let Ok(Some(_)) = stream.message().await {}
    })
    .await;
    assert!(
        ended.is_ok(),
        "the old ListAndWatch stream ends when the plugin restarts"
    );
    let mut client = p.kubelet.plugin(&reg2.endpoint).await;
    let mut stream = client
        .list_and_watch(dp::Empty {})
        .await
        .expect("stream")
        .into_inner();
    assert_eq!(
        stream
            .message()
            .await
            .expect("ok")
            .expect("list")
            .devices
            .len(),
        8
    );

    // A requested restart (SIGHUP in the binary) re-registers too.
    p.restart.notify_one();
    let reg3 = p
        .kubelet
        .next_registration(Duration::from_secs(5))
        .await
        .expect("re-registered after SIGHUP");
    assert_eq!(reg3.resource_name, RESOURCE);

    // Shutdown removes the socket.
    let socket = p.kubelet.device_plugin_dir.join("nvidia-gpu.sock");
    assert!(socket.exists());
    p.shutdown.send(true).expect("send");
    tokio::time::timeout(Duration::from_secs(6), &mut p.task)
        .await
        .expect("stops")
        .expect("no panic");
    assert!(!socket.exists(), "socket removed on shutdown");
}

#[tokio::test]
async fn health_event_streams_unhealthy_replicas_and_recovers() {
    let mut p = start_plugin(false).await;
    let reg = p
        .kubelet
        .next_registration(Duration::from_secs(5))
        .await
        .expect("registered");
    let mut client = p.kubelet.plugin(&reg.endpoint).await;
    let mut stream = client
        .list_and_watch(dp::Empty {})
        .await
        .expect("stream")
        .into_inner();
    stream.message().await.expect("ok").expect("initial");

    p.state.health_event(
        &HealthEvent::Xid {
            uuid: "GPU-0".into(),
            xid: 79,
        },
        Instant::now(),
    );
    let update = stream.message().await.expect("ok").expect("update");
    let unhealthy: Vec<_> = update
        .devices
        .iter()
        .filter(|d| d.health == "Unhealthy")
        .map(|d| d.id.as_str())
        .collect();
    assert_eq!(unhealthy, ["GPU-0-0", "GPU-0-1", "GPU-0-2", "GPU-0-3"]);
    let annotation = p.state.register_annotation();
    assert!(annotation.starts_with(r#"[{"id":"GPU-0","count":4,"devmem":15360,"devcore":100,"type":"NVIDIA-Tesla T4","mode":"hami-core"}"#), "{annotation}");

    // An ignored XID changes nothing; recovery after the quiet period when the GPU answers.
    p.state.health_event(
        &HealthEvent::Xid {
            uuid: "GPU-1".into(),
            xid: 13,
        },
        Instant::now(),
    );
    p.state.recover(&|_| false, Instant::now());
    p.state
        .recover(&|_| true, Instant::now() + Duration::from_millis(1));
    let update = stream.message().await.expect("ok").expect("recovered");
    assert!(update.devices.iter().all(|d| d.health == "Healthy"));
    assert!(
        p.state
            .register_annotation()
            .matches(r#""health":true"#)
            .count()
            == 2
    );
    let _ = p.shutdown.send(true);
}

/// 24 pods with different limits, all bound at once; the fake kubelet admits them one by one
/// (GetPreferredAllocation + Allocate per container, then records the devices in pod-resources)
/// in creation, reverse and random order. Each container must get its own limits and GPUs.
#[tokio::test]
async fn twenty_four_bound_pods_get_their_own_limits_in_any_admission_order() {
    for order in ["creation", "reverse", "random"] {
        let mut p = start_plugin_split(true, 20).await;
        let reg = p
            .kubelet
            .next_registration(Duration::from_secs(5))
            .await
            .expect("registered");
        let mut client = p.kubelet.plugin(&reg.endpoint).await;
        let mut stream = client
            .list_and_watch(dp::Empty {})
            .await
            .expect("stream")
            .into_inner();
        let all: Vec<String> = stream
            .message()
            .await
            .expect("ok")
            .expect("list")
            .devices
            .into_iter()
            .map(|d| d.id)
            .collect();

        let mut expected = BTreeMap::new();
        for i in 0..24u32 {
            let gpu = if i % 2 == 0 { "GPU-0" } else { "GPU-1" };
            let (mem, cores) = (1000 + 10 * i, 1 + i);
            let containers: Vec<Vec<(&str, u32, u32)>> = if i % 6 == 5 {
                vec![
                    vec![(gpu, mem, cores)],
                    vec![("GPU-0", mem + 1, cores), ("GPU-1", mem + 1, cores)],
                ]
            } else {
                vec![vec![(gpu, mem, cores)]]
            };
            let refs: Vec<&[(&str, u32, u32)]> = containers.iter().map(Vec::as_slice).collect();
            let pod = bound_pod(&format!("pod-{i:02}"), &refs, u64::from(i));
            expected.insert(
                pod.name.clone(),
                containers
                    .iter()
                    .map(|c| {
                        c.iter()
                            .map(|(u, m, k)| (u.to_string(), *m, *k))
                            .collect::<Vec<_>>()
                    })
                    .collect::<Vec<_>>(),
            );
            p.api.pods.lock().expect("lock").push(pod);
        }
        let mut names: Vec<String> = expected.keys().cloned().collect();
        match order {
            "reverse" => names.reverse(),
            "random" => {
                let mut rng = StdRng::seed_from_u64(7);
                for i in (1..names.len()).rev() {
                    names.swap(i, rng.random_range(0..=i));
                }
            }
            _ => {}
        }
        let mut used: BTreeSet<String> = BTreeSet::new();
        for name in names {
            // The kubelet adds the pod to its pod manager before admission: List shows it.
            p.kubelet
                .pod_resources
                .record("default", &name, "c0", RESOURCE, Vec::new());
            for (k, container) in expected[&name].iter().enumerate() {
                let cname = format!("c{k}");
                p.kubelet
                    .pod_resources
                    .record("default", &name, &cname, RESOURCE, Vec::new());
                let available: Vec<String> = all
                    .iter()
                    .filter(|id| !used.contains(*id))
                    .cloned()
                    .collect();
                let pref = client
                    .get_preferred_allocation(dp::PreferredAllocationRequest {
                        container_requests: vec![dp::ContainerPreferredAllocationRequest {
                            available_device_i_ds: available,
                            must_include_device_i_ds: Vec::new(),
                            allocation_size: container.len() as i32,
                        }],
                    })
                    .await
                    .expect("preferred")
                    .into_inner();
                let ids = pref.container_responses[0].device_i_ds.clone();
                let id_refs: Vec<&str> = ids.iter().map(String::as_str).collect();
                let resp = allocate(&mut client, &id_refs)
                    .await
                    .unwrap_or_else(|e| panic!("{name}: {}", e.message()));
                let uuids: Vec<&str> = container.iter().map(|(u, _, _)| u.as_str()).collect();
                assert_eq!(
                    resp.envs["NVIDIA_VISIBLE_DEVICES"],
                    uuids.join(","),
                    "{name} {order}"
                );
                for (j, (_, mem, _)) in container.iter().enumerate() {
                    assert_eq!(
                        resp.envs[&format!("CUDA_DEVICE_MEMORY_LIMIT_{j}")],
                        format!("{mem}m"),
                        "{name} {order}"
                    );
                }
                assert_eq!(
                    resp.envs["CUDA_DEVICE_SM_LIMIT"],
                    container[0].2.to_string()
                );
                let host = resp
                    .mounts
                    .iter()
                    .find(|m| m.container_path == "/usr/local/vgpu")
                    .expect("cache mount");
                assert!(
                    host.host_path.ends_with(&format!("uid-{name}_{cname}")),
                    "{}",
                    host.host_path
                );
                used.extend(ids.iter().cloned());
                p.kubelet
                    .pod_resources
                    .record("default", &name, &cname, RESOURCE, ids);
            }
        }
        let pods = p.api.pods.lock().expect("lock").clone();
        assert!(
            pods.iter()
                .all(|p| p.annotations[keys::BIND_PHASE] == keys::BIND_PHASE_SUCCESS),
            "{order}"
        );
        let _ = p.shutdown.send(true);
    }
}

#[tokio::test]
async fn a_booking_of_a_gpu_this_node_lacks_is_never_served() {
    let mut p = start_plugin(false).await;
    let reg = p
        .kubelet
        .next_registration(Duration::from_secs(5))
        .await
        .expect("registered");
    let mut client = p.kubelet.plugin(&reg.endpoint).await;
    p.api.pods.lock().expect("lock").push(bound_pod(
        "bad",
        &[&[("GPU-9", 1000, 10), ("GPU-0", 1000, 10)]],
        1,
    ));
    p.api
        .pods
        .lock()
        .expect("lock")
        .push(bound_pod("good", &[&[("GPU-0", 2000, 20)]], 2));
    let err = allocate(&mut client, &["GPU-0-0", "GPU-0-1"])
        .await
        .expect_err("no believable pod asks for two GPUs");
    assert!(err.message().contains("tessera"), "{}", err.message());
    let ok = allocate(&mut client, &["GPU-0-2"])
        .await
        .expect("good pod unaffected");
    assert_eq!(ok.envs["CUDA_DEVICE_MEMORY_LIMIT_0"], "2000m");
    let _ = p.shutdown.send(true);
}

/// The attack of the security review: a user creates a pod that skips the GPU scheduler and
/// carries forged booking annotations naming the GPU another pod booked. The plugin must not
/// serve it (foreign scheduler, or a booking for another node), and must serve the real pod.
#[tokio::test]
async fn forged_bookings_are_not_served() {
    let mut p = start_plugin(false).await;
    let reg = p
        .kubelet
        .next_registration(Duration::from_secs(5))
        .await
        .expect("registered");
    let mut client = p.kubelet.plugin(&reg.endpoint).await;
    let mut forged = bound_pod("forged", &[&[("GPU-0", 9000, 100)]], 1);
    forged.scheduler_name = Some("default-scheduler".into());
    let mut elsewhere = bound_pod("elsewhere", &[&[("GPU-0", 8000, 100)]], 1);
    elsewhere
        .annotations
        .insert(keys::VGPU_NODE.to_owned(), "node-b".to_owned());
    let mut unbooked_node = bound_pod("no-node", &[&[("GPU-0", 7000, 100)]], 1);
    unbooked_node.annotations.remove(keys::VGPU_NODE);
    for pod in [forged, elsewhere, unbooked_node] {
        p.api.pods.lock().expect("lock").push(pod);
        let err = allocate(&mut client, &["GPU-0-0"])
            .await
            .expect_err("a forged booking is not served");
        assert!(err.message().contains("tessera"), "{}", err.message());
    }
    // The real pod, booked by the GPU scheduler, is served its own limits; no forged one is.
    p.api
        .pods
        .lock()
        .expect("lock")
        .push(bound_pod("real", &[&[("GPU-0", 2000, 20)]], 5));
    let ok = allocate(&mut client, &["GPU-0-1"])
        .await
        .expect("the real pod is served");
    assert_eq!(ok.envs["CUDA_DEVICE_MEMORY_LIMIT_0"], "2000m");
    let patched: Vec<String> = p
        .api
        .patches
        .lock()
        .expect("lock")
        .iter()
        .map(|(k, _)| k.clone())
        .collect();
    assert_eq!(patched, ["default/real"], "only the real pod was patched");
    let _ = p.shutdown.send(true);
}

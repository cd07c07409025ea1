//! The real gRPC service on a real unix socket, driven by a fake kubelet: registration,
//! ListAndWatch, GetPreferredAllocation, Allocate for bound pods, kubelet restart, stream drop,
//! health, shutdown.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use hami_contract::annotations as keys;
use hami_contract::config::MigProfileAllow;
use hami_contract::mig::{MigAllocation, MigPlacement};
use kubelet_proto::deviceplugin::v1beta1 as dp;
use nvml_mig::{MigControl, Placement};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use support::kubelet_harness::FakeKubelet;
use tessera_device_plugin::kubelet::{KubeletSettings, run};
use tessera_device_plugin::service::DevicePluginService;
use tessera_node::allocator::Allocator;
use tessera_node::device_state::DeviceState;
use tessera_node::edges::{NoPodResources, PodResourcesSource};
use tessera_node::gpu::MigLayout;
use tessera_node::gpu::{AdvertiseSettings, GpuInfo, plan_gpus};
use tessera_node::health::{HealthEvent, HealthPolicy, HealthTracker};
use tessera_node::identity::PodSnapshot;
use tessera_node::metrics::Readiness;
use tessera_node::mig::MigManager;
use tessera_node::node_events::{NodeEventType, NodeEvents};
use tessera_node::pod_resources::KubeletPodResources;
use tessera_node::testing::{self, MemoryApi, MemoryMig, NODE, RESOURCE, response_settings, t4};
use tokio_util::sync::CancellationToken;

fn gpus() -> Vec<GpuInfo> {
    (0..2)
        .map(|i| GpuInfo {
            numa_node: Some(i),
            ..t4(&format!("GPU-{i}"), i)
        })
        .collect()
}

fn bound_pod(name: &str, entries: &[&[(&str, u32, u32)]], bind_time: u64) -> PodSnapshot {
    testing::bound_pod(NODE, name, entries, bind_time)
}

struct Plugin {
    kubelet: FakeKubelet,
    restart: Arc<tokio::sync::Notify>,
    readiness: Readiness,
    api: MemoryApi,
    state: Arc<DeviceState>,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    _root: tempfile::TempDir,
    hook: tempfile::TempDir,
}

async fn start_plugin(with_pod_resources: bool) -> Plugin {
    start_plugin_split(with_pod_resources, 4).await
}

async fn start_plugin_split(with_pod_resources: bool, split: u32) -> Plugin {
    let mut settings = AdvertiseSettings::new(&Default::default(), Default::default(), "");
    settings.split_count = split;
    start_plugin_with(with_pod_resources, &gpus(), &settings, None).await
}

async fn start_plugin_with(
    with_pod_resources: bool,
    gpus: &[GpuInfo],
    settings: &AdvertiseSettings,
    mig: Option<Arc<MigManager>>,
) -> Plugin {
    let root = tempfile::tempdir().expect("tempdir");
    let hook = tempfile::tempdir().expect("tempdir");
    let kubelet = FakeKubelet::start(root.path(), with_pod_resources).await;
    let owned = |u: &str| mig.as_ref().is_some_and(|m| m.owns(u));
    let (managed, _) = plan_gpus(gpus, settings, &owned);
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
    let mut allocator = Allocator::new(
        NODE.into(),
        response_settings(hook.path()),
        state.managed_uuids.clone(),
        Arc::new(api.clone()),
        Arc::new(api.clone()),
        pod_resources,
    );
    allocator.mig = mig;
    allocator.mig_gpus = state.mig_gpus.clone();
    let allocator = Arc::new(allocator);
    let restart = Arc::new(tokio::sync::Notify::new());
    let readiness = Readiness::default();
    let ks = KubeletSettings {
        socket_dir: kubelet.device_plugin_dir.clone(),
        socket_name: "nvidia-gpu.sock".into(),
        resource_name: RESOURCE.into(),
        preferred_allocation: true,
        poll_interval: Duration::from_millis(200),
        register_retry: Duration::from_millis(200),
        stop_grace: Duration::from_secs(5),
        restart: restart.clone(),
        readiness: readiness.clone(),
    };
    let shutdown = CancellationToken::new();
    let shutdown_rx = shutdown.clone();
    let st = state.clone();
    let task = tokio::spawn(async move {
        let make = move |stop| DevicePluginService {
            state: st.clone(),
            allocator: allocator.clone(),
            preferred_allocation: true,
            stop,
            exclusive: false,
        };
        run(ks, make, shutdown_rx, None).await.expect("plugin runs");
    });
    Plugin {
        kubelet,
        restart,
        readiness,
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

/// Waits (bounded) until `cond` holds.
async fn wait_until(cond: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !cond() {
        assert!(
            Instant::now() < deadline,
            "condition not reached within 5 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
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
    // Ready (the DaemonSet's readiness probe) only once registered.
    wait_until(|| p.readiness.is_ready()).await;
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
        .add_pod(bound_pod("web", &[&[("GPU-1", 3000, 30)]], 1));
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
        let patches = p.api.patches();
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
    // Not ready while the restarted kubelet does not know the plugin.
    wait_until(|| !p.readiness.is_ready()).await;
    let reg2 = p
        .kubelet
        .next_registration(Duration::from_secs(5))
        .await
        .expect("re-registered");
    assert!(restarted.elapsed() < Duration::from_secs(5));
    assert_eq!(reg2.endpoint, "nvidia-gpu.sock");
    wait_until(|| p.readiness.is_ready()).await;
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
    p.shutdown.cancel();
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
    let (events, mut node_events) = NodeEvents::channel();
    p.state.attach_events(events);

    p.state.health_event(
        &HealthEvent::Xid {
            uuid: "GPU-0".into(),
            xid: 79,
        },
        Instant::now(),
    );
    let event = node_events.try_recv().expect("a node event");
    assert_eq!(
        (event.kind, event.reason),
        (NodeEventType::Warning, "GPUUnhealthy")
    );
    assert!(event.message.contains("GPU-0") && event.message.contains("XID 79"));
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
    // The ignored XID and the failed probe said nothing; the recovery did.
    let event = node_events.try_recv().expect("a recovery event");
    assert_eq!(
        (event.kind, event.reason),
        (NodeEventType::Normal, "GPURecovered")
    );
    assert!(node_events.try_recv().is_err(), "one event per change");
    assert!(
        p.state
            .register_annotation()
            .matches(r#""health":true"#)
            .count()
            == 2
    );
    p.shutdown.cancel();
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
            p.api.add_pod(pod);
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
        let pods = p.api.pods();
        assert!(
            pods.iter()
                .all(|p| p.annotations[keys::BIND_PHASE] == keys::BIND_PHASE_SUCCESS),
            "{order}"
        );
        p.shutdown.cancel();
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
    let (events, mut node_events) = NodeEvents::channel();
    p.state.attach_events(events);
    p.api.add_pod(bound_pod(
        "bad",
        &[&[("GPU-9", 1000, 10), ("GPU-0", 1000, 10)]],
        1,
    ));
    p.api
        .add_pod(bound_pod("good", &[&[("GPU-0", 2000, 20)]], 2));
    let err = allocate(&mut client, &["GPU-0-0", "GPU-0-1"])
        .await
        .expect_err("no believable pod asks for two GPUs");
    assert!(err.message().contains("tessera"), "{}", err.message());
    // The refusal is a Warning on the node too, with the message the kubelet got.
    let event = node_events.try_recv().expect("a node event");
    assert_eq!(
        (event.kind, event.reason),
        (NodeEventType::Warning, "AllocateRefused")
    );
    assert!(event.message.ends_with(err.message()), "{}", event.message);
    let ok = allocate(&mut client, &["GPU-0-2"])
        .await
        .expect("good pod unaffected");
    assert_eq!(ok.envs["CUDA_DEVICE_MEMORY_LIMIT_0"], "2000m");
    p.shutdown.cancel();
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
        p.api.add_pod(pod);
        let err = allocate(&mut client, &["GPU-0-0"])
            .await
            .expect_err("a forged booking is not served");
        assert!(err.message().contains("tessera"), "{}", err.message());
    }
    // The real pod, booked by the GPU scheduler, is served its own limits; no forged one is.
    p.api
        .add_pod(bound_pod("real", &[&[("GPU-0", 2000, 20)]], 5));
    let ok = allocate(&mut client, &["GPU-0-1"])
        .await
        .expect("the real pod is served");
    assert_eq!(ok.envs["CUDA_DEVICE_MEMORY_LIMIT_0"], "2000m");
    let patched = p.api.patched();
    assert_eq!(patched, ["default/real"], "only the real pod was patched");
    p.shutdown.cancel();
}

/// A second plugin binds our socket's path (NVIDIA's and HAMi's plugins use the same name): the
/// plugin says so on the node and registers again, so the kubelet talks to it, not the other.
#[tokio::test]
async fn a_second_plugin_replacing_our_socket_is_reported_and_displaced() {
    let mut p = start_plugin(false).await;
    let reg = p
        .kubelet
        .next_registration(Duration::from_secs(5))
        .await
        .expect("registered");
    let (events, mut node_events) = NodeEvents::channel();
    p.state.attach_events(events);
    let path = p.kubelet.device_plugin_dir.join(&reg.endpoint);
    std::fs::remove_file(&path).expect("remove our socket");
    let _other = tokio::net::UnixListener::bind(&path).expect("the other plugin binds");
    let again = p
        .kubelet
        .next_registration(Duration::from_secs(5))
        .await
        .expect("registered again");
    assert_eq!(again.endpoint, "nvidia-gpu.sock");
    let event = node_events.try_recv().expect("a conflict event");
    assert_eq!(
        (event.kind, event.reason),
        (NodeEventType::Warning, "DevicePluginConflict")
    );
    assert!(
        event.message.contains("replaced this plugin's socket")
            && event
                .message
                .contains("nvidia.com/gpu.deploy.device-plugin=false"),
        "{}",
        event.message
    );
    // Ours again: the kubelet reaches this plugin at the path.
    let mut client = p.kubelet.plugin(&again.endpoint).await;
    let list = client
        .list_and_watch(dp::Empty {})
        .await
        .expect("stream")
        .into_inner()
        .message()
        .await
        .expect("ok")
        .expect("a list");
    assert_eq!(list.devices.len(), 8);
    p.shutdown.cancel();
}

/// The scan for other plugins: a socket that lists this node's GPUs is found with its device
/// IDs; the kubelet's socket, our own, plain files and a socket that never answers are not.
#[tokio::test]
async fn other_plugin_sockets_are_probed_for_their_devices() {
    let mut p = start_plugin(false).await;
    p.kubelet
        .next_registration(Duration::from_secs(5))
        .await
        .expect("registered");
    let dir = p.kubelet.device_plugin_dir.clone();
    // Another plugin: a second instance of the service on another socket name.
    let other = dir.join("nvidia.sock");
    let listener = tokio::net::UnixListener::bind(&other).expect("bind");
    let service = DevicePluginService {
        state: p.state.clone(),
        allocator: Arc::new(Allocator::new(
            NODE.into(),
            response_settings(p.hook.path()),
            p.state.managed_uuids.clone(),
            Arc::new(p.api.clone()),
            Arc::new(p.api.clone()),
            Arc::new(NoPodResources),
        )),
        preferred_allocation: false,
        stop: p.shutdown.child_token(),
        exclusive: false,
    };
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(
                kubelet_proto::deviceplugin::v1beta1::device_plugin_server::DevicePluginServer::new(
                    service,
                ),
            )
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
    );
    let _silent = std::os::unix::net::UnixListener::bind(dir.join("silent.sock")).expect("bind");
    std::fs::write(dir.join("kubelet_internal_checkpoint"), "{}").expect("write");
    let found = tessera_device_plugin::kubelet::foreign_plugin_devices(
        &dir,
        "nvidia-gpu.sock",
        Duration::from_millis(500),
    )
    .await;
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].0, "nvidia.sock");
    let ours: BTreeSet<String> = ["GPU-0".to_owned()].into();
    assert_eq!(
        tessera_node::conflict::ids_naming_our_gpus(&ours, &found[0].1),
        ["GPU-0-0", "GPU-0-1", "GPU-0-2", "GPU-0-3"]
    );
    p.shutdown.cancel();
}

/// A pod on the MIG GPU `GPU-0` with one container and the reservations the extender wrote.
fn mig_pod(name: &str, reservations: &[MigAllocation]) -> PodSnapshot {
    let mut pod = bound_pod(name, &[&[("GPU-0", 4864, 15)]], 1);
    pod.annotations.insert(
        keys::MIG_ALLOCATIONS.into(),
        hami_contract::mig::encode_allocations(reservations),
    );
    pod
}

fn mig_reservation(start: u32) -> MigAllocation {
    MigAllocation {
        container_index: 0,
        device_index: 0,
        gpu_uuid: "GPU-0".into(),
        profile: "1g.5gb".into(),
        placement: MigPlacement { start, size: 1 },
        ..MigAllocation::default()
    }
}

/// HAMi: pkg/device-plugin/nvidiadevice/nvinternal/plugin/util.go `GetContainerDeviceStrArray`
/// (the container's reservations by device index, carved exactly, never another placement) and
/// server.go `Allocate`/`annotateMigRuntimeInfo` (MIG UUIDs as the visible devices, no HAMi-core
/// env or mounts, the runtime identity added to `hami.io/vgpu-mig-allocations`).
#[tokio::test]
async fn a_mig_reservation_is_carved_at_allocate_and_the_container_gets_only_that_instance() {
    let control = Arc::new(MemoryMig::a100s(1));
    let manager = Arc::new(MigManager::load(control.clone(), None));
    let mut a100 = GpuInfo {
        name: "NVIDIA A100-SXM4-40GB".into(),
        memory_total_mib: Some(40960),
        mig_enabled: true,
        mig: Some(MigLayout {
            profiles: testing::a100_profiles(),
            instances: Vec::new(),
        }),
        ..t4("GPU-0", 0)
    };
    a100.numa_node = Some(0);
    let mut settings = AdvertiseSettings::new(&Default::default(), Default::default(), "mig");
    settings.mig_allowlist = vec![MigProfileAllow {
        models: vec!["A100".into()],
        profiles: vec!["1g.5gb".into(), "3g.20gb".into()],
    }];
    let mut p = start_plugin_with(false, &[a100], &settings, Some(manager.clone())).await;
    let reg = p
        .kubelet
        .next_registration(Duration::from_secs(5))
        .await
        .expect("registered");
    let mut client = p.kubelet.plugin(&reg.endpoint).await;
    let devices = client
        .list_and_watch(dp::Empty {})
        .await
        .expect("stream")
        .into_inner()
        .message()
        .await
        .expect("ok")
        .expect("a list");
    assert_eq!(
        devices.devices.len(),
        7,
        "the largest instance count of the allowed profiles"
    );

    p.api.add_pod(mig_pod("slice", &[mig_reservation(6)]));
    let resp = allocate(&mut client, &["GPU-0-0"])
        .await
        .expect("allocated");
    let carved = control.instances(0).expect("instances");
    assert_eq!(carved.len(), 1);
    assert_eq!(carved[0].placement, Placement { start: 6, size: 1 });
    assert_eq!(resp.envs["NVIDIA_VISIBLE_DEVICES"], carved[0].uuid);
    assert!(
        resp.mounts.is_empty(),
        "no shim on a MIG instance: {:?}",
        resp.mounts
    );
    assert!(!resp.envs.contains_key("CUDA_DEVICE_MEMORY_LIMIT_0"));
    let patches = p.api.patches();
    let recorded = hami_contract::mig::decode_allocations(&patches[0].1[keys::MIG_ALLOCATIONS])
        .expect("valid");
    assert!(recorded[0].is_realized());
    assert_eq!(recorded[0].mig_uuid, carved[0].uuid);
    assert_eq!(patches[0].1[keys::BIND_PHASE], keys::BIND_PHASE_SUCCESS);

    // A reservation on a slice that is taken fails the call (the kubelet rejects the pod) and
    // marks it failed; nothing else is carved.
    p.api.remove_pod("default/slice");
    control
        .create(0, "1g.5gb", Placement { start: 5, size: 1 })
        .expect("someone else");
    p.api.add_pod(mig_pod("taken", &[mig_reservation(5)]));
    let err = allocate(&mut client, &["GPU-0-1"])
        .await
        .expect_err("taken slice");
    assert!(err.message().contains("not free"), "{}", err.message());
    assert_eq!(control.instances(0).map(|i| i.len()).ok(), Some(2));

    // A pod without a reservation for its MIG device is refused, not given a whole GPU.
    p.api.remove_pod("default/taken");
    p.api.add_pod(mig_pod("none", &[]));
    let err = allocate(&mut client, &["GPU-0-2"])
        .await
        .expect_err("no reservation");
    assert!(
        err.message().contains("no MIG reservation"),
        "{}",
        err.message()
    );
    p.shutdown.cancel();
}

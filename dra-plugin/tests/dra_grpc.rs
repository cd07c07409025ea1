//! The DRA plugin's gRPC services on real unix sockets, driven the way the kubelet drives them:
//! registration (GetInfo, NotifyRegistrationStatus), then NodePrepareResources and
//! NodeUnprepareResources for claims whose allocation is read from a (fake) API server.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kubelet_proto::dra::v1 as dra;
use kubelet_proto::pluginregistration as reg;
use kubelet_proto::transport::unix_channel;
use serde_json::json;
use tessera_dra_plugin::cdi;
use tessera_dra_plugin::checkpoint::PreparedClaims;
use tessera_dra_plugin::plugin::{ClaimSource, DraDriver, serve};
use tessera_node::edges::EdgeError;
use tessera_node::gpu::GpuInfo;
use tessera_node::testing::{region_with_process, response_settings, t4};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

const NODE: &str = "node-a";

/// ResourceClaims by `namespace/name`.
#[derive(Default, Clone)]
struct Claims(Arc<Mutex<BTreeMap<String, ResourceClaim>>>);

impl ClaimSource for Claims {
    fn claim(
        &self,
        namespace: &str,
        name: &str,
    ) -> BoxFuture<'_, Result<Option<ResourceClaim>, EdgeError>> {
        let found = self
            .0
            .lock()
            .unwrap()
            .get(&format!("{namespace}/{name}"))
            .cloned();
        Box::pin(async move { Ok(found) })
    }
}

impl Claims {
    /// A claim allocated one share of `device`.
    fn add(&self, name: &str, uid: &str, device: &str, memory: &str, cores: &str) {
        let claim: ResourceClaim = serde_json::from_value(json!({
            "metadata": {"namespace": "ml", "name": name, "uid": uid},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.tessera.dev"}}]}},
            "status": {"allocation": {"devices": {"results": [{
                "request": "gpu", "driver": "gpu.tessera.dev", "pool": NODE, "device": device,
                "consumedCapacity": {"memory": memory, "cores": cores},
            }]}}},
        }))
        .unwrap();
        self.0.lock().unwrap().insert(format!("ml/{name}"), claim);
    }

    fn remove(&self, name: &str) {
        self.0.lock().unwrap().remove(&format!("ml/{name}"));
    }
}

fn gpus() -> Vec<GpuInfo> {
    (0..2).map(|i| t4(&format!("GPU-{i}"), i)).collect()
}

struct Plugin {
    driver: Arc<DraDriver>,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

fn start(root: &Path, claims: &Claims) -> Plugin {
    let prepared = PreparedClaims::load(root.join("cdi"), response_settings(&root.join("hook")));
    let driver = Arc::new(DraDriver::new(
        NODE.into(),
        gpus(),
        Arc::new(claims.clone()),
        prepared,
    ));
    let shutdown = CancellationToken::new();
    let task = tokio::spawn({
        let (driver, shutdown) = (driver.clone(), shutdown.clone());
        let root = root.to_path_buf();
        async move {
            serve(
                driver,
                root.join("plugins/gpu.tessera.dev/dra.sock"),
                root.join("plugins_registry/gpu.tessera.dev-reg.sock"),
                Arc::new(Notify::new()),
                shutdown,
            )
            .await
            .unwrap();
        }
    });
    Plugin {
        driver,
        shutdown,
        task,
    }
}

impl Plugin {
    async fn stop(self) {
        self.shutdown.cancel();
        self.task.await.unwrap();
    }
}

/// Dials a socket the plugin is about to create.
async fn dial(path: &Path) -> tonic::transport::Channel {
    for _ in 0..100 {
        if let Ok(ch) = unix_channel(path, Duration::from_secs(1)).await {
            return ch;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{} never served", path.display());
}

fn claim(name: &str, uid: &str) -> dra::Claim {
    dra::Claim {
        namespace: "ml".into(),
        name: name.into(),
        uid: uid.into(),
    }
}

/// A shim region as HAMi-core leaves it: one GPU with `limit` bytes and `cores` percent, one
/// live process (PID 10) using `used` bytes.
fn region(uuid: &str, limit: u64, cores: u64, used: u64) -> Vec<u8> {
    use vgpu_region::{offset, slot};
    let mut b = region_with_process(uuid, 10);
    let mut put = |off: usize, v: &[u8]| b[off..off + v.len()].copy_from_slice(v);
    put(offset::LIMIT, &limit.to_ne_bytes());
    put(offset::SM_LIMIT, &cores.to_ne_bytes());
    put(
        offset::PROCS + slot::USED + slot::MEM_TOTAL,
        &used.to_ne_bytes(),
    );
    // As the shim initialises it: limited, and active for one period.
    put(offset::UTILIZATION_SWITCH, &1i32.to_ne_bytes());
    put(offset::RECENT_KERNEL, &2i32.to_ne_bytes());
    put(offset::PRIORITY, &1i32.to_ne_bytes());
    b
}

/// A region's `(recent_kernel, utilization_switch)`.
fn feedback_words(path: &Path) -> (i32, i32) {
    let r = vgpu_region::RegionSnapshot::parse(&std::fs::read(path).unwrap()).unwrap();
    (r.recent_kernel, r.utilization_switch)
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

fn spec_env(root: &Path, uid: &str) -> Vec<String> {
    let spec: cdi::Spec =
        serde_json::from_slice(&std::fs::read(cdi::spec_path(&root.join("cdi"), uid)).unwrap())
            .unwrap();
    spec.devices[0].container_edits.env.clone()
}

#[tokio::test]
async fn the_kubelet_registers_the_driver_and_prepares_each_claim_with_its_own_share() {
    let root = tempfile::tempdir().unwrap();
    let claims = Claims::default();
    let plugin = start(root.path(), &claims);

    // Registration, as the kubelet's plugin watcher does it.
    let ch = dial(
        &root
            .path()
            .join("plugins_registry/gpu.tessera.dev-reg.sock"),
    )
    .await;
    let mut registration = reg::registration_client::RegistrationClient::new(ch);
    let info = registration
        .get_info(reg::InfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.r#type, "DRAPlugin");
    assert_eq!(info.name, "gpu.tessera.dev");
    assert_eq!(info.supported_versions, ["v1.DRAPlugin"]);
    assert!(info.endpoint.ends_with("plugins/gpu.tessera.dev/dra.sock"));
    assert!(
        !plugin.driver.readiness().is_ready(),
        "ready before the kubelet registered the driver"
    );
    registration
        .notify_registration_status(reg::RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        })
        .await
        .unwrap();
    assert!(plugin.driver.readiness().is_ready());

    // A heterogeneous burst onto one node: twenty claims of twenty sizes on two GPUs, prepared
    // concurrently (one call per pod, as the kubelet makes them).
    for i in 0..20u32 {
        claims.add(
            &format!("c{i}"),
            &format!("uid-{i}"),
            &format!("gpu-{}", i % 2),
            &format!("{}Mi", 100 + i),
            &(i + 1).to_string(),
        );
    }
    let ch = dial(Path::new(&info.endpoint)).await;
    let calls = (0..20u32).map(|i| {
        let mut client = dra::dra_plugin_client::DraPluginClient::new(ch.clone());
        async move {
            client
                .node_prepare_resources(dra::NodePrepareResourcesRequest {
                    claims: vec![claim(&format!("c{i}"), &format!("uid-{i}"))],
                })
                .await
                .unwrap()
                .into_inner()
        }
    });
    let answers = futures::future::join_all(calls).await;
    for (i, answer) in answers.iter().enumerate() {
        let uid = format!("uid-{i}");
        let entry = &answer.claims[&uid];
        assert_eq!(entry.error, "");
        assert_eq!(entry.devices.len(), 1);
        assert_eq!(entry.devices[0].device_name, format!("gpu-{}", i % 2));
        assert_eq!(entry.devices[0].pool_name, NODE);
        assert_eq!(entry.devices[0].request_names, ["gpu"]);
        assert_eq!(
            entry.devices[0].cdi_device_ids,
            [format!("tessera.dev/gpu-claim={uid}")]
        );
        let env = spec_env(root.path(), &uid);
        assert!(env.contains(&format!("NVIDIA_VISIBLE_DEVICES=GPU-{}", i % 2)));
        assert!(env.contains(&format!("CUDA_DEVICE_MEMORY_LIMIT_0={}m", 100 + i)));
        assert!(env.contains(&format!("CUDA_DEVICE_SM_LIMIT={}", i + 1)));
    }

    // Every claim of a call gets an entry; a bad one says why and the others still work.
    claims.add("too-big", "uid-big", "gpu-0", "16Gi", "10");
    let mut client = dra::dra_plugin_client::DraPluginClient::new(ch.clone());
    let answer = client
        .node_prepare_resources(dra::NodePrepareResourcesRequest {
            claims: vec![
                claim("too-big", "uid-big"),
                claim("missing", "uid-missing"),
                claim("c0", "uid-0"),
                claim("c1", "uid-stale"),
            ],
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        answer.claims["uid-big"].error.contains("outside"),
        "{answer:?}"
    );
    assert!(answer.claims["uid-missing"].error.contains("not found"));
    assert!(answer.claims["uid-stale"].error.contains("UID"));
    assert_eq!(answer.claims["uid-0"].error, "");
    assert!(!cdi::spec_path(&root.path().join("cdi"), "uid-big").exists());

    // Unprepare removes the spec and the claim's directory; twice is fine.
    for _ in 0..2 {
        let answer = client
            .node_unprepare_resources(dra::NodeUnprepareResourcesRequest {
                claims: vec![claim("c3", "uid-3")],
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(answer.claims["uid-3"].error, "");
    }
    assert!(!cdi::spec_path(&root.path().join("cdi"), "uid-3").exists());
    assert!(!root.path().join("hook/vgpu/claims/uid-3").exists());

    // What an operator sees on /metrics: 21 good prepares (20 claims and c0 again), 3 refused,
    // one unprepare (the second was of a claim no longer prepared), 19 claims prepared now.
    let metrics = plugin.driver.metrics().encode();
    for line in [
        r#"tessera_dra_plugin_prepares_total{result="success"} 21"#,
        r#"tessera_dra_plugin_prepares_total{result="failure"} 3"#,
        r#"tessera_dra_plugin_unprepares_total{result="success"} 1"#,
        "tessera_dra_plugin_prepared_claims 19",
        "tessera_dra_plugin_kubelet_registrations_total 1",
    ] {
        assert!(metrics.contains(line), "{line} missing from:\n{metrics}");
    }

    // Each claim's usage, from the shim's region in the claim's directory (shared by every
    // container using the claim), labelled with the claim: c0's process uses 64 MiB of its
    // 100 MiB on GPU-0. A directory's junk is skipped, never fatal.
    std::fs::write(
        root.path().join("hook/vgpu/claims/uid-0/shim.cache"),
        region("GPU-0", 100 << 20, 1, 64 << 20),
    )
    .unwrap();
    std::fs::write(root.path().join("hook/vgpu/claims/uid-1/junk.cache"), b"x").unwrap();
    plugin.driver.record_usage().await;
    let metrics = plugin.driver.metrics().encode();
    let labels = r#"{namespace="ml",claim="c0",vdevice_index="0",device_uuid="GPU-0"}"#;
    for line in [
        format!("tessera_dra_claim_memory_used_bytes{labels} 67108864.0"),
        format!("tessera_dra_claim_memory_limit_bytes{labels} 104857600.0"),
        format!("tessera_dra_claim_sm_limit_percent{labels} 1.0"),
    ] {
        assert!(metrics.contains(&line), "{line} missing from:\n{metrics}");
    }
    assert!(!metrics.contains(r#"claim="c1""#), "{metrics}");

    // The vGPU monitor's feedback over the claims' regions. c0 alone on GPU-0: its core limit
    // is lifted (HAMi's default policy). A region of c1 (allocated GPU-1) naming GPU-0 does not
    // count there: a claim cannot put another claim's limit back on.
    let clock = || vgpu_region::feedback::FeedbackClock {
        now_secs: now_secs(),
        period_secs: 5,
    };
    let c0 = root.path().join("hook/vgpu/claims/uid-0/shim.cache");
    std::fs::write(
        root.path().join("hook/vgpu/claims/uid-1/shim.cache"),
        region("GPU-0", 100 << 20, 2, 0),
    )
    .unwrap();
    plugin.driver.feedback(clock()).await;
    assert_eq!(feedback_words(&c0), (1, 0), "c0 alone is not limited");
    // c2 starts on GPU-0 too: both limits are on from the next period.
    let c2 = root.path().join("hook/vgpu/claims/uid-2/shim.cache");
    let mut launching = std::fs::read(&c0).unwrap();
    launching[vgpu_region::offset::LAST_KERNEL_TIME..][..8]
        .copy_from_slice(&now_secs().to_ne_bytes());
    std::fs::write(&c0, launching).unwrap();
    std::fs::write(&c2, region("GPU-0", 102 << 20, 3, 0)).unwrap();
    plugin.driver.feedback(clock()).await;
    assert_eq!(feedback_words(&c0).1, 1, "c0 shares GPU-0 and is limited");
    assert_eq!(
        feedback_words(&c2),
        (1, 1),
        "c2 shares GPU-0 and is limited"
    );
    plugin.stop().await;
    assert!(
        !root
            .path()
            .join("plugins_registry/gpu.tessera.dev-reg.sock")
            .exists()
    );

    // A restarted plugin answers from what it prepared, even if the API server now says
    // otherwise, and cleans up after claims that are gone.
    claims.add("c4", "uid-4", "gpu-1", "9Gi", "90");
    claims.remove("c5");
    let plugin = start(root.path(), &claims);
    assert_eq!(plugin.driver.prepared_uids().await.len(), 19);
    let ch = dial(&root.path().join("plugins/gpu.tessera.dev/dra.sock")).await;
    let mut client = dra::dra_plugin_client::DraPluginClient::new(ch);
    let answer = client
        .node_prepare_resources(dra::NodePrepareResourcesRequest {
            claims: vec![claim("c4", "uid-4")],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.claims["uid-4"].error, "");
    assert!(spec_env(root.path(), "uid-4").contains(&"CUDA_DEVICE_MEMORY_LIMIT_0=104m".to_owned()));
    let removed = plugin.driver.remove_stale().await;
    assert_eq!(removed, ["uid-5"]);
    assert!(!cdi::spec_path(&root.path().join("cdi"), "uid-5").exists());
    plugin.stop().await;
}

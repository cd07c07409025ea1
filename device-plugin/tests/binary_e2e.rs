//! The real binary end to end on one machine: fake NVML, the fake kubelet, an unreachable
//! apiserver (the plugin must still serve the kubelet), registration, ListAndWatch, and SIGTERM
//! removing the socket.

mod support;

use std::process::{Command, Stdio};
use std::time::Duration;

use kubelet_proto::deviceplugin::v1beta1 as dp;
use support::kubelet_harness::FakeKubelet;

#[tokio::test]
async fn binary_registers_streams_and_cleans_up_on_sigterm() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lib = nvidia_ml::locate::install_as_soname(dir.path()).expect("fake NVML built");
    let scenario = dir.path().join("scenario.json");
    std::fs::write(
        &scenario,
        r#"{"devices":[{"uuid":"GPU-aaaa","name":"Tesla T4","memory_total_mib":15360},
                       {"uuid":"GPU-bbbb","name":"Tesla T4","memory_total_mib":15360}]}"#,
    )
    .expect("scenario");
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        "apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: \"http://127.0.0.1:9\"}}]\n\
         users: [{name: u, user: {}}]\ncontexts: [{name: x, context: {cluster: c, user: u}}]\ncurrent-context: x\n",
    )
    .expect("kubeconfig");
    let mut kubelet = FakeKubelet::start(dir.path(), true).await;
    let mut child = Command::new(env!("CARGO_BIN_EXE_tessera-device-plugin"))
        .args(["--node-name", "node-a", "--metrics-addr", "127.0.0.1:0"])
        .arg("--nvml-lib")
        .arg(&lib)
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .arg("--config-file")
        .arg(dir.path().join("absent.yaml"))
        .arg("--socket-dir")
        .arg(&kubelet.device_plugin_dir)
        .arg("--pod-resources-socket")
        .arg(&kubelet.pod_resources_socket)
        .arg("--hook-path")
        .arg(dir.path().join("hook"))
        .env("FAKE_NVML_SCENARIO", &scenario)
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");

    let reg = kubelet
        .next_registration(Duration::from_secs(20))
        .await
        .expect("the binary registers without an apiserver");
    assert_eq!(
        (reg.endpoint.as_str(), reg.resource_name.as_str()),
        ("nvidia-gpu.sock", "nvidia.com/gpu")
    );
    let mut client = kubelet.plugin(&reg.endpoint).await;
    let mut stream = client
        .list_and_watch(dp::Empty {})
        .await
        .expect("stream")
        .into_inner();
    let list = stream.message().await.expect("ok").expect("list");
    assert_eq!(list.devices.len(), 20, "2 GPUs x deviceSplitCount 10");
    // No pod can be identified (no apiserver): a clear, bounded refusal.
    let started = tokio::time::Instant::now();
    let err = client
        .allocate(dp::AllocateRequest {
            container_requests: vec![dp::ContainerAllocateRequest {
                devices_ids: vec!["GPU-aaaa-0".into()],
            }],
        })
        .await
        .expect_err("nothing to serve");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    assert!(err.message().starts_with("tessera:"), "{}", err.message());

    let socket = kubelet.device_plugin_dir.join("nvidia-gpu.sock");
    assert!(socket.exists());
    let status = Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .status()
        .expect("kill");
    assert!(status.success());
    let exit = tokio::task::spawn_blocking(move || child.wait())
        .await
        .expect("join")
        .expect("wait");
    assert!(exit.success(), "clean exit on SIGTERM: {exit:?}");
    assert!(!socket.exists(), "socket removed on SIGTERM");
}

//! One simulated GPU node: a real `Node` object, the real `tessera-device-plugin` binary on a
//! fake NVML scenario, and a harness kubelet that speaks the v1beta1 device plugin protocol to it
//! over real unix sockets and admits the pods kube-scheduler binds to the node.
//!
//! The harness kubelet does what the kubelet's device manager does around admission, and no
//! more: it follows `ListAndWatch` into the node's `nvidia.com/gpu` capacity, admits bound pods
//! one at a time (kubelet admission is serialized) in the order its watch sees them bound, calls
//! `GetPreferredAllocation` and `Allocate` once per GPU container in container order (a later
//! container takes the init containers' devices first, as `devicesToReuse` does), reports the pod
//! under admission and admitted pods through pod-resources `List` (app and sidecar containers,
//! never regular init containers), rejects a pod whose `Allocate` fails
//! (`UnexpectedAdmissionError`, as the kubelet does), and finishes deletions (there is no
//! container to stop, so a deleted pod is removed at once). `e2e/tests/kubelet_parity.rs` runs one
//! burst on it and on a real kubelet and compares the two. What it still does not do: re-admit
//! pods after a restart (the real kubelet does, and may ask again for served containers), and
//! run containers.
//! Containers are not run; a test runs a process under the returned environment itself
//! ([`crate::cluster::Cluster::run_container`]).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::{WatchStreamExt, watcher};
use kubelet_harness::FakeKubelet;
use kubelet_proto::deviceplugin::v1beta1 as dp;
use kubelet_proto::deviceplugin::v1beta1::device_plugin_client::DevicePluginClient;
use serde_json::json;
use tokio::sync::mpsc;
use tonic::transport::Channel;

use crate::process::Proc;
use crate::{Error, Result};

pub const GPU_RESOURCE: &str = "nvidia.com/gpu";

/// One simulated GPU.
#[derive(Debug, Clone)]
pub struct GpuSpec {
    pub uuid: String,
    pub model: String,
    pub memory_mib: u64,
}

#[derive(Debug, Clone)]
pub struct NodeSpec {
    pub name: String,
    pub gpus: Vec<GpuSpec>,
    /// `nvidia.deviceSplitCount` in the plugin's device-config.yaml (chart default 10).
    pub split_count: Option<u32>,
    /// A whole fake NVML scenario (topology and all) instead of the one built from `gpus`.
    pub scenario: Option<String>,
    /// Extra flags for this node's `tessera-device-plugin`.
    pub plugin_args: Vec<String>,
    /// More of the plugin's `device-config.yaml` under `nvidia:` (indented YAML lines).
    pub device_config: Option<String>,
    /// The plugin's per-node `config.json` (e.g. `operatingmode: mig`).
    pub node_config: Option<String>,
}

impl NodeSpec {
    /// `count` identical GPUs with UUIDs derived from the node name.
    pub fn uniform(name: &str, count: usize, model: &str, memory_mib: u64) -> NodeSpec {
        let tag: u32 = name
            .bytes()
            .fold(0u32, |h, b| h.wrapping_mul(31).wrapping_add(u32::from(b)));
        NodeSpec {
            name: name.to_owned(),
            gpus: (0..count)
                .map(|i| GpuSpec {
                    uuid: format!("GPU-{tag:08x}-0000-4000-8000-{i:012x}"),
                    model: model.to_owned(),
                    memory_mib,
                })
                .collect(),
            split_count: None,
            scenario: None,
            plugin_args: Vec::new(),
            device_config: None,
            node_config: None,
        }
    }

    /// A node whose fake NVML plays `scenario` (a scenario file's JSON, e.g.
    /// `examples/device-plugin/fake-nvml-dgx1-nvlink.json`); its GPUs are the scenario's devices.
    pub fn from_scenario(name: &str, scenario: &str) -> Result<NodeSpec> {
        let parsed: serde_json::Value = serde_json::from_str(scenario)
            .map_err(|e| Error::msg(format!("scenario for {name}: {e}")))?;
        let gpus = parsed["devices"]
            .as_array()
            .map(|devices| {
                devices
                    .iter()
                    .map(|d| GpuSpec {
                        uuid: d["uuid"].as_str().unwrap_or_default().to_owned(),
                        model: d["name"].as_str().unwrap_or_default().to_owned(),
                        memory_mib: d["memory_total_mib"].as_u64().unwrap_or_default(),
                    })
                    .collect()
            })
            .unwrap_or_default();
        Ok(NodeSpec {
            name: name.to_owned(),
            gpus,
            split_count: None,
            scenario: Some(scenario.to_owned()),
            plugin_args: Vec::new(),
            device_config: None,
            node_config: None,
        })
    }

    pub fn with_plugin_args(mut self, args: &[&str]) -> NodeSpec {
        self.plugin_args = args.iter().map(|a| (*a).to_owned()).collect();
        self
    }

    /// Adds `yaml` (lines indented under `nvidia:`) to the plugin's `device-config.yaml`.
    pub fn with_device_config(mut self, yaml: &str) -> NodeSpec {
        self.device_config = Some(yaml.to_owned());
        self
    }

    /// Gives the plugin a per-node `config.json`.
    pub fn with_node_config(mut self, json: &str) -> NodeSpec {
        self.node_config = Some(json.to_owned());
        self
    }

    pub fn with_split_count(mut self, n: u32) -> NodeSpec {
        self.split_count = Some(n);
        self
    }

    /// The fake NVML scenario file's content for this node's GPUs.
    pub fn scenario_json(&self) -> String {
        if let Some(s) = &self.scenario {
            return s.clone();
        }
        let devices: Vec<_> = self
            .gpus
            .iter()
            .enumerate()
            .map(|(i, g)| {
                json!({
                    "uuid": g.uuid, "name": g.model, "memory_total_mib": g.memory_mib,
                    "pci_bus_id": format!("00000000:{:02X}:00.0", 0x10 + i),
                })
            })
            .collect();
        json!({ "devices": devices }).to_string()
    }
}

/// What the harness kubelet did with one container.
#[derive(Debug, Clone)]
pub struct AdmittedContainer {
    pub name: String,
    pub device_ids: Vec<String>,
    pub response: dp::ContainerAllocateResponse,
}

#[derive(Debug, Clone)]
pub struct Admitted {
    pub namespace: String,
    pub name: String,
    pub containers: Vec<AdmittedContainer>,
}

/// The harness kubelet's view of its node, shared with the test.
#[derive(Debug, Default)]
pub struct NodeState {
    /// Device IDs from the last `ListAndWatch` message, with health.
    pub devices: Vec<(String, bool)>,
    /// Pods admitted and not yet gone, by UID.
    pub admitted: BTreeMap<String, Admitted>,
    /// Pods whose `Allocate` failed, by UID, with the plugin's message.
    pub rejected: BTreeMap<String, String>,
    /// `Register` calls received.
    pub registrations: usize,
    /// `Allocate` calls made.
    pub allocate_calls: usize,
    /// The order in which the node's watch saw each pod (by UID) bound to it: the kubelet admits
    /// in watch order, not creation order.
    pub bound_order: BTreeMap<String, u64>,
}

impl NodeState {
    /// Notes a pod seen bound to the node; true the first time.
    fn note_bound(&mut self, uid: &str) -> bool {
        if self.bound_order.contains_key(uid) {
            return false;
        }
        let next = self.bound_order.len() as u64;
        self.bound_order.insert(uid.to_owned(), next);
        true
    }
}

#[derive(Debug)]
enum KubeletCommand {
    Restart,
}

/// A running node. Dropping it stops the plugin and the harness kubelet.
#[derive(Debug)]
pub struct GpuNode {
    pub spec: NodeSpec,
    pub dir: PathBuf,
    /// Append JSON lines here to script NVML events (`{"device":0,"kind":"xid","xid":48}`).
    pub events_file: PathBuf,
    pub state: Arc<Mutex<NodeState>>,
    plugin: Proc,
    /// How the plugin was started, to start it again ([`GpuNode::restart_plugin`]).
    plugin_launch: PluginLaunch,
    commands: mpsc::UnboundedSender<KubeletCommand>,
    task: tokio::task::JoinHandle<()>,
}

/// A plugin command line, kept to start the same plugin again.
#[derive(Debug, Clone)]
struct PluginLaunch {
    program: std::ffi::OsString,
    args: Vec<std::ffi::OsString>,
    envs: Vec<(std::ffi::OsString, std::ffi::OsString)>,
    log_dir: PathBuf,
}

impl PluginLaunch {
    fn of(cmd: &Command, log_dir: &Path) -> PluginLaunch {
        PluginLaunch {
            program: cmd.get_program().to_owned(),
            args: cmd.get_args().map(ToOwned::to_owned).collect(),
            envs: cmd
                .get_envs()
                .filter_map(|(k, v)| Some((k.to_owned(), v?.to_owned())))
                .collect(),
            log_dir: log_dir.to_path_buf(),
        }
    }

    fn command(&self) -> Command {
        let mut cmd = Command::new(&self.program);
        cmd.args(&self.args)
            .envs(self.envs.iter().map(|(k, v)| (k, v)));
        cmd
    }
}

impl Drop for GpuNode {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What a node needs from its cluster to start.
#[derive(Clone)]
pub struct NodeEnv {
    pub client: kube::Client,
    pub kubeconfig: PathBuf,
    pub plugin_binary: PathBuf,
    pub nvml_lib: PathBuf,
    pub shim: PathBuf,
    pub log_dir: PathBuf,
}

impl std::fmt::Debug for NodeEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeEnv")
            .field("kubeconfig", &self.kubeconfig)
            .finish_non_exhaustive()
    }
}

impl GpuNode {
    /// `dir` holds the node's files and logs; `socket_dir` (short: unix socket paths are limited
    /// to 107 bytes) holds the kubelet's and the plugin's sockets.
    pub async fn start(
        spec: NodeSpec,
        env: &NodeEnv,
        dir: &Path,
        socket_dir: &Path,
    ) -> Result<GpuNode> {
        std::fs::create_dir_all(dir)?;
        create_node_object(&env.client, &spec.name).await?;
        let kubelet = FakeKubelet::start(socket_dir, true).await;
        let (mut cmd, events_file) = device_plugin_command(&spec, env, dir, &kubelet)?;
        cmd.args(["--health-recovery-seconds", "3"]);
        let plugin_launch = PluginLaunch::of(&cmd, &env.log_dir);
        let plugin = Proc::spawn(
            &format!("device-plugin-{}", spec.name),
            &env.log_dir,
            &mut cmd,
        )?;

        let state = Arc::new(Mutex::new(NodeState::default()));
        let (tx, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(kubelet_loop(
            spec.name.clone(),
            env.client.clone(),
            kubelet,
            state.clone(),
            rx,
        ));
        Ok(GpuNode {
            spec,
            dir: dir.to_path_buf(),
            events_file,
            state,
            plugin,
            plugin_launch,
            commands: tx,
            task,
        })
    }

    pub fn name(&self) -> &str {
        &self.spec.name
    }

    /// A kubelet restart: every socket in the device-plugin directory is deleted and
    /// `kubelet.sock` comes back; the plugin must register again.
    pub fn restart_kubelet(&self) {
        let _ = self.commands.send(KubeletCommand::Restart);
    }

    /// Kills the device plugin (SIGKILL, as a crashed or evicted plugin pod) and starts it again
    /// with the same command line; it registers with the kubelet again.
    pub fn restart_plugin(&mut self) -> Result<()> {
        self.plugin.kill();
        let mut cmd = self.plugin_launch.command();
        self.plugin = Proc::spawn(
            &format!("device-plugin-{}", self.spec.name),
            &self.plugin_launch.log_dir,
            &mut cmd,
        )?;
        Ok(())
    }

    /// Appends one NVML event line for the fake NVML of this node.
    pub fn nvml_event(&self, line: serde_json::Value) -> Result<()> {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&self.events_file)?;
        writeln!(f, "{line}")?;
        Ok(())
    }

    /// The plugin's whole log file.
    pub fn plugin_log_path(&self) -> &Path {
        &self.plugin.log
    }

    pub fn plugin_log(&self) -> String {
        self.plugin.tail(40)
    }

    pub fn plugin_running(&mut self) -> bool {
        self.plugin.is_running()
    }

    pub fn admitted(&self) -> BTreeMap<String, Admitted> {
        self.state
            .lock()
            .map(|s| s.admitted.clone())
            .unwrap_or_default()
    }

    pub fn rejected(&self) -> BTreeMap<String, String> {
        self.state
            .lock()
            .map(|s| s.rejected.clone())
            .unwrap_or_default()
    }

    pub fn registrations(&self) -> usize {
        self.state.lock().map(|s| s.registrations).unwrap_or(0)
    }
}

/// A node without a device plugin or harness kubelet: the `Node` object, Ready and untainted,
/// with the register annotation a plugin would publish for `spec` (chart defaults: split 10, no
/// scaling), and `nvidia.com/gpu` capacity. Pods bound to it are never admitted. For scale runs,
/// where hundreds of plugin processes would measure the harness rather than the scheduler.
pub async fn register_bare_node(client: &kube::Client, spec: &NodeSpec) -> Result<()> {
    create_node_object(client, &spec.name).await?;
    let split = spec.split_count.unwrap_or(10);
    let devices: Vec<hami_contract::node::NodeDevice> = spec
        .gpus
        .iter()
        .enumerate()
        .map(|(i, g)| hami_contract::node::NodeDevice {
            id: g.uuid.clone(),
            index: u32::try_from(i).unwrap_or(0),
            count: split,
            devmem: u32::try_from(g.memory_mib).unwrap_or(u32::MAX),
            devcore: 100,
            device_type: hami_contract::node::model_type_name(&g.model),
            mode: "hami-core".to_owned(),
            health: true,
            ..Default::default()
        })
        .collect();
    let value = hami_contract::node::encode_node_devices(&devices);
    let nodes: Api<Node> = Api::all(client.clone());
    nodes
        .patch(
            &spec.name,
            &PatchParams::default(),
            &Patch::Merge(&json!({"metadata": {"annotations": {
                hami_contract::annotations::NODE_REGISTER: value}}})),
        )
        .await?;
    let slots = spec.gpus.len() * split as usize;
    patch_node_capacity(client, &spec.name, Some((slots, slots))).await
}

/// Lays out a node's files as a real node has them (NVML scenario and events for the fake
/// NVML, `<hook>/vgpu/libvgpu.so` and `ld.so.preload`, the device config) under `dir`, and returns
/// the `tessera-device-plugin` command line over them and `kubelet`'s sockets, with the events
/// file to append NVML events to.
pub fn device_plugin_command(
    spec: &NodeSpec,
    env: &NodeEnv,
    dir: &Path,
    kubelet: &FakeKubelet,
) -> Result<(Command, PathBuf)> {
    std::fs::create_dir_all(dir)?;
    let scenario = dir.join("nvml-scenario.json");
    std::fs::write(&scenario, spec.scenario_json())?;
    let events_file = dir.join("nvml-events.jsonl");
    std::fs::write(&events_file, "")?;
    // HOOK_PATH layout as on a real node: <hook>/vgpu/libvgpu.so.
    let hook = dir.join("hook");
    std::fs::create_dir_all(hook.join("vgpu"))?;
    let shim_link = hook.join("vgpu/libvgpu.so");
    let _ = std::fs::remove_file(&shim_link);
    std::os::unix::fs::symlink(&env.shim, &shim_link)?;
    std::fs::write(
        hook.join("vgpu/ld.so.preload"),
        "/usr/local/vgpu/libvgpu.so\n",
    )?;

    let device_config = dir.join("device-config.yaml");
    let mut nvidia = String::new();
    if let Some(n) = spec.split_count {
        nvidia.push_str(&format!("  deviceSplitCount: {n}\n"));
    }
    if let Some(extra) = &spec.device_config {
        nvidia.push_str(extra);
        if !extra.ends_with('\n') {
            nvidia.push('\n');
        }
    }
    if nvidia.is_empty() {
        let _ = std::fs::remove_file(&device_config);
    } else {
        std::fs::write(&device_config, format!("nvidia:\n{nvidia}"))?;
    }
    let node_config = dir.join("node-config.json");
    match &spec.node_config {
        Some(json) => std::fs::write(&node_config, json)?,
        None => {
            let _ = std::fs::remove_file(&node_config);
        }
    }
    let mut cmd = Command::new(&env.plugin_binary);
    cmd.arg("--node-name")
        .arg(&spec.name)
        .arg("--kubeconfig")
        .arg(&env.kubeconfig)
        .arg("--config-file")
        .arg(&device_config)
        .arg("--node-config")
        .arg(&node_config)
        .arg("--socket-dir")
        .arg(&kubelet.device_plugin_dir)
        .arg("--pod-resources-socket")
        .arg(&kubelet.pod_resources_socket)
        .arg("--hook-path")
        .arg(&hook)
        .arg("--nvml-lib")
        .arg(&env.nvml_lib)
        .arg("--sysfs-root")
        .arg(dir.join("sys"))
        .args(["--metrics-addr", "127.0.0.1:0"])
        .args(&spec.plugin_args)
        .env("FAKE_NVML_SCENARIO", &scenario)
        .env("FAKE_NVML_EVENTS", &events_file)
        // MIG instances outlive a plugin restart, as on a real GPU.
        .env("FAKE_NVML_MIG_STATE", dir.join("nvml-mig-state.json"))
        .env("RUST_LOG", "info");
    Ok((cmd, events_file))
}

async fn create_node_object(client: &kube::Client, name: &str) -> Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    let node: Node = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {
            "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "gpu": "on"}},
    }))?;
    match nodes.create(&PostParams::default(), &node).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => return Err(e.into()),
    }
    patch_node_capacity(client, name, None).await?;
    // The API server's TaintNodesByCondition admission creates the node with the not-ready taint;
    // kube-controller-manager's node lifecycle controller would lift it once the node reports
    // Ready. There is no controller-manager here, so the harness does that part too.
    nodes
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"taints": null}})),
        )
        .await?;
    Ok(())
}

/// The kubelet release whose pod-resources semantics the harness kubelet follows.
pub const HARNESS_KUBELET_VERSION: &str = "v1.34.4";

/// What a kubelet reports: plenty of CPU, memory and pod slots, and the plugin's device count.
async fn patch_node_capacity(
    client: &kube::Client,
    name: &str,
    gpus: Option<(usize, usize)>,
) -> Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    let mut capacity = json!({"cpu": "64", "memory": "256Gi", "pods": "1000"});
    let mut allocatable = capacity.clone();
    if let Some((total, healthy)) = gpus {
        capacity[GPU_RESOURCE] = json!(total.to_string());
        allocatable[GPU_RESOURCE] = json!(healthy.to_string());
    }
    // The harness kubelet answers pod-resources as a 1.34 kubelet does (only active pods), and
    // says so: the plugin reads that version to decide how it may identify pods.
    let patch = json!({"status": {
        "capacity": capacity, "allocatable": allocatable,
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                        "message": "tessera e2e harness kubelet"}],
        "nodeInfo": {
            "machineID": name, "systemUUID": name, "bootID": "harness",
            "kernelVersion": "harness", "osImage": "tessera e2e harness",
            "containerRuntimeVersion": "harness://0", "kubeletVersion": HARNESS_KUBELET_VERSION,
            "kubeProxyVersion": "", "operatingSystem": "linux", "architecture": "amd64",
        },
    }});
    nodes
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(())
}

async fn next_list(
    stream: &mut Option<tonic::Streaming<dp::ListAndWatchResponse>>,
) -> Option<Result<dp::ListAndWatchResponse>> {
    match stream {
        Some(s) => match s.message().await {
            Ok(Some(m)) => Some(Ok(m)),
            Ok(None) => None,
            Err(e) => Some(Err(Error::msg(format!("ListAndWatch: {e}")))),
        },
        None => std::future::pending().await,
    }
}

struct Plugin {
    client: DevicePluginClient<Channel>,
    preferred: bool,
}

async fn kubelet_loop(
    node: String,
    client: kube::Client,
    mut kubelet: FakeKubelet,
    state: Arc<Mutex<NodeState>>,
    mut commands: mpsc::UnboundedReceiver<KubeletCommand>,
) {
    let mut plugin: Option<Plugin> = None;
    let mut stream: Option<tonic::Streaming<dp::ListAndWatchResponse>> = None;
    let mut tick = tokio::time::interval(Duration::from_millis(150));
    // The kubelet's pod source: a watch on the pods bound to this node, admitted as they arrive,
    // and the pods it has shown (no LIST per admission: a burst on many nodes would load the API
    // server with the harness's own reads).
    let mut pods: BTreeMap<String, Pod> = BTreeMap::new();
    let mut relist: Option<BTreeMap<String, Pod>> = None;
    let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
    let mut bound = watcher(Api::<Pod>::all(client.clone()), config)
        .default_backoff()
        .boxed();
    loop {
        tokio::select! {
            event = bound.next() => {
                let uid_of = |p: &Pod| p.metadata.uid.clone().unwrap_or_default();
                let pod = match event {
                    Some(Ok(watcher::Event::Apply(p))) => {
                        pods.insert(uid_of(&p), p.clone());
                        p
                    }
                    Some(Ok(watcher::Event::InitApply(p))) => {
                        relist.get_or_insert_with(BTreeMap::new).insert(uid_of(&p), p.clone());
                        p
                    }
                    Some(Ok(watcher::Event::Delete(p))) => {
                        pods.remove(&uid_of(&p));
                        continue;
                    }
                    Some(Ok(watcher::Event::Init)) => {
                        relist = Some(BTreeMap::new());
                        continue;
                    }
                    Some(Ok(watcher::Event::InitDone)) => {
                        pods = relist.take().unwrap_or_default();
                        continue;
                    }
                    Some(Err(e)) => {
                        tracing::debug!(%node, error = %e, "pod watch");
                        continue;
                    }
                    None => return,
                };
                let uid = uid_of(&pod);
                let new = state.lock().map(|mut s| s.note_bound(&uid)).unwrap_or(false);
                if new
                    && let Some(p) = plugin.as_mut()
                    && let Err(e) = sync_pods(&client, &kubelet, p, &state, &pods).await
                {
                    tracing::debug!(%node, error = %e, "pod sync");
                }
            }
            reg = kubelet.registrations.recv() => {
                let Some(reg) = reg else { return };
                if let Ok(mut s) = state.lock() {
                    s.registrations += 1;
                }
                let mut c = kubelet.plugin(&reg.endpoint).await;
                let preferred = reg.options.as_ref().is_some_and(|o| o.get_preferred_allocation_available);
                match c.list_and_watch(dp::Empty {}).await {
                    Ok(s) => stream = Some(s.into_inner()),
                    Err(e) => tracing::warn!(%node, error = %e, "ListAndWatch failed"),
                }
                plugin = Some(Plugin { client: c, preferred });
            }
            msg = next_list(&mut stream) => {
                match msg {
                    Some(Ok(list)) => {
                        let devices: Vec<(String, bool)> = list.devices.iter()
                            .map(|d| (d.id.clone(), d.health == dp::HEALTHY)).collect();
                        let total = devices.len();
                        let healthy = devices.iter().filter(|d| d.1).count();
                        if let Ok(mut s) = state.lock() {
                            s.devices = devices;
                        }
                        if let Err(e) = patch_node_capacity(&client, &node, Some((total, healthy))).await {
                            tracing::warn!(%node, error = %e, "node capacity patch failed");
                        }
                    }
                    Some(Err(e)) => {
                        tracing::warn!(%node, error = %e, "ListAndWatch ended");
                        stream = None;
                    }
                    None => stream = None,
                }
            }
            cmd = commands.recv() => {
                match cmd {
                    Some(KubeletCommand::Restart) => {
                        plugin = None;
                        stream = None;
                        kubelet.restart().await;
                    }
                    None => return,
                }
            }
            _ = tick.tick() => {
                if let Some(p) = plugin.as_mut()
                    && let Err(e) = sync_pods(&client, &kubelet, p, &state, &pods).await {
                    tracing::debug!(%node, error = %e, "pod sync");
                }
            }
        }
    }
}

fn gpu_count(c: &k8s_openapi::api::core::v1::Container) -> usize {
    let r = c.resources.as_ref();
    let q = r
        .and_then(|r| r.limits.as_ref())
        .and_then(|l| l.get(GPU_RESOURCE))
        .or_else(|| {
            r.and_then(|r| r.requests.as_ref())
                .and_then(|l| l.get(GPU_RESOURCE))
        });
    q.and_then(|q| q.0.parse::<usize>().ok()).unwrap_or(0)
}

async fn sync_pods(
    client: &kube::Client,
    kubelet: &FakeKubelet,
    plugin: &mut Plugin,
    state: &Arc<Mutex<NodeState>>,
    pods: &BTreeMap<String, Pod>,
) -> Result<()> {
    let live: BTreeSet<String> = pods.keys().cloned().collect();
    {
        let mut s = state
            .lock()
            .map_err(|_| Error::msg("node state poisoned"))?;
        let gone: Vec<String> = s
            .admitted
            .keys()
            .filter(|u| !live.contains(*u))
            .cloned()
            .collect();
        for uid in gone {
            if let Some(a) = s.admitted.remove(&uid) {
                kubelet.pod_resources.remove(&a.namespace, &a.name);
            }
        }
    }
    let mut fresh = Vec::new();
    for pod in pods.values() {
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let ns = pod.metadata.namespace.clone().unwrap_or_default();
        let name = pod.metadata.name.clone().unwrap_or_default();
        if pod.metadata.deletion_timestamp.is_some() {
            // Nothing runs, so the "containers" stop at once: release and finish the deletion.
            if let Ok(mut s) = state.lock()
                && let Some(a) = s.admitted.remove(&uid)
            {
                kubelet.pod_resources.remove(&a.namespace, &a.name);
            }
            let dp = DeleteParams {
                grace_period_seconds: Some(0),
                preconditions: Some(Preconditions {
                    uid: Some(uid.clone()),
                    resource_version: None,
                }),
                ..Default::default()
            };
            let _ = Api::<Pod>::namespaced(client.clone(), &ns)
                .delete(&name, &dp)
                .await;
            continue;
        }
        let phase = pod
            .status
            .as_ref()
            .and_then(|s| s.phase.clone())
            .unwrap_or_default();
        let known = state
            .lock()
            .map(|s| s.admitted.contains_key(&uid) || s.rejected.contains_key(&uid))
            .unwrap_or(true);
        if known || phase == "Succeeded" || phase == "Failed" {
            continue;
        }
        fresh.push(pod.clone());
    }
    // Watch order (what the kubelet follows).
    let order = state
        .lock()
        .map(|s| s.bound_order.clone())
        .unwrap_or_default();
    fresh.sort_by(|a, b| {
        let key = |p: &Pod| {
            (
                p.metadata
                    .uid
                    .as_ref()
                    .and_then(|u| order.get(u).copied())
                    .unwrap_or(u64::MAX),
                p.metadata.creation_timestamp.clone().map(|t| t.0),
                p.metadata.name.clone(),
            )
        };
        key(a).cmp(&key(b))
    });
    for pod in fresh {
        admit(client, kubelet, plugin, state, &pod).await?;
    }
    Ok(())
}

async fn admit(
    client: &kube::Client,
    kubelet: &FakeKubelet,
    plugin: &mut Plugin,
    state: &Arc<Mutex<NodeState>>,
    pod: &Pod,
) -> Result<()> {
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let ns = pod.metadata.namespace.clone().unwrap_or_default();
    let name = pod.metadata.name.clone().unwrap_or_default();
    let spec = pod.spec.clone().unwrap_or_default();
    let init_count = spec.init_containers.as_ref().map_or(0, Vec::len);
    let containers: Vec<_> = spec
        .init_containers
        .unwrap_or_default()
        .into_iter()
        .chain(spec.containers)
        .collect();
    // pod-resources reports app containers and restartable (sidecar) init containers, never
    // regular init containers.
    let reported = |i: usize, c: &k8s_openapi::api::core::v1::Container| {
        i >= init_count || c.restart_policy.as_deref() == Some("Always")
    };
    // The pod under admission is active (listed) with no devices yet.
    for (i, c) in containers.iter().enumerate() {
        if reported(i, c) {
            kubelet
                .pod_resources
                .record(&ns, &name, &c.name, GPU_RESOURCE, Vec::new());
        }
    }
    // Devices of the pod's init containers, which its later containers take first (the
    // device manager's `devicesToReuse`).
    let mut reusable: Vec<String> = Vec::new();
    let mut free: Vec<String> = {
        let s = state
            .lock()
            .map_err(|_| Error::msg("node state poisoned"))?;
        let used: BTreeSet<&String> = s
            .admitted
            .values()
            .flat_map(|a| a.containers.iter().flat_map(|c| c.device_ids.iter()))
            .collect();
        s.devices
            .iter()
            .filter(|(id, healthy)| *healthy && !used.contains(id))
            .map(|(id, _)| id.clone())
            .collect()
    };
    let mut done = Vec::new();
    for (i, c) in containers.iter().enumerate() {
        let count = gpu_count(c);
        if count == 0 {
            continue;
        }
        let reused: Vec<String> = reusable.iter().take(count).cloned().collect();
        let mut ids: Vec<String> = Vec::new();
        if reused.len() == count {
            // All from the init containers' devices: no GetPreferredAllocation, as in the kubelet.
            ids = reused.clone();
        } else if plugin.preferred {
            let mut available = reused.clone();
            available.extend(free.iter().cloned());
            let req = dp::PreferredAllocationRequest {
                container_requests: vec![dp::ContainerPreferredAllocationRequest {
                    available_device_i_ds: available.clone(),
                    must_include_device_i_ds: reused.clone(),
                    allocation_size: i32::try_from(count).unwrap_or(i32::MAX),
                }],
            };
            if let Ok(r) = plugin.client.get_preferred_allocation(req).await
                && let Some(first) = r.into_inner().container_responses.into_iter().next()
                && first.device_i_ds.len() == count
                && first.device_i_ds.iter().all(|d| available.contains(d))
                && reused.iter().all(|d| first.device_i_ds.contains(d))
            {
                ids = first.device_i_ds;
            }
        }
        if ids.is_empty() {
            let need = count - reused.len();
            if free.len() < need {
                reject(client, kubelet, state, pod, &format!(
                    "Allocate failed due to requested number of devices unavailable for {GPU_RESOURCE}. Requested: {count}, Available: {}",
                    free.len()
                )).await;
                return Ok(());
            }
            ids = reused.clone();
            ids.extend(free[..need].iter().cloned());
        }
        if let Ok(mut s) = state.lock() {
            s.allocate_calls += 1;
        }
        let req = dp::AllocateRequest {
            container_requests: vec![dp::ContainerAllocateRequest {
                devices_ids: ids.clone(),
            }],
        };
        match plugin.client.allocate(req).await {
            Ok(r) => {
                let response = r
                    .into_inner()
                    .container_responses
                    .into_iter()
                    .next()
                    .unwrap_or_default();
                free.retain(|d| !ids.contains(d));
                if i < init_count {
                    reusable.extend(
                        ids.iter()
                            .filter(|d| !reusable.contains(d))
                            .cloned()
                            .collect::<Vec<_>>(),
                    );
                } else {
                    reusable.retain(|d| !ids.contains(d));
                }
                if reported(i, c) {
                    kubelet
                        .pod_resources
                        .record(&ns, &name, &c.name, GPU_RESOURCE, ids.clone());
                }
                done.push(AdmittedContainer {
                    name: c.name.clone(),
                    device_ids: ids,
                    response,
                });
            }
            Err(e) => {
                reject(
                    client,
                    kubelet,
                    state,
                    pod,
                    &format!("Allocate failed: {}", e.message()),
                )
                .await;
                return Ok(());
            }
        }
    }
    if let Ok(mut s) = state.lock() {
        s.admitted.insert(
            uid,
            Admitted {
                namespace: ns.clone(),
                name: name.clone(),
                containers: done,
            },
        );
    }
    let status = json!({"status": {"phase": "Running", "conditions": [
        {"type": "Ready", "status": "True"}, {"type": "PodScheduled", "status": "True"}]}});
    let _ = Api::<Pod>::namespaced(client.clone(), &ns)
        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
        .await;
    Ok(())
}

/// What the kubelet does when a device plugin's `Allocate` fails: the pod fails admission.
async fn reject(
    client: &kube::Client,
    kubelet: &FakeKubelet,
    state: &Arc<Mutex<NodeState>>,
    pod: &Pod,
    message: &str,
) {
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let ns = pod.metadata.namespace.clone().unwrap_or_default();
    let name = pod.metadata.name.clone().unwrap_or_default();
    kubelet.pod_resources.remove(&ns, &name);
    if let Ok(mut s) = state.lock() {
        s.rejected.insert(uid, message.to_owned());
    }
    let status = json!({"status": {"phase": "Failed", "reason": "UnexpectedAdmissionError",
                                   "message": message}});
    let _ = Api::<Pod>::namespaced(client.clone(), &ns)
        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
        .await;
}

//! A cluster whose nodes are real: etcd, kube-apiserver, kube-controller-manager and the control
//! plane's kube-scheduler on the test's own network, and nodes that each run a kubelet v1.34 with
//! its own containerd, in their own mount, UTS and PID namespaces (`e2e/node/node.sh`). Tessera
//! is installed with `helm install` of `charts/tessera`, from images built from the workspace's
//! outputs and imported into every node's containerd; its components run as the pods the chart
//! describes, with the chart's ServiceAccounts and RBAC. Nodes join with node credentials (a
//! `system:node:<name>` client certificate, authorised by the Node authorizer and
//! NodeRestriction), the way kubeadm joins them.
//!
//! What stands in for the world outside one machine (docs/e2e.md): the fake NVML and CUDA
//! libraries, delivered into containers by a fake NVIDIA container runtime as the NVIDIA
//! container toolkit delivers the driver; the network (one namespace made by the test, no
//! kube-proxy: see [`crate::netns`]); no registry (images are imported).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, ServiceAccount};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::rbac::v1::RoleBinding;
use kube::Api;
use kube::api::{DeleteParams, ListParams, LogParams, PostParams};
use serde_json::json;

use crate::artifacts::{Artifacts, artifacts};
use crate::certs::{Pki, service_account_key};
use crate::cluster::{client_for, http_get_bearer, start_etcd, token, wait_apiserver};
use crate::netns::{self, ClusterNetwork};
use crate::node::NodeSpec;
use crate::process::{Proc, free_port};
use crate::{Error, Result, eventually};

/// Where [`RealCluster::install_kueue`] installs Kueue (its documented namespace).
pub const KUEUE_NAMESPACE: &str = "kueue-system";

/// The chart's release name and namespace in every real-node test.
pub const RELEASE: &str = "tessera";
pub const NAMESPACE: &str = "tessera-system";
/// The ServiceAccounts of the scheduler pod's extender and of its kube-scheduler, under
/// [`RELEASE`].
pub const SCHEDULER_SA: &str = "tessera-scheduler";
pub const KUBE_SCHEDULER_SA: &str = "tessera-kube-scheduler";
/// The ordinary user tests act as; [`RealCluster::tenant_namespace`] gives it `edit` there.
pub const USER: &str = "alice@example.com";
/// The e2e's metrics scraper: a ServiceAccount in the chart's namespace ([`RealCluster::scrape_token`]).
pub const SCRAPER: &str = "e2e-metrics-scraper";
/// The image the GPU workloads run: the CUDA probe and busybox.
pub const PROBE_IMAGE: &str = "tessera.local/cuda-probe:e2e";
/// The chart's default hook path (`global.gpuHookPath`).
const DEFAULT_HOOK_PATH: &str = "/usr/local";

/// One real node.
#[derive(Debug, Clone)]
pub struct RealNodeSpec {
    pub node: NodeSpec,
    /// Whether the node has a (fake) NVIDIA driver. Without one, NVML cannot be loaded in the
    /// device plugin's container, as on a node the DaemonSet reached by mistake.
    pub driver: bool,
    /// Node labels besides `gpu=on` (HAMi's device-plugin node selector).
    pub labels: Vec<(String, String)>,
    /// A DRA node: containerd v2 (CDI; `e2e/containerd-v2.sh` builds it once) and the label
    /// [`DRA_NODE_LABEL`], so the chart's DRA plugin runs there instead of the device plugin.
    /// A cluster with one turns on the control plane's DRA feature gates ([`DRA_FEATURE_GATES`]).
    pub dra: bool,
    /// The node's NVIDIA container runtime configuration.
    pub runtime: NodeRuntime,
    /// One simulated GPU state for the whole node (`FAKE_GPU_STATE`, mounted read-write into
    /// every GPU container and the device plugin), so the plugin's NVML lists the processes of
    /// every container, by the PID its own namespace sees, as a real driver does. Off: each
    /// container has a GPU of its own.
    pub shared_gpu_state: bool,
}

/// What the node's (fake) NVIDIA container runtime accepts as a container's device list: its
/// `/etc/nvidia-container-runtime/config.toml`, which the runtime and the device plugin read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeRuntime {
    /// The configuration docs/security.md asks for: the variable ignored in unprivileged
    /// containers, the device list read from volume mounts (the chart's recommended
    /// `devicePlugin.deviceListStrategy=volume-mounts`).
    Safe,
    /// The file the toolkit installs, with its defaults, which accept the variable from any
    /// container (what HAMi's default `envvar` strategy needs).
    ToolkitDefaults,
    /// No NVIDIA container runtime at all: containerd runs runc, as on a kind or k3s node
    /// without GPUs (the chart's simulated GPUs bring their own driver).
    None,
}

impl NodeRuntime {
    /// The `config.toml` text, or `None` for no file.
    fn config_toml(self) -> Option<&'static str> {
        match self {
            NodeRuntime::Safe => Some(
                "accept-nvidia-visible-devices-envvar-when-unprivileged = false\n\
                 accept-nvidia-visible-devices-as-volume-mounts = true\n",
            ),
            NodeRuntime::ToolkitDefaults => Some(
                "#accept-nvidia-visible-devices-envvar-when-unprivileged = true\n\
                 #accept-nvidia-visible-devices-as-volume-mounts = false\n\
                 [nvidia-container-cli]\nldconfig = \"@/sbin/ldconfig\"\n",
            ),
            NodeRuntime::None => None,
        }
    }
}

/// The NVIDIA container toolkit's configuration directory on a node (each node has its own,
/// `e2e/node/node.sh`).
pub const NVIDIA_RUNTIME_DIR: &str = "/etc/nvidia-container-runtime";

/// Where a node's shared simulated GPU state appears in its GPU containers
/// ([`RealNodeSpec::shared_gpu_state`]).
pub const SHARED_GPU_STATE: &str = "/etc/tessera-fake-gpu/state";

/// `--set` pairs every [`ChartValues::Recommended`] install gets first: docs/helm.md's install
/// on nodes whose runtime is [`NodeRuntime::Safe`].
pub const RECOMMENDED_SETS: &[(&str, &str)] =
    &[("devicePlugin.deviceListStrategy", "volume-mounts")];

impl RealNodeSpec {
    pub fn gpu(node: NodeSpec) -> RealNodeSpec {
        RealNodeSpec {
            node,
            driver: true,
            labels: Vec::new(),
            dra: false,
            runtime: NodeRuntime::Safe,
            shared_gpu_state: false,
        }
    }

    /// A GPU node whose GPUs are handed out through DRA.
    pub fn dra(node: NodeSpec) -> RealNodeSpec {
        RealNodeSpec {
            dra: true,
            ..RealNodeSpec::gpu(node)
        }
    }
}

/// The label of DRA nodes (the chart's default `dra.nodeSelector`).
pub const DRA_NODE_LABEL: (&str, &str) = ("tessera.io/dra", "on");
/// The alpha DRA gates of Kubernetes 1.34 the DRA path uses: GPUs shared by capacity, and
/// DeviceClasses that serve an extended resource. Set on kube-apiserver, kube-scheduler and
/// kube-controller-manager of a cluster with a DRA node (the kubelet needs none: DRA is GA).
pub const DRA_FEATURE_GATES: &str = "DRAConsumableCapacity=true,DRAExtendedResource=true";

/// How the chart is installed.
#[derive(Debug, Clone)]
pub enum ChartValues {
    /// The install docs/helm.md recommends, with `--set` pairs on top.
    Recommended(Vec<(String, String)>),
    /// A values file given unchanged (`-f`), e.g. HAMi v2.10's defaults.
    File(PathBuf),
    /// Do not install the chart.
    None,
}

impl ChartValues {
    /// The host directory the shim lives in, `<global.gpuHookPath>/vgpu`: each node gets its
    /// own directory there (`e2e/node/node.sh`). A values file keeps the default hook path.
    pub fn host_vgpu_dir(&self) -> String {
        let hook = match self {
            ChartValues::Recommended(sets) => sets
                .iter()
                .find(|(k, _)| k == "global.gpuHookPath")
                .map_or(DEFAULT_HOOK_PATH, |(_, v)| v.as_str()),
            ChartValues::File(_) | ChartValues::None => DEFAULT_HOOK_PATH,
        };
        format!("{}/vgpu", hook.trim_end_matches('/'))
    }
}

#[derive(Debug, Clone)]
pub struct RealClusterOptions {
    pub name: String,
    pub nodes: Vec<RealNodeSpec>,
    pub chart: ChartValues,
}

/// The previous release, ready to install ([`RealCluster::import_previous_release`]).
#[derive(Debug, Clone)]
pub struct PreviousInstall {
    /// The commit it was built from.
    pub rev: String,
    /// Its images' tag: install it with `global.imageTag` = this.
    pub tag: String,
    /// Its packaged chart.
    pub chart: PathBuf,
    /// Its shim, as the plugin installs it on the host.
    pub shim: PathBuf,
}

/// A running node: `unshare` → `node.sh` → containerd, kubelet and the node's containers.
#[derive(Debug)]
pub struct RealNode {
    pub spec: RealNodeSpec,
    pub ip: std::net::Ipv4Addr,
    pub dir: PathBuf,
    /// The chart's `<gpuHookPath>/vgpu` as the node sees it.
    pub host_vgpu_dir: String,
    proc_: Proc,
}

impl RealNode {
    pub fn name(&self) -> &str {
        &self.spec.node.name
    }

    /// Appends one scripted NVML event (`{"device":0,"kind":"xid","xid":48}`) that the fake NVML
    /// of every container on this node sees, the GPU plugin's included. A plugin started later
    /// reads the file from its start, so it sees the event again.
    pub fn nvml_event(&self, line: &serde_json::Value) -> Result<()> {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(self.dir.join("nvml-events.jsonl"))?;
        writeln!(f, "{line}")?;
        Ok(())
    }

    /// The node's `<gpuHookPath>/vgpu/containers` (the per-container directories the plugin
    /// makes at `Allocate`), seen from the test through the node's mount namespace
    /// (`/proc/<node's init>/root/…`): each directory is a size-limited tmpfs the plugin mounted
    /// there, which the node's directory under the run directory does not show. The run
    /// directory's copy once the node is gone.
    pub fn containers_dir(&self) -> PathBuf {
        let vgpu = self.host_vgpu_dir.trim_start_matches('/');
        match self.init_pid() {
            Some(pid) => PathBuf::from(format!("/proc/{pid}/root"))
                .join(vgpu)
                .join("containers"),
            None => self.dir.join("fs").join(vgpu).join("containers"),
        }
    }

    /// The kubelet's device-plugin directory (`/var/lib/kubelet/device-plugins`), reached through
    /// the node's mount namespace: a socket made there is the one the kubelet dials.
    pub fn device_plugin_dir(&self) -> Result<PathBuf> {
        let pid = self
            .init_pid()
            .ok_or_else(|| Error::msg(format!("node {} is not running", self.name())))?;
        Ok(PathBuf::from(format!(
            "/proc/{pid}/root/var/lib/kubelet/device-plugins"
        )))
    }

    /// A file of the node's `<gpuHookPath>/vgpu` (`libvgpu.so`, `ld.so.preload`), as the node
    /// and its containers' mounts see it.
    pub fn vgpu_file(&self, name: &str) -> PathBuf {
        self.containers_dir().with_file_name(name)
    }

    /// The node's `node.sh` (PID 1 of its PID namespace), seen from the test.
    fn init_pid(&self) -> Option<u32> {
        let unshare = self.proc_.pid()?;
        let children =
            std::fs::read_to_string(format!("/proc/{unshare}/task/{unshare}/children")).ok()?;
        children.split_whitespace().next()?.parse().ok()
    }

    /// `program` to run inside the node's PID and mount namespaces (not in any pod: a process
    /// of the node itself), through `nsenter`.
    pub fn command_in(&self, program: &Path) -> Result<Command> {
        let pid = self
            .init_pid()
            .ok_or_else(|| Error::msg(format!("node {} is not running", self.name())))?;
        let mut cmd = Command::new("nsenter");
        cmd.args(["-t", &pid.to_string(), "-p", "-m", "--"])
            .arg(program);
        Ok(cmd)
    }

    fn signal(&self, sig: &str) -> Result<()> {
        let pid = self
            .init_pid()
            .ok_or_else(|| Error::msg(format!("node {} is not running", self.name())))?;
        let st = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(pid.to_string())
            .status()?;
        st.success()
            .then_some(())
            .ok_or_else(|| Error::msg(format!("kill -{sig} {pid} failed")))
    }

    /// SIGKILLs the kubelet; the node's supervisor starts it again a second later.
    pub fn restart_kubelet(&self) -> Result<()> {
        self.signal("USR1")
    }

    /// SIGKILLs containerd (containers keep running under their shims); it comes back.
    pub fn restart_containerd(&self) -> Result<()> {
        self.signal("USR2")
    }

    /// Kills every process of the node and waits until its namespaces are gone.
    fn stop(&mut self) {
        let init = self.init_pid();
        self.proc_.kill();
        if let Some(pid) = init {
            let gone = Path::new("/proc").join(pid.to_string());
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while gone.exists() && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

impl Drop for RealNode {
    fn drop(&mut self) {
        self.stop();
    }
}

pub struct RealCluster {
    pub dir: PathBuf,
    pub artifacts: &'static Artifacts,
    pub nodes: Vec<RealNode>,
    admin: kube::Client,
    user: kube::Client,
    etcd: Proc,
    etcd_port: u16,
    apiserver: Option<Proc>,
    controller_manager: Option<Proc>,
    kube_scheduler: Option<Proc>,
    keep: bool,
    /// `--feature-gates` of the control plane, if any.
    feature_gates: Option<&'static str>,
    /// The chart's `<gpuHookPath>/vgpu` on every node.
    host_vgpu_dir: String,
    /// A token of [`SCRAPER`], when it was issued (the chart's metrics need one).
    scrape_token: std::sync::Mutex<Option<(String, std::time::Instant)>>,
    _net: ClusterNetwork,
}

impl std::fmt::Debug for RealCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RealCluster")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

impl Drop for RealCluster {
    fn drop(&mut self) {
        // Nodes first: their kubelets would otherwise spin on a dead API server.
        self.nodes.clear();
        remove_container_cgroups();
        self.kube_scheduler = None;
        self.controller_manager = None;
        self.apiserver = None;
        self.etcd.kill();
        crate::process::keep_or_remove_run_dir(&self.dir, self.keep);
    }
}

/// Runs `body` as a real-node test: on a thread of its own in a fresh network namespace, with a
/// current-thread runtime (every socket and child process is made in that namespace).
///
/// The control plane is found (or built from its Go modules, on a machine that never built it)
/// first, outside the namespace: inside it the Go module proxy cannot be reached. A test whose
/// nodes run containerd v2 calls [`containerd_v2`] before this, for the same reason.
pub fn run<F, Fut>(nodes: usize, body: F) -> Result<()>
where
    F: FnOnce(ClusterNetwork) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<()>>,
{
    artifacts()?;
    std::thread::spawn(move || {
        let net = ClusterNetwork::enter(nodes)?;
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(body(net))
    })
    .join()
    .map_err(|_| Error::msg("the test thread panicked"))?
}

/// Paths of the node tools Debian provides (`e2e/node-tools.sh`, which installs them once).
#[derive(Debug, Clone)]
pub struct NodeTools {
    pub containerd: PathBuf,
    pub ctr: PathBuf,
    pub runc: PathBuf,
    pub cni_bin_dir: PathBuf,
}

/// The `NAME=PATH` lines a tool script of `e2e/` prints (its progress goes to stderr).
fn script_vars(script: &str) -> std::result::Result<BTreeMap<String, String>, String> {
    let root = crate::artifacts::workspace_root();
    let out = Command::new(root.join("e2e").join(script))
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("running e2e/{script}: {e}"))?;
    if !out.status.success() {
        return Err(format!("e2e/{script} failed ({})", out.status));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect())
}

/// `vars[key]` as a path, or which script failed to print it.
fn script_path(
    vars: &BTreeMap<String, String>,
    script: &str,
    key: &str,
) -> std::result::Result<PathBuf, String> {
    vars.get(key)
        .map(PathBuf::from)
        .ok_or_else(|| format!("e2e/{script} printed no {key}"))
}

pub fn node_tools() -> Result<&'static NodeTools> {
    static T: OnceLock<std::result::Result<NodeTools, String>> = OnceLock::new();
    T.get_or_init(|| {
        let script = "node-tools.sh";
        let vars = script_vars(script)?;
        let get = |k: &str| script_path(&vars, script, k);
        Ok(NodeTools {
            containerd: get("CONTAINERD")?,
            ctr: get("CTR")?,
            runc: get("RUNC")?,
            cni_bin_dir: get("CNI_BIN_DIR")?,
        })
    })
    .as_ref()
    .map_err(|e| Error::msg(e.clone()))
}

/// containerd v2 for DRA nodes (`e2e/containerd-v2.sh`, which builds it from its Go module once).
#[derive(Debug, Clone)]
pub struct ContainerdV2 {
    pub containerd: PathBuf,
    pub ctr: PathBuf,
    pub shim: PathBuf,
}

pub fn containerd_v2() -> Result<&'static ContainerdV2> {
    static T: OnceLock<std::result::Result<ContainerdV2, String>> = OnceLock::new();
    T.get_or_init(|| {
        let script = "containerd-v2.sh";
        let vars = script_vars(script)?;
        let get = |k: &str| script_path(&vars, script, k);
        Ok(ContainerdV2 {
            containerd: get("CONTAINERD_V2")?,
            ctr: get("CTR_V2")?,
            shim: get("SHIM_V2")?,
        })
    })
    .as_ref()
    .map_err(|e| Error::msg(e.clone()))
}

fn write(path: &Path, content: impl AsRef<[u8]>) -> Result<()> {
    if let Some(p) = path.parent() {
        std::fs::create_dir_all(p)?;
    }
    std::fs::write(path, content)?;
    Ok(())
}

/// A kubeconfig for the API server at its cluster address, authenticating with a client
/// certificate (`cert`, `key` paths) or a bearer token.
fn kubeconfig(ca: &Path, user: KubeconfigUser<'_>) -> serde_json::Value {
    let user = match user {
        KubeconfigUser::Cert { cert, key } => {
            json!({"client-certificate": cert, "client-key": key})
        }
        KubeconfigUser::Token(t) => json!({"token": t}),
    };
    json!({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "e2e", "cluster": {
            "server": format!("https://{}:443", netns::APISERVER_IP),
            "certificate-authority": ca}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": "u"}}],
        "current-context": "e2e",
    })
}

enum KubeconfigUser<'a> {
    Cert { cert: &'a Path, key: &'a Path },
    Token(String),
}

/// Issues a client certificate for `user` in `groups` and writes it, with a kubeconfig that uses
/// it and trusts the cluster CA `ca`, into `dir`.
fn cert_kubeconfig(
    dir: &Path,
    ca: &Path,
    pki: &Pki,
    name: &str,
    user: &str,
    groups: &[&str],
) -> Result<PathBuf> {
    let pem = pki.client_in(user, groups)?;
    let cert = dir.join(format!("{name}.crt"));
    let key = dir.join(format!("{name}.key"));
    write(&cert, &pem.cert)?;
    write(&key, &pem.key)?;
    let path = dir.join(format!("{name}.kubeconfig"));
    let doc = kubeconfig(
        ca,
        KubeconfigUser::Cert {
            cert: &cert,
            key: &key,
        },
    );
    write(&path, yaml_serde::to_string(&doc)?)?;
    Ok(path)
}

fn token_kubeconfig(dir: &Path, user: &str) -> Result<PathBuf> {
    let path = dir.join(format!("{}.kubeconfig", token(user)));
    let doc = kubeconfig(&dir.join("ca.crt"), KubeconfigUser::Token(token(user)));
    write(&path, yaml_serde::to_string(&doc)?)?;
    Ok(path)
}

impl RealCluster {
    /// Starts the control plane and the nodes, and installs the chart as `opts.chart` says.
    /// Call it from [`run`].
    pub async fn start(net: ClusterNetwork, opts: RealClusterOptions) -> Result<RealCluster> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let artifacts = artifacts()?;
        let tools = node_tools()?;
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or(0);
        let dir = artifacts
            .root
            .join("target/e2e-runs")
            .join(format!("{}-{stamp}", opts.name));
        std::fs::create_dir_all(dir.join("logs"))?;

        let pki = Pki::new()?;
        write(&dir.join("ca.crt"), pki.ca_pem())?;
        let api_ip = netns::APISERVER_IP.to_string();
        let svc_ip = netns::KUBERNETES_SERVICE_IP.to_string();
        let api_cert = pki.server(
            "kube-apiserver",
            &[
                "127.0.0.1",
                &api_ip,
                &svc_ip,
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ],
        )?;
        write(&dir.join("apiserver.crt"), &api_cert.cert)?;
        write(&dir.join("apiserver.key"), &api_cert.key)?;
        let kubelet_client = pki.client_in("kube-apiserver-kubelet-client", &["system:masters"])?;
        write(
            &dir.join("apiserver-kubelet-client.crt"),
            &kubelet_client.cert,
        )?;
        write(
            &dir.join("apiserver-kubelet-client.key"),
            &kubelet_client.key,
        )?;
        write_webhook_client(&dir)?;
        write_front_proxy(&dir)?;
        let sa = service_account_key()?;
        write(&dir.join("sa.key"), &sa.key)?;
        write(&dir.join("sa.pub"), &sa.cert)?;
        // The administrator and the tenant authenticate with tokens (as a cluster's OIDC users
        // would); the control plane's components and the nodes with client certificates.
        let tokens = format!(
            "{},admin,admin,\"system:masters\"\n{},{USER},{USER},\"tenants\"\n",
            token("admin"),
            token(USER)
        );
        write(&dir.join("tokens.csv"), tokens)?;
        let admin_kc = token_kubeconfig(&dir, "admin")?;
        let user_kc = token_kubeconfig(&dir, USER)?;
        let ca = dir.join("ca.crt");
        let kcm_kc = cert_kubeconfig(
            &dir,
            &ca,
            &pki,
            "kube-controller-manager",
            "system:kube-controller-manager",
            &[],
        )?;
        let sched_kc = cert_kubeconfig(
            &dir,
            &ca,
            &pki,
            "kube-scheduler",
            "system:kube-scheduler",
            &[],
        )?;

        let [etcd_port, etcd_peer_port] = crate::process::free_ports();
        let etcd = start_etcd(artifacts, &dir, etcd_port, etcd_peer_port)?;
        eventually(
            "etcd /health",
            Duration::from_secs(30),
            Duration::from_millis(100),
            || crate::cluster::http_get(etcd_port, "/health"),
        )
        .await?;
        let feature_gates = opts
            .nodes
            .iter()
            .any(|n| n.dra)
            .then_some(DRA_FEATURE_GATES);
        let mut apiserver = start_apiserver(artifacts, &dir, etcd_port, feature_gates)?;
        let admin = client_for(&admin_kc).await?;
        let user = client_for(&user_kc).await?;
        wait_apiserver(&admin, &mut apiserver).await?;

        let mut cluster = RealCluster {
            dir: dir.clone(),
            artifacts,
            nodes: Vec::new(),
            admin,
            user,
            etcd,
            etcd_port,
            apiserver: Some(apiserver),
            controller_manager: None,
            kube_scheduler: None,
            keep: false,
            feature_gates,
            host_vgpu_dir: opts.chart.host_vgpu_dir(),
            scrape_token: Default::default(),
            _net: net,
        };
        let started = async {
            // kube-controller-manager exits at once if it cannot read the authentication
            // ConfigMap; the RoleBinding that lets it is among the API server's bootstrap RBAC,
            // created a moment after it serves (a real control plane's kubelet would restart it).
            let rbs: Api<RoleBinding> = Api::namespaced(cluster.admin.clone(), "kube-system");
            eventually(
                "the API server's bootstrap RBAC",
                Duration::from_secs(60),
                Duration::from_millis(200),
                || async {
                    rbs.get_opt("system::extension-apiserver-authentication-reader")
                        .await
                        .ok()
                        .flatten()
                },
            )
            .await?;
            cluster.controller_manager = Some(start_controller_manager(
                artifacts,
                &dir,
                &kcm_kc,
                feature_gates,
            )?);
            cluster.kube_scheduler = Some(start_kube_scheduler(
                artifacts,
                &dir,
                &sched_kc,
                feature_gates,
            )?);
            // The ServiceAccount admission plugin needs each namespace's `default` account, which
            // kube-controller-manager creates: it is working once that exists.
            let sas: Api<ServiceAccount> = Api::namespaced(cluster.admin.clone(), "default");
            eventually(
                "kube-controller-manager to create default/default",
                Duration::from_secs(60),
                Duration::from_millis(250),
                || async { sas.get_opt("default").await.ok().flatten() },
            )
            .await?;
            let images = node_images(artifacts)?;
            for (i, spec) in opts.nodes.iter().enumerate() {
                let node = cluster.start_node(i, spec.clone(), &pki, tools, &images)?;
                cluster.nodes.push(node);
            }
            for n in &opts.nodes {
                cluster.wait_node_ready(&n.node.name).await?;
            }
            match &opts.chart {
                ChartValues::None => {}
                values => cluster.helm_install(values).await?,
            }
            Ok::<(), Error>(())
        };
        match started.await {
            Ok(()) => Ok(cluster),
            Err(e) => {
                cluster.keep = true;
                Err(Error::msg(format!(
                    "{e}\n(logs: {})\n{}",
                    cluster.dir.join("logs").display(),
                    cluster.logs_tail(15)
                )))
            }
        }
    }

    /// Stops kube-apiserver for `down`, then starts it again on the same address and etcd.
    pub async fn restart_apiserver(&mut self, down: Duration) -> Result<()> {
        if let Some(mut a) = self.apiserver.take() {
            a.kill();
        }
        tokio::time::sleep(down).await;
        let mut a = start_apiserver(
            self.artifacts,
            &self.dir,
            self.etcd_port,
            self.feature_gates,
        )?;
        let r = wait_apiserver(&self.admin, &mut a).await;
        self.apiserver = Some(a);
        r
    }

    pub fn admin(&self) -> &kube::Client {
        &self.admin
    }

    pub fn user(&self) -> &kube::Client {
        &self.user
    }

    pub fn kubeconfig_admin(&self) -> PathBuf {
        self.dir.join(format!("{}.kubeconfig", token("admin")))
    }

    /// The tenant's kubeconfig ([`USER`], a token).
    pub fn kubeconfig_user(&self) -> PathBuf {
        self.dir.join(format!("{}.kubeconfig", token(USER)))
    }

    /// Runs `kubectl tessera <args>` as the administrator or as the tenant (their kubeconfig,
    /// namespace `default` unless `args` say otherwise); returns whether it succeeded and what
    /// it printed (stdout, then stderr).
    pub async fn kubectl_tessera(&self, as_tenant: bool, args: &[&str]) -> Result<(bool, String)> {
        let kubeconfig = if as_tenant {
            self.kubeconfig_user()
        } else {
            self.kubeconfig_admin()
        };
        if !self.artifacts.kubectl_tessera.is_file() {
            return Err(Error::msg(format!(
                "{} not found: run `make build` first",
                self.artifacts.kubectl_tessera.display()
            )));
        }
        let mut cmd = Command::new(&self.artifacts.kubectl_tessera);
        cmd.arg("--kubeconfig").arg(kubeconfig).args(args);
        let out = tokio::task::spawn_blocking(move || cmd.output())
            .await
            .map_err(|e| Error::msg(format!("kubectl-tessera: {e}")))??;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok((out.status.success(), text))
    }

    pub fn node(&self, name: &str) -> Option<&RealNode> {
        self.nodes.iter().find(|n| n.name() == name)
    }

    /// Builds the newer kube-scheduler's image ([`Artifacts::kube_scheduler_next`]) and imports
    /// it into every node's containerd, as the nodes would pull it; returns its tag, for the
    /// chart's `scheduler.kubeScheduler.image.tag`. Only the tests that run it pay the import.
    pub async fn import_kube_scheduler_next(&self) -> Result<String> {
        let built = crate::images::build_kube_scheduler_next(
            self.artifacts,
            &crate::images::default_out_dir(),
        )
        .map_err(|e| Error::msg(format!("building the newer kube-scheduler's image: {e}")))?;
        self.import_everywhere(&built.tar).await?;
        Ok(self.artifacts.kube_scheduler_next_version.clone())
    }

    /// The release an upgrade starts from ([`crate::artifacts::previous_release`]): its images
    /// built and imported into every node's containerd (as the nodes would pull them), its chart
    /// packaged. Only the tests that upgrade pay for it.
    pub async fn import_previous_release(&self) -> Result<PreviousInstall> {
        let previous = crate::artifacts::previous_release()
            .map_err(|e| Error::msg(format!("the previous release: {e}")))?;
        let built = crate::images::build_previous_release(
            self.artifacts,
            previous,
            &crate::images::default_out_dir(),
        )
        .map_err(|e| Error::msg(format!("building the previous release's images: {e}")))?;
        for image in &built {
            self.import_everywhere(&image.tar).await?;
        }
        let chart = package_chart(
            &self.artifacts.helm,
            &previous.chart_dir,
            &self.dir.join("previous-chart"),
        )?;
        Ok(PreviousInstall {
            rev: previous.rev.clone(),
            tag: previous.tag(),
            chart,
            shim: previous.shim.clone(),
        })
    }

    /// Kueue ([`Artifacts::kueue`], built from its Go module by `e2e/tools.sh`), installed as its
    /// users install it: `helm install` of its own chart into [`KUEUE_NAMESPACE`] with
    /// `values` (a values file), its image imported into every node as a registry would serve
    /// it. Returns once its Deployment is Ready, which Kueue reports only when its webhook
    /// serves with the certificate it issued itself.
    pub async fn install_kueue(&self, values: &Path) -> Result<()> {
        let a = self.artifacts;
        if !a.kueue.is_file() || !a.kueue_chart.join("Chart.yaml").is_file() {
            return Err(Error::msg(format!(
                "Kueue is not built ({} / {}): run e2e/tools.sh",
                a.kueue.display(),
                a.kueue_chart.display()
            )));
        }
        let image = crate::images::build_kueue(a, &crate::images::default_out_dir())
            .map_err(|e| Error::msg(format!("building Kueue's image: {e}")))?;
        self.import_everywhere(&image.tar).await?;
        let mut args: Vec<std::ffi::OsString> = vec![a.kueue_chart.clone().into()];
        args.extend(["--create-namespace", "--wait", "--timeout", "300s", "-f"].map(Into::into));
        args.push(values.into());
        // The image as imported (no registry), and requests a two-core node can hold.
        args.extend(
            [
                format!(
                    "controllerManager.manager.image.repository={}",
                    crate::images::KUEUE_REPOSITORY
                ),
                format!("controllerManager.manager.image.tag={}", a.kueue_version),
                "controllerManager.manager.image.pullPolicy=Never".to_owned(),
                "controllerManager.manager.resources.requests.cpu=50m".to_owned(),
                "controllerManager.manager.resources.requests.memory=128Mi".to_owned(),
            ]
            .into_iter()
            .flat_map(|set| ["--set".into(), set.into()]),
        );
        if let Err(e) = self
            .helm_release("kueue", KUEUE_NAMESPACE, "install", args)
            .await
        {
            return Err(Error::msg(format!(
                "{e}\n{}",
                self.describe_pods(KUEUE_NAMESPACE).await
            )));
        }
        Ok(())
    }

    /// Server-side apply, as the administrator, of every object of a multi-document YAML text
    /// (`kubectl apply --server-side -f`), of any kind the API server serves: resources are
    /// found by discovery, as kubectl finds them.
    pub async fn apply_yaml(&self, yaml: &str) -> Result<()> {
        use kube::api::{DynamicObject, Patch, PatchParams};
        use kube::discovery::{Discovery, Scope};
        let discovery = Discovery::new(self.admin.clone()).run().await?;
        for doc in crate::yaml_documents(yaml)? {
            let obj: DynamicObject = serde_json::from_value(doc)?;
            let types = obj
                .types
                .clone()
                .ok_or_else(|| Error::msg("an object without apiVersion and kind".to_owned()))?;
            let (group, version) = types
                .api_version
                .split_once('/')
                .unwrap_or(("", types.api_version.as_str()));
            let gvk = kube::api::GroupVersionKind::gvk(group, version, &types.kind);
            let (resource, caps) = discovery.resolve_gvk(&gvk).ok_or_else(|| {
                Error::msg(format!("the API server serves no {}", types.api_version))
            })?;
            let name = obj.metadata.name.clone().unwrap_or_default();
            let api: Api<DynamicObject> = match caps.scope {
                Scope::Cluster => Api::all_with(self.admin.clone(), &resource),
                Scope::Namespaced => Api::namespaced_with(
                    self.admin.clone(),
                    obj.metadata.namespace.as_deref().unwrap_or("default"),
                    &resource,
                ),
            };
            api.patch(
                &name,
                &PatchParams::apply("tessera-e2e").force(),
                &Patch::Apply(&obj),
            )
            .await?;
        }
        Ok(())
    }

    /// `ctr images import` of `tar` into every node's containerd (the CRI's namespace).
    async fn import_everywhere(&self, tar: &Path) -> Result<()> {
        let tools = node_tools()?;
        for node in &self.nodes {
            let mut cmd = node.command_in(&tools.ctr)?;
            cmd.args(["-a", "/run/containerd/containerd.sock", "-n", "k8s.io"])
                .args(["images", "import"])
                .arg(tar);
            let out = tokio::task::spawn_blocking(move || cmd.output())
                .await
                .map_err(|e| Error::msg(format!("ctr: {e}")))??;
            if !out.status.success() {
                return Err(Error::msg(format!(
                    "importing {} on {}: {}",
                    tar.display(),
                    node.name(),
                    String::from_utf8_lossy(&out.stderr).trim()
                )));
            }
        }
        Ok(())
    }

    fn start_node(
        &self,
        index: usize,
        spec: RealNodeSpec,
        pki: &Pki,
        tools: &NodeTools,
        images: &[PathBuf],
    ) -> Result<RealNode> {
        let name = spec.node.name.clone();
        let dir = self.dir.join("nodes").join(&name);
        std::fs::create_dir_all(&dir)?;
        let ip = netns::node_ip(index);
        // Joined as kubeadm joins a node: a client certificate in system:nodes.
        let node_user = format!("system:node:{name}");
        let kc = cert_kubeconfig(
            &dir,
            &self.dir.join("ca.crt"),
            pki,
            "node",
            &node_user,
            &["system:nodes"],
        )?;
        std::fs::rename(&kc, dir.join("kubeconfig"))?;
        write(
            &dir.join("images.list"),
            images
                .iter()
                .map(|p| format!("{}\n", p.display()))
                .collect::<String>(),
        )?;

        // Pod networking: one bridge per node, its own subnet.
        let cni_conf = dir.join("cni");
        write(
            &cni_conf.join("10-te2e.conflist"),
            serde_json::to_string_pretty(&json!({
                "cniVersion": "0.4.0",
                "name": format!("te2e-{index}"),
                "plugins": [{
                    "type": "bridge",
                    "bridge": format!("te2ebr{index}"),
                    "isGateway": true,
                    "ipMasq": false,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": netns::pod_subnet(index)}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": dir.join("cni-ipam"),
                    }
                }]
            }))?,
        )?;

        // The NVIDIA container toolkit's stand-in: containerd runs every container through the
        // fake runtime, which mounts the (fake) driver into containers that ask for GPUs.
        let scenario = dir.join("gpu-scenario.json");
        write(&scenario, spec.node.scenario_json())?;
        let driver_dir = &self.artifacts.driver_dir;
        // Scripted NVML events (XIDs, lost GPUs) for every container's fake NVML on this node:
        // [`RealNode::nvml_event`] appends to it.
        let events = dir.join("nvml-events.jsonl");
        write(&events, "")?;
        let mut mounts = vec![
            json!({"host": scenario, "container": "/etc/tessera-fake-gpu/scenario.json"}),
            json!({"host": events, "container": "/etc/tessera-fake-gpu/events.jsonl"}),
        ];
        let mut driver_env = vec![
            "FAKE_NVML_SCENARIO=/etc/tessera-fake-gpu/scenario.json".to_owned(),
            "FAKE_NVML_EVENTS=/etc/tessera-fake-gpu/events.jsonl".to_owned(),
        ];
        if spec.shared_gpu_state {
            let state = dir.join("gpu-state");
            write(&state, "")?;
            set_mode(&state, 0o666)?;
            mounts.push(json!({"host": state, "container": SHARED_GPU_STATE, "writable": true}));
            driver_env.push(format!("FAKE_GPU_STATE={SHARED_GPU_STATE}"));
        }
        if spec.driver {
            for lib in ["libcuda.so.1", "libnvidia-ml.so.1"] {
                mounts.push(json!({
                    "host": driver_dir.join(lib),
                    "container": format!("/usr/lib/x86_64-linux-gnu/{lib}"),
                }));
            }
        }
        let memory_mib = spec.node.gpus.first().map_or(0, |g| g.memory_mib);
        write(
            &dir.join("driver.json"),
            serde_json::to_string_pretty(&json!({
                "runc": tools.runc,
                "mounts": mounts,
                "env": driver_env
                    .into_iter()
                    .chain([format!("FAKE_CUDA_MEMORY_MIB={memory_mib}")])
                    .collect::<Vec<_>>(),
                "log": self.dir.join("logs").join(format!("{name}-nvidia-runtime.log")),
                "runtime_config": format!("{NVIDIA_RUNTIME_DIR}/config.toml"),
            }))?,
        )?;
        // The node's own /etc/nvidia-container-runtime (node.sh binds it over the host's).
        let runtime_dir = dir
            .join("fs")
            .join(NVIDIA_RUNTIME_DIR.trim_start_matches('/'));
        std::fs::create_dir_all(&runtime_dir)?;
        if let Some(toml) = spec.runtime.config_toml() {
            write(&runtime_dir.join("config.toml"), toml)?;
        }
        let runtime = dir.join("nvidia-container-runtime");
        write(
            &runtime,
            format!(
                "#!/bin/sh\nexec {} --driver-config {} \"$@\"\n",
                fake_runtime(self.artifacts)?.display(),
                dir.join("driver.json").display()
            ),
        )?;
        set_mode(&runtime, 0o755)?;

        let v2 = if spec.dra {
            Some(containerd_v2()?)
        } else {
            None
        };
        // Without an NVIDIA runtime containerd runs runc itself.
        let runtime = if spec.runtime == NodeRuntime::None {
            tools.runc.clone()
        } else {
            runtime
        };
        let config = match v2 {
            Some(v2) => containerd_v2_config(&dir, &cni_conf, &runtime, tools, &v2.shim),
            None => containerd_config(&dir, &cni_conf, &runtime, tools),
        };
        write(&dir.join("containerd.toml"), config)?;
        write(
            &dir.join("kubelet.yaml"),
            serde_json::to_string_pretty(&kubelet_config(&self.dir, ip, spec.dra))?,
        )?;
        let mut labels = vec![("gpu".to_owned(), "on".to_owned())];
        if spec.dra {
            labels.push((DRA_NODE_LABEL.0.to_owned(), DRA_NODE_LABEL.1.to_owned()));
        }
        labels.extend(spec.labels.iter().cloned());
        let labels = labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",");

        let mut cmd = Command::new("unshare");
        cmd.args([
            "--mount",
            "--uts",
            "--pid",
            "--fork",
            "--kill-child",
            "--mount-proc",
            "--propagation",
            "private",
            "--",
        ])
        .arg(self.artifacts.root.join("e2e/node/node.sh"))
        .env("NODE_NAME", &name)
        .env("NODE_IP", ip.to_string())
        .env("NODE_DIR", &dir)
        .env("NODE_LABELS", labels)
        .env("LOG_DIR", self.dir.join("logs"))
        .env("KUBELET", &self.artifacts.kubelet)
        .env(
            "CONTAINERD",
            v2.map_or(&tools.containerd, |v| &v.containerd),
        )
        .env("CTR", v2.map_or(&tools.ctr, |v| &v.ctr))
        .env("HOOK_DIR", &self.host_vgpu_dir);
        let proc_ = Proc::spawn(&format!("{name}-node"), &self.dir.join("logs"), &mut cmd)?;
        Ok(RealNode {
            spec,
            ip,
            dir,
            host_vgpu_dir: self.host_vgpu_dir.clone(),
            proc_,
        })
    }

    async fn wait_node_ready(&mut self, name: &str) -> Result<()> {
        let nodes: Api<Node> = Api::all(self.admin.clone());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(180);
        loop {
            let ready = nodes.get_opt(name).await.ok().flatten().is_some_and(|n| {
                n.status
                    .and_then(|s| s.conditions)
                    .unwrap_or_default()
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True")
            });
            if ready {
                return Ok(());
            }
            let running = self
                .nodes
                .iter_mut()
                .find(|n| n.name() == name)
                .is_some_and(|n| n.proc_.is_running());
            if !running || tokio::time::Instant::now() >= deadline {
                return Err(Error::msg(format!("node {name} did not become Ready")));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// `helm install` of `charts/tessera` into the release namespace, waiting (helm's `--wait`)
    /// until every Deployment and DaemonSet pod is Ready.
    pub async fn helm_install(&self, values: &ChartValues) -> Result<()> {
        let chart = packaged_chart(self.artifacts)?;
        self.helm_install_chart(&chart, values).await
    }

    /// `helm install` of a packaged `chart` (e.g. [`PreviousInstall::chart`]), as
    /// [`RealCluster::helm_install`].
    pub async fn helm_install_chart(&self, chart: &Path, values: &ChartValues) -> Result<()> {
        if matches!(values, ChartValues::None) {
            return Ok(());
        }
        let mut args: Vec<std::ffi::OsString> = vec![chart.into()];
        args.extend(["--create-namespace", "--wait", "--timeout", "240s"].map(Into::into));
        args.extend(self.values_args(values));
        if let Err(e) = self.helm("install", args).await {
            return Err(Error::msg(format!(
                "{e}\n{}",
                self.describe_pods(NAMESPACE).await
            )));
        }
        Ok(())
    }

    /// `helm <verb> <release> --namespace <ns> --kubeconfig <admin> <args>`; its output kept in
    /// `logs/helm-<verb>.log`, its standard error in the error when it fails.
    async fn helm(&self, verb: &str, args: Vec<std::ffi::OsString>) -> Result<()> {
        self.helm_release(RELEASE, NAMESPACE, verb, args).await
    }

    /// `helm <verb> <release> --namespace <namespace> …` of any release, as [`RealCluster::helm`]
    /// (its log `logs/helm-<verb>.log`, or `logs/helm-<release>-<verb>.log` for another release).
    async fn helm_release(
        &self,
        release: &str,
        namespace: &str,
        verb: &str,
        args: Vec<std::ffi::OsString>,
    ) -> Result<()> {
        let mut cmd = Command::new(&self.artifacts.helm);
        cmd.args([verb, release, "--namespace", namespace])
            .arg("--kubeconfig")
            .arg(self.kubeconfig_admin())
            .args(args);
        let out = tokio::task::spawn_blocking(move || cmd.output())
            .await
            .map_err(|e| Error::msg(format!("helm: {e}")))??;
        let log = if release == RELEASE {
            format!("logs/helm-{verb}.log")
        } else {
            format!("logs/helm-{release}-{verb}.log")
        };
        std::fs::write(
            self.dir.join(log),
            [&out.stdout[..], &out.stderr[..]].concat(),
        )?;
        if !out.status.success() {
            return Err(Error::msg(format!(
                "helm {verb} failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok(())
    }

    /// `helm uninstall --wait` of the release: every object it made is gone when this returns
    /// (the pods it placed keep running).
    pub async fn helm_uninstall(&self) -> Result<()> {
        self.helm(
            "uninstall",
            ["--wait", "--timeout", "180s"].map(Into::into).to_vec(),
        )
        .await
    }

    /// `helm`'s arguments for `values`: docs/helm.md's recommended install with its `--set`
    /// pairs, or a values file.
    fn values_args(&self, values: &ChartValues) -> Vec<std::ffi::OsString> {
        let mut args: Vec<std::ffi::OsString> = Vec::new();
        match values {
            ChartValues::Recommended(sets) => {
                for (k, v) in RECOMMENDED_SETS {
                    args.extend(["--set".into(), format!("{k}={v}").into()]);
                }
                for (k, v) in sets {
                    if v == CLUSTER_WEBHOOK_CLIENT_CA {
                        let ca = self.dir.join(WEBHOOK_CLIENT_CA);
                        args.extend(["--set-file".into(), format!("{k}={}", ca.display()).into()]);
                    } else {
                        args.extend(["--set".into(), format!("{k}={v}").into()]);
                    }
                }
            }
            ChartValues::File(f) => args.extend(["-f".into(), f.clone().into_os_string()]),
            ChartValues::None => {}
        }
        args
    }

    /// `helm upgrade` of the release with the values file it was installed with plus `sets`
    /// (no `--wait`: a test that upgrades watches what it expects).
    pub async fn helm_upgrade(&self, values: &Path, sets: &[(&str, &str)]) -> Result<()> {
        let mut args = vec!["-f".into(), values.as_os_str().to_owned()];
        args.extend(sets.iter().map(|(k, v)| format!("--set={k}={v}").into()));
        let chart = packaged_chart(self.artifacts)?;
        self.helm_upgrade_with(&chart, args).await
    }

    /// `helm upgrade --reuse-values` with `sets` on top (no `--wait`).
    pub async fn helm_upgrade_set(&self, sets: &[(&str, &str)]) -> Result<()> {
        let mut args = vec!["--reuse-values".into()];
        args.extend(sets.iter().map(|(k, v)| format!("--set={k}={v}").into()));
        let chart = packaged_chart(self.artifacts)?;
        self.helm_upgrade_with(&chart, args).await
    }

    /// `helm upgrade` of the release to a packaged `chart` with `values` as a user gives them
    /// (not reused from the release): this workspace's chart for an upgrade,
    /// [`PreviousInstall::chart`] for a downgrade. No `--wait`.
    pub async fn helm_upgrade_chart(
        &self,
        chart: Option<&Path>,
        values: &ChartValues,
    ) -> Result<()> {
        let args = self.values_args(values);
        let chart = match chart {
            Some(c) => c.to_owned(),
            None => packaged_chart(self.artifacts)?,
        };
        self.helm_upgrade_with(&chart, args).await
    }

    async fn helm_upgrade_with(
        &self,
        chart: &Path,
        mut args: Vec<std::ffi::OsString>,
    ) -> Result<()> {
        args.insert(0, chart.into());
        self.helm("upgrade", args).await
    }

    /// Waits until the device-plugin DaemonSet has every pod updated, Ready and available (after
    /// a `helm upgrade` that changed it).
    pub async fn wait_plugin_rolled_out(&self) -> Result<()> {
        let ds: Api<DaemonSet> = Api::namespaced(self.admin.clone(), NAMESPACE);
        eventually(
            "the device-plugin DaemonSet rolled out",
            Duration::from_secs(120),
            Duration::from_millis(500),
            || async {
                let list = ds.list(&ListParams::default()).await.ok()?;
                list.items
                    .iter()
                    .all(|d| {
                        let st = d.status.clone().unwrap_or_default();
                        st.observed_generation == d.metadata.generation
                            && st.updated_number_scheduled.unwrap_or(0)
                                == st.desired_number_scheduled
                            && st.number_ready == st.desired_number_scheduled
                            && st.number_unavailable.unwrap_or(0) == 0
                    })
                    .then_some(())
            },
        )
        .await
    }

    /// Waits until the release serves again after a fault on its node: every Deployment's
    /// replicas Ready, the device plugin on every node Ready, and the scheduler's Service with a
    /// ready endpoint (the webhook fails closed without one, so a pod created earlier is refused).
    pub async fn wait_release_serving(&self) -> Result<()> {
        let deploys: Api<Deployment> = Api::namespaced(self.admin.clone(), NAMESPACE);
        let slices: Api<EndpointSlice> = Api::namespaced(self.admin.clone(), NAMESPACE);
        eventually(
            "the release's Deployments Ready and the scheduler's Service with an endpoint",
            Duration::from_secs(120),
            Duration::from_millis(500),
            || async {
                let deployments_ready = deploys
                    .list(&ListParams::default())
                    .await
                    .ok()?
                    .items
                    .iter()
                    .all(|d| {
                        let want = d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
                        let st = d.status.clone().unwrap_or_default();
                        st.ready_replicas.unwrap_or(0) >= want
                            && st.unavailable_replicas.unwrap_or(0) == 0
                    });
                let lp = ListParams::default()
                    .labels(&format!("kubernetes.io/service-name={RELEASE}-scheduler"));
                let endpoint_ready = slices.list(&lp).await.ok()?.items.iter().any(|s| {
                    s.endpoints
                        .iter()
                        .any(|e| e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(false))
                });
                (deployments_ready && endpoint_ready).then_some(())
            },
        )
        .await?;
        self.wait_plugin_rolled_out().await
    }

    /// Every pod of a namespace with its phase, readiness, restarts and last termination, for
    /// failure messages.
    pub async fn describe_pods(&self, namespace: &str) -> String {
        let pods: Api<Pod> = Api::namespaced(self.admin.clone(), namespace);
        let Ok(list) = pods.list(&ListParams::default()).await else {
            return "(pods could not be listed)".to_owned();
        };
        let mut out = String::new();
        for p in list.items {
            let name = p.metadata.name.clone().unwrap_or_default();
            let st = p.status.clone().unwrap_or_default();
            out.push_str(&format!(
                "pod {name} on {:?}: {:?} {:?}\n",
                p.spec.as_ref().and_then(|s| s.node_name.clone()),
                st.phase,
                st.conditions
                    .unwrap_or_default()
                    .iter()
                    .map(|c| format!(
                        "{}={} {}",
                        c.type_,
                        c.status,
                        c.message.clone().unwrap_or_default()
                    ))
                    .collect::<Vec<_>>()
            ));
            for cs in st
                .init_container_statuses
                .unwrap_or_default()
                .into_iter()
                .chain(st.container_statuses.unwrap_or_default())
            {
                out.push_str(&format!(
                    "  {} ready={} restarts={} state={:?} last={:?}\n",
                    cs.name, cs.ready, cs.restart_count, cs.state, cs.last_state
                ));
            }
        }
        out
    }

    /// Creates `namespace` and lets [`USER`] edit it (an ordinary tenant's rights).
    pub async fn tenant_namespace(&self, namespace: &str) -> Result<()> {
        let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": namespace}}))?;
        Api::<Namespace>::all(self.admin.clone())
            .create(&PostParams::default(), &ns)
            .await?;
        let rb: RoleBinding = serde_json::from_value(json!({
            "metadata": {"name": "tenant-edit", "namespace": namespace},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": USER}],
        }))?;
        Api::<RoleBinding>::namespaced(self.admin.clone(), namespace)
            .create(&PostParams::default(), &rb)
            .await?;
        // The namespace's default ServiceAccount, which pods need, comes from the controller.
        let sas: Api<ServiceAccount> = Api::namespaced(self.admin.clone(), namespace);
        eventually(
            "the namespace's default ServiceAccount",
            Duration::from_secs(30),
            Duration::from_millis(100),
            || async { sas.get_opt("default").await.ok().flatten() },
        )
        .await?;
        Ok(())
    }

    /// Waits until pod `name` has finished (Succeeded or Failed) and returns it.
    pub async fn wait_finished(
        &self,
        namespace: &str,
        name: &str,
        within: Duration,
    ) -> Result<Pod> {
        let pods: Api<Pod> = Api::namespaced(self.admin.clone(), namespace);
        let r = eventually(
            &format!("pod {namespace}/{name} to finish"),
            within,
            Duration::from_millis(250),
            || async {
                pods.get_opt(name).await.ok().flatten().filter(|p| {
                    matches!(
                        p.status.as_ref().and_then(|s| s.phase.as_deref()),
                        Some("Succeeded" | "Failed")
                    )
                })
            },
        )
        .await;
        match r {
            Ok(p) => Ok(p),
            Err(e) => Err(Error::msg(format!(
                "{e}\n{}",
                self.describe_pods(namespace).await
            ))),
        }
    }

    /// What `kubectl logs POD -c CONTAINER` prints (through the API server and the kubelet), as
    /// the tenant in its namespaces and as the administrator in the release namespace.
    pub async fn logs(&self, namespace: &str, pod: &str, container: &str) -> Result<String> {
        let client = if namespace == NAMESPACE {
            &self.admin
        } else {
            &self.user
        };
        let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
        Ok(pods
            .logs(
                pod,
                &LogParams {
                    container: Some(container.to_owned()),
                    ..LogParams::default()
                },
            )
            .await?)
    }

    /// Creates `pod` (in its own namespace) as the tenant user, as a pod author would.
    pub async fn create_pod_as_user(&self, pod: &Pod) -> Result<Pod> {
        let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
        Ok(Api::<Pod>::namespaced(self.user.clone(), namespace)
            .create(&PostParams::default(), pod)
            .await?)
    }

    /// Deletes a pod and waits until it is gone.
    pub async fn delete_pod(&self, namespace: &str, name: &str) -> Result<()> {
        let pods: Api<Pod> = Api::namespaced(self.admin.clone(), namespace);
        let _ = pods.delete(name, &DeleteParams::default()).await;
        eventually(
            &format!("pod {namespace}/{name} to be gone"),
            Duration::from_secs(60),
            Duration::from_millis(200),
            || async {
                pods.get_opt(name)
                    .await
                    .ok()
                    .and_then(|p| p.is_none().then_some(()))
            },
        )
        .await
    }

    /// The leading tessera-scheduler's `/metrics` (scraped at its pod's address, as Prometheus
    /// scrapes it), or `None` while no scheduler pod answers.
    pub async fn scheduler_metrics(&self) -> Option<String> {
        let lp = ListParams::default().labels("app.kubernetes.io/component=scheduler");
        self.pod_metrics(lp, 9395, |m| {
            m.lines().any(|l| l.trim() == "tessera_scheduler_leader 1")
        })
        .await
    }

    /// `/metrics` of the DRA plugin on `node`, or `None` while it does not answer.
    /// A kube client that authenticates with `token` (the admin kubeconfig with its user's
    /// credentials replaced by the token).
    pub async fn client_with_token(&self, token: &str) -> Result<kube::Client> {
        let text = std::fs::read_to_string(self.kubeconfig_admin())?;
        let mut doc: serde_json::Value = yaml_serde::from_str(&text)?;
        let users = doc["users"]
            .as_array_mut()
            .ok_or_else(|| Error::msg("kubeconfig without users"))?;
        for u in users {
            u["user"] = json!({ "token": token });
        }
        let kc = kube::config::Kubeconfig::from_yaml(&yaml_serde::to_string(&doc)?)?;
        let cfg =
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await?;
        Ok(kube::Client::try_from(cfg)?)
    }

    /// A token of the chart's service account `sa` from the TokenRequest API, bound to `pod`
    /// when given (then it carries the pod's node in its node claim, as the kubelet's do).
    pub async fn service_account_token(&self, sa: &str, pod: Option<&Pod>) -> Result<String> {
        let mut spec = json!({"audiences": [], "expirationSeconds": 600});
        if let Some(p) = pod {
            spec["boundObjectRef"] = json!({
                "apiVersion": "v1", "kind": "Pod",
                "name": p.metadata.name, "uid": p.metadata.uid,
            });
        }
        let req: k8s_openapi::api::authentication::v1::TokenRequest =
            serde_json::from_value(json!({"spec": spec}))?;
        let sas: Api<ServiceAccount> = Api::namespaced(self.admin.clone(), NAMESPACE);
        let out: k8s_openapi::api::authentication::v1::TokenRequest = sas
            .create_subresource("token", sa, &PostParams::default(), &req)
            .await?;
        Ok(out.status.map(|s| s.token).unwrap_or_default())
    }

    /// The API Priority and Fairness classification of the chart's service account `sa`'s
    /// requests: `(FlowSchema, priority level)` names, from the `X-Kubernetes-PF-*-UID` headers
    /// the API server puts on one of its requests (a list of the release's pods).
    pub async fn flow_control_of(&self, sa: &str) -> Result<(String, String)> {
        use k8s_openapi::api::flowcontrol::v1::{FlowSchema, PriorityLevelConfiguration};
        let client = self
            .client_with_token(&self.service_account_token(sa, None).await?)
            .await?;
        let req = http::Request::get(format!("/api/v1/namespaces/{NAMESPACE}/pods?limit=1"))
            .body(kube::client::Body::from(Vec::new()))
            .map_err(|e| Error::msg(format!("request: {e}")))?;
        let resp = client.send(req).await?;
        let header = |name: &str| {
            resp.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
                .ok_or_else(|| Error::msg(format!("no {name} on {sa}'s request")))
        };
        let (schema_uid, level_uid) = (
            header("X-Kubernetes-PF-FlowSchema-UID")?,
            header("X-Kubernetes-PF-PriorityLevel-UID")?,
        );
        let schema = name_with_uid(Api::<FlowSchema>::all(self.admin.clone()), &schema_uid).await?;
        let level = name_with_uid(
            Api::<PriorityLevelConfiguration>::all(self.admin.clone()),
            &level_uid,
        )
        .await?;
        Ok((schema.unwrap_or(schema_uid), level.unwrap_or(level_uid)))
    }

    /// The chart's (first) pod of `component` (`app.kubernetes.io/component`), on any node.
    pub async fn chart_pod_on_any(&self, component: &str) -> Result<Pod> {
        Api::<Pod>::namespaced(self.admin.clone(), NAMESPACE)
            .list(
                &ListParams::default().labels(&format!("app.kubernetes.io/component={component}")),
            )
            .await?
            .items
            .into_iter()
            .next()
            .ok_or_else(|| Error::msg(format!("no {component} pod")))
    }

    /// The chart's pod of `component` (`app.kubernetes.io/component`) on `node`.
    pub async fn chart_pod_on(&self, component: &str, node: &str) -> Result<Pod> {
        Api::<Pod>::namespaced(self.admin.clone(), NAMESPACE)
            .list(
                &ListParams::default()
                    .labels(&format!("app.kubernetes.io/component={component}"))
                    .fields(&format!("spec.nodeName={node}")),
            )
            .await?
            .items
            .into_iter()
            .next()
            .ok_or_else(|| Error::msg(format!("no {component} pod on {node}")))
    }

    pub async fn device_plugin_metrics(&self, node: &str) -> Option<String> {
        let lp = ListParams::default()
            .labels("app.kubernetes.io/component=device-plugin")
            .fields(&format!("spec.nodeName={node}"));
        self.pod_metrics(lp, 9394, |_| true).await
    }

    pub async fn dra_plugin_metrics(&self, node: &str) -> Option<String> {
        let lp = ListParams::default()
            .labels("app.kubernetes.io/component=dra-plugin")
            .fields(&format!("spec.nodeName={node}"));
        self.pod_metrics(lp, 9394, |_| true).await
    }

    /// A bearer token of [`SCRAPER`], the e2e's Prometheus: a ServiceAccount of the chart's
    /// namespace whose ClusterRole allows `get` on the non-resource URL `/metrics`, as
    /// Prometheus' own does (the chart's `metricsAuthorization: kubernetes`). Issued every five
    /// minutes; the first call creates the account and its RBAC.
    pub async fn scrape_token(&self) -> Result<String> {
        if let Ok(g) = self.scrape_token.lock()
            && let Some((t, at)) = g.as_ref()
            // The token lives 10 minutes (`service_account_token`): renewed at 5.
            && at.elapsed() < Duration::from_secs(300)
        {
            return Ok(t.clone());
        }
        let pp = PostParams::default();
        let objects = [
            json!({"apiVersion": "v1", "kind": "ServiceAccount",
                "metadata": {"name": SCRAPER, "namespace": NAMESPACE}}),
            json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                "metadata": {"name": SCRAPER},
                "rules": [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]}),
            json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                "metadata": {"name": SCRAPER},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": SCRAPER},
                "subjects": [{"kind": "ServiceAccount", "name": SCRAPER, "namespace": NAMESPACE}]}),
        ];
        for o in objects {
            let r = match o["kind"].as_str() {
                Some("ServiceAccount") => {
                    Api::<ServiceAccount>::namespaced(self.admin.clone(), NAMESPACE)
                        .create(&pp, &serde_json::from_value(o)?)
                        .await
                        .map(drop)
                }
                Some("ClusterRole") => {
                    Api::<k8s_openapi::api::rbac::v1::ClusterRole>::all(self.admin.clone())
                        .create(&pp, &serde_json::from_value(o)?)
                        .await
                        .map(drop)
                }
                _ => Api::<k8s_openapi::api::rbac::v1::ClusterRoleBinding>::all(self.admin.clone())
                    .create(&pp, &serde_json::from_value(o)?)
                    .await
                    .map(drop),
            };
            match r {
                Ok(()) => {}
                Err(kube::Error::Api(e)) if e.code == 409 => {}
                Err(e) => return Err(e.into()),
            }
        }
        let token = self.service_account_token(SCRAPER, None).await?;
        if let Ok(mut g) = self.scrape_token.lock() {
            *g = Some((token.clone(), std::time::Instant::now()));
        }
        Ok(token)
    }

    /// The first `/metrics` on `port` of the chart's pods selected by `lp` that `wanted`
    /// accepts, scraped at the pod's address.
    async fn pod_metrics(
        &self,
        lp: ListParams,
        port: u16,
        wanted: impl Fn(&str) -> bool,
    ) -> Option<String> {
        let token = self.scrape_token().await.ok()?;
        let pods: Api<Pod> = Api::namespaced(self.admin.clone(), NAMESPACE);
        for p in pods.list(&lp).await.ok()?.items {
            let Some(ip) = p.status.and_then(|s| s.pod_ip) else {
                continue;
            };
            if let Some(m) = http_get_bearer(&ip, port, "/metrics", Some(&token)).await
                && wanted(&m)
            {
                return Some(m);
            }
        }
        None
    }

    /// The last lines of every log, for a failure message.
    pub fn logs_tail(&self, n: usize) -> String {
        crate::process::tail_all(&self.dir.join("logs"), n)
    }
}

/// The images every node imports, built (or reused) from the workspace's outputs: the pause
/// image, Tessera's two images, kube-scheduler under the names the chart's values produce
/// (Tessera's recommended values: `registry.k8s.io/kube-scheduler:<cluster version>`; HAMi's
/// defaults: HAMi's mirror, tag = the cluster's version), and the CUDA probe.
fn node_images(a: &Artifacts) -> Result<Vec<PathBuf>> {
    let names = crate::images::ImageNames {
        kube_scheduler: vec![format!(
            "registry.cn-hangzhou.aliyuncs.com/google_containers/kube-scheduler:{}",
            a.k8s_version
        )],
        ..Default::default()
    };
    let built = crate::images::build_all(a, &names, &crate::images::default_out_dir())
        .map_err(|e| Error::msg(format!("building the node images: {e}")))?;
    Ok(built.into_iter().map(|b| b.tar).collect())
}

/// The chart as a user gets it: `helm package` of `charts/tessera` (what `make release`
/// publishes), made once per test process, so what the package leaves out (`.helmignore`) is
/// missing in the e2e too.
fn packaged_chart(a: &Artifacts) -> Result<PathBuf> {
    static PACKAGED: OnceLock<std::result::Result<PathBuf, String>> = OnceLock::new();
    PACKAGED
        .get_or_init(|| {
            let dir = a
                .root
                .join("target/e2e-chart")
                .join(std::process::id().to_string());
            package_chart(&a.helm, &a.root.join("charts/tessera"), &dir).map_err(|e| e.to_string())
        })
        .clone()
        .map_err(Error::msg)
}

/// `helm package` of the chart source `chart_dir` into `out_dir`; the `.tgz` it wrote.
fn package_chart(helm: &Path, chart_dir: &Path, out_dir: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(out_dir)
        .map_err(|e| Error::msg(format!("{}: {e}", out_dir.display())))?;
    let out = Command::new(helm)
        .arg("package")
        .arg(chart_dir)
        .arg("-d")
        .arg(out_dir)
        .output()
        .map_err(|e| Error::msg(format!("helm package: {e}")))?;
    if !out.status.success() {
        return Err(Error::msg(format!(
            "helm package of {} failed: {}",
            chart_dir.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    std::fs::read_dir(out_dir)
        .map_err(|e| Error::msg(format!("{}: {e}", out_dir.display())))?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "tgz"))
        .ok_or_else(|| {
            Error::msg(format!(
                "helm package wrote no .tgz into {}",
                out_dir.display()
            ))
        })
}

/// The fake NVIDIA container runtime (`e2e/src/bin/fake-nvidia-container-runtime.rs`), built
/// beside the daemons.
fn fake_runtime(a: &Artifacts) -> Result<PathBuf> {
    let p = a
        .tessera_scheduler
        .with_file_name("fake-nvidia-container-runtime");
    if p.is_file() {
        Ok(p)
    } else {
        Err(Error::msg(format!(
            "{} not found: run `make build` first",
            p.display()
        )))
    }
}

/// Removes the cgroups containerd made for containers (`/sys/fs/cgroup/<controller>/k8s.io/…`,
/// cgroup v1, as on this kind of machine) once the nodes' processes are gone: a killed node
/// leaves them behind, empty. Only empty cgroups can be removed, so a live container's never is.
fn remove_container_cgroups() {
    fn remove_tree(dir: &Path) -> bool {
        if let Ok(rd) = std::fs::read_dir(dir) {
            for e in rd.flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    remove_tree(&e.path());
                }
            }
        }
        std::fs::remove_dir(dir).is_ok()
    }
    let Ok(controllers) = std::fs::read_dir("/sys/fs/cgroup") else {
        return;
    };
    let roots: Vec<PathBuf> = controllers
        .flatten()
        .map(|c| c.path().join("k8s.io"))
        .filter(|p| p.is_dir())
        .collect();
    // The killed processes may take a moment to leave their cgroups.
    for _ in 0..20 {
        if roots.iter().all(|r| !r.exists() || remove_tree(r)) {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn set_mode(path: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    Ok(())
}

/// The API server's client certificate for admission webhooks, issued by a CA of its own
/// (`webhook-client-ca.crt`: what docs/helm.md's "Webhook client authentication" puts in
/// `scheduler.admissionWebhook.clientAuth.caBundle`, so no other certificate of the cluster opens
/// `/webhook`), and the AdmissionConfiguration that makes the API server present it to every
/// webhook that asks for one. Every cluster runs so: Tessera's extender asks (for
/// kube-scheduler's certificate) and must take a certificate of a CA it does not know as none
/// (the demo's cluster, without `clientAuth`, shows it does).
fn write_webhook_client(dir: &Path) -> Result<()> {
    let pki = Pki::new()?;
    write(&dir.join(WEBHOOK_CLIENT_CA), pki.ca_pem())?;
    let client = pki.client_in("kube-apiserver-webhook-client", &[])?;
    write(&dir.join("webhook-client.crt"), &client.cert)?;
    write(&dir.join("webhook-client.key"), &client.key)?;
    let kubeconfig = json!({
        "apiVersion": "v1", "kind": "Config",
        "users": [{
            "name": "*",
            "user": {
                "client-certificate": dir.join("webhook-client.crt"),
                "client-key": dir.join("webhook-client.key"),
            },
        }],
    });
    write(
        &dir.join("webhook-kubeconfig.yaml"),
        yaml_serde::to_string(&kubeconfig)?,
    )?;
    let webhook = json!({
        "apiVersion": "apiserver.config.k8s.io/v1",
        "kind": "WebhookAdmissionConfiguration",
        "kubeConfigFile": dir.join("webhook-kubeconfig.yaml"),
    });
    let admission = json!({
        "apiVersion": "apiserver.config.k8s.io/v1",
        "kind": "AdmissionConfiguration",
        "plugins": [
            {"name": "ValidatingAdmissionWebhook", "configuration": webhook},
            {"name": "MutatingAdmissionWebhook", "configuration": webhook},
        ],
    });
    write(
        &dir.join("admission.yaml"),
        yaml_serde::to_string(&admission)?,
    )
}

/// The aggregation layer's front proxy, as kubeadm sets it up: a CA of its own that only signs
/// the API server's proxy client certificate (`front-proxy-client`), so an aggregated API server
/// (Kueue's visibility API) trusts the user the API server forwards, and no other certificate
/// of the cluster can claim to be a forwarded user.
fn write_front_proxy(dir: &Path) -> Result<()> {
    let pki = Pki::new()?;
    write(&dir.join("front-proxy-ca.crt"), pki.ca_pem())?;
    let client = pki.client_in("front-proxy-client", &[])?;
    write(&dir.join("front-proxy-client.crt"), &client.cert)?;
    write(&dir.join("front-proxy-client.key"), &client.key)
}

/// The CA of the API server's webhook client certificate, in a cluster's directory; as a chart
/// value ([`ChartValues::Recommended`]) the word [`CLUSTER_WEBHOOK_CLIENT_CA`] stands for it.
const WEBHOOK_CLIENT_CA: &str = "webhook-client-ca.crt";

/// A [`ChartValues::Recommended`] value that `helm install` gets as the contents of the cluster's
/// webhook client CA (`--set-file`).
pub const CLUSTER_WEBHOOK_CLIENT_CA: &str = "<cluster webhook client CA>";

fn start_apiserver(
    a: &Artifacts,
    dir: &Path,
    etcd: u16,
    feature_gates: Option<&str>,
) -> Result<Proc> {
    let p = |f: &str| dir.join(f).display().to_string();
    let mut cmd = Command::new(&a.kube_apiserver);
    cmd.arg(format!("--etcd-servers=http://127.0.0.1:{etcd}"))
        // 443 on every address of the cluster's namespace: the `kubernetes` Service's ClusterIP
        // is one of them, so pods reach the API server where their in-cluster config says.
        .arg("--bind-address=0.0.0.0")
        .arg("--secure-port=443")
        .arg(format!("--advertise-address={}", netns::APISERVER_IP))
        .arg(format!("--cert-dir={}", p("apiserver-certs")))
        .arg(format!("--tls-cert-file={}", p("apiserver.crt")))
        .arg(format!("--tls-private-key-file={}", p("apiserver.key")))
        .arg(format!("--client-ca-file={}", p("ca.crt")))
        .arg(format!("--token-auth-file={}", p("tokens.csv")))
        .arg("--authorization-mode=Node,RBAC")
        .arg("--enable-admission-plugins=NodeRestriction")
        .arg(format!(
            "--admission-control-config-file={}",
            p("admission.yaml")
        ))
        // Webhook Services are reached at their endpoints (no kube-proxy in this network).
        .arg("--enable-aggregator-routing=true")
        .arg(format!(
            "--requestheader-client-ca-file={}",
            p("front-proxy-ca.crt")
        ))
        .arg("--requestheader-allowed-names=front-proxy-client")
        .arg("--requestheader-username-headers=X-Remote-User")
        .arg("--requestheader-group-headers=X-Remote-Group")
        .arg("--requestheader-extra-headers-prefix=X-Remote-Extra-")
        .arg(format!(
            "--proxy-client-cert-file={}",
            p("front-proxy-client.crt")
        ))
        .arg(format!(
            "--proxy-client-key-file={}",
            p("front-proxy-client.key")
        ))
        .arg(format!(
            "--kubelet-client-certificate={}",
            p("apiserver-kubelet-client.crt")
        ))
        .arg(format!(
            "--kubelet-client-key={}",
            p("apiserver-kubelet-client.key")
        ))
        .arg("--kubelet-preferred-address-types=InternalIP")
        .arg("--service-account-issuer=https://kubernetes.default.svc")
        .arg(format!("--service-account-key-file={}", p("sa.pub")))
        .arg(format!(
            "--service-account-signing-key-file={}",
            p("sa.key")
        ))
        .arg(format!(
            "--service-cluster-ip-range={}",
            netns::SERVICE_CIDR
        ))
        .arg("--allow-privileged=true")
        .arg("--profiling=false")
        .arg("--v=1");
    if let Some(g) = feature_gates {
        cmd.arg(format!("--feature-gates={g}"));
    }
    Ok(Proc::spawn("kube-apiserver", &dir.join("logs"), &mut cmd)?)
}

fn start_controller_manager(
    a: &Artifacts,
    dir: &Path,
    kubeconfig: &Path,
    feature_gates: Option<&str>,
) -> Result<Proc> {
    let mut cmd = Command::new(&a.kube_controller_manager);
    cmd.arg(format!("--kubeconfig={}", kubeconfig.display()))
        .arg(format!(
            "--authentication-kubeconfig={}",
            kubeconfig.display()
        ))
        .arg(format!(
            "--authorization-kubeconfig={}",
            kubeconfig.display()
        ))
        .arg("--bind-address=127.0.0.1")
        .arg(format!("--secure-port={}", free_port()))
        .arg("--use-service-account-credentials=true")
        .arg(format!(
            "--service-account-private-key-file={}",
            dir.join("sa.key").display()
        ))
        .arg(format!("--root-ca-file={}", dir.join("ca.crt").display()))
        .arg("--cluster-name=tessera-e2e")
        .arg("--leader-elect=false")
        .arg("--v=1");
    if let Some(g) = feature_gates {
        cmd.arg(format!("--feature-gates={g}"));
    }
    Ok(Proc::spawn(
        "kube-controller-manager",
        &dir.join("logs"),
        &mut cmd,
    )?)
}

/// The control plane's own scheduler (profile `default-scheduler`): it places the chart's pods
/// and every pod that asks for no GPU.
fn start_kube_scheduler(
    a: &Artifacts,
    dir: &Path,
    kubeconfig: &Path,
    feature_gates: Option<&str>,
) -> Result<Proc> {
    let config = dir.join("kube-scheduler.yaml");
    let doc = json!({
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "clientConnection": {"kubeconfig": kubeconfig},
        "leaderElection": {"leaderElect": false},
    });
    write(&config, yaml_serde::to_string(&doc)?)?;
    let mut cmd = Command::new(&a.kube_scheduler);
    cmd.arg(format!("--config={}", config.display()))
        .arg("--bind-address=127.0.0.1")
        .arg(format!("--secure-port={}", free_port()))
        .arg("--v=1");
    if let Some(g) = feature_gates {
        cmd.arg(format!("--feature-gates={g}"));
    }
    Ok(Proc::spawn("kube-scheduler", &dir.join("logs"), &mut cmd)?)
}

/// containerd's configuration for one node: its own root; state, socket and runc state under
/// the node's private /run; CRI with the local pause image, the node's CNI config, and the fake
/// NVIDIA runtime in front of runc.
fn containerd_config(
    node_dir: &Path,
    cni_conf: &Path,
    runtime: &Path,
    tools: &NodeTools,
) -> String {
    format!(
        r#"version = 2
root = "{root}"
state = "/run/containerd"

[grpc]
  address = "/run/containerd/containerd.sock"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  # Root cannot lower oom_score_adj on these machines; without this runc fails every sandbox.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "{runtime}"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni_bin}"
    conf_dir = "{cni_conf}"
"#,
        root = node_dir.join("containerd").display(),
        pause = crate::images::PAUSE_IMAGE,
        runtime = runtime.display(),
        cni_bin = tools.cni_bin_dir.display(),
        cni_conf = cni_conf.display(),
    )
}

/// containerd v2's configuration for a DRA node (config version 3): what [`containerd_config`]
/// sets, in v2's plugin names, plus CDI (on by default in v2; the kubelet's `CDI_devices` are
/// applied from the specs in /etc/cdi and /var/run/cdi, the node's own /run) and the v2 shim by
/// path (Debian's containerd package puts its 1.6 shim on PATH, which v2 would find first).
fn containerd_v2_config(
    node_dir: &Path,
    cni_conf: &Path,
    runtime: &Path,
    tools: &NodeTools,
    shim: &Path,
) -> String {
    format!(
        r#"version = 3
root = "{root}"
state = "/run/containerd"

[grpc]
  address = "/run/containerd/containerd.sock"

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{pause}"

[plugins."io.containerd.cri.v1.runtime"]
  # Root cannot lower oom_score_adj on these machines; without this runc fails every sandbox.
  restrict_oom_score_adj = true
  enable_cdi = true
  cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      runtime_path = "{shim}"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "{runtime}"
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["{cni_bin}"]
    conf_dir = "{cni_conf}"
"#,
        root = node_dir.join("containerd").display(),
        pause = crate::images::PAUSE_IMAGE,
        shim = shim.display(),
        runtime = runtime.display(),
        cni_bin = tools.cni_bin_dir.display(),
        cni_conf = cni_conf.display(),
    )
}

/// The kubelet's configuration: webhook authentication and authorisation against the API
/// server, the cluster CA for client certificates, its own address, and the settings this kind
/// of machine needs (cgroupfs without QoS cgroups, no swap check, no eviction thresholds).
fn kubelet_config(cluster_dir: &Path, ip: std::net::Ipv4Addr, dra: bool) -> serde_json::Value {
    let mut config = json!({
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": ip.to_string(),
        "port": 10250,
        "readOnlyPort": 0,
        "healthzPort": 0,
        "authentication": {
            "anonymous": {"enabled": false},
            "webhook": {"enabled": true},
            "x509": {"clientCAFile": cluster_dir.join("ca.crt")},
        },
        "authorization": {"mode": "Webhook"},
        "cgroupDriver": "cgroupfs",
        "cgroupsPerQOS": false,
        "enforceNodeAllocatable": [],
        "failSwapOn": false,
        "containerRuntimeEndpoint": "unix:///run/containerd/containerd.sock",
        "localStorageCapacityIsolation": false,
        "evictionHard": {},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "resolvConf": "",
        "serializeImagePulls": false,
        "clusterDomain": "cluster.local",
    });
    if dra {
        // The kubelet's part of serving an extended resource from a DeviceClass (KEP-5004):
        // admitting the pod without the resource in allocatable, and giving each container the
        // CDI devices of the claim kube-scheduler made for it.
        config["featureGates"] = json!({"DRAExtendedResource": true});
    }
    config
}

/// The name of the object of `api`'s kind whose UID is `uid`, if one is listed.
async fn name_with_uid<K>(api: Api<K>, uid: &str) -> Result<Option<String>>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    Ok(api
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .find(|o| o.meta().uid.as_deref() == Some(uid))
        .and_then(|o| o.meta().name.clone()))
}

//! A whole Tessera cluster on loopback: etcd, kube-apiserver, scheduler pods (kube-scheduler +
//! tessera-scheduler), a stand-in for the scheduler Service, and GPU nodes.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::Api;
use kube::api::{ListParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::artifacts::{Artifacts, artifacts};
use crate::certs::{Pki, service_account_key};
use crate::node::{AdmittedContainer, GpuNode, NodeEnv, NodeSpec};
use crate::process::{Proc, free_port};
use crate::{Error, Result, eventually};

/// The chart's release namespace, and the service-account users its RBAC names.
pub const NAMESPACE: &str = "tessera-system";
pub const SCHEDULER_USER: &str = "system:serviceaccount:tessera-system:tessera-scheduler";
pub const DEVICE_PLUGIN_USER: &str = "system:serviceaccount:tessera-system:tessera-device-plugin";
/// kube-scheduler's lease, as the chart's scheduler configuration names it.
pub const KUBE_SCHEDULER_LEASE: &str = "tessera-kube-scheduler";
/// The user tests create pods as: an ordinary cluster user.
pub const USER: &str = "alice@example.com";
/// kube-scheduler's user, as the cluster's own kube-scheduler authenticates.
pub const KUBE_SCHEDULER_USER: &str = "system:kube-scheduler";
/// The groups of a service account of the release namespace ([`ClusterOptions::apf`]).
const SERVICE_ACCOUNT_GROUPS: &str = "system:serviceaccounts,system:serviceaccounts:tessera-system";

#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// Names the run directory (`target/e2e-runs/<name>-…`), kept when the test fails.
    pub name: String,
    pub nodes: Vec<NodeSpec>,
    /// Scheduler pods, each a kube-scheduler beside a tessera-scheduler (the chart's layout).
    pub scheduler_pods: usize,
    /// Extra flags for every `tessera-scheduler serve`.
    pub tessera_args: Vec<String>,
    /// `Some(sets)`: the API server also serves MutatingAdmissionPolicy (Kubernetes 1.34's
    /// feature gate) and the chart's `admissionPolicy.podMutation` policies, rendered with these
    /// extra `--set` values, do the webhook's work in namespaces labeled
    /// [`POLICY_NAMESPACE_LABEL`]` = policy`; the webhook keeps every other namespace.
    pub pod_mutation_policy: Option<Vec<String>>,
    /// Kubernetes feature gates (`Name=true`) of the API server and of every kube-scheduler the
    /// cluster or a benchmark starts, e.g. DRA's `DRAConsumableCapacity=true`.
    pub feature_gates: Vec<String>,
    /// `true`: the components authenticate as in a real cluster, outside `system:masters` (the
    /// scheduler and the device plugin as their service accounts, kube-scheduler as
    /// `system:kube-scheduler`), authorized by a binding to `cluster-admin`, so API Priority and
    /// Fairness classifies their requests instead of exempting them; the chart's FlowSchemas are
    /// installed. The admin and [`USER`] stay in `system:masters`.
    pub apf: bool,
}

/// The namespace label that hands a namespace's pods to the pod-mutation policies instead of the
/// webhook ([`ClusterOptions::pod_mutation_policy`]).
pub const POLICY_NAMESPACE_LABEL: &str = "tessera.dev/admission";

/// A namespace `name` whose pods the pod-mutation policies admit, not the webhook
/// ([`POLICY_NAMESPACE_LABEL`]).
pub fn policy_namespace(name: &str) -> Namespace {
    let mut ns = Namespace::default();
    ns.metadata.name = Some(name.to_owned());
    ns.metadata.labels = Some([(POLICY_NAMESPACE_LABEL.to_owned(), "policy".to_owned())].into());
    ns
}

impl ClusterOptions {
    pub fn new(name: &str, nodes: Vec<NodeSpec>) -> ClusterOptions {
        ClusterOptions {
            name: name.to_owned(),
            nodes,
            scheduler_pods: 1,
            tessera_args: Vec::new(),
            pod_mutation_policy: None,
            feature_gates: Vec::new(),
            apf: false,
        }
    }
}

/// A scheduler pod: kube-scheduler and tessera-scheduler on one "pod" loopback, with their own
/// hostname (kube-scheduler's lease identity starts with it, as in a real pod).
#[derive(Debug)]
pub struct SchedulerPod {
    pub name: String,
    pub extender_port: u16,
    pub metrics_port: u16,
    kube_scheduler: Option<Proc>,
    tessera: Option<Proc>,
}

impl SchedulerPod {
    pub fn is_up(&self) -> bool {
        self.tessera.is_some()
    }
}

pub struct Cluster {
    pub dir: PathBuf,
    pub artifacts: &'static Artifacts,
    pki: Pki,
    admin: kube::Client,
    user: kube::Client,
    apiserver_port: u16,
    etcd: Proc,
    apiserver: Option<Proc>,
    pub scheduler_pods: Vec<SchedulerPod>,
    pub nodes: Vec<GpuNode>,
    service: tokio::task::JoinHandle<()>,
    opts: ClusterOptions,
    etcd_port: u16,
    /// Keep the run directory even without a panic (a failed start).
    keep: bool,
    /// Unix sockets, in a short path under /tmp.
    sockets: tempfile::TempDir,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.service.abort();
        self.nodes.clear();
        self.scheduler_pods.clear();
        self.apiserver = None;
        self.etcd.kill();
        crate::process::keep_or_remove_run_dir(&self.dir, self.keep);
    }
}

pub(crate) fn token(user: &str) -> String {
    format!("e2e-{}", user.replace([':', '@', '.'], "-"))
}

fn write_kubeconfig(path: &Path, port: u16, ca: &Path, user: &str) -> Result<()> {
    let doc = json!({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "e2e", "cluster": {
            "server": format!("https://127.0.0.1:{port}"),
            "certificate-authority": ca}}],
        "users": [{"name": "u", "user": {"token": token(user)}}],
        "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": "u"}}],
        "current-context": "e2e",
    });
    std::fs::write(path, yaml_serde::to_string(&doc)?)?;
    Ok(())
}

pub(crate) async fn client_for(path: &Path) -> Result<kube::Client> {
    let kc = Kubeconfig::read_from(path)?;
    let cfg = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
    Ok(kube::Client::try_from(cfg)?)
}

/// A plain-HTTP GET on loopback (etcd's /health, the daemons' /metrics).
pub async fn http_get(port: u16, path: &str) -> Option<String> {
    http_get_at("127.0.0.1", port, path).await
}

/// A plain-HTTP GET (health and metrics endpoints); `None` unless it answers 200.
pub async fn http_get_at(host: &str, port: u16, path: &str) -> Option<String> {
    http_get_bearer(host, port, path, None).await
}

/// [`http_get_at`] with `Authorization: Bearer <token>` when a token is given.
pub async fn http_get_bearer(
    host: &str,
    port: u16,
    path: &str,
    token: Option<&str>,
) -> Option<String> {
    let (status, body) = http_get_status(host, port, path, token).await?;
    (status == 200).then_some(body)
}

/// A plain-HTTP GET's status code and body (`None`: no answer within 7 s).
pub async fn http_get_status(
    host: &str,
    port: u16,
    path: &str,
    token: Option<&str>,
) -> Option<(u16, String)> {
    let mut s = tokio::time::timeout(
        Duration::from_secs(2),
        tokio::net::TcpStream::connect((host, port)),
    )
    .await
    .ok()?
    .ok()?;
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    let req = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\n{auth}Connection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.ok()?;
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf))
        .await
        .ok()?
        .ok()?;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.strip_prefix("HTTP/1.1 ")?.get(..3)?.parse().ok()?;
    let chunked = head
        .lines()
        .any(|l| l.to_ascii_lowercase().replace(' ', "") == "transfer-encoding:chunked");
    let body = if chunked {
        dechunk(body)?
    } else {
        body.to_owned()
    };
    Some((status, body))
}

/// The body of a `Transfer-Encoding: chunked` response (Go's servers send large answers so).
fn dechunk(mut rest: &str) -> Option<String> {
    let mut out = String::new();
    loop {
        let (size, after) = rest.split_once("\r\n")?;
        let size = usize::from_str_radix(size.split(';').next()?.trim(), 16).ok()?;
        if size == 0 {
            return Some(out);
        }
        out.push_str(after.get(..size)?);
        rest = after.get(size..)?.strip_prefix("\r\n")?;
    }
}

/// The scheduler Service's stand-in: forwards each TCP connection to the first scheduler pod
/// that accepts it, as a Service forwards to a ready endpoint.
fn spawn_service(
    port: u16,
    backends: std::sync::Arc<std::sync::Mutex<Vec<u16>>>,
) -> Result<tokio::task::JoinHandle<()>> {
    let std_listener = std::net::TcpListener::bind(("127.0.0.1", port))?;
    std_listener.set_nonblocking(true)?;
    let listener = tokio::net::TcpListener::from_std(std_listener)?;
    Ok(tokio::spawn(async move {
        loop {
            let Ok((mut inbound, _)) = listener.accept().await else {
                continue;
            };
            let ports = backends.lock().map(|b| b.clone()).unwrap_or_default();
            tokio::spawn(async move {
                for p in ports {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(("127.0.0.1", p)).await
                    {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                        return;
                    }
                }
            });
        }
    }))
}

impl Cluster {
    pub async fn start(opts: ClusterOptions) -> Result<Cluster> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let artifacts = artifacts()?;
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
        let ca = dir.join("ca.crt");
        std::fs::write(&ca, pki.ca_pem())?;
        let api_cert = pki.server("kube-apiserver", &["127.0.0.1", "localhost"])?;
        std::fs::write(dir.join("apiserver.crt"), &api_cert.cert)?;
        std::fs::write(dir.join("apiserver.key"), &api_cert.key)?;
        let sa = service_account_key()?;
        std::fs::write(dir.join("sa.key"), &sa.key)?;
        std::fs::write(dir.join("sa.pub"), &sa.cert)?;
        let ext = pki.server("tessera-scheduler", &["127.0.0.1", "localhost"])?;
        std::fs::write(dir.join("extender.crt"), &ext.cert)?;
        std::fs::write(dir.join("extender.key"), &ext.key)?;
        let ks_client = pki.client("kube-scheduler")?;
        std::fs::write(dir.join("extender-client.crt"), &ks_client.cert)?;
        std::fs::write(dir.join("extender-client.key"), &ks_client.key)?;
        // Static tokens. Every component is in system:masters unless `apf` (its groups then are
        // a service account's): the e2e proves the data path, the chart's RBAC is checked by the
        // chart tests.
        let (account, scheduler) = if opts.apf {
            (SERVICE_ACCOUNT_GROUPS, "system:authenticated")
        } else {
            ("system:masters", "system:masters")
        };
        let users = [
            ("admin", "system:masters"),
            (USER, "system:masters"),
            (SCHEDULER_USER, account),
            (DEVICE_PLUGIN_USER, account),
            (KUBE_SCHEDULER_USER, scheduler),
        ];
        let tokens: String = users
            .iter()
            .map(|(u, g)| format!("{},{u},{u},\"{g}\"\n", token(u)))
            .collect();
        std::fs::write(dir.join("tokens.csv"), tokens)?;

        let [etcd_port, etcd_peer_port] = crate::process::free_ports();
        let etcd = start_etcd(artifacts, &dir, etcd_port, etcd_peer_port)?;
        eventually(
            "etcd /health",
            Duration::from_secs(30),
            Duration::from_millis(100),
            || http_get(etcd_port, "/health"),
        )
        .await?;

        let apiserver_port = free_port();
        for (user, _) in &users {
            write_kubeconfig(&kubeconfig_path(&dir, user), apiserver_port, &ca, user)?;
        }
        let policy = opts.pod_mutation_policy.is_some();
        let mut apiserver = start_apiserver(artifacts, &dir, apiserver_port, etcd_port, &opts)?;
        let admin = client_for(&kubeconfig_path(&dir, "admin")).await?;
        let user = client_for(&kubeconfig_path(&dir, USER)).await?;
        wait_apiserver(&admin, &mut apiserver).await?;
        if opts.apf {
            let components = [SCHEDULER_USER, DEVICE_PLUGIN_USER, KUBE_SCHEDULER_USER];
            grant_cluster_admin(&admin, &dir, &components).await?;
            install_flow_schemas(artifacts, &admin).await?;
        }
        let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": NAMESPACE}}))?;
        let _ = Api::<Namespace>::all(admin.clone())
            .create(&PostParams::default(), &ns)
            .await;

        let service_port = free_port();
        let backends = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let service = spawn_service(service_port, backends.clone())?;
        install_webhook(artifacts, &admin, &pki, service_port, policy).await?;
        install_booking_policy(artifacts, &admin).await?;
        if let Some(sets) = &opts.pod_mutation_policy {
            install_pod_mutation_policy(artifacts, &admin, sets).await?;
        }

        let mut cluster = Cluster {
            dir,
            artifacts,
            pki,
            admin,
            user,
            apiserver_port,
            etcd,
            apiserver: Some(apiserver),
            scheduler_pods: Vec::new(),
            nodes: Vec::new(),

            service,
            opts: opts.clone(),
            etcd_port,
            keep: false,
            sockets: tempfile::Builder::new()
                .prefix("te2e-")
                .tempdir_in("/tmp")?,
        };
        match cluster.start_components(&opts, &backends).await {
            Ok(()) => Ok(cluster),
            Err(e) => {
                cluster.keep = true;
                Err(Error::msg(format!(
                    "{e}\n(logs: {})",
                    cluster.dir.join("logs").display()
                )))
            }
        }
    }

    async fn start_components(
        &mut self,
        opts: &ClusterOptions,
        backends: &std::sync::Arc<std::sync::Mutex<Vec<u16>>>,
    ) -> Result<()> {
        let cluster = self;
        for i in 0..opts.scheduler_pods {
            let name = format!("tessera-scheduler-{i}");
            let pod = cluster.start_scheduler_pod(&name)?;
            if let Ok(mut b) = backends.lock() {
                b.push(pod.extender_port);
            }
            cluster.scheduler_pods.push(pod);
            // The first pod takes both leases before the next one starts (deterministic roles).
            if i == 0 {
                cluster.wait_leader().await?;
                let prefix = format!("{name}_");
                eventually(
                    "kube-scheduler's lease held by the first scheduler pod",
                    Duration::from_secs(60),
                    Duration::from_millis(200),
                    || async {
                        cluster
                            .leases()
                            .await
                            .iter()
                            .any(|(l, h)| l == KUBE_SCHEDULER_LEASE && h.starts_with(&prefix))
                            .then_some(())
                    },
                )
                .await?;
            }
        }
        for spec in &opts.nodes {
            cluster.add_node(spec.clone()).await?;
        }
        cluster.wait_leader().await?;
        Ok(())
    }

    pub fn admin(&self) -> &kube::Client {
        &self.admin
    }

    /// The ordinary user's client (what `kubectl` of a cluster user would be).
    pub fn user(&self) -> &kube::Client {
        &self.user
    }

    /// The kubeconfig file of one of the cluster's users (`"admin"`, [`USER`], …).
    pub fn kubeconfig(&self, user: &str) -> PathBuf {
        kubeconfig_path(&self.dir, user)
    }

    /// Starts another upstream kube-scheduler with its default configuration (profile
    /// `default-scheduler`, no extender), logging to `logs/<name>.log`.
    pub fn spawn_plain_kube_scheduler(&self, name: &str) -> Result<Proc> {
        let config = self.dir.join(format!("{name}.yaml"));
        let doc = json!({
            "apiVersion": "kubescheduler.config.k8s.io/v1",
            "kind": "KubeSchedulerConfiguration",
            "clientConnection": {"kubeconfig": kubeconfig_path(&self.dir, KUBE_SCHEDULER_USER)},
            "leaderElection": {"leaderElect": false},
        });
        std::fs::write(&config, yaml_serde::to_string(&doc)?)?;
        let mut cmd = Command::new(&self.artifacts.kube_scheduler);
        cmd.arg(format!("--config={}", config.display()))
            .arg("--bind-address=127.0.0.1")
            .arg(format!("--secure-port={}", free_port()))
            .arg("--v=1")
            .args(self.kube_scheduler_gates());
        Ok(Proc::spawn(name, &self.dir.join("logs"), &mut cmd)?)
    }

    /// kube-scheduler's `--feature-gates` flag for [`ClusterOptions::feature_gates`], if any:
    /// every kube-scheduler of the cluster runs with the API server's gates.
    pub fn kube_scheduler_gates(&self) -> Option<String> {
        (!self.opts.feature_gates.is_empty())
            .then(|| format!("--feature-gates={}", self.opts.feature_gates.join(",")))
    }

    pub fn pki(&self) -> &Pki {
        &self.pki
    }

    pub fn node(&self, name: &str) -> Option<&GpuNode> {
        self.nodes.iter().find(|n| n.name() == name)
    }

    pub fn node_mut(&mut self, name: &str) -> Option<&mut GpuNode> {
        self.nodes.iter_mut().find(|n| n.name() == name)
    }

    /// What a GPU node of this cluster needs to start (its plugin binary, kubeconfig, fakes).
    pub fn node_env(&self) -> NodeEnv {
        NodeEnv {
            client: self.admin.clone(),
            kubeconfig: kubeconfig_path(&self.dir, DEVICE_PLUGIN_USER),
            plugin_binary: self.artifacts.tessera_device_plugin.clone(),
            nvml_lib: self.artifacts.driver_dir.join("libnvidia-ml.so.1"),
            shim: self.artifacts.shim.clone(),
            log_dir: self.dir.join("logs"),
        }
    }

    /// Starts a GPU node and waits until its plugin has published the register annotation.
    pub async fn add_node(&mut self, spec: NodeSpec) -> Result<()> {
        let dir = self.dir.join("nodes").join(&spec.name);
        let sockets = self.sockets.path().join(self.nodes.len().to_string());
        let name = spec.name.clone();
        let node = GpuNode::start(spec, &self.node_env(), &dir, &sockets).await?;
        self.nodes.push(node);
        let nodes: Api<Node> = Api::all(self.admin.clone());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let registered = nodes.get(&name).await.ok().is_some_and(|n| {
                n.metadata
                    .annotations
                    .is_some_and(|a| a.contains_key(hami_contract::annotations::NODE_REGISTER))
            });
            if registered {
                return Ok(());
            }
            let Some(node) = self.nodes.last_mut() else {
                return Err(Error::msg("node vanished"));
            };
            if !node.plugin_running() || tokio::time::Instant::now() >= deadline {
                return Err(Error::msg(format!(
                    "node {name}: the device plugin did not publish {}:\n{}",
                    hami_contract::annotations::NODE_REGISTER,
                    node.plugin_log()
                )));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn start_scheduler_pod(&self, name: &str) -> Result<SchedulerPod> {
        let [extender_port, metrics_port] = crate::process::free_ports();
        let tessera = self.spawn_tessera(name, extender_port, metrics_port)?;
        let kube_scheduler = self.spawn_kube_scheduler(name, extender_port)?;
        Ok(SchedulerPod {
            name: name.to_owned(),
            extender_port,
            metrics_port,
            kube_scheduler: Some(kube_scheduler),
            tessera: Some(tessera),
        })
    }

    /// `tessera-scheduler serve` on `port` (HTTPS, kube-scheduler's client certificate) and
    /// `metrics`, as this cluster's scheduler identity; the caller adds leadership flags.
    pub fn tessera_command(&self, port: u16, metrics: u16) -> Command {
        let mut cmd = Command::new(&self.artifacts.tessera_scheduler);
        cmd.arg("serve")
            .arg("--http-bind")
            .arg(format!("127.0.0.1:{port}"))
            .arg("--cert-file")
            .arg(self.dir.join("extender.crt"))
            .arg("--key-file")
            .arg(self.dir.join("extender.key"))
            .arg("--client-ca-file")
            .arg(self.dir.join("ca.crt"))
            .arg("--metrics-bind-address")
            .arg(format!("127.0.0.1:{metrics}"))
            .env("KUBECONFIG", kubeconfig_path(&self.dir, SCHEDULER_USER))
            .env("RUST_LOG", "info");
        cmd
    }

    fn spawn_tessera(&self, pod: &str, port: u16, metrics: u16) -> Result<Proc> {
        let mut cmd = self.tessera_command(port, metrics);
        cmd.args(["--leader-elect-resource-namespace", NAMESPACE])
            .args(["--identity", pod])
            // As the chart runs it: lead only beside the leading kube-scheduler.
            .arg(format!("--follow-lease={NAMESPACE}/{KUBE_SCHEDULER_LEASE}"))
            .args(&self.opts.tessera_args)
            .env("POD_NAME", pod);
        Ok(Proc::spawn(pod, &self.dir.join("logs"), &mut cmd)?)
    }

    /// kube-scheduler with the chart's rendered configuration; only the addresses and file paths
    /// that differ on a laptop are rewritten.
    fn spawn_kube_scheduler(&self, pod: &str, extender_port: u16) -> Result<Proc> {
        let config = scheduler_config(
            &self.artifacts.root,
            "kube-scheduler-config.yaml",
            &kubeconfig_path(&self.dir, KUBE_SCHEDULER_USER),
            extender_port,
            &self.dir,
        )?;
        let path = self.dir.join(format!("{pod}-kube-scheduler.yaml"));
        std::fs::write(&path, config)?;
        // Its own UTS namespace gives it the pod's hostname, which starts its lease identity.
        let mut cmd = Command::new("unshare");
        cmd.args(uts_unshare_args())
            .args(["--", "sh", "-c", "hostname \"$0\" && exec \"$@\"", pod])
            .arg(&self.artifacts.kube_scheduler)
            .arg(format!("--config={}", path.display()))
            .arg("--bind-address=127.0.0.1")
            .arg(format!("--secure-port={}", free_port()))
            .arg("--v=2")
            .args(self.kube_scheduler_gates());
        Ok(Proc::spawn(
            &format!("{pod}-kube-scheduler"),
            &self.dir.join("logs"),
            &mut cmd,
        )?)
    }

    /// Index of the scheduler pod whose tessera-scheduler reports itself leader.
    pub async fn leader(&self) -> Option<usize> {
        for (i, p) in self.scheduler_pods.iter().enumerate() {
            if !p.is_up() {
                continue;
            }
            if let Some(m) = http_get(p.metrics_port, "/metrics").await
                && m.lines().any(|l| l.trim() == "tessera_scheduler_leader 1")
            {
                return Some(i);
            }
        }
        None
    }

    pub async fn wait_leader(&self) -> Result<usize> {
        let r = eventually(
            "a tessera-scheduler leader",
            Duration::from_secs(60),
            Duration::from_millis(200),
            || self.leader(),
        )
        .await;
        r.map_err(|e| {
            let logs: String = self
                .scheduler_pods
                .iter()
                .filter_map(|p| {
                    p.tessera
                        .as_ref()
                        .map(|t| format!("{}:\n{}\n", p.name, t.tail(20)))
                })
                .collect();
            Error::msg(format!("{e}\n{logs}"))
        })
    }

    /// Kills (SIGKILL) both containers of scheduler pod `i`, as a node failure would.
    pub fn kill_scheduler_pod(&mut self, i: usize) {
        if let Some(p) = self.scheduler_pods.get_mut(i) {
            if let Some(mut t) = p.tessera.take() {
                t.kill();
            }
            if let Some(mut k) = p.kube_scheduler.take() {
                k.kill();
            }
        }
    }

    /// Kills (SIGKILL) only the kube-scheduler container of scheduler pod `i`.
    pub fn kill_kube_scheduler(&mut self, i: usize) {
        if let Some(mut k) = self
            .scheduler_pods
            .get_mut(i)
            .and_then(|p| p.kube_scheduler.take())
        {
            k.kill();
        }
    }

    /// Kills only the tessera-scheduler container of pod `i` and starts it again.
    pub fn restart_tessera(&mut self, i: usize) -> Result<()> {
        let (name, port, metrics) = match self.scheduler_pods.get_mut(i) {
            Some(p) => {
                if let Some(mut t) = p.tessera.take() {
                    t.kill();
                }
                (p.name.clone(), p.extender_port, p.metrics_port)
            }
            None => return Err(Error::msg(format!("no scheduler pod {i}"))),
        };
        let t = self.spawn_tessera(&name, port, metrics)?;
        if let Some(p) = self.scheduler_pods.get_mut(i) {
            p.tessera = Some(t);
        }
        Ok(())
    }

    /// Stops kube-apiserver for `down`, then starts it again on the same port and etcd.
    pub async fn restart_apiserver(&mut self, down: Duration) -> Result<()> {
        if let Some(mut a) = self.apiserver.take() {
            a.kill();
        }
        tokio::time::sleep(down).await;
        let mut a = start_apiserver(
            self.artifacts,
            &self.dir,
            self.apiserver_port,
            self.etcd_port,
            &self.opts,
        )?;
        let r = wait_apiserver(&self.admin, &mut a).await;
        self.apiserver = Some(a);
        r
    }

    /// Pods of a namespace.
    pub async fn pods(&self, namespace: &str) -> Result<Vec<Pod>> {
        Ok(Api::<Pod>::namespaced(self.admin.clone(), namespace)
            .list(&ListParams::default())
            .await?
            .items)
    }

    /// The admission record of a pod on whichever node admitted it.
    pub fn admitted(&self, uid: &str) -> Option<crate::node::Admitted> {
        self.nodes
            .iter()
            .find_map(|n| n.admitted().get(uid).cloned())
    }

    /// Runs the shim's C probe as container `c` would run: the environment from `Allocate`, every
    /// container path in it resolved through the returned mounts, and the shim loaded from the
    /// host file mounted at `/etc/ld.so.preload`'s entry (as `LD_PRELOAD`, which has the same
    /// effect without root), on the fake CUDA driver with a `gpu_memory_mib` card.
    pub fn run_container(
        &self,
        c: &AdmittedContainer,
        gpu_memory_mib: u64,
        args: &[&str],
    ) -> Result<Output> {
        let mounts: Vec<(String, String)> = c
            .response
            .mounts
            .iter()
            .map(|m| (m.container_path.clone(), m.host_path.clone()))
            .collect();
        let resolve = |container_path: &str| -> Option<String> {
            mounts
                .iter()
                .filter(|(cp, _)| {
                    container_path == cp.as_str()
                        || container_path.starts_with(&format!("{}/", cp.trim_end_matches('/')))
                })
                .max_by_key(|(cp, _)| cp.len())
                .map(|(cp, hp)| format!("{hp}{}", &container_path[cp.len()..]))
        };
        let shim = resolve(hami_contract_shim_path())
            .ok_or_else(|| Error::msg("Allocate mounted no libvgpu.so"))?;
        for (cp, hp) in &mounts {
            if cp == "/usr/local/vgpu" {
                std::fs::create_dir_all(hp)?;
            }
        }
        let mut cmd = Command::new(&self.artifacts.cuda_probe);
        cmd.args(args)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("LD_LIBRARY_PATH", &self.artifacts.driver_dir)
            .env("LD_PRELOAD", &shim)
            .env("FAKE_CUDA_MEMORY_MIB", gpu_memory_mib.to_string());
        for (k, v) in &c.response.envs {
            let v = if v.starts_with('/') {
                resolve(v).unwrap_or_else(|| v.clone())
            } else {
                v.clone()
            };
            cmd.env(k, v);
        }
        Ok(cmd.output()?)
    }

    /// Leases in the release namespace: `(name, holder)`.
    pub async fn leases(&self) -> Vec<(String, String)> {
        Api::<Lease>::namespaced(self.admin.clone(), NAMESPACE)
            .list(&ListParams::default())
            .await
            .map(|l| {
                l.items
                    .into_iter()
                    .map(|l| {
                        (
                            l.metadata.name.unwrap_or_default(),
                            l.spec.and_then(|s| s.holder_identity).unwrap_or_default(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The last lines of every log, for a failure message.
    pub fn logs_tail(&self, n: usize) -> String {
        crate::process::tail_all(&self.dir.join("logs"), n)
    }
}

/// `unshare` flags that give a child its own hostname: `--uts` as root, else inside a new user
/// namespace (unprivileged users on most distributions).
fn uts_unshare_args() -> &'static [&'static str] {
    static ARGS: std::sync::OnceLock<&'static [&'static str]> = std::sync::OnceLock::new();
    ARGS.get_or_init(|| {
        let works = |args: &[&str]| {
            Command::new("unshare")
                .args(args)
                .args(["--", "sh", "-c", "hostname e2e-probe"])
                .output()
                .is_ok_and(|o| o.status.success())
        };
        if works(&["--uts"]) {
            &["--uts"]
        } else {
            &["--user", "--map-root-user", "--uts"]
        }
    })
}

fn hami_contract_shim_path() -> &'static str {
    "/usr/local/vgpu/libvgpu.so"
}

pub(crate) fn kubeconfig_path(dir: &Path, user: &str) -> PathBuf {
    dir.join(format!("kubeconfig-{}", token(user)))
}

pub(crate) fn start_etcd(a: &Artifacts, dir: &Path, client: u16, peer: u16) -> Result<Proc> {
    let mut cmd = Command::new(&a.etcd);
    cmd.arg(format!("--data-dir={}", dir.join("etcd").display()))
        .arg(format!("--listen-client-urls=http://127.0.0.1:{client}"))
        .arg(format!("--advertise-client-urls=http://127.0.0.1:{client}"))
        .arg(format!("--listen-peer-urls=http://127.0.0.1:{peer}"))
        .arg(format!(
            "--initial-advertise-peer-urls=http://127.0.0.1:{peer}"
        ))
        .arg(format!("--initial-cluster=default=http://127.0.0.1:{peer}"))
        .arg("--unsafe-no-fsync=true")
        .arg("--log-level=warn");
    Ok(Proc::spawn("etcd", &dir.join("logs"), &mut cmd)?)
}

/// With [`ClusterOptions::pod_mutation_policy`] it also serves MutatingAdmissionPolicy (beta and
/// off by default in 1.34); [`ClusterOptions::feature_gates`] are added.
fn start_apiserver(
    a: &Artifacts,
    dir: &Path,
    port: u16,
    etcd: u16,
    opts: &ClusterOptions,
) -> Result<Proc> {
    let p = |f: &str| dir.join(f).display().to_string();
    let mut cmd = Command::new(&a.kube_apiserver);
    cmd.arg(format!("--etcd-servers=http://127.0.0.1:{etcd}"))
        .arg("--bind-address=127.0.0.1")
        .arg("--advertise-address=127.0.0.1")
        .arg(format!("--secure-port={port}"))
        .arg(format!("--cert-dir={}", p("apiserver-certs")))
        .arg(format!("--tls-cert-file={}", p("apiserver.crt")))
        .arg(format!("--tls-private-key-file={}", p("apiserver.key")))
        .arg(format!("--client-ca-file={}", p("ca.crt")))
        .arg(format!("--token-auth-file={}", p("tokens.csv")))
        .arg("--authorization-mode=RBAC")
        .arg(format!("--service-account-issuer=https://127.0.0.1:{port}"))
        .arg(format!("--service-account-key-file={}", p("sa.pub")))
        .arg(format!(
            "--service-account-signing-key-file={}",
            p("sa.key")
        ))
        .arg("--service-cluster-ip-range=10.0.0.0/24")
        // No kube-controller-manager creates the default ServiceAccount.
        .arg("--disable-admission-plugins=ServiceAccount")
        .arg("--allow-privileged=true")
        // Go's pprof endpoints only for a benchmark's profile (`e2e/benches/scheduling.rs`).
        .arg(format!(
            "--profiling={}",
            std::env::var_os("TESSERA_BENCH_PERF_DIR").is_some()
        ))
        .arg("--v=1");
    let mut gates = opts.feature_gates.clone();
    if opts.pod_mutation_policy.is_some() {
        gates.push("MutatingAdmissionPolicy=true".to_owned());
        cmd.arg("--runtime-config=admissionregistration.k8s.io/v1beta1=true");
    }
    if !gates.is_empty() {
        cmd.arg(format!("--feature-gates={}", gates.join(",")));
    }
    Ok(Proc::spawn("kube-apiserver", &dir.join("logs"), &mut cmd)?)
}

/// Waits until the apiserver serves and its bootstrap objects exist; fails at once, with its
/// log, if the process exits.
pub(crate) async fn wait_apiserver(admin: &kube::Client, proc_: &mut Proc) -> Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let ns: Api<Namespace> = Api::all(admin.clone());
        // The default namespace and the system priority classes are created by the apiserver's
        // own bootstrap controllers, after which it is usable.
        if ns.get("default").await.is_ok()
            && Api::<k8s_openapi::api::scheduling::v1::PriorityClass>::all(admin.clone())
                .get("system-node-critical")
                .await
                .is_ok()
        {
            return Ok(());
        }
        if !proc_.is_running() || tokio::time::Instant::now() >= deadline {
            return Err(Error::msg(format!(
                "kube-apiserver did not become ready:\n{}",
                proc_.tail(30)
            )));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// `charts/tessera/files/<file>` (asserted by the chart tests to be exactly what the chart
/// renders), with the apiserver connection added and the extender's port and client-certificate
/// paths pointed at this cluster.
pub fn scheduler_config(
    root: &Path,
    file: &str,
    kubeconfig: &Path,
    extender_port: u16,
    certs: &Path,
) -> Result<String> {
    let text = std::fs::read_to_string(root.join("charts/tessera/files").join(file))?;
    let mut cfg: yaml_serde::Value = yaml_serde::from_str(&text)?;
    cfg["clientConnection"] = yaml_serde::to_value(json!({"kubeconfig": kubeconfig}))?;
    let ext = cfg
        .get_mut("extenders")
        .and_then(|e| e.get_mut(0))
        .ok_or_else(|| Error::msg("the chart's scheduler config has no extender"))?;
    let url = ext["urlPrefix"].as_str().unwrap_or_default().to_owned();
    let (scheme, _) = url
        .rsplit_once(':')
        .ok_or_else(|| Error::msg(format!("urlPrefix {url:?} has no port")))?;
    ext["urlPrefix"] = yaml_serde::Value::from(format!("{scheme}:{extender_port}"));
    if let Some(tls) = ext.get_mut("tlsConfig") {
        tls["certFile"] =
            yaml_serde::Value::from(certs.join("extender-client.crt").display().to_string());
        tls["keyFile"] =
            yaml_serde::Value::from(certs.join("extender-client.key").display().to_string());
    }
    Ok(yaml_serde::to_string(&cfg)?)
}

/// One template of the chart as `helm template` renders it in the release namespace, with
/// `--set` values `sets`.
fn render_chart_template(a: &Artifacts, template: &str, sets: &[String]) -> Result<Vec<u8>> {
    let mut helm = Command::new(&a.helm);
    helm.args(["template", "tessera"])
        .arg(a.root.join("charts/tessera"))
        .args(["--namespace", NAMESPACE, "--show-only", template]);
    for set in sets {
        helm.arg("--set").arg(set);
    }
    let out = helm.output()?;
    if !out.status.success() {
        return Err(Error::msg(format!(
            "helm template {template} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    Ok(out.stdout)
}

/// The chart's `MutatingWebhookConfiguration`, rendered by helm with a URL client config (the
/// chart's `customURL`) pointing at the Service stand-in, and this cluster's CA bundle.
/// With `beside_policy`, namespaces labeled [`POLICY_NAMESPACE_LABEL`]` = policy` are left to
/// the pod-mutation policies (the chart's own `namespaceSelector` value).
async fn install_webhook(
    a: &Artifacts,
    admin: &kube::Client,
    pki: &Pki,
    port: u16,
    beside_policy: bool,
) -> Result<()> {
    let mut sets = vec![
        "scheduler.admissionWebhook.customURL.enabled=true".to_owned(),
        "scheduler.admissionWebhook.customURL.host=127.0.0.1".to_owned(),
        format!("scheduler.admissionWebhook.customURL.port={port}"),
    ];
    if beside_policy {
        let term = "scheduler.admissionWebhook.namespaceSelector.matchExpressions[0]";
        sets.extend([
            format!("{term}.key={POLICY_NAMESPACE_LABEL}"),
            format!("{term}.operator=NotIn"),
            format!("{term}.values[0]=policy"),
        ]);
    }
    let rendered = render_chart_template(a, "templates/webhook/mutatingwebhook.yaml", &sets)?;
    let mut mwc: MutatingWebhookConfiguration = yaml_serde::from_slice(&rendered)?;
    let ca = k8s_openapi::ByteString(pki.ca_pem().into_bytes());
    for w in mwc.webhooks.iter_mut().flatten() {
        w.client_config.ca_bundle = Some(ca.clone());
    }
    Api::<MutatingWebhookConfiguration>::all(admin.clone())
        .create(&PostParams::default(), &mwc)
        .await?;
    Ok(())
}

/// The chart's `booking-annotations` admission policy and its binding, as the chart renders
/// them: the API server refuses, on every pod write, booking annotations from anyone but the
/// scheduler and the device plugin (the webhook sees only CREATE). The chart's other policies
/// need tokens bound to pods and nodes, which the harness's static tokens are not. Returns once
/// the API server enforces it (policies take effect after its informer saw them).
async fn install_booking_policy(a: &Artifacts, admin: &kube::Client) -> Result<()> {
    use k8s_openapi::api::admissionregistration::v1::{
        ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
    };
    let rendered = render_chart_template(a, "templates/admission/policies.yaml", &[])?;
    let text = String::from_utf8_lossy(&rendered);
    let mut installed = 0;
    for doc in text.split("\n---") {
        let object: serde_json::Value = match yaml_serde::from_str(doc) {
            Ok(v) => v,
            Err(_) => continue,
        };
        let name = object["metadata"]["name"].as_str().unwrap_or_default();
        if !name.ends_with("-booking-annotations") {
            continue;
        }
        let pp = PostParams::default();
        match object["kind"].as_str() {
            Some("ValidatingAdmissionPolicy") => {
                let policy: ValidatingAdmissionPolicy = serde_json::from_value(object)?;
                Api::<ValidatingAdmissionPolicy>::all(admin.clone())
                    .create(&pp, &policy)
                    .await?;
            }
            Some("ValidatingAdmissionPolicyBinding") => {
                let binding: ValidatingAdmissionPolicyBinding = serde_json::from_value(object)?;
                Api::<ValidatingAdmissionPolicyBinding>::all(admin.clone())
                    .create(&pp, &binding)
                    .await?;
            }
            _ => continue,
        }
        installed += 1;
    }
    if installed != 2 {
        return Err(Error::msg(format!(
            "the chart's booking-annotations policy and binding: found {installed} of 2 objects"
        )));
    }
    // A forged booking on a pod the webhook does not see (`hami.io/webhook: ignore`), in a dry
    // run: refused once the policy is enforced.
    let probe: Pod = serde_json::from_value(json!({
        "metadata": {"name": "booking-policy-probe", "namespace": "default",
            "labels": {"hami.io/webhook": "ignore"},
            "annotations": {"hami.io/bind-phase": "allocating"}},
        "spec": {"containers": [{"name": "c", "image": "probe"}]},
    }))?;
    let pods = Api::<Pod>::namespaced(admin.clone(), "default");
    let dry_run = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    eventually(
        "the booking-annotations policy is enforced",
        Duration::from_secs(30),
        Duration::from_millis(200),
        || async {
            match pods.create(&dry_run, &probe).await {
                Err(e) if e.to_string().contains("Tessera admission policy") => Some(()),
                _ => None,
            }
        },
    )
    .await
}

/// Applies (server-side, forced) every object of a rendered chart template; returns how many.
async fn apply_rendered(admin: &kube::Client, rendered: &[u8]) -> Result<usize> {
    use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
    let text = String::from_utf8_lossy(rendered);
    let mut applied = 0;
    for doc in text.split("\n---") {
        let object: DynamicObject = match yaml_serde::from_str(doc) {
            Ok(o) => o,
            Err(_) => continue,
        };
        let Some(types) = object.types.clone() else {
            continue;
        };
        let (group, version) = types
            .api_version
            .split_once('/')
            .unwrap_or(("", types.api_version.as_str()));
        let gvk = GroupVersionKind::gvk(group, version, &types.kind);
        let kind = types.kind.to_ascii_lowercase();
        let plural = match kind.strip_suffix('y') {
            Some(stem) => format!("{stem}ies"),
            None => format!("{kind}s"),
        };
        let resource = ApiResource::from_gvk_with_plural(&gvk, &plural);
        let name = object.metadata.name.clone().unwrap_or_default();
        Api::<DynamicObject>::all_with(admin.clone(), &resource)
            .patch(
                &name,
                &kube::api::PatchParams::apply("tessera-e2e").force(),
                &kube::api::Patch::Apply(&object),
            )
            .await?;
        applied += 1;
    }
    Ok(applied)
}

/// The chart's FlowSchemas ([`ClusterOptions::apf`]), as the chart renders them by default.
async fn install_flow_schemas(a: &Artifacts, admin: &kube::Client) -> Result<()> {
    let rendered = render_chart_template(a, "templates/scheduler/flowschemas.yaml", &[])?;
    match apply_rendered(admin, &rendered).await? {
        2 => Ok(()),
        n => Err(Error::msg(format!(
            "the chart's FlowSchemas: found {n} of 2 objects"
        ))),
    }
}

/// Binds `users` to `cluster-admin` ([`ClusterOptions::apf`]: authorized, not exempt) and
/// returns once the API server's authorizer lets each of them list nodes.
async fn grant_cluster_admin(admin: &kube::Client, dir: &Path, users: &[&str]) -> Result<()> {
    use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
    let subjects: Vec<serde_json::Value> = users
        .iter()
        .map(|u| json!({"kind": "User", "apiGroup": "rbac.authorization.k8s.io", "name": u}))
        .collect();
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "tessera-e2e-components"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
            "name": "cluster-admin"},
        "subjects": subjects,
    }))?;
    Api::<ClusterRoleBinding>::all(admin.clone())
        .create(&PostParams::default(), &binding)
        .await?;
    for user in users {
        let client = client_for(&kubeconfig_path(dir, user)).await?;
        let nodes = Api::<Node>::all(client);
        eventually(
            &format!("{user} authorized by its binding"),
            Duration::from_secs(30),
            Duration::from_millis(200),
            || async { nodes.list(&ListParams::default().limit(1)).await.ok() },
        )
        .await?;
    }
    Ok(())
}

/// The chart's `admissionPolicy.podMutation` objects (a MutatingAdmissionPolicy, a
/// ValidatingAdmissionPolicy and their bindings), rendered with `sets`, bound to the namespaces
/// labeled [`POLICY_NAMESPACE_LABEL`]` = policy`; applied (server-side), so a second call
/// replaces them. Returns once the API server applies a pod-mutation policy: a probe
/// namespace's dry-run GPU pod is handed to the scheduler and an out-of-range percentage is
/// refused. After a second call that may still be the first version: a caller waits for what
/// the new values change.
pub async fn install_pod_mutation_policy(
    a: &Artifacts,
    admin: &kube::Client,
    sets: &[String],
) -> Result<()> {
    let mut all = vec![
        "admissionPolicy.podMutation.enabled=true".to_owned(),
        format!(
            "scheduler.admissionWebhook.namespaceSelector.matchLabels.{}=policy",
            POLICY_NAMESPACE_LABEL.replace('.', "\\.")
        ),
    ];
    all.extend(sets.iter().cloned());
    let rendered = render_chart_template(a, "templates/admission/pod-mutation.yaml", &all)?;
    let installed = apply_rendered(admin, &rendered).await?;
    if installed != 4 {
        return Err(Error::msg(format!(
            "the chart's pod-mutation policies and bindings: found {installed} of 4 objects"
        )));
    }
    let probe_ns = "tessera-policy-probe";
    match Api::<Namespace>::all(admin.clone())
        .create(&PostParams::default(), &policy_namespace(probe_ns))
        .await
    {
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        other => {
            other?;
        }
    }
    let probe = |name: &str, pct: &str| -> Result<Pod> {
        Ok(serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": probe_ns},
            "spec": {"containers": [{"name": "c", "image": "probe",
                "resources": {"limits": {"nvidia.com/gpumem-percentage": pct}}}]},
        }))?)
    };
    let (mutated, refused) = (probe("mutated", "50")?, probe("refused", "101")?);
    let pods = Api::<Pod>::namespaced(admin.clone(), probe_ns);
    let dry_run = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    eventually(
        "the pod-mutation policies are applied",
        Duration::from_secs(30),
        Duration::from_millis(200),
        || async {
            let scheduler = pods
                .create(&dry_run, &mutated)
                .await
                .ok()?
                .spec?
                .scheduler_name?;
            let refused = match pods.create(&dry_run, &refused).await {
                Err(e) => e.to_string().contains("Tessera admission policy"),
                Ok(_) => false,
            };
            (scheduler != "default-scheduler" && refused).then_some(())
        },
    )
    .await
}

#[cfg(test)]
mod http_tests {
    #[test]
    fn chunked_bodies_are_joined() {
        assert_eq!(
            super::dechunk("5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\n\r\n").as_deref(),
            Some("hello, world")
        );
        assert_eq!(super::dechunk("5\r\nhel"), None);
    }
}

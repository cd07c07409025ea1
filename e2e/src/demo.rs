//! `make demo`: a local cluster of three real nodes with different (simulated) GPU models and
//! Tessera installed by `helm install`, the pods of `examples/demo/pods.yaml`, a table of which
//! pod got which GPU slice and why the others wait, and what each placed pod sees from inside its
//! container. The cluster stays up, reachable with the printed kubeconfig, until Ctrl-C (or
//! SIGTERM), which removes everything it made.
//!
//! The pods are submitted in file order, each one only once the previous one is placed or has a
//! verdict, so the table is the same on every run.
//!
//! [`run_harness`] is the same submission on harness nodes (`e2e/tests/scenarios.rs`).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use base64::Engine as _;
use hami_contract::annotations::{BIND_PHASE, BIND_PHASE_FAILED, BIND_PHASE_SUCCESS};
use hami_contract::devices::PodDevices;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{LogParams, PostParams};
use serde_json::json;

use crate::cluster::{Cluster, ClusterOptions};
use crate::netns::{self, ClusterNetwork};
use crate::node::NodeSpec;
use crate::pods::{annotation, node_of};
use crate::real::{ChartValues, PROBE_IMAGE, RealCluster, RealClusterOptions, RealNodeSpec};
use crate::{Error, Result};

/// The demo's nodes.
pub fn demo_nodes() -> Vec<NodeSpec> {
    vec![
        NodeSpec::uniform("t4-node", 2, "Tesla T4", 15360),
        NodeSpec::uniform("a100-node", 4, "NVIDIA A100-SXM4-40GB", 40960),
        NodeSpec::uniform("h100-node", 1, "NVIDIA H100 80GB HBM3", 81559),
    ]
}

/// Pods of a multi-document YAML file, in file order. Every pod needs a name, and names are
/// unique.
pub fn read_pods(path: &Path) -> Result<Vec<Pod>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::msg(format!("reading {}: {e}", path.display())))?;
    let mut pods: Vec<Pod> = Vec::new();
    for (i, doc) in yaml_serde::Deserializer::from_str(&text).enumerate() {
        let bad = |e: yaml_serde::Error| {
            Error::msg(format!("{}: document {}: {e}", path.display(), i + 1))
        };
        let v = <yaml_serde::Value as serde::Deserialize>::deserialize(doc).map_err(bad)?;
        if v.is_null() {
            continue;
        }
        let pod = yaml_serde::from_value::<Pod>(v).map_err(bad)?;
        let Some(name) = pod.metadata.name.as_deref().filter(|n| !n.is_empty()) else {
            return Err(Error::msg(format!(
                "{}: document {}: a pod without metadata.name",
                path.display(),
                i + 1
            )));
        };
        if pods
            .iter()
            .any(|p| p.metadata.name.as_deref() == Some(name))
        {
            return Err(Error::msg(format!(
                "{}: two pods named {name}",
                path.display()
            )));
        }
        if pod.spec.as_ref().is_none_or(|s| s.containers.is_empty()) {
            return Err(Error::msg(format!(
                "{}: pod {name} has no containers",
                path.display()
            )));
        }
        pods.push(pod);
    }
    if pods.is_empty() {
        return Err(Error::msg(format!("{}: no pods", path.display())));
    }
    Ok(pods)
}

/// One row of the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    pub pod: String,
    pub node: Option<String>,
    /// `GPU model (uuid tail): MiB, cores%` per device.
    pub slices: Vec<String>,
    /// Why it is not placed (admission denial or the scheduler's reasons).
    pub why: String,
}

/// What became of one submitted pod.
#[derive(Debug, Clone)]
enum Verdict {
    /// On a node, its devices allocated; the pod as last read.
    Placed(Box<Pod>),
    /// Not placed, and why.
    Pending(String),
}

fn namespace_of(p: &Pod) -> String {
    p.metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into())
}

fn short_api_error(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) => s.message.clone(),
        other => other.to_string(),
    }
}

/// The scheduler's reason for not placing the pod (`PodScheduled=False` with a message).
fn unschedulable(p: &Pod) -> Option<String> {
    p.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "PodScheduled" && c.status == "False")?
        .message
        .clone()
        .filter(|m| !m.is_empty())
}

/// Submits `pods` in order as `client`, each one only after the previous one is placed
/// (`placed`) or has a verdict (refused at admission, unschedulable with a message, allocation
/// failed), so that what each pod finds on the nodes never depends on timing.
async fn submit_in_order<F>(
    client: &kube::Client,
    pods: &[Pod],
    within: Duration,
    mut placed: F,
) -> Vec<(String, Verdict)>
where
    F: FnMut(&Pod) -> bool,
{
    let mut out = Vec::new();
    for p in pods {
        let name = p.metadata.name.clone().unwrap_or_default();
        let api = Api::<Pod>::namespaced(client.clone(), &namespace_of(p));
        if let Err(e) = api.create(&PostParams::default(), p).await {
            let why = format!("refused at admission: {}", short_api_error(&e));
            out.push((name, Verdict::Pending(why)));
            continue;
        }
        let deadline = tokio::time::Instant::now() + within;
        let verdict = loop {
            if let Ok(Some(live)) = api.get_opt(&name).await {
                if placed(&live) {
                    break Verdict::Placed(Box::new(live));
                }
                if annotation(&live, BIND_PHASE) == Some(BIND_PHASE_FAILED) {
                    break Verdict::Pending(format!(
                        "bound to {} but its devices could not be allocated",
                        node_of(&live).unwrap_or_default()
                    ));
                }
                if let Some(why) = unschedulable(&live) {
                    break Verdict::Pending(why);
                }
            }
            if tokio::time::Instant::now() >= deadline {
                break Verdict::Pending(format!("no verdict within {} s", within.as_secs()));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        out.push((name, verdict));
    }
    out
}

/// The table's rows: `models` maps GPU UUIDs to model names.
fn rows_of(verdicts: &[(String, Verdict)], models: &BTreeMap<String, String>) -> Vec<Row> {
    verdicts
        .iter()
        .map(|(name, v)| match v {
            Verdict::Placed(p) => Row {
                pod: name.clone(),
                node: node_of(p),
                slices: slices_of(p, models),
                why: String::new(),
            },
            Verdict::Pending(why) => Row {
                pod: name.clone(),
                node: None,
                slices: Vec::new(),
                why: why.clone(),
            },
        })
        .collect()
}

fn slices_of(p: &Pod, models: &BTreeMap<String, String>) -> Vec<String> {
    annotation(p, hami_contract::annotations::DEVICES_ALLOCATED)
        .and_then(|v| PodDevices::decode(v).ok())
        .map(|d| {
            d.0.iter()
                .flatten()
                .map(|d| {
                    let model = models.get(&d.uuid).cloned().unwrap_or_default();
                    let tail = d
                        .uuid
                        .rsplit('-')
                        .next()
                        .unwrap_or("")
                        .trim_start_matches('0');
                    // HAMi's 0 cores is no SM limit (the whole GPU's time, shared), not none.
                    let cores = match d.usedcores {
                        0 => "no SM limit".to_owned(),
                        c => format!("{c}% SMs"),
                    };
                    format!(
                        "{model} (#{}): {} MiB, {cores}",
                        if tail.is_empty() { "0" } else { tail },
                        d.usedmem,
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

fn models_of(nodes: &[NodeSpec]) -> BTreeMap<String, String> {
    nodes
        .iter()
        .flat_map(|n| n.gpus.iter().map(|g| (g.uuid.clone(), g.model.clone())))
        .collect()
}

/// The table, as printed.
pub fn render(rows: &[Row]) -> String {
    let w = rows.iter().map(|r| r.pod.len()).max().unwrap_or(3).max(3);
    let nw = rows
        .iter()
        .map(|r| r.node.as_deref().map_or(7, str::len))
        .max()
        .unwrap_or(4)
        .max(4);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<w$}  {:<nw$}  GPU SLICE / WHY NOT PLACED",
        "POD", "NODE"
    );
    for r in rows {
        match &r.node {
            Some(n) => {
                for (i, s) in r.slices.iter().enumerate() {
                    let (pod, node) = if i == 0 {
                        (r.pod.as_str(), n.as_str())
                    } else {
                        ("", "")
                    };
                    let _ = writeln!(out, "{pod:<w$}  {node:<nw$}  {s}");
                }
            }
            None => {
                let _ = writeln!(out, "{:<w$}  {:<nw$}  {}", r.pod, "pending", r.why);
            }
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Harness nodes (e2e/tests/scenarios.rs).

/// The demo's pods on harness nodes: starts the cluster, submits the pods in file order as the
/// tenant, and returns the cluster (still running) with the rows. A pod is placed once a harness
/// kubelet admitted it.
pub async fn run_harness(pods_file: &Path) -> Result<(Cluster, Vec<Row>)> {
    let pods = read_pods(pods_file)?;
    let cluster = Cluster::start(ClusterOptions::new("demo", demo_nodes())).await?;
    let verdicts = submit_in_order(cluster.user(), &pods, Duration::from_secs(60), |p| {
        let uid = p.metadata.uid.clone().unwrap_or_default();
        node_of(p).is_some() && cluster.admitted(&uid).is_some()
    })
    .await;
    let rows = rows_of(&verdicts, &models_of(&demo_nodes()));
    Ok((cluster, rows))
}

// ---------------------------------------------------------------------------------------------
// Real nodes (`make demo`).

/// What each demo container runs instead of its image's program: one line of what it sees from
/// inside (GPU 0's total as `cuMemGetInfo` reports it through the shim, whether NVML reports the
/// same total, the processes NVML lists and the GPU utilization it reports while the probe
/// holds 1 MiB: the container's own, however many pods share the GPU; the limits the device
/// plugin set), then it sleeps so the pod stays Running.
const REPORT_SCRIPT: &str = r#"T=$(cuda_probe info 2>/dev/null | sed -n 's/^total=\([0-9]*\).*/\1/p'); T=${T:-0}
if cuda_probe nvml "$T" >/dev/null 2>&1; then N="$((T / 1048576)) MiB"; else N="not $((T / 1048576)) MiB"; fi
S=$(cuda_probe smi 1048576 0 2>/dev/null)
P=$(echo "$S" | sed -n 's/^LIST nvmlDeviceGetComputeRunningProcesses_v3 n=\([0-9]*\).*/\1/p')
U=$(echo "$S" | sed -n 's/^UTIL gpu=\([0-9]*\).*/\1/p')
echo "REPORT GPU 0: cuMemGetInfo total $((T / 1048576)) MiB, NVML total $N, NVML processes ${P:-?} (its own), GPU-Util ${U:-?} %; CUDA_DEVICE_MEMORY_LIMIT_0=${CUDA_DEVICE_MEMORY_LIMIT_0:-unset}${CUDA_DEVICE_MEMORY_LIMIT_1:+ CUDA_DEVICE_MEMORY_LIMIT_1=$CUDA_DEVICE_MEMORY_LIMIT_1} CUDA_DEVICE_SM_LIMIT=${CUDA_DEVICE_SM_LIMIT:-unset}"
exec sleep 2147483647"#;

/// The prefix of the line [`REPORT_SCRIPT`] prints.
const REPORT_PREFIX: &str = "REPORT ";

/// The pod as the demo submits it: every container runs [`PROBE_IMAGE`] (there is no registry
/// here) with [`REPORT_SCRIPT`]; names, annotations and resources are the file's.
pub fn as_probe_pod(p: &Pod) -> Pod {
    let mut p = p.clone();
    if let Some(spec) = p.spec.as_mut() {
        for c in &mut spec.containers {
            c.image = Some(PROBE_IMAGE.to_owned());
            c.image_pull_policy = Some("Never".to_owned());
            c.command = Some(vec![
                "/bin/sh".to_owned(),
                "-c".to_owned(),
                REPORT_SCRIPT.to_owned(),
            ]);
            c.args = None;
        }
        // Stopped at once when deleted (`sleep`, the container's PID 1, ignores SIGTERM).
        spec.termination_grace_period_seconds = Some(0);
    }
    p
}

/// Placed on a real node: bound, and the device plugin allocated its devices (or it runs).
fn placed_on_real_node(p: &Pod) -> bool {
    node_of(p).is_some()
        && (annotation(p, BIND_PHASE) == Some(BIND_PHASE_SUCCESS)
            || p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
}

/// The report line of each container of a placed pod (`POD` or `POD/CONTAINER` first), waiting
/// up to `within` for it.
async fn report_lines(client: &kube::Client, pod: &Pod, within: Duration) -> Vec<String> {
    let name = pod.metadata.name.clone().unwrap_or_default();
    let api = Api::<Pod>::namespaced(client.clone(), &namespace_of(pod));
    let containers: Vec<String> = pod
        .spec
        .as_ref()
        .map(|s| s.containers.iter().map(|c| c.name.clone()).collect())
        .unwrap_or_default();
    let deadline = tokio::time::Instant::now() + within;
    let mut out = Vec::new();
    for c in &containers {
        let label = if containers.len() == 1 {
            name.clone()
        } else {
            format!("{name}/{c}")
        };
        let line = loop {
            let lp = LogParams {
                container: Some(c.clone()),
                ..LogParams::default()
            };
            if let Ok(logs) = api.logs(&name, &lp).await
                && let Some(l) = logs.lines().find_map(|l| l.strip_prefix(REPORT_PREFIX))
            {
                break l.to_owned();
            }
            if tokio::time::Instant::now() >= deadline {
                break format!("(no report within {} s)", within.as_secs());
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        };
        out.push(format!("{label}: {line}"));
    }
    out
}

/// A kubeconfig for the administrator that reaches the API server at `127.0.0.1:port` (the
/// demo's forwarder, in the host's network namespace), with the cluster CA inline.
fn host_kubeconfig(ca_pem: &[u8], port: u16) -> Result<String> {
    let doc = json!({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "tessera-demo", "cluster": {
            "server": format!("https://127.0.0.1:{port}"),
            "certificate-authority-data": base64::engine::general_purpose::STANDARD.encode(ca_pem)}}],
        "users": [{"name": "admin", "user": {"token": crate::cluster::token("admin")}}],
        "contexts": [{"name": "tessera-demo", "context": {"cluster": "tessera-demo", "user": "admin"}}],
        "current-context": "tessera-demo",
    });
    Ok(yaml_serde::to_string(&doc)?)
}

/// Forwards every connection to `listener` (made in the host's network namespace) to the API
/// server. Runs on the cluster's thread, so the upstream sockets are made in the cluster's
/// namespace, where 10.200.0.1 lives.
async fn forward_to_apiserver(listener: tokio::net::TcpListener) {
    loop {
        match listener.accept().await {
            Ok((mut inbound, _)) => {
                tokio::spawn(async move {
                    if let Ok(mut up) =
                        tokio::net::TcpStream::connect((netns::APISERVER_IP, 443)).await
                    {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut up).await;
                    }
                });
            }
            // Out of file descriptors or similar: try again shortly.
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Starts the cluster, places the pods, prints the table, the reports and the kubeconfig, and
/// (unless `once`) keeps everything running until the future is dropped.
async fn run_real(
    net: ClusterNetwork,
    pods: Vec<Pod>,
    listener: std::net::TcpListener,
    name: String,
    once: bool,
) -> Result<()> {
    let t0 = Instant::now();
    eprintln!(
        "demo: starting etcd, kube-apiserver, kube-controller-manager, kube-scheduler and 3 real \
         nodes (kubelet + containerd), then `helm install` of charts/tessera …"
    );
    let nodes = demo_nodes();
    let cluster = RealCluster::start(
        net,
        RealClusterOptions {
            name,
            nodes: nodes.iter().cloned().map(RealNodeSpec::gpu).collect(),
            chart: ChartValues::Recommended(Vec::new()),
        },
    )
    .await?;
    eprintln!(
        "demo: cluster up and Tessera installed in {:.0} s; submitting {} pods in file order",
        t0.elapsed().as_secs_f64(),
        pods.len()
    );
    listener.set_nonblocking(true)?;
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let port = listener.local_addr()?.port();
    let forwarder = tokio::spawn(forward_to_apiserver(listener));
    let kubeconfig = cluster.dir.join("kubeconfig");
    let ca = std::fs::read(cluster.dir.join("ca.crt"))?;
    std::fs::write(&kubeconfig, host_kubeconfig(&ca, port)?)?;

    let probes: Vec<Pod> = pods.iter().map(as_probe_pod).collect();
    let verdicts = submit_in_order(
        cluster.admin(),
        &probes,
        Duration::from_secs(120),
        placed_on_real_node,
    )
    .await;
    let rows = rows_of(&verdicts, &models_of(&nodes));
    say(&render(&rows));
    say(&format!(
        "Inside the placed pods (each container runs {PROBE_IMAGE} instead of its image, as there \
         is no registry: it prints this line, then sleeps):"
    ));
    for (_, v) in &verdicts {
        if let Verdict::Placed(p) = v {
            for line in report_lines(cluster.admin(), p, Duration::from_secs(120)).await {
                say(&line);
            }
        }
    }
    // Who uses which GPU, as an operator asks it: the kubectl plugin, with the administrator's
    // credentials.
    let (_, gpus) = cluster.kubectl_tessera(false, &["gpus"]).await?;
    say("");
    say("kubectl tessera gpus:");
    say(gpus.trim_end());
    say("");
    say(&format!("kubeconfig: {}", kubeconfig.display()));
    eprintln!(
        "demo: ready after {:.0} s. Try `kubectl --kubeconfig {} get pods -o wide`.\n\
         demo: press Ctrl-C to stop the cluster and remove everything it made",
        t0.elapsed().as_secs_f64(),
        kubeconfig.display()
    );
    if !once {
        std::future::pending::<()>().await;
    }
    forwarder.abort();
    drop(cluster);
    Ok(())
}

/// How the cluster's thread ended.
enum Ending {
    Done(Result<()>),
    Signal(&'static str),
}

/// True when this process runs as root (the owner of `/proc/self` is the effective user).
fn is_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// Every process descended from `root` (a pid), as this moment's `/proc` shows them.
pub fn descendants_of(root: i32) -> Vec<i32> {
    // pid 0 is the parent of init and of the kernel's threads: never a root here.
    if root <= 1 {
        return Vec::new();
    }
    let mut parent: Vec<(i32, i32)> = Vec::new();
    if let Ok(rd) = std::fs::read_dir("/proc") {
        for e in rd.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
                continue;
            };
            // `pid (comm) state ppid …`; comm may hold spaces and parentheses.
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|s| s.parse::<i32>().ok());
            if let Some(ppid) = ppid {
                parent.push((pid, ppid));
            }
        }
    }
    let mut out = Vec::new();
    let mut frontier = vec![root];
    while let Some(p) = frontier.pop() {
        for (c, _) in parent.iter().filter(|(_, pp)| *pp == p) {
            out.push(*c);
            frontier.push(*c);
        }
    }
    out
}

/// After an interrupted start: kills whatever child is left (a `helm install` still waiting) and
/// removes the run directories of this process (`target/e2e-runs/<name>-*`).
fn sweep(run_dir_prefix: &str) {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    for pid in descendants_of(i32::try_from(std::process::id()).unwrap_or(0)) {
        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
    }
    let runs = crate::artifacts::workspace_root().join("target/e2e-runs");
    if let Ok(rd) = std::fs::read_dir(&runs) {
        for e in rd.flatten() {
            if e.file_name()
                .to_str()
                .is_some_and(|n| n.starts_with(run_dir_prefix))
            {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
}

/// The CLI's entry: the real-node demo. Prints the table, the reports and the kubeconfig, then
/// waits for Ctrl-C or SIGTERM (or returns at once with `once`); either way everything it started
/// is stopped and removed before it returns.
pub fn main(pods_file: &Path, once: bool) -> Result<()> {
    let pods = read_pods(pods_file)?;
    if !is_root() {
        return Err(Error::msg(
            "the demo runs real nodes (their own mount, PID and network namespaces): run it as \
             root",
        ));
    }
    // In the host's network namespace: the cluster's thread leaves it below.
    let listener = std::net::TcpListener::bind("127.0.0.1:0")
        .map_err(|e| Error::msg(format!("listening on 127.0.0.1: {e}")))?;
    let name = format!("demo-{}", std::process::id());
    let prefix = format!("{name}-");
    let nodes = demo_nodes().len();
    let ending = std::thread::Builder::new()
        .name("demo-cluster".into())
        .spawn(move || -> Result<Ending> {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let ending = rt.block_on(async move {
                use tokio::signal::unix::{SignalKind, signal};
                let mut int = signal(SignalKind::interrupt())?;
                let mut term = signal(SignalKind::terminate())?;
                // Built from Go modules on first use: before the namespace, where the module
                // proxy is out of reach.
                crate::artifacts::artifacts()?;
                let net = ClusterNetwork::enter(nodes)?;
                // Dropping the demo's future (on a signal) drops the cluster, which stops and
                // removes everything it started.
                Ok::<_, Error>(tokio::select! {
                    biased;
                    _ = int.recv() => Ending::Signal("SIGINT"),
                    _ = term.recv() => Ending::Signal("SIGTERM"),
                    r = run_real(net, pods, listener, name, once) => Ending::Done(r),
                })
            });
            // A `helm install` interrupted mid-way still runs on a blocking thread: the sweep
            // below ends it; do not wait for it here.
            rt.shutdown_background();
            ending
        })?
        .join()
        .map_err(|_| Error::msg("the demo's cluster thread panicked"))??;
    match ending {
        Ending::Done(r) => r,
        Ending::Signal(sig) => {
            sweep(&prefix);
            eprintln!("demo: {sig}: stopped every process and removed the cluster's files");
            Ok(())
        }
    }
}

//! `kubectl tessera`: Tessera's GPU sharing from a terminal, with the caller's own credentials
//! and RBAC. Installed as `kubectl-tessera` on the PATH (or through krew), kubectl runs it for
//! `kubectl tessera …`.
//!
//! Every answer comes from the scheduler's own decision code (`tessera-scheduler-core`) run on a
//! snapshot of the cluster read with the caller's credentials: nothing is written, and what the
//! caller may not list is left out and said so.

use std::io::Write as _;
use std::path::PathBuf;

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand, ValueEnum};
use k8s_openapi::api::core::v1::{Event, Node, Pod, ResourceQuota};
use kube::api::ListParams;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};
use tessera_scheduler_core::config::DecisionConfig;
use tessera_scheduler_core::fit::FitReason;
use tessera_scheduler_core::inventory;
use tessera_scheduler_core::simulate::{self, Input, PodResult};

mod doctor;
mod migrate;
mod top;

#[derive(Debug, Parser)]
#[command(
    name = "kubectl-tessera",
    version = tessera_runtime::build_info::version(),
    about = "Tessera's GPU sharing from a terminal: who uses which GPU, why a GPU pod is pending, \
             where pods would go. Reads the cluster with your own credentials; writes nothing."
)]
struct Cli {
    /// The kubeconfig file (default: $KUBECONFIG, then ~/.kube/config, then in-cluster).
    #[arg(long, global = true)]
    kubeconfig: Option<PathBuf>,
    /// The kubeconfig context to use (default: the current one).
    #[arg(long, global = true)]
    context: Option<String>,
    /// The namespace (default: the context's, else `default`).
    #[arg(short = 'n', long, global = true)]
    namespace: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Output {
    Table,
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Per node and GPU: the model, health, slots, memory and cores booked, and each pod's
    /// slice. Without permission to list Nodes or other namespaces' pods, only the GPUs of the
    /// pods you may list are shown (their totals unknown).
    Gpus {
        #[arg(short = 'o', long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// Why a GPU pod is pending: each node's reason, the nodes it fits now with their scores,
    /// what preemption would evict for it, and the largest slice free on each node.
    Why {
        /// The pod's name (in --namespace).
        pod: String,
    },
    /// Checks the installation: the scheduler and its webhook, the device plugin on every GPU
    /// node, what each node registered against what its kubelet advertises, and no second GPU
    /// device plugin beside Tessera's; names the fix for each problem. Exits 1 on a failure.
    Doctor,
    /// What switching this HAMi v2.10 cluster to Tessera will do, with nothing run: HAMi's parts
    /// that go, each node and the lock HAMi left on it, every booking Tessera will count, what
    /// would be booked twice or lost, and what the chart does with each key of your values
    /// file. Exits 1 when something would make the switch fail (docs/migrate-from-hami.md).
    MigrateFromHami {
        /// HAMi's values file, as you installed HAMi with it (`helm get values -a <release>`).
        #[arg(short = 'f', long = "values")]
        values: Option<PathBuf>,
    },
    /// Live GPU usage: per GPU (memory used, SM utilization, its containers' use against their
    /// limits) and per container (memory used against its limit, SM utilization), from each
    /// node's device plugin. Needs to list the device-plugin pods and port-forward to them (an
    /// administrator's access to the release namespace).
    Top {
        #[arg(short = 'o', long, value_enum, default_value_t = Output::Table)]
        output: Output,
        /// The bearer token sent to the plugins' /metrics when the chart's
        /// `metricsAuthorization` is `kubernetes` (its default): of a user allowed `get` on the
        /// non-resource URL /metrics. Default: your kubeconfig's token, if it has one.
        #[arg(long, env = "TESSERA_METRICS_TOKEN", hide_env_values = true)]
        token: Option<String>,
    },
    /// Where the pods of a file would go on the cluster as it is now, in file order (nothing is
    /// created).
    Plan {
        /// Pod manifests (multi-document YAML or JSON); `-` reads standard input.
        #[arg(short = 'f', long = "file", required = true)]
        file: Vec<PathBuf>,
        #[arg(short = 'o', long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    match answer(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // The causes on one line, never a backtrace: this is read by a person. The API
            // server's own message ends the line (kube's error repeats it and its reason
            // below it), rather than kube's debug form of its Status.
            let mut causes: Vec<String> = Vec::new();
            for cause in e.chain() {
                if let Some(kube::Error::Api(status)) = cause.downcast_ref::<kube::Error>() {
                    causes.push(status.message.clone());
                    break;
                }
                causes.push(cause.to_string());
            }
            eprintln!("kubectl-tessera: {}", causes.join(": "));
            std::process::ExitCode::FAILURE
        }
    }
}

fn answer(cli: Cli) -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    let (text, healthy) = runtime.block_on(run(cli))?;
    // A reader that stops early (`| head`) is not an error.
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
        written => written.context("writing to standard output")?,
    }
    if !healthy {
        bail!("the installation has failures (above)");
    }
    Ok(())
}

/// The answer's text, and whether it found the cluster healthy (only `doctor` and
/// `migrate-from-hami` can say no).
async fn run(cli: Cli) -> anyhow::Result<(String, bool)> {
    let (client, context_namespace, own_token) =
        connect(cli.kubeconfig.as_ref(), cli.context.clone()).await?;
    let namespace = cli.namespace.unwrap_or(context_namespace);
    // The chart's defaults (HAMi's resource names and scaling): what `tessera-scheduler` decides
    // with unless its own flags change them.
    let cfg = DecisionConfig::default();
    let text = match cli.command {
        Command::Doctor => {
            let findings = doctor::check(&doctor_facts(&client).await?, &cfg);
            let healthy = findings.iter().all(|f| f.level != doctor::Level::Fail);
            return Ok((doctor::report(&findings), healthy));
        }
        Command::MigrateFromHami { values } => {
            let values = match values {
                Some(f) => {
                    let text = tessera_runtime::input::read_file_or_stdin(&f)?;
                    Some(
                        yaml_serde::from_str::<yaml_serde::Value>(&text)
                            .with_context(|| format!("parsing {}", f.display()))?,
                    )
                }
                None => None,
            };
            let plan = migrate::plan(&migrate_facts(&client).await?, &cfg, values.as_ref());
            return Ok((migrate::report(&plan), !plan.blocked()));
        }
        Command::Gpus { output } => {
            let snap = Snapshot::read(&client, &namespace, None).await?;
            let (mut state, _) = snap.input.state(&cfg);
            let rows = inventory::gpus(&mut state);
            match output {
                Output::Json => serde_json::to_string_pretty(&rows)? + "\n",
                Output::Table => {
                    let mut text = if rows.is_empty() {
                        "No GPU is registered or booked that you may see.\n".to_owned()
                    } else {
                        inventory::table(&rows)
                    };
                    for (node, why) in inventory::unregistered(&state) {
                        text.push_str(&format!("node {node}: no GPUs usable: {why}\n"));
                    }
                    text.push_str(&snap.notes());
                    text
                }
            }
        }
        Command::Why { pod } => why(&client, &namespace, &pod, &cfg).await?,
        Command::Top { output, token } => {
            let scrapes = scrape_plugins(&client, token.or(own_token).as_deref()).await?;
            let usage = top::usage(&scrapes);
            match output {
                Output::Json => serde_json::to_string_pretty(&usage)? + "\n",
                Output::Table => top::table(&usage),
            }
        }
        Command::Plan { file, output } => {
            let mut snap = Snapshot::read(&client, &namespace, None).await?;
            // Only the file's pods are placed; the cluster's own pending pods are not.
            snap.input.pending.clear();
            let mut planned = Input::default();
            for f in &file {
                let text = tessera_runtime::input::read_file_or_stdin(f)?;
                planned
                    .add_text(&text)
                    .with_context(|| format!("parsing {}", f.display()))?;
            }
            for mut p in planned.running.into_iter().chain(planned.pending) {
                // A pod of the file is placed as new, whatever its status says.
                if let Some(spec) = p.spec.as_mut() {
                    spec.node_name = None;
                }
                if let Some(a) = p.metadata.annotations.as_mut() {
                    a.retain(|k, _| !k.starts_with("hami.io/"));
                }
                if p.metadata.namespace.is_none() {
                    p.metadata.namespace = Some(namespace.clone());
                }
                snap.input.pending.push(p);
            }
            let results = simulate::run(&snap.input, &cfg);
            match output {
                Output::Json => results.iter().try_fold(String::new(), |mut t, r| {
                    t.push_str(&serde_json::to_string(r)?);
                    t.push('\n');
                    Ok::<_, serde_json::Error>(t)
                })?,
                Output::Table => simulate::table(&results) + &snap.notes(),
            }
        }
    };
    Ok((text, true))
}

/// Every `K` the list parameters select, cluster-wide; `need` says what access that takes.
async fn list_all<K>(client: &Client, lp: &ListParams, need: &'static str) -> anyhow::Result<Vec<K>>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    K::DynamicType: Default,
{
    Ok(Api::<K>::all(client.clone())
        .list(lp)
        .await
        .context(need)?
        .items)
}

/// What `migrate-from-hami` reads: cluster-wide, so it needs an administrator's read access.
async fn migrate_facts(client: &Client) -> anyhow::Result<migrate::Facts> {
    use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
    let all = ListParams::default();
    let need = "migrate-from-hami reads Nodes, pods, Deployments and DaemonSets cluster-wide (an \
                administrator's read access)";
    Ok(migrate::Facts {
        nodes: list_all::<Node>(client, &all, need).await?,
        pods: list_all::<Pod>(client, &all, need).await?,
        deployments: list_all::<Deployment>(client, &all, need).await?,
        daemonsets: list_all::<DaemonSet>(client, &all, need).await?,
        now: k8s_openapi::jiff::Timestamp::now(),
    })
}

/// What `doctor` reads: cluster-wide, so it needs an administrator's read access.
async fn doctor_facts(client: &Client) -> anyhow::Result<doctor::Facts> {
    use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
    use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    let all = ListParams::default();
    let part = |c: &str| ListParams::default().labels(&format!("{}={c}", doctor::COMPONENT));
    let need = "doctor reads Deployments, DaemonSets, Nodes, pods, Events, EndpointSlices and \
                MutatingWebhookConfigurations cluster-wide (an administrator's read access)";
    let schedulers = list_all::<Deployment>(client, &part("scheduler"), need).await?;
    let webhooks = list_all::<MutatingWebhookConfiguration>(client, &part("webhook"), need).await?;
    let mut endpoints = Vec::new();
    for w in webhooks.iter().flat_map(|c| c.webhooks.iter().flatten()) {
        if let Some(svc) = &w.client_config.service {
            let lp =
                ListParams::default().labels(&format!("kubernetes.io/service-name={}", svc.name));
            endpoints.extend(
                Api::<EndpointSlice>::namespaced(client.clone(), &svc.namespace)
                    .list(&lp)
                    .await
                    .context(need)?
                    .items,
            );
        }
    }
    Ok(doctor::Facts {
        schedulers,
        daemonsets: list_all::<DaemonSet>(client, &all, need).await?,
        webhooks,
        endpoints,
        nodes: list_all::<Node>(client, &all, need).await?,
        plugin_pods: list_all::<Pod>(client, &part("device-plugin"), need).await?,
        runtime_events: list_all::<Event>(
            client,
            &ListParams::default().fields(&format!(
                "involvedObject.kind=Node,reason={}",
                doctor::UNSAFE_RUNTIME_REASON
            )),
            need,
        )
        .await?,
        own_version: env!("CARGO_PKG_VERSION").to_owned(),
    })
}

/// A client for the kubeconfig (or in-cluster) and the context's namespace.
async fn connect(
    kubeconfig: Option<&PathBuf>,
    context: Option<String>,
) -> anyhow::Result<(Client, String, Option<String>)> {
    let opts = KubeConfigOptions {
        context,
        ..Default::default()
    };
    let config = match kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path)
                .with_context(|| format!("reading {}", path.display()))?;
            Config::from_custom_kubeconfig(kc, &opts).await?
        }
        None if opts.context.is_some() => Config::from_kubeconfig(&opts).await?,
        None => Config::infer()
            .await
            .context("no kubeconfig ($KUBECONFIG, ~/.kube/config) and not in a cluster")?,
    };
    let namespace = config.default_namespace.clone();
    let token = bearer_token(&config.auth_info);
    Ok((Client::try_from(config)?, namespace, token))
}

/// The kubeconfig user's bearer token, written in the file or in the file it names (a client
/// certificate or an exec plugin gives none: `top --token` then).
fn bearer_token(auth: &kube::config::AuthInfo) -> Option<String> {
    use secrecy::ExposeSecret as _;
    if let Some(t) = &auth.token {
        return Some(t.expose_secret().to_owned());
    }
    let file = auth.token_file.as_ref()?;
    let t = std::fs::read_to_string(file).ok()?;
    Some(t.trim().to_owned()).filter(|t| !t.is_empty())
}

/// The largest exposition `top` reads from one plugin (a node of 8 GPUs and 100 containers
/// writes well under 1 MiB).
const METRICS_LIMIT: usize = 32 << 20;

/// Every Running device-plugin pod's `/metrics`, each through a port-forward to its `metrics`
/// port (the API server and the kubelet carry the bytes; the caller's own RBAC decides), with
/// `token` as the bearer. A node whose plugin cannot be read is a row saying why, not a failure.
async fn scrape_plugins(client: &Client, token: Option<&str>) -> anyhow::Result<Vec<top::Scrape>> {
    let lp = ListParams::default().labels(&format!("{}=device-plugin", doctor::COMPONENT));
    let need = "top lists the device-plugin pods cluster-wide and port-forwards to them (list \
                pods, create pods/portforward in the release namespace)";
    let mut scrapes = Vec::new();
    for pod in list_all::<Pod>(client, &lp, need).await? {
        let node = pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .unwrap_or_default();
        if pod.status.as_ref().and_then(|s| s.phase.as_deref()) != Some("Running") {
            scrapes.push(top::Scrape {
                node,
                text: Err("its device-plugin pod is not Running".to_owned()),
            });
            continue;
        }
        let port = pod
            .spec
            .iter()
            .flat_map(|s| &s.containers)
            .flat_map(|c| c.ports.iter().flatten())
            .find(|p| p.name.as_deref() == Some("metrics"))
            .and_then(|p| u16::try_from(p.container_port).ok());
        let text = match port {
            None => Err("its pod has no port named `metrics`".to_owned()),
            Some(port) => scrape(client, &pod, port, token)
                .await
                .map_err(|e| format!("{e:#}")),
        };
        scrapes.push(top::Scrape { node, text });
    }
    Ok(scrapes)
}

/// `GET /metrics` on `port` of `pod`, through a port-forward.
async fn scrape(
    client: &Client,
    pod: &Pod,
    port: u16,
    token: Option<&str>,
) -> anyhow::Result<String> {
    use http_body_util::BodyExt as _;
    let name = pod.metadata.name.as_deref().unwrap_or_default();
    let namespace = pod.metadata.namespace.as_deref().unwrap_or_default();
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let mut forward = pods
        .portforward(name, &[port])
        .await
        .with_context(|| format!("port-forward to {namespace}/{name}:{port}"))?;
    let stream = forward
        .take_stream(port)
        .context("the port-forward gave no stream")?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
    let connection = tokio::spawn(connection);
    let mut request = http::Request::get("/metrics").header(http::header::HOST, "localhost");
    if let Some(t) = token {
        request = request.header(http::header::AUTHORIZATION, format!("Bearer {t}"));
    }
    let response = sender
        .send_request(request.body(http_body_util::Empty::<hyper::body::Bytes>::new())?)
        .await?;
    let status = response.status();
    let body = http_body_util::Limited::new(response.into_body(), METRICS_LIMIT)
        .collect()
        .await
        .map_err(|e| anyhow::anyhow!("reading the metrics: {e}"))?
        .to_bytes();
    drop(sender);
    connection.abort();
    forward.abort();
    match status.as_u16() {
        200 => Ok(String::from_utf8_lossy(&body).into_owned()),
        401 => bail!(
            "HTTP 401: the plugin asks for a bearer token (metricsAuthorization: kubernetes) and \
             {}: pass --token of a user allowed `get` on the non-resource URL /metrics",
            if token.is_some() {
                "refused this one"
            } else {
                "your kubeconfig has none"
            }
        ),
        403 => bail!(
            "HTTP 403: the token's user may not `get` the non-resource URL /metrics (bind it to a \
             ClusterRole that allows it, as Prometheus' has)"
        ),
        s => bail!("HTTP {s}: {}", String::from_utf8_lossy(&body).trim()),
    }
}

/// What the caller may read of the cluster, as `simulate` takes it, and what was left out.
struct Snapshot {
    input: Input,
    limited: Vec<String>,
}

fn forbidden(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 403)
}

impl Snapshot {
    /// Nodes, pods and ResourceQuotas: cluster-wide where allowed, else the namespace's (pods
    /// and quotas) or none (Nodes). `skip` is a pod UID left out (the one `why` asks about).
    async fn read(client: &Client, namespace: &str, skip: Option<&str>) -> anyhow::Result<Self> {
        let lp = ListParams::default();
        let mut input = Input::default();
        let mut limited = Vec::new();
        match Api::<Node>::all(client.clone()).list(&lp).await {
            Ok(l) => input.nodes = l.items,
            Err(e) if forbidden(&e) => limited.push(
                "you may not list Nodes: GPU totals and free GPUs are unknown (`kubectl auth \
                 can-i list nodes`)"
                    .to_owned(),
            ),
            Err(e) => return Err(e).context("listing Nodes"),
        }
        let pods = match Api::<Pod>::all(client.clone()).list(&lp).await {
            Ok(l) => l.items,
            Err(e) if forbidden(&e) => {
                limited.push(format!(
                    "you may list pods only in namespace {namespace}: other namespaces' bookings \
                     are not counted"
                ));
                Api::<Pod>::namespaced(client.clone(), namespace)
                    .list(&lp)
                    .await
                    .with_context(|| format!("listing the pods of namespace {namespace}"))?
                    .items
            }
            Err(e) => return Err(e).context("listing pods"),
        };
        for p in pods {
            let ended = matches!(
                p.status.as_ref().and_then(|s| s.phase.as_deref()),
                Some("Succeeded" | "Failed")
            );
            if ended || (skip.is_some() && p.metadata.uid.as_deref() == skip) {
                continue;
            }
            input.add_pod(p);
        }
        input.quotas = match Api::<ResourceQuota>::all(client.clone()).list(&lp).await {
            Ok(l) => l.items,
            Err(e) if forbidden(&e) => {
                match Api::<ResourceQuota>::namespaced(client.clone(), namespace)
                    .list(&lp)
                    .await
                {
                    Ok(l) => l.items,
                    Err(e) if forbidden(&e) => {
                        limited.push(
                            "you may not list ResourceQuotas: budgets are not checked".into(),
                        );
                        Vec::new()
                    }
                    Err(e) => return Err(e).context("listing ResourceQuotas"),
                }
            }
            Err(e) => return Err(e).context("listing ResourceQuotas"),
        };
        Ok(Snapshot { input, limited })
    }

    /// The footnotes saying what the answer leaves out.
    fn notes(&self) -> String {
        self.limited
            .iter()
            .map(|l| format!("note: {l}\n"))
            .collect()
    }
}

/// `why POD`: the pod's placement if it has one, else each node's reason and what would help.
async fn why(
    client: &Client,
    namespace: &str,
    name: &str,
    cfg: &DecisionConfig,
) -> anyhow::Result<String> {
    let pod = Api::<Pod>::namespaced(client.clone(), namespace)
        .get(name)
        .await
        .with_context(|| format!("reading pod {namespace}/{name}"))?;
    let key = format!("{namespace}/{name}");
    if let Some(node) = pod.spec.as_ref().and_then(|s| s.node_name.clone()) {
        let devices = pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get("hami.io/vgpu-devices-allocated"))
            .map(|d| simulate::slices(d))
            .unwrap_or_else(|| "no GPU slice".to_owned());
        return Ok(format!("{key} is bound to node {node}: {devices}\n"));
    }
    let mut snap = Snapshot::read(client, namespace, pod.metadata.uid.as_deref()).await?;
    if snap.input.nodes.is_empty() {
        bail!(
            "why needs the Nodes, which your account may not list (kubectl auth can-i list \
             nodes): ask your cluster administrator for read access to Nodes and pods"
        );
    }
    snap.input.pending = vec![pod];
    let results = simulate::run(&snap.input, cfg);
    let Some(result) = results.first() else {
        bail!("{key}: nothing to evaluate");
    };
    let (mut state, _) = snap.input.state(cfg);
    let free = largest_free_slices(&inventory::gpus(&mut state));
    Ok(explain(&key, result, &free) + &snap.notes())
}

/// Per node, the GPU with the most free memory among those with a free slot: (GPU, MiB, cores).
fn largest_free_slices(rows: &[inventory::GpuRow]) -> Vec<(String, String, u32, u32)> {
    let mut best: std::collections::BTreeMap<&str, (String, u32, u32)> = Default::default();
    for r in rows {
        let Some(reg) = &r.registered else { continue };
        if !reg.healthy || r.slots_used >= reg.slots {
            continue;
        }
        let mem = reg.mem.saturating_sub(r.mem_used);
        let cores = reg.cores.saturating_sub(r.cores_used);
        let entry = best.entry(&r.node).or_insert((r.uuid.clone(), mem, cores));
        if mem > entry.1 {
            *entry = (r.uuid.clone(), mem, cores);
        }
    }
    best.into_iter()
        .map(|(node, (gpu, mem, cores))| (node.to_owned(), gpu, mem, cores))
        .collect()
}

/// The answer for a terminal.
fn explain(key: &str, r: &PodResult, free: &[(String, String, u32, u32)]) -> String {
    let mut out = String::new();
    if let Some(e) = &r.error {
        out.push_str(&format!("{key} cannot be placed by Tessera: {e}\n"));
        return out;
    }
    if r.scores.is_empty() {
        out.push_str(&format!(
            "{key} fits no node now ({} node(s) refuse it):\n",
            r.reasons.len()
        ));
    } else {
        let fits: Vec<String> = r
            .scores
            .iter()
            .map(|(n, s)| format!("{n} (score {s:.2})"))
            .collect();
        out.push_str(&format!(
            "{key} fits now on {}; the GPU share is not what holds it: `kubectl describe pod` \
             shows kube-scheduler's other reasons (CPU, memory, affinity, taints), or it has not \
             been tried since room was made.\n",
            fits.join(", ")
        ));
        if !r.reasons.is_empty() {
            out.push_str("Other nodes refuse it:\n");
        }
    }
    for (node, why) in &r.reasons {
        let never = if r.never_fits.contains(node) {
            " (even with every pod there evicted)"
        } else {
            ""
        };
        out.push_str(&format!("  {node}: {why}{never}\n"));
    }
    if !r.preemption.is_empty() {
        out.push_str(
            "Preemption makes room (kube-scheduler evicts these lower-priority pods for it):\n",
        );
        for (node, what) in &r.preemption {
            out.push_str(&format!("  {node}: {what}\n"));
        }
    }
    // HAMi's reason names, in words.
    let named: std::collections::BTreeSet<FitReason> = r
        .reasons
        .values()
        .flat_map(|why| why.split([',', ' ', ';', ':']))
        .filter_map(FitReason::from_name)
        .collect();
    for reason in named {
        out.push_str(&format!("  ({reason}: {})\n", reason.meaning()));
    }
    if r.scores.is_empty() && !free.is_empty() {
        out.push_str(
            "The largest slice free on one GPU of each node (a smaller request fits there):\n",
        );
        for (node, gpu, mem, cores) in free {
            out.push_str(&format!("  {node}: {gpu} {mem} MiB, {cores}% cores\n"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn pending(reasons: &[(&str, &str)]) -> PodResult {
        PodResult {
            pod: "ns/p".into(),
            node: None,
            devices: String::new(),
            reasons: reasons
                .iter()
                .map(|(n, w)| ((*n).to_owned(), (*w).to_owned()))
                .collect(),
            error: None,
            mig: BTreeMap::new(),
            notes: Vec::new(),
            scores: BTreeMap::new(),
            never_fits: vec!["small".into()],
            preemption: BTreeMap::new(),
        }
    }

    #[test]
    fn a_pending_pod_is_explained_in_words_with_what_would_fit() {
        let r = pending(&[
            (
                "big",
                "1/2 CardInsufficientMemory, 1/2 CardTimeSlicingExhausted",
            ),
            ("small", "1/1 CardInsufficientMemory"),
        ]);
        let free = [("big".to_owned(), "GPU-0".to_owned(), 2960, 100)];
        let text = explain("ns/p", &r, &free);
        assert!(
            text.starts_with("ns/p fits no node now (2 node(s) refuse it):\n"),
            "{text}"
        );
        assert!(
            text.contains(
                "  small: 1/1 CardInsufficientMemory (even with every pod there evicted)\n"
            ),
            "{text}"
        );
        assert!(
            text.contains("(CardTimeSlicingExhausted: every share of the GPU is taken"),
            "{text}"
        );
        assert_eq!(
            text.matches("(CardInsufficientMemory:").count(),
            1,
            "{text}"
        );
        assert!(
            text.ends_with("  big: GPU-0 2960 MiB, 100% cores\n"),
            "{text}"
        );
    }

    #[test]
    fn a_pod_that_fits_is_said_to_wait_for_something_else() {
        let mut r = pending(&[]);
        r.scores.insert("n1".into(), 1.5);
        let text = explain("ns/p", &r, &[]);
        assert!(text.contains("fits now on n1 (score 1.50)"), "{text}");
        assert!(text.contains("kubectl describe pod"), "{text}");
    }

    #[test]
    fn the_largest_free_slice_skips_full_and_unhealthy_gpus() {
        let row = |uuid: &str, healthy: bool, slots_used: u32, mem_used: u32| inventory::GpuRow {
            node: "n".into(),
            uuid: uuid.into(),
            registered: Some(inventory::Registered {
                index: 0,
                model: "A100".into(),
                mode: "hami-core".into(),
                healthy,
                slots: 2,
                mem: 40960,
                cores: 100,
            }),
            slots_used,
            mem_used,
            cores_used: 0,
            mig: Vec::new(),
            tenants: Vec::new(),
        };
        let rows = [
            row("GPU-full", true, 2, 0),
            row("GPU-sick", false, 0, 0),
            row("GPU-a", true, 1, 30000),
            row("GPU-b", true, 1, 20000),
        ];
        assert_eq!(
            largest_free_slices(&rows),
            [("n".to_owned(), "GPU-b".to_owned(), 20960, 100)]
        );
    }
}

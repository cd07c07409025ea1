//! `tessera-scheduler serve`: wiring of the decision loop, the informers, leader election and the
//! HTTP(S) servers.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tessera_runtime::{
    CancellationToken, Schedule, spawn_periodic, spawn_task, task_span, wait_for_shutdown_signal,
};
use tracing::Instrument;

use anyhow::Context;
use tessera_http::listen::ServeLimits;
use tessera_http::metrics_access::{MetricsAccessArgs, MetricsGate};
use tessera_http::tls::{self, TlsFiles};
use tessera_scheduler::edge::ClusterEdge;
use tessera_scheduler::engine::{Command, Engine, EngineHandle};
use tessera_scheduler::http::{App, Auth, metrics_router, router};
use tessera_scheduler::kube_edge::{
    FollowLease, KubeEdge, LeaseConfig, run_facts, run_leader_election, run_requeue, run_sync,
};
use tessera_scheduler::metrics::Metrics;
use tessera_scheduler_core::config::DecisionConfig;
use tessera_scheduler_core::facts::SharedFacts;
use tessera_scheduler_core::podspec;
use tessera_scheduler_core::webhook::WebhookConfig;

use crate::PolicyArgs;

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Extender + webhook listener (HAMi `--http_bind`).
    #[arg(
        long,
        alias = "http_bind",
        env = "TESSERA_HTTP_BIND",
        default_value = "127.0.0.1:8080"
    )]
    pub http_bind: SocketAddr,
    /// Server certificate (PEM); with --key-file enables HTTPS. Reloaded when it changes.
    #[arg(
        long,
        alias = "cert_file",
        env = "TESSERA_CERT_FILE",
        requires = "key_file"
    )]
    pub cert_file: Option<PathBuf>,
    #[arg(
        long,
        alias = "key_file",
        env = "TESSERA_KEY_FILE",
        requires = "cert_file"
    )]
    pub key_file: Option<PathBuf>,
    /// CA bundle for client certificates: a verified client certificate may call /filter and /bind.
    #[arg(long, env = "TESSERA_CLIENT_CA_FILE", requires = "cert_file")]
    pub client_ca_file: Option<PathBuf>,
    /// CA bundle of the API server's client certificate: with it, /webhook answers only callers
    /// presenting a certificate this CA issued (403 otherwise). The API server presents one only
    /// where its AdmissionConfiguration gives it one (docs/helm.md, "Webhook client
    /// authentication"). Use a CA that issues nothing else, not the cluster CA. Off by default:
    /// managed clusters do not let the operator configure the API server so.
    #[arg(long, env = "TESSERA_WEBHOOK_CLIENT_CA_FILE", requires = "cert_file")]
    pub webhook_client_ca_file: Option<PathBuf>,
    /// File holding the bearer token /filter and /bind callers must send. Reloaded when it changes.
    #[arg(long, env = "TESSERA_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// Metrics listener (`/metrics`).
    #[arg(
        long,
        env = "TESSERA_METRICS_BIND_ADDRESS",
        default_value = "0.0.0.0:9395"
    )]
    pub metrics_bind_address: SocketAddr,
    /// Also export HAMi's pre-v2.9 metric names (`GPUDeviceMemoryLimit`, `QuotaUsed`, …), as
    /// HAMi's `--legacy-metrics` does.
    #[arg(long, env = "TESSERA_LEGACY_METRICS")]
    pub legacy_metrics: bool,
    #[command(flatten)]
    pub metrics_access: MetricsAccessArgs,
    /// The scheduler profile name the webhook writes into `spec.schedulerName`.
    #[arg(long, env = "TESSERA_SCHEDULER_NAME", default_value = "hami-scheduler")]
    pub scheduler_name: String,
    /// Overwrite `default-scheduler` on GPU pods (HAMi default true).
    #[arg(long, env = "TESSERA_FORCE_OVERWRITE_DEFAULT_SCHEDULER", default_value_t = true, action = clap::ArgAction::Set)]
    pub force_overwrite_default_scheduler: bool,
    /// Users allowed to write scheduler-owned pod annotations (repeat, or comma-separate in the
    /// env var). Default: the `tessera-scheduler` and `tessera-device-plugin` service accounts of
    /// the pod's namespace.
    #[arg(long, env = "TESSERA_WEBHOOK_TRUSTED_USERS", value_delimiter = ',')]
    pub webhook_trusted_user: Vec<String>,
    /// Namespaces whose GPU pods may set the shim's control variables (`CUDA_DISABLE_CONTROL`,
    /// `CUDA_DEVICE_MEMORY_LIMIT[_<n>]`, `CUDA_DEVICE_SM_LIMIT[_<n>]`, …); repeat, or
    /// comma-separate in the env var. Default: none.
    #[arg(
        long,
        env = "TESSERA_WEBHOOK_ALLOW_CONTROL_ENV_NAMESPACES",
        value_delimiter = ','
    )]
    pub webhook_allow_control_env_namespaces: Vec<String>,
    /// Elect a leader with a Lease (disable only for a single replica).
    #[arg(long, env = "TESSERA_LEADER_ELECT", default_value_t = true, action = clap::ArgAction::Set)]
    pub leader_elect: bool,
    #[arg(
        long,
        env = "TESSERA_LEADER_ELECT_RESOURCE_NAME",
        default_value = "tessera-scheduler"
    )]
    pub leader_elect_resource_name: String,
    #[arg(long, env = "POD_NAMESPACE", default_value = "kube-system")]
    pub leader_elect_resource_namespace: String,
    /// Identity in the Lease (default: the pod name, else the hostname).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    #[arg(long, env = "TESSERA_LEASE_DURATION_SECONDS", default_value_t = 15)]
    pub lease_duration_seconds: u64,
    /// Pair leadership with another Lease, `<namespace>/<name>` (or `<name>` in the
    /// --leader-elect-resource-namespace): contend for our own Lease only while that one is held
    /// by this pod (`<prefix>_…`), and release ours when another pod holds it. The chart
    /// follows its kube-scheduler sidecar's Lease (docs/scheduler.md).
    #[arg(long, env = "TESSERA_FOLLOW_LEASE")]
    pub follow_lease: Option<String>,
    /// The holder prefix (before `_`) that means "this pod" in the followed Lease. Default: the
    /// pod name (POD_NAME, i.e. --identity), else the hostname: kube-scheduler writes
    /// `<hostname>_<uuid>`, and a pod's hostname is its name.
    #[arg(long, env = "TESSERA_FOLLOW_LEASE_HOLDER_PREFIX")]
    pub follow_lease_holder_prefix: Option<String>,
    /// Only nodes with these labels take GPU pods (HAMi `--node-label-selector`), `k=v,k2=v2`.
    #[arg(long, env = "TESSERA_NODE_LABEL_SELECTOR", value_delimiter = ',')]
    pub node_label_selector: Vec<String>,
    /// Threads that evaluate the candidate nodes of one filter in parallel (at least 256 nodes
    /// per thread). 1 = sequential; measure before raising it (docs/scheduler.md).
    #[arg(long, env = "TESSERA_FILTER_THREADS", default_value_t = 1)]
    pub filter_threads: usize,
    /// Also patch the decision (HAMi's `hami.io/vgpu-*` annotations and the `hami.io/vgpu-node`
    /// label) onto the pod in `/filter`, as HAMi does, for consumers that read it from pods not
    /// yet bound or list pods by the label (HAMi's own vGPU monitor). Off: the decision travels
    /// in the Binding only, one API write per placed pod (docs/scheduler.md).
    #[arg(long, env = "TESSERA_WRITE_DECISION_AT_FILTER", default_value_t = false, action = clap::ArgAction::Set)]
    pub write_decision_at_filter: bool,
    /// Pod Events the extender writes: `warnings` (FilteringFailed, BindingFailed) or `all`
    /// (also HAMi's FilteringSucceed and BindingSucceed: two API writes per placed pod).
    #[arg(long, env = "TESSERA_POD_EVENTS", value_enum, default_value_t = PodEvents::Warnings)]
    pub pod_events: PodEvents,
    /// Open connections per listener at most; at the limit a new connection closes the oldest
    /// one with no request in flight. Lowered to fit the open-files limit.
    #[arg(long, env = "TESSERA_MAX_CONNECTIONS", default_value_t = 1024)]
    pub max_connections: usize,
    /// Open connections per listener from one source address at most: at the limit a new one
    /// closes that address's oldest connection with no request in flight, else it is closed. So
    /// one peer cannot fill --max-connections with busy connections.
    #[arg(long, env = "TESSERA_MAX_CONNECTIONS_PER_PEER", default_value_t = tessera_http::listen::DEFAULT_MAX_CONNECTIONS_PER_PEER)]
    pub max_connections_per_peer: usize,
    /// Requests in flight per listener from one source address at most, over all its
    /// connections (HTTP/2 streams included); above it a request gets 429 at once. `/healthz`
    /// and `/readyz` are exempt.
    #[arg(long, env = "TESSERA_MAX_REQUESTS_PER_PEER", default_value_t = tessera_http::listen::DEFAULT_MAX_REQUESTS_PER_PEER)]
    pub max_requests_per_peer: usize,
    /// Seconds a client has to finish the TLS handshake.
    #[arg(
        long,
        env = "TESSERA_TLS_HANDSHAKE_TIMEOUT_SECONDS",
        default_value_t = 10
    )]
    pub tls_handshake_timeout_seconds: u64,
    /// Seconds a client has to send a request's headers (HTTP/1).
    #[arg(long, env = "TESSERA_HEADER_READ_TIMEOUT_SECONDS", default_value_t = 5)]
    pub header_read_timeout_seconds: u64,
    /// Seconds a client has, once the headers are in, to send the request's body (a whole
    /// request: at most the header and body deadlines together, 8 s by default). The API
    /// server and kube-scheduler send theirs at once.
    #[arg(long, env = "TESSERA_BODY_READ_TIMEOUT_SECONDS", default_value_t = 3)]
    pub body_read_timeout_seconds: u64,
    /// Seconds a connection may stay open with no request in flight.
    #[arg(
        long,
        env = "TESSERA_IDLE_CONNECTION_TIMEOUT_SECONDS",
        default_value_t = 90
    )]
    pub idle_connection_timeout_seconds: u64,
    #[command(flatten)]
    pub policy: PolicyArgs,
}

/// `--pod-events`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PodEvents {
    Warnings,
    All,
}

/// Parses `k=v` items of `--node-label-selector`.
pub fn parse_selector(items: &[String]) -> anyhow::Result<Vec<(String, String)>> {
    items
        .iter()
        .filter(|i| !i.trim().is_empty())
        .map(|i| {
            i.split_once('=')
                .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
                .ok_or_else(|| anyhow::anyhow!("--node-label-selector item {i:?} is not key=value"))
        })
        .collect()
}

/// `--follow-lease`: `<namespace>/<name>` or `<name>` (in `default_namespace`).
pub fn parse_follow_lease(
    value: &str,
    default_namespace: &str,
    host: &str,
) -> anyhow::Result<FollowLease> {
    let (namespace, name) = match value.trim().split_once('/') {
        Some((ns, name)) => (ns.trim(), name.trim()),
        None => (default_namespace, value.trim()),
    };
    anyhow::ensure!(
        !namespace.is_empty() && !name.is_empty() && !name.contains('/'),
        "--follow-lease {value:?} is not <namespace>/<name>"
    );
    anyhow::ensure!(
        !host.is_empty(),
        "--follow-lease needs --follow-lease-holder-prefix, POD_NAME or HOSTNAME"
    );
    Ok(FollowLease {
        namespace: namespace.to_owned(),
        name: name.to_owned(),
        host: host.to_owned(),
    })
}

fn read_token(path: &PathBuf) -> anyhow::Result<String> {
    let t = std::fs::read_to_string(path)
        .with_context(|| format!("reading token file {}", path.display()))?;
    let t = t.trim().to_owned();
    anyhow::ensure!(!t.is_empty(), "token file {} is empty", path.display());
    Ok(t)
}

pub fn run(args: ServeArgs, cfg: DecisionConfig) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(serve(args, cfg))
}

/// `serve`, as a list of tasks: connect, start the decision loop and the background tasks
/// (leadership, informers, sweeps), set up who may call what, then serve until a signal.
async fn serve(args: ServeArgs, cfg: DecisionConfig) -> anyhow::Result<()> {
    // One process-wide crypto provider for rustls (kube's client and our listeners); an `Err`
    // only means one is installed already.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = kube::Client::try_default()
        .await
        .context("connecting to the Kubernetes API (in-cluster config or KUBECONFIG)")?;
    let identity = args
        .identity
        .clone()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "tessera-scheduler".to_owned());
    let edge = Arc::new(KubeEdge::new(
        client.clone(),
        &args.scheduler_name,
        Some(identity.clone()),
    ));
    let (requeue_tx, requeue_rx) = tokio::sync::mpsc::unbounded_channel();
    let (preempted_tx, preempted_rx) = tokio::sync::mpsc::unbounded_channel();
    let engine = EngineHandle::spawn(
        Engine::new(cfg.clone())
            .with_requeue(requeue_tx)
            .with_preempted(preempted_tx),
    );
    spawn_task("requeue", run_requeue((*edge).clone(), requeue_rx));
    let metrics = Metrics::new(args.legacy_metrics);
    spawn_task(
        "preemption-events",
        tessera_scheduler::http::report_preempted(edge.clone(), metrics.clone(), preempted_rx),
    );
    let leadership = start_leadership(&args, &client, &identity, &engine)?;
    // Every replica serves the webhook, so every replica keeps its cluster facts.
    let facts: SharedFacts = Default::default();
    spawn_task(
        "cluster-facts",
        run_facts(client.clone(), cfg.clone(), facts.clone()),
    );
    let ready = Arc::new(AtomicBool::new(false));
    let metrics_gate = MetricsGate::from_args(&args.metrics_access, &client);
    spawn_task(
        "cluster-sync",
        run_sync(
            client,
            engine.clone(),
            leadership,
            ready.clone(),
            podspec::pod_watch_fields(&args.scheduler_name),
        ),
    );
    let shutdown = CancellationToken::new();
    start_sweeps(&engine, &edge, &shutdown);
    let auth = auth(&args, &shutdown)?;
    let app = Arc::new(App {
        engine,
        edge,
        auth,
        webhook: webhook_config(&args, &cfg),
        decision: cfg,
        facts,
        metrics,
        ready,
    });
    let tls_cfg = tls_config(&args)?;
    let result = run_servers(&args, app, tls_cfg, metrics_gate).await;
    shutdown.cancel();
    result
}

/// Leader election on the Lease (or, with `--leader-elect=false`, leadership from the start):
/// the receiver of the leadership term.
fn start_leadership(
    args: &ServeArgs,
    client: &kube::Client,
    identity: &str,
    engine: &EngineHandle,
) -> anyhow::Result<tokio::sync::watch::Receiver<Option<u64>>> {
    let (lead_tx, lead_rx) = tokio::sync::watch::channel(None);
    if !args.leader_elect {
        if args.follow_lease.is_some() {
            tracing::warn!("--follow-lease has no effect with --leader-elect=false");
        }
        let _ = lead_tx.send(Some(0));
        // Keep the sender alive: the receiver treats a dropped sender as shutdown.
        std::mem::forget(lead_tx);
        return Ok(lead_rx);
    }
    let follow = match &args.follow_lease {
        None => None,
        Some(v) => {
            let host = args
                .follow_lease_holder_prefix
                .clone()
                .unwrap_or_else(|| identity.to_owned());
            let f = parse_follow_lease(v, &args.leader_elect_resource_namespace, &host)?;
            tracing::info!(lease = %format!("{}/{}", f.namespace, f.name), holder_prefix = %format!("{}_", f.host),
                "leadership follows this lease: contending only while this pod holds it");
            Some(f)
        }
    };
    let lease = LeaseConfig {
        namespace: args.leader_elect_resource_namespace.clone(),
        name: args.leader_elect_resource_name.clone(),
        identity: identity.to_owned(),
        lease_duration: Duration::from_secs(args.lease_duration_seconds.max(2)),
        retry_period: Duration::from_secs((args.lease_duration_seconds / 5).max(1)),
        follow,
    };
    spawn_task(
        "leader-election",
        run_leader_election(client.clone(), lease, lead_tx, engine.clone()),
    );
    Ok(lead_rx)
}

/// The periodic sweeps: reservations of pods that no longer exist, and HAMi node locks whose
/// pod will never reach Allocate.
fn start_sweeps(engine: &EngineHandle, edge: &Arc<KubeEdge>, shutdown: &CancellationToken) {
    {
        let engine = engine.clone();
        spawn_periodic(
            "reservation-sweep",
            Schedule::every(PERIOD).first_after(PERIOD),
            shutdown.clone(),
            move || {
                let engine = engine.clone();
                async move { engine.send(Command::Sweep).await }
            },
        );
    }
    // HAMi node locks whose pod will never reach Allocate (deleted, failed, rejected): HAMi
    // keeps them for 5 minutes, and its device plugin serves nobody else meanwhile.
    let (engine, edge) = (engine.clone(), edge.clone());
    spawn_periodic(
        "hami-lock-sweep",
        Schedule::every(PERIOD).first_after(PERIOD),
        shutdown.clone(),
        move || {
            let (engine, edge) = (engine.clone(), edge.clone());
            async move {
                for (node, value) in engine.stale_hami_locks().await {
                    match edge.clear_hami_node_lock(&node, &value).await {
                        Ok(()) => {
                            tracing::info!(%node, lock = %value, "cleared a HAMi node lock whose pod is no longer pending allocation")
                        }
                        Err(e) => {
                            tracing::warn!(%node, error = %tessera_runtime::DisplayChain(&e), "could not clear a stale HAMi node lock")
                        }
                    }
                }
            }
        },
    );
}

/// Who may call what: the bearer token (reloaded while it changes), the client CAs of
/// kube-scheduler and of the API server.
fn auth(args: &ServeArgs, shutdown: &CancellationToken) -> anyhow::Result<Arc<Auth>> {
    let token = match &args.token_file {
        Some(p) => Some(read_token(p)?),
        None => None,
    };
    let webhook_client = match &args.webhook_client_ca_file {
        Some(p) => Some(
            tls::client_verifier(&[p.as_path()])
                .with_context(|| format!("webhook client CA {}", p.display()))?,
        ),
        None => None,
    };
    if webhook_client.is_none() {
        tracing::info!(
            "/webhook answers any caller that reaches it: set --webhook-client-ca-file where the API server presents a client certificate (docs/helm.md)"
        );
    }
    // Each CA authenticates for its own routes only: the extender client CA for /filter and
    // /bind, the webhook client CA for /webhook.
    let scheduler_client = match &args.client_ca_file {
        Some(p) => Some(
            tls::client_verifier(&[p.as_path()])
                .with_context(|| format!("extender client CA {}", p.display()))?,
        ),
        None => None,
    };
    let auth = Arc::new(Auth {
        token: RwLock::new(token),
        client_ca: args.client_ca_file.is_some(),
        scheduler_client,
        webhook_client,
    });
    if auth.is_open() {
        tracing::warn!(
            "/filter and /bind accept unauthenticated callers: set --client-ca-file or --token-file (docs/scheduler.md)"
        );
    }
    if let Some(path) = args.token_file.clone() {
        let auth = auth.clone();
        spawn_periodic(
            "token-reload",
            Schedule::every(PERIOD).first_after(PERIOD),
            shutdown.clone(),
            move || {
                match read_token(&path) {
                    Ok(t) => {
                        if let Ok(mut w) = auth.token.write() {
                            *w = Some(t);
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %format!("{e:#}"), "keeping the previous token")
                    }
                }
                std::future::ready(())
            },
        );
    }
    Ok(auth)
}

/// The webhook's settings from the flags.
fn webhook_config(args: &ServeArgs, cfg: &DecisionConfig) -> WebhookConfig {
    let trusted: BTreeSet<String> = if args.webhook_trusted_user.is_empty() {
        let ns = &args.leader_elect_resource_namespace;
        [
            format!("system:serviceaccount:{ns}:tessera-scheduler"),
            format!("system:serviceaccount:{ns}:tessera-device-plugin"),
        ]
        .into_iter()
        .collect()
    } else {
        args.webhook_trusted_user.iter().cloned().collect()
    };
    WebhookConfig {
        nvidia: cfg.nvidia.clone(),
        scheduler_name: args.scheduler_name.clone(),
        force_overwrite_default_scheduler: args.force_overwrite_default_scheduler,
        trusted_users: trusted,
        allow_control_env_namespaces: args
            .webhook_allow_control_env_namespaces
            .iter()
            .map(|n| n.trim().to_owned())
            .filter(|n| !n.is_empty())
            .collect(),
    }
}

/// The listener's TLS configuration (reloaded when its files change), if HTTPS is on.
fn tls_config(args: &ServeArgs) -> anyhow::Result<Option<Arc<RwLock<Arc<rustls::ServerConfig>>>>> {
    let (Some(cert), Some(key)) = (&args.cert_file, &args.key_file) else {
        return Ok(None);
    };
    let files = TlsFiles {
        cert: cert.clone(),
        key: key.clone(),
        client_ca: args.client_ca_file.clone(),
        webhook_client_ca: args.webhook_client_ca_file.clone(),
    };
    let current = Arc::new(RwLock::new(tls::load(&files)?));
    spawn_task(
        "tls-reload",
        tls::watch_reload(files, current.clone(), PERIOD),
    );
    Ok(Some(current))
}

/// The listeners' limits from the flags.
fn serve_limits(args: &ServeArgs) -> ServeLimits {
    let secs = |s: u64| Duration::from_secs(s.max(1));
    ServeLimits {
        handshake_timeout: secs(args.tls_handshake_timeout_seconds),
        header_timeout: secs(args.header_read_timeout_seconds),
        body_timeout: secs(args.body_read_timeout_seconds),
        idle_timeout: secs(args.idle_connection_timeout_seconds),
        max_connections: args.max_connections.max(1),
        max_connections_per_peer: args.max_connections_per_peer.max(1),
        max_requests_per_peer: args.max_requests_per_peer.max(1),
    }
}

/// Serves the extender and the metrics listeners until one ends or a signal comes.
async fn run_servers<E: ClusterEdge>(
    args: &ServeArgs,
    app: Arc<App<E>>,
    tls_cfg: Option<Arc<RwLock<Arc<rustls::ServerConfig>>>>,
    metrics_gate: Option<Arc<MetricsGate>>,
) -> anyhow::Result<()> {
    let limits = serve_limits(args);
    // Not `spawn_task`: the servers' results end the daemon.
    let metrics = tokio::spawn(
        tls::serve_with(
            args.metrics_bind_address,
            metrics_router(app.clone(), metrics_gate),
            None,
            limits,
        )
        .instrument(task_span("metrics-server")),
    );
    let main = tokio::spawn(
        tls::serve_with(args.http_bind, router(app), tls_cfg, limits)
            .instrument(task_span("extender-server")),
    );
    tokio::select! {
        r = main => r.context("extender server task")?.context("extender server"),
        r = metrics => r.context("metrics server task")?.context("metrics server"),
        s = wait_for_shutdown_signal() => {
            let s = s.context("installing the signal handlers")?;
            tracing::info!(signal = %s, "shutting down");
            Ok(())
        }
    }
}

/// The pace of the reservation sweep and of the token and certificate reloads.
const PERIOD: Duration = Duration::from_secs(10);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn follow_lease_takes_namespace_slash_name_or_a_bare_name() {
        let f = parse_follow_lease("gpu/tessera-kube-scheduler", "other", "pod-a").unwrap();
        assert_eq!(
            (f.namespace.as_str(), f.name.as_str(), f.host.as_str()),
            ("gpu", "tessera-kube-scheduler", "pod-a")
        );
        let f = parse_follow_lease("kube-sched", "tessera-system", "pod-a").unwrap();
        assert_eq!(f.namespace, "tessera-system");
        for bad in ["", "ns/", "/name", "a/b/c"] {
            let e = parse_follow_lease(bad, "ns", "pod-a").unwrap_err();
            assert!(
                e.to_string().contains("is not <namespace>/<name>"),
                "{bad}: {e}"
            );
        }
        assert!(parse_follow_lease("ns/l", "ns", "").is_err());
    }
}

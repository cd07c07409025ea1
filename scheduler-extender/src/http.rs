//! The extender and webhook HTTP API (contract §4.2): `POST /filter`, `/bind`, `/webhook`,
//! `GET /healthz`, `/readyz`; and the metrics router.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::time::Instant;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use hami_contract::annotations as ann;
use http_body_util::{BodyExt, Limited};
use k8s_openapi::api::core::v1::Pod;
use prometheus_client::metrics::histogram::Histogram;
use serde_json::value::RawValue;
use tessera_runtime::DisplayChain;
use tessera_scheduler_core::config::DecisionConfig;
use tessera_scheduler_core::decide::{self, Verdict};
use tessera_scheduler_core::extender::{
    ExtenderArgs, ExtenderBindingArgs, ExtenderBindingResult, ExtenderFilterResult,
    ExtenderPreemptionArgs, ExtenderPreemptionResult, NodeListOut, WireError,
};
use tessera_scheduler_core::facts::SharedFacts;
use tessera_scheduler_core::patch::{bind_phase_patch, binding_metadata, decision_patch};
use tessera_scheduler_core::webhook::{self, WebhookAnswer, WebhookConfig};
use tessera_scheduler_core::{podspec, preempt};
use tracing::Instrument;

use crate::edge::{ClusterEdge, EdgeError, EventType, PodEvent};
use crate::engine::{BindPlan, Command, EngineHandle, Refusal};
use crate::metrics::Metrics;
use tessera_http::listen::{BodyTimeout, PeerCertificates};
use tessera_http::metrics_access::{MetricsGate, protect};

/// HAMi's request body limit.
pub const MAX_BODY: usize = 1 << 20;

/// Body deadline when the listener set none.
pub const DEFAULT_BODY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Why a caller may not call a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error(
        "unauthenticated: /filter and /bind accept only kube-scheduler (client certificate or bearer token)"
    )]
    NotTheScheduler,
    #[error(
        "forbidden: /webhook answers only the API server (a client certificate from the webhook client CA)"
    )]
    NotTheApiServer,
}

/// Why `/bind` did not bind; `Display` is the answer's `Error` and the `BindingFailed` event.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    #[error("{0}")]
    BadRequest(#[source] WireError),
    #[error("pod {key} not found")]
    PodNotFound { key: String },
    #[error("reading pod {key}: {source}")]
    ReadPod {
        key: String,
        #[source]
        source: EdgeError,
    },
    #[error("pod {key} has UID {found}, not {expected}: it was recreated")]
    Recreated {
        key: String,
        found: String,
        expected: String,
    },
    #[error("{0}")]
    Refused(#[source] Refusal),
    #[error("binding pod {key} to node {node}: {source}")]
    Api {
        key: String,
        node: String,
        #[source]
        source: EdgeError,
    },
}

/// `namespace/name` of a pod, written only when a log line needs it (span fields).
#[derive(Debug, Clone, Copy)]
struct PodRef<'a> {
    namespace: &'a str,
    name: &'a str,
}

impl<'a> PodRef<'a> {
    fn of(pod: &'a Pod) -> Self {
        PodRef {
            namespace: pod.metadata.namespace.as_deref().unwrap_or_default(),
            name: pod.metadata.name.as_deref().unwrap_or_default(),
        }
    }
}

impl std::fmt::Display for PodRef<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Who may call `/filter` and `/bind`.
#[derive(Debug, Default)]
pub struct Auth {
    /// Expected bearer token (reloaded from its file by the server).
    pub token: RwLock<Option<String>>,
    /// A client CA is configured: a client certificate `scheduler_client` verifies
    /// authenticates.
    pub client_ca: bool,
    /// With it, `/filter` and `/bind` accept only a certificate this verifies (the extender
    /// client CA's). The handshake accepts any certificate whose key the peer holds
    /// ([`tessera_http::tls::load`]): which CA issued it is decided here, per route. `None` with
    /// `client_ca`: no certificate authenticates.
    pub scheduler_client: Option<Arc<dyn rustls::server::danger::ClientCertVerifier>>,
    /// `/webhook` answers only peers whose client certificate this verifies (the API server's,
    /// `--webhook-client-ca-file`); `None`: anyone who reaches the port.
    pub webhook_client: Option<Arc<dyn rustls::server::danger::ClientCertVerifier>>,
}

impl Auth {
    pub fn is_open(&self) -> bool {
        !self.client_ca && self.token.read().map(|t| t.is_none()).unwrap_or(false)
    }

    fn check(
        &self,
        headers: &HeaderMap,
        chain: Option<&PeerCertificates>,
    ) -> Result<(), AuthError> {
        if self.is_open() {
            return Ok(());
        }
        if self.client_ca
            && self
                .scheduler_client
                .as_ref()
                .is_some_and(|v| verified_by(v, chain))
        {
            return Ok(());
        }
        let expected = self.token.read().ok().and_then(|t| t.clone());
        if let Some(expected) = expected {
            let given = headers
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .unwrap_or("");
            if constant_time_eq(given.as_bytes(), expected.trim().as_bytes()) {
                return Ok(());
            }
        }
        Err(AuthError::NotTheScheduler)
    }
}

impl Auth {
    /// `/webhook`: with a webhook client CA, only a certificate it issued.
    fn check_webhook(&self, ext: &axum::http::Extensions) -> Result<(), AuthError> {
        let Some(verifier) = &self.webhook_client else {
            return Ok(());
        };
        if verified_by(verifier, ext.get::<PeerCertificates>()) {
            Ok(())
        } else {
            Err(AuthError::NotTheApiServer)
        }
    }
}

/// The peer's certificate chain is one `verifier` accepts.
fn verified_by(
    verifier: &Arc<dyn rustls::server::danger::ClientCertVerifier>,
    chain: Option<&PeerCertificates>,
) -> bool {
    chain.is_some_and(|c| c.verified_by(verifier))
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() || a.is_empty() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Everything the handlers share.
#[derive(Debug)]
pub struct App<E> {
    pub engine: EngineHandle,
    pub edge: Arc<E>,
    pub auth: Arc<Auth>,
    pub decision: DecisionConfig,
    pub webhook: WebhookConfig,
    /// What the webhook knows of the cluster (largest GPU, namespace GPU quotas); kept on every
    /// replica by `kube_edge::run_facts`.
    pub facts: SharedFacts,
    pub metrics: Metrics,
    /// This replica leads and has rebuilt its state for the current term.
    pub ready: Arc<std::sync::atomic::AtomicBool>,
}

fn json(status: StatusCode, body: String) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// Reads the body with HAMi's limit, within the listener's body deadline ([`BodyTimeout`];
/// [`DEFAULT_BODY_TIMEOUT`] without one). Empty ⇒ HAMi's 400 text; oversized ⇒ a clear 400;
/// too slow ⇒ 408.
async fn read_body(
    body: Body,
    ext: &axum::http::Extensions,
) -> Result<axum::body::Bytes, Response> {
    let deadline = ext
        .get::<BodyTimeout>()
        .map_or(DEFAULT_BODY_TIMEOUT, |t| t.0);
    match tokio::time::timeout(deadline, Limited::new(body, MAX_BODY).collect()).await {
        Err(_) => Err((
            StatusCode::REQUEST_TIMEOUT,
            format!(
                "request body not received within {} s",
                deadline.as_secs_f64()
            ),
        )
            .into_response()),
        Ok(Ok(c)) => {
            let b = c.to_bytes();
            if b.is_empty() {
                Err((StatusCode::BAD_REQUEST, "Please send a request body").into_response())
            } else {
                Ok(b)
            }
        }
        Ok(Err(_)) => Err((
            StatusCode::BAD_REQUEST,
            format!("request body larger than {MAX_BODY} bytes (1 MiB)"),
        )
            .into_response()),
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The router for the extender and webhook listener.
pub fn router<E: ClusterEdge>(app: Arc<App<E>>) -> Router {
    Router::new()
        .route(
            "/filter",
            post(|State(app), req| extender_call::<E>(app, req, ExtenderCall::Filter)),
        )
        .route(
            "/bind",
            post(|State(app), req| extender_call::<E>(app, req, ExtenderCall::Bind)),
        )
        .route(
            "/preempt",
            post(|State(app), req| extender_call::<E>(app, req, ExtenderCall::Preempt)),
        )
        .route("/webhook", post(webhook_handler::<E>))
        .merge(probes())
        .with_state(app)
}

/// `/healthz` and `/readyz`, on both listeners (the kubelet probes the metrics listener when the
/// extender listens on loopback), never behind the metrics' authorization.
fn probes<E: ClusterEdge>() -> Router<Arc<App<E>>> {
    Router::new()
        .route("/healthz", get(|| async { StatusCode::OK }))
        .route(
            "/readyz",
            // Always 200 (as HAMi): every replica serves the webhook, so readiness must not
            // depend on leadership. The body says whether this replica decides.
            get(|State(app): State<Arc<App<E>>>| async move {
                if app.ready.load(std::sync::atomic::Ordering::Relaxed) {
                    (StatusCode::OK, "leader")
                } else {
                    (StatusCode::OK, "standby")
                }
            }),
        )
}

/// The router for the metrics listener: `/metrics` (behind `access` when set) and the probes.
pub fn metrics_router<E: ClusterEdge>(
    app: Arc<App<E>>,
    access: Option<Arc<MetricsGate>>,
) -> Router {
    let metrics = Router::new().route(
        "/metrics",
        get(|State(app): State<Arc<App<E>>>| async move {
            let view = app.engine.metrics().await;
            // Building the rows and encoding them take 0.2 s at 5,000 nodes: on a blocking
            // thread, not on a worker the decision loop and the extender calls share.
            let metrics = app.metrics.clone();
            let text = tokio::task::spawn_blocking(move || metrics.render(view.expand()))
                .await
                .unwrap_or_else(|_| "# metrics encoding failed\n".to_owned());
            (
                [(
                    header::CONTENT_TYPE,
                    "text/plain; version=0.0.4; charset=utf-8",
                )],
                text,
            )
        }),
    );
    protect(metrics, access).merge(probes()).with_state(app)
}

/// The two calls kube-scheduler makes. They differ only in their names, their latency histogram,
/// the form of their answer and what they decide.
#[derive(Debug, Clone, Copy)]
enum ExtenderCall {
    Filter,
    Bind,
    Preempt,
}

impl ExtenderCall {
    /// The `verb` label of the decision counter.
    fn verb(self) -> &'static str {
        match self {
            ExtenderCall::Filter => "filter",
            ExtenderCall::Bind => "bind",
            ExtenderCall::Preempt => "preempt",
        }
    }

    fn seconds(self, metrics: &Metrics) -> &Histogram {
        match self {
            ExtenderCall::Filter => &metrics.filter_seconds,
            ExtenderCall::Bind => &metrics.bind_seconds,
            ExtenderCall::Preempt => &metrics.preempt_seconds,
        }
    }

    /// The answer of a call refused before it is read.
    fn refusal(self, error: String) -> String {
        match self {
            ExtenderCall::Filter => ExtenderFilterResult::error(error).to_json(),
            ExtenderCall::Bind => ExtenderBindingResult { error }.to_json(),
            // `ExtenderPreemptionResult` has no error field: the status says it.
            ExtenderCall::Preempt => serde_json::json!({ "Error": error }).to_string(),
        }
    }

    /// Decides on `body` and answers: the status and the body.
    async fn answer<E: ClusterEdge>(self, app: &App<E>, body: &[u8]) -> (StatusCode, String) {
        match self {
            ExtenderCall::Filter => (StatusCode::OK, filter_body(app, body).await.to_json()),
            ExtenderCall::Bind => (
                StatusCode::OK,
                ExtenderBindingResult {
                    error: bind_body(app, body)
                        .await
                        .err()
                        .map(|e| e.to_string())
                        .unwrap_or_default(),
                }
                .to_json(),
            ),
            ExtenderCall::Preempt => match preempt_body(app, body).await {
                Ok(result) => (StatusCode::OK, result.to_json()),
                // kube-scheduler reads any other status as the extender's error and preempts
                // nothing this cycle.
                Err((status, error)) => (status, self.refusal(error)),
            },
        }
    }
}

/// `POST /filter` and `/bind`: only kube-scheduler may call (401 and an `Unauthenticated`
/// decision otherwise); the body is read within the limits of [`read_body`]; the latency of a
/// call that was read and answered goes to the call's histogram.
async fn extender_call<E: ClusterEdge>(
    app: Arc<App<E>>,
    req: axum::extract::Request,
    call: ExtenderCall,
) -> Response {
    let started = Instant::now();
    let (parts, body) = req.into_parts();
    if let Err(e) = app
        .auth
        .check(&parts.headers, parts.extensions.get::<PeerCertificates>())
    {
        app.metrics.decision(call.verb(), "Unauthenticated");
        return json(StatusCode::UNAUTHORIZED, call.refusal(e.to_string()));
    }
    let body = match read_body(body, &parts.extensions).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    let (status, answer) = call.answer(&app, &body).await;
    call.seconds(&app.metrics)
        .observe(started.elapsed().as_secs_f64());
    json(status, answer)
}

/// Writes an Event on each GPU pod kube-scheduler marks for preemption, naming the slices its
/// eviction frees (kube-scheduler's own `Preempted` Event names the preemptor, not the GPU), and
/// counts it; until the loop stops.
pub async fn report_preempted<E: ClusterEdge>(
    edge: Arc<E>,
    metrics: Metrics,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<crate::engine::PreemptedPod>,
) {
    while let Some(p) = rx.recv().await {
        metrics.preemption_victims.inc();
        edge.event(preempted_event(&p)).await;
    }
}

/// The Event on a pod kube-scheduler preempts.
pub fn preempted_event(p: &crate::engine::PreemptedPod) -> PodEvent {
    PodEvent {
        namespace: p.namespace.clone(),
        name: p.name.clone(),
        uid: p.uid.clone(),
        kind: EventType::Warning,
        reason: "GPUSlicePreempted".to_owned(),
        message: format!(
            "kube-scheduler is evicting this pod for a higher-priority pod; it frees {} on node {}",
            p.slices.join(", "),
            p.node
        ),
    }
}

/// `/preempt`: for each candidate node kube-scheduler proposes (with its own victims), the
/// lower-priority GPU pods whose eviction lets the pod fit ([`preempt::preempt`]); nodes where
/// preemption cannot help are left out. One Event on the pod names the cheapest slice.
async fn preempt_body<E: ClusterEdge>(
    app: &App<E>,
    body: &[u8],
) -> Result<ExtenderPreemptionResult, (StatusCode, String)> {
    let args = ExtenderPreemptionArgs::decode(body).map_err(|e| {
        app.metrics.decision("preempt", "BadRequest");
        (StatusCode::BAD_REQUEST, e.to_string())
    })?;
    let pod = args.pod;
    let span = tracing::info_span!(
        "preempt",
        pod = %PodRef::of(&pod),
        pod_uid = pod.metadata.uid.as_deref().unwrap_or_default(),
        nodes = args.victims.len(),
    );
    async {
        let namespaces = app
            .engine
            .victim_namespaces(pod.clone(), args.victims.clone())
            .await;
        let budgets = app
            .edge
            .disruption_budgets(&namespaces)
            .await
            .map_err(|e| {
                app.metrics.decision("preempt", "BudgetsUnreadable");
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("reading PodDisruptionBudgets failed: {e}"),
                )
            })?;
        let found = app
            .engine
            .preempt(pod.clone(), args.victims, budgets)
            .await
            .map_err(|r| {
                app.metrics.decision("preempt", refusal_code(&r));
                (StatusCode::SERVICE_UNAVAILABLE, r.to_string())
            })?;
        let helped = found.chosen.values().filter(|v| !v.pods.is_empty()).count();
        app.metrics
            .decision("preempt", if helped == 0 { "NoVictims" } else { "success" });
        tracing::debug!(helped, refused = found.refused.len(), "preemption victims");
        if let Some(message) = preempt::describe(&found.chosen, &found.refused) {
            let (kind, reason) = if helped == 0 {
                (EventType::Warning, "PreemptionNotHelpful")
            } else {
                (EventType::Normal, "PreemptionCandidates")
            };
            app.edge
                .event(PodEvent {
                    namespace: pod.metadata.namespace.clone().unwrap_or_default(),
                    name: pod.metadata.name.clone().unwrap_or_default(),
                    uid: pod.metadata.uid.clone().unwrap_or_default(),
                    kind,
                    reason: reason.to_owned(),
                    message,
                })
                .await;
        }
        Ok(ExtenderPreemptionResult::from_victims(&found.chosen))
    }
    .instrument(span)
    .await
}

async fn filter_body<E: ClusterEdge>(app: &App<E>, body: &[u8]) -> ExtenderFilterResult {
    let args = match ExtenderArgs::decode(body) {
        Ok(a) => a,
        Err(e) => {
            app.metrics.decision("filter", "BadRequest");
            return ExtenderFilterResult::error(e.to_string());
        }
    };
    let Some(pod) = args.pod else {
        app.metrics.decision("filter", "MissingPod");
        return ExtenderFilterResult::error("extender args missing pod");
    };
    let span = tracing::info_span!(
        "filter",
        pod = %PodRef::of(&pod),
        pod_uid = pod.metadata.uid.as_deref().unwrap_or_default(),
    );
    let answer = async {
        if podspec::outside_pod_watch(&pod, &app.webhook.scheduler_name)
            && !podspec::pod_ask(&pod, &app.decision.nvidia).0.is_empty()
        {
            // Its booking would never reach the state (the pod watch leaves this scheduler's
            // pods out), so another pod could be given the same share.
            app.metrics.decision("filter", "UnwatchedScheduler");
            return ExtenderFilterResult::error(format!(
                "pod {} asks for GPUs but names schedulerName {}, whose pods Tessera does not \
                 watch: only pods of GPU scheduler profiles ({} and any other but {}) are booked. \
                 Leave schedulerName unset so the webhook sets it, or set the chart's \
                 schedulerName to {}",
                podspec::pod_key(&pod),
                podspec::UNWATCHED_SCHEDULER,
                app.webhook.scheduler_name,
                podspec::UNWATCHED_SCHEDULER,
                podspec::UNWATCHED_SCHEDULER,
            ));
        }
        if args.node_names.is_none()
            && let Some(nodes) = args.nodes
        {
            return filter_full_nodes(app, &pod, nodes);
        }
        let names: Arc<[String]> = args.node_names.unwrap_or_default().into();
        filter_pod(app, Arc::new(pod), names).await
    };
    answer.instrument(span).await
}

/// `/filter` of one pod over the named candidate nodes: the decision loop decides; the answer,
/// its event and (with `--write-decision-at-filter`) the decision written to the pod.
async fn filter_pod<E: ClusterEdge>(
    app: &App<E>,
    pod: Arc<Pod>,
    names: Arc<[String]>,
) -> ExtenderFilterResult {
    let asked = Instant::now();
    let verdict = app
        .engine
        .filter(Arc::clone(&pod), Arc::clone(&names))
        .await;
    app.metrics
        .observe_step("filter", "decision_loop", asked.elapsed());
    let verdict = match verdict {
        Ok(v) => v,
        Err(r) => {
            app.metrics.decision("filter", refusal_code(&r));
            tracing::debug!(refusal = %r, "filter refused");
            return ExtenderFilterResult::error(r.to_string());
        }
    };
    let key = podspec::pod_key(&pod);
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let event = |kind, reason: &str, message: String| PodEvent {
        namespace: pod.metadata.namespace.clone().unwrap_or_default(),
        name: pod.metadata.name.clone().unwrap_or_default(),
        uid: uid.clone(),
        kind,
        reason: reason.to_owned(),
        message,
    };
    match verdict {
        Verdict::NotGpu => {
            app.metrics.decision("filter", "NotGpu");
            tracing::debug!("not a GPU pod: every candidate passes");
            ExtenderFilterResult {
                node_names: Some(names.to_vec()),
                ..Default::default()
            }
        }
        Verdict::Invalid(e) => {
            app.metrics.decision("filter", "InvalidAnnotation");
            ExtenderFilterResult::error(format!("pod {key}: {e}"))
        }
        Verdict::NoFit {
            failed,
            unresolvable,
        } => {
            app.metrics.decision("filter", "NoFit");
            tracing::debug!(
                nodes = failed.len(),
                unresolvable = unresolvable.len(),
                "no candidate fits"
            );
            app.edge
                .event(event(
                    EventType::Warning,
                    "FilteringFailed",
                    decide::failure_summary(&failed),
                ))
                .await;
            ExtenderFilterResult::no_fit(failed, &unresolvable)
        }
        Verdict::Placed(p) => {
            if app.decision.writes.decision_at_filter {
                let patch = decision_patch(&p.node, &p.devices, &p.mig, unix_now());
                let ns = pod.metadata.namespace.clone().unwrap_or_default();
                let name = pod.metadata.name.clone().unwrap_or_default();
                if let Err(e) = app.edge.patch_pod(&ns, &name, &uid, patch).await {
                    app.engine
                        .send(Command::FilterAbort { uid: uid.clone() })
                        .await;
                    app.metrics.decision("filter", "PatchFailed");
                    return ExtenderFilterResult::error(format!(
                        "writing the GPU decision to pod {key} failed: {e}"
                    ));
                }
            }
            app.metrics.decision("filter", "success");
            tracing::debug!(node = %p.node, "placed");
            if app.decision.writes.success_events {
                app.edge
                    .event(event(
                        EventType::Normal,
                        "FilteringSucceed",
                        decide::success_summary(&p),
                    ))
                    .await;
            }
            ExtenderFilterResult {
                node_names: Some(vec![p.node.clone()]),
                failed_nodes: (!p.failed.is_empty()).then_some(p.failed),
                ..Default::default()
            }
        }
    }
}

/// `Nodes` form (not node-cache-capable): [`decide::filter_given_nodes`], no side effects; the
/// answer echoes the node objects as they came.
fn filter_full_nodes<E: ClusterEdge>(
    app: &App<E>,
    pod: &k8s_openapi::api::core::v1::Pod,
    nodes: Vec<(k8s_openapi::api::core::v1::Node, Box<RawValue>)>,
) -> ExtenderFilterResult {
    let (nodes, values): (Vec<_>, Vec<_>) = nodes.into_iter().unzip();
    // By name, as the decision names them (a node without a name takes no part).
    let mut raw: BTreeMap<String, Box<RawValue>> = nodes
        .iter()
        .zip(values)
        .filter_map(|(n, v)| Some((n.metadata.name.clone()?, v)))
        .collect();
    match decide::filter_given_nodes(&app.decision, pod, &nodes) {
        Verdict::NotGpu => ExtenderFilterResult {
            nodes: Some(NodeListOut {
                metadata: BTreeMap::new(),
                items: raw.into_values().collect(),
            }),
            ..Default::default()
        },
        Verdict::Invalid(e) => ExtenderFilterResult::error(e.to_string()),
        Verdict::NoFit {
            failed,
            unresolvable,
        } => ExtenderFilterResult::no_fit(failed, &unresolvable),
        Verdict::Placed(p) => ExtenderFilterResult {
            nodes: Some(NodeListOut {
                metadata: BTreeMap::new(),
                items: raw.remove(&p.node).into_iter().collect(),
            }),
            failed_nodes: (!p.failed.is_empty()).then_some(p.failed),
            ..Default::default()
        },
    }
}

fn refusal_code(r: &Refusal) -> &'static str {
    match r {
        Refusal::NotLeader => "NotLeader",
        Refusal::NotSynced => "NotSynced",
        Refusal::Rejected(_) => "Rejected",
        Refusal::Stopped => "Stopped",
    }
}

/// `/bind`: one API write for a pod this replica filtered, the Binding carrying the decision
/// (`tessera_scheduler_core::patch::binding_metadata`); a read first only when another replica
/// filtered it.
async fn bind_body<E: ClusterEdge>(app: &App<E>, body: &[u8]) -> Result<(), BindError> {
    let args = ExtenderBindingArgs::decode(body).map_err(|e| {
        app.metrics.decision("bind", "BadRequest");
        BindError::BadRequest(e)
    })?;
    let span = tracing::info_span!(
        "bind",
        pod = %PodRef { namespace: &args.pod_namespace, name: &args.pod_name },
        pod_uid = %args.pod_uid,
        node = %args.node,
    );
    let result = bind(app, &args).instrument(span.clone()).await;
    let _entered = span.enter();
    match &result {
        Ok(()) => tracing::debug!("bound"),
        Err(e) => tracing::debug!(error = %e, "bind failed"),
    }
    result
}

/// The steps of one bind: admit it, take HAMi's node lock where the node needs it, write the
/// Binding, report.
async fn bind<E: ClusterEdge>(app: &App<E>, args: &ExtenderBindingArgs) -> Result<(), BindError> {
    let key = format!("{}/{}", args.pod_namespace, args.pod_name);
    let asked = Instant::now();
    let admitted = admit_bind(app, args, &key).await;
    app.metrics
        .observe_step("bind", "decision_loop", asked.elapsed());
    let plan = match admitted {
        Ok(p) => p,
        Err(e) => {
            if let BindError::Refused(r) = &e {
                app.metrics.decision("bind", refusal_code(r));
                app.edge
                    .event(pod_event(
                        args,
                        EventType::Warning,
                        "BindingFailed",
                        e.to_string(),
                    ))
                    .await;
            }
            return Err(e);
        }
    };
    let gpu = plan.devices.is_some();
    let failed = |source| BindError::Api {
        key: key.clone(),
        node: args.node.clone(),
        source,
    };
    if plan.hami_lock {
        // HAMi's device plugin on this node finds the pod under admission by the node lock
        // (`GetPendingPod`), so it must name this pod before the kubelet can see it bound.
        if let Err(e) = app
            .edge
            .lock_hami_node(&args.node, &args.pod_namespace, &args.pod_name)
            .await
        {
            return bind_failed(app, args, gpu, failed(e)).await;
        }
    }
    let metadata = plan
        .devices
        .as_ref()
        .map(|d| binding_metadata(&args.node, d, &plan.mig, unix_now()))
        .unwrap_or_default();
    let posting = Instant::now();
    let posted = app
        .edge
        .bind_pod(
            &args.pod_namespace,
            &args.pod_name,
            &args.pod_uid,
            &args.node,
            metadata,
        )
        .await;
    app.metrics.observe_step("bind", "api", posting.elapsed());
    if let Err(e) = posted {
        if plan.hami_lock {
            release_hami_lock(app, args).await;
        }
        return bind_failed(app, args, gpu, failed(e)).await;
    }
    bound(app, args, &key, gpu).await;
    Ok(())
}

/// The decision loop's admission of the bind: from its own reservation, else from the pod as
/// the API server has it now.
async fn admit_bind<E: ClusterEdge>(
    app: &App<E>,
    args: &ExtenderBindingArgs,
    key: &str,
) -> Result<BindPlan, BindError> {
    let admitted = match app
        .engine
        .bind_reserved(args.pod_uid.clone(), args.node.clone())
        .await
    {
        Ok(Some(plan)) => Ok(plan),
        Ok(None) => {
            let live = read_live_pod(app, args, key).await?;
            app.engine.bind_begin(live, args.node.clone()).await
        }
        Err(r) => Err(r),
    };
    admitted.map_err(BindError::Refused)
}

/// A bind done: the loop learns it, the metrics and (with `--pod-events all`) an event say so.
async fn bound<E: ClusterEdge>(app: &App<E>, args: &ExtenderBindingArgs, key: &str, gpu: bool) {
    if gpu {
        app.engine
            .send(Command::BindDone {
                uid: args.pod_uid.clone(),
                ok: true,
            })
            .await;
    }
    app.metrics.decision("bind", "success");
    if app.decision.writes.success_events {
        app.edge
            .event(pod_event(
                args,
                EventType::Normal,
                "BindingSucceed",
                format!("Successfully binding node [{}] to {key}", args.node),
            ))
            .await;
    }
}

/// An event about the pod of a bind.
fn pod_event(
    args: &ExtenderBindingArgs,
    kind: EventType,
    reason: &str,
    message: String,
) -> PodEvent {
    PodEvent {
        namespace: args.pod_namespace.clone(),
        name: args.pod_name.clone(),
        uid: args.pod_uid.clone(),
        kind,
        reason: reason.to_owned(),
        message,
    }
}

/// Releases the HAMi node lock taken for a bind that failed (HAMi's scheduler does the same), if
/// it still names the pod.
async fn release_hami_lock<E: ClusterEdge>(app: &App<E>, args: &ExtenderBindingArgs) {
    if let Err(e) = app
        .edge
        .release_hami_node_lock(&args.node, &args.pod_namespace, &args.pod_name)
        .await
    {
        tracing::warn!(node = %args.node, error = %DisplayChain(&e), "could not release HAMi's node lock after a failed bind; it expires in 5 minutes or is cleared once the pod is gone");
    }
}

/// The pod as the API server has it now, checked to be the one kube-scheduler means.
async fn read_live_pod<E: ClusterEdge>(
    app: &App<E>,
    args: &ExtenderBindingArgs,
    key: &str,
) -> Result<Pod, BindError> {
    let live = match app.edge.get_pod(&args.pod_namespace, &args.pod_name).await {
        Ok(Some(p)) => p,
        Ok(None) => {
            app.metrics.decision("bind", "PodNotFound");
            return Err(BindError::PodNotFound {
                key: key.to_owned(),
            });
        }
        Err(source) => {
            app.metrics.decision("bind", "ApiError");
            return Err(BindError::ReadPod {
                key: key.to_owned(),
                source,
            });
        }
    };
    if live.metadata.uid.as_deref() != Some(args.pod_uid.as_str()) {
        app.metrics.decision("bind", "UidMismatch");
        return Err(BindError::Recreated {
            key: key.to_owned(),
            found: live.metadata.uid.clone().unwrap_or_default(),
            expected: args.pod_uid.clone(),
        });
    }
    Ok(live)
}

/// A failed bind leaves nothing behind: its reservation is released at once, and where the
/// filter wrote the decision to the pod (HAMi's order) the pod is marked `failed`, so it books
/// nothing while unbound. By default the failed Binding wrote nothing.
async fn bind_failed<E: ClusterEdge>(
    app: &App<E>,
    args: &ExtenderBindingArgs,
    gpu: bool,
    error: BindError,
) -> Result<(), BindError> {
    if gpu {
        if app.decision.writes.decision_at_filter {
            let failed = bind_phase_patch(ann::BIND_PHASE_FAILED);
            if let Err(e) = app
                .edge
                .patch_pod(&args.pod_namespace, &args.pod_name, &args.pod_uid, failed)
                .await
            {
                tracing::warn!(pod = %args.pod_name, error = %DisplayChain(&e), "could not mark the failed bind on the pod");
            }
        }
        app.engine
            .send(Command::BindDone {
                uid: args.pod_uid.clone(),
                ok: false,
            })
            .await;
    }
    app.metrics.decision("bind", "ApiError");
    app.edge
        .event(pod_event(
            args,
            EventType::Warning,
            "BindingFailed",
            error.to_string(),
        ))
        .await;
    Err(error)
}

async fn webhook_handler<E: ClusterEdge>(
    State(app): State<Arc<App<E>>>,
    req: axum::extract::Request,
) -> Response {
    let (parts, body) = req.into_parts();
    if let Err(e) = app.auth.check_webhook(&parts.extensions) {
        return json(
            StatusCode::FORBIDDEN,
            serde_json::json!({ "error": e.to_string() }).to_string(),
        );
    }
    let body = match read_body(body, &parts.extensions).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    let started = Instant::now();
    let answer = match webhook::parse(&body) {
        Ok(req) => review(&app, &req),
        Err(e) => {
            tracing::debug!(error = %DisplayChain(&e), "not an AdmissionReview");
            WebhookAnswer::error(&e)
        }
    };
    app.metrics
        .webhook_review(review_result(&answer), started.elapsed().as_secs_f64());
    let status = StatusCode::from_u16(answer.status).unwrap_or(StatusCode::OK);
    json(status, answer.body.to_string())
}

/// The `result` label of an answered review.
fn review_result(answer: &WebhookAnswer) -> &'static str {
    let response = &answer.body["response"];
    if answer.status != 200 || response.is_null() {
        "error"
    } else if response["allowed"].as_bool() != Some(true) {
        "denied"
    } else if response.get("patch").is_some_and(|p| !p.is_null()) {
        "mutated"
    } else {
        "allowed"
    }
}

/// The webhook's answer to one AdmissionReview, in a span that names the pod.
fn review<E: ClusterEdge>(app: &App<E>, req: &webhook::Request) -> WebhookAnswer {
    let meta = req.object.as_ref().map(|o| &o.metadata);
    // On CREATE the API server may not have named the pod yet (`generateName`).
    let name = [req.name.as_str()]
        .into_iter()
        .chain(meta.and_then(|m| m.name.as_deref()))
        .chain(meta.and_then(|m| m.generate_name.as_deref()))
        .find(|n| !n.is_empty())
        .unwrap_or_default();
    let span = tracing::info_span!(
        "webhook",
        pod = %PodRef {
            namespace: req.namespace.as_deref().unwrap_or_default(),
            name,
        },
        pod_uid = meta.and_then(|m| m.uid.as_deref()).unwrap_or_default(),
        operation = ?req.operation,
    );
    let _entered = span.enter();
    let answer = {
        let facts = app
            .facts
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        webhook::review(req, &app.webhook, &facts)
    };
    tracing::debug!(
        status = answer.status,
        allowed = answer.body["response"]["allowed"].as_bool(),
        "admission answered"
    );
    answer
}

//! `/metrics` behind the API server's authentication and authorization, as kube-rbac-proxy
//! does: a scrape carries a bearer token, the API server says whose it is (TokenReview) and
//! whether that user may `get` the non-resource URL `/metrics` (SubjectAccessReview). The
//! metrics publish every namespace's GPU quota and every GPU pod's name and node, so a tenant
//! who can reach the port must not read them (docs/security.md, "Network peer → metrics").
//!
//! Why here and not only a NetworkPolicy: a policy needs a CNI that enforces it and cannot tell
//! a tenant's pod from Prometheus in the same namespace; a token names the caller. The answer is
//! cached per token (60 s when allowed, 10 s when refused), so one Prometheus costs the API
//! server two reviews a minute per target, and at most [`MAX_REVIEWS_IN_FLIGHT`] reviews run at
//! once, so a flood of made-up tokens cannot turn the listener into a load on the API server.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures::future::BoxFuture;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    NonResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::{Api, PostParams};
use sha2::{Digest, Sha256};
use tokio::time::Instant;

/// Who may read `/metrics` (`--metrics-authorization`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum MetricsAuthorization {
    /// Anyone who reaches the port (HAMi's behaviour; pair it with a NetworkPolicy).
    #[default]
    None,
    /// A bearer token the API server accepts, of a user allowed `get` on the non-resource URL
    /// `/metrics` (the permission Prometheus' own ClusterRole has).
    Kubernetes,
}

/// The command-line flag both plugins and the extender flatten into theirs.
#[derive(Debug, Clone, clap::Args)]
#[command(about = None, long_about = None)]
pub struct MetricsAccessArgs {
    /// Who may read /metrics: `none` (anyone who reaches the port) or `kubernetes` (a bearer
    /// token the API server accepts, of a user allowed `get` on the non-resource URL /metrics,
    /// checked by TokenReview and SubjectAccessReview). /healthz and /readyz stay open.
    #[arg(
        long = "metrics-authorization",
        env = "TESSERA_METRICS_AUTHORIZATION",
        value_enum,
        default_value_t = MetricsAuthorization::None
    )]
    pub metrics_authorization: MetricsAuthorization,
}

/// What the API server said about a token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// A user allowed to read the metrics.
    Allowed,
    /// No token, or one the API server does not accept: 401.
    Unauthenticated,
    /// A real user, not allowed: 403.
    Forbidden,
}

/// The API server's reviews could not be made (it is unreachable, or refused the review itself,
/// e.g. the daemon's account lacks `create` on tokenreviews).
#[derive(Debug, thiserror::Error)]
#[error("cannot review the scrape's token")]
pub struct ReviewError(#[source] pub kube::Error);

/// Decides one token. The Kubernetes answer is [`KubeReviewer`]; tests swap in their own.
pub trait TokenReviewer: Send + Sync + 'static {
    fn review<'a>(&'a self, token: &'a str) -> BoxFuture<'a, Result<Access, ReviewError>>;
}

/// TokenReview, then SubjectAccessReview for `get` on `path`, with the user, groups, UID and
/// extra the TokenReview returned (a bound token's pod and node travel in `extra`).
#[derive(Clone)]
pub struct KubeReviewer {
    client: kube::Client,
    path: String,
}

impl std::fmt::Debug for KubeReviewer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeReviewer")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl KubeReviewer {
    pub fn new(client: kube::Client, path: impl Into<String>) -> Self {
        Self {
            client,
            path: path.into(),
        }
    }

    async fn decide(&self, token: &str) -> Result<Access, ReviewError> {
        let pp = PostParams::default();
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_owned()),
                audiences: None,
            },
            ..Default::default()
        };
        let reviewed = Api::<TokenReview>::all(self.client.clone())
            .create(&pp, &review)
            .await
            .map_err(ReviewError)?;
        let Some(status) = reviewed.status else {
            return Ok(Access::Unauthenticated);
        };
        let user = match (status.authenticated, status.user) {
            (Some(true), Some(user)) => user,
            _ => return Ok(Access::Unauthenticated),
        };
        let sar = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: user.username,
                groups: user.groups,
                uid: user.uid,
                extra: user.extra,
                non_resource_attributes: Some(NonResourceAttributes {
                    path: Some(self.path.clone()),
                    verb: Some("get".to_owned()),
                }),
                resource_attributes: None,
            },
            ..Default::default()
        };
        let decided = Api::<SubjectAccessReview>::all(self.client.clone())
            .create(&pp, &sar)
            .await
            .map_err(ReviewError)?;
        Ok(if decided.status.is_some_and(|s| s.allowed) {
            Access::Allowed
        } else {
            Access::Forbidden
        })
    }
}

impl TokenReviewer for KubeReviewer {
    fn review<'a>(&'a self, token: &'a str) -> BoxFuture<'a, Result<Access, ReviewError>> {
        Box::pin(self.decide(token))
    }
}

/// Reviews at once at most; a scrape beyond waits up to [`REVIEW_WAIT`], then gets 503.
pub const MAX_REVIEWS_IN_FLIGHT: usize = 4;
/// How long a scrape waits for a review slot.
pub const REVIEW_WAIT: Duration = Duration::from_secs(5);
/// How long an allowed token is trusted without asking again.
pub const ALLOWED_TTL: Duration = Duration::from_secs(60);
/// How long a refused token is refused without asking again.
pub const REFUSED_TTL: Duration = Duration::from_secs(10);
/// Tokens remembered at most (a flood of made-up tokens must not grow the cache without bound).
pub const CACHE_ENTRIES: usize = 256;

/// The rate limit of the warnings about reviews that could not be made.
static REVIEW_FAILURES: tessera_runtime::SharedRateLimitedLog =
    tessera_runtime::SharedRateLimitedLog::new(Duration::from_secs(60));

/// The gate in front of `/metrics`: a reviewer, its answers cached by the token's SHA-256 (the
/// token itself is not kept), and a bound on reviews in flight.
pub struct MetricsGate {
    reviewer: Arc<dyn TokenReviewer>,
    cache: Mutex<HashMap<[u8; 32], (Access, Instant)>>,
    reviews: tokio::sync::Semaphore,
}

impl std::fmt::Debug for MetricsGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsGate").finish_non_exhaustive()
    }
}

/// Why a scrape was not answered with the metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    Unauthenticated,
    Forbidden,
    /// The review could not be made or waited too long: 503, not cached.
    Unavailable,
}

impl MetricsGate {
    pub fn new(reviewer: Arc<dyn TokenReviewer>) -> Self {
        Self {
            reviewer,
            cache: Mutex::new(HashMap::new()),
            reviews: tokio::sync::Semaphore::new(MAX_REVIEWS_IN_FLIGHT),
        }
    }

    /// The gate `args` asks for: `None` when the metrics are open.
    pub fn from_args(args: &MetricsAccessArgs, client: &kube::Client) -> Option<Arc<Self>> {
        match args.metrics_authorization {
            MetricsAuthorization::None => None,
            MetricsAuthorization::Kubernetes => Some(Arc::new(Self::new(Arc::new(
                KubeReviewer::new(client.clone(), "/metrics"),
            )))),
        }
    }

    /// Decides a scrape that carried `token` (`None`: no bearer token).
    pub async fn check(&self, token: Option<&str>) -> Result<(), Refusal> {
        let Some(token) = token.filter(|t| !t.is_empty()) else {
            return Err(Refusal::Unauthenticated);
        };
        let key: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        if let Some(access) = self.cached(&key, Instant::now()) {
            return verdict(access);
        }
        let Ok(Ok(_slot)) = tokio::time::timeout(REVIEW_WAIT, self.reviews.acquire()).await else {
            return Err(Refusal::Unavailable);
        };
        // Another scrape with the same token may have decided while this one waited.
        if let Some(access) = self.cached(&key, Instant::now()) {
            return verdict(access);
        }
        match self.reviewer.review(token).await {
            Ok(access) => {
                tracing::debug!(?access, "reviewed a metrics scrape's token");
                self.remember(key, access, Instant::now());
                verdict(access)
            }
            Err(e) => {
                // Every scrape while the API server is away would say so: once a minute.
                match REVIEW_FAILURES.note_now() {
                    Some(left_out) => tracing::warn!(
                        error = %tessera_runtime::DisplayChain(&e),
                        left_out,
                        "refusing a metrics scrape: its token cannot be reviewed (and left_out more since the last such line)"
                    ),
                    None => {
                        tracing::debug!(error = %tessera_runtime::DisplayChain(&e), "refusing a metrics scrape")
                    }
                }
                Err(Refusal::Unavailable)
            }
        }
    }

    fn cached(&self, key: &[u8; 32], now: Instant) -> Option<Access> {
        let cache = self.cache.lock().ok()?;
        let (access, at) = cache.get(key)?;
        let ttl = if *access == Access::Allowed {
            ALLOWED_TTL
        } else {
            REFUSED_TTL
        };
        (now.saturating_duration_since(*at) < ttl).then_some(*access)
    }

    fn remember(&self, key: [u8; 32], access: Access, now: Instant) {
        let Ok(mut cache) = self.cache.lock() else {
            return;
        };
        if cache.len() >= CACHE_ENTRIES {
            cache.retain(|_, (a, at)| {
                let ttl = if *a == Access::Allowed {
                    ALLOWED_TTL
                } else {
                    REFUSED_TTL
                };
                now.saturating_duration_since(*at) < ttl
            });
        }
        if cache.len() >= CACHE_ENTRIES {
            // Still full of live answers: drop the refusals first, then everything. A review
            // more is cheaper than a cache without bound.
            cache.retain(|_, (a, _)| *a == Access::Allowed);
            if cache.len() >= CACHE_ENTRIES {
                cache.clear();
            }
        }
        cache.insert(key, (access, now));
    }
}

fn verdict(access: Access) -> Result<(), Refusal> {
    match access {
        Access::Allowed => Ok(()),
        Access::Unauthenticated => Err(Refusal::Unauthenticated),
        Access::Forbidden => Err(Refusal::Forbidden),
    }
}

/// The bearer token of `Authorization: Bearer <token>`, if any.
pub fn bearer_token(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

/// Middleware: the request goes on only if the gate lets its token through.
pub async fn require_access(
    State(gate): State<Arc<MetricsGate>>,
    req: Request,
    next: Next,
) -> Response {
    match gate.check(bearer_token(req.headers())).await {
        Ok(()) => next.run(req).await,
        Err(Refusal::Unauthenticated) => (
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, "Bearer")],
            "a bearer token the API server accepts is needed to read the metrics\n",
        )
            .into_response(),
        Err(Refusal::Forbidden) => (
            StatusCode::FORBIDDEN,
            "this user may not get the non-resource URL /metrics\n",
        )
            .into_response(),
        Err(Refusal::Unavailable) => (
            StatusCode::SERVICE_UNAVAILABLE,
            "the scrape's token cannot be reviewed now\n",
        )
            .into_response(),
    }
}

/// `router`'s routes behind `gate` (none: unchanged). Routes merged in afterwards (health
/// probes) stay open.
pub fn protect<S>(router: axum::Router<S>, gate: Option<Arc<MetricsGate>>) -> axum::Router<S>
where
    S: Clone + Send + Sync + 'static,
{
    match gate {
        None => router,
        Some(gate) => {
            router.route_layer(axum::middleware::from_fn_with_state(gate, require_access))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Answers from a table and counts the reviews it made.
    struct Table {
        calls: AtomicUsize,
    }

    impl TokenReviewer for Table {
        fn review<'a>(&'a self, token: &'a str) -> BoxFuture<'a, Result<Access, ReviewError>> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                Ok(match token {
                    "prometheus" => Access::Allowed,
                    "tenant" => Access::Forbidden,
                    _ => Access::Unauthenticated,
                })
            })
        }
    }

    fn gate() -> (MetricsGate, Arc<Table>) {
        let table = Arc::new(Table {
            calls: AtomicUsize::new(0),
        });
        (MetricsGate::new(table.clone()), table)
    }

    #[tokio::test(start_paused = true)]
    async fn each_caller_gets_its_answer_and_answers_are_cached_for_their_ttl() {
        let (gate, table) = gate();
        assert_eq!(gate.check(None).await, Err(Refusal::Unauthenticated));
        assert_eq!(gate.check(Some("")).await, Err(Refusal::Unauthenticated));
        assert_eq!(table.calls.load(Ordering::SeqCst), 0, "no token, no review");
        assert_eq!(gate.check(Some("prometheus")).await, Ok(()));
        assert_eq!(gate.check(Some("tenant")).await, Err(Refusal::Forbidden));
        assert_eq!(
            gate.check(Some("made-up")).await,
            Err(Refusal::Unauthenticated)
        );
        assert_eq!(table.calls.load(Ordering::SeqCst), 3);
        for _ in 0..10 {
            assert_eq!(gate.check(Some("prometheus")).await, Ok(()));
            assert_eq!(gate.check(Some("tenant")).await, Err(Refusal::Forbidden));
        }
        assert_eq!(
            table.calls.load(Ordering::SeqCst),
            3,
            "answered from the cache"
        );
        tokio::time::advance(REFUSED_TTL).await;
        assert_eq!(gate.check(Some("tenant")).await, Err(Refusal::Forbidden));
        assert_eq!(gate.check(Some("prometheus")).await, Ok(()));
        assert_eq!(
            table.calls.load(Ordering::SeqCst),
            4,
            "a refusal is asked again sooner"
        );
        tokio::time::advance(ALLOWED_TTL).await;
        assert_eq!(gate.check(Some("prometheus")).await, Ok(()));
        assert_eq!(table.calls.load(Ordering::SeqCst), 5);
    }

    #[tokio::test(start_paused = true)]
    async fn a_flood_of_made_up_tokens_keeps_the_cache_bounded() {
        let (gate, _) = gate();
        assert_eq!(gate.check(Some("prometheus")).await, Ok(()));
        for i in 0..10 * CACHE_ENTRIES {
            let token = format!("made-up-{i}");
            assert_eq!(
                gate.check(Some(&token)).await,
                Err(Refusal::Unauthenticated)
            );
            assert!(gate.cache.lock().unwrap().len() <= CACHE_ENTRIES);
        }
    }

    #[test]
    fn only_a_bearer_authorization_carries_a_token() {
        let mut h = HeaderMap::new();
        assert_eq!(bearer_token(&h), None);
        h.insert(header::AUTHORIZATION, "Basic abc".parse().unwrap());
        assert_eq!(bearer_token(&h), None);
        h.insert(header::AUTHORIZATION, "Bearer ".parse().unwrap());
        assert_eq!(bearer_token(&h), None);
        h.insert(header::AUTHORIZATION, "bearer tok.en".parse().unwrap());
        assert_eq!(bearer_token(&h), Some("tok.en"));
    }
}

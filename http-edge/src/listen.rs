//! The listener under `/filter`, `/bind`, `/webhook` and `/metrics`, hardened against clients
//! that connect and do nothing (docs/scheduler.md, "Connection limits and timeouts"):
//!
//! * a TLS handshake timeout, hyper's HTTP/1 header read timeout, a body read deadline
//!   ([`BodyTimeout`], applied by the handlers) and an idle timeout for connections with no
//!   request in flight (HTTP/2 and keep-alive included);
//! * a connection limit: at the limit, a new connection closes the *oldest idle* one (no request
//!   in flight: a handshake not finished, headers not complete, a keep-alive pause), so a flood of
//!   idle connections cannot keep `/healthz` or a real caller out, and a connection serving a
//!   request is never cut; when every connection is busy, the new one is closed;
//! * per peer (source IP address) limits, so that one peer cannot fill the listener with
//!   connections that each keep a request in flight: at most `max_connections_per_peer` open
//!   connections (at that limit a new one closes the peer's own oldest idle connection, else it
//!   is closed), and at most `max_requests_per_peer` requests in flight over all of them (HTTP/2
//!   streams included; above it a request is answered 429 at once). `/healthz` and `/readyz`
//!   are exempt from the request limit: they cost nothing and are answered at once;
//! * a fair share when several peers together fill the listener with busy connections (a
//!   tenant's pods each have their own address): a new connection then closes the oldest
//!   connection of the peer holding the most, if that peer holds more than one more than the
//!   newcomer, even with a request in flight; only when every peer holds about as many as the
//!   newcomer is the new connection closed;
//! * accept errors back off (10 ms doubling to 1 s; descriptor exhaustion also closes the oldest
//!   idle connection) and are logged at most once per period, with a count.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;
use tessera_runtime::RateLimitedLog;
use tokio::time::Instant;
use tracing::Instrument;

use axum::Router;
use hyper::service::Service as _;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use rustls::ServerConfig;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio_rustls::TlsAcceptor;

/// Set on each request of a TLS connection whose peer presented a certificate: its chain, end
/// entity first. The handshake checked only that the peer holds its key; what it authenticates
/// for is decided per route against each route's CA (the extender's `http::Auth`), through
/// [`PeerCertificates::verified_by`].
#[derive(Debug, Clone)]
pub struct PeerCertificates {
    chain: Arc<[rustls::pki_types::CertificateDer<'static>]>,
    /// The connection's verdicts: `(verifier, accepted, when)`. Shared by every request of the
    /// connection (each gets a clone of this extension).
    verdicts: Arc<std::sync::Mutex<Vec<(usize, bool, Instant)>>>,
}

/// How long a connection's verdict on its chain stands before the chain is verified again. A
/// chain verification is a signature check per certificate (about a tenth of a millisecond):
/// every request of a kept-alive connection paid it, three per placed pod. Within this time of
/// its expiry a certificate is still accepted on a connection that had it verified before.
pub const VERDICT_TTL: Duration = Duration::from_secs(10);

impl PeerCertificates {
    pub fn new(chain: Arc<[rustls::pki_types::CertificateDer<'static>]>) -> Self {
        PeerCertificates {
            chain,
            verdicts: Arc::default(),
        }
    }

    /// The chain, end entity first.
    pub fn chain(&self) -> &[rustls::pki_types::CertificateDer<'static>] {
        &self.chain
    }

    /// Whether `verifier` accepts the chain now; the connection's verdict for `verifier` is
    /// reused for [`VERDICT_TTL`].
    pub fn verified_by(
        &self,
        verifier: &Arc<dyn rustls::server::danger::ClientCertVerifier>,
    ) -> bool {
        let key = Arc::as_ptr(verifier).cast::<()>() as usize;
        let now = Instant::now();
        let mut verdicts = self
            .verdicts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(&(_, accepted, _)) = verdicts
            .iter()
            .find(|(k, _, at)| *k == key && now.duration_since(*at) < VERDICT_TTL)
        {
            return accepted;
        }
        let accepted = self.chain.split_first().is_some_and(|(leaf, rest)| {
            verifier
                .verify_client_cert(leaf, rest, rustls::pki_types::UnixTime::now())
                .is_ok()
        });
        verdicts.retain(|(k, _, _)| *k != key);
        verdicts.push((key, accepted, now));
        accepted
    }
}

/// Limits of one listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServeLimits {
    /// TLS handshake must finish within this.
    pub handshake_timeout: Duration,
    /// HTTP/1 request headers must arrive within this.
    pub header_timeout: Duration,
    /// A request body must arrive within this (the handlers' [`BodyTimeout`]).
    pub body_timeout: Duration,
    /// A connection with no request in flight for this long is closed.
    pub idle_timeout: Duration,
    /// Open connections at most (see the module documentation).
    pub max_connections: usize,
    /// Open connections of one source address at most.
    pub max_connections_per_peer: usize,
    /// Requests in flight from one source address at most (over all its connections).
    pub max_requests_per_peer: usize,
}

/// The default of `--max-connections-per-peer`. A single kube-apiserver is one peer, and a burst
/// of pod creates makes one webhook call per pod at once, each on its own connection: 64
/// refused the last calls of a 100-pod burst (e2e `burst_of_100_pods_onto_one_node_all_get_their_limits`),
/// and the webhook fails closed. A quarter of the default listener leaves three quarters to
/// everyone else.
pub const DEFAULT_MAX_CONNECTIONS_PER_PEER: usize = 256;
/// The default of `--max-requests-per-peer` (HTTP/2 multiplexes several on one connection).
pub const DEFAULT_MAX_REQUESTS_PER_PEER: usize = 512;

impl Default for ServeLimits {
    fn default() -> Self {
        ServeLimits {
            handshake_timeout: Duration::from_secs(10),
            header_timeout: Duration::from_secs(5),
            body_timeout: Duration::from_secs(3),
            idle_timeout: Duration::from_secs(90),
            max_connections: 1024,
            max_connections_per_peer: DEFAULT_MAX_CONNECTIONS_PER_PEER,
            max_requests_per_peer: DEFAULT_MAX_REQUESTS_PER_PEER,
        }
    }
}

/// The body read deadline, handed to the handlers as a request extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodyTimeout(pub Duration);

/// Open-file soft limit of this process (`/proc/self/limits`), if known.
pub fn open_files_limit() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

/// `max_connections` kept below the descriptor limit (`nofile`), leaving room for the API
/// client, the other listener and files: at most `nofile / 2 - 16`, at least 1.
pub fn effective_max_connections(wanted: usize, nofile: Option<usize>) -> usize {
    let cap = nofile.map_or(usize::MAX, |n| (n / 2).saturating_sub(16));
    wanted.min(cap).max(1)
}

/// One open connection, as the registry sees it.
#[derive(Debug)]
struct ConnState {
    peer: IpAddr,
    /// Requests in flight of every connection of this peer.
    peer_in_flight: Arc<AtomicUsize>,
    in_flight: AtomicUsize,
    /// Wakes the connection's task to close it (eviction).
    close: Notify,
    last_active: Mutex<Instant>,
}

impl ConnState {
    fn touch(&self) {
        if let Ok(mut t) = self.last_active.lock() {
            *t = Instant::now();
        }
    }
    fn idle_for(&self) -> Duration {
        self.last_active
            .lock()
            .map(|t| t.elapsed())
            .unwrap_or_default()
    }
}

/// Counts a request in flight on its connection and for its peer while alive.
struct InFlight(Arc<ConnState>);

impl InFlight {
    /// Enters a request; also returns the peer's requests in flight, this one included.
    fn enter(state: &Arc<ConnState>) -> (Self, usize) {
        state.in_flight.fetch_add(1, Ordering::AcqRel);
        let peer = state.peer_in_flight.fetch_add(1, Ordering::AcqRel) + 1;
        state.touch();
        (InFlight(state.clone()), peer)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.touch();
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.0.peer_in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Open connections and requests in flight of one source address.
#[derive(Debug, Default)]
struct Peer {
    conns: usize,
    in_flight: Arc<AtomicUsize>,
}

#[derive(Debug, Default)]
struct Conns {
    next_id: u64,
    /// Oldest first.
    open: BTreeMap<u64, Arc<ConnState>>,
    peers: HashMap<IpAddr, Peer>,
}

impl Conns {
    fn remove(&mut self, id: u64) -> Option<Arc<ConnState>> {
        let s = self.open.remove(&id)?;
        if let Some(p) = self.peers.get_mut(&s.peer) {
            p.conns = p.conns.saturating_sub(1);
            if p.conns == 0 {
                self.peers.remove(&s.peer);
            }
        }
        Some(s)
    }

    /// Closes the oldest connection with no request in flight among those `which` selects.
    fn evict_idle(&mut self, which: impl Fn(&ConnState) -> bool) -> bool {
        let victim = self
            .open
            .iter()
            .find(|(_, s)| which(s) && s.in_flight.load(Ordering::Acquire) == 0)
            .map(|(id, _)| *id);
        match victim.and_then(|id| self.remove(id)) {
            Some(s) => {
                s.close.notify_one();
                true
            }
            None => false,
        }
    }
}

impl Conns {
    /// Closes the oldest connection, busy or not, of the peer holding the most, if it holds
    /// more than `newcomer + 1` (the connections the new one's peer already has).
    fn evict_from_busiest(&mut self, newcomer: usize) -> bool {
        let Some((peer, n)) = self
            .peers
            .iter()
            .max_by_key(|(_, p)| p.conns)
            .map(|(ip, p)| (*ip, p.conns))
        else {
            return false;
        };
        if n <= newcomer + 1 {
            return false;
        }
        let victim = self
            .open
            .iter()
            .find(|(_, s)| s.peer == peer)
            .map(|(id, _)| *id);
        match victim.and_then(|id| self.remove(id)) {
            Some(s) => {
                s.close.notify_one();
                true
            }
            None => false,
        }
    }
}

/// The open connections of one listener, oldest first, counted per peer.
#[derive(Debug, Default)]
pub struct Registry {
    inner: Mutex<Conns>,
}

/// Connection limits the registry enforces at admission.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnLimits {
    pub max_connections: usize,
    pub max_connections_per_peer: usize,
}

/// Why a new connection was closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The listener is at its connection limit and every connection is busy.
    Full,
    /// The peer is at its connection limit and each of its connections is busy.
    PeerFull,
}

/// A registered connection; unregisters on drop.
#[derive(Debug)]
pub struct Slot {
    registry: Arc<Registry>,
    id: u64,
    state: Arc<ConnState>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Ok(mut g) = self.registry.inner.lock() {
            g.remove(self.id);
        }
    }
}

impl Registry {
    /// Open connections.
    pub fn len(&self) -> usize {
        self.inner.lock().map(|g| g.open.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Open connections of `peer`.
    pub fn peer_len(&self, peer: IpAddr) -> usize {
        self.inner
            .lock()
            .map(|g| g.peers.get(&peer).map_or(0, |p| p.conns))
            .unwrap_or(0)
    }

    /// Closes the oldest connection with no request in flight; false if there is none.
    pub fn evict_idle(&self) -> bool {
        self.inner
            .lock()
            .map(|mut g| g.evict_idle(|_| true))
            .unwrap_or(false)
    }

    /// Registers a new connection from `peer`. At the peer's limit the peer's own oldest idle
    /// connection is closed to make room; at the listener's limit the oldest idle one of any
    /// peer, else the oldest of the peer holding the most (see the module documentation); when
    /// there is none, the new connection must be closed.
    pub fn admit(self: &Arc<Self>, peer: IpAddr, limits: ConnLimits) -> Result<Slot, Refused> {
        let mut g = self.inner.lock().map_err(|_| Refused::Full)?;
        let of_peer = g.peers.get(&peer).map_or(0, |p| p.conns);
        if of_peer >= limits.max_connections_per_peer.max(1) && !g.evict_idle(|s| s.peer == peer) {
            return Err(Refused::PeerFull);
        }
        let of_peer = g.peers.get(&peer).map_or(0, |p| p.conns);
        if g.open.len() >= limits.max_connections.max(1)
            && !g.evict_idle(|_| true)
            && !g.evict_from_busiest(of_peer)
        {
            return Err(Refused::Full);
        }
        g.next_id += 1;
        let id = g.next_id;
        let p = g.peers.entry(peer).or_default();
        p.conns += 1;
        let state = Arc::new(ConnState {
            peer,
            peer_in_flight: p.in_flight.clone(),
            in_flight: AtomicUsize::new(0),
            close: Notify::new(),
            last_active: Mutex::new(Instant::now()),
        });
        g.open.insert(id, state.clone());
        Ok(Slot {
            registry: self.clone(),
            id,
            state,
        })
    }
}

/// Backoff for accept errors: 10 ms doubling to 1 s while they last, reset by a success.
#[derive(Debug)]
pub struct AcceptBackoff {
    next: Duration,
    log: RateLimitedLog,
}

impl Default for AcceptBackoff {
    fn default() -> Self {
        AcceptBackoff {
            next: Self::FIRST,
            log: RateLimitedLog::new(Duration::from_secs(10)),
        }
    }
}

/// What to do after one accept error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcceptErrorAction {
    /// Sleep this long before accepting again (zero: a per-connection error, go on).
    pub sleep: Duration,
    /// Descriptors or memory ran out: close an idle connection.
    pub exhausted: bool,
    /// Log a line now; the count of errors not logged since the previous line.
    pub log: Option<u64>,
}

impl AcceptBackoff {
    pub const FIRST: Duration = Duration::from_millis(10);
    pub const MAX: Duration = Duration::from_secs(1);

    pub fn on_success(&mut self) {
        self.next = Self::FIRST;
    }

    pub fn on_error(&mut self, e: &io::Error, now: Instant) -> AcceptErrorAction {
        let log = self.log.note(now);
        // The peer gave up between SYN and accept: nothing is wrong with the listener.
        if matches!(
            e.kind(),
            io::ErrorKind::ConnectionAborted
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::ConnectionRefused
                | io::ErrorKind::Interrupted
        ) {
            return AcceptErrorAction {
                sleep: Duration::ZERO,
                exhausted: false,
                log,
            };
        }
        // EMFILE 24, ENFILE 23, ENOBUFS 105, ENOMEM 12.
        let exhausted = matches!(e.raw_os_error(), Some(23 | 24 | 105 | 12));
        let sleep = self.next;
        self.next = (self.next * 2).min(Self::MAX);
        AcceptErrorAction {
            sleep,
            exhausted,
            log,
        }
    }
}

/// A source of connections and their peers' addresses (a `TcpListener`, or a test's stand-in).
pub trait Accept {
    type Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    fn accept(&mut self) -> impl Future<Output = io::Result<(Self::Stream, IpAddr)>> + Send;
}

impl Accept for TcpListener {
    type Stream = TcpStream;
    async fn accept(&mut self) -> io::Result<(TcpStream, IpAddr)> {
        // An IPv4 peer of a dual-stack socket counts as its IPv4 address.
        TcpListener::accept(self)
            .await
            .map(|(s, a)| (s, a.ip().to_canonical()))
    }
}

/// Accepts forever: each stream goes to `on_conn` with its registry slot (or is dropped, i.e.
/// closed, when the registry refuses it). Errors back off and are logged at most once per period.
pub async fn accept_loop<A: Accept>(
    mut acceptor: A,
    registry: Arc<Registry>,
    limits: ConnLimits,
    mut on_conn: impl FnMut(A::Stream, Slot),
) {
    let mut backoff = AcceptBackoff::default();
    let mut refused = RateLimitedLog::new(Duration::from_secs(10));
    let mut peer_refused = RateLimitedLog::new(Duration::from_secs(10));
    loop {
        match acceptor.accept().await {
            Ok((stream, peer)) => {
                backoff.on_success();
                match registry.admit(peer, limits) {
                    Ok(slot) => on_conn(stream, slot),
                    Err(Refused::Full) => {
                        if let Some(n) = refused.note(Instant::now()) {
                            tracing::warn!(
                                max_connections = limits.max_connections,
                                not_logged = n,
                                "connection limit reached with every connection busy: closing new connections"
                            );
                        }
                    }
                    Err(Refused::PeerFull) => {
                        if let Some(n) = peer_refused.note(Instant::now()) {
                            tracing::warn!(
                                %peer,
                                max_connections_per_peer = limits.max_connections_per_peer,
                                not_logged = n,
                                "a peer reached its connection limit with every one of its connections busy: closing its new connections"
                            );
                        }
                    }
                }
            }
            Err(e) => {
                let act = backoff.on_error(&e, Instant::now());
                if act.exhausted {
                    registry.evict_idle();
                }
                if let Some(n) = act.log {
                    tracing::warn!(error = %e, not_logged = n, retry_in = ?act.sleep, open = registry.len(), "accept failed");
                }
                if !act.sleep.is_zero() {
                    tokio::time::sleep(act.sleep).await;
                }
            }
        }
    }
}

/// Serves one accepted connection: TLS handshake (bounded), then HTTP/1 or HTTP/2 with the
/// header timeout, closed when idle too long or evicted.
async fn serve_conn<S>(
    stream: S,
    slot: Slot,
    router: Router,
    tls: Option<Arc<ServerConfig>>,
    limits: ServeLimits,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let state = slot.state.clone();
    let evicted = state.close.notified();
    tokio::pin!(evicted);
    let router = router.layer(axum::Extension(BodyTimeout(limits.body_timeout)));
    match tls {
        None => {
            run_http(TokioIo::new(stream), router, &state, evicted, limits).await;
        }
        Some(cfg) => {
            let handshake = tokio::time::timeout(
                limits.handshake_timeout,
                TlsAcceptor::from(cfg).accept(stream),
            );
            let tls_stream = tokio::select! {
                r = handshake => match r {
                    Ok(Ok(s)) => s,
                    Ok(Err(e)) => {
                        tracing::debug!(error = %e, "TLS handshake failed");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!("TLS handshake timed out");
                        return;
                    }
                },
                _ = &mut evicted => return,
            };
            // Any certificate whose key the peer proved (crate::tls::load), or none.
            let chain = tls_stream
                .get_ref()
                .1
                .peer_certificates()
                .filter(|c| !c.is_empty())
                .map(|c| PeerCertificates::new(c.to_vec().into()));
            let router = match chain {
                Some(c) => router.layer(axum::Extension(c)),
                None => router,
            };
            run_http(TokioIo::new(tls_stream), router, &state, evicted, limits).await;
        }
    }
    drop(slot);
}

/// The answer to a request over its peer's limit of requests in flight.
fn too_many_requests(limit: usize) -> axum::response::Response {
    use axum::response::IntoResponse;
    (
        axum::http::StatusCode::TOO_MANY_REQUESTS,
        [(axum::http::header::RETRY_AFTER, "1")],
        format!("more than {limit} requests in flight from this address"),
    )
        .into_response()
}

async fn run_http<I>(
    io: I,
    router: Router,
    state: &Arc<ConnState>,
    mut evicted: std::pin::Pin<&mut tokio::sync::futures::Notified<'_>>,
    limits: ServeLimits,
) where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let inner = TowerToHyperService::new(router);
    let st = state.clone();
    let per_peer = limits.max_requests_per_peer.max(1);
    let svc = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
        let (guard, peer_in_flight) = InFlight::enter(&st);
        let exempt = matches!(req.uri().path(), "/healthz" | "/readyz");
        let fut = (exempt || peer_in_flight <= per_peer).then(|| inner.call(req));
        async move {
            let r = match fut {
                Some(fut) => fut.await,
                None => Ok(too_many_requests(per_peer)),
            };
            drop(guard);
            r
        }
    });
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(64);
    let conn = builder.serve_connection(io, svc);
    tokio::pin!(conn);
    let tick = (limits.idle_timeout / 4).clamp(Duration::from_millis(50), Duration::from_secs(5));
    let mut closing: Option<Instant> = None;
    loop {
        tokio::select! {
            _ = conn.as_mut() => return,
            _ = &mut evicted, if closing.is_none() => {
                conn.as_mut().graceful_shutdown();
                closing = Some(Instant::now());
            }
            _ = tokio::time::sleep(tick) => {
                match closing {
                    // A graceful close that the peer does not finish is cut short.
                    Some(t) if t.elapsed() >= limits.handshake_timeout => return,
                    Some(_) => {}
                    None if state.in_flight.load(Ordering::Acquire) == 0
                        && state.idle_for() >= limits.idle_timeout => {
                        conn.as_mut().graceful_shutdown();
                        closing = Some(Instant::now());
                    }
                    None => {}
                }
            }
        }
    }
}

/// Serves `router` on a bound listener with `limits`, over TLS when `tls` is set (the
/// configuration is read per connection, so a reload applies to new connections).
pub async fn serve_listener(
    listener: TcpListener,
    router: Router,
    tls: Option<Arc<RwLock<Arc<ServerConfig>>>>,
    limits: ServeLimits,
) {
    let max = effective_max_connections(limits.max_connections, open_files_limit());
    if max < limits.max_connections {
        tracing::info!(
            max_connections = max,
            "connection limit lowered to fit the open-files limit"
        );
    }
    let registry = Arc::new(Registry::default());
    let conn_limits = ConnLimits {
        max_connections: max,
        max_connections_per_peer: limits.max_connections_per_peer.min(max),
    };
    accept_loop(listener, registry, conn_limits, move |stream, slot| {
        let _ = stream.set_nodelay(true);
        let cfg = match &tls {
            None => None,
            Some(c) => match c.read() {
                Ok(c) => Some(c.clone()),
                Err(_) => return,
            },
        };
        // One task per connection, in the listener's span.
        tokio::spawn(
            serve_conn(stream, slot, router.clone(), cfg, limits)
                .instrument(tracing::Span::current()),
        );
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_errors_back_off_from_10ms_to_1s_and_reset_on_success() {
        let mut b = AcceptBackoff::default();
        let emfile = io::Error::from_raw_os_error(24);
        let now = Instant::now();
        let sleeps: Vec<u64> = (0..9)
            .map(|_| b.on_error(&emfile, now).sleep.as_millis() as u64)
            .collect();
        assert_eq!(sleeps, [10, 20, 40, 80, 160, 320, 640, 1000, 1000]);
        assert!(b.on_error(&emfile, now).exhausted);
        b.on_success();
        assert_eq!(b.on_error(&emfile, now).sleep, Duration::from_millis(10));
        let aborted = io::Error::from(io::ErrorKind::ConnectionAborted);
        let a = b.on_error(&aborted, now);
        assert_eq!((a.sleep, a.exhausted), (Duration::ZERO, false));
    }

    /// An acceptor whose every call fails with EMFILE, counting the calls.
    struct Exhausted(Arc<AtomicUsize>);

    impl Accept for Exhausted {
        type Stream = tokio::io::DuplexStream;
        async fn accept(&mut self) -> io::Result<(Self::Stream, IpAddr)> {
            self.0.fetch_add(1, Ordering::Relaxed);
            Err(io::Error::from_raw_os_error(24))
        }
    }

    /// Counts formatted log lines.
    #[derive(Clone, Default)]
    struct Lines(Arc<AtomicUsize>);

    impl io::Write for Lines {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            let n = buf.iter().filter(|&&b| b == b'\n').count();
            self.0.fetch_add(n, Ordering::Relaxed);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn an_emfile_loop_sleeps_and_logs_a_bounded_number_of_lines() {
        let lines = Lines::default();
        let w = lines.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || w.clone())
            .with_max_level(tracing::Level::DEBUG)
            .finish();
        let calls = Arc::new(AtomicUsize::new(0));
        tracing::subscriber::with_default(subscriber, || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async {
                let registry = Arc::new(Registry::default());
                // An idle connection is closed to free a descriptor.
                let idle = registry.admit(LOCAL, limits(10, 10)).expect("slot");
                let run = accept_loop(
                    Exhausted(calls.clone()),
                    registry.clone(),
                    limits(10, 10),
                    |_, _| {},
                );
                let _ = tokio::time::timeout(Duration::from_millis(1500), run).await;
                assert!(registry.is_empty(), "the idle connection was evicted");
                drop(idle);
            });
        });
        let calls = calls.load(Ordering::Relaxed);
        let lines = lines.0.load(Ordering::Relaxed);
        // 10+20+…+640 ms = 1.27 s, then 1 s steps: about 8 attempts in 1.5 s, not millions.
        assert!((5..=12).contains(&calls), "{calls} accept calls");
        assert_eq!(lines, 1, "{lines} log lines");
    }

    const LOCAL: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

    fn limits(max_connections: usize, max_connections_per_peer: usize) -> ConnLimits {
        ConnLimits {
            max_connections,
            max_connections_per_peer,
        }
    }

    #[test]
    fn at_the_limit_the_oldest_idle_connection_makes_room_and_busy_ones_stay() {
        let r = Arc::new(Registry::default());
        let l = limits(2, 2);
        let a = r.admit(LOCAL, l).expect("a");
        let b = r.admit(LOCAL, l).expect("b");
        let _busy = InFlight::enter(&a.state);
        // a is busy, b is idle: c takes b's place.
        let c = r.admit(LOCAL, l).expect("c");
        assert_eq!(r.len(), 2);
        let _busy_c = InFlight::enter(&c.state);
        // Both busy: refused.
        assert_eq!(r.admit(LOCAL, l).err(), Some(Refused::PeerFull));
        drop(b);
        assert_eq!(r.len(), 2);
        assert_eq!(effective_max_connections(1024, Some(256)), 112);
        assert_eq!(effective_max_connections(1024, None), 1024);
        assert_eq!(effective_max_connections(1024, Some(10)), 1);
    }

    #[test]
    fn one_peer_with_every_connection_busy_leaves_room_for_another_peer() {
        let r = Arc::new(Registry::default());
        let l = limits(8, 5);
        let flood: IpAddr = "127.0.0.2".parse().unwrap();
        let other: IpAddr = "127.0.0.3".parse().unwrap();
        let busy: Vec<_> = (0..5)
            .map(|_| {
                let s = r.admit(flood, l).expect("within the peer's limit");
                let g = InFlight::enter(&s.state);
                (s, g)
            })
            .collect();
        for _ in 0..100 {
            assert_eq!(r.admit(flood, l).err(), Some(Refused::PeerFull));
        }
        assert_eq!(r.peer_len(flood), 5);
        let theirs: Vec<_> = (0..3).map(|_| r.admit(other, l).expect("other")).collect();
        assert_eq!(r.len(), 8);
        // The listener is full: another peer's idle connection makes room, never a busy one.
        let more = r
            .admit(other, l)
            .expect("evicts an idle one of the other peer");
        assert_eq!((r.peer_len(flood), r.peer_len(other)), (5, 3));
        // The peer's requests in flight are counted over its connections.
        assert_eq!(busy[0].0.state.peer_in_flight.load(Ordering::Acquire), 5);
        drop(busy);
        assert_eq!(r.peer_len(flood), 0);
        drop((theirs, more));
        assert!(r.is_empty());
    }

    #[test]
    fn peers_that_together_fill_the_listener_with_busy_connections_give_way_to_a_newcomer() {
        let r = Arc::new(Registry::default());
        let l = limits(6, 5);
        let (a, b, c): (IpAddr, IpAddr, IpAddr) = (
            "10.0.0.1".parse().unwrap(),
            "10.0.0.2".parse().unwrap(),
            "10.0.0.3".parse().unwrap(),
        );
        let busy = |ip| {
            let s = r.admit(ip, l).expect("admitted");
            let g = InFlight::enter(&s.state);
            (s, g)
        };
        let _a: Vec<_> = (0..5).map(|_| busy(a)).collect();
        let _b = busy(b);
        // Full, every connection busy: the newcomer takes the place of the peer holding most.
        let _c1 = busy(c);
        let _c2 = busy(c);
        assert_eq!((r.peer_len(a), r.peer_len(b), r.peer_len(c)), (3, 1, 2));
        // a holds only one more than c: c's next connection is refused, b's is not.
        assert_eq!(r.admit(c, l).err(), Some(Refused::Full));
        let _b2 = busy(b);
        assert_eq!((r.peer_len(a), r.peer_len(b), r.peer_len(c)), (2, 2, 2));
        assert_eq!(r.admit(a, l).err(), Some(Refused::Full));
        assert_eq!(r.len(), 6);
    }
}

#[cfg(test)]
mod verdict_tests {
    use super::*;
    use rustls::pki_types::{CertificateDer, UnixTime};
    use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Accepts the one certificate it was made for, counting its verifications.
    #[derive(Debug)]
    struct Counting {
        accept: Vec<u8>,
        calls: AtomicUsize,
    }

    impl ClientCertVerifier for Counting {
        fn root_hint_subjects(&self) -> &[rustls::DistinguishedName] {
            &[]
        }
        fn verify_client_cert(
            &self,
            end_entity: &CertificateDer<'_>,
            _: &[CertificateDer<'_>],
            _: UnixTime,
        ) -> Result<ClientCertVerified, rustls::Error> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            if end_entity.as_ref() == self.accept.as_slice() {
                Ok(ClientCertVerified::assertion())
            } else {
                Err(rustls::Error::InvalidCertificate(
                    rustls::CertificateError::UnknownIssuer,
                ))
            }
        }
        fn verify_tls12_signature(
            &self,
            _: &[u8],
            _: &CertificateDer<'_>,
            _: &rustls::DigitallySignedStruct,
        ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
            Err(rustls::Error::General("unused".into()))
        }
        fn verify_tls13_signature(
            &self,
            _: &[u8],
            _: &CertificateDer<'_>,
            _: &rustls::DigitallySignedStruct,
        ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
            Err(rustls::Error::General("unused".into()))
        }
        fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
            Vec::new()
        }
    }

    fn verifier(accept: &[u8]) -> (Arc<Counting>, Arc<dyn ClientCertVerifier>) {
        let v = Arc::new(Counting {
            accept: accept.to_vec(),
            calls: AtomicUsize::new(0),
        });
        (v.clone(), v)
    }

    fn chain(leaf: &[u8]) -> PeerCertificates {
        PeerCertificates::new(vec![CertificateDer::from(leaf.to_vec())].into())
    }

    /// A kept-alive connection's chain is verified once per verifier and period, each request
    /// after that reusing the verdict (accepted or refused), and again once the period is over.
    #[tokio::test(start_paused = true)]
    async fn a_connection_verifies_its_chain_once_a_period_per_verifier() {
        let (scheduler_count, scheduler) = verifier(b"scheduler");
        let (webhook_count, webhook) = verifier(b"api-server");
        let conn = chain(b"scheduler");
        // Every request clones the extension: they share the verdicts.
        for _ in 0..3 {
            assert!(conn.clone().verified_by(&scheduler));
            assert!(!conn.clone().verified_by(&webhook));
        }
        assert_eq!(scheduler_count.calls.load(Ordering::SeqCst), 1);
        assert_eq!(webhook_count.calls.load(Ordering::SeqCst), 1);
        // Another connection has verdicts of its own.
        assert!(!chain(b"tenant").verified_by(&scheduler));
        assert_eq!(scheduler_count.calls.load(Ordering::SeqCst), 2);
        tokio::time::advance(VERDICT_TTL).await;
        assert!(conn.verified_by(&scheduler));
        assert!(!conn.verified_by(&webhook));
        assert_eq!(scheduler_count.calls.load(Ordering::SeqCst), 3);
        assert_eq!(webhook_count.calls.load(Ordering::SeqCst), 2);
    }
}

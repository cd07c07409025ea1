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
//! * accept errors back off (10 ms doubling to 1 s; descriptor exhaustion also closes the oldest
//!   idle connection) and are logged at most once per period, with a count.

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;
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

/// Set on each request by the TLS acceptor: the peer presented a client certificate that the
/// configured client CA verified.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VerifiedClientCert(pub bool);

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
}

impl Default for ServeLimits {
    fn default() -> Self {
        ServeLimits {
            handshake_timeout: Duration::from_secs(10),
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(90),
            max_connections: 1024,
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

/// Counts a request in flight on its connection while alive.
struct InFlight(Arc<ConnState>);

impl InFlight {
    fn enter(state: &Arc<ConnState>) -> Self {
        state.in_flight.fetch_add(1, Ordering::AcqRel);
        state.touch();
        InFlight(state.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.touch();
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The open connections of one listener, oldest first.
#[derive(Debug, Default)]
pub struct Registry {
    inner: Mutex<(u64, BTreeMap<u64, Arc<ConnState>>)>,
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
            g.1.remove(&self.id);
        }
    }
}

impl Registry {
    /// Open connections.
    pub fn len(&self) -> usize {
        self.inner.lock().map(|g| g.1.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Closes the oldest connection with no request in flight; false if there is none.
    pub fn evict_idle(&self) -> bool {
        let Ok(mut g) = self.inner.lock() else {
            return false;
        };
        let victim =
            g.1.iter()
                .find(|(_, s)| s.in_flight.load(Ordering::Acquire) == 0)
                .map(|(id, _)| *id);
        match victim.and_then(|id| g.1.remove(&id)) {
            Some(s) => {
                s.close.notify_one();
                true
            }
            None => false,
        }
    }

    /// Registers a new connection, closing the oldest idle one at the limit; `None`: every
    /// connection is busy, the new one must be closed.
    pub fn admit(self: &Arc<Self>, max: usize) -> Option<Slot> {
        if self.len() >= max && !self.evict_idle() {
            return None;
        }
        let mut g = self.inner.lock().ok()?;
        g.0 += 1;
        let id = g.0;
        let state = Arc::new(ConnState {
            in_flight: AtomicUsize::new(0),
            close: Notify::new(),
            last_active: Mutex::new(Instant::now()),
        });
        g.1.insert(id, state.clone());
        Some(Slot {
            registry: self.clone(),
            id,
            state,
        })
    }
}

/// At most one log line per `period` for a repeated event; the line carries how many were not
/// logged since the previous one.
#[derive(Debug)]
pub struct RateLimitedLog {
    period: Duration,
    last: Option<Instant>,
    suppressed: u64,
}

impl RateLimitedLog {
    pub fn new(period: Duration) -> Self {
        RateLimitedLog {
            period,
            last: None,
            suppressed: 0,
        }
    }

    /// One more occurrence at `now`: `Some(n)` when a line is due, `n` occurrences having been
    /// suppressed since the previous line.
    pub fn note(&mut self, now: Instant) -> Option<u64> {
        match self.last {
            Some(t) if now.saturating_duration_since(t) < self.period => {
                self.suppressed = self.suppressed.saturating_add(1);
                None
            }
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.suppressed))
            }
        }
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

/// A source of connections (a `TcpListener`, or a test's stand-in).
pub trait Accept {
    type Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    fn accept(&mut self) -> impl Future<Output = io::Result<Self::Stream>> + Send;
}

impl Accept for TcpListener {
    type Stream = TcpStream;
    async fn accept(&mut self) -> io::Result<TcpStream> {
        TcpListener::accept(self).await.map(|(s, _)| s)
    }
}

/// Accepts forever: each stream goes to `on_conn` with its registry slot (or is dropped, i.e.
/// closed, when every slot is busy). Errors back off and are logged at most once per period.
pub async fn accept_loop<A: Accept>(
    mut acceptor: A,
    registry: Arc<Registry>,
    max_connections: usize,
    mut on_conn: impl FnMut(A::Stream, Slot),
) {
    let mut backoff = AcceptBackoff::default();
    let mut refused = RateLimitedLog::new(Duration::from_secs(10));
    loop {
        match acceptor.accept().await {
            Ok(stream) => {
                backoff.on_success();
                match registry.admit(max_connections) {
                    Some(slot) => on_conn(stream, slot),
                    None => {
                        if let Some(n) = refused.note(Instant::now()) {
                            tracing::warn!(
                                max_connections,
                                not_logged = n,
                                "connection limit reached with every connection busy: closing new connections"
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
            let router = router.layer(axum::Extension(VerifiedClientCert(false)));
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
            // With a client CA configured, rustls only completes the handshake with a
            // certificate it verified (or none at all).
            let verified = tls_stream
                .get_ref()
                .1
                .peer_certificates()
                .is_some_and(|c| !c.is_empty());
            let router = router.layer(axum::Extension(VerifiedClientCert(verified)));
            run_http(TokioIo::new(tls_stream), router, &state, evicted, limits).await;
        }
    }
    drop(slot);
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
    let svc = hyper::service::service_fn(move |req| {
        let guard = InFlight::enter(&st);
        let fut = inner.call(req);
        async move {
            let r = fut.await;
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
    accept_loop(listener, registry, max, move |stream, slot| {
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
    fn a_burst_of_errors_logs_one_line_per_period_with_the_count() {
        // The review's numbers: 3.57 million accept errors in 13 s.
        let start = Instant::now();
        let mut log = RateLimitedLog::new(Duration::from_secs(10));
        let total = 3_570_000u64;
        let mut lines = Vec::new();
        for i in 0..total {
            let now = start + Duration::from_nanos(i * 13_000_000_000 / total);
            if let Some(n) = log.note(now) {
                lines.push(n);
            }
        }
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert_eq!(lines[0], 0);
        assert!(lines[1] > 2_000_000, "{lines:?}");
    }

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
        async fn accept(&mut self) -> io::Result<Self::Stream> {
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
                let idle = registry.admit(10).expect("slot");
                let run = accept_loop(Exhausted(calls.clone()), registry.clone(), 10, |_, _| {});
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

    #[test]
    fn at_the_limit_the_oldest_idle_connection_makes_room_and_busy_ones_stay() {
        let r = Arc::new(Registry::default());
        let a = r.admit(2).expect("a");
        let b = r.admit(2).expect("b");
        let _busy = InFlight::enter(&a.state);
        // a is busy, b is idle: c takes b's place.
        let c = r.admit(2).expect("c");
        assert_eq!(r.len(), 2);
        let _busy_c = InFlight::enter(&c.state);
        // Both busy: refused.
        assert!(r.admit(2).is_none());
        drop(b);
        assert_eq!(r.len(), 2);
        assert_eq!(effective_max_connections(1024, Some(256)), 112);
        assert_eq!(effective_max_connections(1024, None), 1024);
        assert_eq!(effective_max_connections(1024, Some(10)), 1);
    }
}

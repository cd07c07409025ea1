//! The attacks of the security review against the listener, on loopback, each bounded in time:
//! slow headers, a silent TLS peer, a slow body, and a flood of idle connections above the
//! connection limit, which must not keep `/healthz`, `/readyz` or a request in flight from being
//! served; and (issue 28) one peer holding many busy connections, which must not keep another
//! peer's requests out.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio::time::Instant;

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use rustls::pki_types::{CertificateDer, ServerName};
use tessera_http::listen::{ServeLimits, serve_listener};
use tessera_http::tls::{TlsFiles, load};
use tessera_scheduler::engine::{Engine, EngineHandle};
use tessera_scheduler::http::{App, Auth, router};
use tessera_scheduler::metrics::Metrics;
use tessera_scheduler::testing::FakeEdge;
use tessera_scheduler_core::config::DecisionConfig;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

const LIMITS: ServeLimits = ServeLimits {
    handshake_timeout: Duration::from_secs(1),
    header_timeout: Duration::from_secs(2),
    body_timeout: Duration::from_secs(1),
    idle_timeout: Duration::from_secs(30),
    max_connections: 16,
    max_connections_per_peer: 16,
    max_requests_per_peer: 16,
};

fn app() -> axum::Router {
    router(Arc::new(App {
        engine: EngineHandle::spawn(Engine::standalone(DecisionConfig::default())),
        edge: Arc::new(FakeEdge::new()),
        auth: Arc::new(Auth::default()),
        decision: DecisionConfig::default(),
        webhook: Default::default(),
        facts: Default::default(),
        metrics: Metrics::default(),
        ready: Arc::new(AtomicBool::new(true)),
    }))
}

struct Tls {
    server: Arc<rustls::ServerConfig>,
    ca: CertificateDer<'static>,
    _dir: tempfile::TempDir,
}

fn tls() -> Tls {
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec!["localhost".to_owned()])
        .unwrap()
        .signed_by(&key, &ca)
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (c, k) = (dir.path().join("c.pem"), dir.path().join("k.pem"));
    std::fs::write(&c, cert.pem()).unwrap();
    std::fs::write(&k, key.serialize_pem()).unwrap();
    let server = load(&TlsFiles {
        cert: c,
        key: k,
        client_ca: None,
        webhook_client_ca: None,
    })
    .unwrap();
    Tls {
        server,
        ca: ca.der().clone(),
        _dir: dir,
    }
}

/// Starts a listener on a free loopback port; the task ends with the test's runtime.
async fn start(tls: Option<&Tls>) -> u16 {
    start_with(tls, LIMITS).await
}

async fn start_with(tls: Option<&Tls>, limits: ServeLimits) -> u16 {
    // Every 127.0.0.0/8 address is loopback on Linux: the tests' peers connect from several.
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let cfg = tls.map(|t| Arc::new(RwLock::new(t.server.clone())));
    tokio::spawn(serve_listener(l, app(), cfg, limits));
    port
}

/// A plain TCP connection to the listener from source address `from` (127.x.y.z).
async fn connect_from(from: &str, port: u16) -> std::io::Result<TcpStream> {
    let s = tokio::net::TcpSocket::new_v4()?;
    s.bind(format!("{from}:0").parse().unwrap())?;
    s.connect(([127, 0, 0, 1], port).into()).await
}

/// Headers and the first bytes of a `/webhook` body whose rest never comes: a request that
/// stays in flight until the body deadline.
const STALLED_WEBHOOK: &str = "POST /webhook HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{\"apiVersion\":";

/// Another tenant's GPU pod, as the API server sends it to the webhook.
fn gpu_pod_review() -> String {
    let body = r#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"t2","operation":"CREATE","namespace":"tenant-b","userInfo":{"username":"bob"},"object":{"apiVersion":"v1","kind":"Pod","metadata":{"name":"train"},"spec":{"containers":[{"name":"main","image":"app","resources":{"limits":{"nvidia.com/gpu":"1","nvidia.com/gpumem":"1000"}}}]}}}}"#;
    format!(
        "POST /webhook HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}

async fn connect_tls(port: u16, t: &Tls) -> tokio_rustls::client::TlsStream<TcpStream> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(t.ca.clone()).unwrap();
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .unwrap()
}

/// Sends `req` and reads the answer until the server closes (bounded).
async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S, req: &str) -> String {
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

fn get(path: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
}

/// Reads until EOF or error; how long it took (bounded by `max`).
async fn time_to_close(s: &mut TcpStream, max: Duration) -> Option<Duration> {
    let t = Instant::now();
    let mut buf = [0u8; 512];
    loop {
        match tokio::time::timeout(max.saturating_sub(t.elapsed()), s.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(t.elapsed()),
            Ok(Ok(_)) => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_sending_headers_one_byte_per_second_is_cut_off() {
    let port = start(None).await;
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let req = get("/healthz");
    let started = Instant::now();
    let mut sent = 0;
    let mut buf = [0u8; 256];
    for b in req.as_bytes() {
        if s.write_all(&[*b]).await.is_err() {
            break;
        }
        sent += 1;
        // One byte per second; stop as soon as the server has closed.
        match tokio::time::timeout(Duration::from_secs(1), s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(_)) => {}
            Err(_) => {}
        }
        assert!(started.elapsed() < Duration::from_secs(10), "never cut off");
    }
    let took = started.elapsed();
    assert!(
        sent < req.len(),
        "the whole request went through ({sent} bytes)"
    );
    // Header timeout 2 s (+ one 1 s step of the client).
    assert!(took < Duration::from_secs(5), "cut off only after {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_tls_peer_is_closed_after_the_handshake_timeout() {
    let t = tls();
    let port = start(Some(&t)).await;
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let took = time_to_close(&mut s, Duration::from_secs(6)).await;
    let took = took.expect("the silent peer was never closed");
    assert!(took >= Duration::from_millis(900), "{took:?}");
    // And the listener still works.
    let mut c = connect_tls(port, &t).await;
    let out = exchange(&mut c, &get("/healthz")).await;
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_never_arrives_gets_408_after_the_body_timeout() {
    let port = start(None).await;
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let started = Instant::now();
    let out = exchange(
        &mut s,
        "POST /webhook HTTP/1.1\r\nHost: localhost\r\nContent-Length: 100\r\nConnection: close\r\n\r\n{\"a\":",
    )
    .await;
    assert!(out.starts_with("HTTP/1.1 408"), "{out}");
    assert!(started.elapsed() < Duration::from_secs(4));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_idle_connections_does_not_keep_real_requests_out() {
    let t = tls();
    let port = start(Some(&t)).await;
    // A request in flight (its body half sent) when the flood starts: it must not be cut.
    let mut busy = connect_tls(port, &t).await;
    let body = br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"u1","operation":"DELETE"}}"#;
    let head = format!(
        "POST /webhook HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    busy.write_all(head.as_bytes()).await.unwrap();
    busy.write_all(&body[..10]).await.unwrap();
    busy.flush().await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;

    // 4 × the limit: silent TCP peers (no handshake) and finished handshakes with no request.
    let mut idle = Vec::new();
    for i in 0..64 {
        let s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        idle.push(s);
        if i % 8 == 0 {
            let _ = connect_tls(port, &t).await;
        }
    }
    // /healthz and /readyz are answered while the flood holds its sockets open.
    for path in ["/healthz", "/readyz", "/healthz"] {
        let started = Instant::now();
        let mut c = connect_tls(port, &t).await;
        let out = exchange(&mut c, &get(path)).await;
        assert!(out.starts_with("HTTP/1.1 200"), "{path}: {out}");
        assert!(started.elapsed() < Duration::from_secs(3), "{path} slow");
    }
    // The request in flight completes.
    busy.write_all(&body[10..]).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), busy.read_to_end(&mut out)).await;
    let out = String::from_utf8_lossy(&out);
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    assert!(out.contains(r#""allowed":true"#), "{out}");
    drop(idle);
}

/// Issue 28's done-when: 1,000 connections from one peer, each keeping a `/webhook` request in
/// flight (its body stalled, the body deadline far away), leave `/healthz` answering and another
/// tenant's GPU pod admitted by the webhook within 5 s. The listener runs with the default
/// per-peer limits and a global limit below the flood (512), so without the per-peer limits the
/// flood would hold every slot busy and the others would be refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_busy_connections_from_one_peer_leave_healthz_and_another_tenant_served() {
    let limits = ServeLimits {
        header_timeout: Duration::from_secs(60),
        body_timeout: Duration::from_secs(60),
        max_connections: 512,
        ..ServeLimits::default()
    };
    // The flood and the listener hold about 1,100 descriptors.
    let (_, hard) =
        nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE).unwrap();
    let _ = nix::sys::resource::setrlimit(
        nix::sys::resource::Resource::RLIMIT_NOFILE,
        hard.min(8192),
        hard,
    );
    let port = start_with(None, limits).await;
    let mut flood = Vec::new();
    for _ in 0..1000 {
        // The listener closes what it does not admit; the flood keeps whatever it got.
        if let Ok(mut s) = connect_from("127.0.0.2", port).await {
            let _ = s.write_all(STALLED_WEBHOOK.as_bytes()).await;
            flood.push(s);
        }
    }
    assert!(flood.len() > 900, "only {} connections opened", flood.len());
    tokio::time::sleep(Duration::from_millis(300)).await;

    for round in 0..3 {
        let started = Instant::now();
        let mut c = connect_from("127.0.0.1", port).await.unwrap();
        let out = exchange(&mut c, &get("/healthz")).await;
        assert!(out.starts_with("HTTP/1.1 200"), "/healthz {round}: {out:?}");
        assert!(started.elapsed() < Duration::from_secs(5), "/healthz slow");

        let started = Instant::now();
        let mut c = connect_from("127.0.0.3", port).await.unwrap();
        let out = exchange(&mut c, &gpu_pod_review()).await;
        assert!(out.starts_with("HTTP/1.1 200"), "webhook {round}: {out:?}");
        assert!(out.contains(r#""allowed":true"#), "{out}");
        assert!(out.contains(r#""uid":"t2""#), "{out}");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the other tenant waited {:?}",
            started.elapsed()
        );
    }
    // The flooding peer still holds its connections in flight: nothing above was served by
    // waiting for its requests to end.
    // (Counted until the listener has accepted, and closed, the whole flood off its backlog.)
    let per_peer = ServeLimits::default().max_connections_per_peer;
    let mut alive = usize::MAX;
    for _ in 0..50 {
        alive = 0;
        for s in &mut flood {
            let mut b = [0u8; 1];
            if tokio::time::timeout(Duration::from_millis(1), s.read(&mut b))
                .await
                .is_err()
            {
                alive += 1;
            }
        }
        if alive <= per_peer {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        (1..=per_peer).contains(&alive),
        "{alive} of the flood's requests still in flight"
    );
    drop(flood);
}

/// A tenant's pods each have their own address: eight peers together fill the listener with
/// busy connections (each within its per-peer limit). The API server, a new peer, still gets
/// its webhook call answered within 5 s, and `/healthz` answers: the peer holding the most
/// gives way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_connections_from_many_peers_filling_the_listener_give_way_to_a_new_peer() {
    let limits = ServeLimits {
        header_timeout: Duration::from_secs(30),
        body_timeout: Duration::from_secs(30),
        max_connections: 32,
        max_connections_per_peer: 8,
        ..LIMITS
    };
    let port = start_with(None, limits).await;
    let mut flood = Vec::new();
    for i in 10..18 {
        for _ in 0..8 {
            if let Ok(mut s) = connect_from(&format!("127.0.0.{i}"), port).await {
                let _ = s.write_all(STALLED_WEBHOOK.as_bytes()).await;
                flood.push(s);
            }
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    for round in 0..3 {
        let started = Instant::now();
        let mut c = connect_from("127.0.0.3", port).await.unwrap();
        let out = exchange(&mut c, &gpu_pod_review()).await;
        assert!(out.starts_with("HTTP/1.1 200"), "webhook {round}: {out:?}");
        assert!(out.contains(r#""allowed":true"#), "{out}");
        assert!(started.elapsed() < Duration::from_secs(5), "slow");
        let mut c = connect_from("127.0.0.1", port).await.unwrap();
        let out = exchange(&mut c, &get("/healthz")).await;
        assert!(out.starts_with("HTTP/1.1 200"), "/healthz {round}: {out:?}");
    }
    drop(flood);
}

/// One peer's requests in flight are bounded over its connections: above the limit a request
/// is answered 429 at once (not queued), while its `/healthz` and another peer's requests go
/// through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_over_its_requests_in_flight_gets_429_at_once_and_others_are_served() {
    let limits = ServeLimits {
        body_timeout: Duration::from_secs(30),
        max_requests_per_peer: 4,
        ..LIMITS
    };
    let port = start_with(None, limits).await;
    let mut stalled = Vec::new();
    for _ in 0..4 {
        let mut s = connect_from("127.0.0.4", port).await.unwrap();
        s.write_all(STALLED_WEBHOOK.as_bytes()).await.unwrap();
        stalled.push(s);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let started = Instant::now();
    let mut fifth = connect_from("127.0.0.4", port).await.unwrap();
    let out = exchange(&mut fifth, &gpu_pod_review()).await;
    assert!(out.starts_with("HTTP/1.1 429"), "{out:?}");
    assert!(out.contains("retry-after: 1"), "{out:?}");
    assert!(started.elapsed() < Duration::from_secs(2), "not at once");
    // Probes are exempt, even from the same address.
    let mut probe = connect_from("127.0.0.4", port).await.unwrap();
    let out = exchange(&mut probe, &get("/healthz")).await;
    assert!(out.starts_with("HTTP/1.1 200"), "{out:?}");
    let mut other = connect_from("127.0.0.5", port).await.unwrap();
    let out = exchange(&mut other, &gpu_pod_review()).await;
    assert!(out.contains(r#""allowed":true"#), "{out:?}");
    drop(stalled);
}

/// The review's setup: the server process limited to 256 descriptors, 300 idle connections.
/// The server runs in a child process (this test binary again, under `ulimit -n 256`, for 15 s
/// at most) so the limit does not touch the other tests; the idle connections come from here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_a_256_descriptor_limit_300_idle_connections_neither_block_healthz_nor_flood_the_log()
{
    use std::process::Stdio;
    use tokio::io::AsyncBufReadExt;

    let exe = std::env::current_exe().unwrap();
    let mut child = tokio::process::Command::new("sh")
        .arg("-c")
        .arg(r#"ulimit -n 256 && exec "$0" --exact fd_limited_child_server --nocapture"#)
        .arg(&exe)
        .env("TESSERA_LISTENER_CHILD", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut out = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let port: u16 = loop {
        let line = tokio::time::timeout(Duration::from_secs(20), out.next_line())
            .await
            .expect("child started")
            .unwrap()
            .expect("child printed its port");
        if let Some(p) = line.strip_prefix("PORT ") {
            break p.trim().parse().unwrap();
        }
    };
    let mut idle = Vec::new();
    for _ in 0..300 {
        if let Ok(s) = TcpStream::connect(("127.0.0.1", port)).await {
            idle.push(s);
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    for _ in 0..3 {
        let started = Instant::now();
        let mut c = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        let out = exchange(&mut c, &get("/healthz")).await;
        assert!(out.starts_with("HTTP/1.1 200"), "/healthz: {out:?}");
        assert!(started.elapsed() < Duration::from_secs(3));
    }
    drop(idle);
    let _ = child.start_kill();
    let mut err = String::new();
    let mut stderr = child.stderr.take().unwrap();
    let _ = tokio::time::timeout(Duration::from_secs(5), stderr.read_to_string(&mut err)).await;
    let lines = err.lines().count();
    assert!(lines < 20, "{lines} log lines:\n{err}");
    assert!(err.contains("connection limit lowered"), "{err}");
}

/// The server half of the test above; does nothing unless started by it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fd_limited_child_server() {
    if std::env::var_os("TESSERA_LISTENER_CHILD").is_none() {
        return;
    }
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(tracing::Level::DEBUG)
        .init();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    println!("PORT {}", l.local_addr().unwrap().port());
    let limits = ServeLimits {
        // The default limit, lowered by the listener to fit the 256 descriptors.
        max_connections: ServeLimits::default().max_connections,
        ..LIMITS
    };
    let _ = tokio::time::timeout(
        Duration::from_secs(15),
        serve_listener(l, app(), None, limits),
    )
    .await;
}

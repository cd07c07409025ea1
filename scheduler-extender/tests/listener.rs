//! The attacks of the security review against the listener, on loopback, each bounded in time:
//! slow headers, a silent TLS peer, a slow body, and a flood of idle connections above the
//! connection limit, which must not keep `/healthz`, `/readyz` or a request in flight from being
//! served.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio::time::Instant;

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use rustls::pki_types::{CertificateDer, ServerName};
use tessera_scheduler::engine::{Engine, EngineHandle};
use tessera_scheduler::http::{App, Auth, router};
use tessera_scheduler::listen::{ServeLimits, serve_listener};
use tessera_scheduler::metrics::Metrics;
use tessera_scheduler::testing::FakeEdge;
use tessera_scheduler::tls::{TlsFiles, load};
use tessera_scheduler_core::config::DecisionConfig;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

const LIMITS: ServeLimits = ServeLimits {
    handshake_timeout: Duration::from_secs(1),
    header_timeout: Duration::from_secs(2),
    body_timeout: Duration::from_secs(1),
    idle_timeout: Duration::from_secs(30),
    max_connections: 16,
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
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let cfg = tls.map(|t| Arc::new(RwLock::new(t.server.clone())));
    tokio::spawn(serve_listener(l, app(), cfg, LIMITS));
    port
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

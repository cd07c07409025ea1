//! TLS material loading and reload.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use tessera_http::tls::{TlsFiles, load, watch_reload};

fn write_pair(dir: &std::path::Path, name: &str) -> TlsFiles {
    let ck = rcgen::generate_simple_self_signed(vec![name.to_owned()]).unwrap();
    let cert = dir.join("tls.crt");
    let key = dir.join("tls.key");
    std::fs::write(&cert, ck.cert.pem()).unwrap();
    std::fs::write(&key, ck.signing_key.serialize_pem()).unwrap();
    TlsFiles {
        cert,
        key,
        client_ca: None,
        webhook_client_ca: None,
    }
}

#[test]
fn a_valid_pair_loads_with_and_without_a_client_ca() {
    let dir = tempfile::tempdir().unwrap();
    let mut files = write_pair(dir.path(), "localhost");
    assert!(load(&files).is_ok());
    files.client_ca = Some(files.cert.clone());
    assert!(load(&files).is_ok());
}

#[test]
fn missing_or_empty_files_are_named_in_the_error() {
    let dir = tempfile::tempdir().unwrap();
    let mut files = write_pair(dir.path(), "localhost");
    files.key = dir.path().join("absent.key");
    let e = load(&files).unwrap_err().to_string();
    assert!(e.contains("absent.key"), "{e}");
    let files = write_pair(dir.path(), "localhost");
    std::fs::write(&files.cert, "").unwrap();
    let e = load(&files).unwrap_err().to_string();
    assert!(e.contains("no PEM certificate"), "{e}");
}

#[tokio::test]
async fn a_changed_certificate_is_picked_up() {
    let dir = tempfile::tempdir().unwrap();
    let files = write_pair(dir.path(), "old.example");
    let current = Arc::new(RwLock::new(load(&files).unwrap()));
    let before = Arc::as_ptr(&current.read().unwrap().clone());
    tokio::spawn(watch_reload(
        files.clone(),
        current.clone(),
        Duration::from_millis(20),
    ));
    tokio::time::sleep(Duration::from_millis(1100)).await;
    write_pair(dir.path(), "new.example");
    let mut swapped = false;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        if Arc::as_ptr(&current.read().unwrap().clone()) != before {
            swapped = true;
            break;
        }
    }
    assert!(swapped, "configuration was not reloaded");
}

mod mtls {
    use std::sync::atomic::AtomicBool;
    use std::sync::{Arc, RwLock};

    use rcgen::{
        BasicConstraints, CertificateParams, CertifiedIssuer, ExtendedKeyUsagePurpose, IsCa,
        KeyPair,
    };
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
    use tessera_http::tls::{TlsFiles, load, serve};
    use tessera_scheduler::engine::{Engine, EngineHandle};
    use tessera_scheduler::http::{App, Auth, router};
    use tessera_scheduler::metrics::Metrics;
    use tessera_scheduler::testing::FakeEdge;
    use tessera_scheduler_core::config::DecisionConfig;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    struct Pki {
        ca_pem: String,
        ca_der: CertificateDer<'static>,
        server: (String, String),
        client: (CertificateDer<'static>, PrivateKeyDer<'static>),
    }

    fn pki() -> Pki {
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
        let server_key = KeyPair::generate().unwrap();
        let mut sp = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
        sp.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let server = sp.signed_by(&server_key, &ca).unwrap();
        let client_key = KeyPair::generate().unwrap();
        let mut cp = CertificateParams::new(vec!["kube-scheduler".to_owned()]).unwrap();
        cp.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let client = cp.signed_by(&client_key, &ca).unwrap();
        Pki {
            ca_pem: ca.pem(),
            ca_der: ca.der().clone(),
            server: (server.pem(), server_key.serialize_pem()),
            client: (
                client.der().clone(),
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(client_key.serialize_der())),
            ),
        }
    }

    async fn post_filter(port: u16, pki: &Pki, with_cert: bool) -> String {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(pki.ca_der.clone()).unwrap();
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
        let cfg = if with_cert {
            builder
                .with_client_auth_cert(vec![pki.client.0.clone()], pki.client.1.clone_key())
                .unwrap()
        } else {
            builder.with_no_client_auth()
        };
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        let mut tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
            .connect(ServerName::try_from("localhost").unwrap(), tcp)
            .await
            .unwrap();
        let body = r#"{"NodeNames":["n1"]}"#;
        let req = format!(
            "POST /filter HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        tls.write_all(req.as_bytes()).await.unwrap();
        let mut out = String::new();
        let _ = tls.read_to_string(&mut out).await;
        out
    }

    #[tokio::test]
    async fn filter_requires_a_client_certificate_from_the_configured_ca() {
        let pki = pki();
        let dir = tempfile::tempdir().unwrap();
        let (cert, key, ca) = (
            dir.path().join("c.pem"),
            dir.path().join("k.pem"),
            dir.path().join("ca.pem"),
        );
        std::fs::write(&cert, &pki.server.0).unwrap();
        std::fs::write(&key, &pki.server.1).unwrap();
        std::fs::write(&ca, &pki.ca_pem).unwrap();
        let cfg = load(&TlsFiles {
            cert,
            key,
            client_ca: Some(ca),
            webhook_client_ca: None,
        })
        .unwrap();
        let app = Arc::new(App {
            engine: EngineHandle::spawn(Engine::standalone(DecisionConfig::default())),
            edge: Arc::new(FakeEdge::new()),
            auth: Arc::new(Auth {
                token: RwLock::new(None),
                client_ca: true,
                scheduler_client: Some(
                    tessera_http::tls::client_verifier(&[dir.path().join("ca.pem").as_path()])
                        .unwrap(),
                ),
                webhook_client: None,
            }),
            decision: DecisionConfig::default(),
            webhook: Default::default(),
            facts: Default::default(),
            metrics: Metrics::default(),
            ready: Arc::new(AtomicBool::new(true)),
        });
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr = format!("127.0.0.1:{port}").parse().unwrap();
        tokio::spawn(serve(addr, router(app), Some(Arc::new(RwLock::new(cfg)))));
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        let anonymous = post_filter(port, &pki, false).await;
        assert!(anonymous.starts_with("HTTP/1.1 401"), "{anonymous}");
        let scheduler = post_filter(port, &pki, true).await;
        assert!(scheduler.starts_with("HTTP/1.1 200"), "{scheduler}");
        assert!(
            scheduler.contains("extender args missing pod"),
            "{scheduler}"
        );
        // A certificate of a CA the extender does not know (an API server that presents its
        // webhook client certificate to every webhook): the handshake completes, the caller is
        // one without a certificate: /filter refused, /webhook (no webhook client CA here) and
        // /healthz answered.
        let (_, stranger) = client_ca("kube-apiserver");
        let filter = r#"{"NodeNames":["n1"]}"#;
        let filter = format!(
            "POST /filter HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{filter}",
            filter.len()
        );
        let out = request(port, &pki, Some(&stranger), &filter).await;
        assert!(out.starts_with("HTTP/1.1 401"), "{out}");
        let body = r#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"s1","operation":"CREATE","namespace":"ns","userInfo":{"username":"u"},"object":{"apiVersion":"v1","kind":"Pod","metadata":{"name":"p"},"spec":{"containers":[{"name":"main","image":"app"}]}}}}"#;
        let review = format!(
            "POST /webhook HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        let out = request(port, &pki, Some(&stranger), &review).await;
        assert!(out.starts_with("HTTP/1.1 200"), "{out}");
        assert!(out.contains(r#""uid":"s1""#), "{out}");
    }

    /// A CA and one client certificate it issued.
    fn client_ca(cn: &str) -> (String, (CertificateDer<'static>, PrivateKeyDer<'static>)) {
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
        let key = KeyPair::generate().unwrap();
        let mut cp = CertificateParams::new(vec![cn.to_owned()]).unwrap();
        cp.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let cert = cp.signed_by(&key, &ca).unwrap();
        (
            ca.pem(),
            (
                cert.der().clone(),
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
            ),
        )
    }

    /// One HTTPS request with an optional client certificate; the whole answer.
    async fn request(
        port: u16,
        pki: &Pki,
        client: Option<&(CertificateDer<'static>, PrivateKeyDer<'static>)>,
        req: &str,
    ) -> String {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(pki.ca_der.clone()).unwrap();
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
        let cfg = match client {
            Some((c, k)) => builder
                .with_client_auth_cert(vec![c.clone()], k.clone_key())
                .unwrap(),
            None => builder.with_no_client_auth(),
        };
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        let mut tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
            .connect(ServerName::try_from("localhost").unwrap(), tcp)
            .await
            .unwrap();
        tls.write_all(req.as_bytes()).await.unwrap();
        let mut out = String::new();
        let _ = tls.read_to_string(&mut out).await;
        out
    }

    /// Issue 28: `/webhook` as a quota oracle. With a webhook client CA, only a certificate that
    /// CA issued (the API server's) gets an answer: no certificate, or kube-scheduler's
    /// certificate from the extender client CA, gets 403 and learns nothing; probes still work;
    /// the API server's certificate does not open `/filter`.
    #[tokio::test]
    async fn with_a_webhook_client_ca_only_the_api_servers_certificate_gets_a_webhook_answer_and_only_kube_schedulers_opens_filter()
     {
        let pki = pki();
        let (apiserver_ca, apiserver) = client_ca("kube-apiserver");
        let (_, stranger) = client_ca("kube-apiserver");
        let dir = tempfile::tempdir().unwrap();
        let path = |n: &str| dir.path().join(n);
        std::fs::write(path("c.pem"), &pki.server.0).unwrap();
        std::fs::write(path("k.pem"), &pki.server.1).unwrap();
        std::fs::write(path("sched-ca.pem"), &pki.ca_pem).unwrap();
        std::fs::write(path("api-ca.pem"), &apiserver_ca).unwrap();
        let cfg = load(&TlsFiles {
            cert: path("c.pem"),
            key: path("k.pem"),
            client_ca: Some(path("sched-ca.pem")),
            webhook_client_ca: Some(path("api-ca.pem")),
        })
        .unwrap();
        let app = Arc::new(App {
            engine: EngineHandle::spawn(Engine::standalone(DecisionConfig::default())),
            edge: Arc::new(FakeEdge::new()),
            auth: Arc::new(Auth {
                token: RwLock::new(None),
                client_ca: true,
                scheduler_client: Some(
                    tessera_http::tls::client_verifier(&[path("sched-ca.pem").as_path()]).unwrap(),
                ),
                webhook_client: Some(
                    tessera_http::tls::client_verifier(&[path("api-ca.pem").as_path()]).unwrap(),
                ),
            }),
            decision: DecisionConfig::default(),
            webhook: Default::default(),
            facts: Default::default(),
            metrics: Metrics::default(),
            ready: Arc::new(AtomicBool::new(true)),
        });
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr = format!("127.0.0.1:{port}").parse().unwrap();
        tokio::spawn(serve(addr, router(app), Some(Arc::new(RwLock::new(cfg)))));
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;

        let body = r#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"q1","operation":"CREATE","namespace":"victim","userInfo":{"username":"mallory"},"object":{"apiVersion":"v1","kind":"Pod","metadata":{"name":"probe"},"spec":{"containers":[{"name":"main","image":"app","resources":{"limits":{"nvidia.com/gpu":"1","nvidia.com/gpumem":"40000"}}}]}}}}"#;
        let review = format!(
            "POST /webhook HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        for (who, cert) in [
            ("no certificate", None),
            ("kube-scheduler's certificate", Some(&pki.client)),
        ] {
            let out = request(port, &pki, cert, &review).await;
            assert!(out.starts_with("HTTP/1.1 403"), "{who}: {out}");
            assert!(!out.contains("allowed"), "{who}: {out}");
        }
        // A certificate from another CA authenticates for nothing: 403, no answer.
        let out = request(port, &pki, Some(&stranger), &review).await;
        assert!(!out.contains("allowed"), "a stranger's certificate: {out}");
        let out = request(port, &pki, Some(&apiserver), &review).await;
        assert!(out.starts_with("HTTP/1.1 200"), "{out}");
        assert!(out.contains(r#""uid":"q1""#), "{out}");
        // Each CA authenticates for its own routes: the API server's certificate does not open
        // /filter, kube-scheduler's does.
        let filter = r#"{"NodeNames":["n1"]}"#;
        let filter = format!(
            "POST /filter HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{filter}",
            filter.len()
        );
        let out = request(port, &pki, Some(&apiserver), &filter).await;
        assert!(out.starts_with("HTTP/1.1 401"), "{out}");
        let out = request(port, &pki, Some(&pki.client), &filter).await;
        assert!(out.starts_with("HTTP/1.1 200"), "{out}");
        let probe = "GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
        let out = request(port, &pki, None, probe).await;
        assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    }
}

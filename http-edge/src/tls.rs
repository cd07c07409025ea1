//! TLS with rustls: server certificate (reloaded when its files change), optional client CAs for
//! mTLS callers (kube-scheduler on `/filter` and `/bind`, the API server on `/webhook`); the
//! listener itself (limits, timeouts, the accept loop) is [`crate::listen`].

use std::io::BufReader;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use axum::Router;
use rustls::ServerConfig;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::danger::ClientCertVerifier;
use tokio::net::TcpListener;

use crate::listen::ServeLimits;

/// Why TLS could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: no PEM {what} found")]
    Empty { path: PathBuf, what: &'static str },
    #[error("TLS configuration: {0}")]
    Rustls(#[source] rustls::Error),
    #[error("TLS configuration: {path}: {source}")]
    Ca {
        path: PathBuf,
        #[source]
        source: rustls::Error,
    },
    #[error("TLS configuration: {0}")]
    ClientVerifier(#[source] rustls::server::VerifierBuilderError),
}

/// Where the PEM files are.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// CA of kube-scheduler's client certificate (`/filter`, `/bind`).
    pub client_ca: Option<PathBuf>,
    /// CA of the API server's client certificate (`/webhook`).
    pub webhook_client_ca: Option<PathBuf>,
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_owned(),
        source,
    })
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let data = read(path)?;
    let certs: Vec<_> = rustls_pemfile::certs(&mut BufReader::new(data.as_slice()))
        .collect::<Result<_, _>>()
        .map_err(|source| TlsError::Read {
            path: path.to_owned(),
            source,
        })?;
    if certs.is_empty() {
        return Err(TlsError::Empty {
            path: path.to_owned(),
            what: "certificate",
        });
    }
    Ok(certs)
}

fn key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let data = read(path)?;
    rustls_pemfile::private_key(&mut BufReader::new(data.as_slice()))
        .map_err(|source| TlsError::Read {
            path: path.to_owned(),
            source,
        })?
        .ok_or_else(|| TlsError::Empty {
            path: path.to_owned(),
            what: "private key",
        })
}

/// A verifier of client certificates issued by the CAs in `cas` (PEM bundles); it also lets
/// peers without a certificate complete the handshake (the handlers decide what they may call).
pub fn client_verifier(cas: &[&Path]) -> Result<Arc<dyn ClientCertVerifier>, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for ca in cas {
        for c in certs(ca)? {
            roots.add(c).map_err(|source| TlsError::Ca {
                path: ca.to_path_buf(),
                source,
            })?;
        }
    }
    rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
        .allow_unauthenticated()
        .build()
        .map_err(TlsError::ClientVerifier)
}

/// The handshake's client-certificate check: a certificate is asked for (with the configured
/// CAs as hints), none is required, and any chain is taken whose key the peer proves it holds
/// (the signature checks are the WebPKI verifier's). Whether the chain comes from a CA that
/// opens a route is checked per route (the extender's `http::Auth`). So a client that presents a
/// certificate of another CA (an API server configured to present its webhook client
/// certificate to every webhook) is a caller without a certificate, as it is to any webhook
/// that does not ask for one, rather than a failed handshake.
#[derive(Debug)]
struct AnyClientChain {
    webpki: Arc<dyn ClientCertVerifier>,
}

impl ClientCertVerifier for AnyClientChain {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        false
    }

    fn root_hint_subjects(&self) -> &[rustls::DistinguishedName] {
        self.webpki.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        _end_entity: &rustls::pki_types::CertificateDer<'_>,
        _intermediates: &[rustls::pki_types::CertificateDer<'_>],
        _now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::server::danger::ClientCertVerified, rustls::Error> {
        Ok(rustls::server::danger::ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.webpki.supported_verify_schemes()
    }
}

/// Builds the server configuration from the files.
pub fn load(files: &TlsFiles) -> Result<Arc<ServerConfig>, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Rustls)?;
    let cas: Vec<&Path> = [&files.client_ca, &files.webhook_client_ca]
        .into_iter()
        .flatten()
        .map(PathBuf::as_path)
        .collect();
    let builder = if cas.is_empty() {
        builder.with_no_client_auth()
    } else {
        // Peers without a certificate still complete the handshake (probes, token callers), and
        // so do peers with a certificate of a CA the extender does not know: which CA issued
        // it decides what it authenticates for, per route (the extender's `http::Auth`).
        builder.with_client_cert_verifier(Arc::new(AnyClientChain {
            webpki: client_verifier(&cas)?,
        }))
    };
    let mut cfg = builder
        .with_single_cert(certs(&files.cert)?, key(&files.key)?)
        .map_err(TlsError::Rustls)?;
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

fn mtimes(paths: &[&Path]) -> Vec<Option<SystemTime>> {
    paths
        .iter()
        .map(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok())
        .collect()
}

/// Reloads the configuration whenever a file's modification time changes (Secret volume
/// updates swap the files); a broken new pair keeps the old configuration.
pub async fn watch_reload(
    files: TlsFiles,
    current: Arc<RwLock<Arc<ServerConfig>>>,
    every: Duration,
) {
    let paths: Vec<PathBuf> = [
        Some(files.cert.clone()),
        Some(files.key.clone()),
        files.client_ca.clone(),
        files.webhook_client_ca.clone(),
    ]
    .into_iter()
    .flatten()
    .collect();
    let refs: Vec<&Path> = paths.iter().map(PathBuf::as_path).collect();
    let mut seen = mtimes(&refs);
    loop {
        tokio::time::sleep(every).await;
        let now = mtimes(&refs);
        if now == seen {
            continue;
        }
        match load(&files) {
            Ok(cfg) => {
                if let Ok(mut w) = current.write() {
                    *w = cfg;
                }
                seen = now;
                tracing::info!("reloaded TLS certificate");
            }
            Err(e) => {
                tracing::warn!(error = %tessera_runtime::DisplayChain(&e), "new TLS files are not usable yet; keeping the old certificate")
            }
        }
    }
}

/// Serves `router` on `addr`, over TLS when `tls` is set, with the default limits.
pub async fn serve(
    addr: SocketAddr,
    router: Router,
    tls: Option<Arc<RwLock<Arc<ServerConfig>>>>,
) -> std::io::Result<()> {
    serve_with(addr, router, tls, ServeLimits::default()).await
}

/// Serves `router` on `addr` with `limits` (timeouts, connection limit: [`crate::listen`]).
pub async fn serve_with(
    addr: SocketAddr,
    router: Router,
    tls: Option<Arc<RwLock<Arc<ServerConfig>>>>,
    limits: ServeLimits,
) -> std::io::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    tracing::info!(%addr, tls = tls.is_some(), ?limits, "listening");
    crate::listen::serve_listener(listener, router, tls, limits).await;
    Ok(())
}

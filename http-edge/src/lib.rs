//! The HTTP edge every Tessera daemon shares: [`listen`] (the listener, bounded per peer, with
//! deadlines), [`tls`] (rustls, reloaded certificates, client CAs) and [`metrics_access`]
//! (`/metrics` behind the API server's TokenReview and SubjectAccessReview).
// Daemon and library code returns errors; only tests may unwrap (clippy.toml allows it there).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

pub mod listen;
pub mod metrics_access;
pub mod tls;

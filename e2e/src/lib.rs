//! Tessera end to end on the real upstream control plane.
//!
//! [`cluster::Cluster`] starts, on loopback and with generated certificates: etcd, a
//! kube-apiserver (token authentication, RBAC, the chart's `MutatingWebhookConfiguration` with
//! its CA bundle), one or more scheduler "pods" (the upstream kube-scheduler with the chart's
//! `KubeSchedulerConfiguration`, beside a `tessera-scheduler serve`), and GPU nodes
//! ([`node::GpuNode`]: a real `Node` object, the real `tessera-device-plugin` on a fake NVML
//! scenario, and a harness kubelet on real unix sockets). Every process belongs to the cluster
//! value, logs to a file, and is killed when it drops; the logs are kept when a test fails.
//!
//! Test support only, never shipped.
#![allow(
    clippy::disallowed_types,
    reason = "the e2e harness times real processes and clusters: wall-clock std::time::Instant"
)]

pub mod admission;
pub mod artifacts;
pub mod booking;
pub mod certs;
pub mod cluster;
pub mod demo;
pub mod fake_nvidia_runtime;
pub mod images;
pub mod netns;
pub mod node;
pub mod null_plugin;
pub mod pods;
pub mod probe;
pub mod process;
pub mod prometheus;
pub mod real;
pub mod release;

/// Errors of the harness; a failed test prints them with the logs' location.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Msg(String),
    #[error(transparent)]
    Artifacts(#[from] &'static artifacts::ArtifactError),
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("kubeconfig: {0}")]
    Kubeconfig(#[from] kube::config::KubeconfigError),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("YAML: {0}")]
    Yaml(#[from] yaml_serde::Error),
    #[error("certificates: {0}")]
    Certs(#[from] rcgen::Error),
}

impl Error {
    pub fn msg(m: impl Into<String>) -> Error {
        Error::Msg(m.into())
    }
}

pub type Result<T> = std::result::Result<T, Error>;

/// Polls `probe` every `every` until it returns `Some`, or fails after `within` naming `what`.
pub async fn eventually<T, F, Fut>(
    what: &str,
    within: std::time::Duration,
    every: std::time::Duration,
    mut probe: F,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if let Some(v) = probe().await {
            return Ok(v);
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(Error::msg(format!(
                "timed out after {within:?} waiting for {what}"
            )));
        }
        tokio::time::sleep(every).await;
    }
}

/// Every document of a multi-document YAML text (a rendered chart, a file of manifests) as
/// JSON, empty documents skipped.
pub fn yaml_documents(text: &str) -> Result<Vec<serde_json::Value>> {
    let mut out = Vec::new();
    for (i, doc) in yaml_serde::Deserializer::from_str(text).enumerate() {
        let v: serde_json::Value = serde::Deserialize::deserialize(doc)
            .map_err(|e| Error::msg(format!("YAML document {}: {e}", i + 1)))?;
        if !v.is_null() {
            out.push(v);
        }
    }
    Ok(out)
}

/// The object of a one-document YAML file (an example manifest), typed.
pub fn read_yaml_object<T: serde::de::DeserializeOwned>(path: &std::path::Path) -> Result<T> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::msg(format!("reading {}: {e}", path.display())))?;
    let doc = yaml_documents(&text)?
        .into_iter()
        .next()
        .ok_or_else(|| Error::msg(format!("{}: no object", path.display())))?;
    Ok(serde_json::from_value(doc)?)
}

//! Serving on the device-plugin socket, registering with the kubelet, and re-registering when
//! the kubelet restarts (it deletes every socket in the directory and recreates `kubelet.sock`).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use kubelet_proto::deviceplugin::v1beta1 as dp;
use kubelet_proto::deviceplugin::v1beta1::device_plugin_server::DevicePluginServer;
use kubelet_proto::deviceplugin::v1beta1::registration_client::RegistrationClient;
use std::sync::Arc;
use tokio::net::UnixListener;

use tokio::sync::{Notify, watch};
use tonic::transport::Channel;

use crate::metrics::PluginMetrics;
use crate::service::DevicePluginService;

/// Where and as what the plugin registers.
#[derive(Debug, Clone)]
pub struct KubeletSettings {
    /// The kubelet's device-plugin directory (`/var/lib/kubelet/device-plugins`).
    pub socket_dir: PathBuf,
    /// File name of the plugin's socket in that directory (`nvidia-gpu.sock`).
    pub socket_name: String,
    /// `nvidia.com/gpu`.
    pub resource_name: String,
    pub preferred_allocation: bool,
    /// How often the sockets are checked for a kubelet restart.
    pub poll_interval: Duration,
    /// Notified (e.g. on SIGHUP, as HAMi's plugin does) to restart serving and re-register.
    pub restart: Arc<Notify>,
}

/// HAMi's socket name: `nvidia-` + the resource name's suffix.
pub fn socket_name_for(resource: &str) -> String {
    let suffix = resource.rsplit('/').next().unwrap_or(resource);
    format!("nvidia-{suffix}.sock")
}

#[derive(Debug, thiserror::Error)]
pub enum KubeletError {
    #[error("cannot serve on {path}: {reason}")]
    Listen { path: String, reason: String },
    #[error("cannot reach the kubelet at {path}: {reason}")]
    Connect { path: String, reason: String },
    #[error("the kubelet refused the registration: {0}")]
    Register(String),
}

/// A tonic channel over a unix socket.
pub async fn unix_channel(path: &Path) -> Result<Channel, KubeletError> {
    kubelet_proto::transport::unix_channel(path, Duration::from_secs(5))
        .await
        .map_err(|e| KubeletError::Connect {
            path: path.display().to_string(),
            reason: e.to_string(),
        })
}

/// One `Register` call.
pub async fn register(settings: &KubeletSettings) -> Result<(), KubeletError> {
    let kubelet = settings.socket_dir.join(dp::KUBELET_SOCKET_NAME);
    let channel = unix_channel(&kubelet).await?;
    let mut client = RegistrationClient::new(channel);
    client
        .register(dp::RegisterRequest {
            version: dp::VERSION.to_owned(),
            endpoint: settings.socket_name.clone(),
            resource_name: settings.resource_name.clone(),
            options: Some(dp::DevicePluginOptions {
                pre_start_required: false,
                get_preferred_allocation_available: settings.preferred_allocation,
            }),
        })
        .await
        .map_err(|s| KubeletError::Register(s.message().to_owned()))?;
    Ok(())
}

/// Identity of a socket file: a recreated `kubelet.sock` has a new inode or change time.
fn file_identity(path: &Path) -> Option<(u64, u64, i64, i64)> {
    std::fs::metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino(), m.ctime(), m.ctime_nsec()))
}

/// Serves, registers and re-registers until `shutdown` becomes true; removes the socket at the
/// end. Errors only when the socket cannot be created at all.
pub async fn run(
    settings: KubeletSettings,
    make_service: impl Fn(watch::Receiver<bool>) -> DevicePluginService,
    mut shutdown: watch::Receiver<bool>,
    metrics: Option<PluginMetrics>,
) -> Result<(), KubeletError> {
    let own_socket = settings.socket_dir.join(&settings.socket_name);
    let kubelet_socket = settings.socket_dir.join(dp::KUBELET_SOCKET_NAME);
    loop {
        if *shutdown.borrow() {
            break;
        }
        match std::fs::remove_file(&own_socket) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(path = %own_socket.display(), error = %e, "cannot remove stale socket")
            }
        }
        let listener = UnixListener::bind(&own_socket).map_err(|e| KubeletError::Listen {
            path: own_socket.display().to_string(),
            reason: e.to_string(),
        })?;
        let (stop_tx, stop_rx) = watch::channel(false);
        let service = make_service(stop_rx.clone());
        let mut server_stop = stop_rx.clone();
        let server = tokio::spawn(async move {
            let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
            tonic::transport::Server::builder()
                .add_service(DevicePluginServer::new(service))
                .serve_with_incoming_shutdown(incoming, async move {
                    let _ = server_stop.wait_for(|s| *s).await;
                })
                .await
        });
        tracing::info!(socket = %own_socket.display(), "device plugin serving");

        // Register (retrying while the kubelet is not there yet).
        let mut kubelet_identity = None;
        while !*shutdown.borrow() {
            match register(&settings).await {
                Ok(()) => {
                    kubelet_identity = file_identity(&kubelet_socket);
                    tracing::info!(resource = %settings.resource_name, "registered with the kubelet");
                    if let Some(m) = &metrics {
                        m.registered();
                    }
                    break;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "registration failed; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(settings.poll_interval) => {}
                        _ = shutdown.changed() => {}
                    }
                    // The kubelet may have deleted our socket while we waited.
                    if file_identity(&own_socket).is_none() {
                        break;
                    }
                }
            }
        }

        // Watch for a kubelet restart.
        while !*shutdown.borrow() && kubelet_identity.is_some() {
            tokio::select! {
                _ = tokio::time::sleep(settings.poll_interval) => {}
                _ = shutdown.changed() => {}
                _ = settings.restart.notified() => {
                    tracing::info!("restart requested; serving and registering again");
                    break;
                }
            }
            let own_gone = file_identity(&own_socket).is_none();
            let kubelet_now = file_identity(&kubelet_socket);
            if own_gone || kubelet_now != kubelet_identity {
                tracing::info!(
                    own_gone,
                    "kubelet restart detected; serving and registering again"
                );
                break;
            }
        }

        let _ = stop_tx.send(true);
        match tokio::time::timeout(Duration::from_secs(5), server).await {
            Ok(Ok(Err(e))) => {
                tracing::warn!(error = %e, "device plugin server ended with an error")
            }
            Ok(_) => {}
            Err(_) => tracing::warn!("device plugin server did not stop within 5 s"),
        }
        if *shutdown.borrow() {
            break;
        }
        // Give a restarting kubelet a moment to create its socket before the next attempt.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = std::fs::remove_file(&own_socket);
    tracing::info!(socket = %own_socket.display(), "device plugin stopped; socket removed");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_name_follows_hami() {
        assert_eq!(socket_name_for("nvidia.com/gpu"), "nvidia-gpu.sock");
        assert_eq!(socket_name_for("example.org/vgpu"), "nvidia-vgpu.sock");
    }
}

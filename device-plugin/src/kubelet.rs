//! Serving on the device-plugin socket, registering with the kubelet, and re-registering when
//! the kubelet restarts (it deletes every socket in the directory and recreates `kubelet.sock`).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kubelet_proto::deviceplugin::v1beta1 as dp;
use kubelet_proto::deviceplugin::v1beta1::device_plugin_server::DevicePluginServer;
use kubelet_proto::deviceplugin::v1beta1::registration_client::RegistrationClient;
use tessera_runtime::{DisplayChain, task_span};
use tokio::net::UnixListener;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::service::DevicePluginService;
use tessera_node::conflict::PluginConflict;
use tessera_node::metrics::{PluginMetrics, Readiness};
use tessera_node::node_events::NodeEvent;
use tessera_node::uds::{ConnectError, unix_channel};

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
    /// How often the sockets are checked for a kubelet restart: the kubelet admits pods as soon
    /// as it is back, and rejects GPU pods until the plugin has registered again.
    pub poll_interval: Duration,
    /// Pause between registration attempts while the kubelet does not answer.
    pub register_retry: Duration,
    /// How long a stopping gRPC server may take to end its streams before it is abandoned.
    pub stop_grace: Duration,
    /// Notified (e.g. on SIGHUP, as HAMi's plugin does) to restart serving and re-register.
    pub restart: Arc<Notify>,
    /// Set while the plugin is registered with the current kubelet (`/readyz`).
    pub readiness: Readiness,
}

/// HAMi's socket name: `nvidia-` + the resource name's suffix.
pub fn socket_name_for(resource: &str) -> String {
    let suffix = resource.rsplit('/').next().unwrap_or(resource);
    format!("nvidia-{suffix}.sock")
}

/// Why serving or registering failed; the socket or gRPC cause is the source.
#[derive(Debug, thiserror::Error)]
pub enum KubeletError {
    #[error("cannot serve on {}", path.display())]
    Listen {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error("the kubelet refused the registration")]
    Register(#[source] tonic::Status),
}

/// Pause before serving again after a kubelet restart, so the kubelet has created its socket.
const RESTART_PAUSE: Duration = Duration::from_millis(100);

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
        .map_err(KubeletError::Register)?;
    Ok(())
}

/// Identity of a socket file: a recreated `kubelet.sock` has a new inode or change time.
fn file_identity(path: &Path) -> Option<(u64, u64, i64, i64)> {
    std::fs::metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino(), m.ctime(), m.ctime_nsec()))
}

/// Serves, registers and re-registers until `shutdown` is cancelled; removes the socket at the
/// end. Errors only when the socket cannot be created at all. Each server instance gets a child
/// of `shutdown` as its `stop`, cancelled when that instance ends (restart or shutdown).
pub async fn run(
    settings: KubeletSettings,
    make_service: impl Fn(CancellationToken) -> DevicePluginService,
    shutdown: CancellationToken,
    metrics: Option<PluginMetrics>,
) -> Result<(), KubeletError> {
    let own_socket = settings.socket_dir.join(&settings.socket_name);
    let kubelet_socket = settings.socket_dir.join(dp::KUBELET_SOCKET_NAME);
    loop {
        if shutdown.is_cancelled() {
            break;
        }
        match std::fs::remove_file(&own_socket) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(path = %own_socket.display(), error = %DisplayChain(&e), "cannot remove stale socket")
            }
        }
        let listener = UnixListener::bind(&own_socket).map_err(|source| KubeletError::Listen {
            path: own_socket.clone(),
            source,
        })?;
        // Who else binds this path replaces our socket (a second plugin with the same name).
        let own_identity = file_identity(&own_socket);
        let stop = shutdown.child_token();
        let service = make_service(stop.clone());
        let state = service.state.clone();
        let server_stop = stop.clone();
        // Not `spawn_task`: the server's result is awaited (and logged) below.
        let server = tokio::spawn(
            async move {
                let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
                tonic::transport::Server::builder()
                    .add_service(DevicePluginServer::new(service))
                    .serve_with_incoming_shutdown(incoming, server_stop.cancelled_owned())
                    .await
            }
            .instrument(task_span("device-plugin-server")),
        );
        tracing::info!(socket = %own_socket.display(), "device plugin serving");

        // Register (retrying while the kubelet is not there yet).
        let mut kubelet_identity = None;
        while !shutdown.is_cancelled() {
            match register(&settings).await {
                Ok(()) => {
                    kubelet_identity = file_identity(&kubelet_socket);
                    settings.readiness.set(true);
                    tracing::info!(resource = %settings.resource_name, "registered with the kubelet");
                    if let Some(m) = &metrics {
                        m.registered();
                    }
                    break;
                }
                Err(e) => {
                    tracing::warn!(error = %DisplayChain(&e), "registration failed; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(settings.register_retry) => {}
                        _ = shutdown.cancelled() => {}
                    }
                    // The kubelet may have deleted our socket while we waited.
                    if file_identity(&own_socket).is_none() {
                        break;
                    }
                }
            }
        }

        // Watch for a kubelet restart.
        while !shutdown.is_cancelled() && kubelet_identity.is_some() {
            tokio::select! {
                _ = tokio::time::sleep(settings.poll_interval) => {}
                _ = shutdown.cancelled() => {}
                _ = settings.restart.notified() => {
                    tracing::info!("restart requested; serving and registering again");
                    break;
                }
            }
            let own_now = file_identity(&own_socket);
            let own_gone = own_now.is_none();
            let kubelet_now = file_identity(&kubelet_socket);
            if !own_gone && own_now != own_identity && kubelet_now == kubelet_identity {
                // Not a kubelet restart (that recreates kubelet.sock and deletes ours): another
                // plugin bound our socket's path, and the kubelet now talks to it. Say so, and
                // take the endpoint back: pods admitted through the other plugin lose their
                // limits.
                let conflict = PluginConflict::SocketReplaced {
                    socket: own_socket.display().to_string(),
                };
                tracing::warn!(message = %conflict.message(), "another device plugin replaced our socket; serving and registering again");
                if let Some(m) = &metrics {
                    m.plugin_conflict(&conflict, true);
                }
                state.emit(NodeEvent::plugin_conflict(&conflict));
                break;
            }
            if own_gone || kubelet_now != kubelet_identity {
                tracing::info!(
                    own_gone,
                    "kubelet restart detected; serving and registering again"
                );
                break;
            }
        }

        settings.readiness.set(false);
        stop.cancel();
        match tokio::time::timeout(settings.stop_grace, server).await {
            Ok(Ok(Err(e))) => {
                tracing::warn!(error = %DisplayChain(&e), "device plugin server ended with an error")
            }
            Ok(_) => {}
            Err(_) => {
                tracing::warn!(grace = ?settings.stop_grace, "device plugin server did not stop in time")
            }
        }
        if shutdown.is_cancelled() {
            break;
        }
        tokio::time::sleep(RESTART_PAUSE).await;
    }
    let _ = std::fs::remove_file(&own_socket);
    tracing::info!(socket = %own_socket.display(), "device plugin stopped; socket removed");
    Ok(())
}

/// Why asking another plugin's socket for its devices failed.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error("ListAndWatch failed")]
    Call(#[from] tonic::Status),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

/// The device IDs every other device-plugin socket in `dir` advertises in its first
/// `ListAndWatch` answer, by socket file name. Our own socket and the kubelet's are skipped, and
/// so is a socket that does not answer within `timeout` (logged at debug: a plugin that is
/// starting or stuck is not evidence).
pub async fn foreign_plugin_devices(
    dir: &Path,
    own_socket: &str,
    timeout: Duration,
) -> Vec<(String, Vec<String>)> {
    use std::os::unix::fs::FileTypeExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut sockets: Vec<(String, PathBuf)> = entries
        .filter_map(Result::ok)
        .filter(|e| e.file_type().is_ok_and(|t| t.is_socket()))
        .filter_map(|e| Some((e.file_name().into_string().ok()?, e.path())))
        .filter(|(name, _)| name != own_socket && name != dp::KUBELET_SOCKET_NAME)
        .collect();
    sockets.sort();
    let mut found = Vec::new();
    for (name, path) in sockets {
        let probe = async {
            let channel = unix_channel(&path).await?;
            let mut client =
                kubelet_proto::deviceplugin::v1beta1::device_plugin_client::DevicePluginClient::new(
                    channel,
                );
            let mut stream = client.list_and_watch(dp::Empty {}).await?.into_inner();
            let first = stream.message().await?.unwrap_or_default();
            Ok::<_, ProbeError>(first.devices.into_iter().map(|d| d.id).collect::<Vec<_>>())
        };
        match tokio::time::timeout(timeout, probe)
            .await
            .unwrap_or(Err(ProbeError::Timeout(timeout)))
        {
            Ok(ids) => found.push((name, ids)),
            Err(e) => {
                tracing::debug!(socket = %name, error = %DisplayChain(&e), "device plugin socket not probed")
            }
        }
    }
    found
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

//! gRPC channels to the kubelet's unix sockets (registration, pod-resources).

use std::path::{Path, PathBuf};
use std::time::Duration;

use tonic::transport::Channel;

/// How long connecting to a kubelet socket may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// A kubelet socket could not be reached; the transport error is the source.
#[derive(Debug, thiserror::Error)]
#[error("cannot reach the kubelet at {}", path.display())]
pub struct ConnectError {
    pub path: PathBuf,
    #[source]
    pub source: tonic::transport::Error,
}

/// A tonic channel over a unix socket.
pub async fn unix_channel(path: &Path) -> Result<Channel, ConnectError> {
    kubelet_proto::transport::unix_channel(path, CONNECT_TIMEOUT)
        .await
        .map_err(|source| ConnectError {
            path: path.to_path_buf(),
            source,
        })
}

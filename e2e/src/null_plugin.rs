//! A device plugin that does nothing, for benchmarks: `count` healthy devices of one resource, an
//! empty answer to every `Allocate` and preferred-allocation call, no API server, no files. On a
//! real node, pods that ask for one of its devices pay the kubelet's own cost of a pod with a
//! device (the device manager's admission, its checkpoint, the gRPC round trips) and nothing of
//! Tessera's, so a benchmark can tell the two apart (issue 29, R3).
//!
//! It serves on a socket in the node's device-plugin directory and registers with the node's
//! kubelet over the real v1beta1 gRPC, from the test's process: the directory is reached through
//! the node's mount namespace (`/proc/<pid>/root/...`), so the kubelet dials the same socket.

use std::path::{Path, PathBuf};
use std::pin::Pin;

use futures::Stream;
use kubelet_proto::deviceplugin::v1beta1 as dp;
use kubelet_proto::deviceplugin::v1beta1::device_plugin_server::{
    DevicePlugin, DevicePluginServer,
};
use kubelet_proto::deviceplugin::v1beta1::registration_client::RegistrationClient;
use tokio::sync::oneshot;
use tonic::{Request, Response, Status};

use crate::{Error, Result};

/// The plugin's socket file name in the kubelet's device-plugin directory.
const SOCKET: &str = "tessera-null.sock";

/// A registered null plugin; dropping it stops serving (the kubelet then marks its devices
/// unhealthy).
#[derive(Debug)]
pub struct NullDevicePlugin {
    socket: PathBuf,
    stop: Option<oneshot::Sender<()>>,
}

impl Drop for NullDevicePlugin {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}

#[derive(Debug, Clone)]
struct NullService {
    devices: Vec<dp::Device>,
    preferred_allocation: bool,
}

type DeviceStream =
    Pin<Box<dyn Stream<Item = std::result::Result<dp::ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for NullService {
    async fn get_device_plugin_options(
        &self,
        _: Request<dp::Empty>,
    ) -> std::result::Result<Response<dp::DevicePluginOptions>, Status> {
        Ok(Response::new(dp::DevicePluginOptions {
            pre_start_required: false,
            get_preferred_allocation_available: self.preferred_allocation,
        }))
    }

    type ListAndWatchStream = DeviceStream;

    async fn list_and_watch(
        &self,
        _: Request<dp::Empty>,
    ) -> std::result::Result<Response<Self::ListAndWatchStream>, Status> {
        // One list, then the stream stays open as long as the kubelet keeps it.
        let first = futures::stream::once(std::future::ready(Ok(dp::ListAndWatchResponse {
            devices: self.devices.clone(),
        })));
        Ok(Response::new(Box::pin(futures::StreamExt::chain(
            first,
            futures::stream::pending(),
        ))))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<dp::PreferredAllocationRequest>,
    ) -> std::result::Result<Response<dp::PreferredAllocationResponse>, Status> {
        let container_responses = request
            .into_inner()
            .container_requests
            .into_iter()
            .map(|r| dp::ContainerPreferredAllocationResponse {
                device_i_ds: r
                    .available_device_i_ds
                    .into_iter()
                    .take(usize::try_from(r.allocation_size).unwrap_or(0))
                    .collect(),
            })
            .collect();
        Ok(Response::new(dp::PreferredAllocationResponse {
            container_responses,
        }))
    }

    async fn allocate(
        &self,
        request: Request<dp::AllocateRequest>,
    ) -> std::result::Result<Response<dp::AllocateResponse>, Status> {
        let container_responses = request
            .into_inner()
            .container_requests
            .iter()
            .map(|_| dp::ContainerAllocateResponse::default())
            .collect();
        Ok(Response::new(dp::AllocateResponse {
            container_responses,
        }))
    }

    async fn pre_start_container(
        &self,
        _: Request<dp::PreStartContainerRequest>,
    ) -> std::result::Result<Response<dp::PreStartContainerResponse>, Status> {
        Ok(Response::new(dp::PreStartContainerResponse {}))
    }
}

/// Serves `count` devices of `resource` in `device_plugin_dir` (the kubelet's
/// `/var/lib/kubelet/device-plugins/` as this process reaches it) and registers them with the
/// kubelet there, with or without preferred allocation (Tessera's plugin offers it).
pub async fn start(
    device_plugin_dir: &Path,
    resource: &str,
    count: usize,
    preferred_allocation: bool,
) -> Result<NullDevicePlugin> {
    let socket = device_plugin_dir.join(SOCKET);
    let _ = std::fs::remove_file(&socket);
    let listener = tokio::net::UnixListener::bind(&socket)?;
    let service = NullService {
        devices: (0..count)
            .map(|i| dp::Device {
                id: format!("null-{i}"),
                health: dp::HEALTHY.into(),
                topology: None,
            })
            .collect(),
        preferred_allocation,
    };
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(DevicePluginServer::new(service))
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::UnixListenerStream::new(listener),
                async {
                    let _ = stopped.await;
                },
            ),
    );
    let plugin = NullDevicePlugin {
        socket,
        stop: Some(stop),
    };
    let kubelet = kubelet_harness::unix_channel(&device_plugin_dir.join(dp::KUBELET_SOCKET_NAME))
        .await
        .map_err(|e| Error::msg(format!("the kubelet's registration socket: {e}")))?;
    RegistrationClient::new(kubelet)
        .register(dp::RegisterRequest {
            version: dp::VERSION.into(),
            endpoint: SOCKET.into(),
            resource_name: resource.into(),
            options: Some(dp::DevicePluginOptions {
                pre_start_required: false,
                get_preferred_allocation_available: preferred_allocation,
            }),
        })
        .await
        .map_err(|e| Error::msg(format!("registering {resource}: {}", e.message())))?;
    Ok(plugin)
}

//! A fake kubelet for tests: the real v1beta1 `Registration` service on `<dir>/kubelet.sock`,
//! the pod-resources v1 `List` on its own socket, a client for the plugin's socket, and a
//! "restart" that deletes every socket in the directory and recreates `kubelet.sock`, as a
//! real kubelet does.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use kubelet_proto::deviceplugin::v1beta1 as dp;
use kubelet_proto::deviceplugin::v1beta1::device_plugin_client::DevicePluginClient;
use kubelet_proto::deviceplugin::v1beta1::registration_server::{Registration, RegistrationServer};
use kubelet_proto::podresources::v1 as pr;
use kubelet_proto::podresources::v1::pod_resources_lister_server::{
    PodResourcesLister, PodResourcesListerServer,
};
use tokio::net::UnixListener;
use tokio::net::UnixStream;
use tokio::sync::{mpsc, oneshot};
use tonic::transport::{Channel, Endpoint, Uri};
use tonic::{Request, Response, Status};

#[derive(Clone)]
struct RegistrationService {
    tx: mpsc::UnboundedSender<dp::RegisterRequest>,
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn register(
        &self,
        request: Request<dp::RegisterRequest>,
    ) -> Result<Response<dp::Empty>, Status> {
        let req = request.into_inner();
        if req.version != dp::VERSION {
            return Err(Status::invalid_argument(format!(
                "unsupported version {}",
                req.version
            )));
        }
        let _ = self.tx.send(req);
        Ok(Response::new(dp::Empty {}))
    }
}

/// What the fake kubelet reports from pod-resources `List`.
#[derive(Debug, Clone, Default)]
pub struct PodResourcesState(pub Arc<Mutex<Vec<pr::PodResources>>>);

impl PodResourcesState {
    /// Adds (or extends) a pod's container with devices of `resource`.
    pub fn record(
        &self,
        namespace: &str,
        name: &str,
        container: &str,
        resource: &str,
        ids: Vec<String>,
    ) {
        let mut pods = self.0.lock().expect("lock");
        let pod = match pods
            .iter_mut()
            .position(|p| p.namespace == namespace && p.name == name)
        {
            Some(i) => &mut pods[i],
            None => {
                pods.push(pr::PodResources {
                    name: name.into(),
                    namespace: namespace.into(),
                    containers: Vec::new(),
                });
                pods.last_mut().expect("just pushed")
            }
        };
        let c = match pod.containers.iter_mut().position(|c| c.name == container) {
            Some(i) => &mut pod.containers[i],
            None => {
                pod.containers.push(pr::ContainerResources {
                    name: container.into(),
                    ..Default::default()
                });
                pod.containers.last_mut().expect("just pushed")
            }
        };
        if !ids.is_empty() {
            c.devices.push(pr::ContainerDevices {
                resource_name: resource.into(),
                device_ids: ids,
                topology: None,
            });
        }
    }

    pub fn remove(&self, namespace: &str, name: &str) {
        self.0
            .lock()
            .expect("lock")
            .retain(|p| !(p.namespace == namespace && p.name == name));
    }
}

#[derive(Clone)]
struct PodResourcesService {
    state: PodResourcesState,
}

#[tonic::async_trait]
impl PodResourcesLister for PodResourcesService {
    async fn list(
        &self,
        _: Request<pr::ListPodResourcesRequest>,
    ) -> Result<Response<pr::ListPodResourcesResponse>, Status> {
        let pods = self
            .state
            .0
            .lock()
            .map_err(|_| Status::internal("poisoned"))?
            .clone();
        Ok(Response::new(pr::ListPodResourcesResponse {
            pod_resources: pods,
        }))
    }

    async fn get_allocatable_resources(
        &self,
        _: Request<pr::AllocatableResourcesRequest>,
    ) -> Result<Response<pr::AllocatableResourcesResponse>, Status> {
        Ok(Response::new(pr::AllocatableResourcesResponse::default()))
    }

    async fn get(
        &self,
        _: Request<pr::GetPodResourcesRequest>,
    ) -> Result<Response<pr::GetPodResourcesResponse>, Status> {
        Err(Status::unimplemented(
            "Get is not served by the fake kubelet",
        ))
    }
}

/// The fake kubelet.
#[derive(Debug)]
pub struct FakeKubelet {
    pub device_plugin_dir: PathBuf,
    pub pod_resources_socket: PathBuf,
    pub registrations: mpsc::UnboundedReceiver<dp::RegisterRequest>,
    pub pod_resources: PodResourcesState,
    tx: mpsc::UnboundedSender<dp::RegisterRequest>,
    stop_registration: Option<oneshot::Sender<()>>,
    stop_pod_resources: Option<oneshot::Sender<()>>,
}

fn serve_registration(
    path: &Path,
    tx: mpsc::UnboundedSender<dp::RegisterRequest>,
) -> oneshot::Sender<()> {
    let _ = std::fs::remove_file(path);
    let listener = UnixListener::bind(path).expect("bind kubelet.sock");
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    tokio::spawn(async move {
        let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
        let _ = tonic::transport::Server::builder()
            .add_service(RegistrationServer::new(RegistrationService { tx }))
            .serve_with_incoming_shutdown(incoming, async {
                let _ = stop_rx.await;
            })
            .await;
    });
    stop_tx
}

impl FakeKubelet {
    /// Starts in `root` (a temp dir): `<root>/device-plugins/kubelet.sock` and
    /// `<root>/pod-resources/kubelet.sock`.
    pub async fn start(root: &Path, with_pod_resources: bool) -> Self {
        let device_plugin_dir = root.join("device-plugins");
        let pr_dir = root.join("pod-resources");
        std::fs::create_dir_all(&device_plugin_dir).expect("mkdir");
        std::fs::create_dir_all(&pr_dir).expect("mkdir");
        let (tx, registrations) = mpsc::unbounded_channel();
        let stop_registration = Some(serve_registration(
            &device_plugin_dir.join(dp::KUBELET_SOCKET_NAME),
            tx.clone(),
        ));
        let pod_resources = PodResourcesState::default();
        let pod_resources_socket = pr_dir.join("kubelet.sock");
        let stop_pod_resources = if with_pod_resources {
            let listener = UnixListener::bind(&pod_resources_socket).expect("bind pod-resources");
            let (stop_tx, stop_rx) = oneshot::channel::<()>();
            let state = pod_resources.clone();
            tokio::spawn(async move {
                let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
                let _ = tonic::transport::Server::builder()
                    .add_service(PodResourcesListerServer::new(PodResourcesService { state }))
                    .serve_with_incoming_shutdown(incoming, async {
                        let _ = stop_rx.await;
                    })
                    .await;
            });
            Some(stop_tx)
        } else {
            None
        };
        FakeKubelet {
            device_plugin_dir,
            pod_resources_socket,
            registrations,
            pod_resources,
            tx,
            stop_registration,
            stop_pod_resources,
        }
    }

    /// Waits for the next `Register` call.
    pub async fn next_registration(&mut self, within: Duration) -> Option<dp::RegisterRequest> {
        tokio::time::timeout(within, self.registrations.recv())
            .await
            .ok()
            .flatten()
    }

    /// A kubelet restart: stop, delete every socket in the device-plugin directory, start again.
    pub async fn restart(&mut self) {
        if let Some(stop) = self.stop_registration.take() {
            let _ = stop.send(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        for entry in std::fs::read_dir(&self.device_plugin_dir)
            .expect("readdir")
            .flatten()
        {
            if entry.path().extension().is_some_and(|e| e == "sock") {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        self.stop_registration = Some(serve_registration(
            &self.device_plugin_dir.join(dp::KUBELET_SOCKET_NAME),
            self.tx.clone(),
        ));
    }

    /// A client for the plugin's socket (as the kubelet dials it after `Register`).
    pub async fn plugin(&self, endpoint: &str) -> DevicePluginClient<Channel> {
        let channel = kubelet_proto::transport::unix_channel(
            &self.device_plugin_dir.join(endpoint),
            std::time::Duration::from_secs(5),
        )
        .await
        .expect("dial plugin");
        DevicePluginClient::new(channel)
    }
}

impl Drop for FakeKubelet {
    fn drop(&mut self) {
        if let Some(stop) = self.stop_registration.take() {
            let _ = stop.send(());
        }
        if let Some(stop) = self.stop_pod_resources.take() {
            let _ = stop.send(());
        }
    }
}

/// A tonic channel to a unix socket (the URI is required by tonic but unused).
pub async fn unix_channel(path: &Path) -> Result<Channel, tonic::transport::Error> {
    let path = path.to_path_buf();
    Endpoint::from_static("http://[::]:50051")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let p = path.clone();
            async move { UnixStream::connect(p).await.map(TokioIo::new) }
        }))
        .await
}

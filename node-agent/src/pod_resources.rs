//! The kubelet's pod-resources `List` (unix socket), reduced to the plugin's resource.

use std::collections::BTreeMap;
use std::path::PathBuf;

use futures::future::BoxFuture;
use kubelet_proto::podresources::v1 as pr;
use kubelet_proto::podresources::v1::pod_resources_lister_client::PodResourcesListerClient;

use crate::edges::{EdgeError, PodResourcesSource};
use crate::identity::PodResourcesView;
use crate::uds::unix_channel;

/// Reduces a `List` response to `namespace/name → container → device IDs of resource`.
pub fn view_of(response: &pr::ListPodResourcesResponse, resource: &str) -> PodResourcesView {
    let mut pods = BTreeMap::new();
    for pod in &response.pod_resources {
        let mut containers = BTreeMap::new();
        for c in &pod.containers {
            let ids: Vec<String> = c
                .devices
                .iter()
                .filter(|d| d.resource_name == resource)
                .flat_map(|d| d.device_ids.iter().cloned())
                .collect();
            containers.insert(c.name.clone(), ids);
        }
        pods.insert(format!("{}/{}", pod.namespace, pod.name), containers);
    }
    PodResourcesView { pods }
}

/// Calls `List` on the kubelet's socket; a missing socket means "not available" (old kubelet or
/// directory not mounted), not an error.
#[derive(Debug, Clone)]
pub struct KubeletPodResources {
    pub socket: PathBuf,
    pub resource: String,
}

impl PodResourcesSource for KubeletPodResources {
    fn list(&self) -> BoxFuture<'_, Result<Option<PodResourcesView>, EdgeError>> {
        Box::pin(async move {
            if !self.socket.exists() {
                return Ok(None);
            }
            let channel = unix_channel(&self.socket).await?;
            let mut client = PodResourcesListerClient::new(channel);
            let response = client
                .list(pr::ListPodResourcesRequest {})
                .await
                .map_err(EdgeError::PodResourcesList)?;
            Ok(Some(view_of(response.get_ref(), &self.resource)))
        })
    }
}

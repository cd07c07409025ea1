//! The kubelet-facing `DevicePlugin` gRPC service over the node's [`DeviceState`].

use std::pin::Pin;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use kubelet_proto::deviceplugin::v1beta1 as dp;
use kubelet_proto::deviceplugin::v1beta1::device_plugin_server::DevicePlugin;
use tessera_runtime::DisplayChain;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use tessera_node::allocator::Allocator;
use tessera_node::device_state::DeviceState;
use tessera_node::node_events::NodeEvent;

/// `Allocate` for a resource of whole devices: each container gets exactly the devices the
/// kubelet chose, by their UUIDs (a MIG instance's `MIG-…`). An id this plugin does not serve is
/// refused.
fn exclusive_allocate(
    state: &DeviceState,
    settings: &tessera_node::container_env::ResponseSettings,
    req: dp::AllocateRequest,
) -> Result<dp::AllocateResponse, String> {
    let served = state
        .managed_uuids
        .read()
        .map(|m| m.clone())
        .unwrap_or_default();
    let mut container_responses = Vec::with_capacity(req.container_requests.len());
    for c in &req.container_requests {
        let mut uuids = Vec::with_capacity(c.devices_ids.len());
        for id in &c.devices_ids {
            match tessera_node::gpu::physical_uuid(id).filter(|u| served.contains(*u)) {
                Some(u) => uuids.push(u.to_owned()),
                None => return Err(format!("tessera: unknown device {id:?}")),
            }
        }
        if uuids.is_empty() {
            return Err("tessera: container request has no devices".to_owned());
        }
        container_responses.push(tessera_node::allocator::to_proto(
            tessera_node::container_env::whole_devices_response(&uuids, settings),
        ));
    }
    Ok(dp::AllocateResponse {
        container_responses,
    })
}

/// `GetPreferredAllocation` for whole devices: the devices that must be included, then the
/// available ones in order.
fn exclusive_preferred(req: dp::PreferredAllocationRequest) -> dp::PreferredAllocationResponse {
    dp::PreferredAllocationResponse {
        container_responses: req
            .container_requests
            .into_iter()
            .map(|c| {
                let size = usize::try_from(c.allocation_size).unwrap_or(0);
                let mut ids = c.must_include_device_i_ds.clone();
                for id in c.available_device_i_ds {
                    if ids.len() >= size {
                        break;
                    }
                    if !ids.contains(&id) {
                        ids.push(id);
                    }
                }
                dp::ContainerPreferredAllocationResponse { device_i_ds: ids }
            })
            .collect(),
    }
}

/// The gRPC service registered with the kubelet.
#[derive(Debug, Clone)]
pub struct DevicePluginService {
    pub state: Arc<DeviceState>,
    pub allocator: Arc<Allocator>,
    pub preferred_allocation: bool,
    /// Cancelled when this server instance stops (restart or shutdown): streams end.
    pub stop: CancellationToken,
    /// A resource of whole, unshared devices (`nvidia.com/mig-<profile>` under the `mixed`
    /// strategy): the kubelet's choice of devices is final, so `Allocate` names exactly those,
    /// with no pod to identify and no shim.
    pub exclusive: bool,
}

type DeviceStream = Pin<Box<dyn Stream<Item = Result<dp::ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for DevicePluginService {
    async fn get_device_plugin_options(
        &self,
        _: Request<dp::Empty>,
    ) -> Result<Response<dp::DevicePluginOptions>, Status> {
        Ok(Response::new(dp::DevicePluginOptions {
            pre_start_required: false,
            // Unlike HAMi (appendix B.5), the same value as in the registration.
            get_preferred_allocation_available: self.preferred_allocation,
        }))
    }

    type ListAndWatchStream = DeviceStream;

    async fn list_and_watch(
        &self,
        _: Request<dp::Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let devices = tokio_stream::wrappers::WatchStream::new(self.state.subscribe());
        let stream = devices
            .map(|devices| Ok(dp::ListAndWatchResponse { devices }))
            .take_until(self.stop.clone().cancelled_owned());
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<dp::PreferredAllocationRequest>,
    ) -> Result<Response<dp::PreferredAllocationResponse>, Status> {
        let req = request.into_inner();
        // `pod`, `pod_uid`: recorded once the pod is identified (tessera_node::allocator).
        let span = tracing::info_span!(
            "get_preferred_allocation",
            containers = req.container_requests.len(),
            pod = tracing::field::Empty,
            pod_uid = tracing::field::Empty,
        );
        if self.exclusive {
            return Ok(Response::new(exclusive_preferred(req)));
        }
        Ok(Response::new(
            self.allocator.preferred(req).instrument(span).await,
        ))
    }

    async fn allocate(
        &self,
        request: Request<dp::AllocateRequest>,
    ) -> Result<Response<dp::AllocateResponse>, Status> {
        let req = request.into_inner();
        // `pod`, `pod_uid`: recorded once the pod is identified (tessera_node::allocator), so a
        // pod's Allocate can be found in the node's log by its UID.
        let span = tracing::info_span!(
            "allocate",
            containers = req.container_requests.len(),
            pod = tracing::field::Empty,
            pod_uid = tracing::field::Empty,
        );
        if self.exclusive {
            return exclusive_allocate(&self.state, &self.allocator.settings, req)
                .map(Response::new)
                .map_err(Status::invalid_argument);
        }
        self.allocator
            .allocate(req)
            .instrument(span)
            .await
            .map(Response::new)
            .map_err(|e| {
                // The whole chain: the kubelet shows it in the pod's events, and the node's
                // Event names the pod (the kubelet's own event may not say which device plugin).
                let chain = DisplayChain(&e).to_string();
                self.state
                    .emit(NodeEvent::allocate_refused(e.pod(), &chain));
                Status::failed_precondition(chain)
            })
    }

    async fn pre_start_container(
        &self,
        _: Request<dp::PreStartContainerRequest>,
    ) -> Result<Response<dp::PreStartContainerResponse>, Status> {
        Ok(Response::new(dp::PreStartContainerResponse {}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_node::gpu::ManagedGpu;
    use tessera_node::health::HealthTracker;

    #[test]
    fn a_mig_resource_hands_out_exactly_the_instances_the_kubelet_chose() {
        let instances: Vec<ManagedGpu> = ["MIG-1", "MIG-2"]
            .iter()
            .map(|u| ManagedGpu {
                uuid: (*u).into(),
                index: 0,
                model_type: "NVIDIA A100-SXM4-40GB MIG 1g.5gb".into(),
                devmem: 4864,
                devcore: 100,
                numa: None,
                replicas: 1,
                mode: "hami-core".into(),
                mig_profiles: Vec::new(),
            })
            .collect();
        let tracker = HealthTracker::new(
            tessera_node::health::HealthPolicy::default(),
            instances.iter().map(|g| g.uuid.clone()),
        );
        let state = DeviceState::new(instances, tracker, false, None);
        let settings = tessera_node::testing::response_settings(std::path::Path::new("/hook"));
        let req = |ids: &[&str]| dp::AllocateRequest {
            container_requests: vec![dp::ContainerAllocateRequest {
                devices_ids: ids.iter().map(|s| s.to_string()).collect(),
            }],
        };
        let resp =
            exclusive_allocate(&state, &settings, req(&["MIG-2-0", "MIG-1-0"])).expect("served");
        let c = &resp.container_responses[0];
        assert_eq!(c.envs["NVIDIA_VISIBLE_DEVICES"], "MIG-2,MIG-1");
        assert!(c.mounts.is_empty() && !c.envs.contains_key("CUDA_DEVICE_MEMORY_LIMIT_0"));
        assert!(exclusive_allocate(&state, &settings, req(&["GPU-x-0"])).is_err());
        assert!(exclusive_allocate(&state, &settings, req(&[])).is_err());
        let pref = exclusive_preferred(dp::PreferredAllocationRequest {
            container_requests: vec![dp::ContainerPreferredAllocationRequest {
                available_device_i_ds: vec!["MIG-1-0".into(), "MIG-2-0".into()],
                must_include_device_i_ds: vec!["MIG-2-0".into()],
                allocation_size: 2,
            }],
        });
        assert_eq!(
            pref.container_responses[0].device_i_ds,
            ["MIG-2-0", "MIG-1-0"]
        );
    }
}

//! The GPUs the node advertises and their health: every change is pushed to the kubelet's
//! `ListAndWatch` streams and picked up by the node-annotation loop.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use tokio::time::Instant;

use hami_contract::node::{NodeDevice, encode_node_devices, encode_pair_scores};
use hami_contract::topology::{NodeTopology, pair_scores};
use kubelet_proto::deviceplugin::v1beta1 as dp;
use tessera_runtime::DisplayChain;
use tokio::sync::watch;

use crate::gpu::{ManagedGpu, kubelet_devices, register_devices};
use crate::health::{HealthEvent, HealthTracker};
use crate::metrics::PluginMetrics;
use crate::node_events::{NodeEvent, NodeEvents};
use crate::nvml::GpuInventory;

/// The GPUs the plugin advertises and their health; every change is pushed to `ListAndWatch`
/// streams and picked up by the annotation loop.
pub struct DeviceState {
    inner: Mutex<Inner>,
    devices_tx: watch::Sender<Vec<dp::Device>>,
    /// UUIDs shared with the allocator (it refuses GPUs the node does not manage).
    pub managed_uuids: Arc<RwLock<BTreeSet<String>>>,
    /// The GPUs in dynamic MIG mode (UUID → NVML index), shared with the allocator.
    pub mig_gpus: Arc<RwLock<crate::mig::MigGpus>>,
    numa_topology: bool,
    metrics: Option<PluginMetrics>,
    /// Node Events; set once the API client exists ([`DeviceState::attach_events`]).
    events: OnceLock<NodeEvents>,
}

struct Inner {
    gpus: Vec<ManagedGpu>,
    health: HealthTracker,
    /// NVML's GPU links, only with `ENABLE_TOPOLOGY_SCORE` (`hami.io/node-nvidia-score`).
    topology: Option<NodeTopology>,
}

impl std::fmt::Debug for DeviceState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceState").finish_non_exhaustive()
    }
}

impl DeviceState {
    pub fn new(
        gpus: Vec<ManagedGpu>,
        health: HealthTracker,
        numa_topology: bool,
        metrics: Option<PluginMetrics>,
    ) -> Arc<Self> {
        let (devices_tx, _) = watch::channel(Vec::new());
        let state = Arc::new(DeviceState {
            inner: Mutex::new(Inner {
                gpus,
                health,
                topology: None,
            }),
            devices_tx,
            managed_uuids: Arc::default(),
            mig_gpus: Arc::default(),
            numa_topology,
            metrics,
            events: OnceLock::new(),
        });
        state.publish();
        state
    }

    /// Sends health changes and refused `Allocate` calls as Events on the node from now on. The
    /// state exists before the API client does (`--print-register` never has one), so this is
    /// set afterwards, once; a second call is ignored.
    pub fn attach_events(&self, events: NodeEvents) {
        let _ = self.events.set(events);
    }

    /// Queues a Node Event (dropped when none is attached).
    pub fn emit(&self, event: NodeEvent) {
        if let Some(events) = self.events.get() {
            events.emit(event);
        }
    }

    fn with_inner<T>(&self, f: impl FnOnce(&mut Inner) -> T) -> Option<T> {
        match self.inner.lock() {
            Ok(mut g) => Some(f(&mut g)),
            Err(_) => {
                tracing::error!("device state lock poisoned");
                None
            }
        }
    }

    /// Recomputes the kubelet device list and pushes it when it changed.
    pub fn publish(&self) {
        let Some((devices, uuids, mig)) = self.with_inner(|inner| {
            if let Some(m) = &self.metrics {
                for g in &inner.gpus {
                    m.gpu_health(&g.uuid, inner.health.is_healthy(&g.uuid));
                }
            }
            let devices = kubelet_devices(
                &inner.gpus,
                &|u| inner.health.is_healthy(u),
                self.numa_topology,
            );
            let uuids: BTreeSet<String> = inner.gpus.iter().map(|g| g.uuid.clone()).collect();
            let mig: crate::mig::MigGpus = inner
                .gpus
                .iter()
                .filter(|g| g.mode == crate::gpu::MODE_MIG)
                .map(|g| (g.uuid.clone(), g.index))
                .collect();
            (devices, uuids, mig)
        }) else {
            return;
        };
        if let Ok(mut m) = self.managed_uuids.write() {
            *m = uuids;
        }
        if let Ok(mut m) = self.mig_gpus.write() {
            *m = mig;
        }
        self.devices_tx.send_if_modified(|current| {
            if *current == devices {
                false
            } else {
                *current = devices;
                true
            }
        });
    }

    /// Replaces the GPU list (after a successful rediscovery).
    pub fn set_gpus(&self, gpus: Vec<ManagedGpu>) {
        self.with_inner(|inner| {
            let uuids: BTreeSet<String> = gpus.iter().map(|g| g.uuid.clone()).collect();
            inner.health.set_gpus(&uuids);
            inner.gpus = gpus;
        });
        self.publish();
    }

    /// Applies a health event; streams the change at once.
    pub fn health_event(&self, event: &HealthEvent, now: Instant) {
        if let (HealthEvent::Xid { uuid, xid }, Some(m)) = (event, &self.metrics) {
            m.xid_error(uuid, *xid);
        }
        let changed = self
            .with_inner(|inner| inner.health.apply(event, now))
            .unwrap_or(false);
        if changed {
            tracing::warn!(?event, "GPU unhealthy; its replicas are reported Unhealthy");
            self.emit(NodeEvent::gpu_unhealthy(event));
            self.publish();
        }
    }

    /// Probes GPUs whose quiet period passed; healthy again when they answer.
    pub fn recover(&self, answers: &dyn Fn(&str) -> bool, now: Instant) {
        let Some((due, quiet)) = self.with_inner(|inner| {
            (
                inner.health.due_for_probe(now),
                inner.health.recovery_quiet(),
            )
        }) else {
            return;
        };
        let mut changed = false;
        for uuid in due {
            let ok = answers(&uuid);
            if self
                .with_inner(|inner| inner.health.probe_result(&uuid, ok, now))
                .unwrap_or(false)
            {
                tracing::info!(%uuid, "GPU recovered; its replicas are Healthy again");
                self.emit(NodeEvent::gpu_recovered(&uuid, quiet));
                changed = true;
            }
        }
        if changed {
            self.publish();
        }
    }

    pub fn healthy_uuids(&self) -> Vec<String> {
        self.with_inner(|inner| {
            inner
                .gpus
                .iter()
                .filter(|g| inner.health.is_healthy(&g.uuid))
                .map(|g| g.uuid.clone())
                .collect()
        })
        .unwrap_or_default()
    }

    pub fn register_devices(&self) -> Vec<NodeDevice> {
        self.with_inner(|inner| register_devices(&inner.gpus, &|u| inner.health.is_healthy(u)))
            .unwrap_or_default()
    }

    /// The `hami.io/node-nvidia-register` value.
    pub fn register_annotation(&self) -> String {
        encode_node_devices(&self.register_devices())
    }

    /// Keeps NVML's GPU links for `hami.io/node-nvidia-score` (hardware: read at start and when
    /// the GPU list changes). Pairs whose two ends disagree score 0; they are logged and sent as
    /// one `AsymmetricGPUP2PLink` Node Event here, once per read, rather than on every
    /// annotation write.
    pub fn set_topology(&self, topology: NodeTopology) {
        let uuids: Vec<String> = topology.gpus.iter().map(|g| g.uuid.clone()).collect();
        if let Ok(scores) = pair_scores(&topology, &uuids)
            && !scores.asymmetric.is_empty()
        {
            for (a, b) in &scores.asymmetric {
                tracing::warn!(
                    gpu = %a,
                    peer = %b,
                    "the two GPUs report different links to each other (possible NVLink hardware or driver issue); the pair's topology score is 0"
                );
            }
            self.emit(NodeEvent::asymmetric_links(&scores.asymmetric));
        }
        self.with_inner(|inner| inner.topology = Some(topology));
    }

    /// Reads the GPU links from NVML into the state (`--enable-topology-score`). When NVML cannot
    /// tell, the node gets no `hami.io/node-nvidia-score` and the previous links (if any) stay;
    /// the register annotation is written regardless (HAMi writes neither: deviation T2).
    pub fn read_topology(&self, inventory: &dyn GpuInventory) {
        match inventory.topology() {
            Ok(topology) => {
                tracing::info!(gpus = topology.gpus.len(), "GPU topology read from NVML");
                self.set_topology(topology);
            }
            Err(e) => tracing::warn!(
                error = %DisplayChain(&e),
                "cannot read the GPU topology from NVML; hami.io/node-nvidia-score is not written"
            ),
        }
    }

    /// The `hami.io/node-nvidia-score` value (contract §2.2) for the advertised GPUs, in
    /// register order; `None` without topology (`ENABLE_TOPOLOGY_SCORE` off, or NVML could not
    /// tell).
    pub fn score_annotation(&self) -> Option<String> {
        self.with_inner(|inner| {
            let topology = inner.topology.as_ref()?;
            let uuids: Vec<String> = inner.gpus.iter().map(|g| g.uuid.clone()).collect();
            match pair_scores(topology, &uuids) {
                Ok(scores) => Some(encode_pair_scores(&scores.entries)),
                Err(e) => {
                    tracing::warn!(error = %e, "no GPU topology score for the node: the topology read from NVML misses an advertised GPU");
                    None
                }
            }
        })
        .flatten()
    }

    pub fn subscribe(&self) -> watch::Receiver<Vec<dp::Device>> {
        self.devices_tx.subscribe()
    }

    pub fn gpus(&self) -> Vec<ManagedGpu> {
        self.with_inner(|inner| inner.gpus.clone())
            .unwrap_or_default()
    }

    pub fn gpu_count(&self) -> usize {
        self.with_inner(|inner| inner.gpus.len()).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use hami_contract::node::P2pLink;
    use hami_contract::topology::{GpuLinks, NvLinkEnd, NvLinkRemote};
    use nvml_wrapper::error::NvmlError;

    use super::*;
    use crate::gpu::{AdvertiseSettings, GpuInfo, plan_gpus};
    use crate::health::HealthPolicy;
    use crate::nvml::{GpuSample, InventoryError};
    use crate::testing::t4;

    /// NVML swapped for fixed answers: two T4s joined by one NVLink, under one PCIe switch, or
    /// an NVML that fails the topology read.
    struct FixedInventory {
        topology: Option<NodeTopology>,
    }

    impl GpuInventory for FixedInventory {
        fn discover(&self) -> Result<Vec<GpuInfo>, InventoryError> {
            Ok(vec![t4("GPU-a", 0), t4("GPU-b", 1)])
        }
        fn answers(&self, _uuid: &str) -> bool {
            true
        }
        fn sample(&self) -> Vec<GpuSample> {
            Vec::new()
        }
        fn wait_event(&self, _timeout: Duration) -> Result<Option<HealthEvent>, InventoryError> {
            Ok(None)
        }
        fn topology(&self) -> Result<NodeTopology, InventoryError> {
            self.topology.clone().ok_or(InventoryError::Call {
                call: "nvmlDeviceGetTopologyCommonAncestor",
                source: NvmlError::Unknown,
            })
        }
    }

    fn linked_pair() -> NodeTopology {
        let gpu = |uuid: &str, bus: &str, peer: &str| GpuLinks {
            uuid: uuid.into(),
            pci_bus_id: bus.into(),
            nvlinks: vec![NvLinkEnd {
                remote_pci_bus_id: Some(peer.into()),
                remote: Some(NvLinkRemote::Gpu),
            }],
        };
        NodeTopology {
            gpus: vec![
                gpu("GPU-a", "00000000:07:00.0", "00000000:08:00.0"),
                gpu("GPU-b", "00000000:08:00.0", "00000000:07:00.0"),
            ],
            pcie: [
                ((0, 1), P2pLink::SingleSwitch),
                ((1, 0), P2pLink::SingleSwitch),
            ]
            .into(),
        }
    }

    fn state(inventory: &dyn GpuInventory) -> Arc<DeviceState> {
        let settings = AdvertiseSettings::new(&Default::default(), Default::default(), "");
        let (gpus, _) = plan_gpus(&inventory.discover().expect("discover"), &settings, &|_| {
            false
        });
        let uuids: Vec<String> = gpus.iter().map(|g| g.uuid.clone()).collect();
        DeviceState::new(
            gpus,
            HealthTracker::new(HealthPolicy::default(), uuids),
            false,
            None,
        )
    }

    #[test]
    fn score_annotation_comes_from_the_links_nvml_reports() {
        let inventory = FixedInventory {
            topology: Some(linked_pair()),
        };
        let state = state(&inventory);
        assert_eq!(state.score_annotation(), None, "not read: not written");
        state.read_topology(&inventory);
        assert_eq!(
            state.score_annotation().as_deref(),
            Some(
                r#"[{"uuid":"GPU-a","score":{"GPU-b":150}},{"uuid":"GPU-b","score":{"GPU-a":150}}]"#
            )
        );
    }

    #[test]
    fn a_failed_topology_read_keeps_the_previous_links_and_the_register_annotation() {
        let state = state(&FixedInventory { topology: None });
        state.read_topology(&FixedInventory { topology: None });
        assert_eq!(state.score_annotation(), None);
        assert!(state.register_annotation().contains("GPU-b"));
        state.read_topology(&FixedInventory {
            topology: Some(linked_pair()),
        });
        state.read_topology(&FixedInventory { topology: None });
        assert!(state.score_annotation().is_some_and(|v| v.contains("150")));
    }

    #[test]
    fn a_link_seen_from_one_end_only_is_a_node_warning_and_scores_the_pair_zero() {
        let mut topology = linked_pair();
        topology.gpus[1].nvlinks.clear();
        let inventory = FixedInventory {
            topology: Some(topology),
        };
        let state = state(&inventory);
        let (events, mut rx) = crate::node_events::NodeEvents::channel();
        state.attach_events(events);
        state.read_topology(&inventory);
        let event = rx.try_recv().expect("an Event");
        assert_eq!(event.reason, "AsymmetricGPUP2PLink");
        assert!(
            event.message.contains("GPU-a and GPU-b"),
            "{}",
            event.message
        );
        assert!(rx.try_recv().is_err(), "one Event per read");
        assert_eq!(
            state.score_annotation().as_deref(),
            Some(r#"[{"uuid":"GPU-a","score":{"GPU-b":0}},{"uuid":"GPU-b","score":{"GPU-a":0}}]"#)
        );
    }

    #[test]
    fn an_advertised_gpu_missing_from_the_links_means_no_score_annotation() {
        let mut topology = linked_pair();
        topology.gpus.truncate(1);
        let inventory = FixedInventory {
            topology: Some(topology),
        };
        let state = state(&inventory);
        state.read_topology(&inventory);
        assert_eq!(state.score_annotation(), None);
    }
}

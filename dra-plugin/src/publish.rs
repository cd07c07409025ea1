//! Keeps this node's ResourceSlice equal to the driver's view of its GPUs.
//!
//! One slice per node (`pool` = the node's name, `resourceSliceCount: 1`), named by the API
//! server from `<node>-gpu.tessera.dev-`, owned by the Node (it goes when the node goes). Every
//! pass lists the node's slices of the driver: a missing slice is created (the kubelet deletes
//! every slice of its node when it starts, and a driver's slices 30 s after it deregisters), a
//! changed one is replaced with the pool generation raised, extra ones are deleted.
//!
//! The consumable-capacity fields are kept only by an API server whose `DRAConsumableCapacity`
//! gate is on; one whose gate is off drops them silently. In `auto` mode the publisher reads its
//! slice back, and when they were dropped it publishes whole devices from then on (and says so):
//! a slice that looked shareable but was not would be allocated whole anyway, with claims asking
//! for 8 GiB given the full GPU's limits.

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{Device, ResourcePool, ResourceSlice, ResourceSliceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};

use super::DRIVER;
use super::slice::{Sharing, consumable_fields_dropped};
use tessera_node::edges::EdgeError;

/// Whether the slice offers shares (`--consumable-capacity`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ConsumableMode {
    /// Shares when the API server keeps the fields, whole GPUs otherwise.
    Auto,
    /// Always shares (an API server that drops the fields gets whole GPUs anyway: logged).
    On,
    /// Whole GPUs only.
    Off,
}

/// The slice's state as the publisher last wrote it.
#[derive(Debug)]
pub struct SlicePublisher {
    slices: Api<ResourceSlice>,
    nodes: Api<Node>,
    node: String,
    mode: ConsumableMode,
    sharing: Sharing,
    /// The devices and resourceVersion of the last write: a slice still at that version needs
    /// no comparison (the API server canonicalises quantities, so a field-by-field comparison
    /// with what it returns could differ forever).
    last: Option<(Vec<Device>, String)>,
}

impl SlicePublisher {
    pub fn new(client: kube::Client, node: String, mode: ConsumableMode) -> SlicePublisher {
        SlicePublisher {
            slices: Api::all(client.clone()),
            nodes: Api::all(client),
            node,
            mode,
            sharing: match mode {
                ConsumableMode::Off => Sharing::Exclusive,
                _ => Sharing::Consumable,
            },
            last: None,
        }
    }

    /// How the devices are offered now.
    pub fn sharing(&self) -> Sharing {
        self.sharing
    }

    /// One pass: makes the node's slice hold `devices_for(self.sharing())`. Returns whether it
    /// wrote.
    pub async fn sync(
        &mut self,
        devices_for: &(dyn Fn(Sharing) -> Vec<Device> + Send + Sync),
    ) -> Result<bool, EdgeError> {
        let wrote = self.sync_once(&devices_for(self.sharing)).await?;
        if let Some(stored) = &wrote {
            let sent = devices_for(self.sharing);
            if self.mode == ConsumableMode::Auto
                && self.sharing == Sharing::Consumable
                && consumable_fields_dropped(&sent, stored)
            {
                tracing::warn!(
                    "the API server dropped the consumable-capacity fields (feature gate DRAConsumableCapacity is off): GPUs are offered whole, one claim each"
                );
                self.sharing = Sharing::Exclusive;
                self.sync_once(&devices_for(self.sharing)).await?;
            } else if self.mode == ConsumableMode::On && consumable_fields_dropped(&sent, stored) {
                tracing::warn!(
                    "the API server dropped the consumable-capacity fields (DRAConsumableCapacity is off): kube-scheduler allocates these GPUs whole"
                );
            }
        }
        Ok(wrote.is_some())
    }

    /// Returns the stored devices when it wrote.
    async fn sync_once(&mut self, desired: &[Device]) -> Result<Option<Vec<Device>>, EdgeError> {
        let lp = ListParams::default()
            .fields(&format!("spec.nodeName={},spec.driver={DRIVER}", self.node));
        let mut existing = self
            .slices
            .list(&lp)
            .await
            .map_err(EdgeError::kube("cannot list this node's ResourceSlices"))?
            .items;
        existing.sort_by_key(|s| std::cmp::Reverse(s.spec.pool.generation));
        let generation = existing
            .iter()
            .map(|s| s.spec.pool.generation)
            .max()
            .unwrap_or(0);
        for extra in existing.iter().skip(1) {
            let name = extra.metadata.name.clone().unwrap_or_default();
            tracing::info!(slice = %name, "deleting an extra ResourceSlice of this node");
            self.slices
                .delete(&name, &DeleteParams::default())
                .await
                .map_err(EdgeError::kube(format!(
                    "cannot delete ResourceSlice {name}"
                )))?;
        }
        let stored = match existing.into_iter().next() {
            None => {
                let node = self
                    .nodes
                    .get(&self.node)
                    .await
                    .map_err(EdgeError::kube(format!("cannot read node {}", self.node)))?;
                let slice = ResourceSlice {
                    metadata: ObjectMeta {
                        generate_name: Some(format!("{}-{DRIVER}-", self.node)),
                        owner_references: Some(vec![OwnerReference {
                            api_version: "v1".to_owned(),
                            kind: "Node".to_owned(),
                            name: self.node.clone(),
                            uid: node.metadata.uid.unwrap_or_default(),
                            controller: Some(true),
                            block_owner_deletion: None,
                        }]),
                        ..Default::default()
                    },
                    spec: ResourceSliceSpec {
                        driver: DRIVER.to_owned(),
                        node_name: Some(self.node.clone()),
                        pool: ResourcePool {
                            name: self.node.clone(),
                            generation: generation + 1,
                            resource_slice_count: 1,
                        },
                        devices: Some(desired.to_vec()),
                        ..Default::default()
                    },
                };
                let created = self
                    .slices
                    .create(&PostParams::default(), &slice)
                    .await
                    .map_err(EdgeError::kube("cannot create this node's ResourceSlice"))?;
                tracing::info!(slice = %created.metadata.name.as_deref().unwrap_or_default(), devices = desired.len(), "ResourceSlice created");
                created
            }
            Some(current) => {
                let version = current
                    .metadata
                    .resource_version
                    .clone()
                    .unwrap_or_default();
                let unchanged = self
                    .last
                    .as_ref()
                    .is_some_and(|(devices, v)| devices == desired && *v == version);
                if unchanged {
                    return Ok(None);
                }
                let mut next = current;
                next.spec.devices = Some(desired.to_vec());
                next.spec.pool.generation = generation + 1;
                next.spec.pool.resource_slice_count = 1;
                let name = next.metadata.name.clone().unwrap_or_default();
                let replaced = self
                    .slices
                    .replace(&name, &PostParams::default(), &next)
                    .await
                    .map_err(EdgeError::kube(format!(
                        "cannot update ResourceSlice {name}"
                    )))?;
                tracing::info!(slice = %name, devices = desired.len(), generation = generation + 1, "ResourceSlice updated");
                replaced
            }
        };
        let devices = stored.spec.devices.clone().unwrap_or_default();
        self.last = Some((
            desired.to_vec(),
            stored.metadata.resource_version.unwrap_or_default(),
        ));
        Ok(Some(devices))
    }
}

//! The over-booking check: what the scheduler booked on each GPU, read back from the API
//! (pods' `hami.io/vgpu-devices-allocated`), against what each node registered.

use std::collections::BTreeMap;

use hami_contract::annotations::{DEVICES_ALLOCATED, NODE_REGISTER};
use hami_contract::devices::PodDevices;
use hami_contract::node::decode_node_devices;
use k8s_openapi::api::core::v1::{Node, Pod};

/// Booked share of one GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Booked {
    pub node: String,
    pub count: u32,
    pub mem_mib: u64,
    pub cores: u64,
}

/// Sums the bookings of pods that hold capacity (bound or planned, not terminal), per GPU UUID.
pub fn booked(pods: &[Pod]) -> BTreeMap<String, Booked> {
    let mut out: BTreeMap<String, Booked> = BTreeMap::new();
    for p in pods {
        let phase = p
            .status
            .as_ref()
            .and_then(|s| s.phase.as_deref())
            .unwrap_or("");
        if phase == "Succeeded" || phase == "Failed" {
            continue;
        }
        let ann = p.metadata.annotations.as_ref();
        let Some(value) = ann.and_then(|a| a.get(DEVICES_ALLOCATED)) else {
            continue;
        };
        let node = p
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .or_else(|| ann.and_then(|a| a.get("hami.io/vgpu-node").cloned()))
            .unwrap_or_default();
        let Ok(devices) = PodDevices::decode(value) else {
            continue;
        };
        for d in devices.0.iter().flatten() {
            let b = out.entry(d.uuid.clone()).or_default();
            b.node.clone_from(&node);
            b.count += 1;
            b.mem_mib += u64::from(d.usedmem);
            b.cores += u64::from(d.usedcores);
        }
    }
    out
}

/// Every GPU whose bookings exceed its registered count, memory or cores, as a readable line.
pub fn violations(nodes: &[Node], pods: &[Pod]) -> Vec<String> {
    let mut capacity = BTreeMap::new();
    for n in nodes {
        let name = n.metadata.name.clone().unwrap_or_default();
        let Some(value) = n
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(NODE_REGISTER))
        else {
            continue;
        };
        if let Ok(devs) = decode_node_devices(value) {
            for d in devs {
                capacity.insert(d.id.clone(), (name.clone(), d));
            }
        }
    }
    let mut out = Vec::new();
    for (uuid, b) in booked(pods) {
        let Some((node, d)) = capacity.get(&uuid) else {
            out.push(format!(
                "{uuid}: booked on {} but not registered by any node",
                b.node
            ));
            continue;
        };
        if &b.node != node {
            out.push(format!(
                "{uuid}: booked by a pod on {} but registered by {node}",
                b.node
            ));
        }
        if b.count > d.count || b.mem_mib > u64::from(d.devmem) || b.cores > u64::from(d.devcore) {
            out.push(format!(
                "{uuid} on {node}: booked {} pods / {} MiB / {} cores, capacity {} / {} / {}",
                b.count, b.mem_mib, b.cores, d.count, d.devmem, d.devcore
            ));
        }
    }
    out
}

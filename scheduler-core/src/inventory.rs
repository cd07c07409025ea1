//! Who uses which GPU: per node and GPU, what its device plugin registered, what is booked on it
//! and by which pods, read from the same state the extender decides on (`kubectl tessera gpus`).
//!
//! Built from whatever the caller may list: with the Nodes, every registered GPU with its
//! totals; with only some pods (a namespace user), the GPUs those pods hold, totals unknown.

use std::collections::BTreeMap;

use crate::state::ClusterState;

/// A pod's slice of one GPU.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Tenant {
    pub namespace: String,
    pub name: String,
    /// MiB.
    pub mem: u32,
    /// Percent of SMs (0: no SM limit).
    pub cores: u32,
}

/// Registered totals of a GPU (unknown when the caller may not read its Node).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Registered {
    pub index: u32,
    pub model: String,
    /// `hami-core`, `mig`, `mps`.
    pub mode: String,
    pub healthy: bool,
    /// Slots (`deviceSplitCount`), memory (MiB) and cores (percent × core scaling).
    pub slots: u32,
    pub mem: u32,
    pub cores: u32,
}

/// One GPU: where, what, how much is booked and by whom.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct GpuRow {
    pub node: String,
    pub uuid: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub registered: Option<Registered>,
    pub slots_used: u32,
    pub mem_used: u32,
    pub cores_used: u32,
    /// MIG instances in use, as `profile@start`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub mig: Vec<String>,
    pub tenants: Vec<Tenant>,
}

/// Every GPU of the state: the registered ones of each node (in index order) with what is booked
/// on them, then GPUs that only pods name (their Node not visible or not registered).
pub fn gpus(state: &mut ClusterState) -> Vec<GpuRow> {
    state.prepare();
    let mut tenants: BTreeMap<(String, String), Vec<Tenant>> = BTreeMap::new();
    for pod in state.shared_bookings() {
        for (uuid, mem, cores) in pod.usage() {
            tenants
                .entry((pod.node.to_string(), uuid.to_owned()))
                .or_default()
                .push(Tenant {
                    namespace: pod.namespace.to_string(),
                    name: pod.name.to_string(),
                    mem,
                    cores,
                });
        }
    }
    for list in tenants.values_mut() {
        list.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    }
    let mut rows = Vec::new();
    let names: Vec<String> = state.nodes().map(|n| n.name.clone()).collect();
    for node in names {
        let Some(ns) = state.node_state(&node, None) else {
            continue;
        };
        for g in &ns.gpus {
            let on = tenants
                .remove(&(node.clone(), g.uuid.clone()))
                .unwrap_or_default();
            rows.push(GpuRow {
                node: node.clone(),
                uuid: g.uuid.clone(),
                registered: Some(Registered {
                    index: g.index,
                    model: g.device_type.clone(),
                    mode: g.mode.clone(),
                    healthy: g.health,
                    slots: g.count,
                    mem: g.totalmem,
                    cores: g.totalcore,
                }),
                slots_used: g.used,
                mem_used: g.usedmem,
                cores_used: g.usedcores,
                mig: g
                    .mig
                    .as_ref()
                    .map(|m| {
                        m.in_use
                            .iter()
                            .map(|a| format!("{}@{}", a.profile, a.placement.start))
                            .collect()
                    })
                    .unwrap_or_default(),
                tenants: on,
            });
        }
    }
    // GPUs only pods name: the caller cannot see the Node, or the node no longer registers it.
    for ((node, uuid), on) in tenants {
        rows.push(GpuRow {
            node,
            uuid,
            registered: None,
            slots_used: u32::try_from(on.len()).unwrap_or(u32::MAX),
            mem_used: on.iter().map(|t| t.mem).sum(),
            cores_used: on.iter().map(|t| t.cores).sum(),
            mig: Vec::new(),
            tenants: on,
        });
    }
    rows
}

/// The rows for a terminal: one line per GPU, then one indented line per pod on it.
pub fn table(rows: &[GpuRow]) -> String {
    let mut lines: Vec<[String; 7]> = Vec::new();
    for r in rows {
        let (gpu, model, health, total) = match &r.registered {
            Some(reg) => (
                format!("{} {}", reg.index, r.uuid),
                format!("{} ({})", reg.model, reg.mode),
                if reg.healthy { "ok" } else { "UNHEALTHY" }.to_owned(),
                Some(reg),
            ),
            None => (r.uuid.clone(), "?".to_owned(), "?".to_owned(), None),
        };
        let of = |used: u32, total: Option<u32>, unit: &str| match total {
            Some(t) => format!("{used}/{t}{unit}"),
            None => format!("{used}{unit}/?"),
        };
        lines.push([
            r.node.clone(),
            gpu,
            model,
            health,
            of(r.slots_used, total.map(|t| t.slots), ""),
            of(r.mem_used, total.map(|t| t.mem), " MiB"),
            of(r.cores_used, total.map(|t| t.cores), "%"),
        ]);
        for t in &r.tenants {
            let cores = if t.cores == 0 {
                "no SM limit".to_owned()
            } else {
                format!("{}%", t.cores)
            };
            lines.push([
                String::new(),
                format!("  {}/{}", t.namespace, t.name),
                String::new(),
                String::new(),
                String::new(),
                format!("{} MiB", t.mem),
                cores,
            ]);
        }
        if !r.mig.is_empty() {
            lines.push([
                String::new(),
                format!("  MIG in use: {}", r.mig.join(", ")),
                String::new(),
                String::new(),
                String::new(),
                String::new(),
                String::new(),
            ]);
        }
    }
    crate::text::table(
        ["NODE", "GPU", "MODEL", "HEALTH", "SLOTS", "MEMORY", "CORES"],
        &lines,
    )
}

/// Nodes whose device plugin registered something the extender cannot use, with why (a bad or
/// empty registration, no allocatable GPUs). Nodes that registered nothing at all (every CPU node)
/// are not listed.
pub fn unregistered(state: &ClusterState) -> Vec<(String, String)> {
    state
        .nodes()
        .filter_map(|n| Some((n.name.clone(), n.unregistered.clone()?)))
        .filter(|(_, why)| why != crate::state::NOT_REGISTERED)
        .collect()
}

#[cfg(test)]
mod tests {
    use crate::fixtures::{cluster_state, gpu_node, running_pod};

    #[test]
    fn each_gpu_lists_its_tenants_and_what_they_book() {
        let nodes = vec![gpu_node("n", 2, 16384, 10)];
        let pods = vec![
            running_pod("a", "train", "n", "GPU-n-0,NVIDIA,8000,30:;"),
            running_pod("b", "serve", "n", "GPU-n-0,NVIDIA,4000,0:;"),
            // A pod on a node the caller cannot see.
            running_pod("b", "far", "hidden", "GPU-hidden-3,NVIDIA,2000,10:;"),
        ];
        let mut s = cluster_state(&nodes, &pods);
        let rows = super::gpus(&mut s);
        assert_eq!(rows.len(), 3);
        let g0 = &rows[0];
        assert_eq!((g0.node.as_str(), g0.uuid.as_str()), ("n", "GPU-n-0"));
        assert_eq!((g0.slots_used, g0.mem_used, g0.cores_used), (2, 12000, 30));
        let names: Vec<_> = g0.tenants.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["train", "serve"]);
        assert!(rows[1].tenants.is_empty());
        assert_eq!(rows[1].mem_used, 0);
        assert!(rows[2].registered.is_none());
        assert_eq!(rows[2].mem_used, 2000);
        // A CPU node (no register annotation) is not a GPU node gone wrong; a node that
        // registered nothing usable is.
        let cpu: k8s_openapi::api::core::v1::Node =
            serde_json::from_value(serde_json::json!({"metadata": {"name": "cpu"}})).expect("node");
        let mut empty = gpu_node("empty", 1, 16384, 10);
        empty
            .metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert("hami.io/node-nvidia-register".into(), "[]".into());
        let s = cluster_state(&[cpu, empty], &[]);
        let listed: Vec<String> = super::unregistered(&s)
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert_eq!(listed, ["empty"]);
        let t = super::table(&rows);
        assert!(
            t.contains("GPU-n-0") && t.contains("12000/16384 MiB"),
            "{t}"
        );
        assert!(t.contains("  b/serve") && t.contains("no SM limit"), "{t}");
        assert!(t.contains("2000 MiB/?"), "{t}");
    }
}

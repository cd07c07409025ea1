//! The few cluster facts the admission webhook needs, kept on every replica (the webhook is
//! served by all of them, leader or not): the largest GPU any registered node offers and the GPU
//! limits of each namespace's ResourceQuotas. Fed by a light watch (the daemon's
//! `kube_edge::run_facts`: node metadata and quotas), read under a lock for one webhook answer.
//! Pure data, no I/O.
//!
//! These facts only ever let the webhook refuse a pod that could never be placed; the filter
//! remains the check that counts (usage, in-flight reservations). So a view that has seen no
//! registered GPU yet refuses nothing on its grounds.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use crate::fit;
use crate::quota::{NamespaceLimits, QuotaRecord, Quotas};
use crate::state::NodeRecord;

/// The view, shared between the watch that writes it and the webhook that reads it.
pub type SharedFacts = Arc<RwLock<ClusterFacts>>;

/// See the module documentation.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ClusterFacts {
    /// Registered nodes with at least one usable GPU: the largest one's MiB.
    largest_by_node: BTreeMap<String, u32>,
    /// GPU limits of each ResourceQuota.
    quotas: Quotas,
}

/// The largest GPU of the cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LargestGpu {
    /// MiB as registered (after the node's `deviceMemoryScaling`).
    pub mem: u32,
    /// A node that has it (the first by name).
    pub node: String,
}

/// The largest GPU on a registered node that the filter could ever hand out: NVIDIA, with at
/// least one replica; on a GPU in `mig` mode, no more than its largest registered profile
/// (contract §6.4: a request must fit one instance). Health and cordons are ignored: they
/// change, the card stays.
fn largest_usable(rec: &NodeRecord) -> Option<u32> {
    if rec.unregistered.is_some() {
        return None;
    }
    rec.devices
        .iter()
        .filter(|d| d.count > 0 && fit::is_nvidia(&d.device_type))
        .filter_map(|d| {
            if d.mode != fit::MIG_MODE {
                return Some(d.devmem);
            }
            let profiles = hami_contract::mig::decode_profiles(&d.mig_profiles).ok()?;
            profiles
                .iter()
                .map(|p| p.memory_mb)
                .max()
                .map(|m| m.min(d.devmem))
        })
        .max()
}

impl ClusterFacts {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a node (`NodeRecord::from_node`); unregistered nodes and nodes without a usable
    /// GPU are dropped.
    pub fn upsert_node(&mut self, rec: &NodeRecord) {
        match largest_usable(rec) {
            Some(mem) => {
                self.largest_by_node.insert(rec.name.clone(), mem);
            }
            None => {
                self.largest_by_node.remove(&rec.name);
            }
        }
    }

    pub fn remove_node(&mut self, name: &str) {
        self.largest_by_node.remove(name);
    }

    /// Replaces every node (a watcher's complete List).
    pub fn replace_nodes<'a>(&mut self, recs: impl IntoIterator<Item = &'a NodeRecord>) {
        self.largest_by_node.clear();
        for r in recs {
            self.upsert_node(r);
        }
    }

    /// Records a quota's GPU limits; `None` (the quota names no GPU key) forgets it.
    pub fn upsert_quota(&mut self, namespace: &str, name: &str, rec: Option<QuotaRecord>) {
        self.quotas.upsert(namespace, name, rec);
    }

    pub fn remove_quota(&mut self, namespace: &str, name: &str) {
        self.quotas.remove(namespace, name);
    }

    /// Replaces every quota (a watcher's complete List).
    pub fn replace_quotas(&mut self, recs: impl IntoIterator<Item = QuotaRecord>) {
        self.quotas.replace(recs);
    }

    /// The largest usable GPU, `None` while no registered node with one is known.
    pub fn largest_gpu(&self) -> Option<LargestGpu> {
        let mut best: Option<(&String, u32)> = None;
        for (node, mem) in &self.largest_by_node {
            if best.is_none_or(|(_, m)| *mem > m) {
                best = Some((node, *mem));
            }
        }
        best.map(|(node, mem)| LargestGpu {
            mem,
            node: node.clone(),
        })
    }

    /// The namespace's GPU limits: per resource, the minimum across its quotas (HAMi #2997).
    pub fn namespace_limits(&self, namespace: &str) -> NamespaceLimits<'_> {
        self.quotas.namespace_limits(namespace)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DecisionConfig;
    use crate::quota::Limit;
    use serde_json::json;

    fn node(name: &str, devices: serde_json::Value) -> NodeRecord {
        let n = serde_json::from_value(json!({"metadata": {"name": name, "annotations": {
            "hami.io/node-nvidia-register": devices.to_string()}}}))
        .unwrap();
        NodeRecord::from_node(&n, &DecisionConfig::default()).unwrap()
    }

    fn dev(id: &str, mem: u32, mode: &str) -> serde_json::Value {
        json!({"id": id, "count": 10, "devmem": mem, "devcore": 100, "type": "NVIDIA-A100",
               "mode": mode, "health": true})
    }

    #[test]
    fn largest_gpu_skips_mig_cards_without_profiles_and_follows_updates() {
        let mut f = ClusterFacts::new();
        assert_eq!(f.largest_gpu(), None);
        f.upsert_node(&node("a", json!([dev("g1", 40960, "hami-core")])));
        f.upsert_node(&node(
            "b",
            json!([dev("g2", 81920, "mig"), dev("g3", 24576, "hami-core")]),
        ));
        assert_eq!(
            f.largest_gpu(),
            Some(LargestGpu {
                mem: 40960,
                node: "a".into()
            })
        );
        f.upsert_node(&node("c", json!([dev("g4", 81920, "hami-core")])));
        assert_eq!(f.largest_gpu().map(|l| l.mem), Some(81920));
        f.remove_node("c");
        assert_eq!(f.largest_gpu().map(|l| l.mem), Some(40960));
        // A node whose annotation no longer decodes is not registered any more.
        let mut broken = node("a", json!([]));
        broken.unregistered = Some("node unregistered: bad".into());
        f.upsert_node(&broken);
        assert_eq!(f.largest_gpu().map(|l| l.node), Some("b".into()));
        f.replace_nodes(&[]);
        assert_eq!(f.largest_gpu(), None);
    }

    fn quota(ns: &str, name: &str, mem: Option<u64>, count: Option<u64>) -> QuotaRecord {
        QuotaRecord {
            namespace: ns.into(),
            name: name.into(),
            mem_limit: mem,
            cores_limit: None,
            count_limit: count,
        }
    }

    #[test]
    fn namespace_limits_are_the_minimum_across_quotas_of_that_namespace_only() {
        let mut f = ClusterFacts::new();
        f.replace_quotas([
            quota("team-a", "big", Some(40000), Some(2)),
            quota("team-a", "small", Some(20000), None),
            quota("team-ab", "other", Some(1), Some(1)),
            quota("team", "other", Some(1), Some(1)),
        ]);
        let l = f.namespace_limits("team-a");
        assert_eq!(
            l.mem,
            Some(Limit {
                value: 20000,
                quota: "small"
            })
        );
        assert_eq!(
            l.count,
            Some(Limit {
                value: 2,
                quota: "big"
            })
        );
        assert_eq!(l.cores, None);
        assert!(f.namespace_limits("team-b").is_empty());
        f.upsert_quota("team-a", "small", None);
        assert_eq!(
            f.namespace_limits("team-a").mem.map(|l| l.value),
            Some(40000)
        );
        f.remove_quota("team-a", "big");
        assert!(f.namespace_limits("team-a").is_empty());
    }
}

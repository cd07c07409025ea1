//! What preemption reads of the state: the GPU pods bound to a node and what they charge (the
//! node's state with some of them gone is [`ClusterState::node_without`]).

use super::*;
use crate::state::records::Standing;

/// A GPU pod bound to a node, as a possible victim (borrowed from the state).
#[derive(Debug, Clone)]
pub struct BoundGpuPod<'a> {
    pub uid: &'a str,
    pub namespace: &'a str,
    pub name: &'a str,
    pub standing: Standing,
    /// Its collapsed usage: `(GPU UUID, slots, MiB, cores)` per entry, one entry per GPU.
    pub usage: Vec<(&'a str, u32, u32, u32)>,
    /// What it charges against its namespace's budget.
    pub charge: Charge,
}

impl BoundGpuPod<'_> {
    /// The GPUs it books a slice of.
    pub fn gpus(&self) -> impl Iterator<Item = &str> {
        self.usage.iter().map(|u| u.0)
    }

    /// Whether it books a slice of GPU `uuid`.
    pub fn holds(&self, uuid: &str) -> bool {
        self.usage.iter().any(|u| u.0 == uuid)
    }
}

impl ClusterState {
    /// The pods bound to node `name` (kube-scheduler knows them there) that book GPU capacity
    /// on it: the pods preemption may evict. A decision not bound yet is not one of them:
    /// kube-scheduler could not find it on the node.
    pub fn victims_on(&self, name: &str) -> Vec<BoundGpuPod<'_>> {
        let Some(uids) = self.by_node.get(name) else {
            return Vec::new();
        };
        uids.iter()
            .filter_map(|uid| {
                let (uid, p) = self.pods.get_key_value(uid.as_str())?;
                if p.bound_node.as_deref() != Some(name) {
                    return None;
                }
                let usage = match self.reservations.get(&**uid) {
                    Some(r) if r.node != name => return None,
                    Some(r) => UsageRef::Full(&r.usage),
                    None if p.books_capacity() => UsageRef::Compact(&p.usage),
                    None => return None,
                };
                let mut entries = Vec::new();
                usage.each_ref(|u, slots, mem, cores| entries.push((u, slots, mem, cores)));
                Some(BoundGpuPod {
                    uid,
                    namespace: &p.namespace,
                    name: &p.name,
                    standing: p.standing,
                    usage: entries,
                    charge: usage.charge(),
                })
            })
            .collect()
    }

    /// What pod `uid` charges against the budget of `namespace`, if it is a pod of that
    /// namespace that books capacity.
    pub fn charge_in(&self, uid: &str, namespace: &str) -> Option<Charge> {
        let p = self.pods.get(uid)?;
        if *p.namespace != *namespace {
            return None;
        }
        self.effective(uid).map(|(_, usage)| usage.charge())
    }
}

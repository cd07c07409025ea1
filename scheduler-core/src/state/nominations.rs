//! Pods kube-scheduler has nominated to a node after preempting for them
//! (`status.nominatedNodeName`, not bound yet): the slice their victims free is held for them
//! against pods of no higher priority, as kube-scheduler holds CPU and memory for them
//! (`addGENominatedPods`), which it cannot do for GPU slices it does not see.

use super::*;

/// A pod nominated to a node, kept as the filter needs it to place it there (its spec's GPU
/// requests and placement annotations, [`slim_pod`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Nomination {
    pub node: String,
    pub priority: i32,
    pub pod: Pod,
}

impl Nomination {
    /// The nomination a pod carries: nominated, not bound, not ending.
    pub(super) fn of(pod: &Pod) -> Option<Nomination> {
        let status = pod.status.as_ref()?;
        let node = status
            .nominated_node_name
            .as_deref()
            .filter(|n| !n.is_empty())?;
        let spec = pod.spec.as_ref()?;
        let bound = spec.node_name.as_deref().is_some_and(|n| !n.is_empty());
        let ended = matches!(status.phase.as_deref(), Some("Succeeded") | Some("Failed"));
        if bound || ended || pod.metadata.deletion_timestamp.is_some() {
            return None;
        }
        Some(Nomination {
            node: node.to_owned(),
            priority: spec.priority.unwrap_or(0),
            pod: pod.clone(),
        })
    }
}

impl ClusterState {
    /// Records (or forgets) the nomination of pod `uid`.
    pub(super) fn note_nomination(&mut self, uid: &str, nomination: Option<Nomination>) {
        match nomination {
            Some(n) => {
                self.nominations.insert(uid.into(), n);
            }
            None => {
                self.nominations.remove(uid);
            }
        }
    }

    /// The node pod `uid` is nominated to (where it holds a slice), if any.
    pub fn nomination_of(&self, uid: &str) -> Option<&str> {
        self.nominations.get(uid).map(|n| n.node.as_str())
    }

    /// The nominations a pod of `priority` must leave room for: those of other pods with at
    /// least its priority, by node.
    pub fn holds_against(&self, priority: i32, uid: &str) -> BTreeMap<&str, Vec<&Nomination>> {
        let mut out: BTreeMap<&str, Vec<&Nomination>> = BTreeMap::new();
        for (other, n) in &self.nominations {
            if &**other != uid && n.priority >= priority {
                out.entry(n.node.as_str()).or_default().push(n);
            }
        }
        out
    }

    /// Node `name` as the nominated pods' victims leave it: without the pods being deleted there
    /// (they are going away; the nominated pod's slice is where they were).
    pub fn node_after_deletions(&self, name: &str) -> Option<NodeState> {
        self.node_without(name, |uid| self.pods.get(uid).is_some_and(|p| p.deleting))
    }
}

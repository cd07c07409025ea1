//! The per-node cache the filter reads: every node's state with all effective usage applied,
//! rebuilt lazily for the nodes a change touched, with a dense array of what the quick path
//! decides by ([`HotNode`]) beside the full states.

use super::*;

/// A node's state with every effective usage applied, and why it cannot take GPU pods (copied
/// from its record so a filter needs one lookup per candidate).
#[derive(Debug, Clone)]
pub(super) struct CachedNode {
    pub(super) unregistered: Option<String>,
    /// Shared so that a metrics scrape can take every node's state off the decision loop for
    /// a reference count each ([`ClusterState::node_states`]); a rebuild replaces it.
    pub(super) state: std::sync::Arc<NodeState>,
    /// `fit::nvidia_mask` of `state.gpus`.
    pub(super) nvidia: Vec<bool>,
}

/// What the filter's quick path reads of a cached node, kept apart from the rest in one dense
/// array: at 5,000 candidates the filter's cost was the cache misses of reaching each node
/// (the hash map's entry, the key's buffer, the node's GPUs), by `perf`.
/// Line-aligned, with what a fitting node is decided by in its first line.
#[derive(Debug)]
#[repr(C, align(64))]
pub(super) struct HotNode {
    /// The slot holds a node (a removed node's slot waits for reuse).
    pub(super) occupied: bool,
    pub(super) registered: bool,
    pub(super) summary: NodeSummary,
}

/// Bytes of a node name kept inside the cache's hash table (longer names go to the heap).
pub(super) const INLINE_NAME: usize = 22;

/// A node name as the cache's hash table keeps it: inline when short (most are), so that
/// finding a node does not read a separate buffer to compare the key.
#[derive(Debug, Clone)]
pub(super) enum NodeKey {
    Inline(u8, [u8; INLINE_NAME]),
    Heap(Box<[u8]>),
}

impl NodeKey {
    pub(super) fn new(name: &str) -> Self {
        let b = name.as_bytes();
        match u8::try_from(b.len()) {
            Ok(n) if b.len() <= INLINE_NAME => {
                let mut bytes = [0u8; INLINE_NAME];
                bytes[..b.len()].copy_from_slice(b);
                NodeKey::Inline(n, bytes)
            }
            _ => NodeKey::Heap(b.into()),
        }
    }

    pub(super) fn bytes(&self) -> &[u8] {
        match self {
            NodeKey::Inline(n, bytes) => &bytes[..usize::from(*n)],
            NodeKey::Heap(b) => b,
        }
    }
}

impl std::borrow::Borrow<[u8]> for NodeKey {
    fn borrow(&self) -> &[u8] {
        self.bytes()
    }
}

impl PartialEq for NodeKey {
    fn eq(&self, other: &Self) -> bool {
        self.bytes() == other.bytes()
    }
}

impl Eq for NodeKey {}

impl std::hash::Hash for NodeKey {
    /// As the borrowed form (`[u8]`) hashes, which lookups use.
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.bytes().hash(state);
    }
}

/// The per-node usage cache, in slots: the full state for the full evaluation, and the quick
/// path's [`HotNode`]s in a dense array beside it.
#[derive(Debug, Default)]
pub(super) struct NodeCache {
    pub(super) slot_of: HashMap<NodeKey, usize, NameHash>,
    pub(super) cold: Vec<Option<CachedNode>>,
    pub(super) hot: Vec<HotNode>,
    /// Each slot's node name, shared: a filter lists every fitting node by name, and cloning
    /// this costs a reference count instead of an allocation per node. Kept across refreshes.
    pub(super) names: Vec<std::sync::Arc<str>>,
    pub(super) free: Vec<usize>,
}

impl NodeCache {
    pub(super) fn len(&self) -> usize {
        self.slot_of.len()
    }

    pub(super) fn contains(&self, name: &str) -> bool {
        self.slot_of.contains_key(name.as_bytes())
    }

    pub(super) fn get(&self, name: &str) -> Option<(&CachedNode, &std::sync::Arc<str>)> {
        let slot = *self.slot_of.get(name.as_bytes())?;
        Some((self.cold[slot].as_ref()?, &self.names[slot]))
    }

    pub(super) fn insert(&mut self, name: String, node: CachedNode, summary: NodeSummary) {
        let registered = node.unregistered.is_none();
        if let Some(&slot) = self.slot_of.get(name.as_bytes()) {
            self.cold[slot] = Some(node);
            let hot = &mut self.hot[slot];
            hot.registered = registered;
            hot.summary = summary;
            return;
        }
        let hot = HotNode {
            occupied: true,
            registered,
            summary,
        };
        let shared = std::sync::Arc::from(name.as_str());
        let slot = match self.free.pop() {
            Some(slot) => {
                self.cold[slot] = Some(node);
                self.hot[slot] = hot;
                self.names[slot] = shared;
                slot
            }
            None => {
                self.cold.push(Some(node));
                self.hot.push(hot);
                self.names.push(shared);
                self.cold.len() - 1
            }
        };
        self.slot_of.insert(NodeKey::new(&name), slot);
    }

    pub(super) fn remove(&mut self, name: &str) {
        if let Some(slot) = self.slot_of.remove(name.as_bytes()) {
            self.cold[slot] = None;
            let hot = &mut self.hot[slot];
            hot.occupied = false;
            hot.registered = false;
            hot.summary = NodeSummary::default();
            self.free.push(slot);
        }
    }
}

/// A candidate node as the filter sees it.
#[derive(Debug)]
pub enum Candidate<'a> {
    /// Not registered, or registered with no usable GPUs: the reason string.
    Unregistered(&'a str),
    /// The node with usage, its `fit::nvidia_mask`, and its name (shared).
    Usable(
        std::borrow::Cow<'a, NodeState>,
        &'a [bool],
        &'a std::sync::Arc<str>,
    ),
}

/// Where the state's cache keeps a node ([`ClusterState::node_slot`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeSlot(usize);

/// A candidate node as the filter's quick path sees it ([`ClusterState::quick_candidate`]).
#[derive(Debug)]
pub enum QuickCandidate<'a> {
    /// Not registered, or registered with no usable GPUs: the reason string.
    Unregistered(&'a str),
    /// The node's name (shared) and the summary of its cached state.
    Usable(&'a std::sync::Arc<str>, &'a NodeSummary),
}

/// The hasher of the maps and sets keyed by node name, which the filter reads once per
/// candidate: SipHash was 9 % of the per-candidate cost (docs/benchmarks.md). foldhash is
/// hashbrown's default: a few multiplications per word, seeded per process.
pub type NameHash = foldhash::fast::RandomState;

/// A set of node names, as [`ClusterState::nodes_in_flight`] returns it.
pub type NodeSet<'a> = HashSet<&'a str, NameHash>;

impl ClusterState {
    pub(super) fn build_node(&self, name: &str, exclude: Option<&str>) -> Option<NodeState> {
        self.node_without(name, |uid| Some(uid) == exclude)
    }

    /// Node `name` with every effective usage applied except that of the pods `exclude` names,
    /// built from the books (not the cache); `None` for a node the cluster does not have.
    pub fn node_without(&self, name: &str, exclude: impl Fn(&str) -> bool) -> Option<NodeState> {
        let rec = self.nodes.get(name)?;
        let mut state = rec.base_state();
        let has_mig = state.gpus.iter().any(|g| g.mode == fit::MIG_MODE);
        let mut uids: BTreeSet<&str> = self
            .by_node
            .get(name)
            .map(|s| s.iter().map(String::as_str).collect())
            .unwrap_or_default();
        if let Some(res) = self.res_by_node.get(name) {
            uids.extend(res.iter().map(String::as_str));
        }
        for uid in uids {
            if exclude(uid) {
                continue;
            }
            if let Some((n, usage)) = self.effective(uid)
                && n == name
            {
                usage.book(&mut state);
                // HAMi's occupancy rebuild of MIG reservations (contract §6.4), only where
                // there is something to do: a `mig` GPU on the node, or reservations.
                let mig = self.effective_mig(uid);
                if has_mig || !mig.is_empty() {
                    let mut used: Vec<String> = Vec::new();
                    usage.each(|u, _, _, _| used.push(u.to_owned()));
                    fit::book_pod_mig(&mut state, used.iter().map(String::as_str), mig);
                }
            }
        }
        Some(state)
    }

    pub(super) fn refresh(&mut self) {
        let mut dirty: Vec<String> = self.dirty.drain().collect();
        // In name order: a new cluster's nodes then take slots (and their shared names memory)
        // in the order candidate lists usually come in, which the filter's reads then follow.
        dirty.sort_unstable();
        for name in dirty {
            match self.build_node(&name, None) {
                Some(state) => {
                    let unregistered = self.nodes.get(&name).and_then(|r| r.unregistered.clone());
                    let nvidia = fit::nvidia_mask(&state.gpus);
                    let summary = NodeSummary::new(&state, &nvidia);
                    self.cache.insert(
                        name,
                        CachedNode {
                            unregistered,
                            state: std::sync::Arc::new(state),
                            nvidia,
                        },
                        summary,
                    );
                }
                None => {
                    self.cache.remove(&name);
                }
            }
        }
    }

    /// Makes every node's usage current; call before [`Self::node_state`].
    pub fn prepare(&mut self) {
        self.refresh();
        // The cache only ever holds registered nodes, so equal sizes mean nothing is missing:
        // the per-filter cost stays independent of the cluster size when nothing changed.
        if self.cache.len() == self.nodes.len() {
            return;
        }
        for name in self.nodes.keys() {
            if !self.cache.contains(name) {
                self.dirty.insert(name.clone());
            }
        }
        self.refresh();
    }

    /// Every registered node's state with all effective usage applied, in name order, each
    /// shared with the cache: a consistent view of the whole cluster for a reference count per
    /// node, which a metrics scrape reads after the decision loop has moved on.
    pub fn node_states(&mut self) -> Vec<(std::sync::Arc<str>, std::sync::Arc<NodeState>)> {
        self.prepare();
        self.nodes
            .keys()
            .filter_map(|name| {
                let (cached, shared) = self.cache.get(name)?;
                Some((shared.clone(), cached.state.clone()))
            })
            .collect()
    }

    /// The node with all effective usage except that of `exclude` (the pod being filtered,
    /// whose previous decision HAMi drops first). Call [`Self::prepare`] first.
    pub fn node_state(
        &self,
        name: &str,
        exclude: Option<&str>,
    ) -> Option<std::borrow::Cow<'_, NodeState>> {
        if let Some(uid) = exclude
            && self.effective(uid).is_some_and(|(n, _)| n == name)
        {
            return self.build_node(name, exclude).map(std::borrow::Cow::Owned);
        }
        self.cache
            .get(name)
            .map(|(c, _)| std::borrow::Cow::Borrowed(&*c.state))
    }

    /// A filter candidate: `None` for a node the cluster does not have. `exclude_on` is
    /// [`Self::effective_node`] of `exclude`, computed once per filter. Call [`Self::prepare`]
    /// first.
    pub fn candidate(
        &self,
        name: &str,
        exclude: &str,
        exclude_on: Option<&str>,
    ) -> Option<Candidate<'_>> {
        let (cached, shared) = self.cache.get(name)?;
        if let Some(why) = &cached.unregistered {
            return Some(Candidate::Unregistered(why));
        }
        if exclude_on == Some(name) {
            return self
                .build_node(name, Some(exclude))
                .map(|s| Candidate::Usable(std::borrow::Cow::Owned(s), &cached.nvidia, shared));
        }
        Some(Candidate::Usable(
            std::borrow::Cow::Borrowed(&*cached.state),
            &cached.nvidia,
            shared,
        ))
    }

    /// A filter candidate for the quick path: its summary reflects every effective usage, so
    /// it is not for the node the filtered pod's own earlier decision is on (use
    /// [`Self::candidate`] there). `None` for a node the cluster does not have. Call
    /// [`Self::prepare`] first.
    pub fn quick_candidate(&self, name: &str) -> Option<QuickCandidate<'_>> {
        self.node_slot(name).map(|s| self.quick_at(s))
    }

    /// Where the cache keeps node `name`, for [`Self::quick_at`]; `None` for a node the
    /// cluster does not have. Valid until the state changes. Finding every candidate's slot
    /// first, in one pass, lets the processor overlap the lookups' memory reads.
    pub fn node_slot(&self, name: &str) -> Option<NodeSlot> {
        self.cache
            .slot_of
            .get(name.as_bytes())
            .map(|s| NodeSlot(*s))
    }

    /// [`Self::node_slot`] when node `name` is at `guess` (`None` when it is not there, which
    /// says nothing of where it is). Candidate lists tend to name nodes in the order the cache
    /// took them (by name, when it was built), and checking the next slot reads memory the
    /// quick path reads anyway, where a lookup reads the hash table at random.
    pub fn node_slot_at(&self, name: &str, guess: NodeSlot) -> Option<NodeSlot> {
        let hot = self.cache.hot.get(guess.0)?;
        (hot.occupied && *self.cache.names[guess.0] == *name).then_some(guess)
    }

    /// The slot after `slot`, as a guess for [`Self::node_slot_at`].
    pub fn next_slot(slot: NodeSlot) -> NodeSlot {
        NodeSlot(slot.0 + 1)
    }

    /// [`Self::quick_candidate`] of the node at `slot`.
    pub fn quick_at(&self, slot: NodeSlot) -> QuickCandidate<'_> {
        let hot = &self.cache.hot[slot.0];
        if !hot.registered {
            let why = self.cache.cold[slot.0]
                .as_ref()
                .and_then(|c| c.unregistered.as_deref());
            return QuickCandidate::Unregistered(why.unwrap_or_default());
        }
        QuickCandidate::Usable(&self.cache.names[slot.0], &hot.summary)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The quick path's node is four cache lines, the first holding what decides a fitting
    /// node (its score, the fixed reason's word, the first GPU).
    #[test]
    fn a_hot_node_is_four_cache_lines() {
        assert_eq!(std::mem::size_of::<HotNode>(), 256);
        assert_eq!(std::mem::align_of::<HotNode>(), 64);
    }
}

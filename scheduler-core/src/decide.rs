//! One filter decision over the cluster state: the part shared by the decision loop and
//! `simulate`. Pure (the caller owns the state and does the I/O).

use std::collections::{BTreeMap, BTreeSet};

use hami_contract::PodDevices;
use hami_contract::identity::AllocationSignature;
use hami_contract::policy::AnnotationError;
use k8s_openapi::api::core::v1::{Node, Pod};

use crate::config::DecisionConfig;
use crate::fit::{self, Charge, NodeFit};
use crate::podspec;
use crate::state::{
    BindStage, Candidate, ClusterState, NodeRecord, NodeSet, NodeSlot, QuickCandidate, Reservation,
};

/// Reason for a node skipped because a pending pod there could be confused with this one.
pub const PENDING_CONFLICT: &str = "PendingAllocationConflict";

/// Why a candidate node was not chosen. `Display` is the node's entry in the extender's
/// `FailedNodes` (HAMi's reason string for a fit failure); it serializes as that string.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NodeFailure {
    /// The pod does not fit the node's devices.
    #[error(transparent)]
    Fit(#[from] fit::FitFailure),
    /// The cluster state has no such node.
    #[error("node unregistered")]
    Unknown,
    /// The node is known but takes no GPU pod: why (`node unregistered: …`).
    #[error("{0}")]
    Unregistered(String),
    /// The pod fits, but pod `other` is still being allocated on the node and could be taken for
    /// this one (or the node runs HAMi's device plugin, which takes one pod at a time).
    #[error(
        "{}: pod {other} is still being allocated here {}",
        PENDING_CONFLICT,
        pending_why(.hami_plugin)
    )]
    PendingConflict { other: String, hami_plugin: bool },
}

/// The end of [`NodeFailure::PendingConflict`]'s message.
fn pending_why(hami_plugin: &bool) -> &'static str {
    if *hami_plugin {
        "and HAMi's device plugin here takes one pod at a time"
    } else {
        "and could be taken for this one"
    }
}

impl serde::Serialize for NodeFailure {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

/// What filtering one pod concluded. (One per filter, moved once: the size of `Placed` does not
/// matter.)
#[derive(Debug, Clone, PartialEq)]
#[allow(clippy::large_enum_variant)]
pub enum Verdict {
    /// The pod asks for no managed resource: pass the candidates through untouched.
    NotGpu,
    /// The pod cannot be evaluated (bad annotation).
    Invalid(AnnotationError),
    /// No candidate fits; why, per node.
    NoFit {
        failed: BTreeMap<String, NodeFailure>,
        /// The failed nodes where preemption cannot help ([`beyond_preemption`]): kube-scheduler
        /// gets them as `FailedAndUnresolvableNodes` and runs no preemption dry run there.
        unresolvable: BTreeSet<String>,
    },
    Placed(Placement),
}

/// A chosen node and what the pod gets there.
#[derive(Debug, Clone, PartialEq)]
pub struct Placement {
    pub node: String,
    pub devices: PodDevices,
    pub signature: AllocationSignature,
    pub charge: Charge,
    /// `hami.io/vgpu-mig-allocations` of the decision; empty when no device is on a `mig` GPU.
    pub mig: Vec<hami_contract::mig::MigAllocation>,
    /// Every node that fits, with its score (names shared with the loop's cache).
    pub fitting: Vec<(std::sync::Arc<str>, f32)>,
    /// Why each other candidate failed, with [`DecisionConfig::reasons_when_placed`] (`simulate`,
    /// `kubectl tessera`); empty otherwise (the extender: kube-scheduler reads `FailedNodes`
    /// only when nothing fits).
    pub failed: BTreeMap<String, NodeFailure>,
    /// How many candidates failed (distinct names), reasons kept or not.
    pub failed_count: usize,
}

fn annotations(pod: &Pod) -> BTreeMap<String, String> {
    pod.metadata.annotations.clone().unwrap_or_default()
}

/// Below this many candidates per thread, evaluation stays on the loop's thread.
const PARALLEL_CHUNK_MIN: usize = 256;

/// Candidates whose cache slots the quick path looks up at once.
const SLOT_BLOCK: usize = 128;

/// Failed guesses of a candidate's slot in a row after which the quick path only looks up.
const GUESS_MISSES: u32 = 8;

/// The preferred node of a slice of the candidates so far.
#[derive(Debug)]
enum Best<'c> {
    /// Evaluated fully: the node with its devices.
    Fit(NodeFit),
    /// Answered by the quick check: the node's name (a candidate) and score; the devices are
    /// found by evaluating it fully once it is chosen.
    Quick(&'c str, f32),
}

impl Best<'_> {
    fn score(&self) -> f32 {
        match self {
            Best::Fit(f) => f.score,
            Best::Quick(_, s) => *s,
        }
    }
}

/// What one slice of the candidates concluded.
#[derive(Debug, Default)]
struct Chunk<'c> {
    /// Why each failed node failed, in candidate order: names borrowed from the candidates,
    /// a map of owned names built once at the end, and only when it is wanted.
    failed: Vec<(&'c str, NodeFailure)>,
    fitting: Vec<(std::sync::Arc<str>, f32)>,
    best: Option<Best<'c>>,
}

/// The read-only inputs of evaluating candidates.
struct EvalInput<'a> {
    state: &'a ClusterState,
    ask: &'a fit::PodAsk,
    opts: &'a fit::PlacementOptions,
    quota: Option<&'a fit::QuotaBudget>,
    uid: &'a str,
    /// The node the pod's own earlier decision books, computed once per filter.
    uid_on: Option<&'a str>,
    /// Nodes where a pod may be pending allocation; the gate is only consulted there.
    pending_nodes: &'a NodeSet<'a>,
    /// Also avoid nodes where a confusable pod was decided and is not bound yet.
    avoid_decided: bool,
    annotations: &'a BTreeMap<String, String>,
    /// The request, when the nodes' summaries answer it ([`fit::QuickAsk`]); `None`: every
    /// candidate is evaluated fully.
    quick: Option<&'a fit::QuickAsk>,
    /// Slices held on a node for pods nominated there ([`held_slices`]); those nodes are
    /// evaluated fully, with the slices booked.
    holds: &'a BTreeMap<&'a str, Vec<Held>>,
}

/// A pod nominated to a node, as the filter of a pod of no higher priority books it there.
#[derive(Debug)]
struct Held {
    ask: fit::PodAsk,
    opts: fit::PlacementOptions,
    init_count: usize,
}

/// The slices held, by node, against a pod of `priority`: the nominations of other pods of at
/// least its priority that ask for GPUs.
fn held_slices<'s>(
    state: &'s ClusterState,
    cfg: &DecisionConfig,
    priority: i32,
    uid: &str,
) -> BTreeMap<&'s str, Vec<Held>> {
    state
        .holds_against(priority, uid)
        .into_iter()
        .map(|(node, nominations)| {
            let held: Vec<Held> = nominations
                .iter()
                .filter_map(|n| {
                    let (ask, _) = podspec::pod_ask(&n.pod, &cfg.nvidia);
                    if ask.is_empty() {
                        return None;
                    }
                    let opts =
                        podspec::placement_options(&annotations(&n.pod), &cfg.defaults).ok()?;
                    let init_count = podspec::init_container_count(&n.pod);
                    Some(Held {
                        ask,
                        opts,
                        init_count,
                    })
                })
                .collect();
            (node, held)
        })
        .filter(|(_, held)| !held.is_empty())
        .collect()
}

impl EvalInput<'_> {
    fn run<'c>(&self, candidates: &'c [String]) -> Chunk<'c> {
        let mut out = Chunk {
            fitting: Vec::with_capacity(candidates.len()),
            ..Chunk::default()
        };
        // Each block's places in the cache first: independent lookups the processor can
        // overlap (one after the other, each waited on its memory reads). On the stack: a
        // large allocation per filter would make glibc consolidate its free lists each time.
        // A candidate is first looked for in the slot after the previous one's (see
        // `ClusterState::node_slot_at`), as long as that keeps paying.
        let mut slots = [None::<NodeSlot>; SLOT_BLOCK];
        let mut guess: Option<NodeSlot> = None;
        let mut missed = 0u32;
        for block in candidates.chunks(SLOT_BLOCK) {
            if self.quick.is_some() {
                for (slot, name) in slots.iter_mut().zip(block) {
                    let hit = guess
                        .filter(|_| missed < GUESS_MISSES)
                        .and_then(|g| self.state.node_slot_at(name, g));
                    *slot = match hit {
                        Some(s) => Some(s),
                        None => {
                            let found = self.state.node_slot(name);
                            // Back in order: guess again.
                            missed = match (guess, found) {
                                (Some(g), Some(f)) if f == g => 0,
                                _ => missed + 1,
                            };
                            found
                        }
                    };
                    guess = slot.map(ClusterState::next_slot);
                }
            }
            for (name, slot) in block.iter().zip(slots) {
                // The quick path: the node's summary answers fit or the exact reason. Not for
                // the node the pod's own earlier decision books (its summary counts that
                // decision), nor where the pending-allocation gate may apply (that needs the
                // devices).
                match self.quick {
                    Some(quick)
                        if self.uid_on != Some(name.as_str())
                            && !self.pending_nodes.contains(name.as_str())
                            && !self.holds.contains_key(name.as_str()) =>
                    {
                        self.quick_one(quick, name, slot, &mut out);
                    }
                    _ => self.full_one(name, &mut out),
                }
            }
        }
        out
    }

    /// Whether a node of `score` is preferred to the chunk's best so far.
    fn prefers(&self, score: f32, best: &Option<Best<'_>>) -> bool {
        best.as_ref()
            .is_none_or(|b| self.opts.node_policy.prefers(score, b.score()))
    }

    /// One candidate on the quick path.
    fn quick_one<'c>(
        &self,
        quick: &fit::QuickAsk,
        name: &'c str,
        slot: Option<NodeSlot>,
        out: &mut Chunk<'c>,
    ) {
        match slot.map(|s| self.state.quick_at(s)) {
            None => out.failed.push((name, NodeFailure::Unknown)),
            Some(QuickCandidate::Unregistered(why)) => {
                out.failed
                    .push((name, NodeFailure::Unregistered(why.to_owned())));
            }
            Some(QuickCandidate::Usable(shared_name, summary)) => {
                match quick.check(summary, self.quota) {
                    Err(r) => out.failed.push((name, r.into())),
                    Ok(()) => {
                        out.fitting.push((shared_name.to_owned(), summary.score));
                        if self.prefers(summary.score, &out.best) {
                            out.best = Some(Best::Quick(name, summary.score));
                        }
                    }
                }
            }
        }
    }

    /// One candidate evaluated fully.
    fn full_one<'c>(&self, name: &'c str, out: &mut Chunk<'c>) {
        let (node, nvidia, shared_name) = match self.state.candidate(name, self.uid, self.uid_on) {
            None => {
                out.failed.push((name, NodeFailure::Unknown));
                return;
            }
            Some(Candidate::Unregistered(why)) => {
                out.failed
                    .push((name, NodeFailure::Unregistered(why.to_owned())));
                return;
            }
            Some(Candidate::Usable(node, nvidia, shared_name)) => (node, nvidia, shared_name),
        };
        let node = match self.holds.get(name) {
            Some(held) => {
                std::borrow::Cow::Owned(self.with_holds(name, node.into_owned(), nvidia, held))
            }
            None => node,
        };
        // Only the kept node's device list is built (UUID strings); the others are
        // compared by score alone.
        match fit::evaluate_picks(&node, Some(nvidia), self.ask, self.opts, self.quota) {
            Err(r) => {
                out.failed.push((name, r.into()));
            }
            Ok(f) => {
                let conflict = if self.pending_nodes.contains(name) {
                    let pending = if self.avoid_decided {
                        self.state.in_flight_on(name, self.uid)
                    } else {
                        self.state.pending_on(name, self.uid)
                    };
                    if pending.is_empty() {
                        None
                    } else {
                        let sig = AllocationSignature::new(&f.devices(&node), self.annotations);
                        self.state
                            .blocking_pending(name, &sig, &pending)
                            .map(|p| p.to_string())
                    }
                } else {
                    None
                };
                if let Some(other) = conflict {
                    let hami_plugin = self.state.is_hami_plugin_node(name);
                    out.failed
                        .push((name, NodeFailure::PendingConflict { other, hami_plugin }));
                } else {
                    out.fitting.push((shared_name.to_owned(), f.score));
                    if self.prefers(f.score, &out.best) {
                        out.best = Some(Best::Fit(f.into_fit(&node)));
                    }
                }
            }
        }
    }

    /// `node` with the slices held for the pods nominated there booked: each nominated pod is
    /// placed on the node as its victims leave it (the pods being deleted gone), and the devices
    /// it would get are booked on `node`, so a pod of no higher priority cannot take them, even
    /// while the victims are still terminating. A nominated pod that does not fit even then
    /// holds nothing (kube-scheduler will look for another node for it).
    fn with_holds(
        &self,
        name: &str,
        mut node: fit::NodeState,
        nvidia: &[bool],
        held: &[Held],
    ) -> fit::NodeState {
        let Some(mut after) = self.state.node_after_deletions(name) else {
            return node;
        };
        for h in held {
            let Ok(picks) = fit::evaluate_picks(&after, Some(nvidia), &h.ask, &h.opts, None) else {
                continue;
            };
            let devices = picks.devices(&after);
            let usage = hami_contract::usage::collapse_pod_usage(
                &devices.of_vendor(hami_contract::NVIDIA_VENDOR),
                h.init_count,
                false,
            );
            for u in &usage {
                after.book_usage(&u.uuid, u.slots, u.mem, u.cores);
                node.book_usage(&u.uuid, u.slots, u.mem, u.cores);
            }
        }
        node
    }

    /// The chosen node with its devices: a node the quick check kept is evaluated fully now.
    /// `None` if that evaluation disagrees with the quick check (a bug; the caller then
    /// evaluates every candidate fully).
    fn resolve(&self, best: Best<'_>) -> Option<NodeFit> {
        match best {
            Best::Fit(f) => Some(f),
            Best::Quick(name, score) => {
                let Some(Candidate::Usable(node, nvidia, _)) =
                    self.state.candidate(name, self.uid, self.uid_on)
                else {
                    return None;
                };
                let f = fit::evaluate_picks(&node, Some(nvidia), self.ask, self.opts, self.quota);
                let agrees = f
                    .as_ref()
                    .is_ok_and(|f| f.score.to_bits() == score.to_bits());
                debug_assert!(agrees, "quick check kept {name}, full evaluation: {f:?}");
                f.ok().filter(|_| agrees).map(|f| f.into_fit(&node))
            }
        }
    }
}

/// Filters `pod` over `candidates` (node names). The pod's own earlier decision (`uid`) does not
/// count against it. Nothing is reserved: the caller decides whether to. Nodes where a
/// confusable pod is pending allocation are avoided; decisions not bound yet are treated as
/// settled (what `simulate` models).
pub fn filter_pod(
    state: &mut ClusterState,
    cfg: &DecisionConfig,
    pod: &Pod,
    uid: &str,
    candidates: &[String],
) -> Verdict {
    filter_pod_with(state, cfg, pod, uid, candidates, false)
}

/// The filter of the `Nodes` form (not node-cache-capable, contract §4.4): the devices of the
/// given node objects only, with no usage, no reservation and nothing reserved.
pub fn filter_given_nodes(cfg: &DecisionConfig, pod: &Pod, nodes: &[Node]) -> Verdict {
    let mut state = ClusterState::new();
    let mut names = Vec::new();
    for node in nodes {
        if let Some(rec) = NodeRecord::from_node(node, cfg) {
            names.push(rec.name.clone());
            state.upsert_node(rec);
        }
    }
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    filter_pod(&mut state, cfg, pod, &uid, &names)
}

/// [`filter_pod`] as the live decision loop runs it: with `avoid_decided`, nodes where a
/// confusable pod was decided and is not bound yet are avoided too
/// ([`ClusterState::in_flight_on`]), so kube-scheduler's next pod goes where its bind will be
/// admitted instead of being refused at bind and backed off.
pub fn filter_pod_with(
    state: &mut ClusterState,
    cfg: &DecisionConfig,
    pod: &Pod,
    uid: &str,
    candidates: &[String],
    avoid_decided: bool,
) -> Verdict {
    filter(state, cfg, pod, uid, candidates, avoid_decided, true)
}

/// [`filter_pod_with`] evaluating every candidate fully, without the nodes' summaries: the
/// reference the quick path is tested against.
#[cfg(any(test, feature = "testing"))]
pub fn filter_pod_unpruned(
    state: &mut ClusterState,
    cfg: &DecisionConfig,
    pod: &Pod,
    uid: &str,
    candidates: &[String],
    avoid_decided: bool,
) -> Verdict {
    filter(state, cfg, pod, uid, candidates, avoid_decided, false)
}

/// Every candidate evaluated, on `threads` threads, in candidate order.
fn evaluate<'c>(eval: &EvalInput<'_>, candidates: &'c [String], threads: usize) -> Vec<Chunk<'c>> {
    if threads == 1 {
        return vec![eval.run(candidates)];
    }
    let size = candidates.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let handles: Vec<_> = candidates
            .chunks(size)
            .map(|part| scope.spawn(|| eval.run(part)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_default())
            .collect()
    })
}

/// The filter; with `quick`, a request the nodes' summaries answer ([`fit::QuickAsk`]) is
/// answered from them, and only the chosen node (and nodes where a pod may be pending
/// allocation) is evaluated fully. The verdict is the same either way.
fn filter(
    state: &mut ClusterState,
    cfg: &DecisionConfig,
    pod: &Pod,
    uid: &str,
    candidates: &[String],
    avoid_decided: bool,
    quick: bool,
) -> Verdict {
    let (ask, _warnings) = podspec::pod_ask(pod, &cfg.nvidia);
    if ask.is_empty() {
        return Verdict::NotGpu;
    }
    let annotations = annotations(pod);
    let opts = match podspec::placement_options(&annotations, &cfg.defaults) {
        Ok(o) => o,
        Err(e) => return Verdict::Invalid(e),
    };
    state.prepare();
    let state = &*state;
    let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
    let quota = state.quota_budget(namespace, Some(uid));
    let pending_nodes = if avoid_decided {
        state.nodes_in_flight()
    } else {
        state.nodes_with_pending()
    };
    let quick_ask = if quick {
        fit::QuickAsk::new(&ask, &opts)
    } else {
        None
    };
    let priority = pod.spec.as_ref().and_then(|s| s.priority).unwrap_or(0);
    let holds = held_slices(state, cfg, priority, uid);
    let mut eval = EvalInput {
        state,
        ask: &ask,
        opts: &opts,
        quota: quota.as_ref(),
        uid,
        uid_on: state.effective_node(uid),
        pending_nodes: &pending_nodes,
        avoid_decided,
        annotations: &annotations,
        quick: quick_ask.as_ref(),
        holds: &holds,
    };
    // Nodes are independent: with `--filter-threads` > 1, large candidate lists are evaluated on
    // scoped threads (read-only
    // over the loop's state, which stays the only writer) and merged in candidate order, so the
    // outcome is the same as a sequential pass.
    let threads = cfg
        .filter_threads
        .min(candidates.len() / PARALLEL_CHUNK_MIN)
        .max(1);
    let mut chunks = evaluate(&eval, candidates, threads);
    let mut failed = Vec::new();
    let mut fitting = Vec::new();
    let mut best: Option<Best<'_>> = None;
    loop {
        for c in chunks {
            if failed.is_empty() {
                failed = c.failed;
            } else {
                failed.extend(c.failed);
            }
            if fitting.is_empty() {
                fitting = c.fitting;
            } else {
                fitting.extend(c.fitting);
            }
            if let Some(f) = c.best
                && best
                    .as_ref()
                    .is_none_or(|b| opts.node_policy.prefers(f.score(), b.score()))
            {
                best = Some(f);
            }
        }
        let Some(b) = best.take() else { break };
        match eval.resolve(b) {
            Some(chosen) => {
                let (failed, failed_count) = if cfg.reasons_when_placed {
                    let map = failure_map(failed);
                    let n = map.len();
                    (map, n)
                } else {
                    (BTreeMap::new(), distinct_names(failed))
                };
                return Verdict::Placed(Placement {
                    node: chosen.node.clone(),
                    signature: AllocationSignature::new(&chosen.devices, &annotations),
                    devices: chosen.devices,
                    charge: chosen.charge,
                    mig: chosen.mig,
                    fitting,
                    failed,
                    failed_count,
                });
            }
            None => {
                // The quick check and the full evaluation disagree: answer from the full one.
                eval.quick = None;
                failed.clear();
                fitting.clear();
                chunks = evaluate(&eval, candidates, threads);
            }
        }
    }
    let failed = failure_map(failed);
    let unresolvable = beyond_preemption(&eval, &failed);
    Verdict::NoFit {
        failed,
        unresolvable,
    }
}

/// The failed nodes where evicting pods cannot make room: the node is not known or takes no GPU
/// pod, or the pod does not fit it even with no pod on any of its GPUs (a card too small or of
/// the wrong type, excluded by UUID, unhealthy or cordoned, too few cards). Decided with the real
/// fit on an emptied copy of the node, without the namespace budget (evicting the namespace's
/// own pods could free budget). A node with a `mig` GPU is left out: its instances are state
/// the emptying does not model.
fn beyond_preemption(
    eval: &EvalInput<'_>,
    failed: &BTreeMap<String, NodeFailure>,
) -> BTreeSet<String> {
    // Each emptied fit costs a few microseconds (a copy of the node and the fit); past this many
    // per filter the remaining capacity refusals stay in `FailedNodes`, as under HAMi, so a pod
    // that fits nowhere on a large cluster costs a bounded amount more.
    let mut emptied_fits = MAX_EMPTIED_FITS;
    failed
        .iter()
        .filter(|(name, failure)| match failure {
            NodeFailure::Unknown | NodeFailure::Unregistered(_) => true,
            NodeFailure::PendingConflict { .. } => false,
            NodeFailure::Fit(why) => match eval.state.candidate(name, eval.uid, eval.uid_on) {
                // A `mig` GPU's health and instances follow its bookings.
                Some(Candidate::Usable(node, _, _))
                    if node.gpus.iter().any(|g| g.mode == fit::MIG_MODE) =>
                {
                    false
                }
                Some(Candidate::Usable(node, nvidia, _)) => {
                    if statically_refused(why) {
                        return true;
                    }
                    if emptied_fits == 0 {
                        return false;
                    }
                    emptied_fits -= 1;
                    fit::evaluate_picks(
                        &fit::emptied(&node),
                        Some(nvidia),
                        eval.ask,
                        eval.opts,
                        None,
                    )
                    .is_err()
                }
                _ => true,
            },
        })
        .map(|(name, _)| name.clone())
        .collect()
}

/// The most refused nodes one filter checks against their emptied copy ([`beyond_preemption`]).
const MAX_EMPTIED_FITS: usize = 512;

/// Too few cards, or every card refused for what no eviction changes (on a node without `mig`
/// GPUs): the emptied fit would refuse too, so it need not run.
fn statically_refused(why: &fit::FitFailure) -> bool {
    use fit::{FitFailure, FitReason};
    match why {
        FitFailure::NodeInsufficientDevice => true,
        FitFailure::Devices(counts) => counts.reasons().all(|(r, _)| {
            matches!(
                r,
                FitReason::CardTypeMismatch
                    | FitReason::CardUuidMismatch
                    | FitReason::CardNotHealth
                    | FitReason::CardCordoned
            )
        }),
        FitFailure::MigAllocation { .. } => false,
    }
}

/// The reasons by node, as inserting them one by one in candidate order would leave them (a
/// node named twice keeps its last reason), built in one pass: the candidates usually come
/// sorted, and a map built from a sorted list costs no comparisons beyond the sort's check.
fn failure_map(mut failed: Vec<(&str, NodeFailure)>) -> BTreeMap<String, NodeFailure> {
    // Stable: equal names stay in candidate order; of those the last reason is kept.
    failed.sort_by(|a, b| a.0.cmp(b.0));
    failed.dedup_by(|later, kept| {
        let same = later.0 == kept.0;
        if same {
            std::mem::swap(&mut later.1, &mut kept.1);
        }
        same
    });
    // Sorted and without duplicates: the map is built in one pass.
    failed
        .into_iter()
        .map(|(name, why)| (name.to_owned(), why))
        .collect()
}

/// How many distinct nodes failed, without building their reasons.
fn distinct_names(failed: Vec<(&str, NodeFailure)>) -> usize {
    let mut names: Vec<&str> = failed.into_iter().map(|(name, _)| name).collect();
    names.sort_unstable();
    names.dedup();
    names.len()
}

/// The reservation that records `placement` for `pod` in the overlay.
pub fn reservation_for(pod: &Pod, uid: &str, placement: &Placement, tick: u64) -> Reservation {
    let init_count = podspec::init_container_count(pod);
    let nvidia = placement.devices.of_vendor(hami_contract::NVIDIA_VENDOR);
    Reservation {
        uid: uid.to_owned(),
        namespace: pod
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".to_owned()),
        name: pod.metadata.name.clone().unwrap_or_default(),
        node: placement.node.clone(),
        usage: hami_contract::usage::collapse_pod_usage(&nvidia, init_count, false),
        devices: placement.devices.clone(),
        signature: placement.signature.clone(),
        mig: placement.mig.clone(),
        stage: BindStage::Decided,
        created_tick: tick,
    }
}

/// HAMi's per-reason summary for the `FilteringFailed` event:
/// `<count> nodes <Reason>(<n1,n2>)` per reason, `; `-joined.
pub fn failure_summary(failed: &BTreeMap<String, NodeFailure>) -> String {
    if failed.is_empty() {
        return "no available node, 0 nodes do not meet".to_owned();
    }
    let mut by_reason: BTreeMap<String, Vec<&str>> = BTreeMap::new();
    for (node, reason) in failed {
        // From the rendered reason, as HAMi does from its string: a reason text (an
        // unregistered node's) may itself hold `, ` or `:`.
        let reason = reason.to_string();
        for part in reason.split(", ") {
            let key = part
                .split_once(' ')
                .filter(|(n, _)| n.contains('/'))
                .map_or(part, |(_, r)| r);
            let key = key.split(':').next().unwrap_or(key).to_owned();
            by_reason.entry(key).or_default().push(node);
        }
    }
    by_reason
        .iter()
        .map(|(r, nodes)| format!("{} nodes {r}({})", nodes.len(), nodes.join(",")))
        .collect::<Vec<_>>()
        .join("; ")
}

/// Why a pod that fits nowhere waits, in one word, for the pending-pods gauge: the reason that
/// refused the most candidate nodes (per node, the reason that refused the most of its devices),
/// ties to the first in [`fit::FitReason`]'s order. `NoCandidateNodes` when kube-scheduler
/// offered none (its own filters took them all).
pub fn pending_reason(failed: &BTreeMap<String, NodeFailure>) -> &'static str {
    use fit::{FitFailure, FitReason};
    let mut votes: BTreeMap<(usize, &'static str), usize> = BTreeMap::new();
    for failure in failed.values() {
        let (rank, reason) = match failure {
            NodeFailure::Fit(FitFailure::NodeInsufficientDevice) => (
                FitReason::NodeInsufficientDevice as usize,
                FitReason::NodeInsufficientDevice.as_str(),
            ),
            NodeFailure::Fit(FitFailure::Devices(counts)) => counts
                .reasons()
                .max_by(|(ra, a), (rb, b)| a.cmp(b).then(rb.cmp(ra)))
                .map_or((usize::MAX, "NoDevice"), |(r, _)| (r as usize, r.as_str())),
            NodeFailure::Fit(FitFailure::MigAllocation { .. }) => (
                FitReason::CardMigTopologyInfeasible as usize,
                FitReason::CardMigTopologyInfeasible.as_str(),
            ),
            NodeFailure::Unknown | NodeFailure::Unregistered(_) => {
                (FitReason::COUNT, "NodeUnregistered")
            }
            NodeFailure::PendingConflict { .. } => (FitReason::COUNT + 1, PENDING_CONFLICT),
        };
        *votes.entry((rank, reason)).or_default() += 1;
    }
    votes
        .into_iter()
        .max_by(|((ra, _), a), ((rb, _), b)| a.cmp(b).then(rb.cmp(ra)))
        .map_or("NoCandidateNodes", |((_, reason), _)| reason)
}

/// HAMi's `FilteringSucceed` message.
pub fn success_summary(p: &Placement) -> String {
    use std::fmt::Write as _;
    // Built in one buffer: this runs on the response path of every successful filter, with one
    // entry per fitting node. Many nodes share a score, so the formatted score of the previous
    // entry is reused when the value is the same (float formatting dominates otherwise).
    let mut fits = String::with_capacity(p.fitting.len() * 24);
    let mut last: Option<(u32, String)> = None;
    for (i, (n, s)) in p.fitting.iter().enumerate() {
        if i > 0 {
            fits.push(',');
        }
        fits.push_str(n);
        fits.push(':');
        match &last {
            Some((bits, text)) if *bits == s.to_bits() => fits.push_str(text),
            _ => {
                let text = format!("{s:.2}");
                fits.push_str(&text);
                last = Some((s.to_bits(), text));
            }
        }
    }
    let mut out = String::with_capacity(fits.len() + 96);
    let _ = write!(
        out,
        "find fit node({}), {} nodes not fit, {} nodes fit({fits})",
        p.node,
        p.failed_count,
        p.fitting.len()
    );
    out
}

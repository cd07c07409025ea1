//! GPU-aware preemption: the extender's `preemptVerb` as a function of the cluster state.
//!
//! kube-scheduler's dry run proposes, per candidate node, the victims its own filters need
//! (they free CPU and memory; with the GPU resources `ignoredByScheduler` they never free a GPU).
//! For each node this module keeps those, then looks for the cheapest set of lower-priority GPU
//! pods whose removal lets the pod fit under the real fit (memory, cores, slots, exclusivity,
//! type/UUID/NUMA/topology, MIG instances, the namespace budget): one option per GPU (the
//! lower-priority pods holding a slice of it) and one for the whole node (every lower-priority
//! pod there, for pods asking several GPUs). Each option is made minimal the way
//! kube-scheduler's `SelectVictimsOnNode` does it: victims are put back one by one (those whose
//! eviction would violate a PodDisruptionBudget first, then by decreasing importance) and stay
//! put back while the pod still fits. Options compare by kube-scheduler's own node ranking
//! (fewest PDB violations, lowest highest victim priority, lowest priority sum, fewest victims),
//! so the node kube-scheduler then picks gets the slice it needs and nothing more.
//!
//! Pure: the caller passes the state, the proposal and the PodDisruptionBudgets.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;

use crate::config::DecisionConfig;
use crate::fit::{self, QuotaBudget};
use crate::podspec;
use crate::state::{BoundGpuPod, Candidate, ClusterState, Standing};

/// kube-scheduler's victims for one node (`MetaVictims`): pod UIDs and how many PDBs their
/// eviction violates.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Victims {
    pub pods: Vec<String>,
    pub pdb_violations: i64,
}

/// A PodDisruptionBudget as preemption reads it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Budget {
    pub namespace: String,
    /// `status.disruptionsAllowed`.
    pub allowed: i32,
    /// UIDs of the pods whose eviction it counts: those its selector selects (listed from the
    /// API server by the caller; a budget with an empty or invalid selector selects none, as
    /// kube-scheduler reads it) less those in `status.disruptedPods` (being evicted already).
    pub counted: BTreeSet<String>,
}

impl Budget {
    /// The budget `pdb` with the pods its selector selects, as (name, UID).
    pub fn from_pdb(
        pdb: &PodDisruptionBudget,
        selected: impl IntoIterator<Item = (String, String)>,
    ) -> Self {
        let status = pdb.status.as_ref();
        let disrupted = status.and_then(|s| s.disrupted_pods.as_ref());
        Budget {
            namespace: pdb.metadata.namespace.clone().unwrap_or_default(),
            allowed: status.map_or(0, |s| s.disruptions_allowed),
            counted: selected
                .into_iter()
                .filter(|(name, _)| disrupted.is_none_or(|d| !d.contains_key(name)))
                .map(|(_, uid)| uid)
                .collect(),
        }
    }

    /// Whether the budget counts the eviction of pod `uid`.
    fn counts(&self, uid: &str) -> bool {
        self.counted.contains(uid)
    }
}

/// The namespaces of the pods preemption could name as victims for `pod` on the nodes of
/// `proposed`: the PodDisruptionBudgets that can matter are in these.
pub fn victim_namespaces(
    state: &ClusterState,
    pod: &Pod,
    proposed: &BTreeMap<String, Victims>,
) -> BTreeSet<String> {
    let priority = pod.spec.as_ref().and_then(|s| s.priority).unwrap_or(0);
    proposed
        .keys()
        .flat_map(|node| state.victims_on(node))
        .filter(|v| v.standing.priority < priority)
        .map(|v| v.namespace.to_owned())
        .collect()
}

/// A node's answer: the victims to evict and what their eviction frees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeVictims {
    /// kube-scheduler's victims and the GPU pods added, most important first.
    pub pods: Vec<String>,
    pub pdb_violations: i64,
    /// The GPUs whose tenants are evicted (UUIDs, sorted): what Events name.
    pub gpus: Vec<String>,
    /// The GPU pods evicted, as `namespace/name (priority p)`, most important first.
    pub evicted: Vec<String>,
}

impl NodeVictims {
    /// What evicting these victims does, for Events and `simulate`.
    pub fn what_it_frees(&self) -> String {
        let chosen_by_scheduler = self.pods.len() - self.evicted.len();
        let gpu = format!(
            "evicting {} frees {}",
            self.evicted.join(", "),
            self.gpus.join(", ")
        );
        match (self.gpus.is_empty(), chosen_by_scheduler) {
            (true, _) => "kube-scheduler's own victims also free the GPU slice".to_owned(),
            (false, 0) => gpu,
            (false, n) => format!("{gpu} (with {n} pod(s) kube-scheduler chose)"),
        }
    }
}

/// Why preemption cannot help the pod on a node.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NoVictims {
    #[error("the pod asks for no GPU")]
    NotGpu,
    #[error("node unregistered")]
    Unknown,
    #[error("the pod does not fit even with every lower-priority GPU pod here evicted: {0}")]
    DoesNotFit(String),
    #[error("the pod fits without evicting any GPU pod")]
    AlreadyFits,
}

/// One lower-priority GPU pod that could be evicted from a node.
#[derive(Debug, Clone)]
struct Victim<'a> {
    pod: BoundGpuPod<'a>,
    /// Whether its eviction would violate a PodDisruptionBudget (in the reprieve order).
    violates: bool,
}

/// kube-scheduler's `MoreImportantPod`: higher priority, then the earlier start.
fn more_important(a: &Standing, b: &Standing) -> std::cmp::Ordering {
    b.priority.cmp(&a.priority).then_with(|| {
        // A pod not started yet counts as started now, after every started one.
        a.started
            .unwrap_or(i64::MAX)
            .cmp(&b.started.unwrap_or(i64::MAX))
    })
}

/// What one pod's preemption reads: the pod's ask and options and the cluster's budgets.
struct Preemptor<'a> {
    state: &'a ClusterState,
    ask: fit::PodAsk,
    opts: fit::PlacementOptions,
    uid: &'a str,
    namespace: String,
    priority: i32,
    quota: Option<QuotaBudget>,
    /// The node the pod's own earlier decision books, if any.
    uid_on: Option<&'a str>,
    /// The pod asks for one GPU in all: the tenants of one GPU are all it can need evicted.
    single_gpu: bool,
}

/// The victims on each node of `proposed` (kube-scheduler's candidates with its own victims)
/// that let `pod` fit; nodes where preemption cannot help are left out, with why. The pod's own
/// earlier decision does not count against it.
pub fn preempt(
    state: &mut ClusterState,
    cfg: &DecisionConfig,
    pod: &Pod,
    uid: &str,
    proposed: &BTreeMap<String, Victims>,
    budgets: &[Budget],
) -> (BTreeMap<String, NodeVictims>, BTreeMap<String, NoVictims>) {
    let mut chosen = BTreeMap::new();
    let mut refused = BTreeMap::new();
    let (ask, _warnings) = podspec::pod_ask(pod, &cfg.nvidia);
    if ask.is_empty() {
        for name in proposed.keys() {
            refused.insert(name.clone(), NoVictims::NotGpu);
        }
        return (chosen, refused);
    }
    let annotations = pod.metadata.annotations.clone().unwrap_or_default();
    let opts = match podspec::placement_options(&annotations, &cfg.defaults) {
        Ok(o) => o,
        Err(e) => {
            for name in proposed.keys() {
                refused.insert(name.clone(), NoVictims::DoesNotFit(e.to_string()));
            }
            return (chosen, refused);
        }
    };
    state.prepare();
    let state = &*state;
    let namespace = pod
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    let single_gpu = ask.app.iter().flatten().map(|r| r.nums).sum::<u32>() <= 1
        && ask.init.iter().flatten().all(|r| r.nums <= 1);
    let preemptor = Preemptor {
        state,
        single_gpu,
        quota: state.quota_budget(&namespace, Some(uid)),
        uid_on: state.effective_node(uid),
        ask,
        opts,
        uid,
        namespace,
        priority: pod.spec.as_ref().and_then(|s| s.priority).unwrap_or(0),
    };
    for (name, kept) in proposed {
        match preemptor.on_node(name, kept, budgets) {
            Ok(v) => {
                chosen.insert(name.clone(), v);
            }
            Err(why) => {
                refused.insert(name.clone(), why);
            }
        }
    }
    (chosen, refused)
}

/// kube-scheduler's ranking of a node's victims (`pickOneNodeForPreemption`), smaller first:
/// PDB violations, the highest victim priority, the sum of priorities, the number of victims.
fn cost(v: &[&Victim<'_>], kept_violations: i64) -> (i64, i64, i64, usize) {
    let violations = kept_violations + v.iter().filter(|c| c.violates).count() as i64;
    let highest = v
        .iter()
        .map(|c| i64::from(c.pod.standing.priority))
        .max()
        .unwrap_or(i64::MIN);
    // As kube-scheduler sums them: each shifted by MaxInt32 + 1, so a victim always adds.
    let sum = v
        .iter()
        .map(|c| i64::from(c.pod.standing.priority) + i64::from(i32::MAX) + 1)
        .sum();
    (violations, highest, sum, v.len())
}

/// A lower bound of [`cost`] for any non-empty subset of `option`: no PDB violation beyond
/// kube-scheduler's own (`kept_violations`), one victim of the lowest priority there.
fn least_cost(option: &[&Victim<'_>], kept_violations: i64) -> (i64, i64, i64, usize) {
    let lowest = option
        .iter()
        .map(|c| i64::from(c.pod.standing.priority))
        .min()
        .unwrap_or(i64::MAX);
    (kept_violations, lowest, lowest + i64::from(i32::MAX) + 1, 1)
}

impl Preemptor<'_> {
    fn on_node(
        &self,
        name: &str,
        kept: &Victims,
        budgets: &[Budget],
    ) -> Result<NodeVictims, NoVictims> {
        let state = self.state;
        if state.node(name).is_none_or(|n| n.unregistered.is_some()) {
            return Err(NoVictims::Unknown);
        }
        let kept_set: BTreeSet<&str> = kept.pods.iter().map(String::as_str).collect();
        // kube-scheduler's victims that hold GPU slices here, and the lower-priority GPU pods
        // it left.
        let (kept_pods, mut victims): (Vec<BoundGpuPod<'_>>, Vec<BoundGpuPod<'_>>) = state
            .victims_on(name)
            .into_iter()
            .filter(|v| v.uid != self.uid)
            .partition(|v| kept_set.contains(v.uid));
        victims.retain(|v| v.standing.priority < self.priority);
        let mut candidates: Vec<Victim<'_>> = victims
            .into_iter()
            .map(|pod| Victim {
                pod,
                violates: false,
            })
            .collect();
        // kube-scheduler's `filterPodsWithPDBViolation`, in importance order, each budget's
        // allowance used up by the victims before it; kube-scheduler's own victims (counted in
        // its `NumPDBViolations`) use it first, whatever they are, since they go anyway.
        candidates.sort_by(|a, b| more_important(&a.pod.standing, &b.pod.standing));
        let mut allowed: Vec<i32> = budgets
            .iter()
            .map(|b| {
                let used = kept.pods.iter().filter(|uid| b.counts(uid)).count();
                b.allowed
                    .saturating_sub(i32::try_from(used).unwrap_or(i32::MAX))
            })
            .collect();
        for c in &mut candidates {
            for (i, b) in budgets.iter().enumerate() {
                if b.counts(c.pod.uid) {
                    allowed[i] -= 1;
                    c.violates |= allowed[i] < 0;
                }
            }
        }
        // The reprieve order: violating victims first, each group by importance.
        candidates.sort_by(|a, b| {
            b.violates
                .cmp(&a.violates)
                .then_with(|| more_important(&a.pod.standing, &b.pod.standing))
        });
        let Some(mut node) = NodeUnderTest::new(self, name, &kept_set, &kept_pods) else {
            return Err(NoVictims::Unknown);
        };
        if node.fits(self, &[]) {
            // kube-scheduler's own victims make room for the GPU part too.
            return if kept.pods.is_empty() {
                Err(NoVictims::AlreadyFits)
            } else {
                Ok(NodeVictims {
                    pods: kept.pods.clone(),
                    pdb_violations: kept.pdb_violations,
                    gpus: Vec::new(),
                    evicted: Vec::new(),
                })
            };
        }
        let all: Vec<&Victim<'_>> = candidates.iter().collect();
        if let Err(why) = node.fit(self, &all) {
            return Err(NoVictims::DoesNotFit(why.to_string()));
        }
        // One option per GPU that has lower-priority tenants; the whole node when the pod asks
        // for more than one GPU or no single GPU's tenants make room (a namespace budget, say).
        let gpus: BTreeSet<&str> = candidates.iter().flat_map(|c| c.pod.gpus()).collect();
        let mut options: Vec<Vec<&Victim<'_>>> = gpus
            .iter()
            .map(|g| candidates.iter().filter(|c| c.pod.holds(g)).collect())
            .collect();
        // Cheapest-looking first: then most options cost no fit at all (`consider`).
        options.sort_by_key(|o| least_cost(o, 0));
        let mut best: Option<Vec<&Victim<'_>>> = None;
        let mut some_gpu_fits = false;
        for option in options {
            some_gpu_fits |= node.consider(self, option, &mut best, kept.pdb_violations);
        }
        if !self.single_gpu || !some_gpu_fits {
            node.consider(self, all, &mut best, kept.pdb_violations);
        }
        // The whole node fits (checked above), so some option does.
        let mut chosen = best.unwrap_or_default();
        chosen.sort_by(|a, b| more_important(&a.pod.standing, &b.pod.standing));
        let freed: BTreeSet<&str> = chosen.iter().flat_map(|c| c.pod.gpus()).collect();
        let pdb_violations =
            kept.pdb_violations + chosen.iter().filter(|c| c.violates).count() as i64;
        let mut pods = kept.pods.clone();
        pods.extend(chosen.iter().map(|c| c.pod.uid.to_owned()));
        Ok(NodeVictims {
            pods,
            pdb_violations,
            gpus: freed.into_iter().map(str::to_owned).collect(),
            evicted: chosen
                .iter()
                .map(|c| {
                    format!(
                        "{}/{} (priority {})",
                        c.pod.namespace, c.pod.name, c.pod.standing.priority
                    )
                })
                .collect(),
        })
    }

    /// The namespace budget with what `victims` (and kube-scheduler's own victims) of the pod's
    /// namespace use given back.
    fn quota_without(&self, kept: &BTreeSet<&str>, victims: &[&Victim<'_>]) -> Option<QuotaBudget> {
        self.quota.map(|mut q| {
            let freed = victims
                .iter()
                .filter(|v| v.pod.namespace == self.namespace)
                .map(|v| v.pod.charge)
                .chain(
                    kept.iter()
                        .filter_map(|uid| self.state.charge_in(uid, &self.namespace)),
                );
            freed.for_each(|c| q.give_back(c));
            q
        })
    }
}

/// Takes a pod's usage off the node's GPUs (what its eviction frees).
fn unbook(node: &mut fit::NodeState, usage: &[(&str, u32, u32, u32)]) {
    for &(uuid, slots, mem, cores) in usage {
        node.unbook_usage(uuid, slots, mem, cores);
    }
}

/// One candidate node while its victims are chosen: its state without the pod's own decision
/// and kube-scheduler's victims, built once from the filter's cached state; each fit takes the
/// victims' usage off the GPUs and puts it back. A node with `mig` GPUs is rebuilt for each fit
/// instead (its instances follow the bookings in ways taking usage off does not model).
struct NodeUnderTest<'k> {
    name: String,
    kept: &'k BTreeSet<&'k str>,
    state: fit::NodeState,
    nvidia: Vec<bool>,
    mig: bool,
}

impl<'k> NodeUnderTest<'k> {
    fn new(
        p: &Preemptor<'_>,
        name: &str,
        kept: &'k BTreeSet<&'k str>,
        kept_pods: &[BoundGpuPod<'_>],
    ) -> Option<Self> {
        let Some(Candidate::Usable(cached, nvidia, _)) = p.state.candidate(name, p.uid, p.uid_on)
        else {
            return None;
        };
        let mig = cached.gpus.iter().any(|g| g.mode == fit::MIG_MODE);
        let nvidia = nvidia.to_vec();
        let mut state = cached.into_owned();
        // (A `mig` node is rebuilt from the books for each fit; its state is not read.)
        if !mig {
            for k in kept_pods {
                unbook(&mut state, &k.usage);
            }
        }
        Some(NodeUnderTest {
            name: name.to_owned(),
            kept,
            state,
            nvidia,
            mig,
        })
    }

    fn fits(&mut self, p: &Preemptor<'_>, victims: &[&Victim<'_>]) -> bool {
        self.fit(p, victims).is_ok()
    }

    /// The real fit with `victims` gone.
    fn fit(&mut self, p: &Preemptor<'_>, victims: &[&Victim<'_>]) -> Result<(), fit::FitFailure> {
        let quota = p.quota_without(self.kept, victims);
        if self.mig {
            let kept = self.kept;
            let gone = |uid: &str| {
                uid == p.uid || kept.contains(uid) || victims.iter().any(|v| v.pod.uid == uid)
            };
            let Some(node) = p.state.node_without(&self.name, gone) else {
                return Err(fit::FitFailure::NodeInsufficientDevice);
            };
            return fit::evaluate_picks(&node, Some(&self.nvidia), &p.ask, &p.opts, quota.as_ref())
                .map(|_| ());
        }
        let saved: Vec<(u32, u32, u32)> = self
            .state
            .gpus
            .iter()
            .map(|g| (g.used, g.usedmem, g.usedcores))
            .collect();
        for v in victims {
            unbook(&mut self.state, &v.pod.usage);
        }
        let out = fit::evaluate_picks(
            &self.state,
            Some(&self.nvidia),
            &p.ask,
            &p.opts,
            quota.as_ref(),
        )
        .map(|_| ());
        for (g, (used, mem, cores)) in self.state.gpus.iter_mut().zip(saved) {
            g.used = used;
            g.usedmem = mem;
            g.usedcores = cores;
        }
        out
    }

    /// If the pod fits with `option` gone: `option` made minimal, kept in `best` when it costs
    /// less than what is there.
    fn consider<'c, 'v>(
        &mut self,
        p: &Preemptor<'_>,
        option: Vec<&'c Victim<'v>>,
        best: &mut Option<Vec<&'c Victim<'v>>>,
        kept_violations: i64,
    ) -> bool {
        // No subset of `option` can cost less than this: an option that cannot beat the best
        // so far needs no fit (counted as fitting: it is no reason to try the whole node).
        if best
            .as_ref()
            .is_some_and(|b| least_cost(&option, kept_violations) >= cost(b, kept_violations))
        {
            return true;
        }
        if !self.fits(p, &option) {
            return false;
        }
        let minimal = self.reprieve(p, option);
        if best
            .as_ref()
            .is_none_or(|b| cost(&minimal, kept_violations) < cost(b, kept_violations))
        {
            *best = Some(minimal);
        }
        true
    }

    /// Puts victims back one by one, in the order given, while the pod still fits.
    fn reprieve<'c, 'v>(
        &mut self,
        p: &Preemptor<'_>,
        option: Vec<&'c Victim<'v>>,
    ) -> Vec<&'c Victim<'v>> {
        let mut victims = option;
        let mut i = 0;
        while i < victims.len() {
            let mut without = victims.clone();
            without.remove(i);
            if self.fits(p, &without) {
                victims = without;
            } else {
                i += 1;
            }
        }
        victims
    }
}

/// The Event message on the preemptor: the cheapest node's slice and what evicting frees, or why
/// preemption helps nowhere; `None` when no node was proposed.
pub fn describe(
    chosen: &BTreeMap<String, NodeVictims>,
    refused: &BTreeMap<String, NoVictims>,
) -> Option<String> {
    let helped: Vec<(&String, &NodeVictims)> =
        chosen.iter().filter(|(_, v)| !v.pods.is_empty()).collect();
    let cheapest = helped
        .iter()
        .min_by_key(|(_, v)| (v.pdb_violations, v.pods.len()));
    match cheapest {
        Some((node, v)) => Some(format!(
            "GPU preemption can help on {} node(s); on {node}: {}",
            helped.len(),
            v.what_it_frees()
        )),
        None => {
            let (node, why) = refused.iter().next()?;
            Some(format!(
                "GPU preemption cannot help on {} node(s); {node}: {why}",
                refused.len()
            ))
        }
    }
}

//! Tries to break allocation identity: ≥ 20 pods with different requests bound to one node,
//! admitted by a simulated kubelet in creation, reverse and random order. Every container must
//! get exactly its own limits (and, where the plugin can know, its own GPUs), or a clean
//! failure after which the pod's owner recreates it — never another pod's limits.

use std::collections::{BTreeMap, BTreeSet};

use hami_contract::annotations as keys;
use hami_contract::devices::{ContainerDevice, PodDevices};
use hami_contract::identity::AllocationSignature;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tessera_node::allocator::empty_entries;
use tessera_node::cached_identity::{CacheCall, PodReader, choose_from_cache};
use tessera_node::identity::{
    BookingPolicy, CallFacts, ChoiceReason, ContainerSpec, Ledger, PodResourcesView, PodSnapshot,
    likely_admitting, pending_pods, select,
};

const NODE: &str = "node-a";
const GPUS: [&str; 4] = ["GPU-0", "GPU-1", "GPU-2", "GPU-3"];

/// A pod spec: per GPU container (kubelet order), its devices' (mem, cores); `init` = how many of
/// those are regular init containers.
#[derive(Clone, Debug)]
struct Spec {
    containers: Vec<Vec<(u32, u32)>>,
    init: usize,
}

fn specs() -> Vec<Spec> {
    let mut v = Vec::new();
    // 12 single-container, single-GPU pods, all with different limits.
    for i in 0..12u32 {
        v.push(Spec {
            containers: vec![vec![(1000 + 100 * i, 10 + i)]],
            init: 0,
        });
    }
    // 4 two-GPU pods.
    for i in 0..4u32 {
        v.push(Spec {
            containers: vec![vec![(2000 + i, 20), (2000 + i, 20)]],
            init: 0,
        });
    }
    // 3 two-container pods (1 GPU each), one with a GPU init container.
    v.push(Spec {
        containers: vec![vec![(500, 5)], vec![(600, 6)]],
        init: 0,
    });
    v.push(Spec {
        containers: vec![vec![(700, 7)], vec![(800, 8), (800, 8)]],
        init: 0,
    });
    v.push(Spec {
        containers: vec![vec![(900, 9)], vec![(950, 9)]],
        init: 1,
    });
    // An interchangeable class of 4 identical pods.
    for _ in 0..4 {
        v.push(Spec {
            containers: vec![vec![(3000, 30)]],
            init: 0,
        });
    }
    v
}

#[derive(Clone, Debug, PartialEq)]
enum Phase {
    Waiting,
    Bound,
    Admitted,
    /// A restarted kubelet admits the pod again; its allocation survived only for the GPU
    /// containers before this one (the kubelet checkpoints after each container).
    Readmit(usize),
    Failed,
    /// Failed, then deleted so that its replacement could take its name (a StatefulSet's).
    Deleted,
}

#[derive(Clone, Debug)]
struct SimPod {
    spec_index: usize,
    snapshot: PodSnapshot,
    planned: PodDevices,
    phase: Phase,
    /// Replica IDs the kubelet recorded per container name.
    recorded: BTreeMap<String, Vec<String>>,
    signature: AllocationSignature,
    creation: usize,
    /// The kubelet started the pod's containers (their statuses say running).
    running: bool,
}

struct Sim {
    pods: Vec<SimPod>,
    ledger: Ledger,
    rng: StdRng,
    next_uid: usize,
    next_gpu: usize,
    pod_resources: bool,
    scheduler_rule: bool,
    failures: usize,
    class_swaps: usize,
    /// Calls served to a pod the kubelet asked for again after a restart.
    reasks: usize,
    kubelet_generation: u64,
    /// After a restart the kubelet gets every pod bound to it in one batch and admits that
    /// batch in creation order before anything bound later.
    restart_batch: std::collections::VecDeque<usize>,
    /// The kubelet now and then rejects a bound pod before any `Allocate` (another admit
    /// handler, or no healthy devices while the plugin restarts); its owner recreates it.
    rejects_before_allocate: bool,
    /// The plugin answers from an informer cache that lags by up to [`CACHE_LAG`] calls,
    /// completed and confirmed by reads by name (`cached_identity`), on a 1.34 kubelet.
    lagging_cache: bool,
    /// The node's pods as the API server had them at each call (the cache's possible states:
    /// one watch stream, so always a consistent past state).
    history: std::collections::VecDeque<Vec<PodSnapshot>>,
    /// Calls answered from the cache without a LIST, of all `calls`.
    from_cache: usize,
    calls: usize,
    /// A rejected pod is deleted and its replacement takes its name, as a StatefulSet's does.
    reuse_names: bool,
    /// The plugin's record of a pod's last entry, on a call the cache decided, lands after the
    /// answer (`Allocator::build_and_record`): (pod UID, entries served). Applied a random
    /// number of calls later, or lost when the plugin restarts.
    records_in_flight: Vec<(String, BTreeSet<usize>)>,
    /// The plugin restarts (a new ledger, records in flight lost) before every n-th call.
    plugin_restart_every: Option<usize>,
    plugin_restarts: usize,
    /// Calls whose cache held a GPU-less predecessor of a listed GPU pod's name.
    gpu_less_predecessors: usize,
}

/// A running GPU-less pod on the simulated node, in the simulated pods' namespace.
fn gpu_less_pod(name: &str, uid: &str) -> PodSnapshot {
    tessera_node::testing::gpu_less_pod(NODE, "ns", name, uid)
}

/// Calls by which the simulated informer cache may lag the API server.
const CACHE_LAG: usize = 6;

/// Reads by name from the API server's current state.
struct CurrentPods<'a>(&'a [PodSnapshot]);

impl PodReader for CurrentPods<'_> {
    type Error = std::convert::Infallible;
    fn read(
        &self,
        namespace: &str,
        name: &str,
    ) -> impl std::future::Future<Output = Result<Option<PodSnapshot>, Self::Error>> + Send {
        let pod = self
            .0
            .iter()
            .find(|p| p.namespace == namespace && p.name == name)
            .cloned();
        std::future::ready(Ok(pod))
    }
}

fn container_names(spec: &Spec) -> (Vec<ContainerSpec>, Vec<ContainerSpec>) {
    let mut init = Vec::new();
    let mut app = Vec::new();
    for (i, _) in spec.containers.iter().enumerate() {
        let c = ContainerSpec {
            name: format!("c{i}"),
            requests_resource: true,
            restartable_init: false,
            disable_control: false,
        };
        if i < spec.init {
            init.push(c)
        } else {
            app.push(c)
        }
    }
    // A GPU-less app container in every pod: aligned annotations carry an empty entry for it.
    app.push(ContainerSpec {
        name: "sidecar".into(),
        requests_resource: false,
        restartable_init: false,
        disable_control: false,
    });
    (init, app)
}

impl Sim {
    fn new(seed: u64, pod_resources: bool, scheduler_rule: bool) -> Self {
        let mut sim = Sim {
            pods: Vec::new(),
            ledger: Ledger::default(),
            rng: StdRng::seed_from_u64(seed),
            next_uid: 0,
            next_gpu: 0,
            pod_resources,
            scheduler_rule,
            failures: 0,
            class_swaps: 0,
            reasks: 0,
            kubelet_generation: 0,
            restart_batch: Default::default(),
            rejects_before_allocate: false,
            lagging_cache: false,
            history: Default::default(),
            from_cache: 0,
            calls: 0,
            reuse_names: false,
            records_in_flight: Vec::new(),
            plugin_restart_every: None,
            plugin_restarts: 0,
            gpu_less_predecessors: 0,
        };
        for (i, _) in specs().iter().enumerate() {
            sim.create(i);
        }
        sim
    }

    fn create(&mut self, spec_index: usize) {
        let spec = specs()[spec_index].clone();
        let (init, app) = container_names(&spec);
        let mut entries = Vec::new();
        for c in &spec.containers {
            entries.push(
                c.iter()
                    .map(|(mem, cores)| {
                        self.next_gpu += 1;
                        ContainerDevice {
                            uuid: GPUS[self.next_gpu % GPUS.len()].into(),
                            vendor: "NVIDIA".into(),
                            usedmem: *mem,
                            usedcores: *cores,
                        }
                    })
                    .collect(),
            );
        }
        entries.push(Vec::new()); // the GPU-less sidecar
        let planned = PodDevices(entries);
        let uid = format!("uid-{}", self.next_uid);
        self.next_uid += 1;
        let snapshot = PodSnapshot {
            namespace: "ns".into(),
            name: format!("pod-{spec_index}-{uid}"),
            uid,
            node_name: None,
            scheduler_name: Some("hami-scheduler".into()),
            annotations: BTreeMap::new(),
            terminal: false,
            deleting: false,
            init_containers: init,
            containers: app,
            started_containers: BTreeSet::new(),
            container_ids: Default::default(),
            resource_version: String::new(),
        };
        let signature = AllocationSignature::new(&planned, &BTreeMap::new());
        let creation = self.pods.len();
        self.pods.push(SimPod {
            spec_index,
            snapshot,
            planned,
            phase: Phase::Waiting,
            recorded: BTreeMap::new(),
            signature,
            creation,
            running: false,
        });
    }

    fn pending_on_node(&self) -> Vec<usize> {
        (0..self.pods.len())
            .filter(|i| matches!(self.pods[*i].phase, Phase::Bound | Phase::Readmit(_)))
            .filter(|i| {
                self.pods[*i]
                    .snapshot
                    .annotations
                    .get(keys::BIND_PHASE)
                    .map(String::as_str)
                    == Some(keys::BIND_PHASE_ALLOCATING)
            })
            .collect()
    }

    /// The extender: bind waiting pods in creation order unless the rule forbids it.
    fn extender_binds(&mut self) {
        for i in 0..self.pods.len() {
            if self.pods[i].phase != Phase::Waiting {
                continue;
            }
            if self.scheduler_rule {
                let blocked = self.pending_on_node().iter().any(|&q| {
                    let (a, b) = (&self.pods[i].signature, &self.pods[q].signature);
                    a.confusable_with(b) && !a.interchangeable_with(b)
                });
                if blocked {
                    continue;
                }
            }
            let p = &mut self.pods[i];
            let value = p.planned.encode();
            let a = &mut p.snapshot.annotations;
            a.insert(keys::VGPU_NODE.into(), NODE.into());
            a.insert(keys::DEVICES_TO_ALLOCATE.into(), value.clone());
            a.insert(keys::DEVICES_ALLOCATED.into(), value);
            a.insert(keys::BIND_PHASE.into(), keys::BIND_PHASE_ALLOCATING.into());
            a.insert(
                keys::BIND_TIME.into(),
                (1_700_000_000 + p.creation).to_string(),
            );
            p.snapshot.node_name = Some(NODE.into());
            p.phase = Phase::Bound;
        }
    }

    /// The plugin's record of pod `uid`: `served` entries emptied; `success` when `done`.
    fn write_record(&mut self, uid: &str, served: &BTreeSet<usize>, done: bool) {
        let Some(pod) = self.pods.iter_mut().find(|p| p.snapshot.uid == uid) else {
            return;
        };
        let a = &mut pod.snapshot.annotations;
        let Some(current) = a.get(keys::DEVICES_TO_ALLOCATE) else {
            return;
        };
        let emptied = empty_entries(current, served).expect("valid");
        a.insert(keys::DEVICES_TO_ALLOCATE.into(), emptied);
        if done {
            a.insert(keys::BIND_PHASE.into(), keys::BIND_PHASE_SUCCESS.into());
        }
    }

    /// Before a call: each record in flight lands with even odds; every n-th call the plugin
    /// restarts first, and the records in flight are lost with its ledger.
    fn land_or_lose_records(&mut self) {
        if let Some(n) = self.plugin_restart_every
            && self.calls % n == n - 1
        {
            self.ledger = Ledger::default();
            self.records_in_flight.clear();
            self.plugin_restarts += 1;
        }
        let records = std::mem::take(&mut self.records_in_flight);
        for (uid, served) in records {
            if self.rng.random_bool(0.5) {
                self.write_record(&uid, &served, true);
            } else {
                self.records_in_flight.push((uid, served));
            }
        }
    }

    /// What the plugin reads for a call: a consistent LIST of the node's pods, issued after the
    /// call began (`Allocator::identify`), so it shows every binding and rejection the kubelet
    /// and the extender acted on.
    fn node_pods(&self) -> Vec<PodSnapshot> {
        self.pods
            .iter()
            .filter(|p| !matches!(p.phase, Phase::Waiting | Phase::Deleted))
            .map(|p| p.snapshot.clone())
            .collect()
    }

    fn view(&self, admitting: usize) -> PodResourcesView {
        let mut view = PodResourcesView::default();
        for (i, p) in self.pods.iter().enumerate() {
            if p.phase == Phase::Admitted || i == admitting {
                let mut containers = BTreeMap::new();
                for c in p.snapshot.containers.iter() {
                    containers.insert(
                        c.name.clone(),
                        p.recorded.get(&c.name).cloned().unwrap_or_default(),
                    );
                }
                view.pods.insert(p.snapshot.key(), containers);
            }
        }
        view
    }

    /// The kubelet admits one pod: one call per GPU container, in kubelet order, from `from` on
    /// (earlier ones are checkpointed); with `kill_after`, the kubelet dies once that container
    /// was served.
    fn admit(&mut self, idx: usize, from: usize, kill_after: Option<usize>) {
        let gpu_containers: Vec<ContainerSpec> = self.pods[idx]
            .snapshot
            .gpu_containers()
            .into_iter()
            .cloned()
            .collect();
        let own: Vec<Vec<ContainerDevice>> = self.pods[idx]
            .planned
            .0
            .iter()
            .filter(|e| !e.is_empty())
            .cloned()
            .collect();
        for (k, container) in gpu_containers.iter().enumerate().skip(from) {
            self.land_or_lose_records();
            let view = self.view(idx);
            let facts = CallFacts {
                count: own[k].len(),
                must_include: false,
                hami_lock: None,
                pod_resources: self.pod_resources.then_some(&view),
            };
            let node_pods = self.node_pods();
            let from_cache = self.answer_from_cache(&view, own[k].len(), &node_pods);
            let cache_decided = from_cache.is_some();
            self.from_cache += usize::from(cache_decided);
            self.calls += 1;
            let result = match from_cache {
                Some(choice) => Ok(choice),
                None => {
                    let (pending, rejected) = pending_pods(NODE, &node_pods, &self.ledger);
                    assert!(rejected.is_empty(), "{rejected:?}");
                    self.ledger.note_consistent_read(&pending);
                    select(facts, &pending, &self.ledger)
                }
            };
            let choice = match result {
                Ok(c) => c,
                Err(_) => {
                    // Fail closed: the kubelet rejects the pod; its owner recreates it.
                    self.ledger.break_run();
                    self.failures += 1;
                    self.rejected_and_recreated(idx);
                    return;
                }
            };
            // The invariant: exactly this container's limits.
            let got: Vec<(u32, u32)> = choice
                .devices
                .iter()
                .map(|d| (d.usedmem, d.usedcores))
                .collect();
            let want: Vec<(u32, u32)> = own[k].iter().map(|d| (d.usedmem, d.usedcores)).collect();
            assert_eq!(
                got,
                want,
                "pod {} container {} got another pod's limits: {} served as {:?} (pod-resources {})",
                self.pods[idx].snapshot.key(),
                container.name,
                choice.name,
                choice.reason,
                self.pod_resources
            );
            if choice.uid == self.pods[idx].snapshot.uid {
                assert_eq!(choice.devices, own[k], "own pod, own GPUs");
                assert_eq!(choice.container.name, container.name);
            } else {
                // Only members of one interchangeable class may be served each other's entry.
                let chosen = self
                    .pods
                    .iter()
                    .find(|p| p.snapshot.uid == choice.uid)
                    .expect("known");
                assert!(
                    chosen
                        .signature
                        .interchangeable_with(&self.pods[idx].signature)
                );
                assert!(
                    !self.pod_resources,
                    "with pod-resources the pod is identified exactly"
                );
                self.class_swaps += 1;
            }
            // The plugin's patch: before the answer, or after it for a run the cache ended.
            let mut served: BTreeSet<usize> =
                self.ledger.served(&choice.uid).cloned().unwrap_or_default();
            served.insert(choice.entry_index);
            // As the allocator: only where the kubelet reports every GPU container.
            let reported_all = self.pods[idx].snapshot.gpu_containers_all_reported();
            if cache_decided && choice.entries_left == 0 && reported_all {
                self.records_in_flight.push((choice.uid.clone(), served));
            } else {
                self.write_record(&choice.uid, &served, choice.entries_left == 0);
            }
            self.ledger.record(&choice);
            if choice.reason == ChoiceReason::Reask {
                self.reasks += 1;
            }
            let ids = (0..own[k].len())
                .map(|j| format!("{}-r{}-{j}", self.pods[idx].snapshot.uid, k))
                .collect();
            self.pods[idx].recorded.insert(container.name.clone(), ids);
            if kill_after == Some(k) {
                return;
            }
        }
        self.pods[idx].phase = Phase::Admitted;
    }

    /// The plugin's answer from a cache `CACHE_LAG` calls behind at most, where the cache may
    /// decide (`Allocator::identify`); `None`: the call is decided on a LIST.
    fn answer_from_cache(
        &mut self,
        view: &PodResourcesView,
        count: usize,
        node_pods: &[PodSnapshot],
    ) -> Option<tessera_node::identity::Choice> {
        if !(self.lagging_cache && self.pod_resources) {
            return None;
        }
        self.history.push_back(node_pods.to_vec());
        if self.history.len() > CACHE_LAG {
            self.history.pop_front();
        }
        let mut cache = self.history[self.rng.random_range(0..self.history.len())].clone();
        // The node's GPU-less pods (DaemonSets): cached, listed without devices, never read.
        let mut view = view.clone();
        let mut current = node_pods.to_vec();
        for i in 0..3 {
            let daemon = gpu_less_pod(&format!("daemon-{i}"), &format!("uid-daemon-{i}"));
            view.pods.insert(
                daemon.key(),
                BTreeMap::from([("main".to_owned(), Vec::new())]),
            );
            cache.push(daemon.clone());
            current.push(daemon);
        }
        // Now and then the cache still holds a GPU-less predecessor of a listed pod's name (the
        // GPU pod took the name since): the pod under admission may hide behind it.
        if self.rng.random_bool(0.3) {
            let listed: Vec<usize> = (0..cache.len())
                .filter(|&i| {
                    view.pods.contains_key(&cache[i].key()) && !cache[i].gpu_containers().is_empty()
                })
                .collect();
            if !listed.is_empty() {
                let i = listed[self.rng.random_range(0..listed.len())];
                let (name, uid) = (cache[i].name.clone(), format!("{}-before", cache[i].uid));
                cache[i] = gpu_less_pod(&name, &uid);
                self.gpu_less_predecessors += 1;
            }
        }
        let policy = BookingPolicy::default();
        let call = CacheCall {
            node: NODE,
            policy: &policy,
            count,
            hami_lock: None,
            pod_resources: Some(&view),
            kubelet_version: Some("v1.34.4"),
        };
        let reader = CurrentPods(&current);
        futures::executor::block_on(choose_from_cache(call, &self.ledger, cache, &reader))
            .ok()
            .map(|found| found.choice)
    }

    /// The kubelet is killed while it admits `idx` (after its container `killed_after`) and comes
    /// back: the plugin registers with the new kubelet, which admits again every pod it had not
    /// started, asking again for the containers whose allocation it had not checkpointed.
    fn kubelet_restart(&mut self, idx: usize, killed_after: usize) {
        self.kubelet_generation += 1;
        self.ledger.set_kubelet(self.kubelet_generation);
        for i in 0..self.pods.len() {
            let served = match (&self.pods[i].phase, i == idx) {
                (_, true) => killed_after + 1,
                (Phase::Admitted, false) if !self.pods[i].running => {
                    self.pods[i].snapshot.gpu_containers().len()
                }
                (Phase::Readmit(k), false) => *k,
                _ => continue,
            };
            let kept = self.rng.random_range(0..=served);
            let names: Vec<String> = self.pods[i]
                .snapshot
                .gpu_containers()
                .iter()
                .skip(kept)
                .map(|c| c.name.clone())
                .collect();
            for name in names {
                self.pods[i].recorded.remove(&name);
            }
            let all = self.pods[i].snapshot.gpu_containers().len();
            self.pods[i].phase = if kept == all {
                Phase::Admitted
            } else {
                Phase::Readmit(kept)
            };
        }
        let mut batch: Vec<usize> = (0..self.pods.len())
            .filter(|i| matches!(self.pods[*i].phase, Phase::Bound | Phase::Readmit(_)))
            .collect();
        batch.sort_by_key(|i| self.pods[*i].creation);
        self.restart_batch = batch.into();
    }

    /// The kubelet rejects pod `idx` (a failed `Allocate`, or before asking for its devices): the
    /// pod turns terminal with its booking still `allocating`, and its owner recreates it. The
    /// extender stops counting it as pending at once, so a confusable pod with other limits may
    /// be bound next.
    fn rejected_and_recreated(&mut self, idx: usize) {
        self.pods[idx].phase = Phase::Failed;
        self.pods[idx].snapshot.terminal = true;
        let spec = self.pods[idx].spec_index;
        self.create(spec);
        if self.reuse_names {
            self.pods[idx].phase = Phase::Deleted;
            let name = self.pods[idx].snapshot.name.clone();
            if let Some(replacement) = self.pods.last_mut() {
                replacement.snapshot.name = name;
            }
        }
    }

    /// Admitted pods start now and then: from then on their containers show as running.
    fn start_some(&mut self) {
        for i in 0..self.pods.len() {
            if self.pods[i].phase == Phase::Admitted
                && !self.pods[i].running
                && self.rng.random_range(0..3) == 0
            {
                let p = &mut self.pods[i];
                p.running = true;
                p.snapshot.started_containers = p
                    .snapshot
                    .init_containers
                    .iter()
                    .chain(p.snapshot.containers.iter())
                    .map(|c| c.name.clone())
                    .collect();
            }
        }
    }

    fn run(&mut self, order: &str) {
        self.run_steps(order, 2_000);
        self.assert_every_spec_admitted(order);
    }

    /// Every spec has an admitted pod (the first one, or its owner's replacement).
    fn assert_every_spec_admitted(&self, order: &str) {
        let admitted: BTreeSet<usize> = self
            .pods
            .iter()
            .filter(|p| p.phase == Phase::Admitted)
            .map(|p| p.spec_index)
            .collect();
        assert_eq!(
            admitted.len(),
            specs().len(),
            "every pod is eventually admitted ({order})"
        );
    }

    fn run_steps(&mut self, order: &str, steps: usize) {
        self.run_with_restarts(order, steps, &[]);
    }

    /// Like `run_steps`, killing the kubelet in the middle of the admission at each step of
    /// `restarts`.
    fn run_with_restarts(&mut self, order: &str, steps: usize, restarts: &[usize]) {
        for step in 0..steps {
            self.extender_binds();
            self.start_some();
            let bound: Vec<usize> = (0..self.pods.len())
                .filter(|i| matches!(self.pods[*i].phase, Phase::Bound | Phase::Readmit(_)))
                .collect();
            if bound.is_empty() {
                break;
            }
            while let Some(front) = self.restart_batch.front()
                && !bound.contains(front)
            {
                self.restart_batch.pop_front();
            }
            let pick = match (self.restart_batch.pop_front(), order) {
                (Some(first), _) => first,
                (None, "creation") => bound[0],
                (None, "reverse") => bound[bound.len() - 1],
                (None, _) => bound[self.rng.random_range(0..bound.len())],
            };
            if self.rejects_before_allocate
                && self.pods[pick].phase == Phase::Bound
                && self.rng.random_range(0..4) == 0
            {
                self.rejected_and_recreated(pick);
                continue;
            }
            let from = match self.pods[pick].phase {
                Phase::Readmit(k) => k,
                _ => 0,
            };
            let gpu_containers = self.pods[pick].snapshot.gpu_containers().len();
            if restarts.contains(&step) && from < gpu_containers {
                let killed_after = self.rng.random_range(from..gpu_containers);
                self.admit(pick, from, Some(killed_after));
                if matches!(self.pods[pick].phase, Phase::Bound | Phase::Readmit(_)) {
                    self.kubelet_restart(pick, killed_after);
                }
            } else {
                self.admit(pick, from, None);
            }
        }
    }
}

#[test]
fn scheduler_rule_without_pod_resources_never_swaps_limits() {
    for order in ["creation", "reverse", "random"] {
        for seed in 0..5 {
            let mut sim = Sim::new(seed, false, true);
            sim.run(order);
            assert_eq!(sim.failures, 0, "the rule leaves no ambiguity ({order})");
        }
    }
}

/// The swap a real node showed (CI, stop 21): a pod the kubelet rejected before any `Allocate`
/// kept its `allocating` booking, the extender bound a confusable pod with other limits, and a
/// plugin answering from a lagging cache served the rejected pod's limits to it. The plugin
/// decides on the API server's current state, so the rejected pod is never a candidate.
#[test]
fn pods_rejected_before_allocate_never_lend_their_limits() {
    let mut rejections = 0;
    for pod_resources in [false, true] {
        for order in ["creation", "reverse", "random"] {
            for seed in 0..5 {
                let mut sim = Sim::new(seed, pod_resources, true);
                sim.rejects_before_allocate = true;
                sim.run(order);
                rejections += sim.pods.iter().filter(|p| p.phase == Phase::Failed).count();
                assert_eq!(sim.failures, 0, "rejections leave no ambiguity ({order})");
            }
        }
    }
    assert!(rejections > 20, "the kubelet rejected pods: {rejections}");
}

/// Issue #29: the plugin answers from an informer cache lagging by several calls in both
/// directions (pods bound, rejected, recreated, started, restarted kubelets it has not seen),
/// completed and confirmed by reads by name; rejected pods are replaced under their own name, so
/// the cache often holds a name's predecessor. The plugin's record of a run the cache ended
/// lands calls after the answer, and the plugin restarts now and then, losing the records in
/// flight. Every container still gets its own pod's limits and GPUs (asserted in `admit`), and
/// many calls need no LIST.
#[test]
fn a_lagging_cache_confirmed_by_reads_never_swaps_limits() {
    let (mut calls_from_cache, mut calls, mut failures, mut plugin_restarts) = (0, 0, 0, 0);
    let mut gpu_less_predecessors = 0;
    for scheduler_rule in [true, false] {
        for order in ["creation", "reverse", "random"] {
            for seed in 0..10 {
                let mut sim = Sim::new(seed, true, scheduler_rule);
                sim.lagging_cache = true;
                sim.rejects_before_allocate = true;
                sim.reuse_names = seed % 2 == 0;
                // A restarted plugin knows no run in progress, so it may refuse a pod (fail
                // closed, the owner recreates it): counted only where the plugin keeps running.
                sim.plugin_restart_every = (seed % 3 == 1).then_some(11 + seed as usize);
                sim.run_with_restarts(order, 2_000, &[6, 15]);
                sim.assert_every_spec_admitted(order);
                calls_from_cache += sim.from_cache;
                calls += sim.calls;
                plugin_restarts += sim.plugin_restarts;
                gpu_less_predecessors += sim.gpu_less_predecessors;
                if scheduler_rule && sim.plugin_restarts == 0 {
                    failures += sim.failures;
                }
            }
        }
    }
    // Without the rule a restarted kubelet's re-asks can stay ambiguous on a LIST too.
    assert_eq!(failures, 0, "with the rule, nothing is refused");
    // After each restart, calls are decided on a LIST until none can be a re-ask.
    assert!(
        calls_from_cache * 3 > calls,
        "the cache answered {calls_from_cache} of {calls} calls"
    );
    assert!(
        plugin_restarts > 20,
        "the plugin restarted {plugin_restarts} times"
    );
    assert!(
        gpu_less_predecessors > 100,
        "{gpu_less_predecessors} calls with a GPU-less predecessor in the cache"
    );
}

#[test]
fn pod_resources_elimination_identifies_every_pod_even_without_the_rule() {
    for order in ["creation", "reverse", "random"] {
        for seed in 0..5 {
            let mut sim = Sim::new(seed, true, false);
            sim.run(order);
            assert_eq!(sim.failures, 0, "elimination is exact ({order})");
            assert_eq!(sim.class_swaps, 0);
        }
    }
}

#[test]
fn kubelet_restarts_mid_admission_never_swap_limits() {
    // The kubelet dies twice while admitting, keeping the allocation of a random prefix of every
    // pod it had not started; it asks again for the rest. With and without pod-resources, every
    // call serves the container's own limits (asserted in `admit`) or refuses the pod.
    let mut reasks = 0;
    for pod_resources in [false, true] {
        for order in ["creation", "reverse", "random"] {
            for seed in 0..10 {
                let mut sim = Sim::new(seed, pod_resources, true);
                sim.run_with_restarts(order, 2_000, &[6, 15]);
                sim.assert_every_spec_admitted(order);
                reasks += sim.reasks;
            }
        }
    }
    assert!(
        reasks > 0,
        "re-asked pods are served when nothing else is meant"
    );
}

#[test]
fn without_rule_or_pod_resources_it_fails_closed_but_never_swaps() {
    for order in ["creation", "reverse", "random"] {
        for seed in 0..5 {
            let mut sim = Sim::new(seed, false, false);
            // Without the rule, recreated pods are bound again at once and stay ambiguous, so
            // the node refuses them for as long as that lasts: bounded run, no progress promise.
            sim.run_steps(order, 200);
            assert!(
                sim.failures > 0,
                "ambiguity must show up as refusals ({order})"
            );
        }
    }
}

/// A pod in namespace `ns` with one container `main` booked on GPU-0 (`mem` MiB, 10 cores).
fn one_gpu_pod(name: &str, mem: u32, bind_time: u64) -> PodSnapshot {
    let mut pod = tessera_node::testing::bound_pod(NODE, name, &[&[("GPU-0", mem, 10)]], bind_time);
    pod.namespace = "ns".into();
    pod.containers[0].name = "main".into();
    pod
}

fn facts(count: usize) -> CallFacts<'static> {
    CallFacts {
        count,
        must_include: false,
        hami_lock: None,
        pod_resources: None,
    }
}

#[test]
fn hami_lock_names_the_pod_among_ambiguous_ones() {
    let pods = [one_gpu_pod("a", 1000, 1), one_gpu_pod("b", 2000, 2)];
    let ledger = Ledger::default();
    let (pending, _) = pending_pods(NODE, &pods, &ledger);
    let err = select(facts(1), &pending, &ledger).expect_err("ambiguous");
    assert!(err.to_string().contains("ns/a, ns/b"), "{err}");
    let mut f = facts(1);
    f.hami_lock = Some("ns/b");
    assert_eq!(select(f, &pending, &ledger).expect("lock").name, "b");
}

/// Issue 29: the read started before the kubelet's `List` answers goes to the pod the kubelet
/// most likely admits: the one whose binding the watch delivered first (lowest
/// `resourceVersion`, whatever the bind-time or the name say), or the continuing pod; never a
/// pod with another count, one already started, or one whose version is unreadable while
/// another's is not.
#[test]
fn the_early_read_goes_to_the_pod_bound_first() {
    let with_version = |name: &str, bind_time: u64, rv: &str| {
        let mut p = one_gpu_pod(name, 1000, bind_time);
        p.resource_version = rv.into();
        p
    };
    let mut two_gpus = tessera_node::testing::bound_pod(
        NODE,
        "two-gpus",
        &[&[("GPU-0", 1000, 10), ("GPU-1", 1000, 10)]],
        1,
    );
    two_gpus.resource_version = "5".into();
    let pods = [
        with_version("a-bound-second", 1, "1200"),
        with_version("z-bound-first", 9, "999"),
        with_version("unreadable", 0, "not-a-number"),
        two_gpus,
    ];
    let mut ledger = Ledger::default();
    let (pending, _) = pending_pods(NODE, &pods, &ledger);
    let guess =
        |count, ledger: &Ledger| likely_admitting(count, &pending, ledger).map(|p| p.name.clone());
    assert_eq!(guess(1, &ledger).as_deref(), Some("z-bound-first"));
    assert_eq!(guess(2, &ledger).as_deref(), Some("two-gpus"));
    assert_eq!(guess(3, &ledger), None);

    ledger.record_served("uid-z-bound-first", 0, None);
    let (pending, _) = pending_pods(NODE, &pods, &ledger);
    assert_eq!(
        likely_admitting(1, &pending, &ledger).map(|p| p.name.as_str()),
        Some("a-bound-second"),
        "a served pod is no longer guessed; a readable version comes before an unreadable one"
    );

    // A pod whose first container was served continues with its next one.
    let pods = [with_version("a-bound-second", 1, "1200"), {
        let mut p = tessera_node::testing::bound_pod(
            NODE,
            "sidecar",
            &[&[("GPU-0", 500, 10)], &[("GPU-1", 700, 10)]],
            5,
        );
        p.resource_version = "4000".into();
        p
    }];
    let mut ledger = Ledger::default();
    ledger.record_served("uid-sidecar", 0, Some(1));
    let (pending, _) = pending_pods(NODE, &pods, &ledger);
    assert_eq!(
        likely_admitting(1, &pending, &ledger).map(|p| p.name.as_str()),
        Some("sidecar"),
        "the continuing pod comes before any fresh one"
    );
}

#[test]
fn interchangeable_pods_are_served_oldest_first() {
    let pods = [
        one_gpu_pod("late", 1000, 20),
        one_gpu_pod("early", 1000, 10),
    ];
    let ledger = Ledger::default();
    let (pending, _) = pending_pods(NODE, &pods, &ledger);
    assert_eq!(
        select(facts(1), &pending, &ledger).expect("class").name,
        "early"
    );
}

#[test]
fn count_mismatch_terminal_and_other_node_pods_are_not_candidates() {
    let mut other = one_gpu_pod("other", 1000, 1);
    other
        .annotations
        .insert(keys::VGPU_NODE.into(), "node-b".into());
    let mut done = one_gpu_pod("done", 1000, 1);
    done.terminal = true;
    let mut broken = one_gpu_pod("broken", 1000, 1);
    broken.annotations.insert(
        keys::DEVICES_TO_ALLOCATE.into(),
        "GPU-0,NVIDIA,x,1:;".into(),
    );
    let pods = [other, done, broken];
    let ledger = Ledger::default();
    let (pending, rejected) = pending_pods(NODE, &pods, &ledger);
    assert!(pending.is_empty());
    assert_eq!(rejected.len(), 2, "{rejected:?}");
    assert!(rejected.iter().any(|r| r.to_string().contains("node-b")));
    assert!(select(facts(1), &pending, &ledger).is_err());
    let pods = [one_gpu_pod("two", 1000, 1)];
    let (pending, _) = pending_pods(NODE, &pods, &ledger);
    assert!(
        select(facts(2), &pending, &ledger).is_err(),
        "2 devices asked, entry has 1"
    );
}

#[test]
fn aborted_multi_container_pod_is_not_continued_when_pod_resources_shows_it_gone() {
    // p: two containers (1 GPU each); q: one container, one GPU. p's run stops after container 0.
    let mut p = one_gpu_pod("p", 0, 1);
    let value = "GPU-0,NVIDIA,100,1:;GPU-1,NVIDIA,200,2:;";
    p.annotations
        .insert(keys::DEVICES_TO_ALLOCATE.into(), value.into());
    p.annotations
        .insert(keys::DEVICES_ALLOCATED.into(), value.into());
    p.containers.push(ContainerSpec {
        name: "second".into(),
        requests_resource: true,
        restartable_init: false,
        disable_control: false,
    });
    let q = one_gpu_pod("q", 300, 2);
    let pods = [p, q];
    let mut ledger = Ledger::default();
    ledger.record_served("uid-p", 0, Some(1));
    // The kubelet rejected p (it left the active list) and now admits q.
    let mut view = PodResourcesView::default();
    view.pods.insert(
        "ns/q".into(),
        BTreeMap::from([("main".to_owned(), Vec::new())]),
    );
    let (pending, _) = pending_pods(NODE, &pods, &ledger);
    let f = CallFacts {
        count: 1,
        must_include: false,
        hami_lock: None,
        pod_resources: Some(&view),
    };
    let c = select(f, &pending, &ledger).expect("q identified");
    assert_eq!((c.name.as_str(), c.devices[0].usedmem), ("q", 300));
    // Without pod-resources the plugin cannot tell p's second container from q's first, and their
    // limits differ: it refuses (under the scheduler rule p and q are never pending together).
    assert!(select(facts(1), &pending, &ledger).is_err());
}

#[test]
fn continuing_pod_is_refused_when_an_abort_would_give_other_limits() {
    // p and q are interchangeable two-container pods with different containers; p's first
    // container was served. Without pod-resources the next call is p's second container — or,
    // had p been rejected in between, q's first. Their limits differ: refuse.
    let two = |name: &str, t: u64| {
        let mut pod = one_gpu_pod(name, 0, t);
        let value = "GPU-0,NVIDIA,100,1:;GPU-1,NVIDIA,200,2:;";
        pod.annotations
            .insert(keys::DEVICES_TO_ALLOCATE.into(), value.into());
        pod.annotations
            .insert(keys::DEVICES_ALLOCATED.into(), value.into());
        pod.containers.push(ContainerSpec {
            name: "second".into(),
            requests_resource: true,
            restartable_init: false,
            disable_control: false,
        });
        pod
    };
    let pods = [two("p", 1), two("q", 2)];
    let mut ledger = Ledger::default();
    ledger.record_served("uid-p", 0, Some(1));
    let (pending, _) = pending_pods(NODE, &pods, &ledger);
    let err = select(facts(1), &pending, &ledger).expect_err("ambiguous continuation");
    assert!(err.to_string().contains("ns/p, ns/q"), "{err}");
    // With pod-resources, q is not in the kubelet's pod manager yet: p continues.
    let mut view = PodResourcesView::default();
    view.pods.insert(
        "ns/p".into(),
        BTreeMap::from([
            ("main".to_owned(), vec!["GPU-0-0".to_owned()]),
            ("second".to_owned(), Vec::new()),
        ]),
    );
    let f = CallFacts {
        count: 1,
        must_include: false,
        hami_lock: None,
        pod_resources: Some(&view),
    };
    let c = select(f, &pending, &ledger).expect("p continues");
    assert_eq!((c.name.as_str(), c.devices[0].usedmem), ("p", 200));
}

#[test]
fn elimination_names_an_unknown_pod_and_refuses() {
    let pods = [one_gpu_pod("a", 1000, 1)];
    let ledger = Ledger::default();
    let (pending, _) = pending_pods(NODE, &pods, &ledger);
    let mut view = PodResourcesView::default();
    view.pods.insert(
        "ns/a".into(),
        BTreeMap::from([("main".to_owned(), vec!["GPU-0-1".to_owned()])]),
    );
    view.pods.insert(
        "ns/plain".into(),
        BTreeMap::from([("main".to_owned(), Vec::new())]),
    );
    let f = CallFacts {
        count: 1,
        must_include: false,
        hami_lock: None,
        pod_resources: Some(&view),
    };
    assert!(
        select(f, &pending, &ledger).is_err(),
        "a is already allocated; the admitted pod is not ours"
    );
}

mod arbitrary_input {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Whatever is in the annotations, identity never panics, and whatever it serves has
        /// exactly the call's device count.
        #[test]
        fn never_panics_and_serves_the_right_count(
            to_allocate in "[A-Z0-9a-z,:;-]{0,60}",
            allocated in proptest::option::of("[A-Z0-9a-z,:;-]{0,60}"),
            phase in prop_oneof![Just("allocating"), Just("success"), Just("x")],
            node in prop_oneof![Just(NODE), Just("node-b")],
            bind_time in "[0-9a-z]{0,12}",
            count in 0usize..4,
            containers in 0usize..4,
        ) {
            let mut pod = one_gpu_pod("p", 1, 1);
            pod.annotations.insert(keys::DEVICES_TO_ALLOCATE.into(), to_allocate);
            match allocated {
                Some(a) => { pod.annotations.insert(keys::DEVICES_ALLOCATED.into(), a); }
                None => { pod.annotations.remove(keys::DEVICES_ALLOCATED); }
            }
            pod.annotations.insert(keys::BIND_PHASE.into(), phase.into());
            pod.annotations.insert(keys::VGPU_NODE.into(), node.into());
            pod.annotations.insert(keys::BIND_TIME.into(), bind_time);
            pod.containers = (0..containers).map(|i| ContainerSpec {
                name: format!("c{i}"), requests_resource: i % 2 == 0, restartable_init: false, disable_control: false,
            }).collect();
            let pods = [pod];
            let ledger = Ledger::default();
            let (pending, _) = pending_pods(NODE, &pods, &ledger);
            if let Ok(c) = select(facts(count), &pending, &ledger) {
                prop_assert_eq!(c.devices.len(), count);
            }
        }
    }
}

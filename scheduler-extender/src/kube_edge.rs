//! The real cluster edge: API calls through `kube`, the informers that feed the decision loop,
//! and leader election on a `coordination.k8s.io/v1` Lease held by the extender itself.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{Binding, Node, ObjectReference, Pod, ResourceQuota};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::core::PartialObjectMeta;
use kube::runtime::events::{Event, EventType as KubeEventType, Recorder, Reporter};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use serde_json::json;
use tessera_scheduler_core::config::DecisionConfig;
use tessera_scheduler_core::facts::SharedFacts;
use tessera_scheduler_core::lease::{self, Identity, LeaseAction, LeaseRecord, Standby};
use tessera_scheduler_core::patch::MetadataPatch;
use tessera_scheduler_core::quota::{QuotaKeys, QuotaRecord};
use tessera_scheduler_core::state::{NodeRecord, ResyncKind, slim_node, slim_pod};
use tokio::sync::watch;

use crate::edge::{ClusterEdge, EdgeError, EventType, PodEvent};
use crate::engine::{Command, EngineHandle, Observation, Unschedulable};

fn edge_err(e: kube::Error) -> EdgeError {
    EdgeError::from(e)
}

/// `ClusterEdge` over a kube client.
#[derive(Clone)]
pub struct KubeEdge {
    client: Client,
    /// Events go to a background publisher: `/filter` and `/bind` answer without waiting for
    /// an Event write (kube-scheduler runs the filter call inside its sequential scheduling
    /// cycle, so every API round-trip there lowers the pods/s of the whole cluster).
    events: tokio::sync::mpsc::Sender<PodEvent>,
}

/// Events waiting to be written; beyond this (an API server that does not keep up) new events
/// are dropped, as events are best effort.
const EVENT_QUEUE: usize = 4096;
/// Events written at once.
const EVENT_WRITERS: usize = 8;

impl std::fmt::Debug for KubeEdge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeEdge").finish_non_exhaustive()
    }
}

impl KubeEdge {
    /// Must be called inside a Tokio runtime: it starts the event publisher.
    pub fn new(client: Client, scheduler_name: &str, instance: Option<String>) -> Self {
        let reporter = Reporter {
            controller: scheduler_name.to_owned(),
            instance,
        };
        let recorder = Recorder::new(client.clone(), reporter);
        let (events, rx) = tokio::sync::mpsc::channel(EVENT_QUEUE);
        tessera_runtime::spawn_task("events", publish_events(recorder, rx));
        KubeEdge { client, events }
    }
}

/// How often a failure to record an Event is said (with the count since): an API server that
/// refuses every Event must not flood the log, nor go unnoticed (issue 34).
const EVENT_FAILURE_LOG_PERIOD: std::time::Duration = std::time::Duration::from_secs(60);

/// The rate limit of the warnings about Events that could not be recorded or were dropped.
static EVENT_FAILURES: tessera_runtime::SharedRateLimitedLog =
    tessera_runtime::SharedRateLimitedLog::new(EVENT_FAILURE_LOG_PERIOD);

/// Says, at most once per [`EVENT_FAILURE_LOG_PERIOD`] as a warning (debug in between), that an
/// Event was lost and why.
fn event_lost(why: &dyn std::fmt::Display, reason: &str, pod: &str) {
    let due = EVENT_FAILURES.note_now();
    match due {
        Some(left_out) => tracing::warn!(
            error = %why,
            reason,
            pod,
            left_out,
            "a pod Event could not be recorded (and left_out more since the last such line)"
        ),
        None => tracing::debug!(error = %why, reason, pod, "a pod Event could not be recorded"),
    }
}

async fn publish_event(recorder: &Recorder, event: PodEvent) {
    let reference = ObjectReference {
        api_version: Some("v1".to_owned()),
        kind: Some("Pod".to_owned()),
        name: Some(event.name.clone()),
        namespace: Some(event.namespace.clone()),
        uid: Some(event.uid.clone()),
        ..Default::default()
    };
    let ev = Event {
        type_: match event.kind {
            EventType::Normal => KubeEventType::Normal,
            EventType::Warning => KubeEventType::Warning,
        },
        reason: event.reason.clone(),
        note: Some(event.message.chars().take(1000).collect()),
        action: "Scheduling".to_owned(),
        secondary: None,
    };
    if let Err(e) = recorder.publish(&ev, &reference).await {
        event_lost(
            &tessera_runtime::DisplayChain(&e),
            &event.reason,
            &format!("{}/{}", event.namespace, event.name),
        );
    }
}

/// Writes queued events, up to [`EVENT_WRITERS`] at once, until every [`KubeEdge`] is gone.
async fn publish_events(recorder: Recorder, rx: tokio::sync::mpsc::Receiver<PodEvent>) {
    let stream =
        futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|e| (e, rx)) });
    stream
        .for_each_concurrent(EVENT_WRITERS, |e| publish_event(&recorder, e))
        .await;
}

impl ClusterEdge for KubeEdge {
    async fn get_pod(&self, namespace: &str, name: &str) -> Result<Option<Pod>, EdgeError> {
        Api::<Pod>::namespaced(self.client.clone(), namespace)
            .get_opt(name)
            .await
            .map_err(edge_err)
    }

    async fn patch_pod(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
        patch: MetadataPatch,
    ) -> Result<(), EdgeError> {
        let mut meta = json!({"annotations": patch.annotations});
        if !patch.labels.is_empty() {
            meta["labels"] = json!(patch.labels);
        }
        if !uid.is_empty() {
            // A UID in the patch is a precondition: a recreated pod of the same name is refused.
            meta["uid"] = json!(uid);
        }
        Api::<Pod>::namespaced(self.client.clone(), namespace)
            .patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": meta})),
            )
            .await
            .map(|_| ())
            .map_err(edge_err)
    }

    async fn bind_pod(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
        node: &str,
        metadata: MetadataPatch,
    ) -> Result<(), EdgeError> {
        let binding = Binding {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                namespace: Some(namespace.to_owned()),
                uid: Some(uid.to_owned()),
                annotations: (!metadata.annotations.is_empty()).then_some(metadata.annotations),
                labels: (!metadata.labels.is_empty()).then_some(metadata.labels),
                ..Default::default()
            },
            target: ObjectReference {
                api_version: Some("v1".to_owned()),
                kind: Some("Node".to_owned()),
                name: Some(node.to_owned()),
                ..Default::default()
            },
        };
        Api::<Pod>::namespaced(self.client.clone(), namespace)
            .create_subresource::<_, serde_json::Value>(
                "binding",
                name,
                &PostParams::default(),
                &binding,
            )
            .await
            .map(|_| ())
            .map_err(edge_err)
    }

    async fn lock_hami_node(
        &self,
        node: &str,
        namespace: &str,
        name: &str,
    ) -> Result<(), EdgeError> {
        use hami_contract::nodelock::{AcquireStep, NodeLock, acquire_step};
        let nodes = Api::<Node>::all(self.client.clone());
        // HAMi retries a conflicting write a few times (`DefaultStrategy`, 5 steps); so do we.
        for _ in 0..5 {
            let current = nodes.get(node).await.map_err(edge_err)?;
            let rv = current
                .metadata
                .resource_version
                .clone()
                .unwrap_or_default();
            let value = current
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(hami_contract::annotations::NODE_LOCK))
                .cloned();
            let now = Timestamp::now();
            let age = value
                .as_deref()
                .and_then(NodeLock::parse)
                .and_then(|l| l.time.parse::<Timestamp>().ok())
                .map(|t| now.as_second().saturating_sub(t.as_second()).unsigned_abs());
            match acquire_step(value.as_deref(), namespace, name, age) {
                AcquireStep::Held => return Ok(()),
                AcquireStep::Busy => {
                    return Err(EdgeError::HamiLockBusy {
                        node: node.to_owned(),
                        value: value.unwrap_or_default(),
                    });
                }
                AcquireStep::TakeIfGone {
                    namespace: holder_ns,
                    name: holder,
                } => {
                    let held = Api::<Pod>::namespaced(self.client.clone(), &holder_ns)
                        .get_opt(&holder)
                        .await
                        .map_err(edge_err)?;
                    if held.is_some() {
                        return Err(EdgeError::HamiLockHeld {
                            node: node.to_owned(),
                            namespace: holder_ns,
                            name: holder,
                        });
                    }
                }
                AcquireStep::Take => {}
            }
            // HAMi writes the lock time as RFC 3339 in seconds.
            let time = now
                .round(k8s_openapi::jiff::Unit::Second)
                .unwrap_or(now)
                .to_string();
            let lock = NodeLock::for_pod(&time, namespace, name).encode();
            let patch = json!({"metadata": {
                "annotations": {hami_contract::annotations::NODE_LOCK: lock},
                "resourceVersion": rv,
            }});
            match nodes
                .patch(node, &PatchParams::default(), &Patch::Merge(patch))
                .await
            {
                Ok(_) => return Ok(()),
                Err(kube::Error::Api(s)) if s.code == 409 => continue,
                Err(e) => return Err(edge_err(e)),
            }
        }
        Err(EdgeError::HamiLockContended {
            node: node.to_owned(),
        })
    }

    async fn release_hami_node_lock(
        &self,
        node: &str,
        namespace: &str,
        name: &str,
    ) -> Result<(), EdgeError> {
        self.remove_hami_lock_if(node, |v| {
            hami_contract::nodelock::is_held_by(v, namespace, name)
        })
        .await
    }

    async fn clear_hami_node_lock(&self, node: &str, value: &str) -> Result<(), EdgeError> {
        self.remove_hami_lock_if(node, |v| v == value).await
    }

    async fn disruption_budgets(
        &self,
        namespaces: &std::collections::BTreeSet<String>,
    ) -> Result<Vec<tessera_scheduler_core::preempt::Budget>, EdgeError> {
        use k8s_openapi::api::policy::v1::PodDisruptionBudget;
        use tessera_scheduler_core::preempt::Budget;
        let mut out = Vec::new();
        for ns in namespaces {
            let pdbs = Api::<PodDisruptionBudget>::namespaced(self.client.clone(), ns)
                .list(&kube::api::ListParams::default())
                .await
                .map_err(edge_err)?;
            for pdb in &pdbs.items {
                // kube-scheduler: a budget whose selector is empty or invalid selects nothing.
                let selector = pdb
                    .spec
                    .as_ref()
                    .and_then(|s| s.selector.clone())
                    .and_then(|s| kube::core::Selector::try_from(s).ok())
                    .filter(|s| !s.selects_all());
                let Some(selector) = selector else {
                    continue;
                };
                let pods = Api::<Pod>::namespaced(self.client.clone(), ns)
                    .list_metadata(&kube::api::ListParams::default().labels_from(&selector))
                    .await
                    .map_err(edge_err)?;
                let selected = pods
                    .items
                    .into_iter()
                    .filter_map(|p| Some((p.metadata.name?, p.metadata.uid?)));
                out.push(Budget::from_pdb(pdb, selected));
            }
        }
        Ok(out)
    }

    async fn event(&self, event: PodEvent) {
        if let Err(e) = self.events.try_send(event) {
            let event = e.into_inner();
            event_lost(
                &"the Event queue is full",
                &event.reason,
                &format!("{}/{}", event.namespace, event.name),
            );
        }
    }
}

impl KubeEdge {
    /// Removes `hami.io/mutex.lock` from `node` when its current value passes `remove`, with the
    /// node's resourceVersion as precondition: a lock changed since the read is left alone.
    async fn remove_hami_lock_if(
        &self,
        node: &str,
        remove: impl Fn(&str) -> bool,
    ) -> Result<(), EdgeError> {
        let nodes = Api::<Node>::all(self.client.clone());
        let current = nodes.get(node).await.map_err(edge_err)?;
        let now_value = current
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(hami_contract::annotations::NODE_LOCK));
        if !now_value.is_some_and(|v| remove(v)) {
            return Ok(());
        }
        let patch = json!({"metadata": {
            "annotations": {hami_contract::annotations::NODE_LOCK: null},
            "resourceVersion": current.metadata.resource_version,
        }});
        match nodes
            .patch(node, &PatchParams::default(), &Patch::Merge(patch))
            .await
        {
            // Changed since the read: someone took or released it; leave it.
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
            r => r.map(|_| ()).map_err(edge_err),
        }
    }
}

/// Leader election settings.
#[derive(Debug, Clone)]
pub struct LeaseConfig {
    pub namespace: String,
    pub name: String,
    pub identity: String,
    pub lease_duration: Duration,
    pub retry_period: Duration,
    /// Contend only while this Lease (kube-scheduler's) is held by our pod (`--follow-lease`).
    pub follow: Option<FollowLease>,
}

/// The Lease leadership is paired with (`--follow-lease <namespace>/<name>`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FollowLease {
    pub namespace: String,
    pub name: String,
    /// Holders of this pod write `<host>_<uuid>` (kube-scheduler: hostname = pod name).
    pub host: String,
}

fn now() -> MicroTime {
    MicroTime(Timestamp::now())
}

fn lease_record(lease: &Lease, default_duration_s: i32) -> LeaseRecord {
    let spec = lease.spec.as_ref();
    LeaseRecord {
        holder: spec
            .and_then(|s| s.holder_identity.clone())
            .unwrap_or_default(),
        renew_time: spec.and_then(|s| s.renew_time.as_ref()).map(|t| t.0),
        duration_s: i64::from(
            spec.and_then(|s| s.lease_duration_seconds)
                .unwrap_or(default_duration_s),
        ),
        transitions: spec
            .and_then(|s| s.lease_transitions)
            .and_then(|t| u64::try_from(t).ok())
            .unwrap_or(0),
    }
}

/// One round's outcome.
struct Round {
    /// The term we lead in, if any.
    term: Option<u64>,
    /// Why we do not lead, for the log (logged when it changes).
    standby: Option<String>,
    /// Our kube-scheduler leads and another replica still holds our Lease: it will hand it
    /// over at its next round, so look again soon.
    handover_pending: bool,
}

/// Holds (or waits for) the Lease and publishes the leadership term (`leaseTransitions` when we
/// acquired it) or `None`. With `cfg.follow`, contends only while the followed Lease is held by
/// this pod, and releases the Lease at once when another pod's holder has it
/// (`tessera_scheduler_core::lease`). Runs forever.
pub async fn run_leader_election(
    client: Client,
    cfg: LeaseConfig,
    tx: watch::Sender<Option<u64>>,
    engine: EngineHandle,
) {
    let api: Api<Lease> = Api::namespaced(client.clone(), &cfg.namespace);
    let followed = cfg
        .follow
        .as_ref()
        .map(|f| (Api::<Lease>::namespaced(client, &f.namespace), f));
    let duration_s = i32::try_from(cfg.lease_duration.as_secs())
        .unwrap_or(15)
        .max(1);
    let mut last_renew = tokio::time::Instant::now();
    let mut last_standby: Option<String> = None;
    let mut last_follow_error: Option<String> = None;
    loop {
        let followed_lease = match &followed {
            None => None,
            Some((fapi, f)) => match fapi.get_opt(&f.name).await {
                Ok(l) => {
                    last_follow_error = None;
                    l.map(|l| lease_record(&l, duration_s))
                }
                Err(e) => {
                    let msg = e.to_string();
                    if last_follow_error.as_deref() != Some(msg.as_str()) {
                        tracing::warn!(lease = %format!("{}/{}", f.namespace, f.name), error = %msg,
                            "cannot read the followed lease; contending without it");
                    }
                    last_follow_error = Some(msg);
                    None
                }
            },
        };
        let round = elect_round(
            &api,
            &cfg,
            duration_s,
            followed_lease.as_ref(),
            &tx,
            &engine,
        )
        .await;
        let mut pause = cfg.retry_period;
        match round {
            Ok(r) => {
                if r.standby != last_standby {
                    if let Some(why) = &r.standby {
                        tracing::info!(reason = %why, "standing by");
                    }
                    last_standby = r.standby.clone();
                }
                if r.handover_pending {
                    pause = pause.min(Duration::from_secs(1));
                }
                match r.term {
                    Some(t) => {
                        last_renew = tokio::time::Instant::now();
                        if *tx.borrow() != Some(t) {
                            tracing::info!(term = t, "acquired leadership");
                            let _ = tx.send(Some(t));
                        }
                    }
                    None => {
                        if tx.borrow().is_some() {
                            tracing::warn!("lost leadership");
                            let _ = tx.send(None);
                        }
                    }
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "lease update failed");
                // Step down before the lease could have expired for others.
                if tx.borrow().is_some() && last_renew.elapsed() >= cfg.lease_duration / 2 {
                    tracing::warn!("stepping down: could not renew the lease in time");
                    let _ = tx.send(None);
                }
            }
        }
        tokio::time::sleep(pause).await;
    }
}

async fn elect_round(
    api: &Api<Lease>,
    cfg: &LeaseConfig,
    duration_s: i32,
    followed: Option<&LeaseRecord>,
    tx: &watch::Sender<Option<u64>>,
    engine: &EngineHandle,
) -> Result<Round, kube::Error> {
    let current = api.get_opt(&cfg.name).await?;
    let own = current.as_ref().map(|l| lease_record(l, duration_s));
    let me = Identity {
        own: &cfg.identity,
        follow_host: cfg.follow.as_ref().map(|f| f.host.as_str()),
    };
    let action = lease::decide(own.as_ref(), followed, Timestamp::now(), me);
    let idle = |standby: Option<String>, handover_pending: bool| Round {
        term: None,
        standby,
        handover_pending,
    };
    match action {
        LeaseAction::Standby(Standby::HeldBy(holder)) => {
            // Our kube-scheduler leads: the holder hands over at its next round.
            let paired =
                cfg.follow.is_some() && followed.is_some_and(|f| me.is_own_follower(&f.holder));
            Ok(idle(Some(format!("the lease is held by {holder}")), paired))
        }
        LeaseAction::Standby(Standby::FollowedElsewhere(holder)) => Ok(idle(
            Some(format!(
                "kube-scheduler leads elsewhere ({holder}); that pod's extender must lead"
            )),
            false,
        )),
        LeaseAction::Release { followed_holder } => {
            tracing::info!(kube_scheduler = %followed_holder,
                "kube-scheduler leads in another pod: releasing the extender lease to it");
            // Stop deciding before anyone else can take the Lease: the loop has handled the
            // step-down once this returns, so no later filter or bind is decided here.
            if tx.borrow().is_some() {
                let _ = tx.send(None);
            }
            engine.step_down().await;
            let Some(mut lease) = current else {
                return Ok(idle(None, false));
            };
            let spec = lease.spec.get_or_insert_with(Default::default);
            spec.holder_identity = None;
            spec.renew_time = Some(now());
            spec.lease_duration_seconds = Some(1);
            let released = Some(format!("released the lease to {followed_holder}"));
            match api.replace(&cfg.name, &PostParams::default(), &lease).await {
                Ok(_) => Ok(idle(released, false)),
                // Someone wrote it meanwhile; the next round reads it again.
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(idle(released, false)),
                Err(e) => Err(e),
            }
        }
        LeaseAction::Create => {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(cfg.name.clone()),
                    namespace: Some(cfg.namespace.clone()),
                    ..Default::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(cfg.identity.clone()),
                    lease_duration_seconds: Some(duration_s),
                    acquire_time: Some(now()),
                    renew_time: Some(now()),
                    lease_transitions: Some(0),
                    ..Default::default()
                }),
            };
            match api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(Round {
                    term: Some(0),
                    standby: None,
                    handover_pending: false,
                }),
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(idle(None, false)),
                Err(e) => Err(e),
            }
        }
        LeaseAction::Renew { term } | LeaseAction::Acquire { term } => {
            let Some(mut lease) = current else {
                return Ok(idle(None, false));
            };
            let acquire = matches!(action, LeaseAction::Acquire { .. });
            let spec = lease.spec.get_or_insert_with(Default::default);
            if acquire {
                spec.holder_identity = Some(cfg.identity.clone());
                spec.acquire_time = Some(now());
                spec.lease_transitions = Some(i32::try_from(term).unwrap_or(i32::MAX));
            }
            spec.renew_time = Some(now());
            spec.lease_duration_seconds = Some(duration_s);
            // `replace` carries the resourceVersion we read: a concurrent writer makes this
            // fail (409).
            match api.replace(&cfg.name, &PostParams::default(), &lease).await {
                Ok(_) => Ok(Round {
                    term: Some(term),
                    standby: None,
                    handover_pending: false,
                }),
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(idle(None, false)),
                Err(e) => Err(e),
            }
        }
    }
}

enum Change {
    Node(Box<watcher::Event<Node>>),
    Pod(Box<watcher::Event<Pod>>),
    Quota(Box<watcher::Event<ResourceQuota>>),
}

/// The longest pause between restarts of a term's watchers ([`watcher::DefaultBackoff`]'s).
const MAX_RESTART_PAUSE: Duration = Duration::from_secs(30);

/// Feeds the decision loop while this replica leads: on every new term, fresh watchers List
/// everything (quorum reads), the loop rebuilds from that complete view, then every later change
/// follows on the same channel, in order. Objects are reduced to what the state reads
/// (`state::slim_pod`, `slim_node`) as they arrive, so a List is never held whole. Pods are
/// watched with the field selector `pod_fields` ([`pod_watch_fields`]): the API server leaves
/// out `default-scheduler`'s pods, which hold no booking.
///
/// [`pod_watch_fields`]: tessera_scheduler_core::podspec::pod_watch_fields
pub async fn run_sync(
    client: Client,
    engine: EngineHandle,
    mut leadership: watch::Receiver<Option<u64>>,
    ready: std::sync::Arc<std::sync::atomic::AtomicBool>,
    pod_fields: Option<String>,
) {
    // The watchers back off on their own; this paces restarts of the whole set, should it end.
    let mut restarts = watcher::DefaultBackoff::default();
    loop {
        let term = *leadership.borrow_and_update();
        engine.send(Command::Leadership(term)).await;
        let Some(term) = term else {
            ready.store(false, std::sync::atomic::Ordering::Relaxed);
            if leadership.changed().await.is_err() {
                return;
            }
            continue;
        };
        tokio::select! {
            _ = sync_term(client.clone(), engine.clone(), term, ready.clone(), pod_fields.as_deref()) => {
                tracing::warn!(term, "informers stopped; restarting");
                tokio::time::sleep(restarts.next().unwrap_or(MAX_RESTART_PAUSE)).await;
            }
            r = leadership.changed() => {
                if r.is_err() {
                    return;
                }
            }
        }
        ready.store(false, std::sync::atomic::Ordering::Relaxed);
    }
}

/// One watcher's progress within a term: before the rebuild, its first List; after it, the
/// keys of a re-List (a watcher re-lists after e.g. 410 Gone and reports its complete view:
/// objects missing from it were deleted while the watch was down).
#[derive(Debug, Default)]
struct WatchProgress {
    /// The first List is complete.
    listed: bool,
    /// Keys seen by a re-List in progress.
    relisted: Option<Vec<String>>,
}

/// The observations a watch event makes, for objects of one kind; `K` is the key a re-List
/// keeps, `listed` takes the objects of the first List (before the rebuild).
struct EventRoute<'a, T> {
    progress: &'a mut WatchProgress,
    rebuilt: bool,
    kind: ResyncKind,
    key: fn(&T) -> String,
    upsert: fn(T) -> Observation,
    delete: fn(T) -> Observation,
}

impl<T> EventRoute<'_, T> {
    /// Routes one event: into `first_list` before the rebuild, else into observations.
    fn route(self, ev: watcher::Event<T>, first_list: &mut Vec<T>, obs: &mut Vec<Observation>) {
        match ev {
            watcher::Event::InitApply(o) if !self.rebuilt => first_list.push(o),
            watcher::Event::InitDone if !self.rebuilt => self.progress.listed = true,
            watcher::Event::Init => {
                if self.rebuilt {
                    self.progress.relisted = Some(Vec::new());
                }
            }
            watcher::Event::InitApply(o) => {
                if let Some(keys) = self.progress.relisted.as_mut() {
                    keys.push((self.key)(&o));
                }
                obs.push((self.upsert)(o));
            }
            watcher::Event::InitDone => {
                if let Some(keep) = self.progress.relisted.take() {
                    obs.push(Observation::Resync {
                        kind: self.kind,
                        keep,
                    });
                }
            }
            watcher::Event::Apply(o) => obs.push((self.upsert)(o)),
            watcher::Event::Delete(o) => obs.push((self.delete)(o)),
        }
    }
}

/// What one term's sync has gathered: the first Lists (objects reduced as they arrive, so a
/// List is never held whole), the changes seen meanwhile, and each watcher's progress.
struct TermSync {
    engine: EngineHandle,
    term: u64,
    ready: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// From the term's first List to serving: what a leader change costs
    /// (docs/benchmarks.md).
    started: tokio::time::Instant,
    nodes: Vec<Node>,
    pods: Vec<Pod>,
    quotas: Vec<ResourceQuota>,
    /// Node, pod and quota watchers.
    progress: [WatchProgress; 3],
    rebuilt: bool,
    /// Changes seen before the rebuild, sent once it is done.
    backlog: Vec<Observation>,
}

fn quota_key(q: &ResourceQuota) -> String {
    format!("{}/{}", q.namespace().unwrap_or_default(), q.name_any())
}

impl TermSync {
    /// The observations of one change (the first Lists are kept aside until complete).
    fn observe(&mut self, change: Change) -> Vec<Observation> {
        let mut obs = Vec::new();
        let rebuilt = self.rebuilt;
        let [nodes, pods, quotas] = &mut self.progress;
        match change {
            Change::Node(ev) => EventRoute {
                progress: nodes,
                rebuilt,
                kind: ResyncKind::Nodes,
                key: |n: &Node| n.name_any(),
                upsert: |n| Observation::NodeUpsert(Box::new(slim_node(n))),
                delete: |n| Observation::NodeDelete(n.name_any()),
            }
            .route(slim(*ev, slim_node), &mut self.nodes, &mut obs),
            Change::Pod(ev) => EventRoute {
                progress: pods,
                rebuilt,
                kind: ResyncKind::Pods,
                key: |p: &Pod| p.metadata.uid.clone().unwrap_or_default(),
                upsert: |p| Observation::PodUpsert(Box::new(p)),
                delete: |p| Observation::PodDelete {
                    uid: p.metadata.uid.clone().unwrap_or_default(),
                },
            }
            .route(slim(*ev, slim_pod), &mut self.pods, &mut obs),
            Change::Quota(ev) => EventRoute {
                progress: quotas,
                rebuilt,
                kind: ResyncKind::Quotas,
                key: quota_key,
                upsert: |q| Observation::QuotaUpsert(Box::new(q)),
                delete: |q| Observation::QuotaDelete {
                    namespace: q.namespace().unwrap_or_default(),
                    name: q.name_any(),
                },
            }
            .route(*ev, &mut self.quotas, &mut obs),
        }
        obs
    }

    /// Every first List is complete.
    fn listed(&self) -> bool {
        self.progress.iter().all(|p| p.listed)
    }

    /// Hands the observations to the loop: after the rebuild at once; before it, kept until the
    /// first Lists are complete, then the rebuild and the backlog.
    async fn forward(&mut self, obs: Vec<Observation>) {
        if self.rebuilt {
            for o in obs {
                self.engine.send(Command::Observe(o)).await;
            }
            return;
        }
        self.backlog.extend(obs);
        if self.listed() {
            self.rebuild().await;
        }
    }

    /// Rebuilds the loop's state from the first Lists, then replays the backlog: serving.
    async fn rebuild(&mut self) {
        let (node_count, pod_count) = (self.nodes.len(), self.pods.len());
        self.engine
            .send(Command::Rebuild {
                term: self.term,
                nodes: std::mem::take(&mut self.nodes),
                pods: std::mem::take(&mut self.pods),
                quotas: std::mem::take(&mut self.quotas),
            })
            .await;
        self.engine.barrier().await;
        let seconds = self.started.elapsed().as_secs_f64();
        for o in self.backlog.drain(..) {
            self.engine.send(Command::Observe(o)).await;
        }
        self.rebuilt = true;
        self.ready.store(true, std::sync::atomic::Ordering::Relaxed);
        tracing::info!(
            term = self.term,
            nodes = node_count,
            pods = pod_count,
            list_and_rebuild_seconds = seconds,
            "cluster state rebuilt; serving decisions"
        );
    }
}

/// The event with its object reduced by `f` (what the state reads of it).
fn slim<T>(ev: watcher::Event<T>, f: fn(T) -> T) -> watcher::Event<T> {
    match ev {
        watcher::Event::Apply(o) => watcher::Event::Apply(f(o)),
        watcher::Event::Delete(o) => watcher::Event::Delete(f(o)),
        watcher::Event::Init => watcher::Event::Init,
        watcher::Event::InitApply(o) => watcher::Event::InitApply(f(o)),
        watcher::Event::InitDone => watcher::Event::InitDone,
    }
}

/// The term's watchers, merged into one stream of changes in arrival order. Each restarts with
/// kube-runtime's backoff after an error (exponential, jittered, reset once it runs again).
/// `pod_fields`: the pod watch's field selector (`podspec::pod_watch_fields`).
fn term_changes(
    client: Client,
    pod_fields: Option<&str>,
) -> impl futures::Stream<Item = Result<Change, watcher::Error>> + Send {
    let cfg = watcher::Config::default();
    let nodes = watcher(Api::<Node>::all(client.clone()), cfg.clone())
        .default_backoff()
        .map_ok(|e| Change::Node(Box::new(e)))
        .boxed();
    let pod_cfg = match pod_fields {
        Some(fields) => cfg.clone().fields(fields),
        None => cfg.clone(),
    };
    let pods = watcher(Api::<Pod>::all(client.clone()), pod_cfg)
        .default_backoff()
        .map_ok(|e| Change::Pod(Box::new(e)))
        .boxed();
    let quotas = watcher(Api::<ResourceQuota>::all(client), cfg)
        .default_backoff()
        .map_ok(|e| Change::Quota(Box::new(e)))
        .boxed();
    futures::stream::select_all([nodes, pods, quotas])
}

async fn sync_term(
    client: Client,
    engine: EngineHandle,
    term: u64,
    ready: std::sync::Arc<std::sync::atomic::AtomicBool>,
    pod_fields: Option<&str>,
) {
    let mut sync = TermSync {
        engine,
        term,
        ready,
        started: tokio::time::Instant::now(),
        nodes: Vec::new(),
        pods: Vec::new(),
        quotas: Vec::new(),
        progress: Default::default(),
        rebuilt: false,
        backlog: Vec::new(),
    };
    let mut changes = std::pin::pin!(term_changes(client, pod_fields));
    while let Some(item) = changes.next().await {
        match item {
            Ok(change) => {
                let obs = sync.observe(change);
                sync.forward(obs).await;
            }
            // The watcher backs off before it tries again.
            Err(e) => tracing::warn!(error = %e, "watch error (retrying)"),
        }
    }
}

enum FactChange {
    Node(Box<watcher::Event<PartialObjectMeta<Node>>>),
    Quota(Box<watcher::Event<ResourceQuota>>),
}

fn node_facts(meta: PartialObjectMeta<Node>, cfg: &DecisionConfig) -> Option<NodeRecord> {
    let node = Node {
        metadata: meta.metadata,
        ..Default::default()
    };
    NodeRecord::from_node(&node, cfg)
}

/// Keeps the webhook's [`ClusterFacts`](tessera_scheduler_core::facts::ClusterFacts) on every
/// replica, leader or not, from a light watch: node *metadata* only (the register annotation and
/// labels; no status, whose image lists dominate a Node's size) and ResourceQuotas. Each
/// (re-)List replaces the view at once when complete, so the webhook never sees half a List.
/// Runs forever.
pub async fn run_facts(client: Client, cfg: DecisionConfig, facts: SharedFacts) {
    let keys = QuotaKeys::new(&cfg.nvidia.resources, cfg.nvidia.effective_memory_factor());
    let write = || {
        facts
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    };
    // `Api<PartialObjectMeta<_>>` makes metadata-only List and Watch requests.
    let nodes = watcher(
        Api::<PartialObjectMeta<Node>>::all(client.clone()),
        watcher::Config::default(),
    )
    .default_backoff()
    .map_ok(|e| FactChange::Node(Box::new(e)))
    .boxed();
    let quotas = watcher(
        Api::<ResourceQuota>::all(client),
        watcher::Config::default(),
    )
    .default_backoff()
    .map_ok(|e| FactChange::Quota(Box::new(e)))
    .boxed();
    let mut all = futures::stream::select_all([nodes, quotas]);
    let mut node_list: Option<Vec<NodeRecord>> = None;
    let mut quota_list: Option<Vec<QuotaRecord>> = None;
    while let Some(item) = all.next().await {
        let change = match item {
            Ok(c) => c,
            Err(e) => {
                // The watcher backs off before it tries again.
                tracing::warn!(error = %e, "webhook facts: watch error (retrying)");
                continue;
            }
        };
        match change {
            FactChange::Node(ev) => match *ev {
                watcher::Event::Init => node_list = Some(Vec::new()),
                watcher::Event::InitApply(m) => {
                    if let (Some(list), Some(rec)) = (node_list.as_mut(), node_facts(m, &cfg)) {
                        list.push(rec);
                    }
                }
                watcher::Event::InitDone => {
                    if let Some(list) = node_list.take() {
                        write().replace_nodes(&list);
                        tracing::debug!(nodes = list.len(), "webhook facts: nodes listed");
                    }
                }
                watcher::Event::Apply(m) => {
                    if let Some(rec) = node_facts(m, &cfg) {
                        write().upsert_node(&rec);
                    }
                }
                watcher::Event::Delete(m) => write().remove_node(&m.name_any()),
            },
            FactChange::Quota(ev) => match *ev {
                watcher::Event::Init => quota_list = Some(Vec::new()),
                watcher::Event::InitApply(q) => {
                    if let (Some(list), Some(rec)) =
                        (quota_list.as_mut(), QuotaRecord::from_quota(&q, &keys))
                    {
                        list.push(rec);
                    }
                }
                watcher::Event::InitDone => {
                    if let Some(list) = quota_list.take() {
                        write().replace_quotas(list);
                    }
                }
                watcher::Event::Apply(q) => write().upsert_quota(
                    &q.namespace().unwrap_or_default(),
                    &q.name_any(),
                    QuotaRecord::from_quota(&q, &keys),
                ),
                watcher::Event::Delete(q) => {
                    write().remove_quota(&q.namespace().unwrap_or_default(), &q.name_any())
                }
            },
        }
    }
}

/// The `tessera.io/requeue-at` value of the `sequence`-th nudge: `<unix seconds>.<sequence>`.
fn requeue_stamp(now: Timestamp, sequence: u64) -> String {
    format!("{}.{sequence}", now.as_second())
}

/// At most this many pods are nudged in one batch (each nudge is a pod PATCH).
const NUDGES_PER_BATCH: usize = 200;
/// The least time between two batches: capacity freed again meanwhile joins the next batch, so a
/// churning cluster does not nudge the same pending pods at every pod that finishes.
const NUDGE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

/// Nudges pods that failed filtering once capacity frees, so kube-scheduler retries them now
/// instead of after its unschedulable timeout (HAMi #1368): a pod update moves an unschedulable
/// pod back to the active queue. The first batch goes at once; later ones at most once per
/// [`NUDGE_INTERVAL`], each pod once per batch.
pub async fn run_requeue(
    edge: KubeEdge,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Vec<Unschedulable>>,
) {
    // Each nudge must change the annotation: an unchanged value is a no-op for the API server,
    // kube-scheduler sees no update and the pod waits out the unschedulable timeout (5 min).
    // Pods that finish within one second free capacity twice in that second, hence the sequence.
    let mut sequence: u64 = 0;
    while let Some(first) = rx.recv().await {
        let pods = coalesce(first, &mut rx);
        sequence += 1;
        let stamp = requeue_stamp(Timestamp::now(), sequence);
        for p in pods.into_iter().take(NUDGES_PER_BATCH) {
            let patch = MetadataPatch {
                annotations: BTreeMap::from([("tessera.io/requeue-at".to_owned(), stamp.clone())]),
                ..Default::default()
            };
            if let Err(e) = edge.patch_pod(&p.namespace, &p.name, &p.uid, patch).await {
                tracing::debug!(pod = %p.name, error = %e, "requeue nudge failed");
            }
        }
        tokio::time::sleep(NUDGE_INTERVAL).await;
    }
}

/// The pods of `first` and of every batch already queued behind it, each once.
fn coalesce(
    first: Vec<Unschedulable>,
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<Vec<Unschedulable>>,
) -> std::collections::BTreeSet<Unschedulable> {
    let mut pods: std::collections::BTreeSet<Unschedulable> = first.into_iter().collect();
    while let Ok(more) = rx.try_recv() {
        pods.extend(more);
    }
    pods
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Capacity freed several times while a batch was being nudged: the next batch nudges each
    /// waiting pod once, not once per freed capacity.
    #[test]
    fn batches_queued_behind_one_are_nudged_together_each_pod_once() {
        let pod = |name: &str| Unschedulable {
            namespace: "ns".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
        };
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        tx.send(vec![pod("b"), pod("c")]).unwrap();
        tx.send(vec![pod("a"), pod("b")]).unwrap();
        let pods = coalesce(vec![pod("c")], &mut rx);
        let names: Vec<&str> = pods.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["a", "b", "c"]);
        assert!(rx.try_recv().is_err(), "every queued batch was taken");
    }

    #[test]
    fn nudges_within_one_second_still_change_the_annotation() {
        let now = Timestamp::from_second(1_796_000_000).expect("valid");
        assert_eq!(requeue_stamp(now, 1), "1796000000.1");
        assert_ne!(requeue_stamp(now, 1), requeue_stamp(now, 2));
    }
}

//! The real cluster edge: API calls through `kube`, the informers that feed the decision loop,
//! and leader election on a `coordination.k8s.io/v1` Lease held by the extender itself.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{Node, ObjectReference, Pod, ResourceQuota};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType as KubeEventType, Recorder, Reporter};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use serde_json::json;
use tokio::sync::watch;

use crate::edge::{ClusterEdge, EdgeError, EventType, MetadataPatch, PodEvent};
use crate::engine::{Command, EngineHandle, Observation, ResyncKind, Unschedulable};

fn edge_err(e: kube::Error) -> EdgeError {
    match &e {
        kube::Error::Api(s) if s.code == 404 => EdgeError::not_found(e.to_string()),
        _ => EdgeError::new(e.to_string()),
    }
}

/// `ClusterEdge` over a kube client.
#[derive(Clone)]
pub struct KubeEdge {
    client: Client,
    recorder: Recorder,
}

impl std::fmt::Debug for KubeEdge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeEdge").finish_non_exhaustive()
    }
}

impl KubeEdge {
    pub fn new(client: Client, scheduler_name: &str, instance: Option<String>) -> Self {
        let reporter = Reporter {
            controller: scheduler_name.to_owned(),
            instance,
        };
        KubeEdge {
            recorder: Recorder::new(client.clone(), reporter),
            client,
        }
    }
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
    ) -> Result<(), EdgeError> {
        let binding = json!({
            "apiVersion": "v1", "kind": "Binding",
            "metadata": {"name": name, "namespace": namespace, "uid": uid},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        });
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

    async fn event(&self, event: PodEvent) {
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
        if let Err(e) = self.recorder.publish(&ev, &reference).await {
            tracing::debug!(error = %e, reason = %event.reason, "could not record event");
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
}

fn now() -> MicroTime {
    MicroTime(Timestamp::now())
}

/// Holds (or waits for) the Lease and publishes the leadership term (`leaseTransitions` when we
/// acquired it) or `None`. Runs forever.
pub async fn run_leader_election(client: Client, cfg: LeaseConfig, tx: watch::Sender<Option<u64>>) {
    let api: Api<Lease> = Api::namespaced(client, &cfg.namespace);
    let duration_s = i32::try_from(cfg.lease_duration.as_secs())
        .unwrap_or(15)
        .max(1);
    let mut last_renew = tokio::time::Instant::now();
    loop {
        let term = try_acquire_or_renew(&api, &cfg, duration_s).await;
        match term {
            Ok(Some(t)) => {
                last_renew = tokio::time::Instant::now();
                if *tx.borrow() != Some(t) {
                    tracing::info!(term = t, "acquired leadership");
                    let _ = tx.send(Some(t));
                }
            }
            Ok(None) => {
                if tx.borrow().is_some() {
                    tracing::warn!("lost leadership");
                    let _ = tx.send(None);
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
        tokio::time::sleep(cfg.retry_period).await;
    }
}

async fn try_acquire_or_renew(
    api: &Api<Lease>,
    cfg: &LeaseConfig,
    duration_s: i32,
) -> Result<Option<u64>, kube::Error> {
    let Some(mut lease) = api.get_opt(&cfg.name).await? else {
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
        return match api.create(&PostParams::default(), &lease).await {
            Ok(_) => Ok(Some(0)),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(None),
            Err(e) => Err(e),
        };
    };
    let spec = lease.spec.get_or_insert_with(Default::default);
    let holder = spec.holder_identity.clone().unwrap_or_default();
    let transitions = u64::try_from(spec.lease_transitions.unwrap_or(0)).unwrap_or(0);
    let expired = spec.renew_time.as_ref().is_none_or(|t| {
        let dur = i64::from(spec.lease_duration_seconds.unwrap_or(duration_s));
        t.0.as_second().saturating_add(dur) < Timestamp::now().as_second()
    });
    let term = if holder == cfg.identity {
        transitions
    } else if holder.is_empty() || expired {
        spec.holder_identity = Some(cfg.identity.clone());
        spec.acquire_time = Some(now());
        spec.lease_transitions = Some(i32::try_from(transitions + 1).unwrap_or(i32::MAX));
        transitions + 1
    } else {
        return Ok(None);
    };
    spec.renew_time = Some(now());
    spec.lease_duration_seconds = Some(duration_s);
    // `replace` carries the resourceVersion we read: a concurrent writer makes this fail (409).
    match api.replace(&cfg.name, &PostParams::default(), &lease).await {
        Ok(_) => Ok(Some(term)),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(None),
        Err(e) => Err(e),
    }
}

enum Change {
    Node(Box<watcher::Event<Node>>),
    Pod(Box<watcher::Event<Pod>>),
    Quota(Box<watcher::Event<ResourceQuota>>),
}

/// Feeds the decision loop while this replica leads: on every new term, fresh watchers List
/// everything (quorum reads), the loop rebuilds from that complete view, then every later change
/// follows on the same channel, in order.
pub async fn run_sync(
    client: Client,
    engine: EngineHandle,
    mut leadership: watch::Receiver<Option<u64>>,
    ready: std::sync::Arc<std::sync::atomic::AtomicBool>,
) {
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
            _ = sync_term(client.clone(), engine.clone(), term, ready.clone()) => {
                tracing::warn!(term, "informers stopped; restarting");
                tokio::time::sleep(Duration::from_secs(1)).await;
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

async fn sync_term(
    client: Client,
    engine: EngineHandle,
    term: u64,
    ready: std::sync::Arc<std::sync::atomic::AtomicBool>,
) {
    let cfg = watcher::Config::default();
    let nodes = watcher(Api::<Node>::all(client.clone()), cfg.clone())
        .map_ok(|e| Change::Node(Box::new(e)))
        .boxed();
    let pods = watcher(Api::<Pod>::all(client.clone()), cfg.clone())
        .map_ok(|e| Change::Pod(Box::new(e)))
        .boxed();
    let quotas = watcher(Api::<ResourceQuota>::all(client), cfg)
        .map_ok(|e| Change::Quota(Box::new(e)))
        .boxed();
    let mut all = futures::stream::select_all([nodes, pods, quotas]);
    let (mut n_buf, mut p_buf, mut q_buf) = (Vec::new(), Vec::new(), Vec::new());
    let mut done = [false; 3];
    let mut rebuilt = false;
    let mut backlog: Vec<Observation> = Vec::new();
    // A watcher that re-lists after the rebuild (e.g. 410 Gone) reports its complete view: objects
    // missing from it were deleted while the watch was down.
    let mut relisted: [Option<Vec<String>>; 3] = [None, None, None];
    while let Some(item) = all.next().await {
        let change = match item {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "watch error (retrying)");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        let mut obs = Vec::new();
        match change {
            Change::Node(ev) => match *ev {
                watcher::Event::InitApply(n) if !rebuilt => n_buf.push(n),
                watcher::Event::InitDone if !rebuilt => done[0] = true,
                watcher::Event::Init => {
                    if rebuilt {
                        relisted[0] = Some(Vec::new());
                    }
                }
                watcher::Event::InitApply(n) => {
                    if let Some(keys) = relisted[0].as_mut() {
                        keys.push(n.name_any());
                    }
                    obs.push(Observation::NodeUpsert(Box::new(n)))
                }
                watcher::Event::InitDone => {
                    if let Some(keep) = relisted[0].take() {
                        obs.push(Observation::Resync {
                            kind: ResyncKind::Nodes,
                            keep,
                        });
                    }
                }
                watcher::Event::Apply(n) => obs.push(Observation::NodeUpsert(Box::new(n))),
                watcher::Event::Delete(n) => obs.push(Observation::NodeDelete(n.name_any())),
            },
            Change::Pod(ev) => match *ev {
                watcher::Event::InitApply(p) if !rebuilt => p_buf.push(p),
                watcher::Event::InitDone if !rebuilt => done[1] = true,
                watcher::Event::Init => {
                    if rebuilt {
                        relisted[1] = Some(Vec::new());
                    }
                }
                watcher::Event::InitApply(p) => {
                    if let Some(keys) = relisted[1].as_mut() {
                        keys.push(p.metadata.uid.clone().unwrap_or_default());
                    }
                    obs.push(Observation::PodUpsert(Box::new(p)))
                }
                watcher::Event::InitDone => {
                    if let Some(keep) = relisted[1].take() {
                        obs.push(Observation::Resync {
                            kind: ResyncKind::Pods,
                            keep,
                        });
                    }
                }
                watcher::Event::Apply(p) => obs.push(Observation::PodUpsert(Box::new(p))),
                watcher::Event::Delete(p) => obs.push(Observation::PodDelete {
                    uid: p.metadata.uid.clone().unwrap_or_default(),
                }),
            },
            Change::Quota(ev) => match *ev {
                watcher::Event::InitApply(q) if !rebuilt => q_buf.push(q),
                watcher::Event::InitDone if !rebuilt => done[2] = true,
                watcher::Event::Init => {
                    if rebuilt {
                        relisted[2] = Some(Vec::new());
                    }
                }
                watcher::Event::InitApply(q) => {
                    if let Some(keys) = relisted[2].as_mut() {
                        keys.push(format!(
                            "{}/{}",
                            q.namespace().unwrap_or_default(),
                            q.name_any()
                        ));
                    }
                    obs.push(Observation::QuotaUpsert(Box::new(q)))
                }
                watcher::Event::InitDone => {
                    if let Some(keep) = relisted[2].take() {
                        obs.push(Observation::Resync {
                            kind: ResyncKind::Quotas,
                            keep,
                        });
                    }
                }
                watcher::Event::Apply(q) => obs.push(Observation::QuotaUpsert(Box::new(q))),
                watcher::Event::Delete(q) => obs.push(Observation::QuotaDelete {
                    namespace: q.namespace().unwrap_or_default(),
                    name: q.name_any(),
                }),
            },
        }
        if !rebuilt {
            backlog.extend(obs);
            if done.iter().all(|d| *d) {
                engine
                    .send(Command::Rebuild {
                        term,
                        nodes: std::mem::take(&mut n_buf),
                        pods: std::mem::take(&mut p_buf),
                        quotas: std::mem::take(&mut q_buf),
                    })
                    .await;
                for o in backlog.drain(..) {
                    engine.send(Command::Observe(o)).await;
                }
                rebuilt = true;
                ready.store(true, std::sync::atomic::Ordering::Relaxed);
                tracing::info!(term, "cluster state rebuilt; serving decisions");
            }
        } else {
            for o in obs {
                engine.send(Command::Observe(o)).await;
            }
        }
    }
}

/// Nudges pods that failed filtering once capacity frees, so kube-scheduler retries them now
/// instead of after its unschedulable timeout (HAMi #1368): a pod update moves an unschedulable
/// pod back to the active queue.
pub async fn run_requeue(
    edge: KubeEdge,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Vec<Unschedulable>>,
) {
    while let Some(pods) = rx.recv().await {
        let stamp = Timestamp::now().as_second().to_string();
        for p in pods.into_iter().take(200) {
            let patch = MetadataPatch {
                annotations: BTreeMap::from([("tessera.io/requeue-at".to_owned(), stamp.clone())]),
                ..Default::default()
            };
            if let Err(e) = edge.patch_pod(&p.namespace, &p.name, &p.uid, patch).await {
                tracing::debug!(pod = %p.name, error = %e, "requeue nudge failed");
            }
        }
    }
}

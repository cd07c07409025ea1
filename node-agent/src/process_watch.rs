//! The unaccounted-process watch (issue 28, item 3): every pass compares the processes NVML
//! reports on the node's GPUs with what the allocations account for
//! ([`crate::unaccounted::classify`]) and acts on what two passes running agree on
//! ([`Confirmer`]): a Warning Event on the pod (or on the Node for a process in no pod), the
//! `tessera_device_plugin_unaccounted_gpu_processes` gauge, a log line, and under
//! [`UnaccountedPolicy::Evict`] the pod's eviction. With a pass every `T`, a lasting unaccounted
//! process is acted on within `2T` (docs/security.md, "The node sees every process").
//!
//! It needs the host's PID namespace (`hostPID`, the chart's default): without it no process's
//! `/proc` entry can be read, every one is *undetermined*, and the pass says so once.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use tessera_runtime::{DisplayChain, spawn_blocking_in_span};

use crate::device_state::DeviceState;
use crate::edges::{EdgeError, PodSource};
use crate::gpu_processes::{GpuProcessSource, ProcReader, list_all};
use crate::metrics::PluginMetrics;
use crate::monitor::{booked_gpus, read_shim_regions, region_paths};
use crate::node_events::{EventObject, NodeEvent, NodeEventType, NodeEvents};
use crate::unaccounted::{
    Confirmer, ContainerName, Exemptions, Findings, Observation, Reason, RegionOwner, ShimRegion,
    classify,
};

/// What the node does about a pod with an unaccounted GPU process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UnaccountedPolicy {
    /// No watch at all.
    Off,
    /// A Warning Event on the pod (the Node for a process in no pod), the metric and a log line.
    #[default]
    Report,
    /// As `Report`, then the pod is evicted: deleted with its UID as a precondition, as the
    /// kubelet evicts (no PodDisruptionBudget holds back a pod using GPUs outside its booking).
    Evict,
}

impl UnaccountedPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            UnaccountedPolicy::Off => "off",
            UnaccountedPolicy::Report => "report",
            UnaccountedPolicy::Evict => "evict",
        }
    }
}

impl FromStr for UnaccountedPolicy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "off" => Ok(UnaccountedPolicy::Off),
            "report" => Ok(UnaccountedPolicy::Report),
            "evict" => Ok(UnaccountedPolicy::Evict),
            other => Err(format!(
                "unknown unaccounted-process policy {other:?} (off, report, evict)"
            )),
        }
    }
}

impl std::fmt::Display for UnaccountedPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Evicts a pod through the API server, with the pod's UID as a precondition (a recreated pod
/// of the same name is never evicted). Tests swap it.
pub trait PodEvictor: Send + Sync + 'static {
    fn evict(&self, namespace: &str, name: &str, uid: &str)
    -> BoxFuture<'_, Result<(), EdgeError>>;
}

/// Reason of the Warning Event that announces an eviction for unaccounted processes.
pub const REASON_EVICTING: &str = "EvictingForUnaccountedGPUProcess";

/// What one pass found and did, for tests and the log.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PassSummary {
    /// Unaccounted processes confirmed this pass (seen in the previous pass too).
    pub confirmed: usize,
    /// Pods reported (Event) this pass, by UID.
    pub reported: BTreeSet<String>,
    /// Pods evicted this pass, by UID.
    pub evicted: BTreeSet<String>,
    /// Processes whose `/proc` entry could not be read.
    pub undetermined: usize,
}

/// The periodic watch. Cheap to clone (shared handles).
#[derive(Clone)]
pub struct ProcessWatch {
    /// `<hook>/vgpu/containers`: the containers' shim regions.
    pub containers_dir: PathBuf,
    /// The node's GPUs (their UUIDs are asked of NVML).
    pub state: Arc<DeviceState>,
    pub gpus: Arc<dyn GpuProcessSource>,
    /// The host's `/proc` (the plugin runs with `hostPID`).
    pub proc: Arc<ProcReader>,
    pub pods: Arc<dyn PodSource>,
    /// Host cgroups allowed to use GPUs (`--unaccounted-allowed-host-cgroups`).
    pub allowed_host_cgroups: Vec<String>,
    pub policy: UnaccountedPolicy,
    pub evictor: Arc<dyn PodEvictor>,
    pub events: NodeEvents,
    pub metrics: PluginMetrics,
    pub confirmer: Arc<Mutex<Confirmer>>,
    /// Set once the "no process could be identified" warning was logged.
    pub said_blind: Arc<std::sync::atomic::AtomicBool>,
}

impl std::fmt::Debug for ProcessWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessWatch")
            .field("containers_dir", &self.containers_dir)
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

/// Why a pass could not finish.
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    #[error("the NVML and /proc reads did not finish")]
    Observe(#[source] tokio::task::JoinError),
}

impl ProcessWatch {
    /// One pass: observe, classify, confirm, act.
    pub async fn pass(&self) -> Result<PassSummary, WatchError> {
        let pods = self.pods.cached();
        let exemptions = Exemptions {
            host_cgroups: self.allowed_host_cgroups.clone(),
            // A container the operator let run without the shim (`CUDA_DISABLE_CONTROL` in an
            // `allowControlEnvNamespaces` namespace) is accounted on the GPUs it was booked.
            shimless_pods: pods
                .iter()
                .filter(|p| {
                    p.containers
                        .iter()
                        .chain(&p.init_containers)
                        .any(|c| c.disable_control)
                })
                .map(|p| p.uid.clone())
                .collect(),
        };
        let booked = booked_gpus(&pods);
        let container_names = pods
            .iter()
            .flat_map(|p| {
                p.container_ids.iter().map(|(id, name)| {
                    (
                        id.clone(),
                        ContainerName {
                            pod_uid: p.uid.clone(),
                            name: name.clone(),
                        },
                    )
                })
            })
            .collect();
        let gpus = self.gpus.clone();
        let proc = self.proc.clone();
        let uuids: Vec<String> = self.state.gpus().into_iter().map(|g| g.uuid).collect();
        let dir = self.containers_dir.clone();
        let observation = spawn_blocking_in_span(move || {
            let listed = list_all(gpus.as_ref(), &uuids);
            // Debug: a GPU that cannot list (a MIG instance, a driver without the call) would
            // otherwise say so every pass; the pass's summary line counts what was listed.
            for e in &listed.failed {
                tracing::debug!(error = %DisplayChain(e), "GPU processes not listed this pass");
            }
            let (regions, _skipped) = read_shim_regions(region_paths(&dir));
            let regions = regions
                .into_iter()
                .map(|(path, snapshot)| {
                    ShimRegion::from_snapshot(RegionOwner::of_path(&path), &snapshot)
                })
                .collect();
            let (identities, _gone) = proc.identify_all(listed.processes.iter().map(|p| p.pid));
            Observation {
                processes: listed.processes,
                regions,
                booked,
                identities,
                container_names,
                ..Default::default()
            }
        })
        .await
        .map_err(WatchError::Observe)?;
        let findings = classify(&observation, &exemptions);
        let listed = observation.processes.len();
        tracing::debug!(
            processes = listed,
            regions = observation.regions.len(),
            identified = observation.identities.len(),
            accounted = findings.accounted,
            unaccounted = findings.unaccounted.len(),
            allowed_host = findings.allowed_host.len(),
            undetermined = findings.undetermined.len(),
            "GPU processes compared with the bookings"
        );
        if listed > 0
            && findings.undetermined.len() == listed
            && !self
                .said_blind
                .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            tracing::warn!(
                processes = listed,
                "no GPU process could be identified from /proc: the plugin needs hostPID \
                 (devicePlugin.hostPID) to tell whose processes use the GPUs"
            );
        }
        let confirmed = self
            .confirmer
            .lock()
            .map(|mut c| c.confirm(&findings.unaccounted))
            .unwrap_or_default();
        let confirmed = Findings {
            unaccounted: confirmed,
            undetermined: findings.undetermined,
            ..Default::default()
        };
        Ok(self.act(&confirmed, &pods).await)
    }

    /// Reports (and under `evict` evicts) what was confirmed; sets the metrics.
    async fn act(
        &self,
        confirmed: &Findings,
        pods: &[crate::identity::PodSnapshot],
    ) -> PassSummary {
        let mut summary = PassSummary {
            confirmed: confirmed.unaccounted.len(),
            undetermined: confirmed.undetermined.len(),
            ..Default::default()
        };
        let per_reason: Vec<(&'static str, usize)> = Reason::CODES
            .into_iter()
            .map(|code| {
                let n = confirmed
                    .unaccounted
                    .iter()
                    .filter(|p| p.reason.code() == code)
                    .count();
                (code, n)
            })
            .collect();
        self.metrics
            .set_unaccounted(&per_reason, summary.undetermined);
        for p in confirmed.outside_pods() {
            tracing::warn!(gpu = %p.gpu_uuid, pid = p.pid, "{}", p.message());
            self.events.emit(NodeEvent {
                kind: NodeEventType::Warning,
                reason: p.reason.code(),
                message: p.message(),
                regarding: EventObject::Node,
            });
        }
        for (uid, processes) in confirmed.by_pod() {
            let Some(message) = confirmed.pod_summary(uid) else {
                continue;
            };
            let Some(pod) = pods.iter().find(|p| p.uid == uid) else {
                // A process in a pod this node's informer does not list (another node's pod
                // cannot be here; a static pod or a pod just created): logged, not acted on.
                tracing::warn!(pod_uid = %uid, "{message}");
                continue;
            };
            let reason = processes
                .first()
                .map_or(Reason::CODES[0], |p| p.reason.code());
            let regarding = EventObject::Pod {
                namespace: pod.namespace.clone(),
                name: pod.name.clone(),
                uid: pod.uid.clone(),
            };
            tracing::warn!(pod = %pod.key(), pod_uid = %uid, policy = %self.policy, "{message}");
            self.events.emit(NodeEvent {
                kind: NodeEventType::Warning,
                reason,
                message: message.clone(),
                regarding: regarding.clone(),
            });
            self.metrics.unaccounted_action("reported");
            summary.reported.insert(uid.to_owned());
            if self.policy != UnaccountedPolicy::Evict || pod.deleting || pod.terminal {
                continue;
            }
            self.events.emit(NodeEvent {
                kind: NodeEventType::Warning,
                reason: REASON_EVICTING,
                message: format!(
                    "evicting the pod (the node's unaccountedProcesses policy is evict): {message}"
                ),
                regarding,
            });
            match self.evictor.evict(&pod.namespace, &pod.name, uid).await {
                Ok(()) => {
                    tracing::warn!(pod = %pod.key(), pod_uid = %uid, "evicted for unaccounted GPU processes");
                    self.metrics.unaccounted_action("evicted");
                    summary.evicted.insert(uid.to_owned());
                }
                Err(e) => {
                    // The API server unreachable, or the pod gone meanwhile: the next pass tries
                    // again while the process is still there.
                    tracing::warn!(pod = %pod.key(), pod_uid = %uid, error = %DisplayChain(&e), "cannot evict the pod; trying again next pass");
                    self.metrics.unaccounted_action("eviction_failed");
                }
            }
        }
        summary
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::path::Path;

    use super::*;
    use crate::gpu::ManagedGpu;
    use crate::gpu_processes::{GpuProcessError, ProcessesOnGpu};
    use crate::health::{HealthPolicy, HealthTracker};
    use crate::testing::{MemoryApi, bound_pod};
    use crate::unaccounted::{GpuProcess, ProcessKind};

    const GOOD: &str = "0f1e2d3c-aaaa-bbbb-cccc-00000000000a";
    const THIEF: &str = "0f1e2d3c-aaaa-bbbb-cccc-00000000000b";

    /// NVML's process lists, scripted per GPU.
    #[derive(Default)]
    struct ScriptedProcesses(Mutex<BTreeMap<String, Vec<u32>>>);

    impl GpuProcessSource for ScriptedProcesses {
        fn processes_on(&self, gpu_uuid: &str) -> Result<ProcessesOnGpu, GpuProcessError> {
            let pids = self
                .0
                .lock()
                .map(|m| m.get(gpu_uuid).cloned().unwrap_or_default())
                .unwrap_or_default();
            Ok(ProcessesOnGpu {
                processes: pids
                    .into_iter()
                    .map(|pid| GpuProcess {
                        gpu_uuid: gpu_uuid.to_owned(),
                        pid,
                        used_bytes: Some(1 << 30),
                        kinds: [ProcessKind::Compute].into(),
                    })
                    .collect(),
                unsupported: Vec::new(),
            })
        }
    }

    #[derive(Default)]
    struct RecordingEvictor(Mutex<Vec<String>>);

    impl PodEvictor for RecordingEvictor {
        fn evict(
            &self,
            namespace: &str,
            name: &str,
            uid: &str,
        ) -> BoxFuture<'_, Result<(), EdgeError>> {
            if let Ok(mut v) = self.0.lock() {
                v.push(format!("{namespace}/{name}/{uid}"));
            }
            Box::pin(async { Ok(()) })
        }
    }

    fn proc_entry(root: &Path, pid: u32, cgroup: &str) {
        let dir = root.join(pid.to_string());
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("cgroup"), format!("0::{cgroup}\n")).unwrap();
        std::fs::write(dir.join("status"), format!("Name:\tx\nNSpid:\t{pid}\t7\n")).unwrap();
    }

    fn pod_cgroup(uid: &str) -> String {
        format!(
            "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/cri-containerd-{}.scope",
            uid.replace('-', "_"),
            "c".repeat(64)
        )
    }

    struct Fixture {
        watch: ProcessWatch,
        evictor: Arc<RecordingEvictor>,
        processes: Arc<ScriptedProcesses>,
        events: tokio::sync::mpsc::Receiver<NodeEvent>,
        _dirs: (tempfile::TempDir, tempfile::TempDir),
    }

    /// GPU-a on the node. Pod `good` was booked GPU-a; pod `thief` was booked GPU-b (another
    /// node's, say). On GPU-a NVML lists: 100 (thief's), 200 (good's, no shim region), 300 (the
    /// persistence daemon, allowed), 400 (a host shell, not allowed).
    fn fixture(policy: UnaccountedPolicy) -> Fixture {
        let proc = tempfile::tempdir().unwrap();
        let containers = tempfile::tempdir().unwrap();
        proc_entry(proc.path(), 100, &pod_cgroup(THIEF));
        proc_entry(proc.path(), 200, &pod_cgroup(GOOD));
        proc_entry(
            proc.path(),
            300,
            "/system.slice/nvidia-persistenced.service",
        );
        proc_entry(proc.path(), 400, "/user.slice/user-0.slice/session-1.scope");
        let api = MemoryApi::default();
        let mut good = bound_pod("node-a", "good", &[&[("GPU-a", 1000, 30)]], 1);
        good.uid = GOOD.into();
        let mut thief = bound_pod("node-a", "thief", &[&[("GPU-b", 1000, 30)]], 1);
        thief.uid = THIEF.into();
        api.add_pod(good);
        api.add_pod(thief);
        let gpus = vec![ManagedGpu {
            uuid: "GPU-a".into(),
            index: 0,
            model_type: "NVIDIA Tesla T4".into(),
            devmem: 15360,
            devcore: 100,
            numa: None,
            replicas: 10,
            mode: "hami-core".into(),
            mig_profiles: Vec::new(),
        }];
        let tracker = HealthTracker::new(HealthPolicy::default(), ["GPU-a".to_owned()]);
        let state = DeviceState::new(gpus, tracker, false, None);
        let processes = Arc::new(ScriptedProcesses::default());
        if let Ok(mut m) = processes.0.lock() {
            m.insert("GPU-a".into(), vec![100, 200, 300, 400]);
        }
        let evictor = Arc::new(RecordingEvictor::default());
        let (events, rx) = NodeEvents::channel();
        let watch = ProcessWatch {
            containers_dir: containers.path().to_owned(),
            state,
            gpus: processes.clone(),
            proc: Arc::new(ProcReader::new(proc.path())),
            pods: Arc::new(api),
            allowed_host_cgroups: vec!["/system.slice/nvidia-persistenced.service".into()],
            policy,
            evictor: evictor.clone(),
            events,
            metrics: PluginMetrics::new(),
            confirmer: Arc::default(),
            said_blind: Arc::default(),
        };
        Fixture {
            watch,
            evictor,
            processes,
            events: rx,
            _dirs: (proc, containers),
        }
    }

    fn drain(rx: &mut tokio::sync::mpsc::Receiver<NodeEvent>) -> Vec<NodeEvent> {
        let mut out = Vec::new();
        while let Ok(e) = rx.try_recv() {
            out.push(e);
        }
        out
    }

    #[tokio::test]
    async fn unaccounted_processes_are_reported_on_the_second_pass_and_allowed_ones_never() {
        let mut f = fixture(UnaccountedPolicy::Report);
        let first = f.watch.pass().await.unwrap();
        assert_eq!(first.confirmed, 0, "one sighting is not enough");
        assert!(drain(&mut f.events).is_empty());

        let second = f.watch.pass().await.unwrap();
        assert_eq!(second.confirmed, 3);
        assert_eq!(second.reported, [GOOD.to_owned(), THIEF.to_owned()].into());
        assert!(second.evicted.is_empty());
        assert!(
            f.evictor.0.lock().unwrap().is_empty(),
            "report never evicts"
        );
        let events = drain(&mut f.events);
        let on = |uid: &str| {
            events
                .iter()
                .find(|e| matches!(&e.regarding, EventObject::Pod { uid: u, .. } if u == uid))
                .unwrap_or_else(|| panic!("no Event on pod {uid}: {events:?}"))
        };
        assert_eq!(on(THIEF).reason, "GpuNotBooked");
        assert!(on(THIEF).message.contains("GPU-a"), "{}", on(THIEF).message);
        assert_eq!(on(GOOD).reason, "GpuProcessWithoutShim");
        let node: Vec<&NodeEvent> = events
            .iter()
            .filter(|e| e.regarding == EventObject::Node)
            .collect();
        assert_eq!(node.len(), 1, "only the host shell: {node:?}");
        assert_eq!(node[0].reason, "GpuProcessOutsidePods");
        assert!(node[0].message.contains("400"), "{}", node[0].message);

        let text = f.watch.metrics.encode();
        assert!(
            text.contains(
                "tessera_device_plugin_unaccounted_gpu_processes{reason=\"GpuNotBooked\"} 1"
            ),
            "{text}"
        );
        assert!(
            text.contains("tessera_device_plugin_unaccounted_actions_total{action=\"reported\"} 2")
        );
    }

    #[tokio::test]
    async fn under_evict_the_pods_go_and_a_process_that_left_is_forgotten() {
        let mut f = fixture(UnaccountedPolicy::Evict);
        f.watch.pass().await.unwrap();
        let second = f.watch.pass().await.unwrap();
        assert_eq!(second.evicted, [GOOD.to_owned(), THIEF.to_owned()].into());
        let evicted = f.evictor.0.lock().unwrap().clone();
        assert_eq!(
            evicted,
            [
                format!("default/good/{GOOD}"),
                format!("default/thief/{THIEF}")
            ]
        );
        let events = drain(&mut f.events);
        assert_eq!(
            events
                .iter()
                .filter(|e| e.reason == REASON_EVICTING)
                .count(),
            2
        );
        // The processes are gone from NVML: nothing is confirmed any more.
        if let Ok(mut m) = f.processes.0.lock() {
            m.clear();
        }
        let third = f.watch.pass().await.unwrap();
        assert_eq!(third.confirmed, 0);
    }
}

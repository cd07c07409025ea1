//! The unaccounted-process watch (issue 28, item 3): every pass compares the processes NVML
//! reports on the node's GPUs with what the allocations account for
//! ([`crate::unaccounted::classify`]) and acts on what two passes running agree on
//! ([`Confirmer`]): a Warning Event on the pod (or on the Node for a process in no pod), the
//! `<prefix>_unaccounted_gpu_processes` gauge, a log line, and under
//! [`UnaccountedPolicy::Evict`] the pod's eviction. With a pass every `T`, a lasting unaccounted
//! process is acted on within `2T` (docs/security.md, "The node sees every process").
//!
//! Both node plugins run it; what differs is what accounts for GPU use on their nodes, which a
//! [`BookingSource`] gives each pass: the device plugin's [`HamiBookings`] (HAMi's booking
//! annotations and the containers' shim regions), the DRA plugin's prepared claims (each claim's
//! GPUs, the pods in its `status.reservedFor`, the claims' shim regions). The metrics go where
//! the plugin's others go ([`UnaccountedMetrics`]: `tessera_device_plugin_*`,
//! `tessera_dra_plugin_*`).
//!
//! It needs the host's PID namespace (`hostPID`, the chart's default): without it no process's
//! `/proc` entry can be read, every one is *undetermined*, and the pass says so once.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use tessera_runtime::{DisplayChain, spawn_blocking_in_span};

use crate::device_state::DeviceState;
use crate::edges::{EdgeError, PodSource};
use crate::gpu_processes::{GpuProcessSource, ProcReader, list_all};
use crate::identity::PodSnapshot;
use crate::metrics::PluginMetrics;
use crate::monitor::{
    RegionPath, SkippedFile, booked_gpus, booked_memory, claim_region_paths, read_shim_regions,
    region_paths, write_host_pid,
};
use crate::node_events::{EventObject, NodeEvent, NodeEventType, NodeEvents};
use crate::unaccounted::{
    ClaimBooking, Confirmer, ContainerName, Exemptions, Findings, Observation, Reason, RegionOwner,
    ShimRegion, classify, host_pids_to_record, over_booked,
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

/// The watch's flags, the same in both node plugins (`#[command(flatten)]`).
#[derive(Debug, Clone, clap::Args)]
#[command(about = None, long_about = None)]
pub struct WatchArgs {
    /// What the node does about a GPU process no allocation accounts for (a process in a pod
    /// not booked that GPU, a booked process without the shim, a process in no pod), once two
    /// passes running saw it: `report` (a Warning Event on the pod or the Node, the plugin's
    /// `*_unaccounted_gpu_processes` metric, a log line), `evict` (report, then evict the pod:
    /// deleted with its UID as precondition, as the kubelet evicts) or `off`. Needs `hostPID`.
    #[arg(long, env = "UNACCOUNTED_PROCESS_POLICY", default_value = "report")]
    pub unaccounted_process_policy: UnaccountedPolicy,
    /// Host cgroups whose processes may use the GPUs (comma list of path prefixes matched on `/`
    /// boundaries, e.g. `/system.slice/nvidia-mps.service`; `/` allows every host process).
    #[arg(
        long,
        env = "UNACCOUNTED_ALLOWED_HOST_CGROUPS",
        value_delimiter = ',',
        default_value = ""
    )]
    pub unaccounted_allowed_host_cgroups: Vec<String>,
    /// Seconds between passes of the unaccounted-process watch (a lasting process is acted on
    /// within two).
    #[arg(long, env = "UNACCOUNTED_PERIOD_SECONDS", default_value_t = 15)]
    pub unaccounted_period_seconds: u64,
    /// The host's `/proc` (the plugin runs with `hostPID`): each GPU process's cgroup and PID
    /// namespace are read there.
    #[arg(long, env = "PROC_ROOT", default_value = "/proc")]
    pub proc_root: PathBuf,
    /// MiB per process that a pod's GPU processes may use, by NVML's count, beyond the pod's
    /// memory booking on a GPU (on a DRA node, the memory of every claim the pod holds there)
    /// before the watch reports the pod (`GpuMemoryOverBooking`, under
    /// `--unaccounted-process-policy`): what the driver reserves for a process outside any
    /// allocation the shim sees (its context, local memory).
    #[arg(long, env = "UNACCOUNTED_MEMORY_ALLOWANCE_MIB", default_value_t = DEFAULT_MEMORY_ALLOWANCE_MIB)]
    pub unaccounted_memory_allowance_mib: u64,
}

/// The default of `--unaccounted-memory-allowance-mib`: 518 MiB beyond the shim's count was
/// measured for a 1 GiB PyTorch process on an H200 (docs/gpu-validation.md, check 8).
pub const DEFAULT_MEMORY_ALLOWANCE_MIB: u64 = 1024;

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

/// Where a pass reads shim regions, and whose they are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegionDir {
    /// `<hook>/vgpu/containers`: one `<podUID>_<container>/` per container the device plugin
    /// allocated ([`region_paths`]).
    Containers(PathBuf),
    /// `<hook>/vgpu/claims`: one `<claimUID>/` per DRA claim prepared on the node, shared by
    /// every container using the claim ([`claim_region_paths`]).
    Claims(PathBuf),
}

impl RegionDir {
    /// The region files in the directory (not opened yet). Blocking.
    fn paths(&self) -> (Vec<RegionPath>, Vec<SkippedFile>) {
        match self {
            RegionDir::Containers(dir) => region_paths(dir),
            RegionDir::Claims(dir) => claim_region_paths(dir),
        }
    }
}

/// What accounts for GPU use on the node at one pass: the facts NVML's processes are compared
/// with. Empty fields mean "none".
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Bookings {
    /// UUIDs of the GPUs whose processes are listed.
    pub gpus: Vec<String>,
    /// Per pod UID, the GPUs its HAMi booking annotations give it ([`Observation::booked`]).
    pub booked: BTreeMap<String, BTreeSet<String>>,
    /// The DRA claims prepared on the node, by claim UID ([`Observation::claims`]).
    pub claims: BTreeMap<String, ClaimBooking>,
    /// Pods allowed to run without the shim on the GPUs they were booked
    /// ([`Exemptions::shimless_pods`]).
    pub shimless_pods: BTreeSet<String>,
    /// Where the shim regions that vouch for the booked processes are.
    pub regions: Vec<RegionDir>,
    /// The memory check ([`over_booked`]), where the source knows each pod's memory booking;
    /// `None` judges no pod's memory.
    pub memory: Option<MemoryBookings>,
}

/// What the memory check compares NVML's per-process memory with.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemoryBookings {
    /// Per pod UID and GPU UUID, the MiB booked ([`Observation::booked_mib`]).
    pub booked_mib: BTreeMap<String, BTreeMap<String, u64>>,
    /// MiB allowed per process beyond the booking, for what the driver reserves outside any
    /// allocation the shim sees (`--unaccounted-memory-allowance-mib`).
    pub allowance_mib: u64,
}

/// The node plugin's side of the watch: its GPUs and what accounts for their use, read at the
/// start of every pass. A source that cannot tell now fails the pass (nothing is reported on a
/// guess: a booking left out would make its pods' processes look unbooked).
pub trait BookingSource: Send + Sync + std::fmt::Debug + 'static {
    /// The bookings now; `pods` are the node's pods as the pass sees them (the informer's).
    fn bookings<'a>(
        &'a self,
        pods: &'a [PodSnapshot],
    ) -> BoxFuture<'a, Result<Bookings, EdgeError>>;
}

/// The device plugin's bookings: the GPUs it advertises, each pod's HAMi booking annotations,
/// the containers the operator let run without the shim, and the containers' regions.
#[derive(Clone)]
pub struct HamiBookings {
    /// `<hook>/vgpu/containers`: the containers' shim regions.
    pub containers_dir: PathBuf,
    /// The node's GPUs (their UUIDs are asked of NVML).
    pub state: Arc<DeviceState>,
    /// MiB per process a pod may use beyond its booking before the memory check reports it.
    pub memory_allowance_mib: u64,
}

impl std::fmt::Debug for HamiBookings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HamiBookings")
            .field("containers_dir", &self.containers_dir)
            .finish_non_exhaustive()
    }
}

impl BookingSource for HamiBookings {
    fn bookings<'a>(
        &'a self,
        pods: &'a [PodSnapshot],
    ) -> BoxFuture<'a, Result<Bookings, EdgeError>> {
        let bookings = Bookings {
            gpus: self.state.gpus().into_iter().map(|g| g.uuid).collect(),
            booked: booked_gpus(pods),
            claims: BTreeMap::new(),
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
            regions: vec![RegionDir::Containers(self.containers_dir.clone())],
            memory: Some(MemoryBookings {
                booked_mib: booked_memory(pods),
                allowance_mib: self.memory_allowance_mib,
            }),
        };
        Box::pin(async move { Ok(bookings) })
    }
}

/// Where the watch's gauge and counter go: the plugin's own registry, under its own prefix
/// (`tessera_device_plugin_*`, `tessera_dra_plugin_*`).
pub trait UnaccountedMetrics: Clone + Send + Sync + 'static {
    /// The confirmed unaccounted processes of the last pass, counted per reason code (every
    /// code, 0 included), and the processes whose `/proc` entry could not be read.
    fn set_unaccounted(&self, per_reason: &[(&'static str, usize)], undetermined: usize);
    /// One action on a pod with unaccounted processes (`reported`, `evicted`,
    /// `eviction_failed`).
    fn unaccounted_action(&self, action: &'static str);
}

impl UnaccountedMetrics for PluginMetrics {
    fn set_unaccounted(&self, per_reason: &[(&'static str, usize)], undetermined: usize) {
        PluginMetrics::set_unaccounted(self, per_reason, undetermined);
    }

    fn unaccounted_action(&self, action: &'static str) {
        PluginMetrics::unaccounted_action(self, action);
    }
}

/// The periodic watch. Cheap to clone (shared handles). `M` is where its metrics go (the
/// device plugin's by default).
#[derive(Clone)]
pub struct ProcessWatch<M = PluginMetrics> {
    /// The node's GPUs and what accounts for their use.
    pub bookings: Arc<dyn BookingSource>,
    pub gpus: Arc<dyn GpuProcessSource>,
    /// The host's `/proc` (the plugin runs with `hostPID`).
    pub proc: Arc<ProcReader>,
    pub pods: Arc<dyn PodSource>,
    /// Host cgroups allowed to use GPUs (`--unaccounted-allowed-host-cgroups`).
    pub allowed_host_cgroups: Vec<String>,
    pub policy: UnaccountedPolicy,
    pub evictor: Arc<dyn PodEvictor>,
    pub events: NodeEvents,
    pub metrics: M,
    pub confirmer: Arc<Mutex<Confirmer>>,
    /// Set once the "no process could be identified" warning was logged.
    pub said_blind: Arc<std::sync::atomic::AtomicBool>,
}

impl<M> std::fmt::Debug for ProcessWatch<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessWatch")
            .field("bookings", &self.bookings)
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

/// Why a pass could not finish.
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    #[error("cannot read what accounts for the node's GPU use")]
    Bookings(#[source] EdgeError),
    #[error("the NVML and /proc reads did not finish")]
    Observe(#[source] tokio::task::JoinError),
}

impl<M: UnaccountedMetrics> ProcessWatch<M> {
    /// One pass: observe, classify, confirm, act.
    pub async fn pass(&self) -> Result<PassSummary, WatchError> {
        let pods = self.pods.cached();
        let Bookings {
            gpus: uuids,
            booked,
            claims,
            shimless_pods,
            regions: region_dirs,
            memory,
        } = self
            .bookings
            .bookings(&pods)
            .await
            .map_err(WatchError::Bookings)?;
        let exemptions = Exemptions {
            host_cgroups: self.allowed_host_cgroups.clone(),
            shimless_pods,
        };
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
        let (booked_mib, allowance_mib) = match memory {
            Some(m) => (m.booked_mib, Some(m.allowance_mib)),
            None => (BTreeMap::new(), None),
        };
        let observation = spawn_blocking_in_span(move || {
            let listed = list_all(gpus.as_ref(), &uuids);
            // Debug: a GPU that cannot list (a MIG instance, a driver without the call) would
            // otherwise say so every pass; the pass's summary line counts what was listed.
            for e in &listed.failed {
                tracing::debug!(error = %DisplayChain(e), "GPU processes not listed this pass");
            }
            let (paths, regions): (Vec<_>, Vec<_>) = region_dirs
                .iter()
                .flat_map(|dir| {
                    let (found, _skipped) = read_shim_regions(dir.paths());
                    found
                })
                .map(|(path, snapshot)| {
                    let region = ShimRegion::from_snapshot(RegionOwner::of_path(&path), &snapshot);
                    (path.path, region)
                })
                .unzip();
            let (identities, _gone) = proc.identify_all(listed.processes.iter().map(|p| p.pid));
            let observation = Observation {
                processes: listed.processes,
                regions,
                booked,
                booked_mib,
                claims,
                identities,
                container_names,
            };
            // The host PIDs of the containers' processes, for the shim's NVML view (issue 31).
            for r in host_pids_to_record(&observation) {
                let path: &std::path::Path = &paths[r.region];
                if let Err(e) = write_host_pid(path, r.pid, r.host_pid) {
                    tracing::debug!(region = %path.display(), error = %DisplayChain(&e), "host PID not recorded");
                }
            }
            observation
        })
        .await
        .map_err(WatchError::Observe)?;
        let mut findings = classify(&observation, &exemptions);
        if let Some(allowance) = allowance_mib {
            findings
                .unaccounted
                .extend(over_booked(&observation, &exemptions, allowance));
        }
        let listed = observation.processes.len();
        tracing::debug!(
            processes = listed,
            regions = observation.regions.len(),
            claims = observation.claims.len(),
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
                 (the chart's devicePlugin.hostPID; the DRA plugin's pod has it unless \
                 dra.unaccountedProcesses.policy is off) to tell whose processes use the GPUs"
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
    async fn act(&self, confirmed: &Findings, pods: &[PodSnapshot]) -> PassSummary {
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
    use std::path::PathBuf;

    use super::*;
    use crate::gpu::ManagedGpu;
    use crate::health::{HealthPolicy, HealthTracker};
    use crate::testing::{
        MemoryApi, RecordingEvictor, ScriptedProcesses, bound_pod, pod_cgroup, proc_entry,
        region_with_process,
    };
    use crate::unaccounted::ClaimBooking;

    const GOOD: &str = "0f1e2d3c-aaaa-bbbb-cccc-00000000000a";
    const THIEF: &str = "0f1e2d3c-aaaa-bbbb-cccc-00000000000b";

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
        fixture_with(policy, 1024)
    }

    /// [`fixture`] with a memory allowance of `allowance_mib` per process (every scripted
    /// process uses 1024 MiB; `good` booked 1000 MiB on GPU-a).
    fn fixture_with(policy: UnaccountedPolicy, allowance_mib: u64) -> Fixture {
        let proc = tempfile::tempdir().unwrap();
        let containers = tempfile::tempdir().unwrap();
        proc_entry(proc.path(), 100, &pod_cgroup(THIEF), 7);
        proc_entry(proc.path(), 200, &pod_cgroup(GOOD), 7);
        proc_entry(
            proc.path(),
            300,
            "/system.slice/nvidia-persistenced.service",
            7,
        );
        proc_entry(
            proc.path(),
            400,
            "/user.slice/user-0.slice/session-1.scope",
            7,
        );
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
            bookings: Arc::new(HamiBookings {
                containers_dir: containers.path().to_owned(),
                state,
                memory_allowance_mib: allowance_mib,
            }),
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

    /// The memory check: with no allowance, `good`'s one process (1024 MiB by NVML against the
    /// 1000 MiB booked on GPU-a) puts the pod over its booking, reported on the second pass
    /// with both figures and evicted under `evict`; `thief` booked no memory on GPU-a and is
    /// left to `GpuNotBooked`. With the default allowance neither is over.
    #[tokio::test]
    async fn a_pod_over_its_memory_booking_is_reported_and_evicted() {
        let mut f = fixture_with(UnaccountedPolicy::Evict, 0);
        assert_eq!(f.watch.pass().await.unwrap().confirmed, 0);
        let second = f.watch.pass().await.unwrap();
        assert_eq!(second.confirmed, 4, "three as before, and good's memory");
        assert!(second.evicted.contains(GOOD));
        // One Event per pod, named after its first finding (here: no shim region), whose
        // message also says what the memory check found.
        let events = drain(&mut f.events);
        let on_good: Vec<&NodeEvent> = events
            .iter()
            .filter(|e| {
                e.reason != REASON_EVICTING
                    && matches!(&e.regarding, EventObject::Pod { uid, .. } if uid == GOOD)
            })
            .collect();
        assert_eq!(on_good.len(), 1, "{events:?}");
        for part in [
            "process 200 of this pod uses 1024 MiB of GPU GPU-a",
            "the 1000 MiB it was allocated",
        ] {
            assert!(on_good[0].message.contains(part), "{}", on_good[0].message);
        }
        assert!(
            !events.iter().any(
                |e| matches!(&e.regarding, EventObject::Pod { uid, .. } if uid == THIEF)
                    && e.message.contains("allocated there")
            ),
            "the thief booked no memory on GPU-a: {events:?}"
        );
        let text = f.watch.metrics.encode();
        assert!(
            text.contains(
                "tessera_device_plugin_unaccounted_gpu_processes{reason=\"GpuMemoryOverBooking\"} 1"
            ),
            "{text}"
        );

        let mut f = fixture(UnaccountedPolicy::Report);
        f.watch.pass().await.unwrap();
        f.watch.pass().await.unwrap();
        assert!(
            !drain(&mut f.events)
                .iter()
                .any(|e| e.reason == "GpuMemoryOverBooking")
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

    /// What a DRA node's driver says: the claims prepared on it (their GPUs and the pods in
    /// their `status.reservedFor`) and the claims' region directory; no HAMi booking counts.
    #[derive(Debug)]
    struct PreparedClaims {
        claims_dir: PathBuf,
        claims: BTreeMap<String, ClaimBooking>,
    }

    impl BookingSource for PreparedClaims {
        fn bookings<'a>(
            &'a self,
            _pods: &'a [PodSnapshot],
        ) -> BoxFuture<'a, Result<Bookings, EdgeError>> {
            let bookings = Bookings {
                gpus: vec!["GPU-a".into()],
                claims: self.claims.clone(),
                regions: vec![RegionDir::Claims(self.claims_dir.clone())],
                ..Default::default()
            };
            Box::pin(async move { Ok(bookings) })
        }
    }

    const SHARER: &str = "0f1e2d3c-aaaa-bbbb-cccc-00000000000c";
    const STATIC: &str = "0f1e2d3c-aaaa-bbbb-cccc-00000000000d";
    const STRANGER: &str = "0f1e2d3c-aaaa-bbbb-cccc-00000000000e";

    #[tokio::test]
    async fn a_dra_node_accounts_claims_by_their_regions_and_reports_the_rest() {
        // GPU-a on a DRA node. Claim `claim-1` holds GPU-a for pod `sharer`, and its region
        // lists the sharer's process (PID 7 in its container). Claim `claim-2` holds GPU-a for
        // pod `static`, whose process has no shim (no region in claim-2's directory; claim-1's
        // region does not vouch for it, though it lists a PID 7 too). Pod `stranger` uses no
        // claim; its HAMi booking annotations name GPU-a, which on a DRA node books nothing.
        let proc = tempfile::tempdir().unwrap();
        let claims_dir = tempfile::tempdir().unwrap();
        proc_entry(proc.path(), 100, &pod_cgroup(SHARER), 7);
        proc_entry(proc.path(), 200, &pod_cgroup(STATIC), 7);
        proc_entry(proc.path(), 300, &pod_cgroup(STRANGER), 7);
        std::fs::create_dir_all(claims_dir.path().join("claim-1")).unwrap();
        std::fs::write(
            claims_dir.path().join("claim-1/shim.cache"),
            region_with_process("GPU-a", 7),
        )
        .unwrap();
        std::fs::create_dir_all(claims_dir.path().join("claim-2")).unwrap();
        let claim = |pod: &str| ClaimBooking {
            gpus: ["GPU-a".to_owned()].into(),
            pods: [pod.to_owned()].into(),
        };
        let bookings = PreparedClaims {
            claims_dir: claims_dir.path().to_owned(),
            claims: BTreeMap::from([
                ("claim-1".to_owned(), claim(SHARER)),
                ("claim-2".to_owned(), claim(STATIC)),
            ]),
        };
        let api = MemoryApi::default();
        for (name, uid) in [("sharer", SHARER), ("static", STATIC)] {
            let mut pod = bound_pod("node-a", name, &[], 1);
            pod.annotations.clear();
            pod.uid = uid.into();
            api.add_pod(pod);
        }
        let mut stranger = bound_pod("node-a", "stranger", &[&[("GPU-a", 1000, 30)]], 1);
        stranger.uid = STRANGER.into();
        api.add_pod(stranger);
        let processes = Arc::new(ScriptedProcesses::default());
        if let Ok(mut m) = processes.0.lock() {
            m.insert("GPU-a".into(), vec![100, 200, 300]);
        }
        let evictor = Arc::new(RecordingEvictor::default());
        let (events, mut rx) = NodeEvents::channel();
        let watch = ProcessWatch {
            bookings: Arc::new(bookings),
            gpus: processes,
            proc: Arc::new(ProcReader::new(proc.path())),
            pods: Arc::new(api),
            allowed_host_cgroups: Vec::new(),
            policy: UnaccountedPolicy::Evict,
            evictor: evictor.clone(),
            events,
            metrics: PluginMetrics::new(),
            confirmer: Arc::default(),
            said_blind: Arc::default(),
        };

        assert_eq!(watch.pass().await.unwrap().confirmed, 0);
        let second = watch.pass().await.unwrap();
        assert_eq!(second.confirmed, 2, "the sharer's process is accounted");
        assert_eq!(
            second.reported,
            [STATIC.to_owned(), STRANGER.to_owned()].into()
        );
        assert_eq!(second.evicted, second.reported);
        let events = drain(&mut rx);
        let reason_on = |uid: &str| {
            events
                .iter()
                .find(|e| {
                    e.reason != REASON_EVICTING
                        && matches!(&e.regarding, EventObject::Pod { uid: u, .. } if u == uid)
                })
                .map(|e| e.reason)
        };
        assert_eq!(reason_on(STRANGER), Some("GpuNotBooked"));
        assert_eq!(reason_on(STATIC), Some("GpuProcessWithoutShim"));
        assert_eq!(reason_on(SHARER), None, "{events:?}");
        let evicted = evictor.0.lock().unwrap().clone();
        assert_eq!(
            evicted,
            [
                format!("default/static/{STATIC}"),
                format!("default/stranger/{STRANGER}")
            ]
        );
    }
}

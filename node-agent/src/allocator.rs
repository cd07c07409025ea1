//! `Allocate` and `GetPreferredAllocation`: identity (pure, [`crate::identity`]) + response
//! (pure, [`crate::container_env`]) + the I/O at the edges behind small traits, all inside one
//! time budget so a slow apiserver or kubelet never stalls the node's admissions.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use hami_contract::annotations as keys;
use hami_contract::devices::{DeviceListError, PodDevices};
use kubelet_proto::deviceplugin::v1beta1 as dp;
use tessera_runtime::{DisplayChain, spawn_task};
use tokio::sync::Mutex;
// Deadlines on tokio's clock: the budget follows `tokio::time` (paused in tests), not the wall.
use tokio::time::Instant;

use crate::cached_identity::{CacheCall, PodReader, choose_from_cache, lists_only_active_pods};
use crate::container_env::{
    ContainerResponse, ContainerTarget, ResponseError, ResponseSettings, container_response,
};
use crate::edges::{EdgeError, PodPatcher, PodResourcesSource, PodSource};
use crate::gpu::physical_uuid;
use crate::identity::{
    BookingPolicy, CallFacts, Choice, IdentityError, Ledger, PodResourcesView, PodSnapshot,
    hami_lock_is_stale, likely_admitting, pending_pods_checked, select,
};
use crate::metrics::PluginMetrics;

/// Why an `Allocate` failed. The kubelet puts the message in the pod's events: the gRPC status
/// carries the whole chain ([`DisplayChain`]), e.g. `tessera: cannot create the container cache
/// directory /x: Permission denied (os error 13)`.
#[derive(Debug, thiserror::Error)]
pub enum AllocateError {
    #[error("tessera: {0}")]
    Identity(#[from] IdentityError),
    #[error("tessera: pod {pod} asks for GPU {uuid}, which this node does not manage")]
    UnknownGpu { pod: String, uuid: String },
    #[error("tessera: pod {pod} container {container}")]
    Response {
        pod: String,
        container: String,
        #[source]
        source: ResponseError,
    },
    #[error("tessera: cannot create the container cache directory {dir}")]
    CacheDir {
        dir: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "tessera: cannot record the allocation of pod {pod}: its hami.io/vgpu-devices-to-allocate is unreadable"
    )]
    Entries {
        pod: String,
        #[source]
        source: DeviceListError,
    },
    #[error("tessera: cannot record the allocation of pod {pod}")]
    Patch {
        pod: String,
        #[source]
        source: EdgeError,
    },
    #[error(
        "tessera: cannot read the pods bound to node {node}, so the pod being admitted cannot be identified safely"
    )]
    PodList {
        node: String,
        #[source]
        source: EdgeError,
    },
    #[error(
        "tessera: reading the pods bound to node {node} did not finish within the call's budget; refusing rather than guessing from a stale cache"
    )]
    PodListTimeout { node: String },
    #[error(
        "tessera: allocation did not finish within {0:?}; refusing rather than stalling the kubelet"
    )]
    Timeout(Duration),
    #[error("tessera: request has no container requests")]
    Empty,
    #[error("tessera: pod {pod} container {container}: no MIG instance")]
    Mig {
        pod: String,
        container: String,
        #[source]
        source: Box<crate::mig::MigAllocateError>,
    },
    #[error(
        "tessera: pod {pod} container {container} was given MIG instances and shared GPUs together; a container gets one kind or the other (ask with nvidia.com/vgpu-mode: mig or hami-core)"
    )]
    MixedMig { pod: String, container: String },
}

impl AllocateError {
    /// `<namespace>/<name>` of the pod the refused call was for, when it got that far.
    pub fn pod(&self) -> Option<&str> {
        match self {
            AllocateError::UnknownGpu { pod, .. }
            | AllocateError::Response { pod, .. }
            | AllocateError::Entries { pod, .. }
            | AllocateError::Patch { pod, .. }
            | AllocateError::Mig { pod, .. }
            | AllocateError::MixedMig { pod, .. }
            | AllocateError::Identity(
                IdentityError::AdmittedPodNotPending { pod, .. }
                | IdentityError::AmbiguousReask { pod, .. },
            ) => Some(pod),
            _ => None,
        }
    }
}

/// Where identification reads the node's pods from.
#[derive(Debug)]
enum PodView {
    /// The informer's cache: may lag; only for answers that cannot swap limits.
    Cache,
    /// Read after the call began: the cache completed and confirmed by reads by name where that
    /// is exact, else a consistent LIST; with the read by name started before the kubelet's
    /// `List` answered, if any.
    Fresh(Option<EarlyRead>),
}

/// A read by name started as the call began, before the kubelet's pod-resources `List`
/// answered, of the pod the cache says the kubelet most likely admits
/// ([`crate::identity::likely_admitting`]): the two then overlap. It is a read issued after the
/// call began like any other (design step 7); it only saves waiting for it. Aborted when the
/// call does not ask for that pod.
#[derive(Debug)]
struct EarlyRead {
    key: String,
    task: tokio::task::JoinHandle<Result<Option<PodSnapshot>, EdgeError>>,
}

impl Drop for EarlyRead {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What an answer was decided on (the `read` label of the identity metric).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Read {
    /// The informer's cache (`GetPreferredAllocation` only).
    Cache,
    /// The cache, completed and confirmed by reads by name ([`crate::cached_identity`]).
    CacheConfirmed,
    /// A consistent LIST of the node's pods.
    List,
}

impl Read {
    fn as_str(self) -> &'static str {
        match self {
            Read::Cache => "cache",
            Read::CacheConfirmed => "cache_confirmed",
            Read::List => "list",
        }
    }
}

/// A step of an `Allocate` call (the `step` label of
/// `tessera_device_plugin_allocate_step_duration_seconds`): where the kubelet's wait goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// The kubelet's pod-resources `List`.
    PodResources,
    /// Deciding: the reads by name or the LIST, and selection.
    Identify,
    /// The container's cache directory (a tmpfs mount by default) and its limits file.
    Files,
    /// The pod's record (`vgpu-devices-to-allocate`, `bind-phase`) when written before the
    /// answer (not where it follows the answer: design step 8).
    Patch,
}

impl Step {
    fn as_str(self) -> &'static str {
        match self {
            Step::PodResources => "pod_resources",
            Step::Identify => "identify",
            Step::Files => "files",
            Step::Patch => "patch",
        }
    }
}

/// The pod source's reads by name, as [`crate::cached_identity`] asks for them; the first read
/// of the early read's pod takes its answer.
struct ApiReader<'a> {
    source: &'a dyn PodSource,
    early: std::sync::Mutex<Option<EarlyRead>>,
}

impl<'a> ApiReader<'a> {
    fn new(source: &'a dyn PodSource, early: Option<EarlyRead>) -> Self {
        ApiReader {
            source,
            early: std::sync::Mutex::new(early),
        }
    }

    /// Whether it still holds an early read: one was started and nothing asked for its pod.
    fn holds_early_read(&self) -> bool {
        self.early.lock().map_or(true, |early| early.is_some())
    }
}

impl PodReader for ApiReader<'_> {
    type Error = EdgeError;
    fn read(
        &self,
        namespace: &str,
        name: &str,
    ) -> impl std::future::Future<Output = Result<Option<PodSnapshot>, EdgeError>> + Send {
        let key = format!("{namespace}/{name}");
        let early = self
            .early
            .lock()
            .ok()
            .and_then(|mut early| early.take_if(|e| e.key == key));
        // Owned copies: the future outlives the borrowed names under the trait's signature.
        let (source, namespace, name) = (self.source, namespace.to_owned(), name.to_owned());
        async move {
            if let Some(mut early) = early
                && let Ok(answer) = (&mut early.task).await
            {
                return answer;
            }
            // No early read of this pod (or its task was lost): read it now.
            source.get(&namespace, &name).await
        }
    }
}

/// How long an `Allocate` may take before it fails closed. The kubelet has no timeout on the
/// call and admits one pod at a time, so a hung API server would stall every admission on the
/// node; but a refusal rejects the pod for good (`UnexpectedAdmissionError`: a bare pod is not
/// recreated). Two seconds rejected pods in bursts on two busy cores (a LIST or a PATCH past it
/// at load average 47, `docs/benchmarks.md`); ten keeps a stall bounded and lets a slow but
/// working API server answer.
pub const DEFAULT_ALLOCATE_BUDGET: Duration = Duration::from_secs(10);

/// How long `GetPreferredAllocation` may take: it only steers the kubelet's choice of replicas
/// and answers from the cache, so a neutral answer is always safe and never worth a stall.
const PREFERRED_BUDGET: Duration = Duration::from_secs(2);

/// HAMi's GPU scheduler name (`schedulerName` in its chart).
pub const DEFAULT_SCHEDULER_NAME: &str = "hami-scheduler";

/// Everything `Allocate` needs.
pub struct Allocator {
    pub node: String,
    pub settings: ResponseSettings,
    /// UUIDs of the GPUs this plugin advertises (updated when discovery changes).
    pub managed_uuids: Arc<RwLock<BTreeSet<String>>>,
    pub pods: Arc<dyn PodSource>,
    pub patcher: Arc<dyn PodPatcher>,
    pub pod_resources: Arc<dyn PodResourcesSource>,
    /// Whole-call budget ([`DEFAULT_ALLOCATE_BUDGET`] unless the daemon's
    /// `--allocate-timeout-seconds` says otherwise).
    pub budget: Duration,
    /// Budget for one pod-resources `List`.
    pub pod_resources_budget: Duration,
    pub metrics: Option<PluginMetrics>,
    /// `spec.schedulerName` values whose bookings are believed (HAMi's `hami-scheduler` by
    /// default; the chart passes its `schedulerName`).
    pub scheduler_names: BTreeSet<String>,
    /// Dynamic MIG: the carver (set on a node in operating mode `mig`) and the GPUs it serves.
    pub mig: Option<Arc<crate::mig::MigManager>>,
    pub mig_gpus: Arc<RwLock<crate::mig::MigGpus>>,
    /// How containers' cache directories are made (their size limit).
    pub cache_dirs: crate::cache_dir::CacheDirs,
    ledger: Mutex<Ledger>,
    /// Which kubelet instance the plugin serves: bumped each time it serves a new one.
    kubelet_generation: AtomicU64,
    /// The kubelet's last pod-resources `List` answered (reads start early only then: without
    /// it the call decides on a LIST).
    pod_resources_answers: AtomicBool,
}

impl std::fmt::Debug for Allocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Allocator")
            .field("node", &self.node)
            .field("budget", &self.budget)
            .finish_non_exhaustive()
    }
}

impl Allocator {
    pub fn new(
        node: String,
        settings: ResponseSettings,
        managed_uuids: Arc<RwLock<BTreeSet<String>>>,
        pods: Arc<dyn PodSource>,
        patcher: Arc<dyn PodPatcher>,
        pod_resources: Arc<dyn PodResourcesSource>,
    ) -> Self {
        Allocator {
            node,
            settings,
            managed_uuids,
            pods,
            patcher,
            pod_resources,
            budget: DEFAULT_ALLOCATE_BUDGET,
            pod_resources_budget: Duration::from_millis(500),
            metrics: None,
            scheduler_names: BTreeSet::from([DEFAULT_SCHEDULER_NAME.to_owned()]),
            mig: None,
            mig_gpus: Arc::default(),
            cache_dirs: crate::cache_dir::CacheDirs::default(),
            ledger: Mutex::new(Ledger::default()),
            kubelet_generation: AtomicU64::new(0),
            pod_resources_answers: AtomicBool::new(false),
        }
    }

    /// Empties and (re)creates a container's cache directory with the node's size limit
    /// ([`crate::cache_dir::CacheDirs::prepare_reported`]).
    fn prepare_cache_dir(&self, dir: &str) -> Result<(), AllocateError> {
        self.cache_dirs
            .prepare_reported(std::path::Path::new(dir))
            .map_err(|source| AllocateError::CacheDir {
                dir: dir.to_owned(),
                source,
            })
    }

    /// The plugin serves a new kubelet instance (it registered again after a kubelet restart):
    /// the new kubelet may ask again for pods the previous one was served.
    pub fn kubelet_restarted(&self) {
        self.kubelet_generation.fetch_add(1, Ordering::Relaxed);
    }

    /// The ledger, told which kubelet it serves now.
    async fn ledger(&self) -> tokio::sync::MutexGuard<'_, Ledger> {
        let mut ledger = self.ledger.lock().await;
        ledger.set_kubelet(self.kubelet_generation.load(Ordering::Relaxed));
        ledger
    }

    /// Which bookings are believed: the GPU scheduler's pods, on this node, naming this node's GPUs.
    fn booking_policy(&self) -> BookingPolicy {
        let managed = self
            .managed_uuids
            .read()
            .map(|m| m.clone())
            .unwrap_or_default();
        BookingPolicy::strict(self.scheduler_names.clone(), managed)
    }

    async fn pod_resources_view(&self) -> Option<PodResourcesView> {
        let view = self.pod_resources_list().await;
        self.pod_resources_answers
            .store(view.is_some(), Ordering::Relaxed);
        view
    }

    async fn pod_resources_list(&self) -> Option<PodResourcesView> {
        match tokio::time::timeout(self.pod_resources_budget, self.pod_resources.list()).await {
            Ok(Ok(view)) => view,
            Ok(Err(e)) => {
                tracing::warn!(error = %DisplayChain(&e), "pod-resources List failed; identifying without it");
                None
            }
            Err(_) => {
                tracing::warn!("pod-resources List timed out; identifying without it");
                None
            }
        }
    }

    /// Identity. `Allocate` never decides on the informer's cache alone: a lagging cache can
    /// both miss the pod being admitted (bound after its last event) and still show as pending
    /// a pod the kubelet already rejected, and then name that pod as the unique candidate,
    /// handing its limits to the wrong container. It decides either on the cache completed and
    /// confirmed by reads by name, where that gives exactly a LIST's answer
    /// ([`crate::cached_identity`]: a 1.34+ kubelet's pod-resources `List` answered), or on a
    /// fresh, consistent LIST of the node's pods. The extender binds a pod only after it saw
    /// every confusable pod stop being pending, and the kubelet asks only after it saw the
    /// binding, so a read issued after the call began sees both
    /// (`docs/design/allocation-identity.md`, step 7). If that read fails, the call fails
    /// closed. `GetPreferredAllocation` only steers the kubelet's replica choice, so it answers
    /// from the cache.
    async fn identify(
        &self,
        ledger: &mut Ledger,
        count: usize,
        must_include: bool,
        source: PodView,
        deadline: Instant,
        view: Option<PodResourcesView>,
    ) -> Result<(Choice, Vec<PodSnapshot>, Read), AllocateError> {
        let lock = self.pods.hami_lock();
        let (pods, read) = match source {
            PodView::Cache => (self.pods.cached(), Read::Cache),
            PodView::Fresh(early) => {
                if !must_include {
                    let policy = self.booking_policy();
                    let kubelet_version = self.pods.kubelet_version();
                    let call = CacheCall {
                        node: &self.node,
                        policy: &policy,
                        count,
                        hami_lock: lock.as_deref(),
                        pod_resources: view.as_ref(),
                        kubelet_version: kubelet_version.as_deref(),
                    };
                    let reader = ApiReader::new(self.pods.as_ref(), early);
                    let started_early = reader.holds_early_read();
                    let remaining = deadline.saturating_duration_since(Instant::now());
                    let from_cache = choose_from_cache(call, ledger, self.pods.cached(), &reader);
                    let decided = tokio::time::timeout(remaining, from_cache).await;
                    if started_early && let Some(m) = &self.metrics {
                        m.early_read(!reader.holds_early_read());
                    }
                    match decided {
                        Ok(Ok(found)) => {
                            log_rejections(&found.rejected);
                            return Ok((found.choice, found.pods, Read::CacheConfirmed));
                        }
                        Ok(Err(why)) => {
                            tracing::debug!(reason = %DisplayChain(&why), "Allocate decides on a LIST")
                        }
                        Err(_) => {
                            return Err(AllocateError::PodListTimeout {
                                node: self.node.clone(),
                            });
                        }
                    }
                }
                let remaining = deadline.saturating_duration_since(Instant::now());
                let pods = match tokio::time::timeout(remaining, self.pods.fresh()).await {
                    Ok(Ok(pods)) => pods,
                    Ok(Err(e)) => {
                        return Err(AllocateError::PodList {
                            node: self.node.clone(),
                            source: e,
                        });
                    }
                    Err(_) => {
                        return Err(AllocateError::PodListTimeout {
                            node: self.node.clone(),
                        });
                    }
                };
                (pods, Read::List)
            }
        };
        let facts = CallFacts {
            count,
            must_include,
            hami_lock: lock.as_deref(),
            pod_resources: view.as_ref(),
        };
        let policy = self.booking_policy();
        let (pending, rejected) = pending_pods_checked(&self.node, &policy, &pods, ledger);
        log_rejections(&rejected);
        if read == Read::List {
            ledger.note_consistent_read(&pending);
        }
        let chosen = select(facts, &pending, ledger)?;
        Ok((chosen, pods, read))
    }

    /// Starts reading the pod the kubelet most likely admits (an [`EarlyRead`]) where the call
    /// will be decided on the cache and reads by name: the kubelet's last `List` answered, it
    /// lists only active pods (1.34+), no HAMi lock, no re-ask possible. Elsewhere the call
    /// decides on a LIST and nothing is read early.
    fn start_early_read(&self, ledger: &Ledger, count: usize) -> Option<EarlyRead> {
        let cache_path = self.pod_resources_answers.load(Ordering::Relaxed)
            && ledger.reasks_ruled_out()
            && self.pods.hami_lock().is_none()
            && self
                .pods
                .kubelet_version()
                .is_some_and(|v| lists_only_active_pods(&v));
        if !cache_path {
            return None;
        }
        let pods = self.pods.cached();
        let (pending, _) = pending_pods_checked(&self.node, &self.booking_policy(), &pods, ledger);
        let pod = likely_admitting(count, &pending, ledger)?;
        let (source, namespace, name) = (
            Arc::clone(&self.pods),
            pod.namespace.clone(),
            pod.name.clone(),
        );
        let task = tokio::spawn(async move { source.get(&namespace, &name).await });
        Some(EarlyRead {
            key: pod.key(),
            task,
        })
    }

    fn observe_step(&self, step: Step, took: Duration) {
        if let Some(m) = &self.metrics {
            m.observe_allocate_step(step.as_str(), took);
        }
    }

    /// Serves one kubelet `Allocate`.
    pub async fn allocate(
        &self,
        req: dp::AllocateRequest,
    ) -> Result<dp::AllocateResponse, AllocateError> {
        let started = Instant::now();
        let result =
            match tokio::time::timeout(self.budget, self.allocate_inner(req, started)).await {
                Ok(r) => r,
                Err(_) => {
                    self.ledger.lock().await.break_run();
                    Err(AllocateError::Timeout(self.budget))
                }
            };
        if let Some(m) = &self.metrics {
            m.observe_allocate(started.elapsed(), result.is_ok());
        }
        result
    }

    async fn allocate_inner(
        &self,
        req: dp::AllocateRequest,
        started: Instant,
    ) -> Result<dp::AllocateResponse, AllocateError> {
        if req.container_requests.is_empty() {
            return Err(AllocateError::Empty);
        }
        let deadline = started + self.budget;
        let mut ledger = self.ledger().await;
        let mut responses = Vec::new();
        for creq in &req.container_requests {
            match self.serve_one(&mut ledger, creq, deadline).await {
                Ok(r) => responses.push(r),
                Err(e) => {
                    ledger.break_run();
                    return Err(e);
                }
            }
        }
        Ok(dp::AllocateResponse {
            container_responses: responses,
        })
    }

    async fn serve_one(
        &self,
        ledger: &mut Ledger,
        creq: &dp::ContainerAllocateRequest,
        deadline: Instant,
    ) -> Result<dp::ContainerAllocateResponse, AllocateError> {
        let count = creq.devices_ids.len();
        let asked = Instant::now();
        let early = self.start_early_read(ledger, count);
        let view = self.pod_resources_view().await;
        self.observe_step(Step::PodResources, asked.elapsed());
        let deciding = Instant::now();
        let identified = self
            .identify(ledger, count, false, PodView::Fresh(early), deadline, view)
            .await;
        self.observe_step(Step::Identify, deciding.elapsed());
        let (choice, pods, read) = identified.inspect_err(|e| {
            tracing::warn!(count, error = %e, "Allocate refused: pod not identified");
        })?;
        let pod_key = format!("{}/{}", choice.namespace, choice.name);
        record_pod(&pod_key, &choice.uid);
        if let Some(m) = &self.metrics {
            m.identity_choice(choice.reason.as_str(), read.as_str());
        }
        tracing::info!(pod = %pod_key, container = %choice.container.name, entry = choice.entry_index,
            reason = choice.reason.as_str(), read = read.as_str(), "Allocate serves pod");

        let result = self
            .build_and_record(ledger, creq, &choice, &pods, deadline, read)
            .await;
        if let Err(e) = &result {
            tracing::warn!(pod = %pod_key, error = %DisplayChain(e), "Allocate failed; marking bind-phase failed");
            let patcher = self.patcher.clone();
            let (ns, name, uid) = (
                choice.namespace.clone(),
                choice.name.clone(),
                choice.uid.clone(),
            );
            // Best effort and off the kubelet's path: the call already fails closed. The UID
            // precondition keeps this delayed patch off a recreated pod of the same name.
            spawn_task("mark-bind-phase-failed", async move {
                let mut ann = BTreeMap::new();
                ann.insert(
                    keys::BIND_PHASE.to_owned(),
                    keys::BIND_PHASE_FAILED.to_owned(),
                );
                let patch = tokio::time::timeout(
                    BACKGROUND_PATCH_TIMEOUT,
                    patcher.patch_pod_annotations(&ns, &name, &uid, ann),
                )
                .await;
                match patch {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        tracing::warn!(pod = %format!("{ns}/{name}"), error = %DisplayChain(&e), "could not mark bind-phase failed")
                    }
                    Err(_) => {
                        tracing::warn!(pod = %format!("{ns}/{name}"), "could not mark bind-phase failed: timed out")
                    }
                }
                release_lock(patcher.as_ref(), &ns, &name).await;
            });
        }
        result
    }

    async fn build_and_record(
        &self,
        ledger: &mut Ledger,
        creq: &dp::ContainerAllocateRequest,
        choice: &Choice,
        pods: &[PodSnapshot],
        deadline: Instant,
        read: Read,
    ) -> Result<dp::ContainerAllocateResponse, AllocateError> {
        let pod_key = format!("{}/{}", choice.namespace, choice.name);
        {
            let managed = self
                .managed_uuids
                .read()
                .map_err(|_| AllocateError::UnknownGpu {
                    pod: pod_key.clone(),
                    uuid: "(GPU list unavailable)".into(),
                })?;
            if let Some(d) = choice.devices.iter().find(|d| !managed.contains(&d.uuid)) {
                return Err(AllocateError::UnknownGpu {
                    pod: pod_key,
                    uuid: d.uuid.clone(),
                });
            }
        }
        let kubelet_uuids: BTreeSet<&str> = creq
            .devices_ids
            .iter()
            .filter_map(|id| physical_uuid(id))
            .collect();
        let planned: BTreeSet<&str> = choice.devices.iter().map(|d| d.uuid.as_str()).collect();
        if kubelet_uuids != planned {
            // HAMi serves the scheduler's GPUs whatever replicas the kubelet picked; note it.
            tracing::debug!(pod = %pod_key, ?kubelet_uuids, ?planned, "kubelet replicas differ from the planned GPUs");
        }
        let pod = pods.iter().find(|p| p.uid == choice.uid);
        let empty = BTreeMap::new();
        let pod_annotations = pod.map(|p| &p.annotations).unwrap_or(&empty);
        let mig_gpus = self.mig_gpus.read().map(|m| m.clone()).unwrap_or_default();
        let on_mig = choice
            .devices
            .iter()
            .filter(|d| mig_gpus.contains_key(&d.uuid))
            .count();
        let mut mig_annotation = None;
        let response =
            if on_mig == 0 {
                let target = ContainerTarget {
                    pod_uid: choice.uid.clone(),
                    container_name: choice.container.name.clone(),
                    disable_control: choice.container.disable_control,
                    cache_id: uuid::Uuid::new_v4().to_string(),
                    host_oversubscription: host_oversubscription(&pod_key, pod_annotations),
                };
                let response = container_response(&choice.devices, &target, &self.settings)
                    .map_err(|source| AllocateError::Response {
                        pod: pod_key.clone(),
                        container: choice.container.name.clone(),
                        source,
                    })?;
                let writing = Instant::now();
                self.prepare_cache_dir(&response.cache_dir)?;
                // The limits the shim trusts over the container's environment (container_env.rs).
                crate::container_env::write_limits_file(&response.limits_file).map_err(
                    |source| AllocateError::CacheDir {
                        dir: response.limits_file.host_path.clone(),
                        source,
                    },
                )?;
                self.observe_step(Step::Files, writing.elapsed());
                response
            } else {
                let (response, annotation) =
                    self.carve_mig(choice, &pod_key, pod_annotations, &mig_gpus, on_mig)?;
                mig_annotation = Some(annotation);
                response
            };

        // Record: the to-allocate annotation with this entry (and earlier served ones) emptied.
        let current = pod
            .and_then(|p| p.annotations.get(keys::DEVICES_TO_ALLOCATE))
            .map(String::as_str)
            .unwrap_or_default();
        let mut served: BTreeSet<usize> = ledger.served(&choice.uid).cloned().unwrap_or_default();
        served.insert(choice.entry_index);
        let emptied = empty_entries(current, &served).map_err(|source| AllocateError::Entries {
            pod: pod_key.clone(),
            source,
        })?;
        let mut ann = BTreeMap::new();
        ann.insert(keys::DEVICES_TO_ALLOCATE.to_owned(), emptied);
        if let Some(mig) = mig_annotation {
            ann.insert(keys::MIG_ALLOCATIONS.to_owned(), mig);
        }
        if choice.entries_left == 0 {
            ann.insert(
                keys::BIND_PHASE.to_owned(),
                keys::BIND_PHASE_SUCCESS.to_owned(),
            );
        }
        // Only a pod whose every GPU container pod-resources reports leaves the kubelet's own
        // record of its allocation.
        let kubelet_records_all = pod.is_some_and(PodSnapshot::gpu_containers_all_reported);
        if read == Read::CacheConfirmed && choice.entries_left == 0 && kubelet_records_all {
            // The kubelet identifies the pod under admission on this node (pod-resources, 1.34+:
            // the cache path), so nothing here waits for this record: the ledger holds it for
            // this plugin's next calls, the extender does not hold pods back for it, and after a
            // plugin restart the kubelet's own record (devices in every GPU container of the pod)
            // rules the pod out. It is written after the answer, off the kubelet's path
            // (docs/design/allocation-identity.md, step 8).
            ledger.record(choice);
            record_after_answer(
                self.patcher.clone(),
                (&choice.namespace, &choice.name, &choice.uid),
                ann,
            );
            return Ok(to_proto(response));
        }
        let patching = Instant::now();
        let remaining = deadline.saturating_duration_since(patching);
        let patched = tokio::time::timeout(
            remaining,
            self.patcher
                .patch_pod_annotations(&choice.namespace, &choice.name, &choice.uid, ann),
        )
        .await;
        self.observe_step(Step::Patch, patching.elapsed());
        match patched {
            Ok(Ok(())) => {}
            Ok(Err(source)) => {
                return Err(AllocateError::Patch {
                    pod: pod_key,
                    source,
                });
            }
            Err(_) => return Err(AllocateError::Timeout(self.budget)),
        }
        ledger.record(choice);
        // Only HAMi's scheduler takes the lock: with none in the node's cache there is nothing
        // to release, and no GET of the Node per pod; one the cache had not shown yet is
        // released by the periodic sweep (`release_stale_hami_lock`).
        if choice.entries_left == 0 && self.pods.hami_lock().is_some() {
            let patcher = self.patcher.clone();
            let (ns, name) = (choice.namespace.clone(), choice.name.clone());
            spawn_task("release-hami-lock", async move {
                release_lock(patcher.as_ref(), &ns, &name).await;
            });
        }
        Ok(to_proto(response))
    }

    /// Dynamic MIG: carves (or finds, on a repeated call) the instance reserved for each of the
    /// container's devices, and answers with those MIG devices, without the shim: a MIG instance
    /// is isolated by the hardware and never shared. Returns the response and the reservation
    /// annotation with the instances' runtime identity.
    fn carve_mig(
        &self,
        choice: &Choice,
        pod_key: &str,
        annotations: &BTreeMap<String, String>,
        mig_gpus: &crate::mig::MigGpus,
        on_mig: usize,
    ) -> Result<(ContainerResponse, String), AllocateError> {
        let mig_err = |source| AllocateError::Mig {
            pod: pod_key.to_owned(),
            container: choice.container.name.clone(),
            source: Box::new(source),
        };
        let Some(manager) = &self.mig else {
            return Err(mig_err(crate::mig::MigAllocateError::UnknownGpu(
                choice.devices[0].uuid.clone(),
            )));
        };
        if on_mig != choice.devices.len() {
            // A container is either MIG devices or shared GPUs: the shim cannot limit one
            // process's use of some of its devices and leave others alone by hardware.
            return Err(AllocateError::MixedMig {
                pod: pod_key.to_owned(),
                container: choice.container.name.clone(),
            });
        }
        let reservations =
            crate::mig::container_reservations(annotations, choice.entry_index).map_err(mig_err)?;
        let mut realized = Vec::with_capacity(choice.devices.len());
        for (position, device) in choice.devices.iter().enumerate() {
            let reservation = reservations
                .iter()
                .find(|a| {
                    usize::try_from(a.device_index).is_ok_and(|d| d == position)
                        && a.gpu_uuid == device.uuid
                })
                .ok_or_else(|| {
                    mig_err(crate::mig::MigAllocateError::NoReservation {
                        container: choice.entry_index,
                        device: position,
                        gpu: device.uuid.clone(),
                    })
                })?;
            let instance = manager
                .ensure(mig_gpus, reservation, &choice.uid)
                .map_err(mig_err)?;
            realized.push((
                reservation.container_index,
                reservation.device_index,
                instance,
            ));
        }
        let annotation =
            crate::mig::with_runtime_identity(annotations, &realized).map_err(mig_err)?;
        let uuids: Vec<String> = realized
            .iter()
            .map(|(_, _, i)| i.mig_uuid.clone())
            .collect();
        Ok((
            crate::container_env::whole_devices_response(&uuids, &self.settings),
            annotation,
        ))
    }

    /// Serves one kubelet `GetPreferredAllocation`: steer the kubelet to replicas of the GPUs
    /// the scheduler planned for the pod being admitted. Without a confident identity, answer
    /// neutrally (the `Allocate` that follows fails closed).
    pub async fn preferred(
        &self,
        req: dp::PreferredAllocationRequest,
    ) -> dp::PreferredAllocationResponse {
        let started = Instant::now();
        let budget = self.budget.min(PREFERRED_BUDGET);
        let deadline = started + budget;
        let mut out = Vec::new();
        let answer = tokio::time::timeout(budget, async {
            let mut ledger = self.ledger().await;
            for creq in &req.container_requests {
                let size = usize::try_from(creq.allocation_size).unwrap_or(0);
                let planned = match self
                    .identify(
                        &mut ledger,
                        size,
                        !creq.must_include_device_i_ds.is_empty(),
                        PodView::Cache,
                        deadline,
                        self.pod_resources_view().await,
                    )
                    .await
                {
                    Ok((choice, _, _)) => {
                        record_pod(&format!("{}/{}", choice.namespace, choice.name), &choice.uid);
                        choice.devices.iter().map(|d| d.uuid.clone()).collect()
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "GetPreferredAllocation: no confident identity, neutral answer");
                        Vec::new()
                    }
                };
                out.push(dp::ContainerPreferredAllocationResponse {
                    device_i_ds: prefer_replicas(
                        &creq.available_device_i_ds,
                        &creq.must_include_device_i_ds,
                        size,
                        &planned,
                    ),
                });
            }
        })
        .await;
        if answer.is_err() {
            tracing::warn!("GetPreferredAllocation timed out; neutral answer");
            out = req
                .container_requests
                .iter()
                .map(|c| dp::ContainerPreferredAllocationResponse {
                    device_i_ds: prefer_replicas(
                        &c.available_device_i_ds,
                        &c.must_include_device_i_ds,
                        usize::try_from(c.allocation_size).unwrap_or(0),
                        &[],
                    ),
                })
                .collect();
        }
        dp::PreferredAllocationResponse {
            container_responses: out,
        }
    }

    /// Drops ledger entries of pods that are gone or terminal.
    pub async fn gc_ledger(&self) {
        let pods = self.pods.cached();
        let live: BTreeSet<&str> = pods
            .iter()
            .filter(|p| !p.terminal)
            .map(|p| p.uid.as_str())
            .collect();
        self.ledger.lock().await.retain(&live);
    }

    /// Releases HAMi's node lock when it names a pod that is not waiting for `Allocate` here
    /// ([`hami_lock_is_stale`]): one HAMi's plugin left behind.
    /// Tessera never takes the lock on its own plugin's nodes. Returns the holder it released.
    pub async fn release_stale_hami_lock(&self) -> Option<String> {
        let holder = self.pods.hami_lock()?;
        // Judged on the API server's list, not the informer's: a cache that has not caught up
        // would make a pod waiting for `Allocate` look gone. Rare: only while a lock is live.
        let pods = self.pods.fresh().await.ok()?;
        if !hami_lock_is_stale(&self.node, &holder, &pods) {
            return None;
        }
        let (ns, name) = holder.split_once('/')?;
        tracing::info!(lock = %holder, "releasing a HAMi node lock whose pod is not waiting for Allocate here");
        release_lock(self.patcher.as_ref(), ns, name).await;
        Some(holder)
    }
}

/// How long a best-effort patch off the kubelet's path (bind-phase failed, lock release) may take.
const BACKGROUND_PATCH_TIMEOUT: Duration = Duration::from_secs(10);

/// Writes a served pod's record (`vgpu-devices-to-allocate` emptied, `bind-phase: success`)
/// after the answer, retrying with backoff until it lands or the pod is gone (the UID
/// precondition refuses it on a pod recreated under the same name).
fn record_after_answer(
    patcher: Arc<dyn PodPatcher>,
    (ns, name, uid): (&str, &str, &str),
    annotations: BTreeMap<String, String>,
) {
    use backon::BackoffBuilder;
    let (ns, name, uid) = (ns.to_owned(), name.to_owned(), uid.to_owned());
    spawn_task("record-allocation", async move {
        let pod = format!("{ns}/{name}");
        // Jittered: the records an API server outage held back do not all retry together.
        let mut delays = backon::ExponentialBuilder::default()
            .with_min_delay(RECORD_RETRY_FIRST)
            .with_max_delay(RECORD_RETRY_MAX)
            .with_max_times(RECORD_RETRIES)
            .with_jitter()
            .build();
        for attempt in 1.. {
            let patch = tokio::time::timeout(
                BACKGROUND_PATCH_TIMEOUT,
                patcher.patch_pod_annotations(&ns, &name, &uid, annotations.clone()),
            )
            .await;
            match patch {
                Ok(Ok(())) => return,
                Ok(Err(e)) if e.pod_gone() => {
                    tracing::debug!(%pod, "allocation not recorded: the pod is gone");
                    return;
                }
                Ok(Err(e)) => {
                    tracing::warn!(%pod, attempt, error = %DisplayChain(&e), "could not record the allocation")
                }
                Err(_) => {
                    tracing::warn!(%pod, attempt, "could not record the allocation: timed out")
                }
            }
            let Some(delay) = delays.next() else { break };
            tokio::time::sleep(delay).await;
        }
        tracing::error!(%pod, "gave up recording the allocation: its hami.io/bind-phase stays allocating (it runs with its limits; this node's kubelet identifies its pods, so nothing waits for it)");
    });
}

/// The deferred record's first retry delay, its longest (before jitter, which adds up to as
/// much again), and how many retries: about eight minutes in all, at most sixteen.
const RECORD_RETRY_FIRST: Duration = Duration::from_millis(200);
const RECORD_RETRY_MAX: Duration = Duration::from_secs(60);
const RECORD_RETRIES: usize = 15;

/// Releases HAMi's node lock if it still names `ns/name`; best effort (HAMi's lock expires).
async fn release_lock(patcher: &dyn PodPatcher, ns: &str, name: &str) {
    match tokio::time::timeout(
        BACKGROUND_PATCH_TIMEOUT,
        patcher.release_hami_lock(ns, name),
    )
    .await
    {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::debug!(error = %DisplayChain(&e), "HAMi node lock not released"),
        Err(_) => tracing::debug!("HAMi node lock not released: timed out"),
    }
}

/// Whether the pod opted in to host-backed oversubscription; a value the webhook should have
/// refused (an older webhook, or none) is logged and means no.
fn host_oversubscription(pod: &str, annotations: &BTreeMap<String, String>) -> bool {
    keys::memory_oversubscription(annotations.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .unwrap_or_else(|why| {
            tracing::warn!(%pod, "{why}: served without host-backed oversubscription");
            false
        })
}

fn log_rejections(rejected: &[crate::identity::PodRejection]) {
    for r in rejected {
        tracing::warn!(reason = %DisplayChain(r), "pod ignored by Allocate");
    }
}

/// `must_include` first, then one replica per planned GPU (in plan order), then anything
/// available, up to `size`.
pub fn prefer_replicas(
    available: &[String],
    must_include: &[String],
    size: usize,
    planned: &[String],
) -> Vec<String> {
    let mut chosen: Vec<String> = must_include.iter().take(size).cloned().collect();
    for uuid in planned {
        if chosen.len() >= size {
            break;
        }
        if chosen
            .iter()
            .any(|id| physical_uuid(id) == Some(uuid.as_str()))
        {
            continue;
        }
        if let Some(id) = available
            .iter()
            .find(|id| physical_uuid(id) == Some(uuid.as_str()) && !chosen.contains(id))
        {
            chosen.push(id.clone());
        }
    }
    for id in available {
        if chosen.len() >= size {
            break;
        }
        if !chosen.contains(id) {
            chosen.push(id.clone());
        }
    }
    chosen
}

/// Re-encodes a to-allocate value with the NVIDIA devices of `served` entries removed.
pub fn empty_entries(current: &str, served: &BTreeSet<usize>) -> Result<String, DeviceListError> {
    let mut devices = PodDevices::decode(current)?;
    for (i, entry) in devices.0.iter_mut().enumerate() {
        if served.contains(&i) {
            entry.retain(|d| d.vendor != hami_contract::NVIDIA_VENDOR);
        }
    }
    Ok(devices.encode())
}

/// The gRPC form of a container's response.
pub fn to_proto(r: ContainerResponse) -> dp::ContainerAllocateResponse {
    dp::ContainerAllocateResponse {
        envs: r.envs.into_iter().collect(),
        mounts: r
            .mounts
            .into_iter()
            .map(|m| dp::Mount {
                container_path: m.container_path,
                host_path: m.host_path,
                read_only: m.read_only,
            })
            .collect(),
        devices: Vec::new(),
        annotations: Default::default(),
        cdi_devices: r
            .cdi_devices
            .into_iter()
            .map(|name| dp::CdiDevice { name })
            .collect(),
    }
}

/// Names the identified pod on the current request's span (the daemon's `allocate` or
/// `get_preferred_allocation`, with empty `pod` and `pod_uid` fields): every later line of the
/// call carries them, and a pod is followed across the extender and the node by its UID.
fn record_pod(pod: &str, uid: &str) {
    let span = tracing::Span::current();
    span.record("pod", pod);
    span.record("pod_uid", uid);
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::future::BoxFuture;

    /// An apiserver that never answers and a cache that knows nothing.
    #[derive(Debug)]
    struct Hanging;

    impl PodSource for Hanging {
        fn cached(&self) -> Vec<PodSnapshot> {
            Vec::new()
        }
        fn fresh(&self) -> BoxFuture<'_, Result<Vec<PodSnapshot>, EdgeError>> {
            Box::pin(futures::future::pending())
        }
        fn get<'a>(
            &'a self,
            _: &'a str,
            _: &'a str,
        ) -> BoxFuture<'a, Result<Option<PodSnapshot>, EdgeError>> {
            Box::pin(futures::future::pending())
        }
        fn kubelet_version(&self) -> Option<String> {
            Some("v1.34.4".into())
        }
        fn hami_lock(&self) -> Option<String> {
            None
        }
    }

    impl PodResourcesSource for Hanging {
        fn list(&self) -> BoxFuture<'_, Result<Option<PodResourcesView>, EdgeError>> {
            Box::pin(futures::future::pending())
        }
    }

    impl PodPatcher for Hanging {
        fn patch_pod_annotations(
            &self,
            _: &str,
            _: &str,
            _: &str,
            _: BTreeMap<String, String>,
        ) -> BoxFuture<'_, Result<(), EdgeError>> {
            Box::pin(futures::future::pending())
        }
        fn release_hami_lock(&self, _: &str, _: &str) -> BoxFuture<'_, Result<(), EdgeError>> {
            Box::pin(futures::future::pending())
        }
    }

    fn hanging_allocator() -> Allocator {
        Allocator::new(
            "node-a".into(),
            crate::testing::response_settings(std::path::Path::new("/nonexistent")),
            Arc::default(),
            Arc::new(Hanging),
            Arc::new(Hanging),
            Arc::new(Hanging),
        )
    }

    /// The allocator of node-a, serving GPU-a, on `api`'s pods and `pod_resources`, writing
    /// container files under `cache_dir`.
    fn gpu_a_allocator(
        api: &Arc<crate::testing::MemoryApi>,
        pod_resources: Arc<dyn PodResourcesSource>,
        cache_dir: &std::path::Path,
    ) -> Allocator {
        Allocator::new(
            "node-a".into(),
            crate::testing::response_settings(cache_dir),
            Arc::new(RwLock::new(BTreeSet::from(["GPU-a".to_owned()]))),
            api.clone(),
            api.clone(),
            pod_resources,
        )
    }

    /// The kubelet's `Allocate` of GPU-a's first replica for one container.
    fn gpu_a_first_replica() -> dp::AllocateRequest {
        dp::AllocateRequest {
            container_requests: vec![dp::ContainerAllocateRequest {
                devices_ids: vec!["GPU-a-0".into()],
            }],
        }
    }

    #[tokio::test(start_paused = true)]
    async fn allocate_fails_within_its_budget_when_everything_hangs() {
        let allocator = hanging_allocator();
        let started = tokio::time::Instant::now();
        let err = allocator
            .allocate(gpu_a_first_replica())
            .await
            .expect_err("nothing can be known");
        assert!(
            started.elapsed() <= DEFAULT_ALLOCATE_BUDGET,
            "{:?}",
            started.elapsed()
        );
        assert!(
            err.to_string().contains("no pod bound") || err.to_string().contains("did not finish"),
            "{err}"
        );
        // GetPreferredAllocation answers neutrally, within its shorter budget.
        let started = tokio::time::Instant::now();
        let pref = allocator
            .preferred(dp::PreferredAllocationRequest {
                container_requests: vec![dp::ContainerPreferredAllocationRequest {
                    available_device_i_ds: vec!["GPU-a-0".into(), "GPU-a-1".into()],
                    must_include_device_i_ds: Vec::new(),
                    allocation_size: 1,
                }],
            })
            .await;
        assert_eq!(pref.container_responses[0].device_i_ds.len(), 1);
        assert!(
            started.elapsed() <= PREFERRED_BUDGET,
            "{:?}",
            started.elapsed()
        );
    }

    /// One `Allocate` identification with a deadline 1.2 s away (tokio's paused clock): it must
    /// fail exactly at the deadline; its error.
    async fn identify_until_deadline(allocator: &Allocator, ledger: &mut Ledger) -> AllocateError {
        let started = Instant::now();
        let deadline = started + Duration::from_millis(1200);
        let view = allocator.pod_resources_view().await;
        let err = allocator
            .identify(ledger, 1, false, PodView::Fresh(None), deadline, view)
            .await
            .expect_err("nothing can be known");
        assert_eq!(started.elapsed(), Duration::from_millis(1200));
        err
    }

    /// The deadline is on tokio's clock: with the apiserver hanging, identification gives up on
    /// the pod list exactly at the deadline and fails closed, naming the node.
    #[tokio::test(start_paused = true)]
    async fn identify_gives_up_on_the_pod_list_at_its_deadline() {
        let err = identify_until_deadline(&hanging_allocator(), &mut Ledger::default()).await;
        assert!(
            matches!(&err, AllocateError::PodListTimeout { node } if node == "node-a"),
            "{err}"
        );
    }

    /// The same through `Allocate`: the call's own deadline ends the pod list, so the kubelet
    /// gets the reason, not the catch-all timeout, at exactly the budget.
    #[tokio::test(start_paused = true)]
    async fn allocate_fails_closed_when_the_pod_list_hangs() {
        let mut allocator = hanging_allocator();
        allocator.budget = Duration::from_secs(1);
        let started = Instant::now();
        let err = allocator
            .allocate(gpu_a_first_replica())
            .await
            .expect_err("nothing can be known");
        assert_eq!(started.elapsed(), Duration::from_secs(1));
        assert!(matches!(err, AllocateError::PodListTimeout { .. }), "{err}");
    }

    /// A cache that lags the API server in both directions: it still shows pod `rejected` as
    /// pending (the kubelet rejected it before any `Allocate`, and the extender, having seen
    /// that, bound `admitted`), and it has not seen `admitted` bound yet.
    #[derive(Debug)]
    struct LaggingCache {
        stale: Vec<PodSnapshot>,
        current: Vec<PodSnapshot>,
    }

    impl PodSource for LaggingCache {
        fn cached(&self) -> Vec<PodSnapshot> {
            self.stale.clone()
        }
        fn fresh(&self) -> BoxFuture<'_, Result<Vec<PodSnapshot>, EdgeError>> {
            let current = self.current.clone();
            Box::pin(async move { Ok(current) })
        }
        fn get<'a>(
            &'a self,
            namespace: &'a str,
            name: &'a str,
        ) -> BoxFuture<'a, Result<Option<PodSnapshot>, EdgeError>> {
            let pod = self
                .current
                .iter()
                .find(|p| p.namespace == namespace && p.name == name)
                .cloned();
            Box::pin(async move { Ok(pod) })
        }
        fn kubelet_version(&self) -> Option<String> {
            Some("v1.34.4".into())
        }
        fn hami_lock(&self) -> Option<String> {
            None
        }
    }

    /// `Allocate` of one replica of GPU-a on node-a, pods from `source`, no pod-resources.
    async fn allocate_gpu_a(
        source: Arc<LaggingCache>,
        settings: ResponseSettings,
    ) -> dp::AllocateResponse {
        let allocator = Allocator::new(
            "node-a".into(),
            settings,
            Arc::new(RwLock::new(BTreeSet::from(["GPU-a".to_owned()]))),
            source,
            Arc::new(crate::testing::MemoryApi::default()),
            Arc::new(crate::edges::NoPodResources),
        );
        allocator
            .allocate(gpu_a_first_replica())
            .await
            .expect("the pod is identified")
    }

    /// A cluster taken over from HAMi: a lock HAMi's plugin left naming a pod it already
    /// allocated (or one that is gone) is released; a lock naming a pod still waiting for
    /// `Allocate` here is kept (released when that pod is allocated).
    #[tokio::test]
    async fn a_hami_lock_no_pod_waits_on_is_released() {
        use crate::testing::{MemoryApi, bound_pod};
        let api = MemoryApi::default();
        let mut running = bound_pod("node-a", "running", &[&[("GPU-a", 900, 0)]], 1);
        running
            .annotations
            .insert(keys::BIND_PHASE.into(), keys::BIND_PHASE_SUCCESS.into());
        api.add_pod(running);
        api.add_pod(bound_pod("node-a", "waiting", &[&[("GPU-a", 900, 0)]], 2));
        let api = Arc::new(api);
        let allocator = gpu_a_allocator(
            &api,
            Arc::new(crate::edges::NoPodResources),
            std::path::Path::new("/nonexistent"),
        );
        let lock_on = |holder: Option<&str>| {
            *api.hami_lock
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = holder.map(str::to_owned);
        };
        let releases = || {
            api.lock_releases
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone()
        };
        lock_on(Some("default/waiting"));
        assert_eq!(allocator.release_stale_hami_lock().await, None);
        lock_on(Some("default/running"));
        assert_eq!(
            allocator.release_stale_hami_lock().await.as_deref(),
            Some("default/running")
        );
        lock_on(Some("default/gone"));
        assert_eq!(
            allocator.release_stale_hami_lock().await.as_deref(),
            Some("default/gone")
        );
        lock_on(None);
        assert_eq!(allocator.release_stale_hami_lock().await, None);
        assert_eq!(releases(), ["default/running", "default/gone"]);
    }

    /// The pods of the swap CI caught: `rejected` (900 MiB) as a lagging cache still has it,
    /// pending; the same pod as it is now, rejected by the kubelet; `admitted` (10 GiB), bound
    /// after it.
    fn the_swap_ci_caught() -> (PodSnapshot, PodSnapshot, PodSnapshot) {
        use crate::testing::bound_pod;
        let rejected = bound_pod("node-a", "rejected", &[&[("GPU-a", 900, 0)]], 1);
        let admitted = bound_pod("node-a", "admitted", &[&[("GPU-a", 10240, 0)]], 2);
        let mut rejected_now = rejected.clone();
        rejected_now.terminal = true;
        (rejected, rejected_now, admitted)
    }

    /// The swap CI caught on a real node (without pod-resources, after the plugin restarted):
    /// `Allocate` for a 10 GiB pod answered from the cache, where a rejected 900 MiB pod was
    /// still the unique pending candidate, and the container ran with 900 MiB. The call must be
    /// decided on the API server's current state.
    #[tokio::test]
    async fn allocate_ignores_a_cache_that_lags_the_api_server() {
        let (rejected, rejected_now, admitted) = the_swap_ci_caught();
        let source = Arc::new(LaggingCache {
            stale: vec![rejected],
            current: vec![rejected_now, admitted],
        });
        let dir = tempfile::tempdir().expect("tempdir");
        let resp = allocate_gpu_a(source, crate::testing::response_settings(dir.path())).await;
        let envs = &resp.container_responses[0].envs;
        assert_eq!(
            envs.get("CUDA_DEVICE_MEMORY_LIMIT_0").map(String::as_str),
            Some("10240m"),
            "{envs:?}"
        );
    }

    /// A kubelet's pod-resources `List` that answers `view`.
    #[derive(Debug)]
    struct Listed(PodResourcesView);

    impl PodResourcesSource for Listed {
        fn list(&self) -> BoxFuture<'_, Result<Option<PodResourcesView>, EdgeError>> {
            let view = self.0.clone();
            Box::pin(async move { Ok(Some(view)) })
        }
    }

    /// The listing of `pods`: each container with `devices` (none: under admission).
    fn listing(pods: &[(&PodSnapshot, &[&str])]) -> PodResourcesView {
        let pods = pods
            .iter()
            .map(|(p, devices)| {
                let containers = p
                    .containers
                    .iter()
                    .map(|c| {
                        (
                            c.name.clone(),
                            devices.iter().map(|d| d.to_string()).collect(),
                        )
                    })
                    .collect();
                (p.key(), containers)
            })
            .collect();
        PodResourcesView { pods }
    }

    /// One `Allocate` of GPU-a's first replica on node-a, its memory limit, and the reads by
    /// name and LISTs it cost.
    async fn allocate_on(
        api: crate::testing::MemoryApi,
        view: PodResourcesView,
    ) -> (Option<String>, Vec<String>, usize) {
        let api = Arc::new(api);
        let dir = tempfile::tempdir().expect("tempdir");
        let allocator = gpu_a_allocator(&api, Arc::new(Listed(view)), dir.path());
        // As after the first call since registration, decided on a LIST without re-askable pods.
        allocator.ledger.lock().await.note_consistent_read(&[]);
        let resp = allocator
            .allocate(gpu_a_first_replica())
            .await
            .expect("the pod is identified");
        let limit = resp.container_responses[0]
            .envs
            .get("CUDA_DEVICE_MEMORY_LIMIT_0")
            .cloned();
        let reads = api.reads.lock().expect("reads").clone();
        let lists = *api.lists.lock().expect("lists");
        (limit, reads, lists)
    }

    /// Issue #29: the node's GPU-less pods (listed by the kubelet, no device) are not read at
    /// each call: the pod under admission is, and it alone.
    #[tokio::test]
    async fn gpu_less_pods_on_the_node_cost_no_read() {
        let admitted =
            crate::testing::bound_pod("node-a", "admitted", &[&[("GPU-a", 10240, 0)]], 2);
        let daemons: Vec<PodSnapshot> = (0..5)
            .map(|i| {
                crate::testing::gpu_less_pod(
                    "node-a",
                    "default",
                    &format!("daemon-{i}"),
                    &format!("uid-daemon-{i}"),
                )
            })
            .collect();
        let mut all: Vec<&PodSnapshot> = daemons.iter().collect();
        all.push(&admitted);
        let mut listed: Vec<(&PodSnapshot, &[&str])> =
            daemons.iter().map(|d| (d, &[][..])).collect();
        listed.push((&admitted, &[]));
        let (limit, reads, lists) = allocate_on(api_with("v1.34.4", &all), listing(&listed)).await;
        assert_eq!(limit.as_deref(), Some("10240m"));
        assert_eq!(
            (reads.as_slice(), lists),
            (&["default/admitted".to_owned()][..], 0)
        );
    }

    /// Issue #29: a GPU-less pod in the cache whose name a GPU pod took since (the cache lags
    /// its deletion and the new pod's binding) hides the pod under admission from the cache;
    /// the call then goes to a LIST and serves the new pod its own limits.
    #[tokio::test]
    async fn a_gpu_pod_behind_a_cached_gpu_less_predecessor_is_found_by_a_list() {
        let successor = crate::testing::bound_pod("node-a", "web", &[&[("GPU-a", 10240, 0)]], 2);
        let predecessor = crate::testing::gpu_less_pod("node-a", "default", "web", "uid-web-old");
        let api = api_with("v1.34.4", &[&successor]);
        *api.stale_cache.lock().expect("cache") = Some(vec![predecessor]);
        let (limit, _, lists) = allocate_on(api, listing(&[(&successor, &[])])).await;
        assert_eq!(limit.as_deref(), Some("10240m"));
        assert_eq!(lists, 1, "decided on a LIST");
    }

    /// A patcher that refuses the first `refusals` patches with `code`, then records them.
    struct Refusing {
        refusals: u32,
        code: u16,
        attempts: std::sync::atomic::AtomicU32,
        landed: std::sync::Mutex<Vec<BTreeMap<String, String>>>,
    }

    impl PodPatcher for Refusing {
        fn patch_pod_annotations(
            &self,
            namespace: &str,
            name: &str,
            _: &str,
            annotations: BTreeMap<String, String>,
        ) -> BoxFuture<'_, Result<(), EdgeError>> {
            let attempt = self.attempts.fetch_add(1, Ordering::Relaxed);
            let result = if attempt < self.refusals {
                let key = format!("{namespace}/{name}");
                Err(crate::testing::patch_refused(
                    &key, self.code, "Refused", "refused",
                ))
            } else {
                self.landed.lock().expect("landed").push(annotations);
                Ok(())
            };
            Box::pin(async move { result })
        }
        fn release_hami_lock(&self, _: &str, _: &str) -> BoxFuture<'_, Result<(), EdgeError>> {
            Box::pin(async { Ok(()) })
        }
    }

    /// Issue #29: the record written after the answer is retried until it lands (an API server
    /// unavailable for a while), and given up at once for a pod that is gone or recreated.
    #[tokio::test(start_paused = true)]
    async fn the_record_after_the_answer_is_retried_until_it_lands_or_the_pod_is_gone() {
        let record = BTreeMap::from([(
            keys::BIND_PHASE.to_owned(),
            keys::BIND_PHASE_SUCCESS.to_owned(),
        )]);
        let run = |refusals: u32, code: u16| {
            let patcher = Arc::new(Refusing {
                refusals,
                code,
                attempts: Default::default(),
                landed: Default::default(),
            });
            record_after_answer(
                patcher.clone(),
                ("default", "web", "uid-web"),
                record.clone(),
            );
            patcher
        };
        let unavailable = run(5, 503);
        let gone = run(u32::MAX, 404);
        let recreated = run(u32::MAX, 409);
        tokio::time::sleep(Duration::from_secs(600)).await;
        assert_eq!(unavailable.attempts.load(Ordering::Relaxed), 6);
        assert_eq!(*unavailable.landed.lock().expect("landed"), [record]);
        assert_eq!(gone.attempts.load(Ordering::Relaxed), 1);
        assert_eq!(recreated.attempts.load(Ordering::Relaxed), 1);
    }

    /// Issue #29: where a kubelet's wait in `Allocate` goes is on the plugin's metrics, one
    /// observation per step of each call.
    #[tokio::test]
    async fn an_allocate_reports_the_time_of_each_step() {
        let admitted =
            crate::testing::bound_pod("node-a", "admitted", &[&[("GPU-a", 10240, 0)]], 2);
        let api = Arc::new(api_with("v1.34.4", &[&admitted]));
        let dir = tempfile::tempdir().expect("tempdir");
        let listed = Arc::new(Listed(listing(&[(&admitted, &[])])));
        let mut allocator = gpu_a_allocator(&api, listed, dir.path());
        let metrics = PluginMetrics::new();
        allocator.metrics = Some(metrics.clone());
        allocator
            .allocate(gpu_a_first_replica())
            .await
            .expect("the pod is identified");
        let text = metrics.encode();
        for step in ["pod_resources", "identify", "files", "patch"] {
            assert!(
                text.contains(&format!(
                    "tessera_device_plugin_allocate_step_duration_seconds_count{{step=\"{step}\"}} 1"
                )),
                "{step}: {text}"
            );
        }
    }

    /// A kubelet's pod-resources `List` that answers `view` after letting other tasks run, and
    /// notes which pods had been read by name by then.
    #[derive(Debug)]
    struct SlowListing {
        view: PodResourcesView,
        api: Arc<crate::testing::MemoryApi>,
        reads_before_answer: std::sync::Mutex<Vec<String>>,
    }

    impl PodResourcesSource for SlowListing {
        fn list(&self) -> BoxFuture<'_, Result<Option<PodResourcesView>, EdgeError>> {
            Box::pin(async move {
                for _ in 0..20 {
                    tokio::task::yield_now().await;
                }
                *self.reads_before_answer.lock().expect("reads") =
                    self.api.reads.lock().expect("reads").clone();
                Ok(Some(self.view.clone()))
            })
        }
    }

    /// What one `Allocate` beside a slow `List` did: the memory limit served, the reads by
    /// name made before the `List` answered and in all, and the plugin's metrics.
    struct BesideTheList {
        limit: Option<String>,
        reads_before_answer: Vec<String>,
        reads: Vec<String>,
        metrics: String,
    }

    /// One `Allocate` of GPU-a's first replica on a 1.34 kubelet whose pod-resources `List`
    /// answers `listed` slowly and answered before (reads start early only then), with re-asks
    /// ruled out and `pods` in the API server.
    async fn allocate_beside_a_slow_list(
        pods: &[&PodSnapshot],
        listed: PodResourcesView,
    ) -> BesideTheList {
        let api = Arc::new(api_with("v1.34.4", pods));
        let listing = Arc::new(SlowListing {
            view: listed,
            api: api.clone(),
            reads_before_answer: Default::default(),
        });
        let dir = tempfile::tempdir().expect("tempdir");
        let metrics = PluginMetrics::new();
        let mut allocator = gpu_a_allocator(&api, listing.clone(), dir.path());
        allocator.metrics = Some(metrics.clone());
        allocator
            .pod_resources_answers
            .store(true, Ordering::Relaxed);
        allocator.ledger.lock().await.note_consistent_read(&[]);
        let resp = allocator
            .allocate(gpu_a_first_replica())
            .await
            .expect("the pod is identified");
        BesideTheList {
            limit: resp.container_responses[0]
                .envs
                .get("CUDA_DEVICE_MEMORY_LIMIT_0")
                .cloned(),
            reads_before_answer: listing.reads_before_answer.lock().expect("reads").clone(),
            reads: api.reads.lock().expect("reads").clone(),
            metrics: metrics.encode(),
        }
    }

    /// Issue 29: the kubelet admits one pod at a time, so `Allocate`'s latency is paid once per
    /// pod. The read by name of the pod under admission starts with the call, while the
    /// kubelet's `List` is still answering, and the call then uses it: one read, not two in a
    /// row.
    #[tokio::test]
    async fn the_pod_under_admission_is_read_while_the_kubelet_lists() {
        use crate::testing::bound_pod;
        let mut running = bound_pod("node-a", "running", &[&[("GPU-a", 900, 0)]], 1);
        running
            .annotations
            .insert(keys::BIND_PHASE.into(), keys::BIND_PHASE_SUCCESS.into());
        let mut admitted = bound_pod("node-a", "admitted", &[&[("GPU-a", 10240, 0)]], 2);
        admitted.resource_version = "20".into();
        let listed = listing(&[(&running, &["GPU-a-1"]), (&admitted, &[])]);
        let call = allocate_beside_a_slow_list(&[&running, &admitted], listed).await;
        assert_eq!(call.limit.as_deref(), Some("10240m"));
        assert_eq!(
            call.reads_before_answer,
            ["default/admitted"],
            "read before the List answered"
        );
        assert_eq!(call.reads, ["default/admitted"]);
        assert!(
            call.metrics
                .contains("tessera_device_plugin_early_reads_total{outcome=\"used\"} 1"),
            "{}",
            call.metrics
        );
    }

    /// The early read is a guess from the cache. When the kubelet admits another pod than the
    /// one bound first (that one was deleted, or rejected, and the cache has not seen it yet),
    /// the guess is dropped and the call reads the pod the kubelet lists: its limits, never the
    /// guessed pod's.
    #[tokio::test]
    async fn a_wrong_early_guess_costs_a_read_never_the_limits() {
        use crate::testing::bound_pod;
        let mut first = bound_pod("node-a", "bound-first", &[&[("GPU-a", 900, 0)]], 1);
        first.resource_version = "10".into();
        let mut admitted = bound_pod("node-a", "admitted", &[&[("GPU-a", 10240, 0)]], 2);
        admitted.resource_version = "20".into();
        let listed = listing(&[(&admitted, &[])]);
        let call = allocate_beside_a_slow_list(&[&first, &admitted], listed).await;
        assert_eq!(call.limit.as_deref(), Some("10240m"));
        assert_eq!(
            call.reads_before_answer,
            ["default/bound-first"],
            "the guess was read early"
        );
        assert_eq!(
            call.reads.last().map(String::as_str),
            Some("default/admitted")
        );
        assert!(
            call.metrics
                .contains("tessera_device_plugin_early_reads_total{outcome=\"unused\"} 1"),
            "{}",
            call.metrics
        );
    }

    fn api_with(kubelet: &str, pods: &[&PodSnapshot]) -> crate::testing::MemoryApi {
        let api = crate::testing::MemoryApi::default();
        *api.kubelet_version.lock().expect("version") = Some(kubelet.into());
        for p in pods {
            api.add_pod((*p).clone());
        }
        api
    }

    /// Issue #29: on a 1.34 kubelet with pod-resources, `Allocate` reads the one pod it chose
    /// by name instead of listing every pod on the node; before 1.34 it keeps the LIST.
    #[tokio::test]
    async fn allocate_on_a_134_kubelet_reads_one_pod_instead_of_the_node() {
        use crate::testing::bound_pod;
        let mut running = bound_pod("node-a", "running", &[&[("GPU-a", 900, 0)]], 1);
        running
            .annotations
            .insert(keys::BIND_PHASE.into(), keys::BIND_PHASE_SUCCESS.into());
        let admitted = bound_pod("node-a", "admitted", &[&[("GPU-a", 10240, 0)]], 2);
        let view = listing(&[(&running, &["GPU-a-1"]), (&admitted, &[])]);

        let api = api_with("v1.34.4", &[&running, &admitted]);
        let (limit, reads, lists) = allocate_on(api, view.clone()).await;
        assert_eq!(limit.as_deref(), Some("10240m"));
        assert_eq!(
            (reads.as_slice(), lists),
            (&["default/admitted".to_owned()][..], 0)
        );

        let api = api_with("v1.33.5", &[&running, &admitted]);
        let (limit, reads, lists) = allocate_on(api, view).await;
        assert_eq!(limit.as_deref(), Some("10240m"));
        assert_eq!(
            (reads.len(), lists),
            (0, 1),
            "an older kubelet may list rejected pods"
        );
    }

    /// After the plugin registers with a kubelet (its first, or one that restarted), calls are
    /// decided on a LIST until one showed no pod the kubelet could ask for again.
    #[tokio::test]
    async fn after_registration_the_first_call_is_decided_on_a_list() {
        use crate::testing::bound_pod;
        let admitted = bound_pod("node-a", "admitted", &[&[("GPU-a", 10240, 0)]], 2);
        let api = Arc::new(api_with("v1.34.4", &[&admitted]));
        let allocator = gpu_a_allocator(
            &api,
            Arc::new(Listed(listing(&[(&admitted, &[])]))),
            std::path::Path::new("/nonexistent"),
        );
        let deadline = Instant::now() + Duration::from_secs(2);
        let mut reads = Vec::new();
        for restart in [false, false, true, false] {
            if restart {
                allocator.kubelet_restarted();
            }
            let mut ledger = allocator.ledger().await;
            let view = allocator.pod_resources_view().await;
            let (choice, _, read) = allocator
                .identify(&mut ledger, 1, false, PodView::Fresh(None), deadline, view)
                .await
                .expect("identified");
            assert_eq!(choice.name, "admitted");
            reads.push(read);
        }
        assert_eq!(
            reads,
            [
                Read::List,
                Read::CacheConfirmed,
                Read::List,
                Read::CacheConfirmed
            ]
        );
    }

    /// Issue 29: serving a pod releases HAMi's node lock only when the node shows one; under
    /// Tessera's scheduler (no lock) no release, hence no GET of the Node, follows a pod.
    #[tokio::test]
    async fn a_served_pod_touches_the_node_only_under_a_hami_lock() {
        use crate::testing::bound_pod;
        for lock in [None, Some("default/admitted")] {
            let admitted = bound_pod("node-a", "admitted", &[&[("GPU-a", 10240, 0)]], 2);
            let api = api_with("v1.34.4", &[&admitted]);
            *api.hami_lock.lock().expect("lock") = lock.map(str::to_owned);
            let releases = api.lock_releases.clone();
            let (limit, _, _) = allocate_on(api, listing(&[(&admitted, &[])])).await;
            assert_eq!(limit.as_deref(), Some("10240m"));
            // The release runs off the kubelet's path: let it.
            for _ in 0..10 {
                tokio::task::yield_now().await;
            }
            let released = releases.lock().expect("releases").clone();
            assert_eq!(released.first().map(String::as_str), lock, "{lock:?}");
            assert!(released.len() <= 1, "{released:?}");
        }
    }

    /// The swapped-limits case with pod-resources: the cache still shows the rejected 900 MiB
    /// pod pending and has not seen the 10 GiB pod bound. The kubelet no longer lists the
    /// rejected pod and lists the admitted one, which the cache cannot explain, so that one is
    /// read by name; the container gets 10 GiB, and no LIST was needed.
    #[tokio::test]
    async fn a_lagging_cache_on_a_134_kubelet_still_gives_the_admitted_pod_its_limits() {
        let (rejected, rejected_now, admitted) = the_swap_ci_caught();
        let api = api_with("v1.34.4", &[&rejected_now, &admitted]);
        *api.stale_cache.lock().expect("cache") = Some(vec![rejected]);
        let (limit, reads, lists) = allocate_on(api, listing(&[(&admitted, &[])])).await;
        assert_eq!(limit.as_deref(), Some("10240m"));
        assert_eq!(
            (reads.as_slice(), lists),
            (&["default/admitted".to_owned()][..], 0)
        );
    }

    /// A pod deleted and created again under the same name (a StatefulSet's replacement) while
    /// the cache still holds the first: the listing of that name is read by name, so the new
    /// pod, not its predecessor, gets the container's limits, still without a LIST.
    #[tokio::test]
    async fn a_predecessor_of_the_same_name_in_the_cache_is_read_past() {
        use crate::testing::bound_pod;
        let before = bound_pod("node-a", "job", &[&[("GPU-a", 900, 0)]], 1);
        let mut now = bound_pod("node-a", "job", &[&[("GPU-a", 10240, 0)]], 2);
        now.uid = "uid-job-2".into();
        let api = api_with("v1.34.4", &[&now]);
        *api.stale_cache.lock().expect("cache") = Some(vec![before]);
        let (limit, reads, lists) = allocate_on(api, listing(&[(&now, &[])])).await;
        assert_eq!(limit.as_deref(), Some("10240m"));
        assert_eq!(
            (reads.as_slice(), lists),
            (&["default/job".to_owned()][..], 0)
        );
    }

    /// A read by name that never answers ends at the call's deadline, closed.
    #[tokio::test(start_paused = true)]
    async fn identify_gives_up_on_a_read_by_name_at_its_deadline() {
        use crate::testing::bound_pod;
        let admitted = bound_pod("node-a", "admitted", &[&[("GPU-a", 10240, 0)]], 2);
        let allocator = Allocator::new(
            "node-a".into(),
            crate::testing::response_settings(std::path::Path::new("/nonexistent")),
            Arc::default(),
            Arc::new(Hanging),
            Arc::new(Hanging),
            Arc::new(Listed(listing(&[(&admitted, &[])]))),
        );
        // Past the first LIST after registration (the cache form needs re-asks ruled out).
        let mut ruled_out = Ledger::default();
        ruled_out.note_consistent_read(&[]);
        let err = identify_until_deadline(&allocator, &mut ruled_out).await;
        assert!(matches!(err, AllocateError::PodListTimeout { .. }), "{err}");
    }

    /// Issue #31 item 2 end to end in the plugin: a pod annotated for host-backed
    /// oversubscription, on a node with memory scaling 2, gets its device share in the limits
    /// file the shim trusts; its neighbour without the annotation does not; a bad value is
    /// served without it.
    #[tokio::test]
    async fn an_opted_in_pod_gets_its_device_share_in_the_limits_file() {
        use crate::testing::bound_pod;
        for (value, want) in [
            (Some("host"), Some("5120m")),
            (None, None),
            (Some("yes"), None),
        ] {
            let mut pod = bound_pod("node-a", "llm", &[&[("GPU-a", 10240, 0)]], 1);
            if let Some(v) = value {
                pod.annotations
                    .insert(keys::MEMORY_OVERSUBSCRIPTION.into(), v.into());
            }
            let source = Arc::new(LaggingCache {
                stale: vec![pod.clone()],
                current: vec![pod],
            });
            let dir = tempfile::tempdir().expect("tempdir");
            let mut settings = crate::testing::response_settings(dir.path());
            settings.memory_scaling = 2.0;
            let resp = allocate_gpu_a(source, settings).await;
            let r = &resp.container_responses[0];
            let limits = r
                .mounts
                .iter()
                .find(|m| m.container_path == vgpu_region::protocol::CONTAINER_LIMITS_PATH)
                .map(|m| std::fs::read_to_string(&m.host_path).expect("limits file"))
                .expect("the limits file is mounted");
            let share = limits
                .lines()
                .find_map(|l| l.strip_prefix("TESSERA_DEVICE_MEMORY_SHARE_0="));
            assert_eq!(share, want, "{value:?}: {limits}");
            assert!(
                limits.contains("CUDA_DEVICE_MEMORY_LIMIT_0=10240m\n"),
                "{limits}"
            );
        }
    }

    #[test]
    fn grpc_status_message_carries_the_cause() {
        let e = AllocateError::CacheDir {
            dir: "/x".into(),
            source: std::io::Error::from_raw_os_error(libc::EACCES),
        };
        assert_eq!(
            DisplayChain(&e).to_string(),
            "tessera: cannot create the container cache directory /x: Permission denied (os error 13)"
        );
        let e = AllocateError::Identity(IdentityError::NoContinuingPod);
        assert_eq!(DisplayChain(&e).to_string(), e.to_string(), "said once");
    }

    #[test]
    fn empty_entries_keeps_structure_and_other_vendors() {
        let v = "GPU-a,NVIDIA,1000,10:;GPU-b,NVIDIA,2000,20:OTHER-x,OTHER,5,5:;";
        let served: BTreeSet<usize> = [0, 1].into();
        assert_eq!(
            empty_entries(v, &served).as_deref(),
            Ok(";OTHER-x,OTHER,5,5:;")
        );
        assert!(empty_entries("GPU-a,NVIDIA:;", &served).is_err());
    }

    #[test]
    fn prefer_replicas_picks_planned_gpus_after_must_include() {
        let avail: Vec<String> = ["GPU-a-0", "GPU-a-1", "GPU-b-0", "GPU-c-0"]
            .map(String::from)
            .into();
        let got = prefer_replicas(&avail, &[], 2, &["GPU-c".into(), "GPU-b".into()]);
        assert_eq!(got, ["GPU-c-0", "GPU-b-0"]);
        let got = prefer_replicas(
            &avail,
            &["GPU-a-1".into()],
            2,
            &["GPU-a".into(), "GPU-b".into()],
        );
        assert_eq!(got, ["GPU-a-1", "GPU-b-0"]);
        let got = prefer_replicas(&avail, &[], 3, &[]);
        assert_eq!(got.len(), 3);
    }
}

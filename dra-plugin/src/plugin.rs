//! The kubelet's side of the driver: the registration service the kubelet's plugin watcher
//! finds in its registry directory, and the DRAPlugin service it then calls to prepare and
//! unprepare claims.
//!
//! The kubelet names only the claim (namespace, name, UID); the allocation is read from the API
//! server ([`ClaimSource`]). Claims of one call are read concurrently and written one at a time
//! (one lock over the prepared claims). Every claim of a request gets an entry in the response,
//! with an error text when it failed: the kubelet retries those.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::future::BoxFuture;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kubelet_proto::dra::v1 as dra;
use kubelet_proto::pluginregistration as reg;
use tessera_runtime::{DisplayChain, spawn_blocking_in_span, task_span};
use tokio::io::DuplexStream;
use tokio::net::UnixListener;
use tokio::sync::{Mutex, Notify};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use vgpu_region::feedback::{CorePolicy, FeedbackClock};

use super::DRIVER;
use super::checkpoint::{ClaimRef, PrepareError, PreparedClaim, PreparedClaims};
use super::claim::{claim_shares, reserved_pods, shim_devices};
use super::metrics::{ClaimNames, DraMetrics};
use super::slice::device_name;
use tessera_node::edges::EdgeError;
use tessera_node::gpu::GpuInfo;
use tessera_node::identity::PodSnapshot;
use tessera_node::metrics::Readiness;
use tessera_node::process_watch::{BookingSource, Bookings, MemoryBookings, RegionDir};
use tessera_node::unaccounted::ClaimBooking;

/// Reads ResourceClaims (the API server; tests: a map).
pub trait ClaimSource: Send + Sync + 'static {
    /// The claim, or `None` when it does not exist.
    fn claim(
        &self,
        namespace: &str,
        name: &str,
    ) -> BoxFuture<'_, Result<Option<ResourceClaim>, EdgeError>>;
}

/// [`ClaimSource`] on the API server.
#[derive(Clone)]
pub struct KubeClaims(pub kube::Client);

impl std::fmt::Debug for KubeClaims {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KubeClaims")
    }
}

impl ClaimSource for KubeClaims {
    fn claim(
        &self,
        namespace: &str,
        name: &str,
    ) -> BoxFuture<'_, Result<Option<ResourceClaim>, EdgeError>> {
        let api: kube::Api<ResourceClaim> = kube::Api::namespaced(self.0.clone(), namespace);
        let what = format!("cannot read ResourceClaim {namespace}/{name}");
        let name = name.to_owned();
        Box::pin(async move { api.get_opt(&name).await.map_err(EdgeError::kube(what)) })
    }
}

/// The driver's node-local state: this node's GPUs and the claims prepared on them.
pub struct DraDriver {
    node: String,
    gpus: Vec<GpuInfo>,
    source: Arc<dyn ClaimSource>,
    prepared: Mutex<PreparedClaims>,
    metrics: DraMetrics,
    /// Set while the kubelet has this driver registered (`/readyz`).
    readiness: Readiness,
    /// The rate limit of the warnings about what containers left in claim directories.
    skip_log: tessera_node::monitor::SkipLog,
    /// MiB per process beyond its claims' memory a pod may use before the memory check reports
    /// it (`--unaccounted-memory-allowance-mib`).
    memory_allowance_mib: u64,
}

impl std::fmt::Debug for DraDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DraDriver")
            .field("node", &self.node)
            .field("gpus", &self.gpus.len())
            .finish_non_exhaustive()
    }
}

impl DraDriver {
    pub fn new(
        node: String,
        gpus: Vec<GpuInfo>,
        source: Arc<dyn ClaimSource>,
        prepared: PreparedClaims,
    ) -> DraDriver {
        let metrics = DraMetrics::new();
        metrics.set_prepared_claims(prepared.all().len());
        DraDriver {
            node,
            gpus,
            source,
            prepared: Mutex::new(prepared),
            metrics,
            readiness: Readiness::default(),
            skip_log: tessera_node::monitor::SkipLog::default(),
            memory_allowance_mib: tessera_node::process_watch::DEFAULT_MEMORY_ALLOWANCE_MIB,
        }
    }

    /// The memory check's allowance per process (`--unaccounted-memory-allowance-mib`).
    pub fn with_memory_allowance_mib(mut self, mib: u64) -> DraDriver {
        self.memory_allowance_mib = mib;
        self
    }

    pub fn metrics(&self) -> &DraMetrics {
        &self.metrics
    }

    /// Whether the kubelet has this driver registered now.
    pub fn readiness(&self) -> &Readiness {
        &self.readiness
    }

    /// The UIDs of the prepared claims.
    pub async fn prepared_uids(&self) -> Vec<String> {
        self.prepared.lock().await.all().keys().cloned().collect()
    }

    /// One pass of the claims' usage monitor: each prepared claim's shim region (in its
    /// directory, shared by every container using the claim) into the `tessera_dra_claim_*`
    /// metrics. Files that cannot be read are logged and left out; they never stop the others.
    pub async fn record_usage(&self) {
        let (dir, names) = {
            let prepared = self.prepared.lock().await;
            let names: ClaimNames = prepared
                .all()
                .iter()
                .map(|(uid, c)| (uid.clone(), (c.namespace.clone(), c.name.clone())))
                .collect();
            (prepared.claims_dir(), names)
        };
        let scanned =
            spawn_blocking_in_span(move || tessera_node::monitor::scan_claims(&dir)).await;
        let (samples, skipped) = match scanned {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %DisplayChain(&e), "the claims' region scan did not finish");
                return;
            }
        };
        self.skip_log.report("claim region file", &skipped);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        self.metrics.set_claim_usage(&samples, &names, now);
    }

    /// One period of the vGPU monitor's feedback over the prepared claims' regions
    /// ([`tessera_node::monitor::claims_feedback_pass`]): a claim alone on its GPU runs without its
    /// core limit, claims that share a GPU get theirs back, and a more important claim
    /// (`CUDA_TASK_PRIORITY`) holds the others' launches. The claims' shims run HAMi's default
    /// core policy.
    pub async fn feedback(&self, clock: FeedbackClock) {
        let (dir, booked) = {
            let prepared = self.prepared.lock().await;
            let booked: BTreeMap<String, BTreeSet<String>> = prepared
                .all()
                .iter()
                .map(|(uid, c)| (uid.clone(), self.claim_gpus(c)))
                .collect();
            (prepared.claims_dir(), booked)
        };
        let passed = spawn_blocking_in_span(move || {
            tessera_node::monitor::claims_feedback_pass(&dir, CorePolicy::Default, clock, &booked)
        })
        .await;
        match passed {
            Ok((outcomes, skipped)) => tessera_node::monitor::log_feedback(&outcomes, &skipped),
            Err(e) => {
                tracing::warn!(error = %DisplayChain(&e), "the claims' feedback pass did not finish")
            }
        }
    }

    /// The UUIDs of the GPUs a prepared claim was given (its devices, `gpu-<index>`).
    fn claim_gpus(&self, claim: &PreparedClaim) -> BTreeSet<String> {
        self.gpus
            .iter()
            .filter(|g| {
                let name = device_name(g.index);
                claim.devices.iter().any(|d| d.device == name)
            })
            .map(|g| g.uuid.clone())
            .collect()
    }

    /// What accounts for GPU use on this node now, for the unaccounted-process watch
    /// ([`BookingSource`]): every prepared claim with its GPUs and the pods its ResourceClaim
    /// is reserved for, read from the API server (the kubelet names only the claim, so the
    /// plugin never learnt its pods), and the claims' region directory. No HAMi booking
    /// annotation counts on a DRA node: no device plugin allocates from them here. A claim that
    /// cannot be read fails the pass (its pods' processes would otherwise look unbooked); one
    /// that is gone, or was recreated under its name, books nothing (the stale-claim sweep
    /// unprepares it).
    pub async fn claim_bookings(&self) -> Result<Bookings, EdgeError> {
        let (dir, claims) = {
            let prepared = self.prepared.lock().await;
            let claims: Vec<(String, String, String, BTreeSet<String>)> = prepared
                .all()
                .iter()
                .map(|(uid, c)| {
                    let gpus = self.claim_gpus(c);
                    (uid.clone(), c.namespace.clone(), c.name.clone(), gpus)
                })
                .collect();
            (prepared.claims_dir(), claims)
        };
        // The futures are made before the stream (not by a closure inside it), so the pass's
        // future stays `Send` for every lifetime of the claims' names.
        let reads: Vec<_> = claims
            .iter()
            .map(|(_, namespace, name, _)| self.source.claim(namespace, name))
            .collect();
        let reads: Vec<Result<Option<ResourceClaim>, EdgeError>> = futures::stream::iter(reads)
            .buffered(CLAIM_READS_IN_FLIGHT)
            .collect()
            .await;
        let mut booked = BTreeMap::new();
        let mut shimless_pods = BTreeSet::new();
        let mut booked_mib: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
        for ((uid, _, _, gpus), read) in claims.into_iter().zip(reads) {
            let pods = match read? {
                Some(claim) if claim.metadata.uid.as_deref() == Some(uid.as_str()) => {
                    let pods = reserved_pods(&claim);
                    let shares = claim_shares(&claim, &uid, &self.node, &self.gpus);
                    match shares.as_deref().map(shim_devices) {
                        // An admin-access claim gives its containers the GPUs without the shim
                        // (a monitoring tool, in a namespace the API server lets have admin
                        // access): its pods are accounted without a region on the GPUs they
                        // were given, as the device plugin's operator-allowed shimless
                        // containers are, and their memory is not judged.
                        Ok(None) => shimless_pods.extend(pods.iter().cloned()),
                        // The memory check: each pod the claim is reserved for is held to the
                        // claim's whole share of each GPU (added over its claims). A claim
                        // shared by several pods is not split among them: one pod beyond the
                        // claim's share is reported, several within it together are not.
                        Ok(Some(_)) => {
                            for share in shares.iter().flatten() {
                                let Some(limits) = share.limits else { continue };
                                for pod in &pods {
                                    let mib = booked_mib
                                        .entry(pod.clone())
                                        .or_default()
                                        .entry(share.uuid.clone())
                                        .or_default();
                                    *mib = mib.saturating_add(u64::from(limits.memory_mib));
                                }
                            }
                        }
                        // No longer a claim this node serves: its processes are held to the
                        // regions, never exempted or judged on a guess.
                        Err(_) => {}
                    }
                    pods
                }
                _ => BTreeSet::new(),
            };
            booked.insert(uid, ClaimBooking { gpus, pods });
        }
        Ok(Bookings {
            gpus: self.gpus.iter().map(|g| g.uuid.clone()).collect(),
            booked: BTreeMap::new(),
            claims: booked,
            shimless_pods,
            regions: vec![RegionDir::Claims(dir)],
            memory: Some(MemoryBookings {
                booked_mib,
                allowance_mib: self.memory_allowance_mib,
            }),
        })
    }

    /// Prepares one claim: the devices for the kubelet's response, or why not.
    pub async fn prepare(&self, claim: &ClaimRef) -> Result<Vec<dra::Device>, ClaimPrepareError> {
        let started = tokio::time::Instant::now();
        let r = self.prepare_claim(claim).await;
        self.metrics.observe_prepare(started.elapsed(), r.is_ok());
        r
    }

    async fn prepare_claim(&self, claim: &ClaimRef) -> Result<Vec<dra::Device>, ClaimPrepareError> {
        let answer = |p: &super::checkpoint::PreparedClaim| {
            p.devices
                .iter()
                .map(|d| dra::Device {
                    request_names: d.requests.clone(),
                    pool_name: d.pool.clone(),
                    device_name: d.device.clone(),
                    cdi_device_ids: d.cdi_ids.clone(),
                })
                .collect()
        };
        if let Some(p) = self.prepared.lock().await.get(&claim.uid) {
            return Ok(answer(p));
        }
        let read = self
            .source
            .claim(&claim.namespace, &claim.name)
            .await
            .map_err(ClaimPrepareError::Read)?
            .ok_or_else(|| ClaimPrepareError::NotFound {
                claim: format!("{}/{}", claim.namespace, claim.name),
            })?;
        let shares = claim_shares(&read, &claim.uid, &self.node, &self.gpus)
            .map_err(ClaimPrepareError::Refused)?;
        let mut prepared = self.prepared.lock().await;
        let p = prepared
            .prepare(claim, &shares)
            .map_err(ClaimPrepareError::Files)?;
        tracing::info!(claim = %format!("{}/{}", claim.namespace, claim.name), uid = %claim.uid, devices = p.devices.len(), "claim prepared");
        let devices = answer(p);
        self.metrics.set_prepared_claims(prepared.all().len());
        Ok(devices)
    }

    /// Unprepares one claim (an unknown claim is already unprepared).
    pub async fn unprepare(&self, uid: &str) -> Result<(), PrepareError> {
        let mut prepared = self.prepared.lock().await;
        let known = prepared.get(uid).is_some();
        let r = prepared.unprepare(uid);
        self.metrics.set_prepared_claims(prepared.all().len());
        if known {
            self.metrics.observe_unprepare(r.is_ok());
        }
        r?;
        if known {
            tracing::info!(uid, "claim unprepared");
        }
        Ok(())
    }

    /// Unprepares the prepared claims whose ResourceClaim is gone (deleted, or deleted and
    /// recreated under the same name): the kubelet never unprepared them (it lost its state, or
    /// the plugin was down when it tried). A claim that cannot be read now is kept.
    pub async fn remove_stale(&self) -> Vec<String> {
        let claims: Vec<(String, String, String)> = {
            let prepared = self.prepared.lock().await;
            prepared
                .all()
                .iter()
                .map(|(uid, c)| (uid.clone(), c.namespace.clone(), c.name.clone()))
                .collect()
        };
        let mut removed = Vec::new();
        for (uid, namespace, name) in claims {
            let gone = match self.source.claim(&namespace, &name).await {
                Ok(None) => true,
                Ok(Some(c)) => c.metadata.uid.as_deref() != Some(uid.as_str()),
                Err(e) => {
                    tracing::debug!(error = %DisplayChain(&e), "cannot check a prepared claim");
                    false
                }
            };
            if gone {
                tracing::info!(claim = %format!("{namespace}/{name}"), %uid, "claim is gone; cleaning up what it left");
                if self.unprepare(&uid).await.is_ok() {
                    removed.push(uid);
                }
            }
        }
        removed
    }
}

impl BookingSource for DraDriver {
    fn bookings<'a>(
        &'a self,
        _pods: &'a [PodSnapshot],
    ) -> BoxFuture<'a, Result<Bookings, EdgeError>> {
        Box::pin(self.claim_bookings())
    }
}

/// ResourceClaims read at once by one pass of the unaccounted-process watch: a node with many
/// claims is not a burst of requests to the API server.
const CLAIM_READS_IN_FLIGHT: usize = 8;

/// Why a claim could not be prepared: the kubelet gets the whole chain as the claim's error
/// (`DisplayChain`), and retries.
#[derive(Debug, thiserror::Error)]
pub enum ClaimPrepareError {
    #[error("cannot read the ResourceClaim")]
    Read(#[source] EdgeError),
    #[error("ResourceClaim {claim} not found")]
    NotFound { claim: String },
    #[error("this node cannot serve the claim")]
    Refused(#[source] super::claim::ClaimError),
    #[error("cannot write the claim's files")]
    Files(#[source] PrepareError),
}

/// The DRAPlugin gRPC service.
#[derive(Debug, Clone)]
pub struct DraService(pub Arc<DraDriver>);

fn claim_ref(c: &dra::Claim) -> ClaimRef {
    ClaimRef {
        namespace: c.namespace.clone(),
        name: c.name.clone(),
        uid: c.uid.clone(),
    }
}

#[tonic::async_trait]
impl dra::dra_plugin_server::DraPlugin for DraService {
    async fn node_prepare_resources(
        &self,
        request: tonic::Request<dra::NodePrepareResourcesRequest>,
    ) -> Result<tonic::Response<dra::NodePrepareResourcesResponse>, tonic::Status> {
        let claims = request.into_inner().claims;
        let answers = futures::future::join_all(claims.iter().map(|c| {
            let span = tracing::info_span!(
                "node_prepare_resources",
                claim = %format!("{}/{}", c.namespace, c.name),
                claim_uid = %c.uid,
            );
            async {
                let r = self
                    .0
                    .prepare(&claim_ref(c))
                    .await
                    .map_err(|e| DisplayChain(&e).to_string());
                if let Err(e) = &r {
                    tracing::warn!(error = %e, "cannot prepare claim");
                }
                (c.uid.clone(), r)
            }
            .instrument(span)
        }))
        .await;
        let claims = answers
            .into_iter()
            .map(|(uid, r)| {
                let entry = match r {
                    Ok(devices) => dra::NodePrepareResourceResponse {
                        devices,
                        error: String::new(),
                    },
                    Err(error) => dra::NodePrepareResourceResponse {
                        devices: Vec::new(),
                        error,
                    },
                };
                (uid, entry)
            })
            .collect();
        Ok(tonic::Response::new(dra::NodePrepareResourcesResponse {
            claims,
        }))
    }

    async fn node_unprepare_resources(
        &self,
        request: tonic::Request<dra::NodeUnprepareResourcesRequest>,
    ) -> Result<tonic::Response<dra::NodeUnprepareResourcesResponse>, tonic::Status> {
        let mut claims = std::collections::HashMap::new();
        for c in request.into_inner().claims {
            let span = tracing::info_span!(
                "node_unprepare_resources",
                claim = %format!("{}/{}", c.namespace, c.name),
                claim_uid = %c.uid,
            );
            let error = self
                .0
                .unprepare(&c.uid)
                .instrument(span)
                .await
                .err()
                .map(|e| DisplayChain(&e).to_string())
                .unwrap_or_default();
            claims.insert(c.uid, dra::NodeUnprepareResourceResponse { error });
        }
        Ok(tonic::Response::new(dra::NodeUnprepareResourcesResponse {
            claims,
        }))
    }
}

/// The registration service: tells the kubelet the driver's name and DRA socket; a successful
/// registration wakes `registered` (the kubelet wipes the node's slices when it starts, so the
/// publisher checks the slice again).
#[derive(Debug, Clone)]
pub struct RegistrationService {
    pub endpoint: String,
    pub registered: Arc<Notify>,
    pub readiness: Readiness,
    pub metrics: DraMetrics,
}

#[tonic::async_trait]
impl reg::registration_server::Registration for RegistrationService {
    async fn get_info(
        &self,
        _request: tonic::Request<reg::InfoRequest>,
    ) -> Result<tonic::Response<reg::PluginInfo>, tonic::Status> {
        Ok(tonic::Response::new(reg::PluginInfo {
            r#type: reg::DRA_PLUGIN_TYPE.to_owned(),
            name: DRIVER.to_owned(),
            endpoint: self.endpoint.clone(),
            supported_versions: vec![dra::SERVICE_VERSION.to_owned()],
        }))
    }

    async fn notify_registration_status(
        &self,
        request: tonic::Request<reg::RegistrationStatus>,
    ) -> Result<tonic::Response<reg::RegistrationStatusResponse>, tonic::Status> {
        let status = request.into_inner();
        if status.plugin_registered {
            tracing::info!("registered with the kubelet");
            self.readiness.set(true);
            self.metrics.registered();
            self.registered.notify_one();
        } else {
            tracing::error!(error = %status.error, "the kubelet refused the registration");
        }
        Ok(tonic::Response::new(reg::RegistrationStatusResponse {}))
    }
}

/// Why a socket could not be served.
#[derive(Debug, thiserror::Error)]
#[error("cannot listen on {path}")]
pub struct ListenError {
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

fn bind(path: &Path) -> Result<UnixListener, ListenError> {
    let err = |source| ListenError {
        path: path.to_path_buf(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(err)?;
    }
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(err(e)),
        _ => {}
    }
    UnixListener::bind(path).map_err(err)
}

/// The in-memory pipe between the authority relay and the registration server (its messages are
/// a few hundred bytes).
const RELAY_BUFFER: usize = 64 * 1024;

/// How often the registration socket is checked (the kubelet's plugin watcher only notices a
/// socket that is created; one deleted under us must be made again).
const SOCKET_CHECK: Duration = Duration::from_secs(5);

/// Serves the DRA socket and then the registration socket (the kubelet dials the DRA socket as
/// soon as it registers the plugin) until `shutdown`; both sockets are removed at the end, which
/// deregisters the plugin.
pub async fn serve(
    driver: Arc<DraDriver>,
    dra_socket: PathBuf,
    registration_socket: PathBuf,
    registered: Arc<Notify>,
    shutdown: CancellationToken,
) -> Result<(), ListenError> {
    let listener = bind(&dra_socket)?;
    let readiness = driver.readiness().clone();
    let metrics = driver.metrics().clone();
    let stop = shutdown.clone();
    let dra_server = tokio::spawn(
        async move {
            let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
            tonic::transport::Server::builder()
                .add_service(dra::dra_plugin_server::DraPluginServer::new(DraService(
                    driver,
                )))
                .serve_with_incoming_shutdown(incoming, stop.cancelled_owned())
                .await
        }
        .instrument(task_span("dra-server")),
    );
    tracing::info!(socket = %dra_socket.display(), "DRA service serving");
    let registration = RegistrationService {
        endpoint: dra_socket.display().to_string(),
        registered,
        readiness: readiness.clone(),
        metrics,
    };
    while !shutdown.is_cancelled() {
        let listener = bind(&registration_socket)?;
        let stop = shutdown.child_token();
        let server_stop = stop.clone();
        let service = registration.clone();
        // The kubelet's connections reach the server through the authority relay
        // (`super::authority`), each over an in-memory pipe.
        let (pipes, incoming) = tokio::sync::mpsc::channel::<std::io::Result<DuplexStream>>(16);
        let server = tokio::spawn(
            async move {
                tonic::transport::Server::builder()
                    .add_service(reg::registration_server::RegistrationServer::new(service))
                    .serve_with_incoming_shutdown(
                        tokio_stream::wrappers::ReceiverStream::new(incoming),
                        server_stop.cancelled_owned(),
                    )
                    .await
            }
            .instrument(task_span("dra-registration")),
        );
        let accept_stop = stop.clone();
        let acceptor = tokio::spawn(
            async move {
                loop {
                    let conn = tokio::select! {
                        c = listener.accept() => c,
                        _ = accept_stop.cancelled() => return,
                    };
                    match conn {
                        Ok((conn, _)) => {
                            let (relay_end, server_end) = tokio::io::duplex(RELAY_BUFFER);
                            if pipes.send(Ok(server_end)).await.is_err() {
                                return;
                            }
                            tokio::spawn(async move {
                                if let Err(e) = super::authority::relay(conn, relay_end).await {
                                    tracing::debug!(error = %e, "registration connection ended");
                                }
                            });
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "cannot accept on the registration socket");
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                    }
                }
            }
            .instrument(task_span("dra-registration-accept")),
        );
        tracing::info!(socket = %registration_socket.display(), "registration socket serving");
        loop {
            tokio::select! {
                _ = tokio::time::sleep(SOCKET_CHECK) => {}
                _ = shutdown.cancelled() => break,
            }
            if !registration_socket.exists() {
                tracing::warn!("the registration socket was removed; making it again");
                // Not ready until the kubelet registers the new socket.
                readiness.set(false);
                break;
            }
        }
        stop.cancel();
        let _ = acceptor.await;
        let _ = server.await;
    }
    let _ = std::fs::remove_file(&registration_socket);
    let _ = dra_server.await;
    let _ = std::fs::remove_file(&dra_socket);
    tracing::info!("DRA plugin stopped; sockets removed");
    Ok(())
}

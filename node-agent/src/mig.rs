//! Dynamic MIG on the node (contract §6.4): the instance the scheduler reserved for a pod is
//! carved at `Allocate`, recorded, and destroyed once no live pod reserves it.
//!
//! Ownership is explicit. Tessera destroys only instances it carved (or adopted from a pod's
//! recorded reservation): the records are kept in a checkpoint file on the host, so a restarted
//! plugin finds what it carved, and instances someone else carved (an administrator, NVIDIA's MIG
//! manager) are never touched; their slices are withheld from the placements the node offers
//! (`gpu::plan_gpus`). HAMi instead resets every idle GPU at start-up, destroying whatever is on
//! it (deviation Q2).

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use hami_contract::mig::{MigAllocation, MigPlacement, decode_allocations};
use nvml_mig::{MigControl, MigError, Placement};
use serde::{Deserialize, Serialize};

use crate::identity::PodSnapshot;

/// One instance Tessera carved for a pod's reservation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OwnedInstance {
    pub gpu_uuid: String,
    pub profile: String,
    pub placement: MigPlacement,
    pub gpu_instance_id: u32,
    pub compute_instance_id: u32,
    pub mig_uuid: String,
    /// The pod it was carved for (for the log; reservations, not pods, keep it alive).
    pub pod_uid: String,
}

impl OwnedInstance {
    fn key(&self) -> ReservationKey {
        ReservationKey {
            gpu_uuid: self.gpu_uuid.clone(),
            profile: self.profile.clone(),
            placement: self.placement,
        }
    }
}

/// What identifies a reservation on the node: HAMi's allocation key (GPU, profile, placement).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ReservationKey {
    pub gpu_uuid: String,
    pub profile: String,
    pub placement: MigPlacement,
}

/// Why `Allocate` could not give a container its MIG instance.
#[derive(Debug, thiserror::Error)]
pub enum MigAllocateError {
    #[error(
        "pod has no MIG reservation for container {container} device {device} on GPU {gpu} (hami.io/vgpu-mig-allocations)"
    )]
    NoReservation {
        container: usize,
        device: usize,
        gpu: String,
    },
    #[error("hami.io/vgpu-mig-allocations is unreadable")]
    Annotation(#[source] hami_contract::mig::MigAllocationError),
    #[error("GPU {0} is not a MIG GPU this plugin manages")]
    UnknownGpu(String),
    #[error("carving {profile} at {start}+{size} on GPU {gpu} failed")]
    Carve {
        gpu: String,
        profile: String,
        start: u32,
        size: u32,
        #[source]
        source: MigError,
    },
    #[error("the MIG record lock is poisoned")]
    Poisoned,
}

/// The node's MIG GPUs by UUID → NVML index.
pub type MigGpus = std::collections::BTreeMap<String, u32>;

/// Carves, records and destroys MIG instances.
pub struct MigManager {
    control: Arc<dyn MigControl>,
    /// Where the records are kept (`None`: in memory only, tests).
    checkpoint: Option<PathBuf>,
    /// The records; also serializes every carve and destroy on the node (NVML's MIG calls on one
    /// GPU must not interleave, and they are rare).
    owned: Mutex<Vec<OwnedInstance>>,
}

impl std::fmt::Debug for MigManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MigManager")
            .field("checkpoint", &self.checkpoint)
            .finish_non_exhaustive()
    }
}

/// What a reconcile pass did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Reconciled {
    /// Instances destroyed (their reservation is gone).
    pub destroyed: Vec<OwnedInstance>,
    /// Instances whose destroy failed (kept; tried again next pass), with the reason.
    pub failed: Vec<(OwnedInstance, String)>,
}

impl MigManager {
    /// Loads the records from `checkpoint` (a missing file is no records; an unreadable one is
    /// logged and treated as none, so instances are then only adopted from pods).
    pub fn load(control: Arc<dyn MigControl>, checkpoint: Option<PathBuf>) -> Self {
        let owned = checkpoint
            .as_ref()
            .and_then(|p| match std::fs::read(p) {
                Ok(bytes) => match serde_json::from_slice::<Vec<OwnedInstance>>(&bytes) {
                    Ok(v) => Some(v),
                    Err(e) => {
                        tracing::warn!(path = %p.display(), error = %e, "MIG checkpoint unreadable; adopting instances from pod annotations only");
                        None
                    }
                },
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(e) => {
                    tracing::warn!(path = %p.display(), error = %e, "cannot read the MIG checkpoint");
                    None
                }
            })
            .unwrap_or_default();
        MigManager {
            control,
            checkpoint,
            owned: Mutex::new(owned),
        }
    }

    /// Whether `mig_uuid` is an instance Tessera carved.
    pub fn owns(&self, mig_uuid: &str) -> bool {
        self.owned
            .lock()
            .map(|o| o.iter().any(|i| i.mig_uuid == mig_uuid))
            .unwrap_or(false)
    }

    /// The records now.
    pub fn owned(&self) -> Vec<OwnedInstance> {
        self.owned.lock().map(|o| o.clone()).unwrap_or_default()
    }

    fn save(&self, owned: &[OwnedInstance]) {
        let Some(path) = &self.checkpoint else { return };
        let write = || -> std::io::Result<()> {
            let tmp = path.with_extension("tmp");
            let bytes = serde_json::to_vec_pretty(owned).map_err(std::io::Error::other)?;
            std::fs::write(&tmp, bytes)?;
            std::fs::rename(&tmp, path)
        };
        if let Err(e) = write() {
            tracing::error!(path = %path.display(), error = %e, "cannot write the MIG checkpoint; a restart would not find the instances carved since");
        }
    }

    /// Start-up: drops records of instances that no longer exist, and adopts the realized
    /// reservations of live pods whose instance NVML still shows with the same identity (the
    /// checkpoint may be gone). Nothing is destroyed here.
    pub fn adopt(&self, gpus: &MigGpus, pods: &[PodSnapshot]) {
        let Ok(mut owned) = self.owned.lock() else {
            return;
        };
        let mut live: Vec<(&str, nvml_mig::MigInstance)> = Vec::new();
        // GPUs whose instances could not be listed: their records are kept as they are.
        let mut unknown: BTreeSet<&str> = BTreeSet::new();
        for (uuid, index) in gpus {
            match self.control.instances(*index) {
                Ok(list) => live.extend(list.into_iter().map(|i| (uuid.as_str(), i))),
                Err(e) => {
                    tracing::warn!(gpu = %uuid, error = %tessera_runtime::DisplayChain(&e), "cannot list MIG instances; keeping the GPU's records");
                    unknown.insert(uuid.as_str());
                }
            }
        }
        let is_live = |o: &OwnedInstance| {
            live.iter().any(|(g, i)| {
                *g == o.gpu_uuid
                    && i.uuid == o.mig_uuid
                    && i.gpu_instance_id == o.gpu_instance_id
                    && crate::gpu::contract_placement(i.placement) == o.placement
            })
        };
        owned.retain(|o| {
            let keep = unknown.contains(o.gpu_uuid.as_str()) || is_live(o);
            if !keep {
                tracing::info!(mig = %o.mig_uuid, gpu = %o.gpu_uuid, "recorded MIG instance is gone; record dropped");
            }
            keep
        });
        for pod in pods.iter().filter(|p| !p.terminal) {
            let Some(raw) = pod
                .annotations
                .get(hami_contract::annotations::MIG_ALLOCATIONS)
            else {
                continue;
            };
            let Ok(allocations) = decode_allocations(raw) else {
                continue;
            };
            for a in allocations.iter().filter(|a| a.is_realized()) {
                if !gpus.contains_key(&a.gpu_uuid) || owned.iter().any(|o| o.mig_uuid == a.mig_uuid)
                {
                    continue;
                }
                let record = OwnedInstance {
                    gpu_uuid: a.gpu_uuid.clone(),
                    profile: a.profile.clone(),
                    placement: a.placement,
                    gpu_instance_id: a.gpu_instance_id.unwrap_or_default(),
                    compute_instance_id: a.compute_instance_id.unwrap_or_default(),
                    mig_uuid: a.mig_uuid.clone(),
                    pod_uid: pod.uid.clone(),
                };
                if is_live(&record) {
                    tracing::info!(mig = %record.mig_uuid, pod = %pod.key(), "adopted the MIG instance of a running pod");
                    owned.push(record);
                }
            }
        }
        self.save(&owned);
    }

    /// Gives reservation `a` its instance: the recorded one when it is already carved (a repeated
    /// `Allocate`), else a new one at exactly the reserved placement.
    pub fn ensure(
        &self,
        gpus: &MigGpus,
        a: &MigAllocation,
        pod_uid: &str,
    ) -> Result<OwnedInstance, MigAllocateError> {
        let index = *gpus
            .get(&a.gpu_uuid)
            .ok_or_else(|| MigAllocateError::UnknownGpu(a.gpu_uuid.clone()))?;
        let mut owned = self.owned.lock().map_err(|_| MigAllocateError::Poisoned)?;
        let key = ReservationKey {
            gpu_uuid: a.gpu_uuid.clone(),
            profile: a.profile.clone(),
            placement: a.placement,
        };
        if let Some(existing) = owned.iter().find(|o| o.key() == key) {
            return Ok(existing.clone());
        }
        let placement = Placement {
            start: a.placement.start,
            size: a.placement.size,
        };
        let made = self
            .control
            .create(index, &a.profile, placement)
            .map_err(|source| MigAllocateError::Carve {
                gpu: a.gpu_uuid.clone(),
                profile: a.profile.clone(),
                start: a.placement.start,
                size: a.placement.size,
                source,
            })?;
        let record = OwnedInstance {
            gpu_uuid: a.gpu_uuid.clone(),
            profile: a.profile.clone(),
            placement: a.placement,
            gpu_instance_id: made.gpu_instance_id,
            compute_instance_id: made.compute_instance_id.unwrap_or_default(),
            mig_uuid: made.uuid,
            pod_uid: pod_uid.to_owned(),
        };
        tracing::info!(mig = %record.mig_uuid, gpu = %record.gpu_uuid, profile = %record.profile,
            start = record.placement.start, size = record.placement.size, gi = record.gpu_instance_id,
            "carved the reserved MIG instance");
        owned.push(record.clone());
        self.save(&owned);
        Ok(record)
    }

    /// Destroys every recorded instance that no reservation in `active` names.
    pub fn reconcile(&self, gpus: &MigGpus, active: &BTreeSet<ReservationKey>) -> Reconciled {
        let mut out = Reconciled::default();
        let Ok(mut owned) = self.owned.lock() else {
            return out;
        };
        let mut kept = Vec::with_capacity(owned.len());
        for o in owned.drain(..) {
            if active.contains(&o.key()) {
                kept.push(o);
                continue;
            }
            let Some(index) = gpus.get(&o.gpu_uuid) else {
                // The GPU is no longer managed (filtered, lost): keep the record, touch nothing.
                kept.push(o);
                continue;
            };
            match self.control.destroy(*index, o.gpu_instance_id) {
                Ok(()) => {
                    tracing::info!(mig = %o.mig_uuid, gpu = %o.gpu_uuid, pod_uid = %o.pod_uid, "destroyed a MIG instance no pod reserves any more");
                    out.destroyed.push(o);
                }
                Err(e) => {
                    out.failed
                        .push((o.clone(), tessera_runtime::DisplayChain(&e).to_string()));
                    kept.push(o);
                }
            }
        }
        *owned = kept;
        if !out.destroyed.is_empty() {
            self.save(&owned);
        }
        out
    }
}

/// The reservations of the node's pods that keep an instance alive: every pod bound to `node`
/// that has not finished. A pod being deleted still holds its instance until it is gone or
/// terminal (its containers may still run on it; HAMi drops it at once, deviation Q3).
/// `None` when a reservation annotation cannot be read: the caller must then destroy nothing.
pub fn active_reservations(node: &str, pods: &[PodSnapshot]) -> Option<BTreeSet<ReservationKey>> {
    let mut out = BTreeSet::new();
    for pod in pods {
        if pod.terminal || pod.node_name.as_deref() != Some(node) {
            continue;
        }
        let Some(raw) = pod
            .annotations
            .get(hami_contract::annotations::MIG_ALLOCATIONS)
        else {
            continue;
        };
        match decode_allocations(raw) {
            Ok(list) => out.extend(list.into_iter().map(|a| ReservationKey {
                gpu_uuid: a.gpu_uuid,
                profile: a.profile,
                placement: a.placement,
            })),
            Err(e) => {
                tracing::warn!(pod = %pod.key(), error = %e, "unreadable MIG reservation; no MIG instance is destroyed this pass");
                return None;
            }
        }
    }
    Some(out)
}

/// The reservations of one container (`container` in HAMi's index space: init containers first),
/// by device position.
pub fn container_reservations(
    annotations: &std::collections::BTreeMap<String, String>,
    container: usize,
) -> Result<Vec<MigAllocation>, MigAllocateError> {
    let raw = annotations
        .get(hami_contract::annotations::MIG_ALLOCATIONS)
        .map(String::as_str)
        .unwrap_or_default();
    let mut mine: Vec<MigAllocation> = decode_allocations(raw)
        .map_err(MigAllocateError::Annotation)?
        .into_iter()
        .filter(|a| usize::try_from(a.container_index).is_ok_and(|c| c == container))
        .collect();
    mine.sort_by_key(|a| a.device_index);
    Ok(mine)
}

/// The annotation value with the runtime identity of `realized` filled in.
pub fn with_runtime_identity(
    annotations: &std::collections::BTreeMap<String, String>,
    realized: &[(u32, u32, OwnedInstance)],
) -> Result<String, MigAllocateError> {
    let raw = annotations
        .get(hami_contract::annotations::MIG_ALLOCATIONS)
        .map(String::as_str)
        .unwrap_or_default();
    let mut all = decode_allocations(raw).map_err(MigAllocateError::Annotation)?;
    for a in &mut all {
        if let Some((_, _, o)) = realized
            .iter()
            .find(|(c, d, _)| *c == a.container_index && *d == a.device_index)
        {
            a.mig_uuid = o.mig_uuid.clone();
            a.gpu_instance_id = Some(o.gpu_instance_id);
            a.compute_instance_id = Some(o.compute_instance_id);
        }
    }
    Ok(hami_contract::mig::encode_allocations(&all))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{MemoryMig, bound_pod};
    use hami_contract::annotations::MIG_ALLOCATIONS;
    use hami_contract::mig::encode_allocations;

    const NODE: &str = "node-a";

    fn gpus() -> MigGpus {
        MigGpus::from([("GPU-0".to_owned(), 0), ("GPU-1".to_owned(), 1)])
    }

    fn reservation(
        container: u32,
        device: u32,
        gpu: &str,
        profile: &str,
        start: u32,
        size: u32,
    ) -> MigAllocation {
        MigAllocation {
            container_index: container,
            device_index: device,
            gpu_uuid: gpu.into(),
            profile: profile.into(),
            placement: MigPlacement { start, size },
            ..MigAllocation::default()
        }
    }

    fn pod_with(name: &str, reservations: &[MigAllocation]) -> PodSnapshot {
        let mut p = bound_pod(NODE, name, &[&[("GPU-0", 0, 0)]], 1);
        p.annotations
            .insert(MIG_ALLOCATIONS.into(), encode_allocations(reservations));
        p
    }

    /// HAMi: pkg/device-plugin/nvidiadevice/nvinternal/plugin/migmgr.go `EnsureAllocation` (the
    /// reserved profile at exactly the reserved placement, never another one; a repeat for the
    /// same GPU, profile and placement gets the instance already carved).
    #[test]
    fn a_reservation_is_carved_once_at_its_placement_and_repeats_get_the_same_instance() {
        let control = Arc::new(MemoryMig::a100s(2));
        let m = MigManager::load(control.clone(), None);
        let r = reservation(0, 0, "GPU-0", "3g.20gb", 4, 4);
        let first = m.ensure(&gpus(), &r, "uid-a").expect("carved");
        assert_eq!(first.placement, MigPlacement { start: 4, size: 4 });
        let again = m.ensure(&gpus(), &r, "uid-a").expect("same");
        assert_eq!(first, again);
        assert_eq!(control.instances(0).map(|i| i.len()).ok(), Some(1));
        assert!(m.owns(&first.mig_uuid));
        // An overlapping reservation is refused with NVML's reason, never moved elsewhere.
        let clash = reservation(0, 0, "GPU-0", "1g.5gb", 5, 1);
        let err = m.ensure(&gpus(), &clash, "uid-b").expect_err("overlap");
        assert!(
            tessera_runtime::DisplayChain(&err)
                .to_string()
                .contains("not free"),
            "{err}"
        );
        assert!(matches!(
            m.ensure(&gpus(), &reservation(0, 0, "GPU-9", "1g.5gb", 0, 1), "u"),
            Err(MigAllocateError::UnknownGpu(_))
        ));
    }

    /// HAMi: migmgr.go `ReconcileActiveAllocations` and server.go `activeMigAllocationKeys`
    /// (instances no active reservation names are destroyed), except that a pod being deleted
    /// still holds its instance (deviation Q3).
    #[test]
    fn instances_die_with_their_reservation_and_not_before() {
        let control = Arc::new(MemoryMig::a100s(2));
        let m = MigManager::load(control.clone(), None);
        let ra = reservation(0, 0, "GPU-0", "1g.5gb", 6, 1);
        let rb = reservation(0, 0, "GPU-1", "3g.20gb", 0, 4);
        m.ensure(&gpus(), &ra, "uid-a").expect("a");
        m.ensure(&gpus(), &rb, "uid-b").expect("b");
        let a = pod_with("a", std::slice::from_ref(&ra));
        let mut b = pod_with("b", std::slice::from_ref(&rb));
        // Both alive; b being deleted still holds its instance (its containers may run).
        b.deleting = true;
        let active = active_reservations(NODE, &[a.clone(), b.clone()]).expect("readable");
        assert_eq!(m.reconcile(&gpus(), &active), Reconciled::default());
        // b finished: its instance goes, a's stays.
        b.terminal = true;
        let active = active_reservations(NODE, &[a.clone(), b]).expect("readable");
        let done = m.reconcile(&gpus(), &active);
        assert_eq!(done.destroyed.len(), 1);
        assert_eq!(done.destroyed[0].gpu_uuid, "GPU-1");
        assert_eq!(control.instances(1).map(|i| i.len()).ok(), Some(0));
        assert_eq!(control.instances(0).map(|i| i.len()).ok(), Some(1));
        // A busy instance is kept and retried.
        control.busy.lock().expect("lock").insert(0);
        let done = m.reconcile(&gpus(), &BTreeSet::new());
        assert_eq!(done.failed.len(), 1);
        assert_eq!(m.owned().len(), 1);
        control.busy.lock().expect("lock").clear();
        assert_eq!(m.reconcile(&gpus(), &BTreeSet::new()).destroyed.len(), 1);
        assert!(m.owned().is_empty());
    }

    #[test]
    fn an_unreadable_reservation_on_the_node_stops_every_destroy() {
        let mut p = pod_with("a", &[]);
        p.annotations.insert(MIG_ALLOCATIONS.into(), "{".into());
        assert_eq!(active_reservations(NODE, &[p]), None);
        // Pods of other nodes do not count.
        let mut other = pod_with("x", &[reservation(0, 0, "GPU-0", "1g.5gb", 0, 1)]);
        other.node_name = Some("node-b".into());
        assert_eq!(active_reservations(NODE, &[other]), Some(BTreeSet::new()));
    }

    /// HAMi: server.go `primeMigManagerFromAnnotations` / migmgr.go `AdoptAllocation` (a running
    /// pod's realized reservation is adopted only when NVML shows that instance); Tessera's own
    /// records and never destroying others' instances are deviation Q2.
    #[test]
    fn a_restarted_plugin_finds_what_it_carved_and_never_touches_the_rest() {
        let dir = tempfile::tempdir().expect("tmp");
        let checkpoint = dir.path().join("mig.json");
        let control = Arc::new(MemoryMig::a100s(2));
        // Someone else's instance on GPU 1.
        let foreign = control
            .create(1, "1g.5gb", Placement { start: 0, size: 1 })
            .expect("foreign");
        let m = MigManager::load(control.clone(), Some(checkpoint.clone()));
        let r = reservation(0, 0, "GPU-0", "1g.5gb", 6, 1);
        let carved = m.ensure(&gpus(), &r, "uid-a").expect("carved");
        drop(m);

        let restarted = MigManager::load(control.clone(), Some(checkpoint.clone()));
        restarted.adopt(&gpus(), &[]);
        assert!(restarted.owns(&carved.mig_uuid));
        assert!(!restarted.owns(&foreign.uuid));
        // Nothing reserves anything now: only Tessera's instance is destroyed.
        let done = restarted.reconcile(&gpus(), &BTreeSet::new());
        assert_eq!(done.destroyed.len(), 1);
        assert_eq!(
            control.instances(1).map(|i| i.len()).ok(),
            Some(1),
            "foreign kept"
        );

        // Without a checkpoint, a running pod's recorded instance is adopted from its annotation.
        let again = control
            .create(0, "1g.5gb", Placement { start: 6, size: 1 })
            .expect("carved again");
        let mut realized = r.clone();
        realized.mig_uuid = again.uuid.clone();
        realized.gpu_instance_id = Some(again.gpu_instance_id);
        realized.compute_instance_id = Some(0);
        let lost = MigManager::load(control.clone(), Some(dir.path().join("none.json")));
        lost.adopt(&gpus(), &[pod_with("a", &[realized.clone()])]);
        assert!(lost.owns(&again.uuid));
        // An annotation naming an instance NVML does not show is not adopted.
        let mut stale = realized;
        stale.mig_uuid = "MIG-gone".into();
        let other = MigManager::load(control, None);
        other.adopt(&gpus(), &[pod_with("b", &[stale])]);
        assert!(!other.owns("MIG-gone"));
    }

    #[test]
    fn the_runtime_identity_is_written_into_the_reservation_it_realizes() {
        let r0 = reservation(1, 0, "GPU-0", "1g.5gb", 6, 1);
        let r1 = reservation(1, 1, "GPU-0", "1g.5gb", 5, 1);
        let other = reservation(0, 0, "GPU-1", "3g.20gb", 0, 4);
        let pod = pod_with("a", &[other.clone(), r1.clone(), r0.clone()]);
        let mine = container_reservations(&pod.annotations, 1).expect("readable");
        assert_eq!(mine, vec![r0.clone(), r1.clone()], "by device position");
        let control = Arc::new(MemoryMig::a100s(2));
        let m = MigManager::load(control, None);
        let i0 = m.ensure(&gpus(), &r0, "uid-a").expect("r0");
        let value = with_runtime_identity(&pod.annotations, &[(1, 0, i0.clone())]).expect("ok");
        let after = decode_allocations(&value).expect("valid");
        let realized: Vec<_> = after.iter().filter(|a| a.is_realized()).collect();
        assert_eq!(realized.len(), 1);
        assert_eq!(realized[0].mig_uuid, i0.mig_uuid);
        assert_eq!(realized[0].device_index, 0);
        assert_eq!(after.len(), 3, "other entries kept");
    }
}

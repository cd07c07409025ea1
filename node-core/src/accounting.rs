//! What the node's allocations account for: the GPUs each pod was booked and the owner of each
//! shim region file. The usage monitor (feedback, metrics) and the unaccounted-process check
//! ([`crate::unaccounted`]) both start from these.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use crate::identity::PodSnapshot;

/// A region file's place: `<containers_dir>/<podUID>_<container>/<name>.cache`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionPath {
    pub pod_uid: String,
    pub container: String,
    pub path: PathBuf,
}

/// The GPUs booked to each pod (by UID): every UUID of its `hami.io/vgpu-devices-allocated` and
/// `hami.io/vgpu-devices-to-allocate` annotations, which the scheduler writes and no container
/// can. A pod with neither (or only undecodable ones) is absent.
pub fn booked_gpus(pods: &[PodSnapshot]) -> BTreeMap<String, BTreeSet<String>> {
    use hami_contract::annotations as keys;
    use hami_contract::devices::PodDevices;
    pods.iter()
        .filter_map(|pod| {
            let gpus: BTreeSet<String> = [keys::DEVICES_ALLOCATED, keys::DEVICES_TO_ALLOCATE]
                .into_iter()
                .filter_map(|key| pod.annotations.get(key))
                .filter_map(|value| PodDevices::decode(value).ok())
                .flat_map(|devices| devices.0.into_iter().flatten().map(|d| d.uuid))
                .collect();
            (!gpus.is_empty()).then(|| (pod.uid.clone(), gpus))
        })
        .collect()
}

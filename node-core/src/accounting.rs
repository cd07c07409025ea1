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

/// The GPU memory (MiB) booked to each pod (by UID) on each GPU, summed over its containers:
/// from `hami.io/vgpu-devices-allocated`, else `hami.io/vgpu-devices-to-allocate` (the two
/// describe the same booking; they are not added). A pod with neither decodable is absent.
pub fn booked_memory(pods: &[PodSnapshot]) -> BTreeMap<String, BTreeMap<String, u64>> {
    use hami_contract::annotations as keys;
    use hami_contract::devices::PodDevices;
    pods.iter()
        .filter_map(|pod| {
            let devices = [keys::DEVICES_ALLOCATED, keys::DEVICES_TO_ALLOCATE]
                .into_iter()
                .filter_map(|key| pod.annotations.get(key))
                .find_map(|value| PodDevices::decode(value).ok())?;
            let mut per_gpu: BTreeMap<String, u64> = BTreeMap::new();
            for d in devices.0.into_iter().flatten() {
                *per_gpu.entry(d.uuid).or_default() += u64::from(d.usedmem);
            }
            (!per_gpu.is_empty()).then(|| (pod.uid.clone(), per_gpu))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(uid: &str, annotations: &[(&str, &str)]) -> PodSnapshot {
        PodSnapshot {
            namespace: "ns".into(),
            name: uid.into(),
            uid: uid.into(),
            node_name: Some("node".into()),
            scheduler_name: None,
            annotations: annotations
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            terminal: false,
            deleting: false,
            init_containers: vec![],
            containers: vec![],
            started_containers: Default::default(),
            container_ids: Default::default(),
            resource_version: String::new(),
        }
    }

    /// Two containers on one GPU add up; the two annotations describe one booking and are not
    /// added; a pod with an undecodable booking has none.
    #[test]
    fn booked_memory_sums_containers_per_gpu_from_one_annotation() {
        use hami_contract::annotations as keys;
        let two = "GPU-a,NVIDIA,1000,30:;GPU-a,NVIDIA,500,20:GPU-b,NVIDIA,2000,0:;";
        let pods = [
            pod(
                "p1",
                &[
                    (keys::DEVICES_ALLOCATED, two),
                    (keys::DEVICES_TO_ALLOCATE, two),
                ],
            ),
            pod("p2", &[(keys::DEVICES_TO_ALLOCATE, "GPU-c,NVIDIA,700,0:;")]),
            pod("p3", &[(keys::DEVICES_ALLOCATED, "not a device list")]),
        ];
        let got = booked_memory(&pods);
        let expected: BTreeMap<String, BTreeMap<String, u64>> = [
            (
                "p1".to_string(),
                [("GPU-a".to_string(), 1500), ("GPU-b".to_string(), 2000)].into(),
            ),
            ("p2".to_string(), [("GPU-c".to_string(), 700)].into()),
        ]
        .into();
        assert_eq!(got, expected);
        assert_eq!(booked_gpus(&pods).keys().collect::<Vec<_>>(), ["p1", "p2"]);
    }
}

//! Allocation identity (see `docs/design/allocation-identity.md` and
//! `docs/design/kubelet-device-manager-facts.md` §10 (b)).
//!
//! Nothing in a kubelet `Allocate` call names the pod: the device plugin sees only the device
//! count of each container, one call at a time. The *signature* σ(p) of a pod is that sequence of
//! counts; two pods pending on one node whose signatures can be mistaken for each other are
//! *confusable*, and confusable pods are harmless together only when *interchangeable*.

use std::collections::BTreeMap;

use crate::NVIDIA_VENDOR;
use crate::annotations;
use crate::devices::PodDevices;

/// Pod annotations that constrain where a pod's GPUs may be (or how they are chosen): a planned
/// placement of one pod is valid for another only if these are equal. Deliberately broad —
/// including an annotation that does not matter costs only throughput, missing one that does
/// would hand a pod GPUs it must not have.
pub const PLACEMENT_CONSTRAINT_ANNOTATIONS: &[&str] = &[
    annotations::USE_GPU_UUID,
    annotations::NOUSE_GPU_UUID,
    annotations::USE_GPU_TYPE,
    annotations::NOUSE_GPU_TYPE,
    annotations::VGPU_MODE,
    annotations::NUMA_BIND,
    annotations::GPU_SCHEDULER_POLICY,
];

/// σ(p) and what decides a container's limits, derived from the pod's device list.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AllocationSignature {
    /// Device count per non-empty NVIDIA container, kubelet order (init containers, then app).
    pub counts: Vec<u32>,
    /// `(mem, cores)` per device per such container: what the plugin puts into the limits.
    pub payload: Vec<Vec<(u32, u32)>>,
    /// GPU UUIDs per device per such container: what the plugin puts into
    /// `NVIDIA_VISIBLE_DEVICES`, and what the extender books.
    pub devices: Vec<Vec<String>>,
    /// The pod's [`PLACEMENT_CONSTRAINT_ANNOTATIONS`] that are present, sorted by key.
    pub constraints: Vec<(String, String)>,
}

impl AllocationSignature {
    /// Builds the signature from a pod's container device list (`hami.io/vgpu-devices-allocated`
    /// or the planned list) and its annotations. Only `NVIDIA` entries count; containers without
    /// one make no `Allocate` call for `nvidia.com/gpu` and are skipped.
    pub fn new(devices: &PodDevices, pod_annotations: &BTreeMap<String, String>) -> Self {
        let mut counts = Vec::new();
        let mut payload = Vec::new();
        let mut uuids = Vec::new();
        for container in &devices.0 {
            let mine: Vec<(u32, u32)> = container
                .iter()
                .filter(|d| d.vendor == NVIDIA_VENDOR)
                .map(|d| (d.usedmem, d.usedcores))
                .collect();
            if !mine.is_empty() {
                counts.push(u32::try_from(mine.len()).unwrap_or(u32::MAX));
                payload.push(mine);
                uuids.push(
                    container
                        .iter()
                        .filter(|d| d.vendor == NVIDIA_VENDOR)
                        .map(|d| d.uuid.clone())
                        .collect(),
                );
            }
        }
        let constraints = PLACEMENT_CONSTRAINT_ANNOTATIONS
            .iter()
            .filter_map(|k| {
                pod_annotations
                    .get(*k)
                    .map(|v| ((*k).to_owned(), v.clone()))
            })
            .collect::<BTreeMap<_, _>>()
            .into_iter()
            .collect();
        AllocationSignature {
            counts,
            payload,
            devices: uuids,
            constraints,
        }
    }

    /// Two pods pending on one node could be taken for each other by the device plugin:
    /// σa[0] appears anywhere in σb, or σb[0] anywhere in σa. (A pod whose run stops after
    /// container i−1 leaves the plugin expecting σ[i] when the next pod's first call arrives.)
    /// A pod with no NVIDIA container makes no call and is confusable with nothing.
    pub fn confusable_with(&self, other: &Self) -> bool {
        match (self.counts.first(), other.counts.first()) {
            (Some(a0), Some(b0)) => other.counts.contains(a0) || self.counts.contains(b0),
            _ => false,
        }
    }

    /// Serving one with the other's entry gives it exactly its own GPUs and limits: same counts,
    /// payload, GPUs and constraints, and each pod is *self-consistent*.
    ///
    /// The GPUs must match too: a plugin that cannot tell the two apart may serve either entry to
    /// either pod, and with different GPUs the extender's books would then name the wrong GPU for
    /// each, so deleting one pod would free the GPU the other still uses.
    ///
    /// Self-consistency closes the abort hole: if the kubelet rejects pod p after serving its
    /// container i−1, the next call may be q's first container, and a plugin without abort
    /// detection takes it for p's container i. That call gets the right GPUs and limits only if
    /// every container of p with q's first count carries the first container's.
    pub fn interchangeable_with(&self, other: &Self) -> bool {
        self == other && self.is_self_consistent()
    }

    /// Every container whose device count equals the first container's has the first
    /// container's payload and GPUs.
    fn is_self_consistent(&self) -> bool {
        match (
            self.counts.first(),
            self.payload.first(),
            self.devices.first(),
        ) {
            (Some(c0), Some(p0), Some(d0)) => self
                .counts
                .iter()
                .zip(&self.payload)
                .zip(&self.devices)
                .all(|((c, p), d)| c != c0 || (p == p0 && d == d0)),
            _ => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sig(list: &str, annos: &[(&str, &str)]) -> AllocationSignature {
        let a = annos
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        AllocationSignature::new(&PodDevices::decode(list).unwrap(), &a)
    }

    #[test]
    fn signature_skips_gpu_less_containers_and_other_vendors() {
        let s = sig(
            ";GPU-a,NVIDIA,1000,30:GPU-b,NVIDIA,1000,30:;MLU-x,MLU,5,5:;GPU-c,NVIDIA,500,0:;",
            &[(annotations::USE_GPU_TYPE, "A100"), ("unrelated", "x")],
        );
        assert_eq!(s.counts, vec![2, 1]);
        assert_eq!(
            s.payload,
            vec![vec![(1000, 30), (1000, 30)], vec![(500, 0)]]
        );
        assert_eq!(
            s.constraints,
            vec![(annotations::USE_GPU_TYPE.to_owned(), "A100".to_owned())]
        );
    }

    #[test]
    fn confusable_when_a_first_count_appears_in_the_other() {
        let one = sig("GPU-a,NVIDIA,1000,30:;", &[]);
        let two_then_one = sig("GPU-a,NVIDIA,1,1:GPU-b,NVIDIA,1,1:;GPU-c,NVIDIA,1,1:;", &[]);
        let two = sig("GPU-a,NVIDIA,1,1:GPU-b,NVIDIA,1,1:;", &[]);
        let none = sig(";;", &[]);
        assert!(one.confusable_with(&one));
        assert!(one.confusable_with(&two_then_one)); // σb[0]=2 ∉ σa, but σa[0]=1 ∈ σb
        assert!(two_then_one.confusable_with(&one));
        assert!(!one.confusable_with(&two));
        assert!(!none.confusable_with(&one) && !none.confusable_with(&none));
    }

    #[test]
    fn interchangeable_needs_equal_counts_payload_and_constraints() {
        let a = sig("GPU-a,NVIDIA,1000,30:;", &[]);
        // Same shape and the same GPU: interchangeable.
        assert!(a.interchangeable_with(&sig("GPU-a,NVIDIA,1000,30:;", &[])));
        // Same shape on another GPU: serving one the other's entry would swap the GPUs the
        // extender booked for them.
        assert!(!a.interchangeable_with(&sig("GPU-z,NVIDIA,1000,30:;", &[])));
        assert!(!a.interchangeable_with(&sig("GPU-a,NVIDIA,2000,30:;", &[])));
        assert!(!a.interchangeable_with(&sig(
            "GPU-a,NVIDIA,1000,30:;",
            &[(annotations::NUMA_BIND, "true")]
        )));
        assert!(!a.interchangeable_with(&sig("GPU-a,NVIDIA,1000,30:;GPU-a,NVIDIA,1000,30:;", &[])));
    }

    #[test]
    fn identical_pods_whose_later_container_looks_like_the_first_are_not_interchangeable() {
        // Containers of one GPU each, with different limits: after an abort between them, the
        // next pod's first call would be served the second container's 2000 MiB.
        let mixed = sig("GPU-a,NVIDIA,1000,30:;GPU-b,NVIDIA,2000,30:;", &[]);
        assert!(!mixed.interchangeable_with(&mixed.clone()));
        let uniform = sig("GPU-a,NVIDIA,1000,30:;GPU-a,NVIDIA,1000,30:;", &[]);
        assert!(uniform.interchangeable_with(&uniform.clone()));
        // Same limits on another GPU: the next pod's first call would get GPU-b.
        let two_gpus = sig("GPU-a,NVIDIA,1000,30:;GPU-b,NVIDIA,1000,30:;", &[]);
        assert!(!two_gpus.interchangeable_with(&two_gpus.clone()));
        // A later container with another count cannot be taken for a first call.
        let shaped = sig(
            "GPU-a,NVIDIA,1000,30:;GPU-b,NVIDIA,2000,30:GPU-c,NVIDIA,2000,30:;",
            &[],
        );
        assert!(shaped.interchangeable_with(&shaped.clone()));
    }
}

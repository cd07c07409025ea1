//! What an allocated ResourceClaim gives a container on this node. Pure: the caller supplies
//! the claim as read from the API server and the node's GPUs.
//!
//! kube-scheduler wrote the allocation (`status.allocation.devices.results`): for each of the
//! driver's results the device (`gpu-<index>`) and, on a shareable GPU, the capacity the claim
//! consumes (`consumedCapacity`: `memory` in bytes, `cores` in percent). That becomes the shim's
//! limits: `CUDA_DEVICE_MEMORY_LIMIT_<i>` is the memory in MiB (rounded down: never more than
//! was booked) and `CUDA_DEVICE_SM_LIMIT` the cores. A GPU allocated whole (no consumed capacity)
//! gives the claim all its memory and 100 % of its cores.

use std::collections::{BTreeMap, BTreeSet};

use hami_contract::devices::ContainerDevice;
use k8s_openapi::api::resource::v1::{DeviceRequestAllocationResult, ResourceClaim};

use super::{CORES, DRIVER, MEMORY};
use tessera_node::gpu::GpuInfo;

/// The part of one GPU a claim was given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuShare {
    /// The claim's requests this GPU serves (their parent names, as containers reference them).
    pub requests: Vec<String>,
    /// The pool (this node's name) and device (`gpu-<index>`) of the allocation.
    pub pool: String,
    pub device: String,
    pub uuid: String,
    /// The limits the shim enforces; `None` for admin access (the device is visible, unlimited,
    /// as for a monitoring tool: the API server allows it only in admin namespaces).
    pub limits: Option<ShareLimits>,
}

/// A share's memory (MiB) and cores (percent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShareLimits {
    pub memory_mib: u32,
    pub cores: u32,
}

/// Why a claim cannot be prepared on this node.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClaimError {
    #[error("claim {name} has UID {found}, the kubelet asked for {expected}")]
    UidMismatch {
        name: String,
        expected: String,
        found: String,
    },
    #[error("claim {0} is not allocated")]
    NotAllocated(String),
    #[error("claim {0} has no {DRIVER} device")]
    NoDevices(String),
    #[error(
        "claim {claim} was allocated device {device} of pool {pool}, not of this node's pool {node}"
    )]
    OtherPool {
        claim: String,
        pool: String,
        device: String,
        node: String,
    },
    #[error("claim {claim} was allocated device {device}, which this node does not have")]
    UnknownDevice { claim: String, device: String },
    #[error("claim {claim}: consumed capacity {name}={value:?} of device {device} is {why}")]
    BadCapacity {
        claim: String,
        device: String,
        name: String,
        value: String,
        why: String,
    },
}

/// The consumed capacity named `name` (published unqualified, so in the driver's domain; also
/// accepted fully qualified).
fn consumed<'a>(result: &'a DeviceRequestAllocationResult, name: &str) -> Option<&'a str> {
    let map = result.consumed_capacity.as_ref()?;
    map.get(name)
        .or_else(|| map.get(&format!("{DRIVER}/{name}")))
        .map(|q| q.0.as_str())
}

/// The whole number a quantity is, rounded up as Go's `Quantity.Value()` rounds.
fn whole(text: &str) -> Result<i128, String> {
    hami_contract::quantity::parse(text)
        .map(|q| q.ceil())
        .map_err(|e| e.to_string())
}

/// The GPU shares `claim` holds on this node (pool `node`), merged per GPU (a claim that got two
/// shares of one GPU gets one share with their sum), in allocation order.
pub fn claim_shares(
    claim: &ResourceClaim,
    expected_uid: &str,
    node: &str,
    gpus: &[GpuInfo],
) -> Result<Vec<GpuShare>, ClaimError> {
    let name = format!(
        "{}/{}",
        claim.metadata.namespace.as_deref().unwrap_or_default(),
        claim.metadata.name.as_deref().unwrap_or_default()
    );
    let uid = claim.metadata.uid.as_deref().unwrap_or_default();
    if uid != expected_uid {
        return Err(ClaimError::UidMismatch {
            name,
            expected: expected_uid.to_owned(),
            found: uid.to_owned(),
        });
    }
    let results = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .ok_or_else(|| ClaimError::NotAllocated(name.clone()))?
        .results
        .as_deref()
        .unwrap_or_default();
    let mut shares: Vec<GpuShare> = Vec::new();
    for r in results.iter().filter(|r| r.driver == DRIVER) {
        if r.pool != node {
            return Err(ClaimError::OtherPool {
                claim: name,
                pool: r.pool.clone(),
                device: r.device.clone(),
                node: node.to_owned(),
            });
        }
        let gpu = gpus
            .iter()
            .find(|g| super::slice::device_name(g.index) == r.device)
            .ok_or_else(|| ClaimError::UnknownDevice {
                claim: name.clone(),
                device: r.device.clone(),
            })?;
        let total = gpu.memory_total_mib.unwrap_or(0);
        let bad = |cap: &str, value: &str, why: String| ClaimError::BadCapacity {
            claim: name.clone(),
            device: r.device.clone(),
            name: cap.to_owned(),
            value: value.to_owned(),
            why,
        };
        let limits = if r.admin_access == Some(true) {
            None
        } else {
            let memory_mib = match consumed(r, MEMORY) {
                None => total,
                Some(v) => {
                    let bytes = whole(v).map_err(|why| bad(MEMORY, v, why))?;
                    let mib = bytes / (1024 * 1024);
                    if mib < 1 || mib > i128::from(total) {
                        return Err(bad(MEMORY, v, format!("outside 1 MiB..={total} MiB")));
                    }
                    mib as u32
                }
            };
            let cores = match consumed(r, CORES) {
                None => 100,
                Some(v) => {
                    let c = whole(v).map_err(|why| bad(CORES, v, why))?;
                    if !(0..=100).contains(&c) {
                        return Err(bad(CORES, v, "outside 0..=100".to_owned()));
                    }
                    c as u32
                }
            };
            Some(ShareLimits { memory_mib, cores })
        };
        // A container references the parent request of a prioritized list's subrequest.
        let request = r.request.split('/').next().unwrap_or_default().to_owned();
        match shares.iter_mut().find(|s| s.uuid == gpu.uuid) {
            Some(s) => {
                if !s.requests.contains(&request) {
                    s.requests.push(request);
                }
                s.limits = match (s.limits, limits) {
                    (Some(a), Some(b)) => Some(ShareLimits {
                        memory_mib: a.memory_mib.saturating_add(b.memory_mib).min(total),
                        cores: (a.cores + b.cores).min(100),
                    }),
                    _ => None,
                };
            }
            None => shares.push(GpuShare {
                requests: vec![request],
                pool: r.pool.clone(),
                device: r.device.clone(),
                uuid: gpu.uuid.clone(),
                limits,
            }),
        }
    }
    if shares.is_empty() {
        return Err(ClaimError::NoDevices(name));
    }
    Ok(shares)
}

/// The shares as the shim's device list (`_<i>` = position); `None` when a share has no limits
/// (admin access): the claim then gets its GPUs without the shim.
pub fn shim_devices(shares: &[GpuShare]) -> Option<Vec<ContainerDevice>> {
    shares
        .iter()
        .map(|s| {
            s.limits
                .map(|l| ContainerDevice::nvidia(&s.uuid, l.memory_mib, l.cores))
        })
        .collect()
}

/// The UIDs of the pods `claim` is reserved for (`status.reservedFor` entries of the core
/// group's `pods`): the pods whose processes its GPUs account for. kube-scheduler reserves the
/// claim for a pod before the kubelet prepares it, so every pod using a prepared claim is there.
/// Other consumers (a workload controller's reservation) run no process and are left out.
pub fn reserved_pods(claim: &ResourceClaim) -> BTreeSet<String> {
    claim
        .status
        .as_ref()
        .and_then(|s| s.reserved_for.as_deref())
        .unwrap_or_default()
        .iter()
        .filter(|c| c.resource == "pods" && c.api_group.as_deref().unwrap_or_default().is_empty())
        .filter(|c| !c.uid.is_empty())
        .map(|c| c.uid.clone())
        .collect()
}

/// The requests of `shares`, each with the devices serving it (for the kubelet's response).
pub fn devices_by_request(shares: &[GpuShare]) -> BTreeMap<&str, Vec<&str>> {
    let mut out: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for s in shares {
        for r in &s.requests {
            out.entry(r.as_str()).or_default().push(s.device.as_str());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::resource::v1::{
        AllocationResult, DeviceAllocationResult, ResourceClaimStatus,
    };
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    fn gpus() -> Vec<GpuInfo> {
        (0..2)
            .map(|i| GpuInfo {
                uuid: format!("GPU-{i}"),
                index: i,
                name: "NVIDIA A100-SXM4-40GB".into(),
                memory_total_mib: Some(40960),
                pci_bus_id: String::new(),
                numa_node: None,
                mig_enabled: false,
                mig: None,
            })
            .collect()
    }

    fn result(
        request: &str,
        pool: &str,
        device: &str,
        cap: &[(&str, &str)],
    ) -> DeviceRequestAllocationResult {
        DeviceRequestAllocationResult {
            request: request.into(),
            driver: DRIVER.into(),
            pool: pool.into(),
            device: device.into(),
            consumed_capacity: (!cap.is_empty()).then(|| {
                cap.iter()
                    .map(|(k, v)| ((*k).to_owned(), Quantity((*v).to_owned())))
                    .collect()
            }),
            ..Default::default()
        }
    }

    fn claim(results: Vec<DeviceRequestAllocationResult>) -> ResourceClaim {
        let mut c = ResourceClaim::default();
        c.metadata.namespace = Some("ml".into());
        c.metadata.name = Some("train-gpu".into());
        c.metadata.uid = Some("uid-1".into());
        c.status = Some(ResourceClaimStatus {
            allocation: Some(AllocationResult {
                devices: Some(DeviceAllocationResult {
                    results: Some(results),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        });
        c
    }

    #[test]
    fn consumed_capacity_becomes_the_shims_limits() {
        let c = claim(vec![result(
            "gpu",
            "node-a",
            "gpu-1",
            &[("memory", "8Gi"), ("cores", "25")],
        )]);
        let shares = claim_shares(&c, "uid-1", "node-a", &gpus()).unwrap();
        assert_eq!(shares.len(), 1);
        assert_eq!(shares[0].uuid, "GPU-1");
        assert_eq!(
            shares[0].limits,
            Some(ShareLimits {
                memory_mib: 8192,
                cores: 25
            })
        );
        let devs = shim_devices(&shares).unwrap();
        assert_eq!(devs[0].usedmem, 8192);
    }

    #[test]
    fn a_whole_gpu_claim_gets_all_of_it_and_other_drivers_are_ignored() {
        let mut other = result("nic", "node-a", "eth0", &[]);
        other.driver = "net.example.com".into();
        let c = claim(vec![other, result("gpu", "node-a", "gpu-0", &[])]);
        let shares = claim_shares(&c, "uid-1", "node-a", &gpus()).unwrap();
        assert_eq!(
            shares[0].limits,
            Some(ShareLimits {
                memory_mib: 40960,
                cores: 100
            })
        );
    }

    #[test]
    fn two_shares_of_one_gpu_merge_and_subrequests_name_their_parent() {
        let c = claim(vec![
            result(
                "a/small",
                "node-a",
                "gpu-0",
                &[("memory", "1000Mi"), ("cores", "10")],
            ),
            result(
                "b",
                "node-a",
                "gpu-0",
                &[("gpu.tessera.dev/memory", "2000Mi"), ("cores", "95")],
            ),
        ]);
        let shares = claim_shares(&c, "uid-1", "node-a", &gpus()).unwrap();
        assert_eq!(shares.len(), 1);
        assert_eq!(shares[0].requests, ["a", "b"]);
        assert_eq!(
            shares[0].limits,
            Some(ShareLimits {
                memory_mib: 3000,
                cores: 100
            })
        );
        assert_eq!(devices_by_request(&shares)["b"], ["gpu-0"]);
    }

    #[test]
    fn claims_this_node_cannot_serve_are_refused_with_the_reason() {
        let gpus = gpus();
        let ok = claim(vec![result("gpu", "node-a", "gpu-0", &[])]);
        assert!(matches!(
            claim_shares(&ok, "uid-2", "node-a", &gpus),
            Err(ClaimError::UidMismatch { .. })
        ));
        assert!(matches!(
            claim_shares(&ok, "uid-1", "node-b", &gpus),
            Err(ClaimError::OtherPool { .. })
        ));
        let unknown = claim(vec![result("gpu", "node-a", "gpu-7", &[])]);
        assert!(matches!(
            claim_shares(&unknown, "uid-1", "node-a", &gpus),
            Err(ClaimError::UnknownDevice { .. })
        ));
        for (cap, value) in [
            ("memory", "41Gi"),
            ("memory", "1k"),
            ("memory", "x"),
            ("cores", "101"),
        ] {
            let c = claim(vec![result("gpu", "node-a", "gpu-0", &[(cap, value)])]);
            assert!(
                matches!(
                    claim_shares(&c, "uid-1", "node-a", &gpus),
                    Err(ClaimError::BadCapacity { .. })
                ),
                "{cap}={value}"
            );
        }
        let mut pending = claim(Vec::new());
        pending.status = None;
        assert!(matches!(
            claim_shares(&pending, "uid-1", "node-a", &gpus),
            Err(ClaimError::NotAllocated(_))
        ));
        assert!(matches!(
            claim_shares(&claim(Vec::new()), "uid-1", "node-a", &gpus),
            Err(ClaimError::NoDevices(_))
        ));
    }

    #[test]
    fn admin_access_sees_the_gpu_without_the_shim() {
        let mut r = result("gpu", "node-a", "gpu-0", &[]);
        r.admin_access = Some(true);
        let admin = claim(vec![r]);
        let shares = claim_shares(&admin, "uid-1", "node-a", &gpus()).unwrap();
        assert_eq!(shares[0].limits, None);
        assert!(shim_devices(&shares).is_none());
        let shared = claim(vec![result("gpu", "node-a", "gpu-0", &[("cores", "10")])]);
        let shares = claim_shares(&shared, "uid-1", "node-a", &gpus()).unwrap();
        assert!(shim_devices(&shares).is_some());
        // A claim that no longer reads as this node's is not one (the watch then holds its
        // processes to the shim's regions).
        assert!(claim_shares(&admin, "uid-2", "node-a", &gpus()).is_err());
    }

    #[test]
    fn the_pods_a_claim_is_reserved_for_are_its_pod_consumers() {
        use k8s_openapi::api::resource::v1::ResourceClaimConsumerReference;
        let consumer =
            |group: Option<&str>, resource: &str, uid: &str| ResourceClaimConsumerReference {
                api_group: group.map(str::to_owned),
                name: format!("n-{uid}"),
                resource: resource.into(),
                uid: uid.into(),
            };
        let mut c = claim(vec![result("gpu", "node-a", "gpu-0", &[])]);
        assert!(reserved_pods(&c).is_empty(), "not reserved yet");
        if let Some(status) = c.status.as_mut() {
            status.reserved_for = Some(vec![
                consumer(None, "pods", "pod-1"),
                consumer(Some(""), "pods", "pod-2"),
                consumer(Some("apps"), "deployments", "dep-1"),
                consumer(Some("example.com"), "pods", "not-a-pod"),
                consumer(None, "pods", ""),
            ]);
        }
        assert_eq!(
            reserved_pods(&c),
            ["pod-1".to_owned(), "pod-2".to_owned()].into()
        );
    }
}

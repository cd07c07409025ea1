//! How a pod's allocation counts against its GPUs (contract §5.1, HAMi
//! `CollapseInitContainerUsage` in `pkg/device/initContainer.go`).

use crate::devices::PodDevices;

/// A pod's footprint on one GPU, after collapsing init and app containers.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DeviceUsage {
    /// GPU UUID.
    pub uuid: String,
    /// Vendor key (`NVIDIA`).
    pub vendor: String,
    /// Replicas (`Used` in HAMi's node usage) the pod takes on the GPU; always ≥ 1.
    pub slots: u32,
    /// MiB.
    pub mem: u32,
    /// Percent of SMs.
    pub cores: u32,
}

/// HAMi's `CollapseInitContainerUsage`. `devices` is the pod's
/// `hami.io/vgpu-devices-allocated` list; its first `init_count` entries are the init containers.
///
/// Per (vendor, UUID): init containers run one after another, so they contribute the *max*
/// memory and cores and one slot; app containers run together, so they contribute the *sum*
/// and one slot per occurrence; the pod books the larger of the two per field (slots ≥ 1).
/// Once every init container has exited 0 (`init_containers_done`), only the app-container sum
/// remains (`AppContainersOnlyDeviceUsage`): GPUs used only by init containers drop out.
///
/// The result lists GPUs in order of first appearance in `devices`; sums saturate at `u32::MAX`.
pub fn collapse_pod_usage(
    devices: &PodDevices,
    init_count: usize,
    init_containers_done: bool,
) -> Vec<DeviceUsage> {
    #[derive(Default, Clone, Copy)]
    struct Acc {
        init_mem: u32,
        init_cores: u32,
        init_seen: bool,
        app_mem: u32,
        app_cores: u32,
        app_slots: u32,
    }
    let mut order: Vec<(String, String)> = Vec::new();
    let mut acc: Vec<Acc> = Vec::new();
    let split = init_count.min(devices.0.len());
    for (i, container) in devices.0.iter().enumerate() {
        let is_init = i < split;
        for d in container {
            let pos = match order
                .iter()
                .position(|(v, u)| *v == d.vendor && *u == d.uuid)
            {
                Some(p) => p,
                None => {
                    order.push((d.vendor.clone(), d.uuid.clone()));
                    acc.push(Acc::default());
                    order.len() - 1
                }
            };
            let a = &mut acc[pos];
            if is_init {
                a.init_seen = true;
                a.init_mem = a.init_mem.max(d.usedmem);
                a.init_cores = a.init_cores.max(d.usedcores);
            } else {
                a.app_mem = a.app_mem.saturating_add(d.usedmem);
                a.app_cores = a.app_cores.saturating_add(d.usedcores);
                a.app_slots = a.app_slots.saturating_add(1);
            }
        }
    }
    order
        .into_iter()
        .zip(acc)
        .filter_map(|((vendor, uuid), a)| {
            if init_containers_done {
                (a.app_slots > 0).then_some(DeviceUsage {
                    uuid,
                    vendor,
                    slots: a.app_slots,
                    mem: a.app_mem,
                    cores: a.app_cores,
                })
            } else {
                let init_slots = u32::from(a.init_seen);
                Some(DeviceUsage {
                    uuid,
                    vendor,
                    slots: a.app_slots.max(init_slots).max(1),
                    mem: a.app_mem.max(a.init_mem),
                    cores: a.app_cores.max(a.init_cores),
                })
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(list: &str, init: usize, done: bool) -> Vec<(String, u32, u32, u32)> {
        collapse_pod_usage(&PodDevices::decode(list).unwrap(), init, done)
            .into_iter()
            .map(|u| (u.uuid, u.slots, u.mem, u.cores))
            .collect()
    }

    #[test]
    fn init_max_app_sum_then_larger_of_the_two() {
        // init: 4000/50 then 1000/10 on GPU-a; app: two containers of 1000/20 on GPU-a.
        let list = "GPU-a,NVIDIA,4000,50:;GPU-a,NVIDIA,1000,10:;GPU-a,NVIDIA,1000,20:;GPU-a,NVIDIA,1000,20:;";
        assert_eq!(usage(list, 2, false), vec![("GPU-a".into(), 2, 4000, 50)]);
        assert_eq!(usage(list, 2, true), vec![("GPU-a".into(), 2, 2000, 40)]);
    }

    #[test]
    fn init_only_gpu_books_one_slot_until_init_is_done() {
        let list = "GPU-i,NVIDIA,3000,30:;GPU-a,NVIDIA,1000,10:;";
        assert_eq!(
            usage(list, 1, false),
            vec![("GPU-i".into(), 1, 3000, 30), ("GPU-a".into(), 1, 1000, 10)]
        );
        assert_eq!(usage(list, 1, true), vec![("GPU-a".into(), 1, 1000, 10)]);
    }

    #[test]
    fn no_init_containers_is_a_plain_sum() {
        let list = "GPU-a,NVIDIA,100,10:;GPU-a,NVIDIA,100,10:;";
        assert_eq!(usage(list, 0, false), vec![("GPU-a".into(), 2, 200, 20)]);
    }
}

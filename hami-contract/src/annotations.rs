//! Annotation and label keys (contract §2, §3).

/// Node: the device plugin's device list (JSON since v2.8, text before).
pub const NODE_REGISTER: &str = "hami.io/node-nvidia-register";
/// Node: optional pairwise GPU topology scores.
pub const NODE_SCORE: &str = "hami.io/node-nvidia-score";
/// Node: the scheduler's handshake for NVIDIA devices.
pub const NODE_HANDSHAKE: &str = "hami.io/node-handshake";
/// Node: HAMi's bind-to-Allocate lock. Tessera does not rely on it (see docs/design).
pub const NODE_LOCK: &str = "hami.io/mutex.lock";
/// Node: comma-separated GPU UUIDs excluded from new allocations.
pub const DEVICE_CORDON: &str = "hami.io/device-cordon";

/// Pod (annotation and label): the node the extender chose.
pub const VGPU_NODE: &str = "hami.io/vgpu-node";
/// Pod: Unix seconds of the filter decision.
pub const VGPU_TIME: &str = "hami.io/vgpu-time";
/// Pod: container device list still to be served by the device plugin.
pub const DEVICES_TO_ALLOCATE: &str = "hami.io/vgpu-devices-to-allocate";
/// Pod: container device list as decided; never modified afterwards; the source of usage.
pub const DEVICES_ALLOCATED: &str = "hami.io/vgpu-devices-allocated";
/// Pod: MIG allocations (JSON).
pub const MIG_ALLOCATIONS: &str = "hami.io/vgpu-mig-allocations";
/// Pod: `allocating` | `success` | `failed`.
pub const BIND_PHASE: &str = "hami.io/bind-phase";
/// Pod: Unix seconds of the bind.
pub const BIND_TIME: &str = "hami.io/bind-time";

/// [`BIND_PHASE`] value written by the extender in Bind, before the Binding POST.
pub const BIND_PHASE_ALLOCATING: &str = "allocating";
/// [`BIND_PHASE`] value written by the device plugin once every container is allocated.
pub const BIND_PHASE_SUCCESS: &str = "success";
/// [`BIND_PHASE`] value written by the device plugin when an allocation failed.
pub const BIND_PHASE_FAILED: &str = "failed";

// User annotations read by the scheduler (contract §3.3); parsed by `crate::policy`.

/// Pod: only these GPU UUIDs (comma-separated). Fit reason `CardUuidMismatch`.
pub const USE_GPU_UUID: &str = "nvidia.com/use-gpuuuid";
/// Pod: never these GPU UUIDs (comma-separated).
pub const NOUSE_GPU_UUID: &str = "nvidia.com/nouse-gpuuuid";
/// Pod: the device type must contain one of these (comma-separated, case-insensitive).
pub const USE_GPU_TYPE: &str = "nvidia.com/use-gputype";
/// Pod: the device type must contain none of these.
pub const NOUSE_GPU_TYPE: &str = "nvidia.com/nouse-gputype";
/// Pod: the device mode (`hami-core`, `mig`, `mps`) must be a substring of this value.
pub const VGPU_MODE: &str = "nvidia.com/vgpu-mode";
/// Pod: Go boolean; all GPUs of a container on one NUMA node.
pub const NUMA_BIND: &str = "nvidia.com/numa-bind";
/// Pod: GPU policy (`binpack`, `spread`, `topology-aware`, `mutex`, `numa`, or a comma chain).
pub const GPU_SCHEDULER_POLICY: &str = "hami.io/gpu-scheduler-policy";
/// Pod: node policy (`binpack` or `spread`; anything else behaves as binpack).
pub const NODE_SCHEDULER_POLICY: &str = "hami.io/node-scheduler-policy";
/// Pod (v2.10): `slot=…,core=…,memory=…` weights of the device score.
pub const DEVICE_SCORING_WEIGHTS: &str = "hami.io/device-scoring-weights";

/// Pod or namespace label that makes the webhook skip the object.
pub const WEBHOOK_IGNORE_LABEL: &str = "hami.io/webhook";
/// Scheduler pods' role label.
pub const SCHEDULER_ROLE_LABEL: &str = "hami.io/scheduler-role";

/// Node, Tessera's extension (HAMi neither writes nor reads it): how the node's device plugin
/// tells which pod an `Allocate` serves. [`IDENTITY_POD_RESOURCES`]: the kubelet's pod-resources
/// `List` identifies the pod under admission exactly, so the extender may let several pods that
/// could be confused with each other be in flight on the node at once. Anything else (or no
/// annotation, as on nodes run by HAMi's plugin): the extender's bind rule keeps one such pod in
/// flight (`docs/design/allocation-identity.md`). The plugin fails closed whatever this says, so a
/// wrong value costs refused pods, never another pod's limits.
pub const ALLOCATION_IDENTITY: &str = "tessera.io/allocation-identity";
/// [`ALLOCATION_IDENTITY`]: identification through pod-resources.
pub const IDENTITY_POD_RESOURCES: &str = "pod-resources";
/// [`ALLOCATION_IDENTITY`]: the allocation signature and the bind rule only.
pub const IDENTITY_SIGNATURE: &str = "signature";

/// Annotations only the scheduler and the device plugin may write. The webhook denies any user
/// attempt to set them (HAMi #3076, #3041: a forged annotation books or steals devices).
pub const SCHEDULER_OWNED: &[&str] = &[
    VGPU_NODE,
    VGPU_TIME,
    DEVICES_TO_ALLOCATE,
    DEVICES_ALLOCATED,
    MIG_ALLOCATIONS,
    BIND_PHASE,
    BIND_TIME,
];

/// True for any key the webhook must refuse from users: the owned keys above and anything else
/// under the `hami.io/vgpu-` prefix.
pub fn is_scheduler_owned(key: &str) -> bool {
    SCHEDULER_OWNED.contains(&key) || key.starts_with("hami.io/vgpu-")
}

/// Node label naming the device plugin that serves the node, for the extender: `hami` puts the
/// node in HAMi-plugin mode (HAMi's own device plugin runs there): the extender writes HAMi's
/// node lock at bind and keeps one bind in flight on the node (`docs/helm.md`, "Mixed clusters").
/// Tessera's opt-in oversubscription, on the pod: `host` asks that, on a node whose
/// `deviceMemoryScaling` is above 1, the memory booked past the GPU's physical share be served
/// from host memory rather than taken from the card (docs/oversubscription.md). Without it,
/// HAMi's behaviour: the whole booking may be device memory.
pub const MEMORY_OVERSUBSCRIPTION: &str = "tessera.io/memory-oversubscription";
/// The one value of [`MEMORY_OVERSUBSCRIPTION`].
pub const MEMORY_OVERSUBSCRIPTION_HOST: &str = "host";

/// Whether the pod's annotations ask for host-backed oversubscription; `Err` names a value that
/// is not [`MEMORY_OVERSUBSCRIPTION_HOST`] (the webhook refuses it).
pub fn memory_oversubscription<'a>(
    mut annotations: impl Iterator<Item = (&'a str, &'a str)>,
) -> Result<bool, String> {
    match annotations.find(|(k, _)| *k == MEMORY_OVERSUBSCRIPTION) {
        None => Ok(false),
        Some((_, MEMORY_OVERSUBSCRIPTION_HOST)) => Ok(true),
        Some((_, other)) => Err(format!(
            "{MEMORY_OVERSUBSCRIPTION}: {other:?} is not a known value; the only one is {MEMORY_OVERSUBSCRIPTION_HOST:?}"
        )),
    }
}

/// Tessera's Warning Event reason, on a Node, for an NVIDIA container runtime that would hand
/// GPUs to any container naming them in its environment (the device plugin writes it at start;
/// `kubectl tessera doctor` reads it).
pub const EVENT_UNSAFE_GPU_DEVICE_LIST: &str = "UnsafeGPUDeviceList";

pub const DEVICE_PLUGIN_LABEL: &str = "tessera.io/device-plugin";
/// [`DEVICE_PLUGIN_LABEL`]: HAMi's device plugin.
pub const DEVICE_PLUGIN_HAMI: &str = "hami";

//! What one container gets from `Allocate` (contract §6.3): HAMi-core environment and mounts.
//! The responses are pure (the caller supplies the random cache id and whether optional host
//! files exist); the file helpers that go with them (`tessera_node::container_env`:
//! `resolve_shim_host_path`, `write_limits_file`, and `tessera_node::cache_dir` for the cache
//! directory) are shared by `Allocate` and the DRA plugin's prepare.

use std::collections::BTreeMap;

use hami_contract::config::GpuCorePolicy;
use hami_contract::devices::ContainerDevice;

use vgpu_region::protocol::{
    CONTAINER_LIMITS_PATH, CONTAINER_PRELOAD_PATH, CONTAINER_SHIM_PATH, CONTAINER_VGPU_DIR,
    LIMITS_FILE_NAME, env, render_limits_file, shared_cache_path,
};

use crate::nvidia_runtime::{
    DEVICE_LIST_MOUNT_SOURCE, DeviceListStrategy, VISIBLE_DEVICES_ENV, device_list,
};

/// Node-wide settings that shape every container's response.
#[derive(Debug, Clone, PartialEq)]
pub struct ResponseSettings {
    /// Host `HOOK_PATH` (chart: `/usr/local`); shim files are under `<hook>/vgpu`.
    pub hook_path: String,
    /// `deviceMemoryScaling` after node overrides: > 1 ⇒ `CUDA_OVERSUBSCRIBE=true`.
    pub memory_scaling: f64,
    /// `libCudaLogLevel`; empty ⇒ not set.
    pub lib_cuda_log_level: String,
    /// `disableCoreLimit` ⇒ `GPU_CORE_UTILIZATION_POLICY=disable`.
    pub disable_core_limit: bool,
    /// `gpuCorePolicy`: a non-default value ⇒ `GPU_CORE_UTILIZATION_POLICY=<value>` (HAMi's
    /// webhook sets it in the pod spec; the shim takes the policy from the limits file only, so
    /// `Allocate` writes it there too). `disableCoreLimit` wins.
    pub core_policy: hami_contract::config::GpuCorePolicy,
    /// Host shim path, already resolved (`libvgpu.so.<version>` when present).
    pub shim_host_path: String,
    /// Host `<hook>/vgpu/license` exists: mount it and the validator.
    pub license_present: bool,
    /// Also name the GPUs as CDI devices (`nvidia.com/gpu=<UUID>`, the NVIDIA CDI spec's names)
    /// for runtimes that inject devices through CDI.
    pub cdi_devices: bool,
    /// How the GPUs are named to the NVIDIA container runtime (`deviceListStrategy`).
    pub device_list: DeviceListStrategy,
    /// Simulated GPUs (chart `simulatedGpus`): no NVIDIA runtime mounts a driver, so every GPU
    /// container gets the simulated one here.
    pub simulated_driver: Option<SimulatedDriver>,
}

/// The simulated GPU driver of a node without GPUs (the chart's `simulatedGpus` mode, for trying
/// Tessera on kind or k3s): the fake `libcuda.so.1` and `libnvidia-ml.so.1` and the node's GPU
/// scenario, installed on the host by the chart from their own image (never the production one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimulatedDriver {
    /// The host directory holding both libraries and `scenario.json`.
    pub host_dir: String,
    /// Memory of each simulated GPU, MiB (what the fake CUDA reports as the card's total).
    pub memory_mib: u64,
}

/// Where simulated GPU containers find the driver libraries: the directory of the C library's
/// default search path on Debian and Ubuntu images (the loader searches it without
/// configuration) and on RHEL-family images, for this architecture.
pub fn simulated_driver_dirs() -> [String; 2] {
    [
        format!("/usr/lib/{}-linux-gnu", std::env::consts::ARCH),
        "/usr/lib64".to_owned(),
    ]
}

/// Where a simulated GPU container finds the node's GPU scenario.
pub const SIMULATED_SCENARIO_PATH: &str = "/etc/tessera-simulated-gpu/scenario.json";

impl SimulatedDriver {
    /// The mounts and environment that stand in for the NVIDIA runtime's driver injection.
    fn add_to(&self, envs: &mut BTreeMap<String, String>, mounts: &mut Vec<MountSpec>) {
        let dir = self.host_dir.trim_end_matches('/');
        for lib_dir in simulated_driver_dirs() {
            for lib in ["libcuda.so.1", "libnvidia-ml.so.1"] {
                mounts.push(MountSpec {
                    container_path: format!("{lib_dir}/{lib}"),
                    host_path: format!("{dir}/{lib}"),
                    read_only: true,
                });
            }
        }
        mounts.push(MountSpec {
            container_path: SIMULATED_SCENARIO_PATH.to_owned(),
            host_path: format!("{dir}/scenario.json"),
            read_only: true,
        });
        envs.insert(
            "FAKE_NVML_SCENARIO".to_owned(),
            SIMULATED_SCENARIO_PATH.to_owned(),
        );
        envs.insert(
            "FAKE_CUDA_MEMORY_MIB".to_owned(),
            self.memory_mib.to_string(),
        );
    }
}

impl ResponseSettings {
    /// `<hook>/vgpu`.
    pub fn host_vgpu_dir(&self) -> String {
        format!("{}/vgpu", self.hook_path.trim_end_matches('/'))
    }

    /// `<hook>/vgpu/containers/<podUID>_<container>`: the container's cache directory on the host.
    pub fn container_cache_dir(&self, pod_uid: &str, container: &str) -> String {
        format!("{}/containers/{pod_uid}_{container}", self.host_vgpu_dir())
    }
}

/// Which container is being served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerTarget {
    pub pod_uid: String,
    pub container_name: String,
    /// The container's spec sets `CUDA_DISABLE_CONTROL` to a Go-true value.
    pub disable_control: bool,
    /// Random id for `CUDA_DEVICE_MEMORY_SHARED_CACHE` (HAMi uses a UUID per Allocate).
    pub cache_id: String,
    /// The pod asks for host-backed oversubscription (`tessera.io/memory-oversubscription:
    /// host`): on a node whose memory scaling is above 1, the container's device memory is held
    /// to its physical share and the rest of its booking comes from host memory.
    pub host_oversubscription: bool,
}

/// One mount of the response.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct MountSpec {
    pub container_path: String,
    pub host_path: String,
    pub read_only: bool,
}

impl MountSpec {
    /// One entry of a volume-mount device list.
    fn device_list(container_path: String) -> MountSpec {
        MountSpec {
            container_path,
            host_path: DEVICE_LIST_MOUNT_SOURCE.to_owned(),
            read_only: true,
        }
    }
}

/// Environment and mounts for one container, plus the host directory the plugin must create
/// (mode 0777, emptied first) before answering.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerResponse {
    pub envs: BTreeMap<String, String>,
    pub mounts: Vec<MountSpec>,
    /// Fully qualified CDI device names (empty unless enabled).
    pub cdi_devices: Vec<String>,
    pub cache_dir: String,
    /// The limits file the plugin writes (root-owned, 0444) into `cache_dir` after preparing
    /// it, mounted read-only at [`CONTAINER_LIMITS_PATH`]: see `write_limits_file`.
    pub limits_file: LimitsFile,
}

/// The host path and text of a container's limits file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitsFile {
    pub host_path: String,
    /// `NAME=value` lines: the plugin-owned variables exactly as in the environment.
    pub content: String,
}

/// Why a container's response cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResponseError {
    #[error("container entry has no devices")]
    NoDevices,
    #[error("container name {0:?} cannot be used in a host path")]
    BadContainerName(String),
    #[error("pod UID {0:?} cannot be used in a host path")]
    BadPodUid(String),
}

/// The string can name a directory of its own: not empty, not `.` or `..`, only ASCII letters,
/// digits, `-`, `_` and `.`.
pub fn path_safe(s: &str) -> bool {
    !s.is_empty()
        && s != "."
        && s != ".."
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
}

/// The response for a container served devices without limits: the devices by their UUIDs and
/// nothing of the shim. HAMi's MIG path (`MIG-…` UUIDs: the hardware isolates an instance, and no
/// two containers share one, so there is no limit to enforce) and DRA's admin access.
pub fn whole_devices_response(
    mig_uuids: &[String],
    settings: &ResponseSettings,
) -> ContainerResponse {
    let mut envs = BTreeMap::new();
    let uuids: Vec<&str> = mig_uuids.iter().map(String::as_str).collect();
    let list = device_list(&uuids, settings.device_list);
    envs.insert(VISIBLE_DEVICES_ENV.to_owned(), list.visible_devices);
    let cdi_devices = if settings.cdi_devices {
        mig_uuids
            .iter()
            .map(|u| format!("nvidia.com/gpu={u}"))
            .collect()
    } else {
        Vec::new()
    };
    ContainerResponse {
        envs,
        mounts: list
            .mounts
            .into_iter()
            .map(MountSpec::device_list)
            .collect(),
        cdi_devices,
        cache_dir: String::new(),
        limits_file: LimitsFile {
            host_path: String::new(),
            content: String::new(),
        },
    }
}

/// The device memory, in MiB, behind a booking of `booked_mib` on a GPU registered with memory
/// scaling `scaling` (> 1): the booking's share of the physical card, rounded down.
pub fn device_share_mib(booked_mib: u32, scaling: f64) -> u64 {
    if scaling.is_finite() && scaling > 1.0 {
        (f64::from(booked_mib) / scaling).floor() as u64
    } else {
        u64::from(booked_mib)
    }
}

/// HAMi's response for a container served `devices` (annotation order = `_<i>` order).
pub fn container_response(
    devices: &[ContainerDevice],
    target: &ContainerTarget,
    settings: &ResponseSettings,
) -> Result<ContainerResponse, ResponseError> {
    if !path_safe(&target.pod_uid) {
        return Err(ResponseError::BadPodUid(target.pod_uid.clone()));
    }
    if !path_safe(&target.container_name) {
        return Err(ResponseError::BadContainerName(
            target.container_name.clone(),
        ));
    }
    let cache_dir = settings.container_cache_dir(&target.pod_uid, &target.container_name);
    shim_response(
        devices,
        cache_dir,
        &target.cache_id,
        target.disable_control,
        target.host_oversubscription,
        settings,
    )
}

/// The environment and mounts that put the shim into a container with `devices`' limits, its
/// host cache directory being `cache_dir` (a container's under `Allocate`, a claim's under DRA).
pub fn shim_response(
    devices: &[ContainerDevice],
    cache_dir: String,
    cache_id: &str,
    disable_control: bool,
    host_oversubscription: bool,
    settings: &ResponseSettings,
) -> Result<ContainerResponse, ResponseError> {
    let first = devices.first().ok_or(ResponseError::NoDevices)?;
    let mut envs = BTreeMap::new();
    let uuids: Vec<&str> = devices.iter().map(|d| d.uuid.as_str()).collect();
    let list = device_list(&uuids, settings.device_list);
    envs.insert(VISIBLE_DEVICES_ENV.to_owned(), list.visible_devices);
    for (i, d) in devices.iter().enumerate() {
        envs.insert(env::memory_limit(i), format!("{}m", d.usedmem));
    }
    envs.insert(env::SM_LIMIT.to_owned(), first.usedcores.to_string());
    let vgpu_dir = settings.host_vgpu_dir();
    // A path inside the container: the shim opens it there. The container's cache directory
    // is mounted at CONTAINER_VGPU_DIR whatever the host's hook path (deviation V6).
    envs.insert(env::SHARED_CACHE.to_owned(), shared_cache_path(cache_id));
    if settings.memory_scaling > 1.0 {
        envs.insert(env::OVERSUBSCRIBE.to_owned(), "true".to_owned());
        if host_oversubscription {
            // The physical part of each booking; the shim serves the rest from host memory.
            for (i, d) in devices.iter().enumerate() {
                let share = device_share_mib(d.usedmem, settings.memory_scaling);
                envs.insert(env::device_memory_share(i), format!("{share}m"));
            }
        }
    }
    if !settings.lib_cuda_log_level.is_empty() {
        envs.insert(
            env::LOG_LEVEL.to_owned(),
            settings.lib_cuda_log_level.clone(),
        );
    }
    let core_policy = if settings.disable_core_limit {
        GpuCorePolicy::Disable
    } else {
        settings.core_policy
    };
    if core_policy != GpuCorePolicy::Default {
        envs.insert(env::CORE_POLICY.to_owned(), core_policy.as_str().to_owned());
    }

    let mut mounts = vec![
        MountSpec {
            container_path: CONTAINER_SHIM_PATH.to_owned(),
            host_path: settings.shim_host_path.clone(),
            read_only: true,
        },
        MountSpec {
            container_path: CONTAINER_VGPU_DIR.to_owned(),
            host_path: cache_dir.clone(),
            read_only: false,
        },
    ];
    let limits_file = LimitsFile {
        host_path: format!("{cache_dir}/{LIMITS_FILE_NAME}"),
        content: render_limits_file(envs.iter().map(|(k, v)| (k.as_str(), v.as_str()))),
    };
    mounts.push(MountSpec {
        container_path: CONTAINER_LIMITS_PATH.to_owned(),
        host_path: limits_file.host_path.clone(),
        read_only: true,
    });
    if !disable_control {
        mounts.push(MountSpec {
            container_path: CONTAINER_PRELOAD_PATH.to_owned(),
            host_path: format!("{vgpu_dir}/ld.so.preload"),
            read_only: true,
        });
    }
    mounts.extend(list.mounts.into_iter().map(MountSpec::device_list));
    if settings.license_present {
        mounts.push(MountSpec {
            container_path: "/tmp/license".to_owned(),
            host_path: format!("{vgpu_dir}/license"),
            read_only: true,
        });
        mounts.push(MountSpec {
            container_path: "/usr/bin/vgpuvalidator".to_owned(),
            host_path: format!("{vgpu_dir}/vgpuvalidator"),
            read_only: true,
        });
    }
    // After the limits file: these are the driver's, not limits the shim must trust.
    if let Some(sim) = &settings.simulated_driver {
        sim.add_to(&mut envs, &mut mounts);
    }
    let cdi_devices = if settings.cdi_devices {
        devices
            .iter()
            .map(|d| format!("nvidia.com/gpu={}", d.uuid))
            .collect()
    } else {
        Vec::new()
    };
    Ok(ContainerResponse {
        envs,
        mounts,
        cdi_devices,
        cache_dir,
        limits_file,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(uuid: &str, mem: u32, cores: u32) -> ContainerDevice {
        ContainerDevice::nvidia(uuid, mem, cores)
    }

    fn settings() -> ResponseSettings {
        ResponseSettings {
            hook_path: "/usr/local".into(),
            memory_scaling: 1.0,
            lib_cuda_log_level: "1".into(),
            disable_core_limit: false,
            core_policy: GpuCorePolicy::Default,
            shim_host_path: "/usr/local/vgpu/libvgpu.so".into(),
            license_present: false,
            cdi_devices: false,
            device_list: Default::default(),
            simulated_driver: None,
        }
    }

    fn target(disable_control: bool) -> ContainerTarget {
        ContainerTarget {
            pod_uid: "0f1e2d3c-aaaa-bbbb-cccc-000000000001".into(),
            container_name: "trainer".into(),
            disable_control,
            cache_id: "4f1c0000-0000-4000-8000-000000000000".into(),
            host_oversubscription: false,
        }
    }

    fn render(r: &ContainerResponse) -> String {
        let mut out = String::new();
        for (k, v) in &r.envs {
            out.push_str(&format!("env {k}={v}\n"));
        }
        for m in &r.mounts {
            out.push_str(&format!(
                "mount {} <- {} {}\n",
                m.container_path,
                m.host_path,
                if m.read_only { "ro" } else { "rw" }
            ));
        }
        out
    }

    #[test]
    fn volume_mounts_name_the_gpus_as_mounts_the_container_cannot_set() {
        let volume = ResponseSettings {
            device_list: DeviceListStrategy::VolumeMounts,
            ..settings()
        };
        let r = container_response(
            &[dev("GPU-aaa", 3000, 30), dev("GPU-bbb", 4000, 50)],
            &target(false),
            &volume,
        )
        .expect("valid");
        let text = render(&r);
        assert!(text.contains("env NVIDIA_VISIBLE_DEVICES=/var/run/nvidia-container-devices\n"));
        assert!(text.contains(
            "mount /var/run/nvidia-container-devices/GPU-aaa <- /dev/null ro\n\
             mount /var/run/nvidia-container-devices/GPU-bbb <- /dev/null ro\n"
        ));
        assert!(!text.contains("GPU-aaa,GPU-bbb"), "{text}");
        // The whole-GPU path (MIG instances) names them the same way.
        let whole = whole_devices_response(&["MIG-1".to_owned()], &volume);
        assert_eq!(
            whole.envs.get("NVIDIA_VISIBLE_DEVICES").map(String::as_str),
            Some("/var/run/nvidia-container-devices")
        );
        assert_eq!(
            render(&whole),
            "env NVIDIA_VISIBLE_DEVICES=/var/run/nvidia-container-devices\n\
             mount /var/run/nvidia-container-devices/MIG-1 <- /dev/null ro\n"
        );
    }

    #[test]
    fn golden_two_devices_default_settings() {
        let r = container_response(
            &[dev("GPU-aaa", 3000, 30), dev("GPU-bbb", 4000, 50)],
            &target(false),
            &settings(),
        )
        .expect("valid");
        assert_eq!(
            render(&r),
            "env CUDA_DEVICE_MEMORY_LIMIT_0=3000m
env CUDA_DEVICE_MEMORY_LIMIT_1=4000m
env CUDA_DEVICE_MEMORY_SHARED_CACHE=/usr/local/vgpu/4f1c0000-0000-4000-8000-000000000000.cache
env CUDA_DEVICE_SM_LIMIT=30
env LIBCUDA_LOG_LEVEL=1
env NVIDIA_VISIBLE_DEVICES=GPU-aaa,GPU-bbb
mount /usr/local/vgpu/libvgpu.so <- /usr/local/vgpu/libvgpu.so ro
mount /usr/local/vgpu <- /usr/local/vgpu/containers/0f1e2d3c-aaaa-bbbb-cccc-000000000001_trainer rw
mount /usr/local/vgpu/vgpu-limits <- /usr/local/vgpu/containers/0f1e2d3c-aaaa-bbbb-cccc-000000000001_trainer/vgpu-limits ro
mount /etc/ld.so.preload <- /usr/local/vgpu/ld.so.preload ro
"
        );
        assert_eq!(
            r.limits_file.content,
            "# written by the Tessera node agent (Allocate or DRA prepare); read by libvgpu.so
CUDA_DEVICE_MEMORY_LIMIT_0=3000m
CUDA_DEVICE_MEMORY_LIMIT_1=4000m
CUDA_DEVICE_MEMORY_SHARED_CACHE=/usr/local/vgpu/4f1c0000-0000-4000-8000-000000000000.cache
CUDA_DEVICE_SM_LIMIT=30
"
        );
        assert_eq!(
            r.cache_dir,
            "/usr/local/vgpu/containers/0f1e2d3c-aaaa-bbbb-cccc-000000000001_trainer"
        );
    }

    /// Simulated GPUs: the driver libraries and the scenario are mounted where the NVIDIA
    /// runtime would have put the real driver, and the fake driver's settings stay out of the
    /// limits file the shim trusts.
    #[test]
    fn simulated_gpus_get_the_simulated_driver() {
        let s = ResponseSettings {
            simulated_driver: Some(SimulatedDriver {
                host_dir: "/usr/local/vgpu/simulated/".into(),
                memory_mib: 15360,
            }),
            ..settings()
        };
        let r = container_response(&[dev("GPU-aaa", 3000, 30)], &target(false), &s).expect("valid");
        let text = render(&r);
        let lib_dir = format!("/usr/lib/{}-linux-gnu", std::env::consts::ARCH);
        for want in [
            format!("mount {lib_dir}/libcuda.so.1 <- /usr/local/vgpu/simulated/libcuda.so.1 ro"),
            "mount /usr/lib64/libnvidia-ml.so.1 <- /usr/local/vgpu/simulated/libnvidia-ml.so.1 ro"
                .to_owned(),
            "mount /etc/tessera-simulated-gpu/scenario.json <- /usr/local/vgpu/simulated/scenario.json ro"
                .to_owned(),
            "env FAKE_NVML_SCENARIO=/etc/tessera-simulated-gpu/scenario.json".to_owned(),
            "env FAKE_CUDA_MEMORY_MIB=15360".to_owned(),
        ] {
            assert!(text.contains(&want), "{want} missing from\n{text}");
        }
        assert!(
            !r.limits_file.content.contains("FAKE_"),
            "{}",
            r.limits_file.content
        );
        let real = container_response(&[dev("GPU-aaa", 3000, 30)], &target(false), &settings())
            .expect("valid");
        assert!(
            !render(&real).contains("FAKE_"),
            "a real node gets no simulated driver"
        );
    }

    /// `gpuCorePolicy: force` must reach the shim, which reads the policy from the limits file
    /// only: without it a `force` container would follow the monitor's switch like `default`.
    #[test]
    fn a_non_default_core_policy_reaches_the_limits_file_and_disable_core_limit_wins() {
        let mut s = settings();
        s.core_policy = GpuCorePolicy::Force;
        let r = container_response(&[dev("GPU-aaa", 3000, 30)], &target(false), &s).expect("ok");
        assert_eq!(
            r.envs
                .get("GPU_CORE_UTILIZATION_POLICY")
                .map(String::as_str),
            Some("force")
        );
        assert!(
            r.limits_file
                .content
                .contains("\nGPU_CORE_UTILIZATION_POLICY=force\n"),
            "{}",
            r.limits_file.content
        );
        s.disable_core_limit = true;
        let r = container_response(&[dev("GPU-aaa", 3000, 30)], &target(false), &s).expect("ok");
        assert_eq!(
            r.envs
                .get("GPU_CORE_UTILIZATION_POLICY")
                .map(String::as_str),
            Some("disable")
        );
        s.disable_core_limit = false;
        s.core_policy = GpuCorePolicy::Default;
        let r = container_response(&[dev("GPU-aaa", 3000, 30)], &target(false), &s).expect("ok");
        assert!(!r.envs.contains_key("GPU_CORE_UTILIZATION_POLICY"));
    }

    #[test]
    fn golden_oversubscribed_disabled_core_limit_no_control_license() {
        let mut s = settings();
        s.memory_scaling = 2.0;
        s.disable_core_limit = true;
        s.lib_cuda_log_level = String::new();
        s.license_present = true;
        s.cdi_devices = true;
        s.hook_path = "/opt/hook/".into();
        s.shim_host_path = "/opt/hook/vgpu/libvgpu.so.v0.1.0".into();
        let r =
            container_response(&[dev("GPU-aaa", 15360, 100)], &target(true), &s).expect("valid");
        assert_eq!(
            render(&r),
            "env CUDA_DEVICE_MEMORY_LIMIT_0=15360m
env CUDA_DEVICE_MEMORY_SHARED_CACHE=/usr/local/vgpu/4f1c0000-0000-4000-8000-000000000000.cache
env CUDA_DEVICE_SM_LIMIT=100
env CUDA_OVERSUBSCRIBE=true
env GPU_CORE_UTILIZATION_POLICY=disable
env NVIDIA_VISIBLE_DEVICES=GPU-aaa
mount /usr/local/vgpu/libvgpu.so <- /opt/hook/vgpu/libvgpu.so.v0.1.0 ro
mount /usr/local/vgpu <- /opt/hook/vgpu/containers/0f1e2d3c-aaaa-bbbb-cccc-000000000001_trainer rw
mount /usr/local/vgpu/vgpu-limits <- /opt/hook/vgpu/containers/0f1e2d3c-aaaa-bbbb-cccc-000000000001_trainer/vgpu-limits ro
mount /tmp/license <- /opt/hook/vgpu/license ro
mount /usr/bin/vgpuvalidator <- /opt/hook/vgpu/vgpuvalidator ro
"
        );
        assert_eq!(r.cdi_devices, ["nvidia.com/gpu=GPU-aaa"]);
        assert!(
            r.limits_file
                .content
                .contains("\nGPU_CORE_UTILIZATION_POLICY=disable\n"),
            "{}",
            r.limits_file.content
        );
        assert!(!r.limits_file.content.contains("OVERSUBSCRIBE"));
    }

    /// Issue #31 item 2: a pod that opts in on a node with scaling 2 gets each device's
    /// physical share in the limits file (where the shim reads it); without the opt-in, or on a
    /// node without scaling, nothing changes.
    #[test]
    fn an_opted_in_pod_on_a_scaled_node_gets_its_device_shares_in_the_limits_file() {
        let mut s = settings();
        s.memory_scaling = 2.0;
        let devices = [dev("GPU-aaa", 15360, 30), dev("GPU-bbb", 4097, 30)];
        let mut t = target(false);
        t.host_oversubscription = true;
        let r = container_response(&devices, &t, &s).expect("valid");
        for line in [
            "\nTESSERA_DEVICE_MEMORY_SHARE_0=7680m\n",
            "\nTESSERA_DEVICE_MEMORY_SHARE_1=2048m\n",
            "\nCUDA_DEVICE_MEMORY_LIMIT_0=15360m\n",
        ] {
            assert!(
                r.limits_file.content.contains(line),
                "{}",
                r.limits_file.content
            );
        }
        let plain = container_response(&devices, &target(false), &s).expect("valid");
        assert!(!plain.limits_file.content.contains("MEMORY_SHARE_"));
        s.memory_scaling = 1.0;
        let unscaled = container_response(&devices, &t, &s).expect("valid");
        assert!(!unscaled.limits_file.content.contains("MEMORY_SHARE_"));
        assert_eq!(device_share_mib(100, f64::NAN), 100);
    }

    #[test]
    fn unsafe_names_and_empty_entries_are_errors() {
        assert_eq!(
            container_response(&[], &target(false), &settings()),
            Err(ResponseError::NoDevices)
        );
        let mut t = target(false);
        t.container_name = "../etc".into();
        assert!(matches!(
            container_response(&[dev("GPU-a", 1, 1)], &t, &settings()),
            Err(ResponseError::BadContainerName(_))
        ));
    }
}

//! The shim–node protocol: what the node agent puts into a container and the shim reads there
//! (core contract §1.2; docs/contract-deviations.md V1, V6). The paths inside the container, the
//! environment variables' names, the limits file's name, text format and size, and the rules
//! for who may own it. The node agent (`tessera-node`: `Allocate`, DRA prepare) and the shim
//! (`libvgpu.so`) both take them from here, so what one writes is what the other reads.

use std::collections::HashMap;

use crate::MAX_DEVICES;

/// Where the shim's files live inside every container (fixed by HAMi: `ld.so.preload` names it).
/// The container's cache directory is mounted here, read-write, whatever the host's hook path.
pub const CONTAINER_VGPU_DIR: &str = "/usr/local/vgpu";
/// The container's path of the shim library.
pub const CONTAINER_SHIM_PATH: &str = "/usr/local/vgpu/libvgpu.so";
/// The container's preload file; without it mounted, the shim is not loaded.
pub const CONTAINER_PRELOAD_PATH: &str = "/etc/ld.so.preload";
/// Where the container sees its limits file (read-only). The shim reads its limits, region path
/// and utilization policy from here in preference to its environment, which the container
/// controls (libvgpu-shim/README.md, "Attacks the shim resists"; deviation V1).
pub const CONTAINER_LIMITS_PATH: &str = "/usr/local/vgpu/vgpu-limits";
/// The limits file's name in the container's (or claim's) host directory.
pub const LIMITS_FILE_NAME: &str = "vgpu-limits";
/// The largest limits file the shim reads (the node writes a few hundred bytes).
pub const MAX_LIMITS_FILE_BYTES: u64 = 64 * 1024;
/// The first line of every limits file the node writes (a comment: the shim skips it).
pub const LIMITS_FILE_HEADER: &str =
    "# written by the Tessera node agent (Allocate or DRA prepare); read by libvgpu.so\n";
/// HAMi's lock directory. HAMi mounts it read-write into every GPU container; Tessera mounts it
/// into none (one namespace's pod could read another's files there: docs/security.md).
pub const HAMI_LOCK_DIR: &str = "/tmp/vgpulock";

/// The environment variables of the protocol.
pub mod env {
    /// Memory limit of every device (`<n>[kKmMgG]`); `_<i>` for device `i`.
    pub const MEMORY_LIMIT: &str = "CUDA_DEVICE_MEMORY_LIMIT";
    /// SM limit in percent of every device; `_<i>` for device `i`.
    pub const SM_LIMIT: &str = "CUDA_DEVICE_SM_LIMIT";
    /// The container's shared region file (a path inside the container).
    pub const SHARED_CACHE: &str = "CUDA_DEVICE_MEMORY_SHARED_CACHE";
    /// `default`, `force` or `disable`.
    pub const CORE_POLICY: &str = "GPU_CORE_UTILIZATION_POLICY";
    /// Set by the pod: the node leaves the preload out (the shim is not loaded).
    pub const DISABLE_CONTROL: &str = "CUDA_DISABLE_CONTROL";
    /// `true` when the node's memory scaling is above 1.
    pub const OVERSUBSCRIBE: &str = "CUDA_OVERSUBSCRIBE";
    /// Tessera's opt-in oversubscription (docs/oversubscription.md): the device memory a
    /// container may hold on device `i` (`_<i>`, HAMi's size syntax). Past it, up to the memory
    /// limit, `cuMemAlloc` is served from mapped host memory. Absent: HAMi's behaviour (the
    /// memory limit is all device memory).
    pub const DEVICE_MEMORY_SHARE: &str = "TESSERA_DEVICE_MEMORY_SHARE";
    /// The shim's log level (HAMi's `libCudaLogLevel`).
    pub const LOG_LEVEL: &str = "LIBCUDA_LOG_LEVEL";
    /// The container's scheduling priority (0 high, 1 low), read from the environment.
    pub const TASK_PRIORITY: &str = "CUDA_TASK_PRIORITY";

    /// `CUDA_DEVICE_MEMORY_LIMIT_<i>`.
    pub fn memory_limit(device: usize) -> String {
        format!("{MEMORY_LIMIT}_{device}")
    }

    /// `CUDA_DEVICE_SM_LIMIT_<i>`.
    pub fn sm_limit(device: usize) -> String {
        format!("{SM_LIMIT}_{device}")
    }

    /// `TESSERA_DEVICE_MEMORY_SHARE_<i>`.
    pub fn device_memory_share(device: usize) -> String {
        format!("{DEVICE_MEMORY_SHARE}_{device}")
    }
}

/// The container path of the shared region for a container's cache id.
pub fn shared_cache_path(cache_id: &str) -> String {
    format!("{CONTAINER_VGPU_DIR}/{cache_id}.cache")
}

/// The variables the node decides and the limits file carries: a container must not change
/// them, and the shim takes them from the file when it is there.
pub fn limits_owned(name: &str) -> bool {
    name.starts_with(env::MEMORY_LIMIT)
        || name.starts_with(env::SM_LIMIT)
        || name.starts_with(env::DEVICE_MEMORY_SHARE)
        || name == env::SHARED_CACHE
        || name == env::CORE_POLICY
}

/// Every limits-owned name the shim reads.
pub fn limits_owned_names() -> Vec<String> {
    let mut v = vec![
        env::MEMORY_LIMIT.to_owned(),
        env::SM_LIMIT.to_owned(),
        env::SHARED_CACHE.to_owned(),
        env::CORE_POLICY.to_owned(),
    ];
    for i in 0..MAX_DEVICES {
        v.push(env::memory_limit(i));
        v.push(env::sm_limit(i));
        v.push(env::device_memory_share(i));
    }
    v
}

/// The limits file's text for a container's environment: [`LIMITS_FILE_HEADER`], then one
/// `NAME=value` line per limits-owned variable, in the order given; other names are left out.
pub fn render_limits_file<'a>(vars: impl IntoIterator<Item = (&'a str, &'a str)>) -> String {
    let mut text = LIMITS_FILE_HEADER.to_owned();
    for (name, value) in vars {
        if limits_owned(name) {
            text.push_str(name);
            text.push('=');
            text.push_str(value);
            text.push('\n');
        }
    }
    text
}

/// Parses a limits file: `NAME=value` lines; blank lines and `#` comments are skipped, names
/// that are not limits-owned are ignored. Never fails: a line without `=` is skipped.
pub fn parse_limits_file(text: &str) -> HashMap<String, String> {
    text.lines()
        .map(str::trim_end)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter_map(|l| l.split_once('='))
        .filter(|(k, _)| limits_owned(k))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_rendered_is_what_is_parsed_and_nothing_else() {
        let vars = [
            ("CUDA_DEVICE_MEMORY_LIMIT_0", "1024m"),
            ("CUDA_DEVICE_SM_LIMIT", "30"),
            ("CUDA_DEVICE_MEMORY_SHARED_CACHE", "/usr/local/vgpu/x.cache"),
            ("NVIDIA_VISIBLE_DEVICES", "GPU-a"),
            ("LD_PRELOAD", "/evil.so"),
        ];
        let text = render_limits_file(vars);
        assert!(text.starts_with('#'));
        let parsed = parse_limits_file(&text);
        assert_eq!(parsed.len(), 3);
        assert_eq!(parsed["CUDA_DEVICE_MEMORY_LIMIT_0"], "1024m");
        assert_eq!(parsed["CUDA_DEVICE_SM_LIMIT"], "30");
        assert!(!parsed.contains_key("LD_PRELOAD"));
    }

    #[test]
    fn paths_agree() {
        assert_eq!(
            CONTAINER_LIMITS_PATH,
            format!("{CONTAINER_VGPU_DIR}/{LIMITS_FILE_NAME}")
        );
        assert!(CONTAINER_SHIM_PATH.starts_with(CONTAINER_VGPU_DIR));
        assert_eq!(shared_cache_path("ab"), "/usr/local/vgpu/ab.cache");
        assert!(limits_owned_names().iter().all(|n| limits_owned(n)));
    }
}

//! The CDI spec of a prepared claim: one CDI device per claim, `tessera.dev/gpu-claim=<claim
//! UID>`, whose container edits are what `Allocate` gives a device-plugin container (the GPUs in
//! `NVIDIA_VISIBLE_DEVICES`, the shim's mounts, the limits and the cache path), built by
//! [`tessera_node::container_env::shim_response`]. The runtime (containerd ≥ 1.7 with CDI) applies the
//! edits to every container the kubelet names the device for.
//!
//! One device per claim rather than per request: the edits of two devices in one container would
//! both set `NVIDIA_VISIBLE_DEVICES`, and the later would win. A claim is the unit of sharing.
//!
//! Spec files are written atomically (a temporary file renamed over the final name), so a
//! runtime never reads half a spec.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use tessera_node::container_env::ContainerResponse;

/// The CDI kind (`vendor/class`) of Tessera's claim devices.
pub const KIND: &str = "tessera.dev/gpu-claim";
/// The spec version written: understood by every CDI-capable containerd (1.7 and 2.x).
pub const CDI_VERSION: &str = "0.6.0";
/// Spec file names are `<PREFIX><claim UID>.json`.
pub const SPEC_PREFIX: &str = "tessera-gpu-claim_";

/// A CDI spec file (the fields Tessera writes).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Spec {
    pub cdi_version: String,
    pub kind: String,
    /// What the plugin needs to know about the claim after a restart (the spec files are the
    /// plugin's checkpoint: [`super::checkpoint`]).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    pub devices: Vec<CdiDevice>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CdiDevice {
    pub name: String,
    pub container_edits: ContainerEdits,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerEdits {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<CdiMount>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CdiMount {
    pub host_path: String,
    pub container_path: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub options: Vec<String>,
}

/// The fully qualified CDI device name of a claim (what the kubelet passes to the runtime).
pub fn device_id(claim_uid: &str) -> String {
    format!("{KIND}={claim_uid}")
}

/// The spec file of a claim in `dir`.
pub fn spec_path(dir: &Path, claim_uid: &str) -> PathBuf {
    dir.join(format!("{SPEC_PREFIX}{claim_uid}.json"))
}

/// The claim UID a spec file in `dir` belongs to, if it is one of Tessera's.
pub fn claim_of_spec(file_name: &str) -> Option<&str> {
    file_name.strip_prefix(SPEC_PREFIX)?.strip_suffix(".json")
}

/// The spec that gives a container `response`'s environment and mounts.
pub fn claim_spec(claim_uid: &str, response: &ContainerResponse) -> Spec {
    let env = response
        .envs
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    let mounts = response
        .mounts
        .iter()
        .map(|m| CdiMount {
            host_path: m.host_path.clone(),
            container_path: m.container_path.clone(),
            kind: "bind".to_owned(),
            options: vec![
                "rbind".to_owned(),
                if m.read_only { "ro" } else { "rw" }.to_owned(),
                "nosuid".to_owned(),
                "nodev".to_owned(),
            ],
        })
        .collect();
    Spec {
        cdi_version: CDI_VERSION.to_owned(),
        kind: KIND.to_owned(),
        annotations: BTreeMap::new(),
        devices: vec![CdiDevice {
            name: claim_uid.to_owned(),
            container_edits: ContainerEdits { env, mounts },
        }],
    }
}

/// Writes `spec` to `path` atomically, mode 0644 (the runtime reads it as root).
pub fn write_spec(path: &Path, spec: &Spec) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(
        ".{}.tmp",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("spec")
    ));
    let text = serde_json::to_vec_pretty(spec).map_err(std::io::Error::other)?;
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)?;
    f.write_all(&text)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

/// Removes a file; one already gone is fine.
pub fn remove_file(path: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hami_contract::config::GpuCorePolicy;
    use hami_contract::devices::ContainerDevice;
    use tessera_node::container_env::{ResponseSettings, shim_response};

    fn response() -> ContainerResponse {
        let settings = ResponseSettings {
            hook_path: "/usr/local".into(),
            memory_scaling: 1.0,
            lib_cuda_log_level: String::new(),
            disable_core_limit: false,
            core_policy: GpuCorePolicy::Default,
            shim_host_path: "/usr/local/vgpu/libvgpu.so".into(),
            license_present: false,
            cdi_devices: false,
            device_list: Default::default(),
            simulated_driver: None,
        };
        shim_response(
            &[ContainerDevice::nvidia("GPU-a", 8192, 25)],
            "/usr/local/vgpu/claims/uid-1".into(),
            "cache-1",
            false,
            false,
            &settings,
        )
        .unwrap()
    }

    #[test]
    fn a_claims_spec_carries_the_limits_and_the_shim() {
        let spec = claim_spec("uid-1", &response());
        let json = serde_json::to_value(&spec).unwrap();
        assert_eq!(json["kind"], KIND);
        assert_eq!(json["devices"][0]["name"], "uid-1");
        let env: Vec<&str> = json["devices"][0]["containerEdits"]["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        assert!(env.contains(&"NVIDIA_VISIBLE_DEVICES=GPU-a"));
        assert!(env.contains(&"CUDA_DEVICE_MEMORY_LIMIT_0=8192m"));
        assert!(env.contains(&"CUDA_DEVICE_SM_LIMIT=25"));
        assert!(env.contains(&"CUDA_DEVICE_MEMORY_SHARED_CACHE=/usr/local/vgpu/cache-1.cache"));
        let mounts = json["devices"][0]["containerEdits"]["mounts"]
            .as_array()
            .unwrap();
        let preload = mounts
            .iter()
            .find(|m| m["containerPath"] == "/etc/ld.so.preload")
            .unwrap();
        assert_eq!(preload["options"][1], "ro");
        let cache = mounts
            .iter()
            .find(|m| m["containerPath"] == "/usr/local/vgpu")
            .unwrap();
        assert_eq!(cache["hostPath"], "/usr/local/vgpu/claims/uid-1");
        assert_eq!(device_id("uid-1"), "tessera.dev/gpu-claim=uid-1");
    }

    #[test]
    fn specs_are_written_whole_and_found_again_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = spec_path(dir.path(), "uid-1");
        let spec = claim_spec("uid-1", &response());
        write_spec(&path, &spec).unwrap();
        write_spec(&path, &spec).unwrap();
        let back: Spec = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(back, spec);
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, [format!("{SPEC_PREFIX}uid-1.json")]);
        assert_eq!(claim_of_spec(&names[0]), Some("uid-1"));
        remove_file(&path).unwrap();
        remove_file(&path).unwrap();
    }
}

//! The claims this node has prepared, kept across plugin restarts.
//!
//! The checkpoint is the CDI spec files themselves: each prepared claim has exactly one
//! (`<cdi dir>/tessera-gpu-claim_<UID>.json`), written atomically, whose annotations record the
//! claim's namespace, name and the devices the kubelet was told about. Preparing writes one file
//! and nothing else, so the record and what the runtime injects can never disagree; a restarted
//! plugin reads the directory back and answers the kubelet's repeated calls from it.
//!
//! A claim's host directory (`<hook>/vgpu/claims/<UID>`: the shim's cache and limits file) exists
//! only while its spec does: at start, directories with no spec are removed (a plugin that died
//! between the two writes).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::cdi::{self, Spec};
use super::claim::{GpuShare, shim_devices};
use tessera_node::cache_dir::CacheDirs;
use tessera_node::container_env::{
    ResponseSettings, path_safe, shim_response, whole_devices_response, write_limits_file,
};

const ANNOTATION_NAMESPACE: &str = "tessera.dev/claim-namespace";
const ANNOTATION_NAME: &str = "tessera.dev/claim-name";
const ANNOTATION_DEVICES: &str = "tessera.dev/devices";

/// A claim as the kubelet names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

/// One device of a prepared claim, as the kubelet's response lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreparedDevice {
    pub requests: Vec<String>,
    pub pool: String,
    pub device: String,
    pub cdi_ids: Vec<String>,
}

/// A prepared claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreparedClaim {
    pub namespace: String,
    pub name: String,
    pub devices: Vec<PreparedDevice>,
}

/// Why a claim could not be prepared or unprepared on disk.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    #[error("claim UID {0:?} cannot name a directory")]
    BadUid(String),
    #[error("cannot prepare {path}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot build the container's environment")]
    Response(#[source] tessera_node::container_env::ResponseError),
}

fn io_err(path: impl AsRef<Path>) -> impl FnOnce(std::io::Error) -> PrepareError {
    let path = path.as_ref().display().to_string();
    move |source| PrepareError::Io { path, source }
}

/// The prepared claims of this node, and where their files go.
#[derive(Debug)]
pub struct PreparedClaims {
    cdi_dir: PathBuf,
    settings: ResponseSettings,
    claims: BTreeMap<String, PreparedClaim>,
    /// How a claim's directory is made (its size limit: every container of the claim writes
    /// it, and it is a host directory).
    cache_dirs: CacheDirs,
}

impl PreparedClaims {
    /// Reads back the claims prepared before a restart from `cdi_dir` and removes claim
    /// directories that have no spec. A spec file that cannot be read is left alone and
    /// reported (it is not counted as prepared, and never deleted on a guess).
    pub fn load(cdi_dir: PathBuf, settings: ResponseSettings) -> PreparedClaims {
        let mut claims = BTreeMap::new();
        if let Ok(entries) = std::fs::read_dir(&cdi_dir) {
            for entry in entries.flatten() {
                let file = entry.file_name();
                let Some(uid) = file.to_str().and_then(cdi::claim_of_spec) else {
                    continue;
                };
                match read_claim(&entry.path()) {
                    Ok(c) => {
                        claims.insert(uid.to_owned(), c);
                    }
                    Err(e) => tracing::warn!(
                        file = %entry.path().display(),
                        error = %e,
                        "cannot read a prepared claim's CDI spec; leaving it"
                    ),
                }
            }
        }
        let out = PreparedClaims {
            cdi_dir,
            settings,
            claims,
            cache_dirs: CacheDirs::default(),
        };
        out.remove_orphan_dirs();
        out
    }

    /// Claims prepared from now on get directories made by `dirs` (`--cache-dir-limit-mib`).
    pub fn with_cache_dirs(mut self, dirs: CacheDirs) -> PreparedClaims {
        self.cache_dirs = dirs;
        self
    }

    /// `<hook>/vgpu/claims`: one directory per prepared claim (the shim's region and limits).
    pub fn claims_dir(&self) -> PathBuf {
        PathBuf::from(self.settings.host_vgpu_dir()).join("claims")
    }

    fn remove_orphan_dirs(&self) {
        let Ok(entries) = std::fs::read_dir(self.claims_dir()) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            let has_spec = cdi::spec_path(&self.cdi_dir, &name).exists();
            if !has_spec && entry.file_type().is_ok_and(|t| t.is_dir()) {
                tracing::info!(claim = %name, "removing the directory of a claim that has no spec");
                if let Err(e) = tessera_node::cache_dir::remove(&entry.path()) {
                    tracing::warn!(dir = %entry.path().display(), error = %e, "cannot remove");
                }
            }
        }
    }

    /// The claim, when it is prepared.
    pub fn get(&self, uid: &str) -> Option<&PreparedClaim> {
        self.claims.get(uid)
    }

    /// Every prepared claim by UID.
    pub fn all(&self) -> &BTreeMap<String, PreparedClaim> {
        &self.claims
    }

    /// Prepares `claim` with `shares` (once: a prepared claim is answered from the record,
    /// its directory untouched, since containers may already use it).
    pub fn prepare(
        &mut self,
        claim: &ClaimRef,
        shares: &[GpuShare],
    ) -> Result<&PreparedClaim, PrepareError> {
        if self.claims.contains_key(&claim.uid) {
            return Ok(&self.claims[&claim.uid]);
        }
        if !path_safe(&claim.uid) {
            return Err(PrepareError::BadUid(claim.uid.clone()));
        }
        let response = match shim_devices(shares) {
            Some(devices) => {
                let dir = self.claims_dir().join(&claim.uid);
                let dir_text = dir.display().to_string();
                self.cache_dirs
                    .prepare_reported(&dir)
                    .map_err(io_err(&dir))?;
                let response = shim_response(
                    &devices,
                    dir_text,
                    &uuid::Uuid::new_v4().to_string(),
                    false,
                    // A claim has no pod annotations to opt in with: no host-backed memory
                    // (docs/oversubscription.md).
                    false,
                    &self.settings,
                )
                .map_err(PrepareError::Response)?;
                write_limits_file(&response.limits_file)
                    .map_err(io_err(&response.limits_file.host_path))?;
                response
            }
            None => {
                let uuids: Vec<String> = shares.iter().map(|s| s.uuid.clone()).collect();
                whole_devices_response(&uuids, &self.settings)
            }
        };
        let mut cdi_ids = vec![cdi::device_id(&claim.uid)];
        cdi_ids.extend(response.cdi_devices.iter().cloned());
        let devices: Vec<PreparedDevice> = shares
            .iter()
            .map(|s| PreparedDevice {
                requests: s.requests.clone(),
                pool: s.pool.clone(),
                device: s.device.clone(),
                cdi_ids: cdi_ids.clone(),
            })
            .collect();
        let mut spec = cdi::claim_spec(&claim.uid, &response);
        spec.annotations = BTreeMap::from([
            (ANNOTATION_NAMESPACE.to_owned(), claim.namespace.clone()),
            (ANNOTATION_NAME.to_owned(), claim.name.clone()),
            (
                ANNOTATION_DEVICES.to_owned(),
                serde_json::to_string(&devices).unwrap_or_default(),
            ),
        ]);
        let path = cdi::spec_path(&self.cdi_dir, &claim.uid);
        cdi::write_spec(&path, &spec).map_err(io_err(&path))?;
        self.claims.insert(
            claim.uid.clone(),
            PreparedClaim {
                namespace: claim.namespace.clone(),
                name: claim.name.clone(),
                devices,
            },
        );
        Ok(&self.claims[&claim.uid])
    }

    /// Removes everything of the claim: its spec, then its directory. Unknown claims are fine
    /// (the kubelet repeats calls).
    pub fn unprepare(&mut self, uid: &str) -> Result<(), PrepareError> {
        if !path_safe(uid) {
            return Err(PrepareError::BadUid(uid.to_owned()));
        }
        let path = cdi::spec_path(&self.cdi_dir, uid);
        cdi::remove_file(&path).map_err(io_err(&path))?;
        self.claims.remove(uid);
        // Unmounts the claim's tmpfs first, if it has one; a missing directory is fine.
        let dir = self.claims_dir().join(uid);
        tessera_node::cache_dir::remove(&dir).map_err(io_err(&dir))
    }
}

fn read_claim(path: &Path) -> Result<PreparedClaim, String> {
    let text = std::fs::read(path).map_err(|e| e.to_string())?;
    let spec: Spec = serde_json::from_slice(&text).map_err(|e| e.to_string())?;
    let get = |k: &str| {
        spec.annotations
            .get(k)
            .cloned()
            .ok_or_else(|| format!("annotation {k} missing"))
    };
    let devices: Vec<PreparedDevice> =
        serde_json::from_str(&get(ANNOTATION_DEVICES)?).map_err(|e| e.to_string())?;
    Ok(PreparedClaim {
        namespace: get(ANNOTATION_NAMESPACE)?,
        name: get(ANNOTATION_NAME)?,
        devices,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::claim::ShareLimits;
    use hami_contract::config::GpuCorePolicy;

    fn settings(hook: &Path) -> ResponseSettings {
        ResponseSettings {
            hook_path: hook.display().to_string(),
            memory_scaling: 1.0,
            lib_cuda_log_level: String::new(),
            disable_core_limit: false,
            core_policy: GpuCorePolicy::Default,
            shim_host_path: format!("{}/vgpu/libvgpu.so", hook.display()),
            license_present: false,
            cdi_devices: false,
            device_list: Default::default(),
            simulated_driver: None,
        }
    }

    fn share(mib: u32) -> GpuShare {
        GpuShare {
            requests: vec!["gpu".into()],
            pool: "node-a".into(),
            device: "gpu-0".into(),
            uuid: "GPU-0".into(),
            limits: Some(ShareLimits {
                memory_mib: mib,
                cores: 30,
            }),
        }
    }

    fn claim(uid: &str) -> ClaimRef {
        ClaimRef {
            namespace: "ml".into(),
            name: format!("claim-{uid}"),
            uid: uid.into(),
        }
    }

    #[test]
    fn preparing_twice_keeps_the_first_preparation_and_survives_a_restart() {
        let tmp = tempfile::tempdir().unwrap();
        let cdi_dir = tmp.path().join("cdi");
        let mut claims = PreparedClaims::load(cdi_dir.clone(), settings(tmp.path()));
        let first = claims
            .prepare(&claim("u1"), &[share(3000)])
            .unwrap()
            .clone();
        assert_eq!(first.devices[0].cdi_ids, ["tessera.dev/gpu-claim=u1"]);
        let limits = tmp.path().join("vgpu/claims/u1/vgpu-limits");
        let text = std::fs::read_to_string(&limits).unwrap();
        assert!(text.contains("CUDA_DEVICE_MEMORY_LIMIT_0=3000m"), "{text}");
        // A container's region appears; a repeated prepare must not wipe it.
        let region = tmp.path().join("vgpu/claims/u1/x.cache");
        std::fs::write(&region, b"region").unwrap();
        let again = claims
            .prepare(&claim("u1"), &[share(9999)])
            .unwrap()
            .clone();
        assert_eq!(again, first);
        assert!(region.exists());

        let restarted = PreparedClaims::load(cdi_dir.clone(), settings(tmp.path()));
        assert_eq!(restarted.get("u1"), Some(&first));
        assert!(region.exists());
    }

    /// Every container of a claim writes its directory, a host directory: with a limit (as root,
    /// which CI is) it is a tmpfs of that size, writes beyond it fail with ENOSPC, and unprepare
    /// unmounts and removes it.
    #[test]
    fn a_claims_directory_holds_at_most_its_limit_and_goes_with_the_claim() {
        use tessera_node::cache_dir::CacheDirLimit;
        if !nix::unistd::geteuid().is_root() {
            assert!(
                std::env::var("TESSERA_NO_SKIP").as_deref() != Ok("1"),
                "skipped: mounting a tmpfs needs root (TESSERA_NO_SKIP=1: a skip is a failure)"
            );
            eprintln!("skip: mounting a tmpfs needs root");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let limit = CacheDirLimit {
            bytes: 1 << 20,
            inodes: 16,
        };
        let mut claims =
            PreparedClaims::load(tmp.path().join("cdi"), settings(tmp.path())).with_cache_dirs(
                CacheDirs::limited(limit, PathBuf::from("/proc/self/mountinfo")),
            );
        claims.prepare(&claim("u1"), &[share(1000)]).unwrap();
        let dir = tmp.path().join("vgpu/claims/u1");
        let limits = std::fs::read_to_string(dir.join("vgpu-limits")).unwrap();
        assert!(
            limits.contains("CUDA_DEVICE_MEMORY_LIMIT_0=1000m"),
            "{limits}"
        );
        let err = std::fs::write(dir.join("big"), vec![7u8; 2 << 20]).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
        claims.unprepare("u1").unwrap();
        assert!(!dir.exists());
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let dir = dir.display().to_string();
        assert!(
            !tessera_node::cache_dir::mount_points(&mounts).any(|p| p == dir),
            "the claim's tmpfs outlived it"
        );
    }

    #[test]
    fn unprepare_removes_everything_and_orphans_are_swept_at_start() {
        let tmp = tempfile::tempdir().unwrap();
        let cdi_dir = tmp.path().join("cdi");
        let mut claims = PreparedClaims::load(cdi_dir.clone(), settings(tmp.path()));
        claims.prepare(&claim("u1"), &[share(1000)]).unwrap();
        claims.prepare(&claim("u2"), &[share(1000)]).unwrap();
        claims.unprepare("u1").unwrap();
        claims.unprepare("u1").unwrap();
        assert!(!cdi::spec_path(&cdi_dir, "u1").exists());
        assert!(!tmp.path().join("vgpu/claims/u1").exists());
        // A plugin that died after making a directory but before writing the spec.
        std::fs::create_dir_all(tmp.path().join("vgpu/claims/u3")).unwrap();
        // A spec this code cannot read is kept, not counted.
        std::fs::write(cdi::spec_path(&cdi_dir, "u4"), b"{").unwrap();
        let restarted = PreparedClaims::load(cdi_dir.clone(), settings(tmp.path()));
        assert_eq!(restarted.all().keys().collect::<Vec<_>>(), ["u2"]);
        assert!(!tmp.path().join("vgpu/claims/u3").exists());
        assert!(tmp.path().join("vgpu/claims/u2").exists());
        assert!(cdi::spec_path(&cdi_dir, "u4").exists());
        assert!(matches!(
            PreparedClaims::load(cdi_dir, settings(tmp.path())).unprepare("../x"),
            Err(PrepareError::BadUid(_))
        ));
    }
}

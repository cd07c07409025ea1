//! The environment HAMi-core reads (core contract §1.2), parsed the way HAMi-core parses it (pure
//! functions; the caller passes a lookup so tests need no process environment).

use std::collections::HashMap;

use vgpu_region::protocol::{env, limits_owned, limits_owned_names, parse_limits_file};
use vgpu_region::{MAX_DEVICES, parse_hami_size};

/// Policy from `GPU_CORE_UTILIZATION_POLICY` (exact strings, as HAMi-core compares them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UtilizationPolicy {
    /// Defer to the region's `utilization_switch` (written by the host monitor).
    Default,
    /// Always limit.
    Force,
    /// Never limit.
    Disable,
}

/// Where the node mounts the container's limits, read-only (a root-owned 0444 file on the
/// host, in the container's directory under the hook path). When it is there and trustworthy
/// ([`read_limits_file`]), the limits, the region path and the utilization policy come from it
/// and the environment's values are ignored.
pub const LIMITS_FILE: &str = vgpu_region::protocol::CONTAINER_LIMITS_PATH;

/// Largest limits file read (the plugin writes a few hundred bytes).
const MAX_LIMITS_FILE: u64 = vgpu_region::protocol::MAX_LIMITS_FILE_BYTES;

/// The kernel's overflow uid: how an unmapped owner (the host's root, seen from a user
/// namespace) appears.
fn overflow_uid() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/overflowuid")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(65534)
}

/// Reads the limits file at `path` if it is the device plugin's: opened without following a
/// symlink (and without blocking on a FIFO), a regular file of at most 64 KiB, owned by root
/// (or by the overflow uid, i.e. the host's root from inside a user namespace), writable by
/// nobody but its owner, on a read-only mount. `Ok(None)`: no file (HAMi's plugin is in
/// charge). `Err`: a file is there but is not trustworthy (the caller ignores it, says so).
pub fn read_limits_file(path: &str) -> Result<Option<String>, String> {
    use std::io::Read;
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot open it without following links: {e}")),
    };
    let meta = file.metadata().map_err(|e| e.to_string())?;
    if !meta.file_type().is_file() {
        return Err("not a regular file".into());
    }
    if meta.uid() != 0 && meta.uid() != overflow_uid() {
        return Err(format!("owned by uid {}, not root", meta.uid()));
    }
    if meta.mode() & 0o022 != 0 {
        return Err(format!(
            "mode {:o} is writable by others",
            meta.mode() & 0o7777
        ));
    }
    if meta.len() > MAX_LIMITS_FILE {
        return Err(format!("{} bytes is too large", meta.len()));
    }
    // SAFETY: fstatvfs on an open fd into a zeroed struct.
    let read_only = unsafe {
        use std::os::fd::AsRawFd;
        let mut vfs: libc::statvfs = std::mem::zeroed();
        libc::fstatvfs(file.as_raw_fd(), &mut vfs) == 0 && vfs.f_flag & libc::ST_RDONLY != 0
    };
    if !read_only {
        return Err("not on a read-only mount".into());
    }
    let mut text = String::new();
    file.take(MAX_LIMITS_FILE)
        .read_to_string(&mut text)
        .map_err(|e| e.to_string())?;
    Ok(Some(text))
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Bytes per region device; 0 = no limit.
    pub memory_limit: [u64; MAX_DEVICES],
    /// Bytes of device memory per region device under opt-in oversubscription
    /// (`TESSERA_DEVICE_MEMORY_SHARE_<i>`): past it, up to `memory_limit`, `cuMemAlloc` is
    /// served from mapped host memory. 0 = no oversubscription (HAMi's behaviour); always below
    /// a non-zero `memory_limit` when set.
    pub device_share: [u64; MAX_DEVICES],
    /// Percent per region device; 100 (or 0) = no limit.
    pub sm_limit: [u64; MAX_DEVICES],
    pub policy: UtilizationPolicy,
    pub priority: i32,
    pub cache_path: String,
    pub log_level: i32,
    /// The plugin-owned values came from the device plugin's limits file: they are enforced as
    /// read, whatever the region file says.
    pub from_limits_file: bool,
    /// Warnings about suspicious values, printed once by the caller.
    pub warnings: Vec<String>,
}

/// `atoi`: optional spaces and sign, then digits; 0 when there are none; saturates.
pub fn atoi(s: &str) -> i32 {
    let t = s.trim_start();
    let (neg, digits) = match t.as_bytes().first() {
        Some(b'-') => (true, &t[1..]),
        Some(b'+') => (false, &t[1..]),
        _ => (false, t),
    };
    let mut v: i64 = 0;
    for c in digits.bytes().take_while(u8::is_ascii_digit) {
        v = (v * 10 + (c - b'0') as i64).min(i32::MAX as i64 + 1);
    }
    let v = if neg { -v } else { v };
    v.clamp(i32::MIN as i64, i32::MAX as i64) as i32
}

fn size_var(name: &str, get: &dyn Fn(&str) -> Option<String>, warnings: &mut Vec<String>) -> u64 {
    let Some(text) = get(name) else {
        return 0;
    };
    let parsed = parse_hami_size(&text);
    if parsed.suspicious {
        let meaning = match parsed.bytes {
            0 => "no limit".to_owned(),
            u64::MAX => "no limit (2^64-1)".to_owned(),
            b => format!("{b} bytes"),
        };
        warnings.push(format!(
            "{name}={text:?} is not a plain <number>[k|m|g]; read the way HAMi-core reads it: {meaning}"
        ));
    }
    parsed.bytes
}

impl Config {
    pub fn from_lookup(get: &dyn Fn(&str) -> Option<String>) -> Self {
        let mut warnings = Vec::new();
        let fallback = size_var(env::MEMORY_LIMIT, get, &mut warnings);
        let memory_limit = std::array::from_fn(|i| {
            let v = size_var(&env::memory_limit(i), get, &mut warnings);
            if v > 0 { v } else { fallback }
        });
        let share_fallback = size_var(env::DEVICE_MEMORY_SHARE, get, &mut warnings);
        let device_share = std::array::from_fn(|i| {
            let v = match size_var(&env::device_memory_share(i), get, &mut warnings) {
                0 => share_fallback,
                v => v,
            };
            device_share(v, memory_limit[i])
        });
        let sm_fallback = match size_var(env::SM_LIMIT, get, &mut warnings) {
            0 => 100,
            v => v,
        };
        let sm_limit =
            std::array::from_fn(|i| match size_var(&env::sm_limit(i), get, &mut warnings) {
                0 => sm_fallback,
                v => v,
            });
        let policy = match get(env::CORE_POLICY).as_deref() {
            Some("FORCE" | "force") => UtilizationPolicy::Force,
            Some("DISABLE" | "disable") => UtilizationPolicy::Disable,
            _ => UtilizationPolicy::Default,
        };
        let priority = get(env::TASK_PRIORITY).map_or(1, |v| atoi(&v));
        let cache_path = get(env::SHARED_CACHE)
            .filter(|p| !p.is_empty())
            .unwrap_or_else(|| vgpu_region::DEFAULT_PATH.to_owned());
        let log_level = get(env::LOG_LEVEL).map_or(2, |v| atoi(&v));
        Config {
            memory_limit,
            device_share,
            sm_limit,
            policy,
            priority,
            cache_path,
            log_level,
            from_limits_file: false,
            warnings,
        }
    }

    /// The configuration from the limits file's values (`file`, when there is a trusted one)
    /// and the environment (`env`): with a file, every plugin-owned name is read from it only
    /// (one warning lists the environment's values that differ); without one, as HAMi-core.
    pub fn from_sources(
        file: Option<&HashMap<String, String>>,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Self {
        let Some(file) = file else {
            return Self::from_lookup(env);
        };
        let get = |name: &str| {
            if limits_owned(name) {
                file.get(name).cloned()
            } else {
                env(name)
            }
        };
        let mut c = Self::from_lookup(&get);
        c.from_limits_file = true;
        let differ: Vec<String> = limits_owned_names()
            .into_iter()
            .filter(|n| env(n).is_some_and(|v| file.get(n) != Some(&v)))
            .collect();
        if !differ.is_empty() {
            c.warnings.push(format!(
                "ignoring {} from the environment: the device plugin's {LIMITS_FILE} says otherwise, and it wins",
                differ.join(", ")
            ));
        }
        c
    }

    pub fn from_env() -> Self {
        let env = |name: &str| std::env::var(name).ok();
        match read_limits_file(LIMITS_FILE) {
            Ok(Some(text)) => Self::from_sources(Some(&parse_limits_file(&text)), &env),
            Ok(None) => Self::from_lookup(&env),
            Err(why) => {
                let mut c = Self::from_lookup(&env);
                c.warnings.push(format!(
                    "{LIMITS_FILE} is not the device plugin's ({why}); ignored, limits come from the environment"
                ));
                c
            }
        }
    }
}

/// The device share in force for a device with memory limit `limit`: oversubscription needs a
/// limit (host memory is given only up to it) and a share below it (a share at or above the
/// limit changes nothing).
pub fn device_share(share: u64, limit: u64) -> u64 {
    if limit == 0 || share >= limit {
        0
    } else {
        share
    }
}

/// Whether a percentage limits anything (HAMi: values ≥ 100 and 0 mean "no limit").
pub fn sm_limited(percent: u64) -> bool {
    percent > 0 && percent < 100
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(vars: &[(&str, &str)]) -> Config {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(&|k| map.get(k).cloned())
    }

    const G: u64 = 1 << 30;

    #[test]
    fn a_device_share_counts_only_below_a_memory_limit() {
        let c = cfg(&[
            ("CUDA_DEVICE_MEMORY_LIMIT", "2g"),
            ("CUDA_DEVICE_MEMORY_LIMIT_2", "512m"),
            ("TESSERA_DEVICE_MEMORY_SHARE_0", "1g"),
            ("TESSERA_DEVICE_MEMORY_SHARE_2", "1g"),
        ]);
        assert_eq!(c.device_share[0], G);
        assert_eq!(c.device_share[1], 0, "no share named for device 1");
        assert_eq!(
            c.device_share[2], 0,
            "a share above the limit changes nothing"
        );
        assert_eq!(
            cfg(&[("TESSERA_DEVICE_MEMORY_SHARE_0", "1g")]).device_share[0],
            0
        );
    }

    #[test]
    fn per_device_overrides_fallback() {
        let c = cfg(&[
            ("CUDA_DEVICE_MEMORY_LIMIT", "2g"),
            ("CUDA_DEVICE_MEMORY_LIMIT_1", "1024m"),
        ]);
        assert_eq!(c.memory_limit[0], 2 * G);
        assert_eq!(c.memory_limit[1], G);
        assert_eq!(c.memory_limit[15], 2 * G);
        assert!(c.warnings.is_empty());
    }

    #[test]
    fn env_edge_cases_follow_hami_and_warn() {
        for (text, bytes, warns) in [
            ("4Gi", 4, true),
            ("010g", 8 * G, true),
            ("", 0, true),
            ("-1", u64::MAX, true),
            ("-1g", 0, true),
            ("99999999999g", 0, true),
            ("1g", G, false),
        ] {
            let c = cfg(&[("CUDA_DEVICE_MEMORY_LIMIT", text)]);
            assert_eq!(c.memory_limit[0], bytes, "{text:?}");
            assert_eq!(!c.warnings.is_empty(), warns, "{text:?}");
        }
        assert_eq!(cfg(&[]).memory_limit, [0; 16]);
    }

    #[test]
    fn sm_limit_defaults_and_policy() {
        let c = cfg(&[]);
        assert_eq!(c.sm_limit, [100; 16]);
        assert_eq!(c.policy, UtilizationPolicy::Default);
        assert_eq!(c.priority, 1);
        assert_eq!(c.cache_path, "/tmp/cudevshr.cache");
        let c = cfg(&[
            ("CUDA_DEVICE_SM_LIMIT", "30"),
            ("CUDA_DEVICE_SM_LIMIT_2", "50"),
            ("GPU_CORE_UTILIZATION_POLICY", "force"),
            ("CUDA_TASK_PRIORITY", "0"),
        ]);
        assert_eq!(c.sm_limit[0], 30);
        assert_eq!(c.sm_limit[2], 50);
        assert_eq!(c.policy, UtilizationPolicy::Force);
        assert_eq!(c.priority, 0);
        // HAMi compares exact strings: "Force" is not "force".
        assert_eq!(
            cfg(&[("GPU_CORE_UTILIZATION_POLICY", "Force")]).policy,
            UtilizationPolicy::Default
        );
        assert_eq!(
            cfg(&[("GPU_CORE_UTILIZATION_POLICY", "DISABLE")]).policy,
            UtilizationPolicy::Disable
        );
        assert!(sm_limited(30) && !sm_limited(100) && !sm_limited(0) && !sm_limited(150));
    }

    #[test]
    fn the_limits_file_wins_over_the_environment() {
        let file = parse_limits_file(
            "# written by tessera-device-plugin\nCUDA_DEVICE_MEMORY_LIMIT_0=1024m\nCUDA_DEVICE_SM_LIMIT=30\n\
             CUDA_DEVICE_MEMORY_SHARED_CACHE=/usr/local/vgpu/a.cache\nLD_PRELOAD=/evil.so\n",
        );
        assert!(!file.contains_key("LD_PRELOAD"), "only plugin-owned names");
        let env: HashMap<String, String> = [
            ("CUDA_DEVICE_MEMORY_LIMIT_0", "16384m"),
            ("CUDA_DEVICE_MEMORY_LIMIT", "16g"),
            ("CUDA_DEVICE_MEMORY_SHARED_CACHE", "/tmp/new.cache"),
            ("GPU_CORE_UTILIZATION_POLICY", "disable"),
            ("CUDA_TASK_PRIORITY", "0"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        let c = Config::from_sources(Some(&file), &|k| env.get(k).cloned());
        assert!(c.from_limits_file);
        assert_eq!(c.memory_limit[0], G);
        assert_eq!(
            c.memory_limit[1], 0,
            "the environment's fallback is ignored too"
        );
        assert_eq!(c.sm_limit[0], 30);
        assert_eq!(c.cache_path, "/usr/local/vgpu/a.cache");
        assert_eq!(c.policy, UtilizationPolicy::Default);
        assert_eq!(
            c.priority, 0,
            "not plugin-owned: still from the environment"
        );
        let w = c.warnings.join("\n");
        for n in [
            "CUDA_DEVICE_MEMORY_LIMIT_0",
            "CUDA_DEVICE_MEMORY_SHARED_CACHE",
            "GPU_CORE_UTILIZATION_POLICY",
        ] {
            assert!(w.contains(n), "{w}");
        }
        // Without a file: HAMi-core's behaviour.
        let c = Config::from_sources(None, &|k| env.get(k).cloned());
        assert_eq!(c.memory_limit[0], 16 * G);
        assert!(!c.from_limits_file);
    }

    #[test]
    fn untrusted_limits_files_are_refused() {
        let dir = std::env::temp_dir().join(format!("vgpu-limits-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("limits");
        assert_eq!(read_limits_file(p.to_str().unwrap()), Ok(None));
        // A symlink is not followed.
        std::fs::write(dir.join("real"), "CUDA_DEVICE_MEMORY_LIMIT_0=1g\n").unwrap();
        std::os::unix::fs::symlink(dir.join("real"), &p).unwrap();
        assert!(read_limits_file(p.to_str().unwrap()).is_err());
        std::fs::remove_file(&p).unwrap();
        // A directory, a writable file (and, below, one on a writable mount) are refused.
        std::fs::create_dir(&p).unwrap();
        assert!(read_limits_file(p.to_str().unwrap()).is_err());
        std::fs::remove_dir(&p).unwrap();
        std::fs::write(&p, "CUDA_DEVICE_MEMORY_LIMIT_0=1g\n").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o666)).unwrap();
        assert!(read_limits_file(p.to_str().unwrap()).is_err());
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o444)).unwrap();
        // The temp dir is not a read-only mount.
        let r = read_limits_file(p.to_str().unwrap());
        assert!(
            r.as_ref()
                .is_err_and(|e| e.contains("read-only") || e.contains("uid")),
            "{r:?}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn atoi_like_c() {
        assert_eq!(atoi("12abc"), 12);
        assert_eq!(atoi("  -3"), -3);
        assert_eq!(atoi("x"), 0);
        assert_eq!(atoi("99999999999"), i32::MAX);
    }
}

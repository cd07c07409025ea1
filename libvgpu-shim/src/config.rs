//! The environment HAMi-core reads, parsed the way HAMi-core parses it (pure functions; the
//! caller passes a lookup so tests need no process environment).

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

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Bytes per region device; 0 = no limit.
    pub memory_limit: [u64; MAX_DEVICES],
    /// Percent per region device; 100 (or 0) = no limit.
    pub sm_limit: [u64; MAX_DEVICES],
    pub policy: UtilizationPolicy,
    pub priority: i32,
    pub cache_path: String,
    pub log_level: i32,
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
        let fallback = size_var("CUDA_DEVICE_MEMORY_LIMIT", get, &mut warnings);
        let memory_limit = std::array::from_fn(|i| {
            let v = size_var(&format!("CUDA_DEVICE_MEMORY_LIMIT_{i}"), get, &mut warnings);
            if v > 0 { v } else { fallback }
        });
        let sm_fallback = match size_var("CUDA_DEVICE_SM_LIMIT", get, &mut warnings) {
            0 => 100,
            v => v,
        };
        let sm_limit = std::array::from_fn(|i| {
            match size_var(&format!("CUDA_DEVICE_SM_LIMIT_{i}"), get, &mut warnings) {
                0 => sm_fallback,
                v => v,
            }
        });
        let policy = match get("GPU_CORE_UTILIZATION_POLICY").as_deref() {
            Some("FORCE" | "force") => UtilizationPolicy::Force,
            Some("DISABLE" | "disable") => UtilizationPolicy::Disable,
            _ => UtilizationPolicy::Default,
        };
        let priority = get("CUDA_TASK_PRIORITY").map_or(1, |v| atoi(&v));
        let cache_path = get("CUDA_DEVICE_MEMORY_SHARED_CACHE")
            .filter(|p| !p.is_empty())
            .unwrap_or_else(|| vgpu_region::DEFAULT_PATH.to_owned());
        let log_level = get("LIBCUDA_LOG_LEVEL").map_or(2, |v| atoi(&v));
        Config {
            memory_limit,
            sm_limit,
            policy,
            priority,
            cache_path,
            log_level,
            warnings,
        }
    }

    pub fn from_env() -> Self {
        Self::from_lookup(&|name| std::env::var(name).ok())
    }
}

/// Whether a percentage limits anything (HAMi: values ≥ 100 and 0 mean "no limit").
pub fn sm_limited(percent: u64) -> bool {
    percent > 0 && percent < 100
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn cfg(vars: &[(&str, &str)]) -> Config {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(&|k| map.get(k).cloned())
    }

    const G: u64 = 1 << 30;

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
    fn atoi_like_c() {
        assert_eq!(atoi("12abc"), 12);
        assert_eq!(atoi("  -3"), -3);
        assert_eq!(atoi("x"), 0);
        assert_eq!(atoi("99999999999"), i32::MAX);
    }
}

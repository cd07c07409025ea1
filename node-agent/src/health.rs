//! GPU health: critical XIDs and lost GPUs make a GPU unhealthy; unlike NVIDIA's plugin, a GPU
//! recovers once it answers NVML again after a quiet period without new errors. Pure: the
//! caller supplies the clock and the probe result.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;
use tokio::time::Instant;

/// XIDs that are application errors, not GPU faults (NVIDIA device plugin's default list).
pub const DEFAULT_IGNORED_XIDS: &[u64] = &[13, 31, 43, 45, 68, 109];

/// Something NVML told us about a GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HealthEvent {
    /// A critical XID error.
    Xid { uuid: String, xid: u64 },
    /// NVML reports the GPU lost (fell off the bus).
    Lost { uuid: String },
}

/// Health rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthPolicy {
    pub ignored_xids: BTreeSet<u64>,
    /// How long a GPU must stay free of new errors (and answer NVML) before it is healthy again.
    pub recovery_quiet: Duration,
    /// All health checks off (`DP_DISABLE_HEALTHCHECKS=all`).
    pub disabled: bool,
}

impl Default for HealthPolicy {
    fn default() -> Self {
        HealthPolicy {
            ignored_xids: DEFAULT_IGNORED_XIDS.iter().copied().collect(),
            recovery_quiet: Duration::from_secs(60),
            disabled: false,
        }
    }
}

/// A `DP_DISABLE_HEALTHCHECKS` item that is neither `all`, `xids` nor an XID.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("DP_DISABLE_HEALTHCHECKS: {item:?} is not all, xids or an XID number")]
pub struct DisableSpecError {
    pub item: String,
    #[source]
    pub source: std::num::ParseIntError,
}

impl HealthPolicy {
    /// Parses NVIDIA's `DP_DISABLE_HEALTHCHECKS`: `all`, `xids`, or a comma list of extra XIDs
    /// to ignore.
    pub fn with_disable_spec(mut self, spec: &str) -> Result<Self, DisableSpecError> {
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            match item {
                "all" | "xids" => self.disabled = true,
                n => {
                    let xid = n.parse().map_err(|source| DisableSpecError {
                        item: n.to_owned(),
                        source,
                    })?;
                    self.ignored_xids.insert(xid);
                }
            }
        }
        Ok(self)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct GpuHealth {
    /// Time of the last error while unhealthy; `None` = healthy.
    last_error: Option<Instant>,
}

/// Per-GPU health.
#[derive(Debug, Clone, Default)]
pub struct HealthTracker {
    policy: HealthPolicy,
    gpus: BTreeMap<String, GpuHealth>,
}

impl HealthTracker {
    pub fn new(policy: HealthPolicy, uuids: impl IntoIterator<Item = String>) -> Self {
        HealthTracker {
            policy,
            gpus: uuids
                .into_iter()
                .map(|u| (u, GpuHealth { last_error: None }))
                .collect(),
        }
    }

    /// Starts tracking GPUs that appeared (healthy) and forgets ones that disappeared.
    pub fn set_gpus(&mut self, uuids: &BTreeSet<String>) {
        self.gpus.retain(|u, _| uuids.contains(u));
        for u in uuids {
            self.gpus
                .entry(u.clone())
                .or_insert(GpuHealth { last_error: None });
        }
    }

    /// How long a GPU must stay quiet before it is probed ([`HealthPolicy::recovery_quiet`]).
    pub fn recovery_quiet(&self) -> Duration {
        self.policy.recovery_quiet
    }

    pub fn is_healthy(&self, uuid: &str) -> bool {
        self.gpus.get(uuid).is_some_and(|g| g.last_error.is_none())
    }

    pub fn unhealthy(&self) -> Vec<&str> {
        self.gpus
            .iter()
            .filter(|(_, g)| g.last_error.is_some())
            .map(|(u, _)| u.as_str())
            .collect()
    }

    /// Applies an event; true when a GPU's health changed.
    pub fn apply(&mut self, event: &HealthEvent, now: Instant) -> bool {
        if self.policy.disabled {
            return false;
        }
        let uuid = match event {
            HealthEvent::Xid { xid, .. } if self.policy.ignored_xids.contains(xid) => return false,
            HealthEvent::Xid { uuid, .. } | HealthEvent::Lost { uuid } => uuid,
        };
        let Some(gpu) = self.gpus.get_mut(uuid) else {
            return false;
        };
        let was_healthy = gpu.last_error.is_none();
        gpu.last_error = Some(now);
        was_healthy
    }

    /// GPUs whose quiet period has passed and which should be probed now.
    pub fn due_for_probe(&self, now: Instant) -> Vec<String> {
        self.gpus
            .iter()
            .filter(|(_, g)| {
                g.last_error
                    .is_some_and(|t| now.saturating_duration_since(t) >= self.policy.recovery_quiet)
            })
            .map(|(u, _)| u.clone())
            .collect()
    }

    /// Records a probe of a GPU that was due; true when it became healthy.
    pub fn probe_result(&mut self, uuid: &str, answers: bool, now: Instant) -> bool {
        let Some(gpu) = self.gpus.get_mut(uuid) else {
            return false;
        };
        if gpu.last_error.is_none() {
            return false;
        }
        if answers {
            gpu.last_error = None;
            true
        } else {
            // Still failing: the quiet period starts over.
            gpu.last_error = Some(now);
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tracker() -> HealthTracker {
        HealthTracker::new(
            HealthPolicy::default(),
            ["GPU-a".to_owned(), "GPU-b".to_owned()],
        )
    }

    #[test]
    fn critical_xid_marks_unhealthy_ignored_xid_does_not() {
        let mut t = tracker();
        let now = Instant::now();
        assert!(!t.apply(
            &HealthEvent::Xid {
                uuid: "GPU-a".into(),
                xid: 13
            },
            now
        ));
        assert!(t.is_healthy("GPU-a"));
        assert!(t.apply(
            &HealthEvent::Xid {
                uuid: "GPU-a".into(),
                xid: 79
            },
            now
        ));
        assert!(!t.is_healthy("GPU-a"));
        assert!(t.is_healthy("GPU-b"));
        assert!(
            !t.apply(
                &HealthEvent::Lost {
                    uuid: "GPU-a".into()
                },
                now
            ),
            "already unhealthy"
        );
        assert!(
            !t.apply(
                &HealthEvent::Lost {
                    uuid: "GPU-zzz".into()
                },
                now
            ),
            "unknown GPU"
        );
    }

    #[test]
    fn recovers_only_after_quiet_period_and_successful_probe() {
        let mut t = tracker();
        let t0 = Instant::now();
        t.apply(
            &HealthEvent::Lost {
                uuid: "GPU-b".into(),
            },
            t0,
        );
        assert!(t.due_for_probe(t0 + Duration::from_secs(59)).is_empty());
        let t1 = t0 + Duration::from_secs(60);
        assert_eq!(t.due_for_probe(t1), ["GPU-b"]);
        assert!(!t.probe_result("GPU-b", false, t1));
        assert!(
            t.due_for_probe(t1 + Duration::from_secs(30)).is_empty(),
            "quiet period restarted"
        );
        let t2 = t1 + Duration::from_secs(60);
        assert!(t.probe_result("GPU-b", true, t2));
        assert!(t.is_healthy("GPU-b"));
    }

    #[test]
    fn disable_spec_parses_all_and_lists() {
        let p = HealthPolicy::default()
            .with_disable_spec("48, 63")
            .expect("valid");
        assert!(p.ignored_xids.contains(&48) && p.ignored_xids.contains(&63) && !p.disabled);
        assert!(
            HealthPolicy::default()
                .with_disable_spec("all")
                .expect("valid")
                .disabled
        );
        assert!(HealthPolicy::default().with_disable_spec("x").is_err());
    }
}

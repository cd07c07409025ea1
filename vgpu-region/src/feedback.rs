//! The host monitor's feedback on the shared regions (HAMi `cmd/vGPUmonitor/feedback.go`
//! `Observe`, core contract §5.4): each control period, from what every container's region says,
//! the `recent_kernel` and `utilization_switch` values to write back. Pure: the caller reads the
//! regions, supplies the clock and writes the result. The rules, with HAMi's function for each,
//! are in `docs/design/sm-limiter.md` ("Host-monitor feedback").
//!
//! Every input comes from a file the container can write, so nothing here trusts it: any
//! priority, counter or timestamp gives a defined answer, no value sizes an allocation (HAMi's
//! monitor grows a slice up to the priority's value), and the work is linear in the number of
//! (container, GPU) pairs.

use std::collections::{BTreeMap, BTreeSet};

use crate::{MAX_DEVICES, RegionSnapshot};

/// HAMi's control period (`watchAndFeedback`: a 5 s ticker).
pub const HAMI_PERIOD_SECS: u64 = 5;

/// `recent_kernel` that holds the container's launches (the shim waits while it is negative).
pub const BLOCKED: i32 = -1;

/// What a container's shim does with `utilization_switch` (`GPU_CORE_UTILIZATION_POLICY`, core
/// contract §5.3).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum CorePolicy {
    /// Limit only while the switch is 1: the monitor decides.
    #[default]
    Default,
    /// Always limit, whatever the switch.
    Force,
    /// Never limit (and never report launches through `recent_kernel`).
    Disable,
}

/// One GPU a region names, with the container's SM limit on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionGpu {
    pub uuid: String,
    /// Percent; 0 or ≥ 100 means no core limit.
    pub sm_limit: u64,
}

/// The fields of one container's region the feedback reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerView {
    /// Smaller is more important (`CUDA_TASK_PRIORITY`, default 1). Negative: HAMi never counts
    /// the container, never blocks it and always lifts its limit.
    pub priority: i32,
    pub recent_kernel: i32,
    pub utilization_switch: i32,
    /// Epoch seconds of the last kernel launch (the shim records it whether or not it limits).
    pub last_kernel_time: u64,
    /// The GPUs the region names (empty UUID slots left out).
    pub gpus: Vec<RegionGpu>,
    pub policy: CorePolicy,
}

impl ContainerView {
    /// The feedback's view of a parsed region; `policy` comes from outside the region (the
    /// region does not record it).
    pub fn from_region(region: &RegionSnapshot, policy: CorePolicy) -> Self {
        let gpus = region
            .uuids
            .iter()
            .take(MAX_DEVICES)
            .enumerate()
            // HAMi's `IsValidUUID`: a slot whose string is not empty.
            .filter(|(_, uuid)| !uuid.is_empty())
            .map(|(d, uuid)| RegionGpu {
                uuid: uuid.clone(),
                sm_limit: region.sm_limit[d],
            })
            .collect();
        ContainerView {
            priority: region.priority,
            recent_kernel: region.recent_kernel,
            utilization_switch: region.utilization_switch,
            last_kernel_time: region.last_kernel_time,
            gpus,
            policy,
        }
    }

    /// Whether the shim would rate-limit some launch of this container when switched on: a core
    /// limit in 1..=99 on one of its GPUs (HAMi-core's `rate_limiter` returns at once otherwise).
    fn has_core_limit(&self) -> bool {
        self.gpus.iter().any(|g| (1..100).contains(&g.sm_limit))
    }

    /// Distinct UUIDs (a hostile region may name one GPU in several slots; it counts once).
    fn uuids(&self) -> BTreeSet<&str> {
        self.gpus.iter().map(|g| g.uuid.as_str()).collect()
    }
}

/// The monitor's clock for one pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FeedbackClock {
    /// Wall clock, epoch seconds (the unit of `last_kernel_time`).
    pub now_secs: u64,
    /// The control period in seconds (HAMi: [`HAMI_PERIOD_SECS`]).
    pub period_secs: u64,
}

/// What to write back into one region, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Feedback {
    pub recent_kernel: i32,
    pub utilization_switch: i32,
    /// The container launched kernels in the last period (it counts as a contender).
    pub active: bool,
    /// A more important container is active on one of its GPUs: its launches wait.
    pub blocked: bool,
    /// Its core limit applies from now on (the policy, then the switch).
    pub limited: bool,
}

/// One control period of the feedback over every region of the node (HAMi's `Observe`).
/// Returns one [`Feedback`] per input, in order.
///
/// 1. Decay: a positive `recent_kernel` drops by one. A container is **active** if it is still
///    positive (it launched through the limiter since the previous period, which sets it to 2),
///    or, beyond HAMi, if its limit is lifted right now (policy default, switch not 1, so its
///    shim does not set `recent_kernel`), it has a core limit, it is not blocked, and
///    `last_kernel_time` is within the last period (plus one second of rounding). Active
///    containers with a priority ≥ 0 are counted per (GPU, priority).
/// 2. **Blocked** if some GPU of the container has an active container of a strictly smaller
///    priority number: `recent_kernel` becomes −1 (kept at −1); otherwise a negative value
///    becomes 0.
/// 3. `utilization_switch` is 1 if the container is blocked or another active container has
///    the same priority on one of its GPUs (the count there is above 1, itself included); else 0.
pub fn decide(containers: &[ContainerView], clock: FeedbackClock) -> Vec<Feedback> {
    let recent_launch_after = clock
        .now_secs
        .saturating_sub(clock.period_secs.saturating_add(1));
    // Step 1: decay and activity.
    let decayed: Vec<(i32, bool)> = containers
        .iter()
        .map(|c| {
            let rk = if c.recent_kernel > 0 {
                c.recent_kernel - 1
            } else {
                c.recent_kernel
            };
            let lifted_but_launching = c.policy == CorePolicy::Default
                && c.utilization_switch != 1
                && rk >= 0
                && c.has_core_limit()
                && c.last_kernel_time >= recent_launch_after;
            (rk, rk > 0 || lifted_but_launching)
        })
        .collect();
    // Active containers per (GPU, priority).
    let mut active_at: BTreeMap<(&str, i32), u32> = BTreeMap::new();
    for (c, &(_, active)) in containers.iter().zip(&decayed) {
        if !active || c.priority < 0 {
            continue;
        }
        for uuid in c.uuids() {
            *active_at.entry((uuid, c.priority)).or_default() += 1;
        }
    }
    // Steps 2 and 3.
    containers
        .iter()
        .zip(decayed)
        .map(|(c, (rk, active))| {
            let p = c.priority;
            let uuids = c.uuids();
            let blocked = p > 0
                && uuids
                    .iter()
                    .any(|&u| active_at.range((u, i32::MIN)..(u, p)).any(|(_, &n)| n > 0));
            let recent_kernel = match (blocked, rk) {
                (true, _) => BLOCKED,
                (false, rk) if rk < 0 => 0,
                (false, rk) => rk,
            };
            let crowded = p >= 0
                && uuids
                    .iter()
                    .any(|&u| active_at.get(&(u, p)).is_some_and(|&n| n > 1));
            let utilization_switch = i32::from(blocked || crowded);
            let limited = match c.policy {
                CorePolicy::Force => true,
                CorePolicy::Disable => false,
                CorePolicy::Default => utilization_switch == 1,
            } && c.has_core_limit();
            Feedback {
                recent_kernel,
                utilization_switch,
                active,
                blocked,
                limited,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_800_000_000;
    const CLOCK: FeedbackClock = FeedbackClock {
        now_secs: NOW,
        period_secs: HAMI_PERIOD_SECS,
    };

    /// A container on `gpus` at `cores` percent that launched through the limiter since the last
    /// period (`recent_kernel` 2, switch 1), at priority 1 (HAMi's default).
    fn busy(gpus: &[&str], cores: u64) -> ContainerView {
        ContainerView {
            priority: 1,
            recent_kernel: 2,
            utilization_switch: 1,
            last_kernel_time: NOW - 1,
            gpus: gpus
                .iter()
                .map(|u| RegionGpu {
                    uuid: (*u).to_owned(),
                    sm_limit: cores,
                })
                .collect(),
            policy: CorePolicy::Default,
        }
    }

    /// Idle for longer than two periods.
    fn idle(mut c: ContainerView) -> ContainerView {
        c.recent_kernel = 0;
        c.last_kernel_time = NOW - 60;
        c
    }

    fn at(mut c: ContainerView, priority: i32) -> ContainerView {
        c.priority = priority;
        c
    }

    fn policy(mut c: ContainerView, policy: CorePolicy) -> ContainerView {
        c.policy = policy;
        c
    }

    /// Lifted (switch 0): its shim no longer sets `recent_kernel`, which has decayed to 0.
    fn lifted(mut c: ContainerView) -> ContainerView {
        c.utilization_switch = 0;
        c.recent_kernel = 0;
        c
    }

    /// (recent_kernel, utilization_switch, blocked, limited) of one container.
    type Outcome = (i32, i32, bool, bool);

    fn run(containers: &[ContainerView]) -> Vec<Outcome> {
        decide(containers, CLOCK)
            .into_iter()
            .map(|f| (f.recent_kernel, f.utilization_switch, f.blocked, f.limited))
            .collect()
    }

    #[test]
    fn table() {
        use CorePolicy::{Disable, Force};
        let g = &["GPU-a"][..];
        let cases: Vec<(&str, Vec<ContainerView>, Vec<Outcome>)> = vec![
            (
                "lone container under default: the limit is lifted",
                vec![busy(g, 30)],
                vec![(1, 0, false, false)],
            ),
            (
                "lone lifted container keeps running: stays lifted",
                vec![lifted(busy(g, 30))],
                vec![(0, 0, false, false)],
            ),
            (
                "two active containers at the same priority: both limited",
                vec![busy(g, 30), busy(g, 30)],
                vec![(1, 1, false, true), (1, 1, false, true)],
            ),
            (
                "a second container starts next to a lifted one: both limited again",
                vec![lifted(busy(g, 30)), busy(g, 30)],
                vec![(0, 1, false, true), (1, 1, false, true)],
            ),
            (
                "the neighbour went idle: lifted again",
                vec![busy(g, 30), idle(busy(g, 30))],
                vec![(1, 0, false, false), (0, 0, false, false)],
            ),
            (
                "high priority active, low priority blocked and limited",
                vec![at(busy(g, 30), 0), at(busy(g, 30), 1)],
                vec![(1, 0, false, false), (BLOCKED, 1, true, true)],
            ),
            (
                "a blocked container stays blocked while the high-priority one runs",
                vec![at(busy(g, 30), 0), {
                    let mut c = at(busy(g, 30), 1);
                    c.recent_kernel = BLOCKED;
                    c
                }],
                vec![(1, 0, false, false), (BLOCKED, 1, true, true)],
            ),
            (
                "high priority idle: the blocked container is released (0) and lifted",
                vec![at(idle(busy(g, 30)), 0), {
                    let mut c = at(busy(g, 30), 1);
                    c.recent_kernel = BLOCKED;
                    c
                }],
                vec![(0, 0, false, false), (0, 0, false, false)],
            ),
            (
                "priority only matters on a shared GPU",
                vec![at(busy(&["GPU-a"], 30), 0), at(busy(&["GPU-b"], 30), 1)],
                vec![(1, 0, false, false), (1, 0, false, false)],
            ),
            (
                "contention on any of a container's GPUs counts",
                vec![
                    at(busy(&["GPU-b"], 30), 0),
                    at(busy(&["GPU-a", "GPU-b"], 30), 1),
                ],
                vec![(1, 0, false, false), (BLOCKED, 1, true, true)],
            ),
            (
                "force: never lifted, even alone",
                vec![policy(busy(g, 30), Force)],
                vec![(1, 0, false, true)],
            ),
            (
                "disable: never limited, even when crowded",
                vec![policy(busy(g, 30), Disable), busy(g, 30)],
                vec![(1, 1, false, false), (1, 1, false, true)],
            ),
            (
                "disable with switch 0 is not seen through last_kernel_time (its shim never reports)",
                vec![policy(lifted(busy(g, 30)), Disable), busy(g, 30)],
                vec![(0, 0, false, false), (1, 0, false, false)],
            ),
            (
                "a lifted container without a core limit is no contender",
                vec![lifted(busy(g, 100)), busy(g, 30)],
                vec![(0, 0, false, false), (1, 0, false, false)],
            ),
            (
                "negative priority: never counted, never blocked, switch 0",
                vec![at(busy(g, 30), -1), at(busy(g, 30), 0)],
                vec![(1, 0, false, false), (1, 0, false, false)],
            ),
            (
                "a region naming one GPU twice counts once",
                vec![busy(&["GPU-a", "GPU-a"], 30)],
                vec![(1, 0, false, false)],
            ),
        ];
        for (name, input, want) in cases {
            assert_eq!(run(&input), want, "{name}");
        }
    }

    #[test]
    fn recent_kernel_decays_one_per_period_and_a_new_region_counts_once() {
        // A fresh region holds 2: active in the first period (1), not in the next (0).
        let mut c = vec![busy(&["GPU-a"], 30), idle(busy(&["GPU-a"], 30))];
        c[1].recent_kernel = 2;
        c[1].last_kernel_time = 0;
        let first = decide(&c, CLOCK);
        assert_eq!((first[1].recent_kernel, first[1].active), (1, true));
        assert_eq!(first[0].utilization_switch, 1, "the new region counts");
        c[1].recent_kernel = first[1].recent_kernel;
        c[1].utilization_switch = first[1].utilization_switch;
        let second = decide(&c, CLOCK);
        assert_eq!((second[1].recent_kernel, second[1].active), (0, false));
        assert_eq!(second[0].utilization_switch, 0);
    }

    #[test]
    fn hostile_values_give_defined_answers() {
        for priority in [i32::MIN, -1, 0, 1, i32::MAX] {
            for recent_kernel in [i32::MIN, -1, 0, 1, 2, i32::MAX] {
                for last_kernel_time in [0, NOW, u64::MAX] {
                    let mut c = busy(&["GPU-a"], u64::MAX);
                    c.priority = priority;
                    c.recent_kernel = recent_kernel;
                    c.last_kernel_time = last_kernel_time;
                    let out = decide(&[c, busy(&["GPU-a"], 30)], CLOCK);
                    assert!(
                        out.iter()
                            .all(|f| f.recent_kernel >= -1
                                && (0..=1).contains(&f.utilization_switch))
                    );
                }
            }
        }
        let huge = FeedbackClock {
            now_secs: u64::MAX,
            period_secs: u64::MAX,
        };
        assert_eq!(decide(&[busy(&["GPU-a"], 30)], huge).len(), 1);
    }
}

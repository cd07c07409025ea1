//! The SM limiter: a GCRA launch pacer per device whose rate is set by a feedback controller on
//! measured utilization. The math is in `docs/design/sm-limiter.md`; HAMi-core's token bucket,
//! which it replaces, is core contract §5.1–§5.4.
//!
//! Launch path (hot): one relaxed load when no limit is active; with a limit, `cuCtxGetDevice`,
//! a clock read (vDSO, no syscall) and one CAS on the device's theoretical arrival time, plus a
//! sleep only when the launch is ahead of its budget. No allocation, lock or `getenv`.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use vgpu_region::MAX_DEVICES;

/// Blocks a graph launch is charged before feedback corrects the estimate.
pub const GRAPH_BLOCKS: u64 = 1024;

/// Set when any device is being limited (read on every launch).
static ACTIVE: AtomicBool = AtomicBool::new(false);
/// Set by any launch; the watcher turns it into `last_kernel_time`.
pub static LAUNCHED: AtomicBool = AtomicBool::new(false);

/// Burst allowance: a launch may run this far ahead of its budget without waiting.
const BURST_NS: u64 = 2_000_000;

pub struct DeviceLimiter {
    /// Whether this device is limited now.
    pub enabled: AtomicBool,
    /// Cost of one block in nanoseconds of budget, ×1024 (fixed point). 0 = not yet measured.
    pub ns_per_block_x1024: AtomicU64,
    /// GCRA theoretical arrival time (monotonic ns).
    pub tat: AtomicU64,
    /// Blocks launched (monotonic counter, read by the controller).
    pub blocks: AtomicU64,
    /// Launches that had to wait (the limit was binding).
    pub waits: AtomicU64,
}

pub static DEVICES: [DeviceLimiter; MAX_DEVICES] = [const {
    DeviceLimiter {
        enabled: AtomicBool::new(false),
        ns_per_block_x1024: AtomicU64::new(0),
        tat: AtomicU64::new(0),
        blocks: AtomicU64::new(0),
        waits: AtomicU64::new(0),
    }
}; MAX_DEVICES];

pub fn set_active(active: bool) {
    ACTIVE.store(active, Ordering::Relaxed);
}

#[inline]
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer; CLOCK_MONOTONIC is served by the vDSO (no syscall).
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Paces a launch of `blocks` blocks on the current context's device.
#[inline]
pub fn before_launch(blocks: u64) {
    before_launch_on(crate::real::current_device, blocks);
}

/// Paces a launch of `blocks` blocks on the device `device` names (asked only while a limit is
/// active: finding a stream's device costs driver calls).
#[inline]
pub fn before_launch_on(device: impl FnOnce() -> Option<usize>, blocks: u64) {
    if !LAUNCHED.load(Ordering::Relaxed) {
        LAUNCHED.store(true, Ordering::Relaxed);
    }
    if ACTIVE.load(Ordering::Relaxed) {
        throttle(device(), blocks);
    }
}

#[cold]
fn throttle(dev: Option<usize>, blocks: u64) {
    let Some(dev) = dev.filter(|&d| d < MAX_DEVICES) else {
        return;
    };
    let d = &DEVICES[dev];
    d.blocks.fetch_add(blocks, Ordering::Relaxed);
    if !d.enabled.load(Ordering::Relaxed) {
        return;
    }
    // Priority blocking by the host monitor (recent_kernel < 0), as HAMi-core does, in shorter
    // steps; and mark this container as active for the monitor.
    if let Some(region) = crate::region::try_get() {
        let rk = region.recent_kernel();
        while rk.load(Ordering::Relaxed) < 0 {
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        if rk.load(Ordering::Relaxed) != 2 {
            rk.store(2, Ordering::Relaxed);
        }
    }
    let npb = d.ns_per_block_x1024.load(Ordering::Relaxed);
    if npb == 0 {
        return;
    }
    let cost = blocks.max(1).saturating_mul(npb) >> 10;
    let now = now_ns();
    let mut tat = d.tat.load(Ordering::Relaxed);
    let new = loop {
        let new = tat.max(now).saturating_add(cost);
        match d
            .tat
            .compare_exchange_weak(tat, new, Ordering::AcqRel, Ordering::Relaxed)
        {
            Ok(_) => break new,
            Err(t) => tat = t,
        }
    };
    // The launch may proceed once `now ≥ new − cost − BURST`, i.e. its start is within the
    // burst allowance.
    let start = new - cost;
    if start > now + BURST_NS {
        d.waits.fetch_add(1, Ordering::Relaxed);
        std::thread::sleep(std::time::Duration::from_nanos(start - now - BURST_NS));
    }
}

/// One controller step (pure): the new cost per block, from the old one, the limit `L` (%), the
/// measured utilisation `U` (%) and the blocks launched `B`, both over the window `window_ns`,
/// and whether the pacer held launches back in that window (`paced`).
///
/// Model: one block costs `U·W / (100·B)` ns of device time, so running at `L` allows
/// `B·L/U` blocks per window, i.e. a budget of `W·U / (B·L)` ns per block. That is the target
/// while the application sets the pace. While the pacer does, the target is `c·U/L` instead:
/// the launch rate then also carries what the host lost (a late wake-up from the pacer's sleep,
/// a CPU-starved or CFS-throttled launcher), which the model would read as the budget, leaving
/// the device below `L` for good; the ratio has `U = L` as its only fixed point. Without lost
/// time the two targets are equal. The new value is the geometric mean of the old one and the
/// target (a first-order filter in log space) when the measurement is within 2× of the limit,
/// and the target itself when it is further off (a restart or a workload change); a step changes
/// it by at most 64×.
pub fn control_step(
    old_x1024: u64,
    limit: f64,
    util: f64,
    blocks: u64,
    window_ns: u64,
    paced: bool,
) -> u64 {
    if blocks == 0 {
        return old_x1024;
    }
    if util < 0.5 {
        // Work was launched but nothing measurable ran: relax (halve the cost).
        return old_x1024 / 2;
    }
    let model = window_ns as f64 * util / (blocks as f64 * limit) * 1024.0;
    if old_x1024 == 0 {
        return model.max(1.0) as u64;
    }
    let old = old_x1024 as f64;
    let target = if paced { old * util / limit } else { model };
    let near = util >= limit / 2.0 && util <= limit * 2.0;
    let next = if near { (old * target).sqrt() } else { target };
    let next = next.clamp(old / 64.0, old * 64.0);
    next.clamp(1.0, 1e15) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A simulated device: each block costs `c` ns; the app launches kernels of 40 blocks as fast
    /// as allowed, and each launch the pacer holds back wakes `lost` ns late (a loaded host).
    fn simulate(limit: f64, c: f64, lost: f64) -> f64 {
        const BLOCKS: f64 = 40.0;
        let w = 500_000_000u64;
        let mut npb = 0u64;
        let mut util = 0.0;
        for _ in 0..40 {
            // The launch period: the pacer's budget plus the late wake-up when the pacer binds,
            // never faster than the device runs the kernel (its queue is full then).
            let budget = BLOCKS * npb as f64 / 1024.0;
            let paced = npb > 0 && budget + lost > BLOCKS * c;
            let period = if paced { budget + lost } else { BLOCKS * c };
            let admitted = w as f64 / period * BLOCKS;
            util = (admitted * c / w as f64 * 100.0).min(100.0);
            npb = control_step(npb, limit, util, admitted as u64, w, paced);
        }
        util
    }

    #[test]
    fn converges_to_the_limit_for_any_block_cost() {
        for limit in [10.0, 30.0, 50.0, 70.0] {
            for c in [1_000.0, 50_000.0, 2_000_000.0] {
                let u = simulate(limit, c, 0.0);
                assert!((u - limit).abs() < 1.0, "limit {limit} cost {c}: {u}");
            }
        }
    }

    /// A launcher that wakes late (CPU contention, CFS throttling) still gets its limit: with
    /// 40-block kernels of 50 µs blocks (2 ms each), wake-ups 0.2 to 1 ms late.
    #[test]
    fn converges_to_the_limit_when_wake_ups_are_late() {
        for limit in [10.0, 30.0, 50.0, 70.0] {
            for lost in [200_000.0, 1_000_000.0] {
                let u = simulate(limit, 50_000.0, lost);
                assert!((u - limit).abs() < 1.0, "limit {limit} lost {lost} ns: {u}");
            }
        }
    }

    #[test]
    fn idle_keeps_and_silence_relaxes() {
        for paced in [false, true] {
            assert_eq!(control_step(5000, 30.0, 0.0, 0, 1, paced), 5000);
            assert_eq!(control_step(5000, 30.0, 0.0, 10, 1, paced), 2500);
            assert_eq!(control_step(0, 30.0, 0.0, 10, 1, paced), 0);
        }
    }
}

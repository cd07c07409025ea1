//! One background thread per process (started by the hooks with their first use of the region,
//! and again in a forked child): sweeps dead processes' slots, records `last_kernel_time`, and
//! runs the SM limiter's controller on NVML utilization.

use std::ffi::{c_uint, c_void};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use vgpu_region::MAX_DEVICES;

use crate::config::{UtilizationPolicy, sm_limited};
use crate::limiter::{self, DEVICES};
use crate::real::{self, Aux};
use crate::{log, region};

const TICK: Duration = Duration::from_millis(50);
const SWEEP_EVERY: u32 = 5; // 250 ms
const CONTROL_EVERY: u32 = 10; // 500 ms
const WINDOW_NS: u64 = 500_000_000;

static STARTED: AtomicBool = AtomicBool::new(false);
/// The pid the watcher runs in (a forked child has no watcher thread).
static OWNER: AtomicU32 = AtomicU32::new(0);

pub fn start() {
    if STARTED.load(Ordering::Acquire) {
        return;
    }
    if STARTED.swap(true, Ordering::AcqRel) {
        return;
    }
    OWNER.store(std::process::id(), Ordering::Release);
    let spawned = std::thread::Builder::new()
        .name("vgpu-watcher".into())
        .spawn(|| {
            if std::panic::catch_unwind(run).is_err() {
                log::error!("watcher thread failed; dead-process cleanup and SM limits are off");
                limiter::set_active(false);
            }
        });
    if spawned.is_err() {
        log::warning!(
            "cannot start the watcher thread; dead-process cleanup relies on OOM retries"
        );
    }
}

/// atfork child handler: threads do not survive `fork`.
pub fn after_fork_in_child() {
    STARTED.store(false, Ordering::Release);
}

struct Nvml {
    ok: bool,
}

impl Nvml {
    fn init() -> Nvml {
        let p = real::aux(Aux::nvmlInit_v2);
        if p.is_null() {
            return Nvml { ok: false };
        }
        // SAFETY: `nvmlInit_v2(void)`.
        let r =
            unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> c_uint>(p)() };
        Nvml { ok: r == 0 }
    }

    fn handle(&self, cuda_dev: usize) -> Option<*mut c_void> {
        let p = real::aux(Aux::nvmlDeviceGetHandleByIndex_v2);
        if !self.ok || p.is_null() {
            return None;
        }
        let idx = crate::visible::cuda_to_nvml(cuda_dev)?;
        let mut h: *mut c_void = std::ptr::null_mut();
        // SAFETY: `nvmlDeviceGetHandleByIndex_v2(unsigned, nvmlDevice_t*)`.
        let r = unsafe {
            std::mem::transmute::<
                *mut c_void,
                unsafe extern "C" fn(c_uint, *mut *mut c_void) -> c_uint,
            >(p)(idx as c_uint, &mut h)
        };
        (r == 0).then_some(h)
    }

    /// This container's SM utilisation (%) on a device over the last `window_us`: the average
    /// per pid of NVML's samples, summed over the container's pids. If NVML knows none of them
    /// (a PID namespace without host pids), the whole device's utilisation.
    fn container_util(&self, handle: *mut c_void, pids: &[u32], window_us: u64) -> Option<f64> {
        let since = crate::nvml_api::realtime_us().saturating_sub(window_us);
        if let Ok(samples) = crate::nvml_api::real_process_samples(handle, since) {
            if samples.is_empty() {
                return Some(0.0);
            }
            let mut total = 0.0;
            let mut matched = false;
            for &pid in pids {
                let mine: Vec<_> = samples.iter().filter(|s| s.pid == pid).collect();
                if !mine.is_empty() {
                    matched = true;
                    total += mine.iter().map(|s| s.sm_util as f64).sum::<f64>() / mine.len() as f64;
                }
            }
            if matched {
                return Some(total.min(100.0));
            }
        }
        let p = real::get(real::F::nvmlDeviceGetUtilizationRates);
        if p.is_null() {
            return None;
        }
        let mut u = crate::nvml_api::Utilization::default();
        // SAFETY: `nvmlDeviceGetUtilizationRates(dev, nvmlUtilization_t*)`.
        let r = unsafe {
            std::mem::transmute::<
                *mut c_void,
                unsafe extern "C" fn(*mut c_void, *mut crate::nvml_api::Utilization) -> c_uint,
            >(p)(handle, &mut u)
        };
        (r == 0).then_some(u.gpu as f64)
    }
}

fn run() {
    let region = region::get();
    let cfg = region::config();
    let limited: Vec<usize> = (0..MAX_DEVICES)
        .filter(|&d| sm_limited(region.sm_limit(d)))
        .collect();
    let mut nvml: Option<Nvml> = None;
    let mut last_blocks = [0u64; MAX_DEVICES];
    let mut last_waits = [0u64; MAX_DEVICES];
    let mut tick: u32 = 0;
    // Count launches from the start, so the first control window has both numbers.
    let initially = match cfg.policy {
        UtilizationPolicy::Force => true,
        UtilizationPolicy::Disable => false,
        UtilizationPolicy::Default => region.utilization_switch() == 1,
    };
    limiter::set_active(initially && !limited.is_empty());
    // The first window started with counting; its utilisation covers time before it.
    let mut warm = false;
    loop {
        if OWNER.load(Ordering::Acquire) != std::process::id() {
            return;
        }
        std::thread::sleep(TICK);
        tick = tick.wrapping_add(1);
        if limiter::LAUNCHED.swap(false, Ordering::Relaxed) {
            let secs = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            region.set_last_kernel_time(secs);
        }
        if tick.is_multiple_of(SWEEP_EVERY) && !region.private {
            region.sweep();
        }
        if limited.is_empty() || !tick.is_multiple_of(CONTROL_EVERY) {
            continue;
        }
        let enforce = match cfg.policy {
            UtilizationPolicy::Force => true,
            UtilizationPolicy::Disable => false,
            UtilizationPolicy::Default => region.utilization_switch() == 1,
        };
        limiter::set_active(enforce);
        let nv = nvml.get_or_insert_with(|| {
            let n = Nvml::init();
            if !n.ok {
                log::warning!("NVML unavailable: CUDA_DEVICE_SM_LIMIT cannot be enforced");
            }
            n
        });
        let pids = region.pids();
        for &d in &limited {
            let dl = &DEVICES[d];
            dl.enabled.store(enforce, Ordering::Relaxed);
            let blocks = dl.blocks.load(Ordering::Relaxed);
            let launched = blocks.wrapping_sub(last_blocks[d]);
            last_blocks[d] = blocks;
            let waits = dl.waits.load(Ordering::Relaxed);
            let paced = waits != last_waits[d];
            last_waits[d] = waits;
            if !enforce {
                continue;
            }
            if !warm {
                continue;
            }
            let Some(h) = nv.handle(d) else { continue };
            let Some(util) = nv.container_util(h, &pids, WINDOW_NS / 1000) else {
                continue;
            };
            region.set_sm_util(d, util.round() as u64);
            let old = dl.ns_per_block_x1024.load(Ordering::Relaxed);
            let limit = region.sm_limit(d) as f64;
            let new = limiter::control_step(old, limit, util, launched, WINDOW_NS, paced);
            dl.ns_per_block_x1024.store(new, Ordering::Relaxed);
            log::info!(
                "sm limiter dev {d}: util {util:.1}% blocks {launched} waits {waits} cost/block {:.0} ns -> {:.0} ns",
                old as f64 / 1024.0,
                new as f64 / 1024.0
            );
        }
        warm = true;
    }
}

//! Stream-ordered allocation (`cuMemAllocAsync`, `cuMemAllocFromPoolAsync`, `cuMemFreeAsync`)
//! and the memory a pool keeps after a free.
//!
//! Live pool allocations are charged at their size like any allocation (check-and-add, refused
//! over the limit). A freed block goes back to its pool; whether the pool keeps it depends on
//! the pool's release threshold (`CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`):
//!
//! * threshold 0 (the driver's default): the driver returns unused pool memory at the next
//!   synchronisation, so the free uncounts at once (as before);
//! * threshold > 0 (PyTorch's `cudaMallocAsync` backend sets it to the maximum): the pool keeps
//!   up to that much, so the freed bytes stay charged as the pool's *retained* memory. A later
//!   allocation from the same pool is served from the retained charge first (only the rest is
//!   reserved anew). The retained charge is brought back to the driver's own numbers,
//!   `min(reserved, max(threshold, used)) − used` (`RESERVED_MEM_CURRENT`, `USED_MEM_CURRENT`),
//!   after an allocation from such a pool, after `cuMemPoolTrimTo`, after a threshold change
//!   (`cuMemPoolSetAttribute`), and before any allocation of this process would fail the limit;
//!   `cuMemPoolDestroy` gives it back.
//!
//! Retained memory is charged to the slot's `data_size` (HAMi's monitor shows it as buffer).

use std::collections::HashMap;
use std::ffi::{c_int, c_void};

use super::*;

/// `CUmemPool_attribute` values.
const RELEASE_THRESHOLD: c_int = 4;
const RESERVED_MEM_CURRENT: c_int = 5;
const USED_MEM_CURRENT: c_int = 7;

struct Pool {
    dev: usize,
    /// The release threshold, read once and updated by `cuMemPoolSetAttribute`.
    threshold: u64,
    /// Bytes charged for memory the pool keeps beyond its live allocations.
    retained: u64,
}

#[derive(Default)]
pub(super) struct PoolTracker {
    /// Live pool allocation → its pool.
    of_ptr: HashMap<u64, u64>,
    pools: HashMap<u64, Pool>,
}

impl PoolTracker {
    /// A pointer is no longer a live pool allocation (freed by any call).
    pub(super) fn forget_ptr(&mut self, ptr: u64) -> Option<u64> {
        self.of_ptr.remove(&ptr)
    }
}

fn pool_attr(pool: u64, attr: c_int) -> Option<u64> {
    let p = real::aux(real::Aux::cuMemPoolGetAttribute);
    if p.is_null() {
        return None;
    }
    let mut v: u64 = 0;
    // SAFETY: `cuMemPoolGetAttribute(CUmemoryPool, CUmemPool_attribute, void*)`; the three
    // attributes asked for are `cuuint64_t`.
    let r = unsafe {
        std::mem::transmute::<
            *mut c_void,
            unsafe extern "C" fn(*mut c_void, c_int, *mut c_void) -> CUresult,
        >(p)(pool as *mut c_void, attr, (&mut v as *mut u64).cast())
    };
    (r == CUDA_SUCCESS).then_some(v)
}

/// The device's current pool (where `cuMemAllocAsync` allocates).
fn current_pool(dev: usize) -> Option<u64> {
    let p = real::aux(real::Aux::cuDeviceGetMemPool);
    if p.is_null() {
        return None;
    }
    let mut pool: *mut c_void = std::ptr::null_mut();
    // SAFETY: `cuDeviceGetMemPool(CUmemoryPool*, CUdevice)`.
    let r = unsafe {
        std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*mut *mut c_void, c_int) -> CUresult>(
            p,
        )(&mut pool, dev as c_int)
    };
    (r == CUDA_SUCCESS && !pool.is_null()).then_some(pool as u64)
}

/// What a pool keeps beyond its live allocations once the driver has released what it releases
/// at a synchronisation: up to the threshold, never more than is reserved.
pub fn retained_bytes(reserved: u64, used: u64, threshold: u64) -> u64 {
    reserved.min(threshold.max(used)).saturating_sub(used)
}

/// Applies a change of a retained charge (a pool's, or what the driver keeps for graphs) to the
/// region's data size, outside the tracker's lock.
pub(super) fn apply(dev: usize, delta: i128) {
    if delta == 0 {
        return;
    }
    let region = region_with_watcher();
    let field = vgpu_region::slot::MEM_DATA_SIZE;
    if delta > 0 {
        region.charge_as(dev, field, delta.min(u64::MAX as i128) as u64);
    } else {
        region.release_as(dev, field, (-delta).min(u64::MAX as i128) as u64);
    }
}

/// Brings `pool`'s retained charge to the driver's numbers. True when the charge went down.
fn reconcile(pool: u64) -> bool {
    if !with_tracker(|t| t.pools.pools.contains_key(&pool)) {
        return false;
    }
    let (Some(reserved), Some(used), Some(threshold)) = (
        pool_attr(pool, RESERVED_MEM_CURRENT),
        pool_attr(pool, USED_MEM_CURRENT),
        pool_attr(pool, RELEASE_THRESHOLD),
    ) else {
        return false;
    };
    let target = retained_bytes(reserved, used, threshold);
    let Some((dev, delta)) = with_tracker(|t| {
        let p = t.pools.pools.get_mut(&pool)?;
        p.threshold = threshold;
        let delta = target as i128 - p.retained as i128;
        p.retained = target;
        Some((p.dev, delta))
    }) else {
        return false;
    };
    apply(dev, delta);
    delta < 0
}

/// Reconciles every pool this process allocated from (before an allocation is refused). True
/// when some charge went down, so a retry may fit.
pub(super) fn reconcile_all() -> bool {
    let pools: Vec<u64> = with_tracker(|t| t.pools.pools.keys().copied().collect());
    pools.into_iter().fold(false, |any, p| reconcile(p) | any)
}

/// Takes up to `bytes` of `pool`'s retained charge (it now pays for a live allocation).
fn take_retained(pool: u64, bytes: u64) -> u64 {
    with_tracker(|t| {
        t.pools.pools.get_mut(&pool).map_or(0, |p| {
            let c = p.retained.min(bytes);
            p.retained -= c;
            c
        })
    })
}

fn give_back_retained(pool: u64, bytes: u64) {
    if bytes != 0 {
        with_tracker(|t| {
            if let Some(p) = t.pools.pools.get_mut(&pool) {
                p.retained += bytes;
            }
        });
    }
}

/// An allocation from `pool` (the device's current pool when `None`): charged at its size,
/// served first from what the pool retains.
pub(super) fn pool_alloc(
    pool: Option<u64>,
    bytes: u64,
    alloc: impl FnOnce() -> (CUresult, u64),
) -> CUresult {
    let Some(dev) = real::current_device() else {
        return alloc().0;
    };
    let Some(pool) = pool.filter(|&p| p != 0).or_else(|| current_pool(dev)) else {
        return counted(Kind::Ptr, Some(dev), bytes, alloc);
    };
    if !with_tracker(|t| t.pools.pools.contains_key(&pool)) {
        let threshold = pool_attr(pool, RELEASE_THRESHOLD).unwrap_or(0);
        with_tracker(|t| {
            t.pools.pools.entry(pool).or_insert(Pool {
                dev,
                threshold,
                retained: 0,
            });
        });
    }
    let region = region_with_watcher();
    let attempt = || {
        let credit = take_retained(pool, bytes);
        match region.reserve(dev, bytes - credit) {
            Ok(()) => Ok(credit),
            Err(()) => {
                give_back_retained(pool, credit);
                Err(())
            }
        }
    };
    let Ok(credit) = attempt().or_else(|()| if reconcile_all() { attempt() } else { Err(()) })
    else {
        log::info!(
            "device {dev}: OOM, {bytes} bytes requested from a memory pool, {} of {} in use",
            region.usage(dev),
            region.limit(dev)
        );
        return CUDA_ERROR_OUT_OF_MEMORY;
    };
    let (r, ptr) = alloc();
    if r != CUDA_SUCCESS {
        region.release(dev, bytes - credit);
        give_back_retained(pool, credit);
        return r;
    }
    let keeps = with_tracker(|t| {
        t.ptrs.insert(ptr, (dev, bytes));
        t.pools.of_ptr.insert(ptr, pool);
        t.pools.pools.get(&pool).is_some_and(|p| p.threshold > 0)
    });
    if keeps {
        // The pool may have grown beyond the request (or been unable to reuse what it kept).
        reconcile(pool);
    }
    r
}

/// `cuMemFreeAsync` succeeded: the allocation's charge is given back, or kept as the pool's
/// retained memory when the pool keeps freed memory.
pub(super) fn pool_free(ptr: u64) {
    let Some((dev, bytes, kept)) = with_tracker(|t| {
        let (dev, bytes) = t.ptrs.remove(&ptr)?;
        let kept = t
            .pools
            .of_ptr
            .remove(&ptr)
            .and_then(|pool| t.pools.pools.get_mut(&pool))
            .filter(|p| p.threshold > 0)
            .map(|p| p.retained += bytes)
            .is_some();
        Some((dev, bytes, kept))
    }) else {
        return;
    };
    if !kept {
        region_with_watcher().release(dev, bytes);
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemPoolTrimTo(pool: *mut c_void, min_bytes_to_keep: usize) -> CUresult {
    guarded("cuMemPoolTrimTo", CUDA_ERROR_UNKNOWN, || {
        let r = real_call!(cuMemPoolTrimTo: unsafe extern "C" fn(*mut c_void, usize) -> CUresult, pool, min_bytes_to_keep);
        if r == CUDA_SUCCESS && !degraded() {
            reconcile(pool as u64);
        }
        r
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolSetAttribute(
    pool: *mut c_void,
    attr: c_int,
    value: *mut c_void,
) -> CUresult {
    guarded("cuMemPoolSetAttribute", CUDA_ERROR_UNKNOWN, || {
        let r = real_call!(cuMemPoolSetAttribute: unsafe extern "C" fn(*mut c_void, c_int, *mut c_void) -> CUresult, pool, attr, value);
        if r == CUDA_SUCCESS && attr == RELEASE_THRESHOLD && !degraded() {
            reconcile(pool as u64);
        }
        r
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemPoolDestroy(pool: *mut c_void) -> CUresult {
    guarded("cuMemPoolDestroy", CUDA_ERROR_UNKNOWN, || {
        let r = real_call!(cuMemPoolDestroy: unsafe extern "C" fn(*mut c_void) -> CUresult, pool);
        if r == CUDA_SUCCESS && !degraded() {
            // Live allocations keep their charge until freed (the driver frees the pool then).
            if let Some(p) = with_tracker(|t| t.pools.pools.remove(&(pool as u64))) {
                apply(p.dev, -(p.retained as i128));
            }
        }
        r
    })
}

#[cfg(test)]
mod tests {
    use super::retained_bytes;

    #[test]
    fn retained_is_what_the_pool_keeps_after_a_synchronisation() {
        const M: u64 = 1 << 20;
        // Default threshold 0: everything unused goes back.
        assert_eq!(retained_bytes(512 * M, 100 * M, 0), 0);
        // Threshold "keep everything".
        assert_eq!(retained_bytes(512 * M, 100 * M, u64::MAX), 412 * M);
        // Threshold 256 MiB: the pool keeps 256 MiB reserved, 100 MiB of it live.
        assert_eq!(retained_bytes(512 * M, 100 * M, 256 * M), 156 * M);
        // Live allocations above the threshold: nothing retained beyond them.
        assert_eq!(retained_bytes(512 * M, 300 * M, 256 * M), 0);
        // Inconsistent numbers (a pending free): never negative.
        assert_eq!(retained_bytes(100 * M, 300 * M, u64::MAX), 0);
    }
}

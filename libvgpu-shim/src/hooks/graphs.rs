//! Graph memory nodes (CUDA 11.4+): device memory a CUDA graph allocates when it runs.
//!
//! An allocation node (`cuGraphAddMemAllocNode`, `cuGraphAddNode(_v2)` with a `MEM_ALLOC`
//! node, `cuMemAllocAsync` captured from a stream, a clone of such a graph) gets a virtual
//! address when it is added; physical memory is mapped when an executable graph made from it
//! runs, and stays mapped after the launch unless a free node of the same graph frees it. The
//! shim counts the memory at **instantiation**, the one step every way of building such a graph
//! goes through before its memory can exist: `cuGraphInstantiate`, `_v2`, `WithFlags` and
//! `WithParams(_ptsz)` read the graph's nodes (child graphs included), charge each allocation
//! node's size to its device, and return `CUDA_ERROR_OUT_OF_MEMORY` without instantiating when
//! that does not fit. Counting at add time would charge graphs that never run and would miss
//! the nodes a capture or a clone creates.
//!
//! A charge is keyed by the node's address and lives as long as the address can hold memory:
//! while an executable graph holding the node exists, and, after a launch that does not free
//! it in-graph, until the address is freed (`cuMemFreeAsync`, `cuMemFree`, or the launch of a
//! graph with a free node for it). An address already charged (by another executable graph,
//! or as a pointer) is charged once. A `cuMemAllocAsync` or `cuMemFreeAsync` on a stream being
//! captured is not counted when it is called ([`capturing`]): it becomes a node like any other.
//!
//! The driver keeps the physical memory of freed graph allocations cached for later launches
//! until `cuDeviceGraphMemTrim`. What it holds for graphs on a device
//! (`CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT`) beyond the live charges is charged as *retained*
//! memory (slot `data_size`, as pools' retained memory), brought back to the driver's number
//! after every graph launch, free of a graph allocation, executable-graph destruction and trim,
//! and before any allocation of the process is refused.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};

use vgpu_region::MAX_DEVICES;

use super::*;

/// `CUgraphNodeType` values.
const NODE_TYPE_GRAPH: c_int = 4;
const NODE_TYPE_MEM_ALLOC: c_int = 10;
const NODE_TYPE_MEM_FREE: c_int = 11;
/// `CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT`.
const RESERVED_MEM_CURRENT: c_int = 2;
/// `CU_MEM_LOCATION_TYPE_DEVICE` (graph allocations on the host are not device memory).
const LOCATION_DEVICE: c_int = 1;
/// Child graphs nested deeper are not read. CUDA refuses memory nodes in child graphs
/// (`cuGraphAddChildGraphNode`); reading them at all is a second line, bounded so a cyclic or
/// hostile structure cannot keep a hook busy.
const MAX_CHILD_DEPTH: usize = 8;
/// Nodes read per instantiation at most (32 MiB of handles); a larger graph is refused rather
/// than instantiated uncounted.
const MAX_NODES: usize = 1 << 22;

/// `CUDA_MEM_ALLOC_NODE_PARAMS` (`_v1` and `_v2` share the layout; `CUmemPoolProps` is 88
/// bytes in every CUDA 11.4–13 header: `maxSize`, `usage` and `reserved` share its last 64).
#[repr(C)]
struct MemAllocNodeParams {
    alloc_type: c_int,
    handle_types: c_int,
    location_type: c_int,
    location_id: c_int,
    win32_security_attributes: *mut c_void,
    pool_props_tail: [u8; 64],
    access_descs: *const c_void,
    access_desc_count: usize,
    bytesize: usize,
    dptr: u64,
}

/// A charged graph allocation address.
struct Alloc {
    dev: usize,
    bytes: u64,
    /// Executable graphs holding the node.
    holders: u32,
    /// Mapped outside a launch: a launch did not free it in-graph and nothing has freed it.
    live: bool,
}

/// An executable graph with memory nodes.
struct Exec {
    /// The allocation addresses it holds (each in `GraphTracker::allocs`).
    held: Vec<u64>,
    /// Of those, the ones no free node of the same graph frees: mapped after a launch.
    outlive: Vec<u64>,
    /// Addresses its free nodes free that it does not allocate.
    frees_others: Vec<u64>,
}

#[derive(Default)]
pub(super) struct GraphTracker {
    allocs: HashMap<u64, Alloc>,
    execs: HashMap<u64, Exec>,
    /// Per device: bytes charged for what the driver holds for graphs beyond `allocs`.
    retained: [u64; MAX_DEVICES],
}

/// Set once an executable graph with memory nodes has existed in this process: graph launches
/// and frees look at the tracker only then (one relaxed load otherwise).
static ANY: AtomicBool = AtomicBool::new(false);

/// Serialises the bookkeeping of instantiation, launch, free and destruction, so an address's
/// charge is decided once (an instantiation reads, reserves, calls the driver and records).
static BOOKKEEPING: PidLock = PidLock::new();

pub(super) fn any() -> bool {
    ANY.load(Ordering::Relaxed)
}

// ---------------------------------------------------------------- reading a graph

type GetNodes = unsafe extern "C" fn(*mut c_void, *mut *mut c_void, *mut usize) -> CUresult;
type NodeGetType = unsafe extern "C" fn(*mut c_void, *mut c_int) -> CUresult;
type AllocNodeParams = unsafe extern "C" fn(*mut c_void, *mut MemAllocNodeParams) -> CUresult;
type FreeNodeParams = unsafe extern "C" fn(*mut c_void, *mut u64) -> CUresult;
type ChildGraph = unsafe extern "C" fn(*mut c_void, *mut *mut c_void) -> CUresult;

/// The driver calls that read a graph; `None` on a driver without graph memory nodes.
struct GraphApi {
    get_nodes: GetNodes,
    get_type: NodeGetType,
    alloc_params: AllocNodeParams,
    free_params: FreeNodeParams,
    child: Option<ChildGraph>,
}

fn graph_api() -> Option<GraphApi> {
    let p = |a| {
        let p = real::aux(a);
        (!p.is_null()).then_some(p)
    };
    // SAFETY: each pointer is the driver's function of that name, whose C signature is the
    // type it is transmuted to.
    unsafe {
        Some(GraphApi {
            get_nodes: std::mem::transmute::<*mut c_void, GetNodes>(p(real::Aux::cuGraphGetNodes)?),
            get_type: std::mem::transmute::<*mut c_void, NodeGetType>(p(
                real::Aux::cuGraphNodeGetType,
            )?),
            alloc_params: std::mem::transmute::<*mut c_void, AllocNodeParams>(p(
                real::Aux::cuGraphMemAllocNodeGetParams,
            )?),
            free_params: std::mem::transmute::<*mut c_void, FreeNodeParams>(p(
                real::Aux::cuGraphMemFreeNodeGetParams,
            )?),
            child: p(real::Aux::cuGraphChildGraphNodeGetGraph)
                .map(|c| std::mem::transmute::<*mut c_void, ChildGraph>(c)),
        })
    }
}

/// The memory nodes of a graph: allocations (address, device, bytes) and freed addresses.
#[derive(Default)]
struct GraphMemory {
    allocs: Vec<(u64, usize, u64)>,
    frees: Vec<u64>,
}

/// Adds the memory nodes of `graph` (and of its child graphs) to `out`. `Err` when the graph
/// has more nodes than `budget` allows. A graph the driver cannot list adds nothing: the
/// driver refuses to instantiate it too.
fn read_graph(
    api: &GraphApi,
    graph: *mut c_void,
    depth: usize,
    budget: &mut usize,
    out: &mut GraphMemory,
) -> Result<(), ()> {
    let mut n: usize = 0;
    // SAFETY: `cuGraphGetNodes(graph, NULL, &n)` asks for the count.
    if unsafe { (api.get_nodes)(graph, std::ptr::null_mut(), &mut n) } != CUDA_SUCCESS {
        return Ok(());
    }
    if n > *budget {
        return Err(());
    }
    *budget -= n;
    let mut nodes = vec![std::ptr::null_mut::<c_void>(); n];
    let mut got = n;
    // SAFETY: room for `got` handles.
    if unsafe { (api.get_nodes)(graph, nodes.as_mut_ptr(), &mut got) } != CUDA_SUCCESS {
        return Ok(());
    }
    for &node in nodes.iter().take(got.min(n)).filter(|n| !n.is_null()) {
        let mut kind: c_int = -1;
        // SAFETY: a node handle the driver just listed; out-pointer on the stack.
        if unsafe { (api.get_type)(node, &mut kind) } != CUDA_SUCCESS {
            continue;
        }
        match kind {
            NODE_TYPE_MEM_ALLOC => {
                // SAFETY: plain integers and pointers; all-zero is a valid value.
                let mut p: MemAllocNodeParams = unsafe { std::mem::zeroed() };
                // SAFETY: an allocation node; the driver fills the struct.
                let ok = unsafe { (api.alloc_params)(node, &mut p) } == CUDA_SUCCESS;
                let dev = usize::try_from(p.location_id)
                    .ok()
                    .filter(|&d| d < MAX_DEVICES);
                if let (true, LOCATION_DEVICE, Some(dev), 1..) =
                    (ok, p.location_type, dev, p.bytesize)
                {
                    out.allocs.push((p.dptr, dev, p.bytesize as u64));
                }
            }
            NODE_TYPE_MEM_FREE => {
                let mut dptr: u64 = 0;
                // SAFETY: a free node; out-pointer on the stack.
                if unsafe { (api.free_params)(node, &mut dptr) } == CUDA_SUCCESS && dptr != 0 {
                    out.frees.push(dptr);
                }
            }
            NODE_TYPE_GRAPH if depth < MAX_CHILD_DEPTH => {
                let Some(child_of) = api.child else {
                    continue;
                };
                let mut child: *mut c_void = std::ptr::null_mut();
                // SAFETY: a child-graph node; out-pointer on the stack.
                if unsafe { child_of(node, &mut child) } == CUDA_SUCCESS && !child.is_null() {
                    read_graph(api, child, depth + 1, budget, out)?;
                }
            }
            _ => {}
        }
    }
    Ok(())
}

// ---------------------------------------------------------------- the driver's graph pool

/// What the driver holds for graphs on `dev` (`cuDeviceGetGraphMemAttribute`).
fn graph_pool_reserved(dev: usize) -> Option<u64> {
    let p = real::aux(real::Aux::cuDeviceGetGraphMemAttribute);
    if p.is_null() {
        return None;
    }
    let mut v: u64 = 0;
    // SAFETY: `cuDeviceGetGraphMemAttribute(CUdevice, CUgraphMem_attribute, void*)`; the
    // attribute asked for is a `cuuint64_t`.
    let r = unsafe {
        std::mem::transmute::<
            *mut c_void,
            unsafe extern "C" fn(c_int, c_int, *mut c_void) -> CUresult,
        >(p)(
            dev as c_int,
            RESERVED_MEM_CURRENT,
            (&mut v as *mut u64).cast(),
        )
    };
    (r == CUDA_SUCCESS).then_some(v)
}

/// Brings `dev`'s retained charge to what the driver holds for graphs beyond the live
/// charges. True when the charge went down.
fn reconcile(dev: usize) -> bool {
    let Some(reserved) = graph_pool_reserved(dev) else {
        return false;
    };
    let delta = with_tracker(|t| {
        let charged: u64 = t
            .graphs
            .allocs
            .values()
            .filter(|a| a.dev == dev)
            .fold(0, |s, a| s.saturating_add(a.bytes));
        let target = reserved.saturating_sub(charged);
        let delta = target as i128 - t.graphs.retained[dev] as i128;
        t.graphs.retained[dev] = target;
        delta
    });
    super::pools::apply(dev, delta);
    delta < 0
}

/// Reconciles every device graphs have used (before an allocation is refused). True when
/// some charge went down, so a retry may fit.
pub(super) fn reconcile_all() -> bool {
    if !any() {
        return false;
    }
    let devices: Vec<usize> = with_tracker(|t| {
        (0..MAX_DEVICES)
            .filter(|&d| t.graphs.retained[d] > 0 || t.graphs.allocs.values().any(|a| a.dev == d))
            .collect()
    });
    devices.into_iter().fold(false, |any, d| reconcile(d) | any)
}

// ---------------------------------------------------------------- bookkeeping

/// Removes the records of `addrs` that nothing holds or maps any more, returning their charges
/// per device.
fn drop_unheld(t: &mut Tracker, addrs: &[u64]) -> Vec<(usize, u64)> {
    let mut freed = Vec::new();
    for d in addrs {
        if t.graphs
            .allocs
            .get(d)
            .is_some_and(|a| a.holders == 0 && !a.live)
            && let Some(a) = t.graphs.allocs.remove(d)
        {
            freed.push((a.dev, a.bytes));
        }
    }
    freed
}

/// Gives back `freed` charges and reconciles their devices (and `also`).
fn settle(freed: Vec<(usize, u64)>, also: &[usize]) {
    let region = region_with_watcher();
    let mut devices: Vec<usize> = also.to_vec();
    for (dev, bytes) in freed {
        region.release(dev, bytes);
        devices.push(dev);
    }
    devices.sort_unstable();
    devices.dedup();
    for dev in devices {
        reconcile(dev);
    }
}

/// An instantiation of `graph`: `call` performs it and writes the executable graph to
/// `exec_out`. Refused with `CUDA_ERROR_OUT_OF_MEMORY`, before the driver is called, when the
/// graph's new allocation addresses do not fit the limit of their device.
fn instantiate(
    graph: *mut c_void,
    exec_out: *mut u64,
    call: impl FnOnce() -> CUresult,
) -> CUresult {
    if degraded() || exec_out.is_null() || graph.is_null() {
        return call();
    }
    let Some(api) = graph_api() else {
        return call();
    };
    let _bookkeeping = BOOKKEEPING.lock();
    let mut mem = GraphMemory::default();
    let mut budget = MAX_NODES;
    if read_graph(&api, graph, 0, &mut budget, &mut mem).is_err() {
        log::info!(
            "a graph of more than {MAX_NODES} nodes cannot be checked for memory nodes; not \
             instantiated"
        );
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if mem.allocs.is_empty() && mem.frees.is_empty() {
        return call();
    }
    // New charges: addresses charged neither as pointers (a captured cuMemAllocAsync) nor for
    // another executable graph.
    let fresh: Vec<bool> = with_tracker(|t| {
        mem.allocs
            .iter()
            .map(|(d, ..)| !t.ptrs.contains_key(d) && !t.graphs.allocs.contains_key(d))
            .collect()
    });
    let mut per_device = [0u64; MAX_DEVICES];
    for (&(_, dev, bytes), _) in mem.allocs.iter().zip(&fresh).filter(|(_, f)| **f) {
        per_device[dev] = per_device[dev].saturating_add(bytes);
    }
    let region = region_with_watcher();
    let mut taken: Vec<(usize, u64)> = Vec::new();
    for (dev, &bytes) in per_device.iter().enumerate().filter(|(_, b)| **b > 0) {
        if reserve(region, dev, Kind::Ptr, bytes).is_err() {
            for &(d, b) in &taken {
                region.release(d, b);
            }
            log::info!(
                "device {dev}: OOM, a graph's memory nodes need {bytes} bytes, {} of {} in use; \
                 not instantiated",
                region.usage(dev),
                region.limit(dev)
            );
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        taken.push((dev, bytes));
    }
    let r = call();
    if r != CUDA_SUCCESS {
        for &(d, b) in &taken {
            region.release(d, b);
        }
        return r;
    }
    // SAFETY: written by the driver on success; checked non-null.
    let exec = unsafe { *exec_out };
    ANY.store(true, Ordering::Relaxed);
    let devices: Vec<usize> = taken.iter().map(|&(d, _)| d).collect();
    let stale = with_tracker(|t| {
        let mut exec_rec = Exec {
            held: Vec::new(),
            outlive: Vec::new(),
            frees_others: Vec::new(),
        };
        for (&(d, dev, bytes), &is_fresh) in mem.allocs.iter().zip(&fresh) {
            if !is_fresh && !t.graphs.allocs.contains_key(&d) {
                // Charged as a pointer: its charge follows the pointer.
                continue;
            }
            let a = t.graphs.allocs.entry(d).or_insert(Alloc {
                dev,
                bytes,
                holders: 0,
                live: false,
            });
            a.holders += 1;
            exec_rec.held.push(d);
            if !mem.frees.contains(&d) {
                exec_rec.outlive.push(d);
            }
        }
        exec_rec.frees_others = mem
            .frees
            .iter()
            .copied()
            .filter(|d| !mem.allocs.iter().any(|(a, ..)| a == d))
            .collect();
        // A handle the driver reuses replaces a record it no longer knows.
        t.graphs.execs.insert(exec, exec_rec).map(|old| {
            for d in &old.held {
                if let Some(a) = t.graphs.allocs.get_mut(d) {
                    a.holders = a.holders.saturating_sub(1);
                }
            }
            drop_unheld(t, &old.held)
        })
    });
    settle(stale.unwrap_or_default(), &devices);
    r
}

/// A successful launch of `exec`: its allocations that outlive the launch are mapped, and the
/// addresses its free nodes free elsewhere are not.
pub(super) fn launched(exec: u64) {
    if !with_tracker(|t| t.graphs.execs.contains_key(&exec)) {
        return;
    }
    let _bookkeeping = BOOKKEEPING.lock();
    let (freed, devices) = with_tracker(|t| {
        let Some(e) = t.graphs.execs.get(&exec) else {
            return (Vec::new(), Vec::new());
        };
        let (outlive, others) = (e.outlive.clone(), e.frees_others.clone());
        let mut devices = Vec::new();
        for d in outlive.iter().chain(&others) {
            if let Some(a) = t.graphs.allocs.get_mut(d) {
                a.live = outlive.contains(d);
                devices.push(a.dev);
            }
        }
        (drop_unheld(t, &others), devices)
    });
    settle(freed, &devices);
}

/// Whether `stream` is being captured into a graph: a stream-ordered allocation or free on it
/// is then a node of the graph being built, not memory, and is counted when the graph is
/// instantiated like any allocation node (charging it as a pointer at capture time made the
/// captured graph's memory follow the pointer, and the driver's graph cache went uncounted once
/// it was freed after a launch).
pub(super) fn capturing(stream: *mut c_void) -> bool {
    // CU_STREAM_LEGACY cannot be captured: no driver call for it. (The NULL stream can be the
    // per-thread stream, through the `_ptsz` entry points, which can.)
    if stream as usize == 1 {
        return false;
    }
    type IsCapturing = unsafe extern "C" fn(*mut c_void, *mut c_int) -> CUresult;
    let Some(is_capturing) = aux_fn::<IsCapturing>(real::Aux::cuStreamIsCapturing) else {
        return false;
    };
    let mut status: c_int = 0;
    // SAFETY: `cuStreamIsCapturing(CUstream, CUstreamCaptureStatus*)`.
    let r = unsafe { is_capturing(stream, &mut status) };
    r == CUDA_SUCCESS && status != 0
}

/// `dptr` was freed (`cuMemFree*`, `cuMemFreeAsync*`): if it is a graph allocation, it no
/// longer holds memory outside a launch.
pub(super) fn freed(dptr: u64) {
    if !any() || !with_tracker(|t| t.graphs.allocs.contains_key(&dptr)) {
        return;
    }
    let _bookkeeping = BOOKKEEPING.lock();
    let (freed, devices) = with_tracker(|t| {
        let Some(a) = t.graphs.allocs.get_mut(&dptr) else {
            return (Vec::new(), Vec::new());
        };
        a.live = false;
        let dev = a.dev;
        (drop_unheld(t, &[dptr]), vec![dev])
    });
    settle(freed, &devices);
}

/// `exec` was destroyed: it no longer holds its allocations.
fn destroyed(exec: u64) {
    if !any() || !with_tracker(|t| t.graphs.execs.contains_key(&exec)) {
        return;
    }
    let _bookkeeping = BOOKKEEPING.lock();
    let (freed, devices) = with_tracker(|t| {
        let Some(e) = t.graphs.execs.remove(&exec) else {
            return (Vec::new(), Vec::new());
        };
        let mut devices = Vec::new();
        for d in &e.held {
            if let Some(a) = t.graphs.allocs.get_mut(d) {
                a.holders = a.holders.saturating_sub(1);
                devices.push(a.dev);
            }
        }
        (drop_unheld(t, &e.held), devices)
    });
    settle(freed, &devices);
}

// ---------------------------------------------------------------- the hooks

type InstantiateLegacy =
    unsafe extern "C" fn(*mut u64, *mut c_void, *mut *mut c_void, *mut c_char, usize) -> CUresult;

/// `cuGraphInstantiate` (CUDA 10) and `cuGraphInstantiate_v2` (11.0): error node and log
/// buffer. CUDA 12's headers map `cuGraphInstantiate` to `cuGraphInstantiateWithFlags`.
macro_rules! instantiate_legacy_hook {
    ($name:ident) => {
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            exec: *mut u64,
            graph: *mut c_void,
            error_node: *mut *mut c_void,
            log_buffer: *mut c_char,
            buffer_size: usize,
        ) -> CUresult {
            guarded(stringify!($name), CUDA_ERROR_UNKNOWN, || {
                instantiate(graph, exec, || {
                    real_call!($name: InstantiateLegacy, exec, graph, error_node, log_buffer, buffer_size)
                })
            })
        }
    };
}
instantiate_legacy_hook!(cuGraphInstantiate);
instantiate_legacy_hook!(cuGraphInstantiate_v2);

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphInstantiateWithFlags(
    exec: *mut u64,
    graph: *mut c_void,
    flags: u64,
) -> CUresult {
    guarded("cuGraphInstantiateWithFlags", CUDA_ERROR_UNKNOWN, || {
        instantiate(graph, exec, || {
            real_call!(
                cuGraphInstantiateWithFlags: unsafe extern "C" fn(*mut u64, *mut c_void, u64) -> CUresult,
                exec, graph, flags
            )
        })
    })
}

/// `cuGraphInstantiateWithParams` (CUDA 12.0; per-thread variant: the upload stream in the
/// parameters). A refusal is the call's result; `result_out` in the parameters is the driver's
/// to write and stays as the caller left it.
macro_rules! instantiate_with_params_hook {
    ($name:ident) => {
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            exec: *mut u64,
            graph: *mut c_void,
            params: *mut c_void,
        ) -> CUresult {
            guarded(stringify!($name), CUDA_ERROR_UNKNOWN, || {
                instantiate(graph, exec, || {
                    real_call!(
                        $name: unsafe extern "C" fn(*mut u64, *mut c_void, *mut c_void) -> CUresult,
                        exec, graph, params
                    )
                })
            })
        }
    };
}
instantiate_with_params_hook!(cuGraphInstantiateWithParams);
instantiate_with_params_hook!(cuGraphInstantiateWithParams_ptsz);

#[unsafe(no_mangle)]
pub extern "C" fn cuGraphExecDestroy(exec: *mut c_void) -> CUresult {
    guarded("cuGraphExecDestroy", CUDA_ERROR_UNKNOWN, || {
        let r = real_call!(cuGraphExecDestroy: unsafe extern "C" fn(*mut c_void) -> CUresult, exec);
        if r == CUDA_SUCCESS && !degraded() {
            destroyed(exec as u64);
        }
        r
    })
}

/// Trimming gives cached graph memory back to the device: the retained charge follows.
#[unsafe(no_mangle)]
pub extern "C" fn cuDeviceGraphMemTrim(device: c_int) -> CUresult {
    guarded("cuDeviceGraphMemTrim", CUDA_ERROR_UNKNOWN, || {
        let r = real_call!(cuDeviceGraphMemTrim: unsafe extern "C" fn(c_int) -> CUresult, device);
        if r == CUDA_SUCCESS
            && !degraded()
            && any()
            && let Some(dev) = usize::try_from(device).ok().filter(|&d| d < MAX_DEVICES)
        {
            reconcile(dev);
        }
        r
    })
}

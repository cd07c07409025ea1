//! Every kernel launch path held to the container's SM limit: `cuLaunchKernel(Ex)`, the
//! cooperative launches, graph launches and the legacy `cuLaunch`, `cuLaunchGrid(Async)`.

use super::*;

macro_rules! launch_hook {
    ($name:ident) => {
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            f: *mut c_void,
            gx: c_uint,
            gy: c_uint,
            gz: c_uint,
            bx: c_uint,
            by: c_uint,
            bz: c_uint,
            shared: c_uint,
            stream: Stream,
            params: *mut *mut c_void,
            extra: *mut *mut c_void,
        ) -> CUresult {
            limiter::before_launch(gx as u64 * gy.max(1) as u64 * gz.max(1) as u64);
            real_call!(
                $name: unsafe extern "C" fn(*mut c_void, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, Stream, *mut *mut c_void, *mut *mut c_void) -> CUresult,
                f, gx, gy, gz, bx, by, bz, shared, stream, params, extra
            )
        }
    };
}
launch_hook!(cuLaunchKernel);
launch_hook!(cuLaunchKernel_ptsz);

macro_rules! cooperative_hook {
    ($name:ident) => {
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            f: *mut c_void,
            gx: c_uint,
            gy: c_uint,
            gz: c_uint,
            bx: c_uint,
            by: c_uint,
            bz: c_uint,
            shared: c_uint,
            stream: Stream,
            params: *mut *mut c_void,
        ) -> CUresult {
            limiter::before_launch(gx as u64 * gy.max(1) as u64 * gz.max(1) as u64);
            real_call!(
                $name: unsafe extern "C" fn(*mut c_void, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, Stream, *mut *mut c_void) -> CUresult,
                f, gx, gy, gz, bx, by, bz, shared, stream, params
            )
        }
    };
}
cooperative_hook!(cuLaunchCooperativeKernel);
cooperative_hook!(cuLaunchCooperativeKernel_ptsz);

/// The head of `CUlaunchConfig` (grid dimensions first).
#[repr(C)]
pub struct LaunchConfigHead {
    pub grid_dim_x: c_uint,
    pub grid_dim_y: c_uint,
    pub grid_dim_z: c_uint,
}

macro_rules! launch_ex_hook {
    ($name:ident) => {
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            config: *const LaunchConfigHead,
            f: *mut c_void,
            params: *mut *mut c_void,
            extra: *mut *mut c_void,
        ) -> CUresult {
            if !config.is_null() {
                // SAFETY: checked non-null; the caller's config starts with the grid.
                let c = unsafe { &*config };
                limiter::before_launch(c.grid_dim_x as u64 * c.grid_dim_y.max(1) as u64 * c.grid_dim_z.max(1) as u64);
            }
            real_call!(
                $name: unsafe extern "C" fn(*const LaunchConfigHead, *mut c_void, *mut *mut c_void, *mut *mut c_void) -> CUresult,
                config, f, params, extra
            )
        }
    };
}
launch_ex_hook!(cuLaunchKernelEx);
launch_ex_hook!(cuLaunchKernelEx_ptsz);

/// Graph launches are limited too (HAMi-core let them bypass the limit); a graph counts as one
/// full-device wave, and the feedback loop corrects the estimate. A graph with memory nodes
/// also updates what its allocations hold (`graphs.rs`).
macro_rules! graph_hook {
    ($name:ident) => {
        #[unsafe(no_mangle)]
        pub extern "C" fn $name(exec: *mut c_void, stream: Stream) -> CUresult {
            limiter::before_launch(limiter::GRAPH_BLOCKS);
            let r = real_call!($name: unsafe extern "C" fn(*mut c_void, Stream) -> CUresult, exec, stream);
            if r == CUDA_SUCCESS && graphs::any() && !degraded() {
                guarded(stringify!($name), (), || graphs::launched(exec as u64));
            }
            r
        }
    };
}
graph_hook!(cuGraphLaunch);
graph_hook!(cuGraphLaunch_ptsz);

// The pre-4.0 launch API (deprecated, still exported by CUDA 12 and 13 drivers): the block
// shape, parameters and shared memory were set beforehand (`cuFuncSetBlockShape`,
// `cuParamSet*`), the grid is two `int`s. A negative dimension is refused by the driver; it is
// charged as 0 blocks (the pacer charges every launch at least one).

/// Blocks of a pre-4.0 grid.
fn legacy_grid_blocks(width: c_int, height: c_int) -> u64 {
    width.max(0) as u64 * height.max(1) as u64
}

/// `cuLaunch`: a 1 × 1 grid.
#[unsafe(no_mangle)]
pub extern "C" fn cuLaunch(f: *mut c_void) -> CUresult {
    limiter::before_launch(1);
    real_call!(cuLaunch: unsafe extern "C" fn(*mut c_void) -> CUresult, f)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuLaunchGrid(f: *mut c_void, grid_width: c_int, grid_height: c_int) -> CUresult {
    limiter::before_launch(legacy_grid_blocks(grid_width, grid_height));
    real_call!(
        cuLaunchGrid: unsafe extern "C" fn(*mut c_void, c_int, c_int) -> CUresult,
        f, grid_width, grid_height
    )
}

#[unsafe(no_mangle)]
pub extern "C" fn cuLaunchGridAsync(
    f: *mut c_void,
    grid_width: c_int,
    grid_height: c_int,
    stream: Stream,
) -> CUresult {
    limiter::before_launch(legacy_grid_blocks(grid_width, grid_height));
    real_call!(
        cuLaunchGridAsync: unsafe extern "C" fn(*mut c_void, c_int, c_int, Stream) -> CUresult,
        f, grid_width, grid_height, stream
    )
}

/// `CUDA_LAUNCH_PARAMS`.
#[repr(C)]
pub struct LaunchParams {
    pub function: *mut c_void,
    pub grid_dim_x: c_uint,
    pub grid_dim_y: c_uint,
    pub grid_dim_z: c_uint,
    pub block_dim_x: c_uint,
    pub block_dim_y: c_uint,
    pub block_dim_z: c_uint,
    pub shared_mem_bytes: c_uint,
    pub h_stream: Stream,
    pub kernel_params: *mut *mut c_void,
}

/// One cooperative kernel per device (deprecated since CUDA 11.3, still exported): each entry
/// is paced on the device of its own stream, so a launch on another device than the current
/// context's is charged where it runs. A driver takes at most one entry per device; entries
/// past the region's device count cannot be charged anywhere and are not read.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchCooperativeKernelMultiDevice(
    launch_params_list: *mut LaunchParams,
    num_devices: c_uint,
    flags: c_uint,
) -> CUresult {
    if !launch_params_list.is_null() {
        guarded("cuLaunchCooperativeKernelMultiDevice", (), || {
            for i in 0..(num_devices as usize).min(vgpu_region::MAX_DEVICES) {
                // SAFETY: the caller's array of `num_devices` entries (the driver reads it too).
                let p = unsafe { &*launch_params_list.add(i) };
                let blocks =
                    p.grid_dim_x as u64 * p.grid_dim_y.max(1) as u64 * p.grid_dim_z.max(1) as u64;
                let stream = p.h_stream;
                limiter::before_launch_on(|| real::stream_device(stream), blocks);
            }
        });
    }
    real_call!(
        cuLaunchCooperativeKernelMultiDevice: unsafe extern "C" fn(*mut LaunchParams, c_uint, c_uint) -> CUresult,
        launch_params_list, num_devices, flags
    )
}

//! `libvgpu.so`: a drop-in for HAMi-core. Preloaded into GPU containers (`/etc/ld.so.preload`
//! or `LD_PRELOAD`), it enforces `CUDA_DEVICE_MEMORY_LIMIT` and `CUDA_DEVICE_SM_LIMIT` at the
//! CUDA driver API, accounts memory container-wide in HAMi-core's shared-region file, and
//! virtualises the memory totals seen through CUDA and NVML.
//!
//! The driver libraries are never linked: they are `dlopen`ed on first use. The only exported
//! symbols are the hooks in [`hooks`] (pinned by a test with `nm -D`).
// Daemon and library code returns errors; only tests may unwrap (clippy.toml allows it there).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]
#![allow(non_snake_case, clippy::missing_safety_doc)]

mod config;
mod hooks;
mod limiter;
mod log;
#[cfg(any(target_env = "musl", test))]
mod musl_dlsym;
mod nvml_api;
mod real;
mod region;
mod visible;
mod watcher;

// `pthread_atfork` handlers (fork safety): prepare takes the shim's locks in one order (region
// attach, region mutex, allocation tracker), so no child inherits one held by a thread that does
// not exist in it; the parent releases them; the child releases them, forgets the parent's slot
// and allocations (it registers its own slot on first use) and has no watcher thread until its
// first hook that uses the region starts one. None of them can unwind: every body is under
// `catch_unwind`.
extern "C" fn atfork_prepare() {
    let _ = std::panic::catch_unwind(|| {
        region::fork_prepare();
        hooks::fork_prepare();
    });
}

extern "C" fn atfork_parent() {
    let _ = std::panic::catch_unwind(|| {
        hooks::fork_parent();
        region::fork_parent();
    });
}

extern "C" fn atfork_child() {
    let _ = std::panic::catch_unwind(|| {
        hooks::fork_child();
        region::after_fork_in_child();
        watcher::after_fork_in_child();
    });
}

/// Load-time constructor: find the real `dlsym` (so `dlsym(RTLD_NEXT, …)` can be forwarded with
/// the caller's return address from the very first call) and register fork/exit handlers.
/// Nothing here reads the environment, allocates much or touches the driver.
extern "C" fn on_load() {
    let _ = std::panic::catch_unwind(|| {
        real::init_real_dlsym();
        // SAFETY: registering plain extern "C" handlers.
        unsafe {
            libc::pthread_atfork(
                Some(atfork_prepare),
                Some(atfork_parent),
                Some(atfork_child),
            );
            libc::atexit(region::on_exit);
        }
    });
}

#[used]
#[unsafe(link_section = ".init_array")]
static ON_LOAD: extern "C" fn() = on_load;

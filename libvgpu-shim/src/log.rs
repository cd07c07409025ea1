//! Minimal stderr logging with HAMi-core's levels (`LIBCUDA_LOG_LEVEL`, default 2: errors and
//! warnings). The level is read once; messages are written with one `write(2)` each.

use std::sync::atomic::{AtomicI32, Ordering};

static LEVEL: AtomicI32 = AtomicI32::new(-1);

pub const ERROR: i32 = 0;
pub const WARN: i32 = 2;
pub const INFO: i32 = 3;

pub fn level() -> i32 {
    let l = LEVEL.load(Ordering::Relaxed);
    if l >= 0 {
        return l;
    }
    let l = std::env::var(vgpu_region::protocol::env::LOG_LEVEL)
        .ok()
        .map_or(2, |v| crate::config::atoi(&v).max(0));
    LEVEL.store(l, Ordering::Relaxed);
    l
}

pub fn write(lvl: i32, msg: &str) {
    if lvl > ERROR && lvl > level() {
        return;
    }
    let name = match lvl {
        ERROR => "Error",
        WARN => "Warn",
        INFO => "Info",
        _ => "Debug",
    };
    let line = format!("[Tessera vgpu {name}(pid:{})]: {msg}\n", std::process::id());
    // SAFETY: writing a valid buffer to fd 2; a short or failed write is ignored on purpose.
    unsafe { libc::write(2, line.as_ptr().cast(), line.len()) };
}

macro_rules! warning {
    ($($t:tt)*) => { $crate::log::write($crate::log::WARN, &format!($($t)*)) };
}
macro_rules! info {
    ($($t:tt)*) => { $crate::log::write($crate::log::INFO, &format!($($t)*)) };
}
macro_rules! error {
    ($($t:tt)*) => { $crate::log::write($crate::log::ERROR, &format!($($t)*)) };
}
pub(crate) use {error, info, warning};

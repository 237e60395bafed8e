//! stderr lines prefixed `gpupool-vgpu:`, filtered by `LIBCUDA_LOG_LEVEL` (errors always print).
//!
//! Each line is built first and written with one `write(2)`, so lines from several threads or
//! processes sharing a terminal do not interleave mid-line. No buffering, no lock: a line is lost
//! rather than the host program blocked if stderr is a full pipe (the write is not retried).

use crate::env::LogLevel;
use std::sync::atomic::{AtomicU8, Ordering};

static LEVEL: AtomicU8 = AtomicU8::new(LogLevel::Warn as u8);

pub fn set_level(level: LogLevel) {
    LEVEL.store(level as u8, Ordering::Relaxed);
}

pub fn enabled(level: LogLevel) -> bool {
    level == LogLevel::Error || level as u8 <= LEVEL.load(Ordering::Relaxed)
}

pub fn write(level: LogLevel, message: &str) {
    if !enabled(level) {
        return;
    }
    let tag = match level {
        LogLevel::Error => "error",
        LogLevel::Warn => "warning",
        LogLevel::Info => "info",
        LogLevel::Debug => "debug",
    };
    let line = format!("gpupool-vgpu: {tag}: {message}\n");
    // SAFETY: writes a buffer we own to fd 2; the result is ignored on purpose (see module docs).
    unsafe {
        libc::write(2, line.as_ptr().cast(), line.len());
    }
}

macro_rules! log_error {
    ($($arg:tt)*) => { $crate::log::write($crate::env::LogLevel::Error, &format!($($arg)*)) };
}
macro_rules! log_warn {
    ($($arg:tt)*) => { $crate::log::write($crate::env::LogLevel::Warn, &format!($($arg)*)) };
}
macro_rules! log_info {
    ($($arg:tt)*) => {
        if $crate::log::enabled($crate::env::LogLevel::Info) {
            $crate::log::write($crate::env::LogLevel::Info, &format!($($arg)*))
        }
    };
}
macro_rules! log_debug {
    ($($arg:tt)*) => {
        if $crate::log::enabled($crate::env::LogLevel::Debug) {
            $crate::log::write($crate::env::LogLevel::Debug, &format!($($arg)*))
        }
    };
}

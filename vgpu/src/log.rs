//! stderr lines prefixed `gpupool-vgpu:`, filtered by `LIBCUDA_LOG_LEVEL` (errors always print).
//!
//! Each line is built first and written with one `write(2)`, so lines from several threads or
//! processes sharing a terminal do not interleave mid-line. No buffering, no lock, and never a
//! blocking write: a line is lost rather than the host program blocked when stderr is a pipe
//! nobody reads (the library logs from its launch path, where a blocked thread would hold up
//! every other thread of the program, and the card for the other containers). A pipe or FIFO is
//! written through a descriptor of its own opened non-blocking (the program's own descriptor's
//! flags are left alone: they are shared with whoever else holds it); anything else only when
//! `poll(2)` says it takes the line now (a regular file always does).

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
    let mut line = format!("gpupool-vgpu: {tag}: {message}\n");
    // A line no longer than PIPE_BUF is written whole or not at all.
    if line.len() > libc::PIPE_BUF {
        let mut end = libc::PIPE_BUF - 1;
        while !line.is_char_boundary(end) {
            end -= 1;
        }
        line.truncate(end);
        line.push('\n');
    }
    write_without_blocking(line.as_bytes());
}

/// Writes `bytes` to stderr if it can be done without blocking; the result is ignored on purpose
/// (see the module's docs).
fn write_without_blocking(bytes: &[u8]) {
    // SAFETY: fstat into a zeroed stat we own; open/poll/write/close on descriptors we own or on
    // fd 2, with buffers we own.
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        if libc::fstat(2, &mut st) != 0 {
            return;
        }
        if st.st_mode & libc::S_IFMT == libc::S_IFIFO {
            let path = c"/proc/self/fd/2";
            let fd = libc::open(
                path.as_ptr(),
                libc::O_WRONLY | libc::O_NONBLOCK | libc::O_CLOEXEC,
            );
            if fd >= 0 {
                libc::write(fd, bytes.as_ptr().cast(), bytes.len());
                libc::close(fd);
                return;
            }
        }
        let mut ready = libc::pollfd {
            fd: 2,
            events: libc::POLLOUT,
            revents: 0,
        };
        if libc::poll(&mut ready, 1, 0) == 1 && ready.revents & libc::POLLOUT != 0 {
            libc::write(2, bytes.as_ptr().cast(), bytes.len());
        }
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

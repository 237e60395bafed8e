//! The few system calls the shared state needs: open-file-description locks (dropped by the kernel
//! when the last descriptor of a dead process closes, so no lock outlives its holder), futexes on the
//! shared mapping, and the wall clock NVML timestamps use.

use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::AtomicU32;
use std::time::Duration;

fn flock(kind: libc::c_short, offset: u64) -> libc::flock {
    // SAFETY: flock is plain old data; all-zero is a valid value (and l_pid must be 0 for OFD locks).
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = offset as libc::off_t;
    fl.l_len = 1;
    fl
}

/// Takes a write lock on one byte, waiting for it.
pub fn lock_wait(fd: RawFd, offset: u64) -> io::Result<()> {
    let fl = flock(libc::F_WRLCK as libc::c_short, offset);
    loop {
        // SAFETY: fd is open; fl is a valid flock.
        if unsafe { libc::fcntl(fd, libc::F_OFD_SETLKW, &fl) } == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
}

/// Takes a write lock on one byte if no other open file description holds it.
pub fn lock_try(fd: RawFd, offset: u64) -> io::Result<bool> {
    let fl = flock(libc::F_WRLCK as libc::c_short, offset);
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_OFD_SETLK, &fl) } == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EAGAIN) | Some(libc::EACCES) => Ok(false),
        _ => Err(e),
    }
}

pub fn unlock(fd: RawFd, offset: u64) {
    let fl = flock(libc::F_UNLCK as libc::c_short, offset);
    // SAFETY: as above; unlocking a byte we do not hold is harmless.
    unsafe { libc::fcntl(fd, libc::F_OFD_SETLK, &fl) };
}

/// Whether another open file description holds a lock on the byte (ours never conflict with us).
pub fn lock_held_elsewhere(fd: RawFd, offset: u64) -> io::Result<bool> {
    let mut fl = flock(libc::F_WRLCK as libc::c_short, offset);
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_OFD_GETLK, &mut fl) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fl.l_type != libc::F_UNLCK as libc::c_short)
}

/// Sleeps while `*word == expected`, at most `timeout` (a shared futex: works across processes that
/// map the same file).
pub fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: word is a valid, aligned u32 in a shared mapping; ts outlives the call.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        )
    };
}

pub fn futex_wake_all(word: &AtomicU32) {
    // SAFETY: as above.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX) };
}

/// Nanoseconds since the Unix epoch (NVML's sample timestamps are microseconds since the epoch).
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid out-parameter.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Sleeps until the wall clock reaches `deadline_ns` (a kernel's timed busy work: the "GPU" is busy,
/// the CPU is not).
pub fn sleep_until(deadline_ns: u64) {
    loop {
        let now = now_ns();
        if now >= deadline_ns {
            return;
        }
        std::thread::sleep(Duration::from_nanos(deadline_ns - now));
    }
}

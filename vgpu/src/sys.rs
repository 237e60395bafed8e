//! The system calls under the library's shared files: a file mapped `MAP_SHARED` by several
//! processes, open-file-description locks on its byte ranges, futexes on its words, the clock.
//!
//! No process-shared mutex or semaphore is ever used: one held by a process that was killed stays
//! held. An OFD lock (`F_OFD_SETLK`) is dropped by the kernel when the last descriptor of its
//! description closes, that is when the process dies, whatever PID namespace it runs in. OFD
//! locks of one description never conflict with each other, so threads of one process are
//! serialised by a mutex in front of them, and a process never judges its own locks.

use std::ffi::CString;
use std::sync::atomic::AtomicU32;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// CLOCK_MONOTONIC in nanoseconds: one clock for every process on the host (shared files'
/// timestamps are compared across processes and containers).
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec we pass; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

pub fn errno_text(errno: i32) -> String {
    std::io::Error::from_raw_os_error(errno).to_string()
}

pub fn last_errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// One OFD lock command on `len` bytes at `start`.
pub fn ofd_lock(
    fd: libc::c_int,
    cmd: libc::c_int,
    kind: libc::c_int,
    start: u64,
    len: u64,
) -> Result<libc::flock, i32> {
    // SAFETY: an all-zero flock is valid; l_pid must be 0 for OFD locks.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = start as libc::off_t;
    fl.l_len = len as libc::off_t;
    // SAFETY: fcntl with an OFD lock command reads and (for GETLK) writes the flock we own.
    let rc = unsafe { libc::fcntl(fd, cmd, &mut fl) };
    if rc == 0 {
        Ok(fl)
    } else {
        Err(last_errno())
    }
}

/// Whether another open file description holds a lock on the range: its owner is alive. (Our
/// own description's locks never conflict, so a process must not ask this of its own range.)
pub fn held_elsewhere(fd: libc::c_int, start: u64, len: u64) -> bool {
    !matches!(
        ofd_lock(fd, libc::F_OFD_GETLK, libc::F_WRLCK, start, len),
        Ok(fl) if fl.l_type == libc::F_UNLCK as libc::c_short
    )
}

/// Takes the write lock on a range for life (a slot's liveness lock). False if someone holds it.
pub fn try_lock(fd: libc::c_int, start: u64, len: u64) -> bool {
    ofd_lock(fd, libc::F_OFD_SETLK, libc::F_WRLCK, start, len).is_ok()
}

pub fn unlock(fd: libc::c_int, start: u64, len: u64) {
    let _ = ofd_lock(fd, libc::F_OFD_SETLK, libc::F_UNLCK, start, len);
}

/// Why a range could not be locked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockFailure {
    /// Not free within the timeout: its holder is stopped (SIGSTOP, a debugger) or very slow.
    Timeout,
    /// fcntl failed (the errno).
    Errno(i32),
}

/// A range locked by [`lock_range`]: the process's mutex and the OFD lock, until dropped.
pub struct RangeGuard<'a> {
    fd: libc::c_int,
    start: u64,
    len: u64,
    _mutex: MutexGuard<'a, ()>,
}

impl Drop for RangeGuard<'_> {
    fn drop(&mut self) {
        unlock(self.fd, self.start, self.len);
    }
}

/// Takes a range's write lock, waiting at most `timeout` in all: for this process's `mutex` and
/// for the OFD lock together. (Waiting on the mutex without bound would queue threads behind one
/// that waits for a stopped process: the n-th would wait n times the timeout.)
pub fn lock_range<'a>(
    fd: libc::c_int,
    mutex: &'a Mutex<()>,
    start: u64,
    len: u64,
    timeout: Duration,
) -> Result<RangeGuard<'a>, LockFailure> {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_micros(20);
    let mutex = loop {
        match mutex.try_lock() {
            Ok(guard) => break guard,
            Err(std::sync::TryLockError::Poisoned(poisoned)) => break poisoned.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) if Instant::now() < deadline => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(1));
            }
            Err(std::sync::TryLockError::WouldBlock) => return Err(LockFailure::Timeout),
        }
    };
    let mut pause = Duration::from_micros(20);
    loop {
        match ofd_lock(fd, libc::F_OFD_SETLK, libc::F_WRLCK, start, len) {
            Ok(_) => {
                return Ok(RangeGuard {
                    fd,
                    start,
                    len,
                    _mutex: mutex,
                })
            }
            Err(libc::EAGAIN | libc::EACCES | libc::EINTR) if Instant::now() < deadline => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(1));
            }
            Err(libc::EAGAIN | libc::EACCES | libc::EINTR) => return Err(LockFailure::Timeout),
            Err(errno) => return Err(LockFailure::Errno(errno)),
        }
    }
}

/// Sleeps while `word` holds `expected`, at most `timeout` (a shared futex: the word may live in
/// a file mapped by other processes). Spurious wake-ups are the caller's to handle.
pub fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: FUTEX_WAIT on a valid, aligned u32 with a relative timeout we own.
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

/// Wakes every waiter on `word`, in any process that maps it.
pub fn futex_wake_all(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a valid, aligned u32.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX) };
}

/// Why a shared file could not be made usable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MapError {
    /// open(2) failed, after creating the folder if it was missing.
    Open { path: String, errno: i32 },
    /// fstat, ftruncate or mmap failed.
    Map { path: String, errno: i32 },
    /// The lock that serialises growing the file was not free in time.
    Lock { path: String, failure: LockFailure },
}

impl std::fmt::Display for MapError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MapError::Open { path, errno } => write!(
                f,
                "cannot open or create the shared file {path}: {}",
                errno_text(*errno)
            ),
            MapError::Map { path, errno } => write!(
                f,
                "cannot size or map the shared file {path}: {}",
                errno_text(*errno)
            ),
            MapError::Lock {
                path,
                failure: LockFailure::Timeout,
            } => write!(
                f,
                "a lock of {path} was not free in time (its holder is stopped?)"
            ),
            MapError::Lock {
                path,
                failure: LockFailure::Errno(errno),
            } => write!(f, "cannot lock {path}: {}", errno_text(*errno)),
        }
    }
}

/// The descriptors of the library's shared files in this process. A child forked while another
/// thread was still opening them (its state not yet published) would otherwise keep them open,
/// and with them the parent's OFD locks: its slots would look alive after the parent died. The
/// child closes every one of them ([`close_owned_after_fork`]).
static OWNED_FDS: [std::sync::atomic::AtomicI32; 64] =
    [const { std::sync::atomic::AtomicI32::new(-1) }; 64];

fn own_fd(fd: libc::c_int) {
    use std::sync::atomic::Ordering;
    for slot in &OWNED_FDS {
        if slot
            .compare_exchange(-1, fd, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            return;
        }
    }
}

fn disown_fd(fd: libc::c_int) {
    use std::sync::atomic::Ordering;
    for slot in &OWNED_FDS {
        if slot
            .compare_exchange(fd, -1, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            return;
        }
    }
}

/// Threads between open(2) of a shared file and its registration: a fork then would give the
/// child a descriptor nobody knows of. The fork waits for them ([`before_fork`]).
static OPENING: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// In the parent, just before a fork (the atfork prepare handler): waits while another thread is
/// between opening a shared file and registering it (a system call and a compare-and-swap), at
/// most 100 ms (an open(2) that hangs, on a stuck network file system, must not hang the fork).
pub fn before_fork() {
    let deadline = now_ns() + 100_000_000;
    while OPENING.load(std::sync::atomic::Ordering::Acquire) > 0 && now_ns() < deadline {
        std::hint::spin_loop();
    }
}

/// In a forked child (async-signal-safe: atomics and close(2)): closes the parent's descriptors
/// of the library's shared files. The child opens its own on first use.
pub fn close_owned_after_fork() {
    use std::sync::atomic::Ordering;
    for slot in &OWNED_FDS {
        let fd = slot.swap(-1, Ordering::AcqRel);
        if fd >= 0 {
            // SAFETY: a descriptor the library opened in the parent; nothing in the child uses it.
            unsafe { libc::close(fd) };
        }
    }
}

/// A file every process that uses it maps `MAP_SHARED`, `len` bytes from its start.
pub struct MappedFile {
    path: String,
    fd: libc::c_int,
    base: *mut u8,
    len: usize,
}

// SAFETY: the mapping is only accessed through atomics or under locks; the fd and the pointer are
// plain values valid for the life of the MappedFile.
unsafe impl Send for MappedFile {}
unsafe impl Sync for MappedFile {}

impl MappedFile {
    /// Opens the file (creating it, and its folder, if `create`), grows it to `len` under the
    /// range lock `grow_lock` (two first processes must not race; it is never shrunk: another
    /// process's mapping past a new end would fault), and maps it. The file is made `0666`:
    /// processes of one container, and containers of one card, may run as different users.
    pub fn open(
        path: &str,
        len: usize,
        create: bool,
        grow_lock: (u64, u64),
        lock_timeout: Duration,
    ) -> Result<MappedFile, MapError> {
        let c_path = CString::new(path).map_err(|_| MapError::Open {
            path: path.into(),
            errno: libc::EINVAL,
        })?;
        let flags = libc::O_RDWR | libc::O_CLOEXEC | if create { libc::O_CREAT } else { 0 };
        // SAFETY: a valid C string; O_CLOEXEC so that an exec'd program does not keep our
        // description (and with it our locks) alive.
        // Opened and registered with no fork in between (see `before_fork`).
        let open = || {
            OPENING.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            let fd = unsafe { libc::open(c_path.as_ptr(), flags, 0o666) };
            let errno = last_errno();
            if fd >= 0 {
                own_fd(fd);
            }
            OPENING.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
            (fd, errno)
        };
        let (mut fd, mut errno) = open();
        if fd < 0 && create && errno == libc::ENOENT {
            if let Some(parent) = std::path::Path::new(path).parent() {
                let _ = std::fs::create_dir_all(parent);
            }
            (fd, errno) = open();
        }
        if fd < 0 {
            return Err(MapError::Open {
                path: path.into(),
                errno,
            });
        }
        // Failing (not the owner) is fine: the owner made it so.
        // SAFETY: fd is ours.
        unsafe { libc::fchmod(fd, 0o666) };
        let mut file = MappedFile {
            path: path.to_string(),
            fd,
            base: std::ptr::null_mut(),
            len,
        };
        {
            let mutex = Mutex::new(());
            let _guard = lock_range(fd, &mutex, grow_lock.0, grow_lock.1, lock_timeout).map_err(
                |failure| MapError::Lock {
                    path: path.into(),
                    failure,
                },
            )?;
            // SAFETY: fstat into a zeroed stat we own.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            if unsafe { libc::fstat(fd, &mut st) } != 0 {
                return Err(file.map_error());
            }
            if (st.st_size as u64) < len as u64
                && unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0
            {
                return Err(file.map_error());
            }
        }
        // SAFETY: maps len bytes of our fd, shared; checked for MAP_FAILED below.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(file.map_error());
        }
        file.base = base.cast();
        Ok(file)
    }

    fn map_error(&self) -> MapError {
        MapError::Map {
            path: self.path.clone(),
            errno: last_errno(),
        }
    }

    pub fn path(&self) -> &str {
        &self.path
    }

    pub fn fd(&self) -> libc::c_int {
        self.fd
    }

    pub fn base(&self) -> *mut u8 {
        self.base
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The file's device and inode: what identifies it across the mount namespaces of containers
    /// that bind-mount it (paths differ, the inode does not).
    pub fn identity(&self) -> Option<(u64, u64)> {
        // SAFETY: fstat into a zeroed stat we own.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        (unsafe { libc::fstat(self.fd, &mut st) } == 0).then_some((st.st_dev, st.st_ino))
    }
}

impl Drop for MappedFile {
    fn drop(&mut self) {
        // SAFETY: unmaps what open() mapped and closes our fd (which drops our OFD locks: this is
        // how a unit test's "process" dies).
        unsafe {
            if !self.base.is_null() {
                libc::munmap(self.base.cast(), self.len);
            }
            disown_fd(self.fd);
            libc::close(self.fd);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn is_open(fd: libc::c_int) -> bool {
        // SAFETY: F_GETFD on any number only reads the descriptor table.
        unsafe { libc::fcntl(fd, libc::F_GETFD) != -1 }
    }

    /// A shared file opened in this process (published in the process state or not yet, as when
    /// another thread is still initialising) is closed in a forked child, so the child keeps no
    /// OFD lock of the parent's alive; the parent keeps it.
    #[test]
    fn a_forked_child_closes_the_shared_files_it_inherited() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shared").to_str().unwrap().to_string();
        let file =
            MappedFile::open(&path, 4096, true, (1 << 40, 1), Duration::from_secs(1)).unwrap();
        let fd = file.fd();
        // SAFETY: the child only makes async-signal-safe calls (close, fcntl, _exit).
        match unsafe { libc::fork() } {
            0 => {
                close_owned_after_fork();
                let code = if is_open(fd) { 1 } else { 0 };
                unsafe { libc::_exit(code) }
            }
            pid => {
                let mut status = 0;
                // SAFETY: waits for our own child.
                assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
                assert!(libc::WIFEXITED(status));
                assert_eq!(libc::WEXITSTATUS(status), 0, "the child kept the file open");
            }
        }
        assert!(is_open(fd), "the parent lost its file");
    }
}

//! Cleanup at process exit for clusters kept in statics (one cluster shared by a test file's tests),
//! which are never dropped.

use std::path::PathBuf;
use std::sync::{Mutex, Once};

static DIRS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
static PIDS: Mutex<Vec<u32>> = Mutex::new(Vec::new());
static HOOK: Once = Once::new();

extern "C" fn at_exit() {
    if let Ok(pids) = PIDS.lock() {
        for pid in pids.iter() {
            // SAFETY: kill(2) on a pid this process spawned.
            unsafe {
                libc::kill(*pid as libc::pid_t, libc::SIGKILL);
            }
        }
    }
    if let Ok(dirs) = DIRS.lock() {
        for dir in dirs.iter() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

fn install() {
    HOOK.call_once(|| {
        // SAFETY: registers a plain extern "C" function with no captured state.
        unsafe {
            libc::atexit(at_exit);
        }
    });
}

/// Remove `dir` when the process exits, even if its owner was never dropped.
pub fn remove_at_exit(dir: PathBuf) {
    install();
    DIRS.lock().unwrap().push(dir);
}

/// Kill `pid` when the process exits, even if its owner was never dropped.
pub fn kill_at_exit(pid: u32) {
    install();
    PIDS.lock().unwrap().push(pid);
}

/// Forget a pid that has been reaped, so a recycled pid is never killed.
pub fn forget_pid(pid: u32) {
    PIDS.lock().unwrap().retain(|p| *p != pid);
}

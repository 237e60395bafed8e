//! Crash-safe file writes: a reader sees the old file or the new one, never half of one.

use std::fs::{self, File, OpenOptions, Permissions};
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

use super::fault::fault_point;

/// Fault points around the two steps of an atomic write (temp written, renamed).
pub type FaultPoints = Option<(&'static str, &'static str)>;

/// Write `bytes` to `dir/name` through `dir/tmp_name`: write, fsync, rename, fsync the folder.
/// `tmp_name` must not look like a final file to whoever scans `dir`.
pub fn atomic_write(
    dir: &Path,
    name: &str,
    tmp_name: &str,
    bytes: &[u8],
    mode: u32,
    faults: FaultPoints,
) -> io::Result<()> {
    write_temp(dir, tmp_name, bytes, mode)?;
    if let Some((after_temp, _)) = faults {
        fault_point(after_temp);
    }
    publish(
        dir,
        tmp_name,
        name,
        faults.map(|(_, after_rename)| after_rename),
    )
}

/// The first half of [`atomic_write`]: `dir/tmp_name` written and fsynced, not yet visible
/// under its final name.
pub fn write_temp(dir: &Path, tmp_name: &str, bytes: &[u8], mode: u32) -> io::Result<()> {
    let mut file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(dir.join(tmp_name))?;
    // The umask may have narrowed the mode; a leftover temp file may carry another one.
    file.set_permissions(Permissions::from_mode(mode))?;
    file.write_all(bytes)?;
    file.sync_all()
}

/// The second half of [`atomic_write`]: rename the fsynced temp file, then fsync the folder.
pub fn publish(
    dir: &Path,
    tmp_name: &str,
    name: &str,
    after_rename: Option<&'static str>,
) -> io::Result<()> {
    if let Err(e) = fs::rename(dir.join(tmp_name), dir.join(name)) {
        // Nobody will publish this one; the next write would replace it anyway.
        let _ = remove_file(&dir.join(tmp_name));
        return Err(e);
    }
    if let Some(point) = after_rename {
        fault_point(point);
    }
    sync_dir(dir)
}

pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Remove a file; a file that is not there is already removed.
pub fn remove_file(path: &Path) -> io::Result<bool> {
    match fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// Remove a folder and its content; a folder that is not there is already removed.
pub fn remove_dir_all(path: &Path) -> io::Result<bool> {
    match fs::remove_dir_all(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// Create `dir` with `mode` if missing; refuse a folder others can write to, since whoever can
/// write there can plant CDI specs or checkpoint entries.
pub fn ensure_private_dir(dir: &Path, mode: u32) -> io::Result<()> {
    match fs::metadata(dir) {
        Ok(meta) if !meta.is_dir() => Err(io::Error::other(format!(
            "{} exists and is not a folder",
            dir.display()
        ))),
        Ok(meta) if meta.permissions().mode() & 0o002 != 0 => Err(io::Error::other(format!(
            "{} is writable by others (mode {:o}); refusing to use it",
            dir.display(),
            meta.permissions().mode() & 0o7777
        ))),
        Ok(_) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            fs::create_dir_all(dir)?;
            fs::set_permissions(dir, Permissions::from_mode(mode))
        }
        Err(e) => Err(e),
    }
}

/// Wait (blocking) for an exclusive `flock` on `path`, creating the file (0600) when missing. The
/// kernel drops the lock when the file is closed, also when the process dies, so a killed process
/// never leaves it taken.
pub fn lock_exclusive(path: &Path) -> io::Result<File> {
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(path)?;
    flock(&file, libc::LOCK_EX)?;
    Ok(file)
}

/// `flock(file, operation)`, retried when a signal interrupts it.
fn flock(file: &File, operation: libc::c_int) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    loop {
        // SAFETY: flock on a descriptor `file` owns, for as long as it is borrowed.
        if unsafe { libc::flock(file.as_raw_fd(), operation) } == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Wait (blocking) for an exclusive `flock` on a file kept open.
pub fn relock_exclusive(file: &File) -> io::Result<()> {
    flock(file, libc::LOCK_EX)
}

/// An exclusive `flock` on a file kept open if nobody holds one: false (at once) when another
/// open file of it holds the lock. Never blocks.
pub fn try_lock_exclusive(file: &File) -> io::Result<bool> {
    match flock(file, libc::LOCK_EX | libc::LOCK_NB) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(false),
        Err(e) => Err(e),
    }
}

/// Release a lock taken with [`relock_exclusive`] or [`try_lock_exclusive`].
pub fn unlock(file: &File) -> io::Result<()> {
    flock(file, libc::LOCK_UN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_write_replaces_and_sets_mode() {
        let dir = tempfile::tempdir().unwrap();
        atomic_write(dir.path(), "a.json", ".a.tmp", b"one", 0o600, None).unwrap();
        atomic_write(dir.path(), "a.json", ".a.tmp", b"two", 0o644, None).unwrap();
        let path = dir.path().join("a.json");
        assert_eq!(fs::read(&path).unwrap(), b"two");
        assert_eq!(
            fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o644
        );
        assert!(!dir.path().join(".a.tmp").exists());
        assert!(!remove_file(&dir.path().join("missing")).unwrap());
    }

    #[test]
    fn a_lock_kept_open_is_taken_released_and_refused_while_another_holds_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("serialize.lock");
        let ours = lock_exclusive(&path).unwrap();
        unlock(&ours).unwrap();
        // Another open file of the lock (another driver instance) holds it: ours cannot have it.
        let theirs = lock_exclusive(&path).unwrap();
        assert!(!try_lock_exclusive(&ours).unwrap());
        drop(theirs);
        assert!(try_lock_exclusive(&ours).unwrap());
        unlock(&ours).unwrap();
        relock_exclusive(&ours).unwrap();
        let other = OpenOptions::new().write(true).open(&path).unwrap();
        assert!(!try_lock_exclusive(&other).unwrap());
    }

    #[test]
    fn world_writable_folders_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("state");
        ensure_private_dir(&sub, 0o700).unwrap();
        assert_eq!(
            fs::metadata(&sub).unwrap().permissions().mode() & 0o777,
            0o700
        );
        fs::set_permissions(&sub, Permissions::from_mode(0o777)).unwrap();
        assert!(ensure_private_dir(&sub, 0o700).is_err());
    }
}

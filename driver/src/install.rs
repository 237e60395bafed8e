//! `gpupool-driver install-lib`: puts gpupool's enforcement library where limited containers get it
//! from. The DaemonSet runs it in an init container from the same image, so the library on a node
//! is always the one built with the driver that prepares its claims.
//!
//! The copy is atomic (temp file, fsync, rename): a container starting meanwhile bind-mounts the
//! old file or the new one, never half of one, and containers already running keep the inode
//! they mounted.

use std::fs;
use std::path::{Path, PathBuf};

use thiserror::Error;

use crate::node_state::fsutil;
use crate::node_state::layout::GPUPOOL_LIB_FILE_NAME;

/// Where the image carries the library (deploy/Containerfile).
pub const IMAGE_LIB_PATH: &str = "/usr/local/lib/gpupool/libgpupool_vgpu.so";

#[derive(Debug, Error)]
pub enum InstallError {
    #[error("reading the library {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a shared library (no ELF header)")]
    NotElf { path: PathBuf },
    #[error("installing into {dir}: {source}")]
    Write {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// What [`install_lib`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum Installed {
    /// The library was written (first install, or another build).
    Written(PathBuf),
    /// The same bytes were already there; nothing was touched.
    UpToDate(PathBuf),
}

/// Copies the library at `from` to `<to_dir>/libgpupool_vgpu.so` (mode 0755), creating `to_dir`
/// (0755) when missing.
pub fn install_lib(from: &Path, to_dir: &Path) -> Result<Installed, InstallError> {
    let bytes = fs::read(from).map_err(|source| InstallError::Read {
        path: from.to_path_buf(),
        source,
    })?;
    if !bytes.starts_with(b"\x7fELF") {
        return Err(InstallError::NotElf {
            path: from.to_path_buf(),
        });
    }
    let target = to_dir.join(GPUPOOL_LIB_FILE_NAME);
    if fs::read(&target).is_ok_and(|current| current == bytes) {
        return Ok(Installed::UpToDate(target));
    }
    let write_err = |source| InstallError::Write {
        dir: to_dir.to_path_buf(),
        source,
    };
    fsutil::ensure_private_dir(to_dir, 0o755).map_err(write_err)?;
    fsutil::atomic_write(
        to_dir,
        GPUPOOL_LIB_FILE_NAME,
        &format!(".{GPUPOOL_LIB_FILE_NAME}.tmp"),
        &bytes,
        0o755,
        None,
    )
    .map_err(write_err)?;
    Ok(Installed::Written(target))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn installs_atomically_then_reports_up_to_date() {
        let top = tempfile::tempdir().unwrap();
        let from = top.path().join("lib.so");
        fs::write(&from, b"\x7fELF one").unwrap();
        let dir = top.path().join("usr/local/gpupool");

        let target = dir.join(GPUPOOL_LIB_FILE_NAME);
        assert_eq!(
            install_lib(&from, &dir).unwrap(),
            Installed::Written(target.clone())
        );
        assert_eq!(fs::read(&target).unwrap(), b"\x7fELF one");
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!((mode(&target), mode(&dir)), (0o755, 0o755));
        assert_eq!(
            install_lib(&from, &dir).unwrap(),
            Installed::UpToDate(target.clone())
        );

        fs::write(&from, b"\x7fELF two").unwrap();
        assert_eq!(
            install_lib(&from, &dir).unwrap(),
            Installed::Written(target.clone())
        );
        assert_eq!(fs::read(&target).unwrap(), b"\x7fELF two");
        let names: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(
            names,
            [GPUPOOL_LIB_FILE_NAME],
            "no temp file is left behind"
        );
    }

    #[test]
    fn refuses_what_is_not_a_library_or_not_there() {
        let top = tempfile::tempdir().unwrap();
        let text = top.path().join("notes.txt");
        fs::write(&text, b"hello").unwrap();
        let e = install_lib(&text, top.path()).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("{} is not a shared library (no ELF header)", text.display())
        );
        let e = install_lib(&top.path().join("missing.so"), top.path()).unwrap_err();
        assert!(e.to_string().starts_with("reading the library"), "{e}");
    }
}

//! Where a card's MPS daemon keeps its files (pure): `<run-dir>/mps/<card UUID>/` with
//!
//! - `pipe/` (0755): the daemon's control socket and PID file (`CUDA_MPS_PIPE_DIRECTORY`), mounted
//!   in the claims' containers at the same path and at [`CONTAINER_PIPE_DIR`];
//! - `log/` (0700): `control.log` and `server.log` (`CUDA_MPS_LOG_DIRECTORY`), the driver's only;
//! - `shm/` (1777): the daemon's `/dev/shm` (a bind mount in its own mount namespace) and the
//!   containers' `/dev/shm`, since an MPS client reaches its server through shared memory.
//!
//! The run folder is per boot (a tmpfs), like the daemon itself, and a tmpfs is what `/dev/shm`
//! must be. Keyed by the card's UUID, which names the same card after a reboot.

use std::path::{Path, PathBuf};

use gpupool_api::validation::is_uuid;

/// The folder under the run folder holding one folder per card.
pub const MPS_DIR: &str = "mps";
/// Where the pipe folder is mounted in a container besides its own path: CUDA's default, so a
/// process that drops `CUDA_MPS_PIPE_DIRECTORY` from its environment still finds the daemon.
pub const CONTAINER_PIPE_DIR: &str = "/tmp/nvidia-mps";
pub const CONTAINER_SHM_DIR: &str = "/dev/shm";
/// The daemon's socket in its pipe folder.
pub const CONTROL_SOCKET: &str = "control";
/// The daemon's PID file in its pipe folder.
pub const PID_FILE: &str = "nvidia-cuda-mps-control.pid";
/// `sun_path` holds 108 bytes with its NUL: a longer socket path cannot be bound, and the daemon
/// then fails with nothing but its absence.
pub const MAX_SOCKET_PATH: usize = 107;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    #[error("{0:?} is not a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx): it would name a folder")]
    BadUuid(String),
    #[error(
        "the MPS control socket {path} is {len} bytes long, more than the {MAX_SOCKET_PATH} a Unix \
         socket path may have: choose a shorter --run-dir"
    )]
    SocketPathTooLong { path: String, len: usize },
}

/// One card's daemon folders.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DaemonDirs {
    pub root: PathBuf,
    pub pipe: PathBuf,
    pub log: PathBuf,
    pub shm: PathBuf,
}

impl DaemonDirs {
    /// The folders of the card `uuid` under `run_dir`; the UUID becomes a folder name, so it is
    /// checked, and so is the socket path's length.
    pub fn of(run_dir: &Path, uuid: &str) -> Result<DaemonDirs, LayoutError> {
        if !uuid.strip_prefix("GPU-").is_some_and(is_uuid) {
            return Err(LayoutError::BadUuid(uuid.to_string()));
        }
        let root = run_dir.join(MPS_DIR).join(uuid);
        let dirs = DaemonDirs {
            pipe: root.join("pipe"),
            log: root.join("log"),
            shm: root.join("shm"),
            root,
        };
        let socket = dirs.socket();
        let len = socket.as_os_str().len();
        if len > MAX_SOCKET_PATH {
            return Err(LayoutError::SocketPathTooLong {
                path: socket.display().to_string(),
                len,
            });
        }
        Ok(dirs)
    }

    pub fn socket(&self) -> PathBuf {
        self.pipe.join(CONTROL_SOCKET)
    }

    pub fn pid_file(&self) -> PathBuf {
        self.pipe.join(PID_FILE)
    }
}

/// The folder holding every card's daemon folders.
pub fn mps_root(run_dir: &Path) -> PathBuf {
    run_dir.join(MPS_DIR)
}

#[cfg(test)]
mod tests {
    use super::*;

    const UUID: &str = "GPU-51b8cb73-0d3e-4d3c-9a8e-000000000001";

    #[test]
    fn a_cards_folders_are_named_by_its_uuid_under_the_run_folder() {
        let dirs = DaemonDirs::of(Path::new("/var/run/gpupool"), UUID).unwrap();
        assert_eq!(
            dirs.socket(),
            Path::new("/var/run/gpupool/mps/GPU-51b8cb73-0d3e-4d3c-9a8e-000000000001/pipe/control")
        );
        assert_eq!(dirs.shm, dirs.root.join("shm"));
        assert_eq!(dirs.pid_file().file_name().unwrap(), PID_FILE);
    }

    #[test]
    fn a_uuid_that_could_name_another_folder_and_a_socket_path_too_long_are_refused() {
        for bad in [
            "../../etc",
            "GPU-../../x",
            "MIG-51b8cb73-0d3e-4d3c-9a8e-000000000001",
            "",
        ] {
            assert!(
                matches!(
                    DaemonDirs::of(Path::new("/r"), bad),
                    Err(LayoutError::BadUuid(_))
                ),
                "{bad}"
            );
        }
        let deep = "/x".repeat(30);
        let e = DaemonDirs::of(Path::new(&deep), UUID).unwrap_err();
        assert!(e.to_string().contains("--run-dir"), "{e}");
    }
}

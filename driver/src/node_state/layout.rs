//! Every host path the driver owns, and the names of its files: the one place to look when a
//! folder is added, moved or cleaned up.
//!
//! - `<state-dir>/` (0700, survives reboots): the checkpoint ([`checkpoint`](super::checkpoint))
//!   and `ld.so.preload`, the file HAMi-core's library is preloaded through.
//! - `<cdi-root>/` (0755): one CDI spec per prepared claim, `gpupool.dev-claim_<uid>.json`, each
//!   written through a `.<name>.tmp` file first.
//! - `<run-dir>/` (0711, per boot, normally a tmpfs): the per-claim folders, one tree per kind
//!   ([`CLAIM_FOLDERS`]), `<run-dir>/<kind>/<uid>/`.
//! - the HAMi-core lock folder, `/tmp/vgpulock`, shared by every container on the node.

use std::path::{Path, PathBuf};

use gpupool_api::names::cdi_spec_file_name;

use super::checkpoint;

/// `ld.so.preload` in the state folder; its content is [`CONTAINER_LIB_PATH`].
pub const PRELOAD_FILE_NAME: &str = "ld.so.preload";
/// Where HAMi-core is mounted in the container, and what `/etc/ld.so.preload` names.
pub const CONTAINER_LIB_PATH: &str = "/usr/local/vgpu/libvgpu.so";
/// Where the preload file is mounted in the container.
pub const LD_SO_PRELOAD: &str = "/etc/ld.so.preload";
/// HAMi-core's library in `--vgpu-lib-dir`.
pub const LIB_FILE_NAME: &str = "libvgpu.so";
/// HAMi-core's cross-container lock folder, same path on both sides.
pub const VGPU_LOCK_DIR: &str = "/tmp/vgpulock";

/// Every file the driver keeps in its state folder.
pub const STATE_FILES: &[&str] = &[
    checkpoint::CHECKPOINT_FILE,
    checkpoint::LOG_FILE,
    checkpoint::LOCK_FILE,
    PRELOAD_FILE_NAME,
];

/// A kind of per-claim host folder: `<run-dir>/<kind>/<claim uid>/`, created (mode 1777, sticky)
/// when the claim's spec mounts it, removed with the claim, swept when no prepared claim accounts
/// for it. A new kind is one more entry in [`CLAIM_FOLDERS`]; the spec mounts it in `prepare/cdi.rs`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimFolder {
    /// HAMi-core's per-claim accounting file (`<card uuid>.cache`), shared by the claim's containers.
    VgpuCache,
}

/// Every kind of per-claim folder.
pub const CLAIM_FOLDERS: &[ClaimFolder] = &[ClaimFolder::VgpuCache];

impl ClaimFolder {
    /// The folder under the run folder holding one folder per claim.
    pub const fn dir_name(self) -> &'static str {
        match self {
            ClaimFolder::VgpuCache => "vgpu-cache",
        }
    }
}

/// Host paths of one node agent.
#[derive(Debug, Clone)]
pub struct NodeLayout {
    pub state_dir: PathBuf,
    pub cdi_root: PathBuf,
    /// Per-boot state, normally on a tmpfs.
    pub run_dir: PathBuf,
    /// `<vgpu-lib-dir>/libvgpu.so`.
    pub vgpu_lib: PathBuf,
    pub vgpu_lock_dir: PathBuf,
    pub fake_gpus: bool,
    /// A lock file when other driver instances share these folders (a rolling update with surge),
    /// see [`NodeState::take_turn`](super::NodeState::take_turn).
    pub serialize_lock: Option<PathBuf>,
}

impl NodeLayout {
    /// The layout for these folders, HAMi-core's lock folder at its fixed place.
    pub fn new(
        state_dir: PathBuf,
        cdi_root: PathBuf,
        run_dir: PathBuf,
        vgpu_lib_dir: &Path,
        fake_gpus: bool,
    ) -> Self {
        NodeLayout {
            state_dir,
            cdi_root,
            run_dir,
            vgpu_lib: vgpu_lib_dir.join(LIB_FILE_NAME),
            vgpu_lock_dir: PathBuf::from(VGPU_LOCK_DIR),
            fake_gpus,
            serialize_lock: None,
        }
    }

    /// A file whose content is [`CONTAINER_LIB_PATH`], mounted at `/etc/ld.so.preload`.
    pub fn preload_file(&self) -> PathBuf {
        self.state_dir.join(PRELOAD_FILE_NAME)
    }

    /// The folder holding every claim's folder of `kind`.
    pub fn claim_folder_root(&self, kind: ClaimFolder) -> PathBuf {
        self.run_dir.join(kind.dir_name())
    }

    /// The claim's folder of `kind`. `uid` must have been checked (a UUID).
    pub fn claim_folder(&self, kind: ClaimFolder, uid: &str) -> PathBuf {
        self.claim_folder_root(kind).join(uid)
    }

    /// Every per-claim folder of the claim.
    pub fn claim_folders<'a>(&'a self, uid: &'a str) -> impl Iterator<Item = PathBuf> + 'a {
        CLAIM_FOLDERS
            .iter()
            .map(move |kind| self.claim_folder(*kind, uid))
    }

    /// The claim's CDI spec. `uid` must have been checked (a UUID).
    pub fn spec_path(&self, uid: &str) -> PathBuf {
        self.cdi_root.join(cdi_spec_file_name(uid))
    }
}

/// The claim UID of a file in the CDI root that this driver wrote (final or temp), if it is one.
pub fn owned_spec_uid(file_name: &str) -> Option<&str> {
    let prefix = cdi_spec_file_name("");
    let prefix = prefix.strip_suffix(".json").unwrap_or(&prefix);
    let rest = file_name.strip_prefix('.').unwrap_or(file_name);
    let rest = rest.strip_prefix(prefix)?;
    rest.strip_suffix(".json.tmp")
        .or_else(|| rest.strip_suffix(".json"))
}

/// The spec's temp name: a dot first and `.tmp` last, since CDI runtimes only read `*.json` and
/// `*.yaml`.
pub(super) fn spec_temp_name(uid: &str) -> String {
    format!(".{}.tmp", cdi_spec_file_name(uid))
}

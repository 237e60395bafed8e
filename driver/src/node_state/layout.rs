//! Every host path the driver owns, and the names of its files: the one place to look when a
//! folder is added, moved or cleaned up.
//!
//! - `<state-dir>/` (0700, survives reboots): the checkpoint ([`checkpoint`](super::checkpoint))
//!   and one preload file per enforcement library (`ld.so.preload` for HAMi-core,
//!   `ld.so.preload.gpupool` for gpupool's own), the file a limited container's
//!   `/etc/ld.so.preload` is.
//! - `<cdi-root>/` (0755): one CDI spec per prepared claim, `gpupool.dev-claim_<uid>.json`, each
//!   written through a `.<name>.tmp` file first.
//! - `<run-dir>/` (0711, per boot, normally a tmpfs): the per-claim folders, one tree per kind
//!   ([`CLAIM_FOLDERS`]), `<run-dir>/<kind>/<uid>/`; and one arbiter file per card
//!   (`<run-dir>/vgpu-arbiter/<card uuid>`, 0666 in a 0711 folder), through which gpupool's library
//!   in every container with an SM limit on that card takes turns holding it. A card's file
//!   outlives its claims (it holds the card's tenants' history, a few KiB); it goes with the boot.
//! - `<run-dir>/mps/<card UUID>/` (0711): a card's MPS control daemon's pipe, log and shared-memory
//!   folders, while it runs ([`crate::mps::layout`]).
//! - the HAMi-core lock folder, `/tmp/vgpulock`, shared by every container on the node.
//! - the enforcement libraries on the host, which the driver only reads: gpupool's
//!   (`--gpupool-lib-dir`, installed by the DaemonSet's init container with `install-lib`) and
//!   HAMi-core's (`--vgpu-lib-dir`, installed by the operator).

use std::path::{Path, PathBuf};

use gpupool_api::config::Enforcement;
use gpupool_api::names::cdi_spec_file_name;

use super::checkpoint;

/// HAMi-core's preload file in the state folder; its content is [`HAMI_CORE_CONTAINER_PATH`].
pub const PRELOAD_FILE_NAME: &str = "ld.so.preload";
/// gpupool's preload file in the state folder; its content is [`GPUPOOL_CONTAINER_PATH`].
pub const GPUPOOL_PRELOAD_FILE_NAME: &str = "ld.so.preload.gpupool";
/// Where HAMi-core is mounted in the container.
pub const HAMI_CORE_CONTAINER_PATH: &str = "/usr/local/vgpu/libvgpu.so";
/// Where gpupool's library is mounted in the container.
pub const GPUPOOL_CONTAINER_PATH: &str = "/usr/local/gpupool/libgpupool_vgpu.so";
/// Where a preload file is mounted in the container.
pub const LD_SO_PRELOAD: &str = "/etc/ld.so.preload";
/// HAMi-core's library in `--vgpu-lib-dir`.
pub const LIB_FILE_NAME: &str = "libvgpu.so";
/// gpupool's library in `--gpupool-lib-dir` (what `cargo build -p gpupool-vgpu` makes).
pub const GPUPOOL_LIB_FILE_NAME: &str = "libgpupool_vgpu.so";
/// HAMi-core's cross-container lock folder, same path on both sides.
pub const VGPU_LOCK_DIR: &str = "/tmp/vgpulock";

/// The folder of the cards' arbiter files under the run folder.
pub const ARBITER_DIR_NAME: &str = "vgpu-arbiter";

/// Every file the driver keeps in its state folder.
pub const STATE_FILES: &[&str] = &[
    checkpoint::CHECKPOINT_FILE,
    checkpoint::LOG_FILE,
    checkpoint::LOCK_FILE,
    PRELOAD_FILE_NAME,
    GPUPOOL_PRELOAD_FILE_NAME,
];

/// A kind of per-claim host folder: `<run-dir>/<kind>/<claim uid>/`, created (mode 1777, sticky)
/// when the claim's spec mounts it, removed with the claim, swept when no prepared claim accounts
/// for it. A new kind is one more entry in [`CLAIM_FOLDERS`]; the spec mounts it in `prepare/cdi.rs`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimFolder {
    /// The enforcement library's per-claim accounting file (`<card uuid>.cache`), shared by the
    /// claim's containers.
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

/// An in-container enforcement library, as this node holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnforcementLib {
    /// What it enforces (never `None`).
    pub enforcement: Enforcement,
    /// The library on the host, mounted read-only into limited containers.
    pub host_path: PathBuf,
    /// Where it is mounted, which is what its preload file names.
    pub container_path: &'static str,
    /// Its preload file in the state folder, mounted at [`LD_SO_PRELOAD`].
    pub preload_file_name: &'static str,
}

impl EnforcementLib {
    /// What claims' status and the log call it.
    pub fn name(&self) -> &'static str {
        self.enforcement.library_name().unwrap_or("none")
    }
}

/// Host paths of one node agent.
#[derive(Debug, Clone)]
pub struct NodeLayout {
    pub state_dir: PathBuf,
    pub cdi_root: PathBuf,
    /// Per-boot state, normally on a tmpfs.
    pub run_dir: PathBuf,
    /// gpupool's library, `<gpupool-lib-dir>/libgpupool_vgpu.so`.
    pub gpupool_lib: EnforcementLib,
    /// HAMi-core, `<vgpu-lib-dir>/libvgpu.so`.
    pub hami_core_lib: EnforcementLib,
    pub vgpu_lock_dir: PathBuf,
    pub fake_gpus: bool,
    /// A lock file when other driver instances share these folders (a rolling update with surge),
    /// see [`NodeState::take_turn`](super::NodeState::take_turn).
    pub serialize_lock: Option<PathBuf>,
    /// How the cards' MPS control daemons are run; their folders are under `run_dir`
    /// ([`crate::mps::layout`]).
    pub mps: crate::mps::MpsSettings,
}

impl NodeLayout {
    /// The layout for these folders, HAMi-core's lock folder at its fixed place. `lib_dirs` are
    /// the host folders of gpupool's library and of HAMi-core, in that order.
    pub fn new(
        state_dir: PathBuf,
        cdi_root: PathBuf,
        run_dir: PathBuf,
        (gpupool_lib_dir, vgpu_lib_dir): (&Path, &Path),
        fake_gpus: bool,
    ) -> Self {
        NodeLayout {
            state_dir,
            cdi_root,
            run_dir,
            gpupool_lib: EnforcementLib {
                enforcement: Enforcement::Gpupool,
                host_path: gpupool_lib_dir.join(GPUPOOL_LIB_FILE_NAME),
                container_path: GPUPOOL_CONTAINER_PATH,
                preload_file_name: GPUPOOL_PRELOAD_FILE_NAME,
            },
            hami_core_lib: EnforcementLib {
                enforcement: Enforcement::HamiCore,
                host_path: vgpu_lib_dir.join(LIB_FILE_NAME),
                container_path: HAMI_CORE_CONTAINER_PATH,
                preload_file_name: PRELOAD_FILE_NAME,
            },
            vgpu_lock_dir: PathBuf::from(VGPU_LOCK_DIR),
            fake_gpus,
            serialize_lock: None,
            mps: crate::mps::MpsSettings::default(),
        }
    }

    /// The library that enforces `enforcement`; `None` for no enforcement.
    pub fn library(&self, enforcement: Enforcement) -> Option<&EnforcementLib> {
        match enforcement {
            Enforcement::Gpupool => Some(&self.gpupool_lib),
            Enforcement::HamiCore => Some(&self.hami_core_lib),
            Enforcement::None => None,
        }
    }

    /// Both libraries, gpupool's first.
    pub fn libraries(&self) -> [&EnforcementLib; 2] {
        [&self.gpupool_lib, &self.hami_core_lib]
    }

    /// The library's preload file: one line, its container path; mounted at [`LD_SO_PRELOAD`].
    pub fn preload_file(&self, lib: &EnforcementLib) -> PathBuf {
        self.state_dir.join(lib.preload_file_name)
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

    /// The folder of the cards' arbiter files.
    pub fn arbiter_root(&self) -> PathBuf {
        self.run_dir.join(ARBITER_DIR_NAME)
    }

    /// A card's arbiter file. None for a UUID that is not a plain file name (letters, digits and
    /// dashes, as NVML writes them): nothing reaches a path unchecked.
    pub fn card_arbiter(&self, card_uuid: &str) -> Option<PathBuf> {
        let plain = !card_uuid.is_empty()
            && card_uuid.len() <= 96
            && card_uuid
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-');
        plain.then(|| self.arbiter_root().join(card_uuid))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cards_arbiter_is_named_by_its_uuid_and_nothing_else() {
        let layout = NodeLayout::new(
            "/state".into(),
            "/cdi".into(),
            "/run/gpupool".into(),
            (Path::new("/lib/a"), Path::new("/lib/b")),
            false,
        );
        assert_eq!(
            layout.card_arbiter("GPU-1a2b3c4d-0000-1111-2222-333344445555"),
            Some(PathBuf::from(
                "/run/gpupool/vgpu-arbiter/GPU-1a2b3c4d-0000-1111-2222-333344445555"
            ))
        );
        for bad in ["", "../x", "GPU-1/..", "a b", &"x".repeat(97)] {
            assert_eq!(layout.card_arbiter(bad), None, "{bad:?}");
        }
    }
}

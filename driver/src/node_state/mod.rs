//! A claim's state on the node: its CDI spec, its per-claim folders and its checkpoint entry, the
//! lock that lets two driver instances share them, and the start-up recovery that makes them agree
//! after a crash. Files only: what a claim means and what the API server says is `prepare/`'s.
//!
//! The write order is what makes a crash at any point repairable (docs/architecture.md):
//! - [`NodeState::create_mig`] (claims with MIG devices, before the spec can be rendered): entry
//!   `PrepareStarted` naming each MIG device's card, profile and placement, then per device the
//!   GPU instance, its id recorded, the compute instance, its id and UUID recorded; undone on
//!   failure.
//! - [`NodeState::prepare`]: entry `PrepareStarted`, then the folders and the spec (temp file,
//!   rename), then entry `PrepareCompleted`; undone on failure. A spec never has its final name
//!   without at least a started entry.
//! - [`NodeState::remove`]: the spec and folders first, then the MIG instances (compute, then GPU
//!   instance), the entry last: a crash in between leaves an entry whose spec start-up writes
//!   again, and the kubelet's retry removes all of it.
//! - [`NodeState::recover`]: completed entries get their spec back, anything else is rolled back,
//!   files and MIG instances no completed entry accounts for are removed.
//! - MPS daemons (claims with `compute: Mps`): started before the spec that mounts their folders,
//!   stopped with their last claim, before its entry goes (`mps.rs`).

pub mod checkpoint;
pub mod fault;
mod files;
pub(crate) mod fsutil;
pub mod layout;
mod mps;
mod recovery;

use std::path::PathBuf;
use std::sync::Arc;

use gpupool_api::cdi::Spec;
use thiserror::Error;

use self::checkpoint::{
    Change, CheckpointData, CheckpointError, ClaimEntry, ClaimState, MigRecord,
};
use self::fault::fault_point;
pub use self::layout::NodeLayout;
use crate::mig::{MigError, MigManager, Placement};

/// Test hook: a boot id to use instead of the kernel's (reboot simulation in e2e tests).
pub const BOOT_ID_ENV: &str = "GPUPOOL_BOOT_ID";
const BOOT_ID_FILE: &str = "/proc/sys/kernel/random/boot_id";

/// The node's boot id: the kernel's, unless [`BOOT_ID_ENV`] overrides it.
pub fn current_boot_id() -> String {
    if let Ok(id) = std::env::var(BOOT_ID_ENV) {
        return id;
    }
    std::fs::read_to_string(BOOT_ID_FILE)
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

#[derive(Debug, Error)]
pub enum NodeStateError {
    #[error("state folder {path}: {source}")]
    StateDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("CDI root {path}: {source}")]
    CdiRoot {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("taking the lock {path}: {source}")]
    Lock {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("a completed entry without a CDI spec")]
    NoSpec,
    #[error("writing the CDI spec: {0}")]
    WriteSpec(#[source] std::io::Error),
    #[error("rewriting the CDI spec: {0}")]
    RestoreSpec(#[source] std::io::Error),
    #[error("removing its files: {0}")]
    RemoveFiles(#[source] std::io::Error),
    #[error("reading the checkpoint: {0}")]
    Refresh(#[source] CheckpointError),
    #[error(transparent)]
    Mig(#[from] MigError),
    #[error("MPS: {0}")]
    Mps(#[from] crate::mps::MpsError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
}

/// This instance's turn on the node's shared folders; released on drop (the file lock first,
/// then this process's queue).
pub struct Turn {
    _held: HeldLock,
    _local: tokio::sync::OwnedMutexGuard<()>,
}

/// The serialize lock taken on the file kept open; unlocked on drop.
struct HeldLock(Arc<std::fs::File>);

impl Drop for HeldLock {
    fn drop(&mut self) {
        if let Err(e) = fsutil::unlock(&self.0) {
            // Closing the file is what releases a lock the kernel could not unlock: the other
            // instance would wait until this process exits.
            tracing::error!(error = %e, "releasing the serialize lock failed");
        }
    }
}

/// The node's prepared claims as files and checkpoint. Methods that touch files block: call them
/// off the runtime's threads, except [`NodeState::prepare`] and [`NodeState::remove`] of a claim
/// without MIG devices, which are a few system calls on the CDI folder's tmpfs and one append to
/// the checkpoint log (a compaction, once in about 500 changes, a few fsyncs). Send + Sync; share
/// it in an `Arc`.
pub struct NodeState {
    layout: NodeLayout,
    checkpoint: checkpoint::Store,
    /// Taken before the lock file, so that this process's own calls queue here rather than each
    /// holding a blocking thread in `flock` (the threads the call holding the lock needs).
    turn: Arc<tokio::sync::Mutex<()>>,
    /// The cards' MIG instances, created and destroyed in the order recorded here.
    mig: Arc<dyn MigManager>,
    /// The serialize lock's file (with other instances on the node), open for the process's
    /// life: a turn is a `flock` and an unlock, not an open, a `flock` and a close.
    serialize_lock: Option<Arc<std::fs::File>>,
    /// Held through each change of the MPS daemons (`mps.rs`): claims of one call, or of calls
    /// for pods that start together, are prepared at once, and a daemon's steps must not
    /// interleave with another claim's on the same card. The other instance is kept out by the
    /// turn.
    mps_lock: std::sync::Mutex<()>,
}

/// Where MIG instances may exist: the node's cards that have MIG.
#[derive(Debug, Clone)]
pub struct MigCards {
    pub manager: Arc<dyn MigManager>,
    /// UUIDs of the cards with MIG.
    pub cards: Vec<String>,
}

impl NodeState {
    /// Start-up (blocking): folders, then the checkpoint against the files (see [`recovery`]).
    /// Returns, besides the state, what was moved aside when the checkpoint was unreadable.
    pub fn recover(
        layout: NodeLayout,
        boot_id: &str,
        mig: MigCards,
    ) -> Result<(Self, Option<String>), NodeStateError> {
        // Another instance may be preparing a claim right now: its spec would look like an orphan
        // to the sweep.
        let serialize_lock = layout
            .serialize_lock
            .as_deref()
            .map(lock_shared_folders)
            .transpose()?
            .map(Arc::new);
        let held = serialize_lock.clone().map(HeldLock);
        let recovered = recovery::recover(&layout, boot_id, &mig)?;
        drop(held);
        let checkpoint = checkpoint::Store::new(layout.state_dir.clone(), recovered.data);
        let state = NodeState {
            layout,
            checkpoint,
            turn: Arc::default(),
            mig: mig.manager,
            serialize_lock,
            mps_lock: std::sync::Mutex::new(()),
        };
        Ok((state, recovered.corrupt))
    }

    pub fn layout(&self) -> &NodeLayout {
        &self.layout
    }

    /// Whether another instance has changed the checkpoint since this one last read or wrote it
    /// (two stats, no lock): what [`NodeState::prepared`] answers may then be out of date until
    /// the next [`NodeState::take_turn`]. Always false for an instance alone on the node.
    pub fn others_may_have_written(&self) -> bool {
        self.serialize_lock.is_some() && !self.checkpoint.is_current()
    }

    /// With other instances on the node: wait for this one's turn and catch up with what they
    /// changed. `Ok(None)` when this process is alone.
    ///
    /// The common case, nobody else holding the lock and the checkpoint as this process left it,
    /// costs a non-blocking `flock` and two stats on this thread: a hand-over to a blocking
    /// thread and back cost more than the rest of an unprepare. Otherwise a blocking thread
    /// waits for the lock and reads what the other instance wrote.
    pub async fn take_turn(self: &Arc<Self>) -> Result<Option<Turn>, NodeStateError> {
        let Some(file) = self.serialize_lock.clone() else {
            return Ok(None);
        };
        let lock_err = |source| NodeStateError::Lock {
            path: self.layout.serialize_lock.clone().unwrap_or_default(),
            source,
        };
        let local = self.turn.clone().lock_owned().await;
        let held = fsutil::try_lock_exclusive(&file)
            .map_err(lock_err)?
            .then(|| HeldLock(file.clone()));
        if held.is_some() && self.checkpoint.is_current() {
            return Ok(held.map(|held| Turn {
                _held: held,
                _local: local,
            }));
        }
        let this = self.clone();
        let held = tokio::task::spawn_blocking(move || {
            let held = match held {
                Some(held) => held,
                None => {
                    fsutil::relock_exclusive(&file).map_err(|source| NodeStateError::Lock {
                        path: this.layout.serialize_lock.clone().unwrap_or_default(),
                        source,
                    })?;
                    HeldLock(file)
                }
            };
            this.checkpoint.refresh().map_err(NodeStateError::Refresh)?;
            Ok::<_, NodeStateError>(held)
        })
        .await
        .expect("taking the turn does not panic")?;
        Ok(Some(Turn {
            _held: held,
            _local: local,
        }))
    }

    /// Reads the checkpoint as this instance holds it.
    pub fn read<R>(&self, f: impl FnOnce(&CheckpointData) -> R) -> R {
        self.checkpoint.read(f)
    }

    /// The claim's entry when it is prepared (and not only known from a spec found without a
    /// checkpoint).
    pub fn prepared(&self, uid: &str) -> Option<ClaimEntry> {
        self.read(|data| {
            data.claims
                .get(uid)
                .filter(|e| e.state == ClaimState::PrepareCompleted && !e.recovered)
                .cloned()
        })
    }

    /// Whether the claim's spec is in the CDI root (one stat).
    pub fn spec_exists(&self, uid: &str) -> bool {
        self.layout.spec_path(uid).exists()
    }

    /// Write a completed claim's spec again when it vanished (someone cleaned the CDI folder).
    /// Blocking.
    pub fn restore_spec(&self, uid: &str, spec: &Spec) -> Result<(), NodeStateError> {
        if !self.spec_exists(uid) {
            files::write_spec_with_sources(&self.layout, uid, spec)
                .map_err(NodeStateError::RestoreSpec)?;
        }
        Ok(())
    }

    /// HAMi-core's lock folder, created world-writable and sticky: the runtime needs it to exist
    /// before it can mount it.
    pub fn ensure_vgpu_lock_dir(&self) -> Result<(), NodeStateError> {
        files::ensure_shared_dir(&self.layout.vgpu_lock_dir).map_err(|source| NodeStateError::Io {
            path: self.layout.vgpu_lock_dir.clone(),
            source,
        })
    }

    /// Create the MIG instances of a claim's MIG devices (`started.mig`: card, profile and
    /// placement of each), recording every step before the next (see the module's order); returns
    /// the records with their instances' ids and UUIDs. On failure what was created is destroyed
    /// and the entry removed. Blocking.
    pub fn create_mig(
        &self,
        uid: &str,
        mut started: ClaimEntry,
    ) -> Result<Vec<MigRecord>, NodeStateError> {
        started.state = ClaimState::PrepareStarted;
        self.checkpoint
            .commit(Change::Put(uid.to_string(), Box::new(started.clone())))?;
        for i in 0..started.mig.len() {
            if let Err(e) = self.create_instance(uid, &mut started, i) {
                self.destroy_all(uid, &started.mig);
                if let Err(e) = self.checkpoint.commit(Change::Remove(uid.to_string())) {
                    tracing::error!(uid, error = %e, "rolling back a failed MIG creation could not update the checkpoint; the next start will");
                }
                return Err(e);
            }
        }
        Ok(started.mig)
    }

    /// MIG instance `i` of `entry`: mode, GPU instance, record, compute instance, record.
    fn create_instance(
        &self,
        uid: &str,
        entry: &mut ClaimEntry,
        i: usize,
    ) -> Result<(), NodeStateError> {
        let record = entry.mig[i].clone();
        // Only cards that switch without a reset offer MIG devices while the mode is off.
        if !self.mig.mig_enabled(&record.parent_uuid)? {
            self.mig.set_mig_enabled(&record.parent_uuid, true)?;
        }
        let gi = self.mig.create_gpu_instance(&Placement {
            parent_uuid: record.parent_uuid.clone(),
            profile_id: record.profile_id,
            start: record.start,
            size: record.size,
        })?;
        entry.mig[i].gpu_instance = Some(gi);
        fault_point("after-gpu-instance-created");
        self.checkpoint
            .commit(Change::Put(uid.to_string(), Box::new(entry.clone())))?;
        fault_point("after-gpu-instance-recorded");
        let ci =
            self.mig
                .create_compute_instance(&record.parent_uuid, gi, record.compute_slices)?;
        entry.mig[i].compute_instance = Some(ci.id);
        entry.mig[i].uuid = Some(ci.uuid);
        entry.mig[i].device_nodes = ci.device_nodes;
        fault_point("after-compute-instance-created");
        self.checkpoint
            .commit(Change::Put(uid.to_string(), Box::new(entry.clone())))?;
        Ok(())
    }

    /// Destroy the instances of `records`, compute instance before GPU instance, newest first;
    /// best effort (a failure is logged, and the next start destroys what is left).
    fn destroy_all(&self, uid: &str, records: &[MigRecord]) {
        for record in records.iter().rev() {
            if let Err(e) = self.destroy(record) {
                tracing::error!(uid, device = %record.device, error = %e, "could not destroy a MIG instance of a failed prepare; the next start will");
            }
        }
    }

    /// One MIG device's instances, compute instance first.
    fn destroy(&self, record: &MigRecord) -> Result<(), MigError> {
        let Some(gi) = record.gpu_instance else {
            return Ok(());
        };
        if let Some(ci) = record.compute_instance {
            self.mig
                .destroy_compute_instance(&record.parent_uuid, gi, ci)?;
        }
        fault_point("after-compute-instance-destroyed");
        self.mig.destroy_gpu_instance(&record.parent_uuid, gi)
    }

    /// Leave MIG mode on a card that switches without a reset, before it runs whole or in
    /// fractions (no instance may exist: the node guard keeps MIG devices and cards apart).
    /// Blocking.
    pub fn leave_mig_mode(&self, parent_uuid: &str) -> Result<(), NodeStateError> {
        if self.mig.mig_enabled(parent_uuid)? {
            self.mig.set_mig_enabled(parent_uuid, false)?;
        }
        Ok(())
    }

    /// Undo [`NodeState::create_mig`] when the claim fails before [`NodeState::prepare`].
    /// Blocking.
    pub fn abandon(&self, uid: &str) {
        self.roll_back(uid);
    }

    /// Record the claim `PrepareStarted`, write its folders and the spec `completed` carries, then
    /// record `completed`; undone on failure. Blocking.
    pub fn prepare(&self, uid: &str, completed: ClaimEntry) -> Result<(), NodeStateError> {
        let spec = completed.spec.as_ref().ok_or(NodeStateError::NoSpec)?;
        // The started entry names the claim and its MIG instances only: the spec and the answer
        // come with `completed`.
        let started = ClaimEntry {
            state: ClaimState::PrepareStarted,
            namespace: completed.namespace.clone(),
            name: completed.name.clone(),
            devices: Vec::new(),
            spec: None,
            warning: completed.warning.clone(),
            recovered: false,
            mig: completed.mig.clone(),
            mps: completed.mps.clone(),
        };
        self.checkpoint
            .commit(Change::Put(uid.to_string(), Box::new(started)))?;
        fault_point("after-prepare-started");
        let done = files::write_spec_with_sources(&self.layout, uid, spec)
            .map_err(NodeStateError::WriteSpec)
            .and_then(|()| {
                self.checkpoint
                    .commit(Change::Put(uid.to_string(), Box::new(completed)))
                    .map_err(NodeStateError::from)
            });
        if done.is_err() {
            self.roll_back(uid);
        }
        done?;
        fault_point("after-prepare-completed");
        Ok(())
    }

    /// Undo a prepare that failed after `PrepareStarted` was recorded.
    fn roll_back(&self, uid: &str) {
        if files::remove_claim_files(&self.layout, uid, || {}).is_err() {
            tracing::error!(
                uid,
                "rolling back a failed prepare could not remove its files; the next start will"
            );
        }
        let records = self.read(|data| {
            data.claims
                .get(uid)
                .map(|e| e.mig.clone())
                .unwrap_or_default()
        });
        self.destroy_all(uid, &records);
        let held_mps = self.read(|data| data.claims.get(uid).is_some_and(|e| !e.mps.is_empty()));
        if let Err(e) = self.checkpoint.commit(Change::Remove(uid.to_string())) {
            tracing::error!(uid, error = %e, "rolling back a failed prepare could not update the checkpoint; the next start will");
        }
        if held_mps {
            if let Err(e) = self.release_mps(None) {
                tracing::error!(uid, error = %e, "rolling back a failed prepare could not stop its MPS daemon; the next start will");
            }
        }
    }

    /// The claim's spec and folders, then its MIG instances, then its entry if it has one.
    /// Blocking.
    pub fn remove(&self, uid: &str) -> Result<(), NodeStateError> {
        files::remove_claim_files(&self.layout, uid, || fault_point("mid-unprepare"))
            .map_err(NodeStateError::RemoveFiles)?;
        let records = self.read(|data| {
            data.claims
                .get(uid)
                .map(|e| e.mig.clone())
                .unwrap_or_default()
        });
        // Processes still running on an instance make NVML refuse (IN_USE): the entry stays and
        // the kubelet's retry finishes the job.
        for record in records.iter().rev() {
            self.destroy(record)?;
        }
        // The card's MPS daemon stops with its last holder (node_state/mps.rs).
        if self.read(|data| data.claims.get(uid).is_some_and(|e| !e.mps.is_empty())) {
            return self.remove_mps_holder(uid);
        }
        if self.read(|data| data.claims.contains_key(uid)) {
            self.checkpoint.commit(Change::Remove(uid.to_string()))?;
        }
        Ok(())
    }

    /// Fold the checkpoint's log into its snapshot (orderly shutdown). Blocking.
    pub fn compact(&self) -> Result<(), NodeStateError> {
        Ok(self.checkpoint.compact()?)
    }
}

/// Wait (blocking) for the exclusive lock other instances on the node take too, creating the file
/// and its folder.
fn lock_shared_folders(path: &std::path::Path) -> Result<std::fs::File, NodeStateError> {
    let lock_err = |source| NodeStateError::Lock {
        path: path.to_path_buf(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(lock_err)?;
    }
    fsutil::lock_exclusive(path).map_err(lock_err)
}

//! Start-up: make the files, the MIG instances and the checkpoint agree again, whatever a crash,
//! a reboot or a lost checkpoint left behind. Blocking.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use gpupool_api::cdi::Spec;
use gpupool_api::validation::is_uuid;

use super::checkpoint::{self, CheckpointData, ClaimEntry, ClaimState, MigRecord};
use super::files;
use super::fsutil;
use super::layout::{self, NodeLayout, CLAIM_FOLDERS};
use super::{MigCards, NodeStateError};
use crate::mig::{GpuInstance, MigManager};

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> NodeStateError {
    let path = path.to_path_buf();
    move |source| NodeStateError::Io { path, source }
}

/// What start-up found.
pub struct Recovered {
    /// The checkpoint to run with.
    pub data: CheckpointData,
    /// When the checkpoint on disk was unreadable: what was moved aside, for the node's Event.
    pub corrupt: Option<String>,
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Folders with their modes, the preload files, then the checkpoint against the files and the MIG
/// instances: completed entries get their spec back (written again after a reboot) unless their
/// MIG instances are gone, unfinished ones are rolled back, and files and instances no completed
/// entry accounts for are removed.
pub(super) fn recover(
    layout: &NodeLayout,
    boot_id: &str,
    mig: &MigCards,
) -> Result<Recovered, NodeStateError> {
    let state_dir = &layout.state_dir;
    let cdi_root = &layout.cdi_root;
    fsutil::ensure_private_dir(state_dir, 0o700).map_err(|source| NodeStateError::StateDir {
        path: state_dir.clone(),
        source,
    })?;
    fsutil::ensure_private_dir(cdi_root, 0o755).map_err(|source| NodeStateError::CdiRoot {
        path: cdi_root.clone(),
        source,
    })?;
    fsutil::ensure_private_dir(&layout.run_dir, 0o711).map_err(io_err(&layout.run_dir))?;
    for kind in CLAIM_FOLDERS {
        let root = layout.claim_folder_root(*kind);
        fsutil::ensure_private_dir(&root, 0o711).map_err(io_err(&root))?;
    }
    for lib in layout.libraries() {
        let preload = format!("{}\n", lib.container_path);
        let preload_file = layout.preload_file(lib);
        if fs::read_to_string(&preload_file).ok().as_deref() != Some(preload.as_str()) {
            fsutil::atomic_write(
                state_dir,
                lib.preload_file_name,
                &format!(".{}.tmp", lib.preload_file_name),
                preload.as_bytes(),
                0o644,
                None,
            )
            .map_err(io_err(&preload_file))?;
        }
    }

    let _lock = checkpoint::CheckpointLock::acquire(state_dir)
        .map_err(io_err(&state_dir.join(checkpoint::LOCK_FILE)))?;
    let mut corrupt = None;
    let mut data = match checkpoint::load(state_dir) {
        Ok(Some(data)) => data,
        Ok(None) => CheckpointData::default(),
        Err(e) => {
            let aside = checkpoint::move_aside(state_dir, unix_now())
                .map_err(io_err(&checkpoint::path(state_dir)))?;
            let message = format!(
                "checkpoint {} is unreadable ({e}); moved it to {} and starting with no prepared claims",
                checkpoint::path(state_dir).display(),
                aside.display()
            );
            tracing::error!("{message}");
            corrupt = Some(message);
            from_cdi_root(cdi_root)
        }
    };

    let rebooted = !data.boot_id.is_empty() && data.boot_id != boot_id;
    if rebooted {
        tracing::info!(previous = %data.boot_id, current = %boot_id, "node rebooted since the checkpoint was written: writing prepared claims' CDI specs again");
    }
    let remove_files = |uid: &str| -> Result<(), NodeStateError> {
        files::remove_spec(layout, uid).map_err(io_err(cdi_root))?;
        files::remove_claim_folders(layout, uid).map_err(io_err(&layout.run_dir))
    };
    let instances = mig_instances(mig);
    let mut keep = BTreeMap::new();
    for (uid, entry) in std::mem::take(&mut data.claims) {
        let valid_uid = is_uuid(&uid);
        match (&entry.state, &entry.spec) {
            (ClaimState::PrepareCompleted, Some(_))
                if valid_uid && missing_instance(&entry.mig, &instances).is_some() =>
            {
                // A reboot or a driver reload destroyed MIG instances: the spec would name a MIG
                // device that no longer exists. A fresh prepare creates new ones.
                tracing::error!(uid, device = ?missing_instance(&entry.mig, &instances), "a prepared claim's MIG instance is gone; dropping it so the next prepare starts over");
                destroy_records(mig.manager.as_ref(), &uid, &entry.mig);
                remove_files(&uid)?;
            }
            (ClaimState::PrepareCompleted, Some(spec))
                if valid_uid && rebooted && missing_device_node(spec).is_some() =>
            {
                // The cards moved or left with the reboot: a fresh prepare finds the truth.
                tracing::error!(uid, node = ?missing_device_node(spec), "a prepared claim's device node is gone after the reboot; dropping it so the next prepare starts over");
                remove_files(&uid)?;
            }
            (ClaimState::PrepareCompleted, Some(spec)) if valid_uid => {
                if rebooted || !layout.spec_path(&uid).exists() {
                    files::ensure_mount_sources(layout, &uid, spec)
                        .map_err(io_err(&layout.run_dir))?;
                    files::write_spec(layout, &uid, spec).map_err(io_err(cdi_root))?;
                }
                keep.insert(uid, entry);
            }
            _ => {
                tracing::info!(uid, state = ?entry.state, "rolling back an unfinished prepare");
                destroy_records(mig.manager.as_ref(), &uid, &entry.mig);
                if valid_uid {
                    remove_files(&uid)?;
                }
            }
        }
    }
    data.claims = keep;
    super::mps::recover(layout, &mut data, rebooted);
    sweep_orphans(layout, &data)?;
    sweep_mig(mig, &data);

    data.boot_id = boot_id.to_string();
    checkpoint::save(state_dir, &data)?;
    Ok(Recovered { data, corrupt })
}

/// Remove files of ours that no completed entry accounts for: orphans of a crash or of a lost
/// checkpoint.
fn sweep_orphans(layout: &NodeLayout, data: &CheckpointData) -> Result<(), NodeStateError> {
    let cdi_root = &layout.cdi_root;
    for dir_entry in fs::read_dir(cdi_root).map_err(io_err(cdi_root))? {
        let dir_entry = dir_entry.map_err(io_err(cdi_root))?;
        let name = dir_entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(uid) = layout::owned_spec_uid(name) else {
            continue;
        };
        let is_temp = name.ends_with(".tmp");
        if is_temp || !data.claims.contains_key(uid) {
            tracing::info!(
                file = name,
                "removing a CDI spec no prepared claim accounts for"
            );
            fsutil::remove_file(&dir_entry.path()).map_err(io_err(&dir_entry.path()))?;
        }
    }
    for kind in CLAIM_FOLDERS {
        let root = layout.claim_folder_root(*kind);
        for dir_entry in fs::read_dir(&root).map_err(io_err(&root))? {
            let dir_entry = dir_entry.map_err(io_err(&root))?;
            let name = dir_entry.file_name();
            if !name.to_str().is_some_and(|n| data.claims.contains_key(n)) {
                fsutil::remove_dir_all(&dir_entry.path()).map_err(io_err(&dir_entry.path()))?;
            }
        }
    }
    fsutil::sync_dir(cdi_root).map_err(io_err(cdi_root))
}

/// The GPU instances of each MIG card in MIG mode, by card UUID; a card that cannot be read is
/// left out (and logged): nothing is destroyed on it.
fn mig_instances(mig: &MigCards) -> BTreeMap<String, Vec<GpuInstance>> {
    let mut out = BTreeMap::new();
    for card in &mig.cards {
        let listed = mig.manager.mig_enabled(card).and_then(|enabled| {
            if enabled {
                mig.manager.gpu_instances(card)
            } else {
                Ok(Vec::new())
            }
        });
        match listed {
            Ok(instances) => {
                out.insert(card.clone(), instances);
            }
            Err(e) => {
                tracing::error!(card, error = %e, "cannot list the card's MIG instances; leaving them as they are")
            }
        }
    }
    out
}

/// The first MIG device of a completed entry whose GPU or compute instance does not exist.
fn missing_instance(
    records: &[MigRecord],
    instances: &BTreeMap<String, Vec<GpuInstance>>,
) -> Option<String> {
    records
        .iter()
        .find(|r| {
            let Some(listed) = instances.get(&r.parent_uuid) else {
                // Unreadable card: assume it is there rather than drop a running claim.
                return false;
            };
            let found = listed.iter().find(|gi| Some(gi.id) == r.gpu_instance);
            !found.is_some_and(|gi| {
                r.compute_instance
                    .is_some_and(|ci| gi.compute_instances.contains(&ci))
            })
        })
        .map(|r| r.device.clone())
}

/// Destroy what the records name, compute instance first; best effort (the sweep follows).
fn destroy_records(manager: &dyn MigManager, uid: &str, records: &[MigRecord]) {
    for r in records.iter().rev() {
        let Some(gi) = r.gpu_instance else { continue };
        let done = r
            .compute_instance
            .map_or(Ok(()), |ci| {
                manager.destroy_compute_instance(&r.parent_uuid, gi, ci)
            })
            .and_then(|()| manager.destroy_gpu_instance(&r.parent_uuid, gi));
        if let Err(e) = done {
            tracing::error!(uid, device = %r.device, error = %e, "cannot destroy a MIG instance of an unfinished prepare");
        }
    }
}

/// Destroy every MIG instance no completed entry accounts for: left by a crash between creating
/// an instance and recording it, or by a lost checkpoint. gpupool owns MIG on its cards.
fn sweep_mig(mig: &MigCards, data: &CheckpointData) {
    let accounted: std::collections::BTreeSet<(&str, u32)> = data
        .claims
        .values()
        .flat_map(|e| &e.mig)
        .filter_map(|r| Some((r.parent_uuid.as_str(), r.gpu_instance?)))
        .collect();
    for (card, instances) in mig_instances(mig) {
        for gi in instances {
            if accounted.contains(&(card.as_str(), gi.id)) {
                continue;
            }
            tracing::info!(
                card,
                gpu_instance = gi.id,
                profile = gi.profile_id,
                start = gi.start,
                "destroying a MIG instance no prepared claim accounts for"
            );
            let done = gi
                .compute_instances
                .iter()
                .try_for_each(|ci| mig.manager.destroy_compute_instance(&card, gi.id, *ci))
                .and_then(|()| mig.manager.destroy_gpu_instance(&card, gi.id));
            if let Err(e) = done {
                tracing::error!(card, gpu_instance = gi.id, error = %e, "cannot destroy a MIG instance no claim accounts for");
            }
        }
    }
}

/// The first device node a spec names that is not on this host.
fn missing_device_node(spec: &Spec) -> Option<String> {
    spec.devices
        .iter()
        .map(|d| &d.container_edits)
        .chain(std::iter::once(&spec.container_edits))
        .flat_map(|e| &e.device_nodes)
        .map(|n| n.host_path.clone().unwrap_or_else(|| n.path.clone()))
        .find(|p| !Path::new(p).exists())
}

/// Entries for the specs of ours found in the CDI root, when the checkpoint was lost. A spec that
/// does not parse or is not valid CDI is left out (and then removed as an orphan).
fn from_cdi_root(cdi_root: &Path) -> CheckpointData {
    let mut data = CheckpointData::default();
    let Ok(entries) = fs::read_dir(cdi_root) else {
        return data;
    };
    for dir_entry in entries.flatten() {
        let name = dir_entry.file_name();
        let Some(uid) = name.to_str().and_then(layout::owned_spec_uid) else {
            continue;
        };
        if name.to_str().is_some_and(|n| n.ends_with(".tmp")) || !is_uuid(uid) {
            continue;
        }
        let spec = fs::read(dir_entry.path())
            .ok()
            .and_then(|b| serde_json::from_slice::<Spec>(&b).ok())
            .filter(|s| {
                s.kind == gpupool_api::names::CDI_KIND && gpupool_api::cdi::validate(s).is_empty()
            });
        if let Some(spec) = spec {
            tracing::warn!(uid, "keeping a CDI spec found without a checkpoint; the claim will be prepared again when the kubelet asks");
            data.claims.insert(
                uid.to_string(),
                ClaimEntry {
                    state: ClaimState::PrepareCompleted,
                    namespace: String::new(),
                    name: String::new(),
                    devices: Vec::new(),
                    spec: Some(spec),
                    warning: None,
                    recovered: true,
                    mig: Vec::new(),
                    mps: Vec::new(),
                },
            );
        }
    }
    data
}

//! `<state-dir>/checkpoint.json`: what this node has prepared, surviving restarts and reboots.
//!
//! ```json
//! {"version": 1, "checksum": "<sha256 hex of the canonical data>", "data": {"bootId": "...", "claims": {...}}}
//! ```
//! The checksum covers the data re-serialised through `serde_json::Value`, so it does not depend
//! on the file's whitespace. Newer fields may be added to `data` later: version 1 readers ignore
//! them, and later versions must keep reading version 1.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};

use gpupool_api::cdi::Spec;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use thiserror::Error;

use super::fsutil;
use super::PreparedDevice;

pub const CHECKPOINT_FILE: &str = "checkpoint.json";
/// flock(2)ed around every read-modify-write, so that two driver processes on one node (a
/// DaemonSet rolling update with surge) never lose each other's entries.
pub const LOCK_FILE: &str = "checkpoint.lock";
const CHECKPOINT_TEMP: &str = ".checkpoint.json.tmp";
pub const VERSION: u32 = 1;

#[derive(Debug, Error)]
pub enum CheckpointError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("cannot write {path}: {source}")]
    Write { path: PathBuf, source: io::Error },
    #[error("not a checkpoint: {0}")]
    Parse(String),
    #[error("unsupported checkpoint version {0} (this driver reads version {VERSION})")]
    Version(u64),
    #[error("checksum mismatch: the file is corrupt")]
    Checksum,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ClaimState {
    PrepareStarted,
    PrepareCompleted,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimEntry {
    pub state: ClaimState,
    pub namespace: String,
    pub name: String,
    /// The answer given to the kubelet (empty while started).
    #[serde(default)]
    pub devices: Vec<PreparedDevice>,
    /// The spec written, so that it can be written again after a reboot with identical ids.
    #[serde(default)]
    pub spec: Option<Spec>,
    /// Shown in the claim's device status, kept so a restart can repeat it.
    #[serde(default)]
    pub warning: Option<String>,
    /// Rebuilt from a spec file after the checkpoint was lost: the spec stays (containers of the
    /// claim may restart and need it) but the kubelet's answer is unknown, so the next prepare
    /// does the work again and unprepare removes it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub recovered: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CheckpointData {
    pub boot_id: String,
    /// By claim UID.
    #[serde(default)]
    pub claims: BTreeMap<String, ClaimEntry>,
}

fn checksum(data: &serde_json::Value) -> String {
    let canonical = serde_json::to_vec(data).unwrap_or_default();
    hex::encode(Sha256::digest(&canonical))
}

pub fn encode(data: &CheckpointData) -> Vec<u8> {
    let value = serde_json::to_value(data).expect("checkpoint data is plain JSON");
    let file =
        serde_json::json!({ "version": VERSION, "checksum": checksum(&value), "data": value });
    serde_json::to_vec_pretty(&file).expect("a JSON value serialises")
}

pub fn decode(bytes: &[u8]) -> Result<CheckpointData, CheckpointError> {
    let file: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| CheckpointError::Parse(e.to_string()))?;
    let version = file
        .get("version")
        .and_then(|v| v.as_u64())
        .ok_or_else(|| CheckpointError::Parse("no version".into()))?;
    if version != u64::from(VERSION) {
        return Err(CheckpointError::Version(version));
    }
    let data = file
        .get("data")
        .ok_or_else(|| CheckpointError::Parse("no data".into()))?;
    if file.get("checksum").and_then(|c| c.as_str()) != Some(checksum(data).as_str()) {
        return Err(CheckpointError::Checksum);
    }
    serde_json::from_value(data.clone()).map_err(|e| CheckpointError::Parse(e.to_string()))
}

pub fn path(state_dir: &Path) -> PathBuf {
    state_dir.join(CHECKPOINT_FILE)
}

/// The checkpoint in `state_dir`; `Ok(None)` when there is none yet.
pub fn load(state_dir: &Path) -> Result<Option<CheckpointData>, CheckpointError> {
    let path = path(state_dir);
    match std::fs::read(&path) {
        Ok(bytes) => decode(&bytes).map(Some),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(CheckpointError::Read { path, source }),
    }
}

/// Write the checkpoint atomically, mode 0600. Callers serialise writers.
pub fn save(state_dir: &Path, data: &CheckpointData) -> Result<(), CheckpointError> {
    fsutil::atomic_write(
        state_dir,
        CHECKPOINT_FILE,
        CHECKPOINT_TEMP,
        &encode(data),
        0o600,
        None,
    )
    .map_err(|source| CheckpointError::Write {
        path: path(state_dir),
        source,
    })
}

/// An exclusive lock on the checkpoint, released on drop.
pub struct CheckpointLock {
    _file: std::fs::File,
}

impl CheckpointLock {
    /// Wait for the lock (blocking: call from a blocking context).
    pub fn acquire(state_dir: &Path) -> io::Result<Self> {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(state_dir.join(LOCK_FILE))?;
        loop {
            // SAFETY: flock on a file descriptor we own, for the lifetime of `file`.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } == 0 {
                return Ok(Self { _file: file });
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

/// One change to the claims of a checkpoint.
#[derive(Debug, Clone)]
pub enum Change {
    Put(String, Box<ClaimEntry>),
    Remove(String),
}

impl Change {
    pub fn apply(self, data: &mut CheckpointData) {
        match self {
            Change::Put(uid, entry) => {
                data.claims.insert(uid, *entry);
            }
            Change::Remove(uid) => {
                data.claims.remove(&uid);
            }
        }
    }
}

/// Under the lock: read the file (falling back to `current` when it is missing or unreadable),
/// apply `change`, write it; returns what was written.
pub fn update(
    state_dir: &Path,
    current: &CheckpointData,
    change: Change,
) -> Result<CheckpointData, CheckpointError> {
    let _lock = CheckpointLock::acquire(state_dir).map_err(|source| CheckpointError::Write {
        path: state_dir.join(LOCK_FILE),
        source,
    })?;
    let mut data = match load(state_dir) {
        Ok(Some(on_disk)) => on_disk,
        Ok(None) => current.clone(),
        Err(e) => {
            tracing::error!(error = %e, "checkpoint unreadable during an update; writing the in-memory copy");
            current.clone()
        }
    };
    change.apply(&mut data);
    save(state_dir, &data)?;
    Ok(data)
}

/// Move an unreadable checkpoint out of the way (`checkpoint.json.corrupt-<unix time>`) so the
/// driver can start empty instead of failing on it at every restart.
pub fn move_aside(state_dir: &Path, unix_time: u64) -> io::Result<PathBuf> {
    let aside = state_dir.join(format!("{CHECKPOINT_FILE}.corrupt-{unix_time}"));
    std::fs::rename(path(state_dir), &aside)?;
    fsutil::sync_dir(state_dir)?;
    Ok(aside)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> CheckpointData {
        let mut claims = BTreeMap::new();
        claims.insert(
            "0b7c4a49-6f1e-4a52-9d0e-6d1f3f7a5b10".to_string(),
            ClaimEntry {
                state: ClaimState::PrepareCompleted,
                namespace: "team-a".into(),
                name: "train".into(),
                devices: vec![PreparedDevice {
                    request_names: vec!["gpu".into()],
                    pool_name: "node-a".into(),
                    device_name: "gpu-0".into(),
                    cdi_device_ids: vec!["gpupool.dev/claim=x".into()],
                    share_id: Some("s1".into()),
                }],
                spec: None,
                warning: Some("w".into()),
                recovered: false,
            },
        );
        CheckpointData {
            boot_id: "b1".into(),
            claims,
        }
    }

    #[test]
    fn round_trips_through_a_file_with_mode_0600() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(load(dir.path()).unwrap(), None);
        save(dir.path(), &sample()).unwrap();
        assert_eq!(load(dir.path()).unwrap(), Some(sample()));
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(path(dir.path()))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let file: serde_json::Value =
            serde_json::from_slice(&std::fs::read(path(dir.path())).unwrap()).unwrap();
        assert_eq!(file["version"], 1);
        assert_eq!(
            file["data"]["claims"]["0b7c4a49-6f1e-4a52-9d0e-6d1f3f7a5b10"]["state"],
            "PrepareCompleted"
        );
    }

    #[test]
    fn corruption_of_every_kind_is_detected() {
        let good = encode(&sample());
        let truncated = &good[..good.len() / 2];
        assert!(matches!(decode(truncated), Err(CheckpointError::Parse(_))));
        assert!(matches!(decode(b""), Err(CheckpointError::Parse(_))));

        // Flip one byte inside a value of the data: still JSON, wrong checksum.
        let text = String::from_utf8(good.clone()).unwrap();
        let flipped = text.replacen("team-a", "team-b", 1);
        assert!(matches!(
            decode(flipped.as_bytes()),
            Err(CheckpointError::Checksum)
        ));

        let wrong_version = text.replacen("\"version\": 1", "\"version\": 7", 1);
        assert!(matches!(
            decode(wrong_version.as_bytes()),
            Err(CheckpointError::Version(7))
        ));

        // Whitespace does not matter, content does.
        let compact: serde_json::Value = serde_json::from_slice(&good).unwrap();
        assert_eq!(
            decode(&serde_json::to_vec(&compact).unwrap()).unwrap(),
            sample()
        );
    }

    #[test]
    fn a_corrupt_file_is_moved_aside() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(path(dir.path()), b"{\"version\":1,").unwrap();
        assert!(load(dir.path()).is_err());
        let aside = move_aside(dir.path(), 1700000000).unwrap();
        assert!(aside.ends_with("checkpoint.json.corrupt-1700000000"));
        assert_eq!(load(dir.path()).unwrap(), None);
    }

    #[test]
    fn updates_keep_entries_written_by_another_process() {
        let dir = tempfile::tempdir().unwrap();
        save(dir.path(), &sample()).unwrap();
        // This process's copy is stale: it never saw the sample's claim.
        let stale = CheckpointData {
            boot_id: "b1".into(),
            claims: BTreeMap::new(),
        };
        let mut entry = sample().claims.into_values().next().unwrap();
        entry.name = "other".into();
        let written = update(
            dir.path(),
            &stale,
            Change::Put("u2".into(), Box::new(entry)),
        )
        .unwrap();
        assert_eq!(written.claims.len(), 2);
        assert_eq!(load(dir.path()).unwrap().unwrap(), written);
        let written = update(dir.path(), &stale, Change::Remove("u2".into())).unwrap();
        assert_eq!(written, sample());
    }

    proptest! {
        #[test]
        fn decoding_arbitrary_bytes_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode(&bytes);
        }

        #[test]
        fn any_single_byte_flip_is_refused_or_harmless(pos in any::<prop::sample::Index>(), bit in 0u8..8) {
            let mut bytes = encode(&sample());
            let i = pos.index(bytes.len());
            bytes[i] ^= 1 << bit;
            // Either refused, or the flip hit insignificant whitespace and the data is intact.
            if let Ok(data) = decode(&bytes) {
                prop_assert_eq!(data, sample());
            }
        }
    }
}

//! `<state-dir>/checkpoint.json`: what this node has prepared, surviving restarts and reboots.
//!
//! ```json
//! {"version": 1, "checksum": "<sha256 hex of the data's bytes>", "data": {"bootId": "...", "claims": {...}}}
//! ```
//! Written on one line: the data is serialised once (compact, `": "` after keys) and the checksum
//! covers exactly those bytes, so a read of our own layout hashes the bytes between `"data": `
//! and the closing brace and parses them once. Files in any other layout still load when the
//! checksum matches the data re-serialised from its typed form, or (files of earlier drivers) the
//! data re-serialised through `serde_json::Value`. Newer fields may be added to `data` later:
//! version 1 readers ignore them, and later versions must keep reading version 1.
//!
//! [`Store`] keeps the in-memory copy authoritative and group-commits changes: one writer drains
//! every pending change and writes the file once for all of them.

use std::collections::BTreeMap;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

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

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// The checksum files of earlier drivers carry: over the data re-serialised through `Value`.
fn value_checksum(data: &serde_json::Value) -> String {
    sha256_hex(&serde_json::to_vec(data).unwrap_or_default())
}

/// Compact JSON with `": "` after keys: one line, yet `"bootId": "..."` reads as it always did.
struct OneLine;

impl serde_json::ser::Formatter for OneLine {
    fn begin_object_value<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        writer.write_all(b": ")
    }
}

/// The data's canonical bytes, which the checksum covers.
fn data_bytes(data: &CheckpointData) -> Vec<u8> {
    let mut out = Vec::with_capacity(4096);
    let mut ser = serde_json::Serializer::with_formatter(&mut out, OneLine);
    data.serialize(&mut ser)
        .expect("checkpoint data is plain JSON");
    out
}

const HEAD: &[u8] = b"{\"version\": 1, \"checksum\": \"";
const MID: &[u8] = b"\", \"data\": ";
const TAIL: &[u8] = b"}\n";
const HEX_LEN: usize = 64;

pub fn encode(data: &CheckpointData) -> Vec<u8> {
    let data = data_bytes(data);
    let mut file = Vec::with_capacity(HEAD.len() + HEX_LEN + MID.len() + data.len() + TAIL.len());
    file.extend_from_slice(HEAD);
    file.extend_from_slice(sha256_hex(&data).as_bytes());
    file.extend_from_slice(MID);
    file.extend_from_slice(&data);
    file.extend_from_slice(TAIL);
    file
}

/// Our own layout, checksum verified: the data's bytes parsed once.
fn decode_own_layout(bytes: &[u8]) -> Option<Result<CheckpointData, CheckpointError>> {
    let rest = bytes.strip_prefix(HEAD)?;
    let (checksum, rest) = rest.split_at_checked(HEX_LEN)?;
    let data = rest.strip_prefix(MID)?.strip_suffix(TAIL)?;
    if sha256_hex(data).as_bytes() != checksum {
        return None;
    }
    Some(serde_json::from_slice(data).map_err(|e| CheckpointError::Parse(e.to_string())))
}

pub fn decode(bytes: &[u8]) -> Result<CheckpointData, CheckpointError> {
    if let Some(decoded) = decode_own_layout(bytes) {
        return decoded;
    }
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
    let Some(stored) = file.get("checksum").and_then(|c| c.as_str()) else {
        return Err(CheckpointError::Checksum);
    };
    if stored == value_checksum(data) {
        return serde_json::from_value(data.clone())
            .map_err(|e| CheckpointError::Parse(e.to_string()));
    }
    // Our layout reformatted (by hand, by a tool): the checksum is over the canonical bytes.
    match CheckpointData::deserialize(data) {
        Ok(typed) if stored == sha256_hex(&data_bytes(&typed)) => Ok(typed),
        _ => Err(CheckpointError::Checksum),
    }
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
    write_file(state_dir, &encode(data))
}

fn write_file(state_dir: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    fsutil::atomic_write(
        state_dir,
        CHECKPOINT_FILE,
        CHECKPOINT_TEMP,
        bytes,
        0o600,
        None,
    )
    .map_err(|source| CheckpointError::Write {
        path: path(state_dir),
        source,
    })
}

/// What identifies one version of the checkpoint file: a file written by anyone else (another
/// driver process on the node during a rolling update) gets a new inode from its rename and a
/// new ctime, so a differing stamp means "read it again".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileStamp {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl FileStamp {
    fn of(meta: &std::fs::Metadata) -> Self {
        Self {
            dev: meta.dev(),
            ino: meta.ino(),
            len: meta.len(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            ctime: (meta.ctime(), meta.ctime_nsec()),
        }
    }
}

/// The stamp of the checkpoint file now; `None` when there is none or it cannot be looked at.
pub fn stamp(state_dir: &Path) -> Option<FileStamp> {
    std::fs::metadata(path(state_dir))
        .ok()
        .map(|m| FileStamp::of(&m))
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
        self.apply_with_undo(data);
    }

    /// Apply; returns what restores the claim's previous entry.
    fn apply_with_undo(self, data: &mut CheckpointData) -> Undo {
        match self {
            Change::Put(uid, entry) => {
                let previous = data.claims.insert(uid.clone(), *entry);
                Undo(uid, previous)
            }
            Change::Remove(uid) => {
                let previous = data.claims.remove(&uid);
                Undo(uid, previous)
            }
        }
    }
}

/// A claim's entry before a change (none: it had none).
struct Undo(String, Option<ClaimEntry>);

impl Undo {
    fn apply(self, data: &mut CheckpointData) {
        match self.1 {
            Some(entry) => data.claims.insert(self.0, entry),
            None => data.claims.remove(&self.0),
        };
    }
}

/// The checkpoint of a running driver: the in-memory copy is authoritative; the file is read
/// again only when another process wrote it since our last write. Changes are group-committed:
/// whoever finds no writer running becomes it, drains every pending change, writes the file
/// once (temp, fsync, rename, fsync of the folder, under `flock`), and answers every waiter with
/// the result; a caller's `commit` returns only once its own change is durable (or failed, and
/// then the in-memory copy is as before).
pub struct Store {
    dir: PathBuf,
    data: Mutex<CheckpointData>,
    queue: Mutex<Queue>,
    /// Files written since start (each one batch of changes).
    writes: std::sync::atomic::AtomicU64,
    /// The file as we last wrote it; only the writer touches it.
    written: Mutex<Option<FileStamp>>,
}

type Waiter = tokio::sync::oneshot::Sender<Result<(), String>>;

#[derive(Default)]
struct Queue {
    pending: Vec<(Change, Waiter)>,
    writing: bool,
}

impl Store {
    /// `data` as the file in `dir` holds it now, `written` the file's stamp then.
    pub fn new(dir: PathBuf, data: CheckpointData, written: Option<FileStamp>) -> Self {
        Self {
            dir,
            data: Mutex::new(data),
            queue: Mutex::new(Queue::default()),
            writes: Default::default(),
            written: Mutex::new(written),
        }
    }

    /// Look at the in-memory copy (it holds every committed change of this process).
    pub fn read<R>(&self, f: impl FnOnce(&CheckpointData) -> R) -> R {
        f(&self.data.lock().expect("checkpoint data is never poisoned"))
    }

    /// How many times the file was written (one per batch of changes).
    pub fn writes(&self) -> u64 {
        self.writes.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Make `change` durable; returns once it is on disk, with the batch's result.
    pub async fn commit(self: &Arc<Self>, change: Change) -> Result<(), String> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let start_writer = {
            let mut queue = self
                .queue
                .lock()
                .expect("checkpoint queue is never poisoned");
            queue.pending.push((change, tx));
            !std::mem::replace(&mut queue.writing, true)
        };
        if start_writer {
            let store = self.clone();
            tokio::task::spawn_blocking(move || store.run_writer());
        }
        rx.await
            .map_err(|_| "the checkpoint writer stopped before writing the change".to_string())?
    }

    fn run_writer(&self) {
        let _stop = WriterStop(self);
        loop {
            let batch = {
                let mut queue = self
                    .queue
                    .lock()
                    .expect("checkpoint queue is never poisoned");
                if queue.pending.is_empty() {
                    queue.writing = false;
                    return;
                }
                std::mem::take(&mut queue.pending)
            };
            let (changes, waiters): (Vec<_>, Vec<_>) = batch.into_iter().unzip();
            let result = self.write_batch(changes).map_err(|e| e.to_string());
            for waiter in waiters {
                let _ = waiter.send(result.clone());
            }
        }
    }

    fn write_batch(&self, changes: Vec<Change>) -> Result<(), CheckpointError> {
        let _lock =
            CheckpointLock::acquire(&self.dir).map_err(|source| CheckpointError::Write {
                path: self.dir.join(LOCK_FILE),
                source,
            })?;
        let mut written = self.written.lock().expect("only the writer takes it");
        let on_disk = match stamp(&self.dir) {
            None => None,
            Some(now) if Some(now) == *written => None,
            Some(_) => match load(&self.dir) {
                Ok(data) => data,
                Err(e) => {
                    tracing::error!(error = %e, "checkpoint unreadable during an update; writing the in-memory copy");
                    None
                }
            },
        };
        let (bytes, replaced, undo) = {
            let mut data = self.data.lock().expect("checkpoint data is never poisoned");
            let replaced = on_disk.map(|d| std::mem::replace(&mut *data, d));
            let undo: Vec<Undo> = changes
                .into_iter()
                .map(|c| c.apply_with_undo(&mut data))
                .collect();
            (encode(&data), replaced, undo)
        };
        match write_file(&self.dir, &bytes) {
            Ok(()) => {
                *written = stamp(&self.dir);
                self.writes
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Ok(())
            }
            Err(e) => {
                let mut data = self.data.lock().expect("checkpoint data is never poisoned");
                match replaced {
                    Some(previous) => *data = previous,
                    None => undo.into_iter().rev().for_each(|u| u.apply(&mut data)),
                }
                Err(e)
            }
        }
    }
}

/// A writer that panics must not leave `writing` set with nobody writing: its waiters get an
/// error (their senders drop) and the next commit starts a new writer.
struct WriterStop<'a>(&'a Store);

impl Drop for WriterStop<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            if let Ok(mut queue) = self.0.queue.lock() {
                queue.writing = false;
                queue.pending.clear();
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

    /// How drivers before the group commit wrote the file.
    fn legacy_encode(data: &CheckpointData) -> Vec<u8> {
        let value = serde_json::to_value(data).unwrap();
        let file = serde_json::json!({
            "version": 1,
            "checksum": value_checksum(&value),
            "data": value,
        });
        serde_json::to_vec_pretty(&file).unwrap()
    }

    #[test]
    fn files_of_earlier_drivers_still_load_and_ours_are_one_line() {
        let mut data = sample();
        data.claims.values_mut().next().unwrap().spec = Some(
            serde_json::from_value(serde_json::json!({
                "cdiVersion": "0.6.0",
                "kind": "gpupool.dev/claim",
                "devices": [{"name": "x", "containerEdits": {"env": ["A=1"]}}]
            }))
            .unwrap(),
        );
        assert_eq!(decode(&legacy_encode(&data)).unwrap(), data);
        let mut tampered = legacy_encode(&data);
        let at = tampered.iter().position(|b| *b == b'b').unwrap();
        tampered[at] = b'c';
        assert!(decode(&tampered).is_err());

        let ours = encode(&data);
        assert_eq!(ours.iter().filter(|b| **b == b'\n').count(), 1);
        assert!(ours.windows(11).any(|w| w == b"\"bootId\": \""));
        assert_eq!(decode(&ours).unwrap(), data);
    }

    fn entry(name: &str) -> Box<ClaimEntry> {
        let mut entry = sample().claims.into_values().next().unwrap();
        entry.name = name.into();
        Box::new(entry)
    }

    fn store_in(dir: &Path) -> Arc<Store> {
        save(dir, &CheckpointData::default()).unwrap();
        Arc::new(Store::new(
            dir.to_path_buf(),
            CheckpointData::default(),
            stamp(dir),
        ))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_changes_share_writes_and_all_are_durable_when_answered() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_in(dir.path());
        let commits = (0..16).map(|i| {
            let store = store.clone();
            async move {
                store
                    .commit(Change::Put(format!("u{i}"), entry(&format!("c{i}"))))
                    .await
                    .unwrap();
                // Answered: the change is in the file.
                assert!(load(store.dir.as_path())
                    .unwrap()
                    .unwrap()
                    .claims
                    .contains_key(&format!("u{i}")));
            }
        });
        futures::future::join_all(commits).await;
        assert!(
            store.writes() < 16,
            "{} writes for 16 changes",
            store.writes()
        );
        let on_disk = load(dir.path()).unwrap().unwrap();
        assert_eq!(on_disk.claims.len(), 16);
        assert_eq!(store.read(|d| d.clone()), on_disk);
    }

    #[tokio::test]
    async fn a_file_written_by_another_process_is_read_again_and_ours_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_in(dir.path());
        store
            .commit(Change::Put("ours".into(), entry("a")))
            .await
            .unwrap();
        // Another driver process adds its own claim.
        update(
            dir.path(),
            &CheckpointData::default(),
            Change::Put("theirs".into(), entry("b")),
        )
        .unwrap();
        store
            .commit(Change::Put("ours2".into(), entry("c")))
            .await
            .unwrap();
        let on_disk = load(dir.path()).unwrap().unwrap();
        assert_eq!(
            on_disk.claims.keys().collect::<Vec<_>>(),
            ["ours", "ours2", "theirs"]
        );
        assert_eq!(store.read(|d| d.clone()), on_disk);

        // Unchanged since our write: the in-memory copy is the base and the file is not read,
        // which an entry planted only in memory shows.
        store
            .data
            .lock()
            .unwrap()
            .claims
            .insert("memory-only".into(), *entry("m"));
        store.commit(Change::Remove("ours".into())).await.unwrap();
        let on_disk = load(dir.path()).unwrap().unwrap();
        assert_eq!(
            on_disk.claims.keys().collect::<Vec<_>>(),
            ["memory-only", "ours2", "theirs"]
        );
    }

    #[tokio::test]
    async fn a_failed_write_leaves_the_in_memory_copy_as_it_was() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_in(dir.path());
        store
            .commit(Change::Put("kept".into(), entry("a")))
            .await
            .unwrap();
        let before = store.read(|d| d.clone());
        // The temp file's name taken by a folder: the write cannot happen.
        std::fs::create_dir(dir.path().join(CHECKPOINT_TEMP)).unwrap();
        let err = store
            .commit(Change::Put("new".into(), entry("b")))
            .await
            .unwrap_err();
        assert!(err.contains("checkpoint.json"), "{err}");
        assert!(store.commit(Change::Remove("kept".into())).await.is_err());
        assert_eq!(store.read(|d| d.clone()), before);
        assert_eq!(load(dir.path()).unwrap().unwrap(), before);

        std::fs::remove_dir(dir.path().join(CHECKPOINT_TEMP)).unwrap();
        store
            .commit(Change::Put("new".into(), entry("b")))
            .await
            .unwrap();
        assert_eq!(load(dir.path()).unwrap().unwrap().claims.len(), 2);
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

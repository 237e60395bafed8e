//! What this node has prepared, surviving restarts and reboots: a snapshot,
//! `<state-dir>/checkpoint.json`, and a log of the changes made since, `<state-dir>/checkpoint.wal`.
//!
//! The snapshot:
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
//! The log continues exactly one snapshot: its first line names the SHA-256 of the snapshot
//! file's bytes, every further line is one change, `<sha256 hex of the JSON> <JSON>`:
//! ```text
//! gpupool-checkpoint-log 1 <sha256 hex of checkpoint.json>
//! 3f0a... {"put": ["<claim uid>", {"state": "PrepareCompleted", ...}]}
//! 9c41... {"remove": "<claim uid>"}
//! ```
//! A change is one `write` appended to the log, synced by a background thread (see [`Store`]
//! for why nobody waits for that), where rewriting the whole file cost four fsyncs on the
//! kubelet's critical path. Both files are still only ever replaced
//! atomically (temp file, fsync, rename, fsync of the folder): the snapshot and a fresh log when
//! the log has grown ([`COMPACT_AT_BYTES`]), at start-up and at an orderly shutdown. A log whose
//! first line names another snapshot is left over from a compaction cut short and is ignored.
//! An incomplete last line is a write cut short, never acknowledged, and is dropped; any other
//! damage makes the whole checkpoint unreadable (start-up then moves it aside).
//! Drivers before the log read the snapshot alone: one stopped in order leaves nothing in the log.
//!
//! [`Store`] keeps the in-memory copy authoritative.

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
use gpupool_api::claim::PreparedDevice;

pub const CHECKPOINT_FILE: &str = "checkpoint.json";
/// flock(2)ed around every read-modify-write, so that two driver processes on one node (a
/// DaemonSet rolling update with surge) never lose each other's entries.
pub const LOCK_FILE: &str = "checkpoint.lock";
const CHECKPOINT_TEMP: &str = ".checkpoint.json.tmp";
pub const LOG_FILE: &str = "checkpoint.wal";
const LOG_TEMP: &str = ".checkpoint.wal.tmp";
const LOG_MAGIC: &[u8] = b"gpupool-checkpoint-log 1 ";
const LOG_HEADER_LEN: usize = LOG_MAGIC.len() + HEX_LEN + 1;
/// The log is folded into a new snapshot once it is larger than this and than twice the
/// snapshot: replaying it at start stays short, and compactions stay rare (one in about 500
/// prepare/unprepare cycles), so they do not show in the kubelet's p99.
pub const COMPACT_AT_BYTES: u64 = 1 << 20;
pub const VERSION: u32 = 1;
/// How long a change may wait in the page cache for its `fdatasync` (see [`Store`]).
pub const SYNC_DELAY: std::time::Duration = std::time::Duration::from_millis(5);

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
    #[error("{LOG_FILE} line {line}: {reason}")]
    Log { line: usize, reason: String },
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
    /// The MIG instances of the claim's MIG devices, each step recorded before the next is
    /// taken (see [`MigRecord`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mig: Vec<MigRecord>,
    /// The card whose MPS control daemon the claim's share uses, recorded (in `PrepareStarted`)
    /// before the daemon is started or joined: a daemon runs while an entry names its card.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mps: Vec<MpsHold>,
}

/// A claim's share of an MPS card: what its container gets, and what the card's daemon must allow.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MpsHold {
    /// The card's UUID.
    pub card: String,
    /// `gpu-<i>`.
    pub device: String,
    /// `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`.
    pub percentage: u32,
    /// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`, MiB.
    pub memory_mib: u64,
}

/// Where a card's MPS control daemon is in its life. Each state is recorded before the step it
/// names: a crash in that step leaves a record that says what may exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum MpsDaemonState {
    /// Its folders and process may exist, its PID is not known yet.
    Starting,
    /// Running as `pid` since `startTime`.
    Running,
    /// Being stopped: the process, its servers and folders may still exist.
    Stopping,
}

/// A card's MPS control daemon, by card UUID in [`CheckpointData::mps`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MpsDaemonRecord {
    pub state: MpsDaemonState,
    /// `gpu-<i>`.
    pub device: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<i32>,
    /// The kernel's start time of `pid` (clock ticks after boot), which tells it from a later
    /// process with the same PID.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<u64>,
    /// How often it was found dead and started again since its first start.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub restarts: u32,
    /// The last time it was found dead, as the claims on the card are told until it stops.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// One MIG device of a claim, as far as it got: the intent (card, profile, placement) is
/// recorded before the GPU instance is created, its id before the compute instance is created,
/// the compute instance and the MIG device's UUID before the spec is written. Whatever a crash
/// interrupts, the next start knows what may exist and destroys it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigRecord {
    /// The device the claim was allocated, `gpu-<i>-mig-<profile>-<start>`.
    pub device: String,
    pub parent_uuid: String,
    pub profile_id: u32,
    /// Compute slices of the profile (what its compute instance spans).
    pub compute_slices: u32,
    /// First memory slice and how many.
    pub start: u32,
    pub size: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_instance: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_instance: Option<u32>,
    /// The MIG device's UUID (`MIG-...`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// Capability device nodes the container gets with it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_nodes: Vec<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CheckpointData {
    pub boot_id: String,
    /// By claim UID.
    #[serde(default)]
    pub claims: BTreeMap<String, ClaimEntry>,
    /// The MPS control daemons, by card UUID (see `node_state/mps.rs`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub mps: BTreeMap<String, MpsDaemonRecord>,
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

pub fn log_path(state_dir: &Path) -> PathBuf {
    state_dir.join(LOG_FILE)
}

/// One change to a checkpoint; one line of the log. The MPS daemons' changes are variants of
/// their own: a driver from before them cannot read such a line (during a rolling update only
/// when an MPS claim was prepared by the newer one; an orderly stop folds the log away).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Change {
    Put(String, Box<ClaimEntry>),
    Remove(String),
    /// A card's MPS daemon, by card UUID.
    PutMps(String, Box<MpsDaemonRecord>),
    RemoveMps(String),
}

impl Change {
    pub fn apply(self, data: &mut CheckpointData) {
        self.apply_with_undo(data);
    }

    /// Apply; returns what restores the previous entry.
    fn apply_with_undo(self, data: &mut CheckpointData) -> Undo {
        match self {
            Change::Put(uid, entry) => {
                let previous = data.claims.insert(uid.clone(), *entry);
                Undo::Claim(uid, previous)
            }
            Change::Remove(uid) => {
                let previous = data.claims.remove(&uid);
                Undo::Claim(uid, previous)
            }
            Change::PutMps(card, record) => {
                let previous = data.mps.insert(card.clone(), *record);
                Undo::Mps(card, previous)
            }
            Change::RemoveMps(card) => {
                let previous = data.mps.remove(&card);
                Undo::Mps(card, previous)
            }
        }
    }
}

/// An entry before a change (none: there was none). It lives for one commit, on the stack: boxing
/// the large variant would cost every prepare an allocation for nothing.
#[allow(clippy::large_enum_variant)]
enum Undo {
    Claim(String, Option<ClaimEntry>),
    Mps(String, Option<MpsDaemonRecord>),
}

impl Undo {
    fn apply(self, data: &mut CheckpointData) {
        fn restore<V>(map: &mut BTreeMap<String, V>, key: String, previous: Option<V>) {
            match previous {
                Some(value) => map.insert(key, value),
                None => map.remove(&key),
            };
        }
        match self {
            Undo::Claim(uid, previous) => restore(&mut data.claims, uid, previous),
            Undo::Mps(card, previous) => restore(&mut data.mps, card, previous),
        }
    }
}

/// The log's first line for a snapshot file's bytes.
fn log_header(snapshot: &[u8]) -> Vec<u8> {
    let mut line = Vec::with_capacity(LOG_HEADER_LEN);
    line.extend_from_slice(LOG_MAGIC);
    line.extend_from_slice(sha256_hex(snapshot).as_bytes());
    line.push(b'\n');
    line
}

/// Append a change's log line to `out`.
fn encode_change(change: &Change, out: &mut Vec<u8>) {
    let json = serde_json::to_vec(change).expect("a change is plain JSON");
    out.extend_from_slice(sha256_hex(&json).as_bytes());
    out.push(b' ');
    out.extend_from_slice(&json);
    out.push(b'\n');
}

/// What a log holds for one snapshot.
#[derive(Debug, PartialEq)]
struct LogContent {
    changes: Vec<Change>,
    /// Bytes up to the end of the last complete line: what to keep before appending.
    valid_len: u64,
}

/// Parse a log; `Ok(None)` when it does not continue the snapshot `snapshot_bytes` (left over
/// from a compaction cut short, or no log header at all).
fn decode_log(bytes: &[u8], snapshot_bytes: &[u8]) -> Result<Option<LogContent>, CheckpointError> {
    let header = log_header(snapshot_bytes);
    if !bytes.starts_with(&header) {
        return Ok(None);
    }
    let mut changes = Vec::new();
    let mut at = header.len();
    for (index, line) in bytes[at..].split_inclusive(|b| *b == b'\n').enumerate() {
        let Some(line) = line.strip_suffix(b"\n") else {
            // A write cut short: it was never acknowledged.
            break;
        };
        let line_no = index + 2;
        let bad = |reason: &str| CheckpointError::Log {
            line: line_no,
            reason: reason.to_string(),
        };
        let (checksum, json) = line
            .split_at_checked(HEX_LEN)
            .and_then(|(c, rest)| Some((c, rest.strip_prefix(b" ")?)))
            .ok_or_else(|| bad("not a checksummed change"))?;
        if sha256_hex(json).as_bytes() != checksum {
            return Err(bad("checksum mismatch"));
        }
        let change = serde_json::from_slice(json).map_err(|e| bad(&e.to_string()))?;
        changes.push(change);
        at += line.len() + 1;
    }
    Ok(Some(LogContent {
        changes,
        valid_len: at as u64,
    }))
}

/// Both files as read, under the lock.
struct OnDisk {
    data: CheckpointData,
    /// The log's valid length, when there is a log continuing this snapshot.
    log_len: Option<u64>,
    snapshot_len: u64,
}

fn read_optional(path: &Path) -> Result<Option<Vec<u8>>, CheckpointError> {
    match std::fs::read(path) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(CheckpointError::Read {
            path: path.to_path_buf(),
            source,
        }),
    }
}

fn read_on_disk(state_dir: &Path) -> Result<Option<OnDisk>, CheckpointError> {
    let Some(snapshot) = read_optional(&path(state_dir))? else {
        return Ok(None);
    };
    let mut data = decode(&snapshot)?;
    let log = match read_optional(&log_path(state_dir))? {
        Some(bytes) => decode_log(&bytes, &snapshot)?,
        None => None,
    };
    let log_len = log.map(|log| {
        for change in log.changes {
            change.apply(&mut data);
        }
        log.valid_len
    });
    Ok(Some(OnDisk {
        data,
        log_len,
        snapshot_len: snapshot.len() as u64,
    }))
}

/// The checkpoint in `state_dir` (the snapshot with its log replayed); `Ok(None)` when there is
/// none yet.
pub fn load(state_dir: &Path) -> Result<Option<CheckpointData>, CheckpointError> {
    Ok(read_on_disk(state_dir)?.map(|d| d.data))
}

/// Write the whole checkpoint atomically, mode 0600: a snapshot of `data` and an empty log for
/// it. Callers serialise writers.
pub fn save(state_dir: &Path, data: &CheckpointData) -> Result<(), CheckpointError> {
    write_snapshot(state_dir, data).map(|_| ())
}

/// [`save`]; returns the snapshot's length.
fn write_snapshot(state_dir: &Path, data: &CheckpointData) -> Result<u64, CheckpointError> {
    let snapshot = encode(data);
    let write_err = |path: PathBuf| move |source| CheckpointError::Write { path, source };
    fsutil::atomic_write(
        state_dir,
        CHECKPOINT_FILE,
        CHECKPOINT_TEMP,
        &snapshot,
        0o600,
        None,
    )
    .map_err(write_err(path(state_dir)))?;
    // Until this rename the old log names the old snapshot's bytes, so it is ignored.
    fsutil::atomic_write(
        state_dir,
        LOG_FILE,
        LOG_TEMP,
        &log_header(&snapshot),
        0o600,
        None,
    )
    .map_err(write_err(log_path(state_dir)))?;
    Ok(snapshot.len() as u64)
}

/// What identifies one version of a file: a file written by anyone else (another driver process
/// on the node during a rolling update) gets a new inode from its rename or a new size and
/// ctime from its append, so a differing stamp means "read it again".
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

    fn at(path: &Path) -> Option<Self> {
        std::fs::metadata(path).ok().map(|m| Self::of(&m))
    }
}

/// An exclusive lock on the checkpoint, released on drop.
pub struct CheckpointLock {
    _file: std::fs::File,
}

impl CheckpointLock {
    /// Wait for the lock (blocking: call from a blocking context).
    pub fn acquire(state_dir: &Path) -> io::Result<Self> {
        fsutil::lock_exclusive(&state_dir.join(LOCK_FILE)).map(|file| Self { _file: file })
    }

    fn in_dir(state_dir: &Path) -> Result<Self, CheckpointError> {
        Self::acquire(state_dir).map_err(|source| CheckpointError::Write {
            path: state_dir.join(LOCK_FILE),
            source,
        })
    }
}

/// The log as this process last left it, open for appending.
struct Appender {
    log: Arc<std::fs::File>,
    log_stamp: FileStamp,
    snapshot_stamp: FileStamp,
    snapshot_len: u64,
}

impl Appender {
    /// Open the log of the snapshot just read or written, dropping an incomplete last line.
    fn open(state_dir: &Path, log_len: u64, snapshot_len: u64) -> io::Result<Self> {
        let log = std::fs::OpenOptions::new()
            .append(true)
            .open(log_path(state_dir))?;
        if log.metadata()?.len() != log_len {
            log.set_len(log_len)?;
        }
        let snapshot_stamp = FileStamp::at(&path(state_dir))
            .ok_or_else(|| io::Error::other("the snapshot vanished under the lock"))?;
        Ok(Self {
            log_stamp: FileStamp::of(&log.metadata()?),
            log: Arc::new(log),
            snapshot_stamp,
            snapshot_len,
        })
    }

    /// Nobody else wrote either file since we did.
    fn is_current(&self, state_dir: &Path) -> bool {
        FileStamp::at(&log_path(state_dir)) == Some(self.log_stamp)
            && FileStamp::at(&path(state_dir)) == Some(self.snapshot_stamp)
    }

    fn should_compact(&self) -> bool {
        self.log_stamp.len > COMPACT_AT_BYTES.max(2 * self.snapshot_len)
    }

    /// Append `bytes`; on failure cut the log back to where it was (best effort), so that a
    /// crash before the next snapshot replays nothing of a change reported failed.
    fn append(&mut self, bytes: &[u8]) -> io::Result<()> {
        use std::io::Write;
        let before = self.log_stamp.len;
        let written = (&*self.log)
            .write_all(bytes)
            .and_then(|()| self.log.metadata());
        match written {
            Ok(meta) => {
                self.log_stamp = FileStamp::of(&meta);
                Ok(())
            }
            Err(e) => {
                let _ = self.log.set_len(before);
                Err(e)
            }
        }
    }
}

/// The writer's view of the files.
#[derive(Default)]
struct WriterState {
    /// `None`: read the files again before the next change (first write, someone else wrote,
    /// or a failure).
    appender: Option<Appender>,
    /// A write failed: the files may hold part of it, so the next change writes a snapshot of
    /// the in-memory copy instead of reading them again.
    compact_from_memory: bool,
}

/// Makes appended changes durable shortly after they were answered: `fdatasync` of the log on
/// its own thread, [`SYNC_DELAY`] after the first change not yet synced, so that no caller waits
/// for the disk and a burst of changes costs one sync (each costs the CPU a tenth of a prepare
/// here). A sync that fails makes the next change write a whole new snapshot (each step synced).
struct Syncer {
    dirty: std::sync::mpsc::Sender<Arc<std::fs::File>>,
    failed: Arc<std::sync::atomic::AtomicBool>,
    /// Syncs done, for tests.
    #[cfg_attr(not(test), allow(dead_code))]
    synced: Arc<std::sync::atomic::AtomicU64>,
}

impl Syncer {
    fn start() -> Self {
        let (dirty, pending) = std::sync::mpsc::channel::<Arc<std::fs::File>>();
        let failed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = failed.clone();
        let synced = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let count = synced.clone();
        let run = move || {
            // Ends when the store (the only sender) is dropped.
            while let Ok(mut log) = pending.recv() {
                std::thread::sleep(SYNC_DELAY);
                // Everything appended until now is covered by one sync of the newest log.
                while let Ok(newer) = pending.try_recv() {
                    log = newer;
                }
                if let Err(e) = log.sync_data() {
                    tracing::error!(error = %e, "syncing the checkpoint log failed; writing a new snapshot with the next change");
                    flag.store(true, std::sync::atomic::Ordering::SeqCst);
                }
                count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        };
        std::thread::Builder::new()
            .name("checkpoint-sync".into())
            .spawn(run)
            .expect("a thread can be started at start-up");
        Self {
            dirty,
            failed,
            synced,
        }
    }
}

/// The checkpoint of a running driver: the in-memory copy is authoritative; the files are read
/// again only when another process wrote them since our last write.
///
/// [`Store::commit`] appends one line to the log (under `flock`) and returns once it is written:
/// from then on a crash of this process at any moment loses nothing, since the kernel keeps the
/// page. A power cut can lose the changes of the last [`SYNC_DELAY`] and a sync, until the
/// [`Syncer`]'s `fdatasync`; that costs nothing a reboot does not repair anyway: the CDI specs live on a tmpfs
/// and are gone with the reboot, start-up removes any spec without a completed entry, unprepare
/// removes a claim's files by its UID whether or not it has an entry, and the kubelet, which
/// reads the claim from the API server before it calls, prepares its pods' claims again after a
/// reboot and gets the same CDI ids from a fresh prepare. Waiting for the disk instead cost each
/// prepare and unprepare one flush of the disk cache (0.1 to 0.3 ms here, more on a busy disk).
pub struct Store {
    dir: PathBuf,
    data: Mutex<CheckpointData>,
    writer: Mutex<WriterState>,
    syncer: Syncer,
}

impl Store {
    /// `data` as the files in `dir` hold it now.
    pub fn new(dir: PathBuf, data: CheckpointData) -> Self {
        Self {
            dir,
            data: Mutex::new(data),
            writer: Mutex::new(WriterState::default()),
            syncer: Syncer::start(),
        }
    }

    /// Look at the in-memory copy (it holds every committed change of this process).
    pub fn read<R>(&self, f: impl FnOnce(&CheckpointData) -> R) -> R {
        f(&self.data.lock().expect("checkpoint data is never poisoned"))
    }

    /// Record `change` in the log (blocking: call from a blocking context); on failure the
    /// in-memory copy is as before.
    pub fn commit(&self, change: Change) -> Result<(), CheckpointError> {
        let _lock = CheckpointLock::in_dir(&self.dir)?;
        let mut state = self.writer.lock().expect("only the writer takes it");
        if self
            .syncer
            .failed
            .swap(false, std::sync::atomic::Ordering::SeqCst)
        {
            state.appender = None;
            state.compact_from_memory = true;
        }
        let replaced = self.catch_up(&mut state);
        let mut line = Vec::with_capacity(512);
        encode_change(&change, &mut line);
        let undo = change
            .apply_with_undo(&mut self.data.lock().expect("checkpoint data is never poisoned"));
        let result = match state.appender.as_mut() {
            Some(appender) => appender
                .append(&line)
                .map_err(|source| CheckpointError::Write {
                    path: log_path(&self.dir),
                    source,
                }),
            None => self.write_compacted(&mut state),
        };
        match result {
            Ok(()) => {
                let appender = state.appender.as_ref().expect("set by a successful write");
                if appender.should_compact() {
                    if let Err(e) = self.write_compacted(&mut state) {
                        tracing::warn!(error = %e, "could not fold the checkpoint log into a new snapshot; will try again");
                    }
                } else {
                    let _ = self.syncer.dirty.send(appender.log.clone());
                }
                Ok(())
            }
            Err(e) => {
                // The files may hold part of what is reported failed (a snapshot written before
                // its log failed, say): never read them back as they are.
                state.appender = None;
                state.compact_from_memory = true;
                let mut data = self.data.lock().expect("checkpoint data is never poisoned");
                match replaced {
                    Some(previous) => *data = previous,
                    None => undo.apply(&mut data),
                }
                Err(e)
            }
        }
    }

    /// Fold the log into a new snapshot now (an orderly shutdown: drivers before the log then
    /// read everything from the snapshot). Blocking.
    pub fn compact(&self) -> Result<(), CheckpointError> {
        let _lock = CheckpointLock::in_dir(&self.dir)?;
        let mut state = self.writer.lock().expect("only the writer takes it");
        self.catch_up(&mut state);
        self.write_compacted(&mut state)
    }

    /// Whether the files are still as this process last wrote or read them (two stats, no
    /// lock): then [`Store::refresh`] has nothing to read. A write another process makes right
    /// after is caught by the next [`Store::commit`], which checks again under the lock.
    pub fn is_current(&self) -> bool {
        let state = self.writer.lock().expect("only the writer takes it");
        !state.compact_from_memory
            && state
                .appender
                .as_ref()
                .is_some_and(|a| a.is_current(&self.dir))
    }

    /// Make the in-memory copy what the files hold, when another process wrote them since this
    /// one last did (blocking). For drivers that share the files and take turns: called at the
    /// start of a turn, it shows the claims the other prepared or unprepared meanwhile.
    pub fn refresh(&self) -> Result<(), CheckpointError> {
        let _lock = CheckpointLock::in_dir(&self.dir)?;
        let mut state = self.writer.lock().expect("only the writer takes it");
        self.catch_up(&mut state);
        Ok(())
    }

    /// Under the lock: make the in-memory copy what the files hold when someone else wrote
    /// them (or nothing is known of them yet). Returns the copy it replaced.
    fn catch_up(&self, state: &mut WriterState) -> Option<CheckpointData> {
        if state.compact_from_memory
            || state
                .appender
                .as_ref()
                .is_some_and(|a| a.is_current(&self.dir))
        {
            return None;
        }
        state.appender = None;
        let on_disk = match read_on_disk(&self.dir) {
            Ok(on_disk) => on_disk?,
            Err(e) => {
                tracing::error!(error = %e, "checkpoint unreadable during an update; writing the in-memory copy");
                return None;
            }
        };
        if let Some(log_len) = on_disk.log_len {
            match Appender::open(&self.dir, log_len, on_disk.snapshot_len) {
                Ok(appender) => state.appender = Some(appender),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot append to the checkpoint log; writing a new snapshot")
                }
            }
        }
        let mut data = self.data.lock().expect("checkpoint data is never poisoned");
        Some(std::mem::replace(&mut *data, on_disk.data))
    }

    /// Snapshot the in-memory copy and start a new log (each step synced).
    fn write_compacted(&self, state: &mut WriterState) -> Result<(), CheckpointError> {
        state.appender = None;
        let data = self.data.lock().expect("checkpoint data is never poisoned");
        let snapshot_len = write_snapshot(&self.dir, &data)?;
        drop(data);
        state.compact_from_memory = false;
        let appender =
            Appender::open(&self.dir, LOG_HEADER_LEN as u64, snapshot_len).map_err(|source| {
                CheckpointError::Write {
                    path: log_path(&self.dir),
                    source,
                }
            })?;
        state.appender = Some(appender);
        Ok(())
    }
}

/// Under the lock: read the files (falling back to `current` when there are none or they are
/// unreadable), apply `change`, write a new snapshot; returns what was written. What another
/// driver process on the node does, for tests.
#[cfg(test)]
fn update(
    state_dir: &Path,
    current: &CheckpointData,
    change: Change,
) -> Result<CheckpointData, CheckpointError> {
    let _lock = CheckpointLock::in_dir(state_dir)?;
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

/// Move an unreadable checkpoint out of the way (`checkpoint.json.corrupt-<unix time>`, and the
/// log beside it as `checkpoint.wal.corrupt-<unix time>` when it holds any change) so the driver
/// can start empty instead of failing on it at every restart.
pub fn move_aside(state_dir: &Path, unix_time: u64) -> io::Result<PathBuf> {
    let aside = state_dir.join(format!("{CHECKPOINT_FILE}.corrupt-{unix_time}"));
    match std::fs::rename(path(state_dir), &aside) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let log = log_path(state_dir);
    match std::fs::read(&log) {
        Ok(bytes) if bytes.iter().filter(|b| **b == b'\n').count() > 1 => std::fs::rename(
            &log,
            state_dir.join(format!("{LOG_FILE}.corrupt-{unix_time}")),
        )?,
        Ok(_) => {
            fsutil::remove_file(&log)?;
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
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
                mig: Vec::new(),
                mps: Vec::new(),
            },
        );
        CheckpointData {
            boot_id: "b1".into(),
            claims,
            mps: BTreeMap::new(),
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
    fn mps_daemons_and_holds_go_through_the_log_and_files_without_them_still_load() {
        let dir = tempfile::tempdir().unwrap();
        save(dir.path(), &sample()).unwrap();
        let store = Store::new(dir.path().to_path_buf(), sample());
        let card = "GPU-51b8cb73-0d3e-4d3c-9a8e-000000000001".to_string();
        let mut holder = sample().claims.into_values().next().unwrap();
        holder.mps = vec![MpsHold {
            card: card.clone(),
            device: "gpu-0".into(),
            percentage: 30,
            memory_mib: 8192,
        }];
        store
            .commit(Change::Put("u-mps".into(), Box::new(holder.clone())))
            .unwrap();
        let running = MpsDaemonRecord {
            state: MpsDaemonState::Running,
            device: "gpu-0".into(),
            pid: Some(4242),
            start_time: Some(987_654),
            restarts: 1,
            failure: Some("found dead".into()),
        };
        store
            .commit(Change::PutMps(card.clone(), Box::new(running.clone())))
            .unwrap();
        let loaded = load(dir.path()).unwrap().unwrap();
        assert_eq!(loaded.mps.get(&card), Some(&running));
        assert_eq!(loaded.claims["u-mps"].mps, holder.mps);
        store.commit(Change::RemoveMps(card.clone())).unwrap();
        assert!(load(dir.path()).unwrap().unwrap().mps.is_empty());
        // What a driver before MPS wrote has neither field, and reads back as no daemons.
        let text = String::from_utf8(encode(&sample())).unwrap();
        assert!(!text.contains("\"mps\""), "{text}");
        assert!(decode(text.as_bytes()).unwrap().mps.is_empty());
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
            mps: BTreeMap::new(),
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
        Arc::new(Store::new(dir.to_path_buf(), CheckpointData::default()))
    }

    /// The claims the files hold, as a restarted driver would read them.
    /// A store with one committed claim, `kept`, and its data as committed.
    fn store_holding_one_claim() -> (tempfile::TempDir, Arc<Store>, CheckpointData) {
        let dir = tempfile::tempdir().unwrap();
        let store = store_in(dir.path());
        store
            .commit(Change::Put("kept".into(), entry("a")))
            .unwrap();
        let before = store.read(|d| d.clone());
        (dir, store, before)
    }

    fn claim_uids(dir: &Path) -> Vec<String> {
        load(dir).unwrap().unwrap().claims.into_keys().collect()
    }

    fn log_lines(dir: &Path) -> usize {
        std::fs::read(log_path(dir))
            .unwrap()
            .iter()
            .filter(|b| **b == b'\n')
            .count()
    }

    #[test]
    fn concurrent_changes_are_all_in_the_log_when_answered() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_in(dir.path());
        let snapshot = std::fs::read(path(dir.path())).unwrap();
        std::thread::scope(|scope| {
            for i in 0..16 {
                let store = &store;
                scope.spawn(move || {
                    store
                        .commit(Change::Put(format!("u{i}"), entry(&format!("c{i}"))))
                        .unwrap();
                    // Answered: the change is in the files.
                    assert!(load(store.dir.as_path())
                        .unwrap()
                        .unwrap()
                        .claims
                        .contains_key(&format!("u{i}")));
                });
            }
        });
        let on_disk = load(dir.path()).unwrap().unwrap();
        assert_eq!(on_disk.claims.len(), 16);
        assert_eq!(store.read(|d| d.clone()), on_disk);
        // Appended to the log, one line per change; the snapshot was not rewritten.
        assert_eq!(std::fs::read(path(dir.path())).unwrap(), snapshot);
        assert_eq!(log_lines(dir.path()), 1 + 16);
    }

    #[test]
    fn the_log_is_synced_after_changes_without_anyone_waiting() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_in(dir.path());
        let synced = || {
            store
                .syncer
                .synced
                .load(std::sync::atomic::Ordering::Relaxed)
        };
        assert_eq!(synced(), 0);
        for i in 0..20 {
            store
                .commit(Change::Put(format!("u{i}"), entry("n")))
                .unwrap();
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while synced() == 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        // At least one sync, at most one per change (they coalesce when the disk is slower).
        assert!((1..=20).contains(&synced()), "{} syncs", synced());
    }

    #[test]
    fn files_written_by_another_process_are_read_again_and_ours_are_not() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_in(dir.path());
        store
            .commit(Change::Put("ours".into(), entry("a")))
            .unwrap();
        // Another driver process adds its own claim (and writes a new snapshot).
        update(
            dir.path(),
            &CheckpointData::default(),
            Change::Put("theirs".into(), entry("b")),
        )
        .unwrap();
        store
            .commit(Change::Put("ours2".into(), entry("c")))
            .unwrap();
        let on_disk = load(dir.path()).unwrap().unwrap();
        assert_eq!(
            on_disk.claims.keys().collect::<Vec<_>>(),
            ["ours", "ours2", "theirs"]
        );
        assert_eq!(store.read(|d| d.clone()), on_disk);

        // Unchanged since our write: the files are not read again, which an entry planted only
        // in memory shows (reading them would have dropped it).
        store
            .data
            .lock()
            .unwrap()
            .claims
            .insert("memory-only".into(), *entry("m"));
        store.commit(Change::Remove("ours".into())).unwrap();
        assert_eq!(
            store.read(|d| d.claims.keys().cloned().collect::<Vec<_>>()),
            ["memory-only", "ours2", "theirs"]
        );
        assert_eq!(claim_uids(dir.path()), ["ours2", "theirs"]);
    }

    #[test]
    fn a_refresh_shows_what_another_store_committed_and_keeps_ours_when_nobody_did() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (store_in(dir.path()), store_in(dir.path()));
        a.commit(Change::Put("by-a".into(), entry("a"))).unwrap();
        b.refresh().unwrap();
        let uids = |s: &Store| s.read(|d| d.claims.keys().cloned().collect::<Vec<_>>());
        assert_eq!(uids(&b), ["by-a"]);
        b.commit(Change::Put("by-b".into(), entry("b"))).unwrap();
        b.commit(Change::Remove("by-a".into())).unwrap();
        a.refresh().unwrap();
        assert_eq!(uids(&a), ["by-b"]);

        // Nothing written since a's refresh: an entry planted only in a's memory stays, so a
        // refresh with no news costs no read.
        a.data
            .lock()
            .unwrap()
            .claims
            .insert("memory-only".into(), *entry("m"));
        a.refresh().unwrap();
        assert_eq!(uids(&a), ["by-b", "memory-only"]);
    }

    #[test]
    fn a_failed_snapshot_leaves_the_in_memory_copy_as_it_was() {
        let (dir, store, before) = store_holding_one_claim();
        store.compact().unwrap();
        // No log: the next change writes a snapshot, and the temp file's name taken by a folder
        // makes that impossible.
        std::fs::remove_file(log_path(dir.path())).unwrap();
        std::fs::create_dir(dir.path().join(CHECKPOINT_TEMP)).unwrap();
        let err = store
            .commit(Change::Put("new".into(), entry("b")))
            .unwrap_err()
            .to_string();
        assert!(err.contains("checkpoint.json"), "{err}");
        assert!(store.commit(Change::Remove("kept".into())).is_err());
        assert_eq!(store.read(|d| d.clone()), before);
        assert_eq!(load(dir.path()).unwrap().unwrap(), before);

        std::fs::remove_dir(dir.path().join(CHECKPOINT_TEMP)).unwrap();
        store.commit(Change::Put("new".into(), entry("b"))).unwrap();
        assert_eq!(load(dir.path()).unwrap().unwrap().claims.len(), 2);
        assert!(log_path(dir.path()).exists());
    }

    #[test]
    fn a_failed_append_is_never_replayed() {
        let (dir, store, before) = store_holding_one_claim();
        // The writer's log handle goes read-only: the append fails.
        store
            .writer
            .lock()
            .unwrap()
            .appender
            .as_mut()
            .expect("the first write opened the log")
            .log = Arc::new(std::fs::File::open(log_path(dir.path())).unwrap());
        let err = store
            .commit(Change::Put("lost".into(), entry("b")))
            .unwrap_err()
            .to_string();
        assert!(err.contains("checkpoint.wal"), "{err}");
        assert_eq!(store.read(|d| d.clone()), before);

        // The next change writes a snapshot of the in-memory copy: nothing of the failed batch.
        store
            .commit(Change::Put("next".into(), entry("c")))
            .unwrap();
        let on_disk = load(dir.path()).unwrap().unwrap();
        assert_eq!(on_disk.claims.keys().collect::<Vec<_>>(), ["kept", "next"]);
        assert_eq!(log_lines(dir.path()), 1);
    }

    #[test]
    fn an_incomplete_last_line_is_dropped_and_damage_elsewhere_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_in(dir.path());
        for name in ["a", "b"] {
            store.commit(Change::Put(name.into(), entry(name))).unwrap();
        }
        let good = std::fs::read(log_path(dir.path())).unwrap();

        // A write cut short by a crash: ignored, and cut off before the next append.
        let mut torn = good.clone();
        let mut line = Vec::new();
        encode_change(&Change::Put("torn".into(), entry("t")), &mut line);
        torn.extend_from_slice(&line[..line.len() / 2]);
        std::fs::write(log_path(dir.path()), &torn).unwrap();
        assert_eq!(claim_uids(dir.path()), ["a", "b"]);
        let restarted = Arc::new(Store::new(
            dir.path().to_path_buf(),
            CheckpointData::default(),
        ));
        restarted.commit(Change::Remove("a".into())).unwrap();
        assert_eq!(claim_uids(dir.path()), ["b"]);
        assert_eq!(log_lines(dir.path()), 4);

        // A complete line that does not match its checksum: the checkpoint is unreadable.
        let text = String::from_utf8(good).unwrap();
        let flipped = text.replacen("\"name\":\"a\"", "\"name\":\"x\"", 1);
        assert_ne!(flipped, text);
        std::fs::write(log_path(dir.path()), flipped).unwrap();
        let err = load(dir.path()).unwrap_err();
        assert!(matches!(err, CheckpointError::Log { line: 2, .. }), "{err}");
        assert!(err.to_string().contains("checkpoint.wal line 2"), "{err}");
    }

    #[test]
    fn a_log_of_another_snapshot_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        save(dir.path(), &sample()).unwrap();
        // A compaction cut short after the snapshot's rename: the old log names the old one.
        let mut stale = log_header(b"the snapshot before");
        encode_change(
            &Change::Remove("0b7c4a49-6f1e-4a52-9d0e-6d1f3f7a5b10".into()),
            &mut stale,
        );
        std::fs::write(log_path(dir.path()), stale).unwrap();
        assert_eq!(load(dir.path()).unwrap().unwrap(), sample());
    }

    #[test]
    fn a_grown_log_is_folded_into_a_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_in(dir.path());
        let mut line = Vec::new();
        encode_change(&Change::Put("u".into(), entry("n")), &mut line);
        let changes = 2 * (COMPACT_AT_BYTES as usize / line.len());
        for i in 0..changes {
            store
                .commit(Change::Put(format!("u{i}"), entry("n")))
                .unwrap();
            if i % 2 == 1 {
                store.commit(Change::Remove(format!("u{}", i - 1))).unwrap();
            }
        }
        let log_len = std::fs::metadata(log_path(dir.path())).unwrap().len();
        assert!(
            log_len <= COMPACT_AT_BYTES + line.len() as u64,
            "the log is {log_len} bytes after {changes} puts"
        );
        let on_disk = load(dir.path()).unwrap().unwrap();
        assert_eq!(on_disk.claims.len(), changes / 2);
        assert_eq!(store.read(|d| d.clone()), on_disk);

        // An orderly stop folds the rest: the snapshot alone holds everything.
        store.compact().unwrap();
        assert_eq!(log_lines(dir.path()), 1);
        assert_eq!(
            decode(&std::fs::read(path(dir.path())).unwrap()).unwrap(),
            on_disk
        );
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

//! The shared accounting file: one per container, mapped `MAP_SHARED` by each of its processes.
//!
//! No process-shared mutex or semaphore lives in the file: one held by a process that was killed
//! stays held. Coordination uses open-file-description locks (`F_OFD_SETLK`) on byte ranges,
//! which the kernel drops when the last descriptor of the description is closed, that is when the
//! process dies, whatever PID namespace it is in:
//! - the header lock (byte 0), taken briefly to check and record a charge, reap, or edit the header;
//! - each process slot's range, held by its owner for its whole life. A slot marked in use whose
//!   range someone else can lock belongs to a dead process: its charges are released ("reaped").
//!
//! OFD locks of one description never conflict with each other, so threads of one process are
//! serialised by a mutex in front of the header lock, and a process never judges its own slot.
//! Several [`SharedFile`]s opened in one process behave as different processes (different
//! descriptions), which the unit tests below rely on.

use crate::env::{Config, Uuid, MAX_DEVICES};
use crate::layout::{self, Header, LayoutError};
use crate::sys::{self, errno_text, now_ns, LockFailure, MapError, MappedFile, RangeGuard};
use std::fmt;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// The longest a thread waits for the header lock. It is held for microseconds at a time, so
/// reaching this means its holder is stopped (SIGSTOP, a debugger): better an error than a hang.
pub const LOCK_TIMEOUT: Duration = Duration::from_secs(2);

/// Dead processes are looked for at most this often on the allocation path (and always before an
/// allocation is refused), so a kill -9 is noticed within this time by anyone who allocates or
/// asks for free memory.
pub const REAP_INTERVAL: Duration = Duration::from_millis(100);

#[derive(Debug)]
pub enum SharedError {
    Open { path: String, errno: i32 },
    Map { path: String, errno: i32 },
    LockTimeout { path: String },
    Lock { path: String, errno: i32 },
    NoFreeSlot { path: String },
}

impl fmt::Display for SharedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SharedError::Open { path, errno } => {
                write!(
                    f,
                    "cannot open or create the shared file {path}: {}",
                    errno_text(*errno)
                )
            }
            SharedError::Map { path, errno } => {
                write!(
                    f,
                    "cannot size or map the shared file {path}: {}",
                    errno_text(*errno)
                )
            }
            SharedError::LockTimeout { path } => {
                write!(f, "the header lock of {path} was not free within {LOCK_TIMEOUT:?} (its holder is stopped?)")
            }
            SharedError::Lock { path, errno } => {
                write!(f, "cannot lock {path}: {}", errno_text(*errno))
            }
            SharedError::NoFreeSlot { path } => {
                write!(
                    f,
                    "{path}: all {} process slots are in use",
                    layout::SLOT_COUNT
                )
            }
        }
    }
}

/// Claim index -> GPU UUID.
pub type UuidMap = [Option<Uuid>; MAX_DEVICES];

/// The map after a merge, and the entries the driver's UUIDs replaced: (index, was, now).
#[derive(Debug, PartialEq, Eq)]
pub struct MergedMap {
    pub map: UuidMap,
    pub replaced: Vec<(usize, Uuid, Uuid)>,
}

/// What attaching found in the file, for the caller's log.
#[derive(Debug, PartialEq, Eq)]
pub enum Attached {
    /// A new file, initialised with our limits.
    Created,
    /// Made with the limits we have.
    Matching,
    /// Made with other limits: the header now holds ours; live processes' charges were kept.
    LimitsReplaced { old: String },
    /// Not a file of this layout: re-initialised from scratch.
    Reinitialised { found: String },
}

/// A dead process whose charges were released.
#[derive(Debug, PartialEq, Eq)]
pub struct Reaped {
    pub pid: u32,
    pub bytes: u64,
}

pub struct SharedFile {
    file: MappedFile,
    /// Serialises this process's threads in front of the header lock (see the module docs).
    header_mutex: Mutex<()>,
    /// The slot this process claimed (usize::MAX: none), set under the header lock as it is
    /// claimed. A reap never takes it, whatever its caller knows: our own lock on its range never
    /// conflicts with us, so to our own eyes it always looks dead, and a thread asking for a view
    /// while another claims it would otherwise reap it (every later charge then went unseen).
    claimed: std::sync::atomic::AtomicUsize,
}

/// Holds the header lock (the process mutex and the OFD lock on byte 0) until dropped.
pub struct HeaderGuard<'a> {
    _range: RangeGuard<'a>,
}

impl From<MapError> for SharedError {
    fn from(error: MapError) -> SharedError {
        match error {
            MapError::Open { path, errno } => SharedError::Open { path, errno },
            MapError::Map { path, errno } => SharedError::Map { path, errno },
            MapError::Lock {
                path,
                failure: LockFailure::Timeout,
            } => SharedError::LockTimeout { path },
            MapError::Lock {
                path,
                failure: LockFailure::Errno(errno),
            } => SharedError::Lock { path, errno },
        }
    }
}

impl SharedFile {
    /// Opens (creating if needed, with its folder) and maps the file. Nothing is read yet: call
    /// [`SharedFile::attach`].
    pub fn open(path: &str) -> Result<SharedFile, SharedError> {
        let file = MappedFile::open(
            path,
            layout::FILE_SIZE as usize,
            true,
            layout::HEADER_LOCK,
            LOCK_TIMEOUT,
        )?;
        Ok(SharedFile {
            claimed: std::sync::atomic::AtomicUsize::new(usize::MAX),
            file,
            header_mutex: Mutex::new(()),
        })
    }

    pub fn path(&self) -> &str {
        self.file.path()
    }

    pub fn fd(&self) -> libc::c_int {
        self.file.fd()
    }

    /// The file's device and inode: the container's identity on a card's arbiter.
    pub fn identity(&self) -> Option<(u64, u64)> {
        self.file.identity()
    }

    /// Takes the header lock, waiting at most [`LOCK_TIMEOUT`] in all (see [`sys::lock_range`]).
    pub fn lock_header(&self) -> Result<HeaderGuard<'_>, SharedError> {
        let (start, len) = layout::HEADER_LOCK;
        sys::lock_range(self.fd(), &self.header_mutex, start, len, LOCK_TIMEOUT)
            .map(|range| HeaderGuard { _range: range })
            .map_err(|failure| match failure {
                LockFailure::Timeout => SharedError::LockTimeout {
                    path: self.path().to_string(),
                },
                LockFailure::Errno(errno) => SharedError::Lock {
                    path: self.path().to_string(),
                    errno,
                },
            })
    }

    fn u32_at(&self, offset: u64) -> &AtomicU32 {
        debug_assert!(offset.is_multiple_of(4) && offset + 4 <= self.file.len() as u64);
        // SAFETY: offset is inside the mapping and aligned (layout's const asserts); the mapping
        // lives as long as self.
        unsafe { &*(self.file.base().add(offset as usize) as *const AtomicU32) }
    }

    fn u64_at(&self, offset: u64) -> &AtomicU64 {
        debug_assert!(offset.is_multiple_of(8) && offset + 8 <= self.file.len() as u64);
        // SAFETY: as in u32_at.
        unsafe { &*(self.file.base().add(offset as usize) as *const AtomicU64) }
    }

    fn read_header_bytes(&self, _guard: &HeaderGuard<'_>) -> Vec<u8> {
        let mut buf = vec![0u8; layout::HEADER_SIZE as usize];
        // SAFETY: the header is inside the mapping; only the header lock holder writes it.
        unsafe { std::ptr::copy_nonoverlapping(self.file.base(), buf.as_mut_ptr(), buf.len()) };
        buf
    }

    fn write_header_bytes(&self, _guard: &HeaderGuard<'_>, buf: &[u8]) {
        // SAFETY: as in read_header_bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(
                buf.as_ptr(),
                self.file.base(),
                layout::HEADER_SIZE as usize,
            )
        };
    }

    /// Checks the header against this process's limits and makes the file usable: a new file is
    /// initialised; another layout is re-initialised; other limits are replaced by ours (live
    /// charges kept). Never silently obeys a header that disagrees with the environment.
    pub fn attach(&self, config: &Config) -> Result<Attached, SharedError> {
        let guard = self.lock_header()?;
        let mut bytes = self.read_header_bytes(&guard);
        let ours = Header::for_config(config);
        let outcome = match Header::decode(&bytes) {
            Ok(found) if found.matches(config) => Attached::Matching,
            Ok(found) => {
                ours.encode_settings(&mut bytes);
                self.write_header_bytes(&guard, &bytes);
                Attached::LimitsReplaced {
                    old: found.describe_limits(),
                }
            }
            Err(LayoutError::Empty) => {
                ours.encode(&mut bytes);
                self.write_header_bytes(&guard, &bytes);
                Attached::Created
            }
            Err(other) => {
                // SAFETY: zeroes the whole mapping under the header lock; nobody of this layout
                // has state in it (the header said otherwise).
                unsafe { std::ptr::write_bytes(self.file.base(), 0, self.file.len()) };
                ours.encode(&mut bytes);
                self.write_header_bytes(&guard, &bytes);
                Attached::Reinitialised {
                    found: other.to_string(),
                }
            }
        };
        Ok(outcome)
    }

    /// The claim index -> UUID map as recorded in the file.
    pub fn uuid_map(&self) -> Result<[Option<Uuid>; MAX_DEVICES], SharedError> {
        let guard = self.lock_header()?;
        let bytes = self.read_header_bytes(&guard);
        Ok(Header::decode(&bytes)
            .map(|h| h.uuid_map)
            .unwrap_or([None; MAX_DEVICES]))
    }

    /// Records `proposed` entries the file does not hold yet, and returns the merged map. Entries
    /// in `overrides` (the driver's `GPUPOOL_DEVICE_UUID_<i>`) replace what the file holds.
    /// Returns the map and the indices whose recorded UUID was replaced.
    pub fn merge_uuid_map(
        &self,
        overrides: &[Option<Uuid>; MAX_DEVICES],
        proposed: &[Option<Uuid>; MAX_DEVICES],
    ) -> Result<MergedMap, SharedError> {
        let guard = self.lock_header()?;
        let mut bytes = self.read_header_bytes(&guard);
        let mut map = Header::decode(&bytes)
            .map(|h| h.uuid_map)
            .unwrap_or([None; MAX_DEVICES]);
        let mut replaced = Vec::new();
        let mut changed = false;
        for i in 0..MAX_DEVICES {
            match (overrides[i], map[i]) {
                (Some(want), Some(had)) if want != had => {
                    replaced.push((i, had, want));
                    map[i] = Some(want);
                    changed = true;
                }
                (Some(want), None) => {
                    map[i] = Some(want);
                    changed = true;
                }
                (None, None) if proposed[i].is_some() => {
                    map[i] = proposed[i];
                    changed = true;
                }
                _ => {}
            }
        }
        if changed {
            for (i, uuid) in map.iter().enumerate() {
                Header::encode_uuid(&mut bytes, i, *uuid);
            }
            self.write_header_bytes(&guard, &bytes);
        }
        Ok(MergedMap { map, replaced })
    }

    fn slot_range(slot: usize) -> (u64, u64) {
        (layout::slot(slot), layout::SLOT_SIZE)
    }

    fn slots_high(&self) -> usize {
        (self.u32_at(layout::H_SLOTS_HIGH).load(Ordering::Acquire) as usize)
            .min(layout::SLOT_COUNT as usize)
    }

    fn slot_in_use(&self, slot: usize) -> bool {
        self.u32_at(layout::slot(slot) + layout::S_IN_USE)
            .load(Ordering::Acquire)
            == 1
    }

    /// Claims a free slot and holds its lock for as long as this description is open.
    pub fn claim_slot(&self, pid: u32) -> Result<usize, SharedError> {
        let guard = self.lock_header()?;
        for attempt in 0..2 {
            for slot in 0..layout::SLOT_COUNT as usize {
                if self.slot_in_use(slot) {
                    continue;
                }
                let (start, len) = Self::slot_range(slot);
                if !sys::try_lock(self.fd(), start, len) {
                    continue;
                }
                for device in 0..MAX_DEVICES {
                    self.u64_at(layout::slot_tracked(slot, device))
                        .store(0, Ordering::Relaxed);
                    self.u64_at(layout::slot_context(slot, device))
                        .store(0, Ordering::Relaxed);
                }
                self.u32_at(layout::slot(slot) + layout::S_PID)
                    .store(pid, Ordering::Relaxed);
                self.u32_at(layout::slot(slot) + layout::S_HOST_PID)
                    .store(0, Ordering::Relaxed);
                self.u64_at(layout::slot(slot) + layout::S_START_NS)
                    .store(now_ns(), Ordering::Relaxed);
                self.u32_at(layout::slot(slot) + layout::S_IN_USE)
                    .store(1, Ordering::Release);
                self.u32_at(layout::H_SLOTS_HIGH)
                    .fetch_max(slot as u32 + 1, Ordering::AcqRel);
                self.claimed.store(slot, Ordering::Release);
                return Ok(slot);
            }
            if attempt == 0 {
                self.reap_locked(&guard, None);
            }
        }
        Err(SharedError::NoFreeSlot {
            path: self.path().to_string(),
        })
    }

    /// Gives our slot back as the process exits normally, so that its charges disappear at once
    /// rather than at the next reap. Only the owner writes its slot; no lock needed (our OFD lock
    /// on the range stays until exit, so nobody claims it in between).
    pub fn release_slot(&self, slot: usize) {
        for device in 0..MAX_DEVICES {
            self.u64_at(layout::slot_tracked(slot, device))
                .store(0, Ordering::Relaxed);
            self.u64_at(layout::slot_context(slot, device))
                .store(0, Ordering::Relaxed);
        }
        self.u32_at(layout::slot(slot) + layout::S_IN_USE)
            .store(0, Ordering::Release);
    }

    pub fn set_host_pid(&self, slot: usize, host_pid: u32) {
        self.u32_at(layout::slot(slot) + layout::S_HOST_PID)
            .store(host_pid, Ordering::Release);
    }

    /// Our processes on the card as NVML will name them: known host PIDs, and how many in-use
    /// slots have none yet.
    pub fn host_pids(&self) -> (Vec<u32>, usize) {
        let mut known = Vec::new();
        let mut unknown = 0;
        for slot in 0..self.slots_high() {
            if self.slot_in_use(slot) {
                match self
                    .u32_at(layout::slot(slot) + layout::S_HOST_PID)
                    .load(Ordering::Acquire)
                {
                    0 => unknown += 1,
                    pid => known.push(pid),
                }
            }
        }
        (known, unknown)
    }

    /// Releases the slots of dead processes. `own` is never judged (our own locks never conflict
    /// with us, so it would look dead).
    pub fn reap(&self, own: Option<usize>) -> Result<Vec<Reaped>, SharedError> {
        let guard = self.lock_header()?;
        Ok(self.reap_locked(&guard, own))
    }

    fn reap_locked(&self, _guard: &HeaderGuard<'_>, own: Option<usize>) -> Vec<Reaped> {
        let mut reaped = Vec::new();
        let claimed = self.claimed.load(Ordering::Acquire);
        for slot in 0..self.slots_high() {
            if Some(slot) == own || slot == claimed || !self.slot_in_use(slot) {
                continue;
            }
            let (start, len) = Self::slot_range(slot);
            if sys::held_elsewhere(self.fd(), start, len) {
                continue;
            }
            let mut bytes = 0;
            for device in 0..MAX_DEVICES {
                bytes += self
                    .u64_at(layout::slot_tracked(slot, device))
                    .swap(0, Ordering::Relaxed);
                bytes += self
                    .u64_at(layout::slot_context(slot, device))
                    .swap(0, Ordering::Relaxed);
            }
            let pid = self
                .u32_at(layout::slot(slot) + layout::S_PID)
                .load(Ordering::Relaxed);
            self.u32_at(layout::slot(slot) + layout::S_IN_USE)
                .store(0, Ordering::Release);
            reaped.push(Reaped { pid, bytes });
        }
        self.u64_at(layout::H_LAST_REAP_NS)
            .store(now_ns(), Ordering::Release);
        reaped
    }

    fn reap_due(&self) -> bool {
        let last = self.u64_at(layout::H_LAST_REAP_NS).load(Ordering::Acquire);
        now_ns().saturating_sub(last) >= REAP_INTERVAL.as_nanos() as u64
    }

    /// Reaps if the last reap is older than [`REAP_INTERVAL`] (views call this so that a killed
    /// process's memory shows as free within a second even when nobody allocates).
    pub fn reap_if_due(&self, own: Option<usize>) -> Result<Vec<Reaped>, SharedError> {
        if !self.reap_due() {
            return Ok(Vec::new());
        }
        self.reap(own)
    }

    /// What the container's live processes hold on a claim index: allocations plus context memory.
    pub fn charged(&self, device: usize) -> u64 {
        let mut total = 0u64;
        for slot in 0..self.slots_high() {
            if self.slot_in_use(slot) {
                total = total
                    .saturating_add(
                        self.u64_at(layout::slot_tracked(slot, device))
                            .load(Ordering::Acquire),
                    )
                    .saturating_add(
                        self.u64_at(layout::slot_context(slot, device))
                            .load(Ordering::Acquire),
                    );
            }
        }
        total
    }

    pub fn tracked(&self, slot: usize, device: usize) -> u64 {
        self.u64_at(layout::slot_tracked(slot, device))
            .load(Ordering::Acquire)
    }

    /// Records `bytes` on `slot` if the container stays within `limit`. Dead processes are reaped
    /// first when due, and always before a refusal, so a killed process never causes an OOM.
    /// `Ok(Charge::Refused { .. })` is a refusal; `Err` is the file failing.
    pub fn charge(
        &self,
        slot: usize,
        device: usize,
        bytes: u64,
        limit: u64,
    ) -> Result<Charge, SharedError> {
        let guard = self.lock_header()?;
        let mut reaped = Vec::new();
        if self.reap_due() {
            reaped = self.reap_locked(&guard, Some(slot));
        }
        let mut charged = self.charged(device);
        if charged.saturating_add(bytes) > limit && reaped.is_empty() {
            reaped = self.reap_locked(&guard, Some(slot));
            charged = self.charged(device);
        }
        if charged.saturating_add(bytes) > limit {
            return Ok(Charge::Refused { charged, reaped });
        }
        self.u64_at(layout::slot_tracked(slot, device))
            .fetch_add(bytes, Ordering::AcqRel);
        Ok(Charge::Recorded { reaped })
    }

    /// Gives back bytes charged earlier. Only the slot's owner writes its fields, so no header
    /// lock is needed: checkers see the value before or after.
    pub fn uncharge(&self, slot: usize, device: usize, bytes: u64) {
        let field = self.u64_at(layout::slot_tracked(slot, device));
        let _ = field.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
            Some(v.saturating_sub(bytes))
        });
    }

    pub fn set_context(&self, slot: usize, device: usize, bytes: u64) {
        self.u64_at(layout::slot_context(slot, device))
            .store(bytes, Ordering::Release);
    }

    pub fn context(&self, slot: usize, device: usize) -> u64 {
        self.u64_at(layout::slot_context(slot, device))
            .load(Ordering::Acquire)
    }
}

#[derive(Debug, PartialEq, Eq)]
pub enum Charge {
    Recorded { reaped: Vec<Reaped> },
    Refused { charged: u64, reaped: Vec<Reaped> },
}

/// Holds an accounting file's header lock through an open file description of its own, as a
/// process stopped inside it would, until the returned file is dropped (for tests and
/// diagnostics). None: the file cannot be opened or the lock is held already.
pub fn hold_header_lock(path: &str) -> Option<std::fs::File> {
    use std::os::fd::AsRawFd;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .ok()?;
    let (start, len) = layout::HEADER_LOCK;
    sys::try_lock(file.as_raw_fd(), start, len).then_some(file)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    struct TempPath(String);

    impl TempPath {
        fn new(name: &str) -> TempPath {
            static COUNTER: AtomicU32 = AtomicU32::new(0);
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let dir =
                std::env::temp_dir().join(format!("gpupool-vgpu-test-{}-{n}", std::process::id()));
            TempPath(dir.join(name).to_string_lossy().into_owned())
        }
    }

    impl Drop for TempPath {
        fn drop(&mut self) {
            if let Some(parent) = std::path::Path::new(&self.0).parent() {
                let _ = std::fs::remove_dir_all(parent);
            }
        }
    }

    fn config(pairs: &[(&str, &str)]) -> Config {
        crate::env::parse(
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), Some(v.to_string()))),
        )
        .config
        .expect("valid")
    }

    fn gib(n: u64) -> u64 {
        n << 30
    }

    #[test]
    fn the_first_process_creates_the_file_and_its_folder() {
        let path = TempPath::new("sub/dir/x.cache");
        let config = config(&[("CUDA_DEVICE_MEMORY_LIMIT", "1g")]);
        let file = SharedFile::open(&path.0).expect("open");
        assert_eq!(file.attach(&config).expect("attach"), Attached::Created);
        let second = SharedFile::open(&path.0).expect("open");
        assert_eq!(second.attach(&config).expect("attach"), Attached::Matching);
        let meta = std::fs::metadata(&path.0).expect("exists");
        assert_eq!(meta.len(), layout::FILE_SIZE);
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(meta.permissions().mode() & 0o777, 0o666);
    }

    #[test]
    fn an_unopenable_path_is_an_error_naming_it() {
        let err = SharedFile::open("/proc/definitely/not/here.cache")
            .err()
            .expect("fails");
        assert!(
            err.to_string().contains("/proc/definitely/not/here.cache"),
            "{err}"
        );
    }

    #[test]
    fn two_processes_share_one_limit() {
        let path = TempPath::new("x.cache");
        let config = config(&[("CUDA_DEVICE_MEMORY_LIMIT_0", "1g")]);
        let a = SharedFile::open(&path.0).expect("open");
        let b = SharedFile::open(&path.0).expect("open");
        a.attach(&config).expect("attach");
        b.attach(&config).expect("attach");
        let sa = a.claim_slot(100).expect("slot");
        let sb = b.claim_slot(200).expect("slot");
        assert_ne!(sa, sb);
        assert!(matches!(
            a.charge(sa, 0, gib(1) - 10, gib(1)).unwrap(),
            Charge::Recorded { .. }
        ));
        assert!(matches!(
            b.charge(sb, 0, 10, gib(1)).unwrap(),
            Charge::Recorded { .. }
        ));
        assert_eq!(a.charged(0), gib(1));
        match b.charge(sb, 0, 1, gib(1)).unwrap() {
            Charge::Refused { charged, reaped } => {
                assert_eq!(charged, gib(1));
                assert!(reaped.is_empty());
            }
            other => panic!("{other:?}"),
        }
        // Another device's limit is separate.
        assert!(matches!(
            b.charge(sb, 1, 5, 5).unwrap(),
            Charge::Recorded { .. }
        ));
        a.uncharge(sa, 0, 100);
        assert!(matches!(
            b.charge(sb, 0, 100, gib(1)).unwrap(),
            Charge::Recorded { .. }
        ));
        assert!(matches!(
            b.charge(sb, 0, 1, gib(1)).unwrap(),
            Charge::Refused { .. }
        ));
    }

    #[test]
    fn context_memory_counts_against_the_limit() {
        let path = TempPath::new("x.cache");
        let config = config(&[("CUDA_DEVICE_MEMORY_LIMIT_0", "1g")]);
        let a = SharedFile::open(&path.0).expect("open");
        a.attach(&config).expect("attach");
        let slot = a.claim_slot(1).expect("slot");
        a.set_context(slot, 0, 300 << 20);
        assert_eq!(a.charged(0), 300 << 20);
        assert!(matches!(
            a.charge(slot, 0, gib(1) - (300 << 20) + 1, gib(1)).unwrap(),
            Charge::Refused { .. }
        ));
        assert!(matches!(
            a.charge(slot, 0, gib(1) - (300 << 20), gib(1)).unwrap(),
            Charge::Recorded { .. }
        ));
    }

    #[test]
    fn a_dead_process_is_reaped_before_a_refusal() {
        let path = TempPath::new("x.cache");
        let config = config(&[("CUDA_DEVICE_MEMORY_LIMIT_0", "1g")]);
        let survivor = SharedFile::open(&path.0).expect("open");
        survivor.attach(&config).expect("attach");
        let own = survivor.claim_slot(1).expect("slot");
        {
            let doomed = SharedFile::open(&path.0).expect("open");
            let slot = doomed.claim_slot(42).expect("slot");
            assert!(matches!(
                doomed.charge(slot, 0, gib(1), gib(1)).unwrap(),
                Charge::Recorded { .. }
            ));
            // While it lives, its memory is counted and its slot is not reaped.
            assert!(survivor.reap(Some(own)).unwrap().is_empty());
            assert_eq!(survivor.charged(0), gib(1));
            // Dropping the SharedFile closes its description: the kernel drops its locks, as on kill -9.
        }
        match survivor.charge(own, 0, gib(1), gib(1)).unwrap() {
            Charge::Recorded { reaped } => assert_eq!(
                reaped,
                vec![Reaped {
                    pid: 42,
                    bytes: gib(1)
                }]
            ),
            other => panic!("{other:?}"),
        }
        assert_eq!(survivor.charged(0), gib(1));
    }

    #[test]
    fn a_process_never_reaps_its_own_slot() {
        let path = TempPath::new("x.cache");
        let a = SharedFile::open(&path.0).expect("open");
        a.attach(&config(&[])).expect("attach");
        let slot = a.claim_slot(1).expect("slot");
        a.set_context(slot, 0, 7);
        assert!(a.reap(Some(slot)).unwrap().is_empty());
        assert_eq!(a.charged(0), 7);
        // Nor when the caller does not know it yet (a thread asking for a view while another
        // claims the process's first slot): it used to see itself as dead and reap its own new
        // slot, and every later charge of the process then went unseen by the others.
        assert!(a.reap(None).unwrap().is_empty());
        assert_eq!(a.charged(0), 7);
    }

    #[test]
    fn a_file_made_with_other_limits_is_replaced_and_live_charges_kept() {
        let path = TempPath::new("x.cache");
        let old = config(&[
            ("CUDA_DEVICE_MEMORY_LIMIT_0", "1g"),
            ("CUDA_DEVICE_SM_LIMIT_0", "30"),
        ]);
        let new = config(&[
            ("CUDA_DEVICE_MEMORY_LIMIT_0", "2g"),
            ("CUDA_DEVICE_SM_LIMIT_0", "50"),
        ]);
        let a = SharedFile::open(&path.0).expect("open");
        a.attach(&old).expect("attach");
        let slot = a.claim_slot(1).expect("slot");
        a.charge(slot, 0, 123, gib(1)).unwrap();
        let b = SharedFile::open(&path.0).expect("open");
        assert_eq!(
            b.attach(&new).unwrap(),
            Attached::LimitsReplaced {
                old: "memory[0]=1073741824 sm[0]=30%".into()
            }
        );
        assert_eq!(b.charged(0), 123);
        let c = SharedFile::open(&path.0).expect("open");
        assert_eq!(c.attach(&new).unwrap(), Attached::Matching);
    }

    #[test]
    fn a_foreign_file_is_reinitialised() {
        let path = TempPath::new("x.cache");
        std::fs::create_dir_all(std::path::Path::new(&path.0).parent().unwrap()).unwrap();
        std::fs::write(&path.0, b"not ours at all").unwrap();
        let a = SharedFile::open(&path.0).expect("open");
        match a.attach(&config(&[])).unwrap() {
            Attached::Reinitialised { found } => assert!(found.contains("no magic"), "{found}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(a.charged(0), 0);
    }

    #[test]
    fn the_uuid_map_is_recorded_once_and_overridden_by_the_driver() {
        let path = TempPath::new("x.cache");
        let a = SharedFile::open(&path.0).expect("open");
        a.attach(&config(&[])).expect("attach");
        let (u1, u2, u3) = (Uuid([1; 16]), Uuid([2; 16]), Uuid([3; 16]));
        let mut proposed = [None; MAX_DEVICES];
        proposed[0] = Some(u1);
        proposed[1] = Some(u2);
        let MergedMap { map, replaced } =
            a.merge_uuid_map(&[None; MAX_DEVICES], &proposed).unwrap();
        assert_eq!((map[0], map[1], replaced.len()), (Some(u1), Some(u2), 0));
        // A later process that sees the cards in another order keeps the first mapping.
        let b = SharedFile::open(&path.0).expect("open");
        let MergedMap { map, .. } = b
            .merge_uuid_map(
                &[None; MAX_DEVICES],
                &[
                    Some(u2),
                    Some(u1),
                    None,
                    None,
                    None,
                    None,
                    None,
                    None,
                    None,
                    None,
                    None,
                    None,
                    None,
                    None,
                    None,
                    None,
                ],
            )
            .unwrap();
        assert_eq!((map[0], map[1]), (Some(u1), Some(u2)));
        // The driver's GPUPOOL_DEVICE_UUID_<i> wins and says what it replaced.
        let mut overrides = [None; MAX_DEVICES];
        overrides[1] = Some(u3);
        let MergedMap { map, replaced } =
            b.merge_uuid_map(&overrides, &[None; MAX_DEVICES]).unwrap();
        assert_eq!(map[1], Some(u3));
        assert_eq!(replaced, vec![(1, u2, u3)]);
        assert_eq!(a.uuid_map().unwrap()[1], Some(u3));
    }

    #[test]
    fn a_released_slot_stops_counting_at_once() {
        let path = TempPath::new("x.cache");
        let a = SharedFile::open(&path.0).expect("open");
        let b = SharedFile::open(&path.0).expect("open");
        let slot = a.claim_slot(1).expect("slot");
        a.set_context(slot, 0, 300);
        a.charge(slot, 0, 5, 1000).unwrap();
        assert_eq!(b.charged(0), 305);
        a.release_slot(slot);
        assert_eq!(b.charged(0), 0);
        // Its range is still locked by the exiting owner: nobody claims it meanwhile.
        assert_ne!(b.claim_slot(2).expect("slot"), slot);
    }

    #[test]
    fn host_pids_list_known_and_count_unknown() {
        let path = TempPath::new("x.cache");
        let a = SharedFile::open(&path.0).expect("open");
        let b = SharedFile::open(&path.0).expect("open");
        let sa = a.claim_slot(1).expect("slot");
        b.claim_slot(2).expect("slot");
        a.set_host_pid(sa, 4242);
        assert_eq!(a.host_pids(), (vec![4242], 1));
    }

    #[test]
    fn the_header_lock_times_out_instead_of_hanging() {
        let path = TempPath::new("x.cache");
        let a = SharedFile::open(&path.0).expect("open");
        let b = SharedFile::open(&path.0).expect("open");
        let _held = a.lock_header().expect("lock");
        let started = Instant::now();
        assert!(matches!(
            b.lock_header(),
            Err(SharedError::LockTimeout { .. })
        ));
        let waited = started.elapsed();
        assert!(
            waited >= LOCK_TIMEOUT && waited < LOCK_TIMEOUT + Duration::from_secs(1),
            "{waited:?}"
        );
    }

    #[test]
    fn threads_queued_behind_a_stopped_holder_all_give_up_within_the_timeout() {
        let path = TempPath::new("x.cache");
        let stopped = SharedFile::open(&path.0).expect("open");
        let ours = SharedFile::open(&path.0).expect("open");
        let _held = stopped.lock_header().expect("lock");
        let started = Instant::now();
        std::thread::scope(|scope| {
            let waiters: Vec<_> = (0..4)
                .map(|_| scope.spawn(|| ours.lock_header().map(|_| ())))
                .collect();
            for waiter in waiters {
                assert!(matches!(
                    waiter.join().expect("no panic"),
                    Err(SharedError::LockTimeout { .. })
                ));
            }
        });
        // Each thread waited at most the timeout, not its place in the queue times the timeout.
        let waited = started.elapsed();
        assert!(waited < LOCK_TIMEOUT + Duration::from_secs(1), "{waited:?}");
    }
}

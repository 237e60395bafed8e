//! A card's arbiter: one small file per GPU, mapped by every limited process of every container
//! on that card, through which they take turns holding the card (`schedule.rs` decides who).
//!
//! The driver creates the file and mounts it into each claim's containers
//! (`GPUPOOL_VGPU_ARBITER_<i>`); the library creates it when it is missing. Layout (version 1,
//! machine byte order, [`Layout`]): a header with the lease (holder, start, end), two futex words
//! and the virtual clock; 64 tenant records (a tenant is a container: the device and inode of its
//! shared accounting file, its weight and policy, its virtual time, `FORCE` credit, statistics);
//! 256 process records (PID, tenant, since when it waits, launches that went ahead unarbitrated).
//!
//! Coordination, as in the accounting file, without any process-shared mutex:
//! - each process holds an OFD lock on its record's lock byte for life: a record whose byte is free
//!   belongs to the dead, and a lease held by the dead is taken back at once;
//! - decisions (grant, release, renew) are made under the decision lock byte, held for
//!   microseconds; registering takes records without it (OFD lock, compare-and-swap), so a new
//!   process never waits for it. A launch waits for it no longer than its own bound. A
//!   process stopped inside it (SIGSTOP, a debugger, the cgroup freezer) therefore costs the
//!   others one bounded wait, then [`LOCK_BACKOFF_NS`] of launches that go ahead unarbitrated at
//!   once (each tries the lock once, and arbitration resumes the moment it is free): never a
//!   hang, never a wait per launch;
//! - the holder and the lease's end are read without any lock on every launch (two loads);
//! - waiters sleep on a futex in the file (`grant_seq`), the holder's keeper thread on another
//!   (`waiting_seq`): a hand-over wakes the next holder at once, in any container.
//!
//! What a hostile container can do with the file: everything in it is readable and writable by
//! every tenant of the card. Every index read from it is bounds-checked and every number clamped
//! (`schedule.rs`), so garbage cannot make the library crash or wait without bound; a tenant that
//! lies (a huge weight, a lease it never gives up) can take the card from the card's other
//! tenants, who then wait their bound and launch unarbitrated, as without a limiter. It can
//! also truncate the file, and the others' next access faults (SIGBUS). It cannot reach another
//! card (one file each) or the node (the file is the only thing mounted, and it is data).

use crate::schedule::{self, Decision, Tenant, Waiter};
use crate::sys::{self, now_ns, LockFailure, MapError, MappedFile};
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

pub const MAGIC: u64 = u64::from_le_bytes(*b"GPUPARB1");
pub const VERSION: u32 = 1;
pub const TENANTS: usize = 64;
pub const PROCESSES: usize = 256;
/// The decision lock is held for microseconds; reaching this means its holder is stopped. The
/// longest wait for it (the keeper's, a process's exit), and for the lock that serialises the
/// file's growth; a launch waits no longer than its bound.
pub const LOCK_TIMEOUT: Duration = Duration::from_secs(2);
/// After a wait for the decision lock timed out, this process tries it once (no wait) for this
/// long: a stopped holder must not cost every launch a bound's wait.
pub const LOCK_BACKOFF_NS: u64 = 1_000_000_000;
/// A lease whose holder is alive but has not given the card up this long after its end (stopped,
/// or its queued work does not finish) is taken back by the next waiter.
pub const STALE_NS: u64 = 1_000_000_000;

/// Lock bytes lie past the data (OFD locks may cover bytes beyond the end of a file): locking
/// never touches what the mapping holds.
const LOCK_BASE: u64 = 1 << 40;
const LOCK_INIT: (u64, u64) = (LOCK_BASE, 1);
const LOCK_DECIDE: (u64, u64) = (LOCK_BASE + 1, 1);
const fn lock_process(slot: usize) -> (u64, u64) {
    (LOCK_BASE + 64 + slot as u64, 1)
}

const FLAG_FORCE: u32 = 1;

#[repr(C)]
struct Header {
    magic: AtomicU64,
    version: AtomicU32,
    /// Process slot + 1 of the holder; 0: nobody holds the card.
    holder: AtomicU32,
    lease_start_ns: AtomicU64,
    lease_end_ns: AtomicU64,
    /// Bumped at every grant and release: waiters sleep on it.
    grant_seq: AtomicU32,
    /// Bumped whenever a process starts waiting: the holder's keeper sleeps on it.
    waiting_seq: AtomicU32,
    /// The virtual time of the last grant (`schedule::Tenant::join`).
    vclock: AtomicU64,
    /// Leases granted since the file was made (statistics).
    grants: AtomicU64,
    _reserved: [u64; 9],
}

#[repr(C)]
struct TenantRecord {
    /// Device and inode of the tenant's accounting file, mixed; 0: a free record.
    key: AtomicU64,
    weight: AtomicU32,
    flags: AtomicU32,
    vtime: AtomicU64,
    credit_ns: AtomicI64,
    credit_at_ns: AtomicU64,
    /// Nanoseconds it held the card, and leases it got (statistics, for tools and tests).
    used_ns: AtomicU64,
    leases: AtomicU64,
    last_active_ns: AtomicU64,
}

#[repr(C)]
struct ProcessRecord {
    /// PID as the process sees itself; 0: a free record.
    pid: AtomicU32,
    /// Tenant index + 1.
    tenant: AtomicU32,
    /// When it started waiting for the card; 0: not waiting.
    waiting_since_ns: AtomicU64,
    /// Launches that waited their whole bound and went ahead without the card.
    unarbitrated: AtomicU64,
    /// The last sign of its work on the card (a launch, queued work seen running, the end of its
    /// drain): a holder is charged up to here, never for the idle time after it.
    busy_until_ns: AtomicU64,
    _reserved: [u64; 4],
}

#[repr(C)]
struct Layout {
    header: Header,
    tenants: [TenantRecord; TENANTS],
    processes: [ProcessRecord; PROCESSES],
}

pub const FILE_SIZE: usize = std::mem::size_of::<Layout>();
const _: () = assert!(std::mem::size_of::<Header>() == 128);
const _: () = assert!(std::mem::size_of::<TenantRecord>() == 64);
const _: () = assert!(std::mem::size_of::<ProcessRecord>() == 64);

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ArbiterError {
    Map(MapError),
    Lock { path: String, failure: LockFailure },
    NoTenantRecord { path: String },
    NoProcessRecord { path: String },
}

impl std::fmt::Display for ArbiterError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ArbiterError::Map(error) => write!(f, "{error}"),
            ArbiterError::Lock {
                path,
                failure: LockFailure::Timeout,
            } => write!(
                f,
                "the decision lock of {path} was not free in time (its holder is stopped?)"
            ),
            ArbiterError::Lock {
                path,
                failure: LockFailure::Errno(errno),
            } => write!(f, "cannot lock {path}: {}", sys::errno_text(*errno)),
            ArbiterError::NoTenantRecord { path } => {
                write!(
                    f,
                    "{path}: all {TENANTS} tenant records are in use by live containers"
                )
            }
            ArbiterError::NoProcessRecord { path } => {
                write!(f, "{path}: all {PROCESSES} process records are in use")
            }
        }
    }
}

/// Who this process is on the card, as the arbiter sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Member {
    pub key: u64,
    pub weight: u32,
    pub force: bool,
}

/// What a turn at the decision lock ended in, for the process that asked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Turn {
    /// This process holds the card until the given time.
    Holding { until_ns: u64 },
    /// Someone else holds it, or nobody may have it yet: sleep until woken or the given time.
    Wait { until_ns: u64 },
}

/// A card's arbiter, opened by one process.
pub struct Arbiter {
    file: MappedFile,
    decide_mutex: Mutex<()>,
    slot: usize,
    tenant: usize,
    /// Until when a wait for the decision lock is not worth it (it just timed out).
    lock_stuck_until_ns: AtomicU64,
}

impl Arbiter {
    /// Opens (or creates) the card's arbiter and registers this process as a member of tenant
    /// `member` (created, or updated with this process's weight and policy).
    pub fn open(path: &str, member: Member) -> Result<Arbiter, ArbiterError> {
        let file = MappedFile::open(path, FILE_SIZE, true, LOCK_INIT, LOCK_TIMEOUT)
            .map_err(ArbiterError::Map)?;
        let mut arbiter = Arbiter {
            file,
            decide_mutex: Mutex::new(()),
            slot: usize::MAX,
            tenant: usize::MAX,
            lock_stuck_until_ns: AtomicU64::new(0),
        };
        let (slot, tenant) = arbiter.register(member)?;
        (arbiter.slot, arbiter.tenant) = (slot, tenant);
        Ok(arbiter)
    }

    fn layout(&self) -> &Layout {
        // SAFETY: the mapping is FILE_SIZE bytes, page-aligned, and lives as long as self; every
        // field is an atomic (any bit pattern is valid).
        unsafe { &*(self.file.base() as *const Layout) }
    }

    pub fn path(&self) -> &str {
        self.file.path()
    }

    pub fn fd(&self) -> libc::c_int {
        self.file.fd()
    }

    /// The decision lock, waiting at most `wait` (once, with no wait, while a recent wait timed
    /// out: see [`LOCK_BACKOFF_NS`]).
    fn decide_lock(&self, wait: Duration) -> Result<sys::RangeGuard<'_>, ArbiterError> {
        let (start, len) = LOCK_DECIDE;
        let now = now_ns();
        let wait = if now < self.lock_stuck_until_ns.load(Ordering::Relaxed) {
            Duration::ZERO
        } else {
            wait.min(LOCK_TIMEOUT)
        };
        sys::lock_range(self.fd(), &self.decide_mutex, start, len, wait).map_err(|failure| {
            if failure == LockFailure::Timeout && !wait.is_zero() {
                self.lock_stuck_until_ns
                    .store(now_ns().saturating_add(LOCK_BACKOFF_NS), Ordering::Relaxed);
            }
            ArbiterError::Lock {
                path: self.path().to_string(),
                failure,
            }
        })
    }

    fn alive(&self, slot: usize) -> bool {
        self.alive_for(slot, self.slot)
    }

    /// Whether a process record belongs to a live process, as `own` sees it (never judged: our
    /// own locks never conflict with us).
    fn alive_for(&self, slot: usize, own: usize) -> bool {
        if slot == own {
            return true;
        }
        let (start, len) = lock_process(slot);
        self.layout().processes[slot].pid.load(Ordering::Acquire) != 0
            && sys::held_elsewhere(self.fd(), start, len)
    }

    /// Takes a process record (held by our lock for life) and a tenant record, without the
    /// decision lock: a process stopped inside it must not keep the card's other containers from
    /// starting programs. Records are taken by an OFD lock (process) and compare-and-swap of the
    /// key (tenant); two processes of one container registering at once end up in one record
    /// (the lowest that holds its key).
    fn register(&self, member: Member) -> Result<(usize, usize), ArbiterError> {
        self.start_afresh_if_foreign()?;
        let layout = self.layout();
        // A process record: free, or left by a dead process.
        let slot = (0..PROCESSES)
            .find(|&s| {
                let (start, len) = lock_process(s);
                (layout.processes[s].pid.load(Ordering::Acquire) == 0
                    || !sys::held_elsewhere(self.fd(), start, len))
                    && sys::try_lock(self.fd(), start, len)
            })
            .ok_or_else(|| ArbiterError::NoProcessRecord {
                path: self.path().to_string(),
            })?;
        let process = &layout.processes[slot];
        process.waiting_since_ns.store(0, Ordering::SeqCst);
        process.tenant.store(0, Ordering::SeqCst);
        process.unarbitrated.store(0, Ordering::Relaxed);
        process.busy_until_ns.store(0, Ordering::Relaxed);
        // Alive from here on (our lock and a PID): a registering process's tenant record is not
        // taken for a dead one's.
        process.pid.store(std::process::id(), Ordering::SeqCst);
        // A record left by a holder that died: the lease is taken back (charged as a dead
        // holder's), or this process would find itself holding a lease it never got.
        if layout
            .header
            .holder
            .compare_exchange(slot as u32 + 1, 0, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            self.charge_holder(slot, now_ns());
            self.bump_grants();
        }
        let key = member.key.max(1);
        let tenant = loop {
            let Some(claimed) = self.claim_tenant(key, slot) else {
                sys::unlock(self.fd(), lock_process(slot).0, 1);
                process.pid.store(0, Ordering::Release);
                return Err(ArbiterError::NoTenantRecord {
                    path: self.path().to_string(),
                });
            };
            process.tenant.store(claimed as u32 + 1, Ordering::SeqCst);
            // Still ours (not taken as left by the dead before our record named it), and the
            // lowest record with our key (another process of the container may have claimed
            // one at the same moment): otherwise again.
            let lowest =
                (0..TENANTS).find(|&t| layout.tenants[t].key.load(Ordering::SeqCst) == key);
            match lowest {
                Some(t) if t == claimed => break claimed,
                Some(t) => {
                    process.tenant.store(t as u32 + 1, Ordering::SeqCst);
                    if !self.tenant_in_use(claimed, slot) {
                        let _ = layout.tenants[claimed].key.compare_exchange(
                            key,
                            0,
                            Ordering::SeqCst,
                            Ordering::SeqCst,
                        );
                    }
                    if layout.tenants[t].key.load(Ordering::SeqCst) == key {
                        break t;
                    }
                }
                None => {}
            }
        };
        let record = &layout.tenants[tenant];
        record.weight.store(member.weight, Ordering::Relaxed);
        record
            .flags
            .store(if member.force { FLAG_FORCE } else { 0 }, Ordering::Relaxed);
        Ok((slot, tenant))
    }

    /// A file that is new, foreign or of another version is started afresh (no live process can
    /// use a layout it does not recognise), under the lock that serialises its growth.
    fn start_afresh_if_foreign(&self) -> Result<(), ArbiterError> {
        let layout = self.layout();
        let recognised = || {
            layout.header.magic.load(Ordering::Acquire) == MAGIC
                && layout.header.version.load(Ordering::Acquire) == VERSION
        };
        if recognised() {
            return Ok(());
        }
        let mutex = Mutex::new(());
        let (start, len) = LOCK_INIT;
        let _guard =
            sys::lock_range(self.fd(), &mutex, start, len, LOCK_TIMEOUT).map_err(|failure| {
                ArbiterError::Lock {
                    path: self.path().to_string(),
                    failure,
                }
            })?;
        if !recognised() {
            // SAFETY: the mapping is FILE_SIZE bytes; every field is an atomic of plain data.
            unsafe { std::ptr::write_bytes(self.file.base(), 0, FILE_SIZE) };
            layout.header.version.store(VERSION, Ordering::Release);
            layout.header.magic.store(MAGIC, Ordering::Release);
        }
        Ok(())
    }

    /// Whether a live process other than `own` belongs to tenant record `t`.
    fn tenant_in_use(&self, t: usize, own: usize) -> bool {
        (0..PROCESSES).any(|s| {
            s != own
                && self.layout().processes[s].tenant.load(Ordering::SeqCst) as usize == t + 1
                && self.alive_for(s, own)
        })
    }

    /// The tenant record of `key`: the one that holds it, or a free one (or one left by
    /// containers whose processes are all gone) taken by compare-and-swap and started level with
    /// the tenants competing. None: every record belongs to a live container.
    fn claim_tenant(&self, key: u64, own: usize) -> Option<usize> {
        let layout = self.layout();
        if let Some(t) = (0..TENANTS).find(|&t| layout.tenants[t].key.load(Ordering::SeqCst) == key)
        {
            return Some(t);
        }
        for t in 0..TENANTS {
            let record = &layout.tenants[t];
            let old = record.key.load(Ordering::SeqCst);
            if old != 0 && self.tenant_in_use(t, own) {
                continue;
            }
            if record
                .key
                .compare_exchange(old, key, Ordering::SeqCst, Ordering::SeqCst)
                .is_err()
            {
                continue;
            }
            // A new tenant (or a record left by containers that are gone): it starts level with
            // the tenants already competing.
            record.vtime.store(
                layout.header.vclock.load(Ordering::Acquire),
                Ordering::Relaxed,
            );
            record.credit_ns.store(0, Ordering::Relaxed);
            record.credit_at_ns.store(now_ns(), Ordering::Relaxed);
            record.used_ns.store(0, Ordering::Relaxed);
            record.leases.store(0, Ordering::Relaxed);
            record.last_active_ns.store(0, Ordering::Relaxed);
            return Some(t);
        }
        None
    }

    /// The fast path of every launch: whether this process holds the card and its lease runs.
    #[inline]
    pub fn holds(&self, now_ns: u64) -> bool {
        let header = &self.layout().header;
        header.holder.load(Ordering::Acquire) == self.slot as u32 + 1
            && now_ns < header.lease_end_ns.load(Ordering::Acquire)
    }

    /// Whether this process is the holder, lease run out or not.
    pub fn is_holder(&self) -> bool {
        self.layout().header.holder.load(Ordering::Acquire) == self.slot as u32 + 1
    }

    pub fn lease_end_ns(&self) -> u64 {
        self.layout().header.lease_end_ns.load(Ordering::Acquire)
    }

    /// The futex words and their current values: waiters sleep on `grant_seq`, keepers on
    /// `waiting_seq`.
    pub fn grant_seq(&self) -> &AtomicU32 {
        &self.layout().header.grant_seq
    }

    pub fn waiting_seq(&self) -> &AtomicU32 {
        &self.layout().header.waiting_seq
    }

    /// Whether another live process waits for the card.
    pub fn others_waiting(&self) -> bool {
        let layout = self.layout();
        (0..PROCESSES).any(|s| {
            s != self.slot
                && layout.processes[s].waiting_since_ns.load(Ordering::Acquire) != 0
                && layout.processes[s].pid.load(Ordering::Acquire) != 0
        })
    }

    /// Marks this process as waiting (once; later calls keep the first time) and wakes the
    /// holder's keeper. The holder never waits: marked, it would count as a waiter once it gave
    /// the card up, be granted it while idle and keep it from the others.
    pub fn start_waiting(&self, now_ns: u64) {
        if self.is_holder() {
            return;
        }
        let record = &self.layout().processes[self.slot];
        if record
            .waiting_since_ns
            .compare_exchange(0, now_ns.max(1), Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            let header = &self.layout().header;
            header.waiting_seq.fetch_add(1, Ordering::AcqRel);
            sys::futex_wake_all(&header.waiting_seq);
        }
    }

    pub fn stop_waiting(&self) {
        self.layout().processes[self.slot]
            .waiting_since_ns
            .store(0, Ordering::Release);
    }

    /// A sign of this process's work on the card now (see `ProcessRecord::busy_until_ns`). A
    /// plain store on every launch: only this process writes its record, and two of its threads
    /// racing can only put it back by the nanoseconds between their clock reads.
    #[inline]
    pub fn note_busy(&self, now_ns: u64) {
        self.layout().processes[self.slot]
            .busy_until_ns
            .store(now_ns, Ordering::Relaxed);
    }

    /// Counts a launch that went ahead without the card.
    pub fn count_unarbitrated(&self) {
        self.layout().processes[self.slot]
            .unarbitrated
            .fetch_add(1, Ordering::Relaxed);
    }

    fn tenant_of(&self, slot: usize) -> Option<usize> {
        let t = self.layout().processes[slot].tenant.load(Ordering::Acquire) as usize;
        (1..=TENANTS).contains(&t).then(|| t - 1)
    }

    fn read_tenant(&self, t: usize) -> Tenant {
        let r = &self.layout().tenants[t];
        let in_use = r.key.load(Ordering::Acquire) != 0;
        Tenant {
            weight: r.weight.load(Ordering::Relaxed),
            force: r.flags.load(Ordering::Relaxed) & FLAG_FORCE != 0,
            vtime: r.vtime.load(Ordering::Relaxed),
            credit_ns: r.credit_ns.load(Ordering::Relaxed),
            credit_at_ns: r.credit_at_ns.load(Ordering::Relaxed),
            // A free record never competes, whatever it holds.
            last_active_ns: if in_use {
                r.last_active_ns.load(Ordering::Relaxed)
            } else {
                0
            },
        }
    }

    fn read_tenants(&self) -> Vec<Tenant> {
        (0..TENANTS).map(|t| self.read_tenant(t)).collect()
    }

    fn write_tenant(&self, t: usize, tenant: &Tenant) {
        let r = &self.layout().tenants[t];
        r.vtime.store(tenant.vtime, Ordering::Relaxed);
        r.credit_ns.store(tenant.credit_ns, Ordering::Relaxed);
        r.credit_at_ns.store(tenant.credit_at_ns, Ordering::Relaxed);
        r.last_active_ns
            .store(tenant.last_active_ns, Ordering::Relaxed);
    }

    /// Charges the holder's tenant for the lease so far (from its start to the holder's last sign
    /// of work: `schedule::used_ns`) and restarts the lease's clock at `now`. Under the decision
    /// lock, or after taking a dead holder's lease back by compare-and-swap (`register`). A dead
    /// or stopped holder is charged up to its last launch, not up to the moment someone noticed.
    fn charge_holder(&self, holder_slot: usize, now_ns: u64) {
        let header = &self.layout().header;
        let busy_until = self.layout().processes[holder_slot]
            .busy_until_ns
            .load(Ordering::Relaxed);
        let used = schedule::used_ns(
            header.lease_start_ns.load(Ordering::Acquire),
            busy_until,
            now_ns,
        );
        if let Some(t) = self.tenant_of(holder_slot) {
            let mut tenant = self.read_tenant(t);
            tenant.charge(used, now_ns);
            self.write_tenant(t, &tenant);
            self.layout().tenants[t]
                .used_ns
                .fetch_add(used, Ordering::Relaxed);
        }
        header.lease_start_ns.store(now_ns, Ordering::Release);
    }

    fn bump_grants(&self) {
        let header = &self.layout().header;
        header.grant_seq.fetch_add(1, Ordering::AcqRel);
        sys::futex_wake_all(&header.grant_seq);
    }

    /// Under the decision lock: takes the card back from a dead or stale holder, and if the card
    /// is free, grants it to the waiter `schedule::decide` picks.
    fn settle(&self, now_ns: u64) -> Turn {
        let layout = self.layout();
        let header = &layout.header;
        let holder = header.holder.load(Ordering::Acquire) as usize;
        if holder != 0 {
            let slot = holder - 1;
            let end = header.lease_end_ns.load(Ordering::Acquire);
            if slot == self.slot {
                self.stop_waiting();
                return Turn::Holding { until_ns: end };
            }
            let gone = slot >= PROCESSES || !self.alive(slot);
            let stale = now_ns > end.saturating_add(STALE_NS)
                || end.saturating_sub(header.lease_start_ns.load(Ordering::Acquire))
                    > schedule::ROUND_NS + STALE_NS;
            if !gone && !stale {
                return Turn::Wait {
                    until_ns: end.saturating_add(STALE_NS).min(now_ns + STALE_NS),
                };
            }
            if slot < PROCESSES {
                // The dead held it until now (its context went with it); a stale holder too.
                self.charge_holder(slot, now_ns);
                if gone {
                    layout.processes[slot]
                        .waiting_since_ns
                        .store(0, Ordering::Release);
                }
            }
            header.holder.store(0, Ordering::Release);
            self.bump_grants();
        }
        self.grant(now_ns)
    }

    /// Under the decision lock: the live waiting processes (records of the dead are cleared).
    fn waiters(&self) -> Vec<Waiter> {
        let layout = self.layout();
        let mut waiters = Vec::new();
        for s in 0..PROCESSES {
            let since = layout.processes[s].waiting_since_ns.load(Ordering::Acquire);
            if since == 0 || s == self.slot && self.is_holder() {
                continue;
            }
            match self.tenant_of(s) {
                Some(tenant) if self.alive(s) => waiters.push(Waiter {
                    process: s,
                    tenant,
                    since_ns: since,
                }),
                _ => layout.processes[s]
                    .waiting_since_ns
                    .store(0, Ordering::Release),
            }
        }
        waiters
    }

    /// Under the decision lock, the card free: grant it.
    fn grant(&self, now_ns: u64) -> Turn {
        let layout = self.layout();
        let header = &layout.header;
        let waiters = self.waiters();
        let mut tenants = self.read_tenants();
        let mut vclock = header.vclock.load(Ordering::Acquire);
        let decision = schedule::decide(&mut tenants, &waiters, &mut vclock, now_ns);
        for w in &waiters {
            self.write_tenant(w.tenant, &tenants[w.tenant]);
        }
        header.vclock.store(vclock, Ordering::Release);
        match decision {
            Decision::Grant { process, lease_ns } => {
                let end = now_ns + lease_ns;
                layout.processes[process]
                    .waiting_since_ns
                    .store(0, Ordering::Release);
                if let Some(t) = self.tenant_of(process) {
                    layout.tenants[t].leases.fetch_add(1, Ordering::Relaxed);
                }
                header.lease_start_ns.store(now_ns, Ordering::Release);
                header.lease_end_ns.store(end, Ordering::Release);
                header.holder.store(process as u32 + 1, Ordering::Release);
                header.grants.fetch_add(1, Ordering::Relaxed);
                self.bump_grants();
                if process == self.slot {
                    Turn::Holding { until_ns: end }
                } else {
                    Turn::Wait {
                        until_ns: end.saturating_add(STALE_NS),
                    }
                }
            }
            Decision::NotBefore(t) => Turn::Wait { until_ns: t },
            Decision::Nobody => Turn::Wait {
                until_ns: now_ns + STALE_NS,
            },
        }
    }

    /// A waiter's turn at the decision lock: the card is granted if it is free and this
    /// process's tenant is next.
    pub fn try_take(&self, now_ns: u64, wait: Duration) -> Result<Turn, ArbiterError> {
        let _guard = self.decide_lock(wait)?;
        Ok(self.settle(now_ns))
    }

    /// The holder's lease ran out: it goes on (charged for what it used) when nobody else waits,
    /// or when its container is still behind every waiting one (`schedule::keeps_card`), and its
    /// policy allows. Ok(None): it must give the card up ([`Arbiter::release`]).
    pub fn renew(&self, now_ns: u64, wait: Duration) -> Result<Option<u64>, ArbiterError> {
        let _guard = self.decide_lock(wait)?;
        if !self.is_holder() {
            return Ok(None);
        }
        self.charge_holder(self.slot, now_ns);
        let Some(t) = self.tenant_of(self.slot) else {
            return Ok(None);
        };
        let waiters = self.waiters();
        let mut tenants = self.read_tenants();
        if !waiters.is_empty() && !schedule::keeps_card(&mut tenants, t, &waiters, now_ns) {
            return Ok(None);
        }
        let competing = schedule::competing_weight(&tenants, now_ns);
        let lease = schedule::renew(&mut tenants[t], competing, now_ns);
        self.write_tenant(t, &tenants[t]);
        // The renewal is the service in progress now: a tenant that starts competing starts no
        // earlier than its virtual time (start-time fair queuing).
        let header = &self.layout().header;
        header.vclock.fetch_max(tenants[t].vtime, Ordering::AcqRel);
        Ok(lease.map(|lease| {
            let end = now_ns + lease;
            self.layout()
                .header
                .lease_end_ns
                .store(end, Ordering::Release);
            end
        }))
    }

    /// The holder gives the card up (its queued work has finished): charged for the whole
    /// lease, and the card goes to the next waiter at once.
    pub fn release(&self, now_ns: u64, wait: Duration) -> Result<(), ArbiterError> {
        let _guard = self.decide_lock(wait)?;
        if !self.is_holder() {
            return Ok(());
        }
        self.charge_holder(self.slot, now_ns);
        self.layout().header.holder.store(0, Ordering::Release);
        self.bump_grants();
        self.grant(now_ns);
        Ok(())
    }

    /// This process leaves (it exits): the card is released if held, the record freed.
    pub fn leave(&self) {
        let _ = self.release(now_ns(), LOCK_TIMEOUT);
        let record = &self.layout().processes[self.slot];
        record.waiting_since_ns.store(0, Ordering::Release);
        record.pid.store(0, Ordering::Release);
    }

    /// Statistics of this process's tenant: (nanoseconds it held the card, leases).
    pub fn tenant_stats(&self) -> (u64, u64) {
        let r = &self.layout().tenants[self.tenant];
        (
            r.used_ns.load(Ordering::Relaxed),
            r.leases.load(Ordering::Relaxed),
        )
    }
}

/// Launches that went ahead without the card, summed over the process records of an arbiter
/// file's bytes (for tools and tests; records of exited processes keep their count).
pub fn unarbitrated_launches(file: &[u8]) -> u64 {
    let records = std::mem::offset_of!(Layout, processes);
    let field = std::mem::offset_of!(ProcessRecord, unarbitrated);
    let size = std::mem::size_of::<ProcessRecord>();
    (0..PROCESSES)
        .filter_map(|p| file.get(records + p * size + field..records + p * size + field + 8))
        .map(|b| u64::from_ne_bytes(b.try_into().expect("8 bytes")))
        .fold(0u64, u64::saturating_add)
}

/// Holds a card's decision lock through an open file description of its own, as a process
/// stopped inside it would, until the returned file is dropped (for tests and diagnostics: what
/// the others then do is what they do under a stopped peer). None: the file cannot be opened or
/// the lock is held already.
pub fn hold_decision_lock(path: &str) -> Option<std::fs::File> {
    use std::os::fd::AsRawFd;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .ok()?;
    let (start, len) = LOCK_DECIDE;
    sys::try_lock(file.as_raw_fd(), start, len).then_some(file)
}

/// A tenant key from a file's identity (device, inode): never 0.
pub fn tenant_key((dev, ino): (u64, u64)) -> u64 {
    // FNV-1a over both: cheap, and collisions need two accounting files on one card whose
    // identities hash alike (they would then share one share, never exceed it).
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in dev.to_le_bytes().into_iter().chain(ino.to_le_bytes()) {
        hash ^= byte as u64;
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;
    const W: Duration = LOCK_TIMEOUT;

    fn member(key: u64, weight: u32) -> Member {
        Member {
            key,
            weight,
            force: false,
        }
    }

    fn path(dir: &tempfile::TempDir) -> String {
        dir.path()
            .join("GPU-card.arbiter")
            .to_str()
            .unwrap()
            .to_string()
    }

    #[test]
    fn a_lone_waiter_gets_the_card_and_keeps_it_while_nobody_else_waits() {
        let dir = tempfile::tempdir().unwrap();
        let a = Arbiter::open(&path(&dir), member(1, 30)).unwrap();
        let now = now_ns();
        a.start_waiting(now);
        let Turn::Holding { until_ns } = a.try_take(now, W).unwrap() else {
            panic!("not granted")
        };
        assert_eq!(until_ns, now + schedule::ROUND_NS);
        assert!(a.holds(now + 1) && !a.holds(until_ns));
        assert_eq!(
            a.renew(until_ns, W).unwrap(),
            Some(until_ns + schedule::ROUND_NS)
        );
    }

    #[test]
    fn the_holder_hands_over_to_a_waiter_of_another_container() {
        let dir = tempfile::tempdir().unwrap();
        let a = Arbiter::open(&path(&dir), member(1, 30)).unwrap();
        let b = Arbiter::open(&path(&dir), member(2, 70)).unwrap();
        let now = now_ns();
        a.start_waiting(now);
        assert!(matches!(a.try_take(now, W).unwrap(), Turn::Holding { .. }));
        b.start_waiting(now + 1);
        assert!(matches!(b.try_take(now + 1, W).unwrap(), Turn::Wait { .. }));
        assert!(a.others_waiting());
        // A lease cannot be renewed while someone waits (a is behind b, but it is the holder).
        a.note_busy(now + 50 * MS);
        assert_eq!(a.renew(now + 50 * MS, W).unwrap(), None);
        a.release(now + 50 * MS, W).unwrap();
        assert!(b.is_holder(), "granted by the release, before b asks again");
        assert!(b.holds(now + 51 * MS));
        assert_eq!(a.tenant_stats().0, 50 * MS);
    }

    #[test]
    fn a_dead_holders_card_is_taken_back_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let a = Arbiter::open(&path(&dir), member(1, 50)).unwrap();
        let b = Arbiter::open(&path(&dir), member(2, 50)).unwrap();
        let now = now_ns();
        a.start_waiting(now);
        a.try_take(now, W).unwrap();
        b.start_waiting(now);
        drop(a); // its descriptor closes: the kernel drops its locks, as at a kill -9
        assert!(matches!(
            b.try_take(now + MS, W).unwrap(),
            Turn::Holding { .. }
        ));
    }

    #[test]
    fn processes_of_one_container_share_its_tenant() {
        let dir = tempfile::tempdir().unwrap();
        let a1 = Arbiter::open(&path(&dir), member(7, 30)).unwrap();
        let a2 = Arbiter::open(&path(&dir), member(7, 30)).unwrap();
        assert_eq!(a1.tenant, a2.tenant);
        assert_ne!(a1.slot, a2.slot);
        let b = Arbiter::open(&path(&dir), member(8, 70)).unwrap();
        assert_ne!(b.tenant, a1.tenant);
    }

    #[test]
    fn the_records_of_the_dead_are_reused() {
        let dir = tempfile::tempdir().unwrap();
        let first = Arbiter::open(&path(&dir), member(1, 30)).unwrap();
        let (slot, tenant) = (first.slot, first.tenant);
        drop(first);
        let next = Arbiter::open(&path(&dir), member(2, 30)).unwrap();
        assert_eq!((next.slot, next.tenant), (slot, tenant));
    }

    #[test]
    fn a_foreign_or_garbage_file_is_started_afresh_and_never_trusted() {
        let dir = tempfile::tempdir().unwrap();
        let p = path(&dir);
        std::fs::write(&p, vec![0xffu8; FILE_SIZE]).unwrap();
        let a = Arbiter::open(&p, member(1, 30)).unwrap();
        let now = now_ns();
        a.start_waiting(now);
        assert!(matches!(a.try_take(now, W).unwrap(), Turn::Holding { .. }));
        // Now a tenant scribbles over everything but the magic: no crash, no endless wait.
        let layout = a.layout();
        layout.header.holder.store(u32::MAX, Ordering::Release);
        layout
            .header
            .lease_end_ns
            .store(u64::MAX, Ordering::Release);
        for t in &layout.tenants {
            t.weight.store(u32::MAX, Ordering::Relaxed);
            t.vtime.store(u64::MAX, Ordering::Relaxed);
        }
        for p in &layout.processes {
            p.tenant.store(u32::MAX, Ordering::Relaxed);
        }
        let b = Arbiter::open(&path(&dir), member(2, 50)).unwrap();
        b.start_waiting(now);
        assert!(matches!(
            b.try_take(now + 1, W).unwrap(),
            Turn::Holding { .. }
        ));
    }

    #[test]
    fn a_holder_that_never_lets_go_loses_the_card_when_stale() {
        let dir = tempfile::tempdir().unwrap();
        let a = Arbiter::open(&path(&dir), member(1, 50)).unwrap();
        let b = Arbiter::open(&path(&dir), member(2, 50)).unwrap();
        let now = now_ns();
        a.start_waiting(now);
        let Turn::Holding { until_ns } = a.try_take(now, W).unwrap() else {
            panic!()
        };
        b.start_waiting(now);
        assert!(matches!(
            b.try_take(until_ns, W).unwrap(),
            Turn::Wait { .. }
        ));
        assert!(matches!(
            b.try_take(until_ns + STALE_NS + 1, W).unwrap(),
            Turn::Holding { .. }
        ));
    }

    #[test]
    fn a_second_process_of_the_holders_container_gets_the_next_turn() {
        let dir = tempfile::tempdir().unwrap();
        let a1 = Arbiter::open(&path(&dir), member(7, 30)).unwrap();
        let a2 = Arbiter::open(&path(&dir), member(7, 30)).unwrap();
        let now = now_ns();
        a1.start_waiting(now);
        let Turn::Holding { until_ns } = a1.try_take(now, W).unwrap() else {
            panic!("not granted")
        };
        a2.start_waiting(now + MS);
        assert!(matches!(
            a2.try_take(now + MS, W).unwrap(),
            Turn::Wait { .. }
        ));
        // At the lease's end the holder does not go on while its sibling waits...
        a1.note_busy(until_ns);
        assert_eq!(a1.renew(until_ns, W).unwrap(), None);
        // ...and its release hands the card to the sibling.
        a1.release(until_ns, W).unwrap();
        assert!(a2.is_holder());
    }

    #[test]
    fn a_holder_is_charged_up_to_its_last_work_not_for_its_idle_time() {
        let dir = tempfile::tempdir().unwrap();
        let a = Arbiter::open(&path(&dir), member(1, 30)).unwrap();
        let b = Arbiter::open(&path(&dir), member(2, 70)).unwrap();
        let now = now_ns();
        a.start_waiting(now);
        a.try_take(now, W).unwrap();
        a.note_busy(now + 3 * MS);
        // Ten minutes later (nobody waited), the other container wants the card; the holder is
        // found stale and is charged its 3 ms, not ten minutes.
        let later = now + 600_000 * MS;
        b.start_waiting(later);
        assert!(matches!(
            b.try_take(later, W).unwrap(),
            Turn::Holding { .. }
        ));
        assert_eq!(a.tenant_stats().0, 3 * MS);
        // The same for a renewal after an idle lease.
        b.note_busy(later + 5 * MS);
        b.renew(later + 40 * MS + 600_000 * MS, W).unwrap();
        assert_eq!(b.tenant_stats().0, 5 * MS);
    }

    #[test]
    fn the_holder_never_marks_itself_waiting_and_is_not_granted_again_when_idle() {
        let dir = tempfile::tempdir().unwrap();
        let a = Arbiter::open(&path(&dir), member(1, 50)).unwrap();
        let b = Arbiter::open(&path(&dir), member(2, 50)).unwrap();
        let now = now_ns();
        a.start_waiting(now);
        assert!(matches!(a.try_take(now, W).unwrap(), Turn::Holding { .. }));
        // A thread of the holder that was waiting wakes up and asks again: no waiting mark.
        a.start_waiting(now + MS);
        assert!(matches!(
            a.try_take(now + MS, W).unwrap(),
            Turn::Holding { .. }
        ));
        assert!(!b.others_waiting(), "the holder counts as a waiter");
        // Given up while idle, the card goes to nobody: the next to ask gets it at once.
        a.release(now + 2 * MS, W).unwrap();
        assert!(!a.is_holder());
        b.start_waiting(now + 3 * MS);
        assert!(matches!(
            b.try_take(now + 3 * MS, W).unwrap(),
            Turn::Holding { .. }
        ));
    }

    #[test]
    fn a_record_reused_after_its_holder_died_holds_no_lease() {
        let dir = tempfile::tempdir().unwrap();
        let a = Arbiter::open(&path(&dir), member(1, 50)).unwrap();
        let now = now_ns();
        a.start_waiting(now);
        a.try_take(now, W).unwrap();
        let slot = a.slot;
        drop(a); // killed while holding the card
        let next = Arbiter::open(&path(&dir), member(1, 50)).unwrap();
        assert_eq!(next.slot, slot);
        assert!(!next.is_holder() && !next.holds(now_ns()));
    }

    /// A process stopped inside the decision lock (here: another open file description holding
    /// its byte, as a SIGSTOPped process's would): a caller waits its own bound once, then tries
    /// once without waiting until the backoff is over, and decides again the moment it is free.
    #[test]
    fn a_decision_lock_held_by_a_stopped_process_costs_one_bounded_wait() {
        let dir = tempfile::tempdir().unwrap();
        let a = Arbiter::open(&path(&dir), member(1, 50)).unwrap();
        let stopped = hold_decision_lock(&path(&dir)).unwrap();
        let started = std::time::Instant::now();
        assert!(a.try_take(now_ns(), Duration::from_millis(30)).is_err());
        let first = started.elapsed();
        assert!(
            first >= Duration::from_millis(30) && first < Duration::from_millis(500),
            "{first:?}"
        );
        let started = std::time::Instant::now();
        for _ in 0..100 {
            assert!(a.try_take(now_ns(), Duration::from_millis(30)).is_err());
        }
        assert!(
            started.elapsed() < Duration::from_millis(100),
            "{:?}",
            started.elapsed()
        );
        drop(stopped);
        assert!(a.try_take(now_ns(), Duration::from_millis(30)).is_ok());
    }

    #[test]
    fn a_process_registers_while_another_is_stopped_inside_the_decision_lock() {
        let dir = tempfile::tempdir().unwrap();
        let first = Arbiter::open(&path(&dir), member(1, 50)).unwrap();
        let _stopped = hold_decision_lock(&path(&dir)).unwrap();
        let started = std::time::Instant::now();
        let second = Arbiter::open(&path(&dir), member(2, 50)).unwrap();
        assert!(started.elapsed() < Duration::from_millis(500));
        assert_ne!(second.tenant, first.tenant);
    }

    #[test]
    fn processes_of_one_container_starting_together_share_one_tenant_record() {
        for _ in 0..20 {
            let dir = tempfile::tempdir().unwrap();
            let p = path(&dir);
            let opened: Vec<Arbiter> = std::thread::scope(|s| {
                let handles: Vec<_> = (0..8)
                    .map(|i| {
                        let p = p.clone();
                        s.spawn(move || Arbiter::open(&p, member(1 + i % 2, 50)).unwrap())
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let of_key = |k: usize| -> Vec<usize> {
                opened
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| i % 2 == k)
                    .map(|(_, a)| a.tenant)
                    .collect()
            };
            let (one, two) = (of_key(0), of_key(1));
            assert!(one.iter().all(|&t| t == one[0]), "{one:?}");
            assert!(two.iter().all(|&t| t == two[0]), "{two:?}");
            assert_ne!(one[0], two[0]);
        }
    }

    #[test]
    fn tenant_keys_are_never_zero_and_differ_by_inode() {
        assert_ne!(tenant_key((0, 0)), 0);
        assert_ne!(tenant_key((5, 1)), tenant_key((5, 2)));
    }
}

//! Test-only: the simulated GPU shared by the stand-in CUDA driver and NVML.
//!
//! The cards live in a state file (`GPUPOOL_STANDIN_STATE`) that every process using a stand-in maps
//! `MAP_SHARED`. The first process creates it from `GPUPOOL_STANDIN_DEVICES` (spec.rs); later ones
//! take the cards as written. The file holds, per card, the memory every process uses (allocations,
//! managed memory and context memory, separately), per process the time its kernels ran and the
//! time it had work on the card (kernels submitted and not yet complete) in sample-period buckets,
//! and whose turn on the card's engine it is. The engine is time-sliced like a GPU without MPS:
//! processes with work take turns of at most a timeslice each, a kernel still running at the end
//! of its process's turn is preempted and resumes at that process's next turn, and a process alone
//! keeps the engine.
//!
//! No process-shared mutex exists anywhere: a process killed while holding one would leave it held.
//! Instead:
//! - each CUDA process owns a slot and holds an open-file-description lock on the slot's lock byte for
//!   as long as it lives; the kernel drops that lock when the process dies, so a slot whose lock byte
//!   can be taken by someone else belongs to the dead, and its memory is released (as the real driver
//!   releases a dead process's memory);
//! - memory checks and reaping serialise on another OFD lock byte, held only for microseconds;
//! - the card's engine is one lock-free word (whose turn it is, whether a kernel runs, when the turn
//!   began), handed round robin to the next waiting slot, with a sequence word to sleep on (a
//!   futex); a waiter takes the engine from an owner that died (its slot lock is free), and from a
//!   live owner whose turn is over while no kernel of it runs.

pub mod engine;
pub mod spec;
pub mod sys;

use engine::State;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

pub use spec::{Config, DeviceSpec, SpecError, MAX_DEVICES};

/// Processes that can use the stand-in CUDA driver at once (per state file).
pub const MAX_SLOTS: usize = 64;
/// Sample-period buckets kept per process and card.
const RING: usize = 32;
/// Periods a per-process sample covers at most (NVML keeps a short history).
pub const SAMPLE_HISTORY: u64 = 10;

const MAGIC: u64 = u64::from_le_bytes(*b"GPSTNDIN");
const LAYOUT_VERSION: u32 = 2;

/// Lock bytes live far past the data (OFD locks may cover bytes beyond the end of a file), so that
/// locking never touches what the mapping holds.
const LOCK_BASE: u64 = 1 << 40;
const LOCK_INIT: u64 = LOCK_BASE;
const LOCK_MEMORY: u64 = LOCK_BASE + 1;
const fn lock_slot(slot: usize) -> u64 {
    LOCK_BASE + 64 + slot as u64
}

#[repr(C)]
struct Header {
    magic: AtomicU64,
    layout_version: u32,
    device_count: u32,
    context_memory: u64,
    reserved_memory: u64,
    sample_ns: u64,
    timeslice_ns: u64,
    _pad: [u8; 4096 - 48],
}

#[repr(C)]
struct DeviceRecord {
    uuid: [u8; 16],
    memory: u64,
    sms: u32,
    /// Whose turn it is (`engine::State`): slot + 1 of the owner (0: nobody), whether one of its
    /// kernels runs, and when its turn began.
    engine: AtomicU64,
    /// One bit per slot waiting for the engine.
    engine_waiters: AtomicU64,
    /// Bumped whenever the engine changes hands, so that waiters can sleep on it (a futex).
    engine_seq: AtomicU32,
    _pad32: u32,
    /// When the running kernel's current stretch started (0: none), so that samples count it.
    running_since_ns: AtomicU64,
}

#[repr(C)]
struct Bucket {
    period: AtomicU64,
    busy_ns: AtomicU64,
}

#[repr(C)]
struct SlotDevice {
    /// Device memory allocated (managed memory apart).
    used: AtomicU64,
    /// Managed memory: the card is charged for it, NVML's per-process figure leaves it out.
    managed: AtomicU64,
    context: AtomicU64,
    contexts: AtomicU32,
    /// Kernels submitted and not yet complete (written by the owning process only).
    pending: AtomicU32,
    /// Since when `pending` has been above 0 (0: no work).
    work_since_ns: AtomicU64,
    /// Time the process's kernels ran, per sample period.
    busy: [Bucket; RING],
    /// Time the process had work on the card (queued or running), per sample period.
    work: [Bucket; RING],
}

#[repr(C)]
struct Slot {
    pid: AtomicU32,
    host_pid: AtomicU32,
    _pad: [u8; 56],
    devices: [SlotDevice; MAX_DEVICES],
}

#[repr(C)]
struct Layout {
    header: Header,
    devices: [DeviceRecord; MAX_DEVICES],
    slots: [Slot; MAX_SLOTS],
}

/// What a card is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    pub uuid: [u8; 16],
    pub memory: u64,
    pub sms: u32,
}

impl DeviceInfo {
    pub fn uuid_string(&self) -> String {
        spec::format_uuid(&self.uuid)
    }
}

/// A card's memory as the driver sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryUse {
    pub total: u64,
    pub reserved: u64,
    /// Allocations and context memory of every live process.
    pub used: u64,
}

impl MemoryUse {
    pub fn free(&self) -> u64 {
        self.total
            .saturating_sub(self.reserved)
            .saturating_sub(self.used)
    }
}

/// A process with memory or a context on a card, as NVML lists it: `memory` is its allocations
/// and context memory, without managed memory (as the H200 showed it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcessUse {
    pub pid: u32,
    pub memory: u64,
}

/// One per-process utilisation sample (NVML's `nvmlProcessUtilizationSample_t`, the fields we fill).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sample {
    pub pid: u32,
    pub timestamp_us: u64,
    pub sm_util: u32,
}

/// What is charged to a process on a card.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Charge {
    /// Device memory the process allocated.
    Memory,
    /// Managed memory: on the card's account, not in the process's NVML figure.
    Managed,
    /// One context's fixed memory (counts the context too).
    Context,
}

/// One process's view of a state file.
pub struct Sim {
    file: File,
    layout: &'static Layout,
    path: String,
    slot: Option<usize>,
    /// Serialises this process's threads before they contend across processes for a card's engine.
    engine_local: [Mutex<()>; MAX_DEVICES],
    /// Serialises this process's writers of its own buckets and work counters.
    ring_writer: Mutex<()>,
    /// Serialises this process's threads on the memory lock.
    memory_local: Mutex<()>,
}

impl std::fmt::Debug for Sim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sim")
            .field("path", &self.path)
            .field("slot", &self.slot)
            .finish()
    }
}

/// The memory lock, held: this process's threads excluded by a mutex, other processes by the OFD
/// lock (which does not exclude threads sharing one open file description: a second `F_OFD_SETLKW`
/// from the same description succeeds at once).
struct Locked<'a> {
    sim: &'a Sim,
    offset: u64,
    _local: std::sync::MutexGuard<'a, ()>,
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        sys::unlock(self.sim.file.as_raw_fd(), self.offset);
    }
}

impl Sim {
    /// Opens (or creates) the state file named by `GPUPOOL_STANDIN_STATE`.
    pub fn open_from_env() -> Result<Sim, String> {
        let path = std::env::var("GPUPOOL_STANDIN_STATE").map_err(|_| {
            "GPUPOOL_STANDIN_STATE is not set: it names the simulated GPUs' state file".to_string()
        })?;
        Sim::open(&path, Config::from_env)
    }

    /// Opens the state file at `path`, creating it with `config()` when it does not hold a valid state.
    pub fn open(
        path: &str,
        config: impl FnOnce() -> Result<Config, SpecError>,
    ) -> Result<Sim, String> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o666)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| format!("{path}: {e}"))?;
        let fd = file.as_raw_fd();
        let size = std::mem::size_of::<Layout>();
        sys::lock_wait(fd, LOCK_INIT).map_err(|e| format!("{path}: lock: {e}"))?;
        let result = (|| {
            let len = file.metadata().map_err(|e| format!("{path}: {e}"))?.len();
            if len < size as u64 {
                file.set_len(size as u64)
                    .map_err(|e| format!("{path}: {e}"))?;
            }
            // SAFETY: a fresh shared mapping of `size` bytes of a file at least that long.
            let map = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    size,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    fd,
                    0,
                )
            };
            if map == libc::MAP_FAILED {
                return Err(format!("{path}: mmap: {}", std::io::Error::last_os_error()));
            }
            // SAFETY: the mapping is `size` bytes, page-aligned, lives for the process, and every
            // field is either atomic or written only here, under the init lock, before `magic`.
            let layout: &'static Layout = unsafe { &*(map as *const Layout) };
            let valid = layout.header.magic.load(Ordering::Acquire) == MAGIC
                && layout.header.layout_version == LAYOUT_VERSION;
            if !valid {
                let config = config().map_err(|e| format!("creating {path}: {e}"))?;
                // SAFETY: we hold the init lock and the state is not valid, so no process uses it.
                unsafe { initialise(map as *mut Layout, path, &config) };
                layout.header.magic.store(MAGIC, Ordering::Release);
            }
            Ok(layout)
        })();
        sys::unlock(fd, LOCK_INIT);
        let layout = result?;
        Ok(Sim {
            file,
            layout,
            path: path.to_string(),
            slot: None,
            engine_local: std::array::from_fn(|_| Mutex::new(())),
            ring_writer: Mutex::new(()),
            memory_local: Mutex::new(()),
        })
    }

    pub fn path(&self) -> &str {
        &self.path
    }

    pub fn device_count(&self) -> usize {
        self.layout.header.device_count as usize
    }

    pub fn device(&self, index: usize) -> DeviceInfo {
        let d = &self.layout.devices[index];
        DeviceInfo {
            uuid: d.uuid,
            memory: d.memory,
            sms: d.sms,
        }
    }

    pub fn context_memory(&self) -> u64 {
        self.layout.header.context_memory
    }

    pub fn sample_ns(&self) -> u64 {
        self.layout.header.sample_ns
    }

    /// The longest turn a process has on a card's engine while another process has work there.
    pub fn timeslice_ns(&self) -> u64 {
        self.layout.header.timeslice_ns
    }

    /// The slot this process holds, once `attach` succeeded.
    pub fn slot(&self) -> Option<usize> {
        self.slot
    }

    fn lock(&self, offset: u64) -> Locked<'_> {
        let local = self.memory_local.lock().unwrap_or_else(|e| e.into_inner());
        // An error here means the file descriptor is broken: nothing sensible remains to do.
        sys::lock_wait(self.file.as_raw_fd(), offset).expect("stand-in state lock");
        Locked {
            sim: self,
            offset,
            _local: local,
        }
    }

    /// Takes a process slot for this process (the CUDA side, at `cuInit`), recording `host_pid` as the
    /// PID NVML reports. The slot's lock is held until the process exits.
    pub fn attach(&mut self, host_pid: u32) -> Result<usize, String> {
        if let Some(slot) = self.slot {
            return Ok(slot);
        }
        let fd = self.file.as_raw_fd();
        let _guard = self.lock(LOCK_MEMORY);
        for (i, slot) in self.layout.slots.iter().enumerate() {
            if sys::lock_try(fd, lock_slot(i)).map_err(|e| format!("{}: {e}", self.path))? {
                if slot.pid.load(Ordering::Acquire) != 0 {
                    self.clear_slot(i);
                }
                slot.host_pid.store(host_pid, Ordering::Relaxed);
                slot.pid.store(std::process::id(), Ordering::Release);
                drop(_guard);
                self.slot = Some(i);
                return Ok(i);
            }
        }
        Err(format!(
            "{}: all {MAX_SLOTS} process slots are in use",
            self.path
        ))
    }

    /// Releases a dead process's slot: its memory, contexts, work and samples go, and the engine if
    /// it held it. Called with the memory lock held and the slot's own lock taken by us.
    fn clear_slot(&self, i: usize) {
        let slot = &self.layout.slots[i];
        for (d, sd) in slot.devices.iter().enumerate() {
            sd.used.store(0, Ordering::Relaxed);
            sd.managed.store(0, Ordering::Relaxed);
            sd.context.store(0, Ordering::Relaxed);
            sd.contexts.store(0, Ordering::Relaxed);
            sd.pending.store(0, Ordering::Relaxed);
            sd.work_since_ns.store(0, Ordering::Relaxed);
            for b in sd.busy.iter().chain(sd.work.iter()) {
                b.period.store(u64::MAX, Ordering::Relaxed);
                b.busy_ns.store(0, Ordering::Relaxed);
            }
            let dev = &self.layout.devices[d];
            dev.engine_waiters.fetch_and(!(1u64 << i), Ordering::AcqRel);
            self.take_back_from(d, i);
        }
        slot.host_pid.store(0, Ordering::Relaxed);
        slot.pid.store(0, Ordering::Release);
    }

    /// Frees card `dev`'s engine if the dead slot `dead` holds it, and wakes the waiters.
    fn take_back_from(&self, dev: usize, dead: usize) {
        let d = &self.layout.devices[dev];
        let mut word = d.engine.load(Ordering::Acquire);
        while State::unpack(word).owner == dead as u32 + 1 {
            match d.engine.compare_exchange(
                word,
                State::IDLE.pack(),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    d.running_since_ns.store(0, Ordering::Release);
                    self.engine_changed(dev);
                    return;
                }
                Err(now) => word = now,
            }
        }
    }

    /// Releases every slot whose owner died. Call with the memory lock held.
    fn reap_locked(&self) {
        let fd = self.file.as_raw_fd();
        for (i, slot) in self.layout.slots.iter().enumerate() {
            if Some(i) == self.slot || slot.pid.load(Ordering::Acquire) == 0 {
                continue;
            }
            if let Ok(true) = sys::lock_try(fd, lock_slot(i)) {
                if slot.pid.load(Ordering::Acquire) != 0 {
                    self.clear_slot(i);
                }
                sys::unlock(fd, lock_slot(i));
            }
        }
    }

    fn used_locked(&self, dev: usize) -> u64 {
        self.layout
            .slots
            .iter()
            .filter(|s| s.pid.load(Ordering::Acquire) != 0)
            .map(|s| {
                let sd = &s.devices[dev];
                sd.used.load(Ordering::Acquire)
                    + sd.managed.load(Ordering::Acquire)
                    + sd.context.load(Ordering::Acquire)
            })
            .sum()
    }

    fn my_slot(&self) -> &Slot {
        &self.layout.slots[self.slot.expect("stand-in: charge before attach")]
    }

    /// Charges `bytes` to this process on card `dev` if the card has room (after releasing the dead's
    /// memory); false when it does not (the caller answers out of memory).
    pub fn charge(&self, dev: usize, bytes: u64, kind: Charge) -> bool {
        let _guard = self.lock(LOCK_MEMORY);
        self.reap_locked();
        let d = &self.layout.devices[dev];
        let room = d.memory.saturating_sub(self.layout.header.reserved_memory);
        match self.used_locked(dev).checked_add(bytes) {
            Some(total) if total <= room => {}
            _ => return false,
        }
        let sd = &self.my_slot().devices[dev];
        match kind {
            Charge::Memory => {
                sd.used.fetch_add(bytes, Ordering::AcqRel);
            }
            Charge::Managed => {
                sd.managed.fetch_add(bytes, Ordering::AcqRel);
            }
            Charge::Context => {
                sd.context.fetch_add(bytes, Ordering::AcqRel);
                sd.contexts.fetch_add(1, Ordering::AcqRel);
            }
        }
        true
    }

    /// Gives back what `charge` took.
    pub fn uncharge(&self, dev: usize, bytes: u64, kind: Charge) {
        let sd = &self.my_slot().devices[dev];
        match kind {
            Charge::Memory => {
                sd.used.fetch_sub(bytes, Ordering::AcqRel);
            }
            Charge::Managed => {
                sd.managed.fetch_sub(bytes, Ordering::AcqRel);
            }
            Charge::Context => {
                sd.context.fetch_sub(bytes, Ordering::AcqRel);
                sd.contexts.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }

    /// The card's memory now (after releasing the dead's).
    pub fn memory(&self, dev: usize) -> MemoryUse {
        let _guard = self.lock(LOCK_MEMORY);
        self.reap_locked();
        MemoryUse {
            total: self.layout.devices[dev].memory,
            reserved: self.layout.header.reserved_memory,
            used: self.used_locked(dev),
        }
    }

    /// Live processes with a context or memory on the card, in slot order. Their memory leaves out
    /// managed memory, as NVML's per-process figure did on the H200.
    pub fn processes(&self, dev: usize) -> Vec<ProcessUse> {
        let _guard = self.lock(LOCK_MEMORY);
        self.reap_locked();
        self.layout
            .slots
            .iter()
            .filter(|s| s.pid.load(Ordering::Acquire) != 0)
            .filter_map(|s| {
                let sd = &s.devices[dev];
                let memory = sd.used.load(Ordering::Acquire) + sd.context.load(Ordering::Acquire);
                let any = memory > 0 || sd.managed.load(Ordering::Acquire) > 0;
                (sd.contexts.load(Ordering::Acquire) > 0 || any).then(|| ProcessUse {
                    pid: s.host_pid.load(Ordering::Relaxed),
                    memory,
                })
            })
            .collect()
    }

    /// A kernel was submitted to card `dev`: this process has work there until `run_kernel` has run
    /// it (NVML's per-process utilisation counts that time).
    pub fn kernel_queued(&self, dev: usize) {
        let slot = self.slot.expect("stand-in: kernel before attach");
        let _w = self.ring_writer.lock().unwrap_or_else(|e| e.into_inner());
        let sd = &self.layout.slots[slot].devices[dev];
        if sd.pending.fetch_add(1, Ordering::AcqRel) == 0 {
            sd.work_since_ns.store(sys::now_ns(), Ordering::Release);
        }
    }

    /// A queued kernel completed at `at`.
    fn kernel_done(&self, dev: usize, slot: usize, at: u64) {
        let _w = self.ring_writer.lock().unwrap_or_else(|e| e.into_inner());
        let sd = &self.layout.slots[slot].devices[dev];
        let before = sd
            .pending
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        if before == Ok(1) {
            let since = sd.work_since_ns.swap(0, Ordering::AcqRel);
            if since != 0 {
                self.record(&sd.work, since, at.max(since));
            }
        }
    }

    fn has_work(&self, dev: usize, slot: usize) -> bool {
        self.layout.slots[slot].devices[dev]
            .pending
            .load(Ordering::Acquire)
            > 0
    }

    /// Runs one kernel queued with `kernel_queued` on card `dev` for `duration` of engine time, then
    /// marks it complete. The engine is time-sliced across processes: this waits for this
    /// process's turn, runs until the kernel is done or the turn is over while another process
    /// waits (then the kernel is preempted and resumes at this process's next turn), and records
    /// the time it ran for utilisation. One kernel of a process runs at a time. Returns the
    /// wall-clock nanoseconds of its first start and of its completion.
    pub fn run_kernel(&self, dev: usize, duration: Duration) -> (u64, u64) {
        let slot = self.slot.expect("stand-in: kernel before attach");
        let _local = self.engine_local[dev]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let d = &self.layout.devices[dev];
        let timeslice = self.timeslice_ns();
        let mut remaining = duration.as_nanos() as u64;
        let mut first = None;
        loop {
            let ours = self.engine_acquire(dev, slot);
            let running = State {
                running: true,
                ..ours
            };
            if d.engine
                .compare_exchange(
                    ours.pack(),
                    running.pack(),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_err()
            {
                continue; // our turn was over while idle and a waiter took the engine
            }
            let start = sys::now_ns();
            first.get_or_insert(start);
            d.running_since_ns.store(start, Ordering::Release);
            let mut turn = running;
            let mut turn_end = turn.turn_us * 1000 + timeslice;
            let preempted = loop {
                let now = sys::now_ns();
                if now - start >= remaining {
                    break false;
                }
                if now >= turn_end {
                    if self.others_waiting(dev, slot) {
                        break true;
                    }
                    // Alone on the card: a new turn.
                    turn.turn_us = now / 1000;
                    d.engine.store(turn.pack(), Ordering::Release);
                    turn_end = now + timeslice;
                }
                sys::sleep_until((start + remaining).min(turn_end));
            };
            let now = sys::now_ns();
            let ran = (now - start).min(remaining);
            remaining -= ran;
            d.running_since_ns.store(0, Ordering::Release);
            if ran > 0 {
                let _w = self.ring_writer.lock().unwrap_or_else(|e| e.into_inner());
                self.record(
                    &self.layout.slots[slot].devices[dev].busy,
                    start,
                    start + ran,
                );
            }
            if preempted {
                self.engine_hand_over(dev, slot);
                continue;
            }
            self.kernel_done(dev, slot, now);
            // Keep the engine while this process has more work and either time left in its turn
            // or nobody else waiting; otherwise the next waiting process's turn begins.
            if self.has_work(dev, slot) && (now < turn_end || !self.others_waiting(dev, slot)) {
                d.engine.store(
                    State {
                        running: false,
                        ..turn
                    }
                    .pack(),
                    Ordering::Release,
                );
            } else {
                self.engine_hand_over(dev, slot);
            }
            return (first.unwrap_or(start), now);
        }
    }

    fn slot_alive(&self, slot: usize) -> bool {
        !matches!(
            sys::lock_held_elsewhere(self.file.as_raw_fd(), lock_slot(slot)),
            Ok(false)
        )
    }

    fn others_waiting(&self, dev: usize, slot: usize) -> bool {
        self.layout.devices[dev]
            .engine_waiters
            .load(Ordering::Acquire)
            & !(1u64 << slot)
            != 0
    }

    fn engine_changed(&self, dev: usize) {
        let d = &self.layout.devices[dev];
        d.engine_seq.fetch_add(1, Ordering::AcqRel);
        sys::futex_wake_all(&d.engine_seq);
    }

    /// Waits until it is `slot`'s turn on card `dev` with no kernel running; returns the engine
    /// word as it then is (owner = `slot`).
    fn engine_acquire(&self, dev: usize, slot: usize) -> State {
        let d = &self.layout.devices[dev];
        let me = slot as u32 + 1;
        let bit = 1u64 << slot;
        let timeslice_us = self.timeslice_ns() / 1000;
        let mut registered = false;
        let got = |registered: bool| {
            if registered {
                d.engine_waiters.fetch_and(!bit, Ordering::AcqRel);
            }
        };
        loop {
            let seq = d.engine_seq.load(Ordering::Acquire);
            let word = d.engine.load(Ordering::Acquire);
            let state = State::unpack(word);
            let now_us = sys::now_ns() / 1000;
            if state.owner == me && !state.running {
                got(registered);
                return state; // handed over to us, or kept from our last kernel
            }
            let take = |word: u64| {
                let ours = State::turn_of(slot, now_us);
                d.engine
                    .compare_exchange(word, ours.pack(), Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                    .then_some(ours)
            };
            if state.owner == 0 {
                if let Some(ours) = take(word) {
                    got(registered);
                    return ours;
                }
                continue;
            }
            if !registered {
                d.engine_waiters.fetch_or(bit, Ordering::AcqRel);
                registered = true;
                continue; // the owner may have handed over before it saw our bit
            }
            let owner = state.owner as usize - 1;
            // An owner between kernels whose turn is over yields to the next waiter in turn.
            let over = !state.running && state.turn_over(now_us, timeslice_us);
            if over
                && engine::next_after(owner, d.engine_waiters.load(Ordering::Acquire)) == Some(slot)
            {
                if let Some(ours) = take(word) {
                    got(registered);
                    self.engine_changed(dev);
                    return ours;
                }
                continue;
            }
            let wait_us = if state.running || over {
                20_000
            } else {
                (state.turn_us + timeslice_us)
                    .saturating_sub(now_us)
                    .clamp(100, 20_000)
            };
            sys::futex_wait(&d.engine_seq, seq, Duration::from_micros(wait_us));
            if d.engine.load(Ordering::Acquire) == word && !self.slot_alive(owner) {
                // The owner died with the card (or was handed it while waiting): take it back,
                // and drop its waiting bit so that no later hand-over gives it to the dead (its
                // slot is reaped later).
                d.engine_waiters
                    .fetch_and(!(1u64 << owner), Ordering::AcqRel);
                self.take_back_from(dev, owner);
            }
        }
    }

    /// Ends `slot`'s turn on card `dev`: the next waiting slot's turn begins now (round robin), or
    /// the engine is free.
    fn engine_hand_over(&self, dev: usize, slot: usize) {
        let d = &self.layout.devices[dev];
        let waiters = d.engine_waiters.load(Ordering::Acquire) & !(1u64 << slot);
        let next = match engine::next_after(slot, waiters) {
            Some(n) => State::turn_of(n, sys::now_ns() / 1000),
            None => State::IDLE,
        };
        d.engine.store(next.pack(), Ordering::Release);
        self.engine_changed(dev);
    }

    /// Adds `[start, end)` to a ring of per-period buckets. Call with `ring_writer` held.
    fn record(&self, ring: &[Bucket; RING], start: u64, end: u64) {
        let p = self.sample_ns();
        let mut t = start;
        while t < end {
            let period = t / p;
            let until = end.min((period + 1) * p);
            let b = &ring[(period % RING as u64) as usize];
            if b.period.load(Ordering::Acquire) == period {
                b.busy_ns.fetch_add(until - t, Ordering::AcqRel);
            } else {
                // Readers accept a bucket only if they read the same period before and after it.
                b.period.store(u64::MAX, Ordering::Release);
                b.busy_ns.store(until - t, Ordering::Release);
                b.period.store(period, Ordering::Release);
            }
            t = until;
        }
    }

    /// What a ring holds for `period`.
    fn bucket(ring: &[Bucket; RING], period: u64) -> u64 {
        let b = &ring[(period % RING as u64) as usize];
        let before = b.period.load(Ordering::Acquire);
        let value = b.busy_ns.load(Ordering::Acquire);
        let after = b.period.load(Ordering::Acquire);
        if before == period && after == period {
            value
        } else {
            0
        }
    }

    /// The part of `period` from `since` (0: none) to now.
    fn open_part(&self, since: u64, period: u64) -> u64 {
        let p = self.sample_ns();
        let (from, to) = (period * p, (period + 1) * p);
        if since == 0 || since >= to {
            return 0;
        }
        to.min(sys::now_ns()).saturating_sub(since.max(from))
    }

    /// Time slot `slot`'s kernels ran on card `dev` during `period`, a kernel running now included.
    fn busy_in(&self, slot: usize, dev: usize, period: u64) -> u64 {
        let d = &self.layout.devices[dev];
        let mut total = Self::bucket(&self.layout.slots[slot].devices[dev].busy, period);
        let state = State::unpack(d.engine.load(Ordering::Acquire));
        if state.owner == slot as u32 + 1 && state.running {
            total += self.open_part(d.running_since_ns.load(Ordering::Acquire), period);
        }
        total.min(self.sample_ns())
    }

    /// Time slot `slot` had work on card `dev` during `period`, work pending now included.
    fn work_in(&self, slot: usize, dev: usize, period: u64) -> u64 {
        let sd = &self.layout.slots[slot].devices[dev];
        let total = Self::bucket(&sd.work, period)
            + self.open_part(sd.work_since_ns.load(Ordering::Acquire), period);
        total.min(self.sample_ns())
    }

    /// Per-process samples on card `dev` newer than `last_seen_us` (NVML's `lastSeenTimeStamp`): one
    /// per process that had work in the window, which runs from the first sample period ending after
    /// `last_seen_us` (at most `SAMPLE_HISTORY` periods back) to the last completed period; `sm_util`
    /// is the share of that window during which the process had work on the card (kernels
    /// submitted and not yet complete), not its share of the engine: under time-slicing two
    /// processes saturating one card both read near 100 (the H200 read 75 and 73 for a pair that
    /// got 42 % and 61 % of the card). The timestamp is the window's end. Processes without work
    /// in the window are left out, as NVML leaves out processes without utilisation.
    pub fn process_samples(&self, dev: usize, last_seen_us: u64) -> Vec<Sample> {
        let p = self.sample_ns();
        let now = sys::now_ns();
        let Some(last) = (now / p).checked_sub(1) else {
            return Vec::new();
        };
        let end_us = (last + 1) * p / 1000;
        if end_us <= last_seen_us {
            return Vec::new();
        }
        let first = (last + 1)
            .saturating_sub(SAMPLE_HISTORY)
            .max(last_seen_us.saturating_mul(1000) / p);
        let periods = last - first + 1;
        let _guard = self.lock(LOCK_MEMORY);
        self.reap_locked();
        let mut out = Vec::new();
        for (i, slot) in self.layout.slots.iter().enumerate() {
            if slot.pid.load(Ordering::Acquire) == 0 {
                continue;
            }
            let worked: u64 = (first..=last).map(|k| self.work_in(i, dev, k)).sum();
            let util = ((worked * 100 + periods * p / 2) / (periods * p)).min(100) as u32;
            if worked > 0 {
                out.push(Sample {
                    pid: slot.host_pid.load(Ordering::Relaxed),
                    timestamp_us: end_us,
                    sm_util: util,
                });
            }
        }
        out
    }

    /// Percent of the last completed sample period during which the card ran a kernel.
    pub fn device_utilization(&self, dev: usize) -> u32 {
        let p = self.sample_ns();
        let Some(last) = (sys::now_ns() / p).checked_sub(1) else {
            return 0;
        };
        let _guard = self.lock(LOCK_MEMORY);
        self.reap_locked();
        let busy: u64 = (0..MAX_SLOTS)
            .filter(|&i| self.layout.slots[i].pid.load(Ordering::Acquire) != 0)
            .map(|i| self.busy_in(i, dev, last))
            .sum();
        ((busy * 100 + p / 2) / p).min(100) as u32
    }
}

/// Writes a fresh state.
///
/// # Safety
/// `layout` must be a writable mapping of a whole `Layout` that no other process reads as valid
/// (the caller holds the init lock and the magic is not set).
unsafe fn initialise(layout: *mut Layout, path: &str, config: &Config) {
    std::ptr::write_bytes(layout as *mut u8, 0, std::mem::size_of::<Layout>());
    let l = &mut *layout;
    l.header.layout_version = LAYOUT_VERSION;
    l.header.device_count = config.devices.len() as u32;
    l.header.context_memory = config.context_memory;
    l.header.reserved_memory = config.reserved_memory;
    l.header.sample_ns = config.sample_ms * 1_000_000;
    l.header.timeslice_ns = config.timeslice_us * 1000;
    for (i, spec) in config.devices.iter().enumerate() {
        let d = &mut l.devices[i];
        d.uuid = match &config.uuids {
            Some(list) => list[i],
            None => spec::derived_uuid(path, i),
        };
        d.memory = spec.memory;
        d.sms = spec.sms;
    }
    for slot in l.slots.iter_mut() {
        for sd in slot.devices.iter_mut() {
            for b in sd.busy.iter_mut().chain(sd.work.iter_mut()) {
                *b.period.get_mut() = u64::MAX;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(devices: &str) -> Config {
        let devices = devices.to_string();
        Config::from_lookup(move |k| (k == "GPUPOOL_STANDIN_DEVICES").then(|| devices.clone()))
            .unwrap()
    }

    #[test]
    fn the_first_opener_creates_and_later_ones_keep_the_cards() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state").to_str().unwrap().to_string();
        let a = Sim::open(&path, || Ok(config("2x1g:10"))).unwrap();
        let b = Sim::open(&path, || Ok(config("1x8g:20"))).unwrap();
        assert_eq!(b.device_count(), 2);
        assert_eq!(b.device(1), a.device(1));
        assert_eq!(b.device(0).memory, 1 << 30);
        assert_eq!(a.device(0).uuid, spec::derived_uuid(&path, 0));
    }

    #[test]
    fn charges_stop_at_capacity_and_come_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state").to_str().unwrap().to_string();
        let mut a = Sim::open(&path, || Ok(config("1x1g"))).unwrap();
        a.attach(std::process::id()).unwrap();
        assert!(a.charge(0, 300 << 20, Charge::Context));
        assert!(a.charge(0, (1 << 30) - (300 << 20), Charge::Memory));
        assert!(!a.charge(0, 1, Charge::Memory));
        assert_eq!(a.memory(0).free(), 0);
        a.uncharge(0, 1 << 20, Charge::Memory);
        assert!(a.charge(0, 1 << 20, Charge::Memory));
        let procs = a.processes(0);
        assert_eq!(
            procs,
            vec![ProcessUse {
                pid: std::process::id(),
                memory: 1 << 30
            }]
        );
    }

    #[test]
    fn threads_of_one_process_never_charge_past_capacity() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state").to_str().unwrap().to_string();
        let mut a = Sim::open(&path, || Ok(config("1x1g"))).unwrap();
        a.attach(std::process::id()).unwrap();
        let a = std::sync::Arc::new(a);
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let a = a.clone();
                std::thread::spawn(move || {
                    (0..300)
                        .filter(|_| a.charge(0, 1 << 20, Charge::Memory))
                        .count()
                })
            })
            .collect();
        let granted: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
        assert_eq!(granted, 1024);
        assert_eq!(a.memory(0).free(), 0);
    }

    fn sim(path: &str, cfg: Config, pid: u32) -> Sim {
        let mut s = Sim::open(path, move || Ok(cfg)).unwrap();
        s.attach(pid).unwrap();
        s
    }

    fn run(s: &Sim, ms: u64) -> (u64, u64) {
        s.kernel_queued(0);
        s.run_kernel(0, Duration::from_millis(ms))
    }

    #[test]
    fn alone_a_process_keeps_the_engine_for_its_whole_kernel() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state").to_str().unwrap().to_string();
        let a = sim(&path, config("1x1g"), 1);
        let (start, end) = run(&a, 40);
        let took = (end - start) / 1_000_000;
        assert!((40..60).contains(&took), "{took} ms");
    }

    /// Two processes: one kernel of 120 ms in one, 1 ms kernels back to back in the other (always
    /// one more queued, so that it has work all the time), turns of `timeslice_us`. Returns how
    /// long the long kernel took, and the short kernels' completions while it ran.
    fn long_against_short(timeslice_us: u64) -> (u64, Vec<u64>) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state").to_str().unwrap().to_string();
        let cfg = Config {
            timeslice_us,
            ..config("1x1g")
        };
        let a = std::sync::Arc::new(sim(&path, cfg.clone(), 1));
        let b = std::sync::Arc::new(sim(&path, cfg, 2));
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let shorts = {
            let (b, stop) = (b.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut ends = Vec::new();
                b.kernel_queued(0);
                while !stop.load(Ordering::Relaxed) {
                    b.kernel_queued(0);
                    ends.push(b.run_kernel(0, Duration::from_millis(1)).1);
                }
                ends
            })
        };
        std::thread::sleep(Duration::from_millis(10));
        let (start, end) = run(&a, 120);
        stop.store(true, Ordering::Relaxed);
        let ends = shorts.join().unwrap();
        let during = ends.into_iter().filter(|&e| e > start && e < end).collect();
        ((end - start) / 1_000_000, during)
    }

    fn longest_gap_ms(ends: &[u64]) -> u64 {
        ends.windows(2)
            .map(|w| w[1] - w[0])
            .max()
            .unwrap_or(u64::MAX)
            / 1_000_000
    }

    /// Time-slicing gives each process turns of at most 2 ms: the short kernels keep completing
    /// while the long one runs, and the long one takes about twice its duration.
    #[test]
    fn a_long_kernel_is_preempted_at_the_end_of_its_turn() {
        let (took_ms, during) = long_against_short(2000);
        // About 120 ms of each: the long kernel's 120 ms and as much of the short ones.
        assert!(
            (200..400).contains(&took_ms),
            "the long kernel took {took_ms} ms"
        );
        assert!(during.len() >= 60, "{} short kernels", during.len());
        // No short kernel waited for the long one to end: the longest gap between two of their
        // completions is a turn of the other process and a bit.
        let gap = longest_gap_ms(&during);
        assert!(gap < 15, "a gap of {gap} ms");
    }

    #[test]
    fn the_timeslice_is_the_length_of_a_turn() {
        let (took_ms, during) = long_against_short(20_000);
        assert!(
            (200..400).contains(&took_ms),
            "the long kernel took {took_ms} ms"
        );
        // Turns of 20 ms: the short kernels complete in bursts, 20 ms apart.
        let gap = longest_gap_ms(&during);
        assert!((18..60).contains(&gap), "a gap of {gap} ms");
    }

    #[test]
    fn one_kernel_runs_at_a_time_and_two_busy_processes_share_in_halves() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state").to_str().unwrap().to_string();
        let cfg = Config {
            sample_ms: 20,
            ..config("1x1g")
        };
        let sims: Vec<_> = (0..2)
            .map(|i| std::sync::Arc::new(sim(&path, cfg.clone(), 100 + i)))
            .collect();
        let begin = sys::now_ns();
        let workers: Vec<_> = sims
            .iter()
            .map(|s| {
                let s = s.clone();
                std::thread::spawn(move || {
                    let mut runs = Vec::new();
                    while sys::now_ns() - begin < 300_000_000 {
                        runs.push(run(&s, 3));
                    }
                    runs
                })
            })
            .collect();
        let runs: Vec<Vec<(u64, u64)>> = workers.into_iter().map(|w| w.join().unwrap()).collect();
        let engine_ms = |r: &Vec<(u64, u64)>| r.len() as f64 * 3.0;
        let wall_ms = (sys::now_ns() - begin) as f64 / 1e6;
        for r in &runs {
            let share = engine_ms(r) / wall_ms;
            assert!((0.3..=0.6).contains(&share), "{share}");
        }
        assert!(
            (engine_ms(&runs[0]) + engine_ms(&runs[1])) / wall_ms <= 1.02,
            "more than one kernel at a time"
        );
        // Both had work all along: NVML's per-process figure says so for both.
        let samples = sims[0].process_samples(0, 0);
        assert_eq!(samples.len(), 2, "{samples:?}");
        for sample in &samples {
            assert!(sample.sm_util >= 90, "{samples:?}");
        }
    }

    #[test]
    fn managed_memory_is_on_the_cards_account_not_the_processs() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state").to_str().unwrap().to_string();
        let a = sim(&path, config("1x1g"), 7);
        assert!(a.charge(0, 300 << 20, Charge::Context));
        assert!(a.charge(0, 600 << 20, Charge::Managed));
        assert_eq!(a.memory(0).used, 900 << 20);
        assert_eq!(
            a.processes(0),
            vec![ProcessUse {
                pid: 7,
                memory: 300 << 20
            }]
        );
        assert!(!a.charge(0, (124 << 20) + 1, Charge::Memory));
        a.uncharge(0, 600 << 20, Charge::Managed);
        assert_eq!(a.memory(0).used, 300 << 20);
    }

    #[test]
    fn work_time_shows_in_samples_and_no_work_shows_none() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state").to_str().unwrap().to_string();
        let cfg = Config {
            sample_ms: 20,
            ..config("1x1g")
        };
        let a = sim(&path, cfg.clone(), 4242);
        let idle = sim(&path, cfg, 4343);
        assert!(idle.charge(0, 1 << 20, Charge::Memory));
        let start = sys::now_ns();
        while sys::now_ns() - start < 100_000_000 {
            run(&a, 2);
        }
        let samples = a.process_samples(0, 0);
        assert_eq!(samples.len(), 1, "{samples:?}");
        assert_eq!(samples[0].pid, 4242);
        assert!(samples[0].sm_util >= 40, "{samples:?}");
        assert!(a.process_samples(0, samples[0].timestamp_us).is_empty());
        // Queued and not yet run is work too.
        a.kernel_queued(0);
        std::thread::sleep(Duration::from_millis(50));
        let samples = a.process_samples(0, 0);
        assert!(samples[0].sm_util >= 40, "{samples:?}");
    }
}

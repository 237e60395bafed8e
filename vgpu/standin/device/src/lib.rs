//! Test-only: the simulated GPU shared by the stand-in CUDA driver and NVML.
//!
//! The cards live in a state file (`GPUPOOL_STANDIN_STATE`) that every process using a stand-in maps
//! `MAP_SHARED`. The first process creates it from `GPUPOOL_STANDIN_DEVICES` (spec.rs); later ones
//! take the cards as written. The file holds, per card, the memory every process uses (allocations
//! and context memory, separately), the busy time of every process in sample-period buckets, and
//! which process's kernel the card is running (one kernel at a time per card, across processes, like a
//! GPU time-slicing contexts without MPS).
//!
//! No process-shared mutex exists anywhere: a process killed while holding one would leave it held.
//! Instead:
//! - each CUDA process owns a slot and holds an open-file-description lock on the slot's lock byte for
//!   as long as it lives; the kernel drops that lock when the process dies, so a slot whose lock byte
//!   can be taken by someone else belongs to the dead, and its memory is released (as the real driver
//!   releases a dead process's memory);
//! - memory checks and reaping serialise on another OFD lock byte, held only for microseconds;
//! - the card's kernel engine is a lock-free owner word with a hand-off to the next waiting slot
//!   (fairness: two busy processes alternate kernels) and a futex to sleep on; a waiter whose owner
//!   died (its slot lock is free) takes the engine back.

pub mod spec;
pub mod sys;

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
const LAYOUT_VERSION: u32 = 1;

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
    _pad: [u8; 4096 - 40],
}

#[repr(C)]
struct DeviceRecord {
    uuid: [u8; 16],
    memory: u64,
    sms: u32,
    /// Slot + 1 of the process whose kernel runs now, 0 when idle.
    engine_owner: AtomicU32,
    /// One bit per slot waiting for the engine.
    engine_waiters: AtomicU64,
    /// When the running kernel started (0: none), so that samples count a kernel still running.
    running_since_ns: AtomicU64,
    _pad: [u8; 16],
}

#[repr(C)]
struct Bucket {
    period: AtomicU64,
    busy_ns: AtomicU64,
}

#[repr(C)]
struct SlotDevice {
    used: AtomicU64,
    context: AtomicU64,
    contexts: AtomicU32,
    _pad: u32,
    ring: [Bucket; RING],
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

/// A process with memory or a context on a card, as NVML lists it.
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
    /// Serialises this process's writers of its own busy buckets.
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

    /// Releases a dead process's slot: its memory, contexts and samples go, and the engine if it
    /// held it. Called with the memory lock held and the slot's own lock taken by us.
    fn clear_slot(&self, i: usize) {
        let slot = &self.layout.slots[i];
        for (d, sd) in slot.devices.iter().enumerate() {
            sd.used.store(0, Ordering::Relaxed);
            sd.context.store(0, Ordering::Relaxed);
            sd.contexts.store(0, Ordering::Relaxed);
            for b in &sd.ring {
                b.period.store(u64::MAX, Ordering::Relaxed);
                b.busy_ns.store(0, Ordering::Relaxed);
            }
            let dev = &self.layout.devices[d];
            dev.engine_waiters.fetch_and(!(1u64 << i), Ordering::AcqRel);
            if dev
                .engine_owner
                .compare_exchange(i as u32 + 1, 0, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                dev.running_since_ns.store(0, Ordering::Release);
                sys::futex_wake_all(&dev.engine_owner);
            }
        }
        slot.host_pid.store(0, Ordering::Relaxed);
        slot.pid.store(0, Ordering::Release);
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
                s.devices[dev].used.load(Ordering::Acquire)
                    + s.devices[dev].context.load(Ordering::Acquire)
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

    /// Live processes with a context or memory on the card, in slot order.
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
                (sd.contexts.load(Ordering::Acquire) > 0 || memory > 0).then(|| ProcessUse {
                    pid: s.host_pid.load(Ordering::Relaxed),
                    memory,
                })
            })
            .collect()
    }

    /// Runs one kernel of `duration` on card `dev`: waits for the card (one kernel at a time across
    /// all processes, handed over in turn), keeps it busy for `duration`, records the busy time for
    /// this process's utilisation samples. Returns the (start, end) wall-clock nanoseconds.
    pub fn run_kernel(&self, dev: usize, duration: Duration) -> (u64, u64) {
        let slot = self.slot.expect("stand-in: kernel before attach");
        let local = self.engine_local[dev]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        self.engine_acquire(dev, slot);
        let d = &self.layout.devices[dev];
        let start = sys::now_ns();
        d.running_since_ns.store(start, Ordering::Release);
        sys::sleep_until(start + duration.as_nanos() as u64);
        let end = sys::now_ns();
        d.running_since_ns.store(0, Ordering::Release);
        self.record_busy(dev, slot, start, end);
        self.engine_release(dev, slot);
        drop(local);
        (start, end)
    }

    fn slot_alive(&self, slot: usize) -> bool {
        !matches!(
            sys::lock_held_elsewhere(self.file.as_raw_fd(), lock_slot(slot)),
            Ok(false)
        )
    }

    fn engine_acquire(&self, dev: usize, slot: usize) {
        let d = &self.layout.devices[dev];
        let me = slot as u32 + 1;
        let bit = 1u64 << slot;
        let mut registered = false;
        loop {
            match d
                .engine_owner
                .compare_exchange(0, me, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => break,
                Err(owner) if owner == me => break, // handed over to us
                Err(owner) => {
                    if !registered {
                        d.engine_waiters.fetch_or(bit, Ordering::AcqRel);
                        registered = true;
                        continue; // the owner may have released before it saw our bit
                    }
                    sys::futex_wait(&d.engine_owner, owner, Duration::from_millis(20));
                    if d.engine_owner.load(Ordering::Acquire) == owner
                        && !self.slot_alive(owner as usize - 1)
                    {
                        // The owner died with the card (or was handed it while waiting): take
                        // it back, and drop its waiting bit so that no later release hands the
                        // card to the dead again (its slot is reaped later).
                        d.engine_waiters
                            .fetch_and(!(1u64 << (owner - 1)), Ordering::AcqRel);
                        if d.engine_owner
                            .compare_exchange(owner, 0, Ordering::AcqRel, Ordering::Relaxed)
                            .is_ok()
                        {
                            d.running_since_ns.store(0, Ordering::Release);
                        }
                    }
                }
            }
        }
        if registered {
            d.engine_waiters.fetch_and(!bit, Ordering::AcqRel);
        }
    }

    fn engine_release(&self, dev: usize, slot: usize) {
        let d = &self.layout.devices[dev];
        let waiters = d.engine_waiters.load(Ordering::Acquire) & !(1u64 << slot);
        let next = if waiters == 0 {
            0
        } else {
            // Round robin: the first waiting slot after ours, wrapping around.
            let rotated = waiters.rotate_right(slot as u32 + 1);
            let offset = rotated.trailing_zeros() as usize;
            ((slot + 1 + offset) % 64) as u32 + 1
        };
        d.engine_owner.store(next, Ordering::Release);
        if waiters != 0 {
            sys::futex_wake_all(&d.engine_owner);
        }
    }

    fn record_busy(&self, dev: usize, slot: usize, start: u64, end: u64) {
        let p = self.sample_ns();
        let _w = self.ring_writer.lock().unwrap_or_else(|e| e.into_inner());
        let sd = &self.layout.slots[slot].devices[dev];
        let mut t = start;
        while t < end {
            let period = t / p;
            let until = end.min((period + 1) * p);
            let b = &sd.ring[(period % RING as u64) as usize];
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

    fn busy_in(&self, slot: usize, dev: usize, period: u64) -> u64 {
        let b = &self.layout.slots[slot].devices[dev].ring[(period % RING as u64) as usize];
        let before = b.period.load(Ordering::Acquire);
        let busy = b.busy_ns.load(Ordering::Acquire);
        let after = b.period.load(Ordering::Acquire);
        let mut total = if before == period && after == period {
            busy
        } else {
            0
        };
        // A kernel still running counts for the part of the period it has covered.
        let d = &self.layout.devices[dev];
        if d.engine_owner.load(Ordering::Acquire) == slot as u32 + 1 {
            let since = d.running_since_ns.load(Ordering::Acquire);
            let p = self.sample_ns();
            let (from, to) = (period * p, (period + 1) * p);
            if since != 0 && since < to {
                total += to.min(sys::now_ns()).saturating_sub(since.max(from));
            }
        }
        total.min(self.sample_ns())
    }

    /// Per-process samples on card `dev` newer than `last_seen_us` (NVML's `lastSeenTimeStamp`): one
    /// per process busy in the window, which runs from the first sample period ending after
    /// `last_seen_us` (at most `SAMPLE_HISTORY` periods back) to the last completed period; `sm_util`
    /// is the process's busy share of that window, the timestamp the window's end. Processes idle
    /// over the window are left out, as NVML leaves out processes without utilisation.
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
            let busy: u64 = (first..=last).map(|k| self.busy_in(i, dev, k)).sum();
            let util = ((busy * 100 + periods * p / 2) / (periods * p)).min(100) as u32;
            if util > 0 {
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
            for b in sd.ring.iter_mut() {
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

    #[test]
    fn busy_time_shows_in_samples() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state").to_str().unwrap().to_string();
        let cfg = Config {
            sample_ms: 20,
            ..config("1x1g")
        };
        let mut a = Sim::open(&path, move || Ok(cfg)).unwrap();
        a.attach(4242).unwrap();
        let start = sys::now_ns();
        while sys::now_ns() - start < 100_000_000 {
            a.run_kernel(0, Duration::from_millis(2));
        }
        let samples = a.process_samples(0, 0);
        assert_eq!(samples.len(), 1);
        assert_eq!(samples[0].pid, 4242);
        assert!(samples[0].sm_util >= 40, "{samples:?}");
        assert!(a.process_samples(0, samples[0].timestamp_us).is_empty());
    }
}

//! The compute limiter in a process: the gate every launch path passes, the marks that keep the
//! holder from queueing far ahead of the card, and the keeper thread that hands the card over.
//!
//! A launch on a card with an SM limit goes ahead only while this process holds the card's lease
//! (`arbiter.rs`); otherwise it waits for the container's turn, never longer than its bound
//! (`GPUPOOL_VGPU_MAX_LAUNCH_WAIT_MS`), then goes ahead unarbitrated and is counted: a rank held
//! here while its peer's collective kernel spins must get through, or both hang.
//!
//! Launches are asynchronous, so holding the card when launching is not enough: the work must
//! also have finished before the card passes to the next tenant, or the two time-slice and
//! neither gets its share. After each launch the limiter records an event ("mark") on the same
//! stream; the holder never has more marks outstanding than about [`AHEAD_NS`] of work, and when
//! its lease ends (or it goes idle while another container waits) it stops launching, waits for
//! its marks, and only then gives the card up, charged for everything up to that moment. A
//! program that queues a thousand kernels (PyTorch eager does) is paced to a few milliseconds of
//! queue, which its throughput does not notice.
//!
//! Captured launches (stream capture builds a graph, nothing runs) pass untouched and unmarked;
//! the limiter's own event queries run in the relaxed capture mode, so that they never break a
//! capture another thread is making in global mode.
//!
//! Every wait here is bounded, the holder's too: a launch waits at most its bound in all (for the
//! card, for its queue to have room, for the decision lock, for a drain it does itself), then goes
//! ahead, counted. The holder publishes its last sign of work (`Arbiter::note_busy`: each launch,
//! queued work seen running, a drain's end), which is what it is charged up to; an idle holder
//! gives the card up (`schedule::IDLE_NS` when someone waits, `schedule::IDLE_RELEASE_NS` when
//! nobody does). Marks are forgotten before their context is destroyed (`forget_context`, called
//! by the context hooks): the keeper never queries an event the driver has freed. A panic under
//! `turn` leaves it poisoned, which is read as free, never as held forever.

use crate::arbiter::{Arbiter, ArbiterError, Turn, LOCK_BACKOFF_NS};
use crate::cuda::*;
use crate::driver;
use crate::env::MAX_DEVICES;
use crate::process::{self, Process, GATE, GATE_PASS, GATE_REFUSED, GATE_THROTTLE};
use crate::schedule::{IDLE_NS, IDLE_RELEASE_NS};
use crate::sys::{futex_wait, now_ns};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, TryLockError};
use std::time::Duration;

/// How much work (estimated) the holder may have queued on the card. Its lease's end is late by
/// at most about this (and one launch), which is charged to it.
pub const AHEAD_NS: u64 = 4_000_000;
/// The longest a holder waits for its queued work before giving the card up anyway (a kernel that
/// never ends, a collective waiting for a peer).
pub const DRAIN_MAX_NS: u64 = 500_000_000;
/// Work per launch assumed before any was measured: a conservative (short) queue to start with.
const INITIAL_LAUNCH_NS: u64 = 1_000_000;
const MAX_OUTSTANDING: usize = 1024;
const POLL: Duration = Duration::from_micros(50);
/// How often a holder giving the card up looks at its last marks: the card idles from its last
/// kernel's end until the next tenant starts, and a drain lasts a few milliseconds at most. (A
/// blocking wait on the event would have no bound: a kernel that never ends would hang us.)
const DRAIN_POLL: Duration = Duration::from_micros(10);

/// What a launch that passed the gate needs afterwards: where to record its mark.
pub struct Ticket {
    device: &'static DeviceLimiter,
    stream: CUstream,
}

struct Mark {
    context: usize,
    event: usize,
}

#[derive(Default)]
struct Marks {
    outstanding: VecDeque<Mark>,
    /// Recorded events that completed, per context, ready to be recorded again.
    spare: Vec<Mark>,
    /// Launches whose mark completed during the current lease.
    completed_in_lease: u64,
}

/// One claim index's limiter state in this process.
pub struct DeviceLimiter {
    index: usize,
    /// Set while the holder drains its queue to give the card up: launches wait.
    closing: AtomicBool,
    /// Launches between the gate and their mark (the drain waits for them).
    in_gate: AtomicU32,
    last_launch_ns: AtomicU64,
    /// Estimated card time per launch, from the leases' measured time.
    launch_ns: AtomicU64,
    /// When this process got (or last renewed) the card.
    held_since_ns: AtomicU64,
    /// Threads of this process waiting for the card.
    waiting_threads: AtomicU32,
    /// Launches made since the card was granted or the lease renewed.
    launched_in_lease: AtomicU64,
    marks: Mutex<Marks>,
    /// One thread of the process renews or gives up the lease at a time.
    turn: Mutex<()>,
}

static DEVICES: [AtomicPtr<DeviceLimiter>; MAX_DEVICES] =
    [const { AtomicPtr::new(std::ptr::null_mut()) }; MAX_DEVICES];
static KEEPER_STARTED: AtomicBool = AtomicBool::new(false);
/// When this process last said that the decision lock was not free (said once per backoff).
static LOCK_REPORTED_NS: AtomicU64 = AtomicU64::new(0);
static ATFORK_REGISTERED: AtomicBool = AtomicBool::new(false);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The gate. Ok(None): launch, nothing to record; Ok(Some): launch, then [`after_launch`];
/// Err: return this code instead (the environment was refused).
#[inline]
pub fn before_launch(stream: CUstream, per_thread: bool) -> Result<Option<Ticket>, CUresult> {
    match GATE.load(Ordering::Relaxed) {
        GATE_PASS => Ok(None),
        GATE_THROTTLE => Ok(throttle(stream, per_thread)),
        GATE_REFUSED => Err(CUDA_ERROR_NOT_INITIALIZED),
        // Not decided yet (or another thread is publishing it): decided from the state itself,
        // never by asking the gate again (a thread that asked while another one initialises
        // would recurse until it did).
        _ => match process::get() {
            Some(process) if process.config.throttles() => Ok(throttle(stream, per_thread)),
            Some(_) => Ok(None),
            None => Err(CUDA_ERROR_NOT_INITIALIZED),
        },
    }
}

/// After the real launch: its mark, when it was launched.
pub fn after_launch(ticket: Option<Ticket>, rc: CUresult) {
    if let Some(ticket) = ticket {
        if rc == CUDA_SUCCESS {
            ticket.device.record_mark(ticket.stream);
        }
        ticket.device.in_gate.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The stream a launch names, as a handle that means the same thing to any entry point: NULL is
/// the legacy stream for the plain entry points and the thread's own stream for `_ptsz`.
fn explicit(stream: CUstream, per_thread: bool) -> CUstream {
    if !stream.is_null() {
        stream
    } else if per_thread {
        CU_STREAM_PER_THREAD as CUstream
    } else {
        CU_STREAM_LEGACY as CUstream
    }
}

#[cold]
fn throttle(stream: CUstream, per_thread: bool) -> Option<Ticket> {
    let process = process::get()?;
    let index = process.launch_device()?;
    let arbiter = process.arbiter(index)?;
    let stream = explicit(stream, per_thread);
    if driver::capturing(stream) {
        return None;
    }
    let device = device(process, index)?;
    ensure_keeper();
    let start = now_ns();
    let deadline = start.saturating_add(process.config.max_launch_wait.as_nanos() as u64);
    loop {
        device.in_gate.fetch_add(1, Ordering::SeqCst);
        let now = now_ns();
        if arbiter.holds(now)
            && !device.closing.load(Ordering::SeqCst)
            && !device.would_outlast_lease(arbiter, now)
        {
            if device.room_to_queue(arbiter, deadline) {
                device.launched(arbiter);
                device.launched_in_lease.fetch_add(1, Ordering::Relaxed);
                return Some(Ticket { device, stream });
            }
            device.in_gate.fetch_sub(1, Ordering::SeqCst);
            continue; // the lease ended while the queue drained
        }
        device.in_gate.fetch_sub(1, Ordering::SeqCst);
        let decided = if now_ns() >= deadline {
            false
        } else if arbiter.is_holder() {
            device.end_of_lease(arbiter, deadline)
        } else {
            device.wait_turn(arbiter, deadline)
        };
        if !decided {
            arbiter.count_unarbitrated();
            log_debug!(
                "a launch on device {index} waited its bound ({} ms) for the card and went ahead",
                (now_ns() - start) / 1_000_000
            );
            device.in_gate.fetch_add(1, Ordering::SeqCst);
            device.launched(arbiter);
            return Some(Ticket { device, stream });
        }
    }
}

/// What is left of a wait that must end at `deadline`.
fn until(deadline: u64) -> Duration {
    Duration::from_nanos(deadline.saturating_sub(now_ns()))
}

/// The decision lock was not free: said once per backoff, not on every launch (and never while
/// `turn` is held: see `log.rs`, a write to stderr never blocks).
fn report(error: &ArbiterError) {
    let now = now_ns();
    let last = LOCK_REPORTED_NS.load(Ordering::Relaxed);
    if (last == 0 || now.saturating_sub(last) >= LOCK_BACKOFF_NS)
        && LOCK_REPORTED_NS
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    {
        log_warn!("{error}; launches go ahead unarbitrated until it is free");
    }
}

fn device(process: &'static Process, index: usize) -> Option<&'static DeviceLimiter> {
    let current = DEVICES[index].load(Ordering::Acquire);
    if !current.is_null() {
        // SAFETY: DEVICES only holds leaked boxes, never freed.
        return Some(unsafe { &*current });
    }
    process.arbiter(index)?;
    register_atfork();
    let created = Box::into_raw(Box::new(DeviceLimiter::new(index)));
    match DEVICES[index].compare_exchange(
        std::ptr::null_mut(),
        created,
        Ordering::AcqRel,
        Ordering::Acquire,
    ) {
        // SAFETY: as above.
        Ok(_) => Some(unsafe { &*created }),
        Err(other) => {
            // SAFETY: ours, never shared.
            drop(unsafe { Box::from_raw(created) });
            Some(unsafe { &*other })
        }
    }
}

impl DeviceLimiter {
    fn new(index: usize) -> DeviceLimiter {
        DeviceLimiter {
            index,
            closing: AtomicBool::new(false),
            in_gate: AtomicU32::new(0),
            last_launch_ns: AtomicU64::new(0),
            launch_ns: AtomicU64::new(INITIAL_LAUNCH_NS),
            held_since_ns: AtomicU64::new(0),
            waiting_threads: AtomicU32::new(0),
            launched_in_lease: AtomicU64::new(0),
            marks: Mutex::new(Marks::default()),
            turn: Mutex::new(()),
        }
    }

    /// The holder may launch when its queue has room; waits (polling its marks) while it has
    /// about [`AHEAD_NS`] of work queued. False: the lease ended meanwhile.
    fn room_to_queue(&self, arbiter: &Arbiter, deadline: u64) -> bool {
        let budget = (AHEAD_NS / self.launch_ns.load(Ordering::Relaxed).max(1))
            .clamp(2, MAX_OUTSTANDING as u64) as usize;
        loop {
            if self.outstanding() < budget {
                return true;
            }
            self.poll_marks(arbiter);
            if self.outstanding() < budget {
                return true;
            }
            let now = now_ns();
            if now >= deadline {
                return true; // its bound: a queue that does not move must not hang the program
            }
            if !arbiter.holds(now) || self.closing.load(Ordering::SeqCst) {
                return false;
            }
            std::thread::sleep(POLL);
        }
    }

    /// Whether this launch, behind the work already queued, would finish after the lease's end:
    /// the holder then stops launching, so that its queue is empty when the lease ends and the
    /// next tenant starts at once (not after our queue). The first launch of a lease always goes,
    /// or a tenant whose launches are longer than its leases would never run.
    fn would_outlast_lease(&self, arbiter: &Arbiter, now: u64) -> bool {
        if self.launched_in_lease.load(Ordering::Relaxed) == 0 {
            return false;
        }
        let per_launch = self.launch_ns.load(Ordering::Relaxed);
        let queued = (self.outstanding() as u64 + 1).saturating_mul(per_launch);
        now.saturating_add(queued) > arbiter.lease_end_ns()
    }

    fn outstanding(&self) -> usize {
        lock(&self.marks).outstanding.len()
    }

    /// A launch goes ahead: a sign of work.
    fn launched(&self, arbiter: &Arbiter) {
        let now = now_ns();
        self.last_launch_ns.store(now, Ordering::Relaxed);
        arbiter.note_busy(now);
    }

    /// `turn`, if free. A panic under it (caught at the entry point) leaves it poisoned: that is
    /// free too, or the holder would find it busy forever.
    fn try_turn(&self) -> Option<MutexGuard<'_, ()>> {
        match self.turn.try_lock() {
            Ok(guard) => Some(guard),
            Err(TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        }
    }

    /// Records an event after a launch, in the current context, on the launch's stream.
    fn record_mark(&self, stream: CUstream) {
        let mut context: CUcontext = std::ptr::null_mut();
        if unsafe { driver::cuCtxGetCurrent(&mut context) } != Some(CUDA_SUCCESS) {
            return;
        }
        let context = context as usize;
        let mut marks = lock(&self.marks);
        if marks.outstanding.len() >= MAX_OUTSTANDING {
            return;
        }
        let spare = marks.spare.iter().position(|m| m.context == context);
        let event = match spare {
            Some(i) => marks.spare.swap_remove(i).event,
            None => {
                let mut event: CUevent = std::ptr::null_mut();
                let created = driver::relaxed(|| unsafe {
                    driver::cuEventCreate(&mut event, CU_EVENT_DISABLE_TIMING)
                });
                if created != Some(CUDA_SUCCESS) {
                    return;
                }
                event as usize
            }
        };
        let recorded =
            driver::relaxed(|| unsafe { driver::cuEventRecord(event as CUevent, stream) });
        if recorded == Some(CUDA_SUCCESS) {
            marks.outstanding.push_back(Mark { context, event });
        } else {
            driver::relaxed(|| unsafe { driver::cuEventDestroy_v2(event as CUevent) });
        }
    }

    /// Takes the completed marks off the queue. Work that was queued (finished or not) is a sign
    /// of work until now.
    fn poll_marks(&self, arbiter: &Arbiter) {
        let mut marks = lock(&self.marks);
        if marks.outstanding.is_empty() {
            return;
        }
        arbiter.note_busy(now_ns());
        let Marks {
            outstanding,
            spare,
            completed_in_lease,
        } = &mut *marks;
        driver::relaxed(|| {
            outstanding.retain(|mark| {
                match unsafe { driver::cuEventQuery(mark.event as CUevent) } {
                    Some(CUDA_ERROR_NOT_READY) => true,
                    Some(CUDA_SUCCESS) => {
                        *completed_in_lease += 1;
                        spare.push(Mark {
                            context: mark.context,
                            event: mark.event,
                        });
                        false
                    }
                    // Its context is gone (or the driver says the event is): nothing to wait for.
                    _ => false,
                }
            })
        });
    }

    /// The lease ran out (or the card must be handed over): renew it when nobody else waits,
    /// otherwise drain and give the card up. One thread of the process does it; others wait.
    /// False: nothing could be decided before `deadline` (the decision lock is not free): the
    /// launch goes ahead.
    fn end_of_lease(&self, arbiter: &Arbiter, deadline: u64) -> bool {
        let Some(_turn) = self.try_turn() else {
            std::thread::sleep(POLL);
            return true;
        };
        if !arbiter.is_holder() {
            return true;
        }
        let now = now_ns();
        if now < arbiter.lease_end_ns() && !self.would_outlast_lease(arbiter, now) {
            return true; // renewed by another thread meanwhile
        }
        self.poll_marks(arbiter);
        match arbiter.renew(now, until(deadline)) {
            Ok(Some(_)) => {
                self.learn_launch_cost(now);
                self.launched_in_lease.store(0, Ordering::Relaxed);
                true
            }
            Ok(None) => self.hand_over(arbiter, deadline),
            Err(error) => {
                report(&error);
                false
            }
        }
    }

    /// Stops launching, waits for the queued work (until `deadline`), gives the card up. False:
    /// the work did not finish or the decision lock was not free in time; the card is kept (the
    /// keeper, or the next launch, tries again), its lease over.
    fn hand_over(&self, arbiter: &Arbiter, deadline: u64) -> bool {
        self.closing.store(true, Ordering::SeqCst);
        // Each poll of work still queued notes it as a sign of work: the charge runs to the end
        // of the drain.
        let drained = loop {
            self.poll_marks(arbiter);
            if self.outstanding() == 0 && self.in_gate.load(Ordering::SeqCst) == 0 {
                break true;
            }
            if now_ns() >= deadline {
                log_debug!(
                    "device {}: queued work did not finish in time; the card is kept for now",
                    self.index
                );
                break false;
            }
            std::thread::sleep(DRAIN_POLL);
        };
        let now = now_ns();
        let released = if drained {
            self.learn_launch_cost(now);
            arbiter.release(now, until(deadline))
        } else {
            Ok(())
        };
        self.closing.store(false, Ordering::SeqCst);
        match released {
            Ok(()) => drained,
            Err(error) => {
                report(&error);
                false
            }
        }
    }

    /// The card time per launch, from the lease that just ended or was renewed: its length
    /// over the launches whose marks completed in it (an average over leases). Idle moments in
    /// the lease make it an overestimate, which only shortens the queue.
    fn learn_launch_cost(&self, now: u64) {
        let completed = std::mem::take(&mut lock(&self.marks).completed_in_lease);
        let held = now.saturating_sub(self.held_since_ns.swap(now, Ordering::Relaxed));
        if completed > 0 && held > 0 {
            let previous = self.launch_ns.load(Ordering::Relaxed);
            self.launch_ns
                .store((previous * 3 + held / completed) / 4, Ordering::Relaxed);
        }
    }

    /// Waits for this container's turn; false when the bound passed first.
    fn wait_turn(&self, arbiter: &Arbiter, deadline: u64) -> bool {
        self.waiting_threads.fetch_add(1, Ordering::AcqRel);
        let granted = loop {
            let now = now_ns();
            if arbiter.is_holder() {
                break true; // granted by the holder's release while this thread slept
            }
            arbiter.start_waiting(now);
            let seq = arbiter.grant_seq().load(Ordering::Acquire);
            let until = match arbiter.try_take(now, until(deadline)) {
                Ok(Turn::Holding { .. }) => break true,
                Ok(Turn::Wait { until_ns }) => until_ns,
                Err(error) => {
                    report(&error);
                    break false;
                }
            };
            let now = now_ns();
            if now >= deadline {
                break false;
            }
            let sleep = until
                .min(deadline)
                .saturating_sub(now)
                .clamp(50_000, 5_000_000);
            futex_wait(arbiter.grant_seq(), seq, Duration::from_nanos(sleep));
        };
        // The process's waiting mark stays while another of its threads still waits.
        if self.waiting_threads.fetch_sub(1, Ordering::AcqRel) == 1 && !granted {
            arbiter.stop_waiting();
        }
        if granted {
            self.held_since_ns.store(now_ns(), Ordering::Relaxed);
            self.launched_in_lease.store(0, Ordering::Relaxed);
        }
        granted
    }

    /// The keeper's look at this device: a holder that another process waits for gives the card
    /// up at its lease's end, or earlier when it is idle; an idle holder that nobody waits for
    /// gives it up after [`IDLE_RELEASE_NS`] (nothing of its idle time is charged either way).
    fn keep(&self, arbiter: &Arbiter) -> bool {
        if !arbiter.is_holder() {
            return false;
        }
        self.poll_marks(arbiter);
        let now = now_ns();
        let idle_for = if self.outstanding() == 0 && self.in_gate.load(Ordering::SeqCst) == 0 {
            now.saturating_sub(self.last_launch_ns.load(Ordering::Relaxed))
        } else {
            0
        };
        let drain_by = now.saturating_add(DRAIN_MAX_NS);
        let others = arbiter.others_waiting();
        if idle_for >= if others { IDLE_NS } else { IDLE_RELEASE_NS } {
            if let Some(_turn) = self.try_turn() {
                if arbiter.is_holder() {
                    self.hand_over(arbiter, drain_by);
                }
            }
        } else if others && now >= arbiter.lease_end_ns() {
            self.end_of_lease(arbiter, drain_by);
        }
        true
    }

    /// A context was destroyed: its events went with it.
    fn forget_context(&self, context: usize) {
        let mut marks = lock(&self.marks);
        marks.outstanding.retain(|m| m.context != context);
        marks.spare.retain(|m| m.context != context);
    }
}

/// A context of this process was destroyed (or reset): forget its marks.
pub fn forget_context(context: usize) {
    for slot in &DEVICES {
        let device = slot.load(Ordering::Acquire);
        if !device.is_null() {
            // SAFETY: DEVICES only holds leaked boxes, never freed.
            unsafe { &*device }.forget_context(context);
        }
    }
}

/// The keeper: one thread per limited process, started by its first throttled launch. It gives
/// the card up for a holder whose threads are not launching (blocked in a synchronisation, busy
/// on the CPU) when another container waits.
fn ensure_keeper() {
    if KEEPER_STARTED.load(Ordering::Relaxed) || KEEPER_STARTED.swap(true, Ordering::AcqRel) {
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("gpupool-vgpu-keeper".into())
        .spawn(|| loop {
            if std::panic::catch_unwind(keep_all).is_err() {
                log_error!("the limiter's keeper failed; launches hand the card over themselves");
                std::thread::sleep(Duration::from_millis(100));
            }
        });
    if let Err(error) = spawned {
        log_error!(
            "cannot start the limiter's keeper thread ({error}): launches hand the card over themselves"
        );
    }
}

fn keep_all() {
    let Some(process) = process::get() else {
        std::thread::sleep(Duration::from_millis(100));
        return;
    };
    let mut holding: Option<&Arbiter> = None;
    for (index, slot) in DEVICES.iter().enumerate() {
        let device = slot.load(Ordering::Acquire);
        if device.is_null() {
            continue;
        }
        // SAFETY: DEVICES only holds leaked boxes, never freed.
        let device = unsafe { &*device };
        if let Some(arbiter) = process.arbiter(index) {
            if device.keep(arbiter) && arbiter.is_holder() {
                holding = Some(arbiter);
            }
        }
    }
    match holding {
        // Holding: woken when a process starts waiting, and every millisecond meanwhile (to see
        // the lease end, or the holder go idle, while someone waits).
        Some(arbiter) => {
            let seq = arbiter.waiting_seq().load(Ordering::Acquire);
            let wait = if arbiter.others_waiting() {
                Duration::from_millis(1)
            } else {
                Duration::from_millis(50)
            };
            futex_wait(arbiter.waiting_seq(), seq, wait);
        }
        None => std::thread::sleep(Duration::from_millis(5)),
    }
}

fn register_atfork() {
    if !ATFORK_REGISTERED.swap(true, Ordering::AcqRel) {
        // SAFETY: registers a handler that only does atomic stores.
        unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) };
    }
}

/// A forked child has no driver state and no keeper thread: it starts over on first use.
extern "C" fn after_fork_in_child() {
    for slot in &DEVICES {
        slot.store(std::ptr::null_mut(), Ordering::Release);
    }
    KEEPER_STARTED.store(false, Ordering::Release);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arbiter::{Member, LOCK_TIMEOUT};

    fn card(dir: &tempfile::TempDir, key: u64, weight: u32) -> Arbiter {
        let path = dir.path().join("card").to_str().unwrap().to_string();
        Arbiter::open(
            &path,
            Member {
                key,
                weight,
                force: false,
            },
        )
        .unwrap()
    }

    fn take(arbiter: &Arbiter) {
        arbiter.start_waiting(now_ns());
        assert!(matches!(
            arbiter.try_take(now_ns(), LOCK_TIMEOUT).unwrap(),
            Turn::Holding { .. }
        ));
    }

    /// A thread that finds the gate not yet decided while the process state already exists
    /// (another thread published the state and is about to open the gate) decides from the state:
    /// before, it asked the gate again, and again, recursing until the other thread caught up
    /// (or the stack ran out). Here the gate is held undecided on purpose.
    #[test]
    fn an_undecided_gate_is_decided_from_the_process_state_without_recursing() {
        let process = process::get().expect("the test's environment limits nothing");
        assert!(!process.config.throttles());
        let decided = GATE.swap(process::GATE_UNINIT, Ordering::AcqRel);
        let answer = before_launch(std::ptr::null_mut(), false);
        GATE.store(decided, Ordering::Release);
        assert!(matches!(answer, Ok(None)));
    }

    /// A panic under `turn` (caught at the entry point, as every panic of the library is)
    /// poisons it: the holder must still renew and hand over, not find it busy forever.
    #[test]
    fn a_panic_under_the_turn_leaves_the_holder_able_to_renew_and_hand_over() {
        let dir = tempfile::tempdir().unwrap();
        let arbiter = card(&dir, 1, 30);
        let device = DeviceLimiter::new(0);
        std::thread::scope(|s| {
            let poisoned = s.spawn(|| {
                let _turn = device.turn.lock().unwrap();
                panic!("injected under the turn");
            });
            assert!(poisoned.join().is_err());
        });
        assert!(device.turn.is_poisoned());
        take(&arbiter);
        // The lease ran out while nobody waited: renewed.
        std::thread::sleep(Duration::from_millis(45));
        let before = arbiter.lease_end_ns();
        assert!(device.end_of_lease(&arbiter, now_ns() + 100_000_000));
        assert!(arbiter.lease_end_ns() > before, "not renewed");
        // Someone else waits and the holder is idle: the keeper hands the card over.
        let other = card(&dir, 2, 70);
        other.start_waiting(now_ns());
        assert!(device.keep(&arbiter));
        assert!(!arbiter.is_holder() && other.is_holder());
    }

    /// The holder's own path is bounded too: with the decision lock held by a stopped process,
    /// the end of a lease gives up by the launch's deadline (the launch then goes ahead).
    #[test]
    fn the_end_of_a_lease_waits_no_longer_than_the_launch_may() {
        let dir = tempfile::tempdir().unwrap();
        let arbiter = card(&dir, 1, 30);
        let device = DeviceLimiter::new(0);
        take(&arbiter);
        std::thread::sleep(Duration::from_millis(45));
        let _stopped = crate::arbiter::hold_decision_lock(arbiter.path()).unwrap();
        let started = std::time::Instant::now();
        assert!(!device.end_of_lease(&arbiter, now_ns() + 20_000_000));
        assert!(
            started.elapsed() < Duration::from_millis(200),
            "{:?}",
            started.elapsed()
        );
    }

    #[test]
    fn a_null_stream_is_named_for_what_it_means() {
        let s = 0x1234 as CUstream;
        assert_eq!(explicit(s, true), s);
        assert_eq!(
            explicit(std::ptr::null_mut(), false) as usize,
            CU_STREAM_LEGACY
        );
        assert_eq!(
            explicit(std::ptr::null_mut(), true) as usize,
            CU_STREAM_PER_THREAD
        );
    }
}

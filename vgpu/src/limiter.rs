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

use crate::arbiter::{Arbiter, Turn};
use crate::cuda::*;
use crate::driver;
use crate::env::MAX_DEVICES;
use crate::process::{self, Process, GATE, GATE_PASS, GATE_REFUSED, GATE_THROTTLE};
use crate::sys::{futex_wait, now_ns};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

/// How much work (estimated) the holder may have queued on the card. Its lease's end is late by
/// at most about this (and one launch), which is charged to it.
pub const AHEAD_NS: u64 = 4_000_000;
/// A holder that launched nothing for this long and has nothing queued gives the card up to a
/// waiting container before its lease ends (a share nobody uses goes to whoever wants it).
pub const IDLE_NS: u64 = 1_000_000;
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
        _ => match process::get() {
            Some(_) => before_launch(stream, per_thread),
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
                device.last_launch_ns.store(now_ns(), Ordering::Relaxed);
                device.launched_in_lease.fetch_add(1, Ordering::Relaxed);
                return Some(Ticket { device, stream });
            }
            device.in_gate.fetch_sub(1, Ordering::SeqCst);
            continue; // the lease ended while the queue drained
        }
        device.in_gate.fetch_sub(1, Ordering::SeqCst);
        if arbiter.is_holder() {
            device.end_of_lease(arbiter);
            continue;
        }
        if !device.wait_turn(arbiter, deadline) {
            arbiter.count_unarbitrated();
            log_debug!(
                "a launch on device {index} waited its bound ({} ms) for the card and went ahead",
                (now_ns() - start) / 1_000_000
            );
            device.in_gate.fetch_add(1, Ordering::SeqCst);
            device.last_launch_ns.store(now_ns(), Ordering::Relaxed);
            return Some(Ticket { device, stream });
        }
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
    let created = Box::into_raw(Box::new(DeviceLimiter {
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
    }));
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
    /// The holder may launch when its queue has room; waits (polling its marks) while it has
    /// about [`AHEAD_NS`] of work queued. False: the lease ended meanwhile.
    fn room_to_queue(&self, arbiter: &Arbiter, deadline: u64) -> bool {
        let budget = (AHEAD_NS / self.launch_ns.load(Ordering::Relaxed).max(1))
            .clamp(2, MAX_OUTSTANDING as u64) as usize;
        loop {
            if self.outstanding() < budget {
                return true;
            }
            self.poll_marks();
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

    /// Takes the completed marks off the queue.
    fn poll_marks(&self) {
        let mut marks = lock(&self.marks);
        if marks.outstanding.is_empty() {
            return;
        }
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
    fn end_of_lease(&self, arbiter: &Arbiter) {
        let Ok(_turn) = self.turn.try_lock() else {
            std::thread::sleep(POLL);
            return;
        };
        if !arbiter.is_holder() {
            return;
        }
        let now = now_ns();
        if now < arbiter.lease_end_ns() && !self.would_outlast_lease(arbiter, now) {
            return; // renewed by another thread meanwhile
        }
        match arbiter.renew(now) {
            Ok(Some(_)) => {
                self.learn_launch_cost(now);
                self.launched_in_lease.store(0, Ordering::Relaxed);
                return;
            }
            Ok(None) => {}
            Err(error) => log_error!("{error}; the card is given up"),
        }
        self.hand_over(arbiter);
    }

    /// Stops launching, waits for the queued work (bounded), gives the card up.
    fn hand_over(&self, arbiter: &Arbiter) {
        self.closing.store(true, Ordering::SeqCst);
        let deadline = now_ns().saturating_add(DRAIN_MAX_NS);
        loop {
            self.poll_marks();
            if self.outstanding() == 0 && self.in_gate.load(Ordering::SeqCst) == 0 {
                break;
            }
            if now_ns() >= deadline {
                log_warn!(
                    "device {}: queued work did not finish within {} ms; the card is given up anyway",
                    self.index,
                    DRAIN_MAX_NS / 1_000_000
                );
                break;
            }
            std::thread::sleep(DRAIN_POLL);
        }
        let now = now_ns();
        self.learn_launch_cost(now);
        if let Err(error) = arbiter.release(now) {
            log_error!("{error}");
        }
        self.closing.store(false, Ordering::SeqCst);
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
            arbiter.start_waiting(now);
            let seq = arbiter.grant_seq().load(Ordering::Acquire);
            let until = match arbiter.try_take(now) {
                Ok(Turn::Holding { .. }) => break true,
                Ok(Turn::Wait { until_ns }) => until_ns,
                Err(error) => {
                    log_error!("{error}");
                    break false;
                }
            };
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

    /// The keeper's look at this device: a holder that another container waits for gives the
    /// card up at its lease's end, or earlier when it is idle.
    fn keep(&self, arbiter: &Arbiter) -> bool {
        if !arbiter.is_holder() {
            return false;
        }
        self.poll_marks();
        if arbiter.others_waiting() {
            let now = now_ns();
            let idle = self.outstanding() == 0
                && self.in_gate.load(Ordering::SeqCst) == 0
                && now.saturating_sub(self.last_launch_ns.load(Ordering::Relaxed)) >= IDLE_NS;
            if idle {
                if let Ok(_turn) = self.turn.try_lock() {
                    if arbiter.is_holder() {
                        self.hand_over(arbiter);
                    }
                }
            } else if now >= arbiter.lease_end_ns() {
                self.end_of_lease(arbiter);
            }
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

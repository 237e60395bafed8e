//! Execution: streams (each with a worker thread running its queue in order), events, modules and
//! functions, kernel launches (plain, `Ex`, cooperative), stream capture and graphs.
//!
//! A kernel's work is the duration, in nanoseconds, of its first parameter (a `.u64`): the worker
//! runs it for that long on the card's time-sliced engine (one kernel at a time across all
//! processes, in turns; see the device crate), which records the time for NVML. Modules are PTX text: the stand-in reads the
//! `.entry` names and their parameter counts, so the same PTX (a kernel that spins on `%globaltimer`
//! for its first parameter) runs on a real GPU.
#![allow(non_snake_case, clippy::missing_safety_doc, clippy::too_many_arguments)]

use crate::capture;
use crate::context::{current, Ctx};
use crate::driver::{driver, entry, Driver};
use crate::ffi::*;
use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::ffi::{c_char, c_void, CStr};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::ThreadId;
use std::time::Duration;

/// Launches a stream queues before `cuLaunchKernel` blocks (real drivers block when their pushbuffer
/// is full, at about this depth), so that a launch loop is paced by the card.
pub const QUEUE_DEPTH: usize = 1024;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One kernel as launched or captured.
#[derive(Clone)]
pub struct KernelSpec {
    pub func: Arc<Function>,
    pub duration_ns: u64,
    pub cooperative: bool,
}

enum Work {
    Kernel { duration_ns: u64 },
    Event { event: Arc<Event>, generation: u64 },
}

struct Queue {
    items: VecDeque<Work>,
    submitted: u64,
    completed: u64,
    worker: bool,
    closed: bool,
}

struct Capture {
    nodes: Vec<KernelSpec>,
    mode: i32,
    thread: ThreadId,
    invalidated: bool,
}

/// `CUstreamCaptureStatus` of a stream.
fn status_of(capture: &Option<Capture>) -> i32 {
    match capture {
        None => CU_STREAM_CAPTURE_STATUS_NONE,
        Some(c) if c.invalidated => CU_STREAM_CAPTURE_STATUS_INVALIDATED,
        Some(_) => CU_STREAM_CAPTURE_STATUS_ACTIVE,
    }
}

pub struct Stream {
    pub handle: usize,
    pub ctx: Arc<Ctx>,
    /// The legacy NULL stream cannot be captured.
    legacy: bool,
    queue: Mutex<Queue>,
    changed: Condvar,
    capture: Mutex<Option<Capture>>,
}

impl Stream {
    fn new(handle: usize, ctx: Arc<Ctx>, legacy: bool) -> Arc<Stream> {
        let s = Arc::new(Stream {
            handle,
            ctx: ctx.clone(),
            legacy,
            queue: Mutex::new(Queue {
                items: VecDeque::new(),
                submitted: 0,
                completed: 0,
                worker: false,
                closed: false,
            }),
            changed: Condvar::new(),
            capture: Mutex::new(None),
        });
        lock(&ctx.streams).push(Arc::downgrade(&s));
        s
    }

    fn enqueue(self: &Arc<Self>, work: Work) {
        let mut q = lock(&self.queue);
        while q.items.len() >= QUEUE_DEPTH {
            q = self.changed.wait(q).unwrap_or_else(|e| e.into_inner());
        }
        if matches!(work, Work::Kernel { .. }) {
            // The process has work on the card from now until the kernel completes.
            driver()
                .expect("a stream exists only after cuInit")
                .sim
                .kernel_queued(self.ctx.physical);
        }
        q.items.push_back(work);
        q.submitted += 1;
        if !q.worker {
            q.worker = true;
            let me = self.clone();
            std::thread::Builder::new()
                .name("standin-stream".into())
                .spawn(move || me.work())
                .expect("stand-in stream worker");
        }
        self.changed.notify_all();
    }

    fn work(self: Arc<Self>) {
        let d = driver().expect("a stream exists only after cuInit");
        loop {
            let job = {
                let mut q = lock(&self.queue);
                loop {
                    match q.items.front() {
                        Some(Work::Kernel { duration_ns }) => break Some(*duration_ns),
                        Some(Work::Event { event, generation }) => {
                            event.complete(*generation);
                            q.items.pop_front();
                            q.completed += 1;
                            self.changed.notify_all();
                        }
                        None if q.closed => {
                            q.worker = false;
                            break None;
                        }
                        None => q = self.changed.wait(q).unwrap_or_else(|e| e.into_inner()),
                    }
                }
            };
            let Some(ns) = job else { return };
            d.sim
                .run_kernel(self.ctx.physical, Duration::from_nanos(ns));
            let mut q = lock(&self.queue);
            q.items.pop_front();
            q.completed += 1;
            self.changed.notify_all();
        }
    }

    pub fn synchronize(&self) {
        let mut q = lock(&self.queue);
        while q.completed < q.submitted {
            q = self.changed.wait(q).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn idle(&self) -> bool {
        let q = lock(&self.queue);
        q.completed == q.submitted
    }

    fn close(&self) {
        lock(&self.queue).closed = true;
        self.changed.notify_all();
    }

    fn capturing(&self) -> bool {
        lock(&self.capture).is_some()
    }

    /// Operations that conflict with a capture of this stream (querying or synchronising it,
    /// memory operations the stand-in cannot record into a graph) are refused while it captures,
    /// and invalidate the capture, as an invalid operation during capture does on a real driver.
    pub fn refuse_while_capturing(&self) -> Result<(), CUresult> {
        if self.invalidate_capture_if(|_, _| true) {
            Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
        } else {
            Ok(())
        }
    }

    /// Invalidates this stream's capture, if it has one for which `prohibits(mode, thread)` holds;
    /// whether it did.
    pub fn invalidate_capture_if(&self, prohibits: impl FnOnce(i32, ThreadId) -> bool) -> bool {
        match lock(&self.capture).as_mut() {
            Some(c) if prohibits(c.mode, c.thread) => {
                c.invalidated = true;
                true
            }
            _ => false,
        }
    }

    /// Runs kernels, or records them when the stream is capturing.
    fn submit(self: &Arc<Self>, kernels: &[KernelSpec]) -> Result<(), CUresult> {
        {
            let mut cap = lock(&self.capture);
            if let Some(c) = cap.as_mut() {
                if c.invalidated {
                    return Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
                }
                c.nodes.extend(kernels.iter().cloned());
                return Ok(());
            }
        }
        for k in kernels {
            self.enqueue(Work::Kernel {
                duration_ns: k.duration_ns,
            });
        }
        Ok(())
    }
}

pub struct Event {
    pub handle: usize,
    /// The context it was created in: destroying that context frees it.
    pub context: usize,
    /// Its context was destroyed. A real driver has freed the event then, and a call with its
    /// handle reads freed memory (or another object that took its place): the stand-in ends the
    /// process, so that a library that queries such an event is seen, not forgiven.
    pub freed: std::sync::atomic::AtomicBool,
    flags: u32,
    state: Mutex<EventState>,
    done: Condvar,
}

#[derive(Default)]
struct EventState {
    generation: u64,
    completed: u64,
    time_ns: u64,
    recorded: bool,
    /// The stream whose capture the event was last recorded into (None: recorded outside).
    captured_in: Option<std::sync::Weak<Stream>>,
}

impl Event {
    /// An event last recorded into a capture still in progress cannot be queried or waited for
    /// (`CUDA_ERROR_CAPTURED_EVENT`, in every mode); trying invalidates that capture.
    fn refuse_if_captured(&self) -> Result<(), CUresult> {
        let capturing = lock(&self.state)
            .captured_in
            .as_ref()
            .and_then(std::sync::Weak::upgrade);
        match capturing {
            Some(s) if s.invalidate_capture_if(|_, _| true) => Err(CUDA_ERROR_CAPTURED_EVENT),
            _ => Ok(()),
        }
    }
}

impl Event {
    fn complete(&self, generation: u64) {
        let mut s = lock(&self.state);
        if generation > s.completed {
            s.completed = generation;
            s.time_ns = gpupool_standin_device::sys::now_ns();
        }
        self.done.notify_all();
    }
}

pub struct Module {
    functions: Vec<usize>,
}

pub struct Function {
    pub handle: usize,
    pub ctx: usize,
    pub name: String,
    pub params: usize,
}

pub struct Graph {
    nodes: Vec<(usize, KernelSpec)>,
}

pub struct GraphExec {
    nodes: Vec<KernelSpec>,
}

#[derive(Default)]
pub struct Exec {
    pub streams: crate::driver::Registry<Arc<Stream>>,
    pub events: crate::driver::Registry<Arc<Event>>,
    pub modules: crate::driver::Registry<Module>,
    pub functions: crate::driver::Registry<Arc<Function>>,
    pub graphs: crate::driver::Registry<Graph>,
    pub execs: crate::driver::Registry<Arc<GraphExec>>,
}

thread_local! {
    /// This thread's per-thread default stream, per context.
    static PER_THREAD: RefCell<HashMap<usize, Arc<Stream>>> = RefCell::new(HashMap::new());
}

fn null_stream(ctx: &Arc<Ctx>) -> Arc<Stream> {
    ctx.null_stream
        .get_or_init(|| Stream::new(0, ctx.clone(), true))
        .clone()
}

fn per_thread_stream(ctx: &Arc<Ctx>) -> Arc<Stream> {
    PER_THREAD.with(|m| {
        m.borrow_mut()
            .entry(ctx.handle)
            .or_insert_with(|| Stream::new(0, ctx.clone(), false))
            .clone()
    })
}

/// The stream a handle names: NULL is the legacy default stream in the legacy entry points and this
/// thread's default stream in the `_ptsz` ones; `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD` name
/// those two anywhere. The special handles need a current context.
pub fn resolve_stream(d: &Driver, handle: CUstream, ptsz: bool) -> Result<Arc<Stream>, CUresult> {
    match handle as usize {
        0 if ptsz => Ok(per_thread_stream(&current()?)),
        0 | CU_STREAM_LEGACY => Ok(null_stream(&current()?)),
        CU_STREAM_PER_THREAD => Ok(per_thread_stream(&current()?)),
        h => {
            let s = d
                .state()
                .exec
                .streams
                .get(h)
                .cloned()
                .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
            if !s.ctx.is_live() {
                return Err(CUDA_ERROR_CONTEXT_IS_DESTROYED);
            }
            Ok(s)
        }
    }
}

// ---- Streams ----

unsafe fn stream_create(out: *mut CUstream, flags: u32) -> Result<(), CUresult> {
    let d = driver()?;
    if out.is_null() || flags & !CU_STREAM_NON_BLOCKING != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let ctx = current()?;
    let mut st = d.state();
    let h = st.handles.allocate();
    st.exec.streams.insert(h, Stream::new(h, ctx, false));
    *out = h as CUstream;
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(out: *mut CUstream, flags: u32) -> CUresult {
    entry(|| stream_create(out, flags))
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreateWithPriority(
    out: *mut CUstream,
    flags: u32,
    _priority: i32,
) -> CUresult {
    entry(|| stream_create(out, flags))
}

/// Returns at once; queued work still runs (as cuda.h describes).
fn stream_destroy(handle: CUstream) -> Result<(), CUresult> {
    let d = driver()?;
    let s = d
        .state()
        .exec
        .streams
        .remove(handle as usize)
        .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    s.close();
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamDestroy(stream: CUstream) -> CUresult {
    entry(|| stream_destroy(stream))
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamDestroy_v2(stream: CUstream) -> CUresult {
    entry(|| stream_destroy(stream))
}

fn stream_sync(handle: CUstream, ptsz: bool) -> Result<(), CUresult> {
    let d = driver()?;
    let s = resolve_stream(d, handle, ptsz)?;
    s.refuse_while_capturing()?;
    capture::unsafe_call()?;
    s.synchronize();
    d.state().mem.trim_pools_at_sync(&d.sim);
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamSynchronize(stream: CUstream) -> CUresult {
    entry(|| stream_sync(stream, false))
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamSynchronize_ptsz(stream: CUstream) -> CUresult {
    entry(|| stream_sync(stream, true))
}

fn stream_query(handle: CUstream, ptsz: bool) -> Result<(), CUresult> {
    let d = driver()?;
    let s = resolve_stream(d, handle, ptsz)?;
    s.refuse_while_capturing()?;
    capture::unsafe_call()?;
    if s.idle() {
        Ok(())
    } else {
        Err(CUDA_ERROR_NOT_READY)
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamQuery(stream: CUstream) -> CUresult {
    entry(|| stream_query(stream, false))
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamQuery_ptsz(stream: CUstream) -> CUresult {
    entry(|| stream_query(stream, true))
}

fn begin_capture(handle: CUstream, mode: i32, ptsz: bool) -> Result<(), CUresult> {
    let d = driver()?;
    if !capture::valid_mode(mode) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let s = resolve_stream(d, handle, ptsz)?;
    if s.legacy {
        return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    }
    let mut cap = lock(&s.capture);
    if cap.is_some() {
        return Err(CUDA_ERROR_ILLEGAL_STATE);
    }
    *cap = Some(Capture {
        nodes: Vec::new(),
        mode,
        thread: std::thread::current().id(),
        invalidated: false,
    });
    drop(cap);
    capture::began(&s);
    Ok(())
}

/// The CUDA 10.0 form has no mode: global capture.
#[no_mangle]
pub unsafe extern "C" fn cuStreamBeginCapture(stream: CUstream) -> CUresult {
    entry(|| begin_capture(stream, CU_STREAM_CAPTURE_MODE_GLOBAL, false))
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamBeginCapture_ptsz(stream: CUstream) -> CUresult {
    entry(|| begin_capture(stream, CU_STREAM_CAPTURE_MODE_GLOBAL, true))
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamBeginCapture_v2(stream: CUstream, mode: i32) -> CUresult {
    entry(|| begin_capture(stream, mode, false))
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamBeginCapture_v2_ptsz(stream: CUstream, mode: i32) -> CUresult {
    entry(|| begin_capture(stream, mode, true))
}

unsafe fn end_capture(handle: CUstream, graph: *mut CUgraph, ptsz: bool) -> Result<(), CUresult> {
    let d = driver()?;
    if graph.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let s = resolve_stream(d, handle, ptsz)?;
    let c = {
        let mut cap = lock(&s.capture);
        match cap.as_ref() {
            None => return Err(CUDA_ERROR_ILLEGAL_STATE),
            Some(c)
                if c.mode == CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
                    && c.thread != std::thread::current().id() =>
            {
                return Err(CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD)
            }
            Some(_) => cap.take().expect("checked"),
        }
    };
    capture::ended(&s);
    if c.invalidated {
        *graph = std::ptr::null_mut();
        return Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    }
    let mut st = d.state();
    let mut nodes = Vec::new();
    for k in c.nodes {
        nodes.push((st.handles.allocate(), k));
    }
    let h = st.handles.allocate();
    st.exec.graphs.insert(h, Graph { nodes });
    *graph = h as CUgraph;
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamEndCapture(stream: CUstream, graph: *mut CUgraph) -> CUresult {
    entry(|| end_capture(stream, graph, false))
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamEndCapture_ptsz(
    stream: CUstream,
    graph: *mut CUgraph,
) -> CUresult {
    entry(|| end_capture(stream, graph, true))
}

unsafe fn is_capturing(handle: CUstream, status: *mut i32, ptsz: bool) -> Result<(), CUresult> {
    let d = driver()?;
    if status.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let s = resolve_stream(d, handle, ptsz)?;
    *status = status_of(&lock(&s.capture));
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamIsCapturing(stream: CUstream, status: *mut i32) -> CUresult {
    entry(|| is_capturing(stream, status, false))
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamIsCapturing_ptsz(stream: CUstream, status: *mut i32) -> CUresult {
    entry(|| is_capturing(stream, status, true))
}

unsafe fn stream_get_device(
    handle: CUstream,
    device: *mut CUdevice,
    ptsz: bool,
) -> Result<(), CUresult> {
    let d = driver()?;
    if device.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let s = resolve_stream(d, handle, ptsz)?;
    capture::unsafe_call()?;
    *device = s.ctx.ordinal as CUdevice;
    Ok(())
}

/// CUDA 12.8. Potentially unsafe during capture (see `capture.rs`).
#[no_mangle]
pub unsafe extern "C" fn cuStreamGetDevice(stream: CUstream, device: *mut CUdevice) -> CUresult {
    entry(|| stream_get_device(stream, device, false))
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamGetDevice_ptsz(
    stream: CUstream,
    device: *mut CUdevice,
) -> CUresult {
    entry(|| stream_get_device(stream, device, true))
}

// ---- Events ----

#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(out: *mut CUevent, flags: u32) -> CUresult {
    entry(|| {
        let d = driver()?;
        if out.is_null() || flags & !CU_EVENT_FLAGS_MASK != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let context = current()?.handle;
        let mut st = d.state();
        let h = st.handles.allocate();
        st.exec.events.insert(
            h,
            Arc::new(Event {
                handle: h,
                context,
                freed: std::sync::atomic::AtomicBool::new(false),
                flags,
                state: Mutex::default(),
                done: Condvar::new(),
            }),
        );
        *out = h as CUevent;
        Ok(())
    })
}

fn event(d: &Driver, handle: CUevent) -> Result<Arc<Event>, CUresult> {
    let event = d
        .state()
        .exec
        .events
        .get(handle as usize)
        .cloned()
        .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    if event.freed.load(std::sync::atomic::Ordering::Acquire) {
        eprintln!(
            "gpupool-standin-cuda: event {:#x} used after its context was destroyed (a use after free on a real driver)",
            handle as usize
        );
        std::process::abort();
    }
    Ok(event)
}

fn event_record(ev: CUevent, stream: CUstream, ptsz: bool) -> Result<(), CUresult> {
    let d = driver()?;
    let e = event(d, ev)?;
    let s = resolve_stream(d, stream, ptsz)?;
    if s.capturing() {
        // Recorded into the capture as an ordering point; kernels are captured in order anyway.
        lock(&e.state).captured_in = Some(Arc::downgrade(&s));
        return Ok(());
    }
    let generation = {
        let mut es = lock(&e.state);
        es.generation += 1;
        es.recorded = true;
        es.captured_in = None;
        es.generation
    };
    s.enqueue(Work::Event {
        event: e,
        generation,
    });
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn cuEventRecord(ev: CUevent, stream: CUstream) -> CUresult {
    entry(|| event_record(ev, stream, false))
}

#[no_mangle]
pub unsafe extern "C" fn cuEventRecord_ptsz(ev: CUevent, stream: CUstream) -> CUresult {
    entry(|| event_record(ev, stream, true))
}

#[no_mangle]
pub unsafe extern "C" fn cuEventQuery(ev: CUevent) -> CUresult {
    entry(|| {
        let d = driver()?;
        let e = event(d, ev)?;
        e.refuse_if_captured()?;
        capture::unsafe_call()?;
        let s = lock(&e.state);
        if s.completed >= s.generation {
            Ok(())
        } else {
            Err(CUDA_ERROR_NOT_READY)
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventSynchronize(ev: CUevent) -> CUresult {
    entry(|| {
        let d = driver()?;
        let e = event(d, ev)?;
        e.refuse_if_captured()?;
        capture::unsafe_call()?;
        {
            let mut s = lock(&e.state);
            while s.completed < s.generation {
                s = e.done.wait(s).unwrap_or_else(|x| x.into_inner());
            }
        }
        d.state().mem.trim_pools_at_sync(&d.sim);
        Ok(())
    })
}

unsafe fn elapsed(ms: *mut f32, start: CUevent, end: CUevent) -> Result<(), CUresult> {
    let d = driver()?;
    if ms.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let (a, b) = (event(d, start)?, event(d, end)?);
    a.refuse_if_captured()?;
    b.refuse_if_captured()?;
    if (a.flags | b.flags) & CU_EVENT_DISABLE_TIMING != 0 {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    let (sa, sb) = (lock(&a.state).clone_times(), lock(&b.state).clone_times());
    if !sa.0 || !sb.0 {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    if !sa.1 || !sb.1 {
        return Err(CUDA_ERROR_NOT_READY);
    }
    *ms = (sb.2 as f64 - sa.2 as f64) as f32 / 1e6;
    Ok(())
}

impl EventState {
    /// (recorded, completed, time)
    fn clone_times(&self) -> (bool, bool, u64) {
        (
            self.recorded,
            self.completed >= self.generation,
            self.time_ns,
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuEventElapsedTime(
    ms: *mut f32,
    start: CUevent,
    end: CUevent,
) -> CUresult {
    entry(|| elapsed(ms, start, end))
}

#[no_mangle]
pub unsafe extern "C" fn cuEventElapsedTime_v2(
    ms: *mut f32,
    start: CUevent,
    end: CUevent,
) -> CUresult {
    entry(|| elapsed(ms, start, end))
}

fn event_destroy(ev: CUevent) -> Result<(), CUresult> {
    let d = driver()?;
    d.state()
        .exec
        .events
        .remove(ev as usize)
        .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn cuEventDestroy(ev: CUevent) -> CUresult {
    entry(|| event_destroy(ev))
}

#[no_mangle]
pub unsafe extern "C" fn cuEventDestroy_v2(ev: CUevent) -> CUresult {
    entry(|| event_destroy(ev))
}

// ---- Modules and functions ----

/// The `.entry` kernels of a PTX text and how many parameters each declares. A text without a
/// `.version` directive is not PTX.
pub fn ptx_entries(text: &str) -> Option<Vec<(String, usize)>> {
    if !text.contains(".version") {
        return None;
    }
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find(".entry") {
        rest = &rest[at + ".entry".len()..];
        let name: String = rest
            .trim_start()
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == '$')
            .collect();
        if name.is_empty() {
            return None;
        }
        let after = rest.trim_start()[name.len()..].trim_start();
        let params = match after.strip_prefix('(') {
            Some(list) => list[..list.find(')')?].matches(".param").count(),
            None => 0,
        };
        out.push((name, params));
    }
    Some(out)
}

unsafe fn load(module: *mut CUmodule, image: *const c_void) -> Result<(), CUresult> {
    let d = driver()?;
    if module.is_null() || image.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let ctx = current()?;
    let text = CStr::from_ptr(image as *const c_char)
        .to_str()
        .map_err(|_| CUDA_ERROR_INVALID_IMAGE)?;
    let entries = ptx_entries(text).ok_or(CUDA_ERROR_INVALID_IMAGE)?;
    let mut st = d.state();
    let mh = st.handles.allocate();
    let mut functions = Vec::new();
    for (name, params) in entries {
        let fh = st.handles.allocate();
        st.exec.functions.insert(
            fh,
            Arc::new(Function {
                handle: fh,
                ctx: ctx.handle,
                name,
                params,
            }),
        );
        functions.push(fh);
    }
    st.exec.modules.insert(mh, Module { functions });
    *module = mh as CUmodule;
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadData(module: *mut CUmodule, image: *const c_void) -> CUresult {
    entry(|| load(module, image))
}

/// JIT options are accepted and ignored (there is nothing to compile).
#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadDataEx(
    module: *mut CUmodule,
    image: *const c_void,
    num_options: u32,
    options: *mut i32,
    values: *mut *mut c_void,
) -> CUresult {
    entry(|| {
        if num_options > 0 && (options.is_null() || values.is_null()) {
            driver()?;
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        load(module, image)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleUnload(module: CUmodule) -> CUresult {
    entry(|| {
        let d = driver()?;
        let mut st = d.state();
        let m = st
            .exec
            .modules
            .remove(module as usize)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        for f in m.functions {
            st.exec.functions.remove(f);
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleGetFunction(
    func: *mut CUfunction,
    module: CUmodule,
    name: *const c_char,
) -> CUresult {
    entry(|| {
        let d = driver()?;
        if func.is_null() || name.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let name = CStr::from_ptr(name).to_string_lossy();
        let st = d.state();
        let m = st
            .exec
            .modules
            .get(module as usize)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let f = m
            .functions
            .iter()
            .filter_map(|&h| st.exec.functions.get(h))
            .find(|f| f.name == name)
            .ok_or(CUDA_ERROR_NOT_FOUND)?;
        *func = f.handle as CUfunction;
        Ok(())
    })
}

fn function(d: &Driver, f: CUfunction) -> Result<Arc<Function>, CUresult> {
    d.state()
        .exec
        .functions
        .get(f as usize)
        .cloned()
        .ok_or(CUDA_ERROR_INVALID_HANDLE)
}

#[no_mangle]
pub unsafe extern "C" fn cuFuncGetAttribute(
    value: *mut i32,
    attrib: i32,
    f: CUfunction,
) -> CUresult {
    entry(|| {
        let d = driver()?;
        if value.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        function(d, f)?;
        *value = match attrib {
            CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK => 1024,
            CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES => 0,
            CU_FUNC_ATTRIBUTE_NUM_REGS => 16,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        };
        Ok(())
    })
}

/// Resident blocks per multiprocessor of the stand-in's kernels: limited by the 2048 threads and 32
/// blocks a multiprocessor holds (H100's limits).
pub fn blocks_per_sm(threads_per_block: u32) -> u32 {
    if threads_per_block == 0 || threads_per_block > 1024 {
        return 0;
    }
    let warps = threads_per_block.div_ceil(32);
    (64 / warps).min(32)
}

#[no_mangle]
pub unsafe extern "C" fn cuOccupancyMaxActiveBlocksPerMultiprocessor(
    num_blocks: *mut i32,
    f: CUfunction,
    block_size: i32,
    _dynamic_smem: usize,
) -> CUresult {
    entry(|| {
        let d = driver()?;
        if num_blocks.is_null() || block_size <= 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        function(d, f)?;
        *num_blocks = blocks_per_sm(block_size as u32) as i32;
        Ok(())
    })
}

// ---- Launches ----

#[derive(Clone, Copy)]
struct Dims {
    grid: [u32; 3],
    block: [u32; 3],
    shared: u32,
}

/// The launch configuration rules of an H100-like device.
fn check_dims(dims: &Dims) -> Result<(), CUresult> {
    let [gx, gy, gz] = dims.grid;
    let [bx, by, bz] = dims.block;
    if [gx, gy, gz, bx, by, bz].contains(&0) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if gx > i32::MAX as u32 || gy > 65535 || gz > 65535 || bx > 1024 || by > 1024 || bz > 64 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if (bx as u64) * (by as u64) * (bz as u64) > 1024 || dims.shared > 48 << 10 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok(())
}

/// The kernel's duration: its first parameter, read from `kernelParams` or the `extra` buffer.
unsafe fn duration(
    f: &Function,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> Result<u64, CUresult> {
    if !params.is_null() && !extra.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if f.params == 0 {
        return Ok(0);
    }
    if !params.is_null() {
        let first = *params;
        if first.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        return Ok(std::ptr::read_unaligned(first as *const u64));
    }
    if extra.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let (mut buffer, mut size) = (std::ptr::null::<u8>(), 0usize);
    let mut i = 0;
    loop {
        match *extra.add(i) as usize {
            CU_LAUNCH_PARAM_END => break,
            CU_LAUNCH_PARAM_BUFFER_POINTER => buffer = *extra.add(i + 1) as *const u8,
            CU_LAUNCH_PARAM_BUFFER_SIZE => size = *(*extra.add(i + 1) as *const usize),
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
        i += 2;
    }
    if buffer.is_null() || size < 8 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok(std::ptr::read_unaligned(buffer as *const u64))
}

/// Everything a launch checks; returns the kernel and the stream it goes to.
unsafe fn prepare(
    f: CUfunction,
    dims: Dims,
    stream: CUstream,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
    cooperative: bool,
    ptsz: bool,
) -> Result<(KernelSpec, Arc<Stream>), CUresult> {
    let d = driver()?;
    let ctx = current()?;
    let func = function(d, f)?;
    if func.ctx != ctx.handle {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    check_dims(&dims)?;
    let s = resolve_stream(d, stream, ptsz)?;
    if s.ctx.handle != ctx.handle {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    if cooperative {
        let threads = dims.block.iter().product::<u32>();
        let blocks = dims.grid.iter().map(|&g| g as u64).product::<u64>();
        let max = blocks_per_sm(threads) as u64 * d.sim.device(ctx.physical).sms as u64;
        if blocks > max {
            return Err(CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE);
        }
    }
    let duration_ns = duration(&func, params, extra)?;
    Ok((
        KernelSpec {
            func,
            duration_ns,
            cooperative,
        },
        s,
    ))
}

unsafe fn launch(
    f: CUfunction,
    dims: Dims,
    stream: CUstream,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
    cooperative: bool,
    ptsz: bool,
) -> Result<(), CUresult> {
    let (k, s) = prepare(f, dims, stream, params, extra, cooperative, ptsz)?;
    s.submit(&[k])
}

#[no_mangle]
pub unsafe extern "C" fn cuLaunchKernel(
    f: CUfunction,
    gx: u32,
    gy: u32,
    gz: u32,
    bx: u32,
    by: u32,
    bz: u32,
    shared: u32,
    stream: CUstream,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    entry(|| {
        launch(
            f,
            Dims {
                grid: [gx, gy, gz],
                block: [bx, by, bz],
                shared,
            },
            stream,
            params,
            extra,
            false,
            false,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuLaunchKernel_ptsz(
    f: CUfunction,
    gx: u32,
    gy: u32,
    gz: u32,
    bx: u32,
    by: u32,
    bz: u32,
    shared: u32,
    stream: CUstream,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    entry(|| {
        launch(
            f,
            Dims {
                grid: [gx, gy, gz],
                block: [bx, by, bz],
                shared,
            },
            stream,
            params,
            extra,
            false,
            true,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuLaunchCooperativeKernel(
    f: CUfunction,
    gx: u32,
    gy: u32,
    gz: u32,
    bx: u32,
    by: u32,
    bz: u32,
    shared: u32,
    stream: CUstream,
    params: *mut *mut c_void,
) -> CUresult {
    entry(|| {
        if params.is_null() {
            driver()?;
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        launch(
            f,
            Dims {
                grid: [gx, gy, gz],
                block: [bx, by, bz],
                shared,
            },
            stream,
            params,
            std::ptr::null_mut(),
            true,
            false,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuLaunchCooperativeKernel_ptsz(
    f: CUfunction,
    gx: u32,
    gy: u32,
    gz: u32,
    bx: u32,
    by: u32,
    bz: u32,
    shared: u32,
    stream: CUstream,
    params: *mut *mut c_void,
) -> CUresult {
    entry(|| {
        if params.is_null() {
            driver()?;
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        launch(
            f,
            Dims {
                grid: [gx, gy, gz],
                block: [bx, by, bz],
                shared,
            },
            stream,
            params,
            std::ptr::null_mut(),
            true,
            true,
        )
    })
}

unsafe fn launch_ex(
    config: *const CUlaunchConfig,
    f: CUfunction,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
    ptsz: bool,
) -> Result<(), CUresult> {
    driver()?;
    let c = config.as_ref().ok_or(CUDA_ERROR_INVALID_VALUE)?;
    if c.num_attrs > 0 && c.attrs.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut cooperative = false;
    for i in 0..c.num_attrs as usize {
        let a = &*c.attrs.add(i);
        if a.id == CU_LAUNCH_ATTRIBUTE_COOPERATIVE {
            cooperative = (a.value[0] as u32) != 0;
        }
    }
    let dims = Dims {
        grid: [c.grid_dim_x, c.grid_dim_y, c.grid_dim_z],
        block: [c.block_dim_x, c.block_dim_y, c.block_dim_z],
        shared: c.shared_mem_bytes,
    };
    launch(f, dims, c.h_stream, params, extra, cooperative, ptsz)
}

#[no_mangle]
pub unsafe extern "C" fn cuLaunchKernelEx(
    config: *const CUlaunchConfig,
    f: CUfunction,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    entry(|| launch_ex(config, f, params, extra, false))
}

#[no_mangle]
pub unsafe extern "C" fn cuLaunchKernelEx_ptsz(
    config: *const CUlaunchConfig,
    f: CUfunction,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    entry(|| launch_ex(config, f, params, extra, true))
}

// ---- Graphs ----

#[no_mangle]
pub unsafe extern "C" fn cuGraphCreate(graph: *mut CUgraph, flags: u32) -> CUresult {
    entry(|| {
        let d = driver()?;
        if graph.is_null() || flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut st = d.state();
        let h = st.handles.allocate();
        st.exec.graphs.insert(h, Graph { nodes: Vec::new() });
        *graph = h as CUgraph;
        Ok(())
    })
}

unsafe fn add_kernel_node(
    node: *mut CUgraphNode,
    graph: CUgraph,
    deps: *const CUgraphNode,
    ndeps: usize,
    p: &CUDA_KERNEL_NODE_PARAMS_v1,
    ctx: CUcontext,
) -> Result<(), CUresult> {
    let d = driver()?;
    if node.is_null() || (ndeps > 0 && deps.is_null()) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let func = function(d, p.func)?;
    if !ctx.is_null() && ctx as usize != func.ctx {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let dims = Dims {
        grid: [p.grid_dim_x, p.grid_dim_y, p.grid_dim_z],
        block: [p.block_dim_x, p.block_dim_y, p.block_dim_z],
        shared: p.shared_mem_bytes,
    };
    check_dims(&dims)?;
    let duration_ns = duration(&func, p.kernel_params, p.extra)?;
    let mut st = d.state();
    let nh = st.handles.allocate();
    let g = st
        .exec
        .graphs
        .get_mut(graph as usize)
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    for i in 0..ndeps {
        let dep = *deps.add(i) as usize;
        if !g.nodes.iter().any(|(h, _)| *h == dep) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
    }
    g.nodes.push((
        nh,
        KernelSpec {
            func,
            duration_ns,
            cooperative: false,
        },
    ));
    *node = nh as CUgraphNode;
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphAddKernelNode(
    node: *mut CUgraphNode,
    graph: CUgraph,
    deps: *const CUgraphNode,
    ndeps: usize,
    params: *const CUDA_KERNEL_NODE_PARAMS_v1,
) -> CUresult {
    entry(|| {
        driver()?;
        let p = params.as_ref().ok_or(CUDA_ERROR_INVALID_VALUE)?;
        add_kernel_node(node, graph, deps, ndeps, p, std::ptr::null_mut())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphAddKernelNode_v2(
    node: *mut CUgraphNode,
    graph: CUgraph,
    deps: *const CUgraphNode,
    ndeps: usize,
    params: *const CUDA_KERNEL_NODE_PARAMS_v2,
) -> CUresult {
    entry(|| {
        driver()?;
        let p = params.as_ref().ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if !p.kern.is_null() && !p.v1.func.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        add_kernel_node(node, graph, deps, ndeps, &p.v1, p.ctx)
    })
}

unsafe fn instantiate(exec: *mut CUgraphExec, graph: CUgraph, flags: u64) -> Result<(), CUresult> {
    let d = driver()?;
    if exec.is_null() || flags & !0xF != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut st = d.state();
    let nodes = st
        .exec
        .graphs
        .get(graph as usize)
        .ok_or(CUDA_ERROR_INVALID_VALUE)?
        .nodes
        .iter()
        .map(|(_, k)| k.clone())
        .collect();
    let h = st.handles.allocate();
    st.exec.execs.insert(h, Arc::new(GraphExec { nodes }));
    *exec = h as CUgraphExec;
    Ok(())
}

/// The CUDA 10.0 and 11.0 forms (error node and log buffer, which stay untouched on success).
#[no_mangle]
pub unsafe extern "C" fn cuGraphInstantiate(
    exec: *mut CUgraphExec,
    graph: CUgraph,
    _error_node: *mut CUgraphNode,
    _log: *mut c_char,
    _log_size: usize,
) -> CUresult {
    entry(|| instantiate(exec, graph, 0))
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphInstantiate_v2(
    exec: *mut CUgraphExec,
    graph: CUgraph,
    _error_node: *mut CUgraphNode,
    _log: *mut c_char,
    _log_size: usize,
) -> CUresult {
    entry(|| instantiate(exec, graph, 0))
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphInstantiateWithFlags(
    exec: *mut CUgraphExec,
    graph: CUgraph,
    flags: u64,
) -> CUresult {
    entry(|| instantiate(exec, graph, flags))
}

fn graph_launch(exec: CUgraphExec, stream: CUstream, ptsz: bool) -> Result<(), CUresult> {
    let d = driver()?;
    let g = d
        .state()
        .exec
        .execs
        .get(exec as usize)
        .cloned()
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let s = resolve_stream(d, stream, ptsz)?;
    if g.nodes.iter().any(|k| k.func.ctx != s.ctx.handle) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    s.submit(&g.nodes)
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphLaunch(exec: CUgraphExec, stream: CUstream) -> CUresult {
    entry(|| graph_launch(exec, stream, false))
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphLaunch_ptsz(exec: CUgraphExec, stream: CUstream) -> CUresult {
    entry(|| graph_launch(exec, stream, true))
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphExecDestroy(exec: CUgraphExec) -> CUresult {
    entry(|| {
        let d = driver()?;
        d.state()
            .exec
            .execs
            .remove(exec as usize)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphDestroy(graph: CUgraph) -> CUresult {
    entry(|| {
        let d = driver()?;
        d.state()
            .exec
            .graphs
            .remove(graph as usize)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptx_entries_and_their_parameters() {
        let ptx = ".version 7.0\n.target sm_70\n.visible .entry busy(\n .param .u64 busy_param_0\n)\n{ ret; }\n\
                   .entry other( .param .u32 a, .param .u64 b ) { ret; }\n.entry bare\n{ ret; }";
        assert_eq!(
            ptx_entries(ptx).unwrap(),
            vec![
                ("busy".to_string(), 1),
                ("other".to_string(), 2),
                ("bare".to_string(), 0)
            ]
        );
        assert!(ptx_entries("not a module").is_none());
    }

    #[test]
    fn occupancy_and_launch_rules() {
        assert_eq!(blocks_per_sm(1024), 2);
        assert_eq!(blocks_per_sm(256), 8);
        assert_eq!(blocks_per_sm(32), 32);
        assert_eq!(blocks_per_sm(1), 32);
        let ok = Dims {
            grid: [1, 1, 1],
            block: [256, 1, 1],
            shared: 0,
        };
        assert!(check_dims(&ok).is_ok());
        assert!(check_dims(&Dims {
            grid: [0, 1, 1],
            ..ok
        })
        .is_err());
        assert!(check_dims(&Dims {
            block: [1024, 2, 1],
            ..ok
        })
        .is_err());
        assert!(check_dims(&Dims {
            block: [1, 1, 65],
            ..ok
        })
        .is_err());
        assert!(check_dims(&Dims {
            shared: 49153,
            ..ok
        })
        .is_err());
    }
}

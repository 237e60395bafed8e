//! `capture-rules`: one potentially unsafe (or conflicting) call made while a stream captures, from
//! the capturing thread or another one, in a chosen interaction mode, and what it did to the
//! capture. The rules are cuda.h's (`cuStreamBeginCapture_v2`, `cuThreadExchangeStreamCaptureMode`).

use super::{emit, with_result, Session};
use crate::cu::*;
use serde_json::json;
use std::ffi::c_void;

fn mode(name: &str) -> Result<i32, String> {
    match name {
        "global" => Ok(0),
        "thread-local" => Ok(1),
        "relaxed" => Ok(2),
        other => Err(format!(
            "unknown capture mode {other:?} (global, thread-local, relaxed)"
        )),
    }
}

pub const CALLS: &[&str] = &[
    "event-query",
    "event-sync",
    "stream-query",
    "stream-sync",
    "ctx-sync",
    "mem-alloc",
    "mem-alloc-async",
    "stream-get-device",
    "captured-event-query",
    "capturing-stream-query",
];

type Fn0 = unsafe extern "C" fn() -> CUresult;
type FnHandle = unsafe extern "C" fn(Handle) -> CUresult;
type FnModeSwap = unsafe extern "C" fn(*mut i32) -> CUresult;
type FnAlloc = unsafe extern "C" fn(*mut CUdeviceptr, usize) -> CUresult;
type FnFree = unsafe extern "C" fn(CUdeviceptr) -> CUresult;
type FnStreamDevice = unsafe extern "C" fn(Handle, *mut i32) -> CUresult;
type FnAllocAsync = unsafe extern "C" fn(*mut CUdeviceptr, usize, Handle) -> CUresult;
type FnFreeAsync = unsafe extern "C" fn(CUdeviceptr, Handle) -> CUresult;

/// Raw handles and entry points, moved to the calling thread (they are plain addresses).
#[derive(Clone, Copy)]
struct Call {
    what: &'static str,
    ctx: usize,
    capturing: usize,
    other: usize,
    outside_event: usize,
    captured_event: usize,
    set_current: FnHandle,
    exchange: Option<FnModeSwap>,
    event_query: FnHandle,
    event_sync: FnHandle,
    stream_query: FnHandle,
    stream_sync: FnHandle,
    ctx_sync: Fn0,
    mem_alloc: FnAlloc,
    mem_free: FnFree,
    mem_alloc_async: FnAllocAsync,
    mem_free_async: FnFreeAsync,
    stream_get_device: Option<FnStreamDevice>,
}

impl Call {
    /// Makes the call in this thread, after setting its interaction mode when asked; its result.
    unsafe fn make(self, caller_mode: Option<i32>, other_thread: bool) -> (CUresult, CUresult) {
        if other_thread {
            (self.set_current)(self.ctx as Handle);
        }
        let exchanged = match (caller_mode, self.exchange) {
            (Some(m), Some(f)) => {
                let mut m = m;
                f(&mut m)
            }
            (Some(_), None) => 500,
            (None, _) => 0,
        };
        let r = match self.what {
            "event-query" => (self.event_query)(self.outside_event as Handle),
            "event-sync" => (self.event_sync)(self.outside_event as Handle),
            "stream-query" => (self.stream_query)(self.other as Handle),
            "stream-sync" => (self.stream_sync)(self.other as Handle),
            "ctx-sync" => (self.ctx_sync)(),
            "mem-alloc" => {
                let mut p: CUdeviceptr = 0;
                let r = (self.mem_alloc)(&mut p, 1 << 20);
                if r == 0 {
                    (self.mem_free)(p);
                }
                r
            }
            "mem-alloc-async" => {
                let mut p: CUdeviceptr = 0;
                let r = (self.mem_alloc_async)(&mut p, 1 << 20, self.other as Handle);
                if r == 0 {
                    (self.mem_free_async)(p, self.other as Handle);
                }
                r
            }
            "stream-get-device" => {
                let mut dev = -1;
                match self.stream_get_device {
                    Some(f) => f(self.other as Handle, &mut dev),
                    None => 500,
                }
            }
            "captured-event-query" => (self.event_query)(self.captured_event as Handle),
            "capturing-stream-query" => (self.stream_query)(self.capturing as Handle),
            _ => unreachable!("checked against CALLS"),
        };
        (exchanged, r)
    }
}

impl Session<'_> {
    pub(super) fn capture_rules(&self) -> Result<(), String> {
        let capture_mode = mode(self.opts.str("capture-mode").unwrap_or("global"))?;
        let other_thread = match self.opts.str("caller").unwrap_or("other") {
            "same" => false,
            "other" => true,
            c => return Err(format!("unknown --caller {c:?} (same, other)")),
        };
        let caller_mode = self.opts.str("caller-mode").map(mode).transpose()?;
        let what = self.opts.str("call").ok_or("--call is required")?;
        let what = *CALLS
            .iter()
            .find(|c| **c == what)
            .ok_or_else(|| format!("unknown --call {what:?} ({})", CALLS.join(", ")))?;
        let cu = self.cu;
        let f = self
            .module_function()
            .map_err(|r| format!("module: {}", error_name(r)))?;
        let mut ns: u64 = 1_000_000;
        let mut params: [*mut c_void; 1] = [&mut ns as *mut u64 as *mut c_void];
        // SAFETY: cuda.h's ABIs; valid out-pointers; params outlive the calls.
        unsafe {
            let mut capturing: Handle = std::ptr::null_mut();
            let mut other: Handle = std::ptr::null_mut();
            need!(cu.stream_create())(&mut capturing, 0);
            need!(cu.stream_create())(&mut other, 0);
            let mut outside_event: Handle = std::ptr::null_mut();
            let mut captured_event: Handle = std::ptr::null_mut();
            need!(cu.event_create())(&mut outside_event, 0);
            need!(cu.event_create())(&mut captured_event, 0);
            let launch = need!(cu.launch_kernel());
            let launch_into = |stream: Handle, params: &mut [*mut c_void; 1]| {
                launch(
                    f,
                    1,
                    1,
                    1,
                    32,
                    1,
                    1,
                    0,
                    stream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            };
            // Work outside the capture, still running when the call is made.
            launch_into(other, &mut params);
            need!(cu.event_record())(outside_event, other);
            let begun = need!(cu.stream_begin_capture_v2())(capturing, capture_mode);
            let captured = launch_into(capturing, &mut params);
            need!(cu.event_record())(captured_event, capturing);
            let call = Call {
                what,
                ctx: self.context.get() as usize,
                capturing: capturing as usize,
                other: other as usize,
                outside_event: outside_event as usize,
                captured_event: captured_event as usize,
                set_current: need!(cu.ctx_set_current()),
                exchange: cu.thread_exchange_stream_capture_mode().ok(),
                event_query: need!(cu.event_query()),
                event_sync: need!(cu.event_synchronize()),
                stream_query: need!(cu.stream_query()),
                stream_sync: need!(cu.stream_synchronize()),
                ctx_sync: need!(cu.ctx_synchronize()),
                mem_alloc: need!(cu.mem_alloc_v2()),
                mem_free: need!(cu.mem_free_v2()),
                mem_alloc_async: need!(cu.mem_alloc_async()),
                mem_free_async: need!(cu.mem_free_async()),
                stream_get_device: cu.stream_get_device().ok(),
            };
            let (exchanged, result) = if other_thread {
                std::thread::spawn(move || call.make(caller_mode, true))
                    .join()
                    .map_err(|_| "the calling thread panicked")?
            } else {
                let out = call.make(caller_mode, false);
                // Back to the thread's default for what follows.
                if let (Some(_), Some(f)) = (caller_mode, call.exchange) {
                    let mut m = 0;
                    f(&mut m);
                }
                out
            };
            let mut status = -1;
            let status_result = need!(cu.stream_is_capturing())(capturing, &mut status);
            let after = launch_into(capturing, &mut params);
            let mut graph: Handle = std::ptr::null_mut();
            let ended = need!(cu.stream_end_capture())(capturing, &mut graph);
            emit(with_result(
                json!({
                    "op": "capture_rules",
                    "capture_mode": capture_mode,
                    "caller": if other_thread { "other" } else { "same" },
                    "caller_mode": caller_mode,
                    "call": what,
                    "begin_result": begun,
                    "captured_launch_result": captured,
                    "exchange_result": exchanged,
                    "status_result": status_result,
                    "status_after": status,
                    "launch_after": after,
                    "end_result": ended,
                    "end_error": error_name(ended),
                    "graph": !graph.is_null(),
                }),
                result,
            ));
            need!(cu.stream_synchronize())(other);
        }
        Ok(())
    }
}

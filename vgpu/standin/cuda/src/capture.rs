//! The rules stream capture puts on "potentially unsafe" calls made during or concurrently with a
//! capture (cuda.h: `cuStreamBeginCapture_v2`, `cuThreadExchangeStreamCaptureMode`).
//!
//! Each thread has an interaction mode (`CU_STREAM_CAPTURE_MODE_GLOBAL` unless it exchanged it),
//! each capture the mode it began with. A potentially unsafe call is prohibited when:
//! - the thread's mode is GLOBAL and the thread has its own capture not begun RELAXED, or any other
//!   thread has a capture begun GLOBAL;
//! - the thread's mode is THREAD_LOCAL and the thread has its own capture not begun RELAXED;
//! - never when the thread's mode is RELAXED.
//!
//! A prohibited call fails with `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and invalidates the
//! captures that prohibited it ("when an invalid operation is attempted during stream capture, any
//! associated capture graphs are invalidated"): they go on to fail with
//! `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`, and `cuStreamEndCapture` returns no graph. This is what
//! broke PyTorch's captures when its NCCL watchdog thread polled an event recorded before the
//! capture (PyTorch moved those queries to the thread-local and relaxed modes).
//!
//! Calls that necessarily conflict with a capture are refused in every mode (querying or
//! synchronising the capturing stream, an event recorded in a capture, or the context of a
//! capturing stream): see `exec.rs`.
//!
//! The stand-in's potentially unsafe calls: `cuEventQuery`, `cuEventSynchronize`, `cuStreamQuery`,
//! `cuStreamSynchronize`, `cuCtxSynchronize`, `cuStreamGetDevice` (CCCL found it refused during
//! capture on driver 580, the H200's, and the refusal invalidating the capture), and the
//! synchronous allocations and frees (`cuMemAlloc`, `cuMemAllocPitch`, `cuMemAllocManaged`,
//! `cuMemFree`; cudaMalloc is cuda.h's own example).
#![allow(non_snake_case, clippy::missing_safety_doc)]

use crate::driver::{driver, entry};
use crate::exec::Stream;
use crate::ffi::*;
use std::cell::Cell;
use std::sync::{Arc, Mutex, Weak};
use std::thread::ThreadId;

thread_local! {
    /// This thread's stream capture interaction mode.
    static MODE: Cell<i32> = const { Cell::new(CU_STREAM_CAPTURE_MODE_GLOBAL) };
}

/// The process's captures in progress.
static ACTIVE: Mutex<Vec<Weak<Stream>>> = Mutex::new(Vec::new());

fn active() -> std::sync::MutexGuard<'static, Vec<Weak<Stream>>> {
    ACTIVE.lock().unwrap_or_else(|e| e.into_inner())
}

pub fn valid_mode(mode: i32) -> bool {
    matches!(
        mode,
        CU_STREAM_CAPTURE_MODE_GLOBAL
            | CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
            | CU_STREAM_CAPTURE_MODE_RELAXED
    )
}

/// A capture began on `stream`.
pub fn began(stream: &Arc<Stream>) {
    let mut list = active();
    list.retain(|w| w.strong_count() > 0);
    list.push(Arc::downgrade(stream));
}

/// The capture on `stream` ended.
pub fn ended(stream: &Arc<Stream>) {
    active().retain(|w| w.strong_count() > 0 && !std::ptr::eq(w.as_ptr(), Arc::as_ptr(stream)));
}

/// Whether a call from a thread in mode `caller_mode` is prohibited by a capture begun with
/// `capture_mode` by the thread `owner` (`ours`: the caller is that thread).
pub fn prohibits(caller_mode: i32, capture_mode: i32, ours: bool) -> bool {
    match caller_mode {
        CU_STREAM_CAPTURE_MODE_RELAXED => false,
        CU_STREAM_CAPTURE_MODE_THREAD_LOCAL => {
            ours && capture_mode != CU_STREAM_CAPTURE_MODE_RELAXED
        }
        _ => {
            (ours && capture_mode != CU_STREAM_CAPTURE_MODE_RELAXED)
                || (!ours && capture_mode == CU_STREAM_CAPTURE_MODE_GLOBAL)
        }
    }
}

/// Checks a potentially unsafe call against the captures in progress: Ok, or the captures that
/// prohibit it invalidated and `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`.
pub fn unsafe_call() -> Result<(), CUresult> {
    let mode = MODE.with(Cell::get);
    let me: ThreadId = std::thread::current().id();
    let streams: Vec<Arc<Stream>> = active().iter().filter_map(Weak::upgrade).collect();
    let mut prohibited = false;
    for s in streams {
        if s.invalidate_capture_if(|capture_mode, owner| prohibits(mode, capture_mode, owner == me))
        {
            prohibited = true;
        }
    }
    if prohibited {
        Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
    } else {
        Ok(())
    }
}

/// Swaps the calling thread's interaction mode with `*mode`.
#[no_mangle]
pub unsafe extern "C" fn cuThreadExchangeStreamCaptureMode(mode: *mut i32) -> CUresult {
    entry(|| {
        driver()?;
        let m = mode.as_mut().ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if !valid_mode(*m) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        *m = MODE.with(|cell| cell.replace(*m));
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_three_modes_follow_cuda_h() {
        const G: i32 = CU_STREAM_CAPTURE_MODE_GLOBAL;
        const T: i32 = CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        const R: i32 = CU_STREAM_CAPTURE_MODE_RELAXED;
        // (caller's mode, capture's mode, the caller's own capture) -> prohibited
        for (caller, capture, ours, expected) in [
            (G, G, true, true),
            (G, T, true, true),
            (G, R, true, false),
            (G, G, false, true),
            (G, T, false, false),
            (G, R, false, false),
            (T, G, true, true),
            (T, T, true, true),
            (T, R, true, false),
            (T, G, false, false),
            (R, G, true, false),
            (R, G, false, false),
        ] {
            assert_eq!(
                prohibits(caller, capture, ours),
                expected,
                "caller {caller}, capture {capture}, ours {ours}"
            );
        }
    }
}

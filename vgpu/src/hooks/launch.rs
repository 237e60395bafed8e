//! Launches: every launch path goes through the limiter's gate (`limiter.rs`), and, once
//! launched, leaves its mark. The `_ptsz` forms differ only in what a NULL stream means: each
//! handler serves both, `PER_THREAD` saying which (the two ABIs are the same).

use super::*;
use crate::limiter;

/// The gate, the launch, its mark.
unsafe fn gated(stream: CUstream, per_thread: bool, launch: impl FnOnce() -> CUresult) -> CUresult {
    let ticket = match limiter::before_launch(stream, per_thread) {
        Ok(ticket) => ticket,
        Err(rc) => return rc,
    };
    let rc = launch();
    limiter::after_launch(ticket, rc);
    rc
}

pub(super) unsafe fn launch_kernel<const PER_THREAD: bool>(
    real: pfn::cuLaunchKernel,
    f: CUfunction,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    stream: CUstream,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    gated(stream, PER_THREAD, || {
        real(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra)
    })
}

fn config_stream(config: *const CUlaunchConfigHead) -> CUstream {
    if config.is_null() {
        std::ptr::null_mut()
    } else {
        // SAFETY: the caller's launch configuration, read only.
        unsafe { (*config).stream }
    }
}

pub(super) unsafe fn launch_kernel_ex<const PER_THREAD: bool>(
    real: pfn::cuLaunchKernelEx,
    config: *const CUlaunchConfigHead,
    f: CUfunction,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    gated(config_stream(config), PER_THREAD, || {
        real(config, f, params, extra)
    })
}

pub(super) unsafe fn launch_cooperative<const PER_THREAD: bool>(
    real: pfn::cuLaunchCooperativeKernel,
    f: CUfunction,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    stream: CUstream,
    params: *mut *mut c_void,
) -> CUresult {
    gated(stream, PER_THREAD, || {
        real(f, gx, gy, gz, bx, by, bz, shared, stream, params)
    })
}

pub(super) unsafe fn graph_launch<const PER_THREAD: bool>(
    real: pfn::cuGraphLaunch,
    exec: CUgraphExec,
    stream: CUstream,
) -> CUresult {
    gated(stream, PER_THREAD, || real(exec, stream))
}

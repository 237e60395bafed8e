//! Launches: every launch path goes through the limiter's gate (`limiter.rs`), and, once
//! launched, leaves its mark. The `_ptsz` forms differ only in what a NULL stream means.

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

pub(super) unsafe fn launch_kernel(
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
    gated(stream, false, || {
        real(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra)
    })
}

pub(super) unsafe fn launch_kernel_ptsz(
    real: pfn::cuLaunchKernel_ptsz,
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
    gated(stream, true, || {
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

pub(super) unsafe fn launch_kernel_ex(
    real: pfn::cuLaunchKernelEx,
    config: *const CUlaunchConfigHead,
    f: CUfunction,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    gated(config_stream(config), false, || {
        real(config, f, params, extra)
    })
}

pub(super) unsafe fn launch_kernel_ex_ptsz(
    real: pfn::cuLaunchKernelEx_ptsz,
    config: *const CUlaunchConfigHead,
    f: CUfunction,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    gated(config_stream(config), true, || {
        real(config, f, params, extra)
    })
}

pub(super) unsafe fn launch_cooperative(
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
    gated(stream, false, || {
        real(f, gx, gy, gz, bx, by, bz, shared, stream, params)
    })
}

pub(super) unsafe fn launch_cooperative_ptsz(
    real: pfn::cuLaunchCooperativeKernel_ptsz,
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
    gated(stream, true, || {
        real(f, gx, gy, gz, bx, by, bz, shared, stream, params)
    })
}

pub(super) unsafe fn graph_launch(
    real: pfn::cuGraphLaunch,
    exec: CUgraphExec,
    stream: CUstream,
) -> CUresult {
    gated(stream, false, || real(exec, stream))
}

pub(super) unsafe fn graph_launch_ptsz(
    real: pfn::cuGraphLaunch_ptsz,
    exec: CUgraphExec,
    stream: CUstream,
) -> CUresult {
    gated(stream, true, || real(exec, stream))
}

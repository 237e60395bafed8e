//! Launches: every launch path goes through the limiter's gate.

use super::*;
use crate::gate;

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
    if let Err(rc) = gate::before_launch(stream) {
        return rc;
    }
    real(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra)
}

pub(super) unsafe fn launch_kernel_ex(
    real: pfn::cuLaunchKernelEx,
    config: *const CUlaunchConfigHead,
    f: CUfunction,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    let stream = if config.is_null() {
        std::ptr::null_mut()
    } else {
        (*config).stream
    };
    if let Err(rc) = gate::before_launch(stream) {
        return rc;
    }
    real(config, f, params, extra)
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
    if let Err(rc) = gate::before_launch(stream) {
        return rc;
    }
    real(f, gx, gy, gz, bx, by, bz, shared, stream, params)
}

pub(super) unsafe fn graph_launch(
    real: pfn::cuGraphLaunch,
    exec: CUgraphExec,
    stream: CUstream,
) -> CUresult {
    if let Err(rc) = gate::before_launch(stream) {
        return rc;
    }
    real(exec, stream)
}

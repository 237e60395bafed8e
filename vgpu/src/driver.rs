//! Driver and NVML functions the library calls for itself (not wrapped), resolved by name through
//! the real `dlsym` on the library's handle the first time they are needed.

use crate::cuda::*;
use crate::interpose::{Library, CUDA, NVML};
use std::ffi::{c_char, c_int, c_uint, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Whether the stream is capturing (a launch into a capture runs nothing). An error (the legacy
/// stream while another stream captures) counts as capturing: the launch is the program's to make.
#[allow(clippy::not_unsafe_ptr_arg_deref)] // the stream is an opaque handle for the driver
pub fn capturing(stream: CUstream) -> bool {
    let mut status: c_int = CU_STREAM_CAPTURE_STATUS_NONE;
    match unsafe { cuStreamIsCapturing(stream, &mut status) } {
        Some(CUDA_SUCCESS) => status != CU_STREAM_CAPTURE_STATUS_NONE,
        Some(_) => true,
        None => false,
    }
}

/// Runs `f` in the relaxed stream-capture mode: our own calls (event queries, a stream's device)
/// must not count as the "potentially unsafe" calls that invalidate another thread's capture in
/// global mode.
pub fn relaxed<R>(f: impl FnOnce() -> R) -> R {
    let mut mode: c_int = CU_STREAM_CAPTURE_MODE_RELAXED;
    let exchanged = unsafe { cuThreadExchangeStreamCaptureMode(&mut mode) } == Some(CUDA_SUCCESS);
    let result = f();
    if exchanged {
        unsafe { cuThreadExchangeStreamCaptureMode(&mut mode) };
    }
    result
}

/// A function pointer looked up once. 0: not looked up yet; 1: absent.
pub struct LazyFn {
    library: &'static Library,
    name: &'static CStr,
    addr: AtomicUsize,
}

const ABSENT: usize = 1;

impl LazyFn {
    pub const fn new(library: &'static Library, name: &'static CStr) -> LazyFn {
        LazyFn {
            library,
            name,
            addr: AtomicUsize::new(0),
        }
    }

    /// `load`: whether the library may be loaded for this (never libcuda: a program that did not
    /// load the driver must not get it from us; NVML we load for our own measurements).
    pub fn get(&self) -> Option<usize> {
        match self.addr.load(Ordering::Acquire) {
            0 => {
                let load = std::ptr::eq(self.library, &NVML);
                // A library not loaded yet is not cached as absent: it may be loaded later.
                let handle_known = self.library.handle(false).is_some();
                let found = self.library.lookup(self.name, load);
                if found.is_some() || handle_known {
                    self.addr.store(found.unwrap_or(ABSENT), Ordering::Release);
                }
                found
            }
            ABSENT => None,
            addr => Some(addr),
        }
    }
}

macro_rules! lazy_fns {
    ($($lib:ident $name:ident: fn($($arg:ident: $ty:ty),*) -> $ret:ty;)*) => {
        $(
            /// # Safety
            /// The pointers must be valid for the driver function of this name.
            #[allow(non_snake_case)]
            pub unsafe fn $name($($arg: $ty),*) -> Option<$ret> {
                static F: LazyFn = LazyFn::new(&$lib, unsafe {
                    CStr::from_bytes_with_nul_unchecked(concat!(stringify!($name), "\0").as_bytes())
                });
                let addr = F.get()?;
                // SAFETY: the symbol has this signature in cuda.h / nvml.h.
                let f: unsafe extern "C" fn($($ty),*) -> $ret = unsafe { std::mem::transmute(addr) };
                Some(unsafe { f($($arg),*) })
            }
        )*
    };
}

lazy_fns! {
    CUDA cuDeviceGet: fn(device: *mut CUdevice, ordinal: c_int) -> CUresult;
    CUDA cuDeviceGetCount: fn(count: *mut c_int) -> CUresult;
    CUDA cuDeviceGetUuid: fn(uuid: *mut CUuuid, device: CUdevice) -> CUresult;
    CUDA cuCtxGetDevice: fn(device: *mut CUdevice) -> CUresult;
    CUDA cuCtxGetCurrent: fn(context: *mut CUcontext) -> CUresult;
    CUDA cuStreamGetDevice: fn(stream: CUstream, device: *mut CUdevice) -> CUresult;
    CUDA cuStreamIsCapturing: fn(stream: CUstream, status: *mut c_int) -> CUresult;
    CUDA cuThreadExchangeStreamCaptureMode: fn(mode: *mut c_int) -> CUresult;
    CUDA cuEventCreate: fn(event: *mut CUevent, flags: c_uint) -> CUresult;
    CUDA cuEventRecord: fn(event: CUevent, stream: CUstream) -> CUresult;
    CUDA cuEventQuery: fn(event: CUevent) -> CUresult;
    CUDA cuEventDestroy_v2: fn(event: CUevent) -> CUresult;
    CUDA cuDevicePrimaryCtxGetState: fn(device: CUdevice, flags: *mut c_uint, active: *mut c_int) -> CUresult;
    CUDA cuArrayGetMemoryRequirements: fn(req: *mut CUDA_ARRAY_MEMORY_REQUIREMENTS, array: CUarray, device: CUdevice) -> CUresult;
    CUDA cuMipmappedArrayGetMemoryRequirements: fn(req: *mut CUDA_ARRAY_MEMORY_REQUIREMENTS, array: CUmipmappedArray, device: CUdevice) -> CUresult;
    NVML nvmlInit_v2: fn() -> nvmlReturn_t;
    NVML nvmlDeviceGetHandleByUUID: fn(uuid: *const c_char, device: *mut nvmlDevice_t) -> nvmlReturn_t;
    NVML nvmlDeviceGetUUID: fn(device: nvmlDevice_t, uuid: *mut c_char, length: c_uint) -> nvmlReturn_t;
    NVML nvmlDeviceGetIndex: fn(device: nvmlDevice_t, index: *mut c_uint) -> nvmlReturn_t;
    NVML nvmlDeviceGetComputeRunningProcesses_v3: fn(device: nvmlDevice_t, count: *mut c_uint, infos: *mut nvmlProcessInfo_t) -> nvmlReturn_t;
    NVML nvmlDeviceGetComputeRunningProcesses_v2: fn(device: nvmlDevice_t, count: *mut c_uint, infos: *mut nvmlProcessInfo_t) -> nvmlReturn_t;
    NVML nvmlDeviceGetComputeRunningProcesses: fn(device: nvmlDevice_t, count: *mut c_uint, infos: *mut nvmlProcessInfo_v1_t) -> nvmlReturn_t;
}

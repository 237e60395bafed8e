//! The few CUDA driver API and NVML types and codes the library touches, as `cuda.h` and `nvml.h`
//! define them (only the fields we read; layouts checked against the headers' offsets).

#![allow(non_camel_case_types)]

use std::ffi::{c_int, c_uint, c_void};

pub type CUresult = c_int;
pub type CUdevice = c_int;
pub type CUdeviceptr = u64;
/// The 32-bit device pointer of the pre-3.2 entry points (`cuMemAlloc` without `_v2`).
pub type CUdeviceptr_v1 = c_uint;
pub type CUcontext = *mut c_void;
pub type CUstream = *mut c_void;
pub type CUfunction = *mut c_void;
pub type CUgraphExec = *mut c_void;
pub type CUevent = *mut c_void;
pub type CUarray = *mut c_void;
pub type CUmipmappedArray = *mut c_void;
pub type CUmemoryPool = *mut c_void;
pub type CUmemGenericAllocationHandle = u64;

pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
/// What every entry point answers when the environment cannot be obeyed (fail closed): the
/// runtime reports it as "initialization error", which frameworks treat as "no usable CUDA".
pub const CUDA_ERROR_NOT_INITIALIZED: CUresult = 3;
pub const CUDA_ERROR_NOT_FOUND: CUresult = 500;
/// `cuEventQuery`: the work before the event has not finished.
pub const CUDA_ERROR_NOT_READY: CUresult = 600;
pub const CUDA_ERROR_UNKNOWN: CUresult = 999;

/// The special stream handles: the legacy NULL stream and the calling thread's per-thread
/// default stream, named explicitly (a NULL stream means either, depending on the entry point).
pub const CU_STREAM_LEGACY: usize = 0x1;
pub const CU_STREAM_PER_THREAD: usize = 0x2;

/// `cuEventCreate` flags: no timing (cheaper to record).
pub const CU_EVENT_DISABLE_TIMING: c_uint = 0x2;

/// `CUstreamCaptureStatus` and `CUstreamCaptureMode`.
pub const CU_STREAM_CAPTURE_STATUS_NONE: c_int = 0;
pub const CU_STREAM_CAPTURE_MODE_RELAXED: c_int = 2;

/// `cuGetProcAddress` flags.
pub const CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM: u64 = 1 << 1;

/// `CUmemLocationType`.
pub const CU_MEM_LOCATION_TYPE_DEVICE: c_int = 1;

/// `CUDA_ARRAY3D_DEFERRED_MAPPING`: the array has no memory of its own (it is mapped onto
/// `cuMemCreate` memory, which is charged there).
pub const CUDA_ARRAY3D_DEFERRED_MAPPING: c_uint = 0x80;

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct CUuuid {
    pub bytes: [u8; 16],
}

/// `CUmemLocation`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUmemLocation {
    pub kind: c_int,
    pub id: c_int,
}

/// The leading fields of `CUmemAllocationProp` (we only read; never copy the struct).
#[repr(C)]
pub struct CUmemAllocationPropHead {
    pub kind: c_int,
    pub requested_handle_types: c_int,
    pub location: CUmemLocation,
}

/// The leading fields of `CUmemPoolProps`.
#[repr(C)]
pub struct CUmemPoolPropsHead {
    pub alloc_type: c_int,
    pub handle_types: c_int,
    pub location: CUmemLocation,
}

/// `CUDA_ARRAY_DESCRIPTOR` (`_v2`: size_t extents).
#[repr(C)]
pub struct CUDA_ARRAY_DESCRIPTOR {
    pub width: usize,
    pub height: usize,
    pub format: c_uint,
    pub num_channels: c_uint,
}

/// `CUDA_ARRAY_DESCRIPTOR_v1` (32-bit extents, `cuArrayCreate` without `_v2`).
#[repr(C)]
pub struct CUDA_ARRAY_DESCRIPTOR_v1 {
    pub width: c_uint,
    pub height: c_uint,
    pub format: c_uint,
    pub num_channels: c_uint,
}

#[repr(C)]
pub struct CUDA_ARRAY3D_DESCRIPTOR {
    pub width: usize,
    pub height: usize,
    pub depth: usize,
    pub format: c_uint,
    pub num_channels: c_uint,
    pub flags: c_uint,
}

#[repr(C)]
pub struct CUDA_ARRAY3D_DESCRIPTOR_v1 {
    pub width: c_uint,
    pub height: c_uint,
    pub depth: c_uint,
    pub format: c_uint,
    pub num_channels: c_uint,
    pub flags: c_uint,
}

#[repr(C)]
#[derive(Default)]
pub struct CUDA_ARRAY_MEMORY_REQUIREMENTS {
    pub size: usize,
    pub alignment: usize,
    pub reserved: [c_uint; 4],
}

/// The leading fields of `CUlaunchConfig` (the stream is what the gate needs).
#[repr(C)]
pub struct CUlaunchConfigHead {
    pub grid: [c_uint; 3],
    pub block: [c_uint; 3],
    pub shared_mem_bytes: c_uint,
    pub stream: CUstream,
}

// NVML.
pub type nvmlReturn_t = c_int;
pub type nvmlDevice_t = *mut c_void;
pub const NVML_SUCCESS: nvmlReturn_t = 0;
/// What NVML memory queries answer when the environment cannot be obeyed (fail closed).
pub const NVML_ERROR_UNINITIALIZED: nvmlReturn_t = 1;
pub const NVML_ERROR_INVALID_ARGUMENT: nvmlReturn_t = 2;
pub const NVML_ERROR_NOT_FOUND: nvmlReturn_t = 6;
pub const NVML_ERROR_INSUFFICIENT_SIZE: nvmlReturn_t = 7;
pub const NVML_ERROR_UNKNOWN: nvmlReturn_t = 999;
/// `usedGpuMemory` when the driver cannot say (e.g. without the privilege to see it).
pub const NVML_VALUE_NOT_AVAILABLE: u64 = u64::MAX;

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct nvmlMemory_t {
    pub total: u64,
    pub free: u64,
    pub used: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct nvmlMemory_v2_t {
    pub version: c_uint,
    pub total: u64,
    pub reserved: u64,
    pub free: u64,
    pub used: u64,
}

/// `nvmlMemory_v2`: `NVML_STRUCT_VERSION(Memory, 2)`.
pub const NVML_MEMORY_V2: c_uint = std::mem::size_of::<nvmlMemory_v2_t>() as c_uint | (2 << 24);

/// `nvmlProcessInfo_v1_t` (`nvmlDeviceGetComputeRunningProcesses` without suffix).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct nvmlProcessInfo_v1_t {
    pub pid: c_uint,
    pub used_gpu_memory: u64,
}

/// `nvmlProcessInfo_t` of the `_v2` and `_v3` queries.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct nvmlProcessInfo_t {
    pub pid: c_uint,
    pub used_gpu_memory: u64,
    pub gpu_instance_id: c_uint,
    pub compute_instance_id: c_uint,
}

/// Buffer size for `nvmlDeviceGetUUID` (`NVML_DEVICE_UUID_V2_BUFFER_SIZE`).
pub const NVML_UUID_BUFFER: usize = 96;

const _: () = {
    assert!(std::mem::offset_of!(CUlaunchConfigHead, stream) == 32);
    assert!(std::mem::size_of::<CUDA_ARRAY3D_DESCRIPTOR>() == 40);
    assert!(std::mem::size_of::<CUDA_ARRAY_MEMORY_REQUIREMENTS>() == 32);
    assert!(std::mem::offset_of!(CUmemAllocationPropHead, location) == 8);
    assert!(std::mem::size_of::<nvmlMemory_v2_t>() == 40);
    assert!(std::mem::size_of::<nvmlProcessInfo_t>() == 24);
};

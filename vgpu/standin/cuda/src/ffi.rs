//! The driver API's types and constants, written by hand to mirror `cuda.h` of CUDA 12.9 (PyPI
//! `nvidia-cuda-runtime-cu12` 12.9.79, `nvidia/cuda_runtime/include/cuda.h`); the numeric values and
//! struct layouts are that header's, for x86_64/aarch64 Linux (LP64).
#![allow(non_camel_case_types, dead_code)]

use std::ffi::c_void;

pub type CUresult = i32;
pub type CUdevice = i32;
/// `CUdeviceptr_v2` (LP64).
pub type CUdeviceptr = u64;
/// `CUdeviceptr_v1`: the 32-bit pointers of the pre-3.2 entry points (`cuMemAlloc`, ...).
pub type CUdeviceptr_v1 = u32;
pub type CUcontext = *mut c_void;
pub type CUmodule = *mut c_void;
pub type CUfunction = *mut c_void;
pub type CUstream = *mut c_void;
pub type CUevent = *mut c_void;
pub type CUarray = *mut c_void;
pub type CUmipmappedArray = *mut c_void;
pub type CUgraph = *mut c_void;
pub type CUgraphNode = *mut c_void;
pub type CUgraphExec = *mut c_void;
pub type CUmemoryPool = *mut c_void;
pub type CUmemGenericAllocationHandle = u64;

// CUresult (`enum cudaError_enum`).
pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
pub const CUDA_ERROR_NOT_INITIALIZED: CUresult = 3;
pub const CUDA_ERROR_DEINITIALIZED: CUresult = 4;
pub const CUDA_ERROR_NO_DEVICE: CUresult = 100;
pub const CUDA_ERROR_INVALID_DEVICE: CUresult = 101;
pub const CUDA_ERROR_INVALID_IMAGE: CUresult = 200;
pub const CUDA_ERROR_INVALID_CONTEXT: CUresult = 201;
pub const CUDA_ERROR_CONTEXT_ALREADY_CURRENT: CUresult = 202;
pub const CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY: CUresult = 224;
pub const CUDA_ERROR_INVALID_HANDLE: CUresult = 400;
pub const CUDA_ERROR_ILLEGAL_STATE: CUresult = 401;
pub const CUDA_ERROR_NOT_FOUND: CUresult = 500;
pub const CUDA_ERROR_NOT_READY: CUresult = 600;
pub const CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: CUresult = 701;
pub const CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE: CUresult = 708;
pub const CUDA_ERROR_CONTEXT_IS_DESTROYED: CUresult = 709;
pub const CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE: CUresult = 720;
pub const CUDA_ERROR_NOT_PERMITTED: CUresult = 800;
pub const CUDA_ERROR_NOT_SUPPORTED: CUresult = 801;
pub const CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: CUresult = 900;
pub const CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: CUresult = 901;
pub const CUDA_ERROR_STREAM_CAPTURE_UNMATCHED: CUresult = 903;
pub const CUDA_ERROR_CAPTURED_EVENT: CUresult = 907;
pub const CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD: CUresult = 908;
pub const CUDA_ERROR_UNKNOWN: CUresult = 999;

/// Name and description of every code this stand-in returns (cuda.h's names, its doc comments
/// shortened), for `cuGetErrorName` / `cuGetErrorString`.
pub const ERRORS: &[(CUresult, &str, &str)] = &[
    (CUDA_SUCCESS, "CUDA_SUCCESS", "no error"),
    (
        CUDA_ERROR_INVALID_VALUE,
        "CUDA_ERROR_INVALID_VALUE",
        "invalid argument",
    ),
    (
        CUDA_ERROR_OUT_OF_MEMORY,
        "CUDA_ERROR_OUT_OF_MEMORY",
        "out of memory",
    ),
    (
        CUDA_ERROR_NOT_INITIALIZED,
        "CUDA_ERROR_NOT_INITIALIZED",
        "initialization error",
    ),
    (
        CUDA_ERROR_DEINITIALIZED,
        "CUDA_ERROR_DEINITIALIZED",
        "driver shutting down",
    ),
    (
        CUDA_ERROR_NO_DEVICE,
        "CUDA_ERROR_NO_DEVICE",
        "no CUDA-capable device is detected",
    ),
    (
        CUDA_ERROR_INVALID_DEVICE,
        "CUDA_ERROR_INVALID_DEVICE",
        "invalid device ordinal",
    ),
    (
        CUDA_ERROR_INVALID_IMAGE,
        "CUDA_ERROR_INVALID_IMAGE",
        "device kernel image is invalid",
    ),
    (
        CUDA_ERROR_INVALID_CONTEXT,
        "CUDA_ERROR_INVALID_CONTEXT",
        "invalid device context",
    ),
    (
        CUDA_ERROR_CONTEXT_ALREADY_CURRENT,
        "CUDA_ERROR_CONTEXT_ALREADY_CURRENT",
        "context already current",
    ),
    (
        CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY,
        "CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY",
        "the provided execution affinity is not supported",
    ),
    (
        CUDA_ERROR_INVALID_HANDLE,
        "CUDA_ERROR_INVALID_HANDLE",
        "invalid resource handle",
    ),
    (
        CUDA_ERROR_ILLEGAL_STATE,
        "CUDA_ERROR_ILLEGAL_STATE",
        "the operation cannot be performed in the present state",
    ),
    (
        CUDA_ERROR_NOT_FOUND,
        "CUDA_ERROR_NOT_FOUND",
        "named symbol not found",
    ),
    (
        CUDA_ERROR_NOT_READY,
        "CUDA_ERROR_NOT_READY",
        "device not ready",
    ),
    (
        CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES,
        "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
        "too many resources requested for launch",
    ),
    (
        CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE,
        "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE",
        "primary context active",
    ),
    (
        CUDA_ERROR_CONTEXT_IS_DESTROYED,
        "CUDA_ERROR_CONTEXT_IS_DESTROYED",
        "context is destroyed",
    ),
    (
        CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE,
        "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE",
        "too many blocks in cooperative launch",
    ),
    (
        CUDA_ERROR_NOT_PERMITTED,
        "CUDA_ERROR_NOT_PERMITTED",
        "operation not permitted",
    ),
    (
        CUDA_ERROR_NOT_SUPPORTED,
        "CUDA_ERROR_NOT_SUPPORTED",
        "operation not supported",
    ),
    (
        CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
        "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
        "operation not permitted when stream is capturing",
    ),
    (
        CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
        "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
        "operation failed due to a previous error during capture",
    ),
    (
        CUDA_ERROR_STREAM_CAPTURE_UNMATCHED,
        "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED",
        "capture was not initiated in this stream",
    ),
    (
        CUDA_ERROR_CAPTURED_EVENT,
        "CUDA_ERROR_CAPTURED_EVENT",
        "operation not permitted on an event last recorded in a capturing stream",
    ),
    (
        CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD,
        "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
        "attempt to terminate a thread-local capture sequence from another thread",
    ),
    (CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"),
];

// CUdriverProcAddress_flags / CUdriverProcAddressQueryResult.
pub const CU_GET_PROC_ADDRESS_DEFAULT: u64 = 0;
pub const CU_GET_PROC_ADDRESS_LEGACY_STREAM: u64 = 1 << 0;
pub const CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM: u64 = 1 << 1;
pub const CU_GET_PROC_ADDRESS_SUCCESS: i32 = 0;
pub const CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND: i32 = 1;
pub const CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT: i32 = 2;

// CUdevice_attribute (the ones this stand-in answers).
pub const CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: i32 = 1;
pub const CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X: i32 = 2;
pub const CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y: i32 = 3;
pub const CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z: i32 = 4;
pub const CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X: i32 = 5;
pub const CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y: i32 = 6;
pub const CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z: i32 = 7;
pub const CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: i32 = 8;
pub const CU_DEVICE_ATTRIBUTE_WARP_SIZE: i32 = 10;
pub const CU_DEVICE_ATTRIBUTE_MAX_PITCH: i32 = 11;
pub const CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT: i32 = 14;
pub const CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: i32 = 16;
pub const CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE1D_WIDTH: i32 = 21;
pub const CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_WIDTH: i32 = 22;
pub const CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_HEIGHT: i32 = 23;
pub const CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE3D_WIDTH: i32 = 24;
pub const CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE3D_HEIGHT: i32 = 25;
pub const CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE3D_DEPTH: i32 = 26;
pub const CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: i32 = 33;
pub const CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID: i32 = 34;
pub const CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: i32 = 39;
pub const CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: i32 = 41;
pub const CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID: i32 = 50;
pub const CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT: i32 = 51;
pub const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: i32 = 75;
pub const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: i32 = 76;
pub const CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY: i32 = 83;
pub const CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS: i32 = 89;
pub const CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH: i32 = 95;
pub const CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: i32 = 102;
pub const CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR: i32 = 106;
pub const CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: i32 = 115;

// CUctx_flags.
pub const CU_CTX_FLAGS_MASK: u32 = 0xFF;
// CUstream_flags and the special stream handles.
pub const CU_STREAM_NON_BLOCKING: u32 = 0x1;
pub const CU_STREAM_LEGACY: usize = 0x1;
pub const CU_STREAM_PER_THREAD: usize = 0x2;
// CUevent_flags.
pub const CU_EVENT_DISABLE_TIMING: u32 = 0x2;
pub const CU_EVENT_FLAGS_MASK: u32 = 0x7;
// CUmemAttach_flags.
pub const CU_MEM_ATTACH_GLOBAL: u32 = 0x1;
pub const CU_MEM_ATTACH_HOST: u32 = 0x2;
// CUmemAllocationType / CUmemLocationType / CUmemAllocationHandleType.
pub const CU_MEM_ALLOCATION_TYPE_PINNED: i32 = 0x1;
pub const CU_MEM_LOCATION_TYPE_DEVICE: i32 = 0x1;
pub const CU_MEM_LOCATION_TYPE_HOST: i32 = 0x2;
pub const CU_MEM_LOCATION_TYPE_HOST_NUMA: i32 = 0x3;
pub const CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT: i32 = 0x4;
pub const CU_MEM_HANDLE_TYPE_NONE: i32 = 0x0;
pub const CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: i32 = 0x1;
pub const CU_MEM_HANDLE_TYPE_FABRIC: i32 = 0x8;
// CUmemAllocationGranularity_flags.
pub const CU_MEM_ALLOC_GRANULARITY_MINIMUM: i32 = 0x0;
pub const CU_MEM_ALLOC_GRANULARITY_RECOMMENDED: i32 = 0x1;
// CUmemPool_attribute.
pub const CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES: i32 = 1;
pub const CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC: i32 = 2;
pub const CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES: i32 = 3;
pub const CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: i32 = 4;
pub const CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: i32 = 5;
pub const CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: i32 = 6;
pub const CU_MEMPOOL_ATTR_USED_MEM_CURRENT: i32 = 7;
pub const CU_MEMPOOL_ATTR_USED_MEM_HIGH: i32 = 8;
// CUarray_format (the classic element formats; the video and block-compressed ones are refused).
pub const CU_AD_FORMAT_UNSIGNED_INT8: i32 = 0x01;
pub const CU_AD_FORMAT_UNSIGNED_INT16: i32 = 0x02;
pub const CU_AD_FORMAT_UNSIGNED_INT32: i32 = 0x03;
pub const CU_AD_FORMAT_SIGNED_INT8: i32 = 0x08;
pub const CU_AD_FORMAT_SIGNED_INT16: i32 = 0x09;
pub const CU_AD_FORMAT_SIGNED_INT32: i32 = 0x0a;
pub const CU_AD_FORMAT_HALF: i32 = 0x10;
pub const CU_AD_FORMAT_FLOAT: i32 = 0x20;
// CUDA_ARRAY3D_* flags.
pub const CUDA_ARRAY3D_LAYERED: u32 = 0x01;
pub const CUDA_ARRAY3D_SURFACE_LDST: u32 = 0x02;
pub const CUDA_ARRAY3D_CUBEMAP: u32 = 0x04;
pub const CUDA_ARRAY3D_TEXTURE_GATHER: u32 = 0x08;
pub const CUDA_ARRAY3D_SPARSE: u32 = 0x40;
pub const CUDA_ARRAY3D_DEFERRED_MAPPING: u32 = 0x80;
// CUstreamCaptureMode / CUstreamCaptureStatus.
pub const CU_STREAM_CAPTURE_MODE_GLOBAL: i32 = 0;
pub const CU_STREAM_CAPTURE_MODE_THREAD_LOCAL: i32 = 1;
pub const CU_STREAM_CAPTURE_MODE_RELAXED: i32 = 2;
pub const CU_STREAM_CAPTURE_STATUS_NONE: i32 = 0;
pub const CU_STREAM_CAPTURE_STATUS_ACTIVE: i32 = 1;
pub const CU_STREAM_CAPTURE_STATUS_INVALIDATED: i32 = 2;
// CUlaunchAttributeID (the one the stand-in acts on).
pub const CU_LAUNCH_ATTRIBUTE_COOPERATIVE: i32 = 2;
// CUfunction_attribute.
pub const CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: i32 = 0;
pub const CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES: i32 = 1;
pub const CU_FUNC_ATTRIBUTE_NUM_REGS: i32 = 4;
// cuLaunchKernel's `extra` markers.
pub const CU_LAUNCH_PARAM_END: usize = 0x00;
pub const CU_LAUNCH_PARAM_BUFFER_POINTER: usize = 0x01;
pub const CU_LAUNCH_PARAM_BUFFER_SIZE: usize = 0x02;

/// `CUuuid`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUuuid {
    pub bytes: [u8; 16],
}

/// `CUmemLocation_v1`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUmemLocation {
    pub type_: i32,
    pub id: i32,
}

/// `CUmemAllocationProp_v1`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUmemAllocationProp {
    pub type_: i32,
    pub requested_handle_types: i32,
    pub location: CUmemLocation,
    pub win32_handle_meta_data: *mut c_void,
    pub alloc_flags: CUmemAllocFlags,
}

/// The anonymous `allocFlags` struct of `CUmemAllocationProp_v1`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUmemAllocFlags {
    pub compression_type: u8,
    pub gpu_direct_rdma_capable: u8,
    pub usage: u16,
    pub reserved: [u8; 4],
}

/// `CUmemAccessDesc_v1`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUmemAccessDesc {
    pub location: CUmemLocation,
    pub flags: i32,
}

/// `CUmemPoolProps_v1`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUmemPoolProps {
    pub alloc_type: i32,
    pub handle_types: i32,
    pub location: CUmemLocation,
    pub win32_security_attributes: *mut c_void,
    pub max_size: usize,
    pub usage: u16,
    pub reserved: [u8; 54],
}

/// `CUDA_ARRAY_DESCRIPTOR_v2`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUDA_ARRAY_DESCRIPTOR {
    pub width: usize,
    pub height: usize,
    pub format: i32,
    pub num_channels: u32,
}

/// `CUDA_ARRAY_DESCRIPTOR_v1` (the `cuArrayCreate` of CUDA < 3.2).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUDA_ARRAY_DESCRIPTOR_v1 {
    pub width: u32,
    pub height: u32,
    pub format: i32,
    pub num_channels: u32,
}

/// `CUDA_ARRAY3D_DESCRIPTOR_v2`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUDA_ARRAY3D_DESCRIPTOR {
    pub width: usize,
    pub height: usize,
    pub depth: usize,
    pub format: i32,
    pub num_channels: u32,
    pub flags: u32,
}

/// `CUDA_ARRAY3D_DESCRIPTOR_v1`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUDA_ARRAY3D_DESCRIPTOR_v1 {
    pub width: u32,
    pub height: u32,
    pub depth: u32,
    pub format: i32,
    pub num_channels: u32,
    pub flags: u32,
}

/// `CUDA_ARRAY_MEMORY_REQUIREMENTS_v1`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUDA_ARRAY_MEMORY_REQUIREMENTS {
    pub size: usize,
    pub alignment: usize,
    pub reserved: [u32; 4],
}

/// `CUlaunchAttribute`: the id, padding to 8, and a 64-byte value union.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUlaunchAttribute {
    pub id: i32,
    pub pad: [u8; 4],
    pub value: [u64; 8],
}

/// `CUlaunchConfig`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUlaunchConfig {
    pub grid_dim_x: u32,
    pub grid_dim_y: u32,
    pub grid_dim_z: u32,
    pub block_dim_x: u32,
    pub block_dim_y: u32,
    pub block_dim_z: u32,
    pub shared_mem_bytes: u32,
    pub h_stream: CUstream,
    pub attrs: *mut CUlaunchAttribute,
    pub num_attrs: u32,
}

/// `CUDA_KERNEL_NODE_PARAMS_v1`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUDA_KERNEL_NODE_PARAMS_v1 {
    pub func: CUfunction,
    pub grid_dim_x: u32,
    pub grid_dim_y: u32,
    pub grid_dim_z: u32,
    pub block_dim_x: u32,
    pub block_dim_y: u32,
    pub block_dim_z: u32,
    pub shared_mem_bytes: u32,
    pub kernel_params: *mut *mut c_void,
    pub extra: *mut *mut c_void,
}

/// `CUDA_KERNEL_NODE_PARAMS_v2` (v1 plus `kern` and `ctx`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUDA_KERNEL_NODE_PARAMS_v2 {
    pub v1: CUDA_KERNEL_NODE_PARAMS_v1,
    pub kern: *mut c_void,
    pub ctx: CUcontext,
}

/// `CUctxCreateParams` (cuCtxCreate_v4).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUctxCreateParams {
    pub exec_affinity_params: *mut c_void,
    pub num_exec_affinity_params: i32,
    pub cig_params: *mut c_void,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    /// Sizes and offsets as cuda.h lays the structs out on LP64.
    #[test]
    fn layouts_match_cuda_h() {
        assert_eq!(size_of::<CUmemAllocationProp>(), 32);
        assert_eq!(offset_of!(CUmemAllocationProp, location), 8);
        assert_eq!(offset_of!(CUmemAllocationProp, alloc_flags), 24);
        assert_eq!(size_of::<CUmemPoolProps>(), 88);
        assert_eq!(offset_of!(CUmemPoolProps, max_size), 24);
        assert_eq!(size_of::<CUDA_ARRAY_DESCRIPTOR>(), 24);
        assert_eq!(size_of::<CUDA_ARRAY3D_DESCRIPTOR>(), 40);
        assert_eq!(size_of::<CUDA_ARRAY_DESCRIPTOR_v1>(), 16);
        assert_eq!(size_of::<CUDA_ARRAY3D_DESCRIPTOR_v1>(), 24);
        assert_eq!(size_of::<CUDA_ARRAY_MEMORY_REQUIREMENTS>(), 32);
        assert_eq!(size_of::<CUlaunchAttribute>(), 72);
        assert_eq!(offset_of!(CUlaunchConfig, h_stream), 32);
        assert_eq!(size_of::<CUlaunchConfig>(), 56);
        assert_eq!(size_of::<CUDA_KERNEL_NODE_PARAMS_v1>(), 56);
        assert_eq!(size_of::<CUDA_KERNEL_NODE_PARAMS_v2>(), 72);
        assert_eq!(size_of::<CUctxCreateParams>(), 24);
    }
}

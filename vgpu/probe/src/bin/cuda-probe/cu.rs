//! Typed calls into the driver, each through the function pointer the loader found, with the ABI
//! that matches how it was found (32-bit `cuMemAlloc` of CUDA 2.0, `cuMemAlloc_v2`, ...).

use crate::loader::{Loader, Resolved};
use serde_json::{json, Value};
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;

pub type CUresult = i32;

/// A call that could not be made: its entry point was not found.
#[derive(Clone, Debug)]
pub struct Missing {
    pub base: String,
    pub resolved: Resolved,
}

impl Missing {
    pub fn json(&self) -> Value {
        let (r, s) = self.resolved.result.unwrap_or((0, -1));
        json!({
            "missing": self.base,
            "symbol": self.resolved.name,
            "lookup_result": self.resolved.result.map(|_| r),
            "lookup_error": self.resolved.result.map(|_| error_name(r)),
            "lookup_status": self.resolved.result.map(|_| s),
        })
    }
}

pub type Call<T> = Result<T, Missing>;

pub struct Cu {
    pub loader: Loader,
    cache: RefCell<HashMap<String, Resolved>>,
}

pub fn error_name(code: CUresult) -> &'static str {
    match code {
        0 => "CUDA_SUCCESS",
        1 => "CUDA_ERROR_INVALID_VALUE",
        2 => "CUDA_ERROR_OUT_OF_MEMORY",
        3 => "CUDA_ERROR_NOT_INITIALIZED",
        4 => "CUDA_ERROR_DEINITIALIZED",
        34 => "CUDA_ERROR_STUB_LIBRARY",
        100 => "CUDA_ERROR_NO_DEVICE",
        101 => "CUDA_ERROR_INVALID_DEVICE",
        200 => "CUDA_ERROR_INVALID_IMAGE",
        201 => "CUDA_ERROR_INVALID_CONTEXT",
        209 => "CUDA_ERROR_NO_BINARY_FOR_GPU",
        218 => "CUDA_ERROR_INVALID_PTX",
        224 => "CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY",
        400 => "CUDA_ERROR_INVALID_HANDLE",
        401 => "CUDA_ERROR_ILLEGAL_STATE",
        500 => "CUDA_ERROR_NOT_FOUND",
        600 => "CUDA_ERROR_NOT_READY",
        700 => "CUDA_ERROR_ILLEGAL_ADDRESS",
        701 => "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
        708 => "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE",
        709 => "CUDA_ERROR_CONTEXT_IS_DESTROYED",
        719 => "CUDA_ERROR_LAUNCH_FAILED",
        720 => "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE",
        800 => "CUDA_ERROR_NOT_PERMITTED",
        801 => "CUDA_ERROR_NOT_SUPPORTED",
        900 => "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
        901 => "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
        903 => "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED",
        906 => "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
        907 => "CUDA_ERROR_CAPTURED_EVENT",
        908 => "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
        999 => "CUDA_ERROR_UNKNOWN",
        _ => "CUDA_ERROR_(other)",
    }
}

macro_rules! sig {
    ($($arg:ty),*) => { unsafe extern "C" fn($($arg),*) -> CUresult };
}

/// Declares a typed getter per entry point: `self.<method>()` resolves `<base>` once and returns
/// the pointer as the given function type.
macro_rules! entry_points {
    ($($method:ident: $base:literal => $ty:ty;)*) => {
        impl Cu {
            $(
                #[allow(dead_code)]
                pub fn $method(&self) -> Call<$ty> {
                    let addr = self.addr($base)?;
                    // SAFETY: the entry point named $base, whose ABI the caller chose from the
                    // version it was found with.
                    Ok(unsafe { std::mem::transmute::<*mut c_void, $ty>(addr) })
                }
            )*
        }
    };
}

pub type CUdeviceptr = u64;
pub type Handle = *mut c_void;

entry_points! {
    init: "cuInit" => sig!(u32);
    driver_get_version: "cuDriverGetVersion" => sig!(*mut i32);
    device_get_count: "cuDeviceGetCount" => sig!(*mut i32);
    device_get: "cuDeviceGet" => sig!(*mut i32, i32);
    device_get_name: "cuDeviceGetName" => sig!(*mut i8, i32, i32);
    device_get_uuid: "cuDeviceGetUuid" => sig!(*mut [u8; 16], i32);
    device_total_mem_v2: "cuDeviceTotalMem" => sig!(*mut usize, i32);
    device_total_mem_v1: "cuDeviceTotalMem" => sig!(*mut u32, i32);
    device_get_attribute: "cuDeviceGetAttribute" => sig!(*mut i32, i32, i32);
    primary_ctx_retain: "cuDevicePrimaryCtxRetain" => sig!(*mut Handle, i32);
    primary_ctx_release: "cuDevicePrimaryCtxRelease" => sig!(i32);
    primary_ctx_reset: "cuDevicePrimaryCtxReset" => sig!(i32);
    ctx_set_current: "cuCtxSetCurrent" => sig!(Handle);
    ctx_create_v2: "cuCtxCreate" => sig!(*mut Handle, u32, i32);
    ctx_create_v3: "cuCtxCreate" => sig!(*mut Handle, *mut c_void, i32, u32, i32);
    ctx_create_v4: "cuCtxCreate" => sig!(*mut Handle, *mut c_void, u32, i32);
    ctx_destroy: "cuCtxDestroy" => sig!(Handle);
    ctx_synchronize: "cuCtxSynchronize" => sig!();
    mem_get_info_v2: "cuMemGetInfo" => sig!(*mut usize, *mut usize);
    mem_get_info_v1: "cuMemGetInfo" => sig!(*mut u32, *mut u32);
    mem_alloc_v2: "cuMemAlloc" => sig!(*mut CUdeviceptr, usize);
    mem_alloc_v1: "cuMemAlloc" => sig!(*mut u32, u32);
    mem_alloc_pitch_v2: "cuMemAllocPitch" => sig!(*mut CUdeviceptr, *mut usize, usize, usize, u32);
    mem_alloc_pitch_v1: "cuMemAllocPitch" => sig!(*mut u32, *mut u32, u32, u32, u32);
    mem_free_v2: "cuMemFree" => sig!(CUdeviceptr);
    mem_free_v1: "cuMemFree" => sig!(u32);
    mem_alloc_managed: "cuMemAllocManaged" => sig!(*mut CUdeviceptr, usize, u32);
    mem_create: "cuMemCreate" => sig!(*mut u64, usize, *const MemAllocationProp, u64);
    mem_release: "cuMemRelease" => sig!(u64);
    mem_get_allocation_granularity: "cuMemGetAllocationGranularity" => sig!(*mut usize, *const MemAllocationProp, i32);
    mem_address_reserve: "cuMemAddressReserve" => sig!(*mut CUdeviceptr, usize, usize, CUdeviceptr, u64);
    mem_address_free: "cuMemAddressFree" => sig!(CUdeviceptr, usize);
    mem_map: "cuMemMap" => sig!(CUdeviceptr, usize, usize, u64, u64);
    mem_unmap: "cuMemUnmap" => sig!(CUdeviceptr, usize);
    mem_set_access: "cuMemSetAccess" => sig!(CUdeviceptr, usize, *const MemAccessDesc, usize);
    mem_alloc_async: "cuMemAllocAsync" => sig!(*mut CUdeviceptr, usize, Handle);
    mem_alloc_from_pool_async: "cuMemAllocFromPoolAsync" => sig!(*mut CUdeviceptr, usize, Handle, Handle);
    mem_free_async: "cuMemFreeAsync" => sig!(CUdeviceptr, Handle);
    mem_pool_create: "cuMemPoolCreate" => sig!(*mut Handle, *const MemPoolProps);
    mem_pool_destroy: "cuMemPoolDestroy" => sig!(Handle);
    mem_pool_get_attribute: "cuMemPoolGetAttribute" => sig!(Handle, i32, *mut c_void);
    device_get_default_mem_pool: "cuDeviceGetDefaultMemPool" => sig!(*mut Handle, i32);
    array_create_v2: "cuArrayCreate" => sig!(*mut Handle, *const ArrayDescriptor);
    array_create_v1: "cuArrayCreate" => sig!(*mut Handle, *const ArrayDescriptorV1);
    array3d_create_v2: "cuArray3DCreate" => sig!(*mut Handle, *const Array3dDescriptor);
    array3d_create_v1: "cuArray3DCreate" => sig!(*mut Handle, *const Array3dDescriptorV1);
    array_destroy: "cuArrayDestroy" => sig!(Handle);
    array_get_memory_requirements: "cuArrayGetMemoryRequirements" => sig!(*mut ArrayMemoryRequirements, Handle, i32);
    mipmapped_array_create: "cuMipmappedArrayCreate" => sig!(*mut Handle, *const Array3dDescriptor, u32);
    mipmapped_array_destroy: "cuMipmappedArrayDestroy" => sig!(Handle);
    mipmapped_array_get_memory_requirements: "cuMipmappedArrayGetMemoryRequirements" => sig!(*mut ArrayMemoryRequirements, Handle, i32);
    stream_create: "cuStreamCreate" => sig!(*mut Handle, u32);
    stream_destroy: "cuStreamDestroy" => sig!(Handle);
    stream_synchronize: "cuStreamSynchronize" => sig!(Handle);
    stream_begin_capture_v2: "cuStreamBeginCapture" => sig!(Handle, i32);
    stream_begin_capture_v1: "cuStreamBeginCapture" => sig!(Handle);
    stream_end_capture: "cuStreamEndCapture" => sig!(Handle, *mut Handle);
    stream_is_capturing: "cuStreamIsCapturing" => sig!(Handle, *mut i32);
    stream_query: "cuStreamQuery" => sig!(Handle);
    stream_get_device: "cuStreamGetDevice" => sig!(Handle, *mut i32);
    thread_exchange_stream_capture_mode: "cuThreadExchangeStreamCaptureMode" => sig!(*mut i32);
    event_create: "cuEventCreate" => sig!(*mut Handle, u32);
    event_record: "cuEventRecord" => sig!(Handle, Handle);
    event_synchronize: "cuEventSynchronize" => sig!(Handle);
    event_query: "cuEventQuery" => sig!(Handle);
    event_elapsed_time: "cuEventElapsedTime" => sig!(*mut f32, Handle, Handle);
    event_destroy: "cuEventDestroy" => sig!(Handle);
    module_load_data: "cuModuleLoadData" => sig!(*mut Handle, *const c_void);
    module_get_function: "cuModuleGetFunction" => sig!(*mut Handle, Handle, *const i8);
    occupancy: "cuOccupancyMaxActiveBlocksPerMultiprocessor" => sig!(*mut i32, Handle, i32, usize);
    launch_kernel: "cuLaunchKernel" => sig!(Handle, u32, u32, u32, u32, u32, u32, u32, Handle, *mut *mut c_void, *mut *mut c_void);
    launch_kernel_ex: "cuLaunchKernelEx" => sig!(*const LaunchConfig, Handle, *mut *mut c_void, *mut *mut c_void);
    launch_cooperative_kernel: "cuLaunchCooperativeKernel" => sig!(Handle, u32, u32, u32, u32, u32, u32, u32, Handle, *mut *mut c_void);
    graph_create: "cuGraphCreate" => sig!(*mut Handle, u32);
    graph_add_kernel_node_v1: "cuGraphAddKernelNode" => sig!(*mut Handle, Handle, *const Handle, usize, *const KernelNodeParams);
    graph_add_kernel_node_v2: "cuGraphAddKernelNode" => sig!(*mut Handle, Handle, *const Handle, usize, *const KernelNodeParamsV2);
    graph_instantiate_v1: "cuGraphInstantiate" => sig!(*mut Handle, Handle, *mut Handle, *mut i8, usize);
    graph_instantiate_with_flags: "cuGraphInstantiate" => sig!(*mut Handle, Handle, u64);
    graph_launch: "cuGraphLaunch" => sig!(Handle, Handle);
    graph_exec_destroy: "cuGraphExecDestroy" => sig!(Handle);
    graph_destroy: "cuGraphDestroy" => sig!(Handle);
}

impl Cu {
    pub fn new(loader: Loader) -> Cu {
        Cu {
            loader,
            cache: RefCell::new(HashMap::new()),
        }
    }

    pub fn addr(&self, base: &str) -> Result<*mut c_void, Missing> {
        let r = self
            .cache
            .borrow_mut()
            .entry(base.to_string())
            .or_insert_with(|| self.loader.resolve(base))
            .clone();
        if r.addr.is_null() {
            Err(Missing {
                base: base.to_string(),
                resolved: r,
            })
        } else {
            Ok(r.addr)
        }
    }

    /// Whether `base` resolved to its CUDA >= `since` ABI.
    pub fn abi(&self, since: i32, header_abi: i32) -> bool {
        self.loader.abi_at_least(since, header_abi)
    }

    /// The names among `base`'s variants whose `dlsym(handle, ...)` address is `addr`: which
    /// exported function a lookup found (none when something else, such as an interposer's
    /// wrapper, was returned).
    pub fn exported_as(&self, base: &str, addr: *mut c_void) -> Vec<String> {
        if addr.is_null() {
            return Vec::new();
        }
        let mut names: Vec<String> = [
            "", "_v2", "_v3", "_v4", "_ptsz", "_ptds", "_v2_ptsz", "_v2_ptds",
        ]
        .iter()
        .map(|s| format!("{base}{s}"))
        .collect();
        if base == "cuGraphInstantiate" {
            names.push("cuGraphInstantiateWithFlags".into());
        }
        names
            .into_iter()
            .filter(|n| self.loader.dlsym_handle(n) == addr)
            .collect()
    }

    /// Every resolution made so far, for the record.
    pub fn resolutions(&self) -> Value {
        let cache = self.cache.borrow();
        let mut names: Vec<&String> = cache.keys().collect();
        names.sort();
        Value::Object(
            names
                .into_iter()
                .map(|n| {
                    let r = &cache[n];
                    (
                        n.clone(),
                        json!({
                            "symbol": r.name,
                            "address": format!("{:#x}", r.addr as usize),
                            "lookup_result": r.result.map(|x| x.0),
                            "lookup_status": r.result.map(|x| x.1),
                            "matches": self.exported_as(n, r.addr),
                        }),
                    )
                })
                .collect(),
        )
    }
}

// ---- cuda.h structs (12.9), as the probe passes them ----

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct MemLocation {
    pub type_: i32,
    pub id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct MemAllocationProp {
    pub type_: i32,
    pub requested_handle_types: i32,
    pub location: MemLocation,
    pub win32_handle_meta_data: *mut c_void,
    pub alloc_flags: [u8; 8],
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct MemAccessDesc {
    pub location: MemLocation,
    pub flags: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct MemPoolProps {
    pub alloc_type: i32,
    pub handle_types: i32,
    pub location: MemLocation,
    pub win32_security_attributes: *mut c_void,
    pub max_size: usize,
    pub usage: u16,
    pub reserved: [u8; 54],
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ArrayDescriptor {
    pub width: usize,
    pub height: usize,
    pub format: i32,
    pub num_channels: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ArrayDescriptorV1 {
    pub width: u32,
    pub height: u32,
    pub format: i32,
    pub num_channels: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct Array3dDescriptor {
    pub width: usize,
    pub height: usize,
    pub depth: usize,
    pub format: i32,
    pub num_channels: u32,
    pub flags: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct Array3dDescriptorV1 {
    pub width: u32,
    pub height: u32,
    pub depth: u32,
    pub format: i32,
    pub num_channels: u32,
    pub flags: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ArrayMemoryRequirements {
    pub size: usize,
    pub alignment: usize,
    pub reserved: [u32; 4],
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct LaunchAttribute {
    pub id: i32,
    pub pad: [u8; 4],
    pub value: [u64; 8],
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct LaunchConfig {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_mem_bytes: u32,
    pub stream: Handle,
    pub attrs: *mut LaunchAttribute,
    pub num_attrs: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct KernelNodeParams {
    pub func: Handle,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_mem_bytes: u32,
    pub kernel_params: *mut *mut c_void,
    pub extra: *mut *mut c_void,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct KernelNodeParamsV2 {
    pub v1: KernelNodeParams,
    pub kern: Handle,
    pub ctx: Handle,
}

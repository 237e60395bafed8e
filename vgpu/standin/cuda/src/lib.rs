//! Test-only: a stand-in `libcuda.so.1` (a subset of the CUDA driver API on a simulated GPU).
//!
//! The simulated cards live in a file several processes share (the `gpupool-standin-device` crate);
//! this library is the driver API over them: devices, contexts, memory (linear, pitched, managed, the
//! virtual memory API, pools, arrays), streams, events, modules, launches, graphs, stream capture
//! and the rules it puts on other calls, and `cuGetProcAddress`. It refuses what the real driver
//! refuses, with cuda.h's codes; see the README next to this crate for what it imitates and what it
//! does not.

pub mod capture;
pub mod context;
pub mod device;
pub mod driver;
pub mod exec;
pub mod ffi;
pub mod memory;
pub mod procaddr;

/// Everything one process's driver holds.
pub struct State {
    pub handles: driver::Handles,
    pub contexts: driver::Registry<std::sync::Arc<context::Ctx>>,
    /// Each device's primary context, made on first retain and kept (its handle never changes).
    pub primaries: Vec<Option<std::sync::Arc<context::Ctx>>>,
    pub mem: memory::Memory,
    pub exec: exec::Exec,
}

impl State {
    pub fn new(ordinals: usize) -> State {
        State {
            handles: driver::Handles::default(),
            contexts: driver::Registry::default(),
            primaries: vec![None; ordinals],
            mem: memory::Memory::new(ordinals),
            exec: exec::Exec::default(),
        }
    }
}

/// The address of every exported entry point by name (what `cuGetProcAddress` returns).
pub mod symbols {
    #[allow(unused_imports)]
    use crate::{capture::*, context::*, device::*, exec::*, memory::*, procaddr::*};
    use std::ffi::c_void;

    macro_rules! table {
        ($($name:ident,)*) => {
            pub fn address_of(symbol: &str) -> Option<*mut c_void> {
                match symbol {
                    $(stringify!($name) => Some($name as *mut c_void),)*
                    _ => None,
                }
            }

            /// Every exported entry point's name.
            pub const NAMES: &[&str] = &[$(stringify!($name),)*];

            /// One private function per entry point that jumps to it: the addresses
            /// `cuGetProcAddress` hands out with `GPUPOOL_STANDIN_PROC_ADDRESS=internal`, as a
            /// driver may hand out internal entry points rather than its exported symbols. A jump,
            /// not a call, so one thunk serves whatever the entry point's arguments are.
            pub mod thunks {
                $(
                    #[allow(non_snake_case)]
                    pub mod $name {
                        #[cfg(target_arch = "x86_64")]
                        #[unsafe(naked)]
                        pub(super) unsafe extern "C" fn thunk() {
                            core::arch::naked_asm!("jmp {f}", f = sym super::super::$name)
                        }

                        #[cfg(target_arch = "aarch64")]
                        #[unsafe(naked)]
                        pub(super) unsafe extern "C" fn thunk() {
                            core::arch::naked_asm!("b {f}", f = sym super::super::$name)
                        }
                    }
                )*

                pub fn address_of(symbol: &str) -> Option<*mut std::ffi::c_void> {
                    match symbol {
                        $(stringify!($name) => Some($name::thunk as *mut std::ffi::c_void),)*
                        _ => None,
                    }
                }
            }
        };
    }

    table! {
    cuGetErrorString,
    cuGetErrorName,
    cuInit,
    cuDriverGetVersion,
    cuDeviceGet,
    cuDeviceGetCount,
    cuDeviceGetName,
    cuDeviceGetUuid,
    cuDeviceGetUuid_v2,
    cuDeviceTotalMem,
    cuDeviceTotalMem_v2,
    cuDeviceGetAttribute,
    cuDeviceGetPCIBusId,
    cuDeviceGetByPCIBusId,
    cuDeviceGetDefaultMemPool,
    cuDeviceGetMemPool,
    cuDeviceSetMemPool,
    cuDevicePrimaryCtxRetain,
    cuDevicePrimaryCtxGetState,
    cuDevicePrimaryCtxRelease,
    cuDevicePrimaryCtxRelease_v2,
    cuDevicePrimaryCtxSetFlags,
    cuDevicePrimaryCtxSetFlags_v2,
    cuDevicePrimaryCtxReset,
    cuDevicePrimaryCtxReset_v2,
    cuCtxCreate,
    cuCtxCreate_v2,
    cuCtxCreate_v3,
    cuCtxCreate_v4,
    cuCtxDestroy,
    cuCtxDestroy_v2,
    cuCtxPushCurrent,
    cuCtxPushCurrent_v2,
    cuCtxPopCurrent,
    cuCtxPopCurrent_v2,
    cuCtxSetCurrent,
    cuCtxGetCurrent,
    cuCtxGetDevice,
    cuCtxSynchronize,
    cuMemGetInfo,
    cuMemGetInfo_v2,
    cuMemAlloc,
    cuMemAlloc_v2,
    cuMemAllocPitch,
    cuMemAllocPitch_v2,
    cuMemFree,
    cuMemFree_v2,
    cuMemGetAddressRange_v2,
    cuMemAllocManaged,
    cuMemCreate,
    cuMemRelease,
    cuMemGetAllocationGranularity,
    cuMemAddressReserve,
    cuMemAddressFree,
    cuMemMap,
    cuMemUnmap,
    cuMemSetAccess,
    cuMemAllocAsync,
    cuMemAllocAsync_ptsz,
    cuMemAllocFromPoolAsync,
    cuMemAllocFromPoolAsync_ptsz,
    cuMemFreeAsync,
    cuMemFreeAsync_ptsz,
    cuMemPoolCreate,
    cuMemPoolDestroy,
    cuMemPoolTrimTo,
    cuMemPoolGetAttribute,
    cuMemPoolSetAttribute,
    cuArrayCreate,
    cuArrayCreate_v2,
    cuArray3DCreate,
    cuArray3DCreate_v2,
    cuArrayDestroy,
    cuArrayGetMemoryRequirements,
    cuMipmappedArrayCreate,
    cuMipmappedArrayDestroy,
    cuMipmappedArrayGetMemoryRequirements,
    cuStreamCreate,
    cuStreamCreateWithPriority,
    cuStreamDestroy,
    cuStreamDestroy_v2,
    cuStreamSynchronize,
    cuStreamSynchronize_ptsz,
    cuStreamQuery,
    cuStreamQuery_ptsz,
    cuStreamBeginCapture,
    cuStreamBeginCapture_ptsz,
    cuStreamBeginCapture_v2,
    cuStreamBeginCapture_v2_ptsz,
    cuStreamEndCapture,
    cuStreamEndCapture_ptsz,
    cuStreamIsCapturing,
    cuStreamIsCapturing_ptsz,
    cuStreamGetDevice,
    cuStreamGetDevice_ptsz,
    cuThreadExchangeStreamCaptureMode,
    cuEventCreate,
    cuEventRecord,
    cuEventRecord_ptsz,
    cuEventQuery,
    cuEventSynchronize,
    cuEventElapsedTime,
    cuEventElapsedTime_v2,
    cuEventDestroy,
    cuEventDestroy_v2,
    cuModuleLoadData,
    cuModuleLoadDataEx,
    cuModuleUnload,
    cuModuleGetFunction,
    cuFuncGetAttribute,
    cuOccupancyMaxActiveBlocksPerMultiprocessor,
    cuLaunchKernel,
    cuLaunchKernel_ptsz,
    cuLaunchKernelEx,
    cuLaunchKernelEx_ptsz,
    cuLaunchCooperativeKernel,
    cuLaunchCooperativeKernel_ptsz,
    cuGraphCreate,
    cuGraphAddKernelNode,
    cuGraphAddKernelNode_v2,
    cuGraphInstantiate,
    cuGraphInstantiate_v2,
    cuGraphInstantiateWithFlags,
    cuGraphLaunch,
    cuGraphLaunch_ptsz,
    cuGraphExecDestroy,
    cuGraphDestroy,
    cuGetProcAddress,
    cuGetProcAddress_v2,
    }
}

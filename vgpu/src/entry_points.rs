//! The entry points the library wraps, listed once: each ABI variant and stream variant of a
//! function is its own entry, with the arguments of its prototype in `cuda.h` / `nvml.h` and the
//! handler (in `hooks`) that its wrappers call.
//!
//! [`Sym`] names them for everything below the wrappers (the real pointers in `interpose`, our own
//! calls in `driver` and `nvml`); `hooks` expands the same list into the wrappers themselves.

#![allow(clippy::missing_safety_doc)]

use crate::cuda::*;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};

/// Expands `$callback! { name(args) => handler; ... }` over every wrapped entry point.
macro_rules! for_each_entry_point {
    ($callback:ident) => {
        $callback! {
            cuInit(flags: c_uint) => init;
            cuGetProcAddress(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: u64) => get_proc_address;
            cuGetProcAddress_v2(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: u64, status: *mut c_int) => get_proc_address_v2;
            cuDeviceTotalMem(bytes: *mut c_uint, device: CUdevice) => device_total_mem;
            cuDeviceTotalMem_v2(bytes: *mut usize, device: CUdevice) => device_total_mem;
            cuMemGetInfo(free: *mut c_uint, total: *mut c_uint) => mem_get_info;
            cuMemGetInfo_v2(free: *mut usize, total: *mut usize) => mem_get_info;
            cuMemAlloc(dptr: *mut CUdeviceptr_v1, bytes: c_uint) => mem_alloc;
            cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytes: usize) => mem_alloc;
            cuMemAllocPitch(dptr: *mut CUdeviceptr_v1, pitch: *mut c_uint, width: c_uint, height: c_uint, element: c_uint) => mem_alloc_pitch_v1;
            cuMemAllocPitch_v2(dptr: *mut CUdeviceptr, pitch: *mut usize, width: usize, height: usize, element: c_uint) => mem_alloc_pitch;
            cuMemFree(dptr: CUdeviceptr_v1) => mem_free;
            cuMemFree_v2(dptr: CUdeviceptr) => mem_free;
            cuMemAllocManaged(dptr: *mut CUdeviceptr, bytes: usize, flags: c_uint) => mem_alloc_managed;
            cuMemCreate(handle: *mut CUmemGenericAllocationHandle, size: usize, prop: *const CUmemAllocationPropHead, flags: u64) => mem_create;
            cuMemRelease(handle: CUmemGenericAllocationHandle) => mem_release;
            cuMemMap(ptr: CUdeviceptr, size: usize, offset: usize, handle: CUmemGenericAllocationHandle, flags: u64) => mem_map;
            cuMemUnmap(ptr: CUdeviceptr, size: usize) => mem_unmap;
            cuMemAllocAsync(dptr: *mut CUdeviceptr, bytes: usize, stream: CUstream) => mem_alloc_async;
            cuMemAllocAsync_ptsz(dptr: *mut CUdeviceptr, bytes: usize, stream: CUstream) => mem_alloc_async;
            cuMemAllocFromPoolAsync(dptr: *mut CUdeviceptr, bytes: usize, pool: CUmemoryPool, stream: CUstream) => mem_alloc_from_pool_async;
            cuMemAllocFromPoolAsync_ptsz(dptr: *mut CUdeviceptr, bytes: usize, pool: CUmemoryPool, stream: CUstream) => mem_alloc_from_pool_async;
            cuMemFreeAsync(dptr: CUdeviceptr, stream: CUstream) => mem_free_async;
            cuMemFreeAsync_ptsz(dptr: CUdeviceptr, stream: CUstream) => mem_free_async;
            cuMemPoolCreate(pool: *mut CUmemoryPool, props: *const CUmemPoolPropsHead) => mem_pool_create;
            cuMemPoolDestroy(pool: CUmemoryPool) => mem_pool_destroy;
            cuDeviceGetDefaultMemPool(pool: *mut CUmemoryPool, device: CUdevice) => device_get_mem_pool;
            cuDeviceGetMemPool(pool: *mut CUmemoryPool, device: CUdevice) => device_get_mem_pool;
            cuArrayCreate(handle: *mut CUarray, desc: *const CUDA_ARRAY_DESCRIPTOR_v1) => any_array_create;
            cuArrayCreate_v2(handle: *mut CUarray, desc: *const CUDA_ARRAY_DESCRIPTOR) => any_array_create;
            cuArray3DCreate(handle: *mut CUarray, desc: *const CUDA_ARRAY3D_DESCRIPTOR_v1) => any_array_create;
            cuArray3DCreate_v2(handle: *mut CUarray, desc: *const CUDA_ARRAY3D_DESCRIPTOR) => any_array_create;
            cuMipmappedArrayCreate(handle: *mut CUmipmappedArray, desc: *const CUDA_ARRAY3D_DESCRIPTOR, levels: c_uint) => mipmapped_array_create;
            cuArrayDestroy(array: CUarray) => array_destroy;
            cuMipmappedArrayDestroy(array: CUmipmappedArray) => mipmapped_array_destroy;
            cuDevicePrimaryCtxRetain(ctx: *mut CUcontext, device: CUdevice) => primary_ctx_retain;
            cuDevicePrimaryCtxRelease(device: CUdevice) => primary_ctx_release;
            cuDevicePrimaryCtxRelease_v2(device: CUdevice) => primary_ctx_release;
            cuDevicePrimaryCtxReset(device: CUdevice) => primary_ctx_reset;
            cuDevicePrimaryCtxReset_v2(device: CUdevice) => primary_ctx_reset;
            cuCtxDestroy(ctx: CUcontext) => ctx_destroy;
            cuCtxDestroy_v2(ctx: CUcontext) => ctx_destroy;
            cuCtxCreate(ctx: *mut CUcontext, flags: c_uint, device: CUdevice) => ctx_create;
            cuCtxCreate_v2(ctx: *mut CUcontext, flags: c_uint, device: CUdevice) => ctx_create;
            cuCtxCreate_v3(ctx: *mut CUcontext, params: *mut c_void, count: c_int, flags: c_uint, device: CUdevice) => ctx_create_v3;
            cuCtxCreate_v4(ctx: *mut CUcontext, params: *mut c_void, flags: c_uint, device: CUdevice) => ctx_create_v4;
            cuLaunchKernel(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, shared: c_uint, stream: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void) => launch_kernel::<false>;
            cuLaunchKernel_ptsz(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, shared: c_uint, stream: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void) => launch_kernel::<true>;
            cuLaunchKernelEx(config: *const CUlaunchConfigHead, f: CUfunction, params: *mut *mut c_void, extra: *mut *mut c_void) => launch_kernel_ex::<false>;
            cuLaunchKernelEx_ptsz(config: *const CUlaunchConfigHead, f: CUfunction, params: *mut *mut c_void, extra: *mut *mut c_void) => launch_kernel_ex::<true>;
            cuLaunchCooperativeKernel(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, shared: c_uint, stream: CUstream, params: *mut *mut c_void) => launch_cooperative::<false>;
            cuLaunchCooperativeKernel_ptsz(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, shared: c_uint, stream: CUstream, params: *mut *mut c_void) => launch_cooperative::<true>;
            cuGraphLaunch(exec: CUgraphExec, stream: CUstream) => graph_launch::<false>;
            cuGraphLaunch_ptsz(exec: CUgraphExec, stream: CUstream) => graph_launch::<true>;
            nvmlDeviceGetMemoryInfo(device: nvmlDevice_t, memory: *mut nvmlMemory_t) => nvml_memory_info;
            nvmlDeviceGetMemoryInfo_v2(device: nvmlDevice_t, memory: *mut nvmlMemory_v2_t) => nvml_memory_info;
        }
    };
}
pub(crate) use for_each_entry_point;

macro_rules! define_sym {
    ($( $name:ident ( $($arg:ident : $ty:ty),* $(,)? ) => $handler:path ; )*) => {
        /// A wrapped entry point (one ABI variant).
        #[allow(non_camel_case_types)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum Sym { $($name,)* }

        impl Sym {
            pub const ALL: &'static [Sym] = &[$(Sym::$name,)*];
            pub const COUNT: usize = Sym::ALL.len();

            pub fn name(self) -> &'static str {
                match self { $(Sym::$name => stringify!($name),)* }
            }

            pub fn c_name(self) -> &'static CStr {
                match self {
                    $(Sym::$name => match CStr::from_bytes_with_nul(concat!(stringify!($name), "\0").as_bytes()) {
                        Ok(name) => name,
                        Err(_) => unreachable!(),
                    },)*
                }
            }

            pub fn from_name(name: &[u8]) -> Option<Sym> {
                $( if name == stringify!($name).as_bytes() { return Some(Sym::$name); } )*
                None
            }
        }

        /// The real functions' types, by the name of the variant.
        #[allow(non_camel_case_types)]
        pub mod pfn {
            use super::*;
            $( pub type $name = unsafe extern "C" fn($($ty),*) -> c_int; )*
        }
    };
}

for_each_entry_point!(define_sym);

impl Sym {
    /// A launch: it goes through the compute limiter's gate.
    pub fn is_launch(self) -> bool {
        matches!(
            self,
            Sym::cuLaunchKernel
                | Sym::cuLaunchKernel_ptsz
                | Sym::cuLaunchKernelEx
                | Sym::cuLaunchKernelEx_ptsz
                | Sym::cuLaunchCooperativeKernel
                | Sym::cuLaunchCooperativeKernel_ptsz
                | Sym::cuGraphLaunch
                | Sym::cuGraphLaunch_ptsz
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_launches_are_the_four_launch_functions_in_both_stream_forms() {
        let launches: Vec<&str> = Sym::ALL
            .iter()
            .filter(|s| s.is_launch())
            .map(|s| s.name())
            .collect();
        assert_eq!(launches.len(), 8, "{launches:?}");
        assert!(launches
            .iter()
            .all(|n| n.starts_with("cuLaunch") || n.starts_with("cuGraphLaunch")));
    }

    #[test]
    fn every_entry_point_is_named_and_found_by_its_name() {
        for sym in Sym::ALL {
            assert_eq!(Sym::from_name(sym.name().as_bytes()), Some(*sym));
            assert_eq!(sym.c_name().to_bytes(), sym.name().as_bytes());
        }
        // Every variant the cuGetProcAddress tables know is wrapped.
        for family in crate::symbols::FAMILIES {
            for variant in family.variants {
                assert!(
                    Sym::from_name(variant.name.as_bytes()).is_some(),
                    "{}",
                    variant.name
                );
            }
        }
    }
}

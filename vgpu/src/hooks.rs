//! The wrappers: one per (function, ABI variant, stream variant), each calling its own real
//! pointer. Each exists twice: exported under the driver's name (found by `dlsym` on the driver's
//! handle through our `dlsym`, by programs linked against the driver, and by `cuGetProcAddress`
//! when the driver returns its exported function), and unexported for an address
//! `cuGetProcAddress` returned that is not an exported symbol (see `symbols.rs`).
//!
//! Every wrapper runs its body inside `catch_unwind`: a panic of ours becomes
//! `CUDA_ERROR_UNKNOWN` / `NVML_ERROR_UNKNOWN` and a stderr line, never an abort of the program.
//! No lock of ours is held while the real driver runs.

#![allow(clippy::missing_safety_doc, clippy::too_many_arguments)]

use crate::accounting::{array_bytes, mipmapped_bytes, Charged};
use crate::cuda::*;
use crate::driver;
use crate::gate;
use crate::interpose::{library_of, real, set_procaddr_real, warn_once, Origin, CUDA, NVML};
use crate::process::{self, Process};
use crate::symbols;
use crate::view::{clamp_u32, MemoryView};
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::panic::AssertUnwindSafe;

macro_rules! entry_points {
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

            pub fn exported_wrapper(self) -> usize {
                match self { $(Sym::$name => exported::$name as *const () as usize,)* }
            }

            pub fn procaddr_wrapper(self) -> usize {
                match self { $(Sym::$name => procaddr::$name as *const () as usize,)* }
            }
        }

        /// The real functions' types, by the name of the variant.
        #[allow(non_camel_case_types)]
        pub mod pfn {
            use super::*;
            $( pub type $name = unsafe extern "C" fn($($ty),*) -> c_int; )*
        }

        /// Exported under the driver's names.
        pub mod exported {
            use super::*;
            $(
                #[no_mangle]
                #[allow(non_snake_case)]
                pub unsafe extern "C" fn $name($($arg: $ty),*) -> c_int {
                    call(Sym::$name, Origin::Export, |addr| {
                        // SAFETY: addr is the driver's function of this variant, of this type.
                        let real: pfn::$name = unsafe { std::mem::transmute::<usize, pfn::$name>(addr) };
                        unsafe { $handler(real, $($arg),*) }
                    })
                }
            )*
        }

        /// For addresses `cuGetProcAddress` returned that match no exported symbol.
        pub mod procaddr {
            use super::*;
            $(
                #[allow(non_snake_case)]
                pub unsafe extern "C" fn $name($($arg: $ty),*) -> c_int {
                    call(Sym::$name, Origin::ProcAddr, |addr| {
                        // SAFETY: as above; the ABI was chosen by version and flags (symbols.rs).
                        let real: pfn::$name = unsafe { std::mem::transmute::<usize, pfn::$name>(addr) };
                        unsafe { $handler(real, $($arg),*) }
                    })
                }
            )*
        }
    };
}

/// Runs a wrapper's body with the real function's address, turning a panic into an error code.
fn call(sym: Sym, origin: Origin, body: impl FnOnce(usize) -> c_int) -> c_int {
    let nvml = std::ptr::eq(library_of(sym), &NVML);
    let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| match real(sym, origin) {
        Some(addr) => body(addr),
        None => {
            warn_once(sym, "is not in the driver library; the call fails");
            if nvml {
                13 // NVML_ERROR_FUNCTION_NOT_FOUND
            } else {
                CUDA_ERROR_NOT_FOUND
            }
        }
    }));
    outcome.unwrap_or_else(|_| {
        log_error!(
            "internal error in the {} wrapper; the call returns an error instead",
            sym.name()
        );
        if nvml {
            NVML_ERROR_UNKNOWN
        } else {
            CUDA_ERROR_UNKNOWN
        }
    })
}

entry_points! {
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
    cuLaunchKernel(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, shared: c_uint, stream: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void) => launch_kernel;
    cuLaunchKernel_ptsz(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, shared: c_uint, stream: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void) => launch_kernel;
    cuLaunchKernelEx(config: *const CUlaunchConfigHead, f: CUfunction, params: *mut *mut c_void, extra: *mut *mut c_void) => launch_kernel_ex;
    cuLaunchKernelEx_ptsz(config: *const CUlaunchConfigHead, f: CUfunction, params: *mut *mut c_void, extra: *mut *mut c_void) => launch_kernel_ex;
    cuLaunchCooperativeKernel(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, shared: c_uint, stream: CUstream, params: *mut *mut c_void) => launch_cooperative;
    cuLaunchCooperativeKernel_ptsz(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, shared: c_uint, stream: CUstream, params: *mut *mut c_void) => launch_cooperative;
    cuGraphLaunch(exec: CUgraphExec, stream: CUstream) => graph_launch;
    cuGraphLaunch_ptsz(exec: CUgraphExec, stream: CUstream) => graph_launch;
    nvmlDeviceGetMemoryInfo(device: nvmlDevice_t, memory: *mut nvmlMemory_t) => nvml_memory_info;
    nvmlDeviceGetMemoryInfo_v2(device: nvmlDevice_t, memory: *mut nvmlMemory_v2_t) => nvml_memory_info;
}

// ---- initialisation and lookup -------------------------------------------------------------

unsafe fn init(real: pfn::cuInit, flags: c_uint) -> CUresult {
    if process::get().is_none() {
        return CUDA_ERROR_NOT_INITIALIZED;
    }
    real(flags)
}

unsafe fn get_proc_address(
    real: pfn::cuGetProcAddress,
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
) -> CUresult {
    if process::get().is_none() {
        return CUDA_ERROR_NOT_INITIALIZED;
    }
    let rc = real(symbol, pfn, version, flags);
    substitute(real as usize, rc, symbol, pfn, version, flags);
    rc
}

unsafe fn get_proc_address_v2(
    real: pfn::cuGetProcAddress_v2,
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
    status: *mut c_int,
) -> CUresult {
    if process::get().is_none() {
        return CUDA_ERROR_NOT_INITIALIZED;
    }
    let rc = real(symbol, pfn, version, flags, status);
    substitute(real as usize, rc, symbol, pfn, version, flags);
    rc
}

/// Replaces the function `cuGetProcAddress` returned with our wrapper of the same variant. The
/// driver keeps its choice (version, per-thread stream): we only recognise it.
unsafe fn substitute(
    real_gpa: usize,
    rc: CUresult,
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
) {
    if rc != CUDA_SUCCESS || symbol.is_null() || pfn.is_null() || (*pfn).is_null() {
        return;
    }
    CUDA.keep_containing(real_gpa);
    let Some(family) = symbols::family_of(CStr::from_ptr(symbol).to_bytes()) else {
        return;
    };
    let addr = *pfn as usize;
    let variants = || {
        family
            .variants
            .iter()
            .filter_map(|v| Sym::from_name(v.name.as_bytes()))
    };
    for sym in variants() {
        if real(sym, Origin::Export) == Some(addr) {
            *pfn = sym.exported_wrapper() as *mut c_void;
            return;
        }
    }
    match symbols::select(family, version, flags).and_then(|v| Sym::from_name(v.name.as_bytes())) {
        Some(sym) if set_procaddr_real(sym, addr) => {
            log_debug!("cuGetProcAddress({}, {version}, {flags}) returned no exported symbol; wrapped as {}", family.base, sym.name());
            *pfn = sym.procaddr_wrapper() as *mut c_void;
        }
        Some(sym) => warn_once(
            sym,
            "came back from cuGetProcAddress at two addresses; the second is not limited",
        ),
        None => {
            if let Some(first) = variants().next() {
                warn_once(first, &format!("has no known ABI at CUDA version {version}; cuGetProcAddress's function is returned unwrapped"));
            }
        }
    }
}

// ---- memory views ---------------------------------------------------------------------------

/// A byte count as an entry point writes it: `size_t`, or 32 bits in the pre-3.2 forms (the view
/// is clamped there, never wrapped).
trait Bytes: Copy {
    fn get(self) -> u64;
    fn put(bytes: u64) -> Self;
}

impl Bytes for usize {
    fn get(self) -> u64 {
        self as u64
    }
    fn put(bytes: u64) -> usize {
        bytes as usize
    }
}

impl Bytes for c_uint {
    fn get(self) -> u64 {
        self as u64
    }
    fn put(bytes: u64) -> c_uint {
        clamp_u32(bytes)
    }
}

/// `cuMemGetInfo[_v2]`: the current device's view under its limit.
unsafe fn mem_get_info<T: Bytes>(
    real: unsafe extern "C" fn(*mut T, *mut T) -> CUresult,
    free: *mut T,
    total: *mut T,
) -> CUresult {
    let Some(p) = process::get() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    let rc = real(free, total);
    if rc == CUDA_SUCCESS && p.limits_memory() && !free.is_null() && !total.is_null() {
        if let Some(view) = p
            .current_device()
            .and_then(|(_, i)| p.view(i?, (*free).get()))
        {
            *free = T::put(view.free);
            *total = T::put(view.total);
        }
    }
    rc
}

/// `cuDeviceTotalMem[_v2]`: the limit.
unsafe fn device_total_mem<T: Bytes>(
    real: unsafe extern "C" fn(*mut T, CUdevice) -> CUresult,
    bytes: *mut T,
    device: CUdevice,
) -> CUresult {
    let Some(p) = process::get() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    let rc = real(bytes, device);
    if rc == CUDA_SUCCESS && p.limits_memory() && !bytes.is_null() {
        if let Some(limit) = p.device_index(device).and_then(|i| p.memory_limit(i)) {
            *bytes = T::put(limit);
        }
    }
    rc
}

/// NVML's memory structs, v1 and v2.
trait NvmlMemory {
    fn free(&self) -> u64;
    fn show(&mut self, view: MemoryView);
}

impl NvmlMemory for nvmlMemory_t {
    fn free(&self) -> u64 {
        self.free
    }
    fn show(&mut self, view: MemoryView) {
        (self.total, self.free, self.used) = (view.total, view.free, view.used);
    }
}

impl NvmlMemory for nvmlMemory_v2_t {
    fn free(&self) -> u64 {
        self.free
    }
    fn show(&mut self, view: MemoryView) {
        (self.total, self.free, self.used) = (view.total, view.free, view.used);
        // The driver's reservation is part of the card, not of the limit: with total set to the
        // limit, used + free must add up to it.
        self.reserved = 0;
    }
}

/// `nvmlDeviceGetMemoryInfo[_v2]`: the device's view under its limit.
unsafe fn nvml_memory_info<M: NvmlMemory>(
    real: unsafe extern "C" fn(nvmlDevice_t, *mut M) -> nvmlReturn_t,
    device: nvmlDevice_t,
    memory: *mut M,
) -> nvmlReturn_t {
    let Some(p) = process::get() else {
        return NVML_ERROR_UNINITIALIZED;
    };
    let rc = real(device, memory);
    if rc == NVML_SUCCESS && p.limits_memory() && !memory.is_null() {
        if let Some(view) = p
            .nvml_device_index(device)
            .and_then(|i| p.view(i, (*memory).free()))
        {
            (*memory).show(view);
        }
    }
    rc
}

// ---- allocations ----------------------------------------------------------------------------

/// Reserve, call, then record (success) or give back (failure).
fn allocate(
    p: &Process,
    device: Option<usize>,
    bytes: u64,
    call: impl FnOnce() -> CUresult,
    record: impl FnOnce(Charged),
) -> CUresult {
    let charge = match p.reserve(device, bytes) {
        Ok(charge) => charge,
        Err(rc) => return rc,
    };
    let rc = call();
    match (rc, charge) {
        (CUDA_SUCCESS, Some(charge)) => record(charge),
        (_, Some(charge)) => p.release(charge),
        _ => {}
    }
    rc
}

fn current_index(p: &Process) -> Option<usize> {
    p.current_device().and_then(|(_, index)| index)
}

/// Frees through the driver (an allocation we must undo), by the exported `_v2` function.
unsafe fn free_real(ptr: CUdeviceptr) {
    if let Some(addr) = real(Sym::cuMemFree_v2, Origin::Export) {
        let free: pfn::cuMemFree_v2 = std::mem::transmute::<usize, pfn::cuMemFree_v2>(addr);
        free(ptr);
    }
}

/// `cuMemAlloc[_v2]`.
unsafe fn mem_alloc<P: Copy + Into<u64>, S: Bytes>(
    real: unsafe extern "C" fn(*mut P, S) -> CUresult,
    dptr: *mut P,
    bytes: S,
) -> CUresult {
    let Some(p) = process::get() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    if !p.limits_memory() {
        return real(dptr, bytes);
    }
    allocate(
        p,
        current_index(p),
        bytes.get(),
        || real(dptr, bytes),
        |c| p.record_pointer((*dptr).into(), c),
    )
}

unsafe fn mem_alloc_managed(
    real: pfn::cuMemAllocManaged,
    dptr: *mut CUdeviceptr,
    bytes: usize,
    flags: c_uint,
) -> CUresult {
    let Some(p) = process::get() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    if !p.limits_memory() {
        return real(dptr, bytes, flags);
    }
    // Policy: managed memory is charged in full to the current device, though the driver may
    // keep some of it on the host (it can migrate there at any time, unseen).
    allocate(
        p,
        current_index(p),
        bytes as u64,
        || real(dptr, bytes, flags),
        |c| p.record_pointer(*dptr, c),
    )
}

/// The pitched allocations: `width * height` is checked before the call; the driver's pitch is
/// only known after, and `pitch * height` is what is charged (undone if that passes the limit).
unsafe fn pitched(
    p: &Process,
    width: u64,
    height: u64,
    call: impl FnOnce() -> CUresult,
    result: impl Fn() -> (CUdeviceptr, u64),
    free: impl FnOnce(CUdeviceptr),
) -> CUresult {
    let Some(requested) = width.checked_mul(height) else {
        return call();
    };
    let charge = match p.reserve(current_index(p), requested) {
        Ok(charge) => charge,
        Err(rc) => return rc,
    };
    let rc = call();
    let Some(charge) = charge else { return rc };
    if rc != CUDA_SUCCESS {
        p.release(charge);
        return rc;
    }
    let (ptr, pitch) = result();
    match p.adjust(charge, pitch.saturating_mul(height)) {
        Ok(exact) => {
            p.record_pointer(ptr, exact);
            rc
        }
        Err(oom) => {
            free(ptr);
            p.release(charge);
            oom
        }
    }
}

unsafe fn mem_alloc_pitch(
    real: pfn::cuMemAllocPitch_v2,
    dptr: *mut CUdeviceptr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    element: c_uint,
) -> CUresult {
    let Some(p) = process::get() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    if !p.limits_memory() || dptr.is_null() || pitch.is_null() {
        return real(dptr, pitch, width, height, element);
    }
    pitched(
        p,
        width as u64,
        height as u64,
        || real(dptr, pitch, width, height, element),
        || (*dptr, *pitch as u64),
        |ptr| free_real(ptr),
    )
}

unsafe fn mem_alloc_pitch_v1(
    real: pfn::cuMemAllocPitch,
    dptr: *mut CUdeviceptr_v1,
    pitch: *mut c_uint,
    width: c_uint,
    height: c_uint,
    element: c_uint,
) -> CUresult {
    let Some(p) = process::get() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    if !p.limits_memory() || dptr.is_null() || pitch.is_null() {
        return real(dptr, pitch, width, height, element);
    }
    let free_v1 = |ptr: CUdeviceptr| {
        if let Some(addr) = crate::interpose::real(Sym::cuMemFree, Origin::Export) {
            let free: pfn::cuMemFree = std::mem::transmute::<usize, pfn::cuMemFree>(addr);
            free(ptr as CUdeviceptr_v1);
        }
    };
    pitched(
        p,
        width as u64,
        height as u64,
        || real(dptr, pitch, width, height, element),
        || (*dptr as u64, *pitch as u64),
        free_v1,
    )
}

/// Frees: the driver first; only a pointer it freed and that we charged is uncharged.
fn uncharge_pointer(p: &Process, rc: CUresult, ptr: CUdeviceptr) -> CUresult {
    if rc == CUDA_SUCCESS {
        if let Some(charge) = p.with_allocations(|a| a.remove_pointer(ptr)) {
            p.release(charge);
        }
    }
    rc
}

/// `cuMemFree[_v2]`.
unsafe fn mem_free<P: Copy + Into<u64>>(
    real: unsafe extern "C" fn(P) -> CUresult,
    ptr: P,
) -> CUresult {
    let Some(p) = process::get() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    uncharge_pointer(p, real(ptr), ptr.into())
}

unsafe fn mem_free_async(
    real: pfn::cuMemFreeAsync,
    ptr: CUdeviceptr,
    stream: CUstream,
) -> CUresult {
    let Some(p) = process::get() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    // Uncharged when the free is enqueued: from then on the memory is the pool's to reuse.
    uncharge_pointer(p, real(ptr, stream), ptr)
}

unsafe fn mem_alloc_async(
    real: pfn::cuMemAllocAsync,
    dptr: *mut CUdeviceptr,
    bytes: usize,
    stream: CUstream,
) -> CUresult {
    let Some(p) = process::get() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    if !p.limits_memory() {
        return real(dptr, bytes, stream);
    }
    let device = p.stream_device(stream).and_then(|(_, index)| index);
    allocate(
        p,
        device,
        bytes as u64,
        || real(dptr, bytes, stream),
        |c| p.record_pointer(*dptr, c),
    )
}

unsafe fn mem_alloc_from_pool_async(
    real: pfn::cuMemAllocFromPoolAsync,
    dptr: *mut CUdeviceptr,
    bytes: usize,
    pool: CUmemoryPool,
    stream: CUstream,
) -> CUresult {
    let Some(p) = process::get() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    if !p.limits_memory() {
        return real(dptr, bytes, pool, stream);
    }
    // The pool's device when we saw the pool made or handed out; else the stream's.
    let device = match p.with_allocations(|a| a.pool(pool as usize)) {
        Some(known) => known,
        None => p.stream_device(stream).and_then(|(_, index)| index),
    };
    allocate(
        p,
        device,
        bytes as u64,
        || real(dptr, bytes, pool, stream),
        |c| p.record_pointer(*dptr, c),
    )
}

unsafe fn mem_pool_create(
    real: pfn::cuMemPoolCreate,
    pool: *mut CUmemoryPool,
    props: *const CUmemPoolPropsHead,
) -> CUresult {
    let Some(p) = process::get() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    let rc = real(pool, props);
    if rc == CUDA_SUCCESS && p.limits_memory() && !pool.is_null() && !props.is_null() {
        let location = (*props).location;
        let device = (location.kind == CU_MEM_LOCATION_TYPE_DEVICE)
            .then(|| p.device_index(location.id))
            .flatten();
        p.with_allocations(|a| a.set_pool(*pool as usize, device));
    }
    rc
}

unsafe fn mem_pool_destroy(real: pfn::cuMemPoolDestroy, pool: CUmemoryPool) -> CUresult {
    let Some(p) = process::get() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    let rc = real(pool);
    if rc == CUDA_SUCCESS {
        p.with_allocations(|a| a.forget_pool(pool as usize));
    }
    rc
}

unsafe fn device_get_mem_pool(
    real: pfn::cuDeviceGetMemPool,
    pool: *mut CUmemoryPool,
    device: CUdevice,
) -> CUresult {
    let Some(p) = process::get() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    let rc = real(pool, device);
    if rc == CUDA_SUCCESS && p.limits_memory() && !pool.is_null() {
        let index = p.device_index(device);
        p.with_allocations(|a| a.set_pool(*pool as usize, index));
    }
    rc
}

unsafe fn mem_create(
    real: pfn::cuMemCreate,
    handle: *mut CUmemGenericAllocationHandle,
    size: usize,
    prop: *const CUmemAllocationPropHead,
    flags: u64,
) -> CUresult {
    let Some(p) = process::get() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    if !p.limits_memory() || prop.is_null() || handle.is_null() {
        return real(handle, size, prop, flags);
    }
    let location = (*prop).location;
    // Only device memory counts; host and host-NUMA locations are not the card's.
    let device = (location.kind == CU_MEM_LOCATION_TYPE_DEVICE)
        .then(|| p.device_index(location.id))
        .flatten();
    allocate(
        p,
        device,
        size as u64,
        || real(handle, size, prop, flags),
        |c| p.with_allocations(|a| a.add_handle(*handle, c)),
    )
}

unsafe fn mem_release(real: pfn::cuMemRelease, handle: CUmemGenericAllocationHandle) -> CUresult {
    let Some(p) = process::get() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    let rc = real(handle);
    if rc == CUDA_SUCCESS {
        if let Some(charge) = p.with_allocations(|a| a.remove_handle(handle)) {
            p.release(charge);
        }
    }
    rc
}

// ---- arrays ---------------------------------------------------------------------------------

#[derive(Clone, Copy)]
enum ArrayKind {
    Array,
    Mipmapped,
}

/// Arrays: checked before with the size the descriptor implies, charged after with the size the
/// driver reports (`cu*GetMemoryRequirements`; a real driver answers only for deferred-mapping
/// arrays, which we do not charge at all, so there the descriptor's size stays).
unsafe fn create_array(
    p: &Process,
    kind: ArrayKind,
    estimate: Option<u64>,
    call: impl FnOnce() -> CUresult,
    handle: impl Fn() -> usize,
) -> CUresult {
    let Some((cu_device, index)) = p.current_device() else {
        return call();
    };
    let charge = match p.reserve(index, estimate.unwrap_or(0)) {
        Ok(charge) => charge,
        Err(rc) => return rc,
    };
    let rc = call();
    let Some(charge) = charge else { return rc };
    if rc != CUDA_SUCCESS {
        p.release(charge);
        return rc;
    }
    let array = handle();
    let mut requirements = CUDA_ARRAY_MEMORY_REQUIREMENTS::default();
    let reported = match kind {
        ArrayKind::Array => unsafe {
            driver::cuArrayGetMemoryRequirements(&mut requirements, array as CUarray, cu_device)
        },
        ArrayKind::Mipmapped => unsafe {
            driver::cuMipmappedArrayGetMemoryRequirements(
                &mut requirements,
                array as CUmipmappedArray,
                cu_device,
            )
        },
    };
    let exact = if reported == Some(CUDA_SUCCESS) {
        p.adjust(charge, requirements.size as u64)
    } else {
        Ok(charge)
    };
    match exact {
        Ok(exact) => {
            let context = p.current_context();
            p.with_allocations(|a| match kind {
                ArrayKind::Array => a.add_array(array, exact, context),
                ArrayKind::Mipmapped => a.add_mipmapped(array, exact, context),
            });
            rc
        }
        Err(oom) => {
            let destroy = match kind {
                ArrayKind::Array => Sym::cuArrayDestroy,
                ArrayKind::Mipmapped => Sym::cuMipmappedArrayDestroy,
            };
            if let Some(addr) = real(destroy, Origin::Export) {
                let destroy: pfn::cuArrayDestroy =
                    std::mem::transmute::<usize, pfn::cuArrayDestroy>(addr);
                destroy(array as *mut c_void);
            }
            p.release(charge);
            oom
        }
    }
}

/// What an array descriptor says, whatever its ABI (`CUDA_ARRAY_DESCRIPTOR`, the 3-D one, and
/// their 32-bit `_v1` forms): width, height, depth, format, channels, flags.
trait Descriptor {
    fn shape(&self) -> (u64, u64, u64, c_uint, c_uint, c_uint);
}

impl Descriptor for CUDA_ARRAY_DESCRIPTOR {
    fn shape(&self) -> (u64, u64, u64, c_uint, c_uint, c_uint) {
        let (w, h) = (self.width as u64, self.height as u64);
        (w, h, 0, self.format, self.num_channels, 0)
    }
}

impl Descriptor for CUDA_ARRAY_DESCRIPTOR_v1 {
    fn shape(&self) -> (u64, u64, u64, c_uint, c_uint, c_uint) {
        let (w, h) = (self.width as u64, self.height as u64);
        (w, h, 0, self.format, self.num_channels, 0)
    }
}

impl Descriptor for CUDA_ARRAY3D_DESCRIPTOR {
    fn shape(&self) -> (u64, u64, u64, c_uint, c_uint, c_uint) {
        let (w, h, d) = (self.width as u64, self.height as u64, self.depth as u64);
        (w, h, d, self.format, self.num_channels, self.flags)
    }
}

impl Descriptor for CUDA_ARRAY3D_DESCRIPTOR_v1 {
    fn shape(&self) -> (u64, u64, u64, c_uint, c_uint, c_uint) {
        let (w, h, d) = (self.width as u64, self.height as u64, self.depth as u64);
        (w, h, d, self.format, self.num_channels, self.flags)
    }
}

/// Every array creation: `levels` is a mipmapped array's. Deferred-mapping arrays have no memory
/// of their own (it is `cuMemCreate` memory mapped onto them, charged there): passed through.
unsafe fn array_create<D: Descriptor>(
    kind: ArrayKind,
    handle: *mut CUarray,
    desc: *const D,
    levels: Option<c_uint>,
    call: impl FnOnce() -> CUresult,
) -> CUresult {
    let Some(p) = process::get() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    if !p.limits_memory() || desc.is_null() || handle.is_null() {
        return call();
    }
    let (width, height, depth, format, channels, flags) = (*desc).shape();
    if flags & CUDA_ARRAY3D_DEFERRED_MAPPING != 0 {
        return call();
    }
    let estimate = match levels {
        Some(levels) => mipmapped_bytes(width, height, depth, format, channels, levels),
        None => array_bytes(width, height, depth, format, channels),
    };
    create_array(p, kind, estimate, call, || *handle as usize)
}

/// `cuArrayCreate[_v2]` and `cuArray3DCreate[_v2]`.
unsafe fn any_array_create<D: Descriptor>(
    real: unsafe extern "C" fn(*mut CUarray, *const D) -> CUresult,
    handle: *mut CUarray,
    desc: *const D,
) -> CUresult {
    array_create(ArrayKind::Array, handle, desc, None, || real(handle, desc))
}

unsafe fn mipmapped_array_create(
    real: pfn::cuMipmappedArrayCreate,
    handle: *mut CUmipmappedArray,
    desc: *const CUDA_ARRAY3D_DESCRIPTOR,
    levels: c_uint,
) -> CUresult {
    array_create(ArrayKind::Mipmapped, handle, desc, Some(levels), || {
        real(handle, desc, levels)
    })
}

/// `cuArrayDestroy` and `cuMipmappedArrayDestroy`: uncharges what the driver destroyed.
unsafe fn any_array_destroy(
    real: unsafe extern "C" fn(*mut c_void) -> CUresult,
    array: *mut c_void,
    kind: ArrayKind,
) -> CUresult {
    let Some(p) = process::get() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    let rc = real(array);
    if rc == CUDA_SUCCESS {
        let charge = p.with_allocations(|a| match kind {
            ArrayKind::Array => a.remove_array(array as usize),
            ArrayKind::Mipmapped => a.remove_mipmapped(array as usize),
        });
        if let Some(charge) = charge {
            p.release(charge);
        }
    }
    rc
}

unsafe fn array_destroy(real: pfn::cuArrayDestroy, array: CUarray) -> CUresult {
    any_array_destroy(real, array, ArrayKind::Array)
}

unsafe fn mipmapped_array_destroy(
    real: pfn::cuMipmappedArrayDestroy,
    array: CUmipmappedArray,
) -> CUresult {
    any_array_destroy(real, array, ArrayKind::Mipmapped)
}

// ---- contexts (context memory, host PID) ----------------------------------------------------

unsafe fn with_context_probe(
    device: CUdevice,
    primary: bool,
    call: impl FnOnce() -> CUresult,
) -> CUresult {
    let Some(p) = process::get() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    if p.file().is_none() {
        return call();
    }
    let probe = p.before_context(device, primary);
    let rc = call();
    if rc == CUDA_SUCCESS {
        if let Some(probe) = probe {
            p.after_context(probe);
        }
    }
    rc
}

unsafe fn primary_ctx_retain(
    real: pfn::cuDevicePrimaryCtxRetain,
    ctx: *mut CUcontext,
    device: CUdevice,
) -> CUresult {
    let rc = with_context_probe(device, true, || real(ctx, device));
    if rc == CUDA_SUCCESS && !ctx.is_null() {
        if let Some(p) = process::get() {
            p.remember_primary(device, *ctx as usize);
        }
    }
    rc
}

/// A primary context's reset destroys it with everything allocated in it.
unsafe fn primary_ctx_reset(real: pfn::cuDevicePrimaryCtxReset_v2, device: CUdevice) -> CUresult {
    let Some(p) = process::get() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    let rc = real(device);
    if rc == CUDA_SUCCESS {
        p.primary_destroyed(device);
    }
    rc
}

/// The last release of a primary context destroys it (the driver says so through its state).
unsafe fn primary_ctx_release(
    real: pfn::cuDevicePrimaryCtxRelease_v2,
    device: CUdevice,
) -> CUresult {
    let Some(p) = process::get() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    let rc = real(device);
    if rc == CUDA_SUCCESS {
        let (mut flags, mut active) = (0, 0);
        let state = unsafe { driver::cuDevicePrimaryCtxGetState(device, &mut flags, &mut active) };
        if state == Some(CUDA_SUCCESS) && active == 0 {
            p.primary_destroyed(device);
        }
    }
    rc
}

unsafe fn ctx_destroy(real: pfn::cuCtxDestroy_v2, ctx: CUcontext) -> CUresult {
    let Some(p) = process::get() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    let rc = real(ctx);
    if rc == CUDA_SUCCESS {
        p.context_destroyed(ctx as usize);
    }
    rc
}

unsafe fn ctx_create(
    real: pfn::cuCtxCreate_v2,
    ctx: *mut CUcontext,
    flags: c_uint,
    device: CUdevice,
) -> CUresult {
    with_context_probe(device, false, || real(ctx, flags, device))
}

unsafe fn ctx_create_v3(
    real: pfn::cuCtxCreate_v3,
    ctx: *mut CUcontext,
    params: *mut c_void,
    count: c_int,
    flags: c_uint,
    device: CUdevice,
) -> CUresult {
    with_context_probe(device, false, || real(ctx, params, count, flags, device))
}

unsafe fn ctx_create_v4(
    real: pfn::cuCtxCreate_v4,
    ctx: *mut CUcontext,
    params: *mut c_void,
    flags: c_uint,
    device: CUdevice,
) -> CUresult {
    with_context_probe(device, false, || real(ctx, params, flags, device))
}

// ---- launches -------------------------------------------------------------------------------

unsafe fn launch_kernel(
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

unsafe fn launch_kernel_ex(
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

unsafe fn launch_cooperative(
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

unsafe fn graph_launch(real: pfn::cuGraphLaunch, exec: CUgraphExec, stream: CUstream) -> CUresult {
    if let Err(rc) = gate::before_launch(stream) {
        return rc;
    }
    real(exec, stream)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    // These tests run in the test binary, where no libcuda is loaded: no exported symbol can match
    // a returned address, so `substitute` takes the version/flags route. Each test uses its own
    // entry points: a wrapper's cuGetProcAddress target is recorded once per process.

    static CALLS: AtomicUsize = AtomicUsize::new(0);

    unsafe extern "C" fn fake_release(handle: CUmemGenericAllocationHandle) -> CUresult {
        CALLS.fetch_add(handle as usize, Ordering::SeqCst);
        CUDA_SUCCESS
    }

    unsafe extern "C" fn fake_launch_ptsz(exec: CUgraphExec, _stream: CUstream) -> CUresult {
        CALLS.fetch_add(exec as usize, Ordering::SeqCst);
        CUDA_SUCCESS
    }

    unsafe extern "C" fn fake_other(_: CUmemGenericAllocationHandle) -> CUresult {
        CUDA_ERROR_UNKNOWN
    }

    unsafe fn substituted(symbol: &CStr, returned: usize, version: c_int, flags: u64) -> usize {
        let mut pfn = returned as *mut c_void;
        substitute(
            fake_other as *const () as usize,
            CUDA_SUCCESS,
            symbol.as_ptr(),
            &mut pfn,
            version,
            flags,
        );
        pfn as usize
    }

    #[test]
    fn an_address_matching_no_export_gets_the_wrapper_of_the_abi_the_version_selects() {
        unsafe {
            let wrapped = substituted(
                c"cuMemRelease",
                fake_release as *const () as usize,
                12090,
                0,
            );
            assert_eq!(wrapped, Sym::cuMemRelease.procaddr_wrapper());
            // The wrapper calls the address the driver returned.
            let before = CALLS.load(Ordering::SeqCst);
            let call: pfn::cuMemRelease = std::mem::transmute::<usize, pfn::cuMemRelease>(wrapped);
            assert_eq!(call(5), CUDA_SUCCESS);
            assert_eq!(CALLS.load(Ordering::SeqCst) - before, 5);
            // Asked again with another address for the same ABI: never two targets for one wrapper.
            let other = substituted(c"cuMemRelease", fake_other as *const () as usize, 12090, 0);
            assert_eq!(
                other, fake_other as *const () as usize,
                "passed through unwrapped"
            );
        }
    }

    #[test]
    fn the_per_thread_flag_selects_the_ptsz_wrapper() {
        unsafe {
            let flags = CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
            let wrapped = substituted(
                c"cuGraphLaunch",
                fake_launch_ptsz as *const () as usize,
                12090,
                flags,
            );
            assert_eq!(wrapped, Sym::cuGraphLaunch_ptsz.procaddr_wrapper());
            let before = CALLS.load(Ordering::SeqCst);
            let call: pfn::cuGraphLaunch_ptsz =
                std::mem::transmute::<usize, pfn::cuGraphLaunch_ptsz>(wrapped);
            assert_eq!(call(7 as CUgraphExec, std::ptr::null_mut()), CUDA_SUCCESS);
            assert_eq!(CALLS.load(Ordering::SeqCst) - before, 7);
        }
    }

    #[test]
    fn an_unknown_version_or_symbol_is_passed_through_untouched() {
        unsafe {
            let address = fake_other as *const () as usize;
            // cuMemAllocAsync did not exist at CUDA 10.0: no ABI to guess.
            assert_eq!(substituted(c"cuMemAllocAsync", address, 10000, 0), address);
            assert_eq!(substituted(c"cuMemcpyHtoD_v2", address, 12090, 0), address);
        }
    }

    #[test]
    fn failed_lookups_are_left_alone() {
        // Drivers answer CUDA_ERROR_NOT_FOUND; cuda.h's comment says CUDA_SUCCESS with NULL.
        for rc in [CUDA_ERROR_NOT_FOUND, CUDA_SUCCESS] {
            unsafe {
                let mut pfn = std::ptr::null_mut();
                substitute(0, rc, c"cuMemFree".as_ptr(), &mut pfn, 12090, 0);
                assert!(pfn.is_null(), "{rc}");
                substitute(0, rc, c"cuMemAllocAsync".as_ptr(), &mut pfn, 11010, 0);
                assert!(pfn.is_null(), "{rc}");
            }
        }
    }

    #[test]
    fn every_wrapper_is_named_and_found_by_its_name() {
        for sym in Sym::ALL {
            assert_eq!(Sym::from_name(sym.name().as_bytes()), Some(*sym));
            assert_eq!(sym.c_name().to_bytes(), sym.name().as_bytes());
            assert_ne!(sym.exported_wrapper(), sym.procaddr_wrapper());
        }
        // Every variant the cuGetProcAddress tables know has a wrapper.
        for family in symbols::FAMILIES {
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

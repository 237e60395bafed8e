//! Memory: the views (`cuMemGetInfo`, `cuDeviceTotalMem`, NVML's memory info) and every
//! allocation path, charged before the driver is asked; contexts (their memory, the host PID).

use super::*;
use crate::accounting::{array_bytes, mipmapped_bytes, Charged};
use crate::driver;
use crate::limiter;
use crate::process::{self, Process};
use crate::view::{clamp_u32, MemoryView};

// ---- memory views ---------------------------------------------------------------------------

/// A byte count as an entry point writes it: `size_t`, or 32 bits in the pre-3.2 forms (the view
/// is clamped there, never wrapped).
pub(super) trait Bytes: Copy {
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
pub(super) unsafe fn mem_get_info<T: Bytes>(
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
pub(super) unsafe fn device_total_mem<T: Bytes>(
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
pub(super) trait NvmlMemory {
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
pub(super) unsafe fn nvml_memory_info<M: NvmlMemory>(
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
pub(super) unsafe fn mem_alloc<P: Copy + Into<u64>, S: Bytes>(
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

pub(super) unsafe fn mem_alloc_managed(
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
        |c| p.record_managed(*dptr, c),
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

pub(super) unsafe fn mem_alloc_pitch(
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

pub(super) unsafe fn mem_alloc_pitch_v1(
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
pub(super) unsafe fn mem_free<P: Copy + Into<u64>>(
    real: unsafe extern "C" fn(P) -> CUresult,
    ptr: P,
) -> CUresult {
    let Some(p) = process::get() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    uncharge_pointer(p, real(ptr), ptr.into())
}

pub(super) unsafe fn mem_free_async(
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

pub(super) unsafe fn mem_alloc_async(
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

pub(super) unsafe fn mem_alloc_from_pool_async(
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

pub(super) unsafe fn mem_pool_create(
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

pub(super) unsafe fn mem_pool_destroy(real: pfn::cuMemPoolDestroy, pool: CUmemoryPool) -> CUresult {
    let Some(p) = process::get() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    let rc = real(pool);
    if rc == CUDA_SUCCESS {
        p.with_allocations(|a| a.forget_pool(pool as usize));
    }
    rc
}

pub(super) unsafe fn device_get_mem_pool(
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

pub(super) unsafe fn mem_create(
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

pub(super) unsafe fn mem_release(
    real: pfn::cuMemRelease,
    handle: CUmemGenericAllocationHandle,
) -> CUresult {
    let Some(p) = process::get() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    let rc = real(handle);
    if rc == CUDA_SUCCESS {
        if let Some(charge) = p.with_allocations(|a| a.release_handle(handle)) {
            p.release(charge);
        }
    }
    rc
}

/// `cuMemMap`: a mapping keeps a released handle's memory alive (see `Allocations`).
pub(super) unsafe fn mem_map(
    real: pfn::cuMemMap,
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: CUmemGenericAllocationHandle,
    flags: u64,
) -> CUresult {
    let Some(p) = process::get() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    let rc = real(ptr, size, offset, handle, flags);
    if rc == CUDA_SUCCESS {
        p.with_allocations(|a| a.map_handle(ptr, size as u64, handle));
    }
    rc
}

/// `cuMemUnmap`: the last mapping of a released handle frees its memory, and its charge.
pub(super) unsafe fn mem_unmap(real: pfn::cuMemUnmap, ptr: CUdeviceptr, size: usize) -> CUresult {
    let Some(p) = process::get() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    let rc = real(ptr, size);
    if rc == CUDA_SUCCESS {
        for charge in p.with_allocations(|a| a.unmap_range(ptr, size as u64)) {
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
pub(super) trait Descriptor {
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
pub(super) unsafe fn any_array_create<D: Descriptor>(
    real: unsafe extern "C" fn(*mut CUarray, *const D) -> CUresult,
    handle: *mut CUarray,
    desc: *const D,
) -> CUresult {
    array_create(ArrayKind::Array, handle, desc, None, || real(handle, desc))
}

pub(super) unsafe fn mipmapped_array_create(
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

pub(super) unsafe fn array_destroy(real: pfn::cuArrayDestroy, array: CUarray) -> CUresult {
    any_array_destroy(real, array, ArrayKind::Array)
}

pub(super) unsafe fn mipmapped_array_destroy(
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

pub(super) unsafe fn primary_ctx_retain(
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
pub(super) unsafe fn primary_ctx_reset(
    real: pfn::cuDevicePrimaryCtxReset_v2,
    device: CUdevice,
) -> CUresult {
    let Some(p) = process::get() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    // The limiter's marks go first: its keeper must never query an event the reset frees.
    if let Some(context) = p.primary_context(device) {
        limiter::forget_context(context);
    }
    let rc = real(device);
    if rc == CUDA_SUCCESS {
        p.primary_destroyed(device);
    }
    rc
}

/// The last release of a primary context destroys it (the driver says so through its state).
pub(super) unsafe fn primary_ctx_release(
    real: pfn::cuDevicePrimaryCtxRelease_v2,
    device: CUdevice,
) -> CUresult {
    let Some(p) = process::get() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    // Whether this release is the last is known only afterwards: the marks of the primary
    // context are forgotten before any release (they only pace the holder's queue; a mark
    // forgotten early costs nothing), so that none is queried after the driver freed it.
    if let Some(context) = p.primary_context(device) {
        limiter::forget_context(context);
    }
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

pub(super) unsafe fn ctx_destroy(real: pfn::cuCtxDestroy_v2, ctx: CUcontext) -> CUresult {
    let Some(p) = process::get() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    limiter::forget_context(ctx as usize);
    let rc = real(ctx);
    if rc == CUDA_SUCCESS {
        p.context_destroyed(ctx as usize);
    }
    rc
}

pub(super) unsafe fn ctx_create(
    real: pfn::cuCtxCreate_v2,
    ctx: *mut CUcontext,
    flags: c_uint,
    device: CUdevice,
) -> CUresult {
    with_context_probe(device, false, || real(ctx, flags, device))
}

pub(super) unsafe fn ctx_create_v3(
    real: pfn::cuCtxCreate_v3,
    ctx: *mut CUcontext,
    params: *mut c_void,
    count: c_int,
    flags: c_uint,
    device: CUdevice,
) -> CUresult {
    with_context_probe(device, false, || real(ctx, params, count, flags, device))
}

pub(super) unsafe fn ctx_create_v4(
    real: pfn::cuCtxCreate_v4,
    ctx: *mut CUcontext,
    params: *mut c_void,
    flags: c_uint,
    device: CUdevice,
) -> CUresult {
    with_context_probe(device, false, || real(ctx, params, flags, device))
}

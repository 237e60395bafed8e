//! Contexts: the primary context of each device (retained and released, charged its fixed memory
//! while active), created contexts, and each thread's context stack.
#![allow(non_snake_case, clippy::missing_safety_doc)]

use crate::driver::{driver, entry, Driver};
use crate::exec::Stream;
use crate::ffi::*;
use gpupool_standin_device::Charge;
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

pub struct Ctx {
    pub handle: usize,
    pub ordinal: usize,
    pub physical: usize,
    pub primary: bool,
    /// A created context until destroyed; a primary context while retained.
    pub live: AtomicBool,
    pub retains: AtomicU32,
    pub flags: AtomicU32,
    /// The legacy default stream (NULL, `CU_STREAM_LEGACY`), made on first use.
    pub null_stream: OnceLock<Arc<Stream>>,
    /// Every stream of the context, for `cuCtxSynchronize`.
    pub streams: Mutex<Vec<Weak<Stream>>>,
}

impl Ctx {
    fn new(handle: usize, ordinal: usize, physical: usize, primary: bool, flags: u32) -> Ctx {
        Ctx {
            handle,
            ordinal,
            physical,
            primary,
            live: AtomicBool::new(false),
            retains: AtomicU32::new(0),
            flags: AtomicU32::new(flags),
            null_stream: OnceLock::new(),
            streams: Mutex::new(Vec::new()),
        }
    }

    pub fn is_live(&self) -> bool {
        self.live.load(Ordering::Acquire)
    }

    fn live_streams(&self) -> Vec<Arc<Stream>> {
        let mut list = self.streams.lock().unwrap_or_else(|e| e.into_inner());
        list.retain(|w| w.strong_count() > 0);
        list.iter().filter_map(Weak::upgrade).collect()
    }

    /// Waits for every stream of the context.
    pub fn synchronize(&self) {
        for s in self.live_streams() {
            s.synchronize();
        }
    }

    /// Synchronising a context with a capturing stream conflicts with the capture (a broader
    /// handle than the stream): refused, and the captures invalidated.
    fn refuse_while_capturing(&self) -> Result<(), CUresult> {
        let mut refused = Ok(());
        for s in self.live_streams() {
            if s.refuse_while_capturing().is_err() {
                refused = Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
            }
        }
        refused
    }
}

thread_local! {
    static STACK: RefCell<Vec<Arc<Ctx>>> = const { RefCell::new(Vec::new()) };
}

/// The calling thread's current context.
pub fn current() -> Result<Arc<Ctx>, CUresult> {
    let ctx = STACK
        .with(|s| s.borrow().last().cloned())
        .ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
    if !ctx.is_live() {
        return Err(CUDA_ERROR_CONTEXT_IS_DESTROYED);
    }
    Ok(ctx)
}

fn lookup(d: &Driver, handle: CUcontext) -> Result<Arc<Ctx>, CUresult> {
    d.state()
        .contexts
        .get(handle as usize)
        .cloned()
        .ok_or(CUDA_ERROR_INVALID_CONTEXT)
}

/// Charges a new context's memory; a card without room refuses the context.
fn activate(d: &Driver, ctx: &Ctx) -> Result<(), CUresult> {
    if !d
        .sim
        .charge(ctx.physical, d.sim.context_memory(), Charge::Context)
    {
        return Err(CUDA_ERROR_OUT_OF_MEMORY);
    }
    ctx.live.store(true, Ordering::Release);
    Ok(())
}

/// Ends a context: its work is waited for, its memory (allocations, arrays, context memory) released.
fn deactivate(d: &Driver, ctx: &Ctx) {
    ctx.synchronize();
    ctx.live.store(false, Ordering::Release);
    d.state().exec.events.retain(|_, event| {
        if event.context == ctx.handle {
            event.freed.store(true, Ordering::Release);
        }
        true
    });
    d.state()
        .mem
        .release_context(&d.sim, ctx.handle, ctx.physical);
    d.sim
        .uncharge(ctx.physical, d.sim.context_memory(), Charge::Context);
}

fn primary(d: &Driver, dev: CUdevice) -> Result<Arc<Ctx>, CUresult> {
    let ordinal = d.ordinal(dev)?;
    let mut st = d.state();
    if let Some(ctx) = &st.primaries[ordinal] {
        return Ok(ctx.clone());
    }
    let handle = st.handles.allocate();
    let ctx = Arc::new(Ctx::new(handle, ordinal, d.visible[ordinal], true, 0));
    st.primaries[ordinal] = Some(ctx.clone());
    st.contexts.insert(handle, ctx.clone());
    Ok(ctx)
}

unsafe fn out<T>(p: *mut T, v: T) -> Result<(), CUresult> {
    if p.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    p.write(v);
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    entry(|| {
        let d = driver()?;
        if pctx.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let ctx = primary(d, dev)?;
        // Retains and releases of one device's primary context serialise on its counter's owner.
        let _st = PRIMARY_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        if ctx.retains.load(Ordering::Acquire) == 0 {
            activate(d, &ctx)?;
        }
        ctx.retains.fetch_add(1, Ordering::AcqRel);
        out(pctx, ctx.handle as CUcontext)
    })
}

static PRIMARY_LOCK: Mutex<()> = Mutex::new(());

fn primary_release(dev: CUdevice) -> Result<(), CUresult> {
    let d = driver()?;
    let ctx = primary(d, dev)?;
    let _st = PRIMARY_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    if ctx.retains.load(Ordering::Acquire) == 0 {
        return Err(CUDA_ERROR_INVALID_CONTEXT);
    }
    if ctx.retains.fetch_sub(1, Ordering::AcqRel) == 1 {
        deactivate(d, &ctx);
    }
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease(dev: CUdevice) -> CUresult {
    entry(|| primary_release(dev))
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    entry(|| primary_release(dev))
}

fn primary_reset(dev: CUdevice) -> Result<(), CUresult> {
    let d = driver()?;
    let ctx = primary(d, dev)?;
    let _st = PRIMARY_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    if ctx.retains.swap(0, Ordering::AcqRel) > 0 {
        deactivate(d, &ctx);
    }
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxReset(dev: CUdevice) -> CUresult {
    entry(|| primary_reset(dev))
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxReset_v2(dev: CUdevice) -> CUresult {
    entry(|| primary_reset(dev))
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxGetState(
    dev: CUdevice,
    flags: *mut u32,
    active: *mut i32,
) -> CUresult {
    entry(|| {
        let d = driver()?;
        if flags.is_null() || active.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let ctx = primary(d, dev)?;
        *flags = ctx.flags.load(Ordering::Relaxed);
        *active = ctx.is_live() as i32;
        Ok(())
    })
}

fn primary_set_flags(dev: CUdevice, flags: u32, refuse_active: bool) -> Result<(), CUresult> {
    let d = driver()?;
    let ctx = primary(d, dev)?;
    if flags & !CU_CTX_FLAGS_MASK != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if refuse_active && ctx.is_live() {
        return Err(CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE);
    }
    ctx.flags.store(flags, Ordering::Relaxed);
    Ok(())
}

/// The CUDA 7.0 form refuses an active primary context; the 11.0 `_v2` changes its flags anyway.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxSetFlags(dev: CUdevice, flags: u32) -> CUresult {
    entry(|| primary_set_flags(dev, flags, true))
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxSetFlags_v2(dev: CUdevice, flags: u32) -> CUresult {
    entry(|| primary_set_flags(dev, flags, false))
}

fn create(pctx: *mut CUcontext, flags: u32, dev: CUdevice) -> Result<(), CUresult> {
    let d = driver()?;
    if pctx.is_null() || flags & !CU_CTX_FLAGS_MASK != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let ordinal = d.ordinal(dev)?;
    let ctx = {
        let mut st = d.state();
        let handle = st.handles.allocate();
        Arc::new(Ctx::new(handle, ordinal, d.visible[ordinal], false, flags))
    };
    activate(d, &ctx)?;
    d.state().contexts.insert(ctx.handle, ctx.clone());
    // SAFETY: checked non-null above.
    unsafe { *pctx = ctx.handle as CUcontext };
    STACK.with(|s| s.borrow_mut().push(ctx));
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxCreate(pctx: *mut CUcontext, flags: u32, dev: CUdevice) -> CUresult {
    entry(|| create(pctx, flags, dev))
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxCreate_v2(
    pctx: *mut CUcontext,
    flags: u32,
    dev: CUdevice,
) -> CUresult {
    entry(|| create(pctx, flags, dev))
}

/// With execution-affinity parameters: the stand-in supports none (a real GPU without MPS refuses
/// SM-count affinity the same way).
#[no_mangle]
pub unsafe extern "C" fn cuCtxCreate_v3(
    pctx: *mut CUcontext,
    params: *mut std::ffi::c_void,
    num_params: i32,
    flags: u32,
    dev: CUdevice,
) -> CUresult {
    entry(|| {
        driver()?;
        if num_params < 0 || (num_params > 0 && params.is_null()) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if num_params > 0 {
            return Err(CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY);
        }
        create(pctx, flags, dev)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxCreate_v4(
    pctx: *mut CUcontext,
    params: *const CUctxCreateParams,
    flags: u32,
    dev: CUdevice,
) -> CUresult {
    entry(|| {
        driver()?;
        if let Some(p) = params.as_ref() {
            if p.num_exec_affinity_params < 0
                || (p.num_exec_affinity_params > 0 && p.exec_affinity_params.is_null())
            {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            if p.num_exec_affinity_params > 0 {
                return Err(CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY);
            }
            if !p.cig_params.is_null() {
                return Err(CUDA_ERROR_NOT_SUPPORTED);
            }
        }
        create(pctx, flags, dev)
    })
}

fn destroy(handle: CUcontext) -> Result<(), CUresult> {
    let d = driver()?;
    if handle.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let ctx = lookup(d, handle)?;
    if ctx.primary {
        return Err(CUDA_ERROR_INVALID_CONTEXT);
    }
    d.state().contexts.remove(ctx.handle);
    deactivate(d, &ctx);
    STACK.with(|s| {
        let mut s = s.borrow_mut();
        if s.last().is_some_and(|c| Arc::ptr_eq(c, &ctx)) {
            s.pop();
        }
    });
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxDestroy(ctx: CUcontext) -> CUresult {
    entry(|| destroy(ctx))
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxDestroy_v2(ctx: CUcontext) -> CUresult {
    entry(|| destroy(ctx))
}

fn push(handle: CUcontext) -> Result<(), CUresult> {
    let d = driver()?;
    if handle.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let ctx = lookup(d, handle)?;
    STACK.with(|s| s.borrow_mut().push(ctx));
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxPushCurrent(ctx: CUcontext) -> CUresult {
    entry(|| push(ctx))
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxPushCurrent_v2(ctx: CUcontext) -> CUresult {
    entry(|| push(ctx))
}

fn pop(pctx: *mut CUcontext) -> Result<(), CUresult> {
    driver()?;
    let ctx = STACK
        .with(|s| s.borrow_mut().pop())
        .ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
    if !pctx.is_null() {
        // SAFETY: the caller passes a writable CUcontext or NULL.
        unsafe { *pctx = ctx.handle as CUcontext };
    }
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxPopCurrent(pctx: *mut CUcontext) -> CUresult {
    entry(|| pop(pctx))
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(pctx: *mut CUcontext) -> CUresult {
    entry(|| pop(pctx))
}

/// Replaces the top of the thread's stack (NULL pops it), as cuda.h describes.
#[no_mangle]
pub unsafe extern "C" fn cuCtxSetCurrent(ctx: CUcontext) -> CUresult {
    entry(|| {
        let d = driver()?;
        if ctx.is_null() {
            STACK.with(|s| s.borrow_mut().pop());
            return Ok(());
        }
        let ctx = lookup(d, ctx)?;
        STACK.with(|s| {
            let mut s = s.borrow_mut();
            s.pop();
            s.push(ctx);
        });
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(pctx: *mut CUcontext) -> CUresult {
    entry(|| {
        driver()?;
        let handle = STACK
            .with(|s| s.borrow().last().map(|c| c.handle))
            .unwrap_or(0);
        out(pctx, handle as CUcontext)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetDevice(device: *mut CUdevice) -> CUresult {
    entry(|| {
        driver()?;
        let ctx = current()?;
        out(device, ctx.ordinal as CUdevice)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxSynchronize() -> CUresult {
    entry(|| {
        let d = driver()?;
        let ctx = current()?;
        ctx.refuse_while_capturing()?;
        crate::capture::unsafe_call()?;
        ctx.synchronize();
        d.state().mem.trim_pools_at_sync(&d.sim);
        Ok(())
    })
}

//! How calls reach us: the exported `dlsym`, the real pointers behind each wrapper, and the
//! libraries they come from.
//!
//! The CUDA runtime, PyTorch and NCCL `dlopen("libcuda.so.1")` and look entry points up with
//! `dlsym(handle, name)`, which searches that library only: a preloaded object's `cu*` exports
//! are never seen that way. So we export `dlsym` itself, as a few instructions of assembly: they
//! jump straight to glibc's `dlsym` (the caller's return address untouched, which glibc uses for
//! `RTLD_NEXT` and the caller's lookup scope) unless the handle is not `RTLD_NEXT` and the name
//! starts with `cu` or `nv`. Only those reach [`dlsym_hook`], which resolves the name for real
//! first and substitutes a wrapper only for a name we wrap and that resolved. Every other `dlsym`
//! in the process (other interposers, profilers, sanitizers) behaves exactly as without us.
//!
//! Our own code never calls `libc::dlsym` (it would resolve to our export): it uses [`real_dlsym`].

use crate::entry_points::Sym;
use std::ffi::{c_char, c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};

/// glibc's `dlsym`, found once in an ELF constructor (or by the trampoline itself if another
/// library's constructor calls `dlsym` before ours ran).
pub static REAL_DLSYM: AtomicUsize = AtomicUsize::new(0);

type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

#[cfg(target_arch = "x86_64")]
const GLIBC_BASE_VERSION: &CStr = c"GLIBC_2.2.5";
#[cfg(target_arch = "aarch64")]
const GLIBC_BASE_VERSION: &CStr = c"GLIBC_2.17";

/// Finds glibc's `dlsym` by version: `GLIBC_2.34` (where it moved into libc), else the
/// architecture's base version (older glibc, where it lives in libdl).
pub extern "C" fn resolve_real_dlsym() -> usize {
    let current = REAL_DLSYM.load(Ordering::Acquire);
    if current != 0 {
        return current;
    }
    for version in [c"GLIBC_2.34", GLIBC_BASE_VERSION] {
        // SAFETY: dlvsym with valid C strings; RTLD_NEXT searches the objects after ours.
        let found = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), version.as_ptr()) };
        if !found.is_null() {
            REAL_DLSYM.store(found as usize, Ordering::Release);
            return found as usize;
        }
    }
    0
}

#[used]
#[link_section = ".init_array"]
static FIND_REAL_DLSYM: extern "C" fn() = {
    extern "C" fn constructor() {
        resolve_real_dlsym();
    }
    constructor
};

/// glibc's `dlsym`. Panics only if glibc has none, which cannot happen in a process that loaded us.
pub fn real_dlsym() -> DlsymFn {
    let addr = resolve_real_dlsym();
    assert!(addr != 0, "glibc's dlsym not found");
    // SAFETY: addr is glibc's dlsym, whose signature is DlsymFn.
    unsafe { std::mem::transmute::<usize, DlsymFn>(addr) }
}

/// Which slot table a wrapper's real pointer lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// The function exported under the wrapper's name (found by `dlsym` or resolved lazily).
    Export,
    /// An address `cuGetProcAddress` returned that matches no exported symbol; the wrapper for
    /// the ABI the version and flags select calls it.
    ProcAddr,
}

static EXPORT_REAL: [AtomicUsize; Sym::COUNT] = [const { AtomicUsize::new(0) }; Sym::COUNT];
static PROCADDR_REAL: [AtomicUsize; Sym::COUNT] = [const { AtomicUsize::new(0) }; Sym::COUNT];
static WARNED: [AtomicBool; Sym::COUNT] = [const { AtomicBool::new(false) }; Sym::COUNT];

pub fn warn_once(sym: Sym, what: &str) {
    if !WARNED[sym as usize].swap(true, Ordering::Relaxed) {
        log_warn!("{} {what}", sym.name());
    }
}

/// The real function behind a wrapper, or None if it cannot be found (the wrapper then answers
/// an error instead of calling itself).
pub fn real(sym: Sym, origin: Origin) -> Option<usize> {
    match origin {
        Origin::Export => {
            let addr = EXPORT_REAL[sym as usize].load(Ordering::Acquire);
            if addr != 0 {
                return Some(addr);
            }
            // The program called our export of a driver function: the driver is loaded (or the
            // program links it), so loading it here changes nothing.
            let resolved = library_of(sym).lookup(sym.c_name(), true)?;
            EXPORT_REAL[sym as usize].store(resolved, Ordering::Release);
            Some(resolved)
        }
        Origin::ProcAddr => {
            Some(PROCADDR_REAL[sym as usize].load(Ordering::Acquire)).filter(|&a| a != 0)
        }
    }
}

/// Records the function `dlsym` found for `sym`'s exported wrapper. Err(the other address) when a
/// different one was recorded before (a second copy of the driver in one process).
pub fn set_export_real(sym: Sym, addr: usize) -> Result<(), usize> {
    match EXPORT_REAL[sym as usize].compare_exchange(0, addr, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => Ok(()),
        Err(existing) if existing == addr => Ok(()),
        Err(existing) => Err(existing),
    }
}

/// Records the address a `cuGetProcAddress` call returned for `sym`'s ABI when it matches no
/// exported symbol. False if a different address was recorded before (never two targets for one
/// wrapper).
pub fn set_procaddr_real(sym: Sym, addr: usize) -> bool {
    match PROCADDR_REAL[sym as usize].compare_exchange(0, addr, Ordering::AcqRel, Ordering::Acquire)
    {
        Ok(_) => true,
        Err(existing) => existing == addr,
    }
}

/// A driver library: its soname and the handle we look symbols up in.
pub struct Library {
    soname: &'static CStr,
    handle: AtomicPtr<c_void>,
}

pub static CUDA: Library = Library {
    soname: c"libcuda.so.1",
    handle: AtomicPtr::new(std::ptr::null_mut()),
};
pub static NVML: Library = Library {
    soname: c"libnvidia-ml.so.1",
    handle: AtomicPtr::new(std::ptr::null_mut()),
};

pub fn library_of(sym: Sym) -> &'static Library {
    if sym.name().starts_with("nv") {
        &NVML
    } else {
        &CUDA
    }
}

impl Library {
    /// Our own handle of the library: taken by us, never closed.
    fn store(&self, handle: *mut c_void) {
        let _ = self.handle.compare_exchange(
            std::ptr::null_mut(),
            handle,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }

    /// Keeps the library that contains `addr` (a function the driver handed out, or the program
    /// found) loaded for good, and its handle for our own lookups. Wrappers and our own calls
    /// keep pointers into it for the life of the process: a program that `dlclose`s the library
    /// when it is done (go-nvml's Shutdown does) must not unload it under them, or a later
    /// `dlopen` could put it elsewhere, leaving those pointers to unmapped memory and the new
    /// copy's functions unwrapped. The handle is ours (a reference of our own, the object marked
    /// never to be unloaded), not the program's, which it may close. The program opened it by
    /// whatever name: the file the address lies in is what we open.
    pub fn keep_containing(&self, addr: usize) {
        if !self.handle.load(Ordering::Acquire).is_null() {
            return;
        }
        // SAFETY: dladdr fills a Dl_info we own; the file name it returns is owned by the loader.
        unsafe {
            let mut info: libc::Dl_info = std::mem::zeroed();
            if libc::dladdr(addr as *const c_void, &mut info) != 0 && !info.dli_fname.is_null() {
                let handle = libc::dlopen(
                    info.dli_fname,
                    libc::RTLD_LAZY | libc::RTLD_NOLOAD | libc::RTLD_NODELETE,
                );
                if !handle.is_null() {
                    self.store(handle);
                }
            }
        }
    }

    /// The handle: the remembered one, else the library if already loaded, else loaded now.
    /// `load`: whether loading it is acceptable (we never load libcuda into a program that did not).
    pub fn handle(&self, load: bool) -> Option<*mut c_void> {
        let handle = self.handle.load(Ordering::Acquire);
        if !handle.is_null() {
            return Some(handle);
        }
        // SAFETY: dlopen with a valid soname. The handle is ours and never closed; NODELETE as
        // in keep_containing (the program may close its own reference).
        let flags = libc::RTLD_LAZY | libc::RTLD_NODELETE;
        let mut opened = unsafe { libc::dlopen(self.soname.as_ptr(), flags | libc::RTLD_NOLOAD) };
        if opened.is_null() && load {
            opened = unsafe { libc::dlopen(self.soname.as_ptr(), flags) };
        }
        if opened.is_null() {
            return None;
        }
        self.store(opened);
        Some(self.handle.load(Ordering::Acquire))
    }

    /// A symbol of this library by the real `dlsym`; None when absent or when it is our own
    /// export (calling it would loop back into us). `load`: see [`Library::handle`].
    pub fn lookup(&self, name: &CStr, load: bool) -> Option<usize> {
        let handle = self.handle(load)?;
        // SAFETY: a valid handle and C string.
        let addr = unsafe { real_dlsym()(handle, name.as_ptr()) } as usize;
        if addr == 0 {
            return None;
        }
        if in_our_object(addr) {
            log_error!(
                "{} resolves to gpupool-vgpu itself; refusing to call it",
                name.to_string_lossy()
            );
            return None;
        }
        Some(addr)
    }
}

/// The base address of our own shared object.
fn our_base() -> usize {
    static BASE: AtomicUsize = AtomicUsize::new(0);
    let base = BASE.load(Ordering::Relaxed);
    if base != 0 {
        return base;
    }
    let found = object_base(our_base as *const () as usize);
    BASE.store(found, Ordering::Relaxed);
    found
}

fn object_base(addr: usize) -> usize {
    // SAFETY: dladdr fills a Dl_info we own.
    unsafe {
        let mut info: libc::Dl_info = std::mem::zeroed();
        if libc::dladdr(addr as *const c_void, &mut info) == 0 {
            return 0;
        }
        info.dli_fbase as usize
    }
}

/// True when `addr` is inside this library (a wrapper of ours, not the driver's function).
pub fn in_our_object(addr: usize) -> bool {
    let base = object_base(addr);
    base != 0 && base == our_base()
}

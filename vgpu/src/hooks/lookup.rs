//! How calls reach the wrappers: `cuInit`, and `cuGetProcAddress`, whose returned function is
//! replaced by our wrapper of the same variant.

use super::*;
use crate::interpose::{in_our_object, real_dlsym, CUDA};
use crate::interpose::{set_export_real, set_procaddr_real};
use crate::process;
use crate::symbols;
use std::ffi::CStr;

/// The exported `dlsym` (x86_64). `rdi` = handle, `rsi` = name.
///
/// # Safety
/// glibc's `dlsym` contract.
#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
#[no_mangle]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    core::arch::naked_asm!(
        "mov rax, qword ptr [rip + {real}]",
        "test rax, rax",
        "jz 5f",
        "2:",
        "cmp rdi, -1", // RTLD_NEXT: always glibc's
        "je 3f",
        "test rsi, rsi",
        "jz 3f",
        "movzx ecx, byte ptr [rsi]",
        "cmp ecx, 0x63", // 'c'
        "je 4f",
        "cmp ecx, 0x6e", // 'n'
        "jne 3f",
        "cmp byte ptr [rsi + 1], 0x76", // 'v' (byte 1 exists: byte 0 was not NUL)
        "je 6f",
        "3:",
        "jmp rax",
        "4:",
        "cmp byte ptr [rsi + 1], 0x75", // 'u'
        "jne 3b",
        "6:",
        "jmp {hook}",
        "5:",
        // Not resolved yet (a constructor running before ours): resolve, keeping the arguments
        // and a 16-byte aligned stack for the call.
        "push rdi",
        "push rsi",
        "sub rsp, 8",
        "call {resolve}",
        "add rsp, 8",
        "pop rsi",
        "pop rdi",
        "test rax, rax",
        "jnz 2b",
        "ret",
        real = sym crate::interpose::REAL_DLSYM,
        hook = sym dlsym_hook,
        resolve = sym crate::interpose::resolve_real_dlsym,
    )
}

/// The exported `dlsym` (aarch64). `x0` = handle, `x1` = name.
///
/// # Safety
/// glibc's `dlsym` contract.
#[cfg(target_arch = "aarch64")]
#[unsafe(naked)]
#[no_mangle]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    core::arch::naked_asm!(
        "adrp x16, {real}",
        "ldr x16, [x16, :lo12:{real}]",
        "cbz x16, 5f",
        "2:",
        "cmn x0, #1", // RTLD_NEXT
        "b.eq 3f",
        "cbz x1, 3f",
        "ldrb w17, [x1]",
        "cmp w17, #0x63", // 'c'
        "b.eq 4f",
        "cmp w17, #0x6e", // 'n'
        "b.ne 3f",
        "ldrb w17, [x1, #1]",
        "cmp w17, #0x76", // 'v'
        "b.eq 6f",
        "3:",
        "br x16",
        "4:",
        "ldrb w17, [x1, #1]",
        "cmp w17, #0x75", // 'u'
        "b.ne 3b",
        "6:",
        "b {hook}",
        "5:",
        "stp x29, x30, [sp, #-32]!",
        "mov x29, sp",
        "stp x0, x1, [sp, #16]",
        "bl {resolve}",
        "mov x16, x0",
        "ldp x0, x1, [sp, #16]",
        "ldp x29, x30, [sp], #32",
        "cbnz x16, 2b",
        "mov x0, #0",
        "ret",
        real = sym crate::interpose::REAL_DLSYM,
        hook = sym dlsym_hook,
        resolve = sym crate::interpose::resolve_real_dlsym,
    )
}

/// `dlsym` for a `cu*` or `nv*` name through a handle that is not `RTLD_NEXT`.
pub(super) unsafe extern "C" fn dlsym_hook(
    handle: *mut c_void,
    symbol: *const c_char,
) -> *mut c_void {
    // SAFETY: the caller's arguments, passed on unchanged.
    let found = unsafe { real_dlsym()(handle, symbol) };
    if found.is_null() {
        return found;
    }
    // Anything going wrong in here leaves the caller with the real symbol.
    std::panic::catch_unwind(|| unsafe { wrap_found(CStr::from_ptr(symbol), found) })
        .unwrap_or(found)
}

/// The entry point `addr` is our wrapper of, if it is one (exported or not).
fn wrapper_of(addr: usize) -> Option<Sym> {
    Sym::ALL
        .iter()
        .copied()
        .find(|s| s.exported_wrapper() == addr || s.procaddr_wrapper() == addr)
}

/// Whether a launch entry point is handed out as the driver's own function: with no SM limit in
/// force, launches have nothing to pass through, and a wrapper would only cost time on every one
/// of them. (A refused environment keeps the wrapper: it answers the refusal.)
fn launch_unwrapped(sym: Sym) -> bool {
    sym.is_launch() && matches!(process::get(), Some(p) if !p.config.throttles())
}

unsafe fn wrap_found(symbol: &CStr, found: *mut c_void) -> *mut c_void {
    let Some(sym) = Sym::from_name(symbol.to_bytes()) else {
        return found; // not a function we wrap: untouched
    };
    if in_our_object(found as usize) {
        // RTLD_DEFAULT found our own export, which is already the wrapper; but without us the
        // caller would have found nothing unless the driver is loaded and has the symbol.
        let library = library_of(sym);
        let Some(real) = library.handle(false).and(library.lookup(symbol, false)) else {
            return std::ptr::null_mut();
        };
        if launch_unwrapped(sym) {
            return real as *mut c_void;
        }
        return found;
    }
    if launch_unwrapped(sym) {
        return found;
    }
    // The wrapper will call `found` for the rest of the process's life: the library must stay.
    library_of(sym).keep_containing(found as usize);
    if set_export_real(sym, found as usize).is_err() {
        // A second copy of the driver in one process: our wrapper calls the first. Hand the
        // caller its own function, unwrapped, rather than the wrong library's.
        warn_once(
            sym,
            "resolves to two different libraries in this process; the second is not limited",
        );
        return found;
    }
    sym.exported_wrapper() as *mut c_void
}

pub(super) unsafe fn init(real: pfn::cuInit, flags: c_uint) -> CUresult {
    if process::get().is_none() {
        return CUDA_ERROR_NOT_INITIALIZED;
    }
    real(flags)
}

pub(super) unsafe fn get_proc_address(
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

pub(super) unsafe fn get_proc_address_v2(
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
    if let Some(ours) = wrapper_of(addr) {
        // The driver handed out one of our own wrappers (a table that resolves through symbol
        // interposition does): it is wrapped already. Wrapping it again would make every call
        // pass twice, every allocation charged twice.
        if let Some(sym) = Some(ours).filter(|s| launch_unwrapped(*s)) {
            if let Some(real) = real(sym, Origin::Export) {
                *pfn = real as *mut c_void;
            }
        }
        return;
    }
    for sym in variants() {
        if real(sym, Origin::Export) == Some(addr) {
            if !launch_unwrapped(sym) {
                *pfn = sym.exported_wrapper() as *mut c_void;
            }
            return;
        }
    }
    match symbols::select(family, version, flags).and_then(|v| Sym::from_name(v.name.as_bytes())) {
        Some(sym) if launch_unwrapped(sym) => {}
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

    unsafe extern "C" fn fake_free_async_ptsz(ptr: CUdeviceptr, _stream: CUstream) -> CUresult {
        CALLS.fetch_add(ptr as usize, Ordering::SeqCst);
        CUDA_SUCCESS
    }

    unsafe extern "C" fn fake_launch(_exec: CUgraphExec, _stream: CUstream) -> CUresult {
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
                c"cuMemFreeAsync",
                fake_free_async_ptsz as *const () as usize,
                12090,
                flags,
            );
            assert_eq!(wrapped, Sym::cuMemFreeAsync_ptsz.procaddr_wrapper());
            let before = CALLS.load(Ordering::SeqCst);
            let call: pfn::cuMemFreeAsync_ptsz =
                std::mem::transmute::<usize, pfn::cuMemFreeAsync_ptsz>(wrapped);
            assert_eq!(call(7, std::ptr::null_mut()), CUDA_SUCCESS);
            assert_eq!(CALLS.load(Ordering::SeqCst) - before, 7);
        }
    }

    #[test]
    fn without_an_sm_limit_a_launch_is_handed_out_as_the_drivers_own() {
        // This test process has no limit in its environment: launches cost nothing of ours.
        let address = fake_launch as *const () as usize;
        for flags in [0, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM] {
            unsafe {
                assert_eq!(
                    substituted(c"cuGraphLaunch", address, 12090, flags),
                    address
                );
            }
        }
    }

    #[test]
    fn one_of_our_own_wrappers_handed_back_is_never_wrapped_again() {
        for sym in [Sym::cuMemAlloc_v2, Sym::cuMemFree_v2] {
            for ours in [sym.exported_wrapper(), sym.procaddr_wrapper()] {
                unsafe {
                    assert_eq!(substituted(sym.c_name(), ours, 12090, 0), ours, "{sym:?}");
                }
            }
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

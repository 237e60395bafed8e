//! How the probe reaches the driver, the ways the CUDA runtime and other programs do:
//! - `dlsym`: `dlopen("libcuda.so.1")` then `dlsym(handle, name)` with the names cuda.h (12.9) maps
//!   the API to (`cuMemAlloc` -> `cuMemAlloc_v2`; with `--per-thread`, the `_ptsz` forms);
//! - `global`: the same names through `dlsym(RTLD_DEFAULT, ...)` after a `RTLD_GLOBAL` open: what a
//!   program linked with `-lcuda` binds to (a preloaded library's exports come first);
//! - `proc`: `cuGetProcAddress_v2(base name, &pfn, --cuda-version, flags, &status)`, flags
//!   `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM` with `--per-thread` (else LEGACY_STREAM), the
//!   runtime's way since CUDA 11.3; `proc-v1` uses the 4-argument `cuGetProcAddress`.
//!
//! Which ABI a function pointer has follows from how it was found: the header's mapping for the
//! dlsym forms, the requested version for `proc` (as the runtime picks the `PFN_..._v<version>`
//! typedef it asked for).

use std::ffi::{c_char, c_void, CString};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lookup {
    Dlsym,
    Global,
    Proc,
    ProcV1,
}

pub const HEADER_VERSION: i32 = 12090;
pub const CU_GET_PROC_ADDRESS_LEGACY_STREAM: u64 = 1;
pub const CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM: u64 = 2;

type GetProcV2 = unsafe extern "C" fn(*const c_char, *mut *mut c_void, i32, u64, *mut i32) -> i32;
type GetProcV1 = unsafe extern "C" fn(*const c_char, *mut *mut c_void, i32, u64) -> i32;

pub struct Loader {
    pub handle: *mut c_void,
    pub lookup: Lookup,
    /// The version the ABIs follow: `--cuda-version` for the proc lookups, the header's otherwise.
    pub version: i32,
    pub per_thread: bool,
    /// Flags for the proc lookups when given (`--proc-flags`), e.g. 0 = CU_GET_PROC_ADDRESS_DEFAULT.
    pub flags: Option<u64>,
    getproc_v2: Option<GetProcV2>,
    getproc_v1: Option<GetProcV1>,
}

/// One resolution, for the record.
#[derive(Clone, Debug)]
pub struct Resolved {
    pub addr: *mut c_void,
    /// The symbol name asked for (dlsym forms) or the base name (proc forms).
    pub name: String,
    /// cuGetProcAddress's result and status (proc forms only).
    pub result: Option<(i32, i32)>,
}

pub fn dlerror_text() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string.
    unsafe {
        let e = libc::dlerror();
        if e.is_null() {
            "unknown dlerror".into()
        } else {
            std::ffi::CStr::from_ptr(e).to_string_lossy().into_owned()
        }
    }
}

/// The symbol a program compiled against cuda.h 12.9 binds for `base` (its `#define`s), in the
/// per-thread-default-stream compilation mode or not.
pub fn header_name(base: &str, per_thread: bool) -> String {
    let v2 = [
        "cuDeviceTotalMem",
        "cuCtxCreate",
        "cuMemGetInfo",
        "cuMemAlloc",
        "cuMemAllocPitch",
        "cuMemFree",
        "cuArrayCreate",
        "cuArray3DCreate",
        "cuCtxDestroy",
        "cuCtxPopCurrent",
        "cuCtxPushCurrent",
        "cuStreamDestroy",
        "cuEventDestroy",
        "cuDevicePrimaryCtxRelease",
        "cuDevicePrimaryCtxReset",
        "cuDevicePrimaryCtxSetFlags",
        "cuGraphAddKernelNode",
        "cuGetProcAddress",
        "cuMemGetAddressRange",
    ];
    let ptsz = [
        "cuStreamSynchronize",
        "cuStreamQuery",
        "cuEventRecord",
        "cuLaunchKernel",
        "cuLaunchKernelEx",
        "cuLaunchCooperativeKernel",
        "cuGraphLaunch",
        "cuMemAllocAsync",
        "cuMemFreeAsync",
        "cuMemAllocFromPoolAsync",
        "cuStreamEndCapture",
        "cuStreamIsCapturing",
        "cuStreamGetDevice",
    ];
    match base {
        "cuGraphInstantiate" => "cuGraphInstantiateWithFlags".into(),
        "cuStreamBeginCapture" if per_thread => "cuStreamBeginCapture_v2_ptsz".into(),
        "cuStreamBeginCapture" => "cuStreamBeginCapture_v2".into(),
        b if v2.contains(&b) => format!("{b}_v2"),
        b if per_thread && ptsz.contains(&b) => format!("{b}_ptsz"),
        b => b.to_string(),
    }
}

impl Loader {
    pub fn open(
        lookup: Lookup,
        version: i32,
        per_thread: bool,
        flags: Option<u64>,
    ) -> Result<Loader, String> {
        let mode = libc::RTLD_NOW
            | if lookup == Lookup::Global {
                libc::RTLD_GLOBAL
            } else {
                libc::RTLD_LOCAL
            };
        // SAFETY: a constant NUL-terminated name.
        let handle = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), mode) };
        if handle.is_null() {
            return Err(format!("dlopen(libcuda.so.1): {}", dlerror_text()));
        }
        let mut l = Loader {
            handle,
            lookup,
            version: if matches!(lookup, Lookup::Proc | Lookup::ProcV1) {
                version
            } else {
                HEADER_VERSION
            },
            per_thread,
            flags,
            getproc_v2: None,
            getproc_v1: None,
        };
        // The runtime finds the entry-point getter itself with dlsym on the handle.
        let v2 = l.dlsym_handle("cuGetProcAddress_v2");
        let v1 = l.dlsym_handle("cuGetProcAddress");
        // SAFETY: the symbols are cuda.h's cuGetProcAddress_v2 / cuGetProcAddress (11.3 form).
        unsafe {
            l.getproc_v2 =
                (!v2.is_null()).then(|| std::mem::transmute::<*mut c_void, GetProcV2>(v2));
            l.getproc_v1 =
                (!v1.is_null()).then(|| std::mem::transmute::<*mut c_void, GetProcV1>(v1));
        }
        match lookup {
            Lookup::Proc if l.getproc_v2.is_none() => {
                Err("libcuda.so.1 has no cuGetProcAddress_v2".into())
            }
            Lookup::ProcV1 if l.getproc_v1.is_none() => {
                Err("libcuda.so.1 has no cuGetProcAddress".into())
            }
            _ => Ok(l),
        }
    }

    pub fn dlsym_handle(&self, name: &str) -> *mut c_void {
        let c = CString::new(name).expect("symbol name");
        // SAFETY: handle is a live dlopen handle; c is NUL-terminated.
        unsafe { libc::dlsym(self.handle, c.as_ptr()) }
    }

    fn dlsym_global(&self, name: &str) -> *mut c_void {
        let c = CString::new(name).expect("symbol name");
        // SAFETY: as above, in the global scope.
        unsafe { libc::dlsym(libc::RTLD_DEFAULT, c.as_ptr()) }
    }

    /// `cuGetProcAddress_v2` as the runtime calls it, whatever the lookup mode.
    pub fn get_proc(
        &self,
        base: &str,
        version: i32,
        flags: u64,
    ) -> Option<(i32, i32, *mut c_void)> {
        let f = self.getproc_v2?;
        let c = CString::new(base).ok()?;
        let mut pfn: *mut c_void = std::ptr::null_mut();
        let mut status: i32 = -1;
        // SAFETY: the driver's cuGetProcAddress_v2 with valid out-pointers.
        let r = unsafe { f(c.as_ptr(), &mut pfn, version, flags, &mut status) };
        Some((r, status, pfn))
    }

    pub fn proc_flags(&self) -> u64 {
        if let Some(f) = self.flags {
            f
        } else if self.per_thread {
            CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
        } else {
            CU_GET_PROC_ADDRESS_LEGACY_STREAM
        }
    }

    /// Finds `base` the configured way.
    pub fn resolve(&self, base: &str) -> Resolved {
        match self.lookup {
            Lookup::Dlsym | Lookup::Global => {
                let name = header_name(base, self.per_thread);
                let addr = if self.lookup == Lookup::Dlsym {
                    self.dlsym_handle(&name)
                } else {
                    self.dlsym_global(&name)
                };
                Resolved {
                    addr,
                    name,
                    result: None,
                }
            }
            Lookup::Proc => {
                let (r, status, addr) = self
                    .get_proc(base, self.version, self.proc_flags())
                    .unwrap_or((-1, -1, std::ptr::null_mut()));
                Resolved {
                    addr,
                    name: base.into(),
                    result: Some((r, status)),
                }
            }
            Lookup::ProcV1 => {
                let f = self.getproc_v1.expect("checked at open");
                let c = CString::new(base).expect("symbol name");
                let mut pfn: *mut c_void = std::ptr::null_mut();
                // SAFETY: the driver's 11.3 cuGetProcAddress with a valid out-pointer.
                let r = unsafe { f(c.as_ptr(), &mut pfn, self.version, self.proc_flags()) };
                Resolved {
                    addr: pfn,
                    name: base.into(),
                    result: Some((r, -1)),
                }
            }
        }
    }

    /// Whether the function found for `base` has the ABI introduced at `since` (versioned lookups
    /// follow the version; the dlsym forms have the header's, i.e. the newest the probe knows,
    /// except where the header maps to an older form, given as `header_abi`).
    pub fn abi_at_least(&self, since: i32, header_abi: i32) -> bool {
        match self.lookup {
            Lookup::Proc | Lookup::ProcV1 => self.version >= since,
            Lookup::Dlsym | Lookup::Global => header_abi >= since,
        }
    }
}

/// `dlopen("libnvidia-ml.so.1")` as NVML users do; None when it is absent.
pub fn open_nvml() -> Option<*mut c_void> {
    // SAFETY: a constant NUL-terminated name.
    let h = unsafe {
        libc::dlopen(
            c"libnvidia-ml.so.1".as_ptr(),
            libc::RTLD_NOW | libc::RTLD_LOCAL,
        )
    };
    (!h.is_null()).then_some(h)
}

pub fn dlsym(handle: *mut c_void, name: &str) -> *mut c_void {
    let c = CString::new(name).expect("symbol name");
    // SAFETY: handle is a live dlopen handle.
    unsafe { libc::dlsym(handle, c.as_ptr()) }
}

#[cfg(test)]
mod tests {
    use super::header_name;

    #[test]
    fn header_names_follow_cuda_h() {
        assert_eq!(header_name("cuMemAlloc", false), "cuMemAlloc_v2");
        assert_eq!(header_name("cuLaunchKernel", false), "cuLaunchKernel");
        assert_eq!(header_name("cuLaunchKernel", true), "cuLaunchKernel_ptsz");
        assert_eq!(
            header_name("cuGraphInstantiate", true),
            "cuGraphInstantiateWithFlags"
        );
        assert_eq!(
            header_name("cuStreamBeginCapture", true),
            "cuStreamBeginCapture_v2_ptsz"
        );
        assert_eq!(header_name("cuInit", true), "cuInit");
    }
}

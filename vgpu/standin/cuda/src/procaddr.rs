//! `cuGetProcAddress` and `cuGetProcAddress_v2`: a base name, a CUDA version and flags choose one
//! exported symbol, as the real driver chooses among the `PFN_<name>_v<version>[_ptsz|_ptds]`
//! variants of `cudaTypedefs.h` (CUDA 12.9). The address returned is the address of that exported
//! symbol (the library is linked `-Bsymbolic`, so an interposer exporting the same name does not
//! change what we return).
#![allow(non_snake_case, clippy::missing_safety_doc)]

use crate::driver::entry;
use crate::ffi::*;
use std::ffi::{c_char, c_void, CStr};

/// One variant of a base name: the CUDA version that introduced it, its exported symbol, and
/// whether it is the per-thread-default-stream form (`_ptsz`/`_ptds`) of the ABI introduced at
/// `abi` (for the legacy forms, `abi == version`).
pub struct Variant {
    pub version: i32,
    pub abi: i32,
    pub symbol: &'static str,
    pub per_thread: bool,
}

const fn v(version: i32, symbol: &'static str) -> Variant {
    Variant {
        version,
        abi: version,
        symbol,
        per_thread: false,
    }
}

const fn pt(version: i32, abi: i32, symbol: &'static str) -> Variant {
    Variant {
        version,
        abi,
        symbol,
        per_thread: true,
    }
}

/// The variants of every base name this stand-in exports, from cudaTypedefs.h's `PFN_` typedefs and
/// cuda.h's `#define <name> <name>_v<n>` lines.
pub static TABLE: &[(&str, &[Variant])] = &[
    ("cuGetErrorString", &[v(6000, "cuGetErrorString")]),
    ("cuGetErrorName", &[v(6000, "cuGetErrorName")]),
    ("cuInit", &[v(2000, "cuInit")]),
    ("cuDriverGetVersion", &[v(2020, "cuDriverGetVersion")]),
    ("cuDeviceGet", &[v(2000, "cuDeviceGet")]),
    ("cuDeviceGetCount", &[v(2000, "cuDeviceGetCount")]),
    ("cuDeviceGetName", &[v(2000, "cuDeviceGetName")]),
    (
        "cuDeviceGetUuid",
        &[v(9020, "cuDeviceGetUuid"), v(11040, "cuDeviceGetUuid_v2")],
    ),
    (
        "cuDeviceTotalMem",
        &[v(2000, "cuDeviceTotalMem"), v(3020, "cuDeviceTotalMem_v2")],
    ),
    ("cuDeviceGetAttribute", &[v(2000, "cuDeviceGetAttribute")]),
    ("cuDeviceGetPCIBusId", &[v(4010, "cuDeviceGetPCIBusId")]),
    ("cuDeviceGetByPCIBusId", &[v(4010, "cuDeviceGetByPCIBusId")]),
    (
        "cuDeviceGetDefaultMemPool",
        &[v(11020, "cuDeviceGetDefaultMemPool")],
    ),
    ("cuDeviceGetMemPool", &[v(11020, "cuDeviceGetMemPool")]),
    ("cuDeviceSetMemPool", &[v(11020, "cuDeviceSetMemPool")]),
    (
        "cuDevicePrimaryCtxRetain",
        &[v(7000, "cuDevicePrimaryCtxRetain")],
    ),
    (
        "cuDevicePrimaryCtxGetState",
        &[v(7000, "cuDevicePrimaryCtxGetState")],
    ),
    (
        "cuDevicePrimaryCtxRelease",
        &[
            v(7000, "cuDevicePrimaryCtxRelease"),
            v(11000, "cuDevicePrimaryCtxRelease_v2"),
        ],
    ),
    (
        "cuDevicePrimaryCtxSetFlags",
        &[
            v(7000, "cuDevicePrimaryCtxSetFlags"),
            v(11000, "cuDevicePrimaryCtxSetFlags_v2"),
        ],
    ),
    (
        "cuDevicePrimaryCtxReset",
        &[
            v(7000, "cuDevicePrimaryCtxReset"),
            v(11000, "cuDevicePrimaryCtxReset_v2"),
        ],
    ),
    (
        "cuCtxCreate",
        &[
            v(2000, "cuCtxCreate"),
            v(3020, "cuCtxCreate_v2"),
            v(11040, "cuCtxCreate_v3"),
            v(12050, "cuCtxCreate_v4"),
        ],
    ),
    (
        "cuCtxDestroy",
        &[v(2000, "cuCtxDestroy"), v(4000, "cuCtxDestroy_v2")],
    ),
    (
        "cuCtxPushCurrent",
        &[v(2000, "cuCtxPushCurrent"), v(4000, "cuCtxPushCurrent_v2")],
    ),
    (
        "cuCtxPopCurrent",
        &[v(2000, "cuCtxPopCurrent"), v(4000, "cuCtxPopCurrent_v2")],
    ),
    ("cuCtxSetCurrent", &[v(4000, "cuCtxSetCurrent")]),
    ("cuCtxGetCurrent", &[v(4000, "cuCtxGetCurrent")]),
    ("cuCtxGetDevice", &[v(2000, "cuCtxGetDevice")]),
    ("cuCtxSynchronize", &[v(2000, "cuCtxSynchronize")]),
    (
        "cuMemGetInfo",
        &[v(2000, "cuMemGetInfo"), v(3020, "cuMemGetInfo_v2")],
    ),
    (
        "cuMemAlloc",
        &[v(2000, "cuMemAlloc"), v(3020, "cuMemAlloc_v2")],
    ),
    (
        "cuMemAllocPitch",
        &[v(2000, "cuMemAllocPitch"), v(3020, "cuMemAllocPitch_v2")],
    ),
    (
        "cuMemFree",
        &[v(2000, "cuMemFree"), v(3020, "cuMemFree_v2")],
    ),
    (
        "cuMemGetAddressRange",
        &[v(3020, "cuMemGetAddressRange_v2")],
    ),
    ("cuMemAllocManaged", &[v(6000, "cuMemAllocManaged")]),
    ("cuMemCreate", &[v(10020, "cuMemCreate")]),
    ("cuMemRelease", &[v(10020, "cuMemRelease")]),
    (
        "cuMemGetAllocationGranularity",
        &[v(10020, "cuMemGetAllocationGranularity")],
    ),
    ("cuMemAddressReserve", &[v(10020, "cuMemAddressReserve")]),
    ("cuMemAddressFree", &[v(10020, "cuMemAddressFree")]),
    ("cuMemMap", &[v(10020, "cuMemMap")]),
    ("cuMemUnmap", &[v(10020, "cuMemUnmap")]),
    ("cuMemSetAccess", &[v(10020, "cuMemSetAccess")]),
    (
        "cuMemAllocAsync",
        &[
            v(11020, "cuMemAllocAsync"),
            pt(11020, 11020, "cuMemAllocAsync_ptsz"),
        ],
    ),
    (
        "cuMemAllocFromPoolAsync",
        &[
            v(11020, "cuMemAllocFromPoolAsync"),
            pt(11020, 11020, "cuMemAllocFromPoolAsync_ptsz"),
        ],
    ),
    (
        "cuMemFreeAsync",
        &[
            v(11020, "cuMemFreeAsync"),
            pt(11020, 11020, "cuMemFreeAsync_ptsz"),
        ],
    ),
    ("cuMemPoolCreate", &[v(11020, "cuMemPoolCreate")]),
    ("cuMemPoolDestroy", &[v(11020, "cuMemPoolDestroy")]),
    ("cuMemPoolTrimTo", &[v(11020, "cuMemPoolTrimTo")]),
    (
        "cuMemPoolGetAttribute",
        &[v(11020, "cuMemPoolGetAttribute")],
    ),
    (
        "cuMemPoolSetAttribute",
        &[v(11020, "cuMemPoolSetAttribute")],
    ),
    (
        "cuArrayCreate",
        &[v(2000, "cuArrayCreate"), v(3020, "cuArrayCreate_v2")],
    ),
    (
        "cuArray3DCreate",
        &[v(2000, "cuArray3DCreate"), v(3020, "cuArray3DCreate_v2")],
    ),
    ("cuArrayDestroy", &[v(2000, "cuArrayDestroy")]),
    (
        "cuArrayGetMemoryRequirements",
        &[v(11060, "cuArrayGetMemoryRequirements")],
    ),
    (
        "cuMipmappedArrayCreate",
        &[v(5000, "cuMipmappedArrayCreate")],
    ),
    (
        "cuMipmappedArrayDestroy",
        &[v(5000, "cuMipmappedArrayDestroy")],
    ),
    (
        "cuMipmappedArrayGetMemoryRequirements",
        &[v(11060, "cuMipmappedArrayGetMemoryRequirements")],
    ),
    ("cuStreamCreate", &[v(2000, "cuStreamCreate")]),
    (
        "cuStreamCreateWithPriority",
        &[v(5050, "cuStreamCreateWithPriority")],
    ),
    (
        "cuStreamDestroy",
        &[v(2000, "cuStreamDestroy"), v(4000, "cuStreamDestroy_v2")],
    ),
    (
        "cuStreamSynchronize",
        &[
            v(2000, "cuStreamSynchronize"),
            pt(7000, 2000, "cuStreamSynchronize_ptsz"),
        ],
    ),
    (
        "cuStreamQuery",
        &[
            v(2000, "cuStreamQuery"),
            pt(7000, 2000, "cuStreamQuery_ptsz"),
        ],
    ),
    (
        "cuStreamBeginCapture",
        &[
            v(10000, "cuStreamBeginCapture"),
            pt(10000, 10000, "cuStreamBeginCapture_ptsz"),
            v(10010, "cuStreamBeginCapture_v2"),
            pt(10010, 10010, "cuStreamBeginCapture_v2_ptsz"),
        ],
    ),
    (
        "cuStreamEndCapture",
        &[
            v(10000, "cuStreamEndCapture"),
            pt(10000, 10000, "cuStreamEndCapture_ptsz"),
        ],
    ),
    (
        "cuStreamIsCapturing",
        &[
            v(10000, "cuStreamIsCapturing"),
            pt(10000, 10000, "cuStreamIsCapturing_ptsz"),
        ],
    ),
    (
        "cuStreamGetDevice",
        &[
            v(12080, "cuStreamGetDevice"),
            pt(12080, 12080, "cuStreamGetDevice_ptsz"),
        ],
    ),
    (
        "cuThreadExchangeStreamCaptureMode",
        &[v(10010, "cuThreadExchangeStreamCaptureMode")],
    ),
    ("cuEventCreate", &[v(2000, "cuEventCreate")]),
    (
        "cuEventRecord",
        &[
            v(2000, "cuEventRecord"),
            pt(7000, 2000, "cuEventRecord_ptsz"),
        ],
    ),
    ("cuEventQuery", &[v(2000, "cuEventQuery")]),
    ("cuEventSynchronize", &[v(2000, "cuEventSynchronize")]),
    (
        "cuEventElapsedTime",
        &[
            v(2000, "cuEventElapsedTime"),
            v(12080, "cuEventElapsedTime_v2"),
        ],
    ),
    (
        "cuEventDestroy",
        &[v(2000, "cuEventDestroy"), v(4000, "cuEventDestroy_v2")],
    ),
    ("cuModuleLoadData", &[v(2000, "cuModuleLoadData")]),
    ("cuModuleLoadDataEx", &[v(2010, "cuModuleLoadDataEx")]),
    ("cuModuleUnload", &[v(2000, "cuModuleUnload")]),
    ("cuModuleGetFunction", &[v(2000, "cuModuleGetFunction")]),
    ("cuFuncGetAttribute", &[v(2020, "cuFuncGetAttribute")]),
    (
        "cuOccupancyMaxActiveBlocksPerMultiprocessor",
        &[v(6050, "cuOccupancyMaxActiveBlocksPerMultiprocessor")],
    ),
    (
        "cuLaunchKernel",
        &[
            v(4000, "cuLaunchKernel"),
            pt(7000, 4000, "cuLaunchKernel_ptsz"),
        ],
    ),
    (
        "cuLaunchKernelEx",
        &[
            v(11060, "cuLaunchKernelEx"),
            pt(11060, 11060, "cuLaunchKernelEx_ptsz"),
        ],
    ),
    (
        "cuLaunchCooperativeKernel",
        &[
            v(9000, "cuLaunchCooperativeKernel"),
            pt(9000, 9000, "cuLaunchCooperativeKernel_ptsz"),
        ],
    ),
    ("cuGraphCreate", &[v(10000, "cuGraphCreate")]),
    (
        "cuGraphAddKernelNode",
        &[
            v(10000, "cuGraphAddKernelNode"),
            v(12000, "cuGraphAddKernelNode_v2"),
        ],
    ),
    // CUDA 12.0 made cuGraphInstantiate mean cuGraphInstantiateWithFlags (cuda.h:
    // `#define cuGraphInstantiate cuGraphInstantiateWithFlags`; cudaTypedefs.h:
    // `#define PFN_cuGraphInstantiate PFN_cuGraphInstantiateWithFlags_v11040`).
    (
        "cuGraphInstantiate",
        &[
            v(10000, "cuGraphInstantiate"),
            v(11000, "cuGraphInstantiate_v2"),
            v(12000, "cuGraphInstantiateWithFlags"),
        ],
    ),
    (
        "cuGraphInstantiateWithFlags",
        &[v(11040, "cuGraphInstantiateWithFlags")],
    ),
    (
        "cuGraphLaunch",
        &[
            v(10000, "cuGraphLaunch"),
            pt(10000, 10000, "cuGraphLaunch_ptsz"),
        ],
    ),
    ("cuGraphExecDestroy", &[v(10000, "cuGraphExecDestroy")]),
    ("cuGraphDestroy", &[v(10000, "cuGraphDestroy")]),
    (
        "cuGetProcAddress",
        &[
            v(11030, "cuGetProcAddress"),
            v(12000, "cuGetProcAddress_v2"),
        ],
    ),
];

/// The outcome of a lookup: a symbol, or the `CUdriverProcAddressQueryResult` of a failure.
#[derive(Debug, PartialEq, Eq)]
pub enum Choice {
    Symbol(&'static str),
    NotFound,
    VersionNotSufficient,
}

/// Chooses the variant: the newest legacy ABI introduced at or before `version`; with the per-thread
/// flag, that ABI's per-thread form if it exists by `version` (else the legacy one, as cuda.h says).
pub fn choose(symbol: &str, version: i32, per_thread: bool) -> Choice {
    let Some((_, variants)) = TABLE.iter().find(|(base, _)| *base == symbol) else {
        return Choice::NotFound;
    };
    let Some(legacy) = variants
        .iter()
        .filter(|x| !x.per_thread && x.version <= version)
        .max_by_key(|x| x.version)
    else {
        return Choice::VersionNotSufficient;
    };
    if per_thread {
        if let Some(p) = variants
            .iter()
            .find(|x| x.per_thread && x.abi == legacy.abi && x.version <= version)
        {
            return Choice::Symbol(p.symbol);
        }
    }
    Choice::Symbol(legacy.symbol)
}

/// Which address `cuGetProcAddress` hands out for the variant it chose
/// (`GPUPOOL_STANDIN_PROC_ADDRESS`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Addresses {
    /// `exported` (the default): the driver's exported symbol of the variant, as the H200's
    /// driver did for the entry points checked.
    Exported,
    /// `internal`: a private thunk per symbol that jumps to it, which no `dlsym` returns, as a
    /// driver may hand out its internal entry points.
    Internal,
    /// `interposed`: `dlsym(RTLD_DEFAULT, <variant>)`, the global lookup, which finds a preloaded
    /// library's exported wrapper first: what a driver (or an interposer) whose table resolves
    /// through symbol interposition hands out. The driver's own symbol when the lookup finds none.
    Interposed,
}

/// How `cuGetProcAddress` answers, from the process's environment (both settings are real drivers'
/// latitude, so that the library is tested against either answer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Answers {
    pub addresses: Addresses,
    /// `GPUPOOL_STANDIN_PROC_NOT_FOUND=success`: a symbol not given (unknown, or a version too
    /// old) answers `CUDA_SUCCESS` with a NULL pointer, as cuda.h's comment says. Default `error`:
    /// `CUDA_ERROR_NOT_FOUND`, as drivers answer.
    pub not_found_success: bool,
}

pub const PROC_ADDRESS: &str = "GPUPOOL_STANDIN_PROC_ADDRESS";
pub const PROC_NOT_FOUND: &str = "GPUPOOL_STANDIN_PROC_NOT_FOUND";

/// Reads the two settings; a value that is neither choice is an error naming the variable (a test
/// with a typo must not silently run the default).
pub fn answers(address: Option<&str>, not_found: Option<&str>) -> Result<Answers, String> {
    let addresses = match address {
        None | Some("exported") => Addresses::Exported,
        Some("internal") => Addresses::Internal,
        Some("interposed") => Addresses::Interposed,
        Some(other) => {
            return Err(format!(
                "{PROC_ADDRESS}={other:?}: expected exported, internal or interposed"
            ))
        }
    };
    let not_found_success = match not_found {
        None | Some("error") => false,
        Some("success") => true,
        Some(other) => {
            return Err(format!(
                "{PROC_NOT_FOUND}={other:?}: expected error or success"
            ))
        }
    };
    Ok(Answers {
        addresses,
        not_found_success,
    })
}

fn process_answers() -> Result<Answers, CUresult> {
    static ANSWERS: std::sync::OnceLock<Result<Answers, CUresult>> = std::sync::OnceLock::new();
    *ANSWERS.get_or_init(|| {
        let var = |name| std::env::var(name).ok();
        answers(var(PROC_ADDRESS).as_deref(), var(PROC_NOT_FOUND).as_deref()).map_err(|e| {
            eprintln!("gpupool-standin-cuda: {e}");
            CUDA_ERROR_INVALID_VALUE
        })
    })
}

/// The global lookup of `symbol`: a preloaded object's export of the name comes first, then ours
/// (the lookup starts from the caller's scope, which has this library in it).
fn interposed(symbol: &str) -> Option<*mut c_void> {
    let name = std::ffi::CString::new(symbol).ok()?;
    // SAFETY: a NUL-terminated name; RTLD_DEFAULT is a valid handle.
    let addr = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    (!addr.is_null()).then_some(addr)
}

unsafe fn lookup(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: i32,
    flags: u64,
    status: *mut i32,
) -> Result<(), CUresult> {
    if symbol.is_null()
        || pfn.is_null()
        || flags
            & !(CU_GET_PROC_ADDRESS_LEGACY_STREAM | CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM)
            != 0
    {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let answers = process_answers()?;
    let name = CStr::from_ptr(symbol).to_str().unwrap_or("");
    let choice = choose(
        name,
        version,
        flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM != 0,
    );
    let (addr, code) = match choice {
        Choice::Symbol(s) => {
            let addr = match answers.addresses {
                Addresses::Exported => crate::symbols::address_of(s),
                Addresses::Internal => crate::symbols::thunks::address_of(s),
                Addresses::Interposed => interposed(s).or_else(|| crate::symbols::address_of(s)),
            };
            (addr, CU_GET_PROC_ADDRESS_SUCCESS)
        }
        Choice::NotFound => (None, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND),
        Choice::VersionNotSufficient => (None, CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT),
    };
    *pfn = addr.unwrap_or(std::ptr::null_mut());
    if !status.is_null() {
        *status = code;
    }
    // cuda.h documents CUDA_SUCCESS with a NULL pointer here; drivers answer CUDA_ERROR_NOT_FOUND
    // (ZLUDA, which reproduces the driver's behaviour, does the same). The stricter answer is the
    // default; GPUPOOL_STANDIN_PROC_NOT_FOUND=success gives cuda.h's.
    match addr {
        Some(_) => Ok(()),
        None if answers.not_found_success => Ok(()),
        None => Err(CUDA_ERROR_NOT_FOUND),
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: i32,
    flags: u64,
    status: *mut i32,
) -> CUresult {
    entry(|| lookup(symbol, pfn, version, flags, status))
}

/// The CUDA 11.3 form, without the status.
#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: i32,
    flags: u64,
) -> CUresult {
    entry(|| lookup(symbol, pfn, version, flags, std::ptr::null_mut()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_choose_the_abi_and_the_flag_the_stream_form() {
        assert_eq!(
            choose("cuMemAlloc", 3010, false),
            Choice::Symbol("cuMemAlloc")
        );
        assert_eq!(
            choose("cuMemAlloc", 3020, false),
            Choice::Symbol("cuMemAlloc_v2")
        );
        assert_eq!(
            choose("cuMemAlloc", 12090, true),
            Choice::Symbol("cuMemAlloc_v2")
        );
        assert_eq!(
            choose("cuLaunchKernel", 12000, false),
            Choice::Symbol("cuLaunchKernel")
        );
        assert_eq!(
            choose("cuLaunchKernel", 12000, true),
            Choice::Symbol("cuLaunchKernel_ptsz")
        );
        // The per-thread form arrived with CUDA 7.0.
        assert_eq!(
            choose("cuLaunchKernel", 6050, true),
            Choice::Symbol("cuLaunchKernel")
        );
        assert_eq!(
            choose("cuLaunchKernel", 3020, false),
            Choice::VersionNotSufficient
        );
        assert_eq!(
            choose("cuStreamBeginCapture", 10000, true),
            Choice::Symbol("cuStreamBeginCapture_ptsz")
        );
        assert_eq!(
            choose("cuStreamBeginCapture", 12000, true),
            Choice::Symbol("cuStreamBeginCapture_v2_ptsz")
        );
        assert_eq!(
            choose("cuGraphInstantiate", 11000, false),
            Choice::Symbol("cuGraphInstantiate_v2")
        );
        assert_eq!(
            choose("cuGraphInstantiate", 12000, false),
            Choice::Symbol("cuGraphInstantiateWithFlags")
        );
        assert_eq!(
            choose("cuMemAllocAsync", 11010, false),
            Choice::VersionNotSufficient
        );
        assert_eq!(choose("cuNoSuchThing", 12000, false), Choice::NotFound);
    }

    #[test]
    fn every_variant_is_exported_and_has_its_own_thunk() {
        // symbol -> its thunk; a symbol may be a variant of two bases (cuGraphInstantiateWithFlags).
        let mut thunks = std::collections::HashMap::new();
        for (base, variants) in TABLE {
            for x in *variants {
                let exported = crate::symbols::address_of(x.symbol);
                assert!(exported.is_some(), "{base}: {} is not exported", x.symbol);
                let thunk = crate::symbols::thunks::address_of(x.symbol).expect("a thunk");
                assert_ne!(Some(thunk), exported, "{}", x.symbol);
                thunks.insert(x.symbol, thunk as usize);
            }
        }
        let distinct: std::collections::HashSet<usize> = thunks.values().copied().collect();
        assert_eq!(distinct.len(), thunks.len(), "every symbol its own thunk");
    }

    #[test]
    fn the_answers_are_read_strictly() {
        assert_eq!(
            answers(None, None),
            Ok(Answers {
                addresses: Addresses::Exported,
                not_found_success: false
            })
        );
        assert_eq!(
            answers(Some("internal"), Some("success")),
            Ok(Answers {
                addresses: Addresses::Internal,
                not_found_success: true
            })
        );
        assert_eq!(
            answers(Some("interposed"), None).map(|a| a.addresses),
            Ok(Addresses::Interposed)
        );
        let err = answers(Some("inside"), None).unwrap_err();
        assert!(
            err.contains(PROC_ADDRESS) && err.contains("inside"),
            "{err}"
        );
        assert!(answers(None, Some("null"))
            .unwrap_err()
            .contains(PROC_NOT_FOUND));
    }
}

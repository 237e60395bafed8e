//! Which exported variant of a driver function has which ABI, by CUDA version and stream flag
//! (`cudaTypedefs.h`'s `PFN_<name>_v<version>[_ptsz]`). Pure tables.
//!
//! `cuGetProcAddress` takes a base name (`cuMemAlloc`), a CUDA version and flags, and the driver
//! picks the variant (`cuMemAlloc_v2`, `cuLaunchKernel_ptsz`, ...). We let the driver pick, then
//! recognise its choice by comparing the returned address with the address of each variant's
//! exported symbol. These tables are the fallback for an address that matches no exported symbol:
//! the variant the version and flags select, which is what the driver would have given.

use crate::cuda::CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;

/// One exported variant: its symbol name, the first CUDA version whose `cuGetProcAddress` returns
/// it, and whether it is the per-thread-default-stream form (`_ptsz`/`_ptds`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Variant {
    pub name: &'static str,
    pub since: i32,
    pub per_thread: bool,
}

/// A base name as `cuGetProcAddress` is asked for it, and its variants.
#[derive(Debug)]
pub struct Family {
    pub base: &'static str,
    pub variants: &'static [Variant],
}

const fn v(name: &'static str, since: i32) -> Variant {
    Variant {
        name,
        since,
        per_thread: false,
    }
}

const fn ptsz(name: &'static str, since: i32) -> Variant {
    Variant {
        name,
        since,
        per_thread: true,
    }
}

/// The driver functions we wrap, by family. Every variant named here has a wrapper.
pub const FAMILIES: &[Family] = &[
    Family {
        base: "cuInit",
        variants: &[v("cuInit", 2000)],
    },
    Family {
        base: "cuGetProcAddress",
        variants: &[
            v("cuGetProcAddress", 11030),
            v("cuGetProcAddress_v2", 12000),
        ],
    },
    Family {
        base: "cuDeviceTotalMem",
        variants: &[v("cuDeviceTotalMem", 2000), v("cuDeviceTotalMem_v2", 3020)],
    },
    Family {
        base: "cuMemGetInfo",
        variants: &[v("cuMemGetInfo", 2000), v("cuMemGetInfo_v2", 3020)],
    },
    Family {
        base: "cuMemAlloc",
        variants: &[v("cuMemAlloc", 2000), v("cuMemAlloc_v2", 3020)],
    },
    Family {
        base: "cuMemAllocPitch",
        variants: &[v("cuMemAllocPitch", 2000), v("cuMemAllocPitch_v2", 3020)],
    },
    Family {
        base: "cuMemFree",
        variants: &[v("cuMemFree", 2000), v("cuMemFree_v2", 3020)],
    },
    Family {
        base: "cuMemAllocManaged",
        variants: &[v("cuMemAllocManaged", 6000)],
    },
    Family {
        base: "cuMemCreate",
        variants: &[v("cuMemCreate", 10020)],
    },
    Family {
        base: "cuMemRelease",
        variants: &[v("cuMemRelease", 10020)],
    },
    Family {
        base: "cuMemMap",
        variants: &[v("cuMemMap", 10020)],
    },
    Family {
        base: "cuMemUnmap",
        variants: &[v("cuMemUnmap", 10020)],
    },
    Family {
        base: "cuMemAllocAsync",
        variants: &[
            v("cuMemAllocAsync", 11020),
            ptsz("cuMemAllocAsync_ptsz", 11020),
        ],
    },
    Family {
        base: "cuMemAllocFromPoolAsync",
        variants: &[
            v("cuMemAllocFromPoolAsync", 11020),
            ptsz("cuMemAllocFromPoolAsync_ptsz", 11020),
        ],
    },
    Family {
        base: "cuMemFreeAsync",
        variants: &[
            v("cuMemFreeAsync", 11020),
            ptsz("cuMemFreeAsync_ptsz", 11020),
        ],
    },
    Family {
        base: "cuMemPoolCreate",
        variants: &[v("cuMemPoolCreate", 11020)],
    },
    Family {
        base: "cuMemPoolDestroy",
        variants: &[v("cuMemPoolDestroy", 11020)],
    },
    Family {
        base: "cuDeviceGetDefaultMemPool",
        variants: &[v("cuDeviceGetDefaultMemPool", 11020)],
    },
    Family {
        base: "cuDeviceGetMemPool",
        variants: &[v("cuDeviceGetMemPool", 11020)],
    },
    Family {
        base: "cuArrayCreate",
        variants: &[v("cuArrayCreate", 2000), v("cuArrayCreate_v2", 3020)],
    },
    Family {
        base: "cuArray3DCreate",
        variants: &[v("cuArray3DCreate", 2000), v("cuArray3DCreate_v2", 3020)],
    },
    Family {
        base: "cuMipmappedArrayCreate",
        variants: &[v("cuMipmappedArrayCreate", 5000)],
    },
    Family {
        base: "cuArrayDestroy",
        variants: &[v("cuArrayDestroy", 2000)],
    },
    Family {
        base: "cuMipmappedArrayDestroy",
        variants: &[v("cuMipmappedArrayDestroy", 5000)],
    },
    Family {
        base: "cuDevicePrimaryCtxRetain",
        variants: &[v("cuDevicePrimaryCtxRetain", 7000)],
    },
    Family {
        base: "cuDevicePrimaryCtxRelease",
        variants: &[
            v("cuDevicePrimaryCtxRelease", 7000),
            v("cuDevicePrimaryCtxRelease_v2", 11000),
        ],
    },
    Family {
        base: "cuDevicePrimaryCtxReset",
        variants: &[
            v("cuDevicePrimaryCtxReset", 7000),
            v("cuDevicePrimaryCtxReset_v2", 11000),
        ],
    },
    Family {
        base: "cuCtxDestroy",
        variants: &[v("cuCtxDestroy", 2000), v("cuCtxDestroy_v2", 4000)],
    },
    Family {
        base: "cuCtxCreate",
        variants: &[
            v("cuCtxCreate", 2000),
            v("cuCtxCreate_v2", 3020),
            v("cuCtxCreate_v3", 11040),
            v("cuCtxCreate_v4", 12050),
        ],
    },
    Family {
        base: "cuLaunchKernel",
        variants: &[v("cuLaunchKernel", 4000), ptsz("cuLaunchKernel_ptsz", 7000)],
    },
    Family {
        base: "cuLaunchKernelEx",
        variants: &[
            v("cuLaunchKernelEx", 11060),
            ptsz("cuLaunchKernelEx_ptsz", 11060),
        ],
    },
    Family {
        base: "cuLaunchCooperativeKernel",
        variants: &[
            v("cuLaunchCooperativeKernel", 9000),
            ptsz("cuLaunchCooperativeKernel_ptsz", 9000),
        ],
    },
    Family {
        base: "cuGraphLaunch",
        variants: &[v("cuGraphLaunch", 10000), ptsz("cuGraphLaunch_ptsz", 10000)],
    },
];

/// The family a `cuGetProcAddress` symbol belongs to (the base name, or a variant's own name).
pub fn family_of(symbol: &[u8]) -> Option<&'static Family> {
    FAMILIES.iter().find(|f| {
        f.base.as_bytes() == symbol || f.variants.iter().any(|v| v.name.as_bytes() == symbol)
    })
}

/// The variant the driver returns for `version` and `flags`: the per-thread form when asked for
/// and available at that version, else the newest legacy variant the version reaches. `None`
/// when the version predates every variant (the driver answers "version not sufficient").
pub fn select(family: &Family, version: i32, flags: u64) -> Option<&'static Variant> {
    let newest = |per_thread: bool| {
        family
            .variants
            .iter()
            .filter(|v| v.per_thread == per_thread && v.since <= version)
            .max_by_key(|v| v.since)
    };
    if flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM != 0 {
        if let Some(variant) = newest(true) {
            return Some(variant);
        }
    }
    newest(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PT: u64 = CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;

    fn pick(symbol: &str, version: i32, flags: u64) -> Option<&'static str> {
        select(family_of(symbol.as_bytes()).expect("known"), version, flags).map(|v| v.name)
    }

    #[test]
    fn versions_pick_the_abi_the_typedefs_name() {
        assert_eq!(pick("cuMemAlloc", 2000, 0), Some("cuMemAlloc"));
        assert_eq!(pick("cuMemAlloc", 3010, 0), Some("cuMemAlloc"));
        assert_eq!(pick("cuMemAlloc", 3020, 0), Some("cuMemAlloc_v2"));
        assert_eq!(pick("cuMemAlloc", 12090, 0), Some("cuMemAlloc_v2"));
        assert_eq!(pick("cuCtxCreate", 11040, 0), Some("cuCtxCreate_v3"));
        assert_eq!(pick("cuCtxCreate", 12050, 0), Some("cuCtxCreate_v4"));
        assert_eq!(pick("cuGetProcAddress", 11080, 0), Some("cuGetProcAddress"));
        assert_eq!(
            pick("cuGetProcAddress", 12000, 0),
            Some("cuGetProcAddress_v2")
        );
    }

    #[test]
    fn the_per_thread_flag_picks_ptsz_from_its_own_version() {
        assert_eq!(
            pick("cuLaunchKernel", 12000, PT),
            Some("cuLaunchKernel_ptsz")
        );
        assert_eq!(pick("cuLaunchKernel", 12000, 0), Some("cuLaunchKernel"));
        // cuLaunchKernel_ptsz appeared in 7.0: an older version gets the legacy stream form.
        assert_eq!(pick("cuLaunchKernel", 6050, PT), Some("cuLaunchKernel"));
        assert_eq!(pick("cuGraphLaunch", 10000, PT), Some("cuGraphLaunch_ptsz"));
        assert_eq!(
            pick("cuMemFreeAsync", 11020, PT),
            Some("cuMemFreeAsync_ptsz")
        );
        // Functions without a stream have no per-thread form: the flag changes nothing.
        assert_eq!(pick("cuMemAlloc", 12000, PT), Some("cuMemAlloc_v2"));
    }

    #[test]
    fn a_version_before_the_function_existed_selects_nothing() {
        assert_eq!(pick("cuMemAllocAsync", 11010, 0), None);
        assert_eq!(pick("cuLaunchKernelEx", 11000, PT), None);
    }

    #[test]
    fn families_are_found_by_base_or_variant_name() {
        assert_eq!(
            family_of(b"cuMemAlloc_v2").map(|f| f.base),
            Some("cuMemAlloc")
        );
        assert_eq!(
            family_of(b"cuLaunchKernel_ptsz").map(|f| f.base),
            Some("cuLaunchKernel")
        );
        assert!(family_of(b"cuMemcpy").is_none());
        assert!(family_of(b"cuMemAllocHost").is_none());
    }

    #[test]
    fn no_variant_is_listed_twice() {
        let mut names: Vec<&str> = FAMILIES
            .iter()
            .flat_map(|f| f.variants.iter().map(|v| v.name))
            .collect();
        let count = names.len();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), count);
    }
}

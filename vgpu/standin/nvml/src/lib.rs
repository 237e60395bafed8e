//! Test-only: a stand-in `libnvidia-ml.so.1` over the simulated cards of `gpupool-standin-device`.
//!
//! Types and codes mirror `nvml.h` (NVML API 12, as nvml-wrapper-sys 0.10 binds it and pynvml 13
//! declares it): `nvmlMemory_t`, `nvmlMemory_v2_t` with its `version` (`NVML_STRUCT_VERSION(Memory,
//! 2)` = size | 2 << 24), `nvmlProcessInfo_v1_t` (16 bytes, the unversioned
//! `nvmlDeviceGetComputeRunningProcesses`) and `nvmlProcessInfo_t` = v2 = v3 (24 bytes),
//! `nvmlProcessUtilizationSample_t`, `nvmlUtilization_t`. NVML ignores `CUDA_VISIBLE_DEVICES`: its
//! indices are the cards' indices in the state file.
#![allow(non_snake_case, non_camel_case_types, clippy::missing_safety_doc)]

use gpupool_standin_device::Sim;
use std::ffi::{c_char, CStr};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;

pub type nvmlReturn_t = u32;
pub const NVML_SUCCESS: nvmlReturn_t = 0;
pub const NVML_ERROR_UNINITIALIZED: nvmlReturn_t = 1;
pub const NVML_ERROR_INVALID_ARGUMENT: nvmlReturn_t = 2;
pub const NVML_ERROR_NOT_SUPPORTED: nvmlReturn_t = 3;
pub const NVML_ERROR_NOT_FOUND: nvmlReturn_t = 6;
pub const NVML_ERROR_INSUFFICIENT_SIZE: nvmlReturn_t = 7;
pub const NVML_ERROR_DRIVER_NOT_LOADED: nvmlReturn_t = 9;
pub const NVML_ERROR_ARGUMENT_VERSION_MISMATCH: nvmlReturn_t = 25;
pub const NVML_ERROR_UNKNOWN: nvmlReturn_t = 999;

/// `nvmlMemory_t`.
#[repr(C)]
pub struct nvmlMemory_t {
    pub total: u64,
    pub free: u64,
    pub used: u64,
}

/// `nvmlMemory_v2_t`.
#[repr(C)]
pub struct nvmlMemory_v2_t {
    pub version: u32,
    pub total: u64,
    pub reserved: u64,
    pub free: u64,
    pub used: u64,
}

/// `nvmlMemory_v2` = `NVML_STRUCT_VERSION(Memory, 2)`.
pub const NVML_MEMORY_V2: u32 = std::mem::size_of::<nvmlMemory_v2_t>() as u32 | (2 << 24);

/// `nvmlProcessInfo_v1_t`.
#[repr(C)]
pub struct nvmlProcessInfo_v1_t {
    pub pid: u32,
    pub used_gpu_memory: u64,
}

/// `nvmlProcessInfo_v2_t`, which `nvmlProcessInfo_t` (v3) is too.
#[repr(C)]
pub struct nvmlProcessInfo_t {
    pub pid: u32,
    pub used_gpu_memory: u64,
    pub gpu_instance_id: u32,
    pub compute_instance_id: u32,
}

/// `nvmlProcessUtilizationSample_t`.
#[repr(C)]
pub struct nvmlProcessUtilizationSample_t {
    pub pid: u32,
    pub time_stamp: u64,
    pub sm_util: u32,
    pub mem_util: u32,
    pub enc_util: u32,
    pub dec_util: u32,
}

/// `nvmlUtilization_t`.
#[repr(C)]
pub struct nvmlUtilization_t {
    pub gpu: u32,
    pub memory: u32,
}

/// An `nvmlDevice_t` points at one of these.
pub struct Device {
    index: usize,
}

pub type nvmlDevice_t = *const Device;

/// MIG is off on the stand-in's cards: NVML reports instance ids as 0xFFFFFFFF then.
const NO_INSTANCE: u32 = 0xFFFF_FFFF;

struct Nvml {
    sim: Sim,
    devices: Vec<Device>,
}

static NVML: OnceLock<Result<Nvml, nvmlReturn_t>> = OnceLock::new();
/// nvmlInit calls not yet matched by nvmlShutdown (NVML counts them).
static INITS: AtomicU32 = AtomicU32::new(0);

fn entry(f: impl FnOnce() -> Result<(), nvmlReturn_t>) -> nvmlReturn_t {
    match std::panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => NVML_SUCCESS,
        Ok(Err(e)) => e,
        Err(_) => {
            eprintln!("gpupool-standin-nvml: internal error (panic) in an entry point");
            NVML_ERROR_UNKNOWN
        }
    }
}

fn nvml() -> Result<&'static Nvml, nvmlReturn_t> {
    if INITS.load(Ordering::Acquire) == 0 {
        return Err(NVML_ERROR_UNINITIALIZED);
    }
    match NVML.get() {
        Some(Ok(n)) => Ok(n),
        _ => Err(NVML_ERROR_UNINITIALIZED),
    }
}

unsafe fn device(handle: nvmlDevice_t) -> Result<(&'static Nvml, usize), nvmlReturn_t> {
    let n = nvml()?;
    let range = n.devices.as_ptr_range();
    if handle.is_null() || !range.contains(&handle) {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    Ok((n, (*handle).index))
}

fn init() -> Result<(), nvmlReturn_t> {
    let opened = NVML.get_or_init(|| match Sim::open_from_env() {
        Ok(sim) => {
            let devices = (0..sim.device_count())
                .map(|index| Device { index })
                .collect();
            Ok(Nvml { sim, devices })
        }
        Err(e) => {
            eprintln!("gpupool-standin-nvml: {e}");
            Err(NVML_ERROR_DRIVER_NOT_LOADED)
        }
    });
    opened.as_ref().map_err(|e| *e)?;
    INITS.fetch_add(1, Ordering::AcqRel);
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn nvmlInit_v2() -> nvmlReturn_t {
    entry(init)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlInit() -> nvmlReturn_t {
    entry(init)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlInitWithFlags(flags: u32) -> nvmlReturn_t {
    entry(|| {
        // NVML_INIT_FLAG_NO_GPUS (1) and NVML_INIT_FLAG_NO_ATTACH (2).
        if flags & !3 != 0 {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        init()
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlShutdown() -> nvmlReturn_t {
    entry(|| {
        INITS
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .map_err(|_| NVML_ERROR_UNINITIALIZED)?;
        Ok(())
    })
}

const ERROR_STRINGS: &[(nvmlReturn_t, &CStr)] = &[
    (NVML_SUCCESS, c"Success"),
    (NVML_ERROR_UNINITIALIZED, c"Uninitialized"),
    (NVML_ERROR_INVALID_ARGUMENT, c"Invalid Argument"),
    (NVML_ERROR_NOT_SUPPORTED, c"Not Supported"),
    (NVML_ERROR_NOT_FOUND, c"Not Found"),
    (NVML_ERROR_INSUFFICIENT_SIZE, c"Insufficient Size"),
    (NVML_ERROR_DRIVER_NOT_LOADED, c"Driver Not Loaded"),
    (
        NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
        c"Argument version mismatch",
    ),
    (NVML_ERROR_UNKNOWN, c"Unknown Error"),
];

/// Answers without initialisation, as NVML does.
#[no_mangle]
pub unsafe extern "C" fn nvmlErrorString(result: nvmlReturn_t) -> *const c_char {
    ERROR_STRINGS
        .iter()
        .find(|(c, _)| *c == result)
        .map(|(_, s)| s.as_ptr())
        .unwrap_or(c"Unknown Error".as_ptr())
}

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion(version: *mut i32) -> nvmlReturn_t {
    entry(|| {
        nvml()?;
        if version.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        *version = 12090;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(version: *mut i32) -> nvmlReturn_t {
    nvmlSystemGetCudaDriverVersion(version)
}

unsafe fn count(out: *mut u32) -> Result<(), nvmlReturn_t> {
    let n = nvml()?;
    if out.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    *out = n.devices.len() as u32;
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(out: *mut u32) -> nvmlReturn_t {
    entry(|| count(out))
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCount(out: *mut u32) -> nvmlReturn_t {
    entry(|| count(out))
}

unsafe fn by_index(index: u32, out: *mut nvmlDevice_t) -> Result<(), nvmlReturn_t> {
    let n = nvml()?;
    if out.is_null() || index as usize >= n.devices.len() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    *out = &n.devices[index as usize];
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: u32,
    out: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    entry(|| by_index(index, out))
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex(
    index: u32,
    out: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    entry(|| by_index(index, out))
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(
    uuid: *const c_char,
    out: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    entry(|| {
        let n = nvml()?;
        if uuid.is_null() || out.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let wanted = CStr::from_ptr(uuid).to_string_lossy();
        let d = n
            .devices
            .iter()
            .find(|d| n.sim.device(d.index).uuid_string() == wanted)
            .ok_or(NVML_ERROR_NOT_FOUND)?;
        *out = d;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetIndex(dev: nvmlDevice_t, index: *mut u32) -> nvmlReturn_t {
    entry(|| {
        let (_, i) = device(dev)?;
        if index.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        *index = i as u32;
        Ok(())
    })
}

unsafe fn copy_string(text: &str, out: *mut c_char, length: u32) -> Result<(), nvmlReturn_t> {
    if out.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    if (length as usize) < text.len() + 1 {
        return Err(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    std::ptr::copy_nonoverlapping(text.as_ptr(), out as *mut u8, text.len());
    *out.add(text.len()) = 0;
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    dev: nvmlDevice_t,
    uuid: *mut c_char,
    length: u32,
) -> nvmlReturn_t {
    entry(|| {
        let (n, i) = device(dev)?;
        copy_string(&n.sim.device(i).uuid_string(), uuid, length)
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetName(
    dev: nvmlDevice_t,
    name: *mut c_char,
    length: u32,
) -> nvmlReturn_t {
    entry(|| {
        let (n, i) = device(dev)?;
        copy_string(
            &format!(
                "gpupool stand-in GPU ({} GiB)",
                n.sim.device(i).memory >> 30
            ),
            name,
            length,
        )
    })
}

/// v1: `used` counts what the driver reserves (total = free + used).
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    dev: nvmlDevice_t,
    memory: *mut nvmlMemory_t,
) -> nvmlReturn_t {
    entry(|| {
        let (n, i) = device(dev)?;
        if memory.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let m = n.sim.memory(i);
        let free = m.free();
        *memory = nvmlMemory_t {
            total: m.total,
            free,
            used: m.total - free,
        };
        Ok(())
    })
}

/// v2: the caller sets `version`; `reserved` is reported apart and left out of `used`
/// (total = reserved + free + used), as nvidia-smi shows it.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    dev: nvmlDevice_t,
    memory: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    entry(|| {
        let (n, i) = device(dev)?;
        if memory.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        if (*memory).version != NVML_MEMORY_V2 {
            return Err(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
        }
        let m = n.sim.memory(i);
        let free = m.free();
        *memory = nvmlMemory_v2_t {
            version: NVML_MEMORY_V2,
            total: m.total,
            reserved: m.reserved,
            free,
            used: m.total - m.reserved.min(m.total) - free,
        };
        Ok(())
    })
}

/// The size-negotiating list protocol of NVML: with too small a buffer (or none), the count needed
/// and `NVML_ERROR_INSUFFICIENT_SIZE`; with no processes, 0 and success.
unsafe fn processes<T>(
    dev: nvmlDevice_t,
    count: *mut u32,
    infos: *mut T,
    make: impl Fn(u32, u64) -> T,
) -> Result<(), nvmlReturn_t> {
    let (n, i) = device(dev)?;
    if count.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    let list = n.sim.processes(i);
    if list.len() > *count as usize || (infos.is_null() && !list.is_empty()) {
        *count = list.len() as u32;
        return Err(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    for (k, p) in list.iter().enumerate() {
        infos.add(k).write(make(p.pid, p.memory));
    }
    *count = list.len() as u32;
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses(
    dev: nvmlDevice_t,
    count: *mut u32,
    infos: *mut nvmlProcessInfo_v1_t,
) -> nvmlReturn_t {
    entry(|| {
        processes(dev, count, infos, |pid, used_gpu_memory| {
            nvmlProcessInfo_v1_t {
                pid,
                used_gpu_memory,
            }
        })
    })
}

fn info_v3(pid: u32, used_gpu_memory: u64) -> nvmlProcessInfo_t {
    nvmlProcessInfo_t {
        pid,
        used_gpu_memory,
        gpu_instance_id: NO_INSTANCE,
        compute_instance_id: NO_INSTANCE,
    }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v2(
    dev: nvmlDevice_t,
    count: *mut u32,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    entry(|| processes(dev, count, infos, info_v3))
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    dev: nvmlDevice_t,
    count: *mut u32,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    entry(|| processes(dev, count, infos, info_v3))
}

/// Per-process samples newer than `last_seen` (microseconds since the epoch; 0: all kept): `smUtil`
/// is the share of the sample window in which the process had work on the card (kernels submitted
/// and not yet complete), so processes that time-slice a saturated card all read near 100, as on
/// the H200. A process without work in the window has no sample. Without a buffer, or with too
/// small a one, the count needed and `NVML_ERROR_INSUFFICIENT_SIZE`; with no sample at all,
/// `NVML_ERROR_NOT_FOUND`.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetProcessUtilization(
    dev: nvmlDevice_t,
    utilization: *mut nvmlProcessUtilizationSample_t,
    count: *mut u32,
    last_seen: u64,
) -> nvmlReturn_t {
    entry(|| {
        let (n, i) = device(dev)?;
        if count.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let samples = n.sim.process_samples(i, last_seen);
        if samples.is_empty() {
            return Err(NVML_ERROR_NOT_FOUND);
        }
        if utilization.is_null() || (*count as usize) < samples.len() {
            *count = samples.len() as u32;
            return Err(NVML_ERROR_INSUFFICIENT_SIZE);
        }
        for (k, s) in samples.iter().enumerate() {
            utilization.add(k).write(nvmlProcessUtilizationSample_t {
                pid: s.pid,
                time_stamp: s.timestamp_us,
                sm_util: s.sm_util,
                mem_util: 0,
                enc_util: 0,
                dec_util: 0,
            });
        }
        *count = samples.len() as u32;
        Ok(())
    })
}

/// `gpu`: percent of the last sample period during which the card ran a kernel.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    dev: nvmlDevice_t,
    utilization: *mut nvmlUtilization_t,
) -> nvmlReturn_t {
    entry(|| {
        let (n, i) = device(dev)?;
        if utilization.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        *utilization = nvmlUtilization_t {
            gpu: n.sim.device_utilization(i),
            memory: 0,
        };
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn layouts_match_nvml_h() {
        assert_eq!(NVML_MEMORY_V2, 0x0200_0028);
        assert_eq!(size_of::<nvmlProcessInfo_v1_t>(), 16);
        assert_eq!(size_of::<nvmlProcessInfo_t>(), 24);
        assert_eq!(offset_of!(nvmlProcessInfo_t, gpu_instance_id), 16);
        assert_eq!(size_of::<nvmlProcessUtilizationSample_t>(), 32);
        assert_eq!(offset_of!(nvmlProcessUtilizationSample_t, sm_util), 16);
    }
}

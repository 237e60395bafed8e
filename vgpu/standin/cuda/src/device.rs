//! Initialisation, versions, error strings and device queries.
#![allow(non_snake_case, clippy::missing_safety_doc)]

use crate::driver::{self, driver, entry, DRIVER_VERSION};
use crate::ffi::*;
use std::ffi::{c_char, CStr};

#[no_mangle]
pub unsafe extern "C" fn cuInit(flags: u32) -> CUresult {
    entry(|| driver::init(flags))
}

/// Answers before `cuInit`, as the real driver does.
#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut i32) -> CUresult {
    entry(|| {
        if version.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        *version = DRIVER_VERSION;
        Ok(())
    })
}

/// Static NUL-terminated copies of the names and descriptions.
fn cstr_table() -> &'static Vec<(CUresult, std::ffi::CString, std::ffi::CString)> {
    static TABLE: std::sync::OnceLock<Vec<(CUresult, std::ffi::CString, std::ffi::CString)>> =
        std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        ERRORS
            .iter()
            .map(|(c, n, s)| {
                (
                    *c,
                    std::ffi::CString::new(*n).unwrap(),
                    std::ffi::CString::new(*s).unwrap(),
                )
            })
            .collect()
    })
}

unsafe fn error_text(code: CUresult, out: *mut *const c_char, name: bool) -> Result<(), CUresult> {
    if out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    match cstr_table().iter().find(|(c, _, _)| *c == code) {
        Some((_, n, s)) => {
            *out = if name { n.as_ptr() } else { s.as_ptr() };
            Ok(())
        }
        None => {
            *out = std::ptr::null();
            Err(CUDA_ERROR_INVALID_VALUE)
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorName(error: CUresult, pstr: *mut *const c_char) -> CUresult {
    entry(|| error_text(error, pstr, true))
}

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorString(error: CUresult, pstr: *mut *const c_char) -> CUresult {
    entry(|| error_text(error, pstr, false))
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut i32) -> CUresult {
    entry(|| {
        let d = driver()?;
        if count.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        *count = d.visible.len() as i32;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(device: *mut CUdevice, ordinal: i32) -> CUresult {
    entry(|| {
        let d = driver()?;
        if device.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        d.ordinal(ordinal)?;
        *device = ordinal;
        Ok(())
    })
}

/// `gpupool stand-in GPU (<GiB> GiB)`: a name no real card has, so no test mistakes one for the other.
pub fn device_name(memory: u64) -> String {
    format!("gpupool stand-in GPU ({} GiB)", memory >> 30)
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: i32, dev: CUdevice) -> CUresult {
    entry(|| {
        let d = driver()?;
        let physical = d.physical(dev)?;
        if name.is_null() || len <= 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let text = device_name(d.sim.device(physical).memory);
        let n = text.len().min(len as usize - 1);
        std::ptr::copy_nonoverlapping(text.as_ptr(), name as *mut u8, n);
        *name.add(n) = 0;
        Ok(())
    })
}

unsafe fn uuid(out: *mut CUuuid, dev: CUdevice) -> Result<(), CUresult> {
    let d = driver()?;
    let physical = d.physical(dev)?;
    if out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    (*out).bytes = driver::uuid_of(&d.sim, physical);
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid(out: *mut CUuuid, dev: CUdevice) -> CUresult {
    entry(|| uuid(out, dev))
}

/// The 11.4 form also answers for MIG instances; the stand-in has none, so both agree.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(out: *mut CUuuid, dev: CUdevice) -> CUresult {
    entry(|| uuid(out, dev))
}

fn total(dev: CUdevice) -> Result<u64, CUresult> {
    let d = driver()?;
    Ok(d.sim.device(d.physical(dev)?).memory)
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    entry(|| {
        let t = total(dev)?;
        if bytes.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        *bytes = t as usize;
        Ok(())
    })
}

/// The pre-3.2 form with a 32-bit size: saturates at 4 GiB - 1.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem(bytes: *mut u32, dev: CUdevice) -> CUresult {
    entry(|| {
        let t = total(dev)?;
        if bytes.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        *bytes = t.min(u32::MAX as u64) as u32;
        Ok(())
    })
}

/// An H100-like device of the configured SM count (compute capability 9.0).
pub fn attribute(attrib: i32, sms: u32, physical: usize) -> Option<i32> {
    Some(match attrib {
        CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK => 1024,
        CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X | CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y => 1024,
        CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z => 64,
        CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X => i32::MAX,
        CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y | CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z => 65535,
        CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK => 48 << 10,
        CU_DEVICE_ATTRIBUTE_WARP_SIZE => 32,
        CU_DEVICE_ATTRIBUTE_MAX_PITCH => i32::MAX,
        CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT => 512,
        CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT => sms as i32,
        CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE1D_WIDTH => crate::memory::MAX_1D,
        CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_WIDTH => crate::memory::MAX_2D_WIDTH,
        CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_HEIGHT => crate::memory::MAX_2D_HEIGHT,
        CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE3D_WIDTH
        | CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE3D_HEIGHT
        | CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE3D_DEPTH => crate::memory::MAX_3D,
        CU_DEVICE_ATTRIBUTE_PCI_BUS_ID => 0x10 + physical as i32,
        CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID | CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID => 0,
        CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR => 2048,
        CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT => 32,
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR => 9,
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR => 0,
        CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR => 32,
        CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING
        | CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY
        | CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS
        | CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH
        | CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
        | CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED => 1,
        _ => return None,
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetAttribute(
    pi: *mut i32,
    attrib: i32,
    dev: CUdevice,
) -> CUresult {
    entry(|| {
        let d = driver()?;
        let physical = d.physical(dev)?;
        if pi.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        *pi = attribute(attrib, d.sim.device(physical).sms, physical)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetPCIBusId(
    bus_id: *mut c_char,
    len: i32,
    dev: CUdevice,
) -> CUresult {
    entry(|| {
        let d = driver()?;
        let physical = d.physical(dev)?;
        if bus_id.is_null() || len <= 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let text = format!("00000000:{:02X}:00.0", 0x10 + physical);
        let n = text.len().min(len as usize - 1);
        std::ptr::copy_nonoverlapping(text.as_ptr(), bus_id as *mut u8, n);
        *bus_id.add(n) = 0;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetByPCIBusId(
    dev: *mut CUdevice,
    bus_id: *const c_char,
) -> CUresult {
    entry(|| {
        let d = driver()?;
        if dev.is_null() || bus_id.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let wanted = CStr::from_ptr(bus_id)
            .to_string_lossy()
            .to_ascii_uppercase();
        let found = d.visible.iter().position(|&p| {
            let full = format!("00000000:{:02X}:00.0", 0x10 + p);
            full == wanted || full.ends_with(&wanted) && wanted.len() >= 7
        });
        *dev = found.ok_or(CUDA_ERROR_INVALID_DEVICE)? as CUdevice;
        Ok(())
    })
}

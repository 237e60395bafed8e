//! Our own use of NVML: per-process memory (context memory) and the process list (host PIDs). Loaded on first need, once per
//! process; a process without `libnvidia-ml.so.1` (or whose NVML does not initialise) runs
//! without it, and says so once.

// NVML device handles are opaque pointers we pass back to NVML, never dereference.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use crate::cuda::*;
use crate::driver;
use crate::entry_points::Sym;
use crate::env::Uuid;
use crate::interpose::{real, Origin, NVML};
use std::ffi::{c_char, c_uint, CStr, CString};

/// A process on a card as NVML lists it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CardProcess {
    pub pid: u32,
    /// None when NVML cannot say (`NVML_VALUE_NOT_AVAILABLE`).
    pub used_bytes: Option<u64>,
}

/// Proof that NVML loaded and initialised in this process.
pub struct Nvml(());

impl Nvml {
    pub fn load() -> Option<Nvml> {
        NVML.handle(true)?;
        match unsafe { driver::nvmlInit_v2() } {
            Some(NVML_SUCCESS) => Some(Nvml(())),
            Some(code) => {
                log_warn!("libnvidia-ml.so.1 is present but nvmlInit_v2 failed ({code}); running without NVML");
                None
            }
            None => None,
        }
    }

    pub fn device_by_uuid(&self, uuid: Uuid) -> Option<nvmlDevice_t> {
        let text = CString::new(uuid.to_string()).ok()?;
        let mut device = std::ptr::null_mut();
        (unsafe { driver::nvmlDeviceGetHandleByUUID(text.as_ptr(), &mut device) }? == NVML_SUCCESS)
            .then_some(device)
    }

    pub fn uuid_of(&self, device: nvmlDevice_t) -> Option<Uuid> {
        let mut buf = [0 as c_char; NVML_UUID_BUFFER];
        if unsafe { driver::nvmlDeviceGetUUID(device, buf.as_mut_ptr(), buf.len() as c_uint) }?
            != NVML_SUCCESS
        {
            return None;
        }
        // SAFETY: NVML wrote a NUL-terminated string into buf (and buf ends in 0 regardless).
        buf[NVML_UUID_BUFFER - 1] = 0;
        let text = unsafe { CStr::from_ptr(buf.as_ptr()) };
        Uuid::parse(text.to_str().ok()?)
    }

    /// NVML's index of a device (its place in NVML's enumeration, which ignores
    /// `CUDA_VISIBLE_DEVICES`).
    pub fn index_of(&self, device: nvmlDevice_t) -> Option<usize> {
        let mut index: c_uint = 0;
        (unsafe { driver::nvmlDeviceGetIndex(device, &mut index) }? == NVML_SUCCESS)
            .then_some(index as usize)
    }

    /// The card's real memory (total, free), through the real `nvmlDeviceGetMemoryInfo`.
    pub fn memory(&self, device: nvmlDevice_t) -> Option<(u64, u64)> {
        let addr = real(Sym::nvmlDeviceGetMemoryInfo, Origin::Export)?;
        // SAFETY: the real nvmlDeviceGetMemoryInfo.
        let f: unsafe extern "C" fn(nvmlDevice_t, *mut nvmlMemory_t) -> nvmlReturn_t =
            unsafe { std::mem::transmute(addr) };
        let mut memory = nvmlMemory_t::default();
        (unsafe { f(device, &mut memory) } == NVML_SUCCESS).then_some((memory.total, memory.free))
    }

    /// The compute processes on a card (newest query the library has).
    pub fn processes(&self, device: nvmlDevice_t) -> Option<Vec<CardProcess>> {
        let convert = |pid: c_uint, used: u64| CardProcess {
            pid,
            used_bytes: (used != NVML_VALUE_NOT_AVAILABLE).then_some(used),
        };
        for query in [
            driver::nvmlDeviceGetComputeRunningProcesses_v3,
            driver::nvmlDeviceGetComputeRunningProcesses_v2,
        ] {
            if let Some(list) = list_with(|count, buf| unsafe { query(device, count, buf) }) {
                return Some(
                    list.iter()
                        .map(|p: &nvmlProcessInfo_t| convert(p.pid, p.used_gpu_memory))
                        .collect(),
                );
            }
        }
        let list = list_with(|count, buf| unsafe {
            driver::nvmlDeviceGetComputeRunningProcesses(device, count, buf)
        })?;
        Some(
            list.iter()
                .map(|p: &nvmlProcessInfo_v1_t| convert(p.pid, p.used_gpu_memory))
                .collect(),
        )
    }
}

/// NVML's two-call list protocol: ask for the count, then fill a buffer (with room for a few
/// more, as the list can grow in between).
fn list_with<T: Default + Clone>(
    mut query: impl FnMut(*mut c_uint, *mut T) -> Option<nvmlReturn_t>,
) -> Option<Vec<T>> {
    let mut capacity: c_uint = 16;
    for _ in 0..4 {
        let mut buf = vec![T::default(); capacity as usize];
        let mut count = capacity;
        match query(&mut count, buf.as_mut_ptr())? {
            NVML_SUCCESS => {
                buf.truncate(count.min(capacity) as usize);
                return Some(buf);
            }
            NVML_ERROR_INSUFFICIENT_SIZE => capacity = count.max(capacity) + 16,
            _ => return None,
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_list_protocol_grows_the_buffer_until_it_fits() {
        let available = 40u32;
        let mut calls = 0;
        let list = list_with(|count: *mut c_uint, buf: *mut u32| {
            calls += 1;
            // SAFETY: count and buf come from list_with, buf has *count entries.
            unsafe {
                if *count < available {
                    *count = available;
                    return Some(NVML_ERROR_INSUFFICIENT_SIZE);
                }
                for i in 0..available {
                    *buf.add(i as usize) = i;
                }
                *count = available;
            }
            Some(NVML_SUCCESS)
        })
        .expect("fits");
        assert_eq!(list.len(), 40);
        assert_eq!(list[39], 39);
        assert_eq!(calls, 2);
    }

    #[test]
    fn an_error_or_a_missing_function_is_no_list() {
        assert!(list_with(|_: *mut c_uint, _: *mut u32| Some(NVML_ERROR_UNKNOWN)).is_none());
        assert!(list_with(|_: *mut c_uint, _: *mut u32| None).is_none());
    }
}

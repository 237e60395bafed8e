//! NVML through `dlopen("libnvidia-ml.so.1")` + `dlsym`, as monitoring code and the runtime's users
//! reach it (nvml.h's types).

use crate::loader::{dlsym, open_nvml};
use serde_json::{json, Value};
use std::ffi::{c_char, c_void, CStr, CString};

pub type NvmlReturn = u32;
pub type NvmlDevice = *mut c_void;

#[repr(C)]
#[derive(Default)]
pub struct Memory {
    pub total: u64,
    pub free: u64,
    pub used: u64,
}

#[repr(C)]
#[derive(Default)]
pub struct MemoryV2 {
    pub version: u32,
    pub total: u64,
    pub reserved: u64,
    pub free: u64,
    pub used: u64,
}

/// `NVML_STRUCT_VERSION(Memory, 2)`.
pub const MEMORY_V2: u32 = std::mem::size_of::<MemoryV2>() as u32 | (2 << 24);

#[repr(C)]
#[derive(Default, Clone, Copy)]
pub struct ProcessInfoV1 {
    pub pid: u32,
    pub used_gpu_memory: u64,
}

#[repr(C)]
#[derive(Default, Clone, Copy)]
pub struct ProcessInfo {
    pub pid: u32,
    pub used_gpu_memory: u64,
    pub gpu_instance_id: u32,
    pub compute_instance_id: u32,
}

#[repr(C)]
#[derive(Default, Clone, Copy)]
pub struct UtilizationSample {
    pub pid: u32,
    pub time_stamp: u64,
    pub sm_util: u32,
    pub mem_util: u32,
    pub enc_util: u32,
    pub dec_util: u32,
}

#[repr(C)]
#[derive(Default)]
pub struct Utilization {
    pub gpu: u32,
    pub memory: u32,
}

pub const NVML_ERROR_INSUFFICIENT_SIZE: NvmlReturn = 7;

pub fn nvml_error(code: NvmlReturn) -> &'static str {
    match code {
        0 => "NVML_SUCCESS",
        1 => "NVML_ERROR_UNINITIALIZED",
        2 => "NVML_ERROR_INVALID_ARGUMENT",
        3 => "NVML_ERROR_NOT_SUPPORTED",
        4 => "NVML_ERROR_NO_PERMISSION",
        6 => "NVML_ERROR_NOT_FOUND",
        7 => "NVML_ERROR_INSUFFICIENT_SIZE",
        9 => "NVML_ERROR_DRIVER_NOT_LOADED",
        13 => "NVML_ERROR_FUNCTION_NOT_FOUND",
        25 => "NVML_ERROR_ARGUMENT_VERSION_MISMATCH",
        999 => "NVML_ERROR_UNKNOWN",
        _ => "NVML_ERROR_(other)",
    }
}

pub struct Nvml {
    handle: *mut c_void,
    pub init_result: NvmlReturn,
}

macro_rules! call {
    ($self:expr, $name:literal, ($($t:ty),*), ($($a:expr),*)) => {{
        let f = dlsym($self.handle, $name);
        if f.is_null() {
            None
        } else {
            // SAFETY: nvml.h's signature for $name.
            let f: unsafe extern "C" fn($($t),*) -> NvmlReturn = unsafe { std::mem::transmute(f) };
            Some(unsafe { f($($a),*) })
        }
    }};
}

impl Nvml {
    /// Opens and initialises NVML; None when the library is absent.
    pub fn open() -> Option<Nvml> {
        let handle = open_nvml()?;
        let mut n = Nvml {
            handle,
            init_result: 0,
        };
        n.init_result = call!(n, "nvmlInit_v2", (), ()).unwrap_or(13);
        Some(n)
    }

    pub fn device_by_uuid(&self, uuid: &str) -> Result<NvmlDevice, NvmlReturn> {
        let c = CString::new(uuid).map_err(|_| 2u32)?;
        let mut dev: NvmlDevice = std::ptr::null_mut();
        match call!(
            self,
            "nvmlDeviceGetHandleByUUID",
            (*const c_char, *mut NvmlDevice),
            (c.as_ptr(), &mut dev)
        ) {
            Some(0) => Ok(dev),
            Some(e) => Err(e),
            None => Err(13),
        }
    }

    /// `nvmlShutdown` and `dlclose`, as NVML users that finish with it do (go-nvml's Shutdown).
    /// If that unloaded the library, its old address range is then kept from reuse, so that a
    /// new `dlopen` puts it elsewhere, as it may in a long-lived process: whoever kept a pointer
    /// into the old copy would call unmapped memory. Returns whether it was unloaded.
    pub fn close(self) -> bool {
        let init = dlsym(self.handle, "nvmlInit_v2");
        // SAFETY: dladdr fills a Dl_info we own.
        let path = unsafe {
            let mut info: libc::Dl_info = std::mem::zeroed();
            libc::dladdr(init, &mut info);
            CStr::from_ptr(info.dli_fname).to_owned()
        };
        // /proc/self/maps names the file itself, not the link it was opened through.
        let file = std::fs::canonicalize(path.to_string_lossy().as_ref()).unwrap_or_default();
        let ranges = mapped_ranges(&file.to_string_lossy());
        call!(self, "nvmlShutdown", (), ());
        // SAFETY: the handle open() got; nothing of this library is used after this.
        unsafe { libc::dlclose(self.handle) };
        // SAFETY: only looks whether the library is still there (the reference it may take is
        // dropped at once); the reservation is fresh anonymous memory, never touched.
        unsafe {
            let still = libc::dlopen(path.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD);
            if !still.is_null() {
                libc::dlclose(still);
                return false;
            }
            for (start, end) in ranges {
                libc::mmap(
                    start as *mut c_void,
                    end - start,
                    libc::PROT_NONE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
                    -1,
                    0,
                );
            }
        }
        true
    }

    pub fn device_count(&self) -> Result<u32, NvmlReturn> {
        let mut count: u32 = 0;
        match call!(self, "nvmlDeviceGetCount_v2", (*mut u32), (&mut count)) {
            Some(0) => Ok(count),
            Some(e) => Err(e),
            None => Err(13),
        }
    }

    pub fn device_by_index(&self, index: u32) -> Result<NvmlDevice, NvmlReturn> {
        let mut dev: NvmlDevice = std::ptr::null_mut();
        match call!(
            self,
            "nvmlDeviceGetHandleByIndex_v2",
            (u32, *mut NvmlDevice),
            (index, &mut dev)
        ) {
            Some(0) => Ok(dev),
            Some(e) => Err(e),
            None => Err(13),
        }
    }

    pub fn uuid(&self, dev: NvmlDevice) -> Option<String> {
        let mut buf = [0 as c_char; 96];
        match call!(
            self,
            "nvmlDeviceGetUUID",
            (NvmlDevice, *mut c_char, u32),
            (dev, buf.as_mut_ptr(), 96)
        ) {
            // SAFETY: NVML wrote a NUL-terminated string into buf.
            Some(0) => Some(
                unsafe { CStr::from_ptr(buf.as_ptr()) }
                    .to_string_lossy()
                    .into_owned(),
            ),
            _ => None,
        }
    }

    pub fn memory_v1(&self, dev: NvmlDevice) -> Value {
        let mut m = Memory::default();
        let r = call!(
            self,
            "nvmlDeviceGetMemoryInfo",
            (NvmlDevice, *mut Memory),
            (dev, &mut m)
        )
        .unwrap_or(13);
        if r != 0 {
            return json!({"result": r, "error": nvml_error(r)});
        }
        json!({"result": 0, "total": m.total, "free": m.free, "used": m.used})
    }

    pub fn memory_v2(&self, dev: NvmlDevice, version: u32) -> Value {
        let mut m = MemoryV2 {
            version,
            ..Default::default()
        };
        let r = call!(
            self,
            "nvmlDeviceGetMemoryInfo_v2",
            (NvmlDevice, *mut MemoryV2),
            (dev, &mut m)
        )
        .unwrap_or(13);
        if r != 0 {
            return json!({"result": r, "error": nvml_error(r)});
        }
        json!({"result": 0, "version": m.version, "total": m.total, "reserved": m.reserved, "free": m.free, "used": m.used})
    }

    /// `nvmlDeviceGetComputeRunningProcesses_v3` (24-byte entries) or, with `v1`, the unversioned
    /// symbol (16-byte entries), by the size-negotiating protocol.
    pub fn processes(&self, dev: NvmlDevice, v1: bool) -> Value {
        let mut count: u32 = 0;
        let probe = if v1 {
            call!(
                self,
                "nvmlDeviceGetComputeRunningProcesses",
                (NvmlDevice, *mut u32, *mut ProcessInfoV1),
                (dev, &mut count, std::ptr::null_mut())
            )
        } else {
            call!(
                self,
                "nvmlDeviceGetComputeRunningProcesses_v3",
                (NvmlDevice, *mut u32, *mut ProcessInfo),
                (dev, &mut count, std::ptr::null_mut())
            )
        };
        match probe {
            None => return json!({"result": 13, "error": nvml_error(13)}),
            Some(0) => return json!({"result": 0, "processes": []}),
            Some(NVML_ERROR_INSUFFICIENT_SIZE) => {}
            Some(e) => return json!({"result": e, "error": nvml_error(e)}),
        }
        count += 4;
        let list: Vec<Value> = if v1 {
            let mut buf = vec![ProcessInfoV1::default(); count as usize];
            let r = call!(
                self,
                "nvmlDeviceGetComputeRunningProcesses",
                (NvmlDevice, *mut u32, *mut ProcessInfoV1),
                (dev, &mut count, buf.as_mut_ptr())
            )
            .unwrap_or(13);
            if r != 0 {
                return json!({"result": r, "error": nvml_error(r)});
            }
            buf[..count as usize]
                .iter()
                .map(|p| json!({"pid": p.pid, "used_memory": p.used_gpu_memory}))
                .collect()
        } else {
            let mut buf = vec![ProcessInfo::default(); count as usize];
            let r = call!(
                self,
                "nvmlDeviceGetComputeRunningProcesses_v3",
                (NvmlDevice, *mut u32, *mut ProcessInfo),
                (dev, &mut count, buf.as_mut_ptr())
            )
            .unwrap_or(13);
            if r != 0 {
                return json!({"result": r, "error": nvml_error(r)});
            }
            buf[..count as usize]
                .iter()
                .map(|p| json!({"pid": p.pid, "used_memory": p.used_gpu_memory, "gpu_instance_id": p.gpu_instance_id, "compute_instance_id": p.compute_instance_id}))
                .collect()
        };
        json!({"result": 0, "processes": list})
    }

    /// Per-process samples newer than `last_seen` (the size negotiation of pynvml).
    pub fn process_utilization(
        &self,
        dev: NvmlDevice,
        last_seen: u64,
    ) -> Result<Vec<UtilizationSample>, NvmlReturn> {
        let mut count: u32 = 0;
        let r = call!(
            self,
            "nvmlDeviceGetProcessUtilization",
            (NvmlDevice, *mut UtilizationSample, *mut u32, u64),
            (dev, std::ptr::null_mut(), &mut count, last_seen)
        )
        .unwrap_or(13);
        if r != NVML_ERROR_INSUFFICIENT_SIZE {
            return Err(r);
        }
        let mut buf = vec![UtilizationSample::default(); count as usize];
        let r = call!(
            self,
            "nvmlDeviceGetProcessUtilization",
            (NvmlDevice, *mut UtilizationSample, *mut u32, u64),
            (dev, buf.as_mut_ptr(), &mut count, last_seen)
        )
        .unwrap_or(13);
        if r != 0 {
            return Err(r);
        }
        buf.truncate(count as usize);
        Ok(buf)
    }

    pub fn utilization(&self, dev: NvmlDevice) -> Result<u32, NvmlReturn> {
        let mut u = Utilization::default();
        match call!(
            self,
            "nvmlDeviceGetUtilizationRates",
            (NvmlDevice, *mut Utilization),
            (dev, &mut u)
        )
        .unwrap_or(13)
        {
            0 => Ok(u.gpu),
            e => Err(e),
        }
    }
}

/// The address ranges a loaded file is mapped at (`/proc/self/maps`).
fn mapped_ranges(path: &str) -> Vec<(usize, usize)> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    maps.lines()
        .filter(|l| l.ends_with(path))
        .filter_map(|l| {
            let (start, end) = l.split_whitespace().next()?.split_once('-')?;
            Some((
                usize::from_str_radix(start, 16).ok()?,
                usize::from_str_radix(end, 16).ok()?,
            ))
        })
        .collect()
}

//! The NVML calls that nvml-wrapper 0.13 does not wrap or gets wrong, made through the library it
//! loaded (`Nvml::lib()`) on its device handles (`Device::handle()`):
//! - MIG instance creation and destruction, which it lacks;
//! - `nvmlDeviceGetGpuInstancePossiblePlacements_v2`, whose wrapper returns an empty list (it never
//!   sets the vector's length);
//! - `nvmlDeviceGetNvLinkRemoteDeviceType`, whose wrapper returns `Unknown` whatever NVML says (it
//!   passes NVML a temporary copy of its result).
//!
//! Each symbol is looked up before the call, so an older `libnvidia-ml` without it is an error
//! naming the call, never a panic (the driver aborts on a panic). Never run on a GPU here: see the
//! README's "What ran on real hardware".

use std::ffi::CStr;
use std::os::raw::{c_char, c_uint};

use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings as sys;

/// A failed NVML call: which, on which card, and NVML's return code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("NVML {call}: {message} (code {code})")]
pub struct NvmlCallError {
    pub call: String,
    pub code: u32,
    pub message: String,
}

impl NvmlCallError {
    pub fn is(&self, code: u32) -> bool {
        self.code == code
    }
}

pub const SUCCESS: u32 = sys::nvmlReturn_enum_NVML_SUCCESS;
pub const NOT_FOUND: u32 = sys::nvmlReturn_enum_NVML_ERROR_NOT_FOUND;
pub const NOT_SUPPORTED: u32 = sys::nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED;
pub const INVALID_ARGUMENT: u32 = sys::nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
pub const IN_USE: u32 = sys::nvmlReturn_enum_NVML_ERROR_IN_USE;
pub const INSUFFICIENT_RESOURCES: u32 = sys::nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES;
/// Stands for a symbol the loaded library lacks (not an NVML code).
pub const MISSING_SYMBOL: u32 = u32::MAX;

/// `NVML_STRUCT_VERSION(GpuInstanceProfileInfo, 2)`: the struct's size with the version in the
/// top byte, as nvml.h defines it.
pub const GPU_INSTANCE_PROFILE_INFO_V2: c_uint =
    (std::mem::size_of::<sys::nvmlGpuInstanceProfileInfo_v2_t>() as c_uint) | (2 << 24);

/// The compute-instance profile that spans a whole GPU instance of `slice_count` compute slices
/// (`NVML_COMPUTE_INSTANCE_PROFILE_<n>_SLICE`).
pub fn compute_instance_profile_for(slice_count: u32) -> Option<c_uint> {
    Some(match slice_count {
        1 => sys::NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE,
        2 => sys::NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE,
        3 => sys::NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE,
        4 => sys::NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE,
        6 => sys::NVML_COMPUTE_INSTANCE_PROFILE_6_SLICE,
        7 => sys::NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE,
        8 => sys::NVML_COMPUTE_INSTANCE_PROFILE_8_SLICE,
        _ => return None,
    })
}

/// NVML's text for a return code.
fn error_text(nvml: &Nvml, code: u32) -> String {
    let Ok(f) = nvml.lib().nvmlErrorString.as_ref() else {
        return String::new();
    };
    // SAFETY: nvmlErrorString returns a pointer to a static, NUL-terminated string (or null).
    unsafe {
        let text = f(code);
        if text.is_null() {
            String::new()
        } else {
            CStr::from_ptr(text).to_string_lossy().into_owned()
        }
    }
}

/// `Ok` on NVML_SUCCESS, else the error naming `call`.
fn check(nvml: &Nvml, call: &str, code: u32) -> Result<(), NvmlCallError> {
    if code == SUCCESS {
        return Ok(());
    }
    Err(NvmlCallError {
        call: call.to_string(),
        code,
        message: error_text(nvml, code),
    })
}

fn symbol<'a, T, E: std::fmt::Display>(
    found: Result<&'a T, &E>,
    call: &str,
) -> Result<&'a T, NvmlCallError> {
    found.map_err(|e| NvmlCallError {
        call: call.to_string(),
        code: MISSING_SYMBOL,
        message: format!("the loaded libnvidia-ml has no such function ({e})"),
    })
}

/// A profile's figures as `nvmlDeviceGetGpuInstanceProfileInfoV` reports them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProfileInfo {
    pub id: u32,
    pub name: String,
    pub slice_count: u32,
    pub instance_count: u32,
    pub multiprocessors: u32,
    pub copy_engines: u32,
    pub decoders: u32,
    pub encoders: u32,
    pub jpeg_engines: u32,
    pub ofa_engines: u32,
    pub memory_mib: u64,
}

/// The name NVML gives a profile without its "MIG " prefix ("MIG 1g.10gb" -> "1g.10gb").
pub fn profile_name(raw: &[c_char]) -> String {
    let bytes: Vec<u8> = raw
        .iter()
        .take_while(|c| **c != 0)
        .map(|c| *c as u8)
        .collect();
    let text = String::from_utf8_lossy(&bytes);
    text.trim()
        .strip_prefix("MIG ")
        .unwrap_or(text.trim())
        .to_string()
}

/// GPU-instance profile `profile` (an `NVML_GPU_INSTANCE_PROFILE_*` value) of a card; NotSupported
/// or InvalidArgument when the card does not have it.
pub fn gpu_instance_profile(
    nvml: &Nvml,
    device: &Device<'_>,
    profile: c_uint,
) -> Result<ProfileInfo, NvmlCallError> {
    let call = "nvmlDeviceGetGpuInstanceProfileInfoV";
    let f = symbol(
        nvml.lib().nvmlDeviceGetGpuInstanceProfileInfoV.as_ref(),
        call,
    )?;
    // SAFETY: a zeroed plain C struct with its version set, filled in by NVML; the handle comes
    // from nvml-wrapper and lives as long as `device`.
    let info = unsafe {
        let mut info: sys::nvmlGpuInstanceProfileInfo_v2_t = std::mem::zeroed();
        info.version = GPU_INSTANCE_PROFILE_INFO_V2;
        check(nvml, call, f(device.handle(), profile, &mut info))?;
        info
    };
    Ok(ProfileInfo {
        id: info.id,
        name: profile_name(&info.name),
        slice_count: info.sliceCount,
        instance_count: info.instanceCount,
        multiprocessors: info.multiprocessorCount,
        copy_engines: info.copyEngineCount,
        decoders: info.decoderCount,
        encoders: info.encoderCount,
        jpeg_engines: info.jpegCount,
        ofa_engines: info.ofaCount,
        memory_mib: info.memorySizeMB,
    })
}

/// Where a profile may be placed: (start, size) in memory slices. Works with MIG mode off.
pub fn possible_placements(
    nvml: &Nvml,
    device: &Device<'_>,
    profile_id: u32,
) -> Result<Vec<(u32, u32)>, NvmlCallError> {
    let call = "nvmlDeviceGetGpuInstancePossiblePlacements_v2";
    let f = symbol(
        nvml.lib()
            .nvmlDeviceGetGpuInstancePossiblePlacements_v2
            .as_ref(),
        call,
    )?;
    // SAFETY: first call with a null array asks for the count; the second gets an array of
    // exactly that many elements and NVML writes at most `count` of them, returning how many.
    unsafe {
        let mut count: c_uint = 0;
        check(
            nvml,
            call,
            f(
                device.handle(),
                profile_id,
                std::ptr::null_mut(),
                &mut count,
            ),
        )?;
        let mut placements =
            vec![sys::nvmlGpuInstancePlacement_t { start: 0, size: 0 }; count as usize];
        check(
            nvml,
            call,
            f(
                device.handle(),
                profile_id,
                placements.as_mut_ptr(),
                &mut count,
            ),
        )?;
        placements.truncate(count as usize);
        Ok(placements.into_iter().map(|p| (p.start, p.size)).collect())
    }
}

/// What NVLink `link` of the card reaches (`NVML_NVLINK_DEVICE_TYPE_*`).
pub fn nvlink_remote_device_type(
    nvml: &Nvml,
    device: &Device<'_>,
    link: u32,
) -> Result<u32, NvmlCallError> {
    let call = "nvmlDeviceGetNvLinkRemoteDeviceType";
    let f = symbol(
        nvml.lib().nvmlDeviceGetNvLinkRemoteDeviceType.as_ref(),
        call,
    )?;
    // SAFETY: NVML writes one enum value into `kind`.
    unsafe {
        let mut kind: sys::nvmlIntNvLinkDeviceType_t = 0;
        check(nvml, call, f(device.handle(), link, &mut kind))?;
        Ok(kind)
    }
}

pub const NVLINK_DEVICE_TYPE_GPU: u32 =
    sys::nvmlIntNvLinkDeviceType_enum_NVML_NVLINK_DEVICE_TYPE_GPU;
pub const NVLINK_DEVICE_TYPE_SWITCH: u32 =
    sys::nvmlIntNvLinkDeviceType_enum_NVML_NVLINK_DEVICE_TYPE_SWITCH;

/// A GPU instance as NVML lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInstanceInfo {
    pub id: u32,
    pub profile_id: u32,
    pub start: u32,
    pub size: u32,
    pub compute_instances: Vec<u32>,
}

fn gpu_instance_by_id(
    nvml: &Nvml,
    device: &Device<'_>,
    id: u32,
) -> Result<sys::nvmlGpuInstance_t, NvmlCallError> {
    let call = format!("nvmlDeviceGetGpuInstanceById({id})");
    let f = symbol(nvml.lib().nvmlDeviceGetGpuInstanceById.as_ref(), &call)?;
    // SAFETY: NVML writes an opaque handle.
    unsafe {
        let mut gi: sys::nvmlGpuInstance_t = std::ptr::null_mut();
        check(nvml, &call, f(device.handle(), id, &mut gi))?;
        Ok(gi)
    }
}

/// Create a GPU instance of `profile_id` at `start` (`size` memory slices); returns its id.
/// INSUFFICIENT_RESOURCES when the placement is taken.
pub fn create_gpu_instance(
    nvml: &Nvml,
    device: &Device<'_>,
    profile_id: u32,
    start: u32,
    size: u32,
) -> Result<u32, NvmlCallError> {
    let call = "nvmlDeviceCreateGpuInstanceWithPlacement";
    let create = symbol(
        nvml.lib().nvmlDeviceCreateGpuInstanceWithPlacement.as_ref(),
        call,
    )?;
    let info_call = "nvmlGpuInstanceGetInfo";
    let info = symbol(nvml.lib().nvmlGpuInstanceGetInfo.as_ref(), info_call)?;
    // SAFETY: the placement is read by NVML; it writes an opaque handle, then the instance's info.
    unsafe {
        let placement = sys::nvmlGpuInstancePlacement_t { start, size };
        let mut gi: sys::nvmlGpuInstance_t = std::ptr::null_mut();
        check(
            nvml,
            call,
            create(device.handle(), profile_id, &placement, &mut gi),
        )?;
        let mut out: sys::nvmlGpuInstanceInfo_t = std::mem::zeroed();
        check(nvml, info_call, info(gi, &mut out))?;
        Ok(out.id)
    }
}

/// Create the compute instance that spans all of GPU instance `gi` (`slice_count` compute
/// slices, shared engines); returns its id.
pub fn create_compute_instance(
    nvml: &Nvml,
    device: &Device<'_>,
    gi: u32,
    slice_count: u32,
) -> Result<u32, NvmlCallError> {
    let Some(ci_profile) = compute_instance_profile_for(slice_count) else {
        return Err(NvmlCallError {
            call: "nvmlGpuInstanceGetComputeInstanceProfileInfo".into(),
            code: INVALID_ARGUMENT,
            message: format!("no compute-instance profile spans {slice_count} compute slices"),
        });
    };
    let handle = gpu_instance_by_id(nvml, device, gi)?;
    let info_call = "nvmlGpuInstanceGetComputeInstanceProfileInfo";
    let profile_info = symbol(
        nvml.lib()
            .nvmlGpuInstanceGetComputeInstanceProfileInfo
            .as_ref(),
        info_call,
    )?;
    let call = "nvmlGpuInstanceCreateComputeInstance";
    let create = symbol(
        nvml.lib().nvmlGpuInstanceCreateComputeInstance.as_ref(),
        call,
    )?;
    let get_call = "nvmlComputeInstanceGetInfo_v2";
    let get = symbol(nvml.lib().nvmlComputeInstanceGetInfo_v2.as_ref(), get_call)?;
    // SAFETY: plain C structs filled in by NVML, opaque handles it hands out.
    unsafe {
        let mut profile: sys::nvmlComputeInstanceProfileInfo_t = std::mem::zeroed();
        check(
            nvml,
            info_call,
            profile_info(
                handle,
                ci_profile,
                sys::NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
                &mut profile,
            ),
        )?;
        let mut ci: sys::nvmlComputeInstance_t = std::ptr::null_mut();
        check(nvml, call, create(handle, profile.id, &mut ci))?;
        let mut info: sys::nvmlComputeInstanceInfo_t = std::mem::zeroed();
        check(nvml, get_call, get(ci, &mut info))?;
        Ok(info.id)
    }
}

/// Destroy compute instance `ci` of GPU instance `gi`; gone already is fine.
pub fn destroy_compute_instance(
    nvml: &Nvml,
    device: &Device<'_>,
    gi: u32,
    ci: u32,
) -> Result<(), NvmlCallError> {
    let handle = match gpu_instance_by_id(nvml, device, gi) {
        Err(e) if e.is(NOT_FOUND) || e.is(INVALID_ARGUMENT) => return Ok(()),
        other => other?,
    };
    let by_id_call = format!("nvmlGpuInstanceGetComputeInstanceById({gi}, {ci})");
    let by_id = symbol(
        nvml.lib().nvmlGpuInstanceGetComputeInstanceById.as_ref(),
        &by_id_call,
    )?;
    let call = format!("nvmlComputeInstanceDestroy({gi}, {ci})");
    let destroy = symbol(nvml.lib().nvmlComputeInstanceDestroy.as_ref(), &call)?;
    // SAFETY: opaque handles from NVML.
    unsafe {
        let mut handle_ci: sys::nvmlComputeInstance_t = std::ptr::null_mut();
        match by_id(handle, ci, &mut handle_ci) {
            SUCCESS => {}
            NOT_FOUND | INVALID_ARGUMENT => return Ok(()),
            code => check(nvml, &by_id_call, code)?,
        }
        match destroy(handle_ci) {
            NOT_FOUND => Ok(()),
            code => check(nvml, &call, code),
        }
    }
}

/// Destroy GPU instance `gi` (its compute instances must be gone: IN_USE otherwise, or while
/// processes run on it); gone already is fine.
pub fn destroy_gpu_instance(
    nvml: &Nvml,
    device: &Device<'_>,
    gi: u32,
) -> Result<(), NvmlCallError> {
    let handle = match gpu_instance_by_id(nvml, device, gi) {
        Err(e) if e.is(NOT_FOUND) || e.is(INVALID_ARGUMENT) => return Ok(()),
        other => other?,
    };
    let call = format!("nvmlGpuInstanceDestroy({gi})");
    let destroy = symbol(nvml.lib().nvmlGpuInstanceDestroy.as_ref(), &call)?;
    // SAFETY: an opaque handle from NVML.
    match unsafe { destroy(handle) } {
        NOT_FOUND => Ok(()),
        code => check(nvml, &call, code),
    }
}

/// Every GPU instance of the card with its compute instances, over the profiles in `profile_ids`.
pub fn gpu_instances(
    nvml: &Nvml,
    device: &Device<'_>,
    profile_ids: &[u32],
) -> Result<Vec<GpuInstanceInfo>, NvmlCallError> {
    let call = "nvmlDeviceGetGpuInstances";
    let list = symbol(nvml.lib().nvmlDeviceGetGpuInstances.as_ref(), call)?;
    let info_call = "nvmlGpuInstanceGetInfo";
    let info = symbol(nvml.lib().nvmlGpuInstanceGetInfo.as_ref(), info_call)?;
    let ci_call = "nvmlGpuInstanceGetComputeInstances";
    let list_ci = symbol(
        nvml.lib().nvmlGpuInstanceGetComputeInstances.as_ref(),
        ci_call,
    )?;
    let ci_info_call = "nvmlComputeInstanceGetInfo_v2";
    let ci_info = symbol(
        nvml.lib().nvmlComputeInstanceGetInfo_v2.as_ref(),
        ci_info_call,
    )?;
    let mut out = Vec::new();
    // At most 7 GPU instances per card and 8 compute instances per GPU instance (nvml.h limits).
    const MAX: usize = 8;
    for &profile_id in profile_ids {
        // SAFETY: arrays of MAX handles; NVML writes at most that many and says how many.
        unsafe {
            let mut handles = [std::ptr::null_mut(); MAX];
            let mut count: c_uint = 0;
            check(
                nvml,
                call,
                list(
                    device.handle(),
                    profile_id,
                    handles.as_mut_ptr(),
                    &mut count,
                ),
            )?;
            for &gi in handles.iter().take((count as usize).min(MAX)) {
                let mut gi_info: sys::nvmlGpuInstanceInfo_t = std::mem::zeroed();
                check(nvml, info_call, info(gi, &mut gi_info))?;
                let mut cis = [std::ptr::null_mut(); MAX];
                let mut ci_count: c_uint = 0;
                let mut compute_instances = Vec::new();
                for ci_profile in 0..sys::NVML_COMPUTE_INSTANCE_PROFILE_COUNT {
                    let mut profile: sys::nvmlComputeInstanceProfileInfo_t = std::mem::zeroed();
                    let get_profile = symbol(
                        nvml.lib()
                            .nvmlGpuInstanceGetComputeInstanceProfileInfo
                            .as_ref(),
                        "nvmlGpuInstanceGetComputeInstanceProfileInfo",
                    )?;
                    if get_profile(
                        gi,
                        ci_profile,
                        sys::NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
                        &mut profile,
                    ) != SUCCESS
                    {
                        continue;
                    }
                    check(
                        nvml,
                        ci_call,
                        list_ci(gi, profile.id, cis.as_mut_ptr(), &mut ci_count),
                    )?;
                    for &ci in cis.iter().take((ci_count as usize).min(MAX)) {
                        let mut ci_out: sys::nvmlComputeInstanceInfo_t = std::mem::zeroed();
                        check(nvml, ci_info_call, ci_info(ci, &mut ci_out))?;
                        compute_instances.push(ci_out.id);
                    }
                }
                out.push(GpuInstanceInfo {
                    id: gi_info.id,
                    profile_id: gi_info.profileId,
                    start: gi_info.placement.start,
                    size: gi_info.placement.size,
                    compute_instances,
                });
            }
        }
    }
    Ok(out)
}

/// The UUID of the MIG device of GPU instance `gi`, compute instance `ci` (`MIG-...`).
pub fn mig_device_uuid(
    nvml: &Nvml,
    device: &Device<'_>,
    gi: u32,
    ci: u32,
) -> Result<String, NvmlCallError> {
    let to_call_error = |call: &str| {
        let call = call.to_string();
        move |e: nvml_wrapper::error::NvmlError| NvmlCallError {
            call,
            code: 0,
            message: e.to_string(),
        }
    };
    let max = device
        .mig_device_count()
        .map_err(to_call_error("nvmlDeviceGetMaxMigDeviceCount"))?;
    for index in 0..max {
        let Ok(mig) = device.mig_device_by_index(index) else {
            continue;
        };
        let ids = (gpu_instance_id(nvml, &mig), compute_instance_id(nvml, &mig));
        if let (Ok(g), Ok(c)) = ids {
            if (g, c) == (gi, ci) {
                return mig
                    .uuid()
                    .map_err(to_call_error("nvmlDeviceGetUUID(MIG device)"));
            }
        }
    }
    Err(NvmlCallError {
        call: "nvmlDeviceGetMigDeviceHandleByIndex".into(),
        code: NOT_FOUND,
        message: format!("no MIG device for GPU instance {gi}, compute instance {ci}"),
    })
}

fn gpu_instance_id(nvml: &Nvml, mig: &Device<'_>) -> Result<u32, NvmlCallError> {
    let call = "nvmlDeviceGetGpuInstanceId";
    let f = symbol(nvml.lib().nvmlDeviceGetGpuInstanceId.as_ref(), call)?;
    // SAFETY: NVML writes one unsigned int.
    unsafe {
        let mut id: c_uint = 0;
        check(nvml, call, f(mig.handle(), &mut id))?;
        Ok(id)
    }
}

fn compute_instance_id(nvml: &Nvml, mig: &Device<'_>) -> Result<u32, NvmlCallError> {
    let call = "nvmlDeviceGetComputeInstanceId";
    let f = symbol(nvml.lib().nvmlDeviceGetComputeInstanceId.as_ref(), call)?;
    // SAFETY: NVML writes one unsigned int.
    unsafe {
        let mut id: c_uint = 0;
        check(nvml, call, f(mig.handle(), &mut id))?;
        Ok(id)
    }
}

/// Switch MIG mode; an activation status other than success (Ampere: a reset is pending) is an
/// error, since the mode did not change.
pub fn set_mig_mode(nvml: &Nvml, device: &Device<'_>, enabled: bool) -> Result<(), NvmlCallError> {
    let call = "nvmlDeviceSetMigMode";
    let f = symbol(nvml.lib().nvmlDeviceSetMigMode.as_ref(), call)?;
    let mode = if enabled {
        sys::NVML_DEVICE_MIG_ENABLE
    } else {
        sys::NVML_DEVICE_MIG_DISABLE
    };
    // SAFETY: NVML writes one return code.
    unsafe {
        let mut activation: sys::nvmlReturn_t = SUCCESS;
        check(nvml, call, f(device.handle(), mode, &mut activation))?;
        check(nvml, "nvmlDeviceSetMigMode (activation)", activation)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profile_names_lose_the_mig_prefix() {
        let raw: Vec<c_char> = b"MIG 1g.10gb+me\0garbage"
            .iter()
            .map(|b| *b as c_char)
            .collect();
        assert_eq!(profile_name(&raw), "1g.10gb+me");
        let plain: Vec<c_char> = b"3g.40gb\0".iter().map(|b| *b as c_char).collect();
        assert_eq!(profile_name(&plain), "3g.40gb");
    }

    #[test]
    fn the_struct_version_carries_size_and_version() {
        assert_eq!(GPU_INSTANCE_PROFILE_INFO_V2 >> 24, 2);
        assert_eq!(
            (GPU_INSTANCE_PROFILE_INFO_V2 & 0xff_ffff) as usize,
            std::mem::size_of::<sys::nvmlGpuInstanceProfileInfo_v2_t>()
        );
    }

    #[test]
    fn a_compute_instance_spans_the_whole_gpu_instance() {
        assert_eq!(
            compute_instance_profile_for(1),
            Some(sys::NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE)
        );
        assert_eq!(
            compute_instance_profile_for(7),
            Some(sys::NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE)
        );
        assert_eq!(compute_instance_profile_for(5), None);
    }
}

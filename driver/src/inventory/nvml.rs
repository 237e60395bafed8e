//! Discovery through NVML (`libnvidia-ml.so.1`, loaded at run time by nvml-wrapper), plus sysfs for
//! what NVML does not report (NUMA node, PCIe root).
//!
//! SM count: `nvmlDeviceGetAttributes_v2().multiprocessorCount` where the driver offers it (it is
//! documented for MIG-capable parts and fails with NotSupported elsewhere); otherwise CUDA cores
//! (`nvmlDeviceGetNumGpuCores`) divided by the cores per SM of the compute capability
//! ([`cores_per_sm`], CUDA C Programming Guide, "Arithmetic Instructions" throughput table).

use std::path::Path;

use gpupool_api::inventory::{
    model_from_product_name, Gpu, Inventory, InventorySource, Mig, MigProfile,
};
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};

use super::topology::{nvlink_domains, GpuLinks, LinkPeer};
use crate::nvml_ffi::{self, ProfileInfo};

#[derive(Debug, thiserror::Error)]
pub enum NvmlDiscoveryError {
    #[error(
        "NVIDIA management library (libnvidia-ml.so.1) could not be loaded: {0}. This node has no \
         NVIDIA driver installed or the library is not mounted into the container; install the driver, \
         or pass --fake-gpus (e.g. --fake-gpus a100-40gb:2) to run with fake GPUs"
    )]
    LibraryMissing(String),
    #[error("NVML: {call}: {source}")]
    Call {
        call: String,
        #[source]
        source: NvmlError,
    },
}

fn call_err(call: impl Into<String>) -> impl FnOnce(NvmlError) -> NvmlDiscoveryError {
    let call = call.into();
    move |source| NvmlDiscoveryError::Call { call, source }
}

/// CUDA cores per SM for a compute capability; None for capabilities this table does not know.
pub fn cores_per_sm(major: i32, minor: i32) -> Option<u32> {
    Some(match (major, minor) {
        (3, _) => 192,
        (5, _) => 128,
        (6, 0) => 64,
        (6, _) => 128,
        (7, _) => 64,
        (8, 0) => 64,
        (8, _) => 128,
        (9, _) | (10, _) | (11, _) | (12, _) => 128,
        _ => return None,
    })
}

/// NVML's bus id ("00000000:07:00.0") in the form sysfs and `lspci -D` use ("0000:07:00.0").
pub fn normalize_pci_bus_id(nvml_bus_id: &str) -> String {
    let lower = nvml_bus_id.trim().to_ascii_lowercase();
    match lower.split_once(':') {
        Some((domain, rest)) if domain.len() > 4 => {
            let trimmed = &domain[domain.len() - 4..];
            format!("{trimmed}:{rest}")
        }
        _ => lower,
    }
}

/// The PCIe root complex ("pci0000:00") from a device's resolved sysfs path
/// (".../devices/pci0000:00/0000:00:01.0/0000:07:00.0").
pub fn pcie_root_from_sysfs_path(path: &Path) -> Option<String> {
    path.components()
        .filter_map(|c| c.as_os_str().to_str())
        .find(|c| c.starts_with("pci") && c.len() > 3 && c[3..].contains(':'))
        .map(str::to_string)
}

/// Content of `/sys/bus/pci/devices/<id>/numa_node`: "-1" means the platform has no NUMA affinity.
pub fn parse_numa_node(content: &str) -> Option<i64> {
    content.trim().parse::<i64>().ok().filter(|n| *n >= 0)
}

/// NVML's CUDA driver version number (12040) as "12.4".
pub fn format_cuda_driver_version(version: i32) -> String {
    format!("{}.{}", version / 1000, (version % 1000) / 10)
}

/// Loads NVML and reads every GPU.
pub fn discover() -> Result<Inventory, NvmlDiscoveryError> {
    let nvml = Nvml::init().map_err(|e| match e {
        NvmlError::LibloadingError(_)
        | NvmlError::FailedToLoadSymbol(_)
        | NvmlError::LibraryNotFound
        | NvmlError::DriverNotLoaded => NvmlDiscoveryError::LibraryMissing(e.to_string()),
        other => NvmlDiscoveryError::Call {
            call: "nvmlInit".into(),
            source: other,
        },
    })?;
    let driver_version = nvml
        .sys_driver_version()
        .map_err(call_err("nvmlSystemGetDriverVersion"))?;
    let cuda_driver_version = nvml
        .sys_cuda_driver_version()
        .map(format_cuda_driver_version)
        .map_err(call_err("nvmlSystemGetCudaDriverVersion"))?;
    let count = nvml
        .device_count()
        .map_err(call_err("nvmlDeviceGetCount"))?;
    let mut gpus = Vec::with_capacity(count as usize);
    let mut links = Vec::with_capacity(count as usize);
    for i in 0..count {
        let device = nvml
            .device_by_index(i)
            .map_err(call_err(format!("nvmlDeviceGetHandleByIndex({i})")))?;
        let name = |call: &str| format!("{call}(gpu {i})");
        let product_name = device.name().map_err(call_err(name("nvmlDeviceGetName")))?;
        let cc = device
            .cuda_compute_capability()
            .map_err(call_err(name("nvmlDeviceGetCudaComputeCapability")))?;
        let per_sm = cores_per_sm(cc.major, cc.minor);
        let cuda_cores = device.num_cores().ok();
        let multiprocessors = match device.attributes() {
            Ok(attrs) if attrs.multiprocessor_count > 0 => attrs.multiprocessor_count,
            _ => match (cuda_cores, per_sm) {
                (Some(cores), Some(per_sm)) => cores / per_sm,
                _ => 0,
            },
        };
        let cuda_cores = cuda_cores.unwrap_or_else(|| multiprocessors * per_sm.unwrap_or(0));
        let pci = device
            .pci_info()
            .map_err(call_err(name("nvmlDeviceGetPciInfo")))?;
        let pci_bus_id = normalize_pci_bus_id(&pci.bus_id);
        let sysfs = Path::new("/sys/bus/pci/devices").join(&pci_bus_id);
        links.push(GpuLinks {
            bus_id: pci_bus_id.clone(),
            peers: nvlink_peers(&nvml, &device),
        });
        let mig = read_mig(&nvml, &device, cc.major);
        gpus.push(Gpu {
            index: device
                .index()
                .map_err(call_err(name("nvmlDeviceGetIndex")))?,
            minor: device
                .minor_number()
                .map_err(call_err(name("nvmlDeviceGetMinorNumber")))?,
            uuid: device.uuid().map_err(call_err(name("nvmlDeviceGetUUID")))?,
            model: model_from_product_name(&product_name),
            product_name,
            architecture: device
                .architecture()
                .map(|a| a.to_string())
                .unwrap_or_else(|_| "Unknown".into()),
            brand: device
                .brand()
                .map(|b| format!("{b:?}"))
                .unwrap_or_else(|_| "Unknown".into()),
            memory_bytes: device
                .memory_info()
                .map_err(call_err(name("nvmlDeviceGetMemoryInfo")))?
                .total,
            multiprocessors,
            cuda_cores,
            cuda_compute_capability: format!("{}.{}", cc.major, cc.minor),
            driver_version: driver_version.clone(),
            cuda_driver_version: cuda_driver_version.clone(),
            pcie_root: std::fs::canonicalize(&sysfs)
                .ok()
                .and_then(|p| pcie_root_from_sysfs_path(&p)),
            numa_node: std::fs::read_to_string(sysfs.join("numa_node"))
                .ok()
                .and_then(|c| parse_numa_node(&c)),
            pci_bus_id,
            mig,
            nvlink_domain: None,
        });
    }
    let domains = nvlink_domains(&links);
    for gpu in &mut gpus {
        gpu.nvlink_domain = domains.get(&gpu.pci_bus_id).cloned();
    }
    gpus.sort_by_key(|g| g.index);
    Ok(Inventory {
        source: InventorySource::Nvml,
        gpus,
    })
}

/// What each active NVLink of the card reaches. Links that do not answer (no NVLink on the
/// card, a link index past its count) are skipped: a card without NVLink has no peers.
fn nvlink_peers(nvml: &Nvml, device: &Device<'_>) -> Vec<LinkPeer> {
    let mut peers = Vec::new();
    for link in 0..nvml_wrapper_sys::bindings::NVML_NVLINK_MAX_LINKS {
        let wrapper = device.link_wrapper_for(link);
        if !matches!(wrapper.is_active(), Ok(true)) {
            continue;
        }
        let Ok(remote) = wrapper.remote_pci_info() else {
            continue;
        };
        let bus_id = normalize_pci_bus_id(&remote.bus_id);
        peers.push(
            match nvml_ffi::nvlink_remote_device_type(nvml, device, link) {
                Ok(nvml_ffi::NVLINK_DEVICE_TYPE_GPU) => LinkPeer::Gpu(bus_id),
                Ok(nvml_ffi::NVLINK_DEVICE_TYPE_SWITCH) => LinkPeer::Switch(bus_id),
                _ => LinkPeer::Other,
            },
        );
    }
    peers
}

/// The card's MIG capability: `None` when NVML says the card has no MIG mode. Profiles come
/// from `nvmlDeviceGetGpuInstanceProfileInfoV` for each profile NVML defines, placements from
/// `nvmlDeviceGetGpuInstancePossiblePlacements_v2` (both work with MIG off); a profile that
/// cannot be read is left out, with a log line.
fn read_mig(nvml: &Nvml, device: &Device<'_>, cc_major: i32) -> Option<Mig> {
    let mode = device.mig_mode().ok()?;
    let mut profiles = Vec::new();
    for profile in 0..nvml_wrapper_sys::bindings::NVML_GPU_INSTANCE_PROFILE_COUNT {
        let info = match nvml_ffi::gpu_instance_profile(nvml, device, profile) {
            Ok(info) => info,
            Err(e) if e.is(nvml_ffi::NOT_SUPPORTED) || e.is(nvml_ffi::INVALID_ARGUMENT) => continue,
            Err(e) => {
                tracing::warn!(profile, error = %e, "cannot read a MIG profile; leaving it out");
                continue;
            }
        };
        match nvml_ffi::possible_placements(nvml, device, info.id) {
            Ok(placements) => profiles.extend(mig_profile(&info, &placements)),
            Err(e) => {
                tracing::warn!(profile = %info.name, error = %e, "cannot read a MIG profile's placements; leaving it out")
            }
        }
    }
    Some(Mig {
        enabled: mode.current == nvml_wrapper_sys::bindings::NVML_DEVICE_MIG_ENABLE,
        // Hopper (compute capability 9) and newer switch MIG mode without a GPU reset.
        switchable: cc_major >= 9,
        profiles,
    })
}

/// A profile of the inventory from NVML's figures and placements `(start, size)`; none when
/// it has no placement or placements of different sizes (not a layout this driver understands).
pub fn mig_profile(info: &ProfileInfo, placements: &[(u32, u32)]) -> Option<MigProfile> {
    let size = placements.first()?.1;
    if size == 0 || placements.iter().any(|(_, s)| *s != size) {
        return None;
    }
    let mut starts: Vec<u32> = placements.iter().map(|(start, _)| *start).collect();
    starts.sort_unstable();
    starts.dedup();
    let name = if info.name.is_empty() {
        // Drivers before the v2 struct give no name: NVIDIA's form, "<g>g.<GB>gb".
        format!("{}g.{}gb", info.slice_count, info.memory_mib.div_ceil(1024))
    } else {
        info.name.clone()
    };
    Some(MigProfile {
        id: info.id,
        name,
        compute_slices: info.slice_count,
        memory_slices: size,
        placements: starts,
        instances: info.instance_count,
        multiprocessors: info.multiprocessors,
        copy_engines: info.copy_engines,
        decoders: info.decoders,
        encoders: info.encoders,
        jpeg_engines: info.jpeg_engines,
        ofa_engines: info.ofa_engines,
        memory_bytes: info.memory_mib << 20,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(name: &str) -> ProfileInfo {
        ProfileInfo {
            id: 15,
            name: name.to_string(),
            slice_count: 1,
            instance_count: 4,
            multiprocessors: 14,
            copy_engines: 1,
            decoders: 1,
            encoders: 0,
            jpeg_engines: 0,
            ofa_engines: 0,
            memory_mib: 9856,
        }
    }

    #[test]
    fn a_profile_takes_nvml_figures_and_sorted_placements() {
        let p = mig_profile(&info("1g.10gb"), &[(6, 2), (0, 2), (4, 2), (2, 2)]).unwrap();
        assert_eq!(p.placements, [0, 2, 4, 6]);
        assert_eq!((p.memory_slices, p.compute_slices, p.instances), (2, 1, 4));
        assert_eq!(p.memory_bytes, 9856 << 20);
        let unnamed = mig_profile(&info(""), &[(0, 2)]).unwrap();
        assert_eq!(unnamed.name, "1g.10gb");
        assert!(mig_profile(&info("x"), &[]).is_none());
        assert!(mig_profile(&info("x"), &[(0, 1), (2, 2)]).is_none());
    }

    #[test]
    fn bus_ids_take_the_sysfs_form() {
        assert_eq!(normalize_pci_bus_id("00000000:07:00.0"), "0000:07:00.0");
        assert_eq!(normalize_pci_bus_id("00000001:8A:00.0"), "0001:8a:00.0");
        assert_eq!(normalize_pci_bus_id("0000:07:00.0"), "0000:07:00.0");
    }

    #[test]
    fn pcie_root_is_the_root_complex_component() {
        let path = Path::new("/sys/devices/pci0000:00/0000:00:01.0/0000:07:00.0");
        assert_eq!(
            pcie_root_from_sysfs_path(path).as_deref(),
            Some("pci0000:00")
        );
        let deep = Path::new("/sys/devices/pci0000:80/0000:80:03.1/0000:81:00.0/0000:82:00.0");
        assert_eq!(
            pcie_root_from_sysfs_path(deep).as_deref(),
            Some("pci0000:80")
        );
        assert_eq!(
            pcie_root_from_sysfs_path(Path::new("/sys/bus/pci/devices")),
            None
        );
    }

    #[test]
    fn numa_minus_one_means_none() {
        assert_eq!(parse_numa_node("-1\n"), None);
        assert_eq!(parse_numa_node("1\n"), Some(1));
        assert_eq!(parse_numa_node(""), None);
    }

    #[test]
    fn cuda_versions_and_core_counts() {
        assert_eq!(format_cuda_driver_version(12040), "12.4");
        assert_eq!(format_cuda_driver_version(11080), "11.8");
        assert_eq!(cores_per_sm(8, 0), Some(64));
        assert_eq!(cores_per_sm(8, 6), Some(128));
        assert_eq!(cores_per_sm(7, 0), Some(64));
        assert_eq!(cores_per_sm(9, 0), Some(128));
        assert_eq!(cores_per_sm(2, 0), None);
    }
}

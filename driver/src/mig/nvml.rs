//! MIG on real cards, through NVML (the raw calls in `nvml_ffi`, since nvml-wrapper has no
//! create/destroy). Written against nvml.h and NVIDIA's documentation; it has not run on a card
//! yet (README, "What ran on real hardware").

use std::path::PathBuf;

use nvml_wrapper::Nvml;

use super::{
    capability_nodes, ComputeInstance, GpuInstance, MigError, MigErrorKind, MigManager, Placement,
};
use crate::nvml_ffi::{self, NvmlCallError};

/// Where the kernel driver lists the capability minors of MIG instances.
pub const MIG_MINORS: &str = "/proc/driver/nvidia-caps/mig-minors";

/// MIG through the node's NVML.
pub struct NvmlMig {
    nvml: Nvml,
    /// Every GPU-instance profile id of each card, to list its instances.
    profile_ids: std::collections::BTreeMap<String, Vec<u32>>,
    /// Minor number of each card (`/dev/nvidia<minor>`), for its capability nodes.
    minors: std::collections::BTreeMap<String, u32>,
    mig_minors: PathBuf,
}

impl std::fmt::Debug for NvmlMig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlMig")
            .field("cards", &self.profile_ids.keys().collect::<Vec<_>>())
            .finish()
    }
}

fn kind_of(e: &NvmlCallError) -> MigErrorKind {
    match e.code {
        nvml_ffi::INSUFFICIENT_RESOURCES => MigErrorKind::Occupied,
        nvml_ffi::IN_USE => MigErrorKind::InUse,
        _ => MigErrorKind::Failed(e.to_string()),
    }
}

impl NvmlMig {
    /// Loads NVML; `inventory`'s MIG-capable cards are the ones it manages.
    pub fn new(inventory: &gpupool_api::inventory::Inventory) -> Result<Self, MigError> {
        let nvml = Nvml::init().map_err(|e| {
            MigError::new("loading NVML for MIG", MigErrorKind::Failed(e.to_string()))
        })?;
        let mut profile_ids = std::collections::BTreeMap::new();
        let mut minors = std::collections::BTreeMap::new();
        for gpu in &inventory.gpus {
            if let Some(mig) = &gpu.mig {
                profile_ids.insert(
                    gpu.uuid.clone(),
                    mig.profiles.iter().map(|p| p.id).collect(),
                );
                minors.insert(gpu.uuid.clone(), gpu.minor);
            }
        }
        Ok(NvmlMig {
            nvml,
            profile_ids,
            minors,
            mig_minors: PathBuf::from(MIG_MINORS),
        })
    }

    /// `work` on the card's handle; errors name the step and the card.
    fn on_card<T>(
        &self,
        parent_uuid: &str,
        step: &str,
        work: impl FnOnce(&nvml_wrapper::Device<'_>) -> Result<T, NvmlCallError>,
    ) -> Result<T, MigError> {
        let step = format!("{step} on {parent_uuid}");
        let device = self.nvml.device_by_uuid(parent_uuid).map_err(|e| {
            MigError::new(
                step.clone(),
                MigErrorKind::Failed(format!("nvmlDeviceGetHandleByUUID: {e}")),
            )
        })?;
        work(&device).map_err(|e| MigError::new(step, kind_of(&e)))
    }
}

impl MigManager for NvmlMig {
    fn mig_enabled(&self, parent_uuid: &str) -> Result<bool, MigError> {
        let step = format!("reading MIG mode of {parent_uuid}");
        let device = self
            .nvml
            .device_by_uuid(parent_uuid)
            .map_err(|e| MigError::new(step.clone(), MigErrorKind::Failed(e.to_string())))?;
        device
            .mig_mode()
            .map(|m| m.current == nvml_wrapper_sys::bindings::NVML_DEVICE_MIG_ENABLE)
            .map_err(|e| MigError::new(step, MigErrorKind::Failed(e.to_string())))
    }

    fn set_mig_enabled(&self, parent_uuid: &str, enabled: bool) -> Result<(), MigError> {
        let step = format!("switching MIG mode {}", if enabled { "on" } else { "off" });
        self.on_card(parent_uuid, &step, |d| {
            nvml_ffi::set_mig_mode(&self.nvml, d, enabled)
        })
    }

    fn create_gpu_instance(&self, placement: &Placement) -> Result<u32, MigError> {
        let step = format!(
            "creating GPU instance of profile {} at memory slice {}",
            placement.profile_id, placement.start
        );
        self.on_card(&placement.parent_uuid, &step, |d| {
            nvml_ffi::create_gpu_instance(
                &self.nvml,
                d,
                placement.profile_id,
                placement.start,
                placement.size,
            )
        })
    }

    fn create_compute_instance(
        &self,
        parent_uuid: &str,
        gpu_instance: u32,
        compute_slices: u32,
    ) -> Result<ComputeInstance, MigError> {
        let step = format!("creating the compute instance of GPU instance {gpu_instance}");
        let (id, uuid) = self.on_card(parent_uuid, &step, |d| {
            let id =
                nvml_ffi::create_compute_instance(&self.nvml, d, gpu_instance, compute_slices)?;
            let uuid = nvml_ffi::mig_device_uuid(&self.nvml, d, gpu_instance, id)?;
            Ok((id, uuid))
        })?;
        let minor = self.minors.get(parent_uuid).copied().unwrap_or_default();
        let minors = std::fs::read_to_string(&self.mig_minors).map_err(|e| {
            MigError::new(
                format!("reading {}", self.mig_minors.display()),
                MigErrorKind::Failed(e.to_string()),
            )
        })?;
        let device_nodes = capability_nodes(&minors, minor, gpu_instance, id);
        if device_nodes.len() != 2 {
            return Err(MigError::new(
                format!(
                    "finding the capability nodes of GPU instance {gpu_instance}, compute instance {id} on {parent_uuid}"
                ),
                MigErrorKind::Failed(format!(
                    "{} lists {} of the 2 expected",
                    self.mig_minors.display(),
                    device_nodes.len()
                )),
            ));
        }
        Ok(ComputeInstance {
            id,
            uuid,
            device_nodes,
        })
    }

    fn destroy_compute_instance(
        &self,
        parent_uuid: &str,
        gpu_instance: u32,
        compute_instance: u32,
    ) -> Result<(), MigError> {
        let step = format!(
            "destroying compute instance {compute_instance} of GPU instance {gpu_instance}"
        );
        self.on_card(parent_uuid, &step, |d| {
            nvml_ffi::destroy_compute_instance(&self.nvml, d, gpu_instance, compute_instance)
        })
    }

    fn destroy_gpu_instance(&self, parent_uuid: &str, gpu_instance: u32) -> Result<(), MigError> {
        let step = format!("destroying GPU instance {gpu_instance}");
        self.on_card(parent_uuid, &step, |d| {
            nvml_ffi::destroy_gpu_instance(&self.nvml, d, gpu_instance)
        })
    }

    fn gpu_instances(&self, parent_uuid: &str) -> Result<Vec<GpuInstance>, MigError> {
        let profiles = self
            .profile_ids
            .get(parent_uuid)
            .cloned()
            .unwrap_or_default();
        let found = self.on_card(parent_uuid, "listing MIG instances", |d| {
            nvml_ffi::gpu_instances(&self.nvml, d, &profiles)
        })?;
        Ok(found
            .into_iter()
            .map(|gi| GpuInstance {
                id: gi.id,
                profile_id: gi.profile_id,
                start: gi.start,
                size: gi.size,
                compute_instances: gi.compute_instances,
            })
            .collect())
    }
}

//! The claim's CDI spec and the kubelet's answer.

use std::path::Path;
use std::sync::atomic::Ordering;

use gpupool_api::claim::{ClaimRef, PreparedDevice};
use gpupool_api::config::EffectiveConfig;

use super::cdi::{self, SpecDevice};
use super::claim::AllocatedDevice;
use super::{limits, nvidia_cdi, ClaimPreparer, DriverLibraries, PrepareErrorKind};
use crate::devices::{DeviceKind, NodeDevice};
use crate::node_state::checkpoint::MigRecord;

impl ClaimPreparer {
    /// The claim's CDI spec and the kubelet's answer, once its MIG instances exist (`mig`).
    pub(super) fn answer(
        &self,
        claim: &ClaimRef,
        per_device: &[(AllocatedDevice, NodeDevice<'_>, EffectiveConfig)],
        device_limits: &[limits::DeviceLimits],
        mig: &[MigRecord],
    ) -> Result<(cdi::Rendered, Vec<PreparedDevice>), PrepareErrorKind> {
        let layout = self.state.layout();
        let spec_devices: Vec<SpecDevice> = per_device
            .iter()
            .zip(device_limits)
            .map(|((allocated, device, _), limits)| SpecDevice {
                allocated,
                gpu: device.gpu,
                limits,
                mig: match device.kind {
                    DeviceKind::Mig { profile, .. } => mig
                        .iter()
                        .find(|r| r.device == allocated.device)
                        .map(|r| cdi::MigSpec {
                            profile: &profile.name,
                            uuid: r.uuid.as_deref().unwrap_or_default(),
                            device_nodes: &r.device_nodes,
                        }),
                    DeviceKind::Card => None,
                },
            })
            .collect();
        let rendered = cdi::render(&claim.uid, &spec_devices, layout, &|p: &Path| p.exists())?;
        if let Some(warning) = &rendered.warning {
            if !self.warned_missing_lib.swap(true, Ordering::Relaxed) {
                tracing::warn!("{warning}");
            }
        }

        let mut devices = Vec::with_capacity(per_device.len());
        for ((d, device, _), id) in per_device.iter().zip(&rendered.cdi_ids) {
            let mut cdi_device_ids = vec![id.clone()];
            if let (false, DriverLibraries::NvidiaCdi { spec_dirs }) =
                (layout.fake_gpus, &self.opts.driver_libraries)
            {
                // A MIG device's driver libraries are its card's.
                let gpu = device.gpu;
                let nvidia = nvidia_cdi::find_device_id(spec_dirs, &gpu.uuid, gpu.index).map_err(
                    |source| PrepareErrorKind::NvidiaCdi {
                        device: d.device.clone(),
                        source,
                    },
                )?;
                cdi_device_ids.push(nvidia);
            }
            devices.push(PreparedDevice {
                request_names: vec![d.request.clone()],
                pool_name: d.pool.clone(),
                device_name: d.device.clone(),
                cdi_device_ids,
                share_id: d.share_id.clone(),
            });
        }
        Ok((rendered, devices))
    }
}

//! What `kubectl describe resourceclaim` shows for a MIG device (pure): the same Ready condition
//! as a card's share, and data that says which partition was made: profile, MIG device UUID,
//! GPU and compute instance ids, the card, its memory and SMs, and its compute in weight units.

use gpupool_api::inventory::{Gpu, MigProfile};
use gpupool_api::names::DEVICE_TYPE_MIG;
use gpupool_api::quantity;
use k8s_openapi::api::resource::v1::AllocatedDeviceStatus;
use k8s_openapi::jiff::Timestamp;
use serde_json::{json, Value};

use super::claim::AllocatedDevice;
use super::limits::DeviceLimits;
use crate::node_state::checkpoint::MigRecord;

/// The `data` of a MIG device's status entry (well under the 10 KiB limit: no free text).
pub fn device_data(
    gpu: &Gpu,
    profile: &MigProfile,
    record: &MigRecord,
    limits: &DeviceLimits,
    weight: Option<i64>,
) -> Value {
    let mut data = json!({
        "type": DEVICE_TYPE_MIG,
        "migProfile": profile.name,
        "migUUID": record.uuid,
        "gpuInstance": record.gpu_instance,
        "computeInstance": record.compute_instance,
        "parentUUID": gpu.uuid,
        "model": gpu.model,
        "memory": quantity::format_bytes(limits.memory_bytes),
        "multiprocessors": profile.multiprocessors,
        "isolation": "MIG",
        "cudaOrdinal": limits.ordinal,
    });
    if let Some(units) = weight
        .and_then(|w| crate::devices::mig_weight(w, gpu.multiprocessors, profile.multiprocessors))
    {
        data["computeUnits"] = json!(units);
    }
    data
}

/// This driver's status entry for one prepared MIG device (`mig`: its profile and what prepare
/// created for it).
pub fn device_status(
    device: &AllocatedDevice,
    gpu: &Gpu,
    mig: (&MigProfile, &MigRecord),
    limits: &DeviceLimits,
    weight: Option<i64>,
    generation: Option<i64>,
    now: Timestamp,
) -> AllocatedDeviceStatus {
    let (profile, record) = mig;
    let message = format!(
        "prepared: MIG {} (GPU instance {}, compute instance {}) of {}: {} of memory, {} SMs",
        profile.name,
        record
            .gpu_instance
            .map_or_else(|| "?".into(), |i| i.to_string()),
        record
            .compute_instance
            .map_or_else(|| "?".into(), |i| i.to_string()),
        gpu.uuid,
        quantity::format_bytes(limits.memory_bytes),
        profile.multiprocessors,
    );
    super::status::prepared_entry(
        device,
        ("Prepared", message),
        device_data(gpu, profile, record, limits, weight),
        generation,
        now,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::{find, DeviceKind};
    use crate::prepare::claim::tests::inventory;
    use gpupool_api::config::Enforcement;

    #[test]
    fn a_mig_status_names_the_partition_its_instances_and_its_compute() {
        let inv = inventory();
        let d = find(&inv, "gpu-2-mig-1g-10gb-3").unwrap();
        let DeviceKind::Mig { profile, start } = d.kind else {
            unreachable!()
        };
        let record = MigRecord {
            device: d.name.clone(),
            parent_uuid: d.gpu.uuid.clone(),
            profile_id: profile.id,
            compute_slices: profile.compute_slices,
            start,
            size: profile.memory_slices,
            gpu_instance: Some(5),
            compute_instance: Some(0),
            uuid: Some("MIG-11111111-2222-4333-8444-555555555555".into()),
            device_nodes: Vec::new(),
        };
        let limits = DeviceLimits {
            ordinal: 0,
            memory_bytes: profile.memory_bytes,
            cores: 0,
            enforcement: Enforcement::None,
            compute: gpupool_api::config::Compute::Limiter,
            priority: None,
        };
        let allocated = AllocatedDevice {
            request: "gpu".into(),
            pool: "node-a".into(),
            device: d.name.clone(),
            share_id: None,
            consumed: Default::default(),
        };
        let status = device_status(
            &allocated,
            d.gpu,
            (profile, &record),
            &limits,
            Some(989),
            Some(1),
            Timestamp::UNIX_EPOCH,
        );
        let ready = &status.conditions.as_ref().unwrap()[0];
        assert_eq!(
            (ready.type_.as_str(), ready.status.as_str()),
            ("Ready", "True")
        );
        assert!(
            ready
                .message
                .starts_with("prepared: MIG 1g.10gb (GPU instance 5, compute instance 0) of GPU-2"),
            "{}",
            ready.message
        );
        let data = &status.data.as_ref().unwrap().0;
        assert_eq!(data["migUUID"], "MIG-11111111-2222-4333-8444-555555555555");
        assert_eq!(data["gpuInstance"], 5);
        assert_eq!(data["multiprocessors"], 16);
        assert_eq!(data["computeUnits"], 119);
        assert_eq!(data["isolation"], "MIG");
        assert!(serde_json::to_vec(data).unwrap().len() < super::super::status::MAX_DATA_BYTES);
    }
}

//! What the user sees: `status.devices[]` of the claim (`kubectl describe resourceclaim`) and a
//! Warning Event when preparation fails. Pure builders; the I/O is in mod.rs.

use gpupool_api::inventory::Gpu;
use gpupool_api::names::DRIVER_NAME;
use gpupool_api::quantity;
use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference};
use k8s_openapi::api::resource::v1::AllocatedDeviceStatus;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, MicroTime, ObjectMeta, Time};
use k8s_openapi::apimachinery::pkg::runtime::RawExtension;
use k8s_openapi::jiff::Timestamp;
use serde_json::{json, Map, Value};

use super::claim::AllocatedDevice;
use super::limits::DeviceLimits;
use gpupool_api::claim::ClaimRef;

/// Upstream limit on `status.devices[].data`.
pub const MAX_DATA_BYTES: usize = 10240;
pub const EVENT_REASON_PREPARE_FAILED: &str = "PrepareFailed";
pub const COMPONENT: &str = "gpupool-driver";

/// Compute units of a share: the model's weight times the share of its compute.
pub fn compute_units(weight: Option<i64>, cores: u32) -> Option<f64> {
    match weight {
        Some(w) if w > 0 && cores > 0 => Some((w as f64) * f64::from(cores) / 100.0),
        _ => None,
    }
}

/// The `data` object of one device's status, kept under the upstream size limit.
pub fn device_data(
    gpu: &Gpu,
    limits: &DeviceLimits,
    weight: Option<i64>,
    warning: Option<&str>,
) -> Value {
    let mut data = Map::new();
    data.insert(
        "memoryLimit".into(),
        json!(quantity::format_bytes(limits.memory_bytes)),
    );
    data.insert("coreLimit".into(), json!(limits.cores));
    if let Some(units) = compute_units(weight, limits.cores) {
        data.insert("computeUnits".into(), json!(units));
    }
    data.insert("model".into(), json!(gpu.model));
    data.insert("uuid".into(), json!(gpu.uuid));
    data.insert("enforcement".into(), json!(limits.enforcement.as_str()));
    if limits.compute == gpupool_api::config::Compute::Mps {
        data.insert("compute".into(), json!(limits.compute.as_str()));
    }
    data.insert("cudaOrdinal".into(), json!(limits.ordinal));
    if let Some(w) = warning {
        data.insert("warning".into(), json!(w));
    }
    let mut value = Value::Object(data);
    if serde_json::to_vec(&value).map_or(0, |v| v.len()) > MAX_DATA_BYTES {
        // Only a pathological warning can get here; keep the limits, drop the prose.
        if let Value::Object(m) = &mut value {
            m.insert("warning".into(), json!("(truncated)"));
        }
    }
    value
}

/// What the Ready condition says; it agrees with the reason: enforced, or why not.
fn ready_message(limits: &DeviceLimits, warning: Option<&str>) -> String {
    let cores = match (limits.cores, limits.compute) {
        (0, gpupool_api::config::Compute::Mps) => "all SMs through MPS".to_string(),
        (0, _) => "no SM limit".to_string(),
        (cores, gpupool_api::config::Compute::Mps) => format!("{cores}% of the SMs through MPS"),
        (cores, _) => format!("{cores}% of the SMs"),
    };
    let enforcement = match (warning, limits.enforcement.library_name()) {
        (Some(warning), _) => format!("; {warning}"),
        (None, Some(library)) => format!(", enforced by {library}"),
        (None, None) => ", not enforced (enforcement None)".to_string(),
    };
    format!(
        "prepared: {} of memory, {cores}{enforcement}",
        quantity::format_bytes(limits.memory_bytes),
    )
}

/// This driver's status entry for one prepared device.
pub fn device_status(
    device: &AllocatedDevice,
    gpu: &Gpu,
    limits: &DeviceLimits,
    weight: Option<i64>,
    warning: Option<&str>,
    generation: Option<i64>,
    now: Timestamp,
) -> AllocatedDeviceStatus {
    let reason = if warning.is_some() {
        "PreparedNotEnforced"
    } else {
        "Prepared"
    };
    prepared_entry(
        device,
        (reason, ready_message(limits, warning)),
        device_data(gpu, limits, weight, warning),
        generation,
        now,
    )
}

/// The entry of a prepared device: Ready, for `reason` with `message`, and what it is in `data`.
pub(super) fn prepared_entry(
    device: &AllocatedDevice,
    (reason, message): (&str, String),
    data: Value,
    generation: Option<i64>,
    now: Timestamp,
) -> AllocatedDeviceStatus {
    AllocatedDeviceStatus {
        driver: DRIVER_NAME.to_string(),
        pool: device.pool.clone(),
        device: device.device.clone(),
        share_id: device.share_id.clone(),
        conditions: Some(vec![Condition {
            type_: "Ready".into(),
            status: "True".into(),
            reason: reason.into(),
            message,
            last_transition_time: Time(now),
            observed_generation: generation,
        }]),
        data: Some(RawExtension(data)),
        network_data: None,
    }
}

fn is_ours(entry: &AllocatedDeviceStatus, pool: &str) -> bool {
    entry.driver == DRIVER_NAME && entry.pool == pool
}

/// The full `status.devices` list: other drivers' and other pools' entries kept, ours replaced.
pub fn merge_device_status(
    existing: &[AllocatedDeviceStatus],
    pool: &str,
    ours: Vec<AllocatedDeviceStatus>,
) -> Vec<AllocatedDeviceStatus> {
    existing
        .iter()
        .filter(|e| !is_ours(e, pool))
        .cloned()
        .chain(ours)
        .collect()
}

/// Reason of the Ready condition while the device is tainted, and once it has recovered.
pub const REASON_DEVICE_UNHEALTHY: &str = "DeviceUnhealthy";
pub const REASON_DEVICE_RECOVERED: &str = "DeviceRecovered";

/// Our entries of `existing` with each device's health in its Ready condition: False with the
/// fault while the device is in `unhealthy` (device name -> what is wrong), True again once a
/// device that was reported unhealthy is not. `None` when no condition changes.
pub fn with_device_health(
    existing: &[AllocatedDeviceStatus],
    pool: &str,
    unhealthy: &std::collections::BTreeMap<String, String>,
    now: Timestamp,
) -> Option<Vec<AllocatedDeviceStatus>> {
    let mut changed = false;
    let list = existing
        .iter()
        .cloned()
        .map(|mut entry| {
            if !is_ours(&entry, pool) {
                return entry;
            }
            let Some(ready) = entry
                .conditions
                .get_or_insert_with(Vec::new)
                .iter_mut()
                .find(|c| c.type_ == "Ready")
            else {
                return entry;
            };
            let wanted = match unhealthy.get(&entry.device) {
                Some(fault) => Some((
                    "False",
                    REASON_DEVICE_UNHEALTHY,
                    format!("device {} is unhealthy: {fault}", entry.device),
                )),
                None if ready.reason == REASON_DEVICE_UNHEALTHY => Some((
                    "True",
                    REASON_DEVICE_RECOVERED,
                    format!("device {} is healthy again", entry.device),
                )),
                None => None,
            };
            if let Some((status, reason, message)) = wanted {
                if ready.status != status || ready.reason != reason || ready.message != message {
                    if ready.status != status {
                        ready.last_transition_time = Time(now);
                    }
                    ready.status = status.into();
                    ready.reason = reason.into();
                    ready.message = message;
                    changed = true;
                }
            }
            entry
        })
        .collect();
    changed.then_some(list)
}

/// A Warning Event on the claim, as `kubectl describe resourceclaim` lists them.
pub fn prepare_failed_event(claim: &ClaimRef, node: &str, message: &str, now: Timestamp) -> Event {
    let involved = ObjectReference {
        api_version: Some("resource.k8s.io/v1".into()),
        kind: Some("ResourceClaim".into()),
        name: Some(claim.name.clone()),
        namespace: Some(claim.namespace.clone()),
        uid: Some(claim.uid.clone()),
        ..Default::default()
    };
    let mut event = warning_event(
        involved,
        &claim.namespace,
        &claim.name,
        EVENT_REASON_PREPARE_FAILED,
        message,
        node,
        now,
    );
    event.action = Some("PrepareResources".into());
    event
}

/// A Warning Event on the Node (a corrupt checkpoint was moved aside, a GPU fault), about what the
/// driver did (`action`: the API server refuses an Event with an `eventTime` and no action).
pub fn node_event(node: &str, action: &str, reason: &str, message: &str, now: Timestamp) -> Event {
    let involved = ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Node".into()),
        name: Some(node.into()),
        // The Node's uid is not known here; name and kind identify it.
        ..Default::default()
    };
    let mut event = warning_event(involved, "default", node, reason, message, node, now);
    event.action = Some(action.into());
    event
}

/// A Warning Event from this node's driver about `involved`, named after `name` in `namespace`.
fn warning_event(
    involved: ObjectReference,
    namespace: &str,
    name: &str,
    reason: &str,
    message: &str,
    node: &str,
    now: Timestamp,
) -> Event {
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    Event {
        metadata: ObjectMeta {
            // Object names stop at 253 characters; a long object name must not lose the event.
            name: Some(format!(
                "{}.{}",
                name.chars().take(200).collect::<String>(),
                &suffix[..16]
            )),
            namespace: Some(namespace.into()),
            ..Default::default()
        },
        involved_object: involved,
        reason: Some(reason.into()),
        message: Some(message.chars().take(1024).collect()),
        type_: Some("Warning".into()),
        source: Some(EventSource {
            component: Some(COMPONENT.into()),
            host: Some(node.into()),
        }),
        reporting_component: Some(format!("{DRIVER_NAME}/{COMPONENT}")),
        reporting_instance: Some(node.into()),
        first_timestamp: Some(Time(now)),
        last_timestamp: Some(Time(now)),
        event_time: Some(MicroTime(now)),
        count: Some(1),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prepare::claim::tests::{claim_ref, inventory, UID};
    use gpupool_api::config::Enforcement;

    fn limits() -> DeviceLimits {
        DeviceLimits {
            ordinal: 0,
            memory_bytes: 8 << 30,
            cores: 50,
            enforcement: Enforcement::HamiCore,
            compute: gpupool_api::config::Compute::Limiter,
            priority: None,
        }
    }

    fn device() -> AllocatedDevice {
        AllocatedDevice {
            request: "gpu".into(),
            pool: "node-a".into(),
            device: "gpu-0".into(),
            share_id: Some("s1".into()),
            consumed: Default::default(),
        }
    }

    #[test]
    fn status_entry_names_the_share_and_its_limits() {
        let inv = inventory();
        let s = device_status(
            &device(),
            &inv.gpus[0],
            &limits(),
            Some(312),
            None,
            Some(3),
            Timestamp::UNIX_EPOCH,
        );
        assert_eq!(
            (s.driver.as_str(), s.pool.as_str(), s.device.as_str()),
            ("gpupool.dev", "node-a", "gpu-0")
        );
        assert_eq!(s.share_id.as_deref(), Some("s1"));
        let c = &s.conditions.as_ref().unwrap()[0];
        assert_eq!(
            (c.type_.as_str(), c.status.as_str(), c.reason.as_str()),
            ("Ready", "True", "Prepared")
        );
        assert_eq!(c.observed_generation, Some(3));
        let data = &s.data.as_ref().unwrap().0;
        assert_eq!(data["memoryLimit"], "8Gi");
        assert_eq!(data["coreLimit"], 50);
        assert_eq!(data["computeUnits"], 156.0);
        assert_eq!(data["model"], "A100-SXM4-40GB");
        assert_eq!(data["uuid"], inv.gpus[0].uuid);
        assert!(data.get("warning").is_none());

        let warned = device_data(&inv.gpus[0], &limits(), None, Some(&"x".repeat(20000)));
        assert!(serde_json::to_vec(&warned).unwrap().len() <= MAX_DATA_BYTES);
        assert!(warned.get("computeUnits").is_none());
        assert_eq!(compute_units(Some(312), 0), None);
    }

    #[test]
    fn ready_message_agrees_with_the_reason() {
        let inv = inventory();
        let ready = |limits: &DeviceLimits, warning: Option<&str>| {
            let s = device_status(
                &device(),
                &inv.gpus[0],
                limits,
                None,
                warning,
                None,
                Timestamp::UNIX_EPOCH,
            );
            let c = s.conditions.unwrap().remove(0);
            (c.reason, c.message)
        };
        let enforced = DeviceLimits {
            enforcement: Enforcement::Gpupool,
            ..limits()
        };
        assert_eq!(
            ready(&enforced, None),
            (
                "Prepared".to_string(),
                "prepared: 8Gi of memory, 50% of the SMs, enforced by gpupool-vgpu".to_string()
            )
        );
        let missing = "gpupool-vgpu (/usr/local/gpupool/libgpupool_vgpu.so) is not installed on \
                       this node: limits are set but not enforced";
        let (reason, message) = ready(&enforced, Some(missing));
        assert_eq!(reason, "PreparedNotEnforced");
        assert_eq!(
            message,
            format!("prepared: 8Gi of memory, 50% of the SMs; {missing}")
        );
        assert!(!message.contains("enforced by"), "{message}");
        let off = DeviceLimits {
            enforcement: Enforcement::None,
            cores: 0,
            ..limits()
        };
        assert_eq!(
            ready(&off, None).1,
            "prepared: 8Gi of memory, no SM limit, not enforced (enforcement None)"
        );
        let mps = DeviceLimits {
            enforcement: Enforcement::Gpupool,
            compute: gpupool_api::config::Compute::Mps,
            cores: 30,
            ..limits()
        };
        assert_eq!(
            ready(&mps, None).1,
            "prepared: 8Gi of memory, 30% of the SMs through MPS, enforced by gpupool-vgpu"
        );
        let data = device_data(&inv.gpus[0], &mps, None, None);
        assert_eq!(
            (data["compute"].as_str(), data["coreLimit"].as_u64()),
            (Some("Mps"), Some(30))
        );
        assert!(device_data(&inv.gpus[0], &limits(), None, None)
            .get("compute")
            .is_none());
    }

    /// Our entry for the test device, and the same device as another driver's entry.
    fn ours_and_another_drivers() -> (AllocatedDeviceStatus, AllocatedDeviceStatus) {
        let ours = device_status(
            &device(),
            &inventory().gpus[0],
            &limits(),
            None,
            None,
            None,
            Timestamp::UNIX_EPOCH,
        );
        let mut other = ours.clone();
        other.driver = "net.example.com".into();
        (ours, other)
    }

    #[test]
    fn merge_keeps_other_drivers_entries() {
        let (ours, other) = ours_and_another_drivers();
        let mut other_pool = ours.clone();
        other_pool.pool = "node-b".into();
        let merged = merge_device_status(
            &[other.clone(), ours.clone(), other_pool.clone()],
            "node-a",
            vec![],
        );
        assert_eq!(merged, vec![other.clone(), other_pool]);
        assert!(!merged.iter().any(|e| is_ours(e, "node-a")));
        let merged =
            merge_device_status(std::slice::from_ref(&other), "node-a", vec![ours.clone()]);
        assert_eq!(merged, vec![other, ours]);
    }

    #[test]
    fn a_tainted_device_makes_its_entries_not_ready_until_it_recovers() {
        let (ours, other) = ours_and_another_drivers();
        let existing = vec![other.clone(), ours.clone()];
        let now = Timestamp::from_second(1_700_000_000).unwrap();
        let ready = |list: &[AllocatedDeviceStatus], i: usize| {
            let c = &list[i].conditions.as_ref().unwrap()[0];
            (c.status.clone(), c.reason.clone(), c.message.clone())
        };

        let healthy = std::collections::BTreeMap::new();
        assert_eq!(with_device_health(&existing, "node-a", &healthy, now), None);

        let tainted =
            std::collections::BTreeMap::from([(ours.device.clone(), "XID 79".to_string())]);
        let down = with_device_health(&existing, "node-a", &tainted, now).unwrap();
        assert_eq!(down[0], other, "another driver's entry is left alone");
        let (status, reason, message) = ready(&down, 1);
        assert_eq!(
            (status.as_str(), reason.as_str()),
            ("False", REASON_DEVICE_UNHEALTHY)
        );
        assert!(
            message.contains("XID 79") && message.contains(&ours.device),
            "{message}"
        );
        assert_eq!(
            down[1].conditions.as_ref().unwrap()[0].last_transition_time,
            Time(now)
        );
        assert_eq!(
            with_device_health(&down, "node-a", &tainted, now),
            None,
            "no repeat"
        );

        let up = with_device_health(&down, "node-a", &healthy, now).unwrap();
        let (status, reason, _) = ready(&up, 1);
        assert_eq!(
            (status.as_str(), reason.as_str()),
            ("True", REASON_DEVICE_RECOVERED)
        );
        assert_eq!(with_device_health(&up, "node-a", &healthy, now), None);
    }

    #[test]
    fn failure_event_points_at_the_claim() {
        let e = prepare_failed_event(
            &claim_ref(UID),
            "node-a",
            "not allocated",
            Timestamp::UNIX_EPOCH,
        );
        assert_eq!(e.type_.as_deref(), Some("Warning"));
        assert_eq!(e.reason.as_deref(), Some("PrepareFailed"));
        assert_eq!(e.involved_object.kind.as_deref(), Some("ResourceClaim"));
        assert_eq!(e.involved_object.uid.as_deref(), Some(UID));
        assert_eq!(e.metadata.namespace.as_deref(), Some("team-a"));
        assert!(e.metadata.name.unwrap().starts_with("train."));
    }
}

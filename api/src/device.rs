//! The consumable capacities of a gpupool device (docs/architecture.md, "Device model"), defined once: the driver
//! publishes them and the scheduler stand-in's tests allocate against exactly the same shape.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, DeviceCapacity,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::names::{capacity, MEMORY_STEP_BYTES};
use crate::quantity::format_bytes;

/// Memory offered for a card of `memory_bytes`: rounded down to the 1Mi step, because the request
/// policy's default (the whole card) must be a multiple of the step.
pub fn published_memory_bytes(memory_bytes: u64) -> u64 {
    memory_bytes / MEMORY_STEP_BYTES * MEMORY_STEP_BYTES
}

/// `memory` and `cores`, and nothing else (every capacity of a shared device is consumed by every
/// claim). `shared`: with the request policies of consumable capacity (memory: default the whole
/// card, min and step 1Mi; cores: default 0, 0..=100 step 1); otherwise plain values for clusters
/// without DRAConsumableCapacity, where each device is allocated whole.
pub fn gpu_capacity(memory_bytes: u64, shared: bool) -> BTreeMap<String, DeviceCapacity> {
    let q = |s: &str| Quantity(s.to_string());
    let memory = format_bytes(published_memory_bytes(memory_bytes));
    let step = format_bytes(MEMORY_STEP_BYTES);
    let policy = |default: &str, min: &str, max: Option<&str>, step: &str| {
        shared.then(|| CapacityRequestPolicy {
            default: Some(q(default)),
            valid_range: Some(CapacityRequestPolicyRange {
                min: q(min),
                max: max.map(q),
                step: Some(q(step)),
            }),
            valid_values: None,
        })
    };
    BTreeMap::from([
        (
            capacity::MEMORY.to_string(),
            DeviceCapacity {
                value: q(&memory),
                request_policy: policy(&memory, &step, None, &step),
            },
        ),
        (
            capacity::CORES.to_string(),
            DeviceCapacity {
                value: q("100"),
                request_policy: policy("0", "0", Some("100"), "1"),
            },
        ),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_capacities_follow_the_device_model() {
        let caps = gpu_capacity(40 << 30, true);
        assert_eq!(caps.len(), 2);
        let memory = &caps["memory"];
        assert_eq!(memory.value.0, "40Gi");
        let policy = memory.request_policy.as_ref().unwrap();
        assert_eq!(policy.default.as_ref().unwrap().0, "40Gi");
        let range = policy.valid_range.as_ref().unwrap();
        assert_eq!(
            (
                range.min.0.as_str(),
                range.step.as_ref().unwrap().0.as_str()
            ),
            ("1Mi", "1Mi")
        );
        assert!(range.max.is_none());
        let cores = caps["cores"].request_policy.as_ref().unwrap();
        assert_eq!(cores.default.as_ref().unwrap().0, "0");
        let range = cores.valid_range.as_ref().unwrap();
        assert_eq!(range.max.as_ref().unwrap().0, "100");
    }

    #[test]
    fn memory_is_rounded_down_to_the_step_and_exclusive_has_no_policy() {
        let caps = gpu_capacity((1 << 30) + 12345, false);
        assert_eq!(caps["memory"].value.0, "1Gi");
        assert!(caps.values().all(|c| c.request_policy.is_none()));
    }
}

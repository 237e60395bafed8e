//! Inventory -> the ResourceSlices of this node's pool (pure; the publisher sends them).
//!
//! One pool per node, named after the node; one device per GPU (`gpu-<index>`) with the attributes and
//! the two consumable capacities of the device model (docs/architecture.md).

use std::collections::BTreeMap;

use gpupool_api::device::gpu_capacity;
use gpupool_api::inventory::{to_semver, Gpu, Inventory};
use gpupool_api::names::{attr, device_name, DRIVER_NAME};
use gpupool_api::validation::{
    validate_resource_slice, FieldError, MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS,
};
use k8s_openapi::api::resource::v1::{
    Device, DeviceAttribute, DeviceCapacity, ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::health::HealthMap;

/// Upstream limit of devices per slice when no device has taints, counters or list attributes.
pub const MAX_DEVICES_PER_SLICE: usize = 128;
/// Upstream limit of an object name (DNS subdomain).
const MAX_NAME_LEN: usize = 253;

/// How devices are offered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum SliceMode {
    /// Shareable devices with consumable capacity (needs the DRAConsumableCapacity feature).
    Shared,
    /// Whole-card exclusive devices, for clusters that drop or reject consumable-capacity fields.
    ExclusiveFallback,
}

/// A slice this driver would send and the API server would reject.
#[derive(Debug, thiserror::Error)]
#[error("ResourceSlice {slice} is invalid: {}", errors.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
pub struct SliceError {
    pub slice: String,
    pub errors: Vec<FieldError>,
}

/// Name of slice `n` (0-based) of `node`'s pool: `<node>-gpupool.dev-<n>`, shortened with a hash of
/// the node name when a long node name would push it past 253 characters.
pub fn slice_name(node_name: &str, n: usize) -> String {
    let suffix = format!("-{DRIVER_NAME}-{n}");
    if node_name.len() + suffix.len() <= MAX_NAME_LEN {
        return format!("{node_name}{suffix}");
    }
    use sha2::{Digest, Sha256};
    let hash = hex::encode(&Sha256::digest(node_name.as_bytes())[..4]);
    let keep = MAX_NAME_LEN - suffix.len() - hash.len() - 1;
    let prefix = node_name[..keep].trim_end_matches(['.', '-']);
    format!("{prefix}-{hash}{suffix}")
}

/// Upstream limit of a string attribute value, in bytes.
const MAX_STRING_LEN: usize = 64;

/// A string attribute, cut to the upstream limit (at a character boundary) so that one odd value
/// reported by a device cannot keep the whole pool from being published.
fn string(value: &str) -> DeviceAttribute {
    let mut end = value.len().min(MAX_STRING_LEN);
    while !value.is_char_boundary(end) {
        end -= 1;
    }
    DeviceAttribute {
        string: Some(value[..end].to_string()),
        ..Default::default()
    }
}

fn int(value: i64) -> DeviceAttribute {
    DeviceAttribute {
        int: Some(value),
        ..Default::default()
    }
}

fn version(value: &str) -> Option<DeviceAttribute> {
    to_semver(value).map(|v| DeviceAttribute {
        version: Some(v),
        ..Default::default()
    })
}

/// The attributes of one GPU (docs/architecture.md, "Device model"); `computeWeight` only when a weight is known, versions only
/// when they have a semver form.
pub fn device_attributes(gpu: &Gpu, weight: Option<i64>) -> BTreeMap<String, DeviceAttribute> {
    let mut a = BTreeMap::new();
    a.insert(attr::PRODUCT_NAME.into(), string(&gpu.product_name));
    a.insert(attr::MODEL.into(), string(&gpu.model));
    a.insert(attr::ARCHITECTURE.into(), string(&gpu.architecture));
    a.insert(attr::UUID.into(), string(&gpu.uuid));
    a.insert(attr::INDEX.into(), int(gpu.index.into()));
    a.insert(
        attr::MULTIPROCESSORS.into(),
        int(gpu.multiprocessors.into()),
    );
    a.insert(attr::CUDA_CORES.into(), int(gpu.cuda_cores.into()));
    if let Some(w) = weight {
        a.insert(attr::COMPUTE_WEIGHT.into(), int(w));
    }
    a.insert(attr::BRAND.into(), string(&gpu.brand));
    for (name, value) in [
        (attr::CUDA_COMPUTE_CAPABILITY, &gpu.cuda_compute_capability),
        (attr::DRIVER_VERSION, &gpu.driver_version),
        (attr::CUDA_DRIVER_VERSION, &gpu.cuda_driver_version),
    ] {
        if let Some(v) = version(value) {
            a.insert(name.into(), v);
        }
    }
    a.insert(attr::PCI_BUS_ID.into(), string(&gpu.pci_bus_id));
    if let Some(root) = &gpu.pcie_root {
        a.insert(attr::PCIE_ROOT.into(), string(root));
    }
    if let Some(numa) = gpu.numa_node {
        a.insert(attr::NUMA_NODE.into(), int(numa));
    }
    a
}

/// The capacities of one GPU: `memory` and `cores` (see [`gpupool_api::device::gpu_capacity`]).
pub fn device_capacity(gpu: &Gpu, mode: SliceMode) -> BTreeMap<String, DeviceCapacity> {
    gpu_capacity(gpu.memory_bytes, mode == SliceMode::Shared)
}

pub fn device(gpu: &Gpu, weight: Option<i64>, mode: SliceMode) -> Device {
    Device {
        name: device_name(gpu.index),
        allow_multiple_allocations: (mode == SliceMode::Shared).then_some(true),
        attributes: Some(device_attributes(gpu, weight)),
        capacity: Some(device_capacity(gpu, mode)),
        ..Default::default()
    }
}

/// All slices of `node_name`'s pool at `generation`, validated against the upstream limits.
/// `weights` maps a GPU's `model` to its compute weight; `health` gives the taints of faulty
/// devices. No GPUs -> no slices.
pub fn build_slices(
    inventory: &Inventory,
    node_name: &str,
    weights: &BTreeMap<String, i64>,
    health: &HealthMap,
    generation: i64,
    mode: SliceMode,
) -> Result<Vec<ResourceSlice>, SliceError> {
    // A slice with a tainted device may hold at most 64 devices. The lower limit for the whole
    // pool is simpler than packing around the tainted ones, and differs only on nodes with more
    // than 64 GPUs.
    let per_slice = if inventory
        .gpus
        .iter()
        .any(|g| !health.taints(&device_name(g.index)).is_empty())
    {
        MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS
    } else {
        MAX_DEVICES_PER_SLICE
    };
    let chunks: Vec<&[Gpu]> = inventory.gpus.chunks(per_slice).collect();
    let count = chunks.len() as i64;
    let mut slices = Vec::with_capacity(chunks.len());
    for (n, chunk) in chunks.into_iter().enumerate() {
        let slice = ResourceSlice {
            metadata: ObjectMeta {
                name: Some(slice_name(node_name, n)),
                ..Default::default()
            },
            spec: ResourceSliceSpec {
                driver: DRIVER_NAME.to_string(),
                node_name: Some(node_name.to_string()),
                pool: ResourcePool {
                    name: node_name.to_string(),
                    generation,
                    resource_slice_count: count,
                },
                devices: Some(
                    chunk
                        .iter()
                        .map(|gpu| {
                            let mut d = device(gpu, weights.get(&gpu.model).copied(), mode);
                            let taints = health.taints(&d.name);
                            d.taints = (!taints.is_empty()).then_some(taints);
                            d
                        })
                        .collect(),
                ),
                ..Default::default()
            },
        };
        let errors = validate_resource_slice(&slice);
        if !errors.is_empty() {
            return Err(SliceError {
                slice: slice_name(node_name, n),
                errors,
            });
        }
        slices.push(slice);
    }
    Ok(slices)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::fake::fake_inventory;

    fn attrs(d: &Device) -> &BTreeMap<String, DeviceAttribute> {
        d.attributes.as_ref().unwrap()
    }

    #[test]
    fn one_slice_with_every_attribute_and_both_capacities() {
        let inv = fake_inventory("a100-40gb:2,v100-32gb:1", "node-1").unwrap();
        let weights = BTreeMap::from([("A100-SXM4-40GB".to_string(), 312)]);
        let slices = build_slices(
            &inv,
            "node-1",
            &weights,
            &HealthMap::default(),
            7,
            SliceMode::Shared,
        )
        .unwrap();
        assert_eq!(slices.len(), 1);
        let s = &slices[0];
        assert_eq!(s.metadata.name.as_deref(), Some("node-1-gpupool.dev-0"));
        assert_eq!(s.spec.driver, "gpupool.dev");
        assert_eq!(s.spec.node_name.as_deref(), Some("node-1"));
        assert_eq!(
            (s.spec.pool.name.as_str(), s.spec.pool.generation),
            ("node-1", 7)
        );
        assert_eq!(s.spec.pool.resource_slice_count, 1);
        let devices = s.spec.devices.as_ref().unwrap();
        let names: Vec<_> = devices.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["gpu-0", "gpu-1", "gpu-2"]);

        let a100 = &devices[0];
        assert_eq!(a100.allow_multiple_allocations, Some(true));
        let a = attrs(a100);
        assert_eq!(
            a["productName"].string.as_deref(),
            Some("NVIDIA A100-SXM4-40GB")
        );
        assert_eq!(a["model"].string.as_deref(), Some("A100-SXM4-40GB"));
        assert_eq!(a["architecture"].string.as_deref(), Some("Ampere"));
        assert_eq!(a["uuid"].string.as_deref(), Some(inv.gpus[0].uuid.as_str()));
        assert_eq!(a["index"].int, Some(0));
        assert_eq!(a["multiprocessors"].int, Some(108));
        assert_eq!(a["cudaCores"].int, Some(6912));
        assert_eq!(a["computeWeight"].int, Some(312));
        assert_eq!(a["brand"].string.as_deref(), Some("Nvidia"));
        assert_eq!(a["cudaComputeCapability"].version.as_deref(), Some("8.0.0"));
        assert_eq!(a["driverVersion"].version.as_deref(), Some("550.54.15"));
        assert_eq!(a["cudaDriverVersion"].version.as_deref(), Some("12.4.0"));
        assert!(a["resource.kubernetes.io/pciBusID"].string.is_some());
        assert_eq!(
            a["resource.kubernetes.io/pcieRoot"].string.as_deref(),
            Some("pci0000:00")
        );
        assert_eq!(a["resource.kubernetes.io/numaNode"].int, Some(0));
        assert!(
            !attrs(&devices[2]).contains_key("computeWeight"),
            "no weight known for V100"
        );

        // The capacities' content is the device model's (tested in gpupool-api); the slice
        // carries them for each card's memory, shareable.
        assert_eq!(a100.capacity, Some(gpu_capacity(40 << 30, true)));
        assert_eq!(cap_of(&devices[2], "memory"), "32Gi");
    }

    fn cap_of(d: &Device, name: &str) -> String {
        d.capacity.as_ref().unwrap()[name].value.0.clone()
    }

    #[test]
    fn memory_not_on_a_mebibyte_is_rounded_down_to_the_step() {
        let mut inv = fake_inventory("h100-80gb:1", "n").unwrap();
        assert_eq!(
            cap_of(&device(&inv.gpus[0], None, SliceMode::Shared), "memory"),
            "81559Mi"
        );
        inv.gpus[0].memory_bytes = 81559 * 1024 * 1024 + 512;
        let d = device(&inv.gpus[0], None, SliceMode::Shared);
        assert_eq!(cap_of(&d, "memory"), "81559Mi");
    }

    #[test]
    fn more_than_128_gpus_split_into_slices_of_one_generation() {
        let inv = fake_inventory("t4:130", "big").unwrap();
        let slices = build_slices(
            &inv,
            "big",
            &BTreeMap::new(),
            &HealthMap::default(),
            3,
            SliceMode::Shared,
        )
        .unwrap();
        assert_eq!(slices.len(), 2);
        let sizes: Vec<_> = slices
            .iter()
            .map(|s| s.spec.devices.as_ref().unwrap().len())
            .collect();
        assert_eq!(sizes, [128, 2]);
        for (n, s) in slices.iter().enumerate() {
            assert_eq!(s.spec.pool.resource_slice_count, 2);
            assert_eq!(s.spec.pool.generation, 3);
            assert_eq!(s.spec.pool.name, "big");
            assert_eq!(
                s.metadata.name.clone().unwrap(),
                format!("big-gpupool.dev-{n}")
            );
        }
        assert_eq!(slices[1].spec.devices.as_ref().unwrap()[0].name, "gpu-128");
    }

    fn taint_xid(health: &mut HealthMap, device: &str, xid: u32) {
        use crate::health::{Observation, XidPolicy};
        let observation = Observation::Xid {
            device: device.into(),
            xid,
        };
        health
            .apply(observation, &XidPolicy::default(), 1_700_000_000)
            .unwrap();
    }

    fn all_devices(inv: &Inventory) -> HealthMap {
        HealthMap::new(inv.gpus.iter().map(|g| device_name(g.index)))
    }

    #[test]
    fn a_tainted_device_carries_its_taint_and_the_others_none() {
        let inv = fake_inventory("a100-40gb:2", "n").unwrap();
        let mut health = all_devices(&inv);
        taint_xid(&mut health, "gpu-0", 79);
        let slices =
            build_slices(&inv, "n", &BTreeMap::new(), &health, 1, SliceMode::Shared).unwrap();
        let devices = slices[0].spec.devices.as_ref().unwrap();
        let taints = devices[0].taints.as_ref().unwrap();
        assert_eq!(taints.len(), 1);
        assert_eq!(
            (
                taints[0].key.as_str(),
                taints[0].value.as_deref(),
                taints[0].effect.as_str()
            ),
            ("gpupool.dev/xid", Some("79"), "NoSchedule")
        );
        assert!(taints[0].time_added.is_some());
        assert_eq!(devices[1].taints, None);
        let json = serde_json::to_value(&devices[1]).unwrap();
        assert!(json.get("taints").is_none(), "{json}");
    }

    #[test]
    fn with_a_taint_a_big_pool_splits_into_slices_of_64() {
        let inv = fake_inventory("t4:130", "big").unwrap();
        let mut health = all_devices(&inv);
        taint_xid(&mut health, "gpu-100", 48);
        let slices =
            build_slices(&inv, "big", &BTreeMap::new(), &health, 2, SliceMode::Shared).unwrap();
        let sizes: Vec<_> = slices
            .iter()
            .map(|s| s.spec.devices.as_ref().unwrap().len())
            .collect();
        assert_eq!(sizes, [64, 64, 2]);
        assert!(slices.iter().all(|s| s.spec.pool.resource_slice_count == 3));
        let tainted: Vec<_> = slices
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .filter(|d| d.taints.is_some())
            .map(|d| d.name.as_str())
            .collect();
        assert_eq!(tainted, ["gpu-100"]);
    }

    #[test]
    fn exclusive_fallback_has_plain_capacities_and_no_sharing() {
        let inv = fake_inventory("a100-40gb:1", "n").unwrap();
        let slices = build_slices(
            &inv,
            "n",
            &BTreeMap::new(),
            &HealthMap::default(),
            1,
            SliceMode::ExclusiveFallback,
        )
        .unwrap();
        let d = &slices[0].spec.devices.as_ref().unwrap()[0];
        assert_eq!(d.allow_multiple_allocations, None);
        let cap = d.capacity.as_ref().unwrap();
        assert!(cap.values().all(|c| c.request_policy.is_none()));
        assert_eq!(cap["memory"].value.0, "40Gi");
        let json = serde_json::to_value(&slices[0]).unwrap().to_string();
        assert!(!json.contains("allowMultipleAllocations"), "{json}");
        assert!(!json.contains("requestPolicy"), "{json}");
    }

    #[test]
    fn no_gpus_no_slices() {
        let inv = Inventory {
            source: gpupool_api::inventory::InventorySource::Fake,
            gpus: vec![],
        };
        assert!(build_slices(
            &inv,
            "n",
            &BTreeMap::new(),
            &HealthMap::default(),
            1,
            SliceMode::Shared
        )
        .unwrap()
        .is_empty());
    }

    #[test]
    fn every_profile_builds_a_valid_slice_within_the_attribute_limit() {
        for p in crate::inventory::fake::PROFILES {
            let inv = fake_inventory(&format!("{}:1", p.key), "node").unwrap();
            let slices = build_slices(
                &inv,
                "node",
                &BTreeMap::new(),
                &HealthMap::default(),
                1,
                SliceMode::Shared,
            )
            .unwrap_or_else(|e| panic!("{}: {e}", p.key));
            let d = &slices[0].spec.devices.as_ref().unwrap()[0];
            let n = attrs(d).len() + d.capacity.as_ref().unwrap().len();
            assert!(n <= 32, "{}: {n} attributes+capacities", p.key);
            assert!(attrs(d)
                .values()
                .all(|v| v.string.as_ref().is_none_or(|s| s.len() <= 64)));
        }
    }

    #[test]
    fn a_slice_the_api_would_reject_is_an_error_naming_the_field() {
        let inv = fake_inventory("t4:1", "Node_A").unwrap();
        let err = build_slices(
            &inv,
            "Node_A",
            &BTreeMap::new(),
            &HealthMap::default(),
            1,
            SliceMode::Shared,
        )
        .unwrap_err();
        assert_eq!(err.slice, "Node_A-gpupool.dev-0");
        let text = err.to_string();
        assert!(text.contains("spec.pool.name"), "{text}");
    }

    #[test]
    fn overlong_strings_are_cut_to_the_upstream_limit() {
        let mut inv = fake_inventory("t4:1", "n").unwrap();
        inv.gpus[0].product_name = format!("NVIDIA {}", "Ü".repeat(40));
        let slices = build_slices(
            &inv,
            "n",
            &BTreeMap::new(),
            &HealthMap::default(),
            1,
            SliceMode::Shared,
        )
        .unwrap();
        let d = &slices[0].spec.devices.as_ref().unwrap()[0];
        let name = attrs(d)["productName"].string.clone().unwrap();
        assert!(name.len() <= 64 && name.starts_with("NVIDIA ÜÜ"), "{name}");
    }

    #[test]
    fn slice_names_stay_dns_safe_for_long_nodes() {
        let long = "n".repeat(250);
        let name = slice_name(&long, 1);
        assert!(name.len() <= 253, "{}", name.len());
        assert!(name.ends_with("-gpupool.dev-1"));
        assert_ne!(
            slice_name(&long, 1),
            slice_name(&format!("{}m", &long[..249]), 1)
        );
    }
}

//! Inventory -> the ResourceSlices of this node's pool (pure; the publisher sends them).
//!
//! One pool per node, named after the node. Its devices and counter sets come from
//! [`crate::devices`]: `gpu-<index>` per GPU with the attributes and the two consumable
//! capacities of the device model, and on cards with MIG one device per profile and placement
//! plus the card's counter set (docs/architecture.md, "Device model"). Counter sets go in slices
//! of their own (the API takes counter sets or devices in a slice, never both), then the devices,
//! each kind split within upstream's limits ([`split`]).

use std::collections::BTreeMap;

use gpupool_api::device::gpu_capacity;
use gpupool_api::inventory::{to_semver, Gpu, Inventory, MigProfile};
use gpupool_api::names::{attr, device_name, DEVICE_TYPE_GPU, DEVICE_TYPE_MIG, DRIVER_NAME};
use gpupool_api::quantity::format_bytes;
use gpupool_api::validation::{
    validate_resource_slice, FieldError, MAX_COUNTER_SETS_PER_SLICE,
    MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS,
};
use k8s_openapi::api::resource::v1::{
    CounterSet, Device, DeviceAttribute, DeviceCapacity, ResourcePool, ResourceSlice,
    ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::devices::{self, DeviceKind, NodeDevice, Partitioning};
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

/// Attributes every device of a card carries: what the card is and where it sits.
fn card_attributes(gpu: &Gpu, a: &mut BTreeMap<String, DeviceAttribute>) {
    a.insert(attr::PRODUCT_NAME.into(), string(&gpu.product_name));
    a.insert(attr::MODEL.into(), string(&gpu.model));
    a.insert(attr::ARCHITECTURE.into(), string(&gpu.architecture));
    a.insert(attr::INDEX.into(), int(gpu.index.into()));
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
}

/// The attributes of one GPU (docs/architecture.md, "Device model"); `computeWeight` only when a weight is known, versions only
/// when they have a semver form, `nvlinkDomain` only for a card joined to others by NVLink.
pub fn device_attributes(gpu: &Gpu, weight: Option<i64>) -> BTreeMap<String, DeviceAttribute> {
    let mut a = BTreeMap::new();
    card_attributes(gpu, &mut a);
    a.insert(attr::TYPE.into(), string(DEVICE_TYPE_GPU));
    a.insert(attr::UUID.into(), string(&gpu.uuid));
    a.insert(
        attr::MULTIPROCESSORS.into(),
        int(gpu.multiprocessors.into()),
    );
    a.insert(attr::CUDA_CORES.into(), int(gpu.cuda_cores.into()));
    if let Some(w) = weight {
        a.insert(attr::COMPUTE_WEIGHT.into(), int(w));
    }
    if let Some(domain) = &gpu.nvlink_domain {
        a.insert(attr::NVLINK_DOMAIN.into(), string(domain));
    }
    a
}

/// The attributes of a MIG device: its card's, what the partition is (profile, placement, SMs,
/// CUDA cores) and the card's weight scaled by its share of the SMs. No `uuid` (the MIG device
/// gets one only when prepare creates it) and no `nvlinkDomain` (MIG devices have no NVLink
/// peer-to-peer).
pub fn mig_attributes(
    gpu: &Gpu,
    profile: &MigProfile,
    start: u32,
    weight: Option<i64>,
) -> BTreeMap<String, DeviceAttribute> {
    let mut a = BTreeMap::new();
    card_attributes(gpu, &mut a);
    a.insert(attr::TYPE.into(), string(DEVICE_TYPE_MIG));
    a.insert(attr::PARENT_UUID.into(), string(&gpu.uuid));
    a.insert(attr::MIG_PROFILE.into(), string(&profile.name));
    a.insert(attr::MIG_PROFILE_ID.into(), int(profile.id.into()));
    a.insert(attr::MIG_PLACEMENT_START.into(), int(start.into()));
    a.insert(
        attr::MIG_MEMORY_SLICES.into(),
        int(profile.memory_slices.into()),
    );
    a.insert(
        attr::MULTIPROCESSORS.into(),
        int(profile.multiprocessors.into()),
    );
    if let Some(per_sm) = gpu.cuda_cores.checked_div(gpu.multiprocessors) {
        a.insert(
            attr::CUDA_CORES.into(),
            int((per_sm * profile.multiprocessors).into()),
        );
    }
    if let Some(w) =
        weight.and_then(|w| devices::mig_weight(w, gpu.multiprocessors, profile.multiprocessors))
    {
        a.insert(attr::COMPUTE_WEIGHT.into(), int(w));
    }
    a
}

/// The capacities of one GPU: `memory` and `cores` (see [`gpupool_api::device::gpu_capacity`]).
pub fn device_capacity(gpu: &Gpu, mode: SliceMode) -> BTreeMap<String, DeviceCapacity> {
    gpu_capacity(gpu.memory_bytes, mode == SliceMode::Shared)
}

/// `gpu-<index>`: a whole card, shareable in fractions when the cluster has consumable capacity.
pub fn device(gpu: &Gpu, weight: Option<i64>, mode: SliceMode) -> Device {
    Device {
        name: device_name(gpu.index),
        allow_multiple_allocations: (mode == SliceMode::Shared).then_some(true),
        attributes: Some(device_attributes(gpu, weight)),
        capacity: Some(device_capacity(gpu, mode)),
        ..Default::default()
    }
}

/// The published form of one device of the node, with its counter consumption and the taints
/// of its card.
fn published(
    d: &NodeDevice<'_>,
    weights: &BTreeMap<String, i64>,
    health: &HealthMap,
    mode: SliceMode,
    partitioning: Partitioning,
) -> Device {
    let weight = weights.get(&d.gpu.model).copied();
    let mut device = match d.kind {
        DeviceKind::Card => device(d.gpu, weight, mode),
        DeviceKind::Mig { profile, start } => Device {
            name: d.name.clone(),
            attributes: Some(mig_attributes(d.gpu, profile, start, weight)),
            // Not shareable: a plain value, for selectors and for what `kubectl` shows.
            capacity: Some(BTreeMap::from([(
                gpupool_api::names::capacity::MEMORY.to_string(),
                DeviceCapacity {
                    value: Quantity(format_bytes(profile.memory_bytes)),
                    request_policy: None,
                },
            )])),
            ..Default::default()
        },
    };
    device.consumes_counters = devices::consumption(d, partitioning).map(|c| vec![c]);
    // A MIG device is on its card: the card's fault is its fault.
    let taints = health.taints(&device_name(d.gpu.index));
    device.taints = (!taints.is_empty()).then_some(taints);
    device
}

/// What one slice of the pool carries.
#[derive(Debug, Clone, PartialEq)]
pub enum SliceContent {
    Counters(Vec<CounterSet>),
    Devices(Vec<Device>),
}

/// Counter sets and devices over as few slices as upstream's limits allow: counter sets 8 to a
/// slice, first; devices 128 to a slice, or 64 when any device of the pool has taints or
/// consumes counters (the lower limit for the whole pool is simpler than packing around those
/// devices, and differs only on nodes with more than 64 devices).
pub fn split(counter_sets: Vec<CounterSet>, devices: Vec<Device>) -> Vec<SliceContent> {
    let restricted = devices.iter().any(|d| {
        d.taints.as_ref().is_some_and(|t| !t.is_empty())
            || d.consumes_counters.as_ref().is_some_and(|c| !c.is_empty())
    });
    let per_slice = if restricted {
        MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS
    } else {
        MAX_DEVICES_PER_SLICE
    };
    let mut slices: Vec<SliceContent> = counter_sets
        .chunks(MAX_COUNTER_SETS_PER_SLICE)
        .map(|c| SliceContent::Counters(c.to_vec()))
        .collect();
    slices.extend(
        devices
            .chunks(per_slice)
            .map(|d| SliceContent::Devices(d.to_vec())),
    );
    slices
}

/// All slices of `node_name`'s pool at `generation`, validated against the upstream limits.
/// `weights` maps a GPU's `model` to its compute weight; `health` gives the taints of faulty
/// devices; `partitioning` whether MIG devices and counter sets are offered. No GPUs -> no slices.
pub fn build_slices(
    inventory: &Inventory,
    node_name: &str,
    weights: &BTreeMap<String, i64>,
    health: &HealthMap,
    generation: i64,
    mode: SliceMode,
    partitioning: Partitioning,
) -> Result<Vec<ResourceSlice>, SliceError> {
    let counter_sets: Vec<CounterSet> = inventory
        .gpus
        .iter()
        .filter_map(|g| devices::counter_set(g, partitioning))
        .collect();
    let devices: Vec<Device> = devices::node_devices(inventory, partitioning)
        .iter()
        .map(|d| published(d, weights, health, mode, partitioning))
        .collect();
    let contents = split(counter_sets, devices);
    let count = contents.len() as i64;
    let mut slices = Vec::with_capacity(contents.len());
    for (n, content) in contents.into_iter().enumerate() {
        let (shared_counters, devices) = match content {
            SliceContent::Counters(sets) => (Some(sets), None),
            SliceContent::Devices(devices) => (None, Some(devices)),
        };
        let slice = ResourceSlice {
            metadata: ObjectMeta {
                name: Some(slice_name(node_name, n)),
                ..Default::default()
            },
            spec: ResourceSliceSpec {
                driver: DRIVER_NAME.to_string(),
                // Counter-only slices too: they belong to this node's pool.
                node_name: Some(node_name.to_string()),
                pool: ResourcePool {
                    name: node_name.to_string(),
                    generation,
                    resource_slice_count: count,
                },
                shared_counters,
                devices,
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
            Partitioning::Counters,
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
            Partitioning::Counters,
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
        let slices = build_slices(
            &inv,
            "n",
            &BTreeMap::new(),
            &health,
            1,
            SliceMode::Shared,
            Partitioning::Counters,
        )
        .unwrap();
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
        let slices = build_slices(
            &inv,
            "big",
            &BTreeMap::new(),
            &health,
            2,
            SliceMode::Shared,
            Partitioning::Counters,
        )
        .unwrap();
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
            Partitioning::Counters,
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
            SliceMode::Shared,
            Partitioning::Counters
        )
        .unwrap()
        .is_empty());
    }

    #[test]
    fn every_profile_builds_a_valid_slice_within_the_attribute_limit() {
        let mig_on = crate::inventory::fake::PROFILES
            .iter()
            .filter(|p| p.mig.is_some())
            .map(|p| format!("{}:1+mig", p.key));
        let plain = crate::inventory::fake::PROFILES
            .iter()
            .map(|p| format!("{}:1", p.key));
        for spec in plain.chain(mig_on) {
            let inv = fake_inventory(&spec, "node").unwrap();
            let weights = BTreeMap::from([(inv.gpus[0].model.clone(), 989)]);
            let slices = build_slices(
                &inv,
                "node",
                &weights,
                &HealthMap::default(),
                1,
                SliceMode::Shared,
                Partitioning::Counters,
            )
            .unwrap_or_else(|e| panic!("{spec}: {e}"));
            for d in devices_of_slices(&slices) {
                let n = attrs(d).len() + d.capacity.as_ref().unwrap().len();
                assert!(n <= 32, "{spec} {}: {n} attributes+capacities", d.name);
                assert!(attrs(d)
                    .values()
                    .all(|v| v.string.as_ref().is_none_or(|s| s.len() <= 64)));
            }
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
            Partitioning::Counters,
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
            Partitioning::Counters,
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

    fn devices_of_slices(slices: &[ResourceSlice]) -> Vec<&Device> {
        slices
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .collect()
    }

    #[test]
    fn an_nvswitch_board_of_h100s_splits_counters_and_devices_within_the_limits() {
        let inv = fake_inventory("h100-80gb:8+nvswitch", "hgx").unwrap();
        let weights = BTreeMap::from([("H100-80GB-HBM3".to_string(), 989)]);
        let slices = build_slices(
            &inv,
            "hgx",
            &weights,
            &HealthMap::default(),
            2,
            SliceMode::Shared,
            Partitioning::Counters,
        )
        .unwrap();
        // 8 counter sets in one slice, then 8 x 26 devices in slices of 64.
        let shape: Vec<(usize, usize)> = slices
            .iter()
            .map(|s| {
                (
                    s.spec.shared_counters.as_ref().map_or(0, Vec::len),
                    s.spec.devices.as_ref().map_or(0, Vec::len),
                )
            })
            .collect();
        assert_eq!(shape, [(8, 0), (0, 64), (0, 64), (0, 64), (0, 16)]);
        for s in &slices {
            assert_eq!(s.spec.pool.resource_slice_count, 5);
            assert_eq!(s.spec.node_name.as_deref(), Some("hgx"));
            assert!(s.spec.shared_counters.is_none() || s.spec.devices.is_none());
        }
        let devices = devices_of_slices(&slices);
        let gpu0 = devices.iter().find(|d| d.name == "gpu-0").unwrap();
        let a = attrs(gpu0);
        assert_eq!(a["type"].string.as_deref(), Some("gpu"));
        let domain = a["nvlinkDomain"].string.clone().unwrap();
        assert!(devices
            .iter()
            .filter(|d| attrs(d)["type"].string.as_deref() == Some("gpu"))
            .all(|d| attrs(d)["nvlinkDomain"].string.as_deref() == Some(domain.as_str())));
        assert_eq!(
            gpu0.consumes_counters.as_ref().unwrap()[0].counter_set,
            "gpu-0-counters"
        );
        let mig = devices
            .iter()
            .find(|d| d.name == "gpu-3-mig-1g-10gb-2")
            .unwrap();
        let m = attrs(mig);
        assert_eq!(m["type"].string.as_deref(), Some("mig"));
        assert_eq!(m["migProfile"].string.as_deref(), Some("1g.10gb"));
        assert_eq!(m["migProfileId"].int, Some(19));
        assert_eq!(m["migPlacementStart"].int, Some(2));
        assert_eq!(
            m["parentUUID"].string.as_deref(),
            Some(inv.gpus[3].uuid.as_str())
        );
        assert_eq!(m["multiprocessors"].int, Some(16));
        assert_eq!(m["cudaCores"].int, Some(16 * 128));
        assert_eq!(m["computeWeight"].int, Some(119), "989 x 16 / 132");
        assert_eq!(m["model"].string.as_deref(), Some("H100-80GB-HBM3"));
        assert!(!m.contains_key("uuid") && !m.contains_key("nvlinkDomain"));
        assert_eq!(
            mig.allow_multiple_allocations, None,
            "a MIG device is exclusive"
        );
        assert_eq!(cap_of(mig, "memory"), "10194Mi");
        assert_eq!(
            mig.consumes_counters.as_ref().unwrap()[0].counter_set,
            "gpu-3-counters"
        );
    }

    #[test]
    fn nine_mig_cards_need_two_counter_slices() {
        let inv = fake_inventory("h200:9", "big").unwrap();
        let slices = build_slices(
            &inv,
            "big",
            &BTreeMap::new(),
            &HealthMap::default(),
            1,
            SliceMode::Shared,
            Partitioning::Counters,
        )
        .unwrap();
        let sets: Vec<usize> = slices
            .iter()
            .filter_map(|s| s.spec.shared_counters.as_ref().map(Vec::len))
            .collect();
        assert_eq!(sets, [8, 1]);
        assert_eq!(devices_of_slices(&slices).len(), 9 * 26);
    }

    #[test]
    fn without_partitionable_devices_the_model_is_todays() {
        let inv = fake_inventory("h100-80gb:2,a100-40gb:1+mig", "n").unwrap();
        let slices = build_slices(
            &inv,
            "n",
            &BTreeMap::new(),
            &HealthMap::default(),
            1,
            SliceMode::Shared,
            Partitioning::WholeCardsOnly,
        )
        .unwrap();
        assert_eq!(slices.len(), 1);
        assert!(slices[0].spec.shared_counters.is_none());
        let names: Vec<&str> = devices_of_slices(&slices)
            .iter()
            .map(|d| d.name.as_str())
            .collect();
        assert_eq!(
            names,
            ["gpu-0", "gpu-1"],
            "the A100 in MIG mode cannot run whole"
        );
        assert!(devices_of_slices(&slices)
            .iter()
            .all(|d| d.consumes_counters.is_none()));
    }

    #[test]
    fn a_tainted_card_taints_its_mig_devices_too() {
        let inv = fake_inventory("h100-80gb:2", "n").unwrap();
        let mut health = all_devices(&inv);
        taint_xid(&mut health, "gpu-1", 79);
        let slices = build_slices(
            &inv,
            "n",
            &BTreeMap::new(),
            &health,
            1,
            SliceMode::Shared,
            Partitioning::Counters,
        )
        .unwrap();
        for d in devices_of_slices(&slices) {
            let tainted = d.taints.is_some();
            assert_eq!(tainted, d.name.starts_with("gpu-1"), "{}", d.name);
        }
    }

    #[test]
    fn split_puts_counter_sets_first_and_respects_both_limits() {
        let set = |i: u32| CounterSet {
            name: format!("s{i}"),
            counters: BTreeMap::new(),
        };
        let plain = |i: u32| Device {
            name: format!("d{i}"),
            ..Default::default()
        };
        let shape = |contents: &[SliceContent]| -> Vec<String> {
            contents
                .iter()
                .map(|c| match c {
                    SliceContent::Counters(s) => format!("c{}", s.len()),
                    SliceContent::Devices(d) => format!("d{}", d.len()),
                })
                .collect()
        };
        assert_eq!(
            shape(&split(
                (0..17).map(set).collect(),
                (0..130).map(plain).collect()
            )),
            ["c8", "c8", "c1", "d128", "d2"]
        );
        let mut counted: Vec<Device> = (0..65).map(plain).collect();
        counted[64].consumes_counters = Some(vec![Default::default()]);
        assert_eq!(shape(&split(vec![], counted)), ["d64", "d1"]);
        assert!(split(vec![], vec![]).is_empty());
    }
}

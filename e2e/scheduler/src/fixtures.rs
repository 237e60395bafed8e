//! Test objects shaped like gpupool publishes them (docs/architecture.md, "Device model"), built here so
//! the scheduler does not depend on the driver's slice builder.

use std::collections::BTreeMap;

use gpupool_api::names::DRIVER_NAME;
use k8s_openapi::api::resource::v1::{
    AllocationResult, CELDeviceSelector, CapacityRequestPolicy, CapacityRequirements, Counter,
    CounterSet, Device, DeviceAttribute, DeviceCapacity, DeviceClaim, DeviceClaimConfiguration,
    DeviceClass, DeviceClassConfiguration, DeviceClassSpec, DeviceCounterConsumption,
    DeviceRequest, DeviceRequestAllocationResult, DeviceSelector, DeviceSubRequest,
    ExactDeviceRequest, OpaqueDeviceConfiguration, ResourceClaim, ResourceClaimStatus,
    ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::runtime::RawExtension;

pub fn q(s: &str) -> Quantity {
    Quantity(s.to_string())
}

fn string_attr(s: &str) -> DeviceAttribute {
    DeviceAttribute {
        string: Some(s.to_string()),
        ..Default::default()
    }
}

pub fn int_attr(i: i64) -> DeviceAttribute {
    DeviceAttribute {
        int: Some(i),
        ..Default::default()
    }
}

fn version_attr(v: &str) -> DeviceAttribute {
    DeviceAttribute {
        version: Some(v.to_string()),
        ..Default::default()
    }
}

/// One GPU as gpupool publishes it: shared, memory + cores consumable.
pub fn gpu(index: u32, model: &str, memory: &str) -> Device {
    let mut attributes = BTreeMap::new();
    attributes.insert("model".to_string(), string_attr(model));
    attributes.insert(
        "productName".to_string(),
        string_attr(&format!("NVIDIA {model}")),
    );
    attributes.insert("index".to_string(), int_attr(index.into()));
    attributes.insert("driverVersion".to_string(), version_attr("550.54.15"));
    attributes.insert(
        "resource.kubernetes.io/pcieRoot".to_string(),
        string_attr(&format!("pci0000:{:02x}", index / 2)),
    );
    let bytes = gpupool_api::quantity::parse(memory)
        .expect("fixture memory is a quantity")
        .ceil_units();
    let capacity = gpupool_api::device::gpu_capacity(bytes as u64, true);
    Device {
        name: format!("gpu-{index}"),
        attributes: Some(attributes),
        capacity: Some(capacity),
        allow_multiple_allocations: Some(true),
        ..Default::default()
    }
}

/// A capacity of `value` whose requests take the smallest of `values` at or above them.
pub fn with_valid_values(value: &str, default: &str, values: &[&str]) -> DeviceCapacity {
    DeviceCapacity {
        value: q(value),
        request_policy: Some(CapacityRequestPolicy {
            default: Some(q(default)),
            valid_range: None,
            valid_values: Some(values.iter().map(|v| q(v)).collect()),
        }),
    }
}

/// A card with MIG, as gpupool publishes one on a node with partitionable devices: its counter
/// set (8 memory slices, 132 SMs), `gpu-<index>` shareable and consuming all of it, and seven
/// 1g MIG devices `gpu-<index>-mig-1g-10gb-<k>`, each consuming memory slice k and 16 SMs.
pub fn mig_card(index: u32) -> (CounterSet, Vec<Device>) {
    let set_name = format!("gpu-{index}-counters");
    let counter = |v: &str| Counter { value: q(v) };
    let mut all: BTreeMap<String, Counter> = (0..8)
        .map(|k| (format!("memory-slice-{k}"), counter("1")))
        .collect();
    all.insert("multiprocessors".into(), counter("132"));
    let consume = |counters: BTreeMap<String, Counter>| {
        Some(vec![DeviceCounterConsumption {
            counter_set: set_name.clone(),
            counters,
        }])
    };
    let mut card = gpu(index, "H100-80GB-HBM3", "80Gi");
    card.attributes
        .get_or_insert_with(Default::default)
        .insert("type".into(), string_attr("gpu"));
    card.consumes_counters = consume(all.clone());
    let mut devices = vec![card];
    for k in 0..7u32 {
        let mut attributes = BTreeMap::new();
        attributes.insert("type".to_string(), string_attr("mig"));
        attributes.insert("model".to_string(), string_attr("H100-80GB-HBM3"));
        attributes.insert("migProfile".to_string(), string_attr("1g.10gb"));
        attributes.insert("index".to_string(), int_attr(index.into()));
        devices.push(Device {
            name: format!("gpu-{index}-mig-1g-10gb-{k}"),
            attributes: Some(attributes),
            consumes_counters: consume(BTreeMap::from([
                (format!("memory-slice-{k}"), counter("1")),
                ("multiprocessors".to_string(), counter("16")),
            ])),
            ..Default::default()
        });
    }
    (
        CounterSet {
            name: set_name.clone(),
            counters: all,
        },
        devices,
    )
}

/// Node `node`'s pool of MIG cards: one counter slice, one device slice (pool generation 1).
pub fn mig_node_slices(node: &str, cards: u32) -> Vec<ResourceSlice> {
    let (sets, devices): (Vec<CounterSet>, Vec<Vec<Device>>) = (0..cards).map(mig_card).unzip();
    let mut counters = slice_of(DRIVER_NAME, node, node, 1, 2, Vec::new());
    counters.metadata.name = Some(format!("{node}-counters"));
    counters.spec.devices = None;
    counters.spec.shared_counters = Some(sets);
    let mut devices = slice_of(DRIVER_NAME, node, node, 1, 2, devices.concat());
    devices.metadata.name = Some(format!("{node}-devices"));
    vec![counters, devices]
}

/// Classes for [`mig_card`] pools: its cards (`h100.gpupool.dev`) and their 1g MIG devices
/// (`h100-mig-1g.gpupool.dev`).
pub fn mig_classes() -> Vec<DeviceClass> {
    let guard = r#"device.driver == "gpupool.dev""#;
    let of_type = |t: &str| format!(r#"{guard} && device.attributes["gpupool.dev"].type == "{t}""#);
    vec![
        class(H100, &[&of_type("gpu")]),
        class(H100_MIG_1G, &[&of_type("mig")]),
    ]
}

pub const H100: &str = "h100.gpupool.dev";
pub const H100_MIG_1G: &str = "h100-mig-1g.gpupool.dev";

/// A device that can only be allocated whole.
pub fn exclusive(mut device: Device) -> Device {
    device.allow_multiple_allocations = None;
    device
}

/// The single slice of a node's pool (pool name = node name, generation 1).
pub fn node_slice(node: &str, devices: Vec<Device>) -> ResourceSlice {
    slice_of(DRIVER_NAME, node, node, 1, 1, devices)
}

pub fn slice_of(
    driver: &str,
    node: &str,
    pool: &str,
    generation: i64,
    count: i64,
    devices: Vec<Device>,
) -> ResourceSlice {
    ResourceSlice {
        metadata: ObjectMeta {
            name: Some(format!("{node}-{driver}-{generation}")),
            ..Default::default()
        },
        spec: ResourceSliceSpec {
            driver: driver.to_string(),
            node_name: Some(node.to_string()),
            pool: ResourcePool {
                name: pool.to_string(),
                generation,
                resource_slice_count: count,
            },
            devices: Some(devices),
            ..Default::default()
        },
    }
}

/// The seeds' pool: node-a 2 x A100-SXM4-40GB, node-b 2 x V100-SXM2-32GB, node-c 1 x RTX 3090.
pub fn seed_slices() -> Vec<ResourceSlice> {
    vec![
        node_slice(
            "node-a",
            vec![
                gpu(0, "A100-SXM4-40GB", "40Gi"),
                gpu(1, "A100-SXM4-40GB", "40Gi"),
            ],
        ),
        node_slice(
            "node-b",
            vec![
                gpu(0, "V100-SXM2-32GB", "32Gi"),
                gpu(1, "V100-SXM2-32GB", "32Gi"),
            ],
        ),
        node_slice("node-c", vec![gpu(0, "RTX-3090", "24Gi")]),
    ]
}

pub fn class(name: &str, selectors: &[&str]) -> DeviceClass {
    DeviceClass {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            ..Default::default()
        },
        spec: DeviceClassSpec {
            selectors: Some(selectors.iter().map(|s| selector(s)).collect()),
            ..Default::default()
        },
    }
}

pub fn with_class_config(mut class: DeviceClass, parameters: serde_json::Value) -> DeviceClass {
    class
        .spec
        .config
        .get_or_insert_with(Vec::new)
        .push(DeviceClassConfiguration {
            opaque: Some(opaque(parameters)),
        });
    class
}

pub fn opaque(parameters: serde_json::Value) -> OpaqueDeviceConfiguration {
    OpaqueDeviceConfiguration {
        driver: DRIVER_NAME.to_string(),
        parameters: RawExtension(parameters),
    }
}

pub fn selector(expression: &str) -> DeviceSelector {
    DeviceSelector {
        cel: Some(CELDeviceSelector {
            expression: expression.to_string(),
        }),
    }
}

/// The classes the controller manages: all gpupool GPUs, and one per model.
pub fn seed_classes() -> Vec<DeviceClass> {
    let guard = r#"device.driver == "gpupool.dev""#;
    let model = |m: &str| format!(r#"{guard} && device.attributes["gpupool.dev"].model == "{m}""#);
    vec![
        class("gpupool.dev", &[guard]),
        class("a100-sxm4-40gb.gpupool.dev", &[&model("A100-SXM4-40GB")]),
        class("v100-sxm2-32gb.gpupool.dev", &[&model("V100-SXM2-32GB")]),
        class("rtx-3090.gpupool.dev", &[&model("RTX-3090")]),
    ]
}

pub const A100: &str = "a100-sxm4-40gb.gpupool.dev";
pub const V100: &str = "v100-sxm2-32gb.gpupool.dev";

fn capacity(requests: &[(&str, &str)]) -> Option<CapacityRequirements> {
    (!requests.is_empty()).then(|| CapacityRequirements {
        requests: Some(
            requests
                .iter()
                .map(|(k, v)| (k.to_string(), q(v)))
                .collect(),
        ),
    })
}

/// An `exactly` request for one device of `class` with capacity requests.
pub fn exact(name: &str, class: &str, requests: &[(&str, &str)]) -> DeviceRequest {
    DeviceRequest {
        name: name.to_string(),
        exactly: Some(ExactDeviceRequest {
            device_class_name: class.to_string(),
            allocation_mode: Some("ExactCount".into()),
            count: Some(1),
            capacity: capacity(requests),
            ..Default::default()
        }),
        first_available: None,
    }
}

pub fn subrequest(name: &str, class: &str, requests: &[(&str, &str)]) -> DeviceSubRequest {
    DeviceSubRequest {
        name: name.to_string(),
        device_class_name: class.to_string(),
        allocation_mode: Some("ExactCount".into()),
        count: Some(1),
        capacity: capacity(requests),
        ..Default::default()
    }
}

pub fn first_available(name: &str, subrequests: Vec<DeviceSubRequest>) -> DeviceRequest {
    DeviceRequest {
        name: name.to_string(),
        exactly: None,
        first_available: Some(subrequests),
    }
}

pub fn claim(name: &str, requests: Vec<DeviceRequest>) -> ResourceClaim {
    crate::claims::claim_for_requests(
        ObjectMeta {
            name: Some(name.to_string()),
            namespace: Some("default".to_string()),
            uid: Some(format!("uid-{name}")),
            ..Default::default()
        },
        requests,
    )
}

/// The devices part of a claim's spec, to change.
pub fn devices_mut(claim: &mut ResourceClaim) -> &mut DeviceClaim {
    claim.spec.devices.get_or_insert_with(Default::default)
}

/// The first request of a claim, an `exactly` one, to change.
pub fn first_exact_mut(claim: &mut ResourceClaim) -> &mut ExactDeviceRequest {
    let requests = devices_mut(claim).requests.as_mut().expect("requests");
    requests[0].exactly.as_mut().expect("an exactly request")
}

/// The results of an allocation.
pub fn results(allocation: &AllocationResult) -> &[DeviceRequestAllocationResult] {
    allocation
        .devices
        .as_ref()
        .and_then(|d| d.results.as_deref())
        .unwrap_or_default()
}

pub fn with_claim_config(
    mut claim: ResourceClaim,
    requests: &[&str],
    parameters: serde_json::Value,
) -> ResourceClaim {
    devices_mut(&mut claim)
        .config
        .get_or_insert_with(Vec::new)
        .push(DeviceClaimConfiguration {
            requests: (!requests.is_empty())
                .then(|| requests.iter().map(|r| r.to_string()).collect()),
            opaque: Some(opaque(parameters)),
        });
    claim
}

pub fn allocated(mut claim: ResourceClaim, allocation: AllocationResult) -> ResourceClaim {
    claim.status = Some(ResourceClaimStatus {
        allocation: Some(allocation),
        ..Default::default()
    });
    claim
}

/// Each result as `request pool/device memory cores` (capacity omitted when not consumed).
pub fn summary(allocation: &AllocationResult) -> Vec<String> {
    allocation
        .devices
        .iter()
        .flat_map(|d| d.results.iter().flatten())
        .map(|r| {
            let consumed = r.consumed_capacity.as_ref().map_or(String::new(), |c| {
                let get = |k: &str| c.get(k).map_or("-".to_string(), |q| q.0.clone());
                format!(" memory={} cores={}", get("memory"), get("cores"))
            });
            format!("{} {}/{}{consumed}", r.request, r.pool, r.device)
        })
        .collect()
}

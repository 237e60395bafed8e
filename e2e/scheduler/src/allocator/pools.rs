//! Which devices a node can use: the latest generation of each pool, restricted to the slices
//! (or, with perDeviceNodeSelection, the devices) that target the node.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{Node, NodeSelector, NodeSelectorRequirement};
use k8s_openapi::api::resource::v1::{CounterSet, Device, ResourceSlice};

/// The node an allocation is computed for: its name and labels (for slice node selectors).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TargetNode {
    pub name: String,
    pub labels: BTreeMap<String, String>,
}

impl TargetNode {
    pub fn named(name: &str) -> Self {
        TargetNode {
            name: name.to_string(),
            labels: BTreeMap::new(),
        }
    }
}

impl From<&str> for TargetNode {
    fn from(name: &str) -> Self {
        TargetNode::named(name)
    }
}

impl From<&Node> for TargetNode {
    fn from(node: &Node) -> Self {
        TargetNode {
            name: node.metadata.name.clone().unwrap_or_default(),
            labels: node.metadata.labels.clone().unwrap_or_default(),
        }
    }
}

/// Whether a node selector (terms ORed, requirements within a term ANDed) selects the node.
/// An empty term selects nothing, like the real API.
pub fn node_selector_matches(selector: &NodeSelector, node: &TargetNode) -> bool {
    selector.node_selector_terms.iter().any(|term| {
        let expressions = term.match_expressions.as_deref().unwrap_or_default();
        let fields = term.match_fields.as_deref().unwrap_or_default();
        if expressions.is_empty() && fields.is_empty() {
            return false;
        }
        expressions
            .iter()
            .all(|req| requirement_matches(req, node.labels.get(&req.key).map(String::as_str)))
            && fields.iter().all(|req| {
                let value = (req.key == "metadata.name").then_some(node.name.as_str());
                requirement_matches(req, value)
            })
    })
}

fn requirement_matches(req: &NodeSelectorRequirement, value: Option<&str>) -> bool {
    let values = req.values.as_deref().unwrap_or_default();
    let as_int = |s: &str| s.parse::<i64>().ok();
    match req.operator.as_str() {
        "In" => value.is_some_and(|v| values.iter().any(|x| x == v)),
        "NotIn" => value.is_none_or(|v| values.iter().all(|x| x != v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" | "Lt" => {
            let (Some(have), Some(bound)) = (
                value.and_then(as_int),
                values.first().and_then(|s| as_int(s)),
            ) else {
                return false;
            };
            if req.operator == "Gt" {
                have > bound
            } else {
                have < bound
            }
        }
        _ => false,
    }
}

/// The latest generation of one pool as seen from one node.
#[derive(Debug)]
pub(crate) struct Pool<'a> {
    pub driver: &'a str,
    pub name: &'a str,
    /// Fewer slices of the latest generation exist than `resourceSliceCount` says: the driver
    /// is in the middle of an update.
    pub incomplete: bool,
    /// Why the latest generation cannot be used: the same device or counter-set name twice, or
    /// a device that consumes a counter set or counter the pool does not have (upstream marks the
    /// whole pool invalid then, "counter set %s not found", rather than reject the slice).
    pub invalid: Option<String>,
    /// Devices of this pool usable on the node, in slice order (slices sorted by name).
    pub devices: Vec<PoolDevice<'a>>,
    /// The pool's counter sets by name, from every slice of the generation (counter sets sit in
    /// slices of their own).
    pub counter_sets: BTreeMap<&'a str, &'a CounterSet>,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct PoolDevice<'a> {
    pub slice: &'a ResourceSlice,
    pub device: &'a Device,
}

/// Where a device may be used, from its slice or (perDeviceNodeSelection) from the device.
pub(crate) enum Placement<'a> {
    Node(&'a str),
    Selector(&'a NodeSelector),
    AllNodes,
    Nowhere,
}

pub(crate) fn placement<'a>(slice: &'a ResourceSlice, device: &'a Device) -> Placement<'a> {
    let spec = &slice.spec;
    let (node_name, selector, all_nodes) = if spec.per_device_node_selection == Some(true) {
        (
            device.node_name.as_deref(),
            device.node_selector.as_ref(),
            device.all_nodes,
        )
    } else {
        (
            spec.node_name.as_deref(),
            spec.node_selector.as_ref(),
            spec.all_nodes,
        )
    };
    match (node_name, selector, all_nodes) {
        (Some(name), _, _) if !name.is_empty() => Placement::Node(name),
        (_, Some(selector), _) => Placement::Selector(selector),
        (_, _, Some(true)) => Placement::AllNodes,
        _ => Placement::Nowhere,
    }
}

fn usable_on(placement: &Placement<'_>, node: &TargetNode) -> bool {
    match placement {
        Placement::Node(name) => *name == node.name,
        Placement::Selector(selector) => node_selector_matches(selector, node),
        Placement::AllNodes => true,
        Placement::Nowhere => false,
    }
}

/// Pools with a device usable on `node`, sorted by driver and pool name for a deterministic
/// search order. Slices of older generations are ignored.
pub(crate) fn gather_pools<'a>(slices: &'a [ResourceSlice], node: &TargetNode) -> Vec<Pool<'a>> {
    let mut latest: BTreeMap<(&str, &str), Vec<&ResourceSlice>> = BTreeMap::new();
    for slice in slices {
        let key = (slice.spec.driver.as_str(), slice.spec.pool.name.as_str());
        let entry = latest.entry(key).or_default();
        match entry.first().map(|s| s.spec.pool.generation) {
            Some(generation) if generation > slice.spec.pool.generation => {}
            Some(generation) if generation == slice.spec.pool.generation => entry.push(slice),
            _ => *entry = vec![slice],
        }
    }
    let mut pools = Vec::new();
    for ((driver, name), mut pool_slices) in latest {
        pool_slices.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        let expected = pool_slices[0].spec.pool.resource_slice_count;
        let mut seen = BTreeSet::new();
        let mut invalid = pool_slices
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .find(|d| !seen.insert(d.name.as_str()))
            .map(|d| format!("device {} is listed twice", d.name));
        let mut counter_sets: BTreeMap<&str, &CounterSet> = BTreeMap::new();
        for set in pool_slices
            .iter()
            .flat_map(|s| s.spec.shared_counters.iter().flatten())
        {
            if counter_sets.insert(set.name.as_str(), set).is_some() && invalid.is_none() {
                invalid = Some(format!("counter set {} is listed twice", set.name));
            }
        }
        if invalid.is_none() {
            invalid = pool_slices
                .iter()
                .flat_map(|s| s.spec.devices.iter().flatten())
                .find_map(|d| missing_counter(d, &counter_sets));
        }
        let devices: Vec<PoolDevice> = pool_slices
            .iter()
            .flat_map(|slice| {
                slice
                    .spec
                    .devices
                    .iter()
                    .flatten()
                    .map(move |device| PoolDevice { slice, device })
            })
            .filter(|d| usable_on(&placement(d.slice, d.device), node))
            .collect();
        if devices.is_empty() {
            continue;
        }
        pools.push(Pool {
            driver,
            name,
            incomplete: pool_slices.len() as i64 != expected,
            invalid,
            devices,
            counter_sets,
        });
    }
    pools
}

/// The first counter set or counter a device consumes that the pool does not have.
fn missing_counter(device: &Device, sets: &BTreeMap<&str, &CounterSet>) -> Option<String> {
    for consumption in device.consumes_counters.iter().flatten() {
        let Some(set) = sets.get(consumption.counter_set.as_str()) else {
            return Some(format!(
                "device {}: counter set {} not found",
                device.name, consumption.counter_set
            ));
        };
        if let Some(counter) = consumption
            .counters
            .keys()
            .find(|c| !set.counters.contains_key(*c))
        {
            return Some(format!(
                "device {}: counter {counter} not found in counter set {}",
                device.name, consumption.counter_set
            ));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::NodeSelectorTerm;
    use k8s_openapi::api::resource::v1::{ResourcePool, ResourceSliceSpec};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn slice(
        name: &str,
        node: Option<&str>,
        pool: &str,
        generation: i64,
        count: i64,
        devices: &[&str],
    ) -> ResourceSlice {
        ResourceSlice {
            metadata: ObjectMeta {
                name: Some(name.to_string()),
                ..Default::default()
            },
            spec: ResourceSliceSpec {
                driver: "gpupool.dev".to_string(),
                node_name: node.map(str::to_string),
                all_nodes: node.is_none().then_some(true),
                pool: ResourcePool {
                    name: pool.to_string(),
                    generation,
                    resource_slice_count: count,
                },
                devices: Some(
                    devices
                        .iter()
                        .map(|d| Device {
                            name: d.to_string(),
                            ..Default::default()
                        })
                        .collect(),
                ),
                ..Default::default()
            },
        }
    }

    fn names(pools: &[Pool]) -> Vec<String> {
        pools
            .iter()
            .flat_map(|p| {
                p.devices
                    .iter()
                    .map(move |d| format!("{}/{}", p.name, d.device.name))
            })
            .collect()
    }

    #[test]
    fn only_the_latest_generation_counts() {
        let slices = vec![
            slice("a-old", Some("node-a"), "node-a", 1, 1, &["gpu-0", "gpu-9"]),
            slice("a-new", Some("node-a"), "node-a", 2, 1, &["gpu-0"]),
        ];
        let pools = gather_pools(&slices, &"node-a".into());
        assert_eq!(names(&pools), vec!["node-a/gpu-0"]);
        assert!(!pools[0].incomplete);
    }

    #[test]
    fn a_pool_missing_slices_of_its_generation_is_incomplete() {
        let slices = vec![slice("a-1", Some("node-a"), "node-a", 3, 2, &["gpu-0"])];
        let pools = gather_pools(&slices, &"node-a".into());
        assert!(pools[0].incomplete);
    }

    #[test]
    fn other_nodes_slices_are_not_candidates_but_all_nodes_slices_are() {
        let slices = vec![
            slice("a", Some("node-a"), "node-a", 1, 1, &["gpu-0"]),
            slice("b", Some("node-b"), "node-b", 1, 1, &["gpu-0"]),
            slice("net", None, "fabric", 1, 1, &["switch-0"]),
        ];
        let pools = gather_pools(&slices, &"node-b".into());
        assert_eq!(names(&pools), vec!["fabric/switch-0", "node-b/gpu-0"]);
    }

    #[test]
    fn duplicate_device_names_make_a_pool_invalid() {
        let slices = vec![
            slice("a-1", Some("node-a"), "node-a", 1, 2, &["gpu-0"]),
            slice("a-2", Some("node-a"), "node-a", 1, 2, &["gpu-0"]),
        ];
        let pools = gather_pools(&slices, &"node-a".into());
        assert!(pools[0].invalid.is_some());
    }

    #[test]
    fn counter_sets_come_from_their_own_slices_and_a_missing_one_invalidates_the_pool() {
        use k8s_openapi::api::resource::v1::{Counter, DeviceCounterConsumption};
        use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
        let counters = |names: &[&str]| -> BTreeMap<String, Counter> {
            names
                .iter()
                .map(|n| {
                    (
                        n.to_string(),
                        Counter {
                            value: Quantity("1".into()),
                        },
                    )
                })
                .collect()
        };
        let mut sets = slice("a-0", Some("node-a"), "node-a", 1, 2, &[]);
        sets.spec.devices = None;
        sets.spec.shared_counters = Some(vec![CounterSet {
            name: "gpu-0-counters".into(),
            counters: counters(&["memory-slice-0"]),
        }]);
        let mut devices = slice("a-1", Some("node-a"), "node-a", 1, 2, &["gpu-0"]);
        let consume = |set: &str, counter: &str| {
            Some(vec![DeviceCounterConsumption {
                counter_set: set.into(),
                counters: counters(&[counter]),
            }])
        };
        devices.spec.devices.as_mut().unwrap()[0].consumes_counters =
            consume("gpu-0-counters", "memory-slice-0");
        let slices = vec![sets.clone(), devices.clone()];
        let pools = gather_pools(&slices, &"node-a".into());
        assert_eq!(pools[0].invalid, None);
        assert!(
            !pools[0].incomplete,
            "the counter slice counts in resourceSliceCount"
        );
        assert!(pools[0].counter_sets.contains_key("gpu-0-counters"));

        devices.spec.devices.as_mut().unwrap()[0].consumes_counters =
            consume("gpu-9-counters", "memory-slice-0");
        let slices = vec![sets.clone(), devices.clone()];
        let pools = gather_pools(&slices, &"node-a".into());
        assert_eq!(
            pools[0].invalid.as_deref(),
            Some("device gpu-0: counter set gpu-9-counters not found")
        );
        devices.spec.devices.as_mut().unwrap()[0].consumes_counters =
            consume("gpu-0-counters", "memory-slice-7");
        let slices = vec![sets, devices];
        let pools = gather_pools(&slices, &"node-a".into());
        assert!(pools[0]
            .invalid
            .as_deref()
            .unwrap()
            .contains("memory-slice-7"));
    }

    #[test]
    fn node_selectors_match_labels_and_name() {
        let mut node = TargetNode::named("node-a");
        node.labels.insert("zone".into(), "z1".into());
        let requirement = |key: &str, op: &str, values: &[&str]| NodeSelectorRequirement {
            key: key.to_string(),
            operator: op.to_string(),
            values: Some(values.iter().map(|v| v.to_string()).collect()),
        };
        let by_label = NodeSelector {
            node_selector_terms: vec![NodeSelectorTerm {
                match_expressions: Some(vec![requirement("zone", "In", &["z1", "z2"])]),
                match_fields: None,
            }],
        };
        let by_other_name = NodeSelector {
            node_selector_terms: vec![NodeSelectorTerm {
                match_expressions: None,
                match_fields: Some(vec![requirement("metadata.name", "In", &["node-b"])]),
            }],
        };
        let empty_term = NodeSelector {
            node_selector_terms: vec![NodeSelectorTerm::default()],
        };
        assert!(node_selector_matches(&by_label, &node));
        assert!(!node_selector_matches(&by_other_name, &node));
        assert!(!node_selector_matches(&empty_term, &node));
    }
}

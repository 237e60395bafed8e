//! Hand-made Nodes for a control plane without kubelets, and the ResourceSlices gpupool's driver
//! would publish for them (its own slice code on a fake inventory, no driver process).
//!
//! A Node nobody heartbeats must carry its status from the start (capacity, allocatable, a Ready
//! condition) and lose the `node.kubernetes.io/not-ready` taint that admission puts on every new
//! Node, or kube-scheduler places nothing on it.

use std::collections::BTreeMap;

use gpupool_driver::devices::Partitioning;
use gpupool_driver::health::HealthMap;
use gpupool_driver::inventory::fake::fake_inventory;
use gpupool_driver::slices::{build_slices, SliceMode};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::ResourceSlice;
use serde_json::{json, Value};

/// The taint TaintNodesByCondition admission adds to every Node created.
pub const NOT_READY_TAINT: &str = "node.kubernetes.io/not-ready";
/// Label on every Node a test made, by hand or through a real kubelet it started
/// ([`super::real_node`]), so a plane can tell them apart (and remove them at the next turn).
pub const HAND_MADE_LABEL: &str = "gpupool.dev/hand-made";

/// What a hand-made Node offers to the scheduler besides its devices.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeShape {
    pub name: String,
    /// CPU capacity (a quantity: `"96"`, `"500m"`).
    pub cpu: String,
    /// Memory capacity (a quantity: `"512Gi"`).
    pub memory: String,
    pub pods: u32,
    pub labels: BTreeMap<String, String>,
}

impl NodeShape {
    /// A node with room for anything the e2e scenarios run: 32 CPUs, 256 GiB, 110 pods.
    pub fn new(name: impl Into<String>) -> NodeShape {
        NodeShape {
            name: name.into(),
            cpu: "32".into(),
            memory: "256Gi".into(),
            pods: 110,
            labels: BTreeMap::new(),
        }
    }

    pub fn cpu(mut self, quantity: &str) -> Self {
        self.cpu = quantity.to_string();
        self
    }

    pub fn memory(mut self, quantity: &str) -> Self {
        self.memory = quantity.to_string();
        self
    }

    pub fn pods(mut self, pods: u32) -> Self {
        self.pods = pods;
        self
    }

    pub fn label(mut self, key: &str, value: &str) -> Self {
        self.labels.insert(key.to_string(), value.to_string());
        self
    }
}

/// The Node object of `shape`, status included, as a kubelet would register it.
pub fn node_object(shape: &NodeShape) -> Node {
    let mut labels: BTreeMap<String, String> = [
        ("kubernetes.io/hostname", shape.name.as_str()),
        ("kubernetes.io/os", "linux"),
        ("kubernetes.io/arch", std::env::consts::ARCH),
        (HAND_MADE_LABEL, "true"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    labels.extend(shape.labels.clone());
    let resources = json!({
        "cpu": shape.cpu,
        "memory": shape.memory,
        "pods": shape.pods.to_string(),
        "ephemeral-storage": "100Gi",
    });
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": shape.name, "labels": labels},
        "status": {
            "capacity": resources,
            "allocatable": resources,
            "conditions": [{
                "type": "Ready", "status": "True", "reason": "KubeletReady",
                "message": "hand-made node: no kubelet heartbeats it"
            }],
            "nodeInfo": {
                "kubeletVersion": "v1.36.2", "operatingSystem": "linux",
                "architecture": std::env::consts::ARCH, "machineID": "", "systemUUID": "",
                "bootID": "", "kernelVersion": "", "osImage": "", "containerRuntimeVersion": "",
                "kubeProxyVersion": ""
            }
        }
    }))
    .expect("the node literal is a Node")
}

/// The merge patch that leaves the node's taints without the not-ready one, or `None` when it has
/// none to remove.
pub fn without_not_ready_taint(node: &Node) -> Option<Value> {
    let taints = node.spec.as_ref()?.taints.as_ref()?;
    if !taints.iter().any(|t| t.key == NOT_READY_TAINT) {
        return None;
    }
    let kept: Vec<_> = taints.iter().filter(|t| t.key != NOT_READY_TAINT).collect();
    Some(json!({"spec": {"taints": kept}}))
}

/// The ResourceSlices gpupool's driver publishes for `node` with fake GPUs `fake_gpus` (the
/// `--fake-gpus` syntax, e.g. `a100-40gb:2,v100-32gb:1`), at pool generation 1: consumable
/// capacity and MIG counters, as on a 1.36 cluster. `weights` maps a model to its compute weight.
pub fn fake_node_slices(
    node: &str,
    fake_gpus: &str,
    weights: &BTreeMap<String, i64>,
) -> Result<Vec<ResourceSlice>, String> {
    let inventory = fake_inventory(fake_gpus, node).map_err(|e| format!("{fake_gpus}: {e}"))?;
    build_slices(
        &inventory,
        node,
        weights,
        &HealthMap::default(),
        1,
        SliceMode::Shared,
        Partitioning::Counters,
    )
    .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hand_made_node_is_ready_with_its_resources_and_labels() {
        let node = node_object(
            &NodeShape::new("n1")
                .cpu("96")
                .memory("512Gi")
                .label("zone", "a"),
        );
        let status = node.status.as_ref().unwrap();
        assert_eq!(status.allocatable.as_ref().unwrap()["cpu"].0, "96");
        assert_eq!(status.capacity.as_ref().unwrap()["pods"].0, "110");
        let ready = &status.conditions.as_ref().unwrap()[0];
        assert_eq!(
            (ready.type_.as_str(), ready.status.as_str()),
            ("Ready", "True")
        );
        let labels = node.metadata.labels.as_ref().unwrap();
        assert_eq!(labels["kubernetes.io/hostname"], "n1");
        assert_eq!(labels["zone"], "a");
        assert_eq!(labels[HAND_MADE_LABEL], "true");
    }

    #[test]
    fn only_the_not_ready_taint_is_removed() {
        let mut node = node_object(&NodeShape::new("n1"));
        assert_eq!(without_not_ready_taint(&node), None);
        node.spec = Some(
            serde_json::from_value(json!({"taints": [
                {"key": NOT_READY_TAINT, "effect": "NoSchedule"},
                {"key": "gpu", "value": "x", "effect": "NoSchedule"}]}))
            .unwrap(),
        );
        assert_eq!(
            without_not_ready_taint(&node),
            Some(
                json!({"spec": {"taints": [{"key": "gpu", "value": "x", "effect": "NoSchedule"}]}})
            )
        );
    }

    #[test]
    fn fake_slices_are_the_drivers_own() {
        let slices = fake_node_slices("n1", "a100-40gb:2", &BTreeMap::new()).unwrap();
        let devices: Vec<&str> = slices
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .map(|d| d.name.as_str())
            .filter(|n| !n.contains("-mig-"))
            .collect();
        assert_eq!(devices, ["gpu-0", "gpu-1"]);
        assert!(slices
            .iter()
            .all(|s| s.spec.node_name.as_deref() == Some("n1") && s.spec.pool.generation == 1));
        assert!(fake_node_slices("n1", "no-such-card:1", &BTreeMap::new())
            .unwrap_err()
            .starts_with("no-such-card:1: "));
    }
}

//! The GPU inventory of one node: one type whatever found it (NVML or a fake profile).

use serde::{Deserialize, Serialize};

/// One physical GPU as the driver publishes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Gpu {
    /// NVML index on the node; the device is published as `gpu-<index>`.
    pub index: u32,
    /// Minor number of `/dev/nvidia<minor>`.
    pub minor: u32,
    pub uuid: String,
    /// Product name as NVML reports it, e.g. "NVIDIA A100-SXM4-40GB".
    pub product_name: String,
    /// Short model, e.g. "A100-SXM4-40GB" (see [`model_from_product_name`]).
    pub model: String,
    /// e.g. "Ampere".
    pub architecture: String,
    /// NVML brand, e.g. "Nvidia", "Tesla", "GeForce".
    pub brand: String,
    pub memory_bytes: u64,
    /// Streaming multiprocessors.
    pub multiprocessors: u32,
    pub cuda_cores: u32,
    /// e.g. "8.0".
    pub cuda_compute_capability: String,
    /// e.g. "550.54.15".
    pub driver_version: String,
    /// e.g. "12.4".
    pub cuda_driver_version: String,
    /// e.g. "0000:07:00.0".
    pub pci_bus_id: String,
    /// e.g. "pci0000:00", when known.
    pub pcie_root: Option<String>,
    /// NUMA node, when the platform reports one.
    pub numa_node: Option<i64>,
}

/// Where an inventory came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum InventorySource {
    Nvml,
    Fake,
}

/// All GPUs of one node, ordered by index.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Inventory {
    pub source: InventorySource,
    pub gpus: Vec<Gpu>,
}

impl Inventory {
    pub fn gpu(&self, device_name: &str) -> Option<&Gpu> {
        self.gpus
            .iter()
            .find(|g| crate::names::device_name(g.index) == device_name)
    }
}

/// Short model name from NVML's product name: "NVIDIA A100-SXM4-40GB" -> "A100-SXM4-40GB",
/// "Tesla V100-SXM2-32GB" -> "V100-SXM2-32GB", "NVIDIA GeForce RTX 3090" -> "RTX-3090".
/// Spaces become dashes so the model is one token in a label, a CEL literal and a resource name.
pub fn model_from_product_name(product_name: &str) -> String {
    let mut rest = product_name.trim();
    for prefix in ["NVIDIA ", "Tesla ", "GeForce ", "Quadro "] {
        if let Some(stripped) = rest.strip_prefix(prefix) {
            rest = stripped.trim_start();
        }
    }
    rest.split_whitespace().collect::<Vec<_>>().join("-")
}

/// A version as semver, the form DRA version attributes require: "12.4" -> "12.4.0",
/// "535.104.05" -> "535.104.5" (semver forbids leading zeros). None when it has no numeric form.
pub fn to_semver(version: &str) -> Option<String> {
    let parts: Vec<&str> = version.trim().split('.').collect();
    if parts.is_empty() || parts.len() > 3 {
        return None;
    }
    let mut numbers = Vec::with_capacity(3);
    for part in &parts {
        if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        numbers.push(part.parse::<u64>().ok()?);
    }
    numbers.resize(3, 0);
    Some(format!("{}.{}.{}", numbers[0], numbers[1], numbers[2]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_names_are_short_single_tokens() {
        assert_eq!(
            model_from_product_name("NVIDIA A100-SXM4-40GB"),
            "A100-SXM4-40GB"
        );
        assert_eq!(
            model_from_product_name("Tesla V100-SXM2-32GB"),
            "V100-SXM2-32GB"
        );
        assert_eq!(
            model_from_product_name("NVIDIA GeForce RTX 3090"),
            "RTX-3090"
        );
        assert_eq!(model_from_product_name("NVIDIA H200"), "H200");
    }

    #[test]
    fn versions_become_semver() {
        assert_eq!(to_semver("12.4").as_deref(), Some("12.4.0"));
        assert_eq!(to_semver("535.104.05").as_deref(), Some("535.104.5"));
        assert_eq!(to_semver("8.0").as_deref(), Some("8.0.0"));
        assert_eq!(to_semver("r550"), None);
        assert_eq!(to_semver("1.2.3.4"), None);
    }
}

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
    /// MIG capability, for cards that can be partitioned (A100, H100, H200, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig: Option<Mig>,
    /// The NVLink domain the card belongs to: cards joined by NVLink, directly or through one
    /// NVSwitch fabric, share the value; a card without active NVLinks has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvlink_domain: Option<String>,
}

/// How a card can be partitioned with MIG, as NVML reports it. Geometry is never assumed: every
/// figure here comes from NVML at run time (or from a fake profile that carries a real card's).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Mig {
    /// MIG mode is on now (`nvmlDeviceGetMigMode`, current mode).
    pub enabled: bool,
    /// The mode can be switched while the driver runs, without a GPU reset (Hopper and newer).
    /// Ampere needs a reset, so there only what the current mode allows is offered.
    pub switchable: bool,
    /// The GPU-instance profiles of the card, each with where it may be placed.
    pub profiles: Vec<MigProfile>,
}

/// One GPU-instance profile (`nvmlGpuInstanceProfileInfo_v2_t` plus its possible placements).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigProfile {
    /// NVML's profile id (`info.id`), what instance creation takes, e.g. 19 for 1g.5gb on an A100.
    pub id: u32,
    /// e.g. "1g.5gb", "1g.10gb+me".
    pub name: String,
    /// Compute slices (NVML's `sliceCount`: 1 for 1g.*, 7 for 7g.*).
    pub compute_slices: u32,
    /// Placement size in memory slices (a 1g.10gb on an A100 takes 2 of its 8).
    pub memory_slices: u32,
    /// First memory slice of each possible placement, ascending.
    pub placements: Vec<u32>,
    /// How many instances of this profile fit on the card at once (`instanceCount`).
    pub instances: u32,
    pub multiprocessors: u32,
    pub copy_engines: u32,
    pub decoders: u32,
    pub encoders: u32,
    pub jpeg_engines: u32,
    pub ofa_engines: u32,
    pub memory_bytes: u64,
}

impl Mig {
    /// Memory slices of the card: the end of the furthest placement (8 on A100, H100, H200).
    pub fn memory_slices(&self) -> u32 {
        self.profiles
            .iter()
            .flat_map(|p| {
                p.placements
                    .iter()
                    .map(move |start| start + p.memory_slices)
            })
            .max()
            .unwrap_or(0)
    }

    /// The profile with this NVML id.
    pub fn profile(&self, id: u32) -> Option<&MigProfile> {
        self.profiles.iter().find(|p| p.id == id)
    }
}

/// A profile name as a DNS label, for device and class names: "1g.10gb+me" -> "1g-10gb-me".
pub fn mig_profile_label(profile_name: &str) -> String {
    profile_name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect::<String>()
        .split('-')
        .filter(|part| !part.is_empty())
        .collect::<Vec<_>>()
        .join("-")
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
    fn mig_profile_names_become_dns_labels() {
        assert_eq!(mig_profile_label("1g.10gb"), "1g-10gb");
        assert_eq!(mig_profile_label("1g.10gb+me"), "1g-10gb-me");
        assert_eq!(mig_profile_label("MIG 7g.80gb"), "mig-7g-80gb");
    }

    #[test]
    fn memory_slices_end_at_the_furthest_placement() {
        let profile = |id, slices, placements: Vec<u32>| MigProfile {
            id,
            name: format!("p{id}"),
            compute_slices: slices,
            memory_slices: slices,
            instances: placements.len() as u32,
            placements,
            multiprocessors: 1,
            copy_engines: 0,
            decoders: 0,
            encoders: 0,
            jpeg_engines: 0,
            ofa_engines: 0,
            memory_bytes: 1,
        };
        let mig = Mig {
            enabled: false,
            switchable: true,
            profiles: vec![profile(19, 1, (0..7).collect()), profile(9, 4, vec![0, 4])],
        };
        assert_eq!(mig.memory_slices(), 8);
        assert_eq!(mig.profile(9).map(|p| p.memory_slices), Some(4));
        assert!(mig.profile(5).is_none());
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

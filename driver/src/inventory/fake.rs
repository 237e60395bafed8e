//! Fake GPUs with the figures NVML reports for real cards, so the whole driver runs on machines
//! without a GPU (CI, kind, laptops) and tests see realistic slices.

use gpupool_api::inventory::{model_from_product_name, Gpu, Inventory, InventorySource};
use sha2::{Digest, Sha256};

/// The NVML figures of one card model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Profile {
    /// Name used in `--fake-gpus`, e.g. "a100-40gb".
    pub key: &'static str,
    /// `nvmlDeviceGetName`.
    pub product_name: &'static str,
    pub architecture: &'static str,
    /// `nvmlDeviceGetBrand`, spelled as the driver publishes it.
    pub brand: &'static str,
    /// `nvmlDeviceGetMemoryInfo().total`, in MiB.
    pub memory_mib: u64,
    pub multiprocessors: u32,
    pub cuda_cores: u32,
    pub cuda_compute_capability: &'static str,
}

/// Driver versions the fake cards claim, a current data-centre branch.
pub const FAKE_DRIVER_VERSION: &str = "550.54.15";
pub const FAKE_CUDA_DRIVER_VERSION: &str = "12.4";

/// Figures as `nvidia-smi -q` / NVML report them on these cards (memory total in MiB, SM count,
/// CUDA cores = SMs x cores per SM of the architecture).
pub const PROFILES: &[Profile] = &[
    Profile {
        key: "a100-40gb",
        product_name: "NVIDIA A100-SXM4-40GB",
        architecture: "Ampere",
        brand: "Nvidia",
        memory_mib: 40960,
        multiprocessors: 108,
        cuda_cores: 6912,
        cuda_compute_capability: "8.0",
    },
    Profile {
        key: "a100-80gb",
        product_name: "NVIDIA A100-SXM4-80GB",
        architecture: "Ampere",
        brand: "Nvidia",
        memory_mib: 81920,
        multiprocessors: 108,
        cuda_cores: 6912,
        cuda_compute_capability: "8.0",
    },
    Profile {
        key: "h100-80gb",
        product_name: "NVIDIA H100 80GB HBM3",
        architecture: "Hopper",
        brand: "Nvidia",
        memory_mib: 81559,
        multiprocessors: 132,
        cuda_cores: 16896,
        cuda_compute_capability: "9.0",
    },
    Profile {
        key: "h200",
        product_name: "NVIDIA H200",
        architecture: "Hopper",
        brand: "Nvidia",
        memory_mib: 143771,
        multiprocessors: 132,
        cuda_cores: 16896,
        cuda_compute_capability: "9.0",
    },
    Profile {
        key: "l40s",
        product_name: "NVIDIA L40S",
        architecture: "Ada",
        brand: "Nvidia",
        memory_mib: 46068,
        multiprocessors: 142,
        cuda_cores: 18176,
        cuda_compute_capability: "8.9",
    },
    Profile {
        key: "v100-32gb",
        product_name: "Tesla V100-SXM2-32GB",
        architecture: "Volta",
        brand: "Tesla",
        memory_mib: 32768,
        multiprocessors: 80,
        cuda_cores: 5120,
        cuda_compute_capability: "7.0",
    },
    Profile {
        key: "t4",
        product_name: "Tesla T4",
        architecture: "Turing",
        brand: "Nvidia",
        memory_mib: 15360,
        multiprocessors: 40,
        cuda_cores: 2560,
        cuda_compute_capability: "7.5",
    },
    Profile {
        key: "rtx3090",
        product_name: "NVIDIA GeForce RTX 3090",
        architecture: "Ampere",
        brand: "GeForce",
        memory_mib: 24576,
        multiprocessors: 82,
        cuda_cores: 10496,
        cuda_compute_capability: "8.6",
    },
];

/// Bad `--fake-gpus` input.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FakeGpuError {
    #[error("--fake-gpus: unknown profile {name:?}; known profiles: {known}")]
    UnknownProfile { name: String, known: String },
    #[error("--fake-gpus: bad count {count:?} for profile {profile:?}: expected a whole number from 1 to 1024")]
    BadCount { profile: String, count: String },
    #[error("--fake-gpus: empty list; expected e.g. a100-40gb:2,v100-32gb:1")]
    Empty,
}

pub fn profile(key: &str) -> Option<&'static Profile> {
    PROFILES.iter().find(|p| p.key == key)
}

fn known_profiles() -> String {
    PROFILES
        .iter()
        .map(|p| p.key)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Parses `a100-40gb:2,v100-32gb:1` (a missing count means 1) into profiles in order.
pub fn parse_fake_gpus(spec: &str) -> Result<Vec<(&'static Profile, u32)>, FakeGpuError> {
    let mut out = Vec::new();
    for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (name, count) = match item.split_once(':') {
            Some((name, count)) => (name.trim(), Some(count.trim())),
            None => (item, None),
        };
        let name = name.to_ascii_lowercase();
        let profile = profile(&name).ok_or_else(|| FakeGpuError::UnknownProfile {
            name: name.clone(),
            known: known_profiles(),
        })?;
        let count = match count {
            None => 1,
            Some(text) => match text.parse::<u32>() {
                Ok(n) if (1..=1024).contains(&n) => n,
                _ => {
                    return Err(FakeGpuError::BadCount {
                        profile: name,
                        count: text.to_string(),
                    })
                }
            },
        };
        out.push((profile, count));
    }
    if out.is_empty() {
        return Err(FakeGpuError::Empty);
    }
    Ok(out)
}

/// A stable GPU UUID for fake GPU `index` on `node_name`, in NVML's `GPU-8-4-4-4-12` form,
/// so that a restarted driver publishes the same devices.
pub fn fake_uuid(node_name: &str, index: u32) -> String {
    let digest = Sha256::digest(format!("gpupool-fake-gpu/{node_name}/{index}").as_bytes());
    let hex = hex::encode(&digest[..16]);
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// The inventory a node with these fake cards would report: indices and minors 0.., one PCI bus per card.
pub fn fake_inventory(spec: &str, node_name: &str) -> Result<Inventory, FakeGpuError> {
    let mut gpus = Vec::new();
    let mut index = 0u32;
    for (profile, count) in parse_fake_gpus(spec)? {
        for _ in 0..count {
            gpus.push(fake_gpu(profile, node_name, index));
            index += 1;
        }
    }
    Ok(Inventory {
        source: InventorySource::Fake,
        gpus,
    })
}

fn fake_gpu(profile: &Profile, node_name: &str, index: u32) -> Gpu {
    // Real boards sit on buses 0x07, 0x0f, ...; any distinct, well-formed id serves the tests.
    let domain = index / 200;
    let bus = 0x20 + index % 200;
    Gpu {
        index,
        minor: index,
        uuid: fake_uuid(node_name, index),
        product_name: profile.product_name.to_string(),
        model: model_from_product_name(profile.product_name),
        architecture: profile.architecture.to_string(),
        brand: profile.brand.to_string(),
        memory_bytes: profile.memory_mib * 1024 * 1024,
        multiprocessors: profile.multiprocessors,
        cuda_cores: profile.cuda_cores,
        cuda_compute_capability: profile.cuda_compute_capability.to_string(),
        driver_version: FAKE_DRIVER_VERSION.to_string(),
        cuda_driver_version: FAKE_CUDA_DRIVER_VERSION.to_string(),
        pci_bus_id: format!("{domain:04x}:{bus:02x}:00.0"),
        pcie_root: Some(format!("pci{domain:04x}:00")),
        numa_node: Some(0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiles_carry_the_nvml_figures() {
        let a100 = profile("a100-40gb").unwrap();
        assert_eq!(a100.product_name, "NVIDIA A100-SXM4-40GB");
        assert_eq!(
            (a100.memory_mib, a100.multiprocessors, a100.cuda_cores),
            (40960, 108, 6912)
        );
        let h200 = profile("h200").unwrap();
        assert_eq!(
            (h200.product_name, h200.memory_mib),
            ("NVIDIA H200", 143771)
        );
        let v100 = profile("v100-32gb").unwrap();
        assert_eq!(
            (v100.product_name, v100.cuda_compute_capability),
            ("Tesla V100-SXM2-32GB", "7.0")
        );
        assert_eq!(
            profile("h100-80gb").unwrap().product_name,
            "NVIDIA H100 80GB HBM3"
        );
        assert_eq!(profile("t4").unwrap().product_name, "Tesla T4");
        assert_eq!(
            profile("rtx3090").unwrap().product_name,
            "NVIDIA GeForce RTX 3090"
        );
        for p in PROFILES {
            let (major, minor) = p.cuda_compute_capability.split_once('.').unwrap();
            let per_sm =
                super::super::nvml::cores_per_sm(major.parse().unwrap(), minor.parse().unwrap())
                    .unwrap();
            assert_eq!(
                p.cuda_cores,
                p.multiprocessors * per_sm,
                "{}: cores = SMs x cores/SM",
                p.key
            );
        }
    }

    #[test]
    fn parses_a_list_of_profiles_with_counts() {
        let parsed = parse_fake_gpus("a100-40gb:2, v100-32gb:1,t4").unwrap();
        let keys: Vec<_> = parsed.iter().map(|(p, n)| (p.key, *n)).collect();
        assert_eq!(keys, vec![("a100-40gb", 2), ("v100-32gb", 1), ("t4", 1)]);
    }

    #[test]
    fn unknown_profile_lists_the_known_ones() {
        let err = parse_fake_gpus("a100-40gb:1,b200:1").unwrap_err();
        let text = err.to_string();
        assert!(text.contains("\"b200\""), "{text}");
        for p in PROFILES {
            assert!(text.contains(p.key), "{text} lacks {}", p.key);
        }
    }

    #[test]
    fn bad_counts_and_empty_lists_are_errors() {
        assert!(matches!(
            parse_fake_gpus("a100-40gb:0"),
            Err(FakeGpuError::BadCount { .. })
        ));
        assert!(matches!(
            parse_fake_gpus("a100-40gb:x"),
            Err(FakeGpuError::BadCount { .. })
        ));
        assert_eq!(parse_fake_gpus(" , "), Err(FakeGpuError::Empty));
    }

    #[test]
    fn inventory_numbers_cards_in_order_with_stable_ids() {
        let inv = fake_inventory("a100-40gb:2,v100-32gb:1", "node-a").unwrap();
        assert_eq!(inv.source, InventorySource::Fake);
        let indices: Vec<_> = inv
            .gpus
            .iter()
            .map(|g| (g.index, g.minor, g.model.as_str()))
            .collect();
        assert_eq!(
            indices,
            vec![
                (0, 0, "A100-SXM4-40GB"),
                (1, 1, "A100-SXM4-40GB"),
                (2, 2, "V100-SXM2-32GB")
            ]
        );
        assert_eq!(inv.gpus[0].memory_bytes, 40 * 1024 * 1024 * 1024);
        let again = fake_inventory("a100-40gb:2,v100-32gb:1", "node-a").unwrap();
        assert_eq!(inv, again);
        let other = fake_inventory("a100-40gb:2,v100-32gb:1", "node-b").unwrap();
        assert_ne!(inv.gpus[0].uuid, other.gpus[0].uuid);
        assert_ne!(inv.gpus[0].uuid, inv.gpus[1].uuid);
        assert_ne!(inv.gpus[0].pci_bus_id, inv.gpus[1].pci_bus_id);
        let uuid = &inv.gpus[0].uuid;
        let groups: Vec<usize> = uuid
            .trim_start_matches("GPU-")
            .split('-')
            .map(str::len)
            .collect();
        assert!(uuid.starts_with("GPU-"));
        assert_eq!(groups, vec![8, 4, 4, 4, 12]);
    }
}

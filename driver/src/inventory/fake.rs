//! Fake GPUs with the figures NVML reports for real cards, so the whole driver runs on machines
//! without a GPU (CI, kind, laptops) and tests see realistic slices: MIG geometry of the cards
//! that have it, and NVLink layouts (an NVSwitch board, bridged pairs).
//!
//! `--fake-gpus` is a list of `<profile>[:<count>][+<option>...]`, e.g.
//! `a100-40gb:2+mig,h100-80gb:8+nvswitch`. Options: `mig` (MIG mode on at start), `nvswitch`
//! (the group's cards on one NVSwitch fabric), `nvlink-pairs` (cards bridged two by two).

use gpupool_api::inventory::{
    model_from_product_name, Gpu, Inventory, InventorySource, Mig, MigProfile,
};
use sha2::{Digest, Sha256};

use super::topology::{nvlink_domains, GpuLinks, LinkPeer};

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
    /// MIG geometry, for cards that can be partitioned.
    pub mig: Option<&'static FakeMig>,
}

/// The MIG geometry of one card model, as NVML reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FakeMig {
    /// Switches mode without a reset (Hopper).
    pub switchable: bool,
    pub profiles: &'static [FakeMigProfile],
}

/// One GPU-instance profile (`nvmlDeviceGetGpuInstanceProfileInfoV` and its placements).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FakeMigProfile {
    pub id: u32,
    pub name: &'static str,
    pub memory_slices: u32,
    pub placements: &'static [u32],
    /// How many instances of it fit at once (`instanceCount`: one for the `+me` profiles, which
    /// take the card's only JPEG and OFA engines).
    pub instances: u32,
    pub multiprocessors: u32,
    /// Copy engines, decoders, encoders, JPEG and OFA engines.
    pub engines: [u32; 5],
    /// `memorySizeMB` where it is known from a real card; otherwise the instance's memory slices
    /// times an eighth of the card (NVML reports a little less: firmware keeps some).
    pub memory_mib: Option<u64>,
}

const ALL_1G: &[u32] = &[0, 1, 2, 3, 4, 5, 6];

/// A100-40GB: ids, placements and memory sizes as NVML reports them on the real card (the
/// geometry table of NVIDIA's MIG user guide); engine counts of go-nvml's A100 mock, which
/// matches the real card.
pub const A100_40GB_MIG: FakeMig = FakeMig {
    switchable: false,
    profiles: &[
        mig(
            19,
            "1g.5gb",
            (1, ALL_1G, 7),
            14,
            [1, 1, 0, 0, 0],
            Some(4864),
        ),
        mig(
            20,
            "1g.5gb+me",
            (1, ALL_1G, 1),
            14,
            [1, 1, 0, 1, 1],
            Some(4864),
        ),
        mig(
            15,
            "1g.10gb",
            (2, &[0, 2, 4, 6], 4),
            14,
            [1, 1, 0, 0, 0],
            Some(9856),
        ),
        mig(
            14,
            "2g.10gb",
            (2, &[0, 2, 4], 3),
            28,
            [2, 1, 0, 0, 0],
            Some(9856),
        ),
        mig(
            9,
            "3g.20gb",
            (4, &[0, 4], 2),
            42,
            [3, 2, 0, 0, 0],
            Some(19968),
        ),
        mig(5, "4g.20gb", (4, &[0], 1), 56, [4, 2, 0, 0, 0], Some(19968)),
        mig(0, "7g.40gb", (8, &[0], 1), 98, [7, 5, 0, 1, 1], Some(40192)),
    ],
};

/// A100-80GB: the A100-40GB geometry with twice the memory per slice.
pub const A100_80GB_MIG: FakeMig = FakeMig {
    switchable: false,
    profiles: &[
        mig(
            19,
            "1g.10gb",
            (1, ALL_1G, 7),
            14,
            [1, 1, 0, 0, 0],
            Some(9856),
        ),
        mig(
            20,
            "1g.10gb+me",
            (1, ALL_1G, 1),
            14,
            [1, 1, 0, 1, 1],
            Some(9856),
        ),
        mig(
            15,
            "1g.20gb",
            (2, &[0, 2, 4, 6], 4),
            14,
            [1, 1, 0, 0, 0],
            Some(19968),
        ),
        mig(
            14,
            "2g.20gb",
            (2, &[0, 2, 4], 3),
            28,
            [2, 1, 0, 0, 0],
            Some(19968),
        ),
        mig(
            9,
            "3g.40gb",
            (4, &[0, 4], 2),
            42,
            [3, 2, 0, 0, 0],
            Some(40192),
        ),
        mig(5, "4g.40gb", (4, &[0], 1), 56, [4, 2, 0, 0, 0], Some(40192)),
        mig(0, "7g.80gb", (8, &[0], 1), 98, [7, 5, 0, 1, 1], Some(80384)),
    ],
};

/// H100-80GB: ids, placements and SM counts of the real card (NVIDIA's MIG user guide); engine
/// counts are stand-ins (a decoder and a JPEG engine per compute slice, the only OFA engine for
/// `+me` and the full profile), not read from a card; memory per slice an eighth of the card.
/// Hopper switches MIG mode without a reset.
pub const H100_80GB_MIG: FakeMig = FakeMig {
    switchable: true,
    profiles: &[
        mig(19, "1g.10gb", (1, ALL_1G, 7), 16, [1, 1, 0, 1, 0], None),
        mig(20, "1g.10gb+me", (1, ALL_1G, 1), 16, [1, 1, 0, 1, 1], None),
        mig(
            15,
            "1g.20gb",
            (2, &[0, 2, 4, 6], 4),
            26,
            [1, 1, 0, 1, 0],
            None,
        ),
        mig(14, "2g.20gb", (2, &[0, 2, 4], 3), 32, [2, 2, 0, 2, 0], None),
        mig(9, "3g.40gb", (4, &[0, 4], 2), 60, [3, 3, 0, 3, 0], None),
        mig(5, "4g.40gb", (4, &[0], 1), 64, [4, 4, 0, 4, 0], None),
        mig(0, "7g.80gb", (8, &[0], 1), 132, [8, 7, 0, 7, 1], None),
    ],
};

/// H200: NVIDIA names the profiles after its 141 GB; ids, placements and SMs assumed equal to
/// the H100's (not verified on a card, which is why the driver reads them from NVML).
pub const H200_MIG: FakeMig = FakeMig {
    switchable: true,
    profiles: &[
        mig(19, "1g.18gb", (1, ALL_1G, 7), 16, [1, 1, 0, 1, 0], None),
        mig(20, "1g.18gb+me", (1, ALL_1G, 1), 16, [1, 1, 0, 1, 1], None),
        mig(
            15,
            "1g.35gb",
            (2, &[0, 2, 4, 6], 4),
            26,
            [1, 1, 0, 1, 0],
            None,
        ),
        mig(14, "2g.35gb", (2, &[0, 2, 4], 3), 32, [2, 2, 0, 2, 0], None),
        mig(9, "3g.71gb", (4, &[0, 4], 2), 60, [3, 3, 0, 3, 0], None),
        mig(5, "4g.71gb", (4, &[0], 1), 64, [4, 4, 0, 4, 0], None),
        mig(0, "7g.141gb", (8, &[0], 1), 132, [8, 7, 0, 7, 1], None),
    ],
};

/// `geometry`: memory slices per instance, the first slice of each placement, and how many
/// instances fit at once.
const fn mig(
    id: u32,
    name: &'static str,
    geometry: (u32, &'static [u32], u32),
    multiprocessors: u32,
    engines: [u32; 5],
    memory_mib: Option<u64>,
) -> FakeMigProfile {
    let (memory_slices, placements, instances) = geometry;
    FakeMigProfile {
        id,
        name,
        memory_slices,
        placements,
        instances,
        multiprocessors,
        engines,
        memory_mib,
    }
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
        mig: Some(&A100_40GB_MIG),
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
        mig: Some(&A100_80GB_MIG),
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
        mig: Some(&H100_80GB_MIG),
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
        mig: Some(&H200_MIG),
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
        mig: None,
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
        mig: None,
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
        mig: None,
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
        mig: None,
    },
];

/// Bad `--fake-gpus` input.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FakeGpuError {
    #[error("--fake-gpus: unknown profile {name:?}; known profiles: {known}")]
    UnknownProfile { name: String, known: String },
    #[error("--fake-gpus: bad count {count:?} for profile {profile:?}: expected a whole number from 1 to 1024")]
    BadCount { profile: String, count: String },
    #[error("--fake-gpus: unknown option {option:?} in {item:?}; known options: mig, nvswitch, nvlink-pairs")]
    UnknownOption { item: String, option: String },
    #[error("--fake-gpus: {item:?} asks for MIG mode, but profile {profile:?} has no MIG (profiles with MIG: {known})")]
    NoMig {
        item: String,
        profile: String,
        known: String,
    },
    #[error("--fake-gpus: {item:?} names two NVLink layouts; pick one of nvswitch, nvlink-pairs")]
    TwoLayouts { item: String },
    #[error("--fake-gpus: empty list; expected e.g. a100-40gb:2,v100-32gb:1")]
    Empty,
}

/// How the cards of one `--fake-gpus` entry are joined by NVLink.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FakeLayout {
    /// PCIe only.
    None,
    /// Every card of the entry on one NVSwitch fabric (an HGX board).
    NvSwitch,
    /// Cards bridged two by two (0-1, 2-3, ...); an odd last card has no partner.
    Pairs,
}

/// One entry of `--fake-gpus`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FakeGroup {
    pub profile: &'static Profile,
    pub count: u32,
    /// MIG mode on at start.
    pub mig_enabled: bool,
    pub layout: FakeLayout,
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

fn mig_profiles() -> String {
    PROFILES
        .iter()
        .filter(|p| p.mig.is_some())
        .map(|p| p.key)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Parses `a100-40gb:2+mig,v100-32gb:1` (a missing count means 1) into groups in order.
pub fn parse_fake_gpus(spec: &str) -> Result<Vec<FakeGroup>, FakeGpuError> {
    let mut out = Vec::new();
    for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let mut parts = item.split('+').map(str::trim);
        let head = parts.next().unwrap_or_default();
        let (name, count) = match head.split_once(':') {
            Some((name, count)) => (name.trim(), Some(count.trim())),
            None => (head, None),
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
        let mut group = FakeGroup {
            profile,
            count,
            mig_enabled: false,
            layout: FakeLayout::None,
        };
        for option in parts {
            let layout = match option.to_ascii_lowercase().as_str() {
                "mig" if profile.mig.is_none() => {
                    return Err(FakeGpuError::NoMig {
                        item: item.to_string(),
                        profile: name,
                        known: mig_profiles(),
                    })
                }
                "mig" => {
                    group.mig_enabled = true;
                    continue;
                }
                "nvswitch" => FakeLayout::NvSwitch,
                "nvlink-pairs" => FakeLayout::Pairs,
                _ => {
                    return Err(FakeGpuError::UnknownOption {
                        item: item.to_string(),
                        option: option.to_string(),
                    })
                }
            };
            if group.layout != FakeLayout::None {
                return Err(FakeGpuError::TwoLayouts {
                    item: item.to_string(),
                });
            }
            group.layout = layout;
        }
        out.push(group);
    }
    if out.is_empty() {
        return Err(FakeGpuError::Empty);
    }
    Ok(out)
}

/// A stable GPU UUID for fake GPU `index` on `node_name`, in NVML's `GPU-8-4-4-4-12` form,
/// so that a restarted driver publishes the same devices.
pub fn fake_uuid(node_name: &str, index: u32) -> String {
    uuid_form("GPU", &format!("gpupool-fake-gpu/{node_name}/{index}"))
}

/// `<prefix>-8-4-4-4-12` hex from a digest of `seed`.
pub fn uuid_form(prefix: &str, seed: &str) -> String {
    let digest = Sha256::digest(seed.as_bytes());
    let hex = hex::encode(&digest[..16]);
    format!(
        "{prefix}-{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// The inventory a node with these fake cards would report: indices and minors 0.., one PCI bus
/// per card, MIG geometry where the model has it, NVLink domains from the entries' layouts.
pub fn fake_inventory(spec: &str, node_name: &str) -> Result<Inventory, FakeGpuError> {
    let mut gpus = Vec::new();
    let mut links = Vec::new();
    let mut index = 0u32;
    for (group_no, group) in parse_fake_gpus(spec)?.into_iter().enumerate() {
        let first = index;
        for _ in 0..group.count {
            let mut gpu = fake_gpu(group.profile, node_name, index);
            if let Some(mig) = &mut gpu.mig {
                mig.enabled = group.mig_enabled;
            }
            gpus.push(gpu);
            index += 1;
        }
        let members: Vec<&Gpu> = gpus[first as usize..].iter().collect();
        links.extend(fake_links(&members, group.layout, group_no));
    }
    let domains = nvlink_domains(&links);
    for gpu in &mut gpus {
        gpu.nvlink_domain = domains.get(&gpu.pci_bus_id).cloned();
    }
    Ok(Inventory {
        source: InventorySource::Fake,
        gpus,
    })
}

/// What NVML's link calls would report for a group of cards in `layout`: an NVSwitch board's
/// cards each reach the group's switches, bridged pairs reach each other.
fn fake_links(members: &[&Gpu], layout: FakeLayout, group_no: usize) -> Vec<GpuLinks> {
    members
        .iter()
        .enumerate()
        .map(|(i, gpu)| {
            let peers = match layout {
                FakeLayout::None => Vec::new(),
                // An HGX H100 board has four NVSwitches; each card has links to all of them.
                FakeLayout::NvSwitch => (0..4)
                    .map(|s| LinkPeer::Switch(format!("switch-{group_no}-{s}")))
                    .collect(),
                FakeLayout::Pairs => {
                    let partner = i ^ 1;
                    members
                        .get(partner)
                        .map(|p| vec![LinkPeer::Gpu(p.pci_bus_id.clone()); 4])
                        .unwrap_or_default()
                }
            };
            GpuLinks {
                bus_id: gpu.pci_bus_id.clone(),
                peers,
            }
        })
        .collect()
}

/// The MIG capability a card of this profile reports (mode off).
fn fake_mig(profile: &Profile) -> Option<Mig> {
    let fake = profile.mig?;
    let slices = fake
        .profiles
        .iter()
        .flat_map(|p| p.placements.iter().map(move |s| s + p.memory_slices))
        .max()
        .unwrap_or(1)
        .max(1);
    let per_slice_mib = profile.memory_mib / u64::from(slices);
    Some(Mig {
        enabled: false,
        switchable: fake.switchable,
        profiles: fake
            .profiles
            .iter()
            .map(|p| MigProfile {
                id: p.id,
                name: p.name.to_string(),
                // "3g.40gb": three compute slices.
                compute_slices: p
                    .name
                    .split_once('g')
                    .and_then(|(n, _)| n.parse().ok())
                    .unwrap_or(1),
                memory_slices: p.memory_slices,
                placements: p.placements.to_vec(),
                instances: p.instances,
                multiprocessors: p.multiprocessors,
                copy_engines: p.engines[0],
                decoders: p.engines[1],
                encoders: p.engines[2],
                jpeg_engines: p.engines[3],
                ofa_engines: p.engines[4],
                memory_bytes: p
                    .memory_mib
                    .unwrap_or(per_slice_mib * u64::from(p.memory_slices))
                    << 20,
            })
            .collect(),
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
        mig: fake_mig(profile),
        nvlink_domain: None,
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
        let keys: Vec<_> = parsed.iter().map(|g| (g.profile.key, g.count)).collect();
        assert_eq!(keys, vec![("a100-40gb", 2), ("v100-32gb", 1), ("t4", 1)]);
        assert!(parsed
            .iter()
            .all(|g| !g.mig_enabled && g.layout == FakeLayout::None));
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

    #[test]
    fn options_set_mig_mode_and_the_nvlink_layout() {
        let groups = parse_fake_gpus("a100-40gb:2+mig+nvlink-pairs,h100-80gb:8+nvswitch").unwrap();
        assert_eq!(
            groups
                .iter()
                .map(|g| (g.profile.key, g.count, g.mig_enabled, g.layout))
                .collect::<Vec<_>>(),
            vec![
                ("a100-40gb", 2, true, FakeLayout::Pairs),
                ("h100-80gb", 8, false, FakeLayout::NvSwitch)
            ]
        );
    }

    #[test]
    fn bad_options_name_the_entry_and_what_is_known() {
        let err = parse_fake_gpus("v100-32gb:2+mig").unwrap_err();
        assert!(matches!(err, FakeGpuError::NoMig { .. }));
        let text = err.to_string();
        assert!(
            text.contains("\"v100-32gb:2+mig\"") && text.contains("h100-80gb"),
            "{text}"
        );
        let err = parse_fake_gpus("t4+nvlink").unwrap_err().to_string();
        assert!(
            err.contains("\"nvlink\"") && err.contains("nvlink-pairs"),
            "{err}"
        );
        assert!(matches!(
            parse_fake_gpus("h100-80gb:2+nvswitch+nvlink-pairs"),
            Err(FakeGpuError::TwoLayouts { .. })
        ));
    }

    #[test]
    fn mig_cards_carry_the_geometry_of_the_real_ones() {
        let inv = fake_inventory("a100-40gb:1+mig,h100-80gb:1,h200:1,v100-32gb:1", "n").unwrap();
        let a100 = inv.gpus[0].mig.as_ref().unwrap();
        assert!(a100.enabled && !a100.switchable);
        assert_eq!(a100.memory_slices(), 8);
        let one_g = a100.profile(19).unwrap();
        assert_eq!(
            (
                one_g.name.as_str(),
                one_g.placements.len(),
                one_g.memory_bytes
            ),
            ("1g.5gb", 7, 4864 << 20)
        );
        assert_eq!(a100.profile(15).unwrap().placements, [0, 2, 4, 6]);
        assert_eq!(a100.profile(9).unwrap().placements, [0, 4]);
        assert_eq!(a100.profile(20).unwrap().instances, 1, "one +me at most");
        let h100 = inv.gpus[1].mig.as_ref().unwrap();
        assert!(!h100.enabled && h100.switchable);
        let sms: Vec<(&str, u32)> = h100
            .profiles
            .iter()
            .filter(|p| p.id != 20)
            .map(|p| (p.name.as_str(), p.multiprocessors))
            .collect();
        assert_eq!(
            sms,
            [
                ("1g.10gb", 16),
                ("1g.20gb", 26),
                ("2g.20gb", 32),
                ("3g.40gb", 60),
                ("4g.40gb", 64),
                ("7g.80gb", 132)
            ]
        );
        let h200 = inv.gpus[2].mig.as_ref().unwrap();
        assert_eq!(h200.profile(0).unwrap().name, "7g.141gb");
        assert!(inv.gpus[3].mig.is_none());
        // No instance of a profile takes more memory than its share of the card.
        for gpu in &inv.gpus {
            for p in gpu.mig.iter().flat_map(|m| &m.profiles) {
                assert!(
                    p.memory_bytes * 8 <= gpu.memory_bytes * u64::from(p.memory_slices),
                    "{} {}",
                    gpu.model,
                    p.name
                );
            }
        }
    }

    #[test]
    fn an_nvswitch_board_is_one_domain_and_bridged_pairs_are_one_each() {
        let inv =
            fake_inventory("h100-80gb:8+nvswitch,a100-40gb:3+nvlink-pairs,t4:1", "n").unwrap();
        let domains: Vec<Option<&str>> = inv
            .gpus
            .iter()
            .map(|g| g.nvlink_domain.as_deref())
            .collect();
        let board = domains[0].expect("the board has a domain");
        assert!(
            domains[..8].iter().all(|d| *d == Some(board)),
            "{domains:?}"
        );
        let pair = domains[8].expect("a pair has a domain");
        assert_eq!(domains[9], Some(pair));
        assert_ne!(pair, board);
        assert_eq!(domains[10], None, "the odd card out has no partner");
        assert_eq!(domains[11], None, "PCIe only");
    }
}

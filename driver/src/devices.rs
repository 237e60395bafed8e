//! The devices one node offers, from its inventory (pure): each GPU is `gpu-<i>` (a whole card,
//! shareable in fractions) and, where the card has MIG, one device per MIG profile and placement,
//! `gpu-<i>-mig-<profile>-<start>`. A card with MIG devices gets one counter set (its memory
//! slices, SMs, engines and memory); each MIG device consumes its placement's slices and its
//! profile's share of the rest, and `gpu-<i>` consumes all of it, so the scheduler never puts a MIG
//! device and a whole card or fraction on the same GPU, nor two MIG devices on one memory slice
//! (docs/architecture.md, "Device model"). Every figure comes from the inventory.

use std::collections::BTreeMap;

use gpupool_api::inventory::{Gpu, Inventory, MigProfile};
use gpupool_api::names::{counter, counter_set_name, device_name, mig_device_name};
use gpupool_api::quantity::format_bytes;
use k8s_openapi::api::resource::v1::{Counter, CounterSet, DeviceCounterConsumption};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

/// What a device of the node is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind<'a> {
    /// The whole card: one claim takes it all, or several take fractions.
    Card,
    /// A MIG partition at one placement.
    Mig {
        profile: &'a MigProfile,
        /// First memory slice.
        start: u32,
    },
}

/// One device of the node and the card it belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeDevice<'a> {
    pub name: String,
    pub gpu: &'a Gpu,
    pub kind: DeviceKind<'a>,
}

impl NodeDevice<'_> {
    pub fn is_mig(&self) -> bool {
        matches!(self.kind, DeviceKind::Mig { .. })
    }

    /// The memory slices a MIG device occupies, `start..end`; none for a whole card.
    pub fn memory_slices(&self) -> Option<std::ops::Range<u32>> {
        match self.kind {
            DeviceKind::Mig { profile, start } => Some(start..start + profile.memory_slices),
            DeviceKind::Card => None,
        }
    }
}

/// Whether the node offers MIG devices at all: the API server keeps counter sets
/// (partitionable devices). Without, a MIG device's overlap with others could not be expressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Partitioning {
    /// Counter sets and MIG devices (Kubernetes >= 1.35 with DRAPartitionableDevices).
    Counters,
    /// Whole cards only: the API server drops counters.
    WholeCardsOnly,
}

/// The devices of one GPU, `gpu-<i>` first, then its MIG devices by profile (as NVML lists
/// them) and placement. A card whose MIG mode needs a reset to change (Ampere) offers what its
/// current mode allows: `gpu-<i>` with MIG off, MIG devices with MIG on. One that switches at
/// run time (Hopper and newer) offers both, and prepare switches the mode.
pub fn devices_of(gpu: &Gpu, partitioning: Partitioning) -> Vec<NodeDevice<'_>> {
    let card = || NodeDevice {
        name: device_name(gpu.index),
        gpu,
        kind: DeviceKind::Card,
    };
    let Some(mig) = &gpu.mig else {
        return vec![card()];
    };
    let mut devices = Vec::new();
    if !mig.enabled || mig.switchable {
        devices.push(card());
    }
    if partitioning == Partitioning::Counters && (mig.enabled || mig.switchable) {
        for profile in &mig.profiles {
            for &start in &profile.placements {
                devices.push(NodeDevice {
                    name: mig_device_name(gpu.index, &profile.name, start),
                    gpu,
                    kind: DeviceKind::Mig { profile, start },
                });
            }
        }
    }
    devices
}

/// Every device of the node, card by card.
pub fn node_devices(inventory: &Inventory, partitioning: Partitioning) -> Vec<NodeDevice<'_>> {
    inventory
        .gpus
        .iter()
        .flat_map(|g| devices_of(g, partitioning))
        .collect()
}

/// The device of this name, as a node with counter sets offers it: what a claim may name.
pub fn find<'a>(inventory: &'a Inventory, name: &str) -> Option<NodeDevice<'a>> {
    node_devices(inventory, Partitioning::Counters)
        .into_iter()
        .find(|d| d.name == name)
}

/// Whether the card offers MIG devices, and so has a counter set its devices consume.
pub fn has_mig_devices(gpu: &Gpu, partitioning: Partitioning) -> bool {
    devices_of(gpu, partitioning).iter().any(NodeDevice::is_mig)
}

fn quantity(value: impl ToString) -> Counter {
    Counter {
        value: Quantity(value.to_string()),
    }
}

/// The counters a card offers: each memory slice once, SMs and memory as the card reports them,
/// each engine kind as many as the profile using most of them at its largest instance count (one
/// `+me` instance takes the card's only JPEG and OFA engines, seven 1g instances take seven
/// decoders).
fn card_counters(gpu: &Gpu) -> BTreeMap<String, Counter> {
    let mut counters = BTreeMap::new();
    let Some(mig) = &gpu.mig else {
        return counters;
    };
    for k in 0..mig.memory_slices() {
        counters.insert(counter::memory_slice(k), quantity(1));
    }
    let most = |engines: fn(&MigProfile) -> u32| {
        mig.profiles
            .iter()
            .map(|p| engines(p) * p.instances.max(1))
            .max()
            .unwrap_or(0)
    };
    let sms = mig
        .profiles
        .iter()
        .map(|p| p.multiprocessors)
        .max()
        .unwrap_or(0)
        .max(gpu.multiprocessors);
    counters.insert(counter::MULTIPROCESSORS.into(), quantity(sms));
    for (name, count) in [
        (counter::COPY_ENGINES, most(|p| p.copy_engines)),
        (counter::DECODERS, most(|p| p.decoders)),
        (counter::ENCODERS, most(|p| p.encoders)),
        (counter::JPEG_ENGINES, most(|p| p.jpeg_engines)),
        (counter::OFA_ENGINES, most(|p| p.ofa_engines)),
    ] {
        counters.insert(name.into(), quantity(count));
    }
    counters.insert(
        counter::MEMORY.into(),
        Counter {
            value: Quantity(format_bytes(gpu.memory_bytes)),
        },
    );
    // A counter of zero (an engine the card lacks) constrains nothing: leave it out.
    counters.retain(|_, c| c.value.0 != "0");
    counters
}

/// The card's counter set, when it offers MIG devices.
pub fn counter_set(gpu: &Gpu, partitioning: Partitioning) -> Option<CounterSet> {
    has_mig_devices(gpu, partitioning).then(|| CounterSet {
        name: counter_set_name(gpu.index),
        counters: card_counters(gpu),
    })
}

/// What a device takes from its card's counter set: a MIG device its placement's memory slices
/// and its profile's SMs, engines and memory; `gpu-<i>` all of it. None on a card without MIG
/// devices.
pub fn consumption(
    device: &NodeDevice<'_>,
    partitioning: Partitioning,
) -> Option<DeviceCounterConsumption> {
    if !has_mig_devices(device.gpu, partitioning) {
        return None;
    }
    let all = card_counters(device.gpu);
    let counters = match device.kind {
        DeviceKind::Card => all,
        DeviceKind::Mig { profile, start } => {
            let mut taken = BTreeMap::new();
            for k in start..start + profile.memory_slices {
                taken.insert(counter::memory_slice(k), quantity(1));
            }
            for (name, count) in [
                (counter::MULTIPROCESSORS, profile.multiprocessors),
                (counter::COPY_ENGINES, profile.copy_engines),
                (counter::DECODERS, profile.decoders),
                (counter::ENCODERS, profile.encoders),
                (counter::JPEG_ENGINES, profile.jpeg_engines),
                (counter::OFA_ENGINES, profile.ofa_engines),
            ] {
                taken.insert(name.into(), quantity(count));
            }
            taken.insert(
                counter::MEMORY.into(),
                Counter {
                    value: Quantity(format_bytes(profile.memory_bytes)),
                },
            );
            // Only counters the card has: a reference to a missing one invalidates the pool.
            taken.retain(|name, c| c.value.0 != "0" && all.contains_key(name));
            taken
        }
    };
    Some(DeviceCounterConsumption {
        counter_set: counter_set_name(device.gpu.index),
        counters,
    })
}

/// The compute weight of a MIG device: its card's weight scaled by its share of the card's SMs,
/// rounded down (a partition never claims more compute than it has). The same arithmetic the
/// controller uses for ComputeProfiles.
pub fn mig_weight(card_weight: i64, card_sms: u32, profile_sms: u32) -> Option<i64> {
    if card_weight <= 0 || card_sms == 0 {
        return None;
    }
    let scaled = i128::from(card_weight) * i128::from(profile_sms) / i128::from(card_sms);
    i64::try_from(scaled).ok().filter(|w| *w > 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::fake::fake_inventory;

    fn names(devices: &[NodeDevice<'_>]) -> Vec<String> {
        devices.iter().map(|d| d.name.clone()).collect()
    }

    #[test]
    fn an_h100_offers_its_card_and_every_mig_placement() {
        let inv = fake_inventory("h100-80gb:1", "n").unwrap();
        let devices = devices_of(&inv.gpus[0], Partitioning::Counters);
        // 1g x7, 1g+me x7, 1g.20gb x4, 2g x3, 3g x2, 4g x1, 7g x1, and the card.
        assert_eq!(devices.len(), 26);
        assert_eq!(devices[0].name, "gpu-0");
        let all = names(&devices);
        for name in [
            "gpu-0-mig-1g-10gb-0",
            "gpu-0-mig-1g-10gb-6",
            "gpu-0-mig-1g-10gb-me-3",
            "gpu-0-mig-1g-20gb-6",
            "gpu-0-mig-3g-40gb-4",
            "gpu-0-mig-7g-80gb-0",
        ] {
            assert!(all.iter().any(|n| n == name), "{name} in {all:?}");
        }
        assert!(all.iter().all(|n| gpupool_api::validation::is_dns_label(n)));
    }

    #[test]
    fn ampere_offers_what_its_current_mode_allows() {
        let on = fake_inventory("a100-40gb:1+mig", "n").unwrap();
        let devices = devices_of(&on.gpus[0], Partitioning::Counters);
        assert!(
            devices.iter().all(NodeDevice::is_mig),
            "no gpu-0 with MIG on"
        );
        assert_eq!(devices.len(), 25);
        let off = fake_inventory("a100-40gb:1", "n").unwrap();
        assert_eq!(
            names(&devices_of(&off.gpus[0], Partitioning::Counters)),
            ["gpu-0"]
        );
        assert!(counter_set(&off.gpus[0], Partitioning::Counters).is_none());
    }

    #[test]
    fn without_counters_only_cards_that_can_run_whole_are_offered() {
        let inv = fake_inventory("a100-40gb:1+mig,h100-80gb:1,v100-32gb:1", "n").unwrap();
        assert_eq!(
            names(&node_devices(&inv, Partitioning::WholeCardsOnly)),
            ["gpu-1", "gpu-2"]
        );
        assert!(inv
            .gpus
            .iter()
            .all(|g| counter_set(g, Partitioning::WholeCardsOnly).is_none()));
    }

    #[test]
    fn the_card_consumes_its_whole_counter_set_and_a_mig_device_its_slices() {
        let inv = fake_inventory("h100-80gb:1", "n").unwrap();
        let gpu = &inv.gpus[0];
        let set = counter_set(gpu, Partitioning::Counters).unwrap();
        assert_eq!(set.name, "gpu-0-counters");
        assert_eq!(set.counters["memory-slice-7"].value.0, "1");
        assert_eq!(set.counters["multiprocessors"].value.0, "132");
        assert_eq!(set.counters["ofa-engines"].value.0, "1");
        assert_eq!(set.counters["decoders"].value.0, "7");
        assert_eq!(set.counters["memory"].value.0, "81559Mi");
        assert!(
            !set.counters.contains_key("encoders"),
            "zero counters are left out"
        );
        for name in set.counters.keys() {
            assert!(gpupool_api::validation::is_dns_label(name), "{name}");
        }

        let devices = devices_of(gpu, Partitioning::Counters);
        let card = consumption(&devices[0], Partitioning::Counters).unwrap();
        assert_eq!(card.counter_set, "gpu-0-counters");
        assert_eq!(card.counters, set.counters);
        let three_g = devices
            .iter()
            .find(|d| d.name == "gpu-0-mig-3g-40gb-4")
            .unwrap();
        let taken = consumption(three_g, Partitioning::Counters)
            .unwrap()
            .counters;
        let slices: Vec<&str> = taken
            .keys()
            .filter(|k| k.starts_with("memory-slice-"))
            .map(String::as_str)
            .collect();
        assert_eq!(
            slices,
            [
                "memory-slice-4",
                "memory-slice-5",
                "memory-slice-6",
                "memory-slice-7"
            ]
        );
        assert_eq!(taken["multiprocessors"].value.0, "60");
        assert!(!taken.contains_key("ofa-engines"));
        // Every counter consumed exists in the set.
        for d in &devices {
            for name in consumption(d, Partitioning::Counters)
                .unwrap()
                .counters
                .keys()
            {
                assert!(set.counters.contains_key(name), "{}: {name}", d.name);
            }
        }
    }

    #[test]
    fn seven_small_instances_fit_the_counters_and_the_me_profile_only_once() {
        for spec in ["a100-40gb:1+mig", "h100-80gb:1", "h200:1"] {
            let inv = fake_inventory(spec, "n").unwrap();
            let gpu = &inv.gpus[0];
            let set = counter_set(gpu, Partitioning::Counters).unwrap().counters;
            let devices = devices_of(gpu, Partitioning::Counters);
            let value = |c: &Counter| gpupool_api::quantity::parse(&c.value.0).unwrap().0;
            let sum = |picked: &[&NodeDevice<'_>]| {
                let mut total: BTreeMap<String, i128> = BTreeMap::new();
                for d in picked {
                    for (k, c) in consumption(d, Partitioning::Counters).unwrap().counters {
                        *total.entry(k).or_default() += value(&c);
                    }
                }
                total
            };
            let fits =
                |picked: &[&NodeDevice<'_>]| sum(picked).iter().all(|(k, v)| *v <= value(&set[k]));
            let smallest: Vec<&NodeDevice<'_>> = devices
                .iter()
                .filter(|d| matches!(d.kind, DeviceKind::Mig { profile, .. } if profile.id == 19))
                .collect();
            assert_eq!(smallest.len(), 7, "{spec}");
            assert!(fits(&smallest), "{spec}: seven 1g instances fit");
            let me: Vec<&NodeDevice<'_>> = devices
                .iter()
                .filter(|d| matches!(d.kind, DeviceKind::Mig { profile, .. } if profile.id == 20))
                .take(2)
                .collect();
            assert!(fits(&me[..1]), "{spec}");
            assert!(!fits(&me), "{spec}: a second +me instance does not fit");
        }
    }

    #[test]
    fn names_resolve_to_their_card_profile_and_placement() {
        let inv = fake_inventory("v100-32gb:1,h100-80gb:1", "n").unwrap();
        let d = find(&inv, "gpu-1-mig-2g-20gb-4").unwrap();
        assert_eq!(d.gpu.index, 1);
        assert_eq!(d.memory_slices(), Some(4..6));
        assert!(matches!(d.kind, DeviceKind::Mig { profile, start: 4 } if profile.id == 14));
        assert_eq!(find(&inv, "gpu-0").map(|d| d.kind), Some(DeviceKind::Card));
        assert!(
            find(&inv, "gpu-1-mig-2g-20gb-5").is_none(),
            "not a placement"
        );
        assert!(
            find(&inv, "gpu-0-mig-1g-10gb-0").is_none(),
            "a V100 has no MIG"
        );
    }

    #[test]
    fn a_mig_weight_is_the_card_weight_scaled_by_its_sms() {
        assert_eq!(mig_weight(989, 132, 16), Some(119));
        assert_eq!(mig_weight(989, 132, 132), Some(989));
        assert_eq!(mig_weight(312, 108, 14), Some(40));
        assert_eq!(mig_weight(0, 132, 16), None);
        assert_eq!(mig_weight(10, 132, 1), None, "rounds down to nothing");
    }
}

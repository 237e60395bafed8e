//! Partitionable devices (KEP-4815): counter sets a pool offers and what each device consumes
//! from them, as the incubating allocator of kube-scheduler 1.36.2 counts them. An exclusive
//! device is charged when it is allocated; a shareable one (allowMultipleAllocations) once, with
//! its first share, and later shares skip the check; the counters come back with the last share.
//! So a card whose device consumes all of its counters and a MIG device carved from it exclude
//! each other whatever their shares.

use std::collections::{BTreeMap, HashMap};

use gpupool_api::quantity::{self, format_milli, Milli};
use k8s_openapi::api::resource::v1::{CounterSet, Device};

/// Counters of one counter set of one pool, by counter name.
pub type Counters = BTreeMap<String, Milli>;

/// Amounts per (pool index, counter set).
pub type Ledger = HashMap<(usize, String), Counters>;

/// What a pool's counter sets offer.
pub fn offered<'a>(
    pool: usize,
    sets: impl IntoIterator<Item = &'a CounterSet>,
    ledger: &mut Ledger,
) {
    for set in sets {
        let counters = set
            .counters
            .iter()
            // A value that does not parse was written by someone else; it offers nothing.
            .map(|(name, c)| {
                (
                    name.clone(),
                    quantity::parse(&c.value.0).unwrap_or(Milli(0)),
                )
            })
            .collect();
        ledger.insert((pool, set.name.clone()), counters);
    }
}

/// What a device takes from its pool's counter sets.
pub fn consumption(device: &Device) -> Vec<(String, Counters)> {
    device
        .consumes_counters
        .iter()
        .flatten()
        .map(|c| {
            let counters = c
                .counters
                .iter()
                .map(|(name, v)| {
                    (
                        name.clone(),
                        quantity::parse(&v.value.0).unwrap_or(Milli(0)),
                    )
                })
                .collect();
            (c.counter_set.clone(), counters)
        })
        .collect()
}

/// Add what `device` consumes to `used`.
pub fn charge(used: &mut Ledger, pool: usize, device: &Device) {
    for (set, counters) in consumption(device) {
        let entry = used.entry((pool, set)).or_default();
        for (name, amount) in counters {
            let total = entry.entry(name).or_insert(Milli(0));
            total.0 += amount.0;
        }
    }
}

/// Whether `device` still fits its pool's counters next to `used`; else which counter is short.
pub fn check(device: &Device, pool: usize, offered: &Ledger, used: &Ledger) -> Result<(), String> {
    for (set, counters) in consumption(device) {
        let key = (pool, set.clone());
        let available = offered.get(&key);
        for (name, amount) in counters {
            let have = available
                .and_then(|a| a.get(&name))
                .copied()
                .unwrap_or(Milli(0));
            let taken = used
                .get(&key)
                .and_then(|u| u.get(&name))
                .copied()
                .unwrap_or(Milli(0));
            if taken.0 + amount.0 > have.0 {
                return Err(format!(
                    "insufficient counters for {}: {set}/{name} needs {}, {} of {} left",
                    device.name,
                    format_milli(amount),
                    format_milli(Milli((have.0 - taken.0).max(0))),
                    format_milli(have),
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::resource::v1::{Counter, DeviceCounterConsumption};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    fn counters(pairs: &[(&str, &str)]) -> BTreeMap<String, Counter> {
        pairs
            .iter()
            .map(|(n, v)| {
                (
                    n.to_string(),
                    Counter {
                        value: Quantity(v.to_string()),
                    },
                )
            })
            .collect()
    }

    fn consuming(name: &str, pairs: &[(&str, &str)]) -> Device {
        Device {
            name: name.into(),
            consumes_counters: Some(vec![DeviceCounterConsumption {
                counter_set: "gpu-0-counters".into(),
                counters: counters(pairs),
            }]),
            ..Default::default()
        }
    }

    #[test]
    fn charges_add_up_until_a_counter_is_short() {
        let mut offer = Ledger::new();
        offered(
            0,
            [&CounterSet {
                name: "gpu-0-counters".into(),
                counters: counters(&[("memory-slice-0", "1"), ("multiprocessors", "132")]),
            }],
            &mut offer,
        );
        let small = consuming(
            "mig-a",
            &[("memory-slice-0", "1"), ("multiprocessors", "16")],
        );
        let mut used = Ledger::new();
        assert_eq!(check(&small, 0, &offer, &used), Ok(()));
        charge(&mut used, 0, &small);
        let again = check(&small, 0, &offer, &used).unwrap_err();
        assert_eq!(
            again,
            "insufficient counters for mig-a: gpu-0-counters/memory-slice-0 needs 1, 0 of 1 left"
        );
        let other_pool = check(&small, 1, &offer, &used).unwrap_err();
        assert!(other_pool.contains("0 of 0 left"), "{other_pool}");
    }
}

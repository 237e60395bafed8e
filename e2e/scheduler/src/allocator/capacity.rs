//! Consumable capacity (KEP-5075): how much of each capacity of a shared device one request
//! consumes, and whether that still fits next to the shares already allocated.
//!
//! Mirrors kube-scheduler: an absent request takes the policy default (or the whole value);
//! a request is rounded up from `validRange.min` in `step`s (below min becomes min) or to the
//! smallest of `validValues` at or above it; a result above `max`, off the steps or not among
//! the valid values is refused unless it equals the default.

use std::collections::BTreeMap;

use gpupool_api::quantity::{self, format_bytes, format_milli, Milli, QuantityError};
use k8s_openapi::api::resource::v1::{CapacityRequestPolicy, Device, DeviceCapacity};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq)]
pub enum CapacityError {
    #[error("{device} has no capacity {name}")]
    Missing { device: String, name: String },
    #[error("{name} {requested} on {device} is outside its request policy ({rule})")]
    Policy {
        device: String,
        name: String,
        requested: String,
        rule: String,
    },
    #[error("insufficient {name} on {device}: requested {requested}, available {available}")]
    Insufficient {
        device: String,
        name: String,
        requested: String,
        available: String,
    },
    #[error("capacity {name} of {device}: {message}")]
    Quantity {
        device: String,
        name: String,
        message: String,
    },
}

/// Amounts already consumed on one device, per capacity name.
pub type Consumed = BTreeMap<String, Milli>;

fn parse(device: &Device, name: &str, q: &Quantity) -> Result<Milli, CapacityError> {
    quantity::parse(&q.0).map_err(|e| CapacityError::Quantity {
        device: device.name.clone(),
        name: name.to_string(),
        message: e.to_string(),
    })
}

/// Kubernetes' `Quantity.Value()`: whole units, rounded up.
fn units(m: Milli) -> i128 {
    m.ceil_units()
}

/// What one request consumes of every capacity of a shared device (all capacities are
/// recorded, even those not asked for).
pub fn consumption(
    device: &Device,
    requests: Option<&BTreeMap<String, Quantity>>,
) -> Result<BTreeMap<String, Quantity>, CapacityError> {
    let capacities = device.capacity.clone().unwrap_or_default();
    if let Some(name) = requests
        .into_iter()
        .flatten()
        .map(|(name, _)| name)
        .find(|name| !capacities.contains_key(*name))
    {
        return Err(CapacityError::Missing {
            device: device.name.clone(),
            name: name.clone(),
        });
    }
    let mut result = BTreeMap::new();
    for (name, cap) in &capacities {
        let requested = requests.and_then(|r| r.get(name));
        let consumed = consumed_amount(device, name, requested, cap)?;
        if let Some(rule) = violated_rule(device, name, &consumed, cap.request_policy.as_ref())? {
            return Err(CapacityError::Policy {
                device: device.name.clone(),
                name: name.clone(),
                requested: requested.map_or_else(|| consumed.0.clone(), |q| q.0.clone()),
                rule,
            });
        }
        result.insert(name.clone(), consumed);
    }
    Ok(result)
}

fn consumed_amount(
    device: &Device,
    name: &str,
    requested: Option<&Quantity>,
    cap: &DeviceCapacity,
) -> Result<Quantity, CapacityError> {
    let policy = cap.request_policy.as_ref();
    let Some(requested) = requested else {
        return Ok(policy
            .and_then(|p| p.default.clone())
            .unwrap_or_else(|| cap.value.clone()));
    };
    let Some(policy) = policy else {
        return Ok(requested.clone());
    };
    let want = parse(device, name, requested)?;
    if let Some(range) = &policy.valid_range {
        let min = parse(device, name, &range.min)?;
        if want < min {
            return Ok(range.min.clone());
        }
        let Some(step) = &range.step else {
            return Ok(requested.clone());
        };
        let step = units(parse(device, name, step)?).max(1);
        let added = units(want) - units(min);
        let steps = added / step + i128::from(added % step != 0);
        let value = units(min) + step * steps;
        return Ok(Quantity(format_bytes(u64::try_from(value).unwrap_or(0))));
    }
    if let Some(values) = &policy.valid_values {
        for value in values {
            if want <= parse(device, name, value)? {
                return Ok(value.clone());
            }
        }
    }
    Ok(requested.clone())
}

fn violated_rule(
    device: &Device,
    name: &str,
    consumed: &Quantity,
    policy: Option<&CapacityRequestPolicy>,
) -> Result<Option<String>, CapacityError> {
    let Some(policy) = policy else {
        return Ok(None);
    };
    let amount = parse(device, name, consumed)?;
    if let Some(default) = &policy.default {
        if parse(device, name, default)? == amount {
            return Ok(None);
        }
    }
    if let Some(range) = &policy.valid_range {
        if let Some(max) = &range.max {
            if amount > parse(device, name, max)? {
                return Ok(Some(format!("maximum {}", max.0)));
            }
        }
        if let Some(step) = &range.step {
            let step_units = units(parse(device, name, step)?).max(1);
            let min = parse(device, name, &range.min)?;
            if (units(amount) - units(min)) % step_units != 0 {
                return Ok(Some(format!("step {} from {}", step.0, range.min.0)));
            }
        }
        return Ok(None);
    }
    if let Some(values) = policy.valid_values.as_ref().filter(|v| !v.is_empty()) {
        for value in values {
            if parse(device, name, value)? == amount {
                return Ok(None);
            }
        }
        let list: Vec<&str> = values.iter().map(|v| v.0.as_str()).collect();
        return Ok(Some(format!("valid values {}", list.join(", "))));
    }
    Ok(None)
}

/// Whether `consumption` still fits on the device next to what `used` already holds.
pub fn check_fits(
    device: &Device,
    consumption: &BTreeMap<String, Quantity>,
    used: &Consumed,
) -> Result<(), CapacityError> {
    for (name, cap) in device.capacity.iter().flatten() {
        let Some(amount) = consumption.get(name) else {
            continue;
        };
        let value = parse(device, name, &cap.value)?;
        let want = parse(device, name, amount)?;
        let already = used.get(name).copied().unwrap_or(Milli(0));
        if Milli(already.0 + want.0) > value {
            return Err(CapacityError::Insufficient {
                device: device.name.clone(),
                name: name.clone(),
                requested: display(want, &cap.value),
                available: display(Milli((value.0 - already.0).max(0)), &cap.value),
            });
        }
    }
    Ok(())
}

/// On a device that cannot be shared, capacity requests are a minimum the device must offer.
pub fn check_exclusive(
    device: &Device,
    requests: Option<&BTreeMap<String, Quantity>>,
) -> Result<(), CapacityError> {
    for (name, requested) in requests.into_iter().flatten() {
        let Some(cap) = device.capacity.as_ref().and_then(|c| c.get(name)) else {
            return Err(CapacityError::Missing {
                device: device.name.clone(),
                name: name.clone(),
            });
        };
        let want = parse(device, name, requested)?;
        let value = parse(device, name, &cap.value)?;
        if want > value {
            return Err(CapacityError::Insufficient {
                device: device.name.clone(),
                name: name.clone(),
                requested: display(want, &cap.value),
                available: display(value, &cap.value),
            });
        }
    }
    Ok(())
}

/// Add `consumption` to the running totals of a device.
pub fn add(
    used: &mut Consumed,
    consumption: &BTreeMap<String, Quantity>,
) -> Result<(), QuantityError> {
    for (name, amount) in consumption {
        let m = quantity::parse(&amount.0)?;
        used.entry(name.clone()).or_insert(Milli(0)).0 += m.0;
    }
    Ok(())
}

/// An amount printed the way the capacity's own value is written (binary bytes or decimal).
fn display(amount: Milli, like: &Quantity) -> String {
    let binary = ["Ki", "Mi", "Gi", "Ti", "Pi", "Ei"]
        .iter()
        .any(|suffix| like.0.ends_with(suffix));
    if binary && amount.0 >= 0 && amount.0 % 1000 == 0 {
        format_bytes((amount.0 / 1000) as u64)
    } else {
        format_milli(amount)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{self, q, with_valid_values};

    /// gpu-0 as gpupool publishes it, with `slots` that take one of a few values too.
    fn gpu(memory: &str) -> Device {
        let mut device = fixtures::gpu(0, "A100-SXM4-40GB", memory);
        device.capacity.get_or_insert_with(Default::default).insert(
            "slots".to_string(),
            with_valid_values("64", "4", &["4", "16", "32"]),
        );
        device
    }

    fn ask(pairs: &[(&str, &str)]) -> BTreeMap<String, Quantity> {
        pairs.iter().map(|(k, v)| (k.to_string(), q(v))).collect()
    }

    fn consumed(pairs: &[(&str, &str)]) -> Result<BTreeMap<String, String>, CapacityError> {
        consumption(&gpu("40Gi"), Some(&ask(pairs)))
            .map(|m| m.into_iter().map(|(k, v)| (k, v.0)).collect())
    }

    #[test]
    fn requests_round_up_to_the_step() {
        let c = consumed(&[("memory", "1500M"), ("cores", "500m")]).unwrap();
        assert_eq!(c["memory"], "1431Mi");
        assert_eq!(c["cores"], "1");
    }

    #[test]
    fn a_request_below_min_becomes_min() {
        assert_eq!(consumed(&[("memory", "1k")]).unwrap()["memory"], "1Mi");
    }

    #[test]
    fn a_request_takes_the_smallest_valid_value_at_or_above_it() {
        assert_eq!(consumed(&[("slots", "5")]).unwrap()["slots"], "16");
        assert_eq!(consumed(&[("slots", "32")]).unwrap()["slots"], "32");
        let err = consumed(&[("slots", "33")]).unwrap_err();
        assert!(
            matches!(err, CapacityError::Policy { ref name, .. } if name == "slots"),
            "{err}"
        );
    }

    #[test]
    fn a_request_above_max_is_refused() {
        let err = consumed(&[("cores", "101")]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "cores 101 on gpu-0 is outside its request policy (maximum 100)"
        );
    }

    #[test]
    fn unrequested_capacities_take_their_default() {
        let c = consumed(&[]).unwrap();
        assert_eq!(c["memory"], "40Gi");
        assert_eq!(c["cores"], "0");
        assert_eq!(c["slots"], "4");
    }

    #[test]
    fn asking_for_a_capacity_the_device_lacks_is_refused() {
        let err = consumed(&[("bandwidth", "1")]).unwrap_err();
        assert_eq!(err.to_string(), "gpu-0 has no capacity bandwidth");
    }

    #[test]
    fn fits_counts_what_is_already_used() {
        let device = gpu("40Gi");
        let want = consumption(&device, Some(&ask(&[("memory", "16Gi")]))).unwrap();
        let mut used = Consumed::new();
        add(&mut used, &ask(&[("memory", "32Gi"), ("cores", "10")])).unwrap();
        let err = check_fits(&device, &want, &used).unwrap_err();
        assert_eq!(
            err.to_string(),
            "insufficient memory on gpu-0: requested 16Gi, available 8Gi"
        );
        add(&mut used, &ask(&[("memory", "-24Gi")])).unwrap();
        assert_eq!(check_fits(&device, &want, &used), Ok(()));
    }
}

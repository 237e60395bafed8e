//! Checks a ResourceSlice against the upstream limits of `resource.k8s.io/v1` (docs/architecture.md, "Upstream limits on a slice"), so the driver
//! can refuse to send what a real API server would reject, and the emulator rejects it the same way.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CounterSet, Device, DeviceAttribute, DeviceCapacity,
    DeviceCounterConsumption, ResourceSlice,
};

use crate::quantity::{self, Milli};

/// Devices per slice, and the lower limit when any device uses taints or counters.
pub const MAX_DEVICES_PER_SLICE: usize = 128;
pub const MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS: usize = 64;
pub const MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE: usize = 32;
pub const MAX_TAINTS_PER_DEVICE: usize = 16;
pub const MAX_IDENTIFIER_LENGTH: usize = 32;
pub const MAX_DOMAIN_LENGTH: usize = 63;
pub const MAX_ATTRIBUTE_VALUE_LENGTH: usize = 64;
pub const MAX_DRIVER_NAME_LENGTH: usize = 63;
pub const MAX_POOL_NAME_LENGTH: usize = 253;
pub const MAX_VALID_VALUES: usize = 10;
/// Partitionable devices (resource.k8s.io/v1, 1.36): counter sets per slice, counters per set,
/// counter consumptions per device and counters per consumption.
pub const MAX_COUNTER_SETS_PER_SLICE: usize = 8;
pub const MAX_COUNTERS_PER_COUNTER_SET: usize = 32;
pub const MAX_COUNTER_CONSUMPTIONS_PER_DEVICE: usize = 2;
pub const MAX_COUNTERS_PER_CONSUMPTION: usize = 32;

/// One violation, named by its field path as the API server names it (e.g. `spec.devices[3].attributes`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    pub field: String,
    pub message: String,
}

impl std::fmt::Display for FieldError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

#[derive(Default)]
struct Errors(Vec<FieldError>);

impl Errors {
    fn push(&mut self, field: impl Into<String>, message: impl Into<String>) {
        self.0.push(FieldError {
            field: field.into(),
            message: message.into(),
        });
    }

    fn too_many(&mut self, field: impl Into<String>, actual: usize, max: usize) {
        self.push(
            field,
            format!("Too many: {actual}: must have at most {max} items"),
        );
    }

    fn too_long(&mut self, field: impl Into<String>, max: usize) {
        self.push(field, format!("Too long: may not be more than {max} bytes"));
    }
}

/// A UUID in its canonical textual form (what Kubernetes generates for metadata.uid).
pub fn is_uuid(s: &str) -> bool {
    s.len() == 36
        && s.char_indices().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => c == '-',
            _ => c.is_ascii_hexdigit(),
        })
}

/// An RFC 1123 DNS label, as Kubernetes checks namespace and device names.
pub fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// An RFC 1123 DNS subdomain, as Kubernetes checks object and driver names.
pub fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(is_dns_label)
}

fn is_c_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Semantic Versioning 2.0.0, without a leading "v".
pub fn is_semver(s: &str) -> bool {
    let (rest, build) = match s.split_once('+') {
        Some((r, b)) => (r, Some(b)),
        None => (s, None),
    };
    let (core, pre) = match rest.split_once('-') {
        Some((c, p)) => (c, Some(p)),
        None => (rest, None),
    };
    let numeric = |p: &str| {
        !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) && (p == "0" || !p.starts_with('0'))
    };
    let ident =
        |p: &str| !p.is_empty() && p.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    let parts: Vec<&str> = core.split('.').collect();
    parts.len() == 3
        && parts.iter().all(|p| numeric(p))
        && pre.is_none_or(|p| {
            p.split('.')
                .all(|id| ident(id) && (!id.bytes().all(|b| b.is_ascii_digit()) || numeric(id)))
        })
        && build.is_none_or(|b| b.split('.').all(ident))
}

const C_IDENTIFIER_RULE: &str = "a valid C identifier must start with alphabetic character or '_', followed by a string of alphanumeric characters or '_' (e.g. 'my_name',  or 'MY_NAME',  or 'MyName', regex used for validation is '[A-Za-z_][A-Za-z0-9_]*')";
const DNS_SUBDOMAIN_RULE: &str = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')";
const DNS_LABEL_RULE: &str = "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')";

/// An attribute or capacity name: a C identifier of at most 32 characters, optionally prefixed by a
/// DNS subdomain of at most 63 characters and a slash.
fn validate_qualified_name(name: &str, field: &str, errors: &mut Errors) {
    let (domain, id) = match name.split_once('/') {
        Some((d, i)) => (Some(d), i),
        None => (None, name),
    };
    if let Some(domain) = domain {
        if domain.len() > MAX_DOMAIN_LENGTH {
            errors.too_long(field, MAX_DOMAIN_LENGTH);
        } else if !is_dns_subdomain(domain) {
            errors.push(
                field,
                format!("Invalid value: {domain:?}: {DNS_SUBDOMAIN_RULE}"),
            );
        }
    }
    if id.is_empty() {
        errors.push(field, "Required value: name required");
    } else if id.len() > MAX_IDENTIFIER_LENGTH {
        errors.too_long(field, MAX_IDENTIFIER_LENGTH);
    } else if !is_c_identifier(id) {
        errors.push(field, format!("Invalid value: {id:?}: {C_IDENTIFIER_RULE}"));
    }
}

fn validate_attribute(attribute: &DeviceAttribute, field: &str, errors: &mut Errors) {
    let set = [
        attribute.bool.is_some(),
        attribute.int.is_some(),
        attribute.string.is_some(),
        attribute.version.is_some(),
    ]
    .iter()
    .filter(|s| **s)
    .count();
    match set {
        0 => errors.push(field, "Required value: exactly one value must be specified"),
        1 => {}
        _ => errors.push(field, "Invalid value: exactly one value must be specified"),
    }
    if let Some(s) = &attribute.string {
        if s.len() > MAX_ATTRIBUTE_VALUE_LENGTH {
            errors.too_long(format!("{field}.string"), MAX_ATTRIBUTE_VALUE_LENGTH);
        }
    }
    if let Some(v) = &attribute.version {
        if v.len() > MAX_ATTRIBUTE_VALUE_LENGTH {
            errors.too_long(format!("{field}.version"), MAX_ATTRIBUTE_VALUE_LENGTH);
        } else if !is_semver(v) {
            errors.push(
                format!("{field}.version"),
                format!(
                    "Invalid value: {v:?}: must be a string compatible with semver.org spec 2.0.0"
                ),
            );
        }
    }
}

fn parse_quantity(text: &str, field: &str, errors: &mut Errors) -> Option<Milli> {
    match quantity::parse(text) {
        Ok(q) => Some(q),
        Err(e) => {
            errors.push(field, format!("Invalid value: {text:?}: {}", e.reason));
            None
        }
    }
}

fn validate_request_policy(policy: &CapacityRequestPolicy, field: &str, errors: &mut Errors) {
    let default = policy
        .default
        .as_ref()
        .and_then(|d| parse_quantity(&d.0, &format!("{field}.default"), errors));
    if policy.valid_range.is_some() && policy.valid_values.is_some() {
        errors.push(
            field,
            "Forbidden: only one of validRange or validValues may be specified",
        );
    }
    if let Some(range) = &policy.valid_range {
        let range_field = format!("{field}.validRange");
        let min = parse_quantity(&range.min.0, &format!("{range_field}.min"), errors);
        let max = range
            .max
            .as_ref()
            .and_then(|m| parse_quantity(&m.0, &format!("{range_field}.max"), errors));
        let step = range
            .step
            .as_ref()
            .and_then(|s| parse_quantity(&s.0, &format!("{range_field}.step"), errors));
        if let Some(step) = step {
            if step.0 <= 0 {
                errors.push(
                    format!("{range_field}.step"),
                    format!(
                        "Invalid value: {:?}: must be positive",
                        range
                            .step
                            .as_ref()
                            .map(|s| s.0.as_str())
                            .unwrap_or_default()
                    ),
                );
            }
        }
        if let (Some(min), Some(max)) = (min, max) {
            if max < min {
                errors.push(
                    format!("{range_field}.max"),
                    format!(
                        "Invalid value: {:?}: must be greater than or equal to min",
                        range.max.as_ref().map(|m| m.0.as_str()).unwrap_or_default()
                    ),
                );
            }
        }
        let off_step = |value: Milli| match (min, step) {
            (Some(min), Some(step)) if step.0 > 0 => (value.0 - min.0) % step.0 != 0,
            _ => false,
        };
        if let Some(max) = max {
            if off_step(max) {
                errors.push(
                    format!("{range_field}.max"),
                    format!(
                        "Invalid value: {:?}: must be a multiple of step above min",
                        range.max.as_ref().map(|m| m.0.as_str()).unwrap_or_default()
                    ),
                );
            }
        }
        if let Some(default) = default {
            let default_text = policy
                .default
                .as_ref()
                .map(|d| d.0.as_str())
                .unwrap_or_default();
            if min.is_some_and(|min| default < min) || max.is_some_and(|max| default > max) {
                errors.push(
                    format!("{field}.default"),
                    format!("Invalid value: {default_text:?}: must be within validRange (min <= default <= max)"),
                );
            } else if off_step(default) {
                errors.push(
                    format!("{field}.default"),
                    format!(
                        "Invalid value: {default_text:?}: must be a multiple of step above min"
                    ),
                );
            }
        }
    }
    if let Some(values) = &policy.valid_values {
        let values_field = format!("{field}.validValues");
        if values.len() > MAX_VALID_VALUES {
            errors.too_many(&values_field, values.len(), MAX_VALID_VALUES);
        }
        let parsed: Vec<Option<Milli>> = values
            .iter()
            .enumerate()
            .map(|(i, v)| parse_quantity(&v.0, &format!("{values_field}[{i}]"), errors))
            .collect();
        for (i, pair) in parsed.windows(2).enumerate() {
            if let [Some(a), Some(b)] = pair {
                if b <= a {
                    errors.push(
                        format!("{values_field}[{}]", i + 1),
                        format!("Invalid value: {:?}: must be sorted in ascending order without duplicates", values[i + 1].0),
                    );
                }
            }
        }
        if let Some(default) = default {
            if !parsed.contains(&Some(default)) {
                errors.push(
                    format!("{field}.default"),
                    format!(
                        "Invalid value: {:?}: must be one of validValues",
                        policy
                            .default
                            .as_ref()
                            .map(|d| d.0.as_str())
                            .unwrap_or_default()
                    ),
                );
            }
        }
    }
}

fn validate_capacity(capacity: &DeviceCapacity, field: &str, errors: &mut Errors) {
    parse_quantity(&capacity.value.0, &format!("{field}.value"), errors);
    if let Some(policy) = &capacity.request_policy {
        validate_request_policy(policy, &format!("{field}.requestPolicy"), errors);
    }
}

/// A counter or counter-set name: a DNS label (`memory-slice-0`; `memorySlice0` is rejected).
fn validate_counter_name(name: &str, field: &str, errors: &mut Errors) {
    if name.is_empty() {
        errors.push(field, "Required value");
    } else if !is_dns_label(name) {
        errors.push(field, format!("Invalid value: {name:?}: {DNS_LABEL_RULE}"));
    }
}

/// Counters of a set or of a consumption: at most `max`, DNS-label names, quantity values.
fn validate_counters(
    counters: &BTreeMap<String, k8s_openapi::api::resource::v1::Counter>,
    max: usize,
    field: &str,
    errors: &mut Errors,
) {
    if counters.is_empty() {
        errors.push(field, "Required value");
    } else if counters.len() > max {
        errors.too_many(field, counters.len(), max);
    }
    for (name, counter) in counters {
        let counter_field = format!("{field}[{name}]");
        validate_counter_name(name, &counter_field, errors);
        parse_quantity(&counter.value.0, &format!("{counter_field}.value"), errors);
    }
}

fn validate_counter_sets(sets: &[CounterSet], errors: &mut Errors) {
    if sets.len() > MAX_COUNTER_SETS_PER_SLICE {
        errors.too_many(
            "spec.sharedCounters",
            sets.len(),
            MAX_COUNTER_SETS_PER_SLICE,
        );
    }
    let mut seen = BTreeSet::new();
    for (i, set) in sets.iter().enumerate() {
        let field = format!("spec.sharedCounters[{i}]");
        validate_counter_name(&set.name, &format!("{field}.name"), errors);
        if !set.name.is_empty() && !seen.insert(set.name.as_str()) {
            errors.push(
                format!("{field}.name"),
                format!("Duplicate value: {:?}", set.name),
            );
        }
        validate_counters(
            &set.counters,
            MAX_COUNTERS_PER_COUNTER_SET,
            &format!("{field}.counters"),
            errors,
        );
    }
}

fn validate_consumes_counters(
    consumptions: &[DeviceCounterConsumption],
    field: &str,
    errors: &mut Errors,
) {
    if consumptions.len() > MAX_COUNTER_CONSUMPTIONS_PER_DEVICE {
        errors.too_many(
            field,
            consumptions.len(),
            MAX_COUNTER_CONSUMPTIONS_PER_DEVICE,
        );
    }
    let mut seen = BTreeSet::new();
    for (i, consumption) in consumptions.iter().enumerate() {
        let entry = format!("{field}[{i}]");
        validate_counter_name(
            &consumption.counter_set,
            &format!("{entry}.counterSet"),
            errors,
        );
        if !consumption.counter_set.is_empty() && !seen.insert(consumption.counter_set.as_str()) {
            errors.push(
                format!("{entry}.counterSet"),
                format!("Duplicate value: {:?}", consumption.counter_set),
            );
        }
        validate_counters(
            &consumption.counters,
            MAX_COUNTERS_PER_CONSUMPTION,
            &format!("{entry}.counters"),
            errors,
        );
    }
}

fn validate_device(device: &Device, field: &str, errors: &mut Errors) {
    if device.name.is_empty() {
        errors.push(format!("{field}.name"), "Required value");
    } else if !is_dns_label(&device.name) {
        errors.push(
            format!("{field}.name"),
            format!("Invalid value: {:?}: {DNS_LABEL_RULE}", device.name),
        );
    }
    let empty_attributes = BTreeMap::new();
    let attributes = device.attributes.as_ref().unwrap_or(&empty_attributes);
    let empty_capacity = BTreeMap::new();
    let capacities = device.capacity.as_ref().unwrap_or(&empty_capacity);
    let combined = attributes.len() + capacities.len();
    if combined > MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE {
        errors.push(
            field,
            format!(
                "Invalid value: {combined}: the total number of attributes and capacities must not exceed {MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE}"
            ),
        );
    }
    for (name, attribute) in attributes {
        let attr_field = format!("{field}.attributes[{name}]");
        validate_qualified_name(name, &attr_field, errors);
        validate_attribute(attribute, &attr_field, errors);
    }
    let shareable = device.allow_multiple_allocations == Some(true);
    for (name, capacity) in capacities {
        let cap_field = format!("{field}.capacity[{name}]");
        validate_qualified_name(name, &cap_field, errors);
        validate_capacity(capacity, &cap_field, errors);
        if !shareable && capacity.request_policy.is_some() {
            errors.push(
                format!("{cap_field}.requestPolicy"),
                "Forbidden: allowMultipleAllocations must be true",
            );
        }
    }
    if let Some(consumptions) = &device.consumes_counters {
        validate_consumes_counters(consumptions, &format!("{field}.consumesCounters"), errors);
    }
    if let Some(taints) = &device.taints {
        if taints.len() > MAX_TAINTS_PER_DEVICE {
            errors.too_many(
                format!("{field}.taints"),
                taints.len(),
                MAX_TAINTS_PER_DEVICE,
            );
        }
    }
}

/// Devices choose their node only under `perDeviceNodeSelection`, and then exactly one way.
fn validate_device_node_selection(
    device: &Device,
    per_device: bool,
    field: &str,
    errors: &mut Errors,
) {
    let set: Vec<&str> = [
        (
            "nodeName",
            device.node_name.as_deref().is_some_and(|n| !n.is_empty()),
        ),
        ("nodeSelector", device.node_selector.is_some()),
        ("allNodes", device.all_nodes == Some(true)),
    ]
    .into_iter()
    .filter_map(|(name, is_set)| is_set.then_some(name))
    .collect();
    if per_device {
        if set.len() != 1 {
            errors.push(
                field,
                "Invalid value: exactly one of `nodeName`, `nodeSelector`, `allNodes` is required when `perDeviceNodeSelection` is set",
            );
        }
    } else {
        for name in set {
            errors.push(
                format!("{field}.{name}"),
                "Forbidden: may only be set when `perDeviceNodeSelection` is set",
            );
        }
    }
}

/// All violations of the upstream limits in `slice`; empty when it would be accepted.
pub fn validate_resource_slice(slice: &ResourceSlice) -> Vec<FieldError> {
    let mut errors = Errors::default();
    let spec = &slice.spec;

    if spec.driver.is_empty() {
        errors.push("spec.driver", "Required value");
    } else if spec.driver.len() > MAX_DRIVER_NAME_LENGTH {
        errors.too_long("spec.driver", MAX_DRIVER_NAME_LENGTH);
    } else if !is_dns_subdomain(&spec.driver) {
        errors.push(
            "spec.driver",
            format!("Invalid value: {:?}: {DNS_SUBDOMAIN_RULE}", spec.driver),
        );
    }

    if spec.pool.name.is_empty() {
        errors.push("spec.pool.name", "Required value");
    } else if spec.pool.name.len() > MAX_POOL_NAME_LENGTH {
        errors.too_long("spec.pool.name", MAX_POOL_NAME_LENGTH);
    } else if !spec.pool.name.split('/').all(is_dns_subdomain) {
        errors.push(
            "spec.pool.name",
            format!(
                "Invalid value: {:?}: each '/'-separated part must be a DNS subdomain",
                spec.pool.name
            ),
        );
    }
    if spec.pool.generation < 0 {
        errors.push(
            "spec.pool.generation",
            format!(
                "Invalid value: {}: must be greater than or equal to 0",
                spec.pool.generation
            ),
        );
    }
    if spec.pool.resource_slice_count < 1 {
        errors.push(
            "spec.pool.resourceSliceCount",
            format!(
                "Invalid value: {}: must be greater than zero",
                spec.pool.resource_slice_count
            ),
        );
    }

    let node_name = spec.node_name.as_deref().filter(|n| !n.is_empty());
    let selectors_set = [
        node_name.is_some(),
        spec.node_selector.is_some(),
        spec.all_nodes == Some(true),
        spec.per_device_node_selection == Some(true),
    ]
    .iter()
    .filter(|s| **s)
    .count();
    const ONE_OF: &str = "exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` is required";
    match selectors_set {
        0 => errors.push("spec", format!("Required value: {ONE_OF}")),
        1 => {}
        _ => errors.push(
            "spec",
            format!("Invalid value: {ONE_OF}, but multiple fields are set"),
        ),
    }
    if let Some(node) = node_name {
        if !is_dns_subdomain(node) {
            errors.push(
                "spec.nodeName",
                format!("Invalid value: {node:?}: {DNS_SUBDOMAIN_RULE}"),
            );
        }
    }

    // Since 1.35 a slice carries counter sets or devices, never both; the counter sets sit in
    // slices of their own in the same pool (docs/architecture.md, "Upstream limits on a slice").
    if spec.shared_counters.is_some() && spec.devices.is_some() {
        errors.push(
            "spec",
            "Invalid value: \"\": only one of `sharedCounters` or `devices` is allowed",
        );
    }
    if let Some(sets) = &spec.shared_counters {
        validate_counter_sets(sets, &mut errors);
    }

    let devices = spec.devices.as_deref().unwrap_or_default();
    let restricted = devices.iter().any(|d| {
        d.taints.as_ref().is_some_and(|t| !t.is_empty())
            || d.consumes_counters.as_ref().is_some_and(|c| !c.is_empty())
    });
    let max_devices = if restricted {
        MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS
    } else {
        MAX_DEVICES_PER_SLICE
    };
    if devices.len() > max_devices {
        errors.too_many("spec.devices", devices.len(), max_devices);
    }
    let per_device = spec.per_device_node_selection == Some(true);
    let mut seen = BTreeSet::new();
    for (i, device) in devices.iter().enumerate() {
        let field = format!("spec.devices[{i}]");
        validate_device(device, &field, &mut errors);
        validate_device_node_selection(device, per_device, &field, &mut errors);
        if !device.name.is_empty() && !seen.insert(device.name.as_str()) {
            errors.push(
                format!("{field}.name"),
                format!("Duplicate value: {:?}", device.name),
            );
        }
    }
    errors.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn device(i: usize) -> serde_json::Value {
        json!({
            "name": format!("gpu-{i}"),
            "allowMultipleAllocations": true,
            "attributes": {
                "productName": {"string": "NVIDIA A100-SXM4-40GB"},
                "driverVersion": {"version": "550.54.15"},
                "resource.kubernetes.io/pciBusID": {"string": "0000:3b:00.0"},
                "index": {"int": i}
            },
            "capacity": {
                "memory": {"value": "40Gi", "requestPolicy": {"default": "40Gi", "validRange": {"min": "1Mi", "step": "1Mi"}}},
                "cores": {"value": "100", "requestPolicy": {"default": "0", "validRange": {"min": "0", "max": "100", "step": "1"}}}
            }
        })
    }

    fn slice_json(devices: usize) -> serde_json::Value {
        json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": "node-a-gpupool.dev"},
            "spec": {
                "driver": "gpupool.dev",
                "nodeName": "node-a",
                "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
                "devices": (0..devices).map(device).collect::<Vec<_>>()
            }
        })
    }

    fn errors_of(value: serde_json::Value) -> Vec<FieldError> {
        validate_resource_slice(&serde_json::from_value(value).expect("a decodable slice"))
    }

    /// The fields named by the errors for a slice changed by `edit`.
    fn fields_after(edit: impl FnOnce(&mut serde_json::Value)) -> Vec<String> {
        let mut value = slice_json(2);
        edit(&mut value);
        errors_of(value).into_iter().map(|e| e.field).collect()
    }

    #[test]
    fn the_design_slice_is_accepted() {
        assert_eq!(errors_of(slice_json(128)), vec![]);
    }

    #[test]
    fn at_most_128_devices() {
        let errors = errors_of(slice_json(129));
        assert_eq!(errors.len(), 1);
        assert_eq!(errors[0].field, "spec.devices");
        assert_eq!(
            errors[0].message,
            "Too many: 129: must have at most 128 items"
        );
    }

    #[test]
    fn at_most_64_devices_with_taints_or_counters() {
        let mut value = slice_json(65);
        value["spec"]["devices"][3]["taints"] = json!([{"key": "k", "effect": "NoSchedule"}]);
        let errors = errors_of(value);
        assert_eq!(errors[0].field, "spec.devices");
        assert!(errors[0].message.contains("at most 64"));
        let mut value = slice_json(65);
        value["spec"]["devices"][0]["consumesCounters"] =
            json!([{"counterSet": "s", "counters": {"c": {"value": "1"}}}]);
        assert_eq!(errors_of(value)[0].field, "spec.devices");
        let mut value = slice_json(64);
        value["spec"]["devices"][3]["taints"] = json!([{"key": "k", "effect": "NoSchedule"}]);
        assert_eq!(errors_of(value), vec![]);
    }

    #[test]
    fn at_most_32_attributes_and_capacities() {
        let fields = fields_after(|v| {
            for i in 0..29 {
                v["spec"]["devices"][1]["attributes"][format!("extra{i}")] = json!({"int": i});
            }
        });
        assert_eq!(fields, vec!["spec.devices[1]"]);
    }

    #[test]
    fn attribute_names_are_short_c_identifiers() {
        let long = "a".repeat(40);
        let fields =
            fields_after(|v| v["spec"]["devices"][0]["attributes"][&long] = json!({"int": 1}));
        assert_eq!(fields, vec![format!("spec.devices[0].attributes[{long}]")]);
        let fields = fields_after(|v| {
            v["spec"]["devices"][0]["attributes"]["1bad-name"] = json!({"int": 1})
        });
        assert_eq!(fields, vec!["spec.devices[0].attributes[1bad-name]"]);
        let errors = errors_of({
            let mut v = slice_json(1);
            v["spec"]["devices"][0]["attributes"][&long] = json!({"int": 1});
            v
        });
        assert_eq!(errors[0].message, "Too long: may not be more than 32 bytes");
    }

    #[test]
    fn attribute_domains_are_dns_subdomains_of_at_most_63() {
        let name = format!("{}.dev/model", "d".repeat(60));
        let fields =
            fields_after(|v| v["spec"]["devices"][0]["attributes"][&name] = json!({"int": 1}));
        assert_eq!(fields, vec![format!("spec.devices[0].attributes[{name}]")]);
        let fields = fields_after(|v| {
            v["spec"]["devices"][0]["capacity"]["Bad_Domain/x"] = json!({"value": "1"})
        });
        assert_eq!(fields, vec!["spec.devices[0].capacity[Bad_Domain/x]"]);
    }

    #[test]
    fn string_and_version_values_at_most_64_and_versions_semver() {
        let fields = fields_after(|v| {
            v["spec"]["devices"][0]["attributes"]["productName"] = json!({"string": "x".repeat(65)})
        });
        assert_eq!(
            fields,
            vec!["spec.devices[0].attributes[productName].string"]
        );
        let fields = fields_after(|v| {
            v["spec"]["devices"][1]["attributes"]["driverVersion"] = json!({"version": "550.54"})
        });
        assert_eq!(
            fields,
            vec!["spec.devices[1].attributes[driverVersion].version"]
        );
        let fields = fields_after(|v| {
            v["spec"]["devices"][1]["attributes"]["driverVersion"] =
                json!({"version": format!("1.2.3-{}", "a".repeat(60))})
        });
        assert_eq!(
            fields,
            vec!["spec.devices[1].attributes[driverVersion].version"]
        );
    }

    #[test]
    fn exactly_one_value_per_attribute() {
        let fields = fields_after(|v| {
            v["spec"]["devices"][0]["attributes"]["index"] = json!({"int": 1, "string": "1"})
        });
        assert_eq!(fields, vec!["spec.devices[0].attributes[index]"]);
        let fields = fields_after(|v| v["spec"]["devices"][0]["attributes"]["index"] = json!({}));
        assert_eq!(fields, vec!["spec.devices[0].attributes[index]"]);
    }

    #[test]
    fn driver_name_is_a_short_dns_subdomain() {
        let fields =
            fields_after(|v| v["spec"]["driver"] = json!(format!("{}.dev", "d".repeat(60))));
        assert_eq!(fields, vec!["spec.driver"]);
        let fields = fields_after(|v| v["spec"]["driver"] = json!("GPUpool.dev"));
        assert_eq!(fields, vec!["spec.driver"]);
    }

    #[test]
    fn pool_name_at_most_253() {
        let long = vec!["p".repeat(60); 5].join(".");
        let fields = fields_after(|v| v["spec"]["pool"]["name"] = json!(long));
        assert_eq!(fields, vec!["spec.pool.name"]);
    }

    #[test]
    fn at_most_16_taints() {
        let taints: Vec<_> = (0..17)
            .map(|i| json!({"key": format!("k{i}"), "effect": "NoSchedule"}))
            .collect();
        let fields = fields_after(|v| v["spec"]["devices"][1]["taints"] = json!(taints));
        assert_eq!(fields, vec!["spec.devices[1].taints"]);
    }

    #[test]
    fn device_names_are_unique_dns_labels() {
        let fields = fields_after(|v| v["spec"]["devices"][1]["name"] = json!("gpu-0"));
        assert_eq!(fields, vec!["spec.devices[1].name"]);
        let fields = fields_after(|v| v["spec"]["devices"][0]["name"] = json!("GPU_0"));
        assert_eq!(fields, vec!["spec.devices[0].name"]);
    }

    #[test]
    fn capacity_default_and_max_are_multiples_of_step() {
        let fields = fields_after(|v| {
            v["spec"]["devices"][0]["capacity"]["memory"]["requestPolicy"]["default"] =
                json!("1500Ki")
        });
        assert_eq!(
            fields,
            vec!["spec.devices[0].capacity[memory].requestPolicy.default"]
        );
        let fields = fields_after(|v| {
            v["spec"]["devices"][0]["capacity"]["cores"]["requestPolicy"]["validRange"] =
                json!({"min": "0", "max": "99", "step": "2"})
        });
        assert_eq!(
            fields,
            vec!["spec.devices[0].capacity[cores].requestPolicy.validRange.max"]
        );
    }

    #[test]
    fn capacity_default_within_min_and_max() {
        let fields = fields_after(|v| {
            v["spec"]["devices"][0]["capacity"]["cores"]["requestPolicy"]["default"] = json!("101")
        });
        assert_eq!(
            fields,
            vec!["spec.devices[0].capacity[cores].requestPolicy.default"]
        );
        let fields = fields_after(|v| {
            v["spec"]["devices"][0]["capacity"]["cores"]["requestPolicy"]["validRange"] =
                json!({"min": "50", "max": "10", "step": "1"});
            v["spec"]["devices"][0]["capacity"]["cores"]["requestPolicy"]["default"] = json!("50");
        });
        assert!(fields
            .contains(&"spec.devices[0].capacity[cores].requestPolicy.validRange.max".to_string()));
    }

    #[test]
    fn valid_values_at_most_10_sorted_and_containing_default() {
        let set = |values: serde_json::Value, default: &'static str| {
            move |v: &mut serde_json::Value| {
                v["spec"]["devices"][0]["capacity"]["cores"]["requestPolicy"] =
                    json!({"default": default, "validValues": values});
            }
        };
        assert_eq!(
            fields_after(set(json!(["0", "50", "100"]), "50")),
            Vec::<String>::new()
        );
        let eleven: Vec<String> = (0..11).map(|i| i.to_string()).collect();
        assert_eq!(
            fields_after(set(json!(eleven), "0")),
            vec!["spec.devices[0].capacity[cores].requestPolicy.validValues"]
        );
        assert_eq!(
            fields_after(set(json!(["0", "100", "50"]), "0")),
            vec!["spec.devices[0].capacity[cores].requestPolicy.validValues[2]"]
        );
        assert_eq!(
            fields_after(set(json!(["0", "50"]), "25")),
            vec!["spec.devices[0].capacity[cores].requestPolicy.default"]
        );
    }

    #[test]
    fn resource_slice_count_at_least_one() {
        let fields = fields_after(|v| v["spec"]["pool"]["resourceSliceCount"] = json!(0));
        assert_eq!(fields, vec!["spec.pool.resourceSliceCount"]);
    }

    #[test]
    fn exactly_one_node_selection() {
        let fields = fields_after(|v| {
            v["spec"].as_object_mut().unwrap().remove("nodeName");
        });
        assert_eq!(fields, vec!["spec"]);
        let fields = fields_after(|v| v["spec"]["allNodes"] = json!(true));
        assert_eq!(fields, vec!["spec"]);
        let fields = fields_after(|v| {
            v["spec"].as_object_mut().unwrap().remove("nodeName");
            v["spec"]["allNodes"] = json!(true);
        });
        assert_eq!(fields, Vec::<String>::new());
    }

    #[test]
    fn devices_pick_their_node_only_under_per_device_node_selection() {
        let fields = fields_after(|v| v["spec"]["devices"][1]["nodeName"] = json!("node-a"));
        assert_eq!(fields, vec!["spec.devices[1].nodeName"]);
        let per_device = |v: &mut serde_json::Value| {
            v["spec"].as_object_mut().unwrap().remove("nodeName");
            v["spec"]["perDeviceNodeSelection"] = json!(true);
            v["spec"]["devices"][0]["nodeName"] = json!("node-a");
            v["spec"]["devices"][1]["allNodes"] = json!(true);
        };
        assert_eq!(fields_after(per_device), Vec::<String>::new());
        let fields = fields_after(|v| {
            per_device(v);
            v["spec"]["devices"][1]
                .as_object_mut()
                .unwrap()
                .remove("allNodes");
        });
        assert_eq!(fields, vec!["spec.devices[1]"]);
    }

    fn counter_slice_json(sets: usize, counters: usize) -> serde_json::Value {
        let set = |i: usize| {
            let counters: serde_json::Map<String, serde_json::Value> = (0..counters)
                .map(|k| (format!("memory-slice-{k}"), json!({"value": "1"})))
                .collect();
            json!({"name": format!("gpu-{i}-counters"), "counters": counters})
        };
        json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": "node-a-gpupool.dev-0"},
            "spec": {
                "driver": "gpupool.dev",
                "nodeName": "node-a",
                "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 2},
                "sharedCounters": (0..sets).map(set).collect::<Vec<_>>()
            }
        })
    }

    #[test]
    fn a_counter_only_slice_within_the_limits_is_accepted() {
        assert_eq!(errors_of(counter_slice_json(8, 32)), vec![]);
    }

    #[test]
    fn counter_sets_and_devices_never_share_a_slice() {
        let mut value = counter_slice_json(1, 2);
        value["spec"]["devices"] = json!([device(0)]);
        let errors = errors_of(value);
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert_eq!(errors[0].field, "spec");
        assert!(errors[0]
            .message
            .contains("only one of `sharedCounters` or `devices` is allowed"));
        // An empty list is still a list: the real server decodes it as set.
        let mut value = counter_slice_json(1, 2);
        value["spec"]["devices"] = json!([]);
        assert_eq!(errors_of(value)[0].field, "spec");
    }

    #[test]
    fn at_most_8_counter_sets_of_32_counters() {
        let errors = errors_of(counter_slice_json(9, 1));
        assert_eq!(errors[0].field, "spec.sharedCounters");
        assert_eq!(errors[0].message, "Too many: 9: must have at most 8 items");
        let errors = errors_of(counter_slice_json(1, 33));
        assert_eq!(errors[0].field, "spec.sharedCounters[0].counters");
    }

    #[test]
    fn counter_and_counter_set_names_are_dns_labels() {
        let mut value = counter_slice_json(1, 1);
        value["spec"]["sharedCounters"][0]["counters"] = json!({"memorySlice0": {"value": "1"}});
        value["spec"]["sharedCounters"][0]["name"] = json!("gpu_0");
        let fields: Vec<String> = errors_of(value).into_iter().map(|e| e.field).collect();
        assert_eq!(
            fields,
            vec![
                "spec.sharedCounters[0].name",
                "spec.sharedCounters[0].counters[memorySlice0]"
            ]
        );
        let fields = fields_after(|v| {
            v["spec"]["devices"][1]["consumesCounters"] =
                json!([{"counterSet": "Gpu0", "counters": {"memory-slice-0": {"value": "1"}}}])
        });
        assert_eq!(
            fields,
            vec!["spec.devices[1].consumesCounters[0].counterSet"]
        );
    }

    #[test]
    fn at_most_2_consumptions_of_32_counters_per_device() {
        let consumption = |set: &str, n: usize| {
            let counters: serde_json::Map<String, serde_json::Value> = (0..n)
                .map(|k| (format!("c-{k}"), json!({"value": "1"})))
                .collect();
            json!({"counterSet": set, "counters": counters})
        };
        let three = json!([
            consumption("a", 1),
            consumption("b", 1),
            consumption("c", 1)
        ]);
        let fields = fields_after(|v| v["spec"]["devices"][0]["consumesCounters"] = three.clone());
        assert_eq!(fields, vec!["spec.devices[0].consumesCounters"]);
        let wide = json!([consumption("a", 33)]);
        let fields = fields_after(|v| v["spec"]["devices"][0]["consumesCounters"] = wide.clone());
        assert_eq!(fields, vec!["spec.devices[0].consumesCounters[0].counters"]);
        let twice = json!([consumption("a", 1), consumption("a", 1)]);
        let fields = fields_after(|v| v["spec"]["devices"][0]["consumesCounters"] = twice.clone());
        assert_eq!(
            fields,
            vec!["spec.devices[0].consumesCounters[1].counterSet"]
        );
    }

    #[test]
    fn an_exclusive_device_may_not_have_a_request_policy() {
        let fields = fields_after(|v| {
            v["spec"]["devices"][0]
                .as_object_mut()
                .unwrap()
                .remove("allowMultipleAllocations");
        });
        assert_eq!(
            fields,
            vec![
                "spec.devices[0].capacity[cores].requestPolicy",
                "spec.devices[0].capacity[memory].requestPolicy"
            ]
        );
    }

    #[test]
    fn semver_rules() {
        for ok in [
            "1.2.3",
            "0.0.0",
            "550.54.15",
            "1.0.0-rc.1",
            "1.0.0+build.5",
            "1.0.0-alpha-1",
        ] {
            assert!(is_semver(ok), "{ok}");
        }
        for bad in ["1.2", "v1.2.3", "01.2.3", "1.2.3-", "1.2.3-01", "a.b.c", ""] {
            assert!(!is_semver(bad), "{bad}");
        }
    }
}

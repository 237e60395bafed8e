//! What gpupool's admission webhook refuses in a ResourceClaim, a ResourceClaimTemplate or a
//! DeviceClass: the `GpuConfig`s in their `config[].opaque` entries for driver `gpupool.dev`,
//! decoded by the driver's own parser ([`crate::config::decode`]), and the overrides the driver
//! would refuse at prepare once it sees what the request asks for (`memoryLimit` above the
//! request's memory, `coreLimit` above its cores, MPS on a share that reserves no SMs or on more
//! than one device).
//!
//! Objects come as JSON in any of the versions `resource.k8s.io` serves: v1 and v1beta2 put a
//! request's device selection under `exactly`, v1beta1 inline in the request ([`RequestLayout`]).
//! Everything else read here (`devices.config`, `firstAvailable`, `capacity.requests`) has the same
//! shape in all three.
//!
//! Only what the spec alone decides is refused: the card a request lands on (its size, MIG or not,
//! its compute capability) and the DeviceClass's own config are unknown at admission, so those
//! checks stay with the driver's prepare, which refuses them with the same field names.

use serde_json::Value;

use crate::config::{
    decode, effective_config, ConfigEntry, ConfigError, ConfigSource, EffectiveConfig,
};
use crate::names::{capacity, DRIVER_NAME, MEMORY_STEP_BYTES};
use crate::quantity;

/// Where a request's device selection (class, count, capacity) is, by API version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestLayout {
    /// `resource.k8s.io/v1` and `v1beta2`: `requests[].exactly.{deviceClassName,count,capacity}`.
    Exactly,
    /// `resource.k8s.io/v1beta1`: the same fields directly in `requests[]`.
    Inline,
}

impl RequestLayout {
    /// The layout of a `resource.k8s.io` version; `None` for a version gpupool does not know.
    pub fn of_version(version: &str) -> Option<RequestLayout> {
        match version {
            "v1" | "v1beta2" => Some(RequestLayout::Exactly),
            "v1beta1" => Some(RequestLayout::Inline),
            _ => None,
        }
    }
}

fn problem(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.into(),
        message: message.into(),
    }
}

/// The decoded gpupool entries of a `config` list, and the problems of those that do not decode.
fn decode_entries(config: Option<&Value>, path: &str) -> (Vec<ConfigEntry>, Vec<ConfigError>) {
    let mut entries = Vec::new();
    let mut problems = Vec::new();
    let Some(Value::Array(items)) = config else {
        return (entries, problems);
    };
    for (i, item) in items.iter().enumerate() {
        let Some(opaque) = item.get("opaque") else {
            continue;
        };
        if opaque.get("driver").and_then(Value::as_str) != Some(DRIVER_NAME) {
            continue;
        }
        let field = format!("{path}[{i}].opaque.parameters");
        let parameters = opaque.get("parameters").unwrap_or(&Value::Null);
        match decode(parameters, &field) {
            Ok(config) => entries.push(ConfigEntry {
                // At admission every entry of a claim is the claim's own.
                source: ConfigSource::FromClaim,
                field,
                requests: item
                    .get("requests")
                    .and_then(Value::as_array)
                    .map(|r| {
                        r.iter()
                            .filter_map(|n| n.as_str().map(str::to_string))
                            .collect()
                    })
                    .unwrap_or_default(),
                config,
            }),
            Err(e) => problems.push(e),
        }
    }
    (entries, problems)
}

/// Checks a DeviceClass `spec` (at `path`, e.g. `spec`): its gpupool configs decode.
pub fn check_class_spec(spec: &Value, path: &str) -> Vec<ConfigError> {
    decode_entries(spec.get("config"), &format!("{path}.config")).1
}

/// One device selection of a claim: a request, or one subrequest of its `firstAvailable`.
struct Selection<'a> {
    /// As an allocation result names it: `gpu`, or `gpu/v100` for a subrequest.
    name: String,
    path: String,
    fields: &'a Value,
}

fn selections<'a>(requests: &'a [Value], path: &str, layout: RequestLayout) -> Vec<Selection<'a>> {
    let mut out = Vec::new();
    for (i, request) in requests.iter().enumerate() {
        let name = request.get("name").and_then(Value::as_str).unwrap_or("");
        let request_path = format!("{path}[{i}]");
        match request.get("firstAvailable").and_then(Value::as_array) {
            Some(subs) if !subs.is_empty() => {
                for (j, sub) in subs.iter().enumerate() {
                    let sub_name = sub.get("name").and_then(Value::as_str).unwrap_or("");
                    out.push(Selection {
                        name: format!("{name}/{sub_name}"),
                        path: format!("{request_path}.firstAvailable[{j}]"),
                        fields: sub,
                    });
                }
            }
            _ => match layout {
                RequestLayout::Exactly => {
                    if let Some(exactly) = request.get("exactly") {
                        out.push(Selection {
                            name: name.to_string(),
                            path: format!("{request_path}.exactly"),
                            fields: exactly,
                        });
                    }
                }
                RequestLayout::Inline => out.push(Selection {
                    name: name.to_string(),
                    path: request_path,
                    fields: request,
                }),
            },
        }
    }
    out
}

/// A capacity request of a selection, parsed; a quantity the API server let through but that does
/// not parse is left to the API server and the scheduler.
fn capacity_request(selection: &Selection<'_>, name: &str) -> Option<quantity::Milli> {
    let text = selection
        .fields
        .get("capacity")?
        .get("requests")?
        .get(name)?
        .as_str()?;
    quantity::parse(text).ok()
}

/// Whether a selection's DeviceClass is one of gpupool's by its name.
fn is_gpupool_class(selection: &Selection<'_>) -> bool {
    selection
        .fields
        .get("deviceClassName")
        .and_then(Value::as_str)
        .is_some_and(|class| {
            class == DRIVER_NAME
                || class
                    .strip_suffix(DRIVER_NAME)
                    .is_some_and(|prefix| prefix.ends_with('.') && prefix.len() > 1)
        })
}

/// How many devices a selection asks for: `None` for `allocationMode: All` (any number).
fn device_count(selection: &Selection<'_>) -> Option<i64> {
    match selection
        .fields
        .get("allocationMode")
        .and_then(Value::as_str)
    {
        Some("All") => None,
        _ => Some(
            selection
                .fields
                .get("count")
                .and_then(Value::as_i64)
                .unwrap_or(1),
        ),
    }
}

/// What the driver's prepare would refuse of `effective` for `selection`, from the request alone.
fn check_selection(selection: &Selection<'_>, effective: &EffectiveConfig) -> Vec<ConfigError> {
    let mut problems = Vec::new();
    let c = &effective.config;
    let field = |f: &Option<String>| f.clone().unwrap_or_default();
    let memory = capacity_request(selection, capacity::MEMORY).filter(|m| m.0 > 0);
    // The scheduler rounds a request up to the capacity's step (1Mi for memory, 1 for cores), and
    // the driver compares against what was allocated.
    let allocated_memory = memory.and_then(|m| {
        let bytes = u64::try_from(m.ceil_units()).ok()?;
        Some(bytes.div_ceil(MEMORY_STEP_BYTES) * MEMORY_STEP_BYTES)
    });
    let cores = capacity_request(selection, capacity::CORES)
        .map(|c| c.ceil_units().clamp(0, 100) as u32)
        .unwrap_or(0);
    if let (Some(limit), Some(allocated)) = (c.memory_limit, allocated_memory) {
        if c.memory_limit_raises(allocated) {
            problems.push(problem(
                field(&effective.memory_limit_field),
                format!(
                    "{} is above the {} that request {:?} asks for ({}.capacity.requests.memory): \
                     a memoryLimit may only lower the allocation",
                    quantity::format_bytes(limit),
                    quantity::format_bytes(allocated),
                    selection.name,
                    selection.path
                ),
            ));
        }
    }
    if let Some(limit) = c.core_limit {
        if c.core_limit_raises(cores) {
            problems.push(problem(
                field(&effective.core_limit_field),
                format!(
                    "{limit} is above the {cores}% that request {:?} asks for \
                     ({}.capacity.requests.cores): a coreLimit may only lower the allocation, \
                     1..{cores} allowed",
                    selection.name, selection.path
                ),
            ));
        }
    }
    if c.compute == Some(crate::config::Compute::Mps) {
        let mps_field = field(&effective.compute_field);
        match device_count(selection) {
            Some(1) => {}
            count => problems.push(problem(
                mps_field.clone(),
                format!(
                    "Mps, but request {:?} asks for {} devices: a container reaches one MPS \
                     control daemon, which serves one card; ask for one device",
                    selection.name,
                    count.map_or("all matching".to_string(), |n| n.to_string())
                ),
            )),
        }
        let part_of_card = memory.is_some() || c.memory_limit.is_some();
        if cores == 0 && part_of_card {
            problems.push(problem(
                mps_field,
                format!(
                    "Mps, but request {:?} reserves no SMs (no capacity.requests.cores) for a part \
                     of a card's memory, and MPS takes the share's SMs from cores: ask for cores \
                     at {}.capacity.requests.cores, or leave compute unset",
                    selection.name, selection.path
                ),
            ));
        }
    }
    problems
}

/// Checks a claim spec (`spec` of a ResourceClaim at `path` = `spec`, or `spec.spec` of a
/// ResourceClaimTemplate): every gpupool config decodes, and every request a gpupool config applies
/// to leaves it something the driver can honour.
pub fn check_claim_spec(spec: &Value, path: &str, layout: RequestLayout) -> Vec<ConfigError> {
    let Some(devices) = spec.get("devices") else {
        return Vec::new();
    };
    let devices_path = format!("{path}.devices");
    let (entries, mut problems) =
        decode_entries(devices.get("config"), &format!("{devices_path}.config"));
    if entries.is_empty() {
        return problems;
    }
    let requests = devices
        .get("requests")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    for selection in selections(requests, &format!("{devices_path}.requests"), layout) {
        // A config that names the request is meant for a gpupool device there. One that names no
        // request applies to every request, but the driver reads it only for its own devices: a
        // request of another driver (which may well have a capacity called memory) is held to it
        // only where its class is, by name, one of gpupool's (the controller's `gpupool.dev` and
        // `*.gpupool.dev`); other classes are left to prepare rather than refused wrongly.
        let named = entries.iter().any(|e| {
            e.requests
                .iter()
                .any(|r| crate::config::request_matches(r, &selection.name))
        });
        let unnamed = entries.iter().any(|e| e.requests.is_empty());
        if named || (unnamed && is_gpupool_class(&selection)) {
            let effective = effective_config(&entries, &selection.name);
            problems.extend(check_selection(&selection, &effective));
        }
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn gpu_config(extra: Value) -> Value {
        let mut base = json!({"apiVersion": "gpupool.dev/v1alpha1", "kind": "GpuConfig"});
        base.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        base
    }

    /// A v1 claim spec with one request `gpu` asking for `capacity` and a config for it.
    fn claim(capacity: Value, config: Value) -> Value {
        json!({"devices": {
            "requests": [{"name": "gpu", "exactly": {
                "deviceClassName": "gpupool.dev", "capacity": {"requests": capacity}}}],
            "config": [
                {"opaque": {"driver": "other.example.com", "parameters": {"anything": 1}}},
                {"requests": ["gpu"], "opaque": {"driver": "gpupool.dev", "parameters": gpu_config(config)}}
            ]
        }})
    }

    fn fields(problems: &[ConfigError]) -> Vec<&str> {
        problems.iter().map(|p| p.field.as_str()).collect()
    }

    const P: &str = "spec.devices.config[1].opaque.parameters";

    #[test]
    fn a_config_the_driver_takes_passes_and_other_drivers_configs_are_not_read() {
        let ok = claim(
            json!({"memory": "8Gi", "cores": "50"}),
            json!({"memoryLimit": "4Gi", "coreLimit": 25, "compute": "Mps"}),
        );
        assert_eq!(check_claim_spec(&ok, "spec", RequestLayout::Exactly), []);
        // Equal to the request is not above it; 1500M is rounded up to 1431Mi by the scheduler.
        let equal = claim(json!({"memory": "1500M"}), json!({"memoryLimit": "1431Mi"}));
        assert_eq!(check_claim_spec(&equal, "spec", RequestLayout::Exactly), []);
        let no_devices = json!({});
        assert_eq!(
            check_claim_spec(&no_devices, "spec", RequestLayout::Exactly),
            []
        );
    }

    #[test]
    fn decode_errors_name_the_field_in_the_object() {
        let bad = claim(json!({}), json!({"coreLimit": 150}));
        let problems = check_claim_spec(&bad, "spec", RequestLayout::Exactly);
        assert_eq!(fields(&problems), [format!("{P}.coreLimit")]);
        assert!(problems[0].message.contains("0..100"), "{problems:?}");
        let template = check_claim_spec(&bad, "spec.spec", RequestLayout::Exactly);
        assert_eq!(
            fields(&template),
            ["spec.spec.devices.config[1].opaque.parameters.coreLimit"]
        );
        let missing = json!({"devices": {"config": [{"opaque": {"driver": "gpupool.dev"}}]}});
        let problems = check_claim_spec(&missing, "spec", RequestLayout::Exactly);
        assert_eq!(
            fields(&problems),
            ["spec.devices.config[0].opaque.parameters"]
        );
    }

    #[test]
    fn overrides_above_the_request_are_refused_with_the_request_named() {
        let above = claim(json!({"memory": "8Gi"}), json!({"memoryLimit": "9Gi"}));
        let problems = check_claim_spec(&above, "spec", RequestLayout::Exactly);
        assert_eq!(fields(&problems), [format!("{P}.memoryLimit")]);
        assert!(
            problems[0]
                .message
                .starts_with("9Gi is above the 8Gi that request \"gpu\""),
            "{problems:?}"
        );
        for core_limit in [0, 60] {
            let above = claim(json!({"cores": "50"}), json!({"coreLimit": core_limit}));
            let problems = check_claim_spec(&above, "spec", RequestLayout::Exactly);
            assert_eq!(
                fields(&problems),
                [format!("{P}.coreLimit")],
                "{core_limit}"
            );
        }
        // Without a cores request there is no SM limit to lower: any coreLimit is a lowering.
        let lower = claim(json!({"memory": "8Gi"}), json!({"coreLimit": 30}));
        assert_eq!(check_claim_spec(&lower, "spec", RequestLayout::Exactly), []);
        // Without a memory request the claim gets the whole card, unknown here: left to prepare.
        let whole = claim(json!({}), json!({"memoryLimit": "900Gi"}));
        assert_eq!(check_claim_spec(&whole, "spec", RequestLayout::Exactly), []);
    }

    #[test]
    fn mps_on_a_share_without_cores_or_on_many_devices_is_refused() {
        let no_cores = claim(json!({"memory": "8Gi"}), json!({"compute": "Mps"}));
        let problems = check_claim_spec(&no_cores, "spec", RequestLayout::Exactly);
        assert_eq!(fields(&problems), [format!("{P}.compute")]);
        assert!(
            problems[0].message.contains("reserves no SMs"),
            "{problems:?}"
        );
        let limit = claim(json!({}), json!({"compute": "Mps", "memoryLimit": "4Gi"}));
        assert_eq!(
            fields(&check_claim_spec(&limit, "spec", RequestLayout::Exactly)),
            [format!("{P}.compute")]
        );
        let whole = claim(json!({}), json!({"compute": "Mps"}));
        assert_eq!(check_claim_spec(&whole, "spec", RequestLayout::Exactly), []);
        let mut two = claim(json!({"cores": "30"}), json!({"compute": "Mps"}));
        two["devices"]["requests"][0]["exactly"]["count"] = json!(2);
        let problems = check_claim_spec(&two, "spec", RequestLayout::Exactly);
        assert_eq!(fields(&problems), [format!("{P}.compute")]);
        assert!(problems[0].message.contains("2 devices"), "{problems:?}");
    }

    #[test]
    fn another_drivers_request_is_held_only_to_a_config_that_names_it() {
        let spec = |requests: Value| {
            json!({"devices": {
                "requests": [
                    {"name": "gpu", "exactly": {"deviceClassName": "a100-sxm4-40gb.gpupool.dev",
                                                "capacity": {"requests": {"memory": "16Gi"}}}},
                    {"name": "nic", "exactly": {"deviceClassName": "rdma.example.com",
                                                "capacity": {"requests": {"memory": "1Gi"}}}}
                ],
                "config": [{"requests": requests, "opaque": {"driver": "gpupool.dev",
                            "parameters": gpu_config(json!({"memoryLimit": "8Gi"}))}}]
            }})
        };
        assert_eq!(
            check_claim_spec(&spec(json!([])), "spec", RequestLayout::Exactly),
            [],
            "no request named: only the gpupool class's request is checked"
        );
        let named = check_claim_spec(&spec(json!(["nic"])), "spec", RequestLayout::Exactly);
        assert_eq!(
            fields(&named),
            ["spec.devices.config[0].opaque.parameters.memoryLimit"]
        );
        assert!(named[0].message.contains("request \"nic\""), "{named:?}");
        let mut fraction = spec(json!([]));
        fraction["devices"]["requests"][0]["exactly"]["capacity"]["requests"]["memory"] =
            json!("4Gi");
        assert_eq!(
            fields(&check_claim_spec(&fraction, "spec", RequestLayout::Exactly)),
            ["spec.devices.config[0].opaque.parameters.memoryLimit"],
            "the gpupool class's request is"
        );
    }

    #[test]
    fn v1beta1_requests_are_inline_and_subrequests_are_checked_each() {
        let beta = json!({"devices": {
            "requests": [{"name": "gpu", "deviceClassName": "gpupool.dev",
                          "capacity": {"requests": {"memory": "4Gi"}}}],
            "config": [{"opaque": {"driver": "gpupool.dev",
                                   "parameters": gpu_config(json!({"memoryLimit": "8Gi"}))}}]
        }});
        let problems = check_claim_spec(&beta, "spec", RequestLayout::Inline);
        assert_eq!(
            fields(&problems),
            ["spec.devices.config[0].opaque.parameters.memoryLimit"]
        );
        assert!(problems[0]
            .message
            .contains("spec.devices.requests[0].capacity"));
        // Read with the v1 layout the same object has no selection to check.
        assert_eq!(check_claim_spec(&beta, "spec", RequestLayout::Exactly), []);

        let first_available = json!({"devices": {
            "requests": [{"name": "gpu", "firstAvailable": [
                {"name": "a100", "deviceClassName": "a100.gpupool.dev", "capacity": {"requests": {"memory": "16Gi"}}},
                {"name": "v100", "deviceClassName": "v100.gpupool.dev", "capacity": {"requests": {"memory": "8Gi"}}}
            ]}],
            "config": [
                {"opaque": {"driver": "gpupool.dev", "parameters": gpu_config(json!({"memoryLimit": "12Gi"}))}},
                {"requests": ["gpu/v100"], "opaque": {"driver": "gpupool.dev",
                  "parameters": gpu_config(json!({"memoryLimit": "6Gi"}))}}
            ]
        }});
        assert_eq!(
            check_claim_spec(&first_available, "spec", RequestLayout::Exactly),
            [],
            "the v100 subrequest's own limit wins over the claim-wide 12Gi"
        );
        let mut too_much = first_available.clone();
        too_much["devices"]["config"][1]["requests"] = json!(["gpu/a100"]);
        let problems = check_claim_spec(&too_much, "spec", RequestLayout::Exactly);
        assert_eq!(
            fields(&problems),
            ["spec.devices.config[0].opaque.parameters.memoryLimit"]
        );
        assert!(problems[0].message.contains("\"gpu/v100\""), "{problems:?}");
    }

    /// JSON shaped like a claim spec: the keys the checks read, with anything as their values.
    fn arb_spec() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|n| json!(n)),
            prop_oneof![
                Just("gpupool.dev"),
                Just("gpu"),
                Just("8Gi"),
                Just("50"),
                Just("All"),
                Just("gpupool.dev/v1alpha1"),
                Just("GpuConfig"),
                Just("Mps"),
                Just("-1"),
                Just("1e40"),
            ]
            .prop_map(|s| json!(s)),
        ];
        leaf.prop_recursive(7, 96, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::btree_map(
                    prop::sample::select(vec![
                        "devices",
                        "requests",
                        "config",
                        "opaque",
                        "driver",
                        "parameters",
                        "name",
                        "exactly",
                        "firstAvailable",
                        "capacity",
                        "memory",
                        "cores",
                        "count",
                        "allocationMode",
                        "memoryLimit",
                        "coreLimit",
                        "compute",
                        "apiVersion",
                        "kind",
                    ])
                    .prop_map(str::to_string),
                    inner,
                    0..6,
                )
                .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest::proptest! {
        #[test]
        fn any_spec_is_checked_without_a_panic(spec in arb_spec()) {
            for layout in [RequestLayout::Exactly, RequestLayout::Inline] {
                for problem in check_claim_spec(&spec, "spec", layout) {
                    proptest::prop_assert!(problem.field.starts_with("spec.devices.config["));
                }
            }
            let _ = check_class_spec(&spec, "spec");
        }
    }

    #[test]
    fn a_class_config_is_decoded() {
        let class = json!({"config": [
            {"opaque": {"driver": "gpupool.dev", "parameters": gpu_config(json!({"sharing": "Shared"}))}},
            {"opaque": {"driver": "gpupool.dev", "parameters": gpu_config(json!({"sharing": "Exclusive"}))}}
        ]});
        assert_eq!(
            fields(&check_class_spec(&class, "spec")),
            ["spec.config[0].opaque.parameters.sharing"]
        );
        assert_eq!(check_class_spec(&json!({}), "spec"), []);
        assert_eq!(
            RequestLayout::of_version("v1beta1"),
            Some(RequestLayout::Inline)
        );
        assert_eq!(
            RequestLayout::of_version("v1beta2"),
            Some(RequestLayout::Exactly)
        );
        assert_eq!(RequestLayout::of_version("v2"), None);
    }
}

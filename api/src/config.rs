//! `GpuConfig`: the opaque device configuration a DeviceClass or a ResourceClaim hands to the driver.
//!
//! ```yaml
//! apiVersion: gpupool.dev/v1alpha1
//! kind: GpuConfig
//! sharing: Fractional        # or Exclusive: the claim must hold the whole card
//! memoryLimit: 4Gi           # may only lower the allocated memory
//! coreLimit: 25              # percent, may only lower the allocated cores
//! enforcement: Gpupool       # or HamiCore, or None: no limits in the container
//! compute: Mps               # or Limiter: who holds the cores share (see [`Compute`])
//! priority: 1                # HAMi-core's CUDA_TASK_PRIORITY (0 high, 1 low)
//! ```
//!
//! Decoding is strict and hand-written over `serde_json::Value` so that every error names the exact
//! field (`status.allocation.devices.config[1].opaque.parameters.memoryLimt: unknown field`): serde's
//! own `deny_unknown_fields` message carries no path.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use thiserror::Error;

use crate::names::API_GROUP_VERSION;
use crate::quantity;

pub const GPU_CONFIG_KIND: &str = "GpuConfig";
/// Upstream limit on opaque parameters (resource.k8s.io/v1).
pub const MAX_PARAMETERS_BYTES: usize = 10 * 1024;
/// A GpuConfig is flat; anything deeper than this is refused before it is walked.
pub const MAX_NESTING_DEPTH: usize = 4;
/// HAMi-core knows two task priorities: 0 (high) and 1 (low).
pub const MAX_PRIORITY: i64 = 1;

const KNOWN_FIELDS: &[&str] = &[
    "apiVersion",
    "kind",
    "sharing",
    "memoryLimit",
    "coreLimit",
    "enforcement",
    "compute",
    "priority",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Sharing {
    /// The claim must hold the whole card (no other share can be on it).
    Exclusive,
    /// The claim may hold a fraction of the card.
    Fractional,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Enforcement {
    /// Limits enforced in the container by gpupool's own library (`libgpupool_vgpu.so`).
    Gpupool,
    /// Limits enforced in the container by HAMi-core (`libvgpu.so`).
    HamiCore,
    /// No enforcement: the container sees the whole card; the limits are bookkeeping only.
    None,
}

impl Enforcement {
    /// The library that enforces it, as a claim's status and the driver's log name it.
    pub fn library_name(self) -> Option<&'static str> {
        match self {
            Enforcement::Gpupool => Some("gpupool-vgpu"),
            Enforcement::HamiCore => Some("HAMi-core"),
            Enforcement::None => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Enforcement::Gpupool => "Gpupool",
            Enforcement::HamiCore => "HamiCore",
            Enforcement::None => "None",
        }
    }
}

/// Who holds a share's `cores` (its SMs); memory stays with the enforcement library either way.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Compute {
    /// The enforcement library's SM limiter (`CUDA_DEVICE_SM_LIMIT_<i>`): a duty cycle in time.
    #[default]
    Limiter,
    /// NVIDIA MPS: the driver runs the card's MPS control daemon and the container's processes are
    /// its clients with `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` = `cores`, a partition of the SMs in
    /// hardware. Every share of the card must then be an MPS share.
    Mps,
}

impl Compute {
    pub fn as_str(self) -> &'static str {
        match self {
            Compute::Limiter => "Limiter",
            Compute::Mps => "Mps",
        }
    }
}

/// One decoded GpuConfig; `None` fields leave the decision to an earlier config or the default.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuConfig {
    pub sharing: Option<Sharing>,
    /// Bytes.
    pub memory_limit: Option<u64>,
    /// Percent of the card, 0..=100.
    pub core_limit: Option<u32>,
    pub enforcement: Option<Enforcement>,
    pub compute: Option<Compute>,
    pub priority: Option<i64>,
}

/// A config problem, naming the field it is about.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
#[error("{field}: {message}")]
pub struct ConfigError {
    pub field: String,
    pub message: String,
}

fn err(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.into(),
        message: message.into(),
    }
}

impl GpuConfig {
    /// Fields set in `later` win over this one's (class configs first, then the claim's).
    pub fn overlay(&mut self, later: &GpuConfig) {
        self.sharing = later.sharing.or(self.sharing);
        self.memory_limit = later.memory_limit.or(self.memory_limit);
        self.core_limit = later.core_limit.or(self.core_limit);
        self.enforcement = later.enforcement.or(self.enforcement);
        self.compute = later.compute.or(self.compute);
        self.priority = later.priority.or(self.priority);
    }

    /// Whether `memoryLimit` asks for more than the `allocated` bytes: a limit may only lower
    /// what the scheduler gave. One rule for the admission webhook (against the request) and the
    /// driver's prepare (against the allocation).
    pub fn memory_limit_raises(&self, allocated: u64) -> bool {
        self.memory_limit.is_some_and(|limit| limit > allocated)
    }

    /// Whether `coreLimit` asks for more than the `allocated` percent of SMs. 0 means "no SM
    /// limit", so on a share with cores (allocated > 0) a coreLimit of 0 raises it too; without
    /// cores there is no SM limit to lower and any coreLimit is a lowering.
    pub fn core_limit_raises(&self, allocated: u32) -> bool {
        self.core_limit
            .is_some_and(|limit| allocated > 0 && (limit == 0 || limit > allocated))
    }
}

/// Depth of nested arrays/objects; a scalar is 0. Iterative so hostile input cannot blow the stack.
fn nesting_depth(value: &Value) -> usize {
    let mut max = 0;
    let mut stack = vec![(value, 0usize)];
    while let Some((v, depth)) = stack.pop() {
        match v {
            Value::Array(items) => {
                max = max.max(depth + 1);
                stack.extend(items.iter().map(|i| (i, depth + 1)));
            }
            Value::Object(map) => {
                max = max.max(depth + 1);
                stack.extend(map.values().map(|i| (i, depth + 1)));
            }
            _ => {}
        }
    }
    max
}

/// Decode raw parameter bytes (as found in a manifest). `field` is the path of the parameters object.
pub fn decode_bytes(bytes: &[u8], field: &str) -> Result<GpuConfig, ConfigError> {
    if bytes.len() > MAX_PARAMETERS_BYTES {
        return Err(err(
            field,
            format!(
                "{} bytes, more than the {MAX_PARAMETERS_BYTES} allowed",
                bytes.len()
            ),
        ));
    }
    let value: Value =
        serde_json::from_slice(bytes).map_err(|e| err(field, format!("not valid JSON: {e}")))?;
    decode(&value, field)
}

/// Decode the `parameters` of an opaque config. `field` is its path, used in every error.
pub fn decode(parameters: &Value, field: &str) -> Result<GpuConfig, ConfigError> {
    let depth = nesting_depth(parameters);
    if depth > MAX_NESTING_DEPTH {
        return Err(err(
            field,
            format!("nested {depth} levels deep, at most {MAX_NESTING_DEPTH} allowed"),
        ));
    }
    let size = serde_json::to_vec(parameters).map(|v| v.len()).unwrap_or(0);
    if size > MAX_PARAMETERS_BYTES {
        return Err(err(
            field,
            format!("{size} bytes, more than the {MAX_PARAMETERS_BYTES} allowed"),
        ));
    }
    let Value::Object(map) = parameters else {
        return Err(err(field, "must be an object"));
    };
    let at = |name: &str| format!("{field}.{name}");

    for key in map.keys() {
        if !KNOWN_FIELDS.contains(&key.as_str()) {
            return Err(err(at(key), "unknown field"));
        }
    }
    match map.get("apiVersion") {
        Some(Value::String(v)) if v == API_GROUP_VERSION => {}
        Some(other) => {
            return Err(err(
                at("apiVersion"),
                format!("unsupported value {other}, expected {API_GROUP_VERSION:?}"),
            ))
        }
        None => return Err(err(at("apiVersion"), "required")),
    }
    match map.get("kind") {
        Some(Value::String(v)) if v == GPU_CONFIG_KIND => {}
        Some(other) => {
            return Err(err(
                at("kind"),
                format!("unsupported value {other}, expected {GPU_CONFIG_KIND:?}"),
            ))
        }
        None => return Err(err(at("kind"), "required")),
    }

    let mut config = GpuConfig::default();
    if let Some(v) = map.get("sharing") {
        config.sharing = Some(match v.as_str() {
            Some("Exclusive") => Sharing::Exclusive,
            Some("Fractional") => Sharing::Fractional,
            _ => {
                return Err(err(
                    at("sharing"),
                    format!("unsupported value {v}, expected \"Exclusive\" or \"Fractional\""),
                ))
            }
        });
    }
    if let Some(v) = map.get("enforcement") {
        config.enforcement = Some(match v.as_str() {
            Some("Gpupool") => Enforcement::Gpupool,
            Some("HamiCore") => Enforcement::HamiCore,
            Some("None") => Enforcement::None,
            _ => {
                return Err(err(
                    at("enforcement"),
                    format!(
                        "unsupported value {v}, expected \"Gpupool\", \"HamiCore\" or \"None\""
                    ),
                ))
            }
        });
    }
    if let Some(v) = map.get("compute") {
        config.compute = Some(match v.as_str() {
            Some("Limiter") => Compute::Limiter,
            Some("Mps") => Compute::Mps,
            _ => {
                return Err(err(
                    at("compute"),
                    format!("unsupported value {v}, expected \"Limiter\" or \"Mps\""),
                ))
            }
        });
    }
    if let Some(v) = map.get("memoryLimit") {
        config.memory_limit = Some(decode_memory(v).map_err(|m| err(at("memoryLimit"), m))?);
    }
    if let Some(v) = map.get("coreLimit") {
        let cores = v
            .as_u64()
            .filter(|c| *c <= 100)
            .ok_or_else(|| err(at("coreLimit"), format!("{v}: must be an integer 0..100")))?;
        config.core_limit = Some(cores as u32);
    }
    if let Some(v) = map.get("priority") {
        let priority = v
            .as_i64()
            .filter(|p| (0..=MAX_PRIORITY).contains(p))
            .ok_or_else(|| {
                err(
                    at("priority"),
                    format!("{v}: must be an integer 0 (high) or 1 (low)"),
                )
            })?;
        config.priority = Some(priority);
    }
    Ok(config)
}

fn decode_memory(v: &Value) -> Result<u64, String> {
    let milli = match v {
        Value::String(s) => quantity::parse(s).map_err(|e| e.to_string())?,
        Value::Number(n) => match n.as_u64() {
            Some(bytes) => quantity::Milli::from_units(i128::from(bytes)),
            None => return Err(format!("{v}: must be a whole number of bytes")),
        },
        _ => return Err(format!("{v}: must be a quantity such as \"8Gi\"")),
    };
    if milli.0 % 1000 != 0 {
        return Err(format!("{v}: must be a whole number of bytes"));
    }
    let bytes = u64::try_from(milli.0 / 1000).map_err(|_| format!("{v}: out of range"))?;
    if bytes < crate::names::MEMORY_STEP_BYTES {
        return Err(format!("{v}: must be at least 1Mi"));
    }
    Ok(bytes)
}

/// Where a config entry came from, in the order they apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ConfigSource {
    FromClass,
    FromClaim,
}

impl ConfigSource {
    pub fn parse(source: &str) -> Option<Self> {
        match source {
            "FromClass" => Some(ConfigSource::FromClass),
            "FromClaim" => Some(ConfigSource::FromClaim),
            _ => None,
        }
    }
}

/// One decoded entry of `status.allocation.devices.config` for this driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigEntry {
    pub source: ConfigSource,
    /// Path of the entry's parameters, e.g. `status.allocation.devices.config[1].opaque.parameters`.
    pub field: String,
    /// Requests it applies to; empty = all.
    pub requests: Vec<String>,
    pub config: GpuConfig,
}

/// Whether an entry naming `entry_request` applies to an allocation result of `result_request`:
/// "gpu" matches "gpu" and every subrequest "gpu/<sub>"; "gpu/v100" matches only itself.
pub fn request_matches(entry_request: &str, result_request: &str) -> bool {
    result_request == entry_request
        || result_request
            .strip_prefix(entry_request)
            .is_some_and(|rest| rest.starts_with('/'))
}

/// The config that applies to one allocation result, with the field each override came from,
/// so that an override the allocation cannot honour is reported at the field the user wrote.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EffectiveConfig {
    pub config: GpuConfig,
    pub sharing_field: Option<String>,
    pub memory_limit_field: Option<String>,
    pub core_limit_field: Option<String>,
    pub enforcement_field: Option<String>,
    pub compute_field: Option<String>,
}

/// The effective config of one allocation result: class entries, then claim entries, later wins.
pub fn effective_config(entries: &[ConfigEntry], result_request: &str) -> EffectiveConfig {
    let mut ordered: Vec<&ConfigEntry> = entries.iter().collect();
    // Stable: within one source the listed order is kept.
    ordered.sort_by_key(|e| e.source);
    let mut effective = EffectiveConfig::default();
    for entry in ordered {
        if entry.requests.is_empty()
            || entry
                .requests
                .iter()
                .any(|r| request_matches(r, result_request))
        {
            let c = &entry.config;
            if c.sharing.is_some() {
                effective.sharing_field = Some(format!("{}.sharing", entry.field));
            }
            if c.memory_limit.is_some() {
                effective.memory_limit_field = Some(format!("{}.memoryLimit", entry.field));
            }
            if c.core_limit.is_some() {
                effective.core_limit_field = Some(format!("{}.coreLimit", entry.field));
            }
            if c.enforcement.is_some() {
                effective.enforcement_field = Some(format!("{}.enforcement", entry.field));
            }
            if c.compute.is_some() {
                effective.compute_field = Some(format!("{}.compute", entry.field));
            }
            effective.config.overlay(c);
        }
    }
    effective
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    const F: &str = "status.allocation.devices.config[1].opaque.parameters";

    fn base() -> serde_json::Map<String, Value> {
        let Value::Object(m) = json!({"apiVersion": "gpupool.dev/v1alpha1", "kind": "GpuConfig"})
        else {
            unreachable!()
        };
        m
    }

    fn with(key: &str, value: Value) -> Value {
        let mut m = base();
        m.insert(key.into(), value);
        Value::Object(m)
    }

    #[test]
    fn decodes_every_field() {
        let v = json!({
            "apiVersion": "gpupool.dev/v1alpha1", "kind": "GpuConfig",
            "sharing": "Fractional", "memoryLimit": "4Gi", "coreLimit": 25,
            "enforcement": "None", "compute": "Mps", "priority": 0
        });
        let c = decode(&v, F).unwrap();
        assert_eq!(
            c,
            GpuConfig {
                sharing: Some(Sharing::Fractional),
                memory_limit: Some(4 << 30),
                core_limit: Some(25),
                enforcement: Some(Enforcement::None),
                compute: Some(Compute::Mps),
                priority: Some(0),
            }
        );
        assert_eq!(
            decode(&with("memoryLimit", json!(1 << 20)), F)
                .unwrap()
                .memory_limit,
            Some(1 << 20)
        );
    }

    #[test]
    fn unknown_field_is_named() {
        let e = decode(&with("memoryLimt", json!("4Gi")), F).unwrap_err();
        assert_eq!(e.field, format!("{F}.memoryLimt"));
        assert_eq!(e.to_string(), format!("{F}.memoryLimt: unknown field"));
    }

    #[test]
    fn bad_values_name_their_field() {
        let cases = [
            ("sharing", json!("Shared")),
            ("enforcement", json!("hamicore")),
            ("compute", json!("MPS")),
            ("compute", json!(true)),
            ("coreLimit", json!(101)),
            ("coreLimit", json!("50")),
            ("coreLimit", json!(-1)),
            ("memoryLimit", json!("8GB")),
            ("memoryLimit", json!("500m")),
            ("memoryLimit", json!("1Ki")),
            ("memoryLimit", json!(true)),
            ("priority", json!(2)),
            ("priority", json!("high")),
        ];
        for (field, value) in cases {
            let e = decode(&with(field, value.clone()), F).unwrap_err();
            assert_eq!(e.field, format!("{F}.{field}"), "{field}={value}");
        }
    }

    #[test]
    fn api_version_and_kind_are_required_and_checked() {
        let mut m = base();
        m.remove("kind");
        assert_eq!(
            decode(&Value::Object(m), F).unwrap_err().field,
            format!("{F}.kind")
        );
        let e = decode(&with("apiVersion", json!("gpupool.dev/v1")), F).unwrap_err();
        assert_eq!(e.field, format!("{F}.apiVersion"));
        let e = decode(&json!(["a"]), F).unwrap_err();
        assert_eq!(e.field, F);
    }

    #[test]
    fn oversized_and_deep_parameters_are_refused() {
        let big = with("padding", json!("x".repeat(MAX_PARAMETERS_BYTES)));
        let e = decode(&big, F).unwrap_err();
        assert_eq!(e.field, F);
        assert!(e.message.contains("bytes"), "{e}");

        let mut deep = json!(1);
        for _ in 0..10 {
            deep = json!({ "a": deep });
        }
        let e = decode(&with("sharing", deep), F).unwrap_err();
        assert_eq!(e.field, F);
        assert!(e.message.contains("nested"), "{e}");

        let e = decode_bytes(&vec![b' '; MAX_PARAMETERS_BYTES + 1], F).unwrap_err();
        assert!(e.message.contains("bytes"), "{e}");
        let deep_text = format!("{}{}", "[".repeat(5000), "]".repeat(5000));
        assert!(decode_bytes(deep_text.as_bytes(), F).is_err());
    }

    #[test]
    fn claim_entries_win_over_class_and_requests_select() {
        let class = ConfigEntry {
            source: ConfigSource::FromClass,
            field: "c0".into(),
            requests: vec![],
            config: GpuConfig {
                enforcement: Some(Enforcement::None),
                core_limit: Some(50),
                ..Default::default()
            },
        };
        let claim_gpu = ConfigEntry {
            source: ConfigSource::FromClaim,
            field: "c1".into(),
            requests: vec!["gpu".into()],
            config: GpuConfig {
                enforcement: Some(Enforcement::HamiCore),
                ..Default::default()
            },
        };
        let claim_v100 = ConfigEntry {
            source: ConfigSource::FromClaim,
            field: "c2".into(),
            requests: vec!["gpu/v100".into()],
            config: GpuConfig {
                memory_limit: Some(1 << 30),
                ..Default::default()
            },
        };
        // Listed claim-first to show the source decides, not the position.
        let entries = vec![claim_gpu, claim_v100, class];
        let v100 = effective_config(&entries, "gpu/v100");
        assert_eq!(v100.memory_limit_field.as_deref(), Some("c2.memoryLimit"));
        assert_eq!(v100.core_limit_field.as_deref(), Some("c0.coreLimit"));
        let v100 = v100.config;
        assert_eq!(v100.enforcement, Some(Enforcement::HamiCore));
        assert_eq!(v100.core_limit, Some(50));
        assert_eq!(v100.memory_limit, Some(1 << 30));
        let a100 = effective_config(&entries, "gpu/a100").config;
        assert_eq!(a100.memory_limit, None);
        assert_eq!(a100.enforcement, Some(Enforcement::HamiCore));
        let other = effective_config(&entries, "gpus").config;
        assert_eq!(other.enforcement, Some(Enforcement::None));
        assert!(!request_matches("gpu", "gpu-2"));
        assert!(request_matches("gpu", "gpu/x"));
        assert!(!request_matches("gpu/v100", "gpu"));
    }

    #[test]
    fn compute_comes_from_the_class_unless_the_claim_says_and_names_its_field() {
        let class = ConfigEntry {
            source: ConfigSource::FromClass,
            field: "c0".into(),
            requests: vec![],
            config: GpuConfig {
                compute: Some(Compute::Mps),
                ..Default::default()
            },
        };
        let effective = effective_config(std::slice::from_ref(&class), "gpu");
        assert_eq!(effective.config.compute, Some(Compute::Mps));
        assert_eq!(effective.compute_field.as_deref(), Some("c0.compute"));
        let claim = ConfigEntry {
            source: ConfigSource::FromClaim,
            field: "c1".into(),
            requests: vec![],
            config: GpuConfig {
                compute: Some(Compute::Limiter),
                ..Default::default()
            },
        };
        let effective = effective_config(&[claim, class], "gpu");
        assert_eq!(effective.config.compute, Some(Compute::Limiter));
        assert_eq!(effective.compute_field.as_deref(), Some("c1.compute"));
        assert_eq!(
            effective_config(&[], "gpu")
                .config
                .compute
                .unwrap_or_default(),
            Compute::Limiter,
            "the default stays the library's limiter"
        );
    }

    fn arb_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|n| json!(n)),
            any::<f64>().prop_map(|n| json!(n)),
            "[a-zA-Z0-9. ]{0,12}".prop_map(Value::String),
            prop_oneof![
                Just("GpuConfig"),
                Just("gpupool.dev/v1alpha1"),
                Just("HamiCore"),
                Just("Mps"),
                Just("Exclusive"),
                Just("8Gi"),
                Just("1e40"),
            ]
            .prop_map(|s| Value::String(s.into())),
        ];
        leaf.prop_recursive(6, 64, 8, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                prop::collection::btree_map(
                    prop_oneof![
                        Just("apiVersion".to_string()),
                        Just("kind".to_string()),
                        Just("memoryLimit".to_string()),
                        Just("coreLimit".to_string()),
                        Just("priority".to_string()),
                        Just("sharing".to_string()),
                        Just("compute".to_string()),
                        "[a-z]{1,8}",
                    ],
                    inner,
                    0..8
                )
                .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #[test]
        fn decoding_arbitrary_json_never_panics(value in arb_json()) {
            if let Err(e) = decode(&value, F) {
                prop_assert!(e.field.starts_with(F));
            }
        }

        #[test]
        fn decoding_arbitrary_bytes_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode_bytes(&bytes, F);
        }
    }
}

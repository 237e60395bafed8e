//! CEL device selectors, evaluated over the same `device` variable kube-scheduler builds:
//! `device.driver`, `device.attributes[domain][name]`, `device.capacity[domain][name]`,
//! `device.allowMultipleAllocations`. Names without a domain belong to the driver's domain.

use std::collections::HashMap;
use std::sync::Arc;

use k8s_openapi::api::resource::v1::{Device, DeviceAttribute};
use kube_cel::cel::objects::{Key, Map};
use kube_cel::cel::{Context, Program, Value};
use kube_cel::KubeCelExt;
use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq)]
pub enum SelectorError {
    #[error("CEL compile error: {0}")]
    Compile(String),
    #[error("CEL runtime error: {0}")]
    Runtime(String),
    #[error("CEL result is not a bool but {0}")]
    NotBool(String),
}

/// Compiles each expression once and evaluates it against devices.
pub struct CelEvaluator {
    root: Context<'static>,
    programs: HashMap<String, Result<Arc<Program>, SelectorError>>,
    quantity: Program,
    semver: Program,
}

impl Default for CelEvaluator {
    fn default() -> Self {
        Self::new()
    }
}

impl CelEvaluator {
    pub fn new() -> Self {
        CelEvaluator {
            root: Context::default().with_all(),
            programs: HashMap::new(),
            quantity: Program::compile("quantity(text)").expect("constant expression compiles"),
            semver: Program::compile("semver(text)").expect("constant expression compiles"),
        }
    }

    /// The `device` variable of a device published by `driver`.
    pub fn device_value(&self, driver: &str, device: &Device) -> Value {
        let attributes = device
            .attributes
            .iter()
            .flatten()
            .filter_map(|(name, attribute)| Some((name, self.attribute_value(attribute)?)));
        // Capacities are quantities.
        let capacity =
            device.capacity.iter().flatten().filter_map(|(name, cap)| {
                Some((name, self.construct(&self.quantity, &cap.value.0)?))
            });
        let mut fields: HashMap<String, Value> = HashMap::new();
        fields.insert("driver".into(), Value::String(Arc::new(driver.to_string())));
        fields.insert("attributes".into(), by_domain(driver, attributes));
        fields.insert("capacity".into(), by_domain(driver, capacity));
        fields.insert(
            "allowMultipleAllocations".into(),
            Value::Bool(device.allow_multiple_allocations == Some(true)),
        );
        Value::from(fields)
    }

    /// The CEL value of an attribute; None for one that is left out.
    fn attribute_value(&self, attribute: &DeviceAttribute) -> Option<Value> {
        if let Some(v) = attribute.int {
            Some(Value::Int(v))
        } else if let Some(v) = attribute.bool {
            Some(Value::Bool(v))
        } else if let Some(v) = &attribute.string {
            Some(Value::String(Arc::new(v.clone())))
        } else if let Some(v) = &attribute.version {
            // The API server only accepts semver here; an unparsable value is left out
            // rather than failing every selector on the node.
            self.construct(&self.semver, v)
        } else {
            None
        }
    }

    fn construct(&self, program: &Program, text: &str) -> Option<Value> {
        let mut scope = self.root.new_inner_scope();
        scope.add_variable_from_value("text", Value::String(Arc::new(text.to_string())));
        program.execute(&scope).ok()
    }

    /// Whether `expression` is true for `device` (a value from [`Self::device_value`]).
    pub fn matches(&mut self, expression: &str, device: &Value) -> Result<bool, SelectorError> {
        let program = self
            .programs
            .entry(expression.to_string())
            .or_insert_with(|| {
                Program::compile(expression)
                    .map(Arc::new)
                    .map_err(|e| SelectorError::Compile(e.to_string()))
            })
            .clone()?;
        let mut scope = self.root.new_inner_scope();
        scope.add_variable_from_value("device", device.clone());
        match program.execute(&scope) {
            Ok(Value::Bool(b)) => Ok(b),
            Ok(other) => Err(SelectorError::NotBool(format!("{:?}", other.type_of()))),
            Err(e) => Err(SelectorError::Runtime(lowercase_first(&e.to_string()))),
        }
    }
}

/// `domain/id` -> (domain, id); a bare `id` belongs to the driver's domain.
pub fn split_qualified<'a>(name: &'a str, driver: &'a str) -> (&'a str, &'a str) {
    name.split_once('/').unwrap_or((driver, name))
}

/// `domain -> id -> value` of qualified names and their values (see [`split_qualified`]).
fn by_domain<'a>(driver: &str, entries: impl Iterator<Item = (&'a String, Value)>) -> Value {
    let mut domains: HashMap<String, HashMap<String, Value>> = HashMap::new();
    for (name, value) in entries {
        let (domain, id) = split_qualified(name, driver);
        domains
            .entry(domain.to_string())
            .or_default()
            .insert(id.to_string(), value);
    }
    let map: HashMap<Key, Value> = domains
        .into_iter()
        .map(|(domain, inner)| (Key::String(Arc::new(domain)), Value::from(inner)))
        .collect();
    Value::Map(Map { map: Arc::new(map) })
}

/// cel-go prints "no such key: x"; the Rust crate capitalises. Keep upstream's wording.
fn lowercase_first(message: &str) -> String {
    let mut chars = message.chars();
    match chars.next() {
        Some(first) => first.to_lowercase().chain(chars).collect(),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{gpu, int_attr};

    /// An A100 as gpupool publishes it, on NUMA node 1.
    fn device() -> Device {
        let mut device = gpu(0, "A100-SXM4-40GB", "40Gi");
        device
            .attributes
            .get_or_insert_with(Default::default)
            .insert("resource.kubernetes.io/numaNode".to_string(), int_attr(1));
        device
    }

    fn eval(expression: &str) -> Result<bool, SelectorError> {
        let mut cel = CelEvaluator::new();
        let value = cel.device_value("gpupool.dev", &device());
        cel.matches(expression, &value)
    }

    #[test]
    fn bare_attribute_names_live_in_the_driver_domain() {
        assert_eq!(
            eval(r#"device.attributes["gpupool.dev"].model == "A100-SXM4-40GB""#),
            Ok(true)
        );
        assert_eq!(
            eval(r#"device.attributes["resource.kubernetes.io"].numaNode == 1"#),
            Ok(true)
        );
        assert_eq!(
            eval(r#"device.driver == "gpupool.dev" && device.allowMultipleAllocations"#),
            Ok(true)
        );
    }

    #[test]
    fn versions_are_semver_and_capacities_are_quantities() {
        assert_eq!(
            eval(
                r#"device.attributes["gpupool.dev"].driverVersion.isGreaterThan(semver("535.0.0"))"#
            ),
            Ok(true)
        );
        assert_eq!(
            eval(r#"device.capacity["gpupool.dev"].memory.compareTo(quantity("48Gi")) < 0"#),
            Ok(true)
        );
    }

    #[test]
    fn a_missing_domain_is_a_runtime_error() {
        let err = eval(r#"device.attributes["other.example.com"].model == "x""#).unwrap_err();
        assert_eq!(
            err.to_string(),
            "CEL runtime error: no such key: other.example.com"
        );
    }

    #[test]
    fn a_false_guard_absorbs_the_error_on_either_side_like_cel_go() {
        let mut cel = CelEvaluator::new();
        let foreign = cel.device_value("nic.example.com", &Device::default());
        let guard_last =
            r#"device.attributes["gpupool.dev"].model == "x" && device.driver == "gpupool.dev""#;
        assert_eq!(cel.matches(guard_last, &foreign), Ok(false));
        let unguarded = r#"device.attributes["gpupool.dev"].model == "x""#;
        assert!(matches!(
            cel.matches(unguarded, &foreign),
            Err(SelectorError::Runtime(_))
        ));
    }

    #[test]
    fn a_non_bool_result_is_an_error() {
        assert!(matches!(
            eval("device.driver"),
            Err(SelectorError::NotBool(_))
        ));
        assert!(matches!(
            eval("device.driver =="),
            Err(SelectorError::Compile(_))
        ));
    }

    #[test]
    fn has_tells_a_missing_attribute_from_a_present_one() {
        // The controller's card classes: devices of drivers from before MIG have no `type`.
        let cards = r#"!has(device.attributes["gpupool.dev"].type) || device.attributes["gpupool.dev"].type == "gpu""#;
        assert_eq!(eval(cards), Ok(true));
        let mut cel = CelEvaluator::new();
        let mut mig = device();
        mig.attributes.get_or_insert_with(Default::default).insert(
            "type".to_string(),
            DeviceAttribute {
                string: Some("mig".into()),
                ..Default::default()
            },
        );
        let value = cel.device_value("gpupool.dev", &mig);
        assert_eq!(cel.matches(cards, &value), Ok(false));
    }
}

//! Decoding like the real server: unknown fields are pruned (or refused under `fieldValidation=Strict`),
//! badly typed fields refused. Built-in kinds are checked by a round trip through their k8s-openapi type,
//! custom resources against their CRD's openAPIV3Schema.

use serde::{de::DeserializeOwned, Serialize};
use serde_json::Value;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    /// The body does not decode into the kind at all (a 400 BadRequest from the real server).
    #[error("{0}")]
    Undecodable(String),
    /// Schema violations of a custom resource (a 422 Invalid), as (field, message).
    #[error("invalid fields: {0:?}")]
    Invalid(Vec<(String, String)>),
}

fn roundtrip<T: DeserializeOwned + Serialize>(object: &Value) -> Result<Value, DecodeError> {
    let typed: T = serde_json::from_value(object.clone())
        .map_err(|e| DecodeError::Undecodable(e.to_string()))?;
    serde_json::to_value(typed).map_err(|e| DecodeError::Undecodable(e.to_string()))
}

/// The path of `key` under `path` ("" for the root), as field errors name it.
fn child_path(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

/// Removes from `input` each key that `decoded` lost, recording its path.
fn prune_lost(input: &mut Value, decoded: &Value, path: &str, lost: &mut Vec<String>) {
    match (input, decoded) {
        (Value::Object(map), Value::Object(kept)) => {
            let mut removed = Vec::new();
            for (key, value) in map.iter_mut() {
                let child = child_path(path, key);
                match kept.get(key) {
                    None if value.is_null() => {}
                    None => removed.push((key.clone(), child)),
                    Some(kept_value) => prune_lost(value, kept_value, &child, lost),
                }
            }
            for (key, child) in removed {
                map.remove(&key);
                lost.push(child);
            }
        }
        (Value::Array(items), Value::Array(kept)) => {
            for (i, (item, kept_item)) in items.iter_mut().zip(kept).enumerate() {
                prune_lost(item, kept_item, &format!("{path}[{i}]"), lost);
            }
        }
        _ => {}
    }
}

/// Decodes a built-in kind; returns the paths of unknown fields, which are removed from `object`.
pub fn decode_builtin(kind: &str, object: &mut Value) -> Result<Vec<String>, DecodeError> {
    use k8s_openapi::api::{
        admissionregistration::v1 as admission, apps::v1 as apps, coordination::v1 as coordination,
        core::v1 as core, rbac::v1 as rbac, resource::v1 as resource,
    };
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1 as apiextensions;
    let decoded = match kind {
        "Namespace" => roundtrip::<core::Namespace>(object)?,
        "Node" => roundtrip::<core::Node>(object)?,
        "Pod" => roundtrip::<core::Pod>(object)?,
        "Event" => roundtrip::<core::Event>(object)?,
        "ConfigMap" => roundtrip::<core::ConfigMap>(object)?,
        "DeviceClass" => roundtrip::<resource::DeviceClass>(object)?,
        "ResourceClaim" => roundtrip::<resource::ResourceClaim>(object)?,
        "ResourceClaimTemplate" => roundtrip::<resource::ResourceClaimTemplate>(object)?,
        "ResourceSlice" => roundtrip::<resource::ResourceSlice>(object)?,
        "Lease" => roundtrip::<coordination::Lease>(object)?,
        "ServiceAccount" => roundtrip::<core::ServiceAccount>(object)?,
        "Secret" => roundtrip::<core::Secret>(object)?,
        "Service" => roundtrip::<core::Service>(object)?,
        "Deployment" => roundtrip::<apps::Deployment>(object)?,
        "DaemonSet" => roundtrip::<apps::DaemonSet>(object)?,
        "ClusterRole" => roundtrip::<rbac::ClusterRole>(object)?,
        "ClusterRoleBinding" => roundtrip::<rbac::ClusterRoleBinding>(object)?,
        "Role" => roundtrip::<rbac::Role>(object)?,
        "RoleBinding" => roundtrip::<rbac::RoleBinding>(object)?,
        "ValidatingAdmissionPolicy" => roundtrip::<admission::ValidatingAdmissionPolicy>(object)?,
        "ValidatingAdmissionPolicyBinding" => {
            roundtrip::<admission::ValidatingAdmissionPolicyBinding>(object)?
        }
        "ValidatingWebhookConfiguration" => {
            roundtrip::<admission::ValidatingWebhookConfiguration>(object)?
        }
        "CustomResourceDefinition" => roundtrip::<apiextensions::CustomResourceDefinition>(object)?,
        _ => return Ok(Vec::new()),
    };
    let mut lost = Vec::new();
    prune_lost(object, &decoded, "", &mut lost);
    Ok(lost)
}

fn type_matches(expected: &str, value: &Value) -> bool {
    match expected {
        "object" => value.is_object(),
        "array" => value.is_array(),
        "string" => value.is_string(),
        "integer" => value.is_i64() || value.is_u64(),
        "number" => value.is_number(),
        "boolean" => value.is_boolean(),
        _ => true,
    }
}

fn describe(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_f64() => "number",
        Value::Number(_) => "integer",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

fn bound(schema: &Value, key: &str) -> Option<f64> {
    schema.get(key).and_then(Value::as_f64)
}

struct SchemaWalk {
    unknown: Vec<String>,
    invalid: Vec<(String, String)>,
}

impl SchemaWalk {
    /// minimum/maximum, min/maxLength and min/maxItems, with upstream's wording.
    fn check_bounds(&mut self, value: &Value, schema: &Value, path: &str) {
        let mut fail = |message: String| self.invalid.push((path.to_string(), message));
        if let Some(number) = value.as_f64() {
            let exclusive_min =
                schema.get("exclusiveMinimum").and_then(Value::as_bool) == Some(true);
            let exclusive_max =
                schema.get("exclusiveMaximum").and_then(Value::as_bool) == Some(true);
            if let Some(min) = bound(schema, "minimum") {
                if number < min || (exclusive_min && number == min) {
                    let relation = if exclusive_min {
                        "greater than"
                    } else {
                        "greater than or equal to"
                    };
                    fail(format!(
                        "Invalid value: {value}: {path} in body should be {relation} {min}"
                    ));
                }
            }
            if let Some(max) = bound(schema, "maximum") {
                if number > max || (exclusive_max && number == max) {
                    let relation = if exclusive_max {
                        "less than"
                    } else {
                        "less than or equal to"
                    };
                    fail(format!(
                        "Invalid value: {value}: {path} in body should be {relation} {max}"
                    ));
                }
            }
        }
        let length = match value {
            Value::String(text) => Some((
                text.chars().count() as f64,
                "minLength",
                "maxLength",
                "chars long",
            )),
            Value::Array(items) => Some((items.len() as f64, "minItems", "maxItems", "items")),
            _ => None,
        };
        if let Some((len, min_key, max_key, unit)) = length {
            if let Some(min) = bound(schema, min_key).filter(|min| len < *min) {
                fail(format!(
                    "Invalid value: {value}: {path} in body should be at least {min} {unit}"
                ));
            }
            if let Some(max) = bound(schema, max_key).filter(|max| len > *max) {
                let shown = if value.is_string() {
                    value.to_string()
                } else {
                    format!("{len}")
                };
                fail(format!(
                    "Too long: {shown}: {path} in body should be at most {max} {unit}"
                ));
            }
        }
    }

    fn walk(&mut self, value: &mut Value, schema: &Value, path: &str, root: bool) {
        if value.is_null() && schema.get("nullable").and_then(Value::as_bool) == Some(true) {
            return;
        }
        let int_or_string = schema
            .get("x-kubernetes-int-or-string")
            .and_then(Value::as_bool)
            == Some(true);
        if let Some(expected) = schema.get("type").and_then(Value::as_str) {
            let ok = type_matches(expected, value)
                || (int_or_string && (value.is_string() || value.is_i64()));
            if !ok {
                self.invalid.push((
                    path.to_string(),
                    format!(
                        "Invalid value: \"{}\": {path} in body must be of type {expected}: \"{}\"",
                        describe(value),
                        describe(value)
                    ),
                ));
                return;
            }
        }
        if let Some(allowed) = schema.get("enum").and_then(Value::as_array) {
            if !allowed.contains(value) {
                self.invalid
                    .push((path.to_string(), format!("Unsupported value: {value}")));
            }
        }
        self.check_bounds(value, schema, path);
        if let (Value::Object(map), Some(properties)) = (
            &mut *value,
            schema.get("properties").and_then(Value::as_object),
        ) {
            // The real server defaults missing properties from the structural schema.
            for (key, property) in properties {
                if let Some(default) = property.get("default") {
                    map.entry(key.clone()).or_insert_with(|| default.clone());
                }
            }
        }
        if schema
            .get("x-kubernetes-preserve-unknown-fields")
            .and_then(Value::as_bool)
            == Some(true)
            || schema
                .get("x-kubernetes-embedded-resource")
                .and_then(Value::as_bool)
                == Some(true)
        {
            return;
        }
        match value {
            Value::Object(map) => {
                for required in schema
                    .get("required")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    if let Some(key) = required.as_str() {
                        if !map.contains_key(key) {
                            let field = child_path(path, key);
                            self.invalid.push((field, "Required value".into()));
                        }
                    }
                }
                let properties = schema.get("properties").and_then(Value::as_object);
                let additional = schema.get("additionalProperties").filter(|a| a.is_object());
                let mut removed = Vec::new();
                for (key, child_value) in map.iter_mut() {
                    let child = child_path(path, key);
                    if root && matches!(key.as_str(), "apiVersion" | "kind" | "metadata") {
                        continue;
                    }
                    if let Some(child_schema) = properties.and_then(|p| p.get(key)) {
                        self.walk(child_value, child_schema, &child, false);
                    } else if let Some(child_schema) = additional {
                        self.walk(child_value, child_schema, &child, false);
                    } else if properties.is_some() || root {
                        removed.push((key.clone(), child));
                    }
                }
                for (key, child) in removed {
                    map.remove(&key);
                    self.unknown.push(child);
                }
            }
            Value::Array(items) => {
                if let Some(item_schema) = schema.get("items") {
                    for (i, item) in items.iter_mut().enumerate() {
                        self.walk(item, item_schema, &format!("{path}[{i}]"), false);
                    }
                }
            }
            _ => {}
        }
    }
}

/// Decodes a custom resource against its schema; unknown fields are removed and returned.
pub fn decode_custom(schema: &Value, object: &mut Value) -> Result<Vec<String>, DecodeError> {
    let mut walk = SchemaWalk {
        unknown: Vec::new(),
        invalid: Vec::new(),
    };
    walk.walk(object, schema, "", true);
    if walk.invalid.is_empty() {
        Ok(walk.unknown)
    } else {
        Err(DecodeError::Invalid(walk.invalid))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn builtin_unknown_fields_are_found_and_pruned() {
        let mut cm = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "a", "bogus": 1},
            "data": {"k": "v"}, "extra": {"x": 1}});
        let lost = decode_builtin("ConfigMap", &mut cm).unwrap();
        assert_eq!(
            lost,
            vec!["metadata.bogus".to_string(), "extra".to_string()]
        );
        assert_eq!(
            cm,
            json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "a"}, "data": {"k": "v"}})
        );
    }

    #[test]
    fn builtin_unknown_nested_list_field() {
        let mut slice = json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "s"},
            "spec": {"driver": "d", "pool": {"name": "p", "generation": 1, "resourceSliceCount": 1}, "nodeName": "n",
                "devices": [{"name": "gpu-0", "colour": "red"}]}});
        let lost = decode_builtin("ResourceSlice", &mut slice).unwrap();
        assert_eq!(lost, vec!["spec.devices[0].colour".to_string()]);
    }

    #[test]
    fn builtin_wrong_type_is_undecodable() {
        let mut cm = json!({"metadata": {"name": "a"}, "data": "not a map"});
        assert!(matches!(
            decode_builtin("ConfigMap", &mut cm),
            Err(DecodeError::Undecodable(_))
        ));
    }

    #[test]
    fn custom_schema_defaults_and_bounds() {
        let schema = json!({"type": "object", "properties": {
            "spec": {"type": "object", "properties": {
                "weight": {"type": "integer", "minimum": 1, "maximum": 1000},
                "preference": {"type": "string", "default": "Strongest", "enum": ["Strongest", "Cheapest"]},
                "models": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 5}}}}}});
        let mut obj = json!({"spec": {"weight": 3}});
        assert!(decode_custom(&schema, &mut obj).unwrap().is_empty());
        assert_eq!(obj["spec"]["preference"], "Strongest");
        let mut bad = json!({"spec": {"weight": 0, "preference": "Fastest", "models": ["a", "b", "toolong"]}});
        let DecodeError::Invalid(errors) = decode_custom(&schema, &mut bad).unwrap_err() else {
            panic!()
        };
        let mut fields: Vec<&str> = errors.iter().map(|(f, _)| f.as_str()).collect();
        fields.sort();
        assert_eq!(
            fields,
            [
                "spec.models",
                "spec.models[2]",
                "spec.preference",
                "spec.weight"
            ]
        );
        let weight = errors.iter().find(|(f, _)| f == "spec.weight").unwrap();
        assert!(
            weight.1.contains("greater than or equal to 1"),
            "{weight:?}"
        );
    }

    #[test]
    fn custom_schema_prunes_and_types() {
        let schema = json!({"type": "object", "properties": {
            "spec": {"type": "object", "required": ["weight"], "properties": {"weight": {"type": "integer"}}},
            "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}});
        let mut obj = json!({"apiVersion": "g/v1", "kind": "X", "metadata": {"name": "a"},
            "spec": {"weight": 3, "colour": "red"}, "status": {"anything": 1}});
        assert_eq!(
            decode_custom(&schema, &mut obj).unwrap(),
            vec!["spec.colour".to_string()]
        );
        assert_eq!(obj["spec"], json!({"weight": 3}));
        assert_eq!(obj["status"], json!({"anything": 1}));
        let mut bad = json!({"spec": {"weight": "heavy"}});
        let DecodeError::Invalid(errors) = decode_custom(&schema, &mut bad).unwrap_err() else {
            panic!()
        };
        assert_eq!(errors[0].0, "spec.weight");
        let mut missing = json!({"spec": {}});
        let DecodeError::Invalid(errors) = decode_custom(&schema, &mut missing).unwrap_err() else {
            panic!()
        };
        assert_eq!(
            errors[0],
            ("spec.weight".to_string(), "Required value".to_string())
        );
    }
}

//! Server-side tables (`Accept: application/json;as=Table;v=v1;g=meta.k8s.io`) that `kubectl get` prints.

use serde_json::{json, Value};

use crate::clock;
use crate::resources::{Columns, PrinterColumn, ResourceDef};
use crate::selectors::split_outside;

struct Column {
    name: &'static str,
    kind: &'static str,
    description: &'static str,
}

const fn col(name: &'static str, kind: &'static str, description: &'static str) -> Column {
    Column {
        name,
        kind,
        description,
    }
}

fn str_at<'a>(object: &'a Value, pointer: &str) -> &'a str {
    object
        .pointer(pointer)
        .and_then(Value::as_str)
        .unwrap_or_default()
}

fn or_none(text: &str) -> String {
    if text.is_empty() {
        "<none>".into()
    } else {
        text.into()
    }
}

fn age(object: &Value) -> Value {
    json!(clock::age(
        object
            .pointer("/metadata/creationTimestamp")
            .and_then(Value::as_str)
    ))
}

fn claim_state(object: &Value) -> String {
    let mut state = Vec::new();
    if object.pointer("/metadata/deletionTimestamp").is_some() {
        state.push("deleted");
    }
    if object
        .pointer("/status/allocation")
        .is_some_and(|a| !a.is_null())
    {
        state.push("allocated");
        if object
            .pointer("/status/reservedFor")
            .and_then(Value::as_array)
            .is_some_and(|r| !r.is_empty())
        {
            state.push("reserved");
        }
    } else {
        state.push("pending");
    }
    state.join(",")
}

fn pod_ready(object: &Value) -> String {
    let total = object
        .pointer("/spec/containers")
        .and_then(Value::as_array)
        .map_or(0, Vec::len);
    let ready = object
        .pointer("/status/containerStatuses")
        .and_then(Value::as_array)
        .map_or(0, |s| {
            s.iter()
                .filter(|c| c.get("ready") == Some(&json!(true)))
                .count()
        });
    format!("{ready}/{total}")
}

fn pod_status(object: &Value) -> String {
    if object.pointer("/metadata/deletionTimestamp").is_some() {
        return "Terminating".into();
    }
    let reason = str_at(object, "/status/reason");
    if !reason.is_empty() {
        return reason.into();
    }
    let waiting = object
        .pointer("/status/containerStatuses")
        .and_then(Value::as_array)
        .and_then(|s| {
            s.iter()
                .find_map(|c| c.pointer("/state/waiting/reason").and_then(Value::as_str))
        });
    waiting
        .map(String::from)
        .unwrap_or_else(|| or_none(str_at(object, "/status/phase")))
}

fn node_status(object: &Value) -> String {
    let ready = object
        .pointer("/status/conditions")
        .and_then(Value::as_array)
        .and_then(|c| c.iter().find(|c| c.get("type") == Some(&json!("Ready"))))
        .and_then(|c| c.get("status"))
        .and_then(Value::as_str);
    match ready {
        Some("True") => "Ready".into(),
        Some("False") => "NotReady".into(),
        _ => "Unknown".into(),
    }
}

fn builtin_columns(kind: &str) -> Vec<Column> {
    let name = col("Name", "string", "Name must be unique within a namespace.");
    let age = col("Age", "string", "CreationTimestamp is a timestamp representing the server time when this object was created.");
    match kind {
        "ResourceSlice" => vec![
            name,
            col("Node", "string", "The node that the devices are local to."),
            col("Driver", "string", "The driver that publishes the slice."),
            col("Pool", "string", "The pool the slice belongs to."),
            age,
        ],
        "ResourceClaim" => vec![
            name,
            col(
                "State",
                "string",
                "pending, allocated or allocated,reserved.",
            ),
            age,
        ],
        "Pod" => vec![
            name,
            col("Ready", "string", "The number of ready containers."),
            col(
                "Status",
                "string",
                "The aggregate status of the containers.",
            ),
            col("Node", "string", "The node the pod is bound to."),
            age,
        ],
        "Node" => vec![
            name,
            col("Status", "string", "The Ready condition."),
            col("Age", "string", "Age"),
            col("Version", "string", "Kubelet version."),
        ],
        "Namespace" => vec![name, col("Status", "string", "The namespace phase."), age],
        "ConfigMap" => vec![name, col("Data", "integer", "Number of data entries."), age],
        "Lease" => vec![name, col("Holder", "string", "The holder identity."), age],
        "Event" => vec![
            col("Last Seen", "string", "Time of the last occurrence."),
            col("Type", "string", "Normal or Warning."),
            col("Reason", "string", "Short reason."),
            col("Object", "string", "The involved object."),
            col("Message", "string", "The message."),
        ],
        "CustomResourceDefinition" => vec![name, col("Created At", "date", "Creation time.")],
        _ => vec![name, age],
    }
}

fn builtin_cells(kind: &str, object: &Value) -> Vec<Value> {
    let name = json!(str_at(object, "/metadata/name"));
    match kind {
        "ResourceSlice" => vec![
            name,
            json!(or_none(str_at(object, "/spec/nodeName"))),
            json!(str_at(object, "/spec/driver")),
            json!(str_at(object, "/spec/pool/name")),
            age(object),
        ],
        "ResourceClaim" => vec![name, json!(claim_state(object)), age(object)],
        "Pod" => vec![
            name,
            json!(pod_ready(object)),
            json!(pod_status(object)),
            json!(or_none(str_at(object, "/spec/nodeName"))),
            age(object),
        ],
        "Node" => vec![
            name,
            json!(node_status(object)),
            age(object),
            json!(str_at(object, "/status/nodeInfo/kubeletVersion")),
        ],
        "Namespace" => vec![name, json!(str_at(object, "/status/phase")), age(object)],
        "ConfigMap" => vec![
            name,
            json!(
                object
                    .get("data")
                    .and_then(Value::as_object)
                    .map_or(0, |d| d.len())
                    + object
                        .get("binaryData")
                        .and_then(Value::as_object)
                        .map_or(0, |d| d.len())
            ),
            age(object),
        ],
        "Lease" => vec![
            name,
            json!(or_none(str_at(object, "/spec/holderIdentity"))),
            age(object),
        ],
        "Event" => {
            let last = [
                "/lastTimestamp",
                "/eventTime",
                "/metadata/creationTimestamp",
            ]
            .iter()
            .find_map(|p| object.pointer(p).and_then(Value::as_str));
            vec![
                json!(clock::age(last)),
                json!(str_at(object, "/type")),
                json!(str_at(object, "/reason")),
                json!(format!(
                    "{}/{}",
                    str_at(object, "/involvedObject/kind").to_lowercase(),
                    str_at(object, "/involvedObject/name")
                )),
                json!(str_at(object, "/message")),
            ]
        }
        "CustomResourceDefinition" => {
            vec![name, json!(str_at(object, "/metadata/creationTimestamp"))]
        }
        _ => vec![name, age(object)],
    }
}

/// Splits a JSONPath on dots outside brackets.
fn path_segments(path: &str) -> Vec<&str> {
    split_outside(path, '.', '[', ']')
        .into_iter()
        .filter(|s| !s.is_empty())
        .collect()
}

/// `?(@.a.b=="v")` as (path, value).
fn parse_filter(index: &str) -> Option<(String, String)> {
    let inner = index.strip_prefix("?(")?.strip_suffix(')')?;
    let (lhs, rhs) = inner.split_once("==")?;
    let path = lhs.trim().strip_prefix('@')?.to_string();
    let value = rhs.trim().trim_matches('"').trim_matches('\'').to_string();
    Some((path, value))
}

/// Evaluates the JSONPath subset CRD printer columns use: `.a.b`, `.a[0].b`, `.a[*].b`,
/// `.a[?(@.type=="Ready")].status`.
pub fn eval_json_path(object: &Value, path: &str) -> Option<Value> {
    let mut current = vec![object.clone()];
    let trimmed = path
        .trim()
        .trim_start_matches('{')
        .trim_end_matches('}')
        .trim_start_matches('$');
    for segment in path_segments(trimmed) {
        let (field, index) = match segment.find('[') {
            Some(i) => (
                &segment[..i],
                Some(&segment[i + 1..segment.len().saturating_sub(1).max(i + 1)]),
            ),
            None => (segment, None),
        };
        let mut next = Vec::new();
        for value in current {
            let value = if field.is_empty() {
                Some(value)
            } else {
                value.get(field).cloned()
            };
            match (value, index) {
                (Some(v), None) => next.push(v),
                (Some(Value::Array(items)), Some("*")) => next.extend(items),
                (Some(Value::Array(items)), Some(i)) if i.starts_with('?') => {
                    if let Some((filter_path, wanted)) = parse_filter(i) {
                        next.extend(items.into_iter().filter(|item| {
                            eval_json_path(item, &filter_path).is_some_and(|v| {
                                v.as_str()
                                    .map(String::from)
                                    .unwrap_or_else(|| v.to_string())
                                    == wanted
                            })
                        }));
                    }
                }
                (Some(Value::Array(items)), Some(i)) => {
                    if let Some(item) = i.parse::<usize>().ok().and_then(|i| items.get(i)) {
                        next.push(item.clone());
                    }
                }
                _ => {}
            }
        }
        current = next;
    }
    match current.len() {
        0 => None,
        1 => current.pop(),
        _ => Some(json!(current
            .iter()
            .map(|v| v
                .as_str()
                .map(String::from)
                .unwrap_or_else(|| v.to_string()))
            .collect::<Vec<_>>()
            .join(","))),
    }
}

fn custom_cell(column: &PrinterColumn, object: &Value) -> Value {
    let value = eval_json_path(object, &column.json_path);
    match (column.column_type.as_str(), value) {
        ("date", Some(Value::String(ts))) => json!(clock::age(Some(&ts))),
        (_, Some(v)) => v,
        (_, None) => Value::Null,
    }
}

fn row_object(object: &Value, include: &str) -> Value {
    match include {
        "Object" => object.clone(),
        "None" => Value::Null,
        _ => json!({
            "kind": "PartialObjectMetadata",
            "apiVersion": "meta.k8s.io/v1",
            "metadata": object.get("metadata").cloned().unwrap_or(json!({})),
        }),
    }
}

/// A `meta.k8s.io/v1` Table of `objects`; `include` is the `includeObject` query parameter.
pub fn table(def: &ResourceDef, objects: &[Value], resource_version: &str, include: &str) -> Value {
    let (definitions, rows): (Vec<Value>, Vec<Value>) = match &def.columns {
        Columns::Builtin => {
            let columns = builtin_columns(&def.kind);
            let defs = columns
                .iter()
                .map(|c| {
                    json!({"name": c.name, "type": c.kind, "format": if c.name == "Name" { "name" } else { "" },
                        "description": c.description, "priority": 0})
                })
                .collect();
            let rows = objects
                .iter()
                .map(|o| json!({"cells": builtin_cells(&def.kind, o), "object": row_object(o, include)}))
                .collect();
            (defs, rows)
        }
        Columns::Custom(columns) => {
            let mut defs = vec![json!({"name": "Name", "type": "string", "format": "name",
                "description": "Name must be unique within a namespace.", "priority": 0})];
            let default_age = [PrinterColumn {
                name: "Age".into(),
                column_type: "date".into(),
                json_path: ".metadata.creationTimestamp".into(),
                description: String::new(),
                priority: 0,
            }];
            let columns: &[PrinterColumn] = if columns.is_empty() {
                &default_age
            } else {
                columns
            };
            defs.extend(columns.iter().map(|c| {
                json!({"name": c.name, "type": c.column_type, "format": "", "description": c.description,
                    "priority": c.priority})
            }));
            let rows = objects
                .iter()
                .map(|o| {
                    let mut cells = vec![json!(str_at(o, "/metadata/name"))];
                    cells.extend(columns.iter().map(|c| custom_cell(c, o)));
                    json!({"cells": cells, "object": row_object(o, include)})
                })
                .collect();
            (defs, rows)
        }
    };
    json!({
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": resource_version},
        "columnDefinitions": definitions,
        "rows": rows,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::builtin_resources;
    use crate::testing::strings;

    fn def(kind: &str) -> ResourceDef {
        builtin_resources()
            .into_iter()
            .find(|d| d.kind == kind)
            .unwrap()
    }

    #[test]
    fn claim_states() {
        let pending = json!({"metadata": {"name": "c"}});
        let allocated =
            json!({"metadata": {"name": "c"}, "status": {"allocation": {"devices": {}}}});
        let reserved = json!({"metadata": {"name": "c"}, "status": {"allocation": {}, "reservedFor": [{"name": "p"}]}});
        assert_eq!(claim_state(&pending), "pending");
        assert_eq!(claim_state(&allocated), "allocated");
        assert_eq!(claim_state(&reserved), "allocated,reserved");
    }

    #[test]
    fn slice_table_columns_and_cells() {
        let slice = json!({"metadata": {"name": "s1", "creationTimestamp": "2020-01-01T00:00:00Z"},
            "spec": {"nodeName": "node-a", "driver": "gpupool.dev", "pool": {"name": "node-a"}}});
        let t = table(&def("ResourceSlice"), &[slice], "7", "");
        let names = strings(&t["columnDefinitions"], "name");
        assert_eq!(names, ["Name", "Node", "Driver", "Pool", "Age"]);
        assert_eq!(
            t["rows"][0]["cells"].as_array().unwrap()[0..4],
            [
                json!("s1"),
                json!("node-a"),
                json!("gpupool.dev"),
                json!("node-a")
            ]
        );
        assert_eq!(t["rows"][0]["object"]["kind"], "PartialObjectMetadata");
    }

    #[test]
    fn json_path_subset() {
        let obj = json!({"spec": {"w": 312, "l": [{"n": "a"}, {"n": "b"}]}});
        assert_eq!(eval_json_path(&obj, ".spec.w"), Some(json!(312)));
        assert_eq!(eval_json_path(&obj, ".spec.l[1].n"), Some(json!("b")));
        assert_eq!(eval_json_path(&obj, ".spec.l[*].n"), Some(json!("a,b")));
        assert_eq!(eval_json_path(&obj, ".spec.missing"), None);
        let status = json!({"status": {"conditions": [{"type": "Synced", "status": "False"}, {"type": "Ready", "status": "True"}]}});
        assert_eq!(
            eval_json_path(&status, r#".status.conditions[?(@.type=="Ready")].status"#),
            Some(json!("True"))
        );
    }
}

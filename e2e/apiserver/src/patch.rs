//! The PATCH bodies the API server accepts: JSON merge patch (RFC 7386), JSON patch (RFC 6902) and a
//! strategic merge patch close enough for kubectl and kube-rs (lists of named objects merge by key).

use serde_json::{Map, Value};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PatchError {
    #[error("invalid JSON patch: {0}")]
    InvalidJsonPatch(String),
    #[error("the JSON patch test operation failed at {0}")]
    TestFailed(String),
    #[error("the JSON patch path {0} does not exist")]
    MissingPath(String),
}

/// RFC 7386: objects merge recursively, `null` deletes, anything else replaces.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(patch_map) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let target_map = target.as_object_mut().expect("object ensured above");
    for (key, value) in patch_map {
        if value.is_null() {
            target_map.remove(key);
        } else {
            merge_patch(target_map.entry(key.clone()).or_insert(Value::Null), value);
        }
    }
}

fn unescape(token: &str) -> String {
    token.replace("~1", "/").replace("~0", "~")
}

fn split_pointer(path: &str) -> Result<(String, String), PatchError> {
    if path.is_empty() {
        return Err(PatchError::InvalidJsonPatch(
            "the root cannot be patched".into(),
        ));
    }
    let idx = path
        .rfind('/')
        .ok_or_else(|| PatchError::InvalidJsonPatch(format!("path {path:?}")))?;
    Ok((path[..idx].to_string(), unescape(&path[idx + 1..])))
}

fn remove_at(doc: &mut Value, path: &str) -> Result<Value, PatchError> {
    let (parent, last) = split_pointer(path)?;
    let missing = || PatchError::MissingPath(path.to_string());
    match doc.pointer_mut(&parent).ok_or_else(missing)? {
        Value::Object(map) => map.remove(&last).ok_or_else(missing),
        Value::Array(items) => {
            let idx: usize = last.parse().map_err(|_| missing())?;
            if idx >= items.len() {
                return Err(missing());
            }
            Ok(items.remove(idx))
        }
        _ => Err(missing()),
    }
}

fn add_at(doc: &mut Value, path: &str, value: Value) -> Result<(), PatchError> {
    if path.is_empty() {
        *doc = value;
        return Ok(());
    }
    let (parent, last) = split_pointer(path)?;
    let missing = || PatchError::MissingPath(path.to_string());
    match doc.pointer_mut(&parent).ok_or_else(missing)? {
        Value::Object(map) => {
            map.insert(last, value);
            Ok(())
        }
        Value::Array(items) => {
            if last == "-" {
                items.push(value);
                return Ok(());
            }
            let idx: usize = last.parse().map_err(|_| missing())?;
            if idx > items.len() {
                return Err(missing());
            }
            items.insert(idx, value);
            Ok(())
        }
        _ => Err(missing()),
    }
}

/// RFC 6902 operations applied in order; any failure leaves the error and no partial result is used.
pub fn json_patch(target: &mut Value, operations: &Value) -> Result<(), PatchError> {
    let ops = operations.as_array().ok_or_else(|| {
        PatchError::InvalidJsonPatch("the body must be a JSON array of operations".into())
    })?;
    let mut doc = target.clone();
    for op in ops {
        let name = op.get("op").and_then(Value::as_str).unwrap_or_default();
        let path = op
            .get("path")
            .and_then(Value::as_str)
            .ok_or_else(|| PatchError::InvalidJsonPatch(format!("operation {op} has no path")))?;
        let value = || {
            op.get("value")
                .cloned()
                .ok_or_else(|| PatchError::InvalidJsonPatch(format!("operation {op} has no value")))
        };
        let from = || {
            op.get("from")
                .and_then(Value::as_str)
                .ok_or_else(|| PatchError::InvalidJsonPatch(format!("operation {op} has no from")))
        };
        match name {
            "add" => add_at(&mut doc, path, value()?)?,
            "remove" => {
                remove_at(&mut doc, path)?;
            }
            "replace" => {
                let slot = doc
                    .pointer_mut(path)
                    .ok_or_else(|| PatchError::MissingPath(path.into()))?;
                *slot = value()?;
            }
            "move" => {
                let moved = remove_at(&mut doc, from()?)?;
                add_at(&mut doc, path, moved)?;
            }
            "copy" => {
                let copied = doc
                    .pointer(from()?)
                    .cloned()
                    .ok_or_else(|| PatchError::MissingPath(path.into()))?;
                add_at(&mut doc, path, copied)?;
            }
            "test" => {
                if doc.pointer(path) != Some(&value()?) {
                    return Err(PatchError::TestFailed(path.into()));
                }
            }
            other => {
                return Err(PatchError::InvalidJsonPatch(format!(
                    "unknown op {other:?}"
                )))
            }
        }
    }
    *target = doc;
    Ok(())
}

/// Keys that Kubernetes types use as `patchMergeKey` for lists of objects.
const MERGE_KEYS: [&str; 7] = [
    "name",
    "type",
    "uid",
    "containerPort",
    "mountPath",
    "devicePath",
    "ip",
];

/// The merge key of a list: the one `$setElementOrder` names, else the first of [`MERGE_KEYS`]
/// that every element of the patch carries.
fn merge_key_of(items: &[Value], order: Option<&Vec<Value>>) -> Option<String> {
    if let Some(key) = order
        .and_then(|o| o.first())
        .and_then(Value::as_object)
        .and_then(|o| o.keys().next())
    {
        return Some(key.clone());
    }
    MERGE_KEYS
        .into_iter()
        .find(|key| {
            !items.is_empty()
                && items
                    .iter()
                    .all(|item| item.as_object().is_some_and(|o| o.contains_key(*key)))
        })
        .map(String::from)
}

/// A strategic merge patch: a merge patch where lists of keyed objects merge element by element, with
/// the `$patch: delete` and `$setElementOrder` directives honoured and other directives dropped.
pub fn strategic_merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(patch_map) = patch else {
        *target = patch.clone();
        return;
    };
    if patch_map.get("$patch").and_then(Value::as_str) == Some("replace") {
        let mut replacement = patch.clone();
        strip_directives(&mut replacement);
        *target = replacement;
        return;
    }
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let target_map = target.as_object_mut().expect("object ensured above");
    for (key, value) in patch_map {
        if key.starts_with('$') {
            continue;
        }
        if value.is_null() {
            target_map.remove(key);
            continue;
        }
        let order = patch_map
            .get(&format!("$setElementOrder/{key}"))
            .and_then(Value::as_array);
        let slot = target_map.entry(key.clone()).or_insert(Value::Null);
        match (slot.as_array_mut(), value.as_array()) {
            (Some(existing), Some(patch_items)) if merge_key_of(patch_items, order).is_some() => {
                let merge_key = merge_key_of(patch_items, order).expect("checked");
                merge_keyed_list(existing, patch_items, &merge_key);
                if let Some(order) = order {
                    reorder(existing, order);
                }
            }
            _ if value.is_object() => strategic_merge_patch(slot, value),
            _ => {
                let mut replacement = value.clone();
                strip_directives(&mut replacement);
                *slot = replacement;
            }
        }
    }
}

fn merge_keyed_list(existing: &mut Vec<Value>, patch_items: &[Value], merge_key: &str) {
    for item in patch_items {
        let key_value = item.get(merge_key);
        let position = existing.iter().position(|e| e.get(merge_key) == key_value);
        let delete = item.get("$patch").and_then(Value::as_str) == Some("delete");
        match (position, delete) {
            (Some(idx), true) => {
                existing.remove(idx);
            }
            (None, true) => {}
            (Some(idx), false) => strategic_merge_patch(&mut existing[idx], item),
            (None, false) => {
                let mut added = item.clone();
                strip_directives(&mut added);
                existing.push(added);
            }
        }
    }
}

/// Orders `items` as `$setElementOrder` lists them (each entry names one merge key and value);
/// items it does not list keep their relative order after the listed ones.
fn reorder(items: &mut Vec<Value>, order: &[Value]) {
    let mut remaining = std::mem::take(items);
    for wanted in order {
        let Some((key, value)) = wanted.as_object().and_then(|o| o.iter().next()) else {
            continue;
        };
        if let Some(idx) = remaining
            .iter()
            .position(|item| item.get(key) == Some(value))
        {
            items.push(remaining.remove(idx));
        }
    }
    items.extend(remaining);
}

fn strip_directives(value: &mut Value) {
    match value {
        Value::Object(map) => {
            map.retain(|k, _| !k.starts_with('$'));
            map.values_mut().for_each(strip_directives);
        }
        Value::Array(items) => items.iter_mut().for_each(strip_directives),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::strings;
    use serde_json::json;

    #[test]
    fn merge_patch_merges_deletes_and_replaces() {
        let mut doc = json!({"a": {"b": 1, "c": 2}, "l": [1, 2]});
        merge_patch(&mut doc, &json!({"a": {"b": null, "d": 3}, "l": [3]}));
        assert_eq!(doc, json!({"a": {"c": 2, "d": 3}, "l": [3]}));
    }

    #[test]
    fn json_patch_operations() {
        let mut doc = json!({"metadata": {"labels": {"a/b": "x"}}, "items": [1, 2]});
        json_patch(
            &mut doc,
            &json!([
                {"op": "test", "path": "/metadata/labels/a~1b", "value": "x"},
                {"op": "replace", "path": "/metadata/labels/a~1b", "value": "y"},
                {"op": "add", "path": "/items/-", "value": 3},
                {"op": "remove", "path": "/items/0"},
                {"op": "copy", "from": "/items", "path": "/copy"},
                {"op": "move", "from": "/copy", "path": "/moved"}
            ]),
        )
        .unwrap();
        assert_eq!(
            doc,
            json!({"metadata": {"labels": {"a/b": "y"}}, "items": [2, 3], "moved": [2, 3]})
        );
    }

    #[test]
    fn failed_json_patch_leaves_document_untouched() {
        let mut doc = json!({"a": 1});
        let err = json_patch(
            &mut doc,
            &json!([{"op": "replace", "path": "/a", "value": 2}, {"op": "test", "path": "/a", "value": 1}]),
        )
        .unwrap_err();
        assert_eq!(err, PatchError::TestFailed("/a".into()));
        assert_eq!(doc, json!({"a": 1}));
        assert!(json_patch(&mut doc, &json!([{"op": "remove", "path": "/nope"}])).is_err());
    }

    #[test]
    fn strategic_patch_orders_by_the_key_set_element_order_names() {
        let mut doc = json!({"volumeMounts": [
            {"name": "a", "mountPath": "/a"}, {"name": "b", "mountPath": "/b"}, {"name": "c", "mountPath": "/c"}]});
        strategic_merge_patch(
            &mut doc,
            &json!({"$setElementOrder/volumeMounts": [{"mountPath": "/a"}, {"mountPath": "/c"}, {"mountPath": "/b"}],
                "volumeMounts": [{"name": "c2", "mountPath": "/c"}]}),
        );
        let paths = strings(&doc["volumeMounts"], "mountPath");
        assert_eq!(paths, ["/a", "/c", "/b"]);
        assert_eq!(
            doc["volumeMounts"][1]["name"], "c2",
            "merged by mountPath, not name"
        );
    }

    #[test]
    fn strategic_patch_merges_named_lists() {
        let mut doc = json!({"spec": {"containers": [{"name": "a", "image": "1"}, {"name": "b", "image": "1"}]}});
        strategic_merge_patch(
            &mut doc,
            &json!({"spec": {
                "$setElementOrder/containers": [{"name": "c"}, {"name": "a"}],
                "containers": [{"name": "a", "image": "2"}, {"name": "b", "$patch": "delete"}, {"name": "c", "image": "3"}]
            }}),
        );
        assert_eq!(
            doc,
            json!({"spec": {"containers": [{"name": "c", "image": "3"}, {"name": "a", "image": "2"}]}})
        );
    }
}

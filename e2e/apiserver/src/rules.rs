//! Update rules of the real API server that gpupool's components can trip over: immutable specs of
//! ResourceClaims and their templates, what a pod update may change, and what a ResourceClaim's
//! status may say (docs/architecture.md, "What a real API server does that the code relies on"). Pure functions.

use std::collections::BTreeSet;

use gpupool_api::validation::is_dns_subdomain;
use serde_json::{Map, Value};

/// (field, message) pairs, as the Invalid status lists its causes.
pub type Causes = Vec<(String, String)>;

/// The largest `status.devices[].data` the real server stores.
pub const MAX_DEVICE_STATUS_DATA_BYTES: usize = 10 * 1024;
pub const MAX_RESERVED_FOR: usize = 256;

const POD_UPDATE_RULE: &str = "Forbidden: pod updates may not change fields other than `spec.containers[*].image`,`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` (only additions to existing tolerations),`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was previously negative)";

fn immutable(field: &str, old: &Value, new: &Value, causes: &mut Causes) {
    let before = old.pointer(&format!("/{}", field.replace('.', "/")));
    let after = new.pointer(&format!("/{}", field.replace('.', "/")));
    if before != after {
        causes.push((
            field.to_string(),
            "Invalid value: field is immutable".to_string(),
        ));
    }
}

/// The pod spec with every field an update may change replaced by `from`'s value.
fn pod_spec_without_mutable(spec: &Value, from: &Value) -> Value {
    let mut masked = spec.clone();
    for list in ["containers", "initContainers"] {
        if let (Some(items), Some(old_items)) = (
            masked.get_mut(list).and_then(Value::as_array_mut),
            from.get(list).and_then(Value::as_array),
        ) {
            for (item, old) in items.iter_mut().zip(old_items) {
                if let (Some(obj), Some(image)) = (item.as_object_mut(), old.get("image")) {
                    obj.insert("image".into(), image.clone());
                }
            }
        }
    }
    if let Some(obj) = masked.as_object_mut() {
        copy_fields(
            obj,
            from,
            &[
                "activeDeadlineSeconds",
                "tolerations",
                "terminationGracePeriodSeconds",
                "schedulingGates",
            ],
        );
    }
    masked
}

/// Makes each of `fields` in `to` what it is in `from`: the same value, or absent.
pub fn copy_fields(to: &mut Map<String, Value>, from: &Value, fields: &[&str]) {
    for &field in fields {
        match from.get(field) {
            Some(value) => to.insert(field.into(), value.clone()),
            None => to.remove(field),
        };
    }
}

fn is_label_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.starts_with(|c: char| c.is_ascii_alphanumeric())
        && s.ends_with(|c: char| c.is_ascii_alphanumeric())
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// Label keys are qualified names and values at most 63 safe characters, like upstream.
pub fn validate_labels(object: &Value) -> Causes {
    let mut causes = Vec::new();
    let Some(labels) = object
        .pointer("/metadata/labels")
        .and_then(Value::as_object)
    else {
        return causes;
    };
    for (key, value) in labels {
        let (prefix, name) = match key.rsplit_once('/') {
            Some((p, n)) => (Some(p), n),
            None => (None, key.as_str()),
        };
        if prefix.is_some_and(|p| !is_dns_subdomain(p)) || !is_label_name(name) {
            causes.push((
                "metadata.labels".into(),
                format!("Invalid value: {key:?}: name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character, with an optional DNS subdomain prefix and '/'"),
            ));
        }
        match value.as_str() {
            Some(text) if text.is_empty() || is_label_name(text) => {}
            _ => causes.push((
                "metadata.labels".into(),
                format!("Invalid value: {value}: a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character"),
            )),
        }
    }
    causes
}

/// No finalizer may be added to an object that is being deleted.
pub fn validate_finalizers(old: &Value, new: &Value) -> Causes {
    if old.pointer("/metadata/deletionTimestamp").is_none() {
        return Vec::new();
    }
    let list = |o: &Value| -> BTreeSet<String> {
        o.pointer("/metadata/finalizers")
            .and_then(Value::as_array)
            .map(|f| {
                f.iter()
                    .filter_map(Value::as_str)
                    .map(String::from)
                    .collect()
            })
            .unwrap_or_default()
    };
    let (before, after) = (list(old), list(new));
    if after.is_subset(&before) {
        Vec::new()
    } else {
        vec![(
            "metadata.finalizers".into(),
            "Forbidden: no new finalizers can be added if the object is being deleted".into(),
        )]
    }
}

/// Rules for replacing `old` with `new` through the main endpoint of a built-in kind.
pub fn validate_update(group: &str, kind: &str, old: &Value, new: &Value) -> Causes {
    let mut causes = Vec::new();
    match (group, kind) {
        ("resource.k8s.io", "ResourceClaim") | ("resource.k8s.io", "ResourceClaimTemplate") => {
            immutable("spec", old, new, &mut causes);
        }
        ("resource.k8s.io", "ResourceSlice") => {
            immutable("spec.nodeName", old, new, &mut causes);
            immutable("spec.driver", old, new, &mut causes);
        }
        ("", "Pod") => {
            let old_spec = old.get("spec").cloned().unwrap_or(Value::Null);
            let new_spec = new.get("spec").cloned().unwrap_or(Value::Null);
            if pod_spec_without_mutable(&new_spec, &old_spec) != old_spec {
                causes.push(("spec".into(), POD_UPDATE_RULE.into()));
            }
        }
        _ => {}
    }
    causes
}

fn device_key(value: &Value) -> (String, String, String, Option<String>) {
    let text = |k: &str| {
        value
            .get(k)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string()
    };
    (
        text("driver"),
        text("pool"),
        text("device"),
        value
            .get("shareID")
            .and_then(Value::as_str)
            .map(String::from),
    )
}

/// What the real server does to a claim update before validating it: `status.devices` entries of
/// devices the update deallocates are dropped, so a driver's status disappears with its allocation
/// without any write of the driver's.
pub fn drop_deallocated_status_devices(old: &Value, new: &mut Value) {
    let results = |claim: &Value| -> BTreeSet<_> {
        claim
            .pointer("/status/allocation/devices/results")
            .and_then(Value::as_array)
            .map(|results| results.iter().map(device_key).collect())
            .unwrap_or_default()
    };
    let (before, after) = (results(old), results(new));
    let gone: BTreeSet<_> = before.difference(&after).collect();
    if gone.is_empty() {
        return;
    }
    if let Some(devices) = new
        .pointer_mut("/status/devices")
        .and_then(Value::as_array_mut)
    {
        devices.retain(|d| !gone.contains(&device_key(d)));
    }
}

/// Upstream's limits on a new-style Event's fields (pkg/apis/core/validation/events.go).
const EVENT_FIELD_LIMIT: usize = 128;
const EVENT_NOTE_LIMIT: usize = 1024;

/// What the real server requires of every core/v1 Event on create (its "legacy" validation, which
/// events.k8s.io/v1 Events pass as well). An Event with `eventTime` (new style: kube-rs's recorder,
/// gpupool's own events) must name its reporting controller (a qualified name) and instance, an
/// action and a reason, each at most 128 characters, with a message of at most 1024; its
/// namespace is its object's, or `default` or `kube-system` for a cluster-scoped object. An old
/// style Event only needs the namespaces to agree (`default` allowed for cluster-scoped objects).
pub fn validate_event(event: &Value) -> Causes {
    let text = |pointer: &str| {
        event
            .pointer(pointer)
            .and_then(Value::as_str)
            .unwrap_or_default()
    };
    let namespace = text("/metadata/namespace");
    let involved_namespace = text("/involvedObject/namespace");
    let mut causes = Causes::new();
    let mismatch = (
        "involvedObject.namespace".to_string(),
        format!("Invalid value: {involved_namespace:?}: does not match event.namespace"),
    );
    if event.get("eventTime").is_none_or(Value::is_null) {
        let agrees = if involved_namespace.is_empty() {
            namespace.is_empty() || namespace == "default"
        } else {
            namespace == involved_namespace
        };
        if !agrees {
            causes.push(mismatch);
        }
        return causes;
    }
    if involved_namespace.is_empty() && !matches!(namespace, "default" | "kube-system") {
        causes.push(mismatch);
    }
    let mut required = |field: &str, limit: usize| {
        let value = text(&format!("/{field}"));
        if value.is_empty() {
            causes.push((field.to_string(), "Required value".to_string()));
        } else if value.chars().count() > limit {
            causes.push((
                field.to_string(),
                format!("Invalid value: \"\": can have at most {limit} characters"),
            ));
        }
    };
    required("reportingComponent", usize::MAX);
    required("reportingInstance", EVENT_FIELD_LIMIT);
    required("action", EVENT_FIELD_LIMIT);
    required("reason", EVENT_FIELD_LIMIT);
    let controller = text("/reportingComponent");
    let (prefix, name) = match controller.rsplit_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, controller),
    };
    if !controller.is_empty()
        && (prefix.is_some_and(|p| !is_dns_subdomain(p)) || !is_label_name(name))
    {
        causes.push((
            "reportingComponent".into(),
            format!("Invalid value: {controller:?}: must be a qualified name"),
        ));
    }
    if text("/message").chars().count() > EVENT_NOTE_LIMIT {
        causes.push((
            "message".into(),
            format!("Invalid value: \"\": can have at most {EVENT_NOTE_LIMIT} characters"),
        ));
    }
    causes
}

/// What a ResourceClaim's status may hold, given the status before the write (None on create).
pub fn validate_claim_status(old: Option<&Value>, new: &Value) -> Causes {
    let mut causes = Vec::new();
    let allocation = new.pointer("/status/allocation").filter(|a| !a.is_null());
    if let Some(old_allocation) = old
        .and_then(|o| o.pointer("/status/allocation"))
        .filter(|a| !a.is_null())
    {
        if let Some(new_allocation) = allocation {
            if new_allocation != old_allocation {
                causes.push((
                    "status.allocation".into(),
                    "Invalid value: field is immutable".into(),
                ));
            }
        }
    }
    let reserved = new
        .pointer("/status/reservedFor")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    if !reserved.is_empty() && allocation.is_none() {
        causes.push((
            "status.reservedFor".into(),
            "Forbidden: may not be specified when `allocated` is not set".into(),
        ));
    }
    if reserved.len() > MAX_RESERVED_FOR {
        causes.push((
            "status.reservedFor".into(),
            format!(
                "Too many: {}: must have at most {MAX_RESERVED_FOR} items",
                reserved.len()
            ),
        ));
    }
    let mut uids = BTreeSet::new();
    for (i, consumer) in reserved.iter().enumerate() {
        let uid = consumer
            .get("uid")
            .and_then(Value::as_str)
            .unwrap_or_default();
        if !uids.insert(uid.to_string()) {
            causes.push((
                format!("status.reservedFor[{i}].uid"),
                format!("Duplicate value: {uid:?}"),
            ));
        }
    }

    let allocated: BTreeSet<_> = allocation
        .and_then(|a| a.pointer("/devices/results"))
        .and_then(Value::as_array)
        .map(|results| results.iter().map(device_key).collect())
        .unwrap_or_default();
    let devices = new
        .pointer("/status/devices")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let mut seen = BTreeSet::new();
    for (i, device) in devices.iter().enumerate() {
        let field = format!("status.devices[{i}]");
        let key = device_key(device);
        if !allocated.contains(&key) {
            causes.push((
                field.clone(),
                format!(
                    "Invalid value: {{driver: {:?}, pool: {:?}, device: {:?}, shareID: {:?}}}: must be an allocated device in the claim",
                    key.0, key.1, key.2, key.3
                ),
            ));
        }
        if !seen.insert(key.clone()) {
            causes.push((
                field.clone(),
                "Duplicate value: the device is listed more than once".into(),
            ));
        }
        if let Some(data) = device.get("data").filter(|d| !d.is_null()) {
            if !data.is_object() {
                causes.push((
                    format!("{field}.data"),
                    "Invalid value: must be a JSON object".into(),
                ));
            } else {
                let size = serde_json::to_vec(data).map_or(0, |b| b.len());
                if size > MAX_DEVICE_STATUS_DATA_BYTES {
                    causes.push((
                        format!("{field}.data"),
                        format!(
                            "Too long: may not be more than {MAX_DEVICE_STATUS_DATA_BYTES} bytes"
                        ),
                    ));
                }
            }
        }
        for (j, condition) in device
            .get("conditions")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .enumerate()
        {
            for required in ["type", "status", "reason", "lastTransitionTime"] {
                if condition
                    .get(required)
                    .and_then(Value::as_str)
                    .is_none_or(str::is_empty)
                {
                    causes.push((
                        format!("{field}.conditions[{j}].{required}"),
                        "Required value".into(),
                    ));
                }
            }
        }
    }
    causes
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_new_style_event_needs_an_action_and_its_reporter() {
        let event = serde_json::json!({
            "metadata": {"name": "node-a.1", "namespace": "default"},
            "involvedObject": {"kind": "Node", "name": "node-a"},
            "eventTime": "2026-12-04T00:00:00.000000Z", "reason": "GpuXidError",
            "reportingComponent": "gpupool.dev/gpupool-driver", "reportingInstance": "node-a",
            "message": "gpu-0: XID 79"});
        let causes = validate_event(&event);
        assert_eq!(
            causes,
            [("action".to_string(), "Required value".to_string())]
        );
        let mut complete = event.clone();
        complete["action"] = "CheckHealth".into();
        assert_eq!(validate_event(&complete), Causes::new());
        // Old-style events (no eventTime) need none of it, only agreeing namespaces.
        let mut old = event.clone();
        old.as_object_mut().unwrap().remove("eventTime");
        assert_eq!(validate_event(&old), Causes::new());
        old["metadata"]["namespace"] = "gpupool".into();
        assert_eq!(validate_event(&old)[0].0, "involvedObject.namespace");
        complete["metadata"]["namespace"] = "gpupool".into();
        assert_eq!(validate_event(&complete)[0].0, "involvedObject.namespace");
    }
    use super::*;
    use serde_json::json;

    fn allocated_claim() -> Value {
        json!({"spec": {"devices": {}}, "status": {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": "gpupool.dev", "pool": "node-a", "device": "gpu-0", "shareID": "s1"}]}}}})
    }

    fn fields(causes: Causes) -> Vec<String> {
        causes.into_iter().map(|(f, _)| f).collect()
    }

    /// The fields an update of a `group` `kind` from `old` to `new` is refused for.
    fn update_causes(group: &str, kind: &str, old: &Value, new: &Value) -> Vec<String> {
        fields(validate_update(group, kind, old, new))
    }

    /// The fields the status of a new claim is refused for.
    fn status_causes(claim: &Value) -> Vec<String> {
        fields(validate_claim_status(None, claim))
    }

    #[test]
    fn claim_and_template_specs_are_immutable() {
        let old = json!({"spec": {"devices": {"requests": [{"name": "a"}]}}});
        let new = json!({"spec": {"devices": {"requests": [{"name": "b"}]}}});
        assert_eq!(
            update_causes("resource.k8s.io", "ResourceClaim", &old, &new),
            ["spec"]
        );
        assert_eq!(
            update_causes("resource.k8s.io", "ResourceClaimTemplate", &old, &new),
            ["spec"]
        );
        assert!(validate_update("resource.k8s.io", "DeviceClass", &old, &new).is_empty());
    }

    #[test]
    fn slice_node_and_driver_are_immutable() {
        let old = json!({"spec": {"nodeName": "a", "driver": "d", "devices": []}});
        let moved =
            json!({"spec": {"nodeName": "b", "driver": "d", "devices": [{"name": "gpu-0"}]}});
        assert_eq!(
            update_causes("resource.k8s.io", "ResourceSlice", &old, &moved),
            ["spec.nodeName"]
        );
    }

    #[test]
    fn pod_updates_may_only_change_images_and_tolerations() {
        let old = json!({"spec": {"containers": [{"name": "c", "image": "a", "env": [{"name": "X", "value": "1"}]}]}});
        let image = json!({"spec": {"containers": [{"name": "c", "image": "b", "env": [{"name": "X", "value": "1"}]}],
            "tolerations": [{"key": "k", "operator": "Exists"}]}});
        assert!(validate_update("", "Pod", &old, &image).is_empty());
        let env = json!({"spec": {"containers": [{"name": "c", "image": "a", "env": [{"name": "X", "value": "2"}]}]}});
        assert_eq!(update_causes("", "Pod", &old, &env), ["spec"]);
        let node = json!({"spec": {"containers": [{"name": "c", "image": "a", "env": [{"name": "X", "value": "1"}]}], "nodeName": "n"}});
        assert_eq!(
            update_causes("", "Pod", &old, &node),
            ["spec"],
            "binding is the way to set nodeName"
        );
    }

    #[test]
    fn label_keys_and_values() {
        let ok = json!({"metadata": {"labels": {"gpupool.dev/model": "A100-SXM4-40GB", "app": "", "a.b_c": "x"}}});
        assert!(validate_labels(&ok).is_empty());
        for bad in [
            json!({"metadata": {"labels": {"app": "has space"}}}),
            json!({"metadata": {"labels": {"Bad_Prefix/x": "v"}}}),
            json!({"metadata": {"labels": {"-x": "v"}}}),
            json!({"metadata": {"labels": {"x": "v".repeat(64)}}}),
        ] {
            assert_eq!(fields(validate_labels(&bad)), ["metadata.labels"], "{bad}");
        }
    }

    #[test]
    fn no_new_finalizers_while_deleting() {
        let deleting =
            json!({"metadata": {"deletionTimestamp": "2025-01-01T00:00:00Z", "finalizers": ["a"]}});
        let added = json!({"metadata": {"finalizers": ["a", "b"]}});
        let removed = json!({"metadata": {"finalizers": []}});
        assert_eq!(
            fields(validate_finalizers(&deleting, &added)),
            ["metadata.finalizers"]
        );
        assert!(validate_finalizers(&deleting, &removed).is_empty());
        assert!(validate_finalizers(&json!({"metadata": {}}), &added).is_empty());
    }

    #[test]
    fn allocation_is_immutable_once_set() {
        let old = allocated_claim();
        let mut moved = old.clone();
        moved["status"]["allocation"]["devices"]["results"][0]["device"] = json!("gpu-1");
        assert_eq!(
            fields(validate_claim_status(Some(&old), &moved)),
            ["status.allocation"]
        );
        let cleared = json!({"status": {}});
        assert!(
            validate_claim_status(Some(&old), &cleared).is_empty(),
            "deallocation is allowed"
        );
    }

    #[test]
    fn reserved_for_needs_an_allocation_and_unique_uids() {
        let claim =
            json!({"status": {"reservedFor": [{"resource": "pods", "name": "p", "uid": "u"}]}});
        assert_eq!(status_causes(&claim), ["status.reservedFor"]);
        let mut twice = allocated_claim();
        twice["status"]["reservedFor"] =
            json!([{"name": "p", "uid": "u"}, {"name": "q", "uid": "u"}]);
        assert_eq!(status_causes(&twice), ["status.reservedFor[1].uid"]);
    }

    #[test]
    fn device_status_names_an_allocated_device_and_share() {
        let mut claim = allocated_claim();
        claim["status"]["devices"] = json!([{"driver": "gpupool.dev", "pool": "node-a", "device": "gpu-0", "shareID": "s1",
            "data": {"limits": {"memory": "8Gi"}},
            "conditions": [{"type": "Ready", "status": "True", "reason": "Prepared", "message": "", "lastTransitionTime": "2025-01-01T00:00:00Z"}]}]);
        assert!(validate_claim_status(None, &claim).is_empty());
        claim["status"]["devices"][0]["shareID"] = json!("other");
        assert_eq!(status_causes(&claim), ["status.devices[0]"]);
    }

    #[test]
    fn deallocation_drops_the_status_of_the_deallocated_devices_only() {
        let mut old = allocated_claim();
        old["status"]["devices"] = json!([
            {"driver": "gpupool.dev", "pool": "node-a", "device": "gpu-0", "shareID": "s1"},
            {"driver": "other.dev", "pool": "node-a", "device": "nic-0"}]);
        let mut new = old.clone();
        new["status"]["allocation"] = Value::Null;
        new["status"]["reservedFor"] = json!([]);
        drop_deallocated_status_devices(&old, &mut new);
        // The other driver's entry names no device of the allocation: validation still refuses it,
        // as the real server does.
        assert_eq!(
            new["status"]["devices"],
            json!([{"driver": "other.dev", "pool": "node-a", "device": "nic-0"}])
        );
        let mut unchanged = old.clone();
        unchanged["status"]["reservedFor"] = json!([{"resource": "pods", "name": "p", "uid": "u"}]);
        drop_deallocated_status_devices(&old, &mut unchanged);
        assert_eq!(unchanged["status"]["devices"], old["status"]["devices"]);
    }

    #[test]
    fn device_status_data_and_conditions() {
        let mut claim = allocated_claim();
        claim["status"]["devices"] = json!([{"driver": "gpupool.dev", "pool": "node-a", "device": "gpu-0", "shareID": "s1",
            "data": {"blob": "x".repeat(MAX_DEVICE_STATUS_DATA_BYTES)},
            "conditions": [{"type": "Ready", "status": "True"}]}]);
        assert_eq!(
            status_causes(&claim),
            [
                "status.devices[0].data",
                "status.devices[0].conditions[0].reason",
                "status.devices[0].conditions[0].lastTransitionTime"
            ]
        );
        claim["status"]["devices"][0]["data"] = json!("not an object");
        claim["status"]["devices"][0]["conditions"] = json!([]);
        assert_eq!(status_causes(&claim), ["status.devices[0].data"]);
    }
}

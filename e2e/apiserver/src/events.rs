//! `events.k8s.io/v1` Events are the core `v1` Events under other field names: the real server keeps
//! one storage and converts, so an Event written by kube-rs' Recorder shows in `kubectl describe`.

use serde_json::{Map, Value};

/// (events.k8s.io/v1 name, core/v1 name) of every renamed field.
const RENAMED: [(&str, &str); 7] = [
    ("regarding", "involvedObject"),
    ("note", "message"),
    ("reportingController", "reportingComponent"),
    ("deprecatedSource", "source"),
    ("deprecatedFirstTimestamp", "firstTimestamp"),
    ("deprecatedLastTimestamp", "lastTimestamp"),
    ("deprecatedCount", "count"),
];

fn rename(object: Value, to_core: bool, api_version: &str) -> Value {
    let Value::Object(map) = object else {
        return object;
    };
    let mut out = Map::new();
    for (key, value) in map {
        let renamed = RENAMED
            .iter()
            .find_map(|(events, core)| {
                if to_core && key == *events {
                    Some(*core)
                } else if !to_core && key == *core {
                    Some(*events)
                } else {
                    None
                }
            })
            .map(String::from)
            .unwrap_or(key);
        out.insert(renamed, value);
    }
    out.insert("apiVersion".into(), Value::String(api_version.into()));
    Value::Object(out)
}

pub fn to_core(object: Value) -> Value {
    rename(object, true, "v1")
}

pub fn from_core(object: Value) -> Value {
    rename(object, false, "events.k8s.io/v1")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn round_trip_renames_fields() {
        let event = json!({"apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": {"name": "e"},
            "regarding": {"kind": "ResourceClaim", "name": "c"}, "note": "no fit", "reason": "Failed",
            "reportingController": "gpupool.dev/scheduler", "deprecatedCount": 2});
        let core = to_core(event.clone());
        assert_eq!(core["involvedObject"]["name"], "c");
        assert_eq!(core["message"], "no fit");
        assert_eq!(core["reportingComponent"], "gpupool.dev/scheduler");
        assert_eq!(core["count"], 2);
        assert_eq!(core["apiVersion"], "v1");
        assert_eq!(from_core(core), event);
    }
}

//! The OpenAPI documents kubectl fetches before `apply`: an index of group-versions and, per
//! group-version, a document without schemas (kubectl then falls back to JSON merge patches).

use serde_json::{json, Value};

use crate::resources::ResourceDef;

fn group_version_paths(defs: &[ResourceDef]) -> Vec<String> {
    let mut paths: Vec<String> = defs
        .iter()
        .map(|d| {
            if d.group.is_empty() {
                format!("api/{}", d.version)
            } else {
                format!("apis/{}/{}", d.group, d.version)
            }
        })
        .collect();
    paths.sort();
    paths.dedup();
    paths
}

/// One PATCH operation per resource, carrying its GVK and the `fieldValidation` parameter: kubectl
/// looks for exactly that to decide that the server validates fields itself (and skips its own
/// validation, which would need full schemas).
fn resource_paths(defs: &[ResourceDef], group_version_path: &str) -> Value {
    let mut paths = serde_json::Map::new();
    for def in defs {
        let prefix = if def.group.is_empty() {
            format!("api/{}", def.version)
        } else {
            format!("apis/{}/{}", def.group, def.version)
        };
        if prefix != group_version_path {
            continue;
        }
        let path = if def.namespaced {
            format!("/{prefix}/namespaces/{{namespace}}/{}/{{name}}", def.plural)
        } else {
            format!("/{prefix}/{}/{{name}}", def.plural)
        };
        let query = |name: &str| json!({"name": name, "in": "query", "schema": {"type": "string", "uniqueItems": true}});
        paths.insert(
            path,
            json!({"patch": {
                "operationId": format!("patch{}", def.kind),
                "parameters": [query("dryRun"), query("fieldManager"), query("fieldValidation"), query("force")],
                "x-kubernetes-action": "patch",
                "x-kubernetes-group-version-kind": {"group": def.group, "version": def.version, "kind": def.kind},
            }}),
        );
    }
    Value::Object(paths)
}

/// The document at `/openapi/<rest>`, or None when there is none.
pub fn serve(defs: &[ResourceDef], rest: &[&str]) -> Option<Value> {
    match rest {
        ["v2"] => Some(json!({
            "swagger": "2.0",
            "info": {"title": "Kubernetes", "version": "v1.34.0"},
            "paths": {},
            "definitions": {},
        })),
        ["v3"] => {
            let paths: serde_json::Map<String, Value> = group_version_paths(defs)
                .into_iter()
                .map(|p| {
                    let url = format!("/openapi/v3/{p}?hash=0");
                    (p, json!({"serverRelativeURL": url}))
                })
                .collect();
            Some(json!({"paths": paths}))
        }
        ["v3", gv @ ..] => {
            let wanted = gv.join("/");
            group_version_paths(defs).contains(&wanted).then(|| {
                json!({
                    "openapi": "3.0.0",
                    "info": {"title": "Kubernetes", "version": "v1.34.0"},
                    "paths": resource_paths(defs, &wanted),
                    "components": {"schemas": {}},
                })
            })
        }
        _ => None,
    }
}

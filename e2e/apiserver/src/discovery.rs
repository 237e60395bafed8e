//! Discovery documents: `/version`, `/api`, `/apis`, per group-version resource lists, and the
//! aggregated form (`apidiscovery.k8s.io/v2`) kubectl asks for first.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use crate::resources::ResourceDef;

const VERBS: [&str; 8] = [
    "create",
    "delete",
    "deletecollection",
    "get",
    "list",
    "patch",
    "update",
    "watch",
];

pub fn version() -> Value {
    json!({
        "major": "1",
        "minor": "34",
        "gitVersion": "v1.34.0-gpupool-emulator",
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "2025-08-27T00:00:00Z",
        "goVersion": "go1.24.0",
        "compiler": "gc",
        "platform": "linux/amd64",
    })
}

pub fn core_versions(server_address: &str) -> Value {
    json!({
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}],
    })
}

/// Group name -> its versions, in first-seen order.
fn groups(defs: &[ResourceDef]) -> BTreeMap<String, Vec<String>> {
    let mut groups: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for def in defs.iter().filter(|d| !d.group.is_empty()) {
        let versions = groups.entry(def.group.clone()).or_default();
        if !versions.contains(&def.version) {
            versions.push(def.version.clone());
        }
    }
    groups
}

fn api_group(name: &str, versions: &[String]) -> Value {
    let versions: Vec<Value> = versions
        .iter()
        .map(|v| json!({"groupVersion": format!("{name}/{v}"), "version": v}))
        .collect();
    json!({"name": name, "versions": versions, "preferredVersion": versions[0]})
}

pub fn group_list(defs: &[ResourceDef]) -> Value {
    let groups: Vec<Value> = groups(defs)
        .iter()
        .map(|(name, versions)| api_group(name, versions))
        .collect();
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
}

pub fn group(defs: &[ResourceDef], name: &str) -> Option<Value> {
    let groups = groups(defs);
    let versions = groups.get(name)?;
    let mut group = api_group(name, versions);
    group["kind"] = json!("APIGroup");
    group["apiVersion"] = json!("v1");
    Some(group)
}

/// The APIResourceList of one group/version, or None when nothing is served there.
pub fn resource_list(defs: &[ResourceDef], group: &str, version: &str) -> Option<Value> {
    let mut resources = Vec::new();
    for def in defs
        .iter()
        .filter(|d| d.group == group && d.version == version)
    {
        resources.push(json!({
            "name": def.plural,
            "singularName": def.singular,
            "namespaced": def.namespaced,
            "kind": def.kind,
            "verbs": VERBS,
            "shortNames": def.short_names,
            "categories": def.categories,
        }));
        if def.status_subresource {
            resources.push(json!({
                "name": format!("{}/status", def.plural),
                "singularName": "",
                "namespaced": def.namespaced,
                "kind": def.kind,
                "verbs": ["get", "patch", "update"],
            }));
        }
        if def.group.is_empty() && def.plural == "pods" {
            resources.push(
                json!({"name": "pods/binding", "singularName": "", "namespaced": true,
                "kind": "Binding", "verbs": ["create"]}),
            );
        }
    }
    if resources.is_empty() {
        return None;
    }
    let group_version = if group.is_empty() {
        version.to_string()
    } else {
        format!("{group}/{version}")
    };
    Some(
        json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version, "resources": resources}),
    )
}

fn aggregated_resource(def: &ResourceDef) -> Value {
    let mut subresources = Vec::new();
    if def.status_subresource {
        subresources.push(json!({"subresource": "status", "responseKind": {"group": def.group, "version": def.version, "kind": def.kind}, "verbs": ["get", "patch", "update"]}));
    }
    if def.group.is_empty() && def.plural == "pods" {
        subresources.push(json!({"subresource": "binding", "responseKind": {"group": "", "version": "v1", "kind": "Binding"}, "verbs": ["create"]}));
    }
    let mut resource = json!({
        "resource": def.plural,
        "responseKind": {"group": def.group, "version": def.version, "kind": def.kind},
        "scope": if def.namespaced { "Namespaced" } else { "Cluster" },
        "singularResource": def.singular,
        "verbs": VERBS,
    });
    if !def.short_names.is_empty() {
        resource["shortNames"] = json!(def.short_names);
    }
    if !def.categories.is_empty() {
        resource["categories"] = json!(def.categories);
    }
    if !subresources.is_empty() {
        resource["subresources"] = json!(subresources);
    }
    resource
}

/// `apidiscovery.k8s.io/<version>` APIGroupDiscoveryList for `/api` (core) or `/apis` (named groups).
pub fn aggregated(defs: &[ResourceDef], core: bool, discovery_version: &str) -> Value {
    let mut items = Vec::new();
    if core {
        let resources: Vec<Value> = defs
            .iter()
            .filter(|d| d.group.is_empty())
            .map(aggregated_resource)
            .collect();
        items.push(json!({"metadata": {"creationTimestamp": null},
            "versions": [{"version": "v1", "resources": resources, "freshness": "Current"}]}));
    } else {
        for (name, versions) in groups(defs) {
            let versions: Vec<Value> = versions
                .iter()
                .map(|v| {
                    let resources: Vec<Value> = defs
                        .iter()
                        .filter(|d| d.group == name && &d.version == v)
                        .map(aggregated_resource)
                        .collect();
                    json!({"version": v, "resources": resources, "freshness": "Current"})
                })
                .collect();
            items.push(json!({"metadata": {"name": name, "creationTimestamp": null}, "versions": versions}));
        }
    }
    json!({
        "kind": "APIGroupDiscoveryList",
        "apiVersion": format!("apidiscovery.k8s.io/{discovery_version}"),
        "metadata": {},
        "items": items,
    })
}

/// The discovery version to answer with when the Accept header asks for aggregated discovery.
pub fn wants_aggregated(accept: &str) -> Option<&'static str> {
    for media in accept.split(',') {
        if !media.contains("as=APIGroupDiscoveryList") {
            continue;
        }
        if media.contains("v=v2beta1") {
            return Some("v2beta1");
        }
        if media.contains("v=v2") {
            return Some("v2");
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::builtin_resources;
    use crate::testing::strings;

    #[test]
    fn resource_list_includes_status_subresource() {
        let list = resource_list(&builtin_resources(), "resource.k8s.io", "v1").unwrap();
        let names = strings(&list["resources"], "name");
        assert!(names.contains(&"resourceclaims/status"));
        assert!(names.contains(&"resourceslices"));
        assert!(resource_list(&builtin_resources(), "nope.dev", "v1").is_none());
    }

    #[test]
    fn aggregated_accept_header() {
        let accept = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList,application/json;g=apidiscovery.k8s.io;v=v2beta1;as=APIGroupDiscoveryList,application/json";
        assert_eq!(wants_aggregated(accept), Some("v2"));
        assert_eq!(wants_aggregated("application/json"), None);
    }
}

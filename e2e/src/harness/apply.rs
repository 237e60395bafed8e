//! Applying YAML manifests through the kube client, for when the real kubectl is not at hand.

use kube::api::{DynamicObject, Patch, PatchParams, PostParams};
use kube::core::GroupVersionKind;
use kube::discovery::{pinned_kind, Scope};
use kube::{Api, Client};
use serde_json::Value;

#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    #[error("document {index}: not valid YAML: {source}")]
    Yaml {
        index: usize,
        #[source]
        source: serde_yaml::Error,
    },
    #[error("document {index}: missing {field}")]
    MissingField { index: usize, field: &'static str },
    #[error("{kind} {name}: {source}")]
    Kube {
        kind: String,
        name: String,
        #[source]
        source: kube::Error,
    },
}

/// The objects of a multi-document YAML stream, skipping empty documents; `List` kinds are flattened.
pub fn parse_manifests(yaml: &str) -> Result<Vec<Value>, ApplyError> {
    let mut objects = Vec::new();
    for (index, document) in serde_yaml::Deserializer::from_str(yaml).enumerate() {
        let value: Value = serde::Deserialize::deserialize(document)
            .map_err(|source| ApplyError::Yaml { index, source })?;
        match value {
            Value::Null => {}
            Value::Object(ref map) if map.get("kind").and_then(Value::as_str) == Some("List") => {
                if let Some(items) = map.get("items").and_then(Value::as_array) {
                    objects.extend(items.iter().cloned());
                }
            }
            other => objects.push(other),
        }
    }
    for (index, object) in objects.iter().enumerate() {
        for field in ["apiVersion", "kind"] {
            if object.get(field).and_then(Value::as_str).is_none() {
                return Err(ApplyError::MissingField { index, field });
            }
        }
        let named = object.pointer("/metadata/name").is_some()
            || object.pointer("/metadata/generateName").is_some();
        if !named {
            return Err(ApplyError::MissingField {
                index,
                field: "metadata.name",
            });
        }
    }
    Ok(objects)
}

fn gvk_of(object: &Value) -> GroupVersionKind {
    let api_version = object["apiVersion"].as_str().unwrap_or_default();
    let kind = object["kind"].as_str().unwrap_or_default();
    let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
    GroupVersionKind::gvk(group, version, kind)
}

/// Creates each object, or merge-patches it when it exists; namespaced objects without a namespace
/// go to `default_namespace`. Objects are applied in order, so a CRD must come before its objects.
pub async fn apply_objects(
    client: &Client,
    objects: &[Value],
    default_namespace: &str,
) -> Result<Vec<DynamicObject>, ApplyError> {
    let mut applied = Vec::new();
    for object in objects {
        let gvk = gvk_of(object);
        let name = object
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let kube_err = |source| ApplyError::Kube {
            kind: gvk.kind.clone(),
            name: name.clone(),
            source,
        };
        let (resource, caps) = pinned_kind(client, &gvk).await.map_err(kube_err)?;
        let api: Api<DynamicObject> = if caps.scope == Scope::Namespaced {
            let ns = object
                .pointer("/metadata/namespace")
                .and_then(Value::as_str)
                .unwrap_or(default_namespace);
            Api::namespaced_with(client.clone(), ns, &resource)
        } else {
            Api::all_with(client.clone(), &resource)
        };
        let dynamic: DynamicObject =
            serde_json::from_value(object.clone()).expect("a checked manifest is a DynamicObject");
        let result = match api.create(&PostParams::default(), &dynamic).await {
            Err(kube::Error::Api(status)) if status.code == 409 && !name.is_empty() => api
                .patch(&name, &PatchParams::default(), &Patch::Merge(object))
                .await
                .map_err(kube_err)?,
            other => other.map_err(kube_err)?,
        };
        applied.push(result);
    }
    Ok(applied)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_documents_and_flattens_lists() {
        let yaml = "---\napiVersion: v1\nkind: Namespace\nmetadata: {name: a}\n---\n\n---\n\
                    apiVersion: v1\nkind: List\nitems:\n- {apiVersion: v1, kind: ConfigMap, metadata: {name: b}}\n";
        let objects = parse_manifests(yaml).unwrap();
        let names: Vec<&str> = objects
            .iter()
            .map(|o| o["metadata"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["a", "b"]);
    }

    #[test]
    fn an_object_without_kind_or_name_is_refused_naming_the_field() {
        let err = parse_manifests("apiVersion: v1\nmetadata: {name: a}\n").unwrap_err();
        assert_eq!(err.to_string(), "document 0: missing kind");
        let err = parse_manifests("apiVersion: v1\nkind: Pod\nmetadata: {}\n").unwrap_err();
        assert_eq!(err.to_string(), "document 0: missing metadata.name");
    }

    #[test]
    fn group_and_version_come_from_api_version() {
        let gvk =
            gvk_of(&serde_json::json!({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass"}));
        assert_eq!(
            (gvk.group.as_str(), gvk.version.as_str()),
            ("resource.k8s.io", "v1")
        );
        let core = gvk_of(&serde_json::json!({"apiVersion": "v1", "kind": "Pod"}));
        assert_eq!((core.group.as_str(), core.version.as_str()), ("", "v1"));
    }
}

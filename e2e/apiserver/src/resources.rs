//! What the emulator serves: the built-in resources and those that CustomResourceDefinitions add.

use serde_json::Value;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CrdError {
    #[error("{field}: {message}")]
    Invalid { field: String, message: String },
}

/// A printer column of a custom resource (`additionalPrinterColumns`).
#[derive(Debug, Clone, PartialEq)]
pub struct PrinterColumn {
    pub name: String,
    pub column_type: String,
    pub json_path: String,
    pub description: String,
    pub priority: i64,
}

/// Which table a `kubectl get` of this resource shows.
#[derive(Debug, Clone, PartialEq)]
pub enum Columns {
    Builtin,
    Custom(Vec<PrinterColumn>),
}

/// One resource at one group/version.
#[derive(Debug, Clone, PartialEq)]
pub struct ResourceDef {
    /// "" for the core group.
    pub group: String,
    pub version: String,
    pub plural: String,
    pub singular: String,
    pub kind: String,
    pub namespaced: bool,
    pub short_names: Vec<String>,
    pub categories: Vec<String>,
    pub status_subresource: bool,
    pub columns: Columns,
    /// The CRD's openAPIV3Schema for this version; None for built-in kinds.
    pub schema: Option<Value>,
}

impl ResourceDef {
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// `plural.group` (or `plural` in the core group), as error messages name a resource.
    pub fn qualified_plural(&self) -> String {
        if self.group.is_empty() {
            self.plural.clone()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }

    /// `Kind.group` as Invalid errors name a kind.
    pub fn qualified_kind(&self) -> String {
        if self.group.is_empty() {
            self.kind.clone()
        } else {
            format!("{}.{}", self.kind, self.group)
        }
    }

    /// Objects of one resource share storage across the versions they are served at.
    pub fn storage_key(&self) -> (String, String) {
        if self.is_events_alias() {
            return (String::new(), "events".into());
        }
        (self.group.clone(), self.plural.clone())
    }

    /// `events.k8s.io/v1` Events, stored as core Events.
    pub fn is_events_alias(&self) -> bool {
        self.group == "events.k8s.io" && self.plural == "events"
    }

    pub fn is_custom(&self) -> bool {
        self.schema.is_some() || matches!(self.columns, Columns::Custom(_))
    }
}

fn builtin(
    group: &str,
    plural: &str,
    kind: &str,
    namespaced: bool,
    short: &[&str],
    status: bool,
) -> ResourceDef {
    ResourceDef {
        group: group.into(),
        version: "v1".into(),
        plural: plural.into(),
        singular: kind.to_lowercase(),
        kind: kind.into(),
        namespaced,
        short_names: short.iter().map(|s| s.to_string()).collect(),
        categories: if plural == "pods" {
            vec!["all".into()]
        } else {
            Vec::new()
        },
        status_subresource: status,
        columns: Columns::Builtin,
        schema: None,
    }
}

/// A built-in resource: plural, kind, namespaced, short names, status subresource.
type Builtin = (
    &'static str,
    &'static str,
    bool,
    &'static [&'static str],
    bool,
);

/// The built-in resources by API group, in the order discovery lists them.
const BUILTINS: &[(&str, &[Builtin])] = &[
    (
        "",
        &[
            ("namespaces", "Namespace", false, &["ns"], true),
            ("nodes", "Node", false, &["no"], true),
            ("pods", "Pod", true, &["po"], true),
            ("events", "Event", true, &["ev"], false),
            ("configmaps", "ConfigMap", true, &["cm"], false),
        ],
    ),
    (
        "resource.k8s.io",
        &[
            ("deviceclasses", "DeviceClass", false, &[], false),
            ("resourceclaims", "ResourceClaim", true, &[], true),
            (
                "resourceclaimtemplates",
                "ResourceClaimTemplate",
                true,
                &[],
                false,
            ),
            ("resourceslices", "ResourceSlice", false, &[], false),
        ],
    ),
    (
        "coordination.k8s.io",
        &[("leases", "Lease", true, &[], false)],
    ),
    ("events.k8s.io", &[("events", "Event", true, &[], false)]),
    // What gpupool's deploy/ manifests create, so they can be applied to the emulator.
    (
        "",
        &[
            ("serviceaccounts", "ServiceAccount", true, &["sa"], false),
            ("secrets", "Secret", true, &[], false),
            ("services", "Service", true, &["svc"], true),
        ],
    ),
    (
        "apps",
        &[
            ("deployments", "Deployment", true, &["deploy"], true),
            ("daemonsets", "DaemonSet", true, &["ds"], true),
        ],
    ),
    (
        "rbac.authorization.k8s.io",
        &[
            ("clusterroles", "ClusterRole", false, &[], false),
            (
                "clusterrolebindings",
                "ClusterRoleBinding",
                false,
                &[],
                false,
            ),
            ("roles", "Role", true, &[], false),
            ("rolebindings", "RoleBinding", true, &[], false),
        ],
    ),
    (
        "admissionregistration.k8s.io",
        &[
            (
                "validatingadmissionpolicies",
                "ValidatingAdmissionPolicy",
                false,
                &[],
                true,
            ),
            (
                "validatingadmissionpolicybindings",
                "ValidatingAdmissionPolicyBinding",
                false,
                &[],
                false,
            ),
            // Stored and decoded strictly, never called: the emulator has no admission chain, so
            // what a webhook refuses is tested on the real kube-apiserver (e2e/tests/webhook.rs).
            (
                "validatingwebhookconfigurations",
                "ValidatingWebhookConfiguration",
                false,
                &[],
                false,
            ),
        ],
    ),
    (
        "apiextensions.k8s.io",
        &[(
            "customresourcedefinitions",
            "CustomResourceDefinition",
            false,
            &["crd", "crds"],
            true,
        )],
    ),
];

/// Whether the real server keeps `metadata.generation` for objects of `def` (set to 1 on create,
/// bumped when the spec changes): the built-in kinds whose strategy tracks it (observed on
/// kube-apiserver 1.36 for the kinds gpupool meets) and every custom resource. A ResourceClaim,
/// a Node or a ConfigMap, among others, has no generation at all.
pub fn tracks_generation(def: &ResourceDef) -> bool {
    let builtin = BUILTINS.iter().any(|(group, resources)| {
        *group == def.group && resources.iter().any(|r| r.0 == def.plural)
    });
    !builtin
        || matches!(
            (def.group.as_str(), def.kind.as_str()),
            ("", "Pod")
                | ("resource.k8s.io", "DeviceClass" | "ResourceSlice")
                | ("apps", "Deployment" | "DaemonSet")
                | (
                    "admissionregistration.k8s.io",
                    "ValidatingAdmissionPolicy"
                        | "ValidatingAdmissionPolicyBinding"
                        | "ValidatingWebhookConfiguration"
                )
                | ("apiextensions.k8s.io", "CustomResourceDefinition")
        )
}

pub fn builtin_resources() -> Vec<ResourceDef> {
    BUILTINS
        .iter()
        .flat_map(|(group, resources)| {
            resources
                .iter()
                .map(move |&(plural, kind, namespaced, short, status)| {
                    builtin(group, plural, kind, namespaced, short, status)
                })
        })
        .collect()
}

fn string_list(value: Option<&Value>) -> Vec<String> {
    value
        .and_then(Value::as_array)
        .map(|items| {
            items
                .iter()
                .filter_map(Value::as_str)
                .map(String::from)
                .collect()
        })
        .unwrap_or_default()
}

fn required_str<'a>(crd: &'a Value, pointer: &str, field: &str) -> Result<&'a str, CrdError> {
    crd.pointer(pointer)
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .ok_or_else(|| CrdError::Invalid {
            field: field.into(),
            message: "Required value".into(),
        })
}

/// The resources a CRD object serves, one per served version.
pub fn crd_resources(crd: &Value) -> Result<Vec<ResourceDef>, CrdError> {
    let group = required_str(crd, "/spec/group", "spec.group")?;
    let plural = required_str(crd, "/spec/names/plural", "spec.names.plural")?;
    let kind = required_str(crd, "/spec/names/kind", "spec.names.kind")?;
    let name = crd
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if name != format!("{plural}.{group}") {
        return Err(CrdError::Invalid {
            field: "metadata.name".into(),
            message: format!("Invalid value: {name:?}: must be spec.names.plural+\".\"+spec.group"),
        });
    }
    let namespaced = match crd.pointer("/spec/scope").and_then(Value::as_str) {
        Some("Namespaced") => true,
        Some("Cluster") => false,
        other => {
            return Err(CrdError::Invalid {
                field: "spec.scope".into(),
                message: format!(
                    "Unsupported value: {other:?}: supported values: \"Cluster\", \"Namespaced\""
                ),
            })
        }
    };
    let singular = crd
        .pointer("/spec/names/singular")
        .and_then(Value::as_str)
        .map(String::from)
        .unwrap_or_else(|| kind.to_lowercase());
    let versions = crd
        .pointer("/spec/versions")
        .and_then(Value::as_array)
        .filter(|v| !v.is_empty())
        .ok_or_else(|| CrdError::Invalid {
            field: "spec.versions".into(),
            message: "Invalid value: must have exactly one version marked as storage version"
                .into(),
        })?;
    let mut defs = Vec::new();
    for (i, version) in versions.iter().enumerate() {
        let version_name = required_str(version, "/name", &format!("spec.versions[{i}].name"))?;
        if !version
            .get("served")
            .and_then(Value::as_bool)
            .unwrap_or(false)
        {
            continue;
        }
        let columns = version
            .get("additionalPrinterColumns")
            .and_then(Value::as_array)
            .map(|cols| {
                cols.iter()
                    .map(|c| {
                        let text = |key: &str, default: &str| {
                            c.get(key)
                                .and_then(Value::as_str)
                                .unwrap_or(default)
                                .to_string()
                        };
                        PrinterColumn {
                            name: text("name", ""),
                            column_type: text("type", "string"),
                            json_path: text("jsonPath", ""),
                            description: text("description", ""),
                            priority: c.get("priority").and_then(Value::as_i64).unwrap_or(0),
                        }
                    })
                    .collect()
            })
            .unwrap_or_default();
        defs.push(ResourceDef {
            group: group.into(),
            version: version_name.into(),
            plural: plural.into(),
            singular: singular.clone(),
            kind: kind.into(),
            namespaced,
            short_names: string_list(crd.pointer("/spec/names/shortNames")),
            categories: string_list(crd.pointer("/spec/names/categories")),
            status_subresource: version.pointer("/subresources/status").is_some(),
            columns: Columns::Custom(columns),
            schema: Some(
                version
                    .pointer("/schema/openAPIV3Schema")
                    .cloned()
                    .unwrap_or_else(|| serde_json::json!({"type": "object", "x-kubernetes-preserve-unknown-fields": true})),
            ),
        });
    }
    Ok(defs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn crd_serves_each_served_version() {
        let crd = json!({
            "metadata": {"name": "gpumodels.gpupool.dev"},
            "spec": {"group": "gpupool.dev", "scope": "Cluster",
                "names": {"plural": "gpumodels", "kind": "GpuModel", "shortNames": ["gm"]},
                "versions": [
                    {"name": "v1alpha1", "served": true, "storage": true, "subresources": {"status": {}},
                     "additionalPrinterColumns": [{"name": "Weight", "type": "integer", "jsonPath": ".spec.computeWeight"}]},
                    {"name": "v0", "served": false, "storage": false}
                ]}
        });
        let defs = crd_resources(&crd).unwrap();
        assert_eq!(defs.len(), 1);
        assert_eq!(defs[0].api_version(), "gpupool.dev/v1alpha1");
        assert!(!defs[0].namespaced && defs[0].status_subresource);
        assert_eq!(defs[0].singular, "gpumodel");
        assert_eq!(defs[0].short_names, vec!["gm".to_string()]);
    }

    #[test]
    fn crd_name_must_match_names() {
        let crd = json!({"metadata": {"name": "wrong"}, "spec": {"group": "g.dev", "scope": "Cluster",
            "names": {"plural": "xs", "kind": "X"}, "versions": [{"name": "v1", "served": true}]}});
        let CrdError::Invalid { field, .. } = crd_resources(&crd).unwrap_err();
        assert_eq!(field, "metadata.name");
    }
}

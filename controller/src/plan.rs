//! What to change in the cluster: desired objects against existing ones. Pure.
//!
//! A managed object is rewritten when the spec we last wrote (its hash annotation) differs from the one we
//! want now, or when someone edited a field we set; fields the API server defaults on its own are not a
//! difference. Objects without our managed-by label are never touched.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaimTemplate};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Serialize;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::models::{MANAGED_BY_LABEL, MANAGER};
use crate::profiles::PROFILE_LABEL;

/// Hash of the spec the controller last wrote into an object.
pub const SPEC_HASH_ANNOTATION: &str = "gpupool.dev/spec-hash";

pub fn spec_hash<T: Serialize>(spec: &T) -> String {
    let bytes = serde_json::to_vec(spec).expect("specs serialise");
    hex::encode(&Sha256::digest(&bytes)[..8])
}

/// Whether every field set in `wanted` has the same value in `actual` (arrays element by element).
pub fn json_contains(wanted: &Value, actual: &Value) -> bool {
    match (wanted, actual) {
        (Value::Null, _) => true,
        (Value::Object(w), Value::Object(a)) => w
            .iter()
            .all(|(k, v)| v.is_null() || a.get(k).is_some_and(|av| json_contains(v, av))),
        (Value::Array(w), Value::Array(a)) => {
            w.len() == a.len() && w.iter().zip(a).all(|(wv, av)| json_contains(wv, av))
        }
        (w, a) => w == a,
    }
}

pub fn is_managed(meta: &ObjectMeta) -> bool {
    meta.labels
        .as_ref()
        .and_then(|l| l.get(MANAGED_BY_LABEL))
        .is_some_and(|v| v == MANAGER)
}

fn stamp(meta: &mut ObjectMeta, hash: String) {
    meta.annotations
        .get_or_insert_with(BTreeMap::new)
        .insert(SPEC_HASH_ANNOTATION.to_string(), hash);
}

/// Stamp a class whose spec was changed after diffing (e.g. a field the API refused was dropped).
pub fn restamp_class(class: &mut DeviceClass) {
    let hash = spec_hash(&class.spec);
    stamp(&mut class.metadata, hash);
}

fn metadata_differs(wanted: &ObjectMeta, actual: &ObjectMeta) -> bool {
    let labels_differ = !wanted
        .labels
        .iter()
        .flatten()
        .all(|(k, v)| actual.labels.as_ref().and_then(|l| l.get(k)) == Some(v));
    let owner_uids = |m: &ObjectMeta| -> BTreeSet<String> {
        m.owner_references
            .iter()
            .flatten()
            .map(|o| o.uid.clone())
            .collect()
    };
    let hash = |m: &ObjectMeta| {
        m.annotations
            .as_ref()
            .and_then(|a| a.get(SPEC_HASH_ANNOTATION))
            .cloned()
    };
    labels_differ || owner_uids(wanted) != owner_uids(actual) || hash(wanted) != hash(actual)
}

fn spec_differs<T: Serialize>(wanted: &T, actual: &T) -> bool {
    let wanted = serde_json::to_value(wanted).expect("specs serialise");
    let actual = serde_json::to_value(actual).expect("specs serialise");
    !json_contains(&wanted, &actual)
}

#[derive(Debug, Clone, PartialEq)]
pub enum ClassAction {
    Create(DeviceClass),
    /// Carries the existing object's resourceVersion.
    Replace(DeviceClass),
    Delete(String),
    /// A class of that name exists and is not ours: left alone.
    Foreign(String),
}

/// Changes that turn `existing` DeviceClasses into `desired`.
pub fn diff_classes(desired: &[DeviceClass], existing: &[DeviceClass]) -> Vec<ClassAction> {
    let by_name: BTreeMap<&str, &DeviceClass> = existing
        .iter()
        .filter_map(|c| Some((c.metadata.name.as_deref()?, c)))
        .collect();
    let mut actions = Vec::new();
    let mut wanted_names = BTreeSet::new();
    for class in desired {
        let name = class.metadata.name.clone().unwrap_or_default();
        wanted_names.insert(name.clone());
        let mut wanted = class.clone();
        stamp(&mut wanted.metadata, spec_hash(&class.spec));
        match by_name.get(name.as_str()) {
            None => actions.push(ClassAction::Create(wanted)),
            Some(current) if !is_managed(&current.metadata) => {
                actions.push(ClassAction::Foreign(name))
            }
            Some(current) => {
                if metadata_differs(&wanted.metadata, &current.metadata)
                    || spec_differs(&wanted.spec, &current.spec)
                {
                    wanted.metadata.resource_version = current.metadata.resource_version.clone();
                    actions.push(ClassAction::Replace(wanted));
                }
            }
        }
    }
    for class in existing {
        if let Some(name) = class.metadata.name.as_deref() {
            if is_managed(&class.metadata) && !wanted_names.contains(name) {
                actions.push(ClassAction::Delete(name.to_string()));
            }
        }
    }
    actions
}

#[derive(Debug, Clone, PartialEq)]
pub enum TemplateAction {
    Create(ResourceClaimTemplate),
    /// Only metadata changed (labels, owners); carries the existing resourceVersion.
    Replace(ResourceClaimTemplate),
    /// The spec changed: it is immutable, so delete the old one and create this.
    Recreate(ResourceClaimTemplate),
    Delete {
        namespace: String,
        name: String,
    },
    Foreign {
        namespace: String,
        name: String,
    },
}

fn key(meta: &ObjectMeta) -> (String, String) {
    (
        meta.namespace.clone().unwrap_or_default(),
        meta.name.clone().unwrap_or_default(),
    )
}

/// Changes that turn `existing` ResourceClaimTemplates into `desired`. Only templates labelled as
/// coming from a ComputeProfile and managed by us are deleted.
pub fn diff_templates(
    desired: &[ResourceClaimTemplate],
    existing: &[ResourceClaimTemplate],
) -> Vec<TemplateAction> {
    let by_key: BTreeMap<(String, String), &ResourceClaimTemplate> =
        existing.iter().map(|t| (key(&t.metadata), t)).collect();
    let mut actions = Vec::new();
    let mut wanted_keys = BTreeSet::new();
    for template in desired {
        let k = key(&template.metadata);
        wanted_keys.insert(k.clone());
        let mut wanted = template.clone();
        stamp(&mut wanted.metadata, spec_hash(&template.spec));
        match by_key.get(&k) {
            None => actions.push(TemplateAction::Create(wanted)),
            Some(current) if !is_managed(&current.metadata) => {
                actions.push(TemplateAction::Foreign {
                    namespace: k.0,
                    name: k.1,
                })
            }
            Some(current) => {
                let hash = |m: &ObjectMeta| {
                    m.annotations
                        .as_ref()
                        .and_then(|a| a.get(SPEC_HASH_ANNOTATION))
                        .cloned()
                };
                if hash(&wanted.metadata) != hash(&current.metadata)
                    || spec_differs(&wanted.spec, &current.spec)
                {
                    actions.push(TemplateAction::Recreate(wanted));
                } else if metadata_differs(&wanted.metadata, &current.metadata) {
                    wanted.metadata.resource_version = current.metadata.resource_version.clone();
                    actions.push(TemplateAction::Replace(wanted));
                }
            }
        }
    }
    for template in existing {
        let from_profile = template
            .metadata
            .labels
            .as_ref()
            .is_some_and(|l| l.contains_key(PROFILE_LABEL));
        let k = key(&template.metadata);
        if is_managed(&template.metadata) && from_profile && !wanted_keys.contains(&k) {
            actions.push(TemplateAction::Delete {
                namespace: k.0,
                name: k.1,
            });
        }
    }
    actions
}

/// A JSON merge patch for `.status` that turns `old` into `new`: fields that disappeared are set to null
/// (a plain merge patch of the new status would leave them behind). None when nothing changed.
pub fn status_patch<T: Serialize>(old: Option<&T>, new: &T) -> Option<Value> {
    let new = serde_json::to_value(new).expect("status serialises");
    let old = old
        .map(|o| serde_json::to_value(o).expect("status serialises"))
        .unwrap_or(Value::Null);
    if old == new {
        return None;
    }
    let mut patch = new.clone();
    if let (Value::Object(old), Value::Object(patch)) = (&old, &mut patch) {
        for k in old.keys() {
            patch.entry(k.clone()).or_insert(Value::Null);
        }
    }
    Some(serde_json::json!({ "status": patch }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::{plan as plan_models, ClassOptions};
    use gpupool_api::crd::{GpuModel, GpuModelSpec, GpuModelStatus};
    use serde_json::json;

    fn desired_classes() -> Vec<DeviceClass> {
        let model = GpuModel::new(
            "a100",
            GpuModelSpec {
                model: Some("A100-SXM4-40GB".into()),
                product_name: None,
                compute_weight: 312,
                device_class_name: None,
                tier: None,
                mig_profiles: Vec::new(),
            },
        );
        plan_models(
            &[model],
            &[],
            ClassOptions {
                extended_resources: true,
            },
        )
        .classes
    }

    /// What the API server hands back after creating `actions`' objects, with a defaulted field added.
    fn as_stored(actions: &[ClassAction]) -> Vec<DeviceClass> {
        actions
            .iter()
            .map(|a| match a {
                ClassAction::Create(c) => {
                    let mut c = c.clone();
                    c.metadata.resource_version = Some("7".into());
                    c.metadata.uid = Some("u".into());
                    c
                }
                other => panic!("expected only creates, got {other:?}"),
            })
            .collect()
    }

    #[test]
    fn fresh_cluster_creates_everything_then_nothing_changes() {
        let desired = desired_classes();
        let first = diff_classes(&desired, &[]);
        assert_eq!(first.len(), 2);
        let stored = as_stored(&first);
        assert_eq!(diff_classes(&desired, &stored), []);
    }

    #[test]
    fn changed_spec_is_replaced_with_the_stored_resource_version() {
        let stored = as_stored(&diff_classes(&desired_classes(), &[]));
        let mut desired = desired_classes();
        // Sorted by name: [a100-sxm4-40gb.gpupool.dev, gpupool.dev].
        desired[0].spec.extended_resource_name = None;
        let actions = diff_classes(&desired, &stored);
        assert_eq!(actions.len(), 1);
        match &actions[0] {
            ClassAction::Replace(c) => {
                assert_eq!(c.metadata.resource_version.as_deref(), Some("7"));
                assert_eq!(c.spec.extended_resource_name, None);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn hand_edited_selector_is_put_back() {
        let mut stored = as_stored(&diff_classes(&desired_classes(), &[]));
        stored[0].spec.selectors.as_mut().unwrap()[0]
            .cel
            .as_mut()
            .unwrap()
            .expression = "true".into();
        assert!(matches!(
            diff_classes(&desired_classes(), &stored)[..],
            [ClassAction::Replace(_)]
        ));
    }

    #[test]
    fn only_managed_orphans_are_deleted_and_foreign_names_are_left_alone() {
        let mut stored = as_stored(&diff_classes(&desired_classes(), &[]));
        let mut foreign = stored[0].clone();
        foreign.metadata.labels = None;
        foreign.metadata.name = Some("someone-else".into());
        stored.push(foreign);
        let mut taken = stored[0].clone();
        taken.metadata.labels = None;
        // Only the all-GPUs class is desired now; the a100 class is an orphan.
        let desired: Vec<DeviceClass> = desired_classes()
            .into_iter()
            .filter(|c| c.metadata.name.as_deref() == Some("gpupool.dev"))
            .collect();
        let actions = diff_classes(&desired, &stored);
        assert_eq!(
            actions,
            [ClassAction::Delete("a100-sxm4-40gb.gpupool.dev".into())]
        );
        // A desired class whose name belongs to someone else is reported, not overwritten.
        let actions = diff_classes(&desired_classes(), &[taken]);
        assert!(actions.contains(&ClassAction::Foreign("a100-sxm4-40gb.gpupool.dev".into())));
    }

    #[test]
    fn template_spec_change_recreates_and_orphans_go() {
        use crate::profiles::{plan as plan_profile, NamespaceInfo, ServableModel};
        use gpupool_api::crd::{ComputeProfile, ComputeProfileSpec};
        let models = vec![ServableModel {
            name: "a100".into(),
            model: "A100".into(),
            class_name: "a100.gpupool.dev".into(),
            weight: 312,
            mig: Vec::new(),
        }];
        let namespaces = vec![NamespaceInfo {
            name: "team-a".into(),
            ..Default::default()
        }];
        let profile = |compute| {
            ComputeProfile::new(
                "p",
                ComputeProfileSpec {
                    compute,
                    memory: None,
                    models: vec![],
                    preference: Default::default(),
                    namespaces: vec!["team-a".into()],
                    namespace_selector: None,
                    mig: Default::default(),
                    cards: None,
                    same_nvlink_domain: false,
                },
            )
        };
        let template = |compute| {
            plan_profile(&profile(compute), &models, &namespaces)
                .template_in("team-a", None)
                .unwrap()
        };
        let created = match &diff_templates(&[template(156)], &[])[..] {
            [TemplateAction::Create(t)] => t.clone(),
            other => panic!("{other:?}"),
        };
        assert_eq!(
            diff_templates(&[template(156)], std::slice::from_ref(&created)),
            []
        );
        assert!(matches!(
            diff_templates(&[template(100)], std::slice::from_ref(&created))[..],
            [TemplateAction::Recreate(_)]
        ));
        assert_eq!(
            diff_templates(&[], &[created]),
            [TemplateAction::Delete {
                namespace: "team-a".into(),
                name: "p".into()
            }]
        );
    }

    #[test]
    fn status_patch_clears_vanished_fields_and_skips_no_ops() {
        let old = GpuModelStatus {
            device_class_name: Some("x".into()),
            devices: 2,
            ..Default::default()
        };
        let new = GpuModelStatus {
            devices: 2,
            ..Default::default()
        };
        assert_eq!(status_patch(Some(&old), &old), None);
        let patch = status_patch(Some(&old), &new).unwrap();
        assert_eq!(patch["status"]["deviceClassName"], Value::Null);
        assert_eq!(patch["status"]["devices"], json!(2));
    }

    #[test]
    fn containment_ignores_server_defaults_but_not_edits() {
        let wanted = json!({"a": 1, "b": [{"c": 2}]});
        assert!(json_contains(
            &wanted,
            &json!({"a": 1, "b": [{"c": 2, "d": 3}], "e": 4})
        ));
        assert!(!json_contains(&wanted, &json!({"a": 1, "b": [{"c": 3}]})));
        assert!(!json_contains(&wanted, &json!({"a": 1, "b": []})));
    }
}

//! The controller's examples in deploy/examples are valid objects and fit together: every class they
//! name is one the controller makes from gpumodels.yaml, and half-a100 gives A100 50 / V100 61.

use std::path::Path;

use gpupool_api::crd::{ComputeProfile, GpuModel};
use gpupool_controller::models::{self, ClassOptions, ModelsPlan};
use gpupool_controller::plan::json_contains;
use gpupool_controller::profiles::{self, NamespaceInfo, ServableModel};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimTemplate};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

fn documents(file: &str) -> Vec<Value> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/examples")
        .join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| serde_json::to_value(serde_yaml::Value::deserialize(doc).unwrap()).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

/// Decodes into the typed object and checks nothing was lost (a misspelt field would be dropped by
/// the API server too).
fn typed<T: DeserializeOwned + Serialize>(doc: &Value) -> T {
    let object: T = serde_json::from_value(doc.clone())
        .unwrap_or_else(|e| panic!("{}: {e}", doc["metadata"]["name"]));
    let back = serde_json::to_value(&object).unwrap();
    assert!(
        json_contains(doc, &back),
        "unknown or mistyped fields in {}: {doc:#}",
        doc["metadata"]["name"]
    );
    object
}

/// The first two documents of an example file, typed.
fn typed_pair<A, B>(file: &str) -> (A, B)
where
    A: DeserializeOwned + Serialize,
    B: DeserializeOwned + Serialize,
{
    let docs = documents(file);
    (typed(&docs[0]), typed(&docs[1]))
}

fn example_models() -> Vec<GpuModel> {
    documents("gpumodels.yaml")
        .iter()
        .map(|d| {
            assert_eq!(d["apiVersion"], "gpupool.dev/v1alpha1");
            typed(d)
        })
        .collect()
}

/// The example GpuModels planned on a cluster with no devices yet.
fn example_plan() -> ModelsPlan {
    models::plan(
        &example_models(),
        &[],
        ClassOptions {
            extended_resources: true,
        },
    )
}

fn class_names() -> Vec<String> {
    let plan = example_plan();
    for outcome in &plan.outcomes {
        assert!(
            outcome.usable(),
            "{} is not usable: {:?}",
            outcome.name,
            outcome.verdicts
        );
    }
    plan.classes
        .iter()
        .map(|c| c.metadata.name.clone().unwrap())
        .collect()
}

#[test]
fn gpumodels_make_the_seed_pool_classes() {
    let weights: Vec<(Option<String>, i64)> = example_models()
        .into_iter()
        .map(|m| (m.spec.model, m.spec.compute_weight))
        .collect();
    assert_eq!(
        weights,
        [
            (Some("A100-SXM4-40GB".to_string()), 312),
            (Some("V100-SXM2-32GB".to_string()), 256),
            (Some("RTX-3090".to_string()), 71),
            (Some("H100-80GB-HBM3".to_string()), 989)
        ]
    );
    assert_eq!(
        gpupool_api::inventory::model_from_product_name("NVIDIA GeForce RTX 3090"),
        "RTX-3090"
    );
    let classes = class_names();
    for wanted in [
        "a100-sxm4-40gb.gpupool.dev",
        "v100-sxm2-32gb.gpupool.dev",
        "rtx-3090.gpupool.dev",
        "h100-80gb-hbm3.gpupool.dev",
        "h100-80gb-hbm3-mig-1g-10gb.gpupool.dev",
        "h100-80gb-hbm3-mig-1g-20gb.gpupool.dev",
        "h100-80gb-hbm3-mig-3g-40gb.gpupool.dev",
        "gpupool.dev",
    ] {
        assert!(
            classes.contains(&wanted.to_string()),
            "{wanted} in {classes:?}"
        );
    }
}

#[test]
fn half_a100_profile_serves_team_a_with_a100_50_and_v100_61() {
    let (namespace, profile): (Namespace, ComputeProfile) =
        typed_pair("compute-profile-half-a100.yaml");
    let plan = example_plan();
    let outcome = profiles::plan(
        &profile,
        &ServableModel::from_outcomes(&plan.outcomes),
        &[NamespaceInfo {
            name: namespace.metadata.name.unwrap(),
            ..Default::default()
        }],
    );
    assert_eq!(outcome.namespaces, ["team-a"]);
    assert_eq!(
        outcome.subrequests,
        [
            "A100-SXM4-40GB cores=50 memory=8Gi",
            "V100-SXM2-32GB cores=61 memory=8Gi"
        ]
    );
}

#[test]
fn pod_by_model_uses_the_v100_class() {
    let (template, pod): (ResourceClaimTemplate, Pod) = typed_pair("pod-by-model.yaml");
    let request = &template.spec.spec.devices.unwrap().requests.unwrap()[0];
    let class = &request.exactly.as_ref().unwrap().device_class_name;
    assert_eq!(class, "v100-sxm2-32gb.gpupool.dev");
    assert!(class_names().contains(class));
    let claims = pod.spec.unwrap().resource_claims.unwrap();
    assert_eq!(
        claims[0].resource_claim_template_name.as_deref(),
        template.metadata.name.as_deref()
    );
}

#[test]
fn claim_prefers_a100_then_v100() {
    let docs = documents("claim-prefer-a100.yaml");
    let claim: ResourceClaim = typed(&docs[0]);
    let request = &claim.spec.devices.unwrap().requests.unwrap()[0];
    let classes: Vec<String> = request
        .first_available
        .as_ref()
        .unwrap()
        .iter()
        .map(|s| s.device_class_name.clone())
        .collect();
    assert_eq!(
        classes,
        ["a100-sxm4-40gb.gpupool.dev", "v100-sxm2-32gb.gpupool.dev"]
    );
    let known = class_names();
    assert!(classes.iter().all(|c| known.contains(c)));
}

/// The class of each `exactly` request of an example's claim.
fn claim_classes(file: &str) -> Vec<String> {
    let claim: ResourceClaim = typed(&documents(file)[0]);
    claim
        .spec
        .devices
        .unwrap()
        .requests
        .unwrap()
        .iter()
        .map(|r| r.exactly.as_ref().unwrap().device_class_name.clone())
        .collect()
}

#[test]
fn mig_fraction_and_nvlink_examples_name_classes_the_controller_makes() {
    let known = class_names();
    for (file, class) in [
        ("mig-h100-1g.yaml", "h100-80gb-hbm3-mig-1g-10gb.gpupool.dev"),
        ("fraction-h100-quarter.yaml", "h100-80gb-hbm3.gpupool.dev"),
        ("nvlink-two-h100.yaml", "h100-80gb-hbm3.gpupool.dev"),
    ] {
        assert_eq!(claim_classes(file), [class], "{file}");
        assert!(known.contains(&class.to_string()), "{class}");
    }
    let claim: ResourceClaim = typed(&documents("nvlink-two-h100.yaml")[0]);
    let devices = claim.spec.devices.unwrap();
    assert_eq!(
        devices.requests.unwrap()[0].exactly.as_ref().unwrap().count,
        Some(2)
    );
    let constraints: Vec<(Option<String>, Option<String>)> = devices
        .constraints
        .unwrap()
        .into_iter()
        .map(|c| (c.match_attribute, c.distinct_attribute))
        .collect();
    assert_eq!(
        constraints,
        [
            (Some("gpupool.dev/nvlinkDomain".to_string()), None),
            (None, Some("gpupool.dev/uuid".to_string()))
        ]
    );
}

#[test]
fn the_gang_example_asks_each_worker_for_a_whole_card_of_a_class_the_controller_makes() {
    let docs = documents("gang/training-4x-h100.yaml");
    let kinds: Vec<&str> = docs.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        [
            "PodGroup",
            "ResourceClaimTemplate",
            "Pod",
            "Pod",
            "Pod",
            "Pod"
        ]
    );
    assert_eq!(docs[0]["spec"]["schedulingPolicy"]["gang"]["minCount"], 4);
    let template: ResourceClaimTemplate = typed(&docs[1]);
    let requests = template.spec.spec.devices.unwrap().requests.unwrap();
    let exactly = requests[0].exactly.as_ref().unwrap();
    assert_eq!(exactly.device_class_name, "h100-80gb-hbm3.gpupool.dev");
    assert!(class_names().contains(&exactly.device_class_name));
    // A whole card: one device, no capacity request (the default is the card's whole memory).
    assert_eq!((requests.len(), exactly.count), (1, Some(1)));
    assert!(exactly.capacity.is_none());
    // Pods stay JSON: k8s-openapi's PodSpec has no schedulingGroup yet.
    for (i, pod) in docs[2..].iter().enumerate() {
        let spec = &pod["spec"];
        assert_eq!(
            spec["schedulingGroup"]["podGroupName"], "train",
            "worker {i}"
        );
        assert_eq!(
            spec["resourceClaims"][0]["resourceClaimTemplateName"], "train-one-h100",
            "worker {i}"
        );
        assert_eq!(
            spec["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
                ["topologyKey"],
            "kubernetes.io/hostname",
            "worker {i}"
        );
    }
}

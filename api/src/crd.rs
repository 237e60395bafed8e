//! gpupool's custom resources (cluster-scoped, `gpupool.dev/v1alpha1`): `GpuModel` and `ComputeProfile`.
//!
//! The CRD manifests in `deploy/` are generated from these types (`CustomResourceExt::crd`).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A GPU model of the pool and its compute weight: the unit that makes different cards comparable.
/// The controller manages one DeviceClass per GpuModel; the node driver publishes the weight as the
/// `computeWeight` attribute of each matching device.
#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "gpupool.dev",
    version = "v1alpha1",
    kind = "GpuModel",
    plural = "gpumodels",
    shortname = "gm",
    status = "GpuModelStatus",
    printcolumn = r#"{"name":"Model","type":"string","jsonPath":".spec.model"}"#,
    printcolumn = r#"{"name":"Product","type":"string","jsonPath":".spec.productName","priority":1}"#,
    printcolumn = r#"{"name":"Weight","type":"integer","jsonPath":".spec.computeWeight"}"#,
    printcolumn = r#"{"name":"Devices","type":"integer","jsonPath":".status.devices"}"#,
    printcolumn = r#"{"name":"Nodes","type":"integer","jsonPath":".status.nodes"}"#,
    printcolumn = r#"{"name":"Memory","type":"string","jsonPath":".status.memory"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Class","type":"string","jsonPath":".status.deviceClassName","priority":1}"#,
    printcolumn = r#"{"name":"Tier","type":"string","jsonPath":".spec.tier","priority":1}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct GpuModelSpec {
    /// Matches devices whose `model` attribute equals this (e.g. "A100-SXM4-40GB").
    /// Exactly one of `model` and `productName` is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Matches devices whose `productName` attribute equals this (e.g. "NVIDIA A100-SXM4-40GB").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub product_name: Option<String>,
    /// Compute of one whole card of this model, in the pool's weight units (e.g. 312 for an A100).
    pub compute_weight: i64,
    /// DeviceClass to manage; default `<model in lower case>.gpupool.dev` (e.g. `a100-sxm4-40gb.gpupool.dev`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_class_name: Option<String>,
    /// Optional tier (e.g. "training"): the controller also manages a DeviceClass `tier-<tier>.gpupool.dev`
    /// selecting every model of that tier.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tier: Option<String>,
    /// MIG profiles of this model to offer (e.g. "1g.10gb", "3g.40gb"), each through a DeviceClass
    /// `<model>-mig-<profile>.gpupool.dev` (`h100-80gb-hbm3-mig-1g-10gb.gpupool.dev`). The
    /// profiles' geometry comes from the nodes (NVML); a name no node publishes matches nothing.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mig_profiles: Vec<String>,
}

/// What the controller observed of a GpuModel.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuModelStatus {
    /// Devices published by gpupool nodes that this GpuModel matches.
    #[serde(default)]
    pub devices: i64,
    /// Nodes with at least one such device.
    #[serde(default)]
    pub nodes: i64,
    /// Total memory of those devices, as a quantity ("80Gi").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<String>,
    /// The DeviceClass the controller manages for this model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_class_name: Option<String>,
    /// Each MIG profile of `spec.migProfiles`: its class and what the nodes publish of it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mig_profiles: Vec<MigProfileStatus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`, `NoMatchingDevices`, `Conflict`, `Invalid`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
}

/// One MIG profile of a GpuModel as the controller sees it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigProfileStatus {
    /// e.g. "1g.10gb".
    pub name: String,
    /// The DeviceClass selecting this model's MIG devices of this profile.
    pub device_class_name: String,
    /// MIG devices of this profile published (one per placement and card).
    #[serde(default)]
    pub devices: i64,
    /// SMs of one instance, as the nodes publish it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub multiprocessors: Option<i64>,
    /// Compute of one instance in weight units: the model's weight scaled by the instance's share
    /// of the card's SMs (what a ComputeProfile compares with its `compute`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_weight: Option<i64>,
}

/// Whether a ComputeProfile may be served by MIG devices, and before or after fractions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum MigUse {
    /// Fractions of cards only.
    #[default]
    Never,
    /// A MIG device first (hardware isolation), a fraction when none is free.
    First,
    /// A fraction first, a MIG device when no card has room.
    Last,
}

/// Which way a ComputeProfile orders the models it may use.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum Preference {
    /// Highest weight first: spread work onto the strongest free cards.
    #[default]
    Strongest,
    /// Lowest weight first: bin-pack onto the weakest card that can serve it.
    Weakest,
}

/// An amount of compute in weight units, served by whichever allowed model is free. The controller keeps
/// a ResourceClaimTemplate of the profile's name in each served namespace.
#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "gpupool.dev",
    version = "v1alpha1",
    kind = "ComputeProfile",
    plural = "computeprofiles",
    shortname = "cprof",
    status = "ComputeProfileStatus",
    printcolumn = r#"{"name":"Compute","type":"integer","jsonPath":".spec.compute"}"#,
    printcolumn = r#"{"name":"Memory","type":"string","jsonPath":".spec.memory"}"#,
    printcolumn = r#"{"name":"Preference","type":"string","jsonPath":".spec.preference"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct ComputeProfileSpec {
    /// Compute in weight units (156 = half an A100 at weight 312).
    pub compute: i64,
    /// Device memory per claim, as a quantity ("8Gi"); default: the whole card.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<String>,
    /// Names of the GpuModels that may serve this profile; default all.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub models: Vec<String>,
    #[serde(default)]
    pub preference: Preference,
    /// Namespaces that get the ResourceClaimTemplate.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub namespaces: Vec<String>,
    /// Or: namespaces whose labels match.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<LabelSelector>,
    /// MIG devices as well as fractions: the smallest MIG profile of each allowed model whose
    /// compute (its `computeWeight`) and memory reach the profile's, through the GpuModel's MIG
    /// classes. Needs `cards: 1`.
    #[serde(default, skip_serializing_if = "is_never")]
    pub mig: MigUse,
    /// Cards per claim, each with `compute` and `memory` (default 1). More than one card get
    /// distinct cards (`distinctAttribute` on the uuid).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cards: Option<i64>,
    /// With `cards` > 1: all cards on one NVLink domain (`matchAttribute` on
    /// `gpupool.dev/nvlinkDomain`), e.g. one NVSwitch board or one bridged pair.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub same_nvlink_domain: bool,
}

fn is_never(mig: &MigUse) -> bool {
    *mig == MigUse::Never
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ComputeProfileStatus {
    /// Namespaces that hold the profile's ResourceClaimTemplate.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub namespaces: Vec<String>,
    /// The subrequests of the template, e.g. "A100-SXM4-40GB cores=50".
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub subrequests: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`, `Invalid`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
}

impl GpuModelSpec {
    /// Whether the controller accepts this spec (else it is marked Invalid): exactly one way to match
    /// and a positive weight. The driver publishes weights only from valid GpuModels.
    pub fn is_valid(&self) -> bool {
        self.compute_weight > 0 && self.model.is_some() != self.product_name.is_some()
    }
}

impl GpuModel {
    /// When several GpuModels want one device or one class name, the oldest wins, then the first by
    /// name; objects not yet stored come last. The controller and the driver both order by this, so
    /// the published `computeWeight` comes from the GpuModel whose DeviceClass the controller keeps.
    pub fn precedence(&self) -> (bool, Option<k8s_openapi::jiff::Timestamp>, Option<&String>) {
        let created = self.metadata.creation_timestamp.as_ref().map(|t| t.0);
        (created.is_none(), created, self.metadata.name.as_ref())
    }
}

/// Conditions as a plain list of objects in the schema: the API server keeps them unpruned.
fn conditions_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    serde_json::from_value(serde_json::json!({
        "type": "array",
        "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}
    }))
    .expect("static schema")
}

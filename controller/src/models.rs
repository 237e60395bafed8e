//! GpuModels -> DeviceClasses and GpuModel status, from the published ResourceSlices. Pure.
//!
//! Every GpuModel is judged on its own first (Invalid), then against the others in a fixed order
//! (oldest first, then by name) so that the earlier of two colliding models keeps its class and the
//! later one reports the Conflict: adding a bad object never takes a working class away.

use std::collections::{BTreeMap, BTreeSet};

use gpupool_api::crd::{GpuModel, GpuModelStatus, MigProfileStatus};
use gpupool_api::inventory::{mig_profile_label, model_from_product_name};
use gpupool_api::names::{
    attr, capacity, API_GROUP_VERSION, DEVICE_TYPE_GPU, DEVICE_TYPE_MIG, DRIVER_NAME,
};
use gpupool_api::quantity;
use gpupool_api::validation::is_dns_subdomain;
use k8s_openapi::api::resource::v1::{
    CELDeviceSelector, DeviceClass, DeviceClassSpec, DeviceSelector, ResourceSlice,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

use crate::status::{Verdict, CONFLICT, INVALID, NO_MATCHING_DEVICES, READY};

/// Label on everything the controller creates; only objects carrying it are ever replaced or deleted.
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
pub const MANAGER: &str = "gpupool-controller";
/// Which GpuModel a per-model DeviceClass comes from.
pub const GPUMODEL_LABEL: &str = "gpupool.dev/gpumodel";
/// Which tier a tier DeviceClass stands for.
pub const TIER_LABEL: &str = "gpupool.dev/tier";
/// The class that selects every gpupool GPU.
pub const ALL_GPUS_CLASS: &str = DRIVER_NAME;
const CLASS_SUFFIX: &str = ".gpupool.dev";

/// One device of a gpupool ResourceSlice, reduced to what GpuModels match and count.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PublishedDevice {
    pub node: String,
    pub pool: String,
    pub name: String,
    pub model: Option<String>,
    pub product_name: Option<String>,
    pub memory_bytes: u64,
    /// Set for a MIG device: its profile ("1g.10gb").
    pub mig_profile: Option<String>,
    /// SMs of the device (of the partition, for a MIG device).
    pub multiprocessors: Option<i64>,
    /// The `computeWeight` the node published (a MIG device's is scaled by its SM share).
    pub compute_weight: Option<i64>,
}

impl PublishedDevice {
    pub fn is_mig(&self) -> bool {
        self.mig_profile.is_some()
    }
}

/// The devices of the current generation of every gpupool pool. Slices of older generations are
/// leftovers of a republish in progress and would count a device twice.
pub fn published_devices(slices: &[ResourceSlice]) -> Vec<PublishedDevice> {
    let ours: Vec<&ResourceSlice> = slices
        .iter()
        .filter(|s| s.spec.driver == DRIVER_NAME)
        .collect();
    let mut latest: BTreeMap<&str, i64> = BTreeMap::new();
    for slice in &ours {
        let generation = latest
            .entry(slice.spec.pool.name.as_str())
            .or_insert(i64::MIN);
        *generation = (*generation).max(slice.spec.pool.generation);
    }
    let mut devices = Vec::new();
    for slice in ours {
        let pool = &slice.spec.pool;
        if latest.get(pool.name.as_str()) != Some(&pool.generation) {
            continue;
        }
        let node = slice
            .spec
            .node_name
            .clone()
            .unwrap_or_else(|| pool.name.clone());
        for device in slice.spec.devices.iter().flatten() {
            let value = |name: &str| {
                let attributes = device.attributes.as_ref()?;
                attributes
                    .get(name)
                    .or_else(|| attributes.get(&format!("{DRIVER_NAME}/{name}")))
            };
            let attribute = |name: &str| value(name).and_then(|a| a.string.clone());
            let int = |name: &str| value(name).and_then(|a| a.int);
            let is_mig = attribute(attr::TYPE).as_deref() == Some(DEVICE_TYPE_MIG);
            let memory_bytes = device
                .capacity
                .as_ref()
                .and_then(|c| {
                    c.get(capacity::MEMORY)
                        .or_else(|| c.get(&format!("{DRIVER_NAME}/{}", capacity::MEMORY)))
                })
                .and_then(|c| quantity::parse(&c.value.0).ok())
                .map(|milli| u64::try_from(milli.0 / 1000).unwrap_or(0))
                .unwrap_or(0);
            devices.push(PublishedDevice {
                node: node.clone(),
                pool: pool.name.clone(),
                name: device.name.clone(),
                model: attribute(attr::MODEL),
                product_name: attribute(attr::PRODUCT_NAME),
                memory_bytes,
                mig_profile: is_mig.then(|| attribute(attr::MIG_PROFILE)).flatten(),
                multiprocessors: int(attr::MULTIPROCESSORS),
                compute_weight: int(attr::COMPUTE_WEIGHT),
            });
        }
    }
    devices
}

/// How a GpuModel picks its devices.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Matcher {
    Model(String),
    ProductName(String),
}

impl Matcher {
    /// The short model name the driver publishes for these devices.
    pub fn model(&self) -> String {
        match self {
            Matcher::Model(m) => m.clone(),
            Matcher::ProductName(p) => model_from_product_name(p),
        }
    }

    pub fn matches(&self, device: &PublishedDevice) -> bool {
        match self {
            Matcher::Model(m) => device.model.as_deref() == Some(m),
            Matcher::ProductName(p) => device.product_name.as_deref() == Some(p),
        }
    }

    /// The CEL test of this matcher, to be used after the driver guard.
    fn cel(&self) -> String {
        let (attribute, value) = match self {
            Matcher::Model(m) => (attr::MODEL, m),
            Matcher::ProductName(p) => (attr::PRODUCT_NAME, p),
        };
        format!(
            "device.attributes[\"{DRIVER_NAME}\"].{attribute} == {}",
            cel_string(value)
        )
    }
}

/// Whole cards only: a device with `type: gpu`, or without `type` (drivers from before MIG
/// published none, and a class must not fail on their devices during an upgrade). Without it a
/// claim that asks for a card with no capacity request could get a MIG partition.
fn cards_only() -> String {
    format!(
        "(!has(device.attributes[\"{DRIVER_NAME}\"].{ty}) || device.attributes[\"{DRIVER_NAME}\"].{ty} == {gpu})",
        ty = attr::TYPE,
        gpu = cel_string(DEVICE_TYPE_GPU)
    )
}

/// MIG devices of one profile.
fn mig_profile_cel(profile: &str) -> String {
    format!(
        "device.attributes[\"{DRIVER_NAME}\"].{ty} == {mig} && device.attributes[\"{DRIVER_NAME}\"].{p} == {}",
        cel_string(profile),
        ty = attr::TYPE,
        mig = cel_string(DEVICE_TYPE_MIG),
        p = attr::MIG_PROFILE,
    )
}

/// The DeviceClass of one MIG profile of a model: `<model>-mig-<profile>.gpupool.dev`.
pub fn mig_class_name(model: &str, profile: &str) -> String {
    format!(
        "{}-mig-{}{CLASS_SUFFIX}",
        dns_label(model),
        mig_profile_label(profile)
    )
}

/// A CEL string literal.
fn cel_string(value: &str) -> String {
    let escaped: String = value
        .chars()
        .flat_map(|c| match c {
            '\\' => vec!['\\', '\\'],
            '"' => vec!['\\', '"'],
            '\n' => vec!['\\', 'n'],
            c => vec![c],
        })
        .collect();
    format!("\"{escaped}\"")
}

/// The guard that keeps a selector from reading another driver's attributes ("no such key").
fn driver_guard() -> String {
    format!("device.driver == {}", cel_string(DRIVER_NAME))
}

/// A DNS label (RFC 1123) from free text: "A100-SXM4-40GB" -> "a100-sxm4-40gb", "RTX 3090" -> "rtx-3090".
/// Empty when nothing usable is left.
pub fn dns_label(text: &str) -> String {
    let mut label = String::new();
    for c in text.chars().flat_map(char::to_lowercase) {
        let c = if c.is_ascii_lowercase() || c.is_ascii_digit() {
            c
        } else {
            '-'
        };
        if c == '-' && (label.is_empty() || label.ends_with('-')) {
            continue;
        }
        label.push(c);
    }
    label.truncate(63);
    label.trim_end_matches('-').to_string()
}

/// The default DeviceClass of a model: `<model as DNS label>.gpupool.dev`.
pub fn default_class_name(model: &str) -> String {
    format!("{}{CLASS_SUFFIX}", dns_label(model))
}

pub fn tier_class_name(tier_label: &str) -> String {
    format!("tier-{tier_label}{CLASS_SUFFIX}")
}

/// Why a GpuModel is unusable on its own.
fn invalid_reason(model: &GpuModel) -> Option<(&'static str, String)> {
    let spec = &model.spec;
    if spec.compute_weight <= 0 {
        return Some((
            "InvalidComputeWeight",
            format!(
                "spec.computeWeight must be a positive integer, got {}",
                spec.compute_weight
            ),
        ));
    }
    let model_set = spec.model.as_deref().is_some_and(|m| !m.trim().is_empty());
    let product_set = spec
        .product_name
        .as_deref()
        .is_some_and(|p| !p.trim().is_empty());
    if model_set == product_set {
        return Some((
            "InvalidMatch",
            "exactly one of spec.model and spec.productName must be set".to_string(),
        ));
    }
    let matcher = matcher(model);
    if dns_label(&matcher.model()).is_empty() {
        return Some((
            "InvalidMatch",
            format!(
                "model {:?} has no letters or digits to name a DeviceClass after",
                matcher.model()
            ),
        ));
    }
    if let Some(class) = &spec.device_class_name {
        if !is_dns_subdomain(class) {
            return Some((
                "InvalidDeviceClassName",
                format!("spec.deviceClassName {class:?} is not a DNS subdomain (lower-case letters, digits, '-', '.')"),
            ));
        }
        if class == ALL_GPUS_CLASS || (class.starts_with("tier-") && class.ends_with(CLASS_SUFFIX))
        {
            return Some((
                "InvalidDeviceClassName",
                format!(
                    "spec.deviceClassName {class:?} is reserved for the controller's own classes"
                ),
            ));
        }
    }
    let mut seen = BTreeSet::new();
    for (i, profile) in spec.mig_profiles.iter().enumerate() {
        let label = mig_profile_label(profile);
        let class = mig_class_name(&matcher.model(), profile);
        if label.is_empty() || !is_dns_subdomain(&class) {
            return Some((
                "InvalidMigProfile",
                format!("spec.migProfiles[{i}] {profile:?} does not name a MIG profile (e.g. \"1g.10gb\")"),
            ));
        }
        if !seen.insert(label) {
            return Some((
                "InvalidMigProfile",
                format!("spec.migProfiles[{i}] {profile:?} is listed twice"),
            ));
        }
    }
    if let Some(tier) = &spec.tier {
        if dns_label(tier).is_empty() {
            return Some((
                "InvalidTier",
                format!("spec.tier {tier:?} has no letters or digits"),
            ));
        }
    }
    None
}

fn matcher(model: &GpuModel) -> Matcher {
    match (&model.spec.model, &model.spec.product_name) {
        (Some(m), _) if !m.trim().is_empty() => Matcher::Model(m.trim().to_string()),
        (_, Some(p)) => Matcher::ProductName(p.trim().to_string()),
        _ => Matcher::Model(String::new()),
    }
}

/// Options that depend on the cluster, not on the objects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClassOptions {
    /// Set `extendedResourceName: gpupool.dev/<model>` (clusters with DRA extended resources).
    pub extended_resources: bool,
}

/// What became of one GpuModel.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelOutcome {
    pub name: String,
    pub generation: Option<i64>,
    pub matcher: Matcher,
    pub weight: i64,
    /// Set only when the model is usable (valid and not in conflict): its class is managed.
    pub class_name: Option<String>,
    pub tier: Option<String>,
    pub devices: i64,
    pub nodes: i64,
    pub memory_bytes: u64,
    /// The MIG profiles the model offers, each with its class (set only when usable).
    pub mig: Vec<MigOutcome>,
    pub verdicts: Vec<Verdict>,
}

/// One MIG profile of a GpuModel: its class and what the nodes publish of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigOutcome {
    pub profile: String,
    pub class_name: String,
    pub devices: i64,
    pub multiprocessors: Option<i64>,
    /// The smallest `computeWeight` the nodes publish for it (they agree unless a republish is
    /// under way; the smaller never promises more compute than a device has).
    pub weight: Option<i64>,
    pub memory_bytes: Option<u64>,
}

impl ModelOutcome {
    pub fn usable(&self) -> bool {
        self.class_name.is_some()
    }

    /// The status to write, conditions merged with those already there.
    pub fn status(
        &self,
        existing: Option<&GpuModelStatus>,
        now: &k8s_openapi::apimachinery::pkg::apis::meta::v1::Time,
    ) -> GpuModelStatus {
        let existing_conditions = existing.map(|s| s.conditions.as_slice()).unwrap_or(&[]);
        GpuModelStatus {
            devices: self.devices,
            nodes: self.nodes,
            memory: Some(quantity::format_bytes(self.memory_bytes)),
            device_class_name: self.class_name.clone(),
            mig_profiles: self
                .mig
                .iter()
                .map(|m| MigProfileStatus {
                    name: m.profile.clone(),
                    device_class_name: m.class_name.clone(),
                    devices: m.devices,
                    multiprocessors: m.multiprocessors,
                    compute_weight: m.weight,
                })
                .collect(),
            observed_generation: self.generation,
            conditions: crate::status::merge(
                existing_conditions,
                &self.verdicts,
                self.generation,
                now,
            ),
        }
    }
}

/// Everything the GpuModels ask for.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelsPlan {
    /// In the order of the GpuModels' names.
    pub outcomes: Vec<ModelOutcome>,
    /// Per-model classes, tier classes and the all-GPUs class, by name.
    pub classes: Vec<DeviceClass>,
}

/// Judge every GpuModel, count its devices and build the DeviceClasses to keep.
pub fn plan(models: &[GpuModel], devices: &[PublishedDevice], options: ClassOptions) -> ModelsPlan {
    plan_with_taken(models, devices, options, &BTreeSet::new())
}

/// Like [`plan`], where `taken` are names of existing DeviceClasses the controller does not manage:
/// a model whose class name is among them gets no class and a Conflict, and is left out of its tier.
pub fn plan_with_taken(
    models: &[GpuModel],
    devices: &[PublishedDevice],
    options: ClassOptions,
    taken: &BTreeSet<String>,
) -> ModelsPlan {
    let mut ordered: Vec<&GpuModel> = models.iter().collect();
    ordered.sort_by(|a, b| a.precedence().cmp(&b.precedence()));

    let mut outcomes: Vec<ModelOutcome> = Vec::new();
    // Class name -> the GpuModel that holds it; matcher -> holder.
    let mut class_holders: BTreeMap<String, String> = BTreeMap::new();
    let mut matcher_holders: BTreeMap<Matcher, String> = BTreeMap::new();
    // Device (pool, name) -> holder.
    let mut device_holders: BTreeMap<(String, String), String> = BTreeMap::new();

    for model in ordered {
        let name = model.metadata.name.clone().unwrap_or_default();
        let matcher = matcher(model);
        // Cards count as the model's devices; its MIG partitions are reported per profile.
        let matched: Vec<&PublishedDevice> = devices
            .iter()
            .filter(|d| !d.is_mig() && matcher.matches(d))
            .collect();
        let nodes: BTreeSet<&str> = matched.iter().map(|d| d.node.as_str()).collect();
        let mut outcome = ModelOutcome {
            name: name.clone(),
            generation: model.metadata.generation,
            matcher: matcher.clone(),
            weight: model.spec.compute_weight,
            class_name: None,
            tier: model.spec.tier.as_deref().map(dns_label),
            devices: matched.len() as i64,
            nodes: nodes.len() as i64,
            memory_bytes: matched.iter().map(|d| d.memory_bytes).sum(),
            mig: Vec::new(),
            verdicts: Vec::new(),
        };

        if let Some((reason, message)) = invalid_reason(model) {
            outcome.verdicts = vec![
                Verdict::new(READY, false, reason, message.clone()),
                Verdict::new(INVALID, true, reason, message),
                Verdict::new(CONFLICT, false, "NoConflict", ""),
                no_devices_verdict(&outcome),
            ];
            outcomes.push(outcome);
            continue;
        }

        let class_name = model
            .spec
            .device_class_name
            .clone()
            .unwrap_or_else(|| default_class_name(&matcher.model()));
        let mig_classes: Vec<String> = model
            .spec
            .mig_profiles
            .iter()
            .map(|p| mig_class_name(&matcher.model(), p))
            .collect();
        let conflict = if let Some(class) = mig_classes
            .iter()
            .find(|c| taken.contains(*c) || class_holders.contains_key(*c))
        {
            Some((
                "DeviceClassNameConflict",
                match class_holders.get(class) {
                    Some(holder) => {
                        format!("DeviceClass {class} is already managed for GpuModel {holder}")
                    }
                    None => format!("DeviceClass {class} exists and is not managed by {MANAGER}"),
                },
            ))
        } else if taken.contains(&class_name) {
            Some((
                "DeviceClassNotManaged",
                format!("DeviceClass {class_name} exists and is not managed by {MANAGER}"),
            ))
        } else if let Some(holder) = class_holders.get(&class_name) {
            Some((
                "DeviceClassNameConflict",
                format!("DeviceClass {class_name} is already managed for GpuModel {holder}"),
            ))
        } else if let Some(holder) = matcher_holders.get(&matcher) {
            Some((
                "DeviceConflict",
                format!(
                    "GpuModel {holder} already matches the same devices ({})",
                    describe(&matcher)
                ),
            ))
        } else {
            matched.iter().find_map(|d| {
                device_holders
                    .get(&(d.pool.clone(), d.name.clone()))
                    .map(|holder| {
                        (
                            "DeviceConflict",
                            format!(
                                "device {}/{} is already matched by GpuModel {holder}",
                                d.pool, d.name
                            ),
                        )
                    })
            })
        };

        if let Some((reason, message)) = conflict {
            outcome.verdicts = vec![
                Verdict::new(READY, false, reason, message.clone()),
                Verdict::new(INVALID, false, "Valid", ""),
                Verdict::new(CONFLICT, true, reason, message),
                no_devices_verdict(&outcome),
            ];
            outcomes.push(outcome);
            continue;
        }

        class_holders.insert(class_name.clone(), name.clone());
        for class in &mig_classes {
            class_holders.insert(class.clone(), name.clone());
        }
        outcome.mig = model
            .spec
            .mig_profiles
            .iter()
            .zip(&mig_classes)
            .map(|(profile, class_name)| {
                let published: Vec<&PublishedDevice> = devices
                    .iter()
                    .filter(|d| d.mig_profile.as_deref() == Some(profile.as_str()))
                    .filter(|d| matcher.matches(d))
                    .collect();
                MigOutcome {
                    profile: profile.clone(),
                    class_name: class_name.clone(),
                    devices: published.len() as i64,
                    multiprocessors: published.iter().filter_map(|d| d.multiprocessors).min(),
                    weight: published.iter().filter_map(|d| d.compute_weight).min(),
                    memory_bytes: published.iter().map(|d| d.memory_bytes).min(),
                }
            })
            .collect();
        matcher_holders.insert(matcher.clone(), name.clone());
        for d in &matched {
            device_holders.insert((d.pool.clone(), d.name.clone()), name.clone());
        }
        let ready = if outcome.devices > 0 {
            Verdict::new(
                READY,
                true,
                "DevicesMatched",
                format!(
                    "{} devices on {} nodes through DeviceClass {class_name}",
                    outcome.devices, outcome.nodes
                ),
            )
        } else {
            Verdict::new(
                READY,
                false,
                "NoMatchingDevices",
                format!(
                    "no published {DRIVER_NAME} device has {}",
                    describe(&matcher)
                ),
            )
        };
        outcome.verdicts = vec![
            ready,
            Verdict::new(INVALID, false, "Valid", ""),
            Verdict::new(CONFLICT, false, "NoConflict", ""),
            no_devices_verdict(&outcome),
        ];
        outcome.class_name = Some(class_name);
        outcomes.push(outcome);
    }

    let mut classes = Vec::new();
    for (outcome, model) in outcomes.iter().filter_map(|o| {
        let model = models
            .iter()
            .find(|m| m.metadata.name.as_deref() == Some(o.name.as_str()))?;
        o.usable().then_some((o, model))
    }) {
        classes.push(model_class(outcome, model, options));
        for mig in &outcome.mig {
            classes.push(class(
                mig.class_name.clone(),
                managed_labels(Some((GPUMODEL_LABEL, &outcome.name))),
                owner(model, true).into_iter().collect(),
                format!(
                    "{} && {} && {}",
                    driver_guard(),
                    outcome.matcher.cel(),
                    mig_profile_cel(&mig.profile)
                ),
                None,
            ));
        }
    }
    let mut tiers: BTreeMap<&str, Vec<(&ModelOutcome, &GpuModel)>> = BTreeMap::new();
    for outcome in outcomes.iter().filter(|o| o.usable()) {
        if let (Some(tier), Some(model)) = (
            outcome.tier.as_deref(),
            models
                .iter()
                .find(|m| m.metadata.name.as_deref() == Some(outcome.name.as_str())),
        ) {
            tiers.entry(tier).or_default().push((outcome, model));
        }
    }
    for (tier, members) in &tiers {
        classes.push(tier_class(tier, members));
    }
    classes.push(all_gpus_class());
    classes.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    outcomes.sort_by(|a, b| a.name.cmp(&b.name));
    ModelsPlan { outcomes, classes }
}

fn describe(matcher: &Matcher) -> String {
    match matcher {
        Matcher::Model(m) => format!("model {m:?}"),
        Matcher::ProductName(p) => format!("productName {p:?}"),
    }
}

fn no_devices_verdict(outcome: &ModelOutcome) -> Verdict {
    if outcome.devices == 0 {
        Verdict::new(
            NO_MATCHING_DEVICES,
            true,
            "NoDevices",
            format!(
                "no published {DRIVER_NAME} device has {}",
                describe(&outcome.matcher)
            ),
        )
    } else {
        Verdict::new(NO_MATCHING_DEVICES, false, "DevicesFound", "")
    }
}

/// An object name as a label value: label values stop at 63 characters and must end alphanumeric,
/// object names may be longer.
pub fn label_value(name: &str) -> String {
    let truncated: String = name.chars().take(63).collect();
    truncated
        .trim_end_matches(|c: char| !c.is_ascii_alphanumeric())
        .to_string()
}

fn managed_labels(extra: Option<(&str, &str)>) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::from([(MANAGED_BY_LABEL.to_string(), MANAGER.to_string())]);
    if let Some((k, v)) = extra {
        labels.insert(k.to_string(), label_value(v));
    }
    labels
}

/// An owner reference to a GpuModel, when it has been stored (has a uid).
fn owner(model: &GpuModel, controller: bool) -> Option<OwnerReference> {
    Some(OwnerReference {
        api_version: API_GROUP_VERSION.to_string(),
        kind: "GpuModel".to_string(),
        name: model.metadata.name.clone()?,
        uid: model.metadata.uid.clone()?,
        controller: Some(controller),
        block_owner_deletion: None,
    })
}

fn class(
    name: String,
    labels: BTreeMap<String, String>,
    owners: Vec<OwnerReference>,
    expression: String,
    extended_resource_name: Option<String>,
) -> DeviceClass {
    DeviceClass {
        metadata: ObjectMeta {
            name: Some(name),
            labels: Some(labels),
            owner_references: (!owners.is_empty()).then_some(owners),
            ..Default::default()
        },
        spec: DeviceClassSpec {
            selectors: Some(vec![DeviceSelector {
                cel: Some(CELDeviceSelector { expression }),
            }]),
            extended_resource_name,
            config: None,
        },
    }
}

fn model_class(outcome: &ModelOutcome, model: &GpuModel, options: ClassOptions) -> DeviceClass {
    let label = dns_label(&outcome.matcher.model());
    class(
        outcome.class_name.clone().unwrap_or_default(),
        managed_labels(Some((GPUMODEL_LABEL, &outcome.name))),
        owner(model, true).into_iter().collect(),
        format!(
            "{} && {} && {}",
            driver_guard(),
            outcome.matcher.cel(),
            cards_only()
        ),
        options
            .extended_resources
            .then(|| format!("{DRIVER_NAME}/{label}")),
    )
}

fn tier_class(tier: &str, members: &[(&ModelOutcome, &GpuModel)]) -> DeviceClass {
    let mut terms: Vec<String> = members.iter().map(|(o, _)| o.matcher.cel()).collect();
    terms.sort();
    terms.dedup();
    class(
        tier_class_name(tier),
        managed_labels(Some((TIER_LABEL, tier))),
        members
            .iter()
            .filter_map(|(_, m)| owner(m, false))
            .collect(),
        format!(
            "{} && ({}) && {}",
            driver_guard(),
            terms.join(" || "),
            cards_only()
        ),
        None,
    )
}

/// Every gpupool card, whole or in fractions; MIG devices have their classes per profile.
fn all_gpus_class() -> DeviceClass {
    class(
        ALL_GPUS_CLASS.to_string(),
        managed_labels(None),
        Vec::new(),
        format!("{} && {}", driver_guard(), cards_only()),
        None,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::is_true;
    use crate::testing::{at, condition};
    use gpupool_api::crd::GpuModelSpec;
    use k8s_openapi::api::resource::v1::{
        Device, DeviceAttribute, DeviceCapacity, ResourcePool, ResourceSliceSpec,
    };
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    const GI: u64 = 1 << 30;
    const ON: ClassOptions = ClassOptions {
        extended_resources: true,
    };

    fn gpumodel(name: &str, model: &str, weight: i64, created: i64) -> GpuModel {
        let mut m = GpuModel::new(
            name,
            GpuModelSpec {
                model: Some(model.to_string()),
                product_name: None,
                compute_weight: weight,
                device_class_name: None,
                tier: None,
                mig_profiles: Vec::new(),
            },
        );
        m.metadata.uid = Some(format!("uid-{name}"));
        m.metadata.generation = Some(1);
        m.metadata.creation_timestamp = Some(at(created));
        m
    }

    /// A GpuModel that matches by productName instead of model.
    fn gpumodel_by_product(name: &str, product: &str, weight: i64, created: i64) -> GpuModel {
        let mut m = gpumodel(name, "unused", weight, created);
        m.spec.model = None;
        m.spec.product_name = Some(product.to_string());
        m
    }

    /// The optional GpuModel fields, set in a chain.
    trait GpuModelExt {
        fn class_name(self, class: &str) -> Self;
        fn tier(self, tier: &str) -> Self;
    }

    impl GpuModelExt for GpuModel {
        fn class_name(mut self, class: &str) -> Self {
            self.spec.device_class_name = Some(class.to_string());
            self
        }

        fn tier(mut self, tier: &str) -> Self {
            self.spec.tier = Some(tier.to_string());
            self
        }
    }

    fn device(index: u32, model: &str, product: &str, memory: &str) -> Device {
        let attributes = BTreeMap::from([
            (
                attr::MODEL.to_string(),
                DeviceAttribute {
                    string: Some(model.to_string()),
                    ..Default::default()
                },
            ),
            (
                attr::PRODUCT_NAME.to_string(),
                DeviceAttribute {
                    string: Some(product.to_string()),
                    ..Default::default()
                },
            ),
        ]);
        let capacity = BTreeMap::from([(
            capacity::MEMORY.to_string(),
            DeviceCapacity {
                value: Quantity(memory.to_string()),
                request_policy: None,
            },
        )]);
        Device {
            name: format!("gpu-{index}"),
            attributes: Some(attributes),
            capacity: Some(capacity),
            ..Default::default()
        }
    }

    fn slice(node: &str, generation: i64, driver: &str, devices: Vec<Device>) -> ResourceSlice {
        ResourceSlice {
            metadata: ObjectMeta {
                name: Some(format!("{node}-{generation}")),
                ..Default::default()
            },
            spec: ResourceSliceSpec {
                driver: driver.to_string(),
                node_name: Some(node.to_string()),
                pool: ResourcePool {
                    name: node.to_string(),
                    generation,
                    resource_slice_count: 1,
                },
                devices: Some(devices),
                ..Default::default()
            },
        }
    }

    /// Two nodes: node-a with two A100s, node-b with an A100 and a V100.
    fn pool() -> Vec<PublishedDevice> {
        let a100 = |i| device(i, "A100-SXM4-40GB", "NVIDIA A100-SXM4-40GB", "40Gi");
        let v100 = |i| device(i, "V100-SXM2-32GB", "Tesla V100-SXM2-32GB", "32Gi");
        published_devices(&[
            slice("node-a", 2, DRIVER_NAME, vec![a100(0), a100(1)]),
            slice("node-b", 1, DRIVER_NAME, vec![a100(0), v100(1)]),
        ])
    }

    fn outcome<'a>(plan: &'a ModelsPlan, name: &str) -> &'a ModelOutcome {
        plan.outcomes.iter().find(|o| o.name == name).unwrap()
    }

    fn class_named<'a>(plan: &'a ModelsPlan, name: &str) -> Option<&'a DeviceClass> {
        plan.classes
            .iter()
            .find(|c| c.metadata.name.as_deref() == Some(name))
    }

    fn expression(class: &DeviceClass) -> &str {
        &class.spec.selectors.as_ref().unwrap()[0]
            .cel
            .as_ref()
            .unwrap()
            .expression
    }

    fn status_of(plan: &ModelsPlan, name: &str) -> GpuModelStatus {
        outcome(plan, name).status(None, &at(1000))
    }

    #[test]
    fn only_the_latest_generation_of_gpupool_pools_counts() {
        let devices = published_devices(&[
            slice("node-a", 1, DRIVER_NAME, vec![device(0, "A", "A", "1Gi")]),
            slice("node-a", 2, DRIVER_NAME, vec![device(0, "B", "B", "1Gi")]),
            slice("node-a", 9, "other.dev", vec![device(0, "C", "C", "1Gi")]),
        ]);
        assert_eq!(devices.len(), 1);
        assert_eq!(devices[0].model.as_deref(), Some("B"));
        assert_eq!(devices[0].memory_bytes, GI);
    }

    #[test]
    fn model_class_selects_exactly_that_model_behind_the_driver_guard() {
        let plan = plan(&[gpumodel("a100", "A100-SXM4-40GB", 312, 1)], &pool(), ON);
        let class = class_named(&plan, "a100-sxm4-40gb.gpupool.dev").expect("class");
        assert_eq!(
            expression(class),
            r#"device.driver == "gpupool.dev" && device.attributes["gpupool.dev"].model == "A100-SXM4-40GB" && (!has(device.attributes["gpupool.dev"].type) || device.attributes["gpupool.dev"].type == "gpu")"#
        );
        assert_eq!(
            class.spec.extended_resource_name.as_deref(),
            Some("gpupool.dev/a100-sxm4-40gb")
        );
        let labels = class.metadata.labels.as_ref().unwrap();
        assert_eq!(labels[MANAGED_BY_LABEL], MANAGER);
        let owners = class.metadata.owner_references.as_ref().unwrap();
        assert_eq!(
            (owners[0].kind.as_str(), owners[0].uid.as_str()),
            ("GpuModel", "uid-a100")
        );
    }

    #[test]
    fn extended_resource_name_is_left_out_when_the_cluster_lacks_it() {
        let plan = plan(
            &[gpumodel("a100", "A100-SXM4-40GB", 312, 1)],
            &pool(),
            ClassOptions {
                extended_resources: false,
            },
        );
        let class = class_named(&plan, "a100-sxm4-40gb.gpupool.dev").unwrap();
        assert_eq!(class.spec.extended_resource_name, None);
    }

    #[test]
    fn product_name_matcher_and_explicit_class_name() {
        let model = gpumodel_by_product("v100", "Tesla V100-SXM2-32GB", 256, 1)
            .class_name("v100.example.com");
        let plan = plan(&[model], &pool(), ON);
        let class = class_named(&plan, "v100.example.com").expect("explicit class name");
        assert!(expression(class).contains(
            r#" && device.attributes["gpupool.dev"].productName == "Tesla V100-SXM2-32GB" && "#
        ));
        assert_eq!(status_of(&plan, "v100").devices, 1);
    }

    #[test]
    fn product_name_default_class_is_named_after_the_drivers_model_name() {
        let model = gpumodel_by_product("rtx", "NVIDIA GeForce RTX 3090", 71, 1);
        let plan = plan(&[model], &[], ON);
        let class = class_named(&plan, "rtx-3090.gpupool.dev").expect("derived class name");
        assert_eq!(
            class.spec.extended_resource_name.as_deref(),
            Some("gpupool.dev/rtx-3090")
        );
    }

    #[test]
    fn status_counts_devices_nodes_and_memory() {
        let plan = plan(
            &[
                gpumodel("a100", "A100-SXM4-40GB", 312, 1),
                gpumodel("v100", "V100-SXM2-32GB", 256, 2),
            ],
            &pool(),
            ON,
        );
        let a100 = status_of(&plan, "a100");
        assert_eq!((a100.devices, a100.nodes), (3, 2));
        assert_eq!(a100.memory.as_deref(), Some("120Gi"));
        assert_eq!(
            a100.device_class_name.as_deref(),
            Some("a100-sxm4-40gb.gpupool.dev")
        );
        assert_eq!(a100.observed_generation, Some(1));
        assert!(is_true(&a100.conditions, READY));
        assert!(!is_true(&a100.conditions, NO_MATCHING_DEVICES));
        let v100 = status_of(&plan, "v100");
        assert_eq!((v100.devices, v100.nodes), (1, 1));
        assert_eq!(v100.memory.as_deref(), Some("32Gi"));
    }

    #[test]
    fn model_without_devices_keeps_its_class_and_says_so() {
        let plan = plan(&[gpumodel("h100", "H100-SXM5-80GB", 989, 1)], &pool(), ON);
        let status = status_of(&plan, "h100");
        assert!(is_true(&status.conditions, NO_MATCHING_DEVICES));
        assert!(!is_true(&status.conditions, READY));
        assert_eq!(status.memory.as_deref(), Some("0"));
        assert!(class_named(&plan, "h100-sxm5-80gb.gpupool.dev").is_some());
    }

    #[test]
    fn zero_or_negative_weight_is_invalid_and_gets_no_class() {
        for weight in [0, -5] {
            let plan = plan(
                &[gpumodel("a100", "A100-SXM4-40GB", weight, 1)],
                &pool(),
                ON,
            );
            let status = status_of(&plan, "a100");
            let invalid = condition(&status.conditions, INVALID);
            assert_eq!(invalid.status, "True");
            assert_eq!(invalid.reason, "InvalidComputeWeight");
            assert!(invalid.message.contains("spec.computeWeight"));
            assert!(class_named(&plan, "a100-sxm4-40gb.gpupool.dev").is_none());
            assert_eq!(status.device_class_name, None);
        }
    }

    #[test]
    fn neither_or_both_matchers_is_invalid() {
        let mut neither = gpumodel("neither", "x", 10, 1);
        neither.spec.model = None;
        let mut both = gpumodel("both", "A100-SXM4-40GB", 10, 1);
        both.spec.product_name = Some("NVIDIA A100-SXM4-40GB".to_string());
        let plan = plan(&[neither, both], &pool(), ON);
        for name in ["neither", "both"] {
            let status = status_of(&plan, name);
            assert!(is_true(&status.conditions, INVALID), "{name}");
            let invalid = condition(&status.conditions, INVALID);
            assert_eq!(invalid.reason, "InvalidMatch");
        }
        // Only the all-GPUs class is left.
        assert_eq!(plan.classes.len(), 1);
    }

    #[test]
    fn bad_class_name_is_invalid() {
        let model = gpumodel("a100", "A100-SXM4-40GB", 312, 1).class_name("Not_A_Name");
        let plan = plan(&[model], &pool(), ON);
        let status = status_of(&plan, "a100");
        assert_eq!(
            condition(&status.conditions, INVALID).reason,
            "InvalidDeviceClassName"
        );
    }

    #[test]
    fn same_class_name_conflicts_on_the_later_model_only() {
        let early = gpumodel("zeta", "A100-SXM4-40GB", 312, 1).class_name("fast.example.com");
        let late = gpumodel("alpha", "V100-SXM2-32GB", 256, 2).class_name("fast.example.com");
        let plan = plan(&[late, early], &pool(), ON);
        assert!(is_true(&status_of(&plan, "zeta").conditions, READY));
        let late_status = status_of(&plan, "alpha");
        let conflict = condition(&late_status.conditions, CONFLICT);
        assert_eq!(
            (conflict.status.as_str(), conflict.reason.as_str()),
            ("True", "DeviceClassNameConflict")
        );
        assert!(conflict.message.contains("zeta"));
        let class = class_named(&plan, "fast.example.com").unwrap();
        assert!(expression(class).contains("A100-SXM4-40GB"));
    }

    #[test]
    fn same_creation_time_breaks_the_tie_by_name() {
        let b = gpumodel("b", "A100-SXM4-40GB", 312, 5).class_name("x.example.com");
        let a = gpumodel("a", "V100-SXM2-32GB", 256, 5).class_name("x.example.com");
        let plan = plan(&[b, a], &pool(), ON);
        assert!(is_true(&status_of(&plan, "b").conditions, CONFLICT));
        assert!(!is_true(&status_of(&plan, "a").conditions, CONFLICT));
    }

    #[test]
    fn two_models_matching_one_device_conflict() {
        let by_model = gpumodel("by-model", "V100-SXM2-32GB", 256, 1);
        let by_product = gpumodel_by_product("by-product", "Tesla V100-SXM2-32GB", 250, 2)
            .class_name("other.example.com");
        let plan = plan(&[by_model, by_product], &pool(), ON);
        let status = status_of(&plan, "by-product");
        let conflict = condition(&status.conditions, CONFLICT);
        assert_eq!(conflict.reason, "DeviceConflict");
        assert!(
            conflict.message.contains("node-b/gpu-1"),
            "{}",
            conflict.message
        );
        assert!(class_named(&plan, "other.example.com").is_none());
        assert!(is_true(&status_of(&plan, "by-model").conditions, READY));
    }

    #[test]
    fn identical_matchers_conflict_even_without_devices() {
        let first = gpumodel("first", "H100", 989, 1);
        let second = gpumodel("second", "H100", 900, 2).class_name("h100-b.example.com");
        let plan = plan(&[first, second], &[], ON);
        assert!(is_true(&status_of(&plan, "second").conditions, CONFLICT));
    }

    #[test]
    fn class_name_held_by_someone_else_is_a_conflict() {
        let a100 = gpumodel("a100", "A100-SXM4-40GB", 312, 1).tier("fast");
        let plan = plan_with_taken(
            &[a100],
            &pool(),
            ON,
            &BTreeSet::from(["a100-sxm4-40gb.gpupool.dev".to_string()]),
        );
        let status = status_of(&plan, "a100");
        let conflict = condition(&status.conditions, CONFLICT);
        assert_eq!(
            (conflict.status.as_str(), conflict.reason.as_str()),
            ("True", "DeviceClassNotManaged")
        );
        assert_eq!(status.device_class_name, None);
        assert_eq!(status.devices, 3);
        assert!(class_named(&plan, "a100-sxm4-40gb.gpupool.dev").is_none());
        assert!(class_named(&plan, "tier-fast.gpupool.dev").is_none());
    }

    #[test]
    fn tier_class_selects_any_usable_model_of_the_tier() {
        let a100 = gpumodel("a100", "A100-SXM4-40GB", 312, 1).tier("Datacenter");
        let v100 = gpumodel("v100", "V100-SXM2-32GB", 256, 2).tier("datacenter");
        let broken = gpumodel("broken", "RTX-3090", 0, 3).tier("datacenter");
        let plan = plan(&[a100, v100, broken], &pool(), ON);
        let tier = class_named(&plan, "tier-datacenter.gpupool.dev").expect("tier class");
        assert_eq!(
            expression(tier),
            r#"device.driver == "gpupool.dev" && (device.attributes["gpupool.dev"].model == "A100-SXM4-40GB" || device.attributes["gpupool.dev"].model == "V100-SXM2-32GB") && (!has(device.attributes["gpupool.dev"].type) || device.attributes["gpupool.dev"].type == "gpu")"#
        );
        assert_eq!(tier.metadata.owner_references.as_ref().unwrap().len(), 2);
    }

    #[test]
    fn all_gpus_class_always_exists() {
        let plan = plan(&[], &[], ON);
        assert_eq!(plan.classes.len(), 1);
        assert_eq!(
            plan.classes[0].metadata.name.as_deref(),
            Some("gpupool.dev")
        );
        assert_eq!(
            expression(&plan.classes[0]),
            r#"device.driver == "gpupool.dev" && (!has(device.attributes["gpupool.dev"].type) || device.attributes["gpupool.dev"].type == "gpu")"#
        );
    }

    #[test]
    fn names_become_dns_safe() {
        assert_eq!(
            default_class_name("A100-SXM4-40GB"),
            "a100-sxm4-40gb.gpupool.dev"
        );
        assert_eq!(dns_label("RTX 3090 (rev. 2)"), "rtx-3090-rev-2");
        assert_eq!(dns_label("--x--"), "x");
        assert_eq!(dns_label(&"a".repeat(80)).len(), 63);
        assert!(is_dns_subdomain("a100-sxm4-40gb.gpupool.dev"));
        assert!(!is_dns_subdomain("A100.gpupool.dev"));
        assert!(!is_dns_subdomain("-a.dev"));
    }

    #[test]
    fn long_names_make_valid_label_values() {
        let long = format!("{}-{}", "a".repeat(62), "b".repeat(20));
        assert_eq!(label_value(&long), "a".repeat(62));
        assert_eq!(label_value("half-a100"), "half-a100");
    }

    #[test]
    fn cel_literals_are_escaped() {
        assert_eq!(cel_string(r#"a"b\c"#), r#""a\"b\\c""#);
    }

    /// node-h: an H100 card and MIG devices of two profiles, as a driver with MIG publishes them.
    fn mig_pool() -> Vec<PublishedDevice> {
        let mut card = device(0, "H100-80GB-HBM3", "NVIDIA H100 80GB HBM3", "81559Mi");
        let mig = |name: &str, profile: &str, sms: i64, weight: i64, memory: &str| {
            let mut d = device(0, "H100-80GB-HBM3", "NVIDIA H100 80GB HBM3", memory);
            d.name = name.to_string();
            let a = d.attributes.get_or_insert_with(Default::default);
            let string = |v: &str| DeviceAttribute {
                string: Some(v.to_string()),
                ..Default::default()
            };
            let int = |v: i64| DeviceAttribute {
                int: Some(v),
                ..Default::default()
            };
            a.insert(attr::TYPE.into(), string("mig"));
            a.insert(attr::MIG_PROFILE.into(), string(profile));
            a.insert(attr::MULTIPROCESSORS.into(), int(sms));
            a.insert(attr::COMPUTE_WEIGHT.into(), int(weight));
            d
        };
        let devices = vec![
            mig("gpu-0-mig-1g-10gb-0", "1g.10gb", 16, 119, "10194Mi"),
            mig("gpu-0-mig-1g-10gb-1", "1g.10gb", 16, 119, "10194Mi"),
            mig("gpu-0-mig-3g-40gb-4", "3g.40gb", 60, 449, "40776Mi"),
        ];
        card.attributes.get_or_insert_with(Default::default).insert(
            attr::TYPE.into(),
            DeviceAttribute {
                string: Some("gpu".into()),
                ..Default::default()
            },
        );
        published_devices(&[slice(
            "node-h",
            1,
            DRIVER_NAME,
            [vec![card], devices].concat(),
        )])
    }

    #[test]
    fn mig_profiles_get_a_class_each_and_their_compute_in_the_status() {
        let mut h100 = gpumodel("h100", "H100-80GB-HBM3", 989, 1);
        h100.spec.mig_profiles = vec!["1g.10gb".into(), "3g.40gb".into(), "7g.80gb".into()];
        let plan = plan(&[h100], &mig_pool(), ON);
        let class = class_named(&plan, "h100-80gb-hbm3-mig-1g-10gb.gpupool.dev").expect("class");
        assert_eq!(
            expression(class),
            r#"device.driver == "gpupool.dev" && device.attributes["gpupool.dev"].model == "H100-80GB-HBM3" && device.attributes["gpupool.dev"].type == "mig" && device.attributes["gpupool.dev"].migProfile == "1g.10gb""#
        );
        assert_eq!(class.spec.extended_resource_name, None);
        assert!(class_named(&plan, "h100-80gb-hbm3-mig-7g-80gb.gpupool.dev").is_some());
        let status = status_of(&plan, "h100");
        assert_eq!(
            status.devices, 1,
            "the card; its MIG devices are counted per profile"
        );
        assert_eq!(status.memory.as_deref(), Some("81559Mi"));
        let profiles: Vec<(&str, i64, Option<i64>, Option<i64>)> = status
            .mig_profiles
            .iter()
            .map(|p| {
                (
                    p.name.as_str(),
                    p.devices,
                    p.multiprocessors,
                    p.compute_weight,
                )
            })
            .collect();
        assert_eq!(
            profiles,
            [
                ("1g.10gb", 2, Some(16), Some(119)),
                ("3g.40gb", 1, Some(60), Some(449)),
                ("7g.80gb", 0, None, None)
            ]
        );
        assert_eq!(
            status.mig_profiles[0].device_class_name,
            "h100-80gb-hbm3-mig-1g-10gb.gpupool.dev"
        );
    }

    #[test]
    fn bad_mig_profile_names_make_the_model_invalid_naming_the_entry() {
        let mut h100 = gpumodel("h100", "H100-80GB-HBM3", 989, 1);
        h100.spec.mig_profiles = vec!["1g.10gb".into(), "...".into()];
        let plan = plan(&[h100.clone()], &mig_pool(), ON);
        let status = status_of(&plan, "h100");
        assert!(is_true(&status.conditions, INVALID));
        let invalid = condition(&status.conditions, INVALID);
        assert!(
            invalid.message.contains("spec.migProfiles[1]"),
            "{}",
            invalid.message
        );
        h100.spec.mig_profiles = vec!["1g.10gb".into(), "1G.10GB".into()];
        let status = status_of(&plan_of(&h100), "h100");
        let invalid = condition(&status.conditions, INVALID);
        assert!(
            invalid.message.contains("listed twice"),
            "{}",
            invalid.message
        );
    }

    fn plan_of(model: &GpuModel) -> ModelsPlan {
        plan(std::slice::from_ref(model), &mig_pool(), ON)
    }

    #[test]
    fn classes_of_cards_do_not_select_mig_devices() {
        let plan = plan(
            &[gpumodel("h100", "H100-80GB-HBM3", 989, 1)],
            &mig_pool(),
            ON,
        );
        for name in ["h100-80gb-hbm3.gpupool.dev", ALL_GPUS_CLASS] {
            let class = class_named(&plan, name).unwrap();
            assert!(
                expression(class).ends_with(
                    r#"(!has(device.attributes["gpupool.dev"].type) || device.attributes["gpupool.dev"].type == "gpu")"#
                ),
                "{name}: {}",
                expression(class)
            );
        }
    }
}

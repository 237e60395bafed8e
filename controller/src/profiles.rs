//! ComputeProfile + usable GpuModels -> the ResourceClaimTemplate to keep in each served namespace. Pure.
//!
//! One request `gpu` whose `firstAvailable` subrequests ask each allowed model, in preference order,
//! for `cores = ceil(compute * 100 / weight)` percent of one card: the same compute on whichever is free.
//! With `mig: First` or `Last`, each model's smallest MIG profile whose weight (the card's scaled by
//! the partition's share of its SMs, as the nodes publish it) reaches `compute` is offered too,
//! before or after the fractions. With `cards: N` each subrequest asks for N distinct cards, on one
//! NVLink domain with `sameNvlinkDomain`.

use std::collections::{BTreeMap, BTreeSet};

use gpupool_api::crd::{ComputeProfile, ComputeProfileStatus, MigUse, Preference};
use gpupool_api::inventory::mig_profile_label;
use gpupool_api::names::{attr, capacity, API_GROUP_VERSION, DRIVER_NAME};
use gpupool_api::quantity;
use k8s_openapi::api::resource::v1::{
    CapacityRequirements, DeviceClaim, DeviceConstraint, DeviceRequest, DeviceSubRequest,
    ResourceClaimSpec, ResourceClaimTemplate, ResourceClaimTemplateSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{
    LabelSelector, ObjectMeta, OwnerReference, Time,
};

use crate::models::{dns_label, label_value, ModelOutcome, MANAGED_BY_LABEL, MANAGER};
use crate::status::{Verdict, INVALID, READY};

/// Which ComputeProfile a template (and the claims made from it) comes from.
pub const PROFILE_LABEL: &str = "gpupool.dev/compute-profile";
/// The one request of every profile template; allocations name `gpu/<subrequest>`.
pub const REQUEST_NAME: &str = "gpu";
/// Upstream limit on `firstAvailable` subrequests per request.
pub const MAX_SUBREQUESTS: usize = 8;
/// `cores` is a percentage of one card.
const MAX_CORES: i64 = 100;
/// HAMi-core tracks at most 16 devices per container.
pub const MAX_CARDS: i64 = 16;

/// A GpuModel that may serve profiles: valid, not in conflict, with a managed DeviceClass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServableModel {
    /// The GpuModel's name (what `spec.models` lists).
    pub name: String,
    /// The short model name ("A100-SXM4-40GB").
    pub model: String,
    pub class_name: String,
    pub weight: i64,
    /// MIG profiles of the model whose compute the nodes publish.
    pub mig: Vec<ServableMig>,
}

/// A MIG profile that may serve profiles.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServableMig {
    pub profile: String,
    pub class_name: String,
    /// The card's weight scaled by the partition's share of the card's SMs.
    pub weight: i64,
    pub memory_bytes: Option<u64>,
}

impl ServableModel {
    pub fn from_outcomes(outcomes: &[ModelOutcome]) -> Vec<ServableModel> {
        outcomes
            .iter()
            .filter_map(|o| {
                Some(ServableModel {
                    name: o.name.clone(),
                    model: o.matcher.model(),
                    class_name: o.class_name.clone()?,
                    weight: o.weight,
                    mig: o
                        .mig
                        .iter()
                        .filter_map(|m| {
                            Some(ServableMig {
                                profile: m.profile.clone(),
                                class_name: m.class_name.clone(),
                                weight: m.weight?,
                                memory_bytes: m.memory_bytes,
                            })
                        })
                        .collect(),
                })
            })
            .collect()
    }
}

/// The smallest MIG profile of `model` that gives `compute` weight units and `memory` bytes.
fn smallest_mig(model: &ServableModel, compute: i64, memory: Option<u64>) -> Option<&ServableMig> {
    model
        .mig
        .iter()
        .filter(|m| m.weight >= compute)
        .filter(|m| memory.is_none_or(|want| m.memory_bytes.is_some_and(|have| have >= want)))
        .min_by(|a, b| {
            (a.weight, a.memory_bytes, &a.profile).cmp(&(b.weight, b.memory_bytes, &b.profile))
        })
}

/// One way to serve a profile: a fraction of a model's card (cores percent), or a MIG device.
#[derive(Clone, Copy)]
enum Candidate<'a> {
    Fraction(&'a ServableModel, i64),
    Mig(&'a ServableModel, &'a ServableMig),
}

impl Candidate<'_> {
    /// The weight preference orders by: the card's, or the partition's.
    fn weight(&self) -> i64 {
        match self {
            Candidate::Fraction(model, _) => model.weight,
            Candidate::Mig(_, mig) => mig.weight,
        }
    }

    fn name(&self) -> &str {
        match self {
            Candidate::Fraction(model, _) | Candidate::Mig(model, _) => &model.name,
        }
    }
}

/// A namespace as far as serving profiles goes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NamespaceInfo {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    /// Being deleted: the API refuses new objects in it.
    pub terminating: bool,
}

/// Percent of a card of weight `weight` that gives `compute` weight units, rounded up;
/// None when one card is not enough.
pub fn cores(compute: i64, weight: i64) -> Option<i64> {
    if compute <= 0 || weight <= 0 {
        return None;
    }
    let (numerator, weight) = (i128::from(compute) * 100, i128::from(weight));
    let needed = numerator / weight + i128::from(numerator % weight != 0);
    (needed <= i128::from(MAX_CORES)).then_some(needed as i64)
}

/// What became of one ComputeProfile.
#[derive(Debug, Clone, PartialEq)]
pub struct ProfileOutcome {
    pub name: String,
    pub generation: Option<i64>,
    /// The template body, the same in every served namespace; None when the profile is Invalid.
    pub template: Option<ResourceClaimTemplateSpec>,
    /// Served namespaces that exist, sorted.
    pub namespaces: Vec<String>,
    /// "A100-SXM4-40GB cores=50 memory=8Gi", in preference order.
    pub subrequests: Vec<String>,
    pub verdicts: Vec<Verdict>,
}

impl ProfileOutcome {
    pub fn status(
        &self,
        existing: Option<&ComputeProfileStatus>,
        now: &Time,
    ) -> ComputeProfileStatus {
        let existing_conditions = existing.map(|s| s.conditions.as_slice()).unwrap_or(&[]);
        ComputeProfileStatus {
            namespaces: self.namespaces.clone(),
            subrequests: self.subrequests.clone(),
            observed_generation: self.generation,
            conditions: crate::status::merge(
                existing_conditions,
                &self.verdicts,
                self.generation,
                now,
            ),
        }
    }

    /// The ResourceClaimTemplate for one served namespace (named after the profile).
    pub fn template_in(
        &self,
        namespace: &str,
        owner_uid: Option<&str>,
    ) -> Option<ResourceClaimTemplate> {
        let spec = self.template.clone()?;
        Some(ResourceClaimTemplate {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                namespace: Some(namespace.to_string()),
                labels: Some(profile_labels(&self.name)),
                owner_references: owner_uid.map(|uid| {
                    vec![OwnerReference {
                        api_version: API_GROUP_VERSION.to_string(),
                        kind: "ComputeProfile".to_string(),
                        name: self.name.clone(),
                        uid: uid.to_string(),
                        controller: Some(true),
                        block_owner_deletion: None,
                    }]
                }),
                ..Default::default()
            },
            spec,
        })
    }
}

fn profile_labels(profile: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (MANAGED_BY_LABEL.to_string(), MANAGER.to_string()),
        (PROFILE_LABEL.to_string(), label_value(profile)),
    ])
}

fn invalid(profile: &ComputeProfile, reason: &str, message: String) -> ProfileOutcome {
    ProfileOutcome {
        name: profile.metadata.name.clone().unwrap_or_default(),
        generation: profile.metadata.generation,
        template: None,
        namespaces: Vec::new(),
        subrequests: Vec::new(),
        verdicts: vec![
            Verdict::new(READY, false, reason, message.clone()),
            Verdict::new(INVALID, true, reason, message),
        ],
    }
}

/// Decide one ComputeProfile against the servable models and the cluster's namespaces.
pub fn plan(
    profile: &ComputeProfile,
    models: &[ServableModel],
    namespaces: &[NamespaceInfo],
) -> ProfileOutcome {
    let spec = &profile.spec;
    let name = profile.metadata.name.clone().unwrap_or_default();
    if spec.compute <= 0 {
        return invalid(
            profile,
            "InvalidCompute",
            format!(
                "spec.compute must be a positive integer, got {}",
                spec.compute
            ),
        );
    }
    let cards = spec.cards.unwrap_or(1);
    if !(1..=MAX_CARDS).contains(&cards) {
        return invalid(
            profile,
            "InvalidCards",
            format!("spec.cards must be from 1 to {MAX_CARDS}, got {cards}"),
        );
    }
    if cards > 1 && spec.mig != MigUse::Never {
        return invalid(
            profile,
            "InvalidMig",
            format!(
                "spec.mig {:?} needs spec.cards 1: a MIG device is a part of one card, and MIG devices have no NVLink between them (got spec.cards {cards})",
                spec.mig
            ),
        );
    }
    let mut memory_bytes = None;
    if let Some(memory) = &spec.memory {
        match quantity::parse(memory) {
            Ok(bytes) if bytes.0 > 0 => memory_bytes = u64::try_from(bytes.ceil_units()).ok(),
            Ok(_) => {
                return invalid(
                    profile,
                    "InvalidMemory",
                    format!("spec.memory must be positive, got {memory:?}"),
                )
            }
            Err(e) => return invalid(profile, "InvalidMemory", format!("spec.memory: {e}")),
        }
    }
    let selector = match &spec.namespace_selector {
        Some(selector) => match LabelMatcher::new(selector) {
            Ok(m) => Some(m),
            Err(message) => {
                return invalid(
                    profile,
                    "InvalidNamespaceSelector",
                    format!("spec.namespaceSelector: {message}"),
                )
            }
        },
        None => None,
    };

    let mut notes = Vec::new();
    let allowed: Vec<&ServableModel> = if spec.models.is_empty() {
        models.iter().collect()
    } else {
        let mut allowed = Vec::new();
        for wanted in &spec.models {
            match models.iter().find(|m| &m.name == wanted) {
                Some(m) => allowed.push(m),
                None => notes.push(format!(
                    "GpuModel {wanted} is missing, invalid or in conflict"
                )),
            }
        }
        allowed
    };

    let by_preference = |a: i64, b: i64| match spec.preference {
        Preference::Strongest => b.cmp(&a),
        Preference::Weakest => a.cmp(&b),
    };
    let mut fractions: Vec<Candidate> = Vec::new();
    let mut migs: Vec<Candidate> = Vec::new();
    for model in allowed {
        match cores(spec.compute, model.weight) {
            Some(c) => fractions.push(Candidate::Fraction(model, c)),
            None => notes.push(format!(
                "{} left out: compute {} is more than one card (weight {})",
                model.model, spec.compute, model.weight
            )),
        }
        if spec.mig != MigUse::Never {
            match smallest_mig(model, spec.compute, memory_bytes) {
                Some(mig) => migs.push(Candidate::Mig(model, mig)),
                None => notes.push(format!(
                    "{}: no MIG profile of GpuModel {} that the nodes publish reaches compute {}{}",
                    model.model,
                    model.name,
                    spec.compute,
                    spec.memory
                        .as_deref()
                        .map(|m| format!(" and memory {m}"))
                        .unwrap_or_default()
                )),
            }
        }
    }
    for list in [&mut fractions, &mut migs] {
        list.sort_by(|a, b| {
            by_preference(a.weight(), b.weight()).then_with(|| a.name().cmp(b.name()))
        });
    }
    let mut candidates = match spec.mig {
        MigUse::First => [migs, fractions].concat(),
        MigUse::Never | MigUse::Last => [fractions, migs].concat(),
    };
    if candidates.len() > MAX_SUBREQUESTS {
        notes.push(format!(
            "only the first {MAX_SUBREQUESTS} of {} ways to serve it are offered",
            candidates.len()
        ));
        candidates.truncate(MAX_SUBREQUESTS);
    }
    if candidates.is_empty() {
        return invalid(
            profile,
            "NoModelCanServe",
            format!("no model can serve compute {}", spec.compute),
        );
    }

    let mut used_names = BTreeSet::new();
    let mut subrequests = Vec::new();
    let mut summaries = Vec::new();
    for candidate in &candidates {
        let base = match candidate {
            Candidate::Fraction(model, _) => dns_label(&model.model),
            Candidate::Mig(model, mig) => format!(
                "{}-mig-{}",
                dns_label(&model.model),
                mig_profile_label(&mig.profile)
            ),
        };
        let mut sub_name = base.clone();
        let mut n = 2;
        while !used_names.insert(sub_name.clone()) {
            sub_name = format!("{base}-{n}");
            n += 1;
        }
        let (class, capacity, summary) = match candidate {
            Candidate::Fraction(model, cores) => {
                let mut requests =
                    BTreeMap::from([(capacity::CORES.to_string(), Quantity(cores.to_string()))]);
                let mut summary = format!("{} cores={cores}", model.model);
                if let Some(memory) = &spec.memory {
                    requests.insert(capacity::MEMORY.to_string(), Quantity(memory.clone()));
                    summary.push_str(&format!(" memory={memory}"));
                }
                if cards > 1 {
                    summary.push_str(&format!(" x{cards}"));
                }
                (
                    model.class_name.clone(),
                    Some(CapacityRequirements {
                        requests: Some(requests),
                    }),
                    summary,
                )
            }
            // A MIG device is taken whole: its memory and SMs are its profile's.
            Candidate::Mig(model, mig) => (
                mig.class_name.clone(),
                None,
                format!(
                    "{} MIG {} (weight {})",
                    model.model, mig.profile, mig.weight
                ),
            ),
        };
        summaries.push(summary);
        subrequests.push(DeviceSubRequest {
            name: sub_name,
            device_class_name: class,
            allocation_mode: Some("ExactCount".to_string()),
            count: Some(cards),
            capacity,
            selectors: None,
            tolerations: None,
        });
    }
    let mut constraints = Vec::new();
    if cards > 1 {
        // Shares of one card could otherwise fill several slots of the request.
        constraints.push(DeviceConstraint {
            requests: Some(vec![REQUEST_NAME.to_string()]),
            distinct_attribute: Some(format!("{DRIVER_NAME}/{}", attr::UUID)),
            match_attribute: None,
        });
        if spec.same_nvlink_domain {
            constraints.push(DeviceConstraint {
                requests: Some(vec![REQUEST_NAME.to_string()]),
                match_attribute: Some(format!("{DRIVER_NAME}/{}", attr::NVLINK_DOMAIN)),
                distinct_attribute: None,
            });
        }
    } else if spec.same_nvlink_domain {
        notes.push("spec.sameNvlinkDomain has no effect with one card".to_string());
    }

    let mut served: BTreeSet<String> = BTreeSet::new();
    for wanted in &spec.namespaces {
        match namespaces.iter().find(|n| &n.name == wanted) {
            Some(ns) if !ns.terminating => {
                served.insert(ns.name.clone());
            }
            Some(_) => notes.push(format!("namespace {wanted} is terminating")),
            None => notes.push(format!("namespace {wanted} does not exist")),
        }
    }
    if let Some(selector) = &selector {
        served.extend(
            namespaces
                .iter()
                .filter(|ns| !ns.terminating && selector.matches(&ns.labels))
                .map(|ns| ns.name.clone()),
        );
    }

    let template = ResourceClaimTemplateSpec {
        metadata: Some(ObjectMeta {
            labels: Some(BTreeMap::from([(
                PROFILE_LABEL.to_string(),
                label_value(&name),
            )])),
            ..Default::default()
        }),
        spec: ResourceClaimSpec {
            devices: Some(DeviceClaim {
                requests: Some(vec![DeviceRequest {
                    name: REQUEST_NAME.to_string(),
                    exactly: None,
                    first_available: Some(subrequests),
                }]),
                constraints: (!constraints.is_empty()).then_some(constraints),
                config: None,
            }),
        },
    };

    let ready = if served.is_empty() {
        let mut message =
            "no namespace is served (spec.namespaces / spec.namespaceSelector)".to_string();
        for note in &notes {
            message.push_str("; ");
            message.push_str(note);
        }
        Verdict::new(READY, false, "NoNamespaces", message)
    } else {
        let mut message = format!(
            "ResourceClaimTemplate {name} in {}",
            served.iter().cloned().collect::<Vec<_>>().join(", ")
        );
        for note in &notes {
            message.push_str("; ");
            message.push_str(note);
        }
        Verdict::new(READY, true, "TemplatesReady", message)
    };

    ProfileOutcome {
        name,
        generation: profile.metadata.generation,
        template: Some(template),
        namespaces: served.into_iter().collect(),
        subrequests: summaries,
        verdicts: vec![ready, Verdict::new(INVALID, false, "Valid", "")],
    }
}

/// A label selector, checked once, matched many times.
#[derive(Debug, Clone)]
pub struct LabelMatcher {
    requirements: Vec<(String, Operator, Vec<String>)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Operator {
    In,
    NotIn,
    Exists,
    DoesNotExist,
}

impl LabelMatcher {
    pub fn new(selector: &LabelSelector) -> Result<Self, String> {
        let mut requirements = Vec::new();
        for (key, value) in selector.match_labels.iter().flatten() {
            requirements.push((key.clone(), Operator::In, vec![value.clone()]));
        }
        for (i, expr) in selector.match_expressions.iter().flatten().enumerate() {
            let op = match expr.operator.as_str() {
                "In" => Operator::In,
                "NotIn" => Operator::NotIn,
                "Exists" => Operator::Exists,
                "DoesNotExist" => Operator::DoesNotExist,
                other => {
                    return Err(format!(
                        "matchExpressions[{i}].operator {other:?} is not In, NotIn, Exists or DoesNotExist"
                    ))
                }
            };
            let values = expr.values.clone().unwrap_or_default();
            let needs_values = matches!(op, Operator::In | Operator::NotIn);
            if needs_values == values.is_empty() {
                return Err(format!(
                    "matchExpressions[{i}].values must be {} for {}",
                    if needs_values { "non-empty" } else { "empty" },
                    expr.operator
                ));
            }
            requirements.push((expr.key.clone(), op, values));
        }
        Ok(LabelMatcher { requirements })
    }

    /// An empty selector matches everything, as in Kubernetes.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.requirements.iter().all(|(key, op, values)| {
            let value = labels.get(key);
            match op {
                Operator::In => value.is_some_and(|v| values.contains(v)),
                Operator::NotIn => !value.is_some_and(|v| values.contains(v)),
                Operator::Exists => value.is_some(),
                Operator::DoesNotExist => value.is_none(),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::is_true;
    use crate::testing::{at, condition};
    use gpupool_api::crd::ComputeProfileSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;

    fn model(name: &str, weight: i64) -> ServableModel {
        ServableModel {
            name: name.to_lowercase(),
            model: name.to_string(),
            class_name: format!("{}.gpupool.dev", name.to_lowercase()),
            weight,
            mig: Vec::new(),
        }
    }

    /// The seeds' pool.
    fn pool() -> Vec<ServableModel> {
        vec![
            model("V100-SXM2-32GB", 256),
            model("RTX-3090", 71),
            model("A100-SXM4-40GB", 312),
        ]
    }

    fn team_a() -> Vec<NamespaceInfo> {
        vec![
            NamespaceInfo {
                name: "team-a".into(),
                labels: BTreeMap::from([("gpu".into(), "yes".into())]),
                terminating: false,
            },
            NamespaceInfo {
                name: "team-b".into(),
                ..Default::default()
            },
        ]
    }

    fn profile(compute: i64, memory: Option<&str>) -> ComputeProfile {
        let mut p = ComputeProfile::new(
            "half-a100",
            ComputeProfileSpec {
                compute,
                memory: memory.map(str::to_string),
                models: Vec::new(),
                preference: Preference::Strongest,
                namespaces: vec!["team-a".into()],
                namespace_selector: None,
                mig: Default::default(),
                cards: None,
                same_nvlink_domain: false,
            },
        );
        p.metadata.generation = Some(3);
        p
    }

    fn subrequests(outcome: &ProfileOutcome) -> Vec<DeviceSubRequest> {
        let template = outcome.template.as_ref().expect("a template");
        let requests = template
            .spec
            .devices
            .as_ref()
            .unwrap()
            .requests
            .as_ref()
            .unwrap();
        assert_eq!(requests.len(), 1);
        assert_eq!(requests[0].name, "gpu");
        requests[0].first_available.clone().unwrap()
    }

    fn requested(sub: &DeviceSubRequest, what: &str) -> Option<String> {
        sub.capacity
            .as_ref()?
            .requests
            .as_ref()?
            .get(what)
            .map(|q| q.0.clone())
    }

    #[test]
    fn exact_division_needs_no_rounding() {
        assert_eq!(cores(156, 312), Some(50));
        assert_eq!(cores(312, 312), Some(100));
    }

    #[test]
    fn remainders_round_up() {
        assert_eq!(cores(156, 256), Some(61)); // 60.9375
        assert_eq!(cores(1, 312), Some(1)); // 0.32
    }

    #[test]
    fn more_than_one_card_is_none() {
        assert_eq!(cores(156, 71), None); // 219.7
        assert_eq!(cores(313, 312), None); // 100.3 rounds up to 101
        assert_eq!(cores(0, 312), None);
    }

    #[test]
    fn half_a100_is_a100_50_then_v100_61_and_no_3090() {
        let outcome = plan(&profile(156, Some("8Gi")), &pool(), &team_a());
        let subs = subrequests(&outcome);
        let summary: Vec<(String, String, Option<String>, Option<String>)> = subs
            .iter()
            .map(|s| {
                (
                    s.name.clone(),
                    s.device_class_name.clone(),
                    requested(s, "cores"),
                    requested(s, "memory"),
                )
            })
            .collect();
        assert_eq!(
            summary,
            [
                (
                    "a100-sxm4-40gb".to_string(),
                    "a100-sxm4-40gb.gpupool.dev".to_string(),
                    Some("50".to_string()),
                    Some("8Gi".to_string())
                ),
                (
                    "v100-sxm2-32gb".to_string(),
                    "v100-sxm2-32gb.gpupool.dev".to_string(),
                    Some("61".to_string()),
                    Some("8Gi".to_string())
                ),
            ]
        );
        assert!(subs
            .iter()
            .all(|s| s.allocation_mode.as_deref() == Some("ExactCount") && s.count == Some(1)));
        assert_eq!(
            outcome.subrequests,
            [
                "A100-SXM4-40GB cores=50 memory=8Gi",
                "V100-SXM2-32GB cores=61 memory=8Gi"
            ]
        );
        assert_eq!(outcome.namespaces, ["team-a"]);
        assert!(outcome.verdicts[0]
            .message
            .contains("RTX-3090 left out: compute 156 is more than one card (weight 71)"));
        let status = outcome.status(None, &at(0));
        assert!(is_true(&status.conditions, READY));
        assert_eq!(status.observed_generation, Some(3));
    }

    #[test]
    fn memory_is_omitted_when_unset() {
        let outcome = plan(&profile(156, None), &pool(), &team_a());
        for sub in subrequests(&outcome) {
            assert_eq!(requested(&sub, "memory"), None);
            assert!(requested(&sub, "cores").is_some());
        }
    }

    #[test]
    fn weakest_preference_orders_ascending() {
        let mut p = profile(60, None);
        p.spec.preference = Preference::Weakest;
        let names: Vec<String> = subrequests(&plan(&p, &pool(), &team_a()))
            .into_iter()
            .map(|s| s.name)
            .collect();
        assert_eq!(names, ["rtx-3090", "v100-sxm2-32gb", "a100-sxm4-40gb"]);
    }

    #[test]
    fn equal_weights_are_ordered_by_name() {
        let models = vec![model("B-CARD", 100), model("A-CARD", 100)];
        let names: Vec<String> = subrequests(&plan(&profile(50, None), &models, &team_a()))
            .into_iter()
            .map(|s| s.name)
            .collect();
        assert_eq!(names, ["a-card", "b-card"]);
    }

    #[test]
    fn at_most_eight_subrequests_strongest_kept() {
        let models: Vec<ServableModel> =
            (1..=10).map(|i| model(&format!("M{i}"), 100 + i)).collect();
        let subs = subrequests(&plan(&profile(50, None), &models, &team_a()));
        assert_eq!(subs.len(), 8);
        assert_eq!(subs[0].name, "m10");
        assert_eq!(subs[7].name, "m3");
    }

    #[test]
    fn allowed_models_restrict_the_list() {
        let mut p = profile(156, None);
        p.spec.models = vec!["v100-sxm2-32gb".into(), "gone".into()];
        let outcome = plan(&p, &pool(), &team_a());
        let names: Vec<String> = subrequests(&outcome).into_iter().map(|s| s.name).collect();
        assert_eq!(names, ["v100-sxm2-32gb"]);
        assert!(outcome.verdicts[0].message.contains("GpuModel gone"));
    }

    #[test]
    fn no_model_can_serve_is_invalid() {
        let outcome = plan(&profile(400, None), &pool(), &team_a());
        assert_eq!(outcome.template, None);
        let status = outcome.status(None, &at(0));
        let invalid = condition(&status.conditions, INVALID);
        assert_eq!(invalid.status, "True");
        assert_eq!(invalid.message, "no model can serve compute 400");
    }

    #[test]
    fn bad_compute_or_memory_names_the_field() {
        let zero = plan(&profile(0, None), &pool(), &team_a());
        assert!(zero.verdicts[1].status && zero.verdicts[1].message.contains("spec.compute"));
        let bad = plan(&profile(156, Some("lots")), &pool(), &team_a());
        assert!(bad.verdicts[1].status && bad.verdicts[1].message.contains("spec.memory"));
    }

    #[test]
    fn namespaces_from_list_and_selector() {
        let mut p = profile(156, None);
        p.spec.namespaces = vec!["missing".into()];
        p.spec.namespace_selector = Some(LabelSelector {
            match_labels: Some(BTreeMap::from([("gpu".into(), "yes".into())])),
            match_expressions: None,
        });
        let outcome = plan(&p, &pool(), &team_a());
        assert_eq!(outcome.namespaces, ["team-a"]);
        assert!(outcome.verdicts[0]
            .message
            .contains("namespace missing does not exist"));
        let template = outcome.template_in("team-a", Some("uid-1")).unwrap();
        assert_eq!(template.metadata.name.as_deref(), Some("half-a100"));
        assert_eq!(
            template.metadata.labels.as_ref().unwrap()[MANAGED_BY_LABEL],
            MANAGER
        );
        assert_eq!(
            template.metadata.owner_references.unwrap()[0].kind,
            "ComputeProfile"
        );
    }

    #[test]
    fn terminating_namespaces_are_not_served() {
        let mut namespaces = team_a();
        namespaces[0].terminating = true;
        let outcome = plan(&profile(156, None), &pool(), &namespaces);
        assert!(outcome.namespaces.is_empty());
        assert!(!outcome.verdicts[0].status);
    }

    #[test]
    fn selector_operators() {
        let selector = LabelMatcher::new(&LabelSelector {
            match_labels: None,
            match_expressions: Some(vec![
                LabelSelectorRequirement {
                    key: "team".into(),
                    operator: "In".into(),
                    values: Some(vec!["a".into(), "b".into()]),
                },
                LabelSelectorRequirement {
                    key: "frozen".into(),
                    operator: "DoesNotExist".into(),
                    values: None,
                },
            ]),
        })
        .unwrap();
        let labels = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>()
        };
        assert!(selector.matches(&labels(&[("team", "a")])));
        assert!(!selector.matches(&labels(&[("team", "c")])));
        assert!(!selector.matches(&labels(&[("team", "a"), ("frozen", "1")])));
        let bad = LabelMatcher::new(&LabelSelector {
            match_labels: None,
            match_expressions: Some(vec![LabelSelectorRequirement {
                key: "x".into(),
                operator: "Like".into(),
                values: None,
            }]),
        });
        assert!(bad.unwrap_err().contains("operator"));
    }

    /// An H100 (weight 989) with MIG profiles as its nodes publish them, and an A100.
    fn mig_pool() -> Vec<ServableModel> {
        let mig = |profile: &str, weight: i64, mib: u64| ServableMig {
            profile: profile.to_string(),
            class_name: format!(
                "h100-80gb-hbm3-mig-{}.gpupool.dev",
                mig_profile_label(profile)
            ),
            weight,
            memory_bytes: Some(mib << 20),
        };
        let mut h100 = model("H100-80GB-HBM3", 989);
        h100.mig = vec![
            mig("3g.40gb", 449, 40776),
            mig("1g.10gb", 119, 10194),
            mig("1g.20gb", 194, 20388),
        ];
        vec![h100, model("A100-SXM4-40GB", 312)]
    }

    fn names(outcome: &ProfileOutcome) -> Vec<(String, String, Option<String>)> {
        subrequests(outcome)
            .iter()
            .map(|s| {
                (
                    s.name.clone(),
                    s.device_class_name.clone(),
                    requested(s, "cores"),
                )
            })
            .collect()
    }

    #[test]
    fn a_profile_falls_back_from_the_smallest_mig_profile_that_serves_it_to_fractions() {
        let mut p = profile(100, None);
        p.spec.mig = MigUse::First;
        let outcome = plan(&p, &mig_pool(), &team_a());
        let subs = names(&outcome);
        // compute 100: 1g.10gb gives 119, the smallest that reaches it.
        assert_eq!(
            subs,
            [
                (
                    "h100-80gb-hbm3-mig-1g-10gb".to_string(),
                    "h100-80gb-hbm3-mig-1g-10gb.gpupool.dev".to_string(),
                    None
                ),
                (
                    "h100-80gb-hbm3".to_string(),
                    "h100-80gb-hbm3.gpupool.dev".to_string(),
                    Some("11".to_string())
                ),
                (
                    "a100-sxm4-40gb".to_string(),
                    "a100-sxm4-40gb.gpupool.dev".to_string(),
                    Some("33".to_string())
                ),
            ]
        );
        assert!(
            subrequests(&outcome)[0].capacity.is_none(),
            "a MIG device is taken whole"
        );
        assert_eq!(
            outcome.subrequests[0],
            "H100-80GB-HBM3 MIG 1g.10gb (weight 119)"
        );

        // Fractions first, MIG last; more compute picks a bigger profile; memory counts too.
        p.spec.mig = MigUse::Last;
        p.spec.compute = 150;
        let subs = names(&plan(&p, &mig_pool(), &team_a()));
        assert_eq!(subs.last().unwrap().0, "h100-80gb-hbm3-mig-1g-20gb");
        p.spec.memory = Some("30Gi".into());
        let subs = names(&plan(&p, &mig_pool(), &team_a()));
        assert_eq!(subs.last().unwrap().0, "h100-80gb-hbm3-mig-3g-40gb");
        // Never (the default): fractions only.
        p.spec.mig = MigUse::Never;
        let subs = names(&plan(&p, &mig_pool(), &team_a()));
        assert!(
            subs.iter().all(|(n, _, _)| !n.contains("-mig-")),
            "{subs:?}"
        );
    }

    #[test]
    fn a_model_without_a_big_enough_mig_profile_is_noted() {
        let mut p = profile(500, None);
        p.spec.mig = MigUse::First;
        let outcome = plan(&p, &mig_pool(), &team_a());
        assert!(names(&outcome).iter().all(|(n, _, _)| !n.contains("-mig-")));
        let ready = condition(&outcome.status(None, &at(0)).conditions, READY).clone();
        assert!(
            ready
                .message
                .contains("no MIG profile of GpuModel h100-80gb-hbm3"),
            "{}",
            ready.message
        );
    }

    #[test]
    fn n_cards_on_one_nvlink_domain_are_distinct_cards_matched_on_the_domain() {
        let mut p = profile(312, None);
        p.spec.cards = Some(2);
        p.spec.same_nvlink_domain = true;
        let outcome = plan(&p, &mig_pool(), &team_a());
        let subs = subrequests(&outcome);
        assert!(subs.iter().all(|s| s.count == Some(2)));
        let template = outcome.template.as_ref().unwrap();
        let constraints = template
            .spec
            .devices
            .as_ref()
            .unwrap()
            .constraints
            .clone()
            .unwrap();
        assert_eq!(constraints.len(), 2);
        assert_eq!(
            constraints[0].distinct_attribute.as_deref(),
            Some("gpupool.dev/uuid")
        );
        assert_eq!(
            constraints[1].match_attribute.as_deref(),
            Some("gpupool.dev/nvlinkDomain")
        );
        assert!(constraints
            .iter()
            .all(|c| c.requests.as_deref() == Some(&["gpu".to_string()][..])));
        assert!(
            outcome.subrequests[0].ends_with(" x2"),
            "{:?}",
            outcome.subrequests
        );
    }

    #[test]
    fn bad_card_counts_and_mig_with_several_cards_are_invalid_naming_the_field() {
        let mut p = profile(100, None);
        p.spec.cards = Some(0);
        let outcome = plan(&p, &mig_pool(), &team_a());
        assert!(outcome.template.is_none());
        let invalid = condition(&outcome.status(None, &at(0)).conditions, INVALID).clone();
        assert!(
            invalid.message.starts_with("spec.cards must be"),
            "{}",
            invalid.message
        );
        p.spec.cards = Some(2);
        p.spec.mig = MigUse::Last;
        let outcome = plan(&p, &mig_pool(), &team_a());
        let invalid = condition(&outcome.status(None, &at(0)).conditions, INVALID).clone();
        assert!(
            invalid.message.starts_with("spec.mig"),
            "{}",
            invalid.message
        );
    }
}

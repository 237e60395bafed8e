//! The structured-parameters allocator of kube-scheduler's DRA plugin (resource.k8s.io/v1),
//! as a pure function: one claim, one node, the published slices and the claims already
//! allocated in, an `AllocationResult` or the reason why not out.
//!
//! Search order and semantics follow upstream: requests in order, `firstAvailable`
//! subrequests in order, devices in pool order (pools sorted by driver and name, slices by
//! name), depth-first with backtracking, so a claim gets all its requests or nothing.

pub mod capacity;
pub mod counters;
pub mod pools;
pub mod selectors;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, HashMap, HashSet};

use gpupool_api::claim::allocation_results;
use k8s_openapi::api::core::v1::{NodeSelector, NodeSelectorRequirement, NodeSelectorTerm};
use k8s_openapi::api::resource::v1::{
    AllocationResult, DeviceAllocationConfiguration, DeviceAllocationResult, DeviceAttribute,
    DeviceClass, DeviceConstraint, DeviceRequestAllocationResult, DeviceSelector, DeviceTaint,
    DeviceToleration, ResourceClaim, ResourceSlice,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube_cel::cel::Value;
use thiserror::Error;

use capacity::{CapacityError, Consumed};
use pools::{gather_pools, placement, Placement};
pub use pools::{node_selector_matches, TargetNode};
use selectors::CelEvaluator;

/// Why a claim cannot be allocated on a node, in words a user can act on.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[error("{message}")]
pub struct Unallocatable {
    pub message: String,
}

impl Unallocatable {
    fn new(message: impl Into<String>) -> Self {
        Unallocatable {
            message: message.into(),
        }
    }
}

/// Diagnosis when every request fits alone.
const TOGETHER: &str =
    "each request fits on its own but not all together (constraints or shared capacity)";

/// Upper bound on search steps, so a pathological claim fails instead of hanging the loop.
const SEARCH_STEP_LIMIT: u64 = 100_000;

/// Allocate `claim` on `node`. `allocated` holds every claim whose allocation already uses
/// devices (the claim itself, if present there, is ignored).
pub fn allocate(
    claim: &ResourceClaim,
    node: &TargetNode,
    classes: &[DeviceClass],
    slices: &[ResourceSlice],
    allocated: &[ResourceClaim],
) -> Result<AllocationResult, Unallocatable> {
    let claim_ref = format!(
        "{}/{}",
        claim.metadata.namespace.as_deref().unwrap_or_default(),
        claim.metadata.name.as_deref().unwrap_or_default()
    );
    let requests = resolve_requests(claim, &claim_ref, classes)?;
    let pools = gather_pools(slices, node);
    let mut candidates = Vec::new();
    let mut offered = counters::Ledger::new();
    for (index, pool) in pools.iter().enumerate() {
        counters::offered(index, pool.counter_sets.values().copied(), &mut offered);
        for device in &pool.devices {
            candidates.push(Candidate {
                driver: pool.driver,
                pool: pool.name,
                pool_index: index,
                pool_incomplete: pool.incomplete,
                pool_invalid: pool.invalid.clone(),
                slice: device.slice,
                device: device.device,
            });
        }
    }
    let in_use = InUse::from_claims(claim, allocated, &candidates);
    let mut search = Search {
        claim_ref,
        node: &node.name,
        constraints: claim
            .spec
            .devices
            .as_ref()
            .and_then(|d| d.constraints.as_deref())
            .unwrap_or_default(),
        chosen: vec![0; requests.len()],
        requests,
        in_use,
        offered,
        candidates,
        cel: CelEvaluator::new(),
        values: HashMap::new(),
        selectable: HashMap::new(),
        picks: Vec::new(),
        steps: 0,
    };
    match search.solve(0) {
        Ok(true) => Ok(search.result(claim)),
        Ok(false) => Err(Unallocatable::new(search.diagnose()?)),
        // Out of steps: a request that cannot be met even alone is the better answer.
        Err(gave_up) if search.steps > SEARCH_STEP_LIMIT => {
            let diagnosis = search.diagnose()?;
            Err(if diagnosis.contains(TOGETHER) {
                gave_up
            } else {
                Unallocatable::new(diagnosis)
            })
        }
        Err(other) => Err(other),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Count(usize),
    All,
}

/// One way to satisfy a request: the request itself (`exactly`) or one of its subrequests.
struct Variant<'a> {
    /// The name results carry: `<request>` or `<request>/<subrequest>`.
    result_name: String,
    subrequest: Option<&'a str>,
    class: &'a DeviceClass,
    selectors: &'a [DeviceSelector],
    mode: Mode,
    capacity: Option<&'a BTreeMap<String, Quantity>>,
    admin_access: bool,
    tolerations: Option<&'a Vec<DeviceToleration>>,
}

struct Request<'a> {
    name: &'a str,
    variants: Vec<Variant<'a>>,
}

fn resolve_requests<'a>(
    claim: &'a ResourceClaim,
    claim_ref: &str,
    classes: &'a [DeviceClass],
) -> Result<Vec<Request<'a>>, Unallocatable> {
    let find_class = |request: &str, name: &str| {
        classes
            .iter()
            .find(|c| c.metadata.name.as_deref() == Some(name))
            .ok_or_else(|| {
                Unallocatable::new(format!(
                    "claim {claim_ref}, request {request}: could not retrieve device class {name}: \
                     deviceclass.resource.k8s.io \"{name}\" not found"
                ))
            })
    };
    let mode = |request: &str, mode: Option<&str>, count: Option<i64>| match mode {
        None | Some("ExactCount") => Ok(Mode::Count(count.unwrap_or(1).max(1) as usize)),
        Some("All") => Ok(Mode::All),
        Some(other) => Err(Unallocatable::new(format!(
            "claim {claim_ref}, request {request}: unsupported allocationMode {other:?}"
        ))),
    };
    let mut requests = Vec::new();
    for request in crate::claims::requests_of(claim) {
        let name = request.name.as_str();
        let mut variants = Vec::new();
        if let Some(exact) = &request.exactly {
            variants.push(Variant {
                result_name: name.to_string(),
                subrequest: None,
                class: find_class(name, &exact.device_class_name)?,
                selectors: exact.selectors.as_deref().unwrap_or_default(),
                mode: mode(name, exact.allocation_mode.as_deref(), exact.count)?,
                capacity: exact.capacity.as_ref().and_then(|c| c.requests.as_ref()),
                admin_access: exact.admin_access == Some(true),
                tolerations: exact.tolerations.as_ref(),
            });
        } else if let Some(subrequests) = &request.first_available {
            for sub in subrequests {
                let result_name = format!("{name}/{}", sub.name);
                variants.push(Variant {
                    class: find_class(&result_name, &sub.device_class_name)?,
                    selectors: sub.selectors.as_deref().unwrap_or_default(),
                    mode: mode(&result_name, sub.allocation_mode.as_deref(), sub.count)?,
                    capacity: sub.capacity.as_ref().and_then(|c| c.requests.as_ref()),
                    admin_access: false,
                    tolerations: sub.tolerations.as_ref(),
                    subrequest: Some(sub.name.as_str()),
                    result_name,
                });
            }
        }
        if variants.is_empty() {
            return Err(Unallocatable::new(format!(
                "claim {claim_ref}, request {name}: neither exactly nor firstAvailable is set"
            )));
        }
        requests.push(Request { name, variants });
    }
    Ok(requests)
}

type DeviceKey = (String, String, String);

struct Candidate<'a> {
    driver: &'a str,
    pool: &'a str,
    /// Index of the pool among the node's pools (the key of its counters).
    pool_index: usize,
    pool_incomplete: bool,
    /// Why the pool cannot be used, when it cannot.
    pool_invalid: Option<String>,
    slice: &'a ResourceSlice,
    device: &'a k8s_openapi::api::resource::v1::Device,
}

impl Candidate<'_> {
    fn key(&self) -> DeviceKey {
        (
            self.driver.to_string(),
            self.pool.to_string(),
            self.device.name.clone(),
        )
    }

    fn shared(&self) -> bool {
        self.device.allow_multiple_allocations == Some(true)
    }

    fn consumes_counters(&self) -> bool {
        self.device
            .consumes_counters
            .as_ref()
            .is_some_and(|c| !c.is_empty())
    }
}

/// Devices other claims hold: whole (exclusive) or as shares with their consumed capacity, and
/// the counters their devices take.
#[derive(Default)]
struct InUse {
    exclusive: HashSet<DeviceKey>,
    shares: HashMap<DeviceKey, (Consumed, HashSet<String>)>,
    counters: counters::Ledger,
}

impl InUse {
    fn from_claims(
        claim: &ResourceClaim,
        allocated: &[ResourceClaim],
        candidates: &[Candidate<'_>],
    ) -> Self {
        let mut in_use = InUse::default();
        let same = |other: &ResourceClaim| match (&claim.metadata.uid, &other.metadata.uid) {
            (Some(a), Some(b)) => a == b,
            _ => {
                claim.metadata.namespace == other.metadata.namespace
                    && claim.metadata.name == other.metadata.name
            }
        };
        for other in allocated.iter().filter(|other| !same(other)) {
            for result in allocation_results(other)
                .iter()
                .filter(|r| r.admin_access != Some(true))
            {
                let key = (
                    result.driver.clone(),
                    result.pool.clone(),
                    result.device.clone(),
                );
                match &result.share_id {
                    Some(share) => {
                        let entry = in_use.shares.entry(key).or_default();
                        entry.1.insert(share.clone());
                        if let Some(consumed) = &result.consumed_capacity {
                            // An unparsable amount was written by someone else; it cannot be
                            // accounted and must not block every allocation on the node.
                            let _ = capacity::add(&mut entry.0, consumed);
                        }
                    }
                    None => {
                        in_use.exclusive.insert(key);
                    }
                }
            }
        }
        // Each device in use is charged once, however many shares it has (a device no longer
        // published charges nothing).
        let in_use_keys: HashSet<&DeviceKey> = in_use
            .exclusive
            .iter()
            .chain(in_use.shares.keys())
            .collect();
        for c in candidates {
            if in_use_keys.contains(&c.key()) {
                counters::charge(&mut in_use.counters, c.pool_index, c.device);
            }
        }
        in_use
    }
}

struct Pick {
    request: usize,
    variant: usize,
    candidate: usize,
    consumption: Option<BTreeMap<String, Quantity>>,
}

/// Why one device cannot serve one request (variant).
enum Rejection {
    Class,
    Selector,
    Taint(String),
    InUse(String),
    Capacity(CapacityError),
    Constraint(String),
    InvalidPool(String),
    Counters(String),
}

struct Search<'a> {
    claim_ref: String,
    node: &'a str,
    requests: Vec<Request<'a>>,
    constraints: &'a [DeviceConstraint],
    candidates: Vec<Candidate<'a>>,
    in_use: InUse,
    /// What each pool's counter sets offer.
    offered: counters::Ledger,
    cel: CelEvaluator,
    values: HashMap<usize, Value>,
    /// (request, variant, candidate) -> class and request selectors match.
    selectable: HashMap<(usize, usize, usize), Result<(), bool>>,
    picks: Vec<Pick>,
    chosen: Vec<usize>,
    steps: u64,
}

impl<'a> Search<'a> {
    /// Counts one search step; too many end the search with an error.
    fn step(&mut self) -> Result<(), Unallocatable> {
        self.steps += 1;
        if self.steps > SEARCH_STEP_LIMIT {
            return Err(Unallocatable::new(format!(
                "claim {}: gave up after {SEARCH_STEP_LIMIT} allocation attempts",
                self.claim_ref
            )));
        }
        Ok(())
    }

    fn solve(&mut self, request: usize) -> Result<bool, Unallocatable> {
        self.step()?;
        if request == self.requests.len() {
            return Ok(true);
        }
        for variant in 0..self.requests[request].variants.len() {
            self.chosen[request] = variant;
            let found = match self.requests[request].variants[variant].mode {
                Mode::Count(n) => self.pick(request, variant, n, 0)?,
                Mode::All => self.pick_all(request, variant)?,
            };
            if found {
                return Ok(true);
            }
        }
        Ok(false)
    }

    fn pick(
        &mut self,
        request: usize,
        variant: usize,
        remaining: usize,
        start: usize,
    ) -> Result<bool, Unallocatable> {
        if remaining == 0 {
            return self.solve(request + 1);
        }
        for candidate in start..self.candidates.len() {
            self.step()?;
            if let Ok(consumption) = self.try_candidate(request, variant, candidate)? {
                self.picks.push(Pick {
                    request,
                    variant,
                    candidate,
                    consumption,
                });
                let next = if self.candidates[candidate].shared() {
                    candidate
                } else {
                    candidate + 1
                };
                if self.pick(request, variant, remaining - 1, next)? {
                    return Ok(true);
                }
                self.picks.pop();
            }
        }
        Ok(false)
    }

    fn pick_all(&mut self, request: usize, variant: usize) -> Result<bool, Unallocatable> {
        let name = self.requests[request].variants[variant].result_name.clone();
        let mut all = Vec::new();
        for candidate in 0..self.candidates.len() {
            let c = &self.candidates[candidate];
            let pool_id = format!("{}/{}", c.driver, c.pool);
            if c.pool_incomplete {
                return Err(Unallocatable::new(format!(
                    "claim {}, request {name}: asks for all devices, but resource pool {pool_id} is currently being updated",
                    self.claim_ref
                )));
            }
            if let Some(why) = &c.pool_invalid {
                return Err(Unallocatable::new(format!(
                    "claim {}, request {name}: asks for all devices, but resource pool {pool_id} is currently invalid: {why}",
                    self.claim_ref
                )));
            }
            if self.selectable(request, variant, candidate)?.is_ok() {
                all.push(candidate);
            }
        }
        if all.is_empty() {
            return Ok(false);
        }
        let before = self.picks.len();
        for candidate in all {
            match self.try_candidate(request, variant, candidate)? {
                Ok(consumption) => self.picks.push(Pick {
                    request,
                    variant,
                    candidate,
                    consumption,
                }),
                Err(_) => {
                    self.picks.truncate(before);
                    return Ok(false);
                }
            }
        }
        if self.solve(request + 1)? {
            return Ok(true);
        }
        self.picks.truncate(before);
        Ok(false)
    }

    /// Whether the device passes the class's and the request's CEL selectors. A CEL error
    /// aborts the whole allocation, as upstream.
    fn selectable(
        &mut self,
        request: usize,
        variant: usize,
        candidate: usize,
    ) -> Result<Result<(), Rejection>, Unallocatable> {
        let key = (request, variant, candidate);
        if let Some(cached) = self.selectable.get(&key) {
            return Ok(cached.map_err(|by_class| {
                if by_class {
                    Rejection::Class
                } else {
                    Rejection::Selector
                }
            }));
        }
        let c = &self.candidates[candidate];
        let device_value = self
            .values
            .entry(candidate)
            .or_insert_with(|| self.cel.device_value(c.driver, c.device))
            .clone();
        let v = &self.requests[request].variants[variant];
        let class_name = v.class.metadata.name.as_deref().unwrap_or_default();
        let class_selectors = v.class.spec.selectors.as_deref().unwrap_or_default();
        let outcome = if !passes(&mut self.cel, class_selectors, &device_value, || {
            format!("class {class_name}")
        })? {
            Err(true)
        } else if !passes(&mut self.cel, v.selectors, &device_value, || {
            format!("claim {}", self.claim_ref)
        })? {
            Err(false)
        } else {
            Ok(())
        };
        self.selectable.insert(key, outcome);
        self.selectable(request, variant, candidate)
    }

    /// Every check for giving `candidate` to the request, cheapest first: in use, selectors,
    /// taints, capacity, constraints. Ok holds the capacity a shared device would consume.
    #[allow(clippy::type_complexity)]
    fn try_candidate(
        &mut self,
        request: usize,
        variant: usize,
        candidate: usize,
    ) -> Result<Result<Option<BTreeMap<String, Quantity>>, Rejection>, Unallocatable> {
        let c = &self.candidates[candidate];
        let key = c.key();
        let v = &self.requests[request].variants[variant];
        // Upstream allocates nothing from a pool it cannot see completely.
        if c.pool_invalid.is_some() || c.pool_incomplete {
            let state = match &c.pool_invalid {
                Some(why) => format!("invalid: {why}"),
                None => "being updated".to_string(),
            };
            return Ok(Err(Rejection::InvalidPool(format!(
                "resource pool {}/{} is currently {state}",
                c.driver, c.pool
            ))));
        }
        if !v.admin_access {
            // A shared device may serve several requests, even several slots of one request
            // (upstream: use distinctAttribute to spread them); capacity decides.
            let taken_by_claim = !c.shared() && self.picks.iter().any(|p| p.candidate == candidate);
            if self.in_use.exclusive.contains(&key) || taken_by_claim {
                return Ok(Err(Rejection::InUse(format!(
                    "{} is already allocated",
                    c.device.name
                ))));
            }
        }
        if let Err(rejection) = self.selectable(request, variant, candidate)? {
            return Ok(Err(rejection));
        }
        let c = &self.candidates[candidate];
        let v = &self.requests[request].variants[variant];
        if let Some(taint) = untolerated_taint(c.device.taints.as_deref(), v.tolerations) {
            return Ok(Err(Rejection::Taint(format!(
                "{} has the taint {}={}:{} that the request does not tolerate",
                c.device.name,
                taint.key,
                taint.value.as_deref().unwrap_or_default(),
                taint.effect
            ))));
        }
        let consumption = if v.admin_access {
            None
        } else if c.shared() {
            let consumption = match capacity::consumption(c.device, v.capacity) {
                Ok(consumption) => consumption,
                Err(e) => return Ok(Err(Rejection::Capacity(e))),
            };
            let mut used = self
                .in_use
                .shares
                .get(&key)
                .map(|(consumed, _)| consumed.clone())
                .unwrap_or_default();
            for pick in self.picks.iter().filter(|p| p.candidate == candidate) {
                if let Some(consumed) = &pick.consumption {
                    let _ = capacity::add(&mut used, consumed);
                }
            }
            if let Err(e) = capacity::check_fits(c.device, &consumption, &used) {
                return Ok(Err(Rejection::Capacity(e)));
            }
            Some(consumption)
        } else {
            if let Err(e) = capacity::check_exclusive(c.device, v.capacity) {
                return Ok(Err(Rejection::Capacity(e)));
            }
            None
        };
        if let Err(message) = self.check_counters(candidate) {
            return Ok(Err(Rejection::Counters(message)));
        }
        if let Err(message) = self.check_constraints(request, variant, candidate) {
            return Ok(Err(Rejection::Constraint(message)));
        }
        Ok(Ok(consumption))
    }

    /// The counters `candidate` takes still fit next to every other claim's devices and this
    /// claim's earlier picks. A shareable device already shared (by another claim or an earlier
    /// pick) was charged with its first share: later shares skip the check, as upstream does.
    fn check_counters(&self, candidate: usize) -> Result<(), String> {
        let c = &self.candidates[candidate];
        if !c.consumes_counters() {
            return Ok(());
        }
        let picked_before = self.picks.iter().any(|p| p.candidate == candidate);
        if c.shared() && (self.in_use.shares.contains_key(&c.key()) || picked_before) {
            return Ok(());
        }
        let mut used = self.in_use.counters.clone();
        let mut charged = HashSet::new();
        for pick in &self.picks {
            let p = &self.candidates[pick.candidate];
            let already = p.shared() && self.in_use.shares.contains_key(&p.key());
            if !already && charged.insert(pick.candidate) {
                counters::charge(&mut used, p.pool_index, p.device);
            }
        }
        counters::check(c.device, c.pool_index, &self.offered, &used)
    }

    fn check_constraints(
        &self,
        request: usize,
        variant: usize,
        candidate: usize,
    ) -> Result<(), String> {
        let applies = |constraint: &DeviceConstraint, request: usize, variant: usize| {
            let listed = constraint.requests.as_deref().unwrap_or_default();
            let r = &self.requests[request];
            listed.is_empty()
                || listed
                    .iter()
                    .any(|name| name == r.name || *name == r.variants[variant].result_name)
        };
        let c = &self.candidates[candidate];
        for constraint in self.constraints {
            if !applies(constraint, request, variant) {
                continue;
            }
            let (attribute, distinct) =
                match (&constraint.match_attribute, &constraint.distinct_attribute) {
                    (Some(name), _) => (name, false),
                    (None, Some(name)) => (name, true),
                    (None, None) => continue,
                };
            let Some(value) = lookup_attribute(c.driver, c.device, attribute) else {
                return Err(format!("{} has no attribute {attribute}", c.device.name));
            };
            for pick in &self.picks {
                if !applies(constraint, pick.request, pick.variant) {
                    continue;
                }
                let other = &self.candidates[pick.candidate];
                let other_value = lookup_attribute(other.driver, other.device, attribute);
                let same = other_value == Some(value);
                if distinct && same {
                    return Err(format!(
                        "{} and {} have the same {attribute} (distinctAttribute)",
                        other.device.name, c.device.name
                    ));
                }
                if !distinct && !same {
                    return Err(format!(
                        "{} and {} differ in {attribute} (matchAttribute)",
                        other.device.name, c.device.name
                    ));
                }
            }
        }
        Ok(())
    }

    /// After a failed search: the first request that cannot be met even on its own, with
    /// each device's reason, or else a note that the requests only fail together.
    fn diagnose(&mut self) -> Result<String, Unallocatable> {
        self.picks.clear();
        if self.candidates.is_empty() {
            return Ok(format!(
                "claim {}: no devices are published for node {}",
                self.claim_ref, self.node
            ));
        }
        for request in 0..self.requests.len() {
            let mut explanations = Vec::new();
            let mut satisfiable = false;
            for variant in 0..self.requests[request].variants.len() {
                let mut usable = 0;
                let mut rejections = Vec::new();
                for candidate in 0..self.candidates.len() {
                    // Selectors first here: a busy device of another model is reported as
                    // not matching, not as busy.
                    let outcome = match self.selectable(request, variant, candidate)? {
                        Err(rejection) => Err(rejection),
                        Ok(()) => self.try_candidate(request, variant, candidate)?.map(|_| ()),
                    };
                    match outcome {
                        Ok(()) => usable += 1,
                        Err(rejection) => rejections.push(rejection),
                    }
                }
                let v = &self.requests[request].variants[variant];
                let needed = match v.mode {
                    Mode::Count(n) => n,
                    Mode::All => 1,
                };
                let all_usable = v.mode != Mode::All
                    || rejections
                        .iter()
                        .all(|r| matches!(r, Rejection::Class | Rejection::Selector));
                if usable >= needed && all_usable {
                    satisfiable = true;
                    break;
                }
                let explanation = explain(v, usable, needed, &rejections);
                explanations.push(match v.subrequest {
                    Some(sub) => format!("subrequest {sub}: {explanation}"),
                    None => explanation,
                });
            }
            if !satisfiable {
                return Ok(format!(
                    "claim {}, request {}: {}",
                    self.claim_ref,
                    self.requests[request].name,
                    explanations.join("; ")
                ));
            }
        }
        Ok(format!("claim {}: {TOGETHER}", self.claim_ref))
    }

    fn result(&self, claim: &ResourceClaim) -> AllocationResult {
        let mut given: HashMap<DeviceKey, HashSet<String>> = HashMap::new();
        let mut results = Vec::new();
        for pick in &self.picks {
            let c = &self.candidates[pick.candidate];
            let v = &self.requests[pick.request].variants[pick.variant];
            let share_id = pick.consumption.as_ref().map(|_| {
                let key = c.key();
                let taken = self.in_use.shares.get(&key).map(|(_, ids)| ids);
                let mine = given.entry(key).or_default();
                let id = loop {
                    let id = new_share_id();
                    if !mine.contains(&id) && !taken.is_some_and(|t| t.contains(&id)) {
                        break id;
                    }
                };
                mine.insert(id.clone());
                id
            });
            results.push(DeviceRequestAllocationResult {
                request: v.result_name.clone(),
                driver: c.driver.to_string(),
                pool: c.pool.to_string(),
                device: c.device.name.clone(),
                admin_access: v.admin_access.then_some(true),
                tolerations: v.tolerations.cloned(),
                consumed_capacity: pick.consumption.clone(),
                share_id,
                ..Default::default()
            });
        }
        AllocationResult {
            devices: Some(DeviceAllocationResult {
                results: Some(results),
                config: Some(self.config(claim)).filter(|c| !c.is_empty()),
            }),
            node_selector: self.node_selector(),
            allocation_timestamp: None,
        }
    }

    /// The class's config for each request that used the class, then the claim's config
    /// entries that name a chosen request (or subrequest) or no request at all.
    fn config(&self, claim: &ResourceClaim) -> Vec<DeviceAllocationConfiguration> {
        let mut config = Vec::new();
        for (request, r) in self.requests.iter().enumerate() {
            let v = &r.variants[self.chosen[request]];
            for entry in v.class.spec.config.iter().flatten() {
                config.push(DeviceAllocationConfiguration {
                    source: "FromClass".to_string(),
                    requests: Some(vec![v.result_name.clone()]),
                    opaque: entry.opaque.clone(),
                });
            }
        }
        let claim_config = claim
            .spec
            .devices
            .as_ref()
            .and_then(|d| d.config.as_deref())
            .unwrap_or_default();
        for entry in claim_config {
            let listed = entry.requests.as_deref().unwrap_or_default();
            let chosen = listed.is_empty()
                || self.requests.iter().enumerate().any(|(request, r)| {
                    listed.iter().any(|name| {
                        name == r.name || *name == r.variants[self.chosen[request]].result_name
                    })
                });
            if chosen {
                config.push(DeviceAllocationConfiguration {
                    source: "FromClaim".to_string(),
                    requests: entry.requests.clone(),
                    opaque: entry.opaque.clone(),
                });
            }
        }
        config
    }

    /// A node-local device pins the claim to that node; selector-bound devices add their
    /// requirements; devices on all nodes add nothing.
    fn node_selector(&self) -> Option<NodeSelector> {
        let mut term = NodeSelectorTerm::default();
        let add = |into: &mut Option<Vec<NodeSelectorRequirement>>,
                   from: &Option<Vec<NodeSelectorRequirement>>| {
            for requirement in from.iter().flatten() {
                let list = into.get_or_insert_with(Vec::new);
                if !list.contains(requirement) {
                    list.push(requirement.clone());
                }
            }
        };
        for pick in &self.picks {
            let c = &self.candidates[pick.candidate];
            match placement(c.slice, c.device) {
                Placement::Node(name) => {
                    return Some(NodeSelector {
                        node_selector_terms: vec![NodeSelectorTerm {
                            match_fields: Some(vec![NodeSelectorRequirement {
                                key: "metadata.name".to_string(),
                                operator: "In".to_string(),
                                values: Some(vec![name.to_string()]),
                            }]),
                            match_expressions: None,
                        }],
                    })
                }
                Placement::Selector(selector) => {
                    if let Some(first) = selector.node_selector_terms.first() {
                        add(&mut term.match_fields, &first.match_fields);
                        add(&mut term.match_expressions, &first.match_expressions);
                    }
                }
                Placement::AllNodes | Placement::Nowhere => {}
            }
        }
        (term.match_fields.is_some() || term.match_expressions.is_some()).then(|| NodeSelector {
            node_selector_terms: vec![term],
        })
    }
}

/// Whether `device` passes each of `selectors`, stopping at the first it fails. A CEL error
/// aborts the whole allocation, naming the selector and its `owner` (class or claim).
fn passes(
    cel: &mut CelEvaluator,
    selectors: &[DeviceSelector],
    device: &Value,
    owner: impl FnOnce() -> String,
) -> Result<bool, Unallocatable> {
    for (i, selector) in selectors.iter().enumerate() {
        let Some(expression) = &selector.cel else {
            continue;
        };
        match cel.matches(&expression.expression, device) {
            Ok(true) => {}
            Ok(false) => return Ok(false),
            Err(e) => {
                return Err(Unallocatable::new(format!(
                    "{}: selector #{i}: {e}",
                    owner()
                )))
            }
        }
    }
    Ok(true)
}

fn explain(v: &Variant<'_>, usable: usize, needed: usize, rejections: &[Rejection]) -> String {
    let class = v.class.metadata.name.as_deref().unwrap_or_default();
    let specific: Vec<String> = rejections
        .iter()
        .filter_map(|r| match r {
            Rejection::Class | Rejection::Selector => None,
            Rejection::Taint(m)
            | Rejection::InUse(m)
            | Rejection::Constraint(m)
            | Rejection::Counters(m)
            | Rejection::InvalidPool(m) => Some(m.clone()),
            Rejection::Capacity(e) => Some(e.to_string()),
        })
        .collect();
    let matched_class = rejections
        .iter()
        .filter(|r| !matches!(r, Rejection::Class))
        .count()
        + usable;
    if matched_class == 0 {
        return format!("no device matches class {class}");
    }
    if specific.is_empty() && usable == 0 {
        return format!("no device of class {class} matches the request's selectors");
    }
    let mut message = String::new();
    if usable > 0 || v.mode == Mode::All {
        message = match v.mode {
            Mode::All => "asks for all devices, but not all are available: ".to_string(),
            Mode::Count(_) => format!("needs {needed} devices, only {usable} available: "),
        };
    }
    message.push_str(&specific.join("; "));
    message.trim_end_matches(": ").to_string()
}

/// The first NoSchedule/NoExecute taint no toleration of the request matches.
fn untolerated_taint<'t>(
    taints: Option<&'t [DeviceTaint]>,
    tolerations: Option<&Vec<DeviceToleration>>,
) -> Option<&'t DeviceTaint> {
    taints.into_iter().flatten().find(|taint| {
        matches!(taint.effect.as_str(), "NoSchedule" | "NoExecute")
            && !tolerations.into_iter().flatten().any(|t| {
                let key_matches = match t.key.as_deref() {
                    None | Some("") => t.operator.as_deref() == Some("Exists"),
                    Some(key) => key == taint.key,
                };
                let value_matches = t.operator.as_deref() == Some("Exists")
                    || t.value.as_deref().unwrap_or_default()
                        == taint.value.as_deref().unwrap_or_default();
                let effect_matches = t
                    .effect
                    .as_deref()
                    .is_none_or(|e| e.is_empty() || e == taint.effect);
                key_matches && value_matches && effect_matches
            })
    })
}

/// A fully qualified attribute of a device; bare names are in the driver's domain.
fn lookup_attribute<'d>(
    driver: &str,
    device: &'d k8s_openapi::api::resource::v1::Device,
    name: &str,
) -> Option<&'d DeviceAttribute> {
    let attributes = device.attributes.as_ref()?;
    if let Some(value) = attributes.get(name) {
        return Some(value);
    }
    let (domain, id) = name.split_once('/')?;
    (domain == driver).then(|| attributes.get(id)).flatten()
}

/// A share id as kube-scheduler writes it: a fresh lowercase UUID (the API validates the field with
/// `k8s:format=k8s-uuid`).
fn new_share_id() -> String {
    uuid::Uuid::new_v4().to_string()
}

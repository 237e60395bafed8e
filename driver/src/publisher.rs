//! Keeps this node's ResourceSlices in the API equal to what [`crate::slices`] builds.
//!
//! Only slices of this node and driver are read, written or deleted. Every change of content gets a
//! new pool generation (one above the highest stored), written as one request per slice, new and
//! changed slices first, stale ones last, so the scheduler never sees a generation with missing slices.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use gpupool_api::inventory::Inventory;
use gpupool_api::names::DRIVER_NAME;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::ResourceSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client, ResourceExt};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::devices::Partitioning;
use crate::health::HealthMap;
use crate::slices::{build_slices, SliceError, SliceMode};

/// How often slices are compared with the API even when nothing local changed, so that a slice
/// deleted by someone else comes back.
pub const RESYNC_INTERVAL: Duration = Duration::from_secs(60);
const MIN_BACKOFF: Duration = Duration::from_millis(200);
const MAX_BACKOFF: Duration = Duration::from_secs(30);
const MAX_CONFLICT_RETRIES: usize = 5;

#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error(transparent)]
    Invalid(#[from] SliceError),
    #[error("listing ResourceSlices of node {node}: {source}")]
    List {
        node: String,
        #[source]
        source: kube::Error,
    },
    #[error("{verb} ResourceSlice {name}: {source}")]
    Write {
        verb: &'static str,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error(
        "ResourceSlices of node {node} kept changing while being written ({attempts} attempts)"
    )]
    Conflict { node: String, attempts: usize },
}

/// What one reconciliation did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Unchanged { generation: i64 },
    Published { generation: i64, slices: usize },
}

/// The writes that bring the stored slices to the desired state.
#[derive(Debug, Default)]
pub struct Plan {
    pub generation: i64,
    pub create: Vec<ResourceSlice>,
    /// Desired slices carrying the stored `resourceVersion` (optimistic concurrency).
    pub update: Vec<ResourceSlice>,
    pub delete: Vec<String>,
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.create.is_empty() && self.update.is_empty() && self.delete.is_empty()
    }
}

fn spec_json(slice: &ResourceSlice) -> serde_json::Value {
    serde_json::to_value(&slice.spec).unwrap_or_default()
}

/// Compares the stored slices of this node with the desired ones (pure). Unchanged content keeps
/// its generation; any change is planned at the highest stored generation + 1.
pub fn plan(
    stored: &[ResourceSlice],
    inventory: &Inventory,
    node_name: &str,
    weights: &BTreeMap<String, i64>,
    health: &HealthMap,
    mode: SliceMode,
    partitioning: Partitioning,
) -> Result<Plan, SliceError> {
    let mine: Vec<&ResourceSlice> = stored
        .iter()
        .filter(|s| s.spec.driver == DRIVER_NAME && s.spec.node_name.as_deref() == Some(node_name))
        .collect();
    let current = mine
        .iter()
        .map(|s| s.spec.pool.generation)
        .max()
        .unwrap_or(0);
    let by_name: BTreeMap<String, &ResourceSlice> =
        mine.iter().map(|s| (s.name_any(), *s)).collect();

    let same = build_slices(
        inventory,
        node_name,
        weights,
        health,
        current,
        mode,
        partitioning,
    )?;
    let up_to_date = same.len() == by_name.len()
        && same.iter().all(|want| {
            by_name
                .get(&want.name_any())
                .is_some_and(|have| spec_json(have) == spec_json(want))
        });
    if up_to_date {
        return Ok(Plan {
            generation: current,
            ..Default::default()
        });
    }

    let generation = current + 1;
    let desired = build_slices(
        inventory,
        node_name,
        weights,
        health,
        generation,
        mode,
        partitioning,
    )?;
    let mut plan = Plan {
        generation,
        ..Default::default()
    };
    for mut want in desired {
        match by_name.get(&want.name_any()) {
            Some(have) => {
                want.metadata.resource_version = have.metadata.resource_version.clone();
                plan.update.push(want);
            }
            None => plan.create.push(want),
        }
    }
    let wanted: Vec<String> = plan
        .create
        .iter()
        .chain(&plan.update)
        .map(|s| s.name_any())
        .collect();
    plan.delete = by_name
        .keys()
        .filter(|name| !wanted.contains(name))
        .cloned()
        .collect();
    Ok(plan)
}

/// Why the cluster does not take shareable devices, when it says so: a 422 naming a
/// consumable-capacity field, or a stored object that lost `allowMultipleAllocations`.
pub fn fallback_reason_from_error(err: &kube::Error) -> Option<String> {
    match err {
        kube::Error::Api(status) if status.code == 422 => {
            let msg = &status.message;
            ["allowMultipleAllocations", "requestPolicy", "consumable"]
                .iter()
                .any(|field| msg.contains(field))
                .then(|| format!("the API server rejected the consumable-capacity fields: {msg}"))
        }
        _ => None,
    }
}

pub fn fallback_reason_from_stored(sent: &ResourceSlice, stored: &ResourceSlice) -> Option<String> {
    let shared = |s: &ResourceSlice| {
        s.spec
            .devices
            .iter()
            .flatten()
            .any(|d| d.allow_multiple_allocations == Some(true))
    };
    (shared(sent) && !shared(stored)).then(|| {
        format!(
            "the API server dropped allowMultipleAllocations from ResourceSlice {} \
             (feature DRAConsumableCapacity is off)",
            sent.name_any()
        )
    })
}

/// Why the cluster does not take partitionable devices, when it says so: a 422 naming a counter
/// field, or a stored object that lost the counter sets or consumptions it was sent with (the
/// real API server drops fields of a disabled feature, DRAPartitionableDevices, without a word).
pub fn partitioning_fallback_from_error(err: &kube::Error) -> Option<String> {
    match err {
        kube::Error::Api(status) if status.code == 422 => {
            let msg = &status.message;
            ["sharedCounters", "consumesCounters"]
                .iter()
                .any(|field| msg.contains(field))
                .then(|| format!("the API server rejected the counter fields: {msg}"))
        }
        _ => None,
    }
}

pub fn partitioning_fallback_from_stored(
    sent: &ResourceSlice,
    stored: &ResourceSlice,
) -> Option<String> {
    let counters = |s: &ResourceSlice| {
        s.spec
            .shared_counters
            .as_ref()
            .is_some_and(|c| !c.is_empty())
            || s.spec
                .devices
                .iter()
                .flatten()
                .any(|d| d.consumes_counters.as_ref().is_some_and(|c| !c.is_empty()))
    };
    (counters(sent) && !counters(stored)).then(|| {
        format!(
            "the API server dropped sharedCounters/consumesCounters from ResourceSlice {} \
             (feature DRAPartitionableDevices is off)",
            sent.name_any()
        )
    })
}

fn is_conflict(err: &kube::Error) -> bool {
    matches!(err, kube::Error::Api(s) if s.code == 409)
}

enum Applied {
    Done,
    Conflict,
    /// No consumable capacity: exclusive whole cards.
    FallBack(String),
    /// No partitionable devices: no MIG devices, no counter sets.
    WholeCardsOnly(String),
}

/// Publishes one node's slices.
pub struct SlicePublisher {
    api: Api<ResourceSlice>,
    client: Client,
    node_name: String,
    mode: SliceMode,
    partitioning: Partitioning,
}

impl SlicePublisher {
    pub fn new(client: Client, node_name: impl Into<String>) -> Self {
        Self {
            api: Api::all(client.clone()),
            client,
            node_name: node_name.into(),
            mode: SliceMode::Shared,
            partitioning: Partitioning::Counters,
        }
    }

    pub fn mode(&self) -> SliceMode {
        self.mode
    }

    pub fn partitioning(&self) -> Partitioning {
        self.partitioning
    }

    async fn list(&self) -> Result<Vec<ResourceSlice>, PublishError> {
        let fields = format!("spec.nodeName={},spec.driver={DRIVER_NAME}", self.node_name);
        self.api
            .list(&ListParams::default().fields(&fields))
            .await
            .map(|l| l.items)
            .map_err(|source| PublishError::List {
                node: self.node_name.clone(),
                source,
            })
    }

    /// The node as owner, so the cluster collects the slices when the node goes away; none when the
    /// node cannot be read (then the slices simply have no owner).
    async fn owner(&self) -> Option<OwnerReference> {
        let node = Api::<Node>::all(self.client.clone())
            .get_opt(&self.node_name)
            .await
            .ok()??;
        Some(OwnerReference {
            api_version: "v1".into(),
            kind: "Node".into(),
            name: node.name_any(),
            uid: node.metadata.uid?,
            controller: Some(true),
            block_owner_deletion: None,
        })
    }

    async fn apply(&self, plan: Plan) -> Result<Applied, PublishError> {
        let owner = self.owner().await;
        let pp = PostParams::default();
        for (verb, mut slice) in plan
            .create
            .into_iter()
            .map(|s| ("creating", s))
            .chain(plan.update.into_iter().map(|s| ("updating", s)))
        {
            let name = slice.name_any();
            if let Some(owner) = &owner {
                slice.metadata.owner_references = Some(vec![owner.clone()]);
            }
            let result = if verb == "creating" {
                self.api.create(&pp, &slice).await
            } else {
                self.api.replace(&name, &pp, &slice).await
            };
            // Counter slices come first (see `slices::split`): a server that drops counters is
            // noticed before any MIG device is written without the counters that keep it apart
            // from its card.
            match result {
                Ok(stored) => {
                    if let Some(reason) = partitioning_fallback_from_stored(&slice, &stored) {
                        return Ok(Applied::WholeCardsOnly(reason));
                    }
                    if let Some(reason) = fallback_reason_from_stored(&slice, &stored) {
                        return Ok(Applied::FallBack(reason));
                    }
                }
                Err(e) if is_conflict(&e) => return Ok(Applied::Conflict),
                Err(e) => {
                    if self.partitioning == Partitioning::Counters {
                        if let Some(reason) = partitioning_fallback_from_error(&e) {
                            return Ok(Applied::WholeCardsOnly(reason));
                        }
                    }
                    if self.mode == SliceMode::Shared {
                        if let Some(reason) = fallback_reason_from_error(&e) {
                            return Ok(Applied::FallBack(reason));
                        }
                    }
                    return Err(PublishError::Write {
                        verb,
                        name,
                        source: e,
                    });
                }
            }
        }
        for name in plan.delete {
            match self.api.delete(&name, &DeleteParams::default()).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(source) => {
                    return Err(PublishError::Write {
                        verb: "deleting",
                        name,
                        source,
                    })
                }
            }
        }
        Ok(Applied::Done)
    }

    /// One pass: read the stored slices and write what differs (retrying conflicts on fresh state).
    pub async fn reconcile(
        &mut self,
        inventory: &Inventory,
        weights: &BTreeMap<String, i64>,
        health: &HealthMap,
    ) -> Result<Outcome, PublishError> {
        for _ in 0..MAX_CONFLICT_RETRIES {
            let stored = self.list().await?;
            let plan = plan(
                &stored,
                inventory,
                &self.node_name,
                weights,
                health,
                self.mode,
                self.partitioning,
            )?;
            if plan.is_empty() {
                return Ok(Outcome::Unchanged {
                    generation: plan.generation,
                });
            }
            let generation = plan.generation;
            let slices = plan.create.len() + plan.update.len();
            match self.apply(plan).await? {
                Applied::Done => return Ok(Outcome::Published { generation, slices }),
                Applied::Conflict => {
                    tracing::debug!(node = %self.node_name, "ResourceSlice conflict; retrying on fresh state");
                }
                Applied::FallBack(reason) => {
                    tracing::warn!(
                        node = %self.node_name,
                        %reason,
                        "falling back to exclusive whole-GPU devices (no fractional sharing on this cluster)"
                    );
                    self.mode = SliceMode::ExclusiveFallback;
                }
                Applied::WholeCardsOnly(reason) => {
                    // Cards in MIG mode that need a reset to leave it cannot run whole.
                    let left_out: Vec<String> = inventory
                        .gpus
                        .iter()
                        .filter(|g| {
                            crate::devices::devices_of(g, Partitioning::WholeCardsOnly).is_empty()
                        })
                        .map(|g| gpupool_api::names::device_name(g.index))
                        .collect();
                    tracing::warn!(
                        node = %self.node_name,
                        %reason,
                        not_offered = ?left_out,
                        "publishing whole cards and fractions only: no MIG devices without partitionable devices (Kubernetes >= 1.35 with DRAPartitionableDevices)"
                    );
                    self.partitioning = Partitioning::WholeCardsOnly;
                }
            }
        }
        Err(PublishError::Conflict {
            node: self.node_name.clone(),
            attempts: MAX_CONFLICT_RETRIES,
        })
    }

    /// Publishes until `stop`: at start, whenever the weights or the devices' health change, and
    /// every [`RESYNC_INTERVAL`]; failures are retried with capped exponential backoff. `published`
    /// turns true after the first successful pass.
    pub async fn run(
        mut self,
        inventory: Arc<Inventory>,
        mut weights: watch::Receiver<BTreeMap<String, i64>>,
        mut health: watch::Receiver<HealthMap>,
        published: watch::Sender<bool>,
        stop: CancellationToken,
    ) {
        let mut backoff = MIN_BACKOFF;
        let (mut weights_open, mut health_open) = (true, true);
        loop {
            let current = weights.borrow_and_update().clone();
            let current_health = health.borrow_and_update().clone();
            let wait = match self.reconcile(&inventory, &current, &current_health).await {
                Ok(outcome) => {
                    backoff = MIN_BACKOFF;
                    match outcome {
                        Outcome::Published { generation, slices } => tracing::info!(
                            node = %self.node_name,
                            generation,
                            slices,
                            gpus = inventory.gpus.len(),
                            partitioning = ?self.partitioning,
                            tainted = current_health.iter().filter(|(_, r)| !r.faults.is_empty()).count(),
                            mode = ?self.mode,
                            "published ResourceSlices"
                        ),
                        Outcome::Unchanged { generation } => tracing::debug!(
                            node = %self.node_name, generation, "ResourceSlices up to date"
                        ),
                    }
                    published.send_replace(true);
                    RESYNC_INTERVAL
                }
                Err(err) => {
                    tracing::warn!(node = %self.node_name, error = %err, retry_in = ?backoff, "publishing ResourceSlices failed");
                    let wait = backoff;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                    wait
                }
            };
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
                changed = weights.changed(), if weights_open => {
                    if changed.is_err() {
                        weights_open = false;
                    }
                }
                changed = health.changed(), if health_open => {
                    if changed.is_err() {
                        health_open = false;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::fake::fake_inventory;

    fn stored(slices: Vec<ResourceSlice>) -> Vec<ResourceSlice> {
        slices
            .into_iter()
            .enumerate()
            .map(|(i, mut s)| {
                s.metadata.resource_version = Some(format!("{}", 100 + i));
                s
            })
            .collect()
    }

    /// The plan for node n1 with every device healthy, fractions on.
    fn healthy_plan(
        have: &[ResourceSlice],
        inv: &Inventory,
        weights: &BTreeMap<String, i64>,
    ) -> Plan {
        plan(
            have,
            inv,
            "n1",
            weights,
            &HealthMap::default(),
            SliceMode::Shared,
            Partitioning::Counters,
        )
        .unwrap()
    }

    #[test]
    fn first_publish_creates_at_generation_one() {
        let inv = fake_inventory("a100-40gb:2", "n1").unwrap();
        let p = plan(
            &[],
            &inv,
            "n1",
            &BTreeMap::new(),
            &HealthMap::default(),
            SliceMode::Shared,
            Partitioning::Counters,
        )
        .unwrap();
        assert_eq!(p.generation, 1);
        assert_eq!(p.create.len(), 1);
        assert!(p.update.is_empty() && p.delete.is_empty());
        assert_eq!(p.create[0].spec.pool.generation, 1);
    }

    #[test]
    fn unchanged_content_writes_nothing() {
        let inv = fake_inventory("a100-40gb:2", "n1").unwrap();
        let w = BTreeMap::new();
        let have = stored(
            build_slices(
                &inv,
                "n1",
                &w,
                &HealthMap::default(),
                4,
                SliceMode::Shared,
                Partitioning::Counters,
            )
            .unwrap(),
        );
        let p = healthy_plan(&have, &inv, &w);
        assert!(p.is_empty());
        assert_eq!(p.generation, 4);
    }

    #[test]
    fn two_instances_of_one_node_agree_on_what_the_other_published() {
        // A rolling update runs the old and the new driver pod side by side: each finds the
        // slices the other wrote (owner set, stored by the API) and writes nothing, so the pool's
        // generation stays where it is.
        let inv = fake_inventory("a100-40gb:2,v100-32gb:1", "n1").unwrap();
        let w = BTreeMap::from([("A100-SXM4-40GB".to_string(), 312)]);
        let first = healthy_plan(&[], &inv, &w);
        let mut have = stored(first.create);
        for slice in &mut have {
            slice.metadata.owner_references = Some(vec![OwnerReference {
                api_version: "v1".into(),
                kind: "Node".into(),
                name: "n1".into(),
                uid: "node-uid".into(),
                controller: Some(true),
                block_owner_deletion: None,
            }]);
            slice.metadata.uid = Some("slice-uid".into());
        }
        let second = healthy_plan(&have, &inv, &w);
        assert!(second.is_empty(), "{second:?}");
        assert_eq!(second.generation, 1);
    }

    #[test]
    fn a_changed_weight_updates_with_the_next_generation() {
        let inv = fake_inventory("a100-40gb:2", "n1").unwrap();
        let have = stored(
            build_slices(
                &inv,
                "n1",
                &BTreeMap::new(),
                &HealthMap::default(),
                4,
                SliceMode::Shared,
                Partitioning::Counters,
            )
            .unwrap(),
        );
        let w = BTreeMap::from([("A100-SXM4-40GB".to_string(), 312)]);
        let p = healthy_plan(&have, &inv, &w);
        assert_eq!(p.generation, 5);
        assert_eq!(p.update.len(), 1);
        assert_eq!(
            p.update[0].metadata.resource_version.as_deref(),
            Some("100")
        );
        assert_eq!(p.update[0].spec.pool.generation, 5);
        let d = &p.update[0].spec.devices.as_ref().unwrap()[0];
        assert_eq!(
            d.attributes.as_ref().unwrap()["computeWeight"].int,
            Some(312)
        );
    }

    #[test]
    fn a_taint_and_its_clearing_each_publish_a_new_generation() {
        use crate::health::{Observation, XidPolicy};
        let inv = fake_inventory("a100-40gb:2", "n1").unwrap();
        let w = BTreeMap::new();
        let mut health = HealthMap::new(["gpu-0".to_string(), "gpu-1".to_string()]);
        let have = stored(
            build_slices(
                &inv,
                "n1",
                &w,
                &health,
                4,
                SliceMode::Shared,
                Partitioning::Counters,
            )
            .unwrap(),
        );
        let policy = XidPolicy::default();
        let xid = Observation::Xid {
            device: "gpu-0".into(),
            xid: 79,
        };
        health.apply(xid, &policy, 1_700_000_000).unwrap();
        let p = plan(
            &have,
            &inv,
            "n1",
            &w,
            &health,
            SliceMode::Shared,
            Partitioning::Counters,
        )
        .unwrap();
        assert_eq!(p.generation, 5);
        let devices = p.update[0].spec.devices.clone().unwrap();
        assert_eq!(devices[0].taints.as_ref().map(Vec::len), Some(1));
        assert_eq!(devices[1].taints, None);

        // As the API stores and returns it, the tainted slice is up to date: no write per resync.
        let returned: Vec<ResourceSlice> = p
            .update
            .iter()
            .map(|s| serde_json::from_value(serde_json::to_value(s).unwrap()).unwrap())
            .collect();
        let tainted = stored(returned);
        assert!(plan(
            &tainted,
            &inv,
            "n1",
            &w,
            &health,
            SliceMode::Shared,
            Partitioning::Counters
        )
        .unwrap()
        .is_empty());

        let clear = Observation::Clear {
            device: "gpu-0".into(),
        };
        health.apply(clear, &policy, 1_700_000_100).unwrap();
        let p = plan(
            &tainted,
            &inv,
            "n1",
            &w,
            &health,
            SliceMode::Shared,
            Partitioning::Counters,
        )
        .unwrap();
        assert_eq!(p.generation, 6);
        assert!(p.update[0]
            .spec
            .devices
            .iter()
            .flatten()
            .all(|d| d.taints.is_none()));
    }

    #[test]
    fn shrinking_deletes_stale_slices_and_ignores_other_nodes() {
        let big = fake_inventory("t4:130", "n1").unwrap();
        let w = BTreeMap::new();
        let mut have = stored(
            build_slices(
                &big,
                "n1",
                &w,
                &HealthMap::default(),
                2,
                SliceMode::Shared,
                Partitioning::Counters,
            )
            .unwrap(),
        );
        let other_inv = fake_inventory("t4:1", "n2").unwrap();
        have.extend(
            build_slices(
                &other_inv,
                "n2",
                &w,
                &HealthMap::default(),
                9,
                SliceMode::Shared,
                Partitioning::Counters,
            )
            .unwrap(),
        );
        let small = fake_inventory("t4:3", "n1").unwrap();
        let p = plan(
            &have,
            &small,
            "n1",
            &w,
            &HealthMap::default(),
            SliceMode::Shared,
            Partitioning::Counters,
        )
        .unwrap();
        assert_eq!(
            p.generation, 3,
            "generation of this node's pool, not the other's 9"
        );
        assert_eq!(p.update.len(), 1);
        assert_eq!(p.update[0].spec.pool.resource_slice_count, 1);
        assert_eq!(p.delete, vec!["n1-gpupool.dev-1".to_string()]);
        assert!(p.create.is_empty());
    }

    #[test]
    fn stored_object_without_sharing_means_fallback() {
        let inv = fake_inventory("a100-40gb:1", "n1").unwrap();
        let w = BTreeMap::new();
        let sent = build_slices(
            &inv,
            "n1",
            &w,
            &HealthMap::default(),
            1,
            SliceMode::Shared,
            Partitioning::Counters,
        )
        .unwrap()
        .remove(0);
        let mut dropped = sent.clone();
        for d in dropped.spec.devices.iter_mut().flatten() {
            d.allow_multiple_allocations = None;
        }
        assert!(fallback_reason_from_stored(&sent, &dropped)
            .unwrap()
            .contains("allowMultipleAllocations"));
        assert_eq!(fallback_reason_from_stored(&sent, &sent), None);
        let exclusive = build_slices(
            &inv,
            "n1",
            &w,
            &HealthMap::default(),
            1,
            SliceMode::ExclusiveFallback,
            Partitioning::Counters,
        )
        .unwrap()
        .remove(0);
        assert_eq!(fallback_reason_from_stored(&exclusive, &exclusive), None);
    }

    #[test]
    fn unprocessable_naming_the_fields_means_fallback() {
        let status = |code, message: &str| {
            kube::Error::Api(Box::new(kube::core::Status {
                code,
                message: message.into(),
                ..kube::core::Status::failure(message, "Invalid")
            }))
        };
        let e = status(422, "ResourceSlice.resource.k8s.io \"n\" is invalid: spec.devices[0].allowMultipleAllocations: Forbidden");
        assert!(fallback_reason_from_error(&e).is_some());
        assert!(
            fallback_reason_from_error(&status(422, "spec.pool.name: Required value")).is_none()
        );
        assert!(fallback_reason_from_error(&status(500, "allowMultipleAllocations")).is_none());
    }

    #[test]
    fn a_stored_slice_without_its_counters_means_whole_cards_only() {
        let inv = fake_inventory("h100-80gb:1", "n1").unwrap();
        let sent = build_slices(
            &inv,
            "n1",
            &BTreeMap::new(),
            &HealthMap::default(),
            1,
            SliceMode::Shared,
            Partitioning::Counters,
        )
        .unwrap();
        // The counter slice comes first and is what a server without the feature empties.
        let counters = &sent[0];
        assert!(counters.spec.shared_counters.is_some());
        let mut dropped = counters.clone();
        dropped.spec.shared_counters = None;
        let reason = partitioning_fallback_from_stored(counters, &dropped).unwrap();
        assert!(reason.contains("DRAPartitionableDevices"), "{reason}");
        assert_eq!(partitioning_fallback_from_stored(counters, counters), None);
        let mut devices = sent[1].clone();
        let kept = devices.clone();
        for d in devices.spec.devices.iter_mut().flatten() {
            d.consumes_counters = None;
        }
        assert!(partitioning_fallback_from_stored(&kept, &devices).is_some());
        let whole = build_slices(
            &inv,
            "n1",
            &BTreeMap::new(),
            &HealthMap::default(),
            1,
            SliceMode::Shared,
            Partitioning::WholeCardsOnly,
        )
        .unwrap();
        assert_eq!(
            partitioning_fallback_from_stored(&whole[0], &whole[0]),
            None
        );
    }

    #[test]
    fn unprocessable_naming_counters_means_whole_cards_only() {
        let e = kube::Error::Api(Box::new(kube::core::Status {
            code: 422,
            message: "ResourceSlice \"n\" is invalid: spec.sharedCounters: Forbidden".into(),
            ..kube::core::Status::failure("x", "Invalid")
        }));
        assert!(partitioning_fallback_from_error(&e).is_some());
        assert!(fallback_reason_from_error(&e).is_none());
    }
}

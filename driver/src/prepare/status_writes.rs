//! The claims' `status.devices` writes (what `kubectl describe resourceclaim` shows), queued off
//! the kubelet's critical path in time as well as in thread: a prepare's write waits
//! [`super::STATUS_WRITE_DELAY`] and is made only if the claim is still prepared and no later
//! prepare of it queued a write of its own (coalesced), so a short-lived pod costs no write and
//! the driver's own writes do not slow the reads of the prepares that follow. The content is
//! `status.rs`'s; this is when and how it is written.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use gpupool_api::claim::ClaimRef;
use k8s_openapi::api::resource::v1::{AllocatedDeviceStatus, ResourceClaim};
use k8s_openapi::jiff::Timestamp;

use super::api::{ApiError, ClaimApi, ClaimRead};
use super::claim::{self, AllocationId};
use super::{status, SeenClaims, API_WRITE_TIMEOUT};
use crate::node_state::checkpoint::ClaimState;
use crate::node_state::NodeState;

/// The last write sent for a claim: its sequence number and task.
type QueueTail = (u64, tokio::task::JoinHandle<()>);

/// The claims' `status.devices` writes, off the kubelet's critical path: each claim's writes run
/// in spawned tasks chained one after the other, so a re-prepare's write never gets overtaken by
/// an earlier one of the same claim. Claims do not wait for each other.
#[derive(Clone)]
pub(super) struct StatusQueue {
    /// Per claim uid: the sequence number and handle of the last write sent.
    tails: Arc<Mutex<HashMap<String, QueueTail>>>,
    next_seq: Arc<std::sync::atomic::AtomicU64>,
    /// Writes of different claims in flight at once. kube's client speaks HTTP/1.1, so each one
    /// holds a connection of its own (~50 KiB): against a slow API server an unbounded queue
    /// turned a burst of prepares into hundreds of connections.
    in_flight: Arc<tokio::sync::Semaphore>,
    /// Prepare writes not yet due, kept as data (a task each, sleeping until due, held the
    /// whole future of the write, several times the write itself); at most one per claim.
    delayed: Arc<Mutex<Delayed>>,
}

/// Prepare writes waiting for their time, in the order they come due, and whether a task
/// releases them.
#[derive(Default)]
struct Delayed {
    queue: VecDeque<DelayedWrite>,
    releasing: bool,
}

struct DelayedWrite {
    due: tokio::time::Instant,
    write: StatusWrite,
}

const STATUS_WRITES_IN_FLIGHT: usize = 4;

impl Default for StatusQueue {
    fn default() -> Self {
        Self {
            tails: Arc::default(),
            next_seq: Arc::default(),
            in_flight: Arc::new(tokio::sync::Semaphore::new(STATUS_WRITES_IN_FLIGHT)),
            delayed: Arc::default(),
        }
    }
}

impl StatusQueue {
    /// `write` after the claim's earlier writes, a prepare write still waiting for its time
    /// included (it is sent now, so that this one comes after it).
    pub(super) fn push(
        &self,
        uid: &str,
        write: impl std::future::Future<Output = ()> + Send + 'static,
    ) {
        self.release_now(|w| w.write.claim.uid == uid);
        self.push_after(uid, None, write);
    }

    /// A prepare's write: made `delay` from now, in place of the claim's earlier prepare write if
    /// that one still waits (unless the claim is unprepared by then, which [`StatusWrite`] checks).
    pub(super) fn push_prepare_write(&self, delay: std::time::Duration, write: StatusWrite) {
        let due = tokio::time::Instant::now() + delay;
        let mut delayed = self.delayed.lock().expect("status queue is never poisoned");
        delayed
            .queue
            .retain(|w| w.write.claim.uid != write.claim.uid);
        // The delay is the same for every write of a driver: this is the end of the queue.
        let at = delayed.queue.partition_point(|w| w.due <= due);
        delayed.queue.insert(at, DelayedWrite { due, write });
        if !delayed.releasing {
            delayed.releasing = true;
            tokio::spawn(self.clone().release_when_due());
        }
    }

    /// Sends each delayed write when it is due, then ends when none is left.
    async fn release_when_due(self) {
        loop {
            let next = {
                let mut delayed = self.delayed.lock().expect("status queue is never poisoned");
                match delayed.queue.front() {
                    Some(first) => first.due,
                    None => {
                        delayed.releasing = false;
                        return;
                    }
                }
            };
            tokio::time::sleep_until(next).await;
            // One at a time, in a slot taken for it: a burst of writes coming due at once stays
            // data until a write can start, instead of becoming a task each.
            let slot = self.in_flight.clone().acquire_owned().await.ok();
            let first = {
                let mut delayed = self.delayed.lock().expect("status queue is never poisoned");
                let now = tokio::time::Instant::now();
                match delayed.queue.front() {
                    Some(first) if first.due <= now => delayed.queue.pop_front(),
                    _ => None,
                }
            };
            if let Some(DelayedWrite { write, .. }) = first {
                let uid = write.claim.uid.clone();
                self.push_after(&uid, slot, write.run());
            }
        }
    }

    /// Sends the delayed writes `which` picks now.
    fn release_now(&self, which: impl Fn(&DelayedWrite) -> bool) {
        let released: VecDeque<DelayedWrite> = {
            let mut delayed = self.delayed.lock().expect("status queue is never poisoned");
            if !delayed.queue.iter().any(&which) {
                return;
            }
            let (now, later): (VecDeque<_>, VecDeque<_>) = std::mem::take(&mut delayed.queue)
                .into_iter()
                .partition(&which);
            delayed.queue = later;
            now
        };
        for DelayedWrite { write, .. } in released {
            let uid = write.claim.uid.clone();
            self.push_after(&uid, None, write.run());
        }
    }

    /// `write`, after the claim's earlier writes, in `slot` or in the next free one.
    fn push_after(
        &self,
        uid: &str,
        slot: Option<tokio::sync::OwnedSemaphorePermit>,
        write: impl std::future::Future<Output = ()> + Send + 'static,
    ) {
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        let tails = self.tails.clone();
        let owned_uid = uid.to_string();
        let mut map = self.tails.lock().expect("status queue is never poisoned");
        let previous = map.remove(uid).map(|(_, handle)| handle);
        let in_flight = self.in_flight.clone();
        let handle = tokio::spawn(async move {
            let slot = match previous {
                Some(previous) => {
                    // Never hold a slot while waiting for the claim's earlier write: that one
                    // may itself be waiting for a slot.
                    drop(slot);
                    let _ = previous.await;
                    None
                }
                None => slot,
            };
            let permit = match slot {
                Some(slot) => Ok(slot),
                None => in_flight.acquire_owned().await,
            };
            write.await;
            drop(permit);
            let mut map = tails.lock().expect("status queue is never poisoned");
            if map.get(&owned_uid).is_some_and(|(s, _)| *s == seq) {
                map.remove(&owned_uid);
            }
        });
        map.insert(uid.to_string(), (seq, handle));
    }

    /// Wait until every write queued so far has finished; those still waiting for their time
    /// are sent now (an orderly shutdown does not wait out the delay). A marker is chained
    /// behind each claim's last write, so the per-claim order holds for writes queued meanwhile.
    pub(super) async fn flush(&self) {
        self.release_now(|_| true);
        let uids: Vec<String> = self
            .tails
            .lock()
            .expect("status queue is never poisoned")
            .keys()
            .cloned()
            .collect();
        let mut done = Vec::with_capacity(uids.len());
        for uid in uids {
            let (tx, rx) = tokio::sync::oneshot::channel();
            self.push(&uid, async move {
                let _ = tx.send(());
            });
            done.push(rx);
        }
        for rx in done {
            let _ = rx.await;
        }
    }
}

/// `status.devices` of a claim as read.
fn device_status_of(claim: &ResourceClaim) -> Vec<AllocatedDeviceStatus> {
    claim
        .status
        .as_ref()
        .and_then(|s| s.devices.clone())
        .unwrap_or_default()
}

/// The Ready conditions of one claim's entries, from the devices' health; read with quorum, written
/// conditionally, read again once if someone wrote the claim in between.
pub(super) async fn write_device_health(
    api: &dyn ClaimApi,
    pool: &str,
    claim: &ClaimRef,
    unhealthy: &BTreeMap<String, String>,
) -> Result<(), ApiError> {
    for _ in 0..2 {
        let current = api
            .get_claim(&claim.namespace, &claim.name, ClaimRead::Quorum)
            .await?;
        if current.metadata.uid.as_deref() != Some(claim.uid.as_str()) {
            return Ok(());
        }
        let existing = device_status_of(&current);
        let Some(list) = status::with_device_health(&existing, pool, unhealthy, Timestamp::now())
        else {
            return Ok(());
        };
        match api
            .write_device_status(
                &claim.namespace,
                &claim.name,
                list,
                current.metadata.resource_version,
            )
            .await
        {
            Err(ApiError::Conflict) => continue,
            other => return other.map(|_| ()),
        }
    }
    Err(ApiError::Conflict)
}

/// The one `status.devices` write of a prepare, after the kubelet has its answer.
pub(super) struct StatusWrite {
    pub(super) api: Arc<dyn ClaimApi>,
    pub(super) state: Arc<NodeState>,
    /// Told the resourceVersion each write answers with.
    pub(super) seen: Arc<SeenClaims>,
    pub(super) claim: ClaimRef,
    pub(super) pool: String,
    pub(super) ours: Vec<AllocatedDeviceStatus>,
    /// The allocation the devices were prepared from.
    pub(super) prepared_from: AllocationId,
    /// `status.devices` of the copy prepared from (other drivers' entries are kept).
    pub(super) existing: Vec<AllocatedDeviceStatus>,
    /// That copy's resourceVersion: the write is conditional on it.
    pub(super) based_on: Option<String>,
}

impl StatusWrite {
    /// Best effort, within [`API_WRITE_TIMEOUT`]. Conditional on the copy prepared from being
    /// current, which also checks a copy taken from the watch cache: a stale one fails the write,
    /// the claim is read with quorum, and its allocation compared with the one prepared.
    pub(super) async fn run(self) {
        let name = self.claim.to_string();
        match tokio::time::timeout(API_WRITE_TIMEOUT, self.write()).await {
            Ok(Ok(())) | Ok(Err(ApiError::NotFound)) => {}
            Ok(Err(e)) => {
                tracing::warn!(claim = %name, error = %e, "prepared, but writing the claim's device status failed")
            }
            Err(_) => {
                tracing::warn!(claim = %name, "prepared, but writing the claim's device status timed out")
            }
        }
    }

    fn still_prepared(&self) -> bool {
        self.state.read(|data| {
            data.claims
                .get(&self.claim.uid)
                .is_some_and(|e| e.state == ClaimState::PrepareCompleted)
        })
    }

    async fn write(self) -> Result<(), ApiError> {
        // Unprepared meanwhile (a pod deleted at once): nothing to tell, and no request spent.
        if !self.still_prepared() {
            return Ok(());
        }
        let (namespace, name) = (&self.claim.namespace, &self.claim.name);
        let list = status::merge_device_status(&self.existing, &self.pool, self.ours.clone());
        match self
            .api
            .write_device_status(namespace, name, list, self.based_on.clone())
            .await
        {
            Err(ApiError::Conflict) => {}
            Ok(version) => {
                self.seen.wrote(&self.claim.uid, version);
                return Ok(());
            }
            Err(e) => return Err(e),
        }
        // The claim changed since the copy prepared from (its reservations, another driver's
        // status, or the copy came from a cache that was behind).
        let current = self
            .api
            .get_claim(namespace, name, ClaimRead::Quorum)
            .await?;
        if current.metadata.uid.as_deref() != Some(self.claim.uid.as_str()) {
            return Ok(());
        }
        let now = claim::allocation_id(&current, &self.pool);
        if now.is_empty() {
            return Ok(()); // Deallocated: nothing to report on.
        }
        if now != self.prepared_from {
            tracing::error!(
                claim = %format!("{namespace}/{name}"),
                prepared = ?self.prepared_from,
                current = ?now,
                "the claim was prepared from a copy that was not current: its allocation has \
                 changed; delete the pod so that the kubelet prepares the claim again"
            );
            return Err(ApiError::Other(
                "prepared from an allocation that is no longer the claim's".into(),
            ));
        }
        if !self.still_prepared() {
            return Ok(());
        }
        let existing = device_status_of(&current);
        let list = status::merge_device_status(&existing, &self.pool, self.ours);
        let version = self
            .api
            .write_device_status(namespace, name, list, current.metadata.resource_version)
            .await?;
        self.seen.wrote(&self.claim.uid, version);
        Ok(())
    }
}

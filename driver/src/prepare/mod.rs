//! Claim preparation: the kubelet's NodePrepareResources / NodeUnprepareResources, independent of the
//! gRPC version that carried them (the `plugin::dra` adapters translate v1 and v1beta1 to these types).
//!
//! claim.rs (fetch + check) -> limits.rs (pure) -> cdi.rs (pure render) -> [`crate::node_state`]
//! (spec, folders and checkpoint entry, in crash-safe order), then status.rs (what
//! `kubectl describe resourceclaim` shows). This module orchestrates; failures are typed
//! ([`PrepareError`]) until the gRPC adapter turns them into text.

mod answer;
mod api;
pub(crate) mod cdi;
pub mod claim;
mod device_health;
mod error;
mod guard;
pub(crate) mod limits;
mod mig_status;
mod mps;
mod nvidia_cdi;
pub mod offline;
mod reads;
mod reservations;
mod seen;
pub(crate) mod status;
mod status_writes;
mod tombstones;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpupool_api::claim::{ClaimRef, PreparedDevice};
use gpupool_api::config::effective_config;
use gpupool_api::inventory::Inventory;
use k8s_openapi::jiff::Timestamp;
use tokio::sync::watch;

use self::api::{ClaimApi, KubeClaimApi};
use self::claim::AllocationId;
pub use self::error::{PrepareError, PrepareErrorKind};
pub use self::limits::DefaultEnforcement;
pub use self::mps::MPS_CHECK_INTERVAL;
pub use self::nvidia_cdi::DriverLibraries;
use self::reads::CLAIM_READS_IN_FLIGHT;
use self::reservations::InFlight;
use self::seen::SeenClaims;
use self::status_writes::{StatusQueue, StatusWrite};
use self::tombstones::UnpreparedAllocations;
use crate::devices::{self, DeviceKind, NodeDevice};
use crate::node_state::checkpoint::{CheckpointData, ClaimEntry, ClaimState, MigRecord, MpsHold};
use crate::node_state::{current_boot_id, MigCards, NodeLayout, NodeState, NodeStateError};

/// What preparation needs to know about the node.
#[derive(Debug, Clone)]
pub struct PrepareOptions {
    /// This node's name, which is also its pool name.
    pub node_name: String,
    /// Where the claims' files go (see [`crate::node_state::layout`]).
    pub layout: NodeLayout,
    /// Where real GPUs' driver libraries come from (ignored with fake GPUs, which have none).
    pub driver_libraries: DriverLibraries,
    /// The cards with MIG and what creates their instances.
    pub mig: MigCards,
    /// The enforcement of a claim whose config names none.
    pub default_enforcement: DefaultEnforcement,
    /// How long after a prepare its `status.devices` write is made (see [`STATUS_WRITE_DELAY`]).
    pub status_write_delay: Duration,
}

/// A prepare's status write waits this long: a claim unprepared meanwhile (a short-lived pod, a
/// kubelet retry) costs the cluster no write, and a burst of prepares is not slowed by the API
/// server's handling of the driver's own writes (a quorum read waits for the writes etcd is
/// committing). `kubectl describe resourceclaim` shows the status about this long after the
/// prepare, which is about when the pod's containers start.
pub const STATUS_WRITE_DELAY: Duration = Duration::from_millis(500);

const API_WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// Prepares and unprepares claims for the kubelet. Send + Sync; share it in an `Arc`.
pub struct ClaimPreparer {
    opts: PrepareOptions,
    inventory: Arc<Inventory>,
    api: Arc<dyn ClaimApi>,
    weights: watch::Receiver<BTreeMap<String, i64>>,
    state: Arc<NodeState>,
    claim_locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    status_writes: StatusQueue,
    unprepared: UnpreparedAllocations,
    seen: Arc<SeenClaims>,
    /// The devices last reported unhealthy (device -> what is wrong), see
    /// [`ClaimPreparer::report_device_health`].
    unhealthy: Mutex<BTreeMap<String, String>>,
    warned_missing_lib: AtomicBool,
    /// Claims between their node-guard check and their checkpoint entry (see `reserve`).
    in_flight: InFlight,
    /// Claim reads in flight at once, see [`reads::CLAIM_READS_IN_FLIGHT`].
    claim_reads: tokio::sync::Semaphore,
}

impl ClaimPreparer {
    /// Reconciles the checkpoint and the CDI folder; call before registering with the kubelet.
    pub async fn new(
        opts: PrepareOptions,
        inventory: Arc<Inventory>,
        client: kube::Client,
        weights: watch::Receiver<BTreeMap<String, i64>>,
    ) -> Result<Self, NodeStateError> {
        let api = Arc::new(KubeClaimApi::new(client));
        Self::with_api(opts, inventory, api, weights, current_boot_id()).await
    }

    /// [`ClaimPreparer::new`] with any API implementation and an explicit boot id.
    pub(crate) async fn with_api(
        opts: PrepareOptions,
        inventory: Arc<Inventory>,
        api: Arc<dyn ClaimApi>,
        weights: watch::Receiver<BTreeMap<String, i64>>,
        boot_id: String,
    ) -> Result<Self, NodeStateError> {
        let (layout, mig) = (opts.layout.clone(), opts.mig.clone());
        let (state, corrupt) =
            tokio::task::spawn_blocking(move || NodeState::recover(layout, &boot_id, mig))
                .await
                .expect("reconciliation does not panic")?;
        if let Some(message) = corrupt {
            let event = status::node_event(
                &opts.node_name,
                "RecoverCheckpoint",
                "CheckpointCorrupt",
                &message,
                Timestamp::now(),
            );
            let api = api.clone();
            tokio::spawn(async move {
                if let Err(e) = tokio::time::timeout(API_WRITE_TIMEOUT, api.post_event(event)).await
                {
                    tracing::warn!(error = %e, "could not post the CheckpointCorrupt event");
                }
            });
        }
        Ok(Self {
            opts,
            inventory,
            api,
            weights,
            state: Arc::new(state),
            claim_locks: Mutex::new(HashMap::new()),
            status_writes: StatusQueue::default(),
            unprepared: UnpreparedAllocations::default(),
            seen: Arc::default(),
            unhealthy: Mutex::default(),
            warned_missing_lib: AtomicBool::new(false),
            in_flight: Mutex::default(),
            claim_reads: tokio::sync::Semaphore::new(CLAIM_READS_IN_FLIGHT),
        })
    }

    /// Prepare every claim concurrently; each gets its own answer.
    ///
    /// Each claim takes the node's turn (with another instance of the driver, see
    /// [`crate::node_state::NodeState::take_turn`]) only for its files and checkpoint entry, after its read from the
    /// API server: a call never holds the turn while it waits for the API server, so the calls of
    /// other pods, and the other instance's, are not queued behind that read.
    pub async fn prepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> Vec<(ClaimRef, Result<Vec<PreparedDevice>, PrepareError>)> {
        let answers = futures::future::join_all(claims.iter().map(|c| self.prepare_claim(c))).await;
        claims.into_iter().zip(answers).collect()
    }

    /// Unprepare every claim concurrently; a claim this driver does not know is already unprepared.
    pub async fn unprepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> Vec<(ClaimRef, Result<(), PrepareError>)> {
        let _turn = match self.state.take_turn().await {
            Ok(turn) => turn,
            Err(e) => return fail_all(claims, e),
        };
        let answers =
            futures::future::join_all(claims.iter().map(|c| self.unprepare_claim(c))).await;
        claims.into_iter().zip(answers).collect()
    }

    /// The recorded answer for a prepared claim, if any (for inspection and tests).
    pub async fn prepared(&self, uid: &str) -> Option<Vec<PreparedDevice>> {
        self.state.prepared(uid).map(|e| e.devices)
    }

    /// Wait until the claims' status writes queued so far are done (tests, orderly shutdown).
    pub async fn flush_status_writes(&self) {
        self.status_writes.flush().await;
    }

    fn claim_lock(&self, uid: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self
            .claim_locks
            .lock()
            .expect("claim lock map is never poisoned");
        locks.entry(uid.to_string()).or_default().clone()
    }

    fn forget_claim_lock(&self, uid: &str, ours: &Arc<tokio::sync::Mutex<()>>) {
        let mut locks = self
            .claim_locks
            .lock()
            .expect("claim lock map is never poisoned");
        // The map and `ours` are the only holders: nobody waits on this claim.
        if locks
            .get(uid)
            .is_some_and(|l| Arc::ptr_eq(l, ours) && Arc::strong_count(l) <= 2)
        {
            locks.remove(uid);
        }
    }

    /// Fold the checkpoint's log into its snapshot (orderly shutdown).
    pub async fn compact_checkpoint(&self) -> Result<(), NodeStateError> {
        let state = self.state.clone();
        tokio::task::spawn_blocking(move || state.compact())
            .await
            .expect("compaction does not panic")
    }

    async fn prepare_claim(&self, claim: &ClaimRef) -> Result<Vec<PreparedDevice>, PrepareError> {
        self.one_at_a_time(claim, self.prepare_locked(claim)).await
    }

    /// `work` once the reference is checked (its names and UID become paths) and no other call
    /// works on the same claim.
    async fn one_at_a_time<T>(
        &self,
        claim: &ClaimRef,
        work: impl std::future::Future<Output = Result<T, PrepareError>>,
    ) -> Result<T, PrepareError> {
        claim::validate_ref(claim).map_err(|e| PrepareError::new(claim, e))?;
        let lock = self.claim_lock(&claim.uid);
        let guard = lock.lock().await;
        let result = work.await;
        drop(guard);
        self.forget_claim_lock(&claim.uid, &lock);
        result
    }

    async fn prepare_locked(&self, claim: &ClaimRef) -> Result<Vec<PreparedDevice>, PrepareError> {
        // A claim this instance knows prepared is answered from the checkpoint, without a read.
        // Otherwise the read comes before the turn. It is safe there: this claim's lock is held,
        // so no unprepare of it by this process (and its tombstone) can come between the read and
        // the work, and a claim the other instance prepared meanwhile shows in the checkpoint the
        // turn refreshes, which is checked again below. When the other instance has written since
        // this one last looked, the read waits for the turn: the claim may be prepared already.
        let known = self.state.prepared(&claim.uid).is_some();
        let read = if known || self.state.others_may_have_written() {
            None
        } else {
            Some(self.read_claim(claim).await)
        };
        let result = match self.state.take_turn().await {
            Err(e) => Err(PrepareError::new(
                claim,
                PrepareErrorKind::Turn(Arc::new(e)),
            )),
            Ok(_turn) => {
                if let Some(entry) = self.state.prepared(&claim.uid) {
                    return self
                        .restore_spec_if_missing(claim, &entry)
                        .await
                        .map(|()| entry.devices);
                }
                // Not read before the turn (see above) and not prepared: read now, in the turn
                // (only with two instances).
                let object = match read {
                    Some(read) => read,
                    None => self.read_claim(claim).await,
                };
                match object {
                    Ok(object) => self.prepare_fresh(claim, object).await,
                    Err(e) => Err(e),
                }
            }
        };
        if let Err(error) = &result {
            tracing::warn!(claim = %claim, uid = %claim.uid, %error, transient = error.is_transient(), "prepare failed");
            let event = status::prepare_failed_event(
                claim,
                &self.opts.node_name,
                &error.to_string(),
                Timestamp::now(),
            );
            match tokio::time::timeout(API_WRITE_TIMEOUT, self.api.post_event(event)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "could not post the PrepareFailed event"),
                Err(_) => tracing::warn!("posting the PrepareFailed event timed out"),
            }
        }
        result
    }

    /// A completed claim whose spec vanished (someone cleaned the CDI folder) gets it back.
    async fn restore_spec_if_missing(
        &self,
        claim: &ClaimRef,
        entry: &ClaimEntry,
    ) -> Result<(), PrepareError> {
        let Some(spec) = entry.spec.clone() else {
            return Ok(());
        };
        // The common case (the kubelet repeating a prepare) is one stat on the CDI folder's
        // tmpfs: not worth a thread hand-over.
        if self.state.spec_exists(&claim.uid) {
            return Ok(());
        }
        let (state, uid) = (self.state.clone(), claim.uid.clone());
        run_blocking(claim, move || state.restore_spec(&uid, &spec)).await
    }

    /// Prepares `claim`, read from the API server as `object`, in this instance's turn.
    async fn prepare_fresh(
        &self,
        claim: &ClaimRef,
        object: k8s_openapi::api::resource::v1::ResourceClaim,
    ) -> Result<Vec<PreparedDevice>, PrepareError> {
        let fail = |kind: PrepareErrorKind| PrepareError::new(claim, kind);
        let pool = self.opts.node_name.as_str();
        let allocation = claim::check_claim(claim, &object, pool, &self.inventory)
            .map_err(|e| fail(e.into()))?;

        let per_device: Vec<_> = allocation
            .devices
            .iter()
            .map(|d| {
                let device =
                    devices::find(&self.inventory, &d.device).expect("checked by check_claim");
                (
                    d.clone(),
                    device,
                    effective_config(&allocation.configs, &d.request),
                )
            })
            .collect();
        // Held until the claim is recorded prepared or has failed: the node guard sees it.
        let _reserved = self.reserve(claim, &per_device).map_err(fail)?;
        let layout = self.state.layout();
        let default_enforcement = self
            .opts
            .default_enforcement
            .resolve(|e| layout.library(e).is_some_and(|lib| lib.host_path.exists()));
        let device_limits =
            limits::claim_limits(&per_device, default_enforcement).map_err(|e| fail(e.into()))?;
        // MPS: the card's daemon runs, admitting the share, before the spec names its folders.
        let mps: Vec<MpsHold> = crate::mps::share::check(&per_device, &device_limits)
            .map_err(|e| fail(e.into()))?
            .into_iter()
            .collect();
        if !mps.is_empty() {
            let started = ClaimEntry {
                state: ClaimState::PrepareStarted,
                namespace: claim.namespace.clone(),
                name: claim.name.clone(),
                devices: Vec::new(),
                spec: None,
                warning: None,
                recovered: false,
                mig: Vec::new(),
                mps: mps.clone(),
            };
            let (state, uid) = (self.state.clone(), claim.uid.clone());
            run_blocking(claim, move || state.hold_mps(&uid, started)).await?;
        }

        let hami_core = device_limits
            .iter()
            .any(|l| l.enforcement == gpupool_api::config::Enforcement::HamiCore);
        if hami_core && !layout.fake_gpus && layout.hami_core_lib.host_path.exists() {
            self.state
                .ensure_vgpu_lock_dir()
                .map_err(|e| fail(e.into()))?;
        }

        // A card that switches MIG mode at run time runs whole or in fractions with MIG off.
        for (_, device, _) in &per_device {
            if device.kind == DeviceKind::Card
                && device.gpu.mig.as_ref().is_some_and(|m| m.switchable)
            {
                let (state, uuid) = (self.state.clone(), device.gpu.uuid.clone());
                run_blocking(claim, move || state.leave_mig_mode(&uuid)).await?;
            }
        }
        // MIG devices: their instances exist (and are recorded) before the spec can name them.
        let intents: Vec<MigRecord> = per_device
            .iter()
            .filter_map(|(_, device, _)| mig_intent(device))
            .collect();
        let mig = if intents.is_empty() {
            Vec::new()
        } else {
            let started = ClaimEntry {
                state: ClaimState::PrepareStarted,
                namespace: claim.namespace.clone(),
                name: claim.name.clone(),
                devices: Vec::new(),
                spec: None,
                warning: None,
                recovered: false,
                mig: intents,
                mps: Vec::new(),
            };
            let (state, uid) = (self.state.clone(), claim.uid.clone());
            run_blocking(claim, move || state.create_mig(&uid, started)).await?
        };
        let answer = self.answer(claim, &per_device, &device_limits, &mig);
        let (rendered, devices) = match answer {
            Ok(answer) => answer,
            Err(kind) => {
                if !mig.is_empty() {
                    let (state, uid) = (self.state.clone(), claim.uid.clone());
                    let _ = tokio::task::spawn_blocking(move || state.abandon(&uid)).await;
                }
                return Err(fail(kind));
            }
        };

        let completed = ClaimEntry {
            state: ClaimState::PrepareCompleted,
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            devices: devices.clone(),
            spec: Some(rendered.spec.clone()),
            warning: rendered.warning.clone(),
            recovered: false,
            mig: mig.clone(),
            mps,
        };
        let (state, uid) = (self.state.clone(), claim.uid.clone());
        if mig.is_empty() {
            // A spec on the CDI folder's tmpfs and a line appended to the checkpoint log, in the
            // page cache: a few system calls, cheaper than a hand-over to a blocking thread and
            // back (two wake-ups, ~130 µs of the kubelet's wait here, BENCHMARKS.md).
            state
                .prepare(&uid, completed)
                .map_err(|e| PrepareError::new(claim, e))?;
        } else {
            // Rolling back may destroy MIG instances through NVML: that blocks. One blocking
            // section for the whole sequence: no thread hand-over between its steps.
            run_blocking(claim, move || state.prepare(&uid, completed)).await?;
        }
        self.seen.prepared_from(&claim.uid, &object);

        // The claim is prepared once its spec and entry exist; the status is for the user only.
        let weights = self.weights.borrow().clone();
        let now = Timestamp::now();
        let ours = per_device
            .iter()
            .zip(&device_limits)
            .map(|((d, device, _), l)| {
                let weight = weights.get(&device.gpu.model).copied();
                let record = mig.iter().find(|r| r.device == d.device);
                match (device.kind, record) {
                    (DeviceKind::Mig { profile, .. }, Some(record)) => mig_status::device_status(
                        d,
                        device.gpu,
                        (profile, record),
                        l,
                        weight,
                        allocation.generation,
                        now,
                    ),
                    _ => status::device_status(
                        d,
                        device.gpu,
                        l,
                        weight,
                        rendered.warning.as_deref(),
                        allocation.generation,
                        now,
                    ),
                }
            })
            .collect::<Vec<_>>();
        // A claim prepared on a device that is unhealthy (a request tolerating the taint) says so.
        let unhealthy = self.unhealthy.lock().expect("never poisoned").clone();
        let ours = status::with_device_health(&ours, pool, &unhealthy, now).unwrap_or(ours);
        let write = StatusWrite {
            api: self.api.clone(),
            state: self.state.clone(),
            seen: self.seen.clone(),
            claim: claim.clone(),
            pool: pool.to_string(),
            ours,
            prepared_from: claim::allocation_id(&object, pool),
            existing: allocation.device_status,
            based_on: object.metadata.resource_version.clone(),
        };
        self.status_writes
            .push_prepare_write(self.opts.status_write_delay, write);
        Ok(devices)
    }

    async fn unprepare_claim(&self, claim: &ClaimRef) -> Result<(), PrepareError> {
        self.one_at_a_time(claim, self.unprepare_locked(claim))
            .await
    }

    /// Files and checkpoint entry only: no API request. The claim's `status.devices` entries go
    /// with its allocation (the API server drops them when the allocation is removed), and an
    /// unprepare must work while the API server is away.
    async fn unprepare_locked(&self, claim: &ClaimRef) -> Result<(), PrepareError> {
        // The allocation's identity only: the entry also holds the whole CDI spec.
        let (allocation, mig): (Option<AllocationId>, bool) = self.state.read(|data| {
            let entry = data.claims.get(&claim.uid);
            (
                entry.map(|e| claim::prepared_allocation_id(&e.devices)),
                entry.is_some_and(|e| !e.mig.is_empty() || !e.mps.is_empty()),
            )
        });
        let (state, uid) = (self.state.clone(), claim.uid.clone());
        if mig {
            // Destroying MIG instances goes through NVML, stopping an MPS daemon waits for it:
            // that blocks.
            run_blocking(claim, move || state.remove(&uid)).await?;
        } else {
            // Files on the CDI folder's tmpfs and a checkpoint line: cheaper on this thread than
            // a hand-over (see prepare_fresh).
            state
                .remove(&uid)
                .map_err(|e| PrepareError::new(claim, e))?;
        }
        let tombstone = self.seen.bury(&claim.uid, allocation.unwrap_or_default());
        if !tombstone.allocation.is_empty() {
            self.unprepared.record(&claim.uid, tombstone);
        }
        Ok(())
    }

    /// Reads the checkpoint as this instance holds it (metrics, computed at scrape time).
    pub fn read_checkpoint<R>(&self, f: impl FnOnce(&CheckpointData) -> R) -> R {
        self.state.read(f)
    }
}

/// The checkpoint record of a MIG device before anything is created: card, profile, placement.
fn mig_intent(device: &NodeDevice<'_>) -> Option<MigRecord> {
    let DeviceKind::Mig { profile, start } = device.kind else {
        return None;
    };
    Some(MigRecord {
        device: device.name.clone(),
        parent_uuid: device.gpu.uuid.clone(),
        profile_id: profile.id,
        compute_slices: profile.compute_slices,
        start,
        size: profile.memory_slices,
        gpu_instance: None,
        compute_instance: None,
        uuid: None,
        device_nodes: Vec::new(),
    })
}

/// The same error for every claim of a call that could not start.
fn fail_all<T>(
    claims: Vec<ClaimRef>,
    error: NodeStateError,
) -> Vec<(ClaimRef, Result<T, PrepareError>)> {
    let error = Arc::new(error);
    claims
        .into_iter()
        .map(|c| {
            let e = PrepareError::new(&c, PrepareErrorKind::Turn(error.clone()));
            (c, Err(e))
        })
        .collect()
}

/// Run a blocking step of the node's state (file system calls, a `flock` another driver process
/// may hold for a moment) off the runtime's thread.
async fn run_blocking<T: Send + 'static>(
    claim: &ClaimRef,
    work: impl FnOnce() -> Result<T, NodeStateError> + Send + 'static,
) -> Result<T, PrepareError> {
    match tokio::task::spawn_blocking(work).await {
        Ok(result) => result.map_err(|e| PrepareError::new(claim, e)),
        Err(e) => Err(PrepareError::new(
            claim,
            PrepareErrorKind::Internal(e.to_string()),
        )),
    }
}

#[cfg(test)]
mod admission_agrees;
#[cfg(test)]
mod tests;

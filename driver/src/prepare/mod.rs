//! Claim preparation: the kubelet's NodePrepareResources / NodeUnprepareResources, independent of the
//! gRPC version that carried them (the `plugin::dra` adapters translate v1 and v1beta1 to these types).
//!
//! claim.rs (fetch + check) -> limits.rs (pure) -> cdi.rs (pure render + atomic write) -> checkpoint.rs,
//! then status.rs (what `kubectl describe resourceclaim` shows).
//!
//! Crash safety: a claim is recorded `PrepareStarted` before its spec is written (temp file,
//! rename) and `PrepareCompleted` after; unprepare removes the spec before the entry
//! ([`ClaimFiles`]). Start-up reconciliation (in [`ClaimPreparer::new`]) rolls back whatever a
//! crash left half done.

pub mod api;
pub mod cdi;
pub mod checkpoint;
pub mod claim;
pub mod fault;
pub mod fsutil;
pub mod limits;
pub mod nvidia_cdi;
pub mod status;

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, Permissions};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpupool_api::config::effective_config;
use gpupool_api::inventory::Inventory;
use k8s_openapi::api::resource::v1::AllocatedDeviceStatus;
use k8s_openapi::jiff::Timestamp;
use thiserror::Error;
use tokio::sync::watch;

use self::api::{ApiError, ClaimApi, ClaimRead, KubeClaimApi};
use self::cdi::{HostLayout, SpecDevice};
use self::checkpoint::{Change, CheckpointData, ClaimEntry, ClaimState};
use self::claim::AllocationId;
use self::fault::fault_point;
pub use self::nvidia_cdi::DriverLibraries;

/// A claim as the kubelet names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ClaimRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

/// One prepared device, as answered to the kubelet.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PreparedDevice {
    pub request_names: Vec<String>,
    pub pool_name: String,
    pub device_name: String,
    pub cdi_device_ids: Vec<String>,
    pub share_id: Option<String>,
}

/// Where preparation reads and writes on the node.
#[derive(Debug, Clone)]
pub struct PrepareOptions {
    /// This node's name, which is also its pool name.
    pub node_name: String,
    pub cdi_root: PathBuf,
    pub state_dir: PathBuf,
    /// Per-boot state (HAMi-core's per-claim cache folders), normally on a tmpfs.
    pub run_dir: PathBuf,
    /// Folder holding HAMi-core's `libvgpu.so`.
    pub vgpu_lib_dir: PathBuf,
    pub fake_gpus: bool,
    /// Where real GPUs' driver libraries come from (ignored with fake GPUs, which have none).
    pub driver_libraries: DriverLibraries,
    /// A lock file when other driver instances share these folders (a rolling update with surge):
    /// each prepare, unprepare and the start-up reconciliation then hold it, and each call starts
    /// from the checkpoint as the files hold it. `None`: this process is alone and its in-memory
    /// checkpoint stays authoritative.
    pub serialize_lock: Option<PathBuf>,
}

#[derive(Debug, Error)]
pub enum PrepareError {
    #[error("state folder {path}: {source}")]
    StateDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("CDI root {path}: {source}")]
    CdiRoot {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Checkpoint(#[from] checkpoint::CheckpointError),
}

/// Test hook: a boot id to use instead of the kernel's (reboot simulation in e2e tests).
pub const BOOT_ID_ENV: &str = "GPUPOOL_BOOT_ID";
const BOOT_ID_FILE: &str = "/proc/sys/kernel/random/boot_id";
const CACHE_DIR_NAME: &str = "vgpu-cache";
const PRELOAD_FILE_NAME: &str = "ld.so.preload";
/// The kubelet gives a whole NodePrepareResources call 45 s; leave room for the rest.
const API_READ_TIMEOUT: Duration = Duration::from_secs(15);
const API_WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// The node's boot id: the kernel's, unless [`BOOT_ID_ENV`] overrides it.
pub fn current_boot_id() -> String {
    if let Ok(id) = std::env::var(BOOT_ID_ENV) {
        return id;
    }
    fs::read_to_string(BOOT_ID_FILE)
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Prepares and unprepares claims for the kubelet. Send + Sync; share it in an `Arc`.
pub struct ClaimPreparer {
    opts: PrepareOptions,
    inventory: Arc<Inventory>,
    api: Arc<dyn ClaimApi>,
    weights: watch::Receiver<BTreeMap<String, i64>>,
    layout: HostLayout,
    checkpoint: Arc<checkpoint::Store>,
    claim_locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    status_writes: StatusQueue,
    unprepared: UnpreparedAllocations,
    /// The devices last reported unhealthy (device -> what is wrong), see
    /// [`ClaimPreparer::report_device_health`].
    unhealthy: Mutex<BTreeMap<String, String>>,
    warned_missing_lib: AtomicBool,
    /// Taken before the lock file, so that this process's own calls queue here rather than each
    /// holding a blocking thread in `flock` (the threads the call holding the lock needs).
    turn: Arc<tokio::sync::Mutex<()>>,
}

/// This instance's turn on the node's shared folders; released on drop.
struct Turn {
    _file: std::fs::File,
    _local: tokio::sync::OwnedMutexGuard<()>,
}

/// Wait (blocking) for the exclusive `flock` on `path`, creating the file and its folder.
fn lock_shared_folders(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir)?;
    }
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(path)?;
    loop {
        // SAFETY: flock on a descriptor we own; the kernel drops the lock when it is closed,
        // also when the process dies, so a killed instance never leaves it taken.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } == 0 {
            return Ok(file);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// The allocations unprepared since start, newest last, so that a watch-cache copy still showing
/// one of them is recognised as stale (see [`claim::cached_copy_problem`]). Bounded: a claim is
/// re-allocated within seconds of its unprepare, if ever, and the cache is behind by far less.
#[derive(Default)]
struct UnpreparedAllocations(Mutex<std::collections::VecDeque<(String, AllocationId)>>);

const UNPREPARED_KEPT: usize = 1024;

impl UnpreparedAllocations {
    fn record(&self, uid: &str, id: AllocationId) {
        let mut list = self.0.lock().expect("never poisoned");
        if list.len() == UNPREPARED_KEPT {
            list.pop_front();
        }
        list.push_back((uid.to_string(), id));
    }

    fn of(&self, uid: &str) -> Vec<AllocationId> {
        let list = self.0.lock().expect("never poisoned");
        list.iter()
            .filter(|(u, _)| u == uid)
            .map(|(_, id)| id.clone())
            .collect()
    }
}

/// The claims' `status.devices` writes, off the kubelet's critical path: each claim's writes run
/// in spawned tasks chained one after the other, so a re-prepare's write never gets overtaken by
/// an earlier one of the same claim. Claims do not wait for each other.
/// The last write queued for a claim: its sequence number and task.
type QueueTail = (u64, tokio::task::JoinHandle<()>);

#[derive(Clone)]
struct StatusQueue {
    /// Per claim uid: the sequence number and handle of the last write queued.
    tails: Arc<Mutex<HashMap<String, QueueTail>>>,
    next_seq: Arc<std::sync::atomic::AtomicU64>,
    /// Writes of different claims in flight at once. kube's client speaks HTTP/1.1, so each one
    /// holds a connection of its own (~50 KiB): against a slow API server an unbounded queue
    /// turned a burst of prepares into hundreds of connections.
    in_flight: Arc<tokio::sync::Semaphore>,
}

const STATUS_WRITES_IN_FLIGHT: usize = 4;

impl Default for StatusQueue {
    fn default() -> Self {
        Self {
            tails: Arc::default(),
            next_seq: Arc::default(),
            in_flight: Arc::new(tokio::sync::Semaphore::new(STATUS_WRITES_IN_FLIGHT)),
        }
    }
}

impl StatusQueue {
    fn push(&self, uid: &str, write: impl std::future::Future<Output = ()> + Send + 'static) {
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        let tails = self.tails.clone();
        let owned_uid = uid.to_string();
        let mut map = self.tails.lock().expect("status queue is never poisoned");
        let previous = map.remove(uid).map(|(_, handle)| handle);
        let in_flight = self.in_flight.clone();
        let handle = tokio::spawn(async move {
            if let Some(previous) = previous {
                let _ = previous.await;
            }
            let permit = in_flight.acquire_owned().await;
            write.await;
            drop(permit);
            let mut map = tails.lock().expect("status queue is never poisoned");
            if map.get(&owned_uid).is_some_and(|(s, _)| *s == seq) {
                map.remove(&owned_uid);
            }
        });
        map.insert(uid.to_string(), (seq, handle));
    }

    /// Wait until every write queued so far has finished. A marker is chained behind each
    /// claim's last write, so the per-claim order holds for writes queued meanwhile.
    async fn flush(&self) {
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

impl ClaimPreparer {
    /// Reconciles the checkpoint and the CDI folder; call before registering with the kubelet.
    pub async fn new(
        opts: PrepareOptions,
        inventory: Arc<Inventory>,
        client: kube::Client,
        weights: watch::Receiver<BTreeMap<String, i64>>,
    ) -> Result<Self, PrepareError> {
        let api = Arc::new(KubeClaimApi::new(client));
        Self::with_api(opts, inventory, api, weights, current_boot_id()).await
    }

    /// [`ClaimPreparer::new`] with any API implementation and an explicit boot id.
    pub async fn with_api(
        opts: PrepareOptions,
        inventory: Arc<Inventory>,
        api: Arc<dyn ClaimApi>,
        weights: watch::Receiver<BTreeMap<String, i64>>,
        boot_id: String,
    ) -> Result<Self, PrepareError> {
        let layout = HostLayout {
            vgpu_lib: opts.vgpu_lib_dir.join(cdi::LIB_FILE_NAME),
            preload_file: opts.state_dir.join(PRELOAD_FILE_NAME),
            vgpu_lock_dir: PathBuf::from(cdi::VGPU_LOCK_DIR),
            cache_root: opts.run_dir.join(CACHE_DIR_NAME),
            fake_gpus: opts.fake_gpus,
        };
        let (data, corrupt) = {
            let opts = opts.clone();
            let layout = layout.clone();
            tokio::task::spawn_blocking(move || {
                // Another instance may be preparing a claim right now: its spec would look like
                // an orphan to the sweep.
                let _turn = match &opts.serialize_lock {
                    Some(path) => {
                        Some(
                            lock_shared_folders(path).map_err(|source| PrepareError::Io {
                                path: path.clone(),
                                source,
                            })?,
                        )
                    }
                    None => None,
                };
                reconcile(&opts, &layout, &boot_id)
            })
            .await
            .expect("reconciliation does not panic")?
        };
        if let Some(message) = corrupt {
            let event = status::node_event(
                &opts.node_name,
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
        let checkpoint = Arc::new(checkpoint::Store::new(opts.state_dir.clone(), data));
        Ok(Self {
            opts,
            inventory,
            api,
            weights,
            layout,
            checkpoint,
            claim_locks: Mutex::new(HashMap::new()),
            status_writes: StatusQueue::default(),
            unprepared: UnpreparedAllocations::default(),
            unhealthy: Mutex::default(),
            warned_missing_lib: AtomicBool::new(false),
            turn: Arc::default(),
        })
    }

    /// With other instances on the node: wait for this one's turn and catch up with what they
    /// changed. `Ok(None)` when this process is alone.
    async fn take_turn(&self) -> Result<Option<Turn>, String> {
        let Some(path) = self.opts.serialize_lock.clone() else {
            return Ok(None);
        };
        let local = self.turn.clone().lock_owned().await;
        let checkpoint = self.checkpoint.clone();
        let file = run_blocking(move || {
            let file = lock_shared_folders(&path)
                .map_err(|e| format!("taking the lock {}: {e}", path.display()))?;
            checkpoint
                .refresh()
                .map_err(|e| format!("reading the checkpoint: {e}"))?;
            Ok(file)
        })
        .await?;
        Ok(Some(Turn {
            _file: file,
            _local: local,
        }))
    }

    /// Prepare every claim concurrently; each gets its own answer.
    pub async fn prepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> Vec<(ClaimRef, Result<Vec<PreparedDevice>, String>)> {
        let _turn = match self.take_turn().await {
            Ok(turn) => turn,
            Err(e) => return fail_all(claims, &e),
        };
        let answers = futures::future::join_all(claims.iter().map(|c| self.prepare_claim(c))).await;
        claims.into_iter().zip(answers).collect()
    }

    /// Unprepare every claim concurrently; a claim this driver does not know is already unprepared.
    pub async fn unprepare(&self, claims: Vec<ClaimRef>) -> Vec<(ClaimRef, Result<(), String>)> {
        let _turn = match self.take_turn().await {
            Ok(turn) => turn,
            Err(e) => return fail_all(claims, &e),
        };
        let answers =
            futures::future::join_all(claims.iter().map(|c| self.unprepare_claim(c))).await;
        claims.into_iter().zip(answers).collect()
    }

    /// The recorded answer for a prepared claim, if any (for inspection and tests).
    pub async fn prepared(&self, uid: &str) -> Option<Vec<PreparedDevice>> {
        self.checkpoint.read(|data| {
            data.claims
                .get(uid)
                .filter(|e| e.state == ClaimState::PrepareCompleted && !e.recovered)
                .map(|e| e.devices.clone())
        })
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
    pub async fn compact_checkpoint(&self) -> Result<(), String> {
        let store = self.checkpoint.clone();
        run_blocking(move || store.compact().map_err(|e| e.to_string())).await
    }

    async fn prepare_claim(&self, claim: &ClaimRef) -> Result<Vec<PreparedDevice>, String> {
        claim::validate_ref(claim).map_err(|e| e.to_string())?;
        let lock = self.claim_lock(&claim.uid);
        let guard = lock.lock().await;
        let result = self.prepare_locked(claim).await;
        drop(guard);
        self.forget_claim_lock(&claim.uid, &lock);
        result
    }

    async fn prepare_locked(&self, claim: &ClaimRef) -> Result<Vec<PreparedDevice>, String> {
        let recorded = self.checkpoint.read(|data| {
            data.claims
                .get(&claim.uid)
                .filter(|e| e.state == ClaimState::PrepareCompleted && !e.recovered)
                .cloned()
        });
        if let Some(entry) = recorded {
            self.restore_spec_if_missing(&claim.uid, &entry).await?;
            return Ok(entry.devices);
        }

        let result = self.prepare_fresh(claim).await;
        if let Err(message) = &result {
            tracing::warn!(claim = %format!("{}/{}", claim.namespace, claim.name), uid = %claim.uid, error = %message, "prepare failed");
            let event = status::prepare_failed_event(
                claim,
                &self.opts.node_name,
                message,
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
    async fn restore_spec_if_missing(&self, uid: &str, entry: &ClaimEntry) -> Result<(), String> {
        let Some(spec) = entry.spec.clone() else {
            return Ok(());
        };
        // The common case (the kubelet repeating a prepare) is one stat on the CDI folder's
        // tmpfs: not worth a thread hand-over.
        if cdi::spec_path(&self.opts.cdi_root, uid).exists() {
            return Ok(());
        }
        let (cdi_root, uid, layout) = (
            self.opts.cdi_root.clone(),
            uid.to_string(),
            self.layout.clone(),
        );
        run_blocking(move || {
            if !cdi::spec_path(&cdi_root, &uid).exists() {
                ensure_mount_sources(&layout, &uid, &spec)
                    .and_then(|()| cdi::write_spec(&cdi_root, &uid, &spec))
                    .map_err(|e| format!("rewriting the CDI spec: {e}"))?;
            }
            Ok(())
        })
        .await
    }

    async fn prepare_fresh(&self, claim: &ClaimRef) -> Result<Vec<PreparedDevice>, String> {
        let claim_name = format!("{}/{}", claim.namespace, claim.name);
        let object = self.read_claim(claim, &claim_name).await?;
        let pool = self.opts.node_name.as_str();
        let allocation =
            claim::check_claim(claim, &object, pool, &self.inventory).map_err(|e| e.to_string())?;

        let per_device: Vec<_> = allocation
            .devices
            .iter()
            .map(|d| {
                let gpu = self
                    .inventory
                    .gpu(&d.device)
                    .expect("checked by check_claim");
                (
                    d.clone(),
                    gpu,
                    effective_config(&allocation.configs, &d.request),
                )
            })
            .collect();
        let device_limits =
            limits::claim_limits(&per_device).map_err(|e| format!("claim {claim_name}: {e}"))?;

        let enforced = device_limits
            .iter()
            .any(|l| l.enforcement == gpupool_api::config::Enforcement::HamiCore);
        if enforced && !self.opts.fake_gpus && self.layout.vgpu_lib.exists() {
            // HAMi-core's lock folder is shared by every container on the node; the runtime needs
            // it to exist before it can mount it.
            ensure_shared_dir(&self.layout.vgpu_lock_dir).map_err(|e| {
                format!(
                    "claim {claim_name}: {}: {e}",
                    self.layout.vgpu_lock_dir.display()
                )
            })?;
        }
        let spec_devices: Vec<SpecDevice> = per_device
            .iter()
            .zip(&device_limits)
            .map(|((allocated, gpu, _), limits)| SpecDevice {
                allocated,
                gpu,
                limits,
            })
            .collect();
        let rendered = cdi::render(&claim.uid, &spec_devices, &self.layout, &|p: &Path| {
            p.exists()
        })
        .map_err(|e| format!("claim {claim_name}: {e}"))?;
        if let Some(warning) = &rendered.warning {
            if !self.warned_missing_lib.swap(true, Ordering::Relaxed) {
                tracing::warn!("{warning}");
            }
        }

        let mut devices = Vec::with_capacity(per_device.len());
        for ((d, gpu, _), id) in per_device.iter().zip(&rendered.cdi_ids) {
            let mut cdi_device_ids = vec![id.clone()];
            if let (false, DriverLibraries::NvidiaCdi { spec_dirs }) =
                (self.opts.fake_gpus, &self.opts.driver_libraries)
            {
                let nvidia = nvidia_cdi::find_device_id(spec_dirs, &gpu.uuid, gpu.index)
                    .map_err(|e| format!("claim {claim_name}: {}: {e}", d.device))?;
                cdi_device_ids.push(nvidia);
            }
            devices.push(PreparedDevice {
                request_names: vec![d.request.clone()],
                pool_name: d.pool.clone(),
                device_name: d.device.clone(),
                cdi_device_ids,
                share_id: d.share_id.clone(),
            });
        }

        let uid = claim.uid.clone();
        let entry = |state, devices, spec| ClaimEntry {
            state,
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            devices,
            spec,
            warning: rendered.warning.clone(),
            recovered: false,
        };
        let started = entry(ClaimState::PrepareStarted, Vec::new(), None);
        let completed = entry(
            ClaimState::PrepareCompleted,
            devices.clone(),
            Some(rendered.spec.clone()),
        );
        let files = self.claim_files(&uid);
        // One blocking section for the whole sequence: no thread hand-over between its steps.
        run_blocking(move || files.prepare(started, completed))
            .await
            .map_err(|e| format!("claim {claim_name}: {e}"))?;

        // The claim is prepared once its spec and entry exist; the status is for the user only.
        let weights = self.weights.borrow().clone();
        let now = Timestamp::now();
        let ours = per_device
            .iter()
            .zip(&device_limits)
            .map(|((d, gpu, _), l)| {
                status::device_status(
                    d,
                    gpu,
                    l,
                    weights.get(&gpu.model).copied(),
                    rendered.warning.as_deref(),
                    allocation.generation,
                    now,
                )
            })
            .collect::<Vec<_>>();
        // A claim prepared on a device that is unhealthy (a request tolerating the taint) says so.
        let unhealthy = self.unhealthy.lock().expect("never poisoned").clone();
        let ours = status::with_device_health(&ours, pool, &unhealthy, now).unwrap_or(ours);
        let write = StatusWrite {
            api: self.api.clone(),
            checkpoint: self.checkpoint.clone(),
            claim: claim.clone(),
            pool: pool.to_string(),
            ours,
            prepared_from: claim::allocation_id(&object, pool),
            existing: allocation.device_status,
            based_on: object.metadata.resource_version.clone(),
        };
        self.status_writes.push(&uid, write.run());
        Ok(devices)
    }

    /// The claim as the API server has it: from its watch cache when that copy can only be the
    /// allocation the kubelet saw (see [`claim::cached_copy_problem`]), else with a quorum read.
    async fn read_claim(
        &self,
        claim: &ClaimRef,
        claim_name: &str,
    ) -> Result<k8s_openapi::api::resource::v1::ResourceClaim, String> {
        let pool = self.opts.node_name.as_str();
        match self.get_claim(claim, ClaimRead::Cached).await {
            Ok(copy) => {
                let problem =
                    claim::cached_copy_problem(claim, &copy, pool, &self.unprepared.of(&claim.uid));
                match problem {
                    None => return Ok(copy),
                    Some(why) => {
                        tracing::debug!(claim = %claim_name, why, "cached copy not usable; reading with quorum")
                    }
                }
            }
            // The cache may not have seen the claim's creation yet.
            Err(ApiError::NotFound) => {
                tracing::debug!(claim = %claim_name, "not in the watch cache; reading with quorum")
            }
            // An API server that cannot answer from its cache cannot answer a quorum read either:
            // asking again would only double the kubelet's wait.
            Err(e) => return Err(read_failure(claim_name, e)),
        }
        self.get_claim(claim, ClaimRead::Quorum)
            .await
            .map_err(|e| read_failure(claim_name, e))
    }

    async fn get_claim(
        &self,
        claim: &ClaimRef,
        read: ClaimRead,
    ) -> Result<k8s_openapi::api::resource::v1::ResourceClaim, ApiError> {
        tokio::time::timeout(
            API_READ_TIMEOUT,
            self.api.get_claim(&claim.namespace, &claim.name, read),
        )
        .await
        .unwrap_or_else(|_| Err(ApiError::Other("timed out".into())))
    }

    /// What prepare and unprepare write for one claim.
    fn claim_files(&self, uid: &str) -> ClaimFiles {
        ClaimFiles {
            uid: uid.to_string(),
            cdi_root: self.opts.cdi_root.clone(),
            layout: self.layout.clone(),
            checkpoint: self.checkpoint.clone(),
        }
    }

    async fn unprepare_claim(&self, claim: &ClaimRef) -> Result<(), String> {
        claim::validate_ref(claim).map_err(|e| e.to_string())?;
        let lock = self.claim_lock(&claim.uid);
        let guard = lock.lock().await;
        let result = self.unprepare_locked(claim).await;
        drop(guard);
        self.forget_claim_lock(&claim.uid, &lock);
        result
    }

    /// Files and checkpoint entry only: no API request. The claim's `status.devices` entries go
    /// with its allocation (the API server drops them when the allocation is removed), and an
    /// unprepare must work while the API server is away.
    async fn unprepare_locked(&self, claim: &ClaimRef) -> Result<(), String> {
        // The allocation's identity only: the entry also holds the whole CDI spec.
        let allocation: Option<AllocationId> = self.checkpoint.read(|data| {
            data.claims
                .get(&claim.uid)
                .map(|e| claim::prepared_allocation_id(&e.devices))
        });
        let known = allocation.is_some();

        let files = self.claim_files(&claim.uid);
        run_blocking(move || files.unprepare(known))
            .await
            .map_err(|e| format!("claim {}/{}: {e}", claim.namespace, claim.name))?;
        if let Some(id) = allocation.filter(|id| !id.is_empty()) {
            self.unprepared.record(&claim.uid, id);
        }
        Ok(())
    }

    /// Tells the claims prepared on each device of `unhealthy` (device -> what is wrong) through
    /// the Ready condition of their `status.devices` entries, and the claims on devices that left
    /// it that they recovered. Only claims on devices whose health changed since the last call are
    /// written: one quorum read and one write each, off the kubelet's path.
    pub fn report_device_health(&self, unhealthy: BTreeMap<String, String>) {
        let previous = std::mem::replace(
            &mut *self.unhealthy.lock().expect("never poisoned"),
            unhealthy.clone(),
        );
        let changed: std::collections::BTreeSet<&String> = previous
            .keys()
            .chain(unhealthy.keys())
            .filter(|d| previous.get(*d) != unhealthy.get(*d))
            .collect();
        if changed.is_empty() {
            return;
        }
        let claims: Vec<ClaimRef> = self.checkpoint.read(|data| {
            data.claims
                .iter()
                .filter(|(_, e)| e.state == ClaimState::PrepareCompleted)
                .filter(|(_, e)| e.devices.iter().any(|d| changed.contains(&d.device_name)))
                .map(|(uid, e)| ClaimRef {
                    namespace: e.namespace.clone(),
                    name: e.name.clone(),
                    uid: uid.clone(),
                })
                .collect()
        });
        let unhealthy = Arc::new(unhealthy);
        for claim in claims {
            let (api, pool, unhealthy) = (
                self.api.clone(),
                self.opts.node_name.clone(),
                unhealthy.clone(),
            );
            let uid = claim.uid.clone();
            self.status_writes.push(&uid, async move {
                let name = format!("{}/{}", claim.namespace, claim.name);
                let work = write_device_health(api.as_ref(), &pool, &claim, &unhealthy);
                match tokio::time::timeout(API_WRITE_TIMEOUT, work).await {
                    Ok(Ok(())) | Ok(Err(ApiError::NotFound)) => {}
                    Ok(Err(e)) => {
                        tracing::warn!(claim = %name, error = %e, "could not write the device health into the claim's status")
                    }
                    Err(_) => {
                        tracing::warn!(claim = %name, "writing the device health into the claim's status timed out")
                    }
                }
            });
        }
    }

    /// Reads the checkpoint as this instance holds it (metrics, computed at scrape time).
    pub fn read_checkpoint<R>(&self, f: impl FnOnce(&CheckpointData) -> R) -> R {
        self.checkpoint.read(f)
    }
}

/// The same error for every claim of a call that could not start.
fn fail_all<T>(claims: Vec<ClaimRef>, error: &str) -> Vec<(ClaimRef, Result<T, String>)> {
    claims
        .into_iter()
        .map(|c| (c, Err(error.to_string())))
        .collect()
}

/// Run a blocking step (file system calls, a `flock` another driver process may hold for a
/// moment) off the runtime's thread.
async fn run_blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, String> + Send + 'static,
) -> Result<T, String> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| e.to_string())?
}

/// One claim's files and checkpoint entry, changed in the order that keeps a crash at any
/// point repairable by start-up reconciliation. Blocking.
struct ClaimFiles {
    uid: String,
    cdi_root: PathBuf,
    layout: HostLayout,
    checkpoint: Arc<checkpoint::Store>,
}

impl ClaimFiles {
    /// `PrepareStarted`, then the spec `completed` records (temp file, rename), then
    /// `PrepareCompleted`; undone on failure. A spec never has its final name without at least a
    /// started entry.
    fn prepare(&self, started: ClaimEntry, completed: ClaimEntry) -> Result<(), String> {
        let spec = completed
            .spec
            .as_ref()
            .ok_or("a completed entry without a CDI spec")?;
        self.checkpoint
            .commit(Change::Put(self.uid.clone(), Box::new(started)))
            .map_err(|e| e.to_string())?;
        fault_point("after-prepare-started");
        let done = ensure_mount_sources(&self.layout, &self.uid, spec)
            .and_then(|()| cdi::write_spec(&self.cdi_root, &self.uid, spec))
            .map_err(|e| format!("writing the CDI spec: {e}"));
        let done = done.and_then(|()| {
            self.checkpoint
                .commit(Change::Put(self.uid.clone(), Box::new(completed)))
                .map_err(|e| e.to_string())
        });
        if done.is_err() {
            self.roll_back();
        }
        done?;
        fault_point("after-prepare-completed");
        Ok(())
    }

    /// Undo a prepare that failed after `PrepareStarted` was recorded.
    fn roll_back(&self) {
        let removed = cdi::remove_spec(&self.cdi_root, &self.uid)
            .and_then(|_| fsutil::remove_dir_all(&self.layout.cache_dir(&self.uid)));
        if removed.is_err() {
            tracing::error!(
                uid = self.uid,
                "rolling back a failed prepare could not remove its files; the next start will"
            );
        }
        if let Err(e) = self.checkpoint.commit(Change::Remove(self.uid.clone())) {
            tracing::error!(uid = self.uid, error = %e, "rolling back a failed prepare could not update the checkpoint; the next start will");
        }
    }

    /// The spec and cache folder first, the entry (when there is one) last: a crash in between
    /// leaves an entry whose spec start-up writes again, and the kubelet's retry removes both.
    fn unprepare(&self, known: bool) -> Result<(), String> {
        cdi::remove_spec(&self.cdi_root, &self.uid)
            .and_then(|_| {
                fault_point("mid-unprepare");
                fsutil::remove_dir_all(&self.layout.cache_dir(&self.uid))
            })
            .map_err(|e| format!("removing its files: {e}"))?;
        if known {
            self.checkpoint
                .commit(Change::Remove(self.uid.clone()))
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}

/// What the kubelet is told when the claim could not be read.
fn read_failure(claim_name: &str, error: ApiError) -> String {
    match error {
        ApiError::NotFound => format!("claim {claim_name}: not found in the API server"),
        e => format!("claim {claim_name}: cannot read it from the API server: {e}"),
    }
}

/// `status.devices` of a claim as read.
fn device_status_of(
    claim: &k8s_openapi::api::resource::v1::ResourceClaim,
) -> Vec<AllocatedDeviceStatus> {
    claim
        .status
        .as_ref()
        .and_then(|s| s.devices.clone())
        .unwrap_or_default()
}

/// The Ready conditions of one claim's entries, from the devices' health; read with quorum, written
/// conditionally, read again once if someone wrote the claim in between.
async fn write_device_health(
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
struct StatusWrite {
    api: Arc<dyn ClaimApi>,
    checkpoint: Arc<checkpoint::Store>,
    claim: ClaimRef,
    pool: String,
    ours: Vec<AllocatedDeviceStatus>,
    /// The allocation the devices were prepared from.
    prepared_from: AllocationId,
    /// `status.devices` of the copy prepared from (other drivers' entries are kept).
    existing: Vec<AllocatedDeviceStatus>,
    /// That copy's resourceVersion: the write is conditional on it.
    based_on: Option<String>,
}

impl StatusWrite {
    /// Best effort, within [`API_WRITE_TIMEOUT`]. Conditional on the copy prepared from being
    /// current, which also checks a copy taken from the watch cache: a stale one fails the write,
    /// the claim is read with quorum, and its allocation compared with the one prepared.
    async fn run(self) {
        let name = format!("{}/{}", self.claim.namespace, self.claim.name);
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
        self.checkpoint.read(|data| {
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
            other => return other.map(|_| ()),
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
        self.api
            .write_device_status(namespace, name, list, current.metadata.resource_version)
            .await
            .map(|_| ())
    }
}

/// A folder every container user may write to (HAMi-core's lock folder, the per-claim cache),
/// sticky like /tmp so users cannot remove each other's files.
fn ensure_shared_dir(dir: &Path) -> std::io::Result<()> {
    if !dir.is_dir() {
        fs::create_dir_all(dir)?;
    }
    // Also when the folder exists: a hostPath mount makes it 0755 before we see it, and then
    // containers that do not run as root cannot take HAMi-core's locks.
    if fs::metadata(dir)?.permissions().mode() & 0o7777 != 0o1777 {
        fs::set_permissions(dir, Permissions::from_mode(0o1777))?;
    }
    Ok(())
}

/// Create the host folders a spec mounts that this driver owns (the claim's cache folder, the
/// HAMi-core lock folder), so a spec written again after a reboot still has its mount sources.
fn ensure_mount_sources(
    layout: &HostLayout,
    uid: &str,
    spec: &gpupool_api::cdi::Spec,
) -> std::io::Result<()> {
    let cache_dir = layout.cache_dir(uid);
    for mount in spec.devices.iter().flat_map(|d| &d.container_edits.mounts) {
        let host = Path::new(&mount.host_path);
        if host == cache_dir || host == layout.vgpu_lock_dir {
            ensure_shared_dir(host)?;
        }
    }
    Ok(())
}

/// The first device node a spec names that is not on this host.
fn missing_device_node(spec: &gpupool_api::cdi::Spec) -> Option<String> {
    spec.devices
        .iter()
        .map(|d| &d.container_edits)
        .chain(std::iter::once(&spec.container_edits))
        .flat_map(|e| &e.device_nodes)
        .map(|n| n.host_path.clone().unwrap_or_else(|| n.path.clone()))
        .find(|p| !Path::new(p).exists())
}

/// Entries for the specs of ours found in the CDI root, when the checkpoint was lost. A spec that
/// does not parse or is not valid CDI is left out (and then removed as an orphan).
fn recover_from_cdi_root(cdi_root: &Path) -> CheckpointData {
    let mut data = CheckpointData::default();
    let Ok(entries) = fs::read_dir(cdi_root) else {
        return data;
    };
    for dir_entry in entries.flatten() {
        let name = dir_entry.file_name();
        let Some(uid) = name.to_str().and_then(cdi::owned_file_uid) else {
            continue;
        };
        if name.to_str().is_some_and(|n| n.ends_with(".tmp")) || !claim::is_uuid(uid) {
            continue;
        }
        let spec = fs::read(dir_entry.path())
            .ok()
            .and_then(|b| serde_json::from_slice::<gpupool_api::cdi::Spec>(&b).ok())
            .filter(|s| {
                s.kind == gpupool_api::names::CDI_KIND && gpupool_api::cdi::validate(s).is_empty()
            });
        if let Some(spec) = spec {
            tracing::warn!(uid, "keeping a CDI spec found without a checkpoint; the claim will be prepared again when the kubelet asks");
            data.claims.insert(
                uid.to_string(),
                ClaimEntry {
                    state: ClaimState::PrepareCompleted,
                    namespace: String::new(),
                    name: String::new(),
                    devices: Vec::new(),
                    spec: Some(spec),
                    warning: None,
                    recovered: true,
                },
            );
        }
    }
    data
}

/// Start-up reconciliation; returns the checkpoint to run with and, when the file on disk was
/// unreadable, the message describing what was moved aside.
fn reconcile(
    opts: &PrepareOptions,
    layout: &HostLayout,
    boot_id: &str,
) -> Result<(CheckpointData, Option<String>), PrepareError> {
    let state_dir = &opts.state_dir;
    fsutil::ensure_private_dir(state_dir, 0o700).map_err(|source| PrepareError::StateDir {
        path: state_dir.clone(),
        source,
    })?;
    fsutil::ensure_private_dir(&opts.cdi_root, 0o755).map_err(|source| PrepareError::CdiRoot {
        path: opts.cdi_root.clone(),
        source,
    })?;
    let io_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| PrepareError::Io { path, source }
    };
    fsutil::ensure_private_dir(&opts.run_dir, 0o711).map_err(io_err(&opts.run_dir))?;
    fsutil::ensure_private_dir(&layout.cache_root, 0o711).map_err(io_err(&layout.cache_root))?;
    let preload = format!("{}\n", cdi::CONTAINER_LIB_PATH);
    if fs::read_to_string(&layout.preload_file).ok().as_deref() != Some(preload.as_str()) {
        fsutil::atomic_write(
            state_dir,
            PRELOAD_FILE_NAME,
            ".ld.so.preload.tmp",
            preload.as_bytes(),
            0o644,
            None,
        )
        .map_err(io_err(&layout.preload_file))?;
    }

    let _lock = checkpoint::CheckpointLock::acquire(state_dir)
        .map_err(io_err(&state_dir.join(checkpoint::LOCK_FILE)))?;
    let mut corrupt = None;
    let mut data = match checkpoint::load(state_dir) {
        Ok(Some(data)) => data,
        Ok(None) => CheckpointData::default(),
        Err(e) => {
            let aside = checkpoint::move_aside(state_dir, unix_now())
                .map_err(io_err(&checkpoint::path(state_dir)))?;
            let message = format!(
                "checkpoint {} is unreadable ({e}); moved it to {} and starting with no prepared claims",
                checkpoint::path(state_dir).display(),
                aside.display()
            );
            tracing::error!("{message}");
            corrupt = Some(message);
            recover_from_cdi_root(&opts.cdi_root)
        }
    };

    let rebooted = !data.boot_id.is_empty() && data.boot_id != boot_id;
    if rebooted {
        tracing::info!(previous = %data.boot_id, current = %boot_id, "node rebooted since the checkpoint was written: writing prepared claims' CDI specs again");
    }
    let mut keep = BTreeMap::new();
    for (uid, entry) in std::mem::take(&mut data.claims) {
        let valid_uid = claim::is_uuid(&uid);
        match (&entry.state, &entry.spec) {
            (ClaimState::PrepareCompleted, Some(spec))
                if valid_uid && rebooted && missing_device_node(spec).is_some() =>
            {
                // The cards moved or left with the reboot: a fresh prepare finds the truth.
                tracing::error!(uid, node = ?missing_device_node(spec), "a prepared claim's device node is gone after the reboot; dropping it so the next prepare starts over");
                cdi::remove_spec(&opts.cdi_root, &uid).map_err(io_err(&opts.cdi_root))?;
                fsutil::remove_dir_all(&layout.cache_dir(&uid))
                    .map_err(io_err(&layout.cache_root))?;
            }
            (ClaimState::PrepareCompleted, Some(spec)) if valid_uid => {
                if rebooted || !cdi::spec_path(&opts.cdi_root, &uid).exists() {
                    ensure_mount_sources(layout, &uid, spec).map_err(io_err(&layout.cache_root))?;
                    cdi::write_spec(&opts.cdi_root, &uid, spec).map_err(io_err(&opts.cdi_root))?;
                }
                keep.insert(uid, entry);
            }
            _ => {
                tracing::info!(uid, state = ?entry.state, "rolling back an unfinished prepare");
                if valid_uid {
                    cdi::remove_spec(&opts.cdi_root, &uid).map_err(io_err(&opts.cdi_root))?;
                    fsutil::remove_dir_all(&layout.cache_dir(&uid))
                        .map_err(io_err(&layout.cache_root))?;
                }
            }
        }
    }
    data.claims = keep;

    // Files of ours that no completed entry accounts for: orphans of a crash or a lost checkpoint.
    for dir_entry in fs::read_dir(&opts.cdi_root).map_err(io_err(&opts.cdi_root))? {
        let dir_entry = dir_entry.map_err(io_err(&opts.cdi_root))?;
        let name = dir_entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(uid) = cdi::owned_file_uid(name) else {
            continue;
        };
        let is_temp = name.ends_with(".tmp");
        if is_temp || !data.claims.contains_key(uid) {
            tracing::info!(
                file = name,
                "removing a CDI spec no prepared claim accounts for"
            );
            fsutil::remove_file(&dir_entry.path()).map_err(io_err(&dir_entry.path()))?;
        }
    }
    for dir_entry in fs::read_dir(&layout.cache_root).map_err(io_err(&layout.cache_root))? {
        let dir_entry = dir_entry.map_err(io_err(&layout.cache_root))?;
        let name = dir_entry.file_name();
        if !name.to_str().is_some_and(|n| data.claims.contains_key(n)) {
            fsutil::remove_dir_all(&dir_entry.path()).map_err(io_err(&dir_entry.path()))?;
        }
    }
    fsutil::sync_dir(&opts.cdi_root).map_err(io_err(&opts.cdi_root))?;

    data.boot_id = boot_id.to_string();
    checkpoint::save(state_dir, &data)?;
    Ok((data, corrupt))
}

#[cfg(test)]
mod tests;

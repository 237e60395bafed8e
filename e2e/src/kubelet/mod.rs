//! Kubelet emulator: registers DRA plugins from a registry folder and prepares the claims of the pods
//! bound to its node over the plugin's gRPC socket, the way the kubelet does.

mod pods;

pub use pods::{
    allocated_resources_status, claim_ready_for_pod, health_name, init_container_statuses,
    pick_version, pod_claim_names, registration_retry_delay, resource_health, retry_backoff,
    running_container_statuses, DraVersion, MAX_REGISTRATION_RETRY,
};

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpupool_api::claim::{ClaimRef, PreparedDevice};
use gpupool_proto::{dra_v1, dra_v1beta1, health_v1alpha1, registration};
use k8s_openapi::api::core::v1::{Event, Node, ObjectReference, Pod, ResourceHealth};
use k8s_openapi::api::resource::v1::ResourceClaim;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, Time};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use tokio::task::JoinHandle;
use tonic::transport::Channel;

use crate::grpc::path_authority::PathAuthorityConnection;
use crate::grpc::{connect_unix_lazy, GrpcError, KUBELET_CALL_TIMEOUT};

const GET_INFO: &str = "/pluginregistration.Registration/GetInfo";
const NOTIFY_REGISTRATION_STATUS: &str =
    "/pluginregistration.Registration/NotifyRegistrationStatus";
/// Each registration call's deadline: the plugin watcher gives GetInfo one second; a plugin
/// slower than that is retried with backoff, as there.
const REGISTRATION_CALL_TIMEOUT: Duration = Duration::from_secs(1);

/// Event reason the kubelet uses when a pod's claims cannot be prepared.
pub const FAILED_PREPARE_REASON: &str = "FailedPrepareDynamicResources";

/// How long the kubelet trusts a device health report that carries no
/// `health_check_timeout_seconds`: after that the device shows `Unknown` until the plugin reports
/// it again.
pub const DEFAULT_HEALTH_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum KubeletError {
    #[error("kubelet {node}: {source}")]
    Kube {
        node: String,
        #[source]
        source: kube::Error,
    },
    #[error("DRA driver {0} is not registered with this kubelet")]
    NotRegistered(String),
    #[error("DRA driver {driver}: {call} failed: {status}")]
    Rpc {
        driver: String,
        call: &'static str,
        status: tonic::Status,
    },
    #[error(transparent)]
    Grpc(#[from] GrpcError),
    #[error("timed out after {0:?} waiting for {1}")]
    Timeout(Duration, String),
}

/// How one kubelet emulator behaves.
#[derive(Clone, Debug)]
pub struct KubeletConfig {
    pub node_name: String,
    /// Folder watched for `*-reg.sock` (the kubelet's `plugins_registry`).
    pub registry_dir: PathBuf,
    /// DRA versions this kubelet speaks, in order of preference (short names).
    pub known_versions: Vec<String>,
    /// Timeout of every DRA call.
    pub call_timeout: Duration,
    /// How often the registry folder and the node's pods are looked at.
    pub poll_interval: Duration,
    /// Create the Node object on start, like a kubelet registering its node.
    pub register_node: bool,
    /// Watch pods bound to the node and prepare their claims; off when a real kubelet does that.
    pub manage_pods: bool,
    /// How long a device health report counts when the plugin set no timeout of its own.
    pub health_timeout: Duration,
}

impl KubeletConfig {
    pub fn new(node_name: impl Into<String>, registry_dir: impl Into<PathBuf>) -> Self {
        KubeletConfig {
            node_name: node_name.into(),
            registry_dir: registry_dir.into(),
            known_versions: vec![
                gpupool_proto::versions::DRA_V1.to_string(),
                gpupool_proto::versions::DRA_V1BETA1.to_string(),
            ],
            call_timeout: KUBELET_CALL_TIMEOUT,
            poll_interval: Duration::from_millis(100),
            register_node: true,
            manage_pods: true,
            health_timeout: DEFAULT_HEALTH_TIMEOUT,
        }
    }
}

/// A claim the kubelet believes prepared, and the pods on this node that use it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreparedClaim {
    pub claim: ClaimRef,
    pub devices: Vec<PreparedDevice>,
    pub pod_uids: BTreeSet<String>,
    /// The drivers that prepared it (and will be asked to unprepare it).
    pub drivers: BTreeSet<String>,
}

impl PreparedClaim {
    pub fn cdi_device_ids(&self) -> Vec<String> {
        self.devices
            .iter()
            .flat_map(|d| d.cdi_device_ids.iter().cloned())
            .collect()
    }
}

/// Per-claim outcome of a DRA call, keyed by claim UID; `Err` is the plugin's `error` string.
pub type PrepareOutcome = BTreeMap<String, Result<Vec<PreparedDevice>, String>>;
pub type UnprepareOutcome = BTreeMap<String, Result<(), String>>;

/// A plugin accepted by the kubelet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registration {
    pub driver: String,
    pub socket: PathBuf,
    pub endpoint: PathBuf,
    pub version: DraVersion,
    pub advertised_versions: Vec<String>,
    pub health_advertised: bool,
    /// Increases with every registration this kubelet accepts, so a re-registration (after a driver
    /// restart) is told apart from the one before.
    pub sequence: u64,
}

/// A registration socket the kubelet refused, and why (what it told the plugin).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejection {
    pub socket: PathBuf,
    pub error: String,
}

/// The latest health the plugin reported for one device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceHealthReport {
    pub pool_name: String,
    pub device_name: String,
    pub health: health_v1alpha1::HealthStatus,
    pub last_updated_time: i64,
    pub message: String,
}

/// The registration handshakes the kubelet started with one registration socket path.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RegistrationAttempts {
    /// When each handshake began, oldest first (the latest [`KEPT_ATTEMPTS`]).
    pub started: Vec<Instant>,
    /// Handshakes in a row that failed (no answer, or a plugin the kubelet refused); 0 once one
    /// succeeds.
    pub failures: u32,
    /// Not before this instant is the socket tried again, while it is failing.
    pub next_attempt: Option<Instant>,
}

/// How many handshake start times [`RegistrationAttempts`] keeps per socket.
pub const KEPT_ATTEMPTS: usize = 64;

/// A device health as the kubelet keeps it: the report, when it came, how long it counts.
#[derive(Clone, Debug)]
struct CachedHealth {
    report: DeviceHealthReport,
    received: Instant,
    valid_for: Duration,
}

struct Plugin {
    registration: Registration,
    channel: Channel,
    health_task: Option<JoinHandle<()>>,
}

#[derive(Default)]
struct PodRecord {
    namespace: String,
    name: String,
    claim_uids: BTreeSet<String>,
    running: bool,
    attempts: u32,
    next_attempt: Option<Instant>,
    last_error: Option<String>,
    /// When the containers started, once they have.
    started_at: Option<Time>,
    /// `status.containerStatuses` as last written, to write again only what changed.
    written_statuses: Option<serde_json::Value>,
}

/// A socket file re-created at the same path (a restarted plugin) has a new inode or mtime.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct SocketId {
    inode: u64,
    mtime: (i64, i64),
}

impl SocketId {
    fn of(meta: &std::fs::Metadata) -> Self {
        SocketId {
            inode: meta.ino(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
        }
    }
}

#[derive(Default)]
struct State {
    /// Registry socket path -> identity of the socket last registered from there.
    seen_sockets: HashMap<PathBuf, SocketId>,
    /// Registry socket path -> its handshakes. Keyed by path, not by socket identity, as the
    /// kubelet's backoff is: a socket re-created at the same path waits out the backoff too.
    attempts: HashMap<PathBuf, RegistrationAttempts>,
    /// The registration the kubelet calls, per driver: the newest.
    plugins: BTreeMap<String, Plugin>,
    /// Older registrations of a driver still serving (a rolling update's old instance): when the
    /// newest one's socket goes, the kubelet falls back to the newest of these.
    standby: Vec<Registration>,
    rejections: Vec<Rejection>,
    /// Driver -> (pool, device) -> health, merged over reports the way the kubelet's cache is, and
    /// dropped when the driver's stream ends.
    health_cache: BTreeMap<String, BTreeMap<(String, String), CachedHealth>>,
    prepared: BTreeMap<String, PreparedClaim>,
    /// Claim UID -> driver -> the devices that driver prepared for it.
    prepared_by_driver: BTreeMap<String, BTreeMap<String, Vec<PreparedDevice>>>,
    pods: BTreeMap<String, PodRecord>,
    registrations_accepted: u64,
    /// Every change of the registration the kubelet calls, per driver: when, and which socket
    /// (`None`: no plugin of that driver at all).
    timeline: Vec<(Instant, String, Option<PathBuf>)>,
}

impl State {
    fn record_current(&mut self, driver: &str) {
        let current = self
            .plugins
            .get(driver)
            .map(|p| p.registration.socket.clone());
        self.timeline
            .push((Instant::now(), driver.to_string(), current));
    }
}

struct Inner {
    client: Client,
    config: KubeletConfig,
    state: Mutex<State>,
}

/// A running kubelet emulator; its background tasks stop when it is dropped.
pub struct Kubelet {
    inner: Arc<Inner>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
        let mut state = self.inner.state.lock().unwrap();
        for plugin in state.plugins.values_mut() {
            if let Some(task) = plugin.health_task.take() {
                task.abort();
            }
        }
    }
}

impl Kubelet {
    /// Registers the node (when asked) and starts watching the registry folder and the node's pods.
    pub async fn start(client: Client, config: KubeletConfig) -> Result<Kubelet, KubeletError> {
        let inner = Arc::new(Inner {
            client,
            config,
            state: Mutex::new(State::default()),
        });
        if inner.config.register_node {
            inner.register_node().await?;
        }
        let mut tasks = Vec::new();
        let registry = inner.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                registry.scan_registry().await;
                tokio::time::sleep(registry.config.poll_interval).await;
            }
        }));
        if inner.config.manage_pods {
            let pods = inner.clone();
            tasks.push(tokio::spawn(async move {
                loop {
                    if let Err(err) = pods.sync_pods().await {
                        tracing::warn!(node = %pods.config.node_name, "pod sync: {err}");
                    }
                    tokio::time::sleep(pods.inner_pod_interval()).await;
                }
            }));
        }
        Ok(Kubelet { inner, tasks })
    }

    pub fn node_name(&self) -> &str {
        &self.inner.config.node_name
    }

    pub fn registrations(&self) -> Vec<Registration> {
        let state = self.inner.state.lock().unwrap();
        state
            .plugins
            .values()
            .map(|p| p.registration.clone())
            .collect()
    }

    /// Every change of the registration this kubelet calls for `driver`, oldest first: when, and
    /// the registration socket (`None` while it has no plugin of that driver).
    pub fn registration_timeline(&self, driver: &str) -> Vec<(Instant, Option<PathBuf>)> {
        self.inner
            .state
            .lock()
            .unwrap()
            .timeline
            .iter()
            .filter(|(_, d, _)| d == driver)
            .map(|(at, _, socket)| (*at, socket.clone()))
            .collect()
    }

    pub fn registration(&self, driver: &str) -> Option<Registration> {
        let state = self.inner.state.lock().unwrap();
        state.plugins.get(driver).map(|p| p.registration.clone())
    }

    /// Waits until `driver` is registered and returns its registration.
    pub async fn wait_for_registration(
        &self,
        driver: &str,
        timeout: Duration,
    ) -> Result<Registration, KubeletError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(reg) = self.registration(driver) {
                return Ok(reg);
            }
            if Instant::now() >= deadline {
                return Err(KubeletError::Timeout(
                    timeout,
                    format!(
                        "driver {driver} to register on node {} (rejections: {:?})",
                        self.node_name(),
                        self.rejections()
                    ),
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn rejections(&self) -> Vec<Rejection> {
        self.inner.state.lock().unwrap().rejections.clone()
    }

    /// The registration handshakes started with the socket at `socket`, if any.
    pub fn registration_attempts(&self, socket: &Path) -> Option<RegistrationAttempts> {
        self.inner
            .state
            .lock()
            .unwrap()
            .attempts
            .get(socket)
            .cloned()
    }

    /// Claims (by UID) the kubelet believes prepared.
    pub fn prepared_claims(&self) -> BTreeMap<String, PreparedClaim> {
        self.inner.state.lock().unwrap().prepared.clone()
    }

    /// The latest health the driver streamed for each of its devices, as the kubelet keeps it
    /// (one merged record per device, forgotten when the stream ends).
    pub fn device_health(&self, driver: &str) -> Vec<DeviceHealthReport> {
        let state = self.inner.state.lock().unwrap();
        state
            .health_cache
            .get(driver)
            .map(|devices| devices.values().map(|c| c.report.clone()).collect())
            .unwrap_or_default()
    }

    /// The last prepare error of a pod on this node, if it is still failing.
    pub fn pod_error(&self, namespace: &str, name: &str) -> Option<String> {
        let state = self.inner.state.lock().unwrap();
        state
            .pods
            .values()
            .find(|p| p.namespace == namespace && p.name == name)
            .and_then(|p| p.last_error.clone())
    }

    /// Calls NodePrepareResources directly, for tests that craft requests; the kubelet's own
    /// bookkeeping is left alone.
    pub async fn prepare(
        &self,
        driver: &str,
        claims: &[ClaimRef],
    ) -> Result<PrepareOutcome, KubeletError> {
        self.inner.call_prepare(driver, claims).await
    }

    /// Calls NodeUnprepareResources directly (bookkeeping left alone).
    pub async fn unprepare(
        &self,
        driver: &str,
        claims: &[ClaimRef],
    ) -> Result<UnprepareOutcome, KubeletError> {
        self.inner.call_unprepare(driver, claims).await
    }
}

/// NodePrepareResources and NodeUnprepareResources of one DRA version, as a module with `prepare`
/// and `unprepare`: the generated types differ, the calls do not. `|d| share_id` reads a device's
/// share id (v1beta1 has none).
macro_rules! dra_calls {
    ($module:ident, $proto:ident, |$d:ident| $share_id:expr) => {
        mod $module {
            use super::*;

            fn to_claims(claims: &[ClaimRef]) -> Vec<$proto::Claim> {
                claims
                    .iter()
                    .map(|c| $proto::Claim {
                        namespace: c.namespace.clone(),
                        uid: c.uid.clone(),
                        name: c.name.clone(),
                    })
                    .collect()
            }

            /// An empty error is success.
            fn result(error: String) -> Result<(), String> {
                if error.is_empty() {
                    Ok(())
                } else {
                    Err(error)
                }
            }

            pub(super) async fn prepare(
                channel: Channel,
                claims: &[ClaimRef],
            ) -> Result<PrepareOutcome, tonic::Status> {
                let mut client = $proto::dra_plugin_client::DraPluginClient::new(channel);
                let request = $proto::NodePrepareResourcesRequest {
                    claims: to_claims(claims),
                };
                let response = client.node_prepare_resources(request).await?;
                Ok(response
                    .into_inner()
                    .claims
                    .into_iter()
                    .map(|(uid, r)| {
                        let devices = r.devices.into_iter().map(|$d| {
                            let share_id = $share_id;
                            PreparedDevice {
                                request_names: $d.request_names,
                                pool_name: $d.pool_name,
                                device_name: $d.device_name,
                                cdi_device_ids: $d.cdi_device_ids,
                                share_id,
                            }
                        });
                        (uid, result(r.error).map(|()| devices.collect()))
                    })
                    .collect())
            }

            pub(super) async fn unprepare(
                channel: Channel,
                claims: &[ClaimRef],
            ) -> Result<UnprepareOutcome, tonic::Status> {
                let mut client = $proto::dra_plugin_client::DraPluginClient::new(channel);
                let request = $proto::NodeUnprepareResourcesRequest {
                    claims: to_claims(claims),
                };
                let response = client.node_unprepare_resources(request).await?;
                Ok(response
                    .into_inner()
                    .claims
                    .into_iter()
                    .map(|(uid, r)| (uid, result(r.error)))
                    .collect())
            }
        }
    };
}

dra_calls!(dra_calls_v1, dra_v1, |d| d.share_id);
dra_calls!(dra_calls_v1beta1, dra_v1beta1, |d| None);

fn now_time() -> Time {
    Time(k8s_openapi::jiff::Timestamp::now())
}

fn is_conflict_or_exists(err: &kube::Error) -> bool {
    matches!(err, kube::Error::Api(status) if status.code == 409)
}

fn is_not_found(err: &kube::Error) -> bool {
    matches!(err, kube::Error::Api(status) if status.code == 404)
}

impl Inner {
    fn inner_pod_interval(&self) -> Duration {
        self.config.poll_interval.max(Duration::from_millis(100))
    }

    fn kube_err(&self, source: kube::Error) -> KubeletError {
        KubeletError::Kube {
            node: self.config.node_name.clone(),
            source,
        }
    }

    async fn register_node(&self) -> Result<(), KubeletError> {
        let name = &self.config.node_name;
        let node: Node = serde_json::from_value(json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "labels": {
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": std::env::consts::ARCH,
                    "gpupool.dev/emulated": "true",
                }
            },
            "status": {
                "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                "message": "kubelet emulator is posting ready status"}],
                "nodeInfo": {"kubeletVersion": "v1.34.0-gpupool-emulator", "operatingSystem": "linux",
                             "architecture": std::env::consts::ARCH, "machineID": "", "systemUUID": "",
                             "bootID": "", "kernelVersion": "", "osImage": "", "containerRuntimeVersion": "",
                             "kubeProxyVersion": ""}
            }
        }))
        .expect("node literal is a valid Node");
        let nodes: Api<Node> = Api::all(self.client.clone());
        match nodes.create(&PostParams::default(), &node).await {
            Ok(_) => Ok(()),
            Err(err) if is_conflict_or_exists(&err) => Ok(()),
            Err(err) => Err(self.kube_err(err)),
        }
    }

    async fn scan_registry(self: &Arc<Self>) {
        let dir = &self.config.registry_dir;
        let mut present: HashMap<PathBuf, SocketId> = HashMap::new();
        if let Ok(entries) = std::fs::read_dir(dir) {
            for entry in entries.flatten() {
                let path = entry.path();
                let is_reg = path
                    .file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.ends_with("-reg.sock"));
                let Ok(meta) = entry.metadata() else { continue };
                if is_reg && meta.file_type().is_socket() {
                    present.insert(path, SocketId::of(&meta));
                }
            }
        }
        // Sockets that went away (or were replaced) take their plugin with them.
        let gone: Vec<PathBuf> = {
            let state = self.state.lock().unwrap();
            state
                .seen_sockets
                .iter()
                .filter(|(path, id)| present.get(*path) != Some(id))
                .map(|(path, _)| path.clone())
                .collect()
        };
        for path in gone {
            self.forget_socket(&path);
        }
        for (path, id) in present {
            if !self.start_attempt(&path, id) {
                continue;
            }
            let answered = self.register_socket(&path).await;
            self.finish_attempt(path, id, answered);
        }
    }

    /// Whether to handshake with the socket at `path` now: not when it is registered already, nor
    /// while it waits out the backoff of earlier failures. Records the start when it is due.
    fn start_attempt(&self, path: &Path, id: SocketId) -> bool {
        let mut state = self.state.lock().unwrap();
        if state.seen_sockets.get(path) == Some(&id) {
            return false;
        }
        let attempts = state.attempts.entry(path.to_path_buf()).or_default();
        let now = Instant::now();
        if attempts.next_attempt.is_some_and(|at| now < at) {
            return false;
        }
        if attempts.started.len() == KEPT_ATTEMPTS {
            attempts.started.remove(0);
        }
        attempts.started.push(now);
        true
    }

    /// Books a handshake's outcome. Like the kubelet, a plugin it refused is a failure too: it is
    /// asked again after the backoff, and told again why.
    fn finish_attempt(&self, path: PathBuf, id: SocketId, answered: bool) {
        let mut state = self.state.lock().unwrap();
        let registered = answered
            && state
                .plugins
                .values()
                .any(|p| p.registration.socket == path);
        let attempts = state.attempts.entry(path.clone()).or_default();
        if registered {
            attempts.failures = 0;
            attempts.next_attempt = None;
            state.seen_sockets.insert(path, id);
        } else {
            attempts.failures += 1;
            let delay = registration_retry_delay(attempts.failures);
            attempts.next_attempt = Some(Instant::now() + delay);
            tracing::debug!(socket = %path.display(), failures = attempts.failures,
                "registration failed; next attempt in {delay:?}");
        }
    }

    fn forget_socket(self: &Arc<Self>, socket: &Path) {
        let mut state = self.state.lock().unwrap();
        state.seen_sockets.remove(socket);
        let drivers: Vec<String> = state
            .plugins
            .iter()
            .filter(|(_, p)| p.registration.socket == socket)
            .map(|(d, _)| d.clone())
            .collect();
        state.standby.retain(|r| r.socket != socket);
        for driver in drivers {
            if let Some(mut plugin) = state.plugins.remove(&driver) {
                tracing::info!(node = %self.config.node_name, %driver, "plugin deregistered");
                if let Some(task) = plugin.health_task.take() {
                    task.abort();
                }
            }
            state.health_cache.remove(&driver);
            let fallback = state
                .standby
                .iter()
                .filter(|r| r.driver == driver)
                .max_by_key(|r| r.sequence)
                .cloned();
            if let Some(reg) = fallback {
                state.standby.retain(|r| r.socket != reg.socket);
                tracing::info!(node = %self.config.node_name, %driver,
                    socket = %reg.socket.display(), "falling back to an older registration");
                let plugin = self.plugin_for(reg);
                state.plugins.insert(driver.clone(), plugin);
            }
            state.record_current(&driver);
        }
    }

    /// The channel (and health stream, when advertised) of an accepted registration.
    fn plugin_for(self: &Arc<Self>, registration: Registration) -> Plugin {
        let channel = connect_unix_lazy(&registration.endpoint, self.config.call_timeout);
        let health_task = registration.health_advertised.then(|| {
            let inner = self.clone();
            let driver = registration.driver.clone();
            let endpoint = registration.endpoint.clone();
            tokio::spawn(async move { inner.watch_health(driver, endpoint).await })
        });
        Plugin {
            registration,
            channel,
            health_task,
        }
    }

    /// Runs the registration handshake; `false` when the socket did not answer (tried again later).
    async fn register_socket(self: &Arc<Self>, socket: &Path) -> bool {
        // As the kubelet's plugin watcher: grpc-go dialled with the bare path, so the requests
        // carry the path as `:authority`.
        let mut conn = match PathAuthorityConnection::connect(socket).await {
            Ok(conn) => conn,
            Err(err) => {
                tracing::debug!(socket = %socket.display(), "dial failed: {err}");
                return false;
            }
        };
        let info: registration::PluginInfo = match conn
            .unary(
                GET_INFO,
                &registration::InfoRequest {},
                REGISTRATION_CALL_TIMEOUT,
            )
            .await
        {
            Ok(info) => info,
            Err(err) => {
                tracing::debug!(socket = %socket.display(),
                    "failed to get plugin info using RPC GetInfo: {err}");
                return false;
            }
        };
        let verdict = self.judge_plugin(socket, &info);
        // As the kubelet: the plugin is registered (the kubelet calls it) before it is told so.
        let (registered, error) = match verdict {
            Ok(reg) => {
                tracing::info!(node = %self.config.node_name, driver = %reg.driver,
                    version = reg.version.short_name(), "plugin registered");
                let mut state = self.state.lock().unwrap();
                state.registrations_accepted += 1;
                let mut reg = reg;
                reg.sequence = state.registrations_accepted;
                state.standby.retain(|r| r.socket != reg.socket);
                let driver = reg.driver.clone();
                let plugin = self.plugin_for(reg);
                if let Some(mut old) = state.plugins.insert(driver.clone(), plugin) {
                    if let Some(task) = old.health_task.take() {
                        task.abort();
                    }
                    let replaced_by = &state.plugins[&old.registration.driver].registration;
                    if old.registration.socket != replaced_by.socket {
                        state.standby.push(old.registration);
                    }
                }
                state.record_current(&driver);
                (true, String::new())
            }
            Err(error) => {
                tracing::warn!(socket = %socket.display(), "plugin rejected: {error}");
                self.state.lock().unwrap().rejections.push(Rejection {
                    socket: socket.to_path_buf(),
                    error: error.clone(),
                });
                (false, error)
            }
        };
        let notified: Result<registration::RegistrationStatusResponse, _> = conn
            .unary(
                NOTIFY_REGISTRATION_STATUS,
                &registration::RegistrationStatus {
                    plugin_registered: registered,
                    error,
                },
                REGISTRATION_CALL_TIMEOUT,
            )
            .await;
        if let Err(err) = notified {
            tracing::warn!(socket = %socket.display(), "NotifyRegistrationStatus failed: {err}");
        }
        true
    }

    fn judge_plugin(
        &self,
        socket: &Path,
        info: &registration::PluginInfo,
    ) -> Result<Registration, String> {
        if info.r#type != gpupool_proto::DRA_PLUGIN_TYPE {
            return Err(format!(
                "plugin type {:?} is not supported (want {:?})",
                info.r#type,
                gpupool_proto::DRA_PLUGIN_TYPE
            ));
        }
        if info.name.is_empty() {
            return Err("plugin name is empty".to_string());
        }
        if info.endpoint.is_empty() {
            return Err(format!("plugin {} advertised no endpoint", info.name));
        }
        let version = pick_version(&self.config.known_versions, &info.supported_versions)
            .ok_or_else(|| {
                format!(
                    "none of the versions supported by plugin {} ({:?}) is known to this kubelet ({:?})",
                    info.name, info.supported_versions, self.config.known_versions
                )
            })?;
        Ok(Registration {
            driver: info.name.clone(),
            socket: socket.to_path_buf(),
            endpoint: PathBuf::from(&info.endpoint),
            version,
            advertised_versions: info.supported_versions.clone(),
            health_advertised: info
                .supported_versions
                .iter()
                .any(|v| v == gpupool_proto::versions::HEALTH_V1ALPHA1),
            sequence: 0,
        })
    }

    async fn watch_health(self: Arc<Self>, driver: String, endpoint: PathBuf) {
        use health_v1alpha1::dra_resource_health_client::DraResourceHealthClient;
        loop {
            // A stream has no call timeout: it lives as long as the plugin.
            let channel = connect_unix_lazy(&endpoint, Duration::from_secs(24 * 3600));
            let mut client = DraResourceHealthClient::new(channel);
            if let Ok(response) = client
                .node_watch_resources(health_v1alpha1::NodeWatchResourcesRequest {})
                .await
            {
                let mut stream = response.into_inner();
                while let Ok(Some(update)) = stream.message().await {
                    self.cache_health(&driver, &update);
                }
                // The kubelet forgets a driver's device health when its stream ends.
                self.state.lock().unwrap().health_cache.remove(&driver);
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Merges one report into the health cache as the kubelet does: reported devices are fresh
    /// as of now; devices missing from the report keep what they had until it times out.
    fn cache_health(&self, driver: &str, update: &health_v1alpha1::NodeWatchResourcesResponse) {
        let now = Instant::now();
        let mut state = self.state.lock().unwrap();
        let cache = state.health_cache.entry(driver.to_string()).or_default();
        for device in &update.devices {
            let Some(id) = &device.device else { continue };
            let valid_for = u64::try_from(device.health_check_timeout_seconds)
                .ok()
                .filter(|s| *s > 0)
                .map_or(self.config.health_timeout, Duration::from_secs);
            cache.insert(
                (id.pool_name.clone(), id.device_name.clone()),
                CachedHealth {
                    report: DeviceHealthReport {
                        pool_name: id.pool_name.clone(),
                        device_name: id.device_name.clone(),
                        health: device.health(),
                        last_updated_time: device.last_updated_time,
                        message: device.message.clone(),
                    },
                    received: now,
                    valid_for,
                },
            );
        }
    }

    /// The health the kubelet would show for a device now: `Unknown` when never reported or
    /// when the last report is older than its timeout.
    fn current_health(
        &self,
        state: &State,
        driver: &str,
        pool: &str,
        device: &str,
    ) -> health_v1alpha1::HealthStatus {
        state
            .health_cache
            .get(driver)
            .and_then(|devices| devices.get(&(pool.to_string(), device.to_string())))
            .filter(|cached| cached.received.elapsed() <= cached.valid_for)
            .map_or(health_v1alpha1::HealthStatus::Unknown, |cached| {
                cached.report.health
            })
    }

    /// The devices prepared for the claim `namespace/name` with their health, or `None` when the
    /// kubelet has not prepared that claim.
    fn claim_health(&self, namespace: &str, name: &str) -> Option<Vec<ResourceHealth>> {
        let state = self.state.lock().unwrap();
        let prepared = state
            .prepared
            .values()
            .find(|p| p.claim.namespace == namespace && p.claim.name == name)?;
        let by_driver = state.prepared_by_driver.get(&prepared.claim.uid)?;
        Some(
            by_driver
                .iter()
                .flat_map(|(driver, devices)| devices.iter().map(move |d| (driver.as_str(), d)))
                .map(|(driver, d)| {
                    let health = self.current_health(&state, driver, &d.pool_name, &d.device_name);
                    resource_health(
                        driver,
                        &d.pool_name,
                        &d.device_name,
                        &d.cdi_device_ids,
                        health,
                    )
                })
                .collect(),
        )
    }

    fn plugin_channel(&self, driver: &str) -> Result<(Channel, DraVersion), KubeletError> {
        let state = self.state.lock().unwrap();
        let plugin = state
            .plugins
            .get(driver)
            .ok_or_else(|| KubeletError::NotRegistered(driver.to_string()))?;
        Ok((plugin.channel.clone(), plugin.registration.version))
    }

    async fn call_prepare(
        &self,
        driver: &str,
        claims: &[ClaimRef],
    ) -> Result<PrepareOutcome, KubeletError> {
        let (channel, version) = self.plugin_channel(driver)?;
        let outcome = match version {
            DraVersion::V1 => dra_calls_v1::prepare(channel, claims).await,
            DraVersion::V1beta1 => dra_calls_v1beta1::prepare(channel, claims).await,
        };
        outcome.map_err(|status| KubeletError::Rpc {
            driver: driver.to_string(),
            call: "NodePrepareResources",
            status,
        })
    }

    async fn call_unprepare(
        &self,
        driver: &str,
        claims: &[ClaimRef],
    ) -> Result<UnprepareOutcome, KubeletError> {
        let (channel, version) = self.plugin_channel(driver)?;
        let outcome = match version {
            DraVersion::V1 => dra_calls_v1::unprepare(channel, claims).await,
            DraVersion::V1beta1 => dra_calls_v1beta1::unprepare(channel, claims).await,
        };
        outcome.map_err(|status| KubeletError::Rpc {
            driver: driver.to_string(),
            call: "NodeUnprepareResources",
            status,
        })
    }

    async fn sync_pods(&self) -> Result<(), KubeletError> {
        let pods: Api<Pod> = Api::all(self.client.clone());
        let selector = format!("spec.nodeName={}", self.config.node_name);
        let list = pods
            .list(&ListParams::default().fields(&selector))
            .await
            .map_err(|e| self.kube_err(e))?;
        let mut live = BTreeSet::new();
        for pod in &list.items {
            // Guard against a server that ignores the field selector.
            let on_node = pod.spec.as_ref().and_then(|s| s.node_name.as_deref())
                == Some(self.config.node_name.as_str());
            let Some(uid) = pod.metadata.uid.clone() else {
                continue;
            };
            if !on_node {
                continue;
            }
            if pod.metadata.deletion_timestamp.is_some() {
                self.release_pod(&uid).await;
                let ns = pod.metadata.namespace.clone().unwrap_or_default();
                let name = pod.metadata.name.clone().unwrap_or_default();
                let api: Api<Pod> = Api::namespaced(self.client.clone(), &ns);
                // What the kubelet does once the containers are gone: finish the deletion.
                let _ = api
                    .delete(&name, &DeleteParams::default().grace_period(0))
                    .await;
                continue;
            }
            live.insert(uid.clone());
            let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
            if matches!(phase, Some("Succeeded") | Some("Failed")) {
                continue;
            }
            let (due, running) = {
                let state = self.state.lock().unwrap();
                match state.pods.get(&uid) {
                    Some(record) if record.running => (false, true),
                    Some(record) => (
                        record.next_attempt.is_none_or(|t| Instant::now() >= t),
                        false,
                    ),
                    None => (true, false),
                }
            };
            if due {
                self.start_pod(pod, &uid).await;
            } else if running {
                self.refresh_container_statuses(pod, &uid).await;
            }
        }
        let gone: Vec<String> = {
            let state = self.state.lock().unwrap();
            state
                .pods
                .keys()
                .filter(|uid| !live.contains(*uid))
                .cloned()
                .collect()
        };
        for uid in gone {
            self.release_pod(&uid).await;
        }
        self.unprepare_unused().await;
        Ok(())
    }

    /// Prepares the claims of a pod that has them all allocated and reserved, then marks it running.
    async fn start_pod(&self, pod: &Pod, pod_uid: &str) {
        let namespace = pod.metadata.namespace.clone().unwrap_or_default();
        let name = pod.metadata.name.clone().unwrap_or_default();
        {
            let mut state = self.state.lock().unwrap();
            let record = state.pods.entry(pod_uid.to_string()).or_default();
            record.namespace = namespace.clone();
            record.name = name.clone();
        }
        // Pods without claims run at once; pods with claims wait until the scheduler is done with them.
        let Ok(claim_names) = pod_claim_names(pod) else {
            return;
        };
        let claims_api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &namespace);
        let mut ready: Vec<(ClaimRef, BTreeSet<String>)> = Vec::new();
        for claim_name in &claim_names {
            let Ok(Some(claim)) = claims_api.get_opt(claim_name).await else {
                return;
            };
            match claim_ready_for_pod(&claim, pod_uid) {
                Ok(drivers) => ready.push((ClaimRef::of(&claim), drivers)),
                Err(_) => return,
            }
        }

        let mut errors: Vec<String> = Vec::new();
        let mut by_driver: BTreeMap<String, Vec<ClaimRef>> = BTreeMap::new();
        for (claim, drivers) in &ready {
            let already = self.state.lock().unwrap().prepared.contains_key(&claim.uid);
            if already {
                self.attach(pod_uid, claim, None, Vec::new());
                continue;
            }
            for driver in drivers {
                by_driver
                    .entry(driver.clone())
                    .or_default()
                    .push(claim.clone());
            }
        }
        for (driver, claims) in by_driver {
            match self.call_prepare(&driver, &claims).await {
                Ok(outcome) => {
                    for claim in &claims {
                        match outcome.get(&claim.uid) {
                            Some(Ok(devices)) => {
                                self.attach(pod_uid, claim, Some(&driver), devices.clone())
                            }
                            Some(Err(error)) => errors.push(format!(
                                "prepare dynamic resources: NodePrepareResources failed for ResourceClaim {}: {error}",
                                claim.name
                            )),
                            None => errors.push(format!(
                                "prepare dynamic resources: NodePrepareResources skipped 1 ResourceClaim {}",
                                claim.name
                            )),
                        }
                    }
                }
                Err(err) => errors.push(format!(
                    "prepare dynamic resources: NodePrepareResources for claims {:?}: {err}",
                    claims.iter().map(|c| c.name.as_str()).collect::<Vec<_>>()
                )),
            }
        }

        if errors.is_empty() {
            let started_at = now_time();
            let statuses = self.container_statuses(pod, &started_at);
            if let Err(err) = self.mark_running(pod, &started_at, &statuses).await {
                tracing::warn!(pod = %name, "marking pod running: {err}");
                return;
            }
            let mut state = self.state.lock().unwrap();
            if let Some(record) = state.pods.get_mut(pod_uid) {
                record.running = true;
                record.last_error = None;
                record.started_at = Some(started_at);
                record.written_statuses = Some(statuses);
            }
        } else {
            let message = errors.join("; ");
            let attempts = {
                let mut state = self.state.lock().unwrap();
                let record = state.pods.entry(pod_uid.to_string()).or_default();
                record.attempts += 1;
                record.next_attempt = Some(Instant::now() + retry_backoff(record.attempts));
                record.last_error = Some(message.clone());
                record.attempts
            };
            tracing::info!(pod = %name, attempts, "{message}");
            if let Err(err) = self.post_pod_event(pod, &message).await {
                tracing::warn!(pod = %name, "posting event: {err}");
            }
        }
    }

    fn attach(
        &self,
        pod_uid: &str,
        claim: &ClaimRef,
        driver: Option<&str>,
        devices: Vec<PreparedDevice>,
    ) {
        let mut state = self.state.lock().unwrap();
        let entry = state
            .prepared
            .entry(claim.uid.clone())
            .or_insert_with(|| PreparedClaim {
                claim: claim.clone(),
                devices: Vec::new(),
                pod_uids: BTreeSet::new(),
                drivers: BTreeSet::new(),
            });
        entry.devices.extend(devices.iter().cloned());
        entry.pod_uids.insert(pod_uid.to_string());
        entry.drivers.extend(driver.map(str::to_string));
        if let Some(driver) = driver {
            state
                .prepared_by_driver
                .entry(claim.uid.clone())
                .or_default()
                .entry(driver.to_string())
                .or_default()
                .extend(devices);
        }
        if let Some(record) = state.pods.get_mut(pod_uid) {
            record.claim_uids.insert(claim.uid.clone());
        }
    }

    /// Forgets a pod; its claims that no other pod on the node uses are unprepared.
    async fn release_pod(&self, pod_uid: &str) {
        {
            let mut state = self.state.lock().unwrap();
            let Some(record) = state.pods.remove(pod_uid) else {
                return;
            };
            for claim_uid in record.claim_uids {
                if let Some(prepared) = state.prepared.get_mut(&claim_uid) {
                    prepared.pod_uids.remove(pod_uid);
                }
            }
        }
        self.unprepare_unused().await;
    }

    /// Unprepares every claim no pod uses any more; one that fails (a driver away) stays and is tried
    /// again on the next pass, as the kubelet does.
    async fn unprepare_unused(&self) {
        let unused: Vec<PreparedClaim> = {
            let state = self.state.lock().unwrap();
            state
                .prepared
                .values()
                .filter(|p| p.pod_uids.is_empty())
                .cloned()
                .collect()
        };
        for prepared in unused {
            let claim = &prepared.claim;
            let mut failed = false;
            for driver in &prepared.drivers {
                match self
                    .call_unprepare(driver, std::slice::from_ref(claim))
                    .await
                {
                    Ok(outcome) => {
                        if let Some(Err(error)) = outcome.get(&claim.uid) {
                            tracing::warn!(claim = %claim.name, %driver, "unprepare: {error}");
                            failed = true;
                        }
                    }
                    Err(err) => {
                        tracing::warn!(claim = %claim.name, %driver, "unprepare: {err}");
                        failed = true;
                    }
                }
            }
            if !failed {
                // Pod sync is one sequential loop, so no pod took the claim up meanwhile.
                let mut state = self.state.lock().unwrap();
                state.prepared.remove(&claim.uid);
                state.prepared_by_driver.remove(&claim.uid);
            }
        }
    }

    /// `status.containerStatuses` of a running pod as JSON, with the device health of now.
    fn container_statuses(&self, pod: &Pod, started_at: &Time) -> serde_json::Value {
        let namespace = pod.metadata.namespace.as_deref().unwrap_or_default();
        let lookup = |claim: &str| self.claim_health(namespace, claim);
        serde_json::to_value(running_container_statuses(pod, started_at, &lookup))
            .expect("container statuses serialize")
    }

    /// Writes the container statuses of a running pod again when they changed: device health
    /// reported, changed, or timed out.
    async fn refresh_container_statuses(&self, pod: &Pod, pod_uid: &str) {
        let (started_at, written) = {
            let state = self.state.lock().unwrap();
            let Some(record) = state.pods.get(pod_uid) else {
                return;
            };
            let Some(started_at) = record.started_at.clone() else {
                return;
            };
            (started_at, record.written_statuses.clone())
        };
        let statuses = self.container_statuses(pod, &started_at);
        if written.as_ref() == Some(&statuses) {
            return;
        }
        let namespace = pod.metadata.namespace.clone().unwrap_or_default();
        let name = pod.metadata.name.clone().unwrap_or_default();
        let patch = json!({"status": {"containerStatuses": statuses}});
        match self.patch_pod_status(&namespace, &name, &patch).await {
            Ok(()) => {
                let mut state = self.state.lock().unwrap();
                if let Some(record) = state.pods.get_mut(pod_uid) {
                    record.written_statuses = Some(statuses);
                }
            }
            Err(err) => tracing::warn!(pod = %name, "updating container statuses: {err}"),
        }
    }

    /// What the kubelet writes once a pod's containers run: phase, IPs, its own conditions (the
    /// others, such as the scheduler's PodScheduled, are kept), and one status per container.
    async fn mark_running(
        &self,
        pod: &Pod,
        started_at: &Time,
        container_statuses: &serde_json::Value,
    ) -> Result<(), kube::Error> {
        let namespace = pod.metadata.namespace.clone().unwrap_or_default();
        let name = pod.metadata.name.clone().unwrap_or_default();
        const KUBELET_CONDITIONS: [&str; 4] = [
            "PodReadyToStartContainers",
            "Initialized",
            "ContainersReady",
            "Ready",
        ];
        let mut conditions: Vec<serde_json::Value> = pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .into_iter()
            .flatten()
            .filter(|c| !KUBELET_CONDITIONS.contains(&c.type_.as_str()))
            .map(|c| serde_json::to_value(c).expect("a condition serializes"))
            .collect();
        conditions.extend(KUBELET_CONDITIONS.iter().map(|type_| {
            json!({"type": type_, "status": "True", "lastProbeTime": null,
                   "lastTransitionTime": started_at})
        }));
        let mut status = json!({
            "phase": "Running",
            "hostIP": "127.0.0.1",
            "hostIPs": [{"ip": "127.0.0.1"}],
            "podIP": "127.0.0.1",
            "podIPs": [{"ip": "127.0.0.1"}],
            "startTime": started_at,
            "conditions": conditions,
            "containerStatuses": container_statuses,
        });
        let init = init_container_statuses(pod, started_at);
        if !init.is_empty() {
            status["initContainerStatuses"] =
                serde_json::to_value(init).expect("container statuses serialize");
        }
        self.patch_pod_status(&namespace, &name, &json!({ "status": status }))
            .await
    }

    async fn patch_pod_status(
        &self,
        namespace: &str,
        name: &str,
        patch: &serde_json::Value,
    ) -> Result<(), kube::Error> {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        match api
            .patch_status(name, &PatchParams::default(), &Patch::Merge(patch))
            .await
        {
            Ok(_) => Ok(()),
            // A server without the pods/status subresource takes the status on the object itself.
            Err(err)
                if is_not_found(&err) || matches!(&err, kube::Error::Api(s) if s.code == 405) =>
            {
                api.patch(name, &PatchParams::default(), &Patch::Merge(patch))
                    .await
                    .map(|_| ())
            }
            Err(err) => Err(err),
        }
    }

    async fn post_pod_event(&self, pod: &Pod, message: &str) -> Result<(), kube::Error> {
        let namespace = pod.metadata.namespace.clone().unwrap_or_default();
        let name = pod.metadata.name.clone().unwrap_or_default();
        let now = now_time();
        let event = Event {
            metadata: ObjectMeta {
                name: Some(format!("{name}.{}", uuid::Uuid::new_v4().simple())),
                namespace: Some(namespace.clone()),
                ..Default::default()
            },
            involved_object: ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                name: Some(name),
                namespace: Some(namespace.clone()),
                uid: pod.metadata.uid.clone(),
                ..Default::default()
            },
            reason: Some(FAILED_PREPARE_REASON.into()),
            message: Some(message.to_string()),
            type_: Some("Warning".into()),
            count: Some(1),
            first_timestamp: Some(now.clone()),
            last_timestamp: Some(now.clone()),
            event_time: None::<MicroTime>,
            reporting_component: Some("kubelet".into()),
            reporting_instance: Some(self.config.node_name.clone()),
            source: Some(k8s_openapi::api::core::v1::EventSource {
                component: Some("kubelet".into()),
                host: Some(self.config.node_name.clone()),
            }),
            ..Default::default()
        };
        let api: Api<Event> = Api::namespaced(self.client.clone(), &namespace);
        api.create(&PostParams::default(), &event).await.map(|_| ())
    }
}

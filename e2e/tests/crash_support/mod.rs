//! A node for the crash, outage and hostile-input scenarios: the API server emulator, a kubelet
//! emulator that only does what the test tells it, and the real `gpupool-driver` started by the
//! test, where every start carries its own environment (an armed fault point, a boot id) and can be
//! killed at will. The environment goes to that one process, never to the test process's, which
//! every test running in parallel in the binary shares.
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::time::{Duration, Instant};

use gpupool_api::claim::{ClaimRef, PreparedDevice};
use gpupool_apiserver::ApiServer;
use gpupool_e2e::harness::{
    client_for_kubeconfig, create_namespace, events_about, find_binary, node_slices,
    service_account_kubeconfig, start_api_emulator, wait_for_every, ManagedProcess, NodeDirs,
    DRIVER_BIN, DRIVER_SERVICE_ACCOUNT,
};
use gpupool_e2e::kubelet::{
    Kubelet, KubeletConfig, KubeletError, PrepareOutcome, UnprepareOutcome,
};
use k8s_openapi::api::core::v1::Event;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::{json, Value};

pub const DRIVER: &str = gpupool_api::names::DRIVER_NAME;
// The driver's own names for its files and test hooks: a test that re-declared them would keep
// passing after the driver renamed one.
pub use gpupool_driver::node_state::fault::FAULT_POINT_ENV;
use gpupool_driver::node_state::layout::{CLAIM_FOLDERS, STATE_FILES};
pub use gpupool_driver::node_state::BOOT_ID_ENV;
pub const TIMEOUT: Duration = Duration::from_secs(30);

/// How one start of the driver ended up.
#[derive(Debug)]
pub enum Started {
    /// Registered with the kubelet emulator.
    Registered,
    /// Exited before registering.
    Exited(ExitStatus),
}

pub struct CrashNode {
    pub name: String,
    pub apiserver: ApiServer,
    pub client: Client,
    pub kubelet: Kubelet,
    pub dirs: NodeDirs,
    pub root: PathBuf,
    /// The driver's ServiceAccount, bound to this node.
    driver_kubeconfig: PathBuf,
    lib_dirs: PathBuf,
    binary: PathBuf,
    fake_gpus: String,
    /// The driver of the last start; every start is a new process, all writing to one log.
    driver: ManagedProcess,
    pub boot_id: String,
    _guard: tempfile::TempDir,
}

impl Drop for CrashNode {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.driver.print_log_tail(200);
        }
        self.kill_driver();
    }
}

impl CrashNode {
    /// Starts the API server emulator and the kubelet emulator; the driver is started by the test.
    pub async fn new(name: &str, fake_gpus: &str) -> CrashNode {
        let guard = tempfile::Builder::new()
            .prefix("gpupool-crash-")
            .tempdir()
            .expect("creating the work folder");
        let root = guard.path().to_path_buf();
        let kubeconfig = root.join("kubeconfig");
        let apiserver = start_api_emulator(&kubeconfig)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let client = client_for_kubeconfig(&kubeconfig)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let driver_kubeconfig =
            service_account_kubeconfig(&apiserver, &root, DRIVER_SERVICE_ACCOUNT, Some(name))
                .unwrap_or_else(|e| panic!("{e}"));
        let host = root.join("host");
        let dirs = NodeDirs::under(&host);
        let lib_dirs = host.join("libs");
        for dir in [&dirs.registry, &dirs.plugin, &lib_dirs] {
            std::fs::create_dir_all(dir).expect("creating the node's folders");
        }
        let mut config = KubeletConfig::new(name, &dirs.registry);
        // The test is the kubelet's pod logic: it decides what to prepare and when to retry.
        config.manage_pods = false;
        config.poll_interval = Duration::from_millis(20);
        let kubelet = Kubelet::start(client.clone(), config)
            .await
            .unwrap_or_else(|e| panic!("starting the kubelet emulator: {e}"));
        let binary = find_binary(DRIVER_BIN).unwrap_or_else(|e| panic!("{e}"));
        // Not started: it names the driver and its log until the first start.
        let driver = ManagedProcess::new(
            &format!("{DRIVER_BIN} on {name}"),
            &binary,
            Vec::new(),
            root.join("driver.log"),
        );
        CrashNode {
            name: name.to_string(),
            apiserver,
            client,
            kubelet,
            dirs,
            root,
            driver_kubeconfig,
            lib_dirs,
            binary,
            fake_gpus: fake_gpus.to_string(),
            driver,
            boot_id: uuid::Uuid::new_v4().to_string(),
            _guard: guard,
        }
    }

    /// `new`, with `namespace` created for the test's claims.
    pub async fn with_namespace(name: &str, fake_gpus: &str, namespace: &str) -> CrashNode {
        let node = CrashNode::new(name, fake_gpus).await;
        node.create_namespace(namespace).await;
        node
    }

    /// The `--fake-gpus` profile of the next start (a card added or removed while the driver is down).
    pub fn set_fake_gpus(&mut self, profile: &str) {
        self.fake_gpus = profile.to_string();
    }

    /// The devices `gpupool-driver inspect` says this node's inventory publishes, by name: what the
    /// API should converge to.
    pub fn inventory_devices(&self) -> BTreeMap<String, Value> {
        let output = Command::new(&self.binary)
            .args([
                "inspect",
                "--fake-gpus",
                &self.fake_gpus,
                "--node-name",
                &self.name,
            ])
            .output()
            .expect("running gpupool-driver inspect");
        assert!(
            output.status.success(),
            "gpupool-driver inspect: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let report: Value = serde_yaml::from_slice(&output.stdout).expect("inspect prints YAML");
        devices_by_name(
            report["resourceSlices"]
                .as_array()
                .into_iter()
                .flatten()
                .cloned(),
        )
    }

    /// The devices this node's driver has published, by name, with the pool generation they carry.
    pub async fn published_devices(&self) -> Option<(i64, BTreeMap<String, Value>)> {
        let ours: Vec<Value> = node_slices(&self.client, &self.name)
            .await
            .ok()?
            .into_iter()
            .map(|s| serde_json::to_value(s).expect("a slice serialises"))
            .collect();
        let generation = ours
            .iter()
            .filter_map(|s| s["spec"]["pool"]["generation"].as_i64())
            .max()?;
        // Slices of an older generation are on their way out; the scheduler ignores them too.
        let current = ours
            .into_iter()
            .filter(|s| s["spec"]["pool"]["generation"].as_i64() == Some(generation));
        Some((generation, devices_by_name(current)))
    }

    /// The folder everything of this node lives under (host folders, log, kubeconfig).
    pub fn host_root(&self) -> PathBuf {
        self.root.join("host")
    }

    pub fn log(&self) -> String {
        self.driver.log()
    }

    /// Kills a running driver and starts it again (armed at `fault` when given); waits until it has
    /// registered with the kubelet emulator or exited.
    pub async fn start_driver(&mut self, fault: Option<&str>) -> Started {
        self.start_driver_with(fault.map(|f| (FAULT_POINT_ENV, f)).as_slice())
            .await
    }

    /// `start_driver` with `env` set for this start only (over the boot id, without a fault point).
    pub async fn start_driver_with(&mut self, env: &[(&str, &str)]) -> Started {
        self.kill_driver();
        let before = self.kubelet.registration(DRIVER).map_or(0, |r| r.sequence);
        let args = self.dirs.driver_run_args(
            &self.name,
            &self.driver_kubeconfig,
            &self.fake_gpus,
            &self.lib_dirs,
        );
        let mut driver = ManagedProcess::new(
            self.driver.name(),
            &self.binary,
            args,
            self.driver.log_path().to_path_buf(),
        )
        .env(BOOT_ID_ENV, &self.boot_id)
        .env_remove(FAULT_POINT_ENV);
        for (key, value) in env {
            driver = driver.env(*key, *value);
        }
        self.driver = driver.started().unwrap_or_else(|e| panic!("{e}"));
        let started = wait_for_every(
            Duration::from_millis(10),
            "the driver to register",
            TIMEOUT,
            || {
                let started = match self.driver.exit_status() {
                    Some(status) => Some(Started::Exited(status)),
                    None => self
                        .kubelet
                        .registration(DRIVER)
                        .is_some_and(|r| r.sequence > before)
                        .then_some(Started::Registered),
                };
                std::future::ready(started)
            },
        )
        .await;
        started.unwrap_or_else(|e| panic!("{e}\n{}", self.log()))
    }

    /// Starts the driver unarmed and panics (with its log) unless it registers.
    pub async fn start_driver_ok(&mut self) {
        if let Started::Exited(status) = self.start_driver(None).await {
            panic!("the driver exited at start ({status})\n{}", self.log());
        }
    }

    pub fn is_running(&mut self) -> bool {
        self.driver.is_running()
    }

    /// Waits up to `timeout` for the driver to exit on its own.
    pub async fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        self.driver.wait_exit(timeout).await
    }

    /// SIGKILL (a crash); nothing is cleaned up.
    pub fn kill_driver(&mut self) {
        self.driver.kill();
    }

    /// SIGTERM and wait for the driver to exit (it removes its sockets).
    pub async fn stop_driver(&mut self) -> Option<ExitStatus> {
        self.driver.stop(Duration::from_secs(15)).await
    }

    pub async fn create_namespace(&self, name: &str) {
        create_namespace(&self.client, name)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }

    /// Creates a claim and writes its allocation, as the scheduler would; `results` and `config` are
    /// `status.allocation.devices.results` / `.config`.
    pub async fn create_allocated_claim(
        &self,
        namespace: &str,
        name: &str,
        results: Vec<Value>,
        config: Vec<Value>,
    ) -> ClaimRef {
        let requests: BTreeSet<String> = results
            .iter()
            .filter_map(|r| r["request"].as_str().map(str::to_string))
            .collect();
        let claim: ResourceClaim = serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"devices": {"requests": requests.iter().map(|r| json!({
                "name": r, "exactly": {"deviceClassName": "gpu.gpupool.dev"}
            })).collect::<Vec<_>>()}},
        }))
        .expect("claim literal");
        let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), namespace);
        let created = api
            .create(&PostParams::default(), &claim)
            .await
            .unwrap_or_else(|e| panic!("creating claim {namespace}/{name}: {e}"));
        // The scheduler allocates a node's devices with a node selector for that node, which is
        // also what lets the driver's token write the claim's status (associated-node).
        let patch = json!({"status": {"allocation": {
            "devices": {"results": results, "config": config},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [self.name]}]}]},
        }}});
        api.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap_or_else(|e| panic!("allocating claim {namespace}/{name}: {e}"));
        ClaimRef::of(&created)
    }

    /// `create_allocated_claim` of one request `gpu0` for `device` of this node, without config: a
    /// share of (memory, cores), or the whole card.
    pub async fn create_claim_on(
        &self,
        namespace: &str,
        name: &str,
        device: &str,
        share: Option<(&str, &str)>,
    ) -> ClaimRef {
        let (memory, cores) = share.unzip();
        let results = vec![result("gpu0", &self.name, device, memory, cores)];
        self.create_allocated_claim(namespace, name, results, Vec::new())
            .await
    }

    /// NodePrepareResources through the kubelet emulator, retried while the driver is unreachable
    /// (restarting, not registered yet), as the kubelet does.
    pub async fn prepare_retrying(&self, claims: &[ClaimRef]) -> PrepareOutcome {
        self.retrying("NodePrepareResources", || {
            self.kubelet.prepare(DRIVER, claims)
        })
        .await
    }

    pub async fn unprepare_retrying(&self, claims: &[ClaimRef]) -> UnprepareOutcome {
        self.retrying("NodeUnprepareResources", || {
            self.kubelet.unprepare(DRIVER, claims)
        })
        .await
    }

    async fn retrying<T, F, Fut>(&self, call: &str, mut attempt: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, KubeletError>>,
    {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            match attempt().await {
                Ok(outcome) => return outcome,
                Err(e) if Instant::now() < deadline && is_transient(&e) => {
                    tokio::time::sleep(Duration::from_millis(20)).await
                }
                Err(e) => panic!("{call} kept failing: {e}\n{}", self.log()),
            }
        }
    }

    /// Events about a claim (PrepareFailed and the like).
    pub async fn claim_events(&self, namespace: &str, name: &str) -> Vec<Event> {
        events_about(&self.client, Some(namespace), "ResourceClaim", name).await
    }

    /// Warning Events about this Node.
    pub async fn node_events(&self) -> Vec<Event> {
        events_about(&self.client, None, "Node", &self.name).await
    }

    /// The checkpoint's data (`bootId`, `claims`) as the driver reads it: the snapshot with its
    /// log replayed.
    pub fn checkpoint(&self) -> Option<Value> {
        let data = gpupool_driver::node_state::checkpoint::load(&self.dirs.state).ok()??;
        serde_json::to_value(data).ok()
    }

    /// The checkpoint's entries by claim uid.
    fn checkpoint_entries(&self) -> Result<serde_json::Map<String, Value>, String> {
        let checkpoint = self
            .checkpoint()
            .ok_or_else(|| "no readable checkpoint in the state folder".to_string())?;
        Ok(checkpoint["claims"]
            .as_object()
            .cloned()
            .unwrap_or_default())
    }

    /// What start-up reconciliation must leave, whatever the kubelet believes: only completed
    /// checkpoint entries, exactly one spec per entry, no temp or foreign files in either folder.
    pub fn check_reconciled(&self) -> Result<(), String> {
        let mut problems = Vec::new();
        let entries = self.checkpoint_entries()?;
        for (uid, entry) in &entries {
            if entry["state"] != "PrepareCompleted" {
                problems.push(format!(
                    "claim {uid}: entry left in state {}",
                    entry["state"]
                ));
            }
        }
        let expected: BTreeSet<String> = entries
            .keys()
            .map(|uid| gpupool_api::names::cdi_spec_file_name(uid))
            .collect();
        let present: BTreeSet<String> = list_dir(&self.dirs.cdi).into_iter().collect();
        for name in present.difference(&expected) {
            problems.push(format!("CDI folder: {name} without a completed entry"));
        }
        for name in expected.difference(&present) {
            problems.push(format!("CDI folder: no {name} for a completed entry"));
        }
        self.unexpected_state_files(&mut problems);
        for (kind, claim_dir) in self.claim_dirs() {
            if !entries.contains_key(&claim_dir) {
                problems.push(format!(
                    "run folder: {kind}/{claim_dir} without a completed entry"
                ));
            }
        }
        self.check_mig_instances(&entries, &mut problems);
        none_or_all(problems)
    }

    /// Every MIG instance on the fake cards belongs to an entry that records it (GPU and compute
    /// instance), and every MIG device an entry records exists.
    fn check_mig_instances(
        &self,
        entries: &serde_json::Map<String, Value>,
        problems: &mut Vec<String>,
    ) {
        let recorded: BTreeSet<(String, u64, u64)> = entries
            .values()
            .flat_map(|e| e["mig"].as_array().cloned().unwrap_or_default())
            .filter_map(|r| {
                Some((
                    r["parentUuid"].as_str()?.to_string(),
                    r["gpuInstance"].as_u64()?,
                    r["computeInstance"].as_u64()?,
                ))
            })
            .collect();
        let present: BTreeSet<(String, u64, u64)> = mig_instances(&self.dirs.run)
            .into_iter()
            .flat_map(|(card, gi, cis)| {
                if cis.is_empty() {
                    problems.push(format!(
                        "MIG: GPU instance {gi} on {card} has no compute instance (a half-made instance)"
                    ));
                }
                cis.into_iter()
                    .map(move |ci| (card.clone(), u64::from(gi), u64::from(ci)))
            })
            .collect();
        for (card, gi, ci) in present.difference(&recorded) {
            problems.push(format!(
                "MIG: GPU instance {gi} / compute instance {ci} on {card} no checkpoint entry accounts for"
            ));
        }
        for (card, gi, ci) in recorded.difference(&present) {
            problems.push(format!(
                "MIG: a checkpoint entry records GPU instance {gi} / compute instance {ci} on {card}, which does not exist"
            ));
        }
    }

    /// A problem for each file of the state folder the driver does not declare.
    fn unexpected_state_files(&self, problems: &mut Vec<String>) {
        for name in list_dir(&self.dirs.state) {
            if !STATE_FILES.contains(&name.as_str()) {
                problems.push(format!("state folder: unexpected file {name}"));
            }
        }
    }

    /// Every per-claim folder in the run folder: (its kind's folder, the claim's).
    fn claim_dirs(&self) -> Vec<(&'static str, String)> {
        CLAIM_FOLDERS
            .iter()
            .map(|k| k.dir_name())
            .flat_map(|kind| {
                list_dir(&self.dirs.run.join(kind))
                    .into_iter()
                    .map(move |claim_dir| (kind, claim_dir))
            })
            .collect()
    }

    /// Checks the node's folders against what the kubelet believes prepared (claim uid -> the CDI
    /// ids it was answered): each such claim has exactly one valid spec naming those ids and a
    /// `PrepareCompleted` entry with the same ids; nothing else is in the CDI and state folders.
    pub fn check_files(&self, believed: &BTreeMap<String, Vec<String>>) -> Result<(), String> {
        let mut problems = Vec::new();
        let entries = self.checkpoint_entries()?;

        let mut expected_files: BTreeSet<String> = BTreeSet::new();
        for (uid, ids) in believed {
            let file = gpupool_api::names::cdi_spec_file_name(uid);
            expected_files.insert(file.clone());
            match read_spec(&self.dirs.cdi.join(&file)) {
                Err(e) => problems.push(format!("claim {uid}: {e}")),
                Ok(spec) => {
                    let errors = gpupool_api::cdi::validate(&spec);
                    if !errors.is_empty() {
                        problems.push(format!("claim {uid}: invalid CDI spec: {errors:?}"));
                    }
                    let in_spec: BTreeSet<String> = spec
                        .devices
                        .iter()
                        .map(|d| gpupool_api::names::cdi_device_id(&d.name))
                        .collect();
                    let answered: BTreeSet<String> = ids.iter().cloned().collect();
                    if in_spec != answered {
                        problems.push(format!(
                            "claim {uid}: the spec has {in_spec:?}, the kubelet was answered {answered:?}"
                        ));
                    }
                }
            }
            match entries.get(uid) {
                None => problems.push(format!("claim {uid}: no checkpoint entry")),
                Some(entry) => {
                    if entry["state"] != "PrepareCompleted" {
                        problems.push(format!(
                            "claim {uid}: checkpoint state {}, expected PrepareCompleted",
                            entry["state"]
                        ));
                    }
                    let recorded: Vec<String> = entry["devices"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .flat_map(|d| d["cdiDeviceIds"].as_array().cloned().unwrap_or_default())
                        .filter_map(|id| id.as_str().map(str::to_string))
                        .collect();
                    if &recorded != ids {
                        problems.push(format!(
                            "claim {uid}: the checkpoint recorded {recorded:?}, the kubelet was answered {ids:?}"
                        ));
                    }
                }
            }
        }
        for uid in entries.keys().filter(|u| !believed.contains_key(*u)) {
            problems.push(format!(
                "claim {uid}: checkpoint entry {} for a claim the kubelet believes unprepared",
                entries[uid]["state"]
            ));
        }
        for name in list_dir(&self.dirs.cdi) {
            if !expected_files.contains(&name) {
                problems.push(format!("CDI folder: unexpected file {name}"));
            }
        }
        self.unexpected_state_files(&mut problems);
        // Besides the cache folders the run folder holds the driver's health socket and, once a
        // device had a fault, the faults it keeps across restarts.
        let run_files: Vec<&str> = CLAIM_FOLDERS
            .iter()
            .map(|k| k.dir_name())
            .chain([
                gpupool_driver::health::monitor::STATE_FILE,
                // Where the fake cards keep their MIG instances (a real card keeps them itself).
                gpupool_driver::mig::fake::STATE_FILE,
                // The MPS daemons' folders, one per card (checked by the MPS tests).
                gpupool_driver::mps::layout::MPS_DIR,
                // The cards' arbiter files (checked below).
                gpupool_driver::node_state::layout::ARBITER_DIR_NAME,
            ])
            .collect();
        // A card's arbiter is a plain file named by the card's UUID, writable by every container
        // user, and nothing else is there.
        let arbiters = self
            .dirs
            .run
            .join(gpupool_driver::node_state::layout::ARBITER_DIR_NAME);
        for name in list_dir(&arbiters) {
            let meta = std::fs::symlink_metadata(arbiters.join(&name));
            let plain = meta.as_ref().is_ok_and(|m| {
                use std::os::unix::fs::PermissionsExt;
                m.is_file() && m.permissions().mode() & 0o7777 == 0o666
            });
            if !name.starts_with("GPU-") || !plain {
                problems.push(format!("run folder: unexpected arbiter {name} ({meta:?})"));
            }
        }
        for name in list_dir(&self.dirs.run) {
            if !run_files.contains(&name.as_str())
                && !gpupool_driver::health::inject::is_socket_name(&name)
            {
                problems.push(format!("run folder: unexpected file {name}"));
            }
        }
        for (kind, claim_dir) in self.claim_dirs() {
            if !believed.contains_key(&claim_dir) {
                problems.push(format!("run folder: leftover {kind}/{claim_dir}"));
            }
        }
        self.check_mig_instances(&entries, &mut problems);
        none_or_all(problems)
    }
}

/// `Ok` without problems, else all of them, a line each.
fn none_or_all(problems: Vec<String>) -> Result<(), String> {
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("\n"))
    }
}

fn read_spec(path: &Path) -> Result<gpupool_api::cdi::Spec, String> {
    let bytes =
        std::fs::read(path).map_err(|e| format!("no CDI spec at {}: {e}", path.display()))?;
    serde_json::from_slice(&bytes).map_err(|e| format!("{}: not a CDI spec: {e}", path.display()))
}

/// Devices of slices by name, reduced to what the inventory decides (name, attributes, capacity).
fn devices_by_name(slices: impl Iterator<Item = Value>) -> BTreeMap<String, Value> {
    slices
        .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
        .map(|d| {
            let name = d["name"].as_str().unwrap_or_default().to_string();
            let capacity: BTreeMap<String, Value> = d["capacity"]
                .as_object()
                .into_iter()
                .flatten()
                .map(|(k, v)| (k.clone(), v["value"].clone()))
                .collect();
            let reduced = json!({"attributes": d["attributes"], "capacity": capacity});
            (name, reduced)
        })
        .collect()
}

/// File names in a folder, sorted (empty when it does not exist).
pub fn list_dir(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// Every path under `root` (files and folders, relative), for before/after comparisons.
pub fn walk(root: &Path) -> BTreeSet<PathBuf> {
    let mut out = BTreeSet::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if let Ok(relative) = path.strip_prefix(root) {
                out.insert(relative.to_path_buf());
            }
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(path);
            }
        }
    }
    out
}

/// The kubelet retries a call that did not reach the plugin or whose connection broke.
fn is_transient(err: &KubeletError) -> bool {
    matches!(
        err,
        KubeletError::NotRegistered(_) | KubeletError::Rpc { .. } | KubeletError::Grpc(_)
    )
}

/// Whether the process ended by SIGKILL (a fault point fired).
pub fn killed(status: &ExitStatus) -> bool {
    status.signal() == Some(libc::SIGKILL)
}

/// All CDI device ids of a prepare answer.
pub fn cdi_ids(devices: &[PreparedDevice]) -> Vec<String> {
    devices
        .iter()
        .flat_map(|d| d.cdi_device_ids.iter().cloned())
        .collect()
}

/// One allocation result of this driver on `pool` for an exclusive device (a MIG device): no
/// share id, no consumed capacity.
pub fn exclusive_result(request: &str, pool: &str, device: &str) -> Value {
    json!({"request": request, "driver": DRIVER, "pool": pool, "device": device})
}

/// The MIG instances the fake cards hold (card UUID, GPU instance id, its compute instances), as
/// a killed or restarted driver left them.
pub fn mig_instances(run_dir: &Path) -> Vec<(String, u32, Vec<u32>)> {
    gpupool_driver::mig::fake::load(run_dir)
        .cards
        .into_iter()
        .flat_map(|(card, c)| {
            c.gpu_instances.into_iter().map(move |gi| {
                (
                    card.clone(),
                    gi.id,
                    gi.compute_instances.keys().copied().collect(),
                )
            })
        })
        .collect()
}

/// One allocation result of this driver on `pool`: the whole card when `memory` is `None`.
pub fn result(
    request: &str,
    pool: &str,
    device: &str,
    memory: Option<&str>,
    cores: Option<&str>,
) -> Value {
    let mut consumed = serde_json::Map::new();
    if let Some(m) = memory {
        consumed.insert("memory".into(), json!(m));
    }
    if let Some(c) = cores {
        consumed.insert("cores".into(), json!(c));
    }
    let mut result = json!({
        "request": request, "driver": DRIVER, "pool": pool, "device": device,
        "shareID": uuid::Uuid::new_v4().to_string(),
    });
    if !consumed.is_empty() {
        result["consumedCapacity"] = Value::Object(consumed);
    }
    result
}

/// A claim config entry carrying GpuConfig `parameters` for `requests`.
pub fn opaque_config(requests: &[&str], parameters: Value) -> Value {
    json!({
        "source": "FromClaim",
        "requests": requests,
        "opaque": {"driver": DRIVER, "parameters": parameters},
    })
}

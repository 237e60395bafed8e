//! `TestCluster`: the whole system on one machine for e2e tests and the sandbox.
//!
//! Emulated (default): the API server emulator and the scheduler stand-in in process, one kubelet
//! emulator per node, the real `gpupool-driver` per node (fake GPUs, its own folders) and optionally
//! the real `gpupool-controller`. On the control plane ([`Backend::ControlPlane`]): the real
//! kube-apiserver, kube-scheduler and kube-controller-manager the harness starts once per test
//! binary ([`crate::plane`]), hand-made Nodes, the same kubelet emulator (as the node's identity)
//! and the same binaries on their ServiceAccount tokens. With `GPUPOOL_E2E_KUBECONFIG` set: that
//! cluster instead (its kube-scheduler allocates; nodes from `GPUPOOL_E2E_NODE`); the kubelet
//! emulator still drives the driver unless `GPUPOOL_E2E_REAL_KUBELET=1`.

pub mod apply;
pub mod cleanup;
pub mod objects;
pub mod process;
mod upstream;

use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Event, Namespace};
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{ListParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};
use serde_json::Value;

use crate::kubelet::{Kubelet, KubeletConfig, KubeletError, Registration};
use crate::plane::binaries::NodeBinaries;
use crate::plane::real_node::RealNode;
use crate::plane::{ControlPlane, NodeShape, PlaneError, PlaneOptions};
pub use apply::{apply_objects, parse_manifests, ApplyError};
pub use process::{find_binary, print_log_tail, ManagedProcess, ProcessError, Program, Programs};

pub const DRIVER_BIN: &str = "gpupool-driver";
/// What the driver logs when a kubelet tells it it is registered (NotifyRegistrationStatus): how
/// the harness sees a real kubelet's registration, which it cannot ask the kubelet for.
const REGISTERED_LOG_LINE: &str = "registered with kubelet";
pub const CONTROLLER_BIN: &str = "gpupool-controller";
/// The bench's stand-in for a driver on upstream's Go helper (`gpupool-bench`'s reference mode).
pub const REFERENCE_PLUGIN_BIN: &str = "gpupool-reference-plugin";
/// The user agent of the reference plugin's API requests, which the bench counts apart.
pub const REFERENCE_USER_AGENT: &str = "gpupool-reference";

/// Environment that points the harness at a real cluster (see the module docs).
pub mod env {
    pub const KUBECONFIG: &str = "GPUPOOL_E2E_KUBECONFIG";
    pub const NODE: &str = "GPUPOOL_E2E_NODE";
    pub const REAL_KUBELET: &str = "GPUPOOL_E2E_REAL_KUBELET";
    pub const REGISTRY_DIR: &str = "GPUPOOL_E2E_REGISTRY_DIR";
    pub const PLUGIN_DIR: &str = "GPUPOOL_E2E_PLUGIN_DIR";
    pub const CDI_DIR: &str = "GPUPOOL_E2E_CDI_DIR";
}

#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    #[error(transparent)]
    Process(#[from] ProcessError),
    #[error(transparent)]
    Apply(#[from] ApplyError),
    #[error(transparent)]
    Kubelet(#[from] KubeletError),
    #[error("API server emulator: {0}")]
    ApiServer(String),
    #[error("kubeconfig {path}: {message}")]
    Kubeconfig { path: PathBuf, message: String },
    #[error("{what}: {source}")]
    Kube {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("`kubectl {args}` failed ({status}): {stderr}")]
    Kubectl {
        args: String,
        status: String,
        stderr: String,
    },
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout { what: String, after: Duration },
    #[error("no node {0} in this cluster")]
    UnknownNode(String),
    #[error("{0}")]
    Setup(String),
    #[error(transparent)]
    Plane(#[from] PlaneError),
}

fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> HarnessError {
    let what = what.into();
    move |source| HarnessError::Io { what, source }
}

/// One node of the test cluster.
#[derive(Clone, Debug)]
pub struct NodeSpec {
    pub name: String,
    /// `--fake-gpus` profile, e.g. `a100-40gb:2`.
    pub fake_gpus: String,
    /// DRA versions the node's kubelet emulator speaks (default v1 then v1beta1).
    pub kubelet_versions: Option<Vec<String>>,
    /// Extra `gpupool-driver run` arguments.
    pub extra_driver_args: Vec<String>,
    /// How often the kubelet emulator looks at its registry folder and pods (default 100 ms).
    /// The real kubelet's plugin manager reconciles registrations once a second.
    pub kubelet_poll_interval: Option<Duration>,
    /// On the control plane: the real kubelet and containerd drive the driver instead of the
    /// kubelet emulator ([`crate::plane::real_node`]).
    pub real_kubelet: bool,
}

impl NodeSpec {
    pub fn new(name: impl Into<String>, fake_gpus: impl Into<String>) -> Self {
        NodeSpec {
            name: name.into(),
            fake_gpus: fake_gpus.into(),
            kubelet_versions: None,
            extra_driver_args: Vec::new(),
            kubelet_poll_interval: None,
            real_kubelet: false,
        }
    }

    /// Runs this node with the real kubelet and containerd (on the control plane only).
    pub fn with_real_kubelet(mut self) -> Self {
        self.real_kubelet = true;
        self
    }

    pub fn kubelet_versions(mut self, versions: &[&str]) -> Self {
        self.kubelet_versions = Some(versions.iter().map(|s| s.to_string()).collect());
        self
    }
}

/// What to start.
#[derive(Clone, Debug, Default)]
pub struct ClusterSpec {
    pub nodes: Vec<NodeSpec>,
    /// Run the real controller (and install its CRDs).
    pub controller: bool,
    /// Wait this long for each driver to register (default 30 s).
    pub registration_timeout: Option<Duration>,
    /// Where the cluster comes from; by default from the environment (`Backend::from_env`).
    pub backend: Option<Backend>,
    /// Play a cluster without DRAPartitionableDevices (emulator only): slices lose their counters.
    pub without_partitionable_devices: bool,
    /// Where the driver and the controller come from (the workspace's binaries by default).
    pub programs: Programs,
}

impl ClusterSpec {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn node(mut self, name: &str, fake_gpus: &str) -> Self {
        self.nodes.push(NodeSpec::new(name, fake_gpus));
        self
    }

    pub fn with_node(mut self, node: NodeSpec) -> Self {
        self.nodes.push(node);
        self
    }

    pub fn with_controller(mut self) -> Self {
        self.controller = true;
        self
    }

    /// On the emulator, whatever `GPUPOOL_E2E_KUBECONFIG` says.
    pub fn emulated(mut self) -> Self {
        self.backend = Some(Backend::Emulator);
        self
    }

    /// On the real control plane this test binary shares ([`crate::plane::ControlPlane::shared`]).
    pub fn on_control_plane(mut self) -> Self {
        self.backend = Some(Backend::ControlPlane);
        self
    }

    /// On `backend`.
    pub fn on(mut self, backend: Backend) -> Self {
        self.backend = Some(backend);
        self
    }

    /// On an emulator that drops counter sets and consumptions, as a cluster without
    /// partitionable devices does.
    pub fn without_partitionable_devices(mut self) -> Self {
        self.without_partitionable_devices = true;
        self.emulated()
    }
}

/// Where the cluster comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Backend {
    /// The API server emulator and the scheduler stand-in, in process.
    Emulator,
    /// The real kube-apiserver, kube-scheduler and kube-controller-manager, started by the harness.
    ControlPlane,
    /// The cluster `GPUPOOL_E2E_KUBECONFIG` names.
    Real { real_kubelet: bool },
}

impl Backend {
    pub fn from_env() -> Backend {
        match std::env::var_os(env::KUBECONFIG) {
            None => Backend::Emulator,
            Some(_) => Backend::Real {
                real_kubelet: std::env::var(env::REAL_KUBELET)
                    .is_ok_and(|v| v == "1" || v == "true"),
            },
        }
    }
}

/// A node's host folders, as the driver and the kubelet see them.
#[derive(Clone, Debug)]
pub struct NodeDirs {
    pub registry: PathBuf,
    pub plugin: PathBuf,
    pub cdi: PathBuf,
    pub state: PathBuf,
    /// `--run-dir`: per-boot state (HAMi-core's per-claim cache folders).
    pub run: PathBuf,
}

impl NodeDirs {
    /// The folders of a node whose host folders all lie under `base`, named as on a node.
    pub fn under(base: &Path) -> NodeDirs {
        NodeDirs {
            registry: base.join("plugins_registry"),
            plugin: base.join("plugins").join(gpupool_api::names::DRIVER_NAME),
            cdi: base.join("cdi"),
            state: base.join("state"),
            run: base.join("run"),
        }
    }

    /// `gpupool-driver run` for a fake node with these folders: the one command line the harness,
    /// the bench and the crash tests start drivers with. `lib_dirs` holds the node's enforcement
    /// libraries (`gpupool/` and HAMi-core's `vgpu/`): an empty folder means neither is
    /// installed, whatever this host has.
    pub fn driver_run_args(
        &self,
        node: &str,
        kubeconfig: &Path,
        fake_gpus: &str,
        lib_dirs: &Path,
    ) -> Vec<String> {
        let path = |p: &Path| p.display().to_string();
        [
            "run",
            "--node-name",
            node,
            "--kubeconfig",
            &path(kubeconfig),
            "--registry-dir",
            &path(&self.registry),
            "--plugin-dir",
            &path(&self.plugin),
            "--cdi-root",
            &path(&self.cdi),
            "--state-dir",
            &path(&self.state),
            "--run-dir",
            &path(&self.run),
            "--fake-gpus",
            fake_gpus,
            "--vgpu-lib-dir",
            &path(&lib_dirs.join("vgpu")),
            "--gpupool-lib-dir",
            &path(&lib_dirs.join("gpupool")),
            // Many drivers run side by side: each takes a free port and logs it (`metrics_addr`).
            "--metrics-addr",
            "127.0.0.1:0",
        ]
        .map(String::from)
        .to_vec()
    }
}

/// The address a driver or controller started with `--metrics-addr 127.0.0.1:0` serves
/// `/metrics` on: the last `metrics_addr=` its log announced (a restart announces a new one).
pub fn metrics_addr_in_log(log: &str) -> Option<std::net::SocketAddr> {
    log.lines()
        .filter(|l| l.contains("serving GET /metrics"))
        .filter_map(|l| {
            let value = l.split("metrics_addr").nth(1)?;
            let value = value.trim_start_matches(['=', '"', ':', ' ']);
            let end = value
                .find(|c: char| c.is_whitespace() || c == '"' || c == ',')
                .unwrap_or(value.len());
            value[..end].parse().ok()
        })
        .next_back()
}

/// A node: its folders, kubelet emulator (or real kubelet and containerd) and driver process.
pub struct TestNode {
    pub name: String,
    pub spec: NodeSpec,
    pub dirs: NodeDirs,
    pub kubelet: Option<Kubelet>,
    driver: Mutex<ManagedProcess>,
    /// The real kubelet and containerd, where the spec asks for them; after `driver`, so that it
    /// is dropped (stopped) after the driver.
    pub real: Option<RealNode>,
}

impl TestNode {
    pub fn kubelet(&self) -> &Kubelet {
        self.kubelet
            .as_ref()
            .expect("this node's plugin is driven by a real kubelet, not the emulator")
    }

    pub fn driver(&self) -> MutexGuard<'_, ManagedProcess> {
        self.driver.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn driver_log(&self) -> String {
        self.driver().log()
    }

    /// The real kubelet and containerd of a node started [`NodeSpec::with_real_kubelet`].
    pub fn real(&self) -> &RealNode {
        self.real
            .as_ref()
            .expect("this node's plugin is driven by the kubelet emulator")
    }

    /// How many times the driver has heard from a real kubelet that it is registered.
    fn registrations_in_log(&self) -> usize {
        self.driver_log().matches(REGISTERED_LOG_LINE).count()
    }

    /// Where the node's driver serves `/metrics` (None before it has bound, or with a real kubelet
    /// whose driver the harness did not start).
    pub fn metrics_addr(&self) -> Option<std::net::SocketAddr> {
        metrics_addr_in_log(&self.driver_log())
    }

    /// Path of the CDI spec the driver writes for a claim.
    pub fn cdi_spec_path(&self, claim_uid: &str) -> PathBuf {
        self.dirs
            .cdi
            .join(gpupool_api::names::cdi_spec_file_name(claim_uid))
    }

    /// The claim's CDI spec, parsed, if it exists.
    pub fn cdi_spec(&self, claim_uid: &str) -> Option<Value> {
        let text = std::fs::read_to_string(self.cdi_spec_path(claim_uid)).ok()?;
        serde_json::from_str(&text).ok()
    }

    /// Every gpupool CDI spec file in the node's CDI folder.
    pub fn cdi_spec_files(&self) -> Vec<PathBuf> {
        let prefix = format!("{}-claim_", gpupool_api::names::DRIVER_NAME);
        let mut files: Vec<PathBuf> = std::fs::read_dir(&self.dirs.cdi)
            .map(|entries| {
                entries
                    .flatten()
                    .map(|e| e.path())
                    .filter(|p| {
                        p.file_name()
                            .and_then(|n| n.to_str())
                            .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".json"))
                    })
                    .collect()
            })
            .unwrap_or_default();
        files.sort();
        files
    }
}

/// A cluster's use of the shared control plane: the plane, and its turn on it (held until the
/// cluster is dropped).
struct PlaneTenant {
    plane: &'static ControlPlane,
    _turn: crate::plane::tenancy::Turn,
}

/// The system under test; everything it started is stopped when it is dropped.
pub struct TestCluster {
    backend: Backend,
    client: Client,
    kubeconfig: PathBuf,
    workdir: PathBuf,
    nodes: Vec<TestNode>,
    controller: Option<Mutex<ManagedProcess>>,
    scheduler: Option<tokio::task::JoinHandle<()>>,
    apiserver: Option<upstream::ApiServer>,
    plane: Option<PlaneTenant>,
    programs: Programs,
    _workdir_guard: Option<tempfile::TempDir>,
}

impl Drop for TestCluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.print_logs();
        }
        // Processes first, so nothing talks to an API server that is going away.
        for node in &self.nodes {
            node.driver().kill();
        }
        if let Some(controller) = &self.controller {
            controller.lock().unwrap_or_else(|e| e.into_inner()).kill();
        }
        if let Some(task) = &self.scheduler {
            task.abort();
        }
    }
}

/// The control plane every scenario of this test binary shares, or `None` after printing the one
/// line that says why `test` skips (no binaries). Where `GPUPOOL_KUBE_REQUIRED=1` (CI) a missing
/// binary fails the test instead, and a plane that does not start always does.
pub async fn plane_or_skip(test: &str) -> Option<&'static ControlPlane> {
    match ControlPlane::shared().await {
        Ok(plane) => Some(plane),
        Err(PlaneError::Unavailable(why)) if !crate::plane::binaries::required() => {
            println!("skipping {test}: {why}");
            None
        }
        Err(err) => panic!("{test}: {err}"),
    }
}

/// A control plane of `test`'s own, started with `options` (alpha gates, other APIs), or `None`
/// after printing the one line that says why `test` skips (no binaries). As with
/// [`plane_or_skip`], `GPUPOOL_KUBE_REQUIRED=1` makes a missing binary a failure, and a plane that
/// does not start always fails. Stopped when dropped.
pub async fn own_plane_or_skip(test: &str, options: PlaneOptions) -> Option<ControlPlane> {
    match ControlPlane::start(options).await {
        Ok(plane) => Some(plane),
        Err(PlaneError::Unavailable(why)) if !crate::plane::binaries::required() => {
            println!("skipping {test}: {why}");
            None
        }
        Err(err) => panic!("{test}: {err}"),
    }
}

/// Polls `check` every 50 ms until it yields a value, or fails after `timeout` naming `what`.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, check: F) -> Result<T, HarnessError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    wait_for_every(Duration::from_millis(50), what, timeout, check).await
}

/// `wait_for`, polling every `interval`.
pub async fn wait_for_every<T, F, Fut>(
    interval: Duration,
    what: &str,
    timeout: Duration,
    mut check: F,
) -> Result<T, HarnessError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check().await {
            return Ok(value);
        }
        if Instant::now() >= deadline {
            return Err(HarnessError::Timeout {
                what: what.to_string(),
                after: timeout,
            });
        }
        tokio::time::sleep(interval).await;
    }
}

/// A kube client for a kubeconfig file.
pub async fn client_for_kubeconfig(path: &Path) -> Result<Client, HarnessError> {
    let kubeconfig_err = |message: String| HarnessError::Kubeconfig {
        path: path.to_path_buf(),
        message,
    };
    let kubeconfig = Kubeconfig::read_from(path).map_err(|e| kubeconfig_err(e.to_string()))?;
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(|e| kubeconfig_err(e.to_string()))?;
    Client::try_from(config).map_err(|e| kubeconfig_err(e.to_string()))
}

/// Creates the namespace `name`.
pub async fn create_namespace(client: &Client, name: &str) -> Result<(), HarnessError> {
    let namespace: Namespace = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}
    }))
    .expect("namespace literal");
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .map_err(|source| HarnessError::Kube {
            what: format!("creating namespace {name}"),
            source,
        })?;
    Ok(())
}

/// The ResourceSlices gpupool's driver published for `node`.
pub async fn node_slices(client: &Client, node: &str) -> Result<Vec<ResourceSlice>, HarnessError> {
    let list = Api::<ResourceSlice>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(|source| HarnessError::Kube {
            what: "listing resourceslices".into(),
            source,
        })?;
    Ok(list
        .items
        .into_iter()
        .filter(|s| {
            s.spec.driver == gpupool_api::names::DRIVER_NAME
                && s.spec.node_name.as_deref() == Some(node)
        })
        .collect())
}

/// The Events about one object (`kind` `name`), in `namespace` or, with `None`, in all of them;
/// none when they cannot be listed.
pub async fn events_about(
    client: &Client,
    namespace: Option<&str>,
    kind: &str,
    name: &str,
) -> Vec<Event> {
    let events: Api<Event> = match namespace {
        Some(namespace) => Api::namespaced(client.clone(), namespace),
        None => Api::all(client.clone()),
    };
    events
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
        .into_iter()
        .filter(|e| {
            e.involved_object.kind.as_deref() == Some(kind)
                && e.involved_object.name.as_deref() == Some(name)
        })
        .collect()
}

/// The real kubectl: `$KUBECTL`, else `/usr/bin/kubectl`, else `kubectl` on PATH.
pub fn kubectl_path() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("KUBECTL") {
        return Some(PathBuf::from(path));
    }
    let fixed = PathBuf::from("/usr/bin/kubectl");
    if fixed.is_file() {
        return Some(fixed);
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("kubectl"))
            .find(|p| p.is_file())
    })
}

/// Node names from `GPUPOOL_E2E_NODE` (comma-separated).
pub fn real_node_names() -> Vec<String> {
    std::env::var(env::NODE)
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

fn mkdir(path: &Path) -> Result<(), HarnessError> {
    std::fs::create_dir_all(path).map_err(io_err(format!("creating {}", path.display())))
}

impl TestCluster {
    /// Starts everything in `spec` and waits until each driver has registered with its kubelet.
    pub async fn start(spec: ClusterSpec) -> Result<TestCluster, HarnessError> {
        let backend = spec.backend.clone().unwrap_or_else(Backend::from_env);
        let guard = tempfile::Builder::new()
            .prefix("gpupool-e2e-")
            .tempdir()
            .map_err(io_err("creating the work folder"))?;
        let workdir = guard.path().to_path_buf();

        let (apiserver, plane, kubeconfig) = match &backend {
            Backend::Emulator => {
                let path = workdir.join("kubeconfig");
                let options = upstream::ApiServerOptions {
                    without_partitionable_devices: spec.without_partitionable_devices,
                    ..Default::default()
                };
                (
                    Some(start_api_emulator_with(&path, options).await?),
                    None,
                    path,
                )
            }
            Backend::ControlPlane => {
                let plane = ControlPlane::shared().await?;
                let turn = plane.take_turn().await?;
                (
                    None,
                    Some(PlaneTenant { plane, _turn: turn }),
                    plane.admin_kubeconfig(),
                )
            }
            Backend::Real { .. } => (
                None,
                None,
                PathBuf::from(
                    std::env::var_os(env::KUBECONFIG).expect("checked by Backend::from_env"),
                ),
            ),
        };
        let client = client_for_kubeconfig(&kubeconfig).await?;
        if plane.is_some() {
            // As an operator installs gpupool: the components' identities and RBAC, and the
            // policy that holds each driver to its node's slices.
            install_component_rbac(&client).await?;
            install_manifests(&client, &[RESOURCESLICE_POLICY]).await?;
        }

        let scheduler = match backend {
            Backend::Emulator => Some(start_scheduler(client.clone())),
            Backend::ControlPlane | Backend::Real { .. } => None,
        };

        let mut cluster = TestCluster {
            backend,
            client,
            kubeconfig,
            workdir,
            nodes: Vec::new(),
            controller: None,
            scheduler,
            apiserver,
            plane,
            programs: spec.programs,
            _workdir_guard: Some(guard),
        };
        if spec.controller {
            cluster.start_controller().await?;
        }
        let real_names = real_node_names();
        for (i, node_spec) in spec.nodes.iter().enumerate() {
            let name = match &cluster.backend {
                // On the plane too: a turn starts with no node, slice or claim of an earlier one.
                Backend::Emulator | Backend::ControlPlane => node_spec.name.clone(),
                Backend::Real { .. } => real_names.get(i).cloned().ok_or_else(|| {
                    HarnessError::Setup(format!(
                        "this scenario needs {} node(s); {}={:?} names {}",
                        spec.nodes.len(),
                        env::NODE,
                        std::env::var(env::NODE).unwrap_or_default(),
                        real_names.len()
                    ))
                })?,
            };
            cluster.start_node(name, node_spec.clone()).await?;
        }
        let timeout = spec.registration_timeout.unwrap_or(Duration::from_secs(30));
        for node in &cluster.nodes {
            if node.real.is_some() {
                let registered = wait_for(
                    &format!("the real kubelet on {} to register the driver", node.name),
                    timeout,
                    || async { (node.registrations_in_log() > 0).then_some(()) },
                )
                .await;
                if let Err(err) = registered {
                    return Err(HarnessError::Setup(format!(
                        "driver on {} did not register: {err}\n--- driver log ---\n{}\n--- kubelet log ---\n{}",
                        node.name,
                        node.driver_log(),
                        node.real().kubelet_log()
                    )));
                }
            }
            if let Some(kubelet) = &node.kubelet {
                if let Err(err) = kubelet
                    .wait_for_registration(gpupool_api::names::DRIVER_NAME, timeout)
                    .await
                {
                    return Err(HarnessError::Setup(format!(
                        "driver on {} did not register: {err}\n--- driver log ---\n{}",
                        node.name,
                        node.driver_log()
                    )));
                }
            }
        }
        Ok(cluster)
    }

    /// Like `start`, for a cluster kept in a static and shared by a test file's tests (see
    /// `shared_runtime`): such a cluster is never dropped, so its folder is removed at process exit.
    pub async fn start_shared(spec: ClusterSpec) -> Result<TestCluster, HarnessError> {
        let mut cluster = TestCluster::start(spec).await?;
        if let Some(guard) = cluster._workdir_guard.take() {
            cleanup::remove_at_exit(guard.keep());
        }
        Ok(cluster)
    }

    async fn start_controller(&mut self) -> Result<(), HarnessError> {
        let program = self.programs.locate(CONTROLLER_BIN)?;
        let output = tokio::process::Command::new(&program.path)
            .args(program.args(["crds".to_string()]))
            .output()
            .await
            .map_err(io_err(format!("running {} crds", program.path.display())))?;
        if !output.status.success() {
            return Err(HarnessError::Setup(format!(
                "{CONTROLLER_BIN} crds: {}",
                String::from_utf8_lossy(&output.stderr)
            )));
        }
        let crds = parse_manifests(&String::from_utf8_lossy(&output.stdout))?;
        apply_objects(&self.client, &crds, "default").await?;
        let process = self.spawn_controller(None, "controller.log").await?;
        self.controller = Some(Mutex::new(process));
        Ok(())
    }

    /// Starts a controller replica as the harness starts the controller (named `identity` in the
    /// Lease when given, logging to `log` in the work folder): a second one competes for the Lease.
    pub async fn spawn_controller(
        &self,
        identity: Option<&str>,
        log: &str,
    ) -> Result<ManagedProcess, HarnessError> {
        let program = self.programs.locate(CONTROLLER_BIN)?;
        // On the emulator and the plane it runs as its ServiceAccount, with its Lease where the
        // RBAC lets it.
        let mut args = vec![
            "run".to_string(),
            "--metrics-addr".into(),
            "127.0.0.1:0".into(),
        ];
        if let Some(identity) = identity {
            args.extend(["--identity".into(), identity.into()]);
        }
        match self
            .component_kubeconfig(CONTROLLER_SERVICE_ACCOUNT, None)
            .await?
        {
            Some(kubeconfig) => {
                args.extend([
                    "--kubeconfig".into(),
                    kubeconfig.display().to_string(),
                    "--lease-namespace".into(),
                    COMPONENT_NAMESPACE.into(),
                ]);
            }
            None => args.extend(["--kubeconfig".into(), self.kubeconfig.display().to_string()]),
        }
        Ok(ManagedProcess::spawn(
            CONTROLLER_BIN,
            &program.path,
            program.args(args),
            self.workdir.join(log),
        )?)
    }

    async fn start_node(&mut self, name: String, spec: NodeSpec) -> Result<(), HarnessError> {
        let base = self.workdir.join(&name);
        let real_kubelet = matches!(self.backend, Backend::Real { real_kubelet: true });
        let from_env = |var: &str, default: PathBuf| {
            if real_kubelet {
                std::env::var_os(var).map(PathBuf::from).unwrap_or(default)
            } else {
                default
            }
        };
        let defaults = NodeDirs::under(&base);
        let real = match (&self.plane, spec.real_kubelet) {
            (_, false) => None,
            (Some(tenant), true) => {
                let binaries = NodeBinaries::from_env().map_err(PlaneError::Unavailable)?;
                Some(
                    RealNode::start(
                        tenant.plane,
                        &self.client,
                        &binaries,
                        &name,
                        &base.join("real-node"),
                    )
                    .await?,
                )
            }
            (None, true) => {
                return Err(HarnessError::Setup(format!(
                    "node {name}: a real kubelet runs only on the control plane backend"
                )))
            }
        };
        let dirs = match &real {
            Some(real) => NodeDirs {
                registry: real.registry_dir(),
                plugin: real.plugin_dir(gpupool_api::names::DRIVER_NAME),
                cdi: real.cdi_dir(),
                ..defaults
            },
            None => NodeDirs {
                registry: from_env(env::REGISTRY_DIR, defaults.registry),
                plugin: from_env(env::PLUGIN_DIR, defaults.plugin),
                cdi: from_env(env::CDI_DIR, defaults.cdi),
                ..defaults
            },
        };
        for dir in [
            &dirs.registry,
            &dirs.plugin,
            &dirs.cdi,
            &dirs.state,
            &base.join("vgpu"),
        ] {
            mkdir(dir)?;
        }
        // On the plane the Node is made by hand, and the kubelet emulator acts as the node
        // (`system:node:<name>`), held to it by the Node authorizer and NodeRestriction.
        let mut kubelet_client = self.client.clone();
        if let (Some(tenant), None) = (&self.plane, &real) {
            tenant
                .plane
                .create_node(&self.client, &NodeShape::new(&name))
                .await?;
            let path = base.join("kubeconfig-kubelet");
            tenant.plane.node_kubeconfig(&name, &path)?;
            kubelet_client = client_for_kubeconfig(&path).await?;
        }
        let kubelet = if real_kubelet || real.is_some() {
            None
        } else {
            let mut config = KubeletConfig::new(&name, &dirs.registry);
            if let Some(versions) = &spec.kubelet_versions {
                config.known_versions = versions.clone();
            }
            if let Some(interval) = spec.kubelet_poll_interval {
                config.poll_interval = interval;
            }
            // On a real cluster the node exists already; creating it again is harmless (409).
            config.register_node = self.plane.is_none();
            Some(Kubelet::start(kubelet_client, config).await?)
        };
        let program = self.programs.locate(DRIVER_BIN)?;
        let kubeconfig = self.driver_kubeconfig(&name).await?;
        let mut args =
            dirs.driver_run_args(&name, &kubeconfig, &spec.fake_gpus, &base.join("libs"));
        args.extend(spec.extra_driver_args.iter().cloned());
        let driver = ManagedProcess::spawn(
            &format!("{DRIVER_BIN} on {name}"),
            &program.path,
            program.args(args),
            self.workdir.join(format!("driver-{name}.log")),
        )?;
        self.nodes.push(TestNode {
            name,
            spec,
            dirs,
            kubelet,
            driver: Mutex::new(driver),
            real,
        });
        Ok(())
    }

    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    pub fn is_emulated(&self) -> bool {
        self.backend == Backend::Emulator
    }

    /// The control plane this cluster runs on, on [`Backend::ControlPlane`].
    pub fn plane(&self) -> Option<&'static ControlPlane> {
        self.plane.as_ref().map(|p| p.plane)
    }

    pub fn client(&self) -> Client {
        self.client.clone()
    }

    /// The kubeconfig a driver on `node` runs with: on the emulator and the control plane its
    /// ServiceAccount's, bound to the node (written under the node's folder; on the plane the
    /// Node must exist), else the cluster's.
    pub async fn driver_kubeconfig(&self, node: &str) -> Result<PathBuf, HarnessError> {
        Ok(self
            .component_kubeconfig(DRIVER_SERVICE_ACCOUNT, Some(node))
            .await?
            .unwrap_or_else(|| self.kubeconfig.clone()))
    }

    /// A kubeconfig for the component's ServiceAccount (bound to `node` when given) on the
    /// emulator and the plane; `None` on a real cluster, where the harness has only its own.
    async fn component_kubeconfig(
        &self,
        account: &str,
        node: Option<&str>,
    ) -> Result<Option<PathBuf>, HarnessError> {
        let dir = match node {
            Some(node) => self.workdir.join(node),
            None => self.workdir.clone(),
        };
        mkdir(&dir)?;
        if let Some(server) = &self.apiserver {
            return service_account_kubeconfig(server, &dir, account, node).map(Some);
        }
        let Some(tenant) = &self.plane else {
            return Ok(None);
        };
        if let Some(node) = node {
            // A token is bound to an existing Node; a hand-made one does for a node without driver.
            tenant
                .plane
                .create_node(&self.client, &NodeShape::new(node))
                .await?;
        }
        let path = dir.join(match node {
            Some(node) => format!("kubeconfig-{account}-{node}"),
            None => format!("kubeconfig-{account}"),
        });
        tenant
            .plane
            .service_account_kubeconfig(&self.client, COMPONENT_NAMESPACE, account, node, &path)
            .await?;
        Ok(Some(path))
    }

    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig
    }

    pub fn workdir(&self) -> &Path {
        &self.workdir
    }

    pub fn apiserver(&self) -> Option<&upstream::ApiServer> {
        self.apiserver.as_ref()
    }

    pub fn nodes(&self) -> &[TestNode] {
        &self.nodes
    }

    /// The node started from the spec's `index`-th entry (its name differs on a real cluster).
    pub fn node_at(&self, index: usize) -> &TestNode {
        &self.nodes[index]
    }

    pub fn node(&self, name: &str) -> Result<&TestNode, HarnessError> {
        self.nodes
            .iter()
            .find(|n| n.name == name || n.spec.name == name)
            .ok_or_else(|| HarnessError::UnknownNode(name.to_string()))
    }

    /// SIGKILL the controller the harness started (a crash: its Lease is not released).
    pub fn kill_controller(&self) {
        if let Some(controller) = &self.controller {
            controller.lock().unwrap_or_else(|e| e.into_inner()).kill();
        }
    }

    pub fn controller_log(&self) -> Option<String> {
        self.controller
            .as_ref()
            .map(|c| c.lock().unwrap_or_else(|e| e.into_inner()).log())
    }

    /// Where the controller serves `/metrics`, once it has bound.
    pub fn controller_metrics_addr(&self) -> Option<std::net::SocketAddr> {
        self.controller_log()
            .as_deref()
            .and_then(metrics_addr_in_log)
    }

    /// SIGKILL the node's driver (a crash).
    pub fn kill_driver(&self, node: &str) -> Result<(), HarnessError> {
        self.node(node)?.driver().kill();
        Ok(())
    }

    /// SIGTERM the node's driver and wait up to 10 s for it to exit.
    pub async fn stop_driver(
        &self,
        node: &str,
    ) -> Result<Option<std::process::ExitStatus>, HarnessError> {
        let node = self.node(node)?;
        let mut process = std::mem::replace(&mut *node.driver(), ManagedProcess::placeholder());
        let status = process.stop(Duration::from_secs(10)).await;
        *node.driver() = process;
        Ok(status)
    }

    /// Starts the node's driver again (killing it first if it runs) and waits for it to register.
    pub async fn restart_driver(&self, node: &str) -> Result<Option<Registration>, HarnessError> {
        let node = self.node(node)?;
        let before = node
            .kubelet
            .as_ref()
            .and_then(|k| k.registration(gpupool_api::names::DRIVER_NAME))
            .map_or(0, |r| r.sequence);
        let registered_before = node.registrations_in_log();
        {
            let mut driver = node.driver();
            driver.kill();
            driver.start()?;
        }
        match &node.kubelet {
            Some(kubelet) => {
                let registration = wait_for(
                    &format!("the restarted driver on {} to register again", node.name),
                    Duration::from_secs(30),
                    || async {
                        kubelet
                            .registration(gpupool_api::names::DRIVER_NAME)
                            .filter(|r| r.sequence > before)
                    },
                )
                .await
                .map_err(|e| self.with_driver_log(&node.name, e))?;
                Ok(Some(registration))
            }
            None if node.real.is_some() => {
                wait_for(
                    &format!(
                        "the real kubelet on {} to register the restarted driver",
                        node.name
                    ),
                    Duration::from_secs(30),
                    || async { (node.registrations_in_log() > registered_before).then_some(()) },
                )
                .await
                .map_err(|e| self.with_driver_log(&node.name, e))?;
                Ok(None)
            }
            None => Ok(None),
        }
    }

    /// Runs the real kubectl against this cluster; stdout on success.
    pub async fn kubectl(&self, args: &[&str]) -> Result<String, HarnessError> {
        self.kubectl_with_input(args, None).await
    }

    /// Runs kubectl with `input` on stdin (e.g. `apply -f -`).
    pub async fn kubectl_with_input(
        &self,
        args: &[&str],
        input: Option<&str>,
    ) -> Result<String, HarnessError> {
        use tokio::io::AsyncWriteExt;
        let kubectl =
            kubectl_path().ok_or_else(|| HarnessError::Setup("kubectl not found".into()))?;
        let mut child = tokio::process::Command::new(kubectl)
            .args(args)
            .env("KUBECONFIG", &self.kubeconfig)
            .env("KUBECACHEDIR", self.workdir.join("kubectl-cache"))
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(io_err("starting kubectl"))?;
        let mut stdin = child.stdin.take().expect("stdin is piped");
        if let Some(input) = input {
            stdin
                .write_all(input.as_bytes())
                .await
                .map_err(io_err("writing kubectl's stdin"))?;
        }
        drop(stdin);
        let output = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
            .await
            .map_err(|_| HarnessError::Timeout {
                what: format!("kubectl {}", args.join(" ")),
                after: Duration::from_secs(60),
            })?
            .map_err(io_err("running kubectl"))?;
        if !output.status.success() {
            return Err(HarnessError::Kubectl {
                args: args.join(" "),
                status: output.status.to_string(),
                stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
            });
        }
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }

    /// Applies YAML through the kube client (creating, or merge-patching what exists).
    pub async fn apply_yaml(&self, yaml: &str, namespace: &str) -> Result<(), HarnessError> {
        let objects = parse_manifests(yaml)?;
        apply_objects(&self.client, &objects, namespace).await?;
        Ok(())
    }

    /// Applies a YAML file with the real kubectl when present, else through the kube client. Objects
    /// without a namespace go to `namespace` (kubectl's own default when `None`).
    pub async fn apply_file(
        &self,
        path: &Path,
        namespace: Option<&str>,
    ) -> Result<(), HarnessError> {
        if kubectl_path().is_some() {
            let path = path.display().to_string();
            let mut args = vec!["apply", "-f", path.as_str()];
            if let Some(ns) = namespace {
                args.extend(["-n", ns]);
            }
            self.kubectl(&args).await?;
            return Ok(());
        }
        let yaml =
            std::fs::read_to_string(path).map_err(io_err(format!("reading {}", path.display())))?;
        self.apply_yaml(&yaml, namespace.unwrap_or("default")).await
    }

    /// Creates a namespace named `<prefix>-<random>` and returns its name, so scenarios sharing a
    /// cluster (or running on a real one) never see each other's objects.
    pub async fn create_namespace(&self, prefix: &str) -> Result<String, HarnessError> {
        let name = format!(
            "{prefix}-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..6]
        );
        create_namespace(&self.client, &name).await?;
        Ok(name)
    }

    /// The ResourceSlices a node's driver published.
    pub async fn slices_of(&self, node: &str) -> Result<Vec<ResourceSlice>, HarnessError> {
        node_slices(&self.client, node).await
    }

    /// Waits until the node's driver has published `devices` devices.
    pub async fn wait_for_slices(
        &self,
        node: &str,
        devices: usize,
        timeout: Duration,
    ) -> Result<Vec<ResourceSlice>, HarnessError> {
        wait_for(
            &format!("{devices} published device(s) on node {node}"),
            timeout,
            || async {
                let slices = self.slices_of(node).await.ok()?;
                let count: usize = slices
                    .iter()
                    .map(|s| s.spec.devices.as_ref().map_or(0, |d| d.len()))
                    .sum();
                (count >= devices).then_some(slices)
            },
        )
        .await
        .map_err(|e| self.with_driver_log(node, e))
    }

    fn with_driver_log(&self, node: &str, err: HarnessError) -> HarnessError {
        match self.node(node) {
            Ok(n) => HarnessError::Setup(format!(
                "{err}\n--- driver log of {node} ---\n{}",
                n.driver_log()
            )),
            Err(_) => err,
        }
    }

    /// Every process log, keyed by process name.
    pub fn logs(&self) -> BTreeMap<String, String> {
        let mut logs = BTreeMap::new();
        for node in &self.nodes {
            let driver = node.driver();
            logs.insert(driver.name().to_string(), driver.log());
            if let Some(real) = &node.real {
                logs.insert(format!("kubelet on {}", node.name), real.kubelet_log());
                logs.insert(
                    format!("containerd on {}", node.name),
                    real.containerd_log(),
                );
            }
        }
        if let Some(log) = self.controller_log() {
            logs.insert(CONTROLLER_BIN.to_string(), log);
        }
        logs
    }

    /// Prints the last lines of every process log to stderr (the test's output on failure).
    pub fn print_logs(&self) {
        for (name, log) in self.logs() {
            print_log_tail(&name, &log, 150);
        }
    }

    /// A guard that prints the process logs if the test panics while it is alive; for clusters shared
    /// in a static, which are never dropped.
    pub fn logs_on_failure(&self) -> LogsOnFailure<'_> {
        LogsOnFailure { cluster: self }
    }
}

pub struct LogsOnFailure<'a> {
    cluster: &'a TestCluster,
}

impl Drop for LogsOnFailure<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.cluster.print_logs();
        }
    }
}

/// A multi-thread runtime that lives as long as the test process, for clusters shared by the tests
/// of one file (each `#[test]` calls `shared_runtime().block_on(..)`).
pub fn shared_runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
    RUNTIME.get_or_init(|| two_worker_runtime().expect("building the shared test runtime"))
}

/// A multi-thread runtime of two workers: the emulators and the kubelet side share the machine
/// with the real binaries.
pub fn two_worker_runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
}

/// Logs to stderr, filtered by `RUST_LOG` (`warn` without it): how the sandbox and the bench log.
pub fn init_stderr_tracing() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
}

/// The workspace's root folder (the one above `e2e/`).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("e2e/ is inside the workspace")
        .to_path_buf()
}

/// Starts the API server emulator, writes an administrator's kubeconfig for it at `kubeconfig`,
/// and installs the components' ServiceAccounts and RBAC (see [`install_component_rbac`]).
pub async fn start_api_emulator(kubeconfig: &Path) -> Result<upstream::ApiServer, HarnessError> {
    start_api_emulator_with(kubeconfig, upstream::ApiServerOptions::default()).await
}

/// [`start_api_emulator`] with `options`.
pub async fn start_api_emulator_with(
    kubeconfig: &Path,
    options: upstream::ApiServerOptions,
) -> Result<upstream::ApiServer, HarnessError> {
    let server = upstream::ApiServer::start_with(options)
        .await
        .map_err(|e| HarnessError::ApiServer(format!("{e:#}")))?;
    server
        .write_kubeconfig(kubeconfig)
        .map_err(|e| HarnessError::ApiServer(format!("writing kubeconfig: {e}")))?;
    install_component_rbac(&client_for_kubeconfig(kubeconfig).await?).await?;
    Ok(server)
}

/// The manifests that give the driver and the controller their identities and permissions, as an
/// operator installs them.
const COMPONENT_RBAC: &[&str] = &[
    "deploy/base/namespace.yaml",
    "deploy/base/driver-rbac.yaml",
    "deploy/base/controller-rbac.yaml",
];
/// The ValidatingAdmissionPolicy that holds each driver to its own node's slices (enforced by a
/// real API server; the emulator stores policies without enforcing them).
pub const RESOURCESLICE_POLICY: &str = "deploy/base/resourceslice-policy.yaml";
/// Where [`COMPONENT_RBAC`] puts the ServiceAccounts.
pub const COMPONENT_NAMESPACE: &str = "gpupool";
pub const DRIVER_SERVICE_ACCOUNT: &str = "gpupool-driver";
pub const CONTROLLER_SERVICE_ACCOUNT: &str = "gpupool-controller";

/// Applies the ServiceAccounts, roles and bindings of deploy/base, so that a driver or controller
/// started with [`service_account_kubeconfig`] has exactly the permissions an installed one has
/// (a permission missing there fails the tests as it would fail a cluster).
pub async fn install_component_rbac(client: &Client) -> Result<(), HarnessError> {
    install_manifests(client, COMPONENT_RBAC).await
}

/// Applies the workspace's manifest `files`, namespaced objects without a namespace into
/// [`COMPONENT_NAMESPACE`].
pub async fn install_manifests(client: &Client, files: &[&str]) -> Result<(), HarnessError> {
    for file in files {
        let path = workspace_root().join(file);
        let yaml = std::fs::read_to_string(&path).map_err(io_err(format!("reading {file}")))?;
        apply_objects(client, &parse_manifests(&yaml)?, COMPONENT_NAMESPACE).await?;
    }
    Ok(())
}

/// Writes `dir/kubeconfig-<account>[-<node>]` for ServiceAccount `gpupool/<account>` of the
/// emulator, its token bound to `node` as a DaemonSet pod's is, and returns its path.
pub fn service_account_kubeconfig(
    server: &upstream::ApiServer,
    dir: &Path,
    account: &str,
    node: Option<&str>,
) -> Result<PathBuf, HarnessError> {
    let token = server.service_account_token(COMPONENT_NAMESPACE, account, node);
    let path = dir.join(match node {
        Some(node) => format!("kubeconfig-{account}-{node}"),
        None => format!("kubeconfig-{account}"),
    });
    std::fs::write(&path, server.kubeconfig_yaml_with(&token))
        .map_err(io_err(format!("writing {}", path.display())))?;
    Ok(path)
}

fn start_scheduler(client: Client) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        if let Err(err) = upstream::run_scheduler(client).await {
            tracing::error!("scheduler stand-in stopped: {err:#}");
        }
    })
}

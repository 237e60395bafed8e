//! The bench's cluster: the API server emulator in process or the real kube-apiserver (with etcd,
//! from the control plane binaries), the real driver binary per node, and a kubelet emulator that
//! only calls what the bench tells it (no pod logic).
//!
//! Not `harness::TestCluster`: that one also runs the scheduler stand-in and polls registration every
//! 50 ms; the bench needs millisecond start-up timing and a client whose requests it can tell apart
//! from the driver's (its user agent).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use gpupool_api::claim::ClaimRef;
use gpupool_apiserver::{ApiServer, ApiServerOptions, RequestRecord};
use gpupool_e2e::harness::{
    install_component_rbac, service_account_kubeconfig, ManagedProcess, NodeDirs,
    COMPONENT_NAMESPACE, DRIVER_SERVICE_ACCOUNT,
};
use gpupool_e2e::kubelet::{Kubelet, KubeletConfig, KubeletError};
use gpupool_e2e::plane::{ControlPlane, NodeShape, PlaneOptions};
use k8s_openapi::api::core::v1::{Namespace, Node};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};
use serde_json::{json, Value};
use tonic::codegen::http;

use crate::report::ClaimKind;
use crate::requests::BENCH_USER_AGENT;

pub const DRIVER: &str = gpupool_api::names::DRIVER_NAME;
pub const NAMESPACE: &str = "bench";
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// The API server the bench runs against.
pub enum Server {
    Emulator(ApiServer),
    /// kube-apiserver and etcd only (no scheduler or controller-manager: the bench allocates and
    /// reserves claims itself, for pods it does not create), its audit log counting the requests.
    KubeApiserver(Box<ControlPlane>),
}

/// Which API server to start.
pub enum ServerChoice {
    Emulator(ApiServerOptions),
    KubeApiserver,
}

pub struct Bench {
    pub server: Server,
    pub client: Client,
    driver_bin: PathBuf,
    workdir: tempfile::TempDir,
    /// Where the nodes' CDI and run folders live: a tmpfs when there is one, as `/var/run/cdi`
    /// and `/var/run/gpupool` are on a node (`/run` is a tmpfs), while their state folders stay
    /// on the disk, as `/var/lib` does.
    runtime_dir: tempfile::TempDir,
}

/// The tmpfs the bench puts the nodes' `/var/run` folders on, when this machine has one.
const TMPFS: &str = "/dev/shm";

/// A driver process and the kubelet emulator it registers with (none for publish-only nodes).
pub struct BenchNode {
    pub name: String,
    pub kubelet: Option<Kubelet>,
    pub driver: ManagedProcess,
}

impl BenchNode {
    pub fn pid(&self) -> anyhow::Result<u32> {
        self.driver
            .pid()
            .with_context(|| format!("the driver of node {} is not running", self.name))
    }

    pub fn kubelet(&self) -> &Kubelet {
        self.kubelet
            .as_ref()
            .expect("latency nodes are started with a kubelet emulator")
    }

    fn check_running(&mut self) -> anyhow::Result<()> {
        if !self.driver.is_running() {
            bail!(
                "the driver of node {} exited; its log:\n{}",
                self.name,
                self.driver.log()
            );
        }
        Ok(())
    }
}

/// Claim status results (`status.allocation.devices.results`) of one claim on `device` of `pool`,
/// as the scheduler writes them for a shared (allowMultipleAllocations) device: every claim gets a
/// share id and consumes every capacity, the whole card's memory and no cores for a whole card.
pub fn allocation_result(kind: ClaimKind, pool: &str, device: &str) -> Value {
    let (memory, cores) = match kind {
        ClaimKind::Whole => ("40Gi", "0"),
        ClaimKind::Fractional => ("4Gi", "25"),
    };
    json!({
        "request": "gpu", "driver": DRIVER, "pool": pool, "device": device,
        "shareID": uuid::Uuid::new_v4().to_string(),
        "consumedCapacity": {"memory": memory, "cores": cores},
    })
}

impl Bench {
    pub async fn start(driver_bin: PathBuf, choice: ServerChoice) -> anyhow::Result<Bench> {
        // A short name: the drivers' socket paths, named after their pod UID as in a DaemonSet,
        // must stay under the 108 bytes of a Unix socket address.
        let workdir = tempfile::Builder::new()
            .prefix("gpb-")
            .tempdir()
            .context("creating the work folder")?;
        let runtime_dir = match tempfile::Builder::new()
            .prefix("gpb-run-")
            .tempdir_in(TMPFS)
        {
            Ok(dir) => dir,
            Err(_) => tempfile::Builder::new()
                .prefix("gpb-run-")
                .tempdir()
                .context("creating the run folder")?,
        };
        let (server, kubeconfig) = match choice {
            ServerChoice::Emulator(api) => {
                let apiserver = ApiServer::start_with(api)
                    .await
                    .context("starting the API server emulator")?;
                let kubeconfig = workdir.path().join("kubeconfig");
                apiserver
                    .write_kubeconfig(&kubeconfig)
                    .context("writing the kubeconfig")?;
                (Server::Emulator(apiserver), kubeconfig)
            }
            ServerChoice::KubeApiserver => {
                let plane = ControlPlane::start(PlaneOptions::default().apiserver_only().audit())
                    .await
                    .context("starting kube-apiserver and etcd")?;
                let kubeconfig = plane.admin_kubeconfig();
                (Server::KubeApiserver(Box::new(plane)), kubeconfig)
            }
        };
        let client = bench_client(&kubeconfig).await?;
        // The drivers run as their ServiceAccount, authorized as in a cluster.
        install_component_rbac(&client).await?;
        let bench = Bench {
            server,
            client,
            driver_bin,
            workdir,
            runtime_dir,
        };
        let namespace: Namespace = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}
        }))?;
        Api::<Namespace>::all(bench.client.clone())
            .create(&PostParams::default(), &namespace)
            .await
            .context("creating the bench namespace")?;
        Ok(bench)
    }

    pub fn workdir(&self) -> &Path {
        self.workdir.path()
    }

    /// Every request the API server saw so far, oldest first: the emulator's own record, or
    /// kube-apiserver's audit log (which records only requests on claims, slices and events).
    pub fn requests(&self) -> Vec<RequestRecord> {
        match &self.server {
            Server::Emulator(apiserver) => apiserver.requests(),
            Server::KubeApiserver(plane) => plane
                .audit_requests()
                .unwrap_or_else(|e| panic!("{e}"))
                .into_iter()
                .map(|r| RequestRecord {
                    method: r.method,
                    path: r.uri,
                    user_agent: r.user_agent,
                })
                .collect(),
        }
    }

    /// The driver's ServiceAccount kubeconfig for node `name`, its token bound to the node (on
    /// kube-apiserver the Node is made first).
    async fn driver_kubeconfig(&self, name: &str) -> anyhow::Result<PathBuf> {
        let dir = self.workdir().join(name);
        match &self.server {
            Server::Emulator(apiserver) => Ok(service_account_kubeconfig(
                apiserver,
                &dir,
                DRIVER_SERVICE_ACCOUNT,
                Some(name),
            )?),
            Server::KubeApiserver(plane) => {
                plane
                    .create_node(&self.client, &NodeShape::new(name))
                    .await?;
                let path = dir.join(format!("kubeconfig-{DRIVER_SERVICE_ACCOUNT}-{name}"));
                plane
                    .service_account_kubeconfig(
                        &self.client,
                        COMPONENT_NAMESPACE,
                        DRIVER_SERVICE_ACCOUNT,
                        Some(name),
                        &path,
                    )
                    .await?;
                Ok(path)
            }
        }
    }

    /// The folder holding the nodes' CDI and run folders (on a tmpfs when the machine has one).
    pub fn runtime_dir(&self) -> &Path {
        self.runtime_dir.path()
    }

    /// The size of a node's checkpoint: its snapshot and its log (in its `--state-dir`,
    /// `<workdir>/<node>/state`).
    pub fn checkpoint_bytes(&self, node: &str) -> anyhow::Result<u64> {
        let state = self.workdir().join(node).join("state");
        ["checkpoint.json", "checkpoint.wal"]
            .iter()
            .map(|file| {
                let path = state.join(file);
                std::fs::metadata(&path)
                    .map(|m| m.len())
                    .with_context(|| format!("reading {}", path.display()))
            })
            .sum()
    }

    fn node_dirs(&self, name: &str) -> anyhow::Result<(NodeDirs, PathBuf)> {
        let base = self.workdir().join(name);
        let dirs = NodeDirs {
            registry: base.join("plugins_registry"),
            plugin: base.join("plugins").join(DRIVER),
            cdi: self.runtime_dir().join(name).join("cdi"),
            state: base.join("state"),
            run: self.runtime_dir().join(name).join("gpupool"),
        };
        let libs = base.join("libs");
        for dir in [&dirs.registry, &dirs.plugin, &dirs.cdi, &dirs.state, &libs] {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        Ok((dirs, libs))
    }

    fn spawn_driver(
        &self,
        name: &str,
        fake_gpus: &str,
        dirs: &NodeDirs,
        libs: &Path,
        kubeconfig: &Path,
    ) -> anyhow::Result<ManagedProcess> {
        let mut args = dirs.driver_run_args(name, kubeconfig, fake_gpus, libs);
        // As the DaemonSet runs it (`POD_UID` from the downward API): sockets named after the
        // pod, and the serialize lock taken around every prepare and unprepare.
        args.extend(["--pod-uid".to_string(), uuid::Uuid::new_v4().to_string()]);
        ManagedProcess::spawn(
            &format!("gpupool-driver on {name}"),
            &self.driver_bin,
            args,
            self.workdir().join(format!("driver-{name}.log")),
        )
        .map_err(Into::into)
    }

    /// Starts a node with a kubelet emulator that scans its registry folder every `scan`; returns
    /// once the driver registered and published `devices` devices, with the times it took.
    pub async fn start_node(
        &self,
        name: &str,
        fake_gpus: &str,
        devices: usize,
        scan: Duration,
    ) -> anyhow::Result<(BenchNode, Duration, Duration)> {
        let (dirs, libs) = self.node_dirs(name)?;
        let mut config = KubeletConfig::new(name, &dirs.registry);
        config.manage_pods = false;
        config.poll_interval = scan;
        let kubelet = Kubelet::start(self.client.clone(), config)
            .await
            .with_context(|| format!("starting the kubelet emulator of {name}"))?;
        // The token is made before the clock starts: a pod has it when its driver starts.
        let kubeconfig = self.driver_kubeconfig(name).await?;
        let spawned = Instant::now();
        let driver = self.spawn_driver(name, fake_gpus, &dirs, &libs, &kubeconfig)?;
        let mut node = BenchNode {
            name: name.to_string(),
            kubelet: Some(kubelet),
            driver,
        };
        let nodes = BTreeSet::from([name.to_string()]);
        let (mut registered, mut published) = (None, None);
        while registered.is_none() || published.is_none() {
            if registered.is_none() && node.kubelet().registration(DRIVER).is_some() {
                registered = Some(spawned.elapsed());
            }
            if published.is_none() && self.published_devices(&nodes).await?.0 >= devices {
                published = Some(spawned.elapsed());
            }
            if spawned.elapsed() > READY_TIMEOUT {
                bail!(
                    "node {name}: not registered and published after {READY_TIMEOUT:?}; driver log:\n{}",
                    node.driver.log()
                );
            }
            node.check_running()?;
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        Ok((
            node,
            registered.expect("loop ends once set"),
            published.expect("loop ends once set"),
        ))
    }

    /// Starts `reference` (the reference plugin's binary) as node `name`'s DRA plugin, with its own
    /// kubelet emulator; returns once the kubelet emulator accepted its registration. It
    /// publishes nothing: the bench allocates claims on pool `name` by hand anyway.
    pub async fn start_reference_node(
        &self,
        name: &str,
        reference: &Path,
    ) -> anyhow::Result<BenchNode> {
        let (dirs, _) = self.node_dirs(name)?;
        let mut config = KubeletConfig::new(name, &dirs.registry);
        config.manage_pods = false;
        config.poll_interval = Duration::from_millis(10);
        let kubelet = Kubelet::start(self.client.clone(), config)
            .await
            .with_context(|| format!("starting the kubelet emulator of {name}"))?;
        // The driver's ServiceAccount: the same RBAC, so the same authorization work per request.
        let kubeconfig = self.driver_kubeconfig(name).await?;
        let path = |p: &Path| p.display().to_string();
        let args = vec![
            "--node-name".to_string(),
            name.to_string(),
            "--kubeconfig".to_string(),
            path(&kubeconfig),
            "--registry-dir".to_string(),
            path(&dirs.registry),
            "--plugin-dir".to_string(),
            path(&dirs.plugin),
            "--cdi-root".to_string(),
            path(&dirs.cdi),
            "--state-dir".to_string(),
            path(&dirs.state),
        ];
        let driver = ManagedProcess::spawn(
            &format!("reference plugin on {name}"),
            reference,
            args,
            self.workdir().join(format!("reference-{name}.log")),
        )?;
        let mut node = BenchNode {
            name: name.to_string(),
            kubelet: Some(kubelet),
            driver,
        };
        let spawned = Instant::now();
        while node.kubelet().registration(DRIVER).is_none() {
            if spawned.elapsed() > READY_TIMEOUT {
                bail!(
                    "node {name}: the reference plugin did not register within {READY_TIMEOUT:?}; its log:\n{}",
                    node.driver.log()
                );
            }
            node.check_running()?;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Ok(node)
    }

    /// What drivers without kubelets (slice publishing only) need before they start, as a
    /// DaemonSet's pods have it: their Node objects, folders and tokens.
    pub async fn prepare_publishers(&self, names: &[String]) -> anyhow::Result<Vec<Publisher>> {
        let mut prepared = Vec::new();
        for name in names {
            self.create_node_object(name).await?;
            let (dirs, libs) = self.node_dirs(name)?;
            let kubeconfig = self.driver_kubeconfig(name).await?;
            prepared.push(Publisher {
                name: name.clone(),
                dirs,
                libs,
                kubeconfig,
            });
        }
        Ok(prepared)
    }

    /// Starts the prepared publishers' drivers.
    pub fn spawn_publishers(
        &self,
        publishers: &[Publisher],
        fake_gpus: &str,
    ) -> anyhow::Result<Vec<BenchNode>> {
        publishers
            .iter()
            .map(|p| {
                let driver =
                    self.spawn_driver(&p.name, fake_gpus, &p.dirs, &p.libs, &p.kubeconfig)?;
                Ok(BenchNode {
                    name: p.name.clone(),
                    kubelet: None,
                    driver,
                })
            })
            .collect()
    }

    async fn create_node_object(&self, name: &str) -> anyhow::Result<()> {
        if let Server::KubeApiserver(plane) = &self.server {
            plane
                .create_node(&self.client, &NodeShape::new(name))
                .await?;
            return Ok(());
        }
        let node: Node = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        }))?;
        Api::<Node>::all(self.client.clone())
            .create(&PostParams::default(), &node)
            .await
            .with_context(|| format!("creating node {name}"))?;
        Ok(())
    }

    /// Devices and slices gpupool published for `nodes`.
    pub async fn published_devices(
        &self,
        nodes: &BTreeSet<String>,
    ) -> anyhow::Result<(usize, usize)> {
        let list = Api::<ResourceSlice>::all(self.client.clone())
            .list(&ListParams::default())
            .await
            .context("listing ResourceSlices")?;
        let ours: Vec<&ResourceSlice> = list
            .items
            .iter()
            .filter(|s| {
                s.spec.driver == DRIVER
                    && s.spec.node_name.as_ref().is_some_and(|n| nodes.contains(n))
            })
            .collect();
        let devices = ours
            .iter()
            .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
            .sum();
        Ok((devices, ours.len()))
    }

    /// Creates a claim and writes its allocation, as the scheduler would.
    pub async fn create_allocated_claim(
        &self,
        name: &str,
        kind: ClaimKind,
        pool: &str,
        device: &str,
    ) -> anyhow::Result<ClaimRef> {
        let claim: ResourceClaim = serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"devices": {"requests": [
                {"name": "gpu", "exactly": {"deviceClassName": "gpu.gpupool.dev"}}
            ]}},
        }))?;
        let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), NAMESPACE);
        let created = api
            .create(&PostParams::default(), &claim)
            .await
            .with_context(|| format!("creating claim {NAMESPACE}/{name}"))?;
        let result = allocation_result(kind, pool, device);
        // As the scheduler leaves a claim the kubelet prepares: allocated and reserved for the pod.
        let patch = json!({"status": {
            "allocation": {"devices": {"results": [result]}},
            "reservedFor": [{"resource": "pods", "name": format!("{name}-pod"),
                             "uid": uuid::Uuid::new_v4().to_string()}],
        }});
        api.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .with_context(|| format!("allocating claim {NAMESPACE}/{name}"))?;
        Ok(ClaimRef::of(&created))
    }

    /// `count` allocated claims spread over `gpus` cards of `pool`, named `<prefix>-<i>`.
    pub async fn create_claims(
        &self,
        prefix: &str,
        count: usize,
        kind: ClaimKind,
        pool: &str,
        gpus: usize,
    ) -> anyhow::Result<Vec<ClaimRef>> {
        let mut claims = Vec::with_capacity(count);
        for i in 0..count {
            let device = gpupool_api::names::device_name((i % gpus) as u32);
            claims.push(
                self.create_allocated_claim(&format!("{prefix}-{i}"), kind, pool, &device)
                    .await?,
            );
        }
        Ok(claims)
    }
}

/// A publish-only node, ready to start its driver.
pub struct Publisher {
    name: String,
    dirs: NodeDirs,
    libs: PathBuf,
    kubeconfig: PathBuf,
}

/// A kube client for the API server whose requests carry the bench's user agent.
async fn bench_client(kubeconfig: &Path) -> anyhow::Result<Client> {
    let parsed = Kubeconfig::read_from(kubeconfig)
        .with_context(|| format!("reading {}", kubeconfig.display()))?;
    let mut config = Config::from_custom_kubeconfig(parsed, &KubeConfigOptions::default())
        .await
        .with_context(|| format!("loading {}", kubeconfig.display()))?;
    let agent = format!("{BENCH_USER_AGENT}/{}", env!("CARGO_PKG_VERSION"));
    config.headers.push((
        http::header::USER_AGENT,
        http::HeaderValue::from_str(&agent).context("user agent header")?,
    ));
    Client::try_from(config).context("building the kube client")
}

/// Prepares `claim` (alone in its call) and fails on its error or an answer without devices.
pub async fn prepare_one(kubelet: &Kubelet, claim: &ClaimRef) -> anyhow::Result<()> {
    let outcome = kubelet.prepare(DRIVER, std::slice::from_ref(claim)).await;
    let devices = answer_for(claim, ("NodePrepareResources", "prepare"), outcome)?;
    ensure!(
        !devices.is_empty(),
        "claim {} prepared with no devices",
        claim.name
    );
    Ok(())
}

pub async fn unprepare_one(kubelet: &Kubelet, claim: &ClaimRef) -> anyhow::Result<()> {
    let outcome = kubelet.unprepare(DRIVER, std::slice::from_ref(claim)).await;
    answer_for(claim, ("NodeUnprepareResources", "unprepare"), outcome)
}

/// The answer for `claim` of a call (its RPC name, its verb) that carried only that claim.
fn answer_for<T>(
    claim: &ClaimRef,
    (rpc, verb): (&str, &str),
    outcome: Result<BTreeMap<String, Result<T, String>>, KubeletError>,
) -> anyhow::Result<T> {
    let mut outcome = outcome.with_context(|| format!("{rpc} of claim {}", claim.name))?;
    match outcome.remove(&claim.uid) {
        Some(Ok(answer)) => Ok(answer),
        Some(Err(error)) => bail!("{verb} of claim {} failed: {error}", claim.name),
        None => bail!("no {verb} answer for claim {}", claim.name),
    }
}

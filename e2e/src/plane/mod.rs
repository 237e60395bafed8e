//! A real Kubernetes control plane on loopback: etcd, kube-apiserver, kube-scheduler and
//! kube-controller-manager, as envtest starts etcd and kube-apiserver for controller tests, with the
//! scheduler and the controller-manager beside them so that claims are allocated and owned objects
//! collected by the real components. No kubelet: Nodes are made by hand ([`nodes`]), and the
//! harness's kubelet emulator drives the driver on them.
//!
//! - Binaries: [`binaries`] (`GPUPOOL_KUBE_BIN` or `KUBEBUILDER_ASSETS`).
//! - Once per test binary: [`ControlPlane::shared`]; [`ControlPlane::start`] for a plane of one's
//!   own (other feature gates, runtime config, a scheduler profile: [`PlaneOptions`]).
//! - Credentials: an administrator (`system:masters`) for setup, ServiceAccount tokens from the
//!   TokenRequest API (bound to a Node as a DaemonSet pod's token is: it names the node), and
//!   client certificates for node identities.

pub mod audit;
pub mod binaries;
pub mod flags;
pub mod nodes;
pub mod pki;
pub mod real_node;
pub mod tenancy;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Node, ServiceAccount};
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use tokio::sync::OnceCell;

use crate::harness::process::{print_log_tail, ManagedProcess, ProcessError};
pub use binaries::KubeBinaries;
pub use flags::PlaneOptions;
pub use nodes::{fake_node_slices, node_object, NodeShape};

#[derive(Debug, thiserror::Error)]
pub enum PlaneError {
    /// No binaries: the scenario skips (or fails, where they are required).
    #[error("{0}")]
    Unavailable(String),
    #[error(transparent)]
    Pki(#[from] pki::PkiError),
    #[error(transparent)]
    SchedulerConfig(#[from] flags::SchedulerConfigError),
    #[error(transparent)]
    Process(#[from] ProcessError),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{what}: {source}")]
    Kube {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("{component} exited ({status}) before the plane was ready; its log ends:\n{log}")]
    Exited {
        component: &'static str,
        status: String,
        log: String,
    },
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout { what: String, after: Duration },
    /// A plane that failed to start once per test binary fails every scenario that needs it.
    #[error("the shared control plane did not start: {0}")]
    SharedFailed(String),
}

fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> PlaneError {
    let what = what.into();
    move |source| PlaneError::Io { what, source }
}

fn kube_err(what: impl Into<String>) -> impl FnOnce(kube::Error) -> PlaneError {
    let what = what.into();
    move |source| PlaneError::Kube { what, source }
}

/// How long each stage of a start may take on a loaded 2-core machine (the whole plane takes 5-8 s
/// on an idle one).
const READY_TIMEOUT: Duration = Duration::from_secs(90);
/// The administrator's user name in the token file (group `system:masters`).
pub const ADMIN_USER: &str = "gpupool-e2e-admin";
/// How long the tokens the plane asks for stay valid: longer than any test binary runs.
const TOKEN_LIFETIME_SECONDS: i64 = 24 * 3600;

struct Processes {
    etcd: ManagedProcess,
    apiserver: ManagedProcess,
    scheduler: ManagedProcess,
    controller_manager: ManagedProcess,
}

impl Processes {
    fn all_mut(&mut self) -> [(&'static str, &mut ManagedProcess); 4] {
        [
            ("etcd", &mut self.etcd),
            ("kube-apiserver", &mut self.apiserver),
            ("kube-scheduler", &mut self.scheduler),
            ("kube-controller-manager", &mut self.controller_manager),
        ]
    }
}

/// A running control plane; its processes are killed when it is dropped (or, for the shared one,
/// when the test process exits).
pub struct ControlPlane {
    files: flags::PlaneFiles,
    ports: flags::Ports,
    options: PlaneOptions,
    pki: pki::Pki,
    processes: Mutex<Processes>,
    turns: tenancy::Turns,
    audit: audit::AuditLog,
    _dir_guard: Option<tempfile::TempDir>,
}

impl ControlPlane {
    /// Starts a plane of the binaries the environment names (see [`binaries`]).
    pub async fn start(options: PlaneOptions) -> Result<ControlPlane, PlaneError> {
        let binaries = KubeBinaries::from_env().map_err(PlaneError::Unavailable)?;
        Self::start_with(&binaries, options).await
    }

    /// The plane every scenario of this test binary shares, started by the first that asks.
    pub async fn shared() -> Result<&'static ControlPlane, PlaneError> {
        static SHARED: OnceCell<Result<ControlPlane, String>> = OnceCell::const_new();
        let binaries = KubeBinaries::from_env().map_err(PlaneError::Unavailable)?;
        let plane = SHARED
            .get_or_init(|| async move {
                let mut plane = Self::start_with(&binaries, PlaneOptions::default())
                    .await
                    .map_err(|e| e.to_string())?;
                // Never dropped: its folder goes when the process exits (its processes are
                // killed then by the harness's exit hook).
                if let Some(guard) = plane._dir_guard.take() {
                    crate::harness::cleanup::remove_at_exit(guard.keep());
                }
                Ok(plane)
            })
            .await;
        plane
            .as_ref()
            .map_err(|e| PlaneError::SharedFailed(e.clone()))
    }

    /// Starts the plane; a start that lost one of its ports to another process between choosing
    /// and binding it (the components bind seconds apart) is made again with other ports.
    pub async fn start_with(
        binaries: &KubeBinaries,
        options: PlaneOptions,
    ) -> Result<ControlPlane, PlaneError> {
        const TRIES: usize = 3;
        let mut tries = 1;
        loop {
            match Self::start_once(binaries, options.clone()).await {
                Err(err) if tries < TRIES && lost_a_port(&err) => {
                    tracing::warn!("control plane start lost a port, starting again: {err}");
                    tries += 1;
                }
                outcome => return outcome,
            }
        }
    }

    async fn start_once(
        binaries: &KubeBinaries,
        options: PlaneOptions,
    ) -> Result<ControlPlane, PlaneError> {
        let guard = tempfile::Builder::new()
            .prefix("gpupool-plane-")
            .tempdir()
            .map_err(io_err("creating the control plane's folder"))?;
        let files = flags::PlaneFiles {
            dir: guard.path().to_path_buf(),
        };
        let pki = pki::Pki::generate()?;
        let ports = free_ports()?;
        write_private(&files.ca_cert(), &pki.ca_pem)?;
        write_private(&files.front_proxy_ca_cert(), &pki.front_proxy_ca_pem)?;
        write_private(&files.serving_cert(), &pki.serving.cert_pem)?;
        write_private(&files.serving_key(), &pki.serving.key_pem)?;
        write_private(&files.service_account_key(), &pki.service_account_key_pem)?;
        write_private(
            &files.service_account_public_key(),
            &pki.service_account_public_pem,
        )?;

        // Static tokens for the administrator and the two components, each as the user the
        // bootstrap RBAC policy knows it by.
        let users = [
            (ADMIN_USER, "system:masters"),
            (flags::SCHEDULER_USER, ""),
            (flags::CONTROLLER_MANAGER_USER, ""),
        ];
        let mut token_file = String::new();
        for (user, group) in users {
            let token = uuid::Uuid::new_v4().simple().to_string();
            token_file.push_str(&format!("{token},{user},{user},\"{group}\"\n"));
            let server = format!("https://127.0.0.1:{}", ports.apiserver);
            let config = kubeconfig_yaml(&server, &files.ca_cert(), json!({"token": token}));
            write_private(&files.kubeconfig(user), &config)?;
        }
        write_private(&files.tokens(), &token_file)?;
        let scheduler_config = flags::scheduler_config(
            options.scheduler_config.as_deref(),
            &files.kubeconfig(flags::SCHEDULER_USER),
        )?;
        write_private(&files.scheduler_config(), &scheduler_config)?;
        if options.audit {
            write_private(&files.audit_policy(), flags::AUDIT_POLICY)?;
        }

        let spawn = |name: &str, program: &Path, args: Vec<String>| {
            ManagedProcess::spawn(name, program, args, files.log(name))
        };
        let etcd = spawn(
            "etcd",
            &binaries.etcd,
            flags::etcd_args(&files, ports, &options),
        )?;
        let apiserver = spawn(
            "kube-apiserver",
            &binaries.apiserver,
            flags::apiserver_args(&files, ports, &options),
        )?;
        let plane = ControlPlane {
            processes: Mutex::new(Processes {
                etcd,
                apiserver,
                scheduler: ManagedProcess::placeholder(),
                controller_manager: ManagedProcess::placeholder(),
            }),
            files,
            ports,
            options,
            pki,
            turns: tenancy::Turns::default(),
            audit: audit::AuditLog::default(),
            _dir_guard: Some(guard),
        };
        let admin = plane.admin_client().await?;
        plane.wait_ready(&admin).await?;
        if plane.options.apiserver_only {
            return Ok(plane);
        }
        {
            let mut processes = plane.processes();
            processes.scheduler = spawn_component(
                &plane.files,
                "kube-scheduler",
                &binaries.scheduler,
                flags::scheduler_args(&plane.files, plane.ports, &plane.options),
            )?;
            processes.controller_manager = spawn_component(
                &plane.files,
                "kube-controller-manager",
                &binaries.controller_manager,
                flags::controller_manager_args(&plane.files, plane.ports, &plane.options),
            )?;
        }
        // Pods are refused until the namespace's `default` ServiceAccount exists, which the
        // controller-manager makes: the sign that it runs.
        plane
            .wait("the controller-manager to make default/default", || async {
                Api::<ServiceAccount>::namespaced(admin.clone(), "default")
                    .get_opt("default")
                    .await
                    .ok()
                    .flatten()
            })
            .await?;
        plane.check_running()?;
        Ok(plane)
    }

    fn processes(&self) -> std::sync::MutexGuard<'_, Processes> {
        self.processes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Fails naming the first component that is no longer running, with its log.
    pub fn check_running(&self) -> Result<(), PlaneError> {
        let mut processes = self.processes();
        for (component, process) in processes.all_mut() {
            if process.pid().is_none() {
                continue;
            }
            if let Some(status) = process.exit_status() {
                return Err(PlaneError::Exited {
                    component,
                    status: status.to_string(),
                    log: log_tail(&process.log(), 40),
                });
            }
        }
        Ok(())
    }

    async fn wait_ready(&self, admin: &Client) -> Result<(), PlaneError> {
        self.wait("kube-apiserver's /readyz", || async {
            let request = http::Request::get("/readyz").body(Vec::new()).ok()?;
            let body = admin.request_text(request).await.ok()?;
            (body.trim() == "ok").then_some(())
        })
        .await
    }

    /// Polls `check` until it yields, failing early when a component has exited.
    async fn wait<T, F, Fut>(&self, what: &str, mut check: F) -> Result<T, PlaneError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Option<T>>,
    {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(value) = check().await {
                return Ok(value);
            }
            self.check_running()?;
            if Instant::now() >= deadline {
                return Err(PlaneError::Timeout {
                    what: what.to_string(),
                    after: READY_TIMEOUT,
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// `https://127.0.0.1:<port>`.
    pub fn server_url(&self) -> String {
        format!("https://127.0.0.1:{}", self.ports.apiserver)
    }

    /// The CA that signed the serving certificate (and every client certificate).
    pub fn ca_cert(&self) -> PathBuf {
        self.files.ca_cert()
    }

    /// The administrator's kubeconfig (`system:masters`): for setup and checks, never for the
    /// programs under test.
    pub fn admin_kubeconfig(&self) -> PathBuf {
        self.files.kubeconfig(ADMIN_USER)
    }

    /// A client as the administrator. A new one per call: a kube client belongs to the runtime it
    /// was made on, and each test has its own.
    pub async fn admin_client(&self) -> Result<Client, PlaneError> {
        crate::harness::client_for_kubeconfig(&self.admin_kubeconfig())
            .await
            .map_err(|e| PlaneError::Io {
                what: "the administrator's client".into(),
                source: std::io::Error::other(e.to_string()),
            })
    }

    /// Waits until no other scenario uses the plane, and gives it cleared of what earlier turns
    /// made ([`tenancy`]). Held until the returned turn is dropped.
    pub async fn take_turn(&self) -> Result<tenancy::Turn, PlaneError> {
        let admin = self.admin_client().await?;
        Ok(self.turns.take(&admin).await)
    }

    pub fn options(&self) -> &PlaneOptions {
        &self.options
    }

    /// Writes a kubeconfig for ServiceAccount `namespace/account` at `path`, its token from the
    /// TokenRequest API; `bound_node` binds the token to that Node (which must exist), so that it
    /// carries the node's name (`authentication.kubernetes.io/node-name`) as a DaemonSet pod's
    /// token does.
    pub async fn service_account_kubeconfig(
        &self,
        admin: &Client,
        namespace: &str,
        account: &str,
        bound_node: Option<&str>,
        path: &Path,
    ) -> Result<(), PlaneError> {
        let bound_object_ref = match bound_node {
            None => None,
            Some(node) => {
                let uid = Api::<Node>::all(admin.clone())
                    .get(node)
                    .await
                    .map_err(kube_err(format!(
                        "reading Node {node} to bind a token to it"
                    )))?
                    .metadata
                    .uid;
                Some(BoundObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Node".into()),
                    name: Some(node.to_string()),
                    uid,
                })
            }
        };
        let request = TokenRequest {
            spec: TokenRequestSpec {
                audiences: Vec::new(),
                bound_object_ref,
                expiration_seconds: Some(TOKEN_LIFETIME_SECONDS),
            },
            ..Default::default()
        };
        let token = Api::<ServiceAccount>::namespaced(admin.clone(), namespace)
            .create_token_request(account, &PostParams::default(), &request)
            .await
            .map_err(kube_err(format!(
                "a token for ServiceAccount {namespace}/{account}"
            )))?
            .status
            .map(|s| s.token)
            .unwrap_or_default();
        let config = kubeconfig_yaml(&self.server_url(), &self.ca_cert(), json!({"token": token}));
        write_private(path, &config)
    }

    /// Writes a kubeconfig at `path` for the node identity `system:node:<node>` (group
    /// `system:nodes`, a client certificate), which the Node authorizer and NodeRestriction
    /// admission hold to that node, as they hold a kubelet.
    pub fn node_kubeconfig(&self, node: &str, path: &Path) -> Result<(), PlaneError> {
        let cert = self
            .pki
            .client_cert(&format!("system:node:{node}"), &["system:nodes"])?;
        let cert_path = path.with_extension("crt");
        let key_path = path.with_extension("key");
        write_private(&cert_path, &cert.cert_pem)?;
        write_private(&key_path, &cert.key_pem)?;
        let user = json!({
            "client-certificate": cert_path.display().to_string(),
            "client-key": key_path.display().to_string(),
        });
        write_private(
            path,
            &kubeconfig_yaml(&self.server_url(), &self.ca_cert(), user),
        )
    }

    /// Creates a hand-made Node (or finds the one of that name) and removes the not-ready taint
    /// admission put on it; returns it as stored.
    pub async fn create_node(&self, admin: &Client, shape: &NodeShape) -> Result<Node, PlaneError> {
        let nodes: Api<Node> = Api::all(admin.clone());
        let what = || format!("creating Node {}", shape.name);
        let node = match nodes
            .create(&PostParams::default(), &node_object(shape))
            .await
        {
            Ok(node) => node,
            Err(kube::Error::Api(status)) if status.code == 409 => {
                nodes.get(&shape.name).await.map_err(kube_err(what()))?
            }
            Err(err) => return Err(kube_err(what())(err)),
        };
        match nodes::without_not_ready_taint(&node) {
            None => Ok(node),
            Some(patch) => nodes
                .patch(&shape.name, &PatchParams::default(), &Patch::Merge(patch))
                .await
                .map_err(kube_err(format!("untainting Node {}", shape.name))),
        }
    }

    /// Creates `slices` as the administrator (hand-made nodes have no driver to publish them).
    pub async fn publish_slices(
        &self,
        admin: &Client,
        slices: &[ResourceSlice],
    ) -> Result<(), PlaneError> {
        let api: Api<ResourceSlice> = Api::all(admin.clone());
        for slice in slices {
            let name = slice.metadata.name.clone().unwrap_or_default();
            api.create(&PostParams::default(), slice)
                .await
                .map_err(kube_err(format!("creating ResourceSlice {name}")))?;
        }
        Ok(())
    }

    /// Starts kube-scheduler again with another configuration (`None`: the default profile), for
    /// comparing profiles on one plane. Pods it had not bound yet are scheduled by the new one.
    pub async fn restart_scheduler(&self, config: Option<&str>) -> Result<(), PlaneError> {
        let yaml = flags::scheduler_config(config, &self.files.kubeconfig(flags::SCHEDULER_USER))?;
        let mut process = std::mem::replace(
            &mut self.processes().scheduler,
            ManagedProcess::placeholder(),
        );
        process.stop(Duration::from_secs(10)).await;
        write_private(&self.files.scheduler_config(), &yaml)?;
        process.start()?;
        self.processes().scheduler = process;
        Ok(())
    }

    /// The requests kube-apiserver's audit log recorded so far ([`PlaneOptions::audit`]), oldest
    /// first; read incrementally, so calling it often costs only what was added.
    pub fn audit_requests(&self) -> Result<Vec<audit::AuditRequest>, PlaneError> {
        self.audit
            .read(&self.files.audit_log())
            .map_err(io_err("reading kube-apiserver's audit log"))
    }

    /// Every component's log so far, by component.
    pub fn logs(&self) -> BTreeMap<String, String> {
        let mut processes = self.processes();
        processes
            .all_mut()
            .into_iter()
            .map(|(name, process)| (name.to_string(), process.log()))
            .collect()
    }

    /// Prints the last lines of each component's log to stderr (a failed test's output).
    pub fn print_logs(&self, lines: usize) {
        for (name, log) in self.logs() {
            print_log_tail(&name, &log, lines);
        }
    }
}

fn spawn_component(
    files: &flags::PlaneFiles,
    name: &str,
    program: &Path,
    args: Vec<String>,
) -> Result<ManagedProcess, PlaneError> {
    Ok(ManagedProcess::spawn(name, program, args, files.log(name))?)
}

fn log_tail(log: &str, lines: usize) -> String {
    let all: Vec<&str> = log.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Whether a start failed because a component could not bind the port it was given.
fn lost_a_port(err: &PlaneError) -> bool {
    matches!(err, PlaneError::Exited { log, .. } if log.contains("address already in use"))
}

/// Five free loopback ports for a plane's components (see [`free_loopback_ports`]).
fn free_ports() -> Result<flags::Ports, PlaneError> {
    let ports = free_loopback_ports(5)?;
    Ok(flags::Ports {
        etcd_client: ports[0],
        etcd_peer: ports[1],
        apiserver: ports[2],
        scheduler: ports[3],
        controller_manager: ports[4],
    })
}

/// `count` free loopback ports, taken at once so none is handed out twice, below the kernel's
/// ephemeral range: a port from that range, free when chosen, can become the source port of any
/// outgoing connection (the tests make thousands) before the component that was given it binds it.
pub(crate) fn free_loopback_ports(count: usize) -> Result<Vec<u16>, PlaneError> {
    let ephemeral_start = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let below = ephemeral_start.saturating_sub(1).max(PORTS_FROM + 1000);
    let first = rand::random_range(PORTS_FROM..below);
    let ports: Vec<u16> = (first..below)
        .chain(PORTS_FROM..first)
        .filter_map(|port| std::net::TcpListener::bind(("127.0.0.1", port)).ok())
        .take(count)
        .filter_map(|l| l.local_addr().ok().map(|a| a.port()))
        .collect();
    if ports.len() < count {
        return Err(PlaneError::Io {
            what: format!("finding free loopback ports in {PORTS_FROM}..{below}"),
            source: std::io::Error::from(std::io::ErrorKind::AddrInUse),
        });
    }
    Ok(ports)
}

/// Where the planes' ports are looked for, up to the ephemeral range.
const PORTS_FROM: u16 = 20000;

/// A kubeconfig for `server` trusting `ca`, authenticating as `user` (a kubeconfig `user` entry).
pub fn kubeconfig_yaml(server: &str, ca: &Path, user: serde_json::Value) -> String {
    let config = json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "gpupool-plane", "cluster": {
            "server": server, "certificate-authority": ca.display().to_string()}}],
        "users": [{"name": "user", "user": user}],
        "contexts": [{"name": "gpupool-plane", "context": {"cluster": "gpupool-plane", "user": "user"}}],
        "current-context": "gpupool-plane",
    });
    serde_yaml::to_string(&config).expect("a kubeconfig is YAML")
}

/// Writes a file only its owner may read (keys, tokens, kubeconfigs).
fn write_private(path: &Path, contents: &str) -> Result<(), PlaneError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .map_err(io_err(format!("writing {}", path.display())))?;
    file.write_all(contents.as_bytes())
        .map_err(io_err(format!("writing {}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_five_distinct_bindable_ones_below_the_ephemeral_range() {
        let ports = free_ports().unwrap();
        let all = [
            ports.etcd_client,
            ports.etcd_peer,
            ports.apiserver,
            ports.scheduler,
            ports.controller_manager,
        ];
        let distinct: std::collections::BTreeSet<u16> = all.into_iter().collect();
        assert_eq!(distinct.len(), 5, "{all:?}");
        for port in all {
            assert!((PORTS_FROM..32768).contains(&port), "{port}");
            std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
        }
    }

    #[test]
    fn only_a_bind_failure_starts_the_plane_again() {
        let exited = |log: &str| PlaneError::Exited {
            component: "kube-scheduler",
            status: "exit status: 1".into(),
            log: log.into(),
        };
        assert!(lost_a_port(&exited(
            "failed to listen on 127.0.0.1:35507: listen tcp 127.0.0.1:35507: bind: address already in use"
        )));
        assert!(!lost_a_port(&exited("unknown flag: --feature-gates")));
        assert!(!lost_a_port(&PlaneError::Unavailable("no binaries".into())));
    }
}

//! The command lines of etcd, kube-apiserver, kube-scheduler and kube-controller-manager on
//! loopback (pure: paths and ports in, arguments out), and the scheduler's configuration file.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

/// The DRA feature gates gpupool uses, on every component alike (kube-apiserver validates and
/// serves the fields, kube-scheduler allocates with them, kube-controller-manager's claim
/// controllers follow them).
pub const FEATURE_GATES: &[&str] = &[
    "DynamicResourceAllocation",
    "DRAAdminAccess",
    "DRAConsumableCapacity",
    "DRAPartitionableDevices",
    "DRADeviceTaints",
    "DRADeviceTaintRules",
    "DRAPrioritizedList",
    "DRAExtendedResource",
    "DRAResourceClaimDeviceStatus",
    "DRADeviceBindingConditions",
    "DRAResourceClaimGranularStatusAuthorization",
    "DRASchedulerFilterTimeout",
    "ResourceHealthStatus",
    "ResourceHealthStatusMessage",
];

/// API versions served beside `resource.k8s.io/v1` (on by default): the older DRA versions a
/// kubectl or client of an earlier release may still ask for, and DeviceTaintRules.
pub const RUNTIME_CONFIG: &[&str] = &[
    "resource.k8s.io/v1beta1=true",
    "resource.k8s.io/v1beta2=true",
    "resource.k8s.io/v1beta2/devicetaintrules=true",
];

/// Admission plugins enabled besides the defaults (ValidatingAdmissionPolicy is one of those, named
/// so that a later default list cannot drop it): NodeRestriction, as every kubeadm cluster runs.
pub const ADMISSION_PLUGINS: &[&str] = &["NodeRestriction", "ValidatingAdmissionPolicy"];

/// The `kubernetes` Service's range; its first address is in the serving certificate.
pub const SERVICE_CLUSTER_IP_RANGE: &str = "10.96.0.0/16";
/// The ServiceAccount token issuer (and audience) of a kubeadm cluster.
pub const SERVICE_ACCOUNT_ISSUER: &str = "https://kubernetes.default.svc";

/// What a plane is started with beyond the DRA defaults: what the gang-scheduling and trace work
/// needs (alpha gates, alpha APIs, scheduler profiles) without a second kind of plane.
#[derive(Clone, Debug, Default)]
pub struct PlaneOptions {
    /// Feature gates enabled on every component besides [`FEATURE_GATES`] (`GenericWorkload`).
    pub feature_gates: Vec<String>,
    /// Feature gates enabled on kube-scheduler only (`GangScheduling`).
    pub scheduler_feature_gates: Vec<String>,
    /// `--runtime-config` entries besides [`RUNTIME_CONFIG`] (`scheduling.k8s.io/v1alpha2=true`).
    pub runtime_config: Vec<String>,
    /// A `KubeSchedulerConfiguration` (YAML) for kube-scheduler: its profiles, plugins and
    /// weights are kept; `clientConnection.kubeconfig` and `leaderElection` are the plane's.
    pub scheduler_config: Option<String>,
    /// etcd without fsync. For throughput runs only: every write becomes cheaper than a real
    /// cluster's, so no figure of a write's cost may come from such a plane.
    pub etcd_unsafe_no_fsync: bool,
    /// etcd and kube-apiserver only, as envtest starts them: for a client that allocates and
    /// reserves claims itself (kube-controller-manager would take reservations of pods that do
    /// not exist away, and deallocate).
    pub apiserver_only: bool,
    /// Record every request on ResourceClaims, ResourceSlices and Events in kube-apiserver's audit
    /// log ([`crate::plane::ControlPlane::audit_requests`]): what a benchmark counts per client.
    pub audit: bool,
}

impl PlaneOptions {
    pub fn feature_gate(mut self, gate: &str) -> Self {
        self.feature_gates.push(gate.to_string());
        self
    }

    pub fn scheduler_feature_gate(mut self, gate: &str) -> Self {
        self.scheduler_feature_gates.push(gate.to_string());
        self
    }

    pub fn runtime_config(mut self, entry: &str) -> Self {
        self.runtime_config.push(entry.to_string());
        self
    }

    pub fn scheduler_config(mut self, yaml: &str) -> Self {
        self.scheduler_config = Some(yaml.to_string());
        self
    }

    pub fn apiserver_only(mut self) -> Self {
        self.apiserver_only = true;
        self
    }

    pub fn audit(mut self) -> Self {
        self.audit = true;
        self
    }
}

/// Kubernetes 1.36 native gang scheduling (alpha), as the gang scenario and
/// deploy/examples/gang/ need it.
pub const GANG_FEATURE_GATE: &str = "GenericWorkload";
pub const GANG_SCHEDULER_FEATURE_GATE: &str = "GangScheduling";
pub const GANG_RUNTIME_CONFIG: &str = "scheduling.k8s.io/v1alpha2=true";

impl PlaneOptions {
    /// Gang scheduling on: `GenericWorkload` on every component, `GangScheduling` on
    /// kube-scheduler, and the `scheduling.k8s.io/v1alpha2` API (PodGroup, Workload) served.
    pub fn gang_scheduling(self) -> Self {
        self.feature_gate(GANG_FEATURE_GATE)
            .scheduler_feature_gate(GANG_SCHEDULER_FEATURE_GATE)
            .runtime_config(GANG_RUNTIME_CONFIG)
    }
}

/// Loopback ports of one plane.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ports {
    pub etcd_client: u16,
    pub etcd_peer: u16,
    pub apiserver: u16,
    pub scheduler: u16,
    pub controller_manager: u16,
}

/// The plane's files, all under one folder.
#[derive(Clone, Debug)]
pub struct PlaneFiles {
    pub dir: PathBuf,
}

impl PlaneFiles {
    pub fn etcd_data(&self) -> PathBuf {
        self.dir.join("etcd")
    }
    pub fn ca_cert(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }
    pub fn front_proxy_ca_cert(&self) -> PathBuf {
        self.dir.join("front-proxy-ca.crt")
    }
    pub fn serving_cert(&self) -> PathBuf {
        self.dir.join("apiserver.crt")
    }
    pub fn serving_key(&self) -> PathBuf {
        self.dir.join("apiserver.key")
    }
    pub fn service_account_key(&self) -> PathBuf {
        self.dir.join("sa.key")
    }
    pub fn service_account_public_key(&self) -> PathBuf {
        self.dir.join("sa.pub")
    }
    pub fn tokens(&self) -> PathBuf {
        self.dir.join("tokens.csv")
    }
    pub fn kubeconfig(&self, user: &str) -> PathBuf {
        self.dir.join(format!("kubeconfig-{user}"))
    }
    pub fn scheduler_config(&self) -> PathBuf {
        self.dir.join("kube-scheduler.yaml")
    }
    pub fn audit_policy(&self) -> PathBuf {
        self.dir.join("audit-policy.yaml")
    }
    pub fn audit_log(&self) -> PathBuf {
        self.dir.join("audit.log")
    }
    pub fn log(&self, component: &str) -> PathBuf {
        self.dir.join(format!("{component}.log"))
    }
}

fn path(p: &Path) -> String {
    p.display().to_string()
}

fn gates(extra: &[&[String]]) -> String {
    FEATURE_GATES
        .iter()
        .map(|g| format!("{g}=true"))
        .chain(extra.iter().flat_map(|list| list.iter()).map(|g| {
            if g.contains('=') {
                g.clone()
            } else {
                format!("{g}=true")
            }
        }))
        .collect::<Vec<_>>()
        .join(",")
}

pub fn etcd_args(files: &PlaneFiles, ports: Ports, options: &PlaneOptions) -> Vec<String> {
    let client = format!("http://127.0.0.1:{}", ports.etcd_client);
    let peer = format!("http://127.0.0.1:{}", ports.etcd_peer);
    let mut args = vec![
        "--name".into(),
        "default".into(),
        "--data-dir".into(),
        path(&files.etcd_data()),
        "--listen-client-urls".into(),
        client.clone(),
        "--advertise-client-urls".into(),
        client,
        "--listen-peer-urls".into(),
        peer.clone(),
        "--initial-advertise-peer-urls".into(),
        peer.clone(),
        "--initial-cluster".into(),
        format!("default={peer}"),
        "--log-level".into(),
        "warn".into(),
    ];
    if options.etcd_unsafe_no_fsync {
        args.push("--unsafe-no-fsync".into());
    }
    args
}

pub fn apiserver_args(files: &PlaneFiles, ports: Ports, options: &PlaneOptions) -> Vec<String> {
    let runtime_config: Vec<String> = RUNTIME_CONFIG
        .iter()
        .map(|s| s.to_string())
        .chain(options.runtime_config.iter().cloned())
        .collect();
    let ca = path(&files.ca_cert());
    let sa_key = path(&files.service_account_key());
    let mut args: Vec<String> = [
        "--etcd-servers",
        &format!("http://127.0.0.1:{}", ports.etcd_client),
        "--bind-address",
        "127.0.0.1",
        "--advertise-address",
        "127.0.0.1",
        "--secure-port",
        &ports.apiserver.to_string(),
        "--tls-cert-file",
        &path(&files.serving_cert()),
        "--tls-private-key-file",
        &path(&files.serving_key()),
        "--client-ca-file",
        &ca,
        // The request-header flags let the scheduler and the controller-manager find the
        // front-proxy CA in kube-system/extension-apiserver-authentication (they log an error
        // every few seconds without it).
        "--requestheader-client-ca-file",
        &path(&files.front_proxy_ca_cert()),
        "--requestheader-allowed-names",
        "front-proxy-client",
        "--requestheader-username-headers",
        "X-Remote-User",
        "--requestheader-group-headers",
        "X-Remote-Group",
        "--requestheader-extra-headers-prefix",
        "X-Remote-Extra-",
        "--service-account-issuer",
        SERVICE_ACCOUNT_ISSUER,
        "--service-account-key-file",
        &path(&files.service_account_public_key()),
        "--service-account-signing-key-file",
        &sa_key,
        "--token-auth-file",
        &path(&files.tokens()),
        "--authorization-mode",
        "Node,RBAC",
        "--enable-admission-plugins",
        &ADMISSION_PLUGINS.join(","),
        "--allow-privileged=true",
        "--service-cluster-ip-range",
        SERVICE_CLUSTER_IP_RANGE,
        "--endpoint-reconciler-type",
        "none",
        "--feature-gates",
        &gates(&[&options.feature_gates]),
        "--runtime-config",
        &runtime_config.join(","),
    ]
    .map(String::from)
    .to_vec();
    if options.audit {
        args.extend([
            "--audit-policy-file".into(),
            path(&files.audit_policy()),
            "--audit-log-path".into(),
            path(&files.audit_log()),
            // Each event written as its request completes (no fsync): what a count reads back
            // is complete once the requests have answered.
            "--audit-log-mode".into(),
            "blocking".into(),
            "--audit-log-maxsize".into(),
            "0".into(),
        ]);
    }
    args
}

/// The audit policy of [`PlaneOptions::audit`]: one event per request (when it completes), with
/// no bodies, for what gpupool's driver reads and writes; nothing else.
pub const AUDIT_POLICY: &str = "apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: Metadata
  resources:
  - group: resource.k8s.io
    resources: [resourceclaims, resourceclaims/status, resourceslices]
  - group: \"\"
    resources: [events]
  - group: events.k8s.io
    resources: [events]
- level: None
";

/// Flags kube-scheduler and kube-controller-manager share: who they are, whom they ask to
/// authenticate and authorize callers of their own endpoints, where they listen.
fn component_args(kubeconfig: &Path, port: u16, gates: String) -> Vec<String> {
    let kubeconfig = path(kubeconfig);
    [
        "--authentication-kubeconfig",
        &kubeconfig,
        "--authorization-kubeconfig",
        &kubeconfig,
        "--bind-address",
        "127.0.0.1",
        "--secure-port",
        &port.to_string(),
        "--feature-gates",
        &gates,
    ]
    .map(String::from)
    .to_vec()
}

pub fn scheduler_args(files: &PlaneFiles, ports: Ports, options: &PlaneOptions) -> Vec<String> {
    let mut args = vec!["--config".into(), path(&files.scheduler_config())];
    args.extend(component_args(
        &files.kubeconfig(SCHEDULER_USER),
        ports.scheduler,
        gates(&[&options.feature_gates, &options.scheduler_feature_gates]),
    ));
    args
}

pub fn controller_manager_args(
    files: &PlaneFiles,
    ports: Ports,
    options: &PlaneOptions,
) -> Vec<String> {
    let kubeconfig = files.kubeconfig(CONTROLLER_MANAGER_USER);
    let mut args = vec![
        "--kubeconfig".into(),
        path(&kubeconfig),
        "--leader-elect=false".into(),
        // No kubelet heartbeats the hand-made Nodes: node-lifecycle would taint them
        // unreachable and evict their pods.
        "--controllers".into(),
        "*,-node-lifecycle-controller".into(),
        // Each controller on its own ServiceAccount, as kubeadm runs it (the controller-manager's
        // own role is only enough to make those tokens).
        "--use-service-account-credentials=true".into(),
        "--service-account-private-key-file".into(),
        path(&files.service_account_key()),
        "--root-ca-file".into(),
        path(&files.ca_cert()),
    ];
    args.extend(component_args(
        &kubeconfig,
        ports.controller_manager,
        gates(&[&options.feature_gates]),
    ));
    args
}

/// The users kube-scheduler and kube-controller-manager run as: the names the bootstrap RBAC
/// policy binds their roles to.
pub const SCHEDULER_USER: &str = "system:kube-scheduler";
pub const CONTROLLER_MANAGER_USER: &str = "system:kube-controller-manager";

#[derive(Debug, thiserror::Error)]
pub enum SchedulerConfigError {
    #[error("the KubeSchedulerConfiguration is not YAML: {0}")]
    Yaml(#[from] serde_yaml::Error),
    #[error("the KubeSchedulerConfiguration is not a mapping")]
    NotAMapping,
}

/// The scheduler's `--config`: `user`'s configuration (or an empty one) with the plane's
/// connection and no leader election (one scheduler per plane).
pub fn scheduler_config(
    user: Option<&str>,
    kubeconfig: &Path,
) -> Result<String, SchedulerConfigError> {
    let mut config: Value = match user {
        Some(yaml) => serde_yaml::from_str(yaml)?,
        None => json!({}),
    };
    let object = config
        .as_object_mut()
        .ok_or(SchedulerConfigError::NotAMapping)?;
    object
        .entry("apiVersion")
        .or_insert_with(|| json!("kubescheduler.config.k8s.io/v1"));
    object
        .entry("kind")
        .or_insert_with(|| json!("KubeSchedulerConfiguration"));
    let connection = object
        .entry("clientConnection")
        .or_insert_with(|| json!({}));
    if let Some(connection) = connection.as_object_mut() {
        connection.insert("kubeconfig".into(), json!(path(kubeconfig)));
    }
    object.insert("leaderElection".into(), json!({"leaderElect": false}));
    Ok(serde_yaml::to_string(&config)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files() -> PlaneFiles {
        PlaneFiles {
            dir: PathBuf::from("/p"),
        }
    }

    const PORTS: Ports = Ports {
        etcd_client: 1,
        etcd_peer: 2,
        apiserver: 3,
        scheduler: 4,
        controller_manager: 5,
    };

    fn value_of<'a>(args: &'a [String], flag: &str) -> &'a str {
        let i = args
            .iter()
            .position(|a| a == flag)
            .unwrap_or_else(|| panic!("no {flag} in {args:?}"));
        &args[i + 1]
    }

    #[test]
    fn every_component_gets_the_dra_gates_and_the_scheduler_its_own_too() {
        let options = PlaneOptions::default()
            .feature_gate("GenericWorkload")
            .scheduler_feature_gate("GangScheduling")
            .runtime_config("scheduling.k8s.io/v1alpha2=true");
        let apiserver = apiserver_args(&files(), PORTS, &options);
        let scheduler = scheduler_args(&files(), PORTS, &options);
        let manager = controller_manager_args(&files(), PORTS, &options);
        for args in [&apiserver, &scheduler, &manager] {
            let gates = value_of(args, "--feature-gates");
            assert!(
                gates.starts_with("DynamicResourceAllocation=true,"),
                "{gates}"
            );
            assert!(gates.contains("DRAConsumableCapacity=true"), "{gates}");
            assert!(gates.contains("GenericWorkload=true"), "{gates}");
            assert_eq!(
                gates.contains("GangScheduling=true"),
                std::ptr::eq(args, &scheduler),
                "{gates}"
            );
        }
        assert_eq!(
            value_of(&apiserver, "--runtime-config"),
            "resource.k8s.io/v1beta1=true,resource.k8s.io/v1beta2=true,\
             resource.k8s.io/v1beta2/devicetaintrules=true,scheduling.k8s.io/v1alpha2=true"
        );
        assert_eq!(value_of(&apiserver, "--authorization-mode"), "Node,RBAC");
        assert_eq!(
            value_of(&apiserver, "--enable-admission-plugins"),
            "NodeRestriction,ValidatingAdmissionPolicy"
        );
        assert_eq!(value_of(&apiserver, "--etcd-servers"), "http://127.0.0.1:1");
        assert_eq!(value_of(&scheduler, "--secure-port"), "4");
        assert_eq!(
            value_of(&manager, "--controllers"),
            "*,-node-lifecycle-controller"
        );
    }

    #[test]
    fn gang_scheduling_turns_on_the_alpha_gates_and_api_where_each_belongs() {
        let options = PlaneOptions::default().gang_scheduling();
        let apiserver = apiserver_args(&files(), PORTS, &options);
        let scheduler = scheduler_args(&files(), PORTS, &options);
        let manager = controller_manager_args(&files(), PORTS, &options);
        for args in [&apiserver, &scheduler, &manager] {
            let gates = value_of(args, "--feature-gates");
            let on = |gate: &str| gates.split(',').any(|g| g == format!("{gate}=true"));
            assert!(on("GenericWorkload"), "{gates}");
            assert!(on("DynamicResourceAllocation"), "{gates}");
            assert_eq!(
                on("GangScheduling"),
                std::ptr::eq(args, &scheduler),
                "{gates}"
            );
        }
        assert!(
            value_of(&apiserver, "--runtime-config").ends_with(",scheduling.k8s.io/v1alpha2=true")
        );
        assert!(!scheduler.iter().any(|a| a == "--runtime-config"));
    }

    #[test]
    fn the_scheduler_config_keeps_the_profiles_and_takes_the_planes_connection() {
        let user = "apiVersion: kubescheduler.config.k8s.io/v1\nkind: KubeSchedulerConfiguration\n\
                    clientConnection: {qps: 500}\nleaderElection: {leaderElect: true}\n\
                    profiles:\n- schedulerName: default-scheduler\n  plugins: {score: {enabled: [{name: NodeResourcesFit, weight: 5}]}}\n";
        let config: Value =
            serde_yaml::from_str(&scheduler_config(Some(user), Path::new("/p/k")).unwrap())
                .unwrap();
        assert_eq!(config["clientConnection"]["kubeconfig"], "/p/k");
        assert_eq!(config["clientConnection"]["qps"], 500);
        assert_eq!(config["leaderElection"]["leaderElect"], false);
        assert_eq!(
            config["profiles"][0]["plugins"]["score"]["enabled"][0]["weight"],
            5
        );
        let plain: Value =
            serde_yaml::from_str(&scheduler_config(None, Path::new("/p/k")).unwrap()).unwrap();
        assert_eq!(plain["kind"], "KubeSchedulerConfiguration");
        assert!(matches!(
            scheduler_config(Some("- a list"), Path::new("/p/k")),
            Err(SchedulerConfigError::NotAMapping)
        ));
    }
}

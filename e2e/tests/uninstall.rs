//! Uninstalling leaves nothing behind, done as an operator does it, against the API server emulator
//! and against the real control plane (kube-apiserver, and kube-controller-manager's garbage
//! collector and namespace controller):
//! the real `helm install` (or `kubectl apply -k deploy/base`), a user's ComputeProfile from the
//! examples, the real controller started as the installed Deployment starts it (its command, its
//! args, its ServiceAccount's token) until it has made its DeviceClasses, its Lease and the
//! profile's template, each with its owner; then the real `helm uninstall` (or `kubectl delete -k`)
//! and every object the server holds compared with what it held before the install.
//!
//! What may stay is what README's clean-up paragraph leaves to the operator: after `helm uninstall`
//! the CRDs (Helm keeps those of `crds/`), the release namespace and the user's own objects; after
//! `kubectl delete -f deploy/crds/` and deleting the namespace, only the user's namespace. The
//! emulator does the garbage collector's part at once (see its `store::gc`), where a real cluster
//! takes a moment (the comparison waits for it). Events are not compared: a cluster expires them
//! (after an hour by default); nor what a cluster makes in every namespace (its `default`
//! ServiceAccount and `kube-root-ca.crt` ConfigMap), which goes with the namespace.
//!
//! Needs the real Helm (`GPUPOOL_HELM`, or `helm` on PATH; `.ci/install-helm` installs it) and the
//! real kubectl; each test says why it skips without them.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

mod common;

use gpupool_api::crd::{ComputeProfile, GpuModel};
use gpupool_e2e::harness::{
    self, client_for_kubeconfig, find_binary, kubectl_path, service_account_kubeconfig, wait_for,
    workspace_root, Backend, ManagedProcess, COMPONENT_NAMESPACE, CONTROLLER_SERVICE_ACCOUNT,
};
use gpupool_e2e::plane::tenancy::Turn;
use gpupool_e2e::plane::ControlPlane;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::rbac::v1::{ClusterRole, Role};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaimTemplate};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{Api, DynamicObject, ListParams};
use kube::discovery::{verbs, Discovery};
use kube::{Client, Resource, ResourceExt};

/// The release, its namespace (where the ServiceAccount tokens of the harness point) and the
/// Lease the controller elects with.
const RELEASE: &str = "gpupool";
const NAMESPACE: &str = COMPONENT_NAMESPACE;
const LEASE: &str = "gpupool-controller";
/// deploy/examples/compute-profile-half-a100.yaml: a user's profile and namespace.
const PROFILE_EXAMPLE: &str = "deploy/examples/compute-profile-half-a100.yaml";
const USER_NAMESPACE: &str = "team-a";
const PROFILE: &str = "half-a100";
const WAIT: Duration = Duration::from_secs(30);

/// The real Helm: `GPUPOOL_HELM`, else `helm` on PATH; `None` (with the reason printed) without it.
/// A `GPUPOOL_HELM` that does not run fails: CI set it, so it must not pass as a skip.
fn helm(test: &str) -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("GPUPOOL_HELM") {
        let path = PathBuf::from(path);
        let out = std::process::Command::new(&path)
            .arg("version")
            .output()
            .unwrap_or_else(|e| panic!("GPUPOOL_HELM={}: {e}", path.display()));
        assert!(
            out.status.success(),
            "GPUPOOL_HELM={} version",
            path.display()
        );
        return Some(path);
    }
    let on_path = std::process::Command::new("helm")
        .arg("version")
        .output()
        .is_ok_and(|o| o.status.success());
    if on_path {
        return Some(PathBuf::from("helm"));
    }
    println!(
        "skipping {test}: no helm (set GPUPOOL_HELM or put helm on PATH; `.ci/install-helm` \
         installs Helm v4.1.4 and prints its path), and the real Helm is what is tested"
    );
    None
}

fn kubectl(test: &str) -> Option<PathBuf> {
    let path = kubectl_path();
    if path.is_none() {
        println!(
            "skipping {test}: kubectl is not installed, and the real kubectl is what is tested"
        );
    }
    path
}

/// The API server: the emulator, or the shared control plane for this test's turn.
enum Server {
    Emulator(gpupool_apiserver::ApiServer),
    Plane {
        plane: &'static ControlPlane,
        _turn: Turn,
    },
}

/// The API server, an administrator's kubeconfig for it, and the folder they live in.
struct Cluster {
    server: Server,
    dir: tempfile::TempDir,
    kubeconfig: PathBuf,
    admin: Client,
    kubectl: PathBuf,
}

impl Cluster {
    async fn start(kubectl: PathBuf, backend: Backend) -> Cluster {
        let dir = tempfile::tempdir().expect("tempdir");
        let (server, kubeconfig) = match backend {
            Backend::Emulator => {
                let server = gpupool_apiserver::ApiServer::start()
                    .await
                    .expect("start the API emulator");
                let kubeconfig = dir.path().join("kubeconfig");
                server.write_kubeconfig(&kubeconfig).expect("kubeconfig");
                (Server::Emulator(server), kubeconfig)
            }
            _ => {
                let plane = ControlPlane::shared()
                    .await
                    .unwrap_or_else(|e| panic!("{e}"));
                let turn = plane.take_turn().await.unwrap_or_else(|e| panic!("{e}"));
                let kubeconfig = plane.admin_kubeconfig();
                (Server::Plane { plane, _turn: turn }, kubeconfig)
            }
        };
        let admin = client_for_kubeconfig(&kubeconfig).await.expect("client");
        Cluster {
            server,
            dir,
            kubeconfig,
            admin,
            kubectl,
        }
    }

    /// A kubeconfig with the token of the controller's ServiceAccount.
    async fn controller_kubeconfig(&self) -> PathBuf {
        match &self.server {
            Server::Emulator(server) => service_account_kubeconfig(
                server,
                self.dir.path(),
                CONTROLLER_SERVICE_ACCOUNT,
                None,
            )
            .expect("the controller's kubeconfig"),
            Server::Plane { plane, .. } => {
                let path = self.dir.path().join("kubeconfig-controller");
                plane
                    .service_account_kubeconfig(
                        &self.admin,
                        NAMESPACE,
                        CONTROLLER_SERVICE_ACCOUNT,
                        None,
                        &path,
                    )
                    .await
                    .expect("the controller's kubeconfig");
                path
            }
        }
    }

    /// Runs `program args` against this cluster from the workspace root, failing the test unless it
    /// succeeds.
    async fn run(&self, program: &Path, args: &[&str]) -> String {
        let home = self.dir.path().join("helm");
        let out = tokio::process::Command::new(program)
            .args(args)
            .current_dir(workspace_root())
            .env("KUBECONFIG", &self.kubeconfig)
            .env("KUBECACHEDIR", self.dir.path().join("kubectl-cache"))
            // Helm keeps its release records in ConfigMaps instead of Secrets: the emulator decodes
            // only some protobuf bodies (Helm writes its records with a typed client), the objects
            // of the chart are the same either way.
            .env("HELM_DRIVER", "configmap")
            .env("HELM_CONFIG_HOME", home.join("config"))
            .env("HELM_CACHE_HOME", home.join("cache"))
            .env("HELM_DATA_HOME", home.join("data"))
            .output()
            .await
            .unwrap_or_else(|e| panic!("running {}: {e}", program.display()));
        assert!(
            out.status.success(),
            "{} {}:\n{}{}",
            program.display(),
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    async fn kubectl(&self, args: &[&str]) -> String {
        let kubectl = self.kubectl.clone();
        self.run(&kubectl, args).await
    }

    /// Every object the server holds but Events and what a cluster makes in every namespace, as
    /// `<group>/<Kind> <namespace>/<name>`.
    async fn everything(&self) -> BTreeSet<String> {
        let discovery = Discovery::new(self.admin.clone())
            .run()
            .await
            .expect("discovery");
        let mut objects = BTreeSet::new();
        for group in discovery.groups() {
            for (resource, capabilities) in group.recommended_resources() {
                if resource.kind == "Event" || !capabilities.supports_operation(verbs::LIST) {
                    continue;
                }
                let api: Api<DynamicObject> = Api::all_with(self.admin.clone(), &resource);
                let list = api
                    .list(&ListParams::default())
                    .await
                    .unwrap_or_else(|e| panic!("listing {}: {e}", resource.plural));
                for object in list.items {
                    let name = object.metadata.name.as_deref().unwrap_or("");
                    // (openshift-service-ca.crt: the controller-manager of the v1.36.2 build CI
                    // uses, from the tree OpenShift's MicroShift vendors, makes that one too.)
                    let per_namespace = match resource.kind.as_str() {
                        "ServiceAccount" => name == "default",
                        "ConfigMap" => {
                            matches!(name, "kube-root-ca.crt" | "openshift-service-ca.crt")
                        }
                        _ => false,
                    };
                    if per_namespace {
                        continue;
                    }
                    objects.insert(format!(
                        "{}/{} {}/{}",
                        resource.group,
                        resource.kind,
                        object.metadata.namespace.as_deref().unwrap_or(""),
                        object.metadata.name.as_deref().unwrap_or("")
                    ));
                }
            }
        }
        objects
    }

    /// The controller as the installed Deployment runs it: its command and args, `$(VAR)` taken from
    /// the pod's downward API, as its ServiceAccount; only the metrics port is a free one, since
    /// tests run side by side.
    async fn start_controller(&self) -> ManagedProcess {
        let deployment = Api::<Deployment>::namespaced(self.admin.clone(), NAMESPACE)
            .get("gpupool-controller")
            .await
            .expect("the installed controller Deployment");
        let pod = deployment.spec.expect("spec").template.spec.expect("pod");
        let container = pod
            .containers
            .into_iter()
            .find(|c| c.name == "controller")
            .expect("container controller");
        let pod_name = "gpupool-controller-7d9c5-x2x4q";
        let value_of = |name: &str| {
            let from = container
                .env
                .iter()
                .flatten()
                .find(|e| e.name == name)?
                .value_from
                .as_ref()?
                .field_ref
                .as_ref()?;
            match from.field_path.as_str() {
                "metadata.name" => Some(pod_name.to_string()),
                "metadata.namespace" => Some(NAMESPACE.to_string()),
                other => panic!("the controller's env {name} comes from {other}"),
            }
        };
        let expand = |arg: &str| {
            let mut arg = arg.to_string();
            while let Some(start) = arg.find("$(") {
                let end = start + arg[start..].find(')').expect("$(VAR) closed");
                let var = &arg[start + 2..end];
                let value = value_of(var).unwrap_or_else(|| panic!("no env {var} in the pod"));
                arg.replace_range(start..=end, &value);
            }
            arg
        };
        let command = container.command.clone().expect("command");
        let mut args: Vec<String> = command[1..].to_vec();
        for arg in container.args.iter().flatten() {
            if arg.starts_with("--metrics-addr") {
                args.push("--metrics-addr=127.0.0.1:0".into());
            } else {
                args.push(expand(arg));
            }
        }
        let kubeconfig = self.controller_kubeconfig().await;
        // In a pod the ServiceAccount's token is found by the in-cluster config.
        args.push(format!("--kubeconfig={}", kubeconfig.display()));
        let binary = find_binary(&command[0]).expect("the controller binary");
        ManagedProcess::spawn(
            &command[0],
            &binary,
            args,
            self.dir.path().join("controller.log"),
        )
        .expect("start the controller")
    }
}

/// (kind, name, uid) of owner references.
type Owners = BTreeSet<(String, String, String)>;

fn owners(meta: &ObjectMeta) -> Owners {
    meta.owner_references
        .iter()
        .flatten()
        .map(|r: &OwnerReference| (r.kind.clone(), r.name.clone(), r.uid.clone()))
        .collect()
}

fn owned_by<K: Resource<DynamicType = ()>>(owner: &K) -> Owners {
    let meta = owner.meta();
    BTreeSet::from([(
        K::kind(&()).to_string(),
        meta.name.clone().unwrap_or_default(),
        meta.uid.clone().unwrap_or_default(),
    )])
}

/// Waits until the controller has made everything it makes, each with the owner that takes it away:
/// a class per GpuModel and per tier (the models), the all-GPUs class (its ClusterRole), the Lease
/// (its Role) and the profile's template (the profile). Returns what it waited for, by name.
async fn wait_for_the_controllers_objects(admin: &Client, process: &ManagedProcess) -> Vec<String> {
    let cluster_role = Api::<ClusterRole>::all(admin.clone())
        .get("gpupool-controller")
        .await
        .expect("the installed ClusterRole");
    let role = Api::<Role>::namespaced(admin.clone(), NAMESPACE)
        .get("gpupool-controller-leader-election")
        .await
        .expect("the installed Role");
    let profile = Api::<ComputeProfile>::all(admin.clone())
        .get(PROFILE)
        .await
        .expect("the user's ComputeProfile");
    // What is still missing, for the message should it never come.
    let missing = std::sync::Mutex::new(String::new());
    let note = |what: String| *missing.lock().unwrap() = what;
    let checked = wait_for(
        "the controller's classes, Lease and template, each with its owner",
        WAIT,
        || async {
            // Read each time: the controller writes each model's class into its status.
            let models = Api::<GpuModel>::all(admin.clone())
                .list(&ListParams::default())
                .await
                .ok()?
                .items;
            assert!(!models.is_empty(), "the install has GpuModels");
            let classes = Api::<DeviceClass>::all(admin.clone())
                .list(&ListParams::default())
                .await
                .ok()?
                .items;
            let owners_of = |name: &str| {
                classes
                    .iter()
                    .find(|c| c.metadata.name.as_deref() == Some(name))
                    .map(|c| owners(&c.metadata))
            };
            let mut checked = Vec::new();
            let mut expect = |what: String, found: Option<Owners>, wanted: Owners| {
                if found.as_ref() == Some(&wanted) {
                    checked.push(what);
                    Some(())
                } else {
                    note(format!("{what}: owners {found:?}, expected {wanted:?}"));
                    None
                }
            };
            let tiers: BTreeSet<String> =
                models.iter().filter_map(|m| m.spec.tier.clone()).collect();
            for model in &models {
                let Some(name) = model
                    .status
                    .as_ref()
                    .and_then(|s| s.device_class_name.clone())
                else {
                    note(format!("the class of GpuModel {}", model.name_any()));
                    return None;
                };
                expect(
                    format!("DeviceClass {name}"),
                    owners_of(&name),
                    owned_by(model),
                )?;
            }
            for tier in &tiers {
                let name = format!("tier-{tier}.gpupool.dev");
                let members: Owners = models
                    .iter()
                    .filter(|m| m.spec.tier.as_ref() == Some(tier))
                    .flat_map(owned_by)
                    .collect();
                expect(format!("DeviceClass {name}"), owners_of(&name), members)?;
            }
            expect(
                "DeviceClass gpupool.dev".into(),
                owners_of("gpupool.dev"),
                owned_by(&cluster_role),
            )?;
            let lease = Api::<Lease>::namespaced(admin.clone(), NAMESPACE)
                .get_opt(LEASE)
                .await
                .ok()?;
            expect(
                format!("Lease {NAMESPACE}/{LEASE}"),
                lease.map(|l| owners(&l.metadata)),
                owned_by(&role),
            )?;
            let template = Api::<ResourceClaimTemplate>::namespaced(admin.clone(), USER_NAMESPACE)
                .get_opt(PROFILE)
                .await
                .ok()?;
            expect(
                format!("ResourceClaimTemplate {USER_NAMESPACE}/{PROFILE}"),
                template.map(|t| owners(&t.metadata)),
                owned_by(&profile),
            )?;
            Some(checked)
        },
    )
    .await;
    checked.unwrap_or_else(|e| {
        harness::print_log_tail("gpupool-controller", &process.log(), 80);
        panic!("{e}; missing: {}", missing.lock().unwrap())
    })
}

/// On a real cluster the garbage collector watches a new resource type only from its next
/// discovery sync (every 30 s in kube-controller-manager): until then it misses a GpuModel's
/// deletion and leaves what the GpuModel owned (observed: the classes outlived `kubectl delete -k`
/// made 10 s after the install). An operator's install has run far longer than that before it is
/// removed; this waits until the collector has caught up, deleting a probe GpuModel that owns a
/// ConfigMap until the ConfigMap goes with it. Both CRDs are found by the same sync. The emulator
/// collects at once.
async fn wait_until_the_collector_watches_gpumodels(cluster: &Cluster) {
    if matches!(cluster.server, Server::Emulator(_)) {
        return;
    }
    let models: Api<GpuModel> = Api::all(cluster.admin.clone());
    let config_maps: Api<ConfigMap> = Api::namespaced(cluster.admin.clone(), NAMESPACE);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    for attempt in 0.. {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the garbage collector never collected a GpuModel's dependent"
        );
        let name = format!("gc-probe-{attempt}");
        let model: GpuModel = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name},
            "spec": {"model": "GC-PROBE", "computeWeight": 1}}))
        .unwrap();
        let model = models.create(&Default::default(), &model).await.unwrap();
        let owned: ConfigMap = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "ownerReferences": [{
                "apiVersion": "gpupool.dev/v1alpha1", "kind": "GpuModel", "name": name,
                "uid": model.metadata.uid}]}}))
        .unwrap();
        config_maps
            .create(&Default::default(), &owned)
            .await
            .unwrap();
        models.delete(&name, &Default::default()).await.unwrap();
        let collected = wait_for(
            "the probe's ConfigMap to go",
            Duration::from_secs(5),
            || async {
                config_maps
                    .get_opt(&name)
                    .await
                    .ok()
                    .and_then(|c| c.is_none().then_some(()))
            },
        )
        .await;
        if collected.is_ok() {
            return;
        }
        let _ = config_maps.delete(&name, &Default::default()).await;
    }
}

fn keys(entries: &[&str]) -> BTreeSet<String> {
    entries.iter().map(|s| s.to_string()).collect()
}

/// Waits until what the install and the controller left (objects now that were not there at
/// `before`) is `expected`: a cluster's garbage collector and namespace controller take a moment.
async fn assert_left_since(
    cluster: &Cluster,
    before: &BTreeSet<String>,
    expected: BTreeSet<String>,
    what: &str,
) {
    let last = std::sync::Mutex::new(BTreeSet::new());
    let result = wait_for(what, WAIT, || async {
        let left: BTreeSet<String> = cluster
            .everything()
            .await
            .difference(before)
            .cloned()
            .collect();
        let done = left == expected;
        *last.lock().unwrap() = left;
        done.then_some(())
    })
    .await;
    if let Err(e) = result {
        assert_eq!(*last.lock().unwrap(), expected, "{e}: {what}");
    }
}

on_both_backends!(
    helm_uninstall_leaves_only_what_readme_says_to_remove_by_hand,
    kubectl_delete_k_leaves_only_the_users_objects
);

async fn helm_uninstall_leaves_only_what_readme_says_to_remove_by_hand(backend: Backend) {
    let test = "helm_uninstall_leaves_only_what_readme_says_to_remove_by_hand";
    let (Some(helm), Some(kubectl)) = (helm(test), kubectl(test)) else {
        return;
    };
    let cluster = Cluster::start(kubectl, backend).await;
    let before = cluster.everything().await;

    cluster
        .run(
            &helm,
            &[
                "install",
                RELEASE,
                "deploy/helm/gpupool",
                "--namespace",
                NAMESPACE,
                "--create-namespace",
            ],
        )
        .await;
    // The cluster-scoped webhook configuration is among what the uninstall must take away.
    cluster
        .kubectl(&["get", "validatingwebhookconfiguration", "gpupool-webhook"])
        .await;
    wait_until_the_collector_watches_gpumodels(&cluster).await;
    cluster.kubectl(&["apply", "-f", PROFILE_EXAMPLE]).await;
    let mut controller = cluster.start_controller().await;
    let made = wait_for_the_controllers_objects(&cluster.admin, &controller).await;
    println!("the controller made, each with its owner: {made:?}");
    // SIGTERM, as the kubelet stops the pod; it hands the Lease back but leaves it.
    controller.stop(Duration::from_secs(10)).await;

    cluster
        .run(&helm, &["uninstall", RELEASE, "--namespace", NAMESPACE])
        .await;
    assert_left_since(
        &cluster,
        &before,
        keys(&[
            // Helm keeps the CRDs of crds/, and the namespace --create-namespace made.
            "apiextensions.k8s.io/CustomResourceDefinition /computeprofiles.gpupool.dev",
            "apiextensions.k8s.io/CustomResourceDefinition /gpumodels.gpupool.dev",
            "/Namespace /gpupool",
            // The user's own: a namespace, a profile, and the template that goes with the profile.
            "/Namespace /team-a",
            "gpupool.dev/ComputeProfile /half-a100",
            "resource.k8s.io/ResourceClaimTemplate team-a/half-a100",
        ])
        .into_iter()
        // A real API server serves the CRDs' group through an APIService, which goes with them.
        .chain(
            matches!(cluster.server, Server::Plane { .. })
                .then(|| "apiregistration.k8s.io/APIService /v1alpha1.gpupool.dev".to_string()),
        )
        .collect(),
        "what helm uninstall left behind",
    )
    .await;

    // README's clean-up: the CRDs (every GpuModel and ComputeProfile with them), the namespace.
    cluster.kubectl(&["delete", "-f", "deploy/crds/"]).await;
    cluster.kubectl(&["delete", "namespace", NAMESPACE]).await;
    assert_left_since(
        &cluster,
        &before,
        keys(&["/Namespace /team-a"]),
        "what README's clean-up left behind",
    )
    .await;
}

async fn kubectl_delete_k_leaves_only_the_users_objects(backend: Backend) {
    let test = "kubectl_delete_k_leaves_only_the_users_objects";
    let Some(kubectl) = kubectl(test) else {
        return;
    };
    let cluster = Cluster::start(kubectl, backend).await;
    let before = cluster.everything().await;

    // README: the CRDs first, since the base holds GpuModels.
    cluster.kubectl(&["apply", "-f", "deploy/crds/"]).await;
    cluster.kubectl(&["apply", "-k", "deploy/base"]).await;
    cluster
        .kubectl(&["get", "validatingwebhookconfiguration", "gpupool-webhook"])
        .await;
    wait_until_the_collector_watches_gpumodels(&cluster).await;
    cluster.kubectl(&["apply", "-f", PROFILE_EXAMPLE]).await;
    let mut controller = cluster.start_controller().await;
    let made = wait_for_the_controllers_objects(&cluster.admin, &controller).await;
    println!("the controller made, each with its owner: {made:?}");
    controller.stop(Duration::from_secs(10)).await;

    // The base holds the CRDs and the namespace too, so this takes every GpuModel and
    // ComputeProfile, and what they own. The namespace goes first and takes its objects with it
    // (at once on the emulator, within seconds on a cluster): README's --ignore-not-found.
    cluster
        .kubectl(&["delete", "-k", "deploy/base", "--ignore-not-found"])
        .await;
    assert_left_since(
        &cluster,
        &before,
        keys(&["/Namespace /team-a"]),
        "what kubectl delete -k left behind",
    )
    .await;
}

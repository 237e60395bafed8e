//! The install manifests as an operator gets them: the kustomize base and overlays rendered by the real
//! `kubectl kustomize`, checked for what the DaemonSet mounts, the RBAC it grants, the controller's
//! shape, the CRD copies, and (where Go is installed) the Helm chart rendered with the same values.
//!
//! Without `kubectl` (or `go`, for the chart) a test prints why and returns: the tools are the point.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use gpupool_e2e::harness::process::assert_succeeded;
use gpupool_e2e::harness::workspace_root;
use serde_json::Value;

fn deploy_dir() -> PathBuf {
    workspace_root().join("deploy")
}

fn have(tool: &str, version_arg: &str) -> bool {
    Command::new(tool)
        .arg(version_arg)
        .output()
        .map(|out| out.status.success())
        .unwrap_or(false)
}

fn kubectl_missing(test: &str) -> bool {
    if have("kubectl", "version") || have("kubectl", "--help") {
        return false;
    }
    println!("skipping {test}: kubectl is not installed, and the real `kubectl kustomize` is what is tested");
    true
}

/// Every YAML document of a multi-document stream, as JSON values (empty documents dropped).
fn parse_documents(yaml: &str, origin: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(yaml)
        .map(|doc| {
            let value: Value = serde::Deserialize::deserialize(doc)
                .unwrap_or_else(|e| panic!("{origin}: not YAML: {e}"));
            value
        })
        .filter(|v| !v.is_null())
        .collect()
}

/// `kubectl kustomize deploy/<dir>`, parsed.
fn kustomize(dir: &str) -> Vec<Value> {
    let path = deploy_dir().join(dir);
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(&path)
        .output()
        .expect("run kubectl kustomize");
    assert!(
        out.status.success(),
        "kubectl kustomize {} failed:\n{}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    parse_documents(&String::from_utf8_lossy(&out.stdout), dir)
}

const RENDERED: [&str; 3] = ["base", "overlays/fake-gpus", "overlays/nvidia"];

/// Each of RENDERED with what `kubectl kustomize` renders for it, one after the other.
fn each_rendered() -> impl Iterator<Item = (&'static str, Vec<Value>)> {
    RENDERED.into_iter().map(|dir| (dir, kustomize(dir)))
}

/// `each_rendered`, or nothing without kubectl (`test` then says it skips).
fn rendered(test: &str) -> impl Iterator<Item = (&'static str, Vec<Value>)> {
    (!kubectl_missing(test))
        .then(each_rendered)
        .into_iter()
        .flatten()
}

/// What `kubectl kustomize` renders for the base; `None` without kubectl (`test` then says it skips).
fn rendered_base(test: &str) -> Option<Vec<Value>> {
    (!kubectl_missing(test)).then(|| kustomize("base"))
}

fn key(obj: &Value) -> String {
    format!(
        "{} {} {}/{}",
        obj["apiVersion"].as_str().unwrap_or("?"),
        obj["kind"].as_str().unwrap_or("?"),
        obj["metadata"]["namespace"].as_str().unwrap_or(""),
        obj["metadata"]["name"].as_str().unwrap_or("?")
    )
}

fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| {
            panic!(
                "no {kind} {name} among {:?}",
                objects.iter().map(key).collect::<Vec<_>>()
            )
        })
}

fn of_kind<'a>(objects: &'a [Value], kind: &str) -> Vec<&'a Value> {
    objects.iter().filter(|o| o["kind"] == kind).collect()
}

fn strings(value: &Value) -> Vec<String> {
    value
        .as_array()
        .map(|items| {
            items
                .iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// The container (or init container) `name` of a workload's pod.
fn container<'a>(workload: &'a Value, name: &str) -> &'a Value {
    let pod = &workload["spec"]["template"]["spec"];
    ["containers", "initContainers"]
        .iter()
        .filter_map(|list| pod[list].as_array())
        .flatten()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("{}: no container {name}", key(workload)))
}

/// The value of `--flag=value` in a container's args.
fn flag(container: &Value, flag: &str) -> Option<String> {
    let prefix = format!("{flag}=");
    strings(&container["args"])
        .into_iter()
        .find_map(|a| a.strip_prefix(&prefix).map(str::to_owned))
}

/// host path -> (mount path, read only) of each hostPath volume mounted by the container, which
/// mounts every volume of the pod.
fn host_mounts(workload: &Value, container_name: &str) -> BTreeMap<String, (String, bool)> {
    let mounts = host_mounts_of(workload, container_name);
    let volumes = workload["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .map_or(0, Vec::len);
    assert_eq!(
        mounts.len(),
        volumes,
        "{}: every volume is mounted, and only once",
        key(workload)
    );
    mounts
}

/// host path -> (mount path, read only) of each hostPath volume mounted by the container.
fn host_mounts_of(workload: &Value, container_name: &str) -> BTreeMap<String, (String, bool)> {
    let pod = &workload["spec"]["template"]["spec"];
    let volumes: BTreeMap<String, &Value> = pod["volumes"]
        .as_array()
        .map(|vs| {
            vs.iter()
                .map(|v| (v["name"].as_str().unwrap_or_default().to_owned(), v))
                .collect()
        })
        .unwrap_or_default();
    let mut mounts = BTreeMap::new();
    for mount in container(workload, container_name)["volumeMounts"]
        .as_array()
        .cloned()
        .unwrap_or_default()
    {
        let name = mount["name"].as_str().unwrap_or_default();
        let volume = volumes
            .get(name)
            .unwrap_or_else(|| panic!("{}: mount of undeclared volume {name}", key(workload)));
        let host = volume["hostPath"]["path"]
            .as_str()
            .unwrap_or_else(|| panic!("{}: volume {name} is not a hostPath", key(workload)));
        mounts.insert(
            host.to_owned(),
            (
                mount["mountPath"].as_str().unwrap_or_default().to_owned(),
                mount["readOnly"].as_bool().unwrap_or(false),
            ),
        );
    }
    mounts
}

const REGISTRY_DIR: &str = "/var/lib/kubelet/plugins_registry";
const PLUGIN_DIR: &str = "/var/lib/kubelet/plugins/gpupool.dev";
const CDI_ROOT: &str = "/var/run/cdi";
const RUN_DIR: &str = "/var/run/gpupool";
const VGPU_LIB_DIR: &str = "/usr/local/vgpu";
/// gpupool's enforcement library on the node, installed there by the driver pod's init container.
const GPUPOOL_LIB_DIR: &str = "/usr/local/gpupool";
/// HAMi-core's lock folder; fixed by HAMi-core itself.
const VGPU_LOCK_DIR: &str = "/tmp/vgpulock";

#[test]
fn base_and_overlays_render_with_kubectl_kustomize() {
    for (dir, objects) in rendered("base_and_overlays_render_with_kubectl_kustomize") {
        let mut seen = BTreeSet::new();
        for obj in &objects {
            assert!(
                obj["apiVersion"].is_string() && obj["kind"].is_string(),
                "{dir}: {obj}"
            );
            assert!(seen.insert(key(obj)), "{dir}: {} twice", key(obj));
        }
        let kinds: BTreeSet<&str> = objects.iter().filter_map(|o| o["kind"].as_str()).collect();
        for kind in [
            "Namespace",
            "CustomResourceDefinition",
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "Role",
            "RoleBinding",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
            "DaemonSet",
            "Deployment",
            "GpuModel",
        ] {
            assert!(kinds.contains(kind), "{dir} renders no {kind}");
        }
        // Namespaced objects live in the install's namespace; nothing lands in default.
        for obj in &objects {
            if let Some(ns) = obj["metadata"]["namespace"].as_str() {
                assert_eq!(ns, "gpupool", "{dir}: {}", key(obj));
            }
        }
    }
}

#[test]
fn driver_daemonset_mounts_exactly_what_it_needs() {
    for (dir, objects) in rendered("driver_daemonset_mounts_exactly_what_it_needs") {
        let ds = find(&objects, "DaemonSet", "gpupool-driver");
        let driver = container(ds, "driver");
        let fake = dir.ends_with("fake-gpus");

        let mounts = host_mounts(ds, "driver");
        let mut expected: BTreeSet<&str> = [
            REGISTRY_DIR,
            PLUGIN_DIR,
            CDI_ROOT,
            RUN_DIR,
            GPUPOOL_LIB_DIR,
            VGPU_LIB_DIR,
            VGPU_LOCK_DIR,
        ]
        .into();
        if !fake {
            expected.insert("/dev");
        }
        assert_eq!(
            mounts.keys().map(String::as_str).collect::<BTreeSet<_>>(),
            expected,
            "{dir}: host paths mounted into the driver"
        );
        for (host, (in_container, read_only)) in &mounts {
            assert_eq!(
                host, in_container,
                "{dir}: {host} is mounted at the same path"
            );
            let should_be_read_only =
                host == "/dev" || host == VGPU_LIB_DIR || host == GPUPOOL_LIB_DIR;
            assert_eq!(*read_only, should_be_read_only, "{dir}: readOnly of {host}");
        }

        // The flags point at the mounted folders (the driver writes where the kubelet looks).
        for (name, path) in [
            ("--registry-dir", REGISTRY_DIR),
            ("--plugin-dir", PLUGIN_DIR),
            ("--state-dir", PLUGIN_DIR),
            ("--cdi-root", CDI_ROOT),
            ("--run-dir", RUN_DIR),
            ("--vgpu-lib-dir", VGPU_LIB_DIR),
            ("--gpupool-lib-dir", GPUPOOL_LIB_DIR),
        ] {
            assert_eq!(flag(driver, name).as_deref(), Some(path), "{dir}: {name}");
        }
        assert_eq!(
            flag(driver, "--default-enforcement").as_deref(),
            Some("Auto"),
            "{dir}: ours where installed, else HAMi-core, else limits not enforced"
        );
        assert_library_installed_into(ds, GPUPOOL_LIB_DIR, dir);
        assert_eq!(
            flag(driver, "--fake-gpus").is_some(),
            fake,
            "{dir}: --fake-gpus"
        );
        assert_eq!(
            strings(&driver["command"]),
            ["gpupool-driver", "run"],
            "{dir}"
        );

        let node_name = driver["env"]
            .as_array()
            .and_then(|env| env.iter().find(|e| e["name"] == "NODE_NAME"))
            .unwrap_or_else(|| panic!("{dir}: no NODE_NAME"));
        assert_eq!(
            node_name["valueFrom"]["fieldRef"]["fieldPath"], "spec.nodeName",
            "{dir}"
        );

        // The NVIDIA container runtime mounts NVML for "utility" and the MPS control daemon and
        // server for "compute": without the latter every `compute: Mps` claim fails to prepare.
        if !fake {
            let capabilities = driver["env"]
                .as_array()
                .and_then(|env| {
                    env.iter()
                        .find(|e| e["name"] == "NVIDIA_DRIVER_CAPABILITIES")
                })
                .and_then(|e| e["value"].as_str())
                .unwrap_or_else(|| panic!("{dir}: no NVIDIA_DRIVER_CAPABILITIES"));
            let capabilities: BTreeSet<&str> = capabilities.split(',').map(str::trim).collect();
            assert!(
                capabilities.contains("utility") && capabilities.contains("compute"),
                "{dir}: NVIDIA_DRIVER_CAPABILITIES {capabilities:?} lacks utility or compute"
            );
        }

        assert_surge_upgrade(ds, dir);

        // Probes hit the driver's own health endpoint on the port it listens on.
        let healthz =
            flag(driver, "--healthz-addr").unwrap_or_else(|| panic!("{dir}: --healthz-addr"));
        let port: u64 = healthz
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .expect("port");
        let port_name = driver["ports"]
            .as_array()
            .and_then(|ps| ps.iter().find(|p| p["containerPort"] == port))
            .and_then(|p| p["name"].as_str())
            .unwrap_or_else(|| panic!("{dir}: port {port} not declared"));
        // Ready only once the kubelet has registered it: a DaemonSet removes the old pod of a
        // rolling update as soon as the new one is ready.
        for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
            assert_eq!(driver[probe]["httpGet"]["path"], path, "{dir}: {probe}");
            assert_eq!(
                driver[probe]["httpGet"]["port"], port_name,
                "{dir}: {probe}"
            );
        }

        // The image's user is not root; the driver needs root for the host folders it writes.
        assert_eq!(
            driver["securityContext"]["runAsUser"], 0,
            "{dir}: driver runs as root"
        );
        let privileged = driver["securityContext"]["privileged"]
            .as_bool()
            .unwrap_or(false);
        assert_eq!(
            privileged, !fake,
            "{dir}: privileged only where NVML opens device nodes"
        );
        let read_only_root = driver["securityContext"]["readOnlyRootFilesystem"]
            .as_bool()
            .unwrap_or(false);
        assert_eq!(
            read_only_root, fake,
            "{dir}: read-only root wherever the NVIDIA runtime's hook does not write into it"
        );
        let pod = &ds["spec"]["template"]["spec"];
        for host_namespace in ["hostNetwork", "hostPID", "hostIPC"] {
            assert!(
                !pod[host_namespace].as_bool().unwrap_or(false),
                "{dir}: {host_namespace} (the kubelet talks to the driver over Unix sockets)"
            );
        }

        let tolerated: BTreeSet<String> = pod["tolerations"]
            .as_array()
            .map(|ts| {
                ts.iter()
                    .filter_map(|t| t["key"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        for taint in ["nvidia.com/gpu", "gpupool.dev/gpu"] {
            assert!(tolerated.contains(taint), "{dir}: tolerates {taint}");
        }
        let gpu_node_terms = pod["affinity"]["nodeAffinity"]
            ["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
            .to_string();
        assert_eq!(
            gpu_node_terms.contains("nvidia.com/gpu.present")
                && gpu_node_terms.contains("gpupool.dev/gpu-node"),
            !fake,
            "{dir}: GPU-node affinity (fake GPUs go on every node)"
        );
        assert_eq!(
            pod["runtimeClassName"].as_str(),
            dir.ends_with("nvidia").then_some("nvidia"),
            "{dir}: runtimeClassName"
        );
    }
}

/// The init container that puts gpupool's enforcement library on the node: the driver's own image
/// and subcommand, root without any capability, writing nothing but the host folder that the
/// driver container mounts read-only and names in `--gpupool-lib-dir`.
fn assert_library_installed_into(ds: &Value, lib_dir: &str, origin: &str) {
    let inits = ds["spec"]["template"]["spec"]["initContainers"]
        .as_array()
        .unwrap_or_else(|| panic!("{origin}: no init containers"));
    assert_eq!(inits.len(), 1, "{origin}: {inits:?}");
    let init = container(ds, "install-lib");
    let driver = container(ds, "driver");
    assert_eq!(
        init["image"], driver["image"],
        "{origin}: the driver's image"
    );
    assert_eq!(
        init["imagePullPolicy"], driver["imagePullPolicy"],
        "{origin}"
    );
    assert_eq!(
        strings(&init["command"]),
        ["gpupool-driver", "install-lib"],
        "{origin}"
    );
    assert_eq!(
        strings(&init["args"]),
        [format!("--to={lib_dir}")],
        "{origin}"
    );
    let security = &init["securityContext"];
    assert_eq!(
        security["runAsUser"], 0,
        "{origin}: the host folder is root's"
    );
    assert_eq!(security["allowPrivilegeEscalation"], false, "{origin}");
    assert_eq!(security["readOnlyRootFilesystem"], true, "{origin}");
    assert_eq!(
        strings(&security["capabilities"]["drop"]),
        ["ALL"],
        "{origin}"
    );
    assert!(
        !security["privileged"].as_bool().unwrap_or(false),
        "{origin}"
    );
    assert_eq!(
        host_mounts_of(ds, "install-lib"),
        BTreeMap::from([(lib_dir.to_owned(), (lib_dir.to_owned(), false))]),
        "{origin}: the init container writes only the library's folder"
    );
    assert_eq!(
        host_mounts_of(ds, "driver").get(lib_dir),
        Some(&(lib_dir.to_owned(), true)),
        "{origin}: the driver reads the library's folder"
    );
    assert_eq!(
        flag(driver, "--gpupool-lib-dir").as_deref(),
        Some(lib_dir),
        "{origin}"
    );
}

/// A node's new driver pod starts before the old one stops, and each names its sockets after its
/// own pod UID, so the kubelet always has a registered driver to call.
fn assert_surge_upgrade(ds: &Value, origin: &str) {
    let strategy = &ds["spec"]["updateStrategy"];
    assert_eq!(strategy["type"], "RollingUpdate", "{origin}: {strategy}");
    assert_eq!(
        strategy["rollingUpdate"]["maxSurge"], 1,
        "{origin}: a new pod starts beside the old one: {strategy}"
    );
    assert_eq!(
        strategy["rollingUpdate"]["maxUnavailable"], 0,
        "{origin}: the old pod stays until the new one is ready: {strategy}"
    );
    let driver = container(ds, "driver");
    let pod_uid = driver["env"]
        .as_array()
        .and_then(|env| env.iter().find(|e| e["name"] == "POD_UID"))
        .unwrap_or_else(|| panic!("{origin}: no POD_UID in {}", driver["env"]));
    assert_eq!(
        pod_uid["valueFrom"]["fieldRef"]["fieldPath"], "metadata.uid",
        "{origin}: POD_UID from the downward API"
    );
    assert!(
        flag(driver, "--pod-uid").is_none(),
        "{origin}: the env, not a fixed flag, carries the pod UID"
    );
}

/// (apiGroup, resource) -> verbs, over all rules of a role.
fn grants(role: &Value) -> BTreeMap<(String, String), BTreeSet<String>> {
    let mut out: BTreeMap<(String, String), BTreeSet<String>> = BTreeMap::new();
    for rule in role["rules"].as_array().expect("rules") {
        for group in strings(&rule["apiGroups"]) {
            for resource in strings(&rule["resources"]) {
                out.entry((group.clone(), resource))
                    .or_default()
                    .extend(strings(&rule["verbs"]));
            }
        }
    }
    out
}

/// The `resourceNames` of the rules of `role` on `resource`; empty where one rule has none (any name).
fn names_granted(role: &Value, resource: &str) -> Vec<String> {
    let rules: Vec<&Value> = role["rules"]
        .as_array()
        .expect("rules")
        .iter()
        .filter(|r| strings(&r["resources"]).iter().any(|x| x == resource))
        .collect();
    if rules
        .iter()
        .any(|r| strings(&r["resourceNames"]).is_empty())
    {
        return Vec::new();
    }
    rules
        .iter()
        .flat_map(|r| strings(&r["resourceNames"]))
        .collect()
}

fn expect_grants(
    entries: &[(&str, &str, &[&str])],
) -> BTreeMap<(String, String), BTreeSet<String>> {
    entries
        .iter()
        .map(|(group, resource, verbs)| {
            (
                (group.to_string(), resource.to_string()),
                verbs.iter().map(|v| v.to_string()).collect(),
            )
        })
        .collect()
}

#[test]
fn rbac_grants_least_privilege() {
    let Some(objects) = rendered_base("rbac_grants_least_privilege") else {
        return;
    };
    for role in of_kind(&objects, "ClusterRole")
        .into_iter()
        .chain(of_kind(&objects, "Role"))
    {
        for rule in role["rules"].as_array().expect("rules") {
            for field in ["apiGroups", "resources", "verbs", "resourceNames"] {
                assert!(
                    !strings(&rule[field]).iter().any(|s| s.contains('*')),
                    "{}: {field} has *",
                    key(role)
                );
            }
            for resource in strings(&rule["resources"]) {
                assert!(
                    ![
                        "secrets",
                        "configmaps",
                        "pods",
                        "serviceaccounts",
                        "nodes/proxy"
                    ]
                    .contains(&resource.as_str()),
                    "{}: grants {resource}",
                    key(role)
                );
            }
            for verb in strings(&rule["verbs"]) {
                assert!(
                    !["escalate", "bind", "impersonate"].contains(&verb.as_str()),
                    "{}: {verb}",
                    key(role)
                );
            }
        }
    }

    let driver = grants(find(&objects, "ClusterRole", "gpupool-driver"));
    assert_eq!(
        driver,
        expect_grants(&[
            ("resource.k8s.io", "resourceclaims", &["get"]),
            (
                "resource.k8s.io",
                "resourceclaims/status",
                &["patch", "update"]
            ),
            (
                "resource.k8s.io",
                "resourceclaims/driver",
                &["associated-node:patch", "associated-node:update"]
            ),
            (
                "resource.k8s.io",
                "resourceslices",
                &["get", "list", "watch", "create", "update", "delete"]
            ),
            ("gpupool.dev", "gpumodels", &["list", "watch"]),
            ("", "nodes", &["get"]),
            ("", "events", &["create", "patch"]),
            ("events.k8s.io", "events", &["create", "patch"]),
        ]),
        "driver ClusterRole"
    );
    // Only this driver's entries, and only as a node-local driver (never arbitrary-node).
    let status_rule = find(&objects, "ClusterRole", "gpupool-driver")["rules"]
        .as_array()
        .expect("rules")
        .iter()
        .find(|r| strings(&r["resources"]) == ["resourceclaims/driver"])
        .expect("a resourceclaims/driver rule");
    assert_eq!(strings(&status_rule["resourceNames"]), ["gpupool.dev"]);

    let read = &["get", "list", "watch"][..];
    let manage = &["get", "list", "watch", "create", "update", "delete"][..];
    let controller = grants(find(&objects, "ClusterRole", "gpupool-controller"));
    assert_eq!(
        controller,
        expect_grants(&[
            ("gpupool.dev", "gpumodels", read),
            ("gpupool.dev", "computeprofiles", read),
            ("gpupool.dev", "gpumodels/status", &["update", "patch"]),
            (
                "gpupool.dev",
                "computeprofiles/status",
                &["update", "patch"]
            ),
            ("resource.k8s.io", "resourceslices", read),
            ("", "namespaces", read),
            ("resource.k8s.io", "deviceclasses", manage),
            ("resource.k8s.io", "resourceclaimtemplates", manage),
            ("", "events", &["create", "patch"]),
            ("events.k8s.io", "events", &["create", "patch"]),
            // Its own ClusterRole's uid: the role owns the all-GPUs class.
            ("rbac.authorization.k8s.io", "clusterroles", &["get"]),
        ]),
        "controller ClusterRole"
    );
    assert_eq!(
        names_granted(
            find(&objects, "ClusterRole", "gpupool-controller"),
            "clusterroles"
        ),
        ["gpupool-controller"],
        "the controller reads its own ClusterRole and no other"
    );

    // Leases only in the controller's namespace, and only the one it elects with may be renewed;
    // the Role that owns that Lease may be read, by name.
    let lease_role = find(&objects, "Role", "gpupool-controller-leader-election");
    assert_eq!(lease_role["metadata"]["namespace"], "gpupool");
    assert_eq!(
        grants(lease_role),
        expect_grants(&[
            (
                "coordination.k8s.io",
                "leases",
                &["create", "get", "update"]
            ),
            ("rbac.authorization.k8s.io", "roles", &["get"]),
        ]),
        "leader-election Role"
    );
    for rule in lease_role["rules"].as_array().expect("rules") {
        let verbs = strings(&rule["verbs"]);
        if verbs != ["create"] {
            let own_name = if strings(&rule["resources"]) == ["roles"] {
                "gpupool-controller-leader-election"
            } else {
                "gpupool-controller"
            };
            assert_eq!(
                strings(&rule["resourceNames"]),
                [own_name],
                "{verbs:?} by name only"
            );
        }
    }
    let deployment = find(&objects, "Deployment", "gpupool-controller");
    let controller_container = container(deployment, "controller");
    assert_eq!(
        flag(controller_container, "--lease-namespace").as_deref(),
        Some("$(POD_NAMESPACE)")
    );
    let pod_namespace = controller_container["env"]
        .as_array()
        .and_then(|env| env.iter().find(|e| e["name"] == "POD_NAMESPACE"))
        .expect("POD_NAMESPACE");
    assert_eq!(
        pod_namespace["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.namespace"
    );

    // The webhook keeps its own configuration's caBundle, and may touch nothing else.
    let webhook_role = find(&objects, "ClusterRole", "gpupool-webhook");
    assert_eq!(
        grants(webhook_role),
        expect_grants(&[(
            "admissionregistration.k8s.io",
            "validatingwebhookconfigurations",
            &["get", "patch"]
        )]),
        "webhook ClusterRole"
    );
    assert_eq!(
        names_granted(webhook_role, "validatingwebhookconfigurations"),
        [find(
            &objects,
            "ValidatingWebhookConfiguration",
            "gpupool-webhook"
        )["metadata"]["name"]
            .as_str()
            .expect("name")],
        "the webhook patches its own configuration and no other"
    );
    let webhook_deployment = find(&objects, "Deployment", "gpupool-webhook");

    // Each binding gives its role to the ServiceAccount the workload runs as, and to nothing else.
    let daemonset = find(&objects, "DaemonSet", "gpupool-driver");
    for (binding_kind, binding, workload) in [
        ("ClusterRoleBinding", "gpupool-driver", daemonset),
        ("ClusterRoleBinding", "gpupool-controller", deployment),
        (
            "RoleBinding",
            "gpupool-controller-leader-election",
            deployment,
        ),
        ("ClusterRoleBinding", "gpupool-webhook", webhook_deployment),
    ] {
        let b = find(&objects, binding_kind, binding);
        let sa = workload["spec"]["template"]["spec"]["serviceAccountName"]
            .as_str()
            .expect("serviceAccountName");
        find(&objects, "ServiceAccount", sa);
        let subjects = b["subjects"].as_array().expect("subjects");
        assert_eq!(subjects.len(), 1, "{binding}");
        assert_eq!(subjects[0]["kind"], "ServiceAccount");
        assert_eq!(subjects[0]["name"], sa, "{binding}");
        assert_eq!(
            subjects[0]["namespace"], workload["metadata"]["namespace"],
            "{binding}"
        );
        let role_kind = b["roleRef"]["kind"].as_str().expect("roleRef.kind");
        find(
            &objects,
            role_kind,
            b["roleRef"]["name"].as_str().expect("roleRef.name"),
        );
    }
}

#[test]
fn resourceslice_policy_confines_the_driver_to_its_node() {
    let Some(objects) = rendered_base("resourceslice_policy_confines_the_driver_to_its_node")
    else {
        return;
    };
    let policy = find(
        &objects,
        "ValidatingAdmissionPolicy",
        "gpupool-driver-resourceslices",
    );
    let binding = find(
        &objects,
        "ValidatingAdmissionPolicyBinding",
        "gpupool-driver-resourceslices",
    );
    assert_eq!(policy["apiVersion"], "admissionregistration.k8s.io/v1");
    assert_eq!(
        binding["spec"]["policyName"],
        "gpupool-driver-resourceslices"
    );
    assert_eq!(strings(&binding["spec"]["validationActions"]), ["Deny"]);
    assert_eq!(policy["spec"]["failurePolicy"], "Fail");

    let rules = &policy["spec"]["matchConstraints"]["resourceRules"];
    assert_eq!(strings(&rules[0]["resources"]), ["resourceslices"]);
    assert_eq!(
        strings(&rules[0]["operations"]),
        ["CREATE", "UPDATE", "DELETE"]
    );

    // The policy names the ServiceAccount the DaemonSet really runs as.
    let ds = find(&objects, "DaemonSet", "gpupool-driver");
    let user = format!(
        "system:serviceaccount:{}:{}",
        ds["metadata"]["namespace"].as_str().expect("namespace"),
        ds["spec"]["template"]["spec"]["serviceAccountName"]
            .as_str()
            .expect("serviceAccountName")
    );
    let condition = policy["spec"]["matchConditions"][0]["expression"]
        .as_str()
        .expect("matchCondition");
    assert!(
        condition.contains(&format!("\"{user}\"")),
        "{condition} names {user}"
    );

    let text = policy["spec"].to_string();
    assert!(
        text.contains("authentication.kubernetes.io/node-name"),
        "node name from the token"
    );
    assert!(
        text.contains("nodeName"),
        "compared with the slice's spec.nodeName"
    );
    for validation in policy["spec"]["validations"]
        .as_array()
        .expect("validations")
    {
        // The API server refuses a message with a line break.
        if let Some(message) = validation["message"].as_str() {
            assert!(!message.contains('\n'), "{message:?}");
        }
    }
}

#[test]
fn controller_runs_two_non_root_replicas_named_after_their_pods() {
    for (dir, objects) in rendered("controller_runs_two_non_root_replicas_named_after_their_pods") {
        let deployment = find(&objects, "Deployment", "gpupool-controller");
        assert_eq!(deployment["spec"]["replicas"], 2, "{dir}");
        let pod = &deployment["spec"]["template"]["spec"];
        assert_eq!(pod["securityContext"]["runAsNonRoot"], true, "{dir}");
        assert_ne!(pod["securityContext"]["runAsUser"], 0, "{dir}");
        let controller = container(deployment, "controller");
        assert_eq!(
            strings(&controller["command"]),
            ["gpupool-controller", "run"],
            "{dir}"
        );
        assert_eq!(
            flag(controller, "--identity").as_deref(),
            Some("$(POD_NAME)"),
            "{dir}"
        );
        let pod_name = controller["env"]
            .as_array()
            .and_then(|env| env.iter().find(|e| e["name"] == "POD_NAME"))
            .expect("POD_NAME");
        assert_eq!(
            pod_name["valueFrom"]["fieldRef"]["fieldPath"], "metadata.name",
            "{dir}"
        );
        assert_eq!(
            controller["securityContext"]["allowPrivilegeEscalation"], false,
            "{dir}"
        );
        assert_eq!(
            strings(&controller["securityContext"]["capabilities"]["drop"]),
            ["ALL"],
            "{dir}"
        );
    }
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

#[test]
fn crd_copies_equal_the_generated_crds() {
    let generated = deploy_dir().join("crds");
    let mut names: Vec<String> = std::fs::read_dir(&generated)
        .expect("deploy/crds")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".yaml"))
        .collect();
    names.sort();
    assert!(!names.is_empty(), "deploy/crds holds the generated CRDs");
    let hint = "refresh with: cp deploy/crds/*.yaml deploy/base/crds/ && cp deploy/crds/*.yaml deploy/helm/gpupool/crds/";
    for copy_dir in ["base/crds", "helm/gpupool/crds"] {
        let copies = deploy_dir().join(copy_dir);
        let mut copy_names: Vec<String> = std::fs::read_dir(&copies)
            .unwrap_or_else(|e| panic!("deploy/{copy_dir}: {e}"))
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        copy_names.sort();
        assert_eq!(
            copy_names, names,
            "deploy/{copy_dir} holds the same files as deploy/crds; {hint}"
        );
        for name in &names {
            assert!(
                read(&generated.join(name)) == read(&copies.join(name)),
                "deploy/{copy_dir}/{name} differs from deploy/crds/{name}; {hint}"
            );
        }
    }

    if kubectl_missing("crd_copies_equal_the_generated_crds (rendered part)") {
        return;
    }
    let mut expected: Vec<Value> = names
        .iter()
        .flat_map(|n| parse_documents(&read(&generated.join(n)), n))
        .collect();
    expected.sort_by_key(key);
    let mut rendered: Vec<Value> = of_kind(&kustomize("base"), "CustomResourceDefinition")
        .into_iter()
        .cloned()
        .collect();
    rendered.sort_by_key(key);
    assert_eq!(
        rendered, expected,
        "the base installs exactly the generated CRDs"
    );
}

#[test]
fn the_charts_scheduler_profile_is_the_shipped_one() {
    let shipped = read(&deploy_dir().join("scheduler/gpupool-packing.yaml"));
    assert!(
        read(&chart_dir().join("files/gpupool-packing.yaml")) == shipped,
        "deploy/helm/gpupool/files/gpupool-packing.yaml differs from deploy/scheduler/; refresh with: \
         cp deploy/scheduler/gpupool-packing.yaml deploy/helm/gpupool/files/"
    );
    let Some(helm) = helm("the_charts_scheduler_profile_is_the_shipped_one") else {
        return;
    };
    assert!(
        of_kind(&helm_template(&helm, &[]), "ConfigMap").is_empty(),
        "off by default"
    );
    let objects = helm_template(&helm, &["schedulerProfile.enabled=true"]);
    let map = find(&objects, "ConfigMap", "gpupool-scheduler-profile");
    let rendered = map["data"]["kube-scheduler-config.yaml"]
        .as_str()
        .expect("the profile is a string");
    let parsed: Value = serde_yaml::from_str(rendered).expect("the profile is YAML");
    let expected: Value = serde_yaml::from_str(&shipped).expect("the shipped profile is YAML");
    assert_eq!(parsed, expected);
    assert_eq!(parsed["kind"], "KubeSchedulerConfiguration");
}

#[test]
fn default_gpumodels_are_valid_and_agree_with_the_examples() {
    let base = parse_documents(
        &read(&deploy_dir().join("base/gpumodels.yaml")),
        "base/gpumodels.yaml",
    );
    let mut models = BTreeSet::new();
    for gm in &base {
        assert_eq!(gm["apiVersion"], "gpupool.dev/v1alpha1");
        assert_eq!(gm["kind"], "GpuModel");
        let name = gm["metadata"]["name"].as_str().expect("name");
        let spec = &gm["spec"];
        assert!(
            spec["computeWeight"].as_i64().unwrap_or(0) > 0,
            "{name}: computeWeight > 0"
        );
        assert!(
            spec["model"].is_string() ^ spec["productName"].is_string(),
            "{name}: model xor productName"
        );
        let model = spec["model"]
            .as_str()
            .or(spec["productName"].as_str())
            .unwrap_or_default();
        assert!(
            models.insert(model.to_owned()),
            "{name}: a second GpuModel for {model} would conflict"
        );
        assert_eq!(
            name,
            model.to_ascii_lowercase(),
            "{name}: named after its model"
        );
    }
    for model in [
        "A100-SXM4-40GB",
        "V100-SXM2-32GB",
        "RTX-3090",
        "H100-80GB-HBM3",
        "L40S",
        "T4",
    ] {
        assert!(models.contains(model), "a default GpuModel for {model}");
    }

    // Applying the examples after an install must not fight over the same cards.
    let examples_path = deploy_dir().join("examples/gpumodels.yaml");
    if !examples_path.exists() {
        return;
    }
    for example in parse_documents(&read(&examples_path), "examples/gpumodels.yaml") {
        let model = example["spec"]["model"]
            .as_str()
            .or(example["spec"]["productName"].as_str());
        let same_card = base.iter().find(|gm| {
            gm["spec"]["model"]
                .as_str()
                .or(gm["spec"]["productName"].as_str())
                == model
        });
        if let Some(default) = same_card {
            assert_eq!(
                default["metadata"]["name"], example["metadata"]["name"],
                "{model:?}"
            );
            assert_eq!(default["spec"], example["spec"], "{model:?}");
        }
    }
}

/// The real Helm: `GPUPOOL_HELM`, else `helm` on PATH (`.ci/install-helm` installs v4.1.4 and
/// prints its path); `None` without it (`test` then says it skips). A `GPUPOOL_HELM` that does not
/// run fails the test: CI set it, so a broken install must not pass as a skip.
fn helm(test: &str) -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("GPUPOOL_HELM") {
        let path = PathBuf::from(path);
        let out = Command::new(&path)
            .arg("version")
            .output()
            .unwrap_or_else(|e| panic!("GPUPOOL_HELM={}: {e}", path.display()));
        assert_succeeded(&out, &format!("GPUPOOL_HELM={} version", path.display()));
        return Some(path);
    }
    if have("helm", "version") {
        return Some(PathBuf::from("helm"));
    }
    println!(
        "skipping {test}: no helm (set GPUPOOL_HELM or put helm on PATH; `.ci/install-helm` \
         installs Helm v4.1.4 and prints its path), and the real Helm is what is tested"
    );
    None
}

/// `helm <args>` with its configuration, cache and data folders in the target folder: the chart
/// checks neither read nor change a user's Helm repositories and plugins.
fn helm_command(helm: &Path, args: &[&str]) -> Command {
    let home = workspace_root().join("target/helm-home");
    let mut cmd = Command::new(helm);
    cmd.args(args)
        .env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_DATA_HOME", home.join("data"));
    cmd
}

fn chart_dir() -> PathBuf {
    deploy_dir().join("helm/gpupool")
}

/// `helm template gpupool deploy/helm/gpupool --namespace <namespace> --include-crds --set ...`.
fn helm_template_output(helm: &Path, namespace: &str, sets: &[&str]) -> std::process::Output {
    let chart = chart_dir();
    let mut cmd = helm_command(
        helm,
        &[
            "template",
            "gpupool",
            chart.to_str().expect("utf-8 path"),
            "--namespace",
            namespace,
            "--include-crds",
        ],
    );
    for set in sets {
        cmd.args(["--set", set]);
    }
    cmd.output().expect("run helm template")
}

/// What the real Helm renders for the chart with the release namespace gpupool and `sets`.
fn helm_template(helm: &Path, sets: &[&str]) -> Vec<Value> {
    helm_template_in(helm, "gpupool", sets)
}

fn helm_template_in(helm: &Path, namespace: &str, sets: &[&str]) -> Vec<Value> {
    let out = helm_template_output(helm, namespace, sets);
    assert!(
        out.status.success(),
        "helm template --set {sets:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    parse_documents(&String::from_utf8_lossy(&out.stdout), "helm template")
}

/// Every value set that README.md, the chart's README and values.yaml document, each with the
/// kustomize overlay it must render where there is one. `documented_value_sets_are_all_tested`
/// keeps this list and the documents in step.
const VALUE_SETS: &[(&[&str], Option<&str>)] = &[
    (&[], Some("base")),
    (&["fakeGpus=a100-40gb:2"], Some("overlays/fake-gpus")),
    (&["driver.runtimeClassName=nvidia"], Some("overlays/nvidia")),
    // A list needs its comma escaped for --set (values.yaml says so).
    (&["fakeGpus=a100-40gb:2\\,v100-32gb:1"], None),
    (&["metrics.serviceMonitor.enabled=true"], None),
    (
        &[
            "metrics.serviceMonitor.enabled=true",
            "metrics.serviceMonitor.interval=15s",
            "metrics.serviceMonitor.labels.release=prometheus",
        ],
        None,
    ),
    (&["enforcement.default=Gpupool"], None),
    (&["enforcement.default=HamiCore"], None),
    (&["enforcement.default=None"], None),
    (&["enforcement.gpupool.install=false"], None),
    (&["enforcement.gpupool.libDir=/opt/gpupool"], None),
    (PATHS_AND_PORTS, None),
    (&["gpuModels=null"], None),
    (&["schedulerProfile.enabled=true"], None),
    (&["webhook.enabled=false"], None),
    (&["webhook.certManager.enabled=true"], None),
    (
        &[
            "webhook.certManager.enabled=true",
            "webhook.certManager.issuerRef.name=my-ca",
            "webhook.certManager.issuerRef.kind=ClusterIssuer",
            "webhook.replicas=2",
        ],
        None,
    ),
];

/// Every folder, port and name values.yaml lets a user move, moved at once.
const PATHS_AND_PORTS: &[&str] = &[
    "kubeletDir=/var/snap/microk8s/common/var/lib/kubelet",
    "cdiRoot=/etc/cdi",
    "runDir=/run/gpupool",
    "hamiCore.libDir=/opt/hami",
    "enforcement.gpupool.libDir=/opt/gpupool",
    "logFormat=text",
    "driver.healthzPort=9100",
    "driver.metricsPort=9101",
    "controller.metricsPort=9102",
    "controller.replicas=3",
    "image.repository=registry.example/gpupool",
    "image.tag=0.2.0",
    "image.pullPolicy=Always",
];

/// The `--set` arguments a document shows, as written: `--set a=b,c=d` gives both, an escaped
/// comma (`a=b\,c`) stays in its value.
fn documented_sets(text: &str) -> Vec<String> {
    let words: Vec<&str> = text.split_whitespace().collect();
    let mut sets = Vec::new();
    for pair in words.windows(2).filter(|pair| pair[0] == "--set") {
        // Shell quotes and Markdown backticks go, as does the sentence's punctuation after them.
        let arg = pair[1]
            .replace(['`', '\'', '"'], "")
            .trim_end_matches(['.', ',', ';', ':', ')'])
            .to_owned();
        let mut current = String::new();
        let mut chars = arg.chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                '\\' if chars.peek() == Some(&',') => {
                    current.push_str("\\,");
                    chars.next();
                }
                ',' => sets.push(std::mem::take(&mut current)),
                c => current.push(c),
            }
        }
        sets.push(current);
    }
    sets
}

#[test]
fn documented_value_sets_are_all_tested() {
    // Rendered, or shown as a value Helm refuses.
    let tested: BTreeSet<&str> = VALUE_SETS
        .iter()
        .flat_map(|(sets, _)| sets.iter().copied())
        .chain(
            WRONG_VALUES
                .iter()
                .flat_map(|(sets, _)| sets.iter().copied()),
        )
        .collect();
    let mut documented = Vec::new();
    for doc in [
        "README.md",
        "deploy/helm/gpupool/README.md",
        "deploy/helm/gpupool/values.yaml",
    ] {
        for set in documented_sets(&read(&workspace_root().join(doc))) {
            documented.push((doc, set));
        }
    }
    assert!(
        documented.iter().any(|(_, s)| s == "fakeGpus=a100-40gb:2"),
        "found the documented --set examples: {documented:?}"
    );
    for (doc, set) in &documented {
        assert!(
            tested.contains(set.as_str()),
            "{doc} shows --set {set}, which VALUE_SETS does not render"
        );
    }
    // Each enforcement the chart offers is rendered (Auto is the default).
    let schema: Value =
        serde_json::from_str(&read(&chart_dir().join("values.schema.json"))).expect("JSON");
    let choices = strings(&schema["properties"]["enforcement"]["properties"]["default"]["enum"]);
    assert!(choices.contains(&"Auto".to_owned()), "{choices:?}");
    for choice in choices.iter().filter(|c| *c != "Auto") {
        assert!(
            tested.contains(format!("enforcement.default={choice}").as_str()),
            "enforcement.default={choice} is not rendered"
        );
    }
}

#[test]
fn helm_lint_strict_passes_for_every_value_set() {
    let Some(helm) = helm("helm_lint_strict_passes_for_every_value_set") else {
        return;
    };
    let chart = chart_dir();
    for (sets, _) in VALUE_SETS {
        let mut cmd = helm_command(
            &helm,
            &["lint", "--strict", chart.to_str().expect("utf-8 path")],
        );
        for set in *sets {
            cmd.args(["--set", set]);
        }
        let out = cmd.output().expect("run helm lint");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("1 chart(s) linted, 0 chart(s) failed"),
            "helm lint --strict --set {sets:?}:\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // Not even a recommendation left (the icon was one).
        for level in ["[INFO]", "[WARNING]", "[ERROR]"] {
            assert!(
                !stdout.contains(level),
                "helm lint --set {sets:?} says:\n{stdout}"
            );
        }
    }
}

#[test]
fn chart_icon_is_the_svg_beside_it() {
    let chart: Value = serde_yaml::from_str(&read(&chart_dir().join("Chart.yaml"))).expect("YAML");
    let icon = chart["icon"].as_str().expect("Chart.yaml has an icon");
    let svg = std::fs::read(chart_dir().join("icon.svg")).expect("deploy/helm/gpupool/icon.svg");
    assert_eq!(
        icon,
        format!("data:image/svg+xml;base64,{}", base64(&svg)),
        "Chart.yaml's icon is icon.svg as a data: URL; refresh with: \
         echo \"data:image/svg+xml;base64,$(base64 -w0 deploy/helm/gpupool/icon.svg)\""
    );
}

/// Standard base64 with padding (RFC 4648), as `base64 -w0` writes it.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// What a user might mistype, and what Helm must answer: each answer names the value and the fault.
const WRONG_VALUES: &[(&[&str], &[&str])] = &[
    (
        &["fakeGpus=3"],
        &["at '/fakeGpus'", "got number, want string"],
    ),
    (
        &["fakeGpus=a100:2"],
        &["at '/fakeGpus'", "'a100:2' does not match pattern"],
    ),
    (
        &["fakeGpus=a100-40gb:0"],
        &["at '/fakeGpus'", "'a100-40gb:0' does not match pattern"],
    ),
    (
        &["fakeGPUs=a100-40gb:2"],
        &["additional properties 'fakeGPUs' not allowed"],
    ),
    (
        &["enforcement.default=gpupool"],
        &[
            "at '/enforcement/default'",
            "value must be one of 'Auto', 'Gpupool', 'HamiCore', 'None'",
        ],
    ),
    (
        &["enforcement.gpupool.instal=false"],
        &[
            "at '/enforcement/gpupool'",
            "additional properties 'instal' not allowed",
        ],
    ),
    (
        &["enforcement.gpupool.install=yes"],
        &[
            "at '/enforcement/gpupool/install'",
            "got string, want boolean",
        ],
    ),
    (
        &["enforcement.gpupool.libDir=usr/local/gpupool"],
        &["at '/enforcement/gpupool/libDir'", "does not match pattern"],
    ),
    (
        &["kubeletDir=/var/lib/kubelet/"],
        &["at '/kubeletDir'", "does not match pattern"],
    ),
    (
        &["hamicore.libDir=/opt/hami"],
        &["additional properties 'hamicore' not allowed"],
    ),
    (
        &["logFormat=yaml"],
        &["at '/logFormat'", "value must be one of 'json', 'text'"],
    ),
    (
        &["driver.healthzPort=0"],
        &["at '/driver/healthzPort'", "minimum: got 0, want 1"],
    ),
    (
        &["controller.replicas=two"],
        &["at '/controller/replicas'", "got string, want integer"],
    ),
    (
        &["metrics.serviceMonitor.interval=30"],
        &["at '/metrics/serviceMonitor/interval'"],
    ),
    (
        &["gpuModels[0].name=a100", "gpuModels[0].computeWeight=312"],
        &["at '/gpuModels/0'", "missing property 'model'"],
    ),
];

#[test]
fn helm_refuses_wrong_values_naming_them() {
    let Some(helm) = helm("helm_refuses_wrong_values_naming_them") else {
        return;
    };
    for (sets, expected) in WRONG_VALUES {
        let out = helm_template_output(&helm, "gpupool", sets);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "helm template --set {sets:?} was accepted"
        );
        assert!(
            stderr.contains("values don't meet the specifications of the schema"),
            "--set {sets:?}: the schema refused it:\n{stderr}"
        );
        for part in *expected {
            assert!(
                stderr.contains(part),
                "--set {sets:?}: the message says {part:?}:\n{stderr}"
            );
        }
    }
}

/// The fake GPU profiles the schema accepts are the driver's.
#[test]
fn values_schema_knows_the_driver_fake_gpu_profiles() {
    let source = read(&workspace_root().join("driver/src/inventory/fake.rs"));
    let driver: BTreeSet<String> = source
        .lines()
        .filter_map(|l| l.trim().strip_prefix("key: \""))
        .filter_map(|rest| rest.split('"').next())
        .map(str::to_owned)
        .collect();
    assert!(driver.contains("a100-40gb"), "{driver:?}");
    let schema: Value =
        serde_json::from_str(&read(&chart_dir().join("values.schema.json"))).expect("JSON");
    let pattern = schema["properties"]["fakeGpus"]["pattern"]
        .as_str()
        .expect("fakeGpus pattern");
    // The pattern names the profiles in one alternation, written twice (first and later items).
    let alternations: Vec<BTreeSet<String>> = pattern
        .split('(')
        .filter_map(|group| group.split(')').next())
        .filter(|group| group.contains('|') && group.contains("a100-40gb"))
        .map(|group| group.split('|').map(str::to_owned).collect())
        .collect();
    assert_eq!(alternations.len(), 2, "{pattern}");
    for profiles in alternations {
        assert_eq!(profiles, driver, "values.schema.json's fakeGpus profiles");
    }
}

/// Lists whose order means nothing to Kubernetes but that a strategic-merge patch reorders.
fn canonical(mut value: Value) -> Value {
    fn walk(value: &mut Value) {
        match value {
            Value::Object(map) => {
                for (field, child) in map.iter_mut() {
                    if let (Some(key), Value::Array(items)) = (
                        match field.as_str() {
                            "volumes" => Some("name"),
                            "volumeMounts" => Some("mountPath"),
                            _ => None,
                        },
                        &mut *child,
                    ) {
                        items.sort_by(|a, b| a[key].to_string().cmp(&b[key].to_string()));
                    }
                    walk(child);
                }
            }
            Value::Array(items) => items.iter_mut().for_each(walk),
            _ => {}
        }
    }
    walk(&mut value);
    value
}

fn by_key(objects: Vec<Value>) -> BTreeMap<String, Value> {
    objects
        .into_iter()
        .map(|o| (key(&o), canonical(o)))
        .collect()
}

#[test]
fn helm_chart_renders_the_kustomize_objects() {
    if kubectl_missing("helm_chart_renders_the_kustomize_objects") {
        return;
    }
    let Some(helm) = helm("helm_chart_renders_the_kustomize_objects") else {
        return;
    };
    for (sets, dir) in VALUE_SETS {
        let Some(dir) = dir else { continue };
        // Helm creates the release namespace itself (--create-namespace); a Namespace in the chart
        // would collide with it, so that one object is the base's alone.
        let kustomized = by_key(
            kustomize(dir)
                .into_iter()
                .filter(|o| o["kind"] != "Namespace")
                .collect(),
        );
        let rendered = by_key(helm_template(&helm, sets));
        let daemonset = rendered
            .values()
            .find(|o| o["kind"] == "DaemonSet")
            .unwrap_or_else(|| panic!("helm {sets:?} renders no DaemonSet"));
        assert_surge_upgrade(daemonset, &format!("helm {sets:?}"));
        assert_eq!(
            rendered.keys().collect::<Vec<_>>(),
            kustomized.keys().collect::<Vec<_>>(),
            "helm {sets:?} renders the objects of {dir}"
        );
        for (name, object) in &kustomized {
            assert!(
                &rendered[name] == object,
                "helm {sets:?} differs from {dir} in {name}:\nhelm:\n{}\nkustomize:\n{}",
                serde_yaml::to_string(&rendered[name]).unwrap_or_default(),
                serde_yaml::to_string(object).unwrap_or_default()
            );
        }
    }
}

/// Where the image carries the enforcement library, which `gpupool-driver install-lib` copies from.
const IMAGE_LIBRARY: &str = "/usr/local/lib/gpupool/libgpupool_vgpu.so";

/// The Containerfile's instructions, comments and blank lines dropped, continuations joined.
fn containerfile_instructions() -> Vec<String> {
    let text = read(&deploy_dir().join("Containerfile"));
    let mut instructions = Vec::new();
    let mut current = String::new();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        match line.strip_suffix('\\') {
            Some(part) => current.push_str(part),
            None => {
                current.push_str(line);
                instructions.push(std::mem::take(&mut current));
            }
        }
    }
    instructions
}

/// The Containerfile's stages by name, each with its instructions after FROM.
fn containerfile_stages() -> Vec<(String, Vec<String>)> {
    let mut stages: Vec<(String, Vec<String>)> = Vec::new();
    for instruction in containerfile_instructions() {
        if let Some(from) = instruction.strip_prefix("FROM ") {
            let name = from
                .split_once(" AS ")
                .map(|(_, name)| name.trim().to_owned())
                .unwrap_or_default();
            stages.push((name, vec![instruction.clone()]));
        } else if let Some((_, body)) = stages.last_mut() {
            body.push(instruction);
        }
    }
    stages
}

#[test]
fn containerfile_builds_from_source_by_default_or_packs_prebuilt_binaries() {
    let stages = containerfile_stages();
    let names: Vec<&str> = stages.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        ["build", "runtime", "prebuilt", "image"],
        "stages; the last one is what a plain `docker build` makes"
    );
    let stage = |name: &str| &stages.iter().find(|(n, _)| n == name).expect("stage").1;

    // Every COPY from the build context names something that exists, and together they hold every
    // workspace member (cargo loads them all).
    let workspace = read(&workspace_root().join("Cargo.toml"));
    let mut copied = BTreeSet::new();
    for line in stage("build").iter().filter(|l| l.starts_with("COPY ")) {
        let parts: Vec<&str> = line.split_whitespace().skip(1).collect();
        for source in &parts[..parts.len() - 1] {
            assert!(
                workspace_root().join(source).exists(),
                "COPY {source}: not in the repository"
            );
            copied.insert(source.to_string());
        }
    }
    let members = workspace
        .split("members = [")
        .nth(1)
        .and_then(|rest| rest.split(']').next())
        .expect("workspace members");
    for member in members.split('"').skip(1).step_by(2) {
        let top = member.split('/').next().unwrap_or(member);
        assert!(
            copied.contains(top),
            "the image build copies workspace member {member}"
        );
    }
    let build = stage("build")
        .iter()
        .find(|l| l.contains("cargo build"))
        .expect("a cargo build step");
    for needed in [
        "--release",
        "--locked",
        "-p gpupool-driver",
        "-p gpupool-controller",
        "-p gpupool-vgpu",
    ] {
        assert!(build.contains(needed), "cargo build {needed}");
    }

    // Both final stages start from the runtime stage and put the same three files in the same
    // places: the binaries on PATH, the library where install-lib takes it from.
    for (name, from) in [("prebuilt", "${BIN_DIR}/"), ("image", "/out/")] {
        let body = stage(name);
        assert_eq!(body[0], format!("FROM runtime AS {name}"));
        let copies: Vec<&String> = body.iter().filter(|l| l.starts_with("COPY ")).collect();
        // (source, destination) of each file copied.
        let copied: Vec<(String, String)> = copies
            .iter()
            .flat_map(|l| {
                let words: Vec<&str> = l
                    .split_whitespace()
                    .skip(1)
                    .filter(|w| !w.starts_with("--"))
                    .collect();
                let (destination, sources) = words.split_last().expect("COPY <src> <dst>");
                sources
                    .iter()
                    .map(|s| (s.to_string(), destination.to_string()))
                    .collect::<Vec<_>>()
            })
            .collect();
        for (file, destination) in [
            ("gpupool-driver", "/usr/local/bin/"),
            ("gpupool-controller", "/usr/local/bin/"),
            ("libgpupool_vgpu.so", IMAGE_LIBRARY),
        ] {
            assert!(
                copied.contains(&(format!("{from}{file}"), destination.to_owned())),
                "{name}: {file} to {destination}: {copied:?}"
            );
        }
        assert_eq!(
            copies.iter().any(|l| l.starts_with("COPY --from=build")),
            name == "image",
            "{name}: only the default target needs the Rust build"
        );
    }
    assert!(stage("prebuilt").contains(&"ARG BIN_DIR".to_owned()));
    assert!(
        containerfile_instructions().contains(&"ARG BIN_DIR=target/release".to_owned()),
        "the prebuilt target takes release binaries by default"
    );
    // The build context leaves out target/ but for those three release files.
    let ignore = read(&workspace_root().join(".dockerignore"));
    for file in ["gpupool-driver", "gpupool-controller", "libgpupool_vgpu.so"] {
        assert!(
            ignore
                .lines()
                .any(|l| l == format!("!target/release/{file}")),
            ".dockerignore keeps target/release/{file}"
        );
    }

    let user = stage("runtime")
        .iter()
        .rev()
        .find_map(|l| l.strip_prefix("USER "))
        .expect("a USER")
        .to_owned();
    let uid = user.split(':').next().unwrap_or_default().to_owned();
    assert!(
        uid != "0" && uid != "root",
        "the image runs as a non-root user, got {user}"
    );

    // The controller's pod runs as that same user.
    let Some(objects) = rendered_base(
        "containerfile_builds_from_source_by_default_or_packs_prebuilt_binaries (manifest part)",
    ) else {
        return;
    };
    let deployment = find(&objects, "Deployment", "gpupool-controller");
    assert_eq!(
        deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"].to_string(),
        uid,
        "controller pod user = image user"
    );
}

/// `kubectl --kubeconfig <kubeconfig> <args>` with `stdin`, run off the async runtime that serves the
/// emulator.
async fn kubectl_at(
    kubeconfig: &Path,
    args: &[&str],
    stdin: Option<String>,
) -> std::process::Output {
    let kubeconfig = kubeconfig.to_path_buf();
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        use std::io::Write;
        let mut child = Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .args(&args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("run kubectl");
        let mut input = child.stdin.take().expect("stdin");
        input
            .write_all(stdin.unwrap_or_default().as_bytes())
            .expect("write stdin");
        drop(input);
        child.wait_with_output().expect("kubectl output")
    })
    .await
    .expect("kubectl task")
}

fn to_yaml_stream(objects: &[Value]) -> String {
    objects
        .iter()
        .map(|o| format!("---\n{}", serde_yaml::to_string(o).expect("YAML")))
        .collect()
}

/// `kubectl apply --validate=strict` of `objects`, then every object read back with what was
/// rendered (nothing dropped on the way in: spec, rules, subjects, roleRef).
async fn apply_and_read_back(kubeconfig: &Path, objects: &[Value], origin: &str) {
    let out = kubectl_at(
        kubeconfig,
        &["apply", "--validate=strict", "-f", "-"],
        Some(to_yaml_stream(objects)),
    )
    .await;
    assert!(
        out.status.success(),
        "kubectl apply --validate=strict of {origin}:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let out = kubectl_at(
        kubeconfig,
        &["get", "-f", "-", "-o", "json"],
        Some(to_yaml_stream(objects)),
    )
    .await;
    assert!(
        out.status.success(),
        "get {origin}:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listed: Value = serde_json::from_slice(&out.stdout).expect("kubectl get -o json");
    let stored: BTreeMap<String, Value> = listed["items"]
        .as_array()
        .cloned()
        .unwrap_or_else(|| vec![listed.clone()])
        .into_iter()
        .map(|o| (key(&o), o))
        .collect();
    for object in objects {
        let stored = stored
            .get(&key(object))
            .unwrap_or_else(|| panic!("{origin}: {} not stored", key(object)));
        for field in ["spec", "rules", "subjects", "roleRef"] {
            if let Some(rendered) = object.get(field) {
                assert_eq!(
                    &stored[field],
                    rendered,
                    "{origin}: {} {field} as stored",
                    key(object)
                );
            }
        }
    }
}

/// The API server emulator on loopback and a kubeconfig for it (in `dir`).
async fn emulator(dir: &Path) -> (gpupool_apiserver::ApiServer, PathBuf) {
    let server = gpupool_apiserver::ApiServer::start()
        .await
        .expect("start the API emulator");
    let kubeconfig = dir.join("kubeconfig");
    server.write_kubeconfig(&kubeconfig).expect("kubeconfig");
    (server, kubeconfig)
}

/// Each value set as `helm install --create-namespace` would send it, to a fresh API server: the
/// namespace, the chart's CRDs, then the rest, created with strict field validation and read back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_helm_value_set_applies_to_the_api_emulator() {
    if kubectl_missing("every_helm_value_set_applies_to_the_api_emulator") {
        return;
    }
    let Some(helm) = helm("every_helm_value_set_applies_to_the_api_emulator") else {
        return;
    };
    for (sets, _) in VALUE_SETS {
        let origin = format!("helm --set {sets:?}");
        let objects = helm_template(&helm, sets);
        let dir = tempfile::tempdir().expect("tempdir");
        let (_server, kubeconfig) = emulator(dir.path()).await;
        let out = kubectl_at(&kubeconfig, &["create", "namespace", "gpupool"], None).await;
        assert_succeeded(&out, "kubectl create namespace gpupool");
        let (crds, rest): (Vec<Value>, Vec<Value>) = objects
            .into_iter()
            .partition(|o| o["kind"] == "CustomResourceDefinition");
        assert_eq!(crds.len(), 2, "{origin}: the chart's crds/");
        apply_and_read_back(&kubeconfig, &crds, &origin).await;

        if rest.iter().any(|o| o["kind"] == "ServiceMonitor") {
            // Without the Prometheus Operator a server knows no ServiceMonitor, and the install
            // fails saying so (values.yaml: "needs the monitoring.coreos.com CRDs"). Without
            // client-side validation, as `helm install` sends objects: kubectl's validation of an
            // unknown kind would fall back to OpenAPI v2 in protobuf, which the emulator serves only
            // as JSON.
            let out = kubectl_at(
                &kubeconfig,
                &["apply", "--validate=false", "-f", "-"],
                Some(to_yaml_stream(&rest)),
            )
            .await;
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{origin}: applied without the CRD");
            assert!(
                stderr.contains(
                    "no matches for kind \"ServiceMonitor\" in version \"monitoring.coreos.com/v1\""
                ),
                "{origin}: {stderr}"
            );
            let crd = workspace_root()
                .join("e2e/tests/fixtures/servicemonitors.monitoring.coreos.com.yaml");
            let out = kubectl_at(
                &kubeconfig,
                &[
                    "apply",
                    "--validate=strict",
                    "-f",
                    crd.to_str().expect("utf-8 path"),
                ],
                None,
            )
            .await;
            assert_succeeded(&out, "kubectl apply the ServiceMonitor CRD");
        }
        let (cert_manager, rest): (Vec<Value>, Vec<Value>) = rest.into_iter().partition(|o| {
            o["apiVersion"]
                .as_str()
                .is_some_and(|v| v.starts_with("cert-manager.io/"))
        });
        if !cert_manager.is_empty() {
            // Without cert-manager a server knows no Certificate, and the install fails saying so
            // (values.yaml: "With cert-manager installed"). Its CRDs are not in this repository,
            // so the Certificate and Issuer are checked as rendered (helm_webhook_values_...).
            let out = kubectl_at(
                &kubeconfig,
                &["apply", "--validate=false", "-f", "-"],
                Some(to_yaml_stream(&cert_manager)),
            )
            .await;
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(
                !out.status.success(),
                "{origin}: applied without cert-manager"
            );
            assert!(
                stderr.contains(
                    "no matches for kind \"Certificate\" in version \"cert-manager.io/v1\""
                ),
                "{origin}: {stderr}"
            );
        }
        apply_and_read_back(&kubeconfig, &rest, &origin).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manifests_apply_to_the_api_emulator_with_strict_field_validation() {
    if kubectl_missing("manifests_apply_to_the_api_emulator_with_strict_field_validation") {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let (_server, kubeconfig) = emulator(dir.path()).await;

    // As the install instructions say: CRDs first, so that the GpuModels of the base find their kind.
    let crds = deploy_dir().join("crds");
    let out = kubectl_at(
        &kubeconfig,
        &[
            "apply",
            "--validate=strict",
            "-f",
            crds.to_str().expect("utf-8 path"),
        ],
        None,
    )
    .await;
    assert!(
        out.status.success(),
        "apply deploy/crds:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );

    for (dir, objects) in each_rendered() {
        apply_and_read_back(&kubeconfig, &objects, dir).await;
    }

    // Strictness is real: a misspelt field in a built-in kind and in a custom resource is refused,
    // naming the field.
    let base = to_yaml_stream(&kustomize("base"));
    for (from, to) in [
        ("readOnlyRootFilesystem", "readOnlyRootFileSystem"),
        ("tier: workstation", "teir: workstation"),
    ] {
        assert!(base.contains(from), "the base has {from}");
        let broken = base.replacen(from, to, 1);
        let out = kubectl_at(
            &kubeconfig,
            &["apply", "--validate=strict", "-f", "-"],
            Some(broken),
        )
        .await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        let misspelt = to.split(':').next().unwrap_or(to);
        assert!(
            !out.status.success(),
            "a manifest with {misspelt} was accepted"
        );
        assert!(
            stderr.contains(misspelt),
            "the error names {misspelt}:\n{stderr}"
        );
    }
}

/// The workspace's built binary `name`, next to this test's own executable (target/<profile>/).
fn built_binary(name: &str) -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let profile_dir = exe.parent()?.parent()?;
    let path = profile_dir.join(name);
    path.is_file().then_some(path)
}

/// Long flags of `<binary> <subcommand> --help`, each with its possible values when clap lists them.
fn subcommand_flags(binary: &Path, subcommand: &str) -> BTreeMap<String, Option<Vec<String>>> {
    let out = Command::new(binary)
        .args([subcommand, "--help"])
        .output()
        .expect("<subcommand> --help");
    assert!(
        out.status.success(),
        "{} {subcommand} --help",
        binary.display()
    );
    let help = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut flags: BTreeMap<String, Option<Vec<String>>> = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in help.lines() {
        let trimmed = line.trim_start();
        let long = trimmed
            .split_whitespace()
            .find(|word| word.starts_with("--"))
            .filter(|_| trimmed.starts_with('-'));
        if let Some(long) = long {
            let name = long.trim_end_matches(',').to_owned();
            flags.insert(name.clone(), None);
            current = Some(name);
        }
        if let (Some(name), Some(start)) = (&current, line.find("[possible values: ")) {
            let rest = &line[start + "[possible values: ".len()..];
            let values = rest.split(']').next().unwrap_or_default();
            flags.insert(
                name.clone(),
                Some(values.split(", ").map(str::to_owned).collect()),
            );
        }
    }
    flags
}

#[test]
fn workload_args_are_flags_the_binaries_accept() {
    if kubectl_missing("workload_args_are_flags_the_binaries_accept") {
        return;
    }
    // Every container, init containers included: its command is `<binary> <subcommand>`.
    for (binary, kind, workload, container_name) in [
        ("gpupool-driver", "DaemonSet", "gpupool-driver", "driver"),
        (
            "gpupool-driver",
            "DaemonSet",
            "gpupool-driver",
            "install-lib",
        ),
        (
            "gpupool-controller",
            "Deployment",
            "gpupool-controller",
            "controller",
        ),
        (
            "gpupool-controller",
            "Deployment",
            "gpupool-webhook",
            "webhook",
        ),
    ] {
        let Some(path) = built_binary(binary) else {
            println!("skipping the {binary} flags: the binary is not built next to this test (cargo test --workspace builds it)");
            continue;
        };
        for (dir, objects) in each_rendered() {
            let c = container(find(&objects, kind, workload), container_name);
            let command = strings(&c["command"]);
            assert_eq!(
                command.first().map(String::as_str),
                Some(binary),
                "{dir}: {container_name}"
            );
            let subcommand = command.get(1).expect("a subcommand");
            let known = subcommand_flags(&path, subcommand);
            assert!(
                known.contains_key("--help"),
                "{binary} {subcommand}: parsed its help: {known:?}"
            );
            for arg in strings(&c["args"]) {
                let (name, value) = arg.split_once('=').unwrap_or((arg.as_str(), ""));
                let possible = known
                    .get(name)
                    .unwrap_or_else(|| panic!("{dir}: {binary} {subcommand} has no flag {name}"));
                if let Some(values) = possible {
                    assert!(
                        values.iter().any(|v| v == value),
                        "{dir}: {name}={value} not in {values:?}"
                    );
                }
            }
        }
    }
}

#[test]
fn helm_values_move_flags_and_mounts_together() {
    let Some(helm) = helm("helm_values_move_flags_and_mounts_together") else {
        return;
    };
    let kubelet = "/var/snap/microk8s/common/var/lib/kubelet";
    let objects = helm_template(&helm, PATHS_AND_PORTS);
    let ds = find(&objects, "DaemonSet", "gpupool-driver");
    let driver = container(ds, "driver");
    let mounts = host_mounts(ds, "driver");
    for (name, path) in [
        ("--registry-dir", format!("{kubelet}/plugins_registry")),
        ("--plugin-dir", format!("{kubelet}/plugins/gpupool.dev")),
        ("--state-dir", format!("{kubelet}/plugins/gpupool.dev")),
        ("--cdi-root", "/etc/cdi".to_owned()),
        ("--run-dir", "/run/gpupool".to_owned()),
        ("--vgpu-lib-dir", "/opt/hami".to_owned()),
        ("--gpupool-lib-dir", "/opt/gpupool".to_owned()),
    ] {
        assert_eq!(flag(driver, name), Some(path.clone()), "{name}");
        let (in_container, _) = mounts
            .get(&path)
            .unwrap_or_else(|| panic!("{path} is not mounted: {mounts:?}"));
        assert_eq!(
            in_container, &path,
            "{name}: same path in the container as on the host"
        );
    }
    assert_library_installed_into(ds, "/opt/gpupool", "helm");
    assert_eq!(flag(driver, "--log-format").as_deref(), Some("text"));
    assert_eq!(
        flag(driver, "--healthz-addr").as_deref(),
        Some("0.0.0.0:9100")
    );
    assert_eq!(driver["ports"][0]["containerPort"], 9100);
    assert_eq!(metrics_port(driver), 9101);
    let image = "registry.example/gpupool:0.2.0";
    for name in ["driver", "install-lib"] {
        assert_eq!(container(ds, name)["image"], image, "{name}");
        assert_eq!(container(ds, name)["imagePullPolicy"], "Always", "{name}");
    }

    let deployment = find(&objects, "Deployment", "gpupool-controller");
    assert_eq!(deployment["spec"]["replicas"], 3);
    let controller = container(deployment, "controller");
    assert_eq!(flag(controller, "--log-format").as_deref(), Some("text"));
    assert_eq!(metrics_port(controller), 9102);
    assert_eq!(controller["image"], image);

    // A release in another namespace confines that namespace's driver ServiceAccount.
    let elsewhere = helm_template_in(&helm, "gpu-system", &[]);
    let policy = find(
        &elsewhere,
        "ValidatingAdmissionPolicy",
        "gpupool-driver-resourceslices",
    );
    let condition = policy["spec"]["matchConditions"][0]["expression"].to_string();
    assert!(
        condition.contains("system:serviceaccount:gpu-system:gpupool-driver"),
        "{condition}"
    );
    for binding in of_kind(&elsewhere, "ClusterRoleBinding") {
        assert_eq!(
            binding["subjects"][0]["namespace"],
            "gpu-system",
            "{}",
            key(binding)
        );
    }
}

#[test]
fn helm_enforcement_values_set_the_default_and_the_library_install() {
    let Some(helm) = helm("helm_enforcement_values_set_the_default_and_the_library_install") else {
        return;
    };
    let daemonset =
        |sets: &[&str]| find(&helm_template(&helm, sets), "DaemonSet", "gpupool-driver").clone();
    let default = daemonset(&[]);
    assert_eq!(
        flag(container(&default, "driver"), "--default-enforcement").as_deref(),
        Some("Auto")
    );
    assert_library_installed_into(&default, GPUPOOL_LIB_DIR, "helm defaults");

    for choice in ["Gpupool", "HamiCore", "None"] {
        let ds = daemonset(&[&format!("enforcement.default={choice}")]);
        assert_eq!(
            flag(container(&ds, "driver"), "--default-enforcement").as_deref(),
            Some(choice)
        );
        // The library is installed whatever the default: a claim's GpuConfig may still ask for it.
        assert_library_installed_into(&ds, GPUPOOL_LIB_DIR, choice);
    }

    // Installed by the operator: no init container, the driver still looks in the folder.
    let ds = daemonset(&["enforcement.gpupool.install=false"]);
    assert!(
        ds["spec"]["template"]["spec"]["initContainers"].is_null(),
        "{}",
        ds["spec"]["template"]["spec"]["initContainers"]
    );
    let driver = container(&ds, "driver");
    assert_eq!(
        flag(driver, "--gpupool-lib-dir").as_deref(),
        Some(GPUPOOL_LIB_DIR)
    );
    assert_eq!(
        host_mounts(&ds, "driver").get(GPUPOOL_LIB_DIR),
        Some(&(GPUPOOL_LIB_DIR.to_owned(), true))
    );

    let ds = daemonset(&["enforcement.gpupool.libDir=/opt/gpupool"]);
    assert_library_installed_into(&ds, "/opt/gpupool", "libDir=/opt/gpupool");
    assert!(
        !host_mounts(&ds, "driver").contains_key(GPUPOOL_LIB_DIR),
        "the old folder is no longer mounted"
    );
}

/// The port of a `--metrics-addr=:<port>` flag.
fn metrics_port(container: &Value) -> u64 {
    let value = flag(container, "--metrics-addr").expect("--metrics-addr is set");
    value
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("--metrics-addr={value} names no port"))
}

/// The workload's port named `metrics` is where its binary serves, and a Service in its namespace
/// selects its pods and sends `metrics` there.
fn assert_metrics_exposed(
    objects: &[Value],
    kind: &str,
    name: &str,
    container_name: &str,
    origin: &str,
) {
    let workload = find(objects, kind, name);
    let c = container(workload, container_name);
    let port = metrics_port(c);
    let declared = c["ports"]
        .as_array()
        .and_then(|ports| ports.iter().find(|p| p["name"] == "metrics"))
        .unwrap_or_else(|| panic!("{origin}: {name} declares no port named metrics"));
    assert_eq!(declared["containerPort"], port, "{origin}: {name}");
    let pod_labels = workload["spec"]["template"]["metadata"]["labels"]
        .as_object()
        .cloned()
        .unwrap_or_default();
    let service = of_kind(objects, "Service")
        .into_iter()
        .find(|s| {
            s["metadata"]["namespace"] == workload["metadata"]["namespace"]
                && s["spec"]["selector"]
                    .as_object()
                    .is_some_and(|sel| sel.iter().all(|(k, v)| pod_labels.get(k) == Some(v)))
        })
        .unwrap_or_else(|| panic!("{origin}: no Service selects the pods of {name}"));
    let target = service["spec"]["ports"]
        .as_array()
        .and_then(|ports| ports.iter().find(|p| p["name"] == "metrics"))
        .unwrap_or_else(|| panic!("{origin}: the Service of {name} has no metrics port"));
    assert!(
        target["targetPort"] == "metrics" || target["targetPort"] == port,
        "{origin}: the Service of {name} sends metrics to {}",
        target["targetPort"]
    );
    // Headless: Prometheus scrapes every pod, not one behind a virtual IP.
    assert_eq!(service["spec"]["clusterIP"], "None", "{origin}: {name}");
}

#[test]
fn metrics_ports_are_served_and_exposed_by_headless_services() {
    for (dir, objects) in rendered("metrics_ports_are_served_and_exposed_by_headless_services") {
        assert_metrics_exposed(&objects, "DaemonSet", "gpupool-driver", "driver", dir);
        assert_metrics_exposed(
            &objects,
            "Deployment",
            "gpupool-controller",
            "controller",
            dir,
        );
        assert!(of_kind(&objects, "ServiceMonitor").is_empty(), "{dir}");
    }
}

#[test]
fn helm_service_monitors_are_optional_and_select_the_metrics_services() {
    let Some(helm) = helm("helm_service_monitors_are_optional_and_select_the_metrics_services")
    else {
        return;
    };
    assert!(of_kind(&helm_template(&helm, &[]), "ServiceMonitor").is_empty());
    let objects = helm_template(
        &helm,
        &[
            "metrics.serviceMonitor.enabled=true",
            "metrics.serviceMonitor.interval=15s",
            "driver.metricsPort=9100",
            "controller.metricsPort=9101",
        ],
    );
    assert_metrics_exposed(&objects, "DaemonSet", "gpupool-driver", "driver", "helm");
    assert_metrics_exposed(
        &objects,
        "Deployment",
        "gpupool-controller",
        "controller",
        "helm",
    );
    assert_eq!(
        metrics_port(container(
            find(&objects, "DaemonSet", "gpupool-driver"),
            "driver"
        )),
        9100
    );
    let monitors = of_kind(&objects, "ServiceMonitor");
    assert_eq!(monitors.len(), 2);
    for monitor in monitors {
        let selector = monitor["spec"]["selector"]["matchLabels"]
            .as_object()
            .expect("matchLabels");
        let service = of_kind(&objects, "Service")
            .into_iter()
            .find(|s| {
                s["metadata"]["labels"]
                    .as_object()
                    .is_some_and(|l| selector.iter().all(|(k, v)| l.get(k) == Some(v)))
            })
            .unwrap_or_else(|| panic!("{} selects no Service", monitor["metadata"]["name"]));
        let endpoint = &monitor["spec"]["endpoints"][0];
        assert_eq!(endpoint["port"], "metrics");
        assert_eq!(endpoint["path"], "/metrics");
        assert_eq!(endpoint["interval"], "15s");
        assert!(service["spec"]["ports"]
            .as_array()
            .is_some_and(|ports| ports.iter().any(|p| p["name"] == "metrics")));
    }
}

#[test]
fn the_grafana_dashboard_queries_only_metrics_the_binaries_export() {
    let path = deploy_dir().join("grafana/gpupool.json");
    let dashboard: Value = serde_json::from_str(&read(&path))
        .unwrap_or_else(|e| panic!("{}: not JSON: {e}", path.display()));
    let sources = [
        read(&workspace_root().join("driver/src/metrics/mod.rs")),
        read(&workspace_root().join("controller/src/metrics.rs")),
    ]
    .join("\n");
    let mut exprs = Vec::new();
    fn collect(value: &Value, out: &mut Vec<String>) {
        match value {
            Value::Object(map) => {
                if let Some(Value::String(expr)) = map.get("expr") {
                    out.push(expr.clone());
                }
                map.values().for_each(|v| collect(v, out));
            }
            Value::Array(items) => items.iter().for_each(|v| collect(v, out)),
            _ => {}
        }
    }
    collect(&dashboard, &mut exprs);
    assert!(exprs.len() >= 5, "{exprs:?}");
    for expr in &exprs {
        for name in expr
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .filter(|w| w.starts_with("gpupool_"))
        {
            // A family is registered under its name without the suffixes the exposition adds.
            let family = ["_total", "_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .unwrap_or(name);
            assert!(
                sources.contains(&format!("\"{family}\"")),
                "the dashboard queries {name}, which no binary exports: {expr}"
            );
        }
    }
}

/// The webhook's Service, Deployment and configuration agree with one another: each webhook calls
/// the Service on the port that reaches the container's HTTPS port at /validate, with the settings
/// deploy/base/webhook.yaml justifies.
fn assert_webhook_wired(objects: &[Value], origin: &str) {
    let service = find(objects, "Service", "gpupool-webhook");
    let deployment = find(objects, "Deployment", "gpupool-webhook");
    let pod_labels = &deployment["spec"]["template"]["metadata"]["labels"];
    for (label, value) in service["spec"]["selector"].as_object().expect("selector") {
        assert_eq!(
            &pod_labels[label], value,
            "{origin}: the Service selects the pods"
        );
    }
    let port = &service["spec"]["ports"][0];
    let c = container(deployment, "webhook");
    let container_port = c["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .find(|p| p["name"] == port["targetPort"])
        .unwrap_or_else(|| panic!("{origin}: no container port {}", port["targetPort"]));
    assert_eq!(
        flag(c, "--listen"),
        Some(format!(":{}", container_port["containerPort"])),
        "{origin}: the webhook listens on its container port"
    );
    let configuration = find(objects, "ValidatingWebhookConfiguration", "gpupool-webhook");
    let webhooks = configuration["webhooks"].as_array().expect("webhooks");
    let names: Vec<&str> = webhooks.iter().filter_map(|w| w["name"].as_str()).collect();
    assert_eq!(
        names,
        [
            "resourceclaims.gpupool.dev",
            "resourceclaimtemplates.gpupool.dev",
            "deviceclasses.gpupool.dev"
        ],
        "{origin}"
    );
    for webhook in webhooks {
        let to = &webhook["clientConfig"]["service"];
        assert_eq!(to["name"], service["metadata"]["name"], "{origin}");
        assert_eq!(
            to["namespace"], service["metadata"]["namespace"],
            "{origin}"
        );
        assert_eq!(to["port"], port["port"], "{origin}");
        assert_eq!(to["path"], "/validate", "{origin}");
        assert_eq!(webhook["failurePolicy"], "Ignore", "{origin}");
        assert_eq!(webhook["sideEffects"], "None", "{origin}");
        assert_eq!(webhook["timeoutSeconds"], 5, "{origin}");
        assert_eq!(
            strings(&webhook["admissionReviewVersions"]),
            ["v1"],
            "{origin}"
        );
        assert_eq!(
            strings(&webhook["rules"][0]["apiVersions"]),
            ["v1", "v1beta2", "v1beta1"],
            "{origin}"
        );
        let condition = webhook["matchConditions"][0]["expression"]
            .as_str()
            .expect("a match condition");
        assert!(
            condition.contains("c.opaque.driver == 'gpupool.dev'"),
            "{origin}: {condition}"
        );
    }
}

#[test]
fn helm_webhook_values_wire_it_take_cert_manager_and_turn_it_off() {
    let Some(helm) = helm("helm_webhook_values_wire_it_take_cert_manager_and_turn_it_off") else {
        return;
    };
    // Default: self-signed, the caBundle kept by the webhook (its flags name the configuration).
    let objects = helm_template(&helm, &[]);
    assert_webhook_wired(&objects, "helm (defaults)");
    let c = container(find(&objects, "Deployment", "gpupool-webhook"), "webhook");
    assert_eq!(
        flag(c, "--webhook-configuration").as_deref(),
        Some("gpupool-webhook")
    );
    assert!(find(
        &objects,
        "ValidatingWebhookConfiguration",
        "gpupool-webhook"
    )["webhooks"]
        .as_array()
        .expect("webhooks")
        .iter()
        .all(|w| w["clientConfig"].get("caBundle").is_none()));

    // cert-manager: its Certificate for the Service's names, mounted where the flags read it, the
    // key readable by the webhook's group only, the caBundle injected; no API access at all.
    let origin = "helm --set webhook.certManager.enabled=true";
    let objects = helm_template(&helm, &["webhook.certManager.enabled=true"]);
    assert_webhook_wired(&objects, origin);
    let configuration = find(
        &objects,
        "ValidatingWebhookConfiguration",
        "gpupool-webhook",
    );
    assert_eq!(
        configuration["metadata"]["annotations"]["cert-manager.io/inject-ca-from"],
        "gpupool/gpupool-webhook"
    );
    let certificate = find(&objects, "Certificate", "gpupool-webhook");
    assert_eq!(
        strings(&certificate["spec"]["dnsNames"]),
        [
            "gpupool-webhook.gpupool.svc",
            "gpupool-webhook.gpupool.svc.cluster.local"
        ]
    );
    assert_eq!(
        certificate["spec"]["issuerRef"]["name"],
        "gpupool-webhook-selfsigned"
    );
    find(&objects, "Issuer", "gpupool-webhook-selfsigned");
    let deployment = find(&objects, "Deployment", "gpupool-webhook");
    let pod = &deployment["spec"]["template"]["spec"];
    let volume = &pod["volumes"][0];
    assert_eq!(
        volume["secret"]["secretName"],
        certificate["spec"]["secretName"]
    );
    assert_eq!(volume["secret"]["defaultMode"], 0o440, "{origin}: key mode");
    assert_eq!(
        pod["securityContext"]["fsGroup"],
        pod["securityContext"]["runAsGroup"]
    );
    assert_eq!(pod["automountServiceAccountToken"], false);
    let c = container(deployment, "webhook");
    let mount = c["volumeMounts"][0]["mountPath"]
        .as_str()
        .expect("mountPath");
    assert_eq!(flag(c, "--tls-cert-file"), Some(format!("{mount}/tls.crt")));
    assert_eq!(flag(c, "--tls-key-file"), Some(format!("{mount}/tls.key")));
    assert!(
        of_kind(&objects, "ClusterRole")
            .iter()
            .all(|r| r["metadata"]["name"] != "gpupool-webhook"),
        "{origin}: no RBAC for a webhook that calls no API"
    );
    let objects = helm_template(
        &helm,
        &[
            "webhook.certManager.enabled=true",
            "webhook.certManager.issuerRef.name=my-ca",
            "webhook.certManager.issuerRef.kind=ClusterIssuer",
            "webhook.replicas=2",
        ],
    );
    let certificate = find(&objects, "Certificate", "gpupool-webhook");
    assert_eq!(
        certificate["spec"]["issuerRef"],
        serde_json::json!({"name": "my-ca", "kind": "ClusterIssuer"})
    );
    assert!(of_kind(&objects, "Issuer").is_empty());
    assert_eq!(
        find(&objects, "Deployment", "gpupool-webhook")["spec"]["replicas"],
        2
    );

    // Two self-signed replicas would make two CAs for one caBundle: refused, naming the way out.
    let out = helm_template_output(&helm, "gpupool", &["webhook.replicas=2"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("needs webhook.certManager.enabled=true"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Off: nothing of it is rendered.
    let objects = helm_template(&helm, &["webhook.enabled=false"]);
    let left: Vec<String> = objects
        .iter()
        .filter(|o| o.to_string().contains("gpupool-webhook"))
        .map(key)
        .collect();
    assert!(
        left.is_empty(),
        "webhook.enabled=false still renders {left:?}"
    );
}

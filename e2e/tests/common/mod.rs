//! What the scenarios share: one cluster per test file and the checks a user would make by hand.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use gpupool_api::claim::{ClaimRef, PreparedDevice};
use gpupool_e2e::harness::objects::{
    claim_template_yaml, claim_yaml, device_class_yaml, pod_yaml, template_pod_yaml, Request,
};
use gpupool_e2e::harness::{self, wait_for, Backend, ClusterSpec, NodeSpec, TestCluster, TestNode};
use gpupool_e2e::kubelet::PreparedClaim;
use k8s_openapi::api::core::v1::{Event, Pod};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{DeleteParams, ListParams};
use kube::Api;
use serde_json::Value;

pub use gpupool_api::claim::allocation_results;
pub use gpupool_e2e::sandbox::attribute;

pub const TIMEOUT: Duration = Duration::from_secs(30);

/// Each named scenario on every backend, one test body: `<scenario>::emulator`,
/// `<scenario>::control_plane` (the real control plane; skips, saying why, without its binaries)
/// and `<scenario>::real_cluster` (ignored; `GPUPOOL_E2E_KUBECONFIG`). The file provides
/// `async fn cluster(Backend) -> &'static TestCluster` and `mod scenarios` with an
/// `async fn <scenario>(&TestCluster)` each.
#[macro_export]
macro_rules! on_every_backend {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            use gpupool_e2e::harness::{plane_or_skip, shared_runtime, Backend};

            async fn run(backend: Backend) {
                let cluster = super::cluster(backend).await;
                let _logs = cluster.logs_on_failure();
                super::scenarios::$name(cluster).await;
            }

            #[test]
            fn emulator() {
                shared_runtime().block_on(run(Backend::Emulator));
            }

            #[test]
            fn control_plane() {
                shared_runtime().block_on(async {
                    let test = concat!(stringify!($name), "::control_plane");
                    if plane_or_skip(test).await.is_some() {
                        run(Backend::ControlPlane).await;
                    }
                });
            }

            #[test]
            #[ignore = "runs against GPUPOOL_E2E_KUBECONFIG"]
            fn real_cluster() {
                assert!(
                    std::env::var_os("GPUPOOL_E2E_KUBECONFIG").is_some(),
                    "real-cluster scenarios need GPUPOOL_E2E_KUBECONFIG and GPUPOOL_E2E_NODE"
                );
                shared_runtime().block_on(run(Backend::from_env()));
            }
        }
    )*};
}

/// Each named scenario on both backends, one body `async fn <scenario>(Backend)` that starts a
/// cluster of its own: `<scenario>::emulator` and `<scenario>::control_plane` (skips, saying why,
/// without the control plane's binaries). Each runs on a runtime of its own, as `#[tokio::test]`.
#[macro_export]
macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            use gpupool_e2e::harness::{plane_or_skip, two_worker_runtime, Backend};

            #[test]
            fn emulator() {
                two_worker_runtime()
                    .expect("a runtime")
                    .block_on(super::$name(Backend::Emulator));
            }

            #[test]
            fn control_plane() {
                two_worker_runtime().expect("a runtime").block_on(async {
                    let test = concat!(stringify!($name), "::control_plane");
                    if plane_or_skip(test).await.is_some() {
                        super::$name(Backend::ControlPlane).await;
                    }
                });
            }
        }
    )*};
}

/// The scheduler's word that the pod cannot be placed (a Warning `FailedScheduling` on the pod),
/// once it says it, and the pod's claims are unallocated. kube-scheduler says how many nodes could
/// not take the claims; the emulator's stand-in also says which device refused and why, and on
/// the emulator that message must contain `stand_in_detail`.
pub async fn wait_unschedulable(
    cluster: &TestCluster,
    namespace: &str,
    pod: &str,
    stand_in_detail: &str,
) -> String {
    let expected = if cluster.is_emulated() {
        stand_in_detail
    } else {
        "cannot allocate all claims"
    };
    let last = Mutex::new(Vec::new());
    let message = wait_for(
        &format!("FailedScheduling on pod {namespace}/{pod} saying {expected:?}"),
        TIMEOUT,
        || async {
            let messages: Vec<String> = events_about(cluster, namespace, "Pod", pod)
                .await
                .into_iter()
                .filter(|e| e.reason.as_deref() == Some("FailedScheduling"))
                .filter_map(|e| e.message)
                .collect();
            let found = messages.iter().find(|m| m.contains(expected)).cloned();
            *last.lock().unwrap() = messages;
            found
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}; events: {:?}", last.lock().unwrap()));
    let pods: Api<Pod> = Api::namespaced(cluster.client(), namespace);
    let pod_object = pods.get(pod).await.unwrap();
    assert_eq!(
        pod_object.spec.as_ref().and_then(|s| s.node_name.clone()),
        None,
        "pod {pod} is not bound"
    );
    message
}

/// Starts the cluster, or fails the test saying why it did not start.
pub async fn start(spec: ClusterSpec) -> TestCluster {
    TestCluster::start(spec)
        .await
        .unwrap_or_else(|e| panic!("starting the cluster: {e}"))
}

/// A cluster of the one node on `backend`.
pub async fn start_node(node: NodeSpec, backend: Backend) -> TestCluster {
    start(ClusterSpec {
        nodes: vec![node],
        backend: Some(backend),
        ..ClusterSpec::new()
    })
    .await
}

/// Creates the e2e DeviceClass, the class the tests' claims name.
pub async fn apply_device_class(cluster: &TestCluster) {
    cluster
        .apply_yaml(&device_class_yaml(), "default")
        .await
        .unwrap_or_else(|e| panic!("creating the e2e DeviceClass: {e}"));
}

pub async fn apply(cluster: &TestCluster, namespace: &str, yaml: &str) {
    cluster
        .apply_yaml(yaml, namespace)
        .await
        .unwrap_or_else(|e| panic!("applying to {namespace}: {e}\n{yaml}"));
}

/// Creates the claim `name` of `requests` (`claim_yaml`).
pub async fn apply_claim(cluster: &TestCluster, namespace: &str, name: &str, requests: &[Request]) {
    apply(cluster, namespace, &claim_yaml(name, requests)).await;
}

pub async fn claim(cluster: &TestCluster, namespace: &str, name: &str) -> ResourceClaim {
    Api::<ResourceClaim>::namespaced(cluster.client(), namespace)
        .get(name)
        .await
        .unwrap_or_else(|e| panic!("get resourceclaim {namespace}/{name}: {e}"))
}

/// gpupool's (first) entry in the claim's `status.devices`, once the driver has written one.
pub async fn driver_status_entry(
    cluster: &TestCluster,
    namespace: &str,
    name: &str,
) -> Option<k8s_openapi::api::resource::v1::AllocatedDeviceStatus> {
    claim(cluster, namespace, name)
        .await
        .status?
        .devices?
        .into_iter()
        .find(|d| d.driver == gpupool_api::names::DRIVER_NAME)
}

pub async fn events_about(
    cluster: &TestCluster,
    namespace: &str,
    kind: &str,
    name: &str,
) -> Vec<Event> {
    harness::events_about(&cluster.client(), Some(namespace), kind, name).await
}

/// Creates the claim `name` of `requests` and the pod `name` that uses it.
pub async fn apply_claim_and_pod(
    cluster: &TestCluster,
    namespace: &str,
    name: &str,
    requests: &[Request],
) {
    apply_claim(cluster, namespace, name, requests).await;
    apply(cluster, namespace, &pod_yaml(name, &[name])).await;
}

/// Creates the ResourceClaimTemplate `template` of `requests` and the pod `pod` with a claim from
/// it; returns the pod once it runs.
pub async fn run_from_template(
    cluster: &TestCluster,
    namespace: &str,
    pod: &str,
    template: &str,
    requests: &[Request],
) -> Pod {
    apply(cluster, namespace, &claim_template_yaml(template, requests)).await;
    apply(cluster, namespace, &template_pod_yaml(pod, template)).await;
    wait_pod_running(cluster, namespace, pod).await
}

/// Runs `kubectl <args>` until `check` finds in its output what it returns; on timeout the panic
/// shows the last output (`what` names the wait).
pub async fn wait_for_kubectl<T>(
    cluster: &TestCluster,
    args: &[&str],
    what: &str,
    check: impl Fn(&str) -> Option<T>,
) -> T {
    let last = Mutex::new(String::new());
    let (last_ref, check) = (&last, &check);
    wait_for(what, TIMEOUT, || async move {
        let output = cluster.kubectl(args).await.ok()?;
        let found = check(&output);
        *last_ref.lock().unwrap() = output;
        found
    })
    .await
    .unwrap_or_else(|e| panic!("{e}; last output:\n{}", last.lock().unwrap()))
}

/// Waits for an Event about the pod with `reason` (`what` names the wait in a timeout).
pub async fn wait_pod_event(
    cluster: &TestCluster,
    namespace: &str,
    pod: &str,
    reason: &str,
    what: &str,
) -> Event {
    wait_for(what, TIMEOUT, || async {
        events_about(cluster, namespace, "Pod", pod)
            .await
            .into_iter()
            .find(|e| e.reason.as_deref() == Some(reason))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

/// Waits for the pod to run; on timeout the panic says where it is stuck.
pub async fn wait_pod_running(cluster: &TestCluster, namespace: &str, name: &str) -> Pod {
    let pods: Api<Pod> = Api::namespaced(cluster.client(), namespace);
    let result = wait_for(
        &format!("pod {namespace}/{name} to run"),
        TIMEOUT,
        || async {
            let pod = pods.get(name).await.ok()?;
            let running = pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
            running.then_some(pod)
        },
    )
    .await;
    match result {
        Ok(pod) => pod,
        Err(err) => {
            let pod = pods.get(name).await.ok();
            let claims = Api::<ResourceClaim>::namespaced(cluster.client(), namespace)
                .list(&ListParams::default())
                .await
                .map(|l| l.items)
                .unwrap_or_default();
            let kubelet_errors: Vec<String> = cluster
                .nodes()
                .iter()
                .filter_map(|n| n.kubelet.as_ref())
                .filter_map(|k| k.pod_error(namespace, name))
                .collect();
            panic!(
                "{err}\npod: {}\nclaims: {}\nevents: {:?}\nkubelet errors: {kubelet_errors:?}",
                serde_json::to_string(&pod).unwrap_or_default(),
                serde_json::to_string(&claims).unwrap_or_default(),
                events_about(cluster, namespace, "Pod", name)
                    .await
                    .iter()
                    .map(|e| e.message.clone().unwrap_or_default())
                    .collect::<Vec<_>>()
            )
        }
    }
}

pub async fn delete_pod(cluster: &TestCluster, namespace: &str, name: &str) {
    let pods: Api<Pod> = Api::namespaced(cluster.client(), namespace);
    pods.delete(name, &DeleteParams::default())
        .await
        .unwrap_or_else(|e| panic!("delete pod {namespace}/{name}: {e}"));
}

/// Published devices of a node by name, once `count` are there.
pub async fn devices_of(
    cluster: &TestCluster,
    node: &str,
    count: usize,
) -> BTreeMap<String, k8s_openapi::api::resource::v1::Device> {
    let slices: Vec<ResourceSlice> = cluster
        .wait_for_slices(node, count, TIMEOUT)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    slices
        .into_iter()
        .flat_map(|s| s.spec.devices.unwrap_or_default())
        .map(|d| (d.name.clone(), d))
        .collect()
}

pub async fn device_uuid(cluster: &TestCluster, node: &str, device: &str, count: usize) -> String {
    let devices = devices_of(cluster, node, count).await;
    let d = devices
        .get(device)
        .unwrap_or_else(|| panic!("node {node} publishes no {device}: {:?}", devices.keys()));
    attribute(d, "uuid")
        .and_then(|a| a.string.clone())
        .unwrap_or_else(|| panic!("{node}/{device} has no uuid attribute"))
}

/// The device's memory capacity in MiB, as the whole-card limit should read.
pub fn memory_mib(device: &k8s_openapi::api::resource::v1::Device) -> u64 {
    let q = &device.capacity.as_ref().expect("capacity")["memory"]
        .value
        .0;
    let bytes = gpupool_api::quantity::parse(q)
        .expect("memory quantity")
        .ceil_units();
    (bytes as u64) / (1024 * 1024)
}

/// What the kubelet prepared for a claim, once it has. With a real kubelet (nothing to ask) it is read
/// back from the claim's CDI spec: devices in spec order, ids from their names, no request names.
pub async fn prepared(node: &TestNode, claim_uid: &str) -> PreparedClaim {
    let what = format!("claim {claim_uid} prepared on {}", node.name);
    let result = match &node.kubelet {
        Some(kubelet) => {
            wait_for(&what, TIMEOUT, || async {
                kubelet.prepared_claims().get(claim_uid).cloned()
            })
            .await
        }
        None => {
            wait_for(&what, TIMEOUT, || async {
                node.cdi_spec(claim_uid)
                    .map(|spec| prepared_from_cdi(&node.name, claim_uid, &spec))
            })
            .await
        }
    };
    result.unwrap_or_else(|e| panic!("{e}\n--- driver log ---\n{}", node.driver_log()))
}

fn prepared_from_cdi(node: &str, claim_uid: &str, spec: &Value) -> PreparedClaim {
    let devices = spec["devices"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|d| d["name"].as_str())
        .map(|name| {
            // <claimUID>-gpu-<index>[-<shareID>]
            let rest = name.strip_prefix(&format!("{claim_uid}-")).unwrap_or(name);
            let mut parts = rest.splitn(3, '-');
            let device = format!(
                "{}-{}",
                parts.next().unwrap_or_default(),
                parts.next().unwrap_or_default()
            );
            PreparedDevice {
                request_names: Vec::new(),
                pool_name: node.to_string(),
                device_name: device,
                cdi_device_ids: vec![gpupool_api::names::cdi_device_id(name)],
                share_id: parts.next().map(str::to_string),
            }
        })
        .collect();
    PreparedClaim {
        claim: ClaimRef {
            namespace: String::new(),
            name: String::new(),
            uid: claim_uid.to_string(),
        },
        devices,
        pod_uids: Default::default(),
        drivers: Default::default(),
    }
}

/// The CDI spec of a claim; panics naming the path when it is missing.
pub fn cdi_spec(node: &TestNode, claim_uid: &str) -> Value {
    node.cdi_spec(claim_uid).unwrap_or_else(|| {
        panic!(
            "no CDI spec at {} (folder has {:?})",
            node.cdi_spec_path(claim_uid).display(),
            node.cdi_spec_files()
        )
    })
}

/// The env a container gets from one CDI device of the spec plus the spec-wide edits.
pub fn env_for(spec: &Value, cdi_device_id: &str) -> BTreeMap<String, String> {
    let device_name = cdi_device_id
        .rsplit_once('=')
        .map_or(cdi_device_id, |(_, n)| n);
    let mut env = BTreeMap::new();
    let mut add = |edits: Option<&Value>| {
        for entry in edits
            .and_then(|e| e.get("env"))
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
        {
            if let Some((k, v)) = entry.split_once('=') {
                env.insert(k.to_string(), v.to_string());
            }
        }
    };
    add(spec.get("containerEdits"));
    let device = spec["devices"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|d| d["name"] == device_name)
        .unwrap_or_else(|| panic!("CDI spec has no device {device_name}: {spec}"));
    add(device.get("containerEdits"));
    env
}

/// Every deviceNode path anywhere in the spec.
pub fn device_nodes(spec: &Value) -> Vec<String> {
    let mut out = Vec::new();
    let mut collect = |edits: &Value| {
        for node in edits
            .get("deviceNodes")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            out.push(node["path"].as_str().unwrap_or_default().to_string());
        }
    };
    if let Some(edits) = spec.get("containerEdits") {
        collect(edits);
    }
    for device in spec["devices"].as_array().into_iter().flatten() {
        if let Some(edits) = device.get("containerEdits") {
            collect(edits);
        }
    }
    out
}

/// gpupool's allocation results of a claim: (request, pool, device, shareID).
pub fn results(claim: &ResourceClaim) -> Vec<(String, String, String, Option<String>)> {
    allocation_results(claim)
        .iter()
        .filter(|r| r.driver == "gpupool.dev")
        .map(|r| {
            let r = r.clone();
            (r.request, r.pool, r.device, r.share_id)
        })
        .collect()
}

/// `kubectl get` table: rows by NAME, cells by column header (no cell here holds a space).
pub fn table_rows(table: &str) -> BTreeMap<String, BTreeMap<String, String>> {
    let mut lines = table.lines();
    let headers: Vec<&str> = lines
        .next()
        .map(|h| h.split_whitespace().collect())
        .unwrap_or_default();
    lines
        .map(|line| {
            let row: BTreeMap<String, String> = headers
                .iter()
                .zip(line.split_whitespace())
                .map(|(h, v)| (h.to_string(), v.to_string()))
                .collect();
            (row.get("NAME").cloned().unwrap_or_default(), row)
        })
        .collect()
}

/// The `model` attribute a node publishes for one of its devices.
pub async fn model_of(cluster: &TestCluster, node: &str, device: &str) -> String {
    let slices = cluster
        .slices_of(node)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let d = slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .find(|d| d.name == device)
        .unwrap_or_else(|| panic!("node {node} publishes no {device}"));
    attribute(d, gpupool_api::names::attr::MODEL)
        .and_then(|a| a.string.clone())
        .unwrap_or_default()
}

//! GPU health over the real binaries: an XID on a card with a running share taints the card in the
//! node's ResourceSlice, shows Unhealthy in the pod's status and keeps new claims off it, until
//! the operator clears it after a reset.

mod common;

use std::time::Duration;

use gpupool_e2e::harness::objects::Request;
use gpupool_e2e::harness::process::find_binary;
use gpupool_e2e::harness::{wait_for, Backend, NodeSpec, TestCluster};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::DeviceTaint;
use kube::Api;
use serde_json::Value;

const NODE: &str = "node-x";

on_both_backends!(an_xid_taints_the_card_until_it_is_cleared);

/// The node's name on the backend (unique per turn on the control plane).
fn node_name(cluster: &TestCluster) -> String {
    cluster.node(NODE).unwrap().name.clone()
}

/// `gpupool-driver inject-xid` as an operator runs it on the node: (succeeded, output).
fn inject(cluster: &TestCluster, device: &str, what: &str) -> (bool, String) {
    let binary = find_binary("gpupool-driver").unwrap_or_else(|e| panic!("{e}"));
    let node = cluster.node(NODE).unwrap();
    let out = std::process::Command::new(binary)
        .arg("inject-xid")
        .arg("--run-dir")
        .arg(&node.dirs.run)
        .args([device, what])
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

async fn taints_of(cluster: &TestCluster, device: &str) -> Vec<DeviceTaint> {
    let slices = cluster
        .slices_of(&node_name(cluster))
        .await
        .unwrap_or_default();
    slices
        .into_iter()
        .flat_map(|s| s.spec.devices.unwrap_or_default())
        .find(|d| d.name == device)
        .and_then(|d| d.taints)
        .unwrap_or_default()
}

/// The device a claim was allocated, once it is.
async fn allocated_device(cluster: &TestCluster, ns: &str, claim: &str) -> Option<String> {
    let c = common::claim(cluster, ns, claim).await;
    common::results(&c).first().map(|r| r.2.clone())
}

/// `allocatedResourcesStatus[].resources[].health` of the pod's first container.
async fn pod_health(pods: &Api<Pod>, name: &str) -> Vec<String> {
    let pod = pods.get(name).await.unwrap();
    let statuses =
        serde_json::to_value(pod.status.and_then(|s| s.container_statuses)).unwrap_or(Value::Null);
    statuses[0]["allocatedResourcesStatus"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|e| e["resources"].as_array().cloned().unwrap_or_default())
        .filter_map(|r| r["health"].as_str().map(String::from))
        .collect()
}

/// The Ready condition (status, reason) of the driver's status entry on the claim of `pod`.
async fn claim_ready(cluster: &TestCluster, ns: &str, pod: &str) -> Option<(String, String)> {
    let pods: Api<Pod> = Api::namespaced(cluster.client(), ns);
    let claim_name = pods
        .get(pod)
        .await
        .ok()?
        .status?
        .resource_claim_statuses?
        .first()?
        .resource_claim_name
        .clone()?;
    let entry = common::driver_status_entry(cluster, ns, &claim_name).await?;
    let ready = entry.conditions?.into_iter().find(|c| c.type_ == "Ready")?;
    Some((ready.status, ready.reason))
}

/// Waits until the pod's one device shows `health`.
async fn wait_pod_health(pods: &Api<Pod>, name: &str, health: &str, what: &str) {
    wait_for(what, common::TIMEOUT, || async {
        (pod_health(pods, name).await == [health]).then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

/// Waits until the Ready condition on the claim of `pod` is `(status, reason)`.
async fn wait_claim_ready(
    cluster: &TestCluster,
    ns: &str,
    pod: &str,
    (status, reason): (&str, &str),
    what: &str,
) {
    wait_for(what, common::TIMEOUT, || async {
        let ready = claim_ready(cluster, ns, pod).await;
        (ready == Some((status.into(), reason.into()))).then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

async fn node_event_reasons(cluster: &TestCluster) -> Vec<(String, String)> {
    common::events_about(cluster, "default", "Node", &node_name(cluster))
        .await
        .into_iter()
        .map(|e| (e.reason.unwrap_or_default(), e.message.unwrap_or_default()))
        .collect()
}

async fn an_xid_taints_the_card_until_it_is_cleared(backend: Backend) {
    let cluster = common::start_node(NodeSpec::new(NODE, "a100-40gb:2"), backend).await;
    let _logs = cluster.logs_on_failure();
    common::apply_device_class(&cluster).await;
    let ns = cluster.create_namespace("e2e-gpu-health").await.unwrap();
    let pods: Api<Pod> = Api::namespaced(cluster.client(), &ns);
    let gpu0 = common::device_uuid(&cluster, &node_name(&cluster), "gpu-0", 2).await;

    // A share running on gpu-0, from a template: the kubelet reports health for those.
    let share = Request::new("gpu").on(&gpu0).memory("4Gi").cores("25");
    common::run_from_template(&cluster, &ns, "trainer", "trainer", &[share]).await;
    wait_pod_health(&pods, "trainer", "Healthy", "the share to show Healthy").await;

    // Names that are not this node's devices are refused before anything changes.
    let (ok, text) = inject(&cluster, "gpu-7", "79");
    assert!(!ok && text.contains("gpu-7"), "{text}");
    let (ok, text) = inject(&cluster, "gpu-0", "not-an-xid");
    assert!(!ok && text.contains("not an XID"), "{text}");

    let (ok, text) = inject(&cluster, "gpu-0", "79");
    assert!(ok, "{text}");
    assert!(text.contains("gpupool.dev/xid=79"), "{text}");

    // The slice carries the taint on gpu-0 only.
    let taints = wait_for("the taint on gpu-0", common::TIMEOUT, || async {
        let t = taints_of(&cluster, "gpu-0").await;
        (!t.is_empty()).then_some(t)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        taints
            .iter()
            .map(|t| (t.key.as_str(), t.value.as_deref(), t.effect.as_str()))
            .collect::<Vec<_>>(),
        [("gpupool.dev/xid", Some("79"), "NoSchedule")]
    );
    assert!(taints_of(&cluster, "gpu-1").await.is_empty());

    // The running share shows the card Unhealthy, and its claim is no longer Ready.
    wait_pod_health(&pods, "trainer", "Unhealthy", "the share to show Unhealthy").await;
    wait_claim_ready(
        &cluster,
        &ns,
        "trainer",
        ("False", "DeviceUnhealthy"),
        "the share's claim to be Ready=False",
    )
    .await;

    // The Node Event says what happened.
    let events = wait_for("a GpuXidError Node Event", common::TIMEOUT, || async {
        let events = node_event_reasons(&cluster).await;
        events
            .iter()
            .any(|(reason, _)| reason == "GpuXidError")
            .then_some(events)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let (_, message) = events.iter().find(|(r, _)| r == "GpuXidError").unwrap();
    assert!(
        message.contains("gpu-0") && message.contains("XID 79"),
        "{message}"
    );

    // A new share lands on the healthy card. 20Gi leaves gpu-1 too little for the third claim.
    let second = Request::new("gpu").memory("20Gi");
    common::apply_claim_and_pod(&cluster, &ns, "second", &[second]).await;
    common::wait_pod_running(&cluster, &ns, "second").await;
    assert_eq!(
        allocated_device(&cluster, &ns, "second").await.as_deref(),
        Some("gpu-1")
    );

    // 30Gi fits only in what gpu-0 has left: it waits while gpu-0 is tainted.
    let third = Request::new("gpu").memory("30Gi");
    common::apply_claim_and_pod(&cluster, &ns, "third", &[third]).await;
    let refused = common::wait_unschedulable(&cluster, &ns, "third", "gpupool.dev/xid").await;
    if cluster.is_emulated() {
        assert!(refused.contains("gpu-0"), "{refused}");
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(allocated_device(&cluster, &ns, "third").await, None);

    // The card was reset: clear the taint; the waiting claim gets gpu-0.
    let (ok, text) = inject(&cluster, "gpu-0", "clear");
    assert!(ok, "{text}");
    wait_for("the taint to go", common::TIMEOUT, || async {
        taints_of(&cluster, "gpu-0").await.is_empty().then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    common::wait_pod_running(&cluster, &ns, "third").await;
    assert_eq!(
        allocated_device(&cluster, &ns, "third").await.as_deref(),
        Some("gpu-0")
    );
    wait_pod_health(
        &pods,
        "trainer",
        "Healthy",
        "the share to show Healthy again",
    )
    .await;
    wait_claim_ready(
        &cluster,
        &ns,
        "trainer",
        ("True", "DeviceRecovered"),
        "the share's claim to be Ready again",
    )
    .await;
    let events = node_event_reasons(&cluster).await;
    assert!(
        events
            .iter()
            .any(|(r, m)| r == "GpuRecovered" && m.contains("gpu-0")),
        "{events:?}"
    );

    // Clearing a healthy card again is harmless and says so.
    let (ok, text) = inject(&cluster, "gpu-0", "clear");
    assert!(ok && text.contains("unchanged"), "{text}");
}

//! The loop end to end against the API server emulator: a pod with a claim template gets a
//! claim, an allocation, a reservation and a node; one that cannot fit gets an event on the pod; deleting
//! the pod deletes its generated claim.

use std::time::Duration;

use gpupool_apiserver::ApiServer;
use gpupool_scheduler::{spawn, Options};
use k8s_openapi::api::core::v1::{Event, Node, Pod};
use k8s_openapi::api::resource::v1::{
    DeviceClass, DeviceRequestAllocationResult, ResourceClaim, ResourceClaimTemplate, ResourceSlice,
};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::Client;
use serde_json::json;

async fn create<K>(api: &Api<K>, value: serde_json::Value) -> K
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    let object: K = serde_json::from_value(value).unwrap();
    api.create(&PostParams::default(), &object).await.unwrap()
}

fn gpu(index: u32) -> serde_json::Value {
    json!({
        "name": format!("gpu-{index}"),
        "allowMultipleAllocations": true,
        "attributes": {"model": {"string": "A100-SXM4-40GB"}, "index": {"int": index}},
        "capacity": {
            "memory": {"value": "40Gi", "requestPolicy": {"default": "40Gi", "validRange": {"min": "1Mi", "step": "1Mi"}}},
            "cores": {"value": "100", "requestPolicy": {"default": "0", "validRange": {"min": "0", "max": "100", "step": "1"}}}
        }
    })
}

/// Creates `nodes`, the class of A100s (with an `extendedResourceName` if given), and node-b's
/// slice of two A100s.
async fn seed(client: &Client, nodes: &[&str], extended_resource_name: Option<&str>) {
    let node_api: Api<Node> = Api::all(client.clone());
    for name in nodes {
        create(&node_api, json!({"metadata": {"name": name}})).await;
    }
    let mut class = json!({
        "metadata": {"name": "a100-sxm4-40gb.gpupool.dev"},
        "spec": {"selectors": [{"cel": {"expression":
            "device.driver == \"gpupool.dev\" && device.attributes[\"gpupool.dev\"].model == \"A100-SXM4-40GB\""}}]}
    });
    if let Some(name) = extended_resource_name {
        class["spec"]["extendedResourceName"] = json!(name);
    }
    create(&Api::<DeviceClass>::all(client.clone()), class).await;
    create(
        &Api::<ResourceSlice>::all(client.clone()),
        json!({
            "metadata": {"name": "node-b-gpupool.dev"},
            "spec": {"driver": "gpupool.dev", "nodeName": "node-b",
                     "pool": {"name": "node-b", "generation": 1, "resourceSliceCount": 1},
                     "devices": [gpu(0), gpu(1)]}
        }),
    )
    .await;
}

/// A claim for `memory` of an A100.
fn a100_claim(name: &str, memory: &str) -> serde_json::Value {
    json!({
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "a100-sxm4-40gb.gpupool.dev",
            "capacity": {"requests": {"memory": memory}}}}]}}
    })
}

/// The first device allocated to `claim`.
fn first_result(claim: &ResourceClaim) -> DeviceRequestAllocationResult {
    claim
        .status
        .as_ref()
        .and_then(|s| {
            s.allocation
                .as_ref()?
                .devices
                .as_ref()?
                .results
                .as_ref()?
                .first()
        })
        .cloned()
        .expect("the claim is allocated")
}

/// Polls `check` until it yields a value, for up to 10 s.
async fn eventually<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    for _ in 0..100 {
        if let Some(value) = check().await {
            return value;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("timed out waiting for {what}");
}

/// Waits for the pod `name` to be bound to a node.
async fn bound(pods: &Api<Pod>, name: &str) -> Pod {
    eventually(&format!("{name} to be bound"), || async {
        let pod = pods.get(name).await.ok()?;
        pod.spec.as_ref()?.node_name.as_ref()?;
        Some(pod)
    })
    .await
}

#[tokio::test]
async fn schedules_template_pods_reports_misfits_and_cleans_up() {
    let server = ApiServer::start().await.unwrap();
    let client = server.client().await;
    seed(&client, &["node-b", "node-a"], None).await;
    let templates: Api<ResourceClaimTemplate> = Api::namespaced(client.clone(), "default");
    create(
        &templates,
        json!({
            "metadata": {"name": "half-a100"},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": "a100-sxm4-40gb.gpupool.dev",
                "capacity": {"requests": {"memory": "1Gi", "cores": "50"}}}}]}}}
        }),
    )
    .await;
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    create(&claims, a100_claim("too-big", "48Gi")).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let container =
        json!([{"name": "main", "image": "busybox", "resources": {"claims": [{"name": "gpu"}]}}]);
    create(&pods, json!({
        "metadata": {"name": "trainer"},
        "spec": {"containers": container, "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "half-a100"}]}
    })).await;
    let greedy_uid = create(&pods, json!({
        "metadata": {"name": "greedy"},
        "spec": {"containers": container, "resourceClaims": [{"name": "gpu", "resourceClaimName": "too-big"}]}
    })).await.metadata.uid;

    let scheduler = spawn(client.clone(), Options::default());

    let pod = bound(&pods, "trainer").await;
    assert_eq!(
        pod.spec.as_ref().unwrap().node_name.as_deref(),
        Some("node-b")
    );
    let statuses = pod.status.unwrap().resource_claim_statuses.unwrap();
    let claim_name = statuses[0].resource_claim_name.clone().unwrap();
    assert!(claim_name.starts_with("trainer-gpu-"), "{claim_name}");
    let claim = claims.get(&claim_name).await.unwrap();
    let result = first_result(&claim);
    assert_eq!(
        (result.pool.as_str(), result.device.as_str()),
        ("node-b", "gpu-0")
    );
    let consumed = result.consumed_capacity.unwrap();
    assert_eq!(
        (consumed["memory"].0.as_str(), consumed["cores"].0.as_str()),
        ("1Gi", "50")
    );
    assert_eq!(
        claim.metadata.finalizers.as_deref(),
        Some(&["resource.kubernetes.io/delete-protection".to_string()][..])
    );
    let reserved = claim.status.unwrap().reserved_for.unwrap();
    assert_eq!(
        (reserved[0].resource.as_str(), reserved[0].name.as_str()),
        ("pods", "trainer")
    );

    let events: Api<Event> = Api::namespaced(client.clone(), "default");
    let message = eventually("a FailedScheduling event on the pod greedy", || async {
        let list = events.list(&ListParams::default()).await.ok()?;
        list.items
            .iter()
            .find(|e| {
                e.involved_object.kind.as_deref() == Some("Pod")
                    && e.involved_object.name.as_deref() == Some("greedy")
                    && e.involved_object.uid == greedy_uid
                    && e.reason.as_deref() == Some("FailedScheduling")
                    && e.type_.as_deref() == Some("Warning")
            })?
            .message
            .clone()
    })
    .await;
    assert!(
        message.starts_with("0/2 nodes are available: 2 cannot allocate all claims. "),
        "{message}"
    );
    for detail in [
        "node-a: claim default/too-big: no devices are published for node node-a",
        "insufficient memory on gpu-1: requested 48Gi, available 40Gi",
    ] {
        assert!(message.contains(detail), "{message}");
    }
    // kube-scheduler says nothing on the claim itself.
    let all = events.list(&ListParams::default()).await.unwrap();
    assert!(
        !all.items
            .iter()
            .any(|e| e.involved_object.kind.as_deref() == Some("ResourceClaim")),
        "{:?}",
        all.items
    );
    let greedy = pods.get("greedy").await.unwrap();
    assert_eq!(greedy.spec.unwrap().node_name, None);
    let too_big = claims.get("too-big").await.unwrap();
    assert!(too_big.status.and_then(|s| s.allocation).is_none());

    let scheduled = events.list(&ListParams::default()).await.unwrap();
    assert!(scheduled.items.iter().any(|e| {
        e.involved_object.name.as_deref() == Some("trainer")
            && e.reason.as_deref() == Some("Scheduled")
            && e.message.as_deref() == Some("Successfully assigned default/trainer to node-b")
    }));

    pods.delete("trainer", &DeleteParams::default())
        .await
        .unwrap();
    eventually("the generated claim to be deleted", || async {
        claims
            .get_opt(&claim_name)
            .await
            .ok()?
            .is_none()
            .then_some(())
    })
    .await;

    // A claim the user made outlives its pod, deallocated and without the finalizer.
    create(&claims, a100_claim("standalone", "2Gi")).await;
    create(&pods, json!({
        "metadata": {"name": "user"},
        "spec": {"containers": container, "resourceClaims": [{"name": "gpu", "resourceClaimName": "standalone"}]}
    })).await;
    eventually("the standalone claim to be allocated", || async {
        claims
            .get("standalone")
            .await
            .ok()?
            .status?
            .allocation
            .map(|_| ())
    })
    .await;
    pods.delete("user", &DeleteParams::default()).await.unwrap();
    let released = eventually("the standalone claim to be deallocated", || async {
        let claim = claims.get("standalone").await.ok()?;
        let status = claim.status.clone().unwrap_or_default();
        let done = status.allocation.is_none()
            && status.reserved_for.is_none()
            && claim
                .metadata
                .finalizers
                .clone()
                .unwrap_or_default()
                .is_empty();
        done.then_some(claim)
    })
    .await;
    assert_eq!(released.metadata.name.as_deref(), Some("standalone"));

    scheduler.stop().await.unwrap();
}

#[tokio::test]
async fn a_pod_asking_for_an_extended_resource_gets_a_generated_claim() {
    let server = ApiServer::start().await.unwrap();
    let client = server.client().await;
    seed(&client, &["node-b"], Some("gpupool.dev/a100")).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    create(
        &pods,
        json!({
            "metadata": {"name": "legacy"},
            "spec": {"containers": [{"name": "main", "image": "busybox",
                     "resources": {"limits": {"gpupool.dev/a100": "1"}}}]}
        }),
    )
    .await;
    let scheduler = spawn(client.clone(), Options::default());

    let pod = bound(&pods, "legacy").await;
    let status = pod.status.unwrap().extended_resource_claim_status.unwrap();
    assert_eq!(
        status.request_mappings[0].request_name,
        "container-0-request-0"
    );
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    let claim = claims.get(&status.resource_claim_name).await.unwrap();
    assert_eq!(
        claim.metadata.annotations.as_ref().unwrap()
            ["resource.kubernetes.io/extended-resource-claim"],
        "true"
    );
    let result = first_result(&claim);
    assert_eq!(result.request, "container-0-request-0");
    assert_eq!(
        result.consumed_capacity.as_ref().unwrap()["memory"].0,
        "40Gi"
    );
    scheduler.stop().await.unwrap();
}

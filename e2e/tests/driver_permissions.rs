//! The driver's own permissions, as deploy/base grants them and a 1.36 API server checks them
//! (DRAResourceClaimGranularStatusAuthorization): with its ServiceAccount's token, bound to its
//! node as a DaemonSet pod's is, it may write its own entries in `status.devices` of claims
//! allocated on its node, and nothing of claims on other nodes or of other drivers.

use gpupool_e2e::harness::{client_for_kubeconfig, ClusterSpec, TestCluster};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{json, Value};

const SHARE: &str = "3aef7919-0000-4000-8000-000000000001";

/// Claim `name` in default, allocated (by the administrator, as the scheduler would) on `node`.
async fn claim_on(admin: &Api<ResourceClaim>, name: &str, node: &str) {
    let claim: ResourceClaim = serde_json::from_value(json!({"metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpupool.dev"}}]}}}))
    .unwrap();
    admin.create(&PostParams::default(), &claim).await.unwrap();
    admin
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"allocation": {
                "devices": {"results": [{"request": "gpu", "driver": "gpupool.dev", "pool": node,
                    "device": "gpu-0", "shareID": SHARE}]},
                "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": [node]}]}]}}}})),
        )
        .await
        .unwrap();
}

fn entry(driver: &str, pool: &str) -> Value {
    json!({"driver": driver, "pool": pool, "device": "gpu-0", "shareID": SHARE,
        "conditions": [{"type": "Ready", "status": "True", "reason": "Prepared",
            "message": "prepared", "lastTransitionTime": "2026-12-01T00:00:00Z"}]})
}

fn refusal(result: Result<ResourceClaim, kube::Error>) -> String {
    match result {
        Err(kube::Error::Api(status)) => {
            assert_eq!(status.code, 422, "{status:?}");
            status.message
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[tokio::test]
async fn the_driver_writes_status_only_for_its_nodes_claims() {
    let cluster = TestCluster::start(ClusterSpec::new().emulated())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let admin: Api<ResourceClaim> = Api::namespaced(cluster.client(), "default");
    claim_on(&admin, "here", "node-a").await;
    claim_on(&admin, "there", "node-b").await;
    let kubeconfig = cluster
        .driver_kubeconfig("node-a")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let driver: Api<ResourceClaim> = Api::namespaced(
        client_for_kubeconfig(&kubeconfig)
            .await
            .unwrap_or_else(|e| panic!("{e}")),
        "default",
    );
    let write = |name: &'static str, entry: Value| {
        let driver = driver.clone();
        async move {
            driver
                .patch_status(
                    name,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"status": {"devices": [entry]}})),
                )
                .await
        }
    };

    let written = write("here", entry("gpupool.dev", "node-a")).await.unwrap();
    assert_eq!(written.status.unwrap().devices.unwrap().len(), 1);

    let message = refusal(write("there", entry("gpupool.dev", "node-b")).await);
    assert!(
        message.ends_with(
            "status.devices: Forbidden: changing status.devices requires \
             resource=\"resourceclaims/driver\", verb=\"[arbitrary-node:patch]\" permission: \
             resourceclaims.resource.k8s.io \"gpupool.dev\" is forbidden"
        ),
        "{message}"
    );

    let message = refusal(write("here", entry("net.example.com", "node-a")).await);
    assert!(
        message.contains("resourceclaims.resource.k8s.io \"net.example.com\" is forbidden"),
        "{message}"
    );
}

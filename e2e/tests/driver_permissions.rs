//! The driver's own permissions, as deploy/base grants them and a 1.36 API server checks them
//! (DRAResourceClaimGranularStatusAuthorization): with its ServiceAccount's token, bound to its
//! node as a DaemonSet pod's is, it may write its own entries in `status.devices` of claims
//! allocated on its node, and nothing of claims on other nodes or of other drivers. On both
//! backends; and on the real control plane (whose admission enforces ValidatingAdmissionPolicies,
//! which the emulator only stores) the policy of deploy/base holding a driver to its own node's
//! ResourceSlices.

mod common;

use std::time::Duration;

use gpupool_e2e::harness::{
    client_for_kubeconfig, plane_or_skip, two_worker_runtime, wait_for, Backend, ClusterSpec,
    TestCluster, COMPONENT_NAMESPACE, DRIVER_SERVICE_ACCOUNT,
};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{json, Value};

const SHARE: &str = "3aef7919-0000-4000-8000-000000000001";

/// Claim `name`, allocated (by the administrator, as the scheduler would) on `node`.
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

on_both_backends!(the_driver_writes_status_only_for_its_nodes_claims);

/// Two node names of this test alone (the plane is shared by the test binary's scenarios).
fn two_nodes() -> (String, String) {
    let suffix = &uuid::Uuid::new_v4().simple().to_string()[..6];
    (format!("node-a-{suffix}"), format!("node-b-{suffix}"))
}

async fn the_driver_writes_status_only_for_its_nodes_claims(backend: Backend) {
    let cluster = TestCluster::start(ClusterSpec::new().on(backend))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let ns = cluster.create_namespace("e2e-permissions").await.unwrap();
    let (node_a, node_b) = two_nodes();
    let admin: Api<ResourceClaim> = Api::namespaced(cluster.client(), &ns);
    claim_on(&admin, "here", &node_a).await;
    claim_on(&admin, "there", &node_b).await;
    let kubeconfig = cluster
        .driver_kubeconfig(&node_a)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let driver: Api<ResourceClaim> = Api::namespaced(
        client_for_kubeconfig(&kubeconfig)
            .await
            .unwrap_or_else(|e| panic!("{e}")),
        &ns,
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

    let written = write("here", entry("gpupool.dev", &node_a)).await.unwrap();
    assert_eq!(written.status.unwrap().devices.unwrap().len(), 1);

    let message = refusal(write("there", entry("gpupool.dev", &node_b)).await);
    assert!(
        message.ends_with(&format!(
            "status.devices: Forbidden: changing status.devices requires \
             resource=\"resourceclaims/driver\", verb=\"[arbitrary-node:patch]\" permission: \
             resourceclaims.resource.k8s.io \"gpupool.dev\" is forbidden: User \
             \"system:serviceaccount:gpupool:gpupool-driver\" cannot arbitrary-node:patch resource \
             \"resourceclaims/driver\" in API group \"resource.k8s.io\" in the namespace \"{ns}\""
        )),
        "{message}"
    );

    let message = refusal(write("here", entry("net.example.com", &node_a)).await);
    assert!(
        message.contains("resourceclaims.resource.k8s.io \"net.example.com\" is forbidden"),
        "{message}"
    );
}

/// A slice of the driver's published shape (one device) on `node`'s pool.
fn slice_of(node: &str) -> ResourceSlice {
    serde_json::from_value(json!({
        "metadata": {"name": format!("{node}-gpupool.dev-0")},
        "spec": {"driver": "gpupool.dev", "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "gpu-0"}]}}))
    .unwrap()
}

/// The message of an admission denial.
fn denial<T: std::fmt::Debug>(result: Result<T, kube::Error>) -> String {
    match result {
        Err(kube::Error::Api(status)) => status.message,
        other => panic!("expected a denial, got {other:?}"),
    }
}

/// The ValidatingAdmissionPolicy of deploy/base, enforced by kube-apiserver's admission: a driver
/// writes, moves and deletes only its own node's ResourceSlices, and a token naming no node may
/// write none. The emulator stores policies without enforcing them, so this runs on the control
/// plane only.
#[test]
fn a_driver_writes_only_its_own_nodes_slices() {
    two_worker_runtime().unwrap().block_on(async {
        let test = "a_driver_writes_only_its_own_nodes_slices";
        if plane_or_skip(test).await.is_none() {
            return;
        }
        let cluster = TestCluster::start(ClusterSpec::new().on_control_plane())
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let plane = cluster.plane().expect("on the control plane");
        let (node_a, node_b) = two_nodes();
        let driver_client = |path: std::path::PathBuf| async move {
            Api::<ResourceSlice>::all(client_for_kubeconfig(&path).await.unwrap())
        };
        let driver = driver_client(cluster.driver_kubeconfig(&node_a).await.unwrap()).await;
        let admin: Api<ResourceSlice> = Api::all(cluster.client());

        // A new policy is in force once the API server has loaded it (about a second): until
        // then a dry run of a forbidden write succeeds.
        let dry_run = PostParams {
            dry_run: true,
            ..Default::default()
        };
        wait_for(
            "the ResourceSlice policy to be in force",
            Duration::from_secs(30),
            || async { driver.create(&dry_run, &slice_of(&node_b)).await.err() },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));

        let own = driver
            .create(&PostParams::default(), &slice_of(&node_a))
            .await
            .unwrap_or_else(|e| panic!("the driver creates its own node's slice: {e}"));

        let message = denial(
            driver
                .create(&PostParams::default(), &slice_of(&node_b))
                .await,
        );
        assert!(
            message.contains(&format!(
                "the gpupool driver on node '{node_a}' may only write ResourceSlices of its own \
                 node, not slices of node '{node_b}'"
            )),
            "{message}"
        );
        assert!(
            message.contains("ValidatingAdmissionPolicy 'gpupool-driver-resourceslices'"),
            "{message}"
        );

        // Moving a slice to another node is refused before admission: spec.nodeName is
        // immutable (so the policy's take-over rule never gets to speak on 1.36).
        let mut moved = own.clone();
        moved.spec.node_name = Some(node_b.clone());
        let message = denial(
            driver
                .replace(
                    &own.metadata.name.clone().unwrap(),
                    &PostParams::default(),
                    &moved,
                )
                .await,
        );
        assert!(
            message.contains("spec.nodeName: Invalid value")
                && message.contains("field is immutable"),
            "{message}"
        );

        // Another node's slice can be neither changed nor deleted.
        let theirs = admin
            .create(&PostParams::default(), &slice_of(&node_b))
            .await
            .unwrap();
        let mut changed = theirs.clone();
        changed.spec.pool.generation = 2;
        let message = denial(
            driver
                .replace(
                    &theirs.metadata.name.clone().unwrap(),
                    &PostParams::default(),
                    &changed,
                )
                .await,
        );
        assert!(
            message.contains(&format!("not slices of node '{node_b}'")),
            "{message}"
        );
        let message = denial(
            driver
                .delete(&theirs.metadata.name.clone().unwrap(), &Default::default())
                .await,
        );
        assert!(
            message.contains(&format!("not slices of node '{node_b}'")),
            "{message}"
        );
        driver
            .delete(&own.metadata.name.clone().unwrap(), &Default::default())
            .await
            .unwrap_or_else(|e| panic!("the driver deletes its own node's slice: {e}"));

        // The driver's ServiceAccount with a token bound to no node writes nothing.
        let unbound = cluster.workdir().join("kubeconfig-driver-unbound");
        plane
            .service_account_kubeconfig(
                &cluster.client(),
                COMPONENT_NAMESPACE,
                DRIVER_SERVICE_ACCOUNT,
                None,
                &unbound,
            )
            .await
            .unwrap();
        let message = denial(
            driver_client(unbound)
                .await
                .create(&PostParams::default(), &slice_of(&node_a))
                .await,
        );
        assert!(message.contains("token carries no node name"), "{message}");
    });
}

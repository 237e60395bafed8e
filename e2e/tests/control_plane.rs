//! The real control plane the harness starts (`gpupool_e2e::plane`): etcd, kube-apiserver,
//! kube-scheduler and kube-controller-manager v1.36 on loopback. Its own checks: what the
//! scenarios and the trace work rely on it to do, with no driver process involved.

use std::collections::BTreeMap;
use std::time::Duration;

use gpupool_e2e::harness::objects::{claim_yaml, device_class_yaml, pod_yaml, Request};
use gpupool_e2e::harness::{apply_objects, parse_manifests, plane_or_skip, wait_for};
use gpupool_e2e::plane::{fake_node_slices, NodeShape};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::PostParams;
use kube::Api;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_made_node_with_the_drivers_slices_gets_a_claim_allocated_by_kube_scheduler() {
    let Some(plane) = plane_or_skip("control_plane").await else {
        return;
    };
    // Alone on the plane: the scheduler must see no other scenario's nodes.
    let _turn = plane.take_turn().await.unwrap();
    let admin = plane.admin_client().await.unwrap();
    let node = format!(
        "hand-made-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..6]
    );
    plane
        .create_node(&admin, &NodeShape::new(&node))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let slices = fake_node_slices(&node, "a100-40gb:2", &BTreeMap::new()).unwrap();
    plane
        .publish_slices(&admin, &slices)
        .await
        .unwrap_or_else(|e| panic!("{e}"));

    let namespace = format!("plane-{}", &uuid::Uuid::new_v4().simple().to_string()[..6]);
    let ns: Namespace =
        serde_json::from_value(serde_json::json!({"metadata": {"name": namespace}})).unwrap();
    Api::<Namespace>::all(admin.clone())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();
    let uuid = gpupool_driver::inventory::fake::fake_uuid(&node, 1);
    let yaml = [
        device_class_yaml(),
        claim_yaml(
            "half",
            &[Request::new("gpu").on(&uuid).memory("20Gi").cores("50")],
        ),
        pod_yaml("p", &["half"]),
    ]
    .join("---\n");
    // The default ServiceAccount of a new namespace comes a moment after it.
    wait_for(
        "the pod to be admitted",
        Duration::from_secs(30),
        || async {
            apply_objects(&admin, &parse_manifests(&yaml).unwrap(), &namespace)
                .await
                .ok()
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));

    let pods: Api<Pod> = Api::namespaced(admin.clone(), &namespace);
    let bound = wait_for(
        "kube-scheduler to bind the pod",
        Duration::from_secs(60),
        || async {
            pods.get("p")
                .await
                .ok()?
                .spec?
                .node_name
                .filter(|n| !n.is_empty())
        },
    )
    .await
    .unwrap_or_else(|e| {
        plane.print_logs(30);
        panic!("{e}")
    });
    assert_eq!(bound, node);
    let claim = Api::<ResourceClaim>::namespaced(admin, &namespace)
        .get("half")
        .await
        .unwrap();
    // A claim has no generation at all (its spec is immutable, status writes never bump one), so
    // no generation can tell one allocation of a claim from another.
    assert_eq!(claim.metadata.generation, None, "{claim:?}");
    let results = gpupool_api::claim::allocation_results(&claim);
    assert_eq!(results.len(), 1, "{claim:?}");
    assert_eq!(
        (
            results[0].pool.as_str(),
            results[0].device.as_str(),
            results[0].share_id.is_some()
        ),
        (node.as_str(), "gpu-1", true)
    );
}

//! Gang scheduling (Kubernetes 1.36 native, alpha) with gpupool claims on the real kube-scheduler:
//! deploy/examples/gang/training-4x-h100.yaml, a PodGroup of four workers with one whole H100 each,
//! applied to a plane of its own with the gang gates and API on (`PlaneOptions::gang_scheduling`).
//! Two hand-made HGX-like nodes: `hgx-0` with four H100s on one NVSwitch board, `hgx-1` with two;
//! their ResourceSlices the driver's own (no driver process), the DeviceClasses the controller's own
//! for the example's GpuModels (no controller process). One card of `hgx-0` is held by another claim:
//! five cards are free in all but no node has four, and the example keeps its workers on one node, so
//! no worker binds and no worker's claim is allocated; once that card is freed, all four bind on
//! `hgx-0`, each claim on a card of its own, all on one NVLink domain.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use gpupool_api::claim::allocation_results;
use gpupool_api::crd::GpuModel;
use gpupool_api::names::{attr, capacity, DRIVER_NAME};
use gpupool_api::quantity;
use gpupool_controller::models::{plan, published_devices, ClassOptions};
use gpupool_e2e::harness::objects::pod_yaml;
use gpupool_e2e::harness::{
    apply_objects, own_plane_or_skip, parse_manifests, wait_for, workspace_root,
};
use gpupool_e2e::plane::{fake_node_slices, NodeShape, PlaneOptions};
use gpupool_e2e::sandbox::attribute;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::api::{DeleteParams, PostParams};
use kube::{Api, Client};

const NS: &str = "default";
/// Four cards: the node the gang fits on once its fourth card is free.
const NODE: &str = "hgx-0";
/// Two cards: with them, five are free while the gang waits, never four on one node.
const SMALL_NODE: &str = "hgx-1";
/// The example's workers and its PodGroup's minCount.
const WORKERS: [&str; 4] = ["train-0", "train-1", "train-2", "train-3"];
const TIMEOUT: Duration = Duration::from_secs(30);

fn example(path: &str) -> String {
    let path = workspace_root().join("deploy").join("examples").join(path);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The DeviceClasses gpupool's controller makes for the GpuModels of deploy/examples/gpumodels.yaml
/// on a cluster publishing `slices`: its own plan, without its process.
fn controller_classes(slices: &[ResourceSlice]) -> Vec<DeviceClass> {
    let models: Vec<GpuModel> = parse_manifests(&example("gpumodels.yaml"))
        .unwrap()
        .into_iter()
        .filter(|o| o["kind"] == "GpuModel")
        .map(|o| serde_json::from_value(o).unwrap())
        .collect();
    let devices = published_devices(slices);
    plan(
        &models,
        &devices,
        ClassOptions {
            extended_resources: false,
        },
    )
    .classes
}

fn condition(pod: &Pod, kind: &str) -> Option<(String, String, String)> {
    pod.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == kind)
        .map(|c| {
            (
                c.status.clone(),
                c.reason.clone().unwrap_or_default(),
                c.message.clone().unwrap_or_default(),
            )
        })
}

fn node_of(pod: &Pod) -> Option<String> {
    pod.spec
        .as_ref()?
        .node_name
        .clone()
        .filter(|n| !n.is_empty())
}

/// The claim kube-controller-manager made for the pod from its template (`None` until it has).
async fn claim_of(client: &Client, pod: &Pod) -> Option<ResourceClaim> {
    let name = pod
        .status
        .as_ref()?
        .resource_claim_statuses
        .as_ref()?
        .iter()
        .find(|s| s.name == "gpu")?
        .resource_claim_name
        .clone()?;
    Api::<ResourceClaim>::namespaced(client.clone(), NS)
        .get_opt(&name)
        .await
        .ok()
        .flatten()
}

async fn workers(client: &Client) -> Vec<Pod> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let mut out = Vec::new();
    for name in WORKERS {
        if let Ok(pod) = pods.get(name).await {
            out.push(pod);
        }
    }
    out
}

/// Each worker's node and PodScheduled condition, for a failure's message.
fn scheduling_summary(pods: &[Pod]) -> Vec<String> {
    pods.iter()
        .map(|p| {
            format!(
                "{} on {:?}, PodScheduled {:?}",
                p.metadata.name.as_deref().unwrap_or_default(),
                node_of(p),
                condition(p, "PodScheduled")
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gang_that_does_not_fit_holds_no_card_and_binds_whole_once_it_fits() {
    let started = Instant::now();
    let Some(plane) =
        own_plane_or_skip("gang_scheduling", PlaneOptions::default().gang_scheduling()).await
    else {
        return;
    };
    let admin = plane.admin_client().await.unwrap();
    let fail = |what: String| -> ! {
        plane.print_logs(40);
        panic!("{what}")
    };

    // The nodes, each with its cards on one NVSwitch board, and the classes the example names.
    let mut slices = Vec::new();
    for (node, cards) in [
        (NODE, "h100-80gb:4+nvswitch"),
        (SMALL_NODE, "h100-80gb:2+nvswitch"),
    ] {
        plane
            .create_node(&admin, &NodeShape::new(node))
            .await
            .unwrap_or_else(|e| fail(e.to_string()));
        let published = fake_node_slices(node, cards, &BTreeMap::new()).unwrap();
        plane
            .publish_slices(&admin, &published)
            .await
            .unwrap_or_else(|e| fail(e.to_string()));
        slices.extend(published);
    }
    let classes = controller_classes(&slices);
    assert!(
        classes
            .iter()
            .any(|c| c.metadata.name.as_deref() == Some("h100-80gb-hbm3.gpupool.dev")),
        "the controller would make no class for the example's H100s: {classes:?}"
    );
    let class_api: Api<DeviceClass> = Api::all(admin.clone());
    for class in &classes {
        class_api
            .create(&PostParams::default(), class)
            .await
            .unwrap_or_else(|e| fail(format!("creating {:?}: {e}", class.metadata.name)));
    }

    // Another claim holds card 3 of hgx-0 whole (no capacity request: all its memory): three cards
    // free there, two on hgx-1.
    let held_uuid = gpupool_driver::inventory::fake::fake_uuid(NODE, 3);
    // (The harness's `Request::on` cannot pin it: its class takes MIG devices too, which have no
    // uuid attribute until they are prepared, so its selector fails on an H100 node.)
    let held = format!(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata:\n  name: held\nspec:\n  \
         devices:\n    requests:\n    - name: gpu\n      exactly:\n        \
         deviceClassName: h100-80gb-hbm3.gpupool.dev\n        selectors:\n        - cel:\n            \
         expression: device.attributes[\"{DRIVER_NAME}\"].{uuid} == \"{held_uuid}\"\n",
        uuid = attr::UUID,
    );
    let holder = [held, pod_yaml("holder", &["held"])].join("---\n");
    apply_objects(&admin, &parse_manifests(&holder).unwrap(), NS)
        .await
        .unwrap_or_else(|e| fail(e.to_string()));
    let pods: Api<Pod> = Api::namespaced(admin.clone(), NS);
    let claims: Api<ResourceClaim> = Api::namespaced(admin.clone(), NS);
    wait_for("the holder to bind", TIMEOUT, || async {
        node_of(&pods.get("holder").await.ok()?)
    })
    .await
    .unwrap_or_else(|e| fail(e.to_string()));
    let held = claims.get("held").await.unwrap();
    assert_eq!(
        allocation_results(&held)
            .iter()
            .map(|r| r.device.as_str())
            .collect::<Vec<_>>(),
        ["gpu-3"],
        "{held:?}"
    );

    // The gang: the example as a user applies it.
    apply_objects(
        &admin,
        &parse_manifests(&example("gang/training-4x-h100.yaml")).unwrap(),
        NS,
    )
    .await
    .unwrap_or_else(|e| {
        fail(format!(
            "applying deploy/examples/gang/training-4x-h100.yaml: {e}"
        ))
    });

    // kube-scheduler has decided on every worker once each has its claim and is either bound or
    // marked unschedulable (PodScheduled=False); the gang's cycle marks all four at once.
    let decided = wait_for(
        "kube-scheduler to bind or refuse every worker",
        TIMEOUT,
        || async {
            let workers = workers(&admin).await;
            let mut conditions = Vec::new();
            for pod in &workers {
                claim_of(&admin, pod).await?;
                let (status, reason, message) = condition(pod, "PodScheduled")?;
                let name = pod.metadata.name.clone().unwrap_or_default();
                conditions.push((name, status, reason, message));
            }
            (conditions.len() == WORKERS.len()).then_some(conditions)
        },
    )
    .await
    .unwrap_or_else(|e| fail(e.to_string()));
    let decided_at = started.elapsed();
    for (name, status, reason, message) in &decided {
        assert_eq!(
            (status.as_str(), reason.as_str()),
            ("False", "Unschedulable"),
            "{name}, a worker of a gang that does not fit: PodScheduled {message:?}"
        );
    }
    for pod in workers(&admin).await {
        let name = pod.metadata.name.clone().unwrap_or_default();
        assert_eq!(node_of(&pod), None, "{name} bound without its gang");
        let claim = claim_of(&admin, &pod).await.unwrap();
        assert!(
            allocation_results(&claim).is_empty(),
            "{name}'s claim was allocated although the gang does not fit: {claim:?}"
        );
        assert!(
            claim
                .status
                .as_ref()
                .and_then(|s| s.reserved_for.as_ref())
                .is_none_or(|r| r.is_empty()),
            "{name}'s claim is reserved: {claim:?}"
        );
    }

    // Free card 3: the holder goes (force: no kubelet stops it), then its claim.
    pods.delete("holder", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    claims
        .delete("held", &DeleteParams::default())
        .await
        .unwrap();
    wait_for("the held claim to be gone", TIMEOUT, || async {
        claims.get_opt("held").await.ok()?.is_none().then_some(())
    })
    .await
    .unwrap_or_else(|e| fail(e.to_string()));

    let bound = match wait_for("every worker to bind", TIMEOUT, || async {
        let workers = workers(&admin).await;
        let nodes: Vec<String> = workers.iter().filter_map(node_of).collect();
        (nodes.len() == WORKERS.len()).then_some(nodes)
    })
    .await
    {
        Ok(bound) => bound,
        Err(e) => {
            let workers = scheduling_summary(&workers(&admin).await);
            fail(format!("{e}; the workers: {workers:?}"))
        }
    };
    assert_eq!(bound, [NODE; 4]);

    let domains: BTreeMap<String, String> = slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .filter_map(|d| {
            let domain = attribute(d, attr::NVLINK_DOMAIN)?.string.clone()?;
            Some((d.name.clone(), domain))
        })
        .collect();
    let memory: BTreeMap<String, _> = slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .filter_map(|d| {
            let q = d.capacity.as_ref()?.get(capacity::MEMORY)?;
            Some((d.name.clone(), quantity::parse(&q.value.0).unwrap()))
        })
        .collect();
    let mut cards = BTreeSet::new();
    for pod in workers(&admin).await {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let claim = claim_of(&admin, &pod).await.unwrap();
        let results = allocation_results(&claim);
        assert_eq!(results.len(), 1, "{name}: {claim:?}");
        let result = &results[0];
        assert_eq!(
            (result.driver.as_str(), result.pool.as_str()),
            (DRIVER_NAME, NODE),
            "{name}"
        );
        // A card (MIG partitions have no NVLink domain), with all its memory.
        assert!(
            domains.contains_key(&result.device),
            "{name} got {result:?}, not a card with an NVLink domain"
        );
        let consumed = result
            .consumed_capacity
            .as_ref()
            .and_then(|c| c.get(capacity::MEMORY))
            .map(|q| quantity::parse(&q.0).unwrap());
        assert_eq!(
            consumed,
            Some(memory[&result.device]),
            "{name} got {result:?}, not the card's whole memory"
        );
        let reserved: Vec<String> = claim
            .status
            .as_ref()
            .and_then(|s| s.reserved_for.clone())
            .unwrap_or_default()
            .into_iter()
            .map(|r| r.name)
            .collect();
        assert_eq!(reserved, [name.as_str()], "{claim:?}");
        assert!(
            cards.insert(result.device.clone()),
            "two workers on {}",
            result.device
        );
    }
    assert_eq!(cards.len(), 4, "{cards:?}");
    let one_domain: BTreeSet<&String> = cards.iter().map(|c| &domains[c]).collect();
    assert_eq!(one_domain.len(), 1, "{one_domain:?}");
    println!(
        "gang_scheduling: refused with 3 + 2 cards free after {decided_at:?}, all bound {:?} after the start",
        started.elapsed()
    );
}

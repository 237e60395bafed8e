//! The heterogeneous pool end to end (issue 5 "Done when"): the real controller turns the GpuModels
//! of deploy/examples into DeviceClasses and the half-a100 ComputeProfile into a template, the real
//! drivers publish each card's weight, and kube-scheduler (on the control plane) or the scheduler
//! stand-in (on the emulator) places claims by model, the profile's `firstAvailable` falling back
//! to a V100 when the A100s are full.
//!
//! One cluster (A100, V100 and RTX 3090 nodes, as the seeds have them) and one test whose steps run
//! in order: each later step builds on the GpuModels of the first, and the last one changes and
//! deletes them.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::*;
use gpupool_api::names::{attr, capacity};
use gpupool_api::quantity;
use gpupool_e2e::harness::objects::{pod_yaml, template_pod_yaml};
use gpupool_e2e::harness::{wait_for, Backend, ClusterSpec, NodeSpec, TestCluster};
use gpupool_e2e::sandbox::{cdi_limits, examples_dir};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{
    DeviceClass, DeviceSubRequest, ResourceClaim, ResourceClaimTemplate,
};
use kube::api::{DeleteParams, ListParams};
use kube::Api;

const A100_CLASS: &str = "a100-sxm4-40gb.gpupool.dev";
const V100_CLASS: &str = "v100-sxm2-32gb.gpupool.dev";
const RTX_CLASS: &str = "rtx-3090.gpupool.dev";

/// A model of the pool: its GpuModel, class, node and how many cards the node has.
struct Model {
    gpu_model: &'static str,
    model: &'static str,
    class: &'static str,
    node: &'static str,
    /// The node's `--fake-gpus`.
    fake_gpus: &'static str,
    cards: usize,
}

const MODELS: [Model; 3] = [
    Model {
        gpu_model: "a100-sxm4-40gb",
        model: "A100-SXM4-40GB",
        class: A100_CLASS,
        node: "node-a100",
        fake_gpus: "a100-40gb:2",
        cards: 2,
    },
    Model {
        gpu_model: "v100-sxm2-32gb",
        model: "V100-SXM2-32GB",
        class: V100_CLASS,
        node: "node-v100",
        fake_gpus: "v100-32gb:2",
        cards: 2,
    },
    Model {
        gpu_model: "rtx-3090",
        model: "RTX-3090",
        class: RTX_CLASS,
        node: "node-rtx",
        fake_gpus: "rtx3090:1",
        cards: 1,
    },
];

fn example(file: &str) -> PathBuf {
    examples_dir().join(file)
}

/// A claim for one whole card through a model's class (no capacity request: the whole memory).
fn class_claim_yaml(name: &str, class: &str) -> String {
    format!(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata:\n  name: {name}\nspec:\n  devices:\n    requests:\n    \
         - name: gpu\n      exactly:\n        deviceClassName: {class}\n        allocationMode: ExactCount\n        count: 1\n"
    )
}

on_both_backends!(gpu_models_classes_profiles_and_weights_over_the_real_controller);

async fn gpu_models_classes_profiles_and_weights_over_the_real_controller(backend: Backend) {
    let started = Instant::now();
    let mut spec = ClusterSpec::new().with_controller();
    spec.nodes = MODELS
        .iter()
        .map(|m| NodeSpec::new(m.node, m.fake_gpus))
        .collect();
    // Fake cards of three models on three nodes: the emulator or hand-made nodes.
    let cluster = start(spec.on(backend)).await;
    let _logs = cluster.logs_on_failure();

    gpu_models_become_classes_and_kubectl_counts_the_pool(&cluster).await;
    claims_through_a_model_class_land_only_on_that_model(&cluster).await;
    half_a100_falls_back_to_a_v100_with_61_percent(&cluster).await;
    weight_changes_reach_the_slices_and_deleting_a_model_removes_its_class(&cluster).await;
    eprintln!("heterogeneous pool scenario took {:?}", started.elapsed());
}

/// The name a model's node has on the backend (unique per turn on the control plane).
fn node_name(cluster: &TestCluster, node: &str) -> String {
    cluster.node(node).unwrap().name.clone()
}

/// Step 1: gpumodels.yaml -> three DeviceClasses; `kubectl get gpumodels` counts the fake pool.
async fn gpu_models_become_classes_and_kubectl_counts_the_pool(cluster: &TestCluster) {
    // What the drivers published, per model: cards, nodes, memory.
    let mut published: BTreeMap<String, (usize, BTreeSet<String>, u64)> = BTreeMap::new();
    for m in &MODELS {
        let node = node_name(cluster, m.node);
        for device in devices_of(cluster, &node, m.cards).await.values() {
            let model = attribute(device, attr::MODEL)
                .and_then(|a| a.string.clone())
                .unwrap_or_else(|| panic!("{}/{} has no model attribute", m.node, device.name));
            let memory = device
                .capacity
                .as_ref()
                .and_then(|c| c.get(capacity::MEMORY))
                .map(|c| {
                    quantity::parse(&c.value.0)
                        .expect("memory quantity")
                        .ceil_units() as u64
                })
                .unwrap_or_else(|| panic!("{}/{} has no memory capacity", m.node, device.name));
            let entry = published.entry(model).or_default();
            entry.0 += 1;
            entry.1.insert(node.clone());
            entry.2 += memory;
        }
    }

    cluster
        .apply_file(&example("gpumodels.yaml"), None)
        .await
        .unwrap_or_else(|e| panic!("applying gpumodels.yaml: {e}"));
    let classes: Api<DeviceClass> = Api::all(cluster.client());
    for m in &MODELS {
        wait_for(&format!("DeviceClass {}", m.class), TIMEOUT, || async {
            classes.get_opt(m.class).await.ok().flatten()
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontroller log:\n{:?}", cluster.controller_log()));
    }

    // The columns a user reads; the controller fills the counts once it has seen the slices.
    let expected: BTreeMap<&str, [String; 4]> = MODELS
        .iter()
        .map(|m| {
            let (cards, nodes, memory) = published
                .get(m.model)
                .unwrap_or_else(|| panic!("no published {} in {published:?}", m.model));
            (
                m.gpu_model,
                [
                    m.model.to_string(),
                    cards.to_string(),
                    nodes.len().to_string(),
                    quantity::format_bytes(*memory),
                ],
            )
        })
        .collect();
    assert_eq!(expected["a100-sxm4-40gb"][1..], ["2", "1", "80Gi"]);
    assert_eq!(expected["v100-sxm2-32gb"][1..], ["2", "1", "64Gi"]);
    assert_eq!(expected["rtx-3090"][1..], ["1", "1", "24Gi"]);
    let shown = wait_for_kubectl(
        cluster,
        &["get", "gpumodels"],
        "`kubectl get gpumodels` to count the pool",
        |table| {
            let rows = table_rows(table);
            let matches = expected.iter().all(|(name, want)| {
                rows.get(*name).is_some_and(|row| {
                    ["MODEL", "DEVICES", "NODES", "MEMORY"]
                        .iter()
                        .zip(want)
                        .all(|(column, value)| row.get(*column) == Some(value))
                })
            });
            matches.then_some(rows)
        },
    )
    .await;
    assert_eq!(shown["a100-sxm4-40gb"]["WEIGHT"], "312");
    assert_eq!(shown["v100-sxm2-32gb"]["WEIGHT"], "256");
    assert_eq!(shown["rtx-3090"]["WEIGHT"], "71");
    for m in &MODELS {
        let row = &shown[m.gpu_model];
        assert_eq!(row["READY"], "True", "{}: {row:?}", m.gpu_model);
    }
    // gpumodels.yaml also has the H100 (MIG) model, which this pool has no card of.
    let h100 = &shown["h100-80gb-hbm3"];
    assert_eq!(
        (h100["READY"].as_str(), h100["DEVICES"].as_str()),
        ("False", "0"),
        "{h100:?}"
    );
}

/// Pods until gone and claims until gone (their allocations released).
async fn delete_all(cluster: &TestCluster, namespace: &str) {
    let pods: Api<Pod> = Api::namespaced(cluster.client(), namespace);
    let claims: Api<ResourceClaim> = Api::namespaced(cluster.client(), namespace);
    let lp = ListParams::default();
    pods.delete_collection(&DeleteParams::default(), &lp)
        .await
        .unwrap_or_else(|e| panic!("deleting pods of {namespace}: {e}"));
    claims
        .delete_collection(&DeleteParams::default(), &lp)
        .await
        .unwrap_or_else(|e| panic!("deleting claims of {namespace}: {e}"));
    wait_for(
        &format!("pods and claims of {namespace} to go"),
        TIMEOUT,
        || async {
            let pods_left = pods.list(&lp).await.ok()?.items.len();
            let claims_left = claims.list(&lp).await.ok()?.items.len();
            (pods_left == 0 && claims_left == 0).then_some(())
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

/// The claim `name` of one whole card through `class`, and the pod `name` using it.
async fn claim_by_class_and_use(cluster: &TestCluster, namespace: &str, name: &str, class: &str) {
    apply(cluster, namespace, &class_claim_yaml(name, class)).await;
    apply(cluster, namespace, &pod_yaml(name, &[name])).await;
}

/// A whole-card claim and a pod using it, per card of the model; returns (pool, device) per claim.
async fn fill_model(cluster: &TestCluster, namespace: &str, m: &Model) -> Vec<(String, String)> {
    for i in 0..m.cards {
        let name = format!("{}-{i}", m.gpu_model);
        claim_by_class_and_use(cluster, namespace, &name, m.class).await;
    }
    let mut placed = Vec::new();
    for i in 0..m.cards {
        let name = format!("{}-{i}", m.gpu_model);
        wait_pod_running(cluster, namespace, &name).await;
        let results = results(&claim(cluster, namespace, &name).await);
        assert_eq!(results.len(), 1, "{namespace}/{name}: {results:?}");
        let (request, pool, device, _) = results.into_iter().next().unwrap();
        assert_eq!(request, "gpu");
        placed.push((pool, device));
    }
    placed
}

/// Step 2: every card of each model filled through its class, each claim on that model only; one
/// more A100 claim waits rather than taking another model's card.
async fn claims_through_a_model_class_land_only_on_that_model(cluster: &TestCluster) {
    let namespace = cluster
        .create_namespace("by-model")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    for m in &MODELS {
        let placed = fill_model(cluster, &namespace, m).await;
        let distinct: BTreeSet<&(String, String)> = placed.iter().collect();
        assert_eq!(
            distinct.len(),
            m.cards,
            "whole cards of {}: {placed:?}",
            m.model
        );
        for (pool, device) in &placed {
            assert_eq!(
                *pool,
                node_name(cluster, m.node),
                "a claim through {} left its model",
                m.class
            );
            assert_eq!(
                model_of(cluster, pool, device).await,
                m.model,
                "{pool}/{device}"
            );
        }
    }

    // Every A100 is taken; free V100s and an RTX do not make a third A100 claim allocatable.
    claim_by_class_and_use(cluster, &namespace, "one-a100-too-many", A100_CLASS).await;
    wait_pod_event(
        cluster,
        &namespace,
        "one-a100-too-many",
        "FailedScheduling",
        "a FailedScheduling event for the A100 pod that cannot fit",
    )
    .await;
    let waiting = claim(cluster, &namespace, "one-a100-too-many").await;
    assert!(
        results(&waiting).is_empty(),
        "an A100 claim was allocated with every A100 taken: {:?}",
        results(&waiting)
    );
    delete_all(cluster, &namespace).await;
}

/// The `firstAvailable` subrequests of the one request of a template.
fn subrequests(template: &ResourceClaimTemplate) -> Vec<DeviceSubRequest> {
    let requests = template
        .spec
        .spec
        .devices
        .as_ref()
        .and_then(|d| d.requests.clone())
        .unwrap_or_default();
    assert_eq!(requests.len(), 1, "one request: {requests:?}");
    assert_eq!(requests[0].name, "gpu");
    requests[0].first_available.clone().unwrap_or_default()
}

/// (class, cores, memory) of each subrequest, in order.
fn subrequest_summary(subs: &[DeviceSubRequest]) -> Vec<(String, String, String)> {
    subs.iter()
        .map(|s| {
            let requests = s
                .capacity
                .as_ref()
                .and_then(|c| c.requests.clone())
                .unwrap_or_default();
            let get = |k: &str| requests.get(k).map(|q| q.0.clone()).unwrap_or_default();
            (
                s.device_class_name.clone(),
                get(capacity::CORES),
                get(capacity::MEMORY),
            )
        })
        .collect()
}

async fn template_summary(cluster: &TestCluster) -> Option<Vec<(String, String, String)>> {
    Api::<ResourceClaimTemplate>::namespaced(cluster.client(), "team-a")
        .get_opt("half-a100")
        .await
        .ok()
        .flatten()
        .map(|t| subrequest_summary(&subrequests(&t)))
}

/// Step 3: the half-a100 template in team-a asks A100 50 / V100 61; with the A100s full its pod gets
/// 61% of a V100.
async fn half_a100_falls_back_to_a_v100_with_61_percent(cluster: &TestCluster) {
    cluster
        .apply_file(&example("compute-profile-half-a100.yaml"), None)
        .await
        .unwrap_or_else(|e| panic!("applying compute-profile-half-a100.yaml: {e}"));
    let want = vec![
        (A100_CLASS.to_string(), "50".to_string(), "8Gi".to_string()),
        (V100_CLASS.to_string(), "61".to_string(), "8Gi".to_string()),
    ];
    let last = Mutex::new(None);
    wait_for(
        "template team-a/half-a100 with A100 50 then V100 61",
        TIMEOUT,
        || {
            let last = &last;
            let want = &want;
            async move {
                let summary = template_summary(cluster).await;
                *last.lock().unwrap() = summary.clone();
                (summary.as_ref() == Some(want)).then_some(())
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}; last seen {:?}", last.lock().unwrap()));

    let fill = cluster
        .create_namespace("a100-full")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    fill_model(cluster, &fill, &MODELS[0]).await;

    let pod = "trainer";
    apply(cluster, "team-a", &template_pod_yaml(pod, "half-a100")).await;
    let running = wait_pod_running(cluster, "team-a", pod).await;
    let claim_name = running
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.as_ref())
        .and_then(|c| c.iter().find(|c| c.name == "gpu"))
        .and_then(|c| c.resource_claim_name.clone())
        .unwrap_or_else(|| panic!("pod {pod} has no generated claim: {:?}", running.status));
    let generated = claim(cluster, "team-a", &claim_name).await;
    let results = results(&generated);
    assert_eq!(results.len(), 1, "{results:?}");
    let (request, pool, device, _) = &results[0];
    assert_eq!(
        *pool,
        node_name(cluster, "node-v100"),
        "the A100s are full: {results:?}"
    );
    assert!(
        request.starts_with("gpu/v100"),
        "the V100 subrequest was chosen: {request}"
    );
    assert_eq!(model_of(cluster, pool, device).await, "V100-SXM2-32GB");

    let node = cluster.node("node-v100").unwrap();
    let uid = generated.metadata.uid.clone().expect("claim uid");
    prepared(node, &uid).await;
    let limits = cdi_limits(&cdi_spec(node, &uid));
    assert!(
        limits.contains(&"CUDA_DEVICE_SM_LIMIT_0=61".to_string()),
        "{limits:?}"
    );
    assert!(
        limits.contains(&"CUDA_DEVICE_MEMORY_LIMIT_0=8192m".to_string()),
        "{limits:?}"
    );
}

/// The computeWeight every device of a node publishes.
async fn weights_on(cluster: &TestCluster, node: &str) -> Vec<Option<i64>> {
    cluster
        .slices_of(node)
        .await
        .unwrap_or_default()
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .map(|d| attribute(d, attr::COMPUTE_WEIGHT).and_then(|a| a.int))
        .collect()
}

/// Step 4: a new V100 weight is in node-v100's slices within seconds (and in the template's
/// cores); deleting the V100 GpuModel takes its class and subrequest, the others stay.
async fn weight_changes_reach_the_slices_and_deleting_a_model_removes_its_class(
    cluster: &TestCluster,
) {
    let (v100, a100) = (
        node_name(cluster, "node-v100"),
        node_name(cluster, "node-a100"),
    );
    assert_eq!(weights_on(cluster, &v100).await, [Some(256), Some(256)]);
    let changed = Instant::now();
    cluster
        .kubectl(&[
            "patch",
            "gpumodel",
            "v100-sxm2-32gb",
            "--type=merge",
            "-p",
            r#"{"spec":{"computeWeight":300}}"#,
        ])
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let within = Duration::from_secs(10);
    let published = wait_for("node-v100's slices to carry weight 300", within, || async {
        (weights_on(cluster, &v100).await == [Some(300), Some(300)]).then_some(())
    })
    .await;
    if let Err(e) = published {
        panic!(
            "{e}; now {:?}\n--- driver log ---\n{}",
            weights_on(cluster, &v100).await,
            cluster.node("node-v100").unwrap().driver_log()
        );
    }
    eprintln!("weight change published after {:?}", changed.elapsed());
    assert_eq!(weights_on(cluster, &a100).await, [Some(312), Some(312)]);
    // ceil(156 * 100 / 300) = 52
    wait_for("the template's V100 subrequest at 52", TIMEOUT, || async {
        let summary = template_summary(cluster).await?;
        (summary.get(1).map(|s| s.1.as_str()) == Some("52")).then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));

    cluster
        .kubectl(&["delete", "gpumodel", "v100-sxm2-32gb"])
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let classes: Api<DeviceClass> = Api::all(cluster.client());
    wait_for("DeviceClass of the V100 to go", TIMEOUT, || async {
        classes
            .get_opt(V100_CLASS)
            .await
            .ok()
            .and_then(|c| c.is_none().then_some(()))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let last = Mutex::new(None);
    wait_for("the template to keep only the A100", TIMEOUT, || {
        let last = &last;
        async move {
            let summary = template_summary(cluster).await;
            *last.lock().unwrap() = summary.clone();
            let classes: Vec<String> = summary?.into_iter().map(|s| s.0).collect();
            (classes == [A100_CLASS]).then_some(())
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}; last seen {:?}", last.lock().unwrap()));
    // The datacenter tier still has the A100, and no longer picks the V100.
    wait_for(
        "tier-datacenter.gpupool.dev to select the A100 only",
        TIMEOUT,
        || async {
            let tier = classes
                .get_opt("tier-datacenter.gpupool.dev")
                .await
                .ok()??;
            let selectors = serde_json::to_string(&tier.spec.selectors).ok()?;
            (selectors.contains("A100-SXM4-40GB") && !selectors.contains("V100-SXM2-32GB"))
                .then_some(())
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    for class in [A100_CLASS, RTX_CLASS, "gpupool.dev"] {
        assert!(
            classes.get_opt(class).await.unwrap().is_some(),
            "{class} went with the V100's GpuModel"
        );
    }
    let table = cluster
        .kubectl(&["get", "gpumodels"])
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let rows = table_rows(&table);
    assert_eq!(
        rows.keys().map(String::as_str).collect::<Vec<_>>(),
        ["a100-sxm4-40gb", "h100-80gb-hbm3", "rtx-3090"],
        "{table}"
    );
}

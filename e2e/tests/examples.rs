//! Every example in deploy/examples/ applied to the sandbox's pool (issue 7 "Done when"), with the
//! state each file's comments and the README promise checked as a user would: pods running on the
//! right model, the limits in the CDI specs, `kubectl get gpumodels` and `kubectl describe`. On the
//! emulator and on the real control plane (kube-scheduler allocates the NVLink, MIG, extended
//! resource and prioritized-list claims; kube-controller-manager makes the template claims).
//!
//! One cluster and one test: the examples share the pool's cards, and the last step frees some of
//! them to watch the prioritized-list claim choose.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::time::Instant;

use common::*;
use gpupool_api::names::{attr, capacity};
use gpupool_e2e::harness::objects::{pod_yaml, template_pod_yaml};
use gpupool_e2e::harness::{wait_for, Backend, TestCluster};
use gpupool_e2e::sandbox::{self, cdi_limits};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceClaimTemplate};
use kube::api::ListParams;
use kube::Api;

/// Every example this test covers. A new file in deploy/examples/ fails the test until it is
/// covered here.
const COVERED: [&str; 11] = [
    "claim-prefer-a100.yaml",
    "compute-profile-half-a100.yaml",
    "deployment-template.yaml",
    "fraction-h100-quarter.yaml",
    "fraction-half-a100.yaml",
    "fraction-v100-70.yaml",
    "gpumodels.yaml",
    "mig-h100-1g.yaml",
    "nvlink-two-h100.yaml",
    "pod-by-model.yaml",
    "whole-gpu-claim.yaml",
];

const NS: &str = "default";

on_both_backends!(every_example_reaches_the_state_its_comments_and_the_readme_promise);

async fn every_example_reaches_the_state_its_comments_and_the_readme_promise(backend: Backend) {
    // In the order the sandbox applies them, so that the classes and templates the others name
    // exist early.
    let files = sandbox::example_files(&sandbox::examples_dir()).unwrap_or_else(|e| panic!("{e}"));
    let names: BTreeSet<String> = files
        .iter()
        .filter_map(|p| p.file_name().and_then(|n| n.to_str()).map(str::to_string))
        .collect();
    let covered: BTreeSet<String> = COVERED.iter().map(|s| s.to_string()).collect();
    assert_eq!(
        names, covered,
        "deploy/examples/ changed: cover each new example in this test (and drop removed ones)"
    );

    let started = Instant::now();
    // The sandbox's cluster: the seeds' pool.
    let cluster = start(sandbox::cluster_spec().on(backend)).await;
    let _logs = cluster.logs_on_failure();
    for node in cluster.nodes() {
        cluster
            .wait_for_slices(&node.name, 1, TIMEOUT)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
    for file in &files {
        cluster
            .apply_file(file, None)
            .await
            .unwrap_or_else(|e| panic!("kubectl apply -f {}: {e}", file.display()));
    }

    gpumodels_make_classes_weights_and_the_kubectl_table(&cluster).await;
    compute_profile_keeps_its_template_in_team_a(&cluster).await;
    half_a100_runs_with_1gi_and_half_the_sms(&cluster).await;
    describe_shows_what_the_driver_applied(&cluster).await;
    v100_70_runs_on_a_v100_with_70_percent(&cluster).await;
    whole_gpu_claim_gets_the_whole_card_unthrottled(&cluster).await;
    deployment_replicas_each_get_their_own_share(&cluster).await;
    pod_by_model_lands_on_a_v100(&cluster).await;
    mig_fraction_and_nvlink_claims_share_node_h100(&cluster).await;
    describe_shows_the_mig_device(&cluster).await;
    compute_profiles_fall_back_between_a_mig_device_and_a_fraction(&cluster).await;
    prefer_a100_waits_for_a_pod_then_takes_an_a100_else_a_v100(&cluster).await;
    eprintln!("examples scenario took {:?}", started.elapsed());
}

/// gpumodels.yaml: one class per model, per tier and for every card; each card's weight in its
/// slice; `kubectl get gpumodels` as in the README.
async fn gpumodels_make_classes_weights_and_the_kubectl_table(cluster: &TestCluster) {
    let classes: Api<DeviceClass> = Api::all(cluster.client());
    for class in [
        "a100-sxm4-40gb.gpupool.dev",
        "v100-sxm2-32gb.gpupool.dev",
        "rtx-3090.gpupool.dev",
        "h100-80gb-hbm3.gpupool.dev",
        "h100-80gb-hbm3-mig-1g-10gb.gpupool.dev",
        "h100-80gb-hbm3-mig-1g-20gb.gpupool.dev",
        "h100-80gb-hbm3-mig-3g-40gb.gpupool.dev",
        "tier-datacenter.gpupool.dev",
        "tier-workstation.gpupool.dev",
        "gpupool.dev",
    ] {
        wait_for(&format!("DeviceClass {class}"), TIMEOUT, || async {
            classes.get_opt(class).await.ok().flatten()
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    }
    for (node, weight) in [
        ("node-a100", 312),
        ("node-v100", 256),
        ("node-rtx", 71),
        ("node-h100", 989),
    ] {
        wait_for(
            &format!("every card of {node} to publish computeWeight {weight}"),
            TIMEOUT,
            || async {
                let slices = cluster.slices_of(node).await.ok()?;
                let weights: Vec<Option<i64>> = slices
                    .iter()
                    .flat_map(|s| s.spec.devices.iter().flatten())
                    .filter(|d| !is_mig(d))
                    .map(|d| attribute(d, attr::COMPUTE_WEIGHT).and_then(|a| a.int))
                    .collect();
                (!weights.is_empty() && weights.iter().all(|w| *w == Some(weight))).then_some(())
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    }
    let want: BTreeMap<&str, [&str; 6]> = BTreeMap::from([
        (
            "a100-sxm4-40gb",
            ["A100-SXM4-40GB", "312", "2", "1", "80Gi", "True"],
        ),
        (
            "v100-sxm2-32gb",
            ["V100-SXM2-32GB", "256", "2", "1", "64Gi", "True"],
        ),
        ("rtx-3090", ["RTX-3090", "71", "1", "1", "24Gi", "True"]),
        (
            "h100-80gb-hbm3",
            ["H100-80GB-HBM3", "989", "4", "1", "326236Mi", "True"],
        ),
    ]);
    let columns = ["MODEL", "WEIGHT", "DEVICES", "NODES", "MEMORY", "READY"];
    wait_for_kubectl(
        cluster,
        &["get", "gpumodels"],
        "`kubectl get gpumodels` as the README shows it",
        |table| {
            let rows = table_rows(table);
            let same = rows.len() == want.len()
                && want.iter().all(|(name, values)| {
                    rows.get(*name).is_some_and(|row| {
                        columns
                            .iter()
                            .zip(values)
                            .all(|(c, v)| row.get(*c).map(String::as_str) == Some(*v))
                    })
                });
            same.then_some(())
        },
    )
    .await;
}

fn is_mig(d: &k8s_openapi::api::resource::v1::Device) -> bool {
    attribute(d, attr::TYPE).and_then(|a| a.string.as_deref()) == Some("mig")
}

/// compute-profile-half-a100.yaml: template half-a100 in team-a, A100 cores 50 then V100 cores 61,
/// 8Gi each, no RTX 3090 (it cannot serve 156).
async fn compute_profile_keeps_its_template_in_team_a(cluster: &TestCluster) {
    let templates: Api<ResourceClaimTemplate> = Api::namespaced(cluster.client(), "team-a");
    let want = [
        ("a100-sxm4-40gb.gpupool.dev", "50", "8Gi"),
        ("v100-sxm2-32gb.gpupool.dev", "61", "8Gi"),
    ];
    let last = Mutex::new(None);
    wait_for(
        "template team-a/half-a100 with A100 50 then V100 61",
        TIMEOUT,
        || {
            let (last, templates) = (&last, &templates);
            async move {
                let template = templates.get_opt("half-a100").await.ok().flatten()?;
                let requests = template.spec.spec.devices?.requests?;
                *last.lock().unwrap() = Some(requests.clone());
                let [request] = requests.as_slice() else {
                    return None;
                };
                let subs = request.first_available.as_ref()?;
                let got: Vec<(String, String, String)> = subs
                    .iter()
                    .map(|s| {
                        let capacity = s
                            .capacity
                            .as_ref()
                            .and_then(|c| c.requests.clone())
                            .unwrap_or_default();
                        let q = |k: &str| capacity.get(k).map(|q| q.0.clone()).unwrap_or_default();
                        (
                            s.device_class_name.clone(),
                            q(capacity::CORES),
                            q(capacity::MEMORY),
                        )
                    })
                    .collect();
                let same = request.name == "gpu"
                    && got.len() == want.len()
                    && got
                        .iter()
                        .zip(&want)
                        .all(|(g, w)| (g.0.as_str(), g.1.as_str(), g.2.as_str()) == *w);
                same.then_some(())
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}; last seen {:?}", last.lock().unwrap()));
}

/// The one gpupool allocation of a claim once its pod runs: (request, pool, device, shareID).
async fn allocation_of_running(
    cluster: &TestCluster,
    pod: &str,
    claim_name: &str,
) -> (String, String, String, Option<String>) {
    wait_pod_running(cluster, NS, pod).await;
    let results = results(&claim(cluster, NS, claim_name).await);
    assert_eq!(results.len(), 1, "claim {claim_name}: {results:?}");
    results.into_iter().next().unwrap()
}

/// The claim a pod got from its template (`resourceClaimStatuses`).
async fn generated_claim(cluster: &TestCluster, pod: &str) -> String {
    let pod_object = wait_pod_running(cluster, NS, pod).await;
    pod_object
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.as_ref())
        .and_then(|c| c.iter().find(|c| c.name == "gpu"))
        .and_then(|c| c.resource_claim_name.clone())
        .unwrap_or_else(|| panic!("pod {pod} has no generated claim: {:?}", pod_object.status))
}

/// What the claim consumed: (memory, cores) as written in its allocation.
async fn consumed(cluster: &TestCluster, claim_name: &str) -> (Option<String>, Option<String>) {
    let c = claim(cluster, NS, claim_name).await;
    let result = allocation_results(&c)
        .first()
        .cloned()
        .unwrap_or_else(|| panic!("claim {claim_name} is not allocated"));
    let capacity = result.consumed_capacity.unwrap_or_default();
    (
        capacity.get(capacity::MEMORY).map(|q| q.0.clone()),
        capacity.get(capacity::CORES).map(|q| q.0.clone()),
    )
}

/// The limit env of a claim's CDI spec on `node`, once prepared.
async fn limits_of(cluster: &TestCluster, node: &str, claim_name: &str) -> Vec<String> {
    let node = cluster.node(node).unwrap();
    let uid = claim(cluster, NS, claim_name)
        .await
        .metadata
        .uid
        .expect("claim uid");
    prepared(node, &uid).await;
    cdi_limits(&cdi_spec(node, &uid))
}

/// The limit env of the claim's CDI spec on `node` has each of `wanted`.
async fn assert_limits(cluster: &TestCluster, node: &str, claim_name: &str, wanted: &[&str]) {
    let limits = limits_of(cluster, node, claim_name).await;
    for want in wanted {
        assert!(limits.iter().any(|l| l == want), "{want}: {limits:?}");
    }
}

/// The claim consumed (`memory`, `cores`) of its card, and its limits on `node` have each of `limits`.
async fn assert_share(
    cluster: &TestCluster,
    node: &str,
    claim_name: &str,
    (memory, cores): (&str, &str),
    limits: &[&str],
) {
    assert_eq!(
        consumed(cluster, claim_name).await,
        (Some(memory.into()), Some(cores.into()))
    );
    assert_limits(cluster, node, claim_name, limits).await;
}

/// fraction-half-a100.yaml: Running on an A100 with 1Gi and 50%, limits 1024m / 50.
async fn half_a100_runs_with_1gi_and_half_the_sms(cluster: &TestCluster) {
    let (request, pool, device, share) =
        allocation_of_running(cluster, "half-a100", "half-a100").await;
    assert_eq!(
        (request.as_str(), pool.as_str()),
        ("gpu", "node-a100"),
        "{device}"
    );
    assert_eq!(model_of(cluster, &pool, &device).await, "A100-SXM4-40GB");
    assert!(share.is_some(), "a fraction is a share of the card");
    let limits = [
        "CUDA_DEVICE_MEMORY_LIMIT_0=1024m",
        "CUDA_DEVICE_SM_LIMIT_0=50",
    ];
    assert_share(cluster, &pool, "half-a100", ("1Gi", "50"), &limits).await;
}

/// README "Reading what you got": describe shows the driver's data for the device.
async fn describe_shows_what_the_driver_applied(cluster: &TestCluster) {
    let results = results(&claim(cluster, NS, "half-a100").await);
    let (_, pool, device, _) = &results[0];
    let devices = devices_of(cluster, pool, 2).await;
    let uuid = attribute(&devices[device], attr::UUID)
        .and_then(|a| a.string.clone())
        .expect("uuid attribute");
    let want = [
        ("Compute Units:", "156".to_string()),
        ("Core Limit:", "50".to_string()),
        ("Memory Limit:", "1Gi".to_string()),
        ("Model:", "A100-SXM4-40GB".to_string()),
        ("Uuid:", uuid),
    ];
    wait_for_kubectl(
        cluster,
        &["describe", "resourceclaim", "half-a100", "-n", NS],
        "`kubectl describe resourceclaim half-a100` to show the device data",
        |text| {
            let shown = want.iter().all(|(label, value)| {
                text.lines().any(|line| {
                    line.trim_start()
                        .strip_prefix(label)
                        .is_some_and(|rest| rest.trim() == value)
                })
            });
            shown.then_some(())
        },
    )
    .await;
}

/// fraction-v100-70.yaml: on a V100 with 8Gi and SM limit 70.
async fn v100_70_runs_on_a_v100_with_70_percent(cluster: &TestCluster) {
    let (_, pool, device, _) = allocation_of_running(cluster, "v100-70", "v100-70").await;
    assert_eq!(pool, "node-v100");
    assert_eq!(model_of(cluster, &pool, &device).await, "V100-SXM2-32GB");
    let limits = [
        "CUDA_DEVICE_MEMORY_LIMIT_0=8192m",
        "CUDA_DEVICE_SM_LIMIT_0=70",
    ];
    assert_share(cluster, &pool, "v100-70", ("8Gi", "70"), &limits).await;
}

/// whole-gpu-claim.yaml: the RTX 3090, all its memory, no SM limit.
async fn whole_gpu_claim_gets_the_whole_card_unthrottled(cluster: &TestCluster) {
    let (_, pool, device, _) = allocation_of_running(cluster, "whole-gpu", "whole-rtx-3090").await;
    assert_eq!((pool.as_str(), device.as_str()), ("node-rtx", "gpu-0"));
    let card = &devices_of(cluster, &pool, 1).await[&device];
    let card_mib = memory_mib(card);
    let want_memory = format!("CUDA_DEVICE_MEMORY_LIMIT_0={card_mib}m");
    let limits = [want_memory.as_str(), "CUDA_DEVICE_SM_LIMIT_0=0"];
    assert_limits(cluster, &pool, "whole-rtx-3090", &limits).await;
    let (memory, cores) = consumed(cluster, "whole-rtx-3090").await;
    if let Some(memory) = memory {
        let bytes = gpupool_api::quantity::parse(&memory)
            .expect("consumed memory")
            .ceil_units() as u64;
        assert_eq!(bytes, card_mib * 1024 * 1024, "the whole card's memory");
    }
    assert!(
        matches!(cores.as_deref(), None | Some("0")),
        "no compute share: {cores:?}"
    );
}

/// deployment-template.yaml: each replica its own claim (owned by it), each an 8Gi + 25% share of an A100.
async fn deployment_replicas_each_get_their_own_share(cluster: &TestCluster) {
    let mut claims = BTreeSet::new();
    let mut shares = BTreeSet::new();
    for pod in ["inference-0", "inference-1"] {
        let claim_name = generated_claim(cluster, pod).await;
        assert!(
            claim_name.starts_with(&format!("{pod}-gpu-")),
            "{pod}: {claim_name}"
        );
        let c = claim(cluster, NS, &claim_name).await;
        let pod_uid = Api::<Pod>::namespaced(cluster.client(), NS)
            .get(pod)
            .await
            .unwrap()
            .metadata
            .uid;
        let owners = c.metadata.owner_references.clone().unwrap_or_default();
        assert!(
            owners
                .iter()
                .any(|o| o.kind == "Pod" && Some(&o.uid) == pod_uid.as_ref()),
            "{claim_name} is owned by {pod}: {owners:?}"
        );
        let (_, pool, device, share) = allocation_of_running(cluster, pod, &claim_name).await;
        assert_eq!(pool, "node-a100", "{claim_name}");
        assert_eq!(model_of(cluster, &pool, &device).await, "A100-SXM4-40GB");
        let limits = ["CUDA_DEVICE_SM_LIMIT_0=25"];
        assert_share(cluster, &pool, &claim_name, ("8Gi", "25"), &limits).await;
        claims.insert(claim_name);
        shares.insert(share.unwrap_or_else(|| panic!("{pod}'s claim is not a share")));
    }
    assert_eq!(claims.len(), 2, "one claim per replica: {claims:?}");
    assert_eq!(shares.len(), 2, "one share per replica: {shares:?}");
}

/// pod-by-model.yaml: the pod's claim from one-v100 gets a V100.
async fn pod_by_model_lands_on_a_v100(cluster: &TestCluster) {
    let claim_name = generated_claim(cluster, "on-a-v100").await;
    let (_, pool, device, _) = allocation_of_running(cluster, "on-a-v100", &claim_name).await;
    assert_eq!(pool, "node-v100");
    assert_eq!(model_of(cluster, &pool, &device).await, "V100-SXM2-32GB");
}

/// Claims of `default` allocated on node-a100.
async fn a100_claims(cluster: &TestCluster) -> Vec<String> {
    Api::<ResourceClaim>::namespaced(cluster.client(), NS)
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
        .iter()
        .filter(|c| results(c).iter().any(|r| r.1 == "node-a100"))
        .filter_map(|c| c.metadata.name.clone())
        .collect()
}

/// claim-prefer-a100.yaml: unallocated while no pod uses it; with both A100s freed a pod using it
/// gets an A100 ("gpu/a100"); a copy of it, once the A100s are taken, gets the free V100 ("gpu/v100").
async fn prefer_a100_waits_for_a_pod_then_takes_an_a100_else_a_v100(cluster: &TestCluster) {
    let prefer = claim(cluster, NS, "prefer-a100").await;
    assert!(
        results(&prefer).is_empty(),
        "allocated with no pod using it: {:?}",
        results(&prefer)
    );

    // Free the A100s (the other examples' pods there) and one V100 (pod-by-model's whole card).
    for pod in ["half-a100", "inference-0", "inference-1", "on-a-v100"] {
        delete_pod(cluster, NS, pod).await;
    }
    let last = Mutex::new(Vec::new());
    wait_for("the A100s to be released", TIMEOUT, || {
        let last = &last;
        async move {
            let held = a100_claims(cluster).await;
            *last.lock().unwrap() = held.clone();
            held.is_empty().then_some(())
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}; still on node-a100: {:?}", last.lock().unwrap()));
    assert!(
        results(&claim(cluster, NS, "prefer-a100").await).is_empty(),
        "still unused"
    );
    // deployment-template.yaml: the scheduler "deletes it with the pod" (so does pod-by-model's).
    let claims: Api<ResourceClaim> = Api::namespaced(cluster.client(), NS);
    let last = Mutex::new(Vec::new());
    wait_for(
        "the replicas' generated claims to go with them",
        TIMEOUT,
        || {
            let (last, claims) = (&last, &claims);
            async move {
                let generated: Vec<String> = claims
                    .list(&ListParams::default())
                    .await
                    .ok()?
                    .items
                    .into_iter()
                    .filter_map(|c| c.metadata.name)
                    .filter(|n| n.starts_with("inference-") || n.starts_with("on-a-v100-"))
                    .collect();
                *last.lock().unwrap() = generated.clone();
                generated.is_empty().then_some(())
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}; left: {:?}", last.lock().unwrap()));

    let prefer_yaml =
        std::fs::read_to_string(sandbox::examples_dir().join("claim-prefer-a100.yaml"))
            .expect("reading claim-prefer-a100.yaml");
    // Two more claims like it: with the one from the file they take both A100s, then a V100.
    for name in ["prefer-a100-2", "prefer-a100-3"] {
        let copy = prefer_yaml.replace("name: prefer-a100\n", &format!("name: {name}\n"));
        assert_ne!(
            copy, prefer_yaml,
            "the example's claim is named prefer-a100"
        );
        apply(cluster, NS, &copy).await;
    }
    let mut a100_devices = BTreeSet::new();
    for (claim_name, want_request, want_pool) in [
        ("prefer-a100", "gpu/a100", "node-a100"),
        ("prefer-a100-2", "gpu/a100", "node-a100"),
        ("prefer-a100-3", "gpu/v100", "node-v100"),
    ] {
        let pod = format!("uses-{claim_name}");
        apply(cluster, NS, &pod_yaml(&pod, &[claim_name])).await;
        let (request, pool, device, _) = allocation_of_running(cluster, &pod, claim_name).await;
        assert_eq!(
            (request.as_str(), pool.as_str()),
            (want_request, want_pool),
            "{claim_name} -> {device}"
        );
        if pool == "node-a100" {
            a100_devices.insert(device);
        }
    }
    assert_eq!(a100_devices.len(), 2, "one A100 each: {a100_devices:?}");
}

/// mig-h100-1g.yaml, fraction-h100-quarter.yaml and nvlink-two-h100.yaml on the one node-h100:
/// the MIG claim runs on a 1g.10gb partition of a card the fraction is not on, with its weight
/// scaled to its SMs; the NVLink claim gets two more cards, distinct, on one NVLink domain.
async fn mig_fraction_and_nvlink_claims_share_node_h100(cluster: &TestCluster) {
    let (_, pool, mig_device, share) = allocation_of_running(cluster, "mig-1g", "mig-1g").await;
    assert_eq!(pool, "node-h100");
    assert!(share.is_none(), "a MIG device is not shared");
    let devices = devices_of(cluster, &pool, 4 * 26).await;
    let mig = &devices[&mig_device];
    assert!(is_mig(mig), "{mig_device}");
    let int = |d: &k8s_openapi::api::resource::v1::Device, name: &str| {
        attribute(d, name).and_then(|a| a.int)
    };
    assert_eq!(
        attribute(mig, attr::MIG_PROFILE).and_then(|a| a.string.clone()),
        Some("1g.10gb".into())
    );
    assert_eq!(int(mig, attr::MULTIPROCESSORS), Some(16));
    assert_eq!(int(mig, attr::COMPUTE_WEIGHT), Some(119), "989 x 16 / 132");
    let mig_card = int(mig, attr::INDEX).expect("a MIG device names its card");
    let limits = limits_of(cluster, &pool, "mig-1g").await;
    assert!(
        limits
            .iter()
            .any(|l| l == "GPUPOOL_DEVICE_MIG_PROFILE_0=1g.10gb")
            && limits
                .iter()
                .any(|l| l.starts_with("GPUPOOL_DEVICE_UUID_0=MIG-")),
        "{limits:?}"
    );
    assert!(
        !limits
            .iter()
            .any(|l| l.starts_with("CUDA_DEVICE_MEMORY_LIMIT")),
        "the partition is the limit: {limits:?}"
    );

    let (_, pool, quarter_device, share) =
        allocation_of_running(cluster, "quarter-h100", "quarter-h100").await;
    assert_eq!(pool, "node-h100");
    assert!(share.is_some(), "a fraction is a share");
    let quarter_card = int(&devices[&quarter_device], attr::INDEX).unwrap();
    assert_ne!(
        quarter_card, mig_card,
        "MIG and a fraction never share a card: {quarter_device} / {mig_device}"
    );
    assert_share(
        cluster,
        &pool,
        "quarter-h100",
        ("20Gi", "25"),
        &[
            "CUDA_DEVICE_MEMORY_LIMIT_0=20480m",
            "CUDA_DEVICE_SM_LIMIT_0=25",
        ],
    )
    .await;

    wait_pod_running(cluster, NS, "two-h100-nvlink").await;
    let pair = results(&claim(cluster, NS, "two-h100-nvlink").await);
    assert_eq!(pair.len(), 2, "{pair:?}");
    let cards: BTreeSet<i64> = pair
        .iter()
        .map(|(_, pool, device, _)| {
            assert_eq!(pool, "node-h100");
            assert!(!is_mig(&devices[device]), "{device}");
            int(&devices[device], attr::INDEX).unwrap()
        })
        .collect();
    assert_eq!(cards.len(), 2, "two distinct cards: {pair:?}");
    assert!(!cards.contains(&mig_card) && !cards.contains(&quarter_card));
    let domains: BTreeSet<Option<String>> = pair
        .iter()
        .map(|(_, _, device, _)| {
            attribute(&devices[device], attr::NVLINK_DOMAIN).and_then(|a| a.string.clone())
        })
        .collect();
    assert_eq!(domains.len(), 1, "{domains:?}");
    assert!(domains.iter().all(Option::is_some), "{domains:?}");
}

/// README: `kubectl describe resourceclaim mig-1g` shows which partition the driver made.
async fn describe_shows_the_mig_device(cluster: &TestCluster) {
    let limits = limits_of(cluster, "node-h100", "mig-1g").await;
    let mig_uuid = limits
        .iter()
        .find_map(|l| l.strip_prefix("GPUPOOL_DEVICE_UUID_0="))
        .expect("the MIG device's UUID in the spec")
        .to_string();
    let want = [
        ("Mig Profile:", "1g.10gb"),
        ("Isolation:", "MIG"),
        ("Multiprocessors:", "16"),
        ("Compute Units:", "119"),
    ];
    wait_for_kubectl(
        cluster,
        &["describe", "resourceclaim", "mig-1g", "-n", NS],
        "`kubectl describe resourceclaim mig-1g` to show the MIG device",
        |text| {
            let shown = want.iter().all(|(label, value)| {
                text.lines().any(|line| {
                    line.trim_start()
                        .strip_prefix(label)
                        .is_some_and(|rest| rest.trim() == *value)
                })
            }) && text.contains(&mig_uuid)
                && text.contains("prepared: MIG 1g.10gb (GPU instance");
            shown.then_some(())
        },
    )
    .await;
}

/// README "MIG": a ComputeProfile with `mig: First` gets the smallest H100 MIG profile reaching its
/// compute and memory (1g.10gb: weight 119 >= 100, 10194Mi >= 8Gi) and one with `mig: Last` a
/// fraction (8Gi and 11% of the card that holds quarter-h100), through the templates the
/// controller writes and the classes it makes for the GpuModel's MIG profiles.
async fn compute_profiles_fall_back_between_a_mig_device_and_a_fraction(cluster: &TestCluster) {
    for (profile, mig, want_request) in [
        ("mig-first", "First", "gpu/h100-80gb-hbm3-mig-1g-10gb"),
        ("mig-last", "Last", "gpu/h100-80gb-hbm3"),
    ] {
        let yaml = format!(
            "apiVersion: gpupool.dev/v1alpha1\nkind: ComputeProfile\nmetadata:\n  name: {profile}\n\
             spec:\n  compute: 100\n  memory: 8Gi\n  models: [h100-80gb-hbm3]\n  mig: {mig}\n  namespaces: [{NS}]\n"
        );
        apply(cluster, NS, &yaml).await;
        let templates: Api<ResourceClaimTemplate> = Api::namespaced(cluster.client(), NS);
        wait_for(&format!("template {profile}"), TIMEOUT, || async {
            templates.get_opt(profile).await.ok().flatten()
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        let pod = format!("uses-{profile}");
        apply(cluster, NS, &template_pod_yaml(&pod, profile)).await;
        let claim_name = generated_claim(cluster, &pod).await;
        let (request, pool, device, _) = allocation_of_running(cluster, &pod, &claim_name).await;
        assert_eq!(
            (request.as_str(), pool.as_str()),
            (want_request, "node-h100"),
            "{profile} -> {device}"
        );
        if mig == "Last" {
            assert_eq!(
                consumed(cluster, &claim_name).await.1.as_deref(),
                Some("11")
            );
        } else {
            assert!(device.contains("-mig-1g-10gb-"), "{device}");
        }
    }
}

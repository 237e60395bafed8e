//! The node driver end to end (issues 2, 3, 4): the real `gpupool-driver` registers with the kubelet
//! emulator, publishes slices the real kubectl shows, and prepares claims the scheduler allocated, with
//! CDI specs carrying each claim's limits.
//!
//! One cluster per backend serves every scenario of this file; each scenario works in its own
//! namespace and pins its claims to its own cards, so they run side by side. Each runs on the
//! emulator, on the real control plane (`<scenario>::control_plane`: kube-apiserver, kube-scheduler
//! and kube-controller-manager) and, ignored, against `GPUPOOL_E2E_KUBECONFIG`
//! (`<scenario>::real_cluster`; `cargo test -p gpupool-e2e -- --ignored`).

mod common;

use std::collections::BTreeSet;

use common::*;
use gpupool_api::claim::ClaimRef;
use gpupool_e2e::harness::objects::{claim_yaml, pod_yaml, Request};
use gpupool_e2e::harness::{real_node_names, Backend, ClusterSpec, NodeSpec, TestCluster};
use gpupool_e2e::kubelet::DraVersion;
use tokio::sync::OnceCell;

/// node-a: six A100s, one or two per scenario. node-b: V100s ("another node"). node-old: a kubelet
/// that only speaks v1beta1.
const A100S: usize = 6;

fn spec(backend: Backend) -> ClusterSpec {
    let mut nodes = vec![
        NodeSpec::new("node-a", "a100-40gb:6"),
        NodeSpec::new("node-b", "v100-32gb:2"),
        NodeSpec::new("node-old", "rtx3090:1").kubelet_versions(&["v1beta1.DRAPlugin"]),
    ];
    if matches!(backend, Backend::Real { .. }) {
        nodes.truncate(real_node_names().len());
    }
    ClusterSpec {
        nodes,
        backend: Some(backend),
        ..ClusterSpec::new()
    }
}

static EMULATED: OnceCell<TestCluster> = OnceCell::const_new();
static PLANE: OnceCell<TestCluster> = OnceCell::const_new();
static REAL: OnceCell<TestCluster> = OnceCell::const_new();

/// The file's one cluster on `backend`, started by the first scenario that asks.
async fn cluster(backend: Backend) -> &'static TestCluster {
    let cell = match backend {
        Backend::Emulator => &EMULATED,
        Backend::ControlPlane => &PLANE,
        Backend::Real { .. } => &REAL,
    };
    cell.get_or_init(|| async move {
        let cluster = TestCluster::start_shared(spec(backend))
            .await
            .unwrap_or_else(|e| panic!("starting the test cluster: {e}"));
        apply_device_class(&cluster).await;
        cluster
    })
    .await
}

on_every_backend!(
    driver_registers_v1_and_kubectl_shows_every_attribute,
    an_old_kubelet_gets_v1beta1_and_prepares_without_share_ids,
    whole_a100_and_a_fraction_are_prepared_then_unprepared,
    describe_shows_the_share_and_a_second_prepare_returns_the_same_ids,
    bad_claims_fail_alone_in_a_request,
    three_pods_share_one_a100_each_with_its_own_limits,
    two_shares_of_different_cards_get_ordinals_in_cdi_id_order,
    a_claim_that_cannot_fit_gets_an_event_and_stays_pending,
    bad_gpu_configs_fail_naming_the_field_and_good_ones_apply,
    a_claim_shared_by_two_pods_is_unprepared_after_the_last_one,
);

mod scenarios {
    use super::*;
    use k8s_openapi::api::core::v1::Pod;
    use kube::Api;
    use serde_json::Value;

    const DRIVER: &str = "gpupool.dev";

    fn uid(claim: &k8s_openapi::api::resource::v1::ResourceClaim) -> String {
        claim.metadata.uid.clone().expect("claim uid")
    }

    pub async fn driver_registers_v1_and_kubectl_shows_every_attribute(cluster: &TestCluster) {
        let node = cluster.node_at(0);
        if let Some(kubelet) = &node.kubelet {
            let reg = kubelet.registration(DRIVER).expect("registered at start");
            assert_eq!(reg.version, DraVersion::V1, "{reg:?}");
            assert!(reg.health_advertised, "the driver serves health: {reg:?}");
            assert_eq!(reg.endpoint, node.dirs.plugin.join("dra.sock"));
            let health =
                gpupool_e2e::harness::wait_for("the driver's health stream", TIMEOUT, || async {
                    let health = kubelet.device_health(DRIVER);
                    (health.len() == A100S).then_some(health)
                })
                .await
                .unwrap_or_else(|e| panic!("{e}: {:?}", kubelet.device_health(DRIVER)));
            for device in &health {
                assert_eq!(device.pool_name, node.name);
                assert_eq!(
                    device.health,
                    gpupool_proto::health_v1alpha1::HealthStatus::Healthy,
                    "{device:?}"
                );
            }
        }
        devices_of(cluster, &node.name, A100S).await;

        let yaml = cluster
            .kubectl(&["get", "resourceslices", "-o", "yaml"])
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let list: Value = serde_yaml::from_str(&yaml).expect("kubectl prints YAML");
        let slices: Vec<&Value> = list["items"]
            .as_array()
            .expect("a List")
            .iter()
            .filter(|s| {
                s["spec"]["driver"] == DRIVER && s["spec"]["nodeName"] == node.name.as_str()
            })
            .collect();
        let count: usize = slices
            .iter()
            .map(|s| s["spec"]["devices"].as_array().map_or(0, Vec::len))
            .sum();
        assert_eq!(count, A100S, "kubectl shows every A100 of {}", node.name);
        let attributes = [
            "productName",
            "model",
            "architecture",
            "uuid",
            "index",
            "multiprocessors",
            "cudaCores",
            "computeWeight",
            "brand",
            "cudaComputeCapability",
            "driverVersion",
            "cudaDriverVersion",
        ];
        let standard = [
            "resource.kubernetes.io/pciBusID",
            "resource.kubernetes.io/pcieRoot",
            "resource.kubernetes.io/numaNode",
        ];
        let mut uuids = BTreeSet::new();
        for slice in slices {
            for device in slice["spec"]["devices"].as_array().unwrap() {
                let name = device["name"].as_str().unwrap();
                let attrs = device["attributes"].as_object().expect("attributes");
                let get = |a: &str| {
                    attrs
                        .get(a)
                        .or_else(|| attrs.get(&format!("gpupool.dev/{a}")))
                };
                for a in attributes {
                    if a == "computeWeight" && get(a).is_none() {
                        // Published only once a GpuModel gives this model a weight (the controller's part).
                        continue;
                    }
                    assert!(
                        get(a).is_some(),
                        "{name}: attribute {a} missing in {attrs:?}"
                    );
                }
                for a in standard {
                    assert!(
                        attrs.contains_key(a),
                        "{name}: attribute {a} missing in {attrs:?}"
                    );
                }
                assert_eq!(get("model").unwrap()["string"], "A100-SXM4-40GB");
                assert_eq!(
                    get("productName").unwrap()["string"],
                    "NVIDIA A100-SXM4-40GB"
                );
                assert_eq!(get("multiprocessors").unwrap()["int"], 108);
                assert!(
                    get("cudaComputeCapability").unwrap()["version"].is_string(),
                    "semver"
                );
                uuids.insert(get("uuid").unwrap()["string"].as_str().unwrap().to_string());

                assert_eq!(device["allowMultipleAllocations"], true, "{name}");
                let capacity = device["capacity"].as_object().expect("capacity");
                let keys: BTreeSet<&str> = capacity.keys().map(String::as_str).collect();
                assert_eq!(
                    keys,
                    BTreeSet::from(["cores", "memory"]),
                    "{name}: only memory and cores"
                );
                let memory = &capacity["memory"];
                assert_eq!(
                    memory["value"], memory["requestPolicy"]["default"],
                    "{name}: whole card by default"
                );
                assert_eq!(
                    memory["requestPolicy"]["validRange"]["step"], "1Mi",
                    "{name}"
                );
                assert_eq!(
                    memory["requestPolicy"]["validRange"]["min"], "1Mi",
                    "{name}"
                );
                let cores = &capacity["cores"];
                assert_eq!(cores["value"], "100", "{name}");
                assert_eq!(cores["requestPolicy"]["default"], "0", "{name}");
                assert_eq!(cores["requestPolicy"]["validRange"]["max"], "100", "{name}");
                assert_eq!(cores["requestPolicy"]["validRange"]["step"], "1", "{name}");
            }
        }
        assert_eq!(uuids.len(), A100S, "every card has its own uuid");
    }

    pub async fn an_old_kubelet_gets_v1beta1_and_prepares_without_share_ids(cluster: &TestCluster) {
        let Some(node) = cluster.nodes().iter().find(|n| n.spec.name == "node-old") else {
            eprintln!("skipped: needs a third node in GPUPOOL_E2E_NODE");
            return;
        };
        let Some(kubelet) = &node.kubelet else {
            eprintln!("skipped: a real kubelet picks its own version");
            return;
        };
        let reg = kubelet.registration(DRIVER).expect("registered at start");
        assert_eq!(reg.version, DraVersion::V1beta1, "{reg:?}");

        let ns = cluster.create_namespace("e2e-v1beta1").await.unwrap();
        let uuid = device_uuid(cluster, &node.name, "gpu-0", 1).await;
        apply_claim(cluster, &ns, "rtx", &[Request::new("gpu").on(&uuid)]).await;
        apply(cluster, &ns, &pod_yaml("p", &["rtx"])).await;
        wait_pod_running(cluster, &ns, "p").await;
        let claim = claim(cluster, &ns, "rtx").await;
        let prepared = prepared(node, &uid(&claim)).await;
        assert_eq!(prepared.devices.len(), 1);
        assert_eq!(
            prepared.devices[0].share_id, None,
            "v1beta1 has no share id"
        );
        assert_eq!(prepared.devices[0].device_name, "gpu-0");
        assert!(node.cdi_spec_path(&uid(&claim)).is_file());
        delete_pod(cluster, &ns, "p").await;
    }

    pub async fn whole_a100_and_a_fraction_are_prepared_then_unprepared(cluster: &TestCluster) {
        let node = cluster.node_at(0);
        let devices = devices_of(cluster, &node.name, A100S).await;
        let uuid0 = device_uuid(cluster, &node.name, "gpu-0", A100S).await;
        let uuid1 = device_uuid(cluster, &node.name, "gpu-1", A100S).await;
        let ns = cluster
            .create_namespace("e2e-whole-fraction")
            .await
            .unwrap();
        apply_claim(cluster, &ns, "whole", &[Request::new("gpu").on(&uuid0)]).await;
        let fraction = Request::new("gpu").on(&uuid1).memory("8Gi").cores("50");
        apply_claim(cluster, &ns, "fraction", &[fraction]).await;
        apply(cluster, &ns, &pod_yaml("whole", &["whole"])).await;
        apply(cluster, &ns, &pod_yaml("fraction", &["fraction"])).await;
        let whole_pod = wait_pod_running(cluster, &ns, "whole").await;
        wait_pod_running(cluster, &ns, "fraction").await;
        assert_eq!(
            whole_pod.spec.as_ref().unwrap().node_name.as_deref(),
            Some(node.name.as_str())
        );

        let whole = claim(cluster, &ns, "whole").await;
        let fraction = claim(cluster, &ns, "fraction").await;
        for (claim, device, uuid, memory, cores) in [
            (&whole, "gpu-0", &uuid0, memory_mib(&devices["gpu-0"]), None),
            (&fraction, "gpu-1", &uuid1, 8192, Some("50")),
        ] {
            let uid = uid(claim);
            let prepared = prepared(node, &uid).await;
            assert_eq!(prepared.devices.len(), 1);
            let d = &prepared.devices[0];
            assert_eq!(
                (d.pool_name.as_str(), d.device_name.as_str()),
                (node.name.as_str(), device)
            );
            if node.kubelet.is_some() {
                assert_eq!(d.request_names, ["gpu"]);
            }
            let share = results(claim)[0].3.clone();
            assert_eq!(d.share_id, share, "the share id of the allocation");
            let expected_name = gpupool_api::names::cdi_device_name(&uid, device, share.as_deref());
            assert_eq!(
                d.cdi_device_ids,
                [gpupool_api::names::cdi_device_id(&expected_name)]
            );

            let spec = cdi_spec(node, &uid);
            assert_eq!(spec["kind"], "gpupool.dev/claim");
            assert!(
                device_nodes(&spec).is_empty(),
                "fake GPUs have no device nodes: {spec}"
            );
            let env = env_for(&spec, &d.cdi_device_ids[0]);
            assert_eq!(
                env.get("CUDA_DEVICE_MEMORY_LIMIT_0"),
                Some(&format!("{memory}m")),
                "{env:?}"
            );
            match cores {
                Some(c) => assert_eq!(
                    env.get("CUDA_DEVICE_SM_LIMIT_0").map(String::as_str),
                    Some(c)
                ),
                None => {
                    let sm = env
                        .get("CUDA_DEVICE_SM_LIMIT_0")
                        .map(|v| v.parse::<u32>().unwrap());
                    assert!(
                        matches!(sm, None | Some(0) | Some(100..)),
                        "whole card is unthrottled: {env:?}"
                    );
                }
            }
            assert_eq!(env.get("GPUPOOL_DEVICE_UUID_0"), Some(uuid), "{env:?}");
            assert_eq!(
                env.get("GPUPOOL_DEVICE_MODEL_0").map(String::as_str),
                Some("A100-SXM4-40GB")
            );
        }

        let uids = [uid(&whole), uid(&fraction)];
        delete_pod(cluster, &ns, "whole").await;
        delete_pod(cluster, &ns, "fraction").await;
        // The spec goes at the start of unprepare; the kubelet forgets the claim and the cache
        // folder goes when unprepare has answered: wait for all of it.
        gpupool_e2e::harness::wait_for(
            "CDI specs, cache folders and the kubelet's record removed after the pods went",
            TIMEOUT,
            || async {
                uids.iter()
                    .all(|u| {
                        !node.cdi_spec_path(u).exists()
                            && !node.dirs.run.join("vgpu-cache").join(u).exists()
                            && node
                                .kubelet
                                .as_ref()
                                .is_none_or(|k| !k.prepared_claims().contains_key(u))
                    })
                    .then_some(())
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}: {:?}", node.cdi_spec_files()));
        for u in &uids {
            if let Some(kubelet) = &node.kubelet {
                assert!(!kubelet.prepared_claims().contains_key(u));
            }
            let cache = node.dirs.run.join("vgpu-cache").join(u);
            assert!(
                !cache.exists(),
                "cache folder {} removed on unprepare",
                cache.display()
            );
        }
    }

    pub async fn describe_shows_the_share_and_a_second_prepare_returns_the_same_ids(
        cluster: &TestCluster,
    ) {
        let node = cluster.node_at(0);
        let uuid = device_uuid(cluster, &node.name, "gpu-5", A100S).await;
        let ns = cluster.create_namespace("e2e-describe").await.unwrap();
        // As a user would: the real kubectl applies a file.
        let manifest = cluster.workdir().join(format!("{ns}-slice.yaml"));
        let yaml = format!(
            "{}---\n{}",
            claim_yaml(
                "slice",
                &[Request::new("gpu").on(&uuid).memory("8Gi").cores("50")],
            ),
            pod_yaml("p", &["slice"])
        );
        std::fs::write(&manifest, yaml).unwrap();
        cluster
            .apply_file(&manifest, Some(&ns))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        wait_pod_running(cluster, &ns, "p").await;
        let claim = claim(cluster, &ns, "slice").await;
        let prepared = prepared(node, &uid(&claim)).await;
        let share = results(&claim)[0]
            .3
            .clone()
            .expect("a share of a shareable card");

        // A real kubelet cannot be asked to prepare twice; the emulator can.
        if let Some(kubelet) = &node.kubelet {
            let again = kubelet
                .prepare(DRIVER, &[ClaimRef::of(&claim)])
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let devices = again[&uid(&claim)]
                .as_ref()
                .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(
                devices, &prepared.devices,
                "a repeated prepare answers the same"
            );
        }

        // The driver writes status.devices after prepare, with its own ServiceAccount (1.36 asks
        // for resourceclaims/driver on top of resourceclaims/status); describe shows it. The
        // allocation alone names the device, the share and the capacities, so only the driver's
        // own condition and data prove the write.
        let describe = gpupool_e2e::harness::wait_for(
            "describe to show the device status",
            TIMEOUT,
            || async {
                let out = cluster
                    .kubectl(&["describe", "resourceclaim", "slice", "-n", &ns])
                    .await
                    .ok()?;
                out.contains("prepared: 8Gi of memory, 50% of the SMs")
                    .then_some(out)
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        assert!(describe.contains("gpu-5"), "{describe}");
        assert!(describe.contains(&share), "share id: {describe}");
        assert!(describe.contains("Memory Limit:"), "data: {describe}");
        let entry = driver_status_entry(cluster, &ns, "slice")
            .await
            .expect("the driver's status entry");
        assert_eq!(
            (entry.device.as_str(), entry.share_id.as_deref()),
            ("gpu-5", Some(share.as_str()))
        );
        let data = &entry.data.as_ref().expect("the driver's data").0;
        assert_eq!(
            (&data["memoryLimit"], &data["coreLimit"]),
            (&serde_json::json!("8Gi"), &serde_json::json!(50))
        );
        delete_pod(cluster, &ns, "p").await;
    }

    pub async fn bad_claims_fail_alone_in_a_request(cluster: &TestCluster) {
        let node = cluster.node_at(0);
        let Some(kubelet) = &node.kubelet else {
            eprintln!("skipped: crafted requests need the kubelet emulator");
            return;
        };
        let uuid = device_uuid(cluster, &node.name, "gpu-5", A100S).await;
        let ns = cluster.create_namespace("e2e-bad-claims").await.unwrap();
        let share = Request::new("gpu").on(&uuid).memory("4Gi").cores("10");
        apply_claim_and_pod(cluster, &ns, "good", &[share]).await;
        apply_claim(cluster, &ns, "never-allocated", &[Request::new("gpu")]).await;
        wait_pod_running(cluster, &ns, "good").await;
        let good = claim(cluster, &ns, "good").await;
        let good_devices = prepared(node, &uid(&good)).await.devices;
        let unallocated = claim(cluster, &ns, "never-allocated").await;
        let mut claims = vec![
            ClaimRef::of(&good),
            ClaimRef {
                uid: "00000000-0000-4000-8000-000000000000".into(),
                ..ClaimRef::of(&good)
            },
            ClaimRef::of(&unallocated),
        ];
        let mut expected_errors = vec![
            ("00000000-0000-4000-8000-000000000000".to_string(), "good"),
            (uid(&unallocated), "never-allocated"),
        ];
        if let Some(other) = cluster.nodes().get(1) {
            let v100 = device_uuid(cluster, &other.name, "gpu-0", 2).await;
            let share = Request::new("gpu").on(&v100).memory("1Gi");
            apply_claim_and_pod(cluster, &ns, "elsewhere", &[share]).await;
            wait_pod_running(cluster, &ns, "elsewhere").await;
            let elsewhere = claim(cluster, &ns, "elsewhere").await;
            claims.push(ClaimRef::of(&elsewhere));
            expected_errors.push((uid(&elsewhere), "elsewhere"));
        }

        let outcome = kubelet
            .prepare(DRIVER, &claims)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            outcome[&uid(&good)]
                .as_ref()
                .unwrap_or_else(|e| panic!("good claim failed: {e}")),
            &good_devices
        );
        for (uid, name) in expected_errors {
            let result = outcome
                .get(&uid)
                .unwrap_or_else(|| panic!("no answer for {name}: {outcome:?}"));
            let error = result
                .as_ref()
                .expect_err(&format!("claim {name} must fail"));
            assert!(
                error.contains(name),
                "the error names claim {name}: {error}"
            );
        }
        delete_pod(cluster, &ns, "good").await;
        if cluster.nodes().len() > 1 {
            delete_pod(cluster, &ns, "elsewhere").await;
        }
    }

    pub async fn three_pods_share_one_a100_each_with_its_own_limits(cluster: &TestCluster) {
        let node = cluster.node_at(0);
        let uuid = device_uuid(cluster, &node.name, "gpu-2", A100S).await;
        let ns = cluster.create_namespace("e2e-share").await.unwrap();
        let shares = [
            ("s8", "8Gi", "50", 8192),
            ("s16a", "16Gi", "25", 16384),
            ("s16b", "16Gi", "25", 16384),
        ];
        for (name, memory, cores, _) in shares {
            apply_claim_and_pod(
                cluster,
                &ns,
                name,
                &[Request::new("gpu").on(&uuid).memory(memory).cores(cores)],
            )
            .await;
        }
        let mut share_ids = BTreeSet::new();
        let mut caches = BTreeSet::new();
        for (name, _, cores, mib) in shares {
            wait_pod_running(cluster, &ns, name).await;
            let claim = claim(cluster, &ns, name).await;
            let r = results(&claim);
            assert_eq!(r.len(), 1);
            assert_eq!(r[0].2, "gpu-2", "{name} is on the pinned card");
            share_ids.insert(r[0].3.clone().expect("a share id"));
            let uid = uid(&claim);
            let prepared = prepared(node, &uid).await;
            let spec = cdi_spec(node, &uid);
            let env = env_for(&spec, &prepared.devices[0].cdi_device_ids[0]);
            assert_eq!(
                env.get("CUDA_DEVICE_MEMORY_LIMIT_0"),
                Some(&format!("{mib}m")),
                "{name}: {env:?}"
            );
            assert_eq!(
                env.get("CUDA_DEVICE_SM_LIMIT_0").map(String::as_str),
                Some(cores),
                "{name}"
            );
            let cache = env
                .get("CUDA_DEVICE_MEMORY_SHARED_CACHE")
                .unwrap_or_else(|| panic!("{name}: no shared cache env: {env:?}"))
                .clone();
            assert!(
                cache.contains(&uid),
                "{name}: the cache is the claim's own: {cache}"
            );
            let folder = std::path::Path::new(&cache).parent().unwrap().to_path_buf();
            assert!(
                folder.is_dir(),
                "{name}: cache folder {} exists",
                folder.display()
            );
            caches.insert(folder);
        }
        assert_eq!(
            share_ids.len(),
            3,
            "three shares of one card: {share_ids:?}"
        );
        assert_eq!(caches.len(), 3, "three cache folders: {caches:?}");
        for (name, ..) in shares {
            delete_pod(cluster, &ns, name).await;
        }
    }

    pub async fn two_shares_of_different_cards_get_ordinals_in_cdi_id_order(cluster: &TestCluster) {
        let node = cluster.node_at(0);
        let uuid3 = device_uuid(cluster, &node.name, "gpu-3", A100S).await;
        let uuid4 = device_uuid(cluster, &node.name, "gpu-4", A100S).await;
        let ns = cluster.create_namespace("e2e-two-shares").await.unwrap();
        apply_claim(
            cluster,
            &ns,
            "pair",
            &[
                Request::new("a").on(&uuid3).memory("4Gi").cores("10"),
                Request::new("b").on(&uuid4).memory("6Gi").cores("20"),
            ],
        )
        .await;
        apply(cluster, &ns, &pod_yaml("p", &["pair"])).await;
        wait_pod_running(cluster, &ns, "p").await;
        let claim = claim(cluster, &ns, "pair").await;
        let uid = uid(&claim);
        let prepared = prepared(node, &uid).await;
        let spec = cdi_spec(node, &uid);
        let ids = prepared.cdi_device_ids();
        assert_eq!(ids.len(), 2, "{prepared:?}");
        let expected = |device: &str| match device {
            "gpu-3" => ("4096m", "10", &uuid3),
            "gpu-4" => ("6144m", "20", &uuid4),
            other => panic!("unexpected device {other}"),
        };
        let mut seen = BTreeSet::new();
        for (ordinal, id) in ids.iter().enumerate() {
            let device = prepared
                .devices
                .iter()
                .find(|d| d.cdi_device_ids.contains(id))
                .unwrap();
            seen.insert(device.device_name.clone());
            let (memory, cores, uuid) = expected(&device.device_name);
            let env = env_for(&spec, id);
            assert_eq!(
                env.get(&format!("CUDA_DEVICE_MEMORY_LIMIT_{ordinal}"))
                    .map(String::as_str),
                Some(memory),
                "ordinal {ordinal} is {} (CDI id {id}): {env:?}",
                device.device_name
            );
            assert_eq!(
                env.get(&format!("CUDA_DEVICE_SM_LIMIT_{ordinal}"))
                    .map(String::as_str),
                Some(cores)
            );
            assert_eq!(
                env.get(&format!("GPUPOOL_DEVICE_UUID_{ordinal}")),
                Some(uuid)
            );
        }
        assert_eq!(
            seen,
            BTreeSet::from(["gpu-3".to_string(), "gpu-4".to_string()])
        );
        delete_pod(cluster, &ns, "p").await;
    }

    pub async fn a_claim_that_cannot_fit_gets_an_event_and_stays_pending(cluster: &TestCluster) {
        let ns = cluster.create_namespace("e2e-cannot-fit").await.unwrap();
        apply_claim(cluster, &ns, "huge", &[Request::new("gpu").memory("100Gi")]).await;
        apply(cluster, &ns, &pod_yaml("p", &["huge"])).await;
        let pod_uid = Api::<Pod>::namespaced(cluster.client(), &ns)
            .get("p")
            .await
            .unwrap()
            .metadata
            .uid;
        // What kube-scheduler does: a Warning on the pod, saying how many nodes could not
        // allocate the claim; nothing on the claim.
        let event = wait_pod_event(
            cluster,
            &ns,
            "p",
            "FailedScheduling",
            "a FailedScheduling event on the pod whose claim cannot fit",
        )
        .await;
        assert_eq!(event.type_.as_deref(), Some("Warning"), "{event:?}");
        assert_eq!(event.involved_object.uid, pod_uid, "{event:?}");
        let message = event.message.clone().unwrap_or_default();
        assert!(
            message.starts_with("0/") && message.contains(" nodes are available: "),
            "{message}"
        );
        assert!(message.contains("cannot allocate all claims"), "{message}");
        let on_claim = events_about(cluster, &ns, "ResourceClaim", "huge").await;
        assert!(on_claim.is_empty(), "no event on the claim: {on_claim:?}");
        let claim = claim(cluster, &ns, "huge").await;
        assert!(
            claim
                .status
                .as_ref()
                .and_then(|s| s.allocation.as_ref())
                .is_none(),
            "nothing half-allocated: {:?}",
            claim.status
        );
        let pod = Api::<Pod>::namespaced(cluster.client(), &ns)
            .get("p")
            .await
            .unwrap();
        assert_eq!(
            pod.spec.as_ref().unwrap().node_name,
            None,
            "the pod is not bound"
        );
        assert_ne!(
            pod.status.as_ref().and_then(|s| s.phase.as_deref()),
            Some("Running")
        );
    }

    pub async fn bad_gpu_configs_fail_naming_the_field_and_good_ones_apply(cluster: &TestCluster) {
        let node = cluster.node_at(0);
        let uuid = device_uuid(cluster, &node.name, "gpu-5", A100S).await;
        let ns = cluster.create_namespace("e2e-gpuconfig").await.unwrap();
        let request = || Request::new("gpu").on(&uuid).memory("4Gi").cores("10");
        // (claim, GpuConfig, the field its error must name)
        let bad = [
            (
                "typo",
                serde_json::json!({"memoryLimt": "1Gi"}),
                "memoryLimt",
            ),
            (
                "above",
                serde_json::json!({"memoryLimit": "8Gi"}),
                "memoryLimit",
            ),
            (
                "enum",
                serde_json::json!({"sharing": "Sometimes"}),
                "sharing",
            ),
        ];
        for (name, config, _) in &bad {
            apply_claim_and_pod(cluster, &ns, name, &[request().gpu_config(config.clone())]).await;
        }
        apply_claim_and_pod(
            cluster,
            &ns,
            "lowered",
            &[request().gpu_config(serde_json::json!({"memoryLimit": "1Gi"}))],
        )
        .await;

        wait_pod_running(cluster, &ns, "lowered").await;
        let lowered = claim(cluster, &ns, "lowered").await;
        let prepared_lowered = prepared(node, &uid(&lowered)).await;
        let env = env_for(
            &cdi_spec(node, &uid(&lowered)),
            &prepared_lowered.devices[0].cdi_device_ids[0],
        );
        assert_eq!(
            env.get("CUDA_DEVICE_MEMORY_LIMIT_0").map(String::as_str),
            Some("1024m"),
            "{env:?}"
        );

        for (name, _, field) in &bad {
            let events = gpupool_e2e::harness::wait_for(
                &format!("an Event on claim {name} naming {field}"),
                TIMEOUT,
                || async {
                    let events = events_about(cluster, &ns, "ResourceClaim", name).await;
                    events
                        .iter()
                        .any(|e| e.message.as_deref().unwrap_or_default().contains(field))
                        .then_some(events)
                },
            )
            .await;
            let events = match events {
                Ok(events) => events,
                Err(e) => {
                    let messages = |events: Vec<k8s_openapi::api::core::v1::Event>| {
                        events
                            .into_iter()
                            .filter_map(|e| e.message)
                            .collect::<BTreeSet<_>>()
                    };
                    let seen = messages(events_about(cluster, &ns, "ResourceClaim", name).await);
                    let pod_events = messages(events_about(cluster, &ns, "Pod", name).await);
                    panic!("{e}: claim events {seen:?}, pod events {pod_events:?}")
                }
            };
            assert!(
                events.iter().any(|e| e.type_.as_deref() == Some("Warning")),
                "{events:?}"
            );
            let pod = Api::<Pod>::namespaced(cluster.client(), &ns)
                .get(name)
                .await
                .unwrap();
            assert_ne!(
                pod.status.as_ref().and_then(|s| s.phase.as_deref()),
                Some("Running"),
                "{name}"
            );
            let c = claim(cluster, &ns, name).await;
            assert!(
                !node.cdi_spec_path(&uid(&c)).exists(),
                "no CDI spec for failed claim {name}"
            );
        }

        if let Some(kubelet) = &node.kubelet {
            let mut refs = vec![ClaimRef::of(&lowered)];
            for (name, ..) in &bad {
                refs.push(ClaimRef::of(&claim(cluster, &ns, name).await));
            }
            let outcome = kubelet
                .prepare(DRIVER, &refs)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(
                outcome[&uid(&lowered)].as_ref().unwrap(),
                &prepared_lowered.devices
            );
            for ((name, _, field), r) in bad.iter().zip(&refs[1..]) {
                let error = outcome[&r.uid].as_ref().expect_err(name);
                assert!(
                    error.contains(field),
                    "{name}: the error names {field}: {error}"
                );
            }
        }
        for name in ["typo", "above", "enum", "lowered"] {
            delete_pod(cluster, &ns, name).await;
        }
    }

    pub async fn a_claim_shared_by_two_pods_is_unprepared_after_the_last_one(
        cluster: &TestCluster,
    ) {
        let node = cluster.node_at(0);
        let uuid = device_uuid(cluster, &node.name, "gpu-1", A100S).await;
        let ns = cluster.create_namespace("e2e-shared-claim").await.unwrap();
        let share = Request::new("gpu").on(&uuid).memory("2Gi");
        apply_claim(cluster, &ns, "shared", &[share]).await;
        apply(cluster, &ns, &pod_yaml("first", &["shared"])).await;
        apply(cluster, &ns, &pod_yaml("second", &["shared"])).await;
        wait_pod_running(cluster, &ns, "first").await;
        wait_pod_running(cluster, &ns, "second").await;
        let claim = claim(cluster, &ns, "shared").await;
        let uid = uid(&claim);
        let reserved = claim
            .status
            .as_ref()
            .and_then(|s| s.reserved_for.clone())
            .unwrap_or_default();
        assert_eq!(reserved.len(), 2, "reserved for both pods: {reserved:?}");
        prepared(node, &uid).await;

        delete_pod(cluster, &ns, "first").await;
        gpupool_e2e::harness::wait_for("the first pod to be gone", TIMEOUT, || async {
            let pods: Api<Pod> = Api::namespaced(cluster.client(), &ns);
            pods.get_opt("first").await.ok()?.is_none().then_some(())
        })
        .await
        .unwrap();
        // Give the kubelet a few passes: it must keep the claim for the pod still using it.
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        assert!(
            node.cdi_spec_path(&uid).is_file(),
            "still used by the second pod"
        );

        delete_pod(cluster, &ns, "second").await;
        gpupool_e2e::harness::wait_for("the claim to be unprepared", TIMEOUT, || async {
            (!node.cdi_spec_path(&uid).exists()).then_some(())
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", node.driver_log()));
    }
}

//! MIG and fractions on one node (issue 23), over the real driver binary:
//! - through kube-scheduler (the control plane) and the scheduler stand-in on the driver's own
//!   slices: a fraction of a card blocks every MIG device of that card and none of the other
//!   card's, and a MIG device blocks its card;
//! - a scheduler that double-books (kube-scheduler before 1.36.2, Volcano, KAI before v0.17.1):
//!   the node guard refuses the second claim with a clear error;
//! - kill -9 between GPU-instance and compute-instance creation (and at every other MIG step)
//!   leaves no instance behind after the restart;
//! - a reboot (instances gone) prepares the claim again with the same CDI ids;
//! - an API server without partitionable devices gets whole cards only, with the reason logged.

mod common;
mod crash_support;

use std::time::Duration;

use common::*;
use crash_support::{
    cdi_ids, exclusive_result, killed, list_dir, mig_instances, result, CrashNode, Started,
};
use gpupool_e2e::harness::objects::pod_yaml;
use gpupool_e2e::harness::{wait_for, Backend, ClusterSpec, NodeSpec, TestCluster};

const NS: &str = "default";

/// Classes for one kind of device each: cards (whole or fractions), and 1g.10gb MIG devices.
const CLASSES: &str = r#"apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata:
  name: cards.e2e.gpupool.dev
spec:
  selectors:
  - cel:
      expression: device.driver == "gpupool.dev" && device.attributes["gpupool.dev"].type == "gpu"
---
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata:
  name: mig-1g.e2e.gpupool.dev
spec:
  selectors:
  - cel:
      expression: device.driver == "gpupool.dev" && device.attributes["gpupool.dev"].type == "mig" && device.attributes["gpupool.dev"].migProfile == "1g.10gb"
"#;

/// A claim for one device of `class` on card `card`, with capacity requests when given.
fn claim_on(name: &str, class: &str, card: u32, capacity: &[(&str, &str)]) -> String {
    let mut yaml = format!(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata:\n  name: {name}\nspec:\n  devices:\n    requests:\n    - name: gpu\n      exactly:\n        deviceClassName: {class}\n        selectors:\n        - cel:\n            expression: device.attributes[\"gpupool.dev\"].index == {card}\n"
    );
    if !capacity.is_empty() {
        yaml.push_str("        capacity:\n          requests:\n");
        for (k, v) in capacity {
            yaml.push_str(&format!("            {k}: \"{v}\"\n"));
        }
    }
    yaml
}

async fn claim_and_pod(cluster: &TestCluster, name: &str, claim: String) {
    apply(cluster, NS, &claim).await;
    apply(cluster, NS, &pod_yaml(name, &[name])).await;
}

/// The device a running pod's claim got.
async fn device_of_running(cluster: &TestCluster, name: &str) -> String {
    wait_pod_running(cluster, NS, name).await;
    let results = results(&claim(cluster, NS, name).await);
    assert_eq!(results.len(), 1, "{name}: {results:?}");
    results[0].2.clone()
}

/// Waits for the scheduler to refuse the pod (on the emulator saying `why`); the claim stays
/// unallocated.
async fn refused(cluster: &TestCluster, name: &str, why: &str) {
    wait_unschedulable(cluster, NS, name, why).await;
    assert!(
        results(&claim(cluster, NS, name).await).is_empty(),
        "{name} is not allocated"
    );
}

on_both_backends!(a_fraction_blocks_every_mig_device_of_its_card_and_a_mig_device_blocks_its_card);

async fn a_fraction_blocks_every_mig_device_of_its_card_and_a_mig_device_blocks_its_card(
    backend: Backend,
) {
    let cluster = start(
        ClusterSpec::new()
            .with_node(NodeSpec::new("node-mig", "h100-80gb:2"))
            .on(backend),
    )
    .await;
    let _logs = cluster.logs_on_failure();
    let node = cluster.node("node-mig").unwrap();
    devices_of(&cluster, &node.name, 2 * 26).await;
    apply(&cluster, NS, CLASSES).await;

    let cards = "cards.e2e.gpupool.dev";
    let small = "mig-1g.e2e.gpupool.dev";
    claim_and_pod(
        &cluster,
        "half",
        claim_on("half", cards, 0, &[("memory", "8Gi"), ("cores", "50")]),
    )
    .await;
    assert_eq!(device_of_running(&cluster, "half").await, "gpu-0");

    // Every 1g placement of gpu-0 is refused for its counters; those of gpu-1 are free.
    claim_and_pod(&cluster, "small-0", claim_on("small-0", small, 0, &[])).await;
    refused(
        &cluster,
        "small-0",
        "insufficient counters for gpu-0-mig-1g-10gb-6",
    )
    .await;
    claim_and_pod(&cluster, "small-1", claim_on("small-1", small, 1, &[])).await;
    assert_eq!(
        device_of_running(&cluster, "small-1").await,
        "gpu-1-mig-1g-10gb-0"
    );
    let instances = mig_instances(&node.dirs.run);
    assert_eq!(instances.len(), 1, "{instances:?}");

    // A MIG device blocks its card, whole or in fractions.
    claim_and_pod(&cluster, "whole-1", claim_on("whole-1", cards, 1, &[])).await;
    refused(&cluster, "whole-1", "insufficient counters for gpu-1:").await;

    // The fraction goes: gpu-0's counters come back with its last share.
    delete_pod(&cluster, NS, "half").await;
    assert_eq!(
        device_of_running(&cluster, "small-0").await,
        "gpu-0-mig-1g-10gb-0"
    );
}

#[test]
fn without_partitionable_devices_the_node_publishes_whole_cards_and_says_why() {
    gpupool_e2e::harness::shared_runtime().block_on(async {
        let cluster = start(
            ClusterSpec::new()
                .with_node(NodeSpec::new("node-old", "h100-80gb:1,a100-40gb:1+mig"))
                .without_partitionable_devices(),
        )
        .await;
        let _logs = cluster.logs_on_failure();
        let node = cluster.node("node-old").unwrap();
        let last = std::sync::Mutex::new(Vec::new());
        let slices = wait_for("node-old to publish whole cards only", TIMEOUT, || {
            let (last, cluster) = (&last, &cluster);
            async move {
                let slices = cluster.slices_of("node-old").await.ok()?;
                let names: Vec<String> = slices
                    .iter()
                    .flat_map(|s| s.spec.devices.iter().flatten())
                    .map(|d| d.name.clone())
                    .collect();
                *last.lock().unwrap() = names.clone();
                (names == ["gpu-0"]).then_some(slices)
            }
        })
        .await
        .unwrap_or_else(|e| panic!("{e}; last: {:?}", last.lock().unwrap()));
        assert!(slices.iter().all(|s| s.spec.shared_counters.is_none()));
        assert_eq!(slices[0].spec.pool.resource_slice_count, 1);
        let log = node.driver_log();
        assert!(
            log.contains("publishing whole cards and fractions only")
                && log.contains("DRAPartitionableDevices"),
            "the driver says why:\n{log}"
        );
        assert!(log.contains("gpu-1"), "and which card is left out:\n{log}");
    });
}

/// A crash node with one H100 and a claim of one MIG device, allocated by the test.
async fn node_with_a_mig_claim(name: &str) -> (CrashNode, gpupool_api::claim::ClaimRef) {
    let node = CrashNode::with_namespace(name, "h100-80gb:1", "mig").await;
    let claim = node
        .create_allocated_claim(
            "mig",
            "small",
            vec![exclusive_result("gpu0", name, "gpu-0-mig-3g-40gb-4")],
            Vec::new(),
        )
        .await;
    (node, claim)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_between_mig_steps_leaves_nothing_behind_after_restart() {
    for point in [
        "after-gpu-instance-created",
        "after-gpu-instance-recorded",
        "after-compute-instance-created",
    ] {
        let (mut node, claim) = node_with_a_mig_claim("node-kill").await;
        if let Started::Exited(status) = node.start_driver(Some(point)).await {
            panic!("{point}: the armed driver exited at start ({status})");
        }
        assert!(
            node.kubelet
                .prepare("gpupool.dev", std::slice::from_ref(&claim))
                .await
                .is_err(),
            "{point}: the call dies with the driver"
        );
        let status = node.wait_exit(Duration::from_secs(10)).await;
        assert!(
            status.as_ref().is_some_and(killed),
            "{point}: killed by SIGKILL: {status:?}"
        );
        // What the crash left: a GPU instance, without (or with) its compute instance.
        let left = mig_instances(&node.dirs.run);
        assert_eq!(left.len(), 1, "{point}: {left:?}");
        if point != "after-compute-instance-created" {
            assert!(left[0].2.is_empty(), "{point}: half-made: {left:?}");
        }

        node.start_driver_ok().await;
        assert_eq!(
            mig_instances(&node.dirs.run),
            [],
            "{point}: start-up destroyed what no claim accounts for"
        );
        node.check_reconciled()
            .unwrap_or_else(|p| panic!("{point}: start-up left:\n{p}"));
        assert!(
            list_dir(&node.dirs.cdi).is_empty(),
            "{point}: {:?}",
            list_dir(&node.dirs.cdi)
        );

        // The kubelet's retry makes the instance again, and its unprepare takes it away.
        let outcome = node.prepare_retrying(std::slice::from_ref(&claim)).await;
        let devices = outcome[&claim.uid]
            .as_ref()
            .unwrap_or_else(|e| panic!("{point}: {e}"));
        let believed = [(claim.uid.clone(), cdi_ids(devices))].into();
        node.check_files(&believed)
            .unwrap_or_else(|p| panic!("{point}:\n{p}"));
        assert_eq!(mig_instances(&node.dirs.run).len(), 1);
        node.unprepare_retrying(std::slice::from_ref(&claim)).await;
        assert_eq!(mig_instances(&node.dirs.run), []);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_between_compute_and_gpu_instance_destruction_leaves_nothing_either() {
    let (mut node, claim) = node_with_a_mig_claim("node-kill-unprepare").await;
    node.start_driver_ok().await;
    node.prepare_retrying(std::slice::from_ref(&claim)).await;
    if let Started::Exited(status) = node
        .start_driver(Some("after-compute-instance-destroyed"))
        .await
    {
        panic!("the armed driver exited at start ({status})");
    }
    assert!(node
        .kubelet
        .unprepare("gpupool.dev", std::slice::from_ref(&claim))
        .await
        .is_err());
    assert!(node
        .wait_exit(Duration::from_secs(10))
        .await
        .as_ref()
        .is_some_and(killed));
    let left = mig_instances(&node.dirs.run);
    assert!(left.len() == 1 && left[0].2.is_empty(), "{left:?}");
    node.start_driver_ok().await;
    assert_eq!(mig_instances(&node.dirs.run), []);
    node.check_reconciled().unwrap_or_else(|p| panic!("{p}"));
    node.unprepare_retrying(std::slice::from_ref(&claim)).await;
    node.check_files(&Default::default())
        .unwrap_or_else(|p| panic!("{p}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_double_booked_card_is_refused_by_the_node_guard() {
    // What a scheduler that does not count partitionable devices can allocate: a fraction of
    // gpu-0 and a MIG device of gpu-0, both at once.
    let mut node = CrashNode::with_namespace("node-guard", "h100-80gb:2", "guard").await;
    let pool = node.name.clone();
    let fraction = node
        .create_claim_on("guard", "half", "gpu-0", Some(("8Gi", "50")))
        .await;
    let mig = node
        .create_allocated_claim(
            "guard",
            "small",
            vec![exclusive_result("gpu0", &pool, "gpu-0-mig-1g-10gb-0")],
            Vec::new(),
        )
        .await;
    let other_card = node
        .create_allocated_claim(
            "guard",
            "elsewhere",
            vec![exclusive_result("gpu0", &pool, "gpu-1-mig-1g-10gb-0")],
            Vec::new(),
        )
        .await;
    node.start_driver_ok().await;
    let first = node.prepare_retrying(std::slice::from_ref(&fraction)).await;
    assert!(first[&fraction.uid].is_ok(), "{:?}", first[&fraction.uid]);
    let second = node
        .prepare_retrying(&[mig.clone(), other_card.clone()])
        .await;
    let error = second[&mig.uid].as_ref().expect_err("refused").to_string();
    assert!(
        error.contains("claim guard/small: gpu-0-mig-1g-10gb-0 is a MIG partition")
            && error.contains("gpu-0 of claim guard/half")
            && error.contains("kube-scheduler >= 1.36.2"),
        "{error}"
    );
    assert!(second[&other_card.uid].is_ok(), "another card is fine");
    let instances = mig_instances(&node.dirs.run);
    assert_eq!(instances.len(), 1, "only the other card's: {instances:?}");
    let events = node.claim_events("guard", "small").await;
    assert!(
        events.iter().any(|e| e
            .message
            .as_deref()
            .is_some_and(|m| m.contains("MIG partition"))),
        "a PrepareFailed event on the claim: {events:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_reboot_a_mig_claim_gets_a_new_instance_and_the_same_ids() {
    let (mut node, claim) = node_with_a_mig_claim("node-mig-reboot").await;
    let pool = node.name.clone();
    let fraction = node
        .create_allocated_claim(
            "mig",
            "quarter",
            vec![result("gpu0", &pool, "gpu-0", Some("4Gi"), Some("10"))],
            Vec::new(),
        )
        .await;
    node.start_driver_ok().await;
    let before = node.prepare_retrying(std::slice::from_ref(&claim)).await;
    let ids_before = cdi_ids(before[&claim.uid].as_ref().unwrap());
    let uuid_before = mig_instances(&node.dirs.run);
    node.stop_driver().await;
    // A reboot: the run folder and the CDI folder are tmpfs; the cards lose their instances.
    for dir in [&node.dirs.cdi, &node.dirs.run] {
        for name in list_dir(dir) {
            let path = dir.join(&name);
            if path.is_dir() {
                std::fs::remove_dir_all(&path).unwrap();
            } else {
                std::fs::remove_file(&path).unwrap();
            }
        }
    }
    node.boot_id = uuid::Uuid::new_v4().to_string();
    node.start_driver_ok().await;
    assert!(
        list_dir(&node.dirs.cdi).is_empty(),
        "a MIG claim whose instance is gone is not written back"
    );
    let after = node.prepare_retrying(std::slice::from_ref(&claim)).await;
    assert_eq!(cdi_ids(after[&claim.uid].as_ref().unwrap()), ids_before);
    assert_eq!(mig_instances(&node.dirs.run).len(), 1);
    assert!(!uuid_before.is_empty());
    // The card's other use, a fraction, is refused while the MIG device is there (same card).
    let refused = node.prepare_retrying(std::slice::from_ref(&fraction)).await;
    assert!(refused[&fraction.uid].is_err());
}

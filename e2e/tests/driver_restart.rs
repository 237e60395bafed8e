//! The driver going away and coming back, as a DaemonSet rollout or a crash does it: SIGTERM removes its
//! sockets so the kubelet forgets it; a restart registers again; after a SIGKILL the claims prepared
//! before are still known (checkpoint) and unprepare cleanly; new pods are prepared.

mod common;

use common::*;
use gpupool_e2e::harness::objects::Request;
use gpupool_e2e::harness::{wait_for, Backend, NodeSpec, TestNode};

const DRIVER: &str = "gpupool.dev";

/// Waits until the claim's CDI spec is gone from the node (`what` names the wait).
async fn wait_unprepared(node: &TestNode, claim_uid: &str, what: &str) {
    wait_for(what, TIMEOUT, || async {
        (!node.cdi_spec_path(claim_uid).exists()).then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", node.driver_log()));
}

async fn restart_scenario(backend: Backend) {
    let cluster = start_node(NodeSpec::new("node-r", "a100-40gb:2"), backend).await;
    let node = cluster.node_at(0);
    let name = node.name.clone();
    let Some(kubelet) = &node.kubelet else {
        eprintln!("skipped: a real kubelet's registration is not observable from here");
        return;
    };
    apply_device_class(&cluster).await;
    let uuid = device_uuid(&cluster, &name, "gpu-0", 2).await;
    let ns = cluster.create_namespace("e2e-restart").await.unwrap();
    let request = || Request::new("gpu").on(&uuid).memory("2Gi").cores("10");
    apply_claim_and_pod(&cluster, &ns, "before", &[request()]).await;
    wait_pod_running(&cluster, &ns, "before").await;
    let before = claim(&cluster, &ns, "before").await;
    let before_uid = before.metadata.uid.clone().unwrap();
    let before_ids = prepared(node, &before_uid).await.devices;

    // SIGTERM: the driver exits on its own and takes its sockets with it.
    let status = cluster.stop_driver(&name).await.unwrap();
    assert!(
        status.is_some_and(|s| s.success()),
        "clean exit on SIGTERM: {status:?}\n{}",
        node.driver_log()
    );
    assert!(
        !node.dirs.registry.join("gpupool.dev-reg.sock").exists(),
        "registration socket removed"
    );
    assert!(
        !node.dirs.plugin.join("dra.sock").exists(),
        "DRA socket removed"
    );
    // An orderly stop folds the checkpoint's log into its snapshot: a driver from before the log
    // (a DaemonSet rolled back) finds every prepared claim in checkpoint.json alone.
    let log = std::fs::read_to_string(node.dirs.state.join("checkpoint.wal")).unwrap();
    assert_eq!(
        log.lines().count(),
        1,
        "only the log's header is left:\n{log}"
    );
    let snapshot: serde_json::Value =
        serde_json::from_slice(&std::fs::read(node.dirs.state.join("checkpoint.json")).unwrap())
            .unwrap();
    assert_eq!(
        snapshot["data"]["claims"][before_uid.as_str()]["state"],
        "PrepareCompleted",
        "{snapshot}"
    );
    wait_for("the kubelet to forget the driver", TIMEOUT, || async {
        kubelet.registration(DRIVER).is_none().then_some(())
    })
    .await
    .unwrap();

    let first = cluster
        .restart_driver(&name)
        .await
        .unwrap()
        .expect("registered");
    // SIGKILL: nothing is cleaned up; the restart must cope with the stale sockets and its checkpoint.
    cluster.kill_driver(&name).unwrap();
    let second = cluster
        .restart_driver(&name)
        .await
        .unwrap()
        .expect("registered");
    assert!(second.sequence > first.sequence);
    assert!(
        node.cdi_spec_path(&before_uid).is_file(),
        "a prepared claim survives a crash"
    );
    let again = kubelet
        .prepare(DRIVER, &[gpupool_api::claim::ClaimRef::of(&before)])
        .await
        .unwrap();
    assert_eq!(
        again[&before_uid].as_ref().unwrap(),
        &before_ids,
        "same answer after the restart"
    );

    apply_claim_and_pod(&cluster, &ns, "after", &[request()]).await;
    wait_pod_running(&cluster, &ns, "after").await;

    delete_pod(&cluster, &ns, "before").await;
    wait_unprepared(
        node,
        &before_uid,
        "the claim prepared before the crash to be unprepared",
    )
    .await;
    // A pod deleted while the driver is away: the kubelet keeps asking until the driver is back.
    let after = claim(&cluster, &ns, "after").await;
    let after_uid = after.metadata.uid.clone().unwrap();
    cluster.stop_driver(&name).await.unwrap();
    delete_pod(&cluster, &ns, "after").await;
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert!(
        node.cdi_spec_path(&after_uid).is_file(),
        "nobody could unprepare it yet"
    );
    cluster.restart_driver(&name).await.unwrap();
    wait_unprepared(
        node,
        &after_uid,
        "the claim to be unprepared once the driver is back",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_driver_restarts_after_sigterm_and_sigkill_without_losing_claims() {
    restart_scenario(Backend::Emulator).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs against GPUPOOL_E2E_KUBECONFIG"]
async fn driver_restart_real_cluster() {
    assert!(
        std::env::var_os("GPUPOOL_E2E_KUBECONFIG").is_some(),
        "needs GPUPOOL_E2E_KUBECONFIG and GPUPOOL_E2E_NODE"
    );
    restart_scenario(Backend::from_env()).await;
}

//! Two replicas of the real controller, as the Deployment runs them, elect one leader through the
//! Lease in the install's namespace on the real API server (and the emulator): only the leader
//! makes classes, and when it crashes (SIGKILL: its Lease is not handed back) the other takes the
//! Lease once it expires and carries on.

mod common;

use std::time::Duration;

use common::*;
use gpupool_e2e::harness::{wait_for, Backend, ClusterSpec, TestCluster, COMPONENT_NAMESPACE};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::resource::v1::DeviceClass;
use kube::Api;

const LEASE: &str = "gpupool-controller";
const REPLICA_B: &str = "replica-b";
/// The controller's default lease duration (10 s) plus its renew interval and a margin.
const TAKEOVER: Duration = Duration::from_secs(40);

on_both_backends!(one_replica_leads_and_the_other_takes_over_when_it_crashes);

/// (holder, transitions) of the Lease, once it has a holder.
async fn holder(cluster: &TestCluster) -> Option<(String, i32)> {
    let lease = Api::<Lease>::namespaced(cluster.client(), COMPONENT_NAMESPACE)
        .get_opt(LEASE)
        .await
        .ok()??;
    let spec = lease.spec?;
    Some((spec.holder_identity?, spec.lease_transitions.unwrap_or(0)))
}

async fn wait_class(cluster: &TestCluster, class: &str, what: &str) {
    let classes: Api<DeviceClass> = Api::all(cluster.client());
    wait_for(what, TIMEOUT, || async {
        classes.get_opt(class).await.ok().flatten()
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

async fn one_replica_leads_and_the_other_takes_over_when_it_crashes(backend: Backend) {
    let cluster = start(ClusterSpec::new().with_controller().on(backend)).await;
    let _logs = cluster.logs_on_failure();
    let (first, _) = wait_for("replica A to take the Lease", TIMEOUT, || holder(&cluster))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_ne!(first, REPLICA_B);
    let mut replica_b = cluster
        .spawn_controller(Some(REPLICA_B), "controller-b.log")
        .await
        .unwrap_or_else(|e| panic!("{e}"));

    // One leader: the first replica keeps the Lease while it renews, and makes the classes.
    cluster
        .apply_file(
            &gpupool_e2e::sandbox::examples_dir().join("gpumodels.yaml"),
            None,
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    wait_class(
        &cluster,
        "a100-sxm4-40gb.gpupool.dev",
        "the leader to make the A100 class",
    )
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (still, transitions) = holder(&cluster).await.expect("a holder");
    assert_eq!(still, first, "the Lease stays with a leader that renews");
    let follower_log = replica_b.log();
    assert!(
        follower_log.contains("gpupool-controller starting")
            && !follower_log.contains("became leader"),
        "replica B follows:\n{follower_log}"
    );

    // The leader crashes; replica B takes over once the Lease expires, and reconciles.
    cluster.kill_controller();
    let (next, next_transitions) = wait_for("replica B to take the Lease", TAKEOVER, || async {
        holder(&cluster).await.filter(|(h, _)| h == REPLICA_B)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\nreplica B:\n{}", replica_b.log()));
    assert_eq!(next, REPLICA_B);
    assert_eq!(next_transitions, transitions + 1, "one more transition");
    cluster
        .apply_yaml(
            "apiVersion: gpupool.dev/v1alpha1\nkind: GpuModel\nmetadata:\n  name: takeover-probe\n\
             spec:\n  model: TAKEOVER-PROBE\n  computeWeight: 10\n",
            "default",
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    wait_class(
        &cluster,
        "takeover-probe.gpupool.dev",
        "the new leader to make a new model's class",
    )
    .await;
    replica_b.stop(Duration::from_secs(10)).await;
}

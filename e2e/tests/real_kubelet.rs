//! The driver under the real kubelet v1.36.2 and containerd 2.4 ([`gpupool_e2e::plane::real_node`])
//! on the real control plane: the kubelet's plugin watcher registers it, NodePrepareResources comes
//! when the scheduler has placed a pod, containerd injects the claim's CDI device into a real
//! container, NodeUnprepareResources comes when the pod is gone, a driver killed under a running
//! pod is registered again and unprepares that pod's claim, a rolling update hands the node from
//! one driver pod to the next (pod-UID sockets), and the driver's health stream shows an XID in the
//! pod's status. Nothing here is the kubelet emulator. Root only; where `GPUPOOL_KUBE_REQUIRED=1` (CI) a skip is a failure.

mod common;

use std::time::Duration;

use common::*;
use gpupool_e2e::harness::objects::Request;
use gpupool_e2e::harness::{
    find_binary, plane_or_skip, wait_for, ClusterSpec, HarnessError, ManagedProcess, NodeSpec,
    TestCluster, TestNode,
};
use gpupool_e2e::plane::{binaries, PlaneError};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;

const NODE: &str = "node-real";
/// The real kubelet calls NodeUnprepareResources 2-3 s after a pod is gone, once its containers
/// have stopped; on a loaded machine it takes longer.
const UNPREPARE_TIMEOUT: Duration = Duration::from_secs(60);

const PROFILE: &str = "a100-40gb:2";

/// A cluster on the shared plane whose one node runs the real kubelet and containerd (the driver
/// with `driver_args` added), or `None` after saying why this machine cannot run one.
async fn real_node_cluster(test: &str, driver_args: &[&str]) -> Option<TestCluster> {
    plane_or_skip(test).await?;
    let mut node = NodeSpec::new(NODE, PROFILE).with_real_kubelet();
    node.extra_driver_args = driver_args.iter().map(|a| a.to_string()).collect();
    let spec = ClusterSpec::new().on_control_plane().with_node(node);
    match TestCluster::start(spec).await {
        Ok(cluster) => Some(cluster),
        Err(HarnessError::Plane(PlaneError::Unavailable(why))) if !binaries::required() => {
            println!("skipping {test}: {why}");
            None
        }
        Err(err) => panic!("{test}: {err}"),
    }
}

/// A pod of busybox (imported, never pulled) that prints its environment (and, for an MPS share,
/// whether the daemon's control socket is in the pipe folder it was given) and waits; it leaves at
/// once on SIGTERM, so that deleting it does not wait out a grace period.
fn pod_yaml(name: &str, claim: &str) -> String {
    format!(
        r#"apiVersion: v1
kind: Pod
metadata:
  name: {name}
spec:
  restartPolicy: Never
  dnsPolicy: Default
  terminationGracePeriodSeconds: 5
  resourceClaims:
  - name: gpu
    resourceClaimName: {claim}
  containers:
  - name: main
    image: docker.io/local/busybox:latest
    imagePullPolicy: Never
    command:
    - sh
    - -c
    - |
      env | sort
      if [ -n "${{CUDA_MPS_PIPE_DIRECTORY:-}}" ]; then
        if [ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ]; then echo mps-control=present; else echo mps-control=absent; fi
      fi
      echo printed-env
      trap 'exit 0' TERM
      sleep 3600 & wait
    resources:
      claims:
      - name: gpu
"#
    )
}

/// The environment the container printed, once it has.
async fn container_env(node: &TestNode, namespace: &str, pod: &str) -> Vec<String> {
    let output = wait_for(
        &format!("{namespace}/{pod}'s container to print its environment"),
        TIMEOUT,
        || async {
            node.real()
                .container_output(namespace, pod, "main")
                .filter(|out| out.contains("printed-env"))
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n--- kubelet ---\n{}", node.real().kubelet_log()));
    output.lines().map(String::from).collect()
}

async fn run_pod(cluster: &TestCluster, namespace: &str, name: &str) -> Vec<String> {
    apply(cluster, namespace, &pod_yaml(name, name)).await;
    wait_pod_running(cluster, namespace, name).await;
    container_env(cluster.node_at(0), namespace, name).await
}

/// Deletes the pod and waits for the real kubelet's unprepare: the claim's CDI spec gone from the
/// node and the driver's log saying so.
async fn delete_and_wait_unprepared(
    cluster: &TestCluster,
    namespace: &str,
    pod: &str,
    claim_uid: &str,
) {
    let node = cluster.node_at(0);
    delete_pod(cluster, namespace, pod).await;
    wait_for(
        &format!("the real kubelet to unprepare {namespace}/{pod}'s claim"),
        UNPREPARE_TIMEOUT,
        || async { (!node.cdi_spec_path(claim_uid).exists()).then_some(()) },
    )
    .await
    .unwrap_or_else(|e| {
        panic!(
            "{e}\n--- driver ---\n{}\n--- kubelet ---\n{}",
            node.driver_log(),
            node.real().kubelet_log()
        )
    });
    let pods: Api<Pod> = Api::namespaced(cluster.client(), namespace);
    wait_for(
        &format!("pod {namespace}/{pod} to be gone"),
        UNPREPARE_TIMEOUT,
        || async { pods.get_opt(pod).await.ok()?.is_none().then_some(()) },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

fn env_value<'a>(env: &'a [String], key: &str) -> Option<&'a str> {
    env.iter()
        .find_map(|line| line.strip_prefix(key)?.strip_prefix('='))
}

/// A share of a card, from scheduler to container: the real kubelet prepares it through the
/// driver's socket, containerd injects the CDI spec's environment into the container, the limits
/// are the claim's, the device is the one the scheduler allocated; and when the pod goes, the
/// kubelet unprepares it and the claim is deallocated.
#[tokio::test]
async fn a_share_reaches_a_real_container_and_is_unprepared_when_its_pod_goes() {
    const TEST: &str = "a_share_reaches_a_real_container_and_is_unprepared_when_its_pod_goes";
    let Some(cluster) = real_node_cluster(TEST, &[]).await else {
        return;
    };
    let _logs = cluster.logs_on_failure();
    let node = cluster.node_at(0);
    apply_device_class(&cluster).await;
    let ns = cluster.create_namespace("e2e-real-kubelet").await.unwrap();
    apply_claim(
        &cluster,
        &ns,
        "half",
        &[Request::new("gpu").memory("1Gi").cores("50")],
    )
    .await;

    let env = run_pod(&cluster, &ns, "half").await;
    let claim = claim(&cluster, &ns, "half").await;
    let claim_uid = claim.metadata.uid.clone().unwrap();
    let allocated = results(&claim);
    assert_eq!(allocated.len(), 1, "{allocated:?}");
    let device = &allocated[0].2;
    let uuid = device_uuid(&cluster, NODE, device, 2).await;
    assert_eq!(
        env_value(&env, "GPUPOOL_DEVICE_UUID_0"),
        Some(uuid.as_str()),
        "the container is given the allocated card {device}: {env:?}"
    );
    assert_eq!(
        env_value(&env, "CUDA_DEVICE_MEMORY_LIMIT_0"),
        Some("1024m"),
        "{env:?}"
    );
    assert_eq!(
        env_value(&env, "CUDA_DEVICE_SM_LIMIT_0"),
        Some("50"),
        "{env:?}"
    );
    assert!(
        node.cdi_spec_path(&claim_uid).exists(),
        "the claim's CDI spec is on the node while its pod runs"
    );
    // The driver's own status write, under its ServiceAccount, reached the claim.
    let entry = wait_for(
        "the driver's entry in the claim's status",
        TIMEOUT,
        || async { driver_status_entry(&cluster, &ns, "half").await },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(&entry.device, device, "{entry:?}");

    delete_and_wait_unprepared(&cluster, &ns, "half", &claim_uid).await;
    let claims: Api<ResourceClaim> = Api::namespaced(cluster.client(), &ns);
    wait_for(
        "the claim to be deallocated once its pod is gone",
        UNPREPARE_TIMEOUT,
        || async {
            let claim = claims.get("half").await.ok()?;
            claim
                .status
                .and_then(|s| s.allocation)
                .is_none()
                .then_some(())
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        node.driver_log().contains("unprepared claim"),
        "{}",
        node.driver_log()
    );
}

/// A driver killed (SIGKILL) under a running pod, as a crash or an OOM kill ends it: the real
/// kubelet's plugin watcher registers the restarted driver, the claim prepared before the crash
/// is unprepared by it when its pod goes, and a new pod is prepared.
#[tokio::test]
async fn a_driver_killed_under_a_running_pod_is_registered_again_and_unprepares_it() {
    const TEST: &str = "a_driver_killed_under_a_running_pod_is_registered_again_and_unprepares_it";
    let Some(cluster) = real_node_cluster(TEST, &[]).await else {
        return;
    };
    let _logs = cluster.logs_on_failure();
    let node = cluster.node_at(0);
    apply_device_class(&cluster).await;
    let ns = cluster.create_namespace("e2e-real-restart").await.unwrap();
    let share = || [Request::new("gpu").memory("2Gi").cores("20")];
    apply_claim(&cluster, &ns, "before", &share()).await;
    run_pod(&cluster, &ns, "before").await;
    let before_uid = claim(&cluster, &ns, "before").await.metadata.uid.unwrap();

    cluster.kill_driver(NODE).unwrap();
    cluster
        .restart_driver(NODE)
        .await
        .unwrap_or_else(|e| panic!("{e}\n--- kubelet ---\n{}", node.real().kubelet_log()));

    apply_claim(&cluster, &ns, "after", &share()).await;
    let env = run_pod(&cluster, &ns, "after").await;
    assert_eq!(
        env_value(&env, "CUDA_DEVICE_SM_LIMIT_0"),
        Some("20"),
        "{env:?}"
    );
    delete_and_wait_unprepared(&cluster, &ns, "before", &before_uid).await;
    let after_uid = claim(&cluster, &ns, "after").await.metadata.uid.unwrap();
    assert!(
        node.cdi_spec_path(&after_uid).exists(),
        "the other pod's claim stays prepared"
    );
    delete_and_wait_unprepared(&cluster, &ns, "after", &after_uid).await;
}

/// A DaemonSet rolling update on a real node: the old driver pod (its sockets named by its pod UID)
/// prepared a running pod's claim; the new pod's driver starts beside it on the same folders and
/// the real kubelet registers it; the old one is stopped (SIGTERM). The new driver prepares the
/// next pod and unprepares the claim the old one prepared: the node is handed over and no claim
/// is lost.
#[tokio::test]
async fn a_rolling_update_hands_the_real_kubelets_claims_to_the_new_driver_pod() {
    const TEST: &str = "a_rolling_update_hands_the_real_kubelets_claims_to_the_new_driver_pod";
    let old_uid = uuid::Uuid::new_v4().to_string();
    let Some(cluster) = real_node_cluster(TEST, &["--pod-uid", &old_uid]).await else {
        return;
    };
    let _logs = cluster.logs_on_failure();
    let node = cluster.node_at(0);
    apply_device_class(&cluster).await;
    let ns = cluster.create_namespace("e2e-real-upgrade").await.unwrap();
    let share = || [Request::new("gpu").memory("2Gi").cores("30")];
    apply_claim(&cluster, &ns, "old", &share()).await;
    run_pod(&cluster, &ns, "old").await;
    let prepared_line = |pod: &str| format!("prepared claim claim={ns}/{pod}");
    let unprepared_line = |pod: &str| format!("unprepared claim claim={ns}/{pod}");
    assert!(node.driver_log().contains(&prepared_line("old")));

    // The new pod's driver: its own pod UID, the node's folders, as the DaemonSet starts it.
    let new_uid = uuid::Uuid::new_v4().to_string();
    let kubeconfig = cluster.driver_kubeconfig(NODE).await.unwrap();
    let libs = cluster.workdir().join(NODE).join("libs");
    let program = find_binary("gpupool-driver").unwrap_or_else(|e| panic!("{e}"));
    let new_pod = ManagedProcess::new(
        "gpupool-driver (new pod)",
        &program,
        node.dirs.driver_run_args(NODE, &kubeconfig, PROFILE, &libs),
        cluster.workdir().join("driver-new-pod.log"),
    )
    .env("POD_UID", &new_uid)
    .started()
    .unwrap_or_else(|e| panic!("{e}"));
    wait_for(
        "the real kubelet to register the new pod's driver",
        TIMEOUT,
        || async {
            new_pod
                .log()
                .contains("registered with kubelet")
                .then_some(())
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}\n{}", new_pod.log(), node.real().kubelet_log()));
    let status = cluster.stop_driver(NODE).await.unwrap();
    assert!(
        status.is_some_and(|s| s.success()),
        "the old pod's driver exits cleanly on SIGTERM: {status:?}"
    );

    apply_claim(&cluster, &ns, "new", &share()).await;
    let env = run_pod(&cluster, &ns, "new").await;
    assert_eq!(
        env_value(&env, "CUDA_DEVICE_SM_LIMIT_0"),
        Some("30"),
        "{env:?}"
    );
    assert!(
        new_pod.log().contains(&prepared_line("new")),
        "the new pod's driver prepared the next claim:\n{}",
        new_pod.log()
    );
    let old_uid_of_claim = claim(&cluster, &ns, "old").await.metadata.uid.unwrap();
    delete_and_wait_unprepared(&cluster, &ns, "old", &old_uid_of_claim).await;
    assert!(
        new_pod.log().contains(&unprepared_line("old")),
        "the new pod's driver unprepared the claim the old one prepared:\n{}",
        new_pod.log()
    );
    let new_claim_uid = claim(&cluster, &ns, "new").await.metadata.uid.unwrap();
    delete_and_wait_unprepared(&cluster, &ns, "new", &new_claim_uid).await;
}

/// `allocatedResourcesStatus` of the pod's container, as the real kubelet writes it from the
/// driver's health stream: (the pod's claim entry, each resource's health).
async fn pod_health(cluster: &TestCluster, namespace: &str, pod: &str) -> Vec<(String, String)> {
    let pods: Api<Pod> = Api::namespaced(cluster.client(), namespace);
    let Ok(pod) = pods.get(pod).await else {
        return Vec::new();
    };
    pod.status
        .and_then(|s| s.container_statuses)
        .unwrap_or_default()
        .into_iter()
        .flat_map(|c| c.allocated_resources_status.unwrap_or_default())
        .flat_map(|entry| {
            entry
                .resources
                .unwrap_or_default()
                .into_iter()
                .map(move |r| (entry.name.clone(), r.health.unwrap_or_default()))
        })
        .collect()
}

/// A card's health as the real kubelet shows it: the driver's health stream makes the running
/// share's container report its device Healthy; an XID on that card (as `gpupool-driver
/// inject-xid` reports one) turns it Unhealthy in the pod's status, through the real kubelet.
#[tokio::test]
async fn an_xid_on_a_shares_card_shows_unhealthy_in_the_pods_status() {
    const TEST: &str = "an_xid_on_a_shares_card_shows_unhealthy_in_the_pods_status";
    let Some(cluster) = real_node_cluster(TEST, &[]).await else {
        return;
    };
    let _logs = cluster.logs_on_failure();
    let node = cluster.node_at(0);
    apply_device_class(&cluster).await;
    let ns = cluster.create_namespace("e2e-real-health").await.unwrap();
    apply_claim(
        &cluster,
        &ns,
        "trainer",
        &[Request::new("gpu").memory("4Gi").cores("25")],
    )
    .await;
    run_pod(&cluster, &ns, "trainer").await;
    let device = results(&claim(&cluster, &ns, "trainer").await)[0].2.clone();
    let health = |want: &'static str| {
        let ns = ns.clone();
        let cluster = &cluster;
        async move {
            let what = format!("the real kubelet to show the share's card {want}");
            let last = wait_for(&what, UNPREPARE_TIMEOUT, || async {
                let health = pod_health(cluster, &ns, "trainer").await;
                (health.iter().any(|(claim, _)| claim == "claim:gpu")
                    && health.iter().all(|(_, h)| h == want))
                .then_some(health)
            })
            .await;
            last.unwrap_or_else(|e| {
                panic!(
                    "{e}\n--- kubelet ---\n{}",
                    cluster.node_at(0).real().kubelet_log()
                )
            })
        }
    };
    health("Healthy").await;

    let binary = find_binary("gpupool-driver").unwrap_or_else(|e| panic!("{e}"));
    let out = std::process::Command::new(binary)
        .arg("inject-xid")
        .arg("--run-dir")
        .arg(&node.dirs.run)
        .args([device.as_str(), "79"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    health("Unhealthy").await;
}

/// An MPS share (`compute: Mps`) through the real kubelet and containerd, with the stand-in
/// `nvidia-cuda-mps-control`: the driver starts the card's daemon for the claim, containerd
/// mounts the daemon's pipe folder into the container (its control socket is there) and sets the
/// claim's SM percentage; when the pod goes, the kubelet unprepares the claim and the driver stops
/// the daemon, the card's last MPS claim gone.
#[tokio::test]
async fn an_mps_share_reaches_its_daemon_from_a_real_container() {
    const TEST: &str = "an_mps_share_reaches_its_daemon_from_a_real_container";
    const CONTROL: &str = "nvidia-cuda-mps-control";
    let standin = find_binary(CONTROL).unwrap_or_else(|e| {
        panic!("{e} (the stand-in: cargo build -p gpupool-standin-mps; cargo test --workspace builds it)")
    });
    let standin = standin.display().to_string();
    let Some(cluster) = real_node_cluster(TEST, &["--mps-control", &standin]).await else {
        return;
    };
    let _logs = cluster.logs_on_failure();
    let node = cluster.node_at(0);
    let _daemons = StopDaemonsOnFailure(node.dirs.run.clone());
    apply_device_class(&cluster).await;
    let ns = cluster.create_namespace("e2e-real-mps").await.unwrap();
    let mps = serde_json::json!({"apiVersion": "gpupool.dev/v1alpha1", "kind": "GpuConfig", "compute": "Mps"});
    apply_claim(
        &cluster,
        &ns,
        "mps",
        &[Request::new("gpu")
            .memory("4Gi")
            .cores("30")
            .gpu_config(mps)],
    )
    .await;
    let env = run_pod(&cluster, &ns, "mps").await;
    assert_eq!(
        env_value(&env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
        Some("30"),
        "{env:?}"
    );
    assert!(
        env_value(&env, "CUDA_MPS_PIPE_DIRECTORY").is_some(),
        "{env:?}"
    );
    assert_eq!(
        env_value(&env, "mps-control"),
        Some("present"),
        "the daemon's control socket is in the container's pipe folder: {env:?}"
    );
    let daemons = || gpupool_driver::mps::daemon::daemons_under(&node.dirs.run, CONTROL);
    assert_eq!(daemons().len(), 1, "one daemon for the card");

    let claim_uid = claim(&cluster, &ns, "mps").await.metadata.uid.unwrap();
    delete_and_wait_unprepared(&cluster, &ns, "mps", &claim_uid).await;
    wait_for(
        "the card's daemon to stop with its last claim",
        TIMEOUT,
        || async { daemons().is_empty().then_some(()) },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", node.driver_log()));
}

/// SIGKILLs the MPS daemons under a node's run folder when a test fails: a daemon outlives the
/// driver killed at the end of a failed test (on a node, the restarted driver adopts it).
struct StopDaemonsOnFailure(std::path::PathBuf);

impl Drop for StopDaemonsOnFailure {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        for pid in gpupool_driver::mps::daemon::daemons_under(&self.0, "nvidia-cuda-mps-control") {
            // SAFETY: kill(2) of a stand-in daemon this test's driver started, found just now.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

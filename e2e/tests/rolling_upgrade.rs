//! A DaemonSet rolling update with surge, over the real binaries: the old driver pod (A) serves the
//! node, the new one (B) starts beside it on the same folders and registers under its own pod UID,
//! A gets SIGTERM while kubelet calls are in flight on its socket, and B carries on: it prepares new
//! claims and unprepares A's. No claim is lost, no CDI spec is doubled or left behind, the node's
//! ResourceSlices are never deleted or rewritten, and the kubelet always has a driver to call.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use gpupool_api::claim::ClaimRef;
use gpupool_e2e::grpc::connect_unix;
use gpupool_e2e::harness::objects::Request;
use gpupool_e2e::harness::{find_binary, wait_for, Backend, NodeSpec, TestCluster, TestNode};
use gpupool_proto::dra_v1;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Patch, PatchParams, PostParams};
use kube::Api;
use serde_json::json;

const DRIVER: &str = gpupool_api::names::DRIVER_NAME;
const PROFILE: &str = "a100-40gb:2";
/// Concurrent callers on the old pod's socket, each preparing and unpreparing its own claim.
const CALLERS: usize = 4;

fn registration_socket(registry: &Path, pod_uid: &str) -> PathBuf {
    registry.join(format!("{DRIVER}-{pod_uid}-reg.sock"))
}

fn dra_socket(plugin: &Path, pod_uid: &str) -> PathBuf {
    plugin.join(format!("dra-{pod_uid}.sock"))
}

/// The new pod's driver, started by hand: it gets its pod UID from the environment, as the
/// DaemonSet gives it, and shares every folder with the old one.
struct NewPod {
    child: Option<Child>,
    log: PathBuf,
}

impl NewPod {
    async fn start(cluster: &TestCluster, pod_uid: &str, healthz_port: u16) -> NewPod {
        let node = cluster.node_at(0);
        let libs = cluster.workdir().join(&node.spec.name).join("libs");
        let kubeconfig = cluster
            .driver_kubeconfig(&node.name)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let log = cluster.workdir().join("driver-new-pod.log");
        let out = std::fs::File::create(&log).expect("creating the new pod's log");
        let err = out.try_clone().expect("cloning the log handle");
        let mut command =
            Command::new(find_binary("gpupool-driver").unwrap_or_else(|e| panic!("{e}")));
        command
            .args(
                node.dirs
                    .driver_run_args(&node.name, &kubeconfig, PROFILE, &libs),
            )
            .arg(format!("--healthz-addr=127.0.0.1:{healthz_port}"))
            .env("POD_UID", pod_uid)
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        // SAFETY: prctl is async-signal-safe; a test killed from outside leaves no driver behind.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        NewPod {
            child: Some(command.spawn().expect("starting the new pod's driver")),
            log,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    async fn stop(&mut self) -> Option<std::process::ExitStatus> {
        let mut child = self.child.take()?;
        terminate(child.id());
        wait_exit(&mut child, Duration::from_secs(15)).await
    }
}

impl Drop for NewPod {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            eprintln!("===== new pod's driver =====\n{}", self.log());
        }
    }
}

fn terminate(pid: u32) {
    // SAFETY: plain kill(2) on a child of this test.
    unsafe {
        libc::kill(pid as libc::pid_t, libc::SIGTERM);
    }
}

async fn wait_exit(child: &mut Child, timeout: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// The status code of `GET <path>` on the driver's health port, as a probe sees it.
async fn probe(port: u16, path: &str) -> Option<u16> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").as_bytes())
        .await
        .ok()?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.ok()?;
    String::from_utf8_lossy(&answer)
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// From the first registration on, the kubelet always had a gpupool plugin to call.
fn assert_no_gap(kubelet: &gpupool_e2e::kubelet::Kubelet) {
    let timeline = kubelet.registration_timeline(DRIVER);
    let gaps: Vec<_> = timeline
        .iter()
        .skip_while(|(_, socket)| socket.is_none())
        .filter(|(_, socket)| socket.is_none())
        .collect();
    assert!(
        gaps.is_empty(),
        "the kubelet had no plugin to call at {gaps:?} (timeline: {timeline:?})"
    );
}

/// A claim allocated 2Gi + 10% of `device`, written as the scheduler would, with no pod: only the
/// test's own calls prepare it.
async fn allocated_claim(
    cluster: &TestCluster,
    namespace: &str,
    name: &str,
    device: &str,
) -> ClaimRef {
    let node = &cluster.node_at(0).name;
    let claim: ResourceClaim = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"devices": {"requests": [
            {"name": "gpu", "exactly": {"deviceClassName": gpupool_e2e::harness::objects::E2E_CLASS}}
        ]}},
    }))
    .expect("claim literal");
    let api: Api<ResourceClaim> = Api::namespaced(cluster.client(), namespace);
    let created = api
        .create(&PostParams::default(), &claim)
        .await
        .unwrap_or_else(|e| panic!("creating claim {namespace}/{name}: {e}"));
    let result = json!({
        "request": "gpu", "driver": DRIVER, "pool": node, "device": device,
        "shareID": uuid::Uuid::new_v4().to_string(),
        "consumedCapacity": {"memory": "2Gi", "cores": "10"},
    });
    let patch = json!({"status": {"allocation": {"devices": {"results": [result]}}}});
    api.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap_or_else(|e| panic!("allocating claim {namespace}/{name}: {e}"));
    ClaimRef::of(&created)
}

/// What the kubelet knows of a claim after a call: the answer, or nothing when the call broke.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Known {
    Prepared(Vec<String>),
    Unprepared,
    /// The call was not answered: the kubelet asks again.
    Unknown,
}

/// One DRA call on the old pod's socket.
#[derive(Debug)]
struct Call {
    started: Instant,
    answered: Option<Instant>,
}

struct Callers {
    known: Mutex<BTreeMap<String, Known>>,
    calls: Mutex<Vec<Call>>,
    finished: AtomicUsize,
}

/// Prepares and unprepares `claim` over `socket` in turns until a call is not answered (the
/// socket is gone); records each answer as the kubelet would.
async fn call_until_refused(socket: PathBuf, claim: ClaimRef, book: Arc<Callers>) {
    let Ok(channel) = connect_unix(&socket, Duration::from_secs(45)).await else {
        return;
    };
    let mut client = dra_v1::dra_plugin_client::DraPluginClient::new(channel);
    let wire = dra_v1::Claim {
        namespace: claim.namespace.clone(),
        uid: claim.uid.clone(),
        name: claim.name.clone(),
    };
    for round in 0.. {
        let prepare = round % 2 == 0;
        let started = Instant::now();
        let index = {
            let mut calls = book.calls.lock().unwrap();
            calls.push(Call {
                started,
                answered: None,
            });
            calls.len() - 1
        };
        let known = if prepare {
            let request = dra_v1::NodePrepareResourcesRequest {
                claims: vec![wire.clone()],
            };
            match client.node_prepare_resources(request).await {
                Ok(answer) => {
                    let answer = &answer.into_inner().claims[&claim.uid];
                    assert!(
                        answer.error.is_empty(),
                        "prepare of {}: {}",
                        claim.name,
                        answer.error
                    );
                    Known::Prepared(
                        answer
                            .devices
                            .iter()
                            .flat_map(|d| d.cdi_device_ids.iter().cloned())
                            .collect(),
                    )
                }
                Err(_) => Known::Unknown,
            }
        } else {
            let request = dra_v1::NodeUnprepareResourcesRequest {
                claims: vec![wire.clone()],
            };
            match client.node_unprepare_resources(request).await {
                Ok(answer) => {
                    let error = &answer.into_inner().claims[&claim.uid].error;
                    assert!(error.is_empty(), "unprepare of {}: {error}", claim.name);
                    Known::Unprepared
                }
                Err(_) => Known::Unknown,
            }
        };
        let answered = known != Known::Unknown;
        if answered {
            book.calls.lock().unwrap()[index].answered = Some(Instant::now());
        }
        book.finished.fetch_add(1, Ordering::SeqCst);
        // A broken call leaves what the kubelet knew before it standing as unknown.
        book.known.lock().unwrap().insert(claim.uid.clone(), known);
        if !answered {
            return;
        }
    }
}

/// NodePrepareResources over `socket`, as the kubelet calls it; the CDI ids answered per claim UID.
async fn prepare_over(socket: &Path, claims: &[ClaimRef]) -> BTreeMap<String, Vec<String>> {
    let channel = connect_unix(socket, Duration::from_secs(45))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let request = dra_v1::NodePrepareResourcesRequest {
        claims: claims
            .iter()
            .map(|c| dra_v1::Claim {
                namespace: c.namespace.clone(),
                uid: c.uid.clone(),
                name: c.name.clone(),
            })
            .collect(),
    };
    let answer = dra_v1::dra_plugin_client::DraPluginClient::new(channel)
        .node_prepare_resources(request)
        .await
        .unwrap_or_else(|e| panic!("NodePrepareResources on {}: {e}", socket.display()))
        .into_inner();
    answer
        .claims
        .into_iter()
        .map(|(uid, r)| {
            assert!(r.error.is_empty(), "prepare of {uid}: {}", r.error);
            let ids = r
                .devices
                .into_iter()
                .flat_map(|d| d.cdi_device_ids)
                .collect();
            (uid, ids)
        })
        .collect()
}

/// Every gpupool CDI spec file's claim UID (one entry per file).
fn spec_files(cdi: &Path) -> Vec<String> {
    let prefix = format!("{DRIVER}-claim_");
    let mut uids: Vec<String> = std::fs::read_dir(cdi)
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| e.file_name().to_str().map(str::to_string))
                .filter_map(|n| Some(n.strip_prefix(&prefix)?.strip_suffix(".json")?.to_string()))
                .collect()
        })
        .unwrap_or_default();
    uids.sort();
    uids
}

/// Claim UIDs with a completed checkpoint entry, as a restarted driver would read them.
fn checkpointed(state: &Path) -> BTreeMap<String, Vec<String>> {
    let data = gpupool_driver::node_state::checkpoint::load(state)
        .expect("a readable checkpoint")
        .unwrap_or_default();
    data.claims
        .into_iter()
        .filter(|(_, e)| {
            e.state == gpupool_driver::node_state::checkpoint::ClaimState::PrepareCompleted
        })
        .map(|(uid, e)| {
            let ids = e
                .devices
                .into_iter()
                .flat_map(|d| d.cdi_device_ids)
                .collect();
            (uid, ids)
        })
        .collect()
}

/// Every claim the kubelet believes prepared has its spec and completed entry with the ids it was
/// answered, and nothing else is there: exactly one spec per prepared claim.
fn assert_files_match(
    node_dirs: &gpupool_e2e::harness::NodeDirs,
    believed: &BTreeMap<String, Vec<String>>,
    when: &str,
) {
    let specs = spec_files(&node_dirs.cdi);
    let expected: Vec<String> = believed.keys().cloned().collect();
    assert_eq!(
        specs, expected,
        "{when}: one CDI spec per prepared claim, no other"
    );
    let entries = checkpointed(&node_dirs.state);
    assert_eq!(
        &entries, believed,
        "{when}: checkpoint entries and their CDI ids"
    );
}

/// Deletes the pod and waits until its claim is unprepared; returns the claim's UID. The spec goes
/// first, the checkpoint entry last: the unprepare is over when both are gone.
async fn delete_and_wait_unprepared(
    cluster: &TestCluster,
    ns: &str,
    pod: &str,
    node: &TestNode,
    driver: &NewPod,
) -> String {
    let uid = claim(cluster, ns, pod).await.metadata.uid.unwrap();
    delete_pod(cluster, ns, pod).await;
    wait_for(
        &format!("{pod}'s claim to be unprepared"),
        TIMEOUT,
        || async {
            let done = !node.cdi_spec_path(&uid).exists()
                && !checkpointed(&node.dirs.state).contains_key(&uid);
            done.then_some(())
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", driver.log()));
    uid
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_update_hands_every_claim_over_without_a_gap() {
    let (uid_a, uid_b) = (
        uuid::Uuid::new_v4().to_string(),
        uuid::Uuid::new_v4().to_string(),
    );
    let mut old_pod = NodeSpec::new("node-u", PROFILE);
    old_pod.extra_driver_args = vec!["--pod-uid".into(), uid_a.clone()];
    let cluster = start_node(old_pod, Backend::Emulator).await;
    let node = cluster.node_at(0);
    let name = node.name.clone();
    let kubelet = node.kubelet();
    let apiserver = cluster.apiserver().expect("the emulator");
    let (reg_a, dra_a) = (
        registration_socket(&node.dirs.registry, &uid_a),
        dra_socket(&node.dirs.plugin, &uid_a),
    );
    let (reg_b, dra_b) = (
        registration_socket(&node.dirs.registry, &uid_b),
        dra_socket(&node.dirs.plugin, &uid_b),
    );
    let first = kubelet.registration(DRIVER).expect("registered");
    assert_eq!(
        (&first.socket, &first.endpoint),
        (&reg_a, &dra_a),
        "the old pod's sockets carry its UID"
    );

    apply_device_class(&cluster).await;
    let gpu0 = device_uuid(&cluster, &name, "gpu-0", 2).await;
    let ns = cluster.create_namespace("e2e-upgrade").await.unwrap();
    let request = || Request::new("gpu").on(&gpu0).memory("2Gi").cores("10");
    let mut believed: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut old_pods = Vec::new();
    for i in 0..3 {
        let pod = format!("old-{i}");
        apply_claim_and_pod(&cluster, &ns, &pod, &[request()]).await;
        old_pods.push(pod);
    }
    for pod in &old_pods {
        wait_pod_running(&cluster, &ns, pod).await;
        let uid = claim(&cluster, &ns, pod).await.metadata.uid.unwrap();
        believed.insert(uid.clone(), prepared(node, &uid).await.cdi_device_ids());
    }
    assert_files_match(&node.dirs, &believed, "prepared by the old pod");
    let slices_before = cluster.slices_of(&name).await.unwrap();
    let requests_before = apiserver.requests().len();

    // The new pod starts beside the old one; once ready (the DaemonSet's readiness probe) it is
    // the driver the kubelet calls.
    let healthz_port = free_port();
    let mut new_pod = NewPod::start(&cluster, &uid_b, healthz_port).await;
    wait_for("the new pod to be ready (/readyz 200)", TIMEOUT, || async {
        (probe(healthz_port, "/readyz").await == Some(200)).then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", new_pod.log()));
    let second = kubelet
        .registration(DRIVER)
        .expect("a ready driver is registered");
    assert_eq!(
        (&second.socket, &second.endpoint),
        (&reg_b, &dra_b),
        "a ready new pod is the one the kubelet calls"
    );

    // Two claims the old pod prepares after the new one started: the new one has never seen them.
    let handover = [
        allocated_claim(&cluster, &ns, "handover-0", "gpu-1").await,
        allocated_claim(&cluster, &ns, "handover-1", "gpu-1").await,
    ];
    for (uid, ids) in prepare_over(&dra_a, &handover).await {
        believed.insert(uid, ids);
    }

    // Calls in flight on the old pod's socket (a kubelet call that began before the switch).
    let mut inflight_claims = Vec::new();
    for i in 0..CALLERS {
        inflight_claims
            .push(allocated_claim(&cluster, &ns, &format!("inflight-{i}"), "gpu-1").await);
    }
    let book = Arc::new(Callers {
        known: Mutex::new(BTreeMap::new()),
        calls: Mutex::new(Vec::new()),
        finished: AtomicUsize::new(0),
    });
    let callers: Vec<_> = inflight_claims
        .iter()
        .map(|c| tokio::spawn(call_until_refused(dra_a.clone(), c.clone(), book.clone())))
        .collect();
    wait_for("a few answered calls on the old pod", TIMEOUT, || async {
        (book.finished.load(Ordering::SeqCst) >= 3 * CALLERS).then_some(())
    })
    .await
    .unwrap();

    // The new pod takes a turn on the shared folders (as it does for each of its calls) and
    // holds it, so the old pod's calls are certainly in flight when SIGTERM lands.
    let lock_path = node.dirs.plugin.join("serialize.lock");
    let turn = tokio::task::spawn_blocking(move || {
        use std::os::fd::AsRawFd;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .unwrap();
        // SAFETY: flock on a descriptor this closure owns.
        assert_eq!(unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) }, 0);
        file
    })
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let old_pid = node.driver().pid().expect("the old pod runs");
    let signalled = Instant::now();
    terminate(old_pid);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let in_flight = book
        .calls
        .lock()
        .unwrap()
        .iter()
        .filter(|c| c.started < signalled && c.answered.is_none())
        .count();
    assert!(
        in_flight > 0,
        "calls were in flight on the old pod at SIGTERM"
    );
    assert!(
        node.driver().is_running(),
        "the old pod waits for its calls in flight"
    );
    drop(turn);

    let status = cluster.stop_driver(&name).await.unwrap();
    assert!(
        status.is_some_and(|s| s.success()),
        "the old pod exits cleanly: {status:?}\n{}",
        node.driver_log()
    );
    for caller in callers {
        caller.await.unwrap();
    }
    let (calls, answered_after) = {
        let calls = book.calls.lock().unwrap();
        let answered_after = calls
            .iter()
            .filter(|c| c.started < signalled && c.answered.is_some_and(|a| a > signalled))
            .count();
        (calls.len(), answered_after)
    };
    println!(
        "{calls} calls on the old pod, {in_flight} in flight at SIGTERM, {answered_after} of them answered after it"
    );
    assert_eq!(
        answered_after, in_flight,
        "every call in flight at SIGTERM got its answer"
    );
    assert!(
        !reg_a.exists() && !dra_a.exists(),
        "the old pod removed its sockets"
    );
    assert!(
        reg_b.exists() && dra_b.exists(),
        "the new pod's sockets are there"
    );
    assert_eq!(
        kubelet.registration(DRIVER).map(|r| r.socket),
        Some(reg_b.clone()),
        "the kubelet calls the new pod"
    );

    // The new pod's first call: unprepare a claim only the old pod knew it had prepared.
    let unprepared = kubelet.unprepare(DRIVER, &handover[..1]).await.unwrap();
    assert!(unprepared.values().all(Result::is_ok), "{unprepared:?}");
    believed.remove(&handover[0].uid);
    assert!(
        !node.cdi_spec_path(&handover[0].uid).exists(),
        "the new pod removed the old pod's spec"
    );
    assert!(
        !checkpointed(&node.dirs.state).contains_key(&handover[0].uid),
        "and its checkpoint entry"
    );

    // What the kubelet knows of the in-flight claims; a call that broke is asked again, now of
    // the new pod, as the kubelet retries.
    let known = book.known.lock().unwrap().clone();
    for claim in &inflight_claims {
        match known.get(&claim.uid).cloned().unwrap_or(Known::Unknown) {
            Known::Prepared(ids) => {
                believed.insert(claim.uid.clone(), ids);
            }
            Known::Unprepared => {}
            Known::Unknown => {
                let outcome = kubelet
                    .prepare(DRIVER, std::slice::from_ref(claim))
                    .await
                    .unwrap();
                let devices = outcome[&claim.uid].clone().unwrap();
                believed.insert(
                    claim.uid.clone(),
                    devices.into_iter().flat_map(|d| d.cdi_device_ids).collect(),
                );
            }
        }
    }
    assert_files_match(&node.dirs, &believed, "after the old pod left");

    // A claim the old pod prepared gets the same answer from the new one.
    for claim in inflight_claims
        .iter()
        .chain(&handover[1..])
        .filter(|c| believed.contains_key(&c.uid))
    {
        let outcome = kubelet
            .prepare(DRIVER, std::slice::from_ref(claim))
            .await
            .unwrap();
        let ids: Vec<String> = outcome[&claim.uid]
            .clone()
            .unwrap()
            .into_iter()
            .flat_map(|d| d.cdi_device_ids)
            .collect();
        assert_eq!(
            ids, believed[&claim.uid],
            "{}: the same CDI ids",
            claim.name
        );
    }

    // The new pod prepares new pods' claims and unprepares the old pod's.
    for i in 0..2 {
        let pod = format!("new-{i}");
        apply_claim_and_pod(&cluster, &ns, &pod, &[request()]).await;
        wait_pod_running(&cluster, &ns, &pod).await;
        let uid = claim(&cluster, &ns, &pod).await.metadata.uid.unwrap();
        believed.insert(uid.clone(), prepared(node, &uid).await.cdi_device_ids());
    }
    for pod in &old_pods {
        let uid = delete_and_wait_unprepared(&cluster, &ns, pod, node, &new_pod).await;
        believed.remove(&uid);
    }
    assert_files_match(&node.dirs, &believed, "after the new pod took over");

    // Everything unprepared: nothing left behind.
    let rest: Vec<ClaimRef> = inflight_claims
        .iter()
        .chain(&handover[1..])
        .cloned()
        .collect();
    let unprepare = kubelet.unprepare(DRIVER, &rest).await.unwrap();
    assert!(unprepare.values().all(Result::is_ok), "{unprepare:?}");
    for claim in &rest {
        believed.remove(&claim.uid);
    }
    for i in 0..2 {
        let pod = format!("new-{i}");
        let uid = delete_and_wait_unprepared(&cluster, &ns, &pod, node, &new_pod).await;
        believed.remove(&uid);
    }
    assert!(believed.is_empty());
    assert_files_match(&node.dirs, &believed, "after every claim was unprepared");

    assert_no_gap(kubelet);

    // The slices were never deleted, and neither pod rewrote them: same objects, same generation.
    let slice_writes: Vec<String> = apiserver.requests()[requests_before..]
        .iter()
        .filter(|r| r.method != "GET" && r.path.contains("/resourceslices"))
        .map(|r| format!("{} {}", r.method, r.path))
        .collect();
    let deletes = apiserver
        .requests()
        .iter()
        .filter(|r| r.method == "DELETE" && r.path.contains("/resourceslices"))
        .count();
    println!("ResourceSlice DELETEs: {deletes}; writes during the overlap: {slice_writes:?}");
    assert_eq!(deletes, 0, "no ResourceSlice deleted");
    assert!(slice_writes.is_empty(), "{slice_writes:?}");
    let versions = |slices: &[k8s_openapi::api::resource::v1::ResourceSlice]| {
        slices
            .iter()
            .map(|s| {
                (
                    s.metadata.name.clone(),
                    s.metadata.resource_version.clone(),
                    s.spec.pool.generation,
                )
            })
            .collect::<BTreeSet<_>>()
    };
    assert_eq!(
        versions(&cluster.slices_of(&name).await.unwrap()),
        versions(&slices_before),
        "the node's slices are the ones the old pod published"
    );

    let status = new_pod.stop().await;
    assert!(
        status.is_some_and(|s| s.success()),
        "{status:?}\n{}",
        new_pod.log()
    );
    assert!(
        !reg_b.exists() && !dra_b.exists(),
        "the new pod removed its sockets when it stopped"
    );
    assert_eq!(
        cluster.slices_of(&name).await.unwrap().len(),
        slices_before.len(),
        "a stopping driver leaves the node's slices"
    );
}

/// The switch as a DaemonSet drives it: the old pod goes the moment the new one is ready (0.03 s
/// after, on a real node). The kubelet emulator reconciles registrations every 500 ms here (the
/// real kubelet's plugin manager does once a second), so a driver that called itself ready before
/// the kubelet had registered it would leave the node without a plugin, as one did on a real node
/// (0.32 s without, when readiness meant "slices published").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_old_pod_goes_when_the_new_one_is_ready_and_the_kubelet_always_has_a_plugin() {
    let (uid_a, uid_b) = (
        uuid::Uuid::new_v4().to_string(),
        uuid::Uuid::new_v4().to_string(),
    );
    let mut old_pod = NodeSpec::new("node-r", PROFILE);
    old_pod.extra_driver_args = vec!["--pod-uid".into(), uid_a.clone()];
    old_pod.kubelet_poll_interval = Some(Duration::from_millis(500));
    let cluster = start_node(old_pod, Backend::Emulator).await;
    let node = cluster.node_at(0);
    let name = node.name.clone();
    let kubelet = node.kubelet();
    let reg_b = registration_socket(&node.dirs.registry, &uid_b);

    let port = free_port();
    let mut new_pod = NewPod::start(&cluster, &uid_b, port).await;
    // The DaemonSet controller: probe the new pod's readiness, remove the old pod once it passes.
    wait_for("the new pod to be ready (/readyz 200)", TIMEOUT, || async {
        (probe(port, "/readyz").await == Some(200)).then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", new_pod.log()));
    terminate(node.driver().pid().expect("the old pod runs"));
    let status = cluster.stop_driver(&name).await.unwrap();
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
    // Two reconciliations: the kubelet has seen the old pod's socket go.
    tokio::time::sleep(Duration::from_millis(1200)).await;

    assert_no_gap(kubelet);
    assert_eq!(
        kubelet.registration(DRIVER).map(|r| r.socket),
        Some(reg_b),
        "the kubelet calls the new pod"
    );
    let status = new_pod.stop().await;
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
}

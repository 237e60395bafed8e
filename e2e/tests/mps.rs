//! MPS shares (`compute: Mps`) over the real driver binary and the kubelet emulator, with the
//! stand-in `nvidia-cuda-mps-control` (driver/standin/mps): one control daemon per card, started
//! with the first claim and stopped with the last, clients that reach it with what the claim's
//! CDI spec gives them, the node guard, and crash safety: SIGKILL of the driver at every step of
//! the daemon's life, and of the daemon itself, leaves no daemon, server, folder or claim behind.

mod crash_support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crash_support::*;
use gpupool_api::claim::ClaimRef;
use gpupool_driver::mps::daemon::{daemons_under, processes_under};
use gpupool_driver::mps::layout::{mps_root, DaemonDirs};
use gpupool_driver::node_state::fault::MPS_FAULT_POINTS;
use gpupool_e2e::harness::find_binary;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;
use serde_json::{json, Value};

const NAMESPACE: &str = "mps";
const GPUS: &str = "a100-40gb:2";
const CONTROL: &str = "nvidia-cuda-mps-control";
const SERVER: &str = "nvidia-cuda-mps-server";

fn standin() -> PathBuf {
    find_binary(CONTROL).unwrap_or_else(|e| {
        panic!("{e} (the stand-in: cargo build -p gpupool-standin-mps; cargo test --workspace builds it)")
    })
}

fn mps_config() -> Value {
    opaque_config(
        &["gpu0"],
        json!({"apiVersion": "gpupool.dev/v1alpha1", "kind": "GpuConfig", "compute": "Mps"}),
    )
}

/// A node whose driver runs the stand-in as `nvidia-cuda-mps-control`; every daemon and server
/// of its folders is killed when the test ends, whatever happened.
struct MpsNode {
    node: CrashNode,
    control: PathBuf,
}

impl Drop for MpsNode {
    fn drop(&mut self) {
        for pid in daemons_under(&self.node.dirs.run, CONTROL)
            .into_iter()
            .chain(processes_under(&self.node.dirs.run, SERVER))
        {
            // SAFETY: kill(2) of a stand-in process this test's node started.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

impl MpsNode {
    async fn new(name: &str) -> MpsNode {
        let node = CrashNode::with_namespace(name, GPUS, NAMESPACE).await;
        // Traversable by every user, as a node's /var/run is: clients of other users reach the
        // pipe folder under it (a container runtime makes the path's parents in the container).
        for dir in node.host_root().ancestors().take(2) {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711)).unwrap();
        }
        MpsNode {
            node,
            control: standin(),
        }
    }

    async fn start(&mut self, fault: Option<&str>) -> Started {
        let control = self.control.display().to_string();
        let mut env = vec![("MPS_CONTROL", control.as_str())];
        if let Some(point) = fault {
            env.push((FAULT_POINT_ENV, point));
        }
        self.node.start_driver_with(&env).await
    }

    async fn start_ok(&mut self) {
        if let Started::Exited(status) = self.start(None).await {
            panic!("the driver exited at start ({status})\n{}", self.node.log());
        }
    }

    /// An MPS claim of (memory, cores) of `device`.
    async fn share(&self, name: &str, device: &str, cores: &str) -> ClaimRef {
        let results = vec![result(
            "gpu0",
            &self.node.name,
            device,
            Some("8Gi"),
            Some(cores),
        )];
        self.node
            .create_allocated_claim(NAMESPACE, name, results, vec![mps_config()])
            .await
    }

    async fn prepare(&self, claim: &ClaimRef) -> Result<Vec<String>, String> {
        let outcome = self
            .node
            .prepare_retrying(std::slice::from_ref(claim))
            .await;
        outcome[&claim.uid]
            .as_ref()
            .map(|devices| cdi_ids(devices))
            .map_err(|e| e.to_string())
    }

    async fn unprepare(&self, claim: &ClaimRef) {
        let outcome = self
            .node
            .unprepare_retrying(std::slice::from_ref(claim))
            .await;
        if let Err(e) = &outcome[&claim.uid] {
            panic!("unprepare of {}: {e}\n{}", claim.name, self.node.log());
        }
    }

    fn checkpoint_mps(&self) -> BTreeMap<String, Value> {
        self.node
            .checkpoint()
            .and_then(|c| c["mps"].as_object().cloned())
            .map(|m| m.into_iter().collect())
            .unwrap_or_default()
    }

    fn card(&self, index: usize) -> String {
        gpupool_driver::inventory::discover(Some(GPUS), &self.node.name)
            .unwrap()
            .gpus[index]
            .uuid
            .clone()
    }

    fn dirs(&self, card: &str) -> DaemonDirs {
        DaemonDirs::of(&self.node.dirs.run, card).unwrap()
    }

    fn control_log(&self, card: &str) -> String {
        std::fs::read_to_string(self.dirs(card).log.join("control.log")).unwrap_or_default()
    }

    /// The card's daemon as recorded: its pid, checked to be running.
    fn daemon_pid(&self, card: &str) -> i32 {
        let record = &self.checkpoint_mps()[card];
        assert_eq!(record["state"], "Running", "{record}");
        let pid = record["pid"].as_i64().expect("a pid") as i32;
        assert!(
            daemons_under(&self.node.dirs.run, CONTROL).contains(&pid),
            "daemon {pid} is not running"
        );
        pid
    }

    /// What must hold whenever the driver is idle: a running daemon for exactly the cards that
    /// the prepared MPS claims (`believed`) hold, each recorded with its pid; no other daemon,
    /// no server of a daemon that is gone, no folder without its daemon.
    fn check_daemons(&self, believed: &BTreeMap<String, String>) -> Result<(), String> {
        let mut problems = Vec::new();
        let records = self.checkpoint_mps();
        let wanted: BTreeSet<&String> = believed.values().collect();
        let recorded: BTreeSet<&String> = records.keys().collect();
        if wanted != recorded {
            problems.push(format!(
                "daemons recorded for {recorded:?}, the prepared MPS claims hold {wanted:?}"
            ));
        }
        let running = daemons_under(&self.node.dirs.run, CONTROL);
        let mut pids = BTreeSet::new();
        for (card, record) in &records {
            let pid = record["pid"].as_i64().unwrap_or(-1) as i32;
            if record["state"] != "Running" || !running.contains(&pid) {
                problems.push(format!(
                    "{card}: record {record}, but running daemons are {running:?}"
                ));
            }
            pids.insert(pid);
        }
        for pid in &running {
            if !pids.contains(pid) {
                problems.push(format!("daemon {pid} runs without a record"));
            }
        }
        let servers = processes_under(&self.node.dirs.run, SERVER);
        for server in servers {
            let parent = parent_of(server);
            if !pids.contains(&parent) {
                problems.push(format!(
                    "server {server} left by a daemon that is gone (parent {parent})"
                ));
            }
        }
        let folders: BTreeSet<String> = list_dir(&mps_root(&self.node.dirs.run))
            .into_iter()
            .collect();
        let expected: BTreeSet<String> = records.keys().cloned().collect();
        if folders != expected {
            problems.push(format!("MPS folders {folders:?}, records {expected:?}"));
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems.join("\n"))
        }
    }

    /// A CUDA client (the stand-in's) in what the claim's CDI spec gives a container.
    fn client(&self, claim: &ClaimRef, cdi_id: &str, uid: Option<u32>) -> Value {
        let spec = self
            .node
            .dirs
            .cdi
            .join(gpupool_api::names::cdi_spec_file_name(&claim.uid));
        let check = find_binary("gpupool-mps-check").unwrap_or_else(|e| panic!("{e}"));
        let mut command = std::process::Command::new(check);
        command
            .arg("exec")
            .arg("--spec")
            .arg(&spec)
            .arg("--device")
            .arg(cdi_id);
        if let Some(uid) = uid {
            command.arg("--uid").arg(uid.to_string());
        }
        let out = command
            .arg("--")
            .arg(&self.control)
            .arg("--standin-cuda-client")
            .output()
            .expect("gpupool-mps-check exec runs");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "client of {}: {stdout}{}",
            claim.name,
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"))
    }

    async fn ready_condition(&self, claim: &ClaimRef) -> Option<(String, String, String)> {
        let api: Api<ResourceClaim> = Api::namespaced(self.node.client.clone(), NAMESPACE);
        let object = api.get(&claim.name).await.ok()?;
        let entry = object.status?.devices?.into_iter().next()?;
        let ready = entry.conditions?.into_iter().find(|c| c.type_ == "Ready")?;
        Some((ready.status, ready.reason, ready.message))
    }

    /// The claim's Ready condition once its status is `status`.
    async fn wait_ready(&self, claim: &ClaimRef, status: &str) -> (String, String, String) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match self.ready_condition(claim).await {
                Some(ready) if ready.0 == status => return ready,
                other => assert!(
                    Instant::now() < deadline,
                    "{}: Ready is {other:?}, waited for {status}\n{}",
                    claim.name,
                    self.node.log()
                ),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

fn parent_of(pid: i32) -> i32 {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')?
                .1
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()
        })
        .unwrap_or(-1)
}

async fn wait_until<T>(what: &str, timeout: Duration, mut done: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = done() {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_shares_use_one_daemon_started_with_the_first_and_stopped_with_the_last() {
    let mut mps = MpsNode::new("node-mps-life").await;
    mps.start_ok().await;
    let (thirty, seventy) = (
        mps.share("thirty", "gpu-0", "30").await,
        mps.share("seventy", "gpu-0", "70").await,
    );
    let card = mps.card(0);
    assert!(
        mps.checkpoint_mps().is_empty(),
        "no daemon before an MPS claim"
    );

    let ids30 = mps.prepare(&thirty).await.unwrap();
    let pid = mps.daemon_pid(&card);
    let log = mps.control_log(&card);
    for line in [
        format!("CUDA_VISIBLE_DEVICES={card}"),
        "Multi-user server: on".to_string(),
        "CMD set_default_active_thread_percentage 30".to_string(),
        "CMD set_default_device_pinned_mem_limit 0 8192M".to_string(),
    ] {
        assert!(log.contains(&line), "{line} missing from\n{log}");
    }
    let client = mps.client(&thirty, &ids30[0], None);
    assert_eq!(client["mps"], true, "{client}");
    assert_eq!(client["activeThreadPercentage"], 30.0);

    let ids70 = mps.prepare(&seventy).await.unwrap();
    assert_eq!(
        mps.daemon_pid(&card),
        pid,
        "the second share joins the card's daemon"
    );
    // The running server's ceiling rises to the larger share; a client of another user (-M)
    // gets its own share through the same server.
    let server = mps.client(&seventy, &ids70[0], Some(65534));
    assert_eq!(server["mps"], true, "{server}");
    assert_eq!(server["activeThreadPercentage"], 70.0);
    assert_eq!(server["server"], client["server"]);
    let log = mps.control_log(&card);
    assert!(
        log.contains(&format!(
            "CMD set_active_thread_percentage {} 70",
            client["server"]
        )),
        "{log}"
    );
    let (_, reason, message) = mps.wait_ready(&seventy, "True").await;
    assert_eq!(
        reason, "PreparedNotEnforced",
        "no enforcement library on this node"
    );
    assert!(message.contains("70% of the SMs through MPS"), "{message}");
    let believed = BTreeMap::from([
        (thirty.uid.clone(), card.clone()),
        (seventy.uid.clone(), card.clone()),
    ]);
    mps.check_daemons(&believed).unwrap();

    mps.unprepare(&seventy).await;
    assert_eq!(
        mps.daemon_pid(&card),
        pid,
        "the daemon stays while a share holds the card"
    );
    assert!(mps.control_log(&card).ends_with(&format!(
        "CMD set_device_pinned_mem_limit {} 0 8192M\n",
        client["server"]
    )));
    mps.unprepare(&thirty).await;
    mps.check_daemons(&BTreeMap::new()).unwrap();
    assert!(processes_under(&mps.node.dirs.run, SERVER).is_empty());
    mps.node.check_files(&BTreeMap::new()).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mps_and_other_shares_never_share_a_card_and_bad_mps_claims_name_the_field() {
    let mut mps = MpsNode::new("node-mps-guard").await;
    mps.start_ok().await;
    let thirty = mps.share("thirty", "gpu-0", "30").await;
    mps.prepare(&thirty).await.unwrap();
    let limited = mps
        .node
        .create_claim_on(NAMESPACE, "limited", "gpu-0", Some(("8Gi", "50")))
        .await;
    let e = mps.prepare(&limited).await.unwrap_err();
    assert!(
        e.contains("gpu-0 is a share without MPS, and the card is shared through MPS as gpu-0 of claim mps/thirty"),
        "{e}"
    );
    let elsewhere = mps
        .node
        .create_claim_on(NAMESPACE, "elsewhere", "gpu-1", Some(("8Gi", "50")))
        .await;
    mps.prepare(&elsewhere).await.unwrap();
    let mps_there = mps.share("mps-there", "gpu-1", "20").await;
    let e = mps.prepare(&mps_there).await.unwrap_err();
    assert!(e.contains("gpu-1 is an MPS share"), "{e}");
    let no_cores = mps
        .node
        .create_allocated_claim(
            NAMESPACE,
            "no-cores",
            vec![result("gpu0", &mps.node.name, "gpu-0", Some("8Gi"), None)],
            vec![mps_config()],
        )
        .await;
    let e = mps.prepare(&no_cores).await.unwrap_err();
    assert!(
        e.contains(
            "config[0].opaque.parameters.compute: Mps, but the share of gpu-0 reserves no SMs"
        ),
        "{e}"
    );
    // The refused claims left nothing: one daemon, for the one MPS claim.
    let believed = BTreeMap::from([(thirty.uid.clone(), mps.card(0))]);
    mps.check_daemons(&believed).unwrap();
    mps.unprepare(&thirty).await;
    mps.unprepare(&elsewhere).await;
    mps.check_daemons(&BTreeMap::new()).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_restart_adopts_the_daemon_and_a_killed_daemon_is_started_again() {
    let mut mps = MpsNode::new("node-mps-restart").await;
    mps.start_ok().await;
    let thirty = mps.share("thirty", "gpu-0", "30").await;
    let ids = mps.prepare(&thirty).await.unwrap();
    let card = mps.card(0);
    let pid = mps.daemon_pid(&card);
    // A client attached: its daemon has a server. The claim's status is written (half a second
    // after the prepare) before the driver is killed.
    mps.client(&thirty, &ids[0], None);
    mps.wait_ready(&thirty, "True").await;

    mps.node.kill_driver();
    mps.start_ok().await;
    assert_eq!(
        mps.daemon_pid(&card),
        pid,
        "the restarted driver adopts the daemon"
    );
    assert!(mps
        .node
        .log()
        .contains("adopting the running MPS control daemon"));

    let servers = processes_under(&mps.node.dirs.run, SERVER);
    assert_eq!(servers.len(), 1, "{servers:?}");
    // SAFETY: kill(2) of the stand-in daemon this test's driver started.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let restarted = wait_until(
        "the daemon to be started again",
        Duration::from_secs(20),
        || {
            let record = mps.checkpoint_mps().get(&card).cloned()?;
            let new = record["pid"].as_i64()? as i32;
            (new != pid && record["state"] == "Running").then_some((new, record))
        },
    )
    .await;
    assert_eq!(restarted.1["restarts"], 1, "{}", restarted.1);
    assert!(
        !processes_under(&mps.node.dirs.run, SERVER).contains(&servers[0]),
        "the server the killed daemon left is gone"
    );
    let believed = BTreeMap::from([(thirty.uid.clone(), card.clone())]);
    mps.check_daemons(&believed).unwrap();
    let (_, reason, message) = mps.wait_ready(&thirty, "False").await;
    assert_eq!(reason, "DeviceUnhealthy");
    assert!(
        message.contains(&format!(
            "MPS control daemon of {card} (pid {pid}) had exited"
        )),
        "{message}"
    );
    // New processes get MPS again.
    assert_eq!(mps.client(&thirty, &ids[0], None)["mps"], true);
    mps.unprepare(&thirty).await;
    mps.check_daemons(&BTreeMap::new()).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_at_every_step_of_the_daemons_life_leaves_nothing_behind() {
    let mut mps = MpsNode::new("node-mps-crash").await;
    mps.start_ok().await;
    let card = mps.card(0);
    let prepare_points: Vec<&str> = MPS_FAULT_POINTS
        .iter()
        .copied()
        .filter(|p| !p.contains("stop"))
        .chain([
            "after-prepare-started",
            "after-spec-renamed",
            "after-prepare-completed",
        ])
        .collect();
    let unprepare_points: Vec<&str> = MPS_FAULT_POINTS
        .iter()
        .copied()
        .filter(|p| p.contains("stop"))
        .chain(["mid-unprepare"])
        .collect();
    for (i, point) in prepare_points.iter().chain(&unprepare_points).enumerate() {
        let first = mps.share(&format!("first-{i}"), "gpu-0", "30").await;
        let second = mps.share(&format!("second-{i}"), "gpu-0", "40").await;
        let on_prepare = prepare_points.contains(point);
        if !on_prepare {
            mps.prepare(&first).await.unwrap();
        }
        mps.start(Some(point)).await;
        let killed_at = if on_prepare {
            mps.node
                .kubelet
                .prepare(DRIVER, std::slice::from_ref(&first))
                .await
                .map(|_| ())
        } else {
            mps.node
                .kubelet
                .unprepare(DRIVER, std::slice::from_ref(&first))
                .await
                .map(|_| ())
        };
        assert!(killed_at.is_err(), "{point}: the call returned");
        let status = mps.node.wait_exit(Duration::from_secs(10)).await;
        assert!(
            status.is_some_and(|s| killed(&s)),
            "{point}: {status:?}\n{}",
            mps.node.log()
        );
        mps.start_ok().await;
        mps.node
            .check_reconciled()
            .unwrap_or_else(|p| panic!("{point}: {p}"));
        // Start-up left exactly what the completed entries need.
        let completed: BTreeMap<String, String> = mps
            .node
            .checkpoint()
            .and_then(|c| c["claims"].as_object().cloned())
            .unwrap_or_default()
            .into_iter()
            .filter(|(_, e)| e["state"] == "PrepareCompleted")
            .map(|(uid, _)| (uid, card.clone()))
            .collect();
        mps.check_daemons(&completed)
            .unwrap_or_else(|p| panic!("{point}: after the restart:\n{p}"));
        // The kubelet asks again, and a second share joins.
        if on_prepare {
            mps.prepare(&first).await.unwrap();
        } else {
            mps.unprepare(&first).await;
            mps.prepare(&first).await.unwrap();
        }
        mps.prepare(&second).await.unwrap();
        let both = BTreeMap::from([
            (first.uid.clone(), card.clone()),
            (second.uid.clone(), card.clone()),
        ]);
        mps.check_daemons(&both)
            .unwrap_or_else(|p| panic!("{point}: with both shares:\n{p}"));
        mps.unprepare(&first).await;
        mps.unprepare(&second).await;
        mps.check_daemons(&BTreeMap::new())
            .unwrap_or_else(|p| panic!("{point}: after both went:\n{p}"));
        mps.node
            .check_files(&BTreeMap::new())
            .unwrap_or_else(|p| panic!("{point}: {p}"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_nvidia_cuda_mps_control_the_claim_fails_saying_so_and_leaves_nothing() {
    let mut mps = MpsNode::new("node-mps-missing").await;
    mps.control = PathBuf::from("/nonexistent/nvidia-cuda-mps-control");
    mps.start_ok().await;
    let thirty = mps.share("thirty", "gpu-0", "30").await;
    let e = mps.prepare(&thirty).await.unwrap_err();
    assert!(
        e.contains("cannot run /nonexistent/nvidia-cuda-mps-control")
            && e.contains("--mps-control"),
        "{e}"
    );
    mps.check_daemons(&BTreeMap::new()).unwrap();
    mps.node.check_files(&BTreeMap::new()).unwrap();
    // A claim without MPS on the node is not affected.
    let limited = mps
        .node
        .create_claim_on(NAMESPACE, "limited", "gpu-0", Some(("8Gi", "50")))
        .await;
    mps.prepare(&limited).await.unwrap();
}

/// The GPU check (`driver/gpu-check/`) must not rot while no GPU is at hand: its shell and Python
/// parse, and its CPU part runs through `run.sh` as on a GPU, over fake GPUs and the stand-in
/// daemon: the driver prepares the 30 and 70 shares, two clients attach with what their CDI specs
/// give (and one of another user), the daemon lists one server with both, and the unprepare leaves
/// no daemon, server or folder. The throughput steps report themselves skipped.
#[test]
fn the_gpu_check_parses_and_its_cpu_part_passes_over_the_stand_in() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../driver/gpu-check");
    let bash = std::process::Command::new("bash")
        .arg("-n")
        .arg(dir.join("run.sh"))
        .output()
        .expect("bash runs");
    assert!(
        bash.status.success(),
        "{}",
        String::from_utf8_lossy(&bash.stderr)
    );
    let cache = tempfile::tempdir().expect("tempdir");
    let python = std::process::Command::new("python3")
        .args(["-m", "py_compile"])
        .arg(dir.join("check.py"))
        .env("PYTHONPYCACHEPREFIX", cache.path())
        .output()
        .expect("python3 runs");
    assert!(
        python.status.success(),
        "{}",
        String::from_utf8_lossy(&python.stderr)
    );

    let out = tempfile::tempdir().expect("tempdir");
    let check = find_binary("gpupool-mps-check").unwrap_or_else(|e| panic!("{e}"));
    let run = std::process::Command::new(dir.join("run.sh"))
        .arg(&check)
        .arg("--out")
        .arg(out.path())
        .arg("--mps-control")
        .arg(standin())
        .args([
            "--fake-gpus",
            "a100-40gb:1",
            "--cpu-only",
            "--seconds",
            "1",
            "--warmup",
            "0.5",
        ])
        .output()
        .expect("run.sh runs");
    let printed = format!(
        "{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(run.status.success(), "{printed}");
    let rows: Vec<Value> = std::fs::read_to_string(out.path().join("results.jsonl"))
        .expect("results.jsonl")
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    let ok = |check: &str| {
        rows.iter()
            .find(|r| r["check"] == check)
            .unwrap_or_else(|| panic!("no {check} in {printed}"))["ok"]
            .clone()
    };
    for check in [
        "prepare_30_70_multi_user_true",
        "spec_30",
        "spec_70",
        "one_server_two_clients_while_running",
        "client_30_through_mps",
        "client_70_through_mps",
        "client_of_another_user",
        "unprepare_stops_the_daemon_and_leaves_nothing",
    ] {
        assert_eq!(ok(check), true, "{check}: {printed}");
    }
    assert_eq!(ok("alone_without_mps"), Value::Null);
    assert!(std::fs::read_to_string(out.path().join("summary.txt"))
        .unwrap()
        .contains("0 failed"));
}

/// During a rolling update each driver instance has its own PID namespace: the daemon the other
/// instance started has a PID that means nothing here, yet it answers on the card's socket. It is
/// kept (no second daemon on the card) until it stops answering. Played by recording a PID that
/// is not the daemon's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_answering_on_its_socket_is_kept_though_its_pid_is_not_seen() {
    let mut mps = MpsNode::new("node-mps-elsewhere").await;
    mps.start_ok().await;
    let thirty = mps.share("thirty", "gpu-0", "30").await;
    mps.prepare(&thirty).await.unwrap();
    let card = mps.card(0);
    let pid = mps.daemon_pid(&card);
    let status = mps.node.stop_driver().await;
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
    let state = &mps.node.dirs.state;
    let mut data = gpupool_driver::node_state::checkpoint::load(state)
        .unwrap()
        .unwrap();
    let record = data.mps.get_mut(&card).unwrap();
    record.pid = Some(i32::MAX - 1);
    gpupool_driver::node_state::checkpoint::save(state, &data).unwrap();

    mps.start_ok().await;
    // Through a check of the watcher too.
    tokio::time::sleep(gpupool_driver::prepare::MPS_CHECK_INTERVAL + Duration::from_secs(1)).await;
    assert_eq!(
        daemons_under(&mps.node.dirs.run, CONTROL),
        [pid],
        "one daemon on the card, the one that answers\n{}",
        mps.node.log()
    );
    mps.unprepare(&thirty).await;
    assert!(daemons_under(&mps.node.dirs.run, CONTROL).is_empty());
    assert!(list_dir(&mps_root(&mps.node.dirs.run)).is_empty());
}

/// Pods arrive together: the kubelet prepares their claims at once. Shares of one card then share
/// one daemon, started once; none of them stops the other's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shares_of_one_card_prepared_at_once_start_one_daemon() {
    let mut mps = MpsNode::new("node-mps-together").await;
    mps.start_ok().await;
    let claims: Vec<ClaimRef> = futures::future::join_all(
        ["a", "b", "c", "d"]
            .iter()
            .map(|name| mps.share(name, "gpu-0", "20")),
    )
    .await;
    let outcome = mps.node.prepare_retrying(&claims).await;
    for claim in &claims {
        if let Err(e) = &outcome[&claim.uid] {
            panic!("{}: {e}\n{}", claim.name, mps.node.log());
        }
    }
    let card = mps.card(0);
    let believed: BTreeMap<String, String> = claims
        .iter()
        .map(|c| (c.uid.clone(), card.clone()))
        .collect();
    mps.check_daemons(&believed).unwrap();
    assert_eq!(
        mps.control_log(&card)
            .matches("Starting control daemon")
            .count(),
        1,
        "{}",
        mps.control_log(&card)
    );
    let outcome = mps.node.unprepare_retrying(&claims).await;
    assert!(outcome.values().all(Result::is_ok), "{outcome:?}");
    mps.check_daemons(&BTreeMap::new()).unwrap();
}

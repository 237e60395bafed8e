//! Never lose a claim (issue 6), over the real driver binary: SIGKILL at every fault point of prepare
//! and unprepare with random claims (MIG devices among them: no instance may be left behind or
//! lost either), a reboot that empties the CDI folder, and corrupt checkpoints.
//!
//! `GPUPOOL_CRASH_ITERATIONS` (default 200) and `GPUPOOL_CRASH_SEED` (default random, printed) steer
//! the random loop; a failure names the seed, so `GPUPOOL_CRASH_SEED=<seed>` replays it.

mod crash_support;

use std::collections::BTreeMap;
use std::time::Duration;

use crash_support::*;
use gpupool_api::claim::ClaimRef;
use gpupool_driver::node_state::checkpoint::CHECKPOINT_FILE;
use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use serde_json::Value;

/// Passed only by claims with a MIG device, before the rest of a prepare.
const MIG_PREPARE_POINTS: &[&str] = &[
    "after-gpu-instance-created",
    "after-gpu-instance-recorded",
    "after-compute-instance-created",
];
const PREPARE_POINTS: &[&str] = &[
    "after-gpu-instance-created",
    "after-gpu-instance-recorded",
    "after-compute-instance-created",
    "after-prepare-started",
    "after-temp-spec-written",
    "after-spec-renamed",
    "after-prepare-completed",
];
const UNPREPARE_POINTS: &[&str] = &["mid-unprepare", "after-compute-instance-destroyed"];
/// The crash node: two A100s for whole cards and fractions, an H100 for MIG devices.
const CRASH_GPUS: &str = "a100-40gb:2,h100-80gb:1";
const NAMESPACE: &str = "crash";

#[test]
fn every_fault_point_of_the_driver_is_exercised() {
    let ours: Vec<&str> = PREPARE_POINTS
        .iter()
        .chain(UNPREPARE_POINTS)
        .copied()
        .collect();
    assert_eq!(ours, gpupool_driver::node_state::fault::FAULT_POINTS);
}

fn env_number(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

/// Claim `i`'s allocation: claims 0..5 random cards or fractions of the A100s, claims 5..8 one
/// 1g.10gb MIG device each of the H100 (gpu-2), on placements of their own so that they can all
/// be prepared at once.
fn claim_results(rng: &mut StdRng, pool: &str, i: usize) -> Vec<Value> {
    if i >= 5 {
        let device = format!("gpu-2-mig-1g-10gb-{}", i - 5);
        return vec![exclusive_result("gpu0", pool, &device)];
    }
    random_results(rng, pool)
}

fn is_mig_claim(claim: &ClaimRef) -> bool {
    claim
        .name
        .strip_prefix("claim-")
        .and_then(|i| i.parse::<usize>().ok())
        .is_some_and(|i| i >= 5)
}

/// A random allocation on one or both A100s of the crash node: whole cards or fractions.
fn random_results(rng: &mut StdRng, pool: &str) -> Vec<Value> {
    let mut results = Vec::new();
    let devices: Vec<&str> = if rng.random_bool(0.2) {
        vec!["gpu-0", "gpu-1"]
    } else {
        vec![["gpu-0", "gpu-1"][rng.random_range(0..2)]]
    };
    for (i, device) in devices.into_iter().enumerate() {
        let request = format!("gpu{i}");
        if rng.random_bool(0.3) {
            results.push(result(&request, pool, device, None, None));
        } else {
            let memory = format!("{}Gi", rng.random_range(1..=10));
            let cores = rng.random_range(5..=50).to_string();
            results.push(result(&request, pool, device, Some(&memory), Some(&cores)));
        }
    }
    results
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Prepare,
    Unprepare,
}

/// The kubelet's side: what it was answered, and the rule that a repeated prepare gets the same answer.
#[derive(Default)]
struct KubeletBook {
    believed: BTreeMap<String, Vec<String>>,
    /// Per-claim successful answers over the run.
    prepared: usize,
    unprepared: usize,
}

impl KubeletBook {
    fn record_prepare(
        &mut self,
        outcome: &gpupool_e2e::kubelet::PrepareOutcome,
        claims: &[ClaimRef],
    ) {
        for claim in claims {
            let answer = outcome
                .get(&claim.uid)
                .unwrap_or_else(|| panic!("no answer for claim {}", claim.name));
            let devices = answer
                .as_ref()
                .unwrap_or_else(|e| panic!("prepare of claim {} failed: {e}", claim.name));
            let ids = cdi_ids(devices);
            assert!(
                !ids.is_empty(),
                "claim {} prepared with no CDI ids",
                claim.name
            );
            if let Some(before) = self.believed.get(&claim.uid) {
                assert_eq!(
                    before, &ids,
                    "a repeated prepare of claim {} gave another answer",
                    claim.name
                );
            }
            self.believed.insert(claim.uid.clone(), ids);
            self.prepared += 1;
        }
    }

    fn record_unprepare(
        &mut self,
        outcome: &gpupool_e2e::kubelet::UnprepareOutcome,
        claims: &[ClaimRef],
    ) {
        for claim in claims {
            match outcome.get(&claim.uid) {
                Some(Ok(())) => {
                    self.believed.remove(&claim.uid);
                    self.unprepared += 1;
                }
                Some(Err(e)) => panic!("unprepare of claim {} failed: {e}", claim.name),
                None => panic!("no answer for claim {}", claim.name),
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_at_random_fault_points_never_loses_a_claim() {
    let iterations = env_number("GPUPOOL_CRASH_ITERATIONS").unwrap_or(200);
    let seed = env_number("GPUPOOL_CRASH_SEED").unwrap_or_else(rand::random);
    println!(
        "crash loop: {iterations} iterations, seed {seed} (GPUPOOL_CRASH_SEED={seed} replays it)"
    );
    let mut rng = StdRng::seed_from_u64(seed);

    let mut node = CrashNode::with_namespace("node-crash", CRASH_GPUS, NAMESPACE).await;
    let mut claims = Vec::new();
    for i in 0..8 {
        let results = claim_results(&mut rng, &node.name, i);
        claims.push(
            node.create_allocated_claim(NAMESPACE, &format!("claim-{i}"), results, Vec::new())
                .await,
        );
    }
    node.start_driver_ok().await;

    let mut book = KubeletBook::default();
    let mut kills: BTreeMap<&str, usize> = BTreeMap::new();
    let mut armed_not_reached: BTreeMap<&str, usize> = BTreeMap::new();
    let mut calls: BTreeMap<&str, usize> = BTreeMap::new();
    let mut pods_deleted = 0usize;
    let started = std::time::Instant::now();

    for iteration in 0..iterations {
        let count = rng.random_range(1..=3);
        let picked: Vec<ClaimRef> = claims.choose_multiple(&mut rng, count).cloned().collect();
        // Mostly prepare what is not prepared and unprepare what is, with repeats of both.
        let prepared_share = picked
            .iter()
            .filter(|c| book.believed.contains_key(&c.uid))
            .count() as f64
            / picked.len() as f64;
        let op = if rng.random_bool(0.2 + 0.6 * (1.0 - prepared_share)) {
            Op::Prepare
        } else {
            Op::Unprepare
        };
        let points = match op {
            Op::Prepare => PREPARE_POINTS,
            Op::Unprepare => UNPREPARE_POINTS,
        };
        // Only a prepare of a MIG claim not prepared yet passes the MIG points: aim at them
        // most of the time then, so that each is hit in a default-length run.
        let fresh_mig = picked
            .iter()
            .any(|c| is_mig_claim(c) && !book.believed.contains_key(&c.uid));
        let points = if op == Op::Prepare && fresh_mig && rng.random_bool(0.7) {
            MIG_PREPARE_POINTS
        } else {
            points
        };
        let fault = rng
            .random_bool(0.8)
            .then(|| *points.choose(&mut rng).expect("points"));
        let context = format!(
            "iteration {iteration} (seed {seed}): {op:?} of {:?}, fault point {fault:?}",
            picked.iter().map(|c| c.name.as_str()).collect::<Vec<_>>()
        );

        if let Some(point) = fault {
            if let Started::Exited(status) = node.start_driver(Some(point)).await {
                panic!("{context}: the armed driver exited at start ({status}), before any call");
            }
        }
        *calls
            .entry(match op {
                Op::Prepare => "prepare",
                Op::Unprepare => "unprepare",
            })
            .or_default() += 1;
        let answered = match op {
            Op::Prepare => node
                .kubelet
                .prepare(DRIVER, &picked)
                .await
                .map(|outcome| book.record_prepare(&outcome, &picked)),
            Op::Unprepare => node
                .kubelet
                .unprepare(DRIVER, &picked)
                .await
                .map(|outcome| book.record_unprepare(&outcome, &picked)),
        };
        match (fault, answered) {
            (None, Ok(())) => {}
            (None, Err(e)) => panic!("{context}: the unarmed driver failed the call: {e}"),
            (Some(point), Ok(())) => {
                // The call never passed the point (a repeat returns the recorded answer): the armed
                // driver is killed idle, which is a crash too.
                *armed_not_reached.entry(point).or_default() += 1;
                node.kill_driver();
                node.start_driver_ok().await;
            }
            (Some(point), Err(call_error)) => {
                let status = node.wait_exit(Duration::from_secs(10)).await;
                match status {
                    Some(status) if killed(&status) => {
                        *kills.entry(point).or_default() += 1;
                    }
                    other => panic!(
                        "{context}: the call failed ({call_error}) but the driver did not die by SIGKILL: {other:?}"
                    ),
                }
                node.start_driver_ok().await;
                if let Err(problems) = node.check_reconciled() {
                    panic!("{context}: start-up after the kill left:\n{problems}");
                }
                // The kubelet retries what it asked until it succeeds; a prepare whose pod was
                // deleted meanwhile is unprepared instead.
                let pod_gone = op == Op::Prepare && rng.random_bool(0.25);
                if pod_gone {
                    pods_deleted += 1;
                }
                match if pod_gone { Op::Unprepare } else { op } {
                    Op::Prepare => {
                        let outcome = node.prepare_retrying(&picked).await;
                        book.record_prepare(&outcome, &picked);
                    }
                    Op::Unprepare => {
                        let outcome = node.unprepare_retrying(&picked).await;
                        book.record_unprepare(&outcome, &picked);
                    }
                }
            }
        }
        if let Err(problems) = node.check_files(&book.believed) {
            panic!("{context}: the node's folders disagree with the kubelet:\n{problems}");
        }
    }

    let still_prepared = book.believed.len();
    let (prepared, unprepared) = (book.prepared, book.unprepared);
    // Everything still prepared unprepares cleanly after all those crashes.
    let rest: Vec<ClaimRef> = claims
        .iter()
        .filter(|c| book.believed.contains_key(&c.uid))
        .cloned()
        .collect();
    if !rest.is_empty() {
        let outcome = node.unprepare_retrying(&rest).await;
        book.record_unprepare(&outcome, &rest);
    }
    node.check_files(&book.believed)
        .unwrap_or_else(|p| panic!("after unpreparing everything (seed {seed}):\n{p}"));

    let total_kills: usize = kills.values().sum();
    println!(
        "crash loop done in {:.1?}: {iterations} iterations, calls {calls:?}, {total_kills} SIGKILLs at fault points {kills:?}, \
         armed but not reached {armed_not_reached:?}, {pods_deleted} killed prepares unprepared instead of retried; {prepared} claim preparations and {unprepared} unpreparations answered OK; \
         {still_prepared} of {} claims prepared at the end of the loop",
        started.elapsed(),
        claims.len()
    );
    // With the default count every point must have fired; a short run (env) may miss some.
    if iterations >= 100 {
        for point in PREPARE_POINTS.iter().chain(UNPREPARE_POINTS) {
            assert!(
                kills.get(point).copied().unwrap_or(0) > 0,
                "no SIGKILL at {point} in {iterations} iterations (seed {seed}): {kills:?}"
            );
        }
    }
}

/// Prepares `claims`, asserting each succeeds; returns uid -> CDI ids.
async fn prepare_all(node: &CrashNode, claims: &[ClaimRef]) -> BTreeMap<String, Vec<String>> {
    let outcome = node.prepare_retrying(claims).await;
    claims
        .iter()
        .map(|c| {
            let devices = outcome[&c.uid]
                .as_ref()
                .unwrap_or_else(|e| panic!("prepare of {}: {e}\n{}", c.name, node.log()));
            (c.uid.clone(), cdi_ids(devices))
        })
        .collect()
}

/// A node whose driver runs with one claim `claim_name`, a share (memory, cores) of gpu-0,
/// prepared: the node, the claim and what the kubelet believes prepared.
async fn node_with_a_prepared_share(
    node_name: &str,
    claim_name: &str,
    share: (&str, &str),
) -> (CrashNode, ClaimRef, BTreeMap<String, Vec<String>>) {
    let mut node = CrashNode::with_namespace(node_name, "a100-40gb:2", NAMESPACE).await;
    let claim = node
        .create_claim_on(NAMESPACE, claim_name, "gpu-0", Some(share))
        .await;
    node.start_driver_ok().await;
    let believed = prepare_all(&node, std::slice::from_ref(&claim)).await;
    (node, claim, believed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_reboot_the_specs_come_back_with_identical_ids() {
    let mut node = CrashNode::with_namespace("node-reboot", "a100-40gb:2", NAMESPACE).await;
    let pool = node.name.clone();
    let claims = vec![
        node.create_claim_on(NAMESPACE, "whole", "gpu-0", None)
            .await,
        node.create_claim_on(NAMESPACE, "quarter", "gpu-1", Some(("10Gi", "25")))
            .await,
        node.create_allocated_claim(
            NAMESPACE,
            "both",
            vec![
                result("gpu0", &pool, "gpu-1", Some("4Gi"), Some("10")),
                result("gpu1", &pool, "gpu-0", Some("2Gi"), Some("5")),
            ],
            Vec::new(),
        )
        .await,
    ];
    node.start_driver_ok().await;
    let before = prepare_all(&node, &claims).await;
    node.check_files(&before).unwrap_or_else(|p| panic!("{p}"));
    let specs_before: BTreeMap<String, Value> = claims
        .iter()
        .map(|c| (c.uid.clone(), spec_json(&node, &c.uid)))
        .collect();

    let status = node.stop_driver().await;
    assert!(
        status.is_some_and(|s| s.success()),
        "clean exit on SIGTERM: {status:?}"
    );
    // A reboot: /var/run is a tmpfs, the CDI folder comes back empty; the state folder survives.
    for name in list_dir(&node.dirs.cdi) {
        std::fs::remove_file(node.dirs.cdi.join(&name)).unwrap();
    }
    let old_boot = std::mem::replace(&mut node.boot_id, uuid::Uuid::new_v4().to_string());
    node.start_driver_ok().await;

    // Back before the kubelet asks: containers restarting after the reboot need them at once.
    for claim in &claims {
        assert_eq!(
            spec_json(&node, &claim.uid),
            specs_before[&claim.uid],
            "claim {}: the spec written again after the reboot differs",
            claim.name
        );
    }
    let after = prepare_all(&node, &claims).await;
    assert_eq!(
        after, before,
        "the kubelet's repeated prepare gets identical CDI ids"
    );
    node.check_files(&after).unwrap_or_else(|p| panic!("{p}"));
    let checkpoint = node.checkpoint().expect("checkpoint");
    assert_eq!(checkpoint["bootId"], node.boot_id.as_str());
    assert_ne!(old_boot, node.boot_id);
    assert!(
        node.log().contains("rebooted"),
        "the driver logs that it noticed the reboot"
    );
}

fn spec_json(node: &CrashNode, uid: &str) -> Value {
    let path = node
        .dirs
        .cdi
        .join(gpupool_api::names::cdi_spec_file_name(uid));
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("no CDI spec at {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Damages a checkpoint file's bytes.
type Corruption = fn(Vec<u8>) -> Vec<u8>;

/// Ways a checkpoint file gets damaged.
fn corruptions() -> Vec<(&'static str, Corruption)> {
    vec![
        ("truncated", |bytes| bytes[..bytes.len() / 2].to_vec()),
        ("flipped byte", |mut bytes| {
            // A byte inside the boot id: still JSON, so only the checksum can tell.
            let marker = b"\"bootId\": \"";
            let at = bytes
                .windows(marker.len())
                .position(|w| w == marker)
                .expect("the checkpoint records a boot id")
                + marker.len();
            bytes[at] ^= 0x01;
            bytes
        }),
        ("wrong version", |bytes| {
            let mut file: Value = serde_json::from_slice(&bytes).expect("checkpoint is JSON");
            file["version"] = Value::from(999);
            serde_json::to_vec_pretty(&file).unwrap()
        }),
        ("empty file", |_| Vec::new()),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_checkpoint_is_moved_aside_reported_and_the_driver_works() {
    let (mut node, kept, mut believed) =
        node_with_a_prepared_share("node-corrupt", "kept", ("8Gi", "20")).await;
    let mut all = vec![kept.clone()];

    for (round, (kind, corrupt)) in corruptions().into_iter().enumerate() {
        node.stop_driver().await;
        let path = node.dirs.state.join(CHECKPOINT_FILE);
        let damaged = corrupt(std::fs::read(&path).expect("checkpoint written"));
        std::fs::write(&path, &damaged).unwrap();
        let log_before = node.log().len();

        if let Started::Exited(status) = node.start_driver(None).await {
            panic!("{kind}: the driver exited at start ({status}) instead of moving the checkpoint aside");
        }
        let log = node.log()[log_before..].to_string();
        assert!(
            log.contains("is unreadable"),
            "{kind}: the driver logs the unreadable checkpoint:\n{log}"
        );
        let aside: Vec<String> = list_dir(&node.dirs.state)
            .into_iter()
            .filter(|n| n.starts_with("checkpoint.json.corrupt-"))
            .collect();
        assert_eq!(aside.len(), 1, "{kind}: one file moved aside: {aside:?}");
        assert_eq!(
            std::fs::read(node.dirs.state.join(&aside[0])).unwrap(),
            damaged,
            "{kind}: the damaged file is kept aside as it was"
        );
        std::fs::remove_file(node.dirs.state.join(&aside[0])).unwrap();
        gpupool_e2e::harness::wait_for(
            &format!("{kind}: a CheckpointCorrupt Warning Event on the Node"),
            TIMEOUT,
            || async {
                let events = node.node_events().await;
                let corrupt = events
                    .iter()
                    .filter(|e| {
                        e.reason.as_deref() == Some("CheckpointCorrupt")
                            && e.type_.as_deref() == Some("Warning")
                    })
                    .count();
                (corrupt > round).then_some(())
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        assert!(
            node.dirs
                .cdi
                .join(gpupool_api::names::cdi_spec_file_name(&kept.uid))
                .is_file(),
            "{kind}: the spec of a claim prepared before stays (its containers may restart)"
        );

        // The claims from before are prepared again with the same ids; a new claim prepares.
        let fresh = node
            .create_claim_on(
                NAMESPACE,
                &format!("after-{round}"),
                "gpu-1",
                Some(("1Gi", "5")),
            )
            .await;
        all.push(fresh);
        let again = prepare_all(&node, &all).await;
        for (uid, ids) in &believed {
            assert_eq!(
                &again[uid], ids,
                "{kind}: same ids for a claim prepared before"
            );
        }
        believed = again;
        node.check_files(&believed)
            .unwrap_or_else(|p| panic!("{kind}:\n{p}"));
    }
}

/// The folder check the loop relies on sees what a crash would leave behind (it is not vacuous).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_folder_check_sees_leftovers_and_missing_specs() {
    let (node, claim, believed) =
        node_with_a_prepared_share("node-check", "one", ("2Gi", "10")).await;
    node.check_files(&believed)
        .unwrap_or_else(|p| panic!("{p}"));

    let missing = node.check_files(&BTreeMap::new()).unwrap_err();
    assert!(
        missing.contains("believes unprepared") && missing.contains("unexpected file"),
        "a claim the kubelet forgot is reported: {missing}"
    );
    let mut wrong_ids = believed.clone();
    wrong_ids.insert(claim.uid.clone(), vec!["gpupool.dev/claim=other".into()]);
    assert!(
        node.check_files(&wrong_ids).is_err(),
        "other ids are reported"
    );

    let temp = node.dirs.cdi.join(format!(
        ".{}.tmp",
        gpupool_api::names::cdi_spec_file_name(&claim.uid)
    ));
    std::fs::write(&temp, b"{").unwrap();
    let leftover = node.check_files(&believed).unwrap_err();
    assert!(
        leftover.contains(".tmp"),
        "a temp file is reported: {leftover}"
    );
    std::fs::remove_file(&temp).unwrap();

    std::fs::remove_file(
        node.dirs
            .cdi
            .join(gpupool_api::names::cdi_spec_file_name(&claim.uid)),
    )
    .unwrap();
    let gone = node.check_files(&believed).unwrap_err();
    assert!(
        gone.contains("no CDI spec"),
        "a missing spec is reported: {gone}"
    );
}

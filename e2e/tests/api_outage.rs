//! The API server away for a while (issue 6): prepared claims keep working, unprepare keeps working
//! (it needs only the checkpoint), a new prepare fails per claim naming it and succeeds once the API
//! server is back, and the driver's ResourceSlices converge to its inventory afterwards, even when the
//! driver restarted (with one more card) while the API server was down.
//!
//! `GPUPOOL_OUTAGE_SECS` (default 30) sets how long the API server emulator stops serving.

mod crash_support;

use std::time::{Duration, Instant};

use crash_support::*;
use gpupool_api::claim::ClaimRef;
use gpupool_e2e::harness::wait_for;

const NAMESPACE: &str = "outage";

fn outage() -> Duration {
    let secs = std::env::var("GPUPOOL_OUTAGE_SECS")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(30);
    Duration::from_secs(secs)
}

async fn prepared_ids(node: &CrashNode, claim: &ClaimRef) -> Result<Vec<String>, String> {
    let outcome = node
        .kubelet
        .prepare(DRIVER, std::slice::from_ref(claim))
        .await
        .map_err(|e| format!("call failed: {e}"))?;
    match &outcome[&claim.uid] {
        Ok(devices) => Ok(cdi_ids(devices)),
        Err(e) => Err(e.clone()),
    }
}

fn spec_exists(node: &CrashNode, claim: &ClaimRef) -> bool {
    node.dirs
        .cdi
        .join(gpupool_api::names::cdi_spec_file_name(&claim.uid))
        .is_file()
}

/// A new claim's prepare while the API server is away: a per-claim error that names the claim.
async fn assert_prepare_fails_naming(node: &CrashNode, claim: &ClaimRef, when: &str) {
    let started = Instant::now();
    let error = prepared_ids(node, claim)
        .await
        .expect_err("a claim cannot be prepared without reading it from the API server");
    assert!(
        error.contains(&format!("{}/{}", claim.namespace, claim.name)),
        "{when}: the per-claim error names the claim: {error}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(40),
        "{when}: the error came within the kubelet's 45 s call timeout ({:?})",
        started.elapsed()
    );
    assert!(
        !spec_exists(node, claim),
        "{when}: no spec for a failed prepare"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_survive_an_api_outage_and_slices_converge_after_it() {
    let outage = outage();
    let mut node = CrashNode::with_namespace("node-outage", "a100-40gb:2", NAMESPACE).await;
    let kept = node
        .create_claim_on(NAMESPACE, "kept", "gpu-0", Some(("8Gi", "20")))
        .await;
    let released = node
        .create_claim_on(NAMESPACE, "released", "gpu-1", None)
        .await;
    let during = node
        .create_claim_on(NAMESPACE, "during", "gpu-0", Some(("4Gi", "10")))
        .await;
    node.start_driver_ok().await;
    let (generation_before, published) = wait_for("the first slices", TIMEOUT, || async {
        node.published_devices().await.filter(|(_, d)| d.len() == 2)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", node.log()));
    assert_eq!(published, node.inventory_devices());
    let kept_ids = prepared_ids(&node, &kept)
        .await
        .expect("prepare before the outage");
    prepared_ids(&node, &released)
        .await
        .expect("prepare before the outage");

    println!("stopping the API server for {outage:?}");
    let down_since = Instant::now();
    node.apiserver.stop_serving().await;

    assert_eq!(
        prepared_ids(&node, &kept).await,
        Ok(kept_ids.clone()),
        "a prepared claim is answered from the checkpoint while the API server is away"
    );
    let unprepared = node
        .kubelet
        .unprepare(DRIVER, std::slice::from_ref(&released))
        .await
        .expect("unprepare call");
    assert_eq!(
        unprepared[&released.uid],
        Ok(()),
        "unprepare works while the API server is away"
    );
    assert!(!spec_exists(&node, &released), "its spec is gone");
    assert_prepare_fails_naming(&node, &during, "API server away").await;

    // A crash while the API server is away, and a card more when the driver comes back.
    node.kill_driver();
    node.set_fake_gpus("a100-40gb:3");
    node.start_driver_ok().await;
    assert!(spec_exists(&node, &kept), "the spec survives the crash");
    assert_eq!(
        prepared_ids(&node, &kept).await,
        Ok(kept_ids.clone()),
        "same answer after a restart while the API server is away"
    );
    assert_prepare_fails_naming(&node, &during, "API server away, driver restarted").await;

    // The kubelet keeps retrying the new claim for the rest of the outage.
    while down_since.elapsed() < outage {
        tokio::time::sleep(Duration::from_secs(5).min(outage.saturating_sub(down_since.elapsed())))
            .await;
        if down_since.elapsed() < outage {
            assert_prepare_fails_naming(&node, &during, "API server still away").await;
        }
    }
    assert!(node.is_running(), "the driver rode out the outage");
    node.apiserver
        .resume_serving()
        .await
        .expect("serving again on the same port");
    println!("API server back after {:?}", down_since.elapsed());

    let during_ids = wait_for(
        "the new claim to prepare once the API server is back",
        TIMEOUT,
        || async {
            tokio::time::sleep(Duration::from_millis(500)).await;
            prepared_ids(&node, &during).await.ok()
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", node.log()));
    assert!(spec_exists(&node, &during));

    let inventory = node.inventory_devices();
    assert_eq!(inventory.len(), 3);
    // The publisher retries with capped backoff (at most 30 s apart).
    let (generation_after, published) = wait_for(
        "the slices to show the node's three cards",
        Duration::from_secs(75),
        || async {
            node.published_devices()
                .await
                .filter(|(_, devices)| devices == &inventory)
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}; inventory {inventory:?}\n{}", node.log()));
    assert_eq!(published.len(), 3);
    assert!(
        generation_after > generation_before,
        "a new pool generation ({generation_after} after {generation_before})"
    );

    let mut believed = std::collections::BTreeMap::new();
    believed.insert(kept.uid.clone(), kept_ids);
    believed.insert(during.uid.clone(), during_ids);
    node.check_files(&believed)
        .unwrap_or_else(|p| panic!("{p}"));
}

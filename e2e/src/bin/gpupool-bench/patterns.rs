//! The two patterns in which the kubelet calls a node's driver (issue 21), each run against
//! gpupool and against the reference plugin (`gpupool-reference-plugin`: what a driver on
//! upstream's Go helper does per call) on the same emulator, through the same kubelet emulator:
//!
//! - **realistic**: new pods, each with its own claim prepared once; a pod starts every
//!   `interval` and lives `lifetime` (long enough for gpupool's deferred status write), then the
//!   kubelet unprepares its claim. Calls of several pods overlap as they would on a busy node.
//! - **serial**: one claim allocated once and a pod re-created on it over and over: before each
//!   prepare the claim is reserved for the new pod (as the scheduler does), then prepare and
//!   unprepare back to back.
//! - **re-prepare**: one claim and one consumer prepared again after each unprepare (as after a
//!   kubelet restart): the claim, its allocation and its reservation never change.

use std::time::{Duration, Instant};

use anyhow::Context;
use gpupool_api::claim::ClaimRef;
use gpupool_apiserver::RequestRecord;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Patch, PatchParams};
use kube::Api;
use serde::Serialize;
use serde_json::json;

use crate::cluster::{prepare_one, unprepare_one, Bench, NAMESPACE};
use crate::report::ClaimKind;
use crate::requests;
use crate::stats::{self, Summary};
use gpupool_e2e::harness::REFERENCE_USER_AGENT;
use gpupool_e2e::kubelet::Kubelet;

/// Which plugin served a pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Plugin {
    Gpupool,
    Reference,
}

impl Plugin {
    pub fn label(self) -> &'static str {
        match self {
            Plugin::Gpupool => "gpupool",
            Plugin::Reference => "reference",
        }
    }

    /// Whether `record` is one of this plugin's requests (by user agent: the bench's own client
    /// and the reference each set theirs, the driver keeps kube-rs's).
    fn made(self, record: &RequestRecord) -> bool {
        let reference = record.user_agent.starts_with(REFERENCE_USER_AGENT);
        match self {
            Plugin::Reference => reference,
            Plugin::Gpupool => !reference && !requests::is_bench(record),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Pattern {
    Realistic,
    Serial,
    Reprepare,
}

impl Pattern {
    pub fn label(self) -> &'static str {
        match self {
            Pattern::Realistic => "realistic",
            Pattern::Serial => "serial",
            Pattern::Reprepare => "re-prepare",
        }
    }
}

/// How the realistic pattern paces its pods.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Pacing {
    pub interval_ms: u64,
    pub lifetime_ms: u64,
}

/// One pattern against one plugin: latencies seen by the kubelet emulator and the plugin's
/// requests to the API server per claim lifecycle.
#[derive(Clone, Debug, Serialize)]
pub struct PatternRun {
    pub pattern: Pattern,
    pub plugin: Plugin,
    /// Prepare+unprepare cycles (realistic: claims).
    pub cycles: usize,
    pub prepare: Summary,
    pub unprepare: Summary,
    /// Claim GETs per prepare, all of them and those with a resourceVersion (the watch cache).
    pub gets_per_prepare: f64,
    pub cached_gets_per_prepare: f64,
    /// Writes (any) per prepare+unprepare cycle.
    pub writes_per_cycle: f64,
}

/// Waits until `plugin` made no API request for 200 ms, after gpupool's deferred status writes
/// had time to come (at most 10 s).
async fn settle(bench: &Bench, plugin: Plugin) {
    tokio::time::sleep(gpupool_driver::prepare::STATUS_WRITE_DELAY + Duration::from_millis(100))
        .await;
    let count = || bench.requests().iter().filter(|r| plugin.made(r)).count();
    let started = Instant::now();
    let mut seen = count();
    while started.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = count();
        if now == seen {
            return;
        }
        seen = now;
    }
}

fn finish(
    pattern: Pattern,
    plugin: Plugin,
    records: &[RequestRecord],
    prepare: &[Duration],
    unprepare: &[Duration],
) -> PatternRun {
    let mine: Vec<&RequestRecord> = records.iter().filter(|r| plugin.made(r)).collect();
    let claim_gets: Vec<&&RequestRecord> = mine
        .iter()
        .filter(|r| requests::request_kind(&r.method, &r.path) == "GET resourceclaims")
        .collect();
    let cached = claim_gets
        .iter()
        .filter(|r| requests::is_cached_read(r))
        .count();
    let writes = mine
        .iter()
        .filter(|r| requests::is_write(&r.method))
        .count();
    let cycles = prepare.len();
    let per = |n: usize| n as f64 / cycles.max(1) as f64;
    PatternRun {
        pattern,
        plugin,
        cycles,
        prepare: stats::summarize(prepare),
        unprepare: stats::summarize(unprepare),
        gets_per_prepare: per(claim_gets.len()),
        cached_gets_per_prepare: per(cached),
        writes_per_cycle: per(writes),
    }
}

/// The realistic pattern on `pool` (served by `plugin`): `count` new claims.
pub async fn realistic(
    bench: &Bench,
    kubelet: &Kubelet,
    plugin: Plugin,
    pool: &str,
    count: usize,
    pacing: Pacing,
    gpus: usize,
) -> anyhow::Result<PatternRun> {
    let prefix = format!("real-{}", plugin.label());
    let claims = bench
        .create_claims(&prefix, count, ClaimKind::Fractional, pool, gpus)
        .await?;
    let first = bench.requests().len();
    let started = Instant::now();
    let pods = claims.iter().enumerate().map(|(i, claim)| async move {
        let start_at = started + Duration::from_millis(pacing.interval_ms * i as u64);
        tokio::time::sleep_until(start_at.into()).await;
        let t = Instant::now();
        prepare_one(kubelet, claim).await?;
        let prepared = t.elapsed();
        tokio::time::sleep(Duration::from_millis(pacing.lifetime_ms)).await;
        let t = Instant::now();
        unprepare_one(kubelet, claim).await?;
        anyhow::Ok((prepared, t.elapsed()))
    });
    let timings = futures::future::try_join_all(pods).await?;
    settle(bench, plugin).await;
    let (prepare, unprepare): (Vec<_>, Vec<_>) = timings.into_iter().unzip();
    Ok(finish(
        Pattern::Realistic,
        plugin,
        &bench.requests()[first..],
        &prepare,
        &unprepare,
    ))
}

/// The serial pattern on `pool` (served by `plugin`): one claim, `cycles` pods re-created on it;
/// or, as [`Pattern::Reprepare`], the one pod's claim prepared again after each unprepare.
pub async fn serial(
    bench: &Bench,
    kubelet: &Kubelet,
    plugin: Plugin,
    pool: &str,
    cycles: usize,
    pattern: Pattern,
) -> anyhow::Result<PatternRun> {
    let name = format!("{}-{}", pattern.label(), plugin.label());
    let claim = bench
        .create_allocated_claim(&name, ClaimKind::Fractional, pool, "gpu-0")
        .await?;
    let api: Api<ResourceClaim> = Api::namespaced(bench.client.clone(), NAMESPACE);
    let first = bench.requests().len();
    let (mut prepare, mut unprepare) = (Vec::new(), Vec::new());
    for i in 0..cycles {
        if i > 0 && pattern == Pattern::Serial {
            reserve_for_new_pod(&api, &claim, i).await?;
        }
        let t = Instant::now();
        prepare_one(kubelet, &claim).await?;
        prepare.push(t.elapsed());
        let t = Instant::now();
        unprepare_one(kubelet, &claim).await?;
        unprepare.push(t.elapsed());
    }
    settle(bench, plugin).await;
    Ok(finish(
        pattern,
        plugin,
        &bench.requests()[first..],
        &prepare,
        &unprepare,
    ))
}

/// The claim reserved for the next pod only, as the scheduler leaves it once the old pod is gone
/// and the new one is bound; the kubelet calls a few milliseconds later at the earliest (it sees
/// the pod through its own watch), by when the watch cache has the reservation.
async fn reserve_for_new_pod(
    api: &Api<ResourceClaim>,
    claim: &ClaimRef,
    generation: usize,
) -> anyhow::Result<()> {
    let patch = json!({"status": {"reservedFor": [{
        "resource": "pods", "name": format!("{}-pod-{generation}", claim.name),
        "uid": uuid::Uuid::new_v4().to_string(),
    }]}});
    api.patch_status(&claim.name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .with_context(|| format!("reserving claim {} for a new pod", claim.name))?;
    tokio::time::sleep(Duration::from_millis(5)).await;
    Ok(())
}

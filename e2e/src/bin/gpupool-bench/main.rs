//! `gpupool-bench`: the real driver with fake GPUs against the API server emulator, driven through
//! its real sockets the way the kubelet does (issue 8). Prints a table, or JSON with `--json`.
//! Real numbers come from a release build (`cargo build --release -p gpupool-e2e -p gpupool-driver`,
//! then `target/release/gpupool-bench`); `--short` runs a tiny version of everything in seconds.

mod cluster;
mod patterns;
mod procfs;
mod report;
mod requests;
mod stats;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use gpupool_api::claim::ClaimRef;
use gpupool_apiserver::{ApiProfile, ApiServerOptions};
use gpupool_e2e::harness::{
    find_binary, init_stderr_tracing, two_worker_runtime, DRIVER_BIN, REFERENCE_PLUGIN_BIN,
};
use gpupool_e2e::kubelet::Kubelet;
use kube::api::GetParams;

use cluster::{prepare_one, unprepare_one, Bench, ServerChoice};
use patterns::{Pacing, Pattern, Plugin};
use report::{ApiSettings, ClaimKind, LatencyCell, Memory, Publishing, Report, Soak, Startup};

const PROFILE: &str = "a100-40gb";
const GPUS: usize = 8;
/// The registry scan of the kubelet emulator for start-up timing; the real kubelet is told by inotify.
const FAST_SCAN: Duration = Duration::from_millis(1);
const SLOW_SCAN: Duration = Duration::from_millis(100);

#[derive(Parser, Debug)]
#[command(
    about = "Prepare/unprepare latency, memory, start-up and slice publishing of gpupool-driver"
)]
struct Args {
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// A tiny version of everything (a few iterations), for CI.
    #[arg(long)]
    short: bool,
    /// The driver binary; by default the one next to this binary (same build profile).
    #[arg(long, env = "GPUPOOL_DRIVER_BIN")]
    driver: Option<PathBuf>,
    /// Prepare+unprepare cycles per claim kind and concurrency.
    #[arg(long)]
    cycles: Option<usize>,
    /// Cycles of the soak.
    #[arg(long)]
    soak_cycles: Option<usize>,
    /// Claims prepared at once for the memory measurement.
    #[arg(long, default_value_t = 256)]
    prepared_claims: usize,
    /// Driver starts timed.
    #[arg(long)]
    starts: Option<usize>,
    /// Node counts (8 GPUs each) for slice publishing, comma-separated.
    #[arg(long, value_delimiter = ',')]
    publish_nodes: Option<Vec<usize>>,
    /// What the API server emulator charges per request: `none` answers at once (the figures in
    /// BENCHMARKS.md so far), `real` what kube-apiserver with etcd charges on a small machine.
    #[arg(long, value_enum, default_value_t = ApiProfile::None)]
    api_profile: ApiProfile,
    /// Seed of the profile's delays.
    #[arg(long, default_value_t = 0)]
    api_seed: u64,
    /// Against the real kube-apiserver and etcd (the control plane binaries of `GPUPOOL_KUBE_BIN`
    /// or `KUBEBUILDER_ASSETS`) instead of the emulator; requests are counted from its audit log.
    #[arg(long, conflicts_with_all = ["api_profile", "api_seed"])]
    kube_apiserver: bool,
    /// The reference plugin's binary (what a driver on upstream's Go helper does per call); by
    /// default the one next to this binary.
    #[arg(long, env = "GPUPOOL_REFERENCE_PLUGIN_BIN")]
    reference: Option<PathBuf>,
    /// Pods of the realistic pattern (one new claim each), per plugin.
    #[arg(long)]
    pattern_claims: Option<usize>,
    /// Pods re-created on the one claim of the serial pattern, per plugin.
    #[arg(long)]
    pattern_cycles: Option<usize>,
    /// Realistic pattern: a new pod every this many milliseconds.
    #[arg(long, default_value_t = 20)]
    pod_interval_ms: u64,
    /// Realistic pattern: how long each pod lives before its claim is unprepared; longer than
    /// gpupool's status write delay (500 ms), so that each claim gets its status write.
    #[arg(long)]
    pod_lifetime_ms: Option<u64>,
}

struct Plan {
    cycles: usize,
    soak_cycles: usize,
    prepared_claims: usize,
    starts: usize,
    publish_nodes: Vec<usize>,
    concurrency: Vec<usize>,
    pattern_claims: usize,
    pattern_cycles: usize,
    pacing: Pacing,
}

impl Plan {
    fn from_args(args: &Args) -> Plan {
        let (cycles, soak, starts, nodes, prepared) = if args.short {
            (8, 40, 2, vec![1, 2], args.prepared_claims.min(16))
        } else {
            (1000, 10_000, 5, vec![1, 8, 64], args.prepared_claims)
        };
        let (pattern_claims, pattern_cycles, lifetime_ms) = if args.short {
            (8, 8, 600)
        } else {
            (300, 300, 1000)
        };
        Plan {
            cycles: args.cycles.unwrap_or(cycles),
            soak_cycles: args.soak_cycles.unwrap_or(soak),
            prepared_claims: prepared,
            starts: args.starts.unwrap_or(starts),
            publish_nodes: args.publish_nodes.clone().unwrap_or(nodes),
            concurrency: vec![1, 4, 16],
            pattern_claims: args.pattern_claims.unwrap_or(pattern_claims),
            pattern_cycles: args.pattern_cycles.unwrap_or(pattern_cycles),
            pacing: Pacing {
                interval_ms: args.pod_interval_ms,
                lifetime_ms: args.pod_lifetime_ms.unwrap_or(lifetime_ms),
            },
        }
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    init_stderr_tracing();
    let runtime = two_worker_runtime().context("starting the async runtime")?;
    let report = runtime.block_on(run(&args))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report::render_table(&report));
    }
    Ok(())
}

fn progress(message: &str) {
    eprintln!("[gpupool-bench] {message}");
}

async fn run(args: &Args) -> anyhow::Result<Report> {
    let plan = Plan::from_args(args);
    let driver_bin = match &args.driver {
        Some(path) => path.clone(),
        None => find_binary(DRIVER_BIN)?,
    };
    let reference_bin = match &args.reference {
        Some(path) => path.clone(),
        None => find_binary(REFERENCE_PLUGIN_BIN)?,
    };
    let api_options = ApiServerOptions::default()
        .profile(args.api_profile)
        .seed(args.api_seed);
    let mut api = ApiSettings {
        server: "the API server emulator".into(),
        profile: args.api_profile,
        seed: args.api_seed,
        cache_lag_us: api_options.effective_cache_lag().as_secs_f64() * 1e6,
    };
    let choice = if args.kube_apiserver {
        ServerChoice::KubeApiserver
    } else {
        ServerChoice::Emulator(api_options)
    };
    let bench = Bench::start(driver_bin.clone(), choice).await?;
    if args.kube_apiserver {
        let version = bench.client.apiserver_version().await?;
        api.server = format!("kube-apiserver {} with etcd", version.git_version);
    }
    let gpus = format!("{PROFILE}:{GPUS}");

    progress("start-up");
    let mut startup = Vec::new();
    for i in 0..plan.starts {
        let (node, registered, published) = bench
            .start_node(&format!("startup-{i}"), &gpus, GPUS, FAST_SCAN)
            .await?;
        startup.push(Startup {
            to_registered_ms: registered.as_secs_f64() * 1e3,
            to_slices_ms: published.as_secs_f64() * 1e3,
        });
        drop(node);
    }

    let (node, _, _) = bench.start_node("bench-0", &gpus, GPUS, SLOW_SCAN).await?;
    let pid = node.pid()?;
    let kubelet = node.kubelet();
    // Let start-up work (the first publication, the GpuModel watch) finish before measuring idle.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let idle_rss = procfs::rss(pid)?;

    progress(&format!(
        "memory with {} prepared claims",
        plan.prepared_claims
    ));
    let held = bench
        .create_claims(
            "held",
            plan.prepared_claims,
            ClaimKind::Fractional,
            &node.name,
            GPUS,
        )
        .await?;
    run_concurrently(&held, 16, |c| prepare_one(kubelet, c)).await?;
    let prepared_rss = procfs::rss(pid)?;
    let prepared_checkpoint_bytes = bench.checkpoint_bytes(&node.name)?;
    run_concurrently(&held, 16, |c| unprepare_one(kubelet, c)).await?;
    let memory = Memory {
        gpus: GPUS,
        idle_rss_kib: idle_rss.total_kib,
        idle_rss_anon_kib: idle_rss.anon_kib,
        prepared_claims: held.len(),
        prepared_rss_kib: prepared_rss.total_kib,
        prepared_rss_anon_kib: prepared_rss.anon_kib,
        prepared_checkpoint_bytes,
    };

    let probe = bench
        .create_allocated_claim("get-probe", ClaimKind::Whole, &node.name, "gpu-0")
        .await?;
    let gets = plan.cycles.min(1000);
    let api_get_claim = time_claim_gets(&bench, &probe, &GetParams::default(), gets).await?;
    let api_get_claim_cached = time_claim_gets(&bench, &probe, &GetParams::any(), gets).await?;
    let repeat_prepare = time_repeated_prepares(kubelet, &probe, plan.cycles.min(1000)).await?;

    let first_cycle_request = bench.requests().len();
    let mut latency = Vec::new();
    for kind in [ClaimKind::Whole, ClaimKind::Fractional] {
        for &concurrency in &plan.concurrency {
            progress(&format!(
                "latency: {} claims, {concurrency} caller(s), {} cycles",
                kind.label(),
                plan.cycles
            ));
            let prefix = format!("{}-c{concurrency}", kind.label());
            let claims = bench
                .create_claims(&prefix, plan.cycles, kind, &node.name, GPUS)
                .await?;
            latency.push(latency_cell(kubelet, kind, concurrency, &claims).await?);
        }
    }

    // The driver writes a claim's status after answering: let the last cycles' writes land.
    settle_requests(&bench).await;
    let api_requests = requests::per_cycle(
        &bench.requests()[first_cycle_request..],
        latency.iter().map(|c| c.cycles).sum(),
    );

    let patterns = run_patterns(&bench, kubelet, &node.name, &reference_bin, &plan).await?;

    progress(&format!("soak: {} cycles", plan.soak_cycles));
    let soak = soak(&bench, kubelet, &node.name, pid, plan.soak_cycles).await?;
    drop(node);

    let mut publishing = Vec::new();
    for (step, &nodes) in plan.publish_nodes.iter().enumerate() {
        progress(&format!("slice publishing: {nodes} node(s) x {GPUS} GPUs"));
        publishing.push(publish(&bench, step, nodes, &gpus).await?);
    }

    let mut report = Report {
        machine: procfs::machine(),
        driver_binary: driver_bin.display().to_string(),
        state_folders: procfs::describe_folder(bench.workdir()),
        runtime_folders: procfs::describe_folder(bench.runtime_dir()),
        short: args.short,
        api,
        gpus,
        latency,
        memory,
        soak,
        startup,
        publishing,
        api_get_claim,
        api_get_claim_cached,
        api_requests,
        repeat_prepare,
        patterns,
        pacing: plan.pacing,
        targets: Vec::new(),
    };
    report.targets = report::check_targets(&report);
    Ok(report)
}

/// Both patterns against gpupool (on `pool`, the latency node) and against the reference plugin
/// on a node of its own, in the order gpupool, reference, reference, gpupool, so that a drift of
/// the machine during the run falls on both alike.
async fn run_patterns(
    bench: &Bench,
    kubelet: &Kubelet,
    pool: &str,
    reference_bin: &std::path::Path,
    plan: &Plan,
) -> anyhow::Result<Vec<patterns::PatternRun>> {
    let reference = bench
        .start_reference_node("reference-0", reference_bin)
        .await?;
    let nodes = [
        (Plugin::Gpupool, kubelet, pool),
        (
            Plugin::Reference,
            reference.kubelet(),
            reference.name.as_str(),
        ),
    ];
    let mut runs = Vec::new();
    for pattern in [Pattern::Serial, Pattern::Reprepare] {
        for &(plugin, kubelet, pool) in nodes.iter() {
            progress(&format!(
                "{} pattern: {}, {} cycles on one claim",
                pattern.label(),
                plugin.label(),
                plan.pattern_cycles
            ));
            runs.push(
                patterns::serial(bench, kubelet, plugin, pool, plan.pattern_cycles, pattern)
                    .await?,
            );
        }
    }
    for &(plugin, kubelet, pool) in nodes.iter().rev() {
        progress(&format!(
            "realistic pattern: {}, {} new pods",
            plugin.label(),
            plan.pattern_claims
        ));
        runs.push(
            patterns::realistic(
                bench,
                kubelet,
                plugin,
                pool,
                plan.pattern_claims,
                plan.pacing,
                GPUS,
            )
            .await?,
        );
    }
    Ok(runs)
}

/// Waits until the driver made no API request for 200 ms (at most 10 s).
async fn settle_requests(bench: &Bench) {
    const QUIET: Duration = Duration::from_millis(200);
    const LIMIT: Duration = Duration::from_secs(10);
    let started = Instant::now();
    let driver_requests = || {
        bench
            .requests()
            .iter()
            .filter(|r| !requests::is_bench(r))
            .count()
    };
    let mut seen = driver_requests();
    while started.elapsed() < LIMIT {
        tokio::time::sleep(QUIET).await;
        let now = driver_requests();
        if now == seen {
            return;
        }
        seen = now;
    }
}

/// Serial GETs of one claim through the bench's kube client: the same client library and transport
/// the driver reads claims with. With `GetParams::any()` (`resourceVersion=0`) the API server
/// answers from its watch cache, without it from etcd (a quorum read).
async fn time_claim_gets(
    bench: &Bench,
    claim: &ClaimRef,
    params: &GetParams,
    count: usize,
) -> anyhow::Result<stats::Summary> {
    let api: kube::Api<k8s_openapi::api::resource::v1::ResourceClaim> =
        kube::Api::namespaced(bench.client.clone(), &claim.namespace);
    let mut samples = Vec::with_capacity(count);
    for _ in 0..count {
        let t = Instant::now();
        api.get_with(&claim.name, params)
            .await
            .with_context(|| format!("reading claim {}", claim.name))?;
        samples.push(t.elapsed());
    }
    Ok(stats::summarize(&samples))
}

/// Prepares of a claim already prepared, as the kubelet repeats them: answered from the
/// checkpoint with no API request and no file written, so the round trip through the sockets
/// and the driver's own dispatch: the floor under every prepare.
async fn time_repeated_prepares(
    kubelet: &Kubelet,
    claim: &ClaimRef,
    count: usize,
) -> anyhow::Result<stats::Summary> {
    prepare_one(kubelet, claim).await?;
    let mut samples = Vec::with_capacity(count);
    for _ in 0..count {
        let t = Instant::now();
        prepare_one(kubelet, claim).await?;
        samples.push(t.elapsed());
    }
    unprepare_one(kubelet, claim).await?;
    Ok(stats::summarize(&samples))
}

/// Runs `call` on every claim with `concurrency` callers, each taking every `concurrency`-th claim,
/// so no claim is in two calls at once.
async fn run_concurrently<'a, F, Fut>(
    claims: &'a [ClaimRef],
    concurrency: usize,
    call: F,
) -> anyhow::Result<()>
where
    F: Fn(&'a ClaimRef) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let call = &call;
    let callers = (0..concurrency).map(|w| async move {
        for claim in claims.iter().skip(w).step_by(concurrency) {
            call(claim).await?;
        }
        anyhow::Ok(())
    });
    futures::future::try_join_all(callers).await?;
    Ok(())
}

/// Each caller prepares then unprepares its claims one after the other; every call is timed.
async fn latency_cell(
    kubelet: &Kubelet,
    kind: ClaimKind,
    concurrency: usize,
    claims: &[ClaimRef],
) -> anyhow::Result<LatencyCell> {
    let started = Instant::now();
    let callers = (0..concurrency).map(|w| async move {
        let mut prepare = Vec::new();
        let mut unprepare = Vec::new();
        for claim in claims.iter().skip(w).step_by(concurrency) {
            let t = Instant::now();
            prepare_one(kubelet, claim).await?;
            prepare.push(t.elapsed());
            let t = Instant::now();
            unprepare_one(kubelet, claim).await?;
            unprepare.push(t.elapsed());
        }
        anyhow::Ok((prepare, unprepare))
    });
    let results = futures::future::try_join_all(callers).await?;
    let seconds = started.elapsed().as_secs_f64();
    let (prepare, unprepare): (Vec<_>, Vec<_>) = results.into_iter().unzip();
    let prepare: Vec<Duration> = prepare.into_iter().flatten().collect();
    let unprepare: Vec<Duration> = unprepare.into_iter().flatten().collect();
    Ok(LatencyCell {
        kind,
        concurrency,
        cycles: claims.len(),
        prepare: stats::summarize(&prepare),
        unprepare: stats::summarize(&unprepare),
        seconds,
        cycles_per_second: claims.len() as f64 / seconds.max(f64::EPSILON),
    })
}

/// Claims reused round-robin: the soak is about what a long-lived driver keeps, not about the API.
async fn soak(
    bench: &Bench,
    kubelet: &Kubelet,
    pool: &str,
    pid: u32,
    cycles: usize,
) -> anyhow::Result<Soak> {
    const CALLERS: usize = 4;
    const POOL: usize = 64;
    let claims = bench
        .create_claims("soak", POOL, ClaimKind::Fractional, pool, GPUS)
        .await?;
    let cycle_all = |rounds: usize| {
        let claims = &claims;
        async move {
            let callers = (0..CALLERS).map(|w| async move {
                let mine: Vec<&ClaimRef> = claims.iter().skip(w).step_by(CALLERS).collect();
                for i in 0..rounds.div_ceil(CALLERS) {
                    let claim = mine[i % mine.len()];
                    prepare_one(kubelet, claim).await?;
                    unprepare_one(kubelet, claim).await?;
                }
                anyhow::Ok(())
            });
            futures::future::try_join_all(callers).await.map(|_| ())
        }
    };
    // Warm up: connection pools, allocator arenas and maps reach their working size first.
    cycle_all(POOL * 2).await?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (rss_before, fds_before) = (procfs::rss_kib(pid)?, procfs::open_fds(pid)?);
    let started = Instant::now();
    cycle_all(cycles).await?;
    let seconds = started.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_millis(200)).await;
    Ok(Soak {
        cycles: cycles.div_ceil(CALLERS) * CALLERS,
        concurrency: CALLERS,
        seconds,
        rss_before_kib: rss_before,
        rss_after_kib: procfs::rss_kib(pid)?,
        fds_before,
        fds_after: procfs::open_fds(pid)?,
    })
}

/// `nodes` drivers with 8 GPUs each started at once; time until every device is in the API and the
/// drivers' requests meanwhile.
async fn publish(
    bench: &Bench,
    step: usize,
    nodes: usize,
    gpus: &str,
) -> anyhow::Result<Publishing> {
    const SETTLE: Duration = Duration::from_millis(1000);
    const TIMEOUT: Duration = Duration::from_secs(120);
    let names: Vec<String> = (0..nodes).map(|i| format!("pub{step}-{i}")).collect();
    let wanted: BTreeSet<String> = names.iter().cloned().collect();
    let devices = nodes * GPUS;
    let publishers = bench.prepare_publishers(&names).await?;
    let first_request = bench.requests().len();
    let started = Instant::now();
    let drivers = bench.spawn_publishers(&publishers, gpus)?;
    let slices = loop {
        let (published, slices) = bench.published_devices(&wanted).await?;
        if published >= devices {
            break slices;
        }
        if started.elapsed() > TIMEOUT {
            anyhow::bail!(
                "{published} of {devices} devices published after {TIMEOUT:?}; first driver log:\n{}",
                drivers[0].driver.log()
            );
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let seconds = started.elapsed().as_secs_f64();
    let until_published = requests::driver_requests(&bench.requests()[first_request..]);
    tokio::time::sleep(SETTLE).await;
    let after_settle = requests::driver_requests(&bench.requests()[first_request..]);
    drop(drivers);
    Ok(Publishing {
        nodes,
        devices,
        slices,
        seconds,
        slice_writes: requests::slice_writes(&until_published),
        requests: until_published,
        requests_after_settle: after_settle,
    })
}

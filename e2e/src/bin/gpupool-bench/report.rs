//! What one bench run measured, and its rendering as a plain-text table (pure).

use std::collections::BTreeMap;
use std::fmt::Write;

use gpupool_apiserver::ApiProfile;
use serde::Serialize;

use crate::patterns::{Pacing, Pattern, PatternRun, Plugin};
use crate::procfs::Machine;
use crate::stats::{median, Summary};

/// A whole card (no capacity request: the card's memory, no compute share) or a fraction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ClaimKind {
    Whole,
    Fractional,
}

impl ClaimKind {
    pub fn label(self) -> &'static str {
        match self {
            ClaimKind::Whole => "whole",
            ClaimKind::Fractional => "fractional",
        }
    }
}

/// Prepare/unprepare latencies and throughput of one claim kind at one concurrency.
#[derive(Clone, Debug, Serialize)]
pub struct LatencyCell {
    pub kind: ClaimKind,
    pub concurrency: usize,
    pub cycles: usize,
    pub prepare: Summary,
    pub unprepare: Summary,
    pub seconds: f64,
    /// prepare + unprepare cycles per second over the whole cell.
    pub cycles_per_second: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Memory {
    pub gpus: usize,
    pub idle_rss_kib: u64,
    pub idle_rss_anon_kib: u64,
    pub prepared_claims: usize,
    pub prepared_rss_kib: u64,
    pub prepared_rss_anon_kib: u64,
    /// Size of the driver's checkpoint file with the claims prepared (it is rewritten whole on
    /// every change).
    pub prepared_checkpoint_bytes: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Soak {
    pub cycles: usize,
    pub concurrency: usize,
    pub seconds: f64,
    pub rss_before_kib: u64,
    pub rss_after_kib: u64,
    pub fds_before: usize,
    pub fds_after: usize,
}

/// One start of the driver: process spawned -> registered with the kubelet emulator, and ->
/// its slices visible in the API.
#[derive(Clone, Debug, Serialize)]
pub struct Startup {
    pub to_registered_ms: f64,
    pub to_slices_ms: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Publishing {
    pub nodes: usize,
    pub devices: usize,
    pub slices: usize,
    /// All drivers spawned -> every device visible in the API.
    pub seconds: f64,
    /// Driver requests to ResourceSlices that write (POST/PUT/PATCH/DELETE) until published.
    pub slice_writes: usize,
    /// Every driver request until published, by kind.
    pub requests: BTreeMap<String, usize>,
    /// Every driver request until a settle time after publishing, by kind.
    pub requests_after_settle: BTreeMap<String, usize>,
}

/// The API server of this run, and what the emulator charged (when it was the emulator).
#[derive(Clone, Debug, Serialize)]
pub struct ApiSettings {
    pub server: String,
    pub profile: ApiProfile,
    pub seed: u64,
    /// How far `resourceVersion=0` GETs of one object lagged behind writes.
    pub cache_lag_us: f64,
}

/// The drivers' API requests over the latency cells, per prepare+unprepare cycle of a claim.
#[derive(Clone, Debug, Default, Serialize)]
pub struct CycleRequests {
    pub cycles: usize,
    /// GETs and lists, not watches.
    pub reads: usize,
    /// Of those, the ones with a `resourceVersion` (from the watch cache, not a quorum read).
    pub cached_reads: usize,
    /// POST, PUT, PATCH, DELETE.
    pub writes: usize,
    pub reads_per_cycle: f64,
    pub cached_reads_per_cycle: f64,
    pub writes_per_cycle: f64,
    /// Every driver request, watches included, by kind (see `requests::request_kind`).
    pub by_kind: BTreeMap<String, usize>,
}

/// One target of issue 8 against what this run measured.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TargetCheck {
    pub target: String,
    pub measured: f64,
    pub limit: f64,
    pub unit: &'static str,
    pub met: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub machine: Machine,
    pub driver_binary: String,
    /// The file systems under the nodes' state folders and their CDI and run folders (a file
    /// system call on a disk and one on a tmpfs differ by far).
    pub state_folders: String,
    pub runtime_folders: String,
    pub short: bool,
    pub api: ApiSettings,
    pub gpus: String,
    pub latency: Vec<LatencyCell>,
    pub memory: Memory,
    pub soak: Soak,
    pub startup: Vec<Startup>,
    pub publishing: Vec<Publishing>,
    /// A claim GET through kube-rs to the emulator without resourceVersion (a quorum read), the read
    /// every fresh prepare makes: the floor of prepare latency as long as the claim is read so.
    pub api_get_claim: Summary,
    /// The same GET with `resourceVersion=0` (from the watch cache): the floor of a prepare that
    /// reads the claim from the cache.
    pub api_get_claim_cached: Summary,
    /// The drivers' requests per prepare+unprepare cycle over the latency cells.
    pub api_requests: CycleRequests,
    /// A prepare of a claim already prepared (answered from the checkpoint): the gRPC round trip
    /// and the driver's dispatch, the other floor of prepare latency.
    pub repeat_prepare: Summary,
    /// The realistic, serial and re-prepare patterns, each against gpupool and the reference
    /// plugin.
    pub patterns: Vec<PatternRun>,
    /// How the realistic pattern paced its pods.
    pub pacing: Pacing,
    /// Filled by [`check_targets`].
    pub targets: Vec<TargetCheck>,
}

/// gpupool's figure over the reference's for `pattern`, when both ran.
pub fn ratio(
    report: &Report,
    pattern: Pattern,
    figure: impl Fn(&PatternRun) -> f64,
) -> Option<f64> {
    let run = |plugin| {
        report
            .patterns
            .iter()
            .find(|r| r.pattern == pattern && r.plugin == plugin)
    };
    let (ours, reference) = (run(Plugin::Gpupool)?, run(Plugin::Reference)?);
    Some(figure(ours) / figure(reference).max(f64::EPSILON))
}

fn at_most(target: &str, measured: f64, limit: f64, unit: &'static str) -> TargetCheck {
    TargetCheck {
        target: target.to_string(),
        measured,
        limit,
        unit,
        met: measured <= limit,
    }
}

fn at_least(target: &str, measured: f64, limit: f64, unit: &'static str) -> TargetCheck {
    TargetCheck {
        met: measured >= limit,
        ..at_most(target, measured, limit, unit)
    }
}

/// The issue's targets (for a release build on a 2-core machine) against this run; a target whose
/// measurement is missing from the run is left out.
pub fn check_targets(report: &Report) -> Vec<TargetCheck> {
    let mut checks = Vec::new();
    let cell = |kind: ClaimKind, concurrency: usize| {
        report
            .latency
            .iter()
            .find(|c| c.kind == kind && c.concurrency == concurrency)
    };
    for kind in [ClaimKind::Whole, ClaimKind::Fractional] {
        let label = kind.label();
        if let Some(serial) = cell(kind, 1) {
            checks.push(at_most(
                &format!("{label} prepare p50, serial"),
                serial.prepare.p50_us,
                250.0,
                "µs",
            ));
            checks.push(at_most(
                &format!("{label} prepare p99, serial"),
                serial.prepare.p99_us,
                1000.0,
                "µs",
            ));
            if let Some(four) = cell(kind, 4) {
                checks.push(at_least(
                    &format!("{label} throughput, 4 callers / serial"),
                    four.cycles_per_second / serial.cycles_per_second.max(f64::EPSILON),
                    2.0,
                    "x",
                ));
            }
        }
    }
    for pattern in [Pattern::Realistic, Pattern::Serial, Pattern::Reprepare] {
        let label = pattern.label();
        let mut ratio_at_most = |what: &str, figure: fn(&PatternRun) -> f64, limit: f64| {
            if let Some(r) = ratio(report, pattern, figure) {
                checks.push(at_most(
                    &format!("{label}: {what} / reference"),
                    r,
                    limit,
                    "x",
                ));
            }
        };
        ratio_at_most("prepare p50", |r| r.prepare.p50_us, 0.5);
        ratio_at_most("prepare p99", |r| r.prepare.p99_us, 0.5);
        ratio_at_most("unprepare p50", |r| r.unprepare.p50_us, 1.0);
        if let Some(ours) = report
            .patterns
            .iter()
            .find(|r| r.pattern == pattern && r.plugin == Plugin::Gpupool)
        {
            checks.push(at_most(
                &format!("{label}: claim GETs per prepare"),
                ours.gets_per_prepare,
                1.0,
                "GETs",
            ));
        }
    }
    checks.push(at_most(
        &format!(
            "RSS, {} GPUs + {} prepared claims",
            report.memory.gpus, report.memory.prepared_claims
        ),
        mib(report.memory.prepared_rss_kib),
        12.0,
        "MiB",
    ));
    let soak = &report.soak;
    checks.push(at_most(
        "RSS growth over the soak",
        mib(soak.rss_after_kib) - mib(soak.rss_before_kib),
        1.0,
        "MiB",
    ));
    checks.push(at_most(
        "open fds growth over the soak",
        soak.fds_after as f64 - soak.fds_before as f64,
        0.0,
        "fds",
    ));
    if !report.startup.is_empty() {
        let registered: Vec<f64> = report.startup.iter().map(|s| s.to_registered_ms).collect();
        checks.push(at_most(
            "start -> registered (median)",
            median(&registered),
            100.0,
            "ms",
        ));
    }
    if let Some(largest) = report.publishing.last() {
        checks.push(at_most(
            &format!("slice writes per slice ({} devices)", largest.devices),
            largest.slice_writes as f64 / largest.slices.max(1) as f64,
            1.0,
            "requests",
        ));
    }
    checks
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

fn total(counts: &BTreeMap<String, usize>) -> usize {
    counts.values().sum()
}

/// `<what>, <count> calls: p50 <µs> µs, p99 <µs> µs` on a line of its own.
fn write_calls(out: &mut String, what: &str, calls: &Summary) {
    let _ = writeln!(
        out,
        "{what}, {} calls: p50 {:.0} µs, p99 {:.0} µs",
        calls.count, calls.p50_us, calls.p99_us
    );
}

/// The patterns of issue 21 side by side with the reference plugin, and gpupool's ratios.
fn write_patterns(out: &mut String, report: &Report) {
    if report.patterns.is_empty() {
        return;
    }
    let pacing = &report.pacing;
    let _ = writeln!(
        out,
        "\npatterns (fractional claims; realistic: a new pod every {} ms, living {} ms; serial: one claim, a pod re-created on it; re-prepare: one claim, the same pod prepared again):",
        pacing.interval_ms, pacing.lifetime_ms
    );
    let _ = writeln!(
        out,
        "{:<10} {:<10} {:>6} | {:>28} | {:>28} | {:>19} | {:>11}",
        "pattern",
        "plugin",
        "cycles",
        "prepare p50/p95/p99 (µs)",
        "unprepare p50/p95/p99 (µs)",
        "GETs/prepare (cache)",
        "writes/cycle"
    );
    let triple = |s: &Summary| format!("{:.0}/{:.0}/{:.0}", s.p50_us, s.p95_us, s.p99_us);
    for run in &report.patterns {
        let _ = writeln!(
            out,
            "{:<10} {:<10} {:>6} | {:>28} | {:>28} | {:>12.2} ({:.2}) | {:>11.2}",
            run.pattern.label(),
            run.plugin.label(),
            run.cycles,
            triple(&run.prepare),
            triple(&run.unprepare),
            run.gets_per_prepare,
            run.cached_gets_per_prepare,
            run.writes_per_cycle
        );
    }
    for pattern in [Pattern::Realistic, Pattern::Serial, Pattern::Reprepare] {
        let r = |figure: fn(&PatternRun) -> f64| ratio(report, pattern, figure);
        if let (Some(p50), Some(p99), Some(u50)) = (
            r(|r| r.prepare.p50_us),
            r(|r| r.prepare.p99_us),
            r(|r| r.unprepare.p50_us),
        ) {
            let _ = writeln!(
                out,
                "gpupool / reference, {}: prepare p50 {p50:.2}x, p99 {p99:.2}x; unprepare p50 {u50:.2}x",
                pattern.label()
            );
        }
    }
}

/// The report as the table the bench prints.
pub fn render_table(report: &Report) -> String {
    let mut out = String::new();
    let m = &report.machine;
    let _ = writeln!(
        out,
        "machine: {} CPU(s), {}, {} MiB RAM, kernel {}; bench {} build; driver {}",
        m.cpus,
        m.cpu_model,
        m.memory_mib,
        m.kernel,
        if m.debug_build { "debug" } else { "release" },
        report.driver_binary
    );
    let _ = writeln!(
        out,
        "fake GPUs: {}{}",
        report.gpus,
        if report.short { " (--short)" } else { "" }
    );
    if report.api.server.starts_with("kube-apiserver") {
        let _ = writeln!(out, "API server: {}\n", report.api.server);
    } else {
        let _ = writeln!(
            out,
            "API server: {}, profile {} (seed {}, watch cache lag {:.1} ms)\n",
            report.api.server,
            report.api.profile,
            report.api.seed,
            report.api.cache_lag_us / 1e3
        );
    }
    let _ = writeln!(
        out,
        "folders: state on {}, CDI and run folders on {}\n",
        report.state_folders, report.runtime_folders
    );

    let _ = writeln!(
        out,
        "{:<10} {:>4} {:>6} | {:>34} | {:>34} | {:>9}",
        "claims",
        "conc",
        "cycles",
        "prepare p50/p95/p99/max (µs)",
        "unprepare p50/p95/p99/max (µs)",
        "cycles/s"
    );
    for cell in &report.latency {
        let quad = |s: &Summary| {
            format!(
                "{:.0}/{:.0}/{:.0}/{:.0}",
                s.p50_us, s.p95_us, s.p99_us, s.max_us
            )
        };
        let _ = writeln!(
            out,
            "{:<10} {:>4} {:>6} | {:>34} | {:>34} | {:>9.1}",
            cell.kind.label(),
            cell.concurrency,
            cell.cycles,
            quad(&cell.prepare),
            quad(&cell.unprepare),
            cell.cycles_per_second
        );
    }

    let get = &report.api_get_claim;
    write_calls(&mut out, "API claim GET (bench client -> API server)", get);
    let cached = &report.api_get_claim_cached;
    write_calls(
        &mut out,
        "API claim GET resourceVersion=0 (watch cache)",
        cached,
    );
    let _ = writeln!(
        out,
        "floors: quorum-read {:.0} µs, cached-read {:.0} µs (cached-read + 0.4 ms = {:.0} µs)",
        get.p50_us,
        cached.p50_us,
        cached.p50_us + 400.0
    );
    let calls = &report.api_requests;
    let kinds: Vec<String> = calls
        .by_kind
        .iter()
        .map(|(kind, n)| format!("{kind} {:.2}", *n as f64 / calls.cycles.max(1) as f64))
        .collect();
    let _ = writeln!(
        out,
        "api requests per cycle (driver, {} cycles): reads {:.2} (from the cache {:.2}), writes {:.2}{}",
        calls.cycles,
        calls.reads_per_cycle,
        calls.cached_reads_per_cycle,
        calls.writes_per_cycle,
        if kinds.is_empty() {
            String::new()
        } else {
            format!(" ({})", kinds.join(", "))
        }
    );
    write_calls(
        &mut out,
        "prepare of a claim already prepared (no API call, no file)",
        &report.repeat_prepare,
    );

    write_patterns(&mut out, report);

    let mem = &report.memory;
    let _ = writeln!(
        out,
        "\nRSS: idle with {} GPUs {:.1} MiB (anon {:.1}); with {} claims prepared {:.1} MiB (anon {:.1})",
        mem.gpus,
        mib(mem.idle_rss_kib),
        mib(mem.idle_rss_anon_kib),
        mem.prepared_claims,
        mib(mem.prepared_rss_kib),
        mib(mem.prepared_rss_anon_kib)
    );
    let _ = writeln!(
        out,
        "checkpoint (snapshot + log) with {} claims prepared: {:.1} KiB",
        mem.prepared_claims,
        mem.prepared_checkpoint_bytes as f64 / 1024.0
    );
    let soak = &report.soak;
    let _ = writeln!(
        out,
        "soak: {} cycles ({} callers) in {:.1} s; RSS {:.1} -> {:.1} MiB ({:+.2} MiB); fds {} -> {} ({:+})",
        soak.cycles,
        soak.concurrency,
        soak.seconds,
        mib(soak.rss_before_kib),
        mib(soak.rss_after_kib),
        mib(soak.rss_after_kib) - mib(soak.rss_before_kib),
        soak.fds_before,
        soak.fds_after,
        soak.fds_after as i64 - soak.fds_before as i64
    );

    let _ = writeln!(
        out,
        "\nstart-up (spawn -> registered / -> slices published):"
    );
    for (i, s) in report.startup.iter().enumerate() {
        let _ = writeln!(
            out,
            "  run {}: {:.1} ms / {:.1} ms",
            i + 1,
            s.to_registered_ms,
            s.to_slices_ms
        );
    }
    if report.startup.len() > 1 {
        let registered: Vec<f64> = report.startup.iter().map(|s| s.to_registered_ms).collect();
        let published: Vec<f64> = report.startup.iter().map(|s| s.to_slices_ms).collect();
        let _ = writeln!(
            out,
            "  median: {:.1} ms / {:.1} ms",
            median(&registered),
            median(&published)
        );
    }

    let _ = writeln!(
        out,
        "\n{:>5} {:>7} {:>6} {:>9} {:>12} {:>14} {:>14}",
        "nodes", "devices", "slices", "seconds", "slice writes", "driver reqs", "reqs +settle"
    );
    for p in &report.publishing {
        let _ = writeln!(
            out,
            "{:>5} {:>7} {:>6} {:>9.3} {:>12} {:>14} {:>14}",
            p.nodes,
            p.devices,
            p.slices,
            p.seconds,
            p.slice_writes,
            total(&p.requests),
            total(&p.requests_after_settle)
        );
    }
    if let Some(largest) = report.publishing.last() {
        let _ = writeln!(
            out,
            "driver requests by kind ({} nodes, until settled):",
            largest.nodes
        );
        for (kind, n) in &largest.requests_after_settle {
            let _ = writeln!(out, "  {n:>6}  {kind}");
        }
    }
    if !report.targets.is_empty() {
        let _ = writeln!(
            out,
            "\ntargets (issues 8 and 21; release build, 2 cores; issue 21's with --api-profile real):"
        );
        for t in &report.targets {
            let _ = writeln!(
                out,
                "  {:<6} {:<44} {:>10.2} {} (limit {} {})",
                if t.met { "met" } else { "MISSED" },
                t.target,
                t.measured,
                t.unit,
                t.limit,
                t.unit
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Report {
        let summary = Summary {
            count: 10,
            p50_us: 200.0,
            p95_us: 400.0,
            p99_us: 900.0,
            max_us: 1500.0,
            mean_us: 250.0,
        };
        Report {
            machine: Machine {
                cpus: 2,
                cpu_model: "Test CPU".into(),
                memory_mib: 4096,
                kernel: "6.1".into(),
                debug_build: false,
            },
            driver_binary: "target/release/gpupool-driver".into(),
            state_folders: "ext4 (/tmp/b)".into(),
            runtime_folders: "tmpfs (/dev/shm/c)".into(),
            short: false,
            api: ApiSettings {
                server: "the API server emulator".into(),
                profile: ApiProfile::Real,
                seed: 3,
                cache_lag_us: 1000.0,
            },
            gpus: "a100-40gb:8".into(),
            latency: vec![LatencyCell {
                kind: ClaimKind::Fractional,
                concurrency: 4,
                cycles: 10,
                prepare: summary,
                unprepare: summary,
                seconds: 0.5,
                cycles_per_second: 20.0,
            }],
            memory: Memory {
                gpus: 8,
                idle_rss_kib: 8 * 1024,
                idle_rss_anon_kib: 3 * 1024,
                prepared_claims: 256,
                prepared_rss_kib: 10 * 1024,
                prepared_rss_anon_kib: 5 * 1024,
                prepared_checkpoint_bytes: 700 * 1024,
            },
            soak: Soak {
                cycles: 100,
                concurrency: 4,
                seconds: 1.0,
                rss_before_kib: 10 * 1024,
                rss_after_kib: 10 * 1024 + 512,
                fds_before: 20,
                fds_after: 20,
            },
            startup: vec![Startup {
                to_registered_ms: 40.0,
                to_slices_ms: 60.0,
            }],
            publishing: vec![Publishing {
                nodes: 8,
                devices: 64,
                slices: 8,
                seconds: 0.25,
                slice_writes: 8,
                requests: BTreeMap::from([("POST resourceslices".to_string(), 8)]),
                requests_after_settle: BTreeMap::from([
                    ("POST resourceslices".to_string(), 8),
                    ("GET nodes".to_string(), 8),
                ]),
            }],
            api_get_claim: summary,
            api_get_claim_cached: Summary {
                p50_us: 800.0,
                ..summary
            },
            api_requests: CycleRequests {
                cycles: 10,
                reads: 10,
                cached_reads: 5,
                writes: 20,
                reads_per_cycle: 1.0,
                cached_reads_per_cycle: 0.5,
                writes_per_cycle: 2.0,
                by_kind: BTreeMap::from([
                    ("GET resourceclaims".to_string(), 10),
                    ("PATCH resourceclaims/status".to_string(), 20),
                ]),
            },
            repeat_prepare: summary,
            patterns: Vec::new(),
            pacing: Pacing {
                interval_ms: 20,
                lifetime_ms: 1000,
            },
            targets: Vec::new(),
        }
    }

    fn pattern_run(pattern: Pattern, plugin: Plugin, p50: f64, p99: f64, gets: f64) -> PatternRun {
        let summary = |p50: f64, p99: f64| Summary {
            count: 100,
            p50_us: p50,
            p95_us: p99,
            p99_us: p99,
            max_us: p99,
            mean_us: p50,
        };
        PatternRun {
            pattern,
            plugin,
            cycles: 100,
            prepare: summary(p50, p99),
            unprepare: summary(p50 / 2.0, p99 / 2.0),
            gets_per_prepare: gets,
            cached_gets_per_prepare: if plugin == Plugin::Gpupool { gets } else { 0.0 },
            writes_per_cycle: if plugin == Plugin::Gpupool { 1.0 } else { 0.0 },
        }
    }

    #[test]
    fn patterns_are_judged_against_the_reference_run_beside_them() {
        let mut report = sample();
        report.patterns = vec![
            // Realistic: half the reference's p50 and p99, one GET: met.
            pattern_run(Pattern::Realistic, Plugin::Gpupool, 1000.0, 3000.0, 1.0),
            pattern_run(Pattern::Realistic, Plugin::Reference, 2000.0, 6000.0, 1.0),
            // Serial: p99 above half, two GETs per prepare: missed.
            pattern_run(Pattern::Serial, Plugin::Gpupool, 1000.0, 4000.0, 2.0),
            pattern_run(Pattern::Serial, Plugin::Reference, 2500.0, 6000.0, 1.0),
        ];
        let checks = check_targets(&report);
        assert!(verdict(&checks, "realistic: prepare p50 / reference"));
        assert!(verdict(&checks, "realistic: prepare p99 / reference"));
        assert!(verdict(&checks, "realistic: unprepare p50 / reference"));
        assert!(verdict(&checks, "realistic: claim GETs per prepare"));
        assert!(verdict(&checks, "serial: prepare p50 / reference"));
        assert!(!verdict(&checks, "serial: prepare p99 / reference"));
        assert!(!verdict(&checks, "serial: claim GETs per prepare"));

        report.targets = checks;
        let table = render_table(&report);
        assert!(
            table.contains(
                "gpupool / reference, serial: prepare p50 0.40x, p99 0.67x; unprepare p50 0.40x"
            ),
            "{table}"
        );
        assert!(
            table.contains("MISSED serial: prepare p99 / reference"),
            "{table}"
        );
        assert!(
            table.contains("a new pod every 20 ms, living 1000 ms"),
            "{table}"
        );
    }

    fn verdict(checks: &[TargetCheck], prefix: &str) -> bool {
        checks
            .iter()
            .find(|c| c.target.starts_with(prefix))
            .unwrap_or_else(|| panic!("no check {prefix}: {checks:?}"))
            .met
    }

    #[test]
    fn targets_are_judged_against_the_issue_limits() {
        let mut report = sample();
        let serial = LatencyCell {
            concurrency: 1,
            cycles_per_second: 15.0,
            ..report.latency[0].clone()
        };
        report.latency.insert(0, serial);
        let checks = check_targets(&report);
        // p50 200 µs <= 250, p99 900 µs <= 1 ms, 20/15 = 1.33x < 2x.
        assert!(verdict(&checks, "fractional prepare p50"));
        assert!(verdict(&checks, "fractional prepare p99"));
        assert!(!verdict(&checks, "fractional throughput"));
        // No whole-card cells in the sample: no whole-card verdicts.
        assert!(checks.iter().all(|c| !c.target.starts_with("whole")));
        assert!(verdict(&checks, "RSS, 8 GPUs + 256"));
        assert!(verdict(&checks, "RSS growth"));
        assert!(verdict(&checks, "open fds"));
        assert!(verdict(&checks, "start -> registered"));
        assert!(verdict(&checks, "slice writes per slice"));

        report.memory.prepared_rss_kib = 13 * 1024;
        report.soak.fds_after = 21;
        report.publishing[0].slice_writes = 16;
        let checks = check_targets(&report);
        assert!(!verdict(&checks, "RSS, 8 GPUs + 256"));
        assert!(!verdict(&checks, "open fds"));
        assert!(!verdict(&checks, "slice writes per slice"));
    }

    #[test]
    fn table_lists_missed_targets() {
        let mut report = sample();
        report.memory.prepared_rss_kib = 30 * 1024;
        report.targets = check_targets(&report);
        let table = render_table(&report);
        assert!(
            table.contains("MISSED RSS, 8 GPUs + 256 prepared claims"),
            "{table}"
        );
        assert!(table.contains("30.00 MiB (limit 12 MiB)"), "{table}");
    }

    #[test]
    fn table_shows_every_measurement() {
        let table = render_table(&sample());
        assert!(table.contains("2 CPU(s), Test CPU"), "{table}");
        assert!(table.contains("fractional"), "{table}");
        assert!(table.contains("200/400/900/1500"), "{table}");
        assert!(table.contains("20.0"), "{table}");
        assert!(
            table.contains(
                "API claim GET (bench client -> API server), 10 calls: p50 200 µs, p99 900 µs"
            ),
            "{table}"
        );
        assert!(
            table.contains("idle with 8 GPUs 8.0 MiB (anon 3.0)"),
            "{table}"
        );
        assert!(
            table.contains("256 claims prepared 10.0 MiB (anon 5.0)"),
            "{table}"
        );
        assert!(table.contains("(+0.50 MiB)"), "{table}");
        assert!(
            table.contains("checkpoint (snapshot + log) with 256 claims prepared: 700.0 KiB"),
            "{table}"
        );
        assert!(table.contains("fds 20 -> 20 (+0)"), "{table}");
        assert!(table.contains("40.0 ms / 60.0 ms"), "{table}");
        assert!(table.contains("       8  GET nodes"), "{table}");
        assert!(
            table.contains("profile real (seed 3, watch cache lag 1.0 ms)"),
            "{table}"
        );
        assert!(
            table.contains(
                "floors: quorum-read 200 µs, cached-read 800 µs (cached-read + 0.4 ms = 1200 µs)"
            ),
            "{table}"
        );
        assert!(
            table.contains("api requests per cycle (driver, 10 cycles): reads 1.00 (from the cache 0.50), writes 2.00 (GET resourceclaims 1.00, PATCH resourceclaims/status 2.00)"),
            "{table}"
        );
    }

    #[test]
    fn json_names_the_fields_a_reader_looks_for() {
        let json = serde_json::to_value(sample()).unwrap();
        assert_eq!(json["latency"][0]["kind"], "fractional");
        assert_eq!(json["latency"][0]["prepare"]["p99_us"], 900.0);
        assert_eq!(json["memory"]["prepared_rss_kib"], 10240);
        assert_eq!(json["publishing"][0]["slice_writes"], 8);
        assert_eq!(json["api"]["profile"], "real");
        assert_eq!(json["api_get_claim_cached"]["p50_us"], 800.0);
        assert_eq!(json["api_requests"]["writes_per_cycle"], 2.0);
    }
}

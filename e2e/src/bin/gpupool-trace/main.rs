//! `gpupool-trace`: Alibaba's GPU-sharing trace (cluster-trace-gpu-v2023, "openb") through the real
//! kube-scheduler v1.36 by the FGD paper's method (issue 31), in each mode side by side. The trace
//! folder comes from `--trace-dir` or `GPUPOOL_TRACE_DIR`, the control plane binaries from
//! `GPUPOOL_KUBE_BIN` (see README). Prints a table; `--json` and `--csv` write the runs and their
//! curves. `plot_trace.py` beside this file plots the JSON.

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use gpupool_e2e::harness::{init_stderr_tracing, two_worker_runtime};
use gpupool_e2e::trace::runner::{mean, run, sd, RunResult, RunSpec, TRACE_DIR_ENV};
use gpupool_e2e::trace::Mode;

#[derive(Parser, Debug)]
#[command(about = "Alibaba's GPU-sharing trace through the real kube-scheduler, per mode")]
struct Args {
    /// The trace folder (`openb/` as published).
    #[arg(long, env = TRACE_DIR_ENV)]
    trace_dir: PathBuf,
    /// Task list variants, comma-separated: `default` reads `openb_pod_list_default.csv`.
    #[arg(long, default_value = "default", value_delimiter = ',')]
    traces: Vec<String>,
    /// Modes, comma-separated: whole, shares, shares-affinity, shares-packed, shares-packed-extended, shares-affinity-gpu-packed.
    #[arg(
        long,
        default_value = "whole,shares,shares-affinity,shares-packed,shares-packed-extended,shares-affinity-gpu-packed",
        value_delimiter = ','
    )]
    modes: Vec<String>,
    /// Seeds, comma-separated (the FGD paper's are 42..=51).
    #[arg(long, default_value = "42", value_delimiter = ',')]
    seeds: Vec<u64>,
    /// The share of the node list to use (every n-th node), e.g. 0.1 for a short run.
    #[arg(long, default_value_t = 1.0)]
    node_fraction: f64,
    /// etcd with fsync (the default runs it without: placement is measured, not write cost).
    #[arg(long)]
    etcd_fsync: bool,
    /// Write every run (curves included) as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write the curves as CSV here (trace, mode, seed, arrived %, unallocated %).
    #[arg(long)]
    csv: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    init_stderr_tracing();
    let modes = args
        .modes
        .iter()
        .map(|m| Mode::parse(m))
        .collect::<Result<Vec<_>, _>>()?;
    let runtime = two_worker_runtime().context("starting the async runtime")?;
    let mut results: Vec<RunResult> = Vec::new();
    for trace in &args.traces {
        for &seed in &args.seeds {
            for &mode in &modes {
                let spec = RunSpec {
                    trace_dir: args.trace_dir.clone(),
                    trace: trace.clone(),
                    mode,
                    seed,
                    node_fraction: args.node_fraction,
                    etcd_fsync: args.etcd_fsync,
                };
                let result = runtime
                    .block_on(run(&spec))
                    .with_context(|| format!("{trace} {} seed {seed}", mode.name()))?;
                eprintln!("{}", row(&result));
                results.push(result);
                // Written after every run, so a long series keeps what it measured.
                write_outputs(&args, &results)?;
            }
        }
    }
    print!("{}", table(&results));
    Ok(())
}

fn write_outputs(args: &Args, results: &[RunResult]) -> anyhow::Result<()> {
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(results)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &args.csv {
        let mut out = String::from("trace,mode,seed,arrived_percent,unallocated_percent\n");
        for r in results {
            for p in &r.curve {
                out.push_str(&format!(
                    "{},{},{},{:.3},{:.3}\n",
                    r.trace,
                    r.mode.name(),
                    r.seed,
                    p.arrived_percent,
                    p.unallocated_percent
                ));
            }
        }
        std::fs::write(path, out).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn pct(v: Option<f64>) -> String {
    v.map(|v| format!("{v:.2}")).unwrap_or_else(|| "-".into())
}

fn row(r: &RunResult) -> String {
    format!(
        "{} {} seed {}: {} nodes {} GPUs {} tasks | unallocated at 100 % {} at 130 % {:.2} | placed {} refused {} | {:.1} pods/s",
        r.trace,
        r.mode.name(),
        r.seed,
        r.nodes,
        r.gpus,
        r.tasks,
        pct(r.unallocated_at_100),
        r.unallocated_at_130,
        r.placed,
        r.refused,
        r.pods_per_second
    )
}

/// Per trace and mode: the mean (and sd) over the seeds.
fn table(results: &[RunResult]) -> String {
    let mut out = String::from(
        "| trace | mode | seeds | unallocated % at 100 % | at 130 % | placed | refused | pods/s |\n|---|---|---|---|---|---|---|---|\n",
    );
    let mut keys: Vec<(String, Mode)> = results.iter().map(|r| (r.trace.clone(), r.mode)).collect();
    keys.dedup();
    keys.sort();
    keys.dedup();
    for (trace, mode) in keys {
        let runs: Vec<&RunResult> = results
            .iter()
            .filter(|r| r.trace == trace && r.mode == mode)
            .collect();
        let at100 = mean(runs.iter().filter_map(|r| r.unallocated_at_100));
        let sd100 = sd(runs.iter().filter_map(|r| r.unallocated_at_100));
        let at130 = mean(runs.iter().map(|r| r.unallocated_at_130));
        let placed = mean(runs.iter().map(|r| r.placed as f64)).unwrap_or_default();
        let refused = mean(runs.iter().map(|r| r.refused as f64)).unwrap_or_default();
        let rate = mean(runs.iter().map(|r| r.pods_per_second)).unwrap_or_default();
        out.push_str(&format!(
            "| {trace} | {} | {} | {}{} | {} | {placed:.0} | {refused:.0} | {rate:.1} |\n",
            mode.name(),
            runs.len(),
            pct(at100),
            sd100.map(|s| format!(" (sd {s:.2})")).unwrap_or_default(),
            pct(at130),
        ));
    }
    out
}

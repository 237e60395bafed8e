//! `--soak S`: four containers share one card for S seconds the way a cluster's workloads do:
//! three inference servers (bursts of work from a tenth of a second to seconds, quiet from a
//! millisecond to a minute; the second runs two worker processes, each with its own traffic) and
//! one training job (steps of seconds, waits for its data loader of up to 200 ms, and a pause
//! from a third to three fifths of the run, when the servers have the card to themselves). Each
//! process reports when its kernels completed (`launch --timeline-ms`); over sliding windows of
//! 2 s the soak judges each container's share of the card against its limit:
//! - in a window in which a container worked throughout, it got at least its limit less 5 points
//!   (DEFAULT: the others, busy or not, never take more than their limits from it);
//! - in a window in which every container worked throughout or not at all, the card went to those
//!   working in proportion to their limits, within 5 points (work-conserving, proportional).
//!
//! and reports the worst wait of any launch call, against the bound (250 ms), and the launches
//! that waited their bound and went ahead unarbitrated.

use super::{lines, Machine};
use gpupool_vgpu::traffic::{alternating, Lcg};
use serde_json::{json, Value};
use std::process::Child;

const KERNEL_US: u64 = 2000;
const BIN_MS: u64 = 100;
const WINDOW_MS: u64 = 2000;
const STEP_MS: u64 = 500;
/// The first seconds are left out: the processes start and the card's first turns settle.
const WARM_UP_MS: u64 = 2000;

struct Container {
    name: &'static str,
    limit: u32,
    /// Each process's phases: milliseconds of work and idleness, alternately, from its start.
    processes: Vec<Vec<u64>>,
}

fn plan(seconds: u64, seed: u64) -> Vec<Container> {
    let total = seconds * 1000;
    let mut rng = Lcg(seed);
    let mut inference = || alternating(&rng.phases(total, (100, 5_000), (1, 60_000)));
    let (a, b1, b2, c) = (inference(), inference(), inference(), inference());
    // Training stops for the middle of the run (an evaluation, a checkpoint to slow storage):
    // the servers then have the card to themselves, alone or in twos.
    let mut steps = Lcg(seed ^ 0x5eed);
    let mut training = steps.phases(total / 3, (2_000, 20_000), (1, 200));
    training.extend(
        steps
            .phases(total - total * 3 / 5, (2_000, 20_000), (1, 200))
            .into_iter()
            .map(|(a, b)| (a + total * 3 / 5, b + total * 3 / 5)),
    );
    let training = alternating(&training);
    vec![
        Container {
            name: "infer-a",
            limit: 20,
            processes: vec![a],
        },
        Container {
            name: "infer-b",
            limit: 20,
            processes: vec![b1, b2],
        },
        Container {
            name: "infer-c",
            limit: 20,
            processes: vec![c],
        },
        Container {
            name: "train",
            limit: 40,
            processes: vec![training],
        },
    ]
}

/// Whether a process with `phases`, started at `start_ms`, works throughout [from, to) (Some(true)),
/// not at all (Some(false)), or partly (None).
fn working(phases: &[u64], start_ms: u64, from: u64, to: u64) -> Option<bool> {
    let mut at = start_ms;
    let (mut all, mut none) = (true, true);
    for (i, &length) in phases.iter().enumerate() {
        let (a, b) = (at, at + length);
        at = b;
        if b <= from || a >= to {
            continue;
        }
        if i % 2 == 0 {
            none = false;
            if !(a <= from && to <= b) {
                all = false;
            }
        } else {
            all = false;
        }
        if a >= to {
            break;
        }
    }
    if at < to {
        // After the last phase: work until the end.
        none = false;
        if at > from {
            all = false;
        }
    }
    match (all, none) {
        (true, _) => Some(true),
        (_, true) => Some(false),
        _ => None,
    }
}

/// `cuda-probe launch` keeping the card busy as PyTorch eager does, for `seconds`, reporting its
/// timeline, with `extra` arguments.
fn launch_args(seconds: u64, extra: &[&str]) -> Vec<String> {
    let (kernel_us, seconds, bin) = (
        KERNEL_US.to_string(),
        seconds.to_string(),
        BIN_MS.to_string(),
    );
    [
        "launch",
        "--inflight",
        "0",
        "--kernel-us",
        &kernel_us,
        "--seconds",
        &seconds,
        "--timeline-ms",
        &bin,
        "--no-drain",
    ]
    .iter()
    .chain(extra)
    .map(|s| s.to_string())
    .collect()
}

/// What the card gives one program alone without the library, in kernels per bin.
fn capacity(machine: &Machine) -> Result<f64, String> {
    let args = launch_args(3, &[]);
    let line = machine.run(None, "capacity", &args, "timeline")?;
    let bins: Vec<f64> = line["kernels"]
        .as_array()
        .ok_or("no timeline")?
        .iter()
        .filter_map(Value::as_f64)
        .collect();
    // The middle of the run: past the start, before the last bins the run left queued.
    let middle = &bins[bins.len().min(10)..bins.len().saturating_sub(3).max(bins.len().min(10))];
    if middle.is_empty() {
        return Err(format!("capacity: too short a timeline: {line}"));
    }
    Ok(middle.iter().sum::<f64>() / middle.len() as f64)
}

pub fn soak(machine: &Machine, seconds: u64, seed: u64) -> Result<Value, String> {
    let capacity = capacity(machine)?;
    let plan = plan(seconds, seed);
    let mut children: Vec<(usize, usize, Child)> = Vec::new();
    for (c, container) in plan.iter().enumerate() {
        let limit = container.limit.to_string();
        for (p, phases) in container.processes.iter().enumerate() {
            let phases = phases
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(",");
            let args = launch_args(seconds, &["--phases", &phases]);
            let env: [(&str, &str); 1] = [("CUDA_DEVICE_SM_LIMIT", &limit)];
            let child = machine
                .command(Some(&env), container.name, &args)
                .spawn()
                .map_err(|e| e.to_string())?;
            children.push((c, p, child));
        }
    }
    // Per process: (start, bins), worst launch call.
    let mut timelines: Vec<Vec<(u64, Vec<f64>)>> = plan.iter().map(|_| Vec::new()).collect();
    let mut starts: Vec<Vec<u64>> = plan.iter().map(|_| Vec::new()).collect();
    let mut worst_wait_ms: f64 = 0.0;
    for (c, _, child) in children {
        let out = child.wait_with_output().map_err(|e| e.to_string())?;
        let all = lines(&out.stdout);
        let timeline = all
            .iter()
            .find(|l| l["op"] == "timeline")
            .ok_or_else(|| format!("{}: no timeline", plan[c].name))?;
        let launch = all
            .iter()
            .find(|l| l["op"] == "launch")
            .ok_or_else(|| format!("{}: no launch line", plan[c].name))?;
        if launch["result"] != 0 {
            return Err(format!("{}: {launch}", plan[c].name));
        }
        worst_wait_ms = worst_wait_ms.max(launch["launch_call_max_ms"].as_f64().unwrap_or(0.0));
        let start = timeline["start_unix_ms"].as_u64().ok_or("no start")?;
        let bins = timeline["kernels"]
            .as_array()
            .ok_or("no kernels")?
            .iter()
            .filter_map(Value::as_f64)
            .collect();
        starts[c].push(start);
        timelines[c].push((start, bins));
    }
    let origin = starts.iter().flatten().copied().max().ok_or("no process")?;
    // A container's share of the card in [from, to) (unix ms): its kernels' time over the
    // window, against the card alone.
    let share = |c: usize, from: u64, to: u64| -> f64 {
        let mut kernels = 0.0;
        for (start, bins) in &timelines[c] {
            for (i, k) in bins.iter().enumerate() {
                // The part of the bin inside the window (bins follow each process's own start).
                let at = start + i as u64 * BIN_MS;
                let overlap = (at + BIN_MS).min(to).saturating_sub(at.max(from));
                kernels += k * overlap as f64 / BIN_MS as f64;
            }
        }
        kernels / (capacity * (to - from) as f64 / BIN_MS as f64)
    };
    let state = |c: usize, from: u64, to: u64| -> Option<bool> {
        let each: Vec<Option<bool>> = plan[c]
            .processes
            .iter()
            .zip(&starts[c])
            .map(|(phases, &start)| working(phases, start, from, to))
            .collect();
        if each.contains(&Some(true)) {
            Some(true)
        } else if each.iter().all(|s| *s == Some(false)) {
            Some(false)
        } else {
            None
        }
    };
    let end = origin + seconds * 1000 - 1000;
    let mut rows: Vec<Value> = Vec::new();
    let mut busy_min: Vec<f64> = vec![f64::INFINITY; plan.len()];
    let mut busy_windows = vec![0u32; plan.len()];
    let mut below = vec![0u32; plan.len()];
    let mut steady_windows = 0u32;
    let mut steady_dev: Vec<Vec<f64>> = plan.iter().map(|_| Vec::new()).collect();
    let mut from = origin + WARM_UP_MS;
    while from + WINDOW_MS <= end {
        let to = from + WINDOW_MS;
        let states: Vec<Option<bool>> = (0..plan.len()).map(|c| state(c, from, to)).collect();
        let steady = states.iter().all(Option::is_some);
        let busy_limit: u32 = plan
            .iter()
            .zip(&states)
            .filter(|(_, s)| **s == Some(true))
            .map(|(c, _)| c.limit)
            .sum();
        steady_windows += (steady && busy_limit > 0) as u32;
        for (c, container) in plan.iter().enumerate() {
            if states[c] != Some(true) {
                continue;
            }
            let got = share(c, from, to) * 100.0;
            busy_windows[c] += 1;
            busy_min[c] = busy_min[c].min(got);
            if got < container.limit as f64 - 5.0 {
                below[c] += 1;
            }
            if steady {
                let expected = 100.0 * container.limit as f64 / busy_limit as f64;
                steady_dev[c].push(got - expected);
            }
        }
        from += STEP_MS;
    }
    for (c, container) in plan.iter().enumerate() {
        let dev = &steady_dev[c];
        let worst = dev.iter().fold(0f64, |m, d| m.max(d.abs()));
        let mean = if dev.is_empty() {
            f64::NAN
        } else {
            dev.iter().map(|d| d.abs()).sum::<f64>() / dev.len() as f64
        };
        let outside = dev.iter().filter(|d| d.abs() > 5.0).count();
        rows.push(json!({
            "container": container.name,
            "limit": container.limit,
            "processes": container.processes.len(),
            "windows_busy_throughout": busy_windows[c],
            "min_share_when_busy": busy_min[c],
            "windows_below_limit_less_5": below[c],
            "steady_windows": dev.len(),
            "steady_mean_abs_deviation": mean,
            "steady_max_abs_deviation": worst,
            "steady_windows_outside_5": outside,
        }));
    }
    let arbiter =
        std::fs::read(machine.dir.path().join("arbiter").join("card0")).unwrap_or_default();
    Ok(json!({
        "seconds": seconds,
        "seed": seed,
        "window_ms": WINDOW_MS,
        "step_ms": STEP_MS,
        "capacity_kernels_per_bin": capacity,
        "steady_windows": steady_windows,
        "worst_launch_wait_ms": worst_wait_ms,
        "unarbitrated_launches": gpupool_vgpu::arbiter::unarbitrated_launches(&arbiter),
        "containers": rows,
    }))
}

pub fn print(soak: &Value) {
    println!(
        "soak: {} s, seed {}, windows of {} ms every {} ms; worst launch wait {:.1} ms (bound 250); {} launches unarbitrated",
        soak["seconds"], soak["seed"], soak["window_ms"], soak["step_ms"],
        soak["worst_launch_wait_ms"].as_f64().unwrap_or(f64::NAN),
        soak["unarbitrated_launches"]
    );
    println!(
        "{:<8} {:>5} {:>5} | {:>12} {:>9} {:>9} | {:>7} {:>9} {:>9} {:>8}",
        "",
        "limit",
        "procs",
        "busy windows",
        "min share",
        "< limit-5",
        "steady",
        "mean dev",
        "max dev",
        "outside 5"
    );
    for row in soak["containers"].as_array().into_iter().flatten() {
        let n = |k: &str| row[k].as_u64().unwrap_or(0);
        let f = |k: &str| row[k].as_f64().unwrap_or(f64::NAN);
        println!(
            "{:<8} {:>5} {:>5} | {:>12} {:>9.1} {:>9} | {:>7} {:>9.2} {:>9.2} {:>8}",
            row["container"].as_str().unwrap_or(""),
            n("limit"),
            n("processes"),
            n("windows_busy_throughout"),
            f("min_share_when_busy"),
            n("windows_below_limit_less_5"),
            n("steady_windows"),
            f("steady_mean_abs_deviation"),
            f("steady_max_abs_deviation"),
            n("steady_windows_outside_5"),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::working;

    #[test]
    fn a_window_is_worked_throughout_not_at_all_or_partly() {
        // Work 0-100, idle 100-300, then work on.
        let phases = [100, 200];
        assert_eq!(working(&phases, 1000, 1000, 1100), Some(true));
        assert_eq!(working(&phases, 1000, 1100, 1300), Some(false));
        assert_eq!(working(&phases, 1000, 1050, 1150), None);
        assert_eq!(working(&phases, 1000, 1300, 5000), Some(true));
        assert_eq!(working(&phases, 1000, 1250, 1350), None);
    }
}

//! vgpu-bench: what gpupool-vgpu costs per launch and per allocation, and how close its SM limit
//! gets, on the stand-in driver. It runs `cuda-probe` (next to it) as separate processes in each
//! configuration, side by side in one run, in ABBA order so that drift of a noisy machine falls
//! on every configuration alike, and reports medians and their ratio to the run without the
//! library. `vgpu-bench --help` says how; BENCHMARKS.md has figures and how to read them.

mod soak;

use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

const HELP: &str = "vgpu-bench: the cost of gpupool-vgpu per launch and allocation, on the stand-in driver

USAGE: vgpu-bench [--rounds R] [--launches N] [--allocs N] [--accuracy] [--accuracy-repeat K] [--json]
       vgpu-bench --soak S [--seed N] [--json]

  --rounds R           ABBA rounds (default 5): each runs every configuration forward, then backward
  --launches N         launch calls per probe run (default 20000)
  --allocs N           allocation/free pairs per probe run (default 5000)
  --accuracy           also measure the SM limit: two containers capped 30 and 70 on one card,
                       each one's share of the card over a common window of 3 s after a warm-up
                       of 1.5 s (kernels completed in it x their duration / 3 s)
  --accuracy-repeat K  runs of each accuracy row (default 1)
  --json               one JSON object instead of the tables
  --soak S             instead: four containers share one card for S seconds as a cluster's do
                       (three inference servers with bursts and idle gaps from 1 ms to a minute,
                       one of them two processes; a training job with data-loader waits), limits
                       20/20/20/40, DEFAULT; each one's share over sliding windows of 2 s against
                       its limit, the worst wait of a launch call, unarbitrated launches
  --seed N             the soak's traffic (default 1): a run is repeated exactly with its seed

Configurations: none (the stand-in alone), lib (the library preloaded, no limit), mem (a memory
limit of 8 GiB), sm (an SM limit of 50 % with policy FORCE: every launch takes the throttling
path; the median is a launch that found the gate open). Limited processes get the card's arbiter
file (GPUPOOL_VGPU_ARBITER_0), one per machine folder. It needs cuda-probe and the three
libraries next to it: cargo build --release -p gpupool-vgpu -p gpupool-standin-cuda
-p gpupool-standin-nvml -p gpupool-vgpu-probe. GPUPOOL_VGPU_LIBRARY names another build of the
library to measure instead (an older commit's, on the same stand-ins).
";

/// A configuration: its name and the environment the probe gets (`None`: no library).
struct Config {
    name: &'static str,
    env: Option<&'static [(&'static str, &'static str)]>,
    /// Whether allocations are measured (an SM limit leaves them untouched).
    allocs: bool,
}

const CONFIGS: &[Config] = &[
    Config {
        name: "none",
        env: None,
        allocs: true,
    },
    Config {
        name: "lib",
        env: Some(&[]),
        allocs: true,
    },
    Config {
        name: "mem",
        env: Some(&[("CUDA_DEVICE_MEMORY_LIMIT", "8g")]),
        allocs: true,
    },
    Config {
        name: "sm",
        env: Some(&[
            ("CUDA_DEVICE_SM_LIMIT", "50"),
            ("GPU_CORE_UTILIZATION_POLICY", "FORCE"),
        ]),
        allocs: false,
    },
];

/// What one probe run measures: (name, probe arguments, the fields of its result line).
fn measurements(
    launches: u64,
    allocs: u64,
) -> Vec<(&'static str, Vec<String>, &'static [&'static str])> {
    let n = |v: u64| v.to_string();
    vec![
        (
            "launch eager",
            vec![
                "bench-launch".into(),
                "--mode".into(),
                "eager".into(),
                "--count".into(),
                n(launches),
            ],
            &["ns_per_launch_median"],
        ),
        (
            "launch graph",
            vec![
                "bench-launch".into(),
                "--mode".into(),
                "graph".into(),
                "--count".into(),
                n(launches),
            ],
            &["ns_per_launch_median"],
        ),
        (
            "cuMemAlloc",
            vec![
                "bench-alloc".into(),
                "--path".into(),
                "cuMemAlloc".into(),
                "--count".into(),
                n(allocs),
            ],
            &["ns_alloc_median", "ns_free_median"],
        ),
        (
            "cuMemAllocAsync",
            vec![
                "bench-alloc".into(),
                "--path".into(),
                "cuMemAllocAsync".into(),
                "--count".into(),
                n(allocs),
            ],
            &["ns_alloc_median", "ns_free_median"],
        ),
    ]
}

struct Options {
    rounds: usize,
    launches: u64,
    allocs: u64,
    accuracy: bool,
    accuracy_repeat: usize,
    json: bool,
    soak: Option<u64>,
    seed: u64,
}

fn parse_options(args: &[String]) -> Result<Options, String> {
    let mut o = Options {
        rounds: 5,
        launches: 20_000,
        allocs: 5_000,
        accuracy: false,
        accuracy_repeat: 1,
        json: false,
        soak: None,
        seed: 1,
    };
    let mut i = 0;
    while i < args.len() {
        let value = |i: usize| -> Result<u64, String> {
            args.get(i + 1)
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| format!("{} needs a number", args[i]))
        };
        match args[i].as_str() {
            "--rounds" => o.rounds = value(i)?.max(1) as usize,
            "--launches" => o.launches = value(i)?,
            "--allocs" => o.allocs = value(i)?,
            "--accuracy-repeat" => o.accuracy_repeat = value(i)?.max(1) as usize,
            "--soak" => o.soak = Some(value(i)?.max(10)),
            "--seed" => o.seed = value(i)?,
            "--accuracy" => {
                o.accuracy = true;
                i += 1;
                continue;
            }
            "--json" => {
                o.json = true;
                i += 1;
                continue;
            }
            other => return Err(format!("unknown argument {other:?} (see --help)")),
        }
        i += 2;
    }
    Ok(o)
}

/// The newest file named `lib<stem>.so` (or `lib<stem>-<hash>.so` in deps/) next to us.
fn built_library(dir: &Path, stem: &str) -> Result<PathBuf, String> {
    let mut found: Vec<(std::time::SystemTime, PathBuf)> = Vec::new();
    for folder in [dir.to_path_buf(), dir.join("deps")] {
        for entry in std::fs::read_dir(&folder).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let ours = name == format!("lib{stem}.so")
                || (name.starts_with(&format!("lib{stem}-")) && name.ends_with(".so"));
            if let (true, Ok(meta)) = (ours, entry.metadata()) {
                found.push((meta.modified().map_err(|e| e.to_string())?, entry.path()));
            }
        }
    }
    found
        .into_iter()
        .max_by_key(|(time, _)| *time)
        .map(|(_, path)| path)
        .ok_or_else(|| format!("lib{stem}.so is not in {} (see --help)", dir.display()))
}

/// A folder standing for a machine: the stand-ins under their real names and the cards' state.
struct Machine {
    dir: tempfile::TempDir,
    probe: PathBuf,
    library: PathBuf,
}

impl Machine {
    fn new() -> Result<Machine, String> {
        let me = std::env::current_exe().map_err(|e| e.to_string())?;
        let here = me.parent().ok_or("no folder")?.to_path_buf();
        let probe = here.join("cuda-probe");
        if !probe.exists() {
            return Err(format!(
                "no cuda-probe next to {} (see --help)",
                me.display()
            ));
        }
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let lib = dir.path().join("lib");
        std::fs::create_dir(&lib).map_err(|e| e.to_string())?;
        for (stem, soname) in [
            ("gpupool_standin_cuda", "libcuda.so.1"),
            ("gpupool_standin_nvml", "libnvidia-ml.so.1"),
        ] {
            std::os::unix::fs::symlink(built_library(&here, stem)?, lib.join(soname))
                .map_err(|e| e.to_string())?;
        }
        // Another build of the library can be measured on the same stand-ins (an older commit's,
        // side by side): GPUPOOL_VGPU_LIBRARY, as for the tests.
        let library = match std::env::var_os("GPUPOOL_VGPU_LIBRARY") {
            Some(path) => PathBuf::from(path),
            None => built_library(&here, "gpupool_vgpu")?,
        };
        Ok(Machine {
            library,
            probe,
            dir,
        })
    }

    /// The probe in configuration `env` (None: without the library), in container `container`.
    fn command(&self, env: Option<&[(&str, &str)]>, container: &str, args: &[String]) -> Command {
        let mut c = Command::new(&self.probe);
        c.args(args)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("LD_LIBRARY_PATH", self.dir.path().join("lib"))
            .env(
                "GPUPOOL_STANDIN_STATE",
                self.dir.path().join("standin.state"),
            )
            .env("GPUPOOL_STANDIN_DEVICES", "1x80g:132")
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        if let Some(env) = env {
            let cache = self
                .dir
                .path()
                .join("containers")
                .join(container)
                .join("vgpu.cache");
            c.env("LD_PRELOAD", &self.library)
                .env("CUDA_DEVICE_MEMORY_SHARED_CACHE", cache);
            if env
                .iter()
                .any(|(k, _)| k.starts_with("CUDA_DEVICE_SM_LIMIT"))
            {
                c.env(
                    "GPUPOOL_VGPU_ARBITER_0",
                    self.dir.path().join("arbiter").join("card0"),
                );
            }
            for (k, v) in env {
                c.env(k, v);
            }
        }
        c
    }

    /// Runs the probe; the line of its `op`.
    fn run(
        &self,
        env: Option<&[(&str, &str)]>,
        container: &str,
        args: &[String],
        op: &str,
    ) -> Result<Value, String> {
        let out = self
            .command(env, container, args)
            .output()
            .map_err(|e| e.to_string())?;
        lines(&out.stdout)
            .into_iter()
            .find(|l| l["op"] == op)
            .ok_or_else(|| {
                format!(
                    "cuda-probe {args:?} printed no {op} line: {}",
                    String::from_utf8_lossy(&out.stdout)
                )
            })
    }
}

fn lines(stdout: &[u8]) -> Vec<Value> {
    String::from_utf8_lossy(stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    match values.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// The cost table: for each measurement and configuration, the median over every run of the
/// run's own median.
fn costs(machine: &Machine, o: &Options) -> Result<Vec<Value>, String> {
    let measurements = measurements(o.launches, o.allocs);
    // (measurement, field, config) -> per-run medians
    let mut samples: std::collections::BTreeMap<(usize, &str, &str), Vec<f64>> = Default::default();
    let forward: Vec<&Config> = CONFIGS.iter().collect();
    let order: Vec<&Config> = forward
        .iter()
        .chain(forward.iter().rev())
        .copied()
        .collect();
    for round in 0..o.rounds {
        for config in &order {
            for (m, (name, args, fields)) in measurements.iter().enumerate() {
                if name.starts_with("cu") && !config.allocs {
                    continue;
                }
                let op = if args[0] == "bench-launch" {
                    "bench_launch"
                } else {
                    "bench_alloc"
                };
                let line = machine.run(config.env, config.name, args, op)?;
                if line["result"].as_i64().is_some_and(|r| r != 0) {
                    return Err(format!("{name} in {} failed: {line}", config.name));
                }
                for field in *fields {
                    let v = line[*field]
                        .as_f64()
                        .ok_or_else(|| format!("{name} in {}: no {field}: {line}", config.name))?;
                    samples.entry((m, field, config.name)).or_default().push(v);
                }
            }
        }
        eprintln!("vgpu-bench: round {} of {} done", round + 1, o.rounds);
    }
    let mut rows = Vec::new();
    for (m, (name, _, fields)) in measurements.iter().enumerate() {
        for field in *fields {
            let mut row = json!({"measurement": name, "field": field});
            let base = samples
                .get_mut(&(m, field, "none"))
                .map(|v| median(v))
                .unwrap_or(f64::NAN);
            for config in CONFIGS {
                if let Some(v) = samples.get_mut(&(m, field, config.name)) {
                    let med = median(v);
                    row[config.name] = json!({"ns": med, "ratio": med / base, "runs": v.len()});
                }
            }
            rows.push(row);
        }
    }
    Ok(rows)
}

/// One accuracy row: two containers capped 30 and 70 saturate the card with `mode` launches
/// (`inflight` 0: no bound, as PyTorch eager); each one's share of the card over a common window
/// of 3 s after a warm-up of 1.5 s: the kernels that completed in it times their duration over the
/// window (`launch --window-...`). NVML's per-process utilisation is no measure of it: under
/// time-slicing both tenants of a saturated card read near 100. Returns the shares in percent.
fn accuracy_row(
    machine: &Machine,
    mode: &str,
    inflight: u32,
    kernel_us: u32,
    tag: &str,
) -> Result<(f64, f64), String> {
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|e| e.to_string())?
        .as_millis() as u64;
    let args: Vec<String> = vec![
        "launch".to_string(),
        "--mode".into(),
        mode.into(),
        "--seconds".into(),
        "4.8".into(),
        "--inflight".into(),
        inflight.to_string(),
        "--kernel-us".into(),
        kernel_us.to_string(),
        "--window-start-unix-ms".into(),
        (now_ms + 1500).to_string(),
        "--window-ms".into(),
        "3000".into(),
        "--no-drain".into(),
    ];
    let start = |limit: &'static str| -> Result<Child, String> {
        let env: &[(&str, &str)] = match limit {
            "30" => &[("CUDA_DEVICE_SM_LIMIT", "30")],
            _ => &[("CUDA_DEVICE_SM_LIMIT", "70")],
        };
        machine
            .command(Some(env), &format!("{tag}-{limit}"), &args)
            .spawn()
            .map_err(|e| e.to_string())
    };
    let share = |child: Child| -> f64 {
        child
            .wait_with_output()
            .ok()
            .and_then(|out| lines(&out.stdout).into_iter().find(|l| l["op"] == "launch"))
            .filter(|l| l["result"] == 0 && l["window_covered"] == true)
            .and_then(|l| l["window_busy_fraction"].as_f64())
            .map_or(f64::NAN, |f| f * 100.0)
    };
    let thirty = start("30")?;
    let seventy = start("70")?;
    Ok((share(thirty), share(seventy)))
}

fn accuracy(machine: &Machine, o: &Options) -> Result<Vec<Value>, String> {
    let rows: &[(&str, u32, u32, u32)] = &[
        ("eager", 0, 2000, 1),
        ("graph", 0, 2000, 4),
        ("eager", 2, 2000, 1),
        ("graph", 2, 2000, 4),
        ("eager", 8, 2000, 1),
        ("graph", 8, 2000, 4),
        ("eager", 2, 1000, 1),
    ];
    let mut out = Vec::new();
    for (i, &(mode, inflight, kernel_us, kernels)) in rows.iter().enumerate() {
        let mut runs = Vec::new();
        for run in 0..o.accuracy_repeat {
            let (a, b) =
                accuracy_row(machine, mode, inflight, kernel_us, &format!("acc{i}-{run}"))?;
            eprintln!("vgpu-bench: {mode} x{inflight} {kernel_us} us: 30 -> {a:.1}, 70 -> {b:.1}");
            runs.push(json!([a, b]));
        }
        out.push(json!({
            "mode": mode,
            "inflight": inflight,
            "kernel_us": kernel_us,
            "kernels_per_launch": kernels,
            "runs": runs,
        }));
    }
    Ok(out)
}

fn print_tables(o: &Options, cost: &[Value], acc: &[Value]) {
    println!(
        "cost per call, median of {} runs per configuration (ns; ratio to none)",
        2 * o.rounds
    );
    println!(
        "{:<16} {:<6} {:>16} {:>16} {:>16} {:>16}",
        "measurement", "call", "none", "lib", "mem", "sm"
    );
    for row in cost {
        let field = row["field"].as_str().unwrap_or("");
        let call = if field.contains("free") {
            "free"
        } else if field.contains("alloc") {
            "alloc"
        } else {
            "launch"
        };
        let cell = |c: &str| {
            let v = &row[c];
            if v.is_null() {
                "-".to_string()
            } else {
                format!(
                    "{:.0} ({:.2})",
                    v["ns"].as_f64().unwrap_or(f64::NAN),
                    v["ratio"].as_f64().unwrap_or(f64::NAN)
                )
            }
        };
        println!(
            "{:<16} {:<6} {:>16} {:>16} {:>16} {:>16}",
            row["measurement"].as_str().unwrap_or(""),
            call,
            cell("none"),
            cell("lib"),
            cell("mem"),
            cell("sm")
        );
    }
    if !acc.is_empty() {
        println!(
            "\nSM limits 30 / 70 on two containers, share of the card over a common window (%)"
        );
        for row in acc {
            let runs: Vec<String> = row["runs"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|r| {
                    format!(
                        "{:.1} / {:.1}",
                        r[0].as_f64().unwrap_or(f64::NAN),
                        r[1].as_f64().unwrap_or(f64::NAN)
                    )
                })
                .collect();
            let inflight = match row["inflight"].as_u64() {
                Some(0) => "unbounded".to_string(),
                Some(n) => n.to_string(),
                None => "-".to_string(),
            };
            println!(
                "{:<6} x{} kernels/launch, {} in flight, {} us kernels: {}",
                row["mode"].as_str().unwrap_or(""),
                row["kernels_per_launch"],
                inflight,
                row["kernel_us"],
                runs.join(", ")
            );
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        print!("{HELP}");
        return;
    }
    let outcome = parse_options(&args).and_then(|o| {
        let machine = Machine::new()?;
        if let Some(seconds) = o.soak {
            let result = soak::soak(&machine, seconds, o.seed)?;
            if o.json {
                println!("{result}");
            } else {
                soak::print(&result);
            }
            return Ok(());
        }
        let cost = costs(&machine, &o)?;
        let acc = if o.accuracy { accuracy(&machine, &o)? } else { Vec::new() };
        if o.json {
            println!("{}", json!({"costs": cost, "accuracy": acc, "rounds": o.rounds, "launches": o.launches, "allocs": o.allocs}));
        } else {
            print_tables(&o, &cost, &acc);
        }
        Ok(())
    });
    if let Err(e) = outcome {
        eprintln!("vgpu-bench: {e}");
        std::process::exit(2);
    }
}

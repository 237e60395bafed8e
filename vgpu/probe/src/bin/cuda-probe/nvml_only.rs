//! The subcommands that use NVML alone. `libcuda.so.1` is never opened, as in a monitoring process
//! (`nvidia-smi`, a metrics exporter, a scheduler's health check) that shares a container with CUDA
//! programs: what such a process sees must not depend on CUDA being there.

use crate::nvml::{nvml_error, Nvml, NvmlDevice, MEMORY_V2};
use crate::run::{emit, usage};
use crate::Opts;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::ffi::CStr;
use std::time::{Duration, Instant};

pub const SUBCOMMANDS: &[&str] = &["nvml-views", "nvml-util", "nvml-procs"];

pub fn run(sub: &str, opts: &Opts) -> i32 {
    // --reopen N: after the subcommand, nvmlShutdown and dlclose, then open and run it again, N
    // times (monitoring agents open NVML for each scrape).
    let rounds = match opts.num_or("reopen", 0) {
        Ok(n) => n + 1,
        Err(e) => return usage(e),
    };
    let mut outcome = Ok(());
    for _ in 0..rounds {
        outcome = Nvml::open()
            .ok_or_else(|| "libnvidia-ml.so.1 is not there".to_string())
            .and_then(|nvml| {
                if nvml.init_result != 0 {
                    return Err(format!("nvmlInit_v2: {}", nvml_error(nvml.init_result)));
                }
                let done = match sub {
                    "nvml-views" => nvml_views(opts, &nvml),
                    "nvml-util" => nvml_util(opts, &nvml),
                    "nvml-procs" => nvml_procs(opts, &nvml),
                    other => Err(format!("unknown subcommand {other:?} (see --help)")),
                };
                let unloaded = nvml.close();
                emit(json!({"op": "closed", "unloaded": unloaded}));
                done
            });
        if outcome.is_err() {
            break;
        }
    }
    // Whether anything (the program, or a library preloaded into it) loaded the CUDA driver.
    emit(json!({"op": "libraries", "libcuda_loaded": loaded(c"libcuda.so.1")}));
    match outcome {
        Ok(()) => 0,
        Err(e) => usage(e),
    }
}

fn loaded(soname: &CStr) -> bool {
    // SAFETY: dlopen with RTLD_NOLOAD only looks; the reference it may take is dropped at once.
    unsafe {
        let handle = libc::dlopen(soname.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD);
        if handle.is_null() {
            return false;
        }
        libc::dlclose(handle);
        true
    }
}

/// `--index N`: that NVML device (NVML's order is the host's, whatever `CUDA_VISIBLE_DEVICES` says).
fn device(opts: &Opts, nvml: &Nvml) -> Result<NvmlDevice, String> {
    let index = opts.num_or("index", 0)? as u32;
    nvml.device_by_index(index)
        .map_err(|e| format!("nvmlDeviceGetHandleByIndex_v2: {}", nvml_error(e)))
}

/// Every memory view NVML gives of one device: one `nvml_views` line.
pub fn views_of(nvml: &Nvml, index: u32, version: u32) -> Value {
    let dev = match nvml.device_by_index(index) {
        Ok(d) => d,
        Err(e) => {
            return json!({"op": "nvml_views", "index": index, "result": e, "error": nvml_error(e)})
        }
    };
    json!({
        "op": "nvml_views",
        "index": index,
        "uuid": nvml.uuid(dev),
        "v1": nvml.memory_v1(dev),
        "v2": nvml.memory_v2(dev, version),
        "processes": nvml.processes(dev, false)["processes"],
    })
}

/// `nvml-views [--index N] [--nvml-v2-version V]`: one line per device (or the one asked for).
fn nvml_views(opts: &Opts, nvml: &Nvml) -> Result<(), String> {
    let version = opts.num_or("nvml-v2-version", MEMORY_V2 as u64)? as u32;
    let indices: Vec<u32> = match opts.num("index")? {
        Some(i) => vec![i as u32],
        None => {
            let count = nvml
                .device_count()
                .map_err(|e| format!("nvmlDeviceGetCount_v2: {}", nvml_error(e)))?;
            (0..count).collect()
        }
    };
    for index in indices {
        emit(views_of(nvml, index, version));
    }
    Ok(())
}

fn nvml_util(opts: &Opts, n: &Nvml) -> Result<(), String> {
    let dev = device(opts, n)?;
    let seconds = opts
        .str("seconds")
        .map(|s| s.parse::<f64>().map_err(|_| "--seconds: a number"))
        .transpose()?
        .unwrap_or(2.0);
    let interval = Duration::from_millis(opts.num_or("interval-ms", 200)?);
    // Only samples of periods ending after we start: older ones describe the past.
    let mut last_seen = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64);
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let mut per_pid: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
    // What each poll of the per-process samples answered (NVML_ERROR_NOT_FOUND: no process had
    // work in the window).
    let mut answers: BTreeMap<&str, u64> = BTreeMap::new();
    let mut all = Vec::new();
    let (mut polls, mut device_sum, mut device_n) = (0u64, 0u64, 0u64);
    while Instant::now() < deadline {
        std::thread::sleep(interval);
        polls += 1;
        let polled = n.process_utilization(dev, last_seen);
        *answers
            .entry(nvml_error(*polled.as_ref().err().unwrap_or(&0)))
            .or_default() += 1;
        if let Ok(samples) = polled {
            for s in samples {
                let e = per_pid.entry(s.pid).or_default();
                e.0 += 1;
                e.1 += s.sm_util as u64;
                last_seen = last_seen.max(s.time_stamp);
                all.push(json!({"pid": s.pid, "timestamp": s.time_stamp, "sm_util": s.sm_util}));
            }
        }
        if let Ok(u) = n.utilization(dev) {
            device_sum += u as u64;
            device_n += 1;
        }
    }
    let per_pid: serde_json::Map<String, Value> = per_pid
        .into_iter()
        .map(|(pid, (k, sum))| {
            (
                pid.to_string(),
                json!({"samples": k, "mean_sm_util": sum as f64 / k as f64}),
            )
        })
        .collect();
    emit(json!({
        "op": "nvml_util",
        "polls": polls,
        "answers": answers,
        "per_pid": per_pid,
        "device_util_mean": if device_n > 0 { device_sum as f64 / device_n as f64 } else { 0.0 },
        "samples": all,
    }));
    Ok(())
}

fn nvml_procs(opts: &Opts, n: &Nvml) -> Result<(), String> {
    let dev = device(opts, n)?;
    emit(
        json!({"op": "nvml_procs", "uuid": n.uuid(dev), "v1": n.processes(dev, true), "v3": n.processes(dev, false)}),
    );
    Ok(())
}

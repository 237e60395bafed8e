//! The GPU check script (`vgpu/gpu-check/`) must not rot while no GPU is at hand: its shell and
//! Python parse, and the steps that need only the driver API (each allocation path to the limit,
//! managed memory keeping the contexts counted, the cooperative launches of the compute-share
//! phases, the launch loop, NVML's per-process queries) run here, through `run.sh` as on a GPU,
//! over the stand-in driver. The PyTorch, CuPy, nvidia-ml-py, MPS and nvidia-smi parts report
//! themselves skipped. (The shares' accuracy on the stand-in is judged by `compute.rs`, over
//! longer windows; here one-second windows only show that every phase runs and measures.)

mod harness;

use harness::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

fn script_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../gpu-check")
}

#[test]
fn the_shell_and_python_parse() {
    let dir = script_dir();
    let bash = Command::new("bash")
        .arg("-n")
        .arg(dir.join("run.sh"))
        .output()
        .expect("bash runs");
    assert!(
        bash.status.success(),
        "{}",
        String::from_utf8_lossy(&bash.stderr)
    );
    let cache = tempfile::tempdir().expect("temp dir");
    let python = Command::new("python3")
        .args(["-m", "py_compile"])
        .arg(dir.join("check.py"))
        .arg(dir.join("workloads.py"))
        // Compiled files go to the temp dir, not next to the scripts.
        .env("PYTHONPYCACHEPREFIX", cache.path())
        .output()
        .expect("python3 runs");
    assert!(
        python.status.success(),
        "{}",
        String::from_utf8_lossy(&python.stderr)
    );
}

fn rows(out: &Path) -> Vec<Value> {
    std::fs::read_to_string(out.join("results.jsonl"))
        .expect("results.jsonl")
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

fn row<'a>(rows: &'a [Value], step: &str, check: &str) -> &'a Value {
    rows.iter()
        .find(|r| r["step"] == step && r["check"] == check)
        .unwrap_or_else(|| panic!("no {step}/{check} in {rows:#?}"))
}

#[test]
fn the_driver_api_steps_run_over_the_stand_in() {
    let sandbox = Sandbox::new("1x16g:108");
    let out = sandbox.path("gpu-check");
    let library = vgpu_library();
    let run = sandbox
        .unpreloaded(
            script_dir().join("run.sh").to_str().expect("a path"),
            &[
                library.to_str().expect("a path"),
                "--out",
                out.to_str().expect("a path"),
                "--steps",
                "acdef",
                "--limit-mib",
                "1024",
                "--launches",
                "2000",
                "--repeats",
                "1",
                "--sm-warmup",
                "0.5",
                "--sm-seconds",
                "1",
            ],
        )
        .env("HOME", &std::env::var("HOME").unwrap_or_default())
        .run();
    let rows = rows(&out);
    // Every allocation path stops at the limit with CUDA_ERROR_OUT_OF_MEMORY; the linear ones
    // take exactly what cuMemGetInfo says is left and not one byte more; every view agrees.
    for path in [
        "cuMemAlloc",
        "cuMemAllocManaged",
        "cuMemAllocAsync",
        "cuMemAllocFromPoolAsync",
        "cuMemCreate",
        "cuMemAllocPitch",
        "cuArrayCreate",
        "cuArray3DCreate",
        "cuMipmappedArrayCreate",
    ] {
        let r = row(&rows, "a", path);
        assert_eq!(r["ok"], true, "{r}\n{}", run.stdout);
    }
    assert_eq!(
        row(&rows, "a", "managed memory keeps the contexts counted")["ok"],
        true,
        "{rows:#?}"
    );
    assert!(row(&rows, "a", "runtime views")["skipped"].is_string());
    // Every phase of the compute shares ran its cooperative launches and measured them.
    for check in [
        "SM 30/70, cooperative",
        "SM 10/90, cooperative",
        "SM 50/50, cooperative",
        "SM 25 FORCE alone, cooperative",
    ] {
        let r = row(&rows, "c", check);
        let shares: Vec<f64> = r["shares"]
            .as_array()
            .unwrap_or_else(|| panic!("{r}"))
            .iter()
            .map(|s| s.as_f64().expect("a share"))
            .collect();
        assert!(
            shares.iter().all(|s| *s > 0.0) && shares.iter().sum::<f64>() <= 1.2,
            "{r}"
        );
    }
    assert!(row(&rows, "c", "MPS 30/70 (reference)")["skipped"].is_string());
    assert!(row(&rows, "f", "nvidia-smi")["skipped"].is_string());
    let launches = row(&rows, "d", "driver API launch loop, no limit");
    assert!(
        launches["with_ns"].as_f64().is_some_and(|ns| ns > 0.0),
        "{launches}"
    );
    let nvml = row(&rows, "e", "NVML per-process queries");
    assert_eq!(nvml["ok"], true, "{nvml}");
    // The stand-in hands out its exported symbols (a real driver may not: that is the question).
    let procaddr = row(&rows, "e", "cuGetProcAddress returns exported symbols");
    assert_eq!(procaddr["same_as_export"]["cuMemAlloc"], true, "{procaddr}");
    let summary = std::fs::read_to_string(out.join("summary.txt")).expect("summary.txt");
    assert!(summary.contains("a: 10 ok, 0 failed"), "{summary}");
    // No check failed but, possibly, a share over a one-second window.
    let failed: Vec<&Value> = rows
        .iter()
        .filter(|r| r["ok"] == false && r["step"] != "c")
        .collect();
    assert!(failed.is_empty(), "{failed:#?}");
    assert!(
        matches!(run.code, Some(0 | 1)),
        "{}\n{}",
        run.stdout,
        run.stderr
    );
}

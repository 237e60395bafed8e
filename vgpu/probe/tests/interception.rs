//! Every way a program reaches the driver goes through the library: `dlopen` + `dlsym(handle)`,
//! `dlsym(RTLD_DEFAULT)` (a program linked with -lcuda), `cuGetProcAddress_v2` and the 4-argument
//! `cuGetProcAddress`, with and without the per-thread default stream (`_ptsz`), at old and new
//! CUDA versions; symbols we do not wrap come back untouched.

mod harness;

use gpupool_vgpu::arbiter;
use harness::*;

/// (lookup, per-thread, CUDA version given to cuGetProcAddress)
const LOOKUPS: &[(&str, bool, &str)] = &[
    ("dlsym", false, "12090"),
    ("dlsym", true, "12090"),
    ("global", false, "12090"),
    ("global", true, "12090"),
    ("proc", false, "12090"),
    ("proc", true, "12090"),
    ("proc", true, "11020"),
    ("proc-v1", false, "11030"),
    ("proc-v1", true, "11030"),
];

fn lookup_args<'a>(
    lookup: &'a str,
    per_thread: bool,
    version: &'a str,
    args: &[&'a str],
) -> Vec<&'a str> {
    let mut all = args.to_vec();
    all.extend(["--lookup", lookup, "--cuda-version", version]);
    if per_thread {
        all.push("--per-thread");
    }
    all
}

/// A stand-in whose `cuGetProcAddress` returns the exported symbols (as the library's first choice
/// recognises them), and one that returns internal addresses (the library must then pick the ABI
/// from the version and flags itself).
fn drivers() -> [(&'static str, Sandbox); 2] {
    [
        ("exported", Sandbox::new("1x16g:108")),
        (
            "internal",
            Sandbox::new("1x16g:108").with("GPUPOOL_STANDIN_PROC_ADDRESS", "internal"),
        ),
    ]
}

/// The lookups whose answer depends on the driver's addresses: `dlsym` finds the exports whatever
/// `cuGetProcAddress` returns, so the internal driver only changes the proc lookups.
fn lookups_for(driver: &str) -> impl Iterator<Item = &'static (&'static str, bool, &'static str)> {
    let internal = driver == "internal";
    LOOKUPS
        .iter()
        .filter(move |(lookup, _, _)| !internal || lookup.starts_with("proc"))
}

/// The variant the library says it wrapped an internal address as (`LIBCUDA_LOG_LEVEL=3`).
fn wrapped_as<'a>(outcome: &'a Outcome, base: &str) -> Vec<&'a str> {
    outcome
        .library_lines()
        .into_iter()
        .filter(|l| l.contains(&format!("cuGetProcAddress({base},")))
        .filter_map(|l| l.split("wrapped as ").nth(1))
        .collect()
}

#[test]
fn allocations_are_limited_through_every_lookup() {
    let limit = CONTEXT + 64 * MIB;
    for (driver, sandbox) in drivers() {
        for &(lookup, per_thread, version) in lookups_for(driver) {
            // cuMemAllocAsync has a per-thread (_ptsz) form; cuMemAlloc has not.
            for path in ["cuMemAllocAsync", "cuMemAlloc"] {
                for (size, expected) in [(64 * MIB, 0), (64 * MIB + 1, 2)] {
                    let size = size.to_string();
                    let args = lookup_args(
                        lookup,
                        per_thread,
                        version,
                        &["alloc", "--path", path, "--size", &size],
                    );
                    let outcome = sandbox
                        .probe(&sandbox.container(), &args)
                        .env("CUDA_DEVICE_MEMORY_LIMIT", &limit.to_string())
                        .env("LIBCUDA_LOG_LEVEL", "3")
                        .run();
                    let what = format!("{path} of {size} bytes through {lookup} (per-thread {per_thread}, version {version}, {driver} addresses)");
                    assert_eq!(
                        outcome.one("alloc")["result"],
                        expected,
                        "{what}:\n{}\n{}",
                        outcome.stdout,
                        outcome.stderr
                    );
                    // Internal addresses match no export: the ABI is the one the version and the
                    // flag select, as the driver chose it.
                    let variant = match (path, per_thread) {
                        ("cuMemAlloc", _) => "cuMemAlloc_v2",
                        (_, true) => "cuMemAllocAsync_ptsz",
                        (_, false) => "cuMemAllocAsync",
                    };
                    let expected_wraps: Vec<&str> = if driver == "internal" {
                        vec![variant]
                    } else {
                        vec![]
                    };
                    assert_eq!(
                        wrapped_as(&outcome, path),
                        expected_wraps,
                        "{what}: {:?}",
                        outcome.library_lines()
                    );
                }
            }
        }
    }
}

/// Launches that waited their whole bound for the card, as counted in the container's arbiter
/// (its own, next to its accounting file: these containers are given no card arbiter).
fn bounded_waits(cache: &str) -> u64 {
    let bytes = std::fs::read(format!("{cache}.arbiter-0")).unwrap_or_default();
    arbiter::unarbitrated_launches(&bytes)
}

#[test]
fn every_launch_path_goes_through_the_gate() {
    let drivers = drivers();
    // FORCE at 1 %: a turn of 2 ms every 200 ms, and a 1 ms bound: almost every launch waits its
    // bound and is counted, which only happens if the launch went through our gate.
    let mut runs = Vec::new();
    for (driver, sandbox) in &drivers {
        for mode in ["eager", "ex", "cooperative", "graph", "capture"] {
            for &(lookup, per_thread, version) in lookups_for(driver) {
                if mode == "ex" && version.parse::<u32>().unwrap() < 11060 {
                    continue; // cuLaunchKernelEx appeared in CUDA 11.6
                }
                let cache = sandbox.container();
                let args = lookup_args(
                    lookup,
                    per_thread,
                    version,
                    &[
                        "launch",
                        "--mode",
                        mode,
                        "--seconds",
                        "0.3",
                        "--kernel-us",
                        "100",
                    ],
                );
                let child = sandbox
                    .probe(&cache, &args)
                    .env("CUDA_DEVICE_SM_LIMIT", "1")
                    .env("GPU_CORE_UTILIZATION_POLICY", "FORCE")
                    .env("GPUPOOL_VGPU_MAX_LAUNCH_WAIT_MS", "1")
                    .spawn();
                let what = format!("{mode} through {lookup} (per-thread {per_thread}, version {version}, {driver} addresses)");
                runs.push((what, cache, child));
            }
        }
    }
    for (what, cache, child) in runs {
        let outcome = Outcome::from(child.wait_with_output().expect("ends"));
        assert_eq!(
            outcome.one("launch")["result"],
            0,
            "{what}: {}",
            outcome.stdout
        );
        assert!(
            bounded_waits(&cache) > 0,
            "{what} never waited at the gate:\n{}\n{}",
            outcome.stdout,
            outcome.stderr
        );
    }
}

#[test]
fn without_an_sm_limit_launches_reach_the_driver_directly() {
    // No limit, no cost: a process that has only a memory limit gets the driver's own launch
    // functions from every lookup (its allocations are still ours); with an SM limit, ours.
    let sandbox = Sandbox::new("1x16g:108");
    let object_of = |outcome: &Outcome, op: &str| -> String {
        outcome.one(op)["object"].as_str().unwrap_or("").to_string()
    };
    for (limits, launch_is_ours) in [
        (&[("CUDA_DEVICE_MEMORY_LIMIT", "1g")][..], false),
        (
            &[
                ("CUDA_DEVICE_MEMORY_LIMIT", "1g"),
                ("CUDA_DEVICE_SM_LIMIT", "50"),
            ][..],
            true,
        ),
    ] {
        for symbol in ["cuLaunchKernel", "cuGraphLaunch", "cuMemAlloc_v2"] {
            let ours = launch_is_ours || symbol == "cuMemAlloc_v2";
            let base = symbol.trim_end_matches("_v2");
            for (args, op) in [
                (vec!["dlsym", "--symbol", symbol], "dlsym"),
                (
                    vec!["getproc", "--symbol", base, "--lookup", "proc"],
                    "getproc",
                ),
                (
                    vec![
                        "getproc",
                        "--symbol",
                        base,
                        "--lookup",
                        "proc",
                        "--per-thread",
                    ],
                    "getproc",
                ),
            ] {
                let mut run = sandbox.probe(&sandbox.container(), &args);
                for (k, v) in limits {
                    run = run.env(k, v);
                }
                let outcome = run.run_ok();
                let object = object_of(&outcome, op);
                assert_eq!(
                    object.ends_with("libgpupool_vgpu.so"),
                    ours,
                    "{args:?} with {limits:?}: {object} ({})",
                    outcome.stdout
                );
            }
        }
    }
}

#[test]
fn symbols_we_do_not_wrap_come_back_untouched() {
    // A symbol the driver does not give is answered CUDA_ERROR_NOT_FOUND by drivers and
    // CUDA_SUCCESS with NULL by cuda.h's comment: either answer passes through as it is.
    for not_found in ["error", "success"] {
        let sandbox = Sandbox::new("1x16g:108").with("GPUPOOL_STANDIN_PROC_NOT_FOUND", not_found);
        let cache = sandbox.container();
        for (symbol, version) in [
            ("cuStreamSynchronize", "12090"),
            ("cuCtxSetCurrent", "12090"),
            ("cuNoSuchFunction", "12090"),
            // Too old a version for a function we wrap: nothing to wrap.
            ("cuMemAllocAsync", "11010"),
            // From CUDA 12.0 the driver gives cuGraphInstantiateWithFlags (3 arguments) for it.
            ("cuGraphInstantiate", "12000"),
            ("cuGraphInstantiate", "11000"),
        ] {
            for per_thread in [false, true] {
                let mut args = vec!["getproc", "--symbol", symbol, "--cuda-version", version];
                if per_thread {
                    args.push("--per-thread");
                }
                let bare = sandbox.bare(&args).run();
                let ours = sandbox
                    .probe(&cache, &args)
                    .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
                    .run();
                let (bare, ours) = (bare.one("getproc"), ours.one("getproc"));
                for field in ["result", "status", "matches"] {
                    assert_eq!(
                        ours[field], bare[field],
                        "{symbol} at {version} (per-thread {per_thread}, not found: {not_found}): {ours} vs {bare}"
                    );
                }
                assert_eq!(
                    ours["address"] == "0x0",
                    bare["address"] == "0x0",
                    "{symbol}: {ours} vs {bare}"
                );
            }
        }
    }
}

#[test]
fn dlsym_of_names_we_do_not_wrap_answers_as_without_us() {
    let sandbox = Sandbox::new("1x16g:108");
    let cache = sandbox.container();
    let lookup = |library: &str, symbol: &str, preloaded: bool| {
        let args = ["dlsym", "--library", library, "--symbol", symbol];
        let run = if preloaded {
            sandbox
                .probe(&cache, &args)
                .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
        } else {
            sandbox.bare(&args)
        };
        run.run_ok().one("dlsym").clone()
    };
    for (library, symbol) in [
        // The driver's, not wrapped: the driver's own function.
        ("cuda", "cuStreamSynchronize"),
        ("cuda", "cuLaunchHostFunc"),
        ("nvml", "nvmlDeviceGetCount_v2"),
        ("nvml", "nvmlDeviceGetUUID"),
        // cu/nv names the library has none of: NULL, with the loader's own message.
        ("cuda", "cuNoSuchFunction"),
        ("cuda", "cudaMalloc"),
        ("nvml", "nvmlNoSuchFunction"),
        ("nvml", "nvNoSuchFunction"),
    ] {
        let (bare, ours) = (
            lookup(library, symbol, false),
            lookup(library, symbol, true),
        );
        for field in ["object", "object_symbol", "error"] {
            assert_eq!(ours[field], bare[field], "{symbol}: {ours} vs {bare}");
        }
        assert_eq!(
            ours["address"] == "0x0",
            bare["address"] == "0x0",
            "{symbol}"
        );
    }
    // A name we wrap comes back as our wrapper.
    let ours = lookup("cuda", "cuMemAlloc_v2", true);
    assert_eq!(ours["object_symbol"], "cuMemAlloc_v2", "{ours}");
    assert_ne!(
        ours["object"],
        lookup("cuda", "cuMemAlloc_v2", false)["object"],
        "{ours}"
    );
}

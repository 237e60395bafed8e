//! Every way a program reaches the driver goes through the library: `dlopen` + `dlsym(handle)`,
//! `dlsym(RTLD_DEFAULT)` (a program linked with -lcuda), `cuGetProcAddress_v2` and the 4-argument
//! `cuGetProcAddress`, with and without the per-thread default stream (`_ptsz`), at old and new
//! CUDA versions; symbols we do not wrap come back untouched.

mod harness;

use gpupool_vgpu::layout;
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

#[test]
fn allocations_are_limited_through_every_lookup() {
    let sandbox = Sandbox::new("1x16g:108");
    let limit = CONTEXT + 64 * MIB;
    for &(lookup, per_thread, version) in LOOKUPS {
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
                    .run();
                assert_eq!(
                    outcome.one("alloc")["result"],
                    expected,
                    "{path} of {size} bytes through {lookup} (per-thread {per_thread}, version {version}):\n{}\n{}",
                    outcome.stdout,
                    outcome.stderr
                );
            }
        }
    }
}

/// Launches that hit the gate's bound, as counted in the container's shared file.
fn bounded_waits(cache: &str) -> u64 {
    let bytes = std::fs::read(cache).unwrap_or_default();
    let at = (layout::device_record(0) + layout::D_BOUNDED_WAITS) as usize;
    bytes
        .get(at..at + 8)
        .map(|b| u64::from_ne_bytes(b.try_into().expect("8 bytes")))
        .unwrap_or(0)
}

#[test]
fn every_launch_path_goes_through_the_gate() {
    let sandbox = Sandbox::new("1x16g:108");
    // 1 % of each period open and a 1 ms bound: almost every launch waits its bound and is
    // counted, which only happens if the launch went through our gate.
    let mut runs = Vec::new();
    for mode in ["eager", "ex", "cooperative", "graph", "capture"] {
        for &(lookup, per_thread, version) in LOOKUPS {
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
            runs.push((mode, lookup, per_thread, version, cache, child));
        }
    }
    for (mode, lookup, per_thread, version, cache, child) in runs {
        let outcome = Outcome::from(child.wait_with_output().expect("ends"));
        let what = format!("{mode} through {lookup} (per-thread {per_thread}, version {version})");
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
fn symbols_we_do_not_wrap_come_back_untouched() {
    let sandbox = Sandbox::new("1x16g:108");
    let cache = sandbox.container();
    for symbol in ["cuStreamSynchronize", "cuCtxSetCurrent", "cuNoSuchFunction"] {
        for per_thread in [false, true] {
            let mut args = vec!["getproc", "--symbol", symbol];
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
                    "{symbol} (per-thread {per_thread}): {ours} vs {bare}"
                );
            }
        }
    }
}

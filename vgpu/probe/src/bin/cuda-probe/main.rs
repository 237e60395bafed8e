//! cuda-probe: calls the CUDA driver API the way the CUDA runtime does and reports, as JSON lines on
//! stdout, what every call answered. It runs over the stand-in driver in the tests and over a real
//! driver on a GPU (its kernel is real PTX). `cuda-probe --help` documents the subcommands.

mod cu;
mod loader;
mod nvml;
mod nvml_only;
mod run;

use loader::{Lookup, HEADER_VERSION};
use std::collections::HashMap;

pub const HELP: &str = r#"cuda-probe: calls the CUDA driver API as the CUDA runtime does; JSON lines on stdout.

USAGE: cuda-probe <subcommand> [options]

How entry points are found (every subcommand):
  --lookup dlsym|global|proc|proc-v1
        dlsym (default): dlopen("libcuda.so.1") + dlsym(handle, <cuda.h 12.9 name>)
        global: dlopen(RTLD_GLOBAL) + dlsym(RTLD_DEFAULT, <name>): what a program linked with -lcuda binds
        proc: cuGetProcAddress_v2(<base name>, &pfn, --cuda-version, flags, &status), the runtime's way
        proc-v1: the 4-argument cuGetProcAddress of CUDA 11.3
  --cuda-version N   version given to cuGetProcAddress (default 12090); it also picks the ABI the probe
                     calls with (e.g. below 3020, cuMemAlloc is the 32-bit CUDA 2.0 form)
  --per-thread       per-thread default stream: CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM (proc),
                     the _ptsz names (dlsym, global); otherwise CU_GET_PROC_ADDRESS_LEGACY_STREAM
  --proc-flags N     the exact flags for the proc lookups (e.g. 0, CU_GET_PROC_ADDRESS_DEFAULT, as
                     the runtime passes when not built for per-thread streams)
  --device N         CUDA ordinal (default 0)
  --context primary|create|none
        primary (default): cuDevicePrimaryCtxRetain + cuCtxSetCurrent, as the runtime does;
        create: cuCtxCreate (the form --cuda-version selects); none: no context
  --no-init          skip cuInit (to see what an uninitialised driver answers)
  --pause-after-init-ms M   print {"op":"paused_after_init","ms"} and sleep M ms between cuInit
                     and the context

Subcommands (each prints one JSON object per line; "result" is the CUresult, "error" its name):
  devices
      {"op":"device","ordinal","name","uuid","total_mem","sms","texture_pitch_alignment"} per device,
      after {"op":"init","result","error","driver_version","count"}
  alloc --path P [--size N[,N...]] [--count K] [--pause-ms M] [--views] [--hold] [--no-free]
        [--width W --height H --depth D --element E --format F --channels C --flags X --levels L]
        [--stream created|null|per-thread] [--pool default|created] [--map] [--sync]
      P: cuMemAlloc cuMemAllocPitch cuMemAllocManaged cuMemCreate cuMemAllocAsync
         cuMemAllocFromPoolAsync cuArrayCreate cuArray3DCreate cuMipmappedArrayCreate
      one {"op":"alloc","path","index","size","result","error","ptr","pitch","bytes",
           "requirements":{"result","size","alignment"}} per allocation (bytes: what the allocation
           takes on the card when the probe can tell: size, pitch x height, the array's requirements),
      with --views an {"op":"views",...} line after each (M ms after it, default 0), then {"op":"free","path","index","result",
      "error"} per allocation (unless --no-free); --hold prints {"op":"hold","pid"} and sleeps until
      killed instead of freeing. --end-context destroy|reset|release ends the context instead of
      freeing (cuCtxDestroy of a --context create one, cuDevicePrimaryCtxReset or
      cuDevicePrimaryCtxRelease of the primary: the driver frees what was allocated in it),
      prints {"op":"end_context","how","result","error"}, makes a new context as --context says
      and, with --views, shows the views (with --hold it holds instead, without a context). Pitch: --width (default --size) x --height (default 1), --element
      (default 4). Arrays: --width (default --size), --height, --depth (default 0), --format (default
      0x20 float), --channels (default 1), --flags, --levels (mipmapped, default 1). cuMemCreate
      --map also reserves, maps and sets access; --release-after-map then releases the handle at
      once, as the programming guide does (the mapping keeps the memory; freeing unmaps it). Async paths free with cuMemFreeAsync and synchronise.
  fill --path P --chunk N [--limit K] [--views] [--hold]
      allocates chunks until one fails: {"op":"fill","path","chunk","count","allocated","result",
      "error"} (allocated: bytes of the successful chunks as "bytes" counts them)
  free --ptr ADDRESS
      {"op":"free","ptr","result","error"}: cuMemFree of an address the probe never allocated
  views [--nvml-v2-version N]
      {"op":"views","device","uuid","cu_mem_get_info":{"result","free","total"},
       "cu_device_total_mem":{"result","bytes"},"nvml":{"init","v1":{"total","free","used"},
       "v2":{"version","total","reserved","free","used"},"processes":[{"pid","used_memory"}],
       "processes_v1":[...]}} ("nvml":null without libnvidia-ml.so.1)
  hold --path P --size N
      allocates, prints {"op":"hold","pid","result","error"} and sleeps until killed
  fork [--path P --size N] [--child-path P] [--child-size N] [--child-context C] [--child-hold]
       [--after-ms M]
      the parent (set up as the options say; allocates by --path and --size when given) prints its
      views (the driver's, or with --no-init NVML's of device 0: an nvml_views line) and forks.
      The child, whose lines carry "who":"child", prints {"op":"child","pid"}, calls cuInit and
      makes a --child-context (default primary) context whatever --no-init says (its
      {"op":"init"} line gives the driver's answer), allocates --child-size by --child-path
      (default cuMemAlloc), prints views and nvml_views and exits normally, or with --child-hold
      prints {"op":"hold","pid"} and sleeps until killed. The parent prints
      {"op":"forked","child"}, waits, prints {"op":"child_exit","code","signal"} and, M ms
      later (default 0), its views again.
  dlsym --symbol NAME [--library cuda|nvml]
      dlsym(handle, NAME) on libcuda.so.1's (or libnvidia-ml.so.1's) handle: {"op":"dlsym",
      "library","symbol","address","object" (the file the address lies in),"object_symbol" (the
      symbol dladdr names there),"error" (dlerror when NULL)}
  getproc --symbol NAME [--flags N]
      cuGetProcAddress_v2(NAME, --cuda-version, flags (default: from --per-thread)):
      {"op":"getproc","symbol","version","flags","result","error","status","address",
       "matches":[exported names whose dlsym(handle) address equals the returned one],
       "object" (the file the address lies in),"object_symbol" (the symbol dladdr names there)}
  launch [--mode eager|ex|cooperative|graph|capture] [--seconds T] [--kernel-us D] [--grid G]
         [--block B] [--graph-nodes K] [--inflight N] [--stream created|null|per-thread]
         [--report-ms R] [--window-start-unix-ms A --window-ms W] [--no-drain]
         [--pre-launches P] [--capture-hold-ms H] [--phases B,I,B,I,...] [--timeline-ms B]
      runs kernels of D microseconds (default 1000) for T seconds (default 2), at most N (default 2)
      launch calls outstanding; N = 0: no bound, the program never waits (as PyTorch eager: the
      driver's launch queue paces it). graph: explicit kernel nodes, capture: stream capture (after
      P eager launches on the stream, and holding the capture open H ms before ending it), K
      (default 4) kernels per graph; cooperative: --grid up to what fits. Progress lines
      {"op":"progress","elapsed_ms","kernels"} every R ms; then {"op":"launch","mode","inflight",
      "seconds","kernel_us","launches","kernels","throughput" (kernels/s),"busy_fraction" (kernels
      x D / time),"launch_call_max_ms","launch_call_mean_us","result","error"}. With a window (A:
      Unix time in ms, W: its length), also "window_kernels" (kernels that completed inside
      [A, A+W), seen through an event recorded after each launch, its completion time read with
      cuEventElapsedTime against a reference event whose completion was seen on the host's clock;
      a graph's kernels count at its launch's event), "window_busy_fraction" (window_kernels x D / W:
      the share of the card the process got), "window_covered" (the launches ran from before A to
      after A+W), "completion":"events". The run ends with cuStreamSynchronize, unless --no-drain:
      then it waits for the window to end and leaves what is still queued (the process exits).
      --phases: milliseconds of work and of idleness (no launches), alternately from the start,
      then work until the end: a server between requests, a training step waiting for data.
      --timeline-ms B: also {"op":"timeline","start_unix_ms","bin_ms","kernel_us","kernels"}:
      the kernels that completed in each B ms from start_unix_ms (the reference event's
      completion, just before the first launch), seen through the events as for the window.
  fork-storm --marker M [--forks N]
      (with --no-init) one thread makes the process's first CUDA calls (cuInit, the primary
      context) while the main thread forks N times (default 300), one child at a time; each child
      counts the descriptors it inherited whose target path contains M and exits with the count:
      {"op":"fork_storm","forks","during_start_up" (forks made before that thread was done),
      "children_with_parent_files"}
  churn [--rounds R] [--launches L] [--kernel-us D] [--end-context destroy|reset|release]
      R rounds (default 20) of: a context as --context says, its module and stream, L launches
      (default 32) left queued, then the context ended with its work still queued (cuCtxDestroy
      of a created one, cuDevicePrimaryCtxReset or cuDevicePrimaryCtxRelease of the primary, as
      frameworks tear down and re-create theirs): {"op":"churn","rounds","launches","result",
      "error"} (the first failure, or 0).
  capture-rules --call C [--capture-mode M] [--caller same|other] [--caller-mode M]
      launches a 1 ms kernel on a second stream and records an event after it (work outside the
      capture), begins a capture in mode M (global, thread-local, relaxed; default global) on a
      created stream, captures a launch and an event record, then makes call C from the capturing
      thread or another one (default), after cuThreadExchangeStreamCaptureMode to --caller-mode
      when given: event-query / event-sync (the outside event), stream-query / stream-sync (the
      second stream), ctx-sync, mem-alloc (cuMemAlloc of 1 MiB, freed), mem-alloc-async (cuMemAllocAsync of 1 MiB
      on the second stream, freed there), stream-get-device (the
      second stream), captured-event-query, capturing-stream-query. Then it asks
      cuStreamIsCapturing, captures one more launch and ends the capture:
      {"op":"capture_rules","call","result","error" (the call's),"exchange_result","status_after"
       (0 none, 1 active, 2 invalidated),"launch_after","end_result","end_error","graph" (one
       came back)}
  bench-launch [--count N] [--mode eager|graph]
      time of each launch call of an empty kernel (synchronising every 256, not timed):
      {"op":"bench_launch","mode","count","ns_per_launch_mean","ns_per_launch_median","ns_p99"}
  bench-alloc [--count N] [--size S] [--path cuMemAlloc|cuMemAllocAsync]
      alloc/free pairs: {"op":"bench_alloc","path","count","size","ns_alloc_mean",
      "ns_alloc_median","ns_free_mean","ns_free_median"}

NVML only (libcuda.so.1 is never opened; each run ends with {"op":"libraries","libcuda_loaded"},
whether anything in the process loaded it; --reopen N runs the subcommand N more times, each
after nvmlShutdown, dlclose ({"op":"closed","unloaded"}: whether that unloaded the library; if it
did, its old addresses are kept from reuse so the next copy lands elsewhere) and a new dlopen +
nvmlInit_v2):
  nvml-views [--index N] [--nvml-v2-version V]
      {"op":"nvml_views","index","uuid","v1":{"result","total","free","used"},"v2":{"result",
       "version","total","reserved","free","used"},"processes":[{"pid","used_memory",...}]} for NVML
      device N, or for every device
  nvml-util [--seconds T] [--interval-ms I] [--index N]
      polls nvmlDeviceGetProcessUtilization (lastSeenTimeStamp = the newest sample seen) and
      nvmlDeviceGetUtilizationRates every I ms (default 200) for T seconds (default 2) on NVML
      device N (default 0): {"op":"nvml_util","polls","answers":{"<NVML result name>":polls},
      "per_pid":{"<pid>":{"samples","mean_sm_util"}},"device_util_mean","samples":[{"pid",
      "timestamp","sm_util"}...]}. A process's smUtil is the share of the sample window in which
      it had work on the card, not its share of the card: under time-slicing, processes that
      share a card saturated all read near 100 (launch --window-... measures shares)
  nvml-procs [--index N]
      {"op":"nvml_procs","v1":{...},"v3":{...}} from both process-list forms

Every other run ends with {"op":"resolved","entry_points":{base:{"symbol","address",
"lookup_result","lookup_status"}}}. Exit status 0 when the probe ran (CUDA errors are results), 2 on a usage
error, 3 when libcuda.so.1 cannot be opened or a needed entry point is missing.
"#;

/// Command-line options: `--key value` pairs and `--flag`s, after the subcommand.
pub struct Opts {
    pub values: HashMap<String, String>,
    pub flags: Vec<String>,
}

const FLAGS: &[&str] = &[
    "per-thread",
    "no-init",
    "views",
    "hold",
    "no-free",
    "map",
    "sync",
    "child-hold",
    "no-drain",
    "release-after-map",
];

impl Opts {
    fn parse(args: &[String]) -> Result<Opts, String> {
        let mut values = HashMap::new();
        let mut flags = Vec::new();
        let mut i = 0;
        while i < args.len() {
            let a = args[i]
                .strip_prefix("--")
                .ok_or_else(|| format!("unexpected argument {:?}", args[i]))?;
            if FLAGS.contains(&a) {
                flags.push(a.to_string());
                i += 1;
            } else {
                let v = args
                    .get(i + 1)
                    .ok_or_else(|| format!("--{a} needs a value"))?;
                values.insert(a.to_string(), v.clone());
                i += 2;
            }
        }
        Ok(Opts { values, flags })
    }

    pub fn flag(&self, name: &str) -> bool {
        self.flags.iter().any(|f| f == name)
    }

    pub fn str(&self, name: &str) -> Option<&str> {
        self.values.get(name).map(String::as_str)
    }

    /// A number: decimal, 0x hex, or with a k/m/g suffix (powers of 1024).
    pub fn num(&self, name: &str) -> Result<Option<u64>, String> {
        self.str(name)
            .map(|v| parse_num(v).ok_or_else(|| format!("--{name}: not a number: {v:?}")))
            .transpose()
    }

    pub fn num_or(&self, name: &str, default: u64) -> Result<u64, String> {
        Ok(self.num(name)?.unwrap_or(default))
    }

    pub fn nums(&self, name: &str) -> Result<Option<Vec<u64>>, String> {
        self.str(name)
            .map(|v| {
                v.split(',')
                    .map(|x| parse_num(x).ok_or_else(|| format!("--{name}: not a number: {x:?}")))
                    .collect()
            })
            .transpose()
    }
}

pub fn parse_num(v: &str) -> Option<u64> {
    let v = v.trim();
    if let Some(hex) = v.strip_prefix("0x") {
        return u64::from_str_radix(hex, 16).ok();
    }
    let (digits, shift) = match v.chars().last()?.to_ascii_lowercase() {
        'k' => (&v[..v.len() - 1], 10),
        'm' => (&v[..v.len() - 1], 20),
        'g' => (&v[..v.len() - 1], 30),
        _ => (v, 0),
    };
    digits.parse::<u64>().ok()?.checked_mul(1 << shift)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.is_empty()
        || args
            .iter()
            .any(|a| a == "--help" || a == "-h" || a == "help")
    {
        print!("{HELP}");
        return;
    }
    let code = match Opts::parse(&args[1..]) {
        Err(e) => {
            run::emit(serde_json::json!({"op": "usage_error", "message": e}));
            2
        }
        Ok(opts) if nvml_only::SUBCOMMANDS.contains(&args[0].as_str()) => {
            nvml_only::run(&args[0], &opts)
        }
        Ok(opts) => {
            let lookup = match opts.str("lookup").unwrap_or("dlsym") {
                "dlsym" => Lookup::Dlsym,
                "global" => Lookup::Global,
                "proc" => Lookup::Proc,
                "proc-v1" => Lookup::ProcV1,
                other => {
                    run::emit(
                        serde_json::json!({"op": "usage_error", "message": format!("unknown --lookup {other}")}),
                    );
                    std::process::exit(2);
                }
            };
            let version = match opts.num_or("cuda-version", HEADER_VERSION as u64) {
                Ok(v) => v as i32,
                Err(e) => {
                    run::emit(serde_json::json!({"op": "usage_error", "message": e}));
                    std::process::exit(2);
                }
            };
            let flags = match opts.num("proc-flags") {
                Ok(f) => f,
                Err(e) => {
                    run::emit(serde_json::json!({"op": "usage_error", "message": e}));
                    std::process::exit(2);
                }
            };
            match loader::Loader::open(lookup, version, opts.flag("per-thread"), flags) {
                Err(e) => {
                    run::emit(serde_json::json!({"op": "error", "message": e}));
                    3
                }
                Ok(l) => run::run(&args[0], &opts, cu::Cu::new(l)),
            }
        }
    };
    std::process::exit(code);
}

//! Memory limits under the library, through the stand-in driver: every allocation path refused at
//! the limit to the byte, frees that give back exactly what was charged, and views that agree and
//! saturate.

mod harness;

use harness::*;

/// One allocation of each path: the probe's arguments and the bytes the library charges for it
/// (`None`: the driver's pitch decides, read from a first run).
struct Case {
    path: &'static str,
    args: Vec<String>,
    bytes: Option<u64>,
}

fn case(path: &'static str, args: &[&str], bytes: Option<u64>) -> Case {
    let mut all = vec!["alloc".to_string(), "--path".to_string(), path.to_string()];
    all.extend(args.iter().map(|a| a.to_string()));
    Case {
        path,
        args: all,
        bytes,
    }
}

fn cases() -> Vec<Case> {
    // Odd sizes where the path allows them, so that a rounding charge would show.
    let odd = 64 * MIB + 5;
    vec![
        case("cuMemAlloc", &["--size", &odd.to_string()], Some(odd)),
        case(
            "cuMemAllocManaged",
            &["--size", &odd.to_string()],
            Some(odd),
        ),
        case("cuMemAllocAsync", &["--size", &odd.to_string()], Some(odd)),
        case(
            "cuMemAllocAsync",
            &["--size", &odd.to_string(), "--stream", "created"],
            Some(odd),
        ),
        case(
            "cuMemAllocFromPoolAsync",
            &["--size", &odd.to_string(), "--pool", "default"],
            Some(odd),
        ),
        case(
            "cuMemAllocFromPoolAsync",
            &["--size", &odd.to_string(), "--pool", "created"],
            Some(odd),
        ),
        // cuMemCreate sizes are multiples of the allocation granularity.
        case(
            "cuMemCreate",
            &["--size", &(64 * MIB).to_string()],
            Some(64 * MIB),
        ),
        case(
            "cuMemCreate",
            &["--size", &(64 * MIB).to_string(), "--map"],
            Some(64 * MIB),
        ),
        // A width that is not a multiple of the pitch alignment: the driver's pitch is wider.
        case(
            "cuMemAllocPitch",
            &["--width", "1000", "--height", "3000"],
            None,
        ),
        // Arrays: what the descriptor implies (floats, one channel).
        case(
            "cuArrayCreate",
            &["--width", "1000", "--height", "1000"],
            Some(1000 * 1000 * 4),
        ),
        case(
            "cuArray3DCreate",
            &["--width", "100", "--height", "100", "--depth", "100"],
            Some(100 * 100 * 100 * 4),
        ),
        case(
            "cuMipmappedArrayCreate",
            &["--width", "256", "--height", "256", "--levels", "3"],
            Some((256 * 256 + 128 * 128 + 64 * 64) * 4),
        ),
    ]
}

fn alloc_result(sandbox: &Sandbox, case: &Case, limit: u64) -> (i64, Outcome) {
    let args: Vec<&str> = case.args.iter().map(String::as_str).collect();
    let outcome = sandbox
        .probe(&sandbox.container(), &args)
        .env("CUDA_DEVICE_MEMORY_LIMIT", &limit.to_string())
        .run();
    let result = outcome.one("alloc")["result"].as_i64().expect("a result");
    (result, outcome)
}

#[test]
fn every_allocation_path_is_refused_at_the_limit_to_the_byte() {
    let sandbox = Sandbox::new("1x16g:108");
    for case in cases() {
        let bytes = case.bytes.unwrap_or_else(|| {
            // The pitch is the driver's: learn it under a limit that leaves room.
            let (result, outcome) = alloc_result(&sandbox, &case, 4 * GIB);
            assert_eq!(result, 0, "{}", outcome.stdout);
            let line = outcome.one("alloc");
            let pitch = u(&line["pitch"]);
            assert!(pitch > 1000, "the stand-in pads the pitch: {line}");
            pitch * 3000
        });
        // The container's context memory (the stand-in's, read by the library from NVML) plus the
        // allocation: exactly at the limit it succeeds, one byte less and it is refused.
        let (at_limit, outcome) = alloc_result(&sandbox, &case, CONTEXT + bytes);
        assert_eq!(
            at_limit, 0,
            "{} {:?} at the limit:\n{}\n{}",
            case.path, case.args, outcome.stdout, outcome.stderr
        );
        let (over, outcome) = alloc_result(&sandbox, &case, CONTEXT + bytes - 1);
        assert_eq!(
            over, 2,
            "{} {:?} one byte over: CUDA_ERROR_OUT_OF_MEMORY expected:\n{}",
            case.path, case.args, outcome.stdout
        );
    }
}

/// Managed memory does not appear in NVML's per-process used memory (on the H200 the process's
/// figure stayed at its context's with 4 GiB of managed memory allocated). A library that takes
/// "NVML's figure minus what it tracked" for the context loses the context from the account once
/// it measures again after a managed allocation: on the H200 the whole limit then fit on top of
/// the context. The context must stay counted: at a limit of context + 64 MiB, after 64 MiB of
/// managed memory and a pause longer than the library's re-measuring interval, nothing is free
/// and one more byte is refused.
#[test]
fn managed_memory_keeps_the_context_counted() {
    let sandbox = Sandbox::new("1x16g:108");
    let limit = CONTEXT + 64 * MIB;
    let outcome = sandbox
        .probe(
            &sandbox.container(),
            &[
                "alloc",
                "--path",
                "cuMemAllocManaged",
                "--size",
                &format!("{},1", 64 * MIB),
                "--pause-ms",
                "300",
                "--views",
            ],
        )
        .env("CUDA_DEVICE_MEMORY_LIMIT", &limit.to_string())
        .run();
    let allocs = outcome.ops("alloc");
    assert_eq!(allocs[0]["result"], 0, "{}", outcome.stdout);
    let views = outcome.ops("views");
    assert_eq!(
        free_of(views[0]),
        0,
        "the context and the managed memory fill the limit: {}",
        views[0]
    );
    assert_eq!(
        allocs[1]["result"], 2,
        "one byte past the limit after managed memory:\n{}\n{}",
        outcome.stdout, outcome.stderr
    );
}

/// The container's accounting file's header lock is held by a stopped process (here the test
/// holds it) when a process first looks up its claim's devices: nothing can be charged, and an
/// allocation is refused after the lock's bound, never let through uncharged (before: the
/// device had no claim index, and both allocations went through, 2 GiB past a 1 GiB limit).
#[test]
fn an_unreadable_device_map_never_lets_an_allocation_through_uncharged() {
    let sandbox = Sandbox::new("1x16g:108");
    let container = sandbox.container();
    // The file exists once a first process has used it.
    sandbox
        .probe(
            &container,
            &["alloc", "--path", "cuMemAlloc", "--size", "1"],
        )
        .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
        .run_ok();
    let started = sandbox
        .probe(
            &container,
            &[
                "alloc",
                "--path",
                "cuMemAlloc",
                "--size",
                &format!("{},{}", 256 * MIB, 2 * GIB),
                "--pause-after-init-ms",
                "300",
            ],
        )
        .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
        .start_until("paused_after_init");
    // The library has opened the file (at cuInit); its claim's devices are looked up next.
    let held = gpupool_vgpu::shared::hold_header_lock(&container).expect("the header lock");
    let lines = started.finish();
    drop(held);
    let allocs: Vec<_> = lines.iter().filter(|l| l["op"] == "alloc").collect();
    assert_eq!(allocs.len(), 2, "{lines:?}");
    for alloc in allocs {
        assert_eq!(alloc["result"], 2, "let through uncharged: {alloc}");
    }
}

/// The CUDA programming guide's virtual memory pattern: create, reserve, map, set access, and
/// release the handle at once; the mapping keeps the memory until it is unmapped. The limit holds
/// across such allocations (before, the release uncharged memory that was still mapped: a 1 GiB
/// limit let the process map 4 GiB this way), and freeing (the unmap) gives it back.
#[test]
fn memory_released_while_still_mapped_counts_until_unmapped() {
    let sandbox = Sandbox::new("1x16g:108");
    let container = sandbox.container();
    let fill = || {
        sandbox
            .probe(
                &container,
                &[
                    "fill",
                    "--path",
                    "cuMemCreate",
                    "--chunk",
                    &(64 * MIB).to_string(),
                    "--map",
                    "--release-after-map",
                    "--limit",
                    "64",
                    "--views",
                ],
            )
            .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
            .run_ok()
    };
    for run in 0..2 {
        let outcome = fill();
        let line = outcome.one("fill");
        let allocated = u(&line["allocated"]);
        assert_eq!(
            line["result"], 2,
            "run {run}: not refused at the limit: {line}"
        );
        assert!(
            allocated + CONTEXT <= GIB && allocated + CONTEXT + 64 * MIB > GIB,
            "run {run}: {} MiB mapped under a limit of 1 GiB:\n{}",
            allocated / MIB,
            outcome.stdout
        );
        assert!(
            free_of(outcome.one("views")) < 64 * MIB,
            "run {run}: {}",
            outcome.stdout
        );
    }
}

/// A driver (or an interposer) whose `cuGetProcAddress` table resolves through symbol
/// interposition hands out the library's own exported wrappers (the stand-in's
/// `GPUPOOL_STANDIN_PROC_ADDRESS=interposed`). Wrapped once more, every allocation would be
/// charged twice. An allocation is charged exactly once: the views show exactly the bytes
/// allocated, and an allocation that fits the limit exactly is granted.
#[test]
fn a_wrapper_handed_back_by_the_driver_is_not_wrapped_again() {
    let sandbox = Sandbox::new("1x16g:108").with("GPUPOOL_STANDIN_PROC_ADDRESS", "interposed");
    for (lookup, per_thread) in [("proc", false), ("proc", true), ("proc-v1", false)] {
        for path in ["cuMemAlloc", "cuMemAllocAsync"] {
            let mut args = vec![
                "alloc", "--path", path, "--size", "64m", "--views", "--lookup", lookup,
            ];
            if per_thread {
                args.push("--per-thread");
            }
            let what = format!("{path} through {lookup} (per-thread {per_thread})");
            let outcome = sandbox
                .probe(&sandbox.container(), &args)
                .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
                .run();
            assert_eq!(
                outcome.one("alloc")["result"],
                0,
                "{what}: {}",
                outcome.stdout
            );
            let views = outcome.ops("views");
            assert_eq!(
                free_of(views[0]),
                GIB - CONTEXT - 64 * MIB,
                "{what}: 64 MiB charged once:\n{}\n{}",
                outcome.stdout,
                outcome.stderr
            );
            assert_eq!(
                free_of(views[1]),
                GIB - CONTEXT,
                "{what}: {}",
                outcome.stdout
            );
            let exact = sandbox
                .probe(&sandbox.container(), &args)
                .env(
                    "CUDA_DEVICE_MEMORY_LIMIT",
                    &(CONTEXT + 64 * MIB).to_string(),
                )
                .run();
            assert_eq!(
                exact.one("alloc")["result"],
                0,
                "{what}: exactly the limit:\n{}\n{}",
                exact.stdout,
                exact.stderr
            );
        }
    }
}

#[test]
fn frees_give_back_exactly_what_allocations_took() {
    let sandbox = Sandbox::new("1x16g:108");
    // 16 MiB each: linear paths by --size, pitch as 4096 x 4096 bytes (an aligned width: pitch ==
    // width), the array as 4096 x 1024 floats.
    for (path, width, height) in [
        ("cuMemAlloc", "4096", "1024"),
        ("cuMemAllocAsync", "4096", "1024"),
        ("cuMemAllocFromPoolAsync", "4096", "1024"),
        ("cuMemCreate", "4096", "1024"),
        ("cuMemAllocPitch", "4096", "4096"),
        ("cuArrayCreate", "4096", "1024"),
    ] {
        let outcome = sandbox
            .probe(
                &sandbox.container(),
                &[
                    "alloc", "--path", path, "--size", "16m", "--width", width, "--height", height,
                    "--count", "3", "--views",
                ],
            )
            .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
            .run();
        let views = outcome.ops("views");
        assert_eq!(
            views.len(),
            6,
            "{path}: three allocations and three frees, each followed by views:\n{}",
            outcome.stdout
        );
        let free: Vec<u64> = views.iter().map(|v| free_of(v)).collect();
        let step = free[0] - free[1];
        assert_eq!(step, 16 * MIB, "{path}: {free:?}");
        assert_eq!(
            free[1] - free[2],
            step,
            "{path}: each allocation takes the same: {free:?}"
        );
        assert_eq!(
            free[3] - free[2],
            step,
            "{path}: the first free gives back one allocation: {free:?}"
        );
        assert_eq!(
            free[5],
            GIB - CONTEXT,
            "{path}: after every free only the context is charged: {free:?}"
        );
    }
}

#[test]
fn the_views_agree_with_each_other() {
    let sandbox = Sandbox::new("1x16g:108");
    let outcome = sandbox
        .probe(&sandbox.container(), &["views"])
        .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
        .run();
    let views = outcome.one("views");
    let (free, total) = (
        u(&views["cu_mem_get_info"]["free"]),
        u(&views["cu_mem_get_info"]["total"]),
    );
    assert_eq!(total, GIB);
    assert_eq!(
        free,
        GIB - CONTEXT,
        "the context is charged, exactly as NVML reports it: {views}"
    );
    assert_eq!(u(&views["cu_device_total_mem"]["bytes"]), GIB);
    for form in ["v1", "v2"] {
        let nvml = &views["nvml"][form];
        assert_eq!(nvml["result"], 0, "{views}");
        assert_eq!(u(&nvml["total"]), total, "{form}: {views}");
        assert_eq!(u(&nvml["free"]), free, "{form}: {views}");
        assert_eq!(
            u(&nvml["used"]) + u(&nvml["free"]),
            total,
            "{form}: {views}"
        );
    }
    assert_eq!(u(&views["nvml"]["v2"]["reserved"]), 0);
}

#[test]
fn the_views_saturate_when_context_memory_passes_the_limit() {
    let sandbox = Sandbox::new("1x16g:108");
    // 200 MiB of limit, 300 MiB of context: more is used than the limit allows.
    let outcome = sandbox
        .probe(&sandbox.container(), &["views"])
        .env("CUDA_DEVICE_MEMORY_LIMIT", "200m")
        .run();
    let views = outcome.one("views");
    assert_eq!(u(&views["cu_mem_get_info"]["free"]), 0, "{views}");
    assert_eq!(u(&views["cu_mem_get_info"]["total"]), 200 * MIB);
    assert_eq!(u(&views["cu_device_total_mem"]["bytes"]), 200 * MIB);
    for form in ["v1", "v2"] {
        let nvml = &views["nvml"][form];
        assert_eq!(
            (u(&nvml["total"]), u(&nvml["free"]), u(&nvml["used"])),
            (200 * MIB, 0, 200 * MIB),
            "{form}: {views}"
        );
    }
    // And nothing more can be allocated.
    let outcome = sandbox
        .probe(
            &sandbox.container(),
            &["alloc", "--path", "cuMemAlloc", "--size", "1"],
        )
        .env("CUDA_DEVICE_MEMORY_LIMIT", "200m")
        .run();
    assert_eq!(outcome.one("alloc")["result"], 2, "{}", outcome.stdout);
}

#[test]
fn without_a_limit_the_real_answers_are_untouched() {
    let sandbox = Sandbox::new("2x16g:108");
    let bare = sandbox.bare(&["views", "--device", "1"]).run();
    let cache = sandbox.container();
    // A limit on device 0 only: device 1 answers as the driver does.
    let limited = sandbox
        .probe(&cache, &["views", "--device", "1"])
        .env("CUDA_DEVICE_MEMORY_LIMIT_0", "1g")
        .run();
    let (b, l) = (bare.one("views"), limited.one("views"));
    assert_eq!(
        l["cu_mem_get_info"]["total"], b["cu_mem_get_info"]["total"],
        "{l}"
    );
    assert_eq!(u(&l["cu_mem_get_info"]["total"]), 16 * GIB);
    assert_eq!(l["cu_device_total_mem"], b["cu_device_total_mem"]);
    assert_eq!(l["nvml"]["v1"]["total"], b["nvml"]["v1"]["total"]);
    // No limit at all: the library does not even create its shared file.
    let cache = sandbox.container();
    let free = sandbox.probe(&cache, &["views"]).run();
    assert_eq!(
        free.one("views")["cu_device_total_mem"],
        bare.one("views")["cu_device_total_mem"]
    );
    assert!(!exists(&cache), "nothing limited, nothing written");
}

#[test]
fn the_32_bit_entry_points_are_limited_too() {
    // cuGetProcAddress at CUDA 3.1 gives the pre-3.2 ABI (32-bit sizes and pointers), as the
    // exported cuMemAlloc or, from a driver that hands out internal addresses, as an address the
    // library must recognise as that ABI by the version alone.
    for driver in ["exported", "internal"] {
        let sandbox = Sandbox::new("1x16g:108").with("GPUPOOL_STANDIN_PROC_ADDRESS", driver);
        the_32_bit_cu_mem_alloc_is_limited(&sandbox, driver);
    }
}

fn the_32_bit_cu_mem_alloc_is_limited(sandbox: &Sandbox, driver: &str) {
    for (size, expected) in [(64 * MIB, 0), (64 * MIB + 1, 2)] {
        let outcome = sandbox
            .probe(
                &sandbox.container(),
                &[
                    "alloc",
                    "--lookup",
                    "proc",
                    "--cuda-version",
                    "3010",
                    "--context",
                    "create",
                    "--path",
                    "cuMemAlloc",
                    "--size",
                    &size.to_string(),
                ],
            )
            .env(
                "CUDA_DEVICE_MEMORY_LIMIT",
                &(CONTEXT + 64 * MIB).to_string(),
            )
            .env("LIBCUDA_LOG_LEVEL", "3")
            .run();
        assert_eq!(
            outcome.one("alloc")["result"],
            expected,
            "{size} ({driver} addresses): {}\n{}",
            outcome.stdout,
            outcome.stderr
        );
        let fallback = outcome.library_lines().iter().any(|l| {
            l.contains("cuGetProcAddress(cuMemAlloc, 3010, 1)")
                && l.ends_with("wrapped as cuMemAlloc")
        });
        assert_eq!(
            fallback,
            driver == "internal",
            "{driver}: {:?}",
            outcome.library_lines()
        );
    }
}

#[test]
fn deferred_mapping_arrays_are_not_charged_and_ordinary_ones_need_no_driver_figure() {
    let sandbox = Sandbox::new("1x16g:108");
    let limit = (CONTEXT + 16 * MIB).to_string();
    // 4000 x 4000 floats: 61 MiB by the descriptor, more than the limit leaves.
    let array = |path: &str, flags: &str| {
        let outcome = sandbox
            .probe(
                &sandbox.container(),
                &[
                    "alloc", "--path", path, "--width", "4000", "--height", "4000", "--flags",
                    flags, "--views",
                ],
            )
            .env("CUDA_DEVICE_MEMORY_LIMIT", &limit)
            .run();
        let alloc = outcome.one("alloc").clone();
        let views = outcome.ops("views").first().map(|v| free_of(v));
        (alloc, views, outcome)
    };
    for path in ["cuArray3DCreate", "cuMipmappedArrayCreate"] {
        // CUDA_ARRAY3D_DEFERRED_MAPPING: no memory of its own (it is mapped onto cuMemCreate
        // memory, charged there), whatever size the driver reports for it.
        let (alloc, free, outcome) = array(path, "0x80");
        assert_eq!(alloc["result"], 0, "{path}: {}", outcome.stdout);
        assert_eq!(alloc["requirements"]["result"], 0, "{alloc}");
        assert!(u(&alloc["requirements"]["size"]) > 16 * MIB, "{alloc}");
        assert_eq!(free, Some(16 * MIB), "{path}: nothing charged");
        // An ordinary array of that size is refused before the driver is asked.
        let (alloc, _, outcome) = array(path, "0");
        assert_eq!(alloc["result"], 2, "{path}: {}", outcome.stdout);
    }
    // An ordinary array that fits is charged what its descriptor implies: the driver answers no
    // memory requirements for it (cuda.h: only deferred-mapping arrays), and the library does not
    // need them.
    let outcome = sandbox
        .probe(
            &sandbox.container(),
            &[
                "alloc",
                "--path",
                "cuArray3DCreate",
                "--width",
                "1024",
                "--height",
                "1024",
                "--views",
            ],
        )
        .env("CUDA_DEVICE_MEMORY_LIMIT", &limit)
        .run();
    let alloc = outcome.one("alloc");
    assert_eq!(alloc["result"], 0, "{}", outcome.stdout);
    assert_eq!(alloc["requirements"]["result"], 1, "{alloc}");
    assert_eq!(free_of(outcome.ops("views")[0]), 12 * MIB, "4 MiB charged");
}

#[test]
fn a_free_of_a_pointer_we_never_saw_passes_through() {
    let sandbox = Sandbox::new("1x16g:108");
    let bare = sandbox.bare(&["free", "--ptr", "0x1234"]).run();
    let limited = sandbox
        .probe(&sandbox.container(), &["free", "--ptr", "0x1234"])
        .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
        .run();
    assert_eq!(limited.one("free")["result"], bare.one("free")["result"]);
    assert_ne!(bare.one("free")["result"], 0, "the driver refuses it");
}

#[test]
fn without_nvml_memory_limits_hold_with_an_estimated_context() {
    // A context of 200 MiB on this card; without NVML nothing can measure it, and the library
    // charges its fixed estimate (300 MiB) instead.
    let sandbox = Sandbox::without_nvml("1x16g:108").with("GPUPOOL_STANDIN_CONTEXT_MEMORY", "200m");
    let views = sandbox
        .probe(&sandbox.container(), &["views"])
        .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
        .env("LIBCUDA_LOG_LEVEL", "2")
        .run();
    let free = free_of(views.one("views"));
    assert_eq!(free, GIB - 300 * MIB, "{}", views.stdout);
    assert!(
        views
            .library_lines()
            .iter()
            .any(|l| l.contains("an estimate (no NVML)")),
        "{:?}",
        views.library_lines()
    );
    for (size, expected) in [(free, 0), (free + 1, 2)] {
        let outcome = sandbox
            .probe(
                &sandbox.container(),
                &["alloc", "--path", "cuMemAlloc", "--size", &size.to_string()],
            )
            .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
            .run();
        assert_eq!(
            outcome.one("alloc")["result"],
            expected,
            "{size}: {}",
            outcome.stdout
        );
    }
}

#[test]
fn in_a_pid_namespace_the_host_pid_is_found_across_context_creation() {
    // The stand-in's NVML names every process by its PID plus an offset, as the host does for a
    // container's processes: our own PID is not NVML's.
    let sandbox = Sandbox::new("1x16g:108").with("GPUPOOL_STANDIN_HOST_PID_OFFSET", "100000");
    let outcome = sandbox
        .probe(&sandbox.container(), &["views"])
        .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
        .env("LIBCUDA_LOG_LEVEL", "2")
        .run();
    let views = outcome.one("views");
    let pid = u(&views["nvml"]["processes"][0]["pid"]);
    assert!(
        outcome
            .library_lines()
            .iter()
            .any(|l| l.contains(&format!("host PID {pid} (the one new process"))),
        "{:?}",
        outcome.library_lines()
    );
    // With the host PID known, context memory is NVML's per-process figure, exactly.
    assert_eq!(free_of(views), GIB - CONTEXT, "{views}");
    assert!(outcome
        .library_lines()
        .iter()
        .any(|l| l.contains("from NVML's per-process figure")));
}

/// The `nvml_views` line of NVML device `index`.
fn nvml_views(outcome: &Outcome, index: u64) -> &serde_json::Value {
    outcome
        .ops("nvml_views")
        .into_iter()
        .find(|l| l["index"] == index)
        .unwrap_or_else(|| panic!("no views of NVML device {index}:\n{}", outcome.stdout))
}

#[test]
fn a_process_that_only_uses_nvml_sees_the_limit_without_loading_cuda() {
    let sandbox = Sandbox::new("2x16g:108");
    let ids: Vec<String> = sandbox
        .bare(&["nvml-views"])
        .run_ok()
        .ops("nvml_views")
        .iter()
        .map(|l| l["uuid"].as_str().expect("uuid").to_string())
        .collect();
    let cache = sandbox.container();
    // The container's first CUDA process records claim index 0 -> card 0 and holds memory there.
    let _holder = sandbox
        .probe(&cache, &["hold", "--path", "cuMemAlloc", "--size", "256m"])
        .env("CUDA_DEVICE_MEMORY_LIMIT_0", "1g")
        .start_until("hold");
    let monitor = sandbox
        .probe(&cache, &["nvml-views"])
        .env("CUDA_DEVICE_MEMORY_LIMIT_0", "1g")
        .run_ok();
    assert_eq!(monitor.one("libraries")["libcuda_loaded"], false);
    let card0 = nvml_views(&monitor, 0);
    let free = GIB - 256 * MIB - CONTEXT;
    for form in ["v1", "v2"] {
        let v = &card0[form];
        assert_eq!(
            (u(&v["total"]), u(&v["free"]), u(&v["used"])),
            (GIB, free, GIB - free),
            "{form}: {card0}"
        );
    }
    assert_eq!(u(&nvml_views(&monitor, 1)["v1"]["total"]), 16 * GIB);

    // In a container where no CUDA process ran yet, the driver's GPUPOOL_DEVICE_UUID_<i> says
    // which card claim index 0 is.
    let monitor = sandbox
        .probe(&sandbox.container(), &["nvml-views"])
        .env("CUDA_DEVICE_MEMORY_LIMIT_0", "2g")
        .env("GPUPOOL_DEVICE_UUID_0", &ids[1])
        .run_ok();
    assert_eq!(u(&nvml_views(&monitor, 1)["v2"]["total"]), 2 * GIB);
    assert_eq!(u(&nvml_views(&monitor, 0)["v2"]["total"]), 16 * GIB);
    assert_eq!(monitor.one("libraries")["libcuda_loaded"], false);
}

#[test]
fn with_only_hami_cores_variables_nvml_index_i_has_limit_i() {
    // Another device plugin wrote only HAMi-core's variables, and `nvidia-smi` (NVML only) is the
    // first program of the container: NVML's index i is claim index i, as in HAMi-core.
    let sandbox = Sandbox::new("2x16g:108");
    let monitor = sandbox
        .probe(&sandbox.container(), &["nvml-views"])
        .env("CUDA_DEVICE_MEMORY_LIMIT_1", "2g")
        .run_ok();
    for form in ["v1", "v2"] {
        let card1 = &nvml_views(&monitor, 1)[form];
        assert_eq!(
            (u(&card1["total"]), u(&card1["used"])),
            (2 * GIB, 0),
            "{form}: {card1}"
        );
        assert_eq!(u(&nvml_views(&monitor, 0)[form]["total"]), 16 * GIB);
    }
    assert_eq!(monitor.one("libraries")["libcuda_loaded"], false);
    let monitor = sandbox
        .probe(&sandbox.container(), &["nvml-views"])
        .env("CUDA_DEVICE_MEMORY_LIMIT", "4g")
        .run_ok();
    for index in [0, 1] {
        assert_eq!(u(&nvml_views(&monitor, index)["v2"]["total"]), 4 * GIB);
    }
}

#[test]
fn a_malformed_limit_makes_nvml_refuse_memory_queries() {
    let sandbox = Sandbox::new("2x16g:108");
    let monitor = sandbox
        .probe(&sandbox.container(), &["nvml-views"])
        .env("CUDA_DEVICE_MEMORY_LIMIT_0", "12q")
        .run_ok();
    for index in [0, 1] {
        let views = nvml_views(&monitor, index);
        for form in ["v1", "v2"] {
            assert_eq!(
                views[form]["error"], "NVML_ERROR_UNINITIALIZED",
                "{form} of device {index}: {views}"
            );
        }
        // Only memory is refused: the card itself is still listed.
        assert!(views["uuid"].is_string(), "{views}");
    }
    let lines = monitor.library_lines();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].contains("CUDA_DEVICE_MEMORY_LIMIT_0") && lines[0].contains("12q"));
    assert_eq!(monitor.one("libraries")["libcuda_loaded"], false);
}

#[test]
fn ending_a_context_gives_back_what_was_allocated_in_it() {
    let sandbox = Sandbox::new("1x16g:108");
    // (how the context was made, how it ends, allocation path, height of 16 MiB at a width of
    // 4096): cudaDeviceReset resets the primary context; a framework's teardown releases it; a
    // context of one's own is destroyed.
    for (context, end, path, height) in [
        ("primary", "reset", "cuMemAlloc", "1024"),
        ("primary", "release", "cuMemAlloc", "1024"),
        ("create", "destroy", "cuMemAlloc", "1024"),
        ("primary", "reset", "cuMemAllocPitch", "4096"),
        ("primary", "reset", "cuArrayCreate", "1024"),
    ] {
        let outcome = sandbox
            .probe(
                &sandbox.container(),
                &[
                    "alloc",
                    "--path",
                    path,
                    "--size",
                    "16m",
                    "--width",
                    "4096",
                    "--height",
                    height,
                    "--count",
                    "2",
                    "--views",
                    "--context",
                    context,
                    "--end-context",
                    end,
                ],
            )
            .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
            .run_ok();
        let what = format!("{path} in a {context} context, then {end}");
        assert_eq!(
            outcome.one("end_context")["result"],
            0,
            "{what}: {}",
            outcome.stdout
        );
        let free: Vec<u64> = outcome.ops("views").iter().map(|v| free_of(v)).collect();
        assert_eq!(
            free,
            vec![
                GIB - CONTEXT - 16 * MIB,
                GIB - CONTEXT - 32 * MIB,
                GIB - CONTEXT
            ],
            "{what}: after the end only the new context is charged\n{}",
            outcome.stderr
        );
    }
}

#[test]
fn a_monitor_that_closes_and_reopens_nvml_stays_limited() {
    // Monitoring agents open NVML, read, shut it down and dlclose it, again and again. Unloaded
    // under the library, a new copy could land elsewhere: its functions unwrapped (the views
    // unlimited) and the library's pointers into the old copy left dangling.
    let sandbox = Sandbox::new("1x16g:108");
    let uuid = sandbox.bare(&["nvml-views"]).run_ok().ops("nvml_views")[0]["uuid"]
        .as_str()
        .expect("uuid")
        .to_string();
    let monitor = sandbox
        .probe(&sandbox.container(), &["nvml-views", "--reopen", "2"])
        .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
        .env("GPUPOOL_DEVICE_UUID_0", &uuid)
        .run_ok();
    let views = monitor.ops("nvml_views");
    assert_eq!(views.len(), 3, "{}", monitor.stdout);
    for (round, v) in views.iter().enumerate() {
        for form in ["v1", "v2"] {
            assert_eq!(u(&v[form]["total"]), GIB, "round {round}, {form}: {v}");
        }
    }
    assert!(
        monitor.library_lines().is_empty(),
        "{:?}",
        monitor.library_lines()
    );
}

#[test]
fn a_process_idle_after_a_device_reset_is_charged_nothing() {
    let sandbox = Sandbox::new("1x16g:108");
    let cache = sandbox.container();
    // cudaDeviceReset, then no more CUDA: no context, no memory on the card.
    let _idle = sandbox
        .probe(
            &cache,
            &[
                "alloc",
                "--path",
                "cuMemAlloc",
                "--size",
                "64m",
                "--end-context",
                "reset",
                "--hold",
            ],
        )
        .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
        .start_until("hold");
    let views = sandbox
        .probe(&cache, &["views"])
        .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
        .run_ok();
    let v = views.one("views");
    assert_eq!(
        v["nvml"]["processes"].as_array().map(Vec::len),
        Some(1),
        "only this process is on the card: {v}"
    );
    assert_eq!(
        free_of(v),
        GIB - CONTEXT,
        "only this process's own context is charged: {v}"
    );
}

#[test]
fn a_stream_ordered_allocation_never_breaks_another_threads_capture() {
    // PyTorch captures graphs in global mode; another thread's cudaMallocAsync on another stream
    // is legal meanwhile. The library must not make it illegal by what it asks the driver to
    // charge it (cuStreamGetDevice is refused during a global capture on driver 580, and the
    // capture is invalidated).
    let sandbox = Sandbox::new("1x16g:108");
    let outcome = sandbox
        .probe(
            &sandbox.container(),
            &[
                "capture-rules",
                "--call",
                "mem-alloc-async",
                "--caller",
                "other",
            ],
        )
        .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
        .run_ok();
    let c = outcome.one("capture_rules");
    assert_eq!(c["result"], 0, "{c}\n{}", outcome.stderr);
    assert_eq!(
        (
            c["status_after"].as_i64(),
            c["end_result"].as_i64(),
            &c["graph"]
        ),
        (Some(1), Some(0), &serde_json::Value::Bool(true)),
        "the capture was broken: {c}"
    );
}

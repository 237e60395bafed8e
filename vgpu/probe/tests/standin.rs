//! The stand-ins themselves, without the enforcement library: they must refuse what the real
//! driver refuses (or the library's tests would pass against a driver more lenient than any GPU),
//! share one card between processes, time-slice it, and free a killed process's memory.

mod harness;

use harness::*;
use serde_json::Value;
use std::time::Duration;

fn result(v: &Value) -> i64 {
    v["result"]
        .as_i64()
        .unwrap_or_else(|| panic!("no result in {v}"))
}

const SUCCESS: i64 = 0;
const INVALID_VALUE: i64 = 1;
const OUT_OF_MEMORY: i64 = 2;
const NOT_INITIALIZED: i64 = 3;
const NO_DEVICE: i64 = 100;
const INVALID_CONTEXT: i64 = 201;
const NOT_FOUND: i64 = 500;
const COOPERATIVE_LAUNCH_TOO_LARGE: i64 = 720;

/// The probe on the stand-ins alone (no library); it must run to its end.
fn run(machine: &Sandbox, args: &[&str]) -> Outcome {
    machine.bare(args).run_ok()
}

#[test]
fn calls_before_cuinit_are_refused() {
    let m = Sandbox::new("1x1g");
    let out = run(
        &m,
        &["alloc", "--path", "cuMemAlloc", "--size", "1m", "--no-init"],
    );
    assert_eq!(result(out.one("alloc")), NOT_INITIALIZED);
}

#[test]
fn calls_without_a_context_are_refused() {
    let m = Sandbox::new("1x1g");
    let out = run(
        &m,
        &[
            "alloc",
            "--path",
            "cuMemAlloc",
            "--size",
            "1m",
            "--context",
            "none",
            "--views",
        ],
    );
    assert_eq!(result(out.one("alloc")), INVALID_CONTEXT);
    assert_eq!(
        result(&out.one("views")["cu_mem_get_info"]),
        INVALID_CONTEXT
    );
    // cuDeviceTotalMem needs no context.
    assert_eq!(out.one("views")["cu_device_total_mem"]["bytes"], GIB);
}

#[test]
fn zero_sizes_bad_pointers_and_bad_shapes_are_refused() {
    let m = Sandbox::new("1x1g");
    for (path, extra) in [
        ("cuMemAlloc", vec![]),
        ("cuMemAllocManaged", vec![]),
        ("cuMemAllocAsync", vec![]),
        ("cuMemAllocPitch", vec!["--width", "0", "--height", "4"]),
    ] {
        let mut args = vec!["alloc", "--path", path, "--size", "0"];
        args.extend(extra);
        assert_eq!(
            result(run(&m, &args).one("alloc")),
            INVALID_VALUE,
            "{path} of 0 bytes"
        );
    }
    let out = run(&m, &["free", "--ptr", "0xdead000"]);
    assert_eq!(result(out.one("free")), INVALID_VALUE);
    // Pitched memory takes elements of 4, 8 or 16 bytes; cuMemCreate whole granules (2 MiB).
    let out = run(
        &m,
        &[
            "alloc",
            "--path",
            "cuMemAllocPitch",
            "--width",
            "100",
            "--height",
            "2",
            "--element",
            "3",
        ],
    );
    assert_eq!(result(out.one("alloc")), INVALID_VALUE);
    let out = run(&m, &["alloc", "--path", "cuMemCreate", "--size", "3m"]);
    assert_eq!(result(out.one("alloc")), INVALID_VALUE);
}

#[test]
fn memory_runs_out_at_the_cards_capacity_to_the_byte() {
    let m = Sandbox::new("1x1g");
    let room = (GIB - CONTEXT).to_string();
    let over = (GIB - CONTEXT + 1).to_string();
    assert_eq!(
        result(run(&m, &["alloc", "--path", "cuMemAlloc", "--size", &room]).one("alloc")),
        SUCCESS
    );
    assert_eq!(
        result(run(&m, &["alloc", "--path", "cuMemAlloc", "--size", &over]).one("alloc")),
        OUT_OF_MEMORY
    );
    let fill = run(&m, &["fill", "--path", "cuMemAlloc", "--chunk", "1m"]);
    let f = fill.one("fill");
    assert_eq!(result(f), OUT_OF_MEMORY);
    assert_eq!(f["allocated"], GIB - CONTEXT);
    // Pitched memory is charged pitch x height: 100-byte rows take 512.
    let out = run(
        &m,
        &[
            "alloc",
            "--path",
            "cuMemAllocPitch",
            "--width",
            "100",
            "--height",
            "3",
        ],
    );
    let a = out.one("alloc");
    assert_eq!(
        (a["pitch"].as_u64(), a["bytes"].as_u64()),
        (Some(512), Some(1536))
    );
    // A context needs its memory too: a card without room for another one refuses the context.
    let small = Sandbox::new("1x1g").with("GPUPOOL_STANDIN_CONTEXT_MEMORY", "600m");
    let mut holder = small
        .bare(&["hold", "--path", "cuMemAlloc", "--size", "1m"])
        .start_until("hold");
    assert_eq!(result(&holder.line), SUCCESS);
    let out = run(&small, &["views"]);
    holder.kill9();
    assert!(
        out.lines
            .iter()
            .any(|l| l["op"] == "context" && result(l) == OUT_OF_MEMORY),
        "{out:?}"
    );
}

#[test]
fn the_views_agree_on_what_is_used() {
    let m = Sandbox::new("1x2g").with("GPUPOOL_STANDIN_RESERVED_MEMORY", "100m");
    let out = run(
        &m,
        &["alloc", "--path", "cuMemAlloc", "--size", "64m", "--views"],
    );
    let v = &out.ops("views")[0];
    let used = CONTEXT + 64 * MIB;
    let free = 2 * GIB - 100 * MIB - used;
    assert_eq!(v["cu_mem_get_info"]["free"], free);
    assert_eq!(v["cu_mem_get_info"]["total"], 2 * GIB);
    assert_eq!(v["cu_device_total_mem"]["bytes"], 2 * GIB);
    let n = &v["nvml"];
    assert_eq!(
        (n["v1"]["free"].as_u64(), n["v1"]["used"].as_u64()),
        (Some(free), Some(used + 100 * MIB))
    );
    assert_eq!(n["v2"]["version"], 0x0200_0028);
    assert_eq!(
        (n["v2"]["reserved"].as_u64(), n["v2"]["used"].as_u64()),
        (Some(100 * MIB), Some(used))
    );
    let pid = n["processes"][0]["pid"].clone();
    assert_eq!(n["processes"].as_array().unwrap().len(), 1);
    assert_eq!(n["processes"][0]["used_memory"], used);
    assert_eq!(
        n["processes_v1"][0],
        serde_json::json!({"pid": pid, "used_memory": used})
    );
    // A wrong struct version is refused.
    let out = run(&m, &["views", "--nvml-v2-version", "0x01000028"]);
    assert_eq!(
        out.one("views")["nvml"]["v2"]["error"],
        "NVML_ERROR_ARGUMENT_VERSION_MISMATCH"
    );
}

/// On the H200, NVML's per-process used memory stayed at the context's ~543 MB with 4 GiB of
/// managed memory allocated: managed memory is not in the process's figure. The card is charged
/// for it at once all the same (stricter than a card, which holds it only once touched).
#[test]
fn managed_memory_is_on_the_card_but_not_in_the_processs_nvml_figure() {
    let m = Sandbox::new("1x1g");
    let out = run(
        &m,
        &[
            "alloc",
            "--path",
            "cuMemAllocManaged",
            "--size",
            "64m",
            "--views",
        ],
    );
    assert_eq!(result(out.one("alloc")), SUCCESS);
    let v = &out.ops("views")[0];
    assert_eq!(v["cu_mem_get_info"]["free"], GIB - CONTEXT - 64 * MIB);
    assert_eq!(v["nvml"]["v1"]["used"], CONTEXT + 64 * MIB);
    assert_eq!(v["nvml"]["processes"][0]["used_memory"], CONTEXT, "{v}");
    assert_eq!(v["nvml"]["processes_v1"][0]["used_memory"], CONTEXT, "{v}");
    let fill = run(
        &m,
        &["fill", "--path", "cuMemAllocManaged", "--chunk", "1m"],
    );
    assert_eq!(fill.one("fill")["allocated"], GIB - CONTEXT);
    // Freed, it leaves the card.
    assert_eq!(
        out.ops("views")[1]["cu_mem_get_info"]["free"],
        GIB - CONTEXT
    );
}

#[test]
fn two_processes_share_a_card_and_a_killed_ones_memory_is_freed() {
    let m = Sandbox::new("1x2g");
    let mut holder = m
        .bare(&["hold", "--path", "cuMemAlloc", "--size", "600m"])
        .start_until("hold");
    let held = holder.line.clone();
    assert_eq!(result(&held), SUCCESS);
    let holder_pid = held["pid"].clone();
    let views = run(&m, &["views"]);
    let v = views.one("views");
    assert_eq!(
        v["cu_mem_get_info"]["free"],
        2 * GIB - 2 * CONTEXT - 600 * MIB
    );
    assert!(v["nvml"]["processes"]
        .as_array()
        .unwrap()
        .iter()
        .any(|p| p["pid"] == holder_pid));
    let fill = run(&m, &["fill", "--path", "cuMemAlloc", "--chunk", "1m"]);
    assert_eq!(
        fill.one("fill")["allocated"],
        2 * GIB - 2 * CONTEXT - 600 * MIB
    );

    holder.kill9();
    // The next look at the card finds the dead process's memory released.
    let v = run(&m, &["views"]);
    let v = v.one("views");
    assert_eq!(v["cu_mem_get_info"]["free"], 2 * GIB - CONTEXT);
    assert!(!v["nvml"]["processes"]
        .as_array()
        .unwrap()
        .iter()
        .any(|p| p["pid"] == holder_pid));
}

#[test]
fn get_proc_address_refuses_unknown_symbols_and_old_versions() {
    let m = Sandbox::new("1x1g");
    let out = run(&m, &["getproc", "--symbol", "cuNoSuchFunction"]);
    let g = out.one("getproc");
    assert_eq!(
        (result(g), g["status"].as_i64(), g["address"].as_str()),
        (NOT_FOUND, Some(1), Some("0x0"))
    );
    let out = run(
        &m,
        &[
            "getproc",
            "--symbol",
            "cuMemAllocAsync",
            "--cuda-version",
            "11010",
        ],
    );
    let g = out.one("getproc");
    assert_eq!((result(g), g["status"].as_i64()), (NOT_FOUND, Some(2)));
    let out = run(
        &m,
        &[
            "getproc",
            "--symbol",
            "cuMemAllocAsync",
            "--cuda-version",
            "11020",
        ],
    );
    assert_eq!(
        out.one("getproc")["matches"],
        serde_json::json!(["cuMemAllocAsync"])
    );
    let out = run(&m, &["getproc", "--symbol", "cuInit", "--flags", "4"]);
    assert_eq!(result(out.one("getproc")), INVALID_VALUE);
}

#[test]
fn get_proc_address_can_answer_as_cuda_h_says_for_unknown_symbols() {
    // GPUPOOL_STANDIN_PROC_NOT_FOUND=success: CUDA_SUCCESS with a NULL pointer, the status saying
    // why (cuda.h's comment; drivers answer CUDA_ERROR_NOT_FOUND, the default above).
    let m = Sandbox::new("1x1g").with("GPUPOOL_STANDIN_PROC_NOT_FOUND", "success");
    let out = run(&m, &["getproc", "--symbol", "cuNoSuchFunction"]);
    let g = out.one("getproc");
    assert_eq!(
        (result(g), g["status"].as_i64(), g["address"].as_str()),
        (SUCCESS, Some(1), Some("0x0"))
    );
    let out = run(
        &m,
        &[
            "getproc",
            "--symbol",
            "cuMemAllocAsync",
            "--cuda-version",
            "11010",
        ],
    );
    let g = out.one("getproc");
    assert_eq!(
        (result(g), g["status"].as_i64(), g["address"].as_str()),
        (SUCCESS, Some(2), Some("0x0"))
    );
    // A value that is neither choice is refused, naming the variable.
    let typo = Sandbox::new("1x1g").with("GPUPOOL_STANDIN_PROC_NOT_FOUND", "nul");
    let out = typo.bare(&["getproc", "--symbol", "cuInit"]).run_ok();
    assert_eq!(result(out.one("getproc")), INVALID_VALUE);
    assert!(
        out.stderr.contains("GPUPOOL_STANDIN_PROC_NOT_FOUND"),
        "{}",
        out.stderr
    );
}

#[test]
fn get_proc_address_can_hand_out_internal_addresses() {
    // GPUPOOL_STANDIN_PROC_ADDRESS=internal: each variant comes back as an address that is none of
    // the exported symbols (a thunk that jumps to it), as a driver may return internal entry
    // points; dlsym still finds the exports.
    let m = Sandbox::new("1x1g").with("GPUPOOL_STANDIN_PROC_ADDRESS", "internal");
    for (symbol, version) in [("cuMemAlloc", "12090"), ("cuLaunchKernel", "12090")] {
        let out = run(
            &m,
            &["getproc", "--symbol", symbol, "--cuda-version", version],
        );
        let g = out.one("getproc");
        assert_eq!(result(g), SUCCESS, "{g}");
        assert_ne!(g["address"], "0x0", "{g}");
        assert_eq!(g["matches"], serde_json::json!([]), "{g}");
    }
    // The internal addresses are the driver's functions: every ABI works through them.
    for version in ["12090", "3010"] {
        let out = run(
            &m,
            &[
                "alloc",
                "--path",
                "cuMemAlloc",
                "--size",
                "3m",
                "--views",
                "--lookup",
                "proc",
                "--cuda-version",
                version,
                "--context",
                "create",
            ],
        );
        assert_eq!(result(out.one("alloc")), SUCCESS, "{version}");
        assert_eq!(
            out.ops("views")[0]["cu_mem_get_info"]["free"],
            GIB - CONTEXT - 3 * MIB,
            "{version}"
        );
        assert_eq!(result(out.one("free")), SUCCESS, "{version}");
        assert_eq!(
            out.one("resolved")["entry_points"]["cuMemAlloc"]["matches"],
            serde_json::json!([]),
            "{version}"
        );
    }
    let out = run(
        &m,
        &[
            "launch",
            "--mode",
            "graph",
            "--seconds",
            "0.2",
            "--kernel-us",
            "1000",
            "--lookup",
            "proc",
            "--per-thread",
        ],
    );
    assert_eq!(result(out.one("launch")), SUCCESS);
    assert!(out.one("launch")["kernels"].as_u64().unwrap() > 0);
}

/// GPUPOOL_STANDIN_PROC_ADDRESS=interposed: the address is the global lookup of the variant's
/// name, as a driver or interposer whose table resolves through symbol interposition hands out.
/// With nothing preloaded that is the driver's own symbol; a preloaded library that exports the
/// name (here gpupool-vgpu, without limits) comes first.
#[test]
fn get_proc_address_can_hand_out_interposed_addresses() {
    let m = Sandbox::new("1x1g").with("GPUPOOL_STANDIN_PROC_ADDRESS", "interposed");
    let args = [
        "getproc",
        "--symbol",
        "cuMemAlloc",
        "--cuda-version",
        "12090",
    ];
    let bare = run(&m, &args);
    let g = bare.one("getproc");
    assert_eq!(result(g), SUCCESS, "{g}");
    assert_eq!(g["matches"], serde_json::json!(["cuMemAlloc_v2"]), "{g}");
    assert_eq!(g["object"], "libcuda.so.1", "{g}");
    let preloaded = m.probe(&m.container(), &args).run_ok();
    let g = preloaded.one("getproc");
    let library = vgpu_library();
    let library = library.file_name().unwrap().to_string_lossy();
    assert_eq!(result(g), SUCCESS, "{g}");
    assert_eq!(g["object"], library.as_ref(), "{g}");
    // The driver's functions are still what the names lead to: it runs.
    let out = run(
        &m,
        &[
            "alloc",
            "--path",
            "cuMemAlloc",
            "--size",
            "3m",
            "--views",
            "--lookup",
            "proc",
        ],
    );
    assert_eq!(
        out.ops("views")[0]["cu_mem_get_info"]["free"],
        GIB - CONTEXT - 3 * MIB
    );
    let typo = Sandbox::new("1x1g").with("GPUPOOL_STANDIN_PROC_ADDRESS", "interposer");
    let out = typo.bare(&["getproc", "--symbol", "cuInit"]).run_ok();
    assert_eq!(result(out.one("getproc")), INVALID_VALUE);
    assert!(out.stderr.contains("interposed"), "{}", out.stderr);
}

fn chosen(m: &Sandbox, symbol: &str, version: &str, per_thread: bool) -> Value {
    let mut args = vec!["getproc", "--symbol", symbol, "--cuda-version", version];
    if per_thread {
        args.push("--per-thread");
    }
    let out = run(m, &args);
    let g = out.one("getproc");
    assert_eq!(result(g), SUCCESS, "{g}");
    g["matches"].clone()
}

#[test]
fn versions_pick_the_abi_and_only_the_flag_picks_ptsz() {
    let m = Sandbox::new("1x1g");
    let j = |names: &[&str]| serde_json::json!(names);
    assert_eq!(chosen(&m, "cuMemAlloc", "3010", false), j(&["cuMemAlloc"]));
    assert_eq!(
        chosen(&m, "cuMemAlloc", "12090", true),
        j(&["cuMemAlloc_v2"])
    );
    assert_eq!(
        chosen(&m, "cuLaunchKernel", "12090", false),
        j(&["cuLaunchKernel"])
    );
    assert_eq!(
        chosen(&m, "cuLaunchKernel", "12090", true),
        j(&["cuLaunchKernel_ptsz"])
    );
    assert_eq!(
        chosen(&m, "cuLaunchKernel", "6050", true),
        j(&["cuLaunchKernel"])
    );
    assert_eq!(
        chosen(&m, "cuGraphLaunch", "12090", true),
        j(&["cuGraphLaunch_ptsz"])
    );
    assert_eq!(
        chosen(&m, "cuStreamBeginCapture", "10000", true),
        j(&["cuStreamBeginCapture_ptsz"])
    );
    assert_eq!(
        chosen(&m, "cuGraphInstantiate", "11000", false),
        j(&["cuGraphInstantiate_v2"])
    );
    assert_eq!(
        chosen(&m, "cuGraphInstantiate", "12000", false),
        j(&["cuGraphInstantiateWithFlags"])
    );
    assert_eq!(
        chosen(&m, "cuGetProcAddress", "12000", false),
        j(&["cuGetProcAddress_v2"])
    );
}

#[test]
fn every_lookup_path_reaches_the_driver() {
    let m = Sandbox::new("1x1g");
    for lookup in [
        vec!["--lookup", "dlsym"],
        vec!["--lookup", "global"],
        vec!["--lookup", "proc"],
        vec!["--lookup", "proc", "--per-thread"],
        vec!["--lookup", "proc-v1"],
        // CUDA 3.1's ABI: 32-bit sizes and addresses.
        vec![
            "--lookup",
            "proc",
            "--cuda-version",
            "3010",
            "--context",
            "create",
        ],
    ] {
        let mut args = vec!["alloc", "--path", "cuMemAlloc", "--size", "3m", "--views"];
        args.extend(&lookup);
        let out = run(&m, &args);
        assert_eq!(result(out.one("alloc")), SUCCESS, "{lookup:?}");
        assert_eq!(result(out.one("free")), SUCCESS, "{lookup:?}");
        let free = out.ops("views")[0]["cu_mem_get_info"]["free"]
            .as_u64()
            .unwrap();
        assert_eq!(free, GIB - CONTEXT - 3 * MIB, "{lookup:?}");
        let found = &out.one("resolved")["entry_points"]["cuMemAlloc"]["matches"];
        let expected = if lookup.contains(&"3010") {
            "cuMemAlloc"
        } else {
            "cuMemAlloc_v2"
        };
        assert_eq!(found, &serde_json::json!([expected]), "{lookup:?}");
    }
}

#[test]
fn cuda_visible_devices_orders_and_narrows_like_the_real_driver() {
    let m = Sandbox::new("3x1g");
    let all: Vec<Value> = run(&m, &["devices"])
        .ops("device")
        .iter()
        .map(|d| d["uuid"].clone())
        .collect();
    assert_eq!(all.len(), 3);
    let seen = |visible: &str| -> Vec<Value> {
        let out = m
            .bare(&["devices"])
            .env("CUDA_VISIBLE_DEVICES", visible)
            .run_ok();
        out.ops("device")
            .iter()
            .map(|d| d["uuid"].clone())
            .collect()
    };
    assert_eq!(seen("2,0"), vec![all[2].clone(), all[0].clone()]);
    let prefix = &all[1].as_str().unwrap()[..12];
    assert_eq!(
        seen(&format!("{prefix},2")),
        vec![all[1].clone(), all[2].clone()]
    );
    assert_eq!(
        seen(&format!("{},0", all[2].as_str().unwrap())),
        vec![all[2].clone(), all[0].clone()]
    );
    assert_eq!(seen("1,7,0"), vec![all[1].clone()]);
    let out = m
        .bare(&["devices"])
        .env("CUDA_VISIBLE_DEVICES", "")
        .run_ok();
    assert_eq!(result(out.one("init")), NO_DEVICE);
    // Memory is charged to the card the ordinal names.
    let out = m
        .bare(&[
            "alloc",
            "--path",
            "cuMemAlloc",
            "--size",
            "5m",
            "--no-free",
            "--views",
        ])
        .env("CUDA_VISIBLE_DEVICES", "2")
        .run_ok();
    let nv = &out.one("views")["nvml"];
    assert_eq!(out.one("views")["uuid"], all[2]);
    assert_eq!(nv["v1"]["used"], CONTEXT + 5 * MIB);
}

#[test]
fn arrays_report_their_size_only_when_deferred() {
    let m = Sandbox::new("1x1g");
    let out = run(
        &m,
        &[
            "alloc",
            "--path",
            "cuArray3DCreate",
            "--width",
            "1000",
            "--height",
            "1000",
            "--format",
            "1",
            "--views",
        ],
    );
    let a = out.one("alloc");
    assert_eq!(result(a), SUCCESS);
    assert_eq!(
        result(&a["requirements"]),
        INVALID_VALUE,
        "cuda.h: only deferred-mapping arrays answer"
    );
    // 1000 x 1000 bytes in 64-byte rows and 8-row tiles, whole 64 KiB pages: 16 pages.
    assert_eq!(
        out.ops("views")[0]["cu_mem_get_info"]["free"],
        GIB - CONTEXT - 16 * 65536
    );
    let out = run(
        &m,
        &[
            "alloc",
            "--path",
            "cuArray3DCreate",
            "--width",
            "1000",
            "--height",
            "1000",
            "--format",
            "1",
            "--flags",
            "0x80",
            "--views",
        ],
    );
    let a = out.one("alloc");
    assert_eq!(a["requirements"]["size"], 16 * 65536);
    assert_eq!(
        out.ops("views")[0]["cu_mem_get_info"]["free"],
        GIB - CONTEXT
    );
    let out = run(
        &m,
        &[
            "alloc",
            "--path",
            "cuArrayCreate",
            "--width",
            "100",
            "--height",
            "10",
            "--channels",
            "3",
        ],
    );
    assert_eq!(result(out.one("alloc")), INVALID_VALUE);
}

#[test]
fn pools_grow_in_granules_and_give_back_at_synchronisation() {
    let m = Sandbox::new("1x1g");
    let out = run(
        &m,
        &[
            "alloc",
            "--path",
            "cuMemAllocAsync",
            "--size",
            "3m",
            "--views",
        ],
    );
    assert_eq!(result(out.one("alloc")), SUCCESS);
    let v = out.ops("views");
    assert_eq!(v[0]["cu_mem_get_info"]["free"], GIB - CONTEXT - 4 * MIB);
    // cuMemFreeAsync and a synchronisation: the pool keeps nothing above its threshold (0).
    assert_eq!(result(out.one("free")), SUCCESS);
    assert_eq!(v[1]["cu_mem_get_info"]["free"], GIB - CONTEXT);
    let out = run(
        &m,
        &[
            "alloc",
            "--path",
            "cuMemAllocFromPoolAsync",
            "--pool",
            "created",
            "--size",
            "1m",
            "--per-thread",
            "--lookup",
            "proc",
        ],
    );
    assert_eq!(result(out.one("alloc")), SUCCESS);
}

#[test]
fn launches_follow_the_launch_rules() {
    let m = Sandbox::new("1x1g:10");
    // 10 SMs x 2 resident blocks of 1024 threads: 20 blocks fit a cooperative launch, 21 do not.
    let ok = run(
        &m,
        &[
            "launch",
            "--mode",
            "cooperative",
            "--grid",
            "20",
            "--block",
            "1024",
            "--seconds",
            "0.1",
            "--kernel-us",
            "100",
        ],
    );
    assert_eq!(result(ok.one("launch")), SUCCESS);
    let too = run(
        &m,
        &[
            "launch",
            "--mode",
            "cooperative",
            "--grid",
            "21",
            "--block",
            "1024",
            "--seconds",
            "0.1",
        ],
    );
    assert_eq!(result(too.one("launch")), COOPERATIVE_LAUNCH_TOO_LARGE);
    let too = run(&m, &["launch", "--block", "2048", "--seconds", "0.1"]);
    assert_eq!(result(too.one("launch")), INVALID_VALUE);
    // A kernel runs for its parameter: 20 ms kernels over 0.3 s keep the card busy.
    let busy = run(
        &m,
        &[
            "launch",
            "--kernel-us",
            "20000",
            "--seconds",
            "0.3",
            "--mode",
            "capture",
            "--graph-nodes",
            "2",
        ],
    );
    let l = busy.one("launch");
    assert!(l["busy_fraction"].as_f64().unwrap() > 0.7, "{l}");
}

/// What `capture-rules` says happened: the call's result, and whether the capture survived.
fn capture_rule(
    m: &Sandbox,
    capture: &str,
    caller: &str,
    mode: Option<&str>,
    call: &str,
) -> (i64, bool) {
    let mut args = vec![
        "capture-rules",
        "--capture-mode",
        capture,
        "--caller",
        caller,
        "--call",
        call,
    ];
    if let Some(mode) = mode {
        args.extend(["--caller-mode", mode]);
    }
    let out = run(m, &args);
    let c = out.one("capture_rules");
    assert_eq!(c["begin_result"], 0, "{c}");
    assert_eq!(c["exchange_result"], 0, "{c}");
    let valid = c["end_result"] == 0 && c["graph"] == true;
    if valid {
        assert_eq!(
            (c["status_after"].as_i64(), c["launch_after"].as_i64()),
            (Some(1), Some(0)),
            "{c}"
        );
    } else {
        // Invalidated: the capture goes on failing and ends without a graph.
        assert_eq!(
            (
                c["status_after"].as_i64(),
                c["launch_after"].as_i64(),
                c["end_result"].as_i64()
            ),
            (
                Some(2),
                Some(CAPTURE_INVALIDATED),
                Some(CAPTURE_INVALIDATED)
            ),
            "{c}"
        );
        assert_eq!(c["graph"], false, "{c}");
    }
    (result(c), valid)
}

const NOT_READY: i64 = 600;
const CAPTURE_UNSUPPORTED: i64 = 900;
const CAPTURE_INVALIDATED: i64 = 901;
const CAPTURED_EVENT: i64 = 907;

/// cuda.h's rules for calls made during a capture. A thread in the default (global) interaction
/// mode may not make a potentially unsafe call while any thread captures in global mode, nor while
/// it captures itself (unless relaxed); thread-local mode looks at its own captures only; relaxed
/// mode at none. A prohibited call fails with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and
/// invalidates the capture: this is how PyTorch's NCCL watchdog, polling an event recorded before
/// the capture from its own thread, broke captures until it switched to a laxer mode. Calls that
/// conflict with the capture itself (querying the capturing stream, an event recorded in it, or
/// synchronising its context) are refused in every mode.
#[test]
fn calls_during_a_capture_follow_the_capture_mode_rules() {
    let m = Sandbox::new("1x1g");
    let unsafe_calls = [
        "event-query",
        "event-sync",
        "stream-query",
        "stream-sync",
        "mem-alloc",
        "stream-get-device",
    ];
    for call in unsafe_calls {
        // Another thread in the default mode, a global capture: prohibited, capture invalidated.
        assert_eq!(
            capture_rule(&m, "global", "other", None, call),
            (CAPTURE_UNSUPPORTED, false),
            "{call}"
        );
        // The same call from a relaxed or thread-local thread: allowed, the capture holds.
        for mode in ["relaxed", "thread-local"] {
            let (r, valid) = capture_rule(&m, "global", "other", Some(mode), call);
            assert!(
                valid && (r == SUCCESS || r == NOT_READY),
                "{call} from a {mode} thread: {r}"
            );
        }
    }
    for (capture, caller, mode, call, expected) in [
        // A thread-local capture ignores other threads...
        (
            "thread-local",
            "other",
            None,
            "event-query",
            (SUCCESS, true),
        ),
        // ...but not its own thread.
        (
            "thread-local",
            "same",
            None,
            "event-query",
            (CAPTURE_UNSUPPORTED, false),
        ),
        (
            "global",
            "same",
            None,
            "mem-alloc",
            (CAPTURE_UNSUPPORTED, false),
        ),
        (
            "global",
            "same",
            Some("relaxed"),
            "mem-alloc",
            (SUCCESS, true),
        ),
        // A relaxed capture prohibits nothing.
        ("relaxed", "same", None, "stream-sync", (SUCCESS, true)),
        ("relaxed", "other", None, "mem-alloc", (SUCCESS, true)),
        // Conflicting calls are refused in every mode (a context's synchronisation takes in its
        // capturing stream).
        (
            "global",
            "other",
            Some("relaxed"),
            "captured-event-query",
            (CAPTURED_EVENT, false),
        ),
        (
            "relaxed",
            "same",
            None,
            "capturing-stream-query",
            (CAPTURE_UNSUPPORTED, false),
        ),
        (
            "relaxed",
            "other",
            Some("relaxed"),
            "ctx-sync",
            (CAPTURE_UNSUPPORTED, false),
        ),
    ] {
        let (r, valid) = capture_rule(&m, capture, caller, mode, call);
        let r = if r == NOT_READY { SUCCESS } else { r };
        assert_eq!(
            (r, valid),
            expected,
            "{call} from the {caller} thread ({mode:?}) during a {capture} capture"
        );
    }
}

#[test]
fn two_saturating_processes_take_turns_half_and_half() {
    let _serial = one_at_a_time();
    let m = Sandbox::new("1x1g");
    let w = Window::after(Duration::from_millis(800), Duration::from_millis(2000));
    let a = m.bare(&args(&w.saturating("eager", 2000))).spawn();
    let b = m
        .bare(&args(&w.saturating("graph", 2000)))
        .env("CUDA_VISIBLE_DEVICES", "0")
        .spawn();
    let (a, b) = (card_share(&finish(a)), card_share(&finish(b)));
    for share in [a, b] {
        assert!((0.40..=0.60).contains(&share), "{a:.3} / {b:.3}");
    }
    assert!(a + b <= 1.02, "two kernels at once: {a:.3} + {b:.3}");
    assert!(a + b >= 0.85, "the card idled: {a:.3} + {b:.3}");
}

/// A GPU without MPS time-slices contexts: a kernel still running at the end of its process's turn
/// is preempted and resumes at the next turn, so a process with long kernels does not hold the card
/// for their whole length while another process has work. 50 ms kernels against 1 ms kernels get
/// half the card each (handed over only at kernel ends, the long kernels would take ~98 %).
#[test]
fn a_long_kernel_is_preempted_at_the_end_of_its_turn() {
    let _serial = one_at_a_time();
    let m = Sandbox::new("1x1g");
    let w = Window::after(Duration::from_millis(800), Duration::from_millis(3000));
    let long = m.bare(&args(&w.saturating("eager", 50_000))).spawn();
    let short = m.bare(&args(&w.saturating("eager", 1000))).spawn();
    let (long, short) = (card_share(&finish(long)), card_share(&finish(short)));
    assert!(
        (0.35..=0.65).contains(&long) && (0.35..=0.65).contains(&short),
        "50 ms kernels got {long:.3}, 1 ms kernels {short:.3}"
    );
}

/// NVML's per-process SM utilisation under time-slicing means "had work in the sample window":
/// two processes saturating one card both read near 100 (the H200 read 75 and 73 for a pair that
/// got 42 % and 61 % of the card), while the card itself reads busy; a process that runs nothing
/// has no sample, and with nothing running at all the query answers NVML_ERROR_NOT_FOUND.
#[test]
fn nvml_says_each_saturating_process_had_work_all_along() {
    let _serial = one_at_a_time();
    let m = Sandbox::new("1x1g");
    let idle = m
        .bare(&["nvml-util", "--seconds", "0.6", "--interval-ms", "200"])
        .run_ok();
    let u = idle.one("nvml_util");
    assert_eq!(
        u["answers"],
        serde_json::json!({"NVML_ERROR_NOT_FOUND": 3}),
        "{u}"
    );
    let mut holder = m
        .bare(&["hold", "--path", "cuMemAlloc", "--size", "1m"])
        .start_until("hold");
    let w = Window::after(Duration::from_millis(300), Duration::from_millis(1800));
    let a = m.bare(&args(&w.saturating("eager", 2000))).spawn();
    let b = m.bare(&args(&w.saturating("graph", 2000))).spawn();
    std::thread::sleep(Duration::from_millis(500));
    let out = run(
        &m,
        &["nvml-util", "--seconds", "1.2", "--interval-ms", "200"],
    );
    let pids: Vec<String> = [&a, &b].iter().map(|c| c.id().to_string()).collect();
    let shares = (card_share(&finish(a)), card_share(&finish(b)));
    holder.kill9();
    let u = out.one("nvml_util");
    for pid in &pids {
        let util = u["per_pid"][pid]["mean_sm_util"]
            .as_f64()
            .unwrap_or_else(|| panic!("no samples of {pid}: {u}"));
        assert!(
            util >= 85.0,
            "pid {pid} read {util} (shares {shares:?}): {u}"
        );
    }
    assert!(u["device_util_mean"].as_f64().unwrap() > 85.0, "{u}");
    let holder_pid = holder.line["pid"].to_string();
    assert!(u["per_pid"].get(&holder_pid).is_none(), "{u}");
}

#[test]
fn alone_a_process_keeps_the_card() {
    let _serial = one_at_a_time();
    let m = Sandbox::new("1x1g");
    let w = Window::after(Duration::from_millis(500), Duration::from_millis(1000));
    let out = m.bare(&args(&w.saturating("eager", 2000))).run_ok();
    let share = card_share(&out);
    assert!(share >= 0.9, "{share}");
}

fn args(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[test]
fn a_process_killed_mid_kernel_does_not_keep_the_card() {
    let m = Sandbox::new("1x1g");
    let mut a = m
        .bare(&[
            "launch",
            "--seconds",
            "30",
            "--kernel-us",
            "50000",
            "--report-ms",
            "100",
        ])
        .start_until("progress");
    a.kill9();
    let out = run(&m, &["launch", "--seconds", "0.5", "--kernel-us", "5000"]);
    let l = out.one("launch");
    assert!(l["busy_fraction"].as_f64().unwrap() > 0.7, "{l}");
}

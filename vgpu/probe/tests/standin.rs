//! The stand-ins themselves, without the enforcement library: they must refuse what the real
//! driver refuses (or the library's tests would pass against a driver more lenient than any GPU),
//! share one card between processes, time-slice it, and free a killed process's memory.

mod common;

use common::*;
use serde_json::Value;

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

#[test]
fn calls_before_cuinit_are_refused() {
    let m = Machine::new("1x1g");
    let out = m.run(&["alloc", "--path", "cuMemAlloc", "--size", "1m", "--no-init"]);
    assert_eq!(result(one(&out, "alloc")), NOT_INITIALIZED);
}

#[test]
fn calls_without_a_context_are_refused() {
    let m = Machine::new("1x1g");
    let out = m.run(&[
        "alloc",
        "--path",
        "cuMemAlloc",
        "--size",
        "1m",
        "--context",
        "none",
        "--views",
    ]);
    assert_eq!(result(one(&out, "alloc")), INVALID_CONTEXT);
    assert_eq!(
        result(&one(&out, "views")["cu_mem_get_info"]),
        INVALID_CONTEXT
    );
    // cuDeviceTotalMem needs no context.
    assert_eq!(one(&out, "views")["cu_device_total_mem"]["bytes"], GIB);
}

#[test]
fn zero_sizes_bad_pointers_and_bad_shapes_are_refused() {
    let m = Machine::new("1x1g");
    for (path, extra) in [
        ("cuMemAlloc", vec![]),
        ("cuMemAllocManaged", vec![]),
        ("cuMemAllocAsync", vec![]),
        ("cuMemAllocPitch", vec!["--width", "0", "--height", "4"]),
    ] {
        let mut args = vec!["alloc", "--path", path, "--size", "0"];
        args.extend(extra);
        assert_eq!(
            result(one(&m.run(&args), "alloc")),
            INVALID_VALUE,
            "{path} of 0 bytes"
        );
    }
    let out = m.run(&["free", "--ptr", "0xdead000"]);
    assert_eq!(result(one(&out, "free")), INVALID_VALUE);
    // Pitched memory takes elements of 4, 8 or 16 bytes; cuMemCreate whole granules (2 MiB).
    let out = m.run(&[
        "alloc",
        "--path",
        "cuMemAllocPitch",
        "--width",
        "100",
        "--height",
        "2",
        "--element",
        "3",
    ]);
    assert_eq!(result(one(&out, "alloc")), INVALID_VALUE);
    let out = m.run(&["alloc", "--path", "cuMemCreate", "--size", "3m"]);
    assert_eq!(result(one(&out, "alloc")), INVALID_VALUE);
}

#[test]
fn memory_runs_out_at_the_cards_capacity_to_the_byte() {
    let m = Machine::new("1x1g");
    let room = (GIB - CONTEXT).to_string();
    let over = (GIB - CONTEXT + 1).to_string();
    assert_eq!(
        result(one(
            &m.run(&["alloc", "--path", "cuMemAlloc", "--size", &room]),
            "alloc"
        )),
        SUCCESS
    );
    assert_eq!(
        result(one(
            &m.run(&["alloc", "--path", "cuMemAlloc", "--size", &over]),
            "alloc"
        )),
        OUT_OF_MEMORY
    );
    let fill = m.run(&["fill", "--path", "cuMemAlloc", "--chunk", "1m"]);
    let f = one(&fill, "fill");
    assert_eq!(result(f), OUT_OF_MEMORY);
    assert_eq!(f["allocated"], GIB - CONTEXT);
    // Pitched memory is charged pitch x height: 100-byte rows take 512.
    let out = m.run(&[
        "alloc",
        "--path",
        "cuMemAllocPitch",
        "--width",
        "100",
        "--height",
        "3",
    ]);
    let a = one(&out, "alloc");
    assert_eq!(
        (a["pitch"].as_u64(), a["bytes"].as_u64()),
        (Some(512), Some(1536))
    );
    // A context needs its memory too: a card without room for another one refuses the context.
    let small = Machine::new("1x1g").with_env("GPUPOOL_STANDIN_CONTEXT_MEMORY", "600m");
    let mut holder = small.spawn(&["hold", "--path", "cuMemAlloc", "--size", "1m"]);
    assert_eq!(result(&wait_for(&mut holder, "hold")), SUCCESS);
    let out = small.run(&["views"]);
    kill9(&mut holder);
    assert!(
        out.iter()
            .any(|l| l["op"] == "context" && result(l) == OUT_OF_MEMORY),
        "{out:?}"
    );
}

#[test]
fn the_views_agree_on_what_is_used() {
    let m = Machine::new("1x2g").with_env("GPUPOOL_STANDIN_RESERVED_MEMORY", "100m");
    let out = m.run(&["alloc", "--path", "cuMemAlloc", "--size", "64m", "--views"]);
    let v = &ops(&out, "views")[0];
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
    let out = m.run(&["views", "--nvml-v2-version", "0x01000028"]);
    assert_eq!(
        one(&out, "views")["nvml"]["v2"]["error"],
        "NVML_ERROR_ARGUMENT_VERSION_MISMATCH"
    );
}

#[test]
fn two_processes_share_a_card_and_a_killed_ones_memory_is_freed() {
    let m = Machine::new("1x2g");
    let mut holder = m.spawn(&["hold", "--path", "cuMemAlloc", "--size", "600m"]);
    let held = wait_for(&mut holder, "hold");
    assert_eq!(result(&held), SUCCESS);
    let holder_pid = held["pid"].clone();
    let views = m.run(&["views"]);
    let v = one(&views, "views");
    assert_eq!(
        v["cu_mem_get_info"]["free"],
        2 * GIB - 2 * CONTEXT - 600 * MIB
    );
    assert!(v["nvml"]["processes"]
        .as_array()
        .unwrap()
        .iter()
        .any(|p| p["pid"] == holder_pid));
    let fill = m.run(&["fill", "--path", "cuMemAlloc", "--chunk", "1m"]);
    assert_eq!(
        one(&fill, "fill")["allocated"],
        2 * GIB - 2 * CONTEXT - 600 * MIB
    );

    kill9(&mut holder);
    // The next look at the card finds the dead process's memory released.
    let v = m.run(&["views"]);
    let v = one(&v, "views");
    assert_eq!(v["cu_mem_get_info"]["free"], 2 * GIB - CONTEXT);
    assert!(!v["nvml"]["processes"]
        .as_array()
        .unwrap()
        .iter()
        .any(|p| p["pid"] == holder_pid));
}

#[test]
fn get_proc_address_refuses_unknown_symbols_and_old_versions() {
    let m = Machine::new("1x1g");
    let out = m.run(&["getproc", "--symbol", "cuNoSuchFunction"]);
    let g = one(&out, "getproc");
    assert_eq!(
        (result(g), g["status"].as_i64(), g["address"].as_str()),
        (NOT_FOUND, Some(1), Some("0x0"))
    );
    let out = m.run(&[
        "getproc",
        "--symbol",
        "cuMemAllocAsync",
        "--cuda-version",
        "11010",
    ]);
    let g = one(&out, "getproc");
    assert_eq!((result(g), g["status"].as_i64()), (NOT_FOUND, Some(2)));
    let out = m.run(&[
        "getproc",
        "--symbol",
        "cuMemAllocAsync",
        "--cuda-version",
        "11020",
    ]);
    assert_eq!(
        one(&out, "getproc")["matches"],
        serde_json::json!(["cuMemAllocAsync"])
    );
    let out = m.run(&["getproc", "--symbol", "cuInit", "--flags", "4"]);
    assert_eq!(result(one(&out, "getproc")), INVALID_VALUE);
}

fn chosen(m: &Machine, symbol: &str, version: &str, per_thread: bool) -> Value {
    let mut args = vec!["getproc", "--symbol", symbol, "--cuda-version", version];
    if per_thread {
        args.push("--per-thread");
    }
    let out = m.run(&args);
    let g = one(&out, "getproc");
    assert_eq!(result(g), SUCCESS, "{g}");
    g["matches"].clone()
}

#[test]
fn versions_pick_the_abi_and_only_the_flag_picks_ptsz() {
    let m = Machine::new("1x1g");
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
    let m = Machine::new("1x1g");
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
        let out = m.run(&args);
        assert_eq!(result(one(&out, "alloc")), SUCCESS, "{lookup:?}");
        assert_eq!(result(one(&out, "free")), SUCCESS, "{lookup:?}");
        let free = ops(&out, "views")[0]["cu_mem_get_info"]["free"]
            .as_u64()
            .unwrap();
        assert_eq!(free, GIB - CONTEXT - 3 * MIB, "{lookup:?}");
        let found = &one(&out, "resolved")["entry_points"]["cuMemAlloc"]["matches"];
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
    let m = Machine::new("3x1g");
    let all: Vec<Value> = ops(&m.run(&["devices"]), "device")
        .iter()
        .map(|d| d["uuid"].clone())
        .collect();
    assert_eq!(all.len(), 3);
    let seen = |visible: &str| -> Vec<Value> {
        let out = m.run_with(&["devices"], |c| {
            c.env("CUDA_VISIBLE_DEVICES", visible);
        });
        ops(&out, "device")
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
    let out = m.run_with(&["devices"], |c| {
        c.env("CUDA_VISIBLE_DEVICES", "");
    });
    assert_eq!(result(one(&out, "init")), NO_DEVICE);
    // Memory is charged to the card the ordinal names.
    let out = m.run_with(
        &[
            "alloc",
            "--path",
            "cuMemAlloc",
            "--size",
            "5m",
            "--no-free",
            "--views",
        ],
        |c| {
            c.env("CUDA_VISIBLE_DEVICES", "2");
        },
    );
    let nv = &one(&out, "views")["nvml"];
    assert_eq!(one(&out, "views")["uuid"], all[2]);
    assert_eq!(nv["v1"]["used"], CONTEXT + 5 * MIB);
}

#[test]
fn arrays_report_their_size_only_when_deferred() {
    let m = Machine::new("1x1g");
    let out = m.run(&[
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
    ]);
    let a = one(&out, "alloc");
    assert_eq!(result(a), SUCCESS);
    assert_eq!(
        result(&a["requirements"]),
        INVALID_VALUE,
        "cuda.h: only deferred-mapping arrays answer"
    );
    // 1000 x 1000 bytes in 64-byte rows and 8-row tiles, whole 64 KiB pages: 16 pages.
    assert_eq!(
        ops(&out, "views")[0]["cu_mem_get_info"]["free"],
        GIB - CONTEXT - 16 * 65536
    );
    let out = m.run(&[
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
    ]);
    let a = one(&out, "alloc");
    assert_eq!(a["requirements"]["size"], 16 * 65536);
    assert_eq!(
        ops(&out, "views")[0]["cu_mem_get_info"]["free"],
        GIB - CONTEXT
    );
    let out = m.run(&[
        "alloc",
        "--path",
        "cuArrayCreate",
        "--width",
        "100",
        "--height",
        "10",
        "--channels",
        "3",
    ]);
    assert_eq!(result(one(&out, "alloc")), INVALID_VALUE);
}

#[test]
fn pools_grow_in_granules_and_give_back_at_synchronisation() {
    let m = Machine::new("1x1g");
    let out = m.run(&[
        "alloc",
        "--path",
        "cuMemAllocAsync",
        "--size",
        "3m",
        "--views",
    ]);
    assert_eq!(result(one(&out, "alloc")), SUCCESS);
    let v = ops(&out, "views");
    assert_eq!(v[0]["cu_mem_get_info"]["free"], GIB - CONTEXT - 4 * MIB);
    // cuMemFreeAsync and a synchronisation: the pool keeps nothing above its threshold (0).
    assert_eq!(result(one(&out, "free")), SUCCESS);
    assert_eq!(v[1]["cu_mem_get_info"]["free"], GIB - CONTEXT);
    let out = m.run(&[
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
    ]);
    assert_eq!(result(one(&out, "alloc")), SUCCESS);
}

#[test]
fn launches_follow_the_launch_rules() {
    let m = Machine::new("1x1g:10");
    // 10 SMs x 2 resident blocks of 1024 threads: 20 blocks fit a cooperative launch, 21 do not.
    let ok = m.run(&[
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
    ]);
    assert_eq!(result(one(&ok, "launch")), SUCCESS);
    let too = m.run(&[
        "launch",
        "--mode",
        "cooperative",
        "--grid",
        "21",
        "--block",
        "1024",
        "--seconds",
        "0.1",
    ]);
    assert_eq!(result(one(&too, "launch")), COOPERATIVE_LAUNCH_TOO_LARGE);
    let too = m.run(&["launch", "--block", "2048", "--seconds", "0.1"]);
    assert_eq!(result(one(&too, "launch")), INVALID_VALUE);
    // A kernel runs for its parameter: 20 ms kernels over 0.3 s keep the card busy.
    let busy = m.run(&[
        "launch",
        "--kernel-us",
        "20000",
        "--seconds",
        "0.3",
        "--mode",
        "capture",
        "--graph-nodes",
        "2",
    ]);
    let l = one(&busy, "launch");
    assert!(l["busy_fraction"].as_f64().unwrap() > 0.7, "{l}");
}

#[test]
fn two_busy_processes_share_the_card_half_and_half_in_nvml() {
    let m = Machine::new("1x1g");
    let a = m.spawn(&["launch", "--seconds", "2.2", "--kernel-us", "2000"]);
    let b = m.spawn(&[
        "launch",
        "--seconds",
        "2.2",
        "--kernel-us",
        "2000",
        "--mode",
        "graph",
        "--lookup",
        "proc",
        "--per-thread",
    ]);
    std::thread::sleep(std::time::Duration::from_millis(400));
    let out = m.run(&["nvml-util", "--seconds", "1.4", "--interval-ms", "200"]);
    let pids: Vec<String> = [&a, &b].iter().map(|c| c.id().to_string()).collect();
    for child in [a, b] {
        let out = child.wait_with_output().unwrap();
        let runs = parse(&String::from_utf8_lossy(&out.stdout));
        assert_eq!(result(one(&runs, "launch")), SUCCESS);
    }
    let u = one(&out, "nvml_util");
    for pid in &pids {
        let share = u["per_pid"][pid]["mean_sm_util"]
            .as_f64()
            .unwrap_or_else(|| panic!("no samples of {pid}: {u}"));
        assert!(
            (38.0..=62.0).contains(&share),
            "pid {pid} had {share}% of the card: {u}"
        );
    }
    assert!(u["device_util_mean"].as_f64().unwrap() > 85.0, "{u}");
}

#[test]
fn a_process_killed_mid_kernel_does_not_keep_the_card() {
    let m = Machine::new("1x1g");
    let mut a = m.spawn(&[
        "launch",
        "--seconds",
        "30",
        "--kernel-us",
        "50000",
        "--report-ms",
        "100",
    ]);
    wait_for(&mut a, "progress");
    kill9(&mut a);
    let out = m.run(&["launch", "--seconds", "0.5", "--kernel-us", "5000"]);
    let l = one(&out, "launch");
    assert!(l["busy_fraction"].as_f64().unwrap() > 0.7, "{l}");
}

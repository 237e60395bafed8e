//! One limit per container, shared by its processes through the shared file: two processes share
//! it, a killed holder's memory comes back within a second, a file made with other limits is
//! replaced (with a log line), and cards are told apart by UUID whatever order or subset of them a
//! process sees.

mod harness;

use harness::*;
use std::time::Duration;

#[test]
fn two_processes_share_one_limit() {
    let sandbox = Sandbox::new("1x16g:108");
    let cache = sandbox.container();
    let limit = "2g";
    let _holder = sandbox
        .probe(&cache, &["hold", "--path", "cuMemAlloc", "--size", "1g"])
        .env("CUDA_DEVICE_MEMORY_LIMIT", limit)
        .start_until("hold");
    // What the second process sees free: the limit less the holder's gigabyte and both contexts.
    let views = sandbox
        .probe(&cache, &["views"])
        .env("CUDA_DEVICE_MEMORY_LIMIT", limit)
        .run();
    let free = free_of(views.one("views"));
    assert_eq!(free, 2 * GIB - GIB - 2 * CONTEXT, "{}", views.stdout);
    let alloc = |size: u64| {
        let outcome = sandbox
            .probe(
                &cache,
                &[
                    "alloc",
                    "--path",
                    "cuMemAllocAsync",
                    "--size",
                    &size.to_string(),
                ],
            )
            .env("CUDA_DEVICE_MEMORY_LIMIT", limit)
            .run();
        outcome.one("alloc")["result"].as_i64().expect("result")
    };
    assert_eq!(alloc(free), 0, "exactly what is left fits");
    assert_eq!(alloc(free + 1), 2, "one byte more does not");
}

#[test]
fn a_killed_holder_releases_its_memory_within_a_second() {
    let sandbox = Sandbox::new("1x16g:108");
    let cache = sandbox.container();
    let limit = "2g";
    let mut holder = sandbox
        .probe(&cache, &["hold", "--path", "cuMemAlloc", "--size", "1536m"])
        .env("CUDA_DEVICE_MEMORY_LIMIT", limit)
        .start_until("hold");
    let alloc_1g = || {
        let outcome = sandbox
            .probe(&cache, &["alloc", "--path", "cuMemAlloc", "--size", "1g"])
            .env("CUDA_DEVICE_MEMORY_LIMIT", limit)
            .run();
        outcome.one("alloc")["result"].as_i64().expect("result")
    };
    assert_eq!(alloc_1g(), 2, "the holder's memory counts while it lives");
    holder.kill9();
    // Asking for free memory is enough to see it come back (no allocation needed).
    let back = eventually(Duration::from_secs(1), || {
        let views = sandbox
            .probe(&cache, &["views"])
            .env("CUDA_DEVICE_MEMORY_LIMIT", limit)
            .run();
        free_of(views.one("views")) == 2 * GIB - CONTEXT
    });
    assert!(
        back.is_some(),
        "the killed process's 1.5 GiB is still charged after a second"
    );
    assert_eq!(alloc_1g(), 0);
}

#[test]
fn a_file_made_with_other_limits_is_replaced_with_a_log_line() {
    let sandbox = Sandbox::new("1x16g:108");
    let cache = sandbox.container();
    let first = sandbox
        .probe(&cache, &["views"])
        .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
        .run();
    assert_eq!(u(&first.one("views")["cu_mem_get_info"]["total"]), GIB);
    assert!(
        first.library_lines().is_empty(),
        "{:?}",
        first.library_lines()
    );

    let changed = sandbox
        .probe(&cache, &["views"])
        .env("CUDA_DEVICE_MEMORY_LIMIT", "2g")
        .run();
    assert_eq!(
        u(&changed.one("views")["cu_mem_get_info"]["total"]),
        2 * GIB,
        "the new limit applies"
    );
    let lines = changed.library_lines();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].contains(&cache)
            && lines[0].contains("memory[*]=1073741824")
            && lines[0].contains("memory[*]=2147483648"),
        "the line names the file, what it held and what the environment says: {}",
        lines[0]
    );
    // Once replaced, the file matches: no more lines.
    let again = sandbox
        .probe(&cache, &["views"])
        .env("CUDA_DEVICE_MEMORY_LIMIT", "2g")
        .run();
    assert!(
        again.library_lines().is_empty(),
        "{:?}",
        again.library_lines()
    );
}

/// The stand-in's UUIDs of its cards, in its own order.
fn uuids(sandbox: &Sandbox) -> Vec<String> {
    let devices = sandbox.bare(&["devices"]).run();
    devices
        .ops("device")
        .iter()
        .map(|d| d["uuid"].as_str().expect("uuid").to_string())
        .collect()
}

fn total_seen(
    sandbox: &Sandbox,
    cache: &str,
    visible: Option<&str>,
    ordinal: &str,
    env: &[(&str, &str)],
) -> u64 {
    let mut run = sandbox.probe(cache, &["views", "--device", ordinal]);
    if let Some(visible) = visible {
        run = run.env("CUDA_VISIBLE_DEVICES", visible);
    }
    for (k, v) in env {
        run = run.env(k, v);
    }
    let outcome = run.run();
    u(&outcome.one("views")["cu_mem_get_info"]["total"])
}

#[test]
fn a_reordered_or_narrowed_device_list_is_checked_against_the_right_card() {
    let sandbox = Sandbox::new("2x16g:108");
    let cache = sandbox.container();
    let limits = [
        ("CUDA_DEVICE_MEMORY_LIMIT_0", "1g"),
        ("CUDA_DEVICE_MEMORY_LIMIT_1", "2g"),
    ];
    // The container's first process sees the claim's order and records it.
    assert_eq!(total_seen(&sandbox, &cache, None, "1", &limits), 2 * GIB);
    // Later processes see card 1 as their ordinal 0 (Ray and vLLM workers narrow the list).
    assert_eq!(
        total_seen(&sandbox, &cache, Some("1"), "0", &limits),
        2 * GIB
    );
    assert_eq!(
        total_seen(&sandbox, &cache, Some("1,0"), "0", &limits),
        2 * GIB
    );
    assert_eq!(total_seen(&sandbox, &cache, Some("1,0"), "1", &limits), GIB);
    let ids = uuids(&sandbox);
    assert_eq!(
        total_seen(&sandbox, &cache, Some(&ids[1]), "0", &limits),
        2 * GIB
    );

    // And memory held through a narrowed list is charged to that card for everyone.
    let _holder = sandbox
        .probe(&cache, &["hold", "--path", "cuMemAlloc", "--size", "1g"])
        .env("CUDA_VISIBLE_DEVICES", "1")
        .env(limits[0].0, limits[0].1)
        .env(limits[1].0, limits[1].1)
        .start_until("hold");
    let views = sandbox
        .probe(&cache, &["views", "--device", "1"])
        .env(limits[0].0, limits[0].1)
        .env(limits[1].0, limits[1].1)
        .run();
    assert_eq!(
        free_of(views.one("views")),
        2 * GIB - GIB - 2 * CONTEXT,
        "{}",
        views.stdout
    );
}

#[test]
fn the_drivers_device_uuids_win_over_a_narrowed_first_process() {
    let sandbox = Sandbox::new("2x16g:108");
    let ids = uuids(&sandbox);
    let cache = sandbox.container();
    let env = [
        ("CUDA_DEVICE_MEMORY_LIMIT_0", "1g"),
        ("CUDA_DEVICE_MEMORY_LIMIT_1", "2g"),
        ("GPUPOOL_DEVICE_UUID_0", ids[0].as_str()),
        ("GPUPOOL_DEVICE_UUID_1", ids[1].as_str()),
    ];
    // The first process sees only card 1: its ordinal 0 would be taken for claim index 0 without
    // the driver's UUIDs.
    assert_eq!(total_seen(&sandbox, &cache, Some("1"), "0", &env), 2 * GIB);
    assert_eq!(total_seen(&sandbox, &cache, None, "0", &env), GIB);
}

/// The in-use slots of a container's shared file: (PID, bytes allocated on claim index 0).
fn slots(cache: &str) -> Vec<(u32, u64)> {
    use gpupool_vgpu::layout;
    let bytes = std::fs::read(cache).expect("the shared file");
    let u32_at =
        |at: u64| u32::from_ne_bytes(bytes[at as usize..at as usize + 4].try_into().unwrap());
    let u64_at =
        |at: u64| u64::from_ne_bytes(bytes[at as usize..at as usize + 8].try_into().unwrap());
    (0..layout::SLOT_COUNT as usize)
        .filter(|&s| u32_at(layout::slot(s) + layout::S_IN_USE) == 1)
        .map(|s| {
            (
                u32_at(layout::slot(s) + layout::S_PID),
                u64_at(layout::slot_tracked(s, 0)),
            )
        })
        .collect()
}

fn child_lines(lines: &[serde_json::Value]) -> Vec<&serde_json::Value> {
    lines.iter().filter(|l| l["who"] == "child").collect()
}

fn parent_lines<'a>(lines: &'a [serde_json::Value], op: &str) -> Vec<&'a serde_json::Value> {
    lines
        .iter()
        .filter(|l| l["who"].is_null() && l["op"] == op)
        .collect()
}

#[test]
fn a_forked_child_that_exits_leaves_its_parents_charges_alone() {
    let sandbox = Sandbox::new("1x16g:108");
    let cache = sandbox.container();
    // The parent allocates, then forks; the child cannot use the driver its parent initialised
    // (the real driver refuses it too), tries anyway and exits normally, running its atexit
    // handlers, which give back only what is the child's own.
    let outcome = sandbox
        .probe(
            &cache,
            &[
                "fork",
                "--path",
                "cuMemAlloc",
                "--size",
                "256m",
                "--child-size",
                "1m",
            ],
        )
        .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
        .run_ok();
    let child = child_lines(&outcome.lines);
    let init = child
        .iter()
        .find(|l| l["op"] == "init")
        .expect("the child's init");
    assert_eq!(
        init["error"], "CUDA_ERROR_NOT_INITIALIZED",
        "{}",
        outcome.stdout
    );
    assert_eq!(parent_lines(&outcome.lines, "child_exit")[0]["code"], 0);
    let views = parent_lines(&outcome.lines, "views");
    assert_eq!(views.len(), 2, "{}", outcome.stdout);
    let before = free_of(views[0]);
    assert_eq!(before, GIB - CONTEXT - 256 * MIB);
    assert_eq!(
        free_of(views[1]),
        before,
        "the parent's 256 MiB are still charged after its child exited:\n{}",
        outcome.stdout
    );
}

#[test]
fn a_forked_child_gets_its_own_slot_and_its_memory_back_when_killed() {
    let sandbox = Sandbox::new("1x16g:108");
    let cache = sandbox.container();
    let uuid = sandbox.bare(&["devices"]).run_ok().ops("device")[0]["uuid"]
        .as_str()
        .expect("uuid")
        .to_string();
    // A parent that never initialised CUDA (it looked at NVML: the library's state exists) forks
    // a child that does, allocates and holds.
    let mut parent = sandbox
        .probe(
            &cache,
            &[
                "fork",
                "--no-init",
                "--context",
                "none",
                "--child-size",
                "256m",
                "--child-hold",
                // The parent lives on a while after its child's end.
                "--after-ms",
                "1500",
            ],
        )
        .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
        .env("GPUPOOL_DEVICE_UUID_0", &uuid)
        .start_until("hold");
    let child_pid = u(&parent.line["pid"]) as u32;
    let alloc = parent
        .before
        .iter()
        .find(|l| l["who"] == "child" && l["op"] == "alloc")
        .expect("the child's allocation")
        .clone();
    assert_eq!(alloc["result"], 0, "{alloc}");
    // Its own slot, under its own PID, holding its own allocation; the parent has none (it
    // allocated nothing).
    assert_eq!(slots(&cache), vec![(child_pid, 256 * MIB)]);
    // Killed, the child's description closes and its slot's lock with it: the container's next
    // look releases the memory while the parent lives on. (Had the child locked its slot through
    // the description it inherited, the lock would stay with the parent, and the memory charged
    // for the parent's whole life.)
    // SAFETY: signals the child the probe forked, by the PID it printed.
    unsafe { libc::kill(child_pid as i32, libc::SIGKILL) };
    let exit = parent
        .next_line("child_exit")
        .expect("the parent saw its child end");
    assert_eq!(exit["signal"], 9);
    let released = eventually(Duration::from_secs(1), || {
        let views = sandbox
            .probe(&cache, &["nvml-views", "--index", "0"])
            .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
            .env("GPUPOOL_DEVICE_UUID_0", &uuid)
            .run_ok();
        u(&views.one("nvml_views")["v1"]["free"]) == GIB
    });
    assert!(
        released.is_some(),
        "the killed child's 256 MiB stay charged"
    );
    assert_eq!(
        parent.child.try_wait().ok().flatten(),
        None,
        "the parent still runs"
    );
    let lines = parent.finish();
    let after = parent_lines(&lines, "nvml_views");
    assert_eq!(u(&after[1]["v1"]["free"]), GIB, "{:?}", after[1]);
}

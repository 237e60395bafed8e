//! The limiter by turns under the shapes real workloads have, with real processes on the stand-in
//! card (which time-slices like a GPU without MPS): several processes in one container, a
//! container idle while it held the card, a holder stopped with SIGSTOP, a process stopped inside
//! the card's decision lock, stderr a pipe nobody reads, contexts destroyed with work queued.
//! Shares are measured as in `compute.rs` (kernels completed inside a window common to the
//! processes, against what the card gives one program alone); every test has a deadline.

mod harness;

use gpupool_vgpu::arbiter;
use harness::*;
use std::process::Child;
use std::time::{Duration, Instant};

fn args(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// What the card gives one program alone without the library (see `compute.rs`).
fn capacity(sandbox: &Sandbox) -> f64 {
    let w = Window::after(Duration::from_millis(1000), Duration::from_millis(1500));
    card_share(&sandbox.bare(&args(&w.saturating("eager", 2000))).run())
}

/// `launch` arguments for a window, with idle phases.
fn with_phases(w: &Window, phases: &str) -> Vec<String> {
    let mut launch = w.saturating("eager", 2000);
    launch.extend(["--phases".to_string(), phases.to_string()]);
    launch
}

/// Launches of the card's processes that waited their whole bound and went ahead unarbitrated.
fn unarbitrated(sandbox: &Sandbox) -> u64 {
    let bytes = std::fs::read(sandbox.arbiter(0)).unwrap_or_default();
    arbiter::unarbitrated_launches(&bytes)
}

/// Waits for a spawned probe, killing it past `deadline`: a limiter that hangs its program fails
/// here, it does not hang the suite.
fn finish_by(mut child: Child, deadline: Duration) -> Outcome {
    let started = Instant::now();
    loop {
        if child.try_wait().expect("wait").is_some() {
            return finish(child);
        }
        if started.elapsed() > deadline {
            let _ = child.kill();
            let outcome = finish(child);
            panic!(
                "the probe did not end within {deadline:?}:\n{}\n{}",
                outcome.stdout, outcome.stderr
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Shares measured a second time at most: on a loaded two-core machine the stand-in's card loses
/// time to its own threads waiting for a core for seconds at a time, both tenants alike, and the
/// card alone measured just before no longer stands for it (see `compute.rs`); a limiter that
/// does not hold fails both tries.
fn on_one_of_two_tries<T: std::fmt::Debug>(measure: impl Fn() -> T, holds: impl Fn(&T) -> bool) {
    let first = measure();
    if holds(&first) {
        return;
    }
    let second = measure();
    assert!(holds(&second), "{first:?}, then {second:?}");
}

/// Two processes of one container (one share of 30) and a container of 70, all keeping the card
/// busy: the container's processes take its turns one after the other (both progress, the
/// container gets its 30), and no launch waits its bound and goes ahead unarbitrated.
#[test]
fn two_processes_of_one_container_share_its_turns() {
    let _serial = one_at_a_time();
    on_one_of_two_tries(two_processes_and_a_neighbour, |&(a1, a2, b)| {
        (a1 + a2 - 30.0).abs() <= 5.0 && (b - 70.0).abs() <= 5.0
    });
}

fn two_processes_and_a_neighbour() -> (f64, f64, f64) {
    let sandbox = Sandbox::new("1x16g:108");
    let card = capacity(&sandbox);
    let w = Window::after(Duration::from_millis(1500), Duration::from_millis(3000));
    let launch = w.saturating("eager", 2000);
    let container = sandbox.container();
    let first = sandbox.limited_in(&container, "30", &args(&launch)).spawn();
    let second = sandbox.limited_in(&container, "30", &args(&launch)).spawn();
    let other = sandbox.limited("70", &args(&launch)).spawn();
    let deadline = Duration::from_secs(20);
    let (first, second, other) = (
        finish_by(first, deadline),
        finish_by(second, deadline),
        finish_by(other, deadline),
    );
    let (a1, a2, b) = (
        card_share(&first) / card * 100.0,
        card_share(&second) / card * 100.0,
        card_share(&other) / card * 100.0,
    );
    eprintln!("30 in two processes: {a1:.1} + {a2:.1}; 70: {b:.1}");
    assert!(
        a1 >= 7.5 && a2 >= 7.5,
        "a process starved: {a1:.1} / {a2:.1}"
    );
    assert_eq!(unarbitrated(&sandbox), 0, "launches waited their bound");
    (a1, a2, b)
}

/// The same container alone on the card (DEFAULT: the whole card is its to use): its two
/// processes still take turns, neither waits its bound on every launch.
#[test]
fn two_processes_of_a_container_alone_take_turns() {
    let _serial = one_at_a_time();
    let sandbox = Sandbox::new("1x16g:108");
    let card = capacity(&sandbox);
    let w = Window::after(Duration::from_millis(1000), Duration::from_millis(2000));
    let launch = w.saturating("eager", 2000);
    let container = sandbox.container();
    let first = sandbox.limited_in(&container, "30", &args(&launch)).spawn();
    let second = sandbox.limited_in(&container, "30", &args(&launch)).spawn();
    let deadline = Duration::from_secs(20);
    let (first, second) = (finish_by(first, deadline), finish_by(second, deadline));
    let (a1, a2) = (card_share(&first) / card, card_share(&second) / card);
    eprintln!("alone, two processes: {a1:.3} + {a2:.3}");
    assert!(a1 + a2 >= 0.85, "{a1:.3} + {a2:.3}");
    assert!(
        a1 >= 0.3 && a2 >= 0.3,
        "a process starved: {a1:.3} / {a2:.3}"
    );
    assert_eq!(unarbitrated(&sandbox), 0, "launches waited their bound");
}

/// A container of 30 works a second, then idles for seven while it held the card (nobody
/// waited); a container of 70 starts in the middle of that; then both work. Once the first works
/// again, it gets its 30: its idle time was not charged as card time.
#[test]
fn a_container_idle_while_it_held_the_card_gets_its_share_back() {
    let _serial = one_at_a_time();
    on_one_of_two_tries(idle_then_busy, |&(a, b)| {
        (a - 30.0).abs() <= 5.0 && (b - 70.0).abs() <= 5.0
    });
}

fn idle_then_busy() -> (f64, f64) {
    let sandbox = Sandbox::new("1x16g:108");
    let card = capacity(&sandbox);
    // Both start now; the window is the last three seconds of the first one's second busy phase.
    let w = Window::after(Duration::from_millis(8500), Duration::from_millis(3000));
    let idle = sandbox
        .limited("30", &args(&with_phases(&w, "1000,7000")))
        .spawn();
    let late = sandbox
        .limited("70", &args(&with_phases(&w, "0,5000")))
        .spawn();
    let deadline = Duration::from_secs(30);
    let (idle, late) = (finish_by(idle, deadline), finish_by(late, deadline));
    let (a, b) = (
        card_share(&idle) / card * 100.0,
        card_share(&late) / card * 100.0,
    );
    eprintln!("after idling: 30 -> {a:.1}, 70 -> {b:.1}");
    (a, b)
}

/// A process stopped inside the card's decision lock (here the test holds the lock's byte
/// through a description of its own, which is what a stopped process's looks like from outside):
/// a limited program's launches each wait at most their bound, the program ends on time, and it
/// says so once a second at most, not on every launch.
#[test]
fn a_process_stopped_inside_the_decision_lock_costs_bounded_waits() {
    let _serial = one_at_a_time();
    let sandbox = Sandbox::new("1x16g:108");
    // The file exists once a first process has registered.
    sandbox
        .limited("50", &["launch", "--seconds", "0.2", "--kernel-us", "1000"])
        .run_ok();
    let stopped = arbiter::hold_decision_lock(&sandbox.arbiter(0)).expect("the decision lock");
    let started = Instant::now();
    let child = sandbox
        .limited("50", &["launch", "--seconds", "2", "--kernel-us", "1000"])
        .env("GPUPOOL_VGPU_MAX_LAUNCH_WAIT_MS", "100")
        .spawn();
    let outcome = finish_by(child, Duration::from_secs(15));
    let took = started.elapsed();
    drop(stopped);
    let line = outcome.one("launch");
    assert_eq!(line["result"], 0, "{line}\n{}", outcome.stderr);
    let worst = line["launch_call_max_ms"].as_f64().unwrap();
    assert!(worst < 100.0 + 150.0, "a launch waited {worst} ms: {line}");
    assert!(took < Duration::from_secs(6), "{took:?}");
    let said = outcome.library_lines().len();
    assert!(said <= 4, "{said} lines:\n{}", outcome.stderr);
}

/// stderr is a pipe that nobody reads (a supervisor that stopped reading, a full log pipe): the
/// library's lines are dropped, the program is never blocked by them. With FORCE at 1 % and a
/// 1 ms bound almost every launch waits its bound and says so at debug level: the pipe is full
/// within a second.
#[test]
fn a_full_stderr_pipe_never_blocks_the_program() {
    let _serial = one_at_a_time();
    let sandbox = Sandbox::new("1x16g:108");
    let run = sandbox
        .limited(
            "1",
            &[
                "launch",
                "--seconds",
                "2",
                "--kernel-us",
                "100",
                "--inflight",
                "0",
            ],
        )
        .env("GPU_CORE_UTILIZATION_POLICY", "FORCE")
        .env("GPUPOOL_VGPU_MAX_LAUNCH_WAIT_MS", "1")
        .env("LIBCUDA_LOG_LEVEL", "4");
    let mut child = run.spawn();
    // Nobody reads stderr until the program has ended (or its deadline passed).
    let stderr = child.stderr.take();
    let started = Instant::now();
    let ended = loop {
        if child.try_wait().expect("wait").is_some() {
            break true;
        }
        if started.elapsed() > Duration::from_secs(15) {
            let _ = child.kill();
            break false;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    drop(stderr);
    let outcome = finish(child);
    assert!(
        ended,
        "the program blocked on its stderr:\n{}",
        outcome.stdout
    );
    let line = outcome.one("launch");
    assert_eq!(line["result"], 0, "{line}");
    assert!(u(&line["launches"]) > 500, "{line}");
}

/// A holder stopped with SIGSTOP (a debugger, `docker pause`): the other container has the card
/// back within the stale bound, none of its launches waits past its bound, and once the stopped
/// one continues it gets its share again (its stop was not charged as card time).
#[test]
fn a_stopped_holder_is_not_charged_for_its_stop() {
    let _serial = one_at_a_time();
    on_one_of_two_tries(stop_and_continue, |&(a, b)| {
        (a - 50.0).abs() <= 5.0 && (b - 50.0).abs() <= 5.0
    });
}

fn stop_and_continue() -> (f64, f64) {
    let sandbox = Sandbox::new("1x16g:108");
    let card = capacity(&sandbox);
    let stop_at = Duration::from_millis(1500);
    let stopped_for = Duration::from_millis(3000);
    let resumed = Window::after(
        stop_at + stopped_for + Duration::from_millis(700),
        Duration::from_millis(2500),
    );
    let launch = resumed.saturating("eager", 2000);
    let victim = sandbox.limited("50", &args(&launch)).spawn();
    let other = sandbox.limited("50", &args(&launch)).spawn();
    std::thread::sleep(stop_at);
    let pid = victim.id() as libc::pid_t;
    // SAFETY: signals to our own child, which is still running (it runs past the window).
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    std::thread::sleep(stopped_for);
    unsafe { libc::kill(pid, libc::SIGCONT) };
    let deadline = Duration::from_secs(30);
    let (victim, other) = (finish_by(victim, deadline), finish_by(other, deadline));
    let (a, b) = (
        card_share(&victim) / card * 100.0,
        card_share(&other) / card * 100.0,
    );
    eprintln!("after a stop of 3 s: {a:.1} / {b:.1}");
    let worst = other.one("launch")["launch_call_max_ms"].as_f64().unwrap();
    assert!(worst < 250.0 + 150.0, "a launch waited {worst} ms");
    (a, b)
}

/// Frameworks destroy and re-create contexts (`cudaDeviceReset`, a worker's teardown) with work
/// still queued, while another container keeps the card busy: the limiter forgets a context's
/// marks before the driver frees them (the stand-in ends a process that touches an event of a
/// destroyed context, as a use after free would on a real driver).
#[test]
fn contexts_destroyed_with_work_queued_leave_no_mark_behind() {
    let _serial = one_at_a_time();
    let sandbox = Sandbox::new("1x16g:108");
    let mut other = sandbox.busy_neighbour("50", "60");
    for (context, end) in [
        ("create", "destroy"),
        ("primary", "reset"),
        ("primary", "release"),
    ] {
        let child = sandbox
            .limited(
                "50",
                &[
                    "churn",
                    "--context",
                    context,
                    "--end-context",
                    end,
                    "--rounds",
                    "15",
                    "--launches",
                    "24",
                    "--kernel-us",
                    "500",
                ],
            )
            .spawn();
        let outcome = finish_by(child, Duration::from_secs(30));
        assert_eq!(
            outcome.code,
            Some(0),
            "{context}/{end}: the program died:\n{}\n{}",
            outcome.stdout,
            outcome.stderr
        );
        let line = outcome.one("churn");
        assert_eq!(line["result"], 0, "{context}/{end}: {line}");
        assert_eq!(line["rounds"], 15, "{context}/{end}: {line}");
    }
    other.kill9();
}

/// A program forks (a web server's workers, a data loader) while another of its threads makes the
/// first CUDA calls, which open the container's shared files: no child keeps the parent's files
/// open (it would keep the parent's records alive after the parent died). Children forked after
/// the start-up have always been fine; the storm repeats until some forks overlapped it.
#[test]
fn a_child_forked_during_start_up_keeps_none_of_the_parents_files() {
    let sandbox = Sandbox::new("1x16g:108");
    let mut overlapped = 0;
    for _ in 0..10 {
        let outcome = sandbox
            .probe(
                &sandbox.container(),
                &[
                    "fork-storm",
                    "--no-init",
                    "--marker",
                    "vgpu.cache",
                    "--forks",
                    "200",
                ],
            )
            .env("CUDA_DEVICE_SM_LIMIT", "50")
            .env("CUDA_DEVICE_MEMORY_LIMIT", "4g")
            .run_ok();
        let line = outcome.one("fork_storm");
        assert_eq!(
            u(&line["children_with_parent_files"]),
            0,
            "{line}\n{}",
            outcome.stderr
        );
        overlapped += u(&line["during_start_up"]);
        if overlapped >= 5 {
            break;
        }
    }
    assert!(overlapped > 0, "no fork overlapped the start-up");
}

//! `gpupool-sandbox` as a newcomer runs it: one command, well under a minute, a report that shows the
//! seeds' pool, the examples' claims with their fractions and limits, and nothing left behind; and
//! one build: it runs the driver and the controller from its own executable, never cargo.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use gpupool_e2e::harness::{CONTROLLER_BIN, DRIVER_BIN};

#[test]
fn the_sandbox_shows_the_examples_allocated_with_their_limits_and_cleans_up() {
    let started = Instant::now();
    let output = Command::new(env!("CARGO_BIN_EXE_gpupool-sandbox"))
        .env("NO_COLOR", "1")
        .output()
        .expect("running gpupool-sandbox");
    let elapsed = started.elapsed();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "exit {}\n{stdout}\n{stderr}",
        output.status
    );
    assert!(elapsed < Duration::from_secs(60), "took {elapsed:?}");

    assert!(!stdout.contains("FAILED to apply"), "{stdout}");
    for node in ["node-a100", "node-v100", "node-rtx"] {
        assert!(
            stdout.contains(&format!("\n  {node}\n")),
            "slices of {node}:\n{stdout}"
        );
    }
    assert!(stdout.contains("A100-SXM4-40GB   memory 40Gi"), "{stdout}");
    // The seeds' example: 1Gi + 50% of an A100, 70% of a V100, per-replica quarters of an A100.
    let claim_block = |name: &str| -> String {
        let start = stdout
            .find(&format!("  default/{name}"))
            .unwrap_or_else(|| panic!("claim {name} missing:\n{stdout}"));
        let rest = &stdout[start + 2..];
        let end = rest
            .find("\n  default/")
            .or_else(|| rest.find("\n\n"))
            .unwrap_or(rest.len());
        rest[..end].to_string()
    };
    let half = claim_block("half-a100");
    assert!(half.contains("-> node-a100/gpu-"), "{half}");
    assert!(half.contains("memory 1Gi, cores 50%"), "{half}");
    assert!(
        half.contains("CUDA_DEVICE_MEMORY_LIMIT_0=1024m CUDA_DEVICE_SM_LIMIT_0=50"),
        "{half}"
    );
    assert!(half.contains("half-a100 (Running)"), "{half}");
    let v100 = claim_block("v100-70");
    assert!(
        v100.contains("-> node-v100/gpu-") && v100.contains("cores 70%"),
        "{v100}"
    );
    let inference = claim_block("inference-0-gpu-");
    assert!(inference.contains("memory 8Gi, cores 25%"), "{inference}");
    assert!(
        claim_block("whole-rtx-3090").contains("-> node-rtx/gpu-0"),
        "{stdout}"
    );
    assert!(
        claim_block("whole-rtx-3090").contains("whole card"),
        "{stdout}"
    );

    // The CDI spec paths it printed were in its temporary folder, which is gone now.
    let cdi: Vec<PathBuf> = stdout
        .lines()
        .filter_map(|l| l.trim().strip_prefix("CDI spec: "))
        .map(PathBuf::from)
        .collect();
    assert!(!cdi.is_empty(), "{stdout}");
    for path in cdi {
        assert!(
            path.to_string_lossy().contains("gpupool.dev-claim_"),
            "{}",
            path.display()
        );
        assert!(!path.exists(), "{} left behind", path.display());
    }
}

/// The sandbox's executable alone in a folder of its own, as a hard link (a copy across file
/// systems): no `gpupool-driver` or `gpupool-controller` beside it to find.
fn lone_sandbox(dir: &Path) -> PathBuf {
    let built = PathBuf::from(env!("CARGO_BIN_EXE_gpupool-sandbox"));
    let lone = dir.join("gpupool-sandbox");
    if std::fs::hard_link(&built, &lone).is_err() {
        std::fs::copy(&built, &lone).expect("copying gpupool-sandbox");
    }
    lone
}

/// A `cargo` that only leaves `called` behind, first on PATH and in `$CARGO` (which `cargo run`
/// sets and the sandbox used to build the binaries with).
fn cargo_trap(dir: &Path, called: &Path) -> PathBuf {
    let bin = dir.join("trap");
    std::fs::create_dir(&bin).expect("creating the trap folder");
    let cargo = bin.join("cargo");
    std::fs::write(
        &cargo,
        format!("#!/bin/sh\necho \"$@\" >> '{}'\nexit 1\n", called.display()),
    )
    .expect("writing the cargo trap");
    std::fs::set_permissions(&cargo, std::fs::Permissions::from_mode(0o755))
        .expect("making the cargo trap executable");
    cargo
}

/// The running children of `parent`: (pid, name as `ps -e` shows it, executable, arguments).
fn children(parent: u32) -> Vec<(u32, String, PathBuf, Vec<String>)> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("reading /proc").flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let proc = entry.path();
        // "pid (name) state ppid ...": the name may hold spaces and parentheses.
        let Ok(stat) = std::fs::read_to_string(proc.join("stat")) else {
            continue;
        };
        let Some(after_name) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
            continue;
        };
        let ppid = after_name.split_whitespace().nth(1);
        if ppid != Some(&parent.to_string()) {
            continue;
        }
        let name = std::fs::read_to_string(proc.join("comm")).unwrap_or_default();
        let exe = std::fs::read_link(proc.join("exe")).unwrap_or_default();
        let args = std::fs::read(proc.join("cmdline"))
            .unwrap_or_default()
            .split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        found.push((pid, name.trim_end().to_string(), exe, args));
    }
    found
}

/// Kills the sandbox if the test fails while it serves (its children go with it: PDEATHSIG).
struct Serving(Child);

impl Drop for Serving {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn the_sandbox_needs_only_its_own_executable_and_never_runs_cargo() {
    let dir = tempfile::Builder::new()
        .prefix("lone-sandbox-")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .expect("creating a folder");
    let sandbox = lone_sandbox(dir.path());
    let called = dir.path().join("cargo-was-called");
    let cargo = cargo_trap(dir.path(), &called);
    let path = std::env::join_paths(
        std::iter::once(cargo.parent().unwrap().to_path_buf()).chain(std::env::split_paths(
            &std::env::var_os("PATH").unwrap_or_default(),
        )),
    )
    .unwrap();
    let mut child = Command::new(&sandbox)
        .arg("--serve")
        .env("NO_COLOR", "1")
        .env("CARGO", &cargo)
        .env("PATH", path)
        .env_remove("GPUPOOL_DRIVER_BIN")
        .env_remove("GPUPOOL_CONTROLLER_BIN")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting gpupool-sandbox --serve");
    let (stdout, stderr) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let serving = Serving(child);
    let (lines_tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if lines_tx.send(line).is_err() {
                return;
            }
        }
    });
    let stderr = std::thread::spawn(move || std::io::read_to_string(stderr).unwrap_or_default());

    // Up to the line that says it serves, which comes after the report.
    let mut report = String::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !report.contains("Ctrl-C stops it") {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) => report.push_str(&format!("{line}\n")),
            Err(_) => {
                drop(serving);
                panic!(
                    "no `Ctrl-C stops it` line (it exited, or 60 s passed):\n{report}\n{}",
                    stderr.join().unwrap_or_default()
                );
            }
        }
    }
    // Every example pod runs (a claim no pod uses stays pending: the scheduler allocates claims).
    let pods: Vec<&str> = report
        .lines()
        .filter_map(|l| l.trim().strip_prefix("pods: "))
        .flat_map(|l| l.split(", "))
        .collect();
    assert!(!pods.is_empty(), "{report}");
    assert!(pods.iter().all(|p| p.ends_with(" (Running)")), "{report}");
    assert!(!report.contains("Pods not running"), "{report}");

    // What `ps` shows: the controller and one driver per node, each a process of its own, started
    // from this very executable with the program's name first, and named like the program.
    let pid = serving.0.id();
    let mut kids = children(pid);
    kids.sort_by(|a, b| a.3.cmp(&b.3));
    let nodes = gpupool_e2e::sandbox::pool().len();
    let count = |role: &str| {
        kids.iter()
            .filter(|k| k.3.get(1).map(String::as_str) == Some(role))
            .count()
    };
    assert_eq!(count(DRIVER_BIN), nodes, "{kids:#?}");
    assert_eq!(count(CONTROLLER_BIN), 1, "{kids:#?}");
    assert_eq!(kids.len(), nodes + 1, "{kids:#?}");
    let canonical = sandbox.canonicalize().unwrap();
    for (_, name, exe, args) in &kids {
        assert_eq!(exe, &canonical, "{args:?}");
        assert_eq!(args.get(2).map(String::as_str), Some("run"), "{args:?}");
        // The kernel cuts a process's name to 15 bytes, the binary's name as well as ours.
        assert_eq!(name.as_str(), &args[1][..args[1].len().min(15)], "{args:?}");
    }

    // SIGTERM: it stops, and so do the processes it started.
    // SAFETY: kill(2) on our own child, which has not been waited for, so the pid is still its.
    unsafe {
        libc::kill(pid as libc::pid_t, libc::SIGTERM);
    }
    let mut serving = serving;
    let status = serving.0.wait().expect("waiting for the sandbox");
    let stderr = stderr.join().unwrap_or_default();
    assert!(status.success(), "exit {status}\n{stderr}");
    for (pid, _, _, args) in &kids {
        let gone = Instant::now() + Duration::from_secs(5);
        while Path::new(&format!("/proc/{pid}")).exists() && Instant::now() < gone {
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "{args:?} still runs"
        );
    }
    assert!(
        !called.exists(),
        "the sandbox ran cargo: {}\n{stderr}",
        std::fs::read_to_string(&called).unwrap_or_default()
    );
}

/// `gpupool-sandbox <program> ...` is that program's command line: its version, its usage, its
/// exit codes; anything else is the sandbox's own.
#[test]
fn the_sandbox_answers_as_the_driver_and_the_controller_do() {
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_gpupool-sandbox"))
            .args(args)
            .env("NO_COLOR", "1")
            .output()
            .expect("running gpupool-sandbox");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let version = env!("CARGO_PKG_VERSION");
    for program in [DRIVER_BIN, CONTROLLER_BIN] {
        let (code, stdout, stderr) = run(&[program, "--version"]);
        assert_eq!(code, Some(0), "{stderr}");
        assert_eq!(stdout, format!("{program} {version}\n"));
        // A wrong flag: clap's exit code 2 and usage, naming the program, not the sandbox.
        let (code, _, stderr) = run(&[program, "run", "--no-such-flag"]);
        assert_eq!(code, Some(2), "{stderr}");
        assert!(
            stderr.contains(&format!("Usage: {program} run")),
            "{stderr}"
        );
    }
    let (code, stdout, stderr) = run(&[
        DRIVER_BIN,
        "inspect",
        "--fake-gpus",
        "a100-40gb:1",
        "--node-name",
        "node-x",
    ]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        stdout.contains("A100-SXM4-40GB") && stdout.contains("node-x"),
        "{stdout}"
    );
    // The controller's errors end it as its binary's `main` returning an error does.
    let (code, _, stderr) = run(&[CONTROLLER_BIN, "crds", "--dir", "/nonexistent/folder"]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.starts_with("Error: writing /nonexistent/folder/"),
        "{stderr}"
    );

    let (code, _, stderr) = run(&["--no-such-flag"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("Usage: gpupool-sandbox"), "{stderr}");
}

//! What the probe's tests share (the stand-ins' own tests and the library's): a sandbox with the
//! stand-in driver and NVML behind real `dlopen`, the probe run as a real process (bare, or with the
//! library preloaded), its JSON lines read back. Each test file includes this with `mod harness;`
//! (not every file uses every helper).

#![allow(dead_code)]

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;
/// The stand-in's context memory per process and card (its default, set explicitly here).
pub const CONTEXT: u64 = 300 * MIB;

/// The probe binary cargo built for this test.
pub fn probe_path() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_cuda-probe"))
}

/// A shared library cargo built next to the probe (`target/<profile>/`, or `deps/` with or
/// without a hash). The newest copy wins: `cargo test -p gpupool-vgpu-probe` rebuilds the one in
/// `deps/` but leaves a copy an earlier `cargo build -p <package>` put in `target/<profile>/` as it
/// was, and testing that stale copy would test old code.
pub fn built_library(stem: &str, package: &str) -> PathBuf {
    let probe = probe_path();
    let dir = probe.parent().expect("the probe is in a folder");
    let plain = format!("lib{stem}.so");
    let hashed = format!("lib{stem}-");
    let mut candidates = vec![dir.join(&plain), dir.join("deps").join(&plain)];
    if let Ok(entries) = std::fs::read_dir(dir.join("deps")) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(&hashed) && name.ends_with(".so") {
                candidates.push(entry.path());
            }
        }
    }
    let modified = |path: &PathBuf| std::fs::metadata(path).and_then(|m| m.modified()).ok();
    candidates
        .into_iter()
        .filter_map(|path| Some((modified(&path)?, path)))
        .max_by_key(|(time, _)| *time)
        .map(|(_, path)| path)
        .unwrap_or_else(|| {
            panic!(
                "lib{stem}.so is not next to {} (nor in deps/): run `cargo build -p {package}` first",
                probe.display()
            )
        })
}

/// The library under test: the one cargo built, or another build named by
/// `GPUPOOL_VGPU_LIBRARY` (a release build, or an older commit's to see a test fail on it).
pub fn vgpu_library() -> PathBuf {
    match std::env::var_os("GPUPOOL_VGPU_LIBRARY") {
        Some(path) => PathBuf::from(path),
        None => built_library("gpupool_vgpu", "gpupool-vgpu"),
    }
}

/// A folder holding `libcuda.so.1` (and `libnvidia-ml.so.1` unless without NVML) as symlinks to
/// the stand-ins, the stand-in's state file, and shared files for "containers".
pub struct Sandbox {
    pub dir: tempfile::TempDir,
    pub devices: String,
    extra: Vec<(String, String)>,
}

impl Sandbox {
    /// `devices`: the stand-in's `GPUPOOL_STANDIN_DEVICES`, e.g. `2x16g:108`.
    pub fn new(devices: &str) -> Sandbox {
        Sandbox::make(devices, true)
    }

    pub fn without_nvml(devices: &str) -> Sandbox {
        Sandbox::make(devices, false)
    }

    fn make(devices: &str, nvml: bool) -> Sandbox {
        let dir = tempfile::tempdir().expect("temp dir");
        let lib = dir.path().join("lib");
        std::fs::create_dir(&lib).expect("lib dir");
        let cuda = built_library("gpupool_standin_cuda", "gpupool-standin-cuda");
        std::os::unix::fs::symlink(cuda, lib.join("libcuda.so.1")).expect("symlink");
        if nvml {
            let nvml = built_library("gpupool_standin_nvml", "gpupool-standin-nvml");
            std::os::unix::fs::symlink(nvml, lib.join("libnvidia-ml.so.1")).expect("symlink");
        }
        Sandbox {
            dir,
            devices: devices.to_string(),
            extra: Vec::new(),
        }
    }

    /// An environment variable every process of the sandbox gets (stand-in settings).
    pub fn with(mut self, name: &str, value: &str) -> Sandbox {
        self.extra.push((name.into(), value.into()));
        self
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// A new shared-file path: one per "container".
    pub fn container(&self) -> String {
        static N: AtomicU32 = AtomicU32::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        self.path(&format!("containers/{n}/vgpu.cache"))
            .to_string_lossy()
            .into_owned()
    }

    /// The probe with the stand-ins and nothing else in its environment (no preload).
    pub fn bare(&self, args: &[&str]) -> Run {
        let mut command = Command::new(probe_path());
        command.args(args);
        self.prepare(&mut command);
        Run { command }
    }

    /// The probe with the library preloaded, in the container whose shared file is `cache`.
    pub fn probe(&self, cache: &str, args: &[&str]) -> Run {
        let mut run = self.bare(args);
        run.command
            .env("LD_PRELOAD", vgpu_library())
            .env("CUDA_DEVICE_MEMORY_SHARED_CACHE", cache);
        run
    }

    /// The card's arbiter file, one per card shared by every container on it
    /// (`GPUPOOL_VGPU_ARBITER_<i>`): the driver creates it, the library when it is missing. Its
    /// folder exists, as the driver's mount would.
    pub fn arbiter(&self, card: usize) -> String {
        let dir = self.path("arbiter");
        std::fs::create_dir_all(&dir).expect("arbiter folder");
        dir.join(format!("card{card}"))
            .to_string_lossy()
            .into_owned()
    }

    /// The probe in a container of its own with an SM limit of `percent` on card 0, with the
    /// variables the driver gives every process of a limited container: the limit, the
    /// container's own shared file (its identity for the limiter) and the card's arbiter.
    pub fn limited(&self, percent: &str, args: &[&str]) -> Run {
        self.limited_in(&self.container(), percent, args)
    }

    /// A container of `percent` that keeps card 0 busy (2 ms kernels, no bound on launches in
    /// flight) for `seconds`, started and reporting progress: a neighbour for a test's program.
    pub fn busy_neighbour(&self, percent: &str, seconds: &str) -> Started {
        self.limited(
            percent,
            &[
                "launch",
                "--inflight",
                "0",
                "--kernel-us",
                "2000",
                "--seconds",
                seconds,
                "--report-ms",
                "100",
            ],
        )
        .start_until("progress")
    }

    /// The probe as one more process of `container` (its shared file) with an SM limit of
    /// `percent` on card 0, like [`Sandbox::limited`].
    pub fn limited_in(&self, container: &str, percent: &str, args: &[&str]) -> Run {
        self.probe(container, args)
            .env("CUDA_DEVICE_SM_LIMIT", percent)
            .env("GPUPOOL_VGPU_ARBITER_0", &self.arbiter(0))
    }

    /// Any program, with the library preloaded and the stand-ins in reach.
    pub fn program(&self, program: &str, args: &[&str]) -> Run {
        let mut run = self.unpreloaded(program, args);
        run.command.env("LD_PRELOAD", vgpu_library());
        run
    }

    /// Any program with the stand-ins in reach, the library not preloaded (a program that
    /// preloads it into the processes it starts itself).
    pub fn unpreloaded(&self, program: &str, args: &[&str]) -> Run {
        let mut command = Command::new(program);
        command.args(args);
        self.prepare(&mut command);
        Run { command }
    }

    fn prepare(&self, command: &mut Command) {
        command
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("LD_LIBRARY_PATH", self.path("lib"))
            .env("GPUPOOL_STANDIN_STATE", self.path("standin.state"))
            .env("GPUPOOL_STANDIN_DEVICES", &self.devices)
            .env("GPUPOOL_STANDIN_CONTEXT_MEMORY", format!("{}", CONTEXT));
        for (k, v) in &self.extra {
            command.env(k, v);
        }
    }
}

pub struct Run {
    pub command: Command,
}

impl Run {
    pub fn env(mut self, name: &str, value: &str) -> Run {
        self.command.env(name, value);
        self
    }

    pub fn run(mut self) -> Outcome {
        let output = self.command.output().expect("the probe runs");
        Outcome::from(output)
    }

    /// Runs it to its end and checks it ran (exit status 0: CUDA errors are results, not failures
    /// of the probe).
    pub fn run_ok(self) -> Outcome {
        let outcome = self.run();
        assert_eq!(
            outcome.code,
            Some(0),
            "the probe failed:\n{}\n{}",
            outcome.stdout,
            outcome.stderr
        );
        outcome
    }

    /// Starts it in the background, stdout and stderr piped: `Outcome::from(child.wait_with_output())`
    /// reads it once it ends.
    pub fn spawn(mut self) -> Child {
        self.command
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the probe starts")
    }

    /// Starts it in the background and waits for a line with `op` (e.g. "hold"). Its stderr is
    /// dropped: nobody reads it while it runs, and a full pipe would block it.
    pub fn start_until(mut self, op: &str) -> Started {
        let mut child = self
            .command
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("the probe starts");
        let stdout = child.stdout.take().expect("piped");
        let mut started = Started {
            child,
            line: Value::Null,
            reader: std::io::BufReader::new(stdout),
            before: Vec::new(),
        };
        match started.next_line(op) {
            Some(line) => {
                started.line = line;
                started
            }
            None => panic!(
                "the probe ended before printing {op:?}: {:?}",
                started.before
            ),
        }
    }
}

/// A probe running in the background; killed (SIGKILL) when dropped.
pub struct Started {
    pub child: Child,
    /// The line `start_until` waited for.
    pub line: Value,
    reader: std::io::BufReader<std::process::ChildStdout>,
    /// Every line read so far.
    pub before: Vec<Value>,
}

impl Started {
    /// Reads on until a line with `op`; None if the probe ends first.
    pub fn next_line(&mut self, op: &str) -> Option<Value> {
        use std::io::BufRead;
        loop {
            let mut line = String::new();
            if self.reader.read_line(&mut line).unwrap_or(0) == 0 {
                return None;
            }
            let value: Value = serde_json::from_str(line.trim()).unwrap_or(Value::Null);
            self.before.push(value.clone());
            if value["op"] == op {
                return Some(value);
            }
        }
    }

    /// Waits for the probe to end; every line it printed, those read before included.
    pub fn finish(mut self) -> Vec<Value> {
        use std::io::Read;
        let mut rest = String::new();
        let _ = self.reader.read_to_string(&mut rest);
        let _ = self.child.wait();
        let mut lines = std::mem::take(&mut self.before);
        lines.extend(rest.lines().filter_map(|l| serde_json::from_str(l).ok()));
        lines
    }

    pub fn kill9(&mut self) {
        // Child::kill sends SIGKILL, and nothing once the child was reaped (its PID may belong to
        // another process by then).
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Started {
    fn drop(&mut self) {
        self.kill9();
    }
}

#[derive(Debug)]
pub struct Outcome {
    pub code: Option<i32>,
    pub lines: Vec<Value>,
    pub stdout: String,
    pub stderr: String,
}

impl From<Output> for Outcome {
    fn from(output: Output) -> Outcome {
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        let lines = stdout
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        Outcome {
            code: output.status.code(),
            lines,
            stdout,
            stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        }
    }
}

impl Outcome {
    pub fn ops(&self, op: &str) -> Vec<&Value> {
        self.lines.iter().filter(|l| l["op"] == op).collect()
    }

    /// The only line with `op`; panics with the whole output otherwise.
    pub fn one(&self, op: &str) -> &Value {
        let found = self.ops(op);
        assert_eq!(
            found.len(),
            1,
            "expected one {op:?} line:\n{}\n{}",
            self.stdout,
            self.stderr
        );
        found[0]
    }

    /// Lines the library wrote to stderr.
    pub fn library_lines(&self) -> Vec<&str> {
        self.stderr
            .lines()
            .filter(|l| l.starts_with("gpupool-vgpu:"))
            .collect()
    }
}

/// `value` as u64 (panics with context otherwise).
pub fn u(value: &Value) -> u64 {
    value
        .as_u64()
        .unwrap_or_else(|| panic!("not a number: {value}"))
}

/// `cuMemGetInfo`'s free bytes from a views line.
pub fn free_of(views: &Value) -> u64 {
    u(&views["cu_mem_get_info"]["free"])
}

/// Polls `check` until it is true or `within` passed; returns how long it took.
pub fn eventually(within: Duration, mut check: impl FnMut() -> bool) -> Option<Duration> {
    let start = Instant::now();
    loop {
        if check() {
            return Some(start.elapsed());
        }
        if start.elapsed() > within {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn exists(path: &str) -> bool {
    Path::new(path).exists()
}

/// Milliseconds since the Unix epoch, `after` from now: the start of a measurement window that
/// several processes share (`launch --window-start-unix-ms`).
pub fn unix_ms_in(after: Duration) -> u64 {
    (std::time::SystemTime::now() + after)
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_millis() as u64
}

/// A common measurement window: it starts `warmup` from now and lasts `length`.
#[derive(Clone, Copy, Debug)]
pub struct Window {
    pub start_unix_ms: u64,
    pub length: Duration,
    /// How long a process must run to cover it from now (with a margin).
    pub run: Duration,
}

impl Window {
    pub fn after(warmup: Duration, length: Duration) -> Window {
        Window {
            start_unix_ms: unix_ms_in(warmup),
            length,
            run: warmup + length + Duration::from_millis(300),
        }
    }

    /// `launch` arguments that keep the card busy as PyTorch eager does (no bound on the launches
    /// in flight: the driver's queue paces the program) with kernels of `kernel_us`, over the
    /// window, without draining the queue at the end.
    pub fn saturating(&self, mode: &str, kernel_us: u64) -> Vec<String> {
        [
            "launch",
            "--mode",
            mode,
            "--inflight",
            "0",
            "--kernel-us",
            &kernel_us.to_string(),
            "--seconds",
            &format!("{:.3}", self.run.as_secs_f64()),
            "--window-start-unix-ms",
            &self.start_unix_ms.to_string(),
            "--window-ms",
            &self.length.as_millis().to_string(),
            "--no-drain",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    }
}

/// The share of the card a `launch` with a window got (its `window_busy_fraction`), checking that
/// it ran without error and over the whole window.
pub fn card_share(outcome: &Outcome) -> f64 {
    let line = outcome.one("launch");
    assert_eq!(line["result"], 0, "{line}\n{}", outcome.stderr);
    assert_eq!(line["window_covered"], true, "{line}");
    line["window_busy_fraction"]
        .as_f64()
        .unwrap_or_else(|| panic!("no window_busy_fraction: {line}"))
}

/// Waits for a spawned probe and reads its output.
pub fn finish(child: Child) -> Outcome {
    Outcome::from(child.wait_with_output().expect("the probe ends"))
}

/// Tests that measure time shares of a simulated card run one at a time within their file: the
/// stand-in's kernels are timed sleeps of worker threads, and on a two-core machine tests side by
/// side starve each other's threads (the card then idles between kernels and shares read low).
pub fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

//! What the probe tests share: finding the three shared libraries, a temp dir that stands for a
//! machine (stand-in `libcuda.so.1` and `libnvidia-ml.so.1`, the simulated cards' state file), and
//! running `cuda-probe` in it through real `dlopen`, real processes and real files.
#![allow(dead_code)]

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

pub const PROBE: &str = env!("CARGO_BIN_EXE_cuda-probe");

fn find_lib(name: &str, package: &str) -> PathBuf {
    let dir = Path::new(PROBE).parent().expect("probe has a directory");
    for candidate in [dir.join(name), dir.join("deps").join(name)] {
        if candidate.exists() {
            return candidate;
        }
    }
    panic!(
        "{name} is not in {} or its deps/: run `cargo build -p {package}` (the tests need \
         `cargo build -p gpupool-standin-cuda -p gpupool-standin-nvml -p gpupool-vgpu` first)",
        dir.display()
    );
}

/// The stand-in `libcuda.so.1`, found next to the probe (target/<profile> or its deps/).
pub fn standin_cuda() -> PathBuf {
    find_lib("libgpupool_standin_cuda.so", "gpupool-standin-cuda")
}

/// The stand-in `libnvidia-ml.so.1`.
pub fn standin_nvml() -> PathBuf {
    find_lib("libgpupool_standin_nvml.so", "gpupool-standin-nvml")
}

/// The enforcement library, for LD_PRELOAD.
pub fn vgpu_library() -> PathBuf {
    find_lib("libgpupool_vgpu.so", "gpupool-vgpu")
}

/// A machine: a directory with the stand-in driver libraries under their real names and the
/// simulated cards' state file.
pub struct Machine {
    pub dir: tempfile::TempDir,
    pub devices: String,
    /// Extra environment for every process started here.
    pub env: Vec<(String, String)>,
}

impl Machine {
    /// `devices` as `GPUPOOL_STANDIN_DEVICES` takes it (`2x40g:108`).
    pub fn new(devices: &str) -> Machine {
        Machine::build(devices, true)
    }

    /// A machine without `libnvidia-ml.so.1`.
    pub fn without_nvml(devices: &str) -> Machine {
        Machine::build(devices, false)
    }

    fn build(devices: &str, nvml: bool) -> Machine {
        let dir = tempfile::tempdir().expect("temp dir");
        std::os::unix::fs::symlink(standin_cuda(), dir.path().join("libcuda.so.1"))
            .expect("symlink libcuda");
        if nvml {
            std::os::unix::fs::symlink(standin_nvml(), dir.path().join("libnvidia-ml.so.1"))
                .expect("symlink libnvidia-ml");
        }
        Machine {
            dir,
            devices: devices.to_string(),
            env: Vec::new(),
        }
    }

    pub fn state(&self) -> PathBuf {
        self.dir.path().join("standin.state")
    }

    pub fn with_env(mut self, key: &str, value: &str) -> Machine {
        self.env.push((key.into(), value.into()));
        self
    }

    /// `cuda-probe <args>` in this machine's environment (and nothing inherited that could change
    /// what the stand-ins or a preloaded library do).
    pub fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(PROBE);
        c.args(args);
        for (k, _) in std::env::vars() {
            if k.starts_with("CUDA_")
                || k.starts_with("GPUPOOL_")
                || k.starts_with("LD_")
                || k == "LIBCUDA_LOG_LEVEL"
            {
                c.env_remove(k);
            }
        }
        c.env("LD_LIBRARY_PATH", self.dir.path())
            .env("GPUPOOL_STANDIN_STATE", self.state())
            .env("GPUPOOL_STANDIN_DEVICES", &self.devices);
        for (k, v) in &self.env {
            c.env(k, v);
        }
        c
    }

    /// Runs the probe to its end; its JSON lines (the run must succeed).
    pub fn run(&self, args: &[&str]) -> Vec<Value> {
        self.run_with(args, |_| {})
    }

    pub fn run_with(&self, args: &[&str], edit: impl FnOnce(&mut Command)) -> Vec<Value> {
        let mut c = self.command(args);
        edit(&mut c);
        let out = c.output().expect("run cuda-probe");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "cuda-probe {args:?} failed ({}):\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        parse(&stdout)
    }

    /// Starts the probe in the background with stdout piped.
    pub fn spawn(&self, args: &[&str]) -> Child {
        self.command(args)
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn cuda-probe")
    }
}

pub fn parse(stdout: &str) -> Vec<Value> {
    stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

/// The lines of one op.
pub fn ops<'a>(lines: &'a [Value], op: &str) -> Vec<&'a Value> {
    lines.iter().filter(|l| l["op"] == op).collect()
}

/// The one line of `op`.
pub fn one<'a>(lines: &'a [Value], op: &str) -> &'a Value {
    let found = ops(lines, op);
    assert_eq!(found.len(), 1, "expected one {op:?} line in {lines:#?}");
    found[0]
}

/// Reads lines from a spawned probe until one of `op` arrives.
pub fn wait_for(child: &mut Child, op: &str) -> Value {
    use std::io::BufRead;
    let out = child.stdout.as_mut().expect("piped stdout");
    let mut reader = std::io::BufReader::new(out);
    let mut line = String::new();
    loop {
        line.clear();
        let n = reader.read_line(&mut line).expect("read probe output");
        assert!(n > 0, "the probe ended before printing {op:?}");
        let v: Value = serde_json::from_str(line.trim()).expect("JSON line");
        if v["op"] == op {
            return v;
        }
    }
}

/// SIGKILLs a child and reaps it.
pub fn kill9(child: &mut Child) {
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    let _ = child.wait();
}

pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;
/// The stand-in's default context memory (`GPUPOOL_STANDIN_CONTEXT_MEMORY`).
pub const CONTEXT: u64 = 300 * MIB;

//! The real binaries as child processes: found next to the running executable, logs to a file,
//! killed with the harness (and with the harness's process, should it die first).

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{mpsc, Mutex, OnceLock};
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error(
        "{name} not found (looked in {searched:?}); build the binaries first: `cargo build --bins` \
         (or `cargo build -p gpupool-driver -p gpupool-controller`)"
    )]
    BinaryMissing {
        name: String,
        searched: Vec<PathBuf>,
    },
    #[error("starting {name}: {source}")]
    Spawn {
        name: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{name}: {source}")]
    Io {
        name: String,
        #[source]
        source: std::io::Error,
    },
}

/// Folders where cargo puts the workspace's binaries, seen from the running executable: its own
/// folder (a binary in target/debug) and the one above it (a test in target/debug/deps).
pub fn binary_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Ok(exe) = std::env::current_exe() {
        if let Some(dir) = exe.parent() {
            dirs.push(dir.to_path_buf());
            if let Some(up) = dir.parent() {
                dirs.push(up.to_path_buf());
            }
        }
    }
    dirs
}

/// `GPUPOOL_<NAME>_BIN` (e.g. `GPUPOOL_DRIVER_BIN`): the binary to run as `name`, if set.
fn binary_override(name: &str) -> Option<PathBuf> {
    let env_name = format!("{}_BIN", name.to_uppercase().replace('-', "_"));
    std::env::var_os(env_name).map(PathBuf::from)
}

/// Path of a workspace binary; `GPUPOOL_<NAME>_BIN` (e.g. `GPUPOOL_DRIVER_BIN`) overrides the lookup.
pub fn find_binary(name: &str) -> Result<PathBuf, ProcessError> {
    if let Some(path) = binary_override(name) {
        return Ok(path);
    }
    let searched = binary_dirs();
    searched
        .iter()
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
        .ok_or_else(|| ProcessError::BinaryMissing {
            name: name.to_string(),
            searched,
        })
}

/// Where the harness gets the driver and the controller from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Programs {
    /// The workspace's binaries, found by [`find_binary`]: `cargo test` builds them beside the tests.
    #[default]
    Binaries,
    /// The running executable, told which program to be by its first argument: one whose `main`
    /// starts with [`crate::roles::run_if_asked`] (the sandbox). `cargo run` builds only the
    /// binary it runs, so this is what lets the sandbox start without a second build.
    /// `GPUPOOL_<NAME>_BIN` still picks another binary, as with [`Programs::Binaries`].
    ThisExecutable,
}

/// An executable to start as one of the workspace's programs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Program {
    pub path: PathBuf,
    /// What comes before the program's own arguments (the role, for [`Programs::ThisExecutable`]).
    pub leading_args: Vec<String>,
}

impl Program {
    fn plain(path: PathBuf) -> Program {
        Program {
            path,
            leading_args: Vec::new(),
        }
    }

    /// The whole argument list for `args` of the program.
    pub fn args(&self, args: impl IntoIterator<Item = String>) -> Vec<String> {
        self.leading_args.iter().cloned().chain(args).collect()
    }
}

impl Programs {
    /// How to start the program `name` (`DRIVER_BIN`, `CONTROLLER_BIN`).
    pub fn locate(self, name: &str) -> Result<Program, ProcessError> {
        let own = match (self, binary_override(name)) {
            (_, Some(path)) => return Ok(Program::plain(path)),
            (Programs::Binaries, None) => return find_binary(name).map(Program::plain),
            (Programs::ThisExecutable, None) => std::env::current_exe(),
        };
        let path = own.map_err(|source| ProcessError::Io {
            name: format!("{name} (this executable)"),
            source,
        })?;
        Ok(Program {
            path,
            leading_args: vec![name.to_string()],
        })
    }
}

/// `go` run in `dir` without the network: no module proxy, no toolchain switch, no VCS stamp; the
/// build cache in the workspace's target folder.
pub fn offline_go(dir: &Path) -> Command {
    let mut command = Command::new("go");
    command
        .current_dir(dir)
        .env("GOPROXY", "off")
        .env("GOTOOLCHAIN", "local")
        .env("GOFLAGS", "-buildvcs=false")
        .env("GOCACHE", super::workspace_root().join("target/go-build"));
    command
}

/// Fails the test unless the command succeeded, showing `what` and all it printed.
pub fn assert_succeeded(out: &std::process::Output, what: &str) {
    assert!(
        out.status.success(),
        "{what}:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

type SpawnRequest = (Command, mpsc::Sender<std::io::Result<Child>>);

/// Spawns on a thread that lives as long as the process: PR_SET_PDEATHSIG fires when the *thread*
/// that spawned the child exits, and test threads end long before a shared cluster does.
fn spawn_from_keeper(command: Command) -> std::io::Result<Child> {
    static KEEPER: OnceLock<Mutex<mpsc::Sender<SpawnRequest>>> = OnceLock::new();
    let keeper = KEEPER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("gpupool-e2e-spawner".into())
            .spawn(move || {
                for (mut command, reply) in rx {
                    let _ = reply.send(command.spawn());
                }
            })
            .expect("starting the spawner thread");
        Mutex::new(tx)
    });
    let (reply_tx, reply_rx) = mpsc::channel();
    keeper
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .send((command, reply_tx))
        .map_err(|_| std::io::Error::other("the spawner thread is gone"))?;
    reply_rx
        .recv()
        .map_err(|_| std::io::Error::other("the spawner thread is gone"))?
}

/// Prints the last `lines` lines of a process's log to stderr (the test's output on failure).
pub fn print_log_tail(name: &str, log: &str, lines: usize) {
    let all: Vec<&str> = log.lines().collect();
    let tail = &all[all.len().saturating_sub(lines)..];
    eprintln!(
        "===== {name} (last {} lines) =====\n{}",
        tail.len(),
        tail.join("\n")
    );
}

/// A child process whose stdout and stderr go to a log file; killed when dropped.
pub struct ManagedProcess {
    name: String,
    program: PathBuf,
    args: Vec<String>,
    /// This process's changes to the environment it inherits, applied in order: `Some` sets the
    /// variable, `None` removes it.
    env: Vec<(String, Option<String>)>,
    log_path: PathBuf,
    child: Option<Child>,
}

impl ManagedProcess {
    /// `program args`, not started yet: `start` runs it, appending its output to `log_path`.
    pub fn new(name: &str, program: &Path, args: Vec<String>, log_path: PathBuf) -> ManagedProcess {
        ManagedProcess {
            name: name.to_string(),
            program: program.to_path_buf(),
            args,
            env: Vec::new(),
            log_path,
            child: None,
        }
    }

    /// Starts `program args`, appending its output to `log_path`.
    pub fn spawn(
        name: &str,
        program: &Path,
        args: Vec<String>,
        log_path: PathBuf,
    ) -> Result<ManagedProcess, ProcessError> {
        ManagedProcess::new(name, program, args, log_path).started()
    }

    /// A process that was never started, to hold a place while the real one is moved out.
    pub fn placeholder() -> ManagedProcess {
        ManagedProcess::new("", Path::new(""), Vec::new(), PathBuf::new())
    }

    /// Sets `key` for this process (every start from now on) over the environment it inherits
    /// from the test process, which all the tests running in parallel in a binary share.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> ManagedProcess {
        self.env.push((key.into(), Some(value.into())));
        self
    }

    /// Leaves `key` out of the environment this process inherits.
    pub fn env_remove(mut self, key: impl Into<String>) -> ManagedProcess {
        self.env.push((key.into(), None));
        self
    }

    /// Starts the process and returns it.
    pub fn started(mut self) -> Result<ManagedProcess, ProcessError> {
        self.start()?;
        Ok(self)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// Starts the process again with the same arguments (after `kill` or `stop`).
    pub fn start(&mut self) -> Result<(), ProcessError> {
        let io = |source| ProcessError::Io {
            name: self.name.clone(),
            source,
        };
        let log = File::options()
            .create(true)
            .append(true)
            .open(&self.log_path)
            .map_err(io)?;
        let log_err = log.try_clone().map_err(io)?;
        let mut command = Command::new(&self.program);
        command
            .args(&self.args)
            // Plain text logs: they are read from files and printed into test output.
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err);
        for (key, value) in &self.env {
            match value {
                Some(value) => command.env(key, value),
                None => command.env_remove(key),
            };
        }
        // SAFETY: prctl is async-signal-safe; it only asks the kernel to kill the child when the
        // spawning thread (the keeper, which lives as long as the process) exits, so a crashed or
        // interrupted test leaves no stray process.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = spawn_from_keeper(command).map_err(|source| ProcessError::Spawn {
            name: self.name.clone(),
            source,
        })?;
        super::cleanup::kill_at_exit(child.id());
        self.child = Some(child);
        Ok(())
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// How the process ended, once it has exited by itself or by a signal from elsewhere (a fault
    /// point's SIGKILL). `kill` and `stop` let go of the process: after them this is `None`.
    pub fn exit_status(&mut self) -> Option<ExitStatus> {
        let child = self.child.as_mut()?;
        let status = child.try_wait().ok()??;
        super::cleanup::forget_pid(child.id());
        Some(status)
    }

    /// Waits up to `timeout` for the process to exit; its exit status, or `None` if it still runs
    /// (or is not started).
    pub async fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(status) = self.exit_status() {
                return Some(status);
            }
            if self.child.is_none() || tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// SIGKILL, as a crash or an OOM kill would end it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            // A child already reaped is not signalled again (its pid may be another process's).
            let _ = child.kill();
            let _ = child.wait();
            super::cleanup::forget_pid(child.id());
        }
    }

    /// SIGTERM, then SIGKILL if it has not exited within `grace`; returns the exit status if it
    /// exited on its own.
    pub async fn stop(&mut self, grace: Duration) -> Option<ExitStatus> {
        let pid = self.pid()?;
        if self.exit_status().is_none() {
            // SAFETY: plain kill(2) on our own child, not reaped yet, so the pid is still its.
            unsafe {
                libc::kill(pid as libc::pid_t, libc::SIGTERM);
            }
        }
        let status = self.wait_exit(grace).await;
        self.kill();
        status
    }

    /// Everything the process wrote so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// Prints the last `lines` lines of the log to stderr, headed by the process's name.
    pub fn print_log_tail(&self, lines: usize) {
        print_log_tail(&self.name, &self.log(), lines);
    }
}

impl Drop for ManagedProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

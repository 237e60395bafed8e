//! The stand-in fails where the real `nvidia-cuda-mps-control` fails (README.md beside it): these
//! are the behaviours the driver's MPS handling is tested against, so each is checked here.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_nvidia-cuda-mps-control");

struct Dirs {
    _root: tempfile::TempDir,
    pipe: PathBuf,
    log: PathBuf,
}

impl Dirs {
    fn new() -> Dirs {
        let root = tempfile::tempdir().expect("tempdir");
        let (pipe, log) = (root.path().join("pipe"), root.path().join("log"));
        std::fs::create_dir(&pipe).unwrap();
        std::fs::create_dir(&log).unwrap();
        Dirs {
            _root: root,
            pipe,
            log,
        }
    }

    fn command(&self) -> Command {
        let mut command = Command::new(BIN);
        command
            .env("CUDA_MPS_PIPE_DIRECTORY", &self.pipe)
            .env("CUDA_MPS_LOG_DIRECTORY", &self.log);
        command
    }

    fn start(&self, args: &[&str]) -> Output {
        self.command().args(args).output().expect("runs")
    }

    /// The control utility with `commands` on stdin.
    fn control(&self, commands: &str) -> Output {
        let mut child = self
            .command()
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("runs");
        child
            .stdin
            .take()
            .unwrap()
            .write_all(commands.as_bytes())
            .unwrap();
        child.wait_with_output().unwrap()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.log.join("control.log")).unwrap_or_default()
    }

    fn pid(&self) -> Option<i32> {
        std::fs::read_to_string(self.pipe.join("nvidia-cuda-mps-control.pid"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    fn wait_for(&self, what: &str, done: impl Fn(&Dirs) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !done(self) {
            assert!(Instant::now() < deadline, "{what}; log:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn answers(&self) -> bool {
        self.control("get_server_list\n").status.success()
    }
}

impl Drop for Dirs {
    fn drop(&mut self) {
        if let Some(pid) = self.pid() {
            // SAFETY: kill(2) of the daemon this test started.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn without_a_daemon_the_utility_says_so_and_fails() {
    let dirs = Dirs::new();
    let out = dirs.control("get_server_list\n");
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        stdout(&out).trim(),
        "Cannot find MPS control daemon process"
    );
}

#[test]
fn background_start_returns_at_once_and_a_second_daemon_on_the_folder_is_refused() {
    let dirs = Dirs::new();
    assert!(dirs.start(&["-d", "-M"]).status.success());
    dirs.wait_for("the daemon answers", Dirs::answers);
    let first = dirs.pid().expect("a pid file");
    // The second start "succeeds" (it is in the background) but no second daemon comes up.
    assert!(dirs.start(&["-d"]).status.success());
    dirs.wait_for("the refusal is logged", |d| {
        d.log()
            .contains("An instance of this daemon is already running")
    });
    assert_eq!(dirs.pid(), Some(first));
    assert!(dirs.answers(), "the first daemon still serves");
    // In the foreground the refusal is the exit status.
    let out = dirs.start(&["-f"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("already running"),
        "{out:?}"
    );
    assert!(dirs.control("quit\n").status.success());
    dirs.wait_for("quit removes the socket and the pid file", |d| {
        !d.pipe.join("control").exists() && d.pid().is_none()
    });
}

#[test]
fn a_missing_pipe_or_log_folder_means_no_daemon() {
    let dirs = Dirs::new();
    std::fs::remove_dir(&dirs.pipe).unwrap();
    let out = dirs.start(&["-f"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(dirs.log().contains("pipe directory"), "{}", dirs.log());
    assert!(
        !dirs.pipe.exists(),
        "the daemon does not create its pipe folder"
    );

    let dirs = Dirs::new();
    std::fs::remove_dir(&dirs.log).unwrap();
    assert!(dirs.start(&["-d"]).status.success(), "-d returns at once");
    std::thread::sleep(Duration::from_millis(300));
    assert!(!dirs.answers());
    assert!(!dirs.pipe.join("control").exists());
}

#[test]
fn a_killed_daemon_leaves_its_files_and_blocks_the_next_start_until_they_are_removed() {
    let dirs = Dirs::new();
    assert!(dirs.start(&["-d"]).status.success());
    dirs.wait_for("the daemon answers", Dirs::answers);
    let pid = dirs.pid().unwrap();
    // SAFETY: kill(2) of the daemon this test started.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    dirs.wait_for("the daemon is gone", |_| {
        !Path::new(&format!("/proc/{pid}")).exists() || is_zombie(pid)
    });
    assert!(dirs.pipe.join("control").exists() && dirs.pid() == Some(pid));
    let out = dirs.start(&["-f"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(dirs.log().contains("left by a daemon that is gone"));
    for file in ["control", "nvidia-cuda-mps-control.pid"] {
        std::fs::remove_file(dirs.pipe.join(file)).unwrap();
    }
    assert!(dirs.start(&["-d"]).status.success());
    dirs.wait_for("a new daemon answers", Dirs::answers);
}

fn is_zombie(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(true)
}

#[test]
fn a_client_gets_a_server_its_variable_only_lowers_the_share_and_commands_are_recorded() {
    let dirs = Dirs::new();
    assert!(dirs.start(&["-d", "-M"]).status.success());
    dirs.wait_for("the daemon answers", Dirs::answers);
    assert!(dirs
        .control("set_default_active_thread_percentage 50\n")
        .status
        .success());
    let client = |percentage: Option<&str>| {
        let mut command = dirs.command();
        command.arg("--standin-cuda-client");
        if let Some(p) = percentage {
            command.env("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", p);
        }
        let out = command.output().unwrap();
        assert!(out.status.success(), "{out:?}");
        stdout(&out)
    };
    assert!(client(Some("30")).contains("\"activeThreadPercentage\": 30.0"));
    assert!(client(Some("70")).contains("\"activeThreadPercentage\": 50.0"));
    assert!(client(None).contains("\"activeThreadPercentage\": 50.0"));
    let servers = stdout(&dirs.control("get_server_list\n"));
    assert_eq!(
        servers.lines().count(),
        1,
        "one server for every client: {servers}"
    );
    let refused = dirs.control("set_active_thread_percentage 1 30\nnot_a_command\n");
    assert_eq!(refused.status.code(), Some(1));
    let log = dirs.log();
    for line in [
        "CMD set_default_active_thread_percentage 50",
        "CMD set_active_thread_percentage 1 30",
        "CMD not_a_command",
    ] {
        assert!(log.contains(line), "{line} missing from\n{log}");
    }
    assert!(dirs.control("quit\n").status.success());
}

#[test]
fn without_a_daemon_a_cuda_client_runs_without_mps() {
    let dirs = Dirs::new();
    let out = dirs
        .command()
        .arg("--standin-cuda-client")
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(stdout(&out).contains("\"mps\": false"), "{out:?}");
}

//! A card's MPS control daemon as a process: started in a mount namespace of its own whose
//! `/dev/shm` is the card's `shm/` folder, known by its PID and the kernel's start time of that
//! PID (a PID alone may be reused), stopped by `quit` and, failing that, by SIGKILL together
//! with the servers it started. Blocking.
//!
//! `nvidia-cuda-mps-control -d` returns before the daemon has checked anything (a second daemon on
//! the folder, a missing folder, a socket path too long): whether it runs is learnt from its PID
//! file, the process behind it and an answer on its socket, within [`READY_TIMEOUT`], and on
//! failure its `control.log` says why.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use super::control::{self, ControlError};
use super::layout::DaemonDirs;
use super::share::PIPE_DIRECTORY_ENV;
use super::MpsSettings;

/// How long a daemon may take to answer after its start.
pub const READY_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a daemon may take to exit after `quit` before it is killed.
pub const QUIT_TIMEOUT: Duration = Duration::from_secs(5);
pub const LOG_ENV: &str = "CUDA_MPS_LOG_DIRECTORY";
/// What a server process is called.
pub const SERVER_NAME: &str = "nvidia-cuda-mps-server";
/// The control daemon's log in its log folder.
pub const CONTROL_LOG: &str = "control.log";

/// A running daemon: its PID and that PID's start time (clock ticks after boot, `/proc/<pid>/stat`
/// field 22), which a later process with the same PID does not have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DaemonId {
    pub pid: i32,
    pub start_time: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("creating {path}: {source}")]
    Folder {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Control(#[from] ControlError),
    #[error("{binary} -d: {why}")]
    Launch { binary: PathBuf, why: String },
    #[error(
        "the MPS control daemon for {uuid} did not come up within {READY_TIMEOUT:?}: {why}; its log ends: {log}"
    )]
    NotStarted {
        uuid: String,
        why: String,
        log: String,
    },
    #[error("the MPS control daemon {pid} did not exit, even after SIGKILL")]
    Unkillable { pid: i32 },
    #[error(
        "an MPS control daemon answers on {pipe} and did not quit, and it runs in another PID \
         namespace (another driver instance's): it cannot be killed from here"
    )]
    Elsewhere { pipe: PathBuf },
}

/// What `/proc` says of a process.
struct ProcessInfo {
    start_time: u64,
    /// `argv[0]`'s file name.
    name: String,
    /// Started as a daemon (`-d` or `-f` among its arguments), not as the control utility that
    /// shares its name.
    daemon: bool,
}

/// A live process (not a zombie): its start time and name.
fn process(pid: i32) -> Option<ProcessInfo> {
    if pid <= 0 {
        return None;
    }
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // fields[0] is the state (field 3), so field 22 (starttime) is fields[19].
    if fields.first().is_none_or(|s| matches!(*s, "Z" | "X")) {
        return None;
    }
    let start_time = fields.get(19)?.parse().ok()?;
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let mut args = cmdline.split(|b| *b == 0);
    let argv0 = args.next().unwrap_or_default();
    let name = Path::new(std::ffi::OsStr::from_bytes(argv0))
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let daemon = args.any(|a| a == b"-d" || a == b"-f");
    Some(ProcessInfo {
        start_time,
        name,
        daemon,
    })
}

/// The MPS pipe folder the process's environment names, if any.
fn pipe_of(pid: i32) -> Option<PathBuf> {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    let prefix = format!("{PIPE_DIRECTORY_ENV}=").into_bytes();
    environ
        .split(|b| *b == 0)
        .find_map(|var| var.strip_prefix(prefix.as_slice()))
        .map(|value| PathBuf::from(std::ffi::OsStr::from_bytes(value)))
}

/// Whether the process's environment names `pipe` as its MPS pipe folder.
fn serves_pipe(pid: i32, pipe: &Path) -> bool {
    pipe_of(pid).is_some_and(|p| p == pipe)
}

/// Live processes called `name` (`argv[0]`'s file name) whose MPS pipe folder `wanted` accepts.
fn processes(name: &str, wanted: impl Fn(&Path) -> bool) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            process(*pid).is_some_and(|p| p.name == name)
                && pipe_of(*pid).is_some_and(|pipe| wanted(&pipe))
        })
        .collect()
}

/// Live processes called `name` whose MPS pipe folder lies under `root`: what a node's (or a
/// test's) servers are, wherever they came from.
pub fn processes_under(root: &Path, name: &str) -> Vec<i32> {
    processes(name, |pipe| pipe.starts_with(root))
}

/// [`processes_under`] that run as control daemons (the control utility, a command for a
/// moment, shares their name).
pub fn daemons_under(root: &Path, name: &str) -> Vec<i32> {
    processes_under(root, name)
        .into_iter()
        .filter(|pid| process(*pid).is_some_and(|p| p.daemon))
        .collect()
}

/// Reaps `pid` if it is this process's child that has exited (the driver is PID 1 of its
/// container, where an orphaned daemon becomes its child); a no-op otherwise.
fn reap(pid: i32) {
    // SAFETY: waitpid with WNOHANG on one pid; ECHILD when it is not ours.
    unsafe {
        libc::waitpid(pid, std::ptr::null_mut(), libc::WNOHANG);
    }
}

/// The file name a daemon of `settings` runs under.
fn daemon_name(settings: &MpsSettings) -> String {
    settings
        .control
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| super::CONTROL_BINARY.to_string())
}

/// Whether `id` is still the daemon it was recorded as: alive, same start time, same program.
pub fn is_running(settings: &MpsSettings, id: DaemonId) -> bool {
    reap(id.pid);
    process(id.pid)
        .is_some_and(|p| p.start_time == id.start_time && p.name == daemon_name(settings))
}

/// Whether a daemon answers on the control socket of `dirs`, whoever started it: a daemon of the
/// other driver instance of a rolling update runs in that instance's PID namespace, where its PID
/// means nothing here, yet its socket is the same file.
pub fn answers(settings: &MpsSettings, dirs: &DaemonDirs) -> bool {
    control::servers(&settings.control, dirs).is_ok()
}

/// Whether the daemon of `dirs` runs: `id` is alive, or something answers on its socket.
pub fn is_serving(settings: &MpsSettings, dirs: &DaemonDirs, id: Option<DaemonId>) -> bool {
    id.is_some_and(|id| is_running(settings, id)) || answers(settings, dirs)
}

/// Whether the process `id` still lives (its PID not reused since), whatever its program: what a
/// scrape can tell without the driver's settings.
pub fn is_alive(id: DaemonId) -> bool {
    process(id.pid).is_some_and(|p| p.start_time == id.start_time)
}

/// The daemon serving `dirs`, whatever recorded it: the PID its PID file names, if that process
/// is a control daemon whose pipe folder is this one.
pub fn find(settings: &MpsSettings, dirs: &DaemonDirs) -> Option<DaemonId> {
    let pid: i32 = std::fs::read_to_string(dirs.pid_file())
        .ok()?
        .trim()
        .parse()
        .ok()?;
    reap(pid);
    let info = process(pid)?;
    (info.name == daemon_name(settings) && info.daemon && serves_pipe(pid, &dirs.pipe)).then_some(
        DaemonId {
            pid,
            start_time: info.start_time,
        },
    )
}

/// The servers of `dirs`' daemon still running, also those a killed daemon left: processes named
/// `nvidia-cuda-mps-server` whose pipe folder is this one.
pub fn servers(dirs: &DaemonDirs) -> Vec<i32> {
    processes(SERVER_NAME, |pipe| pipe == dirs.pipe)
}

fn folder(path: &Path, mode: u32) -> Result<(), DaemonError> {
    let fail = |source| DaemonError::Folder {
        path: path.to_path_buf(),
        source,
    };
    std::fs::create_dir_all(path).map_err(fail)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(fail)
}

/// The daemon's folders: the pipe folder readable by clients of every user, the log the driver's
/// only, the shared memory writable by all and sticky (like `/dev/shm`).
pub fn create_folders(dirs: &DaemonDirs) -> Result<(), DaemonError> {
    folder(&dirs.root, 0o711)?;
    folder(&dirs.pipe, 0o755)?;
    folder(&dirs.log, 0o700)?;
    folder(&dirs.shm, 0o1777)
}

/// Removes what a daemon that is gone left in its pipe folder (its socket and PID file), so that
/// the next one can start: only call it once no daemon serves the folder.
pub fn remove_stale_files(dirs: &DaemonDirs) -> std::io::Result<()> {
    for file in [dirs.socket(), dirs.pid_file()] {
        match std::fs::remove_file(&file) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
    }
    Ok(())
}

/// The last lines of the daemon's `control.log`, for an error.
pub fn log_tail(dirs: &DaemonDirs) -> String {
    let log = std::fs::read_to_string(dirs.log.join(CONTROL_LOG)).unwrap_or_default();
    let lines: Vec<&str> = log.lines().collect();
    let tail = lines[lines.len().saturating_sub(5)..].join(" | ");
    if tail.is_empty() {
        "(empty)".to_string()
    } else {
        tail
    }
}

/// Starts the daemon of card `uuid` in `dirs` (its folders exist, nothing serves them) and waits
/// until it answers.
pub fn start(
    settings: &MpsSettings,
    dirs: &DaemonDirs,
    uuid: &str,
) -> Result<DaemonId, DaemonError> {
    let launch_error = |why: String| DaemonError::Launch {
        binary: settings.control.clone(),
        why,
    };
    let shm = CString::new(dirs.shm.as_os_str().as_bytes())
        .map_err(|_| launch_error("the shm folder's path has a NUL byte".into()))?;
    let mut command = control::base_command(&settings.control, dirs);
    command
        .arg("-d")
        .args(settings.multi_user.then_some("-M"))
        .env("CUDA_VISIBLE_DEVICES", uuid)
        .env(LOG_ENV, &dirs.log)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: between fork and exec the child only makes system calls (no allocation: the paths
    // are built before), and a failure becomes the spawn's error.
    unsafe {
        command.pre_exec(move || shm_namespace(&shm));
    }
    let launched = command.output().map_err(|source| {
        DaemonError::Control(ControlError::Spawn {
            binary: settings.control.clone(),
            source,
        })
    })?;
    if !launched.status.success() {
        return Err(launch_error(format!(
            "{}: {}{}",
            launched.status,
            String::from_utf8_lossy(&launched.stdout).trim(),
            String::from_utf8_lossy(&launched.stderr).trim()
        )));
    }
    wait_ready(settings, dirs, uuid)
}

/// [`super::layout::CONTAINER_SHM_DIR`], ready for a system call between fork and exec (no allocation there).
const SHM_TARGET: &std::ffi::CStr = c"/dev/shm";

/// In the child, before exec: a mount namespace of its own, nothing propagating back to the host,
/// and the card's folder as `/dev/shm` (the servers the daemon starts inherit it).
fn shm_namespace(shm: &CString) -> std::io::Result<()> {
    let check = |rc: libc::c_int| {
        if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    };
    // SAFETY: system calls on constant or prepared NUL-terminated strings.
    unsafe {
        check(libc::unshare(libc::CLONE_NEWNS))?;
        check(libc::mount(
            std::ptr::null(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        ))?;
        check(libc::mount(
            shm.as_ptr(),
            SHM_TARGET.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND,
            std::ptr::null(),
        ))
    }
}

/// Waits until the daemon's PID file names a control daemon of this folder and it answers.
fn wait_ready(
    settings: &MpsSettings,
    dirs: &DaemonDirs,
    uuid: &str,
) -> Result<DaemonId, DaemonError> {
    let deadline = Instant::now() + READY_TIMEOUT;
    let mut why = "no PID file yet".to_string();
    while Instant::now() < deadline {
        if let Some(id) = find(settings, dirs) {
            match control::servers(&settings.control, dirs) {
                Ok(_) => return Ok(id),
                Err(e @ ControlError::Spawn { .. }) => return Err(e.into()),
                Err(e) => why = e.to_string(),
            }
        } else if dirs.pid_file().exists() {
            why = "its PID file names no control daemon of this folder".to_string();
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Err(DaemonError::NotStarted {
        uuid: uuid.to_string(),
        why,
        log: log_tail(dirs),
    })
}

fn kill(pid: i32) {
    // SAFETY: kill(2) of a process checked to be the daemon or one of its servers.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
    }
}

/// Waits up to `timeout` for the daemon of `dirs` (`id`, when this process can see it) to be
/// gone: no such process, nothing answering on the socket.
fn gone_within(
    settings: &MpsSettings,
    dirs: &DaemonDirs,
    id: Option<DaemonId>,
    timeout: Duration,
) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if !is_serving(settings, dirs, id) {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Stops the daemon of `dirs` (`id`, or whichever its PID file names, or whatever answers on its
/// socket) and every server of the folder: `quit`, then SIGKILL for what is left; then its socket
/// and PID file are gone too.
pub fn stop(
    settings: &MpsSettings,
    dirs: &DaemonDirs,
    id: Option<DaemonId>,
) -> Result<(), DaemonError> {
    let id = id
        .filter(|id| is_running(settings, *id))
        .or_else(|| find(settings, dirs));
    if is_serving(settings, dirs, id) {
        // Best effort: a daemon that does not take it is killed below.
        if let Err(e) = control::run(&settings.control, dirs, &["quit".to_string()]) {
            tracing::warn!(pid = ?id.map(|id| id.pid), error = %e, "the MPS control daemon did not take quit; killing it");
        }
        if !gone_within(settings, dirs, id, QUIT_TIMEOUT) {
            let Some(id) = id else {
                // It answers, but runs where this process cannot see it (another PID namespace).
                return Err(DaemonError::Elsewhere {
                    pipe: dirs.pipe.clone(),
                });
            };
            kill(id.pid);
            if !gone_within(settings, dirs, Some(id), QUIT_TIMEOUT) {
                return Err(DaemonError::Unkillable { pid: id.pid });
            }
        }
    }
    let left = servers(dirs);
    for server in &left {
        tracing::info!(pid = server, pipe = %dirs.pipe.display(), "killing an MPS server its daemon left");
        kill(*server);
    }
    let deadline = Instant::now() + QUIT_TIMEOUT;
    while left.iter().any(|pid| {
        reap(*pid);
        process(*pid).is_some()
    }) && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(10));
    }
    remove_stale_files(dirs).map_err(|source| DaemonError::Folder {
        path: dirs.pipe.clone(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_daemons_shm_is_where_containers_get_theirs() {
        assert_eq!(
            SHM_TARGET.to_str().unwrap(),
            super::super::layout::CONTAINER_SHM_DIR
        );
    }

    #[test]
    fn this_process_is_found_by_its_start_time_and_a_dead_pid_is_not() {
        let me = std::process::id() as i32;
        let info = process(me).expect("this process");
        let settings = MpsSettings {
            control: std::env::current_exe().unwrap(),
            multi_user: true,
        };
        let id = DaemonId {
            pid: me,
            start_time: info.start_time,
        };
        assert!(is_running(&settings, id));
        assert!(!is_running(
            &settings,
            DaemonId {
                start_time: info.start_time + 1,
                ..id
            }
        ));
        assert!(!is_running(&settings, DaemonId { pid: -1, ..id }));
        let other = MpsSettings {
            control: "nvidia-cuda-mps-control".into(),
            multi_user: true,
        };
        assert!(!is_running(&other, id), "another program's PID");
    }
}

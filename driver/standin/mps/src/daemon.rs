//! The control daemon: refuses to start beside another one or without its folders, serves the
//! control commands, starts servers for attaching clients, and leaves its files behind when it is
//! killed (only `quit` removes them).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::{Arc, Mutex};

use crate::paths::{self, Dirs, Log};

/// A server the daemon started: one per user, or one for all with `-M`.
struct Server {
    uid: u32,
    child: Child,
    active_thread_percentage: f64,
    /// Device index -> limit, as given (`1024M`).
    pinned_mem_limits: BTreeMap<u32, String>,
}

struct Client {
    pid: i32,
    server: u32,
    /// Connection number, so that a client leaving removes itself only.
    connection: u64,
}

struct State {
    multi_user: bool,
    servers: Vec<Server>,
    clients: Vec<Client>,
    default_active_thread_percentage: f64,
    default_pinned_mem_limits: BTreeMap<u32, String>,
    shm_marker: PathBuf,
    next_connection: u64,
}

struct Daemon {
    dirs: Dirs,
    log: Log,
    state: Mutex<State>,
}

/// `-d` or `-f`. With `-d` the parent returns at once, before the daemon has checked anything,
/// as the real one does: whoever starts it learns whether it runs only from its PID file, its
/// socket and its log.
pub fn daemon_main(background: bool, multi_user: bool) -> ExitCode {
    if background {
        // SAFETY: the process has one thread here; the child only calls async-signal-safe
        // functions until it is on its own (setsid, open, dup2) and then runs normally.
        match unsafe { libc::fork() } {
            -1 => {
                eprintln!(
                    "nvidia-cuda-mps-control: fork: {}",
                    std::io::Error::last_os_error()
                );
                return ExitCode::FAILURE;
            }
            0 => detach(),
            _ => return ExitCode::SUCCESS,
        }
    }
    match serve(multi_user) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("nvidia-cuda-mps-control: {message}");
            ExitCode::FAILURE
        }
    }
}

/// A new session with stdin, stdout and stderr on /dev/null.
fn detach() {
    // SAFETY: plain system calls on this process's own descriptors.
    unsafe {
        libc::setsid();
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
        if null >= 0 {
            for fd in 0..3 {
                libc::dup2(null, fd);
            }
            if null > 2 {
                libc::close(null);
            }
        }
    }
}

fn serve(multi_user: bool) -> Result<(), String> {
    let dirs = Dirs::from_env();
    if !dirs.log.is_dir() {
        return Err(format!(
            "log directory {} does not exist (CUDA_MPS_LOG_DIRECTORY)",
            dirs.log.display()
        ));
    }
    let log = Log::new(&dirs.log, paths::CONTROL_LOG, "Control");
    let fail = |message: String| {
        log.line(&message);
        Err(message)
    };
    if !dirs.pipe.is_dir() {
        return fail(format!(
            "pipe directory {} does not exist (CUDA_MPS_PIPE_DIRECTORY)",
            dirs.pipe.display()
        ));
    }
    let socket = dirs.socket();
    if UnixStream::connect(&socket).is_ok() {
        return fail(format!(
            "An instance of this daemon is already running on {}",
            socket.display()
        ));
    }
    if let Some(pid) = read_pid(&dirs.pid_file()) {
        if process_alive(pid) {
            return fail(format!(
                "An instance of this daemon is already running (pid {pid} in {})",
                dirs.pid_file().display()
            ));
        }
    }
    // Files of a daemon that was killed: the stand-in never takes them over.
    for stale in [&socket, &dirs.pid_file()] {
        if stale.symlink_metadata().is_ok() {
            return fail(format!(
                "{} exists, left by a daemon that is gone: remove it first",
                stale.display()
            ));
        }
    }
    if socket.as_os_str().len() > paths::MAX_SOCKET_PATH {
        return fail(format!(
            "Failed to bind {}: the path is longer than {} bytes",
            socket.display(),
            paths::MAX_SOCKET_PATH
        ));
    }
    let listener =
        UnixListener::bind(&socket).map_err(|e| format!("bind {}: {e}", socket.display()))?;
    // Clients of every user connect to it (with -M they are all served by root's server).
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o777))
        .map_err(|e| format!("chmod {}: {e}", socket.display()))?;
    let pid = std::process::id();
    std::fs::write(dirs.pid_file(), format!("{pid}\n"))
        .map_err(|e| format!("writing {}: {e}", dirs.pid_file().display()))?;
    // Clients reach their server through shared memory: a client whose /dev/shm is not this one
    // cannot attach.
    let shm_marker = PathBuf::from(format!("/dev/shm/nvidia-mps-standin.{pid}"));
    if let Err(e) = std::fs::write(&shm_marker, b"") {
        return fail(format!("creating {}: {e}", shm_marker.display()));
    }
    log.line(&format!(
        "Starting control daemon using socket {}",
        socket.display()
    ));
    log.line(&format!(
        "To connect CUDA applications to this daemon, set env {}={}",
        paths::PIPE_ENV,
        dirs.pipe.display()
    ));
    log.line(&format!(
        "CUDA_VISIBLE_DEVICES={}",
        std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_default()
    ));
    log.line(&format!(
        "Multi-user server: {}",
        if multi_user { "on" } else { "off" }
    ));
    log.line(&format!("Shared memory: {}", shm_marker.display()));
    let daemon = Arc::new(Daemon {
        dirs,
        log,
        state: Mutex::new(State {
            multi_user,
            servers: Vec::new(),
            clients: Vec::new(),
            default_active_thread_percentage: 100.0,
            default_pinned_mem_limits: BTreeMap::new(),
            shm_marker,
            next_connection: 0,
        }),
    });
    let reaper = daemon.clone();
    std::thread::spawn(move || loop {
        std::thread::sleep(std::time::Duration::from_millis(200));
        reaper.reap_servers();
    });
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        let daemon = daemon.clone();
        std::thread::spawn(move || daemon.handle(stream));
    }
    Ok(())
}

fn read_pid(path: &Path) -> Option<i32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// A process that exists and is not a zombie (a killed daemon whose parent has not reaped it).
fn process_alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            let (_, rest) = stat.rsplit_once(')')?;
            Some(!rest.trim_start().starts_with(['Z', 'X']))
        })
        .unwrap_or(false)
}

/// The peer's (pid, uid), as the kernel saw them when it connected.
fn peer(stream: &UnixStream) -> (i32, u32) {
    use std::os::fd::AsRawFd;
    let mut cred = libc::ucred {
        pid: 0,
        uid: u32::MAX,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED fills a ucred of the length given.
    unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        );
    }
    (cred.pid, cred.uid)
}

/// `N`, `NK`, `NM` or `NG`.
fn valid_mem_limit(value: &str) -> bool {
    let digits = value.trim_end_matches(['K', 'M', 'G']);
    !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit())
        && value.len() - digits.len() <= 1
}

fn percentage(value: &str) -> Result<f64, String> {
    match value.parse::<f64>() {
        Ok(p) if p > 0.0 && p <= 100.0 => Ok(p),
        _ => Err(format!(
            "Invalid active thread percentage {value}: expected a number above 0 and at most 100"
        )),
    }
}

impl Daemon {
    fn handle(self: &Arc<Self>, stream: UnixStream) {
        let mut reader = BufReader::new(match stream.try_clone() {
            Ok(s) => s,
            Err(_) => return,
        });
        let mut first = String::new();
        if reader.read_line(&mut first).is_err() {
            return;
        }
        let first = first.trim_end().to_string();
        if first.is_empty() {
            // A probe (someone checking that the socket answers), not a command.
            return;
        }
        if first == "client" {
            self.attach(stream, reader);
            return;
        }
        self.log.line(&format!("CMD {first}"));
        let answer = self.command(&first);
        let mut stream = stream;
        let reply = match &answer {
            Ok(output) => format!("OK\n{output}"),
            Err(message) => format!("ERR {message}\n"),
        };
        let _ = stream.write_all(reply.as_bytes());
        let _ = stream.flush();
        drop(stream);
        if answer.is_ok() && first.split_whitespace().next() == Some("quit") {
            self.quit();
        }
    }

    /// One control command; the lines to print.
    fn command(&self, line: &str) -> Result<String, String> {
        let words: Vec<&str> = line.split_whitespace().collect();
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let server_index = |state: &State, pid: &str| -> Result<usize, String> {
            let pid: u32 = pid
                .parse()
                .map_err(|_| format!("Invalid server PID {pid}"))?;
            state
                .servers
                .iter()
                .position(|s| s.child.id() == pid)
                .ok_or_else(|| format!("Server {pid} not found"))
        };
        match words.as_slice() {
            ["get_server_list"] => Ok(state
                .servers
                .iter()
                .map(|s| format!("{}\n", s.child.id()))
                .collect()),
            ["get_server_status", pid] => {
                server_index(&state, pid)?;
                Ok("ACTIVE\n".into())
            }
            ["start_server", "-uid", uid] => {
                let uid: u32 = uid.parse().map_err(|_| format!("Invalid uid {uid}"))?;
                self.server_for(&mut state, uid).map(|_| String::new())
            }
            ["get_client_list", pid] => {
                let index = server_index(&state, pid)?;
                let server = state.servers[index].child.id();
                Ok(state
                    .clients
                    .iter()
                    .filter(|c| c.server == server)
                    .map(|c| format!("{}\n", c.pid))
                    .collect())
            }
            ["shutdown_server", pid] | ["shutdown_server", pid, "-f"] => {
                let index = server_index(&state, pid)?;
                let mut server = state.servers.remove(index);
                let id = server.child.id();
                let _ = server.child.kill();
                let _ = server.child.wait();
                state.clients.retain(|c| c.server != id);
                Ok(String::new())
            }
            ["set_default_active_thread_percentage", p] => {
                state.default_active_thread_percentage = percentage(p)?;
                Ok(String::new())
            }
            ["get_default_active_thread_percentage"] => {
                Ok(format!("{:.1}\n", state.default_active_thread_percentage))
            }
            ["set_active_thread_percentage", pid, p] => {
                let index = server_index(&state, pid)?;
                state.servers[index].active_thread_percentage = percentage(p)?;
                Ok(String::new())
            }
            ["get_active_thread_percentage", pid] => {
                let index = server_index(&state, pid)?;
                Ok(format!(
                    "{:.1}\n",
                    state.servers[index].active_thread_percentage
                ))
            }
            ["set_default_device_pinned_mem_limit", dev, value] => {
                let dev: u32 = dev.parse().map_err(|_| format!("Invalid device {dev}"))?;
                if !valid_mem_limit(value) {
                    return Err(format!("Invalid memory limit {value}"));
                }
                state
                    .default_pinned_mem_limits
                    .insert(dev, value.to_string());
                Ok(String::new())
            }
            ["get_default_device_pinned_mem_limit", dev] => {
                let dev: u32 = dev.parse().map_err(|_| format!("Invalid device {dev}"))?;
                Ok(format!(
                    "{}\n",
                    state
                        .default_pinned_mem_limits
                        .get(&dev)
                        .map_or("0", String::as_str)
                ))
            }
            ["set_device_pinned_mem_limit", pid, dev, value] => {
                let index = server_index(&state, pid)?;
                let dev: u32 = dev.parse().map_err(|_| format!("Invalid device {dev}"))?;
                if !valid_mem_limit(value) {
                    return Err(format!("Invalid memory limit {value}"));
                }
                state.servers[index]
                    .pinned_mem_limits
                    .insert(dev, value.to_string());
                Ok(String::new())
            }
            ["terminate_client", server, client] => {
                let index = server_index(&state, server)?;
                let server = state.servers[index].child.id();
                let client: i32 = client
                    .parse()
                    .map_err(|_| format!("Invalid client PID {client}"))?;
                let before = state.clients.len();
                state
                    .clients
                    .retain(|c| !(c.server == server && c.pid == client));
                if state.clients.len() == before {
                    return Err(format!("Client {client} not found on server {server}"));
                }
                // SAFETY: kill(2) of the client's process.
                unsafe { libc::kill(client, libc::SIGKILL) };
                Ok(String::new())
            }
            ["quit"] | ["quit", "-t", _] => Ok(String::new()),
            _ => Err(format!("Unrecognized command: {line}")),
        }
    }

    /// The server a client of `uid` attaches to, started when there is none. Without `-M` a
    /// server of another user that has clients makes the new client wait.
    fn server_for(&self, state: &mut State, uid: u32) -> Result<u32, String> {
        let uid = if state.multi_user { 0 } else { uid };
        if let Some(server) = state.servers.iter().find(|s| s.uid == uid) {
            return Ok(server.child.id());
        }
        if let Some(other) = state.servers.first() {
            let busy = state.clients.iter().any(|c| c.server == other.child.id());
            if busy {
                return Err(format!(
                    "WAIT server {} of user {} has clients",
                    other.child.id(),
                    other.uid
                ));
            }
            let mut other = state.servers.remove(0);
            let _ = other.child.kill();
            let _ = other.child.wait();
        }
        let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
        let child = Command::new(exe)
            .arg0(paths::SERVER_NAME)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("starting {}: {e}", paths::SERVER_NAME))?;
        let id = child.id();
        self.log
            .line(&format!("Starting new server {id} for user {uid}"));
        state.servers.push(Server {
            uid,
            child,
            active_thread_percentage: state.default_active_thread_percentage,
            pinned_mem_limits: state.default_pinned_mem_limits.clone(),
        });
        Ok(id)
    }

    /// A CUDA client: its variables follow until an empty line; it stays attached while the
    /// connection is open.
    fn attach(&self, mut stream: UnixStream, mut reader: BufReader<UnixStream>) {
        let (pid, uid) = peer(&stream);
        let mut env = BTreeMap::new();
        loop {
            let mut line = String::new();
            match reader.read_line(&mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            if let Some((key, value)) = line.split_once('=') {
                env.insert(key.to_string(), value.to_string());
            }
        }
        let requested = env
            .get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
            .map(|p| percentage(p))
            .transpose();
        let (answer, connection) = {
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            let connection = state.next_connection;
            state.next_connection += 1;
            let answer = requested.and_then(|requested| {
                let server = self.server_for(&mut state, uid)?;
                let limit = state
                    .servers
                    .iter()
                    .find(|s| s.child.id() == server)
                    .map_or(100.0, |s| s.active_thread_percentage);
                // The client's variable may only lower what the daemon allows.
                let effective = requested.map_or(limit, |r| r.min(limit));
                state.clients.push(Client {
                    pid,
                    server,
                    connection,
                });
                Ok((server, effective, state.shm_marker.clone()))
            });
            (answer, connection)
        };
        let visible = env.get("CUDA_VISIBLE_DEVICES").cloned().unwrap_or_default();
        let pinned = env
            .get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
            .cloned()
            .unwrap_or_default();
        let reply = match &answer {
            Ok((server, effective, marker)) => {
                self.log.line(&format!(
                    "NEW CLIENT {pid} from user {uid}: server {server}, active thread percentage {effective:.1}, \
                     pinned memory limit {pinned:?}, CUDA_VISIBLE_DEVICES {visible:?}"
                ));
                // The shared memory and the pipe folder as the daemon names them: a client must
                // reach both under those names.
                format!(
                    "ATTACHED {server} {effective:.1}\n{}\n{}\n",
                    marker.display(),
                    self.dirs.pipe.display()
                )
            }
            Err(message) => {
                self.log
                    .line(&format!("NEW CLIENT {pid} from user {uid}: {message}"));
                format!("{message}\n")
            }
        };
        if stream.write_all(reply.as_bytes()).is_err() || answer.is_err() {
            return;
        }
        // Attached until the client closes its end.
        let mut sink = [0u8; 64];
        while matches!(reader.read(&mut sink), Ok(n) if n > 0) {}
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.clients.retain(|c| c.connection != connection);
        self.log.line(&format!("CLIENT {pid} EXIT"));
    }

    /// Servers that ended on their own (killed from outside) are forgotten, with their clients.
    fn reap_servers(&self) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let mut gone = Vec::new();
        state.servers.retain_mut(|s| match s.child.try_wait() {
            Ok(Some(_)) => {
                gone.push(s.child.id());
                false
            }
            _ => true,
        });
        state.clients.retain(|c| !gone.contains(&c.server));
    }

    /// `quit`: servers stopped, socket, PID file and shared memory removed, exit.
    fn quit(&self) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        for server in &mut state.servers {
            let _ = server.child.kill();
            let _ = server.child.wait();
        }
        let _ = std::fs::remove_file(self.dirs.socket());
        let _ = std::fs::remove_file(self.dirs.pid_file());
        let _ = std::fs::remove_file(&state.shm_marker);
        self.log.line("Exit");
        std::process::exit(0);
    }
}

/// A server: it waits to be stopped by its daemon (or killed). Its environment is the daemon's.
pub fn server_main() -> ! {
    let dirs = Dirs::from_env();
    Log::new(&dirs.log, paths::SERVER_LOG, "Server").line("Startup");
    loop {
        std::thread::sleep(std::time::Duration::from_secs(3600));
    }
}

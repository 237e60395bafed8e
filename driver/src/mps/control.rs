//! `nvidia-cuda-mps-control` as a client: commands on its stdin, answers on its stdout, against
//! the daemon of one pipe folder. Each call is a process of its own (as `echo quit |
//! nvidia-cuda-mps-control` is), bounded by [`COMMAND_TIMEOUT`]. Blocking.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use super::layout::DaemonDirs;
use super::share::PIPE_DIRECTORY_ENV;

/// A command answers in milliseconds; a daemon that does not answer within this is treated as
/// not answering, so that a hung daemon never holds the kubelet's call.
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(5);
/// Variables of the driver's environment that the control program and the daemon need (where it
/// and the CUDA driver's libraries are); nothing else of the driver's environment is passed on.
pub const PASSED_ENV: &[&str] = &["PATH", "LD_LIBRARY_PATH"];

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("cannot run {binary}: {source} (install the NVIDIA driver's nvidia-cuda-mps-control, or point --mps-control at it)")]
    Spawn {
        binary: PathBuf,
        source: std::io::Error,
    },
    #[error("{command:?}: no MPS control daemon answers on {pipe}")]
    NoDaemon { command: String, pipe: PathBuf },
    #[error("{command:?} failed ({status}): {output}")]
    Failed {
        command: String,
        status: String,
        output: String,
    },
    #[error("{command:?} did not answer within {COMMAND_TIMEOUT:?}")]
    TimedOut { command: String },
    #[error("{command:?} answered {output:?}, not a list of process ids")]
    Unexpected { command: String, output: String },
}

/// What the control program printed when no daemon answers.
const NO_DAEMON: &str = "Cannot find MPS control daemon process";

/// The environment the control program and the daemon run with: [`PASSED_ENV`] of the driver's,
/// and the pipe folder.
pub fn base_command(binary: &Path, dirs: &DaemonDirs) -> Command {
    let mut command = Command::new(binary);
    command.env_clear();
    for name in PASSED_ENV {
        if let Some(value) = std::env::var_os(name) {
            command.env(name, value);
        }
    }
    command.env(PIPE_DIRECTORY_ENV, &dirs.pipe);
    command
}

/// Sends `commands` (one a line) to the daemon of `dirs`; its stdout.
pub fn run(binary: &Path, dirs: &DaemonDirs, commands: &[String]) -> Result<String, ControlError> {
    let joined = commands.join("; ");
    let mut child = base_command(binary, dirs)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| ControlError::Spawn {
            binary: binary.to_path_buf(),
            source,
        })?;
    let input: String = commands.iter().map(|c| format!("{c}\n")).collect();
    if let Some(mut stdin) = child.stdin.take() {
        // A daemon-less utility may exit before reading: its status says so, not this write.
        let _ = stdin.write_all(input.as_bytes());
    }
    let pid = child.id() as libc::pid_t;
    let (done, wait) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(child.wait_with_output());
    });
    let output = match wait.recv_timeout(COMMAND_TIMEOUT) {
        Ok(Ok(output)) => output,
        Ok(Err(source)) => {
            return Err(ControlError::Spawn {
                binary: binary.to_path_buf(),
                source,
            })
        }
        Err(_) => {
            // SAFETY: kill(2) of the child this call started; the thread reaps it.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            return Err(ControlError::TimedOut { command: joined });
        }
    };
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    if stdout.contains(NO_DAEMON) || stderr.contains(NO_DAEMON) {
        return Err(ControlError::NoDaemon {
            command: joined,
            pipe: dirs.pipe.clone(),
        });
    }
    if !output.status.success() {
        return Err(ControlError::Failed {
            command: joined,
            status: output.status.to_string(),
            output: format!("{}{}", stdout.trim(), stderr.trim()),
        });
    }
    Ok(stdout)
}

/// Process ids, one a line (what `get_server_list` and `get_client_list` print).
pub fn parse_pids(command: &str, output: &str) -> Result<Vec<u32>, ControlError> {
    output
        .split_whitespace()
        .map(|word| {
            word.parse::<u32>()
                .ok()
                .filter(|pid| *pid > 0)
                .ok_or_else(|| ControlError::Unexpected {
                    command: command.to_string(),
                    output: output.to_string(),
                })
        })
        .collect()
}

/// The daemon's servers (`get_server_list`).
pub fn servers(binary: &Path, dirs: &DaemonDirs) -> Result<Vec<u32>, ControlError> {
    let command = "get_server_list";
    let output = run(binary, dirs, &[command.to_string()])?;
    parse_pids(command, &output)
}

/// The clients of one server (`get_client_list <server>`).
pub fn clients(binary: &Path, dirs: &DaemonDirs, server: u32) -> Result<Vec<u32>, ControlError> {
    let command = format!("get_client_list {server}");
    let output = run(binary, dirs, std::slice::from_ref(&command))?;
    parse_pids(&command, &output)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn process_lists_are_numbers_or_an_error_naming_the_command() {
        assert_eq!(
            parse_pids("get_server_list", "812\n900\n").unwrap(),
            [812, 900]
        );
        assert_eq!(
            parse_pids("get_server_list", "").unwrap(),
            Vec::<u32>::new()
        );
        let e = parse_pids("get_server_list", "Server 1 not found\n").unwrap_err();
        assert!(
            e.to_string().starts_with("\"get_server_list\" answered"),
            "{e}"
        );
        assert!(parse_pids("x", "0").is_err());
    }
}

//! A stand-in `nvidia-cuda-mps-control` for machines without a GPU (test-only). One executable
//! plays the three parts the driver and a claim's container meet:
//!
//! - **the control daemon** (`-d` in the background, `-f` in the foreground, `-M` for one server
//!   that serves clients of every user): a Unix socket `control` and a PID file
//!   `nvidia-cuda-mps-control.pid` in `CUDA_MPS_PIPE_DIRECTORY` (default `/tmp/nvidia-mps`), a
//!   `control.log` in `CUDA_MPS_LOG_DIRECTORY` (default `/var/log/nvidia-mps`), and servers
//!   (processes named `nvidia-cuda-mps-server`, started for the first client of a user);
//! - **the control utility** (no arguments): one command a line on stdin, each answered on stdout;
//!   "Cannot find MPS control daemon process" and exit status 1 when no daemon answers;
//! - **a CUDA client** attaching (`--standin-cuda-client`, which the real program does not have:
//!   it is what `libcuda` does when a process starts CUDA): it connects to the daemon with its
//!   `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` and
//!   `CUDA_VISIBLE_DEVICES`, and must see the server's shared memory in its own `/dev/shm`.
//!
//! It is at least as strict as the real one (README.md beside this file lists each behaviour, its
//! source, and what was assumed where NVIDIA's documentation is silent). Every command the daemon
//! receives is recorded in `control.log` as a line `CMD <command>`.

mod attach;
mod client;
mod daemon;
mod paths;

use std::process::ExitCode;

const USAGE: &str = "usage: nvidia-cuda-mps-control [-d | -f] [-M]
  (no option)   read commands from stdin and send them to the running daemon
  -d            start the control daemon in the background
  -f            start the control daemon in the foreground
  -M, --multiuser-server
                one server for the clients of every user (they appear as root)
  --standin-cuda-client [--hold-ms N]
                (stand-in only) attach as a CUDA client would, print a JSON line";

fn main() -> ExitCode {
    let argv0 = std::env::args().next().unwrap_or_default();
    if std::path::Path::new(&argv0).file_name() == Some(std::ffi::OsStr::new(paths::SERVER_NAME)) {
        daemon::server_main();
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (mut background, mut foreground, mut multi_user) = (false, false, false);
    let mut iter = args.iter();
    while let Some(arg) = iter.next() {
        match arg.as_str() {
            "-d" => background = true,
            "-f" => foreground = true,
            "-M" | "--multiuser-server" => multi_user = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            "--standin-cuda-client" => {
                let hold_ms = match (iter.next().map(String::as_str), iter.next()) {
                    (None, _) => 0,
                    (Some("--hold-ms"), Some(ms)) => match ms.parse() {
                        Ok(ms) => ms,
                        Err(_) => return usage_error(&format!("--hold-ms {ms}: not a number")),
                    },
                    (Some(other), _) => return usage_error(&format!("unexpected {other}")),
                };
                return attach::client_main(hold_ms);
            }
            other => return usage_error(&format!("unrecognized option '{other}'")),
        }
    }
    match (background, foreground) {
        (true, true) => usage_error("-d and -f exclude each other"),
        (true, false) | (false, true) => daemon::daemon_main(background, multi_user),
        (false, false) if multi_user => usage_error("-M starts a daemon: give -d or -f"),
        (false, false) => client::utility_main(),
    }
}

fn usage_error(message: &str) -> ExitCode {
    eprintln!("nvidia-cuda-mps-control: {message}\n{USAGE}");
    ExitCode::FAILURE
}

//! The control utility: each line of stdin is one command for the running daemon; its answer goes
//! to stdout. No daemon: "Cannot find MPS control daemon process" and exit status 1. A command the
//! daemon refuses: its message on stderr and exit status 1 once stdin is done.

use std::io::{BufRead, Read, Write};
use std::os::unix::net::UnixStream;
use std::process::ExitCode;

use crate::paths::{Dirs, NO_DAEMON};

pub fn utility_main() -> ExitCode {
    let dirs = Dirs::from_env();
    let mut failed = false;
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let command = line.trim();
        if command.is_empty() {
            continue;
        }
        let Ok(mut stream) = UnixStream::connect(dirs.socket()) else {
            println!("{NO_DAEMON}");
            return ExitCode::FAILURE;
        };
        let mut reply = String::new();
        let sent = stream
            .write_all(format!("{command}\n").as_bytes())
            .and_then(|()| stream.shutdown(std::net::Shutdown::Write))
            .and_then(|()| stream.read_to_string(&mut reply));
        if sent.is_err() {
            println!("{NO_DAEMON}");
            return ExitCode::FAILURE;
        }
        match reply.split_once('\n') {
            Some(("OK", output)) => print!("{output}"),
            _ => {
                let message = reply.trim().strip_prefix("ERR ").unwrap_or(reply.trim());
                eprintln!("{message}");
                failed = true;
            }
        }
    }
    let _ = std::io::stdout().flush();
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

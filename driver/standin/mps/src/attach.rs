//! What `libcuda` does when a process in MPS's reach starts CUDA, as far as the driver's part goes:
//! it reaches the daemon through `$CUDA_MPS_PIPE_DIRECTORY/control` (or runs without MPS when
//! nothing answers there), is given a server, and must see that server's shared memory in its own
//! `/dev/shm`. Prints one JSON line saying what it got.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::ExitCode;

use crate::paths::Dirs;

/// The variables a client hands its server.
const PASSED: &[&str] = &[
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
    "CUDA_VISIBLE_DEVICES",
];

fn json_string(value: &str) -> String {
    let mut out = String::from("\"");
    for c in value.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn without_mps(reason: &str) -> ExitCode {
    println!(
        "{{\"op\": \"client\", \"mps\": false, \"reason\": {}}}",
        json_string(reason)
    );
    ExitCode::SUCCESS
}

fn refused(reason: &str) -> ExitCode {
    println!(
        "{{\"op\": \"client\", \"mps\": false, \"error\": {}}}",
        json_string(reason)
    );
    ExitCode::FAILURE
}

fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

pub fn client_main(hold_ms: u64) -> ExitCode {
    let dirs = Dirs::from_env();
    let socket = dirs.socket();
    let Ok(mut stream) = UnixStream::connect(&socket) else {
        // A CUDA process that finds no daemon runs without MPS, time-sliced beside its servers.
        return without_mps(&format!("no MPS control daemon at {}", socket.display()));
    };
    let mut hello = String::from("client\n");
    for name in PASSED {
        if let Ok(value) = std::env::var(name) {
            hello.push_str(&format!("{name}={value}\n"));
        }
    }
    hello.push('\n');
    if let Err(e) = stream.write_all(hello.as_bytes()) {
        return refused(&format!("writing to {}: {e}", socket.display()));
    }
    let mut reader = BufReader::new(match stream.try_clone() {
        Ok(s) => s,
        Err(e) => return refused(&e.to_string()),
    });
    let mut reply = String::new();
    if reader.read_line(&mut reply).is_err() || reply.is_empty() {
        return refused("the daemon closed the connection");
    }
    let words: Vec<&str> = reply.split_whitespace().collect();
    let ["ATTACHED", server, percentage] = words.as_slice() else {
        return refused(reply.trim());
    };
    let (mut shm, mut daemon_pipe) = (String::new(), String::new());
    if reader.read_line(&mut shm).is_err() || reader.read_line(&mut daemon_pipe).is_err() {
        return refused("the daemon closed the connection");
    }
    let (shm, daemon_pipe) = (shm.trim_end(), daemon_pipe.trim_end());
    if !Path::new(shm).exists() {
        return refused(&format!(
            "the MPS server's shared memory {shm} is not in this process's /dev/shm: \
             it must be the control daemon's"
        ));
    }
    // The server's sockets are named after the daemon's pipe folder: the client must find the
    // same folder under that name.
    if !same_file(
        &Path::new(daemon_pipe).join(crate::paths::CONTROL_SOCKET),
        &socket,
    ) {
        return refused(&format!(
            "the daemon's pipe folder {daemon_pipe} is not where this process reaches it ({}): \
             its servers' sockets are named after it",
            dirs.pipe.display()
        ));
    }
    std::thread::sleep(std::time::Duration::from_millis(hold_ms));
    println!(
        "{{\"op\": \"client\", \"mps\": true, \"server\": {server}, \"activeThreadPercentage\": {percentage}, \
         \"pipeDirectory\": {}, \"pid\": {}}}",
        json_string(&dirs.pipe.display().to_string()),
        std::process::id()
    );
    drop(stream);
    ExitCode::SUCCESS
}

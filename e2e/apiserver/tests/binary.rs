//! The `gpupool-apiserver` binary: serves on the asked port, writes a kubeconfig, stops on SIGTERM.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn http_get(addr: &str, path: &str) -> std::io::Result<String> {
    let mut stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    Ok(response)
}

#[test]
fn binary_serves_until_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    let mut child = Command::new(env!("CARGO_BIN_EXE_gpupool-apiserver"))
        .arg("--kubeconfig-out")
        .arg(&kubeconfig)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut url = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut url)
        .unwrap();
    let addr = url
        .trim()
        .strip_prefix("http://")
        .expect("the binary prints its URL")
        .to_string();

    let config = std::fs::read_to_string(&kubeconfig).unwrap();
    assert!(
        config.contains(&format!("server: http://{addr}")),
        "{config}"
    );
    assert!(
        config.contains("current-context: gpupool-emulator"),
        "{config}"
    );
    let version = http_get(&addr, "/version").unwrap();
    assert!(version.starts_with("HTTP/1.1 200"), "{version}");
    assert!(version.contains("\"gitVersion\""), "{version}");

    // SAFETY: kill(2) on the child process this test started.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "the binary did not stop on SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status:?}");
    assert!(
        http_get(&addr, "/version").is_err(),
        "nothing serves after SIGTERM"
    );
}

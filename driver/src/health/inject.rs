//! `gpupool-driver inject-xid`: an operator (or a test) tells the running driver that a card raised
//! an XID, was lost, or was reset (`clear`). The driver listens on `<run-dir>/health.sock` (0600:
//! whoever can write to it can take cards out of service) and hands each command to the
//! [`super::monitor`] as if NVML had reported it.
//!
//! Wire format, one exchange per connection: `<device> <xid|lost|clear>\n`, answered by
//! `ok <what changed>\n` or `error <why>\n`.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::monitor::Report;
use super::Observation;
use crate::plugin::server::{bind, ServerError};

pub const SOCKET_FILE: &str = "health.sock";
/// Longer than any valid command: a client sending more is cut off, not buffered.
const MAX_LINE: u64 = 256;
const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);

pub fn socket_path(run_dir: &Path) -> PathBuf {
    run_dir.join(SOCKET_FILE)
}

/// `gpu-<index>`, the only device names this driver publishes.
fn valid_device(device: &str) -> bool {
    device
        .strip_prefix("gpu-")
        .is_some_and(|n| !n.is_empty() && n.len() <= 5 && n.bytes().all(|b| b.is_ascii_digit()))
}

/// The observation a command stands for; the reason when it is not one.
pub fn parse(device: &str, what: &str) -> Result<Observation, String> {
    if !valid_device(device) {
        return Err(format!(
            "{device:?} is not a device name of this driver (gpu-<index>, e.g. gpu-0)"
        ));
    }
    let device = device.to_string();
    match what {
        "clear" => Ok(Observation::Clear { device }),
        "lost" => Ok(Observation::Lost {
            device,
            detail: "reported with inject-xid".into(),
        }),
        number => match number.parse::<u32>() {
            Ok(xid) if (1..=u32::from(u16::MAX)).contains(&xid) => {
                Ok(Observation::Xid { device, xid })
            }
            _ => Err(format!(
                "{number:?} is not an XID (1..65535), \"lost\" or \"clear\""
            )),
        },
    }
}

/// Serves the socket until `stop`.
pub fn serve(
    run_dir: &Path,
    reports: mpsc::Sender<Report>,
    stop: CancellationToken,
) -> Result<JoinHandle<()>, ServerError> {
    let path = socket_path(run_dir);
    let listener = bind(&path)?;
    let inode = std::fs::metadata(&path).map(|m| m.ino()).ok();
    tracing::info!(path = %path.display(), "listening for inject-xid");
    Ok(tokio::spawn(async move {
        loop {
            let stream = tokio::select! {
                _ = stop.cancelled() => break,
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        tracing::warn!(error = %e, "inject-xid socket accept failed");
                        continue;
                    }
                },
            };
            let reports = reports.clone();
            tokio::spawn(async move {
                if let Err(e) = answer(stream, reports).await {
                    tracing::debug!(error = %e, "inject-xid connection");
                }
            });
        }
        // During a rolling update the new instance has bound its own socket at this path: leave it.
        if std::fs::metadata(&path).map(|m| m.ino()).ok() == inode {
            let _ = std::fs::remove_file(&path);
        }
    }))
}

async fn answer(
    stream: tokio::net::UnixStream,
    reports: mpsc::Sender<Report>,
) -> std::io::Result<()> {
    let (read, mut write) = stream.into_split();
    let mut line = String::new();
    tokio::io::BufReader::new(read.take(MAX_LINE))
        .read_line(&mut line)
        .await?;
    let outcome = match line.split_whitespace().collect::<Vec<_>>()[..] {
        [device, what] => match parse(device, what) {
            Ok(observation) => {
                tracing::info!(command = line.trim(), "inject-xid");
                let (reply, answer) = oneshot::channel();
                let sent = reports
                    .send(Report {
                        observation,
                        reply: Some(reply),
                    })
                    .await;
                match sent {
                    Ok(()) => answer
                        .await
                        .unwrap_or_else(|_| Err("the driver is stopping".into())),
                    Err(_) => Err("the driver is stopping".into()),
                }
            }
            Err(e) => Err(e),
        },
        _ => Err("expected \"<device> <xid|lost|clear>\"".into()),
    };
    let text = match outcome {
        Ok(text) => format!("ok {text}\n"),
        Err(text) => format!("error {}\n", text.replace('\n', " ")),
    };
    write.write_all(text.as_bytes()).await?;
    write.shutdown().await
}

/// The client side: sends one command to the driver serving `run_dir` and returns its answer.
pub fn send(run_dir: &Path, device: &str, what: &str) -> anyhow::Result<String> {
    use anyhow::Context;
    parse(device, what).map_err(anyhow::Error::msg)?;
    let path = socket_path(run_dir);
    let mut stream = std::os::unix::net::UnixStream::connect(&path).with_context(|| {
        format!(
            "connecting to {} (is gpupool-driver running with --run-dir {}?)",
            path.display(),
            run_dir.display()
        )
    })?;
    stream.set_read_timeout(Some(CLIENT_TIMEOUT))?;
    stream.set_write_timeout(Some(CLIENT_TIMEOUT))?;
    stream.write_all(format!("{device} {what}\n").as_bytes())?;
    let mut reply = String::new();
    BufReader::new(&stream)
        .read_line(&mut reply)
        .context("reading the driver's answer")?;
    let reply = reply.trim_end();
    match reply.split_once(' ') {
        Some(("ok", text)) => Ok(text.to_string()),
        Some(("error", text)) => Err(anyhow::anyhow!("{text}")),
        _ => Err(anyhow::anyhow!(
            "unexpected answer from the driver: {reply:?}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::health::monitor::{channel, Monitor};
    use crate::health::{HealthMap, XidPolicy};
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn only_device_names_and_xids_pass() {
        assert_eq!(
            parse("gpu-0", "79").unwrap(),
            Observation::Xid {
                device: "gpu-0".into(),
                xid: 79
            }
        );
        assert!(matches!(
            parse("gpu-12", "clear").unwrap(),
            Observation::Clear { .. }
        ));
        assert!(matches!(
            parse("gpu-1", "lost").unwrap(),
            Observation::Lost { .. }
        ));
        for (device, what) in [
            ("gpu-0", "0"),
            ("gpu-0", "-1"),
            ("gpu-0", "70000"),
            ("gpu-0", "xid"),
            ("gpu-", "79"),
            ("../gpu-0", "79"),
            ("gpu-0\n", "79"),
            ("gpu-0 gpu-1", "79"),
            ("GPU-0", "79"),
        ] {
            assert!(parse(device, what).is_err(), "{device:?} {what:?}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_command_over_the_socket_goes_through_the_monitor() {
        let dir = tempfile::tempdir().unwrap();
        let (monitor, published) = Monitor::new(
            "node-a",
            XidPolicy::default(),
            HealthMap::new(["gpu-0".to_string()]),
            None,
            None,
        );
        let (tx, rx) = channel();
        let stop = CancellationToken::new();
        tokio::spawn(monitor.run(rx, stop.clone()));
        let server = serve(dir.path(), tx, stop.clone()).unwrap();
        let mode = std::fs::metadata(socket_path(dir.path()))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);

        let run_dir = dir.path().to_path_buf();
        let answer = tokio::task::spawn_blocking(move || send(&run_dir, "gpu-0", "79"))
            .await
            .unwrap()
            .unwrap();
        assert!(answer.contains("gpupool.dev/xid=79"), "{answer}");
        assert_eq!(published.borrow().taints("gpu-0").len(), 1);

        let run_dir = dir.path().to_path_buf();
        let err = tokio::task::spawn_blocking(move || send(&run_dir, "gpu-3", "79"))
            .await
            .unwrap()
            .unwrap_err();
        assert!(err.to_string().contains("no device gpu-3"), "{err}");

        stop.cancel();
        server.await.unwrap();
        assert!(!socket_path(dir.path()).exists());
    }
}

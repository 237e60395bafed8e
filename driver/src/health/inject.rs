//! `gpupool-driver inject-xid`: an operator (or a test) tells the running driver that a card raised
//! an XID, was lost, or was reset (`clear`). The driver listens on `<run-dir>/health.sock`, or
//! `health-<pod UID>.sock` with a pod UID (two instances overlap in a rolling update and must not
//! take each other's socket), mode 0600 (whoever can write to it can take cards out of service),
//! and hands each command to the [`super::monitor`] as if NVML had reported it. The client tells
//! every instance serving the run folder, since each publishes the node's slices and their taints.
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

/// Longer than any valid command: a client sending more is cut off, not buffered.
const MAX_LINE: u64 = 256;
const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);

/// This instance's socket: `health.sock`, or `health-<pod UID>.sock` with a pod UID.
pub fn socket_path(run_dir: &Path, pod_uid: Option<&str>) -> PathBuf {
    run_dir.join(match pod_uid {
        Some(uid) => format!("health-{uid}.sock"),
        None => "health.sock".to_string(),
    })
}

/// Whether `name` is one of the names [`socket_path`] gives.
pub fn is_socket_name(name: &str) -> bool {
    name == "health.sock"
        || name
            .strip_prefix("health-")
            .and_then(|rest| rest.strip_suffix(".sock"))
            .is_some_and(|uid| {
                !uid.is_empty() && uid.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
            })
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

/// Serves this instance's socket until `stop`.
pub fn serve(
    run_dir: &Path,
    pod_uid: Option<&str>,
    reports: mpsc::Sender<Report>,
    stop: CancellationToken,
) -> Result<JoinHandle<()>, ServerError> {
    let path = socket_path(run_dir, pod_uid);
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
        // A later instance with the same name (a restart without a pod UID) may have bound its own
        // socket at this path meanwhile: leave that one.
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

/// The client side: sends one command to every driver instance serving `run_dir` (one, or two
/// during a rolling update) and returns their answers, one line each.
pub fn send(run_dir: &Path, device: &str, what: &str) -> anyhow::Result<String> {
    use anyhow::Context;
    parse(device, what).map_err(anyhow::Error::msg)?;
    let mut sockets: Vec<PathBuf> = std::fs::read_dir(run_dir)
        .with_context(|| format!("reading the run folder {}", run_dir.display()))?
        .flatten()
        .filter(|e| e.file_name().to_str().is_some_and(is_socket_name))
        .map(|e| e.path())
        .collect();
    sockets.sort();
    let mut answers = Vec::new();
    for path in sockets {
        let stream = match std::os::unix::net::UnixStream::connect(&path) {
            Ok(stream) => stream,
            // Left by an instance that was killed; nobody listens.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => continue,
            Err(e) => return Err(e).with_context(|| format!("connecting to {}", path.display())),
        };
        answers.push(exchange(stream, device, what).with_context(|| path.display().to_string())?);
    }
    if answers.is_empty() {
        anyhow::bail!(
            "no gpupool-driver listens in {} (is it running with --run-dir {}?)",
            run_dir.display(),
            run_dir.display()
        );
    }
    Ok(answers.join("\n"))
}

/// One command over one connection.
fn exchange(
    mut stream: std::os::unix::net::UnixStream,
    device: &str,
    what: &str,
) -> anyhow::Result<String> {
    use anyhow::Context;
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
        let server = serve(dir.path(), None, tx, stop.clone()).unwrap();
        let mode = std::fs::metadata(socket_path(dir.path(), None))
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
        assert!(format!("{err:#}").contains("no device gpu-3"), "{err:#}");

        stop.cancel();
        server.await.unwrap();
        assert!(!socket_path(dir.path(), None).exists());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_instances_each_have_a_socket_and_both_hear_a_command() {
        let dir = tempfile::tempdir().unwrap();
        let stop = CancellationToken::new();
        let mut published = Vec::new();
        let mut servers = Vec::new();
        for uid in ["old-pod", "new-pod"] {
            let (monitor, health) = Monitor::new(
                "node-a",
                XidPolicy::default(),
                HealthMap::new(["gpu-0".to_string()]),
                None,
                None,
            );
            let (tx, rx) = channel();
            tokio::spawn(monitor.run(rx, stop.clone()));
            servers.push(serve(dir.path(), Some(uid), tx, stop.clone()).unwrap());
            published.push(health);
        }
        // A socket left by a killed instance is skipped, not an error.
        drop(
            std::os::unix::net::UnixListener::bind(dir.path().join("health-killed.sock")).unwrap(),
        );

        let run_dir = dir.path().to_path_buf();
        let answer = tokio::task::spawn_blocking(move || send(&run_dir, "gpu-0", "79"))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(answer.lines().count(), 2, "{answer}");
        for health in &published {
            assert_eq!(health.borrow().taints("gpu-0").len(), 1);
        }
        stop.cancel();
        for server in servers {
            server.await.unwrap();
        }
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(left, ["health-killed.sock"], "each removed its own socket");
        assert!(is_socket_name("health-3f1a-b2.sock") && is_socket_name("health.sock"));
        assert!(!is_socket_name("health-.sock") && !is_socket_name("health-a/b.sock"));
    }
}

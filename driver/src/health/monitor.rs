//! The one place observations become state: applies each [`Report`] to the node's [`HealthMap`],
//! publishes the new map (the slice publisher and the kubelet's health stream watch it), keeps
//! the faults in the run folder, logs, and posts a Node Event for each change worth one.
//!
//! NVML events, the probe and `inject-xid` all go through here, so a rehearsal on fake GPUs takes
//! the path a real XID takes.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use k8s_openapi::api::core::v1::Event;
use k8s_openapi::jiff::Timestamp;
use kube::api::PostParams;
use kube::Api;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;

use super::{HealthMap, Observation, Transition, XidClass, XidPolicy};

/// Where the faults are kept in `--run-dir`: a driver restart keeps them, a reboot (which resets
/// the cards) does not.
pub const STATE_FILE: &str = "device-health.json";
/// Reports waiting to be applied; a detector that outruns this waits.
const QUEUE: usize = 64;

/// One observation and, for `inject-xid`, where the outcome goes.
#[derive(Debug)]
pub struct Report {
    pub observation: Observation,
    pub reply: Option<oneshot::Sender<Result<String, String>>>,
}

pub fn channel() -> (mpsc::Sender<Report>, mpsc::Receiver<Report>) {
    mpsc::channel(QUEUE)
}

pub struct Monitor {
    node: String,
    policy: XidPolicy,
    state: HealthMap,
    published: watch::Sender<HealthMap>,
    events: Option<Api<Event>>,
    state_file: Option<PathBuf>,
}

/// The faults saved by an earlier run, if any could be read.
pub fn load(run_dir: &Path) -> Option<HealthMap> {
    let path = run_dir.join(STATE_FILE);
    let text = std::fs::read_to_string(&path).ok()?;
    match serde_json::from_str(&text) {
        Ok(map) => Some(map),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "ignoring unreadable device health state");
            None
        }
    }
}

fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or_default()
}

impl Monitor {
    /// `events`: where Node Events go (none in tests); `run_dir`: where the faults are kept.
    pub fn new(
        node: impl Into<String>,
        policy: XidPolicy,
        initial: HealthMap,
        events: Option<Api<Event>>,
        run_dir: Option<&Path>,
    ) -> (Self, watch::Receiver<HealthMap>) {
        let (published, rx) = watch::channel(initial.clone());
        for (device, record) in initial.iter() {
            for fault in &record.faults {
                tracing::warn!(device, fault = %fault.fault, message = %fault.message, "device still tainted from before the restart");
            }
        }
        (
            Self {
                node: node.into(),
                policy,
                state: initial,
                published,
                events,
                state_file: run_dir.map(|d| d.join(STATE_FILE)),
            },
            rx,
        )
    }

    /// Applies reports until `stop` or until every sender is gone.
    pub async fn run(mut self, mut reports: mpsc::Receiver<Report>, stop: CancellationToken) {
        loop {
            let report = tokio::select! {
                _ = stop.cancelled() => return,
                report = reports.recv() => match report {
                    Some(r) => r,
                    None => return,
                },
            };
            let outcome = self.handle(report.observation);
            if let Some(reply) = report.reply {
                let _ = reply.send(outcome);
            }
        }
    }

    fn handle(&mut self, observation: Observation) -> Result<String, String> {
        let transition = self
            .state
            .apply(observation, &self.policy, unix_now())
            .map_err(|e| e.to_string())?;
        self.log(&transition);
        if !matches!(
            transition,
            Transition::Unchanged { .. } | Transition::Counted { .. }
        ) {
            self.published.send_replace(self.state.clone());
            self.save();
        }
        if let (Some(text), Some(api)) = (transition.node_event(), &self.events) {
            let mut event = crate::prepare::status::node_event(
                &self.node,
                "CheckHealth",
                text.reason,
                &text.message,
                Timestamp::now(),
            );
            if !text.warning {
                event.type_ = Some("Normal".into());
            }
            // The API may be slow or down: the taint and the health stream must not wait for it.
            let api = api.clone();
            tokio::spawn(async move {
                if let Err(e) = api.create(&PostParams::default(), &event).await {
                    tracing::warn!(error = %e, reason = ?event.reason, "could not post the Node Event");
                }
            });
        }
        Ok(transition.describe())
    }

    fn log(&self, transition: &Transition) {
        match transition {
            Transition::Tainted {
                device,
                fault,
                message,
            } => {
                tracing::warn!(device, %fault, message, "GPU fault: tainting the device NoSchedule")
            }
            Transition::Recovered { device, cleared } => {
                tracing::info!(device, cleared = ?cleared, "GPU healthy again: taints removed")
            }
            Transition::Unknown { device, reason } => {
                tracing::warn!(device, reason, "NVML cannot read the GPU: health Unknown")
            }
            Transition::Counted {
                device,
                xid,
                class: XidClass::Application,
                count,
            } => tracing::info!(
                device,
                xid,
                count,
                "application XID: not the card's fault, no taint"
            ),
            Transition::Counted {
                device, xid, count, ..
            } => tracing::warn!(
                device,
                xid,
                count,
                "XID in neither --xid-fatal nor --xid-ignore: counted, no taint"
            ),
            Transition::Unchanged { device } => tracing::debug!(device, "device health unchanged"),
        }
    }

    /// Writes the faults beside the claims' run state (temp file + rename, so a crash leaves the
    /// old or the new file, never half of one).
    fn save(&self) {
        let Some(path) = &self.state_file else {
            return;
        };
        let write = || -> std::io::Result<()> {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)?;
            }
            let tmp = path.with_extension("json.tmp");
            std::fs::write(&tmp, serde_json::to_vec(&self.state)?)?;
            std::fs::rename(&tmp, path)
        };
        if let Err(e) = write() {
            tracing::warn!(path = %path.display(), error = %e, "could not save device health; a restart would lose the taints");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn xid(device: &str, xid: u32) -> Observation {
        Observation::Xid {
            device: device.into(),
            xid,
        }
    }

    async fn send(tx: &mpsc::Sender<Report>, observation: Observation) -> Result<String, String> {
        let (reply, answer) = oneshot::channel();
        tx.send(Report {
            observation,
            reply: Some(reply),
        })
        .await
        .unwrap();
        answer.await.unwrap()
    }

    #[tokio::test]
    async fn reports_change_the_published_map_and_survive_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let devices = || HealthMap::new(["gpu-0".to_string(), "gpu-1".to_string()]);
        let (monitor, mut published) = Monitor::new(
            "node-a",
            XidPolicy::default(),
            devices(),
            None,
            Some(dir.path()),
        );
        let (tx, rx) = channel();
        let stop = CancellationToken::new();
        let task = tokio::spawn(monitor.run(rx, stop.clone()));

        let answer = send(&tx, xid("gpu-0", 79)).await.unwrap();
        assert!(answer.contains("gpupool.dev/xid=79"), "{answer}");
        assert!(published.has_changed().unwrap());
        assert_eq!(published.borrow_and_update().taints("gpu-0").len(), 1);

        // An application XID is answered but publishes nothing new.
        let answer = send(&tx, xid("gpu-1", 13)).await.unwrap();
        assert!(answer.contains("not tainted"), "{answer}");
        assert!(!published.has_changed().unwrap());

        let err = send(&tx, xid("gpu-9", 79)).await.unwrap_err();
        assert!(err.contains("gpu-9"), "{err}");

        stop.cancel();
        task.await.unwrap();

        // A new driver process on the same node starts with the taint.
        let restored = devices().restored_from(&load(dir.path()).unwrap());
        assert_eq!(restored.taints("gpu-0").len(), 1);
        assert!(restored.taints("gpu-1").is_empty());
    }
}

//! DRA resource health (v1alpha1): a stream of the complete device list, sent when the kubelet opens
//! it, whenever the list changes, and every [`REFRESH_INTERVAL`] without a change: the kubelet
//! marks a device `Unknown` once its last report is older than the report's
//! `health_check_timeout_seconds` (30 s when 0), so a stream that only speaks on change turns every
//! pod's device health to Unknown half a minute after it started. Every device present is
//! reported HEALTHY.

use std::pin::Pin;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::Stream;
use gpupool_proto::health_v1alpha1 as health;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

/// How often the complete list is sent again when nothing changed.
pub const REFRESH_INTERVAL: Duration = Duration::from_secs(10);
/// How long the kubelet may go without a report before it shows the device `Unknown`: three
/// refreshes, so one late report is not a flap.
pub const HEALTH_CHECK_TIMEOUT: Duration = Duration::from_secs(30);

/// Serves `v1alpha1.DRAResourceHealth` for the devices of one pool.
#[derive(Clone)]
pub struct HealthService {
    pool_name: String,
    devices: watch::Receiver<Vec<String>>,
    stop: CancellationToken,
}

impl HealthService {
    /// `devices`: names of the devices present now; streams end when `stop` is cancelled so that a
    /// graceful shutdown is not held up by the kubelet's long-lived watch.
    pub fn new(
        pool_name: impl Into<String>,
        devices: watch::Receiver<Vec<String>>,
        stop: CancellationToken,
    ) -> Self {
        Self {
            pool_name: pool_name.into(),
            devices,
            stop,
        }
    }

    pub fn into_server(self) -> health::dra_resource_health_server::DraResourceHealthServer<Self> {
        health::dra_resource_health_server::DraResourceHealthServer::new(self)
    }
}

/// The full health report for `devices`, all HEALTHY at `now` (unix seconds).
pub fn report(pool_name: &str, devices: &[String], now: i64) -> health::NodeWatchResourcesResponse {
    health::NodeWatchResourcesResponse {
        devices: devices
            .iter()
            .map(|name| health::DeviceHealth {
                device: Some(health::DeviceIdentifier {
                    pool_name: pool_name.to_string(),
                    device_name: name.clone(),
                }),
                health: health::HealthStatus::Healthy as i32,
                last_updated_time: now,
                health_check_timeout_seconds: HEALTH_CHECK_TIMEOUT.as_secs() as i64,
                message: String::new(),
            })
            .collect(),
    }
}

fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or_default()
}

type ReportStream =
    Pin<Box<dyn Stream<Item = Result<health::NodeWatchResourcesResponse, Status>> + Send>>;

#[tonic::async_trait]
impl health::dra_resource_health_server::DraResourceHealth for HealthService {
    type NodeWatchResourcesStream = ReportStream;

    async fn node_watch_resources(
        &self,
        _request: Request<health::NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        let stream = reports(
            self.pool_name.clone(),
            self.devices.clone(),
            self.stop.clone(),
            REFRESH_INTERVAL,
        );
        Ok(Response::new(Box::pin(stream)))
    }
}

/// The current list at once, then one report per change or per `refresh`, until `stop`.
fn reports(
    pool: String,
    devices: watch::Receiver<Vec<String>>,
    stop: CancellationToken,
    refresh: Duration,
) -> impl Stream<Item = Result<health::NodeWatchResourcesResponse, Status>> + Send {
    // State: (receiver, first report still to send).
    futures::stream::unfold((devices, true), move |(mut devices, first)| {
        let pool = pool.clone();
        let stop = stop.clone();
        async move {
            if !first {
                tokio::select! {
                    _ = stop.cancelled() => return None,
                    changed = devices.changed() => changed.ok()?,
                    _ = tokio::time::sleep(refresh) => {}
                }
            }
            let current = devices.borrow_and_update().clone();
            Some((Ok(report(&pool, &current, unix_now())), (devices, false)))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_lists_every_device_healthy() {
        let r = report("node-1", &["gpu-0".into(), "gpu-1".into()], 1_700_000_000);
        assert_eq!(r.devices.len(), 2);
        for (d, name) in r.devices.iter().zip(["gpu-0", "gpu-1"]) {
            let id = d.device.as_ref().unwrap();
            assert_eq!(
                (id.pool_name.as_str(), id.device_name.as_str()),
                ("node-1", name)
            );
            assert_eq!(d.health, health::HealthStatus::Healthy as i32);
            assert_eq!(d.last_updated_time, 1_700_000_000);
            assert_eq!(d.health_check_timeout_seconds, 30);
        }
    }

    #[tokio::test]
    async fn the_list_is_sent_again_before_the_kubelet_would_call_it_unknown() {
        use futures::StreamExt;
        // The real interval, scaled down 200 times.
        let refresh = REFRESH_INTERVAL / 200;
        let (tx, rx) = watch::channel(vec!["gpu-0".to_string()]);
        let stop = CancellationToken::new();
        let mut stream = Box::pin(reports("node-1".into(), rx, stop.clone(), refresh));
        assert_eq!(stream.next().await.unwrap().unwrap().devices.len(), 1);
        // Nothing changes: reports keep coming, one per interval.
        let started = std::time::Instant::now();
        for _ in 0..3 {
            let report = stream.next().await.unwrap().unwrap();
            assert_eq!(report.devices.len(), 1);
        }
        let elapsed = started.elapsed();
        assert!(elapsed >= refresh * 3, "{elapsed:?}");
        // A change is reported with the new list.
        tx.send_replace(vec!["gpu-0".to_string(), "gpu-1".to_string()]);
        assert_eq!(stream.next().await.unwrap().unwrap().devices.len(), 2);
        stop.cancel();
        assert!(stream.next().await.is_none());
        assert!(REFRESH_INTERVAL * 3 <= HEALTH_CHECK_TIMEOUT);
    }
}

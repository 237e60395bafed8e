//! DRA resource health (`v1` and `v1alpha1`, the same messages): a stream of the complete device
//! list, sent when the kubelet opens it, whenever a device's health changes, and every
//! [`REFRESH_INTERVAL`] without a change: the kubelet marks a device `Unknown` once its last report
//! is older than the report's `health_check_timeout_seconds` (30 s when 0), so a stream that only
//! speaks on change turns every pod's device health to Unknown half a minute after it started.
//! A tainted device is UNHEALTHY with its faults in the message, one NVML cannot read UNKNOWN.

use std::pin::Pin;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::Stream;
use gpupool_proto::health_v1 as v1;
use gpupool_proto::health_v1alpha1 as health;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::health::{DeviceHealth, HealthMap};

/// How often the complete list is sent again when nothing changed.
pub const REFRESH_INTERVAL: Duration = Duration::from_secs(10);
/// How long the kubelet may go without a report before it shows the device `Unknown`: three
/// refreshes, so one late report is not a flap.
pub const HEALTH_CHECK_TIMEOUT: Duration = Duration::from_secs(30);

/// Serves `v1.DRAResourceHealth` and `v1alpha1.DRAResourceHealth` for the devices of one pool.
#[derive(Clone)]
pub struct HealthService {
    pool_name: String,
    devices: watch::Receiver<HealthMap>,
    stop: CancellationToken,
}

impl HealthService {
    /// `devices`: every device present now, with its health; streams end when `stop` is cancelled
    /// so that a graceful shutdown is not held up by the kubelet's long-lived watch.
    pub fn new(
        pool_name: impl Into<String>,
        devices: watch::Receiver<HealthMap>,
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

    pub fn into_v1_server(self) -> v1::dra_resource_health_server::DraResourceHealthServer<Self> {
        v1::dra_resource_health_server::DraResourceHealthServer::new(self)
    }

    fn stream(
        &self,
    ) -> impl Stream<Item = Result<health::NodeWatchResourcesResponse, Status>> + Send {
        reports(
            self.pool_name.clone(),
            self.devices.clone(),
            self.stop.clone(),
            REFRESH_INTERVAL,
        )
    }
}

/// The full health report for `devices` at `now` (unix seconds).
pub fn report(
    pool_name: &str,
    devices: &HealthMap,
    now: i64,
) -> health::NodeWatchResourcesResponse {
    health::NodeWatchResourcesResponse {
        devices: devices
            .iter()
            .map(|(name, record)| {
                let (status, message) = match record.health() {
                    DeviceHealth::Healthy => (health::HealthStatus::Healthy, String::new()),
                    DeviceHealth::Unhealthy { message, .. } => {
                        (health::HealthStatus::Unhealthy, message)
                    }
                    DeviceHealth::Unknown { reason } => (health::HealthStatus::Unknown, reason),
                };
                health::DeviceHealth {
                    device: Some(health::DeviceIdentifier {
                        pool_name: pool_name.to_string(),
                        device_name: name.to_string(),
                    }),
                    health: status as i32,
                    last_updated_time: now,
                    health_check_timeout_seconds: HEALTH_CHECK_TIMEOUT.as_secs() as i64,
                    message,
                }
            })
            .collect(),
    }
}

/// The same report in `v1` (field for field: the two packages share their messages).
pub fn to_v1(report: health::NodeWatchResourcesResponse) -> v1::NodeWatchResourcesResponse {
    v1::NodeWatchResourcesResponse {
        devices: report
            .devices
            .into_iter()
            .map(|d| v1::DeviceHealth {
                device: d.device.map(|id| v1::DeviceIdentifier {
                    pool_name: id.pool_name,
                    device_name: id.device_name,
                }),
                health: d.health,
                last_updated_time: d.last_updated_time,
                health_check_timeout_seconds: d.health_check_timeout_seconds,
                message: d.message,
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
        Ok(Response::new(Box::pin(self.stream())))
    }
}

type ReportStreamV1 =
    Pin<Box<dyn Stream<Item = Result<v1::NodeWatchResourcesResponse, Status>> + Send>>;

#[tonic::async_trait]
impl v1::dra_resource_health_server::DraResourceHealth for HealthService {
    type NodeWatchResourcesStream = ReportStreamV1;

    async fn node_watch_resources(
        &self,
        _request: Request<v1::NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        use futures::StreamExt;
        Ok(Response::new(Box::pin(self.stream().map(|r| r.map(to_v1)))))
    }
}

/// The current list at once, then one report per change or per `refresh`, until `stop`.
fn reports(
    pool: String,
    devices: watch::Receiver<HealthMap>,
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

    fn devices(names: &[&str]) -> HealthMap {
        HealthMap::new(names.iter().map(|n| n.to_string()))
    }

    #[test]
    fn report_lists_every_device_healthy() {
        let r = report("node-1", &devices(&["gpu-0", "gpu-1"]), 1_700_000_000);
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

    #[test]
    fn a_tainted_device_is_unhealthy_naming_the_xid_and_an_unreadable_one_unknown() {
        use crate::health::{Observation, XidPolicy};
        let mut map = devices(&["gpu-0", "gpu-1", "gpu-2"]);
        let policy = XidPolicy::default();
        let xid = Observation::Xid {
            device: "gpu-0".into(),
            xid: 79,
        };
        map.apply(xid, &policy, 1).unwrap();
        let unreadable = Observation::Unreadable {
            device: "gpu-2".into(),
            reason: "NVML: Unknown Error".into(),
        };
        map.apply(unreadable, &policy, 1).unwrap();
        let r = report("node-1", &map, 2);
        let by_name: Vec<(String, i32, String)> = r
            .devices
            .iter()
            .map(|d| {
                (
                    d.device.as_ref().unwrap().device_name.clone(),
                    d.health,
                    d.message.clone(),
                )
            })
            .collect();
        assert_eq!(by_name.len(), 3, "every device, every time");
        assert_eq!(by_name[0].1, health::HealthStatus::Unhealthy as i32);
        assert!(by_name[0].2.contains("XID 79"), "{}", by_name[0].2);
        assert_eq!(by_name[1].1, health::HealthStatus::Healthy as i32);
        assert_eq!(by_name[2].1, health::HealthStatus::Unknown as i32);
        assert!(by_name[2].2.contains("NVML"), "{}", by_name[2].2);

        let v1 = to_v1(r.clone());
        assert_eq!(v1.devices.len(), 3);
        assert_eq!(v1.devices[0].health, v1::HealthStatus::Unhealthy as i32);
        assert_eq!(v1.devices[0].message, r.devices[0].message);
        assert_eq!(v1.devices[2].device.as_ref().unwrap().device_name, "gpu-2");
    }

    #[tokio::test]
    async fn the_list_is_sent_again_before_the_kubelet_would_call_it_unknown() {
        use futures::StreamExt;
        // The real interval, scaled down 200 times.
        let refresh = REFRESH_INTERVAL / 200;
        let (tx, rx) = watch::channel(devices(&["gpu-0"]));
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
        tx.send_replace(devices(&["gpu-0", "gpu-1"]));
        assert_eq!(stream.next().await.unwrap().unwrap().devices.len(), 2);
        stop.cancel();
        assert!(stream.next().await.is_none());
        assert!(REFRESH_INTERVAL * 3 <= HEALTH_CHECK_TIMEOUT);
    }
}

//! DRA resource health (v1alpha1): a stream of the complete device list, sent when the kubelet opens
//! it and again whenever the list changes. Every device present is reported HEALTHY.

use std::pin::Pin;
use std::time::{SystemTime, UNIX_EPOCH};

use futures::Stream;
use gpupool_proto::health_v1alpha1 as health;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

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
                health_check_timeout_seconds: 0,
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
        );
        Ok(Response::new(Box::pin(stream)))
    }
}

/// The current list at once, then one report per change, until `stop`.
fn reports(
    pool: String,
    devices: watch::Receiver<Vec<String>>,
    stop: CancellationToken,
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
        }
    }
}

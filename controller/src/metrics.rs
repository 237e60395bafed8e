//! Prometheus metrics of the controller, served at `GET /metrics` on `--metrics-addr`: its
//! reconcile passes, and the pool per model as the drivers publish it (labelled by the devices'
//! `model` attribute, the same value as the drivers' `model` label).
//!
//! Prometheus asks for OpenMetrics and gets it; anything else gets the classic text format 0.0.4.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::models::PublishedDevice;

pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";
pub const TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// `--metrics-addr`: `host:port`, `:port` for every address, or empty for no endpoint.
pub fn parse_listen_addr(value: &str) -> Result<ListenAddr, String> {
    let value = value.trim();
    if value.is_empty() {
        return Ok(ListenAddr(None));
    }
    let full = match value.strip_prefix(':') {
        Some(port) => format!("0.0.0.0:{port}"),
        None => value.to_string(),
    };
    full.parse::<SocketAddr>()
        .map(|a| ListenAddr(Some(a)))
        .map_err(|e| format!("{value:?}: {e}; expected host:port, :port, or empty to turn it off"))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListenAddr(pub Option<SocketAddr>);

/// Devices and memory per model.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelPool {
    pub devices: i64,
    pub memory_bytes: u64,
}

/// The pool per model, from the devices of the current generation of every gpupool pool.
pub fn pool_by_model(devices: &[PublishedDevice]) -> BTreeMap<String, ModelPool> {
    let mut pools: BTreeMap<String, ModelPool> = BTreeMap::new();
    for device in devices {
        let Some(model) = &device.model else { continue };
        let pool = pools.entry(model.clone()).or_default();
        pool.devices += 1;
        pool.memory_bytes += device.memory_bytes;
    }
    pools
}

#[derive(Debug, Default)]
struct ModelCollector {
    pools: Arc<Mutex<BTreeMap<String, ModelPool>>>,
}

impl Collector for ModelCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let pools = self.pools.lock().expect("pools are never poisoned").clone();
        let mut devices = encoder.encode_descriptor(
            "gpupool_model_devices",
            "GPUs the drivers publish, per model (as of this replica's last pass as leader)",
            None,
            MetricType::Gauge,
        )?;
        for (model, pool) in &pools {
            let labels = [("model", model.as_str())];
            ConstGauge::new(pool.devices).encode(devices.encode_family(&labels)?)?;
        }
        let mut memory = encoder.encode_descriptor(
            "gpupool_model_memory_bytes",
            "GPU memory the drivers publish, per model (as of this replica's last pass as leader)",
            None,
            MetricType::Gauge,
        )?;
        for (model, pool) in &pools {
            let labels = [("model", model.as_str())];
            ConstGauge::new(pool.memory_bytes as i64).encode(memory.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

/// Every metric of the controller.
pub struct ControllerMetrics {
    registry: Registry,
    reconciles: Counter,
    errors: Counter,
    pools: Arc<Mutex<BTreeMap<String, ModelPool>>>,
}

impl Default for ControllerMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl ControllerMetrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let reconciles = Counter::default();
        let errors = Counter::default();
        // `register` ends each help text with a period of its own.
        registry.register(
            "gpupool_controller_reconciles",
            "Full reconcile passes this replica ran as leader",
            reconciles.clone(),
        );
        registry.register(
            "gpupool_controller_reconcile_errors",
            "Reconcile passes that failed or left a write undone",
            errors.clone(),
        );
        let collector = ModelCollector::default();
        let pools = collector.pools.clone();
        registry.register_collector(Box::new(collector));
        ControllerMetrics {
            registry,
            reconciles,
            errors,
            pools,
        }
    }

    pub fn pass_done(&self, failed: bool) {
        self.reconciles.inc();
        if failed {
            self.errors.inc();
        }
    }

    pub fn set_pools(&self, pools: BTreeMap<String, ModelPool>) {
        *self.pools.lock().expect("pools are never poisoned") = pools;
    }

    /// The exposition: OpenMetrics when asked for, else the classic text format.
    pub fn render(&self, openmetrics: bool) -> String {
        let mut text = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut text, &self.registry) {
            tracing::warn!(error = %e, "encoding the metrics");
        }
        if openmetrics {
            text
        } else {
            openmetrics_to_text(&text)
        }
    }
}

/// OpenMetrics as `prometheus-client` writes it, in the classic text format 0.0.4: a counter's
/// HELP and TYPE name the `_total` series, and there is no UNIT or EOF line.
pub fn openmetrics_to_text(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|prefix| {
            let rest = line.strip_prefix(prefix)?;
            let (name, tail) = rest.split_once(' ')?;
            counters
                .contains(name)
                .then(|| format!("{prefix}{name}_total {tail}"))
        });
        out.push_str(renamed.as_deref().unwrap_or(line));
        out.push('\n');
    }
    out
}

/// Binds the metrics endpoint, so that a taken port fails the start rather than going unnoticed.
pub async fn bind(addr: SocketAddr) -> anyhow::Result<tokio::net::TcpListener> {
    use anyhow::Context;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the metrics endpoint {addr} (--metrics-addr)"))?;
    // The harness and the sandbox read the bound port from this line (`--metrics-addr 127.0.0.1:0`).
    if let Ok(bound) = listener.local_addr() {
        tracing::info!(metrics_addr = %bound, "serving GET /metrics");
    }
    Ok(listener)
}

/// GET /metrics until `stop` turns true.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<ControllerMetrics>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<()> {
    use anyhow::Context;
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move |headers: axum::http::HeaderMap| {
            let metrics = metrics.clone();
            async move {
                let openmetrics = headers
                    .get_all(axum::http::header::ACCEPT)
                    .iter()
                    .filter_map(|v| v.to_str().ok())
                    .any(|v| v.contains("application/openmetrics-text"));
                let content_type = if openmetrics {
                    OPENMETRICS_CONTENT_TYPE
                } else {
                    TEXT_CONTENT_TYPE
                };
                (
                    [(axum::http::header::CONTENT_TYPE, content_type)],
                    metrics.render(openmetrics),
                )
            }
        }),
    );
    axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            let _ = stop.wait_for(|s| *s).await;
        })
        .await
        .context("metrics endpoint")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(node: &str, name: &str, model: Option<&str>, memory: u64) -> PublishedDevice {
        PublishedDevice {
            node: node.into(),
            pool: node.into(),
            name: name.into(),
            model: model.map(str::to_string),
            product_name: None,
            memory_bytes: memory,
        }
    }

    #[test]
    fn the_pool_is_counted_per_model_across_nodes() {
        const GIB: u64 = 1 << 30;
        let devices = [
            device("n1", "gpu-0", Some("A100-SXM4-40GB"), 40 * GIB),
            device("n2", "gpu-0", Some("A100-SXM4-40GB"), 40 * GIB),
            device("n2", "gpu-1", Some("V100-SXM2-32GB"), 32 * GIB),
            device("n3", "gpu-0", None, 8 * GIB),
        ];
        let pools = pool_by_model(&devices);
        assert_eq!(
            pools,
            BTreeMap::from([
                (
                    "A100-SXM4-40GB".to_string(),
                    ModelPool {
                        devices: 2,
                        memory_bytes: 80 * GIB
                    }
                ),
                (
                    "V100-SXM2-32GB".to_string(),
                    ModelPool {
                        devices: 1,
                        memory_bytes: 32 * GIB
                    }
                ),
            ])
        );
    }

    #[test]
    fn passes_errors_and_pools_appear_in_the_text_format() {
        let metrics = ControllerMetrics::new();
        metrics.pass_done(false);
        metrics.pass_done(true);
        metrics.set_pools(BTreeMap::from([(
            "RTX-3090".to_string(),
            ModelPool {
                devices: 1,
                memory_bytes: 24 << 30,
            },
        )]));
        let text = metrics.render(false);
        for line in [
            "# TYPE gpupool_controller_reconciles_total counter",
            "gpupool_controller_reconciles_total 2",
            "gpupool_controller_reconcile_errors_total 1",
            "gpupool_model_devices{model=\"RTX-3090\"} 1",
            "gpupool_model_memory_bytes{model=\"RTX-3090\"} 25769803776",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} not in\n{text}");
        }
        assert!(!text.contains("# EOF"), "{text}");
        assert!(metrics.render(true).ends_with("# EOF\n"));
    }

    #[test]
    fn the_metrics_address_takes_a_port_alone_a_full_address_or_nothing() {
        assert_eq!(
            parse_listen_addr(":9465").unwrap().0,
            Some("0.0.0.0:9465".parse().unwrap())
        );
        assert_eq!(parse_listen_addr("").unwrap().0, None);
        assert!(parse_listen_addr("nine").is_err());
    }
}

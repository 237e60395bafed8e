//! Prometheus metrics of the controller, served at `GET /metrics` on `--metrics-addr`: its
//! reconcile passes, and the pool per model as the drivers publish it (labelled by the devices'
//! `model` attribute, the same value as the drivers' `model` label).
//!
//! Prometheus asks for OpenMetrics and gets it; anything else gets the classic text format 0.0.4.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::models::PublishedDevice;

pub use gpupool_telemetry::{bind, parse_listen_addr, ListenAddr};

/// Devices and memory per model.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelPool {
    pub devices: i64,
    pub memory_bytes: u64,
}

/// The pool per model, from the devices of the current generation of every gpupool pool.
pub fn pool_by_model(devices: &[PublishedDevice]) -> BTreeMap<String, ModelPool> {
    let mut pools: BTreeMap<String, ModelPool> = BTreeMap::new();
    // Cards only: a MIG device is a part of a card counted already.
    for device in devices.iter().filter(|d| !d.is_mig()) {
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
        encode_per_model(
            &mut encoder,
            "gpupool_model_devices",
            "GPUs the drivers publish, per model (as of this replica's last pass as leader)",
            &pools,
            |pool| pool.devices,
        )?;
        encode_per_model(
            &mut encoder,
            "gpupool_model_memory_bytes",
            "GPU memory the drivers publish, per model (as of this replica's last pass as leader)",
            &pools,
            |pool| pool.memory_bytes as i64,
        )?;
        Ok(())
    }
}

/// One gauge family with a sample per model, labelled `model`.
fn encode_per_model(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    pools: &BTreeMap<String, ModelPool>,
    value: impl Fn(&ModelPool) -> i64,
) -> Result<(), std::fmt::Error> {
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (model, pool) in pools {
        let labels = [("model", model.as_str())];
        ConstGauge::new(value(pool)).encode(family.encode_family(&labels)?)?;
    }
    Ok(())
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
        gpupool_telemetry::encode(&self.registry, openmetrics)
    }
}

/// GET /metrics until `stop` turns true.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<ControllerMetrics>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let render = move |openmetrics| {
        let metrics = metrics.clone();
        async move { metrics.render(openmetrics) }
    };
    let shutdown = async move {
        let _ = stop.wait_for(|s| *s).await;
    };
    gpupool_telemetry::serve(listener, render, shutdown).await
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
            ..Default::default()
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
}

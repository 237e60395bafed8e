//! Compute weight per GPU model, published as the `computeWeight` attribute and handed to claim
//! preparation: from `GpuModel` objects when the cluster has them, else a built-in table.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use gpupool_api::crd::GpuModel;
use gpupool_api::inventory::Inventory;
use kube::runtime::watcher;
use kube::{Api, ResourceExt};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// Built-in weights: dense FP16 Tensor Core TFLOPS (FP32 accumulate, without sparsity) from NVIDIA's
/// datasheets (A100, H100/H200 SXM, L40S, V100 SXM2, T4, and the GA102 whitepaper for the RTX 3090).
/// Keyed by the short model name ([`gpupool_api::inventory::model_from_product_name`]).
pub const BUILTIN_WEIGHTS: &[(&str, i64)] = &[
    ("A100-SXM4-40GB", 312),
    ("A100-SXM4-80GB", 312),
    ("A100-PCIE-40GB", 312),
    ("A100-80GB-PCIe", 312),
    ("H100-80GB-HBM3", 989),
    ("H100-SXM5-80GB", 989),
    ("H100-PCIe", 756),
    ("H200", 989),
    ("L40S", 362),
    ("V100-SXM2-32GB", 125),
    ("V100-SXM2-16GB", 125),
    ("V100-PCIE-32GB", 112),
    ("V100-PCIE-16GB", 112),
    ("T4", 65),
    ("RTX-3090", 71),
];

pub fn builtin_weight(model: &str) -> Option<i64> {
    BUILTIN_WEIGHTS
        .iter()
        .find(|(m, _)| *m == model)
        .map(|(_, w)| *w)
}

/// Weight of each model present in `inventory`: the GpuModel whose `spec.model` equals the GPU's model
/// or whose `spec.productName` equals its product name (the one the controller keeps when several
/// match, see [`GpuModel::precedence`]; invalid specs are ignored), else the built-in table, else none.
pub fn resolve_weights(inventory: &Inventory, models: &[GpuModel]) -> BTreeMap<String, i64> {
    let mut sorted: Vec<&GpuModel> = models.iter().filter(|m| m.spec.is_valid()).collect();
    sorted.sort_by(|a, b| a.precedence().cmp(&b.precedence()));
    let mut out = BTreeMap::new();
    for gpu in &inventory.gpus {
        if out.contains_key(&gpu.model) {
            continue;
        }
        let from_crd = sorted.iter().find(|m| {
            m.spec.model.as_deref() == Some(gpu.model.as_str())
                || m.spec.product_name.as_deref() == Some(gpu.product_name.as_str())
        });
        let weight = from_crd
            .map(|m| m.spec.compute_weight)
            .or_else(|| builtin_weight(&gpu.model));
        if let Some(w) = weight {
            out.insert(gpu.model.clone(), w);
        }
    }
    out
}

/// Compute weight per GPU model (`Gpu.model`).
pub type Weights = BTreeMap<String, i64>;

/// A channel with the built-in weights of `inventory`, to be kept current by [`watch_gpu_models`].
pub fn channel(inventory: &Inventory) -> (watch::Sender<Weights>, watch::Receiver<Weights>) {
    watch::channel(resolve_weights(inventory, &[]))
}

fn is_not_found(err: &watcher::Error) -> bool {
    let api_err = match err {
        watcher::Error::InitialListFailed(e) | watcher::Error::WatchStartFailed(e) => e,
        _ => return false,
    };
    matches!(api_err, kube::Error::Api(status) if status.code == 404)
}

/// Watches GpuModel objects until `stop` and sends the resolved weights whenever they change.
/// A cluster without the GpuModel CRD keeps the built-in table (and is asked again with backoff, in
/// case the CRD is installed later). `settled` turns true once the first list completed or failed, so
/// the first publication can carry the cluster's weights rather than flip from the built-in ones.
pub async fn watch_gpu_models(
    api: Api<GpuModel>,
    inventory: std::sync::Arc<Inventory>,
    tx: watch::Sender<BTreeMap<String, i64>>,
    settled: watch::Sender<bool>,
    stop: CancellationToken,
) {
    let mut objects: BTreeMap<String, GpuModel> = BTreeMap::new();
    let mut initial: BTreeMap<String, GpuModel> = BTreeMap::new();
    let mut backoff = Duration::from_millis(200);
    let mut said_missing = false;
    let mut relisting = false;
    let stream = watcher(api, watcher::Config::default());
    futures::pin_mut!(stream);
    loop {
        let event = tokio::select! {
            _ = stop.cancelled() => return,
            next = stream.next() => match next { Some(e) => e, None => return },
        };
        match event {
            Ok(event) => {
                // kube's watcher yields Init before every (re)list, also before one that is about
                // to fail: only a completed list or a change proves the API answers again.
                if !matches!(event, watcher::Event::Init | watcher::Event::InitApply(_)) {
                    backoff = Duration::from_millis(200);
                }
                match event {
                    watcher::Event::Init => {
                        initial.clear();
                        relisting = true;
                    }
                    watcher::Event::InitApply(m) => {
                        initial.insert(m.name_any(), m);
                    }
                    watcher::Event::InitDone => {
                        objects = std::mem::take(&mut initial);
                        relisting = false;
                    }
                    watcher::Event::Apply(m) => {
                        objects.insert(m.name_any(), m);
                    }
                    watcher::Event::Delete(m) => {
                        objects.remove(&m.name_any());
                    }
                }
                // While a relist is buffered, the last complete set stays in force.
                if relisting {
                    continue;
                }
                let models: Vec<GpuModel> = objects.values().cloned().collect();
                let weights = resolve_weights(&inventory, &models);
                tx.send_if_modified(|current| {
                    if *current == weights {
                        return false;
                    }
                    tracing::info!(?weights, "compute weights changed");
                    *current = weights;
                    true
                });
                settled.send_replace(true);
            }
            Err(err) => {
                if is_not_found(&err) {
                    if !said_missing {
                        tracing::info!(
                            "GpuModel CRD not installed: using built-in compute weights"
                        );
                        said_missing = true;
                    }
                } else {
                    tracing::warn!(error = %err, "watching GpuModel objects failed; retrying");
                }
                settled.send_replace(true);
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(30));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::fake::fake_inventory;
    use gpupool_api::crd::GpuModelSpec;

    fn gpu_model(name: &str, model: Option<&str>, product: Option<&str>, weight: i64) -> GpuModel {
        GpuModel::new(
            name,
            GpuModelSpec {
                model: model.map(Into::into),
                product_name: product.map(Into::into),
                compute_weight: weight,
                device_class_name: None,
                tier: None,
                mig_profiles: Vec::new(),
            },
        )
    }

    #[test]
    fn builtin_table_covers_the_fake_profiles() {
        let inv = fake_inventory("a100-40gb:1,v100-32gb:1,rtx3090:1", "n").unwrap();
        let w = resolve_weights(&inv, &[]);
        assert_eq!(w.get("A100-SXM4-40GB"), Some(&312));
        assert_eq!(w.get("V100-SXM2-32GB"), Some(&125));
        assert_eq!(w.get("RTX-3090"), Some(&71));
        for p in crate::inventory::fake::PROFILES {
            let inv = fake_inventory(p.key, "n").unwrap();
            assert_eq!(
                resolve_weights(&inv, &[]).len(),
                1,
                "{} has no built-in weight",
                p.key
            );
        }
    }

    #[test]
    fn gpu_models_override_by_model_or_product_name() {
        let inv = fake_inventory("a100-40gb:2,v100-32gb:1", "n").unwrap();
        let models = [
            gpu_model("v100", None, Some("Tesla V100-SXM2-32GB"), 256),
            gpu_model("a100", Some("A100-SXM4-40GB"), None, 300),
            gpu_model("other", Some("B200"), None, 2000),
        ];
        let w = resolve_weights(&inv, &models);
        assert_eq!(
            w,
            BTreeMap::from([
                ("A100-SXM4-40GB".into(), 300),
                ("V100-SXM2-32GB".into(), 256)
            ])
        );
    }

    #[test]
    fn invalid_weights_fall_back_and_conflicts_resolve_by_name() {
        let inv = fake_inventory("a100-40gb:1", "n").unwrap();
        let w = resolve_weights(&inv, &[gpu_model("bad", Some("A100-SXM4-40GB"), None, 0)]);
        assert_eq!(w.get("A100-SXM4-40GB"), Some(&312));
        let w = resolve_weights(
            &inv,
            &[
                gpu_model("z", Some("A100-SXM4-40GB"), None, 9),
                gpu_model("a", Some("A100-SXM4-40GB"), None, 5),
            ],
        );
        assert_eq!(w.get("A100-SXM4-40GB"), Some(&5));
    }

    #[test]
    fn the_oldest_gpu_model_wins_like_the_controllers_class_and_both_matchers_is_invalid() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
        use k8s_openapi::jiff::Timestamp;
        let inv = fake_inventory("a100-40gb:1", "n").unwrap();
        let created = |mut m: GpuModel, second: i64| {
            m.metadata.creation_timestamp = Some(Time(Timestamp::from_second(second).unwrap()));
            m
        };
        let older = created(gpu_model("z-older", Some("A100-SXM4-40GB"), None, 9), 100);
        let newer = created(gpu_model("a-newer", Some("A100-SXM4-40GB"), None, 5), 200);
        let w = resolve_weights(&inv, &[newer, older]);
        assert_eq!(w.get("A100-SXM4-40GB"), Some(&9));
        let both = gpu_model(
            "both",
            Some("A100-SXM4-40GB"),
            Some("NVIDIA A100-SXM4-40GB"),
            7,
        );
        assert_eq!(
            resolve_weights(&inv, &[both]).get("A100-SXM4-40GB"),
            Some(&312)
        );
    }

    #[test]
    fn unknown_models_get_no_weight() {
        let mut inv = fake_inventory("t4:1", "n").unwrap();
        inv.gpus[0].model = "Mystery-GPU".into();
        assert!(resolve_weights(&inv, &[]).is_empty());
    }
}

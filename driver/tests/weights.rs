//! The GpuModel watch against the API server emulator on loopback.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use gpupool_apiserver::ApiServer;
use gpupool_driver::inventory::fake::fake_inventory;
use gpupool_driver::weights::watch_gpu_models;
use kube::Api;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// Without the GpuModel CRD the driver keeps its built-in weights and asks again with a growing
/// backoff (200 ms, 400 ms, 800 ms, ...), not five times a second forever: on a large cluster
/// every node runs this loop.
#[tokio::test]
async fn a_missing_gpu_model_crd_is_asked_for_with_a_growing_backoff() {
    let server = ApiServer::start().await.unwrap();
    let inventory = Arc::new(fake_inventory("a100-40gb:1", "node-a").unwrap());
    let (tx, rx) = watch::channel(BTreeMap::new());
    let (settled_tx, settled_rx) = watch::channel(false);
    let stop = CancellationToken::new();
    let task = tokio::spawn(watch_gpu_models(
        Api::all(server.client().await),
        inventory,
        tx,
        settled_tx,
        stop.clone(),
    ));
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.cancel();
    task.await.unwrap();

    assert!(
        *settled_rx.borrow(),
        "a missing CRD still settles the weights"
    );
    assert!(
        rx.borrow().is_empty(),
        "no GpuModel, no weights from the cluster"
    );
    let lists = server
        .requests()
        .iter()
        .filter(|r| r.method == "GET" && r.path.contains("gpumodels"))
        .count();
    // 200 + 400 + 800 + 1600 ms of backoff fit in 3 s: at most 5 lists (15 without the backoff).
    assert!((1..=5).contains(&lists), "{lists} GpuModel lists in 3 s");
}

//! Clusters without DRAConsumableCapacity: the publisher must end with exclusive whole-GPU devices,
//! whether the API server silently drops the fields (feature gate off) or rejects them (422).
//! A small stand-in API server plays such a cluster.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::get;
use axum::{Json, Router};
use gpupool_driver::inventory::fake::fake_inventory;
use gpupool_driver::publisher::{Outcome, SlicePublisher};
use gpupool_driver::slices::SliceMode;
use serde_json::{json, Value};

#[derive(Clone, Copy, PartialEq)]
enum Old {
    /// Feature gate off: disabled fields are dropped from what is stored.
    Drops,
    /// Validation rejects them.
    Rejects,
}

#[derive(Clone)]
struct Cluster {
    behaviour: Old,
    slices: Arc<Mutex<Vec<Value>>>,
    writes: Arc<Mutex<usize>>,
}

fn status(code: u16, reason: &str, message: &str) -> (StatusCode, Json<Value>) {
    (
        StatusCode::from_u16(code).unwrap(),
        Json(
            json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                    "message": message, "reason": reason, "code": code}),
        ),
    )
}

fn has_sharing(slice: &Value) -> bool {
    let text = slice["spec"].to_string();
    text.contains("allowMultipleAllocations") || text.contains("requestPolicy")
}

fn strip(mut slice: Value) -> Value {
    for device in slice["spec"]["devices"]
        .as_array_mut()
        .into_iter()
        .flatten()
    {
        device
            .as_object_mut()
            .unwrap()
            .remove("allowMultipleAllocations");
        for cap in device["capacity"]
            .as_object_mut()
            .into_iter()
            .flat_map(|c| c.values_mut())
        {
            cap.as_object_mut().unwrap().remove("requestPolicy");
        }
    }
    slice
}

impl Cluster {
    fn store(&self, mut slice: Value) -> Result<Value, (StatusCode, Json<Value>)> {
        if has_sharing(&slice) && self.behaviour == Old::Rejects {
            let name = slice["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            return Err(status(
                422,
                "Invalid",
                &format!("ResourceSlice.resource.k8s.io \"{name}\" is invalid: spec.devices[0].allowMultipleAllocations: Forbidden: disabled by feature gate DRAConsumableCapacity"),
            ));
        }
        let version = {
            let mut writes = self.writes.lock().unwrap();
            *writes += 1;
            writes.to_string()
        };
        slice = strip(slice);
        slice["metadata"]["resourceVersion"] = json!(version);
        let mut slices = self.slices.lock().unwrap();
        let name = slice["metadata"]["name"].clone();
        slices.retain(|s| s["metadata"]["name"] != name);
        slices.push(slice.clone());
        Ok(slice)
    }
}

async fn list(State(c): State<Cluster>) -> Json<Value> {
    let items = c.slices.lock().unwrap().clone();
    Json(
        json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSliceList",
                "metadata": {"resourceVersion": "1"}, "items": items}),
    )
}

async fn create(
    State(c): State<Cluster>,
    Json(slice): Json<Value>,
) -> Result<(StatusCode, Json<Value>), (StatusCode, Json<Value>)> {
    c.store(slice).map(|s| (StatusCode::CREATED, Json(s)))
}

async fn replace(
    State(c): State<Cluster>,
    Path(_name): Path<String>,
    Json(slice): Json<Value>,
) -> Result<Json<Value>, (StatusCode, Json<Value>)> {
    c.store(slice).map(Json)
}

async fn no_node(Path(name): Path<String>) -> (StatusCode, Json<Value>) {
    status(404, "NotFound", &format!("nodes \"{name}\" not found"))
}

async fn start(behaviour: Old) -> (Cluster, kube::Client) {
    let cluster = Cluster {
        behaviour,
        slices: Arc::default(),
        writes: Arc::default(),
    };
    let app = Router::new()
        .route(
            "/apis/resource.k8s.io/v1/resourceslices",
            get(list).post(create),
        )
        .route(
            "/apis/resource.k8s.io/v1/resourceslices/{name}",
            axum::routing::put(replace),
        )
        .route("/api/v1/nodes/{name}", get(no_node))
        .with_state(cluster.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let config = kube::Config::new(format!("http://{addr}").parse().unwrap());
    (cluster, kube::Client::try_from(config).unwrap())
}

fn stored_devices(cluster: &Cluster) -> Vec<Value> {
    let slices = cluster.slices.lock().unwrap();
    assert_eq!(slices.len(), 1);
    slices[0]["spec"]["devices"].as_array().unwrap().clone()
}

#[tokio::test]
async fn a_cluster_that_drops_consumable_capacity_gets_exclusive_devices() {
    let (cluster, client) = start(Old::Drops).await;
    let inv = fake_inventory("a100-40gb:2", "node-a").unwrap();
    let mut publisher = SlicePublisher::new(client, "node-a");
    let first = publisher
        .reconcile(&inv, &Default::default(), &Default::default())
        .await
        .unwrap();
    assert_eq!(publisher.mode(), SliceMode::ExclusiveFallback);
    // The stored slice already is the exclusive one: nothing more to write, now or later.
    assert_eq!(first, Outcome::Unchanged { generation: 1 });
    assert_eq!(
        publisher
            .reconcile(&inv, &Default::default(), &Default::default())
            .await
            .unwrap(),
        Outcome::Unchanged { generation: 1 }
    );
    assert_eq!(*cluster.writes.lock().unwrap(), 1);
    for d in stored_devices(&cluster) {
        assert_eq!(d["capacity"]["memory"]["value"], "40Gi");
        assert!(d.get("allowMultipleAllocations").is_none());
    }
}

#[tokio::test]
async fn a_cluster_that_rejects_consumable_capacity_gets_exclusive_devices() {
    let (cluster, client) = start(Old::Rejects).await;
    let inv = fake_inventory("v100-32gb:1", "node-a").unwrap();
    let mut publisher = SlicePublisher::new(client, "node-a");
    let outcome = publisher
        .reconcile(&inv, &Default::default(), &Default::default())
        .await
        .unwrap();
    assert_eq!(
        outcome,
        Outcome::Published {
            generation: 1,
            slices: 1
        }
    );
    assert_eq!(publisher.mode(), SliceMode::ExclusiveFallback);
    let devices = stored_devices(&cluster);
    assert_eq!(devices[0]["name"], "gpu-0");
    assert_eq!(devices[0]["capacity"]["cores"]["value"], "100");
    assert!(devices[0]["capacity"]["memory"]
        .get("requestPolicy")
        .is_none());
}

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use gpupool_api::config::Enforcement;

use super::*;
use crate::inventory::fake::fake_inventory;
use crate::node_state::checkpoint::ClaimEntry;
use crate::node_state::NodeLayout;
use crate::prepare::cdi::{self, SpecDevice};
use crate::prepare::claim::AllocatedDevice;
use crate::prepare::limits::DeviceLimits;
use crate::prepare::{PrepareError, PrepareErrorKind};
use gpupool_api::claim::PreparedDevice;

const GIB: u64 = 1 << 30;

#[test]
fn api_requests_are_named_by_their_kubernetes_verb() {
    use http::Method;
    let cases = [
        (
            Method::GET,
            "/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims/c1",
            "get",
        ),
        (
            Method::GET,
            "/apis/resource.k8s.io/v1/resourceslices?labelSelector=x",
            "list",
        ),
        (
            Method::GET,
            "/apis/gpupool.dev/v1alpha1/gpumodels?watch=true&resourceVersion=5",
            "watch",
        ),
        (Method::GET, "/api/v1/namespaces/ml", "get"),
        (Method::GET, "/api/v1/namespaces", "list"),
        (Method::GET, "/api/v1/namespaces/ml/pods", "list"),
        (
            Method::POST,
            "/apis/resource.k8s.io/v1/resourceslices",
            "create",
        ),
        (
            Method::PUT,
            "/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims/c1/status",
            "update",
        ),
        (
            Method::PATCH,
            "/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims/c1/status",
            "patch",
        ),
        (
            Method::DELETE,
            "/apis/resource.k8s.io/v1/resourceslices/s1",
            "delete",
        ),
        (
            Method::DELETE,
            "/apis/resource.k8s.io/v1/resourceslices?fieldSelector=x",
            "deletecollection",
        ),
    ];
    for (method, uri, verb) in cases {
        let uri: http::Uri = uri.parse().unwrap();
        assert_eq!(api_verb(&method, &uri), verb, "{method} {uri}");
    }
}

/// A prepared claim's checkpoint entry with the CDI spec the driver really renders for it.
fn prepared_entry(
    inventory: &Inventory,
    uid: &str,
    name: &str,
    devices: &[(&str, u64, u32, Enforcement)],
) -> ClaimEntry {
    prepared_entry_with(
        inventory,
        uid,
        name,
        devices,
        gpupool_api::config::Compute::Limiter,
    )
}

/// [`prepared_entry`] with its shares' cores held by `compute`.
fn prepared_entry_with(
    inventory: &Inventory,
    uid: &str,
    name: &str,
    devices: &[(&str, u64, u32, Enforcement)],
    compute: gpupool_api::config::Compute,
) -> ClaimEntry {
    let allocated: Vec<AllocatedDevice> = devices
        .iter()
        .map(|(device, _, _, _)| AllocatedDevice {
            request: "gpu".into(),
            pool: "node-1".into(),
            device: device.to_string(),
            share_id: Some(format!("share-{name}")),
            consumed: BTreeMap::new(),
        })
        .collect();
    let limits: Vec<DeviceLimits> = devices
        .iter()
        .enumerate()
        .map(|(i, (_, memory, cores, enforcement))| DeviceLimits {
            ordinal: i,
            memory_bytes: *memory,
            cores: *cores,
            enforcement: *enforcement,
            compute,
            priority: None,
        })
        .collect();
    let spec_devices: Vec<SpecDevice> = allocated
        .iter()
        .zip(&limits)
        .map(|(a, l)| SpecDevice {
            allocated: a,
            gpu: inventory.gpu(&a.device).unwrap(),
            limits: l,
            mig: None,
        })
        .collect();
    let layout = NodeLayout::new(
        PathBuf::from("/nonexistent/state"),
        PathBuf::from("/nonexistent/cdi"),
        PathBuf::from("/run/gpupool"),
        (Path::new("/nonexistent"), Path::new("/nonexistent")),
        true,
    );
    let rendered = cdi::render(uid, &spec_devices, &layout, &|_| false).unwrap();
    ClaimEntry {
        state: ClaimState::PrepareCompleted,
        namespace: "ml".into(),
        name: name.into(),
        devices: allocated
            .iter()
            .zip(&rendered.cdi_ids)
            .map(|(a, id)| PreparedDevice {
                request_names: vec![a.request.clone()],
                pool_name: a.pool.clone(),
                device_name: a.device.clone(),
                cdi_device_ids: vec![id.clone()],
                share_id: a.share_id.clone(),
            })
            .collect(),
        spec: Some(rendered.spec),
        warning: rendered.warning,
        recovered: false,
        mig: Vec::new(),
        mps: Vec::new(),
    }
}

#[test]
fn allocation_per_gpu_sums_the_limits_of_the_prepared_shares() {
    let inventory = fake_inventory("a100-40gb:2,v100-32gb:1", "node-1").unwrap();
    let mut data = CheckpointData::default();
    let hami = Enforcement::HamiCore;
    data.claims.insert(
        "u1".into(),
        prepared_entry(&inventory, "u1", "half", &[("gpu-0", 20 * GIB, 50, hami)]),
    );
    data.claims.insert(
        "u2".into(),
        prepared_entry(
            &inventory,
            "u2",
            "quarter",
            &[("gpu-0", 10 * GIB, 25, hami)],
        ),
    );
    // Two cards in one claim: each limit lands on its own card.
    data.claims.insert(
        "u3".into(),
        prepared_entry(
            &inventory,
            "u3",
            "pair",
            &[("gpu-1", 4 * GIB, 0, hami), ("gpu-2", 8 * GIB, 70, hami)],
        ),
    );
    // Not enforced: a share without limits.
    data.claims.insert(
        "u4".into(),
        prepared_entry(
            &inventory,
            "u4",
            "free",
            &[("gpu-1", GIB, 10, Enforcement::None)],
        ),
    );
    // Started but not finished, and rebuilt after a lost checkpoint: not prepared for the kubelet.
    let mut started = prepared_entry(&inventory, "u5", "started", &[("gpu-2", GIB, 5, hami)]);
    started.state = ClaimState::PrepareStarted;
    data.claims.insert("u5".into(), started);
    let mut recovered = prepared_entry(&inventory, "u6", "recovered", &[("gpu-2", GIB, 5, hami)]);
    recovered.recovered = true;
    data.claims.insert("u6".into(), recovered);

    let state = node_state(&inventory, &data);
    assert_eq!(state.prepared_claims, 4);
    let alloc = |memory: u64, cores: u64, shares: u64| GpuAllocation {
        memory_bytes: memory,
        cores_percent: cores,
        shares,
    };
    assert_eq!(
        state.gpus,
        BTreeMap::from([
            ("gpu-0".to_string(), alloc(30 * GIB, 75, 2)),
            ("gpu-1".to_string(), alloc(4 * GIB, 0, 2)),
            ("gpu-2".to_string(), alloc(8 * GIB, 70, 1)),
        ])
    );
    let free = state.shares.iter().find(|s| s.claim == "free").unwrap();
    assert_eq!((free.memory_bytes, free.cores_percent), (None, None));
    let pair = state.claims.iter().find(|c| c.name == "pair").unwrap();
    assert_eq!(pair.gpus, ["gpu-1", "gpu-2"]);
}

#[test]
fn a_card_given_whole_is_all_allocated_whatever_its_spec_limits() {
    let inventory = fake_inventory("a100-40gb:2", "node-1").unwrap();
    let mut data = CheckpointData::default();
    // A whole card's spec carries the card's memory and SM limit 0 ("none"); without
    // enforcement it carries no limits at all. Neither may read as an idle card.
    for (uid, device, enforcement) in [
        ("u1", "gpu-0", Enforcement::Gpupool),
        ("u2", "gpu-1", Enforcement::None),
    ] {
        let mut entry = prepared_entry(&inventory, uid, uid, &[(device, 40 * GIB, 0, enforcement)]);
        entry.devices[0].share_id = None;
        data.claims.insert(uid.into(), entry);
    }
    let state = node_state(&inventory, &data);
    let whole = GpuAllocation {
        memory_bytes: 40 * GIB,
        cores_percent: 100,
        shares: 1,
    };
    assert_eq!(
        state.gpus,
        BTreeMap::from([
            ("gpu-0".to_string(), whole.clone()),
            ("gpu-1".to_string(), whole)
        ])
    );
}

#[tokio::test]
async fn an_mps_shares_cores_count_and_its_cards_daemon_is_up_while_it_runs() {
    use crate::node_state::checkpoint::{MpsDaemonRecord, MpsDaemonState};
    let inventory = Arc::new(fake_inventory("a100-40gb:2", "node-1").unwrap());
    let mut data = CheckpointData::default();
    let mps = prepared_entry_with(
        &inventory,
        "u1",
        "thirty",
        &[("gpu-0", 8 * GIB, 30, Enforcement::Gpupool)],
        gpupool_api::config::Compute::Mps,
    );
    data.claims.insert("u1".into(), mps);
    let state = node_state(&inventory, &data);
    assert_eq!(
        state.gpus["gpu-0"].cores_percent, 30,
        "the library's SM limit is 0, the share's cores are MPS's"
    );
    // This process plays a running daemon (its PID and start time), a recorded PID that is gone
    // a dead one.
    let me = std::process::id() as i32;
    let stat = std::fs::read_to_string(format!("/proc/{me}/stat")).unwrap();
    let start_time: u64 = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .nth(19)
        .unwrap()
        .parse()
        .unwrap();
    let record = |device: &str, pid: i32, restarts| MpsDaemonRecord {
        state: MpsDaemonState::Running,
        device: device.into(),
        pid: Some(pid),
        start_time: Some(start_time),
        restarts,
        failure: None,
    };
    let (up, dead) = (
        inventory.gpus[0].uuid.clone(),
        inventory.gpus[1].uuid.clone(),
    );
    data.mps.insert(up.clone(), record("gpu-0", me, 0));
    data.mps
        .insert(dead.clone(), record("gpu-1", i32::MAX - 1, 2));
    let mut metrics = DriverMetrics::new();
    let (inv, snapshot) = (inventory.clone(), data.clone());
    let (_, health) = tokio::sync::watch::channel(crate::health::HealthMap::new(
        inventory
            .gpus
            .iter()
            .map(|g| gpupool_api::names::device_name(g.index)),
    ));
    metrics.register_node(
        inventory,
        move || node_state(&inv, &snapshot),
        health,
        kube::Client::new(
            tower::service_fn(|_: http::Request<kube::client::Body>| async {
                Err::<http::Response<kube::client::Body>, _>(std::io::Error::other("offline"))
            }),
            "default",
        ),
    );
    let text = metrics.render(false).await;
    let series = |name: &str, gpu: &str, uuid: &str| {
        sample(&text, &format!("{name}{{gpu=\"{gpu}\",uuid=\"{uuid}\"}}"))
    };
    assert_eq!(
        series("gpupool_mps_daemon_up", "gpu-0", &up),
        Some(1.0),
        "{text}"
    );
    assert_eq!(series("gpupool_mps_daemon_up", "gpu-1", &dead), Some(0.0));
    assert_eq!(
        series("gpupool_mps_daemon_restarts", "gpu-1", &dead),
        Some(2.0)
    );
}

#[test]
fn every_gpu_is_reported_even_with_nothing_prepared() {
    let inventory = fake_inventory("a100-40gb:2", "node-1").unwrap();
    let state = node_state(&inventory, &CheckpointData::default());
    assert_eq!(state.prepared_claims, 0);
    assert_eq!(state.gpus.len(), 2);
    assert!(state.gpus.values().all(|a| *a == GpuAllocation::default()));
}

struct Scripted;

#[tonic::async_trait]
impl Preparer for Scripted {
    async fn prepare(&self, claims: Vec<ClaimRef>) -> PrepareResults {
        claims
            .into_iter()
            .map(|c| {
                let r = if c.name.starts_with("bad") {
                    Err(PrepareError::new(&c, PrepareErrorKind::NotFound))
                } else {
                    Ok(vec![])
                };
                (c, r)
            })
            .collect()
    }

    async fn unprepare(&self, claims: Vec<ClaimRef>) -> UnprepareResults {
        claims.into_iter().map(|c| (c, Ok(()))).collect()
    }
}

fn claim(name: &str) -> ClaimRef {
    ClaimRef {
        namespace: "ml".into(),
        name: name.into(),
        uid: format!("uid-{name}"),
    }
}

/// The value of one sample line (`name{labels} value`) of the text exposition.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[tokio::test]
async fn kubelet_calls_are_counted_per_claim_result_and_timed_per_call() {
    let inventory = Arc::new(fake_inventory("a100-40gb:1", "node-1").unwrap());
    let mut metrics = DriverMetrics::new();
    let inv = inventory.clone();
    let devices = crate::health::HealthMap::new(["gpu-0".to_string()]);
    let (health_tx, health_rx) = tokio::sync::watch::channel(devices.clone());
    metrics.register_node(
        inventory,
        move || node_state(&inv, &CheckpointData::default()),
        health_rx,
        kube::Client::new(
            tower::service_fn(|_: http::Request<kube::client::Body>| async {
                Err::<http::Response<kube::client::Body>, _>(std::io::Error::other("offline"))
            }),
            "default",
        ),
    );
    let preparer = InstrumentedPreparer::new(Arc::new(Scripted), &metrics);
    preparer
        .prepare(vec![claim("a"), claim("bad-1"), claim("b")])
        .await;
    preparer.prepare(vec![claim("c")]).await;
    preparer.unprepare(vec![claim("a")]).await;

    let text = metrics.render(false).await;
    assert_eq!(
        sample(&text, "gpupool_gpu_healthy{gpu=\"gpu-0\"}"),
        Some(1.0)
    );
    let mut tainted = devices;
    let policy = crate::health::XidPolicy::default();
    let xid = crate::health::Observation::Xid {
        device: "gpu-0".into(),
        xid: 79,
    };
    tainted.apply(xid, &policy, 1_700_000_000).unwrap();
    health_tx.send_replace(tainted);
    assert_eq!(
        sample(
            &metrics.render(false).await,
            "gpupool_gpu_healthy{gpu=\"gpu-0\"}"
        ),
        Some(0.0)
    );
    assert_eq!(
        sample(&text, "gpupool_prepare_requests_total{result=\"success\"}"),
        Some(3.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, "gpupool_prepare_requests_total{result=\"error\"}"),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &text,
            "gpupool_unprepare_requests_total{result=\"success\"}"
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(&text, "gpupool_unprepare_requests_total{result=\"error\"}"),
        Some(0.0)
    );
    assert_eq!(
        sample(&text, "gpupool_prepare_duration_seconds_count"),
        Some(2.0)
    );
    assert_eq!(
        sample(
            &text,
            "gpupool_prepare_duration_seconds_bucket{le=\"45.0\"}"
        ),
        Some(2.0)
    );
    assert_eq!(sample(&text, "gpupool_prepared_claims"), Some(0.0));
    let uuid = &fake_inventory("a100-40gb:1", "node-1").unwrap().gpus[0].uuid;
    assert_eq!(
        sample(
            &text,
            &format!("gpupool_gpu_info{{gpu=\"gpu-0\",uuid=\"{uuid}\",model=\"A100-SXM4-40GB\"}}")
        ),
        Some(1.0)
    );
}

#[tokio::test]
async fn the_api_layer_counts_each_request_by_verb_and_status() {
    use tower::{Layer, Service, ServiceExt};
    let metrics = DriverMetrics::new();
    let inner = tower::service_fn(|req: http::Request<()>| async move {
        let status = if req.uri().path().ends_with("/missing") {
            404
        } else {
            200
        };
        Ok::<_, std::convert::Infallible>(
            http::Response::builder().status(status).body(()).unwrap(),
        )
    });
    let mut service = metrics.api_layer().layer(inner);
    for path in [
        "/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims/c1",
        "/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims/missing",
        "/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims/c2",
    ] {
        let request = http::Request::get(path).body(()).unwrap();
        service.ready().await.unwrap().call(request).await.unwrap();
    }
    let text = metrics.render(false).await;
    assert_eq!(
        sample(
            &text,
            "gpupool_api_requests_total{verb=\"get\",code=\"200\"}"
        ),
        Some(2.0),
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            "gpupool_api_requests_total{verb=\"get\",code=\"404\"}"
        ),
        Some(1.0)
    );
}

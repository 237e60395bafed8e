//! Slice publication and the `run` command against the API server emulator on loopback.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gpupool_apiserver::ApiServer;
use gpupool_driver::health::HealthMap;
use gpupool_driver::inventory::fake::fake_inventory;
use gpupool_driver::publisher::{Outcome, SlicePublisher};
use gpupool_driver::slices::{build_slices, SliceMode};
use gpupool_proto::dra_v1;
use hyper_util::rt::TokioIo;
use k8s_openapi::api::resource::v1::ResourceClaim;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};

async fn slices_of(api: &Api<ResourceSlice>, node: &str) -> Vec<ResourceSlice> {
    let mut items: Vec<_> = api
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|s| s.spec.node_name.as_deref() == Some(node))
        .collect();
    items.sort_by_key(|s| s.name_any());
    items
}

/// The slice of a node with one T4 at `generation`, as the driver builds it.
fn one_t4_slice(node: &str, generation: i64) -> ResourceSlice {
    build_slices(
        &fake_inventory("t4:1", node).unwrap(),
        node,
        &BTreeMap::new(),
        &HealthMap::default(),
        generation,
        SliceMode::Shared,
        gpupool_driver::devices::Partitioning::Counters,
    )
    .unwrap()
    .remove(0)
}

#[tokio::test]
async fn publisher_keeps_this_nodes_slices_and_leaves_others_alone() {
    let server = ApiServer::start().await.unwrap();
    let client = server.client().await;
    let api: Api<ResourceSlice> = Api::all(client.clone());
    let none = BTreeMap::new();

    // Another node's slice, and a stale one of ours from an earlier layout at generation 3.
    let other = api
        .create(&PostParams::default(), &one_t4_slice("node-b", 9))
        .await
        .unwrap();
    let mut stale = one_t4_slice("node-a", 3);
    stale.metadata.name = Some("node-a-gpupool.dev-7".into());
    api.create(&PostParams::default(), &stale).await.unwrap();

    let inv = fake_inventory("a100-40gb:2", "node-a").unwrap();
    let mut publisher = SlicePublisher::new(client.clone(), "node-a");
    let outcome = publisher
        .reconcile(&inv, &none, &HealthMap::default())
        .await
        .unwrap();
    assert_eq!(
        outcome,
        Outcome::Published {
            generation: 4,
            slices: 1
        }
    );
    let mine = slices_of(&api, "node-a").await;
    assert_eq!(mine.len(), 1, "the stale slice is gone");
    assert_eq!(mine[0].name_any(), "node-a-gpupool.dev-0");
    assert_eq!(mine[0].spec.pool.generation, 4);
    assert_eq!(mine[0].spec.devices.as_ref().unwrap().len(), 2);
    let theirs = slices_of(&api, "node-b").await;
    assert_eq!(
        theirs[0].resource_version(),
        other.resource_version(),
        "node-b untouched"
    );

    // Nothing changed: nothing written, also by a restarted driver.
    assert_eq!(
        publisher
            .reconcile(&inv, &none, &HealthMap::default())
            .await
            .unwrap(),
        Outcome::Unchanged { generation: 4 }
    );
    let mut restarted = SlicePublisher::new(client.clone(), "node-a");
    assert_eq!(
        restarted
            .reconcile(&inv, &none, &HealthMap::default())
            .await
            .unwrap(),
        Outcome::Unchanged { generation: 4 }
    );
    assert_eq!(
        slices_of(&api, "node-a").await[0].resource_version(),
        mine[0].resource_version()
    );

    // A weight appears: same slice, next generation.
    let weights = BTreeMap::from([("A100-SXM4-40GB".to_string(), 312)]);
    assert_eq!(
        restarted
            .reconcile(&inv, &weights, &HealthMap::default())
            .await
            .unwrap(),
        Outcome::Published {
            generation: 5,
            slices: 1
        }
    );
    let d = &slices_of(&api, "node-a").await[0]
        .spec
        .devices
        .clone()
        .unwrap()[0];
    assert_eq!(
        d.attributes.as_ref().unwrap()["computeWeight"].int,
        Some(312)
    );

    // Past 128 devices: two slices of one generation.
    let big = fake_inventory("t4:130", "node-a").unwrap();
    assert_eq!(
        restarted
            .reconcile(&big, &none, &HealthMap::default())
            .await
            .unwrap(),
        Outcome::Published {
            generation: 6,
            slices: 2
        }
    );
    let mine = slices_of(&api, "node-a").await;
    assert_eq!(mine.len(), 2);
    assert!(mine
        .iter()
        .all(|s| s.spec.pool.generation == 6 && s.spec.pool.resource_slice_count == 2));
    assert_eq!(restarted.mode(), SliceMode::Shared);
}

/// The driver process; its log is printed when the test fails.
struct Driver(Child, PathBuf);

fn free_port() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap()
}

/// Status code of a plain HTTP GET, None when nothing answers.
fn http_status(addr: SocketAddr, path: &str) -> Option<u16> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    response.split_whitespace().nth(1)?.parse().ok()
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
        if std::thread::panicking() {
            let log = std::fs::read_to_string(&self.1).unwrap_or_default();
            eprintln!("--- gpupool-driver log ---\n{log}");
        }
    }
}

fn wait_until(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn run_driver(dir: &Path, kubeconfig: &Path, healthz: SocketAddr) -> Driver {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_gpupool-driver"));
    // POD_UID too: these checks are of the sockets' names without one.
    for var in [
        "FAKE_GPUS",
        "NODE_NAME",
        "LOG_FORMAT",
        "HEALTHZ_ADDR",
        "POD_UID",
    ] {
        cmd.env_remove(var);
    }
    cmd.args([
        "run",
        "--node-name",
        "node-a",
        "--fake-gpus",
        "a100-40gb:1,v100-32gb:1",
    ])
    .arg("--kubeconfig")
    .arg(kubeconfig)
    .arg("--registry-dir")
    .arg(dir.join("registry"))
    .arg("--plugin-dir")
    .arg(dir.join("plugins/gpupool.dev"))
    .arg("--cdi-root")
    .arg(dir.join("cdi"))
    .arg("--state-dir")
    .arg(dir.join("state"))
    .arg("--vgpu-lib-dir")
    .arg(dir.join("vgpu"))
    .arg("--healthz-addr")
    .arg(healthz.to_string())
    // Tests run side by side: the default :9464 would be taken by the first one.
    .arg("--metrics-addr")
    .arg("127.0.0.1:0")
    .stdout(Stdio::null())
    .stderr(std::fs::File::create(dir.join("driver.log")).unwrap());
    Driver(cmd.spawn().unwrap(), dir.join("driver.log"))
}

#[tokio::test(flavor = "multi_thread")]
async fn run_publishes_serves_sockets_and_stops_cleanly_on_sigterm() {
    let server = ApiServer::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    server.write_kubeconfig(&kubeconfig).unwrap();
    let reg: PathBuf = dir.path().join("registry/gpupool.dev-reg.sock");
    let dra: PathBuf = dir.path().join("plugins/gpupool.dev/dra.sock");

    let healthz = free_port();
    let mut driver = run_driver(dir.path(), &kubeconfig, healthz);
    let api: Api<ResourceSlice> = Api::all(server.client().await);
    let start = Instant::now();
    let slice = loop {
        if let Some(s) = slices_of(&api, "node-a").await.into_iter().next() {
            break s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "no slice published"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let names: Vec<_> = slice
        .spec
        .devices
        .unwrap()
        .into_iter()
        .map(|d| d.name)
        .collect();
    assert_eq!(names, ["gpu-0", "gpu-1"]);
    wait_until("sockets", Duration::from_secs(20), || {
        reg.exists() && dra.exists()
    });
    wait_until("/healthz 200", Duration::from_secs(20), || {
        http_status(healthz, "/healthz") == Some(200)
    });

    prepare_and_unprepare_over_the_dra_socket(&server, &dra, &dir.path().join("cdi")).await;

    let pid = driver.0.id() as libc::pid_t;
    // SAFETY: signalling our own child process.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let start = Instant::now();
    let status = loop {
        if let Some(status) = driver.0.try_wait().unwrap() {
            break status;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "driver ignored SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status}");
    assert!(!reg.exists() && !dra.exists(), "sockets removed on exit");
}

async fn dra_client(
    path: &Path,
) -> dra_v1::dra_plugin_client::DraPluginClient<tonic::transport::Channel> {
    let path = path.to_path_buf();
    let channel = tonic::transport::Endpoint::try_from("http://[::]:50051")
        .unwrap()
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(path).await?))
            }
        }))
        .await
        .unwrap();
    dra_v1::dra_plugin_client::DraPluginClient::new(channel)
}

/// The kubelet's part, by hand: a claim allocated 8Gi + 50% of gpu-0 is prepared into a CDI spec,
/// and unprepared again.
async fn prepare_and_unprepare_over_the_dra_socket(
    server: &ApiServer,
    dra: &Path,
    cdi_root: &Path,
) {
    let claims: Api<ResourceClaim> = Api::namespaced(server.client().await, "default");
    let claim: ResourceClaim = serde_json::from_value(serde_json::json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "half-a100", "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpupool.dev"}}]}}
    }))
    .unwrap();
    let created = claims.create(&PostParams::default(), &claim).await.unwrap();
    let status = serde_json::json!({"status": {"allocation": {"devices": {"results": [{
        "request": "gpu", "driver": "gpupool.dev", "pool": "node-a", "device": "gpu-0",
        "shareID": "7f3c2a10-0000-4000-8000-000000000001",
        "consumedCapacity": {"memory": "8Gi", "cores": "50"}
    }]}}}});
    claims
        .patch_status("half-a100", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
    let uid = created.metadata.uid.clone().unwrap();
    let request = dra_v1::Claim {
        namespace: "default".into(),
        name: "half-a100".into(),
        uid: uid.clone(),
    };

    let mut dra = dra_client(dra).await;
    let answer = dra
        .node_prepare_resources(dra_v1::NodePrepareResourcesRequest {
            claims: vec![request.clone()],
        })
        .await
        .unwrap()
        .into_inner();
    let prepared = &answer.claims[&uid];
    assert_eq!(prepared.error, "");
    assert_eq!(prepared.devices.len(), 1);
    let device = &prepared.devices[0];
    assert_eq!(
        (device.pool_name.as_str(), device.device_name.as_str()),
        ("node-a", "gpu-0")
    );
    assert_eq!(
        device.share_id.as_deref(),
        Some("7f3c2a10-0000-4000-8000-000000000001")
    );
    assert_eq!(
        device.cdi_device_ids,
        [format!(
            "gpupool.dev/claim={uid}-gpu-0-7f3c2a10-0000-4000-8000-000000000001"
        )]
    );
    let spec_path = cdi_root.join(format!("gpupool.dev-claim_{uid}.json"));
    let spec = std::fs::read_to_string(&spec_path).unwrap();
    assert!(spec.contains("CUDA_DEVICE_MEMORY_LIMIT_0=8192m"), "{spec}");
    assert!(spec.contains("CUDA_DEVICE_SM_LIMIT_0=50"), "{spec}");

    let answer = dra
        .node_unprepare_resources(dra_v1::NodeUnprepareResourcesRequest {
            claims: vec![request],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.claims[&uid].error, "");
    assert!(!spec_path.exists(), "CDI spec removed on unprepare");
}

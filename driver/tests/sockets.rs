//! The kubelet's view of the plugin sockets: registration, DRA v1/v1beta1 and health over real Unix
//! sockets in a temp folder.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use gpupool_api::claim::{ClaimRef, PreparedDevice};
use gpupool_driver::health::HealthMap;
use gpupool_driver::plugin::health::HealthService;
use gpupool_driver::plugin::registration::{RegistrationOutcome, RegistrationService};
use gpupool_driver::plugin::{server, PrepareResults, Preparer, UnprepareResults};
use gpupool_driver::prepare::claim::ClaimError;
use gpupool_driver::prepare::PrepareError;
use gpupool_proto::health_v1alpha1 as health;
use gpupool_proto::registration as reg;
use gpupool_proto::{dra_v1, dra_v1beta1};
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint};

/// Prepares claims named "good-*" on gpu-0 with share "s1"; fails the others.
struct FakePreparer;

#[tonic::async_trait]
impl Preparer for FakePreparer {
    async fn prepare(&self, claims: Vec<ClaimRef>) -> PrepareResults {
        claims
            .into_iter()
            .map(|c| {
                let r = if c.name.starts_with("good") {
                    Ok(vec![PreparedDevice {
                        request_names: vec!["gpu".into()],
                        pool_name: "node-1".into(),
                        device_name: "gpu-0".into(),
                        cdi_device_ids: vec![format!("gpupool.dev/claim={}-gpu-0-s1", c.uid)],
                        share_id: Some("s1".into()),
                    }])
                } else {
                    let why = ClaimError::NotAllocated(c.to_string());
                    Err(PrepareError::new(&c, why))
                };
                (c, r)
            })
            .collect()
    }

    async fn unprepare(&self, claims: Vec<ClaimRef>) -> UnprepareResults {
        claims.into_iter().map(|c| (c, Ok(()))).collect()
    }
}

async fn channel(path: &Path) -> Channel {
    let path: PathBuf = path.to_path_buf();
    Endpoint::try_from("http://[::]:50051")
        .unwrap()
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
        }))
        .await
        .unwrap()
}

fn claim(name: &str, uid: &str) -> dra_v1::Claim {
    dra_v1::Claim {
        namespace: "default".into(),
        name: name.into(),
        uid: uid.into(),
    }
}

/// The DRA socket at `path` for `preparer`, with health for `gpus` of node-1, until `stop`.
fn serve_dra(
    path: &Path,
    preparer: impl Preparer,
    gpus: &[&str],
    stop: &CancellationToken,
) -> (server::ServedSocket, watch::Sender<HealthMap>) {
    let (devices_tx, devices_rx) =
        watch::channel(HealthMap::new(gpus.iter().map(|g| g.to_string())));
    let dra = server::serve_dra(
        path,
        Arc::new(preparer),
        HealthService::new("node-1", devices_rx, stop.clone()),
        stop.clone(),
    )
    .unwrap();
    (dra, devices_tx)
}

#[tokio::test]
async fn kubelet_registers_prepares_and_watches_health_then_sockets_go_away() {
    let dir = tempfile::tempdir().unwrap();
    let reg_path = dir.path().join("registry/gpupool.dev-reg.sock");
    let dra_path = dir.path().join("plugins/gpupool.dev/dra.sock");
    // A stale socket file from an earlier run must not stop the start.
    std::fs::create_dir_all(dra_path.parent().unwrap()).unwrap();
    std::fs::write(&dra_path, b"stale").unwrap();

    let stop = CancellationToken::new();
    let (dra, _devices_tx) = serve_dra(&dra_path, FakePreparer, &["gpu-0", "gpu-1"], &stop);
    let (outcome_tx, mut outcome_rx) = watch::channel(None);
    let registration = server::serve_registration(
        &reg_path,
        RegistrationService::new(dra_path.to_string_lossy(), outcome_tx),
        stop.clone(),
    )
    .unwrap();
    for path in [&reg_path, &dra_path] {
        let mode = std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{}", path.display());
    }

    let mut registrar = reg::registration_client::RegistrationClient::new(channel(&reg_path).await);
    let info = registrar
        .get_info(reg::InfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.r#type, "DRAPlugin");
    assert_eq!(info.name, "gpupool.dev");
    assert_eq!(info.endpoint, dra_path.to_string_lossy());
    assert_eq!(
        info.supported_versions,
        [
            "v1.DRAPlugin",
            "v1beta1.DRAPlugin",
            "v1.DRAResourceHealth",
            "v1alpha1.DRAResourceHealth"
        ]
    );
    registrar
        .notify_registration_status(reg::RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        })
        .await
        .unwrap();
    outcome_rx.wait_for(|o| o.is_some()).await.unwrap();
    assert_eq!(*outcome_rx.borrow(), Some(RegistrationOutcome::Registered));

    let dra_channel = channel(&dra_path).await;
    let mut v1 = dra_v1::dra_plugin_client::DraPluginClient::new(dra_channel.clone());
    let answer = v1
        .node_prepare_resources(dra_v1::NodePrepareResourcesRequest {
            claims: vec![claim("good-a", "uid-a"), claim("bad-b", "uid-b")],
        })
        .await
        .unwrap()
        .into_inner();
    let a = &answer.claims["uid-a"];
    assert_eq!(a.error, "");
    assert_eq!(a.devices[0].share_id.as_deref(), Some("s1"));
    assert_eq!(
        a.devices[0].cdi_device_ids,
        ["gpupool.dev/claim=uid-a-gpu-0-s1"]
    );
    assert_eq!(a.devices[0].request_names, ["gpu"]);
    assert!(answer.claims["uid-b"].error.contains("default/bad-b"));
    assert!(answer.claims["uid-b"].devices.is_empty());

    let mut beta = dra_v1beta1::dra_plugin_client::DraPluginClient::new(dra_channel.clone());
    let answer = beta
        .node_prepare_resources(dra_v1beta1::NodePrepareResourcesRequest {
            claims: vec![dra_v1beta1::Claim {
                namespace: "default".into(),
                name: "good-c".into(),
                uid: "uid-c".into(),
            }],
        })
        .await
        .unwrap()
        .into_inner();
    let c = &answer.claims["uid-c"];
    assert_eq!(
        (
            c.devices[0].pool_name.as_str(),
            c.devices[0].device_name.as_str()
        ),
        ("node-1", "gpu-0")
    );
    let un = v1
        .node_unprepare_resources(dra_v1::NodeUnprepareResourcesRequest {
            claims: vec![claim("good-a", "uid-a")],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(un.claims["uid-a"].error, "");

    // A 1.37+ kubelet asks for v1: the same list.
    let mut watcher_v1 =
        gpupool_proto::health_v1::dra_resource_health_client::DraResourceHealthClient::new(
            dra_channel.clone(),
        );
    let first_v1 = watcher_v1
        .node_watch_resources(gpupool_proto::health_v1::NodeWatchResourcesRequest {})
        .await
        .unwrap()
        .into_inner()
        .message()
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first_v1.devices.len(), 2);
    assert!(first_v1
        .devices
        .iter()
        .all(|d| d.health == gpupool_proto::health_v1::HealthStatus::Healthy as i32));
    drop(watcher_v1);

    let mut watcher = health::dra_resource_health_client::DraResourceHealthClient::new(dra_channel);
    let mut stream = watcher
        .node_watch_resources(health::NodeWatchResourcesRequest {})
        .await
        .unwrap()
        .into_inner();
    let first = stream.message().await.unwrap().unwrap();
    let names: Vec<_> = first
        .devices
        .iter()
        .map(|d| d.device.as_ref().unwrap().device_name.as_str())
        .collect();
    assert_eq!(names, ["gpu-0", "gpu-1"]);
    assert!(first
        .devices
        .iter()
        .all(|d| d.health == health::HealthStatus::Healthy as i32));
    assert!(first.devices[0].last_updated_time > 1_600_000_000);

    stop.cancel();
    drop(registrar);
    drop(v1);
    drop(beta);
    drop(watcher);
    drop(stream);
    tokio::time::timeout(std::time::Duration::from_secs(10), async {
        registration.finish().await.unwrap();
        dra.finish().await.unwrap();
    })
    .await
    .expect("servers stop after the stop signal");
    assert!(!reg_path.exists());
    assert!(!dra_path.exists());
}

/// Takes a while to prepare, like a claim whose API read is slow.
struct SlowPreparer;

#[tonic::async_trait]
impl Preparer for SlowPreparer {
    async fn prepare(&self, claims: Vec<ClaimRef>) -> PrepareResults {
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        FakePreparer.prepare(claims).await
    }

    async fn unprepare(&self, claims: Vec<ClaimRef>) -> UnprepareResults {
        FakePreparer.unprepare(claims).await
    }
}

#[tokio::test]
async fn a_call_in_flight_at_shutdown_still_gets_its_answer() {
    let dir = tempfile::tempdir().unwrap();
    let dra_path = dir.path().join("dra.sock");
    let stop = CancellationToken::new();
    let (dra, _devices_tx) = serve_dra(&dra_path, SlowPreparer, &["gpu-0"], &stop);
    let mut client = dra_v1::dra_plugin_client::DraPluginClient::new(channel(&dra_path).await);
    let call = tokio::spawn(async move {
        client
            .node_prepare_resources(dra_v1::NodePrepareResourcesRequest {
                claims: vec![claim("good-slow", "uid-slow")],
            })
            .await
    });
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    stop.cancel();
    let answer = call
        .await
        .unwrap()
        .expect("the in-flight call completes")
        .into_inner();
    assert_eq!(answer.claims["uid-slow"].error, "");
    tokio::time::timeout(std::time::Duration::from_secs(10), dra.finish())
        .await
        .expect("server stops once the call is answered")
        .unwrap();
    assert!(!dra_path.exists());
    assert!(
        UnixStream::connect(&dra_path).await.is_err(),
        "no new connections after shutdown"
    );
}

//! The kubelet emulator against an in-process plugin that records what the kubelet told it: the
//! registration handshake (version choice, rejection) and the DRA calls, without the real driver.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpupool_e2e::kubelet::{ClaimRef, DraVersion, Kubelet, KubeletConfig};
use gpupool_proto::{dra_v1, dra_v1beta1, registration};
use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};

#[derive(Clone)]
struct FakePlugin {
    plugin_type: String,
    endpoint: PathBuf,
    versions: Vec<String>,
    notified: Arc<Mutex<Vec<registration::RegistrationStatus>>>,
}

#[tonic::async_trait]
impl registration::registration_server::Registration for FakePlugin {
    async fn get_info(
        &self,
        _: Request<registration::InfoRequest>,
    ) -> Result<Response<registration::PluginInfo>, Status> {
        Ok(Response::new(registration::PluginInfo {
            r#type: self.plugin_type.clone(),
            name: "fake.gpupool.dev".into(),
            endpoint: self.endpoint.display().to_string(),
            supported_versions: self.versions.clone(),
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<registration::RegistrationStatus>,
    ) -> Result<Response<registration::RegistrationStatusResponse>, Status> {
        self.notified.lock().unwrap().push(request.into_inner());
        Ok(Response::new(registration::RegistrationStatusResponse {}))
    }
}

/// Answers each claim with one device whose CDI id names the claim; a claim named "bad" fails.
#[derive(Clone)]
struct FakeDra;

#[tonic::async_trait]
impl dra_v1::dra_plugin_server::DraPlugin for FakeDra {
    async fn node_prepare_resources(
        &self,
        request: Request<dra_v1::NodePrepareResourcesRequest>,
    ) -> Result<Response<dra_v1::NodePrepareResourcesResponse>, Status> {
        let claims = request
            .into_inner()
            .claims
            .into_iter()
            .map(|c| {
                let response = if c.name == "bad" {
                    dra_v1::NodePrepareResourceResponse {
                        devices: vec![],
                        error: format!("claim {}/{}: refused", c.namespace, c.name),
                    }
                } else {
                    dra_v1::NodePrepareResourceResponse {
                        devices: vec![dra_v1::Device {
                            request_names: vec!["gpu".into()],
                            pool_name: "node-a".into(),
                            device_name: "gpu-0".into(),
                            cdi_device_ids: vec![format!("gpupool.dev/claim={}-gpu-0-s1", c.uid)],
                            share_id: Some("s1".into()),
                        }],
                        error: String::new(),
                    }
                };
                (c.uid, response)
            })
            .collect::<HashMap<_, _>>();
        Ok(Response::new(dra_v1::NodePrepareResourcesResponse {
            claims,
        }))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<dra_v1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<dra_v1::NodeUnprepareResourcesResponse>, Status> {
        let claims = request
            .into_inner()
            .claims
            .into_iter()
            .map(|c| {
                (
                    c.uid,
                    dra_v1::NodeUnprepareResourceResponse {
                        error: String::new(),
                    },
                )
            })
            .collect();
        Ok(Response::new(dra_v1::NodeUnprepareResourcesResponse {
            claims,
        }))
    }
}

#[tonic::async_trait]
impl dra_v1beta1::dra_plugin_server::DraPlugin for FakeDra {
    async fn node_prepare_resources(
        &self,
        request: Request<dra_v1beta1::NodePrepareResourcesRequest>,
    ) -> Result<Response<dra_v1beta1::NodePrepareResourcesResponse>, Status> {
        let claims = request
            .into_inner()
            .claims
            .into_iter()
            .map(|c| {
                let device = dra_v1beta1::Device {
                    request_names: vec!["gpu".into()],
                    pool_name: "node-a".into(),
                    device_name: "gpu-0".into(),
                    cdi_device_ids: vec![format!("gpupool.dev/claim={}-gpu-0", c.uid)],
                };
                let response = dra_v1beta1::NodePrepareResourceResponse {
                    devices: vec![device],
                    error: String::new(),
                };
                (c.uid, response)
            })
            .collect();
        Ok(Response::new(dra_v1beta1::NodePrepareResourcesResponse {
            claims,
        }))
    }

    async fn node_unprepare_resources(
        &self,
        _: Request<dra_v1beta1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<dra_v1beta1::NodeUnprepareResourcesResponse>, Status> {
        Ok(Response::new(
            dra_v1beta1::NodeUnprepareResourcesResponse::default(),
        ))
    }
}

/// Serves the fake plugin: registration on `<registry>/fake.gpupool.dev-reg.sock`, DRA on `<plugin>/dra.sock`.
fn serve_plugin(registry: &Path, plugin_dir: &Path, plugin: FakePlugin) {
    let reg_listener = UnixListener::bind(registry.join("fake.gpupool.dev-reg.sock")).unwrap();
    let dra_listener = UnixListener::bind(plugin_dir.join("dra.sock")).unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(registration::registration_server::RegistrationServer::new(
                plugin,
            ))
            .serve_with_incoming(UnixListenerStream::new(reg_listener)),
    );
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(dra_v1::dra_plugin_server::DraPluginServer::new(FakeDra))
            .add_service(dra_v1beta1::dra_plugin_server::DraPluginServer::new(
                FakeDra,
            ))
            .serve_with_incoming(UnixListenerStream::new(dra_listener)),
    );
}

/// A kube client that is never used: these kubelets neither register a node nor watch pods.
fn offline_client() -> kube::Client {
    let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
    kube::Client::try_from(config).unwrap()
}

fn offline_kubelet_config(registry: &Path, known: &[&str]) -> KubeletConfig {
    let mut config = KubeletConfig::new("node-a", registry);
    config.known_versions = known.iter().map(|s| s.to_string()).collect();
    config.register_node = false;
    config.manage_pods = false;
    config
}

struct Setup {
    _dir: tempfile::TempDir,
    registry: PathBuf,
    notified: Arc<Mutex<Vec<registration::RegistrationStatus>>>,
}

fn setup(plugin_type: &str, versions: &[&str]) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let registry = dir.path().join("registry");
    let plugins = dir.path().join("plugin");
    std::fs::create_dir_all(&registry).unwrap();
    std::fs::create_dir_all(&plugins).unwrap();
    let notified = Arc::new(Mutex::new(Vec::new()));
    serve_plugin(
        &registry,
        &plugins,
        FakePlugin {
            plugin_type: plugin_type.into(),
            endpoint: plugins.join("dra.sock"),
            versions: versions.iter().map(|s| s.to_string()).collect(),
            notified: notified.clone(),
        },
    );
    Setup {
        _dir: dir,
        registry,
        notified,
    }
}

const BOTH: [&str; 3] = [
    "v1beta1.DRAPlugin",
    "v1.DRAPlugin",
    "v1alpha1.DRAResourceHealth",
];

#[tokio::test]
async fn registers_with_v1_and_prepares_per_claim() {
    let setup = setup("DRAPlugin", &BOTH);
    let kubelet = Kubelet::start(
        offline_client(),
        offline_kubelet_config(&setup.registry, &["v1.DRAPlugin", "v1beta1.DRAPlugin"]),
    )
    .await
    .unwrap();
    let reg = kubelet
        .wait_for_registration("fake.gpupool.dev", Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(reg.version, DraVersion::V1);
    assert!(reg.health_advertised);
    let notified = setup.notified.lock().unwrap().clone();
    assert_eq!(notified.len(), 1);
    assert!(notified[0].plugin_registered, "{notified:?}");

    let good = ClaimRef {
        namespace: "default".into(),
        name: "good".into(),
        uid: "uid-good".into(),
    };
    let bad = ClaimRef {
        namespace: "default".into(),
        name: "bad".into(),
        uid: "uid-bad".into(),
    };
    let outcome = kubelet
        .prepare("fake.gpupool.dev", &[good, bad])
        .await
        .unwrap();
    let devices = outcome["uid-good"].as_ref().unwrap();
    assert_eq!(devices[0].share_id.as_deref(), Some("s1"));
    assert_eq!(
        devices[0].cdi_device_ids,
        ["gpupool.dev/claim=uid-good-gpu-0-s1"]
    );
    assert!(outcome["uid-bad"]
        .as_ref()
        .unwrap_err()
        .contains("default/bad"));
}

#[tokio::test]
async fn an_old_kubelet_picks_v1beta1() {
    let setup = setup("DRAPlugin", &BOTH);
    let kubelet = Kubelet::start(
        offline_client(),
        offline_kubelet_config(&setup.registry, &["v1beta1.DRAPlugin"]),
    )
    .await
    .unwrap();
    let reg = kubelet
        .wait_for_registration("fake.gpupool.dev", Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(reg.version, DraVersion::V1beta1);
    let claim = ClaimRef {
        namespace: "default".into(),
        name: "c".into(),
        uid: "uid-c".into(),
    };
    let outcome = kubelet.prepare("fake.gpupool.dev", &[claim]).await.unwrap();
    let devices = outcome["uid-c"].as_ref().unwrap();
    assert_eq!(devices[0].cdi_device_ids, ["gpupool.dev/claim=uid-c-gpu-0"]);
    assert_eq!(devices[0].share_id, None);
}

#[tokio::test]
async fn a_plugin_with_no_common_version_or_wrong_type_is_told_why() {
    for (plugin_type, versions, expected) in [
        (
            "DRAPlugin",
            &["k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"][..],
            "none of the versions",
        ),
        ("CSIPlugin", &BOTH[..], "CSIPlugin"),
    ] {
        let setup = setup(plugin_type, versions);
        let kubelet = Kubelet::start(
            offline_client(),
            offline_kubelet_config(&setup.registry, &["v1.DRAPlugin", "v1beta1.DRAPlugin"]),
        )
        .await
        .unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while kubelet.rejections().is_empty() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let rejections = kubelet.rejections();
        assert_eq!(rejections.len(), 1, "{plugin_type}: {rejections:?}");
        assert!(rejections[0].error.contains(expected), "{rejections:?}");
        assert!(kubelet.registrations().is_empty());
        let notified = setup.notified.lock().unwrap().clone();
        assert!(!notified[0].plugin_registered);
        assert!(notified[0].error.contains(expected), "{notified:?}");
        assert!(matches!(
            kubelet.prepare("fake.gpupool.dev", &[]).await,
            Err(gpupool_e2e::kubelet::KubeletError::NotRegistered(_))
        ));
    }
}

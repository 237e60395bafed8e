//! The kubelet emulator against an in-process plugin that records what the kubelet told it: the
//! registration handshake (version choice, rejection, retries with backoff), the DRA calls and the
//! pod status it writes from the health stream; then the same pod status with the real driver.

mod common;

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::TryStreamExt;
use gpupool_api::claim::ClaimRef;
use gpupool_e2e::harness::objects::{self, pod_yaml};
use gpupool_e2e::harness::{wait_for, Backend, NodeSpec};
use gpupool_e2e::kubelet::{DraVersion, Kubelet, KubeletConfig, Registration};
use gpupool_proto::health_v1alpha1::{self as health, HealthStatus};
use gpupool_proto::{dra_v1, dra_v1beta1, registration};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{json, Value};
use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};

#[derive(Clone)]
struct FakePlugin {
    plugin_type: String,
    endpoint: PathBuf,
    versions: Vec<String>,
    notified: Arc<Mutex<Vec<registration::RegistrationStatus>>>,
}

impl FakePlugin {
    /// A plugin of `plugin_type` serving DRA at `endpoint`, nothing heard from the kubelet yet.
    fn new(plugin_type: &str, endpoint: PathBuf, versions: &[&str]) -> FakePlugin {
        FakePlugin {
            plugin_type: plugin_type.into(),
            endpoint,
            versions: versions.iter().map(|s| s.to_string()).collect(),
            notified: Arc::default(),
        }
    }
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

/// `FakeDra` in one DRA version; `$device` makes the device of a claim uid.
macro_rules! fake_dra {
    ($dra:ident, $device:expr) => {
        #[tonic::async_trait]
        impl $dra::dra_plugin_server::DraPlugin for FakeDra {
            async fn node_prepare_resources(
                &self,
                request: Request<$dra::NodePrepareResourcesRequest>,
            ) -> Result<Response<$dra::NodePrepareResourcesResponse>, Status> {
                let device: fn(&str) -> $dra::Device = $device;
                let claims = request
                    .into_inner()
                    .claims
                    .into_iter()
                    .map(|c| {
                        let response = if c.name == "bad" {
                            $dra::NodePrepareResourceResponse {
                                devices: vec![],
                                error: format!("claim {}/{}: refused", c.namespace, c.name),
                            }
                        } else {
                            $dra::NodePrepareResourceResponse {
                                devices: vec![device(&c.uid)],
                                error: String::new(),
                            }
                        };
                        (c.uid, response)
                    })
                    .collect();
                Ok(Response::new($dra::NodePrepareResourcesResponse { claims }))
            }

            async fn node_unprepare_resources(
                &self,
                request: Request<$dra::NodeUnprepareResourcesRequest>,
            ) -> Result<Response<$dra::NodeUnprepareResourcesResponse>, Status> {
                let claims = request
                    .into_inner()
                    .claims
                    .into_iter()
                    .map(|c| (c.uid, $dra::NodeUnprepareResourceResponse::default()))
                    .collect();
                Ok(Response::new($dra::NodeUnprepareResourcesResponse {
                    claims,
                }))
            }
        }
    };
}

fake_dra!(dra_v1, |uid| dra_v1::Device {
    request_names: vec!["gpu".into()],
    pool_name: "node-a".into(),
    device_name: "gpu-0".into(),
    cdi_device_ids: vec![format!("gpupool.dev/claim={uid}-gpu-0-s1")],
    share_id: Some("s1".into()),
});
fake_dra!(dra_v1beta1, |uid| dra_v1beta1::Device {
    request_names: vec!["gpu".into()],
    pool_name: "node-a".into(),
    device_name: "gpu-0".into(),
    cdi_device_ids: vec![format!("gpupool.dev/claim={uid}-gpu-0")],
});

/// Streams the health of `node-a/gpu-0`: the value in the channel every 100 ms, nothing while it
/// is `None` (a plugin gone quiet, its stream still open).
#[derive(Clone)]
struct FakeHealth(watch::Receiver<Option<HealthStatus>>);

type HealthStream =
    Pin<Box<dyn futures::Stream<Item = Result<health::NodeWatchResourcesResponse, Status>> + Send>>;

#[tonic::async_trait]
impl health::dra_resource_health_server::DraResourceHealth for FakeHealth {
    type NodeWatchResourcesStream = HealthStream;

    async fn node_watch_resources(
        &self,
        _: Request<health::NodeWatchResourcesRequest>,
    ) -> Result<Response<HealthStream>, Status> {
        let stream = futures::stream::unfold(self.0.clone(), |current| async move {
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                let Some(status) = *current.borrow() else {
                    continue;
                };
                let report = health::NodeWatchResourcesResponse {
                    devices: vec![health::DeviceHealth {
                        device: Some(health::DeviceIdentifier {
                            pool_name: "node-a".into(),
                            device_name: "gpu-0".into(),
                        }),
                        health: status as i32,
                        last_updated_time: 0,
                        health_check_timeout_seconds: 0,
                        message: String::new(),
                    }],
                };
                return Some((Ok(report), current));
            }
        });
        Ok(Response::new(Box::pin(stream)))
    }
}

fn serve_named_plugin(
    registration_socket: &Path,
    dra_socket: &Path,
    plugin: FakePlugin,
    health: Option<FakeHealth>,
) {
    let reg_listener = UnixListener::bind(registration_socket).unwrap();
    let dra_listener = UnixListener::bind(dra_socket).unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(registration::registration_server::RegistrationServer::new(
                plugin,
            ))
            // The kubelet's registration requests carry the socket path as `:authority`, which a
            // plain tonic server refuses; the driver's repair makes this fake accept them too.
            .serve_with_incoming(
                UnixListenerStream::new(reg_listener)
                    .map_ok(gpupool_driver::plugin::authority::AuthorityRepair::new),
            ),
    );
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(dra_v1::dra_plugin_server::DraPluginServer::new(FakeDra))
            .add_service(dra_v1beta1::dra_plugin_server::DraPluginServer::new(
                FakeDra,
            ))
            .add_optional_service(
                health.map(health::dra_resource_health_server::DraResourceHealthServer::new),
            )
            .serve_with_incoming(UnixListenerStream::new(dra_listener)),
    );
}

/// A kubelet on `registry` speaking the `known` versions, with a kube client that is never used:
/// it neither registers a node nor watches pods.
async fn offline_kubelet(registry: &Path, known: &[&str]) -> Kubelet {
    let client =
        kube::Client::try_from(kube::Config::new("http://127.0.0.1:9".parse().unwrap())).unwrap();
    let mut config = KubeletConfig::new("node-a", registry);
    config.known_versions = known.iter().map(|s| s.to_string()).collect();
    config.register_node = false;
    config.manage_pods = false;
    Kubelet::start(client, config).await.unwrap()
}

/// The fake plugin's registration, once the kubelet has it.
async fn fake_registration(kubelet: &Kubelet) -> Registration {
    kubelet
        .wait_for_registration("fake.gpupool.dev", Duration::from_secs(5))
        .await
        .unwrap()
}

struct Setup {
    _dir: tempfile::TempDir,
    registry: PathBuf,
    notified: Arc<Mutex<Vec<registration::RegistrationStatus>>>,
}

fn setup(plugin_type: &str, versions: &[&str]) -> Setup {
    setup_with_health(plugin_type, versions, None)
}

/// Serves the fake plugin: registration on `<registry>/fake.gpupool.dev-reg.sock`, DRA (and
/// `health` when given) on `<plugin>/dra.sock`.
fn setup_with_health(plugin_type: &str, versions: &[&str], health: Option<FakeHealth>) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let registry = dir.path().join("registry");
    let plugins = dir.path().join("plugin");
    std::fs::create_dir_all(&registry).unwrap();
    std::fs::create_dir_all(&plugins).unwrap();
    let endpoint = plugins.join("dra.sock");
    let plugin = FakePlugin::new(plugin_type, endpoint.clone(), versions);
    let notified = plugin.notified.clone();
    serve_named_plugin(
        &registry.join("fake.gpupool.dev-reg.sock"),
        &endpoint,
        plugin,
        health,
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
    let kubelet = offline_kubelet(&setup.registry, &["v1.DRAPlugin", "v1beta1.DRAPlugin"]).await;
    let reg = fake_registration(&kubelet).await;
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

/// A rolling update's two instances: the kubelet calls the newest, and when the newest goes
/// away first (a failed upgrade), it falls back to the older one still serving.
#[tokio::test]
async fn the_newest_registration_wins_and_an_older_one_takes_over_when_it_goes() {
    let dir = tempfile::tempdir().unwrap();
    let registry = dir.path().join("registry");
    std::fs::create_dir_all(&registry).unwrap();
    let instance = |name: &str| {
        let plugin_dir = dir.path().join(name);
        std::fs::create_dir_all(&plugin_dir).unwrap();
        let socket = registry.join(format!("fake.gpupool.dev-{name}-reg.sock"));
        let endpoint = plugin_dir.join(format!("dra-{name}.sock"));
        serve_named_plugin(
            &socket,
            &endpoint,
            FakePlugin::new("DRAPlugin", endpoint.clone(), &BOTH),
            None,
        );
        (socket, endpoint)
    };
    let (socket_a, endpoint_a) = instance("a");
    let kubelet = offline_kubelet(&registry, &["v1.DRAPlugin"]).await;
    let first = fake_registration(&kubelet).await;
    assert_eq!(first.socket, socket_a);

    let (socket_b, endpoint_b) = instance("b");
    let registered = |socket: PathBuf| {
        let kubelet = &kubelet;
        async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            loop {
                let current = kubelet.registration("fake.gpupool.dev");
                if current.as_ref().is_some_and(|r| r.socket == socket) {
                    return current.unwrap();
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "still {current:?}, want {}",
                    socket.display()
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    assert_eq!(registered(socket_b.clone()).await.endpoint, endpoint_b);

    // B stops first: its socket goes, A's registration is used again, without A registering anew.
    std::fs::remove_file(&socket_b).unwrap();
    let back = registered(socket_a.clone()).await;
    assert_eq!(back.endpoint, endpoint_a);
    assert_eq!(back.sequence, first.sequence);
    let claim = ClaimRef {
        namespace: "default".into(),
        name: "after-fallback".into(),
        uid: "uid-after-fallback".into(),
    };
    let outcome = kubelet.prepare("fake.gpupool.dev", &[claim]).await.unwrap();
    assert!(outcome["uid-after-fallback"].is_ok(), "{outcome:?}");
}

#[tokio::test]
async fn an_old_kubelet_picks_v1beta1() {
    let setup = setup("DRAPlugin", &BOTH);
    let kubelet = offline_kubelet(&setup.registry, &["v1beta1.DRAPlugin"]).await;
    let reg = fake_registration(&kubelet).await;
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
        let kubelet =
            offline_kubelet(&setup.registry, &["v1.DRAPlugin", "v1beta1.DRAPlugin"]).await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        // The kubelet books its verdict before telling the plugin: wait for both.
        let told = || !setup.notified.lock().unwrap().is_empty();
        while (kubelet.rejections().is_empty() || !told()) && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Like the kubelet, a refused plugin is asked again after a backoff and told again why.
        let rejections = kubelet.rejections();
        assert!(!rejections.is_empty(), "{plugin_type}: {rejections:?}");
        assert!(
            rejections.iter().all(|r| r.error.contains(expected)),
            "{rejections:?}"
        );
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

#[tokio::test]
async fn a_registration_socket_that_does_not_answer_is_retried_with_growing_intervals() {
    let dir = tempfile::tempdir().unwrap();
    let registry = dir.path().join("registry");
    std::fs::create_dir_all(&registry).unwrap();
    // A socket file nobody listens on any more (a plugin that died), and one that hangs up at once.
    let dead = registry.join("dead.gpupool.dev-reg.sock");
    drop(std::os::unix::net::UnixListener::bind(&dead).unwrap());
    let rude = registry.join("rude.gpupool.dev-reg.sock");
    let listener = std::os::unix::net::UnixListener::bind(&rude).unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            drop(stream);
        }
    });
    let kubelet = offline_kubelet(&registry, &["v1.DRAPlugin"]).await;
    // Attempts at about 0, 0.5, 1.5 and 3.5 s; a kubelet polling every 100 ms without backoff
    // would have made about 40.
    tokio::time::sleep(Duration::from_millis(4200)).await;
    for socket in [&dead, &rude] {
        let attempts = kubelet
            .registration_attempts(socket)
            .unwrap_or_else(|| panic!("{} was never tried", socket.display()));
        let started = &attempts.started;
        assert!(
            (3..=5).contains(&started.len()),
            "{}: {attempts:?}",
            socket.display()
        );
        assert_eq!(attempts.failures as usize, started.len(), "{attempts:?}");
        let gaps: Vec<Duration> = started.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(gaps[0] >= Duration::from_millis(500), "{gaps:?}");
        for pair in gaps.windows(2) {
            assert!(
                pair[1] >= pair[0] + pair[0] / 2,
                "growing intervals: {gaps:?}"
            );
        }
        let next = attempts.next_attempt.expect("another attempt is planned");
        assert!(
            next - *started.last().unwrap()
                >= gpupool_e2e::kubelet::registration_retry_delay(attempts.failures),
            "{attempts:?}"
        );
    }
    assert!(kubelet.registrations().is_empty());
}

async fn api_client(server: &gpupool_apiserver::ApiServer) -> kube::Client {
    let kubeconfig = kube::config::Kubeconfig::from_yaml(&server.kubeconfig_yaml()).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    kube::Client::try_from(config).unwrap()
}

/// `status.containerStatuses` of a pod as JSON (`null` when not written yet).
async fn container_statuses(pods: &Api<Pod>, name: &str) -> Value {
    let pod = pods.get(name).await.unwrap();
    serde_json::to_value(pod.status.and_then(|s| s.container_statuses)).unwrap()
}

#[tokio::test]
async fn a_running_pod_carries_ready_containers_and_the_health_the_plugin_streams() {
    let (set_health, health) = watch::channel(Some(HealthStatus::Healthy));
    let setup = setup_with_health("DRAPlugin", &BOTH, Some(FakeHealth(health)));
    let server = gpupool_apiserver::ApiServer::start().await.unwrap();
    let client = api_client(&server).await;

    // What the scheduler and the resourceclaim controller would have left: a pod bound to the
    // node, its template claim named in its status, the claim allocated and reserved for it.
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "p"},
        "spec": {"nodeName": "node-a",
                 "containers": [{"name": "main", "image": "busybox",
                                 "resources": {"claims": [{"name": "gpu"}]}}],
                 "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "half"}]}
    }))
    .unwrap();
    let pod = pods.create(&PostParams::default(), &pod).await.unwrap();
    let pod_uid = pod.metadata.uid.clone().unwrap();
    let statuses = json!({"status": {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "p-gpu-x1"}]}});
    pods.patch_status("p", &PatchParams::default(), &Patch::Merge(&statuses))
        .await
        .unwrap();
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": "p-gpu-x1"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "x"}}]}}
    }))
    .unwrap();
    let mut claim = claims.create(&PostParams::default(), &claim).await.unwrap();
    let claim_uid = claim.metadata.uid.clone().unwrap();
    claim.status = Some(
        serde_json::from_value(json!({
            "allocation": {"devices": {"results": [
                {"driver": "fake.gpupool.dev", "pool": "node-a", "device": "gpu-0", "request": "gpu"}]}},
            "reservedFor": [{"resource": "pods", "name": "p", "uid": pod_uid}]
        }))
        .unwrap(),
    );
    claims
        .replace_status("p-gpu-x1", &PostParams::default(), &claim)
        .await
        .unwrap();

    let mut config = KubeletConfig::new("node-a", &setup.registry);
    config.health_timeout = Duration::from_millis(1500);
    let _kubelet = Kubelet::start(client.clone(), config).await.unwrap();

    let cdi_id = format!("gpupool.dev/claim={claim_uid}-gpu-0-s1");
    let expect = |health: &str| json!([{"name": "claim:gpu", "resources": [{"resourceID": cdi_id, "health": health}]}]);
    for (step, health) in [
        (Some(HealthStatus::Healthy), "Healthy"),
        (Some(HealthStatus::Unhealthy), "Unhealthy"),
        // Quiet for longer than the timeout: the kubelet no longer vouches for the device.
        (None, "Unknown"),
    ] {
        set_health.send(step).unwrap();
        let wanted = expect(health);
        let seen = match wait_for(
            &format!("the pod status to show {health}"),
            Duration::from_secs(10),
            || async {
                let statuses = container_statuses(&pods, "p").await;
                (statuses[0]["allocatedResourcesStatus"] == wanted).then_some(statuses)
            },
        )
        .await
        {
            Ok(seen) => seen,
            Err(e) => panic!("{e}: {}", container_statuses(&pods, "p").await),
        };
        assert_eq!(seen[0]["name"], "main");
        assert_eq!(seen[0]["ready"], true, "{seen}");
        assert_eq!(seen[0]["started"], true, "{seen}");
        assert!(
            seen[0]["state"]["running"]["startedAt"].is_string(),
            "{seen}"
        );
    }
    let pod = pods.get("p").await.unwrap();
    let status = pod.status.unwrap();
    assert_eq!(status.phase.as_deref(), Some("Running"));
    let conditions: Vec<(String, String)> = status
        .conditions
        .unwrap_or_default()
        .into_iter()
        .map(|c| (c.type_, c.status))
        .collect();
    for wanted in [
        "PodReadyToStartContainers",
        "Initialized",
        "ContainersReady",
        "Ready",
    ] {
        assert!(
            conditions.contains(&(wanted.to_string(), "True".to_string())),
            "{conditions:?}"
        );
    }
}

/// The real driver on fake GPUs: what `kubectl get pods` and the pod's status show a user.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_with_a_gpupool_claim_shows_ready_and_healthy() {
    let cluster =
        common::start_node(NodeSpec::new("node-h", "a100-40gb:1"), Backend::Emulator).await;
    let _logs = cluster.logs_on_failure();
    common::apply_device_class(&cluster).await;
    let ns = cluster.create_namespace("e2e-pod-status").await.unwrap();
    let quarter = objects::Request::new("gpu").memory("4Gi").cores("25");
    common::run_from_template(&cluster, &ns, "trainer", "quarter", &[quarter]).await;

    let pods: Api<Pod> = Api::namespaced(cluster.client(), &ns);
    let status = pods.get("trainer").await.unwrap().status.unwrap();
    let claim_name = status.resource_claim_statuses.unwrap()[0]
        .resource_claim_name
        .clone()
        .unwrap();
    let claim = common::claim(&cluster, &ns, &claim_name).await;
    let prepared =
        common::prepared(cluster.node_at(0), claim.metadata.uid.as_deref().unwrap()).await;
    let cdi_id = prepared.devices[0].cdi_device_ids[0].clone();
    let wanted =
        json!([{"name": "claim:gpu", "resources": [{"resourceID": cdi_id, "health": "Healthy"}]}]);
    let shown = wait_for(
        "the device health in the pod status",
        common::TIMEOUT,
        || async {
            let statuses = container_statuses(&pods, "trainer").await;
            (statuses[0]["allocatedResourcesStatus"] == wanted && statuses[0]["ready"] == true)
                .then_some(())
        },
    )
    .await;
    if let Err(e) = shown {
        panic!("{e}: {}", container_statuses(&pods, "trainer").await);
    }

    // A claim the pod names directly is prepared too; the v1.36 kubelet reports no health for it.
    let request = objects::Request::new("gpu").memory("1Gi");
    common::apply_claim(&cluster, &ns, "direct", &[request]).await;
    common::apply(&cluster, &ns, &pod_yaml("direct", &["direct"])).await;
    common::wait_pod_running(&cluster, &ns, "direct").await;
    let statuses = container_statuses(&pods, "direct").await;
    assert_eq!(statuses[0]["ready"], true, "{statuses}");
    assert!(
        statuses[0].get("allocatedResourcesStatus").is_none(),
        "{statuses}"
    );

    if gpupool_e2e::harness::kubectl_path().is_none() {
        eprintln!("skipped the kubectl check: kubectl not found");
        return;
    }
    let table = cluster
        .kubectl(&["get", "pods", "-n", &ns, "--no-headers"])
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    for name in ["trainer", "direct"] {
        let line = table
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("{name} in\n{table}"));
        let columns: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(columns[1..3], ["1/1", "Running"], "{table}");
    }
}

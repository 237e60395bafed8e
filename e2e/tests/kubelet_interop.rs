//! The driver's sockets as the real kubelet reaches them: the plugin watcher dials the
//! registration socket with grpc-go and the bare socket path as target, so `:authority` is that
//! path; the DRA client dials `unix:<path>` (authority `localhost`). A tonic client always sends
//! `localhost`, which is how every test passed while a real kubelet could not register the driver.

use std::path::Path;
use std::time::Duration;

use gpupool_api::names::DRIVER_NAME;
use gpupool_driver::plugin::registration::RegistrationService;
use gpupool_e2e::grpc::path_authority::{PathAuthorityConnection, PathAuthorityError};
use gpupool_e2e::harness::{Backend, ClusterSpec, TestCluster};
use gpupool_proto::{dra_v1, registration, versions, DRA_PLUGIN_TYPE};
use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;

const GET_INFO: &str = "/pluginregistration.Registration/GetInfo";
const NOTIFY: &str = "/pluginregistration.Registration/NotifyRegistrationStatus";
const UNPREPARE: &str = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources";
const CALL: Duration = Duration::from_secs(10);

#[tokio::test]
async fn the_driver_answers_registration_calls_that_carry_the_socket_path_as_authority() {
    let spec = ClusterSpec {
        backend: Some(Backend::Emulator),
        ..ClusterSpec::new().node("node-interop", "a100-40gb:1")
    };
    let cluster = TestCluster::start(spec)
        .await
        .expect("cluster starts and the driver registers with the emulated kubelet");
    let _logs = cluster.logs_on_failure();
    let node = cluster.node_at(0);
    let registration = node
        .kubelet()
        .registration(DRIVER_NAME)
        .expect("registered through the path-authority client");

    // The same calls again, by hand, on one connection: the second request refers to the path
    // through HPACK's dynamic table, as grpc-go's does.
    let mut conn = PathAuthorityConnection::connect(&registration.socket)
        .await
        .unwrap();
    let info = get_info(&mut conn)
        .await
        .expect("GetInfo with a path authority is answered");
    assert_eq!(info.r#type, DRA_PLUGIN_TYPE);
    assert_eq!(info.name, DRIVER_NAME);
    assert_eq!(Path::new(&info.endpoint), registration.endpoint);
    assert!(info
        .endpoint
        .starts_with(node.dirs.plugin.to_str().unwrap()));
    for version in [versions::DRA_V1, versions::DRA_V1BETA1] {
        assert!(
            info.supported_versions.iter().any(|v| v == version),
            "{info:?}"
        );
    }
    let _: registration::RegistrationStatusResponse = conn
        .unary(
            NOTIFY,
            &registration::RegistrationStatus {
                plugin_registered: true,
                error: String::new(),
            },
            CALL,
        )
        .await
        .expect("NotifyRegistrationStatus with a path authority is answered");

    // Newer grpc-go percent-encodes the path; h2 refuses that form too.
    let encoded = registration.socket.to_string_lossy().replace('/', "%2F");
    let mut conn = PathAuthorityConnection::connect_with_authority(&registration.socket, &encoded)
        .await
        .unwrap();
    let again = get_info(&mut conn)
        .await
        .expect("GetInfo with a percent-encoded path authority is answered");
    assert_eq!(again, info);

    // The DRA socket is as tolerant, for a client that dials it by path.
    let mut dra = PathAuthorityConnection::connect(&registration.endpoint)
        .await
        .unwrap();
    let answer: dra_v1::NodeUnprepareResourcesResponse = dra
        .unary(
            UNPREPARE,
            &dra_v1::NodeUnprepareResourcesRequest { claims: vec![] },
            CALL,
        )
        .await
        .expect("a DRA call with a path authority is answered");
    assert!(answer.claims.is_empty());
}

/// `GetInfo` on the connection, as the kubelet's plugin watcher calls it.
async fn get_info(
    conn: &mut PathAuthorityConnection,
) -> Result<registration::PluginInfo, PathAuthorityError> {
    conn.unary(GET_INFO, &registration::InfoRequest {}, CALL)
        .await
}

/// The client is as strict as the kubelet: a tonic server without the driver's repair (here the
/// driver's own registration service) refuses it exactly as it refused the real kubelet.
#[tokio::test]
async fn a_plain_tonic_server_refuses_the_kubelets_registration_call() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("plain-reg.sock");
    let incoming = UnixListenerStream::new(UnixListener::bind(&socket).unwrap());
    let (outcome, _) = tokio::sync::watch::channel(None);
    let service = RegistrationService::new(socket.display().to_string(), outcome);
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service.into_server())
            .serve_with_incoming(incoming),
    );
    let mut conn = PathAuthorityConnection::connect(&socket).await.unwrap();
    let err = get_info(&mut conn).await.unwrap_err();
    assert!(matches!(err, PathAuthorityError::Reset(0x1)), "{err:?}");
    assert_eq!(
        err.to_string(),
        "stream terminated by RST_STREAM with error code: PROTOCOL_ERROR"
    );
    server.abort();
}

//! gRPC channels over Unix sockets, the way the kubelet reaches a plugin: tonic channels with
//! authority `localhost` for the DRA socket (what the kubelet's DRA client sends), and
//! [`path_authority`] for the registration socket (the kubelet's plugin watcher sends the path).

pub mod path_authority;

use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

/// The kubelet's per-call timeout for DRA calls.
pub const KUBELET_CALL_TIMEOUT: Duration = Duration::from_secs(45);

#[derive(Debug, thiserror::Error)]
pub enum GrpcError {
    #[error("connecting to Unix socket {path}: {source}")]
    Connect {
        path: PathBuf,
        #[source]
        source: tonic::transport::Error,
    },
}

fn endpoint(timeout: Duration) -> Endpoint {
    // The authority is ignored: every connection goes to the Unix socket.
    Endpoint::from_static("http://localhost")
        .timeout(timeout)
        .connect_timeout(Duration::from_secs(5))
}

fn unix_connector(
    path: PathBuf,
) -> impl tower::Service<
    Uri,
    Response = TokioIo<UnixStream>,
    Error = std::io::Error,
    Future = impl Send + 'static,
> + Clone
       + Send
       + 'static {
    tower::service_fn(move |_: Uri| {
        let path = path.clone();
        async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
    })
}

/// Connects now (so a dead socket is an error here), with `timeout` on every call.
pub async fn connect_unix(path: &Path, timeout: Duration) -> Result<Channel, GrpcError> {
    endpoint(timeout)
        .connect_with_connector(unix_connector(path.to_path_buf()))
        .await
        .map_err(|source| GrpcError::Connect {
            path: path.to_path_buf(),
            source,
        })
}

/// Connects on first use and reconnects after the plugin restarts on the same path.
pub fn connect_unix_lazy(path: &Path, timeout: Duration) -> Channel {
    endpoint(timeout).connect_with_connector_lazy(unix_connector(path.to_path_buf()))
}

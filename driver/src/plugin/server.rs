//! Unix-socket gRPC servers with the kubelet's expectations: stale sockets replaced, mode 0600,
//! graceful stop (no new connections, in-flight calls finish), socket file removed afterwards,
//! and any `:authority` accepted (see [`super::authority`]).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::TryStreamExt;
use tokio::net::UnixListener;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::server::Router;
use tonic::transport::Server;

use super::authority::AuthorityRepair;
use super::dra::{DraV1, DraV1beta1};
use super::health::HealthService;
use super::registration::RegistrationService;
use super::Preparer;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("socket {path}: {action}: {source}")]
    Socket {
        path: PathBuf,
        action: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("gRPC server on {path}: {source}")]
    Serve {
        path: PathBuf,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("gRPC server task on {path} failed: {message}")]
    Task { path: PathBuf, message: String },
}

/// Binds `path` afresh: creates the folder, removes a stale socket left by an earlier run, makes the
/// socket owner-only (0600) since whoever can connect can prepare claims.
pub fn bind(path: &Path) -> Result<UnixListener, ServerError> {
    let err = |action: &'static str| {
        let path = path.to_path_buf();
        move |source| ServerError::Socket {
            path,
            action,
            source,
        }
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(err("creating its folder"))?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => {
            return Err(ServerError::Socket {
                path: path.to_path_buf(),
                action: "replacing stale socket",
                source: std::io::Error::other("a directory is in the way"),
            })
        }
        Ok(_) => {
            tracing::info!(path = %path.display(), "removing stale socket");
            std::fs::remove_file(path).map_err(err("removing stale socket"))?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(err("inspecting")(e)),
    }
    let listener = UnixListener::bind(path).map_err(err("binding"))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(err("setting mode 0600"))?;
    Ok(listener)
}

/// The accepted connections, each read through the `:authority` repair: the kubelet sends the
/// registration socket's path there, which h2 alone refuses. The DRA socket gets the same, so a
/// client that dials it by path works too.
fn connections(
    listener: UnixListener,
) -> impl futures::Stream<Item = std::io::Result<AuthorityRepair<tokio::net::UnixStream>>> {
    UnixListenerStream::new(listener).map_ok(AuthorityRepair::new)
}

/// A socket being served; [`ServedSocket::finish`] waits for the graceful stop and removes the file.
pub struct ServedSocket {
    path: PathBuf,
    task: JoinHandle<Result<(), tonic::transport::Error>>,
}

impl ServedSocket {
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Waits until the server stopped (after its stop token fired and in-flight calls ended), then
    /// removes the socket file.
    pub async fn finish(self) -> Result<(), ServerError> {
        let result = self.task.await;
        if let Err(e) = std::fs::remove_file(&self.path) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(path = %self.path.display(), error = %e, "could not remove socket");
            }
        }
        match result {
            Ok(Ok(())) => Ok(()),
            Ok(Err(source)) => Err(ServerError::Serve {
                path: self.path,
                source,
            }),
            Err(join) => Err(ServerError::Task {
                path: self.path,
                message: join.to_string(),
            }),
        }
    }
}

/// Serves DRA v1, DRA v1beta1 and resource health (v1 and v1alpha1) on `path` until `stop`.
pub fn serve_dra(
    path: &Path,
    preparer: Arc<dyn Preparer>,
    health: HealthService,
    stop: CancellationToken,
) -> Result<ServedSocket, ServerError> {
    let router = Server::builder()
        .add_service(DraV1::new(preparer.clone()).into_server())
        .add_service(DraV1beta1::new(preparer).into_server())
        .add_service(health.clone().into_v1_server())
        .add_service(health.into_server());
    let served = serve(path, router, stop)?;
    tracing::info!(path = %path.display(), "serving DRA v1, v1beta1 and resource health");
    Ok(served)
}

/// Serves plugin registration on `path` until `stop`. Creating this socket is what makes the kubelet
/// notice the plugin, so call it only when the DRA socket is ready.
pub fn serve_registration(
    path: &Path,
    service: RegistrationService,
    stop: CancellationToken,
) -> Result<ServedSocket, ServerError> {
    let served = serve(
        path,
        Server::builder().add_service(service.into_server()),
        stop,
    )?;
    tracing::info!(path = %path.display(), "registration socket ready");
    Ok(served)
}

/// Binds `path` and serves `router` on it until `stop`.
fn serve(
    path: &Path,
    router: Router,
    stop: CancellationToken,
) -> Result<ServedSocket, ServerError> {
    let listener = bind(path)?;
    let task = tokio::spawn(
        router.serve_with_incoming_shutdown(connections(listener), stop.cancelled_owned()),
    );
    Ok(ServedSocket {
        path: path.to_path_buf(),
        task,
    })
}

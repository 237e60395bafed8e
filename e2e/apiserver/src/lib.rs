//! An emulator of the Kubernetes API server on 127.0.0.1: REST + watch over plain HTTP with JSON,
//! faithful enough for kube-rs clients and the real `kubectl`. Objects are kept as JSON values so no
//! field is lost; the rules of the real server that gpupool depends on live in [`store`] and [`rules`].
//!
//! Not emulated, on purpose or for now: authentication and authorization, admission (webhooks and
//! ValidatingAdmissionPolicies are stored, not enforced), CEL `x-kubernetes-validations`, real
//! server-side apply field ownership (apply is a merge of the applied object), pagination
//! (`limit`/`continue` answer everything at once), graceful pod deletion (a pod is deleted at once,
//! so watchers see DELETED, not a deletionTimestamp first), protobuf bodies other than Namespaces
//! and ConfigMaps, and OpenAPI schemas (kubectl falls back to JSON merge patches for unknown kinds
//! and `kubectl explain` has nothing to show).

pub mod clock;
pub mod discovery;
pub mod events;
mod http;
pub mod openapi;
pub mod patch;
pub mod protobuf;
pub mod resources;
pub mod rules;
pub mod schema;
pub mod selectors;
pub mod status;
pub mod store;
pub mod table;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use anyhow::Context;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::task::{AbortHandle, JoinHandle};

pub use http::RequestRecord;
use http::Shared;

/// The context name in the generated kubeconfig.
pub const CONTEXT_NAME: &str = "gpupool-emulator";

#[derive(Default)]
struct Serving {
    accept: Option<JoinHandle<()>>,
    connections: Arc<Mutex<Vec<AbortHandle>>>,
}

impl Serving {
    fn abort_all(&mut self) -> Option<JoinHandle<()>> {
        let accept = self.accept.take();
        if let Some(handle) = &accept {
            handle.abort();
        }
        for connection in self
            .connections
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            connection.abort();
        }
        accept
    }
}

/// A running API server emulator. Dropping it stops serving.
pub struct ApiServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
    serving: Mutex<Serving>,
}

fn spawn_accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    connections: Arc<Mutex<Vec<AbortHandle>>>,
) -> JoinHandle<()> {
    let router = axum::Router::new()
        .fallback(http::handle)
        .with_state(shared);
    tokio::spawn(async move {
        loop {
            let (stream, _) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(error) => {
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            };
            let service = TowerToHyperService::new(router.clone());
            let task = tokio::spawn(async move {
                let builder = auto::Builder::new(TokioExecutor::new());
                if let Err(error) = builder
                    .serve_connection(TokioIo::new(stream), service)
                    .await
                {
                    tracing::debug!(%error, "connection ended with an error");
                }
            });
            let mut live = connections.lock().unwrap_or_else(|p| p.into_inner());
            live.retain(|c| !c.is_finished());
            live.push(task.abort_handle());
        }
    })
}

impl ApiServer {
    /// Starts on 127.0.0.1 with an ephemeral port.
    pub async fn start() -> anyhow::Result<ApiServer> {
        Self::start_on(0).await
    }

    /// Starts on 127.0.0.1:`port` (0 for an ephemeral one).
    pub async fn start_on(port: u16) -> anyhow::Result<ApiServer> {
        let listener = TcpListener::bind(("127.0.0.1", port))
            .await
            .with_context(|| format!("binding 127.0.0.1:{port}"))?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared::new(addr.to_string()));
        let serving = Serving::default();
        let accept = spawn_accept_loop(
            listener,
            Arc::clone(&shared),
            Arc::clone(&serving.connections),
        );
        Ok(ApiServer {
            shared,
            addr,
            serving: Mutex::new(Serving {
                accept: Some(accept),
                ..serving
            }),
        })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// A kubeconfig whose current context (`gpupool-emulator`) points at this server, namespace default.
    pub fn kubeconfig_yaml(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: {CONTEXT_NAME}\n  cluster:\n    server: {url}\ncontexts:\n- name: {CONTEXT_NAME}\n  context:\n    cluster: {CONTEXT_NAME}\n    user: {CONTEXT_NAME}\n    namespace: default\ncurrent-context: {CONTEXT_NAME}\nusers:\n- name: {CONTEXT_NAME}\n  user: {{}}\npreferences: {{}}\n",
            url = self.url()
        )
    }

    pub fn write_kubeconfig(&self, path: &std::path::Path) -> std::io::Result<()> {
        std::fs::write(path, self.kubeconfig_yaml())
    }

    /// Closes the listener and every live connection (watches end); the store is kept.
    pub async fn stop_serving(&self) {
        let accept = self
            .serving
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .abort_all();
        if let Some(handle) = accept {
            let _ = handle.await;
        }
    }

    /// Serves again on the same port after [`ApiServer::stop_serving`].
    pub async fn resume_serving(&self) -> anyhow::Result<()> {
        if self
            .serving
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .accept
            .is_some()
        {
            return Ok(());
        }
        let listener = TcpListener::bind(self.addr)
            .await
            .with_context(|| format!("binding {} again", self.addr))?;
        let mut serving = self.serving.lock().unwrap_or_else(|p| p.into_inner());
        let accept = spawn_accept_loop(
            listener,
            Arc::clone(&self.shared),
            Arc::clone(&serving.connections),
        );
        serving.accept = Some(accept);
        Ok(())
    }

    /// Every request received so far, in order.
    pub fn requests(&self) -> Vec<RequestRecord> {
        self.shared
            .requests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// How often watches that allow bookmarks get one (default 10 s).
    pub fn set_bookmark_interval(&self, interval: std::time::Duration) {
        self.shared.bookmark_interval_ms.store(
            interval.as_millis() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    /// Forgets the watch history: watches resuming from an older resourceVersion then get 410 Gone.
    pub fn compact(&self) {
        self.shared
            .store
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .compact();
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.serving
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .abort_all();
    }
}

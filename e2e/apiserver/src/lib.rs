//! An emulator of the Kubernetes API server on 127.0.0.1: REST + watch over plain HTTP with JSON,
//! faithful enough for kube-rs clients and the real `kubectl`. Objects are kept as JSON values so no
//! field is lost; the rules of the real server that gpupool depends on live in [`store`] and [`rules`].
//!
//! Authentication and authorization as [`auth`] describes them: bearer tokens, RBAC, and the DRA
//! status permissions of 1.36. The garbage collector's part (dependents deleted or orphaned with
//! their owners, `propagationPolicy` on DELETE) is done by the [`store`], synchronously.
//!
//! Not emulated, on purpose or for now: the Node authorizer, admission (webhooks and
//! ValidatingAdmissionPolicies are stored, not enforced), CEL `x-kubernetes-validations`, real
//! server-side apply field ownership (apply is a merge of the applied object), pagination
//! (`limit`/`continue` answer everything at once), graceful pod deletion (a pod is deleted at once,
//! so watchers see DELETED, not a deletionTimestamp first), protobuf bodies other than Namespaces
//! and ConfigMaps, and OpenAPI schemas (kubectl falls back to JSON merge patches for unknown kinds
//! and `kubectl explain` has nothing to show).

pub mod auth;
pub mod clock;
pub mod discovery;
pub mod events;
mod http;
pub mod latency;
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
pub mod watchcache;

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
pub use latency::ApiProfile;

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

/// How to start an [`ApiServer`]; the default is what [`ApiServer::start`] does: an ephemeral port,
/// no latency, a watch cache that is always current.
#[derive(Clone, Debug, Default)]
pub struct ApiServerOptions {
    /// 0 for an ephemeral port.
    pub port: u16,
    pub profile: ApiProfile,
    /// Seeds the delays, so that runs with the same requests in the same order draw the same ones.
    pub seed: u64,
    /// How far `resourceVersion=0` GETs of one object lag behind writes; `None` for the profile's
    /// own ([`ApiProfile::default_cache_lag`]).
    pub cache_lag: Option<std::time::Duration>,
    /// Play a cluster without DRAPartitionableDevices (before 1.35, or the gate off): counter
    /// sets and counter consumptions of ResourceSlices are dropped on write.
    pub without_partitionable_devices: bool,
}

impl ApiServerOptions {
    pub fn port(mut self, port: u16) -> Self {
        self.port = port;
        self
    }

    pub fn profile(mut self, profile: ApiProfile) -> Self {
        self.profile = profile;
        self
    }

    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    pub fn cache_lag(mut self, lag: std::time::Duration) -> Self {
        self.cache_lag = Some(lag);
        self
    }

    /// A cluster without partitionable devices (see the field).
    pub fn without_partitionable_devices(mut self) -> Self {
        self.without_partitionable_devices = true;
        self
    }

    /// The lag the watch cache will have.
    pub fn effective_cache_lag(&self) -> std::time::Duration {
        self.cache_lag
            .unwrap_or_else(|| self.profile.default_cache_lag())
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
        Self::start_with(ApiServerOptions::default().port(port)).await
    }

    /// Starts on 127.0.0.1 with a latency profile and watch cache lag.
    pub async fn start_with(options: ApiServerOptions) -> anyhow::Result<ApiServer> {
        let port = options.port;
        let listener = TcpListener::bind(("127.0.0.1", port))
            .await
            .with_context(|| format!("binding 127.0.0.1:{port}"))?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared::with_latency(
            addr.to_string(),
            latency::Latency::new(options.profile, options.seed),
            options.effective_cache_lag(),
        ));
        shared
            .store
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .set_partitionable_devices(!options.without_partitionable_devices);
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

    /// A kubeconfig whose current context (`gpupool-emulator`) points at this server, namespace
    /// default, with no credentials: the administrator (see [`auth`]).
    pub fn kubeconfig_yaml(&self) -> String {
        self.kubeconfig_yaml_for("{}")
    }

    /// A kubeconfig for this server that authenticates with `token` (see
    /// [`ApiServer::service_account_token`]).
    pub fn kubeconfig_yaml_with(&self, token: &str) -> String {
        self.kubeconfig_yaml_for(&format!("\n    token: {token}"))
    }

    fn kubeconfig_yaml_for(&self, user: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: {CONTEXT_NAME}\n  cluster:\n    server: {url}\ncontexts:\n- name: {CONTEXT_NAME}\n  context:\n    cluster: {CONTEXT_NAME}\n    user: {CONTEXT_NAME}\n    namespace: default\ncurrent-context: {CONTEXT_NAME}\nusers:\n- name: {CONTEXT_NAME}\n  user: {user}\npreferences: {{}}\n",
            url = self.url()
        )
    }

    pub fn write_kubeconfig(&self, path: &std::path::Path) -> std::io::Result<()> {
        std::fs::write(path, self.kubeconfig_yaml())
    }

    /// A token of ServiceAccount `namespace/name`, bound to `node` like the projected token of a
    /// pod running there (what a DaemonSet's pod gets); its permissions are whatever RBAC objects
    /// in this server grant that ServiceAccount.
    pub fn service_account_token(&self, namespace: &str, name: &str, node: Option<&str>) -> String {
        self.shared
            .tokens
            .issue(auth::UserInfo::service_account(namespace, name, node))
    }

    /// A kube-rs client for this server, built from [`ApiServer::kubeconfig_yaml`] the way the
    /// driver and the controller read a kubeconfig. A test helper: panics if no client can be made.
    #[cfg(feature = "client")]
    pub async fn client(&self) -> kube::Client {
        Self::client_from(&self.kubeconfig_yaml()).await
    }

    /// [`ApiServer::client`] authenticating with `token`.
    #[cfg(feature = "client")]
    pub async fn client_with_token(&self, token: &str) -> kube::Client {
        Self::client_from(&self.kubeconfig_yaml_with(token)).await
    }

    #[cfg(feature = "client")]
    async fn client_from(kubeconfig: &str) -> kube::Client {
        use kube::config::{KubeConfigOptions, Kubeconfig};
        let kubeconfig = Kubeconfig::from_yaml(kubeconfig).expect("the kubeconfig parses");
        let config =
            kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .expect("the kubeconfig is usable");
        kube::Client::try_from(config).expect("a client for the emulator")
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

/// Helpers for the unit tests of the modules.
#[cfg(test)]
mod testing {
    use serde_json::Value;

    /// The string `field` of each object in the JSON array `list`.
    pub fn strings<'a>(list: &'a Value, field: &str) -> Vec<&'a str> {
        list.as_array()
            .expect("an array")
            .iter()
            .map(|item| item[field].as_str().expect("a string"))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::{GetParams, Patch, PatchParams, PostParams};
    use kube::Api;

    use super::*;

    fn data(map: &ConfigMap) -> &str {
        map.data.as_ref().unwrap()["v"].as_str()
    }

    #[tokio::test]
    async fn cached_gets_lag_and_quorum_gets_do_not() {
        let lag = Duration::from_millis(400);
        let server = ApiServer::start_with(ApiServerOptions::default().cache_lag(lag))
            .await
            .unwrap();
        let api: Api<ConfigMap> = Api::namespaced(server.client().await, "default");
        let map: ConfigMap = serde_json::from_value(
            serde_json::json!({"metadata": {"name": "cm"}, "data": {"v": "one"}}),
        )
        .unwrap();
        api.create(&PostParams::default(), &map).await.unwrap();
        let written = Instant::now();
        let cached = api.get_with("cm", &GetParams::any()).await;
        if written.elapsed() < lag {
            let error = cached.expect_err("created within the lag");
            assert!(
                matches!(&error, kube::Error::Api(s) if s.code == 404),
                "{error}"
            );
        }
        tokio::time::sleep(lag).await;
        assert_eq!(
            data(&api.get_with("cm", &GetParams::any()).await.unwrap()),
            "one"
        );

        let patch = serde_json::json!({"data": {"v": "two"}});
        api.patch("cm", &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap();
        let written = Instant::now();
        let cached = api.get_with("cm", &GetParams::any()).await.unwrap();
        let quorum = api.get("cm").await.unwrap();
        if written.elapsed() < lag {
            assert_eq!(data(&cached), "one");
        }
        assert_eq!(data(&quorum), "two");
        tokio::time::sleep(lag).await;
        assert_eq!(
            data(&api.get_with("cm", &GetParams::any()).await.unwrap()),
            "two"
        );

        api.delete("cm", &Default::default()).await.unwrap();
        let deleted = Instant::now();
        let cached = api.get_with("cm", &GetParams::any()).await;
        assert!(api.get("cm").await.is_err());
        if deleted.elapsed() < lag {
            assert_eq!(data(&cached.unwrap()), "two");
        }
        tokio::time::sleep(lag).await;
        assert!(api.get_with("cm", &GetParams::any()).await.is_err());
    }

    #[tokio::test]
    async fn the_real_profile_charges_quorum_reads_more_than_cached_ones() {
        let server = ApiServer::start_with(
            ApiServerOptions::default()
                .profile(ApiProfile::Real)
                .seed(5),
        )
        .await
        .unwrap();
        let api: Api<ConfigMap> = Api::namespaced(server.client().await, "default");
        let map: ConfigMap =
            serde_json::from_value(serde_json::json!({"metadata": {"name": "cm"}})).unwrap();
        let start = Instant::now();
        api.create(&PostParams::default(), &map).await.unwrap();
        // A write alone is never faster than the fastest draw of its distribution.
        assert!(start.elapsed() >= Duration::from_micros(500));
        tokio::time::sleep(Duration::from_millis(5)).await;
        let median = |params: GetParams| {
            let api = api.clone();
            async move {
                let mut samples = Vec::new();
                for _ in 0..15 {
                    let t = Instant::now();
                    api.get_with("cm", &params).await.unwrap();
                    samples.push(t.elapsed());
                }
                samples.sort_unstable();
                samples[7]
            }
        };
        let quorum = median(GetParams::default()).await;
        let cached = median(GetParams::any()).await;
        assert!(quorum >= Duration::from_millis(1), "quorum {quorum:?}");
        assert!(cached >= Duration::from_micros(400), "cached {cached:?}");
        assert!(cached < quorum, "cached {cached:?}, quorum {quorum:?}");
    }

    #[tokio::test]
    async fn the_default_profile_charges_nothing_and_caches_nothing() {
        let server = ApiServer::start().await.unwrap();
        let api: Api<ConfigMap> = Api::namespaced(server.client().await, "default");
        let map: ConfigMap =
            serde_json::from_value(serde_json::json!({"metadata": {"name": "cm"}})).unwrap();
        api.create(&PostParams::default(), &map).await.unwrap();
        api.get_with("cm", &GetParams::any()).await.unwrap();
    }
}

//! gpupool's validating admission webhook (`gpupool-controller webhook`): ResourceClaims,
//! ResourceClaimTemplates and DeviceClasses carrying a `gpupool.dev` opaque config are checked at
//! create (and at an update that changes their spec) with the driver's own parser, so that a bad
//! `GpuConfig` is refused by `kubectl apply` instead of failing the pod at prepare on a node.
//!
//! - [`review`]: one AdmissionReview in, its answer out (pure).
//! - [`certs`]: the serving certificate, made here or read from files, swappable while serving.
//! - [`ca_bundle`]: keeping the ValidatingWebhookConfiguration's `caBundle` in step with a
//!   certificate made here.
//! - this module: the HTTPS server and the tasks that keep the certificate fresh.
//!
//! The webhook is a convenience, never a dependency: the chart registers it with
//! `failurePolicy: Ignore`, and the driver refuses the same configs at prepare.

pub mod ca_bundle;
pub mod certs;
pub mod review;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use thiserror::Error;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tracing::{info, warn};

use self::certs::{CertError, CurrentCert};

#[derive(Debug, Error)]
pub enum WebhookError {
    #[error(transparent)]
    Cert(#[from] CertError),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

/// Where the serving certificate comes from.
#[derive(Debug, Clone)]
pub enum CertSource {
    /// Made here at start, with a CA of its own, and made again before it expires. With
    /// `webhook_configuration`, that ValidatingWebhookConfiguration's `caBundle` is kept in step.
    SelfSigned {
        hosts: Vec<String>,
        validity: Duration,
        webhook_configuration: Option<String>,
    },
    /// PEM files (a mounted Secret, e.g. cert-manager's), read again every `reload` so that a
    /// renewed Secret is served without a restart.
    Files {
        cert: PathBuf,
        key: PathBuf,
        reload: Duration,
    },
}

#[derive(Debug, Clone)]
pub struct Settings {
    pub listen: SocketAddr,
    pub certs: CertSource,
    /// How often the `caBundle` is checked (and put back, e.g. after a `helm upgrade` reset it).
    pub ca_bundle_interval: Duration,
    /// After a new CA is in the `caBundle` (beside the old one), how long the old certificate is
    /// still served: the API server must have read the new bundle before it meets the new cert.
    pub rotation_grace: Duration,
}

impl Settings {
    pub fn new(listen: SocketAddr, certs: CertSource) -> Settings {
        Settings {
            listen,
            certs,
            ca_bundle_interval: Duration::from_secs(30),
            rotation_grace: Duration::from_secs(60),
        }
    }
}

/// What the server has answered since it started.
#[derive(Debug, Default)]
pub struct Stats {
    pub reviews: AtomicU64,
    pub refused: AtomicU64,
    pub bad_requests: AtomicU64,
}

impl Stats {
    pub fn reviews(&self) -> u64 {
        self.reviews.load(Ordering::Relaxed)
    }
}

/// A started webhook: where it listens, what it answered, and its tasks (stopped by the `stop`
/// channel given to [`start`]; every open connection is closed then too).
pub struct Running {
    pub addr: SocketAddr,
    pub stats: Arc<Stats>,
    /// The PEM the API server must trust (self-signed mode), as it stands now.
    pub ca_bundle: Option<watch::Receiver<String>>,
    tasks: JoinSet<()>,
}

impl Running {
    /// Waits for every task to end (after `stop`).
    pub async fn join(mut self) {
        while self.tasks.join_next().await.is_some() {}
    }
}

/// Binds, makes or reads the certificate, and starts serving; `client` keeps the `caBundle`
/// (self-signed mode with a webhook configuration named).
pub async fn start(
    settings: Settings,
    client: Option<kube::Client>,
    stop: watch::Receiver<bool>,
) -> Result<Running, WebhookError> {
    let listener = TcpListener::bind(settings.listen)
        .await
        .map_err(|source| WebhookError::Io {
            what: format!("binding the webhook's address {}", settings.listen),
            source,
        })?;
    let addr = listener.local_addr().map_err(|source| WebhookError::Io {
        what: "reading the webhook's address".into(),
        source,
    })?;
    let mut tasks = JoinSet::new();
    let mut ca_bundle = None;
    let current = match &settings.certs {
        CertSource::SelfSigned {
            hosts,
            validity,
            webhook_configuration,
        } => {
            let made = certs::self_signed(hosts, *validity)?;
            let current = CurrentCert::new(certs::certified_key(
                made.cert_pem.as_bytes(),
                made.key_pem.as_bytes(),
                "the self-signed certificate",
            )?);
            let (bundle_tx, bundle_rx) = watch::channel(made.ca_pem.clone());
            ca_bundle = Some(bundle_rx.clone());
            if let (Some(name), Some(client)) = (webhook_configuration, client) {
                tasks.spawn(ca_bundle::keep(
                    client,
                    name.clone(),
                    bundle_rx,
                    settings.ca_bundle_interval,
                    stop.clone(),
                ));
            }
            tasks.spawn(rotate(
                hosts.clone(),
                *validity,
                settings.rotation_grace,
                made,
                current.clone(),
                bundle_tx,
                stop.clone(),
            ));
            current
        }
        CertSource::Files { cert, key, reload } => {
            warn_if_others_may_read(key);
            let (cert_pem, key_pem) = read_pair(cert, key)?;
            let current = CurrentCert::new(certs::certified_key(
                &cert_pem,
                &key_pem,
                &cert.display().to_string(),
            )?);
            tasks.spawn(reload_files(
                cert.clone(),
                key.clone(),
                *reload,
                (cert_pem, key_pem),
                current.clone(),
                stop.clone(),
            ));
            current
        }
    };
    let tls = certs::server_config(current)?;
    let stats = Arc::new(Stats::default());
    tasks.spawn(serve(listener, tls, stats.clone(), stop));
    info!(%addr, "gpupool webhook serving");
    Ok(Running {
        addr,
        stats,
        ca_bundle,
        tasks,
    })
}

/// Resolves once `stop` says so (or its sender is gone), holding no borrow of the channel.
pub(crate) async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// A private key must be readable by its owner and (for a Secret mounted with fsGroup) the
/// webhook's own group only; one that every user of the node may read is said so at start.
fn warn_if_others_may_read(key: &std::path::Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(metadata) = std::fs::metadata(key) {
        let mode = metadata.permissions().mode() & 0o777;
        if mode & 0o007 != 0 {
            warn!(
                key = %key.display(),
                mode = format!("{mode:04o}"),
                "the webhook's private key is readable by other users: mount it with mode 0440 or tighter"
            );
        }
    }
}

fn read_pair(cert: &PathBuf, key: &PathBuf) -> Result<(Vec<u8>, Vec<u8>), WebhookError> {
    let read = |path: &PathBuf| {
        std::fs::read(path).map_err(|source| WebhookError::Io {
            what: format!("reading {}", path.display()),
            source,
        })
    };
    Ok((read(cert)?, read(key)?))
}

/// Self-signed mode: before the certificate expires (at two thirds of its life), a new CA joins the
/// old one in the `caBundle`, and only after `grace` does the server present the new certificate.
async fn rotate(
    hosts: Vec<String>,
    validity: Duration,
    grace: Duration,
    mut serving: certs::SelfSigned,
    current: Arc<CurrentCert>,
    bundle: watch::Sender<String>,
    mut stop: watch::Receiver<bool>,
) {
    let every = validity * 2 / 3;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stopped(&mut stop) => return,
        }
        let next = match certs::self_signed(&hosts, validity) {
            Ok(next) => next,
            Err(e) => {
                warn!(error = %e, "making the next webhook certificate; trying again later");
                continue;
            }
        };
        let _ = bundle.send(format!("{}{}", next.ca_pem, serving.ca_pem));
        tokio::select! {
            _ = tokio::time::sleep(grace) => {}
            _ = stopped(&mut stop) => return,
        }
        match certs::certified_key(
            next.cert_pem.as_bytes(),
            next.key_pem.as_bytes(),
            "the next certificate",
        ) {
            Ok(key) => {
                current.replace(key);
                info!("webhook certificate rotated");
                serving = next;
            }
            Err(e) => warn!(error = %e, "loading the next webhook certificate"),
        }
    }
}

/// Files mode: the pair is read again every `every`; a changed pair that loads is served, a
/// broken one (a Secret half written) is logged and the previous one kept.
async fn reload_files(
    cert: PathBuf,
    key: PathBuf,
    every: Duration,
    mut last: (Vec<u8>, Vec<u8>),
    current: Arc<CurrentCert>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stopped(&mut stop) => return,
        }
        let Ok(pair) = read_pair(&cert, &key) else {
            continue;
        };
        if pair == last {
            continue;
        }
        match certs::certified_key(&pair.0, &pair.1, &cert.display().to_string()) {
            Ok(loaded) => {
                current.replace(loaded);
                info!(cert = %cert.display(), "webhook certificate reloaded");
                last = pair;
            }
            Err(e) => warn!(error = %e, "webhook certificate files changed but do not load"),
        }
    }
}

fn router(stats: Arc<Stats>) -> Router {
    Router::new()
        .route("/validate", post(validate))
        .route("/healthz", get(|| async { "ok" }))
        .layer(DefaultBodyLimit::max(review::MAX_BODY_BYTES))
        .with_state(stats)
}

async fn validate(State(stats): State<Arc<Stats>>, body: Bytes) -> Response {
    match review::answer(&body) {
        Ok((response, decision)) => {
            stats.reviews.fetch_add(1, Ordering::Relaxed);
            if let Some(message) = &decision.message {
                stats.refused.fetch_add(1, Ordering::Relaxed);
                info!(%message, "refused");
            }
            axum::Json(response).into_response()
        }
        Err(e) => {
            stats.bad_requests.fetch_add(1, Ordering::Relaxed);
            warn!(error = %e, "bad admission request");
            (StatusCode::BAD_REQUEST, e.to_string()).into_response()
        }
    }
}

/// How long a client may take over its TLS handshake before the connection is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

async fn serve(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    stats: Arc<Stats>,
    mut stop: watch::Receiver<bool>,
) {
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    let service = TowerToHyperService::new(router(stats));
    // Dropped (and so aborted) on stop: a stopped webhook also closes the API server's kept-alive
    // connections, as a pod that is gone does.
    let mut connections = JoinSet::new();
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    warn!(error = %e, "accepting a webhook connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = stopped(&mut stop) => return,
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        let acceptor = acceptor.clone();
        let service = service.clone();
        connections.spawn(async move {
            let stream =
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                    Ok(Ok(stream)) => stream,
                    Ok(Err(e)) => {
                        tracing::debug!(error = %e, "webhook TLS handshake");
                        return;
                    }
                    Err(_) => return,
                };
            let _ = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

#[cfg(test)]
mod tests;

//! Prometheus metrics of the node agent, served at `GET /metrics` on `--metrics-addr`.
//!
//! Counters and histograms are updated where things happen (the kubelet's calls, the API client);
//! everything about GPUs and prepared claims is computed at scrape time from the inventory and the
//! checkpoint, so it can never drift from what the driver acts on, and survives restarts.
//!
//! Prometheus itself asks for OpenMetrics and gets it as `prometheus-client` writes it; anything
//! else (curl, `promtool check metrics`, older scrapers) gets the classic text format 0.0.4.

pub mod usage;

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use gpupool_api::inventory::{Inventory, InventorySource};
use gpupool_api::names::device_name;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use crate::node_state::checkpoint::{CheckpointData, ClaimState};
use crate::plugin::{PrepareResults, Preparer, UnprepareResults};
use gpupool_api::claim::ClaimRef;
use usage::{ClaimShares, ReservationCache, ShareUsage};

/// From 100 µs (a prepare answered from the checkpoint) to 45 s (the kubelet's own deadline).
pub const DURATION_BUCKETS: [f64; 18] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 20.0, 45.0,
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ApiLabels {
    pub verb: String,
    pub code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct XidLabels {
    gpu: String,
    xid: String,
}

pub use gpupool_telemetry::{bind, parse_listen_addr, ListenAddr};

/// The kubelet's calls: per claim result, and how long each call took.
#[derive(Clone)]
pub struct KubeletCallMetrics {
    prepare_requests: Family<ResultLabels, Counter>,
    unprepare_requests: Family<ResultLabels, Counter>,
    prepare_duration: Histogram,
    unprepare_duration: Histogram,
}

impl KubeletCallMetrics {
    fn new() -> Self {
        let calls = KubeletCallMetrics {
            prepare_requests: Family::default(),
            unprepare_requests: Family::default(),
            prepare_duration: Histogram::new(DURATION_BUCKETS),
            unprepare_duration: Histogram::new(DURATION_BUCKETS),
        };
        // Both results exist from the start, so that rate() sees the first error.
        for result in ["success", "error"] {
            let labels = ResultLabels {
                result: result.into(),
            };
            let _ = calls.prepare_requests.get_or_create(&labels);
            let _ = calls.unprepare_requests.get_or_create(&labels);
        }
        calls
    }

    fn count<T>(
        family: &Family<ResultLabels, Counter>,
        results: &[(ClaimRef, Result<T, crate::prepare::PrepareError>)],
    ) {
        for (_, result) in results {
            let result = if result.is_ok() { "success" } else { "error" };
            family
                .get_or_create(&ResultLabels {
                    result: result.into(),
                })
                .inc();
        }
    }
}

/// A [`Preparer`] that counts and times the kubelet's calls around the real one.
pub struct InstrumentedPreparer {
    inner: Arc<dyn Preparer>,
    calls: KubeletCallMetrics,
}

impl InstrumentedPreparer {
    pub fn new(inner: Arc<dyn Preparer>, metrics: &DriverMetrics) -> Self {
        InstrumentedPreparer {
            inner,
            calls: metrics.calls.clone(),
        }
    }
}

#[tonic::async_trait]
impl Preparer for InstrumentedPreparer {
    async fn prepare(&self, claims: Vec<ClaimRef>) -> PrepareResults {
        let started = Instant::now();
        let results = self.inner.prepare(claims).await;
        self.calls
            .prepare_duration
            .observe(started.elapsed().as_secs_f64());
        KubeletCallMetrics::count(&self.calls.prepare_requests, &results);
        results
    }

    async fn unprepare(&self, claims: Vec<ClaimRef>) -> UnprepareResults {
        let started = Instant::now();
        let results = self.inner.unprepare(claims).await;
        self.calls
            .unprepare_duration
            .observe(started.elapsed().as_secs_f64());
        KubeletCallMetrics::count(&self.calls.unprepare_requests, &results);
        results
    }
}

/// The Kubernetes verb of an API request, from its method and path: a GET of a collection is a
/// list, of a named object a get, and `?watch=true` a watch.
pub fn api_verb(method: &http::Method, uri: &http::Uri) -> &'static str {
    let watch = uri
        .query()
        .is_some_and(|q| q.split('&').any(|kv| kv == "watch=true" || kv == "watch=1"));
    let segments: Vec<&str> = uri.path().split('/').filter(|s| !s.is_empty()).collect();
    // /api/<version>/... or /apis/<group>/<version>/...
    let rest = match segments.first() {
        Some(&"api") => segments.get(2..),
        Some(&"apis") => segments.get(3..),
        _ => None,
    }
    .unwrap_or(&[]);
    let rest = match rest {
        ["namespaces", _, resource @ ..] if !resource.is_empty() => resource,
        other => other,
    };
    let named = rest.len() >= 2;
    match *method {
        http::Method::GET if watch => "watch",
        http::Method::GET if named => "get",
        http::Method::GET => "list",
        http::Method::POST => "create",
        http::Method::PUT => "update",
        http::Method::PATCH => "patch",
        http::Method::DELETE if named => "delete",
        http::Method::DELETE => "deletecollection",
        _ => "other",
    }
}

/// A tower layer for the kube client's service stack: counts every API request by verb and
/// HTTP status (`error` when no response came back).
#[derive(Clone)]
pub struct ApiMetricsLayer {
    requests: Family<ApiLabels, Counter>,
}

impl<S> tower::Layer<S> for ApiMetricsLayer {
    type Service = ApiMetricsService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ApiMetricsService {
            inner,
            requests: self.requests.clone(),
        }
    }
}

#[derive(Clone)]
pub struct ApiMetricsService<S> {
    inner: S,
    requests: Family<ApiLabels, Counter>,
}

impl<S, B, RB> tower::Service<http::Request<B>> for ApiMetricsService<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<RB>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let verb = api_verb(request.method(), request.uri());
        let requests = self.requests.clone();
        let answer = self.inner.call(request);
        Box::pin(async move {
            let answer = answer.await;
            let code = match &answer {
                Ok(response) => response.status().as_u16().to_string(),
                Err(_) => "error".to_string(),
            };
            requests
                .get_or_create(&ApiLabels {
                    verb: verb.to_string(),
                    code,
                })
                .inc();
            answer
        })
    }
}

/// What one GPU holds, summed over the claims prepared on it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GpuAllocation {
    pub memory_bytes: u64,
    pub cores_percent: u64,
    pub shares: u64,
}

/// One prepared share's limits, as its CDI spec sets them (`None`: not limited, enforcement None).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareLimit {
    pub namespace: String,
    pub claim: String,
    pub gpu: String,
    pub memory_bytes: Option<u64>,
    pub cores_percent: Option<u32>,
}

/// The node's prepared claims as the metrics show them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeState {
    pub prepared_claims: u64,
    /// By device name; every GPU of the inventory is present.
    pub gpus: BTreeMap<String, GpuAllocation>,
    pub shares: Vec<ShareLimit>,
    pub claims: Vec<ClaimShares>,
    /// The cards' MPS control daemons, by card UUID.
    pub mps_daemons: BTreeMap<String, crate::node_state::checkpoint::MpsDaemonRecord>,
}

/// `KEY_<ordinal>=value` in a CDI device's env, for a key HAMi-core reads per device.
fn env_limit<'a>(env: &'a [String], key: &str) -> Option<&'a str> {
    env.iter().find_map(|e| {
        let (name, value) = e.split_once('=')?;
        let ordinal = name.strip_prefix(key)?.strip_prefix('_')?;
        ordinal.chars().all(|c| c.is_ascii_digit()).then_some(value)
    })
}

/// Allocation per GPU and limits per share, from the claims the kubelet was told are prepared.
/// A share's memory and cores are the limits its CDI spec gives HAMi-core: the allocation, or less
/// where a `GpuConfig` lowered it. A share prepared with `enforcement: None` has no limits in its
/// spec: it counts in `shares` but adds no memory or cores. A card given whole adds all its memory
/// and 100 % of its SMs.
pub fn node_state(inventory: &Inventory, data: &CheckpointData) -> NodeState {
    const MIB: u64 = 1 << 20;
    let mut state = NodeState {
        gpus: inventory
            .gpus
            .iter()
            .map(|g| (device_name(g.index), GpuAllocation::default()))
            .collect(),
        ..NodeState::default()
    };
    for (uid, entry) in &data.claims {
        if entry.state != ClaimState::PrepareCompleted || entry.recovered {
            continue;
        }
        state.prepared_claims += 1;
        let spec_devices = entry.spec.as_ref().map(|s| s.devices.as_slice());
        for (i, device) in entry.devices.iter().enumerate() {
            let env = spec_devices
                .and_then(|d| d.get(i))
                .map(|d| d.container_edits.env.as_slice())
                .unwrap_or(&[]);
            let memory = env_limit(env, "CUDA_DEVICE_MEMORY_LIMIT")
                .and_then(|v| v.strip_suffix('m'))
                .and_then(|v| v.parse::<u64>().ok())
                .map(|mib| mib * MIB);
            // An MPS share's SMs are its daemon's (the library's SM limit is 0 then).
            let mps = env.iter().find_map(|e| {
                e.strip_prefix(crate::mps::share::ACTIVE_THREAD_PERCENTAGE_ENV)?
                    .strip_prefix('=')?
                    .parse::<u32>()
                    .ok()
            });
            let cores = mps.or_else(|| {
                env_limit(env, "CUDA_DEVICE_SM_LIMIT").and_then(|v| v.parse::<u32>().ok())
            });
            // A card given whole (no share id) is all the claim's, whatever limits its spec
            // carries: its SM limit is 0 ("none"), and without enforcement it has no memory limit.
            let whole_card = device
                .share_id
                .is_none()
                .then(|| inventory.gpu(&device.device_name))
                .flatten();
            let gpu = state.gpus.entry(device.device_name.clone()).or_default();
            gpu.shares += 1;
            match whole_card {
                Some(card) => {
                    gpu.memory_bytes += card.memory_bytes;
                    gpu.cores_percent += 100;
                }
                None => {
                    gpu.memory_bytes += memory.unwrap_or(0);
                    gpu.cores_percent += u64::from(cores.unwrap_or(0));
                }
            }
            state.shares.push(ShareLimit {
                namespace: entry.namespace.clone(),
                claim: entry.name.clone(),
                gpu: device.device_name.clone(),
                memory_bytes: memory,
                cores_percent: cores,
            });
        }
        state.claims.push(ClaimShares {
            uid: uid.clone(),
            namespace: entry.namespace.clone(),
            name: entry.name.clone(),
            gpus: entry
                .devices
                .iter()
                .map(|d| d.device_name.clone())
                .collect(),
        });
    }
    state.mps_daemons = data.mps.clone();
    state
}

type StateFn = Box<dyn Fn() -> NodeState + Send + Sync>;

/// The scrape-time families: GPUs, their allocation, prepared claims and measured share use.
struct NodeCollector {
    inventory: Arc<Inventory>,
    /// The devices' health as the kubelet's health stream reports it.
    health: tokio::sync::watch::Receiver<crate::health::HealthMap>,
    state: StateFn,
    usage: Arc<Mutex<Vec<ShareUsage>>>,
}

impl std::fmt::Debug for NodeCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeCollector").finish_non_exhaustive()
    }
}

fn gauge<'a, V: prometheus_client::encoding::EncodeGaugeValue + std::fmt::Debug>(
    encoder: &mut DescriptorEncoder<'a>,
    name: &str,
    help: &str,
    samples: impl IntoIterator<Item = (Vec<(&'static str, String)>, V)>,
) -> Result<(), std::fmt::Error> {
    let mut family: MetricEncoder =
        encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, value) in samples {
        if labels.is_empty() {
            ConstGauge::new(value).encode(family)?;
            break;
        }
        ConstGauge::new(value).encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

impl Collector for NodeCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let state = (self.state)();
        let gpus = &self.inventory.gpus;
        let model_of = |gpu: &str| {
            self.inventory
                .gpu(gpu)
                .map(|g| g.model.clone())
                .unwrap_or_default()
        };
        gauge(
            &mut encoder,
            "gpupool_prepared_claims",
            "Claims prepared on this node (the kubelet was answered with their devices).",
            [(vec![], state.prepared_claims as i64)],
        )?;
        gauge(
            &mut encoder,
            "gpupool_gpu_info",
            "Each GPU of this node, with its UUID and model; always 1.",
            gpus.iter().map(|g| {
                (
                    vec![
                        ("gpu", device_name(g.index)),
                        ("uuid", g.uuid.clone()),
                        ("model", g.model.clone()),
                    ],
                    1i64,
                )
            }),
        )?;
        gauge(
            &mut encoder,
            "gpupool_gpu_memory_bytes",
            "Memory of each GPU.",
            gpus.iter()
                .map(|g| (vec![("gpu", device_name(g.index))], g.memory_bytes as i64)),
        )?;
        gauge(
            &mut encoder,
            "gpupool_gpu_memory_allocated_bytes",
            "Memory of each GPU given to the claims prepared on it (their memory limits; all of it for a card given whole).",
            state.gpus.iter().map(|(gpu, a)| {
                (
                    vec![("gpu", gpu.clone()), ("model", model_of(gpu))],
                    a.memory_bytes as i64,
                )
            }),
        )?;
        gauge(
            &mut encoder,
            "gpupool_gpu_cores_allocated_percent",
            "Percent of each GPU's SMs given to the claims prepared on it (their SM limits; 100 for a card given whole).",
            state.gpus.iter().map(|(gpu, a)| {
                (
                    vec![("gpu", gpu.clone()), ("model", model_of(gpu))],
                    a.cores_percent as i64,
                )
            }),
        )?;
        gauge(
            &mut encoder,
            "gpupool_gpu_shares",
            "Prepared claims' shares of each GPU.",
            state
                .gpus
                .iter()
                .map(|(gpu, a)| (vec![("gpu", gpu.clone())], a.shares as i64)),
        )?;
        let health = self.health.borrow().clone();
        gauge(
            &mut encoder,
            "gpupool_gpu_healthy",
            "1 while the GPU is reported healthy to the kubelet, else 0.",
            gpus.iter().map(|g| {
                let name = device_name(g.index);
                let healthy = health.health(&name) == crate::health::DeviceHealth::Healthy;
                (vec![("gpu", name)], i64::from(healthy))
            }),
        )?;
        let daemon_labels = |uuid: &str, r: &crate::node_state::checkpoint::MpsDaemonRecord| {
            vec![("gpu", r.device.clone()), ("uuid", uuid.to_string())]
        };
        gauge(
            &mut encoder,
            "gpupool_mps_daemon_up",
            "1 while the MPS control daemon of a card with MPS shares runs, else 0.",
            state.mps_daemons.iter().map(|(uuid, r)| {
                let up = r.state == crate::node_state::checkpoint::MpsDaemonState::Running
                    && r.pid.zip(r.start_time).is_some_and(|(pid, start_time)| {
                        crate::mps::daemon::is_alive(crate::mps::daemon::DaemonId {
                            pid,
                            start_time,
                        })
                    });
                (daemon_labels(uuid, r), i64::from(up))
            }),
        )?;
        gauge(
            &mut encoder,
            "gpupool_mps_daemon_restarts",
            "How often a card's MPS control daemon was found dead and started again since it was first started.",
            state
                .mps_daemons
                .iter()
                .map(|(uuid, r)| (daemon_labels(uuid, r), i64::from(r.restarts))),
        )?;
        let share_labels = |s: &ShareLimit| {
            vec![
                ("namespace", s.namespace.clone()),
                ("claim", s.claim.clone()),
                ("gpu", s.gpu.clone()),
            ]
        };
        gauge(
            &mut encoder,
            "gpupool_share_memory_limit_bytes",
            "Memory limit of each prepared share (HAMi-core's CUDA_DEVICE_MEMORY_LIMIT).",
            state
                .shares
                .iter()
                .filter_map(|s| Some((share_labels(s), s.memory_bytes? as i64))),
        )?;
        gauge(
            &mut encoder,
            "gpupool_share_core_limit_percent",
            "SM limit of each prepared share in percent, 0 = none (HAMi-core's CUDA_DEVICE_SM_LIMIT).",
            state
                .shares
                .iter()
                .filter_map(|s| Some((share_labels(s), i64::from(s.cores_percent?)))),
        )?;
        let usage = self.usage.lock().expect("usage is never poisoned").clone();
        let usage_labels = |u: &ShareUsage| {
            vec![
                ("namespace", u.namespace.clone()),
                ("claim", u.claim.clone()),
                ("gpu", u.gpu.clone()),
            ]
        };
        gauge(
            &mut encoder,
            "gpupool_share_memory_used_bytes",
            "GPU memory the share's processes hold, measured by NVML (real GPUs only).",
            usage
                .iter()
                .map(|u| (usage_labels(u), u.memory_used_bytes as i64)),
        )?;
        gauge(
            &mut encoder,
            "gpupool_share_sm_utilization_ratio",
            "Share of the GPU's SMs the share's processes kept busy, 0..1, measured by NVML (real GPUs only).",
            usage.iter().map(|u| (usage_labels(u), u.sm_utilization)),
        )?;
        Ok(())
    }
}

/// Every metric of the driver, and the state that scrape-time families read.
pub struct DriverMetrics {
    registry: Registry,
    calls: KubeletCallMetrics,
    api: Family<ApiLabels, Counter>,
    usage: Arc<Mutex<Vec<ShareUsage>>>,
    sampler: Option<UsageSampler>,
}

/// Measures per-share use on real GPUs before each scrape is encoded.
struct UsageSampler {
    client: kube::Client,
    gpu_indexes: Vec<u32>,
    claims: Arc<dyn Fn() -> Vec<ClaimShares> + Send + Sync>,
    nvml: Arc<std::sync::OnceLock<Option<nvml_wrapper::Nvml>>>,
    reservations: tokio::sync::Mutex<ReservationCache>,
}

impl Default for DriverMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl DriverMetrics {
    /// The families that exist before the claims do: kubelet calls, API requests, XID errors.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let calls = KubeletCallMetrics::new();
        let api = Family::<ApiLabels, Counter>::default();
        // `register` ends each help text with a period of its own.
        registry.register(
            "gpupool_prepare_requests",
            "Claims the kubelet asked to prepare, by result",
            calls.prepare_requests.clone(),
        );
        registry.register(
            "gpupool_unprepare_requests",
            "Claims the kubelet asked to unprepare, by result",
            calls.unprepare_requests.clone(),
        );
        registry.register(
            "gpupool_prepare_duration_seconds",
            "Time to answer one NodePrepareResources call",
            calls.prepare_duration.clone(),
        );
        registry.register(
            "gpupool_unprepare_duration_seconds",
            "Time to answer one NodeUnprepareResources call",
            calls.unprepare_duration.clone(),
        );
        registry.register(
            "gpupool_api_requests",
            "Requests to the Kubernetes API server, by verb and HTTP status code",
            api.clone(),
        );
        // Declared so dashboards and alerts can refer to it; no samples until XID events are read.
        registry.register(
            "gpupool_gpu_xid_errors",
            "XID errors NVML reported per GPU, by XID code",
            Family::<XidLabels, Counter>::default(),
        );
        DriverMetrics {
            registry,
            calls,
            api,
            usage: Arc::default(),
            sampler: None,
        }
    }

    /// The layer to put on the kube client's service stack.
    pub fn api_layer(&self) -> ApiMetricsLayer {
        ApiMetricsLayer {
            requests: self.api.clone(),
        }
    }

    /// Adds the GPU and claim families, computed at each scrape by `state`; on NVML nodes also the
    /// measured per-share use (reading the claims' `reservedFor` through `client`).
    pub fn register_node(
        &mut self,
        inventory: Arc<Inventory>,
        state: impl Fn() -> NodeState + Send + Sync + 'static,
        health: tokio::sync::watch::Receiver<crate::health::HealthMap>,
        client: kube::Client,
    ) {
        let state = Arc::new(state);
        if inventory.source == InventorySource::Nvml {
            let claims = state.clone();
            self.sampler = Some(UsageSampler {
                client,
                gpu_indexes: inventory.gpus.iter().map(|g| g.index).collect(),
                claims: Arc::new(move || claims().claims),
                nvml: Arc::default(),
                reservations: Default::default(),
            });
        }
        self.registry.register_collector(Box::new(NodeCollector {
            inventory,
            health,
            state: Box::new(move || state()),
            usage: self.usage.clone(),
        }));
    }

    async fn refresh_usage(&self) {
        let Some(sampler) = &self.sampler else {
            return;
        };
        let (nvml, indexes) = (sampler.nvml.clone(), sampler.gpu_indexes.clone());
        let sampled = tokio::task::spawn_blocking(move || {
            let nvml = nvml
                .get_or_init(|| nvml_wrapper::Nvml::init().ok())
                .as_ref()?;
            Some(
                usage::sample_nvml(nvml, &indexes)
                    .into_iter()
                    .map(|s| {
                        let pod = usage::read_pod_uid(s.pid);
                        (s, pod)
                    })
                    .collect::<Vec<_>>(),
            )
        })
        .await
        .ok()
        .flatten()
        .unwrap_or_default();
        let claims = (sampler.claims)();
        let pods: Vec<String> = sampled.iter().filter_map(|(_, p)| p.clone()).collect();
        let mut cache = sampler.reservations.lock().await;
        let reserved = cache.resolve(&sampler.client, &claims, &pods).await;
        let attributed = usage::attribute(&sampled, &claims, reserved);
        *self.usage.lock().expect("usage is never poisoned") = attributed;
    }

    /// The exposition: OpenMetrics when asked for, else the classic text format.
    pub async fn render(&self, openmetrics: bool) -> String {
        self.refresh_usage().await;
        gpupool_telemetry::encode(&self.registry, openmetrics)
    }
}

/// GET /metrics until `stop`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<DriverMetrics>,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    let render = move |openmetrics| {
        let metrics = metrics.clone();
        async move { metrics.render(openmetrics).await }
    };
    gpupool_telemetry::serve(listener, render, stop.cancelled_owned()).await
}

#[cfg(test)]
mod tests;

//! `gpupool-driver`: `run` (the DaemonSet agent) and `inspect` (what this node would publish).
//! The binary's `main` is [`main`]; it is in the library so that the sandbox (gpupool-e2e) can be
//! the driver too, started from its own executable, without a second build.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use crate::config::{Cli, Command, InspectArgs, LogFormat, RunArgs};
use crate::health::{
    inject as health_inject, monitor as health_monitor, nvml as health_nvml, HealthMap, XidPolicy,
};
use crate::install::Installed;
use crate::inventory::{self, Inventory};
use crate::metrics::{self, DriverMetrics, InstrumentedPreparer};
use crate::mig::fake::FakeMig;
use crate::mig::nvml::NvmlMig;
use crate::mig::MigManager;
use crate::node_state::{MigCards, NodeLayout};
use crate::plugin::health::HealthService;
use crate::plugin::registration::{RegistrationOutcome, RegistrationService};
use crate::plugin::{server, stale, Preparer};
use crate::prepare::{ClaimPreparer, PrepareOptions};
use crate::publisher::SlicePublisher;
use crate::slices::{build_slices, SliceMode};
use crate::weights;
use anyhow::Context;
use clap::Parser;
use gpupool_api::crd::GpuModel;
use gpupool_api::names::device_name;
use k8s_openapi::api::core::v1::Event;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// How long in-flight kubelet calls may take to finish after SIGTERM (the kubelet's own call timeout).
const SHUTDOWN_GRACE: Duration = Duration::from_secs(45);
/// How long the first publication waits for the cluster's GpuModel weights.
const WEIGHTS_WAIT: Duration = Duration::from_secs(5);

/// glibc gives every thread that allocates its own arena (up to 8 per core) and does not return
/// their free memory: with prepares running on blocking threads that was most of the driver's heap
/// (BENCHMARKS.md, finding 4). Two arenas keep contention low for a process this size.
fn limit_malloc_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets an allocator parameter; it is called before any thread starts.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
}

/// The whole program: `args` as `std::env::args_os()` gives them, the program's name first.
pub fn main<I, T>(args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    gpupool_telemetry::abort_on_panic();
    let cli = Cli::parse_from(args);
    let logging = matches!(cli.command, Command::Run(_));
    let result = match cli.command {
        Command::Inspect(args) => inspect(args),
        Command::InstallLib(args) => crate::install::install_lib(&args.from, &args.to)
            .map(|installed| match installed {
                Installed::Written(path) => println!("installed {}", path.display()),
                Installed::UpToDate(path) => println!("{} is up to date", path.display()),
            })
            .map_err(anyhow::Error::new),
        Command::InjectXid(args) => {
            crate::health::inject::send(&args.run_dir, &args.device, &args.xid)
                .map(|answer| println!("{answer}"))
        }
        Command::Run(args) => {
            init_tracing(args.log_format);
            limit_malloc_arenas();
            // A node agent needs little parallelism: one thread runs every socket and task, so the
            // kubelet's call, the claim read and the answer never wait for another thread to wake
            // up (serial prepare p99 -17% against two workers, BENCHMARKS.md), and file work goes to
            // a small blocking pool. The defaults (a worker per core, 512 blocking threads) cost
            // memory on a 128-core GPU node and give nothing back.
            match tokio::runtime::Builder::new_current_thread()
                .max_blocking_threads(8)
                .enable_all()
                .build()
            {
                Ok(rt) => rt.block_on(run(*args)),
                Err(e) => Err(anyhow::Error::new(e).context("starting the async runtime")),
            }
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            if logging {
                tracing::error!(error = format!("{err:#}"), "gpupool-driver failed");
            } else {
                eprintln!("gpupool-driver: error: {err:#}");
            }
            ExitCode::FAILURE
        }
    }
}

fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

#[derive(serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct InspectReport<'a> {
    node: &'a str,
    inventory: &'a Inventory,
    compute_weights: &'a BTreeMap<String, i64>,
    resource_slices: Vec<ResourceSlice>,
}

fn inspect(args: InspectArgs) -> anyhow::Result<()> {
    let node = args.node_name.unwrap_or_else(hostname);
    let inventory = inventory::discover(args.fake_gpus.as_deref(), &node)?;
    let weights = weights::resolve_weights(&inventory, &[]);
    let resource_slices = build_slices(
        &inventory,
        &node,
        &weights,
        &HealthMap::default(),
        1,
        SliceMode::Shared,
        crate::devices::Partitioning::Counters,
    )?;
    let report = InspectReport {
        node: &node,
        inventory: &inventory,
        compute_weights: &weights,
        resource_slices,
    };
    print!(
        "{}",
        serde_yaml::to_string(&report).context("rendering YAML")?
    );
    Ok(())
}

async fn kube_client(args: &RunArgs, metrics: &DriverMetrics) -> anyhow::Result<Client> {
    let config = match &args.kubeconfig {
        Some(path) => {
            let kubeconfig = Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .with_context(|| format!("loading kubeconfig {}", path.display()))?
        }
        None => Config::incluster().context(
            "no --kubeconfig given and no in-cluster service account found (KUBERNETES_SERVICE_HOST)",
        )?,
    };
    Ok(kube::client::ClientBuilder::try_from(config)
        .context("building the Kubernetes client")?
        .with_layer(&metrics.api_layer())
        .build())
}

/// SIGTERM or SIGINT, handled from the start so that a stop during start-up is also clean.
struct ShutdownSignals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl ShutdownSignals {
    fn install() -> anyhow::Result<Self> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Self {
            term: signal(SignalKind::terminate()).context("installing the SIGTERM handler")?,
            int: signal(SignalKind::interrupt()).context("installing the SIGINT handler")?,
        })
    }

    async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}

/// Binds the health endpoints, so that a taken port fails the start rather than going unnoticed.
async fn bind_healthz(addr: std::net::SocketAddr) -> anyhow::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the health endpoint {addr}"))
}

/// GET /healthz: 200 once the kubelet sockets are served and the slices were published (alive).
/// GET /readyz: 200 once, besides, the kubelet has confirmed the registration
/// (NotifyRegistrationStatus): a DaemonSet removes the old pod of a rolling update as soon as the
/// new one is ready, and a kubelet that has not registered the new one yet would have no plugin
/// to call in between (0.32 s seen on a real node, when readiness meant /healthz).
async fn serve_health_endpoints(
    listener: tokio::net::TcpListener,
    live: watch::Receiver<bool>,
    ready: watch::Receiver<bool>,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    use axum::http::StatusCode;
    let answer = |flag: watch::Receiver<bool>, not: &'static str| {
        move || {
            let ok = *flag.borrow();
            async move {
                if ok {
                    (StatusCode::OK, "ok\n")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, not)
                }
            }
        }
    };
    let app = axum::Router::new()
        .route(
            "/healthz",
            axum::routing::get(answer(live, "not serving yet\n")),
        )
        .route(
            "/readyz",
            axum::routing::get(answer(ready, "not registered with the kubelet yet\n")),
        );
    tracing::info!(addr = ?listener.local_addr().ok(), "serving GET /healthz and /readyz");
    axum::serve(listener, app)
        .with_graceful_shutdown(stop.cancelled_owned())
        .await
        .context("health endpoint")
}

/// The node's cards with MIG and what manages their instances: NVML on real cards, a file in the
/// run folder on fake ones.
fn mig_cards(inventory: &Inventory, args: &RunArgs) -> anyhow::Result<MigCards> {
    let cards: Vec<String> = inventory
        .gpus
        .iter()
        .filter(|g| g.mig.is_some())
        .map(|g| g.uuid.clone())
        .collect();
    let manager: Arc<dyn MigManager> = if args.fake_gpus.is_some() {
        Arc::new(
            FakeMig::new(&args.run_dir, inventory)
                .with_context(|| format!("fake MIG state in {}", args.run_dir.display()))?,
        )
    } else {
        Arc::new(NvmlMig::new(inventory).map_err(|e| anyhow::anyhow!("{e}"))?)
    };
    if !cards.is_empty() {
        tracing::info!(cards = ?cards, "cards with MIG: their MIG devices are created at prepare");
    }
    Ok(MigCards { manager, cards })
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    let mut signals = ShutdownSignals::install()?;
    let node = args.node_name.clone();
    let inventory = Arc::new(inventory::discover(args.fake_gpus.as_deref(), &node)?);
    tracing::info!(
        node = %node,
        source = ?inventory.source,
        gpus = inventory.gpus.len(),
        models = ?inventory.gpus.iter().map(|g| g.model.as_str()).collect::<Vec<_>>(),
        "discovered GPUs"
    );
    let mut driver_metrics = DriverMetrics::new();
    let client = kube_client(&args, &driver_metrics).await?;
    let healthz_listener = match args.healthz_addr {
        Some(addr) => Some(bind_healthz(addr).await?),
        None => None,
    };
    let metrics_listener = match args.metrics_addr.0 {
        Some(addr) => Some(metrics::bind(addr).await?),
        None => None,
    };
    let stop = CancellationToken::new();

    let (weights_tx, weights_rx) = weights::channel(&inventory);
    let (settled_tx, mut settled_rx) = watch::channel(false);
    let weights_task = tokio::spawn(weights::watch_gpu_models(
        Api::<GpuModel>::all(client.clone()),
        inventory.clone(),
        weights_tx,
        settled_tx,
        stop.clone(),
    ));

    if let Some(pod_uid) = &args.pod_uid {
        tracing::info!(
            pod_uid,
            registration = %args.registration_socket().display(),
            dra = %args.dra_socket().display(),
            "taking turns on this node's claims with any other instance (rolling update)"
        );
    }
    let mig = mig_cards(&inventory, &args)?;
    // Start-up reconciliation of claims happens before the kubelet can reach us.
    let preparer = ClaimPreparer::new(
        PrepareOptions {
            node_name: node.clone(),
            layout: NodeLayout {
                serialize_lock: args.serialize_lock(),
                mps: args.mps(),
                ..NodeLayout::new(
                    args.state_dir.clone(),
                    args.cdi_root.clone(),
                    args.run_dir.clone(),
                    (&args.gpupool_lib_dir, &args.vgpu_lib_dir),
                    args.fake_gpus.is_some(),
                )
            },
            driver_libraries: args.driver_libraries(),
            mig,
            default_enforcement: args.default_enforcement(),
            status_write_delay: crate::prepare::STATUS_WRITE_DELAY,
        },
        inventory.clone(),
        client.clone(),
        weights_rx.clone(),
    )
    .await
    .context("reconciling prepared claims at start")?;
    let preparer = Arc::new(preparer);
    let status_writer = preparer.clone();
    // Device health: NVML events and probe (or inject-xid on fake GPUs) -> one monitor -> the
    // slices' taints and the kubelet's health stream.
    let xid_policy = XidPolicy::new(args.xid_fatal.clone(), args.xid_ignore.clone())
        .map_err(anyhow::Error::msg)?;
    let mut devices = HealthMap::new(inventory.gpus.iter().map(|g| device_name(g.index)));
    if let Some(saved) = health_monitor::load(&args.run_dir) {
        devices = devices.restored_from(&saved);
    }
    let (monitor, devices_rx) = health_monitor::Monitor::new(
        node.clone(),
        xid_policy,
        devices,
        Some(Api::<Event>::namespaced(client.clone(), "default")),
        Some(&args.run_dir),
    );
    let (reports_tx, reports_rx) = health_monitor::channel();
    let monitor_task = tokio::spawn(monitor.run(reports_rx, stop.clone()));
    let inject_task = health_inject::serve(
        &args.run_dir,
        args.pod_uid.as_deref(),
        reports_tx.clone(),
        stop.clone(),
    )?;
    let nvml_watch = match args.fake_gpus {
        Some(_) => None,
        None => Some(
            health_nvml::spawn(inventory.clone(), reports_tx.clone(), stop.clone())
                .context("starting the NVML health thread")?,
        ),
    };
    drop(reports_tx);
    // Claims prepared on a device that turns unhealthy say so in their status (Ready=False), and
    // so do the claims of a card whose MPS daemon was found dead (and started again).
    let claim_health_task = tokio::spawn({
        let (preparer, mut health, stop) = (preparer.clone(), devices_rx.clone(), stop.clone());
        async move {
            let mut mps_check = tokio::time::interval(crate::prepare::MPS_CHECK_INTERVAL);
            loop {
                let mut unhealthy = health.borrow_and_update().unhealthy();
                for (device, fault) in preparer.mps_faults() {
                    unhealthy.entry(device).or_insert(fault);
                }
                preparer.report_device_health(unhealthy);
                tokio::select! {
                    _ = stop.cancelled() => return,
                    changed = health.changed() => if changed.is_err() { return },
                    _ = mps_check.tick() => { preparer.check_mps().await; }
                }
            }
        }
    });
    driver_metrics.register_node(
        inventory.clone(),
        {
            let (preparer, inventory) = (preparer.clone(), inventory.clone());
            move || preparer.read_checkpoint(|data| metrics::node_state(&inventory, data))
        },
        devices_rx.clone(),
        client.clone(),
    );
    let driver_metrics = Arc::new(driver_metrics);
    let metrics_task = metrics_listener.map(|listener| {
        tokio::spawn(metrics::serve(
            listener,
            driver_metrics.clone(),
            stop.clone(),
        ))
    });

    if args.pod_uid.is_some() {
        let (registry, plugin, run) = (
            args.registry_dir.clone(),
            args.plugin_dir.clone(),
            args.run_dir.clone(),
        );
        let own = vec![
            args.registration_socket(),
            args.dra_socket(),
            health_inject::socket_path(&args.run_dir, args.pod_uid.as_deref()),
        ];
        let removed = tokio::task::spawn_blocking(move || {
            stale::remove_dead_sockets(&registry, &plugin, &run, &own)
        })
        .await
        .unwrap_or_default();
        for path in removed {
            tracing::info!(path = %path.display(), "removed the socket of a driver that is gone");
        }
    }
    let health = HealthService::new(node.clone(), devices_rx.clone(), stop.clone());
    let dra = server::serve_dra(
        &args.dra_socket(),
        Arc::new(InstrumentedPreparer::new(
            preparer as Arc<dyn Preparer>,
            &driver_metrics,
        )),
        health,
        stop.clone(),
    )?;

    let (published_tx, mut published_rx) = watch::channel(false);
    let publisher = SlicePublisher::new(client.clone(), node.clone());
    let publisher_task = tokio::spawn({
        let (inventory, stop) = (inventory.clone(), stop.clone());
        async move {
            // Publishing the built-in weights and then the cluster's would bump the generation twice
            // on every restart; a slow API only delays the first publication by this much.
            let _ = tokio::time::timeout(WEIGHTS_WAIT, settled_rx.wait_for(|s| *s)).await;
            publisher
                .run(inventory, weights_rx, devices_rx, published_tx, stop)
                .await
        }
    });

    let (outcome_tx, mut outcome_rx) = watch::channel(None);
    let registration = server::serve_registration(
        &args.registration_socket(),
        RegistrationService::new(args.dra_socket().to_string_lossy(), outcome_tx),
        stop.clone(),
    )?;

    let (live_tx, live_rx) = watch::channel(false);
    let (ready_tx, ready_rx) = watch::channel(false);
    let readiness = tokio::spawn({
        let stop = stop.clone();
        async move {
            let published = async {
                let _ = published_rx.wait_for(|p| *p).await;
                live_tx.send_replace(true);
            };
            let registered = async {
                let _ = outcome_rx
                    .wait_for(|o| o == &Some(RegistrationOutcome::Registered))
                    .await;
            };
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = async { tokio::join!(published, registered) } => {
                    tracing::info!("ready: slices published and registered with the kubelet");
                    ready_tx.send_replace(true);
                }
            }
        }
    });
    let healthz = healthz_listener.map(|listener| {
        tokio::spawn(serve_health_endpoints(
            listener,
            live_rx,
            ready_rx,
            stop.clone(),
        ))
    });

    let signal = signals.recv().await;
    tracing::info!(
        signal,
        "shutting down: no new calls, waiting for in-flight ones"
    );
    stop.cancel();

    let sockets = async {
        let reg = registration.finish().await;
        let dra = dra.finish().await;
        reg.and(dra)
    };
    match tokio::time::timeout(SHUTDOWN_GRACE, sockets).await {
        Ok(result) => result?,
        Err(_) => {
            tracing::warn!(
                "in-flight calls did not finish within {SHUTDOWN_GRACE:?}; stopping anyway"
            );
            for path in [args.registration_socket(), args.dra_socket()] {
                let _ = std::fs::remove_file(path);
            }
        }
    }
    // Claim statuses are written after the kubelet got its answer: let those queued finish, within
    // the same grace, so `kubectl describe` does not keep a stale entry after a clean restart.
    if tokio::time::timeout(SHUTDOWN_GRACE, status_writer.flush_status_writes())
        .await
        .is_err()
    {
        tracing::warn!("claim status writes did not finish within {SHUTDOWN_GRACE:?}");
    }
    // Leave the checkpoint in one file: a driver version before the log reads only that one.
    if let Err(e) = status_writer.compact_checkpoint().await {
        tracing::warn!(error = %e, "could not fold the checkpoint log into its snapshot");
    }
    let _ = publisher_task.await;
    let _ = monitor_task.await;
    let _ = claim_health_task.await;
    let _ = inject_task.await;
    if let Some(thread) = nvml_watch {
        // It notices the stop within one NVML wait (a second).
        let _ = tokio::task::spawn_blocking(move || thread.join()).await;
    }
    let _ = weights_task.await;
    let _ = readiness.await;
    if let Some(task) = healthz {
        if let Ok(Err(e)) = task.await {
            tracing::warn!(error = format!("{e:#}"), "health endpoint");
        }
    }
    if let Some(task) = metrics_task {
        if let Ok(Err(e)) = task.await {
            tracing::warn!(error = format!("{e:#}"), "metrics endpoint");
        }
    }
    tracing::info!("stopped");
    Ok(())
}

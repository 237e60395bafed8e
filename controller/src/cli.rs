//! `gpupool-controller`: `run` and `crds`. The binary's `main` is [`main`]; it is in the library so
//! that the sandbox (gpupool-e2e) can be the controller too, started from its own executable,
//! without a second build.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::{ExitCode, Termination};
use std::sync::Arc;
use std::time::Duration;

use crate::duration::parse_duration;
use crate::leader::{LeaderElector, Leadership, LeaseConfig};
use crate::metrics::{self, ControllerMetrics};
use crate::models::ALL_GPUS_CLASS;
use crate::owner::Owner;
use crate::reconcile::{self, Reconciler, Settings};
use anyhow::Context;
use clap::{ArgAction, Parser, Subcommand, ValueEnum};
use kube::config::{KubeConfigOptions, Kubeconfig};
use tracing::info;

/// gpupool controller: manages DeviceClasses and ResourceClaimTemplates from GpuModels and ComputeProfiles.
#[derive(Parser, Debug)]
#[command(name = "gpupool-controller", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Print the CRD manifests generated from the types (or write them into a folder).
    Crds {
        /// Write one file per CRD into this folder instead of printing.
        #[arg(long)]
        dir: Option<PathBuf>,
    },
    /// Run the controller.
    Run(Box<RunArgs>),
    /// Serve the validating admission webhook (POST /validate, HTTPS) for gpupool.dev opaque configs.
    Webhook(Box<WebhookArgs>),
}

#[derive(clap::Args, Debug)]
struct WebhookArgs {
    /// Kubeconfig file (self-signed mode keeps the webhook configuration's caBundle with it);
    /// default: $KUBECONFIG, ~/.kube/config, or the in-cluster service account.
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// Address to serve HTTPS on: `host:port` or `:port` for every address.
    #[arg(long, default_value = ":8443", value_parser = parse_webhook_addr)]
    listen: std::net::SocketAddr,
    /// Serving certificate (PEM, e.g. a cert-manager Secret's tls.crt); with --tls-key-file.
    /// Without both, the webhook makes its own CA and certificate (self-signed mode).
    #[arg(long, requires = "tls_key_file")]
    tls_cert_file: Option<PathBuf>,
    /// The certificate's private key (PEM, e.g. tls.key).
    #[arg(long, requires = "tls_cert_file")]
    tls_key_file: Option<PathBuf>,
    /// How often the certificate files are read again (a renewed Secret is served without restart).
    #[arg(long, default_value = "1m", value_parser = parse_duration)]
    tls_reload_interval: Duration,
    /// Self-signed mode: the names (and IP addresses) the certificate is made for; default: the
    /// Service's DNS names from --service and --namespace.
    #[arg(long = "cert-host")]
    cert_hosts: Vec<String>,
    /// Self-signed mode: the Service in front of the webhook.
    #[arg(long, default_value = "gpupool-webhook")]
    service: String,
    /// Self-signed mode: the Service's namespace; default $POD_NAMESPACE, else gpupool.
    #[arg(long)]
    namespace: Option<String>,
    /// Self-signed mode: how long a made certificate is valid; a new one is made at two thirds.
    #[arg(long, default_value = "8760h", value_parser = parse_duration)]
    cert_validity: Duration,
    /// Self-signed mode: the ValidatingWebhookConfiguration whose caBundle this webhook keeps in
    /// step with its CA; empty: none (the caBundle is someone else's to set).
    #[arg(long, default_value = "gpupool-webhook")]
    webhook_configuration: String,
    /// Self-signed mode: how often the caBundle is checked and put back.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    ca_bundle_interval: Duration,
    #[arg(long, value_enum, default_value = "text")]
    log_format: LogFormat,
}

fn parse_webhook_addr(value: &str) -> Result<std::net::SocketAddr, String> {
    metrics::parse_listen_addr(value)?
        .0
        .ok_or_else(|| "the webhook needs an address to listen on".to_string())
}

async fn webhook(args: WebhookArgs) -> anyhow::Result<()> {
    use crate::webhook::{CertSource, Settings};
    init_logging(args.log_format);
    let certs = match (args.tls_cert_file, args.tls_key_file) {
        (Some(cert), Some(key)) => CertSource::Files {
            cert,
            key,
            reload: args.tls_reload_interval,
        },
        _ => {
            let namespace = args
                .namespace
                .or_else(|| {
                    std::env::var("POD_NAMESPACE")
                        .ok()
                        .filter(|n| !n.is_empty())
                })
                .unwrap_or_else(|| "gpupool".to_string());
            let hosts = if args.cert_hosts.is_empty() {
                let service = &args.service;
                vec![
                    format!("{service}.{namespace}.svc"),
                    format!("{service}.{namespace}.svc.cluster.local"),
                ]
            } else {
                args.cert_hosts
            };
            CertSource::SelfSigned {
                hosts,
                validity: args.cert_validity,
                webhook_configuration: Some(args.webhook_configuration).filter(|n| !n.is_empty()),
            }
        }
    };
    let needs_client = matches!(
        &certs,
        CertSource::SelfSigned {
            webhook_configuration: Some(_),
            ..
        }
    );
    let client = if needs_client {
        Some(client(args.kubeconfig.as_ref(), "webhook").await?)
    } else {
        None
    };
    let mut settings = Settings::new(args.listen, certs);
    settings.ca_bundle_interval = args.ca_bundle_interval;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let running = crate::webhook::start(settings, client, stopped).await?;
    shutdown_signal().await;
    info!("shutting down");
    let _ = stop.send(true);
    running.join().await;
    Ok(())
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(clap::Args, Debug)]
struct RunArgs {
    /// Kubeconfig file; default: $KUBECONFIG, ~/.kube/config, or the in-cluster service account.
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// Namespace of the leader-election Lease.
    #[arg(long, default_value = "kube-system")]
    lease_namespace: String,
    /// Name of the leader-election Lease.
    #[arg(long, default_value = "gpupool-controller")]
    lease_name: String,
    /// Role in --lease-namespace that owns the Lease, so that the Lease goes when the install's
    /// Role does (helm uninstall, kubectl delete -k); empty: the Lease has no owner.
    #[arg(long, default_value = "gpupool-controller-leader-election")]
    lease_owner_role: String,
    /// ClusterRole that owns the all-GPUs DeviceClass gpupool.dev, so that the class goes when the
    /// install's ClusterRole does; empty: the class has no owner.
    #[arg(long, default_value = "gpupool-controller")]
    owner_cluster_role: String,
    /// This replica's name in the Lease; default: $POD_NAME, else the host name plus a random suffix.
    #[arg(long)]
    identity: Option<String>,
    /// How long a Lease stays valid without renewal.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    lease_duration: Duration,
    /// How often the leader renews (and followers retry).
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    renew_interval: Duration,
    /// Elect a leader through the Lease; false only for a single replica.
    #[arg(long, default_value_t = true, action = ArgAction::Set)]
    leader_elect: bool,
    /// Give model classes `extendedResourceName: gpupool.dev/<model>` (dropped automatically when the
    /// API server does not know the field).
    #[arg(long, default_value_t = true, action = ArgAction::Set)]
    extended_resources: bool,
    /// Full reconcile at least this often, even without watch events.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    resync: Duration,
    /// Create or update the GpuModel and ComputeProfile CRDs on start.
    #[arg(long)]
    install_crds: bool,
    #[arg(long, value_enum, default_value = "text")]
    log_format: LogFormat,
    /// Address of the Prometheus endpoint (GET /metrics): `host:port`, `:port` for every address,
    /// or empty to turn it off.
    #[arg(long, env = "METRICS_ADDR", default_value = ":9465", value_parser = metrics::parse_listen_addr)]
    metrics_addr: metrics::ListenAddr,
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colours only on a terminal: the harness and log collectors read files.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

fn default_identity() -> String {
    if let Ok(pod) = std::env::var("POD_NAME") {
        if !pod.is_empty() {
            return pod;
        }
    }
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "gpupool-controller".to_string());
    // Two processes on one host must not share an identity.
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    format!("{host}_{}", &suffix[..8])
}

async fn client(kubeconfig: Option<&PathBuf>, identity: &str) -> anyhow::Result<kube::Client> {
    let mut config = match kubeconfig {
        Some(path) => {
            let kubeconfig = Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .with_context(|| format!("loading kubeconfig {}", path.display()))?
        }
        None => kube::Config::infer()
            .await
            .context("no kubeconfig: pass --kubeconfig, set KUBECONFIG or run in a cluster")?,
    };
    // Audit logs (and the e2e emulator's request log) tell the replicas apart by this.
    let user_agent = format!(
        "gpupool-controller/{} ({identity})",
        env!("CARGO_PKG_VERSION")
    );
    if let Ok(value) = http::HeaderValue::from_str(&user_agent) {
        config.headers.push((http::header::USER_AGENT, value));
    }
    kube::Client::try_from(config).context("building the Kubernetes client")
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    init_logging(args.log_format);
    let identity = args.identity.clone().unwrap_or_else(default_identity);
    let client = client(args.kubeconfig.as_ref(), &identity).await?;
    let metrics_listener = match args.metrics_addr.0 {
        Some(addr) => Some(metrics::bind(addr).await?),
        None => None,
    };
    if args.install_crds {
        reconcile::install_crds(&client).await?;
    }
    info!(
        %identity,
        lease = %format!("{}/{}", args.lease_namespace, args.lease_name),
        leader_elect = args.leader_elect,
        "gpupool-controller starting"
    );
    let (stop, stopped) = tokio::sync::watch::channel(false);

    let (leadership, elector) = if args.leader_elect {
        let mut elector = LeaderElector::new(
            client.clone(),
            LeaseConfig {
                namespace: args.lease_namespace.clone(),
                name: args.lease_name.clone(),
                identity,
                lease_duration: args.lease_duration,
                renew_interval: args.renew_interval,
            },
        );
        if !args.lease_owner_role.is_empty() {
            elector = elector.with_owner(Owner::role(
                client.clone(),
                &args.lease_namespace,
                &args.lease_owner_role,
                &format!("Lease {}/{}", args.lease_namespace, args.lease_name),
            ));
        }
        let leadership = elector.leadership();
        (leadership, Some(tokio::spawn(elector.run(stopped.clone()))))
    } else {
        (Leadership::always(), None)
    };
    let controller_metrics = Arc::new(ControllerMetrics::new());
    let metrics_task = metrics_listener.map(|listener| {
        tokio::spawn(metrics::serve(
            listener,
            controller_metrics.clone(),
            stopped.clone(),
        ))
    });
    let mut reconciler = Reconciler::new(
        client.clone(),
        leadership,
        Settings {
            extended_resources: args.extended_resources,
            resync: args.resync,
            ..Settings::default()
        },
    )
    .with_metrics(controller_metrics);
    if !args.owner_cluster_role.is_empty() {
        reconciler = reconciler.with_class_owner(Owner::cluster_role(
            client,
            &args.owner_cluster_role,
            &format!("DeviceClass {ALL_GPUS_CLASS}"),
        ));
    }
    let reconciler = Arc::new(reconciler);
    let controller = tokio::spawn(reconciler.run(stopped));

    shutdown_signal().await;
    info!("shutting down");
    let _ = stop.send(true);
    let _ = controller.await;
    if let Some(elector) = elector {
        let _ = elector.await;
    }
    if let Some(task) = metrics_task {
        if let Ok(Err(e)) = task.await {
            tracing::warn!(error = format!("{e:#}"), "metrics endpoint");
        }
    }
    Ok(())
}

/// The whole program: `args` as `std::env::args_os()` gives them, the program's name first. An
/// error ends it as a `main` returning it does: `Error: {err:?}` on stderr, exit code 1.
pub fn main<I, T>(args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    run_cli(args).report()
}

fn run_cli<I, T>(args: I) -> anyhow::Result<()>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    gpupool_telemetry::abort_on_panic();
    let cli = Cli::parse_from(args);
    match cli.command {
        Command::Crds { dir: None } => print!("{}", crate::crds::multi_document()),
        Command::Crds { dir: Some(dir) } => {
            for (file, yaml) in crate::crds::manifests() {
                let path = dir.join(file);
                std::fs::write(&path, yaml)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
        }
        Command::Run(args) => tokio::runtime::Runtime::new()
            .context("starting the async runtime")?
            .block_on(run(*args))?,
        Command::Webhook(args) => tokio::runtime::Runtime::new()
            .context("starting the async runtime")?
            .block_on(webhook(*args))?,
    }
    Ok(())
}

//! `gpupool-apiserver`: the API server emulator as a process, serving until SIGTERM or Ctrl-C.

use std::path::PathBuf;

use clap::Parser;
use gpupool_apiserver::{ApiProfile, ApiServer, ApiServerOptions};

#[derive(Parser)]
#[command(
    about = "Kubernetes API server emulator on 127.0.0.1 (REST + watch, JSON, RBAC; the kubeconfig it writes is an administrator's)"
)]
struct Args {
    /// Port on 127.0.0.1; 0 picks a free one.
    #[arg(long, default_value_t = 0)]
    port: u16,
    /// Where to write a kubeconfig for this server (context gpupool-emulator).
    #[arg(long)]
    kubeconfig_out: Option<PathBuf>,
    /// What each request costs: `none` answers at once, `real` charges what kube-apiserver with
    /// etcd does (quorum and cached reads, writes sharing the fsyncs of one disk).
    #[arg(long, value_enum, default_value_t = ApiProfile::None)]
    api_profile: ApiProfile,
    /// Seed of the profile's delays.
    #[arg(long, default_value_t = 0)]
    latency_seed: u64,
    /// How far `resourceVersion=0` reads of one object lag behind writes, in milliseconds
    /// (fractions allowed); the profile's own by default (0 for none, 1 for real).
    #[arg(long)]
    cache_lag_ms: Option<f64>,
    /// Behave like a cluster without DRAPartitionableDevices: drop ResourceSlices' counter sets
    /// and counter consumptions on write.
    #[arg(long)]
    without_partitionable_devices: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    // Installed before the URL is printed, so whoever reads the URL may signal at once.
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut options = ApiServerOptions::default()
        .port(args.port)
        .profile(args.api_profile)
        .seed(args.latency_seed);
    if args.without_partitionable_devices {
        options = options.without_partitionable_devices();
    }
    if let Some(lag) = args.cache_lag_ms {
        anyhow::ensure!(
            lag.is_finite() && lag >= 0.0,
            "--cache-lag-ms must be 0 or more"
        );
        options = options.cache_lag(std::time::Duration::from_secs_f64(lag / 1e3));
    }
    let server = ApiServer::start_with(options).await?;
    if let Some(path) = &args.kubeconfig_out {
        server.write_kubeconfig(path)?;
        tracing::info!(path = %path.display(), "kubeconfig written");
    }
    println!("{}", server.url());
    tracing::info!(url = %server.url(), "serving");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = sigterm.recv() => {}
    }
    tracing::info!("shutting down");
    server.stop_serving().await;
    Ok(())
}

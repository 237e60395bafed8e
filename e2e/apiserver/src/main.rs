//! `gpupool-apiserver`: the API server emulator as a process, serving until SIGTERM or Ctrl-C.

use std::path::PathBuf;

use clap::Parser;
use gpupool_apiserver::ApiServer;

#[derive(Parser)]
#[command(about = "Kubernetes API server emulator on 127.0.0.1 (REST + watch, JSON, no auth)")]
struct Args {
    /// Port on 127.0.0.1; 0 picks a free one.
    #[arg(long, default_value_t = 0)]
    port: u16,
    /// Where to write a kubeconfig for this server (context gpupool-emulator).
    #[arg(long)]
    kubeconfig_out: Option<PathBuf>,
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
    let server = ApiServer::start_on(args.port).await?;
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

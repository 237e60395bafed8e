//! `gpupool-sandbox`: the whole system on this machine with fake GPUs. Starts the API server
//! emulator, the scheduler stand-in, a kubelet emulator per node, the real controller and one real
//! driver per node, applies `deploy/examples/`, waits until the pods settle and prints what happened.
//! `--serve` keeps it up for `kubectl`. Everything lives in a temporary folder removed at exit.
//! The driver and the controller are this executable, started again as them (`gpupool_e2e::roles`),
//! so `cargo run` builds everything the sandbox runs.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use gpupool_e2e::harness::{
    init_stderr_tracing, two_worker_runtime, workspace_root, ClusterSpec, Programs, TestCluster,
    CONTROLLER_BIN, DRIVER_BIN,
};
use gpupool_e2e::{roles, sandbox};

#[derive(Parser, Debug)]
#[command(
    name = "gpupool-sandbox",
    about = "gpupool on fake GPUs, on this machine, in seconds"
)]
struct Args {
    /// Keep the cluster running after the report and print `export KUBECONFIG=...` (Ctrl-C stops it).
    #[arg(long)]
    serve: bool,
    /// Folder of YAML files to apply.
    #[arg(long, default_value_os_t = sandbox::examples_dir())]
    examples: PathBuf,
    /// Longest wait for the pods to settle, in seconds.
    #[arg(long, default_value_t = 30)]
    settle_seconds: u64,
}

/// Waits until every pod runs, or nothing has changed for 3 s, or `limit` has passed.
async fn settle(cluster: &TestCluster, limit: Duration) -> Result<sandbox::Report, String> {
    let start = Instant::now();
    let mut last: Option<(sandbox::Report, Instant)> = None;
    loop {
        let report = sandbox::gather(cluster).await.map_err(|e| e.to_string())?;
        let all_running = report.waiting_pods.is_empty() && !report.claims.is_empty();
        let unchanged_since = match &last {
            Some((prev, since)) if *prev == report => *since,
            _ => Instant::now(),
        };
        let quiet = unchanged_since.elapsed() >= Duration::from_secs(3);
        if all_running || quiet || start.elapsed() >= limit {
            return Ok(report);
        }
        last = Some((report, unchanged_since));
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

async fn run(args: Args) -> Result<(), String> {
    let started = Instant::now();
    // The driver and the controller are this executable started again as them (roles.rs): the
    // `cargo run` that built it is the only build.
    let spec = ClusterSpec {
        programs: Programs::ThisExecutable,
        ..sandbox::cluster_spec()
    };
    let cluster = TestCluster::start(spec).await.map_err(|e| e.to_string())?;
    println!(
        "started the API server emulator, the scheduler stand-in, {CONTROLLER_BIN} and {} x {DRIVER_BIN} in {:.1}s",
        cluster.nodes().len(),
        started.elapsed().as_secs_f64()
    );
    for node in cluster.nodes() {
        println!("  {:<10} fake GPUs {}", node.name, node.spec.fake_gpus);
    }

    for file in sandbox::example_files(&args.examples)? {
        let shown = file
            .strip_prefix(workspace_root())
            .unwrap_or(&file)
            .display()
            .to_string();
        match cluster.apply_file(&file, None).await {
            Ok(()) => println!("applied {shown}"),
            Err(err) => println!("FAILED to apply {shown}: {err}"),
        }
    }

    println!("Prometheus metrics (curl them, or point a scrape config at them):");
    for (what, url) in sandbox::metrics_endpoints(&cluster) {
        println!("  {what:<20} {url}");
    }

    let report = match settle(&cluster, Duration::from_secs(args.settle_seconds)).await {
        Ok(report) => report,
        Err(err) => {
            cluster.print_logs();
            return Err(err);
        }
    };
    println!();
    print!("{}", sandbox::render(&report));
    println!("\nfinished in {:.1}s", started.elapsed().as_secs_f64());

    if args.serve {
        println!("\nThe sandbox keeps running; in another shell:");
        println!(
            "  export KUBECONFIG={}",
            cluster.kubeconfig_path().display()
        );
        println!("  kubectl get resourceslices,resourceclaims,pods -A");
        println!(
            "Logs and CDI folders are under {}",
            cluster.workdir().display()
        );
        println!("Ctrl-C stops it and removes everything.");
        std::future::pending::<()>().await;
    }
    Ok(())
}

/// Ctrl-C or SIGTERM: the cluster is then dropped, which stops the processes and removes the folder.
async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(term) => term,
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

fn main() -> ExitCode {
    // Before anything of the sandbox's own: the processes it starts as the driver and the
    // controller set up their own logging and runtime.
    if let Some(code) = roles::run_if_asked() {
        return code;
    }
    init_stderr_tracing();
    let args = Args::parse();
    let runtime = match two_worker_runtime() {
        Ok(rt) => rt,
        Err(err) => {
            eprintln!("gpupool-sandbox: starting the runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    let serve = args.serve;
    let outcome = runtime.block_on(async {
        tokio::select! {
            result = run(args) => result,
            _ = shutdown_signal() => if serve { Ok(()) } else { Err("interrupted".to_string()) },
        }
    });
    // Nothing left to wait for: the cluster was dropped inside block_on.
    runtime.shutdown_timeout(Duration::from_millis(200));
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("gpupool-sandbox: {err}");
            ExitCode::FAILURE
        }
    }
}

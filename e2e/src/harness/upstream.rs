//! The two in-process parts owned by other crates: the API server emulator and the scheduler stand-in.
//! Kept in one place so the harness depends on their interfaces at exactly these lines.

pub use gpupool_apiserver::{ApiServer, ApiServerOptions};

/// Runs the scheduler stand-in until the task is aborted.
pub async fn run_scheduler(client: kube::Client) -> anyhow::Result<()> {
    gpupool_scheduler::run(client, gpupool_scheduler::Options::default()).await
}

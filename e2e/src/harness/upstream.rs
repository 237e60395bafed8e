//! The two in-process parts owned by other crates: the API server emulator and the scheduler stand-in.
//! Kept in one place so the harness depends on their interfaces at exactly these lines.

use std::path::Path;

/// Placeholder until `gpupool_apiserver::ApiServer` lands.
pub struct ApiServer;

impl ApiServer {
    pub async fn start() -> anyhow::Result<ApiServer> {
        anyhow::bail!("the API server emulator (gpupool-apiserver) is not available yet")
    }

    pub fn url(&self) -> String {
        String::new()
    }

    pub fn write_kubeconfig(&self, _path: &Path) -> anyhow::Result<()> {
        anyhow::bail!("the API server emulator (gpupool-apiserver) is not available yet")
    }
}

/// Runs the scheduler stand-in until the task is aborted.
pub async fn run_scheduler(_client: kube::Client) -> anyhow::Result<()> {
    anyhow::bail!("the scheduler stand-in (gpupool-scheduler) is not available yet")
}

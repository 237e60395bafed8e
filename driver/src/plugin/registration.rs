//! Plugin registration: tells the kubelet what this plugin is and where its DRA socket is, and hears
//! whether the kubelet accepted it.

use gpupool_api::names::DRIVER_NAME;
use gpupool_proto::registration as reg;
use gpupool_proto::{versions, DRA_PLUGIN_TYPE};
use tokio::sync::watch;
use tonic::{Request, Response, Status};

/// The kubelet's verdict on our registration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegistrationOutcome {
    Registered,
    Rejected(String),
}

/// Serves `pluginregistration.Registration`.
pub struct RegistrationService {
    endpoint: String,
    outcome: watch::Sender<Option<RegistrationOutcome>>,
}

/// Versions advertised in `PluginInfo.supported_versions` (the kubelet's short names).
pub fn supported_versions() -> Vec<String> {
    vec![
        versions::DRA_V1.to_string(),
        versions::DRA_V1BETA1.to_string(),
        versions::HEALTH_V1.to_string(),
        versions::HEALTH_V1ALPHA1.to_string(),
    ]
}

impl RegistrationService {
    /// `endpoint`: path of the DRA socket. The latest verdict is sent on `outcome`.
    pub fn new(
        endpoint: impl Into<String>,
        outcome: watch::Sender<Option<RegistrationOutcome>>,
    ) -> Self {
        Self {
            endpoint: endpoint.into(),
            outcome,
        }
    }

    pub fn into_server(self) -> reg::registration_server::RegistrationServer<Self> {
        reg::registration_server::RegistrationServer::new(self)
    }
}

#[tonic::async_trait]
impl reg::registration_server::Registration for RegistrationService {
    async fn get_info(
        &self,
        _request: Request<reg::InfoRequest>,
    ) -> Result<Response<reg::PluginInfo>, Status> {
        Ok(Response::new(reg::PluginInfo {
            r#type: DRA_PLUGIN_TYPE.to_string(),
            name: DRIVER_NAME.to_string(),
            endpoint: self.endpoint.clone(),
            supported_versions: supported_versions(),
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<reg::RegistrationStatus>,
    ) -> Result<Response<reg::RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        let outcome = if status.plugin_registered {
            tracing::info!(endpoint = %self.endpoint, "registered with kubelet");
            RegistrationOutcome::Registered
        } else {
            tracing::error!(error = %status.error, "kubelet rejected the plugin registration");
            RegistrationOutcome::Rejected(status.error)
        };
        self.outcome.send_replace(Some(outcome));
        Ok(Response::new(reg::RegistrationStatusResponse {}))
    }
}

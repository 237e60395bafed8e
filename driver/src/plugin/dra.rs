//! DRA v1 and v1beta1 services: translate the kubelet's messages to [`ClaimRef`] / [`PreparedDevice`]
//! and back. v1beta1 has no share id: its devices are answered without one.

use std::collections::HashMap;
use std::sync::Arc;

use gpupool_proto::{dra_v1 as v1, dra_v1beta1 as v1beta1};
use tonic::{Request, Response, Status};

use super::Preparer;
use crate::prepare::{ClaimRef, PreparedDevice};

fn claim_ref(namespace: String, name: String, uid: String) -> ClaimRef {
    ClaimRef {
        namespace,
        name,
        uid,
    }
}

fn log_results<T>(what: &str, results: &[(ClaimRef, Result<T, String>)]) {
    for (claim, result) in results {
        match result {
            Ok(_) => {
                tracing::info!(claim = %format!("{}/{}", claim.namespace, claim.name), uid = %claim.uid, "{what} claim")
            }
            Err(error) => {
                tracing::warn!(claim = %format!("{}/{}", claim.namespace, claim.name), uid = %claim.uid, %error, "{what} claim failed")
            }
        }
    }
}

/// Serves `k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`.
#[derive(Clone)]
pub struct DraV1 {
    preparer: Arc<dyn Preparer>,
}

impl DraV1 {
    pub fn new(preparer: Arc<dyn Preparer>) -> Self {
        Self { preparer }
    }

    pub fn into_server(self) -> v1::dra_plugin_server::DraPluginServer<Self> {
        v1::dra_plugin_server::DraPluginServer::new(self)
    }
}

fn v1_device(d: PreparedDevice) -> v1::Device {
    v1::Device {
        request_names: d.request_names,
        pool_name: d.pool_name,
        device_name: d.device_name,
        cdi_device_ids: d.cdi_device_ids,
        share_id: d.share_id,
    }
}

#[tonic::async_trait]
impl v1::dra_plugin_server::DraPlugin for DraV1 {
    async fn node_prepare_resources(
        &self,
        request: Request<v1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1::NodePrepareResourcesResponse>, Status> {
        let claims = request
            .into_inner()
            .claims
            .into_iter()
            .map(|c| claim_ref(c.namespace, c.name, c.uid))
            .collect();
        let results = self.preparer.prepare(claims).await;
        log_results("prepared", &results);
        let claims: HashMap<_, _> = results
            .into_iter()
            .map(|(claim, result)| {
                let answer = match result {
                    Ok(devices) => v1::NodePrepareResourceResponse {
                        devices: devices.into_iter().map(v1_device).collect(),
                        error: String::new(),
                    },
                    Err(error) => v1::NodePrepareResourceResponse {
                        devices: vec![],
                        error,
                    },
                };
                (claim.uid, answer)
            })
            .collect();
        Ok(Response::new(v1::NodePrepareResourcesResponse { claims }))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<v1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1::NodeUnprepareResourcesResponse>, Status> {
        let claims = request
            .into_inner()
            .claims
            .into_iter()
            .map(|c| claim_ref(c.namespace, c.name, c.uid))
            .collect();
        let results = self.preparer.unprepare(claims).await;
        log_results("unprepared", &results);
        let claims = results
            .into_iter()
            .map(|(claim, result)| {
                let error = result.err().unwrap_or_default();
                (claim.uid, v1::NodeUnprepareResourceResponse { error })
            })
            .collect();
        Ok(Response::new(v1::NodeUnprepareResourcesResponse { claims }))
    }
}

/// Serves `k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin` for kubelets that know only v1beta1.
#[derive(Clone)]
pub struct DraV1beta1 {
    preparer: Arc<dyn Preparer>,
}

impl DraV1beta1 {
    pub fn new(preparer: Arc<dyn Preparer>) -> Self {
        Self { preparer }
    }

    pub fn into_server(self) -> v1beta1::dra_plugin_server::DraPluginServer<Self> {
        v1beta1::dra_plugin_server::DraPluginServer::new(self)
    }
}

fn v1beta1_device(d: PreparedDevice) -> v1beta1::Device {
    v1beta1::Device {
        request_names: d.request_names,
        pool_name: d.pool_name,
        device_name: d.device_name,
        cdi_device_ids: d.cdi_device_ids,
    }
}

#[tonic::async_trait]
impl v1beta1::dra_plugin_server::DraPlugin for DraV1beta1 {
    async fn node_prepare_resources(
        &self,
        request: Request<v1beta1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodePrepareResourcesResponse>, Status> {
        let claims = request
            .into_inner()
            .claims
            .into_iter()
            .map(|c| claim_ref(c.namespace, c.name, c.uid))
            .collect();
        let results = self.preparer.prepare(claims).await;
        log_results("prepared", &results);
        let claims = results
            .into_iter()
            .map(|(claim, result)| {
                let answer = match result {
                    Ok(devices) => v1beta1::NodePrepareResourceResponse {
                        devices: devices.into_iter().map(v1beta1_device).collect(),
                        error: String::new(),
                    },
                    Err(error) => v1beta1::NodePrepareResourceResponse {
                        devices: vec![],
                        error,
                    },
                };
                (claim.uid, answer)
            })
            .collect();
        Ok(Response::new(v1beta1::NodePrepareResourcesResponse {
            claims,
        }))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<v1beta1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodeUnprepareResourcesResponse>, Status> {
        let claims = request
            .into_inner()
            .claims
            .into_iter()
            .map(|c| claim_ref(c.namespace, c.name, c.uid))
            .collect();
        let results = self.preparer.unprepare(claims).await;
        log_results("unprepared", &results);
        let claims = results
            .into_iter()
            .map(|(claim, result)| {
                let error = result.err().unwrap_or_default();
                (claim.uid, v1beta1::NodeUnprepareResourceResponse { error })
            })
            .collect();
        Ok(Response::new(v1beta1::NodeUnprepareResourcesResponse {
            claims,
        }))
    }
}

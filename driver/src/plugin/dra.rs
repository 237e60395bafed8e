//! DRA v1 and v1beta1 services: translate the kubelet's messages to [`ClaimRef`] / [`PreparedDevice`]
//! and back. v1beta1 has no share id: its devices are answered without one.

use std::collections::HashMap;
use std::sync::Arc;

use gpupool_proto::{dra_v1 as v1, dra_v1beta1 as v1beta1};
use tonic::{Request, Response, Status};

use super::Preparer;
use crate::prepare::PrepareError;
use gpupool_api::claim::{ClaimRef, PreparedDevice};

fn log_results<T>(what: &str, results: &[(ClaimRef, Result<T, PrepareError>)]) {
    for (claim, result) in results {
        match result {
            Ok(_) => {
                tracing::info!(claim = %claim, uid = %claim.uid, "{what} claim")
            }
            Err(error) => {
                tracing::warn!(claim = %claim, uid = %claim.uid, %error, transient = error.is_transient(), "{what} claim failed")
            }
        }
    }
}

/// One DRA service per proto version: the generated types differ, the translation does not.
macro_rules! dra_service {
    ($(#[$doc:meta])* $name:ident, $proto:ident, $device:ident) => {
        $(#[$doc])*
        #[derive(Clone)]
        pub struct $name {
            preparer: Arc<dyn Preparer>,
        }

        impl $name {
            pub fn new(preparer: Arc<dyn Preparer>) -> Self {
                Self { preparer }
            }

            pub fn into_server(self) -> $proto::dra_plugin_server::DraPluginServer<Self> {
                $proto::dra_plugin_server::DraPluginServer::new(self)
            }

            fn claim_refs(claims: Vec<$proto::Claim>) -> Vec<ClaimRef> {
                claims
                    .into_iter()
                    .map(|c| ClaimRef {
                        namespace: c.namespace,
                        name: c.name,
                        uid: c.uid,
                    })
                    .collect()
            }
        }

        #[tonic::async_trait]
        impl $proto::dra_plugin_server::DraPlugin for $name {
            async fn node_prepare_resources(
                &self,
                request: Request<$proto::NodePrepareResourcesRequest>,
            ) -> Result<Response<$proto::NodePrepareResourcesResponse>, Status> {
                let claims = Self::claim_refs(request.into_inner().claims);
                let results = self.preparer.prepare(claims).await;
                log_results("prepared", &results);
                let claims: HashMap<_, _> = results
                    .into_iter()
                    .map(|(claim, result)| {
                        let answer = match result {
                            Ok(devices) => $proto::NodePrepareResourceResponse {
                                devices: devices.into_iter().map($device).collect(),
                                error: String::new(),
                            },
                            // The one place a failure becomes the text the kubelet shows.
                            Err(error) => $proto::NodePrepareResourceResponse {
                                devices: vec![],
                                error: error.to_string(),
                            },
                        };
                        (claim.uid, answer)
                    })
                    .collect();
                Ok(Response::new($proto::NodePrepareResourcesResponse { claims }))
            }

            async fn node_unprepare_resources(
                &self,
                request: Request<$proto::NodeUnprepareResourcesRequest>,
            ) -> Result<Response<$proto::NodeUnprepareResourcesResponse>, Status> {
                let claims = Self::claim_refs(request.into_inner().claims);
                let results = self.preparer.unprepare(claims).await;
                log_results("unprepared", &results);
                let claims = results
                    .into_iter()
                    .map(|(claim, result)| {
                        let error = result.err().map(|e| e.to_string()).unwrap_or_default();
                        (claim.uid, $proto::NodeUnprepareResourceResponse { error })
                    })
                    .collect();
                Ok(Response::new($proto::NodeUnprepareResourcesResponse { claims }))
            }
        }
    };
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

/// v1beta1 has no share id: the device is answered without one.
fn v1beta1_device(d: PreparedDevice) -> v1beta1::Device {
    v1beta1::Device {
        request_names: d.request_names,
        pool_name: d.pool_name,
        device_name: d.device_name,
        cdi_device_ids: d.cdi_device_ids,
    }
}

dra_service!(
    /// Serves `k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`.
    DraV1,
    v1,
    v1_device
);
dra_service!(
    /// Serves `k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin` for kubelets that know only v1beta1.
    DraV1beta1,
    v1beta1,
    v1beta1_device
);

//! The prepare path's only window on the API server: fetch a claim (from the watch cache or with a
//! quorum read), write its device status, post an Event. A trait so that unit tests run against an in-memory fake and the binary against kube.

use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::Event;
use k8s_openapi::api::resource::v1::{AllocatedDeviceStatus, ResourceClaim};
use kube::api::{Api, GetParams, Patch, PatchParams, PostParams};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ApiError {
    #[error("not found")]
    NotFound,
    /// The object changed since the version a write was based on.
    #[error("conflict: the object changed")]
    Conflict,
    #[error("timed out")]
    TimedOut,
    #[error(transparent)]
    Kube(kube::Error),
    #[error("{0}")]
    Other(String),
}

/// Where a read is served from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimRead {
    /// The API server's watch cache (`resourceVersion=0`): about half the cost of a quorum read,
    /// and possibly behind. See `claim::cached_copy_problem` for when such a copy is used.
    Cached,
    /// The watch cache once it holds this resourceVersion (a GET with `resourceVersion=<v>`): as
    /// cheap as [`ClaimRead::Cached`], never older than a copy seen before.
    NotOlderThan(String),
    /// The current object, read through etcd. It waits for the writes etcd is committing.
    Quorum,
}

pub trait ClaimApi: Send + Sync {
    fn get_claim<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        read: ClaimRead,
    ) -> BoxFuture<'a, Result<ResourceClaim, ApiError>>;

    /// Replace `status.devices` of the claim (the caller keeps other drivers' entries in the list),
    /// only if the claim is still at `based_on` when given ([`ApiError::Conflict`] if not).
    /// Returns the claim's new resourceVersion.
    fn write_device_status<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        devices: Vec<AllocatedDeviceStatus>,
        based_on: Option<String>,
    ) -> BoxFuture<'a, Result<String, ApiError>>;

    fn post_event(&self, event: Event) -> BoxFuture<'_, Result<(), ApiError>>;
}

/// [`ClaimApi`] over a kube client.
pub struct KubeClaimApi {
    client: kube::Client,
}

impl KubeClaimApi {
    pub fn new(client: kube::Client) -> Self {
        Self { client }
    }
}

fn api_error(e: kube::Error) -> ApiError {
    match e {
        kube::Error::Api(status) if status.is_not_found() => ApiError::NotFound,
        kube::Error::Api(status) if status.code == 409 => ApiError::Conflict,
        other => ApiError::Kube(other),
    }
}

impl ClaimApi for KubeClaimApi {
    fn get_claim<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        read: ClaimRead,
    ) -> BoxFuture<'a, Result<ResourceClaim, ApiError>> {
        Box::pin(async move {
            let params = match &read {
                ClaimRead::Cached => GetParams::any(),
                ClaimRead::NotOlderThan(version) => GetParams::at(version),
                ClaimRead::Quorum => GetParams::default(),
            };
            Api::<ResourceClaim>::namespaced(self.client.clone(), namespace)
                .get_with(name, &params)
                .await
                .map_err(api_error)
        })
    }

    fn write_device_status<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        devices: Vec<AllocatedDeviceStatus>,
        based_on: Option<String>,
    ) -> BoxFuture<'a, Result<String, ApiError>> {
        Box::pin(async move {
            // A merge patch replaces the whole list: the caller passes every driver's entries. A
            // resourceVersion in a patch is a precondition: the API server answers 409 when the
            // claim changed since.
            let mut patch = serde_json::json!({ "status": { "devices": devices } });
            if let Some(version) = based_on {
                patch["metadata"] = serde_json::json!({ "resourceVersion": version });
            }
            Api::<ResourceClaim>::namespaced(self.client.clone(), namespace)
                .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map(|claim| claim.metadata.resource_version.unwrap_or_default())
                .map_err(api_error)
        })
    }

    fn post_event(&self, event: Event) -> BoxFuture<'_, Result<(), ApiError>> {
        Box::pin(async move {
            let namespace = event
                .metadata
                .namespace
                .clone()
                .unwrap_or_else(|| "default".to_string());
            Api::<Event>::namespaced(self.client.clone(), &namespace)
                .create(&PostParams::default(), &event)
                .await
                .map(|_| ())
                .map_err(api_error)
        })
    }
}

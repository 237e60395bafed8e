//! Claims prepared without an API server: the claims are given, status writes are kept, Events are
//! logged. For `gpupool-mps-check`, which runs the driver's own prepare and unprepare (limits,
//! CDI spec, MPS daemon, checkpoint) on a GPU machine with no cluster.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use gpupool_api::inventory::Inventory;
use k8s_openapi::api::core::v1::Event;
use k8s_openapi::api::resource::v1::{AllocatedDeviceStatus, ResourceClaim};

use super::api::{ApiError, ClaimApi, ClaimRead};
use super::{ClaimPreparer, PrepareOptions};
use crate::node_state::{current_boot_id, NodeStateError};

type Key = (String, String);

/// The claims an offline preparer reads, and the `status.devices` it wrote for them.
#[derive(Default)]
pub struct StaticClaims {
    claims: Mutex<BTreeMap<Key, ResourceClaim>>,
    statuses: Mutex<BTreeMap<Key, Vec<AllocatedDeviceStatus>>>,
}

impl StaticClaims {
    /// `status.devices` as the preparer last wrote it for the claim.
    pub fn device_status(&self, namespace: &str, name: &str) -> Vec<AllocatedDeviceStatus> {
        let key = (namespace.to_string(), name.to_string());
        self.statuses
            .lock()
            .expect("never poisoned")
            .get(&key)
            .cloned()
            .unwrap_or_default()
    }
}

fn key_of(claim: &ResourceClaim) -> Key {
    (
        claim.metadata.namespace.clone().unwrap_or_default(),
        claim.metadata.name.clone().unwrap_or_default(),
    )
}

impl ClaimApi for StaticClaims {
    fn get_claim<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        _read: ClaimRead,
    ) -> BoxFuture<'a, Result<ResourceClaim, ApiError>> {
        let key = (namespace.to_string(), name.to_string());
        let claim = self
            .claims
            .lock()
            .expect("never poisoned")
            .get(&key)
            .cloned();
        Box::pin(async move { claim.ok_or(ApiError::NotFound) })
    }

    fn write_device_status<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        devices: Vec<AllocatedDeviceStatus>,
        _based_on: Option<String>,
    ) -> BoxFuture<'a, Result<String, ApiError>> {
        let key = (namespace.to_string(), name.to_string());
        self.statuses
            .lock()
            .expect("never poisoned")
            .insert(key, devices);
        Box::pin(async { Ok("1".to_string()) })
    }

    fn post_event(&self, event: Event) -> BoxFuture<'_, Result<(), ApiError>> {
        tracing::warn!(reason = ?event.reason, message = ?event.message, "event");
        Box::pin(async { Ok(()) })
    }
}

impl ClaimPreparer {
    /// A preparer over `claims` instead of an API server, after the same start-up reconciliation
    /// as the driver's (which adopts or stops the MPS daemons an earlier run left).
    pub async fn offline(
        opts: PrepareOptions,
        inventory: Arc<Inventory>,
        claims: Vec<ResourceClaim>,
    ) -> Result<(Self, Arc<StaticClaims>), NodeStateError> {
        let api = Arc::new(StaticClaims::default());
        api.claims
            .lock()
            .expect("never poisoned")
            .extend(claims.into_iter().map(|c| (key_of(&c), c)));
        let (_, weights) = tokio::sync::watch::channel(BTreeMap::new());
        let preparer =
            Self::with_api(opts, inventory, api.clone(), weights, current_boot_id()).await?;
        Ok((preparer, api))
    }
}

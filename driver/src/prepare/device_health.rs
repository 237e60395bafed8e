//! The device health of the claims prepared on each device, told through their status.

use std::collections::BTreeMap;
use std::sync::Arc;

use gpupool_api::claim::ClaimRef;

use super::api::ApiError;
use super::status_writes::write_device_health;
use super::{ClaimPreparer, API_WRITE_TIMEOUT};
use crate::node_state::checkpoint::ClaimState;

impl ClaimPreparer {
    /// Tells the claims prepared on each device of `unhealthy` (device -> what is wrong) through
    /// the Ready condition of their `status.devices` entries, and the claims on devices that left
    /// it that they recovered. Only claims on devices whose health changed since the last call are
    /// written: one quorum read and one write each, off the kubelet's path.
    pub fn report_device_health(&self, unhealthy: BTreeMap<String, String>) {
        let previous = std::mem::replace(
            &mut *self.unhealthy.lock().expect("never poisoned"),
            unhealthy.clone(),
        );
        let changed: std::collections::BTreeSet<&String> = previous
            .keys()
            .chain(unhealthy.keys())
            .filter(|d| previous.get(*d) != unhealthy.get(*d))
            .collect();
        if changed.is_empty() {
            return;
        }
        let claims: Vec<ClaimRef> = self.state.read(|data| {
            data.claims
                .iter()
                .filter(|(_, e)| e.state == ClaimState::PrepareCompleted)
                .filter(|(_, e)| e.devices.iter().any(|d| changed.contains(&d.device_name)))
                .map(|(uid, e)| ClaimRef {
                    namespace: e.namespace.clone(),
                    name: e.name.clone(),
                    uid: uid.clone(),
                })
                .collect()
        });
        let unhealthy = Arc::new(unhealthy);
        for claim in claims {
            let (api, pool, unhealthy) = (
                self.api.clone(),
                self.opts.node_name.clone(),
                unhealthy.clone(),
            );
            let uid = claim.uid.clone();
            self.status_writes.push(&uid, async move {
                let name = claim.to_string();
                let work = write_device_health(api.as_ref(), &pool, &claim, &unhealthy);
                match tokio::time::timeout(API_WRITE_TIMEOUT, work).await {
                    Ok(Ok(())) | Ok(Err(ApiError::NotFound)) => {}
                    Ok(Err(e)) => {
                        tracing::warn!(claim = %name, error = %e, "could not write the device health into the claim's status")
                    }
                    Err(_) => {
                        tracing::warn!(claim = %name, "writing the device health into the claim's status timed out")
                    }
                }
            });
        }
    }
}

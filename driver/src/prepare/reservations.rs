//! The node guard's reservations: a claim's devices held against every other claim's, prepared or
//! being prepared, until the claim is recorded prepared or has failed.

use std::collections::BTreeMap;
use std::sync::Mutex;

use gpupool_api::claim::ClaimRef;
use gpupool_api::config::EffectiveConfig;

use super::claim::AllocatedDevice;
use super::guard::{self, Held, Use};
use super::{ClaimPreparer, PrepareErrorKind};
use crate::devices::{self, NodeDevice};

impl ClaimPreparer {
    /// The node guard: the claim's devices against every other claim's prepared or being
    /// prepared; on success the claim's devices count as held until the reservation is dropped.
    pub(super) fn reserve(
        &self,
        claim: &ClaimRef,
        per_device: &[(AllocatedDevice, NodeDevice<'_>, EffectiveConfig)],
    ) -> Result<Reservation<'_>, PrepareErrorKind> {
        let wanted: Vec<(String, Use)> = per_device
            .iter()
            .map(|(_, device, config)| {
                let mps = config.config.compute == Some(gpupool_api::config::Compute::Mps);
                (device.name.clone(), use_of(device, mps))
            })
            .collect();
        let mut in_flight = self.in_flight.lock().expect("never poisoned");
        let mut held: Vec<Held> = self.state.read(|data| {
            data.claims
                .iter()
                .filter(|(uid, _)| **uid != claim.uid)
                .flat_map(|(_, entry)| {
                    let name = format!("{}/{}", entry.namespace, entry.name);
                    entry
                        .devices
                        .iter()
                        .map(|d| d.device_name.clone())
                        .chain(entry.mig.iter().map(|r| r.device.clone()))
                        .filter_map(|device| {
                            let found = devices::find(&self.inventory, &device)?;
                            let mps = entry.mps.iter().any(|h| h.device == device);
                            Some(Held {
                                claim: name.clone(),
                                what: use_of(&found, mps),
                                device,
                            })
                        })
                        .collect::<Vec<_>>()
                })
                .collect()
        });
        for (uid, (name, devices)) in in_flight.iter() {
            if *uid != claim.uid {
                held.extend(devices.iter().map(|(device, what)| Held {
                    claim: name.clone(),
                    device: device.clone(),
                    what: what.clone(),
                }));
            }
        }
        let name = format!("{}/{}", claim.namespace, claim.name);
        guard::check(&name, &wanted, &held).map_err(|e| PrepareErrorKind::Conflict(Box::new(e)))?;
        in_flight.insert(claim.uid.clone(), (name, wanted));
        Ok(Reservation {
            in_flight: &self.in_flight,
            uid: claim.uid.clone(),
        })
    }
}

/// Devices of claims being prepared now, by claim UID: the claim's name and what it takes.
pub(super) type InFlight = Mutex<BTreeMap<String, (String, Vec<(String, Use)>)>>;

/// A claim's devices held in [`InFlight`] until dropped.
pub(super) struct Reservation<'a> {
    in_flight: &'a InFlight,
    uid: String,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        self.in_flight
            .lock()
            .expect("never poisoned")
            .remove(&self.uid);
    }
}

/// What a device takes of its card, for the node guard; `mps`: a share through the card's MPS
/// daemon.
fn use_of(device: &NodeDevice<'_>, mps: bool) -> Use {
    match device.memory_slices() {
        Some(slices) => Use::Mig {
            gpu: device.gpu.index,
            slices,
        },
        None => Use::Card {
            gpu: device.gpu.index,
            mps,
        },
    }
}

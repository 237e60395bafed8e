//! Detection on real GPUs: an NVML event set for critical XIDs and double-bit ECC errors, and a
//! probe every [`PROBE_INTERVAL`] that notices a card NVML has lost or cannot read. Both run on one
//! plain thread (NVML's wait blocks) and only turn what NVML says into [`Observation`]s; every
//! decision is made in [`super::monitor`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpupool_api::inventory::Inventory;
use gpupool_api::names::device_name;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{EventSet, Nvml};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::monitor::Report;
use super::{Observation, XID_DOUBLE_BIT_ECC};

pub const PROBE_INTERVAL: Duration = Duration::from_secs(10);
/// How long one wait on the event set may block, so that a stop is noticed within it.
const WAIT_MS: u32 = 1000;
const WANTED: EventTypes = EventTypes::CRITICAL_XID_ERROR.union(EventTypes::DOUBLE_BIT_ECC_ERROR);

/// Starts the watcher thread for the GPUs of `inventory`; it ends at `stop`.
pub fn spawn(
    inventory: Arc<Inventory>,
    reports: mpsc::Sender<Report>,
    stop: CancellationToken,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("nvml-health".into())
        .spawn(move || watch(&inventory, &reports, &stop))
}

fn report(reports: &mpsc::Sender<Report>, observation: Observation) {
    let _ = reports.blocking_send(Report {
        observation,
        reply: None,
    });
}

/// The device of a UUID NVML names, as this driver publishes it.
fn device_of(inventory: &Inventory, uuid: &str) -> Option<String> {
    inventory
        .gpus
        .iter()
        .find(|g| g.uuid == uuid)
        .map(|g| device_name(g.index))
}

fn watch(inventory: &Inventory, reports: &mpsc::Sender<Report>, stop: &CancellationToken) {
    while !stop.is_cancelled() {
        let nvml = match Nvml::init() {
            Ok(nvml) => nvml,
            Err(e) => {
                // A driver reload unloads the library under us: every card is Unknown until it
                // loads again, then the probe reads each one afresh.
                for gpu in &inventory.gpus {
                    report(
                        reports,
                        Observation::Unreadable {
                            device: device_name(gpu.index),
                            reason: format!("NVML: {e}"),
                        },
                    );
                }
                sleep_unless_stopped(stop, PROBE_INTERVAL);
                continue;
            }
        };
        let set = register(&nvml, inventory);
        let mut next_probe = Instant::now();
        while !stop.is_cancelled() {
            match &set {
                Some(set) => match set.wait(WAIT_MS) {
                    Ok(event) => on_event(inventory, reports, &event),
                    Err(NvmlError::Timeout) => {}
                    // Which card is lost is the probe's to find out, now.
                    Err(NvmlError::GpuLost) => next_probe = Instant::now(),
                    Err(e) => {
                        tracing::warn!(error = %e, "waiting for NVML events failed");
                        sleep_unless_stopped(stop, Duration::from_millis(u64::from(WAIT_MS)));
                    }
                },
                None => sleep_unless_stopped(stop, Duration::from_millis(u64::from(WAIT_MS))),
            }
            if Instant::now() >= next_probe {
                probe(&nvml, inventory, reports);
                next_probe = Instant::now() + PROBE_INTERVAL;
            }
        }
    }
}

fn sleep_unless_stopped(stop: &CancellationToken, total: Duration) {
    let until = Instant::now() + total;
    while !stop.is_cancelled() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// One event set for every card, with the event types each card supports; none when no card
/// supports any (the probe still runs).
fn register<'n>(nvml: &'n Nvml, inventory: &Inventory) -> Option<EventSet<'n>> {
    let mut set = match nvml.create_event_set() {
        Ok(set) => set,
        Err(e) => {
            tracing::warn!(error = %e, "NVML event set unavailable: XIDs are not watched, only the probe runs");
            return None;
        }
    };
    let mut registered = 0;
    for gpu in &inventory.gpus {
        let device = match nvml.device_by_uuid(gpu.uuid.as_str()) {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(uuid = %gpu.uuid, error = %e, "cannot watch this GPU's XIDs");
                continue;
            }
        };
        let types = device
            .supported_event_types()
            .map(|s| s & WANTED)
            .unwrap_or(EventTypes::empty());
        if types.is_empty() {
            tracing::warn!(uuid = %gpu.uuid, "GPU reports no XID or ECC events: only the probe watches it");
            continue;
        }
        // A failed registration releases the set (NVML leaves it undefined): start a new one.
        set = match device.register_events(types, set) {
            Ok(set) => {
                registered += 1;
                set
            }
            Err(e) => {
                tracing::warn!(uuid = %gpu.uuid, error = %e.error, "registering NVML events failed");
                match nvml.create_event_set() {
                    Ok(set) => set,
                    Err(_) => return None,
                }
            }
        };
    }
    tracing::info!(
        gpus = registered,
        "watching NVML XID and double-bit ECC events"
    );
    (registered > 0).then_some(set)
}

fn on_event(
    inventory: &Inventory,
    reports: &mpsc::Sender<Report>,
    event: &nvml_wrapper::struct_wrappers::event::EventData<'_>,
) {
    let Some(device) = event
        .device
        .uuid()
        .ok()
        .and_then(|u| device_of(inventory, &u))
    else {
        tracing::warn!(event = ?event.event_type, "NVML event on a GPU this driver does not publish");
        return;
    };
    if event.event_type.contains(EventTypes::CRITICAL_XID_ERROR) {
        match event.event_data {
            Some(XidError::Value(xid)) => report(
                reports,
                Observation::Xid {
                    device: device.clone(),
                    xid: u32::try_from(xid).unwrap_or(u32::MAX),
                },
            ),
            _ => tracing::warn!(device, "NVML reported an XID without its number"),
        }
    }
    if event.event_type.contains(EventTypes::DOUBLE_BIT_ECC_ERROR) {
        report(
            reports,
            Observation::Xid {
                device,
                xid: XID_DOUBLE_BIT_ECC,
            },
        );
    }
}

/// Reads each card once: lost, unreadable, or fine.
fn probe(nvml: &Nvml, inventory: &Inventory, reports: &mpsc::Sender<Report>) {
    for gpu in &inventory.gpus {
        let device = device_name(gpu.index);
        // Memory info is readable on every model; a card that does not report it is still there.
        let read = match nvml
            .device_by_uuid(gpu.uuid.as_str())
            .and_then(|d| d.memory_info())
        {
            Ok(_) | Err(NvmlError::NotSupported) => Ok(()),
            Err(e) => Err(e),
        };
        report(reports, observation_of(device, read));
    }
}

/// What one read of a card says.
fn observation_of(device: String, read: Result<(), NvmlError>) -> Observation {
    match read {
        Ok(()) => Observation::Readable { device },
        Err(NvmlError::GpuLost) => Observation::Lost {
            device,
            detail: "NVML: the GPU has fallen off the bus or is otherwise inaccessible".into(),
        },
        Err(e) => Observation::Unreadable {
            device,
            reason: format!("NVML: {e}"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_gpu_is_lost_and_other_failures_are_unknown() {
        assert!(matches!(
            observation_of("gpu-0".into(), Err(NvmlError::GpuLost)),
            Observation::Lost { .. }
        ));
        assert!(matches!(
            observation_of("gpu-0".into(), Err(NvmlError::Unknown)),
            Observation::Unreadable { .. }
        ));
        assert_eq!(
            observation_of("gpu-0".into(), Ok(())),
            Observation::Readable {
                device: "gpu-0".into()
            }
        );
    }
}

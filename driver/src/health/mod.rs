//! GPU health: what the detectors saw ([`Observation`]), what it means for each device
//! ([`DeviceHealth`]), and the device taints that keep the scheduler away from a broken card (pure).
//!
//! A fatal XID or a lost GPU taints the device `NoSchedule` until the card is seen healthy again:
//! an operator's `clear` after a reset, or (for a lost GPU only) the probe reading it again. An
//! XID leaves no trace NVML could read back later, so nothing clears it on its own. Application
//! XIDs (the program's fault, not the card's) are counted and logged, never tainted.
//!
//! [`monitor`] applies observations to the shared [`HealthMap`]; [`inject`] lets an operator (and
//! the e2e tests) feed observations for fake GPUs; [`nvml`] feeds them for real ones.

pub mod inject;
pub mod monitor;
pub mod nvml;

use std::collections::{BTreeMap, BTreeSet};

use gpupool_api::validation::MAX_TAINTS_PER_DEVICE;
use k8s_openapi::api::resource::v1::DeviceTaint;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;

/// Taint key of a device that raised a fatal XID; the value is the XID.
pub const TAINT_XID: &str = "gpupool.dev/xid";
/// Taint key of a device NVML reports as lost (fell off the bus).
pub const TAINT_GPU_LOST: &str = "gpupool.dev/gpu-lost";
pub const NO_SCHEDULE: &str = "NoSchedule";

/// XIDs that mean the card itself is broken until reset: 48 double-bit ECC, 63/64 row remapping,
/// 74 NVLink, 79 fell off the bus, 92 high single-bit ECC rate, 94/95 contained/uncontained ECC,
/// 119/120 GSP.
pub const DEFAULT_XID_FATAL: [u32; 10] = [48, 63, 64, 74, 79, 92, 94, 95, 119, 120];
/// XIDs a faulty program causes (13 graphics engine exception, 31 MMU fault, 43 channel stopped,
/// 45 preemptive cleanup, 68 video decoder): the next program runs fine on the same card.
pub const DEFAULT_XID_IGNORE: [u32; 5] = [13, 31, 43, 45, 68];
/// NVML reports a double-bit ECC error as its own event; the kernel logs it as XID 48.
pub const XID_DOUBLE_BIT_ECC: u32 = 48;
/// Upstream limit of `DeviceHealth.message`.
const MAX_MESSAGE_CHARS: usize = 1024;

/// Which XIDs taint a device and which are only counted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XidPolicy {
    fatal: BTreeSet<u32>,
    ignore: BTreeSet<u32>,
}

/// What an XID means under a [`XidPolicy`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XidClass {
    /// The card is broken: taint it.
    Fatal,
    /// The program's fault: count and log at info.
    Application,
    /// In neither list: count and log a warning, so that an operator can decide which list it
    /// belongs to; tainting every unknown XID would take cards out for harmless ones.
    Unlisted,
}

impl Default for XidPolicy {
    fn default() -> Self {
        Self::new(DEFAULT_XID_FATAL, DEFAULT_XID_IGNORE).expect("the default lists are disjoint")
    }
}

impl XidPolicy {
    /// Refuses an XID in both lists: which of the two the operator meant cannot be guessed.
    pub fn new(
        fatal: impl IntoIterator<Item = u32>,
        ignore: impl IntoIterator<Item = u32>,
    ) -> Result<Self, String> {
        let fatal: BTreeSet<u32> = fatal.into_iter().collect();
        let ignore: BTreeSet<u32> = ignore.into_iter().collect();
        let both: Vec<String> = fatal.intersection(&ignore).map(u32::to_string).collect();
        if !both.is_empty() {
            return Err(format!(
                "XID {} is in both --xid-fatal and --xid-ignore",
                both.join(", ")
            ));
        }
        Ok(Self { fatal, ignore })
    }

    pub fn classify(&self, xid: u32) -> XidClass {
        if self.fatal.contains(&xid) {
            XidClass::Fatal
        } else if self.ignore.contains(&xid) {
            XidClass::Application
        } else {
            XidClass::Unlisted
        }
    }
}

/// What is wrong with a card; one taint each. `Lost` sorts first so that it is the one kept
/// when a device is at the taint limit.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "camelCase")]
pub enum Fault {
    Lost,
    Xid(u32),
}

impl Fault {
    pub fn taint_key(&self) -> &'static str {
        match self {
            Fault::Lost => TAINT_GPU_LOST,
            Fault::Xid(_) => TAINT_XID,
        }
    }

    pub fn taint_value(&self) -> Option<String> {
        match self {
            Fault::Lost => None,
            Fault::Xid(xid) => Some(xid.to_string()),
        }
    }
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fault::Lost => f.write_str("GPU lost"),
            Fault::Xid(xid) => write!(f, "XID {xid}"),
        }
    }
}

/// One fault of a device: what, in words, and since when (unix seconds: taints carry whole
/// seconds, and a finer time would differ from what the API stores and republish every pass).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FaultRecord {
    pub fault: Fault,
    pub message: String,
    pub since: i64,
}

/// Everything known about one device.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DeviceRecord {
    /// Sorted by fault, at most [`MAX_TAINTS_PER_DEVICE`].
    pub faults: Vec<FaultRecord>,
    /// Why NVML could not read the card, while it cannot.
    #[serde(skip)]
    pub unreadable: Option<String>,
    /// Non-fatal XIDs seen, by XID.
    #[serde(skip)]
    pub counted_xids: BTreeMap<u32, u64>,
}

/// A device's health as the kubelet's health stream reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceHealth {
    Healthy,
    /// Tainted: `fault` is the first (a lost GPU before any XID), `message` names them all.
    Unhealthy {
        fault: Fault,
        message: String,
        since: i64,
    },
    Unknown {
        reason: String,
    },
}

impl DeviceRecord {
    pub fn health(&self) -> DeviceHealth {
        if let Some(first) = self.faults.first() {
            let message: Vec<&str> = self.faults.iter().map(|f| f.message.as_str()).collect();
            return DeviceHealth::Unhealthy {
                fault: first.fault,
                message: truncate(&message.join("; "), MAX_MESSAGE_CHARS),
                since: first.since,
            };
        }
        match &self.unreadable {
            Some(reason) => DeviceHealth::Unknown {
                reason: truncate(reason, MAX_MESSAGE_CHARS),
            },
            None => DeviceHealth::Healthy,
        }
    }

    /// The device's taints, one per fault, `NoSchedule`, added at the fault's time.
    pub fn taints(&self) -> Vec<DeviceTaint> {
        self.faults
            .iter()
            .take(MAX_TAINTS_PER_DEVICE)
            .map(|f| DeviceTaint {
                key: f.fault.taint_key().to_string(),
                value: f.fault.taint_value(),
                effect: NO_SCHEDULE.to_string(),
                time_added: Timestamp::from_second(f.since).ok().map(Time),
            })
            .collect()
    }

    /// Adds `record` unless its fault is there already; at the limit, a fault that sorts before
    /// the last one replaces it. True when the faults changed.
    fn add_fault(&mut self, record: FaultRecord) -> bool {
        if self.faults.iter().any(|f| f.fault == record.fault) {
            return false;
        }
        if self.faults.len() >= MAX_TAINTS_PER_DEVICE {
            if self
                .faults
                .last()
                .is_some_and(|last| record.fault < last.fault)
            {
                self.faults.pop();
            } else {
                return false;
            }
        }
        let at = self.faults.partition_point(|f| f.fault < record.fault);
        self.faults.insert(at, record);
        true
    }
}

fn truncate(text: &str, max_chars: usize) -> String {
    text.chars().take(max_chars).collect()
}

/// What a detector (NVML, the probe, `inject-xid`) saw on one device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observation {
    Xid {
        device: String,
        xid: u32,
    },
    /// NVML says the GPU is lost (`NVML_ERROR_GPU_IS_LOST`).
    Lost {
        device: String,
        detail: String,
    },
    /// NVML could not read the card for another reason.
    Unreadable {
        device: String,
        reason: String,
    },
    /// The probe read the card: a lost or unreadable card is back. XIDs stay.
    Readable {
        device: String,
    },
    /// The operator reset the card: every fault goes.
    Clear {
        device: String,
    },
}

impl Observation {
    pub fn device(&self) -> &str {
        match self {
            Observation::Xid { device, .. }
            | Observation::Lost { device, .. }
            | Observation::Unreadable { device, .. }
            | Observation::Readable { device }
            | Observation::Clear { device } => device,
        }
    }
}

/// What applying an observation changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transition {
    /// A new fault: the device is (more) tainted.
    Tainted {
        device: String,
        fault: Fault,
        message: String,
    },
    /// Faults or unreadability went away.
    Recovered { device: String, cleared: Vec<Fault> },
    /// NVML cannot read the card (no taint: it may be a passing driver hiccup).
    Unknown { device: String, reason: String },
    /// A non-fatal XID, counted.
    Counted {
        device: String,
        xid: u32,
        class: XidClass,
        count: u64,
    },
    /// Nothing new (a fault already recorded, a healthy card read again).
    Unchanged { device: String },
}

/// The reason of the Node Event for a transition, as `kubectl get events` shows it.
pub const REASON_XID: &str = "GpuXidError";
pub const REASON_LOST: &str = "GpuLost";
pub const REASON_RECOVERED: &str = "GpuRecovered";
pub const REASON_UNKNOWN: &str = "GpuUnreadable";

/// A Node Event worth posting: reason, message, and whether it is a Warning.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeEventText {
    pub reason: &'static str,
    pub message: String,
    pub warning: bool,
}

impl Transition {
    /// The event an operator should see; none for counted XIDs (they are logged) and no-ops.
    pub fn node_event(&self) -> Option<NodeEventText> {
        match self {
            Transition::Tainted {
                device,
                fault,
                message,
            } => {
                Some(NodeEventText {
                    reason: match fault {
                        Fault::Lost => REASON_LOST,
                        Fault::Xid(_) => REASON_XID,
                    },
                    message: format!(
                    "{device}: {message}; tainted {}{} NoSchedule: no new claims land on it until \
                     it is reset and cleared",
                    fault.taint_key(),
                    fault.taint_value().map(|v| format!("={v}")).unwrap_or_default()
                ),
                    warning: true,
                })
            }
            Transition::Recovered { device, cleared } => Some(NodeEventText {
                reason: REASON_RECOVERED,
                message: if cleared.is_empty() {
                    format!("{device}: NVML reads the card again")
                } else {
                    let list: Vec<String> = cleared.iter().map(ToString::to_string).collect();
                    format!(
                        "{device}: healthy again, taints removed ({})",
                        list.join(", ")
                    )
                },
                warning: false,
            }),
            Transition::Unknown { device, reason } => Some(NodeEventText {
                reason: REASON_UNKNOWN,
                message: format!("{device}: NVML cannot read the card: {reason}"),
                warning: true,
            }),
            Transition::Counted { .. } | Transition::Unchanged { .. } => None,
        }
    }

    /// The answer `inject-xid` prints.
    pub fn describe(&self) -> String {
        match self {
            Transition::Tainted { device, fault, .. } => format!(
                "{device} tainted {}{} NoSchedule",
                fault.taint_key(),
                fault
                    .taint_value()
                    .map(|v| format!("={v}"))
                    .unwrap_or_default()
            ),
            Transition::Recovered { device, cleared } => {
                let list: Vec<String> = cleared.iter().map(ToString::to_string).collect();
                format!("{device} healthy, cleared: {}", list.join(", "))
            }
            Transition::Unknown { device, reason } => format!("{device} unknown: {reason}"),
            Transition::Counted {
                device,
                xid,
                class,
                count,
            } => format!(
                "{device} XID {xid} counted ({} so far), not tainted: {}",
                count,
                match class {
                    XidClass::Application => "an application XID (--xid-ignore)",
                    _ => "not in --xid-fatal",
                }
            ),
            Transition::Unchanged { device } => format!("{device} unchanged"),
        }
    }
}

/// An observation about a device this node does not have.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no device {device} on this node (devices: {known})")]
pub struct UnknownDevice {
    pub device: String,
    pub known: String,
}

/// Health of every device of the node, keyed by device name (`gpu-<index>`).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HealthMap {
    devices: BTreeMap<String, DeviceRecord>,
}

impl HealthMap {
    /// Every device healthy.
    pub fn new(devices: impl IntoIterator<Item = String>) -> Self {
        Self {
            devices: devices
                .into_iter()
                .map(|d| (d, DeviceRecord::default()))
                .collect(),
        }
    }

    /// `self` with the faults `saved` holds for devices that still exist: a driver restart must
    /// not lift a taint the card has done nothing to deserve losing.
    pub fn restored_from(mut self, saved: &HealthMap) -> Self {
        for (name, record) in &mut self.devices {
            if let Some(old) = saved.devices.get(name) {
                for fault in &old.faults {
                    record.add_fault(fault.clone());
                }
            }
        }
        self
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &DeviceRecord)> {
        self.devices.iter().map(|(k, v)| (k.as_str(), v))
    }

    pub fn get(&self, device: &str) -> Option<&DeviceRecord> {
        self.devices.get(device)
    }

    pub fn health(&self, device: &str) -> DeviceHealth {
        self.get(device)
            .map(DeviceRecord::health)
            .unwrap_or(DeviceHealth::Healthy)
    }

    /// The devices reported Unhealthy, with what is wrong with each.
    pub fn unhealthy(&self) -> BTreeMap<String, String> {
        self.iter()
            .filter_map(|(device, record)| match record.health() {
                DeviceHealth::Unhealthy { message, .. } => Some((device.to_string(), message)),
                _ => None,
            })
            .collect()
    }

    /// The taints of `device`; none for a device not in the map.
    pub fn taints(&self, device: &str) -> Vec<DeviceTaint> {
        self.get(device)
            .map(DeviceRecord::taints)
            .unwrap_or_default()
    }

    pub fn any_tainted(&self) -> bool {
        self.devices.values().any(|r| !r.faults.is_empty())
    }

    /// Applies one observation at `now` (unix seconds).
    pub fn apply(
        &mut self,
        observation: Observation,
        policy: &XidPolicy,
        now: i64,
    ) -> Result<Transition, UnknownDevice> {
        let known = self.devices.keys().cloned().collect::<Vec<_>>().join(", ");
        let Some(record) = self.devices.get_mut(observation.device()) else {
            return Err(UnknownDevice {
                device: observation.device().to_string(),
                known,
            });
        };
        let device = observation.device().to_string();
        Ok(match observation {
            Observation::Xid { xid, .. } => match policy.classify(xid) {
                XidClass::Fatal => {
                    let fault = Fault::Xid(xid);
                    let message = format!("XID {xid}{}", xid_hint(xid));
                    if record.add_fault(FaultRecord {
                        fault,
                        message: message.clone(),
                        since: now,
                    }) {
                        Transition::Tainted {
                            device,
                            fault,
                            message,
                        }
                    } else {
                        Transition::Unchanged { device }
                    }
                }
                class => {
                    let count = record.counted_xids.entry(xid).or_default();
                    *count += 1;
                    Transition::Counted {
                        device,
                        xid,
                        class,
                        count: *count,
                    }
                }
            },
            Observation::Lost { detail, .. } => {
                let message = format!("GPU lost: {detail}");
                if record.add_fault(FaultRecord {
                    fault: Fault::Lost,
                    message: message.clone(),
                    since: now,
                }) {
                    Transition::Tainted {
                        device,
                        fault: Fault::Lost,
                        message,
                    }
                } else {
                    Transition::Unchanged { device }
                }
            }
            Observation::Unreadable { reason, .. } => {
                if record.unreadable.as_deref() == Some(reason.as_str()) {
                    Transition::Unchanged { device }
                } else {
                    record.unreadable = Some(reason.clone());
                    Transition::Unknown { device, reason }
                }
            }
            Observation::Readable { .. } => {
                let was_unreadable = record.unreadable.take().is_some();
                let lost = record.faults.iter().any(|f| f.fault == Fault::Lost);
                record.faults.retain(|f| f.fault != Fault::Lost);
                if lost || was_unreadable {
                    Transition::Recovered {
                        device,
                        cleared: if lost { vec![Fault::Lost] } else { vec![] },
                    }
                } else {
                    Transition::Unchanged { device }
                }
            }
            Observation::Clear { .. } => {
                let cleared: Vec<Fault> = record.faults.drain(..).map(|f| f.fault).collect();
                let was_unreadable = record.unreadable.take().is_some();
                if cleared.is_empty() && !was_unreadable {
                    Transition::Unchanged { device }
                } else {
                    Transition::Recovered { device, cleared }
                }
            }
        })
    }
}

/// A few words on the XIDs operators meet most, so the event says what to look for.
fn xid_hint(xid: u32) -> &'static str {
    match xid {
        48 => " (double-bit ECC error)",
        63 | 64 => " (ECC page retirement or row remapping)",
        74 => " (NVLink error)",
        79 => " (GPU has fallen off the bus)",
        92 => " (high single-bit ECC error rate)",
        94 => " (contained ECC error)",
        95 => " (uncontained ECC error)",
        119 | 120 => " (GSP error)",
        _ => "",
    }
}

#[cfg(test)]
mod tests;

//! A claim as the kubelet names it in its DRA calls, and a device as the plugin answers it. The
//! driver and the kubelet emulator speak about the same things, so they share these types.

use k8s_openapi::api::resource::v1::{DeviceRequestAllocationResult, ResourceClaim};
use serde::{Deserialize, Serialize};

/// A claim as the kubelet names it (namespace, name, UID: nothing else reaches the plugin).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClaimRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

impl ClaimRef {
    /// The reference the kubelet would send for `claim`.
    pub fn of(claim: &ResourceClaim) -> Self {
        ClaimRef {
            namespace: claim.metadata.namespace.clone().unwrap_or_default(),
            name: claim.metadata.name.clone().unwrap_or_default(),
            uid: claim.metadata.uid.clone().unwrap_or_default(),
        }
    }
}

/// Every allocation result of a claim, whichever driver's (none before it is allocated).
pub fn allocation_results(claim: &ResourceClaim) -> &[DeviceRequestAllocationResult] {
    claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_deref())
        .unwrap_or_default()
}

impl std::fmt::Display for ClaimRef {
    /// `namespace/name`, as kubectl names a claim.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// One prepared device, as answered to the kubelet (v1beta1 carries no share id). The driver's
/// checkpoint stores it in this serde form, so renaming a field is a checkpoint format change.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PreparedDevice {
    pub request_names: Vec<String>,
    pub pool_name: String,
    pub device_name: String,
    pub cdi_device_ids: Vec<String>,
    pub share_id: Option<String>,
}

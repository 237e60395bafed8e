//! Claim preparation: the kubelet's NodePrepareResources / NodeUnprepareResources, independent of the
//! gRPC version that carried them (the `plugin::dra` adapters translate v1 and v1beta1 to these types).
//!
//! claim.rs (fetch + check) -> limits.rs (pure) -> cdi.rs (pure render + atomic write) -> checkpoint.rs.

/// A claim as the kubelet names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ClaimRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

/// One prepared device, as answered to the kubelet.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PreparedDevice {
    pub request_names: Vec<String>,
    pub pool_name: String,
    pub device_name: String,
    pub cdi_device_ids: Vec<String>,
    pub share_id: Option<String>,
}

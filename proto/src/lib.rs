//! The kubelet's wire contracts for a DRA driver, generated at build time from `proto/`.
//!
//! Each module holds the messages plus tonic client and server for one proto package.

/// Plugin registration (`pluginregistration`), served on `<registry-dir>/<driver>-reg.sock`.
pub mod registration {
    tonic::include_proto!("pluginregistration");
}

/// DRA plugin service, v1 (`k8s.io.kubelet.pkg.apis.dra.v1`).
pub mod dra_v1 {
    tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
}

/// DRA plugin service, v1beta1 (`k8s.io.kubelet.pkg.apis.dra.v1beta1`).
pub mod dra_v1beta1 {
    tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1beta1");
}

/// DRA resource health (`v1alpha1`), served on the DRA socket.
pub mod health_v1alpha1 {
    tonic::include_proto!("v1alpha1");
}

/// DRA resource health (`v1`), the same messages as `v1alpha1`; kubelets from 1.37 prefer it.
pub mod health_v1 {
    tonic::include_proto!("v1");
}

/// `PluginInfo.type` of a DRA driver.
pub const DRA_PLUGIN_TYPE: &str = "DRAPlugin";

/// The kubelet's short service names, as advertised in `PluginInfo.supported_versions`
/// (not the proto full names: a kubelet rejects those).
pub mod versions {
    pub const DRA_V1: &str = "v1.DRAPlugin";
    pub const DRA_V1BETA1: &str = "v1beta1.DRAPlugin";
    pub const HEALTH_V1ALPHA1: &str = "v1alpha1.DRAResourceHealth";
    pub const HEALTH_V1: &str = "v1.DRAResourceHealth";
}

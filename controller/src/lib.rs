//! gpupool's controller: GpuModel -> DeviceClass, ComputeProfile -> ResourceClaimTemplate, pool status.
//!
//! The decisions are pure functions (`models`, `profiles`, `status`, `plan`, the leader rules);
//! `reconcile` and `leader` do the talking to the API server. `webhook` is the admission webhook
//! (`gpupool-controller webhook`), a process of its own beside the controller.

pub mod cli;
pub mod crds;
pub mod duration;
pub mod leader;
pub mod metrics;
pub mod models;
pub mod owner;
pub mod plan;
pub mod profiles;
pub mod reconcile;
pub mod status;
#[cfg(test)]
pub(crate) mod testing;
pub mod webhook;

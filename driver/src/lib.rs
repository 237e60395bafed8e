//! gpupool's node agent. The path a GPU takes, one module per step:
//! NVML or fake profile -> [`inventory`] -> [`devices`] (cards, MIG partitions, counters; pure) ->
//! [`slices`] (pure) -> [`publisher`] (API) -> [`plugin`] (kubelet sockets) -> [`prepare`] (claim
//! -> limits -> CDI spec) -> [`node_state`] (the claim's files, MIG instances ([`mig`]) and
//! checkpoint entry, crash-safe);
//! [`metrics`] shows all of it to Prometheus; [`health`] turns XIDs and lost GPUs into device taints
//! and the kubelet's health stream.

pub mod cli;
pub mod config;
pub mod devices;
pub mod health;
pub mod install;
pub mod inventory;
pub mod metrics;
pub mod mig;
pub mod mps;
pub mod node_state;
mod nvml_ffi;
pub mod plugin;
pub mod prepare;
pub mod publisher;
pub mod slices;
pub mod weights;

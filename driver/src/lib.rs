//! gpupool's node agent. The path a GPU takes, one module per step:
//! NVML or fake profile -> [`inventory`] -> [`slices`] (pure) -> [`publisher`] (API) ->
//! [`plugin`] (kubelet sockets) -> [`prepare`] (claim -> limits -> CDI spec) -> [`node_state`]
//! (the claim's files and checkpoint entry, crash-safe);
//! [`metrics`] shows all of it to Prometheus; [`health`] turns XIDs and lost GPUs into device taints
//! and the kubelet's health stream.

pub mod cli;
pub mod config;
pub mod health;
pub mod install;
pub mod inventory;
pub mod metrics;
pub mod node_state;
pub mod plugin;
pub mod prepare;
pub mod publisher;
pub mod slices;
pub mod weights;

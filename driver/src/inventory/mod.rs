//! GPU discovery: one [`Inventory`] whatever found it, NVML on a GPU node or a fake profile anywhere.

pub mod fake;
pub mod nvml;
pub mod topology;

pub use gpupool_api::inventory::{Gpu, Inventory, InventorySource};

/// Why no inventory could be built.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error(transparent)]
    Fake(#[from] fake::FakeGpuError),
    #[error(transparent)]
    Nvml(#[from] nvml::NvmlDiscoveryError),
}

/// The node's GPUs: the fake profiles of `fake_gpus` when given (e.g. "a100-40gb:2,v100-32gb:1"),
/// else what NVML reports.
pub fn discover(fake_gpus: Option<&str>, node_name: &str) -> Result<Inventory, DiscoveryError> {
    match fake_gpus {
        Some(spec) => Ok(fake::fake_inventory(spec, node_name)?),
        None => Ok(nvml::discover()?),
    }
}

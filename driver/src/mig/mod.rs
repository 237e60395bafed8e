//! MIG instances: the seam between preparing a MIG device and the card. [`MigManager`] is what
//! [`crate::node_state`] calls, in the order it records in the checkpoint (docs/architecture.md,
//! "State on the node and the crash protocol"): GPU instance, then compute instance; destroyed
//! in reverse. [`nvml::NvmlMig`] does it on a real card; [`fake::FakeMig`] keeps its instances in a
//! file under the run folder, so that crash tests can see what a killed driver left behind.

pub mod fake;
pub mod nvml;

use std::fmt;

/// Where to create a GPU instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub parent_uuid: String,
    pub profile_id: u32,
    /// First memory slice and how many.
    pub start: u32,
    pub size: u32,
}

/// A compute instance as created.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ComputeInstance {
    pub id: u32,
    /// The MIG device's UUID (`MIG-...`), what CUDA_VISIBLE_DEVICES names.
    pub uuid: String,
    /// Host device nodes the container needs beside the card's own: the GPU and compute
    /// instances' capability nodes (`/dev/nvidia-caps/nvidia-cap<N>`); none on fake cards.
    pub device_nodes: Vec<String>,
}

/// A GPU instance that exists on a card.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInstance {
    pub id: u32,
    pub profile_id: u32,
    pub start: u32,
    pub size: u32,
    pub compute_instances: Vec<u32>,
}

/// Why a MIG call failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MigErrorKind {
    /// The placement overlaps an instance that exists (NVML's INSUFFICIENT_RESOURCES).
    Occupied,
    /// Processes still run on it (IN_USE): the kubelet's retry can succeed once they stop.
    InUse,
    /// Anything else: NVML's words.
    Failed(String),
}

/// A failed MIG call, naming the card and the step.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct MigError {
    /// e.g. "creating GPU instance 1g.10gb (profile 19) at memory slice 2 on GPU-...".
    pub step: String,
    pub kind: MigErrorKind,
}

impl fmt::Display for MigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            MigErrorKind::Occupied => write!(
                f,
                "{}: the placement overlaps a MIG instance that exists",
                self.step
            ),
            MigErrorKind::InUse => write!(f, "{}: processes still use it", self.step),
            MigErrorKind::Failed(why) => write!(f, "{}: {why}", self.step),
        }
    }
}

impl MigError {
    pub fn new(step: impl Into<String>, kind: MigErrorKind) -> Self {
        MigError {
            step: step.into(),
            kind,
        }
    }
}

/// Creates and destroys MIG instances on the node's cards. Blocking (NVML calls, file writes):
/// call it off the runtime's threads. Creating and destroying an instance that is already in
/// the wanted state is not an error for destroy (gone is gone), and always one for create.
pub trait MigManager: Send + Sync + fmt::Debug {
    /// Whether MIG mode is on now.
    fn mig_enabled(&self, parent_uuid: &str) -> Result<bool, MigError>;
    /// Switch MIG mode (only cards that switch without a reset are asked to).
    fn set_mig_enabled(&self, parent_uuid: &str, enabled: bool) -> Result<(), MigError>;
    /// Create a GPU instance at `placement`; returns its id.
    fn create_gpu_instance(&self, placement: &Placement) -> Result<u32, MigError>;
    /// Create the compute instance spanning GPU instance `gpu_instance` (of a profile with
    /// `compute_slices` compute slices).
    fn create_compute_instance(
        &self,
        parent_uuid: &str,
        gpu_instance: u32,
        compute_slices: u32,
    ) -> Result<ComputeInstance, MigError>;
    fn destroy_compute_instance(
        &self,
        parent_uuid: &str,
        gpu_instance: u32,
        compute_instance: u32,
    ) -> Result<(), MigError>;
    fn destroy_gpu_instance(&self, parent_uuid: &str, gpu_instance: u32) -> Result<(), MigError>;
    /// Every GPU instance of the card, with its compute instances.
    fn gpu_instances(&self, parent_uuid: &str) -> Result<Vec<GpuInstance>, MigError>;
}

/// GPU-instance capability nodes from `/proc/driver/nvidia-caps/mig-minors`, whose lines read
/// `gpu<minor>/gi<id>/access <N>` and `gpu<minor>/gi<id>/ci<id>/access <N>`: the container needs
/// `/dev/nvidia-caps/nvidia-cap<N>` of its GPU instance and of its compute instance.
pub fn capability_nodes(mig_minors: &str, gpu_minor: u32, gi: u32, ci: u32) -> Vec<String> {
    let wanted = [
        format!("gpu{gpu_minor}/gi{gi}/access"),
        format!("gpu{gpu_minor}/gi{gi}/ci{ci}/access"),
    ];
    let mut nodes = Vec::new();
    for want in &wanted {
        for line in mig_minors.lines() {
            if let Some((path, minor)) = line.trim().split_once(char::is_whitespace) {
                if path == want {
                    if let Ok(n) = minor.trim().parse::<u32>() {
                        nodes.push(format!("/dev/nvidia-caps/nvidia-cap{n}"));
                    }
                }
            }
        }
    }
    nodes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capability_nodes_of_a_gpu_and_compute_instance() {
        let minors = "config 1\nmonitor 2\ngpu0/gi1/access 12\ngpu0/gi1/ci0/access 13\n\
                      gpu1/gi1/access 147\ngpu0/gi2/access 21\ngpu0/gi2/ci0/access 22\n";
        assert_eq!(
            capability_nodes(minors, 0, 2, 0),
            [
                "/dev/nvidia-caps/nvidia-cap21",
                "/dev/nvidia-caps/nvidia-cap22"
            ]
        );
        assert_eq!(
            capability_nodes(minors, 1, 1, 0),
            ["/dev/nvidia-caps/nvidia-cap147"]
        );
        assert!(capability_nodes(minors, 3, 1, 0).is_empty());
    }
}

//! NVIDIA MPS shares: a claim with `compute: Mps` gets its `cores` as a partition of the card's SMs
//! from the card's MPS control daemon, which the driver runs, one per card that holds MPS shares,
//! started with the first such claim and stopped with the last.
//!
//! - [`share`] (pure): which claims may use MPS, what their containers get (the CDI edits), and the
//!   limits the daemon itself holds;
//! - [`layout`] (pure): each daemon's folders under the run folder;
//! - [`control`]: `nvidia-cuda-mps-control` as a client (one command, its answer);
//! - [`daemon`]: the daemon's process: start in a mount namespace whose `/dev/shm` is the card's
//!   folder, identity, stop, the servers a killed daemon leaves.
//!
//! The order of the steps and their records in the checkpoint are `node_state`'s
//! (`node_state/mps.rs`), like every other file and process the driver leaves on the node.

pub mod control;
pub mod daemon;
pub mod layout;
pub mod share;

use std::path::PathBuf;

/// Why a card's MPS daemon could not be started, stopped or told its limits.
#[derive(Debug, thiserror::Error)]
pub enum MpsError {
    #[error(transparent)]
    Layout(#[from] layout::LayoutError),
    #[error(transparent)]
    Daemon(#[from] daemon::DaemonError),
    #[error(transparent)]
    Control(#[from] control::ControlError),
}

/// How the driver runs the daemons (`--mps-control`, `--mps-multi-user`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsSettings {
    /// `nvidia-cuda-mps-control`: a path, or a name looked up on `PATH`.
    pub control: PathBuf,
    /// `-M`: one server serves the clients of every user. Without it a pod running as another user
    /// than the card's current clients waits until they have all exited.
    pub multi_user: bool,
}

/// What `nvidia-cuda-mps-control` is called on `PATH`.
pub const CONTROL_BINARY: &str = "nvidia-cuda-mps-control";

impl Default for MpsSettings {
    fn default() -> Self {
        MpsSettings {
            control: PathBuf::from(CONTROL_BINARY),
            multi_user: true,
        }
    }
}

//! Why one claim could not be prepared or unprepared. Kept typed up to the gRPC adapter, which
//! alone turns it into the text the kubelet shows (`kubectl describe pod`).

use gpupool_api::claim::ClaimRef;
use thiserror::Error;

use super::api::ApiError;
use super::cdi::CdiError;
use super::claim::ClaimError;
use super::limits::LimitsError;
use super::nvidia_cdi;
use crate::node_state::NodeStateError;

/// One claim's failure: which claim, and what went wrong.
#[derive(Debug)]
pub struct PrepareError {
    claim: ClaimRef,
    kind: PrepareErrorKind,
}

#[derive(Debug, Error)]
pub enum PrepareErrorKind {
    /// The kubelet's reference or the claim as read fails a check; the error names the claim (or,
    /// for a reference that is not valid, the field), see [`ClaimError`].
    #[error(transparent)]
    Claim(#[from] ClaimError),
    #[error("not found in the API server")]
    NotFound,
    #[error("cannot read it from the API server: {0}")]
    Read(#[source] ApiError),
    #[error(transparent)]
    Limits(#[from] LimitsError),
    #[error(transparent)]
    Render(#[from] CdiError),
    /// The node guard: the device would share its card with another claim's in a way MIG
    /// forbids (see `guard.rs`). Boxed: the error travels in every prepare's `Result`.
    #[error(transparent)]
    Conflict(Box<super::guard::Conflict>),
    #[error("{device}: {source}")]
    NvidiaCdi {
        device: String,
        source: nvidia_cdi::NotFound,
    },
    /// The node's files or checkpoint.
    #[error(transparent)]
    NodeState(#[from] NodeStateError),
    /// This instance could not take its turn on the node's folders: the whole call failed.
    #[error(transparent)]
    Turn(std::sync::Arc<NodeStateError>),
    /// A blocking step that did not finish (it panicked).
    #[error("internal error: {0}")]
    Internal(String),
}

impl PrepareError {
    pub fn new(claim: &ClaimRef, kind: impl Into<PrepareErrorKind>) -> Self {
        PrepareError {
            claim: claim.clone(),
            kind: kind.into(),
        }
    }

    pub fn claim(&self) -> &ClaimRef {
        &self.claim
    }

    pub fn kind(&self) -> &PrepareErrorKind {
        &self.kind
    }

    /// Whether asking again can succeed without anyone changing the claim or the node: the API
    /// server or the node's files failed, or the watch cache has not seen the claim yet. The
    /// others (an invalid claim or config, a device missing on the node) fail the same way until
    /// someone fixes them.
    pub fn is_transient(&self) -> bool {
        match &self.kind {
            PrepareErrorKind::NotFound
            | PrepareErrorKind::Read(_)
            | PrepareErrorKind::NodeState(_)
            | PrepareErrorKind::Turn(_)
            | PrepareErrorKind::Internal(_) => true,
            PrepareErrorKind::Claim(_)
            | PrepareErrorKind::Limits(_)
            | PrepareErrorKind::Render(_)
            | PrepareErrorKind::Conflict(_)
            | PrepareErrorKind::NvidiaCdi { .. } => false,
        }
    }
}

impl std::fmt::Display for PrepareError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.kind {
            // Names the claim itself, or a reference that must not be echoed unchecked.
            PrepareErrorKind::Claim(e) => write!(f, "{e}"),
            kind => write!(f, "claim {}: {kind}", self.claim),
        }
    }
}

impl std::error::Error for PrepareError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        std::error::Error::source(&self.kind)
    }
}

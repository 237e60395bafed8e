//! The kubelet-facing side: registration, DRA (v1 and v1beta1) and resource health over Unix sockets.

pub mod authority;
mod dra;
pub mod health;
pub mod registration;
pub mod server;
pub mod stale;

use gpupool_api::claim::{ClaimRef, PreparedDevice};

use crate::prepare::PrepareError;

/// Prepared devices or an error, per claim, in the order asked.
pub type PrepareResults = Vec<(ClaimRef, Result<Vec<PreparedDevice>, PrepareError>)>;
pub type UnprepareResults = Vec<(ClaimRef, Result<(), PrepareError>)>;

/// What the DRA adapters call: claim preparation, independent of the gRPC version.
/// [`crate::prepare::ClaimPreparer`] is the real one; tests use their own.
#[tonic::async_trait]
pub trait Preparer: Send + Sync + 'static {
    async fn prepare(&self, claims: Vec<ClaimRef>) -> PrepareResults;
    async fn unprepare(&self, claims: Vec<ClaimRef>) -> UnprepareResults;
}

#[tonic::async_trait]
impl Preparer for crate::prepare::ClaimPreparer {
    async fn prepare(&self, claims: Vec<ClaimRef>) -> PrepareResults {
        crate::prepare::ClaimPreparer::prepare(self, claims).await
    }

    async fn unprepare(&self, claims: Vec<ClaimRef>) -> UnprepareResults {
        crate::prepare::ClaimPreparer::unprepare(self, claims).await
    }
}

//! How a prepare reads its claim: from the API server's watch cache when that copy can only be the
//! allocation the kubelet saw, else with a quorum read; a few reads at a time, each bounded.

use std::time::Duration;

use gpupool_api::claim::ClaimRef;

use super::api::{ApiError, ClaimRead};
use super::{claim, ClaimPreparer, PrepareError, PrepareErrorKind};

/// The kubelet gives a whole NodePrepareResources call 45 s; leave room for the rest.
const API_READ_TIMEOUT: Duration = Duration::from_secs(15);

/// kube's client speaks HTTP/1.1: each request in flight holds a connection of its own, and the
/// pool keeps it afterwards (its write buffer and dispatch channel, ~18 KiB here). Sixteen
/// concurrent prepares held twenty connections in a heap profile (with the status writes',
/// `status_writes::STATUS_WRITES_IN_FLIGHT`); a read waits about a millisecond for a slot instead.
pub(super) const CLAIM_READS_IN_FLIGHT: usize = 4;

impl ClaimPreparer {
    /// The claim as the API server has it: from its watch cache when that copy can only be the
    /// allocation the kubelet saw (see [`claim::cached_copy_problem`]), else with a quorum read.
    /// A claim unprepared before is read from the cache "not older than" what the driver last saw
    /// of it.
    pub(super) async fn read_claim(
        &self,
        claim: &ClaimRef,
    ) -> Result<k8s_openapi::api::resource::v1::ResourceClaim, PrepareError> {
        let pool = self.opts.node_name.as_str();
        let tombstones = self.unprepared.of(&claim.uid);
        let read = match tombstones.last().and_then(|t| t.seen_version.clone()) {
            Some(version) => ClaimRead::NotOlderThan(version),
            None => ClaimRead::Cached,
        };
        match self.get_claim(claim, read).await {
            Ok(copy) => {
                let problem = claim::cached_copy_problem(claim, &copy, pool, &tombstones);
                match problem {
                    None => return Ok(copy),
                    Some(why) => {
                        tracing::debug!(claim = %claim, why, "cached copy not usable; reading with quorum")
                    }
                }
            }
            // The cache may not have seen the claim's creation yet.
            Err(ApiError::NotFound) => {
                tracing::debug!(claim = %claim, "not in the watch cache; reading with quorum")
            }
            // An API server that cannot answer from its cache cannot answer a quorum read either:
            // asking again would only double the kubelet's wait.
            Err(e) => return Err(read_failure(claim, e)),
        }
        self.get_claim(claim, ClaimRead::Quorum)
            .await
            .map_err(|e| read_failure(claim, e))
    }

    async fn get_claim(
        &self,
        claim: &ClaimRef,
        read: ClaimRead,
    ) -> Result<k8s_openapi::api::resource::v1::ResourceClaim, ApiError> {
        let read = async {
            let _slot = self.claim_reads.acquire().await;
            self.api
                .get_claim(&claim.namespace, &claim.name, read)
                .await
        };
        tokio::time::timeout(API_READ_TIMEOUT, read)
            .await
            .unwrap_or(Err(ApiError::TimedOut))
    }
}

/// What the kubelet is told when the claim could not be read.
fn read_failure(claim: &ClaimRef, error: ApiError) -> PrepareError {
    let kind = match error {
        ApiError::NotFound => PrepareErrorKind::NotFound,
        e => PrepareErrorKind::Read(e),
    };
    PrepareError::new(claim, kind)
}

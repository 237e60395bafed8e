//! The cards' MPS daemons while the driver runs: checked every [`MPS_CHECK_INTERVAL`] in this
//! instance's turn (a daemon found dead is started again, `node_state/mps.rs`), and their faults
//! for the claims' status.

use std::collections::BTreeMap;
use std::time::Duration;

use super::ClaimPreparer;

/// How often the daemons are checked: a dead one is noticed (and started again) within this.
pub const MPS_CHECK_INTERVAL: Duration = Duration::from_secs(5);

impl ClaimPreparer {
    /// Starts again every MPS daemon that should run and does not; true when one was. Costs
    /// nothing on a node without MPS shares.
    pub async fn check_mps(&self) -> bool {
        if self.state.read(|data| data.mps.is_empty()) && !self.state.others_may_have_written() {
            return false;
        }
        let _turn = match self.state.take_turn().await {
            Ok(turn) => turn,
            Err(e) => {
                tracing::warn!(error = %e, "could not take the node's turn to check the MPS daemons");
                return false;
            }
        };
        let state = self.state.clone();
        tokio::task::spawn_blocking(move || state.check_mps())
            .await
            .unwrap_or(false)
    }

    /// The claims' devices whose MPS daemon had a fault, and what it was.
    pub fn mps_faults(&self) -> BTreeMap<String, String> {
        self.state.mps_faults()
    }
}

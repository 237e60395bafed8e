//! The tombstones of unprepared allocations: what a watch-cache copy of a claim is checked against.

use std::sync::Mutex;

use super::claim::Tombstone;

/// The allocations unprepared since start, newest last, so that a watch-cache copy still showing
/// one of them is recognised as stale (see [`claim::cached_copy_problem`]). Bounded: a claim is
/// re-allocated within seconds of its unprepare, if ever, and the cache is behind by far less.
#[derive(Default)]
pub(super) struct UnpreparedAllocations(Mutex<std::collections::VecDeque<(String, Tombstone)>>);

const UNPREPARED_KEPT: usize = 1024;

impl UnpreparedAllocations {
    pub(super) fn record(&self, uid: &str, tombstone: Tombstone) {
        let mut list = self.0.lock().expect("never poisoned");
        if list.len() == UNPREPARED_KEPT {
            list.pop_front();
        }
        list.push_back((uid.to_string(), tombstone));
    }

    /// The claim's tombstones, oldest first.
    pub(super) fn of(&self, uid: &str) -> Vec<Tombstone> {
        let list = self.0.lock().expect("never poisoned");
        list.iter()
            .filter(|(u, _)| u == uid)
            .map(|(_, t)| t.clone())
            .collect()
    }
}

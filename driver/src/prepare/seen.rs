//! What the driver saw of each prepared claim, which becomes the claim's tombstone on unprepare.

use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;

use super::claim::{self, AllocationId, Tombstone};

/// What the driver saw of each prepared claim: the consumers of the copy it prepared from, and
/// the newest resourceVersion it read or wrote. An unprepare turns it into the claim's
/// [`Tombstone`].
#[derive(Default)]
pub(crate) struct SeenClaims(Mutex<HashMap<String, SeenClaim>>);

#[derive(Default)]
struct SeenClaim {
    consumers: BTreeSet<String>,
    version: Option<String>,
}

impl SeenClaims {
    pub(super) fn prepared_from(
        &self,
        uid: &str,
        copy: &k8s_openapi::api::resource::v1::ResourceClaim,
    ) {
        self.0.lock().expect("never poisoned").insert(
            uid.to_string(),
            SeenClaim {
                consumers: claim::consumers(copy),
                version: copy.metadata.resource_version.clone(),
            },
        );
    }

    /// A status write answered with `version`.
    pub(crate) fn wrote(&self, uid: &str, version: String) {
        if let Some(seen) = self.0.lock().expect("never poisoned").get_mut(uid) {
            seen.version = Some(version);
        }
    }

    /// The claim's tombstone, once its `allocation` is unprepared.
    pub(super) fn bury(&self, uid: &str, allocation: AllocationId) -> Tombstone {
        let seen = self
            .0
            .lock()
            .expect("never poisoned")
            .remove(uid)
            .unwrap_or_default();
        Tombstone {
            allocation,
            consumers: seen.consumers,
            seen_version: seen.version,
        }
    }
}

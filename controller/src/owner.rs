//! Owners, from the install, for what the controller creates that nothing else owns: the all-GPUs
//! DeviceClass `gpupool.dev` names the controller's ClusterRole, the leader-election Lease the
//! leader-election Role of its namespace. `helm uninstall` and `kubectl delete -k` remove both
//! roles, and the cluster's garbage collector then removes what they own. (The per-model and tier
//! classes name their GpuModels, ComputeProfile templates their profiles.)
//!
//! Why the roles: the install creates and removes them; they have the scope an owner needs (a
//! cluster-scoped object may only be owned by a cluster-scoped one, a namespaced object by one in
//! its namespace or a cluster-scoped one); and they grant the permission to create what they own,
//! so once an owner is gone the controller cannot put its object back during an uninstall either.
//!
//! The owner's uid is read on first use and again before each creation of an owned object (made only
//! when missing: at start, or after it went, perhaps with an owner that has been recreated since).
//! When it cannot be read (no such role, no permission to read it) the controller says so once and
//! creates the object without an owner, and tries again at most every [`RETRY_AFTER`]; a reconcile
//! never fails for it.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::rbac::v1::{ClusterRole, Role};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::Api;
use kube::Client;
use tracing::{info, warn};

/// How long an owner that could not be read is taken as absent before it is read again.
pub const RETRY_AFTER: Duration = Duration::from_secs(60);

const RBAC_API_VERSION: &str = "rbac.authorization.k8s.io/v1";

/// Which object owns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OwnerKind {
    ClusterRole,
    /// A Role, in the namespace of what it owns.
    Role {
        namespace: String,
    },
}

impl OwnerKind {
    fn kind(&self) -> &'static str {
        match self {
            OwnerKind::ClusterRole => "ClusterRole",
            OwnerKind::Role { .. } => "Role",
        }
    }
}

#[derive(Debug, Default)]
struct State {
    reference: Option<OwnerReference>,
    /// When the owner was last read, successfully or not; `None`: never.
    read_at: Option<Instant>,
    /// Whether "no owner" has been logged since the owner was last found.
    warned: bool,
}

/// The owner of one object the controller creates, read from the API server.
pub struct Owner {
    client: Client,
    kind: OwnerKind,
    name: String,
    /// What it owns, for the log: e.g. `DeviceClass gpupool.dev`.
    owned: String,
    state: Mutex<State>,
}

impl Owner {
    pub fn cluster_role(client: Client, name: &str, owned: &str) -> Owner {
        Self::new(client, OwnerKind::ClusterRole, name, owned)
    }

    pub fn role(client: Client, namespace: &str, name: &str, owned: &str) -> Owner {
        let kind = OwnerKind::Role {
            namespace: namespace.to_string(),
        };
        Self::new(client, kind, name, owned)
    }

    fn new(client: Client, kind: OwnerKind, name: &str, owned: &str) -> Owner {
        Owner {
            client,
            kind,
            name: name.to_string(),
            owned: owned.to_string(),
            state: Mutex::new(State::default()),
        }
    }

    /// Whether `reference` points at this owner (whatever its uid).
    pub fn is(&self, reference: &OwnerReference) -> bool {
        reference.api_version == RBAC_API_VERSION
            && reference.kind == self.kind.kind()
            && reference.name == self.name
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The reference as last read; read now if it never was, or could not be a while ago.
    pub async fn reference(&self) -> Option<OwnerReference> {
        {
            let state = self.state();
            let fresh_enough = match (&state.reference, state.read_at) {
                (Some(_), _) => true,
                (None, Some(at)) => at.elapsed() < RETRY_AFTER,
                (None, None) => false,
            };
            if fresh_enough {
                return state.reference.clone();
            }
        }
        self.refresh().await
    }

    /// Reads the owner again: before an owned object is created, so that it names the owner as it
    /// is now.
    pub async fn refresh(&self) -> Option<OwnerReference> {
        let read = match &self.kind {
            OwnerKind::ClusterRole => Api::<ClusterRole>::all(self.client.clone())
                .get_opt(&self.name)
                .await
                .map(|role| role.and_then(|r| r.metadata.uid)),
            OwnerKind::Role { namespace } => {
                Api::<Role>::namespaced(self.client.clone(), namespace)
                    .get_opt(&self.name)
                    .await
                    .map(|role| role.and_then(|r| r.metadata.uid))
            }
        };
        let mut state = self.state();
        state.read_at = Some(Instant::now());
        let why = match read {
            Ok(Some(uid)) => {
                if state.reference.as_ref().map(|r| &r.uid) != Some(&uid) {
                    info!(owner = %self.describe(), %uid, owned = %self.owned, "owner found");
                }
                state.reference = Some(self.reference_to(uid));
                state.warned = false;
                return state.reference.clone();
            }
            Ok(None) => {
                // Gone: an object created now must not name it, or the collector takes it at once.
                state.reference = None;
                "not found".to_string()
            }
            // A passing failure keeps what was read before.
            Err(e) if state.reference.is_some() => {
                tracing::debug!(owner = %self.describe(), error = %e, "reading the owner failed; keeping its uid");
                return state.reference.clone();
            }
            Err(e) => e.to_string(),
        };
        if !state.warned {
            state.warned = true;
            warn!(
                owner = %self.describe(),
                reason = %why,
                "cannot read the owner: {} is written without one, so uninstalling leaves it behind",
                self.owned
            );
        }
        None
    }

    fn reference_to(&self, uid: String) -> OwnerReference {
        OwnerReference {
            api_version: RBAC_API_VERSION.to_string(),
            kind: self.kind.kind().to_string(),
            name: self.name.clone(),
            uid,
            // Not its controller, and no blockOwnerDeletion: that would need `delete` on the role.
            controller: None,
            block_owner_deletion: None,
        }
    }

    /// `ClusterRole <name>` or `Role <namespace>/<name>`, as kubectl names it.
    fn describe(&self) -> String {
        match &self.kind {
            OwnerKind::ClusterRole => format!("ClusterRole {}", self.name),
            OwnerKind::Role { namespace } => format!("Role {namespace}/{}", self.name),
        }
    }
}

/// `existing` with `owner` in it: in place of a reference to the same object with another uid, or
/// added. `None` for an empty list, as the API server stores it.
pub fn with_owner(
    existing: &[OwnerReference],
    owner: Option<OwnerReference>,
) -> Option<Vec<OwnerReference>> {
    let mut references: Vec<OwnerReference> = existing.to_vec();
    if let Some(owner) = owner {
        references.retain(|r| {
            !(r.api_version == owner.api_version && r.kind == owner.kind && r.name == owner.name)
        });
        references.push(owner);
    }
    (!references.is_empty()).then_some(references)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(kind: &str, name: &str, uid: &str) -> OwnerReference {
        OwnerReference {
            api_version: RBAC_API_VERSION.into(),
            kind: kind.into(),
            name: name.into(),
            uid: uid.into(),
            controller: None,
            block_owner_deletion: None,
        }
    }

    #[test]
    fn an_owner_is_added_or_replaces_its_older_self() {
        let other = reference("ClusterRole", "someone-else", "o");
        assert_eq!(with_owner(&[], None), None);
        assert_eq!(
            with_owner(std::slice::from_ref(&other), None),
            Some(vec![other.clone()])
        );
        let ours = reference("ClusterRole", "gpupool-controller", "new");
        assert_eq!(
            with_owner(
                &[
                    other.clone(),
                    reference("ClusterRole", "gpupool-controller", "old")
                ],
                Some(ours.clone())
            ),
            Some(vec![other, ours])
        );
    }
}

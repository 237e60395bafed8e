//! Leader election through a `coordination.k8s.io/v1` Lease, so that only one controller replica writes.
//!
//! A lease is taken over when it has no holder, or when its record has not changed for a whole lease
//! duration *as observed by this process*: comparing our clock with the holder's renewTime would trust
//! two machines' clocks to agree. Writes to the Lease use its resourceVersion, so of two contenders
//! the API server lets exactly one win (the other gets 409 Conflict).
//!
//! A leader considers itself leader only until `last renewal attempt + lease duration - renew interval`:
//! if it cannot renew (API unreachable), it stops writing before anyone else may take over.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, OwnerReference};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use thiserror::Error;
use tokio::sync::watch;
use tracing::{info, warn};

use crate::owner::{self, Owner};

#[derive(Debug, Error)]
pub enum LeaderError {
    #[error("lease {namespace}/{name}: {source}")]
    Api {
        namespace: String,
        name: String,
        #[source]
        source: kube::Error,
    },
}

#[derive(Debug, Clone)]
pub struct LeaseConfig {
    pub namespace: String,
    pub name: String,
    pub identity: String,
    pub lease_duration: Duration,
    pub renew_interval: Duration,
}

/// What to do after reading the Lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// No Lease object yet.
    Create,
    /// Nobody holds it, or the holder stopped renewing: take it.
    Take,
    /// We hold it.
    Renew,
    /// Someone else holds a live lease.
    Follow { holder: String },
}

/// Decide from the Lease spec and how long its record has been unchanged (by our clock).
pub fn decide(
    lease: Option<&LeaseSpec>,
    identity: &str,
    unchanged_for: Duration,
    default_duration: Duration,
) -> Decision {
    let Some(spec) = lease else {
        return Decision::Create;
    };
    let holder = spec.holder_identity.as_deref().unwrap_or("");
    if holder.is_empty() {
        return Decision::Take;
    }
    if holder == identity {
        return Decision::Renew;
    }
    let duration = spec
        .lease_duration_seconds
        .filter(|s| *s > 0)
        .map(|s| Duration::from_secs(s as u64))
        .unwrap_or(default_duration);
    if unchanged_for >= duration {
        Decision::Take
    } else {
        Decision::Follow {
            holder: holder.to_string(),
        }
    }
}

/// How long a successful renewal that started at `attempt` lets us act as leader.
pub fn leadership_deadline(attempt: Instant, config: &LeaseConfig) -> Instant {
    let margin = config
        .lease_duration
        .saturating_sub(config.renew_interval)
        .max(config.lease_duration / 2);
    attempt + margin
}

/// Whether this process may write now. Cheap to clone and check before every write.
#[derive(Clone)]
pub struct Leadership {
    until: Arc<Mutex<Option<Instant>>>,
    always: bool,
    changes: watch::Sender<bool>,
}

impl Leadership {
    fn new(always: bool) -> Self {
        Leadership {
            until: Arc::new(Mutex::new(None)),
            always,
            changes: watch::Sender::new(always),
        }
    }

    /// For a single replica run without election (`--leader-elect=false`) and for tests.
    pub fn always() -> Self {
        Self::new(true)
    }

    pub fn is_leader(&self) -> bool {
        self.always
            || self
                .until
                .lock()
                .expect("leadership lock")
                .is_some_and(|until| Instant::now() < until)
    }

    /// Notified whenever leadership is gained or lost.
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.changes.subscribe()
    }

    fn set(&self, until: Option<Instant>) {
        *self.until.lock().expect("leadership lock") = until;
        self.publish();
    }

    /// Tell subscribers the current state (also after a deadline quietly passed).
    fn publish(&self) {
        let now = self.is_leader();
        self.changes.send_if_modified(|was| {
            let changed = *was != now;
            *was = now;
            changed
        });
    }
}

/// Runs the election for one identity.
pub struct LeaderElector {
    api: Api<Lease>,
    config: LeaseConfig,
    leadership: Leadership,
    /// The Lease record last seen and when it was first seen in that state.
    observed: Option<(String, Instant)>,
    /// Owner of the Lease, which `helm uninstall` does not delete itself (see `owner`).
    owner: Option<Owner>,
}

impl LeaderElector {
    pub fn new(client: kube::Client, config: LeaseConfig) -> Self {
        LeaderElector {
            api: Api::namespaced(client, &config.namespace),
            config,
            leadership: Leadership::new(false),
            observed: None,
            owner: None,
        }
    }

    /// Give the Lease `owner` (a Role in the Lease's namespace), so that it goes when the install
    /// does.
    pub fn with_owner(mut self, owner: Owner) -> Self {
        self.owner = Some(owner);
        self
    }

    /// The owner references for a Lease that has `existing`: ours added when it lacks them. The
    /// owner is read again for a Lease about to be created (`creating`), else once.
    async fn owner_references(
        &self,
        existing: &[OwnerReference],
        creating: bool,
    ) -> Option<Vec<OwnerReference>> {
        let owner = match &self.owner {
            None => None,
            Some(owner) if creating => owner.refresh().await,
            Some(owner) if existing.iter().any(|r| owner.is(r)) => None,
            Some(owner) => owner.reference().await,
        };
        owner::with_owner(existing, owner)
    }

    pub fn leadership(&self) -> Leadership {
        self.leadership.clone()
    }

    fn error(&self, source: kube::Error) -> LeaderError {
        LeaderError::Api {
            namespace: self.config.namespace.clone(),
            name: self.config.name.clone(),
            source,
        }
    }

    fn lease_spec(&self, previous: Option<&LeaseSpec>, taking: bool) -> LeaseSpec {
        let now = MicroTime(Timestamp::now());
        let previous = previous.cloned().unwrap_or_default();
        LeaseSpec {
            holder_identity: Some(self.config.identity.clone()),
            lease_duration_seconds: Some(self.config.lease_duration.as_secs().max(1) as i32),
            acquire_time: if taking {
                Some(now.clone())
            } else {
                previous.acquire_time.clone()
            },
            renew_time: Some(now),
            lease_transitions: Some(
                previous.lease_transitions.unwrap_or(0)
                    + i32::from(taking && previous.holder_identity.is_some()),
            ),
            ..previous
        }
    }

    /// One round: read the Lease, then create, take, renew or follow. Returns whether we lead.
    pub async fn step(&mut self) -> Result<bool, LeaderError> {
        let attempt = Instant::now();
        let lease = self
            .api
            .get_opt(&self.config.name)
            .await
            .map_err(|e| self.error(e))?;
        let fingerprint = lease.as_ref().map(|l| {
            format!(
                "{}|{:?}|{:?}",
                l.metadata.resource_version.as_deref().unwrap_or(""),
                l.spec.as_ref().and_then(|s| s.holder_identity.clone()),
                l.spec
                    .as_ref()
                    .and_then(|s| s.renew_time.clone())
                    .map(|t| t.0),
            )
        });
        let unchanged_for = match (&self.observed, &fingerprint) {
            (Some((seen, since)), Some(now)) if seen == now => attempt.duration_since(*since),
            _ => {
                self.observed = fingerprint.clone().map(|f| (f, attempt));
                Duration::ZERO
            }
        };
        // A Lease without a spec has no holder.
        let spec = lease.as_ref().map(|l| l.spec.clone().unwrap_or_default());
        let decision = decide(
            spec.as_ref(),
            &self.config.identity,
            unchanged_for,
            self.config.lease_duration,
        );
        let was_leader = self.leadership.is_leader();
        let result = match &decision {
            Decision::Follow { holder } => {
                if was_leader {
                    warn!(holder = %holder, "lost the lease; stopping writes");
                }
                self.leadership.set(None);
                return Ok(false);
            }
            Decision::Create => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(self.config.name.clone()),
                        namespace: Some(self.config.namespace.clone()),
                        owner_references: self.owner_references(&[], true).await,
                        ..Default::default()
                    },
                    spec: Some(self.lease_spec(None, true)),
                };
                self.api.create(&PostParams::default(), &lease).await
            }
            Decision::Take | Decision::Renew => {
                let mut lease = lease.clone().expect("a lease to take or renew");
                lease.spec = Some(self.lease_spec(spec.as_ref(), decision == Decision::Take));
                // A Lease of a version without owners gets one with its next renewal.
                let existing = lease.metadata.owner_references.clone().unwrap_or_default();
                lease.metadata.owner_references = self.owner_references(&existing, false).await;
                self.api
                    .replace(&self.config.name, &PostParams::default(), &lease)
                    .await
            }
        };
        match result {
            Ok(_) => {
                self.observed = None;
                if !was_leader {
                    info!(identity = %self.config.identity, lease = %format!("{}/{}", self.config.namespace, self.config.name), "became leader");
                }
                self.leadership
                    .set(Some(leadership_deadline(attempt, &self.config)));
                Ok(true)
            }
            Err(kube::Error::Api(status)) if status.code == 409 => {
                if was_leader {
                    warn!("lost the lease to another replica; stopping writes");
                }
                self.leadership.set(None);
                Ok(false)
            }
            Err(e) => {
                // Keep the leadership we have until its deadline; the next round may succeed.
                self.leadership.publish();
                Err(self.error(e))
            }
        }
    }

    /// Campaign and renew until `shutdown` flips to true, then hand the lease back if we hold it.
    pub async fn run(mut self, mut shutdown: watch::Receiver<bool>) {
        loop {
            if let Err(e) = self.step().await {
                warn!(error = %e, "leader election round failed");
            }
            // Wake up at the next renewal, or right when our leadership would lapse.
            let mut wait = self.config.renew_interval;
            if let Some(until) = *self.leadership.until.lock().expect("leadership lock") {
                wait = wait.min(until.saturating_duration_since(Instant::now()));
            }
            let stop = tokio::select! {
                _ = tokio::time::sleep(wait) => false,
                // A dropped sender means nobody can ask us to go on: stop too.
                changed = shutdown.changed() => changed.is_err(),
            };
            self.leadership.publish();
            if stop || *shutdown.borrow() {
                break;
            }
        }
        self.release().await;
    }

    /// Give the lease up so that another replica takes over at once instead of after its expiry.
    pub async fn release(&mut self) {
        if !self.leadership.is_leader() {
            return;
        }
        self.leadership.set(None);
        let Ok(Some(mut lease)) = self.api.get_opt(&self.config.name).await else {
            return;
        };
        let Some(spec) = lease.spec.as_mut() else {
            return;
        };
        if spec.holder_identity.as_deref() != Some(self.config.identity.as_str()) {
            return;
        }
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(MicroTime(Timestamp::now()));
        match self
            .api
            .replace(&self.config.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => info!("released the lease"),
            Err(e) => warn!(error = %e, "could not release the lease; it expires on its own"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEN: Duration = Duration::from_secs(10);

    fn held_by(holder: &str, seconds: Option<i32>) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(holder.to_string()),
            lease_duration_seconds: seconds,
            ..Default::default()
        }
    }

    #[test]
    fn absent_lease_is_created() {
        assert_eq!(decide(None, "me", Duration::ZERO, TEN), Decision::Create);
    }

    #[test]
    fn released_lease_is_taken_at_once() {
        let spec = LeaseSpec::default();
        assert_eq!(
            decide(Some(&spec), "me", Duration::ZERO, TEN),
            Decision::Take
        );
    }

    #[test]
    fn own_lease_is_renewed() {
        let spec = held_by("me", Some(10));
        assert_eq!(decide(Some(&spec), "me", TEN * 5, TEN), Decision::Renew);
    }

    #[test]
    fn live_lease_of_another_is_followed() {
        let spec = held_by("other", Some(10));
        assert_eq!(
            decide(Some(&spec), "me", Duration::from_secs(9), TEN),
            Decision::Follow {
                holder: "other".into()
            }
        );
    }

    #[test]
    fn lease_unchanged_for_its_duration_is_taken() {
        let spec = held_by("other", Some(10));
        assert_eq!(decide(Some(&spec), "me", TEN, TEN), Decision::Take);
        // The lease's own duration wins over ours.
        let spec = held_by("other", Some(30));
        assert!(matches!(
            decide(Some(&spec), "me", Duration::from_secs(20), TEN),
            Decision::Follow { .. }
        ));
    }

    #[test]
    fn leader_stops_before_anyone_may_take_over() {
        let config = LeaseConfig {
            namespace: "kube-system".into(),
            name: "gpupool-controller".into(),
            identity: "me".into(),
            lease_duration: TEN,
            renew_interval: Duration::from_secs(2),
        };
        let attempt = Instant::now();
        assert_eq!(
            leadership_deadline(attempt, &config),
            attempt + Duration::from_secs(8)
        );
        let odd = LeaseConfig {
            renew_interval: Duration::from_secs(20),
            ..config
        };
        assert_eq!(
            leadership_deadline(attempt, &odd),
            attempt + Duration::from_secs(5)
        );
    }

    #[test]
    fn leadership_lapses_at_its_deadline() {
        let leadership = Leadership::new(false);
        let mut changes = leadership.subscribe();
        assert!(!leadership.is_leader());
        leadership.set(Some(Instant::now() + Duration::from_secs(60)));
        assert!(leadership.is_leader());
        assert!(changes.has_changed().unwrap());
        assert!(*changes.borrow_and_update());
        leadership.set(Some(Instant::now() - Duration::from_millis(1)));
        assert!(!leadership.is_leader());
        assert!(!*changes.borrow_and_update());
        assert!(Leadership::always().is_leader());
    }
}

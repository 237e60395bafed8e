//! The cards' MPS control daemons on the node, in crash-safe order. A daemon runs while a
//! checkpoint entry holds its card (`ClaimEntry::mps`), and each step of its life is recorded
//! before it is taken ([`MpsDaemonRecord`]):
//!
//! - start: the claim recorded as the card's holder (`PrepareStarted`), the daemon recorded
//!   `Starting`, its folders and process, recorded `Running` with its PID and start time, then the
//!   ceiling its control pipe holds raised to admit the claim's share;
//! - stop, when the last holder goes: recorded `Stopping`, `quit` (SIGKILL after
//!   [`crate::mps::daemon::QUIT_TIMEOUT`]) with every server of its folder, its folders removed,
//!   the record removed; the holder's entry goes after that;
//! - start-up ([`recover`]): a daemon recorded `Running` that still runs is adopted; one a
//!   completed entry needs that is dead, half-started or half-stopped is cleared and started
//!   again; one no entry needs is stopped; folders no record accounts for (a lost checkpoint) are
//!   stopped and removed;
//! - while running ([`NodeState::check_mps`]): a daemon found dead is started again, and the
//!   failure stays on its record (and on its claims' status) until it stops.

use std::collections::{BTreeMap, BTreeSet};

use super::checkpoint::{
    Change, CheckpointData, ClaimEntry, ClaimState, MpsDaemonRecord, MpsDaemonState, MpsHold,
};
use super::fault::fault_point;
use super::layout::NodeLayout;
use super::{NodeState, NodeStateError};
use crate::mps::daemon::{self, DaemonId};
use crate::mps::layout::{mps_root, DaemonDirs};
use crate::mps::{control, share, MpsError, MpsSettings};

fn dirs_of(layout: &NodeLayout, card: &str) -> Result<DaemonDirs, MpsError> {
    Ok(DaemonDirs::of(&layout.run_dir, card)?)
}

fn recorded_id(record: &MpsDaemonRecord) -> Option<DaemonId> {
    Some(DaemonId {
        pid: record.pid?,
        start_time: record.start_time?,
    })
}

/// The shares that hold `card`, of every entry but `except`.
fn holds_of<'a>(data: &'a CheckpointData, card: &'a str, except: Option<&'a str>) -> Vec<MpsHold> {
    data.claims
        .iter()
        .filter(|(uid, _)| Some(uid.as_str()) != except)
        .flat_map(|(_, e)| &e.mps)
        .filter(|h| h.card == card)
        .cloned()
        .collect()
}

/// Puts the ceiling of the card's shares in force on its daemon (the defaults, and the servers
/// already running).
fn apply_ceiling(
    settings: &MpsSettings,
    dirs: &DaemonDirs,
    holds: &[MpsHold],
) -> Result<(), MpsError> {
    let Some(ceiling) = share::daemon_ceiling(holds) else {
        return Ok(());
    };
    let servers = control::servers(&settings.control, dirs)?;
    control::run(
        &settings.control,
        dirs,
        &share::ceiling_commands(ceiling, &servers),
    )?;
    Ok(())
}

/// Clears whatever a daemon of `dirs` left (the process `id` or the one its PID file names, its
/// servers, its socket and PID file) and starts a new one; its identity.
fn fresh_daemon(
    settings: &MpsSettings,
    dirs: &DaemonDirs,
    card: &str,
    id: Option<DaemonId>,
) -> Result<DaemonId, MpsError> {
    daemon::stop(settings, dirs, id)?;
    daemon::create_folders(dirs)?;
    Ok(daemon::start(settings, dirs, card)?)
}

/// Stops the daemon of `dirs` and removes its folders.
fn remove_daemon(
    settings: &MpsSettings,
    dirs: &DaemonDirs,
    id: Option<DaemonId>,
) -> Result<(), MpsError> {
    daemon::stop(settings, dirs, id)?;
    super::fsutil::remove_dir_all(&dirs.root).map_err(|source| {
        MpsError::Daemon(daemon::DaemonError::Folder {
            path: dirs.root.clone(),
            source,
        })
    })?;
    Ok(())
}

impl NodeState {
    /// Records the claim (`started`, `PrepareStarted`, naming its MPS card) and has the card's
    /// daemon running with a ceiling that admits the claim's share. On failure the entry is
    /// removed and a daemon no other claim holds is stopped. Blocking.
    pub fn hold_mps(&self, uid: &str, mut started: ClaimEntry) -> Result<(), NodeStateError> {
        let _one_at_a_time = self.mps_lock.lock().unwrap_or_else(|e| e.into_inner());
        started.state = ClaimState::PrepareStarted;
        self.checkpoint
            .commit(Change::Put(uid.to_string(), Box::new(started.clone())))?;
        fault_point("after-mps-hold-recorded");
        let done = started.mps.iter().try_for_each(|hold| {
            self.run_daemon(&hold.card, &hold.device)?;
            let holds = self.read(|data| holds_of(data, &hold.card, None));
            let dirs = dirs_of(&self.layout, &hold.card)?;
            apply_ceiling(&self.layout.mps, &dirs, &holds).map_err(NodeStateError::from)
        });
        if let Err(e) = done {
            if let Err(e) = self.checkpoint.commit(Change::Remove(uid.to_string())) {
                tracing::error!(uid, error = %e, "rolling back a failed MPS start could not update the checkpoint; the next start will");
            }
            if let Err(e) = self.release_mps_locked(None) {
                tracing::error!(uid, error = %e, "rolling back a failed MPS start could not stop the daemon; the next start will");
            }
            return Err(e);
        }
        Ok(())
    }

    /// The card's daemon running: the recorded one if it still runs, else a new one, each step
    /// recorded before it is taken. A record found dead keeps the failure for the claims.
    fn run_daemon(&self, card: &str, device: &str) -> Result<(), NodeStateError> {
        let settings = &self.layout.mps;
        let dirs = dirs_of(&self.layout, card)?;
        let record = self.read(|data| data.mps.get(card).cloned());
        let previous = match record {
            Some(r) if r.state == MpsDaemonState::Running => match recorded_id(&r) {
                id if daemon::is_serving(settings, &dirs, id) => return Ok(()),
                _ => Some(MpsDaemonRecord {
                    failure: Some(format!(
                        "the MPS control daemon of {card} (pid {}) had exited; started again",
                        r.pid.unwrap_or_default()
                    )),
                    restarts: r.restarts + 1,
                    ..r
                }),
            },
            other => other,
        };
        let starting = MpsDaemonRecord {
            state: MpsDaemonState::Starting,
            device: device.to_string(),
            pid: None,
            start_time: None,
            restarts: previous.as_ref().map_or(0, |r| r.restarts),
            failure: previous.as_ref().and_then(|r| r.failure.clone()),
        };
        self.checkpoint
            .commit(Change::PutMps(card.to_string(), Box::new(starting.clone())))?;
        fault_point("after-mps-daemon-recorded");
        let id = fresh_daemon(
            settings,
            &dirs,
            card,
            previous.as_ref().and_then(recorded_id),
        )?;
        fault_point("after-mps-daemon-started");
        tracing::info!(card, pid = id.pid, "MPS control daemon running");
        self.checkpoint.commit(Change::PutMps(
            card.to_string(),
            Box::new(MpsDaemonRecord {
                state: MpsDaemonState::Running,
                pid: Some(id.pid),
                start_time: Some(id.start_time),
                ..starting
            }),
        ))?;
        fault_point("after-mps-daemon-running");
        Ok(())
    }

    /// After the entry `leaving` goes (or, with `None`, after entries went): daemons no other
    /// entry holds are stopped, the others' ceilings lowered to the shares left. Stopping errors
    /// are returned (the kubelet's retry of an unprepare tries again); a ceiling that cannot be
    /// lowered is logged.
    pub(super) fn release_mps(&self, leaving: Option<&str>) -> Result<(), NodeStateError> {
        let _one_at_a_time = self.mps_lock.lock().unwrap_or_else(|e| e.into_inner());
        self.release_mps_locked(leaving)
    }

    /// [`NodeState::release_mps`] with the MPS lock held.
    fn release_mps_locked(&self, leaving: Option<&str>) -> Result<(), NodeStateError> {
        let (records, holders): (BTreeMap<String, MpsDaemonRecord>, BTreeSet<String>) =
            self.read(|data| {
                let holders = data
                    .claims
                    .iter()
                    .filter(|(uid, _)| Some(uid.as_str()) != leaving)
                    .flat_map(|(_, e)| e.mps.iter().map(|h| h.card.clone()))
                    .collect();
                (data.mps.clone(), holders)
            });
        let mut result = Ok(());
        for (card, record) in records {
            if holders.contains(&card) {
                let holds = self.read(|data| holds_of(data, &card, leaving));
                let lowered = dirs_of(&self.layout, &card)
                    .and_then(|dirs| apply_ceiling(&self.layout.mps, &dirs, &holds));
                if let Err(e) = lowered {
                    tracing::warn!(card, error = %e, "could not lower the MPS daemon's ceiling to the shares left");
                }
            } else if let Err(e) = self.stop_daemon(&card, record) {
                tracing::error!(card, error = %e, "could not stop the MPS control daemon no claim holds");
                result = Err(e);
            }
        }
        result
    }

    /// The entry of a claim holding MPS cards goes: the daemons only it holds are stopped, then
    /// the entry is removed, both under the MPS lock, so that two holders leaving at once cannot
    /// each count on the other to stop the daemon.
    pub(super) fn remove_mps_holder(&self, uid: &str) -> Result<(), NodeStateError> {
        let _one_at_a_time = self.mps_lock.lock().unwrap_or_else(|e| e.into_inner());
        self.release_mps_locked(Some(uid))?;
        self.checkpoint.commit(Change::Remove(uid.to_string()))?;
        Ok(())
    }

    /// Stops a card's daemon and removes its folders and record, `Stopping` recorded first.
    fn stop_daemon(&self, card: &str, record: MpsDaemonRecord) -> Result<(), NodeStateError> {
        let id = recorded_id(&record);
        self.checkpoint.commit(Change::PutMps(
            card.to_string(),
            Box::new(MpsDaemonRecord {
                state: MpsDaemonState::Stopping,
                ..record
            }),
        ))?;
        fault_point("after-mps-daemon-stopping-recorded");
        let dirs = dirs_of(&self.layout, card)?;
        remove_daemon(&self.layout.mps, &dirs, id)?;
        fault_point("after-mps-daemon-stopped");
        tracing::info!(card, "MPS control daemon stopped: no claim holds the card");
        self.checkpoint
            .commit(Change::RemoveMps(card.to_string()))?;
        Ok(())
    }

    /// Every recorded daemon that should run and does not (found dead, or never started after a
    /// failure) is started again; true when one was. Blocking.
    pub fn check_mps(&self) -> bool {
        let _one_at_a_time = self.mps_lock.lock().unwrap_or_else(|e| e.into_inner());
        let records = self.read(|data| data.mps.clone());
        let mut changed = false;
        for (card, record) in records {
            if record.state == MpsDaemonState::Stopping {
                continue;
            }
            let id = recorded_id(&record);
            // The PID first (no process started); the socket only when the PID says gone.
            let running = record.state == MpsDaemonState::Running
                && (id.is_some_and(|id| daemon::is_running(&self.layout.mps, id))
                    || dirs_of(&self.layout, &card)
                        .is_ok_and(|dirs| daemon::answers(&self.layout.mps, &dirs)));
            if running {
                continue;
            }
            tracing::error!(card, pid = ?record.pid, state = ?record.state, "the MPS control daemon is not running; starting it again");
            changed = true;
            let ceiling = self.run_daemon(&card, &record.device).and_then(|()| {
                let holds = self.read(|data| holds_of(data, &card, None));
                let dirs = dirs_of(&self.layout, &card)?;
                apply_ceiling(&self.layout.mps, &dirs, &holds).map_err(NodeStateError::from)
            });
            if let Err(e) = ceiling {
                tracing::error!(card, error = %e, "could not start the MPS control daemon again; trying at the next check");
                let failed = MpsDaemonRecord {
                    failure: Some(format!(
                        "the MPS control daemon of {card} is not running: {e}"
                    )),
                    ..self
                        .read(|data| data.mps.get(&card).cloned())
                        .unwrap_or(record)
                };
                if let Err(e) = self
                    .checkpoint
                    .commit(Change::PutMps(card.clone(), Box::new(failed)))
                {
                    tracing::error!(card, error = %e, "could not record the MPS daemon's failure");
                }
            }
        }
        changed
    }

    /// Faults of the MPS daemons, by device (`gpu-<i>`): what the claims on those cards are told.
    pub fn mps_faults(&self) -> BTreeMap<String, String> {
        self.read(|data| {
            data.mps
                .values()
                .filter_map(|r| Some((r.device.clone(), r.failure.clone()?)))
                .collect()
        })
    }
}

/// Start-up: each daemon made to agree with the completed entries that survived recovery (their
/// shares in `data.claims`), then the folders no record accounts for stopped and removed. A
/// daemon that cannot be started is recorded as failed (the running driver keeps trying), never a
/// reason not to start.
pub(super) fn recover(layout: &NodeLayout, data: &mut CheckpointData, rebooted: bool) {
    let settings = &layout.mps;
    let needed: BTreeMap<String, String> = data
        .claims
        .values()
        .flat_map(|e| &e.mps)
        .map(|h| (h.card.clone(), h.device.clone()))
        .collect();
    let records = std::mem::take(&mut data.mps);
    for (card, record) in &records {
        let Ok(dirs) = dirs_of(layout, card) else {
            tracing::error!(
                card,
                "dropping an MPS daemon record whose card is not a GPU UUID"
            );
            continue;
        };
        // A PID recorded before a reboot names another process now.
        let id = recorded_id(record).filter(|_| !rebooted);
        if !needed.contains_key(card) {
            tracing::info!(card, state = ?record.state, "stopping an MPS control daemon no prepared claim holds");
            if let Err(e) = remove_daemon(settings, &dirs, id) {
                tracing::error!(card, error = %e, "could not stop the MPS control daemon");
            }
            continue;
        }
        let alive =
            record.state == MpsDaemonState::Running && daemon::is_serving(settings, &dirs, id);
        if alive {
            tracing::info!(
                card,
                pid = record.pid,
                "adopting the running MPS control daemon"
            );
            data.mps.insert(card.clone(), record.clone());
            continue;
        }
        let failure = (record.state == MpsDaemonState::Running && !rebooted).then(|| {
            format!(
                "the MPS control daemon of {card} (pid {}) had exited; started again",
                record.pid.unwrap_or_default()
            )
        });
        let restarts = record.restarts + u32::from(failure.is_some());
        let started = MpsDaemonRecord {
            failure: failure.or_else(|| record.failure.clone().filter(|_| !rebooted)),
            restarts,
            ..record.clone()
        };
        data.mps.insert(
            card.clone(),
            start_recorded(settings, &dirs, card, id, started),
        );
    }
    for (card, device) in &needed {
        if data.mps.contains_key(card) {
            continue;
        }
        let Ok(dirs) = dirs_of(layout, card) else {
            continue;
        };
        let record = MpsDaemonRecord {
            state: MpsDaemonState::Starting,
            device: device.clone(),
            pid: None,
            start_time: None,
            restarts: 0,
            failure: None,
        };
        data.mps.insert(
            card.clone(),
            start_recorded(settings, &dirs, card, None, record),
        );
    }
    sweep(layout, data);
    for card in data.mps.keys() {
        let holds = holds_of(data, card, None);
        if let Ok(dirs) = dirs_of(layout, card) {
            if let Err(e) = apply_ceiling(settings, &dirs, &holds) {
                tracing::warn!(card, error = %e, "could not set the MPS daemon's ceiling at start");
            }
        }
    }
}

/// A fresh daemon for `card`: its record `Running`, or `Starting` with the reason it failed.
fn start_recorded(
    settings: &MpsSettings,
    dirs: &DaemonDirs,
    card: &str,
    id: Option<DaemonId>,
    record: MpsDaemonRecord,
) -> MpsDaemonRecord {
    match fresh_daemon(settings, dirs, card, id) {
        Ok(id) => {
            tracing::info!(
                card,
                pid = id.pid,
                "MPS control daemon started for the prepared claims"
            );
            MpsDaemonRecord {
                state: MpsDaemonState::Running,
                pid: Some(id.pid),
                start_time: Some(id.start_time),
                ..record
            }
        }
        Err(e) => {
            tracing::error!(card, error = %e, "cannot start the MPS control daemon the prepared claims need");
            MpsDaemonRecord {
                state: MpsDaemonState::Starting,
                pid: None,
                start_time: None,
                failure: Some(format!(
                    "the MPS control daemon of {card} is not running: {e}"
                )),
                ..record
            }
        }
    }
}

/// Daemon folders without a record: their daemon (if one runs) stopped, the folders removed.
fn sweep(layout: &NodeLayout, data: &CheckpointData) {
    let root = mps_root(&layout.run_dir);
    let Ok(entries) = std::fs::read_dir(&root) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if data.mps.contains_key(&name) {
            continue;
        }
        match DaemonDirs::of(&layout.run_dir, &name) {
            Ok(dirs) => {
                tracing::info!(folder = %dirs.root.display(), "stopping an MPS control daemon no record accounts for");
                if let Err(e) = remove_daemon(&layout.mps, &dirs, None) {
                    tracing::error!(folder = %dirs.root.display(), error = %e, "could not remove an MPS daemon's folder");
                }
            }
            Err(_) => {
                if let Err(e) = super::fsutil::remove_dir_all(&entry.path()) {
                    tracing::error!(path = %entry.path().display(), error = %e, "could not remove a stray entry of the MPS folder");
                }
            }
        }
    }
}

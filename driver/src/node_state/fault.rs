//! Fault points: places where a crash test can make the driver die hard (SIGKILL, no cleanup).
//!
//! Compiled in only for debug builds or with the `fault-injection` feature; armed only when
//! `GPUPOOL_FAULT_POINT` names the point. A release build compiles every call to nothing.

/// Every point, in the order prepare and unprepare pass them.
pub const FAULT_POINTS: &[&str] = &[
    // Claims with MIG devices first create their instances (NodeState::create_mig).
    "after-gpu-instance-created",
    "after-gpu-instance-recorded",
    "after-compute-instance-created",
    "after-prepare-started",
    "after-temp-spec-written",
    "after-spec-renamed",
    "after-prepare-completed",
    "mid-unprepare",
    "after-compute-instance-destroyed",
];

/// The points of a card's MPS control daemon (`node_state/mps.rs`), passed by claims with
/// `compute: Mps` besides the ones above: a claim recorded as the card's holder, the daemon
/// recorded as starting, started, recorded running; recorded stopping, stopped.
pub const MPS_FAULT_POINTS: &[&str] = &[
    "after-mps-hold-recorded",
    "after-mps-daemon-recorded",
    "after-mps-daemon-started",
    "after-mps-daemon-running",
    "after-mps-daemon-stopping-recorded",
    "after-mps-daemon-stopped",
];

pub const FAULT_POINT_ENV: &str = "GPUPOOL_FAULT_POINT";

#[cfg(any(debug_assertions, feature = "fault-injection"))]
#[inline]
pub fn fault_point(name: &str) {
    if std::env::var(FAULT_POINT_ENV).is_ok_and(|armed| armed == name) {
        tracing::error!(
            fault_point = name,
            "fault point reached: killing the process"
        );
        // SAFETY: kill(2) on our own pid with a valid signal number has no memory effects.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
    }
}

#[cfg(not(any(debug_assertions, feature = "fault-injection")))]
#[inline(always)]
pub fn fault_point(_name: &str) {}

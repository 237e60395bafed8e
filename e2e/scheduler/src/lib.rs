//! Scheduler stand-in for the emulator: what kube-scheduler's DRA plugin and the resourceclaim
//! controller do in a real cluster.
//!
//! - [`allocator`]: the structured-parameters allocator, pure (CEL selectors, `exactly` and
//!   `firstAvailable` requests, constraints, consumable capacity, config, node selector);
//! - [`placement`]: the first node, by name, where all of a pod's claims fit, pure;
//! - [`claims`]: claims generated from templates and extended resources, pure;
//! - [`service`]: the loop against an API server ([`run`], [`spawn`]).

pub mod allocator;
pub mod claims;
pub mod placement;
pub mod service;

pub use allocator::{allocate, TargetNode, Unallocatable};
pub use placement::{place, NoFit, Placement};
pub use service::{run, spawn, Options, SchedulerHandle};

#[cfg(test)]
mod fixtures;

//! Scheduler stand-in for the emulator: what kube-scheduler's DRA plugin and the resourceclaim
//! controller do in a real cluster.
//!
//! [`allocator`] is the pure structured-parameters allocator (CEL selectors, `exactly` and
//! `firstAvailable` requests, consumable capacity); the loop that applies it to an API server
//! lives beside it.

pub mod allocator;
pub mod placement;

pub use allocator::{allocate, TargetNode, Unallocatable};
pub use placement::{place, NoFit, Placement};

#[cfg(test)]
mod fixtures;

//! gpupool-vgpu: holds every process of a container to its claim's GPU memory and SM limits.
//! Preloaded (`LD_PRELOAD` or `/etc/ld.so.preload`); the design and its reasons are in
//! `docs/enforcement.md`.
//!
//! Pure logic (no I/O, tested directly): [`env`], [`view`], [`layout`], [`schedule`] (who holds
//! the card next), [`symbols`], [`accounting`]. At the edges: [`sys`] (mmap, OFD locks, futexes),
//! [`shared`] (the accounting file), [`arbiter`] (the card's turns), [`interpose`] (our `dlsym`),
//! [`hooks`] (the wrappers), [`process`], [`limiter`] (the gate of every launch), [`nvml`],
//! [`driver`].

#[macro_use]
pub mod log;
pub mod accounting;
pub mod arbiter;
pub mod cuda;
pub mod driver;
pub mod entry_points;
pub mod env;
pub mod hooks;
pub mod interpose;
pub mod layout;
pub mod limiter;
pub mod nvml;
pub mod process;
pub mod schedule;
pub mod shared;
pub mod symbols;
pub mod sys;
pub mod traffic;
pub mod view;

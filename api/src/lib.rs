//! gpupool's types and contracts, shared by the driver, the controller and the test harness.
//!
//! Nothing here does I/O: every function takes values and returns values, so each rule is tested directly.

pub mod admission;
pub mod cdi;
pub mod claim;
pub mod config;
pub mod crd;
pub mod device;
pub mod inventory;
pub mod names;
pub mod quantity;
pub mod validation;

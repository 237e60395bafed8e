//! gpupool end to end: a kubelet emulator, a test harness that runs the real driver and controller
//! binaries against the API server emulator (or a real cluster), and the sandbox, which is also the
//! driver and the controller (`roles`) so that it needs no other binary built.

pub mod grpc;
pub mod harness;
pub mod kubelet;
pub mod plane;
pub mod roles;
pub mod sandbox;
pub mod trace;

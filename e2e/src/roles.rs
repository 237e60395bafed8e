//! One executable that is also the driver and the controller: `gpupool-sandbox gpupool-driver run
//! ...` runs what `gpupool-driver run ...` runs (the same `cli::main`), in a process of its own.
//!
//! `cargo run -p gpupool-e2e --bin gpupool-sandbox` builds only the binary it runs; starting the
//! driver's and the controller's binaries took a second `cargo build` on a fresh clone (15 crates
//! again, two more minutes). The sandbox links their code instead (the e2e crate depends on both
//! libraries anyway) and starts itself once per program
//! ([`crate::harness::Programs::ThisExecutable`]): separate processes with the programs' own
//! flags, logs, sockets, exit codes and abort-on-panic hook, which a SIGKILL ends alone, as it
//! ends the real binaries. The tests keep running the real binaries, which `cargo test` builds.

use std::ffi::OsString;
use std::process::ExitCode;

use crate::harness::{CONTROLLER_BIN, DRIVER_BIN};

/// When the first argument names a program (`gpupool-driver`, `gpupool-controller`): runs it with
/// the arguments after that and returns its exit code. `None` otherwise: the arguments are the
/// executable's own. Called first thing in `main`, before logging or a runtime is set up, since
/// the program sets up its own.
pub fn run_if_asked() -> Option<ExitCode> {
    let mut args = std::env::args_os();
    let _executable = args.next();
    let role = args.next()?;
    let program: fn(Vec<OsString>) -> ExitCode = match role.to_str() {
        Some(DRIVER_BIN) => |args| gpupool_driver::cli::main(args),
        Some(CONTROLLER_BIN) => |args| gpupool_controller::cli::main(args),
        _ => return None,
    };
    if let Some(name) = role.to_str() {
        take_name(name);
    }
    // The program gets its own name as argv[0], as from its binary: clap names the program by
    // it in usage lines and errors.
    Some(program(std::iter::once(role).chain(args).collect()))
}

/// Gives this process the name the program's binary gives it in `ps -e`, `top` and `pgrep` (the
/// kernel cuts both to 15 bytes): `pgrep gpupool-driver` finds the sandbox's drivers too.
fn take_name(name: &str) {
    #[cfg(target_os = "linux")]
    if let Ok(name) = std::ffi::CString::new(name) {
        // SAFETY: PR_SET_NAME reads at most 16 bytes of a NUL-terminated string that outlives
        // the call, and changes nothing but the calling thread's name (the only thread yet).
        unsafe {
            libc::prctl(libc::PR_SET_NAME, name.as_ptr() as libc::c_ulong, 0, 0, 0);
        }
    }
}

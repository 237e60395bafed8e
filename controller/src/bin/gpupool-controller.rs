//! `gpupool-controller`; the program is `gpupool_controller::cli`, which the sandbox runs as well.

use std::process::ExitCode;

fn main() -> ExitCode {
    gpupool_controller::cli::main(std::env::args_os())
}

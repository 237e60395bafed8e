//! `gpupool-driver`; the program is `gpupool_driver::cli`, which the sandbox runs as well.

use std::process::ExitCode;

fn main() -> ExitCode {
    gpupool_driver::cli::main(std::env::args_os())
}

//! The library is preloaded into every process of a container, shells included: a program that
//! never calls CUDA or NVML must run exactly as without it (nothing initialised, nothing written,
//! nothing printed), whatever the environment says.

mod harness;

use harness::*;

fn shell_env(sandbox: &Sandbox, cache: &str, script: &str) -> Outcome {
    sandbox
        .program("/bin/sh", &["-c", script])
        .env("CUDA_DEVICE_MEMORY_SHARED_CACHE", cache)
        .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
        .env("CUDA_DEVICE_SM_LIMIT", "30")
        .env("LIBCUDA_LOG_LEVEL", "3")
        .run()
}

#[test]
fn a_shell_runs_as_without_the_library() {
    let sandbox = Sandbox::new("1x16g:108");
    let cache = sandbox.container();
    let outcome = shell_env(
        &sandbox,
        &cache,
        "echo hello; for i in 1 2 3; do true; done; exit 7",
    );
    assert_eq!(outcome.code, Some(7));
    assert_eq!(outcome.stdout, "hello\n");
    assert_eq!(
        outcome.stderr, "",
        "not a word from the library, even at the debug log level"
    );
    assert!(
        !exists(&cache),
        "nothing initialised: the shared file is not even created"
    );
}

#[test]
fn bin_true_runs_as_without_the_library_even_with_a_malformed_limit() {
    let sandbox = Sandbox::new("1x16g:108");
    let cache = sandbox.container();
    let outcome = sandbox
        .program("/bin/true", &[])
        .env("CUDA_DEVICE_MEMORY_SHARED_CACHE", &cache)
        .env("CUDA_DEVICE_MEMORY_LIMIT", "12q")
        .run();
    assert_eq!(outcome.code, Some(0));
    assert_eq!(outcome.stderr, "");
    assert!(!exists(&cache));
}

#[test]
fn a_shell_pipeline_of_several_processes_is_unaffected() {
    let sandbox = Sandbox::new("1x16g:108");
    let cache = sandbox.container();
    let outcome = shell_env(
        &sandbox,
        &cache,
        "printf 'b\\na\\n' | sort | head -n 1 | cat",
    );
    assert_eq!(
        (
            outcome.code,
            outcome.stdout.as_str(),
            outcome.stderr.as_str()
        ),
        (Some(0), "a\n", "")
    );
    assert!(!exists(&cache));
}

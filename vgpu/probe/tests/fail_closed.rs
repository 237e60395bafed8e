//! An environment the library cannot obey refuses CUDA with one stderr line naming the variable (or
//! the file) and its value: never a container running unlimited because of a typo.

mod harness;

use harness::*;

/// `cuInit` through the probe: its result, and the library's stderr lines.
fn init_under(sandbox: &Sandbox, env: &[(&str, &str)], lookup: &str) -> (Outcome, Option<i64>) {
    let mut run = sandbox.probe(&sandbox.container(), &["devices", "--lookup", lookup]);
    for (k, v) in env {
        run = run.env(k, v);
    }
    let outcome = run.run();
    let init = match lookup {
        // Through cuGetProcAddress the lookup itself is refused.
        "proc" => outcome
            .ops("missing")
            .first()
            .and_then(|m| m["lookup_result"].as_i64()),
        _ => outcome
            .ops("init")
            .first()
            .and_then(|i| i["result"].as_i64()),
    };
    (outcome, init)
}

#[test]
fn a_malformed_value_refuses_cuda_and_names_the_variable() {
    let sandbox = Sandbox::new("1x16g:108");
    let malformed = [
        ("CUDA_DEVICE_MEMORY_LIMIT_0", "12q"),
        ("CUDA_DEVICE_MEMORY_LIMIT", "1.5g"),
        ("CUDA_DEVICE_MEMORY_LIMIT_16", "1g"),
        ("CUDA_DEVICE_SM_LIMIT", "abc"),
        ("CUDA_DEVICE_SM_LIMIT_0", "50%"),
        ("GPU_CORE_UTILIZATION_POLICY", "SOMETIMES"),
        ("CUDA_TASK_PRIORITY", "high"),
        ("GPUPOOL_DEVICE_UUID_0", "GPU-not-a-uuid"),
        ("GPUPOOL_VGPU_MAX_LAUNCH_WAIT_MS", "soon"),
        ("CUDA_DEVICE_MEMORY_SHARED_CACHE", "relative/path.cache"),
    ];
    for (variable, value) in malformed {
        for lookup in ["dlsym", "proc"] {
            let (outcome, init) = init_under(&sandbox, &[(variable, value)], lookup);
            assert_eq!(
                init,
                Some(3),
                "{variable}={value} via {lookup}: CUDA_ERROR_NOT_INITIALIZED expected:\n{}",
                outcome.stdout
            );
            let lines = outcome.library_lines();
            assert_eq!(lines.len(), 1, "{variable}={value}: one line: {lines:?}");
            assert!(
                lines[0].contains(variable) && lines[0].contains(value),
                "{variable}={value}: {}",
                lines[0]
            );
        }
    }
}

#[test]
fn every_malformed_variable_gets_its_own_line() {
    let sandbox = Sandbox::new("1x16g:108");
    let (outcome, init) = init_under(
        &sandbox,
        &[
            ("CUDA_DEVICE_MEMORY_LIMIT_0", "12q"),
            ("CUDA_DEVICE_SM_LIMIT_1", "x"),
        ],
        "dlsym",
    );
    assert_eq!(init, Some(3));
    let lines = outcome.library_lines();
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert!(
        lines[0].contains("CUDA_DEVICE_MEMORY_LIMIT_0")
            && lines[1].contains("CUDA_DEVICE_SM_LIMIT_1"),
        "{lines:?}"
    );
}

#[test]
fn a_shared_file_that_cannot_be_made_refuses_cuda_and_names_the_file() {
    let sandbox = Sandbox::new("1x16g:108");
    let path = "/proc/gpupool-vgpu/limits.cache";
    let outcome = sandbox
        .probe(path, &["devices"])
        .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
        .run();
    assert_eq!(outcome.one("init")["result"], 3, "{}", outcome.stdout);
    let lines = outcome.library_lines();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].contains(path), "{}", lines[0]);
}

#[test]
fn a_refused_process_allocates_nothing_even_without_cuinit() {
    let sandbox = Sandbox::new("1x16g:108");
    // A program that skips cuInit (another library called it) still gets nothing from the wrapped
    // entry points.
    let args = [
        "alloc",
        "--path",
        "cuMemAlloc",
        "--context",
        "none",
        "--no-init",
    ];
    let outcome = sandbox
        .probe(&sandbox.container(), &args)
        .env("CUDA_DEVICE_MEMORY_LIMIT", "12q")
        .run();
    assert_eq!(outcome.one("alloc")["result"], 3, "{}", outcome.stdout);
}

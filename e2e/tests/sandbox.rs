//! `gpupool-sandbox` as a newcomer runs it: one command, well under a minute, a report that shows the
//! seeds' pool, the examples' claims with their fractions and limits, and nothing left behind.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

#[test]
fn the_sandbox_shows_the_examples_allocated_with_their_limits_and_cleans_up() {
    let started = Instant::now();
    let output = Command::new(env!("CARGO_BIN_EXE_gpupool-sandbox"))
        .env("NO_COLOR", "1")
        .output()
        .expect("running gpupool-sandbox");
    let elapsed = started.elapsed();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "exit {}\n{stdout}\n{stderr}",
        output.status
    );
    assert!(elapsed < Duration::from_secs(60), "took {elapsed:?}");

    assert!(!stdout.contains("FAILED to apply"), "{stdout}");
    for node in ["node-a100", "node-v100", "node-rtx"] {
        assert!(
            stdout.contains(&format!("\n  {node}\n")),
            "slices of {node}:\n{stdout}"
        );
    }
    assert!(stdout.contains("A100-SXM4-40GB   memory 40Gi"), "{stdout}");
    // The seeds' example: 1Gi + 50% of an A100, 70% of a V100, per-replica quarters of an A100.
    let claim_block = |name: &str| -> String {
        let start = stdout
            .find(&format!("  default/{name}"))
            .unwrap_or_else(|| panic!("claim {name} missing:\n{stdout}"));
        let rest = &stdout[start + 2..];
        let end = rest
            .find("\n  default/")
            .or_else(|| rest.find("\n\n"))
            .unwrap_or(rest.len());
        rest[..end].to_string()
    };
    let half = claim_block("half-a100");
    assert!(half.contains("-> node-a100/gpu-"), "{half}");
    assert!(half.contains("memory 1Gi, cores 50%"), "{half}");
    assert!(
        half.contains("CUDA_DEVICE_MEMORY_LIMIT_0=1024m CUDA_DEVICE_SM_LIMIT_0=50"),
        "{half}"
    );
    assert!(half.contains("half-a100 (Running)"), "{half}");
    let v100 = claim_block("v100-70");
    assert!(
        v100.contains("-> node-v100/gpu-") && v100.contains("cores 70%"),
        "{v100}"
    );
    let inference = claim_block("inference-0-gpu-");
    assert!(inference.contains("memory 8Gi, cores 25%"), "{inference}");
    assert!(
        claim_block("whole-rtx-3090").contains("-> node-rtx/gpu-0"),
        "{stdout}"
    );
    assert!(
        claim_block("whole-rtx-3090").contains("whole card"),
        "{stdout}"
    );

    // The CDI spec paths it printed were in its temporary folder, which is gone now.
    let cdi: Vec<PathBuf> = stdout
        .lines()
        .filter_map(|l| l.trim().strip_prefix("CDI spec: "))
        .map(PathBuf::from)
        .collect();
    assert!(!cdi.is_empty(), "{stdout}");
    for path in cdi {
        assert!(
            path.to_string_lossy().contains("gpupool.dev-claim_"),
            "{}",
            path.display()
        );
        assert!(!path.exists(), "{} left behind", path.display());
    }
}

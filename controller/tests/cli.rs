//! Runs the built `gpupool-controller` binary the way an operator (and the e2e harness) does.

use std::path::Path;
use std::process::Command;

const REGENERATE: &str =
    "regenerate with: cargo run -p gpupool-controller -- crds --dir deploy/crds";

fn binary() -> Command {
    Command::new(env!("CARGO_BIN_EXE_gpupool-controller"))
}

#[test]
fn crds_output_matches_the_files_in_deploy() {
    let output = binary()
        .arg("crds")
        .output()
        .expect("run gpupool-controller crds");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let printed = String::from_utf8(output.stdout).unwrap();

    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/crds");
    let mut expected = String::new();
    for file in [
        "gpumodels.gpupool.dev.yaml",
        "computeprofiles.gpupool.dev.yaml",
    ] {
        let path = dir.join(file);
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e}; {REGENERATE}", path.display()));
        expected.push_str("---\n");
        expected.push_str(&text);
    }
    assert!(
        printed == expected,
        "deploy/crds drifted from the types in api/src/crd.rs; {REGENERATE}"
    );
}

#[test]
fn crds_output_is_two_crd_documents() {
    let output = binary().arg("crds").output().unwrap();
    let printed = String::from_utf8(output.stdout).unwrap();
    let kinds: Vec<String> = serde_yaml::Deserializer::from_str(&printed)
        .map(|doc| {
            let value = serde_yaml::Value::deserialize(doc).unwrap();
            format!(
                "{}/{}",
                value["kind"].as_str().unwrap(),
                value["spec"]["names"]["kind"].as_str().unwrap()
            )
        })
        .collect();
    assert_eq!(
        kinds,
        [
            "CustomResourceDefinition/GpuModel",
            "CustomResourceDefinition/ComputeProfile"
        ]
    );
}

use serde::Deserialize;

#[test]
fn unknown_subcommand_fails_with_usage() {
    let output = binary().arg("bogus").output().unwrap();
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("Usage"));
}

//! The built `gpupool-driver` binary, as an operator runs it.

use std::process::Command;

fn driver() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_gpupool-driver"));
    for var in [
        "FAKE_GPUS",
        "NODE_NAME",
        "KUBECONFIG",
        "LOG_FORMAT",
        "HEALTHZ_ADDR",
        "POD_UID",
    ] {
        cmd.env_remove(var);
    }
    cmd
}

#[test]
fn inspect_prints_the_fake_inventory_and_slices_as_yaml() {
    let out = driver()
        .args([
            "inspect",
            "--fake-gpus",
            "a100-40gb:2",
            "--node-name",
            "node-a",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_yaml::Value = serde_yaml::from_slice(&out.stdout).expect("YAML");
    assert_eq!(doc["node"].as_str(), Some("node-a"));
    let gpus = doc["inventory"]["gpus"].as_sequence().unwrap();
    assert_eq!(gpus.len(), 2);
    assert_eq!(
        gpus[0]["productName"].as_str(),
        Some("NVIDIA A100-SXM4-40GB")
    );
    let slices = doc["resourceSlices"].as_sequence().unwrap();
    assert_eq!(slices.len(), 1);
    assert_eq!(slices[0]["kind"].as_str(), Some("ResourceSlice"));
    assert_eq!(slices[0]["spec"]["driver"].as_str(), Some("gpupool.dev"));
    assert_eq!(slices[0]["spec"]["pool"]["name"].as_str(), Some("node-a"));
    let devices = slices[0]["spec"]["devices"].as_sequence().unwrap();
    assert_eq!(devices.len(), 2);
    for (i, d) in devices.iter().enumerate() {
        assert_eq!(d["name"].as_str(), Some(format!("gpu-{i}").as_str()));
        assert_eq!(d["capacity"]["memory"]["value"].as_str(), Some("40Gi"));
        assert_eq!(d["capacity"]["cores"]["value"].as_str(), Some("100"));
        assert_eq!(d["allowMultipleAllocations"].as_bool(), Some(true));
        assert_eq!(
            d["attributes"]["model"]["string"].as_str(),
            Some("A100-SXM4-40GB")
        );
    }
}

#[test]
fn inspect_rejects_an_unknown_profile_naming_the_known_ones() {
    let out = driver()
        .args(["inspect", "--fake-gpus", "b300:1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("b300") && stderr.contains("a100-40gb"),
        "{stderr}"
    );
}

#[test]
fn run_without_nvml_or_fake_gpus_fails_clearly() {
    if std::path::Path::new("/dev/nvidiactl").exists() {
        eprintln!("skipped: this machine has an NVIDIA driver");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out = driver()
        .args(["run", "--node-name", "n1"])
        .arg("--registry-dir")
        .arg(dir.path().join("reg"))
        .arg("--plugin-dir")
        .arg(dir.path().join("plugin"))
        .arg("--cdi-root")
        .arg(dir.path().join("cdi"))
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("libnvidia-ml"), "{stderr}");
    assert!(stderr.contains("--fake-gpus"), "{stderr}");
    assert!(!dir.path().join("reg/gpupool.dev-reg.sock").exists());
}

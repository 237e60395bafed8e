//! Hostile input to the real driver binary (issue 6): claim references whose UID, name or namespace
//! would make a path escape its folder, and opaque configs that are too big, too deep or carry an
//! unknown field. Each is a per-claim error naming the problem, the good claim in the same request is
//! prepared, and nothing is written outside the CDI, state and run folders. The driver also refuses to
//! start on folders others can write to.

mod crash_support;

use std::collections::BTreeSet;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use crash_support::*;
use gpupool_api::claim::ClaimRef;
use serde_json::{json, Value};

const NAMESPACE: &str = "hostile";

fn claim_ref(namespace: &str, name: &str, uid: &str) -> ClaimRef {
    ClaimRef {
        namespace: namespace.into(),
        name: name.into(),
        uid: uid.into(),
    }
}

fn gpu_config(extra: Value) -> Value {
    let mut parameters = json!({
        "apiVersion": gpupool_api::names::API_GROUP_VERSION,
        "kind": "GpuConfig",
    });
    if let (Some(target), Value::Object(fields)) = (parameters.as_object_mut(), extra) {
        target.extend(fields);
    }
    parameters
}

/// New paths under `root` since `before`, other than those inside `allowed` folders.
fn written_outside(root: &Path, before: &BTreeSet<PathBuf>, allowed: &[&Path]) -> Vec<PathBuf> {
    walk(root)
        .difference(before)
        .filter(|relative| {
            !allowed
                .iter()
                .any(|dir| root.join(relative).starts_with(dir))
        })
        .cloned()
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_claims_get_their_own_error_and_write_nothing_outside() {
    let mut node = CrashNode::with_namespace("node-hostile", "a100-40gb:2", NAMESPACE).await;
    let pool = node.name.clone();
    let good = node
        .create_claim_on(NAMESPACE, "good", "gpu-0", Some(("4Gi", "10")))
        .await;
    let field = "status.allocation.devices.config[0].opaque.parameters";
    // (name, parameters, what the error must say)
    let hostile_configs: Vec<(&str, Value, Vec<String>)> = vec![
        (
            "too-big",
            gpu_config(json!({"memoryLimit": "4Gi", "padding": "x".repeat(11 * 1024)})),
            vec![field.to_string(), "10240".to_string()],
        ),
        (
            "too-deep",
            gpu_config(json!({"sharing": [[[[[["Fractional"]]]]]]})),
            vec![field.to_string(), "nested".to_string()],
        ),
        (
            "unknown-field",
            gpu_config(json!({"memoryLimt": "4Gi"})),
            vec![format!("{field}.memoryLimt"), "unknown field".to_string()],
        ),
    ];
    let mut config_claims = Vec::new();
    for (name, parameters, expected) in hostile_configs {
        let claim = node
            .create_allocated_claim(
                NAMESPACE,
                name,
                vec![result("gpu0", &pool, "gpu-1", Some("2Gi"), Some("5"))],
                vec![opaque_config(&["gpu0"], parameters)],
            )
            .await;
        config_claims.push((claim, expected));
    }

    // Somewhere an absolute-path UID would land if it were joined to a folder.
    let outside = tempfile::Builder::new()
        .prefix("gpupool-hostile-target-")
        .tempdir()
        .unwrap();
    let absolute = outside.path().join("evil");
    let valid_uid = "6f1c2a7e-3b4d-4e5f-8a9b-0c1d2e3f4a5b";
    // (reference, the words its error must carry)
    let hostile_refs: Vec<(ClaimRef, Vec<&str>)> = vec![
        (claim_ref(NAMESPACE, "x", "../x"), vec!["uid", "\"../x\""]),
        (
            claim_ref(NAMESPACE, "x", "../../../../../../tmp/x"),
            vec!["uid", "not a UUID"],
        ),
        (
            claim_ref(NAMESPACE, "x", absolute.to_str().unwrap()),
            vec!["uid", "not a UUID"],
        ),
        (
            claim_ref(NAMESPACE, "x", "not-a-uuid"),
            vec!["uid", "not-a-uuid"],
        ),
        (
            claim_ref(NAMESPACE, "a/b", valid_uid),
            vec!["name", "\"a/b\""],
        ),
        (
            claim_ref(NAMESPACE, "..", valid_uid),
            vec!["name", "\"..\""],
        ),
        (
            claim_ref(NAMESPACE, "../../etc/passwd", valid_uid),
            vec!["name", "../../etc/passwd"],
        ),
        (
            claim_ref("../kube-system", "x", valid_uid),
            vec!["namespace", "../kube-system"],
        ),
        (
            claim_ref("a/b", "x", valid_uid),
            vec!["namespace", "\"a/b\""],
        ),
    ];

    node.start_driver_ok().await;
    let root = node.root.clone();
    let before = walk(&root);
    let allowed = [
        node.dirs.cdi.as_path(),
        node.dirs.state.as_path(),
        node.dirs.run.as_path(),
    ];

    let mut request: Vec<ClaimRef> = vec![good.clone()];
    request.extend(hostile_refs.iter().map(|(c, _)| c.clone()));
    request.extend(config_claims.iter().map(|(c, _)| c.clone()));
    let outcome = node.prepare_retrying(&request).await;

    let good_devices = outcome[&good.uid]
        .as_ref()
        .unwrap_or_else(|e| panic!("the good claim in the same request is prepared: {e}"));
    let good_ids = cdi_ids(good_devices);
    for (claim, words) in &hostile_refs {
        // Two references may share a (valid) UID; then the kubelet gets one answer for both, which
        // must be an error either way.
        let answer = outcome
            .get(&claim.uid)
            .unwrap_or_else(|| panic!("no answer for {claim:?}"));
        let error = answer
            .as_ref()
            .expect_err(&format!("{claim:?} must be refused"));
        if claim.uid != valid_uid {
            for word in words {
                assert!(
                    error.contains(word),
                    "the error for {claim:?} names the problem ({word}): {error}"
                );
            }
        }
    }
    for (claim, expected) in &config_claims {
        let error = outcome[&claim.uid]
            .as_ref()
            .expect_err(&format!("claim {} must be refused", claim.name));
        for word in expected {
            assert!(
                error.contains(word.as_str()),
                "the error for claim {} names the problem ({word}): {error}",
                claim.name
            );
        }
        assert!(
            error.contains(&format!("{NAMESPACE}/{}", claim.name)),
            "the error names the claim: {error}"
        );
    }

    // The same references one at a time, so each valid-UID one gets its own answer.
    for (claim, words) in hostile_refs.iter().filter(|(c, _)| c.uid == valid_uid) {
        let outcome = node.prepare_retrying(std::slice::from_ref(claim)).await;
        let error = outcome[&claim.uid]
            .as_ref()
            .expect_err(&format!("{claim:?} must be refused"));
        for word in words {
            assert!(
                error.contains(word),
                "the error for {claim:?} names the problem ({word}): {error}"
            );
        }
    }
    // Unprepare checks references the same way.
    let refs: Vec<ClaimRef> = hostile_refs
        .iter()
        .filter(|(c, _)| c.uid != valid_uid)
        .map(|(c, _)| c.clone())
        .collect();
    let unprepared = node.unprepare_retrying(&refs).await;
    for claim in &refs {
        let error = unprepared[&claim.uid]
            .as_ref()
            .expect_err(&format!("unprepare of {claim:?} must be refused"));
        assert!(error.contains("uid"), "{claim:?}: {error}");
    }

    let stray = written_outside(&root, &before, &allowed);
    // The driver log grows, it is not a new path; everything else new must be in the two folders.
    assert!(
        stray.is_empty(),
        "written outside the CDI, state and run folders: {stray:?}"
    );
    assert!(
        !absolute.exists() && !outside.path().join("evil.json").exists(),
        "nothing at the absolute path"
    );
    assert_eq!(
        crash_support::list_dir(outside.path()),
        Vec::<String>::new(),
        "nothing in the folder an absolute UID points at"
    );
    let mut believed = std::collections::BTreeMap::new();
    believed.insert(good.uid.clone(), good_ids);
    node.check_files(&believed)
        .unwrap_or_else(|p| panic!("{p}"));
    assert!(node.is_running(), "the driver is still up");
}

async fn refuses_to_start_on(folder: fn(&CrashNode) -> PathBuf, what: &str) {
    let mut node = CrashNode::new("node-perms", "a100-40gb:1").await;
    let dir = folder(&node);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let started = node.start_driver(None).await;
    let Started::Exited(status) = started else {
        panic!("the driver started on a world-writable {what} folder");
    };
    assert!(!status.success(), "{what}: a failed start: {status}");
    let log = node.log();
    assert!(
        log.contains("writable by others") && log.contains(&dir.display().to_string()),
        "{what}: the log says which folder and why:\n{log}"
    );
    assert!(
        crash_support::list_dir(&dir).is_empty(),
        "{what}: nothing written into the refused folder"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_driver_refuses_a_world_writable_state_folder() {
    refuses_to_start_on(|n| n.dirs.state.clone(), "state").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_driver_refuses_a_world_writable_cdi_folder() {
    refuses_to_start_on(|n| n.dirs.cdi.clone(), "CDI").await;
}

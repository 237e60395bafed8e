//! The emulator driven by the real `kubectl` (skipped, with a message, where kubectl is not installed).

use std::path::{Path, PathBuf};
use std::process::Output;

use gpupool_api::crd::GpuModel;
use gpupool_apiserver::ApiServer;
use kube::CustomResourceExt;
use serde_json::json;

const OBJECTS: &str = r#"
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata:
  name: gpupool.dev
spec:
  selectors:
  - cel:
      expression: device.driver == "gpupool.dev"
---
apiVersion: resource.k8s.io/v1
kind: ResourceSlice
metadata:
  name: node-a-gpupool.dev
spec:
  driver: gpupool.dev
  nodeName: node-a
  pool:
    name: node-a
    generation: 1
    resourceSliceCount: 1
  devices:
  - name: gpu-0
    allowMultipleAllocations: true
    attributes:
      productName: {string: "NVIDIA A100-SXM4-40GB"}
      driverVersion: {version: "550.54.15"}
    capacity:
      memory:
        value: 40Gi
        requestPolicy:
          default: 40Gi
          validRange: {min: 1Mi, step: 1Mi}
      cores:
        value: "100"
        requestPolicy:
          default: "0"
          validRange: {min: "0", max: "100", step: "1"}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata:
  name: claim-a
  namespace: default
spec:
  devices:
    requests:
    - name: gpu
      exactly:
        deviceClassName: gpupool.dev
        capacity:
          requests:
            memory: 8Gi
"#;

fn kubectl_available() -> bool {
    match std::process::Command::new("kubectl")
        .args(["version", "--client"])
        .output()
    {
        Ok(out) if out.status.success() => true,
        Ok(out) => {
            eprintln!(
                "SKIP: `kubectl version --client` failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            false
        }
        Err(e) => {
            eprintln!(
                "SKIP: kubectl is not installed ({e}); the kubectl tests need the real kubectl"
            );
            false
        }
    }
}

struct Kubectl {
    kubeconfig: PathBuf,
    _dir: tempfile::TempDir,
}

/// A fresh emulator and a kubectl for it; None (the test is skipped) without kubectl.
async fn start() -> Option<(ApiServer, Kubectl)> {
    if !kubectl_available() {
        return None;
    }
    let server = ApiServer::start().await.unwrap();
    let kubectl = Kubectl::new(&server);
    Some((server, kubectl))
}

#[track_caller]
fn assert_contains(text: &str, expected: &str) {
    assert!(text.contains(expected), "{text}");
}

/// The cells of a table's header and of its first row.
fn header_and_first_row(table: &str) -> (Vec<&str>, Vec<&str>) {
    let mut lines = table.lines().map(|l| l.split_whitespace().collect());
    (lines.next().unwrap(), lines.next().unwrap())
}

impl Kubectl {
    fn new(server: &ApiServer) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let kubeconfig = dir.path().join("kubeconfig");
        server.write_kubeconfig(&kubeconfig).unwrap();
        Kubectl {
            kubeconfig,
            _dir: dir,
        }
    }

    fn file(&self, name: &str, content: &str) -> PathBuf {
        let path = self._dir.path().join(name);
        std::fs::write(&path, content).unwrap();
        path
    }

    async fn run(&self, args: &[&str]) -> Output {
        tokio::process::Command::new("kubectl")
            .args(args)
            .env("KUBECONFIG", &self.kubeconfig)
            .env_remove("KUBERNETES_SERVICE_HOST")
            .output()
            .await
            .expect("kubectl runs")
    }

    /// Runs kubectl and returns stdout, failing the test with stderr when kubectl fails.
    async fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args).await;
        assert!(
            out.status.success(),
            "kubectl {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// `kubectl apply -f <file>`; returns stdout.
    async fn apply(&self, file: &Path) -> String {
        self.ok(&["apply", "-f", path_str(file)]).await
    }

    /// `kubectl apply -f <file>` expecting failure; returns stderr.
    async fn apply_fails(&self, file: &Path) -> String {
        self.fails(&["apply", "-f", path_str(file)]).await
    }

    /// Runs kubectl expecting failure; returns stderr.
    async fn fails(&self, args: &[&str]) -> String {
        let out = self.run(args).await;
        assert!(
            !out.status.success(),
            "kubectl {args:?} should fail, printed {}",
            String::from_utf8_lossy(&out.stdout)
        );
        String::from_utf8(out.stderr).unwrap()
    }
}

fn path_str(path: &Path) -> &str {
    path.to_str().unwrap()
}

#[tokio::test]
async fn kubectl_apply_get_describe_delete() {
    let Some((server, kubectl)) = start().await else {
        return;
    };
    let manifest = kubectl.file("objects.yaml", OBJECTS);

    let applied = kubectl.apply(&manifest).await;
    for created in [
        "deviceclass.resource.k8s.io/gpupool.dev created",
        "resourceslice.resource.k8s.io/node-a-gpupool.dev created",
        "resourceclaim.resource.k8s.io/claim-a created",
    ] {
        assert_contains(&applied, created);
    }
    let again = kubectl.apply(&manifest).await;
    assert_contains(&again, "resourceclaim.resource.k8s.io/claim-a unchanged");
    let relabelled = kubectl.file(
        "relabelled.yaml",
        &OBJECTS.replace(
            "  name: claim-a\n",
            "  name: claim-a\n  labels:\n    team: ml\n",
        ),
    );
    let reapplied = kubectl.apply(&relabelled).await;
    assert_contains(
        &reapplied,
        "resourceclaim.resource.k8s.io/claim-a configured",
    );
    // A claim's spec is immutable, as on a real cluster.
    let changed = kubectl.file(
        "changed.yaml",
        &OBJECTS.replace("memory: 8Gi", "memory: 4Gi"),
    );
    let stderr = kubectl.apply_fails(&changed).await;
    assert_contains(&stderr, "spec: Invalid value: field is immutable");

    let table = kubectl.ok(&["get", "resourceslices"]).await;
    let (header, row) = header_and_first_row(&table);
    assert_eq!(header, ["NAME", "NODE", "DRIVER", "POOL", "AGE"]);
    assert_eq!(
        row[..4],
        ["node-a-gpupool.dev", "node-a", "gpupool.dev", "node-a"]
    );

    let yaml = kubectl.ok(&["get", "resourceslices", "-o", "yaml"]).await;
    for field in [
        "driver: gpupool.dev",
        "productName:",
        "resourceSliceCount: 1",
    ] {
        assert_contains(&yaml, field);
    }

    let claims = kubectl.ok(&["get", "resourceclaims"]).await;
    assert!(
        claims.contains("claim-a") && claims.contains("pending"),
        "{claims}"
    );

    // Allocate the claim the way the scheduler does: through the status subresource.
    let status = json!({"status": {
        "allocation": {"devices": {"results": [{"request": "gpu", "driver": "gpupool.dev", "pool": "node-a",
            "device": "gpu-0", "shareID": "6f1c1f9e-3c0e-4b43-9d59-1c2b3f4a5b6c",
            "consumedCapacity": {"memory": "4Gi", "cores": "0"}}]}},
        "reservedFor": [{"resource": "pods", "name": "trainer", "uid": "0c6e8c3e-0000-4000-8000-000000000001"}]
    }});
    let patched = kubectl
        .ok(&[
            "patch",
            "resourceclaim",
            "claim-a",
            "--subresource=status",
            "--type=merge",
            "-p",
            &status.to_string(),
        ])
        .await;
    assert_contains(&patched, "patched");
    let claims = kubectl.ok(&["get", "resourceclaims"]).await;
    assert_contains(&claims, "allocated,reserved");

    let described = kubectl.ok(&["describe", "resourceclaim", "claim-a"]).await;
    for expected in [
        "Allocation:",
        "Device:",
        "gpu-0",
        "node-a",
        "Share ID:",
        "Reserved For:",
        "trainer",
        "Events:",
    ] {
        assert!(
            described.contains(expected),
            "describe lacks {expected:?}:\n{described}"
        );
    }
    assert!(
        server.requests().iter().any(|r| r
            .path
            .starts_with("/api/v1/namespaces/default/events?fieldSelector=")),
        "describe asks for the claim's events"
    );

    let deleted = kubectl.ok(&["delete", "-f", path_str(&manifest)]).await;
    assert_contains(
        &deleted,
        "resourceslice.resource.k8s.io \"node-a-gpupool.dev\" deleted",
    );
    let empty = kubectl.run(&["get", "resourceslices"]).await;
    assert!(String::from_utf8_lossy(&empty.stderr).contains("No resources found"));
}

fn slice_with_devices(devices: serde_json::Value) -> String {
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "bad"},
        "spec": {"driver": "gpupool.dev", "nodeName": "node-a",
                 "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1}, "devices": devices}
    })
    .to_string()
}

#[tokio::test]
async fn kubectl_apply_refuses_invalid_slices_naming_the_field() {
    let Some((_server, kubectl)) = start().await else {
        return;
    };

    let too_many: Vec<_> = (0..129)
        .map(|i| json!({"name": format!("gpu-{i}")}))
        .collect();
    let long_name = "a".repeat(40);
    let long_attribute = format!("spec.devices[0].attributes[{long_name}]");
    let cases = [
        (
            "too-many.json",
            json!(too_many),
            "spec.devices: Too many: 129: must have at most 128 items",
        ),
        (
            "long-attribute.json",
            json!([{"name": "gpu-0", "attributes": {long_name.clone(): {"int": 1}}}]),
            long_attribute.as_str(),
        ),
        (
            "off-step.json",
            json!([{"name": "gpu-0", "capacity": {"memory": {"value": "40Gi",
                "requestPolicy": {"default": "1500Ki", "validRange": {"min": "1Mi", "step": "1Mi"}}}}}]),
            "spec.devices[0].capacity[memory].requestPolicy.default",
        ),
        (
            "unknown-field.json",
            json!([{"name": "gpu-0", "colour": "green"}]),
            "unknown field \"spec.devices[0].colour\"",
        ),
    ];
    for (name, devices, expected) in cases {
        let file = kubectl.file(name, &slice_with_devices(devices));
        assert_contains(&kubectl.apply_fails(&file).await, expected);
    }

    let listed = kubectl.run(&["get", "resourceslices"]).await;
    assert!(
        String::from_utf8_lossy(&listed.stderr).contains("No resources found"),
        "nothing was stored"
    );
}

#[tokio::test]
async fn kubectl_gets_custom_resources_with_printer_columns() {
    let Some((_server, kubectl)) = start().await else {
        return;
    };
    let crd = kubectl.file(
        "crd.yaml",
        &serde_yaml::to_string(&GpuModel::crd()).unwrap(),
    );
    let out = kubectl.apply(&crd).await;
    assert_contains(&out, "gpumodels.gpupool.dev created");
    let model = kubectl.file(
        "model.yaml",
        "apiVersion: gpupool.dev/v1alpha1\nkind: GpuModel\nmetadata:\n  name: a100\nspec:\n  model: A100-SXM4-40GB\n  computeWeight: 312\n",
    );
    let out = kubectl.apply(&model).await;
    assert_contains(&out, "gpumodel.gpupool.dev/a100 created");
    kubectl
        .ok(&[
            "patch",
            "gpumodel",
            "a100",
            "--subresource=status",
            "--type=merge",
            "-p",
            r#"{"status":{"devices":4,"nodes":2,"memory":"160Gi"}}"#,
        ])
        .await;

    let table = kubectl.ok(&["get", "gpumodels"]).await;
    let (header, row) = header_and_first_row(&table);
    assert_eq!(
        header[..5],
        ["NAME", "MODEL", "WEIGHT", "DEVICES", "NODES"],
        "{table}"
    );
    assert_eq!(
        row[..6],
        ["a100", "A100-SXM4-40GB", "312", "4", "2", "160Gi"],
        "{table}"
    );
    let short = kubectl
        .ok(&["get", "gm", "a100", "-o", "jsonpath={.spec.computeWeight}"])
        .await;
    assert_eq!(short, "312");
}

#[tokio::test]
async fn kubectl_create_sends_protobuf_that_is_understood() {
    let Some((_server, kubectl)) = start().await else {
        return;
    };
    kubectl.ok(&["create", "namespace", "team-a"]).await;
    kubectl
        .ok(&[
            "-n",
            "team-a",
            "create",
            "configmap",
            "cfg",
            "--from-literal=weight=312",
        ])
        .await;
    let weight = kubectl
        .ok(&[
            "-n",
            "team-a",
            "get",
            "configmap",
            "cfg",
            "-o",
            "jsonpath={.data.weight}",
        ])
        .await;
    assert_eq!(weight, "312");
    let stderr = kubectl
        .fails(&["-n", "nowhere", "create", "configmap", "cfg"])
        .await;
    assert_contains(&stderr, "namespaces \"nowhere\" not found");
    kubectl.ok(&["delete", "namespace", "team-a"]).await;
    let gone = kubectl.run(&["get", "configmaps", "-A"]).await;
    assert!(String::from_utf8_lossy(&gone.stderr).contains("No resources found"));
}

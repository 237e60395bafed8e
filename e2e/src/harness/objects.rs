//! Manifests the scenarios create: a DeviceClass for all gpupool GPUs, claims pinned to one device
//! (so scenarios sharing a cluster never compete for a card), and pods that use claims.

use std::fmt::Write as _;

/// DeviceClass the scenarios use: every gpupool GPU (independent of the controller's classes).
pub const E2E_CLASS: &str = "e2e.gpupool.dev";

pub fn device_class_yaml() -> String {
    format!(
        "apiVersion: resource.k8s.io/v1\nkind: DeviceClass\nmetadata:\n  name: {E2E_CLASS}\nspec:\n  selectors:\n  \
         - cel:\n      expression: device.driver == \"gpupool.dev\"\n"
    )
}

/// One request of a claim: pinned to the device with `uuid` (any gpupool GPU when `None`), with an
/// optional capacity request.
#[derive(Clone, Debug, Default)]
pub struct Request {
    pub name: String,
    pub uuid: Option<String>,
    pub memory: Option<String>,
    pub cores: Option<String>,
    /// GpuConfig parameters for this request (`apiVersion`/`kind` are added), as claim config.
    pub gpu_config: Option<serde_json::Value>,
}

impl Request {
    pub fn new(name: &str) -> Self {
        Request {
            name: name.to_string(),
            ..Default::default()
        }
    }

    pub fn on(mut self, uuid: &str) -> Self {
        self.uuid = Some(uuid.to_string());
        self
    }

    pub fn memory(mut self, quantity: &str) -> Self {
        self.memory = Some(quantity.to_string());
        self
    }

    pub fn cores(mut self, percent: &str) -> Self {
        self.cores = Some(percent.to_string());
        self
    }

    pub fn gpu_config(mut self, parameters: serde_json::Value) -> Self {
        self.gpu_config = Some(parameters);
        self
    }
}

/// A ResourceClaim with one `exactly` request per entry.
pub fn claim_yaml(name: &str, requests: &[Request]) -> String {
    format!(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata:\n  name: {name}\nspec:\n{}",
        claim_spec_yaml(requests)
    )
}

/// A ResourceClaimTemplate whose claims are `claim_yaml`'s of `requests`.
pub fn claim_template_yaml(name: &str, requests: &[Request]) -> String {
    let spec: String = claim_spec_yaml(requests)
        .lines()
        .map(|line| format!("  {line}\n"))
        .collect();
    format!(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaimTemplate\nmetadata:\n  name: {name}\nspec:\n  spec:\n{spec}"
    )
}

/// The `spec` of a claim, indented for a claim's top level.
fn claim_spec_yaml(requests: &[Request]) -> String {
    let mut out = String::from("  devices:\n    requests:\n");
    for r in requests {
        let _ = write!(
            out,
            "    - name: {}\n      exactly:\n        deviceClassName: {E2E_CLASS}\n        allocationMode: ExactCount\n        count: 1\n",
            r.name
        );
        if let Some(uuid) = &r.uuid {
            let _ = write!(
                out,
                "        selectors:\n        - cel:\n            expression: device.driver == \"gpupool.dev\" && has(device.attributes[\"gpupool.dev\"].uuid) && device.attributes[\"gpupool.dev\"].uuid == \"{uuid}\"\n"
            );
        }
        if r.memory.is_some() || r.cores.is_some() {
            out.push_str("        capacity:\n          requests:\n");
            if let Some(memory) = &r.memory {
                let _ = writeln!(out, "            memory: {memory}");
            }
            if let Some(cores) = &r.cores {
                let _ = writeln!(out, "            cores: \"{cores}\"");
            }
        }
    }
    let configs: Vec<&Request> = requests.iter().filter(|r| r.gpu_config.is_some()).collect();
    if !configs.is_empty() {
        out.push_str("    config:\n");
        for r in configs {
            let mut parameters = serde_json::json!({
                "apiVersion": gpupool_api::names::API_GROUP_VERSION,
                "kind": "GpuConfig",
            });
            if let (Some(target), Some(serde_json::Value::Object(fields))) =
                (parameters.as_object_mut(), r.gpu_config.clone())
            {
                target.extend(fields);
            }
            // JSON is YAML: the parameters go in flow style, exactly as given.
            let _ = write!(
                out,
                "    - requests: [{}]\n      opaque:\n        driver: {}\n        parameters: {parameters}\n",
                r.name,
                gpupool_api::names::DRIVER_NAME
            );
        }
    }
    out
}

/// A pod whose one container uses the named claims.
pub fn pod_yaml(name: &str, claims: &[&str]) -> String {
    let claims: Vec<(String, String)> = claims
        .iter()
        .enumerate()
        .map(|(i, claim)| (format!("c{i}"), format!("resourceClaimName: {claim}")))
        .collect();
    pod_with_claims(name, &claims)
}

/// A pod whose one container uses one claim, `gpu`, made from the ResourceClaimTemplate `template`.
pub fn template_pod_yaml(name: &str, template: &str) -> String {
    let claim = (
        "gpu".to_string(),
        format!("resourceClaimTemplateName: {template}"),
    );
    pod_with_claims(name, &[claim])
}

/// A pod whose one container uses `claims`: (the pod's name for it, where it comes from).
fn pod_with_claims(name: &str, claims: &[(String, String)]) -> String {
    let mut out = format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\nspec:\n  restartPolicy: Never\n  resourceClaims:\n"
    );
    for (entry, source) in claims {
        let _ = write!(out, "  - name: {entry}\n    {source}\n");
    }
    out.push_str(
        "  containers:\n  - name: main\n    image: busybox:1.36\n    command: [\"sleep\", \"3600\"]\n    resources:\n      claims:\n",
    );
    for (entry, _) in claims {
        let _ = writeln!(out, "      - name: {entry}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Pod;
    use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim};

    #[test]
    fn manifests_parse_as_the_kubernetes_types_with_what_was_asked() {
        let _: DeviceClass = serde_yaml::from_str(&device_class_yaml()).unwrap();
        let claim: ResourceClaim = serde_yaml::from_str(&claim_yaml(
            "c",
            &[
                Request::new("a").on("GPU-1").memory("8Gi").cores("50"),
                Request::new("b"),
            ],
        ))
        .unwrap();
        let requests = claim.spec.devices.unwrap().requests.unwrap();
        let a = requests[0].exactly.as_ref().unwrap();
        let cel = &a.selectors.as_ref().unwrap()[0]
            .cel
            .as_ref()
            .unwrap()
            .expression;
        // MIG devices carry no uuid before they exist: without has() the class's MIG devices make
        // the whole selector fail with "no such key".
        assert_eq!(cel, "device.driver == \"gpupool.dev\" && has(device.attributes[\"gpupool.dev\"].uuid) && device.attributes[\"gpupool.dev\"].uuid == \"GPU-1\"");
        let capacity = a.capacity.as_ref().unwrap().requests.as_ref().unwrap();
        assert_eq!(capacity["memory"].0, "8Gi");
        assert_eq!(capacity["cores"].0, "50");
        assert!(requests[1].exactly.as_ref().unwrap().capacity.is_none());

        let claim: ResourceClaim = serde_yaml::from_str(&claim_yaml(
            "c",
            &[Request::new("a").gpu_config(serde_json::json!({"memoryLimt": "1Gi"}))],
        ))
        .unwrap();
        let config = &claim.spec.devices.unwrap().config.unwrap()[0];
        assert_eq!(config.requests.as_deref(), Some(&["a".to_string()][..]));
        let opaque = config.opaque.as_ref().unwrap();
        assert_eq!(opaque.driver, "gpupool.dev");
        assert_eq!(
            opaque.parameters.0,
            serde_json::json!({"apiVersion": "gpupool.dev/v1alpha1", "kind": "GpuConfig", "memoryLimt": "1Gi"})
        );
        let pod: Pod = serde_yaml::from_str(&pod_yaml("p", &["x", "y"])).unwrap();
        let spec = pod.spec.unwrap();
        assert_eq!(
            spec.resource_claims.unwrap()[1]
                .resource_claim_name
                .as_deref(),
            Some("y")
        );
        assert_eq!(
            spec.containers[0]
                .resources
                .as_ref()
                .unwrap()
                .claims
                .as_ref()
                .unwrap()
                .len(),
            2
        );
    }
}

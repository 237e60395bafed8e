//! What the kubelet decides about a pod and its claims, without I/O.

use std::collections::BTreeSet;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;

/// The DRA service versions the kubelet emulator can speak.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DraVersion {
    V1,
    V1beta1,
}

impl DraVersion {
    /// The kubelet's short name, as in `PluginInfo.supported_versions`.
    pub fn short_name(self) -> &'static str {
        match self {
            DraVersion::V1 => gpupool_proto::versions::DRA_V1,
            DraVersion::V1beta1 => gpupool_proto::versions::DRA_V1BETA1,
        }
    }

    pub fn from_short_name(name: &str) -> Option<Self> {
        match name {
            gpupool_proto::versions::DRA_V1 => Some(DraVersion::V1),
            gpupool_proto::versions::DRA_V1BETA1 => Some(DraVersion::V1beta1),
            _ => None,
        }
    }
}

/// The first of the kubelet's `known` versions (in the kubelet's order of preference) that the plugin
/// advertises; names the kubelet cannot speak are skipped.
pub fn pick_version(known: &[String], advertised: &[String]) -> Option<DraVersion> {
    known
        .iter()
        .filter(|k| advertised.iter().any(|a| a == *k))
        .find_map(|k| DraVersion::from_short_name(k))
}

/// Names of the ResourceClaims a pod uses, or why they are not known yet.
///
/// A template entry is resolved through `status.resourceClaimStatuses`; an entry there without a
/// claim name means no claim is needed (upstream semantics), so it is skipped.
pub fn pod_claim_names(pod: &Pod) -> Result<Vec<String>, String> {
    let entries = pod
        .spec
        .as_ref()
        .and_then(|s| s.resource_claims.clone())
        .unwrap_or_default();
    let statuses = pod
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.clone())
        .unwrap_or_default();
    let mut names = Vec::new();
    for entry in entries {
        if let Some(name) = entry.resource_claim_name {
            names.push(name);
            continue;
        }
        match statuses.iter().find(|s| s.name == entry.name) {
            Some(status) => names.extend(status.resource_claim_name.clone()),
            None => {
                return Err(format!(
                    "waiting for the claim of pod claim entry {:?} to be created from its template",
                    entry.name
                ))
            }
        }
    }
    // A pod asking for a DRA extended resource (limits: {gpupool.dev/<model>: 1}) has no entry in
    // spec.resourceClaims: the scheduler names the claim it made in the pod's status.
    if let Some(extended) = pod
        .status
        .as_ref()
        .and_then(|s| s.extended_resource_claim_status.as_ref())
    {
        names.push(extended.resource_claim_name.clone());
    }
    Ok(names)
}

/// Whether a claim can be prepared for the pod with `pod_uid`: allocated and reserved for it.
/// `Ok` carries the drivers named in the allocation results.
pub fn claim_ready_for_pod(
    claim: &ResourceClaim,
    pod_uid: &str,
) -> Result<BTreeSet<String>, String> {
    let name = claim.metadata.name.as_deref().unwrap_or_default();
    let status = claim.status.as_ref();
    let Some(allocation) = status.and_then(|s| s.allocation.as_ref()) else {
        return Err(format!("claim {name} is not allocated yet"));
    };
    let reserved = status
        .and_then(|s| s.reserved_for.as_ref())
        .is_some_and(|r| r.iter().any(|c| c.uid == pod_uid));
    if !reserved {
        return Err(format!("claim {name} is not reserved for the pod yet"));
    }
    Ok(allocation
        .devices
        .as_ref()
        .and_then(|d| d.results.as_ref())
        .map(|results| results.iter().map(|r| r.driver.clone()).collect())
        .unwrap_or_default())
}

/// Backoff before retrying a failed prepare: 0.5 s doubling, at most 10 s.
pub fn retry_backoff(attempts: u32) -> std::time::Duration {
    let millis = 500u64.saturating_mul(1u64 << attempts.saturating_sub(1).min(5));
    std::time::Duration::from_millis(millis.min(10_000))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn picks_the_kubelets_first_known_version_the_plugin_serves() {
        let both = strings(&["v1.DRAPlugin", "v1beta1.DRAPlugin"]);
        let advertised = strings(&[
            "v1beta1.DRAPlugin",
            "v1.DRAPlugin",
            "v1alpha1.DRAResourceHealth",
        ]);
        assert_eq!(pick_version(&both, &advertised), Some(DraVersion::V1));
        let old_kubelet = strings(&["v1beta1.DRAPlugin"]);
        assert_eq!(
            pick_version(&old_kubelet, &advertised),
            Some(DraVersion::V1beta1)
        );
        let full_names = strings(&["k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"]);
        assert_eq!(pick_version(&both, &full_names), None);
    }

    #[test]
    fn claim_names_come_from_direct_references_and_template_statuses() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "default", "uid": "u1"},
            "spec": {"containers": [], "resourceClaims": [
                {"name": "direct", "resourceClaimName": "shared-claim"},
                {"name": "tmpl", "resourceClaimTemplateName": "half"},
                {"name": "unneeded", "resourceClaimTemplateName": "x"}
            ]},
            "status": {"resourceClaimStatuses": [
                {"name": "tmpl", "resourceClaimName": "p-tmpl-abcde"},
                {"name": "unneeded"}
            ]}
        }))
        .unwrap();
        assert_eq!(
            pod_claim_names(&pod).unwrap(),
            strings(&["shared-claim", "p-tmpl-abcde"])
        );
    }

    #[test]
    fn an_extended_resource_pod_is_prepared_with_the_claim_the_scheduler_named() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "default", "uid": "u1"},
            "spec": {"containers": [{"name": "c", "resources": {"limits": {"gpupool.dev/a100-sxm4-40gb": "1"}}}]},
            "status": {"extendedResourceClaimStatus": {"resourceClaimName": "p-extended-resources-x2x7k",
                "requestMappings": [{"containerName": "c", "resourceName": "gpupool.dev/a100-sxm4-40gb",
                                     "requestName": "container-0-request-0"}]}}
        }))
        .unwrap();
        assert_eq!(
            pod_claim_names(&pod).unwrap(),
            strings(&["p-extended-resources-x2x7k"])
        );
    }

    #[test]
    fn a_template_claim_not_created_yet_makes_the_pod_wait() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "p"},
            "spec": {"containers": [], "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "t"}]}
        }))
        .unwrap();
        let why = pod_claim_names(&pod).unwrap_err();
        assert!(why.contains("\"gpu\""), "{why}");
    }

    #[test]
    fn a_claim_is_ready_only_when_allocated_and_reserved_for_this_pod() {
        let mut claim: ResourceClaim = serde_json::from_value(json!({
            "metadata": {"name": "c", "namespace": "default", "uid": "cu"},
            "spec": {},
            "status": {"allocation": {"devices": {"results": [
                {"driver": "gpupool.dev", "pool": "node-a", "device": "gpu-0", "request": "gpu"}
            ]}}}
        }))
        .unwrap();
        assert!(claim_ready_for_pod(&claim, "pod-1")
            .unwrap_err()
            .contains("not reserved"));
        claim.status.as_mut().unwrap().reserved_for = Some(vec![serde_json::from_value(
            json!({"resource": "pods", "name": "p", "uid": "pod-1"}),
        )
        .unwrap()]);
        assert_eq!(
            claim_ready_for_pod(&claim, "pod-1").unwrap(),
            BTreeSet::from(["gpupool.dev".to_string()])
        );
        assert!(claim_ready_for_pod(&claim, "pod-2").is_err());
        claim.status.as_mut().unwrap().allocation = None;
        assert!(claim_ready_for_pod(&claim, "pod-1")
            .unwrap_err()
            .contains("not allocated"));
    }

    #[test]
    fn backoff_doubles_and_caps() {
        assert_eq!(retry_backoff(1).as_millis(), 500);
        assert_eq!(retry_backoff(2).as_millis(), 1000);
        assert_eq!(retry_backoff(3).as_millis(), 2000);
        assert_eq!(retry_backoff(30).as_millis(), 10_000);
    }
}

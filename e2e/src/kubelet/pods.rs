//! What the kubelet decides about a pod and its claims, without I/O.

use std::collections::BTreeSet;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::time::Duration;

use gpupool_proto::health_v1alpha1::HealthStatus;
use k8s_openapi::api::core::v1::{
    Container, ContainerState, ContainerStateRunning, ContainerStateTerminated, ContainerStatus,
    Pod, ResourceHealth, ResourceStatus,
};
use k8s_openapi::api::resource::v1::ResourceClaim;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

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

/// The longest wait between two registration attempts on one socket: the kubelet's plugin manager
/// runs registrations through goroutinemap, whose exponential backoff stops at 2m2s.
pub const MAX_REGISTRATION_RETRY: Duration = Duration::from_secs(122);

/// How long the kubelet waits before handshaking again with a registration socket after
/// `failures` failed handshakes in a row: 0.5 s, doubling, at most [`MAX_REGISTRATION_RETRY`].
pub fn registration_retry_delay(failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    Duration::from_millis(500u64 << doublings).min(MAX_REGISTRATION_RETRY)
}

/// The kubelet's word for a device's health in `allocatedResourcesStatus`.
pub fn health_name(health: HealthStatus) -> &'static str {
    match health {
        HealthStatus::Healthy => "Healthy",
        HealthStatus::Unhealthy => "Unhealthy",
        HealthStatus::Unknown => "Unknown",
    }
}

/// The devices the kubelet prepared for one ResourceClaim and their health, as
/// `allocatedResourcesStatus` lists them: the first CDI device id (or `driver/pool/device` when
/// the plugin returned none) and the health the kubelet has for it.
pub fn resource_health(
    driver: &str,
    pool: &str,
    device: &str,
    cdi_ids: &[String],
    health: HealthStatus,
) -> ResourceHealth {
    ResourceHealth {
        resource_id: cdi_ids
            .first()
            .cloned()
            .unwrap_or_else(|| format!("{driver}/{pool}/{device}")),
        health: Some(health_name(health).to_string()),
    }
}

/// `allocatedResourcesStatus` of one container, as a v1.36 kubelet writes it: one entry per
/// `resources.claims[]` entry, named `claim:<name>` (`claim:<name>/<request>` when the container
/// asks for one request only). The v1.36 kubelet finds the ResourceClaim only through
/// `status.resourceClaimStatuses`, so a pod claim that names its ResourceClaim directly
/// (`resourceClaimName`) gets no entry; neither does a claim the kubelet has not prepared
/// (`claim_health` answers `None`) or one without devices.
pub fn allocated_resources_status(
    pod: &Pod,
    container: &Container,
    claim_health: &dyn Fn(&str) -> Option<Vec<ResourceHealth>>,
) -> Vec<ResourceStatus> {
    let generated = pod
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.as_ref());
    let mut out: Vec<ResourceStatus> = Vec::new();
    for claim in container
        .resources
        .as_ref()
        .and_then(|r| r.claims.as_ref())
        .into_iter()
        .flatten()
    {
        let Some(claim_name) = generated
            .into_iter()
            .flatten()
            .find(|s| s.name == claim.name)
            .and_then(|s| s.resource_claim_name.as_deref())
        else {
            continue;
        };
        let Some(resources) = claim_health(claim_name) else {
            continue;
        };
        let name = match claim.request.as_deref().filter(|r| !r.is_empty()) {
            Some(request) => format!("claim:{}/{request}", claim.name),
            None => format!("claim:{}", claim.name),
        };
        out.retain(|s| s.name != name);
        if !resources.is_empty() {
            out.push(ResourceStatus {
                name,
                resources: Some(resources),
            });
        }
    }
    out
}

/// 64 hex digits standing for a digest the runtime would report; the same input gives the same
/// digits, so a status computed again compares equal.
fn fake_digest(parts: &[&str]) -> String {
    (0u8..4)
        .map(|salt| {
            let mut hasher = DefaultHasher::new();
            salt.hash(&mut hasher);
            parts.hash(&mut hasher);
            format!("{:016x}", hasher.finish())
        })
        .collect()
}

fn base_status(pod_uid: &str, container: &Container) -> ContainerStatus {
    let image = container.image.clone().unwrap_or_default();
    ContainerStatus {
        name: container.name.clone(),
        image_id: format!("{image}@sha256:{}", fake_digest(&[&image])),
        image,
        container_id: Some(format!(
            "containerd://{}",
            fake_digest(&[pod_uid, &container.name])
        )),
        restart_count: 0,
        ..Default::default()
    }
}

/// `status.containerStatuses` of a pod whose containers all started at `started_at` and run
/// without readiness trouble: ready, started, running, with the device health of their claims.
pub fn running_container_statuses(
    pod: &Pod,
    started_at: &Time,
    claim_health: &dyn Fn(&str) -> Option<Vec<ResourceHealth>>,
) -> Vec<ContainerStatus> {
    let uid = pod.metadata.uid.as_deref().unwrap_or_default();
    pod.spec
        .iter()
        .flat_map(|s| s.containers.iter())
        .map(|container| {
            let resources = allocated_resources_status(pod, container, claim_health);
            ContainerStatus {
                ready: true,
                started: Some(true),
                state: Some(ContainerState {
                    running: Some(ContainerStateRunning {
                        started_at: Some(started_at.clone()),
                    }),
                    ..Default::default()
                }),
                allocated_resources_status: (!resources.is_empty()).then_some(resources),
                ..base_status(uid, container)
            }
        })
        .collect()
}

/// `status.initContainerStatuses` of a pod that got as far as its regular containers: each init
/// container ran to completion, except sidecars (`restartPolicy: Always`), which keep running.
pub fn init_container_statuses(pod: &Pod, started_at: &Time) -> Vec<ContainerStatus> {
    let uid = pod.metadata.uid.as_deref().unwrap_or_default();
    pod.spec
        .iter()
        .flat_map(|s| s.init_containers.iter().flatten())
        .map(|container| {
            let sidecar = container.restart_policy.as_deref() == Some("Always");
            let state = if sidecar {
                ContainerState {
                    running: Some(ContainerStateRunning {
                        started_at: Some(started_at.clone()),
                    }),
                    ..Default::default()
                }
            } else {
                ContainerState {
                    terminated: Some(ContainerStateTerminated {
                        exit_code: 0,
                        reason: Some("Completed".into()),
                        started_at: Some(started_at.clone()),
                        finished_at: Some(started_at.clone()),
                        container_id: None,
                        ..Default::default()
                    }),
                    ..Default::default()
                }
            };
            ContainerStatus {
                ready: sidecar,
                started: Some(sidecar),
                state: Some(state),
                ..base_status(uid, container)
            }
        })
        .collect()
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
    fn registration_retries_double_from_half_a_second_to_the_kubelets_cap() {
        let delays: Vec<u128> = (1..=10)
            .map(|n| registration_retry_delay(n).as_millis())
            .collect();
        assert_eq!(
            delays,
            [500, 1000, 2000, 4000, 8000, 16_000, 32_000, 64_000, 122_000, 122_000]
        );
        assert_eq!(registration_retry_delay(u32::MAX), MAX_REGISTRATION_RETRY);
    }

    fn health_pod() -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "default", "uid": "pod-uid"},
            "spec": {
                "initContainers": [
                    {"name": "setup", "image": "busybox"},
                    {"name": "sidecar", "image": "busybox", "restartPolicy": "Always"}
                ],
                "containers": [
                    {"name": "main", "image": "cuda:12", "resources": {"claims": [
                        {"name": "gpu"}, {"name": "direct"}, {"name": "pair", "request": "left"}
                    ]}},
                    {"name": "plain", "image": "busybox"}
                ],
                "resourceClaims": [
                    {"name": "gpu", "resourceClaimTemplateName": "half"},
                    {"name": "direct", "resourceClaimName": "shared"},
                    {"name": "pair", "resourceClaimTemplateName": "two"}
                ]
            },
            "status": {"resourceClaimStatuses": [
                {"name": "gpu", "resourceClaimName": "p-gpu-x1"},
                {"name": "pair", "resourceClaimName": "p-pair-x2"}
            ]}
        }))
        .unwrap()
    }

    #[test]
    fn containers_run_ready_with_the_health_of_their_template_claims() {
        let pod = health_pod();
        let started = Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH);
        let lookup = |claim: &str| -> Option<Vec<ResourceHealth>> {
            match claim {
                "p-gpu-x1" => Some(vec![resource_health(
                    "gpupool.dev",
                    "node-a",
                    "gpu-0",
                    &["gpupool.dev/claim=u1-gpu-0".to_string()],
                    HealthStatus::Healthy,
                )]),
                "p-pair-x2" => Some(vec![resource_health(
                    "gpupool.dev",
                    "node-a",
                    "gpu-1",
                    &[],
                    HealthStatus::Unknown,
                )]),
                "shared" => Some(vec![resource_health(
                    "gpupool.dev",
                    "node-a",
                    "gpu-2",
                    &[],
                    HealthStatus::Healthy,
                )]),
                _ => None,
            }
        };
        let statuses = running_container_statuses(&pod, &started, &lookup);
        let json = serde_json::to_value(&statuses).unwrap();
        assert_eq!(json[0]["name"], "main");
        assert_eq!(json[0]["ready"], true);
        assert_eq!(json[0]["started"], true);
        assert_eq!(json[0]["restartCount"], 0);
        assert_eq!(json[0]["image"], "cuda:12");
        assert_eq!(
            json[0]["state"]["running"]["startedAt"],
            "1970-01-01T00:00:00Z"
        );
        // The v1.36 kubelet resolves claims through status.resourceClaimStatuses only: the
        // directly named claim gets no entry.
        assert_eq!(
            json[0]["allocatedResourcesStatus"],
            json!([
                {"name": "claim:gpu", "resources": [
                    {"resourceID": "gpupool.dev/claim=u1-gpu-0", "health": "Healthy"}]},
                {"name": "claim:pair/left", "resources": [
                    {"resourceID": "gpupool.dev/node-a/gpu-1", "health": "Unknown"}]}
            ])
        );
        assert_eq!(json[1]["name"], "plain");
        assert_eq!(json[1]["ready"], true);
        assert!(json[1].get("allocatedResourcesStatus").is_none(), "{json}");
        assert_ne!(json[0]["containerID"], json[1]["containerID"]);
        // The same pod gives the same statuses: nothing is written again without a change.
        assert_eq!(
            statuses,
            running_container_statuses(&pod, &started, &lookup)
        );

        let init = serde_json::to_value(init_container_statuses(&pod, &started)).unwrap();
        assert_eq!(init[0]["state"]["terminated"]["reason"], "Completed");
        assert_eq!(init[0]["ready"], false);
        assert_eq!(
            init[1]["state"]["running"]["startedAt"],
            "1970-01-01T00:00:00Z"
        );
        assert_eq!(init[1]["ready"], true);
    }

    #[test]
    fn a_claim_the_kubelet_did_not_prepare_has_no_entry() {
        let pod = health_pod();
        let container = &pod.spec.as_ref().unwrap().containers[0];
        assert!(allocated_resources_status(&pod, container, &|_| None).is_empty());
        assert!(allocated_resources_status(&pod, container, &|_| Some(Vec::new())).is_empty());
    }

    #[test]
    fn backoff_doubles_and_caps() {
        assert_eq!(retry_backoff(1).as_millis(), 500);
        assert_eq!(retry_backoff(2).as_millis(), 1000);
        assert_eq!(retry_backoff(3).as_millis(), 2000);
        assert_eq!(retry_backoff(30).as_millis(), 10_000);
    }
}

//! What the resourceclaim controller and the scheduler derive from a pod, pure: the claims
//! generated from its templates or its extended-resource limits, and which claims it uses.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{ContainerExtendedResourceRequest, Pod, PodResourceClaim};
use k8s_openapi::api::resource::v1::{
    DeviceClaim, DeviceClass, DeviceRequest, ExactDeviceRequest, ResourceClaim, ResourceClaimSpec,
    ResourceClaimTemplate,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use thiserror::Error;

/// Annotation naming the pod's `resourceClaims[]` entry a generated claim was made for.
pub const POD_CLAIM_NAME_ANNOTATION: &str = "resource.kubernetes.io/pod-claim-name";
/// Annotation marking the claim the scheduler generated for a pod's extended resources.
pub const EXTENDED_RESOURCE_CLAIM_ANNOTATION: &str =
    "resource.kubernetes.io/extended-resource-claim";
/// Extended resource name every DeviceClass answers to without declaring one.
pub const IMPLICIT_EXTENDED_RESOURCE_PREFIX: &str = "deviceclass.resource.kubernetes.io/";

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum ClaimsError {
    #[error("pod {pod}: spec.resourceClaims[{entry}] names neither resourceClaimName nor resourceClaimTemplateName")]
    NoSource { pod: String, entry: String },
    #[error("pod {pod}: container {container} asks for {resource}: {quantity:?} is not a whole positive number")]
    BadCount {
        pod: String,
        container: String,
        resource: String,
        quantity: String,
    },
}

fn pod_key(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or_default(),
        pod.metadata.name.as_deref().unwrap_or_default()
    )
}

fn owner(pod: &Pod) -> OwnerReference {
    OwnerReference {
        api_version: "v1".to_string(),
        kind: "Pod".to_string(),
        name: pod.metadata.name.clone().unwrap_or_default(),
        uid: pod.metadata.uid.clone().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    }
}

/// Whether `claim` was generated for the pod with `pod_uid`.
pub fn owned_by(claim: &ResourceClaim, pod_uid: &str) -> bool {
    claim
        .metadata
        .owner_references
        .iter()
        .flatten()
        .any(|o| o.kind == "Pod" && o.uid == pod_uid)
}

/// The requests of `claim`.
pub fn requests_of(claim: &ResourceClaim) -> &[DeviceRequest] {
    claim
        .spec
        .devices
        .as_ref()
        .and_then(|d| d.requests.as_deref())
        .unwrap_or_default()
}

/// Whether `claim` has an allocation.
pub fn is_allocated(claim: &ResourceClaim) -> bool {
    claim
        .status
        .as_ref()
        .is_some_and(|s| s.allocation.is_some())
}

/// The uid of the pod a claim was generated for, if any.
pub fn owner_pod_uid(claim: &ResourceClaim) -> Option<&str> {
    claim
        .metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.kind == "Pod" && o.controller == Some(true))
        .map(|o| o.uid.as_str())
}

/// A new claim with `metadata` that asks for `requests`.
pub(crate) fn claim_for_requests(
    metadata: ObjectMeta,
    requests: Vec<DeviceRequest>,
) -> ResourceClaim {
    ResourceClaim {
        metadata,
        spec: ResourceClaimSpec {
            devices: Some(DeviceClaim {
                requests: Some(requests),
                ..Default::default()
            }),
        },
        status: None,
    }
}

/// The claim the resourceclaim controller creates for a pod's template entry.
pub fn claim_from_template(
    pod: &Pod,
    entry: &PodResourceClaim,
    template: &ResourceClaimTemplate,
) -> ResourceClaim {
    let pod_name = pod.metadata.name.as_deref().unwrap_or_default();
    // Upstream keeps the generated base name short enough for the random suffix.
    let mut base = format!("{pod_name}-{}", entry.name);
    base.truncate(57);
    let template_meta = template.spec.metadata.clone().unwrap_or_default();
    let mut annotations = template_meta.annotations.unwrap_or_default();
    annotations.insert(POD_CLAIM_NAME_ANNOTATION.to_string(), entry.name.clone());
    ResourceClaim {
        metadata: ObjectMeta {
            generate_name: Some(format!("{base}-")),
            namespace: pod.metadata.namespace.clone(),
            labels: template_meta.labels,
            annotations: Some(annotations),
            owner_references: Some(vec![owner(pod)]),
            ..Default::default()
        },
        spec: template.spec.spec.clone(),
        status: None,
    }
}

/// How a pod refers to each of its claims.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimSource {
    /// `resourceClaimName`: a claim the user created.
    Named(String),
    /// `resourceClaimTemplateName`: generated; `existing` is the claim already made for it.
    Template {
        template: String,
        existing: Option<String>,
    },
}

/// Each `spec.resourceClaims[]` entry of the pod with its source; a generated claim is found
/// through `status.resourceClaimStatuses`, or by owner and annotation when the status was not
/// written yet.
pub fn pod_claim_sources(
    pod: &Pod,
    claims: &[ResourceClaim],
) -> Result<Vec<(PodResourceClaim, ClaimSource)>, ClaimsError> {
    let pod_uid = pod.metadata.uid.as_deref().unwrap_or_default();
    let statuses = pod
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.as_deref())
        .unwrap_or_default();
    let mut out = Vec::new();
    for entry in pod
        .spec
        .as_ref()
        .and_then(|s| s.resource_claims.as_deref())
        .unwrap_or_default()
    {
        let source = if let Some(name) = &entry.resource_claim_name {
            ClaimSource::Named(name.clone())
        } else if let Some(template) = &entry.resource_claim_template_name {
            let from_status = statuses
                .iter()
                .find(|s| s.name == entry.name)
                .and_then(|s| s.resource_claim_name.clone());
            let by_owner = || {
                claims
                    .iter()
                    .find(|c| {
                        owned_by(c, pod_uid)
                            && c.metadata
                                .annotations
                                .as_ref()
                                .and_then(|a| a.get(POD_CLAIM_NAME_ANNOTATION))
                                == Some(&entry.name)
                    })
                    .and_then(|c| c.metadata.name.clone())
            };
            ClaimSource::Template {
                template: template.clone(),
                existing: from_status.or_else(by_owner),
            }
        } else {
            return Err(ClaimsError::NoSource {
                pod: pod_key(pod),
                entry: entry.name.clone(),
            });
        };
        out.push((entry.clone(), source));
    }
    Ok(out)
}

/// The claim the scheduler generates for extended resources served by DeviceClasses
/// (`limits: {gpupool.dev/a100: 1}`), with the pod status mappings; None when the pod asks
/// for none.
pub fn extended_resource_claim(
    pod: &Pod,
    classes: &[DeviceClass],
) -> Result<Option<(ResourceClaim, Vec<ContainerExtendedResourceRequest>)>, ClaimsError> {
    let class_for = |resource: &str| {
        classes.iter().find(|c| {
            c.spec.extended_resource_name.as_deref() == Some(resource)
                || resource.strip_prefix(IMPLICIT_EXTENDED_RESOURCE_PREFIX)
                    == c.metadata.name.as_deref()
        })
    };
    let mut requests = Vec::new();
    let mut mappings = Vec::new();
    let containers = pod
        .spec
        .as_ref()
        .map(|s| s.containers.as_slice())
        .unwrap_or_default();
    for (index, container) in containers.iter().enumerate() {
        let resources = container.resources.as_ref();
        let mut wanted: BTreeMap<&String, _> = BTreeMap::new();
        for list in [
            resources.and_then(|r| r.requests.as_ref()),
            resources.and_then(|r| r.limits.as_ref()),
        ]
        .into_iter()
        .flatten()
        {
            wanted.extend(list.iter());
        }
        let mut request_index = 0;
        for (resource, quantity) in wanted {
            let Some(class) = class_for(resource) else {
                continue;
            };
            let count = gpupool_api::quantity::parse(&quantity.0)
                .ok()
                .filter(|m| m.0 > 0 && m.0 % 1000 == 0)
                .map(|m| (m.0 / 1000) as i64)
                .ok_or_else(|| ClaimsError::BadCount {
                    pod: pod_key(pod),
                    container: container.name.clone(),
                    resource: resource.clone(),
                    quantity: quantity.0.clone(),
                })?;
            let request_name = format!("container-{index}-request-{request_index}");
            request_index += 1;
            requests.push(DeviceRequest {
                name: request_name.clone(),
                exactly: Some(ExactDeviceRequest {
                    device_class_name: class.metadata.name.clone().unwrap_or_default(),
                    allocation_mode: Some("ExactCount".to_string()),
                    count: Some(count),
                    ..Default::default()
                }),
                first_available: None,
            });
            mappings.push(ContainerExtendedResourceRequest {
                container_name: container.name.clone(),
                request_name,
                resource_name: resource.clone(),
            });
        }
    }
    if requests.is_empty() {
        return Ok(None);
    }
    let pod_name = pod.metadata.name.as_deref().unwrap_or_default();
    let mut annotations = BTreeMap::new();
    annotations.insert(
        EXTENDED_RESOURCE_CLAIM_ANNOTATION.to_string(),
        "true".to_string(),
    );
    let claim = claim_for_requests(
        ObjectMeta {
            generate_name: Some(format!("{pod_name}-extended-resources-")),
            namespace: pod.metadata.namespace.clone(),
            annotations: Some(annotations),
            owner_references: Some(vec![owner(pod)]),
            ..Default::default()
        },
        requests,
    );
    Ok(Some((claim, mappings)))
}

/// Whether a claim is the extended-resource claim of some pod.
pub fn is_extended_resource_claim(claim: &ResourceClaim) -> bool {
    claim
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(EXTENDED_RESOURCE_CLAIM_ANNOTATION))
        .is_some_and(|v| v == "true")
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{
        Container, PodResourceClaimStatus, PodSpec, PodStatus, ResourceRequirements,
    };
    use k8s_openapi::api::resource::v1::ResourceClaimTemplateSpec;
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    fn pod(entries: Vec<PodResourceClaim>, limits: &[(&str, &str)]) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some("trainer".into()),
                namespace: Some("ml".into()),
                uid: Some("pod-uid".into()),
                ..Default::default()
            },
            spec: Some(PodSpec {
                resource_claims: Some(entries),
                containers: vec![Container {
                    name: "main".into(),
                    resources: Some(ResourceRequirements {
                        limits: Some(
                            limits
                                .iter()
                                .map(|(k, v)| (k.to_string(), Quantity(v.to_string())))
                                .collect(),
                        ),
                        ..Default::default()
                    }),
                    ..Default::default()
                }],
                ..Default::default()
            }),
            status: None,
        }
    }

    fn entry(name: &str, template: &str) -> PodResourceClaim {
        PodResourceClaim {
            name: name.into(),
            resource_claim_template_name: Some(template.into()),
            resource_claim_name: None,
        }
    }

    #[test]
    fn a_template_claim_is_owned_by_and_annotated_for_its_pod() {
        let template = ResourceClaimTemplate {
            metadata: ObjectMeta {
                name: Some("half-a100".into()),
                ..Default::default()
            },
            spec: ResourceClaimTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some([("team".to_string(), "ml".to_string())].into()),
                    ..Default::default()
                }),
                spec: crate::fixtures::claim(
                    "x",
                    vec![crate::fixtures::exact("gpu", crate::fixtures::A100, &[])],
                )
                .spec,
            },
        };
        let p = pod(vec![entry("gpu", "half-a100")], &[]);
        let claim = claim_from_template(
            &p,
            &p.spec.as_ref().unwrap().resource_claims.as_ref().unwrap()[0],
            &template,
        );
        assert_eq!(
            claim.metadata.generate_name.as_deref(),
            Some("trainer-gpu-")
        );
        assert_eq!(claim.metadata.namespace.as_deref(), Some("ml"));
        assert_eq!(
            claim.metadata.annotations.as_ref().unwrap()[POD_CLAIM_NAME_ANNOTATION],
            "gpu"
        );
        assert_eq!(claim.metadata.labels.as_ref().unwrap()["team"], "ml");
        assert!(owned_by(&claim, "pod-uid"));
        assert_eq!(claim.spec, template.spec.spec);
    }

    #[test]
    fn generated_claims_are_found_through_status_or_owner() {
        let mut p = pod(vec![entry("gpu", "t"), entry("other", "t")], &[]);
        p.status = Some(PodStatus {
            resource_claim_statuses: Some(vec![PodResourceClaimStatus {
                name: "gpu".into(),
                resource_claim_name: Some("trainer-gpu-abcde".into()),
            }]),
            ..Default::default()
        });
        let mut made = crate::fixtures::claim("trainer-other-xyz12", vec![]);
        made.metadata.owner_references = Some(vec![owner(&p)]);
        made.metadata.annotations =
            Some([(POD_CLAIM_NAME_ANNOTATION.to_string(), "other".to_string())].into());
        let sources = pod_claim_sources(&p, &[made]).unwrap();
        let existing: Vec<_> = sources
            .into_iter()
            .map(|(_, s)| match s {
                ClaimSource::Template { existing, .. } => existing,
                ClaimSource::Named(_) => None,
            })
            .collect();
        assert_eq!(
            existing,
            vec![
                Some("trainer-gpu-abcde".to_string()),
                Some("trainer-other-xyz12".to_string())
            ]
        );
    }

    #[test]
    fn an_entry_without_a_source_is_an_error_naming_it() {
        let mut e = entry("gpu", "t");
        e.resource_claim_template_name = None;
        let err = pod_claim_sources(&pod(vec![e], &[]), &[]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "pod ml/trainer: spec.resourceClaims[gpu] names neither resourceClaimName nor resourceClaimTemplateName"
        );
    }

    #[test]
    fn extended_resources_become_one_claim_with_a_request_per_resource() {
        let mut a100 = crate::fixtures::class(crate::fixtures::A100, &[]);
        a100.spec.extended_resource_name = Some("gpupool.dev/a100".into());
        let classes = vec![a100];
        let p = pod(vec![], &[("gpupool.dev/a100", "2"), ("cpu", "1")]);
        let (claim, mappings) = extended_resource_claim(&p, &classes).unwrap().unwrap();
        assert!(is_extended_resource_claim(&claim));
        let request = &requests_of(&claim)[0];
        let exactly = request.exactly.as_ref().unwrap();
        assert_eq!(
            (
                request.name.as_str(),
                exactly.device_class_name.as_str(),
                exactly.count
            ),
            ("container-0-request-0", crate::fixtures::A100, Some(2))
        );
        assert_eq!(mappings[0].resource_name, "gpupool.dev/a100");
        assert!(
            extended_resource_claim(&pod(vec![], &[("cpu", "1")]), &classes)
                .unwrap()
                .is_none()
        );
        let half = pod(vec![], &[("gpupool.dev/a100", "500m")]);
        assert!(matches!(
            extended_resource_claim(&half, &classes),
            Err(ClaimsError::BadCount { .. })
        ));
    }
}

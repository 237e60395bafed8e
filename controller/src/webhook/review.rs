//! One `admission.k8s.io/v1` AdmissionReview in, its answer out (pure).
//!
//! The object is read as JSON in the version the API server sent it (the webhook registers v1,
//! v1beta2 and v1beta1 of `resource.k8s.io` each, so nothing is converted on the way), and checked
//! by `gpupool_api::admission`, the driver's own parser. A review that is not one (not JSON, another
//! `apiVersion`, no `request.uid`) is a [`ReviewError`], which the server answers with 400: the API
//! server then applies the webhook's failurePolicy, as for any webhook that cannot answer.

use gpupool_api::admission::{check_claim_spec, check_class_spec, RequestLayout};
use gpupool_api::config::ConfigError;
use serde_json::{json, Value};
use thiserror::Error;

pub const REVIEW_API_VERSION: &str = "admission.k8s.io/v1";
pub const RESOURCE_GROUP: &str = "resource.k8s.io";

/// The largest body read. An AdmissionReview of an update carries the object twice (object and
/// oldObject), each at most the API server's own 3 MiB request limit; anything larger is not one.
pub const MAX_BODY_BYTES: usize = 7 * 1024 * 1024;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum ReviewError {
    #[error("not an AdmissionReview: the body is not JSON ({0})")]
    NotJson(String),
    #[error(
        "AdmissionReview apiVersion {0:?} is not served: this webhook speaks {REVIEW_API_VERSION} \
         (set admissionReviewVersions: [v1])"
    )]
    UnknownVersion(String),
    #[error("not an AdmissionReview: kind is {0:?}")]
    NotAReview(String),
    #[error("AdmissionReview without request.uid")]
    NoUid,
}

/// The answer to one review: allowed, or refused with a message for the user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub allowed: bool,
    pub message: Option<String>,
}

impl Decision {
    fn allow() -> Decision {
        Decision {
            allowed: true,
            message: None,
        }
    }

    fn refuse(message: String) -> Decision {
        Decision {
            allowed: false,
            message: Some(message),
        }
    }
}

/// Reads a review and answers it: the response AdmissionReview as JSON, and the decision.
pub fn answer(body: &[u8]) -> Result<(Value, Decision), ReviewError> {
    let review: Value =
        serde_json::from_slice(body).map_err(|e| ReviewError::NotJson(e.to_string()))?;
    let api_version = review
        .get("apiVersion")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if api_version != REVIEW_API_VERSION {
        return Err(ReviewError::UnknownVersion(api_version.to_string()));
    }
    let kind = review
        .get("kind")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if kind != "AdmissionReview" {
        return Err(ReviewError::NotAReview(kind.to_string()));
    }
    let request = review.get("request").unwrap_or(&Value::Null);
    let uid = request
        .get("uid")
        .and_then(Value::as_str)
        .filter(|u| !u.is_empty())
        .ok_or(ReviewError::NoUid)?;
    let decision = decide(request);
    let mut response = json!({"uid": uid, "allowed": decision.allowed});
    if let Some(message) = &decision.message {
        // 422 Invalid, as the API server's own validation answers a bad field.
        response["status"] = json!({
            "code": 422,
            "reason": "Invalid",
            "message": message,
        });
    }
    Ok((
        json!({
            "apiVersion": REVIEW_API_VERSION,
            "kind": "AdmissionReview",
            "response": response,
        }),
        decision,
    ))
}

/// The decision on one `request` of a review.
pub fn decide(request: &Value) -> Decision {
    let text = |v: Option<&Value>| v.and_then(Value::as_str).unwrap_or_default().to_string();
    let operation = text(request.get("operation"));
    if operation != "CREATE" && operation != "UPDATE" {
        return Decision::allow();
    }
    let resource = request.get("resource").unwrap_or(&Value::Null);
    let group = text(resource.get("group"));
    let version = text(resource.get("version"));
    let plural = text(resource.get("resource"));
    let object = request.get("object").unwrap_or(&Value::Null);
    // A claim's spec is immutable and a class's or template's update that leaves the spec alone
    // (labels, finalizers, owner references) changes nothing the driver reads: refusing it would
    // let a config admitted while the webhook was down block, say, the removal of a finalizer.
    if operation == "UPDATE"
        && request.get("oldObject").and_then(|o| o.get("spec")) == object.get("spec")
    {
        return Decision::allow();
    }
    let what = describe(request, object);
    if group != RESOURCE_GROUP {
        return Decision::refuse(format!(
            "{what}: {group}/{version} {plural} is not a resource this webhook checks \
             (it checks {RESOURCE_GROUP} resourceclaims, resourceclaimtemplates and deviceclasses)"
        ));
    }
    let Some(layout) = RequestLayout::of_version(&version) else {
        return Decision::refuse(format!(
            "{what}: {RESOURCE_GROUP}/{version} is not a version this webhook knows \
             (v1, v1beta2 and v1beta1); create it as {RESOURCE_GROUP}/v1"
        ));
    };
    let spec = object.get("spec").unwrap_or(&Value::Null);
    let problems = match plural.as_str() {
        "resourceclaims" => check_claim_spec(spec, "spec", layout),
        "resourceclaimtemplates" => check_claim_spec(
            spec.get("spec").unwrap_or(&Value::Null),
            "spec.spec",
            layout,
        ),
        "deviceclasses" => check_class_spec(spec, "spec"),
        other => {
            return Decision::refuse(format!(
                "{what}: {RESOURCE_GROUP} {other} is not a resource this webhook checks"
            ))
        }
    };
    if problems.is_empty() {
        Decision::allow()
    } else {
        Decision::refuse(refusal(&what, &problems))
    }
}

/// `ResourceClaim "team-a/half"`, as the user named it (or its generateName, before a name is made).
fn describe(request: &Value, object: &Value) -> String {
    let kind = request
        .get("kind")
        .and_then(|k| k.get("kind"))
        .and_then(Value::as_str)
        .unwrap_or("object");
    let metadata = object.get("metadata").unwrap_or(&Value::Null);
    let name = request
        .get("name")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .or_else(|| metadata.get("name").and_then(Value::as_str))
        .map(str::to_string)
        .or_else(|| {
            metadata
                .get("generateName")
                .and_then(Value::as_str)
                .map(|g| format!("{g}*"))
        })
        .unwrap_or_default();
    match request
        .get("namespace")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
    {
        Some(namespace) => format!("{kind} \"{namespace}/{name}\""),
        None => format!("{kind} \"{name}\""),
    }
}

/// The message a refused user reads: what, then every field with what is allowed there.
pub fn refusal(what: &str, problems: &[ConfigError]) -> String {
    let listed: Vec<String> = problems.iter().map(ToString::to_string).collect();
    format!(
        "{what}: gpupool.dev config refused (the driver would fail the pod at prepare): {}",
        listed.join("; ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn review(operation: &str, version: &str, plural: &str, object: Value) -> Value {
        json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
                "kind": {"group": "resource.k8s.io", "version": version, "kind": "ResourceClaim"},
                "resource": {"group": "resource.k8s.io", "version": version, "resource": plural},
                "name": "half",
                "namespace": "team-a",
                "operation": operation,
                "object": object,
            }
        })
    }

    fn claim(parameters: Value) -> Value {
        json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "half", "namespace": "team-a"},
            "spec": {"devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpupool.dev"}}],
                "config": [{"opaque": {"driver": "gpupool.dev", "parameters": parameters}}]
            }}
        })
    }

    fn answer_of(review: &Value) -> (Value, Decision) {
        answer(&serde_json::to_vec(review).unwrap()).unwrap()
    }

    #[test]
    fn a_bad_claim_is_refused_with_the_claim_and_the_field_named() {
        let bad = claim(
            json!({"apiVersion": "gpupool.dev/v1alpha1", "kind": "GpuConfig", "coreLimit": 150}),
        );
        let (response, decision) = answer_of(&review("CREATE", "v1", "resourceclaims", bad));
        assert!(!decision.allowed);
        let message = response["response"]["status"]["message"].as_str().unwrap();
        assert!(
            message.starts_with("ResourceClaim \"team-a/half\": gpupool.dev config refused"),
            "{message}"
        );
        assert!(
            message.contains("spec.devices.config[0].opaque.parameters.coreLimit: 150: must be an integer 0..100"),
            "{message}"
        );
        assert_eq!(
            response["response"]["uid"],
            "705ab4f5-6393-11e8-b7cc-42010a800002"
        );
        assert_eq!(response["response"]["allowed"], false);
        assert_eq!(response["apiVersion"], "admission.k8s.io/v1");
    }

    #[test]
    fn a_good_claim_is_allowed_and_updates_that_keep_the_spec_are_not_checked() {
        let good = claim(
            json!({"apiVersion": "gpupool.dev/v1alpha1", "kind": "GpuConfig", "compute": "Limiter"}),
        );
        let (response, decision) = answer_of(&review("CREATE", "v1", "resourceclaims", good));
        assert!(decision.allowed);
        assert_eq!(response["response"]["allowed"], true);
        assert!(response["response"].get("status").is_none());

        let bad = claim(
            json!({"apiVersion": "gpupool.dev/v1alpha1", "kind": "GpuConfig", "compute": "Mpss"}),
        );
        let mut update = review("UPDATE", "v1", "resourceclaims", bad.clone());
        update["request"]["oldObject"] = bad.clone();
        assert!(
            answer_of(&update).1.allowed,
            "a finalizer change stays possible"
        );
        update["request"]["oldObject"]["spec"] = json!({});
        assert!(!answer_of(&update).1.allowed, "a changed spec is checked");
        let delete = review("DELETE", "v1", "resourceclaims", Value::Null);
        assert!(answer_of(&delete).1.allowed);
    }

    #[test]
    fn templates_classes_and_versions_are_read_where_they_keep_the_config() {
        let parameters = json!({"apiVersion": "gpupool.dev/v1alpha1", "kind": "GpuConfig", "memoryLimit": "lots"});
        let template = json!({"metadata": {"name": "t"}, "spec": {"spec": claim(parameters.clone())["spec"].clone()}});
        let (_, decision) = answer_of(&review(
            "CREATE",
            "v1beta2",
            "resourceclaimtemplates",
            template,
        ));
        assert!(
            decision
                .message
                .as_deref()
                .unwrap()
                .contains("spec.spec.devices.config[0].opaque.parameters.memoryLimit"),
            "{decision:?}"
        );
        let class = json!({"metadata": {"name": "c"}, "spec": {"config": [{"opaque": {"driver": "gpupool.dev", "parameters": parameters}}]}});
        let mut class_review = review("CREATE", "v1beta1", "deviceclasses", class);
        class_review["request"]["kind"]["kind"] = json!("DeviceClass");
        class_review["request"]["namespace"] = Value::Null;
        class_review["request"]["name"] = json!("c");
        let (_, decision) = answer_of(&class_review);
        let message = decision.message.unwrap();
        assert!(message.starts_with("DeviceClass \"c\":"), "{message}");
        assert!(
            message.contains("spec.config[0].opaque.parameters.memoryLimit"),
            "{message}"
        );

        let (_, decision) = answer_of(&review("CREATE", "v2", "resourceclaims", json!({})));
        assert!(!decision.allowed);
        assert!(decision
            .message
            .unwrap()
            .contains("not a version this webhook knows"));
    }

    #[test]
    fn what_is_not_a_review_is_an_error_not_a_panic() {
        assert!(matches!(answer(b"{"), Err(ReviewError::NotJson(_))));
        assert!(matches!(answer(b"[]"), Err(ReviewError::UnknownVersion(_))));
        let mut old = review("CREATE", "v1", "resourceclaims", json!({}));
        old["apiVersion"] = json!("admission.k8s.io/v1beta1");
        assert_eq!(
            answer(&serde_json::to_vec(&old).unwrap()).unwrap_err(),
            ReviewError::UnknownVersion("admission.k8s.io/v1beta1".into())
        );
        let mut no_uid = review("CREATE", "v1", "resourceclaims", json!({}));
        no_uid["request"]["uid"] = json!("");
        assert_eq!(
            answer(&serde_json::to_vec(&no_uid).unwrap()).unwrap_err(),
            ReviewError::NoUid
        );
        // Fields of the wrong type inside a review are a decision, not an error.
        let mut odd = review(
            "CREATE",
            "v1",
            "resourceclaims",
            json!({"spec": {"devices": {"config": "x", "requests": 3}}}),
        );
        odd["request"]["name"] = json!(7);
        assert!(answer_of(&odd).1.allowed);
    }
}

//! Failures as the real API server reports them: a `Status` object with reason, code and details.

use serde_json::{json, Value};

use crate::resources::ResourceDef;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{code} {reason}: {message}")]
pub struct ApiError {
    pub code: u16,
    pub reason: &'static str,
    pub message: String,
    pub details: Option<Value>,
}

impl ApiError {
    fn new(code: u16, reason: &'static str, message: String, details: Option<Value>) -> Self {
        ApiError {
            code,
            reason,
            message,
            details,
        }
    }

    fn details(def: &ResourceDef, name: &str) -> Value {
        json!({"name": name, "group": def.group, "kind": def.plural})
    }

    /// A failure of one object, `<plural>.<group> "<name>" <what>`, with the object's details.
    fn of_object(
        code: u16,
        reason: &'static str,
        def: &ResourceDef,
        name: &str,
        what: &str,
    ) -> Self {
        let message = format!("{} {name:?} {what}", def.qualified_plural());
        Self::new(code, reason, message, Some(Self::details(def, name)))
    }

    pub fn not_found(def: &ResourceDef, name: &str) -> Self {
        Self::of_object(404, "NotFound", def, name, "not found")
    }

    pub fn namespace_not_found(namespace: &str) -> Self {
        Self::new(
            404,
            "NotFound",
            format!("namespaces {namespace:?} not found"),
            Some(json!({"name": namespace, "kind": "namespaces"})),
        )
    }

    pub fn already_exists(def: &ResourceDef, name: &str) -> Self {
        Self::of_object(409, "AlreadyExists", def, name, "already exists")
    }

    pub fn conflict(def: &ResourceDef, name: &str, why: &str) -> Self {
        Self::new(
            409,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {} {name:?}: {why}",
                def.qualified_plural()
            ),
            Some(Self::details(def, name)),
        )
    }

    pub fn stale(def: &ResourceDef, name: &str) -> Self {
        Self::conflict(
            def,
            name,
            "the object has been modified; please apply your changes to the latest version and try again",
        )
    }

    /// 422 with one cause per (field, message).
    pub fn invalid(def: &ResourceDef, name: &str, causes: &[(String, String)]) -> Self {
        let summary: Vec<String> = causes.iter().map(|(f, m)| format!("{f}: {m}")).collect();
        let joined = if summary.len() == 1 {
            summary[0].clone()
        } else {
            format!("[{}]", summary.join(", "))
        };
        let causes: Vec<Value> = causes
            .iter()
            .map(|(field, message)| json!({"reason": cause_reason(message), "message": message, "field": field}))
            .collect();
        Self::new(
            422,
            "Invalid",
            format!("{} {name:?} is invalid: {joined}", def.qualified_kind()),
            Some(json!({"name": name, "group": def.group, "kind": def.kind, "causes": causes})),
        )
    }

    /// A DELETE whose `DeleteOptions` the server refuses, as `ValidateDeleteOptions` words it.
    pub fn invalid_delete_options(field: &str, message: &str) -> Self {
        Self::new(
            422,
            "Invalid",
            format!("DeleteOptions.meta.k8s.io \"\" is invalid: {field}: {message}"),
            Some(json!({"group": "meta.k8s.io", "kind": "DeleteOptions",
                "causes": [{"reason": cause_reason(message), "message": message, "field": field}]})),
        )
    }

    pub fn forbidden(def: &ResourceDef, name: &str, why: &str) -> Self {
        Self::of_object(403, "Forbidden", def, name, &format!("is forbidden: {why}"))
    }

    /// A 403 with the message and details given (authorization's wording, see `auth`).
    pub fn forbidden_with(message: String, details: Value) -> Self {
        Self::new(403, "Forbidden", message, Some(details))
    }

    /// A token the server does not know.
    pub fn unauthorized() -> Self {
        Self::new(401, "Unauthorized", "Unauthorized".into(), None)
    }

    /// A JSON patch that cannot be applied (a failed test, a missing path) is a 422 like upstream.
    pub fn invalid_patch(def: &ResourceDef, name: &str, why: &str) -> Self {
        Self::new(
            422,
            "Invalid",
            format!("{} {name:?} is invalid: {why}", def.qualified_kind()),
            Some(json!({"name": name, "group": def.group, "kind": def.kind})),
        )
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, "BadRequest", message.into(), None)
    }

    pub fn method_not_allowed(message: impl Into<String>) -> Self {
        Self::new(405, "MethodNotAllowed", message.into(), None)
    }

    pub fn not_found_path(path: &str) -> Self {
        Self::new(
            404,
            "NotFound",
            format!("the server could not find the requested resource ({path})"),
            None,
        )
    }

    pub fn unsupported_media_type(content_type: &str) -> Self {
        Self::new(415, "UnsupportedMediaType", format!("the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml (got {content_type:?})"), None)
    }

    /// Typed clients (e.g. `kubectl create namespace`) send protobuf, which the emulator does not decode.
    pub fn unsupported_body_encoding(content_type: &str) -> Self {
        Self::new(
            415,
            "UnsupportedMediaType",
            format!("the emulator accepts JSON or YAML request bodies, not {content_type:?}; use `kubectl apply -f` (or `kubectl create ... --dry-run=client -o yaml | kubectl apply -f -`)"),
            None,
        )
    }

    /// A resourceVersion the server has not reached within its wait (kube-apiserver's wording).
    pub fn too_large_resource_version(wanted: u64, current: u64) -> Self {
        Self::new(
            504,
            "Timeout",
            format!("Too large resource version: {wanted}, current: {current}"),
            Some(json!({"causes": [{"reason": "ResourceVersionTooLarge",
                "message": "Too large resource version"}], "retryAfterSeconds": 1})),
        )
    }

    pub fn gone(message: impl Into<String>) -> Self {
        Self::new(410, "Expired", message.into(), None)
    }

    pub fn to_status(&self) -> Value {
        let mut status = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        if let Some(details) = &self.details {
            status["details"] = details.clone();
        }
        status
    }
}

/// The machine-readable cause type the real server derives from the message's leading phrase.
fn cause_reason(message: &str) -> &'static str {
    if message.starts_with("Required value") {
        "FieldValueRequired"
    } else if message.starts_with("Too many") || message.starts_with("Too long") {
        "FieldValueTooMany"
    } else if message.starts_with("Duplicate value") {
        "FieldValueDuplicate"
    } else if message.starts_with("Unsupported value") {
        "FieldValueNotSupported"
    } else if message.starts_with("Forbidden") {
        "FieldValueForbidden"
    } else {
        "FieldValueInvalid"
    }
}

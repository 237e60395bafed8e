//! kube-apiserver's audit log, read back as the requests it records: which client (user agent)
//! asked what (verb, URI with its query) and the answer's code. One JSON event per line.

use std::io::{Read, Seek, SeekFrom};
use std::path::Path;
use std::sync::Mutex;

use serde::Deserialize;

/// One request, as the audit log recorded it when it completed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuditRequest {
    /// The HTTP method (the audit log's verb turned back into it: get, list and watch are GET).
    pub method: String,
    /// Path and query, as sent.
    pub uri: String,
    pub user_agent: String,
    pub user: String,
    pub code: u16,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Event {
    verb: String,
    #[serde(rename = "requestURI")]
    request_uri: String,
    #[serde(default)]
    user_agent: String,
    user: User,
    #[serde(default)]
    response_status: Option<ResponseStatus>,
}

#[derive(Deserialize)]
struct User {
    #[serde(default)]
    username: String,
}

#[derive(Deserialize)]
struct ResponseStatus {
    #[serde(default)]
    code: u16,
}

/// The HTTP method of an audit verb.
pub fn method_of(verb: &str) -> &'static str {
    match verb {
        "get" | "list" | "watch" => "GET",
        "create" => "POST",
        "update" => "PUT",
        "patch" => "PATCH",
        "delete" | "deletecollection" => "DELETE",
        _ => "OTHER",
    }
}

/// The request of one audit log line; `None` for a line that is not an audit event.
pub fn parse_line(line: &str) -> Option<AuditRequest> {
    let event: Event = serde_json::from_str(line).ok()?;
    Some(AuditRequest {
        method: method_of(&event.verb).to_string(),
        uri: event.request_uri,
        user_agent: event.user_agent,
        user: event.user.username,
        code: event.response_status.map_or(0, |s| s.code),
    })
}

/// What was read of the log so far: its byte offset (at a line's end) and the requests.
#[derive(Default)]
pub(super) struct AuditLog(Mutex<(u64, Vec<AuditRequest>)>);

impl AuditLog {
    pub(super) fn read(&self, path: &Path) -> std::io::Result<Vec<AuditRequest>> {
        let mut seen = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let mut file = match std::fs::File::open(path) {
            Ok(file) => file,
            // Nothing audited yet.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(seen.1.clone()),
            Err(e) => return Err(e),
        };
        file.seek(SeekFrom::Start(seen.0))?;
        let mut added = String::new();
        file.read_to_string(&mut added)?;
        // A line still being written waits for the next read.
        let complete = added.rfind('\n').map_or(0, |i| i + 1);
        seen.1
            .extend(added[..complete].lines().filter_map(parse_line));
        seen.0 += complete as u64;
        Ok(seen.1.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_audit_event_becomes_its_request() {
        let line = r#"{"kind":"Event","apiVersion":"audit.k8s.io/v1","level":"Metadata","auditID":"a","stage":"ResponseComplete","requestURI":"/apis/resource.k8s.io/v1/namespaces/bench/resourceclaims/c?resourceVersion=0","verb":"get","user":{"username":"system:serviceaccount:gpupool:gpupool-driver","groups":["system:serviceaccounts"]},"sourceIPs":["127.0.0.1"],"userAgent":"gpupool-driver/v0.0.0","objectRef":{"resource":"resourceclaims","namespace":"bench","name":"c","apiGroup":"resource.k8s.io","apiVersion":"v1"},"responseStatus":{"metadata":{},"code":200}}"#;
        assert_eq!(
            parse_line(line),
            Some(AuditRequest {
                method: "GET".into(),
                uri: "/apis/resource.k8s.io/v1/namespaces/bench/resourceclaims/c?resourceVersion=0"
                    .into(),
                user_agent: "gpupool-driver/v0.0.0".into(),
                user: "system:serviceaccount:gpupool:gpupool-driver".into(),
                code: 200,
            })
        );
        assert_eq!(parse_line("not json"), None);
        assert_eq!(method_of("patch"), "PATCH");
    }

    #[test]
    fn the_log_is_read_once_and_a_partial_line_waits() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.log");
        let log = AuditLog::default();
        assert!(log.read(&path).unwrap().is_empty());
        let event = |name: &str| {
            format!(
                r#"{{"verb":"get","requestURI":"/x/{name}","userAgent":"u","user":{{"username":"me"}},"responseStatus":{{"code":200}}}}"#
            )
        };
        std::fs::write(&path, format!("{}\n{}", event("a"), &event("b")[..10])).unwrap();
        assert_eq!(log.read(&path).unwrap().len(), 1);
        std::fs::write(&path, format!("{}\n{}\n", event("a"), event("b"))).unwrap();
        let all = log.read(&path).unwrap();
        assert_eq!(
            all.iter().map(|r| r.uri.as_str()).collect::<Vec<_>>(),
            ["/x/a", "/x/b"]
        );
    }
}

//! Label and field selectors as the API server parses them from `?labelSelector=` / `?fieldSelector=`.

use serde_json::Value;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SelectorError {
    #[error("unable to parse requirement {0:?}: {1}")]
    Requirement(String, &'static str),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum LabelRequirement {
    Equals(String, String),
    NotEquals(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

/// A parsed label selector; the empty selector matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector(Vec<LabelRequirement>);

/// Splits `input` on each `separator` outside `open ... close` brackets.
pub(crate) fn split_outside(input: &str, separator: char, open: char, close: char) -> Vec<&str> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, c) in input.char_indices() {
        if c == open {
            depth += 1;
        } else if c == close {
            depth = depth.saturating_sub(1);
        } else if c == separator && depth == 0 {
            parts.push(&input[start..i]);
            start = i + c.len_utf8();
        }
    }
    parts.push(&input[start..]);
    parts
}

/// Splits on commas that are not inside a `( ... )` value set.
fn split_top_level(input: &str) -> Vec<&str> {
    split_outside(input, ',', '(', ')')
        .into_iter()
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect()
}

fn parse_set(raw: &str, requirement: &str) -> Result<Vec<String>, SelectorError> {
    let raw = raw.trim();
    let inner = raw
        .strip_prefix('(')
        .and_then(|r| r.strip_suffix(')'))
        .ok_or_else(|| {
            SelectorError::Requirement(requirement.into(), "expected a (value, ...) set")
        })?;
    Ok(inner
        .split(',')
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
        .collect())
}

fn check_key(key: &str, requirement: &str) -> Result<String, SelectorError> {
    let key = key.trim();
    if key.is_empty() || key.contains(char::is_whitespace) {
        return Err(SelectorError::Requirement(
            requirement.into(),
            "invalid label key",
        ));
    }
    Ok(key.to_string())
}

impl LabelSelector {
    pub fn parse(input: &str) -> Result<Self, SelectorError> {
        let mut requirements = Vec::new();
        for part in split_top_level(input) {
            let req = if let Some(key) = part.strip_prefix('!') {
                LabelRequirement::NotExists(check_key(key, part)?)
            } else if let Some(idx) = part.find(" notin ") {
                LabelRequirement::NotIn(
                    check_key(&part[..idx], part)?,
                    parse_set(&part[idx + 7..], part)?,
                )
            } else if let Some(idx) = part.find(" in ") {
                LabelRequirement::In(
                    check_key(&part[..idx], part)?,
                    parse_set(&part[idx + 4..], part)?,
                )
            } else if let Some((k, v)) = part.split_once("!=") {
                LabelRequirement::NotEquals(check_key(k, part)?, v.trim().to_string())
            } else if let Some((k, v)) = part.split_once("==") {
                LabelRequirement::Equals(check_key(k, part)?, v.trim().to_string())
            } else if let Some((k, v)) = part.split_once('=') {
                LabelRequirement::Equals(check_key(k, part)?, v.trim().to_string())
            } else {
                LabelRequirement::Exists(check_key(part, part)?)
            };
            requirements.push(req);
        }
        Ok(LabelSelector(requirements))
    }

    /// Matches against `metadata.labels` of `object`.
    pub fn matches(&self, object: &Value) -> bool {
        let labels = object.pointer("/metadata/labels");
        let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        self.0.iter().all(|req| match req {
            LabelRequirement::Equals(k, v) => get(k) == Some(v.as_str()),
            LabelRequirement::NotEquals(k, v) => get(k) != Some(v.as_str()),
            LabelRequirement::In(k, vs) => get(k).is_some_and(|l| vs.iter().any(|v| v == l)),
            LabelRequirement::NotIn(k, vs) => get(k).is_none_or(|l| vs.iter().all(|v| v != l)),
            LabelRequirement::Exists(k) => get(k).is_some(),
            LabelRequirement::NotExists(k) => get(k).is_none(),
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct FieldRequirement {
    path: String,
    value: String,
    equal: bool,
}

/// A parsed field selector over dotted JSON paths (`spec.nodeName`, `involvedObject.uid`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldSelector(Vec<FieldRequirement>);

/// The value a field selector compares against: a missing field reads as "" like the real server.
pub fn field_value(object: &Value, path: &str) -> String {
    let mut current = object;
    for part in path.split('.') {
        match current.get(part) {
            Some(v) => current = v,
            None => return String::new(),
        }
    }
    match current {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

impl FieldSelector {
    pub fn parse(input: &str) -> Result<Self, SelectorError> {
        let mut requirements = Vec::new();
        for part in split_top_level(input) {
            let (path, value, equal) = if let Some((k, v)) = part.split_once("!=") {
                (k, v, false)
            } else if let Some((k, v)) = part.split_once("==") {
                (k, v, true)
            } else if let Some((k, v)) = part.split_once('=') {
                (k, v, true)
            } else {
                return Err(SelectorError::Requirement(
                    part.into(),
                    "expected field=value or field!=value",
                ));
            };
            requirements.push(FieldRequirement {
                path: path.trim().to_string(),
                value: value.trim().to_string(),
                equal,
            });
        }
        Ok(FieldSelector(requirements))
    }

    pub fn matches(&self, object: &Value) -> bool {
        self.0
            .iter()
            .all(|req| (field_value(object, &req.path) == req.value) == req.equal)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(labels: Value) -> Value {
        json!({"metadata": {"name": "p", "namespace": "default", "labels": labels}, "spec": {"nodeName": "node-a"}})
    }

    #[test]
    fn label_selector_operators() {
        let obj = pod(json!({"app": "web", "tier": "front"}));
        let yes = [
            "app=web",
            "app==web",
            "app!=db",
            "app in (web, db)",
            "tier notin (back)",
            "app",
            "!missing",
            "app=web,tier in (front)",
            "",
        ];
        let no = [
            "app=db",
            "app!=web",
            "app in (db)",
            "tier notin (front,back)",
            "missing",
            "!app",
            "app=web,tier=back",
        ];
        for s in yes {
            assert!(
                LabelSelector::parse(s).unwrap().matches(&obj),
                "{s} should match"
            );
        }
        for s in no {
            assert!(
                !LabelSelector::parse(s).unwrap().matches(&obj),
                "{s} should not match"
            );
        }
    }

    #[test]
    fn malformed_label_selector_is_an_error() {
        assert!(LabelSelector::parse("app in web").is_err());
    }

    #[test]
    fn field_selector_paths() {
        let obj = pod(json!({}));
        assert!(FieldSelector::parse("spec.nodeName=node-a")
            .unwrap()
            .matches(&obj));
        assert!(
            FieldSelector::parse("metadata.name=p,metadata.namespace=default")
                .unwrap()
                .matches(&obj)
        );
        assert!(!FieldSelector::parse("spec.nodeName!=node-a")
            .unwrap()
            .matches(&obj));
        assert!(FieldSelector::parse("spec.driver=").unwrap().matches(&obj));
        assert!(!FieldSelector::parse("spec.nodeName=node-b")
            .unwrap()
            .matches(&obj));
        assert!(FieldSelector::parse("nonsense").is_err());
    }
}

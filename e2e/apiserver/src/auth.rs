//! Who is asking, and what they may do, as kube-apiserver 1.36 decides it: bearer tokens name a
//! user; RBAC over the stored Roles, ClusterRoles and their bindings says what that user may do;
//! and a claim's status write needs the DRA permissions on the synthetic subresources
//! `resourceclaims/binding` and `resourceclaims/driver` (`DRAResourceClaimGranularStatusAuthorization`,
//! beta and on in 1.36), with the node-aware verbs `associated-node:<verb>` and
//! `arbitrary-node:<verb>`.
//!
//! A request without credentials is the administrator (group `system:masters`), as on
//! kube-apiserver's former insecure port: the emulator serves plain HTTP, over which kubectl sends
//! no bearer token, and the kubeconfig it writes is the tests' and the sandbox user's admin
//! access. Components that run with their own ServiceAccount in a cluster get a token of that
//! ServiceAccount from [`ApiServer::service_account_token`](crate::ApiServer::service_account_token),
//! bound to a node like the projected token of a pod on that node, and every request they make is
//! authorized as the real server would; an unknown token is 401.
//!
//! Not emulated: the Node authorizer (the kubelet emulator writes as administrator), aggregated
//! ClusterRoles, impersonation, and token expiry.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use serde_json::{json, Value};

use crate::resources::ResourceDef;
use crate::rules::Causes;
use crate::selectors::{FieldSelector, LabelSelector};
use crate::status::ApiError;
use crate::store::Store;

/// The user-info extra a ServiceAccount token bound to a pod carries: the pod's node.
pub const NODE_NAME_EXTRA: &str = "authentication.kubernetes.io/node-name";
/// Members may do anything (RBAC is not consulted), like a cluster's admin certificate.
pub const MASTERS_GROUP: &str = "system:masters";
const SERVICE_ACCOUNT_PREFIX: &str = "system:serviceaccount:";
const RBAC_GROUP: &str = "rbac.authorization.k8s.io";

/// An authenticated (or anonymous) user, as authorization sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserInfo {
    pub name: String,
    pub groups: Vec<String>,
    pub extra: BTreeMap<String, Vec<String>>,
}

impl UserInfo {
    /// The emulator's administrator: whoever sends no credentials.
    pub fn admin() -> Self {
        UserInfo {
            name: "gpupool-emulator-admin".into(),
            groups: vec![MASTERS_GROUP.into(), "system:authenticated".into()],
            extra: BTreeMap::new(),
        }
    }

    /// ServiceAccount `namespace/name`; with `node`, as the projected token of a pod on that node.
    pub fn service_account(namespace: &str, name: &str, node: Option<&str>) -> Self {
        let mut extra = BTreeMap::new();
        if let Some(node) = node {
            extra.insert(NODE_NAME_EXTRA.to_string(), vec![node.to_string()]);
        }
        UserInfo {
            name: format!("{SERVICE_ACCOUNT_PREFIX}{namespace}:{name}"),
            groups: vec![
                "system:serviceaccounts".into(),
                format!("system:serviceaccounts:{namespace}"),
                "system:authenticated".into(),
            ],
            extra,
        }
    }

    fn is_admin(&self) -> bool {
        self.groups.iter().any(|g| g == MASTERS_GROUP)
    }

    fn is_authenticated(&self) -> bool {
        self.groups.iter().any(|g| g == "system:authenticated")
    }

    /// `(namespace, name)` when this is a ServiceAccount.
    fn service_account_ref(&self) -> Option<(&str, &str)> {
        self.name
            .strip_prefix(SERVICE_ACCOUNT_PREFIX)?
            .split_once(':')
    }

    /// The node a ServiceAccount's token is bound to: exactly one value, else none.
    fn bound_node(&self) -> Option<&str> {
        self.service_account_ref()?;
        match self.extra.get(NODE_NAME_EXTRA).map(Vec::as_slice) {
            Some([node]) if !node.is_empty() => Some(node),
            _ => None,
        }
    }
}

/// The tokens this server accepts.
#[derive(Default)]
pub struct Tokens(Mutex<HashMap<String, UserInfo>>);

impl Tokens {
    /// A new token for `user`.
    pub fn issue(&self, user: UserInfo) -> String {
        let token = format!("emulator-{}", uuid::Uuid::new_v4().simple());
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(token.clone(), user);
        token
    }

    /// The user of an `Authorization` header: the administrator without one, an error (401) for
    /// a token this server never issued.
    pub fn authenticate(&self, authorization: Option<&str>) -> Result<UserInfo, ApiError> {
        let Some(value) = authorization else {
            return Ok(UserInfo::admin());
        };
        let token = value
            .strip_prefix("Bearer ")
            .ok_or_else(ApiError::unauthorized)?;
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(token.trim())
            .cloned()
            .ok_or_else(ApiError::unauthorized)
    }
}

/// What a request does, for authorization.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attributes<'a> {
    Resource {
        verb: &'a str,
        group: &'a str,
        resource: &'a str,
        subresource: Option<&'a str>,
        namespace: Option<&'a str>,
        name: Option<&'a str>,
    },
    NonResource {
        verb: &'a str,
        path: &'a str,
    },
}

/// Paths every authenticated user may read (the bootstrap roles `system:discovery`,
/// `system:basic-user`, `system:public-info-viewer`); the public ones anyone may.
const DISCOVERY_PATHS: &[&str] = &["/api", "/api/*", "/apis", "/apis/*", "/openapi/*"];
const PUBLIC_PATHS: &[&str] = &["/healthz", "/livez", "/readyz", "/version"];

/// Whether `user` may do `attrs`.
pub fn authorize(store: &Store, user: &UserInfo, attrs: &Attributes) -> bool {
    if user.is_admin() {
        return true;
    }
    if let Attributes::NonResource { verb: "get", path } = attrs {
        let public = PUBLIC_PATHS.iter().any(|p| url_matches(p, path));
        let discovery = DISCOVERY_PATHS.iter().any(|p| url_matches(p, path));
        if public || (discovery && user.is_authenticated()) {
            return true;
        }
    }
    let namespace = match attrs {
        Attributes::Resource { namespace, .. } => *namespace,
        Attributes::NonResource { .. } => None,
    };
    role_rules(store, user, namespace)
        .iter()
        .any(|(rule, cluster_wide)| rule_allows(rule, *cluster_wide, attrs))
}

/// Every rule granted to `user` that can apply in `namespace`, each with whether it comes from a
/// ClusterRoleBinding (which also grants cluster-scoped and non-resource requests).
fn role_rules(store: &Store, user: &UserInfo, namespace: Option<&str>) -> Vec<(Value, bool)> {
    let all = |plural: &str, ns: Option<&str>| -> Vec<Value> {
        store
            .find(RBAC_GROUP, "v1", plural)
            .map(|def| {
                store.list(
                    &def,
                    ns,
                    &LabelSelector::default(),
                    &FieldSelector::default(),
                )
            })
            .unwrap_or_default()
    };
    let rules_of = |kind: &str, name: &str, ns: Option<&str>| -> Vec<Value> {
        let plural = if kind == "ClusterRole" {
            "clusterroles"
        } else {
            "roles"
        };
        let Some(def) = store.find(RBAC_GROUP, "v1", plural) else {
            return Vec::new();
        };
        let ns = if kind == "ClusterRole" { None } else { ns };
        store
            .get(&def, ns, name)
            .ok()
            .and_then(|role| role.get("rules").and_then(Value::as_array).cloned())
            .unwrap_or_default()
    };
    let mut granted = Vec::new();
    for binding in all("clusterrolebindings", None) {
        if binding_names(&binding, user, None) {
            let (kind, name) = role_ref(&binding);
            if kind == "ClusterRole" {
                granted.extend(rules_of(kind, name, None).into_iter().map(|r| (r, true)));
            }
        }
    }
    if let Some(ns) = namespace {
        for binding in all("rolebindings", Some(ns)) {
            if binding_names(&binding, user, Some(ns)) {
                let (kind, name) = role_ref(&binding);
                granted.extend(
                    rules_of(kind, name, Some(ns))
                        .into_iter()
                        .map(|r| (r, false)),
                );
            }
        }
    }
    granted
}

fn role_ref(binding: &Value) -> (&str, &str) {
    let field = |f: &str| {
        binding
            .pointer(&format!("/roleRef/{f}"))
            .and_then(Value::as_str)
            .unwrap_or_default()
    };
    (field("kind"), field("name"))
}

/// Whether one of the binding's subjects is `user`. A ServiceAccount subject of a RoleBinding
/// without a namespace means the binding's own.
fn binding_names(binding: &Value, user: &UserInfo, binding_namespace: Option<&str>) -> bool {
    let subjects = binding
        .get("subjects")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    subjects.iter().any(|s| {
        let field = |f: &str| s.get(f).and_then(Value::as_str).unwrap_or_default();
        match field("kind") {
            "User" => field("name") == user.name,
            "Group" => user.groups.iter().any(|g| g == field("name")),
            "ServiceAccount" => {
                let ns = Some(field("namespace"))
                    .filter(|n| !n.is_empty())
                    .or(binding_namespace)
                    .unwrap_or_default();
                user.service_account_ref() == Some((ns, field("name")))
            }
            _ => false,
        }
    })
}

fn strings<'a>(rule: &'a Value, field: &str) -> Vec<&'a str> {
    rule.get(field)
        .and_then(Value::as_array)
        .map(|list| list.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

/// RBAC's matching of one PolicyRule.
fn rule_allows(rule: &Value, cluster_wide: bool, attrs: &Attributes) -> bool {
    let verbs = strings(rule, "verbs");
    match *attrs {
        Attributes::NonResource { verb, path } => {
            cluster_wide
                && verbs.iter().any(|v| *v == "*" || *v == verb)
                && strings(rule, "nonResourceURLs")
                    .iter()
                    .any(|u| url_matches(u, path))
        }
        Attributes::Resource {
            verb,
            group,
            resource,
            subresource,
            namespace,
            name,
        } => {
            if namespace.is_none() && !cluster_wide {
                return false;
            }
            let combined = match subresource {
                Some(sub) => format!("{resource}/{sub}"),
                None => resource.to_string(),
            };
            let resource_ok = strings(rule, "resources").iter().any(|r| {
                *r == "*"
                    || *r == combined
                    || subresource.is_some_and(|sub| {
                        *r == format!("{resource}/*") || *r == format!("*/{sub}")
                    })
            });
            let names = strings(rule, "resourceNames");
            verbs.iter().any(|v| *v == "*" || *v == verb)
                && strings(rule, "apiGroups")
                    .iter()
                    .any(|g| *g == "*" || *g == group)
                && resource_ok
                && (names.is_empty() || name.is_some_and(|n| names.contains(&n)))
        }
    }
}

fn url_matches(pattern: &str, path: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => path.starts_with(prefix),
        None => pattern == path,
    }
}

/// The 403 the real server answers, worded as it words it.
pub fn forbidden(user: &UserInfo, attrs: &Attributes) -> ApiError {
    match *attrs {
        Attributes::NonResource { verb, path } => ApiError::forbidden_with(
            format!(
                "forbidden: User {:?} cannot {verb} path {path:?}",
                user.name
            ),
            json!({}),
        ),
        Attributes::Resource {
            verb,
            group,
            resource,
            subresource,
            namespace,
            name,
        } => {
            let qualified = if group.is_empty() {
                resource.to_string()
            } else {
                format!("{resource}.{group}")
            };
            let object = match name {
                Some(name) => format!("{qualified} {name:?}"),
                None => qualified,
            };
            let shown = match subresource {
                Some(sub) => format!("{resource}/{sub}"),
                None => resource.to_string(),
            };
            let scope = match namespace {
                Some(ns) => format!("in the namespace {ns:?}"),
                None => "at the cluster scope".to_string(),
            };
            let mut details = json!({"group": group, "kind": resource});
            if let Some(name) = name {
                details["name"] = json!(name);
            }
            ApiError::forbidden_with(
                format!(
                    "{object} is forbidden: User {:?} cannot {verb} resource {shown:?} in API group {group:?} {scope}",
                    user.name
                ),
                details,
            )
        }
    }
}

/// The node of a single-node allocation (`nodeSelector` with one term whose one `matchFields`
/// requirement is `metadata.name In [<node>]`), as the DRA status authorization reads it.
fn allocated_node(claim: &Value) -> Option<&str> {
    let terms = claim
        .pointer("/status/allocation/nodeSelector/nodeSelectorTerms")?
        .as_array()?;
    let [term] = terms.as_slice() else {
        return None;
    };
    if term
        .get("matchExpressions")
        .and_then(Value::as_array)
        .is_some_and(|e| !e.is_empty())
    {
        return None;
    }
    let [requirement] = term.get("matchFields")?.as_array()?.as_slice() else {
        return None;
    };
    let values = requirement.get("values")?.as_array()?;
    match (
        requirement.get("key")?.as_str()?,
        requirement.get("operator")?.as_str()?,
        values.as_slice(),
    ) {
        ("metadata.name", "In", [node]) => node.as_str(),
        _ => None,
    }
}

/// The drivers whose `status.devices` entries differ between `old` and `new` (added, removed or
/// changed), in order.
fn modified_drivers(old: &Value, new: &Value) -> Vec<String> {
    let entries = |claim: &Value| -> BTreeMap<(String, String, String, String), Value> {
        claim
            .pointer("/status/devices")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_default()
            .iter()
            .map(|entry| {
                let field = |f: &str| {
                    entry
                        .get(f)
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_string()
                };
                (
                    (
                        field("driver"),
                        field("pool"),
                        field("device"),
                        field("shareID"),
                    ),
                    entry.clone(),
                )
            })
            .collect()
    };
    let (before, after) = (entries(old), entries(new));
    let mut drivers: Vec<String> = before
        .iter()
        .filter(|(key, entry)| after.get(*key) != Some(*entry))
        .chain(
            after
                .iter()
                .filter(|(key, entry)| before.get(*key) != Some(*entry)),
        )
        .map(|((driver, ..), _)| driver.clone())
        .collect();
    drivers.sort();
    drivers.dedup();
    drivers
}

/// The DRA status authorization of a claim status write by `user` with `verb` (`update` or
/// `patch`): `status.allocation` and `status.reservedFor` need `resourceclaims/binding`; each
/// driver's `status.devices` entries need `resourceclaims/driver` named after the driver, with
/// `associated-node:<verb>` tried first when the user is a ServiceAccount bound to the claim's
/// (single) allocated node, then `arbitrary-node:<verb>`.
pub fn claim_status_causes(
    store: &Store,
    user: &UserInfo,
    verb: &str,
    claim: &str,
    namespace: Option<&str>,
    old: &Value,
    new: &Value,
) -> Causes {
    let mut causes = Causes::new();
    let check = |verb: &str, sub: &str, name: &str| {
        authorize(
            store,
            user,
            &Attributes::Resource {
                verb,
                group: "resource.k8s.io",
                resource: "resourceclaims",
                subresource: Some(sub),
                namespace,
                name: Some(name),
            },
        )
    };
    let binding_changed = ["/status/allocation", "/status/reservedFor"]
        .iter()
        .any(|p| old.pointer(p) != new.pointer(p));
    if binding_changed && !check(verb, "binding", claim) {
        causes.push((
            "status".into(),
            format!(
                "Forbidden: changing status.allocation or status.reservedFor requires \
                 resource=\"resourceclaims/binding\", verb={verb:?} permission: \
                 resourceclaims.resource.k8s.io {claim:?} is forbidden"
            ),
        ));
    }
    let associated = allocated_node(new)
        .zip(user.bound_node())
        .is_some_and(|(claim_node, user_node)| claim_node == user_node);
    for driver in modified_drivers(old, new) {
        let mut verbs = Vec::new();
        if associated {
            verbs.push(format!("associated-node:{verb}"));
        }
        verbs.push(format!("arbitrary-node:{verb}"));
        if !verbs.iter().any(|v| check(v, "driver", &driver)) {
            // The authorizer's own refusal of the last verb tried ends the message, as upstream's.
            let last = verbs.last().expect("arbitrary-node is always tried");
            let refusal = forbidden(
                user,
                &Attributes::Resource {
                    verb: last,
                    group: "resource.k8s.io",
                    resource: "resourceclaims",
                    subresource: Some("driver"),
                    namespace,
                    name: Some(&driver),
                },
            );
            causes.push((
                "status.devices".into(),
                format!(
                    "Forbidden: changing status.devices requires resource=\"resourceclaims/driver\", \
                     verb=\"[{}]\" permission: {}",
                    verbs.join(" "),
                    refusal.message
                ),
            ));
        }
    }
    causes
}

/// The verb of a request, as RBAC names it.
pub fn verb(method: &str, has_name: bool, watch: bool) -> &'static str {
    match (method, has_name) {
        ("GET", _) if watch => "watch",
        ("GET", true) => "get",
        ("GET", false) => "list",
        ("POST", _) => "create",
        ("PUT", _) => "update",
        ("PATCH", _) => "patch",
        ("DELETE", true) => "delete",
        ("DELETE", false) => "deletecollection",
        _ => "unknown",
    }
}

/// The attributes of a request on `def`.
pub fn resource_attributes<'a>(
    def: &'a ResourceDef,
    verb: &'a str,
    namespace: Option<&'a str>,
    name: Option<&'a str>,
    subresource: Option<&'a str>,
) -> Attributes<'a> {
    Attributes::Resource {
        verb,
        group: &def.group,
        resource: &def.plural,
        subresource,
        namespace,
        name,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resource<'a>(verb: &'a str, resource: &'a str, sub: Option<&'a str>) -> Attributes<'a> {
        Attributes::Resource {
            verb,
            group: "resource.k8s.io",
            resource,
            subresource: sub,
            namespace: Some("default"),
            name: Some("gpupool.dev"),
        }
    }

    #[test]
    fn rules_match_resources_subresources_and_wildcards_as_rbac_does() {
        let rule = |resources: Value| json!({"apiGroups": ["resource.k8s.io"], "resources": resources, "verbs": ["get"]});
        let claims = resource("get", "resourceclaims", None);
        let status = resource("get", "resourceclaims", Some("status"));
        assert!(rule_allows(&rule(json!(["resourceclaims"])), true, &claims));
        assert!(!rule_allows(
            &rule(json!(["resourceclaims"])),
            true,
            &status
        ));
        assert!(rule_allows(
            &rule(json!(["resourceclaims/*"])),
            true,
            &status
        ));
        assert!(rule_allows(&rule(json!(["*/status"])), true, &status));
        assert!(rule_allows(&rule(json!(["*"])), true, &status));
        assert!(!rule_allows(
            &rule(json!(["resourceclaims"])),
            true,
            &resource("list", "resourceclaims", None)
        ));
        // A namespaced grant never reaches cluster-scoped requests.
        let cluster_scoped = Attributes::Resource {
            verb: "get",
            group: "resource.k8s.io",
            resource: "resourceclaims",
            subresource: None,
            namespace: None,
            name: None,
        };
        assert!(!rule_allows(
            &rule(json!(["resourceclaims"])),
            false,
            &cluster_scoped
        ));
        assert!(url_matches("/apis/*", "/apis/resource.k8s.io"));
        assert!(!url_matches("/api", "/apis"));
    }

    #[test]
    fn only_a_single_node_selector_names_an_allocated_node() {
        let claim = |terms: Value| json!({"status": {"allocation": {"nodeSelector": {"nodeSelectorTerms": terms}}}});
        let field =
            |values: Value| json!({"key": "metadata.name", "operator": "In", "values": values});
        assert_eq!(
            allocated_node(&claim(json!([{"matchFields": [field(json!(["a"]))]}]))),
            Some("a")
        );
        for other in [
            json!([{"matchFields": [field(json!(["a", "b"]))]}]),
            json!([{"matchFields": [field(json!(["a"]))]}, {"matchFields": [field(json!(["b"]))]}]),
            json!([{"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": ["a"]}]}]),
        ] {
            assert_eq!(allocated_node(&claim(other.clone())), None, "{other}");
        }
    }

    #[test]
    fn modified_drivers_are_those_whose_entries_changed() {
        let entry = |driver: &str, message: &str| json!({"driver": driver, "pool": "p", "device": "d", "conditions": [{"message": message}]});
        let claim = |entries: Vec<Value>| json!({"status": {"devices": entries}});
        let old = claim(vec![entry("a", "x"), entry("b", "x")]);
        assert!(modified_drivers(&old, &old).is_empty());
        let new = claim(vec![entry("a", "y"), entry("b", "x"), entry("c", "x")]);
        assert_eq!(modified_drivers(&old, &new), ["a", "c"]);
        assert_eq!(modified_drivers(&old, &claim(vec![])), ["a", "b"]);
    }
}

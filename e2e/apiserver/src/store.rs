//! The object store and every write rule of the real API server the emulator reproduces: resource
//! versions, uid/creationTimestamp/generation, optimistic concurrency, status subresources, finalizers,
//! namespaces, CRD registration and ResourceSlice validation, and the garbage collector's work on
//! owner references (module `gc`, synchronous). No I/O: the HTTP layer calls in here.

mod gc;

use std::collections::{BTreeMap, VecDeque};

use gpupool_api::validation::{is_dns_label, is_dns_subdomain};
use serde_json::{json, Map, Value};

use crate::clock;
use crate::patch;
use crate::resources::{builtin_resources, crd_resources, CrdError, ResourceDef};
use crate::rules;
use crate::schema::{decode_builtin, decode_custom, DecodeError};
use crate::selectors::{FieldSelector, LabelSelector};
use crate::status::ApiError;

pub use gc::{Propagation, FOREGROUND_FINALIZER, ORPHAN_FINALIZER};

/// How many watch events are kept for watches that resume from a resourceVersion.
const HISTORY_LIMIT: usize = 10_000;

/// Namespaces the real server refuses to delete.
const PROTECTED_NAMESPACES: [&str; 3] = ["default", "kube-system", "kube-public"];

pub type StorageKey = (String, String);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    Added,
    Modified,
    Deleted,
}

impl EventType {
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }
}

#[derive(Debug, Clone)]
pub struct StoredEvent {
    pub rv: u64,
    pub key: StorageKey,
    pub namespace: String,
    pub event_type: EventType,
    pub object: Value,
    /// The object before a modification, so selector-filtered watches can turn it into ADDED/DELETED.
    pub old: Option<Value>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FieldValidation {
    Strict,
    #[default]
    Warn,
    Ignore,
}

impl FieldValidation {
    pub fn parse(value: Option<&str>) -> Result<Self, ApiError> {
        match value {
            None | Some("") | Some("Warn") => Ok(FieldValidation::Warn),
            Some("Strict") => Ok(FieldValidation::Strict),
            Some("Ignore") => Ok(FieldValidation::Ignore),
            Some(other) => Err(ApiError::bad_request(format!(
                "fieldValidation parameter unsupported: {other:?}: supported values are Strict, Warn, Ignore"
            ))),
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct WriteOptions {
    pub field_validation: FieldValidation,
    pub dry_run: bool,
    /// Who writes, for the checks that depend on it (a claim's status, `auth`); `None` for the
    /// emulator's own writes.
    pub requester: Option<Requester>,
}

/// The user behind a write and the verb of the request (`update` or `patch`).
#[derive(Debug, Clone)]
pub struct Requester {
    pub user: crate::auth::UserInfo,
    pub verb: &'static str,
}

#[derive(Debug, Clone)]
pub struct WriteOutcome {
    pub object: Value,
    pub created: bool,
    pub warnings: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PatchType {
    Merge,
    Json,
    Strategic,
    Apply,
}

impl PatchType {
    pub fn from_content_type(content_type: &str) -> Option<Self> {
        let media = content_type.split(';').next().unwrap_or_default().trim();
        match media {
            "application/merge-patch+json" => Some(PatchType::Merge),
            "application/json-patch+json" => Some(PatchType::Json),
            "application/strategic-merge-patch+json" => Some(PatchType::Strategic),
            "application/apply-patch+yaml" | "application/apply-patch+json" => {
                Some(PatchType::Apply)
            }
            _ => None,
        }
    }
}

/// Preconditions of a delete (`DeleteOptions.preconditions`).
#[derive(Debug, Clone, Default)]
pub struct Preconditions {
    pub uid: Option<String>,
    pub resource_version: Option<String>,
}

/// What a DELETE asks for besides the object (`DeleteOptions`).
#[derive(Debug, Clone, Default)]
pub struct DeleteOptions {
    pub preconditions: Preconditions,
    pub dry_run: bool,
    /// What happens to the object's dependents; `None`: what its finalizers say, else background.
    pub propagation: Option<Propagation>,
}

pub struct Store {
    rv: u64,
    objects: BTreeMap<StorageKey, BTreeMap<(String, String), Value>>,
    history: VecDeque<StoredEvent>,
    builtins: Vec<ResourceDef>,
    crds: BTreeMap<String, Vec<ResourceDef>>,
    /// The DRAPartitionableDevices feature (on by default in 1.36). Off, a ResourceSlice's
    /// `sharedCounters` and its devices' `consumesCounters` are dropped without a word, as the
    /// real server drops the fields of a disabled feature.
    partitionable_devices: bool,
    gc: gc::GcState,
}

impl Default for Store {
    fn default() -> Self {
        Self::new()
    }
}

fn meta_str<'a>(object: &'a Value, field: &str) -> Option<&'a str> {
    object.get("metadata")?.get(field)?.as_str()
}

fn meta_mut(object: &mut Value) -> &mut Map<String, Value> {
    if !object.get("metadata").is_some_and(Value::is_object) {
        object["metadata"] = json!({});
    }
    object["metadata"]
        .as_object_mut()
        .expect("metadata is an object")
}

/// Drops empty metadata maps and lists, which Go's `omitempty` never writes back.
fn drop_empty_metadata(object: &mut Value) {
    if let Some(meta) = object.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.retain(|key, value| {
            let empty = match value {
                Value::Object(m) => m.is_empty(),
                Value::Array(a) => a.is_empty(),
                Value::String(s) => s.is_empty(),
                Value::Null => true,
                _ => false,
            };
            !(empty
                && matches!(
                    key.as_str(),
                    "labels"
                        | "annotations"
                        | "finalizers"
                        | "ownerReferences"
                        | "managedFields"
                        | "generateName"
                ))
        });
    }
}

/// The object without the fields whose change does not bump `metadata.generation`.
fn spec_part(object: &Value) -> Value {
    let mut copy = object.clone();
    if let Some(map) = copy.as_object_mut() {
        map.remove("metadata");
        map.remove("status");
    }
    copy
}

fn random_suffix() -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    uuid::Uuid::new_v4()
        .as_bytes()
        .iter()
        .take(5)
        .map(|b| ALPHABET[*b as usize % ALPHABET.len()] as char)
        .collect()
}

impl Store {
    /// Turn the DRAPartitionableDevices feature off or on (see the field).
    pub fn set_partitionable_devices(&mut self, enabled: bool) {
        self.partitionable_devices = enabled;
    }

    /// What a disabled feature's fields become on a write: nothing.
    fn drop_disabled_fields(&self, def: &ResourceDef, body: &mut Value) {
        if self.partitionable_devices
            || def.group != "resource.k8s.io"
            || def.kind != "ResourceSlice"
        {
            return;
        }
        let Some(spec) = body.get_mut("spec").and_then(Value::as_object_mut) else {
            return;
        };
        spec.remove("sharedCounters");
        for device in spec
            .get_mut("devices")
            .and_then(Value::as_array_mut)
            .into_iter()
            .flatten()
        {
            if let Some(device) = device.as_object_mut() {
                device.remove("consumesCounters");
            }
        }
    }

    pub fn new() -> Self {
        let mut store = Store {
            rv: 0,
            objects: BTreeMap::new(),
            history: VecDeque::new(),
            builtins: builtin_resources(),
            crds: BTreeMap::new(),
            partitionable_devices: true,
            gc: gc::GcState::default(),
        };
        let namespaces = store.find("", "v1", "namespaces").expect("built in");
        for ns in ["default", "kube-system", "kube-public", "kube-node-lease"] {
            store
                .create(
                    &namespaces,
                    None,
                    json!({"metadata": {"name": ns}}),
                    WriteOptions::default(),
                )
                .expect("initial namespaces are valid");
        }
        store
    }

    pub fn current_rv(&self) -> u64 {
        self.rv
    }

    /// The oldest resourceVersion a watch may resume from without a 410.
    pub fn oldest_resumable_rv(&self) -> u64 {
        self.history.front().map(|e| e.rv - 1).unwrap_or(self.rv)
    }

    /// Drops the watch history, so watches resuming from an older resourceVersion get 410 Gone.
    pub fn compact(&mut self) {
        self.history.clear();
    }

    /// Events with a resourceVersion above `after`, in order.
    pub fn events_after(&self, after: u64) -> impl Iterator<Item = &StoredEvent> {
        let start = self.history.partition_point(|e| e.rv <= after);
        self.history.range(start..)
    }

    pub fn all_defs(&self) -> Vec<ResourceDef> {
        let mut defs = self.builtins.clone();
        defs.extend(self.crds.values().flatten().cloned());
        defs
    }

    pub fn find(&self, group: &str, version: &str, plural: &str) -> Option<ResourceDef> {
        self.builtins
            .iter()
            .chain(self.crds.values().flatten())
            .find(|d| d.group == group && d.version == version && d.plural == plural)
            .cloned()
    }

    fn bucket(&self, def: &ResourceDef) -> Option<&BTreeMap<(String, String), Value>> {
        self.objects.get(&def.storage_key())
    }

    /// The key of `name` and the object stored under it, or NotFound.
    fn stored(
        &self,
        def: &ResourceDef,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<((String, String), Value), ApiError> {
        let key = Self::object_key(def, namespace, name);
        let object = self
            .bucket(def)
            .and_then(|b| b.get(&key))
            .cloned()
            .ok_or_else(|| ApiError::not_found(def, name))?;
        Ok((key, object))
    }

    fn object_key(def: &ResourceDef, namespace: Option<&str>, name: &str) -> (String, String) {
        let ns = if def.namespaced {
            namespace.unwrap_or_default()
        } else {
            ""
        };
        (ns.to_string(), name.to_string())
    }

    /// The object as served at `def`'s version.
    pub fn present(def: &ResourceDef, object: &Value) -> Value {
        if def.is_events_alias() {
            let mut out = crate::events::from_core(object.clone());
            out["kind"] = json!("Event");
            return out;
        }
        let mut out = object.clone();
        out["apiVersion"] = json!(def.api_version());
        out["kind"] = json!(def.kind);
        out
    }

    pub fn get(
        &self,
        def: &ResourceDef,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Value, ApiError> {
        self.bucket(def)
            .and_then(|b| b.get(&Self::object_key(def, namespace, name)))
            .map(|o| Self::present(def, o))
            .ok_or_else(|| ApiError::not_found(def, name))
    }

    pub fn list(
        &self,
        def: &ResourceDef,
        namespace: Option<&str>,
        labels: &LabelSelector,
        fields: &FieldSelector,
    ) -> Vec<Value> {
        self.bucket(def)
            .into_iter()
            .flat_map(|b| b.iter())
            .filter(|((ns, _), _)| namespace.is_none_or(|want| !def.namespaced || ns == want))
            .map(|(_, o)| Self::present(def, o))
            .filter(|o| labels.matches(o) && fields.matches(o))
            .collect()
    }

    fn record(
        &mut self,
        def: &ResourceDef,
        event_type: EventType,
        object: &Value,
        old: Option<Value>,
    ) {
        let namespace = meta_str(object, "namespace")
            .unwrap_or_default()
            .to_string();
        self.history.push_back(StoredEvent {
            rv: self.rv,
            key: def.storage_key(),
            namespace,
            event_type,
            object: object.clone(),
            old,
        });
        while self.history.len() > HISTORY_LIMIT {
            self.history.pop_front();
        }
    }

    fn next_rv(&mut self) -> String {
        self.rv += 1;
        self.rv.to_string()
    }

    /// Stores `object` under `key` with the next resourceVersion and records the watch event:
    /// ADDED without an `old` object, MODIFIED with one. Registers the resources of a CRD.
    fn put(
        &mut self,
        def: &ResourceDef,
        key: (String, String),
        mut object: Value,
        old: Option<Value>,
    ) -> Value {
        let rv = self.next_rv();
        meta_mut(&mut object).insert("resourceVersion".into(), json!(rv));
        if Self::is_crd(def) {
            let defs = crd_resources(&object).expect("validated before it is stored");
            self.crds.insert(key.1.clone(), defs);
        }
        self.objects
            .entry(def.storage_key())
            .or_default()
            .insert(key.clone(), object.clone());
        let event = if old.is_some() {
            EventType::Modified
        } else {
            EventType::Added
        };
        let old_owners = old.as_ref().map(gc::owner_uids).unwrap_or_default();
        self.record(def, event, &object, old);
        self.gc_after_put(def, &key, &object, old_owners);
        object
    }

    /// Records the deletion of `object` (already out of the store) at the next resourceVersion.
    fn record_deletion(&mut self, def: &ResourceDef, mut object: Value) -> Value {
        let rv = self.next_rv();
        meta_mut(&mut object).insert("resourceVersion".into(), json!(rv));
        self.record(def, EventType::Deleted, &object, None);
        self.gc_after_removal(def, &object);
        object
    }

    fn namespace_exists(&self, namespace: &str) -> bool {
        self.objects
            .get(&(String::new(), "namespaces".to_string()))
            .is_some_and(|b| b.contains_key(&(String::new(), namespace.to_string())))
    }

    /// Checks kind/apiVersion, decodes like the real server and returns warnings for pruned fields.
    fn decode(
        &self,
        def: &ResourceDef,
        body: &mut Value,
        options: &WriteOptions,
    ) -> Result<Vec<String>, ApiError> {
        if !body.is_object() {
            return Err(ApiError::bad_request(
                "the body of the request must be a JSON object",
            ));
        }
        let name = meta_str(body, "name").unwrap_or_default().to_string();
        match body.get("kind").and_then(Value::as_str) {
            Some(kind) if !kind.is_empty() && kind != def.kind => {
                return Err(ApiError::bad_request(format!(
                    "the kind of the object ({kind}) does not match the kind of the resource ({})",
                    def.kind
                )))
            }
            _ => body["kind"] = json!(def.kind),
        }
        match body.get("apiVersion").and_then(Value::as_str) {
            Some(v) if !v.is_empty() && v != def.api_version() => {
                return Err(ApiError::bad_request(format!(
                    "the API version in the data ({v}) does not match the expected API version ({})",
                    def.api_version()
                )))
            }
            _ => body["apiVersion"] = json!(def.api_version()),
        }
        let cannot = |why: String| {
            ApiError::bad_request(format!(
                "{} in version {:?} cannot be handled as a {}: {why}",
                def.kind, def.version, def.kind
            ))
        };
        let lost = match &def.schema {
            Some(schema) => decode_custom(schema, body),
            None => decode_builtin(&def.kind, body),
        };
        let lost = match lost {
            Ok(lost) => lost,
            Err(DecodeError::Undecodable(why)) => return Err(cannot(why)),
            Err(DecodeError::Invalid(causes)) => {
                return Err(ApiError::invalid(def, &name, &causes))
            }
        };
        let unknown: Vec<String> = lost
            .iter()
            .map(|f| format!("unknown field {f:?}"))
            .collect();
        match options.field_validation {
            FieldValidation::Strict if !unknown.is_empty() => Err(cannot(format!(
                "strict decoding error: {}",
                unknown.join(", ")
            ))),
            FieldValidation::Ignore => Ok(Vec::new()),
            _ => Ok(unknown),
        }
    }

    /// Kind-specific validation the real server applies before storing.
    fn validate(&self, def: &ResourceDef, object: &Value) -> Result<(), ApiError> {
        let name = meta_str(object, "name").unwrap_or_default();
        let name_ok = if def.kind == "Namespace" {
            is_dns_label(name)
        } else if def.kind == "Event" {
            !name.is_empty() && !name.contains('/')
        } else {
            is_dns_subdomain(name)
        };
        if !name_ok {
            let rule = if def.kind == "Namespace" {
                "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character"
            } else {
                "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character"
            };
            return Err(ApiError::invalid(
                def,
                name,
                &[(
                    "metadata.name".into(),
                    format!("Invalid value: {name:?}: {rule}"),
                )],
            ));
        }
        let label_causes = rules::validate_labels(object);
        if !label_causes.is_empty() {
            return Err(ApiError::invalid(def, name, &label_causes));
        }
        if def.group.is_empty() && def.kind == "Event" {
            let causes = rules::validate_event(object);
            if !causes.is_empty() {
                return Err(ApiError::invalid(def, name, &causes));
            }
        }
        if def.group == "resource.k8s.io" && def.kind == "ResourceSlice" {
            let slice: k8s_openapi::api::resource::v1::ResourceSlice =
                serde_json::from_value(object.clone()).map_err(|e| {
                    ApiError::bad_request(format!("ResourceSlice cannot be decoded: {e}"))
                })?;
            let errors = gpupool_api::validation::validate_resource_slice(&slice);
            if !errors.is_empty() {
                let causes: Vec<(String, String)> =
                    errors.into_iter().map(|e| (e.field, e.message)).collect();
                return Err(ApiError::invalid(def, name, &causes));
            }
        }
        if def.kind == "CustomResourceDefinition" && def.group == "apiextensions.k8s.io" {
            crd_resources(object).map_err(|CrdError::Invalid { field, message }| {
                ApiError::invalid(def, name, &[(field, message)])
            })?;
        }
        Ok(())
    }

    fn is_crd(def: &ResourceDef) -> bool {
        def.kind == "CustomResourceDefinition" && def.group == "apiextensions.k8s.io"
    }

    fn crd_status(crd: &Value) -> Value {
        let now = clock::format_rfc3339(clock::unix_now());
        let condition = |kind: &str, reason: &str| json!({"type": kind, "status": "True", "reason": reason, "message": "", "lastTransitionTime": now});
        json!({
            "acceptedNames": crd.pointer("/spec/names").cloned().unwrap_or(json!({})),
            "conditions": [condition("NamesAccepted", "NoConflicts"), condition("Established", "InitialNamesAccepted")],
            "storedVersions": crd.pointer("/spec/versions").and_then(Value::as_array).map(|vs| {
                vs.iter().filter(|v| v.get("storage").and_then(Value::as_bool) == Some(true))
                    .filter_map(|v| v.get("name").cloned()).collect::<Vec<_>>()
            }).unwrap_or_default(),
        })
    }

    /// The core Events resource that stores `events.k8s.io/v1` Events.
    fn core_events(&self) -> ResourceDef {
        self.find("", "v1", "events").expect("built in")
    }

    pub fn create(
        &mut self,
        def: &ResourceDef,
        namespace: Option<&str>,
        mut body: Value,
        options: WriteOptions,
    ) -> Result<WriteOutcome, ApiError> {
        if def.is_events_alias() {
            let core = self.core_events();
            let mut outcome =
                self.create(&core, namespace, crate::events::to_core(body), options)?;
            outcome.object = Self::present(def, &outcome.object);
            return Ok(outcome);
        }
        let warnings = self.decode(def, &mut body, &options)?;
        self.drop_disabled_fields(def, &mut body);
        drop_empty_metadata(&mut body);
        let namespace = if def.namespaced {
            let url_ns = namespace.unwrap_or_default();
            let body_ns = meta_str(&body, "namespace").unwrap_or_default();
            if !body_ns.is_empty() && !url_ns.is_empty() && body_ns != url_ns {
                return Err(ApiError::bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request",
                ));
            }
            let ns = if url_ns.is_empty() { body_ns } else { url_ns }.to_string();
            if ns.is_empty() {
                return Err(ApiError::bad_request(
                    "a namespaced object needs a namespace",
                ));
            }
            if !self.namespace_exists(&ns) {
                return Err(ApiError::namespace_not_found(&ns));
            }
            Some(ns)
        } else {
            None
        };
        let mut name = meta_str(&body, "name").unwrap_or_default().to_string();
        if name.is_empty() {
            match meta_str(&body, "generateName").filter(|g| !g.is_empty()) {
                Some(prefix) => loop {
                    // Like upstream, the prefix is cut so that the name fits 63 characters.
                    let prefix: String = prefix.chars().take(58).collect();
                    let candidate = format!("{prefix}{}", random_suffix());
                    let key = Self::object_key(def, namespace.as_deref(), &candidate);
                    if !self.bucket(def).is_some_and(|b| b.contains_key(&key)) {
                        name = candidate;
                        break;
                    }
                },
                None => {
                    return Err(ApiError::invalid(
                        def,
                        "",
                        &[(
                            "metadata.name".into(),
                            "Required value: name or generateName is required".into(),
                        )],
                    ))
                }
            }
        }
        let key = Self::object_key(def, namespace.as_deref(), &name);
        if self.bucket(def).is_some_and(|b| b.contains_key(&key)) {
            return Err(ApiError::already_exists(def, &name));
        }
        {
            let meta = meta_mut(&mut body);
            meta.insert("name".into(), json!(name));
            match &namespace {
                Some(ns) => meta.insert("namespace".into(), json!(ns)),
                None => meta.remove("namespace"),
            };
            meta.insert("uid".into(), json!(uuid::Uuid::new_v4().to_string()));
            meta.insert(
                "creationTimestamp".into(),
                json!(clock::format_rfc3339(clock::unix_now())),
            );
            if crate::resources::tracks_generation(def) {
                meta.insert("generation".into(), json!(1));
            } else {
                meta.remove("generation");
            }
            meta.remove("deletionTimestamp");
            meta.remove("deletionGracePeriodSeconds");
            meta.remove("resourceVersion");
            meta.remove("managedFields");
        }
        match def.kind.as_str() {
            "Pod" if def.group.is_empty() => body["status"] = json!({"phase": "Pending"}),
            "Namespace" if def.group.is_empty() => body["status"] = json!({"phase": "Active"}),
            "CustomResourceDefinition" => body["status"] = Self::crd_status(&body),
            _ if def.status_subresource && def.kind != "Node" => {
                if let Some(map) = body.as_object_mut() {
                    map.remove("status");
                }
            }
            _ => {}
        }
        self.validate(def, &body)?;
        if options.dry_run {
            return Ok(WriteOutcome {
                object: body,
                created: true,
                warnings,
            });
        }
        let body = self.put(def, key, body, None);
        Ok(WriteOutcome {
            object: Self::present(def, &body),
            created: true,
            warnings,
        })
    }

    /// PUT of the object or of its `status` subresource.
    pub fn update(
        &mut self,
        def: &ResourceDef,
        namespace: Option<&str>,
        name: &str,
        mut body: Value,
        subresource: Option<&str>,
        options: WriteOptions,
    ) -> Result<WriteOutcome, ApiError> {
        if def.is_events_alias() {
            let core = self.core_events();
            let mut outcome = self.update(
                &core,
                namespace,
                name,
                crate::events::to_core(body),
                subresource,
                options,
            )?;
            outcome.object = Self::present(def, &outcome.object);
            return Ok(outcome);
        }
        let (key, existing) = self.stored(def, namespace, name)?;
        let warnings = self.decode(def, &mut body, &options)?;
        self.drop_disabled_fields(def, &mut body);
        drop_empty_metadata(&mut body);
        let body_name = meta_str(&body, "name").unwrap_or_default();
        if !body_name.is_empty() && body_name != name {
            return Err(ApiError::bad_request(format!(
                "the name of the object ({body_name}) does not match the name on the URL ({name})"
            )));
        }
        if def.namespaced {
            let body_ns = meta_str(&body, "namespace").unwrap_or_default();
            if !body_ns.is_empty() && Some(body_ns) != namespace {
                return Err(ApiError::bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request",
                ));
            }
        }
        let current_rv = meta_str(&existing, "resourceVersion").unwrap_or_default();
        if let Some(given) = meta_str(&body, "resourceVersion").filter(|rv| !rv.is_empty()) {
            if given != current_rv {
                return Err(ApiError::stale(def, name));
            }
        }
        if let Some(given) = meta_str(&body, "uid").filter(|u| !u.is_empty()) {
            if Some(given) != meta_str(&existing, "uid") {
                return Err(ApiError::conflict(
                    def,
                    name,
                    "Precondition failed: UID in precondition does not match the UID of the object",
                ));
            }
        }
        // The status subresource changes only status; the main endpoint of a kind with a status
        // subresource changes everything but status.
        let (mut updated, status_from) = match subresource {
            Some("status") => (existing.clone(), Some(&body)),
            Some(other) => {
                return Err(ApiError::not_found_path(&format!("{}/{other}", def.plural)));
            }
            None => (body, def.status_subresource.then_some(&existing)),
        };
        if let (Some(from), Some(map)) = (status_from, updated.as_object_mut()) {
            rules::copy_fields(map, from, &["status"]);
        }
        {
            let old_meta = existing["metadata"]
                .as_object()
                .cloned()
                .unwrap_or_default();
            let meta = meta_mut(&mut updated);
            rules::copy_fields(
                meta,
                &existing["metadata"],
                &[
                    "name",
                    "namespace",
                    "uid",
                    "creationTimestamp",
                    "generation",
                    "deletionTimestamp",
                    "deletionGracePeriodSeconds",
                ],
            );
            meta.insert("resourceVersion".into(), json!(current_rv));
            meta.remove("managedFields");
            if subresource == Some("status") {
                // The status subresource changes nothing but status.
                *meta = old_meta;
            }
        }
        if spec_part(&updated) != spec_part(&existing)
            && subresource.is_none()
            && crate::resources::tracks_generation(def)
        {
            let generation = existing
                .pointer("/metadata/generation")
                .and_then(Value::as_i64)
                .unwrap_or(0)
                + 1;
            meta_mut(&mut updated).insert("generation".into(), json!(generation));
        }
        if Self::is_crd(def) && subresource.is_none() {
            updated["status"] = Self::crd_status(&updated);
            if let Some(conditions) = existing.pointer("/status/conditions") {
                updated["status"]["conditions"] = conditions.clone();
            }
        }
        let mut causes = if subresource.is_none() {
            rules::validate_update(&def.group, &def.kind, &existing, &updated)
        } else {
            Vec::new()
        };
        if def.group == "resource.k8s.io" && def.kind == "ResourceClaim" {
            rules::drop_deallocated_status_devices(&existing, &mut updated);
            causes.extend(rules::validate_claim_status(Some(&existing), &updated));
            if let (Some(requester), Some("status")) = (&options.requester, subresource) {
                causes.extend(crate::auth::claim_status_causes(
                    self,
                    &requester.user,
                    requester.verb,
                    name,
                    namespace,
                    &existing,
                    &updated,
                ));
            }
        }
        causes.extend(rules::validate_finalizers(&existing, &updated));
        if !causes.is_empty() {
            return Err(ApiError::invalid(def, name, &causes));
        }
        self.validate(def, &updated)?;
        if updated == existing {
            return Ok(WriteOutcome {
                object: Self::present(def, &existing),
                created: false,
                warnings,
            });
        }
        if options.dry_run {
            return Ok(WriteOutcome {
                object: Self::present(def, &updated),
                created: false,
                warnings,
            });
        }
        let finalizers_done = updated
            .pointer("/metadata/finalizers")
            .and_then(Value::as_array)
            .is_none_or(|f| f.is_empty());
        if updated.pointer("/metadata/deletionTimestamp").is_some() && finalizers_done {
            let removed = self.remove(def, &key, updated)?;
            return Ok(WriteOutcome {
                object: Self::present(def, &removed),
                created: false,
                warnings,
            });
        }
        let updated = self.put(def, key, updated, Some(existing));
        Ok(WriteOutcome {
            object: Self::present(def, &updated),
            created: false,
            warnings,
        })
    }

    #[allow(clippy::too_many_arguments)]
    pub fn patch(
        &mut self,
        def: &ResourceDef,
        namespace: Option<&str>,
        name: &str,
        patch_type: PatchType,
        body: &[u8],
        subresource: Option<&str>,
        options: WriteOptions,
    ) -> Result<WriteOutcome, ApiError> {
        let patch_doc: Value = match patch_type {
            PatchType::Apply => serde_yaml::from_slice(body)
                .map_err(|e| ApiError::bad_request(format!("error decoding YAML: {e}")))?,
            _ => serde_json::from_slice(body)
                .map_err(|e| ApiError::bad_request(format!("error decoding patch: {e}")))?,
        };
        let key = Self::object_key(def, namespace, name);
        let existing = self.bucket(def).and_then(|b| b.get(&key)).cloned();
        let Some(existing) = existing else {
            if patch_type == PatchType::Apply && subresource.is_none() {
                let mut created = patch_doc;
                meta_mut(&mut created).insert("name".into(), json!(name));
                return self.create(def, namespace, created, options);
            }
            return Err(ApiError::not_found(def, name));
        };
        let mut patched = Self::present(def, &existing);
        match patch_type {
            PatchType::Merge | PatchType::Apply => patch::merge_patch(&mut patched, &patch_doc),
            PatchType::Strategic => patch::strategic_merge_patch(&mut patched, &patch_doc),
            PatchType::Json => patch::json_patch(&mut patched, &patch_doc)
                .map_err(|e| ApiError::invalid_patch(def, name, &e.to_string()))?,
        }
        if patched.pointer("/metadata/resourceVersion").is_none() {
            // A patch that deletes resourceVersion means an unconditional write, as upstream.
            meta_mut(&mut patched).insert(
                "resourceVersion".into(),
                json!(meta_str(&existing, "resourceVersion").unwrap_or_default()),
            );
        }
        self.update(def, namespace, name, patched, subresource, options)
    }

    fn remove(
        &mut self,
        def: &ResourceDef,
        key: &(String, String),
        object: Value,
    ) -> Result<Value, ApiError> {
        if let Some(bucket) = self.objects.get_mut(&def.storage_key()) {
            bucket.remove(key);
        }
        let object = self.record_deletion(def, object);
        if Self::is_crd(def) {
            if let Some(first) = self.crds.get(&key.1).and_then(|d| d.first()).cloned() {
                let children: Vec<((String, String), Value)> = self
                    .objects
                    .remove(&first.storage_key())
                    .unwrap_or_default()
                    .into_iter()
                    .collect();
                for (_, child) in children {
                    self.record_deletion(&first, child);
                }
                // Upstream deletes the custom objects while their kind is still served, so the
                // collector can tell that the dependents' owners are gone.
                self.run_gc();
            }
            self.crds.remove(&key.1);
        }
        if def.kind == "Namespace" && def.group.is_empty() {
            let namespaced: Vec<ResourceDef> = self
                .all_defs()
                .into_iter()
                .filter(|d| d.namespaced)
                .collect();
            let mut seen = std::collections::BTreeSet::new();
            for child_def in namespaced {
                if !seen.insert(child_def.storage_key()) {
                    continue;
                }
                let keys: Vec<(String, String)> = self
                    .bucket(&child_def)
                    .map(|b| b.keys().filter(|(ns, _)| ns == &key.1).cloned().collect())
                    .unwrap_or_default();
                for child_key in keys {
                    if let Some(child) = self
                        .objects
                        .get_mut(&child_def.storage_key())
                        .and_then(|b| b.remove(&child_key))
                    {
                        self.record_deletion(&child_def, child);
                    }
                }
            }
        }
        self.run_gc();
        Ok(object)
    }

    /// Deletes at once, or marks for deletion while finalizers remain (like the real server), with
    /// background propagation to the dependents.
    pub fn delete(
        &mut self,
        def: &ResourceDef,
        namespace: Option<&str>,
        name: &str,
        preconditions: &Preconditions,
        dry_run: bool,
    ) -> Result<Value, ApiError> {
        let options = DeleteOptions {
            preconditions: preconditions.clone(),
            dry_run,
            propagation: None,
        };
        self.delete_with(def, namespace, name, &options)
    }

    /// A DELETE with its options: preconditions, dry run, and what happens to the dependents
    /// (see the module `gc`).
    pub fn delete_with(
        &mut self,
        def: &ResourceDef,
        namespace: Option<&str>,
        name: &str,
        options: &DeleteOptions,
    ) -> Result<Value, ApiError> {
        let preconditions = &options.preconditions;
        let (key, existing) = self.stored(def, namespace, name)?;
        if let Some(uid) = &preconditions.uid {
            if meta_str(&existing, "uid") != Some(uid.as_str()) {
                return Err(ApiError::conflict(
                    def,
                    name,
                    &format!(
                        "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                        meta_str(&existing, "uid").unwrap_or_default()
                    ),
                ));
            }
        }
        if let Some(rv) = &preconditions.resource_version {
            if meta_str(&existing, "resourceVersion") != Some(rv.as_str()) {
                return Err(ApiError::conflict(def, name, &format!("Precondition failed: ResourceVersion in precondition: {rv}, ResourceVersion in object meta: {}", meta_str(&existing, "resourceVersion").unwrap_or_default())));
            }
        }
        if def.group.is_empty() && def.kind == "Namespace" && PROTECTED_NAMESPACES.contains(&name) {
            return Err(ApiError::forbidden(
                def,
                name,
                "this namespace may not be deleted",
            ));
        }
        if options.dry_run {
            return Ok(Self::present(def, &existing));
        }
        let deleted = self.delete_stored(def, key, existing, options.propagation)?;
        Ok(Self::present(def, &deleted))
    }

    /// Deletes every object that matches, each with `options` (their preconditions aside).
    pub fn delete_collection(
        &mut self,
        def: &ResourceDef,
        namespace: Option<&str>,
        labels: &LabelSelector,
        fields: &FieldSelector,
        options: &DeleteOptions,
    ) -> Result<Vec<Value>, ApiError> {
        let targets = self.list(def, namespace, labels, fields);
        let each = DeleteOptions {
            preconditions: Preconditions::default(),
            ..options.clone()
        };
        let mut deleted = Vec::new();
        for object in targets {
            let ns = meta_str(&object, "namespace").map(String::from);
            let name = meta_str(&object, "name").unwrap_or_default().to_string();
            // An earlier one's dependents may be among them, and gone already.
            match self.delete_with(def, ns.as_deref(), &name, &each) {
                Ok(object) => deleted.push(object),
                Err(e) if e.code == 404 => {}
                Err(e) => return Err(e),
            }
        }
        Ok(deleted)
    }

    /// `POST pods/<name>/binding`: sets spec.nodeName once, like the real binding subresource.
    pub fn bind_pod(
        &mut self,
        namespace: &str,
        name: &str,
        binding: &Value,
    ) -> Result<(), ApiError> {
        let pods = self.find("", "v1", "pods").expect("built in");
        let node = binding
            .pointer("/target/name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .ok_or_else(|| {
                ApiError::invalid(
                    &pods,
                    name,
                    &[("target.name".into(), "Required value".into())],
                )
            })?;
        let pod = self.get(&pods, Some(namespace), name)?;
        if let Some(current) = pod
            .pointer("/spec/nodeName")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
        {
            return Err(ApiError::conflict(
                &pods,
                name,
                &format!("pod {name} is already assigned to node {current:?}"),
            ));
        }
        let mut bound = pod.clone();
        bound["spec"]["nodeName"] = json!(node);
        let now = clock::format_rfc3339(clock::unix_now());
        let mut conditions: Vec<Value> = bound
            .pointer("/status/conditions")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        conditions.retain(|c| c.get("type").and_then(Value::as_str) != Some("PodScheduled"));
        conditions.push(json!({"type": "PodScheduled", "status": "True", "lastProbeTime": null, "lastTransitionTime": now}));
        bound["status"]["conditions"] = json!(conditions);
        // Binding changes spec and status in one write, which neither endpoint alone allows.
        let key = Self::object_key(&pods, Some(namespace), name);
        self.put(&pods, key, bound, Some(pod));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cm_def(store: &Store) -> ResourceDef {
        store.find("", "v1", "configmaps").unwrap()
    }

    /// Creates `body` in the default namespace, with the default options.
    fn create(store: &mut Store, def: &ResourceDef, body: Value) -> Result<WriteOutcome, ApiError> {
        store.create(def, Some("default"), body, WriteOptions::default())
    }

    /// Updates `name` in the default namespace (or its `subresource`), with the default options.
    fn update(
        store: &mut Store,
        def: &ResourceDef,
        name: &str,
        body: Value,
        subresource: Option<&str>,
    ) -> Result<WriteOutcome, ApiError> {
        store.update(
            def,
            Some("default"),
            name,
            body,
            subresource,
            WriteOptions::default(),
        )
    }

    /// Patches `name` in the default namespace, with the default options.
    fn patch(
        store: &mut Store,
        def: &ResourceDef,
        name: &str,
        patch_type: PatchType,
        body: &[u8],
    ) -> Result<WriteOutcome, ApiError> {
        store.patch(
            def,
            Some("default"),
            name,
            patch_type,
            body,
            None,
            WriteOptions::default(),
        )
    }

    fn create_cm(store: &mut Store, name: &str) -> Value {
        let def = cm_def(store);
        create(
            store,
            &def,
            json!({"metadata": {"name": name}, "data": {"a": "1"}}),
        )
        .unwrap()
        .object
    }

    #[test]
    fn create_sets_server_fields_and_rejects_duplicates() {
        let mut store = Store::new();
        let obj = create_cm(&mut store, "a");
        // As on kube-apiserver: a ConfigMap (like a ResourceClaim or a Node) has no generation.
        assert_eq!(obj["metadata"]["generation"], Value::Null);
        assert!(obj["metadata"]["uid"].as_str().unwrap().len() == 36);
        assert_eq!(
            obj["metadata"]["resourceVersion"],
            store.current_rv().to_string()
        );
        let def = cm_def(&store);
        let err = create(&mut store, &def, json!({"metadata": {"name": "a"}})).unwrap_err();
        assert_eq!((err.code, err.reason), (409, "AlreadyExists"));
    }

    #[test]
    fn empty_metadata_collections_are_not_stored() {
        let mut store = Store::new();
        let def = cm_def(&store);
        let obj = create(&mut store, &def, json!({"metadata": {"name": "e", "labels": {}, "annotations": {}, "finalizers": [], "generateName": ""}}))
            .unwrap()
            .object;
        let mut keys: Vec<&String> = obj["metadata"].as_object().unwrap().keys().collect();
        keys.sort();
        assert_eq!(
            keys,
            [
                "creationTimestamp",
                "name",
                "namespace",
                "resourceVersion",
                "uid"
            ]
        );
    }

    #[test]
    fn failing_json_patch_is_invalid_and_changes_nothing() {
        let mut store = Store::new();
        let def = cm_def(&store);
        let before = create_cm(&mut store, "j");
        let doc = br#"[{"op": "test", "path": "/data/a", "value": "2"}, {"op": "remove", "path": "/data"}]"#;
        let err = patch(&mut store, &def, "j", PatchType::Json, doc).unwrap_err();
        assert_eq!((err.code, err.reason), (422, "Invalid"));
        assert_eq!(store.get(&def, Some("default"), "j").unwrap(), before);
    }

    #[test]
    fn missing_namespace_is_not_found() {
        let mut store = Store::new();
        let def = cm_def(&store);
        let err = store
            .create(
                &def,
                Some("nope"),
                json!({"metadata": {"name": "a"}}),
                WriteOptions::default(),
            )
            .unwrap_err();
        assert_eq!(err.code, 404);
        assert!(err.message.contains("namespaces \"nope\" not found"));
    }

    #[test]
    fn stale_update_conflicts_and_generation_tracks_spec() {
        let mut store = Store::new();
        let def = cm_def(&store);
        let obj = create_cm(&mut store, "a");
        let mut changed = obj.clone();
        changed["data"]["a"] = json!("2");
        let updated = update(&mut store, &def, "a", changed.clone(), None).unwrap();
        assert_eq!(updated.object["metadata"]["generation"], Value::Null);
        let err = update(&mut store, &def, "a", changed, None).unwrap_err();
        assert_eq!((err.code, err.reason), (409, "Conflict"));

        // A kind that keeps a generation: a DeviceClass's spec change bumps it, labels do not.
        let def = store
            .find("resource.k8s.io", "v1", "deviceclasses")
            .unwrap();
        let class = create(
            &mut store,
            &def,
            json!({"metadata": {"name": "a"}, "spec": {"selectors": []}}),
        )
        .unwrap()
        .object;
        assert_eq!(class["metadata"]["generation"], 1);
        let mut changed = class.clone();
        changed["spec"]["selectors"] = json!([{"cel": {"expression": "true"}}]);
        let updated = update(&mut store, &def, "a", changed, None).unwrap();
        assert_eq!(updated.object["metadata"]["generation"], 2);
        let mut relabelled = updated.object.clone();
        relabelled["metadata"]["labels"] = json!({"x": "y"});
        let out = update(&mut store, &def, "a", relabelled, None).unwrap();
        assert_eq!(
            out.object["metadata"]["generation"], 2,
            "labels are not spec"
        );
    }

    #[test]
    fn status_subresource_separates_spec_and_status() {
        let mut store = Store::new();
        let def = store
            .find("resource.k8s.io", "v1", "resourceclaims")
            .unwrap();
        let claim = create(
            &mut store,
            &def,
            json!({"metadata": {"name": "c"}, "spec": {}, "status": {"x": 1}}),
        )
        .unwrap()
        .object;
        assert!(claim.get("status").is_none(), "status is dropped on create");
        let mut with_status = claim.clone();
        with_status["status"] = json!({"allocation": {"devices": {"results": []}}, "reservedFor": [{"resource": "pods", "name": "p", "uid": "u"}]});
        let out = update(&mut store, &def, "c", with_status.clone(), None).unwrap();
        assert!(
            out.object.get("status").is_none(),
            "main endpoint ignores status"
        );
        let out = update(&mut store, &def, "c", with_status, Some("status")).unwrap();
        assert_eq!(out.object["status"]["reservedFor"][0]["name"], "p");
        assert_eq!(out.object["metadata"]["generation"], Value::Null);
    }

    #[test]
    fn finalizers_delay_deletion() {
        let mut store = Store::new();
        let def = cm_def(&store);
        create(
            &mut store,
            &def,
            json!({"metadata": {"name": "f", "finalizers": ["x/y"]}}),
        )
        .unwrap();
        let marked = store
            .delete(&def, Some("default"), "f", &Preconditions::default(), false)
            .unwrap();
        assert!(marked["metadata"]["deletionTimestamp"].is_string());
        let doc = br#"{"metadata":{"finalizers":null}}"#;
        patch(&mut store, &def, "f", PatchType::Merge, doc).unwrap();
        assert_eq!(store.get(&def, Some("default"), "f").unwrap_err().code, 404);
        let types: Vec<_> = store
            .events_after(0)
            .filter(|e| e.key.1 == "configmaps")
            .map(|e| e.event_type)
            .collect();
        assert_eq!(
            types,
            vec![EventType::Added, EventType::Modified, EventType::Deleted]
        );
    }

    #[test]
    fn strict_decoding_names_unknown_field() {
        let mut store = Store::new();
        let def = cm_def(&store);
        let strict = WriteOptions {
            field_validation: FieldValidation::Strict,
            ..Default::default()
        };
        let err = store
            .create(
                &def,
                Some("default"),
                json!({"metadata": {"name": "s"}, "dataa": {}}),
                strict,
            )
            .unwrap_err();
        assert_eq!(err.code, 400);
        assert!(
            err.message.contains("unknown field \"dataa\""),
            "{}",
            err.message
        );
        let ok = create(
            &mut store,
            &def,
            json!({"metadata": {"name": "s"}, "dataa": {}}),
        )
        .unwrap();
        assert!(ok.object.get("dataa").is_none());
        assert_eq!(ok.warnings, vec!["unknown field \"dataa\"".to_string()]);
    }

    #[test]
    fn crd_registers_and_unregisters_its_resources() {
        let mut store = Store::new();
        let crds = store
            .find("apiextensions.k8s.io", "v1", "customresourcedefinitions")
            .unwrap();
        let crd = json!({"metadata": {"name": "widgets.example.dev"}, "spec": {"group": "example.dev", "scope": "Namespaced",
            "names": {"plural": "widgets", "kind": "Widget"},
            "versions": [{"name": "v1", "served": true, "storage": true,
                "schema": {"openAPIV3Schema": {"type": "object", "properties": {"spec": {"type": "object", "properties": {"size": {"type": "integer"}}}}}}}]}});
        let created = store
            .create(&crds, None, crd, WriteOptions::default())
            .unwrap()
            .object;
        assert_eq!(created["status"]["conditions"][1]["type"], "Established");
        let widgets = store
            .find("example.dev", "v1", "widgets")
            .expect("served after CRD creation");
        create(
            &mut store,
            &widgets,
            json!({"metadata": {"name": "w"}, "spec": {"size": 3}}),
        )
        .unwrap();
        store
            .delete(
                &crds,
                None,
                "widgets.example.dev",
                &Preconditions::default(),
                false,
            )
            .unwrap();
        assert!(store.find("example.dev", "v1", "widgets").is_none());
    }

    #[test]
    fn generate_name_and_binding() {
        let mut store = Store::new();
        let pods = store.find("", "v1", "pods").unwrap();
        let pod = create(&mut store, &pods, json!({"metadata": {"generateName": "web-"}, "spec": {"containers": [{"name": "c", "image": "i"}]}}))
            .unwrap()
            .object;
        let name = pod["metadata"]["name"].as_str().unwrap().to_string();
        assert!(name.starts_with("web-") && name.len() == 9);
        store
            .bind_pod(
                "default",
                &name,
                &json!({"target": {"kind": "Node", "name": "n1"}}),
            )
            .unwrap();
        assert_eq!(
            store.get(&pods, Some("default"), &name).unwrap()["spec"]["nodeName"],
            "n1"
        );
        let again = store
            .bind_pod("default", &name, &json!({"target": {"name": "n2"}}))
            .unwrap_err();
        assert_eq!(again.code, 409);
    }

    /// A counter slice and a device slice of one pool, as a driver with MIG devices publishes them.
    fn partitioned_slices() -> (Value, Value) {
        let pool = json!({"name": "node-a", "generation": 1, "resourceSliceCount": 2});
        let counters = json!({
            "metadata": {"name": "node-a-gpupool.dev-0"},
            "spec": {"driver": "gpupool.dev", "nodeName": "node-a", "pool": pool,
                     "sharedCounters": [{"name": "gpu-0-counters",
                                         "counters": {"memory-slice-0": {"value": "1"}}}]}
        });
        let devices = json!({
            "metadata": {"name": "node-a-gpupool.dev-1"},
            "spec": {"driver": "gpupool.dev", "nodeName": "node-a", "pool": pool,
                     "devices": [{"name": "gpu-0-mig-1g-10gb-0",
                                  "consumesCounters": [{"counterSet": "gpu-0-counters",
                                                        "counters": {"memory-slice-0": {"value": "1"}}}]}]}
        });
        (counters, devices)
    }

    #[test]
    fn counter_slices_are_kept_and_validated_as_1_36_does() {
        let mut store = Store::new();
        let def = store
            .find("resource.k8s.io", "v1", "resourceslices")
            .unwrap();
        let (counters, devices) = partitioned_slices();
        let stored = store
            .create(&def, None, counters.clone(), WriteOptions::default())
            .unwrap()
            .object;
        assert_eq!(
            stored["spec"]["sharedCounters"],
            counters["spec"]["sharedCounters"]
        );
        let stored = store
            .create(&def, None, devices, WriteOptions::default())
            .unwrap()
            .object;
        assert!(stored["spec"]["devices"][0]["consumesCounters"].is_array());

        let mut both = counters;
        both["metadata"]["name"] = json!("both");
        both["spec"]["devices"] = json!([{"name": "gpu-1"}]);
        let err = store
            .create(&def, None, both, WriteOptions::default())
            .unwrap_err();
        assert_eq!(err.code, 422);
        assert!(
            err.message
                .contains("only one of `sharedCounters` or `devices` is allowed"),
            "{}",
            err.message
        );
    }

    #[test]
    fn without_partitionable_devices_the_counter_fields_are_dropped_silently() {
        let mut store = Store::new();
        store.set_partitionable_devices(false);
        let def = store
            .find("resource.k8s.io", "v1", "resourceslices")
            .unwrap();
        let (counters, devices) = partitioned_slices();
        let stored = store
            .create(&def, None, counters, WriteOptions::default())
            .unwrap();
        assert!(stored.object["spec"].get("sharedCounters").is_none());
        assert!(stored.warnings.is_empty(), "no word about it");
        let stored = store
            .create(&def, None, devices.clone(), WriteOptions::default())
            .unwrap()
            .object;
        assert!(stored["spec"]["devices"][0]
            .get("consumesCounters")
            .is_none());
        let mut again = stored;
        again["spec"]["devices"] = devices["spec"]["devices"].clone();
        let updated = store
            .update(
                &def,
                None,
                "node-a-gpupool.dev-1",
                again,
                None,
                WriteOptions::default(),
            )
            .unwrap()
            .object;
        assert!(updated["spec"]["devices"][0]
            .get("consumesCounters")
            .is_none());
    }
}

//! The garbage collector of the control plane (kube-controller-manager's), done by the store itself.
//!
//! - An object whose `metadata.ownerReferences` name only owners that are gone (no object of that
//!   kind and name, or one with another uid) is deleted with background propagation, its own
//!   finalizers respected; one that still has a live owner only loses the references to the gone
//!   ones. So dependents go with their owner, also down a chain, and an object created naming an
//!   owner that no longer exists goes too, as upstream.
//! - An owner deleted with `propagationPolicy: Orphan` keeps the finalizer `orphan` until no dependent
//!   names it any more: the references are removed, the dependents stay. With `Foreground` it keeps
//!   `foregroundDeletion` while its dependents are deleted, until none whose reference has
//!   `blockOwnerDeletion: true` is left.
//! - A reference that cannot be resolved never makes an object collectable: a kind the server does
//!   not serve, or a namespaced owner named by a cluster-scoped dependent (upstream treats it the
//!   same, and also reports it with an Event `OwnerRefInvalidNamespace`, which the emulator does not
//!   write). A namespaced owner is looked up in its dependent's namespace.
//!
//! Synchronous, unlike the real one: the real collector acts from its informers a moment after a
//! change (milliseconds to seconds), the emulator inside the write that made the change. A test sees
//! the dependents gone as soon as the owner's DELETE has answered, so it cannot observe the moment in
//! between. The answers are the real server's: a DELETE returns the owner, not its dependents.

use std::collections::{BTreeSet, HashMap};

use serde_json::{json, Value};

use super::{meta_mut, meta_str, StorageKey, Store};
use crate::clock;
use crate::resources::ResourceDef;
use crate::status::ApiError;

/// The finalizer an owner deleted with `propagationPolicy: Orphan` carries until its dependents
/// no longer name it.
pub const ORPHAN_FINALIZER: &str = "orphan";
/// The finalizer an owner deleted with `propagationPolicy: Foreground` carries until its blocking
/// dependents are gone.
pub const FOREGROUND_FINALIZER: &str = "foregroundDeletion";

/// What happens to the dependents of a deleted object (`DeleteOptions.propagationPolicy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Propagation {
    /// The object goes at once; its dependents follow unless they have another live owner.
    Background,
    /// The object stays, being deleted, until its blocking dependents are gone.
    Foreground,
    /// The object goes once its dependents no longer name it; they stay.
    Orphan,
}

impl Propagation {
    /// What a DELETE asks for, from `propagationPolicy` and the deprecated `orphanDependents`;
    /// `None` when it asks for neither (the object's own finalizers decide, else background).
    /// Refused as the real server refuses them: an unknown policy, or both fields.
    pub fn from_options(
        policy: Option<&str>,
        orphan_dependents: Option<bool>,
    ) -> Result<Option<Propagation>, ApiError> {
        let parsed = match policy {
            None => None,
            Some("Background") => Some(Propagation::Background),
            Some("Foreground") => Some(Propagation::Foreground),
            Some("Orphan") => Some(Propagation::Orphan),
            Some(other) => {
                return Err(ApiError::invalid_delete_options(
                    "propagationPolicy",
                    &format!(
                        "Unsupported value: {other:?}: supported values: \"Foreground\", \"Background\", \"Orphan\""
                    ),
                ))
            }
        };
        match (parsed, orphan_dependents) {
            (Some(_), Some(_)) => Err(ApiError::invalid_delete_options(
                "propagationPolicy",
                &format!(
                    "Invalid value: {:?}: orphanDependents and deletionPropagation cannot be both set",
                    policy.unwrap_or_default()
                ),
            )),
            (Some(p), None) => Ok(Some(p)),
            (None, Some(true)) => Ok(Some(Propagation::Orphan)),
            (None, Some(false)) => Ok(Some(Propagation::Background)),
            (None, None) => Ok(None),
        }
    }
}

/// The finalizers of an object being deleted with `propagation`: the collector's two replaced by
/// the one the policy needs, or kept as they are when the DELETE names no policy (upstream's
/// `deletionFinalizersForGarbageCollection`).
pub fn deletion_finalizers(finalizers: &[String], propagation: Option<Propagation>) -> Vec<String> {
    let Some(propagation) = propagation else {
        return finalizers.to_vec();
    };
    let mut kept: Vec<String> = finalizers
        .iter()
        .filter(|f| *f != ORPHAN_FINALIZER && *f != FOREGROUND_FINALIZER)
        .cloned()
        .collect();
    match propagation {
        Propagation::Background => {}
        Propagation::Foreground => kept.push(FOREGROUND_FINALIZER.to_string()),
        Propagation::Orphan => kept.push(ORPHAN_FINALIZER.to_string()),
    }
    kept
}

/// Where an object is stored: its resource's storage key and its (namespace, name).
type Location = (StorageKey, (String, String));

/// The collector's view of the store, kept up to date by `put` and `remove`, and its pending work.
/// The index makes the work of a write proportional to the objects it concerns, not to the store.
#[derive(Debug, Default)]
pub(super) struct GcState {
    /// Owner uid -> the objects that name it.
    dependents: HashMap<String, BTreeSet<Location>>,
    /// Owners being deleted that wait for the collector (finalizer orphan or foregroundDeletion).
    waiting: BTreeSet<Location>,
    /// Objects to look at.
    checks: Vec<Location>,
    running: bool,
}

/// What the collector does with a dependent.
enum Verdict {
    Keep,
    /// Another owner lives: keep only these references.
    Drop(Vec<Value>),
    /// No owner lives: delete it so.
    Delete(Option<Propagation>),
}

/// What an owner reference points at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OwnerState {
    /// The owner exists and is not being deleted in the foreground.
    Live,
    /// The owner is being deleted in the foreground: it waits for this dependent.
    Waiting,
    /// No object of that kind, name and uid.
    Gone,
    /// Not resolvable: never a reason to collect.
    Unresolvable,
}

fn finalizers(object: &Value) -> Vec<String> {
    object
        .pointer("/metadata/finalizers")
        .and_then(Value::as_array)
        .map(|f| {
            f.iter()
                .filter_map(Value::as_str)
                .map(String::from)
                .collect()
        })
        .unwrap_or_default()
}

fn owner_references(object: &Value) -> &[Value] {
    object
        .pointer("/metadata/ownerReferences")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default()
}

/// The uids of the owners `object` names.
pub(super) fn owner_uids(object: &Value) -> Vec<String> {
    owner_references(object)
        .iter()
        .map(|r| reference_uid(r).to_string())
        .collect()
}

fn reference_uid(reference: &Value) -> &str {
    reference
        .get("uid")
        .and_then(Value::as_str)
        .unwrap_or_default()
}

fn is_deleting(object: &Value) -> bool {
    object.pointer("/metadata/deletionTimestamp").is_some()
}

/// An owner that waits for the collector: being deleted with the orphan or foreground finalizer.
fn waits_for_collector(object: &Value) -> bool {
    is_deleting(object)
        && finalizers(object)
            .iter()
            .any(|f| f == ORPHAN_FINALIZER || f == FOREGROUND_FINALIZER)
}

/// Sets the owner references, dropping the field when none is left (Go's `omitempty`).
fn set_owner_references(object: &mut Value, references: Vec<Value>) {
    let meta = meta_mut(object);
    if references.is_empty() {
        meta.remove("ownerReferences");
    } else {
        meta.insert("ownerReferences".into(), json!(references));
    }
}

impl Store {
    /// Called by `put` once `object` is stored under `key` and its event recorded, in place of an
    /// object that named `old_owners`.
    pub(super) fn gc_after_put(
        &mut self,
        def: &ResourceDef,
        key: &(String, String),
        object: &Value,
        old_owners: Vec<String>,
    ) {
        if std::env::var_os("NO_GC").is_some() {
            return;
        }
        let at: Location = (def.storage_key(), key.clone());
        let owners_now: Vec<&str> = owner_references(object).iter().map(reference_uid).collect();
        let mut dropped_an_owner = false;
        for uid in old_owners
            .iter()
            .filter(|u| !owners_now.contains(&u.as_str()))
        {
            self.unindex(uid, &at);
            dropped_an_owner = true;
        }
        for uid in &owners_now {
            self.gc
                .dependents
                .entry(uid.to_string())
                .or_default()
                .insert(at.clone());
        }
        let waits = waits_for_collector(object);
        if waits {
            self.gc.waiting.insert(at.clone());
        } else {
            self.gc.waiting.remove(&at);
        }
        if !owners_now.is_empty() || waits {
            self.gc.checks.push(at);
        }
        // An owner it no longer names may have been waiting for it in the foreground.
        if dropped_an_owner {
            self.gc.checks.extend(self.gc.waiting.iter().cloned());
        }
        self.run_gc();
    }

    /// Called by `record_deletion` for each object that has left the store: its dependents may be
    /// orphans now, and an owner waiting in the foreground may have been waiting for it. `remove`
    /// runs the work once it has removed everything it removes.
    pub(super) fn gc_after_removal(&mut self, def: &ResourceDef, object: &Value) {
        let key = Self::object_key(
            def,
            meta_str(object, "namespace"),
            meta_str(object, "name").unwrap_or_default(),
        );
        let at: Location = (def.storage_key(), key);
        let references = owner_references(object);
        for reference in references {
            self.unindex(reference_uid(reference), &at);
        }
        self.gc.waiting.remove(&at);
        if let Some(dependents) = meta_str(object, "uid").and_then(|u| self.gc.dependents.get(u)) {
            self.gc.checks.extend(dependents.iter().cloned());
        }
        if !references.is_empty() {
            self.gc.checks.extend(self.gc.waiting.iter().cloned());
        }
    }

    fn unindex(&mut self, uid: &str, at: &Location) {
        if let Some(dependents) = self.gc.dependents.get_mut(uid) {
            dependents.remove(at);
            if dependents.is_empty() {
                self.gc.dependents.remove(uid);
            }
        }
    }

    /// Works until nothing is left to collect. Writes made here come back through `put` and
    /// `remove`, which queue their consequences instead of recursing.
    pub(super) fn run_gc(&mut self) {
        if self.gc.running {
            return;
        }
        self.gc.running = true;
        while let Some(at) = self.gc.checks.pop() {
            self.gc_check(&at);
        }
        self.gc.running = false;
    }

    fn stored_at(&self, at: &Location) -> Option<&Value> {
        self.objects.get(&at.0)?.get(&at.1)
    }

    /// The resource stored under `storage` (the core one for Events).
    fn def_of(&self, storage: &StorageKey) -> Option<ResourceDef> {
        self.builtins
            .iter()
            .chain(self.crds.values().flatten())
            .find(|d| !d.is_events_alias() && d.storage_key() == *storage)
            .cloned()
    }

    fn gc_check(&mut self, at: &Location) {
        let Some(object) = self.stored_at(at) else {
            return;
        };
        let verdict = self.verdict(&at.1 .0, object);
        if !matches!(verdict, Verdict::Keep) {
            let (Some(def), Some(object)) = (self.def_of(&at.0), self.stored_at(at).cloned())
            else {
                return;
            };
            match verdict {
                Verdict::Keep => {}
                Verdict::Drop(kept) => {
                    let mut updated = object.clone();
                    set_owner_references(&mut updated, kept);
                    self.put(&def, at.1.clone(), updated, Some(object));
                }
                Verdict::Delete(propagation) => {
                    let _ = self.delete_stored(&def, at.1.clone(), object, propagation);
                }
            }
        }
        if self.stored_at(at).is_some_and(waits_for_collector) {
            self.finish_owner(at);
        }
    }

    /// Where `reference`, held by an object in `namespace` ("" when cluster-scoped), points.
    fn owner_state(&self, namespace: &str, reference: &Value) -> OwnerState {
        let field = |name: &str| reference.get(name).and_then(Value::as_str).unwrap_or("");
        let group = field("apiVersion")
            .rsplit_once('/')
            .map_or("", |(group, _)| group);
        let Some(def) = self
            .builtins
            .iter()
            .chain(self.crds.values().flatten())
            .find(|d| d.group == group && d.kind == field("kind"))
        else {
            return OwnerState::Unresolvable;
        };
        if def.namespaced && namespace.is_empty() {
            return OwnerState::Unresolvable;
        }
        let owner_namespace = if def.namespaced { namespace } else { "" };
        let owner = self
            .objects
            .get(&def.storage_key())
            .and_then(|b| b.get(&(owner_namespace.to_string(), field("name").to_string())));
        match owner {
            Some(owner) if meta_str(owner, "uid") == Some(reference_uid(reference)) => {
                if is_deleting(owner) && finalizers(owner).iter().any(|f| f == FOREGROUND_FINALIZER)
                {
                    OwnerState::Waiting
                } else {
                    OwnerState::Live
                }
            }
            _ => OwnerState::Gone,
        }
    }

    /// What to do with `object`, stored in `namespace`, given where its owner references point
    /// (upstream's `attemptToDeleteItem`).
    fn verdict(&self, namespace: &str, object: &Value) -> Verdict {
        let references = owner_references(object);
        if references.is_empty() {
            return Verdict::Keep;
        }
        let states: Vec<OwnerState> = references
            .iter()
            .map(|r| self.owner_state(namespace, r))
            .collect();
        let waiting = states.contains(&OwnerState::Waiting);
        if !waiting && !states.contains(&OwnerState::Gone) {
            return Verdict::Keep;
        }
        let lives = |s: &OwnerState| matches!(s, OwnerState::Live | OwnerState::Unresolvable);
        if states.iter().any(lives) {
            let kept = references
                .iter()
                .zip(&states)
                .filter(|(_, s)| lives(s))
                .map(|(r, _)| r.clone())
                .collect();
            return Verdict::Drop(kept);
        }
        // Upstream deletes a dependent of a waiting owner in the foreground when it has dependents
        // of its own, so that a chain goes bottom up; otherwise as the dependent's finalizers say.
        let has_dependents =
            meta_str(object, "uid").is_some_and(|uid| self.gc.dependents.contains_key(uid));
        Verdict::Delete((waiting && has_dependents).then_some(Propagation::Foreground))
    }

    /// An owner being deleted with the orphan or foreground finalizer: orphan its dependents, or
    /// delete them; then drop the finalizer once nothing holds it.
    fn finish_owner(&mut self, at: &Location) {
        let Some(owner) = self.stored_at(at) else {
            return;
        };
        let uid = meta_str(owner, "uid").unwrap_or_default().to_string();
        let orphan = finalizers(owner).iter().any(|f| f == ORPHAN_FINALIZER);
        let dependents: Vec<Location> = self
            .gc
            .dependents
            .get(&uid)
            .map(|d| d.iter().cloned().collect())
            .unwrap_or_default();
        let finalizer = if orphan {
            for dependent_at in dependents {
                let (Some(def), Some(dependent)) = (
                    self.def_of(&dependent_at.0),
                    self.stored_at(&dependent_at).cloned(),
                ) else {
                    continue;
                };
                let kept: Vec<Value> = owner_references(&dependent)
                    .iter()
                    .filter(|r| reference_uid(r) != uid)
                    .cloned()
                    .collect();
                let mut updated = dependent.clone();
                set_owner_references(&mut updated, kept);
                self.put(&def, dependent_at.1, updated, Some(dependent));
            }
            ORPHAN_FINALIZER
        } else {
            for dependent_at in dependents {
                self.gc_check(&dependent_at);
            }
            let blocked = self.gc.dependents.get(&uid).is_some_and(|d| {
                d.iter().filter_map(|at| self.stored_at(at)).any(|o| {
                    owner_references(o).iter().any(|r| {
                        reference_uid(r) == uid
                            && r.get("blockOwnerDeletion").and_then(Value::as_bool) == Some(true)
                    })
                })
            });
            if blocked {
                return;
            }
            FOREGROUND_FINALIZER
        };
        // The owner may have changed while its dependents were handled.
        let (Some(def), Some(owner)) = (self.def_of(&at.0), self.stored_at(at).cloned()) else {
            return;
        };
        let rest: Vec<String> = finalizers(&owner)
            .into_iter()
            .filter(|f| f != finalizer)
            .collect();
        if rest.is_empty() {
            let _ = self.remove(&def, &at.1, owner);
        } else {
            let mut updated = owner.clone();
            meta_mut(&mut updated).insert("finalizers".into(), json!(rest));
            self.put(&def, at.1.clone(), updated, Some(owner));
        }
    }

    /// Deletes a stored object as a DELETE with `propagation` does: at once, or marked for deletion
    /// (deletionTimestamp, the finalizers the policy needs) while finalizers remain.
    pub(super) fn delete_stored(
        &mut self,
        def: &ResourceDef,
        key: (String, String),
        existing: Value,
        propagation: Option<Propagation>,
    ) -> Result<Value, ApiError> {
        let held = finalizers(&existing);
        let wanted = deletion_finalizers(&held, propagation);
        if wanted.is_empty() {
            return self.remove(def, &key, existing);
        }
        if is_deleting(&existing) && wanted == held {
            return Ok(existing);
        }
        let mut marked = existing.clone();
        let meta = meta_mut(&mut marked);
        meta.insert("finalizers".into(), json!(wanted));
        if !meta.contains_key("deletionTimestamp") {
            meta.insert(
                "deletionTimestamp".into(),
                json!(clock::format_rfc3339(clock::unix_now())),
            );
            meta.insert("deletionGracePeriodSeconds".into(), json!(0));
        }
        Ok(self.put(def, key, marked, Some(existing)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{Preconditions, WriteOptions};

    fn def(store: &Store, group: &str, plural: &str) -> ResourceDef {
        store
            .find(group, "v1", plural)
            .unwrap_or_else(|| panic!("{group}/{plural}"))
    }

    fn create(store: &mut Store, def: &ResourceDef, namespace: Option<&str>, body: Value) -> Value {
        store
            .create(def, namespace, body, WriteOptions::default())
            .unwrap_or_else(|e| panic!("creating: {e}"))
            .object
    }

    /// A reference to `owner` as a controller writes it.
    fn owned_by(owner: &Value, block: bool) -> Value {
        json!({
            "apiVersion": owner["apiVersion"],
            "kind": owner["kind"],
            "name": owner["metadata"]["name"],
            "uid": owner["metadata"]["uid"],
            "blockOwnerDeletion": block,
        })
    }

    fn exists(store: &Store, def: &ResourceDef, namespace: Option<&str>, name: &str) -> bool {
        store.get(def, namespace, name).is_ok()
    }

    fn delete(
        store: &mut Store,
        def: &ResourceDef,
        namespace: Option<&str>,
        name: &str,
        propagation: Option<Propagation>,
    ) -> Value {
        store
            .delete_with(
                def,
                namespace,
                name,
                &crate::store::DeleteOptions {
                    propagation,
                    ..Default::default()
                },
            )
            .unwrap()
    }

    /// The uninstall this exists for: a ClusterRole owns a DeviceClass (cluster-scoped), a Role a
    /// Lease in its namespace, a GpuModel-like ConfigMap chain shows the cascade.
    #[test]
    fn dependents_go_with_their_owner_down_a_chain() {
        let mut store = Store::new();
        let roles = def(&store, "rbac.authorization.k8s.io", "clusterroles");
        let classes = def(&store, "resource.k8s.io", "deviceclasses");
        let maps = def(&store, "", "configmaps");
        let role = create(&mut store, &roles, None, json!({"metadata": {"name": "r"}}));
        let class = create(
            &mut store,
            &classes,
            None,
            json!({"metadata": {"name": "c", "ownerReferences": [owned_by(&role, false)]}, "spec": {}}),
        );
        // A namespaced dependent of a cluster-scoped owner, and a dependent of that dependent.
        let first = create(
            &mut store,
            &maps,
            Some("default"),
            json!({"metadata": {"name": "first", "ownerReferences": [owned_by(&class, false)]}}),
        );
        create(
            &mut store,
            &maps,
            Some("default"),
            json!({"metadata": {"name": "second", "ownerReferences": [owned_by(&first, false)]}}),
        );
        create(
            &mut store,
            &maps,
            Some("default"),
            json!({"metadata": {"name": "unowned"}}),
        );

        delete(&mut store, &roles, None, "r", None);
        assert!(!exists(&store, &classes, None, "c"));
        assert!(!exists(&store, &maps, Some("default"), "first"));
        assert!(!exists(&store, &maps, Some("default"), "second"));
        assert!(exists(&store, &maps, Some("default"), "unowned"));
        // Watchers are told, as of any deletion.
        let deleted: Vec<String> = store
            .events_after(0)
            .filter(|e| e.event_type == crate::store::EventType::Deleted)
            .map(|e| e.object["metadata"]["name"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(deleted, ["r", "c", "first", "second"]);
    }

    #[test]
    fn a_dependent_with_another_live_owner_only_loses_the_reference() {
        let mut store = Store::new();
        let maps = def(&store, "", "configmaps");
        let a = create(
            &mut store,
            &maps,
            Some("default"),
            json!({"metadata": {"name": "a"}}),
        );
        let b = create(
            &mut store,
            &maps,
            Some("default"),
            json!({"metadata": {"name": "b"}}),
        );
        create(
            &mut store,
            &maps,
            Some("default"),
            json!({"metadata": {"name": "d", "ownerReferences": [owned_by(&a, false), owned_by(&b, false)]}}),
        );
        delete(&mut store, &maps, Some("default"), "a", None);
        let d = store.get(&maps, Some("default"), "d").unwrap();
        assert_eq!(
            d["metadata"]["ownerReferences"],
            json!([owned_by(&b, false)])
        );
        delete(&mut store, &maps, Some("default"), "b", None);
        assert!(!exists(&store, &maps, Some("default"), "d"));
    }

    #[test]
    fn an_object_created_for_a_gone_owner_is_collected() {
        let mut store = Store::new();
        let maps = def(&store, "", "configmaps");
        let owner = create(
            &mut store,
            &maps,
            Some("default"),
            json!({"metadata": {"name": "o"}}),
        );
        delete(&mut store, &maps, Some("default"), "o", None);
        // The answer to the create is the object; it is gone right after, as the collector sees it.
        let made = create(
            &mut store,
            &maps,
            Some("default"),
            json!({"metadata": {"name": "late", "ownerReferences": [owned_by(&owner, false)]}}),
        );
        assert_eq!(made["metadata"]["name"], "late");
        assert!(!exists(&store, &maps, Some("default"), "late"));
        // A recreated owner of the same name is another object: its uid differs.
        create(
            &mut store,
            &maps,
            Some("default"),
            json!({"metadata": {"name": "o"}}),
        );
        create(
            &mut store,
            &maps,
            Some("default"),
            json!({"metadata": {"name": "stale", "ownerReferences": [owned_by(&owner, false)]}}),
        );
        assert!(!exists(&store, &maps, Some("default"), "stale"));
    }

    #[test]
    fn unresolvable_references_never_collect() {
        let mut store = Store::new();
        let maps = def(&store, "", "configmaps");
        let classes = def(&store, "resource.k8s.io", "deviceclasses");
        let map = create(
            &mut store,
            &maps,
            Some("default"),
            json!({"metadata": {"name": "m"}}),
        );
        let unknown_kind =
            json!({"apiVersion": "example.dev/v1", "kind": "Widget", "name": "w", "uid": "u-1"});
        create(
            &mut store,
            &maps,
            Some("default"),
            json!({"metadata": {"name": "of-a-widget", "ownerReferences": [unknown_kind]}}),
        );
        // A cluster-scoped object cannot be owned by a namespaced one.
        create(
            &mut store,
            &classes,
            None,
            json!({"metadata": {"name": "of-a-map", "ownerReferences": [owned_by(&map, false)]}, "spec": {}}),
        );
        delete(&mut store, &maps, Some("default"), "m", None);
        assert!(exists(&store, &maps, Some("default"), "of-a-widget"));
        assert!(exists(&store, &classes, None, "of-a-map"));
    }

    #[test]
    fn a_dependent_with_finalizers_is_marked_and_goes_when_they_are_done() {
        let mut store = Store::new();
        let maps = def(&store, "", "configmaps");
        let owner = create(
            &mut store,
            &maps,
            Some("default"),
            json!({"metadata": {"name": "o"}}),
        );
        create(
            &mut store,
            &maps,
            Some("default"),
            json!({"metadata": {"name": "d", "finalizers": ["example.dev/keep"], "ownerReferences": [owned_by(&owner, false)]}}),
        );
        delete(&mut store, &maps, Some("default"), "o", None);
        let d = store.get(&maps, Some("default"), "d").unwrap();
        assert!(d["metadata"]["deletionTimestamp"].is_string(), "{d}");
        store
            .patch(
                &maps,
                Some("default"),
                "d",
                crate::store::PatchType::Merge,
                br#"{"metadata":{"finalizers":null}}"#,
                None,
                WriteOptions::default(),
            )
            .unwrap();
        assert!(!exists(&store, &maps, Some("default"), "d"));
    }

    #[test]
    fn orphan_propagation_keeps_the_dependents_without_the_reference() {
        let mut store = Store::new();
        let maps = def(&store, "", "configmaps");
        let owner = create(
            &mut store,
            &maps,
            Some("default"),
            json!({"metadata": {"name": "o"}}),
        );
        create(
            &mut store,
            &maps,
            Some("default"),
            json!({"metadata": {"name": "d", "ownerReferences": [owned_by(&owner, true)]}}),
        );
        delete(
            &mut store,
            &maps,
            Some("default"),
            "o",
            Some(Propagation::Orphan),
        );
        assert!(!exists(&store, &maps, Some("default"), "o"));
        let d = store.get(&maps, Some("default"), "d").unwrap();
        assert!(d["metadata"].get("ownerReferences").is_none(), "{d}");

        // An owner with a finalizer of its own waits for it, without the orphan finalizer left.
        let owner = create(
            &mut store,
            &maps,
            Some("default"),
            json!({"metadata": {"name": "o2", "finalizers": ["example.dev/keep"]}}),
        );
        create(
            &mut store,
            &maps,
            Some("default"),
            json!({"metadata": {"name": "d2", "ownerReferences": [owned_by(&owner, false)]}}),
        );
        let answer = delete(
            &mut store,
            &maps,
            Some("default"),
            "o2",
            Some(Propagation::Orphan),
        );
        assert_eq!(
            answer["metadata"]["finalizers"],
            json!(["example.dev/keep", "orphan"]),
            "the answer shows the owner as the DELETE left it"
        );
        let o2 = store.get(&maps, Some("default"), "o2").unwrap();
        assert_eq!(o2["metadata"]["finalizers"], json!(["example.dev/keep"]));
        assert!(exists(&store, &maps, Some("default"), "d2"));
    }

    #[test]
    fn foreground_propagation_waits_for_blocking_dependents() {
        let mut store = Store::new();
        let maps = def(&store, "", "configmaps");
        let owner = create(
            &mut store,
            &maps,
            Some("default"),
            json!({"metadata": {"name": "o"}}),
        );
        create(
            &mut store,
            &maps,
            Some("default"),
            json!({"metadata": {"name": "blocking", "finalizers": ["example.dev/keep"], "ownerReferences": [owned_by(&owner, true)]}}),
        );
        create(
            &mut store,
            &maps,
            Some("default"),
            json!({"metadata": {"name": "free", "finalizers": ["example.dev/keep"], "ownerReferences": [owned_by(&owner, false)]}}),
        );
        let answer = delete(
            &mut store,
            &maps,
            Some("default"),
            "o",
            Some(Propagation::Foreground),
        );
        assert_eq!(
            answer["metadata"]["finalizers"],
            json!(["foregroundDeletion"])
        );
        // Both dependents are being deleted; the owner waits for the blocking one only.
        for name in ["blocking", "free"] {
            let d = store.get(&maps, Some("default"), name).unwrap();
            assert!(d["metadata"]["deletionTimestamp"].is_string(), "{name}");
        }
        assert!(exists(&store, &maps, Some("default"), "o"));
        store
            .patch(
                &maps,
                Some("default"),
                "blocking",
                crate::store::PatchType::Merge,
                br#"{"metadata":{"finalizers":null}}"#,
                None,
                WriteOptions::default(),
            )
            .unwrap();
        assert!(!exists(&store, &maps, Some("default"), "o"));
        assert!(exists(&store, &maps, Some("default"), "free"));
    }

    #[test]
    fn foreground_deletion_without_dependents_completes_at_once() {
        let mut store = Store::new();
        let maps = def(&store, "", "configmaps");
        create(
            &mut store,
            &maps,
            Some("default"),
            json!({"metadata": {"name": "o"}}),
        );
        delete(
            &mut store,
            &maps,
            Some("default"),
            "o",
            Some(Propagation::Foreground),
        );
        assert!(!exists(&store, &maps, Some("default"), "o"));
    }

    #[test]
    fn deleting_a_crd_collects_what_its_objects_owned() {
        let mut store = Store::new();
        let crds = def(&store, "apiextensions.k8s.io", "customresourcedefinitions");
        let classes = def(&store, "resource.k8s.io", "deviceclasses");
        let crd = json!({"metadata": {"name": "widgets.example.dev"}, "spec": {"group": "example.dev", "scope": "Cluster",
            "names": {"plural": "widgets", "kind": "Widget"},
            "versions": [{"name": "v1", "served": true, "storage": true,
                "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}}]}});
        create(&mut store, &crds, None, crd);
        let widgets = store.find("example.dev", "v1", "widgets").unwrap();
        let widget = create(
            &mut store,
            &widgets,
            None,
            json!({"metadata": {"name": "w"}}),
        );
        create(
            &mut store,
            &classes,
            None,
            json!({"metadata": {"name": "c", "ownerReferences": [owned_by(&widget, false)]}, "spec": {}}),
        );
        store
            .delete(
                &crds,
                None,
                "widgets.example.dev",
                &Preconditions::default(),
                false,
            )
            .unwrap();
        assert!(!exists(&store, &classes, None, "c"));
    }

    #[test]
    fn delete_options_are_read_as_upstream_or_refused() {
        assert_eq!(Propagation::from_options(None, None).unwrap(), None);
        assert_eq!(
            Propagation::from_options(Some("Orphan"), None).unwrap(),
            Some(Propagation::Orphan)
        );
        assert_eq!(
            Propagation::from_options(None, Some(true)).unwrap(),
            Some(Propagation::Orphan)
        );
        assert_eq!(
            Propagation::from_options(None, Some(false)).unwrap(),
            Some(Propagation::Background)
        );
        let unknown = Propagation::from_options(Some("Cascade"), None).unwrap_err();
        assert_eq!((unknown.code, unknown.reason), (422, "Invalid"));
        assert!(
            unknown.message.contains(
                r#"propagationPolicy: Unsupported value: "Cascade": supported values: "Foreground", "Background", "Orphan""#
            ),
            "{}",
            unknown.message
        );
        let both = Propagation::from_options(Some("Orphan"), Some(true)).unwrap_err();
        assert!(
            both.message.contains("cannot be both set"),
            "{}",
            both.message
        );
    }
}
#[cfg(test)]
mod timing {
    use super::*;
    use crate::store::WriteOptions;
    #[test]
    fn timing() {
        for n in [1000usize] {
            let mut store = Store::new();
            let maps = store.find("", "v1", "configmaps").unwrap();
            let owner = store
                .create(
                    &maps,
                    Some("default"),
                    json!({"metadata": {"name": "owner"}}),
                    WriteOptions::default(),
                )
                .unwrap()
                .object;
            let r = json!([{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"]}]);
            for i in 0..n {
                let mut body = json!({"metadata": {"name": format!("m{i}")}});
                if i % 5 == 0 {
                    body["metadata"]["ownerReferences"] = r.clone();
                }
                store
                    .create(&maps, Some("default"), body, WriteOptions::default())
                    .unwrap();
            }
            let t = std::time::Instant::now();
            for i in 0..1000 {
                store.create(&maps, Some("default"), json!({"metadata": {"name": format!("x{i}"), "ownerReferences": r.clone()}}), WriteOptions::default()).unwrap();
            }
            let owned_create = t.elapsed() / 1000;
            eprintln!(
                "n={n}: create owned {owned_create:?} NO_GC={:?}",
                std::env::var_os("NO_GC")
            );
        }
    }
}

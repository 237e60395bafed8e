//! A watch cache that lags: the real server answers `resourceVersion=0` reads from a cache fed by
//! an etcd watch, so a client can read a version older than one already written (even one it
//! wrote itself). This reproduces it for GETs of one object so clients that read from the cache
//! can be tested against a stale answer; a quorum read (no resourceVersion) always sees the
//! store. Lists are served from the store either way. A GET with `resourceVersion=<n>` is served
//! from the cache too, once the cache has caught up with `n` ("not older than"): it waits for
//! that, then answers what the cache holds, which may still be behind the store.
//!
//! Only objects written within the lag are remembered (their versions since the newest one that is
//! at least `lag` old); every other object is the same in the cache as in the store.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::resources::ResourceDef;
use crate::store::{EventType, StorageKey, Store};

/// Versions kept per object: more writes of one object within the lag than this and the oldest
/// are forgotten, so a read then sees a version newer than the lag allows (never a wrong one).
const VERSIONS_PER_OBJECT: usize = 64;
/// Every so many recorded writes, objects nobody wrote within the lag are forgotten.
const SWEEP_EVERY: u64 = 1024;

type ObjectKey = (StorageKey, String, String);

struct Version {
    /// When it was written; `None` for the state before the first write the cache saw.
    at: Option<Instant>,
    /// `None`: the object did not exist.
    object: Option<Value>,
}

/// What a `resourceVersion=0` read of one object sees.
#[derive(Debug, PartialEq)]
pub enum CachedObject {
    /// Not written within the lag: the cache holds what the store holds.
    Current,
    /// The newest version written at least the lag ago (stored form); `None`: it did not exist.
    Stale(Option<Value>),
}

pub struct WatchCache {
    lag: Duration,
    /// The store's resourceVersion up to which writes were recorded.
    seen_rv: u64,
    /// The writes of the last `lag` (resourceVersion, when), oldest first: the cache has not
    /// caught up with them yet.
    recent: VecDeque<(u64, Instant)>,
    versions: HashMap<ObjectKey, VecDeque<Version>>,
    recorded: u64,
}

impl WatchCache {
    /// A cache of `store` as it is now, lagging `lag` behind the writes that follow.
    pub fn new(lag: Duration, store: &Store) -> WatchCache {
        WatchCache {
            lag,
            seen_rv: store.current_rv(),
            recent: VecDeque::new(),
            versions: HashMap::new(),
            recorded: 0,
        }
    }

    pub fn lag(&self) -> Duration {
        self.lag
    }

    /// Records the writes the store made since the last call, as written at `now`. Writes the
    /// store's history no longer holds (after [`Store::compact`]) are missed: those objects read
    /// as current.
    pub fn observe(&mut self, store: &Store, now: Instant) {
        let mut last = self.seen_rv;
        for event in store.events_after(self.seen_rv) {
            last = event.rv;
            let Some(name) = event
                .object
                .pointer("/metadata/name")
                .and_then(Value::as_str)
            else {
                continue;
            };
            let key = (event.key.clone(), event.namespace.clone(), name.to_string());
            let (before, after) = match event.event_type {
                EventType::Added => (None, Some(event.object.clone())),
                EventType::Modified => (event.old.clone(), Some(event.object.clone())),
                // The store gives the deleted object the deletion's resourceVersion; the
                // version before it is not kept, so a stale read shows that one.
                EventType::Deleted => (Some(event.object.clone()), None),
            };
            self.record(key, before, after, now);
        }
        if last > self.seen_rv {
            self.recent.push_back((last, now));
        }
        while self
            .recent
            .front()
            .is_some_and(|(_, at)| *at + self.lag <= now)
        {
            self.recent.pop_front();
        }
        self.seen_rv = store.current_rv().max(last);
    }

    /// When the cache will hold every write up to resourceVersion `rv`; `None` if it does now
    /// (`now`).
    pub fn caught_up_at(&self, rv: u64, now: Instant) -> Option<Instant> {
        let written = self
            .recent
            .iter()
            .take_while(|(r, _)| *r <= rv)
            .last()
            .map(|(_, at)| *at + self.lag)?;
        (written > now).then_some(written)
    }

    fn record(
        &mut self,
        key: ObjectKey,
        before: Option<Value>,
        after: Option<Value>,
        now: Instant,
    ) {
        let versions = self.versions.entry(key).or_insert_with(|| {
            VecDeque::from([Version {
                at: None,
                object: before,
            }])
        });
        versions.push_back(Version {
            at: Some(now),
            object: after,
        });
        while versions.len() > VERSIONS_PER_OBJECT {
            versions.pop_front();
        }
        self.recorded += 1;
        if self.recorded.is_multiple_of(SWEEP_EVERY) {
            self.sweep(now);
        }
    }

    /// Forgets what no read can see any more.
    fn sweep(&mut self, now: Instant) {
        let cutoff = now.checked_sub(self.lag);
        self.versions.retain(|_, versions| {
            let visible = newest_visible(versions, cutoff);
            versions.drain(..visible);
            // One version left that is old enough: it is what the store holds.
            !(versions.len() == 1 && is_visible(&versions[0], cutoff))
        });
    }

    /// What a `resourceVersion=0` GET of `namespace/name` sees at `now`.
    pub fn get(
        &self,
        def: &ResourceDef,
        namespace: Option<&str>,
        name: &str,
        now: Instant,
    ) -> CachedObject {
        let namespace = if def.namespaced {
            namespace.unwrap_or_default()
        } else {
            ""
        };
        let key = (def.storage_key(), namespace.to_string(), name.to_string());
        let Some(versions) = self.versions.get(&key) else {
            return CachedObject::Current;
        };
        let visible = newest_visible(versions, now.checked_sub(self.lag));
        if visible + 1 == versions.len() {
            return CachedObject::Current;
        }
        CachedObject::Stale(versions[visible].object.clone())
    }
}

fn is_visible(version: &Version, cutoff: Option<Instant>) -> bool {
    match (version.at, cutoff) {
        (None, _) => true,
        (Some(at), Some(cutoff)) => at <= cutoff,
        (Some(_), None) => false,
    }
}

/// The index of the newest version written at or before `cutoff`; the first one when none is
/// (it is the oldest known, only newer than the cutoff once the per-object bound dropped some).
fn newest_visible(versions: &VecDeque<Version>, cutoff: Option<Instant>) -> usize {
    versions
        .iter()
        .rposition(|v| is_visible(v, cutoff))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::store::{Preconditions, WriteOptions};

    const LAG: Duration = Duration::from_millis(100);

    struct Fixture {
        store: Store,
        cache: WatchCache,
        def: ResourceDef,
        start: Instant,
    }

    impl Fixture {
        fn new() -> Fixture {
            let store = Store::new();
            let cache = WatchCache::new(LAG, &store);
            let def = store.find("", "v1", "configmaps").expect("built in");
            Fixture {
                store,
                cache,
                def,
                start: Instant::now(),
            }
        }

        fn at(&self, ms: u64) -> Instant {
            self.start + Duration::from_millis(ms)
        }

        fn write(&mut self, ms: u64, data: &str) {
            let body =
                json!({"metadata": {"name": "cm", "namespace": "default"}, "data": {"v": data}});
            let exists = self.store.get(&self.def, Some("default"), "cm").is_ok();
            if exists {
                self.store
                    .update(
                        &self.def,
                        Some("default"),
                        "cm",
                        body,
                        None,
                        WriteOptions::default(),
                    )
                    .unwrap();
            } else {
                self.store
                    .create(&self.def, Some("default"), body, WriteOptions::default())
                    .unwrap();
            }
            let now = self.at(ms);
            self.cache.observe(&self.store, now);
        }

        fn delete(&mut self, ms: u64) {
            self.store
                .delete(
                    &self.def,
                    Some("default"),
                    "cm",
                    &Preconditions::default(),
                    false,
                )
                .unwrap();
            let now = self.at(ms);
            self.cache.observe(&self.store, now);
        }

        /// What a cached read sees at `ms`: the data value, `None` for 404.
        fn cached(&self, ms: u64) -> Option<String> {
            match self
                .cache
                .get(&self.def, Some("default"), "cm", self.at(ms))
            {
                CachedObject::Current => self.quorum(),
                CachedObject::Stale(object) => object.map(|o| data(&o)),
            }
        }

        /// Asserts what a cached read sees at each time: the data value, `None` for 404.
        #[track_caller]
        fn expect_cached(&self, expected: &[(u64, Option<&str>)]) {
            for &(ms, data) in expected {
                assert_eq!(self.cached(ms).as_deref(), data, "a cached read at {ms} ms");
            }
        }

        fn quorum(&self) -> Option<String> {
            self.store
                .get(&self.def, Some("default"), "cm")
                .ok()
                .map(|o| data(&o))
        }
    }

    fn data(object: &Value) -> String {
        object["data"]["v"].as_str().unwrap().to_string()
    }

    #[test]
    fn a_version_is_in_the_cache_one_lag_after_its_write() {
        let mut f = Fixture::new();
        f.write(0, "a");
        let first = f.store.current_rv();
        f.write(30, "b");
        let second = f.store.current_rv();
        assert_eq!(f.cache.caught_up_at(first, f.at(10)), Some(f.at(100)));
        assert_eq!(f.cache.caught_up_at(second, f.at(10)), Some(f.at(130)));
        // Once there, no wait; and a version older than anything recent needs none.
        assert_eq!(f.cache.caught_up_at(first, f.at(100)), None);
        assert_eq!(f.cache.caught_up_at(first - 1, f.at(10)), None);
        // What the cache answers then is that version or newer, never older.
        f.expect_cached(&[(130, Some("b"))]);
        f.write(400, "c");
        assert_eq!(
            f.cache.caught_up_at(second, f.at(400)),
            None,
            "old writes forgotten"
        );
    }

    #[test]
    fn a_cached_read_within_the_lag_sees_the_version_before() {
        let mut f = Fixture::new();
        f.write(0, "one");
        // Created within the lag: not in the cache yet.
        f.expect_cached(&[(50, None)]);
        assert_eq!(f.quorum().as_deref(), Some("one"));
        f.expect_cached(&[(100, Some("one"))]);
        f.write(200, "two");
        f.expect_cached(&[(200, Some("one")), (299, Some("one"))]);
        assert_eq!(f.quorum().as_deref(), Some("two"));
        f.expect_cached(&[(300, Some("two"))]);
    }

    #[test]
    fn several_writes_within_the_lag_are_seen_in_order() {
        let mut f = Fixture::new();
        f.write(0, "one");
        f.write(150, "two");
        f.write(170, "three");
        f.write(190, "four");
        f.expect_cached(&[
            (160, Some("one")),
            (250, Some("two")),
            (275, Some("three")),
            (290, Some("four")),
        ]);
        assert_eq!(f.quorum().as_deref(), Some("four"));
    }

    #[test]
    fn a_deleted_object_stays_in_the_cache_for_the_lag() {
        let mut f = Fixture::new();
        f.write(0, "one");
        f.delete(500);
        assert_eq!(f.quorum(), None);
        f.expect_cached(&[(550, Some("one")), (600, None)]);
        // Created again under the same name: the cache has the deletion first.
        f.write(700, "again");
        f.expect_cached(&[(750, None), (800, Some("again"))]);
    }

    #[test]
    fn objects_not_written_within_the_lag_are_forgotten() {
        let mut f = Fixture::new();
        f.write(0, "one");
        f.write(10, "two");
        f.cache.sweep(f.at(500));
        assert!(f.cache.versions.is_empty());
        f.expect_cached(&[(500, Some("two"))]);
        f.write(600, "three");
        f.cache.sweep(f.at(650));
        assert_eq!(f.cache.versions.len(), 1);
        f.expect_cached(&[(650, Some("two"))]);
    }

    #[test]
    fn other_objects_and_kinds_are_current() {
        let mut f = Fixture::new();
        f.write(0, "one");
        let secrets = f.store.find("", "v1", "secrets").unwrap();
        assert_eq!(
            f.cache.get(&secrets, Some("default"), "cm", f.at(1)),
            CachedObject::Current
        );
        assert_eq!(
            f.cache.get(&f.def, Some("other"), "cm", f.at(1)),
            CachedObject::Current
        );
    }
}

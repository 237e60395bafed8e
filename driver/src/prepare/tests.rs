//! ClaimPreparer end to end against an in-memory API and temp folders (fake GPUs).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::Event;
use k8s_openapi::api::resource::v1::{AllocatedDeviceStatus, ResourceClaim};
use serde_json::json;
use tokio::sync::{watch, Notify};

use std::fs;

use super::api::{ApiError, ClaimApi, ClaimRead};
use super::claim::tests::{allocated_claim, inventory};
use super::*;
use crate::node_state::checkpoint::{self, ClaimState};
use crate::node_state::fault;

/// An answer as the kubelet reads it: the error as its text.
trait KubeletText<T> {
    fn text(&self) -> Result<T, String>;
}

impl<T: Clone> KubeletText<T> for Result<T, PrepareError> {
    fn text(&self) -> Result<T, String> {
        self.as_ref().map_err(ToString::to_string).cloned()
    }
}

/// The kubelet's answer for one claim, as it reads it.
async fn prepare_one(
    preparer: &ClaimPreparer,
    name: &str,
    uid: &str,
) -> Result<Vec<PreparedDevice>, String> {
    preparer.prepare(vec![r(name, uid)]).await[0].1.text()
}

async fn unprepare_one(preparer: &ClaimPreparer, name: &str, uid: &str) -> Result<(), String> {
    preparer.unprepare(vec![r(name, uid)]).await[0].1.text()
}

const NODE: &str = "node-a";
const UID_A: &str = "0b7c4a49-6f1e-4a52-9d0e-6d1f3f7a5b10";
const UID_B: &str = "1c8d5b5a-7a2f-4b63-8e1f-7e2a4a8b6c21";
const UID_C: &str = "2d9e6c6b-8b3a-4c74-9f2a-8f3b5b9c7d32";
const UID_D: &str = "3eaf7d7c-9c4b-4d85-a03b-904c6cad8e43";

#[derive(Default)]
struct FakeApi {
    claims: Mutex<HashMap<(String, String), ResourceClaim>>,
    down: AtomicBool,
    fail_status_writes: AtomicBool,
    /// Milliseconds each status write waits before it lands (a slow API server).
    status_write_delay_ms: std::sync::atomic::AtomicU64,
    /// Reads of any kind, and of those the quorum reads.
    gets: AtomicUsize,
    quorum_gets: AtomicUsize,
    /// Reads asked for, answered or not.
    read_attempts: AtomicUsize,
    status_writes: AtomicUsize,
    /// What the watch cache serves instead of the current object, when set (a cache behind).
    cache: Mutex<HashMap<(String, String), ResourceClaim>>,
    /// Every read asked for, in order.
    reads: Mutex<Vec<ClaimRead>>,
    events: Mutex<Vec<Event>>,
    /// A claim name whose read waits until notified.
    gate: Mutex<Option<(String, Arc<Notify>)>>,
    /// Milliseconds each read takes, and the most reads seen in flight at once.
    read_delay_ms: std::sync::atomic::AtomicU64,
    reads_in_flight: AtomicUsize,
    most_reads_in_flight: AtomicUsize,
}

impl FakeApi {
    fn add(&self, name: &str, claim: ResourceClaim) {
        let mut claim = claim;
        claim.metadata.name = Some(name.into());
        let previous = self
            .claims
            .lock()
            .unwrap()
            .get(&("team-a".to_string(), name.to_string()))
            .and_then(|c| c.metadata.resource_version.clone());
        claim.metadata.resource_version = previous;
        FakeApi::bump_version(&mut claim);
        self.claims
            .lock()
            .unwrap()
            .insert(("team-a".into(), name.into()), claim);
    }

    /// A write by someone else: the claim's resourceVersion moves on.
    fn bump_version(claim: &mut ResourceClaim) -> String {
        let next = claim
            .metadata
            .resource_version
            .as_deref()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
            + 1;
        claim.metadata.resource_version = Some(next.to_string());
        next.to_string()
    }

    /// Another writer (another driver on a claim with devices of several) adds its entry.
    fn add_foreign_status(&self, name: &str, entry: AllocatedDeviceStatus) {
        let mut claims = self.claims.lock().unwrap();
        let claim = claims
            .get_mut(&("team-a".to_string(), name.to_string()))
            .unwrap();
        claim
            .status
            .get_or_insert_with(Default::default)
            .devices
            .get_or_insert_with(Vec::new)
            .push(entry);
        FakeApi::bump_version(claim);
    }

    /// From now on the watch cache serves `claim` for `name`, whatever the object becomes.
    fn cache_serves(&self, name: &str, claim: ResourceClaim) {
        self.cache
            .lock()
            .unwrap()
            .insert(("team-a".into(), name.into()), claim);
    }

    /// The object as it is now.
    fn current(&self, name: &str) -> ResourceClaim {
        self.claims.lock().unwrap()[&("team-a".to_string(), name.to_string())].clone()
    }

    fn device_status(&self, name: &str) -> Vec<AllocatedDeviceStatus> {
        self.current(name)
            .status
            .and_then(|s| s.devices)
            .unwrap_or_default()
    }

    fn event_reasons(&self) -> Vec<(String, String)> {
        self.events
            .lock()
            .unwrap()
            .iter()
            .map(|e| {
                (
                    e.involved_object.name.clone().unwrap_or_default(),
                    e.reason.clone().unwrap_or_default(),
                )
            })
            .collect()
    }
}

impl ClaimApi for FakeApi {
    fn get_claim<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        read: ClaimRead,
    ) -> BoxFuture<'a, Result<ResourceClaim, ApiError>> {
        Box::pin(async move {
            let gate = self.gate.lock().unwrap().clone();
            if let Some((gated, notify)) = gate {
                if gated == name {
                    notify.notified().await;
                }
            }
            let in_flight = self.reads_in_flight.fetch_add(1, Ordering::SeqCst) + 1;
            self.most_reads_in_flight
                .fetch_max(in_flight, Ordering::SeqCst);
            let delay = self.read_delay_ms.load(Ordering::SeqCst);
            if delay > 0 {
                tokio::time::sleep(std::time::Duration::from_millis(delay)).await;
            }
            self.reads_in_flight.fetch_sub(1, Ordering::SeqCst);
            self.read_attempts.fetch_add(1, Ordering::SeqCst);
            self.reads.lock().unwrap().push(read.clone());
            if self.down.load(Ordering::SeqCst) {
                return Err(ApiError::Other("connection refused".into()));
            }
            self.gets.fetch_add(1, Ordering::SeqCst);
            let key = (namespace.to_string(), name.to_string());
            let version = |c: &ResourceClaim| {
                c.metadata
                    .resource_version
                    .as_deref()
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(0)
            };
            match &read {
                ClaimRead::Quorum => {
                    self.quorum_gets.fetch_add(1, Ordering::SeqCst);
                }
                // The cache's copy when it is at least that version, else the object.
                ClaimRead::NotOlderThan(at) => {
                    let at: u64 = at.parse().unwrap();
                    if let Some(stale) = self.cache.lock().unwrap().get(&key) {
                        if version(stale) >= at {
                            return Ok(stale.clone());
                        }
                    }
                }
                ClaimRead::Cached => {
                    if let Some(stale) = self.cache.lock().unwrap().get(&key) {
                        return Ok(stale.clone());
                    }
                }
            }
            self.claims
                .lock()
                .unwrap()
                .get(&key)
                .cloned()
                .ok_or(ApiError::NotFound)
        })
    }

    fn write_device_status<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        devices: Vec<AllocatedDeviceStatus>,
        based_on: Option<String>,
    ) -> BoxFuture<'a, Result<String, ApiError>> {
        Box::pin(async move {
            let delay = self.status_write_delay_ms.load(Ordering::SeqCst);
            if delay > 0 {
                tokio::time::sleep(std::time::Duration::from_millis(delay)).await;
            }
            if self.down.load(Ordering::SeqCst) || self.fail_status_writes.load(Ordering::SeqCst) {
                return Err(ApiError::Other("connection refused".into()));
            }
            self.status_writes.fetch_add(1, Ordering::SeqCst);
            let mut claims = self.claims.lock().unwrap();
            let claim = claims
                .get_mut(&(namespace.to_string(), name.to_string()))
                .ok_or(ApiError::NotFound)?;
            if based_on.is_some() && based_on != claim.metadata.resource_version {
                return Err(ApiError::Conflict);
            }
            claim.status.get_or_insert_with(Default::default).devices = Some(devices);
            Ok(FakeApi::bump_version(claim))
        })
    }

    fn post_event(&self, event: Event) -> BoxFuture<'_, Result<(), ApiError>> {
        Box::pin(async move {
            if self.down.load(Ordering::SeqCst) {
                return Err(ApiError::Other("connection refused".into()));
            }
            self.events.lock().unwrap().push(event);
            Ok(())
        })
    }
}

struct Node {
    _root: tempfile::TempDir,
    top: PathBuf,
    opts: PrepareOptions,
    api: Arc<FakeApi>,
}

impl Node {
    fn new() -> Self {
        let root = tempfile::tempdir().unwrap();
        // Nested, so that escaping the CDI root or state dir would still land inside `top`.
        let top = root.path().join("host");
        let opts = opts_under(&top);
        Node {
            _root: root,
            top,
            opts,
            api: Arc::new(FakeApi::default()),
        }
    }

    async fn start_with_boot(&self, boot_id: &str) -> Arc<ClaimPreparer> {
        let weights = BTreeMap::from([("A100-SXM4-40GB".to_string(), 312i64)]);
        let (_tx, rx) = watch::channel(weights);
        Arc::new(
            ClaimPreparer::with_api(
                self.opts.clone(),
                Arc::new(inventory()),
                self.api.clone(),
                rx,
                boot_id.into(),
            )
            .await
            .unwrap(),
        )
    }

    async fn start(&self) -> Arc<ClaimPreparer> {
        self.start_with_boot("boot-1").await
    }

    fn spec_path(&self, uid: &str) -> PathBuf {
        self.opts.layout.spec_path(uid)
    }

    fn spec(&self, uid: &str) -> gpupool_api::cdi::Spec {
        serde_json::from_slice(&fs::read(self.spec_path(uid)).unwrap()).unwrap()
    }

    fn cdi_files(&self) -> BTreeSet<String> {
        fs::read_dir(&self.opts.layout.cdi_root)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect()
    }

    fn all_files(&self) -> BTreeSet<PathBuf> {
        fn walk(dir: &Path, out: &mut BTreeSet<PathBuf>) {
            for e in fs::read_dir(dir).unwrap() {
                let p = e.unwrap().path();
                out.insert(p.clone());
                if p.is_dir() {
                    walk(&p, out);
                }
            }
        }
        let mut out = BTreeSet::new();
        walk(self._root.path(), &mut out);
        out
    }
}

fn opts_under(top: &Path) -> PrepareOptions {
    let run_dir = top.join("run/gpupool");
    let inventory = inventory();
    let manager = crate::mig::fake::FakeMig::new(&run_dir, &inventory).unwrap();
    PrepareOptions {
        node_name: NODE.into(),
        layout: NodeLayout::new(
            top.join("var/lib/gpupool"),
            top.join("run/cdi"),
            run_dir,
            (&top.join("usr/local/gpupool"), &top.join("usr/local/vgpu")),
            true,
        ),
        driver_libraries: DriverLibraries::None,
        default_enforcement: DefaultEnforcement::Auto,
        mig: crate::node_state::MigCards {
            manager: Arc::new(manager),
            cards: inventory
                .gpus
                .iter()
                .filter(|g| g.mig.is_some())
                .map(|g| g.uuid.clone())
                .collect(),
        },
        status_write_delay: STATUS_WRITE_DELAY,
    }
}

fn r(name: &str, uid: &str) -> ClaimRef {
    ClaimRef {
        namespace: "team-a".into(),
        name: name.into(),
        uid: uid.into(),
    }
}

#[test]
fn the_preparer_can_be_shared_across_tasks() {
    fn send_sync<T: Send + Sync + 'static>() {}
    send_sync::<ClaimPreparer>();
}

/// A claim holding 8Gi + 50% of the node's A100.
fn fractional(uid: &str) -> ResourceClaim {
    allocated_claim(
        uid,
        &[("gpu", NODE, "gpu-0", Some("a1b2"), Some("8Gi"), Some("50"))],
        json!([]),
    )
}

#[tokio::test]
async fn prepares_a_fractional_claim_and_reports_it() {
    let node = Node::new();
    node.api.add("train", fractional(UID_A));
    let preparer = node.start().await;

    let answer = preparer.prepare(vec![r("train", UID_A)]).await;
    let devices = answer[0].1.text().unwrap();
    let id = format!("gpupool.dev/claim={UID_A}-gpu-0-a1b2");
    assert_eq!(
        devices,
        vec![PreparedDevice {
            request_names: vec!["gpu".into()],
            pool_name: NODE.into(),
            device_name: "gpu-0".into(),
            cdi_device_ids: vec![id],
            share_id: Some("a1b2".into()),
        }]
    );

    let spec = node.spec(UID_A);
    assert_eq!(gpupool_api::cdi::validate(&spec), Vec::<String>::new());
    let env = &spec.devices[0].container_edits.env;
    for expected in [
        "CUDA_DEVICE_MEMORY_LIMIT_0=8192m",
        "CUDA_DEVICE_SM_LIMIT_0=50",
        "GPUPOOL_DEVICE_MODEL_0=A100-SXM4-40GB",
    ] {
        assert!(
            env.iter().any(|e| e == expected),
            "{expected} not in {env:?}"
        );
    }
    let cache_dir = node.opts.layout.run_dir.join("vgpu-cache").join(UID_A);
    assert!(cache_dir.is_dir(), "the claim's cache folder exists");
    let cache_env = env
        .iter()
        .find(|e| e.starts_with("CUDA_DEVICE_MEMORY_SHARED_CACHE="))
        .unwrap();
    assert!(cache_env.contains(&cache_dir.display().to_string()));

    let saved = checkpoint::load(&node.opts.layout.state_dir)
        .unwrap()
        .unwrap();
    assert_eq!(saved.claims[UID_A].state, ClaimState::PrepareCompleted);
    assert_eq!(saved.claims[UID_A].devices, devices);
    assert_eq!(saved.boot_id, "boot-1");

    preparer.flush_status_writes().await;
    let status = node.api.device_status("train");
    assert_eq!(status.len(), 1);
    assert_eq!(status[0].share_id.as_deref(), Some("a1b2"));
    let data = &status[0].data.as_ref().unwrap().0;
    assert_eq!(data["memoryLimit"], "8Gi");
    assert_eq!(data["coreLimit"], 50);
    assert_eq!(data["computeUnits"], 156.0);
    // No libvgpu.so in the temp vgpu dir: said so in the status.
    assert!(data["warning"].as_str().unwrap().contains("not installed"));
}

#[tokio::test]
async fn a_second_prepare_returns_the_recorded_answer_without_the_api() {
    let node = Node::new();
    node.api.add("train", fractional(UID_A));
    let preparer = node.start().await;
    let first = prepare_one(&preparer, "train", UID_A).await.unwrap();
    node.api.down.store(true, Ordering::SeqCst);
    let second = prepare_one(&preparer, "train", UID_A).await.unwrap();
    assert_eq!(first, second);
    assert_eq!(node.api.gets.load(Ordering::SeqCst), 1);

    // A spec removed behind our back comes back on the next prepare.
    fs::remove_file(node.spec_path(UID_A)).unwrap();
    let third = prepare_one(&preparer, "train", UID_A).await.unwrap();
    assert_eq!(third, first);
    assert!(node.spec_path(UID_A).exists());
}

#[tokio::test]
async fn two_prepares_of_one_claim_at_once_give_one_spec_and_one_answer() {
    let node = Node::new();
    node.api.add("train", fractional(UID_A));
    let preparer = node.start().await;
    let (a, b) = tokio::join!(
        preparer.prepare(vec![r("train", UID_A)]),
        preparer.prepare(vec![r("train", UID_A)])
    );
    assert_eq!(a[0].1.text().unwrap(), b[0].1.text().unwrap());
    assert_eq!(node.api.gets.load(Ordering::SeqCst), 1);
    assert_eq!(node.cdi_files().len(), 1);
    // Per-claim locks do not pile up once nobody waits on them.
    assert!(preparer.claim_locks.lock().unwrap().is_empty());
}

#[tokio::test]
async fn claim_a_does_not_wait_for_claim_b() {
    let node = Node::new();
    node.api.add("slow", fractional(UID_B));
    node.api.add("fast", fractional(UID_A));
    let notify = Arc::new(Notify::new());
    *node.api.gate.lock().unwrap() = Some(("slow".into(), notify.clone()));
    let preparer = node.start().await;

    let slow = tokio::spawn({
        let p = preparer.clone();
        async move { p.prepare(vec![r("slow", UID_B)]).await }
    });
    tokio::task::yield_now().await;
    let fast = tokio::time::timeout(
        std::time::Duration::from_secs(5),
        preparer.prepare(vec![r("fast", UID_A)]),
    )
    .await
    .expect("claim A finished while claim B was still waiting on the API");
    assert!(fast[0].1.is_ok());
    notify.notify_one();
    assert!(slow.await.unwrap()[0].1.is_ok());
}

#[tokio::test]
async fn bad_claims_fail_alone_and_get_an_event() {
    let node = Node::new();
    node.api.add("good", fractional(UID_A));
    node.api.add("mismatch", fractional(UID_D)); // the kubelet asks with UID_B
    let mut unallocated = fractional(UID_C);
    unallocated.status = None;
    node.api.add("pending", unallocated);
    node.api.add(
        "elsewhere",
        allocated_claim(
            UID_D,
            &[("gpu", "node-b", "gpu-0", None, None, None)],
            json!([]),
        ),
    );
    let preparer = node.start().await;

    let answers = preparer
        .prepare(vec![
            r("mismatch", UID_B),
            r("good", UID_A),
            r("pending", UID_C),
            r("elsewhere", UID_D),
            r("missing", "4fb08e8d-ad5c-4e96-b14c-a15d7dbe9f54"),
        ])
        .await;
    let errors: Vec<String> = answers
        .iter()
        .filter_map(|(_, a)| a.as_ref().err().map(ToString::to_string))
        .collect();
    assert!(answers[1].1.is_ok(), "{:?}", answers[1]);
    assert_eq!(errors.len(), 4, "{errors:?}");
    assert!(
        errors[0].contains("team-a/mismatch") && errors[0].contains("uid"),
        "{}",
        errors[0]
    );
    assert_eq!(errors[1], "claim team-a/pending: not allocated");
    assert!(
        errors[2].contains("team-a/elsewhere: allocated to another node/pool"),
        "{}",
        errors[2]
    );
    assert!(errors[3].contains("not found"), "{}", errors[3]);

    let events = node.api.event_reasons();
    for name in ["mismatch", "pending", "elsewhere", "missing"] {
        assert!(
            events.contains(&(name.to_string(), "PrepareFailed".to_string())),
            "{events:?}"
        );
    }
    assert_eq!(
        node.cdi_files(),
        BTreeSet::from([format!("gpupool.dev-claim_{UID_A}.json")])
    );
    let saved = checkpoint::load(&node.opts.layout.state_dir)
        .unwrap()
        .unwrap();
    assert_eq!(saved.claims.keys().collect::<Vec<_>>(), vec![UID_A]);
}

#[tokio::test]
async fn gpu_config_errors_name_the_field() {
    let node = Node::new();
    let config = |params: serde_json::Value| {
        json!([{"source": "FromClaim", "requests": ["gpu"],
                "opaque": {"driver": "gpupool.dev", "parameters": params}}])
    };
    let base = json!({"apiVersion": "gpupool.dev/v1alpha1", "kind": "GpuConfig"});
    let with = |k: &str, v: serde_json::Value| {
        let mut p = base.clone();
        p[k] = v;
        p
    };
    let cases = [
        (
            "unknown",
            UID_A,
            with("memoryLimt", json!("1Gi")),
            "parameters.memoryLimt: unknown field",
        ),
        (
            "above",
            UID_B,
            with("memoryLimit", json!("9Gi")),
            "parameters.memoryLimit: 9Gi is above the 8Gi",
        ),
        (
            "badenum",
            UID_C,
            with("enforcement", json!("Hami")),
            "parameters.enforcement: unsupported value",
        ),
    ];
    for (name, uid, params, _) in &cases {
        node.api.add(
            name,
            allocated_claim(
                uid,
                &[("gpu", NODE, "gpu-0", None, Some("8Gi"), None)],
                config(params.clone()),
            ),
        );
    }
    node.api.add(
        "lowered",
        allocated_claim(
            UID_D,
            &[("gpu", NODE, "gpu-0", None, Some("8Gi"), None)],
            config(with("memoryLimit", json!("2Gi"))),
        ),
    );
    let preparer = node.start().await;
    let mut refs: Vec<ClaimRef> = cases.iter().map(|(n, u, _, _)| r(n, u)).collect();
    refs.push(r("lowered", UID_D));
    let answers = preparer.prepare(refs).await;
    for ((_, answer), (name, _, _, expected)) in answers.iter().zip(&cases) {
        let e = answer.as_ref().unwrap_err().to_string();
        assert!(e.contains(expected), "{name}: {e}");
        assert!(e.contains(&format!("team-a/{name}")), "{e}");
    }
    assert!(answers[3].1.is_ok());
    let env = &node.spec(UID_D).devices[0].container_edits.env;
    assert!(
        env.contains(&"CUDA_DEVICE_MEMORY_LIMIT_0=2048m".to_string()),
        "{env:?}"
    );
    assert_eq!(node.api.event_reasons().len(), 3);
}

#[tokio::test]
async fn two_shares_of_different_cards_get_ordinals_in_cdi_id_order() {
    let node = Node::new();
    node.api.add(
        "pair",
        allocated_claim(
            UID_A,
            &[
                ("gpu", NODE, "gpu-1", Some("s1"), Some("16Gi"), Some("25")),
                ("gpu", NODE, "gpu-0", Some("s2"), Some("8Gi"), Some("50")),
            ],
            json!([]),
        ),
    );
    let preparer = node.start().await;
    let devices = prepare_one(&preparer, "pair", UID_A).await.unwrap();
    let ids: Vec<&str> = devices
        .iter()
        .map(|d| d.cdi_device_ids[0].as_str())
        .collect();
    assert_eq!(
        ids,
        [
            format!("gpupool.dev/claim={UID_A}-gpu-1-s1"),
            format!("gpupool.dev/claim={UID_A}-gpu-0-s2")
        ]
    );
    let spec = node.spec(UID_A);
    let d0 = &spec.devices[0];
    let d1 = &spec.devices[1];
    assert_eq!(format!("gpupool.dev/claim={}", d0.name), ids[0]);
    for (device, env) in [
        (d0, "CUDA_DEVICE_MEMORY_LIMIT_0=16384m"),
        (d0, "GPUPOOL_DEVICE_MODEL_0=V100-SXM2-32GB"),
        (d1, "CUDA_DEVICE_MEMORY_LIMIT_1=8192m"),
        (d1, "CUDA_DEVICE_SM_LIMIT_1=50"),
    ] {
        let all = &device.container_edits.env;
        assert!(all.contains(&env.to_string()), "{env} not in {all:?}");
    }
    preparer.flush_status_writes().await;
    assert_eq!(node.api.device_status("pair").len(), 2);
}

#[tokio::test]
async fn hostile_names_write_nothing_anywhere() {
    let node = Node::new();
    let preparer = node.start().await;
    let before = node.all_files();
    let hostile = vec![
        r("x", "../../etc"),
        r("x", "/etc/passwd"),
        ClaimRef {
            namespace: "../../tmp".into(),
            name: "x".into(),
            uid: UID_A.into(),
        },
        r("../x", UID_A),
    ];
    for (_, answer) in preparer.prepare(hostile.clone()).await {
        assert!(answer.is_err());
    }
    for (_, answer) in preparer.unprepare(hostile).await {
        assert!(answer.is_err());
    }
    assert_eq!(node.all_files(), before);
    assert_eq!(node.api.gets.load(Ordering::SeqCst), 0);
}

/// Claims `train` (UID_A) and `other` (UID_B) prepared on `node`.
async fn two_prepared_claims(node: &Node) -> Arc<ClaimPreparer> {
    node.api.add("train", fractional(UID_A));
    node.api.add("other", fractional(UID_B));
    let preparer = node.start().await;
    for (_, a) in preparer
        .prepare(vec![r("train", UID_A), r("other", UID_B)])
        .await
    {
        a.unwrap();
    }
    preparer
}

#[tokio::test]
async fn unprepare_removes_everything_and_works_without_the_api() {
    let node = Node::new();
    let preparer = two_prepared_claims(&node).await;
    let cache_a = node.opts.layout.run_dir.join("vgpu-cache").join(UID_A);
    assert!(cache_a.is_dir());
    // The prepare's status write lands first (a write still queued at the unprepare is dropped).
    preparer.flush_status_writes().await;

    let answers = preparer.unprepare(vec![r("train", UID_A)]).await;
    assert!(answers[0].1.is_ok());
    assert!(!node.spec_path(UID_A).exists());
    assert!(!cache_a.exists());
    preparer.flush_status_writes().await;
    assert_eq!(
        node.api.device_status("train").len(),
        1,
        "the status stays until the API server drops it with the allocation"
    );
    assert!(preparer.prepared(UID_A).await.is_none());

    node.api.down.store(true, Ordering::SeqCst);
    let answers = preparer
        .unprepare(vec![
            r("other", UID_B),
            r("never", UID_C),
            r("train", UID_A),
        ])
        .await;
    assert!(answers.iter().all(|(_, a)| a.is_ok()), "{answers:?}");
    assert!(node.cdi_files().is_empty());
    let saved = checkpoint::load(&node.opts.layout.state_dir)
        .unwrap()
        .unwrap();
    assert!(saved.claims.is_empty());

    // A new claim cannot be prepared while the API is away, and says why, after one read: a server
    // that cannot answer from its cache is not asked again with quorum.
    node.api.add("late", fractional(UID_C));
    let attempts = node.api.read_attempts.load(Ordering::SeqCst);
    let e = prepare_one(&preparer, "late", UID_C).await.unwrap_err();
    assert!(e.contains("team-a/late") && e.contains("API server"), "{e}");
    assert_eq!(node.api.read_attempts.load(Ordering::SeqCst), attempts + 1);
}

#[tokio::test]
async fn a_claim_lifecycle_costs_one_cached_read_and_one_status_write() {
    let node = Node::new();
    let preparer = two_prepared_claims(&node).await;
    preparer.flush_status_writes().await;
    assert_eq!(node.api.device_status("train").len(), 1);
    let reads = |api: &FakeApi| {
        (
            api.gets.load(Ordering::SeqCst),
            api.quorum_gets.load(Ordering::SeqCst),
        )
    };
    assert_eq!(reads(&node.api), (2, 0), "one cached read per prepare");
    assert_eq!(node.api.status_writes.load(Ordering::SeqCst), 2);

    // Unprepare asks nothing of the API server.
    for (name, uid) in [("train", UID_A), ("other", UID_B)] {
        unprepare_one(&preparer, name, uid).await.unwrap();
    }
    preparer.flush_status_writes().await;
    assert_eq!(reads(&node.api), (2, 0));
    assert_eq!(node.api.status_writes.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_status_write_that_finds_the_claim_changed_reads_it_and_keeps_other_entries() {
    let node = Node::new();
    node.api.add("train", fractional(UID_A));
    // Another driver wrote its entry after the copy the prepare reads was taken.
    node.api.cache_serves("train", node.api.current("train"));
    let foreign = AllocatedDeviceStatus {
        driver: "other.example.com".into(),
        pool: "node-a".into(),
        device: "nic-0".into(),
        ..Default::default()
    };
    node.api.add_foreign_status("train", foreign.clone());
    let preparer = node.start().await;
    assert!(preparer.prepare(vec![r("train", UID_A)]).await[0].1.is_ok());
    preparer.flush_status_writes().await;
    let status = node.api.device_status("train");
    assert_eq!(status.len(), 2, "{status:?}");
    assert!(status.contains(&foreign));
    assert_eq!(node.api.quorum_gets.load(Ordering::SeqCst), 1);
    assert_eq!(node.api.status_writes.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_cached_copy_of_an_allocation_already_unprepared_is_read_again_with_quorum() {
    let node = Node::new();
    node.api.add("train", fractional(UID_A));
    let preparer = node.start().await;
    let first = prepare_one(&preparer, "train", UID_A).await.unwrap();
    unprepare_one(&preparer, "train", UID_A).await.unwrap();
    preparer.flush_status_writes().await;

    // The claim was deallocated and allocated again on this node: same device, new share. The
    // watch cache still serves the old allocation.
    node.api.cache_serves("train", node.api.current("train"));
    node.api.add(
        "train",
        allocated_claim(
            UID_A,
            &[("gpu", NODE, "gpu-0", Some("c3d4"), Some("4Gi"), Some("25"))],
            json!([]),
        ),
    );
    let quorum_before = node.api.quorum_gets.load(Ordering::SeqCst);
    let second = prepare_one(&preparer, "train", UID_A).await.unwrap();
    assert_eq!(
        node.api.quorum_gets.load(Ordering::SeqCst),
        quorum_before + 1
    );
    assert_eq!(first[0].share_id.as_deref(), Some("a1b2"));
    assert_eq!(
        second[0].share_id.as_deref(),
        Some("c3d4"),
        "the current allocation"
    );
    let env = &node.spec(UID_A).devices[0].container_edits.env;
    assert!(
        env.contains(&"CUDA_DEVICE_MEMORY_LIMIT_0=4096m".to_string()),
        "{env:?}"
    );
}

#[tokio::test]
async fn a_stale_copy_the_rule_cannot_see_is_caught_by_the_status_write() {
    let node = Node::new();
    // Reserved and allocated on this node, never prepared here, since replaced by another
    // allocation of this node: the one case a cached copy can pass for the current one.
    let mut earlier = allocated_claim(
        UID_A,
        &[("gpu", NODE, "gpu-0", Some("e1e1"), Some("8Gi"), Some("50"))],
        json!([]),
    );
    earlier.metadata.resource_version = Some("1".into());
    node.api.add("train", fractional(UID_A));
    node.api.cache_serves("train", earlier);
    FakeApi::bump_version(
        node.api
            .claims
            .lock()
            .unwrap()
            .get_mut(&("team-a".to_string(), "train".to_string()))
            .unwrap(),
    );
    let preparer = node.start().await;
    assert!(preparer.prepare(vec![r("train", UID_A)]).await[0].1.is_ok());
    preparer.flush_status_writes().await;
    // The conditional write failed, the quorum read showed another allocation: no status that
    // would claim the claim is ready on devices it was not prepared for.
    assert!(node.api.device_status("train").is_empty());
    assert_eq!(node.api.quorum_gets.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_checkpoint_that_cannot_be_written_fails_the_prepare_and_leaves_nothing() {
    let node = Node::new();
    node.api.add("train", fractional(UID_A));
    let preparer = node.start().await;
    let before = node.all_files();
    // The checkpoint's log replaced by a folder: PrepareStarted cannot be recorded, while the
    // spec's temp file is being written at the same time.
    let blocker = checkpoint::log_path(&node.opts.layout.state_dir);
    fs::remove_file(&blocker).unwrap();
    fs::create_dir(&blocker).unwrap();
    let answer = preparer.prepare(vec![r("train", UID_A)]).await;
    let error = answer[0].1.text().unwrap_err();
    assert!(error.contains("checkpoint.wal"), "{error}");
    fs::remove_dir(&blocker).unwrap();
    let mut expected = before;
    expected.remove(&blocker);
    assert_eq!(
        node.all_files(),
        expected,
        "no spec, temp file or cache folder left"
    );
    assert!(preparer.prepare(vec![r("train", UID_A)]).await[0].1.is_ok());
    assert!(node.spec_path(UID_A).exists());
}

#[tokio::test]
async fn a_failing_status_write_does_not_fail_the_prepare() {
    let node = Node::new();
    node.api.add("train", fractional(UID_A));
    node.api.fail_status_writes.store(true, Ordering::SeqCst);
    let preparer = node.start().await;
    assert!(preparer.prepare(vec![r("train", UID_A)]).await[0].1.is_ok());
    assert!(node.spec_path(UID_A).exists());
}

#[tokio::test]
async fn the_answer_does_not_wait_for_the_status_and_a_quick_unprepare_writes_nothing() {
    let node = Node::new();
    node.api.add("train", fractional(UID_A));
    node.api.status_write_delay_ms.store(300, Ordering::SeqCst);
    let preparer = node.start().await;
    let started = std::time::Instant::now();
    assert!(preparer.prepare(vec![r("train", UID_A)]).await[0].1.is_ok());
    assert!(
        started.elapsed() < std::time::Duration::from_millis(300),
        "prepare waited for the status write: {:?}",
        started.elapsed()
    );
    assert!(preparer.unprepare(vec![r("train", UID_A)]).await[0]
        .1
        .is_ok());
    preparer.flush_status_writes().await;
    assert_eq!(
        node.api.status_writes.load(Ordering::SeqCst),
        0,
        "a claim unprepared before its write is due gets none"
    );

    node.api.status_write_delay_ms.store(0, Ordering::SeqCst);
    assert!(preparer.prepare(vec![r("train", UID_A)]).await[0].1.is_ok());
    preparer.flush_status_writes().await;
    assert_eq!(node.api.device_status("train").len(), 1);
}

/// The claim reserved for another pod than the one it was prepared for (a pod re-created on it).
fn reserved_for_a_new_pod(uid: &str) -> ResourceClaim {
    let mut claim = fractional(uid);
    claim.status.as_mut().unwrap().reserved_for = Some(vec![
        k8s_openapi::api::resource::v1::ResourceClaimConsumerReference {
            resource: "pods".into(),
            name: "train-1".into(),
            uid: "9f1c2d3e-4b5a-4c6d-8e7f-000000000002".into(),
            ..Default::default()
        },
    ]);
    claim
}

#[tokio::test]
async fn a_pod_recreated_on_the_same_claim_costs_one_cached_read() {
    let node = Node::new();
    node.api.add("train", fractional(UID_A));
    let preparer = node.start().await;
    prepare_one(&preparer, "train", UID_A).await.unwrap();
    preparer.flush_status_writes().await;
    let seen = node.api.current("train").metadata.resource_version.unwrap();
    unprepare_one(&preparer, "train", UID_A).await.unwrap();

    // Same allocation, now reserved for the new pod; the cache is up to date.
    node.api.add("train", reserved_for_a_new_pod(UID_A));
    node.api.cache_serves("train", node.api.current("train"));
    let before = node.api.reads.lock().unwrap().len();
    prepare_one(&preparer, "train", UID_A).await.unwrap();
    let reads = node.api.reads.lock().unwrap()[before..].to_vec();
    assert_eq!(
        reads,
        [ClaimRead::NotOlderThan(seen)],
        "one cached read, not older than the status write the driver saw"
    );
}

#[tokio::test]
async fn prepare_status_writes_wait_and_only_the_last_prepare_writes() {
    let node = Node::new();
    node.api.add("train", fractional(UID_A));
    let mut opts = node.opts.clone();
    opts.status_write_delay = std::time::Duration::from_millis(300);
    let preparer = Arc::new(
        ClaimPreparer::with_api(
            opts,
            Arc::new(inventory()),
            node.api.clone(),
            watch::channel(BTreeMap::new()).1,
            current_boot_id(),
        )
        .await
        .unwrap(),
    );
    prepare_one(&preparer, "train", UID_A).await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    assert_eq!(
        node.api.status_writes.load(Ordering::SeqCst),
        0,
        "not due yet"
    );
    // The pod goes and a new one comes, all within the delay: one write, the last prepare's.
    unprepare_one(&preparer, "train", UID_A).await.unwrap();
    node.api.add("train", reserved_for_a_new_pod(UID_A));
    prepare_one(&preparer, "train", UID_A).await.unwrap();
    preparer.flush_status_writes().await;
    assert_eq!(node.api.status_writes.load(Ordering::SeqCst), 1);
    assert_eq!(node.api.device_status("train").len(), 1);
}

/// A burst of prepares (pods starting together) reads its claims at most four at a time: each
/// read in flight is an HTTP/1.1 connection the client keeps afterwards.
#[tokio::test]
async fn a_burst_of_prepares_holds_at_most_four_claim_reads_in_flight() {
    let node = Node::new();
    let claims: Vec<(String, String)> = (0..12)
        .map(|i| {
            let uid = format!("{i:08x}-6f1e-4a52-9d0e-6d1f3f7a5b10");
            let name = format!("train-{i}");
            node.api.add(
                &name,
                allocated_claim(
                    &uid,
                    &[(
                        "gpu",
                        NODE,
                        "gpu-0",
                        Some(&format!("{i:04x}")),
                        Some("1Gi"),
                        Some("5"),
                    )],
                    json!([]),
                ),
            );
            (name, uid)
        })
        .collect();
    node.api.read_delay_ms.store(20, Ordering::SeqCst);
    let preparer = node.start().await;
    let refs = claims.iter().map(|(name, uid)| r(name, uid)).collect();
    let answers = preparer.prepare(refs).await;
    for (claim, answer) in &answers {
        assert!(answer.is_ok(), "{claim}: {:?}", answer.as_ref().err());
    }
    assert_eq!(node.api.most_reads_in_flight.load(Ordering::SeqCst), 4);
}

/// A device that turns unhealthy while a prepare's status write still waits for its time: the
/// health write comes after the prepare's, so the claim ends up showing the fault, not the
/// healthy status the prepare computed.
#[tokio::test]
async fn a_health_change_during_the_status_delay_is_written_after_the_prepare_status() {
    let mut node = Node::new();
    node.api.add("train", fractional(UID_A));
    node.opts.status_write_delay = std::time::Duration::from_millis(300);
    let preparer = node.start().await;
    prepare_one(&preparer, "train", UID_A).await.unwrap();
    preparer.report_device_health(BTreeMap::from([(
        "gpu-0".to_string(),
        "XID 79".to_string(),
    )]));
    preparer.flush_status_writes().await;
    let status = node.api.device_status("train");
    assert_eq!(status.len(), 1);
    let ready = status[0]
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "Ready")
        .expect("a Ready condition");
    assert_eq!(ready.status, "False", "{ready:?}");
    assert!(ready.message.contains("XID 79"), "{ready:?}");
}

#[tokio::test]
async fn restart_removes_orphans_and_rolls_back_unfinished_prepares() {
    let node = Node::new();
    node.api.add("train", fractional(UID_A));
    let preparer = node.start().await;
    let answer = prepare_one(&preparer, "train", UID_A).await.unwrap();
    drop(preparer);

    // What a crash can leave: a spec with no entry, a temp file, a started entry with its spec.
    let orphan = node.spec_path(UID_B);
    fs::write(&orphan, b"{}").unwrap();
    let temp = node
        .opts
        .layout
        .cdi_root
        .join(format!(".gpupool.dev-claim_{UID_C}.json.tmp"));
    fs::write(&temp, b"{").unwrap();
    let mut data = checkpoint::load(&node.opts.layout.state_dir)
        .unwrap()
        .unwrap();
    let mut started = data.claims[UID_A].clone();
    started.state = ClaimState::PrepareStarted;
    data.claims.insert(UID_D.into(), started);
    checkpoint::save(&node.opts.layout.state_dir, &data).unwrap();
    fs::write(node.spec_path(UID_D), b"{}").unwrap();
    fs::create_dir_all(node.opts.layout.run_dir.join("vgpu-cache").join(UID_D)).unwrap();
    // Someone else's spec is never touched.
    let foreign = node.opts.layout.cdi_root.join("nvidia.com-gpu.json");
    fs::write(&foreign, b"{}").unwrap();

    let preparer = node.start().await;
    assert_eq!(
        node.cdi_files(),
        BTreeSet::from([
            format!("gpupool.dev-claim_{UID_A}.json"),
            "nvidia.com-gpu.json".to_string()
        ])
    );
    assert!(!node
        .opts
        .layout
        .run_dir
        .join("vgpu-cache")
        .join(UID_D)
        .exists());
    let saved = checkpoint::load(&node.opts.layout.state_dir)
        .unwrap()
        .unwrap();
    assert_eq!(saved.claims.keys().collect::<Vec<_>>(), vec![UID_A]);
    assert_eq!(preparer.prepared(UID_A).await, Some(answer));
}

#[tokio::test]
async fn after_a_reboot_specs_come_back_with_identical_ids() {
    let node = Node::new();
    node.api.add("train", fractional(UID_A));
    let preparer = node.start_with_boot("boot-1").await;
    let answer = prepare_one(&preparer, "train", UID_A).await.unwrap();
    let spec = node.spec(UID_A);
    drop(preparer);

    // A reboot empties /var/run/cdi (tmpfs) and the cache folders' content may go too.
    fs::remove_dir_all(&node.opts.layout.cdi_root).unwrap();
    fs::remove_dir_all(node.opts.layout.run_dir.join("vgpu-cache")).unwrap();
    node.api.down.store(true, Ordering::SeqCst);
    let preparer = node.start_with_boot("boot-2").await;
    assert_eq!(node.spec(UID_A), spec);
    assert!(node
        .opts
        .layout
        .run_dir
        .join("vgpu-cache")
        .join(UID_A)
        .is_dir());
    let again = prepare_one(&preparer, "train", UID_A).await.unwrap();
    assert_eq!(again, answer);
    let saved = checkpoint::load(&node.opts.layout.state_dir)
        .unwrap()
        .unwrap();
    assert_eq!(saved.boot_id, "boot-2");
}

#[tokio::test]
async fn after_a_reboot_a_claim_whose_card_is_gone_is_dropped() {
    let node = Node::new();
    node.api.add("train", fractional(UID_A));
    let preparer = node.start_with_boot("boot-1").await;
    prepare_one(&preparer, "train", UID_A).await.unwrap();
    drop(preparer);
    // As if the claim had been prepared on a card whose node no longer exists.
    let mut data = checkpoint::load(&node.opts.layout.state_dir)
        .unwrap()
        .unwrap();
    let spec = data.claims.get_mut(UID_A).unwrap().spec.as_mut().unwrap();
    spec.devices[0]
        .container_edits
        .device_nodes
        .push(gpupool_api::cdi::DeviceNode {
            path: "/dev/nvidia-gone-99".into(),
            ..Default::default()
        });
    checkpoint::save(&node.opts.layout.state_dir, &data).unwrap();

    let preparer = node.start_with_boot("boot-2").await;
    assert!(node.cdi_files().is_empty());
    assert_eq!(preparer.prepared(UID_A).await, None);
    // The kubelet's prepare after the reboot starts over and succeeds on what is there.
    assert!(preparer.prepare(vec![r("train", UID_A)]).await[0].1.is_ok());
}

#[tokio::test]
async fn a_corrupt_checkpoint_is_moved_aside_and_the_driver_works() {
    for corruption in [
        "truncated",
        "flipped",
        "version",
        "empty",
        "flipped log line",
    ] {
        let node = Node::new();
        node.api.add("train", fractional(UID_A));
        let preparer = node.start().await;
        let first = prepare_one(&preparer, "train", UID_A).await.unwrap();
        // The snapshot's damage on a snapshot that holds the claim (as an orderly stop leaves
        // it), the log's on a log that does (as a crash leaves it).
        let in_log = corruption.ends_with("log line");
        if !in_log {
            preparer.compact_checkpoint().await.unwrap();
        }
        drop(preparer);

        let path = if in_log {
            checkpoint::log_path(&node.opts.layout.state_dir)
        } else {
            checkpoint::path(&node.opts.layout.state_dir)
        };
        let good = fs::read(&path).unwrap();
        let bad: Vec<u8> = match corruption {
            "truncated" => good[..good.len() / 3].to_vec(),
            "flipped" | "flipped log line" => String::from_utf8(good.clone())
                .unwrap()
                .replacen("team-a", "team-b", 1)
                .into_bytes(),
            "version" => String::from_utf8(good)
                .unwrap()
                .replacen("\"version\": 1", "\"version\": 2", 1)
                .into_bytes(),
            _ => Vec::new(),
        };
        fs::write(&path, bad).unwrap();

        // A spec that is not valid CDI is not kept whatever happens.
        let junk = node.spec_path(UID_B);
        fs::write(&junk, b"{}").unwrap();

        let preparer = node.start().await;
        let aside: Vec<_> = fs::read_dir(&node.opts.layout.state_dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.starts_with("checkpoint.json.corrupt-"))
            .collect();
        assert_eq!(aside.len(), 1, "{corruption}");
        // The claim's spec survives (its containers may restart), the junk does not.
        assert_eq!(
            node.cdi_files(),
            BTreeSet::from([format!("gpupool.dev-claim_{UID_A}.json")]),
            "{corruption}"
        );
        // Its answer is not trusted: the next prepare asks the API again and gives the same ids.
        assert_eq!(preparer.prepared(UID_A).await, None);
        let gets = node.api.gets.load(Ordering::SeqCst);
        let again = prepare_one(&preparer, "train", UID_A).await;
        assert_eq!(again.unwrap(), first, "{corruption}");
        assert_eq!(node.api.gets.load(Ordering::SeqCst), gets + 1);
        // And a recovered claim can be unprepared.
        drop(preparer);
        fs::write(checkpoint::path(&node.opts.layout.state_dir), b"").unwrap();
        let preparer = node.start().await;
        assert!(preparer.unprepare(vec![r("train", UID_A)]).await[0]
            .1
            .is_ok());
        assert!(node.cdi_files().is_empty(), "{corruption}");
        // The Node event is posted in the background.
        for _ in 0..50 {
            if !node.api.event_reasons().is_empty() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert_eq!(
            node.api.event_reasons()[0],
            (NODE.to_string(), "CheckpointCorrupt".to_string()),
            "{corruption}"
        );
    }
}

#[tokio::test]
async fn files_have_the_promised_modes_and_world_writable_roots_are_refused() {
    use std::os::unix::fs::PermissionsExt;
    let node = Node::new();
    node.api.add("train", fractional(UID_A));
    let preparer = node.start().await;
    prepare_one(&preparer, "train", UID_A).await.unwrap();
    let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&node.opts.layout.state_dir), 0o700);
    assert_eq!(mode(&node.opts.layout.cdi_root), 0o755);
    assert_eq!(mode(&node.spec_path(UID_A)), 0o644);
    assert_eq!(mode(&checkpoint::path(&node.opts.layout.state_dir)), 0o600);
    assert_eq!(
        mode(&checkpoint::log_path(&node.opts.layout.state_dir)),
        0o600
    );
    drop(preparer);

    fs::set_permissions(
        &node.opts.layout.cdi_root,
        fs::Permissions::from_mode(0o777),
    )
    .unwrap();
    let (_tx, rx) = watch::channel(BTreeMap::new());
    let refused = ClaimPreparer::with_api(
        node.opts.clone(),
        Arc::new(inventory()),
        node.api.clone(),
        rx,
        "boot-1".into(),
    )
    .await;
    assert!(matches!(refused, Err(NodeStateError::CdiRoot { .. })));
    let _ = &node.top;
}

/// Set by [`killed_at_every_fault_point_the_node_recovers`] for its child process.
const CRASH_DIR_ENV: &str = "GPUPOOL_TEST_CRASH_DIR";

/// The child half of the crash test: prepare then unprepare, until the armed fault point kills it.
/// Does nothing in a normal test run.
#[tokio::test]
async fn crash_child() {
    let Ok(top) = std::env::var(CRASH_DIR_ENV) else {
        return;
    };
    let api = Arc::new(FakeApi::default());
    api.add(
        "train",
        crash_claim(&std::env::var(fault::FAULT_POINT_ENV).unwrap_or_default()),
    );
    let (_tx, rx) = watch::channel(BTreeMap::new());
    let preparer = ClaimPreparer::with_api(
        opts_under(Path::new(&top)),
        Arc::new(inventory()),
        api,
        rx,
        "boot-1".into(),
    )
    .await
    .unwrap();
    prepare_one(&preparer, "train", UID_A).await.unwrap();
    unprepare_one(&preparer, "train", UID_A).await.unwrap();
}

/// The fault points only a claim with a MIG device passes.
const MIG_POINTS: &[&str] = &[
    "after-gpu-instance-created",
    "after-gpu-instance-recorded",
    "after-compute-instance-created",
    "after-compute-instance-destroyed",
];

/// A claim of one MIG device of the node's H100 (gpu-2).
fn mig_claim(uid: &str, device: &str) -> ResourceClaim {
    allocated_claim(uid, &[("gpu", NODE, device, None, None, None)], json!([]))
}

/// The claim the crash test prepares to reach `point`.
fn crash_claim(point: &str) -> ResourceClaim {
    if MIG_POINTS.contains(&point) {
        mig_claim(UID_A, "gpu-2-mig-1g-10gb-0")
    } else {
        fractional(UID_A)
    }
}

/// The MIG instances the fake cards of a node hold, as (card, GPU instance id).
fn mig_instances(node: &Node) -> Vec<(String, u32)> {
    crate::mig::fake::load(&node.opts.layout.run_dir)
        .cards
        .into_iter()
        .flat_map(|(card, c)| {
            c.gpu_instances
                .into_iter()
                .map(move |gi| (card.clone(), gi.id))
        })
        .collect()
}

#[cfg(any(debug_assertions, feature = "fault-injection"))]
#[tokio::test]
async fn killed_at_every_fault_point_the_node_recovers() {
    use std::os::unix::process::ExitStatusExt;
    for point in fault::FAULT_POINTS {
        let node = Node::new();
        let status = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "prepare::tests::crash_child", "--test-threads=1"])
            .env(CRASH_DIR_ENV, &node.top)
            .env(fault::FAULT_POINT_ENV, point)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .unwrap();
        assert_eq!(status.signal(), Some(libc::SIGKILL), "{point}: not killed");

        node.api.add("train", crash_claim(point));
        let preparer = node.start().await;
        let saved = checkpoint::load(&node.opts.layout.state_dir)
            .unwrap()
            .unwrap();
        let cache = node.opts.layout.run_dir.join("vgpu-cache").join(UID_A);
        match saved.claims.get(UID_A) {
            // Killed after completion: the claim is prepared, with a valid spec and its cache.
            Some(entry) => {
                assert_eq!(entry.state, ClaimState::PrepareCompleted, "{point}");
                assert_eq!(
                    gpupool_api::cdi::validate(&node.spec(UID_A)),
                    Vec::<String>::new()
                );
                assert!(cache.is_dir(), "{point}");
                assert_eq!(node.cdi_files().len(), 1, "{point}");
            }
            // Killed before: nothing at all is left, no MIG instance either.
            None => {
                assert!(
                    node.cdi_files().is_empty(),
                    "{point}: {:?}",
                    node.cdi_files()
                );
                assert!(!cache.exists(), "{point}");
                assert_eq!(mig_instances(&node), [], "{point}");
            }
        }
        let expected_survivor = matches!(*point, "after-prepare-completed" | "mid-unprepare");
        assert_eq!(
            saved.claims.contains_key(UID_A),
            expected_survivor,
            "{point}"
        );

        // Either way the kubelet's retries converge.
        assert!(preparer.prepare(vec![r("train", UID_A)]).await[0].1.is_ok());
        assert!(preparer.unprepare(vec![r("train", UID_A)]).await[0]
            .1
            .is_ok());
        assert!(node.cdi_files().is_empty(), "{point}");
        assert!(!cache.exists(), "{point}");
        assert_eq!(mig_instances(&node), [], "{point}");
    }
}

/// On a machine with an NVIDIA GPU: a fractional claim of the real card 0 gets a spec naming its
/// real device node and UUID and the limits asked for.
/// `cargo test -p gpupool-driver --lib -- --ignored real_gpu --nocapture`
#[tokio::test]
#[ignore = "needs an NVIDIA GPU and its driver"]
async fn real_gpu_fractional_claim_names_the_real_card() {
    let inventory = crate::inventory::discover(None, NODE).expect("NVML discovery");
    let gpu = inventory.gpus.first().expect("at least one GPU").clone();
    println!("card 0: {gpu:?}");
    let root = tempfile::tempdir().unwrap();
    let mut opts = opts_under(root.path());
    opts.layout.fake_gpus = false;
    // A stand-in library file: the spec is not run here, only rendered.
    let lib = &opts.layout.gpupool_lib.host_path;
    fs::create_dir_all(lib.parent().unwrap()).unwrap();
    fs::write(lib, b"").unwrap();
    let api = Arc::new(FakeApi::default());
    api.add(
        "train",
        allocated_claim(
            UID_A,
            &[("gpu", NODE, "gpu-0", Some("a1b2"), Some("8Gi"), Some("50"))],
            json!([]),
        ),
    );
    let (_tx, rx) = watch::channel(BTreeMap::from([(gpu.model.clone(), 989i64)]));
    let preparer = ClaimPreparer::with_api(
        opts.clone(),
        Arc::new(inventory),
        api.clone(),
        rx,
        current_boot_id(),
    )
    .await
    .unwrap();
    let answer = preparer.prepare(vec![r("train", UID_A)]).await;
    let devices = answer[0].1.text().unwrap();
    println!("answer: {devices:?}");
    let spec_text = fs::read_to_string(opts.layout.spec_path(UID_A)).unwrap();
    println!("spec:\n{spec_text}");
    let spec: gpupool_api::cdi::Spec = serde_json::from_str(&spec_text).unwrap();
    assert_eq!(gpupool_api::cdi::validate(&spec), Vec::<String>::new());
    let edits = &spec.devices[0].container_edits;
    assert_eq!(
        edits.device_nodes[0].path,
        format!("/dev/nvidia{}", gpu.minor)
    );
    for env in [
        "CUDA_DEVICE_MEMORY_LIMIT_0=8192m".to_string(),
        "CUDA_DEVICE_SM_LIMIT_0=50".to_string(),
        format!("CUDA_VISIBLE_DEVICES={}", gpu.uuid),
    ] {
        assert!(edits.env.contains(&env), "{env} not in {:?}", edits.env);
    }
    preparer.flush_status_writes().await;
    let status = api.device_status("train");
    println!(
        "status data: {}",
        serde_json::to_string(&status[0].data).unwrap()
    );
    assert_eq!(status[0].data.as_ref().unwrap().0["uuid"], gpu.uuid);
}

/// On a machine with an NVIDIA GPU: the answer carries the node's NVIDIA CDI device beside ours when a
/// spec for the card exists (in /etc/cdi, /var/run/cdi or $GPUPOOL_TEST_NVIDIA_CDI_DIR), and the claim
/// fails naming the fix when none does.
/// `cargo test -p gpupool-driver --lib -- --ignored real_gpu --nocapture`
#[tokio::test]
#[ignore = "needs an NVIDIA GPU and its driver"]
async fn real_gpu_driver_libraries_come_from_the_nvidia_cdi_spec() {
    let inventory = crate::inventory::discover(None, NODE).expect("NVML discovery");
    let gpu = inventory.gpus.first().expect("at least one GPU").clone();
    let mut spec_dirs = vec![PathBuf::from("/etc/cdi"), PathBuf::from("/var/run/cdi")];
    spec_dirs.extend(std::env::var_os("GPUPOOL_TEST_NVIDIA_CDI_DIR").map(PathBuf::from));
    let expected = super::nvidia_cdi::find_device_id(&spec_dirs, &gpu.uuid, gpu.index);
    println!("NVIDIA CDI device for card 0: {expected:?}");

    let root = tempfile::tempdir().unwrap();
    let mut opts = opts_under(root.path());
    opts.layout.fake_gpus = false;
    opts.driver_libraries = DriverLibraries::NvidiaCdi { spec_dirs };
    let api = Arc::new(FakeApi::default());
    api.add(
        "train",
        allocated_claim(
            UID_A,
            &[("gpu", NODE, "gpu-0", None, Some("4Gi"), Some("25"))],
            json!([]),
        ),
    );
    let (_tx, rx) = watch::channel(BTreeMap::new());
    let preparer = ClaimPreparer::with_api(opts, Arc::new(inventory), api, rx, current_boot_id())
        .await
        .unwrap();
    let answer = preparer.prepare(vec![r("train", UID_A)]).await;
    println!("answer: {:?}", answer[0].1);
    match expected {
        Ok(nvidia_id) => {
            let devices = answer[0].1.text().unwrap();
            assert_eq!(devices[0].cdi_device_ids.len(), 2);
            assert_eq!(devices[0].cdi_device_ids[1], nvidia_id);
        }
        Err(_) => {
            let error = answer[0].1.text().unwrap_err();
            assert!(error.contains("nvidia-ctk cdi generate"), "{error}");
        }
    }
}

/// Two instances on one node's folders, as a rolling update with surge runs them.
async fn two_instances(node: &mut Node) -> (Arc<ClaimPreparer>, Arc<ClaimPreparer>) {
    node.opts.layout.serialize_lock = Some(node.top.join("plugins/serialize.lock"));
    let old = node.start().await;
    let new = node.start().await;
    (old, new)
}

#[tokio::test]
async fn either_instance_serves_a_claim_the_other_prepared() {
    let mut node = Node::new();
    node.api.add("train", fractional(UID_A));
    node.api.add("infer", fractional(UID_B));
    let (old, new) = two_instances(&mut node).await;

    let first = prepare_one(&old, "train", UID_A).await.unwrap();
    let gets = node.api.gets.load(Ordering::SeqCst);
    let again = prepare_one(&new, "train", UID_A).await.unwrap();
    assert_eq!(again, first, "the same answer from the other instance");
    assert_eq!(
        node.api.gets.load(Ordering::SeqCst),
        gets,
        "from the checkpoint, not a new prepare"
    );

    prepare_one(&new, "infer", UID_B).await.unwrap();
    let unprepared = new.unprepare(vec![r("train", UID_A)]).await;
    assert!(unprepared[0].1.is_ok(), "{unprepared:?}");
    assert!(!node.spec_path(UID_A).exists(), "its spec is gone");
    assert!(!node
        .opts
        .layout
        .run_dir
        .join("vgpu-cache")
        .join(UID_A)
        .exists());
    assert_eq!(
        node.cdi_files(),
        BTreeSet::from([gpupool_api::names::cdi_spec_file_name(UID_B)]),
        "one spec per prepared claim"
    );

    // The old instance learns of both changes at its next call.
    let from_old = prepare_one(&old, "infer", UID_B).await.unwrap();
    assert_eq!(Some(from_old), new.prepared(UID_B).await);
    assert_eq!(old.prepared(UID_A).await, None);
    unprepare_one(&old, "infer", UID_B).await.unwrap();
    assert!(node.cdi_files().is_empty());
    let saved = checkpoint::load(&node.opts.layout.state_dir)
        .unwrap()
        .unwrap();
    assert!(saved.claims.is_empty(), "{:?}", saved.claims.keys());
}

#[tokio::test]
async fn an_instance_starting_beside_one_mid_prepare_keeps_its_files() {
    let mut node = Node::new();
    node.api.add("train", fractional(UID_A));
    let (old, _) = two_instances(&mut node).await;
    // The old instance is mid-prepare: its turn is taken (its files and entry are being written).
    let turn = old.state.take_turn().await.unwrap();
    let preparing = tokio::spawn({
        let old = old.clone();
        async move { old.prepare(vec![r("train", UID_A)]).await }
    });
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    let starting = tokio::spawn({
        let (opts, api) = (node.opts.clone(), node.api.clone());
        async move {
            let (_tx, rx) = watch::channel(BTreeMap::new());
            ClaimPreparer::with_api(opts, Arc::new(inventory()), api, rx, "boot-1".into()).await
        }
    });
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    assert!(
        !starting.is_finished(),
        "start-up waits for the other instance's call"
    );
    drop(turn);
    let devices = preparing.await.unwrap()[0].1.text().unwrap();
    let started = starting.await.unwrap().unwrap();
    // Whichever took the turn first (the prepare's files, or the start-up's sweep), the spec
    // stays and the new instance knows the claim from its next turn on.
    assert!(
        node.spec_path(UID_A).exists(),
        "the sweep left the new claim's spec"
    );
    drop(started.state.take_turn().await.unwrap());
    assert_eq!(started.prepared(UID_A).await, Some(devices));
}

/// A fraction of the node's H100 (gpu-2).
fn h100_fraction(uid: &str) -> ResourceClaim {
    allocated_claim(
        uid,
        &[("gpu", NODE, "gpu-2", Some("c3d4"), Some("8Gi"), Some("25"))],
        json!([]),
    )
}

#[tokio::test]
async fn a_mig_device_is_created_recorded_described_and_destroyed() {
    let node = Node::new();
    node.api
        .add("small", mig_claim(UID_A, "gpu-2-mig-3g-40gb-4"));
    let preparer = node.start().await;
    let h100 = inventory().gpus[2].uuid.clone();
    let mig = crate::mig::fake::load(&node.opts.layout.run_dir);
    assert!(!mig.cards[&h100].enabled, "the H100 starts with MIG off");

    let devices = prepare_one(&preparer, "small", UID_A).await.unwrap();
    assert_eq!(
        devices[0].cdi_device_ids,
        [format!("gpupool.dev/claim={UID_A}-gpu-2-mig-3g-40gb-4")]
    );
    // The card switched to MIG mode, one GPU instance at memory slice 4 with its compute instance.
    let mig = crate::mig::fake::load(&node.opts.layout.run_dir);
    let card = &mig.cards[&h100];
    assert!(card.enabled);
    assert_eq!(card.gpu_instances.len(), 1);
    let gi = &card.gpu_instances[0];
    assert_eq!((gi.profile_id, gi.start, gi.size), (9, 4, 4));
    let mig_uuid = gi.compute_instances[&0].clone();

    let saved = checkpoint::load(&node.opts.layout.state_dir)
        .unwrap()
        .unwrap();
    let record = &saved.claims[UID_A].mig[0];
    assert_eq!(
        (
            record.gpu_instance,
            record.compute_instance,
            record.uuid.as_deref()
        ),
        (Some(gi.id), Some(0), Some(mig_uuid.as_str()))
    );
    let env = &node.spec(UID_A).devices[0].container_edits.env;
    assert!(
        env.contains(&format!("GPUPOOL_DEVICE_UUID_0={mig_uuid}")),
        "{env:?}"
    );
    assert!(
        !env.iter()
            .any(|e| e.starts_with("CUDA_DEVICE_MEMORY_LIMIT")),
        "{env:?}"
    );
    assert!(
        !node
            .opts
            .layout
            .run_dir
            .join("vgpu-cache")
            .join(UID_A)
            .exists(),
        "no HAMi-core cache for a hardware partition"
    );

    preparer.flush_status_writes().await;
    let status = node.api.device_status("small");
    let data = &status[0].data.as_ref().unwrap().0;
    assert_eq!(data["migProfile"], "3g.40gb");
    assert_eq!(data["migUUID"], mig_uuid.as_str());
    assert_eq!(data["multiprocessors"], 60);
    let ready = &status[0].conditions.as_ref().unwrap()[0];
    assert!(
        ready.message.starts_with("prepared: MIG 3g.40gb"),
        "{}",
        ready.message
    );

    unprepare_one(&preparer, "small", UID_A).await.unwrap();
    assert_eq!(mig_instances(&node), []);
    assert!(node.cdi_files().is_empty());
}

#[tokio::test]
async fn the_node_guard_keeps_mig_and_fractions_of_one_card_apart() {
    let node = Node::new();
    node.api.add("half", h100_fraction(UID_A));
    node.api
        .add("small", mig_claim(UID_B, "gpu-2-mig-1g-10gb-0"));
    node.api
        .add("other", mig_claim(UID_C, "gpu-2-mig-2g-20gb-0"));
    let preparer = node.start().await;
    prepare_one(&preparer, "half", UID_A).await.unwrap();

    let e = prepare_one(&preparer, "small", UID_B).await.unwrap_err();
    assert!(
        e.starts_with("claim team-a/small: gpu-2-mig-1g-10gb-0 is a MIG partition")
            && e.contains("gpu-2 of claim team-a/half")
            && e.contains("kube-scheduler >= 1.36.2"),
        "{e}"
    );
    assert_eq!(mig_instances(&node), [], "nothing was created");
    assert!(preparer.prepared(UID_B).await.is_none());

    // Once the fraction is gone the MIG device prepares; then the card is refused in turn,
    // and a MIG device on the same slices too.
    unprepare_one(&preparer, "half", UID_A).await.unwrap();
    prepare_one(&preparer, "small", UID_B).await.unwrap();
    let e = prepare_one(&preparer, "half", UID_A).await.unwrap_err();
    assert!(
        e.contains("gpu-2 is the whole card")
            && e.contains("gpu-2-mig-1g-10gb-0 of claim team-a/small"),
        "{e}"
    );
    let e = prepare_one(&preparer, "other", UID_C).await.unwrap_err();
    assert!(e.contains("takes memory slices"), "{e}");

    // Both in one call: the in-flight one counts too.
    unprepare_one(&preparer, "small", UID_B).await.unwrap();
    let answers = preparer
        .prepare(vec![r("half", UID_A), r("small", UID_B)])
        .await;
    let failed = answers.iter().filter(|(_, a)| a.is_err()).count();
    assert_eq!(failed, 1, "{answers:?}");
    // The card left MIG mode for the fraction, or holds exactly one instance for the MIG claim.
    let h100 = inventory().gpus[2].uuid.clone();
    let card = crate::mig::fake::load(&node.opts.layout.run_dir).cards[&h100].clone();
    match answers[0].1.is_ok() {
        true => assert!(!card.enabled && card.gpu_instances.is_empty()),
        false => assert_eq!(card.gpu_instances.len(), 1),
    }
}

#[tokio::test]
async fn start_up_destroys_mig_instances_no_claim_accounts_for_and_keeps_the_others() {
    let node = Node::new();
    node.api
        .add("small", mig_claim(UID_A, "gpu-2-mig-1g-10gb-0"));
    let preparer = node.start().await;
    prepare_one(&preparer, "small", UID_A).await.unwrap();
    drop(preparer);

    // An instance made behind the driver's back (or by a driver killed before recording it).
    let h100 = inventory().gpus[2].uuid.clone();
    let other = crate::mig::fake::FakeMig::new(&node.opts.layout.run_dir, &inventory()).unwrap();
    use crate::mig::MigManager;
    let orphan = other
        .create_gpu_instance(&crate::mig::Placement {
            parent_uuid: h100.clone(),
            profile_id: 14,
            start: 4,
            size: 2,
        })
        .unwrap();
    other.create_compute_instance(&h100, orphan, 2).unwrap();
    assert_eq!(mig_instances(&node).len(), 2);

    let preparer = node.start_with_boot("boot-1").await;
    let left = mig_instances(&node);
    assert_eq!(left.len(), 1, "{left:?}");
    assert_ne!(
        left[0].1, orphan,
        "the orphan went, the claim's instance stayed"
    );
    assert!(preparer.prepared(UID_A).await.is_some());

    // The instance vanished (a driver reload, a reboot): the claim is dropped at start and the
    // kubelet's next prepare makes a new one.
    let gone = left[0].1;
    other.destroy_compute_instance(&h100, gone, 0).unwrap();
    other.destroy_gpu_instance(&h100, gone).unwrap();
    let preparer = node.start_with_boot("boot-2").await;
    assert!(preparer.prepared(UID_A).await.is_none());
    assert!(node.cdi_files().is_empty());
    prepare_one(&preparer, "small", UID_A).await.unwrap();
    assert_eq!(mig_instances(&node).len(), 1);
}

#[tokio::test]
async fn a_placement_taken_by_an_instance_fails_the_claim_and_leaves_nothing_of_it() {
    let node = Node::new();
    node.api
        .add("small", mig_claim(UID_A, "gpu-2-mig-2g-20gb-2"));
    let preparer = node.start().await;
    let h100 = inventory().gpus[2].uuid.clone();
    let other = crate::mig::fake::FakeMig::new(&node.opts.layout.run_dir, &inventory()).unwrap();
    use crate::mig::MigManager;
    other.set_mig_enabled(&h100, true).unwrap();
    let squatter = other
        .create_gpu_instance(&crate::mig::Placement {
            parent_uuid: h100.clone(),
            profile_id: 15,
            start: 2,
            size: 2,
        })
        .unwrap();
    let e = prepare_one(&preparer, "small", UID_A).await.unwrap_err();
    assert!(e.contains("overlaps a MIG instance that exists"), "{e}");
    assert_eq!(mig_instances(&node), [(h100, squatter)]);
    let saved = checkpoint::load(&node.opts.layout.state_dir)
        .unwrap()
        .unwrap();
    assert!(saved.claims.is_empty(), "{:?}", saved.claims);
    assert!(node.cdi_files().is_empty());
}

#[tokio::test]
async fn a_call_waits_while_the_other_instance_holds_its_turn() {
    let mut node = Node::new();
    node.api.add("train", fractional(UID_A));
    node.api.add("infer", fractional(UID_B));
    let (old, new) = two_instances(&mut node).await;
    prepare_one(&new, "infer", UID_B).await.unwrap();
    // The old instance's prepare holds its turn (writing its files and entry).
    let turn = old.state.take_turn().await.unwrap();
    let preparing = tokio::spawn({
        let old = old.clone();
        async move { old.prepare(vec![r("train", UID_A)]).await }
    });
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    let unpreparing = tokio::spawn({
        let new = new.clone();
        async move { new.unprepare(vec![r("infer", UID_B)]).await }
    });
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    assert!(
        !unpreparing.is_finished(),
        "the unprepare waits for the other instance's call"
    );
    assert!(node.spec_path(UID_B).exists());
    drop(turn);
    preparing.await.unwrap()[0].1.text().unwrap();
    assert!(unpreparing.await.unwrap()[0].1.is_ok());
    assert!(!node.spec_path(UID_B).exists());
    // Each instance's next turn sees what the other wrote meanwhile (the unprepare's turn may
    // have come before or after the old instance's prepare: the prepare waits for it too).
    drop(new.state.take_turn().await.unwrap());
    assert!(new.prepared(UID_A).await.is_some());
    assert_eq!(new.prepared(UID_A).await, old.prepared(UID_A).await);
    unprepare_one(&old, "train", UID_A).await.unwrap();
    assert_eq!(old.prepared(UID_B).await, None);
}

#[tokio::test]
async fn a_prepare_waiting_on_the_api_server_holds_no_turn() {
    let mut node = Node::new();
    node.api.add("train", fractional(UID_A));
    node.api.add("infer", fractional(UID_B));
    let (old, new) = two_instances(&mut node).await;
    prepare_one(&new, "infer", UID_B).await.unwrap();
    // The old instance has caught up with that (a turn of its own): its view is current, so its
    // next prepare reads before taking its turn.
    drop(old.state.take_turn().await.unwrap());
    // The old instance's read of its claim waits on the API server.
    let gate = Arc::new(Notify::new());
    *node.api.gate.lock().unwrap() = Some(("train".into(), gate.clone()));
    let preparing = tokio::spawn({
        let old = old.clone();
        async move { old.prepare(vec![r("train", UID_A)]).await }
    });
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    // Another pod's calls, to either instance, go on meanwhile.
    let unprepared = tokio::time::timeout(
        std::time::Duration::from_secs(5),
        new.unprepare(vec![r("infer", UID_B)]),
    )
    .await
    .expect("the unprepare does not wait for the other instance's API read");
    assert!(unprepared[0].1.is_ok());
    assert!(!node.spec_path(UID_B).exists());
    assert!(!preparing.is_finished(), "the read is still held");
    gate.notify_one();
    preparing.await.unwrap()[0].1.text().unwrap();
    assert!(node.spec_path(UID_A).exists());
    // Each sees, from its next turn on, what the other wrote.
    assert_eq!(old.prepared(UID_B).await, None);
    drop(new.state.take_turn().await.unwrap());
    assert_eq!(new.prepared(UID_A).await, old.prepared(UID_A).await);
}

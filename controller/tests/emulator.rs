//! The controller against the API server emulator on loopback: classes, templates and status appear and
//! go with their sources, and of two replicas only the leader writes.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use gpupool_api::crd::{ComputeProfile, ComputeProfileSpec, GpuModel, GpuModelSpec};
use gpupool_apiserver::ApiServer;
use gpupool_controller::leader::{LeaderElector, LeaseConfig};
use gpupool_controller::owner::Owner;
use gpupool_controller::reconcile::{install_crds, Reconciler, Settings};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::rbac::v1::{ClusterRole, Role};
use k8s_openapi::api::resource::v1::{
    Device, DeviceAttribute, DeviceCapacity, DeviceClass, ResourceClaimTemplate, ResourcePool,
    ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use tokio::task::JoinHandle;

/// Polls `check` until it returns Some, or panics with `what` after `timeout`.
async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        if tokio::time::Instant::now() > deadline {
            panic!("timed out waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One controller replica running in this process.
struct Replica {
    writes: Arc<AtomicU64>,
    tasks: Vec<JoinHandle<()>>,
}

/// The install's roles that own the Lease and the all-GPUs class (the controller's defaults).
const LEASE_OWNER_ROLE: &str = "gpupool-controller-leader-election";
const CLASS_OWNER_CLUSTER_ROLE: &str = "gpupool-controller";

impl Replica {
    async fn start(server: &ApiServer, identity: &str) -> Replica {
        Self::start_with(server, identity, false).await
    }

    /// A replica whose Lease and all-GPUs class name the install's roles as owners.
    async fn start_owned(server: &ApiServer, identity: &str) -> Replica {
        Self::start_with(server, identity, true).await
    }

    async fn start_with(server: &ApiServer, identity: &str, owned: bool) -> Replica {
        let client = server.client().await;
        let mut elector = LeaderElector::new(
            client.clone(),
            LeaseConfig {
                namespace: "kube-system".into(),
                name: "gpupool-controller".into(),
                identity: identity.into(),
                lease_duration: Duration::from_secs(3),
                renew_interval: Duration::from_millis(500),
            },
        );
        let mut reconciler = Reconciler::new(
            client.clone(),
            elector.leadership(),
            Settings {
                resync: Duration::from_secs(2),
                ..Settings::default()
            },
        );
        if owned {
            elector = elector.with_owner(Owner::role(
                client.clone(),
                "kube-system",
                LEASE_OWNER_ROLE,
                "Lease kube-system/gpupool-controller",
            ));
            reconciler = reconciler.with_class_owner(Owner::cluster_role(
                client,
                CLASS_OWNER_CLUSTER_ROLE,
                "DeviceClass gpupool.dev",
            ));
        }
        let reconciler = Arc::new(reconciler);
        let writes = reconciler.writes();
        // Never told to stop: a replica ends by being aborted, like a crashed process.
        let (_stop, stopped) = tokio::sync::watch::channel(false);
        let stopped_too = stopped.clone();
        let tasks = vec![
            tokio::spawn(async move {
                let _keep = _stop;
                elector.run(stopped).await
            }),
            tokio::spawn(reconciler.run(stopped_too)),
        ];
        Replica { writes, tasks }
    }

    fn writes(&self) -> u64 {
        self.writes.load(Ordering::SeqCst)
    }

    fn crash(self) {
        for task in self.tasks {
            task.abort();
        }
    }
}

fn gpumodel(name: &str, model: &str, weight: i64) -> GpuModel {
    GpuModel::new(
        name,
        GpuModelSpec {
            model: Some(model.into()),
            product_name: None,
            compute_weight: weight,
            device_class_name: None,
            tier: None,
            mig_profiles: Vec::new(),
        },
    )
}

fn slice(node: &str, models: &[&str]) -> ResourceSlice {
    let devices = models
        .iter()
        .enumerate()
        .map(|(i, model)| Device {
            name: format!("gpu-{i}"),
            attributes: Some(BTreeMap::from([(
                "model".to_string(),
                DeviceAttribute {
                    string: Some(model.to_string()),
                    ..Default::default()
                },
            )])),
            capacity: Some(BTreeMap::from([(
                "memory".to_string(),
                DeviceCapacity {
                    value: Quantity("40Gi".into()),
                    request_policy: None,
                },
            )])),
            ..Default::default()
        })
        .collect();
    ResourceSlice {
        metadata: ObjectMeta {
            name: Some(format!("{node}-gpupool.dev")),
            ..Default::default()
        },
        spec: ResourceSliceSpec {
            driver: "gpupool.dev".into(),
            node_name: Some(node.into()),
            pool: ResourcePool {
                name: node.into(),
                generation: 1,
                resource_slice_count: 1,
            },
            devices: Some(devices),
            ..Default::default()
        },
    }
}

fn subrequest_cores(template: &ResourceClaimTemplate) -> Vec<(String, String)> {
    template
        .spec
        .spec
        .devices
        .as_ref()
        .unwrap()
        .requests
        .as_ref()
        .unwrap()[0]
        .first_available
        .as_ref()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s.name.clone(),
                s.capacity.as_ref().unwrap().requests.as_ref().unwrap()["cores"]
                    .0
                    .clone(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_and_profiles_are_served_by_the_single_leader_and_survive_its_crash() {
    let server = ApiServer::start().await.unwrap();
    let admin = server.client().await;
    install_crds(&admin).await.unwrap();
    let gpumodels = Api::<GpuModel>::all(admin.clone());
    let classes = Api::<DeviceClass>::all(admin.clone());
    let profiles = Api::<ComputeProfile>::all(admin.clone());
    let pp = PostParams::default();

    Api::<ResourceSlice>::all(admin.clone())
        .create(
            &pp,
            &slice(
                "node-a",
                &["A100-SXM4-40GB", "A100-SXM4-40GB", "V100-SXM2-32GB"],
            ),
        )
        .await
        .unwrap();
    Api::<Namespace>::all(admin.clone())
        .create(
            &pp,
            &Namespace {
                metadata: ObjectMeta {
                    name: Some("team-a".into()),
                    ..Default::default()
                },
                ..Default::default()
            },
        )
        .await
        .unwrap();

    let first = Replica::start(&server, "replica-a").await;
    let second = Replica::start(&server, "replica-b").await;

    gpumodels
        .create(&pp, &gpumodel("a100-sxm4-40gb", "A100-SXM4-40GB", 312))
        .await
        .unwrap();
    gpumodels
        .create(&pp, &gpumodel("v100-sxm2-32gb", "V100-SXM2-32GB", 256))
        .await
        .unwrap();
    gpumodels
        .create(&pp, &gpumodel("broken", "RTX-3090", 0))
        .await
        .unwrap();

    let class = eventually("the A100 DeviceClass", Duration::from_secs(15), || async {
        classes.get_opt("a100-sxm4-40gb.gpupool.dev").await.unwrap()
    })
    .await;
    let expression = &class.spec.selectors.as_ref().unwrap()[0]
        .cel
        .as_ref()
        .unwrap()
        .expression;
    assert!(expression.contains(r#"model == "A100-SXM4-40GB""#));
    assert!(classes.get_opt("gpupool.dev").await.unwrap().is_some());

    let status = eventually("A100 status", Duration::from_secs(15), || async {
        let model = gpumodels.get("a100-sxm4-40gb").await.unwrap();
        model.status.filter(|s| s.devices == 2)
    })
    .await;
    assert_eq!((status.nodes, status.memory.as_deref()), (1, Some("80Gi")));

    let broken = eventually("the Invalid condition", Duration::from_secs(15), || async {
        gpumodels.get("broken").await.unwrap().status.and_then(|s| {
            s.conditions
                .into_iter()
                .find(|c| c.type_ == "Invalid" && c.status == "True")
        })
    })
    .await;
    assert!(broken.message.contains("spec.computeWeight"));

    profiles
        .create(
            &pp,
            &ComputeProfile::new(
                "half-a100",
                ComputeProfileSpec {
                    compute: 156,
                    memory: Some("8Gi".into()),
                    models: vec![],
                    preference: Default::default(),
                    namespaces: vec!["team-a".into()],
                    namespace_selector: None,
                    mig: Default::default(),
                    cards: None,
                    same_nvlink_domain: false,
                },
            ),
        )
        .await
        .unwrap();
    let templates = Api::<ResourceClaimTemplate>::namespaced(admin.clone(), "team-a");
    let template = eventually(
        "the half-a100 template",
        Duration::from_secs(15),
        || async { templates.get_opt("half-a100").await.unwrap() },
    )
    .await;
    assert_eq!(
        subrequest_cores(&template),
        [
            ("a100-sxm4-40gb".to_string(), "50".to_string()),
            ("v100-sxm2-32gb".to_string(), "61".to_string())
        ]
    );

    // Settled: further passes (watch events, resyncs) find nothing to change.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let settled = first.writes() + second.writes();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(
        first.writes() + second.writes(),
        settled,
        "the controller keeps rewriting an unchanged state"
    );

    // Exactly one replica wrote.
    let (leader, follower) = if first.writes() > 0 {
        (first, second)
    } else {
        (second, first)
    };
    assert!(leader.writes() > 0);
    assert_eq!(follower.writes(), 0, "the follower wrote");

    // A new weight changes the template (recreated: its spec is immutable).
    gpumodels
        .patch(
            "v100-sxm2-32gb",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"computeWeight": 200}})),
        )
        .await
        .unwrap();
    eventually("V100 cores 78", Duration::from_secs(15), || async {
        let template = templates.get_opt("half-a100").await.unwrap()?;
        subrequest_cores(&template)
            .contains(&("v100-sxm2-32gb".to_string(), "78".to_string()))
            .then_some(())
    })
    .await;

    // Deleting a GpuModel removes its class and its subrequest; the others stay.
    gpumodels
        .delete("v100-sxm2-32gb", &DeleteParams::default())
        .await
        .unwrap();
    eventually("the V100 class to go", Duration::from_secs(15), || async {
        classes
            .get_opt("v100-sxm2-32gb.gpupool.dev")
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    eventually(
        "the template without V100",
        Duration::from_secs(15),
        || async {
            let template = templates.get_opt("half-a100").await.unwrap()?;
            (subrequest_cores(&template).len() == 1).then_some(())
        },
    )
    .await;
    assert!(classes
        .get_opt("a100-sxm4-40gb.gpupool.dev")
        .await
        .unwrap()
        .is_some());

    // The leader crashes (no lease release): the follower takes over once the lease expires.
    leader.crash();
    gpumodels
        .create(&pp, &gpumodel("rtx-3090", "RTX-3090", 71))
        .await
        .unwrap();
    eventually(
        "the new leader to create the RTX class",
        Duration::from_secs(20),
        || async { classes.get_opt("rtx-3090.gpupool.dev").await.unwrap() },
    )
    .await;
    assert!(follower.writes() > 0);
    follower.crash();
}

/// (kind, name, uid) of each owner reference.
fn owners(references: &Option<Vec<OwnerReference>>) -> Vec<(String, String, String)> {
    references
        .iter()
        .flatten()
        .map(|r| (r.kind.clone(), r.name.clone(), r.uid.clone()))
        .collect()
}

/// What `helm uninstall` relies on: the all-GPUs class names the controller's ClusterRole and the
/// Lease the leader-election Role, also where a version without owners made them; without its role
/// the class is still made, without an owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_install_roles_own_the_all_gpus_class_and_the_lease() {
    let server = ApiServer::start().await.unwrap();
    let admin = server.client().await;
    install_crds(&admin).await.unwrap();
    let pp = PostParams::default();
    let classes = Api::<DeviceClass>::all(admin.clone());
    let leases = Api::<Lease>::namespaced(admin.clone(), "kube-system");

    // As a version without owners left them: its class, and its Lease released on shutdown.
    let unowned_class: DeviceClass = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "gpupool.dev",
            "labels": {"app.kubernetes.io/managed-by": "gpupool-controller"}},
        "spec": {"selectors": [{"cel": {"expression": "device.driver == \"gpupool.dev\""}}]}
    }))
    .unwrap();
    classes.create(&pp, &unowned_class).await.unwrap();
    let released: Lease = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "gpupool-controller", "namespace": "kube-system"},
        "spec": {"leaseDurationSeconds": 1}
    }))
    .unwrap();
    leases.create(&pp, &released).await.unwrap();

    let cluster_role: ClusterRole = serde_json::from_value(
        serde_json::json!({"metadata": {"name": CLASS_OWNER_CLUSTER_ROLE}, "rules": []}),
    )
    .unwrap();
    let cluster_role = Api::<ClusterRole>::all(admin.clone())
        .create(&pp, &cluster_role)
        .await
        .unwrap();
    let role: Role = serde_json::from_value(serde_json::json!(
        {"metadata": {"name": LEASE_OWNER_ROLE, "namespace": "kube-system"}, "rules": []}
    ))
    .unwrap();
    let role = Api::<Role>::namespaced(admin.clone(), "kube-system")
        .create(&pp, &role)
        .await
        .unwrap();

    let replica = Replica::start_owned(&server, "replica-a").await;
    let class_owner = (
        "ClusterRole".to_string(),
        CLASS_OWNER_CLUSTER_ROLE.to_string(),
        cluster_role.metadata.uid.clone().unwrap(),
    );
    eventually(
        "the ClusterRole to own the all-GPUs class",
        Duration::from_secs(15),
        || async {
            let class = classes.get("gpupool.dev").await.unwrap();
            (owners(&class.metadata.owner_references) == [class_owner.clone()]).then_some(())
        },
    )
    .await;
    let lease_owner = (
        "Role".to_string(),
        LEASE_OWNER_ROLE.to_string(),
        role.metadata.uid.clone().unwrap(),
    );
    eventually(
        "the Role to own the Lease",
        Duration::from_secs(15),
        || async {
            let lease = leases.get("gpupool-controller").await.unwrap();
            (owners(&lease.metadata.owner_references) == [lease_owner.clone()]).then_some(())
        },
    )
    .await;

    // The ClusterRole goes: so does the class (the API server's collector), and the controller
    // makes it again without an owner rather than not at all.
    Api::<ClusterRole>::all(admin.clone())
        .delete(CLASS_OWNER_CLUSTER_ROLE, &DeleteParams::default())
        .await
        .unwrap();
    let recreated = eventually(
        "the all-GPUs class made again",
        Duration::from_secs(15),
        || async { classes.get_opt("gpupool.dev").await.unwrap() },
    )
    .await;
    assert_eq!(owners(&recreated.metadata.owner_references), []);
    replica.crash();
}

//! Turns on a shared plane. Scenarios that start a cluster of their own (nodes, drivers, a
//! controller) on the plane every scenario of a test binary shares take it one at a time: the
//! scheduler sees every Node, so a claim with no pinned card could land on another scenario's
//! node, and DeviceClasses, GpuModels and the controller's Lease are cluster-wide. Each turn starts
//! from a plane cleared of what earlier turns made (their nodes, slices, classes, claims and
//! namespaces, waiting until claims and namespaces are gone), so a turn may use the same node
//! names as the last; the plane's own objects and the components' RBAC stay.

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use k8s_openapi::api::resource::v1::{
    DeviceClass, ResourceClaim, ResourceClaimTemplate, ResourceSlice,
};
use kube::api::{DeleteParams, ListParams};
use kube::core::{ApiResource, DynamicObject, GroupVersionKind};
use kube::{Api, Client};
use tokio::sync::{Mutex, OwnedMutexGuard};

use super::nodes::HAND_MADE_LABEL;

/// How long a turn waits for the namespaces and claims of earlier turns to be gone.
const GONE_WITHIN: Duration = Duration::from_secs(60);

/// Namespaces a turn keeps: the plane's own, and where the components' RBAC lives.
const KEPT_NAMESPACES: &[&str] = &["kube-system", "kube-public", "kube-node-lease", "gpupool"];

/// The right to use the plane alone, and this turn's number (for names unique on the plane).
pub struct Turn {
    pub number: u64,
    _guard: OwnedMutexGuard<u64>,
}

#[derive(Default)]
pub(super) struct Turns(Arc<Mutex<u64>>);

impl Turns {
    /// Waits for the plane, then clears what earlier turns left.
    pub(super) async fn take(&self, admin: &Client) -> Turn {
        let mut guard = self.0.clone().lock_owned().await;
        *guard += 1;
        if *guard > 1 {
            clear(admin).await;
        }
        Turn {
            number: *guard,
            _guard: guard,
        }
    }
}

/// Deletes, best effort, what scenarios make. Pods first and at once (no kubelet finishes a
/// graceful deletion on a hand-made node), so their namespaces can go.
async fn clear(admin: &Client) {
    let zero = DeleteParams::default().grace_period(0);
    let pods: Api<Pod> = Api::all(admin.clone());
    for pod in pods
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
    {
        let namespace = pod.metadata.namespace.clone().unwrap_or_default();
        if KEPT_NAMESPACES.contains(&namespace.as_str()) {
            continue;
        }
        let name = pod.metadata.name.clone().unwrap_or_default();
        let _ = Api::<Pod>::namespaced(admin.clone(), &namespace)
            .delete(&name, &zero)
            .await;
    }
    // `default` cannot be deleted: its claims and templates go one by one.
    let default_claims = Api::<ResourceClaim>::namespaced(admin.clone(), "default");
    let _ = default_claims
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await;
    let _ = Api::<ResourceClaimTemplate>::namespaced(admin.clone(), "default")
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await;
    let namespaces: Api<Namespace> = Api::all(admin.clone());
    let doomed = |list: Vec<Namespace>| -> Vec<String> {
        list.into_iter()
            .filter_map(|n| n.metadata.name)
            .filter(|name| name != "default" && !KEPT_NAMESPACES.contains(&name.as_str()))
            .collect()
    };
    let listed = || async {
        namespaces
            .list(&ListParams::default())
            .await
            .map(|l| l.items)
            .unwrap_or_default()
    };
    for name in doomed(listed().await) {
        let _ = namespaces.delete(&name, &DeleteParams::default()).await;
    }
    // A namespace being deleted refuses new objects, and a claim on its way out still holds its
    // devices: the next turn may use the same names, nodes and cards.
    let deadline = Instant::now() + GONE_WITHIN;
    loop {
        let claims_left = default_claims
            .list(&ListParams::default())
            .await
            .map_or(0, |l| l.items.len());
        if (claims_left == 0 && doomed(listed().await).is_empty()) || Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let _ = Api::<Node>::all(admin.clone())
        .delete_collection(
            &DeleteParams::default(),
            &ListParams::default().labels(HAND_MADE_LABEL),
        )
        .await;
    let _ = Api::<ResourceSlice>::all(admin.clone())
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await;
    let _ = Api::<DeviceClass>::all(admin.clone())
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await;
    for kind in ["GpuModel", "ComputeProfile"] {
        let gvk = GroupVersionKind::gvk(
            gpupool_api::names::API_GROUP,
            gpupool_api::names::API_VERSION,
            kind,
        );
        let resource = ApiResource::from_gvk(&gvk);
        // Fails quietly where the CRD was never installed.
        let _ = Api::<DynamicObject>::all_with(admin.clone(), &resource)
            .delete_collection(&DeleteParams::default(), &ListParams::default())
            .await;
    }
    let _ = Api::<Lease>::namespaced(admin.clone(), "gpupool")
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await;
}

//! Checks on a claim before anything is written: the kubelet's reference (names and UID become file
//! names, so they are validated first), then the claim read from the API server.

use std::collections::{BTreeMap, BTreeSet};

use gpupool_api::config::{self, ConfigEntry, ConfigSource};
use gpupool_api::inventory::Inventory;
use gpupool_api::names::DRIVER_NAME;
use gpupool_api::validation::{is_dns_label, is_dns_subdomain, is_uuid};
use k8s_openapi::api::resource::v1::{AllocatedDeviceStatus, ResourceClaim};
use thiserror::Error;

use gpupool_api::claim::{allocation_results, ClaimRef, PreparedDevice};

#[derive(Debug, Error, PartialEq, Eq)]
pub enum ClaimError {
    #[error("claim uid {0:?} is not a UUID")]
    BadUid(String),
    #[error("claim namespace {0:?} is not a valid namespace name (DNS-1123 label)")]
    BadNamespace(String),
    #[error("claim name {0:?} is not a valid object name (DNS-1123 subdomain)")]
    BadName(String),
    #[error(
        "claim {claim}: the API server has uid {actual:?}, the kubelet asked for {expected:?}"
    )]
    UidMismatch {
        claim: String,
        expected: String,
        actual: String,
    },
    #[error("claim {0}: not allocated")]
    NotAllocated(String),
    #[error(
        "claim {claim}: allocated to another node/pool (no {DRIVER_NAME} device in pool {pool:?})"
    )]
    OtherNode { claim: String, pool: String },
    #[error("claim {claim}: device {device:?} of pool {pool:?} is not in this node's inventory")]
    UnknownDevice {
        claim: String,
        pool: String,
        device: String,
    },
    #[error(
        "claim {claim}: device {device:?} has shareID {share_id:?}, which is not a UUID-like token \
         (lowercase letters, digits and '-', at most 64)"
    )]
    BadShareId {
        claim: String,
        device: String,
        share_id: String,
    },
    #[error("claim {claim}: {error}")]
    Config {
        claim: String,
        error: config::ConfigError,
    },
}

/// Everything in a kubelet claim reference that could reach a path or a URL, checked.
pub fn validate_ref(claim: &ClaimRef) -> Result<(), ClaimError> {
    if !is_uuid(&claim.uid) {
        return Err(ClaimError::BadUid(claim.uid.clone()));
    }
    if !is_dns_label(&claim.namespace) {
        return Err(ClaimError::BadNamespace(claim.namespace.clone()));
    }
    if !is_dns_subdomain(&claim.name) {
        return Err(ClaimError::BadName(claim.name.clone()));
    }
    Ok(())
}

/// One allocation result of this driver on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocatedDevice {
    pub request: String,
    pub pool: String,
    pub device: String,
    pub share_id: Option<String>,
    /// `consumedCapacity`, quantities as strings.
    pub consumed: BTreeMap<String, String>,
}

/// What preparation needs from a claim.
#[derive(Debug, Clone, PartialEq)]
pub struct ClaimAllocation {
    /// In allocation order: the in-container ordinal of a device is its position here.
    pub devices: Vec<AllocatedDevice>,
    /// This driver's opaque config entries, decoded.
    pub configs: Vec<ConfigEntry>,
    /// `status.devices` as read, to keep other drivers' entries when ours are written.
    pub device_status: Vec<AllocatedDeviceStatus>,
    pub generation: Option<i64>,
}

/// Check a claim read from the API server against the kubelet's reference and this node.
pub fn check_claim(
    claim_ref: &ClaimRef,
    claim: &ResourceClaim,
    pool: &str,
    inventory: &Inventory,
) -> Result<ClaimAllocation, ClaimError> {
    let name = format!("{}/{}", claim_ref.namespace, claim_ref.name);
    let actual = claim.metadata.uid.clone().unwrap_or_default();
    if actual != claim_ref.uid {
        return Err(ClaimError::UidMismatch {
            claim: name,
            expected: claim_ref.uid.clone(),
            actual,
        });
    }
    let status = claim.status.as_ref();
    let Some(allocation) = status.and_then(|s| s.allocation.as_ref()) else {
        return Err(ClaimError::NotAllocated(name));
    };
    let devices = allocation.devices.as_ref();
    let results = devices.and_then(|d| d.results.as_deref()).unwrap_or(&[]);
    let ours: Vec<AllocatedDevice> = results
        .iter()
        .filter(|r| r.driver == DRIVER_NAME && r.pool == pool)
        .map(|r| AllocatedDevice {
            request: r.request.clone(),
            pool: r.pool.clone(),
            device: r.device.clone(),
            share_id: r.share_id.clone().filter(|s| !s.is_empty()),
            consumed: r
                .consumed_capacity
                .iter()
                .flatten()
                .map(|(k, v)| (k.clone(), v.0.clone()))
                .collect(),
        })
        .collect();
    if ours.is_empty() {
        return Err(ClaimError::OtherNode {
            claim: name,
            pool: pool.to_string(),
        });
    }
    // The share id becomes part of a CDI device name: the API server only admits UUIDs, but check.
    if let Some((device, share_id)) = ours.iter().find_map(|d| {
        let share = d.share_id.as_deref()?;
        (share.len() > 64
            || !share
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-'))
        .then(|| (d.device.clone(), share.to_string()))
    }) {
        return Err(ClaimError::BadShareId {
            claim: name,
            device,
            share_id,
        });
    }
    if let Some(missing) = ours
        .iter()
        .find(|d| crate::devices::find(inventory, &d.device).is_none())
    {
        return Err(ClaimError::UnknownDevice {
            claim: name,
            pool: missing.pool.clone(),
            device: missing.device.clone(),
        });
    }

    let mut configs = Vec::new();
    for (i, entry) in devices
        .and_then(|d| d.config.as_deref())
        .unwrap_or(&[])
        .iter()
        .enumerate()
    {
        let Some(opaque) = entry.opaque.as_ref().filter(|o| o.driver == DRIVER_NAME) else {
            continue;
        };
        let field = format!("status.allocation.devices.config[{i}].opaque.parameters");
        let source = ConfigSource::parse(&entry.source).ok_or_else(|| ClaimError::Config {
            claim: name.clone(),
            error: config::ConfigError {
                field: format!("status.allocation.devices.config[{i}].source"),
                message: format!("unknown source {:?}", entry.source),
            },
        })?;
        let decoded =
            config::decode(&opaque.parameters.0, &field).map_err(|error| ClaimError::Config {
                claim: name.clone(),
                error,
            })?;
        configs.push(ConfigEntry {
            source,
            field,
            requests: entry.requests.clone().unwrap_or_default(),
            config: decoded,
        });
    }

    Ok(ClaimAllocation {
        devices: ours,
        configs,
        device_status: status.and_then(|s| s.devices.clone()).unwrap_or_default(),
        generation: claim.metadata.generation,
    })
}

/// What identifies one allocation of a claim on this node: its devices with their share ids, in
/// order. Allocations of consumable capacity get fresh share ids, so two allocations of one claim
/// differ here even on the same devices.
pub type AllocationId = Vec<(String, String, Option<String>)>;

/// This driver's results for `pool` in the claim's allocation, as an [`AllocationId`].
pub fn allocation_id(claim: &ResourceClaim, pool: &str) -> AllocationId {
    allocation_results(claim)
        .iter()
        .filter(|r| r.driver == DRIVER_NAME && r.pool == pool)
        .map(|r| {
            (
                r.pool.clone(),
                r.device.clone(),
                r.share_id.clone().filter(|s| !s.is_empty()),
            )
        })
        .collect()
}

/// The [`AllocationId`] of devices as prepared (recorded in the checkpoint).
pub fn prepared_allocation_id(devices: &[PreparedDevice]) -> AllocationId {
    devices
        .iter()
        .map(|d| {
            (
                d.pool_name.clone(),
                d.device_name.clone(),
                d.share_id.clone(),
            )
        })
        .collect()
}

/// The consumers a claim is reserved for (`status.reservedFor[].uid`).
pub fn consumers(claim: &ResourceClaim) -> BTreeSet<String> {
    claim
        .status
        .as_ref()
        .and_then(|s| s.reserved_for.as_ref())
        .into_iter()
        .flatten()
        .map(|c| c.uid.clone())
        .collect()
}

/// What the driver knew of an allocation when it unprepared it: enough to tell a cached copy that
/// still shows it (stale) from the same allocation reserved again for a new pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tombstone {
    pub allocation: AllocationId,
    /// The consumers of the newest copy the driver prepared from.
    pub consumers: BTreeSet<String>,
    /// The resourceVersion of the newest copy of the claim the driver saw while it was prepared
    /// (read or written): a re-prepare reads from the cache "not older than" it.
    pub seen_version: Option<String>,
}

/// Why a copy of the claim from the API server's watch cache must not be prepared from (the
/// caller then reads it with quorum), or `None` when it may be.
///
/// The kubelet calls NodePrepareResources only after it has itself read the claim and found it
/// allocated and reserved for a pod of this node. A cached copy is never newer than the object,
/// and an allocation cannot change while it is set (the API server refuses such updates): it can
/// only be removed, and a new one written later. So a cached copy that is allocated either holds
/// the allocation the kubelet saw, or an earlier allocation of the same claim that has since been
/// removed. The checks below refuse every copy that cannot be the kubelet's:
/// - another UID: the claim was deleted and re-created under the same name;
/// - being deleted, not allocated, or not reserved for anyone: the kubelet would not have called;
/// - no result of this driver in this node's pool: an allocation for another node;
/// - an allocation this driver has prepared and unprepared before (`unprepared`, the tombstones of
///   this claim since the driver started), reserved only for consumers the driver had seen
///   reserved on it: a copy from before the unprepare. The same allocation reserved for a
///   consumer the driver had not seen is a pod started on the claim after the unprepare (a pod
///   re-created on the same claim), and is the kubelet's: such a re-prepare costs one cached
///   read, where refusing every unprepared allocation made it a cached and a quorum read. The
///   caller reads such a claim "not older than" the tombstone's `seen_version`, so the copy is
///   never older than what the driver saw while the allocation was prepared.
///
/// What remains is an earlier allocation of this claim on this node that was never prepared here
/// (or reserved for a consumer this driver never saw, then unprepared), then removed and replaced
/// by another one on this node, all within the cache's delay (normally milliseconds, while that
/// sequence takes a pod deletion, a deallocation and a scheduling cycle). That case is caught
/// after the answer, not before: the status write that follows a prepare is conditional on the
/// copy's resourceVersion, a stale copy makes it fail, and the quorum read that follows compares
/// the allocations (see `ClaimPreparer`).
pub fn cached_copy_problem(
    claim_ref: &ClaimRef,
    claim: &ResourceClaim,
    pool: &str,
    unprepared: &[Tombstone],
) -> Option<&'static str> {
    if claim.metadata.uid.as_deref() != Some(claim_ref.uid.as_str()) {
        return Some("another UID");
    }
    if claim.metadata.deletion_timestamp.is_some() {
        return Some("being deleted");
    }
    let status = claim.status.as_ref();
    if status.and_then(|s| s.allocation.as_ref()).is_none() {
        return Some("not allocated");
    }
    let consumers = consumers(claim);
    if consumers.is_empty() {
        return Some("not reserved");
    }
    let id = allocation_id(claim, pool);
    if id.is_empty() {
        return Some("no device of this node");
    }
    let stale = unprepared
        .iter()
        .any(|t| t.allocation == id && consumers.is_subset(&t.consumers));
    if stale {
        return Some("an allocation already unprepared, reserved for no new consumer");
    }
    None
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::json;

    pub const UID: &str = "0b7c4a49-6f1e-4a52-9d0e-6d1f3f7a5b10";

    pub fn claim_ref(uid: &str) -> ClaimRef {
        ClaimRef {
            namespace: "team-a".into(),
            name: "train".into(),
            uid: uid.into(),
        }
    }

    /// One allocation result: (request, pool, device, shareID, memory, cores).
    pub type ResultSpec<'a> = (
        &'a str,
        &'a str,
        &'a str,
        Option<&'a str>,
        Option<&'a str>,
        Option<&'a str>,
    );

    /// A claim as the scheduler leaves it.
    pub fn allocated_claim(
        uid: &str,
        results: &[ResultSpec<'_>],
        config: serde_json::Value,
    ) -> ResourceClaim {
        let results: Vec<_> = results
            .iter()
            .map(|(request, pool, device, share, memory, cores)| {
                let mut consumed = serde_json::Map::new();
                if let Some(m) = memory {
                    consumed.insert("memory".into(), json!(m));
                }
                if let Some(c) = cores {
                    consumed.insert("cores".into(), json!(c));
                }
                json!({
                    "request": request, "driver": "gpupool.dev", "pool": pool, "device": device,
                    "shareID": share, "consumedCapacity": consumed,
                })
            })
            .collect();
        serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": "train", "namespace": "team-a", "uid": uid, "generation": 1},
            "spec": {"devices": {"requests": []}},
            "status": {
                "allocation": {"devices": {"results": results, "config": config}},
                // The kubelet calls only for claims reserved for a pod of its node.
                "reservedFor": [{"resource": "pods", "name": "train-0",
                                 "uid": "9f1c2d3e-4b5a-4c6d-8e7f-000000000001"}],
            },
        }))
        .unwrap()
    }

    pub fn inventory() -> Inventory {
        let gpu = |index: u32, model: &str, memory: u64| gpupool_api::inventory::Gpu {
            index,
            minor: index,
            uuid: format!("GPU-{index}0000000-0000-0000-0000-000000000000"),
            product_name: format!("NVIDIA {model}"),
            model: model.into(),
            architecture: "Ampere".into(),
            brand: "Nvidia".into(),
            memory_bytes: memory,
            multiprocessors: 108,
            cuda_cores: 6912,
            cuda_compute_capability: "8.0".into(),
            driver_version: "550.54.15".into(),
            cuda_driver_version: "12.4".into(),
            pci_bus_id: format!("0000:0{index}:00.0"),
            pcie_root: None,
            numa_node: None,
            mig: None,
            nvlink_domain: None,
        };
        // gpu-2: an H100 with the real card's MIG geometry (it switches MIG mode at run time).
        let mut h100 = crate::inventory::fake::fake_inventory("h100-80gb:1", "node-a")
            .expect("a known profile")
            .gpus
            .remove(0);
        h100.index = 2;
        h100.minor = 2;
        h100.uuid = "GPU-20000000-0000-0000-0000-000000000000".into();
        h100.pci_bus_id = "0000:02:00.0".into();
        Inventory {
            source: gpupool_api::inventory::InventorySource::Fake,
            gpus: vec![
                gpu(0, "A100-SXM4-40GB", 40 << 30),
                gpu(1, "V100-SXM2-32GB", 32 << 30),
                h100,
            ],
        }
    }

    #[test]
    fn hostile_references_are_refused() {
        for uid in [
            "../../etc",
            "/etc/passwd",
            "",
            "0b7c4a49-6f1e-4a52-9d0e-6d1f3f7a5b1/",
        ] {
            assert!(matches!(
                validate_ref(&claim_ref(uid)),
                Err(ClaimError::BadUid(_))
            ));
        }
        let mut r = claim_ref(UID);
        r.namespace = "../kube-system".into();
        assert!(matches!(validate_ref(&r), Err(ClaimError::BadNamespace(_))));
        let mut r = claim_ref(UID);
        r.name = "a/b".into();
        assert!(matches!(validate_ref(&r), Err(ClaimError::BadName(_))));
        r.name = "train.v2".into();
        assert_eq!(validate_ref(&r), Ok(()));
    }

    #[test]
    fn takes_only_this_drivers_results_on_this_pool() {
        let mut claim = allocated_claim(
            UID,
            &[
                (
                    "gpu",
                    "node-a",
                    "gpu-0",
                    Some("s1"),
                    Some("8Gi"),
                    Some("50"),
                ),
                ("gpu", "node-b", "gpu-0", None, None, None),
            ],
            json!([]),
        );
        let a = check_claim(&claim_ref(UID), &claim, "node-a", &inventory()).unwrap();
        assert_eq!(a.devices.len(), 1);
        assert_eq!(a.devices[0].share_id.as_deref(), Some("s1"));
        assert_eq!(a.devices[0].consumed["memory"], "8Gi");

        let e = check_claim(&claim_ref(UID), &claim, "node-c", &inventory()).unwrap_err();
        assert!(
            e.to_string().contains("allocated to another node/pool"),
            "{e}"
        );
        assert!(e.to_string().contains("team-a/train"), "{e}");

        let e = check_claim(
            &claim_ref(&UID.replace('0', "1")),
            &claim,
            "node-a",
            &inventory(),
        )
        .unwrap_err();
        assert!(matches!(e, ClaimError::UidMismatch { .. }), "{e}");

        claim.status.as_mut().unwrap().allocation = None;
        let e = check_claim(&claim_ref(UID), &claim, "node-a", &inventory()).unwrap_err();
        assert_eq!(e.to_string(), "claim team-a/train: not allocated");
    }

    #[test]
    fn unknown_device_and_bad_config_fail_with_names() {
        let claim = allocated_claim(UID, &[("gpu", "n", "gpu-7", None, None, None)], json!([]));
        let e = check_claim(&claim_ref(UID), &claim, "n", &inventory()).unwrap_err();
        assert!(e.to_string().contains("gpu-7"), "{e}");

        let claim = allocated_claim(
            UID,
            &[("gpu", "n", "gpu-0", Some("../../x"), Some("1Gi"), None)],
            json!([]),
        );
        let e = check_claim(&claim_ref(UID), &claim, "n", &inventory()).unwrap_err();
        assert!(e.to_string().contains("shareID \"../../x\""), "{e}");

        let config = json!([
            {"source": "FromClass", "opaque": {"driver": "other.dev", "parameters": {"x": 1}}},
            {"source": "FromClaim", "requests": ["gpu"], "opaque": {"driver": "gpupool.dev",
             "parameters": {"apiVersion": "gpupool.dev/v1alpha1", "kind": "GpuConfig", "memoryLimt": "1Gi"}}},
        ]);
        let claim = allocated_claim(UID, &[("gpu", "n", "gpu-0", None, None, None)], config);
        let e = check_claim(&claim_ref(UID), &claim, "n", &inventory()).unwrap_err();
        assert_eq!(
            e.to_string(),
            "claim team-a/train: status.allocation.devices.config[1].opaque.parameters.memoryLimt: unknown field"
        );
    }

    #[test]
    fn a_cached_copy_is_used_only_when_it_can_be_the_allocation_the_kubelet_saw() {
        let results: &[ResultSpec<'_>] = &[(
            "gpu",
            "node-a",
            "gpu-0",
            Some("3aef7919-0000-4000-8000-000000000001"),
            Some("8Gi"),
            Some("50"),
        )];
        let claim = allocated_claim(UID, results, json!(null));
        let ours = claim_ref(UID);
        assert_eq!(cached_copy_problem(&ours, &claim, "node-a", &[]), None);

        assert_eq!(
            cached_copy_problem(
                &claim_ref("1c8d5b5a-7a2f-4b63-8e1f-7e2a4a8b6c21"),
                &claim,
                "node-a",
                &[]
            ),
            Some("another UID")
        );
        assert_eq!(
            cached_copy_problem(&ours, &claim, "node-b", &[]),
            Some("no device of this node")
        );
        let mut unreserved = claim.clone();
        unreserved.status.as_mut().unwrap().reserved_for = None;
        assert_eq!(
            cached_copy_problem(&ours, &unreserved, "node-a", &[]),
            Some("not reserved")
        );
        let mut unallocated = claim.clone();
        unallocated.status.as_mut().unwrap().allocation = None;
        assert_eq!(
            cached_copy_problem(&ours, &unallocated, "node-a", &[]),
            Some("not allocated")
        );
        let mut deleting = claim.clone();
        deleting.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                "2026-01-01T00:00:00Z".parse().unwrap(),
            ));
        assert_eq!(
            cached_copy_problem(&ours, &deleting, "node-a", &[]),
            Some("being deleted")
        );

        // An allocation prepared and unprepared before, reserved for the consumers it had then:
        // a copy from before the unprepare. The next allocation has another share id.
        let tombstone = |claim: &ResourceClaim| Tombstone {
            allocation: allocation_id(claim, "node-a"),
            consumers: consumers(claim),
            seen_version: None,
        };
        let earlier = tombstone(&claim);
        assert_eq!(
            cached_copy_problem(&ours, &claim, "node-a", std::slice::from_ref(&earlier)),
            Some("an allocation already unprepared, reserved for no new consumer")
        );
        let next = allocated_claim(
            UID,
            &[(
                "gpu",
                "node-a",
                "gpu-0",
                Some("3aef7919-0000-4000-8000-000000000002"),
                Some("8Gi"),
                Some("50"),
            )],
            json!(null),
        );
        assert_eq!(
            cached_copy_problem(&ours, &next, "node-a", std::slice::from_ref(&earlier)),
            None
        );
        // The same allocation reserved for a pod the driver had not seen (a pod re-created on
        // the claim after the unprepare) is the kubelet's.
        let mut again = claim.clone();
        again.status.as_mut().unwrap().reserved_for = Some(vec![
            k8s_openapi::api::resource::v1::ResourceClaimConsumerReference {
                resource: "pods".into(),
                name: "p2".into(),
                uid: "6f1c8a52-0000-4000-8000-00000000000a".into(),
                ..Default::default()
            },
        ]);
        assert_eq!(
            cached_copy_problem(&ours, &again, "node-a", std::slice::from_ref(&earlier)),
            None
        );
    }
}

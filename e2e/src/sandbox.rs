//! The sandbox's cluster and the examples it applies, and what it prints: slices per node, each
//! claim's device, fraction and limits, the CDI spec paths, and the claims still pending with why.
//! Gathering does the I/O; rendering is pure.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::{Event, Pod};
use k8s_openapi::api::resource::v1::{Device, ResourceClaim, ResourceSlice};
use kube::api::ListParams;
use kube::Api;
use serde_json::Value;

use gpupool_api::claim::allocation_results;
use gpupool_api::names::{attr, capacity, DRIVER_NAME};
use gpupool_api::quantity;

use crate::harness::{workspace_root, ClusterSpec, HarnessError, NodeSpec, TestCluster};

/// The seeds' pool: the cards the sandbox runs and deploy/examples/ are written for.
pub fn pool() -> Vec<NodeSpec> {
    vec![
        NodeSpec::new("node-a100", "a100-40gb:2"),
        NodeSpec::new("node-v100", "v100-32gb:2"),
        NodeSpec::new("node-rtx", "rtx3090:1"),
        // An HGX board: MIG partitions, fractions and NVLink claims side by side.
        NodeSpec::new("node-h100", "h100-80gb:4+nvswitch"),
    ]
}

/// The sandbox's cluster: the seeds' pool and the controller, on the emulator whatever
/// `GPUPOOL_E2E_KUBECONFIG` says.
pub fn cluster_spec() -> ClusterSpec {
    let mut spec = ClusterSpec::new().with_controller().emulated();
    spec.nodes = pool();
    spec
}

/// deploy/examples/ of this workspace.
pub fn examples_dir() -> PathBuf {
    workspace_root().join("deploy").join("examples")
}

/// YAML files of the folder, GpuModels and ComputeProfiles first so that the classes and templates
/// the other examples name exist by the time their claims are scheduled.
pub fn example_files(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("reading {}: {e}", dir.display()))?;
    let mut files: Vec<(bool, PathBuf)> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| matches!(p.extension().and_then(|e| e.to_str()), Some("yaml" | "yml")))
        .map(|p| {
            let text = std::fs::read_to_string(&p).unwrap_or_default();
            let setup = text.contains("kind: GpuModel") || text.contains("kind: ComputeProfile");
            (!setup, p)
        })
        .collect();
    files.sort();
    Ok(files.into_iter().map(|(_, p)| p).collect())
}

/// One published device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceLine {
    pub node: String,
    pub device: String,
    pub model: String,
    pub memory: String,
    pub compute_weight: Option<i64>,
    pub shareable: bool,
    /// The card's index (`gpu-<i>` and its MIG devices).
    pub card: Option<i64>,
    /// Set for a MIG device: its profile.
    pub mig_profile: Option<String>,
    pub nvlink_domain: Option<String>,
}

/// One allocated device (or share) of a claim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllocationLine {
    pub request: String,
    pub pool: String,
    pub device: String,
    pub share_id: Option<String>,
    pub memory: Option<String>,
    pub cores: Option<String>,
}

/// One claim and what became of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimLine {
    pub namespace: String,
    pub name: String,
    pub allocations: Vec<AllocationLine>,
    /// `name (phase)` of the pods it is reserved for.
    pub pods: Vec<String>,
    pub cdi_spec: Option<PathBuf>,
    /// Limit env of the CDI spec, in device order.
    pub limits: Vec<String>,
    /// For a claim without allocation, or a pod that is not running: the latest warning event.
    pub problem: Option<String>,
    /// Whether any pod references the claim (an unused claim is never allocated).
    pub used: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    pub devices: Vec<DeviceLine>,
    pub claims: Vec<ClaimLine>,
    /// Pods that are not running, with why (`namespace/name: reason`).
    pub waiting_pods: Vec<String>,
}

/// A driver-domain attribute, published qualified (`gpupool.dev/x`) or not (`x`).
pub fn attribute<'a>(
    device: &'a Device,
    name: &str,
) -> Option<&'a k8s_openapi::api::resource::v1::DeviceAttribute> {
    let attributes = device.attributes.as_ref()?;
    attributes
        .get(name)
        .or_else(|| attributes.get(&format!("{DRIVER_NAME}/{name}")))
}

fn memory_text(q: &str) -> String {
    match quantity::parse(q) {
        Ok(milli) => quantity::format_bytes(milli.ceil_units().max(0) as u64),
        Err(_) => q.to_string(),
    }
}

/// Devices of gpupool's slices, sorted by node then device name.
pub fn device_lines(slices: &[ResourceSlice]) -> Vec<DeviceLine> {
    let mut lines = Vec::new();
    for slice in slices.iter().filter(|s| s.spec.driver == DRIVER_NAME) {
        let node = slice
            .spec
            .node_name
            .clone()
            .unwrap_or_else(|| slice.spec.pool.name.clone());
        for device in slice.spec.devices.iter().flatten() {
            let model = attribute(device, attr::MODEL)
                .and_then(|a| a.string.clone())
                .unwrap_or_default();
            let memory = device
                .capacity
                .as_ref()
                .and_then(|c| c.get(capacity::MEMORY))
                .map(|c| memory_text(&c.value.0))
                .unwrap_or_default();
            let text = |name: &str| attribute(device, name).and_then(|a| a.string.clone());
            let is_mig = text(attr::TYPE).as_deref() == Some(gpupool_api::names::DEVICE_TYPE_MIG);
            lines.push(DeviceLine {
                node: node.clone(),
                device: device.name.clone(),
                model,
                memory,
                compute_weight: attribute(device, attr::COMPUTE_WEIGHT).and_then(|a| a.int),
                shareable: device.allow_multiple_allocations == Some(true),
                card: attribute(device, attr::INDEX).and_then(|a| a.int),
                mig_profile: is_mig.then(|| text(attr::MIG_PROFILE)).flatten(),
                nvlink_domain: text(attr::NVLINK_DOMAIN),
            });
        }
    }
    lines.sort_by(|a, b| (&a.node, &a.device).cmp(&(&b.node, &b.device)));
    lines
}

/// gpupool's allocation results of a claim.
pub fn allocation_lines(claim: &ResourceClaim) -> Vec<AllocationLine> {
    allocation_results(claim)
        .iter()
        .filter(|r| r.driver == DRIVER_NAME)
        .map(|r| {
            let consumed = r.consumed_capacity.as_ref();
            AllocationLine {
                request: r.request.clone(),
                pool: r.pool.clone(),
                device: r.device.clone(),
                share_id: r.share_id.clone(),
                memory: consumed
                    .and_then(|c| c.get(capacity::MEMORY))
                    .map(|q| memory_text(&q.0)),
                cores: consumed
                    .and_then(|c| c.get(capacity::CORES))
                    .map(|q| q.0.clone()),
            }
        })
        .collect()
}

/// The limit env of a CDI spec (what HAMi-core enforces), device by device, then spec-wide.
pub fn cdi_limits(spec: &Value) -> Vec<String> {
    // A MIG device's limit is its partition: shown by its profile and MIG device UUID.
    let is_limit = |e: &&str| {
        e.starts_with("CUDA_DEVICE_MEMORY_LIMIT_")
            || e.starts_with("CUDA_DEVICE_SM_LIMIT_")
            || e.starts_with("CUDA_TASK_PRIORITY")
            || e.starts_with("GPUPOOL_DEVICE_MIG_PROFILE_")
            || (e.starts_with("GPUPOOL_DEVICE_UUID_") && e.contains("=MIG-"))
    };
    let env_of = |edits: &Value| -> Vec<String> {
        edits
            .get("env")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .filter(is_limit)
            .map(str::to_string)
            .collect()
    };
    let mut out = Vec::new();
    for device in spec
        .get("devices")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        if let Some(edits) = device.get("containerEdits") {
            out.extend(env_of(edits));
        }
    }
    if let Some(edits) = spec.get("containerEdits") {
        out.extend(env_of(edits));
    }
    out
}

/// The latest Warning event message about an object (by kind and name in a namespace).
pub fn latest_warning(events: &[Event], namespace: &str, kind: &str, name: &str) -> Option<String> {
    events
        .iter()
        .filter(|e| {
            e.involved_object.kind.as_deref() == Some(kind)
                && e.involved_object.name.as_deref() == Some(name)
                && e.involved_object.namespace.as_deref().unwrap_or(namespace) == namespace
                && e.type_.as_deref() != Some("Normal")
        })
        .max_by_key(|e| {
            e.last_timestamp
                .as_ref()
                .or(e.first_timestamp.as_ref())
                .map(|t| t.0)
        })
        .map(|e| {
            format!(
                "{}: {}",
                e.reason.clone().unwrap_or_default(),
                e.message.clone().unwrap_or_default()
            )
        })
}

/// Whether a pod names the claim, directly or through its template's generated claim.
pub fn pod_uses_claim(pod: &Pod, namespace: &str, claim: &str) -> bool {
    pod.metadata.namespace.as_deref() == Some(namespace)
        && crate::kubelet::pod_claim_names(pod).is_ok_and(|names| names.iter().any(|n| n == claim))
}

/// Where each process of the cluster serves Prometheus metrics, as `(what, url)`: the drivers
/// and the controller bind free loopback ports, which their logs announce.
pub fn metrics_endpoints(cluster: &TestCluster) -> Vec<(String, String)> {
    let url = |addr: std::net::SocketAddr| format!("http://{addr}/metrics");
    let mut endpoints: Vec<(String, String)> = cluster
        .nodes()
        .iter()
        .filter_map(|n| Some((format!("driver on {}", n.name), url(n.metrics_addr()?))))
        .collect();
    if let Some(addr) = cluster.controller_metrics_addr() {
        endpoints.push(("controller".to_string(), url(addr)));
    }
    endpoints
}

/// The text the sandbox prints.
pub fn render(report: &Report) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "== Published GPUs (ResourceSlices of {DRIVER_NAME})");
    let mut by_node: BTreeMap<&str, Vec<&DeviceLine>> = BTreeMap::new();
    for line in &report.devices {
        by_node.entry(&line.node).or_default().push(line);
    }
    if by_node.is_empty() {
        let _ = writeln!(out, "  (none)");
    }
    for (node, devices) in by_node {
        let _ = writeln!(out, "  {node}");
        for d in devices.iter().filter(|d| d.mig_profile.is_none()) {
            let weight = d
                .compute_weight
                .map(|w| format!("  weight {w}"))
                .unwrap_or_default();
            let shared = if d.shareable {
                "  shareable"
            } else {
                "  exclusive"
            };
            let nvlink = d
                .nvlink_domain
                .as_deref()
                .map(|n| format!("  {n}"))
                .unwrap_or_default();
            let _ = writeln!(
                out,
                "    {:<7} {:<16} memory {}{weight}{shared}{nvlink}",
                d.device, d.model, d.memory
            );
            let migs: Vec<&&DeviceLine> = devices
                .iter()
                .filter(|m| m.mig_profile.is_some() && m.card == d.card)
                .collect();
            if !migs.is_empty() {
                let _ = writeln!(out, "            {}", mig_summary(&migs));
            }
        }
        // MIG devices of a card that is not offered whole (Ampere in MIG mode).
        let orphans: Vec<&&DeviceLine> = devices
            .iter()
            .filter(|m| {
                m.mig_profile.is_some()
                    && !devices
                        .iter()
                        .any(|c| c.mig_profile.is_none() && c.card == m.card)
            })
            .collect();
        if !orphans.is_empty() {
            let _ = writeln!(out, "    MIG only: {}", mig_summary(&orphans));
        }
    }
    let _ = writeln!(out, "\n== Claims");
    if report.claims.is_empty() {
        let _ = writeln!(out, "  (none)");
    }
    for claim in &report.claims {
        let _ = writeln!(out, "  {}/{}", claim.namespace, claim.name);
        if claim.allocations.is_empty() {
            let why = match (&claim.problem, claim.used) {
                (Some(problem), _) => problem.as_str(),
                (None, true) => "not allocated yet (no event)",
                (None, false) => {
                    "no pod uses it (a claim is allocated when a pod that needs it is scheduled)"
                }
            };
            let _ = writeln!(out, "    PENDING: {why}");
        }
        for a in &claim.allocations {
            let share = a
                .share_id
                .as_deref()
                .map(|s| format!(" share {s}"))
                .unwrap_or_default();
            let published = report
                .devices
                .iter()
                .find(|d| d.node == a.pool && d.device == a.device);
            let card_memory = published.map(|d| d.memory.as_str());
            let unthrottled = matches!(a.cores.as_deref(), None | Some("0"));
            let nvlink = published
                .and_then(|d| d.nvlink_domain.as_deref())
                .map(|n| format!(" [{n}]"))
                .unwrap_or_default();
            let fraction = match (&a.memory, &a.cores) {
                _ if published.is_some_and(|d| d.mig_profile.is_some()) => format!(
                    "MIG {} (a hardware partition, memory {})",
                    published
                        .and_then(|d| d.mig_profile.as_deref())
                        .unwrap_or_default(),
                    published.map(|d| d.memory.as_str()).unwrap_or_default()
                ),
                (None, None) => "whole card".to_string(),
                (Some(m), _) if unthrottled && Some(m.as_str()) == card_memory => {
                    format!("whole card (memory {m})")
                }
                (m, c) => format!(
                    "memory {}, cores {}%",
                    m.as_deref().unwrap_or("whole card"),
                    c.as_deref().unwrap_or("0")
                ),
            };
            let _ = writeln!(
                out,
                "    {} -> {}/{}{share}{nvlink}: {fraction}",
                a.request, a.pool, a.device
            );
        }
        if !claim.pods.is_empty() {
            let _ = writeln!(out, "    pods: {}", claim.pods.join(", "));
        }
        if let Some(path) = &claim.cdi_spec {
            let _ = writeln!(out, "    CDI spec: {}", path.display());
        }
        if !claim.limits.is_empty() {
            let _ = writeln!(out, "    limits: {}", claim.limits.join(" "));
        }
        if !claim.allocations.is_empty() {
            if let Some(problem) = &claim.problem {
                let _ = writeln!(out, "    problem: {problem}");
            }
        }
    }
    if !report.waiting_pods.is_empty() {
        let _ = writeln!(out, "\n== Pods not running");
        for pod in &report.waiting_pods {
            let _ = writeln!(out, "  {pod}");
        }
    }
    out
}

/// "MIG: 25 placements (1g.10gb x7, 3g.40gb x2, ...)", profiles in the order published.
fn mig_summary(devices: &[&&DeviceLine]) -> String {
    let mut profiles: Vec<(&str, usize)> = Vec::new();
    for d in devices {
        let profile = d.mig_profile.as_deref().unwrap_or_default();
        match profiles.iter_mut().find(|(p, _)| *p == profile) {
            Some((_, n)) => *n += 1,
            None => profiles.push((profile, 1)),
        }
    }
    let list: Vec<String> = profiles.iter().map(|(p, n)| format!("{p} x{n}")).collect();
    format!("MIG: {} placements ({})", devices.len(), list.join(", "))
}

fn list_err(what: &str) -> impl FnOnce(kube::Error) -> HarnessError + '_ {
    move |source| HarnessError::Kube {
        what: format!("listing {what}"),
        source,
    }
}

/// Reads slices, claims, pods, events and CDI specs of the cluster.
pub async fn gather(cluster: &TestCluster) -> Result<Report, HarnessError> {
    let client = cluster.client();
    let lp = ListParams::default();
    let slices = Api::<ResourceSlice>::all(client.clone())
        .list(&lp)
        .await
        .map_err(list_err("resourceslices"))?
        .items;
    let claims = Api::<ResourceClaim>::all(client.clone())
        .list(&lp)
        .await
        .map_err(list_err("resourceclaims"))?
        .items;
    let pods = Api::<Pod>::all(client.clone())
        .list(&lp)
        .await
        .map_err(list_err("pods"))?
        .items;
    let events = Api::<Event>::all(client)
        .list(&lp)
        .await
        .map_err(list_err("events"))?
        .items;

    let pod_phase = |uid: &str| -> Option<(String, String)> {
        pods.iter()
            .find(|p| p.metadata.uid.as_deref() == Some(uid))
            .map(|p| {
                let phase = p
                    .status
                    .as_ref()
                    .and_then(|s| s.phase.clone())
                    .unwrap_or_else(|| "Pending".into());
                (p.metadata.name.clone().unwrap_or_default(), phase)
            })
    };

    let mut claim_lines = Vec::new();
    for claim in &claims {
        let namespace = claim.metadata.namespace.clone().unwrap_or_default();
        let name = claim.metadata.name.clone().unwrap_or_default();
        let uid = claim.metadata.uid.clone().unwrap_or_default();
        let allocations = allocation_lines(claim);
        let reserved = claim
            .status
            .as_ref()
            .and_then(|s| s.reserved_for.clone())
            .unwrap_or_default();
        let pods_of_claim: Vec<String> = reserved
            .iter()
            .map(|r| match pod_phase(&r.uid) {
                Some((pod, phase)) => format!("{pod} ({phase})"),
                None => format!("{} (gone)", r.name),
            })
            .collect();
        let node = allocations
            .first()
            .and_then(|a| cluster.nodes().iter().find(|n| n.name == a.pool));
        let cdi_spec = node.map(|n| n.cdi_spec_path(&uid)).filter(|p| p.is_file());
        let limits = node
            .and_then(|n| n.cdi_spec(&uid))
            .map(|spec| cdi_limits(&spec))
            .unwrap_or_default();
        let problem = latest_warning(&events, &namespace, "ResourceClaim", &name).or_else(|| {
            // kube-scheduler reports a claim that fits nowhere on the pods waiting for it.
            allocations.is_empty().then_some(())?;
            pods.iter()
                .filter(|p| pod_uses_claim(p, &namespace, &name))
                .find_map(|p| {
                    let pod = p.metadata.name.as_deref().unwrap_or_default();
                    latest_warning(&events, &namespace, "Pod", pod)
                })
        });
        let used =
            !reserved.is_empty() || pods.iter().any(|p| pod_uses_claim(p, &namespace, &name));
        claim_lines.push(ClaimLine {
            namespace,
            name,
            allocations,
            pods: pods_of_claim,
            cdi_spec,
            limits,
            problem,
            used,
        });
    }
    claim_lines.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));

    let mut waiting_pods = Vec::new();
    for pod in &pods {
        let phase = pod
            .status
            .as_ref()
            .and_then(|s| s.phase.as_deref())
            .unwrap_or("Pending");
        if phase == "Running" || phase == "Succeeded" {
            continue;
        }
        let namespace = pod.metadata.namespace.clone().unwrap_or_default();
        let name = pod.metadata.name.clone().unwrap_or_default();
        let why = latest_warning(&events, &namespace, "Pod", &name)
            .unwrap_or_else(|| "no event yet".into());
        waiting_pods.push(format!("{namespace}/{name} ({phase}): {why}"));
    }
    waiting_pods.sort();

    Ok(Report {
        devices: device_lines(&slices),
        claims: claim_lines,
        waiting_pods,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn devices_show_model_memory_and_weight_per_node() {
        let slice: ResourceSlice = serde_json::from_value(json!({
            "metadata": {"name": "s"},
            "spec": {"driver": "gpupool.dev", "nodeName": "node-a100",
                     "pool": {"name": "node-a100", "generation": 1, "resourceSliceCount": 1},
                     "devices": [{"name": "gpu-1", "allowMultipleAllocations": true,
                                  "attributes": {"model": {"string": "A100-SXM4-40GB"}, "computeWeight": {"int": 312}},
                                  "capacity": {"memory": {"value": "40Gi"}, "cores": {"value": "100"}}},
                                 {"name": "gpu-0", "attributes": {"gpupool.dev/model": {"string": "A100-SXM4-40GB"}},
                                  "capacity": {"memory": {"value": "40Gi"}}}]}
        }))
        .unwrap();
        let lines = device_lines(&[slice]);
        assert_eq!(lines[0].device, "gpu-0");
        assert_eq!(lines[0].model, "A100-SXM4-40GB", "qualified attribute name");
        assert!(!lines[0].shareable);
        assert_eq!(lines[1].compute_weight, Some(312));
        let text = render(&Report {
            devices: lines,
            ..Default::default()
        });
        assert!(text.contains("node-a100"), "{text}");
        assert!(
            text.contains("gpu-1   A100-SXM4-40GB   memory 40Gi  weight 312  shareable"),
            "{text}"
        );
    }

    #[test]
    fn a_fraction_shows_share_memory_and_cores_and_a_pending_claim_shows_why() {
        let claim: ResourceClaim = serde_json::from_value(json!({
            "metadata": {"name": "half", "namespace": "default"},
            "spec": {},
            "status": {"allocation": {"devices": {"results": [
                {"driver": "gpupool.dev", "pool": "node-a100", "device": "gpu-0", "request": "gpu",
                 "shareID": "s1", "consumedCapacity": {"memory": "1Gi", "cores": "50"}},
                {"driver": "other.dev", "pool": "node-a100", "device": "nic-0", "request": "nic"}
            ]}}}
        }))
        .unwrap();
        let allocations = allocation_lines(&claim);
        assert_eq!(allocations.len(), 1, "other drivers' results are not ours");
        let report = Report {
            claims: vec![
                ClaimLine {
                    namespace: "default".into(),
                    name: "half".into(),
                    allocations,
                    pods: vec!["p (Running)".into()],
                    cdi_spec: Some("/cdi/x.json".into()),
                    limits: vec!["CUDA_DEVICE_MEMORY_LIMIT_0=1024m".into()],
                    problem: None,
                    used: true,
                },
                ClaimLine {
                    namespace: "default".into(),
                    name: "too-big".into(),
                    allocations: vec![],
                    pods: vec![],
                    cdi_spec: None,
                    limits: vec![],
                    problem: Some("FailedScheduling: cannot allocate all claims".into()),
                    used: true,
                },
                ClaimLine {
                    namespace: "default".into(),
                    name: "unused".into(),
                    allocations: vec![],
                    pods: vec![],
                    cdi_spec: None,
                    limits: vec![],
                    problem: None,
                    used: false,
                },
            ],
            ..Default::default()
        };
        let text = render(&report);
        assert!(
            text.contains("gpu -> node-a100/gpu-0 share s1: memory 1Gi, cores 50%"),
            "{text}"
        );
        assert!(
            text.contains("limits: CUDA_DEVICE_MEMORY_LIMIT_0=1024m"),
            "{text}"
        );
        assert!(
            text.contains("PENDING: FailedScheduling: cannot allocate all claims"),
            "{text}"
        );
    }

    #[test]
    fn a_claim_that_took_all_memory_unthrottled_is_a_whole_card() {
        let report = Report {
            devices: vec![DeviceLine {
                node: "node-v100".into(),
                device: "gpu-0".into(),
                model: "V100-SXM2-32GB".into(),
                memory: "32Gi".into(),
                compute_weight: None,
                shareable: true,
                card: Some(0),
                mig_profile: None,
                nvlink_domain: None,
            }],
            claims: vec![ClaimLine {
                namespace: "default".into(),
                name: "whole".into(),
                allocations: vec![AllocationLine {
                    request: "gpu".into(),
                    pool: "node-v100".into(),
                    device: "gpu-0".into(),
                    share_id: Some("s".into()),
                    memory: Some("32Gi".into()),
                    cores: Some("0".into()),
                }],
                pods: vec![],
                cdi_spec: None,
                limits: vec![],
                problem: None,
                used: true,
            }],
            waiting_pods: vec![],
        };
        let text = render(&report);
        assert!(
            text.contains("gpu -> node-v100/gpu-0 share s: whole card (memory 32Gi)"),
            "{text}"
        );
    }

    #[test]
    fn limits_come_from_device_edits_in_order_then_spec_edits_without_paths() {
        let spec = json!({
            "cdiVersion": "0.5.0", "kind": "gpupool.dev/claim",
            "devices": [
                {"name": "a", "containerEdits": {"env": ["CUDA_DEVICE_MEMORY_LIMIT_0=8192m", "PATH=/x"]}},
                {"name": "b", "containerEdits": {"env": ["CUDA_DEVICE_MEMORY_LIMIT_1=4096m"]}}
            ],
            "containerEdits": {"env": ["CUDA_DEVICE_MEMORY_SHARED_CACHE=/c/u/x.cache", "CUDA_TASK_PRIORITY=1"]}
        });
        assert_eq!(
            cdi_limits(&spec),
            [
                "CUDA_DEVICE_MEMORY_LIMIT_0=8192m",
                "CUDA_DEVICE_MEMORY_LIMIT_1=4096m",
                "CUDA_TASK_PRIORITY=1"
            ]
        );
    }

    #[test]
    fn the_latest_warning_about_the_object_is_chosen() {
        let events: Vec<Event> = serde_json::from_value(json!([
            {"metadata": {"name": "e1", "namespace": "default"}, "type": "Warning", "reason": "Old",
             "message": "first", "lastTimestamp": "2026-01-01T00:00:00Z",
             "involvedObject": {"kind": "ResourceClaim", "name": "c", "namespace": "default"}},
            {"metadata": {"name": "e2", "namespace": "default"}, "type": "Warning", "reason": "New",
             "message": "second", "lastTimestamp": "2026-01-01T00:00:05Z",
             "involvedObject": {"kind": "ResourceClaim", "name": "c", "namespace": "default"}},
            {"metadata": {"name": "e3", "namespace": "default"}, "type": "Warning", "reason": "Other",
             "message": "not this", "lastTimestamp": "2026-01-01T00:00:09Z",
             "involvedObject": {"kind": "Pod", "name": "c", "namespace": "default"}}
        ]))
        .unwrap();
        assert_eq!(
            latest_warning(&events, "default", "ResourceClaim", "c").as_deref(),
            Some("New: second")
        );
        assert_eq!(
            latest_warning(&events, "default", "ResourceClaim", "d"),
            None
        );
    }

    #[test]
    fn mig_devices_are_summed_up_under_their_card_and_a_mig_claim_names_its_profile() {
        let card = |i: i64| DeviceLine {
            node: "node-h100".into(),
            device: format!("gpu-{i}"),
            model: "H100-80GB-HBM3".into(),
            memory: "81559Mi".into(),
            compute_weight: Some(989),
            shareable: true,
            card: Some(i),
            mig_profile: None,
            nvlink_domain: Some("nvlink-0000:20:00.0".into()),
        };
        let mig = |i: i64, profile: &str, start: u32| DeviceLine {
            device: format!("gpu-{i}-mig-{}-{start}", profile.replace('.', "-")),
            memory: "10194Mi".into(),
            compute_weight: Some(119),
            shareable: false,
            mig_profile: Some(profile.into()),
            nvlink_domain: None,
            ..card(i)
        };
        let devices = vec![
            card(0),
            mig(0, "1g.10gb", 0),
            mig(0, "1g.10gb", 1),
            mig(0, "3g.40gb", 4),
            card(1),
        ];
        let report = Report {
            devices,
            claims: vec![ClaimLine {
                namespace: "default".into(),
                name: "mig-1g".into(),
                allocations: vec![AllocationLine {
                    request: "gpu".into(),
                    pool: "node-h100".into(),
                    device: "gpu-0-mig-1g-10gb-1".into(),
                    share_id: None,
                    memory: None,
                    cores: None,
                }],
                pods: vec![],
                cdi_spec: None,
                limits: vec![],
                problem: None,
                used: true,
            }],
            waiting_pods: vec![],
        };
        let text = render(&report);
        assert!(
            text.contains("gpu-0   H100-80GB-HBM3   memory 81559Mi  weight 989  shareable  nvlink-0000:20:00.0\n            MIG: 3 placements (1g.10gb x2, 3g.40gb x1)\n    gpu-1 "),
            "{text}"
        );
        assert!(
            !text.contains("gpu-0-mig-1g-10gb-0 "),
            "one line per card: {text}"
        );
        assert!(
            text.contains("gpu -> node-h100/gpu-0-mig-1g-10gb-1: MIG 1g.10gb (a hardware partition, memory 10194Mi)"),
            "{text}"
        );
    }
}

//! The edge of the trace benchmark: a real control plane per run ([`crate::plane`]), the trace's
//! nodes and the driver's slices for them, and the tasks submitted one at a time, each waited for
//! until kube-scheduler binds it or reports it unschedulable.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use futures::{stream, TryStreamExt};
use gpupool_driver::devices::Partitioning;
use gpupool_driver::health::HealthMap;
use gpupool_driver::inventory::fake::fake_inventory;
use gpupool_driver::slices::{build_slices, SliceMode};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim};
use kube::api::{DeleteParams, PostParams};
use kube::{Api, Client};
use serde::Serialize;

use super::{
    capacity_milli, cards_by_model, device_class, models, node_inventory, node_subset, parse_nodes,
    parse_tasks, sample_tasks, task_objects, Account, Mode, Point, Task, TraceError, TraceNode,
};
use crate::plane::{ControlPlane, NodeShape, PlaneError, PlaneOptions};

/// The node list's file name in the trace folder.
pub const NODE_LIST: &str = "openb_node_list_gpu_node.csv";
/// The environment variable naming the trace folder (`openb/` as published).
pub const TRACE_DIR_ENV: &str = "GPUPOOL_TRACE_DIR";
/// How long one task may wait for kube-scheduler's verdict.
const VERDICT_TIMEOUT: Duration = Duration::from_secs(120);
const NAMESPACE: &str = "default";

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Trace(#[from] TraceError),
    #[error(transparent)]
    Plane(#[from] PlaneError),
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{what}: {source}")]
    Kube {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("node {node}: the driver's slice code: {message}")]
    Slices { node: String, message: String },
    #[error("pod {pod}: no verdict from kube-scheduler in {after:?}")]
    NoVerdict { pod: String, after: Duration },
}

fn kube_err(what: impl Into<String>) -> impl FnOnce(kube::Error) -> RunError {
    let what = what.into();
    move |source| RunError::Kube { what, source }
}

/// What one run is.
#[derive(Clone, Debug)]
pub struct RunSpec {
    pub trace_dir: PathBuf,
    /// The task list's variant: `default` reads `openb_pod_list_default.csv`.
    pub trace: String,
    pub mode: Mode,
    pub seed: u64,
    /// The share of the node list used (1: all of it).
    pub node_fraction: f64,
    /// etcd with fsync (slower; the default leaves it off, this run measures placement).
    pub etcd_fsync: bool,
}

/// What one run measured.
#[derive(Clone, Debug, Serialize)]
pub struct RunResult {
    pub trace: String,
    pub mode: Mode,
    pub seed: u64,
    pub nodes: usize,
    pub gpus: u64,
    pub tasks: usize,
    pub unallocated_at_100: Option<f64>,
    pub unallocated_at_130: f64,
    pub placed: usize,
    pub refused: usize,
    pub placed_gpu_tasks: usize,
    pub refused_gpu_tasks: usize,
    pub capacity_milli: u64,
    pub placed_milli: u64,
    /// Tasks decided (bound or refused) per second of the placement loop.
    pub pods_per_second: f64,
    /// kube-scheduler's reasons for the refusals (its message, numbers as `N`), by count.
    pub refusals: BTreeMap<String, usize>,
    pub setup_seconds: f64,
    pub placement_seconds: f64,
    pub curve: Vec<Point>,
}

pub fn read(path: &Path) -> Result<String, RunError> {
    std::fs::read_to_string(path).map_err(|source| RunError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// The trace's nodes (a subset for a short run) and tasks.
pub fn load(
    trace_dir: &Path,
    trace: &str,
    node_fraction: f64,
) -> Result<(Vec<TraceNode>, Vec<Task>), RunError> {
    let node_path = trace_dir.join(NODE_LIST);
    let nodes = parse_nodes(&node_path.display().to_string(), &read(&node_path)?)?;
    let task_path = trace_dir.join(format!("openb_pod_list_{trace}.csv"));
    let tasks = parse_tasks(&task_path.display().to_string(), &read(&task_path)?)?;
    Ok((node_subset(&nodes, node_fraction), tasks))
}

fn progress(message: &str) {
    eprintln!("[gpupool-trace] {message}");
}

/// One run: a fresh plane with the mode's scheduler profile, the cluster, the tasks.
pub async fn run(spec: &RunSpec) -> Result<RunResult, RunError> {
    let (nodes, tasks) = load(&spec.trace_dir, &spec.trace, spec.node_fraction)?;
    let capacity = capacity_milli(&nodes);
    let arrivals = sample_tasks(&tasks, capacity, spec.seed)?;
    let model_names = models(&nodes);
    // Every object first, so that bad input fails before a plane starts.
    let objects = arrivals
        .iter()
        .map(|t| task_objects(t, spec.mode, &model_names))
        .collect::<Result<Vec<_>, _>>()?;

    let setup = Instant::now();
    let mut options = PlaneOptions {
        etcd_unsafe_no_fsync: !spec.etcd_fsync,
        ..Default::default()
    };
    if let Some(config) = spec.mode.scheduler_config() {
        options = options.scheduler_config(config);
    }
    let plane = ControlPlane::start(options).await?;
    let admin = plane.admin_client().await?;
    build_cluster(&plane, &admin, spec.mode, &nodes).await?;
    let setup_seconds = setup.elapsed().as_secs_f64();
    progress(&format!(
        "{} {} seed {}: {} nodes, {} GPUs {:?}, {} tasks; set up in {setup_seconds:.1} s",
        spec.trace,
        spec.mode.name(),
        spec.seed,
        nodes.len(),
        capacity / 1000,
        cards_by_model(&nodes),
        arrivals.len()
    ));

    let pods: Api<Pod> = Api::namespaced(admin.clone(), NAMESPACE);
    let claims: Api<ResourceClaim> = Api::namespaced(admin.clone(), NAMESPACE);
    let mut account = Account::new(capacity);
    let mut refusals = BTreeMap::new();
    let started = Instant::now();
    for (n, (task, objects)) in arrivals.iter().zip(&objects).enumerate() {
        if let Some(claim) = &objects.claim {
            claims
                .create(&PostParams::default(), claim)
                .await
                .map_err(kube_err(format!("creating claim of task {}", task.name)))?;
        }
        let name = objects.pod.metadata.name.clone().unwrap_or_default();
        create_pod(&pods, &objects.pod).await?;
        let refusal = verdict(&pods, &name).await.inspect_err(|_| {
            plane.print_logs(20);
        })?;
        let placed = refusal.is_none();
        if let Some(message) = refusal {
            *refusals.entry(reason(&message)).or_insert(0) += 1;
            // Refused tasks leave, as in the FGD method (a failed task is counted and dropped);
            // left pending, kube-scheduler would retry them on every later change.
            let delete = DeleteParams::default().grace_period(0);
            let _ = pods.delete(&name, &delete).await;
            if objects.claim.is_some() {
                let _ = claims.delete(&name, &delete).await;
            }
        }
        account.record(task, placed);
        if (n + 1) % 500 == 0 {
            progress(&format!(
                "{} tasks, arrived {:.1} %, unallocated {:.2} %, {:.1} pods/s",
                n + 1,
                account.arrived_percent(),
                account.unallocated_percent(),
                (n + 1) as f64 / started.elapsed().as_secs_f64()
            ));
        }
    }
    let placement_seconds = started.elapsed().as_secs_f64();
    plane.check_running()?;
    Ok(RunResult {
        trace: spec.trace.clone(),
        mode: spec.mode,
        seed: spec.seed,
        nodes: nodes.len(),
        gpus: capacity / 1000,
        tasks: arrivals.len(),
        unallocated_at_100: account.unallocated_at_100,
        unallocated_at_130: account.unallocated_percent(),
        placed: account.placed,
        refused: account.refused,
        placed_gpu_tasks: account.placed_gpu_tasks,
        refused_gpu_tasks: account.refused_gpu_tasks,
        capacity_milli: capacity,
        placed_milli: account.placed_milli,
        pods_per_second: arrivals.len() as f64 / placement_seconds,
        refusals,
        setup_seconds,
        placement_seconds,
        curve: account.curve,
    })
}

async fn create_pod(pods: &Api<Pod>, pod: &Pod) -> Result<(), RunError> {
    let name = pod.metadata.name.clone().unwrap_or_default();
    // The namespace's default ServiceAccount is there (the plane waits for it), so a refusal is
    // an error.
    pods.create(&PostParams::default(), pod)
        .await
        .map(|_| ())
        .map_err(kube_err(format!("creating pod {name}")))
}

/// `None` when kube-scheduler bound pod `name`, its message when it reported it unschedulable.
async fn verdict(pods: &Api<Pod>, name: &str) -> Result<Option<String>, RunError> {
    let deadline = Instant::now() + VERDICT_TIMEOUT;
    let mut pause = Duration::from_millis(1);
    loop {
        let pod = pods
            .get(name)
            .await
            .map_err(kube_err(format!("reading pod {name}")))?;
        if let Some(placed) = pod_verdict(&pod) {
            return Ok(placed);
        }
        if Instant::now() >= deadline {
            return Err(RunError::NoVerdict {
                pod: name.to_string(),
                after: VERDICT_TIMEOUT,
            });
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(8));
    }
}

/// A pod's verdict: bound (`Some(None)`), unschedulable (`Some(Some(message))`), or none yet. A
/// claim the scheduler has not seen yet ("not found") is no verdict: it retries when the claim
/// arrives.
pub fn pod_verdict(pod: &Pod) -> Option<Option<String>> {
    if pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .is_some_and(|n| !n.is_empty())
    {
        return Some(None);
    }
    let conditions = pod.status.as_ref()?.conditions.as_ref()?;
    let scheduled = conditions.iter().find(|c| c.type_ == "PodScheduled")?;
    let message = scheduled.message.clone().unwrap_or_default();
    let unschedulable = scheduled.status == "False"
        && scheduled.reason.as_deref() == Some("Unschedulable")
        && !message.contains("not found");
    unschedulable.then_some(Some(message))
}

/// kube-scheduler's message with its numbers as `N`, so that refusals group by reason.
pub fn reason(message: &str) -> String {
    let mut out = String::new();
    let mut in_number = false;
    for c in message.chars() {
        if c.is_ascii_digit() {
            if !in_number {
                out.push('N');
            }
            in_number = true;
        } else {
            in_number = false;
            out.push(c);
        }
    }
    out
}

/// The DeviceClass, the Nodes and the driver's ResourceSlices for them.
async fn build_cluster(
    plane: &ControlPlane,
    admin: &Client,
    mode: Mode,
    nodes: &[TraceNode],
) -> Result<(), RunError> {
    let classes: Api<DeviceClass> = Api::all(admin.clone());
    classes
        .create(&PostParams::default(), &device_class(mode))
        .await
        .map_err(kube_err("creating the trace's DeviceClass"))?;
    let mut slices = Vec::new();
    for node in nodes {
        let base = fake_inventory(&format!("t4:{}", node.gpus), &node.name).map_err(|e| {
            RunError::Slices {
                node: node.name.clone(),
                message: e.to_string(),
            }
        })?;
        let inventory = node_inventory(node, base)?;
        slices.extend(
            build_slices(
                &inventory,
                &node.name,
                &Default::default(),
                &HealthMap::default(),
                1,
                SliceMode::Shared,
                Partitioning::Counters,
            )
            .map_err(|e| RunError::Slices {
                node: node.name.clone(),
                message: e.to_string(),
            })?,
        );
    }
    stream::iter(nodes.iter().map(Ok::<_, RunError>))
        .try_for_each_concurrent(8, |node| async move {
            let shape = NodeShape::new(&node.name)
                .cpu(&format!("{}m", node.cpu_milli))
                .memory(&format!("{}Mi", node.memory_mib))
                .pods(1000)
                .label("gpupool.dev/trace-model", &node.model);
            plane.create_node(admin, &shape).await?;
            Ok(())
        })
        .await?;
    stream::iter(slices.iter().map(Ok::<_, RunError>))
        .try_for_each_concurrent(8, |slice| async move {
            plane
                .publish_slices(admin, std::slice::from_ref(slice))
                .await?;
            Ok(())
        })
        .await?;
    // kube-scheduler's informers see the last objects a moment after they are written.
    tokio::time::sleep(Duration::from_secs(2)).await;
    Ok(())
}

/// Medians etc. are left to the reader of the JSON; this is the mean the FGD paper reports.
pub fn mean(values: impl IntoIterator<Item = f64>) -> Option<f64> {
    let v: Vec<f64> = values.into_iter().collect();
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

/// Sample standard deviation (None below two values).
pub fn sd(values: impl IntoIterator<Item = f64>) -> Option<f64> {
    let v: Vec<f64> = values.into_iter().collect();
    let m = mean(v.iter().copied())?;
    (v.len() > 1)
        .then(|| (v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (v.len() - 1) as f64).sqrt())
}

//! Alibaba's `cluster-trace-gpu-v2023` (the FGD paper's "openb" trace) replayed through the real
//! kube-scheduler (issue 31): what pooling GPUs is worth on a production task mix.
//!
//! This module is the pure part, no I/O: parsing the node and task lists, the FGD method's
//! sampling (tasks drawn with replacement until the arrived GPU request reaches 130 % of the
//! cluster's capacity, then shuffled), each node's fake inventory and each task's Pod and
//! ResourceClaim per mode, and the accounting (unallocated GPU % against arrived %). The runner
//! that drives a control plane with them is [`runner`].

pub mod runner;

use std::collections::BTreeMap;

use gpupool_api::device::published_memory_bytes;
use gpupool_api::inventory::{Gpu, Inventory};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::json;

/// The DeviceClass every trace claim asks through: a gpupool card (no MIG partitions).
pub const CLASS: &str = "trace-gpu.gpupool.dev";
/// The extended resource the class is backed by in [`Mode::SharesPackedExtended`] (KEP-5004).
pub const EXTENDED_RESOURCE: &str = "gpupool.dev/gpu";
/// The FGD method's inflation: tasks arrive until their GPU request is 130 % of capacity.
pub const INFLATION_PERCENT: u64 = 130;
/// One card in GPU-milli.
pub const CARD_MILLI: u64 = 1000;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TraceError {
    #[error("{file}: line {line}: {message}")]
    Parse {
        file: String,
        line: usize,
        message: String,
    },
    #[error("{file}: the header lacks column {column}")]
    MissingColumn { file: String, column: String },
    #[error("node {node}: model {model} has no profile")]
    UnknownModel { node: String, model: String },
    #[error("task {task}: gpu_spec names model {model}, which no node of the cluster has")]
    UnknownSpec { task: String, model: String },
    #[error("the task list has no task with a GPU request: nothing to inflate")]
    NoGpuTasks,
    #[error("unknown mode {0} (whole, shares, shares-packed, shares-packed-extended, shares-affinity, shares-affinity-gpu-packed)")]
    UnknownMode(String),
}

/// One GPU node of `openb_node_list_gpu_node.csv`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TraceNode {
    pub name: String,
    pub cpu_milli: u64,
    pub memory_mib: u64,
    pub gpus: u32,
    pub model: String,
}

/// One task of an `openb_pod_list_*.csv`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Task {
    pub name: String,
    pub cpu_milli: u64,
    pub memory_mib: u64,
    pub num_gpu: u32,
    /// Per card; below 1000 only for a sharing task (`num_gpu` = 1).
    pub gpu_milli: u64,
    /// Models the task may run on (`gpu_spec`, `|`-separated); empty: any.
    pub gpu_spec: Vec<String>,
}

impl Task {
    /// The task's GPU request in GPU-milli (what the FGD method counts as arrived and placed).
    pub fn gpu_request_milli(&self) -> u64 {
        match self.num_gpu {
            0 => 0,
            1 => self.gpu_milli.min(CARD_MILLI),
            n => u64::from(n) * CARD_MILLI,
        }
    }

    pub fn is_sharing(&self) -> bool {
        self.num_gpu == 1 && self.gpu_milli < CARD_MILLI
    }
}

/// Splits a CSV without quoting (the trace has none) into its header's named columns.
fn rows<'a>(
    file: &str,
    text: &'a str,
    columns: &[&str],
) -> Result<Vec<(usize, Vec<&'a str>)>, TraceError> {
    let mut lines = text.lines().enumerate();
    let header: Vec<&str> = lines
        .next()
        .map(|(_, l)| l.trim().split(',').collect())
        .unwrap_or_default();
    // A column named with a leading `?` is optional: absent, it reads as empty.
    let index: Vec<Option<usize>> = columns
        .iter()
        .map(|c| {
            let name = c.trim_start_matches('?');
            match header.iter().position(|h| *h == name) {
                Some(i) => Ok(Some(i)),
                None if c.starts_with('?') => Ok(None),
                None => Err(TraceError::MissingColumn {
                    file: file.to_string(),
                    column: name.to_string(),
                }),
            }
        })
        .collect::<Result<_, _>>()?;
    let mut out = Vec::new();
    for (n, line) in lines {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let fields: Vec<&str> = line.split(',').collect();
        let picked = index
            .iter()
            .map(|&i| {
                let Some(i) = i else { return Ok("") };
                fields.get(i).copied().ok_or_else(|| TraceError::Parse {
                    file: file.to_string(),
                    line: n + 1,
                    message: format!("{} fields, the header has {}", fields.len(), header.len()),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        out.push((n + 1, picked));
    }
    Ok(out)
}

fn number(file: &str, line: usize, column: &str, value: &str) -> Result<u64, TraceError> {
    value.trim().parse().map_err(|_| TraceError::Parse {
        file: file.to_string(),
        line,
        message: format!("{column} is {value:?}, not a whole number"),
    })
}

/// Parses the node list (`sn, cpu_milli, memory_mib, gpu, model`).
pub fn parse_nodes(file: &str, text: &str) -> Result<Vec<TraceNode>, TraceError> {
    let columns = ["sn", "cpu_milli", "memory_mib", "gpu", "model"];
    rows(file, text, &columns)?
        .into_iter()
        .map(|(line, f)| {
            let gpus = number(file, line, "gpu", f[3])?;
            Ok(TraceNode {
                name: f[0].to_string(),
                cpu_milli: number(file, line, "cpu_milli", f[1])?,
                memory_mib: number(file, line, "memory_mib", f[2])?,
                gpus: u32::try_from(gpus).map_err(|_| TraceError::Parse {
                    file: file.to_string(),
                    line,
                    message: format!("gpu is {gpus}"),
                })?,
                model: f[4].trim().to_string(),
            })
        })
        .collect()
}

/// Parses a task list (`name, cpu_milli, memory_mib, num_gpu, gpu_milli, gpu_spec`, the rest
/// ignored: the FGD method replays no times).
pub fn parse_tasks(file: &str, text: &str) -> Result<Vec<Task>, TraceError> {
    let columns = [
        "name",
        "cpu_milli",
        "memory_mib",
        "num_gpu",
        "gpu_milli",
        // The multigpu lists were published without it.
        "?gpu_spec",
    ];
    rows(file, text, &columns)?
        .into_iter()
        .map(|(line, f)| {
            let num_gpu = number(file, line, "num_gpu", f[3])?;
            let gpu_milli = number(file, line, "gpu_milli", f[4])?;
            if num_gpu > 0 && (gpu_milli == 0 || gpu_milli > CARD_MILLI) {
                return Err(TraceError::Parse {
                    file: file.to_string(),
                    line,
                    message: format!("gpu_milli is {gpu_milli} with num_gpu {num_gpu}"),
                });
            }
            let mut gpu_spec: Vec<String> = f[5]
                .split('|')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect();
            gpu_spec.sort();
            gpu_spec.dedup();
            Ok(Task {
                name: f[0].to_string(),
                cpu_milli: number(file, line, "cpu_milli", f[1])?,
                memory_mib: number(file, line, "memory_mib", f[2])?,
                num_gpu: u32::try_from(num_gpu).unwrap_or(u32::MAX),
                gpu_milli,
                gpu_spec,
            })
        })
        .collect()
}

/// Every `1/fraction`-th node, in list order, so that a short run keeps the mix of models (the
/// list is grouped by model). `fraction` 1 keeps all.
pub fn node_subset(nodes: &[TraceNode], fraction: f64) -> Vec<TraceNode> {
    if fraction >= 1.0 {
        return nodes.to_vec();
    }
    let step = (1.0 / fraction.max(1e-6)).round().max(1.0) as usize;
    nodes.iter().step_by(step).cloned().collect()
}

/// The cluster's GPU capacity in GPU-milli.
pub fn capacity_milli(nodes: &[TraceNode]) -> u64 {
    nodes.iter().map(|n| u64::from(n.gpus) * CARD_MILLI).sum()
}

/// The FGD method's arrivals: tasks drawn with replacement (seeded) until their GPU request
/// reaches `INFLATION_PERCENT` of `capacity_milli`, then shuffled.
pub fn sample_tasks(
    tasks: &[Task],
    capacity_milli: u64,
    seed: u64,
) -> Result<Vec<Task>, TraceError> {
    if !tasks.iter().any(|t| t.gpu_request_milli() > 0) {
        return Err(TraceError::NoGpuTasks);
    }
    let target = capacity_milli * INFLATION_PERCENT / 100;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut arrived = 0;
    let mut out = Vec::new();
    while arrived < target {
        let task = &tasks[rng.random_range(0..tasks.len())];
        arrived += task.gpu_request_milli();
        let mut task = task.clone();
        task.name = format!("t{:05}-{}", out.len(), task.name);
        out.push(task);
    }
    out.shuffle(&mut rng);
    Ok(out)
}

/// What a model's fake card offers. Only the model name matters to placement (a share asks for a
/// share of cores and memory, [`share_memory_mib`]); memory and SMs are for the slices' realism.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct CardProfile {
    pub model: &'static str,
    pub product_name: &'static str,
    pub architecture: &'static str,
    pub memory_mib: u64,
    pub multiprocessors: u32,
    pub cuda_cores: u32,
    /// Not a published figure: assumed for an undisclosed model.
    pub assumed: bool,
}

/// The trace's models. P100, T4, V100 and A10 carry the public figures of the PCIe/SXM2 cards;
/// G1, G2 and G3 are undisclosed, so their profiles are assumptions from the nodes that hold
/// them: G2 (8 per node on 96-core, 384 GiB nodes, the bulk of the fleet) as a 32 GiB, 80-SM
/// card of the V100 class; G3 (8 per node on 128-core, 768 GiB nodes) as an 80 GiB, 108-SM card
/// of the A100 class; G1 (in no GPU node of the published list) as G2.
pub const CARD_PROFILES: &[CardProfile] = &[
    card(
        "P100",
        "Tesla P100-PCIE-16GB",
        "Pascal",
        16384,
        56,
        3584,
        false,
    ),
    card("T4", "Tesla T4", "Turing", 15360, 40, 2560, false),
    card(
        "V100M16",
        "Tesla V100-SXM2-16GB",
        "Volta",
        16384,
        80,
        5120,
        false,
    ),
    card(
        "V100M32",
        "Tesla V100-SXM2-32GB",
        "Volta",
        32768,
        80,
        5120,
        false,
    ),
    card("A10", "NVIDIA A10", "Ampere", 23028, 72, 9216, false),
    card(
        "G1",
        "Alibaba G1 (undisclosed)",
        "Unknown",
        32768,
        80,
        5120,
        true,
    ),
    card(
        "G2",
        "Alibaba G2 (undisclosed)",
        "Unknown",
        32768,
        80,
        5120,
        true,
    ),
    card(
        "G3",
        "Alibaba G3 (undisclosed)",
        "Unknown",
        81920,
        108,
        6912,
        true,
    ),
];

const fn card(
    model: &'static str,
    product_name: &'static str,
    architecture: &'static str,
    memory_mib: u64,
    multiprocessors: u32,
    cuda_cores: u32,
    assumed: bool,
) -> CardProfile {
    CardProfile {
        model,
        product_name,
        architecture,
        memory_mib,
        multiprocessors,
        cuda_cores,
        assumed,
    }
}

pub fn card_profile(model: &str) -> Option<&'static CardProfile> {
    CARD_PROFILES.iter().find(|p| p.model == model)
}

/// The fake inventory of `node`: the driver's fake cards (`base`, from
/// `gpupool_driver::inventory::fake`, on `node.name`) given the trace model's name and figures.
/// Devices are published in index order, as the driver does.
pub fn node_inventory(node: &TraceNode, base: Inventory) -> Result<Inventory, TraceError> {
    let profile = card_profile(&node.model).ok_or_else(|| TraceError::UnknownModel {
        node: node.name.clone(),
        model: node.model.clone(),
    })?;
    let gpus = base
        .gpus
        .into_iter()
        .map(|gpu| Gpu {
            product_name: profile.product_name.to_string(),
            model: profile.model.to_string(),
            architecture: profile.architecture.to_string(),
            memory_bytes: profile.memory_mib << 20,
            multiprocessors: profile.multiprocessors,
            cuda_cores: profile.cuda_cores,
            mig: None,
            nvlink_domain: None,
            ..gpu
        })
        .collect();
    Ok(Inventory { gpus, ..base })
}

/// The memory a share asks for: its share of the smallest card it may land on (published
/// memory, in MiB). Cores carry the share exactly (`gpu_milli / 10` %, rounded up to the 1 %
/// step); memory never binds before cores, since the share of the smallest card is at most the
/// same share of any card. A request in bytes cannot say "this share of whichever card".
pub fn share_memory_mib(task: &Task, models: &[&str]) -> Result<u64, TraceError> {
    let eligible: Vec<&str> = if task.gpu_spec.is_empty() {
        models.to_vec()
    } else {
        task.gpu_spec.iter().map(String::as_str).collect()
    };
    let mut smallest = u64::MAX;
    for model in eligible {
        let profile = card_profile(model).ok_or_else(|| TraceError::UnknownSpec {
            task: task.name.clone(),
            model: model.to_string(),
        })?;
        smallest = smallest.min(published_memory_bytes(profile.memory_mib << 20) >> 20);
    }
    Ok((task.gpu_milli * smallest / CARD_MILLI).max(1))
}

/// The modes compared side by side.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// (a) Whole cards only, as a device-plugin cluster runs it: a sharing task takes a card.
    Whole,
    /// (b) gpupool shares, stock kube-scheduler configuration.
    Shares,
    /// (c) shares with the shipped profile: NodeResourcesFit MostAllocated, every node scored.
    SharesPacked,
    /// (c) as `SharesPacked`, and whole-card tasks ask through the class's extended resource, so
    /// NodeResourcesFit also packs by cards allocated.
    SharesPackedExtended,
    /// (c) stock configuration; each share prefers nodes that already run shares (a preferred
    /// pod affinity, InterPodAffinity scoring), so shares gather on few cards' nodes.
    SharesAffinity,
    /// (c) shares with that affinity, whole cards through the extended resource, and
    /// NodeResourcesFit MostAllocated on the extended resource only (cpu and memory unscored).
    SharesAffinityGpuPacked,
}

impl Mode {
    pub const ALL: [Mode; 6] = [
        Mode::Whole,
        Mode::Shares,
        Mode::SharesPacked,
        Mode::SharesPackedExtended,
        Mode::SharesAffinity,
        Mode::SharesAffinityGpuPacked,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Mode::Whole => "whole",
            Mode::Shares => "shares",
            Mode::SharesPacked => "shares-packed",
            Mode::SharesPackedExtended => "shares-packed-extended",
            Mode::SharesAffinity => "shares-affinity",
            Mode::SharesAffinityGpuPacked => "shares-affinity-gpu-packed",
        }
    }

    pub fn parse(s: &str) -> Result<Mode, TraceError> {
        Mode::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| TraceError::UnknownMode(s.to_string()))
    }

    /// The KubeSchedulerConfiguration the mode runs kube-scheduler with (`None`: stock).
    pub fn scheduler_config(self) -> Option<&'static str> {
        match self {
            Mode::Whole | Mode::Shares | Mode::SharesAffinity => None,
            Mode::SharesPacked | Mode::SharesPackedExtended => Some(PACKED_PROFILE),
            Mode::SharesAffinityGpuPacked => Some(GPU_PACKED_PROFILE),
        }
    }

    fn extended(self) -> bool {
        matches!(
            self,
            Mode::SharesPackedExtended | Mode::SharesAffinityGpuPacked
        )
    }

    fn share_affinity(self) -> bool {
        matches!(self, Mode::SharesAffinity | Mode::SharesAffinityGpuPacked)
    }
}

/// The scheduler profile of the packed modes, as deploy/ ships it: NodeResourcesFit MostAllocated
/// on cpu, memory and the DRA-backed extended resource, and every feasible node scored (the
/// default scores a sample of them on a large cluster).
pub const PACKED_PROFILE: &str = include_str!("../../../deploy/scheduler/gpupool-packing.yaml");

/// NodeResourcesFit MostAllocated on the DRA-backed extended resource alone, every node scored.
pub const GPU_PACKED_PROFILE: &str = "apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
percentageOfNodesToScore: 100
profiles:
- schedulerName: default-scheduler
  pluginConfig:
  - name: NodeResourcesFit
    args:
      scoringStrategy:
        type: MostAllocated
        resources:
        - name: gpupool.dev/gpu
          weight: 1
";

/// The label of a share's pod, which the affinity of [`Mode::SharesAffinity`] looks for.
pub const SHARE_LABEL: &str = "gpupool.dev/share";

/// The DeviceClass of the trace's claims; in the extended mode backed by [`EXTENDED_RESOURCE`].
pub fn device_class(mode: Mode) -> DeviceClass {
    let mut spec = json!({"selectors": [{"cel": {"expression":
        "device.driver == \"gpupool.dev\" && device.attributes[\"gpupool.dev\"].type == \"gpu\""}}]});
    if mode.extended() {
        spec["extendedResourceName"] = json!(EXTENDED_RESOURCE);
    }
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
        "metadata": {"name": CLASS}, "spec": spec,
    }))
    .expect("the class literal is a DeviceClass")
}

/// The objects one task becomes: a claim (none for a CPU-only task, or a whole-card task of the
/// extended mode, whose claim the scheduler makes) and the pod.
#[derive(Clone, Debug)]
pub struct TaskObjects {
    pub claim: Option<ResourceClaim>,
    pub pod: Pod,
}

/// The Pod and claim of `task` in `mode`; `models` are the cluster's models (for a share's
/// memory, [`share_memory_mib`]).
pub fn task_objects(task: &Task, mode: Mode, models: &[&str]) -> Result<TaskObjects, TraceError> {
    let name = task.name.to_lowercase().replace('_', "-");
    let mut requests = json!({
        "cpu": format!("{}m", task.cpu_milli),
        "memory": format!("{}Mi", task.memory_mib),
    });
    let mut claim = None;
    let mut pod_claims = Vec::new();
    if task.num_gpu > 0 {
        let selectors = model_selectors(task);
        let share = task.is_sharing() && mode != Mode::Whole;
        if mode.extended() && !share && selectors.is_none() {
            requests[EXTENDED_RESOURCE] = json!(task.num_gpu.to_string());
        } else {
            let mut exactly = json!({
                "deviceClassName": CLASS, "allocationMode": "ExactCount",
                "count": if share { 1 } else { task.num_gpu },
            });
            if let Some(selectors) = selectors {
                exactly["selectors"] = selectors;
            }
            exactly["capacity"] = if share {
                json!({"requests": {
                    "cores": format!("{}", task.gpu_milli.div_ceil(10)),
                    "memory": format!("{}Mi", share_memory_mib(task, models)?),
                }})
            } else {
                // The whole card: all its cores (memory's default is the whole card).
                json!({"requests": {"cores": "100"}})
            };
            claim = Some(
                serde_json::from_value(json!({
                    "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                    "metadata": {"name": name},
                    "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
                }))
                .expect("the claim literal is a ResourceClaim"),
            );
            pod_claims.push(json!({"name": "gpu", "resourceClaimName": name}));
        }
    }
    let mut container = json!({"name": "task", "image": "registry.k8s.io/pause:3.10",
        "resources": {"requests": requests.clone()}});
    if let Some(limits) = requests.get(EXTENDED_RESOURCE) {
        container["resources"]["limits"] = json!({EXTENDED_RESOURCE: limits});
    }
    if !pod_claims.is_empty() {
        container["resources"]["claims"] = json!([{"name": "gpu"}]);
    }
    let mut spec = json!({"containers": [container], "terminationGracePeriodSeconds": 0});
    let mut labels = json!({"gpupool.dev/trace": "task"});
    if task.is_sharing() && mode != Mode::Whole {
        labels[SHARE_LABEL] = json!("true");
        if mode.share_affinity() {
            spec["affinity"] = json!({"podAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": {
                    "labelSelector": {"matchLabels": {SHARE_LABEL: "true"}},
                    "topologyKey": "kubernetes.io/hostname"}}]}});
        }
    }
    if !pod_claims.is_empty() {
        spec["resourceClaims"] = json!(pod_claims);
    }
    let pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": spec,
    }))
    .expect("the pod literal is a Pod");
    Ok(TaskObjects { claim, pod })
}

/// A `gpu_spec` as CEL selectors on the published model (`None`: any model).
fn model_selectors(task: &Task) -> Option<serde_json::Value> {
    if task.gpu_spec.is_empty() {
        return None;
    }
    let list = task
        .gpu_spec
        .iter()
        .map(|m| format!("\"{m}\""))
        .collect::<Vec<_>>()
        .join(", ");
    Some(json!([{"cel": {"expression":
        format!("device.attributes[\"gpupool.dev\"].model in [{list}]")}}]))
}

/// The GPU-milli a placed task counts as used: its request (a sharing task's requested milli in
/// whole-card mode too, as the issue defines mode (a)).
pub fn placed_milli(task: &Task) -> u64 {
    task.gpu_request_milli()
}

/// One point of the curve: after `arrived` tasks' GPU request, what was placed.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Point {
    pub arrived_percent: f64,
    pub unallocated_percent: f64,
}

/// The running account of one run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Account {
    pub capacity_milli: u64,
    pub arrived_milli: u64,
    pub placed_milli: u64,
    pub placed: usize,
    pub refused: usize,
    pub placed_gpu_tasks: usize,
    pub refused_gpu_tasks: usize,
    pub curve: Vec<Point>,
    /// Unallocated % when the arrivals first reached 100 % of capacity.
    pub unallocated_at_100: Option<f64>,
}

impl Account {
    pub fn new(capacity_milli: u64) -> Account {
        Account {
            capacity_milli,
            ..Default::default()
        }
    }

    pub fn unallocated_percent(&self) -> f64 {
        100.0 - 100.0 * self.placed_milli as f64 / self.capacity_milli.max(1) as f64
    }

    pub fn arrived_percent(&self) -> f64 {
        100.0 * self.arrived_milli as f64 / self.capacity_milli.max(1) as f64
    }

    /// Records one task's outcome.
    pub fn record(&mut self, task: &Task, placed: bool) {
        let before = self.arrived_percent();
        self.arrived_milli += task.gpu_request_milli();
        if placed {
            self.placed += 1;
            self.placed_milli += placed_milli(task);
            if task.num_gpu > 0 {
                self.placed_gpu_tasks += 1;
            }
        } else {
            self.refused += 1;
            if task.num_gpu > 0 {
                self.refused_gpu_tasks += 1;
            }
        }
        let after = self.arrived_percent();
        if before < 100.0 && after >= 100.0 && self.unallocated_at_100.is_none() {
            self.unallocated_at_100 = Some(self.unallocated_percent());
        }
        // A point per whole percent of arrivals.
        if after.floor() > before.floor() || self.curve.is_empty() {
            self.curve.push(Point {
                arrived_percent: after,
                unallocated_percent: self.unallocated_percent(),
            });
        }
    }
}

/// The models of `nodes`, each once.
pub fn models(nodes: &[TraceNode]) -> Vec<&str> {
    let set: std::collections::BTreeSet<&str> = nodes.iter().map(|n| n.model.as_str()).collect();
    set.into_iter().collect()
}

/// The counts of each model's cards, for the report.
pub fn cards_by_model(nodes: &[TraceNode]) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for n in nodes {
        *out.entry(n.model.clone()).or_insert(0) += u64::from(n.gpus);
    }
    out
}

#[cfg(test)]
mod tests;

//! `gpupool-mps-check`: the driver's own prepare and unprepare of MPS claims on one machine, with
//! no cluster: what `driver/gpu-check/` runs on a GPU (README.md there), and CI over the stand-in
//! `nvidia-cuda-mps-control`.
//!
//! ```text
//! gpupool-mps-check prepare   --dir DIR --cores 30,70 [--memory-mib N] [--device gpu-0] [node options]
//! gpupool-mps-check clients   --dir DIR [node options]
//! gpupool-mps-check unprepare --dir DIR [node options]
//! gpupool-mps-check exec      --spec FILE --device NAME [--uid N] -- COMMAND [ARG...]
//! ```
//!
//! `prepare` prepares one claim per `--cores` entry, each a share of the device with
//! `compute: Mps`, through `ClaimPreparer` (limits, node guard, the card's MPS daemon, CDI spec,
//! checkpoint) and exits with the daemon running; `unprepare` is a later start of the driver
//! (it adopts the daemon) that unprepares them all and checks that no daemon, server or folder is
//! left. `exec` runs a command the way a container runtime would with the spec's device: its
//! variables, and its mounts in a mount namespace of its own. Each prints JSON lines.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use gpupool_api::claim::ClaimRef;
use gpupool_driver::mps::layout::{mps_root, DaemonDirs};
use gpupool_driver::mps::{control, daemon, MpsSettings};
use gpupool_driver::node_state::checkpoint;
use gpupool_driver::node_state::NodeLayout;
use gpupool_driver::prepare::{ClaimPreparer, DefaultEnforcement, DriverLibraries, PrepareOptions};
use serde_json::{json, Value};

const NODE: &str = "gpu-check";
const NAMESPACE: &str = "gpu-check";

#[derive(Parser)]
#[command(
    name = "gpupool-mps-check",
    about = "The driver's MPS handling on one machine, without a cluster"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args, Clone)]
struct NodeArgs {
    /// Folder of the node's state, CDI specs and run files (short: the daemon's socket path is
    /// under it and may be at most 107 bytes).
    #[arg(long)]
    dir: PathBuf,
    /// Fake GPUs (as `gpupool-driver run --fake-gpus`) instead of NVML.
    #[arg(long)]
    fake_gpus: Option<String>,
    #[arg(long, default_value = gpupool_driver::mps::CONTROL_BINARY)]
    mps_control: PathBuf,
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    mps_multi_user: bool,
}

#[derive(Subcommand)]
enum Command {
    /// Prepare one MPS share of the device per `--cores` entry.
    Prepare {
        #[command(flatten)]
        node: NodeArgs,
        /// The shares' cores (percent), comma-separated.
        #[arg(long, value_delimiter = ',', required = true)]
        cores: Vec<u32>,
        /// Memory of each share in MiB (default: the card's memory split evenly).
        #[arg(long)]
        memory_mib: Option<u64>,
        #[arg(long, default_value = "gpu-0")]
        device: String,
    },
    /// The daemons' servers and their clients, as the control pipe lists them.
    Clients {
        #[command(flatten)]
        node: NodeArgs,
    },
    /// Unprepare every claim the checkpoint holds and check that nothing is left.
    Unprepare {
        #[command(flatten)]
        node: NodeArgs,
    },
    /// Run a command with a CDI device's variables and mounts.
    Exec {
        #[arg(long)]
        spec: PathBuf,
        /// The CDI device: its name, or `gpupool.dev/claim=<name>`.
        #[arg(long)]
        device: String,
        /// Run the command as this user (and group).
        #[arg(long)]
        uid: Option<u32>,
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
}

fn emit(value: Value) {
    println!("{value}");
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Exec {
            spec,
            device,
            uid,
            command,
        } => exec(&spec, &device, uid, &command),
        Command::Clients { node } => clients(&node),
        command => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())
            .and_then(|rt| rt.block_on(run(command))),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            emit(json!({"op": "error", "error": e}));
            ExitCode::from(2)
        }
    }
}

fn layout(node: &NodeArgs) -> NodeLayout {
    NodeLayout {
        mps: MpsSettings {
            control: node.mps_control.clone(),
            multi_user: node.mps_multi_user,
        },
        ..NodeLayout::new(
            node.dir.join("state"),
            node.dir.join("cdi"),
            node.dir.join("run"),
            (&node.dir.join("libs/gpupool"), &node.dir.join("libs/vgpu")),
            node.fake_gpus.is_some(),
        )
    }
}

async fn preparer(
    node: &NodeArgs,
    claims: Vec<k8s_openapi::api::resource::v1::ResourceClaim>,
) -> Result<
    (
        ClaimPreparer,
        Arc<gpupool_driver::prepare::offline::StaticClaims>,
        Arc<gpupool_api::inventory::Inventory>,
    ),
    String,
> {
    let inventory = Arc::new(
        gpupool_driver::inventory::discover(node.fake_gpus.as_deref(), NODE)
            .map_err(|e| e.to_string())?,
    );
    let opts = PrepareOptions {
        node_name: NODE.to_string(),
        layout: layout(node),
        // The driver libraries are the host's own here: no container runtime injects them.
        driver_libraries: DriverLibraries::None,
        mig: gpupool_driver::node_state::MigCards {
            manager: Arc::new(NoMig),
            cards: Vec::new(),
        },
        default_enforcement: DefaultEnforcement::Auto,
        status_write_delay: std::time::Duration::ZERO,
    };
    let (preparer, api) = ClaimPreparer::offline(opts, inventory.clone(), claims)
        .await
        .map_err(|e| format!("start-up: {e}"))?;
    Ok((preparer, api, inventory))
}

/// No MIG here: the check never asks for a MIG device.
#[derive(Debug)]
struct NoMig;

impl gpupool_driver::mig::MigManager for NoMig {
    fn mig_enabled(&self, _: &str) -> Result<bool, gpupool_driver::mig::MigError> {
        Ok(false)
    }
    fn set_mig_enabled(&self, card: &str, _: bool) -> Result<(), gpupool_driver::mig::MigError> {
        Err(no_mig(card))
    }
    fn create_gpu_instance(
        &self,
        p: &gpupool_driver::mig::Placement,
    ) -> Result<u32, gpupool_driver::mig::MigError> {
        Err(no_mig(&p.parent_uuid))
    }
    fn create_compute_instance(
        &self,
        card: &str,
        _: u32,
        _: u32,
    ) -> Result<gpupool_driver::mig::ComputeInstance, gpupool_driver::mig::MigError> {
        Err(no_mig(card))
    }
    fn destroy_compute_instance(
        &self,
        card: &str,
        _: u32,
        _: u32,
    ) -> Result<(), gpupool_driver::mig::MigError> {
        Err(no_mig(card))
    }
    fn destroy_gpu_instance(
        &self,
        card: &str,
        _: u32,
    ) -> Result<(), gpupool_driver::mig::MigError> {
        Err(no_mig(card))
    }
    fn gpu_instances(
        &self,
        _: &str,
    ) -> Result<Vec<gpupool_driver::mig::GpuInstance>, gpupool_driver::mig::MigError> {
        Ok(Vec::new())
    }
}

fn no_mig(card: &str) -> gpupool_driver::mig::MigError {
    gpupool_driver::mig::MigError::new(
        format!("MIG on {card}"),
        gpupool_driver::mig::MigErrorKind::Failed("not part of the MPS check".into()),
    )
}

/// A claim of one share of `device` with `compute: Mps`, allocated and reserved as the scheduler
/// and the kubelet leave it.
fn mps_claim(name: &str, device: &str, memory_mib: u64, cores: u32) -> Value {
    let uid = uuid::Uuid::new_v4().to_string();
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": uid, "resourceVersion": "1"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpupool.dev"}}]}},
        "status": {
            "allocation": {"devices": {
                "results": [{
                    "request": "gpu", "driver": gpupool_api::names::DRIVER_NAME, "pool": NODE,
                    "device": device, "shareID": uuid::Uuid::new_v4().to_string(),
                    "consumedCapacity": {"memory": format!("{memory_mib}Mi"), "cores": cores.to_string()},
                }],
                "config": [{
                    "source": "FromClaim", "requests": ["gpu"],
                    "opaque": {"driver": gpupool_api::names::DRIVER_NAME, "parameters": {
                        "apiVersion": gpupool_api::names::API_GROUP_VERSION, "kind": "GpuConfig",
                        "compute": "Mps",
                    }},
                }],
            }},
            "reservedFor": [{"resource": "pods", "name": name, "uid": uuid::Uuid::new_v4().to_string()}],
        },
    })
}

async fn run(command: Command) -> Result<bool, String> {
    match command {
        Command::Prepare {
            node,
            cores,
            memory_mib,
            device,
        } => prepare(&node, &cores, memory_mib, &device).await,
        Command::Unprepare { node } => unprepare(&node).await,
        Command::Clients { .. } | Command::Exec { .. } => unreachable!("run without a runtime"),
    }
}

async fn prepare(
    node: &NodeArgs,
    cores: &[u32],
    memory_mib: Option<u64>,
    device: &str,
) -> Result<bool, String> {
    let inventory = gpupool_driver::inventory::discover(node.fake_gpus.as_deref(), NODE)
        .map_err(|e| e.to_string())?;
    let gpu = gpupool_driver::devices::find(&inventory, device)
        .ok_or_else(|| format!("no {device} on this machine"))?
        .gpu
        .clone();
    let memory_mib = memory_mib.unwrap_or((gpu.memory_bytes >> 20) / (cores.len() as u64 + 1));
    let claims: Vec<Value> = cores
        .iter()
        .map(|c| mps_claim(&format!("mps-{c}"), device, memory_mib, *c))
        .collect();
    let objects = claims
        .iter()
        .map(|c| serde_json::from_value(c.clone()).map_err(|e| e.to_string()))
        .collect::<Result<Vec<_>, _>>()?;
    let (preparer, api, _) = preparer(node, objects).await?;
    emit(
        json!({"op": "gpu", "device": device, "uuid": gpu.uuid, "model": gpu.model,
                "computeCapability": gpu.cuda_compute_capability, "memoryMiB": gpu.memory_bytes >> 20}),
    );
    let refs: Vec<ClaimRef> = claims
        .iter()
        .map(|c| ClaimRef {
            namespace: NAMESPACE.into(),
            name: c["metadata"]["name"].as_str().unwrap_or_default().into(),
            uid: c["metadata"]["uid"].as_str().unwrap_or_default().into(),
        })
        .collect();
    let mut ok = true;
    // One at a time, as pods arrive: the first starts the daemon, the next joins it.
    for (claim, cores) in refs.iter().zip(cores) {
        let answer = preparer.prepare(vec![claim.clone()]).await.remove(0).1;
        preparer.flush_status_writes().await;
        match answer {
            Ok(devices) => {
                let name = devices
                    .first()
                    .and_then(|d| d.cdi_device_ids.first())
                    .cloned()
                    .unwrap_or_default();
                let status = api.device_status(&claim.namespace, &claim.name);
                let ready = status
                    .first()
                    .and_then(|s| s.conditions.as_ref()?.first().map(|c| c.message.clone()));
                let data = status
                    .first()
                    .and_then(|s| s.data.as_ref())
                    .map(|d| d.0.clone());
                emit(json!({
                    "op": "prepared", "claim": claim.name, "uid": claim.uid, "cores": cores,
                    "memoryMiB": memory_mib, "cdiDevice": name,
                    "spec": node.dir.join("cdi").join(gpupool_api::names::cdi_spec_file_name(&claim.uid)),
                    "ready": ready, "data": data,
                }));
            }
            Err(e) => {
                ok = false;
                emit(json!({"op": "prepared", "claim": claim.name, "error": e.to_string()}));
            }
        }
    }
    let daemons = preparer.read_checkpoint(|data| serde_json::to_value(&data.mps));
    emit(json!({"op": "daemons", "daemons": daemons.unwrap_or(Value::Null)}));
    preparer
        .compact_checkpoint()
        .await
        .map_err(|e| e.to_string())?;
    Ok(ok)
}

fn clients(node: &NodeArgs) -> Result<bool, String> {
    let data = checkpoint::load(&node.dir.join("state"))
        .map_err(|e| e.to_string())?
        .unwrap_or_default();
    let mut ok = true;
    for (card, record) in &data.mps {
        let dirs = DaemonDirs::of(&node.dir.join("run"), card).map_err(|e| e.to_string())?;
        let listed = control::servers(&node.mps_control, &dirs).and_then(|servers| {
            servers
                .into_iter()
                .map(|s| {
                    control::clients(&node.mps_control, &dirs, s)
                        .map(|c| json!({"pid": s, "clients": c}))
                })
                .collect::<Result<Vec<_>, _>>()
        });
        let log = std::fs::read_to_string(dirs.log.join(daemon::CONTROL_LOG)).unwrap_or_default();
        let tail: Vec<&str> = log
            .lines()
            .rev()
            .take(30)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        match listed {
            Ok(servers) => emit(
                json!({"op": "clients", "card": card, "daemon": record.pid, "servers": servers, "log": tail}),
            ),
            Err(e) => {
                ok = false;
                emit(json!({"op": "clients", "card": card, "error": e.to_string(), "log": tail}));
            }
        }
    }
    Ok(ok)
}

async fn unprepare(node: &NodeArgs) -> Result<bool, String> {
    let (preparer, _, _) = preparer(node, Vec::new()).await?;
    let claims: Vec<ClaimRef> = preparer.read_checkpoint(|data| {
        data.claims
            .iter()
            .map(|(uid, e)| ClaimRef {
                namespace: e.namespace.clone(),
                name: e.name.clone(),
                uid: uid.clone(),
            })
            .collect()
    });
    let mut ok = true;
    for (claim, answer) in preparer.unprepare(claims).await {
        ok &= answer.is_ok();
        emit(json!({"op": "unprepared", "claim": claim.name,
                    "error": answer.err().map(|e| e.to_string())}));
    }
    preparer
        .compact_checkpoint()
        .await
        .map_err(|e| e.to_string())?;
    let data = checkpoint::load(&node.dir.join("state"))
        .map_err(|e| e.to_string())?
        .unwrap_or_default();
    let run = node.dir.join("run");
    let daemon_name = node
        .mps_control
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let daemons = daemon::daemons_under(&run, &daemon_name);
    let servers = daemon::processes_under(&run, daemon::SERVER_NAME);
    let folders: Vec<String> = std::fs::read_dir(mps_root(&run))
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.path().display().to_string())
                .collect()
        })
        .unwrap_or_default();
    let clean = data.claims.is_empty()
        && data.mps.is_empty()
        && daemons.is_empty()
        && servers.is_empty()
        && folders.is_empty();
    emit(
        json!({"op": "cleanup", "ok": clean, "claims": data.claims.len(), "records": data.mps.len(),
                "daemons": daemons, "servers": servers, "folders": folders}),
    );
    Ok(ok && clean)
}

/// What a container runtime does with a CDI device, minus the rootfs: the spec's and the device's
/// variables over this environment, their mounts bound in a mount namespace of the command's own.
/// A mount whose container path is missing here is created (and removed afterwards) when it is a
/// folder, and refused when it is a file.
fn exec(spec: &Path, device: &str, uid: Option<u32>, command: &[String]) -> Result<bool, String> {
    let bytes = std::fs::read(spec).map_err(|e| format!("{}: {e}", spec.display()))?;
    let spec: gpupool_api::cdi::Spec =
        serde_json::from_slice(&bytes).map_err(|e| format!("not a CDI spec: {e}"))?;
    let name = device.rsplit_once('=').map_or(device, |(_, n)| n);
    let found = spec
        .devices
        .iter()
        .find(|d| d.name == name)
        .ok_or_else(|| format!("no device {name} in the spec"))?;
    let edits = [&spec.container_edits, &found.container_edits];
    let mut created = Vec::new();
    let mut mounts = Vec::new();
    for mount in edits.iter().flat_map(|e| &e.mounts) {
        let (source, target) = (
            Path::new(&mount.host_path),
            Path::new(&mount.container_path),
        );
        if !target.exists() {
            if !source.is_dir() {
                return Err(format!(
                    "{} is missing here and is not a folder",
                    target.display()
                ));
            }
            std::fs::create_dir_all(target).map_err(|e| format!("{}: {e}", target.display()))?;
            created.push(target.to_path_buf());
        }
        let c = |p: &Path| CString::new(p.as_os_str().as_bytes()).map_err(|e| e.to_string());
        mounts.push((c(source)?, c(target)?));
    }
    let mut child = std::process::Command::new(&command[0]);
    child.args(&command[1..]);
    for var in edits.iter().flat_map(|e| &e.env) {
        if let Some((key, value)) = var.split_once('=') {
            child.env(key, value);
        }
    }
    // SAFETY: between fork and exec only system calls on strings prepared before.
    unsafe {
        child.pre_exec(move || {
            let check = |rc: libc::c_int| {
                if rc == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            };
            check(libc::unshare(libc::CLONE_NEWNS))?;
            check(libc::mount(
                std::ptr::null(),
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ))?;
            for (source, target) in &mounts {
                check(libc::mount(
                    source.as_ptr(),
                    target.as_ptr(),
                    std::ptr::null(),
                    libc::MS_BIND | libc::MS_REC,
                    std::ptr::null(),
                ))?;
            }
            if let Some(uid) = uid {
                check(libc::setgroups(0, std::ptr::null()))?;
                check(libc::setgid(uid))?;
                check(libc::setuid(uid))?;
            }
            Ok(())
        });
    }
    let status = child.status().map_err(|e| format!("{}: {e}", command[0]));
    for dir in created.iter().rev() {
        let _ = std::fs::remove_dir(dir);
    }
    Ok(status?.success())
}

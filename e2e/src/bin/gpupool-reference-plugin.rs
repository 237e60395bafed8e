//! `gpupool-reference-plugin`: what a DRA driver built on upstream's Go `kubeletplugin` helper does
//! per call, and nothing more, so that `gpupool-bench --reference` can measure gpupool against it
//! side by side: same API server emulator and costs, same kubelet emulator, same sockets and gRPC
//! stack (the driver library's servers).
//!
//! Per prepare: one quorum GET of the claim (no `resourceVersion`, as the helper's
//! `ResourceClaims(ns).Get` does), a check of its UID and allocation, a CDI spec written as
//! container-device-interface's `Spec.Write` does (temp file, rename; no fsync), and the plugin's
//! checkpoint of prepared claims rewritten as the kubelet's `checkpointmanager` does (temp file,
//! fsync, rename). No status write. Per unprepare: the spec removed and the checkpoint rewritten;
//! no API call. Calls are serialized, as the helper does by default. The bench only: not a driver.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use gpupool_api::claim::{ClaimRef, PreparedDevice};
use gpupool_api::names::DRIVER_NAME;
use gpupool_driver::health::HealthMap;
use gpupool_driver::plugin::health::HealthService;
use gpupool_driver::plugin::registration::RegistrationService;
use gpupool_driver::plugin::{server, PrepareResults, Preparer, UnprepareResults};
use gpupool_driver::prepare::{PrepareError, PrepareErrorKind};
use gpupool_e2e::harness::REFERENCE_USER_AGENT;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};
use tokio_util::sync::CancellationToken;

const CHECKPOINT: &str = "checkpoint";

#[derive(Parser, Debug)]
#[command(about = "A minimal DRA kubelet plugin as upstream's Go helper makes one (bench only)")]
struct Args {
    #[arg(long)]
    node_name: String,
    #[arg(long)]
    kubeconfig: PathBuf,
    #[arg(long)]
    registry_dir: PathBuf,
    #[arg(long)]
    plugin_dir: PathBuf,
    #[arg(long)]
    cdi_root: PathBuf,
    #[arg(long)]
    state_dir: PathBuf,
    /// Write the checkpoint without fsync: what the reference costs where a flush is nearly
    /// free, to tell its disk's cost apart from its API requests (the bench passes this through
    /// the environment).
    #[arg(long, env = "GPUPOOL_REFERENCE_NO_FSYNC")]
    no_fsync: bool,
}

struct Reference {
    api: Client,
    pool: String,
    cdi_root: PathBuf,
    state_dir: PathBuf,
    sync: bool,
    /// The prepared claims (the checkpoint's content); held for a whole call: the helper
    /// serializes calls.
    prepared: tokio::sync::Mutex<BTreeMap<String, Vec<PreparedDevice>>>,
}

fn failed(claim: &ClaimRef, why: impl std::fmt::Display) -> PrepareError {
    PrepareError::new(claim, PrepareErrorKind::Internal(why.to_string()))
}

impl Reference {
    async fn prepare_claim(
        &self,
        prepared: &mut BTreeMap<String, Vec<PreparedDevice>>,
        claim: &ClaimRef,
    ) -> Result<Vec<PreparedDevice>, PrepareError> {
        if let Some(devices) = prepared.get(&claim.uid) {
            return Ok(devices.clone());
        }
        let api: Api<ResourceClaim> = Api::namespaced(self.api.clone(), &claim.namespace);
        let read = api.get(&claim.name).await.map_err(|e| failed(claim, e))?;
        if read.metadata.uid.as_deref() != Some(claim.uid.as_str()) {
            return Err(failed(claim, "the claim has another UID"));
        }
        let results = read
            .status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .and_then(|a| a.devices.as_ref())
            .and_then(|d| d.results.clone())
            .unwrap_or_default();
        let devices: Vec<PreparedDevice> = results
            .iter()
            .filter(|r| r.driver == DRIVER_NAME && r.pool == self.pool)
            .map(|r| PreparedDevice {
                request_names: vec![r.request.clone()],
                pool_name: r.pool.clone(),
                device_name: r.device.clone(),
                cdi_device_ids: vec![format!("{DRIVER_NAME}/gpu={}-{}", claim.uid, r.device)],
                share_id: r.share_id.clone(),
            })
            .collect();
        if devices.is_empty() {
            return Err(failed(claim, "not allocated on this node"));
        }
        let spec = serde_json::json!({
            "cdiVersion": "0.6.0",
            "kind": format!("{DRIVER_NAME}/gpu"),
            "devices": devices.iter().map(|d| serde_json::json!({
                "name": format!("{}-{}", claim.uid, d.device_name),
                "containerEdits": {"env": [format!("GPU_DEVICE={}", d.device_name)]},
            })).collect::<Vec<_>>(),
        });
        let (cdi_root, uid) = (self.cdi_root.clone(), claim.uid.clone());
        prepared.insert(claim.uid.clone(), devices.clone());
        let checkpoint = serde_json::to_vec(&*prepared).expect("plain JSON");
        let (state_dir, sync) = (self.state_dir.clone(), self.sync);
        let written = tokio::task::spawn_blocking(move || {
            write_file(
                &cdi_root,
                &spec_name(&uid),
                &serde_json::to_vec(&spec)?,
                false,
            )?;
            write_file(&state_dir, CHECKPOINT, &checkpoint, sync)
        })
        .await
        .expect("file writes do not panic");
        if let Err(e) = written {
            prepared.remove(&claim.uid);
            return Err(failed(claim, e));
        }
        Ok(devices)
    }

    async fn unprepare_claim(
        &self,
        prepared: &mut BTreeMap<String, Vec<PreparedDevice>>,
        claim: &ClaimRef,
    ) -> Result<(), PrepareError> {
        if prepared.remove(&claim.uid).is_none() {
            return Ok(());
        }
        let checkpoint = serde_json::to_vec(&*prepared).expect("plain JSON");
        let (cdi_root, state_dir, uid, sync) = (
            self.cdi_root.clone(),
            self.state_dir.clone(),
            claim.uid.clone(),
            self.sync,
        );
        tokio::task::spawn_blocking(move || {
            match std::fs::remove_file(cdi_root.join(spec_name(&uid))) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
            write_file(&state_dir, CHECKPOINT, &checkpoint, sync)
        })
        .await
        .expect("file writes do not panic")
        .map_err(|e| failed(claim, e))
    }
}

fn spec_name(uid: &str) -> String {
    format!("{DRIVER_NAME}-claim_{uid}.json")
}

/// Temp file in the same folder, fsync when `sync` (the checkpoint manager does, CDI's writer
/// does not), rename.
fn write_file(dir: &Path, name: &str, bytes: &[u8], sync: bool) -> std::io::Result<()> {
    let temp = dir.join(format!(".{name}.tmp"));
    let mut file = std::fs::File::create(&temp)?;
    file.write_all(bytes)?;
    if sync {
        file.sync_all()?;
    }
    drop(file);
    std::fs::rename(&temp, dir.join(name))
}

#[tonic::async_trait]
impl Preparer for Reference {
    async fn prepare(&self, claims: Vec<ClaimRef>) -> PrepareResults {
        let mut prepared = self.prepared.lock().await;
        let mut answers = Vec::with_capacity(claims.len());
        for claim in claims {
            let answer = self.prepare_claim(&mut prepared, &claim).await;
            answers.push((claim, answer));
        }
        answers
    }

    async fn unprepare(&self, claims: Vec<ClaimRef>) -> UnprepareResults {
        let mut prepared = self.prepared.lock().await;
        let mut answers = Vec::with_capacity(claims.len());
        for claim in claims {
            let answer = self.unprepare_claim(&mut prepared, &claim).await;
            answers.push((claim, answer));
        }
        answers
    }
}

async fn client(kubeconfig: &Path) -> anyhow::Result<Client> {
    let parsed = Kubeconfig::read_from(kubeconfig)
        .with_context(|| format!("reading {}", kubeconfig.display()))?;
    let mut config = Config::from_custom_kubeconfig(parsed, &KubeConfigOptions::default()).await?;
    config.headers.push((
        tonic::codegen::http::header::USER_AGENT,
        tonic::codegen::http::HeaderValue::from_static(REFERENCE_USER_AGENT),
    ));
    Ok(Client::try_from(config)?)
}

async fn run(args: Args) -> anyhow::Result<()> {
    for dir in [
        &args.registry_dir,
        &args.plugin_dir,
        &args.cdi_root,
        &args.state_dir,
    ] {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let reference = Reference {
        api: client(&args.kubeconfig).await?,
        pool: args.node_name.clone(),
        cdi_root: args.cdi_root.clone(),
        state_dir: args.state_dir.clone(),
        sync: !args.no_fsync,
        prepared: Default::default(),
    };
    let stop = CancellationToken::new();
    let (_health_tx, health_rx) = tokio::sync::watch::channel(HealthMap::default());
    let dra_socket = args.plugin_dir.join("dra.sock");
    let dra = server::serve_dra(
        &dra_socket,
        Arc::new(reference),
        HealthService::new(args.node_name.clone(), health_rx, stop.clone()),
        stop.clone(),
    )?;
    let (outcome_tx, _outcome_rx) = tokio::sync::watch::channel(None);
    let registration = server::serve_registration(
        &args.registry_dir.join(format!("{DRIVER_NAME}-reg.sock")),
        RegistrationService::new(dra_socket.to_string_lossy(), outcome_tx),
        stop.clone(),
    )?;
    // Served until the bench kills the process.
    registration.finish().await?;
    dra.finish().await?;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // Two workers: a Go program on this machine runs with GOMAXPROCS=2.
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(run(args))
}

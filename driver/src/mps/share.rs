//! MPS shares (pure): which claims may use MPS, what their containers get, and the limits the
//! card's daemon itself holds.
//!
//! A share's SMs: `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` = its `cores` in the container. A client's
//! variable can only lower what its server allows, and a process may change its own environment,
//! so the daemon also holds a ceiling through its control pipe: the largest share prepared on the
//! card (`set_default_active_thread_percentage`, and `set_active_thread_percentage` for a server
//! already running). With one MPS claim on a card that ceiling is its share exactly; with several,
//! no process exceeds the largest.
//!
//! Memory: the enforcement library keeps the container-wide limit (`CUDA_DEVICE_MEMORY_LIMIT_<i>`,
//! every process of the container together). MPS's pinned-memory limit counts per client process,
//! so it is set to the same number as a backstop for each process alone
//! (`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=<i>=<MiB>M`, and the card's largest share as the daemon's
//! default): the library's limit is the one that holds the container, MPS's the one that holds a
//! process the library does not see (a static binary, `enforcement: None`). The SM limit of the
//! library is written as 0 (none): two limiters on one share would each take their cut.

use std::path::PathBuf;

use gpupool_api::config::{Compute, EffectiveConfig};
use gpupool_api::inventory::Gpu;
use gpupool_api::names::MEMORY_STEP_BYTES;

use super::layout::{DaemonDirs, CONTAINER_PIPE_DIR, CONTAINER_SHM_DIR};
use crate::devices::{DeviceKind, NodeDevice};
use crate::node_state::checkpoint::MpsHold;
use crate::prepare::claim::AllocatedDevice;
use crate::prepare::limits::{DeviceLimits, LimitsError};

pub const PIPE_DIRECTORY_ENV: &str = "CUDA_MPS_PIPE_DIRECTORY";
pub const ACTIVE_THREAD_PERCENTAGE_ENV: &str = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE";
pub const PINNED_MEMORY_LIMIT_ENV: &str = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT";
/// The oldest architecture whose MPS partitions SMs by percentage (and serves other users with `-M`).
pub const MIN_COMPUTE_CAPABILITY: (u32, u32) = (7, 0);

fn major_minor(capability: &str) -> Option<(u32, u32)> {
    let (major, minor) = capability.split_once('.')?;
    Some((major.parse().ok()?, minor.parse().ok()?))
}

/// The claim's MPS share when its config asks for one, after the checks MPS needs: one device,
/// a card (not a MIG device) of Volta or newer, and SMs reserved (`cores`) unless it holds the
/// whole card. Each refusal names the `compute` field that asked.
pub fn check(
    devices: &[(AllocatedDevice, NodeDevice<'_>, EffectiveConfig)],
    limits: &[DeviceLimits],
) -> Result<Option<MpsHold>, LimitsError> {
    let Some(((allocated, device, config), limit)) = devices
        .iter()
        .zip(limits)
        .find(|((_, _, config), _)| config.config.compute == Some(Compute::Mps))
    else {
        return Ok(None);
    };
    let refuse = |message: String| LimitsError::Override {
        field: config
            .compute_field
            .clone()
            .unwrap_or_else(|| "compute".into()),
        message,
    };
    if devices.len() > 1 {
        let names: Vec<&str> = devices.iter().map(|(d, ..)| d.device.as_str()).collect();
        return Err(refuse(format!(
            "Mps, but the claim has {} devices ({}): a container reaches one MPS control daemon, \
             which serves one card; ask for one device",
            devices.len(),
            names.join(", ")
        )));
    }
    if let DeviceKind::Mig { profile, .. } = device.kind {
        return Err(refuse(format!(
            "Mps, but {} is MIG {}: its partition is already the limit; MPS is for shares of a card",
            allocated.device, profile.name
        )));
    }
    let gpu = device.gpu;
    if major_minor(&gpu.cuda_compute_capability).is_none_or(|c| c < MIN_COMPUTE_CAPABILITY) {
        return Err(refuse(format!(
            "Mps, but {} ({}) has compute capability {:?}: MPS partitions SMs from 7.0 (Volta) on",
            allocated.device, gpu.model, gpu.cuda_compute_capability
        )));
    }
    if limit.cores == 0 && !holds_whole_card(gpu, limit) {
        return Err(refuse(format!(
            "Mps, but the share of {} reserves no SMs (cores 0), and MPS takes the share's SMs \
             from cores: ask for cores, or leave compute unset",
            allocated.device
        )));
    }
    Ok(Some(hold(allocated, gpu, limit)))
}

fn holds_whole_card(gpu: &Gpu, limit: &DeviceLimits) -> bool {
    limit.memory_bytes >= gpu.memory_bytes / MEMORY_STEP_BYTES * MEMORY_STEP_BYTES
}

/// The MPS share of a device [`check`] accepted: its `cores`, all SMs for a whole card that
/// reserved none, and its memory.
pub fn hold(allocated: &AllocatedDevice, gpu: &Gpu, limit: &DeviceLimits) -> MpsHold {
    MpsHold {
        card: gpu.uuid.clone(),
        device: allocated.device.clone(),
        percentage: match limit.cores {
            0 => 100,
            cores => cores.min(100),
        },
        memory_mib: limit.memory_mib(),
    }
}

/// What a container of an MPS share gets: the variables, and the mounts as (host, container).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerEdits {
    pub env: Vec<String>,
    pub mounts: Vec<(PathBuf, ContainerPath)>,
}

/// The edits of the share at CUDA ordinal `ordinal`, served by the daemon in `dirs`: the pipe
/// folder where the daemon has it (its servers and clients then name every socket alike) and at
/// CUDA's default (a process that drops the variable still reaches the daemon), the daemon's
/// `/dev/shm` as the container's.
pub fn container_edits(hold: &MpsHold, ordinal: usize, dirs: &DaemonDirs) -> ContainerEdits {
    ContainerEdits {
        env: vec![
            format!("{PIPE_DIRECTORY_ENV}={}", dirs.pipe.display()),
            format!("{ACTIVE_THREAD_PERCENTAGE_ENV}={}", hold.percentage),
            format!("{PINNED_MEMORY_LIMIT_ENV}={ordinal}={}M", hold.memory_mib),
        ],
        mounts: vec![
            (dirs.pipe.clone(), ContainerPath::Host),
            (dirs.pipe.clone(), ContainerPath::At(CONTAINER_PIPE_DIR)),
            (dirs.shm.clone(), ContainerPath::At(CONTAINER_SHM_DIR)),
        ],
    }
}

/// Where a mount goes in the container.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContainerPath {
    /// The host path itself.
    Host,
    At(&'static str),
}

/// What the card's daemon allows any client: the largest share prepared on it, SMs in percent
/// and pinned memory in MiB. `None` without shares.
pub fn daemon_ceiling<'a>(holds: impl IntoIterator<Item = &'a MpsHold>) -> Option<(u32, u64)> {
    holds.into_iter().fold(None, |ceiling, h| {
        let (p, m) = ceiling.unwrap_or((0, 0));
        Some((p.max(h.percentage), m.max(h.memory_mib)))
    })
}

/// The control commands that put `ceiling` in force: the defaults for servers started later, and
/// the same for each server already running (`servers`, their PIDs). Device 0 is the daemon's
/// only card (`CUDA_VISIBLE_DEVICES` names one).
pub fn ceiling_commands((percentage, memory_mib): (u32, u64), servers: &[u32]) -> Vec<String> {
    let mut commands = vec![
        format!("set_default_active_thread_percentage {percentage}"),
        format!("set_default_device_pinned_mem_limit 0 {memory_mib}M"),
    ];
    for server in servers {
        commands.push(format!(
            "set_active_thread_percentage {server} {percentage}"
        ));
        commands.push(format!(
            "set_device_pinned_mem_limit {server} 0 {memory_mib}M"
        ));
    }
    commands
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::find;
    use crate::prepare::claim::tests::inventory;
    use gpupool_api::config::{Enforcement, GpuConfig};

    fn allocated(device: &str, memory: Option<&str>, cores: Option<&str>) -> AllocatedDevice {
        let mut consumed = std::collections::BTreeMap::new();
        if let Some(m) = memory {
            consumed.insert("memory".to_string(), m.to_string());
        }
        if let Some(c) = cores {
            consumed.insert("cores".to_string(), c.to_string());
        }
        AllocatedDevice {
            request: "gpu".into(),
            pool: "n".into(),
            device: device.into(),
            share_id: Some("s".into()),
            consumed,
        }
    }

    fn mps() -> EffectiveConfig {
        EffectiveConfig {
            config: GpuConfig {
                compute: Some(Compute::Mps),
                ..Default::default()
            },
            compute_field: Some("config[0].opaque.parameters.compute".into()),
            ..Default::default()
        }
    }

    fn limits(memory_mib: u64, cores: u32) -> DeviceLimits {
        DeviceLimits {
            ordinal: 0,
            memory_bytes: memory_mib << 20,
            cores,
            enforcement: Enforcement::Gpupool,
            compute: Compute::Mps,
            priority: None,
        }
    }

    #[test]
    fn a_share_gets_its_cores_and_memory_and_the_whole_card_gets_all_sms() {
        let inv = inventory();
        let devices = [(
            allocated("gpu-0", Some("8Gi"), Some("30")),
            find(&inv, "gpu-0").unwrap(),
            mps(),
        )];
        let hold = check(&devices, &[limits(8192, 30)]).unwrap().unwrap();
        assert_eq!(
            (hold.card.as_str(), hold.percentage, hold.memory_mib),
            (inv.gpus[0].uuid.as_str(), 30, 8192)
        );
        let whole = inv.gpus[0].memory_bytes >> 20;
        let devices = [(
            allocated("gpu-0", None, None),
            find(&inv, "gpu-0").unwrap(),
            mps(),
        )];
        assert_eq!(
            check(&devices, &[limits(whole, 0)])
                .unwrap()
                .unwrap()
                .percentage,
            100
        );
        let limiter = [(
            allocated("gpu-0", Some("8Gi"), Some("30")),
            find(&inv, "gpu-0").unwrap(),
            EffectiveConfig::default(),
        )];
        assert_eq!(check(&limiter, &[limits(8192, 30)]).unwrap(), None);
    }

    #[test]
    fn what_mps_cannot_serve_is_refused_naming_the_compute_field() {
        let inv = inventory();
        let field = "config[0].opaque.parameters.compute: Mps, but";
        let no_cores = [(
            allocated("gpu-0", Some("8Gi"), None),
            find(&inv, "gpu-0").unwrap(),
            mps(),
        )];
        let e = check(&no_cores, &[limits(8192, 0)])
            .unwrap_err()
            .to_string();
        assert!(e.starts_with(field) && e.contains("cores 0"), "{e}");
        let two = [
            (
                allocated("gpu-0", Some("8Gi"), Some("30")),
                find(&inv, "gpu-0").unwrap(),
                mps(),
            ),
            (
                allocated("gpu-1", Some("8Gi"), Some("30")),
                find(&inv, "gpu-1").unwrap(),
                mps(),
            ),
        ];
        let e = check(&two, &[limits(8192, 30), limits(8192, 30)])
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(field) && e.contains("2 devices (gpu-0, gpu-1)"),
            "{e}"
        );
        let mig = [(
            allocated("gpu-2-mig-3g-40gb-4", None, None),
            find(&inv, "gpu-2-mig-3g-40gb-4").unwrap(),
            mps(),
        )];
        let e = check(&mig, &[limits(40776, 0)]).unwrap_err().to_string();
        assert!(e.starts_with(field) && e.contains("MIG 3g.40gb"), "{e}");
        let mut old = inventory();
        old.gpus[0].cuda_compute_capability = "6.1".into();
        let pascal = [(
            allocated("gpu-0", Some("8Gi"), Some("30")),
            find(&old, "gpu-0").unwrap(),
            mps(),
        )];
        let e = check(&pascal, &[limits(8192, 30)]).unwrap_err().to_string();
        assert!(e.contains("\"6.1\"") && e.contains("7.0"), "{e}");
    }

    #[test]
    fn the_container_reaches_the_daemon_where_it_has_its_pipe_folder_and_at_cudas_default() {
        let dirs = DaemonDirs::of(
            std::path::Path::new("/run/g"),
            "GPU-51b8cb73-0d3e-4d3c-9a8e-000000000001",
        )
        .unwrap();
        let hold = MpsHold {
            card: "GPU-51b8cb73-0d3e-4d3c-9a8e-000000000001".into(),
            device: "gpu-0".into(),
            percentage: 30,
            memory_mib: 8192,
        };
        let edits = container_edits(&hold, 0, &dirs);
        assert_eq!(
            edits.env,
            [
                "CUDA_MPS_PIPE_DIRECTORY=/run/g/mps/GPU-51b8cb73-0d3e-4d3c-9a8e-000000000001/pipe",
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30",
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8192M",
            ]
        );
        assert_eq!(
            edits.mounts,
            [
                (dirs.pipe.clone(), ContainerPath::Host),
                (dirs.pipe.clone(), ContainerPath::At("/tmp/nvidia-mps")),
                (dirs.shm.clone(), ContainerPath::At("/dev/shm"))
            ]
        );
    }

    #[test]
    fn the_daemon_allows_the_largest_share_and_tells_running_servers() {
        let hold = |percentage, memory_mib| MpsHold {
            card: String::new(),
            device: String::new(),
            percentage,
            memory_mib,
        };
        let holds = [hold(30, 40_000), hold(70, 20_000)];
        assert_eq!(daemon_ceiling(&holds), Some((70, 40_000)));
        assert_eq!(daemon_ceiling(&[]), None);
        assert_eq!(
            ceiling_commands((70, 40_000), &[812]),
            [
                "set_default_active_thread_percentage 70",
                "set_default_device_pinned_mem_limit 0 40000M",
                "set_active_thread_percentage 812 70",
                "set_device_pinned_mem_limit 812 0 40000M",
            ]
        );
    }
}

//! The claim's CDI spec: rendered from the limits (pure, with the host's file existence passed in),
//! then written atomically to the CDI root.
//!
//! One spec per claim, kind `gpupool.dev/claim`, one CDI device per allocation result in result
//! order. Per device: `/dev/nvidia<minor>`, the limit env, the enforcement library's mounts
//! (gpupool's or HAMi-core's, one per claim); a MIG device also its GPU and compute instances'
//! capability nodes and no enforcement library (the hardware partition is the limit); spec-level:
//! the control device nodes. A runtime fails a container whose device node or mount source is missing,
//! so nothing that is not on the host is ever emitted: with fake GPUs it is left out, on a real GPU
//! node the claim fails instead (dropping it silently would hand out an unusable or unlimited GPU).

use std::path::Path;

use gpupool_api::cdi::{self, ContainerEdits, Device, DeviceNode, Mount, Spec};
use gpupool_api::config::{Compute, Enforcement};
use gpupool_api::inventory::Gpu;
use gpupool_api::names::{cdi_device_id, cdi_device_name, CDI_KIND};
use thiserror::Error;

use super::claim::AllocatedDevice;
use super::limits::{self, DeviceLimits};
use crate::node_state::layout::{ClaimFolder, NodeLayout, LD_SO_PRELOAD, VGPU_LOCK_DIR};

pub const CONTROL_DEVICE_NODES: &[&str] =
    &["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"];

#[derive(Debug, Error, PartialEq, Eq)]
pub enum CdiError {
    #[error("device node {0} is missing on this node")]
    MissingDeviceNode(String),
    #[error("{0} is missing on this node, HAMi-core cannot coordinate without it")]
    MissingLockDir(String),
    #[error("rendered CDI spec is invalid: {0}")]
    Invalid(String),
}

/// One device to put in the spec.
pub struct SpecDevice<'a> {
    pub allocated: &'a AllocatedDevice,
    pub gpu: &'a Gpu,
    pub limits: &'a DeviceLimits,
    /// Set for a MIG device: the instance prepare created for it.
    pub mig: Option<MigSpec<'a>>,
}

/// A created MIG device, as the spec needs it.
pub struct MigSpec<'a> {
    pub profile: &'a str,
    /// `MIG-...`: what CUDA_VISIBLE_DEVICES names so that CUDA sees the partition, not the card.
    pub uuid: &'a str,
    /// The GPU and compute instances' capability nodes.
    pub device_nodes: &'a [String],
}

impl SpecDevice<'_> {
    /// What CUDA and the fake env name the device by.
    fn uuid(&self) -> &str {
        self.mig.as_ref().map_or(self.gpu.uuid.as_str(), |m| m.uuid)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Rendered {
    pub spec: Spec,
    /// `gpupool.dev/claim=<name>`, one per device, in result order.
    pub cdi_ids: Vec<String>,
    /// Set when limits are written but cannot be enforced (the library is not installed).
    pub warning: Option<String>,
}

fn bind(host: &Path, container: &str, read_only: bool) -> Mount {
    Mount {
        host_path: host.display().to_string(),
        container_path: container.to_string(),
        kind: Some("bind".into()),
        options: vec![
            if read_only { "ro" } else { "rw" }.to_string(),
            "nosuid".into(),
            "nodev".into(),
            "rbind".into(),
        ],
    }
}

/// Render the claim's spec. `exists` answers whether a host path exists (the only host fact used).
pub fn render(
    claim_uid: &str,
    devices: &[SpecDevice<'_>],
    layout: &NodeLayout,
    exists: &dyn Fn(&Path) -> bool,
) -> Result<Rendered, CdiError> {
    let enforced: Vec<&SpecDevice> = devices
        .iter()
        .filter(|d| d.limits.enforcement != Enforcement::None)
        .collect();
    // One library per claim (limits.rs refuses a claim whose devices disagree).
    let library = enforced
        .first()
        .and_then(|d| layout.library(d.limits.enforcement));
    let lib_present =
        library.is_some_and(|lib| exists(&lib.host_path) && exists(&layout.preload_file(lib)));
    let warning = library.filter(|_| !lib_present).map(|lib| {
        format!(
            "{} ({}) is not installed on this node: limits are set but not enforced",
            lib.name(),
            lib.host_path.display()
        )
    });
    // HAMi-core coordinates its containers through a node-wide lock folder; gpupool's library
    // needs none (its accounting file locks itself).
    let hami_core = enforced
        .first()
        .is_some_and(|d| d.limits.enforcement == Enforcement::HamiCore);
    let lock_present = hami_core && exists(&layout.vgpu_lock_dir);
    if hami_core && lib_present && !lock_present && !layout.fake_gpus {
        return Err(CdiError::MissingLockDir(
            layout.vgpu_lock_dir.display().to_string(),
        ));
    }

    let cache_dir = layout.claim_folder(ClaimFolder::VgpuCache, claim_uid);
    // One accounting file per claim, named after its first enforced card (see limits.rs).
    let shared = enforced.first().map(|first| {
        let file = cache_dir.join(format!("{}.cache", first.gpu.uuid));
        let priority = enforced.iter().find_map(|d| d.limits.priority);
        limits::shared_env(&file.display().to_string(), priority)
    });
    // CUDA numbers visible devices in CUDA_VISIBLE_DEVICES order, which pins ordinal i to the
    // i-th device of the claim (otherwise CUDA orders fastest first and the limits could land on
    // the wrong card).
    // A MIG device is only reachable through its MIG UUID in this list.
    let has_mig = devices.iter().any(|d| d.mig.is_some());
    let has_mps = devices.iter().any(|d| d.limits.compute == Compute::Mps);
    let visible = (!layout.fake_gpus && (!enforced.is_empty() || has_mig || has_mps)).then(|| {
        let uuids: Vec<&str> = devices.iter().map(SpecDevice::uuid).collect();
        format!("CUDA_VISIBLE_DEVICES={}", uuids.join(","))
    });

    let mut spec_devices = Vec::with_capacity(devices.len());
    let mut cdi_ids = Vec::with_capacity(devices.len());
    for d in devices {
        let mut edits = ContainerEdits::default();
        if !layout.fake_gpus {
            let node = format!("/dev/nvidia{}", d.gpu.minor);
            if !exists(Path::new(&node)) {
                return Err(CdiError::MissingDeviceNode(node));
            }
            edits.device_nodes.push(DeviceNode {
                path: node,
                ..Default::default()
            });
            for node in d.mig.iter().flat_map(|m| m.device_nodes) {
                if !exists(Path::new(node)) {
                    return Err(CdiError::MissingDeviceNode(node.clone()));
                }
                edits.device_nodes.push(DeviceNode {
                    path: node.clone(),
                    ..Default::default()
                });
            }
        }
        let mps = d.limits.compute == Compute::Mps;
        if d.mig.is_some() || (mps && d.limits.enforcement == Enforcement::None) {
            edits.env.extend(visible.iter().cloned());
        }
        if mps {
            // The card's MPS daemon: its pipe folder and its /dev/shm (crate::mps::share).
            let hold = crate::mps::share::hold(d.allocated, d.gpu, d.limits);
            let dirs = crate::mps::layout::DaemonDirs::of(&layout.run_dir, &d.gpu.uuid)
                .map_err(|e| CdiError::Invalid(e.to_string()))?;
            let mps = crate::mps::share::container_edits(&hold, d.limits.ordinal, &dirs);
            edits.env.extend(mps.env);
            edits
                .mounts
                .extend(mps.mounts.iter().map(|(host, container)| {
                    let container = match container {
                        crate::mps::share::ContainerPath::Host => host.display().to_string(),
                        crate::mps::share::ContainerPath::At(path) => path.to_string(),
                    };
                    bind(host, &container, false)
                }));
        }
        if let (Some(lib), true) = (library, d.limits.enforcement != Enforcement::None) {
            edits.env.extend(limits::limit_env(d.limits));
            // gpupool's library holds an SM limit by taking turns on the card with the other
            // containers there, through the card's arbiter file (HAMi-core has no such file; an
            // MPS share's cores are held by MPS, with no SM limit for the library).
            if d.limits.enforcement == Enforcement::Gpupool
                && d.limits.compute == Compute::Limiter
                && d.limits.cores > 0
                && d.mig.is_none()
            {
                if let Some(arbiter) = layout.card_arbiter(&d.gpu.uuid) {
                    edits.env.push(format!(
                        "GPUPOOL_VGPU_ARBITER_{}={}",
                        d.limits.ordinal,
                        arbiter.display()
                    ));
                    edits
                        .mounts
                        .push(bind(&arbiter, &arbiter.display().to_string(), false));
                }
            }
            edits.env.extend(shared.iter().flatten().cloned());
            edits.env.extend(visible.iter().cloned());
            edits
                .mounts
                .push(bind(&cache_dir, &cache_dir.display().to_string(), false));
            if lib_present {
                edits
                    .mounts
                    .push(bind(&lib.host_path, lib.container_path, true));
                edits
                    .mounts
                    .push(bind(&layout.preload_file(lib), LD_SO_PRELOAD, true));
            }
            if lock_present {
                edits
                    .mounts
                    .push(bind(&layout.vgpu_lock_dir, VGPU_LOCK_DIR, false));
            }
        }
        edits
            .env
            .extend(limits::identity_env(d.limits.ordinal, d.gpu));
        if let Some(mig) = &d.mig {
            let i = d.limits.ordinal;
            // The partition, not the card: what CUDA inside sees and what a pod can check.
            let card = format!("GPUPOOL_DEVICE_UUID_{i}=");
            edits.env.retain(|e| !e.starts_with(&card));
            edits.env.push(format!("{card}{}", mig.uuid));
            edits
                .env
                .push(format!("GPUPOOL_DEVICE_MIG_PROFILE_{i}={}", mig.profile));
        }
        let name = cdi_device_name(
            claim_uid,
            &d.allocated.device,
            d.allocated.share_id.as_deref(),
        );
        cdi_ids.push(cdi_device_id(&name));
        spec_devices.push(Device {
            name,
            container_edits: edits,
            ..Default::default()
        });
    }

    let mut spec_edits = ContainerEdits::default();
    if !layout.fake_gpus {
        for node in CONTROL_DEVICE_NODES {
            if !exists(Path::new(node)) {
                return Err(CdiError::MissingDeviceNode(node.to_string()));
            }
            spec_edits.device_nodes.push(DeviceNode {
                path: node.to_string(),
                ..Default::default()
            });
        }
    }
    let mut spec = Spec {
        cdi_version: String::new(),
        kind: CDI_KIND.to_string(),
        devices: spec_devices,
        container_edits: spec_edits,
        ..Default::default()
    };
    spec.cdi_version = cdi::version_to_write(&spec).to_string();
    let problems = cdi::validate(&spec);
    if !problems.is_empty() {
        return Err(CdiError::Invalid(problems.join("; ")));
    }
    Ok(Rendered {
        spec,
        cdi_ids,
        warning,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prepare::claim::tests::{inventory, UID};
    use std::collections::{BTreeMap, BTreeSet};

    fn layout(fake: bool) -> NodeLayout {
        NodeLayout::new(
            "/var/lib/gpupool".into(),
            "/var/run/cdi".into(),
            "/var/run/gpupool".into(),
            (
                Path::new("/usr/local/gpupool"),
                Path::new("/usr/local/vgpu"),
            ),
            fake,
        )
    }

    fn allocated(device: &str, share: Option<&str>) -> AllocatedDevice {
        AllocatedDevice {
            request: "gpu".into(),
            pool: "node-a".into(),
            device: device.into(),
            share_id: share.map(Into::into),
            consumed: BTreeMap::new(),
        }
    }

    fn limits(ordinal: usize, mib: u64, cores: u32, enforcement: Enforcement) -> DeviceLimits {
        DeviceLimits {
            ordinal,
            memory_bytes: mib << 20,
            cores,
            enforcement,
            compute: gpupool_api::config::Compute::Limiter,
            priority: None,
        }
    }

    fn everything_exists(_: &Path) -> bool {
        true
    }

    /// Host -> container paths of one device's mounts.
    fn mounts(edits: &ContainerEdits) -> BTreeSet<(&str, &str)> {
        edits
            .mounts
            .iter()
            .map(|m| (m.host_path.as_str(), m.container_path.as_str()))
            .collect()
    }

    #[test]
    fn real_gpu_spec_with_gpupool_mounts_its_library_and_no_hami_lock() {
        let inv = inventory();
        let (a, la) = (
            allocated("gpu-1", Some("s1")),
            limits(0, 16384, 25, Enforcement::Gpupool),
        );
        let devices = [SpecDevice {
            allocated: &a,
            gpu: &inv.gpus[1],
            limits: &la,
            mig: None,
        }];
        let r = render(UID, &devices, &layout(false), &everything_exists).unwrap();
        assert_eq!(r.warning, None);
        let edits = &r.spec.devices[0].container_edits;
        let cache_dir = format!("/var/run/gpupool/vgpu-cache/{UID}");
        let arbiter = format!("/var/run/gpupool/vgpu-arbiter/{}", inv.gpus[1].uuid);
        assert_eq!(
            mounts(edits),
            BTreeSet::from([
                (
                    "/usr/local/gpupool/libgpupool_vgpu.so",
                    "/usr/local/gpupool/libgpupool_vgpu.so"
                ),
                ("/var/lib/gpupool/ld.so.preload.gpupool", LD_SO_PRELOAD),
                (cache_dir.as_str(), cache_dir.as_str()),
                (arbiter.as_str(), arbiter.as_str()),
            ])
        );
        for env in [
            "CUDA_DEVICE_MEMORY_LIMIT_0=16384m".to_string(),
            "CUDA_DEVICE_SM_LIMIT_0=25".to_string(),
            // Its turns on the card, shared with every other container there.
            format!("GPUPOOL_VGPU_ARBITER_0={arbiter}"),
            format!("CUDA_VISIBLE_DEVICES={}", inv.gpus[1].uuid),
            // The library maps _0 to this card by UUID, whatever CUDA_VISIBLE_DEVICES becomes.
            format!("GPUPOOL_DEVICE_UUID_0={}", inv.gpus[1].uuid),
        ] {
            assert!(
                edits.env.contains(&env),
                "{env} missing from {:?}",
                edits.env
            );
        }

        // Without the library the limits are still written, and the warning names it.
        let no_lib = |p: &Path| !p.ends_with("libgpupool_vgpu.so");
        let r = render(UID, &devices, &layout(false), &no_lib).unwrap();
        assert_eq!(
            r.warning.as_deref(),
            Some(
                "gpupool-vgpu (/usr/local/gpupool/libgpupool_vgpu.so) is not installed on this \
                 node: limits are set but not enforced"
            )
        );
        let edits = &r.spec.devices[0].container_edits;
        assert!(edits.env.contains(&"CUDA_DEVICE_SM_LIMIT_0=25".to_string()));
        assert_eq!(
            mounts(edits),
            BTreeSet::from([
                (cache_dir.as_str(), cache_dir.as_str()),
                (arbiter.as_str(), arbiter.as_str())
            ])
        );
    }

    #[test]
    fn only_an_sm_limit_under_gpupools_library_gets_the_cards_arbiter() {
        let inv = inventory();
        let a = allocated("gpu-1", Some("s1"));
        for (cores, enforcement, compute) in [
            (0, Enforcement::Gpupool, Compute::Limiter),
            (50, Enforcement::HamiCore, Compute::Limiter),
            (50, Enforcement::None, Compute::Limiter),
            // MPS holds an MPS share's cores; the library gets no SM limit for it.
            (50, Enforcement::Gpupool, Compute::Mps),
        ] {
            let l = DeviceLimits {
                compute,
                ..limits(0, 8192, cores, enforcement)
            };
            let devices = [SpecDevice {
                allocated: &a,
                gpu: &inv.gpus[1],
                limits: &l,
                mig: None,
            }];
            let r = render(UID, &devices, &layout(false), &everything_exists).unwrap();
            let edits = &r.spec.devices[0].container_edits;
            assert!(
                !edits
                    .env
                    .iter()
                    .any(|e| e.starts_with("GPUPOOL_VGPU_ARBITER"))
                    && !mounts(edits)
                        .iter()
                        .any(|(h, _)| h.contains("vgpu-arbiter")),
                "{cores} cores under {enforcement:?}, {compute:?}: {edits:?}"
            );
        }
    }

    #[test]
    fn real_gpu_spec_has_nodes_limits_and_hami_mounts() {
        let inv = inventory();
        let (a, b) = (
            allocated("gpu-1", Some("s1")),
            allocated("gpu-0", Some("s2")),
        );
        let (la, lb) = (
            limits(0, 16384, 25, Enforcement::HamiCore),
            limits(1, 8192, 50, Enforcement::HamiCore),
        );
        let devices = [
            SpecDevice {
                allocated: &a,
                gpu: &inv.gpus[1],
                limits: &la,
                mig: None,
            },
            SpecDevice {
                allocated: &b,
                gpu: &inv.gpus[0],
                limits: &lb,
                mig: None,
            },
        ];
        let r = render(UID, &devices, &layout(false), &everything_exists).unwrap();
        assert_eq!(r.warning, None);
        assert_eq!(
            r.cdi_ids,
            [
                format!("gpupool.dev/claim={UID}-gpu-1-s1"),
                format!("gpupool.dev/claim={UID}-gpu-0-s2")
            ]
        );
        let s = &r.spec;
        assert_eq!(s.cdi_version, "0.5.0");
        assert_eq!(s.kind, "gpupool.dev/claim");
        assert_eq!(cdi::validate(s), Vec::<String>::new());
        let nodes: Vec<&str> = s
            .container_edits
            .device_nodes
            .iter()
            .map(|n| n.path.as_str())
            .collect();
        assert_eq!(nodes, CONTROL_DEVICE_NODES);
        let d1 = &s.devices[1].container_edits;
        assert_eq!(d1.device_nodes[0].path, "/dev/nvidia0");
        let cache = format!(
            "CUDA_DEVICE_MEMORY_SHARED_CACHE=/var/run/gpupool/vgpu-cache/{UID}/{}.cache",
            inv.gpus[1].uuid
        );
        for env in [
            "CUDA_DEVICE_MEMORY_LIMIT_1=8192m",
            "CUDA_DEVICE_SM_LIMIT_1=50",
            cache.as_str(),
        ] {
            assert!(
                d1.env.iter().any(|e| e == env),
                "{env} missing from {:?}",
                d1.env
            );
        }
        assert!(s.devices[0].container_edits.env.contains(&cache));
        let cache_dir = format!("/var/run/gpupool/vgpu-cache/{UID}");
        assert_eq!(
            mounts(d1),
            BTreeSet::from([
                ("/usr/local/vgpu/libvgpu.so", "/usr/local/vgpu/libvgpu.so"),
                ("/var/lib/gpupool/ld.so.preload", LD_SO_PRELOAD),
                ("/tmp/vgpulock", "/tmp/vgpulock"),
                (cache_dir.as_str(), cache_dir.as_str()),
            ])
        );
        let lib = d1
            .mounts
            .iter()
            .find(|m| m.container_path == "/usr/local/vgpu/libvgpu.so")
            .unwrap();
        assert!(lib.options.contains(&"ro".to_string()));
    }

    #[test]
    fn missing_things_on_a_real_node_fail_and_missing_library_warns() {
        let inv = inventory();
        let a = allocated("gpu-0", None);
        let l = limits(0, 1024, 0, Enforcement::HamiCore);
        let devices = [SpecDevice {
            allocated: &a,
            gpu: &inv.gpus[0],
            limits: &l,
            mig: None,
        }];
        let no_node = |p: &Path| p != Path::new("/dev/nvidia0");
        assert_eq!(
            render(UID, &devices, &layout(false), &no_node).unwrap_err(),
            CdiError::MissingDeviceNode("/dev/nvidia0".into())
        );
        let no_uvm = |p: &Path| p != Path::new("/dev/nvidia-uvm");
        assert!(render(UID, &devices, &layout(false), &no_uvm).is_err());

        let no_lib = |p: &Path| !p.ends_with("libvgpu.so");
        let r = render(UID, &devices, &layout(false), &no_lib).unwrap();
        assert!(r.warning.as_deref().unwrap().contains("not installed"));
        let edits = &r.spec.devices[0].container_edits;
        assert!(edits
            .env
            .contains(&"CUDA_DEVICE_MEMORY_LIMIT_0=1024m".to_string()));
        assert!(edits
            .mounts
            .iter()
            .all(|m| m.container_path != LD_SO_PRELOAD));
    }

    #[test]
    fn fake_gpus_get_env_and_only_existing_mounts() {
        let inv = inventory();
        let a = allocated("gpu-0", None);
        let l = limits(0, 8192, 50, Enforcement::HamiCore);
        let devices = [SpecDevice {
            allocated: &a,
            gpu: &inv.gpus[0],
            limits: &l,
            mig: None,
        }];
        // Only the claim's cache folder exists (the driver creates it).
        let only_cache = |p: &Path| p.starts_with("/var/run/gpupool/vgpu-cache");
        let r = render(UID, &devices, &layout(true), &only_cache).unwrap();
        let s = &r.spec;
        assert_eq!(cdi::validate(s), Vec::<String>::new());
        assert!(s.container_edits.is_empty());
        let edits = &s.devices[0].container_edits;
        assert!(edits.device_nodes.is_empty());
        assert_eq!(edits.mounts.len(), 1);
        assert!(edits.mounts[0].host_path.ends_with(UID));
        for env in [
            "CUDA_DEVICE_MEMORY_LIMIT_0=8192m",
            "GPUPOOL_DEVICE_MODEL_0=A100-SXM4-40GB",
            "GPUPOOL_DEVICE_UUID_0=GPU-00000000-0000-0000-0000-000000000000",
        ] {
            assert!(edits.env.iter().any(|e| e == env), "{env}");
        }
        assert!(edits
            .env
            .iter()
            .all(|e| !e.starts_with("CUDA_VISIBLE_DEVICES")));

        // enforcement None: no limit env or mounts, the device still carries its identity.
        let l = limits(0, 8192, 50, Enforcement::None);
        let devices = [SpecDevice {
            allocated: &a,
            gpu: &inv.gpus[0],
            limits: &l,
            mig: None,
        }];
        let r = render(UID, &devices, &layout(true), &everything_exists).unwrap();
        let edits = &r.spec.devices[0].container_edits;
        assert!(edits.mounts.is_empty());
        assert!(edits.env.iter().all(|e| e.starts_with("GPUPOOL_DEVICE_")));
        assert_eq!(r.warning, None);
    }

    #[test]
    fn an_mps_share_reaches_its_cards_daemon_keeps_its_memory_limit_and_gets_no_sm_limit() {
        let inv = inventory();
        let a = AllocatedDevice {
            consumed: BTreeMap::from([
                ("memory".to_string(), "8Gi".to_string()),
                ("cores".to_string(), "30".to_string()),
            ]),
            ..allocated("gpu-1", Some("s1"))
        };
        let mut l = limits(0, 8192, 30, Enforcement::Gpupool);
        l.compute = Compute::Mps;
        let devices = [SpecDevice {
            allocated: &a,
            gpu: &inv.gpus[1],
            limits: &l,
            mig: None,
        }];
        let r = render(UID, &devices, &layout(false), &everything_exists).unwrap();
        let edits = &r.spec.devices[0].container_edits;
        let card = format!("/var/run/gpupool/mps/{}", inv.gpus[1].uuid);
        for env in [
            "CUDA_DEVICE_MEMORY_LIMIT_0=8192m".to_string(),
            "CUDA_DEVICE_SM_LIMIT_0=0".to_string(),
            format!("CUDA_MPS_PIPE_DIRECTORY={card}/pipe"),
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30".to_string(),
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8192M".to_string(),
            format!("CUDA_VISIBLE_DEVICES={}", inv.gpus[1].uuid),
        ] {
            assert!(
                edits.env.contains(&env),
                "{env} missing from {:?}",
                edits.env
            );
        }
        let pipe = format!("{card}/pipe");
        let shm = format!("{card}/shm");
        let m = mounts(edits);
        assert!(m.contains(&(pipe.as_str(), "/tmp/nvidia-mps")), "{m:?}");
        assert!(m.contains(&(pipe.as_str(), pipe.as_str())), "{m:?}");
        assert!(m.contains(&(shm.as_str(), "/dev/shm")), "{m:?}");
        assert!(m.contains(&("/var/lib/gpupool/ld.so.preload.gpupool", LD_SO_PRELOAD)));
        let shm_mount = edits
            .mounts
            .iter()
            .find(|m| m.container_path == "/dev/shm")
            .unwrap();
        assert!(shm_mount.options.contains(&"rw".to_string()));
        assert_eq!(cdi::validate(&r.spec), Vec::<String>::new());

        // Without the library the share still reaches its daemon and sees only its card.
        l.enforcement = Enforcement::None;
        let devices = [SpecDevice {
            allocated: &a,
            gpu: &inv.gpus[1],
            limits: &l,
            mig: None,
        }];
        let r = render(UID, &devices, &layout(false), &everything_exists).unwrap();
        let env = &r.spec.devices[0].container_edits.env;
        assert!(env.contains(&"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30".to_string()));
        assert!(env.contains(&format!("CUDA_VISIBLE_DEVICES={}", inv.gpus[1].uuid)));
        assert!(
            !env.iter().any(|e| e.starts_with("CUDA_DEVICE_")),
            "{env:?}"
        );
    }

    #[test]
    fn a_mig_device_gets_its_capability_nodes_and_its_mig_uuid_and_no_hami_core() {
        let inv = inventory();
        let (a, b) = (
            allocated("gpu-0", Some("s1")),
            allocated("gpu-2-mig-1g-10gb-3", None),
        );
        let (la, lb) = (
            limits(0, 8192, 50, Enforcement::HamiCore),
            limits(1, 10194, 0, Enforcement::None),
        );
        let nodes = vec![
            "/dev/nvidia-caps/nvidia-cap21".to_string(),
            "/dev/nvidia-caps/nvidia-cap22".to_string(),
        ];
        let mig_uuid = "MIG-5a1b2c3d-0000-4000-8000-000000000001";
        let devices = [
            SpecDevice {
                allocated: &a,
                gpu: &inv.gpus[0],
                limits: &la,
                mig: None,
            },
            SpecDevice {
                allocated: &b,
                gpu: &inv.gpus[2],
                limits: &lb,
                mig: Some(MigSpec {
                    profile: "1g.10gb",
                    uuid: mig_uuid,
                    device_nodes: &nodes,
                }),
            },
        ];
        let r = render(UID, &devices, &layout(false), &everything_exists).unwrap();
        assert_eq!(
            r.cdi_ids[1],
            format!("gpupool.dev/claim={UID}-gpu-2-mig-1g-10gb-3")
        );
        let mig = &r.spec.devices[1].container_edits;
        let paths: Vec<&str> = mig.device_nodes.iter().map(|n| n.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "/dev/nvidia2",
                "/dev/nvidia-caps/nvidia-cap21",
                "/dev/nvidia-caps/nvidia-cap22"
            ]
        );
        let visible = format!("CUDA_VISIBLE_DEVICES={},{mig_uuid}", inv.gpus[0].uuid);
        assert!(mig.env.contains(&visible), "{:?}", mig.env);
        assert!(
            r.spec.devices[0].container_edits.env.contains(&visible),
            "the card's ordinal is fixed by the same list"
        );
        assert!(mig.mounts.is_empty(), "no HAMi-core on a MIG device");
        assert!(!mig.env.iter().any(|e| e.starts_with("CUDA_DEVICE_")));
        assert_eq!(cdi::validate(&r.spec), Vec::<String>::new());

        let no_cap = |p: &Path| p != Path::new("/dev/nvidia-caps/nvidia-cap22");
        assert_eq!(
            render(UID, &devices, &layout(false), &no_cap).unwrap_err(),
            CdiError::MissingDeviceNode("/dev/nvidia-caps/nvidia-cap22".into())
        );

        let fake = render(UID, &devices, &layout(true), &everything_exists).unwrap();
        let env = &fake.spec.devices[1].container_edits.env;
        assert!(
            env.contains(&format!("GPUPOOL_DEVICE_UUID_1={mig_uuid}")),
            "{env:?}"
        );
        assert!(env.contains(&"GPUPOOL_DEVICE_MIG_PROFILE_1=1g.10gb".to_string()));
        assert!(!env.contains(&format!("GPUPOOL_DEVICE_UUID_1={}", inv.gpus[2].uuid)));
    }
}

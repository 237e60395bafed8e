//! The limits each prepared device gets, and the environment that carries them (pure).
//!
//! gpupool's library and HAMi-core read the same variables. HAMi-core contract (docs/architecture.md): `CUDA_DEVICE_MEMORY_LIMIT_<i>=<MiB>m` and
//! `CUDA_DEVICE_SM_LIMIT_<i>=<percent>` per CUDA ordinal `<i>` in the container, no zero padding
//! (the library parses with base 0: a leading zero would mean octal), at most 16 devices.
//! `CUDA_DEVICE_MEMORY_SHARED_CACHE` names one file that HAMi-core maps as the accounting region of
//! all devices of the process, so it is one value per claim, set identically on every device of the
//! claim: `<cache dir>/<claimUID>/<uuid of the claim's first device>.cache`. A container holding two
//! gpupool claims would get two caches and overlapping ordinals: one claim per container is the
//! supported shape (a claim may hold up to 16 devices).

use gpupool_api::config::{Compute, EffectiveConfig, Enforcement, Sharing};
use gpupool_api::inventory::{Gpu, MigProfile};
use gpupool_api::names::{capacity, MEMORY_STEP_BYTES};
use gpupool_api::quantity;
use thiserror::Error;

use super::claim::AllocatedDevice;
use crate::devices::{DeviceKind, NodeDevice};

/// HAMi-core tracks at most this many devices per container.
pub const MAX_DEVICES: usize = 16;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum LimitsError {
    #[error(
        "{count} devices in one claim, the enforcement libraries support at most {MAX_DEVICES}"
    )]
    TooManyDevices { count: usize },
    #[error(
        "{field}: {second} on {second_device}, but {first_device} is enforced by {first}: \
         a container preloads one enforcement library, so a claim's devices must agree"
    )]
    MixedEnforcement {
        field: String,
        first: &'static str,
        first_device: String,
        second: &'static str,
        second_device: String,
    },
    #[error("{device}: consumedCapacity[{capacity:?}]: {message}")]
    BadCapacity {
        device: String,
        capacity: String,
        message: String,
    },
    #[error("{field}: {message}")]
    Override { field: String, message: String },
}

/// The limits of one device of a claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceLimits {
    /// CUDA ordinal in the container: the device's position in the claim's results.
    pub ordinal: usize,
    pub memory_bytes: u64,
    /// Percent of the card's SMs; 0 = no SM limit.
    pub cores: u32,
    pub enforcement: Enforcement,
    /// Who holds `cores`: the library's SM limiter, or the card's MPS daemon (then the library
    /// gets no SM limit, see `crate::mps::share`).
    pub compute: Compute,
    pub priority: Option<i64>,
}

impl DeviceLimits {
    pub fn memory_mib(&self) -> u64 {
        self.memory_bytes / MEMORY_STEP_BYTES
    }
}

fn consumed(device: &AllocatedDevice, name: &str) -> Result<Option<quantity::Milli>, LimitsError> {
    device
        .consumed
        .get(name)
        .map(|q| {
            quantity::parse(q).map_err(|e| LimitsError::BadCapacity {
                device: device.device.clone(),
                capacity: name.to_string(),
                message: e.to_string(),
            })
        })
        .transpose()
}

/// Which library enforces a claim whose config does not say (`--default-enforcement`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DefaultEnforcement {
    /// gpupool's library where it is installed, else HAMi-core where it is, else gpupool's (the
    /// claim's status then says that its limits are not enforced).
    Auto,
    Fixed(Enforcement),
}

impl DefaultEnforcement {
    /// The enforcement a claim without an `enforcement` field gets on this node; `installed` tells
    /// whether a library is on the host.
    pub fn resolve(self, installed: impl Fn(Enforcement) -> bool) -> Enforcement {
        match self {
            DefaultEnforcement::Fixed(e) => e,
            DefaultEnforcement::Auto if installed(Enforcement::Gpupool) => Enforcement::Gpupool,
            DefaultEnforcement::Auto if installed(Enforcement::HamiCore) => Enforcement::HamiCore,
            DefaultEnforcement::Auto => Enforcement::Gpupool,
        }
    }
}

/// Limits of one device: the allocation (whole card when no memory was consumed), then the config's
/// overrides, which may only lower it. `default_enforcement` applies where the config says nothing.
pub fn device_limits(
    ordinal: usize,
    device: &AllocatedDevice,
    gpu: &Gpu,
    config: &EffectiveConfig,
    default_enforcement: Enforcement,
) -> Result<DeviceLimits, LimitsError> {
    let bad = |capacity: &str, message: String| LimitsError::BadCapacity {
        device: device.device.clone(),
        capacity: capacity.to_string(),
        message,
    };
    let whole_card = gpu.memory_bytes / MEMORY_STEP_BYTES * MEMORY_STEP_BYTES;
    let allocated_memory = match consumed(device, capacity::MEMORY)? {
        Some(m) if m.0 <= 0 => return Err(bad(capacity::MEMORY, "not positive".into())),
        Some(m) => u64::try_from(m.ceil_units())
            .map_err(|_| bad(capacity::MEMORY, "out of range".into()))?
            .min(gpu.memory_bytes),
        None => gpu.memory_bytes,
    };
    let allocated_cores = match consumed(device, capacity::CORES)? {
        Some(c) if c.0 < 0 || c.ceil_units() > 100 => {
            return Err(bad(capacity::CORES, "outside 0..100".into()))
        }
        Some(c) => c.ceil_units() as u32,
        None => 0,
    };
    let c = &config.config;
    if c.sharing == Some(Sharing::Exclusive) && allocated_memory < whole_card {
        return Err(LimitsError::Override {
            field: config.sharing_field.clone().unwrap_or_default(),
            message: format!(
                "Exclusive, but {} holds {} of {}: ask for the whole card",
                device.device,
                quantity::format_bytes(allocated_memory),
                quantity::format_bytes(gpu.memory_bytes)
            ),
        });
    }
    let mut memory_bytes = allocated_memory;
    if let Some(limit) = c.memory_limit {
        if c.memory_limit_raises(allocated_memory) {
            return Err(LimitsError::Override {
                field: config.memory_limit_field.clone().unwrap_or_default(),
                message: format!(
                    "{} is above the {} allocated on {}",
                    quantity::format_bytes(limit),
                    quantity::format_bytes(allocated_memory),
                    device.device
                ),
            });
        }
        memory_bytes = limit;
    }
    let mut cores = allocated_cores;
    if let Some(limit) = c.core_limit {
        if c.core_limit_raises(allocated_cores) {
            return Err(LimitsError::Override {
                field: config.core_limit_field.clone().unwrap_or_default(),
                message: format!(
                    "{limit} is above the {allocated_cores}% allocated on {}",
                    device.device
                ),
            });
        }
        cores = limit;
    }
    Ok(DeviceLimits {
        ordinal,
        memory_bytes,
        cores,
        enforcement: c.enforcement.unwrap_or(default_enforcement),
        compute: c.compute.unwrap_or_default(),
        priority: c.priority,
    })
}

/// Limits of a MIG device: its profile's memory, no SM limit and nothing for HAMi-core to
/// enforce, since the hardware partition is the limit. A `memoryLimit` or `coreLimit` for it is
/// an error naming the field: it could not be honoured, and silently ignoring it would hand out
/// more than the user asked to allow.
pub fn mig_limits(
    ordinal: usize,
    device: &AllocatedDevice,
    profile: &MigProfile,
    config: &EffectiveConfig,
) -> Result<DeviceLimits, LimitsError> {
    let not_applicable = |field: &Option<String>, what: &str| {
        LimitsError::Override {
        field: field.clone().unwrap_or_default(),
        message: format!(
            "{} is MIG {}, partitioned in hardware: a {what} does not apply (ask for a smaller MIG profile or a fraction of a card)",
            device.device, profile.name
        ),
    }
    };
    let c = &config.config;
    if c.memory_limit.is_some() {
        return Err(not_applicable(&config.memory_limit_field, "memoryLimit"));
    }
    if c.core_limit.is_some() {
        return Err(not_applicable(&config.core_limit_field, "coreLimit"));
    }
    Ok(DeviceLimits {
        ordinal,
        memory_bytes: profile.memory_bytes,
        cores: 0,
        enforcement: Enforcement::None,
        compute: Compute::Limiter,
        priority: c.priority,
    })
}

/// The per-ordinal limit variables of one device (empty when enforcement is off).
pub fn limit_env(limits: &DeviceLimits) -> Vec<String> {
    if limits.enforcement == Enforcement::None {
        return Vec::new();
    }
    let i = limits.ordinal;
    // An MPS share's SMs are the daemon's to hold: the library must not throttle it as well.
    let sm_limit = match limits.compute {
        Compute::Limiter => limits.cores,
        Compute::Mps => 0,
    };
    vec![
        format!("CUDA_DEVICE_MEMORY_LIMIT_{i}={}m", limits.memory_mib()),
        format!("CUDA_DEVICE_SM_LIMIT_{i}={sm_limit}"),
    ]
}

/// Variables that name the card behind ordinal `i`: a pod sees what it was given (on a GPU-less
/// node there is nothing else to look at), and gpupool's library maps `_<i>` to the card's UUID
/// from them, whatever `CUDA_VISIBLE_DEVICES` a process inside sets later.
pub fn identity_env(ordinal: usize, gpu: &Gpu) -> Vec<String> {
    vec![
        format!("GPUPOOL_DEVICE_UUID_{ordinal}={}", gpu.uuid),
        format!("GPUPOOL_DEVICE_MODEL_{ordinal}={}", gpu.model),
    ]
}

/// The claim-wide variables of the enforcement library, identical on every enforced device.
pub fn shared_env(cache_file: &str, priority: Option<i64>) -> Vec<String> {
    let mut env = vec![format!("CUDA_DEVICE_MEMORY_SHARED_CACHE={cache_file}")];
    if let Some(p) = priority {
        env.push(format!("CUDA_TASK_PRIORITY={p}"));
    }
    env
}

/// Limits of every device of a claim, ordinals in result order; every enforced device uses the
/// same library.
pub fn claim_limits(
    devices: &[(AllocatedDevice, NodeDevice<'_>, EffectiveConfig)],
    default_enforcement: Enforcement,
) -> Result<Vec<DeviceLimits>, LimitsError> {
    if devices.len() > MAX_DEVICES {
        return Err(LimitsError::TooManyDevices {
            count: devices.len(),
        });
    }
    let limits = devices
        .iter()
        .enumerate()
        .map(
            |(i, (device, node_device, config))| match node_device.kind {
                DeviceKind::Card => {
                    device_limits(i, device, node_device.gpu, config, default_enforcement)
                }
                DeviceKind::Mig { profile, .. } => mig_limits(i, device, profile, config),
            },
        )
        .collect::<Result<Vec<_>, _>>()?;
    let mut enforced = limits
        .iter()
        .zip(devices)
        .filter(|(l, _)| l.enforcement != Enforcement::None);
    if let Some((first, (first_device, ..))) = enforced.next() {
        if let Some((other, (device, _, config))) =
            enforced.find(|(l, _)| l.enforcement != first.enforcement)
        {
            return Err(LimitsError::MixedEnforcement {
                field: config
                    .enforcement_field
                    .clone()
                    .unwrap_or_else(|| "enforcement".into()),
                first: first.enforcement.as_str(),
                first_device: first_device.device.clone(),
                second: other.enforcement.as_str(),
                second_device: device.device.clone(),
            });
        }
    }
    Ok(limits)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::find;
    use crate::prepare::claim::tests::inventory;
    use gpupool_api::config::GpuConfig;

    /// The node default in these tests.
    const D: Enforcement = Enforcement::Gpupool;

    fn device(name: &str, memory: Option<&str>, cores: Option<&str>) -> AllocatedDevice {
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
            device: name.into(),
            share_id: Some("s".into()),
            consumed,
        }
    }

    fn cfg(config: GpuConfig) -> EffectiveConfig {
        EffectiveConfig {
            config,
            sharing_field: Some("p.sharing".into()),
            memory_limit_field: Some("p.memoryLimit".into()),
            core_limit_field: Some("p.coreLimit".into()),
            enforcement_field: Some("p.enforcement".into()),
            compute_field: Some("p.compute".into()),
        }
    }

    #[test]
    fn limits_come_from_consumed_capacity_else_the_whole_card() {
        let inv = inventory();
        let a100 = &inv.gpus[0];
        let l = device_limits(
            0,
            &device("gpu-0", Some("8Gi"), Some("50")),
            a100,
            &cfg(GpuConfig::default()),
            Enforcement::Gpupool,
        )
        .unwrap();
        assert_eq!(
            (l.memory_mib(), l.cores, l.enforcement),
            (8192, 50, Enforcement::Gpupool)
        );
        let l = device_limits(
            0,
            &device("gpu-0", None, None),
            a100,
            &cfg(GpuConfig::default()),
            D,
        )
        .unwrap();
        assert_eq!((l.memory_mib(), l.cores), (40960, 0));
        // The scheduler rounds 1500M up to 1431Mi.
        let l = device_limits(
            0,
            &device("gpu-0", Some("1431Mi"), Some("0")),
            a100,
            &cfg(GpuConfig::default()),
            D,
        )
        .unwrap();
        assert_eq!(l.memory_mib(), 1431);
    }

    #[test]
    fn env_for_two_shares_of_different_cards_uses_ordinals_0_and_1() {
        let inv = inventory();
        let devices = vec![
            (
                device("gpu-1", Some("16Gi"), Some("25")),
                find(&inv, "gpu-1").unwrap(),
                cfg(GpuConfig::default()),
            ),
            (
                device("gpu-0", Some("8Gi"), Some("50")),
                find(&inv, "gpu-0").unwrap(),
                cfg(GpuConfig::default()),
            ),
        ];
        let limits = claim_limits(&devices, D).unwrap();
        let env: Vec<String> = limits.iter().flat_map(limit_env).collect();
        assert_eq!(
            env,
            [
                "CUDA_DEVICE_MEMORY_LIMIT_0=16384m",
                "CUDA_DEVICE_SM_LIMIT_0=25",
                "CUDA_DEVICE_MEMORY_LIMIT_1=8192m",
                "CUDA_DEVICE_SM_LIMIT_1=50",
            ]
        );
        assert_eq!(
            identity_env(1, &inv.gpus[0]),
            [
                "GPUPOOL_DEVICE_UUID_1=GPU-00000000-0000-0000-0000-000000000000",
                "GPUPOOL_DEVICE_MODEL_1=A100-SXM4-40GB"
            ]
        );
        assert_eq!(
            shared_env("/c/u/x.cache", Some(1)),
            [
                "CUDA_DEVICE_MEMORY_SHARED_CACHE=/c/u/x.cache",
                "CUDA_TASK_PRIORITY=1"
            ]
        );
    }

    #[test]
    fn an_mps_share_keeps_its_memory_limit_and_gets_no_sm_limit_from_the_library() {
        let inv = inventory();
        let mps = GpuConfig {
            compute: Some(Compute::Mps),
            ..Default::default()
        };
        let l = device_limits(
            0,
            &device("gpu-0", Some("8Gi"), Some("30")),
            &inv.gpus[0],
            &cfg(mps),
            D,
        )
        .unwrap();
        assert_eq!((l.cores, l.compute), (30, Compute::Mps));
        assert_eq!(
            limit_env(&l),
            [
                "CUDA_DEVICE_MEMORY_LIMIT_0=8192m",
                "CUDA_DEVICE_SM_LIMIT_0=0"
            ]
        );
    }

    #[test]
    fn overrides_may_only_lower_the_allocation() {
        let inv = inventory();
        let a100 = &inv.gpus[0];
        let lower = GpuConfig {
            memory_limit: Some(4 << 30),
            core_limit: Some(20),
            enforcement: Some(Enforcement::None),
            ..Default::default()
        };
        let l = device_limits(
            0,
            &device("gpu-0", Some("8Gi"), Some("50")),
            a100,
            &cfg(lower),
            D,
        )
        .unwrap();
        assert_eq!((l.memory_mib(), l.cores), (4096, 20));
        assert!(
            limit_env(&l).is_empty(),
            "enforcement None writes no limit env"
        );

        let above = GpuConfig {
            memory_limit: Some(9 << 30),
            ..Default::default()
        };
        let e = device_limits(0, &device("gpu-0", Some("8Gi"), None), a100, &cfg(above), D)
            .unwrap_err();
        assert!(
            e.to_string()
                .starts_with("p.memoryLimit: 9Gi is above the 8Gi"),
            "{e}"
        );

        for core_limit in [0, 60] {
            let c = GpuConfig {
                core_limit: Some(core_limit),
                ..Default::default()
            };
            let e =
                device_limits(0, &device("gpu-0", None, Some("50")), a100, &cfg(c), D).unwrap_err();
            assert!(e.to_string().starts_with("p.coreLimit:"), "{e}");
        }
        // From "no SM limit" any limit is a lowering.
        let c = GpuConfig {
            core_limit: Some(30),
            ..Default::default()
        };
        assert_eq!(
            device_limits(0, &device("gpu-0", None, None), a100, &cfg(c), D)
                .unwrap()
                .cores,
            30
        );

        let exclusive = GpuConfig {
            sharing: Some(Sharing::Exclusive),
            ..Default::default()
        };
        assert!(device_limits(
            0,
            &device("gpu-0", None, None),
            a100,
            &cfg(exclusive.clone()),
            D
        )
        .is_ok());
        let e = device_limits(
            0,
            &device("gpu-0", Some("8Gi"), None),
            a100,
            &cfg(exclusive),
            D,
        )
        .unwrap_err();
        assert!(e.to_string().starts_with("p.sharing:"), "{e}");
    }

    #[test]
    fn bad_capacities_and_too_many_devices_are_errors() {
        let inv = inventory();
        let e = device_limits(
            0,
            &device("gpu-0", Some("8GB"), None),
            &inv.gpus[0],
            &cfg(GpuConfig::default()),
            D,
        )
        .unwrap_err();
        assert!(e.to_string().contains("memory"), "{e}");
        let e = device_limits(
            0,
            &device("gpu-0", None, Some("101")),
            &inv.gpus[0],
            &cfg(GpuConfig::default()),
            D,
        )
        .unwrap_err();
        assert!(e.to_string().contains("cores"), "{e}");
        let many: Vec<_> = (0..17)
            .map(|_| {
                (
                    device("gpu-0", Some("1Gi"), None),
                    find(&inv, "gpu-0").unwrap(),
                    cfg(GpuConfig::default()),
                )
            })
            .collect();
        assert_eq!(
            claim_limits(&many, D).unwrap_err(),
            LimitsError::TooManyDevices { count: 17 }
        );
    }

    #[test]
    fn a_mig_device_gets_its_profile_memory_and_no_hami_limits() {
        let inv = inventory();
        let mig = find(&inv, "gpu-2-mig-3g-40gb-4").unwrap();
        let devices = vec![
            (
                device("gpu-0", Some("8Gi"), Some("50")),
                find(&inv, "gpu-0").unwrap(),
                cfg(GpuConfig::default()),
            ),
            (
                device("gpu-2-mig-3g-40gb-4", None, None),
                mig.clone(),
                cfg(GpuConfig::default()),
            ),
        ];
        let limits = claim_limits(&devices, D).unwrap();
        assert_eq!(limits[1].ordinal, 1);
        assert_eq!(
            limits[1].memory_mib(),
            4 * 10194,
            "four memory slices of an H100"
        );
        assert_eq!(limits[1].enforcement, Enforcement::None);
        assert!(
            limit_env(&limits[1]).is_empty(),
            "HAMi-core has nothing to do"
        );
        assert_eq!(limit_env(&limits[0]).len(), 2);

        let mut lowered = cfg(GpuConfig {
            core_limit: Some(10),
            ..Default::default()
        });
        lowered.core_limit_field = Some("config[0].coreLimit".into());
        let DeviceKind::Mig { profile, .. } = mig.kind else {
            unreachable!()
        };
        let e = mig_limits(0, &devices[1].0, profile, &lowered).unwrap_err();
        let text = e.to_string();
        assert!(
            text.starts_with("config[0].coreLimit:") && text.contains("MIG 3g.40gb"),
            "{text}"
        );
    }
}

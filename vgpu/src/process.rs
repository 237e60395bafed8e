//! This process's view of its limits: the parsed environment, the shared file and its slot, the
//! claim index of each device, what it allocated, its context memory.
//!
//! Nothing here exists until the first CUDA or NVML entry point is called: the library is loaded
//! into every process of the container (shells too), and those that never touch a GPU must not
//! pay for it. The state is created once, under a spin lock held only by the creating thread,
//! and never freed. A forked child starts over (see [`after_fork_in_child`]).

use crate::accounting::{context_bytes, Allocations, Charged};
use crate::arbiter::{self, Arbiter, Member};
use crate::cuda::*;
use crate::driver;
use crate::env::{self, Config, Uuid, MAX_DEVICES};
use crate::layout;
use crate::nvml::Nvml;
use crate::shared::{Attached, Charge, Reaped, SharedFile};
use crate::sys::now_ns;
use crate::view::{memory_view, MemoryView};
use std::sync::atomic::{
    AtomicBool, AtomicI32, AtomicPtr, AtomicU32, AtomicU8, AtomicUsize, Ordering,
};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::Duration;

/// How often a process re-reads its own memory use from NVML (context memory), at most.
pub const CONTEXT_REFRESH: Duration = Duration::from_millis(100);

/// Without NVML nothing can measure a context: this much is charged for each process's first
/// context on a limited device. Contexts of CUDA 12 with lazy module loading take a few hundred
/// MiB; the low end is used so as not to refuse memory that is there.
pub const CONTEXT_ESTIMATE: u64 = 300 << 20;

/// The drop of a card's free memory around our context's creation is bounded by this much:
/// another tenant allocating at the same moment must not be charged to us without limit.
pub const CONTEXT_DROP_BOUND: u64 = 2 << 30;

/// Where a process's context memory on a device comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ContextSource {
    Unknown,
    /// NVML's per-process used memory minus what we track (exact; refreshed).
    NvmlPerProcess,
    /// The drop of the card's free memory around the context's creation (bounded; fixed).
    CreationDrop,
    /// [`CONTEXT_ESTIMATE`] (no NVML).
    Estimate,
}

/// The gate's view of the process, one relaxed load on every launch.
pub const GATE_UNINIT: u8 = 0;
pub const GATE_PASS: u8 = 1;
pub const GATE_THROTTLE: u8 = 2;
pub const GATE_REFUSED: u8 = 3;
pub static GATE: AtomicU8 = AtomicU8::new(GATE_UNINIT);

static PROCESS: AtomicPtr<Process> = AtomicPtr::new(std::ptr::null_mut());
static REFUSED: AtomicBool = AtomicBool::new(false);
static INIT_LOCK: AtomicBool = AtomicBool::new(false);
static ATFORK_REGISTERED: AtomicBool = AtomicBool::new(false);
static ATEXIT_REGISTERED: AtomicBool = AtomicBool::new(false);

const NO_SLOT: usize = usize::MAX;
const CACHE_UNKNOWN: i32 = -2;
const CACHE_NOT_OURS: i32 = -1;
const CUDEVICE_CACHE: usize = 64;

struct Inner {
    allocations: Allocations,
    primaries: std::collections::HashMap<CUdevice, usize>,
    context: [ContextSource; MAX_DEVICES],
    last_refresh_ns: [u64; MAX_DEVICES],
    /// Context memory as last measured while no managed memory was held.
    context_baseline: [Option<u64>; MAX_DEVICES],
}

pub struct Process {
    pub config: Config,
    /// None when the environment limits nothing: every entry point passes straight through.
    file: Option<SharedFile>,
    slot: AtomicUsize,
    inner: Mutex<Inner>,
    claim_map: OnceLock<[Option<Uuid>; MAX_DEVICES]>,
    /// With one visible device, every launch is on it: its claim index (None: several devices,
    /// or the one visible is not the claim's).
    only_device: OnceLock<Option<usize>>,
    by_cudevice: [AtomicI32; CUDEVICE_CACHE],
    nvml: OnceLock<Option<Nvml>>,
    nvml_devices: Mutex<[usize; MAX_DEVICES]>,
    /// This process's PID as NVML names it; 0 while unknown.
    host_pid: AtomicU32,
    /// In the host's PID namespace our own PID is NVML's, once NVML lists us.
    initial_pid_namespace: bool,
    /// The card's arbiter per claim index with an SM limit (the compute limiter's turns).
    arbiters: [Option<Arbiter>; MAX_DEVICES],
    /// The claim's device map could not be read at the last try (the accounting file's header
    /// lock held by a stopped process): a device then has no claim index, and an allocation on it
    /// is refused, never let through uncharged.
    claim_map_unreadable: AtomicBool,
}

/// The process state, created on first use; None when the environment is refused (fail closed).
pub fn get() -> Option<&'static Process> {
    let current = PROCESS.load(Ordering::Acquire);
    if !current.is_null() {
        // SAFETY: PROCESS only ever holds a leaked Box that is never freed.
        return Some(unsafe { &*current });
    }
    if REFUSED.load(Ordering::Acquire) {
        return None;
    }
    init_once()
}

fn init_once() -> Option<&'static Process> {
    while INIT_LOCK
        .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        std::thread::yield_now();
    }
    let result = if !PROCESS.load(Ordering::Acquire).is_null() || REFUSED.load(Ordering::Acquire) {
        let current = PROCESS.load(Ordering::Acquire);
        // SAFETY: as in get().
        (!current.is_null()).then(|| unsafe { &*current })
    } else {
        // A panic while creating must not leave the lock held (every later call would spin):
        // it refuses CUDA like any other failure to obey the environment.
        let created = std::panic::catch_unwind(create).unwrap_or_else(|_| {
            log_error!("internal error while reading the limits; CUDA is refused in this process (fail closed)");
            None
        });
        match created {
            Some(process) => {
                let leaked: &'static Process = Box::leak(Box::new(process));
                let throttles = leaked.config.throttles();
                PROCESS.store(leaked as *const Process as *mut Process, Ordering::Release);
                GATE.store(
                    if throttles { GATE_THROTTLE } else { GATE_PASS },
                    Ordering::Release,
                );
                Some(leaked)
            }
            None => {
                REFUSED.store(true, Ordering::Release);
                GATE.store(GATE_REFUSED, Ordering::Release);
                None
            }
        }
    };
    INIT_LOCK.store(false, Ordering::Release);
    result
}

fn environment() -> Vec<(String, Option<String>)> {
    std::env::vars_os()
        .filter_map(|(name, value)| Some((name.into_string().ok()?, value.into_string().ok())))
        .collect()
}

fn create() -> Option<Process> {
    // First: a fork while this thread opens the shared files must close them in the child.
    register_atfork();
    let vars = environment();
    let level = vars
        .iter()
        .find(|(k, _)| k == env::LOG_LEVEL)
        .and_then(|(_, v)| v.as_deref());
    crate::log::set_level(env::parse_log_level(level));
    let parsed = env::parse(vars);
    for warning in &parsed.warnings {
        log_warn!("{warning}");
    }
    let config = match parsed.config {
        Ok(config) => config,
        Err(errors) => {
            for error in errors {
                log_error!("{error}; CUDA is refused in this process (fail closed)");
            }
            return None;
        }
    };
    let file = if config.limits_anything() {
        let opened =
            SharedFile::open(&config.shared_cache).and_then(|f| f.attach(&config).map(|a| (f, a)));
        match opened {
            Ok((file, attached)) => {
                let ours = layout::describe(&config.memory_limit, &config.sm_limit);
                match attached {
                    Attached::LimitsReplaced { old } => log_warn!(
                        "{} was made with limits {old}; this process's environment says {ours}: the file now holds these (charges of live processes kept)",
                        config.shared_cache
                    ),
                    Attached::Reinitialised { found } => log_warn!(
                        "{} held {found}; re-initialised with limits {ours}",
                        config.shared_cache
                    ),
                    Attached::Created | Attached::Matching => {}
                }
                log_info!("limits {ours}; shared file {}", config.shared_cache);
                Some(file)
            }
            Err(error) => {
                log_error!(
                    "{error} ({}={:?}); CUDA is refused in this process (fail closed)",
                    env::SHARED_CACHE,
                    config.shared_cache
                );
                return None;
            }
        }
    } else {
        None
    };
    let arbiters = match (&file, config.throttles()) {
        (Some(file), true) => open_arbiters(&config, file)?,
        _ => Default::default(),
    };
    if arbiters.iter().any(Option::is_some) && !ATEXIT_REGISTERED.swap(true, Ordering::AcqRel) {
        // SAFETY: registers a handler that gives the card and our records back.
        unsafe { libc::atexit(release_slot_at_exit) };
    }
    Some(Process {
        config,
        file,
        slot: AtomicUsize::new(NO_SLOT),
        inner: Mutex::new(Inner {
            allocations: Allocations::default(),
            primaries: std::collections::HashMap::new(),
            context: [ContextSource::Unknown; MAX_DEVICES],
            last_refresh_ns: [0; MAX_DEVICES],
            context_baseline: [None; MAX_DEVICES],
        }),
        claim_map: OnceLock::new(),
        only_device: OnceLock::new(),
        by_cudevice: [const { AtomicI32::new(CACHE_UNKNOWN) }; CUDEVICE_CACHE],
        nvml: OnceLock::new(),
        nvml_devices: Mutex::new([0; MAX_DEVICES]),
        host_pid: AtomicU32::new(0),
        initial_pid_namespace: in_initial_pid_namespace(),
        arbiters,
        claim_map_unreadable: AtomicBool::new(false),
    })
}

/// Where a claim index's arbiter is: the driver's file for the card, else one of the container's
/// own, next to its accounting file (its processes then take turns among themselves only).
pub fn arbiter_path(config: &Config, index: usize) -> String {
    config.arbiter[index]
        .clone()
        .unwrap_or_else(|| format!("{}.arbiter-{index}", config.shared_cache))
}

/// Joins the arbiter of every card with an SM limit, as a member of the tenant the container's
/// accounting file identifies. A file that cannot be opened refuses CUDA (fail closed): the limit
/// would not hold.
fn open_arbiters(config: &Config, file: &SharedFile) -> Option<[Option<Arbiter>; MAX_DEVICES]> {
    let Some(identity) = file.identity() else {
        log_error!(
            "cannot read the identity of {}; CUDA is refused in this process (fail closed)",
            file.path()
        );
        return None;
    };
    let mut arbiters: [Option<Arbiter>; MAX_DEVICES] = Default::default();
    for (index, limit) in config.sm_limit.iter().enumerate() {
        let Some(weight) = *limit else { continue };
        let path = arbiter_path(config, index);
        let member = Member {
            key: arbiter::tenant_key(identity),
            weight,
            force: config.policy == env::UtilizationPolicy::Force,
        };
        match Arbiter::open(&path, member) {
            Ok(opened) => {
                if config.arbiter[index].is_none() {
                    log_info!("device {index}: no {}_{index}: the card's turns are taken among this container's processes only ({path})", env::ARBITER);
                }
                arbiters[index] = Some(opened);
            }
            Err(error) => {
                log_error!(
                    "{error} ({}_{index}); CUDA is refused in this process (fail closed)",
                    env::ARBITER
                );
                return None;
            }
        }
    }
    Some(arbiters)
}

/// In the host's PID namespace our PID is what NVML reports. (The initial namespace's inode is
/// fixed: PROC_PID_INIT_INO.)
fn in_initial_pid_namespace() -> bool {
    std::fs::read_link("/proc/self/ns/pid")
        .map(|p| p.as_os_str() == "pid:[4026531836]")
        .unwrap_or(false)
}

fn register_atfork() {
    if !ATFORK_REGISTERED.swap(true, Ordering::AcqRel) {
        // SAFETY: registers handlers that only do atomic loads and stores and close(2).
        unsafe { libc::pthread_atfork(Some(before_fork), None, Some(after_fork_in_child)) };
    }
}

/// The parent, before a fork: no shared file half opened (see `sys::before_fork`).
extern "C" fn before_fork() {
    crate::sys::before_fork();
}

/// The child of a fork starts over: it must not use the parent's slot (its OFD locks belong to
/// the description it shares with the parent; unlocking them would release the parent's) and
/// re-attaches on first use with its own description. The parent's state is leaked in the child,
/// never touched again (a mutex in it may be held by a thread that does not exist here).
extern "C" fn after_fork_in_child() {
    // The parent's shared files, its published state's and those another thread was opening
    // when the fork happened alike.
    PROCESS.store(std::ptr::null_mut(), Ordering::Release);
    crate::sys::close_owned_after_fork();
    REFUSED.store(false, Ordering::Release);
    GATE.store(GATE_UNINIT, Ordering::Release);
    INIT_LOCK.store(false, Ordering::Release);
}

/// A process that exits normally gives its charges back at once (a killed one is reaped by the
/// next process that looks). A forked child that never re-attached finds no state and does nothing.
extern "C" fn release_slot_at_exit() {
    let current = PROCESS.load(Ordering::Acquire);
    if current.is_null() {
        return;
    }
    // SAFETY: the leaked state is never freed.
    let process = unsafe { &*current };
    if let (Some(file), Some(slot)) = (process.file.as_ref(), process.slot_if_claimed()) {
        file.release_slot(slot);
    }
    for arbiter in process.arbiters.iter().flatten() {
        arbiter.leave();
    }
}

fn cuda_ok(rc: Option<CUresult>) -> bool {
    rc == Some(CUDA_SUCCESS)
}

impl Process {
    fn inner(&self) -> MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn file(&self) -> Option<&SharedFile> {
        self.file.as_ref()
    }

    /// The card's arbiter of a claim index with an SM limit.
    pub fn arbiter(&self, index: usize) -> Option<&Arbiter> {
        self.arbiters.get(index)?.as_ref()
    }

    /// Whether the memory of a claim index is limited.
    pub fn memory_limit(&self, device: usize) -> Option<u64> {
        self.file.as_ref().and(self.config.memory_limit[device])
    }

    pub fn limits_memory(&self) -> bool {
        self.file.is_some() && self.config.memory_limit.iter().any(Option::is_some)
    }

    fn limits_device(&self, device: usize) -> bool {
        self.file.is_some()
            && (self.config.memory_limit[device].is_some()
                || self.config.sm_limit[device].is_some())
    }

    pub fn nvml(&self) -> Option<&Nvml> {
        self.nvml
            .get_or_init(|| {
                let loaded = Nvml::load();
                if loaded.is_none() {
                    log_info!("NVML is not available: context memory is estimated and SM limits run open loop");
                }
                loaded
            })
            .as_ref()
    }

    /// The claim index -> UUID map: the driver's `GPUPOOL_DEVICE_UUID_<i>`, else what the file
    /// recorded, else CUDA ordinal i here (recorded for later processes). None until CUDA can be
    /// asked (before `cuInit`) and nothing else says.
    pub fn claim_map(&self) -> Option<[Option<Uuid>; MAX_DEVICES]> {
        if let Some(map) = self.claim_map.get() {
            return Some(*map);
        }
        let file = self.file.as_ref()?;
        let mut proposed = [None; MAX_DEVICES];
        let mut count = 0;
        let cuda_answered = cuda_ok(unsafe { driver::cuDeviceGetCount(&mut count) });
        if cuda_answered {
            for (ordinal, entry) in proposed
                .iter_mut()
                .enumerate()
                .take(count.clamp(0, MAX_DEVICES as i32) as usize)
            {
                let mut device = 0;
                if cuda_ok(unsafe { driver::cuDeviceGet(&mut device, ordinal as i32) }) {
                    *entry = cuda_uuid(device);
                }
            }
        }
        let (map, replaced) = match file.merge_uuid_map(&self.config.device_uuid, &proposed) {
            Ok(merged) => (merged.map, merged.replaced),
            Err(error) => {
                self.claim_map_unreadable.store(true, Ordering::Release);
                log_error!("{error}; allocations are refused until it can be read");
                return None;
            }
        };
        self.claim_map_unreadable.store(false, Ordering::Release);
        for (index, had, now) in replaced {
            log_warn!(
                "{}: device {index} was recorded as {had}; {}_{index} says {now}",
                file.path(),
                env::DEVICE_UUID
            );
        }
        if cuda_answered {
            let listed: Vec<String> = map
                .iter()
                .enumerate()
                .filter_map(|(i, u)| u.map(|u| format!("{i}={u}")))
                .collect();
            log_info!("devices of the claim: {}", listed.join(" "));
            let _ = self.claim_map.set(map);
        }
        Some(map)
    }

    /// The claim index of a CUDA device, by its UUID; None for a device outside the claim.
    pub fn device_index(&self, device: CUdevice) -> Option<usize> {
        let cache = usize::try_from(device)
            .ok()
            .filter(|&d| d < CUDEVICE_CACHE)
            .map(|d| &self.by_cudevice[d]);
        if let Some(cached) = cache.map(|c| c.load(Ordering::Relaxed)) {
            if cached >= 0 {
                return Some(cached as usize);
            }
            if cached == CACHE_NOT_OURS {
                return None;
            }
        }
        let map = self.claim_map()?;
        let uuid = cuda_uuid(device)?;
        let index = map.iter().position(|u| *u == Some(uuid));
        if self.claim_map.get().is_some() {
            if let Some(cache) = cache {
                cache.store(
                    index.map(|i| i as i32).unwrap_or(CACHE_NOT_OURS),
                    Ordering::Relaxed,
                );
            }
        }
        index
    }

    /// The claim index a launch runs on: the only visible device's when there is one (no driver
    /// call per launch), else the current context's (a stream of another context cannot be
    /// launched on without making that context current).
    pub fn launch_device(&self) -> Option<usize> {
        if let Some(only) = self.only_device.get() {
            return only.or_else(|| self.current_device()?.1);
        }
        let mut count = 0;
        if cuda_ok(unsafe { driver::cuDeviceGetCount(&mut count) })
            && self.claim_map.get().is_some()
        {
            let mut device = 0;
            let only = (count == 1 && cuda_ok(unsafe { driver::cuDeviceGet(&mut device, 0) }))
                .then(|| self.device_index(device))
                .flatten();
            let _ = self.only_device.set(only);
        }
        self.current_device()?.1
    }

    /// The device of the current context, and its claim index.
    pub fn current_device(&self) -> Option<(CUdevice, Option<usize>)> {
        let mut device = 0;
        cuda_ok(unsafe { driver::cuCtxGetDevice(&mut device) })
            .then(|| (device, self.device_index(device)))
    }

    /// The device a stream belongs to (the current context's when the driver cannot say). Asked
    /// in the relaxed capture mode, and not at all of a capturing stream: driver 580 refuses
    /// `cuStreamGetDevice` during a global capture and invalidates the capture, which would make
    /// a legal `cudaMallocAsync` break another thread's CUDA graph.
    #[allow(clippy::not_unsafe_ptr_arg_deref)] // the stream is an opaque handle for the driver
    pub fn stream_device(&self, stream: CUstream) -> Option<(CUdevice, Option<usize>)> {
        if driver::capturing(stream) {
            return self.current_device();
        }
        let mut device = 0;
        if cuda_ok(driver::relaxed(|| unsafe {
            driver::cuStreamGetDevice(stream, &mut device)
        })) {
            return Some((device, self.device_index(device)));
        }
        self.current_device()
    }

    /// The claim index of a device handle from the program's NVML: by its UUID in the claim
    /// map; when nothing says which card an index is (no `GPUPOOL_DEVICE_UUID_<i>`, and no CUDA
    /// process of the container recorded its ordinals yet, as when only HAMi-core's variables are
    /// set and `nvidia-smi` is the first to look), by HAMi-core's rule: NVML index `i` is claim
    /// index `i` (a container's NVML lists only its own cards). Not recorded: a CUDA process later
    /// records what CUDA says.
    #[allow(clippy::not_unsafe_ptr_arg_deref)] // an opaque handle for NVML
    pub fn nvml_device_index(&self, device: nvmlDevice_t) -> Option<usize> {
        let nvml = self.nvml()?;
        let uuid = nvml.uuid_of(device)?;
        let map = self.claim_map()?;
        if let Some(index) = map.iter().position(|u| *u == Some(uuid)) {
            return Some(index);
        }
        if map.iter().all(Option::is_none) {
            return nvml.index_of(device).filter(|&i| i < MAX_DEVICES);
        }
        None
    }

    /// NVML's handle of a claim index's card (cached).
    pub fn nvml_device(&self, index: usize) -> Option<nvmlDevice_t> {
        let nvml = self.nvml()?;
        let cached = self.nvml_devices.lock().unwrap_or_else(|p| p.into_inner())[index];
        if cached != 0 {
            return Some(cached as nvmlDevice_t);
        }
        let uuid = self.claim_map()?[index]?;
        let device = nvml.device_by_uuid(uuid)?;
        self.nvml_devices.lock().unwrap_or_else(|p| p.into_inner())[index] = device as usize;
        Some(device)
    }

    pub fn host_pid(&self) -> Option<u32> {
        Some(self.host_pid.load(Ordering::Acquire)).filter(|&p| p != 0)
    }

    fn set_host_pid(&self, pid: u32, how: &str) {
        if self.host_pid.swap(pid, Ordering::AcqRel) == pid {
            return;
        }
        if let (Some(file), Some(slot)) = (self.file.as_ref(), self.slot_if_claimed()) {
            file.set_host_pid(slot, pid);
        }
        log_info!("host PID {pid} ({how})");
    }

    /// NVML's process list on a card, as PIDs.
    fn card_pids(&self, index: usize) -> Option<Vec<u32>> {
        let list = self.nvml()?.processes(self.nvml_device(index)?)?;
        Some(list.iter().map(|p| p.pid).collect())
    }

    /// In the host's PID namespace, our PID is NVML's as soon as NVML lists it on the card.
    fn confirm_own_pid(&self, index: usize) -> Option<u32> {
        if let Some(pid) = self.host_pid() {
            return Some(pid);
        }
        let own = std::process::id();
        if self.initial_pid_namespace && self.card_pids(index)?.contains(&own) {
            self.set_host_pid(
                own,
                "our own: we are in the host's PID namespace and NVML lists it",
            );
            return Some(own);
        }
        None
    }

    /// Our slot in the shared file, claimed on first need and held until the process exits.
    pub fn slot(&self) -> Option<usize> {
        let slot = self.slot.load(Ordering::Acquire);
        if slot != NO_SLOT {
            return Some(slot);
        }
        let file = self.file.as_ref()?;
        let _serialise = self.inner();
        let slot = self.slot.load(Ordering::Acquire);
        if slot != NO_SLOT {
            return Some(slot);
        }
        match file.claim_slot(std::process::id()) {
            Ok(slot) => {
                self.slot.store(slot, Ordering::Release);
                if !ATEXIT_REGISTERED.swap(true, Ordering::AcqRel) {
                    // SAFETY: registers a handler that only does atomic stores.
                    unsafe { libc::atexit(release_slot_at_exit) };
                }
                if let Some(pid) = self.host_pid() {
                    file.set_host_pid(slot, pid);
                }
                Some(slot)
            }
            Err(error) => {
                log_error!("{error}");
                None
            }
        }
    }

    fn log_reaped(&self, reaped: &[Reaped]) {
        for dead in reaped {
            log_info!(
                "released {} bytes held by process {}, which has exited",
                dead.bytes,
                dead.pid
            );
        }
    }

    /// Charges an allocation before the driver is asked. `Ok(None)`: the device is not limited
    /// (nothing recorded); `Err(CUDA_ERROR_OUT_OF_MEMORY)`: over the limit (or the file failed).
    pub fn reserve(&self, device: Option<usize>, bytes: u64) -> Result<Option<Charged>, CUresult> {
        let Some(index) = device else {
            // Outside the claim: not ours to count. Unless nobody could tell (the device map was
            // unreadable): then it may be the claim's, and it is refused (fail closed).
            if self.limits_memory() && self.claim_map_unreadable.load(Ordering::Acquire) {
                return Err(CUDA_ERROR_OUT_OF_MEMORY);
            }
            return Ok(None);
        };
        let (Some(limit), Some(file)) = (self.memory_limit(index), self.file.as_ref()) else {
            return Ok(None);
        };
        let Some(slot) = self.slot() else {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        };
        self.refresh_context(index, false);
        for attempt in 0..2 {
            match file.charge(slot, index, bytes, limit) {
                Ok(Charge::Recorded { reaped }) => {
                    self.log_reaped(&reaped);
                    return Ok(Some(Charged {
                        device: index,
                        bytes,
                    }));
                }
                Ok(Charge::Refused { charged, reaped }) => {
                    self.log_reaped(&reaped);
                    // Context memory may have shrunk (a pool trimmed): look again once.
                    if attempt == 0 && self.refresh_context(index, true) {
                        continue;
                    }
                    log_info!("out of memory on device {index}: {bytes} bytes asked, the container holds {charged} of its {limit}");
                    return Err(CUDA_ERROR_OUT_OF_MEMORY);
                }
                Err(error) => {
                    log_error!("{error}; the allocation is refused");
                    return Err(CUDA_ERROR_OUT_OF_MEMORY);
                }
            }
        }
        Err(CUDA_ERROR_OUT_OF_MEMORY)
    }

    /// Gives back a charge (a free, or a failed allocation).
    pub fn release(&self, charge: Charged) {
        if let (Some(file), Some(slot)) = (self.file.as_ref(), self.slot()) {
            file.uncharge(slot, charge.device, charge.bytes);
        }
    }

    /// Moves a charge to the exact size the driver reports after the allocation.
    pub fn adjust(&self, charge: Charged, exact: u64) -> Result<Charged, CUresult> {
        if exact > charge.bytes {
            self.reserve(Some(charge.device), exact - charge.bytes)?;
        } else {
            self.release(Charged {
                device: charge.device,
                bytes: charge.bytes - exact,
            });
        }
        Ok(Charged {
            device: charge.device,
            bytes: exact,
        })
    }

    /// The current context (0 when none or unknown): what frees a pointer if it is destroyed.
    pub fn current_context(&self) -> usize {
        let mut context: CUcontext = std::ptr::null_mut();
        if cuda_ok(unsafe { driver::cuCtxGetCurrent(&mut context) }) {
            context as usize
        } else {
            0
        }
    }

    /// Records a pointer allocation made in the current context.
    pub fn record_pointer(&self, ptr: CUdeviceptr, charge: Charged) {
        let context = self.current_context();
        self.with_allocations(|a| a.add_pointer(ptr, charge, context));
    }

    /// Records a managed allocation made in the current context.
    pub fn record_managed(&self, ptr: CUdeviceptr, charge: Charged) {
        let context = self.current_context();
        self.with_allocations(|a| a.add_managed(ptr, charge, context));
    }

    /// The primary context of a device, as last retained (its handle frees its allocations when
    /// it is reset or released for the last time).
    pub fn remember_primary(&self, device: CUdevice, context: usize) {
        self.inner().primaries.insert(device, context);
    }

    /// The handle of a device's primary context, as last retained.
    pub fn primary_context(&self, device: CUdevice) -> Option<usize> {
        self.inner().primaries.get(&device).copied()
    }

    /// A device's primary context is gone: its allocations with it, and its context memory,
    /// whatever measured it (NVML's per-process figure too: it is only read again when this
    /// process allocates or asks for a view, and a process idle after `cudaDeviceReset` would stay
    /// charged a context it no longer has). The next context is measured again.
    pub fn primary_destroyed(&self, device: CUdevice) {
        let Some(context) = self.inner().primaries.remove(&device) else {
            return;
        };
        self.context_destroyed(context);
        let Some(index) = self.device_index(device) else {
            return;
        };
        {
            let mut inner = self.inner();
            inner.context[index] = ContextSource::Unknown;
            inner.context_baseline[index] = None;
        }
        if let (Some(file), Some(slot)) = (self.file.as_ref(), self.slot_if_claimed()) {
            file.set_context(slot, index, 0);
        }
    }

    /// Releases what the driver freed with a destroyed context.
    pub fn context_destroyed(&self, context: usize) {
        if context == 0 {
            return;
        }
        for charge in self.with_allocations(|a| a.remove_context(context)) {
            self.release(charge);
        }
    }

    /// This process's records of what it allocated. Nothing is recorded without a memory limit,
    /// so then a free, a destroy or a release asks nothing and takes no lock (the default
    /// answer: not one of ours).
    pub fn with_allocations<R: Default>(&self, f: impl FnOnce(&mut Allocations) -> R) -> R {
        if !self.limits_memory() {
            return R::default();
        }
        f(&mut self.inner().allocations)
    }

    /// Re-reads context memory from NVML's per-process figure (when our host PID is known):
    /// what NVML says the process uses on the card minus what we track. Returns whether the
    /// charged value changed. Rate-limited unless `force`.
    fn refresh_context(&self, index: usize, force: bool) -> bool {
        let (Some(file), Some(slot)) = (self.file.as_ref(), self.slot_if_claimed()) else {
            return false;
        };
        {
            let mut inner = self.inner();
            if !matches!(
                inner.context[index],
                ContextSource::Unknown | ContextSource::NvmlPerProcess
            ) {
                return false;
            }
            let now = now_ns();
            if !force
                && now.saturating_sub(inner.last_refresh_ns[index])
                    < CONTEXT_REFRESH.as_nanos() as u64
            {
                return false;
            }
            inner.last_refresh_ns[index] = now;
        }
        let Some(pid) = self.confirm_own_pid(index) else {
            return false;
        };
        let Some(used) = self.nvml_used(index, pid) else {
            return false;
        };
        let mut inner = self.inner();
        let managed = inner.allocations.managed_on(index);
        let context = context_bytes(
            used,
            file.tracked(slot, index),
            managed,
            inner.context_baseline[index],
        );
        if managed == 0 {
            inner.context_baseline[index] = Some(context);
        }
        let old = file.context(slot, index);
        file.set_context(slot, index, context);
        if inner.context[index] == ContextSource::Unknown {
            inner.context[index] = ContextSource::NvmlPerProcess;
            log_info!("context memory on device {index}: {context} bytes, from NVML's per-process figure (kept up to date)");
        }
        old != context
    }

    fn nvml_used(&self, index: usize, pid: u32) -> Option<u64> {
        let device = self.nvml_device(index)?;
        self.nvml()?
            .processes(device)?
            .iter()
            .find(|p| p.pid == pid)?
            .used_bytes
    }

    fn slot_if_claimed(&self) -> Option<usize> {
        Some(self.slot.load(Ordering::Acquire)).filter(|&s| s != NO_SLOT)
    }

    /// Called before a context is created on `device`: what is needed to measure it afterwards.
    /// None when there is nothing to measure (not a limited device, not our first context there,
    /// or a primary context that already exists).
    pub fn before_context(&self, device: CUdevice, primary: bool) -> Option<ContextProbe> {
        let index = self.device_index(device)?;
        if !self.limits_device(index) || self.inner().context[index] != ContextSource::Unknown {
            return None;
        }
        if primary {
            let (mut flags, mut active) = (0, 0);
            if cuda_ok(unsafe {
                driver::cuDevicePrimaryCtxGetState(device, &mut flags, &mut active)
            }) && active != 0
            {
                return None;
            }
        }
        let nvml_device = self.nvml_device(index);
        let pids_before = if self.host_pid().is_none() {
            self.card_pids(index)
        } else {
            None
        };
        let free_before = match (nvml_device, self.nvml()) {
            (Some(d), Some(nvml)) => nvml.memory(d).map(|(_, free)| free),
            _ => None,
        };
        Some(ContextProbe {
            index,
            pids_before,
            free_before,
        })
    }

    /// Called after the context was created: finds our host PID if needed and charges the
    /// context's memory, from the best source available (logged).
    pub fn after_context(&self, probe: ContextProbe) {
        let index = probe.index;
        let (Some(file), Some(slot)) = (self.file.as_ref(), self.slot()) else {
            return;
        };
        let nvml_device = self.nvml_device(index);
        if self.confirm_own_pid(index).is_none() {
            if let (Some(before), Some(after)) = (&probe.pids_before, self.card_pids(index)) {
                let new: Vec<u32> = after
                    .iter()
                    .copied()
                    .filter(|p| !before.contains(p))
                    .collect();
                if let [pid] = new[..] {
                    self.set_host_pid(
                        pid,
                        "the one new process in NVML's list across our context's creation",
                    );
                } else {
                    log_info!("host PID unknown: {} new processes in NVML's list across our context's creation", new.len());
                }
            }
        }
        if self.refresh_context(index, true)
            || self.inner().context[index] == ContextSource::NvmlPerProcess
        {
            return;
        }
        let free_after = match (nvml_device, self.nvml()) {
            (Some(d), Some(nvml)) => nvml.memory(d).map(|(_, free)| free),
            _ => None,
        };
        let (bytes, source) = match (probe.free_before, free_after) {
            (Some(before), Some(after)) => (
                before.saturating_sub(after).min(CONTEXT_DROP_BOUND),
                ContextSource::CreationDrop,
            ),
            _ => (CONTEXT_ESTIMATE, ContextSource::Estimate),
        };
        let mut inner = self.inner();
        if inner.context[index] != ContextSource::Unknown {
            return;
        }
        inner.context[index] = source;
        drop(inner);
        file.set_context(slot, index, bytes);
        match source {
            ContextSource::CreationDrop => log_info!(
                "context memory on device {index}: {bytes} bytes, the drop of the card's free memory around its creation (host PID unknown)"
            ),
            _ => log_info!("context memory on device {index}: {bytes} bytes, an estimate (no NVML)"),
        }
    }

    /// The memory view of a limited device, from the card's real free memory.
    pub fn view(&self, index: usize, real_free: u64) -> Option<MemoryView> {
        let limit = self.memory_limit(index)?;
        let file = self.file.as_ref()?;
        self.refresh_context(index, false);
        match file.reap_if_due(self.slot_if_claimed()) {
            Ok(reaped) => self.log_reaped(&reaped),
            Err(error) => log_error!("{error}"),
        }
        Some(memory_view(limit, file.charged(index), real_free))
    }
}

/// What [`Process::before_context`] saw.
pub struct ContextProbe {
    index: usize,
    pids_before: Option<Vec<u32>>,
    free_before: Option<u64>,
}

fn cuda_uuid(device: CUdevice) -> Option<Uuid> {
    let mut uuid = CUuuid::default();
    cuda_ok(unsafe { driver::cuDeviceGetUuid(&mut uuid, device) }).then_some(Uuid(uuid.bytes))
}

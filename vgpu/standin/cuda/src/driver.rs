//! The process's driver state: initialisation (`cuInit`, `CUDA_VISIBLE_DEVICES`), the simulated cards,
//! handles, and the guard every exported function runs its body in.

use crate::ffi::*;
use gpupool_standin_device::Sim;
use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::{Mutex, MutexGuard, OnceLock};

/// What `cuDriverGetVersion` reports: the CUDA version of the header this stand-in mirrors.
pub const DRIVER_VERSION: i32 = 12090;

pub struct Driver {
    pub sim: Sim,
    /// CUDA ordinal -> index of the card in the state file.
    pub visible: Vec<usize>,
    /// The process that initialised (a forked child does not inherit the driver).
    pub pid: u32,
    state: Mutex<crate::State>,
}

static DRIVER: OnceLock<Result<Driver, CUresult>> = OnceLock::new();

/// Runs an entry point's body: a panic becomes `CUDA_ERROR_UNKNOWN` (never an abort of the caller).
pub fn entry(f: impl FnOnce() -> Result<(), CUresult>) -> CUresult {
    match std::panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => CUDA_SUCCESS,
        Ok(Err(e)) => e,
        Err(_) => {
            eprintln!("gpupool-standin-cuda: internal error (panic) in an entry point");
            CUDA_ERROR_UNKNOWN
        }
    }
}

pub fn init(flags: u32) -> Result<(), CUresult> {
    if flags != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    match DRIVER.get_or_init(open) {
        Ok(d) if d.pid != std::process::id() => Err(CUDA_ERROR_NOT_INITIALIZED),
        Ok(_) => Ok(()),
        Err(e) => Err(*e),
    }
}

/// The initialised driver, or the error every entry point returns before a successful `cuInit`.
pub fn driver() -> Result<&'static Driver, CUresult> {
    match DRIVER.get() {
        None => Err(CUDA_ERROR_NOT_INITIALIZED),
        Some(Err(e)) => Err(*e),
        Some(Ok(d)) if d.pid != std::process::id() => Err(CUDA_ERROR_NOT_INITIALIZED),
        Some(Ok(d)) => Ok(d),
    }
}

impl Driver {
    pub fn state(&self) -> MutexGuard<'_, crate::State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn ordinal(&self, dev: CUdevice) -> Result<usize, CUresult> {
        usize::try_from(dev)
            .ok()
            .filter(|&o| o < self.visible.len())
            .ok_or(CUDA_ERROR_INVALID_DEVICE)
    }

    /// The state-file index of CUDA ordinal `dev`.
    pub fn physical(&self, dev: CUdevice) -> Result<usize, CUresult> {
        Ok(self.visible[self.ordinal(dev)?])
    }
}

fn open() -> Result<Driver, CUresult> {
    let mut sim = Sim::open_from_env().map_err(|e| {
        eprintln!("gpupool-standin-cuda: {e}");
        CUDA_ERROR_NO_DEVICE
    })?;
    let cards: Vec<String> = (0..sim.device_count())
        .map(|i| sim.device(i).uuid_string())
        .collect();
    let visible = visible_devices(
        std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref(),
        &cards,
    );
    if visible.is_empty() {
        return Err(CUDA_ERROR_NO_DEVICE);
    }
    let offset: u32 = std::env::var("GPUPOOL_STANDIN_HOST_PID_OFFSET")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    sim.attach(std::process::id() + offset).map_err(|e| {
        eprintln!("gpupool-standin-cuda: {e}");
        CUDA_ERROR_UNKNOWN
    })?;
    let state = crate::State::new(visible.len());
    Ok(Driver {
        sim,
        visible,
        pid: std::process::id(),
        state: Mutex::new(state),
    })
}

/// Which cards CUDA shows, in what order, as the real driver reads `CUDA_VISIBLE_DEVICES`: unset,
/// all; empty, none; otherwise a comma-separated list of indices or `GPU-` UUIDs (a unique prefix is
/// enough), enumerated in list order and ending at the first entry that names no card (an invalid
/// index or UUID, an ambiguous prefix, or a card listed twice).
pub fn visible_devices(value: Option<&str>, cards: &[String]) -> Vec<usize> {
    let Some(value) = value else {
        return (0..cards.len()).collect();
    };
    let mut out = Vec::new();
    for entry in value.split(',') {
        let entry = entry.trim();
        let found = if entry.starts_with("GPU-") {
            let lower = entry.to_ascii_lowercase();
            let matches: Vec<usize> = (0..cards.len())
                .filter(|&i| cards[i].to_ascii_lowercase().starts_with(&lower))
                .collect();
            (matches.len() == 1).then(|| matches[0])
        } else if !entry.is_empty() && entry.bytes().all(|b| b.is_ascii_digit()) {
            entry.parse::<usize>().ok().filter(|&i| i < cards.len())
        } else {
            None
        };
        match found {
            Some(i) if !out.contains(&i) => out.push(i),
            _ => break,
        }
    }
    out
}

/// Fake, never-dereferenced handle values: one counter for every kind of object, so that a handle
/// of one kind is never mistaken for another kind's.
pub struct Handles {
    next: usize,
}

impl Default for Handles {
    fn default() -> Handles {
        Handles {
            next: 0x5a00_0000_0000,
        }
    }
}

impl Handles {
    pub fn allocate(&mut self) -> usize {
        self.next += 0x40;
        self.next
    }
}

/// A registry of live objects of one kind, keyed by handle.
pub struct Registry<T> {
    map: HashMap<usize, T>,
}

impl<T> Default for Registry<T> {
    fn default() -> Self {
        Registry {
            map: HashMap::new(),
        }
    }
}

impl<T> Registry<T> {
    pub fn insert(&mut self, handle: usize, value: T) {
        self.map.insert(handle, value);
    }

    pub fn get(&self, handle: usize) -> Option<&T> {
        self.map.get(&handle)
    }

    pub fn get_mut(&mut self, handle: usize) -> Option<&mut T> {
        self.map.get_mut(&handle)
    }

    pub fn remove(&mut self, handle: usize) -> Option<T> {
        self.map.remove(&handle)
    }

    pub fn keys(&self) -> Vec<usize> {
        self.map.keys().copied().collect()
    }

    pub fn retain(&mut self, f: impl FnMut(&usize, &mut T) -> bool) {
        self.map.retain(f)
    }
}

pub fn uuid_of(sim: &Sim, physical: usize) -> [u8; 16] {
    sim.device(physical).uuid
}

#[cfg(test)]
mod tests {
    use super::visible_devices;

    fn cards() -> Vec<String> {
        vec![
            "GPU-aaaa1111-0000-0000-0000-000000000000".into(),
            "GPU-aaaa2222-0000-0000-0000-000000000000".into(),
            "GPU-bbbb3333-0000-0000-0000-000000000000".into(),
        ]
    }

    #[test]
    fn visible_devices_follow_the_real_rules() {
        let c = cards();
        assert_eq!(visible_devices(None, &c), vec![0, 1, 2]);
        assert_eq!(visible_devices(Some(""), &c), Vec::<usize>::new());
        assert_eq!(visible_devices(Some("2,1"), &c), vec![2, 1]);
        // An invalid entry hides itself and everything after it.
        assert_eq!(visible_devices(Some("0,2,-1,1"), &c), vec![0, 2]);
        assert_eq!(visible_devices(Some("0,7,1"), &c), vec![0]);
        // UUIDs, whole or as a unique prefix, mixed with indices.
        assert_eq!(
            visible_devices(Some("GPU-bbbb3333-0000-0000-0000-000000000000,0"), &c),
            vec![2, 0]
        );
        assert_eq!(visible_devices(Some("GPU-bb,GPU-AAAA2"), &c), vec![2, 1]);
        // An ambiguous prefix names no card.
        assert_eq!(visible_devices(Some("1,GPU-aaaa"), &c), vec![1]);
        // A card listed twice ends the list.
        assert_eq!(visible_devices(Some("1,1,2"), &c), vec![1]);
    }
}

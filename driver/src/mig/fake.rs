//! MIG on fake cards: the instances live in `<run-dir>/fake-mig.json`, written atomically after
//! every change, so a driver killed between two steps leaves exactly what a real card would keep
//! (instances survive the driver, not a reboot: the run folder is a tmpfs) and a crash test can
//! read it. It refuses what NVML refuses: a placement the profile does not have, one that
//! overlaps an instance, MIG mode off, switching the mode while instances exist, a GPU instance
//! destroyed before its compute instances.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use gpupool_api::inventory::Inventory;
use serde::{Deserialize, Serialize};

use super::{ComputeInstance, GpuInstance, MigError, MigErrorKind, MigManager, Placement};

/// The file, in the run folder.
pub const STATE_FILE: &str = "fake-mig.json";

/// What the file holds, by card UUID.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FakeCards {
    pub cards: BTreeMap<String, FakeCard>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FakeCard {
    pub enabled: bool,
    pub gpu_instances: Vec<FakeGpuInstance>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FakeGpuInstance {
    pub id: u32,
    pub profile_id: u32,
    pub start: u32,
    pub size: u32,
    /// Compute instance id -> MIG device UUID.
    pub compute_instances: BTreeMap<u32, String>,
}

/// The instances the file in `run_dir` holds (none when there is no file).
pub fn load(run_dir: &Path) -> FakeCards {
    std::fs::read(run_dir.join(STATE_FILE))
        .ok()
        .and_then(|bytes| serde_json::from_slice(&bytes).ok())
        .unwrap_or_default()
}

/// The fake cards' MIG, one process at a time (the driver's calls on the node take turns).
#[derive(Debug)]
pub struct FakeMig {
    path: PathBuf,
    /// The placements each card's profiles allow, from the inventory: card -> profile -> starts.
    geometry: BTreeMap<String, BTreeMap<u32, Vec<u32>>>,
    lock: Mutex<()>,
}

impl FakeMig {
    /// The cards of `inventory` that have MIG; the file keeps what an earlier start left, and a
    /// card it does not know yet starts in the mode the inventory says.
    pub fn new(run_dir: &Path, inventory: &Inventory) -> std::io::Result<Self> {
        let path = run_dir.join(STATE_FILE);
        let mut state = load(run_dir);
        let mut geometry = BTreeMap::new();
        for gpu in &inventory.gpus {
            let Some(mig) = &gpu.mig else { continue };
            geometry.insert(
                gpu.uuid.clone(),
                mig.profiles
                    .iter()
                    .map(|p| (p.id, p.placements.clone()))
                    .collect(),
            );
            state
                .cards
                .entry(gpu.uuid.clone())
                .or_insert_with(|| FakeCard {
                    enabled: mig.enabled,
                    gpu_instances: Vec::new(),
                });
        }
        let fake = FakeMig {
            path,
            geometry,
            lock: Mutex::new(()),
        };
        if !state.cards.is_empty() {
            std::fs::create_dir_all(run_dir)?;
            fake.save(&state)
                .map_err(|e| std::io::Error::other(e.to_string()))?;
        }
        Ok(fake)
    }

    fn load(&self) -> FakeCards {
        self.path.parent().map(load).unwrap_or_default()
    }

    fn save(&self, state: &FakeCards) -> Result<(), MigError> {
        let fail = |e: std::io::Error| {
            MigError::new(
                format!("writing {}", self.path.display()),
                MigErrorKind::Failed(e.to_string()),
            )
        };
        let bytes = serde_json::to_vec_pretty(state).expect("plain JSON");
        let temp = self.path.with_extension("json.tmp");
        std::fs::write(&temp, bytes).map_err(fail)?;
        std::fs::rename(&temp, &self.path).map_err(fail)
    }

    /// Runs `change` on the card's state under the lock and saves it when it succeeds.
    fn with_card<T>(
        &self,
        parent_uuid: &str,
        step: &str,
        change: impl FnOnce(&mut FakeCard) -> Result<T, MigErrorKind>,
    ) -> Result<T, MigError> {
        let _turn = self.lock.lock().expect("never poisoned");
        let mut state = self.load();
        let Some(card) = state.cards.get_mut(parent_uuid) else {
            return Err(MigError::new(
                format!("{step} on {parent_uuid}"),
                MigErrorKind::Failed("not a MIG-capable card of this node".into()),
            ));
        };
        let out =
            change(card).map_err(|kind| MigError::new(format!("{step} on {parent_uuid}"), kind))?;
        self.save(&state)?;
        Ok(out)
    }
}

impl MigManager for FakeMig {
    fn mig_enabled(&self, parent_uuid: &str) -> Result<bool, MigError> {
        let _turn = self.lock.lock().expect("never poisoned");
        self.load()
            .cards
            .get(parent_uuid)
            .map(|c| c.enabled)
            .ok_or_else(|| {
                MigError::new(
                    format!("reading MIG mode of {parent_uuid}"),
                    MigErrorKind::Failed("not a MIG-capable card of this node".into()),
                )
            })
    }

    fn set_mig_enabled(&self, parent_uuid: &str, enabled: bool) -> Result<(), MigError> {
        let step = format!("switching MIG mode {}", if enabled { "on" } else { "off" });
        self.with_card(parent_uuid, &step, |card| {
            if !card.gpu_instances.is_empty() {
                return Err(MigErrorKind::InUse);
            }
            card.enabled = enabled;
            Ok(())
        })
    }

    fn create_gpu_instance(&self, placement: &Placement) -> Result<u32, MigError> {
        let allowed = self
            .geometry
            .get(&placement.parent_uuid)
            .and_then(|profiles| profiles.get(&placement.profile_id))
            .is_some_and(|starts| starts.contains(&placement.start));
        let step = format!(
            "creating GPU instance of profile {} at memory slice {}",
            placement.profile_id, placement.start
        );
        self.with_card(&placement.parent_uuid, &step, |card| {
            if !card.enabled {
                return Err(MigErrorKind::Failed("MIG mode is off".into()));
            }
            if !allowed {
                return Err(MigErrorKind::Failed(
                    "not a possible placement of this profile".into(),
                ));
            }
            let wanted = placement.start..placement.start + placement.size;
            if card
                .gpu_instances
                .iter()
                .any(|gi| gi.start < wanted.end && wanted.start < gi.start + gi.size)
            {
                return Err(MigErrorKind::Occupied);
            }
            // NVML hands out the lowest free id, from 1.
            let id = (1..)
                .find(|id| card.gpu_instances.iter().all(|gi| gi.id != *id))
                .expect("a free id");
            card.gpu_instances.push(FakeGpuInstance {
                id,
                profile_id: placement.profile_id,
                start: placement.start,
                size: placement.size,
                compute_instances: BTreeMap::new(),
            });
            Ok(id)
        })
    }

    fn create_compute_instance(
        &self,
        parent_uuid: &str,
        gpu_instance: u32,
        _compute_slices: u32,
    ) -> Result<ComputeInstance, MigError> {
        let step = format!("creating the compute instance of GPU instance {gpu_instance}");
        self.with_card(parent_uuid, &step, |card| {
            let gi = card
                .gpu_instances
                .iter_mut()
                .find(|gi| gi.id == gpu_instance)
                .ok_or_else(|| MigErrorKind::Failed("no such GPU instance".into()))?;
            if !gi.compute_instances.is_empty() {
                // One compute instance spans the whole GPU instance.
                return Err(MigErrorKind::Occupied);
            }
            let uuid = format!("MIG-{}", uuid::Uuid::new_v4());
            gi.compute_instances.insert(0, uuid.clone());
            Ok(ComputeInstance {
                id: 0,
                uuid,
                device_nodes: Vec::new(),
            })
        })
    }

    fn destroy_compute_instance(
        &self,
        parent_uuid: &str,
        gpu_instance: u32,
        compute_instance: u32,
    ) -> Result<(), MigError> {
        let step = format!(
            "destroying compute instance {compute_instance} of GPU instance {gpu_instance}"
        );
        self.with_card(parent_uuid, &step, |card| {
            if let Some(gi) = card
                .gpu_instances
                .iter_mut()
                .find(|gi| gi.id == gpu_instance)
            {
                gi.compute_instances.remove(&compute_instance);
            }
            Ok(())
        })
    }

    fn destroy_gpu_instance(&self, parent_uuid: &str, gpu_instance: u32) -> Result<(), MigError> {
        let step = format!("destroying GPU instance {gpu_instance}");
        self.with_card(parent_uuid, &step, |card| {
            if card
                .gpu_instances
                .iter()
                .any(|gi| gi.id == gpu_instance && !gi.compute_instances.is_empty())
            {
                return Err(MigErrorKind::InUse);
            }
            card.gpu_instances.retain(|gi| gi.id != gpu_instance);
            Ok(())
        })
    }

    fn gpu_instances(&self, parent_uuid: &str) -> Result<Vec<GpuInstance>, MigError> {
        let _turn = self.lock.lock().expect("never poisoned");
        Ok(self
            .load()
            .cards
            .get(parent_uuid)
            .map(|card| {
                card.gpu_instances
                    .iter()
                    .map(|gi| GpuInstance {
                        id: gi.id,
                        profile_id: gi.profile_id,
                        start: gi.start,
                        size: gi.size,
                        compute_instances: gi.compute_instances.keys().copied().collect(),
                    })
                    .collect()
            })
            .unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::fake::fake_inventory;

    fn placement(parent: &str, profile_id: u32, start: u32, size: u32) -> Placement {
        Placement {
            parent_uuid: parent.to_string(),
            profile_id,
            start,
            size,
        }
    }

    #[test]
    fn instances_are_created_and_destroyed_in_order_and_kept_in_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let inv = fake_inventory("h100-80gb:1,t4:1", "n").unwrap();
        let parent = inv.gpus[0].uuid.clone();
        let mig = FakeMig::new(dir.path(), &inv).unwrap();
        assert!(!mig.mig_enabled(&parent).unwrap());
        let off = mig.create_gpu_instance(&placement(&parent, 19, 0, 1));
        assert!(off.unwrap_err().to_string().contains("MIG mode is off"));
        mig.set_mig_enabled(&parent, true).unwrap();

        let gi = mig
            .create_gpu_instance(&placement(&parent, 9, 4, 4))
            .unwrap();
        assert_eq!(gi, 1);
        let taken = mig
            .create_gpu_instance(&placement(&parent, 14, 4, 2))
            .unwrap_err();
        assert_eq!(taken.kind, MigErrorKind::Occupied);
        let not_a_placement = mig.create_gpu_instance(&placement(&parent, 9, 2, 4));
        assert!(not_a_placement.is_err());
        let ci = mig.create_compute_instance(&parent, gi, 3).unwrap();
        assert!(ci.uuid.starts_with("MIG-"));

        // Another process (a restarted driver, a test) sees the same instances.
        let seen = load(dir.path());
        let card = &seen.cards[&parent];
        assert!(card.enabled);
        assert_eq!(card.gpu_instances[0].compute_instances[&0], ci.uuid);
        assert!(
            !seen.cards.contains_key(&inv.gpus[1].uuid),
            "a T4 has no MIG"
        );
        let again = FakeMig::new(dir.path(), &inv).unwrap();
        assert_eq!(again.gpu_instances(&parent).unwrap().len(), 1);

        let early = mig.destroy_gpu_instance(&parent, gi).unwrap_err();
        assert_eq!(early.kind, MigErrorKind::InUse, "compute instance first");
        assert_eq!(
            mig.set_mig_enabled(&parent, false).unwrap_err().kind,
            MigErrorKind::InUse
        );
        mig.destroy_compute_instance(&parent, gi, ci.id).unwrap();
        mig.destroy_gpu_instance(&parent, gi).unwrap();
        mig.destroy_gpu_instance(&parent, gi).unwrap();
        assert!(mig.gpu_instances(&parent).unwrap().is_empty());
        mig.set_mig_enabled(&parent, false).unwrap();
    }

    #[test]
    fn an_ampere_card_starts_in_the_mode_the_inventory_says() {
        let dir = tempfile::tempdir().unwrap();
        let inv = fake_inventory("a100-40gb:1+mig", "n").unwrap();
        let mig = FakeMig::new(dir.path(), &inv).unwrap();
        assert!(mig.mig_enabled(&inv.gpus[0].uuid).unwrap());
    }
}

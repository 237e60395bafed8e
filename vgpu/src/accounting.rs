//! What this process has allocated, and on which device it was charged (pure data, no I/O).
//!
//! Every free uncharges the device the allocation was charged to, found here by its pointer or
//! handle, never "the current device" (the current device at free time can be another card).
//! Pointers and handles we never saw pass through untouched.

use crate::cuda::*;
use std::collections::HashMap;

/// Where a charge went: the claim index and the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Charged {
    pub device: usize,
    pub bytes: u64,
}

/// A charge and the context whose destruction frees it (the driver frees a context's pointers
/// and arrays with it; `cuMemCreate` memory belongs to the process and outlives contexts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Owned {
    charge: Charged,
    context: usize,
    /// `cuMemAllocManaged`: NVML's per-process figure may leave it out (see [`context_bytes`]).
    managed: bool,
}

/// A `cuMemCreate` handle's charge and what keeps its memory alive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Physical {
    charge: Charged,
    released: bool,
    mappings: u32,
}

#[derive(Default)]
pub struct Allocations {
    /// `cuMemAlloc*`, `cuMemAllocPitch*`, `cuMemAllocManaged`, `cuMemAllocAsync`,
    /// `cuMemAllocFromPoolAsync`: freed by `cuMemFree*` or `cuMemFreeAsync`.
    pointers: HashMap<CUdeviceptr, Owned>,
    /// `cuMemCreate` handles. The driver frees the memory when the handle is released *and* its
    /// last mapping is gone (the programming guide's own pattern releases right after mapping):
    /// the charge stays until both.
    handles: HashMap<CUmemGenericAllocationHandle, Physical>,
    /// `cuMemMap` mappings: start -> (handle, size).
    mappings: std::collections::BTreeMap<CUdeviceptr, (CUmemGenericAllocationHandle, u64)>,
    /// `cuArrayCreate*`, `cuArray3DCreate*`, destroyed by `cuArrayDestroy`.
    arrays: HashMap<usize, Owned>,
    /// `cuMipmappedArrayCreate`, destroyed by `cuMipmappedArrayDestroy`.
    mipmapped: HashMap<usize, Owned>,
    /// Memory pools -> the claim index their memory lives on (`None`: a host pool or an
    /// unlimited device: not charged).
    pools: HashMap<usize, Option<usize>>,
}

impl Allocations {
    pub fn add_pointer(&mut self, ptr: CUdeviceptr, charge: Charged, context: usize) {
        self.pointers.insert(
            ptr,
            Owned {
                charge,
                context,
                managed: false,
            },
        );
    }
    pub fn add_managed(&mut self, ptr: CUdeviceptr, charge: Charged, context: usize) {
        self.pointers.insert(
            ptr,
            Owned {
                charge,
                context,
                managed: true,
            },
        );
    }
    /// Managed bytes this process holds on a claim index.
    pub fn managed_on(&self, device: usize) -> u64 {
        self.pointers
            .values()
            .filter(|o| o.managed && o.charge.device == device)
            .map(|o| o.charge.bytes)
            .sum()
    }
    pub fn remove_pointer(&mut self, ptr: CUdeviceptr) -> Option<Charged> {
        self.pointers.remove(&ptr).map(|o| o.charge)
    }
    pub fn add_handle(&mut self, handle: CUmemGenericAllocationHandle, charge: Charged) {
        self.handles.insert(
            handle,
            Physical {
                charge,
                released: false,
                mappings: 0,
            },
        );
    }
    /// `cuMemRelease` succeeded: the charge to give back now, if the memory is gone (no mapping
    /// left); otherwise it goes with the last `cuMemUnmap`.
    pub fn release_handle(&mut self, handle: CUmemGenericAllocationHandle) -> Option<Charged> {
        let physical = self.handles.get_mut(&handle)?;
        physical.released = true;
        if physical.mappings > 0 {
            return None;
        }
        self.handles.remove(&handle).map(|p| p.charge)
    }
    /// `cuMemMap` of `size` bytes at `ptr` onto `handle` succeeded (a handle we never saw, an
    /// imported one, is not ours to count).
    pub fn map_handle(
        &mut self,
        ptr: CUdeviceptr,
        size: u64,
        handle: CUmemGenericAllocationHandle,
    ) {
        if let Some(physical) = self.handles.get_mut(&handle) {
            physical.mappings += 1;
            self.mappings.insert(ptr, (handle, size));
        }
    }
    /// `cuMemUnmap` of [ptr, ptr + size) succeeded: the mappings in it are gone; the charges of
    /// released handles whose last mapping that was, to give back.
    pub fn unmap_range(&mut self, ptr: CUdeviceptr, size: u64) -> Vec<Charged> {
        let end = ptr.saturating_add(size);
        let gone: Vec<CUdeviceptr> = self.mappings.range(ptr..end).map(|(&p, _)| p).collect();
        let mut freed = Vec::new();
        for start in gone {
            let Some((handle, _)) = self.mappings.remove(&start) else {
                continue;
            };
            let Some(physical) = self.handles.get_mut(&handle) else {
                continue;
            };
            physical.mappings = physical.mappings.saturating_sub(1);
            if physical.released && physical.mappings == 0 {
                freed.extend(self.handles.remove(&handle).map(|p| p.charge));
            }
        }
        freed
    }
    pub fn add_array(&mut self, array: usize, charge: Charged, context: usize) {
        self.arrays.insert(
            array,
            Owned {
                charge,
                context,
                managed: false,
            },
        );
    }
    pub fn remove_array(&mut self, array: usize) -> Option<Charged> {
        self.arrays.remove(&array).map(|o| o.charge)
    }
    pub fn add_mipmapped(&mut self, array: usize, charge: Charged, context: usize) {
        self.mipmapped.insert(
            array,
            Owned {
                charge,
                context,
                managed: false,
            },
        );
    }
    pub fn remove_mipmapped(&mut self, array: usize) -> Option<Charged> {
        self.mipmapped.remove(&array).map(|o| o.charge)
    }
    /// Everything the driver freed with a context it destroyed (`cuCtxDestroy`, a primary
    /// context's reset or last release).
    pub fn remove_context(&mut self, context: usize) -> Vec<Charged> {
        fn drain<K>(map: &mut HashMap<K, Owned>, context: usize, freed: &mut Vec<Charged>) {
            map.retain(|_, owned| {
                if owned.context == context {
                    freed.push(owned.charge);
                }
                owned.context != context
            });
        }
        let mut freed = Vec::new();
        drain(&mut self.pointers, context, &mut freed);
        drain(&mut self.arrays, context, &mut freed);
        drain(&mut self.mipmapped, context, &mut freed);
        freed
    }
    pub fn set_pool(&mut self, pool: usize, device: Option<usize>) {
        self.pools.insert(pool, device);
    }
    /// `Some(device)` for a pool we saw created or handed out; `None` for an unknown pool.
    pub fn pool(&self, pool: usize) -> Option<Option<usize>> {
        self.pools.get(&pool).copied()
    }
    pub fn forget_pool(&mut self, pool: usize) {
        self.pools.remove(&pool);
    }
    /// Bytes this process holds on a claim index, by our own records.
    #[cfg(test)]
    pub fn total_on(&self, device: usize) -> u64 {
        let owned = self
            .pointers
            .values()
            .chain(self.arrays.values())
            .chain(self.mipmapped.values());
        let all = owned
            .map(|o| &o.charge)
            .chain(self.handles.values().map(|p| &p.charge));
        all.filter(|c| c.device == device).map(|c| c.bytes).sum()
    }
}

/// The memory of a process's contexts on a card, from NVML's per-process figure (`nvml_used`):
/// what NVML says the process uses minus what the library tracks for it (`tracked`, `managed`
/// included). NVML's figure leaves managed memory out, or counts only the part the driver placed
/// on the card (on the H200 it stayed at the context's ~543 MB with 4 GiB of managed memory
/// allocated, and the subtraction took the contexts out of the account). So while managed memory
/// is held the figure never drops below what the contexts took without it (`baseline`, measured
/// when none was held), or, with no such measurement, below what NVML counts besides the other
/// allocations.
pub fn context_bytes(nvml_used: u64, tracked: u64, managed: u64, baseline: Option<u64>) -> u64 {
    let measured = nvml_used.saturating_sub(tracked);
    if managed == 0 {
        return measured;
    }
    let floor =
        baseline.unwrap_or_else(|| nvml_used.saturating_sub(tracked.saturating_sub(managed)));
    measured.max(floor)
}

/// Bytes per element of the formats whose size is plain (`CUarray_format` x channels), or per
/// texel for the fixed-size packed formats. `None`: a format whose size we do not model
/// (block-compressed, planar video): charged at the driver's figure only.
fn texel_bytes(format: u32, channels: u32) -> Option<u64> {
    let per_channel = match format {
        0x01 | 0x08 => 1,        // (UN)SIGNED_INT8
        0x02 | 0x09 | 0x10 => 2, // (UN)SIGNED_INT16, HALF
        0x03 | 0x0a | 0x20 => 4, // (UN)SIGNED_INT32, FLOAT
        _ => {
            return match format {
                0xc0 | 0xc6 => Some(1),                      // (S|U)NORM_INT8X1
                0xc1 | 0xc7 | 0xc3 | 0xc9 => Some(2),        // INT8X2, INT16X1
                0xc2 | 0xc8 | 0xc4 | 0xca | 0x50 => Some(4), // INT8X4, INT16X2, 101010_2
                0xc5 | 0xcb => Some(8),                      // INT16X4
                _ => None,
            };
        }
    };
    matches!(channels, 1 | 2 | 4).then_some(per_channel * channels as u64)
}

/// The bytes an array descriptor implies (height and depth 0 mean 1-D and 2-D): the size we check
/// before the driver is asked. `None` when the format's size is not modelled or it overflows.
pub fn array_bytes(width: u64, height: u64, depth: u64, format: u32, channels: u32) -> Option<u64> {
    let texel = texel_bytes(format, channels)?;
    width
        .checked_mul(height.max(1))?
        .checked_mul(depth.max(1))?
        .checked_mul(texel)
}

/// The bytes a mipmapped array implies: every level, each half the previous in every dimension
/// that is in use (never below 1).
pub fn mipmapped_bytes(
    width: u64,
    height: u64,
    depth: u64,
    format: u32,
    channels: u32,
    levels: u32,
) -> Option<u64> {
    let mut total = 0u64;
    for level in 0..levels.clamp(1, 64) {
        let shrink = |extent: u64| {
            if extent == 0 {
                0
            } else {
                (extent >> level).max(1)
            }
        };
        total = total.checked_add(array_bytes(
            shrink(width),
            shrink(height),
            shrink(depth),
            format,
            channels,
        )?)?;
    }
    Some(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// The programming guide's pattern: create, map, set access, release at once, use, unmap.
    /// The memory is the driver's until the last unmap, and so is the charge.
    #[test]
    fn memory_released_while_mapped_stays_charged_until_its_last_unmap() {
        let mut a = Allocations::default();
        let charge = Charged {
            device: 0,
            bytes: 512 * MIB,
        };
        a.add_handle(7, charge);
        a.map_handle(0x1000_0000, 256 * MIB, 7);
        a.map_handle(0x2000_0000, 256 * MIB, 7);
        assert_eq!(a.release_handle(7), None, "still mapped twice");
        assert_eq!(a.total_on(0), 512 * MIB);
        assert_eq!(a.unmap_range(0x1000_0000, 256 * MIB), vec![]);
        assert_eq!(a.total_on(0), 512 * MIB, "still mapped once");
        assert_eq!(a.unmap_range(0x2000_0000, 256 * MIB), vec![charge]);
        assert_eq!(a.total_on(0), 0);
        // Released before any mapping: at once. Unmapping a range we never mapped: nothing.
        a.add_handle(8, charge);
        assert_eq!(a.release_handle(8), Some(charge));
        assert_eq!(a.unmap_range(0, u64::MAX), vec![]);
        // Unmapped first, released later: at the release.
        a.add_handle(9, charge);
        a.map_handle(0x3000_0000, 512 * MIB, 9);
        assert_eq!(a.unmap_range(0x3000_0000, 512 * MIB), vec![]);
        assert_eq!(a.release_handle(9), Some(charge));
        // A handle we never saw (imported from another process) is not counted.
        a.map_handle(0x4000_0000, MIB, 99);
        assert_eq!(a.unmap_range(0x4000_0000, MIB), vec![]);
        assert_eq!(a.release_handle(99), None);
    }

    #[test]
    fn managed_memory_never_takes_the_contexts_out_of_the_account() {
        // No managed memory: NVML's figure less what we track.
        assert_eq!(context_bytes(1_543 * MIB, 1_000 * MIB, 0, None), 543 * MIB);
        // 4 GiB managed, which NVML leaves out (the H200): the contexts stay counted.
        assert_eq!(
            context_bytes(543 * MIB, 4_096 * MIB, 4_096 * MIB, Some(543 * MIB)),
            543 * MIB
        );
        assert_eq!(
            context_bytes(543 * MIB, 4_096 * MIB, 4_096 * MIB, None),
            543 * MIB
        );
        // Part of it on the card and counted by NVML: still the contexts, not less.
        assert_eq!(
            context_bytes(1_543 * MIB, 4_096 * MIB, 4_096 * MIB, Some(543 * MIB)),
            543 * MIB
        );
        // The contexts grew (a module loaded) while managed memory was held: that shows.
        assert_eq!(
            context_bytes(
                600 * MIB + 4_096 * MIB,
                4_096 * MIB,
                4_096 * MIB,
                Some(543 * MIB)
            ),
            600 * MIB
        );
    }

    #[test]
    fn managed_bytes_are_told_apart_and_go_with_their_free() {
        let mut a = Allocations::default();
        let charge = |bytes| Charged { device: 1, bytes };
        a.add_pointer(1, charge(10), 7);
        a.add_managed(2, charge(20), 7);
        a.add_managed(
            3,
            Charged {
                device: 0,
                bytes: 40,
            },
            7,
        );
        assert_eq!(a.managed_on(1), 20);
        assert_eq!(a.remove_pointer(2), Some(charge(20)));
        assert_eq!(a.managed_on(1), 0);
        assert_eq!(a.managed_on(0), 40);
    }

    #[test]
    fn frees_find_the_device_the_allocation_was_charged_to() {
        let mut a = Allocations::default();
        a.add_pointer(
            0x1000,
            Charged {
                device: 1,
                bytes: 64,
            },
            0xc,
        );
        a.add_pointer(
            0x2000,
            Charged {
                device: 0,
                bytes: 32,
            },
            0xc,
        );
        a.add_handle(
            7,
            Charged {
                device: 1,
                bytes: 2 << 20,
            },
        );
        assert_eq!(a.total_on(1), 64 + (2 << 20));
        assert_eq!(
            a.remove_pointer(0x1000),
            Some(Charged {
                device: 1,
                bytes: 64
            })
        );
        assert_eq!(
            a.remove_pointer(0x1000),
            None,
            "a double free is not uncharged twice"
        );
        assert_eq!(
            a.remove_pointer(0xdead),
            None,
            "unknown pointers pass through"
        );
        assert_eq!(
            a.release_handle(7),
            Some(Charged {
                device: 1,
                bytes: 2 << 20
            })
        );
        assert_eq!(a.total_on(1), 0);
        assert_eq!(a.total_on(0), 32);
    }

    #[test]
    fn destroying_a_context_frees_its_pointers_and_arrays_but_not_memcreate_memory() {
        let mut a = Allocations::default();
        let c = |bytes| Charged { device: 0, bytes };
        a.add_pointer(0x1000, c(1), 0xa);
        a.add_pointer(0x2000, c(2), 0xb);
        a.add_array(0x3000, c(4), 0xa);
        a.add_mipmapped(0x4000, c(8), 0xa);
        a.add_handle(9, c(16));
        let mut freed: Vec<u64> = a.remove_context(0xa).iter().map(|c| c.bytes).collect();
        freed.sort();
        assert_eq!(freed, vec![1, 4, 8]);
        assert_eq!(a.total_on(0), 2 + 16);
        assert_eq!(
            a.remove_pointer(0x1000),
            None,
            "already gone with its context"
        );
        assert!(a.remove_context(0xa).is_empty());
    }

    #[test]
    fn pools_remember_their_device_or_that_they_are_not_charged() {
        let mut a = Allocations::default();
        a.set_pool(0xa, Some(2));
        a.set_pool(0xb, None);
        assert_eq!(a.pool(0xa), Some(Some(2)));
        assert_eq!(a.pool(0xb), Some(None));
        assert_eq!(a.pool(0xc), None);
        a.forget_pool(0xa);
        assert_eq!(a.pool(0xa), None);
    }

    #[test]
    fn array_sizes_follow_the_descriptor() {
        assert_eq!(array_bytes(1024, 0, 0, 0x20, 1), Some(4096));
        assert_eq!(array_bytes(100, 50, 0, 0x01, 4), Some(100 * 50 * 4));
        assert_eq!(array_bytes(8, 8, 8, 0x10, 2), Some(8 * 8 * 8 * 4));
        assert_eq!(array_bytes(10, 10, 0, 0xc5, 1), Some(800));
        assert_eq!(
            array_bytes(10, 10, 0, 0x20, 3),
            None,
            "3 channels is not a valid descriptor"
        );
        assert_eq!(
            array_bytes(10, 10, 0, 0x91, 4),
            None,
            "block-compressed sizes are not modelled"
        );
        assert_eq!(array_bytes(u64::MAX, 2, 0, 0x01, 1), None);
    }

    #[test]
    fn mipmap_levels_halve_down_to_one() {
        // 8x4 floats: 32 + 8 + 2 + 1 texels over 4 levels.
        assert_eq!(
            mipmapped_bytes(8, 4, 0, 0x20, 1, 4),
            Some((32 + 8 + 2 + 1) * 4)
        );
        // A 1-D mipmap keeps height 0 (treated as 1) at every level.
        assert_eq!(mipmapped_bytes(16, 0, 0, 0x01, 1, 3), Some(16 + 8 + 4));
        assert_eq!(
            mipmapped_bytes(16, 0, 0, 0x01, 1, 0),
            Some(16),
            "0 levels is read as 1"
        );
    }
}

//! Device memory: linear allocations (plain, pitched, managed, the 32-bit pre-3.2 forms), virtual
//! memory management (`cuMemCreate` ...), stream-ordered allocation from memory pools, CUDA arrays.
//! Every byte a process holds on a card is charged to it in the shared state, so that the card runs
//! out at its capacity across processes and NVML sees each process's use.
#![allow(non_snake_case, clippy::missing_safety_doc)]

use crate::context::current;
use crate::driver::{driver, entry, Registry};
use crate::exec::resolve_stream;
use crate::ffi::*;
use gpupool_standin_device::{Charge, Sim};
use std::collections::{BTreeMap, HashMap};

/// `cuMemGetAllocationGranularity`'s answer, and a pool's growth step.
pub const GRANULARITY: u64 = 2 << 20;
/// `cuMemAllocPitch` rounds rows to this (what real cards return: 512-byte rows), a multiple of the
/// texture pitch alignment (32).
pub const PITCH_ALIGNMENT: u64 = 512;
const ALLOC_ALIGNMENT: u64 = 512;
/// Arrays are stored in tiles of 64-byte rows by 8 rows and take whole 64 KiB pages: the stand-in's
/// model (NVIDIA does not document the block-linear layout), so that an array takes more than
/// width x height x element size, as on a real card.
pub const ARRAY_ROW_ALIGNMENT: u64 = 64;
pub const ARRAY_HEIGHT_ALIGNMENT: u64 = 8;
pub const ARRAY_PAGE: u64 = 64 << 10;
pub const MAX_1D: i32 = 131072;
pub const MAX_2D_WIDTH: i32 = 131072;
pub const MAX_2D_HEIGHT: i32 = 65536;
pub const MAX_3D: i32 = 16384;
const MAX_PITCH: u64 = i32::MAX as u64;

fn round_up(n: u64, to: u64) -> Option<u64> {
    n.checked_add(to - 1).map(|x| x / to * to)
}

/// Addresses in one window: bump allocation, reusing gaps once the window is used up.
struct Space {
    base: u64,
    limit: u64,
    next: u64,
    live: BTreeMap<u64, u64>,
}

impl Space {
    fn new(base: u64, len: u64) -> Space {
        Space {
            base,
            limit: base + len,
            next: base,
            live: BTreeMap::new(),
        }
    }

    fn alloc(&mut self, size: u64, align: u64) -> Option<u64> {
        let size = round_up(size.max(1), align)?;
        let start = round_up(self.next, align)?;
        if start.checked_add(size)? <= self.limit {
            self.next = start + size;
            self.live.insert(start, size);
            return Some(start);
        }
        let mut cursor = self.base;
        for (&b, &len) in &self.live {
            let aligned = round_up(cursor, align)?;
            if aligned + size <= b {
                self.live.insert(aligned, size);
                return Some(aligned);
            }
            cursor = b + len;
        }
        let aligned = round_up(cursor, align)?;
        (aligned.checked_add(size)? <= self.limit).then(|| {
            self.live.insert(aligned, size);
            aligned
        })
    }

    fn free(&mut self, base: u64) {
        self.live.remove(&base);
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Device,
    Pitch,
    Managed,
    /// From a pool (its handle): the pool holds the charge.
    Pool(usize),
    /// `cuMemAlloc`/`cuMemAllocPitch` of CUDA < 3.2 (32-bit addresses).
    Legacy,
}

impl Kind {
    /// How the card accounts for it: managed memory stays out of NVML's per-process figure.
    fn account(self) -> Charge {
        match self {
            Kind::Managed => Charge::Managed,
            _ => Charge::Memory,
        }
    }
}

struct Alloc {
    size: u64,
    /// What the card is charged for it (pitch x height for pitched memory; 0 for pool memory).
    charged: u64,
    physical: usize,
    ctx: usize,
    kind: Kind,
}

struct Physical {
    physical: Option<usize>,
    size: u64,
    released: bool,
    maps: u32,
}

struct Pool {
    ordinal: usize,
    physical: usize,
    used: u64,
    reserved: u64,
    used_high: u64,
    reserved_high: u64,
    threshold: u64,
    max_size: u64,
    default: bool,
    destroyed: bool,
}

struct ArrayObj {
    physical: usize,
    ctx: usize,
    size: u64,
    deferred: bool,
    mipmapped: bool,
}

pub struct Memory {
    allocs: BTreeMap<u64, Alloc>,
    spaces: HashMap<usize, Space>,
    legacy: Space,
    managed: Space,
    reserve: Space,
    phys: HashMap<u64, Physical>,
    next_phys: u64,
    reservations: BTreeMap<u64, u64>,
    maps: BTreeMap<u64, (u64, u64)>,
    pools: Registry<Pool>,
    default_pool: Vec<Option<usize>>,
    current_pool: Vec<Option<usize>>,
    arrays: Registry<ArrayObj>,
}

impl Memory {
    pub fn new(ordinals: usize) -> Memory {
        Memory {
            allocs: BTreeMap::new(),
            spaces: HashMap::new(),
            legacy: Space::new(0x1000_0000, 0xE000_0000),
            managed: Space::new(0x6000_0000_0000, 1 << 44),
            reserve: Space::new(0x7000_0000_0000, 1 << 44),
            phys: HashMap::new(),
            next_phys: 0x1_0000,
            reservations: BTreeMap::new(),
            maps: BTreeMap::new(),
            pools: Registry::default(),
            default_pool: vec![None; ordinals],
            current_pool: vec![None; ordinals],
            arrays: Registry::default(),
        }
    }

    fn space(&mut self, physical: usize) -> &mut Space {
        self.spaces
            .entry(physical)
            .or_insert_with(|| Space::new(0x1000_0000_0000 + ((physical as u64) << 40), 1 << 40))
    }

    /// Charges `charged` to the card, places `size` bytes, records the allocation.
    fn place(
        &mut self,
        sim: &Sim,
        physical: usize,
        ctx: usize,
        size: u64,
        charged: u64,
        kind: Kind,
    ) -> Result<u64, CUresult> {
        let account = kind.account();
        if charged > 0 && !sim.charge(physical, charged, account) {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        let addr = match kind {
            Kind::Legacy => self.legacy.alloc(size, ALLOC_ALIGNMENT),
            Kind::Managed => self.managed.alloc(size, ALLOC_ALIGNMENT),
            _ => self.space(physical).alloc(size, ALLOC_ALIGNMENT),
        };
        let Some(addr) = addr else {
            if charged > 0 {
                sim.uncharge(physical, charged, account);
            }
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        };
        self.allocs.insert(
            addr,
            Alloc {
                size,
                charged,
                physical,
                ctx,
                kind,
            },
        );
        Ok(addr)
    }

    fn free(&mut self, sim: &Sim, addr: u64) -> Result<(), CUresult> {
        let a = self.allocs.remove(&addr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        match a.kind {
            Kind::Legacy => self.legacy.free(addr),
            Kind::Managed => self.managed.free(addr),
            _ => self.space(a.physical).free(addr),
        }
        if a.charged > 0 {
            sim.uncharge(a.physical, a.charged, a.kind.account());
        }
        if let Kind::Pool(handle) = a.kind {
            let mut gone = false;
            if let Some(p) = self.pools.get_mut(handle) {
                p.used -= a.size;
                if p.destroyed && p.used == 0 {
                    sim.uncharge(p.physical, p.reserved, Charge::Memory);
                    gone = true;
                }
            }
            if gone {
                self.pools.remove(handle);
            }
        }
        Ok(())
    }

    /// A context ends: its allocations and arrays go back to the card, and the pools of its card
    /// keep nothing they do not use.
    pub fn release_context(&mut self, sim: &Sim, ctx: usize, physical: usize) {
        let addrs: Vec<u64> = self
            .allocs
            .iter()
            .filter(|(_, a)| a.ctx == ctx)
            .map(|(&k, _)| k)
            .collect();
        for addr in addrs {
            let _ = self.free(sim, addr);
        }
        let mut gone = Vec::new();
        self.arrays.retain(|_, a| {
            if a.ctx == ctx {
                gone.push((a.physical, a.size));
                false
            } else {
                true
            }
        });
        for (p, size) in gone {
            if size > 0 {
                sim.uncharge(p, size, Charge::Memory);
            }
        }
        self.trim_pools(sim, Some(physical), true);
    }

    /// What stream, event and context synchronisation does to pools: each gives back what it keeps
    /// above its release threshold (default 0) and does not use.
    pub fn trim_pools_at_sync(&mut self, sim: &Sim) {
        self.trim_pools(sim, None, false);
    }

    fn trim_pools(&mut self, sim: &Sim, physical: Option<usize>, all: bool) {
        for h in self.pools.keys() {
            let p = self.pools.get_mut(h).expect("listed pool");
            if physical.is_some_and(|x| x != p.physical) {
                continue;
            }
            let keep = if all { 0 } else { p.threshold };
            trim(sim, p, keep);
        }
    }
}

fn trim(sim: &Sim, p: &mut Pool, keep: u64) {
    let floor = round_up(p.used, GRANULARITY)
        .unwrap_or(p.used)
        .max(round_up(keep, GRANULARITY).unwrap_or(keep));
    if p.reserved > floor {
        sim.uncharge(p.physical, p.reserved - floor, Charge::Memory);
        p.reserved = floor;
    }
}

unsafe fn out<T>(p: *mut T, v: T) {
    p.write(v)
}

/// `cuMemAlloc_v2` and friends: what every plain allocation checks, in the real driver's order.
fn alloc_linear(size: u64, kind: Kind) -> Result<u64, CUresult> {
    let d = driver()?;
    let ctx = current()?;
    if size == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    crate::capture::unsafe_call()?;
    d.state()
        .mem
        .place(&d.sim, ctx.physical, ctx.handle, size, size, kind)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult {
    entry(|| {
        if dptr.is_null() {
            driver()?;
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out(dptr, alloc_linear(bytesize as u64, Kind::Device)?);
        Ok(())
    })
}

/// The CUDA 2.0 form: 32-bit size and address (addresses come from the low 4 GiB).
#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc(dptr: *mut CUdeviceptr_v1, bytesize: u32) -> CUresult {
    entry(|| {
        if dptr.is_null() {
            driver()?;
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out(dptr, alloc_linear(bytesize as u64, Kind::Legacy)? as u32);
        Ok(())
    })
}

fn pitch_for(width: u64, height: u64, element: u32) -> Result<(u64, u64), CUresult> {
    if width == 0 || height == 0 || !matches!(element, 4 | 8 | 16) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let pitch = round_up(width, PITCH_ALIGNMENT).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    if pitch > MAX_PITCH {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let bytes = pitch.checked_mul(height).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
    Ok((pitch, bytes))
}

fn alloc_pitch(width: u64, height: u64, element: u32, kind: Kind) -> Result<(u64, u64), CUresult> {
    let d = driver()?;
    let ctx = current()?;
    let (pitch, bytes) = pitch_for(width, height, element)?;
    crate::capture::unsafe_call()?;
    let addr = d
        .state()
        .mem
        .place(&d.sim, ctx.physical, ctx.handle, bytes, bytes, kind)?;
    Ok((addr, pitch))
}

/// Rows are rounded up to 512 bytes; the card is charged pitch x height (the returned pitch).
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    dptr: *mut CUdeviceptr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    element: u32,
) -> CUresult {
    entry(|| {
        if dptr.is_null() || pitch.is_null() {
            driver()?;
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (addr, p) = alloc_pitch(width as u64, height as u64, element, Kind::Pitch)?;
        out(dptr, addr);
        out(pitch, p as usize);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocPitch(
    dptr: *mut CUdeviceptr_v1,
    pitch: *mut u32,
    width: u32,
    height: u32,
    element: u32,
) -> CUresult {
    entry(|| {
        if dptr.is_null() || pitch.is_null() {
            driver()?;
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (addr, p) = alloc_pitch(width as u64, height as u64, element, Kind::Legacy)?;
        out(dptr, addr as u32);
        out(pitch, p as u32);
        Ok(())
    })
}

/// Managed memory is charged in full to the current context's card when allocated (a real card
/// holds it only once touched: the stand-in is the stricter of the two), and left out of NVML's
/// per-process used memory, as the H200 showed it (the process's figure stayed at its context's
/// with 4 GiB of managed memory allocated).
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocManaged(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    flags: u32,
) -> CUresult {
    entry(|| {
        driver()?;
        if dptr.is_null() || !matches!(flags, CU_MEM_ATTACH_GLOBAL | CU_MEM_ATTACH_HOST) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out(dptr, alloc_linear(bytesize as u64, Kind::Managed)?);
        Ok(())
    })
}

fn free(addr: u64) -> Result<(), CUresult> {
    let d = driver()?;
    current()?;
    crate::capture::unsafe_call()?;
    // Unknown addresses, and addresses inside an allocation, are CUDA_ERROR_INVALID_VALUE.
    d.state().mem.free(&d.sim, addr)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    entry(|| free(dptr))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemFree(dptr: CUdeviceptr_v1) -> CUresult {
    entry(|| free(dptr as u64))
}

fn info() -> Result<(u64, u64), CUresult> {
    let d = driver()?;
    let ctx = current()?;
    let m = d.sim.memory(ctx.physical);
    Ok((m.free(), m.total))
}

/// Free and total memory of the current context's card (free: what no live process holds, less the
/// reserved memory).
#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    entry(|| {
        if free.is_null() || total.is_null() {
            driver()?;
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (f, t) = info()?;
        out(free, f as usize);
        out(total, t as usize);
        Ok(())
    })
}

/// The 32-bit form: values saturate at 4 GiB - 1.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo(free: *mut u32, total: *mut u32) -> CUresult {
    entry(|| {
        if free.is_null() || total.is_null() {
            driver()?;
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (f, t) = info()?;
        out(free, f.min(u32::MAX as u64) as u32);
        out(total, t.min(u32::MAX as u64) as u32);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetAddressRange_v2(
    pbase: *mut CUdeviceptr,
    psize: *mut usize,
    dptr: CUdeviceptr,
) -> CUresult {
    entry(|| {
        let d = driver()?;
        current()?;
        let st = d.state();
        let (&base, a) = st
            .mem
            .allocs
            .range(..=dptr)
            .next_back()
            .ok_or(CUDA_ERROR_NOT_FOUND)?;
        if dptr >= base + a.size {
            return Err(CUDA_ERROR_NOT_FOUND);
        }
        if !pbase.is_null() {
            out(pbase, base);
        }
        if !psize.is_null() {
            out(psize, a.size as usize);
        }
        Ok(())
    })
}

// ---- Virtual memory management ----

/// Checks an allocation property; returns the card it places memory on (None: host memory).
unsafe fn prop_location(prop: *const CUmemAllocationProp) -> Result<Option<usize>, CUresult> {
    let d = driver()?;
    let p = prop.as_ref().ok_or(CUDA_ERROR_INVALID_VALUE)?;
    if p.type_ != CU_MEM_ALLOCATION_TYPE_PINNED {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    match p.requested_handle_types {
        CU_MEM_HANDLE_TYPE_NONE | CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR => {}
        _ => return Err(CUDA_ERROR_NOT_SUPPORTED),
    }
    match p.location.type_ {
        CU_MEM_LOCATION_TYPE_DEVICE => Ok(Some(d.physical(p.location.id)?)),
        CU_MEM_LOCATION_TYPE_HOST
        | CU_MEM_LOCATION_TYPE_HOST_NUMA
        | CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT => Ok(None),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetAllocationGranularity(
    granularity: *mut usize,
    prop: *const CUmemAllocationProp,
    option: i32,
) -> CUresult {
    entry(|| {
        driver()?;
        if granularity.is_null()
            || !matches!(
                option,
                CU_MEM_ALLOC_GRANULARITY_MINIMUM | CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
            )
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        prop_location(prop)?;
        out(granularity, GRANULARITY as usize);
        Ok(())
    })
}

/// Physical memory: a size that is a multiple of the granularity, charged to the card of a device
/// location (host locations are not card memory). Freed when released and no longer mapped.
#[no_mangle]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut CUmemGenericAllocationHandle,
    size: usize,
    prop: *const CUmemAllocationProp,
    flags: u64,
) -> CUresult {
    entry(|| {
        let d = driver()?;
        if handle.is_null() || flags != 0 || size == 0 || !(size as u64).is_multiple_of(GRANULARITY)
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let physical = prop_location(prop)?;
        if let Some(p) = physical {
            if !d.sim.charge(p, size as u64, Charge::Memory) {
                return Err(CUDA_ERROR_OUT_OF_MEMORY);
            }
        }
        let mut st = d.state();
        st.mem.next_phys += 1;
        let h = st.mem.next_phys;
        st.mem.phys.insert(
            h,
            Physical {
                physical,
                size: size as u64,
                released: false,
                maps: 0,
            },
        );
        out(handle, h);
        Ok(())
    })
}

fn drop_physical_if_done(sim: &Sim, m: &mut Memory, h: u64) {
    if let Some(p) = m.phys.get(&h) {
        if p.released && p.maps == 0 {
            if let Some(card) = p.physical {
                sim.uncharge(card, p.size, Charge::Memory);
            }
            m.phys.remove(&h);
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemRelease(handle: CUmemGenericAllocationHandle) -> CUresult {
    entry(|| {
        let d = driver()?;
        let mut st = d.state();
        match st.mem.phys.get_mut(&handle) {
            Some(p) if !p.released => p.released = true,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
        drop_physical_if_done(&d.sim, &mut st.mem, handle);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAddressReserve(
    ptr: *mut CUdeviceptr,
    size: usize,
    alignment: usize,
    _addr: CUdeviceptr,
    flags: u64,
) -> CUresult {
    entry(|| {
        let d = driver()?;
        let size = size as u64;
        let alignment = if alignment == 0 {
            GRANULARITY
        } else {
            alignment as u64
        };
        if ptr.is_null()
            || flags != 0
            || size == 0
            || !size.is_multiple_of(GRANULARITY)
            || !alignment.is_power_of_two()
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut st = d.state();
        let base = st
            .mem
            .reserve
            .alloc(size, alignment.max(GRANULARITY))
            .ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        st.mem.reservations.insert(base, size);
        out(ptr, base);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAddressFree(ptr: CUdeviceptr, size: usize) -> CUresult {
    entry(|| {
        let d = driver()?;
        let mut st = d.state();
        if st.mem.reservations.get(&ptr) != Some(&(size as u64)) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if st.mem.maps.range(ptr..ptr + size as u64).next().is_some() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        st.mem.reservations.remove(&ptr);
        st.mem.reserve.free(ptr);
        Ok(())
    })
}

fn reserved_range(m: &Memory, ptr: u64, size: u64) -> bool {
    m.reservations
        .range(..=ptr)
        .next_back()
        .is_some_and(|(&b, &len)| ptr + size <= b + len)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemMap(
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: CUmemGenericAllocationHandle,
    flags: u64,
) -> CUresult {
    entry(|| {
        let d = driver()?;
        let size = size as u64;
        let mut st = d.state();
        let m = &mut st.mem;
        if flags != 0
            || offset != 0
            || size == 0
            || !ptr.is_multiple_of(GRANULARITY)
            || !size.is_multiple_of(GRANULARITY)
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if !reserved_range(m, ptr, size) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let overlaps = m
            .maps
            .range(..ptr + size)
            .next_back()
            .is_some_and(|(&b, &(_, len))| b + len > ptr);
        if overlaps {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        match m.phys.get_mut(&handle) {
            Some(p) if !p.released && size <= p.size => p.maps += 1,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
        m.maps.insert(ptr, (handle, size));
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemUnmap(ptr: CUdeviceptr, size: usize) -> CUresult {
    entry(|| {
        let d = driver()?;
        let mut st = d.state();
        let m = &mut st.mem;
        match m.maps.get(&ptr) {
            Some(&(h, len)) if len == size as u64 => {
                m.maps.remove(&ptr);
                if let Some(p) = m.phys.get_mut(&h) {
                    p.maps -= 1;
                }
                drop_physical_if_done(&d.sim, m, h);
                Ok(())
            }
            _ => Err(CUDA_ERROR_INVALID_VALUE),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemSetAccess(
    ptr: CUdeviceptr,
    size: usize,
    desc: *const CUmemAccessDesc,
    count: usize,
) -> CUresult {
    entry(|| {
        let d = driver()?;
        if count == 0 || desc.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        for i in 0..count {
            let a = &*desc.add(i);
            if a.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            d.physical(a.location.id)?;
        }
        let st = d.state();
        let mapped = st
            .mem
            .maps
            .range(..=ptr)
            .next_back()
            .is_some_and(|(&b, &(_, len))| ptr + size as u64 <= b + len);
        if !mapped {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok(())
    })
}

// ---- Memory pools and stream-ordered allocation ----

fn new_pool(
    st: &mut crate::State,
    ordinal: usize,
    physical: usize,
    default: bool,
    max_size: u64,
) -> usize {
    let h = st.handles.allocate();
    st.mem.pools.insert(
        h,
        Pool {
            ordinal,
            physical,
            used: 0,
            reserved: 0,
            used_high: 0,
            reserved_high: 0,
            threshold: 0,
            max_size,
            default,
            destroyed: false,
        },
    );
    h
}

fn default_pool(st: &mut crate::State, ordinal: usize, physical: usize) -> usize {
    if let Some(h) = st.mem.default_pool[ordinal] {
        return h;
    }
    let h = new_pool(st, ordinal, physical, true, 0);
    st.mem.default_pool[ordinal] = Some(h);
    h
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetDefaultMemPool(
    pool: *mut CUmemoryPool,
    dev: CUdevice,
) -> CUresult {
    entry(|| {
        let d = driver()?;
        let ordinal = d.ordinal(dev)?;
        if pool.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let h = default_pool(&mut d.state(), ordinal, d.visible[ordinal]);
        out(pool, h as CUmemoryPool);
        Ok(())
    })
}

fn current_pool(st: &mut crate::State, ordinal: usize, physical: usize) -> usize {
    match st.mem.current_pool[ordinal] {
        Some(h) => h,
        None => default_pool(st, ordinal, physical),
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetMemPool(pool: *mut CUmemoryPool, dev: CUdevice) -> CUresult {
    entry(|| {
        let d = driver()?;
        let ordinal = d.ordinal(dev)?;
        if pool.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let h = current_pool(&mut d.state(), ordinal, d.visible[ordinal]);
        out(pool, h as CUmemoryPool);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceSetMemPool(dev: CUdevice, pool: CUmemoryPool) -> CUresult {
    entry(|| {
        let d = driver()?;
        let ordinal = d.ordinal(dev)?;
        let mut st = d.state();
        match st.mem.pools.get(pool as usize) {
            Some(p) if !p.destroyed && p.ordinal == ordinal => {}
            Some(_) => return Err(CUDA_ERROR_INVALID_DEVICE),
            None => return Err(CUDA_ERROR_INVALID_VALUE),
        }
        st.mem.current_pool[ordinal] = Some(pool as usize);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemPoolCreate(
    pool: *mut CUmemoryPool,
    props: *const CUmemPoolProps,
) -> CUresult {
    entry(|| {
        let d = driver()?;
        let p = props.as_ref().ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if pool.is_null()
            || p.alloc_type != CU_MEM_ALLOCATION_TYPE_PINNED
            || p.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if !matches!(
            p.handle_types,
            CU_MEM_HANDLE_TYPE_NONE | CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        ) {
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        let ordinal = d.ordinal(p.location.id)?;
        let h = new_pool(
            &mut d.state(),
            ordinal,
            d.visible[ordinal],
            false,
            p.max_size as u64,
        );
        out(pool, h as CUmemoryPool);
        Ok(())
    })
}

/// A pool with allocations outstanding goes once they are freed (as cuda.h describes).
#[no_mangle]
pub unsafe extern "C" fn cuMemPoolDestroy(pool: CUmemoryPool) -> CUresult {
    entry(|| {
        let d = driver()?;
        let mut st = d.state();
        let m = &mut st.mem;
        let p = match m.pools.get_mut(pool as usize) {
            Some(p) if !p.destroyed && !p.default => p,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        };
        p.destroyed = true;
        trim(&d.sim, p, 0);
        let (ordinal, empty) = (p.ordinal, p.used == 0);
        if empty {
            let reserved = p.reserved;
            let physical = p.physical;
            if reserved > 0 {
                d.sim.uncharge(physical, reserved, Charge::Memory);
            }
            m.pools.remove(pool as usize);
        }
        if m.current_pool[ordinal] == Some(pool as usize) {
            m.current_pool[ordinal] = None;
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemPoolTrimTo(pool: CUmemoryPool, keep: usize) -> CUresult {
    entry(|| {
        let d = driver()?;
        let mut st = d.state();
        let p = st
            .mem
            .pools
            .get_mut(pool as usize)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        trim(&d.sim, p, keep as u64);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemPoolGetAttribute(
    pool: CUmemoryPool,
    attr: i32,
    value: *mut std::ffi::c_void,
) -> CUresult {
    entry(|| {
        let d = driver()?;
        let st = d.state();
        let p = st
            .mem
            .pools
            .get(pool as usize)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if value.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let v64 = |v: u64| out(value as *mut u64, v);
        match attr {
            CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES
            | CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC
            | CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES => out(value as *mut i32, 1),
            CU_MEMPOOL_ATTR_RELEASE_THRESHOLD => v64(p.threshold),
            CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT => v64(p.reserved),
            CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH => v64(p.reserved_high),
            CU_MEMPOOL_ATTR_USED_MEM_CURRENT => v64(p.used),
            CU_MEMPOOL_ATTR_USED_MEM_HIGH => v64(p.used_high),
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemPoolSetAttribute(
    pool: CUmemoryPool,
    attr: i32,
    value: *mut std::ffi::c_void,
) -> CUresult {
    entry(|| {
        let d = driver()?;
        let mut st = d.state();
        let p = st
            .mem
            .pools
            .get_mut(pool as usize)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if value.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        match attr {
            CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES
            | CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC
            | CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES => {}
            CU_MEMPOOL_ATTR_RELEASE_THRESHOLD => p.threshold = *(value as *const u64),
            // The high-water marks can only be reset (to the current value), with 0.
            CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH if *(value as *const u64) == 0 => {
                p.reserved_high = p.reserved
            }
            CU_MEMPOOL_ATTR_USED_MEM_HIGH if *(value as *const u64) == 0 => p.used_high = p.used,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
        Ok(())
    })
}

/// Takes `size` from the pool, growing what it reserves (and what the card is charged) in whole
/// granules when it does not have the room.
fn pool_alloc(
    sim: &Sim,
    st: &mut crate::State,
    pool: usize,
    ctx: usize,
    size: u64,
) -> Result<u64, CUresult> {
    let p = st
        .mem
        .pools
        .get_mut(pool)
        .filter(|p| !p.destroyed)
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let need = p.used.checked_add(size).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
    if need > p.reserved {
        let target = round_up(need, GRANULARITY).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        if p.max_size != 0 && target > p.max_size {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        if !sim.charge(p.physical, target - p.reserved, Charge::Memory) {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        p.reserved = target;
        p.reserved_high = p.reserved_high.max(target);
    }
    p.used = need;
    p.used_high = p.used_high.max(need);
    let physical = p.physical;
    match st.mem.place(sim, physical, ctx, size, 0, Kind::Pool(pool)) {
        Ok(addr) => Ok(addr),
        Err(e) => {
            st.mem.pools.get_mut(pool).expect("pool").used -= size;
            Err(e)
        }
    }
}

unsafe fn alloc_async(
    dptr: *mut CUdeviceptr,
    size: usize,
    pool: Option<CUmemoryPool>,
    stream: CUstream,
    ptsz: bool,
) -> Result<(), CUresult> {
    let d = driver()?;
    if dptr.is_null() || size == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let s = resolve_stream(d, stream, ptsz)?;
    s.refuse_while_capturing()?;
    let mut st = d.state();
    let handle = match pool {
        Some(p) => p as usize,
        None => current_pool(&mut st, s.ctx.ordinal, s.ctx.physical),
    };
    let addr = pool_alloc(&d.sim, &mut st, handle, s.ctx.handle, size as u64)?;
    out(dptr, addr);
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync(
    dptr: *mut CUdeviceptr,
    size: usize,
    stream: CUstream,
) -> CUresult {
    entry(|| alloc_async(dptr, size, None, stream, false))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync_ptsz(
    dptr: *mut CUdeviceptr,
    size: usize,
    stream: CUstream,
) -> CUresult {
    entry(|| alloc_async(dptr, size, None, stream, true))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync(
    dptr: *mut CUdeviceptr,
    size: usize,
    pool: CUmemoryPool,
    stream: CUstream,
) -> CUresult {
    entry(|| alloc_async(dptr, size, Some(pool), stream, false))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync_ptsz(
    dptr: *mut CUdeviceptr,
    size: usize,
    pool: CUmemoryPool,
    stream: CUstream,
) -> CUresult {
    entry(|| alloc_async(dptr, size, Some(pool), stream, true))
}

/// Freed at once (the stand-in's streams hold no memory operations): the pool keeps the memory
/// reserved until a synchronisation or `cuMemPoolTrimTo` gives it back.
fn free_async(dptr: CUdeviceptr, stream: CUstream, ptsz: bool) -> Result<(), CUresult> {
    let d = driver()?;
    let s = resolve_stream(d, stream, ptsz)?;
    s.refuse_while_capturing()?;
    d.state().mem.free(&d.sim, dptr)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemFreeAsync(dptr: CUdeviceptr, stream: CUstream) -> CUresult {
    entry(|| free_async(dptr, stream, false))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemFreeAsync_ptsz(dptr: CUdeviceptr, stream: CUstream) -> CUresult {
    entry(|| free_async(dptr, stream, true))
}

// ---- Arrays ----

fn element_size(format: i32) -> Option<u64> {
    Some(match format {
        CU_AD_FORMAT_UNSIGNED_INT8 | CU_AD_FORMAT_SIGNED_INT8 => 1,
        CU_AD_FORMAT_UNSIGNED_INT16 | CU_AD_FORMAT_SIGNED_INT16 | CU_AD_FORMAT_HALF => 2,
        CU_AD_FORMAT_UNSIGNED_INT32 | CU_AD_FORMAT_SIGNED_INT32 | CU_AD_FORMAT_FLOAT => 4,
        _ => return None,
    })
}

/// The bytes one array level takes in the stand-in's model: rows padded to 64 bytes, heights to 8
/// rows (a 1D array is one row), times depth or layers, in whole 64 KiB pages.
pub fn array_bytes(width: u64, height: u64, depth: u64, format: i32, channels: u32) -> Option<u64> {
    let elem = element_size(format)? * channels as u64;
    let row = round_up(width.checked_mul(elem)?, ARRAY_ROW_ALIGNMENT)?;
    let rows = if height == 0 {
        1
    } else {
        round_up(height, ARRAY_HEIGHT_ALIGNMENT)?
    };
    round_up(
        row.checked_mul(rows)?.checked_mul(depth.max(1))?,
        ARRAY_PAGE,
    )
}

/// Checks a 3D descriptor as cuArray3DCreate does; returns the bytes of its first level.
fn check_3d(desc: &CUDA_ARRAY3D_DESCRIPTOR) -> Result<u64, CUresult> {
    let (w, h, dp, f) = (
        desc.width as u64,
        desc.height as u64,
        desc.depth as u64,
        desc.flags,
    );
    let known = CUDA_ARRAY3D_LAYERED
        | CUDA_ARRAY3D_SURFACE_LDST
        | CUDA_ARRAY3D_CUBEMAP
        | CUDA_ARRAY3D_TEXTURE_GATHER
        | CUDA_ARRAY3D_SPARSE
        | CUDA_ARRAY3D_DEFERRED_MAPPING;
    if f & !known != 0
        || element_size(desc.format).is_none()
        || !matches!(desc.num_channels, 1 | 2 | 4)
        || w == 0
    {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if f & CUDA_ARRAY3D_SPARSE != 0 {
        return Err(CUDA_ERROR_NOT_SUPPORTED);
    }
    if f & CUDA_ARRAY3D_CUBEMAP != 0 {
        let faces_ok = if f & CUDA_ARRAY3D_LAYERED != 0 {
            dp % 6 == 0 && dp > 0
        } else {
            dp == 6
        };
        if w != h || !faces_ok {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
    } else if f & CUDA_ARRAY3D_LAYERED == 0 && h == 0 && dp != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let layered = f & (CUDA_ARRAY3D_LAYERED | CUDA_ARRAY3D_CUBEMAP) != 0;
    let too_big = if dp > 0 && !layered {
        w > MAX_3D as u64 || h > MAX_3D as u64 || dp > MAX_3D as u64
    } else if h > 0 {
        w > MAX_2D_WIDTH as u64 || h > MAX_2D_HEIGHT as u64
    } else {
        w > MAX_1D as u64
    };
    if too_big {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    array_bytes(w, h, dp, desc.format, desc.num_channels).ok_or(CUDA_ERROR_INVALID_VALUE)
}

fn create_array(
    handle: *mut CUarray,
    desc: CUDA_ARRAY3D_DESCRIPTOR,
    levels: Option<u32>,
) -> Result<(), CUresult> {
    let d = driver()?;
    if handle.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let ctx = current()?;
    let mut size = check_3d(&desc)?;
    if let Some(levels) = levels {
        let largest = desc
            .width
            .max(desc.height)
            .max(if desc.flags & CUDA_ARRAY3D_LAYERED != 0 {
                1
            } else {
                desc.depth
            });
        let max_levels = usize::BITS - largest.leading_zeros();
        if levels == 0 || levels > max_levels {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let layered = desc.flags & (CUDA_ARRAY3D_LAYERED | CUDA_ARRAY3D_CUBEMAP) != 0;
        let (mut w, mut h, mut dp) = (desc.width as u64, desc.height as u64, desc.depth as u64);
        for _ in 1..levels {
            w = (w / 2).max(1);
            h = if h == 0 { 0 } else { (h / 2).max(1) };
            dp = if dp == 0 || layered {
                dp
            } else {
                (dp / 2).max(1)
            };
            size += array_bytes(w, h, dp, desc.format, desc.num_channels)
                .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        }
    }
    let deferred = desc.flags & CUDA_ARRAY3D_DEFERRED_MAPPING != 0;
    let charged = if deferred { 0 } else { size };
    if charged > 0 && !d.sim.charge(ctx.physical, charged, Charge::Memory) {
        return Err(CUDA_ERROR_OUT_OF_MEMORY);
    }
    let mut st = d.state();
    let h = st.handles.allocate();
    st.mem.arrays.insert(
        h,
        ArrayObj {
            physical: ctx.physical,
            ctx: ctx.handle,
            size,
            deferred,
            mipmapped: levels.is_some(),
        },
    );
    // SAFETY: checked non-null above.
    unsafe { *handle = h as CUarray };
    Ok(())
}

fn desc_2d(
    w: u64,
    h: u64,
    format: i32,
    channels: u32,
) -> Result<CUDA_ARRAY3D_DESCRIPTOR, CUresult> {
    if w == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok(CUDA_ARRAY3D_DESCRIPTOR {
        width: w as usize,
        height: h as usize,
        depth: 0,
        format,
        num_channels: channels,
        flags: 0,
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuArrayCreate_v2(
    handle: *mut CUarray,
    desc: *const CUDA_ARRAY_DESCRIPTOR,
) -> CUresult {
    entry(|| {
        driver()?;
        let a = desc.as_ref().ok_or(CUDA_ERROR_INVALID_VALUE)?;
        create_array(
            handle,
            desc_2d(a.width as u64, a.height as u64, a.format, a.num_channels)?,
            None,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuArrayCreate(
    handle: *mut CUarray,
    desc: *const CUDA_ARRAY_DESCRIPTOR_v1,
) -> CUresult {
    entry(|| {
        driver()?;
        let a = desc.as_ref().ok_or(CUDA_ERROR_INVALID_VALUE)?;
        create_array(
            handle,
            desc_2d(a.width as u64, a.height as u64, a.format, a.num_channels)?,
            None,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuArray3DCreate_v2(
    handle: *mut CUarray,
    desc: *const CUDA_ARRAY3D_DESCRIPTOR,
) -> CUresult {
    entry(|| {
        driver()?;
        create_array(
            handle,
            *desc.as_ref().ok_or(CUDA_ERROR_INVALID_VALUE)?,
            None,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuArray3DCreate(
    handle: *mut CUarray,
    desc: *const CUDA_ARRAY3D_DESCRIPTOR_v1,
) -> CUresult {
    entry(|| {
        driver()?;
        let a = desc.as_ref().ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let v2 = CUDA_ARRAY3D_DESCRIPTOR {
            width: a.width as usize,
            height: a.height as usize,
            depth: a.depth as usize,
            format: a.format,
            num_channels: a.num_channels,
            flags: a.flags,
        };
        create_array(handle, v2, None)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMipmappedArrayCreate(
    handle: *mut CUmipmappedArray,
    desc: *const CUDA_ARRAY3D_DESCRIPTOR,
    levels: u32,
) -> CUresult {
    entry(|| {
        driver()?;
        create_array(
            handle,
            *desc.as_ref().ok_or(CUDA_ERROR_INVALID_VALUE)?,
            Some(levels),
        )
    })
}

fn destroy_array(handle: usize, mipmapped: bool) -> Result<(), CUresult> {
    let d = driver()?;
    let mut st = d.state();
    match st.mem.arrays.get(handle) {
        Some(a) if a.mipmapped == mipmapped => {}
        _ => return Err(CUDA_ERROR_INVALID_HANDLE),
    }
    let a = st.mem.arrays.remove(handle).expect("checked");
    if !a.deferred && a.size > 0 {
        d.sim.uncharge(a.physical, a.size, Charge::Memory);
    }
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn cuArrayDestroy(array: CUarray) -> CUresult {
    entry(|| destroy_array(array as usize, false))
}

#[no_mangle]
pub unsafe extern "C" fn cuMipmappedArrayDestroy(array: CUmipmappedArray) -> CUresult {
    entry(|| destroy_array(array as usize, true))
}

/// cuda.h: "If the CUDA array is not allocated with flag CUDA_ARRAY3D_DEFERRED_MAPPING
/// CUDA_ERROR_INVALID_VALUE will be returned": the size of an ordinary array cannot be asked.
unsafe fn requirements(
    req: *mut CUDA_ARRAY_MEMORY_REQUIREMENTS,
    handle: usize,
    dev: CUdevice,
    mipmapped: bool,
) -> Result<(), CUresult> {
    let d = driver()?;
    d.ordinal(dev)?;
    if req.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let st = d.state();
    let a = st
        .mem
        .arrays
        .get(handle)
        .filter(|a| a.mipmapped == mipmapped)
        .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    if !a.deferred {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    out(
        req,
        CUDA_ARRAY_MEMORY_REQUIREMENTS {
            size: a.size as usize,
            alignment: ARRAY_PAGE as usize,
            reserved: [0; 4],
        },
    );
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn cuArrayGetMemoryRequirements(
    req: *mut CUDA_ARRAY_MEMORY_REQUIREMENTS,
    array: CUarray,
    dev: CUdevice,
) -> CUresult {
    entry(|| requirements(req, array as usize, dev, false))
}

#[no_mangle]
pub unsafe extern "C" fn cuMipmappedArrayGetMemoryRequirements(
    req: *mut CUDA_ARRAY_MEMORY_REQUIREMENTS,
    array: CUmipmappedArray,
    dev: CUdevice,
) -> CUresult {
    entry(|| requirements(req, array as usize, dev, true))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_reused_once_the_window_is_used_up() {
        let mut s = Space::new(0x1000, 0x4000);
        let a = s.alloc(0x1000, 0x200).unwrap();
        let b = s.alloc(0x2000, 0x200).unwrap();
        let _c = s.alloc(0x1000, 0x200).unwrap();
        assert!(s.alloc(0x200, 0x200).is_none());
        s.free(b);
        assert_eq!(s.alloc(0x1800, 0x200), Some(a + 0x1000));
    }

    #[test]
    fn pitch_rows_round_to_512_and_charge_pitch_times_height() {
        assert_eq!(pitch_for(100, 3, 4), Ok((512, 1536)));
        assert_eq!(pitch_for(512, 2, 16), Ok((512, 1024)));
        assert_eq!(pitch_for(513, 1, 8), Ok((1024, 1024)));
        assert_eq!(pitch_for(100, 3, 2), Err(CUDA_ERROR_INVALID_VALUE));
        assert_eq!(pitch_for(0, 3, 4), Err(CUDA_ERROR_INVALID_VALUE));
    }

    #[test]
    fn arrays_take_padded_rows_in_whole_pages() {
        // 100 x 10 float4: rows of 1600 -> 1600 bytes (a multiple of 64), 16 rows, one 64 KiB page.
        assert_eq!(
            array_bytes(100, 10, 0, CU_AD_FORMAT_FLOAT, 4),
            Some(64 << 10)
        );
        // 1000 x 1000 u8: rows of 1024, 1000 rows -> 1 024 000 bytes -> 16 pages.
        assert_eq!(
            array_bytes(1000, 1000, 0, CU_AD_FORMAT_UNSIGNED_INT8, 1),
            Some(16 * (64 << 10))
        );
        assert_eq!(array_bytes(1, 0, 0, 0x77, 1), None);
    }
}

//! The shared accounting file's layout (version 1), as pure offsets and an encode/decode of the
//! header. The live file is read and written through atomics at these offsets (`shared.rs`).
//!
//! ```text
//! 0     header (4 KiB): magic, layout version, sizes and offsets, the limits and policy the file
//!       was made with, the claim index -> GPU UUID map, the time of the last reap
//! 4096  16 device records (256 B each): reserved (the compute limiter's state is in each card's
//!       arbiter file, `arbiter.rs`; the space is kept so that version 1's offsets stay valid for
//!       the processes of a container that run an older library)
//! 8192  1024 process slots (320 B each): owner PIDs, then per claim index the bytes the process
//!       has allocated ("tracked") and its context memory
//! ```
//! All integers are in the machine's byte order: the file is shared by processes of one container on
//! one host, never carried elsewhere. Coordination uses OFD locks on byte ranges (`shared.rs`):
//! byte 0 is the header lock, each slot's range is held by the slot's owner for as long as it
//! lives.

use crate::env::{Config, Uuid, MAX_DEVICES};
use std::fmt;

pub const MAGIC: [u8; 8] = *b"GPUPVGPU";
pub const LAYOUT_VERSION: u32 = 1;
pub const HEADER_SIZE: u64 = 4096;
pub const DEVICE_RECORD_SIZE: u64 = 256;
pub const SLOT_SIZE: u64 = 320;
/// Processes of one container that can hold GPU memory at the same time.
pub const SLOT_COUNT: u64 = 1024;
pub const DEVICES_OFFSET: u64 = HEADER_SIZE;
pub const SLOTS_OFFSET: u64 = DEVICES_OFFSET + MAX_DEVICES as u64 * DEVICE_RECORD_SIZE;
pub const FILE_SIZE: u64 = SLOTS_OFFSET + SLOT_COUNT * SLOT_SIZE;

// Header field offsets.
pub const H_MAGIC: u64 = 0;
pub const H_VERSION: u64 = 8;
pub const H_HEADER_SIZE: u64 = 12;
pub const H_FILE_SIZE: u64 = 16;
pub const H_MAX_DEVICES: u64 = 24;
pub const H_SLOT_COUNT: u64 = 28;
pub const H_DEVICE_RECORD_SIZE: u64 = 32;
pub const H_SLOT_SIZE: u64 = 36;
pub const H_DEVICES_OFFSET: u64 = 40;
pub const H_SLOTS_OFFSET: u64 = 48;
pub const H_POLICY: u64 = 56;
pub const H_PRIORITY: u64 = 60;
pub const H_PRIORITY_SET: u64 = 64;
/// CLOCK_MONOTONIC nanoseconds of the last reap of dead slots (atomic).
pub const H_LAST_REAP_NS: u64 = 72;
/// One past the highest slot ever claimed (atomic): scans stop there, so a container of a few
/// processes sums a few slots, not all of them.
pub const H_SLOTS_HIGH: u64 = 80;
/// 16 x { memory limit u64 (0: none), SM limit u32 (0: none), pad u32 }.
pub const H_LIMITS: u64 = 128;
const LIMIT_ENTRY: u64 = 16;
/// 16 x { set u32, pad u32, uuid [u8; 16] }.
pub const H_UUID_MAP: u64 = 384;
const UUID_ENTRY: u64 = 24;
const HEADER_USED: u64 = H_UUID_MAP + MAX_DEVICES as u64 * UUID_ENTRY;

/// The byte the header lock covers.
pub const HEADER_LOCK: (u64, u64) = (0, 1);

// Slot fields (relative to the slot).
pub const S_IN_USE: u64 = 0;
/// PID as the owner sees itself (its own PID namespace).
pub const S_PID: u64 = 4;
/// PID as NVML reports it (the host's namespace); 0 while unknown.
pub const S_HOST_PID: u64 = 8;
pub const S_START_NS: u64 = 16;
/// 16 x { tracked u64, context u64 }.
pub const S_DEVICES: u64 = 64;

pub fn slot(index: usize) -> u64 {
    SLOTS_OFFSET + index as u64 * SLOT_SIZE
}

pub fn slot_tracked(slot_index: usize, device: usize) -> u64 {
    slot(slot_index) + S_DEVICES + device as u64 * 16
}

pub fn slot_context(slot_index: usize, device: usize) -> u64 {
    slot_tracked(slot_index, device) + 8
}

/// The static part of the header: what a process checks when it attaches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    pub memory_limit: [Option<u64>; MAX_DEVICES],
    pub sm_limit: [Option<u32>; MAX_DEVICES],
    pub policy: u32,
    pub priority: Option<i32>,
    pub uuid_map: [Option<Uuid>; MAX_DEVICES],
}

impl Header {
    /// The header a process with `config` writes into a new file (no UUIDs known yet).
    pub fn for_config(config: &Config) -> Header {
        Header {
            memory_limit: config.memory_limit,
            sm_limit: config.sm_limit,
            policy: config.policy.code(),
            priority: config.priority,
            uuid_map: [None; MAX_DEVICES],
        }
    }

    /// True when the file was made with the same limits, policy and priority as `config` asks.
    pub fn matches(&self, config: &Config) -> bool {
        let expected = Header::for_config(config);
        self.memory_limit == expected.memory_limit
            && self.sm_limit == expected.sm_limit
            && self.policy == expected.policy
            && self.priority == expected.priority
    }

    /// Writes the whole header (magic last in spirit: callers hold the header lock, and a reader
    /// that finds no magic treats the file as new).
    pub fn encode(&self, buf: &mut [u8]) {
        assert!(buf.len() as u64 >= HEADER_SIZE);
        buf[..HEADER_SIZE as usize].fill(0);
        put_u32(buf, H_VERSION, LAYOUT_VERSION);
        put_u32(buf, H_HEADER_SIZE, HEADER_SIZE as u32);
        put_u64(buf, H_FILE_SIZE, FILE_SIZE);
        put_u32(buf, H_MAX_DEVICES, MAX_DEVICES as u32);
        put_u32(buf, H_SLOT_COUNT, SLOT_COUNT as u32);
        put_u32(buf, H_DEVICE_RECORD_SIZE, DEVICE_RECORD_SIZE as u32);
        put_u32(buf, H_SLOT_SIZE, SLOT_SIZE as u32);
        put_u64(buf, H_DEVICES_OFFSET, DEVICES_OFFSET);
        put_u64(buf, H_SLOTS_OFFSET, SLOTS_OFFSET);
        self.encode_settings(buf);
        for (i, uuid) in self.uuid_map.iter().enumerate() {
            Header::encode_uuid(buf, i, *uuid);
        }
        buf[..8].copy_from_slice(&MAGIC);
    }

    /// Rewrites only the limits, policy and priority (the rest of the file stays as it is).
    pub fn encode_settings(&self, buf: &mut [u8]) {
        put_u32(buf, H_POLICY, self.policy);
        put_u32(buf, H_PRIORITY, self.priority.unwrap_or(0) as u32);
        put_u32(buf, H_PRIORITY_SET, self.priority.is_some() as u32);
        for i in 0..MAX_DEVICES {
            let at = H_LIMITS + i as u64 * LIMIT_ENTRY;
            put_u64(buf, at, self.memory_limit[i].unwrap_or(0));
            put_u32(buf, at + 8, self.sm_limit[i].unwrap_or(0));
        }
    }

    pub fn encode_uuid(buf: &mut [u8], index: usize, uuid: Option<Uuid>) {
        let at = H_UUID_MAP + index as u64 * UUID_ENTRY;
        put_u32(buf, at, uuid.is_some() as u32);
        let bytes = uuid.map(|u| u.0).unwrap_or([0; 16]);
        buf[(at + 8) as usize..(at + 24) as usize].copy_from_slice(&bytes);
    }

    pub fn decode(buf: &[u8]) -> Result<Header, LayoutError> {
        if (buf.len() as u64) < HEADER_SIZE || buf[..8].iter().all(|&b| b == 0) {
            return Err(LayoutError::Empty);
        }
        if buf[..8] != MAGIC {
            return Err(LayoutError::NotOurs);
        }
        let version = get_u32(buf, H_VERSION);
        let geometry = [
            (get_u32(buf, H_HEADER_SIZE) as u64, HEADER_SIZE),
            (get_u64(buf, H_FILE_SIZE), FILE_SIZE),
            (get_u32(buf, H_MAX_DEVICES) as u64, MAX_DEVICES as u64),
            (get_u32(buf, H_SLOT_COUNT) as u64, SLOT_COUNT),
            (
                get_u32(buf, H_DEVICE_RECORD_SIZE) as u64,
                DEVICE_RECORD_SIZE,
            ),
            (get_u32(buf, H_SLOT_SIZE) as u64, SLOT_SIZE),
            (get_u64(buf, H_DEVICES_OFFSET), DEVICES_OFFSET),
            (get_u64(buf, H_SLOTS_OFFSET), SLOTS_OFFSET),
        ];
        if version != LAYOUT_VERSION || geometry.iter().any(|(found, ours)| found != ours) {
            return Err(LayoutError::OtherLayout { version });
        }
        let mut memory_limit = [None; MAX_DEVICES];
        let mut sm_limit = [None; MAX_DEVICES];
        let mut uuid_map = [None; MAX_DEVICES];
        for i in 0..MAX_DEVICES {
            let at = H_LIMITS + i as u64 * LIMIT_ENTRY;
            memory_limit[i] = Some(get_u64(buf, at)).filter(|&b| b > 0);
            sm_limit[i] = Some(get_u32(buf, at + 8)).filter(|&p| p > 0);
            let at = H_UUID_MAP + i as u64 * UUID_ENTRY;
            if get_u32(buf, at) == 1 {
                let mut bytes = [0u8; 16];
                bytes.copy_from_slice(&buf[(at + 8) as usize..(at + 24) as usize]);
                uuid_map[i] = Some(Uuid(bytes));
            }
        }
        let priority = (get_u32(buf, H_PRIORITY_SET) == 1).then(|| get_u32(buf, H_PRIORITY) as i32);
        Ok(Header {
            memory_limit,
            sm_limit,
            policy: get_u32(buf, H_POLICY),
            priority,
            uuid_map,
        })
    }

    /// One line for the log: the limits this header holds.
    pub fn describe_limits(&self) -> String {
        describe(&self.memory_limit, &self.sm_limit)
    }
}

/// `memory[0]=1073741824 sm[1]=30%`, listing only limited devices ("none" when nothing is);
/// a limit every device has (the index-less variable) is written once as `[*]`.
pub fn describe(memory: &[Option<u64>; MAX_DEVICES], sm: &[Option<u32>; MAX_DEVICES]) -> String {
    fn list<T: Copy + PartialEq + std::fmt::Display>(
        name: &str,
        unit: &str,
        limits: &[Option<T>; MAX_DEVICES],
    ) -> Vec<String> {
        match limits[0] {
            Some(all) if limits.iter().all(|l| *l == Some(all)) => {
                vec![format!("{name}[*]={all}{unit}")]
            }
            _ => (0..MAX_DEVICES)
                .filter_map(|i| limits[i].map(|v| format!("{name}[{i}]={v}{unit}")))
                .collect(),
        }
    }
    let parts = [list("memory", "", memory), list("sm", "%", sm)].concat();
    if parts.is_empty() {
        "none".to_string()
    } else {
        parts.join(" ")
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LayoutError {
    /// No magic: a new (or truncated) file, to be initialised.
    Empty,
    /// Some other program's file at our path.
    NotOurs,
    /// Our magic, another layout (an older or newer library).
    OtherLayout { version: u32 },
}

impl fmt::Display for LayoutError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LayoutError::Empty => write!(f, "empty"),
            LayoutError::NotOurs => write!(f, "not a gpupool-vgpu file (no magic)"),
            LayoutError::OtherLayout { version } => {
                write!(
                    f,
                    "layout version {version} (this library writes {LAYOUT_VERSION})"
                )
            }
        }
    }
}

fn put_u32(buf: &mut [u8], at: u64, v: u32) {
    buf[at as usize..at as usize + 4].copy_from_slice(&v.to_ne_bytes());
}

fn put_u64(buf: &mut [u8], at: u64, v: u64) {
    buf[at as usize..at as usize + 8].copy_from_slice(&v.to_ne_bytes());
}

fn get_u32(buf: &[u8], at: u64) -> u32 {
    u32::from_ne_bytes(
        buf[at as usize..at as usize + 4]
            .try_into()
            .expect("4 bytes"),
    )
}

fn get_u64(buf: &[u8], at: u64) -> u64 {
    u64::from_ne_bytes(
        buf[at as usize..at as usize + 8]
            .try_into()
            .expect("8 bytes"),
    )
}

// The header's fields must fit in the header, and every record must be 8-byte aligned for atomics.
const _: () = assert!(HEADER_USED <= HEADER_SIZE);
const _: () = assert!(S_DEVICES + MAX_DEVICES as u64 * 16 <= SLOT_SIZE);
const _: () = assert!(
    SLOT_SIZE.is_multiple_of(8)
        && DEVICE_RECORD_SIZE.is_multiple_of(8)
        && SLOTS_OFFSET.is_multiple_of(8)
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env::UtilizationPolicy;

    fn config() -> Config {
        crate::env::parse(
            [
                ("CUDA_DEVICE_MEMORY_LIMIT_0", "1g"),
                ("CUDA_DEVICE_SM_LIMIT_1", "30"),
                ("CUDA_TASK_PRIORITY", "1"),
            ]
            .iter()
            .map(|(k, v)| (k.to_string(), Some(v.to_string()))),
        )
        .config
        .expect("valid")
    }

    #[test]
    fn a_header_round_trips_with_its_uuid_map() {
        let mut header = Header::for_config(&config());
        header.uuid_map[3] = Some(Uuid([7; 16]));
        let mut buf = vec![0u8; HEADER_SIZE as usize];
        header.encode(&mut buf);
        assert_eq!(&buf[..8], b"GPUPVGPU");
        let back = Header::decode(&buf).expect("decodes");
        assert_eq!(back, header);
        assert_eq!(back.memory_limit[0], Some(1 << 30));
        assert_eq!(back.sm_limit[1], Some(30));
        assert_eq!(back.priority, Some(1));
        assert!(back.matches(&config()));
    }

    #[test]
    fn a_header_made_with_other_limits_does_not_match() {
        let mut buf = vec![0u8; HEADER_SIZE as usize];
        Header::for_config(&config()).encode(&mut buf);
        let mut other = config();
        other.memory_limit[0] = Some(2 << 30);
        assert!(!Header::decode(&buf).expect("decodes").matches(&other));
        let mut other = config();
        other.policy = UtilizationPolicy::Force;
        assert!(!Header::decode(&buf).expect("decodes").matches(&other));
    }

    #[test]
    fn an_empty_foreign_or_other_version_file_is_told_apart() {
        let buf = vec![0u8; HEADER_SIZE as usize];
        assert_eq!(Header::decode(&buf), Err(LayoutError::Empty));
        assert_eq!(Header::decode(&buf[..10]), Err(LayoutError::Empty));
        let mut foreign = vec![0u8; HEADER_SIZE as usize];
        foreign[..5].copy_from_slice(b"hello");
        assert_eq!(Header::decode(&foreign), Err(LayoutError::NotOurs));
        let mut newer = vec![0u8; HEADER_SIZE as usize];
        Header::for_config(&config()).encode(&mut newer);
        put_u32(&mut newer, H_VERSION, 2);
        assert_eq!(
            Header::decode(&newer),
            Err(LayoutError::OtherLayout { version: 2 })
        );
        let mut resized = vec![0u8; HEADER_SIZE as usize];
        Header::for_config(&config()).encode(&mut resized);
        put_u32(&mut resized, H_SLOT_COUNT, 64);
        assert_eq!(
            Header::decode(&resized),
            Err(LayoutError::OtherLayout { version: 1 })
        );
    }

    #[test]
    fn settings_can_be_rewritten_without_touching_the_uuid_map() {
        let mut header = Header::for_config(&config());
        header.uuid_map[0] = Some(Uuid([1; 16]));
        let mut buf = vec![0u8; HEADER_SIZE as usize];
        header.encode(&mut buf);
        let mut changed = config();
        changed.memory_limit[0] = Some(5 << 20);
        Header::for_config(&changed).encode_settings(&mut buf);
        let back = Header::decode(&buf).expect("decodes");
        assert!(back.matches(&changed));
        assert_eq!(back.uuid_map[0], Some(Uuid([1; 16])));
    }

    #[test]
    fn records_and_slots_do_not_overlap() {
        assert_eq!(slot(0), SLOTS_OFFSET);
        assert_eq!(slot(SLOT_COUNT as usize), FILE_SIZE);
        assert_eq!(slot_context(0, MAX_DEVICES - 1) + 8, slot(1));
        assert_eq!(slot_tracked(2, 1) % 8, 0);
    }

    #[test]
    fn limits_are_described_for_the_log() {
        let header = Header::for_config(&config());
        assert_eq!(header.describe_limits(), "memory[0]=1073741824 sm[1]=30%");
        assert_eq!(describe(&[None; MAX_DEVICES], &[None; MAX_DEVICES]), "none");
        assert_eq!(
            describe(&[Some(5); MAX_DEVICES], &[Some(30); MAX_DEVICES]),
            "memory[*]=5 sm[*]=30%"
        );
    }
}

//! The stand-ins' configuration: what the simulated cards are, read from the environment by the
//! process that creates the state file (later processes take the cards as the file describes them,
//! like programs on a machine whose GPUs are what they are).

use std::fmt;

/// Most cards a state file holds (the file's layout is fixed-size).
pub const MAX_DEVICES: usize = 8;

/// One simulated card.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceSpec {
    /// Device memory in bytes.
    pub memory: u64,
    /// Streaming multiprocessors.
    pub sms: u32,
}

/// Everything the creating process reads from its environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    pub devices: Vec<DeviceSpec>,
    /// `GPU-...` strings, one per device, when listed; derived from the state file's path otherwise.
    pub uuids: Option<Vec<[u8; 16]>>,
    /// Charged to the process for every context it creates on a device.
    pub context_memory: u64,
    /// Kept by the "driver and firmware" on every card: never free, reported by NVML's v2 memory query.
    pub reserved_memory: u64,
    /// Length of one utilisation sample period (NVML's per-process samples), in milliseconds.
    pub sample_ms: u64,
    /// The longest turn a process has on a card's engine while another process has work there.
    pub timeslice_us: u64,
}

pub const DEFAULT_DEVICES: &str = "1x16g:108";
pub const DEFAULT_CONTEXT_MEMORY: u64 = 300 << 20;
pub const DEFAULT_SAMPLE_MS: u64 = 100;
/// 2 ms: the order of the time-slice a GPU without MPS gives each context under contention.
pub const DEFAULT_TIMESLICE_US: u64 = 2000;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecError {
    pub variable: &'static str,
    pub value: String,
    pub why: String,
}

impl fmt::Display for SpecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={:?}: {}", self.variable, self.value, self.why)
    }
}

impl std::error::Error for SpecError {}

/// `123`, `4k`, `512m`, `40g`, `1t` (either case, powers of 1024).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let (digits, shift) = match text.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_lowercase() {
                'k' => 10,
                'm' => 20,
                'g' => 30,
                't' => 40,
                _ => return Err(format!("unknown size suffix {c:?} (k, m, g or t)")),
            };
            (&text[..i], shift)
        }
        _ => (text, 0),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err("expected a number of bytes with an optional k/m/g/t suffix".into());
    }
    let n: u64 = digits.parse().map_err(|e| format!("{e}"))?;
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| "too large".to_string())
}

/// `2x40g:108,80g:132`: comma-separated groups of `[<count>x]<memory>[:<sms>]` (SMs default 108).
pub fn parse_devices(text: &str) -> Result<Vec<DeviceSpec>, String> {
    let mut devices = Vec::new();
    for group in text.split(',') {
        let group = group.trim();
        if group.is_empty() {
            return Err("empty device group".into());
        }
        let (count, rest) = match group.split_once('x') {
            Some((n, rest)) => (
                n.parse::<usize>()
                    .map_err(|_| format!("bad count in {group:?}"))?,
                rest,
            ),
            None => (1, group),
        };
        let (memory, sms) = match rest.split_once(':') {
            Some((m, s)) => (
                m,
                s.parse::<u32>()
                    .map_err(|_| format!("bad SM count in {group:?}"))?,
            ),
            None => (rest, 108),
        };
        let memory = parse_size(memory).map_err(|e| format!("{group:?}: {e}"))?;
        if count == 0 || memory == 0 || sms == 0 {
            return Err(format!("{group:?}: count, memory and SMs must be positive"));
        }
        for _ in 0..count {
            devices.push(DeviceSpec { memory, sms });
        }
    }
    if devices.len() > MAX_DEVICES {
        return Err(format!("{} devices: at most {MAX_DEVICES}", devices.len()));
    }
    Ok(devices)
}

/// `GPU-8932f937-d72c-4106-c12f-20bd9faed9f6` to its 16 bytes.
pub fn parse_uuid(text: &str) -> Result<[u8; 16], String> {
    let hex = text
        .strip_prefix("GPU-")
        .ok_or("a GPU UUID starts with GPU-")?;
    let groups: Vec<&str> = hex.split('-').collect();
    if groups.iter().map(|g| g.len()).collect::<Vec<_>>() != [8, 4, 4, 4, 12] {
        return Err("expected GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx".into());
    }
    let digits: String = groups.concat();
    let mut out = [0u8; 16];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&digits[2 * i..2 * i + 2], 16).map_err(|_| "not hexadecimal")?;
    }
    Ok(out)
}

/// The form nvidia-smi and NVML print.
pub fn format_uuid(bytes: &[u8; 16]) -> String {
    let h: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// A card's UUID when none is listed: a hash of the state file's path and the card's index, so two
/// tests never share UUIDs and a test can compute them (or read them from NVML).
pub fn derived_uuid(state_path: &str, index: usize) -> [u8; 16] {
    fn fnv(seed: u64, data: &[u8]) -> u64 {
        let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed;
        for &b in data {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h
    }
    let mut data = state_path.as_bytes().to_vec();
    data.extend_from_slice(&(index as u64).to_le_bytes());
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&fnv(0x9e37_79b9_7f4a_7c15, &data).to_be_bytes());
    out[8..].copy_from_slice(&fnv(0x2545_f491_4f6c_dd1d, &data).to_be_bytes());
    out
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

impl Config {
    /// Reads `GPUPOOL_STANDIN_DEVICES`, `GPUPOOL_STANDIN_UUIDS`, `GPUPOOL_STANDIN_CONTEXT_MEMORY`,
    /// `GPUPOOL_STANDIN_RESERVED_MEMORY`, `GPUPOOL_STANDIN_SAMPLE_MS` and
    /// `GPUPOOL_STANDIN_TIMESLICE_US`.
    pub fn from_env() -> Result<Config, SpecError> {
        Config::from_lookup(env)
    }

    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Config, SpecError> {
        let err = |variable: &'static str, value: &str, why: String| SpecError {
            variable,
            value: value.to_string(),
            why,
        };
        let devices_text =
            get("GPUPOOL_STANDIN_DEVICES").unwrap_or_else(|| DEFAULT_DEVICES.to_string());
        let devices = parse_devices(&devices_text)
            .map_err(|why| err("GPUPOOL_STANDIN_DEVICES", &devices_text, why))?;
        let uuids = match get("GPUPOOL_STANDIN_UUIDS") {
            None => None,
            Some(text) => {
                let list: Result<Vec<_>, _> =
                    text.split(',').map(|u| parse_uuid(u.trim())).collect();
                let list = list.map_err(|why| err("GPUPOOL_STANDIN_UUIDS", &text, why))?;
                if list.len() != devices.len() {
                    return Err(err(
                        "GPUPOOL_STANDIN_UUIDS",
                        &text,
                        format!("{} UUIDs for {} devices", list.len(), devices.len()),
                    ));
                }
                Some(list)
            }
        };
        let size = |variable: &'static str, default: u64| -> Result<u64, SpecError> {
            match get(variable) {
                None => Ok(default),
                Some(text) => parse_size(&text).map_err(|why| err(variable, &text, why)),
            }
        };
        let context_memory = size("GPUPOOL_STANDIN_CONTEXT_MEMORY", DEFAULT_CONTEXT_MEMORY)?;
        let reserved_memory = size("GPUPOOL_STANDIN_RESERVED_MEMORY", 0)?;
        let sample_ms = match get("GPUPOOL_STANDIN_SAMPLE_MS") {
            None => DEFAULT_SAMPLE_MS,
            Some(text) => match text.trim().parse::<u64>() {
                Ok(ms) if (10..=1000).contains(&ms) => ms,
                _ => {
                    return Err(err(
                        "GPUPOOL_STANDIN_SAMPLE_MS",
                        &text,
                        "milliseconds, 10 to 1000".into(),
                    ))
                }
            },
        };
        let timeslice_us = match get("GPUPOOL_STANDIN_TIMESLICE_US") {
            None => DEFAULT_TIMESLICE_US,
            Some(text) => match text.trim().parse::<u64>() {
                Ok(us) if (100..=1_000_000).contains(&us) => us,
                _ => {
                    return Err(err(
                        "GPUPOOL_STANDIN_TIMESLICE_US",
                        &text,
                        "microseconds, 100 to 1000000".into(),
                    ))
                }
            },
        };
        for d in &devices {
            if d.memory <= reserved_memory + context_memory {
                return Err(err(
                    "GPUPOOL_STANDIN_DEVICES",
                    &devices_text,
                    "a card must hold more than its reserved memory plus one context".into(),
                ));
            }
        }
        Ok(Config {
            devices,
            uuids,
            context_memory,
            reserved_memory,
            sample_ms,
            timeslice_us,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_use_powers_of_1024_in_either_case() {
        assert_eq!(parse_size("123"), Ok(123));
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("2M"), Ok(2 << 20));
        assert_eq!(parse_size("40g"), Ok(40 << 30));
        assert!(parse_size("12q").is_err());
        assert!(parse_size("g").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("99999999999t").is_err());
    }

    #[test]
    fn device_groups_expand_in_order() {
        let d = parse_devices("2x40g:108,80g:132").unwrap();
        assert_eq!(d.len(), 3);
        assert_eq!(
            d[0],
            DeviceSpec {
                memory: 40 << 30,
                sms: 108
            }
        );
        assert_eq!(
            d[2],
            DeviceSpec {
                memory: 80 << 30,
                sms: 132
            }
        );
        assert_eq!(
            parse_devices("16g").unwrap(),
            vec![DeviceSpec {
                memory: 16 << 30,
                sms: 108
            }]
        );
        assert!(parse_devices("0x16g").is_err());
        assert!(parse_devices("9x1g").is_err());
        assert!(parse_devices("1x16g:abc").is_err());
    }

    #[test]
    fn uuids_round_trip_and_derived_ones_differ() {
        let text = "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6";
        assert_eq!(format_uuid(&parse_uuid(text).unwrap()), text);
        assert!(parse_uuid("8932f937-d72c-4106-c12f-20bd9faed9f6").is_err());
        assert!(parse_uuid("GPU-8932f937-d72c-4106-c12f-20bd9faed9fz").is_err());
        assert_ne!(derived_uuid("/tmp/a", 0), derived_uuid("/tmp/a", 1));
        assert_ne!(derived_uuid("/tmp/a", 0), derived_uuid("/tmp/b", 0));
        assert_eq!(derived_uuid("/tmp/a", 0), derived_uuid("/tmp/a", 0));
    }

    #[test]
    fn config_names_the_bad_variable() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        let c = Config::from_lookup(env(&[])).unwrap();
        assert_eq!(c.devices.len(), 1);
        assert_eq!(c.context_memory, DEFAULT_CONTEXT_MEMORY);
        let e = Config::from_lookup(env(&[("GPUPOOL_STANDIN_CONTEXT_MEMORY", "3x")])).unwrap_err();
        assert_eq!(e.variable, "GPUPOOL_STANDIN_CONTEXT_MEMORY");
        let e = Config::from_lookup(env(&[
            ("GPUPOOL_STANDIN_DEVICES", "2x1g"),
            (
                "GPUPOOL_STANDIN_UUIDS",
                "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6",
            ),
        ]))
        .unwrap_err();
        assert_eq!(e.variable, "GPUPOOL_STANDIN_UUIDS");
        let e = Config::from_lookup(env(&[("GPUPOOL_STANDIN_DEVICES", "1x200m")])).unwrap_err();
        assert_eq!(e.variable, "GPUPOOL_STANDIN_DEVICES");
        assert_eq!(c.timeslice_us, DEFAULT_TIMESLICE_US);
        let c = Config::from_lookup(env(&[("GPUPOOL_STANDIN_TIMESLICE_US", "500")])).unwrap();
        assert_eq!(c.timeslice_us, 500);
        for bad in ["99", "2ms", "1000001"] {
            let e = Config::from_lookup(move |k: &str| {
                (k == "GPUPOOL_STANDIN_TIMESLICE_US").then(|| bad.to_string())
            })
            .unwrap_err();
            assert_eq!(e.variable, "GPUPOOL_STANDIN_TIMESLICE_US", "{bad}");
        }
    }
}

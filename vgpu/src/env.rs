//! The environment contract, parsed without I/O.
//!
//! The variables are HAMi-core's (so a CDI spec written for either library works with both) plus a
//! few of our own (`GPUPOOL_*`). Every malformed value is an error that names the variable and its
//! value: the caller refuses CUDA rather than run a container without the limit it was given.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

/// Devices a claim can carry (HAMi-core's limit too): indices `0..=15`.
pub const MAX_DEVICES: usize = 16;

pub const MEMORY_LIMIT: &str = "CUDA_DEVICE_MEMORY_LIMIT";
pub const SM_LIMIT: &str = "CUDA_DEVICE_SM_LIMIT";
pub const SHARED_CACHE: &str = "CUDA_DEVICE_MEMORY_SHARED_CACHE";
pub const POLICY: &str = "GPU_CORE_UTILIZATION_POLICY";
pub const PRIORITY: &str = "CUDA_TASK_PRIORITY";
pub const LOG_LEVEL: &str = "LIBCUDA_LOG_LEVEL";
pub const DEVICE_UUID: &str = "GPUPOOL_DEVICE_UUID";
pub const MAX_LAUNCH_WAIT_MS: &str = "GPUPOOL_VGPU_MAX_LAUNCH_WAIT_MS";
/// `GPUPOOL_VGPU_ARBITER_<i>`: the card's arbiter file, shared by every container on the card
/// (written and mounted by the driver).
pub const ARBITER: &str = "GPUPOOL_VGPU_ARBITER";

/// Where the shared accounting file lives when `CUDA_DEVICE_MEMORY_SHARED_CACHE` is unset.
pub const DEFAULT_SHARED_CACHE: &str = "/tmp/gpupool-vgpu.cache";

/// The longest a launch waits for its container's turn on the card by default: well over the
/// longest wait of a fair turn (a round of the others' leases and their queued work, ~50 ms),
/// short enough that a rank held here cannot hang a collective its peer's kernel spins in.
pub const DEFAULT_MAX_LAUNCH_WAIT: Duration = Duration::from_millis(250);

/// A GPU's UUID as `cuDeviceGetUuid` returns it (16 bytes); NVML prints it as
/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Uuid(pub [u8; 16]);

impl Uuid {
    /// Parses NVML's form, with or without the `GPU-` prefix.
    pub fn parse(text: &str) -> Option<Uuid> {
        let hex = text.strip_prefix("GPU-").unwrap_or(text);
        let groups: Vec<&str> = hex.split('-').collect();
        let lengths = [8, 4, 4, 4, 12];
        if groups.len() != lengths.len() || groups.iter().zip(lengths).any(|(g, n)| g.len() != n) {
            return None;
        }
        let digits: String = groups.concat();
        let mut bytes = [0u8; 16];
        for (i, byte) in bytes.iter_mut().enumerate() {
            let pair = digits.get(2 * i..2 * i + 2)?;
            if !pair.bytes().all(|b| b.is_ascii_hexdigit()) {
                return None;
            }
            *byte = u8::from_str_radix(pair, 16).ok()?;
        }
        Some(Uuid(bytes))
    }
}

impl fmt::Display for Uuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = &self.0;
        write!(f, "GPU-")?;
        for (i, byte) in b.iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                write!(f, "-")?;
            }
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Uuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// `GPU_CORE_UTILIZATION_POLICY`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UtilizationPolicy {
    /// Unset or `DEFAULT`: throttle only while another container's process uses the card.
    Default,
    /// Always throttle to the limit.
    Force,
    /// Never throttle.
    Disable,
}

impl UtilizationPolicy {
    pub fn code(self) -> u32 {
        match self {
            UtilizationPolicy::Default => 0,
            UtilizationPolicy::Force => 1,
            UtilizationPolicy::Disable => 2,
        }
    }
}

/// Log verbosity from `LIBCUDA_LOG_LEVEL`: 0 errors, 1 warnings (the default), 2 info, 3 and up debug.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum LogLevel {
    Error = 0,
    Warn = 1,
    Info = 2,
    Debug = 3,
}

/// What the environment asks of this process, after validation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// Bytes per claim index; `None`: no memory limit on that device.
    pub memory_limit: [Option<u64>; MAX_DEVICES],
    /// Percent of the card's SM time per claim index, `1..=99`; `None`: unthrottled.
    pub sm_limit: [Option<u32>; MAX_DEVICES],
    /// The card each claim index stands for, when the driver says so (`GPUPOOL_DEVICE_UUID_<i>`).
    pub device_uuid: [Option<Uuid>; MAX_DEVICES],
    pub shared_cache: String,
    pub policy: UtilizationPolicy,
    /// `CUDA_TASK_PRIORITY`: recorded in the shared file for tools, not acted on.
    pub priority: Option<i32>,
    pub max_launch_wait: Duration,
    /// The card's arbiter file per claim index (`GPUPOOL_VGPU_ARBITER_<i>`); None: the container
    /// arbitrates only among its own processes.
    pub arbiter: [Option<String>; MAX_DEVICES],
}

impl Config {
    /// True when some device has an SM limit the policy lets us act on.
    pub fn throttles(&self) -> bool {
        self.policy != UtilizationPolicy::Disable && self.sm_limit.iter().any(Option::is_some)
    }

    pub fn limits_anything(&self) -> bool {
        self.throttles() || self.memory_limit.iter().any(Option::is_some)
    }
}

/// A variable whose value we will not act on. Printed as one line naming both.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnvError {
    pub variable: String,
    pub value: String,
    pub reason: &'static str,
}

impl fmt::Display for EnvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={:?}: {}", self.variable, self.value, self.reason)
    }
}

/// Which per-device variable a name is, and for which index (`None`: the index-less form).
fn split_indexed<'a>(name: &'a str, prefix: &str) -> Option<Result<Option<usize>, &'a str>> {
    let rest = name.strip_prefix(prefix)?;
    if rest.is_empty() {
        return Some(Ok(None));
    }
    let digits = rest.strip_prefix('_')?;
    // `_00` or `_+1` would be the same device spelt twice; only the canonical form is accepted.
    let canonical = !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit())
        && (digits == "0" || !digits.starts_with('0'));
    Some(match digits.parse::<usize>() {
        Ok(i) if canonical && i < MAX_DEVICES => Ok(Some(i)),
        _ => Err(digits),
    })
}

/// `12`, `12k`, `12M`, `12g`: bytes, the suffix a power of 1024 (HAMi-core's format). Decimal only:
/// HAMi-core reads a leading `0` as octal, so `010` means different things to the two libraries and
/// is refused rather than guessed.
pub fn parse_size(value: &str) -> Result<u64, &'static str> {
    const REASON: &str = "not a size (decimal digits with an optional k/m/g suffix)";
    let (digits, shift) = match value.as_bytes().last() {
        Some(b'k' | b'K') => (&value[..value.len() - 1], 10),
        Some(b'm' | b'M') => (&value[..value.len() - 1], 20),
        Some(b'g' | b'G') => (&value[..value.len() - 1], 30),
        _ => (value, 0),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(REASON);
    }
    if digits.len() > 1 && digits.starts_with('0') {
        return Err("a leading zero is ambiguous (HAMi-core reads it as octal)");
    }
    let number: u64 = digits.parse().map_err(|_| "too large")?;
    number.checked_mul(1u64 << shift).ok_or("too large")
}

/// `CUDA_DEVICE_SM_LIMIT`: a whole percent; 0 and 100 or more mean unthrottled.
pub fn parse_sm_percent(value: &str) -> Result<Option<u32>, &'static str> {
    const REASON: &str = "not a whole percent";
    if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
        return Err(REASON);
    }
    if value.len() > 1 && value.starts_with('0') {
        return Err("a leading zero is ambiguous (HAMi-core reads it as octal)");
    }
    match value.parse::<u64>() {
        Ok(0) => Ok(None),
        Ok(p) if p >= 100 => Ok(None),
        Ok(p) => Ok(Some(p as u32)),
        // Digits too many for u64 are still "100 or more".
        Err(_) => Ok(None),
    }
}

/// Reads the log level first, on its own: logging is needed to report every other error. A bad
/// value is reported by [`parse`] as a warning, not refused: it limits nothing.
pub fn parse_log_level(value: Option<&str>) -> LogLevel {
    match value.map(str::parse::<i64>) {
        Some(Ok(n)) if n <= 0 => LogLevel::Error,
        Some(Ok(1)) => LogLevel::Warn,
        Some(Ok(2)) => LogLevel::Info,
        Some(Ok(_)) => LogLevel::Debug,
        _ => LogLevel::Warn,
    }
}

/// The result of reading the environment: a config, or every reason it cannot be obeyed, plus
/// warnings about values that limit nothing.
#[derive(Debug)]
pub struct Parsed {
    pub config: Result<Config, Vec<EnvError>>,
    pub warnings: Vec<String>,
}

/// Validates the variables we read. `vars` is the whole environment (name, value); a value that is
/// not UTF-8 is passed as `None` and refused for our variables.
pub fn parse<I>(vars: I) -> Parsed
where
    I: IntoIterator<Item = (String, Option<String>)>,
{
    let mut errors = Vec::new();
    let mut warnings = Vec::new();
    let mut memory_default: Option<u64> = None;
    let mut memory_indexed: BTreeMap<usize, Option<u64>> = BTreeMap::new();
    let mut sm_default: Option<u32> = None;
    let mut sm_indexed: BTreeMap<usize, Option<u32>> = BTreeMap::new();
    let mut device_uuid = [None; MAX_DEVICES];
    let mut shared_cache = None;
    let mut policy = UtilizationPolicy::Default;
    let mut priority = None;
    let mut max_launch_wait = DEFAULT_MAX_LAUNCH_WAIT;
    let mut arbiter: [Option<String>; MAX_DEVICES] = Default::default();

    // Sorted so that the error lines come out in a stable order.
    let sorted: BTreeMap<String, Option<String>> = vars.into_iter().collect();
    for (name, value) in &sorted {
        let relevant = name.starts_with(MEMORY_LIMIT)
            || name.starts_with(SM_LIMIT)
            || name.starts_with(DEVICE_UUID)
            || name.starts_with(ARBITER)
            || [SHARED_CACHE, POLICY, PRIORITY, MAX_LAUNCH_WAIT_MS].contains(&name.as_str());
        if !relevant {
            if name == LOG_LEVEL && value.as_deref().is_some_and(|v| v.parse::<i64>().is_err()) {
                warnings.push(format!(
                    "{LOG_LEVEL}={value:?} is not a number; using 1 (warnings)"
                ));
            }
            continue;
        }
        let Some(value) = value.as_deref() else {
            errors.push(EnvError {
                variable: name.clone(),
                value: "<not UTF-8>".into(),
                reason: "not UTF-8",
            });
            continue;
        };
        let mut fail = |reason: &'static str| {
            errors.push(EnvError {
                variable: name.clone(),
                value: value.to_string(),
                reason,
            });
        };
        if name == SHARED_CACHE {
            if !value.starts_with('/') {
                // A relative path names a different file in each working directory: one limit per
                // folder instead of one per container.
                fail("not an absolute path");
            } else {
                shared_cache = Some(value.to_string());
            }
        } else if name == POLICY {
            match value.to_ascii_uppercase().as_str() {
                "" | "DEFAULT" => policy = UtilizationPolicy::Default,
                "FORCE" => policy = UtilizationPolicy::Force,
                "DISABLE" => policy = UtilizationPolicy::Disable,
                _ => fail("not one of DEFAULT, FORCE, DISABLE"),
            }
        } else if name == PRIORITY {
            match value.parse::<i32>() {
                Ok(p) => priority = Some(p),
                Err(_) => fail("not an integer"),
            }
        } else if name == MAX_LAUNCH_WAIT_MS {
            match value.parse::<u64>() {
                Ok(ms) => max_launch_wait = Duration::from_millis(ms),
                Err(_) => fail("not a whole number of milliseconds"),
            }
        } else if let Some(index) = split_indexed(name, MEMORY_LIMIT) {
            match (index, parse_size(value)) {
                (Err(_), _) => fail("the device index is not 0..15"),
                (_, Err(reason)) => fail(reason),
                // 0 means "no limit" in HAMi-core's contract, as it does for the SM limit.
                (Ok(None), Ok(bytes)) => memory_default = (bytes > 0).then_some(bytes),
                (Ok(Some(i)), Ok(bytes)) => {
                    memory_indexed.insert(i, (bytes > 0).then_some(bytes));
                }
            }
        } else if let Some(index) = split_indexed(name, SM_LIMIT) {
            match (index, parse_sm_percent(value)) {
                (Err(_), _) => fail("the device index is not 0..15"),
                (_, Err(reason)) => fail(reason),
                (Ok(None), Ok(p)) => sm_default = p,
                (Ok(Some(i)), Ok(p)) => {
                    sm_indexed.insert(i, p);
                }
            }
        } else if let Some(index) = split_indexed(name, ARBITER) {
            match index {
                Ok(Some(_)) if !value.starts_with('/') => fail("not an absolute path"),
                Ok(Some(i)) => arbiter[i] = Some(value.to_string()),
                Ok(None) => fail("needs a device index: GPUPOOL_VGPU_ARBITER_<i>"),
                Err(_) => fail("the device index is not 0..15"),
            }
        } else if let Some(index) = split_indexed(name, DEVICE_UUID) {
            match (index, Uuid::parse(value)) {
                (Ok(Some(i)), Some(uuid)) => device_uuid[i] = Some(uuid),
                (Ok(None), _) => fail("needs a device index: GPUPOOL_DEVICE_UUID_<i>"),
                (Err(_), _) => fail("the device index is not 0..15"),
                (_, None) => fail("not a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)"),
            }
        }
        // Other names that merely start with a prefix (e.g. CUDA_DEVICE_MEMORY_LIMITS) fall through
        // `split_indexed` as None and are not ours.
    }

    if !errors.is_empty() {
        return Parsed {
            config: Err(errors),
            warnings,
        };
    }
    let mut memory_limit = [memory_default; MAX_DEVICES];
    for (i, limit) in memory_indexed {
        memory_limit[i] = limit;
    }
    let mut sm_limit = [sm_default; MAX_DEVICES];
    for (i, limit) in sm_indexed {
        sm_limit[i] = limit;
    }
    let config = Config {
        memory_limit,
        sm_limit,
        device_uuid,
        shared_cache: shared_cache.unwrap_or_else(|| DEFAULT_SHARED_CACHE.to_string()),
        policy,
        priority,
        max_launch_wait,
        arbiter,
    };
    Parsed {
        config: Ok(config),
        warnings,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Parsed {
        parse(
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), Some(v.to_string()))),
        )
    }

    fn ok(pairs: &[(&str, &str)]) -> Config {
        env(pairs).config.expect("valid environment")
    }

    fn errors(pairs: &[(&str, &str)]) -> Vec<EnvError> {
        env(pairs).config.expect_err("invalid environment")
    }

    #[test]
    fn sizes_use_powers_of_1024_in_either_case() {
        assert_eq!(parse_size("12"), Ok(12));
        assert_eq!(parse_size("3k"), Ok(3 * 1024));
        assert_eq!(parse_size("3K"), Ok(3 * 1024));
        assert_eq!(parse_size("1024m"), Ok(1 << 30));
        assert_eq!(parse_size("1024M"), Ok(1 << 30));
        assert_eq!(parse_size("2g"), Ok(2 << 30));
        assert_eq!(parse_size("2G"), Ok(2 << 30));
        assert_eq!(parse_size("0"), Ok(0));
    }

    #[test]
    fn malformed_sizes_are_refused() {
        for bad in [
            "", "12q", "m", "1.5g", "-1", " 12", "12 ", "0x10", "12mb", "1t", "010",
        ] {
            assert!(parse_size(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(parse_size("18446744073709551615"), Ok(u64::MAX));
        assert_eq!(parse_size("18446744073709551616"), Err("too large"));
        assert_eq!(parse_size("17179869184g"), Err("too large"));
    }

    #[test]
    fn indexed_memory_limit_wins_over_the_indexless_one() {
        let config = ok(&[
            ("CUDA_DEVICE_MEMORY_LIMIT", "1g"),
            ("CUDA_DEVICE_MEMORY_LIMIT_1", "512m"),
        ]);
        assert_eq!(config.memory_limit[0], Some(1 << 30));
        assert_eq!(config.memory_limit[1], Some(512 << 20));
        assert_eq!(config.memory_limit[15], Some(1 << 30));
    }

    #[test]
    fn only_the_indexed_devices_are_limited_without_an_indexless_value() {
        let config = ok(&[("CUDA_DEVICE_MEMORY_LIMIT_2", "100m")]);
        assert_eq!(config.memory_limit[2], Some(100 << 20));
        assert_eq!(
            config.memory_limit.iter().filter(|l| l.is_some()).count(),
            1
        );
        assert!(config.limits_anything());
        assert!(!config.throttles());
    }

    #[test]
    fn a_zero_limit_means_no_limit_as_in_hami_core() {
        let config = ok(&[
            ("CUDA_DEVICE_MEMORY_LIMIT", "1g"),
            ("CUDA_DEVICE_MEMORY_LIMIT_0", "0"),
        ]);
        assert_eq!(config.memory_limit[0], None);
        assert_eq!(config.memory_limit[1], Some(1 << 30));
    }

    #[test]
    fn a_malformed_memory_limit_names_the_variable_and_value() {
        let errs = errors(&[("CUDA_DEVICE_MEMORY_LIMIT_0", "12q")]);
        assert_eq!(errs.len(), 1);
        assert_eq!(errs[0].variable, "CUDA_DEVICE_MEMORY_LIMIT_0");
        assert_eq!(errs[0].value, "12q");
        let line = errs[0].to_string();
        assert!(
            line.starts_with("CUDA_DEVICE_MEMORY_LIMIT_0=\"12q\": not a size"),
            "{line}"
        );
    }

    #[test]
    fn device_indices_above_15_or_spelt_oddly_are_refused() {
        for name in [
            "CUDA_DEVICE_MEMORY_LIMIT_16",
            "CUDA_DEVICE_MEMORY_LIMIT_00",
            "CUDA_DEVICE_MEMORY_LIMIT_x",
        ] {
            let errs = errors(&[(name, "1g")]);
            assert_eq!(errs[0].variable, name);
            assert_eq!(errs[0].reason, "the device index is not 0..15");
        }
        assert_eq!(
            errors(&[("CUDA_DEVICE_SM_LIMIT_99", "50")])[0].reason,
            "the device index is not 0..15"
        );
    }

    #[test]
    fn names_that_only_share_a_prefix_are_not_ours() {
        let config = ok(&[
            ("CUDA_DEVICE_MEMORY_LIMITS", "junk"),
            ("CUDA_DEVICE_SM_LIMITER", "x"),
        ]);
        assert!(!config.limits_anything());
    }

    #[test]
    fn sm_limits_zero_and_hundred_or_more_are_unthrottled() {
        assert_eq!(parse_sm_percent("0"), Ok(None));
        assert_eq!(parse_sm_percent("100"), Ok(None));
        assert_eq!(parse_sm_percent("250"), Ok(None));
        assert_eq!(parse_sm_percent("99999999999999999999999"), Ok(None));
        assert_eq!(parse_sm_percent("30"), Ok(Some(30)));
        assert_eq!(parse_sm_percent("1"), Ok(Some(1)));
        for bad in ["abc", "", "30%", "-5", "3.5", "030"] {
            assert!(parse_sm_percent(bad).is_err(), "{bad:?} accepted");
        }
        let config = ok(&[
            ("CUDA_DEVICE_SM_LIMIT", "30"),
            ("CUDA_DEVICE_SM_LIMIT_1", "100"),
        ]);
        assert_eq!(config.sm_limit[0], Some(30));
        assert_eq!(config.sm_limit[1], None);
        assert!(config.throttles());
        let errs = errors(&[("CUDA_DEVICE_SM_LIMIT", "abc")]);
        assert_eq!(
            (errs[0].variable.as_str(), errs[0].value.as_str()),
            ("CUDA_DEVICE_SM_LIMIT", "abc")
        );
    }

    #[test]
    fn the_policy_disable_turns_throttling_off() {
        let config = ok(&[
            ("CUDA_DEVICE_SM_LIMIT", "30"),
            ("GPU_CORE_UTILIZATION_POLICY", "DISABLE"),
        ]);
        assert_eq!(config.policy, UtilizationPolicy::Disable);
        assert!(!config.throttles());
        assert_eq!(
            ok(&[("GPU_CORE_UTILIZATION_POLICY", "force")]).policy,
            UtilizationPolicy::Force
        );
        assert_eq!(ok(&[]).policy, UtilizationPolicy::Default);
        assert_eq!(
            errors(&[("GPU_CORE_UTILIZATION_POLICY", "sometimes")])[0].reason,
            "not one of DEFAULT, FORCE, DISABLE"
        );
    }

    #[test]
    fn every_malformed_variable_is_reported_in_name_order() {
        let errs = errors(&[
            ("CUDA_DEVICE_SM_LIMIT", "abc"),
            ("CUDA_DEVICE_MEMORY_LIMIT_0", "12q"),
            ("CUDA_TASK_PRIORITY", "high"),
        ]);
        let names: Vec<&str> = errs.iter().map(|e| e.variable.as_str()).collect();
        assert_eq!(
            names,
            [
                "CUDA_DEVICE_MEMORY_LIMIT_0",
                "CUDA_DEVICE_SM_LIMIT",
                "CUDA_TASK_PRIORITY"
            ]
        );
    }

    #[test]
    fn a_value_that_is_not_utf8_is_refused_for_our_variables_only() {
        let parsed = parse([
            ("CUDA_DEVICE_MEMORY_LIMIT".to_string(), None),
            ("HOME".to_string(), None),
        ]);
        let errs = parsed.config.expect_err("refused");
        assert_eq!(errs.len(), 1);
        assert_eq!(errs[0].variable, "CUDA_DEVICE_MEMORY_LIMIT");
    }

    #[test]
    fn the_shared_cache_defaults_and_must_be_absolute() {
        assert_eq!(ok(&[]).shared_cache, DEFAULT_SHARED_CACHE);
        assert_eq!(
            ok(&[("CUDA_DEVICE_MEMORY_SHARED_CACHE", "/x/y.cache")]).shared_cache,
            "/x/y.cache"
        );
        assert_eq!(
            errors(&[("CUDA_DEVICE_MEMORY_SHARED_CACHE", "y.cache")])[0].reason,
            "not an absolute path"
        );
        assert_eq!(
            errors(&[("CUDA_DEVICE_MEMORY_SHARED_CACHE", "")])[0].reason,
            "not an absolute path"
        );
    }

    #[test]
    fn priority_and_launch_wait_are_numbers() {
        let config = ok(&[
            ("CUDA_TASK_PRIORITY", "1"),
            ("GPUPOOL_VGPU_MAX_LAUNCH_WAIT_MS", "5"),
        ]);
        assert_eq!(config.priority, Some(1));
        assert_eq!(config.max_launch_wait, Duration::from_millis(5));
        assert_eq!(ok(&[]).max_launch_wait, DEFAULT_MAX_LAUNCH_WAIT);
        assert!(env(&[("GPUPOOL_VGPU_MAX_LAUNCH_WAIT_MS", "soon")])
            .config
            .is_err());
    }

    #[test]
    fn arbiter_paths_are_absolute_and_per_device() {
        let config = env(&[("GPUPOOL_VGPU_ARBITER_1", "/run/gpupool/arbiter/GPU-1")])
            .config
            .unwrap();
        assert_eq!(
            config.arbiter[1].as_deref(),
            Some("/run/gpupool/arbiter/GPU-1")
        );
        assert_eq!(config.arbiter[0], None);
        for (name, value, reason) in [
            ("GPUPOOL_VGPU_ARBITER_0", "arbiter", "not an absolute path"),
            (
                "GPUPOOL_VGPU_ARBITER",
                "/a",
                "needs a device index: GPUPOOL_VGPU_ARBITER_<i>",
            ),
            (
                "GPUPOOL_VGPU_ARBITER_16",
                "/a",
                "the device index is not 0..15",
            ),
        ] {
            let errors = env(&[(name, value)]).config.unwrap_err();
            assert_eq!(errors[0].reason, reason, "{name}={value}");
        }
    }

    #[test]
    fn device_uuids_parse_with_or_without_the_gpu_prefix() {
        let text = "GPU-0123abcd-4567-89ef-0123-456789abcdef";
        let uuid = Uuid::parse(text).expect("valid");
        assert_eq!(uuid.to_string(), text);
        assert_eq!(
            Uuid::parse("0123abcd-4567-89ef-0123-456789abcdef"),
            Some(uuid)
        );
        assert_eq!(
            Uuid::parse("GPU-0123ABCD-4567-89EF-0123-456789ABCDEF"),
            Some(uuid)
        );
        for bad in [
            "GPU-0123abcd",
            "GPU-0123abcd-4567-89ef-0123-456789abcdeg",
            "MIG-0123abcd-4567-89ef-0123-456789abcdef",
            "GPU-+123abcd-4567-89ef-0123-456789abcdef",
        ] {
            assert_eq!(Uuid::parse(bad), None, "{bad}");
        }
        let config = ok(&[("GPUPOOL_DEVICE_UUID_1", text)]);
        assert_eq!(config.device_uuid[1], Some(uuid));
        assert_eq!(config.device_uuid[0], None);
        assert!(errors(&[("GPUPOOL_DEVICE_UUID_0", "GPU-nope")])[0]
            .reason
            .starts_with("not a GPU UUID"));
        assert!(errors(&[("GPUPOOL_DEVICE_UUID", text)])[0]
            .reason
            .starts_with("needs a device index"));
    }

    #[test]
    fn the_log_level_never_refuses_cuda() {
        assert_eq!(parse_log_level(None), LogLevel::Warn);
        assert_eq!(parse_log_level(Some("0")), LogLevel::Error);
        assert_eq!(parse_log_level(Some("2")), LogLevel::Info);
        assert_eq!(parse_log_level(Some("7")), LogLevel::Debug);
        assert_eq!(parse_log_level(Some("loud")), LogLevel::Warn);
        let parsed = env(&[("LIBCUDA_LOG_LEVEL", "loud")]);
        assert!(parsed.config.is_ok());
        assert_eq!(parsed.warnings.len(), 1);
    }
}

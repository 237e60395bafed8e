//! What /proc says about the driver process and the machine.

use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum ProcError {
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: no {field} line")]
    Missing { path: String, field: &'static str },
}

/// A `<field>:  <n> kB` value of a /proc/<pid>/status text.
pub fn parse_status_kib(status: &str, field: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
}

/// Resident memory in KiB: all of it (`VmRSS`) and its anonymous part (`RssAnon`: heap and stacks;
/// the rest is mostly the binary's own pages).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Rss {
    pub total_kib: u64,
    pub anon_kib: u64,
}

pub fn rss(pid: u32) -> Result<Rss, ProcError> {
    let path = format!("/proc/{pid}/status");
    let text = std::fs::read_to_string(&path).map_err(|source| ProcError::Read {
        path: path.clone(),
        source,
    })?;
    let field = |name: &'static str| {
        parse_status_kib(&text, name).ok_or(ProcError::Missing {
            path: path.clone(),
            field: name,
        })
    };
    Ok(Rss {
        total_kib: field("VmRSS")?,
        anon_kib: field("RssAnon")?,
    })
}

/// Resident memory of `pid` in KiB.
pub fn rss_kib(pid: u32) -> Result<u64, ProcError> {
    rss(pid).map(|r| r.total_kib)
}

/// Number of open file descriptors of `pid`.
pub fn open_fds(pid: u32) -> Result<usize, ProcError> {
    let path = format!("/proc/{pid}/fd");
    std::fs::read_dir(&path)
        .map(|entries| entries.count())
        .map_err(|source| ProcError::Read { path, source })
}

/// The first `model name` of a /proc/cpuinfo text.
pub fn parse_cpu_model(cpuinfo: &str) -> Option<String> {
    cpuinfo
        .lines()
        .find(|line| line.starts_with("model name"))
        .and_then(|line| line.split_once(':'))
        .map(|(_, model)| model.trim().to_string())
}

/// `MemTotal` of a /proc/meminfo text, in KiB.
pub fn parse_mem_total_kib(meminfo: &str) -> Option<u64> {
    meminfo
        .lines()
        .find_map(|line| line.strip_prefix("MemTotal:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
}

/// The machine the numbers come from.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Machine {
    pub cpus: usize,
    pub cpu_model: String,
    pub memory_mib: u64,
    pub kernel: String,
    /// Whether the bench itself is a debug build (numbers from a debug build are not the published ones).
    pub debug_build: bool,
}

fn read_or_empty(path: impl AsRef<Path>) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

pub fn machine() -> Machine {
    Machine {
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        cpu_model: parse_cpu_model(&read_or_empty("/proc/cpuinfo"))
            .unwrap_or_else(|| "unknown".into()),
        memory_mib: parse_mem_total_kib(&read_or_empty("/proc/meminfo")).unwrap_or(0) / 1024,
        kernel: read_or_empty("/proc/sys/kernel/osrelease")
            .trim()
            .to_string(),
        debug_build: cfg!(debug_assertions),
    }
}

/// The file system type `path` lives on, from a mount table (`/proc/self/mounts` lines): the
/// longest mount point that contains it.
pub fn filesystem_of(mounts: &str, path: &Path) -> Option<String> {
    mounts
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let (_, mount_point, fs_type) = (fields.next()?, fields.next()?, fields.next()?);
            // Spaces in mount points are escaped as \040.
            let mount_point = mount_point.replace("\\040", " ");
            path.starts_with(&mount_point)
                .then(|| (mount_point.len(), fs_type.to_string()))
        })
        .max_by_key(|(len, _)| *len)
        .map(|(_, fs_type)| fs_type)
}

/// Where a folder is, for the report: `<fs type> (<path>)`.
pub fn describe_folder(path: &Path) -> String {
    let fs_type = filesystem_of(&read_or_empty("/proc/self/mounts"), path)
        .unwrap_or_else(|| "unknown fs".into());
    format!("{fs_type} ({})", path.display())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_mount_point_decides_the_file_system() {
        let mounts = "/dev/vda / ext4 rw 0 0\nproc /proc proc rw 0 0\ntmpfs /dev/shm tmpfs rw 0 0\ntmpfs /run tmpfs rw 0 0\n";
        let fs = |p: &str| filesystem_of(mounts, Path::new(p));
        assert_eq!(
            fs("/dev/shm/gpupool-bench-cdi-x/node-0").as_deref(),
            Some("tmpfs")
        );
        assert_eq!(
            fs("/tmp/gpupool-bench-y/node-0/state").as_deref(),
            Some("ext4")
        );
        // A path component, not a string prefix.
        assert_eq!(fs("/running").as_deref(), Some("ext4"));
        assert_eq!(filesystem_of("", Path::new("/tmp")), None);
    }

    #[test]
    fn rss_fields_from_a_status_file() {
        let status =
            "Name:\tgpupool-driver\nVmPeak:\t  20000 kB\nVmRSS:\t    9876 kB\nRssAnon:\t 4000 kB\n";
        assert_eq!(parse_status_kib(status, "VmRSS"), Some(9876));
        assert_eq!(parse_status_kib(status, "RssAnon"), Some(4000));
        assert_eq!(parse_status_kib(status, "VmPeak"), Some(20000));
        assert_eq!(parse_status_kib("Name:\tzombie\n", "VmRSS"), None);
    }

    #[test]
    fn own_process_has_memory_and_descriptors() {
        let pid = std::process::id();
        let rss = rss(pid).unwrap();
        assert!(rss.anon_kib > 0 && rss.total_kib >= rss.anon_kib, "{rss:?}");
        // stdin, stdout, stderr at least, plus the one read_dir opens.
        assert!(open_fds(pid).unwrap() >= 3);
    }

    #[test]
    fn a_missing_process_is_an_error_naming_the_path() {
        let err = rss_kib(u32::MAX).unwrap_err().to_string();
        assert!(err.contains(&format!("/proc/{}/status", u32::MAX)), "{err}");
    }

    #[test]
    fn cpu_model_and_memory_from_proc_texts() {
        let cpuinfo = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) CPU @ 2.20GHz\n";
        assert_eq!(
            parse_cpu_model(cpuinfo).as_deref(),
            Some("Intel(R) Xeon(R) CPU @ 2.20GHz")
        );
        assert_eq!(
            parse_mem_total_kib("MemTotal:       8148200 kB\nMemFree: 1 kB\n"),
            Some(8148200)
        );
    }
}

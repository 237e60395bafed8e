//! Where the daemon keeps its files, as the real one names them, and the log's line format.

use std::io::Write;
use std::path::{Path, PathBuf};

pub const PIPE_ENV: &str = "CUDA_MPS_PIPE_DIRECTORY";
pub const LOG_ENV: &str = "CUDA_MPS_LOG_DIRECTORY";
pub const DEFAULT_PIPE_DIR: &str = "/tmp/nvidia-mps";
pub const DEFAULT_LOG_DIR: &str = "/var/log/nvidia-mps";
pub const CONTROL_SOCKET: &str = "control";
pub const PID_FILE: &str = "nvidia-cuda-mps-control.pid";
pub const CONTROL_LOG: &str = "control.log";
pub const SERVER_LOG: &str = "server.log";
/// What a server process is called (its `argv[0]`), as `ps` shows the real one.
pub const SERVER_NAME: &str = "nvidia-cuda-mps-server";
/// What the daemon answers when it cannot be reached.
pub const NO_DAEMON: &str = "Cannot find MPS control daemon process";
/// `sun_path` holds 108 bytes with its terminating NUL.
pub const MAX_SOCKET_PATH: usize = 107;

pub struct Dirs {
    pub pipe: PathBuf,
    pub log: PathBuf,
}

impl Dirs {
    pub fn from_env() -> Dirs {
        let dir = |name: &str, default: &str| {
            std::env::var_os(name)
                .filter(|v| !v.is_empty())
                .map_or_else(|| PathBuf::from(default), PathBuf::from)
        };
        Dirs {
            pipe: dir(PIPE_ENV, DEFAULT_PIPE_DIR),
            log: dir(LOG_ENV, DEFAULT_LOG_DIR),
        }
    }

    pub fn socket(&self) -> PathBuf {
        self.pipe.join(CONTROL_SOCKET)
    }

    pub fn pid_file(&self) -> PathBuf {
        self.pipe.join(PID_FILE)
    }
}

/// Appends `[<UTC time> <who> <pid>] <message>` lines to a log file, as the real logs read.
pub struct Log {
    path: PathBuf,
    who: &'static str,
}

impl Log {
    pub fn new(dir: &Path, file: &str, who: &'static str) -> Log {
        Log {
            path: dir.join(file),
            who,
        }
    }

    pub fn line(&self, message: &str) {
        let line = format!(
            "[{} {} {}] {message}\n",
            utc_now(),
            self.who,
            std::process::id()
        );
        if let Ok(mut file) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)
        {
            let _ = file.write_all(line.as_bytes());
        }
    }
}

/// `YYYY-MM-DD HH:MM:SS.mmm` in UTC.
fn utc_now() -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let secs = now.as_secs() as i64;
    let (days, rest) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}.{:03}",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60,
        now.subsec_millis()
    )
}

//! Sockets left by driver pods that were killed (SIGKILL, OOM, node-level eviction) and so never
//! removed their own. With pod UIDs in the names, no later pod binds over them: each crash would
//! leave two more files, and the kubelet would keep trying the dead registration.

use std::io::ErrorKind;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use gpupool_api::names::DRIVER_NAME;

/// Whether `name` is one of this driver's registration sockets: `gpupool.dev-reg.sock` or
/// `gpupool.dev-<pod UID>-reg.sock`.
fn is_registration_socket(name: &str) -> bool {
    name.strip_prefix(DRIVER_NAME)
        .and_then(|rest| rest.strip_prefix('-'))
        .and_then(|rest| rest.strip_suffix("reg.sock"))
        .is_some_and(|uid| uid.is_empty() || is_uid_part(uid.strip_suffix('-')))
}

/// Whether `name` is one of this driver's DRA sockets: `dra.sock` or `dra-<pod UID>.sock`.
fn is_dra_socket(name: &str) -> bool {
    name == "dra.sock"
        || is_uid_part(
            name.strip_prefix("dra-")
                .and_then(|rest| rest.strip_suffix(".sock")),
        )
}

fn is_uid_part(uid: Option<&str>) -> bool {
    uid.is_some_and(|u| !u.is_empty() && u.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'))
}

/// Removes this driver's sockets in `registry_dir`, `plugin_dir` and `run_dir` (the health
/// socket) that nobody listens on, except `keep` (this instance's own). A socket another running
/// instance serves accepts the connection and stays. Returns the files removed.
pub fn remove_dead_sockets(
    registry_dir: &Path,
    plugin_dir: &Path,
    run_dir: &Path,
    keep: &[PathBuf],
) -> Vec<PathBuf> {
    let mut removed = Vec::new();
    for (dir, matches) in [
        (registry_dir, is_registration_socket as fn(&str) -> bool),
        (plugin_dir, is_dra_socket),
        (run_dir, crate::health::inject::is_socket_name),
    ] {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let ours = entry.file_name().to_str().is_some_and(matches);
            let is_socket = entry.file_type().is_ok_and(|t| t.is_socket());
            if !ours || !is_socket || keep.contains(&path) {
                continue;
            }
            // Connecting to a Unix socket never waits: refused means no process holds it.
            match UnixStream::connect(&path) {
                Err(e) if e.kind() == ErrorKind::ConnectionRefused => {
                    match std::fs::remove_file(&path) {
                        Ok(()) => removed.push(path),
                        Err(e) if e.kind() == ErrorKind::NotFound => {}
                        Err(e) => {
                            tracing::warn!(path = %path.display(), error = %e, "could not remove a dead driver's socket")
                        }
                    }
                }
                _ => {}
            }
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_this_drivers_socket_names_match() {
        for name in [
            "gpupool.dev-reg.sock",
            "gpupool.dev-0b7c4a49-6f1e-4a52-9d0e-6d1f3f7a5b10-reg.sock",
        ] {
            assert!(is_registration_socket(name), "{name}");
        }
        for name in [
            "other.dev-reg.sock",
            "gpupool.dev-reg.sock.tmp",
            "gpupool.dev--reg.sock",
            "gpupool.dev-a/b-reg.sock",
            "gpupool.devreg.sock",
        ] {
            assert!(!is_registration_socket(name), "{name}");
        }
        assert!(is_dra_socket("dra.sock") && is_dra_socket("dra-0b7c4a49.sock"));
        for name in ["dra-.sock", "health.sock", "dra.sock.old", "xdra-1.sock"] {
            assert!(!is_dra_socket(name), "{name}");
        }
    }

    #[test]
    fn dead_sockets_go_and_served_ones_stay() {
        let dir = tempfile::tempdir().unwrap();
        let (registry, plugin, run) = (
            dir.path().join("registry"),
            dir.path().join("plugin"),
            dir.path().join("run"),
        );
        for d in [&registry, &plugin, &run] {
            std::fs::create_dir_all(d).unwrap();
        }
        let bind = |path: PathBuf| std::os::unix::net::UnixListener::bind(path).unwrap();
        // A killed pod's sockets: bound, then the listener dropped without removing the file.
        drop(bind(registry.join("gpupool.dev-dead-reg.sock")));
        drop(bind(plugin.join("dra-dead.sock")));
        drop(bind(run.join("health-dead.sock")));
        let _alive = (
            bind(registry.join("gpupool.dev-alive-reg.sock")),
            bind(plugin.join("dra-alive.sock")),
        );
        drop(bind(registry.join("other.dev-reg.sock")));
        let own = plugin.join("dra-own.sock");
        drop(bind(own.clone()));

        let mut removed = remove_dead_sockets(&registry, &plugin, &run, std::slice::from_ref(&own));
        removed.sort();
        assert_eq!(
            removed,
            [
                plugin.join("dra-dead.sock"),
                registry.join("gpupool.dev-dead-reg.sock"),
                run.join("health-dead.sock"),
            ]
        );
        assert!(registry.join("gpupool.dev-alive-reg.sock").exists());
        assert!(plugin.join("dra-alive.sock").exists());
        assert!(
            registry.join("other.dev-reg.sock").exists(),
            "another driver's"
        );
        assert!(own.exists(), "this instance's own is left to its bind");
    }
}

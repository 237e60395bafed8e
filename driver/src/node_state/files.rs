//! One claim's files: its CDI spec and its per-claim folders. Blocking.

use std::fs::{self, Permissions};
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use gpupool_api::cdi::Spec;
use gpupool_api::names::cdi_spec_file_name;

use super::fault::fault_point;
use super::fsutil;
use super::layout::{spec_temp_name, NodeLayout};

/// Write the spec atomically, mode 0644 (container runtimes read it).
pub(super) fn write_spec(layout: &NodeLayout, uid: &str, spec: &Spec) -> io::Result<()> {
    let bytes = serde_json::to_vec_pretty(spec).map_err(io::Error::other)?;
    // Invisible to CDI readers until renamed.
    fsutil::write_temp(&layout.cdi_root, &spec_temp_name(uid), &bytes, 0o644)?;
    fault_point("after-temp-spec-written");
    fsutil::publish(
        &layout.cdi_root,
        &spec_temp_name(uid),
        &cdi_spec_file_name(uid),
        Some("after-spec-renamed"),
    )
}

/// Remove the spec and any temp file of the claim; true when a spec was there.
///
/// No fsync of the folder: a killed process cannot undo an unlink, and after a power cut a spec
/// that comes back is harmless: its checkpoint entry's removal is made durable only later (the
/// log's background sync), so a spec back with its entry is what a synced unlink would leave too
/// (start-up writes the spec of a completed entry again), and one back without its entry is
/// removed at start-up. On a disk that fsync was the one flush on the kubelet's unprepare path
/// (0.5 ms here, more with a journal).
pub(super) fn remove_spec(layout: &NodeLayout, uid: &str) -> io::Result<bool> {
    fsutil::remove_file(&layout.cdi_root.join(spec_temp_name(uid)))?;
    fsutil::remove_file(&layout.spec_path(uid))
}

/// Remove every per-claim folder of the claim.
pub(super) fn remove_claim_folders(layout: &NodeLayout, uid: &str) -> io::Result<()> {
    for folder in layout.claim_folders(uid) {
        fsutil::remove_dir_all(&folder)?;
    }
    Ok(())
}

/// The spec and the claim's folders; `between` runs after the spec is gone (a fault point).
pub(super) fn remove_claim_files(
    layout: &NodeLayout,
    uid: &str,
    between: impl FnOnce(),
) -> io::Result<()> {
    remove_spec(layout, uid)?;
    between();
    remove_claim_folders(layout, uid)
}

/// A folder every container user may write to (HAMi-core's lock folder, the per-claim folders),
/// sticky like /tmp so users cannot remove each other's files.
pub(super) fn ensure_shared_dir(dir: &Path) -> io::Result<()> {
    if !dir.is_dir() {
        fs::create_dir_all(dir)?;
    }
    // Also when the folder exists: a hostPath mount makes it 0755 before we see it, and then
    // containers that do not run as root cannot take HAMi-core's locks.
    if fs::metadata(dir)?.permissions().mode() & 0o7777 != 0o1777 {
        fs::set_permissions(dir, Permissions::from_mode(0o1777))?;
    }
    Ok(())
}

/// A card's arbiter file: created empty if missing (gpupool's library lays it out), 0666 (the
/// containers of a card may run as any user), in a 0711 folder (containers see only the file).
pub(super) fn ensure_arbiter_file(path: &Path) -> io::Result<()> {
    if let Some(dir) = path.parent() {
        if !dir.is_dir() {
            fs::create_dir_all(dir)?;
            fs::set_permissions(dir, Permissions::from_mode(0o711))?;
        }
    }
    let file = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    if file.metadata()?.permissions().mode() & 0o7777 != 0o666 {
        file.set_permissions(Permissions::from_mode(0o666))?;
    }
    Ok(())
}

/// Create the host files a spec mounts that this driver owns (the claim's folders, the HAMi-core
/// lock folder, the cards' arbiter files), so a spec written again after a reboot still has its
/// mount sources.
pub(super) fn ensure_mount_sources(layout: &NodeLayout, uid: &str, spec: &Spec) -> io::Result<()> {
    let arbiters = layout.arbiter_root();
    for mount in spec.devices.iter().flat_map(|d| &d.container_edits.mounts) {
        let host = Path::new(&mount.host_path);
        if host == layout.vgpu_lock_dir || layout.claim_folders(uid).any(|f| f == host) {
            ensure_shared_dir(host)?;
        } else if host.parent() == Some(arbiters.as_path()) {
            ensure_arbiter_file(host)?;
        }
    }
    Ok(())
}

/// Write the spec after creating its mount sources.
pub(super) fn write_spec_with_sources(
    layout: &NodeLayout,
    uid: &str,
    spec: &Spec,
) -> io::Result<()> {
    ensure_mount_sources(layout, uid, spec)?;
    write_spec(layout, uid, spec)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node_state::layout::owned_spec_uid;
    use gpupool_api::cdi::Device;
    use std::os::unix::fs::PermissionsExt;

    const UID: &str = "0f8fad5b-d9cb-469f-a165-70867728950e";

    #[test]
    fn spec_files_are_written_atomically_and_recognised() {
        let dir = tempfile::tempdir().unwrap();
        let layout = NodeLayout::new(
            dir.path().join("state"),
            dir.path().to_path_buf(),
            dir.path().join("run"),
            (
                Path::new("/usr/local/gpupool"),
                Path::new("/usr/local/vgpu"),
            ),
            true,
        );
        let spec = Spec {
            cdi_version: "0.6.0".into(),
            kind: gpupool_api::names::CDI_KIND.into(),
            devices: vec![Device {
                name: "d".into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        write_spec(&layout, UID, &spec).unwrap();
        let path = layout.spec_path(UID);
        let back: Spec = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(back, spec);
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o644
        );
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, [format!("gpupool.dev-claim_{UID}.json")]);
        assert_eq!(owned_spec_uid(&names[0]), Some(UID));
        assert_eq!(owned_spec_uid(&spec_temp_name(UID)), Some(UID));
        assert_eq!(owned_spec_uid("nvidia.com-gpu.json"), None);
        assert!(remove_spec(&layout, UID).unwrap());
        assert!(!remove_spec(&layout, UID).unwrap());
    }

    #[test]
    fn a_cards_arbiter_file_is_made_once_writable_for_all_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run/vgpu-arbiter/GPU-1");
        ensure_arbiter_file(&path).unwrap();
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode(&path), 0o666);
        assert_eq!(mode(path.parent().unwrap()), 0o711);
        // What the library wrote in it stays (a second claim on the card, a spec written again).
        fs::write(&path, b"tenants").unwrap();
        ensure_arbiter_file(&path).unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"tenants");
    }

    #[test]
    fn a_shared_folder_made_0755_by_a_host_path_mount_becomes_sticky_and_writable_for_all() {
        let top = tempfile::tempdir().unwrap();
        let lock = top.path().join("vgpulock");
        std::fs::create_dir(&lock).unwrap();
        std::fs::set_permissions(&lock, std::fs::Permissions::from_mode(0o755)).unwrap();
        ensure_shared_dir(&lock).unwrap();
        let mode = std::fs::metadata(&lock).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, 0o1777, "{mode:o}");
    }
}

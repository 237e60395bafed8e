//! Where the control plane's binaries come from: a folder named by `GPUPOOL_KUBE_BIN`, else by
//! `KUBEBUILDER_ASSETS` (what controller-runtime's `setup-envtest use -p path` prints; its folder
//! holds `etcd` and `kube-apiserver`, to which the scheduler and the controller-manager are added).

use std::path::{Path, PathBuf};

/// Environment that points the harness at the binaries, and makes their absence a failure.
pub mod env {
    /// A folder with `etcd`, `kube-apiserver`, `kube-scheduler` and `kube-controller-manager`.
    pub const KUBE_BIN: &str = "GPUPOOL_KUBE_BIN";
    /// envtest's convention for the same folder, read when `GPUPOOL_KUBE_BIN` is not set.
    pub const KUBEBUILDER_ASSETS: &str = "KUBEBUILDER_ASSETS";
    /// `1` (CI): a scenario that needs the control plane fails, instead of skipping, without it.
    pub const KUBE_REQUIRED: &str = "GPUPOOL_KUBE_REQUIRED";
}

pub const ETCD: &str = "etcd";
pub const KUBE_APISERVER: &str = "kube-apiserver";
pub const KUBE_SCHEDULER: &str = "kube-scheduler";
pub const KUBE_CONTROLLER_MANAGER: &str = "kube-controller-manager";
const ALL: [&str; 4] = [
    ETCD,
    KUBE_APISERVER,
    KUBE_SCHEDULER,
    KUBE_CONTROLLER_MANAGER,
];

/// The four executables of a control plane.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KubeBinaries {
    pub etcd: PathBuf,
    pub apiserver: PathBuf,
    pub scheduler: PathBuf,
    pub controller_manager: PathBuf,
}

impl KubeBinaries {
    /// The binaries in `dir`, or why they cannot be used (which are missing).
    pub fn in_dir(dir: &Path) -> Result<KubeBinaries, String> {
        executables_in(dir, &ALL, "needs")?;
        Ok(KubeBinaries {
            etcd: dir.join(ETCD),
            apiserver: dir.join(KUBE_APISERVER),
            scheduler: dir.join(KUBE_SCHEDULER),
            controller_manager: dir.join(KUBE_CONTROLLER_MANAGER),
        })
    }

    /// The binaries the environment names, or the one line that says why there are none.
    pub fn from_env() -> Result<KubeBinaries, String> {
        match dir_from_env() {
            None => Err(format!(
                "no Kubernetes control plane binaries: set {} (or {}) to a folder with {}",
                env::KUBE_BIN,
                env::KUBEBUILDER_ASSETS,
                ALL.join(", ")
            )),
            Some((var, dir)) => Self::in_dir(&dir).map_err(|why| format!("{var}: {why}")),
        }
    }
}

/// The kubelet and containerd 2.4 (with its runc shim and `ctr`) beside the control plane's
/// binaries, and the images a node imports instead of pulling (`images/*.tar`, docker archives:
/// the pause image and a busybox). Only the scenarios with a real node need them.
pub const KUBELET: &str = "kubelet";
pub const CONTAINERD: &str = "containerd";
pub const CONTAINERD_SHIM: &str = "containerd-shim-runc-v2";
pub const CTR: &str = "ctr";
const NODE: [&str; 4] = [KUBELET, CONTAINERD, CONTAINERD_SHIM, CTR];

/// What a real node runs: the kubelet, containerd and its tools, and the images it imports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeBinaries {
    pub kubelet: PathBuf,
    pub containerd: PathBuf,
    /// The folder of `containerd-shim-runc-v2`, which containerd finds on its PATH.
    pub shim_dir: PathBuf,
    pub ctr: PathBuf,
    pub images: Vec<PathBuf>,
}

impl NodeBinaries {
    /// The node's binaries in `dir` and its images in `dir/images`, or why they cannot be used.
    pub fn in_dir(dir: &Path) -> Result<NodeBinaries, String> {
        executables_in(dir, &NODE, "a real node needs")?;
        let images_dir = dir.join("images");
        let mut images: Vec<PathBuf> = std::fs::read_dir(&images_dir)
            .map_err(|e| {
                format!(
                    "{}: {e} (a real node imports its images from there)",
                    images_dir.display()
                )
            })?
            .filter_map(|entry| entry.ok().map(|e| e.path()))
            .filter(|path| path.extension().is_some_and(|ext| ext == "tar"))
            .collect();
        images.sort();
        if images.is_empty() {
            return Err(format!(
                "{} holds no image archive (*.tar); a real node needs the pause image at least",
                images_dir.display()
            ));
        }
        Ok(NodeBinaries {
            kubelet: dir.join(KUBELET),
            containerd: dir.join(CONTAINERD),
            shim_dir: dir.to_path_buf(),
            ctr: dir.join(CTR),
            images,
        })
    }

    /// The node's binaries in the folder the environment names for the control plane.
    pub fn from_env() -> Result<NodeBinaries, String> {
        let (_, dir) = dir_from_env().ok_or_else(|| {
            format!(
                "no Kubernetes binaries: set {} to a folder with {}, {} and images/",
                env::KUBE_BIN,
                ALL.join(", "),
                NODE.join(", ")
            )
        })?;
        Self::in_dir(&dir)
    }
}

/// Whether a scenario without the binaries must fail rather than skip (`GPUPOOL_KUBE_REQUIRED=1`).
pub fn required() -> bool {
    std::env::var(env::KUBE_REQUIRED).is_ok_and(|v| v == "1" || v == "true")
}

/// The folder `GPUPOOL_KUBE_BIN` names, else `KUBEBUILDER_ASSETS`, with the variable that named it.
fn dir_from_env() -> Option<(&'static str, PathBuf)> {
    [env::KUBE_BIN, env::KUBEBUILDER_ASSETS]
        .into_iter()
        .find_map(|var| {
            std::env::var_os(var)
                .filter(|v| !v.is_empty())
                .map(|v| (var, PathBuf::from(v)))
        })
}

/// Ok if every one of `names` is an executable file in `dir`, else the line that names the missing.
fn executables_in(dir: &Path, names: &[&str], needs: &str) -> Result<(), String> {
    let missing: Vec<&str> = names
        .iter()
        .copied()
        .filter(|name| !is_executable(&dir.join(name)))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    Err(format!(
        "{} lacks {} ({needs} {})",
        dir.display(),
        missing.join(", "),
        names.join(", ")
    ))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_folder_missing_binaries_is_refused_naming_them() {
        let dir = tempfile::tempdir().unwrap();
        for name in [ETCD, KUBE_APISERVER] {
            let path = dir.path().join(name);
            std::fs::write(&path, "").unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        // Present but not executable counts as missing.
        std::fs::write(dir.path().join(KUBE_SCHEDULER), "").unwrap();
        let err = KubeBinaries::in_dir(dir.path()).unwrap_err();
        assert!(
            err.ends_with(
                "lacks kube-scheduler, kube-controller-manager (needs etcd, kube-apiserver, \
                 kube-scheduler, kube-controller-manager)"
            ),
            "{err}"
        );
        for name in [KUBE_SCHEDULER, KUBE_CONTROLLER_MANAGER] {
            let path = dir.path().join(name);
            std::fs::write(&path, "").unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let found = KubeBinaries::in_dir(dir.path()).unwrap();
        assert_eq!(found.scheduler, dir.path().join(KUBE_SCHEDULER));
    }

    #[test]
    fn a_node_needs_its_binaries_and_at_least_one_image() {
        let dir = tempfile::tempdir().unwrap();
        for name in [KUBELET, CONTAINERD, CTR] {
            let path = dir.path().join(name);
            std::fs::write(&path, "").unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let err = NodeBinaries::in_dir(dir.path()).unwrap_err();
        assert!(err.contains("lacks containerd-shim-runc-v2"), "{err}");
        let shim = dir.path().join(CONTAINERD_SHIM);
        std::fs::write(&shim, "").unwrap();
        std::fs::set_permissions(&shim, std::fs::Permissions::from_mode(0o755)).unwrap();
        let err = NodeBinaries::in_dir(dir.path()).unwrap_err();
        assert!(err.contains("images"), "{err}");
        std::fs::create_dir(dir.path().join("images")).unwrap();
        std::fs::write(dir.path().join("images").join("notes.txt"), "").unwrap();
        let err = NodeBinaries::in_dir(dir.path()).unwrap_err();
        assert!(err.contains("no image archive"), "{err}");
        std::fs::write(dir.path().join("images").join("pause.tar"), "").unwrap();
        let node = NodeBinaries::in_dir(dir.path()).unwrap();
        assert_eq!(
            node.images,
            vec![dir.path().join("images").join("pause.tar")]
        );
        assert_eq!(node.shim_dir, dir.path());
    }
}

//! Driver libraries on real GPUs. gpupool's own spec carries device nodes and limits; `libcuda`,
//! `nvidia-smi` and the ldcache hooks come from the node's NVIDIA CDI spec (what `nvidia-ctk cdi
//! generate` or the GPU operator writes), whose device id is returned beside ours so the runtime
//! merges both. A claim whose card has no such device fails: a container without driver libraries
//! would start and then fail every CUDA call, far from the cause.

use std::path::{Path, PathBuf};

use thiserror::Error;

/// CDI kind of the NVIDIA container toolkit's per-GPU devices.
pub const NVIDIA_GPU_KIND: &str = "nvidia.com/gpu";

/// Where a real GPU's driver libraries come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DriverLibraries {
    /// Return `nvidia.com/gpu=<uuid or index>` from a spec found in these folders.
    NvidiaCdi { spec_dirs: Vec<PathBuf> },
    /// The container image or another mechanism provides them.
    None,
}

#[derive(Debug, Error, PartialEq, Eq)]
#[error(
    "no NVIDIA CDI spec in {dirs} declares {NVIDIA_GPU_KIND}={uuid} or ={index}: generate one with \
     `nvidia-ctk cdi generate --output=/var/run/cdi/nvidia.yaml`, or start the driver with \
     --driver-libraries=none if images bring their own driver libraries"
)]
pub struct NotFound {
    pub dirs: String,
    pub uuid: String,
    pub index: u32,
}

/// The name of the device standing for this GPU in one parsed CDI spec: its UUID when the spec was
/// generated with the uuid naming strategy, else its index (nvidia-ctk's default strategy).
pub fn device_name_in_spec(spec: &serde_json::Value, uuid: &str, index: u32) -> Option<String> {
    if spec.get("kind").and_then(|k| k.as_str()) != Some(NVIDIA_GPU_KIND) {
        return None;
    }
    let names: Vec<&str> = spec
        .get("devices")?
        .as_array()?
        .iter()
        .filter_map(|d| d.get("name")?.as_str())
        .collect();
    let index = index.to_string();
    if names.contains(&uuid) {
        Some(uuid.to_string())
    } else if names.contains(&index.as_str()) {
        Some(index)
    } else {
        None
    }
}

/// Looks through the spec files (`.json`, `.yaml`, `.yml`) of `dirs`, in order, for this GPU.
/// Unreadable or foreign files are skipped: the runtime ignores them too.
pub fn find_device_id(dirs: &[PathBuf], uuid: &str, index: u32) -> Result<String, NotFound> {
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        let mut files: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| is_spec_file(p))
            .collect();
        files.sort();
        for file in files {
            let Some(spec) = std::fs::read_to_string(&file)
                .ok()
                .and_then(|text| serde_yaml::from_str::<serde_json::Value>(&text).ok())
            else {
                continue;
            };
            if let Some(name) = device_name_in_spec(&spec, uuid, index) {
                return Ok(format!("{NVIDIA_GPU_KIND}={name}"));
            }
        }
    }
    Err(NotFound {
        dirs: dirs
            .iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(", "),
        uuid: uuid.to_string(),
        index,
    })
}

fn is_spec_file(path: &Path) -> bool {
    matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("json" | "yaml" | "yml")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const UUID: &str = "GPU-b128a15c-0000-1111-2222-333344445555";

    #[test]
    fn prefers_the_uuid_then_the_index() {
        let both = json!({"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu",
            "devices": [{"name": "0"}, {"name": UUID}, {"name": "all"}]});
        assert_eq!(device_name_in_spec(&both, UUID, 0).as_deref(), Some(UUID));
        let by_index = json!({"kind": "nvidia.com/gpu", "devices": [{"name": "0"}, {"name": "1"}]});
        assert_eq!(
            device_name_in_spec(&by_index, UUID, 1).as_deref(),
            Some("1")
        );
        assert_eq!(device_name_in_spec(&by_index, UUID, 2), None);
        let other_kind = json!({"kind": "gpupool.dev/claim", "devices": [{"name": UUID}]});
        assert_eq!(device_name_in_spec(&other_kind, UUID, 0), None);
    }

    #[test]
    fn finds_the_device_in_a_yaml_spec_and_names_the_folders_when_absent() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("broken.json"), "{not json").unwrap();
        std::fs::write(
            dir.path().join("nvidia.yaml"),
            "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: \"0\"\n  containerEdits: {}\n",
        )
        .unwrap();
        let dirs = vec![dir.path().join("missing"), dir.path().to_path_buf()];
        assert_eq!(find_device_id(&dirs, UUID, 0).unwrap(), "nvidia.com/gpu=0");
        let err = find_device_id(&dirs, UUID, 3).unwrap_err();
        assert_eq!(err.index, 3);
        assert!(err.to_string().contains(&dir.path().display().to_string()));
        assert!(err.to_string().contains("--driver-libraries=none"));
    }
}

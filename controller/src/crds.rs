//! The CRD manifests of gpupool's custom resources, generated from the Rust types so that they never drift.

use gpupool_api::crd::{ComputeProfile, GpuModel};
use kube::CustomResourceExt;

/// Each CRD as (file name under `deploy/crds/`, YAML document).
pub fn manifests() -> Vec<(String, String)> {
    [GpuModel::crd(), ComputeProfile::crd()]
        .into_iter()
        .map(|crd| {
            let file = format!("{}.yaml", crd.metadata.name.clone().unwrap_or_default());
            let yaml = serde_yaml::to_string(&crd).expect("a CRD always serialises");
            (file, yaml)
        })
        .collect()
}

/// All CRDs as one multi-document YAML stream, what `gpupool-controller crds` prints.
pub fn multi_document() -> String {
    manifests()
        .into_iter()
        .map(|(_, yaml)| format!("---\n{yaml}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_are_named_after_the_crds() {
        let names: Vec<String> = manifests().into_iter().map(|(f, _)| f).collect();
        assert_eq!(
            names,
            [
                "gpumodels.gpupool.dev.yaml",
                "computeprofiles.gpupool.dev.yaml"
            ]
        );
    }

    #[test]
    fn gpumodel_crd_is_cluster_scoped_with_status_and_columns() {
        let crd = GpuModel::crd();
        assert_eq!(crd.spec.scope, "Cluster");
        let version = &crd.spec.versions[0];
        assert!(version.subresources.as_ref().unwrap().status.is_some());
        let columns: Vec<&str> = version
            .additional_printer_columns
            .as_ref()
            .unwrap()
            .iter()
            .map(|c| c.name.as_str())
            .collect();
        for wanted in ["Model", "Weight", "Devices", "Nodes", "Memory"] {
            assert!(
                columns.contains(&wanted),
                "missing column {wanted}: {columns:?}"
            );
        }
    }
}

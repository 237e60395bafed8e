//! The project's names (docs/architecture.md): the driver, its CDI kind, attribute and capacity keys, API groups.

/// DRA driver name, CDI vendor and CRD group.
pub const DRIVER_NAME: &str = "gpupool.dev";
/// CDI kind of the per-claim specs (`<vendor>/<class>`).
pub const CDI_KIND: &str = "gpupool.dev/claim";
/// API group and version of gpupool's own objects (custom resources, opaque config).
pub const API_GROUP: &str = "gpupool.dev";
pub const API_VERSION: &str = "v1alpha1";
pub const API_GROUP_VERSION: &str = "gpupool.dev/v1alpha1";

/// Attribute names, published under the driver's domain (`device.attributes["gpupool.dev"].<name>`).
pub mod attr {
    pub const PRODUCT_NAME: &str = "productName";
    pub const MODEL: &str = "model";
    pub const ARCHITECTURE: &str = "architecture";
    pub const UUID: &str = "uuid";
    pub const INDEX: &str = "index";
    pub const MULTIPROCESSORS: &str = "multiprocessors";
    pub const CUDA_CORES: &str = "cudaCores";
    pub const COMPUTE_WEIGHT: &str = "computeWeight";
    pub const BRAND: &str = "brand";
    pub const CUDA_COMPUTE_CAPABILITY: &str = "cudaComputeCapability";
    pub const DRIVER_VERSION: &str = "driverVersion";
    pub const CUDA_DRIVER_VERSION: &str = "cudaDriverVersion";
    /// What a device is: [`DEVICE_TYPE_GPU`] (a whole card, shareable in fractions) or
    /// [`DEVICE_TYPE_MIG`] (one MIG partition of a card).
    pub const TYPE: &str = "type";
    /// A MIG device's profile, e.g. "1g.10gb".
    pub const MIG_PROFILE: &str = "migProfile";
    /// NVML's id of that profile.
    pub const MIG_PROFILE_ID: &str = "migProfileId";
    /// First memory slice of a MIG device's placement, and how many it takes.
    pub const MIG_PLACEMENT_START: &str = "migPlacementStart";
    pub const MIG_MEMORY_SLICES: &str = "migMemorySlices";
    /// The UUID of the card a MIG device is carved from (the MIG device's own UUID only exists
    /// once it is created, at prepare).
    pub const PARENT_UUID: &str = "parentUUID";
    /// Cards that share a value talk over NVLink (directly or through one NVSwitch fabric).
    pub const NVLINK_DOMAIN: &str = "nvlinkDomain";
    /// Standard names shared with other drivers, so that constraints can align devices across drivers.
    pub const PCI_BUS_ID: &str = "resource.kubernetes.io/pciBusID";
    pub const PCIE_ROOT: &str = "resource.kubernetes.io/pcieRoot";
    pub const NUMA_NODE: &str = "resource.kubernetes.io/numaNode";
}

/// Values of [`attr::TYPE`].
pub const DEVICE_TYPE_GPU: &str = "gpu";
pub const DEVICE_TYPE_MIG: &str = "mig";

/// The only two consumable capacities of a device (docs/architecture.md, "Device model").
pub mod capacity {
    /// Bytes of device memory; request policy min 1Mi, step 1Mi, default the whole card.
    pub const MEMORY: &str = "memory";
    /// Percent of this card's compute; 0..=100 step 1, default 0 (no compute reserved, no SM limit).
    pub const CORES: &str = "cores";
}

/// Step and minimum of the `memory` capacity, in bytes.
pub const MEMORY_STEP_BYTES: u64 = 1024 * 1024;

/// Name of the device that stands for GPU `index` on its node.
pub fn device_name(index: u32) -> String {
    format!("gpu-{index}")
}

/// Name of the device for a MIG partition of GPU `index`: `gpu-<index>-mig-<profile label>-<start>`
/// (profile label: [`crate::inventory::mig_profile_label`], e.g. `gpu-0-mig-1g-10gb-2`).
pub fn mig_device_name(index: u32, profile_name: &str, start: u32) -> String {
    format!(
        "gpu-{index}-mig-{}-{start}",
        crate::inventory::mig_profile_label(profile_name)
    )
}

/// Name of GPU `index`'s counter set (`spec.sharedCounters[].name`).
pub fn counter_set_name(index: u32) -> String {
    format!("gpu-{index}-counters")
}

/// Counters of a GPU's counter set: DNS labels, as the API requires.
pub mod counter {
    pub const MULTIPROCESSORS: &str = "multiprocessors";
    pub const COPY_ENGINES: &str = "copy-engines";
    pub const DECODERS: &str = "decoders";
    pub const ENCODERS: &str = "encoders";
    pub const JPEG_ENGINES: &str = "jpeg-engines";
    pub const OFA_ENGINES: &str = "ofa-engines";
    pub const MEMORY: &str = "memory";

    /// Memory slice `k` of the card (value 1: taken or not).
    pub fn memory_slice(k: u32) -> String {
        format!("memory-slice-{k}")
    }
}

/// File name of the CDI spec of one prepared claim, inside the CDI root.
pub fn cdi_spec_file_name(claim_uid: &str) -> String {
    format!("{DRIVER_NAME}-claim_{claim_uid}.json")
}

/// Name of a device inside a claim's CDI spec: `<claimUID>-gpu-<index>[-<shareID>]`.
pub fn cdi_device_name(claim_uid: &str, device: &str, share_id: Option<&str>) -> String {
    match share_id {
        Some(share) if !share.is_empty() => format!("{claim_uid}-{device}-{share}"),
        _ => format!("{claim_uid}-{device}"),
    }
}

/// Fully qualified CDI device id as returned to the kubelet: `gpupool.dev/claim=<name>`.
pub fn cdi_device_id(cdi_device_name: &str) -> String {
    format!("{CDI_KIND}={cdi_device_name}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mig_devices_and_counter_sets_have_dns_label_names() {
        use crate::validation::is_dns_label;
        let name = mig_device_name(3, "1g.10gb+me", 6);
        assert_eq!(name, "gpu-3-mig-1g-10gb-me-6");
        assert!(is_dns_label(&name));
        assert!(is_dns_label(&counter_set_name(7)));
        assert!(is_dns_label(&counter::memory_slice(7)));
    }

    #[test]
    fn cdi_names_follow_the_layout() {
        let uid = "0b7c4a49-6f1e-4a52-9d0e-6d1f3f7a5b10";
        assert_eq!(
            cdi_spec_file_name(uid),
            format!("gpupool.dev-claim_{uid}.json")
        );
        assert_eq!(cdi_device_name(uid, "gpu-1", None), format!("{uid}-gpu-1"));
        assert_eq!(
            cdi_device_id(&cdi_device_name(uid, "gpu-1", Some("a1b2"))),
            format!("gpupool.dev/claim={uid}-gpu-1-a1b2")
        );
    }
}

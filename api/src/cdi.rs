//! Container Device Interface (CDI) spec files: plain serde types and the spec's own validity rules.
//!
//! The rules mirror the CDI specification and its reference implementation
//! (cncf-tags/container-device-interface): a known `cdiVersion` at least as new as the features the
//! spec uses, a `vendor/class` kind, device names of `[A-Za-z0-9_.:-]` starting and ending
//! alphanumeric, unique device names, no device without edits, `KEY=VALUE` env entries, absolute
//! paths, device node types `b|c|u|p` and permissions from `rwm`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Every released spec version, oldest first.
pub const KNOWN_VERSIONS: &[&str] = &[
    "0.1.0", "0.2.0", "0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0",
];
/// The oldest version the reference implementation still derives as a minimum.
pub const EARLIEST_VERSION: &str = "0.3.0";
/// The version gpupool writes unless a feature needs newer: container runtimes that predate a
/// version reject specs that declare it, and 0.5.0 is what containerd 1.7 / CRI-O 1.28 read.
pub const PREFERRED_VERSION: &str = "0.5.0";

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Spec {
    pub cdi_version: String,
    pub kind: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    pub devices: Vec<Device>,
    #[serde(default, skip_serializing_if = "ContainerEdits::is_empty")]
    pub container_edits: ContainerEdits,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Device {
    pub name: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    pub container_edits: ContainerEdits,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerEdits {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_nodes: Vec<DeviceNode>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<Mount>,
    /// Needs spec 0.7.0.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub additional_gids: Vec<u32>,
}

impl ContainerEdits {
    pub fn is_empty(&self) -> bool {
        self.env.is_empty()
            && self.device_nodes.is_empty()
            && self.mounts.is_empty()
            && self.additional_gids.is_empty()
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceNode {
    /// Path in the container.
    pub path: String,
    /// Path on the host when it differs (needs spec 0.5.0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_path: Option<String>,
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub major: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minor: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permissions: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Mount {
    pub host_path: String,
    pub container_path: String,
    /// Needs spec 0.4.0.
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
}

fn version_key(v: &str) -> Option<usize> {
    KNOWN_VERSIONS.iter().position(|k| *k == v)
}

fn all_edits(spec: &Spec) -> impl Iterator<Item = &ContainerEdits> {
    spec.devices
        .iter()
        .map(|d| &d.container_edits)
        .chain(std::iter::once(&spec.container_edits))
}

/// The oldest spec version that can express everything `spec` uses (the reference
/// implementation's rules): mount `type` 0.4.0; a device name not starting with a letter or a
/// device node `hostPath` 0.5.0; annotations or a dot in the class 0.6.0; `additionalGids` 0.7.0.
pub fn minimum_version(spec: &Spec) -> &'static str {
    let mut min = EARLIEST_VERSION;
    let mut need = |v: &'static str| {
        if version_key(v) > version_key(min) {
            min = v;
        }
    };
    if all_edits(spec).any(|e| {
        e.mounts
            .iter()
            .any(|m| m.kind.as_ref().is_some_and(|t| !t.is_empty()))
    }) {
        need("0.4.0");
    }
    if spec.devices.iter().any(|d| {
        !d.name
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic())
    }) || all_edits(spec).any(|e| {
        e.device_nodes
            .iter()
            .any(|n| n.host_path.as_ref().is_some_and(|p| !p.is_empty()))
    }) {
        need("0.5.0");
    }
    let class_has_dot = spec
        .kind
        .split_once('/')
        .is_some_and(|(_, class)| class.contains('.'));
    if !spec.annotations.is_empty()
        || spec.devices.iter().any(|d| !d.annotations.is_empty())
        || class_has_dot
    {
        need("0.6.0");
    }
    if all_edits(spec).any(|e| !e.additional_gids.is_empty()) {
        need("0.7.0");
    }
    min
}

/// The version to write: the preferred one unless a feature needs newer.
pub fn version_to_write(spec: &Spec) -> &'static str {
    let min = minimum_version(spec);
    if version_key(min) > version_key(PREFERRED_VERSION) {
        min
    } else {
        PREFERRED_VERSION
    }
}

fn check_vendor_or_class(what: &str, name: &str) -> Result<(), String> {
    let first_ok = name.chars().next().is_some_and(|c| c.is_ascii_alphabetic());
    let last_ok = name
        .chars()
        .last()
        .is_some_and(|c| c.is_ascii_alphanumeric());
    if name.is_empty() {
        return Err(format!("empty {what}"));
    }
    if !first_ok {
        return Err(format!("{what} {name:?} must start with a letter"));
    }
    if !last_ok {
        return Err(format!("{what} {name:?} must end with a letter or digit"));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
    {
        return Err(format!("invalid character {c:?} in {what} {name:?}"));
    }
    Ok(())
}

/// A CDI device name: `[A-Za-z0-9_.:-]`, starting and ending with a letter or digit.
pub fn check_device_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("empty device name".into());
    }
    if !name.starts_with(|c: char| c.is_ascii_alphanumeric()) {
        return Err(format!(
            "device name {name:?} must start with a letter or digit"
        ));
    }
    if !name.ends_with(|c: char| c.is_ascii_alphanumeric()) {
        return Err(format!(
            "device name {name:?} must end with a letter or digit"
        ));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':')))
    {
        return Err(format!("invalid character {c:?} in device name {name:?}"));
    }
    Ok(())
}

fn check_edits(at: &str, edits: &ContainerEdits, problems: &mut Vec<String>) {
    for (i, env) in edits.env.iter().enumerate() {
        if env.split_once('=').is_none_or(|(k, _)| k.is_empty()) {
            problems.push(format!("{at}.env[{i}]: {env:?} is not KEY=VALUE"));
        }
    }
    for (i, node) in edits.device_nodes.iter().enumerate() {
        let at = format!("{at}.deviceNodes[{i}]");
        if !node.path.starts_with('/') {
            problems.push(format!(
                "{at}.path: {:?} is not an absolute path",
                node.path
            ));
        }
        if let Some(host) = &node.host_path {
            if !host.starts_with('/') {
                problems.push(format!("{at}.hostPath: {host:?} is not an absolute path"));
            }
        }
        if let Some(kind) = &node.kind {
            if !matches!(kind.as_str(), "" | "b" | "c" | "u" | "p") {
                problems.push(format!("{at}.type: {kind:?} is not one of b, c, u, p"));
            }
        }
        if let Some(perms) = &node.permissions {
            if !perms.chars().all(|c| matches!(c, 'r' | 'w' | 'm')) {
                problems.push(format!(
                    "{at}.permissions: {perms:?} is not made of r, w, m"
                ));
            }
        }
    }
    for (i, mount) in edits.mounts.iter().enumerate() {
        let at = format!("{at}.mounts[{i}]");
        if !mount.host_path.starts_with('/') {
            problems.push(format!(
                "{at}.hostPath: {:?} is not an absolute path",
                mount.host_path
            ));
        }
        if !mount.container_path.starts_with('/') {
            problems.push(format!(
                "{at}.containerPath: {:?} is not an absolute path",
                mount.container_path
            ));
        }
    }
}

/// Every rule of the CDI spec that `spec` breaks, each naming its field; empty when valid.
pub fn validate(spec: &Spec) -> Vec<String> {
    let mut problems = Vec::new();
    match version_key(&spec.cdi_version) {
        None => problems.push(format!(
            "cdiVersion: unknown version {:?}",
            spec.cdi_version
        )),
        Some(declared) => {
            let min = minimum_version(spec);
            if version_key(min) > Some(declared) {
                problems.push(format!(
                    "cdiVersion: {} is older than {min}, which the spec's features need",
                    spec.cdi_version
                ));
            }
        }
    }
    match spec.kind.split_once('/') {
        Some((vendor, class)) => {
            for (what, name) in [("vendor", vendor), ("class", class)] {
                if let Err(e) = check_vendor_or_class(what, name) {
                    problems.push(format!("kind: {e}"));
                }
            }
        }
        None => problems.push(format!("kind: {:?} is not vendor/class", spec.kind)),
    }
    if spec.devices.is_empty() {
        problems.push("devices: a spec needs at least one device".into());
    }
    let mut seen = std::collections::BTreeSet::new();
    for (i, device) in spec.devices.iter().enumerate() {
        let at = format!("devices[{i}]");
        if let Err(e) = check_device_name(&device.name) {
            problems.push(format!("{at}.name: {e}"));
        }
        if !seen.insert(device.name.as_str()) {
            problems.push(format!("{at}.name: duplicate device {:?}", device.name));
        }
        if device.container_edits.is_empty() {
            problems.push(format!(
                "{at}.containerEdits: a device needs at least one edit"
            ));
        }
        check_edits(
            &format!("{at}.containerEdits"),
            &device.container_edits,
            &mut problems,
        );
    }
    check_edits("containerEdits", &spec.container_edits, &mut problems);
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> Spec {
        Spec {
            cdi_version: "0.5.0".into(),
            kind: "gpupool.dev/claim".into(),
            devices: vec![Device {
                name: "0b7c4a49-6f1e-4a52-9d0e-6d1f3f7a5b10-gpu-0".into(),
                annotations: BTreeMap::new(),
                container_edits: ContainerEdits {
                    env: vec!["CUDA_DEVICE_MEMORY_LIMIT_0=8192m".into()],
                    device_nodes: vec![DeviceNode {
                        path: "/dev/nvidia0".into(),
                        ..Default::default()
                    }],
                    ..Default::default()
                },
            }],
            container_edits: ContainerEdits {
                device_nodes: vec![DeviceNode {
                    path: "/dev/nvidiactl".into(),
                    ..Default::default()
                }],
                ..Default::default()
            },
            ..Default::default()
        }
    }

    #[test]
    fn a_good_spec_is_valid_and_serialises_in_cdi_field_names() {
        let s = spec();
        assert_eq!(validate(&s), Vec::<String>::new());
        let json = serde_json::to_value(&s).unwrap();
        assert_eq!(json["cdiVersion"], "0.5.0");
        assert_eq!(
            json["devices"][0]["containerEdits"]["deviceNodes"][0]["path"],
            "/dev/nvidia0"
        );
        assert!(json.get("annotations").is_none());
        let back: Spec = serde_json::from_value(json).unwrap();
        assert_eq!(back, s);
    }

    #[test]
    fn minimum_version_follows_the_features() {
        let mut s = spec();
        // Device name starting with a digit needs 0.5.0.
        assert_eq!(minimum_version(&s), "0.5.0");
        s.devices[0].name = "gpu0".into();
        assert_eq!(minimum_version(&s), "0.3.0");
        assert_eq!(version_to_write(&s), "0.5.0");
        s.devices[0].container_edits.mounts.push(Mount {
            host_path: "/a".into(),
            container_path: "/a".into(),
            kind: Some("bind".into()),
            options: vec!["ro".into()],
        });
        assert_eq!(minimum_version(&s), "0.4.0");
        s.container_edits.device_nodes[0].host_path = Some("/dev/x".into());
        assert_eq!(minimum_version(&s), "0.5.0");
        s.annotations.insert("a".into(), "b".into());
        assert_eq!(minimum_version(&s), "0.6.0");
        assert_eq!(version_to_write(&s), "0.6.0");
        s.devices[0].container_edits.additional_gids.push(44);
        assert_eq!(minimum_version(&s), "0.7.0");
        s.cdi_version = "0.6.0".into();
        assert!(
            validate(&s)[0].starts_with("cdiVersion"),
            "{:?}",
            validate(&s)
        );
    }

    /// Breaks one rule of a good spec.
    type Breakage = fn(&mut Spec);

    #[test]
    fn each_rule_is_enforced() {
        let cases: Vec<(Breakage, &str)> = vec![
            (|s| s.cdi_version = "0.9.0".into(), "cdiVersion"),
            (|s| s.kind = "gpupool.dev".into(), "kind"),
            (|s| s.kind = "gpupool.dev/9claim".into(), "kind"),
            (|s| s.kind = "-x/claim".into(), "kind"),
            (|s| s.devices[0].name = "a/b".into(), "devices[0].name"),
            (|s| s.devices[0].name = "a-".into(), "devices[0].name"),
            (|s| s.devices[0].name = "".into(), "devices[0].name"),
            (|s| s.devices.push(s.devices[0].clone()), "devices[1].name"),
            (|s| s.devices.clear(), "devices"),
            (
                |s| s.devices[0].container_edits = ContainerEdits::default(),
                "devices[0].containerEdits",
            ),
            (
                |s| s.devices[0].container_edits.env.push("NOVALUE".into()),
                "devices[0].containerEdits.env[1]",
            ),
            (
                |s| s.devices[0].container_edits.env.push("=x".into()),
                "devices[0].containerEdits.env[1]",
            ),
            (
                |s| s.devices[0].container_edits.device_nodes[0].path = "dev/nvidia0".into(),
                "devices[0].containerEdits.deviceNodes[0].path",
            ),
            (
                |s| s.container_edits.device_nodes[0].kind = Some("x".into()),
                "containerEdits.deviceNodes[0].type",
            ),
            (
                |s| s.container_edits.device_nodes[0].permissions = Some("rwx".into()),
                "containerEdits.deviceNodes[0].permissions",
            ),
            (
                |s| {
                    s.container_edits.mounts.push(Mount {
                        host_path: "relative".into(),
                        container_path: "/x".into(),
                        ..Default::default()
                    })
                },
                "containerEdits.mounts[0].hostPath",
            ),
        ];
        for (break_it, field) in cases {
            let mut s = spec();
            break_it(&mut s);
            let problems = validate(&s);
            assert!(
                problems.iter().any(|p| p.starts_with(&format!("{field}:"))),
                "expected a problem at {field}, got {problems:?}"
            );
        }
    }
}

//! Measured GPU use per share: NVML's per-process figures, attributed to a claim through the
//! process's cgroup (-> pod UID) and the pods each prepared claim is reserved for.
//!
//! The mapping is pure ([`pod_uid_from_cgroup`], [`attribute`]); only [`sample_nvml`] and
//! [`read_pod_uid`] touch the host, and [`ReservationCache`] the API server.

use std::collections::{BTreeMap, HashMap};

use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::{Api, Client};

/// One process on one GPU, as NVML reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessSample {
    /// `gpu-<index>`.
    pub gpu: String,
    pub pid: u32,
    /// Framebuffer memory the process holds; `None` where the driver does not say.
    pub memory_used_bytes: Option<u64>,
    /// Share of the SMs the process kept busy over NVML's last sampling window, 0..1.
    pub sm_utilization: Option<f64>,
}

/// A prepared claim as attribution needs it.
#[derive(Debug, Clone, PartialEq)]
pub struct ClaimShares {
    pub uid: String,
    pub namespace: String,
    pub name: String,
    /// Device names (`gpu-<index>`) the claim holds on this node.
    pub gpus: Vec<String>,
}

/// Measured use of one claim's share of one GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct ShareUsage {
    pub namespace: String,
    pub claim: String,
    pub gpu: String,
    pub memory_used_bytes: u64,
    pub sm_utilization: f64,
}

/// The pod UID in a `/proc/<pid>/cgroup` file, for both cgroup drivers and both cgroup versions:
/// systemd names the pod's slice `kubepods-<qos>-pod<uid with _ for ->.slice`, cgroupfs names its
/// folder `pod<uid>`.
pub fn pod_uid_from_cgroup(content: &str) -> Option<String> {
    content.lines().find_map(|line| {
        // `hierarchy-id:controllers:path`; the path may itself hold colons.
        let path = line.splitn(3, ':').nth(2)?;
        if !path.contains("kubepods") {
            return None;
        }
        path.split('/').find_map(pod_uid_from_segment)
    })
}

fn pod_uid_from_segment(segment: &str) -> Option<String> {
    let segment = segment.strip_suffix(".slice").unwrap_or(segment);
    let at = segment.rfind("pod")?;
    let candidate = &segment[at + 3..];
    let uid = candidate.replace('_', "-");
    let looks_like_uid = uid.len() == 36
        && uid.chars().enumerate().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => c == '-',
            _ => c.is_ascii_hexdigit(),
        });
    looks_like_uid.then(|| uid.to_ascii_lowercase())
}

/// Sums the samples of each claim's pods per GPU. A process counts for a claim only on a GPU the
/// claim holds, so a pod with two claims on two cards never has one card's use charged to both;
/// processes of pods that no prepared claim is reserved for (another driver's, the host's) are left
/// out.
pub fn attribute(
    samples: &[(ProcessSample, Option<String>)],
    claims: &[ClaimShares],
    reserved_for: &HashMap<String, Vec<String>>,
) -> Vec<ShareUsage> {
    let mut usage: BTreeMap<(String, String, String), (u64, f64)> = BTreeMap::new();
    for (sample, pod) in samples {
        let Some(pod) = pod else { continue };
        for claim in claims {
            let reserved = reserved_for
                .get(&claim.uid)
                .is_some_and(|pods| pods.iter().any(|p| p == pod));
            if !reserved || !claim.gpus.contains(&sample.gpu) {
                continue;
            }
            let entry = usage
                .entry((
                    claim.namespace.clone(),
                    claim.name.clone(),
                    sample.gpu.clone(),
                ))
                .or_default();
            entry.0 += sample.memory_used_bytes.unwrap_or(0);
            entry.1 += sample.sm_utilization.unwrap_or(0.0);
        }
    }
    usage
        .into_iter()
        .map(|((namespace, claim, gpu), (memory, sm))| ShareUsage {
            namespace,
            claim,
            gpu,
            memory_used_bytes: memory,
            sm_utilization: sm.min(1.0),
        })
        .collect()
}

/// The pod of a host process; `None` for processes outside any pod, or gone.
pub fn read_pod_uid(pid: u32) -> Option<String> {
    let content = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    pod_uid_from_cgroup(&content)
}

/// Every compute process on the node's GPUs (blocking: call from a blocking thread). NVML reports
/// host PIDs, which `/proc` resolves only in the host's PID namespace (`hostPID: true`).
pub fn sample_nvml(nvml: &nvml_wrapper::Nvml, gpu_indexes: &[u32]) -> Vec<ProcessSample> {
    use nvml_wrapper::enums::device::UsedGpuMemory;
    let mut samples = Vec::new();
    for &index in gpu_indexes {
        let Ok(device) = nvml.device_by_index(index) else {
            continue;
        };
        let gpu = gpupool_api::names::device_name(index);
        // The last few seconds' samples; the newest per process wins.
        let since = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(0)
            .saturating_sub(10_000_000);
        let mut sm: HashMap<u32, (u64, u32)> = HashMap::new();
        for s in device.process_utilization_stats(since).unwrap_or_default() {
            let newest = sm.get(&s.pid).is_none_or(|(t, _)| s.timestamp >= *t);
            if newest {
                sm.insert(s.pid, (s.timestamp, s.sm_util));
            }
        }
        for p in device.running_compute_processes().unwrap_or_default() {
            samples.push(ProcessSample {
                gpu: gpu.clone(),
                pid: p.pid,
                memory_used_bytes: match p.used_gpu_memory {
                    UsedGpuMemory::Used(bytes) => Some(bytes),
                    UsedGpuMemory::Unavailable => None,
                },
                sm_utilization: sm.get(&p.pid).map(|(_, u)| f64::from(*u) / 100.0),
            });
        }
    }
    samples
}

/// The pods each prepared claim is reserved for (`status.reservedFor`), read from the API server
/// once per claim and again only when a GPU process belongs to a pod no cached claim names.
#[derive(Default)]
pub struct ReservationCache {
    pods: HashMap<String, Vec<String>>,
}

impl ReservationCache {
    pub async fn resolve(
        &mut self,
        client: &Client,
        claims: &[ClaimShares],
        pods_seen: &[String],
    ) -> &HashMap<String, Vec<String>> {
        self.pods
            .retain(|uid, _| claims.iter().any(|c| &c.uid == uid));
        let unknown_pod = pods_seen
            .iter()
            .any(|pod| !self.pods.values().flatten().any(|p| p == pod));
        if unknown_pod {
            for claim in claims {
                let api: Api<ResourceClaim> = Api::namespaced(client.clone(), &claim.namespace);
                let Ok(Some(object)) = api.get_opt(&claim.name).await else {
                    continue;
                };
                // A claim of the same name made again is another claim.
                if object.metadata.uid.as_deref() != Some(claim.uid.as_str()) {
                    continue;
                }
                let pods = object
                    .status
                    .and_then(|s| s.reserved_for)
                    .unwrap_or_default()
                    .into_iter()
                    .filter(|r| r.resource == "pods")
                    .map(|r| r.uid)
                    .collect();
                self.pods.insert(claim.uid.clone(), pods);
            }
        }
        &self.pods
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "0b7c4a49-6f1e-4a52-9d0e-6d1f3f7a5b10";

    #[test]
    fn the_pod_uid_comes_from_either_cgroup_driver_and_version() {
        let systemd_v2 = "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0b7c4a49_6f1e_4a52_9d0e_6d1f3f7a5b10.slice/cri-containerd-3f2a.scope\n";
        let systemd_guaranteed =
            "0::/kubepods.slice/kubepods-pod0b7c4a49_6f1e_4a52_9d0e_6d1f3f7a5b10.slice/crio-9e.scope\n";
        let cgroupfs_v1 = "12:memory:/kubepods/besteffort/pod0b7c4a49-6f1e-4a52-9d0e-6d1f3f7a5b10/3f2a\n\
                           11:cpu,cpuacct:/kubepods/besteffort/pod0b7c4a49-6f1e-4a52-9d0e-6d1f3f7a5b10/3f2a\n";
        let kind_nested = "0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod0b7c4a49_6f1e_4a52_9d0e_6d1f3f7a5b10.slice/cri-containerd-1.scope\n";
        for content in [systemd_v2, systemd_guaranteed, cgroupfs_v1, kind_nested] {
            assert_eq!(
                pod_uid_from_cgroup(content).as_deref(),
                Some(UID),
                "{content}"
            );
        }
    }

    #[test]
    fn processes_outside_pods_have_no_pod() {
        for content in [
            "0::/system.slice/nvidia-persistenced.service\n",
            "0::/user.slice/user-1000.slice/session-2.scope\n",
            "0::/kubepods.slice/kubepods-burstable.slice\n",
            "0::/kubepods.slice/kubepods-podnot-a-uid.slice\n",
            "",
        ] {
            assert_eq!(pod_uid_from_cgroup(content), None, "{content}");
        }
    }

    fn sample(gpu: &str, pid: u32, memory: u64, sm: f64) -> ProcessSample {
        ProcessSample {
            gpu: gpu.into(),
            pid,
            memory_used_bytes: Some(memory),
            sm_utilization: Some(sm),
        }
    }

    fn claim(uid: &str, name: &str, gpus: &[&str]) -> ClaimShares {
        ClaimShares {
            uid: uid.into(),
            namespace: "ml".into(),
            name: name.into(),
            gpus: gpus.iter().map(|g| g.to_string()).collect(),
        }
    }

    #[test]
    fn each_share_gets_the_use_of_its_own_pods_on_its_own_card() {
        const MIB: u64 = 1 << 20;
        let claims = [
            claim("c1", "train", &["gpu-0"]),
            claim("c2", "serve", &["gpu-0"]),
            claim("c3", "both", &["gpu-1"]),
        ];
        let reserved: HashMap<String, Vec<String>> = [
            ("c1".to_string(), vec!["pod-a".to_string()]),
            ("c2".to_string(), vec!["pod-b".to_string()]),
            ("c3".to_string(), vec!["pod-a".to_string()]),
        ]
        .into();
        let samples = [
            // Two processes of pod-a on gpu-0 add up; its process on gpu-1 belongs to c3 only.
            (
                sample("gpu-0", 10, 300 * MIB, 0.25),
                Some("pod-a".to_string()),
            ),
            (
                sample("gpu-0", 11, 200 * MIB, 0.125),
                Some("pod-a".to_string()),
            ),
            (
                sample("gpu-1", 12, 64 * MIB, 0.5),
                Some("pod-a".to_string()),
            ),
            (
                sample("gpu-0", 20, 1024 * MIB, 0.5),
                Some("pod-b".to_string()),
            ),
            // A pod no prepared claim is reserved for, and a process outside any pod.
            (
                sample("gpu-0", 30, 4096 * MIB, 0.9),
                Some("pod-z".to_string()),
            ),
            (sample("gpu-0", 31, 4096 * MIB, 0.9), None),
        ];
        let usage = attribute(&samples, &claims, &reserved);
        let by_claim: BTreeMap<(&str, &str), (u64, f64)> = usage
            .iter()
            .map(|u| {
                (
                    (u.claim.as_str(), u.gpu.as_str()),
                    (u.memory_used_bytes, u.sm_utilization),
                )
            })
            .collect();
        assert_eq!(
            by_claim,
            BTreeMap::from([
                (("both", "gpu-1"), (64 * MIB, 0.5)),
                (("serve", "gpu-0"), (1024 * MIB, 0.5)),
                (("train", "gpu-0"), (500 * MIB, 0.375)),
            ])
        );
    }

    #[test]
    fn a_share_never_reports_more_than_the_whole_card_busy() {
        let claims = [claim("c1", "burst", &["gpu-0"])];
        let reserved = HashMap::from([("c1".to_string(), vec!["p".to_string()])]);
        let samples = [
            (sample("gpu-0", 1, 0, 0.75), Some("p".to_string())),
            (sample("gpu-0", 2, 0, 0.75), Some("p".to_string())),
        ];
        assert_eq!(
            attribute(&samples, &claims, &reserved)[0].sm_utilization,
            1.0
        );
    }
}

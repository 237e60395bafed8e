//! Choosing a node for a pod's claims, pure: the first node (by name) on which every pending
//! claim of the pod can be allocated and every already-allocated one is usable.

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::{AllocationResult, DeviceClass, ResourceClaim, ResourceSlice};

use crate::allocator::{allocate, node_selector_matches, TargetNode};

/// Where the pod goes and the allocation of each pending claim, in the order given.
#[derive(Debug, Clone, PartialEq)]
pub struct Placement {
    pub node: String,
    pub allocations: Vec<AllocationResult>,
}

/// kube-scheduler's reason for a node where the pod's claims cannot all be allocated.
pub const CANNOT_ALLOCATE: &str = "cannot allocate all claims";
/// kube-scheduler's reason for a node that cannot use a claim allocated already.
pub const CLAIM_NOT_AVAILABLE: &str = "resourceclaim not available on the node";
/// kube-scheduler's reason for a node marked unschedulable.
pub const NODE_UNSCHEDULABLE: &str = "node(s) were unschedulable";
/// kube-scheduler's reason for a node outside the pod's node selector or required affinity.
pub const NODE_AFFINITY_MISMATCH: &str = "node(s) didn't match Pod's node affinity/selector";

/// Why one node was not chosen, attributed to the claim that did not fit there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeFailure {
    pub node: String,
    /// `namespace/name` of the claim, when one claim is to blame.
    pub claim: Option<String>,
    /// kube-scheduler's short reason, counted in the event's summary.
    pub reason: &'static str,
    pub message: String,
}

/// No node fits: one reason per node tried, and how many nodes were left out before devices
/// were looked at, by reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NoFit {
    pub failures: Vec<NodeFailure>,
    pub excluded: BTreeMap<&'static str, usize>,
}

impl NoFit {
    /// The reasons that concern one claim (`namespace/name`), as one message.
    pub fn for_claim(&self, claim: &str) -> Option<String> {
        let reasons: Vec<String> = self
            .failures
            .iter()
            .filter(|f| f.claim.as_deref() == Some(claim))
            .map(|f| format!("{}: {}", f.node, f.message))
            .collect();
        (!reasons.is_empty()).then(|| reasons.join("; "))
    }
}

impl fmt::Display for NoFit {
    /// kube-scheduler's FailedScheduling message (every node counted under its reason, the
    /// counts sorted as text), then what did not fit on each node tried, which kube-scheduler
    /// leaves to its log.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut histogram: BTreeMap<&str, usize> = BTreeMap::new();
        for (reason, count) in &self.excluded {
            *histogram.entry(reason).or_default() += count;
        }
        for failure in &self.failures {
            *histogram.entry(failure.reason).or_default() += 1;
        }
        let total: usize = histogram.values().sum();
        if total == 0 {
            return write!(f, "no nodes available to schedule pods");
        }
        let mut summary: Vec<String> = histogram
            .iter()
            .map(|(reason, count)| format!("{count} {reason}"))
            .collect();
        summary.sort();
        write!(f, "0/{total} nodes are available: {}.", summary.join(", "))?;
        let details: Vec<String> = self
            .failures
            .iter()
            .map(|failure| format!("{}: {}", failure.node, failure.message))
            .collect();
        if !details.is_empty() {
            write!(f, " {}", details.join("; "))?;
        }
        Ok(())
    }
}

impl std::error::Error for NoFit {}

pub fn claim_key(claim: &ResourceClaim) -> String {
    format!(
        "{}/{}",
        claim.metadata.namespace.as_deref().unwrap_or_default(),
        claim.metadata.name.as_deref().unwrap_or_default()
    )
}

/// Nodes the pod may go to before devices are considered: schedulable, matching the pod's
/// `nodeSelector` and required node affinity.
pub fn candidate_nodes(pod: &Pod, nodes: &[Node]) -> Vec<TargetNode> {
    nodes
        .iter()
        .filter(|n| exclusion(pod, n).is_none())
        .map(TargetNode::from)
        .collect()
}

/// How many nodes [`candidate_nodes`] leaves out, by kube-scheduler's reason.
pub fn excluded_nodes(pod: &Pod, nodes: &[Node]) -> BTreeMap<&'static str, usize> {
    let mut out = BTreeMap::new();
    for reason in nodes.iter().filter_map(|n| exclusion(pod, n)) {
        *out.entry(reason).or_default() += 1;
    }
    out
}

/// Why the pod may not go to `node` whatever its devices, in kube-scheduler's filter order.
fn exclusion(pod: &Pod, node: &Node) -> Option<&'static str> {
    if node.spec.as_ref().and_then(|s| s.unschedulable) == Some(true) {
        return Some(NODE_UNSCHEDULABLE);
    }
    let spec = pod.spec.as_ref();
    let labels = spec.and_then(|s| s.node_selector.as_ref());
    let affinity = spec
        .and_then(|s| s.affinity.as_ref())
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|a| {
            a.required_during_scheduling_ignored_during_execution
                .as_ref()
        });
    let target = TargetNode::from(node);
    let selected = labels
        .into_iter()
        .flatten()
        .all(|(k, v)| target.labels.get(k) == Some(v));
    let affine = affinity.is_none_or(|a| node_selector_matches(a, &target));
    (!(selected && affine)).then_some(NODE_AFFINITY_MISMATCH)
}

/// Try `nodes` in name order. `pending` claims get allocated; `bound` claims are already
/// allocated and must be usable on the node; `allocated` is every allocated claim in the
/// cluster (capacity and exclusivity accounting).
pub fn place(
    pending: &[&ResourceClaim],
    bound: &[&ResourceClaim],
    nodes: &[TargetNode],
    classes: &[DeviceClass],
    slices: &[ResourceSlice],
    allocated: &[ResourceClaim],
) -> Result<Placement, NoFit> {
    let mut sorted: Vec<&TargetNode> = nodes.iter().collect();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    let mut failures = Vec::new();
    'nodes: for node in sorted {
        for claim in bound {
            let selector = claim
                .status
                .as_ref()
                .and_then(|s| s.allocation.as_ref())
                .and_then(|a| a.node_selector.as_ref());
            if selector.is_some_and(|s| !node_selector_matches(s, node)) {
                failures.push(NodeFailure {
                    node: node.name.clone(),
                    claim: Some(claim_key(claim)),
                    reason: CLAIM_NOT_AVAILABLE,
                    message: format!(
                        "claim {} is allocated on devices not available on this node",
                        claim_key(claim)
                    ),
                });
                continue 'nodes;
            }
        }
        let mut seen: Vec<ResourceClaim> = allocated.to_vec();
        let mut allocations = Vec::new();
        for claim in pending {
            match allocate(claim, node, classes, slices, &seen) {
                Ok(allocation) => {
                    let mut done = (*claim).clone();
                    done.status.get_or_insert_with(Default::default).allocation =
                        Some(allocation.clone());
                    seen.push(done);
                    allocations.push(allocation);
                }
                Err(e) => {
                    failures.push(NodeFailure {
                        node: node.name.clone(),
                        claim: Some(claim_key(claim)),
                        reason: CANNOT_ALLOCATE,
                        message: e.message,
                    });
                    continue 'nodes;
                }
            }
        }
        return Ok(Placement {
            node: node.name.clone(),
            allocations,
        });
    }
    Err(NoFit {
        failures,
        excluded: BTreeMap::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::*;

    fn nodes() -> Vec<TargetNode> {
        // Deliberately unsorted: placement must not depend on list order.
        ["node-c", "node-a", "node-b"]
            .map(TargetNode::named)
            .to_vec()
    }

    /// Node and result lines of one placed claim.
    type Outcome = Result<(String, Vec<String>), NoFit>;

    /// Places each claim as its own pod, like the loop does, and records the allocation.
    fn run(claims: Vec<ResourceClaim>) -> (Vec<Outcome>, Vec<ResourceClaim>) {
        let classes = seed_classes();
        let slices = seed_slices();
        let mut done: Vec<ResourceClaim> = Vec::new();
        let mut outcomes = Vec::new();
        for claim in claims {
            match place(&[&claim], &[], &nodes(), &classes, &slices, &done) {
                Ok(p) => {
                    outcomes.push(Ok((p.node.clone(), summary(&p.allocations[0]))));
                    done.push(allocated(claim, p.allocations[0].clone()));
                }
                Err(e) => outcomes.push(Err(e)),
            }
        }
        (outcomes, done)
    }

    fn ok(node: &str, line: &str) -> Outcome {
        Ok((node.to_string(), vec![line.to_string()]))
    }

    /// Issue 2, "Done when": 1Gi + 50% of an A100, 70% of a V100, then A100 claims until an
    /// A100 is full; the next is refused with the reason.
    #[test]
    fn packs_the_seed_pool_by_the_consumable_capacity_rules() {
        let a100 =
            |name: &str, requests: &[(&str, &str)]| claim(name, vec![exact("gpu", A100, requests)]);
        let (outcomes, done) = run(vec![
            a100("half-a100", &[("memory", "1Gi"), ("cores", "50")]),
            claim(
                "v100-70",
                vec![exact("gpu", V100, &[("memory", "8Gi"), ("cores", "70")])],
            ),
            a100("a100-20g", &[("memory", "20Gi"), ("cores", "50")]),
            a100("a100-small", &[("memory", "1Gi"), ("cores", "1")]),
            a100("a100-rest", &[("memory", "19Gi")]),
            a100("a100-whole", &[]),
            claim("any-whole", vec![exact("gpu", "gpupool.dev", &[])]),
        ]);
        assert_eq!(
            outcomes[0],
            ok("node-a", "gpu node-a/gpu-0 memory=1Gi cores=50")
        );
        assert_eq!(
            outcomes[1],
            ok("node-b", "gpu node-b/gpu-0 memory=8Gi cores=70")
        );
        // gpu-0 now holds 21Gi and all 100 cores.
        assert_eq!(
            outcomes[2],
            ok("node-a", "gpu node-a/gpu-0 memory=20Gi cores=50")
        );
        // No cores left on gpu-0: the next share with cores goes to gpu-1.
        assert_eq!(
            outcomes[3],
            ok("node-a", "gpu node-a/gpu-1 memory=1Gi cores=1")
        );
        // Memory-only shares consume no cores: this one fills gpu-0's memory (40Gi).
        assert_eq!(
            outcomes[4],
            ok("node-a", "gpu node-a/gpu-0 memory=19Gi cores=0")
        );
        // A whole A100 fits nowhere: gpu-0 is full, gpu-1 has a share.
        let refused = outcomes[5].clone().unwrap_err();
        assert_eq!(
            refused.to_string(),
            format!(
                "0/3 nodes are available: 3 cannot allocate all claims. \
                 node-a: claim default/a100-whole, request gpu: insufficient memory on gpu-0: requested 40Gi, available 0; \
                 insufficient memory on gpu-1: requested 40Gi, available 39Gi; \
                 node-b: claim default/a100-whole, request gpu: no device matches class {A100}; \
                 node-c: claim default/a100-whole, request gpu: no device matches class {A100}"
            )
        );
        assert_eq!(
            refused.for_claim("default/a100-whole").unwrap(),
            refused
                .to_string()
                .trim_start_matches("0/3 nodes are available: 3 cannot allocate all claims. ")
        );
        // Any whole GPU: node-a is full, node-b's gpu-0 has a share, so node-b's gpu-1.
        assert_eq!(
            outcomes[6],
            ok("node-b", "gpu node-b/gpu-1 memory=32Gi cores=0")
        );
        let shares: Vec<_> = done
            .iter()
            .map(|c| {
                let a = c.status.as_ref().unwrap().allocation.as_ref().unwrap();
                let r = &a.devices.as_ref().unwrap().results.as_ref().unwrap()[0];
                (
                    r.pool.clone(),
                    r.device.clone(),
                    r.share_id.clone().unwrap(),
                )
            })
            .collect();
        let unique: std::collections::BTreeSet<_> = shares.iter().collect();
        assert_eq!(unique.len(), shares.len());
    }

    #[test]
    fn all_claims_of_a_pod_land_on_one_node_or_none() {
        let classes = seed_classes();
        let slices = seed_slices();
        let a = claim("a", vec![exact("gpu", A100, &[("memory", "30Gi")])]);
        let b = claim("b", vec![exact("gpu", V100, &[])]);
        // An A100 and a V100 are never on the same node.
        let err = place(&[&a, &b], &[], &nodes(), &classes, &slices, &[]).unwrap_err();
        assert_eq!(
            err.failures
                .iter()
                .map(|f| (f.node.as_str(), f.claim.as_deref().unwrap()))
                .collect::<Vec<_>>(),
            vec![
                ("node-a", "default/b"),
                ("node-b", "default/a"),
                ("node-c", "default/a")
            ]
        );
        // Two A100 shares of one pod see each other.
        let c = claim("c", vec![exact("gpu", A100, &[("memory", "30Gi")])]);
        let p = place(&[&a, &c], &[], &nodes(), &classes, &slices, &[]).unwrap();
        assert_eq!(
            summary(&p.allocations[0]),
            vec!["gpu node-a/gpu-0 memory=30Gi cores=0"]
        );
        assert_eq!(
            summary(&p.allocations[1]),
            vec!["gpu node-a/gpu-1 memory=30Gi cores=0"]
        );
    }

    #[test]
    fn nodes_are_filtered_by_schedulability_selector_and_affinity() {
        use k8s_openapi::api::core::v1::{
            Affinity, NodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm,
            NodeSpec, PodSpec,
        };
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
        let node = |name: &str, zone: &str, unschedulable: bool| Node {
            metadata: ObjectMeta {
                name: Some(name.into()),
                labels: Some([("zone".to_string(), zone.to_string())].into()),
                ..Default::default()
            },
            spec: Some(NodeSpec {
                unschedulable: unschedulable.then_some(true),
                ..Default::default()
            }),
            status: None,
        };
        let all = vec![
            node("node-a", "z1", false),
            node("node-b", "z1", true),
            node("node-c", "z2", false),
            node("node-d", "z3", false),
        ];
        let names = |pod: &Pod| {
            candidate_nodes(pod, &all)
                .into_iter()
                .map(|n| n.name)
                .collect::<Vec<_>>()
        };
        let mut pod = Pod {
            spec: Some(PodSpec::default()),
            ..Default::default()
        };
        assert_eq!(names(&pod), vec!["node-a", "node-c", "node-d"]);
        pod.spec.as_mut().unwrap().affinity = Some(Affinity {
            node_affinity: Some(NodeAffinity {
                required_during_scheduling_ignored_during_execution: Some(NodeSelector {
                    node_selector_terms: vec![NodeSelectorTerm {
                        match_expressions: Some(vec![NodeSelectorRequirement {
                            key: "zone".into(),
                            operator: "NotIn".into(),
                            values: Some(vec!["z3".into()]),
                        }]),
                        match_fields: None,
                    }],
                }),
                ..Default::default()
            }),
            ..Default::default()
        });
        assert_eq!(names(&pod), vec!["node-a", "node-c"]);
        pod.spec.as_mut().unwrap().node_selector =
            Some([("zone".to_string(), "z2".to_string())].into());
        assert_eq!(names(&pod), vec!["node-c"]);
        let excluded = excluded_nodes(&pod, &all);
        assert_eq!(
            excluded,
            BTreeMap::from([(NODE_UNSCHEDULABLE, 1), (NODE_AFFINITY_MISMATCH, 2)])
        );
        // Every node is counted in the event, the ones left out early under their own reason.
        let no_fit = NoFit {
            failures: vec![NodeFailure {
                node: "node-c".into(),
                claim: Some("default/c".into()),
                reason: CANNOT_ALLOCATE,
                message: "claim default/c, request gpu: no device matches class x".into(),
            }],
            excluded,
        };
        assert_eq!(
            no_fit.to_string(),
            "0/4 nodes are available: 1 cannot allocate all claims, 1 node(s) were unschedulable, \
             2 node(s) didn't match Pod's node affinity/selector. \
             node-c: claim default/c, request gpu: no device matches class x"
        );
    }

    #[test]
    fn an_allocated_claim_keeps_the_pod_on_its_node() {
        let classes = seed_classes();
        let slices = seed_slices();
        let v = claim("v", vec![exact("gpu", V100, &[("memory", "1Gi")])]);
        let first = place(&[&v], &[], &nodes(), &classes, &slices, &[]).unwrap();
        let bound = allocated(v, first.allocations[0].clone());
        let extra = claim(
            "extra",
            vec![exact("gpu", "gpupool.dev", &[("memory", "1Gi")])],
        );
        let p = place(
            &[&extra],
            &[&bound],
            &nodes(),
            &classes,
            &slices,
            std::slice::from_ref(&bound),
        )
        .unwrap();
        assert_eq!(p.node, "node-b");
    }
}

//! One test per allocation rule, on objects shaped like gpupool's (see `crate::fixtures`).

use std::collections::BTreeSet;

use k8s_openapi::api::resource::v1::{
    AllocationResult, Device, DeviceConstraint, DeviceRequest, ResourceClaim, ResourceSlice,
};
use serde_json::json;

use super::{allocate, TargetNode};
use crate::fixtures::*;

fn on(
    node: &str,
    claim: &ResourceClaim,
    slices: &[ResourceSlice],
    allocated: &[ResourceClaim],
) -> Result<AllocationResult, String> {
    allocate(
        claim,
        &TargetNode::named(node),
        &seed_classes(),
        slices,
        allocated,
    )
    .map_err(|e| e.message)
}

/// Allocates claims one after the other on `node`, each seeing the ones before.
fn sequence(
    node: &str,
    slices: &[ResourceSlice],
    claims: Vec<ResourceClaim>,
) -> Vec<Result<Vec<String>, String>> {
    let mut done: Vec<ResourceClaim> = Vec::new();
    claims
        .into_iter()
        .map(|c| {
            let result = on(node, &c, slices, &done)?;
            let lines = summary(&result);
            done.push(allocated(c, result));
            Ok(lines)
        })
        .collect()
}

/// What [`sequence`] gives for a claim that got the devices of `lines`.
fn ok(lines: &[&str]) -> Result<Vec<String>, String> {
    Ok(lines.iter().map(|l| l.to_string()).collect())
}

/// An A100-SXM4-40GB as gpupool publishes it.
fn a100(index: u32) -> Device {
    gpu(index, "A100-SXM4-40GB", "40Gi")
}

/// A claim for one whole device of `class`.
fn whole(name: &str, class: &str) -> ResourceClaim {
    claim(name, vec![exact("gpu", class, &[])])
}

fn one_a100() -> Vec<ResourceSlice> {
    vec![node_slice("node-a", vec![a100(0)])]
}

/// node-a's pool while it is being updated: generation 2 announces two slices, one has arrived.
fn updating_pool() -> Vec<ResourceSlice> {
    vec![slice_of(
        "gpupool.dev",
        "node-a",
        "node-a",
        2,
        2,
        vec![a100(0)],
    )]
}

#[test]
fn an_exclusive_device_goes_to_one_claim_only() {
    let slices = vec![node_slice(
        "node-a",
        vec![exclusive(a100(0)), exclusive(a100(1))],
    )];
    let claims = (1..=3).map(|i| whole(&format!("c{i}"), A100)).collect();
    assert_eq!(
        sequence("node-a", &slices, claims),
        [
            ok(&["gpu node-a/gpu-0"]),
            ok(&["gpu node-a/gpu-1"]),
            Err("claim default/c3, request gpu: gpu-0 is already allocated; gpu-1 is already allocated".to_string())
        ]
    );
}

#[test]
fn exclusive_results_carry_no_share_or_capacity() {
    let slices = vec![node_slice("node-a", vec![exclusive(a100(0))])];
    let result = on("node-a", &whole("c", A100), &slices, &[]).unwrap();
    let r = &results(&result)[0];
    assert_eq!(
        (r.share_id.as_ref(), r.consumed_capacity.as_ref()),
        (None, None)
    );
}

#[test]
fn capacity_requests_round_up_to_the_step() {
    let c = claim(
        "c",
        vec![exact(
            "gpu",
            A100,
            &[("memory", "1500M"), ("cores", "500m")],
        )],
    );
    let result = on("node-a", &c, &one_a100(), &[]).unwrap();
    assert_eq!(
        summary(&result),
        vec!["gpu node-a/gpu-0 memory=1431Mi cores=1"]
    );
}

#[test]
fn a_request_below_the_minimum_consumes_the_minimum() {
    let c = claim("c", vec![exact("gpu", A100, &[("memory", "100Ki")])]);
    let result = on("node-a", &c, &one_a100(), &[]).unwrap();
    assert_eq!(
        summary(&result),
        vec!["gpu node-a/gpu-0 memory=1Mi cores=0"]
    );
}

#[test]
fn valid_values_take_the_smallest_value_at_or_above_the_request() {
    let mut device = a100(0);
    device.capacity.as_mut().unwrap().insert(
        "memory".into(),
        with_valid_values("40Gi", "40Gi", &["10Gi", "20Gi", "40Gi"]),
    );
    let slices = vec![node_slice("node-a", vec![device])];
    let results = sequence(
        "node-a",
        &slices,
        vec![
            claim("c1", vec![exact("gpu", A100, &[("memory", "11Gi")])]),
            claim("c2", vec![exact("gpu", A100, &[("memory", "10Gi")])]),
            claim("c3", vec![exact("gpu", A100, &[("memory", "11Gi")])]),
            claim("c4", vec![exact("gpu", A100, &[("memory", "10Gi")])]),
        ],
    );
    assert_eq!(
        results,
        [
            ok(&["gpu node-a/gpu-0 memory=20Gi cores=0"]),
            ok(&["gpu node-a/gpu-0 memory=10Gi cores=0"]),
            Err("claim default/c3, request gpu: insufficient memory on gpu-0: requested 20Gi, available 10Gi".to_string()),
            ok(&["gpu node-a/gpu-0 memory=10Gi cores=0"])
        ]
    );
}

#[test]
fn a_request_above_the_maximum_is_refused() {
    let c = claim("c", vec![exact("gpu", A100, &[("cores", "150")])]);
    assert_eq!(
        on("node-a", &c, &one_a100(), &[]),
        Err("claim default/c, request gpu: cores 150 on gpu-0 is outside its request policy (maximum 100)".to_string())
    );
}

#[test]
fn shares_of_a_device_add_up_across_claims() {
    let results = sequence(
        "node-a",
        &one_a100(),
        vec![
            claim(
                "c1",
                vec![exact("gpu", A100, &[("memory", "16Gi"), ("cores", "60")])],
            ),
            claim(
                "c2",
                vec![exact("gpu", A100, &[("memory", "16Gi"), ("cores", "40")])],
            ),
            claim(
                "c3",
                vec![exact("gpu", A100, &[("memory", "8Gi"), ("cores", "1")])],
            ),
            claim("c4", vec![exact("gpu", A100, &[("memory", "16Gi")])]),
            claim("c5", vec![exact("gpu", A100, &[("memory", "8Gi")])]),
        ],
    );
    assert!(results[0].is_ok() && results[1].is_ok());
    assert_eq!(
        results[2..],
        [
            Err("claim default/c3, request gpu: insufficient cores on gpu-0: requested 1, available 0".to_string()),
            Err("claim default/c4, request gpu: insufficient memory on gpu-0: requested 16Gi, available 8Gi".to_string()),
            ok(&["gpu node-a/gpu-0 memory=8Gi cores=0"])
        ]
    );
}

#[test]
fn a_claim_without_capacity_requests_takes_the_whole_card() {
    let slices = vec![node_slice("node-a", vec![a100(0), a100(1)])];
    let results = sequence(
        "node-a",
        &slices,
        vec![
            claim("share", vec![exact("gpu", A100, &[("memory", "1Gi")])]),
            whole("whole", A100),
            claim("tiny", vec![exact("gpu", A100, &[("memory", "1Mi")])]),
        ],
    );
    assert_eq!(
        results,
        [
            ok(&["gpu node-a/gpu-0 memory=1Gi cores=0"]),
            // Not on gpu-0, which already has a share.
            ok(&["gpu node-a/gpu-1 memory=40Gi cores=0"]),
            ok(&["gpu node-a/gpu-0 memory=1Mi cores=0"])
        ]
    );
}

#[test]
fn first_available_takes_the_first_subrequest_that_fits_and_names_it() {
    let prefer_a100 = || {
        claim(
            "prefer",
            vec![first_available(
                "gpu",
                vec![
                    subrequest("a100", A100, &[("cores", "50")]),
                    subrequest("v100", V100, &[("cores", "70")]),
                ],
            )],
        )
    };
    let slices = seed_slices();
    let on_a = on("node-a", &prefer_a100(), &slices, &[]).unwrap();
    assert_eq!(
        summary(&on_a),
        vec!["gpu/a100 node-a/gpu-0 memory=40Gi cores=50"]
    );
    let on_b = on("node-b", &prefer_a100(), &slices, &[]).unwrap();
    assert_eq!(
        summary(&on_b),
        vec!["gpu/v100 node-b/gpu-0 memory=32Gi cores=70"]
    );
    assert_eq!(
        on("node-c", &prefer_a100(), &slices, &[]),
        Err(format!(
            "claim default/prefer, request gpu: subrequest a100: no device matches class {A100}; \
             subrequest v100: no device matches class {V100}"
        ))
    );
}

#[test]
fn request_selectors_see_attributes_versions_and_quantities() {
    let with = |expression: &str| {
        let mut c = claim("c", vec![exact("gpu", "gpupool.dev", &[("memory", "1Gi")])]);
        first_exact_mut(&mut c).selectors = Some(vec![selector(expression)]);
        on("node-a", &c, &seed_slices(), &[]).map(|r| summary(&r))
    };
    let index_1 = r#"device.attributes["gpupool.dev"].index == 1"#;
    assert_eq!(with(index_1), ok(&["gpu node-a/gpu-1 memory=1Gi cores=0"]));
    let new_driver =
        r#"device.attributes["gpupool.dev"].driverVersion.isGreaterThan(semver("535.0.0"))"#;
    assert!(with(new_driver).is_ok());
    let old_driver =
        r#"device.attributes["gpupool.dev"].driverVersion.isLessThan(semver("535.0.0"))"#;
    assert_eq!(
        with(old_driver),
        Err("claim default/c, request gpu: no device of class gpupool.dev matches the request's selectors".to_string())
    );
    let big_memory = r#"device.capacity["gpupool.dev"].memory.compareTo(quantity("48Gi")) >= 0"#;
    assert!(with(big_memory).is_err());
    let enough_memory = r#"device.capacity["gpupool.dev"].memory.isGreaterThan(quantity("32Gi"))"#;
    assert!(with(enough_memory).is_ok());
}

#[test]
fn a_selector_reading_a_missing_domain_fails_the_allocation() {
    // Another driver's device on the node: a selector without the driver guard breaks on it.
    let mut nic = exclusive(gpu(0, "nic", "1Gi"));
    nic.name = "nic-0".into();
    nic.attributes = None;
    let slices = vec![
        slice_of("aaa.example.com", "node-a", "node-a", 1, 1, vec![nic]),
        node_slice("node-a", vec![a100(0)]),
    ];
    let unguarded = class(
        "unguarded",
        &[r#"device.attributes["gpupool.dev"].model == "A100-SXM4-40GB""#],
    );
    let c = whole("c", "unguarded");
    let result = allocate(&c, &"node-a".into(), &[unguarded], &slices, &[]);
    assert_eq!(
        result.unwrap_err().message,
        "class unguarded: selector #0: CEL runtime error: no such key: gpupool.dev"
    );
    // The guarded classes of the controller skip the other driver's device.
    assert!(on("node-a", &whole("c", A100), &slices, &[]).is_ok());
}

#[test]
fn config_comes_from_the_class_then_the_claim_and_follows_the_chosen_subrequest() {
    let mut classes = seed_classes();
    classes[2] = with_class_config(
        classes[2].clone(),
        json!({"kind": "GpuConfig", "from": "v100-class"}),
    );
    let mut c = claim(
        "c",
        vec![first_available(
            "gpu",
            vec![subrequest("a100", A100, &[]), subrequest("v100", V100, &[])],
        )],
    );
    c = with_claim_config(c, &["gpu/a100"], json!({"for": "a100"}));
    c = with_claim_config(c, &["gpu/v100"], json!({"for": "v100"}));
    c = with_claim_config(c, &["gpu"], json!({"for": "gpu"}));
    c = with_claim_config(c, &[], json!({"for": "all"}));
    let result = allocate(&c, &"node-b".into(), &classes, &seed_slices(), &[]).unwrap();
    let config: Vec<(String, Vec<String>, serde_json::Value)> = result
        .devices
        .unwrap()
        .config
        .unwrap()
        .into_iter()
        .map(|e| {
            (
                e.source,
                e.requests.unwrap_or_default(),
                e.opaque.unwrap().parameters.0,
            )
        })
        .collect();
    assert_eq!(
        config,
        vec![
            (
                "FromClass".into(),
                vec!["gpu/v100".to_string()],
                json!({"kind": "GpuConfig", "from": "v100-class"})
            ),
            (
                "FromClaim".into(),
                vec!["gpu/v100".to_string()],
                json!({"for": "v100"})
            ),
            (
                "FromClaim".into(),
                vec!["gpu".to_string()],
                json!({"for": "gpu"})
            ),
            ("FromClaim".into(), vec![], json!({"for": "all"})),
        ]
    );
}

#[test]
fn a_claim_gets_all_its_requests_or_nothing() {
    let slices = one_a100();
    let two = |first: &str, second: &str| {
        claim(
            "two",
            vec![
                exact("first", A100, &[("memory", first)]),
                exact("second", A100, &[("memory", second)]),
            ],
        )
    };
    assert_eq!(
        on("node-a", &two("30Gi", "20Gi"), &slices, &[]),
        Err("claim default/two: each request fits on its own but not all together (constraints or shared capacity)".to_string())
    );
    assert_eq!(
        summary(&on("node-a", &two("20Gi", "20Gi"), &slices, &[]).unwrap()),
        vec![
            "first node-a/gpu-0 memory=20Gi cores=0",
            "second node-a/gpu-0 memory=20Gi cores=0"
        ]
    );
}

#[test]
fn the_search_backtracks_over_subrequests_to_satisfy_later_requests() {
    // The first request prefers an A100; the second can only use the only A100, so the first
    // must fall back to its V100 alternative. Devices across two drivers' pools on one node.
    let slices = vec![node_slice(
        "node-x",
        vec![
            exclusive(a100(0)),
            exclusive(gpu(1, "V100-SXM2-32GB", "32Gi")),
        ],
    )];
    let c = claim(
        "c",
        vec![
            first_available(
                "flex",
                vec![subrequest("a100", A100, &[]), subrequest("v100", V100, &[])],
            ),
            exact("strict", A100, &[]),
        ],
    );
    let result = on("node-x", &c, &slices, &[]).unwrap();
    assert_eq!(
        summary(&result),
        vec!["flex/v100 node-x/gpu-1", "strict node-x/gpu-0"]
    );
}

#[test]
fn share_ids_are_fresh_for_every_share_of_a_device() {
    let claims = (0..40)
        .map(|i| {
            claim(
                &format!("c{i}"),
                vec![exact("gpu", A100, &[("memory", "1Gi")])],
            )
        })
        .collect::<Vec<_>>();
    let mut done: Vec<ResourceClaim> = Vec::new();
    for c in claims {
        let result = on("node-a", &c, &one_a100(), &done).unwrap();
        done.push(allocated(c, result));
    }
    let ids: Vec<String> = done
        .iter()
        .map(|c| {
            let allocation = c.status.as_ref().unwrap().allocation.as_ref().unwrap();
            results(allocation)[0].share_id.clone().unwrap()
        })
        .collect();
    assert_eq!(ids.iter().collect::<BTreeSet<_>>().len(), 40);
    for id in &ids {
        // The API validates shareID as a lowercase UUID.
        let parsed = uuid::Uuid::parse_str(id).unwrap_or_else(|e| panic!("{id}: {e}"));
        assert_eq!(parsed.to_string(), *id);
    }
}

#[test]
fn the_allocation_is_pinned_to_the_node_of_its_devices() {
    let result = on("node-a", &whole("c", A100), &seed_slices(), &[]).unwrap();
    let selector = result.node_selector.unwrap();
    let term = &selector.node_selector_terms[0];
    let field = &term.match_fields.as_ref().unwrap()[0];
    assert_eq!(
        (
            field.key.as_str(),
            field.operator.as_str(),
            field.values.clone().unwrap()
        ),
        ("metadata.name", "In", vec!["node-a".to_string()])
    );
}

#[test]
fn match_attribute_keeps_devices_under_one_pcie_root() {
    // gpu-0/gpu-1 share root 00, gpu-2/gpu-3 share root 01; gpu-1 is taken, so the pair must
    // come from root 01.
    let slices = vec![node_slice(
        "node-a",
        (0..4).map(|i| exclusive(a100(i))).collect(),
    )];
    let taken = allocated(
        whole("taken", A100),
        AllocationResult {
            devices: Some(k8s_openapi::api::resource::v1::DeviceAllocationResult {
                results: Some(vec![
                    k8s_openapi::api::resource::v1::DeviceRequestAllocationResult {
                        request: "gpu".into(),
                        driver: "gpupool.dev".into(),
                        pool: "node-a".into(),
                        device: "gpu-1".into(),
                        ..Default::default()
                    },
                ]),
                config: None,
            }),
            ..Default::default()
        },
    );
    let mut c = claim("pair", vec![exact("a", A100, &[]), exact("b", A100, &[])]);
    devices_mut(&mut c).constraints = Some(vec![DeviceConstraint {
        match_attribute: Some("resource.kubernetes.io/pcieRoot".into()),
        ..Default::default()
    }]);
    let result = on("node-a", &c, &slices, &[taken]).unwrap();
    assert_eq!(summary(&result), vec!["a node-a/gpu-2", "b node-a/gpu-3"]);
}

#[test]
fn all_mode_takes_every_matching_device_and_waits_for_complete_pools() {
    let mut c = whole("all", A100);
    first_exact_mut(&mut c).allocation_mode = Some("All".into());
    let result = on("node-a", &c, &seed_slices(), &[]).unwrap();
    assert_eq!(
        summary(&result),
        vec![
            "gpu node-a/gpu-0 memory=40Gi cores=0",
            "gpu node-a/gpu-1 memory=40Gi cores=0"
        ]
    );
    let incomplete = updating_pool();
    assert_eq!(
        on("node-a", &c, &incomplete, &[]),
        Err("claim default/all, request gpu: asks for all devices, but resource pool gpupool.dev/node-a is currently being updated".to_string())
    );
}

#[test]
fn an_unknown_class_is_named() {
    let c = whole("c", "h100.gpupool.dev");
    assert_eq!(
        on("node-a", &c, &seed_slices(), &[]),
        Err(
            "claim default/c, request gpu: could not retrieve device class h100.gpupool.dev: \
             deviceclass.resource.k8s.io \"h100.gpupool.dev\" not found"
                .to_string()
        )
    );
}

fn two_slots(name: &str, requests: &[(&str, &str)]) -> ResourceClaim {
    let mut c = claim(name, vec![exact("gpu", A100, requests)]);
    first_exact_mut(&mut c).count = Some(2);
    c
}

#[test]
fn one_request_may_take_two_shares_of_one_device_unless_distinct_is_asked() {
    let slices = seed_slices();
    let packed = on(
        "node-a",
        &two_slots("c", &[("memory", "10Gi")]),
        &slices,
        &[],
    )
    .unwrap();
    assert_eq!(
        summary(&packed),
        vec![
            "gpu node-a/gpu-0 memory=10Gi cores=0",
            "gpu node-a/gpu-0 memory=10Gi cores=0"
        ]
    );
    let shares: BTreeSet<_> = results(&packed)
        .iter()
        .map(|r| r.share_id.clone().unwrap())
        .collect();
    assert_eq!(shares.len(), 2);

    let mut spread = two_slots("c", &[("memory", "10Gi")]);
    devices_mut(&mut spread).constraints = Some(vec![DeviceConstraint {
        distinct_attribute: Some("gpupool.dev/index".into()),
        ..Default::default()
    }]);
    assert_eq!(
        summary(&on("node-a", &spread, &slices, &[]).unwrap()),
        vec![
            "gpu node-a/gpu-0 memory=10Gi cores=0",
            "gpu node-a/gpu-1 memory=10Gi cores=0"
        ]
    );
    // Whole cards cannot share: two slots need two cards.
    assert_eq!(
        summary(&on("node-a", &two_slots("c", &[]), &slices, &[]).unwrap()),
        vec![
            "gpu node-a/gpu-0 memory=40Gi cores=0",
            "gpu node-a/gpu-1 memory=40Gi cores=0"
        ]
    );
}

#[test]
fn devices_of_an_incomplete_pool_are_not_allocated() {
    // Generation 2 announces two slices; only one has arrived.
    let slices = updating_pool();
    assert_eq!(
        on("node-a", &whole("c", A100), &slices, &[]),
        Err("claim default/c, request gpu: resource pool gpupool.dev/node-a is currently being updated".to_string())
    );
}

#[test]
fn a_busy_device_of_another_class_is_reported_as_not_matching() {
    let slices = vec![node_slice("node-a", vec![exclusive(a100(0))])];
    let first = on("node-a", &whole("a", A100), &slices, &[]).unwrap();
    let taken = allocated(whole("a", A100), first);
    assert_eq!(
        on("node-a", &whole("v", V100), &slices, &[taken]),
        Err(format!(
            "claim default/v, request gpu: no device matches class {V100}"
        ))
    );
}

#[test]
fn a_hopeless_combinatorial_search_stops_and_names_the_request_that_cannot_fit() {
    // 15 of 30 whole cards for one request, then a request nothing can satisfy: the
    // search would try every combination of the first.
    let slices = vec![node_slice(
        "node-a",
        (0..30).map(|i| exclusive(a100(i))).collect(),
    )];
    let mut c = claim(
        "greedy",
        vec![exact("many", A100, &[]), exact("none", V100, &[])],
    );
    first_exact_mut(&mut c).count = Some(15);
    let started = std::time::Instant::now();
    let err = on("node-a", &c, &slices, &[]).unwrap_err();
    assert_eq!(
        err,
        format!("claim default/greedy, request none: no device matches class {V100}")
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(20));
}

fn tainted(mut device: Device, key: &str, value: &str) -> Device {
    device.taints = Some(vec![k8s_openapi::api::resource::v1::DeviceTaint {
        key: key.into(),
        value: Some(value.into()),
        effect: "NoSchedule".into(),
        time_added: None,
    }]);
    device
}

fn tolerating(mut request: DeviceRequest, toleration: serde_json::Value) -> DeviceRequest {
    request.exactly.as_mut().unwrap().tolerations =
        Some(vec![serde_json::from_value(toleration).unwrap()]);
    request
}

#[test]
fn a_no_schedule_taint_keeps_claims_off_the_device_unless_tolerated() {
    let slices = vec![node_slice(
        "node-a",
        vec![
            exclusive(tainted(a100(0), "gpupool.dev/xid", "79")),
            exclusive(a100(1)),
        ],
    )];
    let claims = (1..=2).map(|i| whole(&format!("c{i}"), A100)).collect();
    let results = sequence("node-a", &slices, claims);
    assert_eq!(results[0], ok(&["gpu node-a/gpu-1"]));
    let err = results[1].clone().unwrap_err();
    assert!(
        err.contains("gpu-0 has the taint gpupool.dev/xid=79:NoSchedule"),
        "{err}"
    );

    // A toleration of that key (any value), or of that exact taint, lets a claim in.
    for toleration in [
        json!({"key": "gpupool.dev/xid", "operator": "Exists"}),
        json!({"key": "gpupool.dev/xid", "operator": "Equal", "value": "79", "effect": "NoSchedule"}),
    ] {
        let c = claim(
            "tolerant",
            vec![tolerating(exact("gpu", A100, &[]), toleration.clone())],
        );
        let busy = allocated(
            whole("other", A100),
            on("node-a", &whole("other", A100), &slices, &[]).unwrap(),
        );
        assert_eq!(
            on("node-a", &c, &slices, &[busy]).map(|r| summary(&r)),
            ok(&["gpu node-a/gpu-0"]),
            "{toleration}"
        );
    }
    // Another value of the key is not tolerated.
    let c = claim(
        "wrong-value",
        vec![tolerating(
            exact("gpu", A100, &[]),
            json!({"key": "gpupool.dev/xid", "operator": "Equal", "value": "48"}),
        )],
    );
    let only_tainted = vec![node_slice(
        "node-a",
        vec![exclusive(tainted(a100(0), "gpupool.dev/xid", "79"))],
    )];
    assert!(on("node-a", &c, &only_tainted, &[]).is_err());
}

/// Allocates claims one after the other on node-h, a pool of two MIG cards ([`mig_card`]) seen
/// through [`mig_classes`]; `keep` lists which earlier claims stay allocated for each next one.
fn on_mig_node(
    claim: &ResourceClaim,
    allocated: &[ResourceClaim],
    slices: &[ResourceSlice],
) -> Result<AllocationResult, String> {
    allocate(
        claim,
        &TargetNode::named("node-h"),
        &mig_classes(),
        slices,
        allocated,
    )
    .map_err(|e| e.message)
}

/// A claim of one 1g MIG device, on card `index` when given.
fn small(name: &str, on_card: Option<u32>) -> ResourceClaim {
    let mut c = claim(name, vec![exact("gpu", H100_MIG_1G, &[])]);
    if let Some(index) = on_card {
        first_exact_mut(&mut c).selectors = Some(vec![selector(&format!(
            r#"device.attributes["gpupool.dev"].index == {index}"#
        ))]);
    }
    c
}

/// A fraction (8Gi, 25%) of a card, card `index` when given.
fn fraction_on(name: &str, on_card: Option<u32>) -> ResourceClaim {
    let mut c = claim(
        name,
        vec![exact("gpu", H100, &[("memory", "8Gi"), ("cores", "25")])],
    );
    if let Some(index) = on_card {
        first_exact_mut(&mut c).selectors = Some(vec![selector(&format!(
            r#"device.attributes["gpupool.dev"].index == {index}"#
        ))]);
    }
    c
}

fn device_of(allocation: &AllocationResult) -> String {
    results(allocation)[0].device.clone()
}

#[test]
fn a_fraction_of_a_card_blocks_every_mig_device_of_that_card_and_none_of_the_other() {
    let slices = mig_node_slices("node-h", 2);
    let half = fraction_on("half", Some(0));
    let half = allocated(half.clone(), on_mig_node(&half, &[], &slices).unwrap());
    assert_eq!(
        device_of(half.status.as_ref().unwrap().allocation.as_ref().unwrap()),
        "gpu-0"
    );

    let err = on_mig_node(&small("s", Some(0)), std::slice::from_ref(&half), &slices).unwrap_err();
    for k in 0..7 {
        assert!(
            err.contains(&format!(
                "insufficient counters for gpu-0-mig-1g-10gb-{k}: gpu-0-counters/"
            )),
            "{err}"
        );
    }
    let got = on_mig_node(&small("s", None), &[half], &slices).unwrap();
    assert_eq!(
        device_of(&got),
        "gpu-1-mig-1g-10gb-0",
        "the other card's first placement"
    );
}

#[test]
fn a_mig_device_blocks_its_card_whole_and_in_fractions() {
    let slices = mig_node_slices("node-h", 2);
    let s = small("s", Some(0));
    let s = allocated(s.clone(), on_mig_node(&s, &[], &slices).unwrap());
    let err = on_mig_node(
        &fraction_on("half", Some(0)),
        std::slice::from_ref(&s),
        &slices,
    )
    .unwrap_err();
    assert!(
        err.contains(
            "insufficient counters for gpu-0: gpu-0-counters/memory-slice-0 needs 1, 0 of 1 left"
        ),
        "{err}"
    );
    let whole = claim("whole", vec![exact("gpu", H100, &[])]);
    let got = on_mig_node(&whole, std::slice::from_ref(&s), &slices).unwrap();
    assert_eq!(device_of(&got), "gpu-1");
    // The card's other placements stay free for MIG.
    let second = on_mig_node(&small("t", Some(0)), &[s], &slices).unwrap();
    assert_eq!(device_of(&second), "gpu-0-mig-1g-10gb-1");
}

#[test]
fn a_shared_card_is_charged_with_its_first_share_and_released_with_its_last() {
    let slices = mig_node_slices("node-h", 1);
    let a = fraction_on("a", Some(0));
    let a = allocated(a.clone(), on_mig_node(&a, &[], &slices).unwrap());
    // The second share skips the counter check: all of them are taken, yet it fits.
    let b = fraction_on("b", Some(0));
    let b = allocated(
        b.clone(),
        on_mig_node(&b, std::slice::from_ref(&a), &slices).unwrap(),
    );
    assert_eq!(
        device_of(b.status.as_ref().unwrap().allocation.as_ref().unwrap()),
        "gpu-0"
    );
    // Two shares in one claim are charged once too.
    let two = claim(
        "two",
        vec![
            exact("x", H100, &[("memory", "1Gi")]),
            exact("y", H100, &[("memory", "1Gi")]),
        ],
    );
    assert!(on_mig_node(&two, &[], &slices).is_ok());

    assert!(on_mig_node(&small("s", None), &[a.clone(), b.clone()], &slices).is_err());
    assert!(
        on_mig_node(&small("s", None), &[b], &slices).is_err(),
        "one share left holds the counters"
    );
    let got = on_mig_node(&small("s", None), &[], &slices).unwrap();
    assert_eq!(device_of(&got), "gpu-0-mig-1g-10gb-0");
}

#[test]
fn mig_devices_fill_the_card_one_memory_slice_each() {
    let slices = mig_node_slices("node-h", 1);
    let mut done: Vec<ResourceClaim> = Vec::new();
    for k in 0..7 {
        let c = small(&format!("s{k}"), None);
        let got = on_mig_node(&c, &done, &slices).unwrap();
        assert_eq!(device_of(&got), format!("gpu-0-mig-1g-10gb-{k}"));
        done.push(allocated(c, got));
    }
    let err = on_mig_node(&small("s7", None), &done, &slices).unwrap_err();
    assert!(err.contains("is already allocated"), "{err}");
}

#[test]
fn a_device_consuming_a_missing_counter_set_makes_the_whole_pool_invalid() {
    let mut slices = mig_node_slices("node-h", 1);
    let devices = slices[1].spec.devices.as_mut().unwrap();
    devices[3].consumes_counters.as_mut().unwrap()[0].counter_set = "gpu-9-counters".into();
    let err = on_mig_node(&fraction_on("half", None), &[], &slices).unwrap_err();
    assert!(
        err.contains(
            "resource pool gpupool.dev/node-h is currently invalid: device gpu-0-mig-1g-10gb-2: counter set gpu-9-counters not found"
        ),
        "{err}"
    );
}

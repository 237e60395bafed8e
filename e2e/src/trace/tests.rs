use super::*;

const NODES: &str = "sn,cpu_milli,memory_mib,gpu,model\n\
openb-node-0000,64000,262144,2,P100\n\
openb-node-0001,96000,393216,8,G2\n\
openb-node-0002,104000,524288,2,T4\n";

const TASKS: &str = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n\
openb-pod-0000,12000,16384,1,1000,,LS,Running,0,1,0\n\
openb-pod-0001,6000,12288,1,460,,LS,Running,0,1,0\n\
openb-pod-0002,4000,8192,0,0,,BE,Running,0,1,0\n\
openb-pod-0003,32000,65536,8,1000,G2,LS,Running,0,1,0\n\
openb-pod-0004,2000,4096,1,250,V100M16|T4|V100M16,LS,Running,0,1,0\n";

fn tasks() -> Vec<Task> {
    parse_tasks("pods.csv", TASKS).unwrap()
}

#[test]
fn the_node_list_parses_with_its_models_and_counts() {
    let nodes = parse_nodes("nodes.csv", NODES).unwrap();
    assert_eq!(nodes.len(), 3);
    assert_eq!(
        nodes[1],
        TraceNode {
            name: "openb-node-0001".into(),
            cpu_milli: 96000,
            memory_mib: 393216,
            gpus: 8,
            model: "G2".into()
        }
    );
    assert_eq!(capacity_milli(&nodes), 12_000);
    assert_eq!(models(&nodes), ["G2", "P100", "T4"]);
}

#[test]
fn bad_rows_name_the_file_line_and_column() {
    let err = parse_nodes(
        "nodes.csv",
        "sn,cpu_milli,memory_mib,gpu,model\nn,1,2,x,T4\n",
    );
    assert_eq!(
        err.unwrap_err().to_string(),
        "nodes.csv: line 2: gpu is \"x\", not a whole number"
    );
    let err = parse_nodes("nodes.csv", "sn,cpu_milli,gpu,model\n");
    assert_eq!(
        err.unwrap_err(),
        TraceError::MissingColumn {
            file: "nodes.csv".into(),
            column: "memory_mib".into()
        }
    );
    let err = parse_tasks(
        "pods.csv",
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\np,1,1,1,1500,\n",
    );
    assert!(err
        .unwrap_err()
        .to_string()
        .contains("line 2: gpu_milli is 1500 with num_gpu 1"));
}

#[test]
fn tasks_parse_with_their_gpu_request_and_spec() {
    let t = tasks();
    assert_eq!(
        t.iter().map(Task::gpu_request_milli).collect::<Vec<_>>(),
        [1000, 460, 0, 8000, 250]
    );
    assert_eq!(
        t.iter().map(Task::is_sharing).collect::<Vec<_>>(),
        [false, true, false, false, true]
    );
    // `|`-separated, each model once.
    assert_eq!(t[4].gpu_spec, ["T4", "V100M16"]);
}

#[test]
fn a_list_without_gpu_spec_reads_as_any_model() {
    let t = parse_tasks(
        "multigpu.csv",
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,qos\np,1000,1024,2,1000,LS\n",
    )
    .unwrap();
    assert_eq!((t[0].num_gpu, t[0].gpu_spec.len()), (2, 0));
}

#[test]
fn sampling_inflates_to_130_percent_and_repeats_by_seed() {
    let t = tasks();
    let capacity = 100_000;
    let a = sample_tasks(&t, capacity, 42).unwrap();
    let arrived: u64 = a.iter().map(Task::gpu_request_milli).sum();
    assert!(arrived >= 130_000, "{arrived}");
    // The last draw crossed the line: without the largest task it would be under.
    assert!(arrived - 8000 < 130_000, "{arrived}");
    assert_eq!(
        a.iter().map(|t| &t.name).collect::<Vec<_>>(),
        sample_tasks(&t, capacity, 42)
            .unwrap()
            .iter()
            .map(|t| &t.name)
            .collect::<Vec<_>>()
    );
    let b = sample_tasks(&t, capacity, 43).unwrap();
    assert_ne!(
        a.iter().map(|t| &t.name).collect::<Vec<_>>(),
        b.iter().map(|t| &t.name).collect::<Vec<_>>()
    );
    // With replacement: more arrivals than the list has tasks, each named uniquely.
    let names: std::collections::BTreeSet<_> = a.iter().map(|t| &t.name).collect();
    assert_eq!(names.len(), a.len());
    assert!(a.len() > t.len());
    assert_eq!(
        sample_tasks(&t[2..3], capacity, 1).unwrap_err(),
        TraceError::NoGpuTasks
    );
}

#[test]
fn a_subset_keeps_every_nth_node() {
    let nodes = parse_nodes("nodes.csv", NODES).unwrap();
    let names = |n: Vec<TraceNode>| n.into_iter().map(|n| n.name).collect::<Vec<_>>();
    assert_eq!(names(node_subset(&nodes, 1.0)).len(), 3);
    assert_eq!(
        names(node_subset(&nodes, 0.5)),
        ["openb-node-0000", "openb-node-0002"]
    );
}

#[test]
fn a_share_asks_for_its_cores_and_its_share_of_the_smallest_eligible_card() {
    let t = tasks();
    let all = ["G2", "P100", "T4"];
    // 460 milli of the T4's 15360 MiB.
    assert_eq!(share_memory_mib(&t[1], &all).unwrap(), 7065);
    assert_eq!(share_memory_mib(&t[1], &["G2"]).unwrap(), 15073);
    assert_eq!(share_memory_mib(&t[4], &["G2"]).unwrap(), 3840);
    let objects = task_objects(&t[1], Mode::Shares, &all).unwrap();
    let claim = serde_json::to_value(objects.claim.unwrap()).unwrap();
    let exactly = &claim["spec"]["devices"]["requests"][0]["exactly"];
    assert_eq!(exactly["deviceClassName"], CLASS);
    assert_eq!(exactly["count"], 1);
    assert_eq!(
        exactly["capacity"]["requests"],
        serde_json::json!({"cores": "46", "memory": "7065Mi"})
    );
    let pod = serde_json::to_value(objects.pod).unwrap();
    assert_eq!(
        pod["spec"]["resourceClaims"][0]["resourceClaimName"],
        "openb-pod-0001"
    );
    assert_eq!(
        pod["spec"]["containers"][0]["resources"]["requests"],
        serde_json::json!({"cpu": "6000m", "memory": "12288Mi"})
    );
}

#[test]
fn whole_card_mode_gives_a_sharing_task_a_card_but_counts_its_request() {
    let t = tasks();
    let objects = task_objects(&t[1], Mode::Whole, &["T4"]).unwrap();
    let claim = serde_json::to_value(objects.claim.unwrap()).unwrap();
    assert_eq!(
        claim["spec"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"],
        serde_json::json!({"cores": "100"})
    );
    assert_eq!(placed_milli(&t[1]), 460);
}

#[test]
fn multi_gpu_and_spec_tasks_become_counts_and_model_selectors() {
    let t = tasks();
    let objects = task_objects(&t[3], Mode::Shares, &["G2"]).unwrap();
    let claim = serde_json::to_value(objects.claim.unwrap()).unwrap();
    let exactly = &claim["spec"]["devices"]["requests"][0]["exactly"];
    assert_eq!(exactly["count"], 8);
    assert_eq!(
        exactly["selectors"][0]["cel"]["expression"],
        "device.attributes[\"gpupool.dev\"].model in [\"G2\"]"
    );
    // A CPU-only task has no claim.
    let cpu = task_objects(&t[2], Mode::Shares, &["G2"]).unwrap();
    assert!(cpu.claim.is_none());
    assert!(serde_json::to_value(cpu.pod).unwrap()["spec"]
        .get("resourceClaims")
        .is_none());
    // A spec naming a model no profile has is refused by name.
    let mut odd = t[4].clone();
    odd.gpu_spec = vec!["H800".into()];
    assert_eq!(
        share_memory_mib(&odd, &["G2"]).unwrap_err().to_string(),
        "task openb-pod-0004: gpu_spec names model H800, which no node of the cluster has"
    );
}

#[test]
fn the_extended_mode_asks_whole_cards_through_the_extended_resource() {
    let t = tasks();
    let class = serde_json::to_value(device_class(Mode::SharesPackedExtended)).unwrap();
    assert_eq!(class["spec"]["extendedResourceName"], EXTENDED_RESOURCE);
    assert!(
        serde_json::to_value(device_class(Mode::Shares)).unwrap()["spec"]
            .get("extendedResourceName")
            .is_none()
    );
    let whole = task_objects(&t[0], Mode::SharesPackedExtended, &["T4"]).unwrap();
    assert!(whole.claim.is_none());
    let pod = serde_json::to_value(whole.pod).unwrap();
    assert_eq!(
        pod["spec"]["containers"][0]["resources"]["requests"][EXTENDED_RESOURCE],
        "1"
    );
    // Shares and tasks with a model constraint keep their claims.
    let share = task_objects(&t[1], Mode::SharesPackedExtended, &["T4"]).unwrap();
    assert!(share.claim.is_some());
    let spec = task_objects(&t[3], Mode::SharesPackedExtended, &["G2"]).unwrap();
    assert!(spec.claim.is_some());
}

#[test]
fn the_packed_profile_is_most_allocated_on_every_node() {
    let config: serde_json::Value = serde_yaml::from_str(PACKED_PROFILE).unwrap();
    assert_eq!(config["percentageOfNodesToScore"], 100);
    let strategy = &config["profiles"][0]["pluginConfig"][0]["args"]["scoringStrategy"];
    assert_eq!(strategy["type"], "MostAllocated");
    assert!(strategy["resources"]
        .as_array()
        .unwrap()
        .iter()
        .any(|r| r["name"] == EXTENDED_RESOURCE));
}

#[test]
fn the_account_reports_unallocated_at_100_and_the_curve() {
    let t = tasks();
    let mut account = Account::new(2000);
    account.record(&t[0], true); // arrived 50 %, placed 1000
    account.record(&t[2], true); // CPU only: nothing arrives
    account.record(&t[1], false); // 73 %, refused
    assert_eq!(account.unallocated_at_100, None);
    account.record(&t[4], true); // 85.5 %
    account.record(&t[1], true); // 108.5 %: crosses 100 %
    assert_eq!(account.placed_milli, 1710);
    assert_eq!((account.placed, account.refused), (4, 1));
    assert_eq!(
        (account.placed_gpu_tasks, account.refused_gpu_tasks),
        (3, 1)
    );
    let at_100 = account.unallocated_at_100.unwrap();
    assert!((at_100 - 14.5).abs() < 1e-9, "{at_100}");
    assert!(account.placed_milli <= account.capacity_milli);
    let arrived: Vec<f64> = account.curve.iter().map(|p| p.arrived_percent).collect();
    assert!(arrived.windows(2).all(|w| w[0] < w[1]), "{arrived:?}");
    assert_eq!(account.curve.last().unwrap().arrived_percent, 108.5);
}

#[test]
fn every_model_of_the_trace_has_a_profile_and_the_undisclosed_are_marked() {
    for model in ["P100", "T4", "V100M16", "V100M32", "A10", "G1", "G2", "G3"] {
        let p = card_profile(model).unwrap();
        assert_eq!(p.assumed, model.starts_with('G'), "{model}");
    }
    let node = TraceNode {
        name: "n".into(),
        cpu_milli: 1,
        memory_mib: 1,
        gpus: 1,
        model: "H800".into(),
    };
    let inventory = Inventory {
        source: gpupool_api::inventory::InventorySource::Fake,
        gpus: Vec::new(),
    };
    assert_eq!(
        node_inventory(&node, inventory).unwrap_err().to_string(),
        "node n: model H800 has no profile"
    );
}

#[test]
fn modes_read_back_by_the_name_the_json_gives_them() {
    for mode in Mode::ALL {
        assert_eq!(Mode::parse(mode.name()), Ok(mode));
        assert_eq!(serde_json::to_value(mode).unwrap(), mode.name());
    }
    assert_eq!(
        Mode::parse("packed").unwrap_err(),
        TraceError::UnknownMode("packed".into())
    );
}

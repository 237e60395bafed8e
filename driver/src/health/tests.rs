use super::*;

const T0: i64 = 1_700_000_000;

fn two_gpus() -> HealthMap {
    HealthMap::new(["gpu-0".to_string(), "gpu-1".to_string()])
}

fn xid(device: &str, xid: u32) -> Observation {
    Observation::Xid {
        device: device.into(),
        xid,
    }
}

fn clear(device: &str) -> Observation {
    Observation::Clear {
        device: device.into(),
    }
}

fn keys_and_values(taints: &[DeviceTaint]) -> Vec<(String, Option<String>, String)> {
    taints
        .iter()
        .map(|t| (t.key.clone(), t.value.clone(), t.effect.clone()))
        .collect()
}

#[test]
fn default_lists_taint_card_faults_and_only_count_application_xids() {
    let policy = XidPolicy::default();
    for x in DEFAULT_XID_FATAL {
        assert_eq!(policy.classify(x), XidClass::Fatal, "XID {x}");
    }
    for x in DEFAULT_XID_IGNORE {
        assert_eq!(policy.classify(x), XidClass::Application, "XID {x}");
    }
    assert_eq!(policy.classify(1), XidClass::Unlisted);
}

#[test]
fn the_lists_are_configurable_and_may_not_overlap() {
    let policy = XidPolicy::new([13], []).unwrap();
    assert_eq!(policy.classify(13), XidClass::Fatal);
    assert_eq!(policy.classify(79), XidClass::Unlisted);
    let err = XidPolicy::new([79, 13], [13, 31]).unwrap_err();
    assert!(err.contains("13") && !err.contains("79"), "{err}");
}

#[test]
fn a_fatal_xid_taints_the_card_no_schedule_and_makes_it_unhealthy() {
    let mut map = two_gpus();
    let t = map
        .apply(xid("gpu-0", 79), &XidPolicy::default(), T0)
        .unwrap();
    assert!(
        matches!(&t, Transition::Tainted { device, fault: Fault::Xid(79), .. } if device == "gpu-0")
    );
    let taints = map.taints("gpu-0");
    assert_eq!(
        keys_and_values(&taints),
        [(
            "gpupool.dev/xid".to_string(),
            Some("79".to_string()),
            "NoSchedule".to_string()
        )]
    );
    assert_eq!(
        taints[0].time_added.as_ref().unwrap().0.as_second(),
        T0,
        "added when it happened"
    );
    match map.health("gpu-0") {
        DeviceHealth::Unhealthy {
            fault,
            message,
            since,
        } => {
            assert_eq!((fault, since), (Fault::Xid(79), T0));
            assert!(message.contains("XID 79"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(map.health("gpu-1"), DeviceHealth::Healthy);
    assert!(map.taints("gpu-1").is_empty());
    let event = t.node_event().unwrap();
    assert_eq!(event.reason, "GpuXidError");
    assert!(event.warning);
    assert!(
        event.message.contains("gpu-0") && event.message.contains("gpupool.dev/xid=79"),
        "{}",
        event.message
    );
}

#[test]
fn an_application_xid_is_counted_without_a_taint_or_event() {
    let mut map = two_gpus();
    let policy = XidPolicy::default();
    for n in 1..=2 {
        let t = map.apply(xid("gpu-1", 13), &policy, T0).unwrap();
        assert_eq!(
            t,
            Transition::Counted {
                device: "gpu-1".into(),
                xid: 13,
                class: XidClass::Application,
                count: n
            }
        );
        assert_eq!(t.node_event(), None);
    }
    assert_eq!(map.health("gpu-1"), DeviceHealth::Healthy);
    assert!(map.taints("gpu-1").is_empty());
    assert!(!map.any_tainted());
}

#[test]
fn the_same_xid_again_changes_nothing_and_keeps_its_time() {
    let mut map = two_gpus();
    let policy = XidPolicy::default();
    map.apply(xid("gpu-0", 79), &policy, T0).unwrap();
    let again = map.apply(xid("gpu-0", 79), &policy, T0 + 60).unwrap();
    assert_eq!(again.node_event(), None);
    assert_eq!(map.taints("gpu-0").len(), 1);
    assert_eq!(
        map.taints("gpu-0")[0]
            .time_added
            .as_ref()
            .unwrap()
            .0
            .as_second(),
        T0
    );
}

#[test]
fn a_lost_gpu_gets_its_own_taint_first_and_comes_back_when_read_again() {
    let mut map = two_gpus();
    let policy = XidPolicy::default();
    map.apply(xid("gpu-0", 48), &policy, T0).unwrap();
    let t = map
        .apply(
            Observation::Lost {
                device: "gpu-0".into(),
                detail: "GPU is lost".into(),
            },
            &policy,
            T0 + 1,
        )
        .unwrap();
    assert_eq!(t.node_event().unwrap().reason, "GpuLost");
    assert_eq!(
        keys_and_values(&map.taints("gpu-0")),
        [
            (
                "gpupool.dev/gpu-lost".to_string(),
                None,
                "NoSchedule".to_string()
            ),
            (
                "gpupool.dev/xid".to_string(),
                Some("48".to_string()),
                "NoSchedule".to_string()
            ),
        ]
    );
    assert!(
        matches!(map.health("gpu-0"), DeviceHealth::Unhealthy { fault: Fault::Lost, ref message, .. } if message.contains("XID 48"))
    );
    // Readable again: the lost taint goes, the XID stays until someone clears it.
    let back = map
        .apply(
            Observation::Readable {
                device: "gpu-0".into(),
            },
            &policy,
            T0 + 2,
        )
        .unwrap();
    assert_eq!(back.node_event().unwrap().reason, "GpuRecovered");
    assert_eq!(
        keys_and_values(&map.taints("gpu-0")),
        [(
            "gpupool.dev/xid".to_string(),
            Some("48".to_string()),
            "NoSchedule".to_string()
        )]
    );
}

#[test]
fn clear_removes_every_taint_and_says_so() {
    let mut map = two_gpus();
    let policy = XidPolicy::default();
    map.apply(xid("gpu-0", 79), &policy, T0).unwrap();
    map.apply(xid("gpu-0", 94), &policy, T0).unwrap();
    let t = map.apply(clear("gpu-0"), &policy, T0 + 5).unwrap();
    assert_eq!(
        t,
        Transition::Recovered {
            device: "gpu-0".into(),
            cleared: vec![Fault::Xid(79), Fault::Xid(94)]
        }
    );
    let event = t.node_event().unwrap();
    assert_eq!(event.reason, "GpuRecovered");
    assert!(!event.warning);
    assert!(event.message.contains("XID 79"), "{}", event.message);
    assert_eq!(map.health("gpu-0"), DeviceHealth::Healthy);
    assert!(map.taints("gpu-0").is_empty());
    // Clearing a healthy card is no news.
    assert_eq!(
        map.apply(clear("gpu-0"), &policy, T0 + 6)
            .unwrap()
            .node_event(),
        None
    );
}

#[test]
fn a_card_nvml_cannot_read_is_unknown_without_a_taint() {
    let mut map = two_gpus();
    let policy = XidPolicy::default();
    let t = map
        .apply(
            Observation::Unreadable {
                device: "gpu-1".into(),
                reason: "NVML: Unknown Error".into(),
            },
            &policy,
            T0,
        )
        .unwrap();
    assert_eq!(t.node_event().unwrap().reason, "GpuUnreadable");
    assert_eq!(
        map.health("gpu-1"),
        DeviceHealth::Unknown {
            reason: "NVML: Unknown Error".into()
        }
    );
    assert!(map.taints("gpu-1").is_empty());
    map.apply(
        Observation::Readable {
            device: "gpu-1".into(),
        },
        &policy,
        T0 + 1,
    )
    .unwrap();
    assert_eq!(map.health("gpu-1"), DeviceHealth::Healthy);
}

#[test]
fn at_most_16_taints_per_device_and_a_lost_gpu_always_shows() {
    let mut map = two_gpus();
    let fatal: Vec<u32> = (100..130).collect();
    let policy = XidPolicy::new(fatal.clone(), []).unwrap();
    for x in &fatal {
        map.apply(xid("gpu-0", *x), &policy, T0).unwrap();
    }
    assert_eq!(map.taints("gpu-0").len(), 16);
    map.apply(
        Observation::Lost {
            device: "gpu-0".into(),
            detail: "gone".into(),
        },
        &policy,
        T0,
    )
    .unwrap();
    let taints = map.taints("gpu-0");
    assert_eq!(taints.len(), 16);
    assert_eq!(taints[0].key, TAINT_GPU_LOST);
}

#[test]
fn a_device_the_node_does_not_have_is_refused_naming_the_known_ones() {
    let mut map = two_gpus();
    let err = map
        .apply(xid("gpu-7", 79), &XidPolicy::default(), T0)
        .unwrap_err();
    assert_eq!(err.device, "gpu-7");
    assert!(err.to_string().contains("gpu-0, gpu-1"), "{err}");
}

#[test]
fn a_restart_keeps_the_taints_of_devices_still_there() {
    let mut before = HealthMap::new(["gpu-0".to_string(), "gpu-5".to_string()]);
    let policy = XidPolicy::default();
    before.apply(xid("gpu-0", 79), &policy, T0).unwrap();
    before.apply(xid("gpu-5", 79), &policy, T0).unwrap();
    let saved: HealthMap = serde_json::from_str(&serde_json::to_string(&before).unwrap()).unwrap();
    let after = two_gpus().restored_from(&saved);
    assert_eq!(after.taints("gpu-0"), before.taints("gpu-0"));
    assert!(
        after.get("gpu-5").is_none(),
        "a card that is gone is not kept"
    );
}

//! Pins every deliberate difference from HAMi listed in `docs/contract-deviations.md`
//! (test names carry the row id).

use std::collections::BTreeMap;

use hami_contract::config::NvidiaConfig;
use hami_contract::config::{DeviceConfig, NodeConfigFile};
use hami_contract::devices::PodDevices;
use hami_contract::handshake::Handshake;
use hami_contract::node::decode_node_devices;
use hami_contract::policy::{AnnotationError, PodSchedulingOptions, ScoringWeights};
use hami_contract::request::{
    ContainerResources, RequestError, RequestWarning, resolve_container, webhook_mutation,
};

fn container(limits: &[(&str, &str)]) -> ContainerResources {
    ContainerResources {
        name: "main".into(),
        limits: limits
            .iter()
            .map(|(k, v)| ((*k).into(), (*v).into()))
            .collect(),
        ..Default::default()
    }
}

fn annos(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).into(), (*v).into()))
        .collect()
}

#[test]
fn d1_trailing_separator_adds_no_entry() {
    assert_eq!(PodDevices::decode("GPU-a,NVIDIA,1,1:;").unwrap().0.len(), 1);
    assert_eq!(
        PodDevices::decode("GPU-a,NVIDIA,1,1:").unwrap(),
        PodDevices::decode("GPU-a,NVIDIA,1,1:;").unwrap()
    );
}

#[test]
fn n1_legacy_bad_number_is_an_error() {
    let err = decode_node_devices("GPU-a,ten,15360,100,NVIDIA-Tesla T4,0,true:")
        .unwrap_err()
        .to_string();
    assert!(err.contains("Count") && err.contains("GPU-a,ten"), "{err}");
}

#[test]
fn n2_negative_json_number_is_an_error() {
    let err = decode_node_devices(r#"[{"id":"GPU-a","numa":-1}]"#)
        .unwrap_err()
        .to_string();
    assert!(err.contains("device 0") && err.contains("numa"), "{err}");
}

#[test]
fn c2_c3_c4_config_values_are_checked() {
    assert!(DeviceConfig::from_yaml("nvidia:\n  gpuCorePolicy: sometimes\n").is_err());
    assert!(DeviceConfig::from_yaml("nvidia:\n  deviceMemoryScaling: 0\n").is_err());
    assert!(DeviceConfig::from_yaml("nvidia:\n  deviceCoreScaling: .nan\n").is_err());
    assert!(DeviceConfig::from_yaml("nvidia:\n  defaultCores: -5\n").is_err());
    // Faithful: YAML 1.1 booleans and scalars into strings, as Go's yaml.v2.
    let c = DeviceConfig::from_yaml(
        "nvidia:\n  overwriteEnv: yes\n  libCudaLogLevel: 3\n  gpuCorePolicy: \"\"\n",
    )
    .unwrap();
    assert!(c.nvidia.overwrite_env);
    assert_eq!(c.nvidia.lib_cuda_log_level, "3");
}

#[test]
fn j1_duplicate_node_names_are_reported_and_the_first_wins() {
    let f = NodeConfigFile::from_json(r#"{"nodeconfig":[{"name":"a","devicesplitcount":2},{"name":"a","devicesplitcount":3},{"name":"b"}]}"#)
        .unwrap();
    assert_eq!(f.for_node("a").unwrap().devicesplitcount, Some(2));
    assert_eq!(f.duplicate_names(), vec!["a".to_owned()]);
}

#[test]
fn j3_negative_preconfigured_memory_is_an_error() {
    let err = NodeConfigFile::from_json(
        r#"{"nodeconfig":[{"name":"a","preconfigureddevicememory":-1}]}"#,
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.starts_with("nodeconfig[0].preconfigureddevicememory:"),
        "{err}"
    );
}

#[test]
fn r2_memory_suffix_is_read_as_mib_with_a_warning_and_denied_by_the_webhook() {
    let d = NvidiaConfig::default();
    let c = container(&[("nvidia.com/gpu", "1"), ("nvidia.com/gpumem", "4Ki")]);
    let r = resolve_container(&c, &d);
    assert_eq!(r.request.unwrap().memreq, 4096);
    assert!(matches!(
        &r.warnings[..],
        [RequestWarning::MemorySuffix { mib: 4096, .. }]
    ));
    assert!(matches!(
        webhook_mutation(&c, &d),
        Err(RequestError::MemoryNotMib { .. })
    ));
}

/// The API server stores quantities canonically, so a user's `gpumem: 3000` reaches the webhook
/// and the scheduler as `3k`. Decimal multipliers are therefore plain MiB, never refused.
#[test]
fn r2_canonical_decimal_multiples_are_plain_mib() {
    let d = NvidiaConfig::default();
    for (text, mib) in [("3k", 3000), ("40k", 40000), ("2M", 2_000_000)] {
        let c = container(&[("nvidia.com/gpu", "1"), ("nvidia.com/gpumem", text)]);
        let r = resolve_container(&c, &d);
        assert_eq!(r.request.unwrap().memreq, mib, "{text}");
        assert!(r.warnings.is_empty(), "{text}: {:?}", r.warnings);
        assert!(webhook_mutation(&c, &d).is_ok(), "{text}");
    }
}

#[test]
fn r3_cores_above_100_are_denied_by_the_webhook() {
    let c = container(&[("nvidia.com/gpu", "1"), ("nvidia.com/gpucores", "150")]);
    let err = webhook_mutation(&c, &NvidiaConfig::default()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid nvidia.com/gpucores value 150 in container main: must be an integer between 0 and 100 (percent of one GPU's SMs)"
    );
}

#[test]
fn r4_non_integer_percentage_and_cores_fall_back_with_a_warning() {
    let d = NvidiaConfig::default();
    let c = container(&[
        ("nvidia.com/gpu", "1"),
        ("nvidia.com/gpumem-percentage", "50.5"),
        ("nvidia.com/gpucores", "7.5"),
    ]);
    let r = resolve_container(&c, &d);
    let req = r.request.unwrap();
    assert_eq!((req.mem_percentage_req, req.coresreq), (100, 0));
    assert_eq!(r.warnings.len(), 2);
    assert!(matches!(
        webhook_mutation(&c, &d),
        Err(RequestError::PercentageOutOfRange { .. })
    ));
}

#[test]
fn r5_r6_zero_or_unusable_count_is_no_request() {
    let d = NvidiaConfig::default();
    let r = resolve_container(&container(&[("nvidia.com/gpu", "0")]), &d);
    assert_eq!((r.request, r.warnings.len()), (None, 0));
    for bad in ["1.5", "-1", "3000000000", "lots"] {
        let r = resolve_container(&container(&[("nvidia.com/gpu", bad)]), &d);
        assert_eq!(r.request, None, "{bad}");
        assert!(
            matches!(&r.warnings[..], [RequestWarning::CountIgnored { .. }]),
            "{bad}"
        );
    }
}

#[test]
fn r7_negative_cores_use_the_default() {
    let cfg = NvidiaConfig {
        default_cores: 5,
        ..Default::default()
    };
    let r = resolve_container(
        &container(&[("nvidia.com/gpu", "1"), ("nvidia.com/gpucores", "-10")]),
        &cfg,
    );
    assert_eq!(r.request.unwrap().coresreq, 5);
    assert!(
        r.warnings[0].to_string().contains("defaultCores 5"),
        "{}",
        r.warnings[0]
    );
}

#[test]
fn a1_unknown_gpu_policy_is_an_error_naming_it() {
    let err = PodSchedulingOptions::from_annotations(&annos(&[(
        "hami.io/gpu-scheduler-policy",
        "binpak",
    )]))
    .unwrap_err();
    assert!(matches!(&err, AnnotationError::GpuPolicy { item, .. } if item == "binpak"));
    // Empty counts as absent.
    let o =
        PodSchedulingOptions::from_annotations(&annos(&[("hami.io/gpu-scheduler-policy", " ")]))
            .unwrap();
    assert_eq!(o.gpu_policy, None);
}

#[test]
fn a2_type_lists_are_trimmed_and_empty_items_dropped() {
    let o = PodSchedulingOptions::from_annotations(&annos(&[
        ("nvidia.com/use-gputype", "A100,"),
        ("nvidia.com/nouse-gputype", ""),
    ]))
    .unwrap();
    assert!(o.type_allowed("NVIDIA A100-SXM4-40GB"));
    assert!(!o.type_allowed("NVIDIA-Tesla T4"));
    let o = PodSchedulingOptions::from_annotations(&annos(&[("nvidia.com/use-gputype", " T4")]))
        .unwrap();
    assert_eq!(o.use_type, ["T4"]);
}

#[test]
fn a3_huge_weight_is_an_error() {
    let err = ScoringWeights::parse("slot=4294967296,core=1,memory=1")
        .unwrap_err()
        .to_string();
    assert!(
        err.ends_with("\"slot\" weight 4294967296 is too large"),
        "{err}"
    );
}

#[test]
fn h1_go_datetime_is_parsed_strictly() {
    assert_eq!(
        Handshake::parse("Requesting_2025-06-13 9:07:40").requesting_expired(i64::MAX),
        Some(false)
    );
}

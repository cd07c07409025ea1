//! Golden tests: every example string and table row of the HAMi contract,
//! `docs/contract/hami.md` (contract §1–§3, plus the webhook of contract §7 and the quota request
//! of contract §5.7). Each test names the section it pins.

use std::collections::BTreeMap;

use hami_contract::annotations as keys;
use hami_contract::config::{DeviceConfig, GpuCorePolicy, NodeConfigFile, NvidiaConfig};
use hami_contract::devices::{ContainerDevice, PodDevices};
use hami_contract::handshake::{Handshake, parse_go_datetime};
use hami_contract::node::{
    DevicePairScore, NodeDevice, P2pLink, decode_node_devices, decode_pair_scores, encode_legacy,
    encode_node_devices, encode_pair_scores, model_type_name,
};
use hami_contract::nodelock::{NodeLock, is_held_by};
use hami_contract::policy::{
    AnnotationWarning, GpuPolicy, GpuPolicyChain, NodePolicy, PodSchedulingOptions, ScoringWeights,
    parse_device_cordon,
};
use hami_contract::request::{
    ContainerDeviceRequest, ContainerResources, RequestError, RequestWarning, resolve_container,
    webhook_mutation,
};
use hami_contract::resources::{MEM_PERCENTAGE_UNSET, ResourceNames};

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

fn req(nums: u32, memreq: u32, pct: u32, cores: u32) -> ContainerDeviceRequest {
    ContainerDeviceRequest {
        nums,
        vendor: "NVIDIA".into(),
        memreq,
        mem_percentage_req: pct,
        coresreq: cores,
    }
}

const GPU: &str = "nvidia.com/gpu";
const MEM: &str = "nvidia.com/gpumem";
const PCT: &str = "nvidia.com/gpumem-percentage";
const CORES: &str = "nvidia.com/gpucores";
const PRIO: &str = "nvidia.com/priority";

// ---- contract §1.1 resource names ---------------------------------------------------------------

#[test]
fn s1_1_default_resource_names() {
    let n = ResourceNames::default();
    assert_eq!(
        [
            &n.count,
            &n.memory,
            &n.memory_percentage,
            &n.cores,
            &n.priority
        ],
        [GPU, MEM, PCT, CORES, PRIO]
    );
    assert_eq!(NvidiaConfig::default().resources, n);
}

#[test]
fn s1_1_limits_are_read_before_requests() {
    let mut c = container(&[(GPU, "1"), (MEM, "3000")]);
    c.requests.insert(MEM.into(), "1000".into());
    c.requests.insert(CORES.into(), "30".into());
    let r = resolve_container(&c, &NvidiaConfig::default())
        .request
        .unwrap();
    assert_eq!((r.memreq, r.coresreq), (3000, 30));
}

#[test]
fn s1_1_gpumem_16gi_makes_hami_ignore_the_whole_request() {
    for bad in ["16Gi", "16.0Gi", "1.5"] {
        let r = resolve_container(
            &container(&[(GPU, "1"), (MEM, bad)]),
            &NvidiaConfig::default(),
        );
        assert_eq!(r.request, None, "{bad}");
        assert!(
            matches!(&r.warnings[..], [RequestWarning::MemoryIgnored { value, .. }] if value == bad),
            "{bad}: {:?}",
            r.warnings
        );
        let text = r.warnings[0].to_string();
        assert!(
            text.contains("ignores the whole GPU request") && text.contains("16384"),
            "{text}"
        );
    }
    // Overflow after memoryFactor.
    let cfg = NvidiaConfig {
        memory_factor: 2,
        ..Default::default()
    };
    let r = resolve_container(&container(&[(GPU, "1"), (MEM, "2000000000")]), &cfg);
    assert_eq!(r.request, None);
    assert!(matches!(
        r.warnings[..],
        [RequestWarning::MemoryIgnored { .. }]
    ));
}

#[test]
fn s1_1_percentage_above_100_is_clamped_and_zero_is_unset() {
    let d = NvidiaConfig::default();
    let r = resolve_container(&container(&[(GPU, "1"), (PCT, "150")]), &d)
        .request
        .unwrap();
    assert_eq!(r.mem_percentage_req, 100);
    let r = resolve_container(&container(&[(GPU, "1"), (PCT, "-5")]), &d)
        .request
        .unwrap();
    assert_eq!(r.mem_percentage_req, 100); // unset ⇒ whole card default
}

#[test]
fn s1_1_cores_above_100_are_clamped_in_fit() {
    let r = resolve_container(
        &container(&[(GPU, "1"), (CORES, "150")]),
        &NvidiaConfig::default(),
    )
    .request
    .unwrap();
    assert_eq!((r.coresreq, r.cores_on()), (150, 100));
}

// ---- contract §1.2 request resolution table -----------------------------------------------------

#[test]
fn s1_2_request_table() {
    let d = NvidiaConfig::default();
    type Row<'a> = (
        Vec<(&'a str, &'a str)>,
        NvidiaConfig,
        ContainerDeviceRequest,
    );
    let rows: Vec<Row> = vec![
        (vec![(GPU, "1")], d.clone(), req(1, 0, 100, 0)),
        (
            vec![(GPU, "2"), (MEM, "4096")],
            d.clone(),
            req(2, 4096, 101, 0),
        ),
        (vec![(GPU, "1"), (PCT, "50")], d.clone(), req(1, 0, 50, 0)),
        (
            vec![(GPU, "1"), (CORES, "50")],
            d.clone(),
            req(1, 0, 100, 50),
        ),
        (vec![(GPU, "1"), (PCT, "0")], d.clone(), req(1, 0, 100, 0)),
        (
            vec![(GPU, "1")],
            NvidiaConfig {
                default_memory: 512,
                ..d.clone()
            },
            req(1, 512, 101, 0),
        ),
        (
            vec![(GPU, "3"), (MEM, "1024")],
            NvidiaConfig {
                memory_factor: 2,
                ..d.clone()
            },
            req(3, 2048, 101, 0),
        ),
    ];
    for (limits, cfg, want) in rows {
        let got = resolve_container(&container(&limits), &cfg);
        assert_eq!(got.request.as_ref(), Some(&want), "{limits:?}");
        assert!(got.warnings.is_empty(), "{limits:?}: {:?}", got.warnings);
    }
}

#[test]
fn s1_2_default_memory_is_not_multiplied_by_memory_factor() {
    let cfg = NvidiaConfig {
        default_memory: 512,
        memory_factor: 4,
        ..Default::default()
    };
    let r = resolve_container(&container(&[(GPU, "1")]), &cfg)
        .request
        .unwrap();
    assert_eq!(
        (r.memreq, r.mem_percentage_req),
        (512, MEM_PERCENTAGE_UNSET)
    );
}

#[test]
fn s1_2_memory_actually_booked() {
    assert_eq!(req(1, 3000, 101, 0).memory_on(15360), 3000);
    assert_eq!(req(1, 0, 50, 0).memory_on(15360), 7680);
    assert_eq!(req(1, 0, 33, 0).memory_on(1000), 330);
    assert_eq!(req(1, 0, 33, 0).memory_on(1001), 330); // floor
    assert_eq!(req(1, 0, 100, 0).memory_on(15360), 15360);
    // Absolute memory wins over a percentage.
    assert_eq!(req(1, 2000, 50, 0).memory_on(15360), 2000);
    assert_eq!(req(1, 0, 101, 0).memory_on(15360), 0);
}

#[test]
fn s1_2_no_count_means_no_request() {
    let r = resolve_container(&container(&[(MEM, "3000")]), &NvidiaConfig::default());
    assert_eq!(r, Default::default());
}

// ---- contract §1.3 defaults when only the count is given (webhook) ------------------------------

fn limits_after(c: &ContainerResources, cfg: &NvidiaConfig) -> (bool, Vec<(String, String)>) {
    let m = webhook_mutation(c, cfg).unwrap();
    (m.has_resource, m.add_limits)
}

#[test]
fn s1_3_gpu_alone_is_an_exclusive_whole_card() {
    let d = NvidiaConfig::default();
    let (has, add) = limits_after(&container(&[(GPU, "1")]), &d);
    assert!(has);
    assert_eq!(add, vec![(CORES.to_owned(), "100".to_owned())]);
    // After the mutation the scheduler sees 100 % memory and 100 cores.
    let r = resolve_container(&container(&[(GPU, "1"), (CORES, "100")]), &d)
        .request
        .unwrap();
    assert_eq!((r.mem_percentage_req, r.coresreq), (100, 100));
    // Without the webhook: 100 % memory, defaultCores (0) cores.
    let r = resolve_container(&container(&[(GPU, "1")]), &d)
        .request
        .unwrap();
    assert_eq!((r.mem_percentage_req, r.coresreq), (100, 0));
}

#[test]
fn s1_3_gpu_with_gpumem_stays_shareable() {
    let (has, add) = limits_after(
        &container(&[(GPU, "1"), (MEM, "8192")]),
        &NvidiaConfig::default(),
    );
    assert!(has);
    assert!(add.is_empty());
}

#[test]
fn s1_3_percentage_100_is_exclusive_other_percentages_are_not() {
    let d = NvidiaConfig::default();
    assert_eq!(
        limits_after(&container(&[(GPU, "1"), (PCT, "100")]), &d).1,
        vec![(CORES.to_owned(), "100".to_owned())]
    );
    assert!(
        limits_after(&container(&[(GPU, "1"), (PCT, "50")]), &d)
            .1
            .is_empty()
    );
    // Empty memory resource name ⇒ exclusive.
    let mut cfg = d.clone();
    cfg.resources.memory = String::new();
    assert_eq!(
        limits_after(&container(&[(GPU, "1"), (MEM, "8192")]), &cfg).1,
        vec![(CORES.to_owned(), "100".to_owned())]
    );
}

#[test]
fn s1_3_count_defaulting() {
    let d = NvidiaConfig::default();
    for limit in [(MEM, "3000"), (PCT, "50"), (CORES, "30")] {
        let (has, add) = limits_after(&container(&[limit]), &d);
        assert!(has, "{limit:?}");
        assert_eq!(add[0], (GPU.to_owned(), "1".to_owned()), "{limit:?}");
    }
    // gpumem-percentage 100 alone: count added, then exclusive cores.
    assert_eq!(
        limits_after(&container(&[(PCT, "100")]), &d).1,
        vec![
            (GPU.to_owned(), "1".to_owned()),
            (CORES.to_owned(), "100".to_owned())
        ]
    );
    let cfg = NvidiaConfig {
        default_gpu_num: 2,
        ..d.clone()
    };
    assert_eq!(
        limits_after(&container(&[(MEM, "3000")]), &cfg).1,
        vec![(GPU.to_owned(), "2".to_owned())]
    );
    let cfg = NvidiaConfig {
        default_gpu_num: 0,
        ..d
    };
    assert_eq!(
        limits_after(&container(&[(MEM, "3000")]), &cfg),
        (false, vec![])
    );
}

#[test]
fn s1_3_scheduler_defaults() {
    let d = NvidiaConfig::default();
    assert_eq!(
        (d.default_memory, d.default_cores, d.default_gpu_num),
        (0, 0, 1)
    );
}

// ---- contract §1.4 device-config.yaml -----------------------------------------------------------

#[test]
fn s1_4_chart_defaults_for_absent_keys() {
    let d = NvidiaConfig::default();
    assert!(!d.overwrite_env);
    assert_eq!(d.memory_factor, 1);
    assert_eq!(d.pre_configured_device_memory, 0);
    assert_eq!(d.device_split_count, 10);
    assert_eq!((d.device_memory_scaling, d.device_core_scaling), (1.0, 1.0));
    assert!(!d.enable_numa_topology);
    assert_eq!(d.gpu_core_policy, GpuCorePolicy::Default);
    assert_eq!(d.lib_cuda_log_level, "1");
    assert_eq!(d.runtime_class_name, "");
    assert!(!d.disable_core_limit);
    assert_eq!(DeviceConfig::from_yaml("").unwrap().nvidia, d);
    assert_eq!(DeviceConfig::from_yaml("nvidia:\n").unwrap().nvidia, d);
    assert_eq!(
        DeviceConfig::from_yaml("cambricon:\n  resourceCountName: x\n")
            .unwrap()
            .nvidia,
        d
    );
}

#[test]
fn s1_4_every_key_is_read() {
    let yaml = r#"
nvidia:
  resourceCountName: "example.com/gpu"
  resourceMemoryName: "example.com/gpumem"
  resourceMemoryPercentageName: "example.com/gpumem-percentage"
  resourceCoreName: "example.com/gpucores"
  resourcePriorityName: "example.com/priority"
  overwriteEnv: true
  defaultMemory: 1024
  defaultCores: 10
  defaultGPUNum: 2
  memoryFactor: 4
  preConfiguredDeviceMemory: 81920
  deviceSplitCount: 5
  deviceMemoryScaling: 1.5
  deviceCoreScaling: 2
  enableNumaTopology: true
  gpuCorePolicy: force
  libCudaLogLevel: 4
  runtimeClassName: nvidia
  disableCoreLimit: true
  knownMigGeometries: [{models: [A30]}]
  someFutureKey: {nested: true}
  migProfileAllowlist:
    - models: ["A100", "H100"]
      profiles: ["1g.10gb", "3g.40gb"]
hygon:
  resourceCountName: "hygon.com/dcunum"
"#;
    let c = DeviceConfig::from_yaml(yaml).unwrap().nvidia;
    assert_eq!(c.resources.count, "example.com/gpu");
    assert_eq!(c.resources.memory, "example.com/gpumem");
    assert_eq!(
        c.resources.memory_percentage,
        "example.com/gpumem-percentage"
    );
    assert_eq!(c.resources.cores, "example.com/gpucores");
    assert_eq!(c.resources.priority, "example.com/priority");
    assert!(c.overwrite_env);
    assert_eq!(
        (c.default_memory, c.default_cores, c.default_gpu_num),
        (1024, 10, 2)
    );
    assert_eq!(
        (
            c.memory_factor,
            c.pre_configured_device_memory,
            c.device_split_count
        ),
        (4, 81920, 5)
    );
    assert_eq!((c.device_memory_scaling, c.device_core_scaling), (1.5, 2.0));
    assert!(c.enable_numa_topology);
    assert_eq!(c.gpu_core_policy, GpuCorePolicy::Force);
    assert_eq!(c.lib_cuda_log_level, "4");
    assert_eq!(c.runtime_class_name, "nvidia");
    assert!(c.disable_core_limit);
    assert_eq!(c.mig_profile_allowlist.len(), 1);
    assert_eq!(c.mig_profile_allowlist[0].models, ["A100", "H100"]);
    assert_eq!(c.mig_profile_allowlist[0].profiles, ["1g.10gb", "3g.40gb"]);
}

#[test]
fn s1_4_wrong_types_name_the_key_path() {
    let cases = [
        (
            "nvidia:\n  deviceSplitCount: ten\n",
            "nvidia.deviceSplitCount: invalid type: string \"ten\", expected u32",
        ),
        (
            "nvidia:\n  defaultMemory: -1\n",
            "nvidia.defaultMemory: invalid type: integer `-1`, expected u32",
        ),
        ("nvidia:\n  overwriteEnv: maybe\n", "nvidia.overwriteEnv:"),
        (
            "nvidia:\n  deviceMemoryScaling: lots\n",
            "nvidia.deviceMemoryScaling:",
        ),
        (
            "nvidia:\n  gpuCorePolicy: sometimes\n",
            "nvidia.gpuCorePolicy: unknown gpuCorePolicy \"sometimes\"",
        ),
        (
            "nvidia:\n  migProfileAllowlist: [{models: 3}]\n",
            "nvidia.migProfileAllowlist[0].models:",
        ),
        (
            "nvidia:\n  deviceCoreScaling: -1\n",
            "nvidia.deviceCoreScaling: must be a positive number",
        ),
        (
            "nvidia:\n  memoryFactor: 3000000000\n",
            "nvidia.memoryFactor: 3000000000 does not fit",
        ),
        ("nvidia: [1, 2]\n", "nvidia:"),
    ];
    for (yaml, want) in cases {
        let err = DeviceConfig::from_yaml(yaml).unwrap_err().to_string();
        assert!(
            err.starts_with(want),
            "{yaml:?}: got {err:?}, want prefix {want:?}"
        );
    }
    let err = DeviceConfig::from_yaml("nvidia: {\n")
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("device-config.yaml: "), "{err}");
}

#[test]
fn s1_4_gpu_core_policy_env_and_overwrite_env() {
    let cfg = NvidiaConfig {
        gpu_core_policy: GpuCorePolicy::Disable,
        overwrite_env: true,
        ..Default::default()
    };
    let m = webhook_mutation(&container(&[]), &cfg).unwrap();
    assert!(!m.has_resource);
    assert_eq!(
        m.add_env,
        vec![
            (
                "GPU_CORE_UTILIZATION_POLICY".to_owned(),
                "disable".to_owned()
            ),
            ("NVIDIA_VISIBLE_DEVICES".to_owned(), "none".to_owned())
        ]
    );
    let m = webhook_mutation(&container(&[(GPU, "1")]), &cfg).unwrap();
    assert_eq!(
        m.add_env,
        vec![(
            "GPU_CORE_UTILIZATION_POLICY".to_owned(),
            "disable".to_owned()
        )]
    );
}

// ---- contract §1.5 per-node config.json ---------------------------------------------------------

const NODE_CONFIG_EXAMPLE: &str = r#"{"nodeconfig":[{"name":"node-a","operatingmode":"hami-core","devicememoryscaling":1,
  "devicesplitcount":10,"devicecorescaling":1,"preconfigureddevicememory":0,
  "libcudaloglevel":"1","enablenumatopology":false,"migstrategy":"none",
  "filterdevices":{"uuid":[],"index":[]},"enablegetpreferredallocation":false}]}"#;

#[test]
fn s1_5_node_config_example() {
    let f = NodeConfigFile::from_json(NODE_CONFIG_EXAMPLE).unwrap();
    let n = f.for_node("node-a").unwrap();
    assert_eq!(n.operatingmode, "hami-core");
    assert_eq!(n.devicememoryscaling, Some(1.0));
    assert_eq!(n.devicesplitcount, Some(10));
    assert_eq!(n.devicecorescaling, Some(1.0));
    assert_eq!(n.preconfigureddevicememory, Some(0));
    assert_eq!(n.libcudaloglevel.as_deref(), Some("1"));
    assert_eq!(n.enablenumatopology, Some(false));
    assert_eq!(n.migstrategy, "none");
    assert!(n.filterdevices.uuid.is_empty() && n.filterdevices.index.is_empty());
    assert_eq!(n.enablegetpreferredallocation, Some(false));
    assert!(f.for_node("node-b").is_none());
}

#[test]
fn s1_5_only_non_zero_values_override() {
    let base = NvidiaConfig {
        device_split_count: 4,
        device_memory_scaling: 2.0,
        pre_configured_device_memory: 100,
        ..Default::default()
    };
    let f = NodeConfigFile::from_json(
        r#"{"nodeconfig":[{"name":"n","devicesplitcount":0,"devicememoryscaling":1.5,"devicecorescaling":0,
            "preconfigureddevicememory":0,"libcudaloglevel":"","enablenumatopology":true}]}"#,
    )
    .unwrap();
    let merged = base.with_node_override(f.for_node("n").unwrap());
    assert_eq!(merged.device_split_count, 4);
    assert_eq!(merged.device_memory_scaling, 1.5);
    assert_eq!(merged.device_core_scaling, 1.0);
    assert_eq!(merged.pre_configured_device_memory, 100);
    assert_eq!(merged.lib_cuda_log_level, "1");
    assert!(merged.enable_numa_topology);
}

#[test]
fn s1_5_keys_are_case_insensitive_and_errors_name_the_path() {
    let f = NodeConfigFile::from_json(r#"{"NodeConfig":[{"Name":"n","DeviceSplitCount":3,"FilterDevices":{"UUID":["GPU-a"],"Index":[1]}}]}"#)
        .unwrap();
    let n = f.for_node("n").unwrap();
    assert_eq!(n.devicesplitcount, Some(3));
    assert!(n.filterdevices.hides("GPU-a", 0) && n.filterdevices.hides("GPU-x", 1));
    assert!(!n.filterdevices.hides("GPU-x", 0));
    let err = NodeConfigFile::from_json(
        r#"{"nodeconfig":[{"name":"n"},{"name":"m","devicesplitcount":"ten"}]}"#,
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.starts_with("nodeconfig[1].devicesplitcount: invalid type: string \"ten\""),
        "{err}"
    );
    let err = NodeConfigFile::from_json("{").unwrap_err().to_string();
    assert!(err.starts_with("config.json: "), "{err}");
}

// ---- contract §2.1 node register annotation -----------------------------------------------------

const REGISTER_EXAMPLE: &str = concat!(
    r#"[{"id":"GPU-0c8e3b5a-1111-2222-3333-444455556666","count":10,"devmem":15360,"devcore":100,"type":"NVIDIA-Tesla T4","mode":"hami-core","health":true},"#,
    r#"{"id":"GPU-9a1b2c3d-1111-2222-3333-444455556666","index":1,"count":10,"devmem":15360,"devcore":100,"type":"NVIDIA-Tesla T4","numa":1,"mode":"hami-core","health":true}]"#
);

fn t4(id: &str, index: u32, numa: u32) -> NodeDevice {
    NodeDevice {
        id: id.into(),
        index,
        count: 10,
        devmem: 15360,
        devcore: 100,
        device_type: "NVIDIA-Tesla T4".into(),
        numa,
        mode: "hami-core".into(),
        mig_profiles: vec![],
        health: true,
    }
}

#[test]
fn s2_1_json_example_encodes_byte_for_byte() {
    let devices = vec![
        t4("GPU-0c8e3b5a-1111-2222-3333-444455556666", 0, 0),
        t4("GPU-9a1b2c3d-1111-2222-3333-444455556666", 1, 1),
    ];
    assert_eq!(encode_node_devices(&devices), REGISTER_EXAMPLE);
    assert_eq!(decode_node_devices(REGISTER_EXAMPLE).unwrap(), devices);
    // The document's two-line layout (whitespace between elements) decodes the same.
    let spaced = REGISTER_EXAMPLE.replace("},{", "},\n {");
    assert_eq!(decode_node_devices(&spaced).unwrap(), devices);
}

#[test]
fn s2_1_omitempty_and_absent_health() {
    let d = NodeDevice {
        id: "GPU-a".into(),
        ..Default::default()
    };
    assert_eq!(encode_node_devices(&[d]), r#"[{"id":"GPU-a"}]"#);
    let got =
        decode_node_devices(r#"[{"id":"GPU-a","count":1,"devicepairscore":{},"future":[1]}]"#)
            .unwrap();
    assert!(!got[0].health);
    assert_eq!(decode_node_devices("[]").unwrap(), vec![]);
}

#[test]
fn s2_1_type_prefix_rule() {
    assert_eq!(model_type_name("Tesla T4"), "NVIDIA-Tesla T4");
    assert_eq!(
        model_type_name("NVIDIA A100-SXM4-40GB"),
        "NVIDIA A100-SXM4-40GB"
    );
}

#[test]
fn s2_1_mig_profiles_are_kept() {
    let text = r#"[{"id":"GPU-m","count":7,"devmem":40960,"devcore":100,"type":"NVIDIA A100-SXM4-40GB","mode":"mig","migProfiles":[{"name":"1g.5gb","memoryMB":4864,"core":15,"sliceCount":1,"placements":[{"start":6,"size":1}]}],"health":true}]"#;
    let d = decode_node_devices(text).unwrap();
    assert_eq!(d[0].mig_profiles.len(), 1);
    assert_eq!(d[0].mig_profiles[0]["memoryMB"], 4864);
    assert_eq!(encode_node_devices(&d), text);
}

#[test]
fn s2_1_legacy_examples() {
    let nine = "GPU-aaa,10,15360,100,NVIDIA-Tesla T4,0,true,0,hami-core:GPU-bbb,10,15360,100,NVIDIA-Tesla T4,1,true,1,hami-core:";
    let d = decode_node_devices(nine).unwrap();
    assert_eq!(d, vec![t4("GPU-aaa", 0, 0), t4("GPU-bbb", 1, 1)]);
    assert_eq!(encode_legacy(&d), nine);
    let seven = "GPU-ebe7c3f7-303d-558d-435e-99a160631fe4,10,7680,100,NVIDIA-Tesla P4,0,true:";
    let d = decode_node_devices(seven).unwrap();
    assert_eq!(
        d,
        vec![NodeDevice {
            id: "GPU-ebe7c3f7-303d-558d-435e-99a160631fe4".into(),
            index: 0,
            count: 10,
            devmem: 7680,
            devcore: 100,
            device_type: "NVIDIA-Tesla P4".into(),
            numa: 0,
            mode: "hami-core".into(),
            mig_profiles: vec![],
            health: true,
        }]
    );
}

// ---- contract §2.2 pair scores ------------------------------------------------------------------

#[test]
fn s2_2_pair_score_example_and_link_table() {
    let text = r#"[{"uuid":"GPU-a","score":{"GPU-b":300,"GPU-c":20}}]"#;
    let scores = decode_pair_scores(text).unwrap();
    assert_eq!(
        scores,
        vec![DevicePairScore {
            uuid: "GPU-a".into(),
            score: BTreeMap::from([("GPU-b".into(), 300), ("GPU-c".into(), 20)]),
        }]
    );
    assert_eq!(encode_pair_scores(&scores), text);
    let table = [
        (P2pLink::CrossCpu, 10),
        (P2pLink::SameCpu, 20),
        (P2pLink::HostBridge, 30),
        (P2pLink::MultiSwitch, 40),
        (P2pLink::SingleSwitch, 50),
        (P2pLink::SameBoard, 60),
        (P2pLink::NvLink(1), 100),
        (P2pLink::NvLink(18), 1800),
    ];
    for (link, score) in table {
        assert_eq!(link.score(), score, "{link:?}");
    }
    // GPU-b's 300 = 3 NVLinks.
    assert_eq!(P2pLink::NvLink(3).score(), 300);
}

// ---- contract §2.3 handshake --------------------------------------------------------------------

#[test]
fn s2_3_handshake_values() {
    assert_eq!(keys::NODE_HANDSHAKE, "hami.io/node-handshake");
    assert_eq!(
        Handshake::requesting("2025-06-13 09:07:40"),
        "Requesting_2025-06-13 09:07:40"
    );
    let h = Handshake::parse("Requesting_2025-06-13 09:07:40");
    assert_eq!(h, Handshake::Requesting("2025-06-13 09:07:40".into()));
    assert_eq!(h.encode(), "Requesting_2025-06-13 09:07:40");
    assert!(parse_go_datetime("2025-06-13 09:07:40").is_some());
    let reported = "Reported 2024-05-01 10:00:00.123456789 +0800 CST m=+30.001";
    assert_eq!(
        Handshake::parse(reported),
        Handshake::Reported("2024-05-01 10:00:00.123456789 +0800 CST m=+30.001".into())
    );
    assert_eq!(Handshake::parse(reported).encode(), reported);
    assert_eq!(
        Handshake::parse("Deleted_2025-06-13 09:07:40"),
        Handshake::Deleted("2025-06-13 09:07:40".into())
    );
    assert_eq!(Handshake::parse(""), Handshake::Other(String::new()));
}

// ---- contract §2.4 node lock --------------------------------------------------------------------

#[test]
fn s2_4_node_lock_values() {
    assert_eq!(keys::NODE_LOCK, "hami.io/mutex.lock");
    let v = "2025-06-13T09:07:40+08:00,default,gpu-pod-1";
    let lock = NodeLock::parse(v).unwrap();
    assert_eq!(
        lock,
        NodeLock::for_pod("2025-06-13T09:07:40+08:00", "default", "gpu-pod-1")
    );
    assert_eq!(lock.encode(), v);
    assert!(is_held_by(v, "default", "gpu-pod-1"));
    assert!(!is_held_by(v, "default", "gpu-pod-2"));
    let legacy = NodeLock::parse("2025-06-13T09:07:40+08:00").unwrap();
    assert_eq!(legacy.holder, None);
    assert_eq!(legacy.encode(), "2025-06-13T09:07:40+08:00");
}

// ---- contract §2.5 device cordon ----------------------------------------------------------------

#[test]
fn s2_5_device_cordon() {
    assert_eq!(keys::DEVICE_CORDON, "hami.io/device-cordon");
    assert_eq!(
        parse_device_cordon(" GPU-a , ,GPU-b,"),
        vec!["GPU-a", "GPU-b"]
    );
    assert!(parse_device_cordon("").is_empty());
}

// ---- contract §3.1 keys written by the scheduler and the plugin ---------------------------------

#[test]
fn s3_1_keys_and_values() {
    assert_eq!(keys::VGPU_NODE, "hami.io/vgpu-node");
    assert_eq!(keys::VGPU_TIME, "hami.io/vgpu-time");
    assert_eq!(
        keys::DEVICES_TO_ALLOCATE,
        "hami.io/vgpu-devices-to-allocate"
    );
    assert_eq!(keys::DEVICES_ALLOCATED, "hami.io/vgpu-devices-allocated");
    assert_eq!(keys::MIG_ALLOCATIONS, "hami.io/vgpu-mig-allocations");
    assert_eq!(keys::BIND_PHASE, "hami.io/bind-phase");
    assert_eq!(keys::BIND_TIME, "hami.io/bind-time");
    assert_eq!(
        [
            keys::BIND_PHASE_ALLOCATING,
            keys::BIND_PHASE_SUCCESS,
            keys::BIND_PHASE_FAILED
        ],
        ["allocating", "success", "failed"]
    );
    for k in keys::SCHEDULER_OWNED {
        assert!(keys::is_scheduler_owned(k));
    }
    assert!(!keys::is_scheduler_owned(keys::GPU_SCHEDULER_POLICY));
}

// ---- contract §3.2 container device list --------------------------------------------------------

fn dev(uuid: &str, mem: u32, cores: u32) -> ContainerDevice {
    ContainerDevice::nvidia(uuid, mem, cores)
}

#[test]
fn s3_2_device_list_table() {
    let rows: Vec<(&str, Vec<Vec<ContainerDevice>>)> = vec![
        (
            "GPU-8dcd427f-483b-b48f-d7e5-75fb19a52b76,NVIDIA,3000,30:;",
            vec![vec![dev(
                "GPU-8dcd427f-483b-b48f-d7e5-75fb19a52b76",
                3000,
                30,
            )]],
        ),
        (
            "GPU-aaa,NVIDIA,3000,30:GPU-bbb,NVIDIA,3000,30:;",
            vec![vec![dev("GPU-aaa", 3000, 30), dev("GPU-bbb", 3000, 30)]],
        ),
        (
            "GPU-aaa,NVIDIA,500,3:;GPU-bbb,NVIDIA,500,3:;",
            vec![vec![dev("GPU-aaa", 500, 3)], vec![dev("GPU-bbb", 500, 3)]],
        ),
        (
            ";GPU-aaa,NVIDIA,1000,30:;",
            vec![vec![], vec![dev("GPU-aaa", 1000, 30)]],
        ),
        (
            ";GPU-aaa,NVIDIA,1000,30:;;",
            vec![vec![], vec![dev("GPU-aaa", 1000, 30)], vec![]],
        ),
        (
            "GPU-aaa,NVIDIA,15360,100:;",
            vec![vec![dev("GPU-aaa", 15360, 100)]],
        ),
    ];
    for (text, want) in rows {
        let got = PodDevices::decode(text).unwrap();
        assert_eq!(got, PodDevices(want), "{text}");
        assert_eq!(got.encode(), text, "{text}");
    }
}

#[test]
fn s3_2_served_to_allocate_value_is_all_empty() {
    let before = PodDevices::decode("GPU-aaa,NVIDIA,3000,50:;").unwrap();
    assert!(!before.is_all_empty());
    // The plugin empties the served container: one empty entry, encoded `;`; HAMi writes `;;`.
    let served = PodDevices(vec![vec![]]);
    assert!(served.is_all_empty());
    assert!(PodDevices::decode(";;").unwrap().is_all_empty());
}

#[test]
fn s3_2_decoding_rules() {
    // Pieces without ',' are skipped; extra fields ignored; fewer than 4 fields is an error.
    assert_eq!(
        PodDevices::decode("junk:GPU-a,NVIDIA,1,2,extra:;").unwrap(),
        PodDevices(vec![vec![dev("GPU-a", 1, 2)]])
    );
    let err = PodDevices::decode("GPU-a,NVIDIA,1:;")
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("pod annotation format error"), "{err}");
    // The whole-card-by-percentage row: 100 % of a 15360 MiB card.
    assert_eq!(req(1, 0, 100, 100).memory_on(15360), 15360);
}

// ---- contract §3.3 user annotations -------------------------------------------------------------

fn annos(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).into(), (*v).into()))
        .collect()
}

#[test]
fn s3_3_annotation_examples() {
    let o = PodSchedulingOptions::from_annotations(&annos(&[
        ("nvidia.com/use-gpuuuid", "GPU-aaa,GPU-bbb"),
        ("nvidia.com/nouse-gpuuuid", "GPU-ccc"),
        ("nvidia.com/use-gputype", "A100,H100"),
        ("nvidia.com/nouse-gputype", "T4"),
        ("nvidia.com/vgpu-mode", "hami-core"),
        ("nvidia.com/numa-bind", "true"),
        ("hami.io/gpu-scheduler-policy", "binpack,numa"),
        ("hami.io/node-scheduler-policy", "spread"),
        ("hami.io/device-scoring-weights", "slot=1,core=1,memory=3"),
    ]))
    .unwrap();
    assert_eq!(o.use_uuid, ["GPU-aaa", "GPU-bbb"]);
    assert_eq!(o.nouse_uuid, ["GPU-ccc"]);
    assert_eq!(o.use_type, ["A100", "H100"]);
    assert_eq!(o.nouse_type, ["T4"]);
    assert_eq!(o.vgpu_mode.as_deref(), Some("hami-core"));
    assert!(o.numa_bind);
    assert_eq!(
        o.gpu_policy,
        Some(GpuPolicyChain(vec![GpuPolicy::Binpack, GpuPolicy::Numa]))
    );
    assert_eq!(o.node_policy, Some(NodePolicy::Spread));
    assert_eq!(
        o.scoring_weights,
        ScoringWeights {
            slot: 1,
            core: 1,
            memory: 3
        }
    );
    assert!(o.warnings.is_empty());
    assert!(o.uuid_allowed("GPU-aaa") && !o.uuid_allowed("GPU-ccc") && !o.uuid_allowed("GPU-ddd"));
    assert!(o.type_allowed("NVIDIA A100-SXM4-40GB") && o.type_allowed("nvidia-h100"));
    assert!(!o.type_allowed("NVIDIA-Tesla T4"));
    assert!(o.mode_allowed("hami-core") && !o.mode_allowed("mig"));
}

#[test]
fn s3_3_empty_uuid_list_is_no_constraint() {
    let o =
        PodSchedulingOptions::from_annotations(&annos(&[("nvidia.com/use-gpuuuid", "")])).unwrap();
    assert!(o.uuid_allowed("GPU-anything"));
    assert_eq!(
        PodSchedulingOptions::from_annotations(&BTreeMap::new()).unwrap(),
        PodSchedulingOptions::default()
    );
}

#[test]
fn s3_3_numa_bind_go_bool_values() {
    for v in ["1", "t", "T", "TRUE", "true", "True"] {
        let o =
            PodSchedulingOptions::from_annotations(&annos(&[("nvidia.com/numa-bind", v)])).unwrap();
        assert!(o.numa_bind, "{v}");
    }
    let o =
        PodSchedulingOptions::from_annotations(&annos(&[("nvidia.com/numa-bind", "yes")])).unwrap();
    assert!(!o.numa_bind);
    assert_eq!(
        o.warnings,
        vec![AnnotationWarning::InvalidNumaBind {
            value: "yes".into()
        }]
    );
}

#[test]
fn s3_3_gpu_policies() {
    for p in ["binpack", "spread", "topology-aware", "mutex", "numa"] {
        let chain = GpuPolicyChain::parse(p).unwrap();
        assert_eq!(chain.0.len(), 1);
        assert_eq!(chain.to_string(), p);
    }
    let err = GpuPolicyChain::parse("binpack,bogus")
        .unwrap_err()
        .to_string();
    assert!(err.contains("\"bogus\""), "{err}");
}

#[test]
fn s3_3_node_policy_other_values_behave_as_binpack() {
    let o = PodSchedulingOptions::from_annotations(&annos(&[(
        "hami.io/node-scheduler-policy",
        "fastest",
    )]))
    .unwrap();
    assert_eq!(o.node_policy, Some(NodePolicy::Binpack));
    assert_eq!(
        o.warnings,
        vec![AnnotationWarning::UnknownNodePolicy {
            value: "fastest".into()
        }]
    );
    let o = PodSchedulingOptions::from_annotations(&annos(&[(
        "hami.io/node-scheduler-policy",
        "binpack",
    )]))
    .unwrap();
    assert!(o.warnings.is_empty());
}

#[test]
fn s3_3_scoring_weights_rules() {
    assert_eq!(
        ScoringWeights::default(),
        ScoringWeights {
            slot: 1,
            core: 1,
            memory: 1
        }
    );
    assert_eq!(
        ScoringWeights::parse(" memory = 3 , slot=0,core=+2").unwrap(),
        ScoringWeights {
            slot: 0,
            core: 2,
            memory: 3
        }
    );
    let bad = [
        ("slot=1,core=1", "expected slot, core, and memory weights"),
        (
            "slot=1,core=1,memory=1,slot=1",
            "expected slot, core, and memory weights",
        ),
        ("slot=1,core=1,memory", "expected key=value entries"),
        ("slot=1,slot=1,memory=1", "duplicate \"slot\" weight"),
        (
            "slot=1,core=x,memory=1",
            "\"core\" weight must be an integer",
        ),
        (
            "slot=1,core=1.5,memory=1",
            "\"core\" weight must be an integer",
        ),
        (
            "slot=1,core=-1,memory=1",
            "\"core\" weight must not be negative",
        ),
        ("slot=1,gpu=1,memory=1", "unknown weight \"gpu\""),
        ("slot=1,gpu=x,memory=1", "\"gpu\" weight must be an integer"),
        (
            "slot=1,gpu=-1,memory=1",
            "\"gpu\" weight must not be negative",
        ),
        (
            "slot=0,core=0,memory=0",
            "at least one weight must be positive",
        ),
        ("", "expected slot, core, and memory weights"),
    ];
    for (v, problem) in bad {
        let err = ScoringWeights::parse(v).unwrap_err().to_string();
        assert_eq!(
            err,
            format!("invalid hami.io/device-scoring-weights annotation {v:?}: {problem}"),
            "{v}"
        );
        assert!(
            PodSchedulingOptions::from_annotations(&annos(&[(
                "hami.io/device-scoring-weights",
                v
            )]))
            .is_err(),
            "{v}"
        );
    }
}

#[test]
fn s3_3_labels_and_env() {
    assert_eq!(keys::WEBHOOK_IGNORE_LABEL, "hami.io/webhook");
    assert_eq!(keys::SCHEDULER_ROLE_LABEL, "hami.io/scheduler-role");
}

// ---- contract §7 webhook denials and env --------------------------------------------------------

#[test]
fn s7_webhook_errors() {
    let d = NvidiaConfig::default();
    let err = webhook_mutation(&container(&[(GPU, "1"), (PCT, "150")]), &d).unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid nvidia.com/gpumem-percentage value 150 in container main: must be an integer between 0 and 100"
    );
    assert!(matches!(
        webhook_mutation(&container(&[(GPU, "1"), (PCT, "-1")]), &d),
        Err(RequestError::PercentageOutOfRange { .. })
    ));
    assert!(webhook_mutation(&container(&[(GPU, "1"), (PCT, "0")]), &d).is_ok());
    assert!(matches!(
        webhook_mutation(&container(&[(GPU, "1"), (CORES, "101")]), &d),
        Err(RequestError::CoresOutOfRange { .. })
    ));
    let err = webhook_mutation(&container(&[(GPU, "1"), (MEM, "16Gi")]), &d).unwrap_err();
    assert!(matches!(err, RequestError::MemoryNotMib { .. }));
    assert!(err.to_string().contains("16384"), "{err}");
}

#[test]
fn s7_priority_env() {
    let m = webhook_mutation(
        &container(&[(GPU, "1"), (PRIO, "1")]),
        &NvidiaConfig::default(),
    )
    .unwrap();
    assert_eq!(
        m.add_env,
        vec![("CUDA_TASK_PRIORITY".to_owned(), "1".to_owned())]
    );
    // Only a priority *limit* counts.
    let mut c = container(&[(GPU, "1")]);
    c.requests.insert(PRIO.into(), "0".into());
    assert!(
        webhook_mutation(&c, &NvidiaConfig::default())
            .unwrap()
            .add_env
            .is_empty()
    );
}

#[test]
fn s7_count_only_in_requests_with_gpumem_is_not_detected() {
    let mut c = container(&[(MEM, "3000")]);
    c.limits.clear();
    c.requests.insert(GPU.into(), "1".into());
    c.requests.insert(MEM.into(), "3000".into());
    let m = webhook_mutation(&c, &NvidiaConfig::default()).unwrap();
    assert!(!m.has_resource);
    // …whereas count in requests alone triggers exclusive-core defaulting.
    let mut c = ContainerResources::default();
    c.requests.insert(GPU.into(), "1".into());
    let m = webhook_mutation(&c, &NvidiaConfig::default()).unwrap();
    assert!(m.has_resource);
    assert_eq!(m.add_limits, vec![(CORES.to_owned(), "100".to_owned())]);
}

// ---- contract §5.7 quota request at admission ---------------------------------------------------

#[test]
fn s5_7_pod_quota_request_is_max_of_app_sum_and_largest_init() {
    use hami_contract::request::{QuotaRequest, resolve_pod};
    let d = NvidiaConfig::default();
    let init = [container(&[(GPU, "1"), (MEM, "8000"), (CORES, "10")])];
    let app = [
        container(&[(GPU, "2"), (MEM, "3000"), (CORES, "20")]),
        container(&[(GPU, "1"), (PCT, "50")]),
        container(&[]),
    ];
    let p = resolve_pod(&init, &app, &d);
    assert!(!p.is_empty());
    assert_eq!(
        p.quota_request(),
        QuotaRequest {
            memory: 8000,
            cores: 40
        }
    );
    assert!(resolve_pod(&[], &[container(&[])], &d).is_empty());
    // Keys the quota is read from.
    assert_eq!(
        d.resources.quota_keys(),
        (
            "limits.nvidia.com/gpumem".to_owned(),
            "limits.nvidia.com/gpucores".to_owned()
        )
    );
}

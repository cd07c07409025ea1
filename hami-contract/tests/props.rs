//! Property tests: every codec round-trips, and no decoder panics on arbitrary input.

use std::collections::BTreeMap;

use hami_contract::config::{DeviceConfig, NodeConfigFile, NvidiaConfig};
use hami_contract::devices::{ContainerDevice, PodDevices};
use hami_contract::handshake::{Handshake, format_go_datetime, parse_go_datetime};
use hami_contract::identity::AllocationSignature;
use hami_contract::node::{
    NodeDevice, decode_json, decode_legacy, decode_node_devices, encode_legacy, encode_node_devices,
};
use hami_contract::nodelock::NodeLock;
use hami_contract::policy::{
    GpuPolicy, GpuPolicyChain, PodSchedulingOptions, ScoringWeights, parse_device_cordon,
};
use hami_contract::quantity;
use hami_contract::request::{
    ContainerResources, resolve_container, resolve_pod, webhook_mutation,
};
use hami_contract::usage::collapse_pod_usage;
use proptest::prelude::*;

/// Numbers HAMi's int32 fields can hold.
fn int32() -> impl Strategy<Value = u32> {
    prop_oneof![0u32..=100, 0u32..=100_000, 0u32..=(i32::MAX as u32)]
}

/// A string without the device list's separators.
fn field() -> impl Strategy<Value = String> {
    "[^,:;]{0,12}"
}

fn container_device() -> impl Strategy<Value = ContainerDevice> {
    (field(), field(), int32(), int32()).prop_map(|(uuid, vendor, usedmem, usedcores)| {
        ContainerDevice {
            uuid,
            vendor,
            usedmem,
            usedcores,
        }
    })
}

fn pod_devices() -> impl Strategy<Value = PodDevices> {
    prop::collection::vec(prop::collection::vec(container_device(), 0..4), 0..5)
        .prop_map(PodDevices)
}

fn json_node_device() -> impl Strategy<Value = NodeDevice> {
    (
        ".{0,16}",
        int32(),
        int32(),
        int32(),
        int32(),
        ".{0,16}",
        int32(),
        ".{0,8}",
        any::<bool>(),
        prop::option::of((".{0,6}", 0u32..100_000)),
    )
        .prop_map(|(id, index, count, devmem, devcore, device_type, numa, mode, health, mig)| NodeDevice {
            id,
            index,
            count,
            devmem,
            devcore,
            device_type,
            numa,
            mode,
            mig_profiles: mig
                .map(|(name, mem)| {
                    vec![serde_json::json!({"name": name, "memoryMB": mem, "core": 15, "sliceCount": 1,
                                             "placements": [{"start": 6, "size": 1}]})]
                })
                .unwrap_or_default(),
            health,
        })
}

fn legacy_node_device() -> impl Strategy<Value = NodeDevice> {
    (
        field(),
        any::<u32>(),
        any::<u32>(),
        any::<u32>(),
        field(),
        any::<u32>(),
        any::<bool>(),
        any::<u32>(),
        field(),
    )
        .prop_map(
            |(id, count, devmem, devcore, device_type, numa, health, index, mode)| NodeDevice {
                id,
                index,
                count,
                devmem,
                devcore,
                device_type,
                numa,
                mode,
                mig_profiles: vec![],
                health,
            },
        )
}

fn gpu_policy() -> impl Strategy<Value = GpuPolicy> {
    prop::sample::select(GpuPolicy::ALL.to_vec())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn device_list_round_trips(p in pod_devices()) {
        let text = p.encode();
        prop_assert_eq!(PodDevices::decode(&text).unwrap(), p);
    }

    #[test]
    fn device_list_decoder_never_panics(s in ".{0,64}", t in "[A-Z0-9,:;-]{0,40}") {
        let _ = PodDevices::decode(&s);
        if let Ok(p) = PodDevices::decode(&t) {
            // Whatever decodes re-encodes to something that decodes to the same value.
            prop_assert_eq!(PodDevices::decode(&p.encode()).unwrap(), p);
        }
    }

    #[test]
    fn node_register_json_round_trips(d in prop::collection::vec(json_node_device(), 0..4)) {
        let text = encode_node_devices(&d);
        prop_assert_eq!(decode_node_devices(&text).unwrap(), d.clone());
        prop_assert_eq!(encode_node_devices(&decode_json(&text).unwrap()), text);
    }

    #[test]
    fn node_register_legacy_round_trips(d in prop::collection::vec(legacy_node_device(), 1..4)) {
        let text = encode_legacy(&d);
        prop_assert_eq!(decode_legacy(&text).unwrap(), d);
    }

    #[test]
    fn node_register_decoders_never_panic(s in ".{0,80}", t in r#"[\[\]{}":,0-9a-z ]{0,60}"#) {
        let _ = decode_node_devices(&s);
        let _ = decode_node_devices(&t);
        let _ = decode_legacy(&s);
        let _ = decode_json(&t);
    }

    #[test]
    fn handshake_round_trips(t in ".{0,30}", kind in 0u8..4) {
        let h = match kind {
            0 => Handshake::Requesting(t),
            1 if !t.contains("Requesting") => Handshake::Deleted(t),
            2 if !t.contains("Requesting") && !t.contains("Deleted") => Handshake::Reported(t),
            3 if !t.contains("Requesting") && !t.contains("Deleted") && !t.starts_with("Reported") => Handshake::Other(t),
            _ => return Ok(()),
        };
        prop_assert_eq!(Handshake::parse(&h.encode()), h);
    }

    #[test]
    fn handshake_parse_never_panics_and_reencodes_stably(s in ".{0,40}") {
        let h = Handshake::parse(&s);
        prop_assert_eq!(Handshake::parse(&h.encode()), h);
    }

    #[test]
    fn go_datetime_round_trips(secs in -62_167_219_200i64..=253_402_300_799i64) {
        let text = format_go_datetime(secs);
        prop_assert_eq!(parse_go_datetime(&text), Some(secs));
        prop_assert_eq!(Handshake::parse(&Handshake::requesting(&text)), Handshake::Requesting(text));
    }

    #[test]
    fn go_datetime_never_panics(s in ".{0,24}", t in "[0-9]{4}-[0-9]{2}-[0-9]{2} [0-9]{2}:[0-9]{2}:[0-9]{2}") {
        let _ = parse_go_datetime(&s);
        if let Some(secs) = parse_go_datetime(&t) {
            prop_assert_eq!(format_go_datetime(secs), t);
        }
    }

    #[test]
    fn policy_chain_round_trips(chain in prop::collection::vec(gpu_policy(), 1..6)) {
        let c = GpuPolicyChain(chain);
        prop_assert_eq!(GpuPolicyChain::parse(&c.to_string()).unwrap(), c.clone());
        // Whitespace and empty items are tolerated.
        let spaced = c.0.iter().map(|p| format!(" {p} ")).collect::<Vec<_>>().join(",,");
        prop_assert_eq!(GpuPolicyChain::parse(&spaced).unwrap(), c);
    }

    #[test]
    fn scoring_weights_round_trip(slot in any::<u32>(), core in any::<u32>(), memory in any::<u32>(), rot in 0usize..3) {
        prop_assume!(slot != 0 || core != 0 || memory != 0);
        let w = ScoringWeights { slot, core, memory };
        prop_assert_eq!(ScoringWeights::parse(&w.to_string()).unwrap(), w);
        let mut parts = [format!("slot={slot}"), format!(" core = {core} "), format!("memory={memory}")];
        parts.rotate_left(rot);
        prop_assert_eq!(ScoringWeights::parse(&parts.join(",")).unwrap(), w);
    }

    #[test]
    fn annotation_parsers_never_panic(keys in prop::collection::vec(0usize..11, 0..6), values in prop::collection::vec(".{0,24}", 6)) {
        const KEYS: [&str; 11] = [
            "nvidia.com/use-gpuuuid", "nvidia.com/nouse-gpuuuid", "nvidia.com/use-gputype", "nvidia.com/nouse-gputype",
            "nvidia.com/vgpu-mode", "nvidia.com/numa-bind", "hami.io/gpu-scheduler-policy", "hami.io/node-scheduler-policy",
            "hami.io/device-scoring-weights", "hami.io/device-cordon", "other",
        ];
        let a: BTreeMap<String, String> = keys.iter().zip(&values).map(|(k, v)| (KEYS[*k].to_owned(), v.clone())).collect();
        if let Ok(o) = PodSchedulingOptions::from_annotations(&a) {
            let _ = (o.uuid_allowed("GPU-a"), o.type_allowed("NVIDIA-Tesla T4"), o.mode_allowed("hami-core"));
        }
        for v in &values {
            let _ = GpuPolicyChain::parse(v);
            let _ = ScoringWeights::parse(v);
            let _ = parse_device_cordon(v);
            let _ = NodeLock::parse(v);
        }
    }

    #[test]
    fn node_lock_round_trips(time in "[0-9T:+-]{1,25}", ns in "[a-z0-9-]{0,10}", name in "[a-z0-9.-]{0,12}") {
        let lock = NodeLock::for_pod(&time, &ns, &name);
        prop_assert_eq!(NodeLock::parse(&lock.encode()), Some(lock));
    }

    #[test]
    fn quantity_never_panics(s in ".{0,20}", t in "[+-]?[0-9]{0,25}(\\.[0-9]{0,25})?([eE][+-]?[0-9]{1,4}|[KMGTPE]i|[numkMGTPE])?") {
        let _ = quantity::parse(&s);
        if let Ok(q) = quantity::parse(&t) {
            let _ = (q.as_integer(), q.ceil(), q.to_string());
        }
    }

    #[test]
    fn quantity_plain_integers_are_exact(v in any::<i64>()) {
        let q = quantity::parse(&v.to_string()).unwrap();
        prop_assert_eq!(q.as_integer(), Some(i128::from(v)));
        prop_assert!(q.is_plain_integer());
    }

    #[test]
    fn config_decoders_never_panic(s in ".{0,80}", y in "nvidia:\n  [a-zA-Z]{1,12}: [a-z0-9.\\-\"\\[\\]{}]{0,10}\n") {
        let _ = DeviceConfig::from_yaml(&s);
        let _ = DeviceConfig::from_yaml(&y);
        let _ = NodeConfigFile::from_json(&s);
    }

    #[test]
    fn request_resolution_never_panics_and_respects_the_sentinel(
        vals in prop::collection::vec(prop_oneof![".{0,10}", "[0-9]{1,12}", "-?[0-9]{1,4}(\\.[0-9])?(Gi|Mi|k|m)?"], 5),
        present in prop::collection::vec(any::<bool>(), 5),
        factor in 0u32..5,
        default_memory in prop_oneof![Just(0u32), 1u32..100_000],
    ) {
        let names = ["nvidia.com/gpu", "nvidia.com/gpumem", "nvidia.com/gpumem-percentage", "nvidia.com/gpucores", "nvidia.com/priority"];
        let mut c = ContainerResources { name: "c".into(), ..Default::default() };
        for ((n, v), p) in names.iter().zip(&vals).zip(&present) {
            if *p { c.limits.insert((*n).to_owned(), v.clone()); } else { c.requests.insert((*n).to_owned(), v.clone()); }
        }
        let cfg = NvidiaConfig { memory_factor: factor, default_memory, ..Default::default() };
        let r = resolve_container(&c, &cfg);
        if let Some(req) = &r.request {
            prop_assert!(req.nums >= 1);
            prop_assert!(req.mem_percentage_req <= 101 && req.mem_percentage_req >= 1);
            // Something is always booked: memory, or a percentage.
            prop_assert!(req.memreq > 0 || req.mem_percentage_req != 101);
            prop_assert!(req.memory_on(u32::MAX) >= req.memreq.min(1));
        }
        let _ = webhook_mutation(&c, &cfg);
        let _ = resolve_pod(std::slice::from_ref(&c), &[c.clone()], &cfg);
    }

    #[test]
    fn usage_collapse_bounds(p in pod_devices(), init in 0usize..6, done in any::<bool>()) {
        let u = collapse_pod_usage(&p, init, done);
        for d in &u {
            prop_assert!(d.slots >= 1);
        }
        if !done {
            // Every GPU in the list is booked.
            let distinct: std::collections::BTreeSet<_> = p.0.iter().flatten().map(|d| (&d.vendor, &d.uuid)).collect();
            prop_assert_eq!(u.len(), distinct.len());
        }
    }

    #[test]
    fn signature_relations(a in pod_devices(), b in pod_devices()) {
        let none = BTreeMap::new();
        let sa = AllocationSignature::new(&a, &none);
        let sb = AllocationSignature::new(&b, &none);
        prop_assert_eq!(sa.confusable_with(&sb), sb.confusable_with(&sa));
        prop_assert_eq!(sa.interchangeable_with(&sb), sb.interchangeable_with(&sa));
        if sa.interchangeable_with(&sb) {
            // Interchangeable pods get the same GPUs and limits from either entry.
            prop_assert_eq!(&sa, &sb);
        }
        if !sa.counts.is_empty() {
            prop_assert!(sa.confusable_with(&sa));
        }
        if sa.interchangeable_with(&sb) && !sa.counts.is_empty() {
            prop_assert!(sa.confusable_with(&sb));
        }
    }
}

//! User annotations (contract §3.3, §2.5) and the node lock (contract §2.4): never panic; the policy
//! chain and scoring weights re-encode to themselves.
#![no_main]

use std::collections::BTreeMap;

use hami_contract::devices::PodDevices;
use hami_contract::identity::AllocationSignature;
use hami_contract::nodelock::NodeLock;
use hami_contract::policy::{
    GpuPolicyChain, PodSchedulingOptions, ScoringWeights, parse_device_cordon,
};
use libfuzzer_sys::fuzz_target;

const KEYS: [&str; 10] = [
    "nvidia.com/use-gpuuuid",
    "nvidia.com/nouse-gpuuuid",
    "nvidia.com/use-gputype",
    "nvidia.com/nouse-gputype",
    "nvidia.com/vgpu-mode",
    "nvidia.com/numa-bind",
    "hami.io/gpu-scheduler-policy",
    "hami.io/node-scheduler-policy",
    "hami.io/device-scoring-weights",
    "hami.io/device-cordon",
];

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    // One value per line; the first byte of each line picks the key (`0`..`9` in order).
    let mut annotations = BTreeMap::new();
    for line in text.split('\n') {
        let key = KEYS[line
            .bytes()
            .next()
            .map_or(0, |b| usize::from(b) % KEYS.len())];
        let value = line.get(1..).unwrap_or("");
        annotations.insert(key.to_owned(), value.to_owned());

        if let Ok(chain) = GpuPolicyChain::parse(value) {
            assert_eq!(
                GpuPolicyChain::parse(&chain.to_string()).expect("re-parses"),
                chain
            );
        }
        if let Ok(w) = ScoringWeights::parse(value) {
            assert_eq!(ScoringWeights::parse(&w.to_string()).expect("re-parses"), w);
        }
        for uuid in parse_device_cordon(value) {
            assert!(!uuid.is_empty() && uuid.trim() == uuid);
        }
        if let Some(lock) = NodeLock::parse(value) {
            assert_eq!(NodeLock::parse(&lock.encode()), Some(lock));
        }
    }
    if let Ok(o) = PodSchedulingOptions::from_annotations(&annotations) {
        let _ = (
            o.uuid_allowed("GPU-a"),
            o.type_allowed("NVIDIA-Tesla T4"),
            o.mode_allowed("mig"),
        );
    }
    let devices = PodDevices::decode(&text).unwrap_or_default();
    let sig = AllocationSignature::new(&devices, &annotations);
    assert!(sig.interchangeable_with(&sig));
});

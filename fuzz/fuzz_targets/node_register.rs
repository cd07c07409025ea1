//! `hami.io/node-nvidia-register` (contract §2.1) in both formats, and the pair-score
//! annotation (contract §2.2): never panic; decoded values re-encode and decode to themselves.
#![no_main]

use hami_contract::node::{
    decode_legacy, decode_node_devices, decode_pair_scores, encode_legacy, encode_node_devices,
    encode_pair_scores,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Ok(devices) = decode_node_devices(&text) {
        let json = encode_node_devices(&devices);
        assert_eq!(
            decode_node_devices(&json).expect("encoded JSON decodes"),
            devices
        );
        if !text.trim_start().starts_with('[') {
            // Legacy fields cannot contain ',' or ':', so the legacy text round-trips too.
            let legacy = encode_legacy(&devices);
            if !devices.is_empty() {
                assert_eq!(
                    decode_legacy(&legacy).expect("encoded legacy decodes"),
                    devices
                );
            }
        }
    }
    if let Ok(scores) = decode_pair_scores(&text) {
        let again =
            decode_pair_scores(&encode_pair_scores(&scores)).expect("encoded scores decode");
        assert_eq!(again, scores);
    }
});

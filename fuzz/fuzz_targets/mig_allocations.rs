//! Dynamic MIG (contract §6.4): `hami.io/vgpu-mig-allocations` (any pod author's input reaches
//! the decoder through a pod the webhook never saw) and the `migProfiles` of a register
//! annotation: never panic; what decodes re-encodes to itself.
#![no_main]

use hami_contract::mig::{decode_allocations, decode_profiles, encode_allocations, encode_profiles};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Ok(list) = decode_allocations(&text) {
        let again = encode_allocations(&list);
        assert_eq!(decode_allocations(&again).ok(), Some(list));
    }
    if let Ok(serde_json::Value::Array(values)) = serde_json::from_str::<serde_json::Value>(&text)
        && let Ok(profiles) = decode_profiles(&values)
    {
        assert_eq!(decode_profiles(&encode_profiles(&profiles)).ok(), Some(profiles));
    }
});

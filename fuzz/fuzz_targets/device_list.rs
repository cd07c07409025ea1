//! `PodDevices::decode` (contract §3.2) on arbitrary text: never panics, and whatever decodes
//! re-encodes to a value that decodes to the same thing.
#![no_main]

use hami_contract::devices::PodDevices;
use hami_contract::usage::collapse_pod_usage;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Ok(devices) = PodDevices::decode(&text) {
        let again = PodDevices::decode(&devices.encode()).expect("an encoded list decodes");
        assert_eq!(again, devices);
        let _ = devices.is_all_empty();
        let _ = devices.of_vendor("NVIDIA");
        let init = data.first().map_or(0, |b| usize::from(*b % 4));
        for done in [false, true] {
            for u in collapse_pod_usage(&devices, init, done) {
                assert!(u.slots >= 1);
            }
        }
    }
});

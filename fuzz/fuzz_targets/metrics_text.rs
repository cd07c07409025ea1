//! A Prometheus text exposition as `kubectl tessera top` reads it from a device plugin, through
//! a port-forward: never panics, and every sample it returns has a name and only named labels.
#![no_main]

use hami_contract::metrics::samples;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let (got, malformed) = samples(&text);
    assert!(got.len() + malformed <= text.lines().count());
    for s in &got {
        assert!(!s.name.is_empty());
        assert!(s.labels.iter().all(|(k, _)| !k.is_empty()));
    }
});

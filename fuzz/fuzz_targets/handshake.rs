//! `hami.io/node-handshake` (contract §2.3) and Go's DateTime: never panic; parse∘encode is
//! stable; a parsed time formats back to the same text.
#![no_main]

use hami_contract::handshake::{Handshake, format_go_datetime, parse_go_datetime};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let h = Handshake::parse(&text);
    assert_eq!(Handshake::parse(&h.encode()), h);
    let _ = h.requesting_expired(i64::MAX);
    let _ = h.requesting_expired(i64::MIN);
    if let Some(secs) = parse_go_datetime(&text) {
        assert_eq!(format_go_datetime(secs), text);
    }
    if data.len() >= 8 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&data[..8]);
        let s = format_go_datetime(i64::from_le_bytes(b));
        assert!(parse_go_datetime(&s).is_some(), "{s}");
    }
});

//! The shim's shared-region file as the privileged device plugin reads it
//! (`vgpu_region::RegionSnapshot::parse`): the bytes are written by the container, so any content
//! must decode or be refused, never panic. The region is 2 MB and libFuzzer's inputs are small, so
//! an input is laid over a zeroed region: its first byte picks the length and whether the header
//! is valid, the rest goes to the header, the process count and the first process slots.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vgpu_region::{FILE_SIZE, MAX_DEVICES, MAX_PROCS, REGION_SIZE, RegionSnapshot, offset};

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let len = match flags & 0b110 {
        0b000 | 0b110 => FILE_SIZE,
        0b010 => REGION_SIZE,
        // Short files (truncated, or still being created).
        _ => rest
            .get(..2)
            .map_or(0, |b| usize::from(u16::from_le_bytes([b[0], b[1]])) * 31)
            .min(FILE_SIZE),
    };
    // One zeroed file reused across runs (a fresh 2 MB buffer per run is slow under ASan); the
    // ranges written are zeroed again afterwards.
    BUF.with_borrow_mut(|buf| {
        if buf.len() != FILE_SIZE {
            *buf = vec![0u8; FILE_SIZE];
        }
        let mut written = Vec::new();
        // Header (magic, versions, device count, UUIDs, limits): the input's first bytes.
        let head = rest.len().min(offset::PROCS).min(len);
        buf[..head].copy_from_slice(&rest[..head]);
        written.push(0..head);
        if flags & 1 != 0 && len >= 12 {
            buf[0..4].copy_from_slice(&vgpu_region::MAGIC.to_ne_bytes());
            buf[4..8].copy_from_slice(&vgpu_region::MAJOR_VERSION.to_ne_bytes());
            written.push(0..8);
        }
        // The same bytes again over the process slots and the tail (proc_num, switches, times).
        for at in [offset::PROCS, offset::PROC_NUM] {
            if at < len {
                let n = rest.len().min(len - at);
                buf[at..at + n].copy_from_slice(&rest[..n]);
                written.push(at..at + n);
            }
        }
        if offset::PROC_NUM + 4 <= len {
            // Mostly a few process slots (decoding all 1024 is slow under ASan); sometimes the
            // input's own count, or a huge one (clamped by the parser).
            let n = match flags >> 6 {
                0 | 1 => i32::from(flags & 7),
                2 => i32::MAX,
                _ => i32_from(rest),
            };
            buf[offset::PROC_NUM..offset::PROC_NUM + 4].copy_from_slice(&n.to_ne_bytes());
            written.push(offset::PROC_NUM..offset::PROC_NUM + 4);
        }
        check(&buf[..len]);
        for r in written {
            buf[r].fill(0);
        }
    });
});

thread_local! {
    static BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn i32_from(b: &[u8]) -> i32 {
    b.get(..4)
        .and_then(|s| s.try_into().ok())
        .map_or(0, i32::from_ne_bytes)
}

fn check(buf: &[u8]) {
    let len = buf.len();
    match RegionSnapshot::parse(buf) {
        Ok(s) => {
            assert!(len >= REGION_SIZE);
            assert!(s.procs.len() <= MAX_PROCS);
            assert_eq!(s.uuids.len(), MAX_DEVICES);
            for d in 0..=MAX_DEVICES {
                let _ = s.device_usage(d);
            }
            let _ = s.live_procs().count();
        }
        Err(e) => assert!(!e.to_string().is_empty()),
    }
}

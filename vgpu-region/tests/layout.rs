//! Pins every offset of HAMi-core's `shared_region_t` (core contract §4.2: computed with
//! `offsetof` on x86_64 glibc, and checked by HAMi's Go test
//! `TestSharedRegionTLayoutMatchesCABI`).

use proptest::prelude::*;
use vgpu_region::*;

#[test]
fn header_offsets_match_hami_core() {
    assert_eq!(REGION_SIZE, 2_008_952);
    assert_eq!(FILE_SIZE, 2_008_953);
    assert_eq!(MAGIC, 0x012F_F74E);
    assert_eq!((MAJOR_VERSION, MINOR_VERSION), (1, 2));
    assert_eq!(offset::INITIALIZED_FLAG, 0);
    assert_eq!(offset::MAJOR_VERSION, 4);
    assert_eq!(offset::MINOR_VERSION, 8);
    assert_eq!(offset::SM_INIT_FLAG, 12);
    assert_eq!(offset::OWNER_PID, 16);
    assert_eq!(offset::SEM, 24);
    assert_eq!(offset::DEVICE_NUM, 56);
    assert_eq!(offset::UUIDS, 64);
    assert_eq!(offset::LIMIT, offset::UUIDS + MAX_DEVICES * UUID_LEN);
    assert_eq!(offset::LIMIT, 1600);
    assert_eq!(offset::SM_LIMIT, 1728);
    assert_eq!(offset::PROCS, 1856);
    assert_eq!(offset::PROC_NUM, offset::PROCS + MAX_PROCS * slot::SIZE);
    assert_eq!(offset::PROC_NUM, 2_008_896);
    assert_eq!(offset::UTILIZATION_SWITCH, 2_008_900);
    assert_eq!(offset::RECENT_KERNEL, 2_008_904);
    assert_eq!(offset::PRIORITY, 2_008_908);
    assert_eq!(offset::LAST_KERNEL_TIME, 2_008_912);
    assert_eq!(offset::SEM_POSTINIT, 2_008_920);
    assert_eq!(offset::SEM_POSTINIT + 32, REGION_SIZE);
}

#[test]
fn slot_offsets_match_hami_core() {
    assert_eq!(slot::SIZE, 1960);
    assert_eq!(slot::PID, 0);
    assert_eq!(slot::HOSTPID, 4);
    assert_eq!(slot::USED, 8);
    assert_eq!(slot::DEVICE_MEMORY_SIZE, 64);
    assert_eq!(
        [
            slot::MEM_CONTEXT_SIZE,
            slot::MEM_MODULE_SIZE,
            slot::MEM_DATA_SIZE,
            slot::MEM_OFFSET,
            slot::MEM_TOTAL
        ],
        [0, 8, 16, 24, 32]
    );
    assert_eq!(slot::MONITORUSED, 1032);
    assert_eq!(slot::DEVICE_UTIL, 1160);
    assert_eq!(slot::DEVICE_UTIL_SIZE, 48);
    assert_eq!(slot::UTIL_SM, 16);
    assert_eq!(slot::STATUS, 1928);
    assert_eq!(slot::SEQLOCK, 1936);
    assert_eq!(slot::UNUSED, 1944);
    assert_eq!(slot::UNUSED + 16, slot::SIZE);
    assert_eq!(slot::base(1), 1856 + 1960);
    assert_eq!(slot::mem(3, slot::MEM_TOTAL), 8 + 3 * 64 + 32);
}

fn put_u64(b: &mut [u8], off: usize, v: u64) {
    b[off..off + 8].copy_from_slice(&v.to_ne_bytes());
}
fn put_i32(b: &mut [u8], off: usize, v: i32) {
    b[off..off + 4].copy_from_slice(&v.to_ne_bytes());
}

fn sample_region() -> Vec<u8> {
    let mut b = vec![0u8; FILE_SIZE];
    put_i32(&mut b, offset::INITIALIZED_FLAG, MAGIC);
    put_i32(&mut b, offset::MAJOR_VERSION, 1);
    put_i32(&mut b, offset::MINOR_VERSION, 2);
    put_u64(&mut b, offset::DEVICE_NUM, 2);
    b[offset::UUIDS..offset::UUIDS + 8].copy_from_slice(b"GPU-abcd");
    put_u64(&mut b, offset::LIMIT, 1 << 30);
    put_u64(&mut b, offset::SM_LIMIT, 30);
    put_i32(&mut b, offset::PROC_NUM, 3);
    put_i32(&mut b, offset::PRIORITY, 1);
    for (i, (pid, status, total)) in [(10, 1, 100u64), (11, 0, 1000), (12, 2, 5)]
        .into_iter()
        .enumerate()
    {
        let base = slot::base(i);
        put_i32(&mut b, base + slot::PID, pid);
        put_i32(&mut b, base + slot::STATUS, status);
        put_u64(&mut b, base + slot::mem(0, slot::MEM_TOTAL), total);
        put_u64(&mut b, base + slot::mem(0, slot::MEM_DATA_SIZE), total);
    }
    b
}

#[test]
fn parses_a_region_and_counts_like_the_monitor() {
    let snap = RegionSnapshot::parse(&sample_region()).expect("valid region");
    assert_eq!(snap.device_num, 2);
    assert_eq!(snap.uuids[0], "GPU-abcd");
    assert_eq!(snap.uuids[1], "");
    assert_eq!(snap.limit[0], 1 << 30);
    assert_eq!(snap.sm_limit[0], 30);
    assert_eq!(snap.procs.len(), 3);
    // The exited slot (status 0) is skipped, as HAMi's monitor does.
    assert_eq!(snap.device_usage(0), 105);
    assert_eq!(snap.device_usage(99), 0);
    assert_eq!(snap.live_procs().count(), 2);
}

#[test]
fn rejects_truncated_foreign_and_future_files() {
    let good = sample_region();
    assert_eq!(
        RegionSnapshot::parse(&good[..REGION_SIZE - 1]),
        Err(RegionError::TooShort(REGION_SIZE - 1))
    );
    assert_eq!(RegionSnapshot::parse(&[]), Err(RegionError::TooShort(0)));
    let mut foreign = good.clone();
    put_i32(&mut foreign, 0, 0x7f45_4c46);
    assert!(matches!(
        RegionSnapshot::parse(&foreign),
        Err(RegionError::NotInitialized(_))
    ));
    let mut future = good.clone();
    put_i32(&mut future, offset::MAJOR_VERSION, 2);
    assert_eq!(
        RegionSnapshot::parse(&future),
        Err(RegionError::UnsupportedVersion(2, 2))
    );
    // A corrupt proc_num is clamped instead of indexing out of bounds.
    let mut corrupt = good;
    put_i32(&mut corrupt, offset::PROC_NUM, i32::MAX);
    assert_eq!(
        RegionSnapshot::parse(&corrupt).unwrap().procs.len(),
        MAX_PROCS
    );
    put_i32(&mut corrupt, offset::PROC_NUM, -5);
    assert_eq!(RegionSnapshot::parse(&corrupt).unwrap().procs.len(), 0);
}

#[test]
fn hami_size_parser_quirks() {
    let p = |s: &str| parse_hami_size(s).bytes;
    const G: u64 = 1 << 30;
    assert_eq!(p("1g"), G);
    assert_eq!(p("1024m"), G);
    assert_eq!(p("1048576k"), G);
    assert_eq!(p("1073741824"), G);
    assert_eq!(p("4Gi"), 4);
    assert_eq!(p("4GB"), 4);
    assert_eq!(p("010g"), 8 * G);
    assert_eq!(p("0x10m"), 16 << 20);
    assert_eq!(p("1.5g"), G);
    assert_eq!(p(" 2g"), 2 * G);
    assert_eq!(p(" 2g "), 2);
    assert_eq!(p("-1"), u64::MAX);
    assert_eq!(p("-1g"), 0);
    assert_eq!(p("abc"), 0);
    assert_eq!(p(""), 0);
    assert_eq!(p("99999999999999999999999g"), 0);
    assert_eq!(p("50%"), 50);
    assert!(!parse_hami_size("1024m").suspicious);
    assert!(!parse_hami_size("3000").suspicious);
    for s in [
        "4Gi",
        "010g",
        "0x10m",
        "1.5g",
        " 2g ",
        "-1",
        "-1g",
        "abc",
        "",
        "50%",
        "99999999999999999999999g",
    ] {
        assert!(parse_hami_size(s).suspicious, "{s:?} should be flagged");
    }
}

proptest! {
    #[test]
    fn parse_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..4096), magic in any::<bool>()) {
        let mut region = sample_region();
        let n = bytes.len().min(region.len());
        region[..n].copy_from_slice(&bytes[..n]);
        if magic { put_i32(&mut region, 0, MAGIC); put_i32(&mut region, 4, 1); }
        let _ = RegionSnapshot::parse(&region);
        let _ = RegionSnapshot::parse(&bytes);
    }

    #[test]
    fn size_parser_never_panics(s in ".{0,40}") {
        let _ = parse_hami_size(&s);
    }

    #[test]
    fn plain_decimal_sizes_are_exact(v in 0u64..1_000_000, unit in prop::sample::select(vec!["", "k", "m", "g", "K", "M", "G"])) {
        let scale = match unit { "k" | "K" => 1u64 << 10, "m" | "M" => 1 << 20, "g" | "G" => 1 << 30, _ => 1 };
        prop_assert_eq!(parse_hami_size(&format!("{v}{unit}")).bytes, v * scale);
    }
}

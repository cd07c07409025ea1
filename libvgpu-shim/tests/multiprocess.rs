//! Container-wide accounting: four processes racing against one limit, `kill -9` cleanup, and
//! the region file as the device plugin's monitor reads it.
#![allow(
    clippy::disallowed_types,
    reason = "times real processes and threads, no tokio clock"
)]

use std::process::Stdio;
use std::time::{Duration, Instant};

use shim_harness::*;

#[test]
fn four_racing_processes_never_exceed_the_limit_and_kill_9_frees_within_1s() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("container.cache");
    let start = dir.path().join("go");
    let chunk = 3 * MIB; // 21 chunks fit in 64 MiB
    let vars = [
        ("CUDA_DEVICE_MEMORY_LIMIT", "64m"),
        ("CUDA_TASK_PRIORITY", "3"),
    ];
    let mut procs = Children(Vec::new());
    let reports: Vec<_> = (0..4)
        .map(|i| dir.path().join(format!("report{i}")))
        .collect();
    for report in &reports {
        let child = probe(
            &cache,
            &vars,
            &[
                "hold",
                &chunk.to_string(),
                start.to_str().unwrap(),
                report.to_str().unwrap(),
            ],
        )
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn");
        procs.0.push(child);
    }
    // Release all four at once.
    std::thread::sleep(Duration::from_millis(300));
    std::fs::write(&start, "").unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let counts: Vec<u64> = reports
        .iter()
        .map(|r| {
            loop {
                if let Some(n) = std::fs::read_to_string(r)
                    .ok()
                    .and_then(|s| s.trim().parse().ok())
                {
                    break n;
                }
                assert!(Instant::now() < deadline, "probe did not report");
                std::thread::sleep(Duration::from_millis(10));
            }
        })
        .collect();
    let total: u64 = counts.iter().sum::<u64>() * chunk;
    assert!(
        total <= 64 * MIB,
        "the sum {total} passed the limit: {counts:?}"
    );
    assert_eq!(total, 21 * chunk, "all that fits was allocated: {counts:?}");

    // The monitor's view (the device plugin parses the file with vgpu-region).
    let snap = region_snapshot(&cache);
    assert_eq!(snap.limit[0], 64 * MIB);
    assert_eq!(snap.sm_limit[0], 100);
    assert_eq!(snap.priority, 3);
    assert_eq!(snap.device_num, 1);
    // The fake driver's device 0 UUID, as the monitor maps usage to a GPU.
    assert_eq!(snap.uuids[0], "GPU-0c0c0c0c-0c0c-0c0c-0c0c-0c0c0c0c0c00");
    assert_eq!(snap.uuids[1], "");
    assert_eq!(snap.live_procs().count(), 4);
    assert_eq!(snap.device_usage(0), total);
    for (child, &n) in procs.0.iter().zip(&counts) {
        let slot = snap
            .procs
            .iter()
            .find(|p| p.pid == child.id() as i32)
            .expect("each process has a slot");
        assert_eq!(slot.used[0].total, n * chunk);
        assert_eq!(slot.used[0].data_size, n * chunk);
        assert_eq!(slot.status, vgpu_region::status::RUNNING);
    }

    // kill -9 the process holding the most; its share is released within 1 s.
    let (victim, &held) = counts
        .iter()
        .enumerate()
        .max_by_key(|&(_, n)| *n)
        .expect("four");
    assert!(held > 0);
    let t0 = Instant::now();
    procs.0[victim].kill().unwrap();
    procs.0[victim].wait().unwrap();
    let grab = probe(&cache, &vars, &["grab", &(held * chunk).to_string(), "1.0"])
        .output()
        .expect("grab");
    assert!(grab.status.success(), "{}", text(&grab));
    loop {
        let snap = region_snapshot(&cache);
        if snap.device_usage(0) <= total && snap.live_procs().count() == 3 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(1),
            "not released within 1 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(t0.elapsed() < Duration::from_millis(1500));
}

#[test]
fn normal_exit_releases_the_slot_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("c.cache");
    let limit = (64 * MIB).to_string();
    assert_ok(&run(&mut probe(
        &cache,
        &[("CUDA_DEVICE_MEMORY_LIMIT", "64m")],
        &["limit", &limit],
    )));
    let snap = region_snapshot(&cache);
    assert_eq!(snap.live_procs().count(), 0);
    assert_eq!(snap.device_usage(0), 0);
}

#[test]
fn a_forked_child_is_accounted_in_its_own_slot() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("f.cache");
    let limit = (64 * MIB).to_string();
    assert_ok(&run(&mut probe(
        &cache,
        &[("CUDA_DEVICE_MEMORY_LIMIT", "64m")],
        &["fork", &limit],
    )));
    let snap = region_snapshot(&cache);
    assert_eq!(snap.live_procs().count(), 0, "both slots released at exit");
}

#[test]
fn eight_threads_racing_in_one_process_get_exactly_the_limit() {
    let dir = tempfile::tempdir().unwrap();
    let limit = (64 * MIB).to_string();
    for _ in 0..3 {
        assert_ok(&run(&mut probe(
            &dir.path().join("t.cache"),
            &[("CUDA_DEVICE_MEMORY_LIMIT", "64m")],
            &["threads", &limit],
        )));
    }
}

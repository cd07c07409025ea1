//! Overhead of the shim against the fake driver, all configurations in one run:
//! `cargo bench -p libvgpu-shim --bench overhead`.
//!
//! For each call, the median ns/call over 15 repetitions without the shim, with the shim and no
//! limit, and with the shim and an SM limit that is active but not binding (so the number is the
//! limiter's bookkeeping, not its sleeps); plus process start-up (spawn → `cuInit` → exit).

#[path = "../tests/common/mod.rs"]
mod common;

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Instant;

fn bench_binary() -> std::path::PathBuf {
    let a = common::artifacts();
    let out = a.dir.join("bench");
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/bench.c");
    let status = Command::new("cc")
        .args(["-O2", "-o"])
        .arg(&out)
        .arg(&src)
        .arg(format!("-L{}", a.dir.display()))
        .arg("-lcuda")
        .status()
        .expect("cc");
    assert!(status.success());
    out
}

fn run(
    bin: &std::path::Path,
    preload: bool,
    vars: &[(&str, &str)],
    args: &[&str],
) -> BTreeMap<String, f64> {
    let a = common::artifacts();
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(bin);
    cmd.args(args)
        .env_clear()
        .env("LD_LIBRARY_PATH", &a.dir)
        .env("FAKE_CUDA_COUNT_CALLS", "0")
        // Simulated kernels of ~0 ns: the launch loop measures calls, not the fake GPU.
        .env("FAKE_CUDA_BLOCK_NS", "0")
        .env(
            "CUDA_DEVICE_MEMORY_SHARED_CACHE",
            dir.path().join("r.cache"),
        );
    if preload {
        cmd.env("LD_PRELOAD", &a.shim);
    }
    for (k, v) in vars {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("bench");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let (name, v) = l.rsplit_once(' ')?;
            Some((name.to_owned(), v.parse().ok()?))
        })
        .collect()
}

/// Median wall time of `n` runs of `probe info` (spawn, cuInit, context, one query, exit).
fn startup(preload: bool) -> f64 {
    let a = common::artifacts();
    let dir = tempfile::tempdir().unwrap();
    let mut times: Vec<f64> = (0..41)
        .map(|_| {
            let mut cmd = Command::new(&a.probe);
            cmd.arg("info")
                .env_clear()
                .env("LD_LIBRARY_PATH", &a.dir)
                .env(
                    "CUDA_DEVICE_MEMORY_SHARED_CACHE",
                    dir.path().join("r.cache"),
                )
                .env("CUDA_DEVICE_MEMORY_LIMIT", "1g");
            if preload {
                cmd.env("LD_PRELOAD", &a.shim);
            }
            let t = Instant::now();
            let out = cmd.output().expect("probe");
            assert!(out.status.success());
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let bin = bench_binary();
    let limited_vars = [
        ("CUDA_DEVICE_MEMORY_LIMIT", "1g"),
        ("CUDA_DEVICE_SM_LIMIT", "50"),
        ("GPU_CORE_UTILIZATION_POLICY", "force"),
    ];
    // Interleaved rounds, so machine load drifts affect all three configurations alike; each
    // number below is the median over rounds of each run's median ns/call.
    const ROUNDS: usize = 7;
    let mut runs: [Vec<BTreeMap<String, f64>>; 3] = Default::default();
    for _ in 0..ROUNDS {
        runs[0].push(run(&bin, false, &[], &["100000"]));
        runs[1].push(run(
            &bin,
            true,
            &[("CUDA_DEVICE_MEMORY_LIMIT", "1g")],
            &["100000"],
        ));
        runs[2].push(run(&bin, true, &limited_vars, &["100000"]));
    }
    let med = |cfg: usize, name: &str| {
        median(
            runs[cfg]
                .iter()
                .filter_map(|m| m.get(name).copied())
                .collect(),
        )
    };
    println!(
        "{:<24} {:>12} {:>12} {:>8} {:>14} {:>8}",
        "call", "no shim ns", "shim ns", "ratio", "shim+SM ns", "ratio"
    );
    for name in runs[0][0].keys() {
        let (b, s, l) = (med(0, name), med(1, name), med(2, name));
        println!(
            "{name:<24} {b:>12.1} {s:>12.1} {:>8.2} {l:>14.1} {:>8.2}   (added {:+.1} ns / {:+.1} ns)",
            s / b,
            l / b,
            s - b,
            l - b
        );
    }
    let (s0, s1) = (startup(false), startup(true));
    println!(
        "process start-up (spawn+cuInit+exit) median: {s0:.2} ms without, {s1:.2} ms with the shim ({:+.2} ms)",
        s1 - s0
    );
}

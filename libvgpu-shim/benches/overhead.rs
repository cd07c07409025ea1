//! Overhead of the shim against the fake driver, all configurations in one run:
//! `cargo bench -p libvgpu-shim --bench overhead`.
//!
//! For each call, the median ns/call over 15 repetitions without the shim, with the shim and no
//! limit, and with the shim and an SM limit that is active but not binding (so the number is the
//! limiter's bookkeeping, not its sleeps); plus process start-up (spawn → `cuInit` → exit),
//! interleaved with and without the shim. Then, when `valgrind` is installed, the noise-free
//! figure: instructions per call under `valgrind --tool=callgrind`, counted only inside a loop
//! function around the call (`tests/c/callgrind_bench.c`), and instructions per process start.
//!
//! Rows go to `shim_overhead.csv` under `TESSERA_BENCH_CSV_DIR`; `TESSERA_BENCH_QUICK=1` runs two
//! rounds, short loops, and callgrind on 1,000 calls.
#![allow(
    clippy::disallowed_types,
    reason = "times real processes and threads, no tokio clock"
)]

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Instant;

use results::{Csv, Row, Stats};
use tessera_bench_results as results;

fn bench_binary() -> std::path::PathBuf {
    let a = shim_harness::artifacts();
    let out = a.dir.join("bench");
    let src = test_paths::manifest_dir().join("tests/c/bench.c");
    let status = Command::new("cc")
        .args(["-O2", "-o"])
        .arg(&out)
        .arg(&src)
        .arg(format!("-L{}", a.dir.display()))
        .args(["-lcuda", "-ldl"])
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
    let a = shim_harness::artifacts();
    let dir = tempfile::tempdir().unwrap();
    // One simulated GPU for the NVML rows (what nvidia-smi reads).
    let scenario = dir.path().join("scenario.json");
    std::fs::write(
        &scenario,
        r#"{"devices": [{"uuid": "GPU-00000000-0000-0000-0000-000000000001", "memory_total_mib": 16384}]}"#,
    )
    .unwrap();
    let mut cmd = Command::new(bin);
    cmd.args(args)
        .env_clear()
        .env("LD_LIBRARY_PATH", &a.dir)
        .env("FAKE_NVML_SCENARIO", &scenario)
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

/// Wall time (ms) of one `probe info` (spawn, cuInit, context, one query, exit).
fn startup_once(preload: bool, dir: &std::path::Path) -> f64 {
    let a = shim_harness::artifacts();
    let mut cmd = Command::new(&a.probe);
    cmd.arg("info")
        .env_clear()
        .env("LD_LIBRARY_PATH", &a.dir)
        .env("CUDA_DEVICE_MEMORY_SHARED_CACHE", dir.join("r.cache"))
        .env("CUDA_DEVICE_MEMORY_LIMIT", "1g");
    if preload {
        cmd.env("LD_PRELOAD", &a.shim);
    }
    let t = Instant::now();
    let out = cmd.output().expect("probe");
    assert!(out.status.success());
    t.elapsed().as_secs_f64() * 1e3
}

fn callgrind_binary() -> std::path::PathBuf {
    let a = shim_harness::artifacts();
    let out = a.dir.join("callgrind_bench");
    let src = test_paths::manifest_dir().join("tests/c/callgrind_bench.c");
    let status = Command::new("cc")
        .args(["-O2", "-g", "-o"])
        .arg(&out)
        .arg(&src)
        .arg(format!("-L{}", a.dir.display()))
        .arg("-lcuda")
        .status()
        .expect("cc");
    assert!(status.success());
    out
}

/// Instructions (`Ir`) callgrind counted: inside `toggle` only, or the whole process.
fn callgrind(
    program: &std::path::Path,
    args: &[&str],
    preload: bool,
    vars: &[(&str, &str)],
    toggle: Option<&str>,
    cache: Option<&std::path::Path>,
) -> Option<f64> {
    let a = shim_harness::artifacts();
    let dir = tempfile::tempdir().ok()?;
    let out_file = dir.path().join("callgrind.out");
    let cache = cache.map_or_else(|| dir.path().join("r.cache"), std::path::Path::to_path_buf);
    let mut cmd = Command::new("valgrind");
    cmd.arg("--tool=callgrind")
        .arg(format!("--callgrind-out-file={}", out_file.display()));
    if let Some(t) = toggle {
        cmd.arg("--collect-atstart=no")
            .arg(format!("--toggle-collect={t}"));
    }
    cmd.arg(program)
        .args(args)
        .env_clear()
        .env("LD_LIBRARY_PATH", &a.dir)
        .env("FAKE_CUDA_COUNT_CALLS", "0")
        .env("FAKE_CUDA_BLOCK_NS", "0")
        .env("CUDA_DEVICE_MEMORY_SHARED_CACHE", &cache);
    if preload {
        cmd.env("LD_PRELOAD", &a.shim);
    }
    for (k, v) in vars {
        cmd.env(k, v);
    }
    let out = cmd.output().ok()?;
    if !out.status.success() {
        eprintln!(
            "callgrind failed: {}",
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
        );
        return None;
    }
    let text = std::fs::read_to_string(&out_file).ok()?;
    text.lines()
        .find_map(|l| {
            l.strip_prefix("totals:")
                .or_else(|| l.strip_prefix("summary:"))
        })
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let quick = results::quick();
    let csv = Csv::open("shim_overhead");
    let bin = bench_binary();
    let limited_vars = [
        ("CUDA_DEVICE_MEMORY_LIMIT", "1g"),
        ("CUDA_DEVICE_SM_LIMIT", "50"),
        ("GPU_CORE_UTILIZATION_POLICY", "force"),
    ];
    let iters = if quick { "20000" } else { "100000" };
    // Interleaved rounds, so machine load drifts affect all three configurations alike; each
    // number below is the median over rounds of each run's median ns/call.
    let rounds: usize = if quick { 2 } else { 7 };
    let mut runs: [Vec<BTreeMap<String, f64>>; 3] = Default::default();
    for _ in 0..rounds {
        runs[0].push(run(&bin, false, &[], &[iters]));
        runs[1].push(run(
            &bin,
            true,
            &[("CUDA_DEVICE_MEMORY_LIMIT", "1g")],
            &[iters],
        ));
        runs[2].push(run(&bin, true, &limited_vars, &[iters]));
    }
    let per_round = |cfg: usize, name: &str| -> Vec<f64> {
        runs[cfg]
            .iter()
            .filter_map(|m| m.get(name).copied())
            .collect()
    };
    let med = |cfg: usize, name: &str| median(per_round(cfg, name));
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
    let goal = |name: &str, cfg: usize| -> Option<(&'static str, f64)> {
        match (name, cfg) {
            ("cuLaunchKernel", 1) => Some(("added < 20 ns", 20.0)),
            ("cuLaunchKernel", 2) => Some(("added < 100 ns", 100.0)),
            ("cuMemAlloc+cuMemFree", _) => Some(("added < 1000 ns", 1000.0)),
            _ => None,
        }
    };
    for name in runs[0][0].keys() {
        let base = per_round(0, name);
        csv.row(
            &Row::new(
                format!("{name}: no shim"),
                "ns per call (fake driver)",
                "ns",
                Stats::of(&base),
            )
            .without_p99(),
        );
        for (cfg, what) in [(1, "shim"), (2, "shim + active SM limit (50 %)")] {
            // Per round: this configuration minus the no-shim run of the same round.
            let added: Vec<f64> = per_round(cfg, name)
                .iter()
                .zip(&base)
                .map(|(x, b)| x - b)
                .collect();
            let s = Stats::of(&added);
            let mut row = Row::new(
                format!("{name}: {what}"),
                "added ns per call vs no shim (same round)",
                "ns",
                s,
            )
            .without_p99()
            .baseline(median(base.clone()))
            .ratio(med(cfg, name) / median(base.clone()));
            if let Some((g, limit)) = goal(name, cfg) {
                row = row.goal(g, s.median < limit);
            }
            csv.row(&row);
        }
    }

    // Opt-in oversubscription: alloc+free past the device share (host memory: map, pin, unpin,
    // unmap), one run per round, against the device path's figure of the shim rounds above.
    let host_vars = [
        ("CUDA_DEVICE_MEMORY_LIMIT", "1g"),
        ("TESSERA_DEVICE_MEMORY_SHARE_0", "1m"),
    ];
    let (mut host, mut device) = (Vec::new(), Vec::new());
    for shim_round in &runs[1] {
        let r = run(&bin, true, &host_vars, &[iters, "host-backed"]);
        host.extend(r.get("cuMemAlloc+cuMemFree past the device share").copied());
        device.extend(shim_round.get("cuMemAlloc+cuMemFree").copied());
    }
    let (h, d) = (median(host.clone()), median(device));
    println!(
        "cuMemAlloc+cuMemFree of 4 KiB past the device share (host memory): {h:.1} ns, {:.1}x the device path",
        h / d
    );
    csv.row(
        &Row::new(
            "cuMemAlloc+cuMemFree of 4 KiB past the device share (host memory, opt-in oversubscription)",
            "ns per call (fake driver: the shim's map/pin/unpin/unmap, not the real driver's pinning)",
            "ns",
            Stats::of(&host),
        )
        .without_p99()
        .baseline(d)
        .ratio(h / d),
    );

    // Start-up, interleaved.
    let dir = tempfile::tempdir().unwrap();
    let n = if quick { 5 } else { 41 };
    let (mut without, mut with) = (Vec::new(), Vec::new());
    for _ in 0..n {
        without.push(startup_once(false, dir.path()));
        with.push(startup_once(true, dir.path()));
    }
    let (s0, s1) = (median(without.clone()), median(with.clone()));
    println!(
        "process start-up (spawn+cuInit+exit) median: {s0:.2} ms without, {s1:.2} ms with the shim ({:+.2} ms)",
        s1 - s0
    );
    csv.row(&Row::new(
        "process start-up (spawn + cuInit + context + exit): no shim",
        "wall time",
        "ms",
        Stats::of(&without),
    ));
    let added: Vec<f64> = with.iter().zip(&without).map(|(w, b)| w - b).collect();
    let sa = Stats::of(&added);
    csv.row(
        &Row::new(
            "process start-up: shim",
            "added wall time vs no shim (pairwise)",
            "ms",
            sa,
        )
        .baseline(s0)
        .ratio(s1 / s0)
        .goal("added < 5 ms", sa.median < 5.0),
    );

    // Callgrind: instructions, not time.
    let have_valgrind = Command::new("valgrind")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !have_valgrind {
        println!("valgrind not found: callgrind instruction counts skipped");
        return;
    }
    let cg = callgrind_binary();
    let calls: usize = if quick { 1_000 } else { 20_000 };
    let calls_s = calls.to_string();
    for (arg, name) in [
        ("launch", "cuLaunchKernel"),
        ("alloc_free", "cuMemAlloc+cuMemFree"),
        ("meminfo", "cuMemGetInfo"),
    ] {
        let toggle = format!("loop_{arg}");
        let per = |preload: bool, vars: &[(&str, &str)]| {
            callgrind(&cg, &[arg, &calls_s], preload, vars, Some(&toggle), None)
                .map(|ir| ir / calls as f64)
        };
        let Some(base) = per(false, &[]) else {
            continue;
        };
        csv.row(
            &Row::new(
                format!("{name}: no shim"),
                "instructions per call (callgrind)",
                "Ir",
                Stats::single(base),
            )
            .without_p99(),
        );
        for (preload_vars, what) in [
            (&[("CUDA_DEVICE_MEMORY_LIMIT", "1g")][..], "shim"),
            (&limited_vars[..], "shim + active SM limit (50 %)"),
        ] {
            if let Some(ir) = per(true, preload_vars) {
                csv.row(
                    &Row::new(
                        format!("{name}: {what}"),
                        "added instructions per call (callgrind)",
                        "Ir",
                        Stats::single(ir - base),
                    )
                    .without_p99()
                    .baseline(base)
                    .ratio(ir / base),
                );
            }
        }
    }
    // Start-up: the container's first process creates and zeroes the 2 MB shared region (a
    // `memset` that callgrind counts per byte-string iteration); later ones attach to it.
    let a = shim_harness::artifacts();
    let shared = tempfile::tempdir().unwrap();
    let cache = shared.path().join("r.cache");
    let start = |preload: bool| {
        callgrind(
            &a.probe,
            &["info"],
            preload,
            &[("CUDA_DEVICE_MEMORY_LIMIT", "1g")],
            None,
            Some(&cache),
        )
    };
    let base = start(false);
    let first = start(true);
    let later = start(true);
    for (ir, what) in [
        (
            first,
            "first process of a container (creates the region file)",
        ),
        (later, "later processes (attach to the region)"),
    ] {
        if let (Some(b), Some(s)) = (base, ir) {
            csv.row(
                &Row::new(
                    format!("process start-up (exec to exit of `cuda_probe info`): {what}"),
                    "added instructions vs no shim (callgrind)",
                    "Ir",
                    Stats::single(s - b),
                )
                .without_p99()
                .baseline(b)
                .ratio(s / b),
            );
        }
    }
}

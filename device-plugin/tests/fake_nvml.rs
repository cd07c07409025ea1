//! The real nvml-wrapper path against the fake `libnvidia-ml.so.1`: discovery through the
//! binary's dry run, scripted XID / GPU-lost events turning GPUs unhealthy in the register
//! annotation, recovery, and a missing driver reported clearly.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;
use tokio::time::Instant;

const BIN: &str = env!("CARGO_BIN_EXE_tessera-device-plugin");

fn scenario(dir: &Path) -> PathBuf {
    let path = dir.join("scenario.json");
    std::fs::write(
        &path,
        r#"{"driver_version":"550.54.15","cuda_driver_version":12040,"devices":[
          {"uuid":"GPU-aaaa","name":"Tesla T4","memory_total_mib":15360,"pci_bus_id":"00000000:3B:00.0"},
          {"uuid":"GPU-bbbb","name":"NVIDIA A100-SXM4-40GB","memory_total_mib":40960,"pci_bus_id":"00000000:AF:00.0"},
          {"uuid":"GPU-cccc","name":"GH200","memory_total_mib":0,"memory_info_unsupported":true},
          {"uuid":"GPU-dddd","name":"A30","memory_total_mib":24576,"mig_mode":true}
        ]}"#,
    )
    .expect("write scenario");
    // NUMA node of the A100 from a fake sysfs.
    let numa = dir.join("sys/bus/pci/devices/0000:af:00.0");
    std::fs::create_dir_all(&numa).expect("mkdir");
    std::fs::write(numa.join("numa_node"), "1\n").expect("write");
    path
}

fn base_command(dir: &Path, lib: &Path, config: &str) -> Command {
    let config_path = dir.join("device-config.yaml");
    std::fs::write(&config_path, config).expect("write config");
    let mut cmd = Command::new(BIN);
    cmd.arg("--node-name")
        .arg("node-a")
        .arg("--nvml-lib")
        .arg(lib)
        .arg("--config-file")
        .arg(&config_path)
        .arg("--node-config")
        .arg(dir.join("absent.json"))
        .arg("--sysfs-root")
        .arg(dir.join("sys"))
        .arg("--print-register")
        .env("FAKE_NVML_SCENARIO", scenario(dir))
        .env("RUST_LOG", "warn");
    cmd
}

const CONFIG: &str = "nvidia:\n  deviceSplitCount: 5\n  deviceMemoryScaling: 1\n  deviceCoreScaling: 1\n  libCudaLogLevel: 1\n  preConfiguredDeviceMemory: 8192\n";

#[test]
fn discovery_through_nvml_builds_hami_register_annotation() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lib = nvidia_ml::locate::install_as_soname(dir.path()).expect("fake NVML built");
    let out = base_command(dir.path(), &lib, CONFIG)
        .output()
        .expect("runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        stdout.trim(),
        r#"[{"id":"GPU-aaaa","count":5,"devmem":15360,"devcore":100,"type":"NVIDIA-Tesla T4","mode":"hami-core","health":true},{"id":"GPU-bbbb","index":1,"count":5,"devmem":40960,"devcore":100,"type":"NVIDIA A100-SXM4-40GB","numa":1,"mode":"hami-core","health":true},{"id":"GPU-cccc","index":2,"count":5,"devmem":8192,"devcore":100,"type":"NVIDIA-GH200","mode":"hami-core","health":true}]"#
    );
    assert!(
        stderr.contains("MIG"),
        "the MIG GPU is refused with a reason: {stderr}"
    );
}

#[test]
fn unparsable_config_and_missing_driver_are_clear_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lib = nvidia_ml::locate::install_as_soname(dir.path()).expect("fake NVML built");
    let out = base_command(dir.path(), &lib, "nvidia:\n  deviceSplitCount: ten\n")
        .output()
        .expect("runs");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("invalid device config") && stderr.contains("deviceSplitCount"),
        "{stderr}"
    );

    let out = base_command(dir.path(), &lib, CONFIG)
        .env("FAKE_NVML_FAIL_INIT", "1")
        .output()
        .expect("runs");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("no NVIDIA driver usable on this node"),
        "{stderr}"
    );

    let out = base_command(dir.path(), &dir.path().join("nope.so"), CONFIG)
        .output()
        .expect("runs");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("cannot load NVML from") && stderr.contains("nope.so"),
        "{stderr}"
    );
}

#[test]
fn scripted_xid_and_lost_gpu_turn_unhealthy_and_recover() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lib = nvidia_ml::locate::install_as_soname(dir.path()).expect("fake NVML built");
    let events = dir.path().join("events.jsonl");
    std::fs::write(&events, "").expect("events");
    let log = dir.path().join("plugin.log");
    let mut child = base_command(dir.path(), &lib, CONFIG)
        .arg("--watch-seconds")
        .arg("30")
        // The unhealthy state lasts this long. (The misses that once looked like a window too
        // short for a loaded machine were `--print-register` subscribing after its first line:
        // an XID appended right after that line could land before the subscription.)
        .arg("--health-recovery-seconds")
        .arg("3")
        .env("FAKE_NVML_EVENTS", &events)
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).expect("log file"))
        .spawn()
        .expect("spawn");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut next = || match lines.next() {
        Some(Ok(line)) => line,
        other => panic!(
            "no line from --print-register ({other:?}); the plugin's log:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        ),
    };
    let healthy = |line: &str| line.matches(r#""health":true"#).count();
    assert_eq!(healthy(&next()), 3, "all healthy at start");

    let append = |line: &str| {
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&events)
            .expect("open");
        writeln!(f, "{line}").expect("append");
    };
    let started = Instant::now();
    append(r#"{"device":0,"kind":"xid","xid":79}"#);
    let line = next();
    assert!(line.starts_with(r#"[{"id":"GPU-aaaa","count":5,"devmem":15360,"devcore":100,"type":"NVIDIA-Tesla T4","mode":"hami-core"}"#), "{line}");
    // Generous bound: the machine running the tests may be loaded; the path itself is a
    // blocking event wait that returns as soon as the fake delivers the event.
    assert!(started.elapsed() < Duration::from_secs(10));
    // No new error for the quiet period and the GPU answers: healthy again.
    assert_eq!(healthy(&next()), 3, "recovered");

    append(r#"{"device":1,"kind":"lost"}"#);
    let line = next();
    assert_eq!(healthy(&line), 2, "{line}");
    assert!(
        !line.contains(r#""numa":1,"mode":"hami-core","health":true"#),
        "{line}"
    );
    append(r#"{"device":1,"kind":"recovered"}"#);
    assert_eq!(
        healthy(&next()),
        3,
        "the lost GPU answers again and recovers"
    );
    let _ = child.kill();
    let _ = child.wait();
}

/// The plugin's dry run on a shipped example scenario with ENABLE_TOPOLOGY_SCORE=true: the
/// register line, then the `hami.io/node-nvidia-score` line.
fn print_with_topology(scenario: &str) -> (String, String) {
    let dir = tempfile::tempdir().expect("tempdir");
    let lib = nvidia_ml::locate::install_as_soname(dir.path()).expect("fake NVML built");
    let examples = test_paths::manifest_dir().join("../examples");
    let out = Command::new(BIN)
        .args(["--node-name", "dgx-node", "--print-register"])
        .arg("--nvml-lib")
        .arg(&lib)
        .arg("--config-file")
        .arg(dir.path().join("absent.yaml"))
        .arg("--node-config")
        .arg(dir.path().join("absent.json"))
        .arg("--sysfs-root")
        .arg(dir.path().join("sys"))
        .env(
            "FAKE_NVML_SCENARIO",
            examples.join("device-plugin").join(scenario),
        )
        .env("ENABLE_TOPOLOGY_SCORE", "true")
        .env("RUST_LOG", "warn")
        .output()
        .expect("runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(
        lines.len(),
        2,
        "register and score lines: {stdout}\n{stderr}"
    );
    (lines[0].to_owned(), lines[1].to_owned())
}

/// `GPU-… → GPU-… → score` from a score annotation value.
fn scores(value: &str) -> std::collections::BTreeMap<(String, String), i64> {
    hami_contract::node::decode_pair_scores(value)
        .expect("a valid score annotation")
        .into_iter()
        .flat_map(|e| {
            let uuid = e.uuid;
            e.score
                .into_iter()
                .map(move |(peer, s)| ((uuid.clone(), peer), s))
        })
        .collect()
}

#[test]
fn nvlinked_gpus_score_above_gpus_joined_only_through_pcie() {
    let (register, score) = print_with_topology("fake-nvml-dgx1-nvlink.json");
    let s = scores(&score);
    assert_eq!(s.len(), 8 * 7, "every ordered pair of the eight GPUs");
    let pair = |a: u32, b: u32| s[&(format!("GPU-dgx1-{a}"), format!("GPU-dgx1-{b}"))];
    // 100 per NVLink, plus the PCIe path: 50 one switch, 20 same socket, 10 across sockets.
    assert_eq!(pair(2, 3), 250, "two NVLinks, one PCIe switch");
    assert_eq!(pair(0, 3), 220, "two NVLinks, same CPU socket");
    assert_eq!(pair(0, 4), 210, "two NVLinks, across sockets");
    assert_eq!(pair(0, 1), 150, "one NVLink, one PCIe switch");
    assert_eq!(pair(0, 5), 10, "no NVLink, across sockets");
    assert!(s.iter().all(|((a, b), v)| s[&(b.clone(), a.clone())] == *v));

    // The simulate example places pods with exactly what the plugin writes.
    let example = std::fs::read_to_string(
        test_paths::manifest_dir().join("../examples/simulate/topology-aware.yaml"),
    )
    .expect("example");
    let annotation = |key: &str| {
        example
            .lines()
            .find_map(|l| {
                l.trim()
                    .strip_prefix(&format!("{key}: '"))
                    .and_then(|v| v.strip_suffix('\''))
            })
            .unwrap_or_else(|| panic!("{key} in examples/simulate/topology-aware.yaml"))
            .to_owned()
    };
    assert_eq!(
        annotation("hami.io/node-nvidia-score"),
        score,
        "examples/simulate/topology-aware.yaml is out of date"
    );
    assert_eq!(annotation("hami.io/node-nvidia-register"), register);
}

#[test]
fn pcie_only_gpus_score_by_how_close_their_pcie_paths_meet() {
    let (_, score) = print_with_topology("fake-nvml-pcie-only.json");
    let s = scores(&score);
    let from_0 = |b: u32| s[&("GPU-pcie-0".to_owned(), format!("GPU-pcie-{b}"))];
    assert_eq!(
        [1, 2, 3, 4, 5].map(from_0),
        [50, 40, 30, 20, 10],
        "one switch, several switches, host bridge, same socket, across sockets"
    );
}

/// NVSwitch systems: every GPU's links end at a switch, so every pair gets the smaller of the two
/// GPUs' switch-link counts (18 here) plus its PCIe level. This goes through deviation T1: the
/// real nvml-wrapper reads each link's remote type as `Unknown`, and a remote bus id that is no
/// GPU of the node is taken for the switch.
#[test]
fn nvswitch_gpus_all_score_eighteen_links_plus_their_pcie_path() {
    let (_, score) = print_with_topology("fake-nvml-hgx-nvswitch.json");
    let s = scores(&score);
    assert_eq!(s.len(), 8 * 7);
    let pair = |a: u32, b: u32| s[&(format!("GPU-hgx-{a}"), format!("GPU-hgx-{b}"))];
    assert_eq!(pair(0, 1), 1830, "18 NVLinks, same host bridge");
    assert_eq!(pair(0, 2), 1820, "18 NVLinks, same CPU socket");
    assert_eq!(pair(0, 7), 1810, "18 NVLinks, across sockets");
    assert!(s.values().all(|v| (1810..=1830).contains(v)), "{s:?}");
}

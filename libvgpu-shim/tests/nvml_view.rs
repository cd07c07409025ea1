//! What a container sees of the GPU through NVML besides memory (issue 31): its own processes
//! and its own utilization, never another tenant's. Two "containers" (two region files) share
//! one simulated GPU (one fake GPU state, which the fake NVML lists as a driver would: every
//! process on the card, host PIDs); the probe prints what `nvidia-smi` reads.

use std::process::{Child, Stdio};
use std::time::Duration;

use shim_harness::*;

const SCENARIO: &str = r#"{"devices": [{"uuid": "GPU-00000000-0000-0000-0000-000000000001", "memory_total_mib": 16384}]}"#;

/// The nine running-process lists the probe prints.
const LISTS: [&str; 9] = [
    "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetComputeRunningProcesses_v2",
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetGraphicsRunningProcesses",
    "nvmlDeviceGetGraphicsRunningProcesses_v2",
    "nvmlDeviceGetGraphicsRunningProcesses_v3",
    "nvmlDeviceGetMPSComputeRunningProcesses",
    "nvmlDeviceGetMPSComputeRunningProcesses_v2",
    "nvmlDeviceGetMPSComputeRunningProcesses_v3",
];

struct Gpu {
    dir: tempfile::TempDir,
    state: String,
    scenario: String,
    children: Vec<Child>,
}

impl Drop for Gpu {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Gpu {
    fn new() -> Gpu {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("gpu.state");
        let scenario = dir.path().join("scenario.json");
        std::fs::write(&scenario, SCENARIO).unwrap();
        fake_gpu_state::open_path(Some(state.clone().into_os_string())).expect("state");
        Gpu {
            state: state.display().to_string(),
            scenario: scenario.display().to_string(),
            dir,
            children: Vec::new(),
        }
    }

    /// The region file of container `name`.
    fn cache(&self, name: &str) -> std::path::PathBuf {
        self.dir.path().join(format!("{name}.cache"))
    }

    fn vars(&self) -> Vec<(&str, &str)> {
        vec![
            ("CUDA_DEVICE_MEMORY_LIMIT", "1024m"),
            ("FAKE_CUDA_MEMORY_MIB", "16384"),
            ("FAKE_GPU_STATE", self.state.as_str()),
            ("FAKE_NVML_SCENARIO", self.scenario.as_str()),
        ]
    }

    /// A process of container `name` that holds `chunk`-byte allocations up to its 1 GiB limit
    /// and waits; returns its PID once it holds them.
    fn holder(&mut self, name: &str, chunk: u64) -> u32 {
        let start = self.dir.path().join("go");
        std::fs::write(&start, "").unwrap();
        let report = self.dir.path().join(format!("{name}.held"));
        let child = probe(
            &self.cache(name),
            &self.vars(),
            &[
                "hold",
                &chunk.to_string(),
                start.to_str().unwrap(),
                report.to_str().unwrap(),
            ],
        )
        .stdout(Stdio::null())
        .spawn()
        .expect("holder");
        let pid = child.id();
        self.children.push(child);
        for _ in 0..600 {
            if std::fs::read_to_string(&report).is_ok_and(|t| !t.trim().is_empty()) {
                return pid;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("the holder of {name} never reported");
    }

    /// A process of container `name` launching kernels for `seconds`; returns its PID.
    fn busy(&mut self, name: &str, seconds: u32) -> u32 {
        let child = probe(
            &self.cache(name),
            &self.vars(),
            &["busy", &seconds.to_string(), "40"],
        )
        .stdout(Stdio::null())
        .spawn()
        .expect("busy");
        let pid = child.id();
        self.children.push(child);
        pid
    }

    /// What the probe prints in container `name` (with the shim; `shim: false`: the same
    /// process without it, as the bare driver answers), allocating `bytes` first.
    fn smi(&self, name: &str, bytes: u64, shim: bool) -> Smi {
        let mut cmd = probe(
            &self.cache(name),
            &self.vars(),
            &["smi", &bytes.to_string(), "0"],
        );
        if !shim {
            cmd.env_remove("LD_PRELOAD");
        }
        let out = run(&mut cmd);
        assert_ok(&out);
        Smi(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

/// The probe's `smi` output.
struct Smi(String);

impl Smi {
    fn pid(&self) -> u32 {
        self.value("PID ").parse().unwrap()
    }

    fn value(&self, prefix: &str) -> &str {
        self.0
            .lines()
            .find_map(|l| l.strip_prefix(prefix))
            .unwrap_or_else(|| panic!("no {prefix:?} in:\n{}", self.0))
    }

    /// The (pid, bytes) entries of list `name`.
    fn list(&self, name: &str) -> Vec<(u32, u64)> {
        let rest = self.value(&format!("LIST {name} n="));
        rest.split_whitespace()
            .skip(1)
            .map(|e| {
                let (pid, used) = e.split_once(':').unwrap();
                (pid.parse().unwrap(), used.parse().unwrap())
            })
            .collect()
    }

    fn util(&self) -> (u32, u32) {
        let rest = self.value("UTIL ");
        let field = |k: &str| -> u32 {
            rest.split_whitespace()
                .find_map(|f| f.strip_prefix(k))
                .unwrap()
                .parse()
                .unwrap()
        };
        (field("gpu="), field("memory="))
    }

    /// The (pid, sm%) samples of `nvmlDeviceGetProcessUtilization`.
    fn samples(&self) -> Vec<(u32, u32)> {
        self.samples_named("SAMPLES n=")
    }

    /// The (pid, sm%) samples of the line starting `prefix` (`SAMPLES2 n=`: NVML 12.4's
    /// `nvmlDeviceGetProcessesUtilizationInfo`).
    fn samples_named(&self, prefix: &str) -> Vec<(u32, u32)> {
        self.value(prefix)
            .split_whitespace()
            .skip(1)
            .map(|e| {
                let (pid, sm) = e.split_once(':').unwrap();
                (pid.parse().unwrap(), sm.parse().unwrap())
            })
            .collect()
    }
}

fn contains_pid(list: &[(u32, u64)], pid: u32) -> bool {
    list.iter().any(|&(p, _)| p == pid)
}

/// Another tenant holds 1 GiB on the card. The bare driver lists it to anyone; through the
/// shim every list of this container holds exactly its own process, with the memory the shim
/// counted, in every API version, and nothing of the neighbour's.
#[test]
fn a_container_lists_only_its_own_processes() {
    let mut gpu = Gpu::new();
    let neighbour = gpu.holder("neighbour", 128 * MIB);

    let bare = gpu.smi("mine", 64 * MIB, false);
    assert!(
        contains_pid(&bare.list(LISTS[2]), neighbour),
        "the control: the bare driver shows the neighbour:\n{}",
        bare.0
    );

    let seen = gpu.smi("mine", 64 * MIB, true);
    let me = seen.pid();
    for name in LISTS[..3].iter().chain(&["detail0"]) {
        assert_eq!(seen.list(name), [(me, 64 * MIB)], "{name}:\n{}", seen.0);
    }
    for name in LISTS[3..]
        .iter()
        .chain(&["detail1", "detail2", "accounting"])
    {
        assert!(seen.list(name).is_empty(), "{name}:\n{}", seen.0);
    }
    assert!(
        contains_pid(&bare.list("detail0"), neighbour)
            && contains_pid(&bare.list("accounting"), neighbour),
        "the control: NVML 12.4's list and accounting show the neighbour:\n{}",
        bare.0
    );
    assert!(!seen.0.contains(&format!(" {neighbour}:")), "{}", seen.0);
    // Nothing says which of the card's processes are this container's yet (no host PIDs
    // recorded): its utilization is 0, never the card's.
    assert_eq!(seen.util(), (0, 0), "{}", seen.0);
    assert!(seen.samples().is_empty(), "{}", seen.0);
    assert!(seen.samples_named("SAMPLES2 n=").is_empty(), "{}", seen.0);
}

/// Both containers keep the card busy. Once the node has recorded this container's host PIDs
/// in its region (as the device plugin's watch does), its utilization and samples are its own
/// process's, with its PID as it sees it; the neighbour's never appear. (Without a PID
/// namespace the host PID is the PID.)
#[test]
fn utilization_is_the_containers_own_once_the_node_records_its_host_pids() {
    let mut gpu = Gpu::new();
    let neighbour = gpu.busy("neighbour", 8);
    let mine = gpu.busy("mine", 8);
    std::thread::sleep(Duration::from_millis(1500));
    let recorded = tessera_node::monitor::write_host_pid(&gpu.cache("mine"), mine, mine).unwrap();
    assert!(recorded, "the busy process has a slot in its region");
    assert!(
        !tessera_node::monitor::write_host_pid(&gpu.cache("mine"), neighbour, neighbour).unwrap(),
        "the neighbour has no slot in this container's region"
    );

    let bare = gpu.smi("mine", 0, false);
    let seen = gpu.smi("mine", 0, true);
    let samples = seen.samples();
    for s in [&samples, &seen.samples_named("SAMPLES2 n=")] {
        assert!(
            s.iter().all(|&(pid, _)| pid == mine) && !s.is_empty(),
            "only this container's process is sampled: {s:?}\n{}",
            seen.0
        );
    }
    assert_eq!(seen.list("accounting"), [(mine, 0)], "{}", seen.0);
    let (gpu_util, _) = seen.util();
    let (card, _) = bare.util();
    let own: u32 = samples.iter().map(|&(_, sm)| sm).max().unwrap_or(0);
    assert!(gpu_util > 0, "{}", seen.0);
    assert!(
        gpu_util <= card && gpu_util.abs_diff(own) <= 15,
        "the container's utilization {gpu_util} (its process {own}, the card {card})\n{}",
        seen.0
    );
    assert!(
        bare.samples().iter().any(|&(pid, _)| pid == neighbour),
        "the control: the bare driver samples the neighbour:\n{}",
        bare.0
    );
    // The busy process has no memory counted, only a context NVML sees: it is listed.
    assert!(contains_pid(&seen.list(LISTS[2]), mine), "{}", seen.0);
    assert!(!contains_pid(&seen.list(LISTS[2]), neighbour));
}

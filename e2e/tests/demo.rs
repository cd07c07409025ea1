//! `make demo` as a user runs it: the built `tessera-demo` on real nodes prints the README's table
//! and what each placed pod sees inside, its kubeconfig works from the host's own network
//! namespace, and Ctrl-C (SIGINT) leaves nothing behind: no process, mount, cgroup or file of
//! the run. Root, as every real-node test.
#![allow(
    clippy::disallowed_types,
    reason = "the e2e harness times real processes and clusters: wall-clock std::time::Instant"
)]

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::ListParams;
use kube::config::{KubeConfigOptions, Kubeconfig};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tessera_e2e::demo::descendants_of;

/// The demo as a child process; stopped with SIGINT (then SIGKILL) if the test fails first.
struct Demo {
    child: Child,
    stderr: PathBuf,
}

impl Demo {
    fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).unwrap_or(0)
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// SIGINT, then waits up to `within` for the exit status.
    fn interrupt(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let _ = kill(Pid::from_raw(self.pid()), Signal::SIGINT);
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        None
    }
}

impl Drop for Demo {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None))
            && self.interrupt(Duration::from_secs(60)).is_none()
        {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A process as `/proc` names it: pid and start time (pids are reused).
fn start_time(pid: i32) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.rsplit_once(')')?.1;
    rest.split_whitespace().nth(19).map(str::to_owned)
}

/// The container cgroups (`/k8s.io/<id>`) the processes are in.
fn container_cgroups(pids: &[i32]) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for pid in pids {
        let Ok(cg) = std::fs::read_to_string(format!("/proc/{pid}/cgroup")) else {
            continue;
        };
        for line in cg.lines() {
            if let Some(path) = line.splitn(3, ':').nth(2)
                && path.starts_with("/k8s.io/")
            {
                out.insert(path.to_owned());
            }
        }
    }
    out
}

/// Every process whose command line or working directory names `dir`.
fn processes_using(dir: &Path) -> Vec<String> {
    let needle = dir.display().to_string();
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in rd.flatten() {
        if e.file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
            .is_none()
        {
            continue;
        }
        let cmdline = std::fs::read(e.path().join("cmdline"))
            .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
            .unwrap_or_default();
        let cwd = std::fs::read_link(e.path().join("cwd"))
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        if cmdline.contains(&needle) || cwd.starts_with(&needle) {
            out.push(format!("{}: {cmdline} (cwd {cwd})", e.path().display()));
        }
    }
    out
}

/// The README's sample output of `make demo`: the lines of its ```text block that starts with the
/// table's header, up to the kubeconfig line.
fn readme_sample(root: &Path) -> Vec<String> {
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap_or_default();
    let mut lines = readme.lines().skip_while(|l| !l.starts_with("POD "));
    let mut out = Vec::new();
    for l in lines.by_ref() {
        if l.starts_with("kubeconfig:") || l.starts_with("```") {
            break;
        }
        out.push(l.trim_end().to_owned());
    }
    out
}

#[test]
fn demo_on_real_nodes_prints_the_readme_table_serves_kubectl_and_ctrl_c_leaves_nothing() {
    let root = tessera_e2e::artifacts::workspace_root();
    let stderr = tempfile::NamedTempFile::new().expect("temp file");
    let child = Command::new(env!("CARGO_BIN_EXE_tessera-demo"))
        .arg("-f")
        .arg(root.join("examples/demo/pods.yaml"))
        .current_dir(&root)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(stderr.reopen().expect("stderr file")))
        .spawn()
        .expect("starting tessera-demo");
    let mut demo = Demo {
        child,
        stderr: stderr.path().to_owned(),
    };
    let pid = demo.pid();
    let stdout = demo.child.stdout.take().expect("stdout");
    let (tx, rx) = mpsc::channel::<String>();
    std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines() {
            let Ok(l) = l else { break };
            let _ = tx.send(l);
        }
    });

    // The table, the reports, then the kubeconfig.
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut out: Vec<String> = Vec::new();
    let kubeconfig = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) => {
                if let Some(p) = l.strip_prefix("kubeconfig: ") {
                    break PathBuf::from(p);
                }
                out.push(l.trim_end().to_owned());
            }
            Err(e) => panic!(
                "no kubeconfig line ({e}); stdout so far:\n{}\nstderr:\n{}",
                out.join("\n"),
                demo.stderr()
            ),
        }
    };
    let printed = out.join("\n");
    eprintln!("{printed}");
    let run_dir = kubeconfig.parent().expect("run dir").to_owned();
    assert!(run_dir.is_dir(), "{}", run_dir.display());

    // Every run prints the same table and reports, the README's.
    let sample = readme_sample(&root);
    assert_eq!(
        out,
        sample,
        "the demo's output differs from README.md's sample\n--- printed:\n{printed}\n--- README:\n{}",
        sample.join("\n")
    );
    // Each placed pod's report: cuMemGetInfo and NVML inside show the slice its row shows.
    for line in &out {
        let Some((pod, rest)) = line.split_once("  ") else {
            continue;
        };
        let Some(mib) = rest
            .split_once(": ")
            .and_then(|(_, s)| s.split(" MiB").next())
            .filter(|m| m.chars().all(|c| c.is_ascii_digit()) && !m.is_empty())
        else {
            continue;
        };
        if pod.trim().is_empty() {
            continue;
        }
        let report = format!("{}: ", pod.trim());
        let seen = out
            .iter()
            .find(|l| l.starts_with(&report))
            .unwrap_or_else(|| panic!("no report of {pod}\n{printed}"));
        assert!(
            seen.contains(&format!(
                "cuMemGetInfo total {mib} MiB, NVML total {mib} MiB"
            )),
            "{seen}"
        );
        // Pods share GPUs (inference-a and -b one T4): each lists its own process only.
        assert!(seen.contains("NVML processes 1 (its own)"), "{seen}");
    }

    // The kubeconfig, used from the host's network namespace (where kubectl runs).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let (server, names) = rt.block_on(async {
        let kc = Kubeconfig::read_from(&kubeconfig).expect("kubeconfig");
        let cfg = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
            .await
            .expect("config");
        let server = cfg.cluster_url.to_string();
        let client = kube::Client::try_from(cfg).expect("client");
        let pods: Api<Pod> = Api::namespaced(client, "default");
        let list = pods
            .list(&ListParams::default())
            .await
            .expect("listing pods with the printed kubeconfig");
        let names: BTreeSet<String> = list
            .items
            .into_iter()
            .filter_map(|p| p.metadata.name)
            .collect();
        (server, names)
    });
    assert!(server.starts_with("https://127.0.0.1:"), "{server}");
    let want: BTreeSet<String> = [
        "whole-h100",
        "notebook",
        "inference-a",
        "inference-b",
        "a100-only",
        "four-whole-cards",
    ]
    .map(str::to_owned)
    .into();
    assert_eq!(names, want);

    // What the run made, seen from the host before Ctrl-C.
    let procs: Vec<(i32, Option<String>)> = descendants_of(pid)
        .into_iter()
        .map(|p| (p, start_time(p)))
        .collect();
    let cgroups = container_cgroups(&procs.iter().map(|(p, _)| *p).collect::<Vec<_>>());
    assert!(
        procs.len() > 20 && !cgroups.is_empty(),
        "the demo's processes and container cgroups: {} / {cgroups:?}",
        procs.len()
    );

    let t = Instant::now();
    let status = demo.interrupt(Duration::from_secs(90));
    let st = status.unwrap_or_else(|| panic!("the demo did not exit within 90 s of SIGINT"));
    eprintln!(
        "e2e demo: exited {st} {:.1} s after SIGINT",
        t.elapsed().as_secs_f64()
    );
    assert!(st.success(), "{st}\n{}", demo.stderr());

    let alive: Vec<i32> = procs
        .iter()
        .filter(|(p, started)| started.is_some() && start_time(*p) == *started)
        .map(|(p, _)| *p)
        .collect();
    assert!(alive.is_empty(), "still running: {alive:?}");
    let using = processes_using(&run_dir);
    assert!(using.is_empty(), "{using:#?}");
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let left: Vec<&str> = mounts
        .lines()
        .filter(|l| l.contains(run_dir.to_str().unwrap_or("?")))
        .collect();
    assert!(left.is_empty(), "{left:#?}");
    assert!(!run_dir.exists(), "{} is left", run_dir.display());
    let controllers: Vec<PathBuf> = std::fs::read_dir("/sys/fs/cgroup")
        .map(|rd| rd.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    let stale: Vec<String> = cgroups
        .iter()
        .flat_map(|cg| {
            controllers
                .iter()
                .map(move |c| c.join(cg.trim_start_matches('/')))
        })
        .filter(|p| p.exists())
        .map(|p| p.display().to_string())
        .collect();
    assert!(stale.is_empty(), "{stale:#?}");
    let port = server
        .trim_start_matches("https://127.0.0.1:")
        .trim_end_matches('/')
        .parse::<u16>()
        .unwrap_or(0);
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "the kubeconfig's port {port} still answers"
    );
}

//! Runs the binary on the shipped example, as the README's first command does.

use std::io::Write;
use std::process::{Command, Stdio};

use serde_json::Value;

fn run(args: &[&str]) -> (bool, Vec<Value>, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tessera-scheduler"))
        .args(args)
        .current_dir(test_paths::workspace_root())
        .output()
        .expect("run tessera-scheduler");
    let lines = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    (
        out.status.success(),
        lines,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn by_pod<'a>(lines: &'a [Value], pod: &str) -> &'a Value {
    lines
        .iter()
        .find(|l| l["pod"] == pod)
        .unwrap_or_else(|| panic!("no line for {pod}"))
}

#[test]
fn the_example_places_pods_in_order_and_explains_the_rest() {
    let (ok, lines, err) = run(&["simulate", "-f", "examples/simulate/cluster.yaml"]);
    assert!(ok, "{err}");
    assert_eq!(lines.len(), 7);
    let notebook = by_pod(&lines, "default/notebook");
    assert_eq!(
        notebook["node"], "t4-node",
        "binpack: the fullest node that fits"
    );
    assert_eq!(notebook["devices"], "GPU-t4-1,NVIDIA,4000,20:;");
    assert_eq!(
        notebook["reasons"]["l4-node"],
        "1/2 CardCordoned, 1/2 CardNotHealth"
    );
    let halves = by_pod(&lines, "default/two-halves");
    assert_eq!(halves["node"], "a100-node");
    assert_eq!(
        halves["devices"],
        "GPU-a100-3,NVIDIA,20480,0:GPU-a100-2,NVIDIA,20480,0:;"
    );
    assert_eq!(
        by_pod(&lines, "default/t4-only")["reasons"]["a100-node"],
        "4/4 CardTypeMismatch"
    );
    assert_eq!(by_pod(&lines, "team-a/batch-1")["node"], "a100-node");
    let over = by_pod(&lines, "team-a/batch-2");
    assert_eq!(over["node"], Value::Null);
    assert_eq!(over["reasons"]["a100-node"], "4/4 ResourceQuotaNotFit");
    let init = by_pod(&lines, "default/with-init");
    assert_eq!(
        init["devices"],
        "GPU-a100-1,NVIDIA,2000,0:;;GPU-a100-1,NVIDIA,12000,30:;"
    );
    let big = by_pod(&lines, "default/too-big");
    assert_eq!(big["node"], Value::Null);
    assert_eq!(big["reasons"]["t4-node"], "2/2 CardInsufficientMemory");
}

#[test]
fn node_policy_flag_changes_the_choice() {
    let (ok, lines, err) = run(&[
        "simulate",
        "-f",
        "examples/simulate/cluster.yaml",
        "--node-scheduler-policy",
        "spread",
    ]);
    assert!(ok, "{err}");
    assert_eq!(by_pod(&lines, "default/notebook")["node"], "a100-node");
}

#[test]
fn a_bad_file_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.yaml");
    std::fs::write(&path, "kind: Pod\nmetadata: {namespace: x}\n").unwrap();
    let (ok, _, err) = run(&["simulate", "-f", path.to_str().unwrap()]);
    assert!(!ok);
    assert!(err.contains("metadata.name is required"), "{err}");
}

#[test]
fn serve_flags_parse_and_tls_needs_both_files() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tessera-scheduler"))
        .args(["serve", "--help"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--http-bind",
        "--client-ca-file",
        "--token-file",
        "--leader-elect",
        "--device-config",
    ] {
        assert!(help.contains(flag), "missing {flag}");
    }
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tessera-scheduler"))
        .args(["serve", "--cert-file", "/tmp/x.crt"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--key-file"));
}

#[test]
fn a_v1_list_in_json_is_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("list.json");
    let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1", "annotations": {
            "hami.io/node-nvidia-register": "GPU-aaa,10,15360,100,NVIDIA-Tesla T4,0,true,0,hami-core:"}}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ns"},
         "spec": {"containers": [{"name": "c", "image": "i",
            "resources": {"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem-percentage": "50"}}}]}}
    ]});
    std::fs::write(&path, list.to_string()).unwrap();
    let (ok, lines, err) = run(&["simulate", "-f", path.to_str().unwrap()]);
    assert!(ok, "{err}");
    assert_eq!(lines.len(), 1);
    assert_eq!(lines[0]["pod"], "ns/p");
    assert_eq!(lines[0]["node"], "n1");
    assert_eq!(lines[0]["devices"], "GPU-aaa,NVIDIA,7680,0:;");
}

/// The GPU UUIDs of a one-container device list (`GPU-x,NVIDIA,8000,0:GPU-y,…:;`).
fn gpus_of(line: &Value) -> Vec<String> {
    line["devices"]
        .as_str()
        .unwrap_or_else(|| panic!("no devices: {line}"))
        .split([':', ';'])
        .filter_map(|d| d.split(',').next().filter(|u| !u.is_empty()))
        .map(str::to_owned)
        .collect()
}

/// How many NVLinks join two GPUs of the fake NVML scenario the example's node annotations were
/// produced from (`examples/device-plugin/fake-nvml-dgx1-nvlink.json`): the hardware truth,
/// independent of any score.
fn nvlinks_between(a: &str, b: &str) -> usize {
    let text = std::fs::read_to_string(
        test_paths::workspace_root().join("examples/device-plugin/fake-nvml-dgx1-nvlink.json"),
    )
    .expect("scenario");
    let scenario: Value = serde_json::from_str(&text).expect("scenario JSON");
    let devices = scenario["devices"].as_array().expect("devices");
    let device = |uuid: &str| {
        devices
            .iter()
            .find(|d| d["uuid"] == uuid)
            .unwrap_or_else(|| panic!("{uuid} not in the scenario"))
    };
    let b_bus = &device(b)["pci_bus_id"];
    device(a)["nvlinks"].as_array().map_or(0, |links| {
        links
            .iter()
            .filter(|l| l["remote_pci_bus_id"] == *b_bus)
            .count()
    })
}

#[test]
fn topology_aware_puts_a_two_gpu_pod_on_nvlinked_gpus() {
    let (ok, lines, err) = run(&["simulate", "-f", "examples/simulate/topology-aware.yaml"]);
    assert!(ok, "{err}");
    let topo = gpus_of(by_pod(&lines, "default/nvlink-pair"));
    assert_eq!(topo.len(), 2, "{topo:?}");
    assert_eq!(
        nvlinks_between(&topo[0], &topo[1]),
        2,
        "topology-aware: the best-connected pair, {topo:?}"
    );
    let spread = gpus_of(by_pod(&lines, "default/spread-pair"));
    assert_eq!(
        nvlinks_between(&spread[0], &spread[1]),
        0,
        "spread: the least-used GPUs, joined only through PCIe and the CPUs, {spread:?}"
    );

    // Without the device plugin's score annotation, topology-aware has nothing to go by and takes
    // the first pair in spread order: the same unlinked pair.
    let dir = tempfile::tempdir().unwrap();
    let example = std::fs::read_to_string(
        test_paths::workspace_root().join("examples/simulate/topology-aware.yaml"),
    )
    .unwrap();
    let without: String = example
        .lines()
        .filter(|l| !l.contains("hami.io/node-nvidia-score"))
        .map(|l| format!("{l}\n"))
        .collect();
    let path = dir.path().join("no-score.yaml");
    std::fs::write(&path, without).unwrap();
    let (ok, lines, err) = run(&["simulate", "-f", path.to_str().unwrap()]);
    assert!(ok, "{err}");
    let blind = gpus_of(by_pod(&lines, "default/nvlink-pair"));
    assert_eq!(nvlinks_between(&blind[0], &blind[1]), 0, "{blind:?}");
}

#[test]
fn the_dra_example_allocates_claims_as_kube_scheduler_would() {
    let (ok, lines, err) = run(&[
        "simulate",
        "-f",
        "examples/simulate/dra.yaml",
        "-f",
        "examples/dra/pod.yaml",
        "-f",
        "examples/dra/share-8gi-25pct.yaml",
        "-f",
        "examples/dra/two-shares-nvlink.yaml",
        "-f",
        "examples/dra/whole-h100.yaml",
    ]);
    assert!(ok, "{err}");
    assert_eq!(lines.len(), 5);
    let notebook = by_pod(&lines, "default/notebook");
    assert_eq!(notebook["node"], "a100-dra");
    assert_eq!(
        notebook["devices"],
        "claim gpu, request gpu: a100-dra/gpu-0 memory=8Gi cores=25"
    );
    let second = by_pod(&lines, "default/notebook-2");
    assert_eq!(second["node"], "h100-dra");
    assert_eq!(
        second["reasons"]["a100-dra"],
        "claim gpu: request gpu: a100-dra/gpu-0 has 15 cores free, needs 25"
    );
    assert_eq!(
        by_pod(&lines, "default/nvlink-pair")["devices"],
        "claim gpus, request gpus: h100-dra/gpu-0 memory=16Gi cores=50; \
         claim gpus, request gpus: h100-dra/gpu-1 memory=16Gi cores=50"
    );
    let whole = by_pod(&lines, "default/whole");
    assert_eq!(
        whole["devices"],
        "claim gpu, request gpu: h100-dra/gpu-2 memory=80Gi cores=100"
    );
    assert!(
        whole["notes"][0]
            .as_str()
            .unwrap()
            .contains("CEL selectors are not evaluated"),
        "{whole}"
    );
    assert_eq!(by_pod(&lines, "default/cuda-share")["node"], "h100-dra");
}

#[test]
fn a_claim_of_another_driver_is_an_error_not_a_guess() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("other.yaml");
    std::fs::write(
        &file,
        r#"
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: other, namespace: ml}
spec: {spec: {devices: {requests: [{name: gpu, exactly: {deviceClassName: gpu.nvidia.com}}]}}}
---
apiVersion: v1
kind: Pod
metadata: {name: trainer, namespace: ml}
spec:
  resourceClaims: [{name: gpu, resourceClaimTemplateName: other}]
  containers: [{name: app, image: cuda, resources: {claims: [{name: gpu}]}}]
"#,
    )
    .unwrap();
    let (ok, lines, err) = run(&["simulate", "-f", file.to_str().unwrap()]);
    assert!(ok, "{err}");
    let trainer = by_pod(&lines, "ml/trainer");
    assert_eq!(trainer["node"], Value::Null);
    assert!(
        trainer["error"]
            .as_str()
            .unwrap()
            .contains("\"gpu.nvidia.com\" does not select gpu.tessera.dev devices"),
        "{trainer}"
    );
}

/// `simulate` with `stdin` on its standard input (issue 34: `-f -`).
fn simulate(args: &[&str], stdin: &str) -> std::process::Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tessera-scheduler"))
        .arg("simulate")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("tessera-scheduler");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

fn example() -> String {
    let root = test_paths::workspace_root();
    std::fs::read_to_string(root.join("examples/simulate/cluster.yaml")).unwrap()
}

#[test]
fn standard_input_is_read_with_a_dash() {
    let text = example();
    let from_stdin = simulate(&["-f", "-"], &text);
    assert!(from_stdin.status.success(), "{from_stdin:?}");
    let root = test_paths::workspace_root();
    let file = root.join("examples/simulate/cluster.yaml");
    let from_file = simulate(&["-f", file.to_str().unwrap()], "");
    assert!(from_file.status.success(), "{from_file:?}");
    assert_eq!(from_stdin.stdout, from_file.stdout);
    assert!(!from_stdin.stdout.is_empty());
}

#[test]
fn an_input_without_gpu_nodes_is_an_error_not_an_empty_answer() {
    let pending = r#"
apiVersion: v1
kind: Pod
metadata: {name: p, namespace: default}
spec:
  containers:
    - name: main
      image: app
      resources: {limits: {nvidia.com/gpu: "1", nvidia.com/gpumem: "1000"}}
"#;
    let out = simulate(&["-f", "-"], pending);
    assert!(!out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stdout.contains("no node that takes GPU pods"), "{stdout}");
    assert!(stderr.contains("no node that takes GPU pods"), "{stderr}");
    assert!(
        !stdout.contains(r#""reasons":{}"#) || stdout.contains("error"),
        "{stdout}"
    );
}

/// Issue 34: the scores of the nodes that fit, the nodes no eviction would help, and a table for
/// a terminal (`-o table`) that says the same as the JSON lines.
#[test]
fn scores_the_nodes_beyond_preemption_and_a_table_for_a_terminal() {
    let (ok, lines, err) = run(&["simulate", "-f", "examples/simulate/cluster.yaml"]);
    assert!(ok, "{err}");
    let notebook = by_pod(&lines, "default/notebook");
    let scores = notebook["scores"].as_object().expect("scores");
    assert!(
        scores.contains_key("t4-node") && scores.contains_key("a100-node"),
        "{notebook}"
    );
    // binpack: the chosen node has the highest score.
    let best = scores
        .iter()
        .max_by(|a, b| a.1.as_f64().partial_cmp(&b.1.as_f64()).unwrap())
        .map(|(n, _)| n.as_str());
    assert_eq!(best, Some("t4-node"));
    let big = by_pod(&lines, "default/too-big");
    assert_eq!(
        big["never_fits"],
        serde_json::json!(["a100-node", "l4-node", "t4-node"])
    );
    // Over its namespace budget: evicting pods could free budget, so not beyond preemption.
    let over = by_pod(&lines, "team-a/batch-2");
    assert_eq!(over["never_fits"], serde_json::json!(["l4-node"]));

    let out = Command::new(env!("CARGO_BIN_EXE_tessera-scheduler"))
        .args([
            "simulate",
            "-f",
            "examples/simulate/cluster.yaml",
            "-o",
            "table",
        ])
        .current_dir(test_paths::workspace_root())
        .output()
        .expect("run tessera-scheduler");
    assert!(out.status.success());
    let table = String::from_utf8_lossy(&out.stdout);
    let rows: Vec<&str> = table.lines().collect();
    assert_eq!(rows.len(), 1 + lines.len(), "{table}");
    assert!(
        rows[0].starts_with("POD ") && rows[0].contains("SCORE"),
        "{table}"
    );
    let row = |pod: &str| {
        *rows
            .iter()
            .find(|r| r.starts_with(pod))
            .unwrap_or_else(|| panic!("{pod}: {table}"))
    };
    assert!(
        row("default/notebook").contains("t4-node    GPU-t4-1 4000 MiB 20%"),
        "{table}"
    );
    assert!(
        row("default/too-big").contains("pending")
            && row("default/too-big").contains("4/4 CardInsufficientMemory (even if emptied)"),
        "{table}"
    );
}

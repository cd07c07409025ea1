//! `tessera-scheduler simulate` as a user runs it: the input from standard input (`-f -`), and
//! an input that cannot be answered (no node takes GPU pods) said so, with a failing exit status
//! (issue 34).

use std::io::Write;
use std::process::{Command, Stdio};

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
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    std::fs::read_to_string(root.join("examples/simulate/cluster.yaml")).unwrap()
}

#[test]
fn standard_input_is_read_with_a_dash() {
    let text = example();
    let from_stdin = simulate(&["-f", "-"], &text);
    assert!(from_stdin.status.success(), "{from_stdin:?}");
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
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

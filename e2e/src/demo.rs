//! `make demo`: a local cluster with three simulated GPU nodes and Tessera, the pods of
//! `examples/demo/pods.yaml`, and a table of which pod got which GPU slice and why the others
//! wait.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use hami_contract::devices::PodDevices;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::PostParams;

use crate::cluster::{Cluster, ClusterOptions};
use crate::node::NodeSpec;
use crate::pods::{annotation, node_of};
use crate::{Error, Result};

/// The demo's nodes.
pub fn demo_nodes() -> Vec<NodeSpec> {
    vec![
        NodeSpec::uniform("t4-node", 2, "Tesla T4", 15360),
        NodeSpec::uniform("a100-node", 4, "NVIDIA A100-SXM4-40GB", 40960),
        NodeSpec::uniform("h100-node", 1, "NVIDIA H100 80GB HBM3", 81559),
    ]
}

/// Pods of a multi-document YAML file, in file order.
pub fn read_pods(path: &Path) -> Result<Vec<Pod>> {
    let text = std::fs::read_to_string(path)?;
    let mut pods = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(&text) {
        let v = <serde_yaml::Value as serde::Deserialize>::deserialize(doc)?;
        if v.is_null() {
            continue;
        }
        pods.push(serde_yaml::from_value::<Pod>(v)?);
    }
    Ok(pods)
}

/// One row of the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    pub pod: String,
    pub node: Option<String>,
    /// `GPU model (uuid tail): MiB, cores%` per device.
    pub slices: Vec<String>,
    /// Why it is not placed (admission denial or the scheduler's reasons).
    pub why: String,
}

/// Starts the cluster, submits the pods, waits until each is admitted on a node or has a
/// scheduling verdict, and returns the cluster (still running) with the rows.
pub async fn run(pods_file: &Path) -> Result<(Cluster, Vec<Row>)> {
    let pods = read_pods(pods_file)?;
    let cluster = Cluster::start(ClusterOptions::new("demo", demo_nodes())).await?;
    let mut denied: BTreeMap<String, String> = BTreeMap::new();
    for p in &pods {
        let ns = p
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into());
        let name = p.metadata.name.clone().unwrap_or_default();
        if let Err(e) = Api::<Pod>::namespaced(cluster.user().clone(), &ns)
            .create(&PostParams::default(), p)
            .await
        {
            denied.insert(
                name,
                format!("refused at admission: {}", short_api_error(&e)),
            );
        }
    }
    let names: Vec<String> = pods
        .iter()
        .filter_map(|p| p.metadata.name.clone())
        .collect();
    // Settled: every pod placed or refused with a reason, and nothing changed for a few seconds
    // (a bind that must wait for another pod's allocation is retried by kube-scheduler).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    let mut last: Vec<Row> = Vec::new();
    let mut unchanged_since = tokio::time::Instant::now();
    let rows = loop {
        let live = cluster.pods("default").await?;
        let rows = rows_of(&cluster, &names, &live, &denied);
        let now = tokio::time::Instant::now();
        if rows != last {
            last.clone_from(&rows);
            unchanged_since = now;
        }
        let decided = rows.iter().all(|r| r.node.is_some() || !r.why.is_empty());
        let all_placed = rows
            .iter()
            .all(|r| r.node.is_some() || r.why.starts_with("refused"));
        if (decided && (all_placed || now - unchanged_since >= Duration::from_secs(6)))
            || now >= deadline
        {
            break rows;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    Ok((cluster, rows))
}

fn short_api_error(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) => s.message.clone(),
        other => other.to_string(),
    }
}

fn rows_of(
    c: &Cluster,
    names: &[String],
    live: &[Pod],
    denied: &BTreeMap<String, String>,
) -> Vec<Row> {
    let models: BTreeMap<String, String> = c
        .nodes
        .iter()
        .flat_map(|n| {
            n.spec
                .gpus
                .iter()
                .map(|g| (g.uuid.clone(), g.model.clone()))
        })
        .collect();
    names
        .iter()
        .map(|name| {
            if let Some(why) = denied.get(name) {
                return Row {
                    pod: name.clone(),
                    node: None,
                    slices: Vec::new(),
                    why: why.clone(),
                };
            }
            let Some(p) = live
                .iter()
                .find(|p| p.metadata.name.as_deref() == Some(name))
            else {
                return Row {
                    pod: name.clone(),
                    node: None,
                    slices: Vec::new(),
                    why: "not found".into(),
                };
            };
            let uid = p.metadata.uid.clone().unwrap_or_default();
            let admitted = c.admitted(&uid).is_some();
            let slices = annotation(p, hami_contract::annotations::DEVICES_ALLOCATED)
                .and_then(|v| PodDevices::decode(v).ok())
                .map(|d| {
                    d.0.iter()
                        .flatten()
                        .map(|d| {
                            let model = models.get(&d.uuid).cloned().unwrap_or_default();
                            let tail = d
                                .uuid
                                .rsplit('-')
                                .next()
                                .unwrap_or("")
                                .trim_start_matches('0');
                            format!(
                                "{model} (#{}): {} MiB, {}% SMs",
                                if tail.is_empty() { "0" } else { tail },
                                d.usedmem,
                                d.usedcores
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            let node = node_of(p).filter(|_| admitted);
            let why = if node.is_some() {
                String::new()
            } else {
                p.status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .and_then(|cs| {
                        cs.iter()
                            .find(|c| c.type_ == "PodScheduled" && c.status == "False")
                    })
                    .and_then(|c| c.message.clone())
                    .unwrap_or_default()
            };
            Row {
                pod: name.clone(),
                node,
                slices,
                why,
            }
        })
        .collect()
}

/// The table, as printed.
pub fn render(rows: &[Row]) -> String {
    let w = rows.iter().map(|r| r.pod.len()).max().unwrap_or(3).max(3);
    let nw = rows
        .iter()
        .map(|r| r.node.as_deref().map_or(7, str::len))
        .max()
        .unwrap_or(4)
        .max(4);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<w$}  {:<nw$}  GPU SLICE / WHY NOT PLACED",
        "POD", "NODE"
    );
    for r in rows {
        match &r.node {
            Some(n) => {
                for (i, s) in r.slices.iter().enumerate() {
                    let (pod, node) = if i == 0 {
                        (r.pod.as_str(), n.as_str())
                    } else {
                        ("", "")
                    };
                    let _ = writeln!(out, "{pod:<w$}  {node:<nw$}  {s}");
                }
            }
            None => {
                let _ = writeln!(out, "{:<w$}  {:<nw$}  {}", r.pod, "pending", r.why);
            }
        }
    }
    out
}

/// The CLI's entry: run, print, wait for Ctrl-C (or return at once with `once`).
pub async fn main(pods_file: &Path, once: bool) -> Result<()> {
    eprintln!(
        "demo: starting etcd, kube-apiserver, kube-scheduler, tessera-scheduler and 3 GPU nodes …"
    );
    let (cluster, rows) = run(pods_file).await?;
    println!("{}", render(&rows));
    if once {
        return Ok(());
    }
    eprintln!(
        "demo: the cluster keeps running; kubeconfig: {}\ndemo: press Ctrl-C to stop and clean up",
        cluster.dir.join("kubeconfig-e2e-admin").display()
    );
    tokio::signal::ctrl_c().await.map_err(Error::Io)?;
    drop(cluster);
    Ok(())
}

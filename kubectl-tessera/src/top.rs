//! `kubectl tessera top`: live GPU usage per GPU and per container, from each node's device
//! plugin's `/metrics` (HAMi's monitor metrics, which the plugin exports under HAMi's names).
//! This module turns the scraped text into rows; `main.rs` fetches it.
//!
//! Bookings (`kubectl tessera gpus`) say what the scheduler promised; this says what the
//! containers use now, as the shim accounts it (memory) and measures it (SM utilization), and
//! what NVML says of the whole GPU. A container far below its limit is a candidate for a smaller
//! slice; a GPU whose use exceeds the sum of its containers' use runs something Tessera did not
//! place.

use std::collections::BTreeMap;

use hami_contract::metrics::{Sample, samples};
use serde::Serialize;
use tessera_scheduler_core::text;

const MIB: f64 = 1024.0 * 1024.0;

/// One node's scrape: its plugin's exposition, or why it could not be read.
#[derive(Debug, Clone)]
pub struct Scrape {
    pub node: String,
    pub text: Result<String, String>,
}

/// A GPU as NVML reports it on its node.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuUsage {
    pub node: String,
    pub index: String,
    pub uuid: String,
    pub model: String,
    pub memory_used_mib: u64,
    /// SM utilization of the whole GPU, 0–100.
    pub utilization_percent: Option<f64>,
    /// What the containers on it use and may use, as their shims account it.
    pub containers_used_mib: u64,
    pub containers_limit_mib: u64,
}

/// One container's share of one GPU.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ContainerUsage {
    pub namespace: String,
    pub pod: String,
    pub container: String,
    pub node: String,
    pub uuid: String,
    pub memory_used_mib: u64,
    pub memory_limit_mib: Option<u64>,
    /// The container's processes' SM utilization on the GPU, 0–100.
    pub sm_utilization_percent: Option<f64>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Top {
    pub gpus: Vec<GpuUsage>,
    pub containers: Vec<ContainerUsage>,
    /// Nodes whose plugin could not be read, and why.
    pub unreadable: Vec<(String, String)>,
    /// Lines of the expositions that were not samples.
    #[serde(skip)]
    pub malformed_lines: usize,
}

fn mib(bytes: f64) -> u64 {
    if bytes.is_finite() && bytes > 0.0 {
        (bytes / MIB).round() as u64
    } else {
        0
    }
}

fn label(s: &Sample, name: &str) -> String {
    s.label(name).unwrap_or_default().to_owned()
}

/// The rows of every node's scrape. A container is keyed by namespace, pod, container and GPU
/// (a container with two GPUs has two rows).
pub fn usage(scrapes: &[Scrape]) -> Top {
    let mut top = Top::default();
    let mut gpus: BTreeMap<(String, String), GpuUsage> = BTreeMap::new();
    let mut containers: BTreeMap<(String, String, String, String), ContainerUsage> =
        BTreeMap::new();
    for scrape in scrapes {
        let text = match &scrape.text {
            Ok(t) => t,
            Err(why) => {
                top.unreadable.push((scrape.node.clone(), why.clone()));
                continue;
            }
        };
        let (series, malformed) = samples(text);
        top.malformed_lines += malformed;
        for s in &series {
            match s.name.as_str() {
                "hami_host_gpu_memory_used_bytes" | "hami_host_gpu_utilization_ratio" => {
                    let uuid = label(s, "device_uuid");
                    let g = gpus
                        .entry((scrape.node.clone(), uuid.clone()))
                        .or_insert_with(|| GpuUsage {
                            node: scrape.node.clone(),
                            index: label(s, "device_index"),
                            uuid,
                            model: label(s, "device_type"),
                            memory_used_mib: 0,
                            utilization_percent: None,
                            containers_used_mib: 0,
                            containers_limit_mib: 0,
                        });
                    if s.name == "hami_host_gpu_memory_used_bytes" {
                        g.memory_used_mib = mib(s.value);
                    } else if s.value.is_finite() {
                        g.utilization_percent = Some(s.value);
                    }
                }
                "hami_vgpu_memory_used_bytes"
                | "hami_vgpu_memory_limit_bytes"
                | "hami_container_device_utilization_ratio" => {
                    let key = (
                        label(s, "namespace"),
                        label(s, "pod"),
                        label(s, "container"),
                        label(s, "device_uuid"),
                    );
                    let c = containers
                        .entry(key.clone())
                        .or_insert_with(|| ContainerUsage {
                            namespace: key.0,
                            pod: key.1,
                            container: key.2,
                            node: scrape.node.clone(),
                            uuid: key.3,
                            memory_used_mib: 0,
                            memory_limit_mib: None,
                            sm_utilization_percent: None,
                        });
                    match s.name.as_str() {
                        "hami_vgpu_memory_used_bytes" => c.memory_used_mib = mib(s.value),
                        "hami_vgpu_memory_limit_bytes" => c.memory_limit_mib = Some(mib(s.value)),
                        _ if s.value.is_finite() => c.sm_utilization_percent = Some(s.value),
                        _ => {}
                    }
                }
                _ => {}
            }
        }
    }
    for c in containers.values() {
        if let Some(g) = gpus.get_mut(&(c.node.clone(), c.uuid.clone())) {
            g.containers_used_mib += c.memory_used_mib;
            g.containers_limit_mib += c.memory_limit_mib.unwrap_or(0);
        }
    }
    top.gpus = gpus.into_values().collect();
    top.gpus
        .sort_by(|a, b| (&a.node, index_order(&a.index)).cmp(&(&b.node, index_order(&b.index))));
    top.containers = containers.into_values().collect();
    top
}

/// Device indexes in numeric order (`10` after `9`), anything else after them.
fn index_order(index: &str) -> (u64, &str) {
    (index.parse().unwrap_or(u64::MAX), index)
}

fn percent(p: Option<f64>) -> String {
    p.map_or_else(|| "-".to_owned(), |p| format!("{p:.0}%"))
}

/// The two tables (GPUs, then containers) and what could not be read.
pub fn table(top: &Top) -> String {
    let mut out = String::new();
    if top.gpus.is_empty() && top.containers.is_empty() {
        out.push_str("No device plugin reported a GPU.\n");
    }
    if !top.gpus.is_empty() {
        let rows: Vec<[String; 6]> = top
            .gpus
            .iter()
            .map(|g| {
                [
                    g.node.clone(),
                    format!("{} {}", g.index, g.uuid),
                    g.model.clone(),
                    format!("{} MiB", g.memory_used_mib),
                    format!("{}/{} MiB", g.containers_used_mib, g.containers_limit_mib),
                    percent(g.utilization_percent),
                ]
            })
            .collect();
        out.push_str(&text::table(
            [
                "NODE",
                "GPU",
                "MODEL",
                "MEMORY USED",
                "CONTAINERS USED/LIMIT",
                "SM UTIL",
            ],
            &rows,
        ));
    }
    if !top.containers.is_empty() {
        if !out.is_empty() {
            out.push('\n');
        }
        let rows: Vec<[String; 5]> = top
            .containers
            .iter()
            .map(|c| {
                let memory = match c.memory_limit_mib {
                    Some(limit) if limit > 0 => format!(
                        "{}/{limit} MiB ({:.0}%)",
                        c.memory_used_mib,
                        c.memory_used_mib as f64 * 100.0 / limit as f64
                    ),
                    _ => format!("{} MiB/no limit", c.memory_used_mib),
                };
                [
                    format!("{}/{}", c.namespace, c.pod),
                    c.container.clone(),
                    format!("{} {}", c.node, c.uuid),
                    memory,
                    percent(c.sm_utilization_percent),
                ]
            })
            .collect();
        out.push_str(&text::table(
            ["POD", "CONTAINER", "GPU", "MEMORY USED/LIMIT", "SM UTIL"],
            &rows,
        ));
    }
    for (node, why) in &top.unreadable {
        out.push_str(&format!(
            "node {node}: the device plugin's metrics could not be read: {why}\n"
        ));
    }
    if top.malformed_lines > 0 {
        out.push_str(&format!(
            "({} line(s) of the plugins' metrics were not samples and were skipped)\n",
            top.malformed_lines
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const A100: &str = "\
# TYPE hami_host_gpu_memory_used_bytes gauge
hami_host_gpu_memory_used_bytes{node=\"a\",device_index=\"0\",device_uuid=\"GPU-0\",device_type=\"NVIDIA A100\"} 4194304000
hami_host_gpu_utilization_ratio{node=\"a\",device_index=\"0\",device_uuid=\"GPU-0\",device_type=\"NVIDIA A100\"} 35
hami_host_gpu_memory_used_bytes{node=\"a\",device_index=\"10\",device_uuid=\"GPU-10\",device_type=\"NVIDIA A100\"} 0
hami_host_gpu_memory_used_bytes{node=\"a\",device_index=\"2\",device_uuid=\"GPU-2\",device_type=\"NVIDIA A100\"} 0
hami_vgpu_memory_used_bytes{namespace=\"team-a\",pod=\"train\",container=\"main\",vdevice_index=\"0\",device_uuid=\"GPU-0\"} 1048576000
hami_vgpu_memory_limit_bytes{namespace=\"team-a\",pod=\"train\",container=\"main\",vdevice_index=\"0\",device_uuid=\"GPU-0\"} 3145728000
hami_container_device_utilization_ratio{namespace=\"team-a\",pod=\"train\",container=\"main\",vdevice_index=\"0\",device_uuid=\"GPU-0\"} 30
hami_vgpu_memory_used_bytes{namespace=\"team-b\",pod=\"infer\",container=\"main\",vdevice_index=\"0\",device_uuid=\"GPU-0\"} 2097152000
hami_vgpu_memory_limit_bytes{namespace=\"team-b\",pod=\"infer\",container=\"main\",vdevice_index=\"0\",device_uuid=\"GPU-0\"} 2097152000
not a sample
";

    #[test]
    fn a_gpu_shows_its_containers_use_and_each_container_its_share() {
        let top = usage(&[
            Scrape {
                node: "a".into(),
                text: Ok(A100.into()),
            },
            Scrape {
                node: "b".into(),
                text: Err("HTTP 403".into()),
            },
        ]);
        assert_eq!(
            top.gpus
                .iter()
                .map(|g| g.index.as_str())
                .collect::<Vec<_>>(),
            ["0", "2", "10"],
            "numeric order"
        );
        let g = &top.gpus[0];
        assert_eq!(
            (g.memory_used_mib, g.utilization_percent),
            (4000, Some(35.0))
        );
        assert_eq!(
            (g.containers_used_mib, g.containers_limit_mib),
            (3000, 5000)
        );
        assert_eq!(top.containers.len(), 2);
        let train = &top.containers[0];
        assert_eq!(
            (
                train.pod.as_str(),
                train.memory_used_mib,
                train.memory_limit_mib
            ),
            ("train", 1000, Some(3000))
        );
        assert_eq!(train.sm_utilization_percent, Some(30.0));
        assert_eq!(top.unreadable, [("b".to_owned(), "HTTP 403".to_owned())]);
        assert_eq!(top.malformed_lines, 1);
        let text = table(&top);
        assert!(text.contains("1000/3000 MiB (33%)"), "{text}");
        assert!(text.contains("3000/5000 MiB"), "{text}");
        assert!(text.contains("node b: the device plugin's metrics could not be read: HTTP 403"));
        assert!(text.contains("were not samples"));
    }

    #[test]
    fn nothing_reported_is_said_so() {
        assert_eq!(table(&usage(&[])), "No device plugin reported a GPU.\n");
    }
}

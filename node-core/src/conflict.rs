//! A second device plugin for the same GPUs on the node (HAMi #736, #829: the GPU Operator's
//! own plugin left running beside HAMi's). Two plugins registering `nvidia.com/gpu` take turns
//! being the kubelet's endpoint: pods admitted through the other one get whole GPUs without the
//! shim, or the same GPU twice. Nothing fails loudly, so Tessera looks for it and says so.
//!
//! Pure: what counts as evidence. The daemon gathers it (the kubelet's socket directory, the
//! node's pods) and reports it as a Warning Event and the `tessera_device_plugin_conflict`
//! metric.

use std::collections::{BTreeMap, BTreeSet};

/// Reason of the Warning Event for a conflicting device plugin.
pub const REASON_CONFLICT: &str = "DevicePluginConflict";

/// What a user does about it (docs/helm.md, "Another device plugin on the node").
pub const REMEDY: &str = "disable the other plugin on this node: with the GPU Operator, label \
the node nvidia.com/gpu.deploy.device-plugin=false or install it with \
--set devicePlugin.enabled=false";

/// One piece of evidence that another device plugin serves this node's GPUs.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum PluginConflict {
    /// Our socket file was replaced by another process while the kubelet kept running: a plugin
    /// with the same socket name (NVIDIA's and HAMi's both use `nvidia-gpu.sock`).
    SocketReplaced { socket: String },
    /// Another socket in the kubelet's directory lists devices of this node's GPUs.
    SameGpus {
        socket: String,
        devices: Vec<String>,
    },
    /// A known GPU device-plugin pod runs on this node.
    PluginPod { pod: String, what: &'static str },
}

impl PluginConflict {
    /// The metric's `kind` label.
    pub fn kind(&self) -> &'static str {
        match self {
            PluginConflict::SocketReplaced { .. } => "socket_replaced",
            PluginConflict::SameGpus { .. } => "same_gpus",
            PluginConflict::PluginPod { .. } => "plugin_pod",
        }
    }

    /// The metric's `source` label: the socket or the pod.
    pub fn source(&self) -> &str {
        match self {
            PluginConflict::SocketReplaced { socket } | PluginConflict::SameGpus { socket, .. } => {
                socket
            }
            PluginConflict::PluginPod { pod, .. } => pod,
        }
    }

    /// The Event's message: what was seen, what it breaks, what to do.
    pub fn message(&self) -> String {
        let seen = match self {
            PluginConflict::SocketReplaced { socket } => format!(
                "another process replaced this plugin's socket {socket} while the kubelet kept \
                 running: a second device plugin uses the same socket name"
            ),
            PluginConflict::SameGpus { socket, devices } => format!(
                "the device plugin at {socket} also serves this node's GPUs ({})",
                summarize(devices)
            ),
            PluginConflict::PluginPod { pod, what } => {
                format!("pod {pod} ({what}) runs on this node")
            }
        };
        format!(
            "{seen}. Pods admitted through the other plugin get GPUs without Tessera's limits, or \
             a GPU another pod has; {REMEDY}"
        )
    }
}

fn summarize(devices: &[String]) -> String {
    match devices {
        [] => String::new(),
        [one] => one.clone(),
        [first, rest @ ..] => format!("{first} and {} more", rest.len()),
    }
}

/// The device IDs, out of those another plugin advertises, that name one of `our_gpus`: the
/// UUID itself (NVIDIA's plugin), or the UUID followed by a replica suffix (`GPU-…-3` from HAMi,
/// `GPU-…::3` from NVIDIA's time-slicing).
pub fn ids_naming_our_gpus(our_gpus: &BTreeSet<String>, foreign_ids: &[String]) -> Vec<String> {
    foreign_ids
        .iter()
        .filter(|id| {
            our_gpus
                .iter()
                .any(|uuid| match id.strip_prefix(uuid.as_str()) {
                    Some(rest) => rest.is_empty() || rest.starts_with(['-', ':', '_', '/']),
                    None => false,
                })
        })
        .cloned()
        .collect()
}

/// Whether a pod is a known NVIDIA GPU device plugin, by the labels its usual installers set and
/// by its images: the GPU Operator's DaemonSet, NVIDIA's own chart, HAMi's chart.
pub fn known_gpu_plugin(
    labels: &BTreeMap<String, String>,
    images: &[&str],
) -> Option<&'static str> {
    let label = |k: &str| labels.get(k).map(String::as_str);
    if label("app") == Some("nvidia-device-plugin-daemonset") {
        return Some("the GPU Operator's device plugin");
    }
    if label("app.kubernetes.io/name") == Some("nvidia-device-plugin") {
        return Some("NVIDIA's device plugin");
    }
    if label("app.kubernetes.io/component") == Some("hami-device-plugin") {
        return Some("HAMi's device plugin");
    }
    let image_is = |needle: &str| images.iter().any(|i| i.contains(needle));
    if image_is("k8s-device-plugin") {
        return Some("NVIDIA's device plugin");
    }
    if image_is("projecthami/hami")
        && label("app.kubernetes.io/component") != Some("hami-scheduler")
    {
        return Some("HAMi's device plugin");
    }
    None
}

/// The evidence of the last scan, so that each conflict is reported once when it appears and
/// its metric series removed when it is gone.
#[derive(Debug, Clone, Default)]
pub struct ConflictTracker {
    current: BTreeSet<PluginConflict>,
}

/// What changed between two scans.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConflictChange {
    pub appeared: Vec<PluginConflict>,
    pub gone: Vec<PluginConflict>,
}

impl ConflictTracker {
    /// Replaces the evidence with a new scan's.
    pub fn update(&mut self, seen: BTreeSet<PluginConflict>) -> ConflictChange {
        let change = ConflictChange {
            appeared: seen.difference(&self.current).cloned().collect(),
            gone: self.current.difference(&seen).cloned().collect(),
        };
        self.current = seen;
        change
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(items: &[&str]) -> BTreeSet<String> {
        items.iter().map(|s| s.to_string()).collect()
    }

    fn ids(items: &[&str]) -> Vec<String> {
        items.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn foreign_ids_match_whole_uuids_and_replica_suffixes_only() {
        let ours = set(&["GPU-aaaa", "GPU-bbbb"]);
        let found = ids_naming_our_gpus(
            &ours,
            &ids(&[
                "GPU-aaaa",    // NVIDIA's plugin
                "GPU-bbbb::2", // NVIDIA's time-slicing replica
                "GPU-aaaa-7",  // HAMi's replica
                "GPU-aaaab",   // another GPU whose UUID starts the same
                "MIG-1234",    // a MIG device
                "mlx5_0",      // an RDMA plugin
            ]),
        );
        assert_eq!(found, ids(&["GPU-aaaa", "GPU-bbbb::2", "GPU-aaaa-7"]));
        assert!(ids_naming_our_gpus(&BTreeSet::new(), &ids(&["GPU-aaaa"])).is_empty());
    }

    #[test]
    fn known_plugins_are_recognised_by_label_or_image() {
        let labels = |k: &str, v: &str| BTreeMap::from([(k.to_owned(), v.to_owned())]);
        assert_eq!(
            known_gpu_plugin(&labels("app", "nvidia-device-plugin-daemonset"), &[]),
            Some("the GPU Operator's device plugin")
        );
        assert_eq!(
            known_gpu_plugin(
                &BTreeMap::new(),
                &["nvcr.io/nvidia/k8s-device-plugin:v0.17.0"]
            ),
            Some("NVIDIA's device plugin")
        );
        assert_eq!(
            known_gpu_plugin(
                &labels("app.kubernetes.io/component", "hami-device-plugin"),
                &[]
            ),
            Some("HAMi's device plugin")
        );
        // HAMi's scheduler shares the image; it is not a device plugin.
        assert_eq!(
            known_gpu_plugin(
                &labels("app.kubernetes.io/component", "hami-scheduler"),
                &["docker.io/projecthami/hami:v2.10.0"]
            ),
            None
        );
        assert_eq!(
            known_gpu_plugin(
                &labels("app", "web"),
                &["nginx:1.27", "ghcr.io/x/tessera-device-plugin:0.1.0"]
            ),
            None
        );
    }

    #[test]
    fn each_conflict_is_reported_when_it_appears_and_cleared_when_gone() {
        let pod = PluginConflict::PluginPod {
            pod: "gpu-operator/nvidia-device-plugin-daemonset-x".into(),
            what: "the GPU Operator's device plugin",
        };
        let sock = PluginConflict::SameGpus {
            socket: "nvidia.sock".into(),
            devices: ids(&["GPU-a"]),
        };
        let mut t = ConflictTracker::default();
        let c = t.update(BTreeSet::from([pod.clone()]));
        assert_eq!((c.appeared, c.gone), (vec![pod.clone()], vec![]));
        let c = t.update(BTreeSet::from([pod.clone(), sock.clone()]));
        assert_eq!((c.appeared, c.gone), (vec![sock.clone()], vec![]));
        let c = t.update(BTreeSet::from([pod.clone(), sock.clone()]));
        assert_eq!(
            c,
            ConflictChange::default(),
            "nothing new, nothing reported"
        );
        let c = t.update(BTreeSet::new());
        assert_eq!(c.appeared, vec![]);
        assert_eq!(c.gone.len(), 2);
    }

    #[test]
    fn messages_name_the_evidence_and_the_remedy() {
        let m = PluginConflict::SameGpus {
            socket: "nvidia.sock".into(),
            devices: ids(&["GPU-a", "GPU-b", "GPU-c"]),
        }
        .message();
        assert!(
            m.starts_with(
                "the device plugin at nvidia.sock also serves this node's GPUs (GPU-a and 2 more)."
            ),
            "{m}"
        );
        assert!(
            m.contains("nvidia.com/gpu.deploy.device-plugin=false"),
            "{m}"
        );
    }
}

//! Kubernetes Events on the plugin's Node: a GPU turned unhealthy or recovered, an `Allocate`
//! refused. Operators look at `kubectl describe node` and `kubectl get events` first; a log line
//! on one of a thousand nodes is found too late.
//!
//! Emitting never blocks and never fails the caller: the health thread and `Allocate` hand the
//! event to a bounded queue ([`NodeEvents::emit`]) and a background task writes it
//! (`kube_edges::spawn_node_event_writer`). A full queue (an API server that does not keep up)
//! drops the event with a debug log, as Events are best effort.

use tokio::sync::mpsc;

use crate::health::HealthEvent;

/// Reason of the Warning Event for a GPU that turned unhealthy.
pub const REASON_GPU_UNHEALTHY: &str = "GPUUnhealthy";
/// Reason of the Normal Event for a GPU that is healthy again.
pub const REASON_GPU_RECOVERED: &str = "GPURecovered";
/// Reason of the Warning Event for a refused `Allocate`.
pub const REASON_ALLOCATE_REFUSED: &str = "AllocateRefused";

/// Reason of the Warning Event for GPU pairs whose two ends report different links (HAMi's).
pub const REASON_ASYMMETRIC_LINKS: &str = "AsymmetricGPUP2PLink";

/// Reason of the Warning Event for a node whose NVIDIA container runtime would hand GPUs to any
/// container that names them in its environment, or none to GPU containers.
pub const REASON_RUNTIME_DEVICE_LIST: &str =
    hami_contract::annotations::EVENT_UNSAFE_GPU_DEVICE_LIST;

/// Events waiting to be written; beyond this new ones are dropped.
pub const NODE_EVENT_QUEUE: usize = 256;

/// Severity, as Kubernetes has it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeEventType {
    Normal,
    Warning,
}

/// The object an Event is about.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum EventObject {
    /// The plugin's Node.
    #[default]
    Node,
    /// A pod on the node (`kubectl describe pod` shows it).
    Pod {
        namespace: String,
        name: String,
        uid: String,
    },
}

/// One Event the node agent writes: about its Node, or about a pod on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeEvent {
    pub kind: NodeEventType,
    pub reason: &'static str,
    pub message: String,
    pub regarding: EventObject,
}

impl NodeEvent {
    /// A GPU turned unhealthy: the kubelet stops placing pods on its replicas.
    pub fn gpu_unhealthy(event: &HealthEvent) -> Self {
        let message = match event {
            HealthEvent::Xid { uuid, xid } => format!(
                "GPU {uuid} is unhealthy after XID {xid}; its replicas are reported Unhealthy to \
                 the kubelet and no new pod is placed on it until it recovers"
            ),
            HealthEvent::Lost { uuid } => format!(
                "GPU {uuid} is lost (NVML no longer reaches it); its replicas are reported \
                 Unhealthy to the kubelet and no new pod is placed on it until it recovers"
            ),
        };
        NodeEvent {
            kind: NodeEventType::Warning,
            reason: REASON_GPU_UNHEALTHY,
            message,
            regarding: EventObject::Node,
        }
    }

    /// A GPU answered NVML again after the quiet period without new errors.
    pub fn gpu_recovered(uuid: &str, quiet: std::time::Duration) -> Self {
        NodeEvent {
            kind: NodeEventType::Normal,
            reason: REASON_GPU_RECOVERED,
            message: format!(
                "GPU {uuid} answers NVML again after {}s without new errors; its replicas are \
                 Healthy again",
                quiet.as_secs()
            ),
            regarding: EventObject::Node,
        }
    }

    /// An `Allocate` the plugin refused; `pod` is `<namespace>/<name>` when the call got that
    /// far. `error` is the whole chain the kubelet also shows in the pod's events.
    pub fn allocate_refused(pod: Option<&str>, error: &str) -> Self {
        let message = match pod {
            Some(pod) => format!("Allocate for pod {pod} refused: {error}"),
            None => format!("Allocate refused before its pod was identified: {error}"),
        };
        NodeEvent {
            kind: NodeEventType::Warning,
            reason: REASON_ALLOCATE_REFUSED,
            // The API server refuses an Event note over 1 kB (events.k8s.io/v1).
            message: truncate(message, 1000),
            regarding: EventObject::Node,
        }
    }

    /// GPU pairs (UUIDs) whose two ends report a different number of links to each other: their
    /// `hami.io/node-nvidia-score` is 0 (contract §2.2; HAMi writes this Event too).
    pub fn asymmetric_links(pairs: &[(String, String)]) -> Self {
        let list: Vec<String> = pairs.iter().map(|(a, b)| format!("{a} and {b}")).collect();
        NodeEvent {
            kind: NodeEventType::Warning,
            reason: REASON_ASYMMETRIC_LINKS,
            message: truncate(
                format!(
                    "GPUs {} report different links to each other (possible NVLink hardware or \
                     driver issue); their topology score is 0, so topology-aware placement does \
                     not prefer them together",
                    list.join(", ")
                ),
                1000,
            ),
            regarding: EventObject::Node,
        }
    }

    /// Another device plugin serves this node's GPUs ([`PluginConflict`]).
    ///
    /// [`PluginConflict`]: crate::conflict::PluginConflict
    pub fn runtime_device_list(
        verdict: &crate::nvidia_runtime::Verdict,
        strategy: crate::nvidia_runtime::DeviceListStrategy,
    ) -> Self {
        NodeEvent {
            kind: NodeEventType::Warning,
            reason: REASON_RUNTIME_DEVICE_LIST,
            message: truncate(verdict.explain(strategy), 1000),
            regarding: EventObject::Node,
        }
    }

    pub fn plugin_conflict(conflict: &crate::conflict::PluginConflict) -> Self {
        NodeEvent {
            kind: NodeEventType::Warning,
            reason: crate::conflict::REASON_CONFLICT,
            message: truncate(conflict.message(), 1000),
            regarding: EventObject::Node,
        }
    }
}

fn truncate(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
    s
}

/// Where the plugin's Node Events go. Cloning is cheap; a handle without a writer
/// ([`NodeEvents::disabled`]) drops every event.
#[derive(Debug, Clone, Default)]
pub struct NodeEvents {
    tx: Option<mpsc::Sender<NodeEvent>>,
}

/// The rate limit of the warnings about Events dropped for a full queue: one a minute at most.
static DROPPED: tessera_runtime::SharedRateLimitedLog =
    tessera_runtime::SharedRateLimitedLog::new(std::time::Duration::from_secs(60));

impl NodeEvents {
    /// A handle and the queue its writer reads.
    pub fn channel() -> (Self, mpsc::Receiver<NodeEvent>) {
        let (tx, rx) = mpsc::channel(NODE_EVENT_QUEUE);
        (NodeEvents { tx: Some(tx) }, rx)
    }

    /// Drops every event (no API server: `--print-register`, tests).
    pub fn disabled() -> Self {
        NodeEvents { tx: None }
    }

    /// Queues `event` without waiting; callable from any thread.
    pub fn emit(&self, event: NodeEvent) {
        let Some(tx) = &self.tx else { return };
        if let Err(e) = tx.try_send(event) {
            match DROPPED.note_now() {
                Some(left_out) => tracing::warn!(
                    error = %e,
                    left_out,
                    "an Event was dropped, its queue full (and left_out more since the last such line)"
                ),
                None => tracing::debug!(error = %e, "an Event was dropped, its queue full"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_say_what_happened_and_what_it_means() {
        let e = NodeEvent::gpu_unhealthy(&HealthEvent::Xid {
            uuid: "GPU-a".into(),
            xid: 79,
        });
        assert_eq!(e.kind, NodeEventType::Warning);
        assert_eq!(e.reason, "GPUUnhealthy");
        assert!(
            e.message
                .starts_with("GPU GPU-a is unhealthy after XID 79;")
        );
        let r = NodeEvent::gpu_recovered("GPU-a", std::time::Duration::from_secs(60));
        assert_eq!(r.kind, NodeEventType::Normal);
        assert!(r.message.contains("after 60s"));
        let a = NodeEvent::allocate_refused(Some("ns/p"), "tessera: boom");
        assert_eq!(a.message, "Allocate for pod ns/p refused: tessera: boom");
    }

    #[test]
    fn long_errors_are_cut_at_a_character_boundary() {
        let e = NodeEvent::allocate_refused(None, &"é".repeat(2000));
        assert!(e.message.len() <= 1000);
    }

    #[test]
    fn a_full_queue_drops_instead_of_blocking() {
        let (events, mut rx) = NodeEvents::channel();
        for _ in 0..NODE_EVENT_QUEUE + 10 {
            events.emit(NodeEvent::gpu_recovered("GPU-a", std::time::Duration::ZERO));
        }
        let mut n = 0;
        while rx.try_recv().is_ok() {
            n += 1;
        }
        assert_eq!(n, NODE_EVENT_QUEUE);
        NodeEvents::disabled().emit(NodeEvent::gpu_recovered("x", std::time::Duration::ZERO));
    }
}

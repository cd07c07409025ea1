//! GPU workloads that report, from inside their container, the limits they got: the real-node
//! scenarios compare each report with what the container's own pod asked for.
//!
//! A report is one line, `SEEN mem0=<CUDA_DEVICE_MEMORY_LIMIT_0> mem1=<…_1 or none>
//! sm=<CUDA_DEVICE_SM_LIMIT> total=<bytes cuMemGetInfo reports through the shim>`, followed by
//! `cuda_probe limit`'s `OK` (exactly the limit allocatable, one byte more refused).

use std::collections::BTreeMap;

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use serde_json::json;

use crate::real::{PROBE_IMAGE, RealCluster};
use crate::{Result, eventually};

/// One GPU container's request: GPUs, memory per GPU in MiB, SM percent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slice {
    pub gpus: u32,
    pub mem_mib: u64,
    /// Asked as `nvidia.com/gpumem-percentage` of a card of this many MiB (`mem_mib` is then
    /// the share it resolves to).
    pub percent_of: Option<u64>,
    pub cores: u32,
}

impl Slice {
    pub const fn mib(gpus: u32, mem_mib: u64) -> Slice {
        Slice {
            gpus,
            mem_mib,
            percent_of: None,
            cores: 0,
        }
    }

    pub const fn with_cores(self, cores: u32) -> Slice {
        Slice { cores, ..self }
    }

    /// `percent` % of a card of `card_mib`.
    pub const fn percent(gpus: u32, percent: u64, card_mib: u64) -> Slice {
        Slice {
            gpus,
            mem_mib: card_mib * percent / 100,
            percent_of: Some(card_mib),
            cores: 0,
        }
    }

    /// The container's `resources.limits`.
    pub fn resources(&self) -> serde_json::Value {
        let mut r = json!({"nvidia.com/gpu": self.gpus});
        match self.percent_of {
            Some(card) => r["nvidia.com/gpumem-percentage"] = json!(self.mem_mib * 100 / card),
            None => r["nvidia.com/gpumem"] = json!(self.mem_mib),
        }
        if self.cores > 0 {
            r["nvidia.com/gpucores"] = json!(self.cores);
        }
        r
    }

    /// The report a container with exactly this slice prints.
    pub fn expected_report(&self) -> String {
        let mem1 = if self.gpus > 1 {
            format!("{}m", self.mem_mib)
        } else {
            "none".to_owned()
        };
        format!(
            "SEEN mem0={}m mem1={mem1} sm={} total={}",
            self.mem_mib,
            self.cores,
            self.mem_mib * 1024 * 1024
        )
    }
}

/// Prints the report once, then proves the limit (`OK`).
const REPORT_ONCE: &str = "T=$(cuda_probe info | sed -n 's/^total=\\([0-9]*\\).*/\\1/p'); \
    echo \"SEEN mem0=${CUDA_DEVICE_MEMORY_LIMIT_0:-none} mem1=${CUDA_DEVICE_MEMORY_LIMIT_1:-none} \
    sm=${CUDA_DEVICE_SM_LIMIT:-none} total=$T\"; cuda_probe limit $T";

/// Proves the limit, then keeps reporting every two seconds until killed (a long-running job).
const REPORT_FOREVER: &str = "while true; do T=$(cuda_probe info | sed -n 's/^total=\\([0-9]*\\).*/\\1/p'); \
    echo \"SEEN mem0=${CUDA_DEVICE_MEMORY_LIMIT_0:-none} mem1=${CUDA_DEVICE_MEMORY_LIMIT_1:-none} \
    sm=${CUDA_DEVICE_SM_LIMIT:-none} total=$T\"; sleep 2; done";

/// A GPU container that reports once (`forever = false`) or keeps reporting.
pub fn container(name: &str, slice: &Slice, forever: bool) -> serde_json::Value {
    json!({
        "name": name,
        "image": PROBE_IMAGE,
        "imagePullPolicy": "Never",
        "command": ["/bin/sh", "-c", if forever { REPORT_FOREVER } else { REPORT_ONCE }],
        "resources": {"limits": slice.resources()},
    })
}

/// A long-running job that loads the shim once (one `cuda_probe steady` process, never a new
/// one): it holds `held_mib` of its slice, then every two seconds prints
/// `STEADY n=<count> info=<cuMemGetInfo's result> total=<bytes> free=<bytes> over=refused|ALLOWED`
/// (`over`: one byte more than the rest of its limit). It shows that a process keeps its limits
/// across what happens on the node after it started (an upgrade replacing the host's shim, a
/// takeover), and its shared region shows what it holds to the node's monitor.
#[derive(Debug, Clone, Copy)]
pub struct Steady {
    pub slice: Slice,
    pub held_mib: u64,
}

const MIB: u64 = 1024 * 1024;

impl Steady {
    /// Its container (one GPU).
    pub fn container(&self, name: &str) -> serde_json::Value {
        let mut c = container(name, &self.slice, true);
        c["command"] = json!([
            "/usr/bin/cuda_probe",
            "steady",
            (self.slice.mem_mib * MIB).to_string(),
            (self.held_mib * MIB).to_string()
        ]);
        c
    }

    /// The count and text of the last `STEADY` line of `logs`.
    pub fn last(logs: &str) -> Option<(u64, String)> {
        let line = logs.lines().rfind(|l| l.starts_with("STEADY "))?;
        let n = line
            .split_whitespace()
            .find_map(|f| f.strip_prefix("n="))?
            .parse()
            .ok()?;
        Some((n, line.to_owned()))
    }

    /// Whether `line` shows this job's limit enforced: `cuMemGetInfo` answered, its total is the
    /// limit, and one byte past the limit was refused.
    pub fn enforced(&self, line: &str) -> bool {
        line.contains(" info=0 ")
            && line.contains(&format!(" total={} ", self.slice.mem_mib * MIB))
            && line.ends_with(" over=refused")
    }

    /// Pod `namespace/pod` is still the pod `uid`, its container never restarted, and its one
    /// process still reports (its count passed `seen`) with its limit enforced. Returns the
    /// count. Panics with the namespace's pods otherwise.
    pub async fn keeps_enforcing(
        &self,
        c: &RealCluster,
        namespace: &str,
        pod: &str,
        uid: &str,
        seen: u64,
        after: &str,
    ) -> u64 {
        let pods: Api<Pod> = Api::namespaced(c.admin().clone(), namespace);
        let r = eventually(
            &format!("{pod} to report again after {after}"),
            Duration::from_secs(60),
            Duration::from_secs(1),
            || async {
                let p = pods.get_opt(pod).await.ok().flatten()?;
                let cs = p.status?.container_statuses?.into_iter().next()?;
                let logs = c.logs(namespace, pod, &cs.name).await.ok()?;
                let (n, line) = Steady::last(&logs)?;
                (n > seen).then_some((
                    p.metadata.uid.unwrap_or_default(),
                    cs.restart_count,
                    n,
                    line,
                ))
            },
        )
        .await;
        let (pod_uid, restarts, n, line) = match r {
            Ok(r) => r,
            Err(e) => panic!("{e}\n{}", c.describe_pods(namespace).await),
        };
        assert_eq!(pod_uid, uid, "{pod} was replaced after {after}");
        assert_eq!(restarts, 0, "{pod} restarted after {after}");
        assert!(
            self.enforced(&line),
            "{pod} after {after}: {line} (wanted info=0, total={}, over=refused)",
            self.slice.mem_mib * MIB
        );
        n
    }

    /// The device plugin on `node` reads pod `pod`'s shared region (written by whichever shim
    /// its process loaded): its memory in use is at least what it holds.
    pub async fn usage_is_read(
        &self,
        c: &RealCluster,
        node: &str,
        pod: &str,
        after: &str,
    ) -> Result<()> {
        let held = (self.held_mib * MIB) as f64;
        eventually(
            &format!("the plugin's hami_vgpu_memory_used_bytes of {pod} after {after}"),
            Duration::from_secs(60),
            Duration::from_secs(1),
            || async {
                let metrics = c.device_plugin_metrics(node).await?;
                metrics
                    .lines()
                    .filter(|l| {
                        l.starts_with("hami_vgpu_memory_used_bytes{")
                            && l.contains(&format!("pod=\"{pod}\""))
                    })
                    .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                    .any(|v| v >= held)
                    .then_some(())
            },
        )
        .await
    }
}

/// A pod that runs once (`restartPolicy: Never`): `init_containers`, then `containers` (JSON
/// containers, e.g. from [`container`]), in `namespace`, pinned to `node` when given.
pub fn pod(
    namespace: &str,
    name: &str,
    node: Option<&str>,
    init_containers: Vec<serde_json::Value>,
    containers: Vec<serde_json::Value>,
) -> Pod {
    let mut spec = json!({"restartPolicy": "Never", "containers": containers});
    if !init_containers.is_empty() {
        spec["initContainers"] = json!(init_containers);
    }
    if let Some(n) = node {
        spec["nodeSelector"] = json!({"kubernetes.io/hostname": n});
    }
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }))
    .expect("a pod built from fixed JSON")
}

/// A pod shape for identity bursts: an optional GPU init container, then the app containers.
/// Every container's (memory, cores) differs from every other shape's, so a swap is always
/// visible.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub tag: &'static str,
    pub init: Option<Slice>,
    pub app: &'static [Slice],
}

/// The card [`SHAPES`] are sized for (`gpumem-percentage` resolves against it): an A100 40 GB.
pub const SHAPE_CARD_MIB: u64 = 40960;

/// Eight shapes: one or two GPUs, `gpumem`, `gpumem-percentage`, `gpucores`, two GPU containers,
/// and two GPU init containers (one with its app container's limits, one with others; the
/// kubelet calls `Allocate` for both containers, the app container reusing the init
/// container's devices).
pub const SHAPES: [Shape; 8] = [
    Shape {
        tag: "m1000",
        init: None,
        app: &[Slice::mib(1, 1000)],
    },
    Shape {
        tag: "m2000c20",
        init: None,
        app: &[Slice::mib(1, 2000).with_cores(20)],
    },
    Shape {
        tag: "m3000",
        init: None,
        app: &[Slice::mib(1, 3000)],
    },
    Shape {
        tag: "two1500",
        init: None,
        app: &[Slice::mib(2, 1500)],
    },
    Shape {
        tag: "pct25",
        init: None,
        app: &[Slice::percent(1, 25, SHAPE_CARD_MIB)],
    },
    Shape {
        tag: "pair",
        init: None,
        app: &[Slice::mib(1, 1200), Slice::mib(1, 2200)],
    },
    Shape {
        tag: "initsame",
        init: Some(Slice::mib(1, 1800)),
        app: &[Slice::mib(1, 1800)],
    },
    Shape {
        tag: "initdiff",
        init: Some(Slice::mib(1, 900)),
        app: &[Slice::mib(1, 2600)],
    },
];

impl Shape {
    /// A one-shot pod of this shape, labelled `shape=<tag>`: `init`, then `app0`, `app1`, …,
    /// each reporting its limits once.
    pub fn pod(&self, namespace: &str, name: &str) -> Pod {
        let init = self
            .init
            .iter()
            .map(|s| container("init", s, false))
            .collect();
        let app = self
            .app
            .iter()
            .enumerate()
            .map(|(i, s)| container(&format!("app{i}"), s, false))
            .collect();
        let mut p = pod(namespace, name, None, init, app);
        p.metadata.labels = Some([("shape".to_owned(), self.tag.to_owned())].into());
        p
    }

    /// Each GPU container's slice, by container name.
    pub fn slices(&self) -> BTreeMap<String, Slice> {
        let mut m: BTreeMap<String, Slice> = self
            .app
            .iter()
            .enumerate()
            .map(|(i, s)| (format!("app{i}"), *s))
            .collect();
        if let Some(s) = self.init {
            m.insert("init".to_owned(), s);
        }
        m
    }
}

/// What a container's logs say about its limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Report {
    /// The last report matches the slice (and the one-shot probe passed).
    Own,
    /// The container reported other limits: another pod's, or none.
    Other(String),
    /// Its own limits, but the probe failed.
    ProbeFailed,
    /// Nothing reported (the container did not get to run its script).
    Silent,
}

/// Judges `logs` against `slice`. `forever` containers are judged by their last report.
pub fn judge(logs: &str, slice: &Slice, forever: bool) -> Report {
    let want = slice.expected_report();
    let seen = logs.lines().rfind(|l| l.starts_with("SEEN "));
    match seen {
        None => Report::Silent,
        Some(s) if s != want => Report::Other(s.to_owned()),
        Some(_) if !forever && !logs.lines().any(|l| l == "OK") => Report::ProbeFailed,
        Some(_) => Report::Own,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_are_judged_against_the_containers_own_slice() {
        let s = Slice::mib(2, 1500).with_cores(20);
        let own = "SEEN mem0=1500m mem1=1500m sm=20 total=1572864000\nOK\n";
        assert_eq!(judge(own, &s, false), Report::Own);
        let other = "SEEN mem0=1000m mem1=none sm=0 total=1048576000\nOK\n";
        assert!(matches!(judge(other, &s, false), Report::Other(_)));
        assert_eq!(
            judge(
                "SEEN mem0=1500m mem1=1500m sm=20 total=1572864000\nFAIL x\n",
                &s,
                false
            ),
            Report::ProbeFailed
        );
        assert_eq!(judge("", &s, false), Report::Silent);
        assert_eq!(
            Slice::percent(1, 25, 40960).resources(),
            json!({"nvidia.com/gpu": 1, "nvidia.com/gpumem-percentage": 25})
        );
    }
}

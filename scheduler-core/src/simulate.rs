//! `tessera-scheduler simulate`: the decision code run offline over a file of objects.

use std::collections::BTreeMap;

use hami_contract::annotations as ann;
use k8s_openapi::api::core::v1::{Node, Pod, ResourceQuota};
use serde::Deserialize;

use crate::config::DecisionConfig;
use crate::decide::{self, NodeFailure, Verdict};
use crate::dra::{DraObjects, DraState};
use crate::fit::FitReason;
use crate::podspec::{self, pod_key};
use crate::preempt;
use crate::quota::QuotaKeys;
use crate::state::{ClusterState, NodeRecord};

/// What simulate says of a pod that uses ResourceClaims and also asks for Tessera's extended
/// resources.
pub const MIXED_DRA_AND_EXTENDER: &str = "the pod uses ResourceClaims and also asks for GPU resources of the device plugin; simulate models one or the other per pod";

/// Why a simulate input could not be read.
#[derive(Debug, thiserror::Error)]
pub enum SimulateError {
    #[error("document {doc}: not valid YAML: {source}")]
    Yaml {
        doc: usize,
        source: yaml_serde::Error,
    },
    #[error("document {doc}: {kind} {name:?}: {source}")]
    Decode {
        doc: usize,
        kind: String,
        name: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("document {doc}: {kind} {name:?}: {problem}")]
    Object {
        doc: usize,
        kind: String,
        name: String,
        problem: &'static str,
    },
}

/// Why the admission webhook would deny a pod of the input ([`admitted`]).
#[derive(Debug, thiserror::Error)]
#[error("the admission webhook would deny this pod: container {container}: {source}")]
pub struct AdmissionDenied {
    pub container: String,
    #[source]
    pub source: hami_contract::request::RequestError,
}

/// The objects of an input file, in file order.
#[derive(Debug, Default)]
pub struct Input {
    pub nodes: Vec<Node>,
    /// Pods already placed (`spec.nodeName` or `hami.io/vgpu-node`, with
    /// `hami.io/vgpu-devices-allocated`).
    pub running: Vec<Pod>,
    /// Pods to place, in file order.
    pub pending: Vec<Pod>,
    pub quotas: Vec<ResourceQuota>,
    /// ResourceSlices, ResourceClaims, ResourceClaimTemplates and DeviceClasses, for the pods
    /// that use claims ([`crate::dra`]).
    pub dra: DraObjects,
    /// Kinds that were skipped (reported on stderr by the CLI).
    pub ignored: Vec<String>,
}

fn object_name(v: &serde_json::Value) -> String {
    let m = &v["metadata"];
    match (m["namespace"].as_str(), m["name"].as_str()) {
        (Some(ns), Some(n)) => format!("{ns}/{n}"),
        (None, Some(n)) => n.to_owned(),
        _ => String::new(),
    }
}

/// An object of the input as its Kubernetes type.
fn typed<T: serde::de::DeserializeOwned>(
    v: &serde_json::Value,
    err: impl Fn(serde_json::Error) -> SimulateError,
) -> Result<T, SimulateError> {
    serde_json::from_value(v.clone()).map_err(err)
}

fn is_placed(pod: &Pod) -> bool {
    let annotations = pod.metadata.annotations.as_ref();
    let has = |k: &str| annotations.is_some_and(|a| a.contains_key(k));
    let bound = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .is_some_and(|n| !n.is_empty());
    bound || (has(ann::VGPU_NODE) && has(ann::DEVICES_ALLOCATED))
}

impl Input {
    /// The cluster the input describes, before any pending pod is placed: its GPU nodes (and
    /// their names, in input order), the placed pods and the quotas.
    pub fn state(&self, cfg: &DecisionConfig) -> (ClusterState, Vec<String>) {
        let mut state = ClusterState::new();
        let keys = QuotaKeys::new(&cfg.nvidia.resources, cfg.nvidia.effective_memory_factor());
        let mut names = Vec::new();
        for n in &self.nodes {
            if let Some(rec) = NodeRecord::from_node(n, cfg) {
                names.push(rec.name.clone());
                state.upsert_node(rec);
            }
        }
        for p in &self.running {
            state.upsert_pod(&with_uid(p));
        }
        for q in &self.quotas {
            let mut q = q.clone();
            if q.metadata.namespace.is_none() {
                q.metadata.namespace = Some("default".to_owned());
            }
            state.upsert_quota(&q, &keys);
        }
        (state, names)
    }

    /// Adds a pod: to the placed ones if it is bound or carries a placement, else to the pods
    /// to place.
    pub fn add_pod(&mut self, pod: Pod) {
        if is_placed(&pod) {
            self.running.push(pod);
        } else {
            self.pending.push(pod);
        }
    }

    /// Reads multi-document YAML (or JSON); a `List` (`v1 List`, `NodeList`, …) is unpacked.
    pub fn parse(text: &str) -> Result<Self, SimulateError> {
        let mut input = Input::default();
        input.add_text(text)?;
        Ok(input)
    }

    /// Adds the objects of another file (documents are numbered within each file).
    pub fn add_text(&mut self, text: &str) -> Result<(), SimulateError> {
        for (i, doc) in yaml_serde::Deserializer::from_str(text).enumerate() {
            let doc_no = i + 1;
            let value =
                yaml_serde::Value::deserialize(doc).map_err(|source| SimulateError::Yaml {
                    doc: doc_no,
                    source,
                })?;
            if value.is_null() {
                continue;
            }
            let json = serde_json::to_value(&value).map_err(|source| SimulateError::Decode {
                doc: doc_no,
                kind: String::new(),
                name: String::new(),
                source,
            })?;
            self.add(doc_no, json)?;
        }
        Ok(())
    }

    fn add(&mut self, doc: usize, v: serde_json::Value) -> Result<(), SimulateError> {
        let kind = v["kind"].as_str().unwrap_or("").to_owned();
        let err = |source: serde_json::Error| SimulateError::Decode {
            doc,
            kind: kind.clone(),
            name: object_name(&v),
            source,
        };
        let invalid = |problem: &'static str| SimulateError::Object {
            doc,
            kind: kind.clone(),
            name: object_name(&v),
            problem,
        };
        match kind.as_str() {
            k if k == "List" || k.ends_with("List") => {
                let items = v["items"].as_array().cloned().unwrap_or_default();
                for item in items {
                    self.add(doc, item)?;
                }
            }
            "Node" => self.nodes.push(typed(&v, err)?),
            "Pod" => {
                let pod: Pod = typed(&v, err)?;
                if pod.metadata.name.is_none() {
                    return Err(invalid("metadata.name is required"));
                }
                self.add_pod(pod);
            }
            "ResourceQuota" => self.quotas.push(typed(&v, err)?),
            "" => return Err(invalid("object has no kind")),
            "ResourceSlice" => self.dra.slices.push(typed(&v, err)?),
            "ResourceClaim" => self.dra.claims.push(typed(&v, err)?),
            "ResourceClaimTemplate" => self.dra.templates.push(typed(&v, err)?),
            "DeviceClass" => self.dra.classes.push(typed(&v, err)?),
            other => self.ignored.push(format!("{other} {}", object_name(&v))),
        }
        Ok(())
    }
}

/// One line of simulate output.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PodResult {
    pub pod: String,
    pub node: Option<String>,
    /// HAMi's container device list for the chosen node; empty when not placed.
    pub devices: String,
    /// Why each node that was not chosen did not fit.
    pub reasons: BTreeMap<String, String>,
    /// Set when the pod could not be evaluated at all.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Per refusing node, one line per MIG GPU: what the pod asked and which placements of
    /// which profiles are free there.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub mig: BTreeMap<String, Vec<String>>,
    /// What simulate did not evaluate for this pod (DRA: CEL selectors, …).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
    /// Every node the pod fits, with the score the node policy ranks them by (the chosen node's
    /// included; binpack prefers the highest, spread the lowest).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub scores: BTreeMap<String, f32>,
    /// Refusing nodes where evicting every pod would still not make room (a card too small or of
    /// the wrong type, too few cards, …): kube-scheduler gets them as
    /// `FailedAndUnresolvableNodes`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub never_fits: Vec<String>,
    /// For a pod that fits nowhere: per node where preemption would make room, the lower-priority
    /// GPU pods it would evict and the GPUs that frees (what the extender's `/preempt` answers
    /// kube-scheduler; kube-scheduler's own victims for CPU or memory are not modelled).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub preemption: BTreeMap<String, String>,
}

/// The results as a table for a terminal: pod, node, the slice on each GPU, the chosen node's
/// score, and why not elsewhere (or, for a pod that fits nowhere, why not anywhere).
pub fn table(results: &[PodResult]) -> String {
    let rows: Vec<[String; 5]> = results
        .iter()
        .map(|r| {
            let node = r.node.clone().unwrap_or_else(|| "pending".to_owned());
            let slices = slices(&r.devices);
            let score = r
                .node
                .as_ref()
                .and_then(|n| r.scores.get(n))
                .map_or_else(|| "-".to_owned(), |s| format!("{s:.2}"));
            let why = match &r.error {
                Some(e) => e.clone(),
                None => r
                    .reasons
                    .iter()
                    .map(|(n, why)| {
                        let never = if r.never_fits.contains(n) {
                            " (even if emptied)"
                        } else {
                            ""
                        };
                        format!("{n}: {why}{never}")
                    })
                    .collect::<Vec<_>>()
                    .join("; "),
            };
            let why = if r.preemption.is_empty() {
                why
            } else {
                let evict: Vec<String> = r
                    .preemption
                    .iter()
                    .map(|(n, what)| format!("{n}: {what}"))
                    .collect();
                format!("{why}; by preemption: {}", evict.join("; "))
            };
            [r.pod.clone(), node, slices, score, why]
        })
        .collect();
    crate::text::table(
        [
            "POD",
            "NODE",
            "GPU SLICES",
            "SCORE",
            "WHY NOT ELSEWHERE / WHY PENDING",
        ],
        &rows,
    )
}

/// HAMi's device list as a reader wants it: per container, each GPU's memory and cores
/// (`GPU-t4-1 4000 MiB 20%`), containers separated by ` | `; the text itself when it is not
/// HAMi's form (a DRA claim's devices).
pub fn slices(devices: &str) -> String {
    if devices.is_empty() {
        return "-".to_owned();
    }
    match hami_contract::PodDevices::decode(devices) {
        Ok(pod) => pod
            .0
            .iter()
            .filter(|c| !c.is_empty())
            .map(|c| {
                c.iter()
                    .map(|d| format!("{} {} MiB {}%", d.uuid, d.usedmem, d.usedcores))
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .collect::<Vec<_>>()
            .join(" | "),
        Err(_) => devices.to_owned(),
    }
}

/// Why the MIG GPUs of the nodes that refused `pod` with `CardMigTopologyInfeasible` did: the
/// largest memory one of its devices asks for, against each profile's free placements.
fn explain_mig(
    state: &ClusterState,
    cfg: &DecisionConfig,
    pod: &Pod,
    uid: &str,
    failed: &BTreeMap<String, NodeFailure>,
) -> BTreeMap<String, Vec<String>> {
    let (ask, _) = podspec::pod_ask(pod, &cfg.nvidia);
    let requests: Vec<_> = ask.init.iter().chain(&ask.app).flatten().collect();
    let mut out = BTreeMap::new();
    for (node, reason) in failed {
        let NodeFailure::Fit(fit) = reason else {
            continue;
        };
        if !fit.has(FitReason::CardMigTopologyInfeasible) {
            continue;
        }
        let Some(ns) = state.node_state(node, Some(uid)) else {
            continue;
        };
        let mut lines = Vec::new();
        for g in &ns.gpus {
            let Some(mig) = &g.mig else { continue };
            let want = requests
                .iter()
                .map(|r| r.memory_on(g.totalmem))
                .max()
                .unwrap_or(0);
            let free: Vec<String> = mig
                .free_placements()
                .into_iter()
                .map(|(p, free)| {
                    let at: Vec<String> = free.iter().map(|pl| pl.start.to_string()).collect();
                    if at.is_empty() {
                        format!("{} ({} MiB): none", p.name, p.memory_mb)
                    } else {
                        format!("{} ({} MiB) at {}", p.name, p.memory_mb, at.join(","))
                    }
                })
                .collect();
            let verdict = if mig
                .select(&mig.occupied().collect::<Vec<_>>(), want)
                .is_some()
            {
                "a profile fits"
            } else {
                "no free placement for a profile"
            };
            lines.push(format!(
                "GPU {} ({}): {verdict} with >= {want} MiB; free: {}",
                g.index,
                g.uuid,
                if free.is_empty() {
                    "no profiles".to_owned()
                } else {
                    free.join("; ")
                }
            ));
        }
        if !lines.is_empty() {
            out.insert(node.clone(), lines);
        }
    }
    out
}

/// The reasons as simulate prints them (the extender's `FailedNodes` strings).
fn reason_strings(failed: BTreeMap<String, NodeFailure>) -> BTreeMap<String, String> {
    failed
        .into_iter()
        .map(|(node, why)| (node, why.to_string()))
        .collect()
}

fn uid_of(pod: &Pod) -> String {
    pod.metadata
        .uid
        .clone()
        .unwrap_or_else(|| format!("simulate:{}", pod_key(pod)))
}

/// Applies the webhook's resource defaults (count, `gpucores: 100` for whole cards) the way the
/// admission webhook would have before the pod reached the scheduler.
fn admitted(pod: &Pod, cfg: &DecisionConfig) -> Result<Pod, AdmissionDenied> {
    let mut p = pod.clone();
    let Some(spec) = p.spec.as_mut() else {
        return Ok(p);
    };
    let containers = spec
        .init_containers
        .iter_mut()
        .flatten()
        .chain(spec.containers.iter_mut());
    for c in containers {
        let res = podspec::container_resources(c);
        let m = hami_contract::request::webhook_mutation(&res, &cfg.nvidia).map_err(|source| {
            AdmissionDenied {
                container: c.name.clone(),
                source,
            }
        })?;
        if m.add_limits.is_empty() {
            continue;
        }
        let limits = c
            .resources
            .get_or_insert_with(Default::default)
            .limits
            .get_or_insert_with(Default::default);
        for (k, v) in m.add_limits {
            limits.insert(
                k,
                k8s_openapi::apimachinery::pkg::api::resource::Quantity(v),
            );
        }
    }
    Ok(p)
}

fn with_uid(pod: &Pod) -> Pod {
    let mut p = pod.clone();
    p.metadata.uid = Some(uid_of(pod));
    if p.metadata.namespace.is_none() {
        p.metadata.namespace = Some("default".to_owned());
    }
    p
}

/// What simulate leaves out of `input`, and why (objects it cannot use as given).
pub fn input_warnings(input: &Input) -> Vec<String> {
    DraState::new(&input.dra).warnings
}

/// The error of a GPU pod when the input has no node that takes GPU pods: no answer about
/// fitting can be given (an empty `reasons` would read as "fits nowhere, for no reason").
pub const NO_GPU_NODES: &str = "the input has no node that takes GPU pods: add the cluster's Nodes \
    (`kubectl get nodes -o yaml`), with the device plugin's register annotation \
    hami.io/node-nvidia-register";

/// Places every pending pod in file order; each placement books capacity for the next.
pub fn run(input: &Input, cfg: &DecisionConfig) -> Vec<PodResult> {
    // Why not elsewhere is half of simulate's answer.
    let cfg = &DecisionConfig {
        reasons_when_placed: true,
        ..cfg.clone()
    };
    let (mut state, names) = input.state(cfg);
    let mut dra = DraState::new(&input.dra);
    let mut out = Vec::new();
    for (tick, pod) in input.pending.iter().enumerate() {
        let pod = with_uid(pod);
        let uid = uid_of(&pod);
        let mut result = PodResult {
            pod: pod_key(&pod),
            node: None,
            devices: String::new(),
            reasons: BTreeMap::new(),
            error: None,
            mig: BTreeMap::new(),
            notes: Vec::new(),
            scores: BTreeMap::new(),
            never_fits: Vec::new(),
            preemption: BTreeMap::new(),
        };
        let uses_claims = pod
            .spec
            .as_ref()
            .and_then(|s| s.resource_claims.as_ref())
            .is_some_and(|c| !c.is_empty());
        if uses_claims {
            if !podspec::pod_ask(&pod, &cfg.nvidia).0.is_empty() {
                result.error = Some(MIXED_DRA_AND_EXTENDER.to_owned());
            } else {
                let placed = dra.place(&pod);
                result.node = placed.node;
                result.devices = placed.devices.join("; ");
                result.reasons = placed.reasons;
                result.notes = placed.notes;
                result.error = placed.error;
            }
            out.push(result);
            continue;
        }
        let pod = match admitted(&pod, cfg) {
            Ok(p) => p,
            Err(e) => {
                result.error = Some(e.to_string());
                out.push(result);
                continue;
            }
        };
        state.upsert_pod(&pod);
        match decide::filter_pod(&mut state, cfg, &pod, &uid, &names) {
            Verdict::NotGpu => {
                result.error = Some(
                    "the pod requests no GPU resource managed by Tessera; kube-scheduler places it without the extender".to_owned(),
                );
            }
            Verdict::Invalid(e) => result.error = Some(e.to_string()),
            Verdict::NoFit { failed, .. } if failed.is_empty() && names.is_empty() => {
                result.error = Some(NO_GPU_NODES.to_owned());
            }
            Verdict::NoFit {
                failed,
                unresolvable,
            } => {
                result.mig = explain_mig(&state, cfg, &pod, &uid, &failed);
                let proposed = failed
                    .keys()
                    .filter(|n| !unresolvable.contains(*n))
                    .map(|n| (n.clone(), preempt::Victims::default()))
                    .collect();
                let (chosen, _) = preempt::preempt(&mut state, cfg, &pod, &uid, &proposed, &[]);
                result.preemption = chosen
                    .into_iter()
                    .map(|(node, v)| (node, v.what_it_frees()))
                    .collect();
                result.reasons = reason_strings(failed);
                result.never_fits = unresolvable.into_iter().collect();
            }
            Verdict::Placed(p) => {
                let r = decide::reservation_for(&pod, &uid, &p, tick as u64);
                state.reserve(r);
                result.scores = p.fitting.iter().map(|(n, s)| (n.to_string(), *s)).collect();
                result.node = Some(p.node.clone());
                result.devices = p.devices.encode();
                result.reasons = reason_strings(p.failed);
            }
        }
        out.push(result);
    }
    out
}

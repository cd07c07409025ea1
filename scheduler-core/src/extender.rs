//! kube-scheduler extender v1 wire types (`k8s.io/kube-scheduler/extender/v1`).
//!
//! The Go structs have no JSON tags: kube-scheduler sends PascalCase keys and decodes answers
//! case-insensitively. We answer in PascalCase with Go's `null`s and accept any key casing.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, Pod};
use serde::Serialize;
use serde_json::Value;

use crate::decide::NodeFailure;

/// Why an extender request body was refused.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("request body is not valid JSON: {0}")]
    Json(#[source] serde_json::Error),
    #[error("request body must be a JSON object")]
    NotAnObject,
    /// A field does not decode as its type.
    #[error("{field}: {source}")]
    Decode {
        field: &'static str,
        #[source]
        source: serde_json::Error,
    },
    /// A field has the right type but not an accepted value.
    #[error("{field}: {problem}")]
    Field {
        field: &'static str,
        problem: &'static str,
    },
}

/// Case-insensitive lookup of a top-level key (Go's `encoding/json` matching).
fn field<'a>(obj: &'a serde_json::Map<String, Value>, name: &str) -> Option<&'a Value> {
    obj.get(name).or_else(|| {
        obj.iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v)
    })
}

fn object(body: &[u8]) -> Result<serde_json::Map<String, Value>, WireError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(WireError::NotAnObject),
        Err(e) => Err(WireError::Json(e)),
    }
}

/// An answer as kube-scheduler reads it; `Error` alone if it cannot be encoded.
fn answer_json(answer: &impl Serialize) -> String {
    serde_json::to_string(answer).unwrap_or_else(|_| r#"{"Error":"encoding failed"}"#.to_owned())
}

/// `ExtenderArgs`.
#[derive(Debug, Clone)]
pub struct ExtenderArgs {
    pub pod: Option<Pod>,
    /// Full node objects (`nodeCacheCapable: false`), kept raw so they can be echoed back.
    pub nodes: Option<Vec<(Node, Value)>>,
    pub node_names: Option<Vec<String>>,
}

impl ExtenderArgs {
    pub fn decode(body: &[u8]) -> Result<Self, WireError> {
        let obj = object(body)?;
        let pod = match field(&obj, "Pod") {
            None | Some(Value::Null) => None,
            Some(v) => Some(serde_json::from_value::<Pod>(v.clone()).map_err(|source| {
                WireError::Decode {
                    field: "Pod",
                    source,
                }
            })?),
        };
        let nodes = match field(&obj, "Nodes") {
            None | Some(Value::Null) => None,
            Some(v) => {
                let items = match v {
                    Value::Object(list) => match field(list, "items") {
                        Some(Value::Array(a)) => a.clone(),
                        None | Some(Value::Null) => Vec::new(),
                        Some(_) => {
                            return Err(WireError::Field {
                                field: "Nodes",
                                problem: "items must be an array",
                            });
                        }
                    },
                    _ => {
                        return Err(WireError::Field {
                            field: "Nodes",
                            problem: "must be a NodeList object",
                        });
                    }
                };
                let mut nodes = Vec::with_capacity(items.len());
                for item in items {
                    let node = serde_json::from_value::<Node>(item.clone()).map_err(|source| {
                        WireError::Decode {
                            field: "Nodes",
                            source,
                        }
                    })?;
                    nodes.push((node, item));
                }
                Some(nodes)
            }
        };
        let node_names = match field(&obj, "NodeNames") {
            None | Some(Value::Null) => None,
            Some(v) => Some(serde_json::from_value::<Vec<String>>(v.clone()).map_err(
                |source| WireError::Decode {
                    field: "NodeNames",
                    source,
                },
            )?),
        };
        Ok(ExtenderArgs {
            pod,
            nodes,
            node_names,
        })
    }
}

/// A NodeList as Go marshals `*v1.NodeList`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NodeListOut {
    pub metadata: BTreeMap<String, Value>,
    pub items: Vec<Value>,
}

/// `ExtenderFilterResult`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderFilterResult {
    pub nodes: Option<NodeListOut>,
    pub node_names: Option<Vec<String>>,
    /// Why each refused node was refused (each serialized as HAMi's reason string).
    pub failed_nodes: Option<BTreeMap<String, NodeFailure>>,
    pub failed_and_unresolvable_nodes: Option<BTreeMap<String, String>>,
    pub error: String,
}

impl ExtenderFilterResult {
    /// The answer for a pod that fits none of the candidates: the nodes where preemption cannot
    /// help (`unresolvable`) go to `FailedAndUnresolvableNodes`, so kube-scheduler runs no
    /// preemption dry run there; the rest to `FailedNodes`. Each with HAMi's reason string.
    pub fn no_fit(
        failed: BTreeMap<String, NodeFailure>,
        unresolvable: &std::collections::BTreeSet<String>,
    ) -> Self {
        let (never, maybe): (BTreeMap<_, _>, BTreeMap<_, _>) = failed
            .into_iter()
            .partition(|(name, _)| unresolvable.contains(name));
        ExtenderFilterResult {
            failed_nodes: Some(maybe),
            failed_and_unresolvable_nodes: (!never.is_empty()).then(|| {
                never
                    .into_iter()
                    .map(|(name, why)| (name, why.to_string()))
                    .collect()
            }),
            ..Default::default()
        }
    }

    pub fn error(msg: impl Into<String>) -> Self {
        ExtenderFilterResult {
            error: msg.into(),
            ..Default::default()
        }
    }

    pub fn to_json(&self) -> String {
        answer_json(self)
    }
}

/// `ExtenderBindingArgs`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtenderBindingArgs {
    pub pod_name: String,
    pub pod_namespace: String,
    pub pod_uid: String,
    pub node: String,
}

impl ExtenderBindingArgs {
    pub fn decode(body: &[u8]) -> Result<Self, WireError> {
        let obj = object(body)?;
        let text = |name: &'static str| -> Result<String, WireError> {
            match field(&obj, name) {
                Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
                None | Some(Value::Null) => Err(WireError::Field {
                    field: name,
                    problem: "missing",
                }),
                Some(Value::String(_)) => Err(WireError::Field {
                    field: name,
                    problem: "empty",
                }),
                Some(_) => Err(WireError::Field {
                    field: name,
                    problem: "must be a string",
                }),
            }
        };
        Ok(ExtenderBindingArgs {
            pod_name: text("PodName")?,
            pod_namespace: text("PodNamespace")?,
            pod_uid: text("PodUID")?,
            node: text("Node")?,
        })
    }
}

/// `ExtenderBindingResult`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderBindingResult {
    pub error: String,
}

impl ExtenderBindingResult {
    pub fn to_json(&self) -> String {
        answer_json(self)
    }
}

/// `ExtenderPreemptionArgs`: the pod and kube-scheduler's victims per candidate node, as pod
/// UIDs (`NodeNameToMetaVictims`, `nodeCacheCapable: true`) or as whole pods
/// (`NodeNameToVictims`, of which only the UIDs are read).
#[derive(Debug, Clone)]
pub struct ExtenderPreemptionArgs {
    pub pod: Pod,
    pub victims: BTreeMap<String, crate::preempt::Victims>,
}

/// The UIDs of a `Pods` list of `MetaVictims` (`[{"UID": …}]`) or of `Victims` (whole pods,
/// `[{"metadata": {"uid": …}}]`).
fn victim_uids(pods: &Value, field_name: &'static str) -> Result<Vec<String>, WireError> {
    let bad = |problem| WireError::Field {
        field: field_name,
        problem,
    };
    let items = match pods {
        Value::Null => return Ok(Vec::new()),
        Value::Array(a) => a,
        _ => return Err(bad("Pods must be an array")),
    };
    items
        .iter()
        .map(|item| {
            let Value::Object(o) = item else {
                return Err(bad("each victim must be an object"));
            };
            let uid = field(o, "UID").or_else(|| match field(o, "metadata") {
                Some(Value::Object(m)) => field(m, "uid"),
                _ => None,
            });
            match uid {
                Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
                _ => Err(bad("a victim has no UID")),
            }
        })
        .collect()
}

impl ExtenderPreemptionArgs {
    pub fn decode(body: &[u8]) -> Result<Self, WireError> {
        let obj = object(body)?;
        let pod = match field(&obj, "Pod") {
            None | Some(Value::Null) => {
                return Err(WireError::Field {
                    field: "Pod",
                    problem: "missing",
                });
            }
            Some(v) => {
                serde_json::from_value::<Pod>(v.clone()).map_err(|source| WireError::Decode {
                    field: "Pod",
                    source,
                })?
            }
        };
        let mut victims = BTreeMap::new();
        for field_name in ["NodeNameToMetaVictims", "NodeNameToVictims"] {
            match field(&obj, field_name) {
                None | Some(Value::Null) => continue,
                Some(Value::Object(nodes)) => {
                    for (node, v) in nodes {
                        let Value::Object(v) = v else {
                            return Err(WireError::Field {
                                field: field_name,
                                problem: "each node's victims must be an object",
                            });
                        };
                        let pods =
                            victim_uids(field(v, "Pods").unwrap_or(&Value::Null), field_name)?;
                        let pdb_violations = match field(v, "NumPDBViolations") {
                            None | Some(Value::Null) => 0,
                            Some(n) => n.as_i64().ok_or(WireError::Field {
                                field: field_name,
                                problem: "NumPDBViolations must be an integer",
                            })?,
                        };
                        victims.insert(
                            node.clone(),
                            crate::preempt::Victims {
                                pods,
                                pdb_violations,
                            },
                        );
                    }
                }
                Some(_) => {
                    return Err(WireError::Field {
                        field: field_name,
                        problem: "must be an object of node names",
                    });
                }
            }
        }
        Ok(ExtenderPreemptionArgs { pod, victims })
    }
}

/// `MetaPod`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MetaPod {
    #[serde(rename = "UID")]
    pub uid: String,
}

/// `MetaVictims`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct MetaVictims {
    pub pods: Vec<MetaPod>,
    #[serde(rename = "NumPDBViolations")]
    pub num_pdb_violations: i64,
}

/// `ExtenderPreemptionResult`: the nodes where preemption helps, each with a non-empty victim
/// list (kube-scheduler refuses an empty one); a node left out is not preempted on. kube-scheduler
/// has no error field here: a request it cannot use is answered with an HTTP error.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderPreemptionResult {
    pub node_name_to_meta_victims: BTreeMap<String, MetaVictims>,
}

impl ExtenderPreemptionResult {
    pub fn from_victims(chosen: &BTreeMap<String, crate::preempt::NodeVictims>) -> Self {
        ExtenderPreemptionResult {
            node_name_to_meta_victims: chosen
                .iter()
                .filter(|(_, v)| !v.pods.is_empty())
                .map(|(node, v)| {
                    (
                        node.clone(),
                        MetaVictims {
                            pods: v
                                .pods
                                .iter()
                                .map(|uid| MetaPod { uid: uid.clone() })
                                .collect(),
                            num_pdb_violations: v.pdb_violations,
                        },
                    )
                })
                .collect(),
        }
    }

    pub fn to_json(&self) -> String {
        answer_json(self)
    }
}

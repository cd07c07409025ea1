//! kube-scheduler extender v1 wire types (`k8s.io/kube-scheduler/extender/v1`).
//!
//! The Go structs have no JSON tags: kube-scheduler sends PascalCase keys and decodes answers
//! case-insensitively. We answer in PascalCase with Go's `null`s and accept any key casing.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, Pod};
use serde::Serialize;
use serde_json::Value;

/// Why an extender request body was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("request body is not valid JSON: {0}")]
    Json(String),
    #[error("request body must be a JSON object")]
    NotAnObject,
    #[error("{field}: {problem}")]
    Field {
        field: &'static str,
        problem: String,
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
        Err(e) => Err(WireError::Json(e.to_string())),
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
        let pod =
            match field(&obj, "Pod") {
                None | Some(Value::Null) => None,
                Some(v) => Some(serde_json::from_value::<Pod>(v.clone()).map_err(|e| {
                    WireError::Field {
                        field: "Pod",
                        problem: e.to_string(),
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
                                problem: "items must be an array".to_owned(),
                            });
                        }
                    },
                    _ => {
                        return Err(WireError::Field {
                            field: "Nodes",
                            problem: "must be a NodeList object".to_owned(),
                        });
                    }
                };
                let mut nodes = Vec::with_capacity(items.len());
                for item in items {
                    let node = serde_json::from_value::<Node>(item.clone()).map_err(|e| {
                        WireError::Field {
                            field: "Nodes",
                            problem: e.to_string(),
                        }
                    })?;
                    nodes.push((node, item));
                }
                Some(nodes)
            }
        };
        let node_names = match field(&obj, "NodeNames") {
            None | Some(Value::Null) => None,
            Some(v) => Some(
                serde_json::from_value::<Vec<String>>(v.clone()).map_err(|e| WireError::Field {
                    field: "NodeNames",
                    problem: e.to_string(),
                })?,
            ),
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
    pub failed_nodes: Option<BTreeMap<String, String>>,
    pub failed_and_unresolvable_nodes: Option<BTreeMap<String, String>>,
    pub error: String,
}

impl ExtenderFilterResult {
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
                    problem: "missing".to_owned(),
                }),
                Some(Value::String(_)) => Err(WireError::Field {
                    field: name,
                    problem: "empty".to_owned(),
                }),
                Some(_) => Err(WireError::Field {
                    field: name,
                    problem: "must be a string".to_owned(),
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

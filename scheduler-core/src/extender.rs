//! kube-scheduler extender v1 wire types (`k8s.io/kube-scheduler/extender/v1`).
//!
//! The Go structs have no JSON tags: kube-scheduler sends PascalCase keys and decodes answers
//! case-insensitively. We answer in PascalCase with Go's `null`s and accept any key casing.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, Pod};
use serde::Serialize;
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::Value;
use serde_json::value::RawValue;

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

/// Case-insensitive lookup of a key in a decoded object (Go's `encoding/json` matching): the
/// nested objects of `/preempt`'s victims, a rare and small request.
fn field<'a>(obj: &'a serde_json::Map<String, Value>, name: &str) -> Option<&'a Value> {
    obj.get(name).or_else(|| {
        obj.iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v)
    })
}

/// The named keys of one JSON object, each as its unparsed text (`None` when absent or `null`),
/// matched as Go's `encoding/json` matches struct fields: an exact key first, else one equal
/// ignoring ASCII case (the last such wins); other keys are skipped without being built.
///
/// Why not a `serde_json::Value`: `/filter` carries a whole pod and hundreds of node names per
/// scheduling cycle; building a tree of them and decoding the types again from the tree cost an
/// allocation per JSON value twice over. Each field is decoded once, from its text, into its type.
fn object_fields<'de, const N: usize>(
    body: &'de [u8],
    names: [&'static str; N],
) -> Result<[Option<&'de RawValue>; N], WireError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let picked = FieldPicker { names }
        .deserialize(&mut de)
        .and_then(|fields| de.end().map(|()| fields));
    match picked {
        Ok(fields) => Ok(fields.map(|f| f.filter(|raw| raw.get() != "null"))),
        // Valid JSON of another type is not an object; anything else is not JSON.
        Err(_) if serde_json::from_slice::<IgnoredAny>(body).is_ok() => Err(WireError::NotAnObject),
        Err(e) => Err(WireError::Json(e)),
    }
}

/// [`object_fields`]' visitor.
struct FieldPicker<const N: usize> {
    names: [&'static str; N],
}

impl<'de, const N: usize> DeserializeSeed<'de> for FieldPicker<N> {
    type Value = [Option<&'de RawValue>; N];

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<Self::Value, D::Error> {
        de.deserialize_map(self)
    }
}

impl<'de, const N: usize> Visitor<'de> for FieldPicker<N> {
    type Value = [Option<&'de RawValue>; N];

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut exact: [Option<&'de RawValue>; N] = [None; N];
        let mut folded: [Option<&'de RawValue>; N] = [None; N];
        // Keys are few (three or four at the top level); an escaped key needs its own string.
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            if let Some(i) = self.names.iter().position(|n| *n == key) {
                exact[i] = Some(map.next_value()?);
            } else if let Some(i) = self.names.iter().position(|n| n.eq_ignore_ascii_case(&key)) {
                folded[i] = Some(map.next_value()?);
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(std::array::from_fn(|i| exact[i].or(folded[i])))
    }
}

/// One field's text decoded into its type, an error naming the field.
fn decode_field<'de, T: serde::Deserialize<'de>>(
    raw: &'de RawValue,
    field: &'static str,
) -> Result<T, WireError> {
    serde_json::from_str(raw.get()).map_err(|source| WireError::Decode { field, source })
}

/// An answer as kube-scheduler reads it; `Error` alone if it cannot be encoded.
fn answer_json(answer: &impl Serialize) -> String {
    serde_json::to_string(answer).unwrap_or_else(|_| r#"{"Error":"encoding failed"}"#.to_owned())
}

/// `ExtenderArgs`.
#[derive(Debug, Clone)]
pub struct ExtenderArgs {
    pub pod: Option<Pod>,
    /// Full node objects (`nodeCacheCapable: false`), each with its text as received so the
    /// chosen one is echoed back unchanged.
    pub nodes: Option<Vec<(Node, Box<RawValue>)>>,
    pub node_names: Option<Vec<String>>,
}

impl ExtenderArgs {
    pub fn decode(body: &[u8]) -> Result<Self, WireError> {
        let [pod, nodes, node_names] = object_fields(body, ["Pod", "Nodes", "NodeNames"])?;
        let pod = pod.map(|raw| decode_field::<Pod>(raw, "Pod")).transpose()?;
        let nodes = nodes.map(decode_node_list).transpose()?;
        let node_names = node_names
            .map(|raw| decode_field::<Vec<String>>(raw, "NodeNames"))
            .transpose()?;
        Ok(ExtenderArgs {
            pod,
            nodes,
            node_names,
        })
    }
}

/// The `Nodes` field: a NodeList whose `items` are decoded one by one and kept as text.
fn decode_node_list(raw: &RawValue) -> Result<Vec<(Node, Box<RawValue>)>, WireError> {
    let [items] = object_fields(raw.get().as_bytes(), ["items"]).map_err(|_| WireError::Field {
        field: "Nodes",
        problem: "must be a NodeList object",
    })?;
    let Some(items) = items else {
        return Ok(Vec::new());
    };
    let items: Vec<&RawValue> =
        serde_json::from_str(items.get()).map_err(|_| WireError::Field {
            field: "Nodes",
            problem: "items must be an array",
        })?;
    items
        .into_iter()
        .map(|item| Ok((decode_field::<Node>(item, "Nodes")?, item.to_owned())))
        .collect()
}

/// A NodeList as Go marshals `*v1.NodeList`.
#[derive(Debug, Clone, Serialize)]
pub struct NodeListOut {
    pub metadata: BTreeMap<String, Value>,
    pub items: Vec<Box<RawValue>>,
}

/// `ExtenderFilterResult`.
#[derive(Debug, Clone, Default, Serialize)]
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
        let [pod_name, pod_namespace, pod_uid, node] =
            object_fields(body, ["PodName", "PodNamespace", "PodUID", "Node"])?;
        let text = |raw: Option<&RawValue>, field: &'static str| {
            let problem = match raw.map(|raw| decode_field::<String>(raw, field)) {
                Some(Ok(s)) if !s.is_empty() => return Ok(s),
                None => "missing",
                Some(Ok(_)) => "empty",
                Some(Err(_)) => "must be a string",
            };
            Err(WireError::Field { field, problem })
        };
        Ok(ExtenderBindingArgs {
            pod_name: text(pod_name, "PodName")?,
            pod_namespace: text(pod_namespace, "PodNamespace")?,
            pod_uid: text(pod_uid, "PodUID")?,
            node: text(node, "Node")?,
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
        const NAMES: [&str; 3] = ["Pod", "NodeNameToMetaVictims", "NodeNameToVictims"];
        let [pod, meta_victims, victim_pods] = object_fields(body, NAMES)?;
        let Some(pod) = pod else {
            return Err(WireError::Field {
                field: "Pod",
                problem: "missing",
            });
        };
        let pod = decode_field::<Pod>(pod, "Pod")?;
        let mut victims = BTreeMap::new();
        for (field_name, raw) in [
            ("NodeNameToMetaVictims", meta_victims),
            ("NodeNameToVictims", victim_pods),
        ] {
            let Some(raw) = raw else { continue };
            let Ok(nodes) = serde_json::from_str::<serde_json::Map<String, Value>>(raw.get())
            else {
                return Err(WireError::Field {
                    field: field_name,
                    problem: "must be an object of node names",
                });
            };
            for (node, v) in nodes {
                let Value::Object(v) = v else {
                    return Err(WireError::Field {
                        field: field_name,
                        problem: "each node's victims must be an object",
                    });
                };
                let pods = victim_uids(field(&v, "Pods").unwrap_or(&Value::Null), field_name)?;
                let pdb_violations = match field(&v, "NumPDBViolations") {
                    None | Some(Value::Null) => 0,
                    Some(n) => n.as_i64().ok_or(WireError::Field {
                        field: field_name,
                        problem: "NumPDBViolations must be an integer",
                    })?,
                };
                victims.insert(
                    node,
                    crate::preempt::Victims {
                        pods,
                        pdb_violations,
                    },
                );
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn an_exact_key_wins_over_one_of_another_case_and_unknown_keys_are_skipped() {
        let body = br#"{"nodenames":["folded"],"Extra":{"deep":[1,2,{"x":null}]},"NodeNames":["exact"],"NODENAMES":["late"]}"#;
        let args = ExtenderArgs::decode(body).unwrap();
        assert_eq!(args.node_names, Some(vec!["exact".to_owned()]));
        let body = br#"{"nodenames":["first"],"NODENAMES":["last"]}"#;
        let args = ExtenderArgs::decode(body).unwrap();
        assert_eq!(args.node_names, Some(vec!["last".to_owned()]));
    }

    #[test]
    fn null_fields_are_absent_and_escaped_keys_match() {
        let args =
            ExtenderArgs::decode(br#"{"Pod":null,"Nodes":null,"\u004eodeNames":["n"]}"#).unwrap();
        assert!(args.pod.is_none() && args.nodes.is_none());
        assert_eq!(args.node_names, Some(vec!["n".to_owned()]));
    }

    #[test]
    fn bodies_that_are_not_one_object_are_refused_with_their_reason() {
        for (body, want) in [
            (&b"[1,2]"[..], "must be a JSON object"),
            (b"\"Pod\"", "must be a JSON object"),
            (b"{\"NodeNames\":[\"a\"]} trailing", "not valid JSON"),
            (b"{\"NodeNames\":[\"a\"]", "not valid JSON"),
            (b"", "not valid JSON"),
        ] {
            let e = ExtenderArgs::decode(body).unwrap_err().to_string();
            assert!(e.contains(want), "{body:?}: {e}");
        }
        let e = ExtenderArgs::decode(br#"{"Nodes":[1]}"#).unwrap_err();
        assert_eq!(e.to_string(), "Nodes: must be a NodeList object");
        let e = ExtenderArgs::decode(br#"{"Nodes":{"items":{}}}"#).unwrap_err();
        assert_eq!(e.to_string(), "Nodes: items must be an array");
    }

    #[test]
    fn full_node_objects_are_kept_as_received() {
        let node = r#"{"metadata":{"name":"n-a","labels":{"z":"1","a":"2"}},"status":{"capacity":{"cpu":"4"}}}"#;
        let body = format!(r#"{{"Nodes":{{"Items":[{node}]}}}}"#);
        let args = ExtenderArgs::decode(body.as_bytes()).unwrap();
        let nodes = args.nodes.unwrap();
        assert_eq!(nodes[0].0.metadata.name.as_deref(), Some("n-a"));
        // Echoed byte for byte: key order and all, as kube-scheduler sent it.
        assert_eq!(nodes[0].1.get(), node);
    }

    #[test]
    fn bind_args_name_the_field_that_is_wrong() {
        let ok = br#"{"PodName":"p","podnamespace":"ns","PodUID":"u","Node":"n"}"#;
        let args = ExtenderBindingArgs::decode(ok).unwrap();
        assert_eq!(
            (
                args.pod_name.as_str(),
                args.pod_namespace.as_str(),
                args.node.as_str()
            ),
            ("p", "ns", "n")
        );
        for (body, want) in [
            (
                &br#"{"PodName":"p","PodNamespace":"ns","PodUID":"u"}"#[..],
                "Node: missing",
            ),
            (
                br#"{"PodName":"","PodNamespace":"ns","PodUID":"u","Node":"n"}"#,
                "PodName: empty",
            ),
            (
                br#"{"PodName":"p","PodNamespace":7,"PodUID":"u","Node":"n"}"#,
                "PodNamespace: must be a string",
            ),
            (
                br#"{"PodName":"p","PodNamespace":"ns","PodUID":null,"Node":"n"}"#,
                "PodUID: missing",
            ),
        ] {
            assert_eq!(
                ExtenderBindingArgs::decode(body).unwrap_err().to_string(),
                want
            );
        }
    }

    fn any_casing(name: &'static str) -> impl Strategy<Value = String> {
        proptest::collection::vec(any::<bool>(), name.len()).prop_map(move |upper| {
            name.chars()
                .zip(upper)
                .map(|(c, u)| {
                    if u {
                        c.to_ascii_uppercase()
                    } else {
                        c.to_ascii_lowercase()
                    }
                })
                .collect()
        })
    }

    proptest! {
        /// Whatever the keys' casing and order, and whatever else the object carries, the names
        /// and the pod come back as they were sent.
        #[test]
        fn filter_args_survive_any_key_casing_and_extra_keys(
            names in proptest::collection::vec("[a-z0-9.\\-\"\\\\é]{0,12}", 0..40),
            pod_name in "[a-z0-9\\-]{1,20}",
            names_key in any_casing("NodeNames"),
            pod_key in any_casing("Pod"),
            extra in proptest::collection::btree_map("[A-Za-z]{1,8}", any::<i64>(), 0..4),
            pod_first in any::<bool>(),
        ) {
            let mut fields = vec![
                (names_key, serde_json::json!(names)),
                (pod_key, serde_json::json!({"metadata": {"name": pod_name}})),
            ];
            if !pod_first {
                fields.reverse();
            }
            for (k, v) in extra {
                if !["nodenames", "pod", "nodes"].contains(&k.to_ascii_lowercase().as_str()) {
                    fields.push((k, serde_json::json!(v)));
                }
            }
            let body = format!(
                "{{{}}}",
                fields
                    .iter()
                    .map(|(k, v)| format!("{}:{v}", serde_json::json!(k)))
                    .collect::<Vec<_>>()
                    .join(",")
            );
            let args = ExtenderArgs::decode(body.as_bytes()).unwrap();
            prop_assert_eq!(args.node_names, Some(names));
            prop_assert_eq!(args.pod.and_then(|p| p.metadata.name), Some(pod_name));
        }
    }
}

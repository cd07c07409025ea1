//! The node register annotation `hami.io/node-nvidia-register` (contract §2.1).
//!
//! v2.8+ writes a JSON array with a fixed key order and every key `omitempty`; ≤ v2.7 wrote a
//! `:`-terminated text list. Tessera writes JSON and reads both.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;

/// Operating mode written by HAMi's device plugin for plain (non-MIG) sharing.
pub const MODE_HAMI_CORE: &str = "hami-core";

/// One physical GPU as registered on the node.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct NodeDevice {
    /// GPU UUID.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub id: String,
    /// NVML index.
    #[serde(skip_serializing_if = "is_zero")]
    pub index: u32,
    /// Replicas (`deviceSplitCount`): how many containers may share the GPU.
    #[serde(skip_serializing_if = "is_zero")]
    pub count: u32,
    /// Registered memory in MiB (after `deviceMemoryScaling`).
    #[serde(skip_serializing_if = "is_zero")]
    pub devmem: u32,
    /// Registered cores (`deviceCoreScaling` × 100).
    #[serde(skip_serializing_if = "is_zero")]
    pub devcore: u32,
    /// Model name with HAMi's `NVIDIA-` prefix rule applied ([`model_type_name`]).
    #[serde(rename = "type", skip_serializing_if = "String::is_empty")]
    pub device_type: String,
    /// NUMA node (unknown ⇒ 0).
    #[serde(skip_serializing_if = "is_zero")]
    pub numa: u32,
    /// `hami-core`, `mig` or `mps`.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub mode: String,
    /// MIG profiles (MIG mode only), kept as HAMi wrote them.
    #[serde(
        rename = "migProfiles",
        skip_serializing_if = "Vec::is_empty",
        serialize_with = "serialize_mig_profiles"
    )]
    pub mig_profiles: Vec<Value>,
    /// Healthy. Absent in the JSON means unhealthy.
    #[serde(skip_serializing_if = "is_false")]
    pub health: bool,
}

/// HAMi's MIG profile struct field order; other keys follow in sorted order.
const MIG_KEY_ORDER: &[&str] = &[
    "name",
    "memoryMB",
    "core",
    "sliceCount",
    "placements",
    "start",
    "size",
];

/// Serializes a JSON value with object keys in HAMi's struct order (see [`MIG_KEY_ORDER`]), so a
/// decoded MIG profile re-encodes byte for byte although `serde_json::Map` sorts its keys.
struct GoOrdered<'a>(&'a Value);

impl Serialize for GoOrdered<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::{SerializeMap, SerializeSeq};
        match self.0 {
            Value::Object(map) => {
                let mut keys: Vec<&String> = map.keys().collect();
                let rank = |k: &str| {
                    MIG_KEY_ORDER
                        .iter()
                        .position(|o| *o == k)
                        .unwrap_or(MIG_KEY_ORDER.len())
                };
                keys.sort_by(|a, b| rank(a).cmp(&rank(b)).then_with(|| a.cmp(b)));
                let mut m = s.serialize_map(Some(keys.len()))?;
                for k in keys {
                    if let Some(v) = map.get(k) {
                        m.serialize_entry(k, &GoOrdered(v))?;
                    }
                }
                m.end()
            }
            Value::Array(items) => {
                let mut seq = s.serialize_seq(Some(items.len()))?;
                for v in items {
                    seq.serialize_element(&GoOrdered(v))?;
                }
                seq.end()
            }
            other => other.serialize(s),
        }
    }
}

fn serialize_mig_profiles<S: serde::Serializer>(
    profiles: &[Value],
    s: S,
) -> Result<S::Ok, S::Error> {
    s.collect_seq(profiles.iter().map(GoOrdered))
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

fn is_false(v: &bool) -> bool {
    !*v
}

/// Why a register annotation could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NodeRegisterError {
    /// Starts with `[` but is not JSON; carries serde_json's message.
    #[error("node register annotation is not valid JSON: {0}")]
    Json(String),
    /// JSON, but not an array of objects; carries what was found instead.
    #[error("node register annotation must be a JSON array of objects, found {0}")]
    NotAnArray(&'static str),
    /// A device object has a key of the wrong type or range.
    #[error("node register annotation: device {index}: key {key:?}: {problem}")]
    Field {
        /// Position of the device in the array.
        index: usize,
        /// The offending key.
        key: &'static str,
        /// What is wrong with it.
        problem: String,
    },
    /// A ≤ v2.7 text entry that cannot be read.
    #[error("legacy node register annotation: device entry {entry:?}: {problem}")]
    Legacy {
        /// The device entry as written.
        entry: String,
        /// What is wrong with it.
        problem: String,
    },
}

/// HAMi's device `type`: the NVML name, prefixed with `NVIDIA-` unless it already starts with
/// `NVIDIA` (`Tesla T4` → `NVIDIA-Tesla T4`; `NVIDIA A100-SXM4-40GB` unchanged).
pub fn model_type_name(nvml_name: &str) -> String {
    if nvml_name.starts_with("NVIDIA") {
        nvml_name.to_owned()
    } else {
        format!("NVIDIA-{nvml_name}")
    }
}

/// Encodes the v2.8+ JSON array exactly as Go's `encoding/json` would (key order, omitempty,
/// HTML-safe escaping of `<`, `>`, `&`, U+2028 and U+2029).
pub fn encode_node_devices(devices: &[NodeDevice]) -> String {
    // Strings and integers only, no maps with non-string keys: serialization cannot fail.
    #[allow(clippy::expect_used, reason = "NodeDevice always serializes")]
    let json = serde_json::to_string(devices).expect("NodeDevice always serializes");
    go_html_escape(&json)
}

/// Go's encoder escapes these even inside strings; matching it keeps the annotation byte-equal
/// to HAMi's, so "patch only when changed" comparisons agree across implementations.
fn go_html_escape(json: &str) -> String {
    let mut out = String::with_capacity(json.len());
    for c in json.chars() {
        match c {
            '<' => out.push_str("\\u003c"),
            '>' => out.push_str("\\u003e"),
            '&' => out.push_str("\\u0026"),
            '\u{2028}' => out.push_str("\\u2028"),
            '\u{2029}' => out.push_str("\\u2029"),
            c => out.push(c),
        }
    }
    out
}

/// Decodes the register annotation in either format: the ≤ v2.7 text format when it looks like
/// one (`ID,…:` entries: a `,` and a `:`, and not starting like JSON), JSON otherwise, so that a
/// malformed JSON value such as `{not json` is reported as JSON rather than as a bad text entry.
/// HAMi v2.10 reads JSON only; reading the text form too is deviation N4.
pub fn decode_node_devices(value: &str) -> Result<Vec<NodeDevice>, NodeRegisterError> {
    let start = value.trim_start();
    let json_like = start.starts_with(['[', '{', '"']);
    if !json_like && value.contains(',') && value.contains(':') {
        decode_legacy(value)
    } else {
        decode_json(value)
    }
}

/// Decodes the v2.8+ JSON array. Keys match case-insensitively (as Go's decoder does), unknown
/// keys are ignored, an absent `health` means unhealthy. Wrong types are errors naming the key.
pub fn decode_json(value: &str) -> Result<Vec<NodeDevice>, NodeRegisterError> {
    let parsed: Value =
        serde_json::from_str(value).map_err(|e| NodeRegisterError::Json(e.to_string()))?;
    let Value::Array(items) = parsed else {
        return Err(NodeRegisterError::NotAnArray(json_kind(&parsed)));
    };
    items
        .iter()
        .enumerate()
        .map(|(index, item)| decode_json_device(index, item))
        .collect()
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn decode_json_device(index: usize, item: &Value) -> Result<NodeDevice, NodeRegisterError> {
    let Value::Object(map) = item else {
        return Err(NodeRegisterError::NotAnArray(json_kind(item)));
    };
    // Go: an exact key match wins, otherwise the first case-insensitive one.
    let get = |key: &str| {
        map.get(key).or_else(|| {
            map.iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(key))
                .map(|(_, v)| v)
        })
    };
    let field_err = |key: &'static str, problem: String| NodeRegisterError::Field {
        index,
        key,
        problem,
    };
    let string = |key: &'static str| -> Result<String, NodeRegisterError> {
        match get(key) {
            None | Some(Value::Null) => Ok(String::new()),
            Some(Value::String(s)) => Ok(s.clone()),
            Some(other) => Err(field_err(
                key,
                format!("expected a string, found {}", json_kind(other)),
            )),
        }
    };
    let number = |key: &'static str| -> Result<u32, NodeRegisterError> {
        match get(key) {
            None | Some(Value::Null) => Ok(0),
            Some(Value::Number(n)) => n
                .as_u64()
                .and_then(|v| u32::try_from(v).ok())
                .filter(|v| i32::try_from(*v).is_ok())
                .ok_or_else(|| field_err(key, format!("{n} is not a non-negative 32-bit integer"))),
            Some(other) => Err(field_err(
                key,
                format!("expected a number, found {}", json_kind(other)),
            )),
        }
    };
    let health = match get("health") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(other) => {
            return Err(field_err(
                "health",
                format!("expected a boolean, found {}", json_kind(other)),
            ));
        }
    };
    let mig_profiles = match get("migProfiles") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a.clone(),
        Some(other) => {
            return Err(field_err(
                "migProfiles",
                format!("expected an array, found {}", json_kind(other)),
            ));
        }
    };
    Ok(NodeDevice {
        id: string("id")?,
        index: number("index")?,
        count: number("count")?,
        devmem: number("devmem")?,
        devcore: number("devcore")?,
        device_type: string("type")?,
        numa: number("numa")?,
        mode: string("mode")?,
        mig_profiles,
        health,
    })
}

/// Decodes the ≤ v2.7 text format: `ID,Count,Devmem,Devcore,Type,Numa,Health[,Index,Mode]:` per
/// device. The 7-field form means index 0 and mode `hami-core`.
///
/// HAMi ignores number parse errors (they become 0); Tessera reports them, because a device
/// registered with 0 memory silently disappears from scheduling.
pub fn decode_legacy(value: &str) -> Result<Vec<NodeDevice>, NodeRegisterError> {
    if !value.contains(':') {
        return Err(NodeRegisterError::Legacy {
            entry: value.to_owned(),
            problem: "no ':'-terminated device entry".into(),
        });
    }
    let mut devices = Vec::new();
    for entry in value.split(':').filter(|e| e.contains(',')) {
        let legacy_err = |problem: String| NodeRegisterError::Legacy {
            entry: entry.to_owned(),
            problem,
        };
        let f: Vec<&str> = entry.split(',').collect();
        if f.len() != 7 && f.len() != 9 {
            return Err(legacy_err(format!("has {} fields, need 7 or 9", f.len())));
        }
        let number = |name: &str, v: &str| {
            v.parse::<u32>()
                .map_err(|_| legacy_err(format!("{name} {v:?} is not a non-negative integer")))
        };
        let health = parse_go_bool(f[6])
            .ok_or_else(|| legacy_err(format!("Health {:?} is not a boolean", f[6])))?;
        let (index, mode) = if f.len() == 9 {
            (number("Index", f[7])?, f[8].to_owned())
        } else {
            (0, MODE_HAMI_CORE.to_owned())
        };
        devices.push(NodeDevice {
            id: f[0].to_owned(),
            index,
            count: number("Count", f[1])?,
            devmem: number("Devmem", f[2])?,
            devcore: number("Devcore", f[3])?,
            device_type: f[4].to_owned(),
            numa: number("Numa", f[5])?,
            mode,
            mig_profiles: Vec::new(),
            health,
        });
    }
    Ok(devices)
}

/// Encodes the ≤ v2.7 text format (9-field form), for clusters still running an old HAMi scheduler.
pub fn encode_legacy(devices: &[NodeDevice]) -> String {
    devices
        .iter()
        .map(|d| {
            format!(
                "{},{},{},{},{},{},{},{},{}:",
                d.id,
                d.count,
                d.devmem,
                d.devcore,
                d.device_type,
                d.numa,
                d.health,
                d.index,
                d.mode
            )
        })
        .collect()
}

/// Go's `strconv.ParseBool`.
pub fn parse_go_bool(v: &str) -> Option<bool> {
    match v {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

/// One entry of `hami.io/node-nvidia-score` (contract §2.2, written only with
/// `ENABLE_TOPOLOGY_SCORE=true`): a GPU and its pair scores with the node's other GPUs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct DevicePairScore {
    /// GPU UUID.
    pub uuid: String,
    /// Other GPU UUID → pair score (sum of [`P2pLink::score`] over the links between them).
    /// Sorted by UUID, as Go's encoder writes maps.
    #[serde(default, deserialize_with = "null_as_empty")]
    pub score: BTreeMap<String, i64>,
}

fn null_as_empty<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<BTreeMap<String, i64>, D::Error> {
    use serde::Deserialize;
    Ok(Option::<BTreeMap<String, i64>>::deserialize(d)?.unwrap_or_default())
}

/// Encodes `hami.io/node-nvidia-score` exactly as Go would.
pub fn encode_pair_scores(scores: &[DevicePairScore]) -> String {
    let json = serde_json::to_string(scores).unwrap_or_else(|_| "[]".to_owned());
    go_html_escape(&json)
}

/// Decodes `hami.io/node-nvidia-score`.
pub fn decode_pair_scores(value: &str) -> Result<Vec<DevicePairScore>, NodeRegisterError> {
    serde_json::from_str(value).map_err(|e| NodeRegisterError::Json(e.to_string()))
}

/// A link between two GPUs as NVML reports it, with HAMi's score (`calculate_score.go`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum P2pLink {
    /// Across CPU sockets: 10.
    CrossCpu,
    /// Same CPU: 20.
    SameCpu,
    /// Host bridge: 30.
    HostBridge,
    /// Several PCIe switches: 40.
    MultiSwitch,
    /// One PCIe switch: 50.
    SingleSwitch,
    /// Same board: 60.
    SameBoard,
    /// N NVLinks (1..=18): N × 100.
    NvLink(u8),
}

impl P2pLink {
    /// HAMi's score for this link.
    pub fn score(self) -> i64 {
        match self {
            P2pLink::CrossCpu => 10,
            P2pLink::SameCpu => 20,
            P2pLink::HostBridge => 30,
            P2pLink::MultiSwitch => 40,
            P2pLink::SingleSwitch => 50,
            P2pLink::SameBoard => 60,
            P2pLink::NvLink(n) => i64::from(n) * 100,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = r#"[{"id":"GPU-0c8e3b5a-1111-2222-3333-444455556666","count":10,"devmem":15360,"devcore":100,"type":"NVIDIA-Tesla T4","mode":"hami-core","health":true},{"id":"GPU-9a1b2c3d-1111-2222-3333-444455556666","index":1,"count":10,"devmem":15360,"devcore":100,"type":"NVIDIA-Tesla T4","numa":1,"mode":"hami-core","health":true}]"#;

    #[test]
    fn contract_json_example_round_trips_byte_for_byte() {
        let devices = decode_node_devices(EXAMPLE).unwrap();
        assert_eq!(devices.len(), 2);
        assert_eq!(devices[1].index, 1);
        assert_eq!(devices[1].numa, 1);
        assert!(devices[0].health);
        assert_eq!(encode_node_devices(&devices), EXAMPLE);
    }

    #[test]
    fn legacy_forms_decode() {
        let nine = "GPU-aaa,10,15360,100,NVIDIA-Tesla T4,0,true,0,hami-core:GPU-bbb,10,15360,100,NVIDIA-Tesla T4,1,true,1,hami-core:";
        let d = decode_node_devices(nine).unwrap();
        assert_eq!(d.len(), 2);
        assert_eq!(
            (d[1].index, d[1].numa, d[1].mode.as_str()),
            (1, 1, "hami-core")
        );
        assert_eq!(encode_legacy(&d), nine);
        let seven = "GPU-ebe7c3f7-303d-558d-435e-99a160631fe4,10,7680,100,NVIDIA-Tesla P4,0,true:";
        let d = decode_node_devices(seven).unwrap();
        assert_eq!(
            (d[0].devmem, d[0].index, d[0].mode.as_str()),
            (7680, 0, "hami-core")
        );
    }

    #[test]
    fn absent_health_is_unhealthy_and_wrong_types_name_the_key() {
        let d = decode_node_devices(r#"[{"ID":"GPU-a","Count":2}]"#).unwrap();
        assert_eq!(
            (d[0].id.as_str(), d[0].count, d[0].health),
            ("GPU-a", 2, false)
        );
        let err = decode_node_devices(r#"[{"id":"GPU-a","devmem":"lots"}]"#).unwrap_err();
        assert!(err.to_string().contains("devmem"), "{err}");
    }

    #[test]
    fn malformed_json_is_reported_as_json_and_text_entries_still_decode() {
        for bad in ["{not json", "{\"id\":\"GPU-a\"}", "garbage", ""] {
            let err = decode_node_devices(bad).unwrap_err();
            assert!(
                matches!(
                    err,
                    NodeRegisterError::Json(_) | NodeRegisterError::NotAnArray(_)
                ),
                "{bad:?}: {err}"
            );
        }
        assert_eq!(decode_node_devices("[]").unwrap(), Vec::new());
        let text = "GPU-a,10,15360,100,NVIDIA-Tesla T4,0,true:";
        assert_eq!(decode_node_devices(text).unwrap()[0].id, "GPU-a");
    }

    #[test]
    fn model_name_prefix_rule() {
        assert_eq!(model_type_name("Tesla T4"), "NVIDIA-Tesla T4");
        assert_eq!(
            model_type_name("NVIDIA A100-SXM4-40GB"),
            "NVIDIA A100-SXM4-40GB"
        );
    }
}

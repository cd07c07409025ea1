//! `kubectl tessera migrate-from-hami`: what switching a live HAMi v2.10 cluster to Tessera will
//! do, read from the cluster and the values file, with nothing run (docs/migrate-from-hami.md).
//!
//! Pure: the caller reads [`Facts`]; [`plan`] decides. Bookings come from the scheduler's own
//! state code, so what is listed is what Tessera's first decision will count.

use std::collections::BTreeMap;

use hami_contract::annotations as keys;
use hami_contract::devices::PodDevices;
use hami_contract::nodelock::NodeLock;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{Node, Pod, PodSpec};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use tessera_scheduler_core::config::DecisionConfig;
use tessera_scheduler_core::inventory::{self, GpuRow};
use tessera_scheduler_core::simulate::Input;

use crate::doctor::{Finding, Level, finding, images, key};

/// HAMi's image: its scheduler and device plugin both run it.
const HAMI_IMAGE: &str = "projecthami/hami";
/// How long HAMi honours a node lock (`nodeLockExpire`, its chart's default).
const LOCK_EXPIRY: SignedDuration = SignedDuration::from_secs(300);

/// What the plan reads: cluster-wide.
#[derive(Debug)]
pub struct Facts {
    pub nodes: Vec<Node>,
    pub pods: Vec<Pod>,
    pub deployments: Vec<Deployment>,
    pub daemonsets: Vec<DaemonSet>,
    pub now: Timestamp,
}

/// Every leaf key of HAMi v2.10's values and what Tessera's chart does with it: the file the
/// chart itself reads to refuse values (`charts/tessera/files/hami-v2.10-keys.yaml`).
const HAMI_KEYS: &str = include_str!("../../charts/tessera/files/hami-v2.10-keys.yaml");

#[derive(Debug, serde::Deserialize)]
struct KeyFile {
    keys: BTreeMap<String, KeyEntry>,
}

#[derive(Debug, serde::Deserialize)]
struct KeyEntry {
    disposition: String,
    #[serde(default)]
    allowed: Option<Vec<yaml_serde::Value>>,
    #[serde(default)]
    instead: Option<String>,
    #[serde(default)]
    why: Option<String>,
}

/// The plan: every finding, in the order an operator works through them, and the GPUs with
/// what is booked on them.
#[derive(Debug)]
pub struct Plan {
    pub findings: Vec<Finding>,
    pub gpus: Vec<GpuRow>,
}

impl Plan {
    /// Whether something would make the switch fail or lose a booking.
    pub fn blocked(&self) -> bool {
        self.findings.iter().any(|f| f.level == Level::Fail)
    }
}

fn is_hami(spec: Option<&PodSpec>) -> bool {
    images(spec).iter().any(|i| i.contains(HAMI_IMAGE))
}

/// The plan for `facts`, and for `values` (the HAMi values file, parsed) when given.
pub fn plan(facts: &Facts, cfg: &DecisionConfig, values: Option<&yaml_serde::Value>) -> Plan {
    let mut out = Vec::new();
    components(facts, &mut out);
    nodes(facts, &mut out);
    let gpus = bookings(facts, cfg, &mut out);
    if let Some(v) = values {
        values_keys(v, &mut out);
    }
    Plan {
        findings: out,
        gpus,
    }
}

/// HAMi's scheduler and device plugin (removed by the switch), and a Tessera already there.
fn components(f: &Facts, out: &mut Vec<Finding>) {
    let hami_deploys: Vec<_> = f
        .deployments
        .iter()
        .filter(|d| is_hami(d.spec.as_ref().and_then(|s| s.template.spec.as_ref())))
        .collect();
    let hami_plugins: Vec<_> = f
        .daemonsets
        .iter()
        .filter(|d| is_hami(d.spec.as_ref().and_then(|s| s.template.spec.as_ref())))
        .collect();
    if hami_deploys.is_empty() && hami_plugins.is_empty() {
        out.push(finding(
            Level::Warn,
            "hami",
            "no HAMi scheduler or device plugin runs (no workload runs an image named \
             projecthami/hami): nothing to take over, or HAMi is already uninstalled"
                .into(),
            None,
        ));
    }
    for d in &hami_deploys {
        out.push(finding(
            Level::Ok,
            "hami",
            format!(
                "scheduler {}: removed by `helm uninstall`; Tessera's scheduler answers for the \
                 same schedulerName (hami-scheduler unless the values change it) from then on",
                key(&d.metadata)
            ),
            None,
        ));
    }
    for d in &hami_plugins {
        let n = d.status.as_ref().map_or(0, |s| s.desired_number_scheduled);
        out.push(finding(
            Level::Ok,
            "hami",
            format!(
                "device plugin {} on {n} node(s): removed by `helm uninstall`; running GPU pods \
                 keep their devices and HAMi-core (their containers hold what they mounted)",
                key(&d.metadata)
            ),
            None,
        ));
    }
    let tessera: Vec<_> = f
        .deployments
        .iter()
        .filter(|d| {
            images(d.spec.as_ref().and_then(|s| s.template.spec.as_ref()))
                .iter()
                .any(|i| i.contains("tessera-scheduler"))
        })
        .collect();
    for d in tessera {
        out.push(finding(
            Level::Warn,
            "tessera",
            format!("Tessera's scheduler {} already runs", key(&d.metadata)),
            Some(
                "two GPU schedulers answering for the same schedulerName place pods on the same \
                 slices: uninstall one before installing the other"
                    .into(),
            ),
        ));
    }
}

/// Nodes HAMi registered GPUs on, and the node locks HAMi left.
fn nodes(f: &Facts, out: &mut Vec<Finding>) {
    for n in &f.nodes {
        let name = n.metadata.name.clone().unwrap_or_default();
        let ann = n.metadata.annotations.clone().unwrap_or_default();
        let labels = n.metadata.labels.clone().unwrap_or_default();
        if let Some(reg) = ann.get(keys::NODE_REGISTER) {
            let mixed = labels.get(keys::DEVICE_PLUGIN_LABEL).map(String::as_str)
                == Some(keys::DEVICE_PLUGIN_HAMI);
            match hami_contract::node::decode_node_devices(reg) {
                Ok(devices) if mixed => out.push(finding(
                    Level::Ok,
                    "node",
                    format!(
                        "{name}: {} GPU(s); labelled {}={}: stays on HAMi's device plugin \
                         (Tessera takes HAMi's node lock there, docs/helm.md \"Mixed clusters\")",
                        devices.len(),
                        keys::DEVICE_PLUGIN_LABEL,
                        keys::DEVICE_PLUGIN_HAMI
                    ),
                    None,
                )),
                Ok(devices) => out.push(finding(
                    Level::Ok,
                    "node",
                    format!(
                        "{name}: {} GPU(s) registered by HAMi; Tessera's device plugin registers \
                         them again in the same annotation when it starts there",
                        devices.len()
                    ),
                    None,
                )),
                Err(e) => out.push(finding(
                    Level::Warn,
                    "node",
                    format!("{name}: HAMi's {} is unreadable ({e})", keys::NODE_REGISTER),
                    Some(
                        "Tessera's device plugin rewrites it when it starts; until then the node \
                         offers no GPUs"
                            .into(),
                    ),
                )),
            }
        }
        if let Some(lock) = ann.get(keys::NODE_LOCK) {
            out.push(node_lock(f, &name, lock));
        }
    }
}

/// A node lock HAMi's scheduler took: whose, how old, and what becomes of it.
fn node_lock(f: &Facts, node: &str, value: &str) -> Finding {
    let parsed = NodeLock::parse(value);
    let at = parsed
        .as_ref()
        .and_then(|l| l.time.parse::<Timestamp>().ok());
    let live = at.is_some_and(|t| f.now.duration_since(t) < LOCK_EXPIRY && t <= f.now);
    let holder = parsed.and_then(|l| l.holder);
    let waiting = holder.as_ref().is_some_and(|(ns, name)| {
        f.pods.iter().any(|p| {
            p.metadata.namespace.as_deref() == Some(ns.as_str())
                && p.metadata.name.as_deref() == Some(name.as_str())
                && annotation(p, keys::BIND_PHASE) == Some(keys::BIND_PHASE_ALLOCATING)
        })
    });
    let who = holder.map_or_else(|| "nobody".to_owned(), |(ns, n)| format!("{ns}/{n}"));
    match (live, waiting) {
        (_, true) => finding(
            Level::Warn,
            "node lock",
            format!("{node}: HAMi's lock names {who}, which is waiting for its device plugin"),
            Some(
                "let the pod start before uninstalling HAMi; if it has not, Tessera's device \
                 plugin allocates it and releases the lock"
                    .into(),
            ),
        ),
        (true, false) => finding(
            Level::Ok,
            "node lock",
            format!(
                "{node}: a lock HAMi left naming {who}, which is not waiting for it: Tessera \
                 ignores it and its device plugin removes it within 30 s"
            ),
            None,
        ),
        (false, false) => finding(
            Level::Ok,
            "node lock",
            format!("{node}: an expired lock ({value}): ignored by Tessera and by HAMi"),
            None,
        ),
    }
}

fn annotation<'a>(p: &'a Pod, k: &str) -> Option<&'a str> {
    p.metadata.annotations.as_ref()?.get(k).map(String::as_str)
}

/// Every booking, as Tessera's first decision counts it, and what would make one wrong.
fn bookings(f: &Facts, cfg: &DecisionConfig, out: &mut Vec<Finding>) -> Vec<GpuRow> {
    let mut input = Input {
        nodes: f.nodes.clone(),
        ..Input::default()
    };
    for p in &f.pods {
        let ended = matches!(
            p.status.as_ref().and_then(|s| s.phase.as_deref()),
            Some("Succeeded" | "Failed")
        );
        if ended {
            continue;
        }
        if let Some(v) = annotation(p, keys::DEVICES_ALLOCATED)
            && let Err(e) = PodDevices::decode(v)
        {
            out.push(finding(
                Level::Fail,
                "booking",
                format!(
                    "{}: its {} is unreadable ({e}): neither HAMi nor Tessera counts it",
                    key(&p.metadata),
                    keys::DEVICES_ALLOCATED
                ),
                Some(
                    "delete and recreate the pod before the switch, or its GPU memory may be \
                     booked twice"
                        .into(),
                ),
            ));
        }
        input.add_pod(p.clone());
    }
    let (mut state, _) = input.state(cfg);
    let rows = inventory::gpus(&mut state);
    let pods: usize = rows.iter().map(|r| r.tenants.len()).sum();
    out.push(finding(
        Level::Ok,
        "bookings",
        format!(
            "{pods} booking(s) on {} GPU(s), listed below: Tessera counts each from its first \
             decision and places no pod on what they hold",
            rows.len()
        ),
        None,
    ));
    for r in &rows {
        let Some(reg) = &r.registered else {
            if r.tenants.is_empty() {
                continue;
            }
            out.push(finding(
                Level::Warn,
                "booking",
                format!(
                    "{} on {}: booked by {} pod(s) but not registered by the node",
                    r.uuid,
                    r.node,
                    r.tenants.len()
                ),
                Some(
                    "the GPU is gone or unhealthy: its pods keep running; Tessera places \
                     nothing on it"
                        .into(),
                ),
            ));
            continue;
        };
        if r.slots_used > reg.slots || r.mem_used > reg.mem || r.cores_used > reg.cores {
            out.push(finding(
                Level::Warn,
                "booking",
                format!(
                    "{} on {}: over-booked ({} of {} slots, {} of {} MiB, {} of {} cores)",
                    r.uuid,
                    r.node,
                    r.slots_used,
                    reg.slots,
                    r.mem_used,
                    reg.mem,
                    r.cores_used,
                    reg.cores
                ),
                Some(
                    "Tessera evicts nothing: it places no pod there until enough of these end"
                        .into(),
                ),
            ));
        }
    }
    rows
}

/// Each key of the values file, against what Tessera's chart does with HAMi v2.10's keys.
fn values_keys(values: &yaml_serde::Value, out: &mut Vec<Finding>) {
    let table = match key_table() {
        Ok(t) => t,
        Err(e) => {
            out.push(finding(
                Level::Fail,
                "values",
                format!("the built-in list of HAMi's keys is unreadable: {e}"),
                None,
            ));
            return;
        }
    };
    let mut leaves = Vec::new();
    flatten("", values, &mut leaves);
    let (mut honoured, mut unknown, mut cross_checked) = (0, Vec::new(), Vec::new());
    for (k, v) in &leaves {
        let Some(entry) = table.keys.get(k) else {
            unknown.push(k.clone());
            continue;
        };
        match entry.disposition.as_str() {
            "honoured" => honoured += 1,
            "vendor-skipped" => {}
            _ => match &entry.allowed {
                Some(allowed) if allowed.iter().any(|a| same_value(a, v)) => {}
                Some(_) => out.push(finding(
                    Level::Fail,
                    "values",
                    format!(
                        "{k}: {} is refused: `helm install` fails",
                        yaml_serde::to_string(v).unwrap_or_default().trim()
                    ),
                    entry.instead.clone().or_else(|| entry.why.clone()),
                )),
                None => cross_checked.push(k.clone()),
            },
        }
    }
    let skipped = leaves
        .iter()
        .filter(|(k, _)| {
            table
                .keys
                .get(k)
                .is_some_and(|e| e.disposition == "vendor-skipped")
        })
        .count();
    out.push(finding(
        Level::Ok,
        "values",
        format!(
            "{} key(s): {honoured} honoured with HAMi's meaning, {skipped} of other vendors \
             (accepted, unused), {} not HAMi v2.10's",
            leaves.len(),
            unknown.len()
        ),
        None,
    ));
    if !cross_checked.is_empty() {
        out.push(finding(
            Level::Ok,
            "values",
            format!(
                "checked by the chart at install against other keys (HAMi's defaults pass; \
                 docs/helm.md, \"Moving from HAMi\"): {}",
                cross_checked.join(", ")
            ),
            None,
        ));
    }
    if !unknown.is_empty() {
        out.push(finding(
            Level::Warn,
            "values",
            format!("not keys of HAMi v2.10: {}", unknown.join(", ")),
            Some(
                "Tessera's own keys are fine (docs/helm.md); anything else is ignored by the \
                 chart"
                    .into(),
            ),
        ));
    }
}

/// [`HAMI_KEYS`], its `<<` merge keys applied (entries share their text through anchors).
fn key_table() -> Result<KeyFile, yaml_serde::Error> {
    let mut v: yaml_serde::Value = yaml_serde::from_str(HAMI_KEYS)?;
    v.apply_merge()?;
    yaml_serde::from_value(v)
}

/// `a.b.c` for every leaf of a YAML mapping (a list or scalar is a leaf).
fn flatten(prefix: &str, v: &yaml_serde::Value, out: &mut Vec<(String, yaml_serde::Value)>) {
    match v {
        yaml_serde::Value::Mapping(m) if !m.is_empty() => {
            for (k, child) in m {
                let k = match k {
                    yaml_serde::Value::String(s) => s.clone(),
                    other => yaml_serde::to_string(other)
                        .unwrap_or_default()
                        .trim()
                        .to_owned(),
                };
                let path = if prefix.is_empty() {
                    k
                } else {
                    format!("{prefix}.{k}")
                };
                flatten(&path, child, out);
            }
        }
        _ if !prefix.is_empty() => out.push((prefix.to_owned(), v.clone())),
        _ => {}
    }
}

/// YAML equality as Helm compares values: `5m` and `"5m"` are the same, so are `1` and `1.0`.
fn same_value(a: &yaml_serde::Value, b: &yaml_serde::Value) -> bool {
    use yaml_serde::Value as V;
    match (a, b) {
        (V::Number(x), V::Number(y)) => x.as_f64() == y.as_f64(),
        (V::Null, V::Null) => true,
        (V::String(x), other) | (other, V::String(x)) if !matches!(other, V::String(_)) => {
            yaml_serde::to_string(other).is_ok_and(|s| s.trim() == x)
        }
        _ => a == b,
    }
}

/// The plan for a terminal: the findings, then the GPUs and their bookings.
pub fn report(plan: &Plan) -> String {
    let mut out = crate::doctor::report(&plan.findings);
    if !plan.gpus.is_empty() {
        out.push_str("\nGPUs and the bookings Tessera will count:\n");
        out.push_str(&inventory::table(&plan.gpus));
    }
    out.push_str(if plan.blocked() {
        "\nThe switch would fail or lose a booking: fix the FAIL lines first.\n"
    } else {
        "\nNothing blocks the switch (docs/migrate-from-hami.md): `helm uninstall` HAMi, then \
         `helm install` Tessera with the same values file.\n"
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn node(name: &str, ann: serde_json::Value) -> Node {
        serde_json::from_value(json!({"metadata": {"name": name, "annotations": ann}})).unwrap()
    }

    fn pod(name: &str, ann: serde_json::Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ml", "uid": format!("uid-{name}"), "annotations": ann},
            "spec": {"nodeName": "gpu-1", "containers": [{"name": "main", "image": "app",
                "resources": {"limits": {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 4000}}}]},
            "status": {"phase": "Running"}
        }))
        .unwrap()
    }

    fn hami_daemonset() -> DaemonSet {
        serde_json::from_value(json!({
            "metadata": {"name": "hami-device-plugin", "namespace": "kube-system"},
            "spec": {"selector": {}, "template": {"spec": {"containers": [
                {"name": "device-plugin", "image": "docker.io/projecthami/hami:v2.10.0"}]}}},
            "status": {"currentNumberScheduled": 1, "desiredNumberScheduled": 1,
                       "numberMisscheduled": 0, "numberReady": 1}
        }))
        .unwrap()
    }

    const REGISTER: &str = r#"[{"id":"GPU-0","count":10,"devmem":15360,"devcore":100,"type":"NVIDIA-Tesla T4","health":true,"mode":"hami-core"}]"#;

    fn facts(lock: Option<&str>, pods: Vec<Pod>) -> Facts {
        let mut ann = json!({keys::NODE_REGISTER: REGISTER});
        if let Some(l) = lock {
            ann[keys::NODE_LOCK] = json!(l);
        }
        Facts {
            nodes: vec![node("gpu-1", ann)],
            pods,
            deployments: Vec::new(),
            daemonsets: vec![hami_daemonset()],
            now: "2026-12-05T01:00:00Z".parse().unwrap(),
        }
    }

    fn running(name: &str, devices: &str) -> Pod {
        pod(
            name,
            json!({keys::VGPU_NODE: "gpu-1", keys::DEVICES_ALLOCATED: devices, keys::BIND_PHASE: "success"}),
        )
    }

    #[test]
    fn a_hami_cluster_is_described_and_its_bookings_counted() {
        let f = facts(None, vec![running("a", "GPU-0,NVIDIA,4000,0:;")]);
        let p = plan(&f, &DecisionConfig::default(), None);
        let text = report(&p);
        assert!(!p.blocked(), "{text}");
        assert!(
            text.contains("device plugin kube-system/hami-device-plugin on 1 node(s)"),
            "{text}"
        );
        assert!(
            text.contains("gpu-1: 1 GPU(s) registered by HAMi"),
            "{text}"
        );
        assert!(text.contains("1 booking(s) on 1 GPU(s)"), "{text}");
        assert_eq!(p.gpus[0].mem_used, 4000);
        assert!(text.contains("Nothing blocks the switch"), "{text}");
    }

    #[test]
    fn node_locks_are_judged_by_their_pod_and_age() {
        let mut waiting = running("w", "GPU-0,NVIDIA,4000,0:;");
        waiting
            .metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(keys::BIND_PHASE.into(), "allocating".into());
        let cases = [
            (
                "2026-12-05T00:59:00Z,ml,w",
                "waiting for its device plugin",
                Level::Warn,
            ),
            (
                "2026-12-05T00:59:00Z,ml,a",
                "removes it within 30 s",
                Level::Ok,
            ),
            ("2026-12-05T00:50:00Z,ml,a", "an expired lock", Level::Ok),
        ];
        for (lock, says, level) in cases {
            let f = facts(
                Some(lock),
                vec![running("a", "GPU-0,NVIDIA,4000,0:;"), waiting.clone()],
            );
            let p = plan(&f, &DecisionConfig::default(), None);
            let l = p
                .findings
                .iter()
                .find(|x| x.check == "node lock")
                .expect("a lock finding");
            assert!(l.detail.contains(says), "{lock}: {l:?}");
            assert_eq!(l.level, level, "{lock}");
        }
    }

    #[test]
    fn unreadable_and_overbooked_bookings_are_conflicts() {
        let f = facts(
            None,
            vec![
                running("a", "GPU-0,NVIDIA,12000,0:;"),
                running("b", "GPU-0,NVIDIA,4000,0:;"),
                running("bad", "GPU-0,NVIDIA,lots,0:;"),
            ],
        );
        let p = plan(&f, &DecisionConfig::default(), None);
        let text = report(&p);
        assert!(p.blocked(), "{text}");
        assert!(
            text.contains("ml/bad: its hami.io/vgpu-devices-allocated is unreadable"),
            "{text}"
        );
        assert!(
            text.contains("over-booked (2 of 10 slots, 16000 of 15360 MiB"),
            "{text}"
        );
        assert!(text.contains("fix the FAIL lines first"), "{text}");
    }

    #[test]
    fn values_keys_are_checked_against_what_the_chart_does() {
        let values: yaml_serde::Value = yaml_serde::from_str(
            "global:\n  imageRegistry: mirror.example.com\n  managedNodeSelectorEnable: false\n\
             scheduler:\n  nodeLockExpire: 10m\ndevices:\n  mthreads:\n    enabled: false\n\
             myOwnKey: 1\n",
        )
        .unwrap();
        let p = plan(
            &facts(None, Vec::new()),
            &DecisionConfig::default(),
            Some(&values),
        );
        let text = report(&p);
        assert!(p.blocked(), "{text}");
        assert!(
            text.contains("scheduler.nodeLockExpire: 10m is refused"),
            "{text}"
        );
        assert!(
            !text.contains("managedNodeSelectorEnable: false is refused"),
            "{text}"
        );
        assert!(text.contains("not keys of HAMi v2.10: myOwnKey"), "{text}");
        // HAMi's own defaults install unchanged: nothing blocks.
        let defaults: yaml_serde::Value =
            yaml_serde::from_str(include_str!("../../e2e/fixtures/hami-v2.10-values.yaml"))
                .unwrap();
        let p = plan(
            &facts(None, Vec::new()),
            &DecisionConfig::default(),
            Some(&defaults),
        );
        assert!(!p.blocked(), "{}", report(&p));
    }
}

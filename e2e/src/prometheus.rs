//! A real Prometheus (built from its Go module by `e2e/tools.sh`) scraping the chart's daemons the
//! way the Prometheus Operator would for the chart's ServiceMonitors, with the chart's
//! PrometheusRule loaded, so the dashboard's queries and the alerts' expressions are evaluated on
//! what the real daemons export (issue 34, item 2).
//!
//! There is no Prometheus Operator here, so [`scrape_configs`] is its translation of a
//! ServiceMonitor endpoint: Kubernetes endpoints discovery in the monitor's namespaces, `keep`
//! on the Service's selector labels and the endpoint's port name, the operator's target labels
//! (`namespace`, `service`, `pod`, `container`, `job`, `endpoint`) and the endpoint's
//! `honorLabels`, path, interval and bearer token.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};

use crate::process::{Proc, free_port};
use crate::{Error, Result, eventually};

/// One series of a query's answer: its labels.
pub type Labels = serde_json::Map<String, Value>;

/// `__meta_kubernetes_service_label_<name>` as Prometheus spells a label name there.
fn meta_label(name: &str) -> String {
    name.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

/// Prometheus' scrape configurations for every ServiceMonitor among `objects` (a rendered chart),
/// as the Prometheus Operator generates them; the API server is reached with `kubeconfig`, the
/// daemons with the token in `token_file` where the monitor names a bearer token file.
pub fn scrape_configs(
    objects: &[Value],
    kubeconfig: &Path,
    token_file: &Path,
    interval: &str,
) -> Vec<Value> {
    let mut out = Vec::new();
    for m in objects.iter().filter(|o| o["kind"] == "ServiceMonitor") {
        let ns = m["metadata"]["namespace"].as_str().unwrap_or_default();
        let name = m["metadata"]["name"].as_str().unwrap_or_default();
        let namespaces: Vec<Value> = m["spec"]["namespaceSelector"]["matchNames"]
            .as_array()
            .cloned()
            .unwrap_or_else(|| vec![json!(ns)]);
        let selector = m["spec"]["selector"]["matchLabels"]
            .as_object()
            .cloned()
            .unwrap_or_default();
        for (i, ep) in m["spec"]["endpoints"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .enumerate()
        {
            let mut relabel: Vec<Value> = selector
                .iter()
                .map(|(k, v)| {
                    json!({"action": "keep",
                           "source_labels": [format!("__meta_kubernetes_service_label_{}", meta_label(k))],
                           "regex": v})
                })
                .collect();
            relabel.push(json!({"action": "keep",
                "source_labels": ["__meta_kubernetes_endpoint_port_name"],
                "regex": ep["port"]}));
            for (source, target) in [
                ("__meta_kubernetes_namespace", "namespace"),
                ("__meta_kubernetes_service_name", "service"),
                ("__meta_kubernetes_pod_name", "pod"),
                ("__meta_kubernetes_pod_container_name", "container"),
                ("__meta_kubernetes_service_name", "job"),
            ] {
                relabel.push(json!({"source_labels": [source], "target_label": target}));
            }
            relabel.push(json!({"target_label": "endpoint", "replacement": ep["port"]}));
            let mut job = json!({
                "job_name": format!("serviceMonitor/{ns}/{name}/{i}"),
                "honor_labels": ep["honorLabels"].as_bool().unwrap_or(false),
                "metrics_path": ep["path"].as_str().unwrap_or("/metrics"),
                "scrape_interval": interval,
                "kubernetes_sd_configs": [{
                    "role": "endpoints",
                    "kubeconfig_file": kubeconfig,
                    "namespaces": {"names": namespaces},
                }],
                "relabel_configs": relabel,
            });
            if ep.get("bearerTokenFile").is_some() {
                job["authorization"] = json!({"credentials_file": token_file});
            }
            out.push(job);
        }
    }
    out
}

/// The rule groups of every PrometheusRule among `objects`, as a Prometheus rules file.
pub fn rule_groups(objects: &[Value]) -> Value {
    let groups: Vec<Value> = objects
        .iter()
        .filter(|o| o["kind"] == "PrometheusRule")
        .flat_map(|o| o["spec"]["groups"].as_array().cloned().unwrap_or_default())
        .collect();
    json!({ "groups": groups })
}

/// A running Prometheus.
#[derive(Debug)]
pub struct Prometheus {
    port: u16,
    _proc: Proc,
}

/// Percent-encodes a query parameter.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

impl Prometheus {
    /// Starts `binary` in `dir` with these scrape configurations and rules (evaluated every
    /// `interval`), its log in `log_dir`.
    pub fn start(
        binary: &Path,
        dir: &Path,
        log_dir: &Path,
        scrape: Vec<Value>,
        rules: &Value,
        interval: &str,
    ) -> Result<Prometheus> {
        std::fs::create_dir_all(dir)?;
        let rules_file = dir.join("rules.yaml");
        std::fs::write(&rules_file, serde_json::to_vec_pretty(rules)?)?;
        let config = json!({
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [rules_file],
            "scrape_configs": scrape,
        });
        let config_file = dir.join("prometheus.yaml");
        std::fs::write(&config_file, serde_json::to_vec_pretty(&config)?)?;
        let port = free_port();
        let mut cmd = Command::new(binary);
        cmd.arg(format!("--config.file={}", config_file.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"));
        let proc_ = Proc::spawn("prometheus", log_dir, &mut cmd)?;
        Ok(Prometheus { port, _proc: proc_ })
    }

    async fn api(&self, path: &str) -> Result<Value> {
        let (status, body) = crate::cluster::http_get_status("127.0.0.1", self.port, path, None)
            .await
            .ok_or_else(|| Error::msg(format!("Prometheus did not answer {path}")))?;
        let v: Value = serde_json::from_str(&body).map_err(|e| {
            Error::msg(format!(
                "Prometheus answered {path} with {status}: {e}: {body}"
            ))
        })?;
        if v["status"] != "success" {
            return Err(Error::msg(format!(
                "Prometheus refused {path}: {} {}",
                v["errorType"], v["error"]
            )));
        }
        Ok(v["data"].clone())
    }

    /// The series an instant query returns (an error if Prometheus cannot evaluate it).
    pub async fn query(&self, expr: &str) -> Result<Vec<Labels>> {
        let data = self
            .api(&format!("/api/v1/query?query={}", encode(expr)))
            .await?;
        Ok(data["result"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .map(|r| r["metric"].as_object().cloned().unwrap_or_default())
            .collect())
    }

    /// Waits until at least `want` targets are discovered and every discovered one is up; returns
    /// them.
    pub async fn wait_targets_up(&self, want: usize, within: Duration) -> Result<Vec<Value>> {
        eventually(
            &format!("{want} scrape targets up"),
            within,
            Duration::from_secs(1),
            || async {
                let data = self.api("/api/v1/targets").await.ok()?;
                let active = data["activeTargets"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default();
                let up = active.iter().filter(|t| t["health"] == "up").count();
                (up >= want && up == active.len()).then_some(active)
            },
        )
        .await
    }

    /// Every rule Prometheus loaded, with its health (`ok`, `err`, `unknown`) and last error.
    pub async fn rules(&self) -> Result<Vec<Value>> {
        let data = self.api("/api/v1/rules").await?;
        Ok(data["groups"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
            .collect())
    }
}

/// The metric names an expression reads: the identifiers outside braces, strings, ranges and
/// label lists that are not PromQL keywords, aggregations or function calls.
pub fn metric_names(expr: &str) -> Vec<String> {
    const WORDS: &[&str] = &[
        "sum", "max", "min", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile",
        "group", "or", "and", "unless", "bool", "offset",
    ];
    const LISTS: &[&str] = &[
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
    ];
    let chars: Vec<char> = expr.chars().collect();
    let mut names: Vec<String> = Vec::new();
    let (mut i, mut braces, mut in_list) = (0, 0usize, false);
    let mut list_next = false;
    while i < chars.len() {
        let c = chars[i];
        match c {
            '"' => {
                i += 1;
                while i < chars.len() && chars[i] != '"' {
                    i += if chars[i] == '\\' { 2 } else { 1 };
                }
            }
            '[' => {
                while i < chars.len() && chars[i] != ']' {
                    i += 1;
                }
            }
            '{' => braces += 1,
            '}' => braces = braces.saturating_sub(1),
            '(' if list_next => {
                in_list = true;
                list_next = false;
            }
            ')' if in_list => in_list = false,
            c if c.is_ascii_alphabetic() || c == '_' || c == ':' => {
                let start = i;
                while i < chars.len()
                    && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':')
                {
                    i += 1;
                }
                let word: String = chars[start..i].iter().collect();
                let next = chars[i..].iter().copied().find(|c| !c.is_whitespace());
                if LISTS.contains(&word.as_str()) {
                    list_next = true;
                } else if braces == 0
                    && !in_list
                    && next != Some('(')
                    && !WORDS.contains(&word.as_str())
                    && !names.contains(&word)
                {
                    names.push(word);
                }
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    names
}

/// The labels of the outermost `by (…)` of an expression (what a panel's series are grouped by).
pub fn grouped_by(expr: &str) -> Vec<String> {
    let Some(i) = expr.find(" by (").or_else(|| expr.find(" by(")) else {
        return Vec::new();
    };
    let rest = &expr[i..];
    let (Some(open), Some(close)) = (rest.find('('), rest.find(')')) else {
        return Vec::new();
    };
    rest[open + 1..close]
        .split(',')
        .map(|l| l.trim().to_owned())
        .filter(|l| !l.is_empty())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_names_and_groupings_are_read_from_expressions() {
        assert_eq!(
            metric_names(
                r#"sum by (device_uuid, xid) (increase(tessera_device_plugin_xid_errors_total{xid!~"13|31"}[10m])) > 0"#
            ),
            ["tessera_device_plugin_xid_errors_total"]
        );
        assert_eq!(
            metric_names(
                "max by (namespace, quota_name) (hami_resource_quota_used{namespace=~\"$namespace\"}) / on (namespace, quota_name) max by (namespace, quota_name) (hami_resource_quota_limit > 0)"
            ),
            ["hami_resource_quota_used", "hami_resource_quota_limit"]
        );
        assert_eq!(
            metric_names("max(tessera_scheduler_leader) == 0 or absent(tessera_scheduler_leader)"),
            ["tessera_scheduler_leader"]
        );
        assert_eq!(
            grouped_by("sum by (node, device_uuid) (hami_gpu_memory_allocated_bytes)"),
            ["node", "device_uuid"]
        );
        assert!(grouped_by("max(tessera_scheduler_leader)").is_empty());
    }

    #[test]
    fn a_service_monitor_becomes_the_operators_scrape_config() {
        let sm = json!({"kind": "ServiceMonitor",
            "metadata": {"name": "t-dp", "namespace": "sys"},
            "spec": {"selector": {"matchLabels": {"app.kubernetes.io/component": "device-plugin"}},
                     "namespaceSelector": {"matchNames": ["sys"]},
                     "endpoints": [{"port": "metrics", "path": "/metrics", "honorLabels": true,
                                    "bearerTokenFile": "/var/run/secrets/token"}]}});
        let c = scrape_configs(&[sm], Path::new("/k"), Path::new("/t"), "2s");
        assert_eq!(c.len(), 1);
        assert_eq!(c[0]["honor_labels"], true);
        assert_eq!(c[0]["authorization"]["credentials_file"], "/t");
        assert_eq!(
            c[0]["relabel_configs"][0]["source_labels"][0],
            "__meta_kubernetes_service_label_app_kubernetes_io_component"
        );
    }
}

//! HAMi's metric names (contract §8) as data, and a reader of the Prometheus text format to
//! compare a daemon's output with them.
//!
//! The inventory (`data/hami-v2.10-metrics.tsv`) was extracted from HAMi v2.10's source; each row
//! says what Tessera does with the metric. Both daemons' tests render every series they can and
//! check the rows of their component: an `exported` row must be there with HAMi's label names in
//! HAMi's order, a `deviation:<id>` row must name a row of `docs/contract-deviations.md`.

use std::collections::BTreeMap;

/// Which HAMi program exports a metric: the scheduler (Tessera: the extender) or the vGPU
/// monitor (Tessera: the device plugin).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricComponent {
    Scheduler,
    Monitor,
}

/// One row of the inventory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HamiMetric {
    pub component: MetricComponent,
    pub name: &'static str,
    /// Label names in HAMi's order (without the scheduler's constant `zone`).
    pub labels: Vec<&'static str>,
    /// Exported only with `--legacy-metrics`.
    pub legacy: bool,
    /// `None`: Tessera exports it as HAMi does; `Some(id)`: deviation `id`.
    pub deviation: Option<&'static str>,
}

const INVENTORY: &str = include_str!("../data/hami-v2.10-metrics.tsv");

/// Every metric HAMi v2.10 exports. The file is part of this crate, so a malformed row is a bug
/// caught by this module's test, and is skipped here rather than panicking.
pub fn hami_metrics() -> Vec<HamiMetric> {
    INVENTORY
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|line| {
            let mut f = line.split('\t');
            let component = match f.next()? {
                "scheduler" => MetricComponent::Scheduler,
                "monitor" => MetricComponent::Monitor,
                _ => return None,
            };
            let name = f.next()?;
            let labels = f.next()?.split(',').filter(|l| !l.is_empty()).collect();
            let legacy = f.next()? == "legacy";
            let deviation = match f.next()? {
                "exported" => None,
                other => Some(other.strip_prefix("deviation:")?),
            };
            Some(HamiMetric {
                component,
                name,
                labels,
                legacy,
                deviation,
            })
        })
        .collect()
}

/// One sample of a text exposition: `name{label="value",…} value [timestamp]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    /// The labels in the order written.
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl Sample {
    /// The value of label `name`, if the sample has it.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Every sample of a Prometheus text exposition (format 0.0.4), in order. Comment and metadata
/// lines are skipped, and so is a line that is not a sample (it is counted in the second
/// value, never guessed at): the text comes from a daemon over the network, and a reader of it
/// must stay useful when one line is not what it expects.
pub fn samples(text: &str) -> (Vec<Sample>, usize) {
    let mut out = Vec::new();
    let mut malformed = 0;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        match sample(line) {
            Some(s) => out.push(s),
            None => malformed += 1,
        }
    }
    (out, malformed)
}

fn sample(line: &str) -> Option<Sample> {
    let name_end = line
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .unwrap_or(line.len());
    let name = &line[..name_end];
    if name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) {
        return None;
    }
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(after) = rest.strip_prefix('{') {
        rest = after;
        loop {
            rest = rest.trim_start();
            if let Some(after) = rest.strip_prefix('}') {
                rest = after;
                break;
            }
            let eq = rest.find('=')?;
            let label = rest[..eq].trim();
            if label.is_empty() {
                return None;
            }
            let (value, after) = quoted(rest[eq + 1..].trim_start())?;
            labels.push((label.to_owned(), value));
            rest = after.trim_start();
            rest = rest.strip_prefix(',').unwrap_or(rest);
        }
    }
    let mut fields = rest.split_whitespace();
    let value = number(fields.next()?)?;
    // An optional timestamp (milliseconds), then nothing.
    if let Some(ts) = fields.next() {
        ts.parse::<i64>().ok()?;
    }
    if fields.next().is_some() {
        return None;
    }
    Some(Sample {
        name: name.to_owned(),
        labels,
        value,
    })
}

/// A double-quoted label value with the format's escapes (`\\`, `\"`, `\n`), and the text
/// after its closing quote.
fn quoted(text: &str) -> Option<(String, &str)> {
    let body = text.strip_prefix('"')?;
    let mut value = String::new();
    let mut chars = body.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return Some((value, &body[i + 1..])),
            '\\' => match chars.next()?.1 {
                'n' => value.push('\n'),
                other => value.push(other),
            },
            c => value.push(c),
        }
    }
    None
}

/// A sample value: Go's float syntax, as the format allows (`NaN`, `+Inf`, `-Inf` included).
fn number(text: &str) -> Option<f64> {
    match text {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        t => t.parse().ok(),
    }
}

/// The series names of a text exposition and, for each, the label names of its first sample
/// in their order. Names of metadata lines (`# TYPE x gauge`) with no sample map to `None`.
pub fn exposition_labels(text: &str) -> BTreeMap<String, Option<Vec<String>>> {
    let mut out: BTreeMap<String, Option<Vec<String>>> = BTreeMap::new();
    for line in text.lines() {
        if let Some(name) = line
            .strip_prefix("# TYPE ")
            .and_then(|rest| rest.split_whitespace().next())
        {
            out.entry(name.to_owned()).or_insert(None);
        }
    }
    for s in samples(text).0 {
        let slot = out.entry(s.name).or_insert(None);
        if slot.is_none() {
            *slot = Some(s.labels.into_iter().map(|(k, _)| k).collect());
        }
    }
    out
}

/// Checks a daemon's exposition against the inventory rows of `component`: `with_legacy` is its
/// output with the legacy names on, `plain` without, `deviations` the text of
/// `docs/contract-deviations.md`. Returns how many rows were checked as exported, or every
/// problem found (a missing name, other labels, a legacy name exported without the flag, a
/// deviation that names no row). The scheduler's constant `zone` label is ignored.
pub fn check_exposition(
    component: MetricComponent,
    with_legacy: &str,
    plain: &str,
    deviations: &str,
) -> Result<usize, Vec<String>> {
    let exported = exposition_labels(with_legacy);
    let plain = exposition_labels(plain);
    let mut problems = Vec::new();
    let mut checked = 0;
    for m in hami_metrics().iter().filter(|m| m.component == component) {
        if let Some(id) = m.deviation {
            if !deviations.contains(&format!("| {id} |")) {
                problems.push(format!("{}: deviation {id} is not a row", m.name));
            }
            continue;
        }
        match exported.get(m.name) {
            None => problems.push(format!("{} is not exported", m.name)),
            Some(None) => problems.push(format!("{} has no sample", m.name)),
            Some(Some(labels)) => {
                let labels: Vec<&str> = labels
                    .iter()
                    .map(String::as_str)
                    .filter(|l| *l != "zone")
                    .collect();
                if labels != m.labels {
                    problems.push(format!(
                        "{}: labels {labels:?}, HAMi's {:?}",
                        m.name, m.labels
                    ));
                }
            }
        }
        if plain.contains_key(m.name) == m.legacy {
            problems.push(format!(
                "{}: exported without --legacy-metrics: {}",
                m.name, !m.legacy
            ));
        }
        checked += 1;
    }
    if problems.is_empty() {
        Ok(checked)
    } else {
        Err(problems)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn samples_read_labels_escapes_values_and_skip_what_is_not_a_sample() {
        let text = "# HELP x y\n# TYPE hami_vgpu_memory_used_bytes gauge\n\
            hami_vgpu_memory_used_bytes{namespace=\"team-a\",pod=\"p\\\"q\",container=\"a\\\\b\\nc\"} 1.5e+09\n\
            up 1 1700000000000\n\
            no_labels{} +Inf\n\
            broken{a=\"x} 1\n\
            1bad 2\n\
            trailing 1 2 3\n";
        let (got, malformed) = samples(text);
        assert_eq!(malformed, 3);
        assert_eq!(got.len(), 3);
        assert_eq!(got[0].name, "hami_vgpu_memory_used_bytes");
        assert_eq!(got[0].label("namespace"), Some("team-a"));
        assert_eq!(got[0].label("pod"), Some("p\"q"));
        assert_eq!(got[0].label("container"), Some("a\\b\nc"));
        assert_eq!(got[0].value, 1.5e9);
        assert_eq!((got[1].name.as_str(), got[1].value), ("up", 1.0));
        assert!(got[2].labels.is_empty() && got[2].value.is_infinite());
    }

    fn escape(v: &str) -> String {
        v.replace('\\', "\\\\")
            .replace('"', "\\\"")
            .replace('\n', "\\n")
    }

    proptest! {
        /// What a daemon writes (any label values, any finite value) reads back the same.
        #[test]
        fn samples_read_back_what_was_written(
            name in "[a-zA-Z_:][a-zA-Z0-9_:]{0,20}",
            labels in proptest::collection::vec(("[a-z_][a-z0-9_]{0,8}", any::<String>()), 0..4),
            value in any::<f64>().prop_filter("finite", |v| v.is_finite()),
        ) {
            let body: Vec<String> =
                labels.iter().map(|(k, v)| format!("{k}=\"{}\"", escape(v))).collect();
            let line = format!("{name}{{{}}} {value:?}\n", body.join(","));
            let (got, malformed) = samples(&line);
            prop_assert_eq!(malformed, 0);
            prop_assert_eq!(got.len(), 1);
            prop_assert_eq!(&got[0].name, &name);
            // Lines are split on any line break: a value with \r would not round-trip.
            let want: Vec<(String, String)> = labels.clone();
            if !labels.iter().any(|(_, v)| v.contains('\r')) {
                prop_assert_eq!(&got[0].labels, &want);
            }
            prop_assert_eq!(got[0].value, value);
        }

        /// Any text: no panic.
        #[test]
        fn samples_never_panic(text in any::<String>()) {
            let _ = samples(&text);
        }
    }

    #[test]
    fn the_inventory_reads_completely() {
        let rows = INVENTORY
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
            .count();
        let metrics = hami_metrics();
        assert_eq!(metrics.len(), rows, "a malformed row was skipped");
        assert!(metrics.len() >= 45);
        let host = metrics
            .iter()
            .find(|m| m.name == "hami_host_gpu_memory_controller_utilization_ratio")
            .expect("row");
        assert_eq!(host.component, MetricComponent::Monitor);
        assert_eq!(host.labels, ["device_index", "device_uuid", "device_type"]);
        assert!(!host.legacy && host.deviation.is_none());
    }

    #[test]
    fn a_missing_or_mislabelled_metric_is_a_problem() {
        let text = "# TYPE hami_host_gpu_utilization_ratio gauge\nhami_host_gpu_utilization_ratio{device_uuid=\"a\",node=\"n\",device_index=\"0\",device_type=\"t\"} 1\n";
        let problems = check_exposition(MetricComponent::Monitor, text, text, "").unwrap_err();
        assert!(
            problems
                .iter()
                .any(|p| p == "hami_vgpu_memory_used_bytes is not exported")
        );
        assert!(
            problems
                .iter()
                .any(|p| p.starts_with("hami_host_gpu_utilization_ratio: labels"))
        );
        assert!(
            problems
                .iter()
                .any(|p| p.contains("deviation O2 is not a row"))
        );
    }

    #[test]
    fn exposition_lines_give_names_and_label_order() {
        let text = "# HELP a A\n# TYPE a gauge\na{x=\"1\",y=\"q\\\"u,o}te\"} 1\n# TYPE b counter\nb_total 3\n# TYPE c gauge\n";
        let got = exposition_labels(text);
        assert_eq!(got["a"], Some(vec!["x".to_owned(), "y".to_owned()]));
        assert_eq!(got["b_total"], Some(vec![]));
        assert_eq!(got["c"], None);
    }
}

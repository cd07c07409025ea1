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

/// The series names of a text exposition and, for each, the label names of its first sample
/// in their order. Names of metadata lines (`# TYPE x gauge`) with no sample map to `None`.
pub fn exposition_labels(text: &str) -> BTreeMap<String, Option<Vec<String>>> {
    let mut out: BTreeMap<String, Option<Vec<String>>> = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            if let Some(name) = rest.split_whitespace().next() {
                out.entry(name.to_owned()).or_insert(None);
            }
            continue;
        }
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let (name, labels) = match line.find(['{', ' ']) {
            Some(i) if line.as_bytes()[i] == b'{' => (&line[..i], label_names(&line[i + 1..])),
            Some(i) => (&line[..i], Vec::new()),
            None => continue,
        };
        let slot = out.entry(name.to_owned()).or_insert(None);
        if slot.is_none() {
            *slot = Some(labels);
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

/// Label names of `a="x",b="y\"z"} 1`, up to the closing brace.
fn label_names(mut rest: &str) -> Vec<String> {
    let mut names = Vec::new();
    loop {
        rest = rest.trim_start_matches(',');
        if rest.starts_with('}') || rest.is_empty() {
            return names;
        }
        let Some(eq) = rest.find('=') else {
            return names;
        };
        names.push(rest[..eq].trim().to_owned());
        // Skip the quoted value, honouring backslash escapes.
        let value = &rest[eq + 1..];
        let mut chars = value.char_indices().skip(1);
        let mut end = None;
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    chars.next();
                }
                '"' => {
                    end = Some(i);
                    break;
                }
                _ => {}
            }
        }
        let Some(end) = end else {
            return names;
        };
        rest = &value[end + 1..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

//! The rows of `docs/contract-deviations.md` have unique IDs, and every reference to one in the
//! repository (`deviation V6`, `deviations L2, L3`, `deviation:O1` in the metric inventory) names
//! a row that exists. Rows are cited from code, charts and docs; a renumbered or reused ID would
//! silently point readers at the wrong difference.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    test_paths::workspace_root()
}

/// `| X12 |` at the start of a table row.
fn row_ids(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("| ")?;
            let id = rest.split(' ').next()?;
            let mut chars = id.chars();
            let letter = chars.next()?;
            (letter.is_ascii_uppercase()
                && id.len() >= 2
                && chars.all(|c| c.is_ascii_digit())
                && rest[id.len()..].starts_with(" |"))
            .then(|| id.to_owned())
        })
        .collect()
}

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        if path.is_dir() {
            if !matches!(name.as_str(), "target" | ".git" | "shared" | "node_modules") {
                files(&path, out);
            }
        } else if [".rs", ".md", ".yaml", ".yml", ".tpl", ".sh", ".py", ".tsv"]
            .iter()
            .any(|ext| name.ends_with(ext))
        {
            out.push(path);
        }
    }
}

/// IDs after `deviation `, `deviations ` (a comma or `and` list) or `deviation:`.
fn references(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for start in ["deviation ", "deviations ", "deviation:", "Deviation "] {
        let mut from = 0;
        while let Some(i) = text[from..].find(start) {
            let mut rest = &text[from + i + start.len()..];
            from += i + start.len();
            loop {
                let id: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric())
                    .collect();
                let mut chars = id.chars();
                let is_id = id.len() >= 2
                    && chars.next().is_some_and(|c| c.is_ascii_uppercase())
                    && chars.all(|c| c.is_ascii_digit());
                if !is_id {
                    break;
                }
                out.push(id.clone());
                rest = &rest[id.len()..];
                let next = rest
                    .strip_prefix(", ")
                    .or_else(|| rest.strip_prefix(" and "))
                    .or_else(|| rest.strip_prefix("–"))
                    .or_else(|| rest.strip_prefix("-"));
                match next {
                    Some(r) => rest = r,
                    None => break,
                }
            }
        }
    }
    out
}

#[test]
fn deviation_ids_are_unique_and_every_reference_names_a_row() {
    let root = root();
    let doc = fs::read_to_string(root.join("docs/contract-deviations.md")).expect("read");
    let ids = row_ids(&doc);
    let mut seen = BTreeMap::<&str, usize>::new();
    for id in &ids {
        *seen.entry(id).or_default() += 1;
    }
    let dup: Vec<_> = seen
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(id, _)| *id)
        .collect();
    assert!(
        dup.is_empty(),
        "duplicate row IDs in docs/contract-deviations.md: {dup:?}"
    );
    let known: BTreeSet<&str> = ids.iter().map(String::as_str).collect();

    let mut all = Vec::new();
    files(&root, &mut all);
    let mut broken = Vec::new();
    for path in all {
        if path.ends_with("hami-contract/tests/deviation_ids.rs") {
            continue;
        }
        let Ok(text) = fs::read_to_string(&path) else {
            continue;
        };
        for id in references(&text) {
            if !known.contains(id.as_str()) {
                broken.push(format!(
                    "{}: deviation {id}",
                    path.strip_prefix(&root).unwrap_or(&path).display()
                ));
            }
        }
    }
    assert!(
        broken.is_empty(),
        "references to missing rows:\n{}",
        broken.join("\n")
    );
}

#[test]
fn references_are_read_in_lists() {
    assert_eq!(
        references("see deviations L2, L3 and V6; deviation:O1; a deviation from HAMi"),
        ["L2", "L3", "V6", "O1"]
    );
    assert_eq!(row_ids("| V6 | x |\n| # | Input |\n|---|"), ["V6"]);
}

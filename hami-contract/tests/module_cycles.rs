//! The workspace's layering, checked: no two modules of one crate depend on each other in a
//! circle (`crate::a` uses `crate::b`, which uses `crate::a`, directly or through others). A
//! circle means neither can be understood, tested or moved alone. The one exception is the shim's
//! symbol table: `real` (the driver's symbols, resolved with `dlsym`) names the hooks that
//! `cuGetProcAddress` must hand out instead of the driver's, and every hook calls `real`; the
//! C ABI makes that edge part of the table, so it is not counted.
//!
//! Modules are the top-level ones (`src/a.rs` or `src/a/…`); `src/lib.rs`, `src/main.rs` and
//! `src/bin/*` are the roots and may use anything. Test modules (`#[cfg(test)] mod tests` at the
//! end of a file) are skipped.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Uses that are not counted: (crate directory, module, the module it uses).
const ALLOWED: &[(&str, &str, &str)] = &[("libvgpu-shim", "real", "hooks")];

fn workspace_root() -> PathBuf {
    test_paths::workspace_root()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The top-level module a file of `src` belongs to, or `None` for the crate roots.
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).ok()?;
    let first = rel.components().next()?.as_os_str().to_str()?;
    let name = first.trim_end_matches(".rs");
    (!matches!(name, "lib" | "main" | "bin")).then(|| name.to_owned())
}

/// `crate::x` references in code (not comments) outside the file's trailing test module.
fn references(text: &str) -> BTreeSet<String> {
    let code: String = text
        .split("#[cfg(test)]\nmod tests")
        .next()
        .unwrap_or(text)
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n");
    let body = code.as_str();
    let mut out = BTreeSet::new();
    for (i, _) in body.match_indices("crate::") {
        let rest = &body[i + "crate::".len()..];
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() {
            out.insert(name);
        }
        // `use crate::{a, b::c}`
        if let Some(group) = rest.strip_prefix('{') {
            for item in group.split('}').next().unwrap_or("").split(',') {
                let n: String = item
                    .trim()
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if !n.is_empty() {
                    out.insert(n);
                }
            }
        }
    }
    out
}

/// Every circle among `deps` (a module's own uses excluded), as sorted module lists.
fn circles(deps: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    let reach = |from: &str| -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.to_owned()];
        while let Some(m) = todo.pop() {
            for d in deps.get(&m).into_iter().flatten() {
                if seen.insert(d.clone()) {
                    todo.push(d.clone());
                }
            }
        }
        seen
    };
    let reachable: BTreeMap<&String, BTreeSet<String>> =
        deps.keys().map(|m| (m, reach(m))).collect();
    let mut out: BTreeSet<Vec<String>> = BTreeSet::new();
    for (m, r) in &reachable {
        if !r.contains(*m) {
            continue;
        }
        // The strongly connected component of m.
        let mut comp: Vec<String> = r
            .iter()
            .filter(|o| reachable.get(o).is_some_and(|ro| ro.contains(*m)))
            .cloned()
            .collect();
        comp.sort();
        out.insert(comp);
    }
    out.into_iter().collect()
}

#[test]
fn no_two_modules_of_a_crate_depend_on_each_other() {
    let root = workspace_root();
    let mut manifests = Vec::new();
    for dir in ["", "test-support", "bench"] {
        let Ok(rd) = std::fs::read_dir(root.join(dir)) else {
            continue;
        };
        for e in rd.flatten() {
            if e.path().join("Cargo.toml").is_file() && e.path().join("src").is_dir() {
                manifests.push(e.path());
            }
        }
    }
    assert!(manifests.len() >= 10, "found only {manifests:?}");
    let mut problems = Vec::new();
    for krate in manifests {
        let name = krate
            .strip_prefix(&root)
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        let src = krate.join("src");
        let mut files = Vec::new();
        rust_files(&src, &mut files);
        let mut deps: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for f in &files {
            let Some(m) = module_of(&src, f) else {
                continue;
            };
            let text = std::fs::read_to_string(f).unwrap_or_default();
            let entry = deps.entry(m.clone()).or_default();
            for r in references(&text) {
                if r != m {
                    entry.insert(r);
                }
            }
        }
        let known: BTreeSet<String> = deps.keys().cloned().collect();
        for (m, d) in deps.iter_mut() {
            d.retain(|x| {
                known.contains(x)
                    && !ALLOWED
                        .iter()
                        .any(|(k, from, to)| *k == name && from == m && to == x)
            });
        }
        for c in circles(&deps) {
            problems.push(format!("{name}: {}", c.join(" <-> ")));
        }
    }
    assert!(
        problems.is_empty(),
        "modules that depend on each other in a circle:\n{}",
        problems.join("\n")
    );
}

#[test]
fn circles_are_found_through_groups_and_chains() {
    let refs = references("use crate::{a, b::X};\nfn f() { crate::c::g(); }");
    assert_eq!(
        refs,
        ["a", "b", "c"].iter().map(|s| s.to_string()).collect()
    );
    let deps: BTreeMap<String, BTreeSet<String>> = [
        ("a", vec!["b"]),
        ("b", vec!["c"]),
        ("c", vec!["a"]),
        ("d", vec!["a"]),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.into_iter().map(str::to_owned).collect()))
    .collect();
    assert_eq!(circles(&deps), vec![vec!["a", "b", "c"]]);
}

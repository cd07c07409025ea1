//! Every citation of the HAMi contract (and of the kubelet facts) in the repository names a
//! section that exists, and no citation points outside the repository.
//!
//! The contract lives in the repository (`docs/contract/`), and code cites it as:
//! * `contract §x.y` → `docs/contract/hami.md` (HAMi v2.10 control plane); a chain continues the
//!   same citation: `contract §5.2–§5.5, §5.7`, `contract §3.3 and §2.5`;
//! * `core contract §x.y` → `docs/contract/hami-core.md` (HAMi-core, `libvgpu.so`);
//! * `Appendix B #n` (optionally `contract Appendix B #n`) → item n of hami.md's Appendix B;
//! * `facts §n`, `facts §n.m`, `facts §10 (a)` (or the file's name before the section sign) →
//!   `docs/design/kubelet-device-manager-facts.md`, whose `### (a) …` headings under `## 10. …`
//!   are the sections `10 (a)`, …;
//! * other documents as `<file>.md §n` (not checked here).
//!
//! A bare section sign followed by a number is ambiguous and fails, as does `Appendix B.n` (write
//! `Appendix B #n`). Inside `docs/contract/*.md` and the facts document a bare section sign means
//! the same document. Scanned: every `.rs`, `.md`, `.yaml`, `.yml`, `.tpl`, `.toml` and `.sh`
//! file of the repository, except `target/` directories, `.git/`, `shared/` and this file.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};

const SECTION: char = '\u{a7}';

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Doc {
    Hami,
    Core,
    Facts,
}

impl fmt::Display for Doc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Doc::Hami => "docs/contract/hami.md",
            Doc::Core => "docs/contract/hami-core.md",
            Doc::Facts => "docs/design/kubelet-device-manager-facts.md",
        })
    }
}

/// The headings of one contract document.
#[derive(Debug, Default)]
struct Outline {
    /// `0`, `1`, `1.1`, … from `## 1. …` and `### 1.1 …`; `10 (a)` from `### (a) …` under
    /// `## 10. …`.
    sections: BTreeSet<String>,
    /// Appendix letter → its numbered items (`1. …` lines directly under `## Appendix B. …`).
    appendices: BTreeMap<char, BTreeSet<u32>>,
}

fn leading_number(s: &str) -> Option<&str> {
    let end = s
        .char_indices()
        .find(|&(i, c)| {
            !(c.is_ascii_digit()
                || (c == '.' && s[i + 1..].starts_with(|d: char| d.is_ascii_digit())))
        })
        .map_or(s.len(), |(i, _)| i);
    (end > 0).then(|| &s[..end])
}

/// The letter of a leading `(a)`.
fn lettered(s: &str) -> Option<char> {
    let mut chars = s.chars();
    match (chars.next(), chars.next(), chars.next()) {
        (Some('('), Some(l), Some(')')) if l.is_ascii_lowercase() => Some(l),
        _ => None,
    }
}

fn parse_outline(text: &str) -> Outline {
    let mut out = Outline::default();
    let mut appendix: Option<char> = None;
    let mut chapter: Option<String> = None;
    let mut in_fence = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
            continue;
        }
        if in_fence {
            continue;
        }
        if let Some(rest) = line.strip_prefix("## ") {
            appendix = None;
            chapter = None;
            if let Some(letter) = rest.strip_prefix("Appendix ") {
                let mut chars = letter.chars();
                if let (Some(l), Some('.')) = (chars.next(), chars.next()) {
                    appendix = Some(l);
                    out.appendices.entry(l).or_default();
                }
            } else if let Some(n) = leading_number(rest)
                && !n.contains('.')
                && rest[n.len()..].starts_with(". ")
            {
                out.sections.insert(n.to_owned());
                chapter = Some(n.to_owned());
            }
        } else if let Some(rest) = line.strip_prefix("### ") {
            if let Some(n) = leading_number(rest)
                && n.contains('.')
                && rest[n.len()..].starts_with(' ')
            {
                out.sections.insert(n.to_owned());
            } else if let Some(ch) = &chapter
                && let Some(letter) = lettered(rest)
                && rest[3..].starts_with(' ')
            {
                out.sections.insert(format!("{ch} ({letter})"));
            }
        } else if let Some(l) = appendix
            && let Some(n) = leading_number(line)
            && !n.contains('.')
            && line[n.len()..].starts_with(". ")
        {
            let item = n.parse().expect("item number");
            out.appendices.entry(l).or_default().insert(item);
        }
    }
    out
}

/// One citation found in a file.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Cite {
    Section {
        doc: Doc,
        number: String,
    },
    Appendix {
        letter: char,
        item: Option<u32>,
    },
    /// A bare section sign: which document is meant?
    Bare {
        number: String,
    },
    /// Something that looks like a citation but does not follow the convention.
    Malformed {
        text: String,
        hint: &'static str,
    },
}

/// Text with comment markers stripped and lines joined by one space, so a citation wrapped over
/// two comment lines (`… contract` / `//! §5.7 …`) reads as one; `starts` maps offsets to
/// lines.
struct Joined {
    text: String,
    starts: Vec<usize>,
}

impl Joined {
    fn new(src: &str) -> Self {
        let mut text = String::with_capacity(src.len());
        let mut starts = Vec::new();
        for line in src.lines() {
            starts.push(text.len());
            let t = line
                .trim_start()
                .trim_start_matches(['/', '!', '#', '*', '>'])
                .trim_start();
            text.push_str(t);
            text.push(' ');
        }
        Self { text, starts }
    }

    fn line_of(&self, offset: usize) -> usize {
        self.starts.partition_point(|&s| s <= offset)
    }
}

/// What the words before a citation say about its document.
enum Qualifier {
    Hami,
    Core,
    Facts,
    Other,
    None,
}

fn qualifier(before: &str) -> Qualifier {
    let b = before.trim_end().to_lowercase();
    if b.ends_with("core contract") {
        Qualifier::Core
    } else if b.ends_with("contract") {
        Qualifier::Hami
    } else {
        let last = b.rsplit(char::is_whitespace).next().unwrap_or("");
        let last = last.trim_matches(['`', '(', ')', '[', ']', ',', ':', ';']);
        if last == "facts" || last.ends_with("kubelet-device-manager-facts.md") {
            Qualifier::Facts
        } else if last.ends_with(".md") {
            Qualifier::Other
        } else {
            Qualifier::None
        }
    }
}

/// A section number right after the section sign at `at`: (number, end offset).
fn section_at(text: &str, at: usize) -> Option<(String, usize)> {
    let start = at + SECTION.len_utf8();
    let n = leading_number(&text[start..])?;
    Some((n.to_owned(), start + n.len()))
}

/// Continues a chain after a number ending at `end`: the next section sign's offset.
fn chain_next(text: &str, end: usize) -> Option<usize> {
    let rest = &text[end..];
    for sep in ["\u{2013}", "\u{2014}", "-", ",", " and ", " or ", "/"] {
        if let Some(after) = rest.strip_prefix(sep) {
            let trimmed = after.trim_start();
            if trimmed.starts_with(SECTION) {
                return Some(end + sep.len() + (after.len() - trimmed.len()));
            }
        }
    }
    None
}

/// Every citation in `src` with its 1-based line. `own` is the document a bare section sign
/// refers to (inside `docs/contract/` and the facts document), if any.
fn extract(src: &str, own: Option<Doc>) -> Vec<(usize, Cite)> {
    let j = Joined::new(src);
    let text = &j.text;
    let mut found = Vec::new();
    let mut skip_to = 0;
    for (at, c) in text.char_indices() {
        if c != SECTION || at < skip_to {
            continue;
        }
        let Some((first, mut end)) = section_at(text, at) else {
            continue;
        };
        let doc = match qualifier(&text[..at]) {
            Qualifier::Hami => Some(Doc::Hami),
            Qualifier::Core => Some(Doc::Core),
            Qualifier::Facts => Some(Doc::Facts),
            Qualifier::Other => None,
            Qualifier::None => match own {
                Some(d) => Some(d),
                None => {
                    found.push((
                        j.line_of(at),
                        Cite::Bare {
                            number: first.clone(),
                        },
                    ));
                    None
                }
            },
        };
        // The facts document has lettered sections: `§10 (a)`.
        let lettered_at = |number: String, end: &mut usize| match text[*end..]
            .strip_prefix(' ')
            .and_then(lettered)
        {
            Some(l) if doc == Some(Doc::Facts) => {
                *end += " (a)".len();
                format!("{number} ({l})")
            }
            _ => number,
        };
        let first = lettered_at(first, &mut end);
        let mut numbers = vec![(at, first)];
        while let Some(next) = chain_next(text, end) {
            let Some((n, mut e)) = section_at(text, next) else {
                break;
            };
            numbers.push((next, lettered_at(n, &mut e)));
            end = e;
        }
        skip_to = end;
        if let Some(doc) = doc {
            for (pos, number) in numbers {
                found.push((j.line_of(pos), Cite::Section { doc, number }));
            }
        }
    }
    let mut from = 0;
    while let Some(i) = text[from..].find("Appendix ") {
        let at = from + i;
        from = at + "Appendix ".len();
        let rest = &text[from..];
        let Some(letter) = rest.chars().next().filter(char::is_ascii_uppercase) else {
            continue;
        };
        let after = &rest[1..];
        let line = j.line_of(at);
        if matches!(qualifier(&text[..at]), Qualifier::Core) {
            found.push((
                line,
                Cite::Malformed {
                    text: format!("core contract Appendix {letter}"),
                    hint: "hami-core.md has no appendices",
                },
            ));
        } else if let Some(n) = after.strip_prefix('.').and_then(leading_number) {
            found.push((
                line,
                Cite::Malformed {
                    text: format!("Appendix {letter}.{n}"),
                    hint: "write `Appendix X #n`",
                },
            ));
        } else if let Some(n) = after.strip_prefix(" #").and_then(leading_number) {
            found.push((
                line,
                Cite::Appendix {
                    letter,
                    item: n.parse().ok(),
                },
            ));
        } else if !after.starts_with(|c: char| c.is_alphanumeric()) {
            found.push((line, Cite::Appendix { letter, item: None }));
        }
    }
    found.sort_by_key(|(l, _)| *l);
    found
}

/// Why a citation does not resolve, if it does not.
fn check(cite: &Cite, hami: &Outline, core: &Outline, facts: &Outline) -> Option<String> {
    match cite {
        Cite::Section { doc, number } => {
            let (outline, prefix) = match doc {
                Doc::Hami => (hami, "contract"),
                Doc::Core => (core, "core contract"),
                Doc::Facts => (facts, "facts"),
            };
            (!outline.sections.contains(number))
                .then(|| format!("`{prefix} {SECTION}{number}`: no such section in {doc}"))
        }
        Cite::Appendix { letter, item } => match (hami.appendices.get(letter), item) {
            (None, _) => Some(format!(
                "`Appendix {letter}`: no such appendix in {}",
                Doc::Hami
            )),
            (Some(items), Some(n)) if !items.contains(n) => Some(format!(
                "`Appendix {letter} #{n}`: no such item in {}",
                Doc::Hami
            )),
            _ => None,
        },
        Cite::Bare { number } => Some(format!(
            "bare `{SECTION}{number}` is ambiguous: write `contract {SECTION}{number}` \
             (docs/contract/hami.md) or `core contract {SECTION}{number}` \
             (docs/contract/hami-core.md)"
        )),
        Cite::Malformed { text, hint } => Some(format!("`{text}`: {hint}")),
    }
}

/// The workspace root; `CONTRACT_REFS_ROOT` points the check at another checkout.
fn repo_root() -> PathBuf {
    if let Some(root) = std::env::var_os("CONTRACT_REFS_ROOT") {
        return root.into();
    }
    test_paths::workspace_root()
}

fn outline(root: &Path, doc: Doc) -> (String, Outline) {
    let path = root.join(doc.to_string());
    let text = fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let outline = parse_outline(&text);
    (text, outline)
}

/// Scanned on its own, where a bare section sign means itself.
const FACTS_PATH: &str = "docs/design/kubelet-device-manager-facts.md";

const EXTENSIONS: [&str; 7] = ["rs", "md", "yaml", "yml", "tpl", "toml", "sh"];

fn walk(dir: &Path, root: &Path, out: &mut Vec<PathBuf>) {
    // Files may move while other work goes on; a vanished entry is simply skipped.
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let Ok(kind) = entry.file_type() else {
            continue;
        };
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if kind.is_dir() {
            let rel = path.strip_prefix(root).unwrap_or(&path);
            let skip = matches!(name.as_ref(), "target" | ".git" | "node_modules")
                || rel == Path::new("shared")
                || rel == Path::new("docs/contract");
            if !skip {
                walk(&path, root, out);
            }
        } else if kind.is_file()
            && path
                .extension()
                .is_some_and(|e| EXTENSIONS.contains(&e.to_string_lossy().as_ref()))
            && !path.ends_with("hami-contract/tests/contract_refs.rs")
            && path.strip_prefix(root).ok() != Some(Path::new(FACTS_PATH))
        {
            out.push(path);
        }
    }
}

#[test]
fn every_contract_citation_resolves() {
    let root = repo_root();
    let (hami_text, hami) = outline(&root, Doc::Hami);
    let (core_text, core) = outline(&root, Doc::Core);
    let (facts_text, facts) = outline(&root, Doc::Facts);

    let mut files = Vec::new();
    walk(&root, &root, &mut files);
    files.sort();

    let mut problems = Vec::new();
    let mut resolved = 0usize;
    let mut report = |rel: &str, cites: Vec<(usize, Cite)>| {
        for (line, cite) in cites {
            match check(&cite, &hami, &core, &facts) {
                Some(why) => problems.push(format!("{rel}:{line}: {why}")),
                None => resolved += 1,
            }
        }
    };
    for path in &files {
        let Ok(src) = fs::read_to_string(path) else {
            continue;
        };
        let rel = path
            .strip_prefix(&root)
            .unwrap_or(path)
            .display()
            .to_string();
        report(&rel, extract(&src, None));
    }
    // The documents' own cross-references.
    report(
        "docs/contract/hami.md",
        extract(&hami_text, Some(Doc::Hami)),
    );
    report(
        "docs/contract/hami-core.md",
        extract(&core_text, Some(Doc::Core)),
    );
    report(FACTS_PATH, extract(&facts_text, Some(Doc::Facts)));

    assert!(
        problems.is_empty(),
        "{} citation(s) do not resolve (convention: docs/contract/hami.md header, \
         facts: {FACTS_PATH} header):\n{}",
        problems.len(),
        problems.join("\n")
    );
    assert!(
        resolved >= 20,
        "only {resolved} citations found under {}: wrong root?",
        root.display()
    );
}

#[test]
fn documents_have_the_expected_outline() {
    let root = repo_root();
    let (_, hami) = outline(&root, Doc::Hami);
    let (_, core) = outline(&root, Doc::Core);
    for n in [
        "0", "1", "1.1", "1.5", "2.5", "3.3", "4.5", "5.7", "6.6", "7", "8.2", "9",
    ] {
        assert!(
            hami.sections.contains(n),
            "hami.md lacks {SECTION}{n}: {:?}",
            hami.sections
        );
    }
    assert_eq!(
        hami.appendices[&'B'],
        (1..=16).collect::<BTreeSet<u32>>(),
        "hami.md Appendix B items"
    );
    assert!(hami.appendices.contains_key(&'A') && hami.appendices.contains_key(&'C'));
    for n in [
        "0", "1.2", "2", "3.1", "3.2", "4.2", "4.8", "5.2", "5.4", "6.3", "8.1", "11",
    ] {
        assert!(
            core.sections.contains(n),
            "hami-core.md lacks {SECTION}{n}: {:?}",
            core.sections
        );
    }
    let (_, facts) = outline(&root, Doc::Facts);
    for n in [
        "0", "1", "1.1", "1.2", "1.3", "1.4", "1.5", "1.6", "2", "2.1", "2.2", "3.1", "3.2", "4",
        "4.1", "4.2", "4.3", "4.4", "4.5", "5", "6", "7", "8", "9", "10", "10 (a)", "10 (b)",
        "10 (c)", "11.1",
    ] {
        assert!(
            facts.sections.contains(n),
            "{FACTS_PATH} lacks {SECTION}{n}: {:?}",
            facts.sections
        );
    }
}

/// Documents that live outside the repository (the research workspace's `shared/docs/`): the
/// repository must stand on its own, so nothing may cite them.
const OUTSIDE: [&str; 10] = [
    "shared/docs",
    "allocation-identity-facts.md",
    "kubernetes-apis.md",
    "real-node-facts.md",
    "hami-lessons.md",
    "peers.md",
    "code-models.md",
    "control-plane-build.md",
    "hami-contract.md",
    "hami-core-contract.md",
];

#[test]
fn nothing_cites_documents_outside_the_repository() {
    let root = repo_root();
    let mut files = Vec::new();
    walk(&root, &root, &mut files);
    for doc in [Doc::Hami, Doc::Core, Doc::Facts] {
        files.push(root.join(doc.to_string()));
    }
    files.sort();
    let mut problems = Vec::new();
    for path in &files {
        let Ok(src) = fs::read_to_string(path) else {
            continue;
        };
        let rel = path.strip_prefix(&root).unwrap_or(path).display();
        for (i, line) in src.lines().enumerate() {
            for name in OUTSIDE {
                if line.contains(name) {
                    problems.push(format!("{rel}:{}: cites `{name}`", i + 1));
                }
            }
        }
    }
    assert!(
        problems.is_empty(),
        "{} reference(s) to documents outside the repository (cite docs/contract/, \
         docs/design/ or another in-repo document instead):\n{}",
        problems.len(),
        problems.join("\n")
    );
}

#[test]
fn extraction_follows_the_convention() {
    let s = |doc, n: &str| Cite::Section {
        doc,
        number: n.to_owned(),
    };
    let src = "//! Fit (contract \u{a7}5.2\u{2013}\u{a7}5.5, \u{a7}5.7) and the lock (\u{a7}2.4).\n\
               /// HAMi-core layout (core contract \u{a7}4.2), see facts \u{a7}1.2, \u{a7}3 and\n\
               /// `kubernetes-apis.md` \u{a7}1.4; quirk Appendix B #14, old form Appendix B.2.\n\
               //! wrapped: request (HAMi's quota pre-check, contract\n\
               //! \u{a7}5.7) and \u{a7}(b) is not a number.\n";
    let got = extract(src, None);
    let want = vec![
        (1, s(Doc::Hami, "5.2")),
        (1, s(Doc::Hami, "5.5")),
        (1, s(Doc::Hami, "5.7")),
        (
            1,
            Cite::Bare {
                number: "2.4".into(),
            },
        ),
        (2, s(Doc::Core, "4.2")),
        (2, s(Doc::Facts, "1.2")),
        (2, s(Doc::Facts, "3")),
        (
            3,
            Cite::Appendix {
                letter: 'B',
                item: Some(14),
            },
        ),
        (
            3,
            Cite::Malformed {
                text: "Appendix B.2".into(),
                hint: "write `Appendix X #n`",
            },
        ),
        (5, s(Doc::Hami, "5.7")),
    ];
    assert_eq!(got, want);
    // Inside a contract document a bare section sign is that document's own section.
    assert_eq!(
        extract("see \u{a7}4.6.", Some(Doc::Core)),
        vec![(1, s(Doc::Core, "4.6"))]
    );
    // The facts document: lettered sections, its file name as the qualifier, chains.
    let src = "//! the lock (facts \u{a7}10 (a)) and the registry\n\
               //! (`docs/design/kubelet-device-manager-facts.md` \u{a7}10 (b), \u{a7}2.1 (the loop)).\n\
               //! Not lettered: contract \u{a7}5.6 (a).\n";
    assert_eq!(
        extract(src, None),
        vec![
            (1, s(Doc::Facts, "10 (a)")),
            (2, s(Doc::Facts, "10 (b)")),
            (2, s(Doc::Facts, "2.1")),
            (3, s(Doc::Hami, "5.6")),
        ]
    );
    assert_eq!(
        extract("as in \u{a7}1.6 and \u{a7}10 (c).", Some(Doc::Facts)),
        vec![(1, s(Doc::Facts, "1.6")), (1, s(Doc::Facts, "10 (c)"))]
    );
    let outline = parse_outline(
        "## 9. Open\n### 9.1 One\n### (z) Lettered\n\
         ## 10. Options\n### (a) Lock\n### (b) Registry\n## Sources\n### (c) orphan\n",
    );
    let want: BTreeSet<String> = ["9", "9.1", "9 (z)", "10", "10 (a)", "10 (b)"]
        .map(String::from)
        .into();
    assert_eq!(outline.sections, want);
}

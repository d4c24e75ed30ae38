//! The floors of `src/` (docs/ARCHITECTURE.md): every folder imports only the folders
//! below it, so no two folders import each other, directly or round a cycle.
//!
//! ```text
//! core ← control ← backend ← group ← pool ← coll ← observe
//! ```
//!
//! The top-level files (`error.rs`, `error/`, `deadline.rs`, `dtype.rs`, `stream.rs`)
//! are shared leaves: every folder may use them, and they import no folder but `core`,
//! which imports none of them. `lib.rs` (the crate root, which re-exports) may use
//! anything.
//!
//! The test reads the sources as text, and with them the unit tests under `tests/unit/`
//! that `src/` includes through `#[path]`, as the modules they are: it drops comments,
//! strings and character literals, follows `mod NAME { … }` blocks, and resolves every
//! path that starts with `crate::`, `$crate::` or `super::` to the folder (or leaf) it
//! names, through the crate root's re-exports for `crate::Name`. Any reference that points up, or from a
//! leaf to a folder other than `core`, fails the test with its file and line.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// The folders of `src/`, lowest first: a folder may import those before it.
const FLOORS: &[&str] = &[
    "core", "control", "backend", "group", "pool", "coll", "observe",
];
/// The shared top-level modules (files, or `error/` with its `error.rs`).
const LEAVES: &[&str] = &["error", "deadline", "dtype", "stream"];
/// The folders a leaf may import.
const LEAF_MAY_IMPORT: &[&str] = &["core"];

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    /// `::`
    Path,
    Punct(char),
}

/// The tokens of `src` that matter for paths, with their line numbers: identifiers,
/// `::` and single punctuation; comments, strings, characters and numbers dropped.
fn tokens(src: &str) -> Vec<(usize, Tok)> {
    let c: Vec<char> = src.chars().collect();
    let (mut i, mut line, mut out) = (0, 1, Vec::new());
    let newlines = |s: &[char]| s.iter().filter(|&&ch| ch == '\n').count();
    while i < c.len() {
        let ch = c[i];
        let next = c.get(i + 1).copied();
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && next == Some('/') {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && next == Some('*') {
            let (start, mut depth) = (i, 0);
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            line += newlines(&c[start..i]);
        } else if ch == 'r'
            && matches!(next, Some('"') | Some('#'))
            && raw_string_end(&c, i + 1).is_some()
        {
            let end = raw_string_end(&c, i + 1).unwrap_or(c.len());
            line += newlines(&c[i..end]);
            i = end;
        } else if ch == 'b' && next == Some('r') && raw_string_end(&c, i + 2).is_some() {
            let end = raw_string_end(&c, i + 2).unwrap_or(c.len());
            line += newlines(&c[i..end]);
            i = end;
        } else if ch == '"' || (ch == 'b' && next == Some('"')) {
            let start = i;
            i += if ch == 'b' { 2 } else { 1 };
            while i < c.len() && c[i] != '"' {
                i += if c[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            line += newlines(&c[start..i.min(c.len())]);
        } else if ch == '\'' {
            // A character literal ('x', '\n', '\u{..}') or a lifetime ('a).
            if next == Some('\\') {
                i += 2;
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if c.get(i + 2) == Some(&'\'') {
                i += 3;
            } else {
                i += 1;
                while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                    i += 1;
                }
            }
        } else if ch.is_alphabetic() || ch == '_' {
            let start = i;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            out.push((line, Tok::Ident(c[start..i].iter().collect())));
        } else if ch.is_ascii_digit() {
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_' || c[i] == '.') {
                i += 1;
            }
        } else if ch == ':' && next == Some(':') {
            out.push((line, Tok::Path));
            i += 2;
        } else {
            out.push((line, Tok::Punct(ch)));
            i += 1;
        }
    }
    out
}

/// Where the raw string whose `#`s or quote start at `at` ends, if it is one.
fn raw_string_end(c: &[char], at: usize) -> Option<usize> {
    let mut i = at;
    while c.get(i) == Some(&'#') {
        i += 1;
    }
    let hashes = i - at;
    if c.get(i) != Some(&'"') {
        return None;
    }
    i += 1;
    while i < c.len() {
        if c[i] == '"' && (1..=hashes).all(|k| c.get(i + k) == Some(&'#')) {
            return Some(i + 1 + hashes);
        }
        i += 1;
    }
    Some(c.len())
}

/// One reference: a line and the top-level module a path names.
struct Reference {
    line: usize,
    target: String,
}

/// The first segments of the paths `crate::{…}` groups and plain paths name, starting
/// at token `i` (just past `crate::`): for a group, every first segment in it.
fn first_segments(toks: &[(usize, Tok)], i: usize) -> Vec<(usize, String)> {
    match toks.get(i) {
        Some((line, Tok::Ident(name))) => vec![(*line, name.clone())],
        Some((_, Tok::Punct('{'))) => {
            let (mut depth, mut j, mut out) = (0, i, Vec::new());
            let mut at_start = true;
            while let Some((line, t)) = toks.get(j) {
                match t {
                    Tok::Punct('{') => {
                        depth += 1;
                        at_start = depth == 1;
                    }
                    Tok::Punct('}') => {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    Tok::Punct(',') if depth == 1 => at_start = true,
                    Tok::Ident(name) if at_start && depth == 1 => {
                        out.push((*line, name.clone()));
                        at_start = false;
                    }
                    _ => at_start = false,
                }
                j += 1;
            }
            out
        }
        _ => Vec::new(),
    }
}

/// The crate-root names `lib.rs` brings in with `use` (`pub use pool::SymmPool`, …):
/// name → the top-level module it comes from.
fn root_names(lib: &str) -> BTreeMap<String, String> {
    let toks = tokens(lib);
    let mut names = BTreeMap::new();
    let mut i = 0;
    while i < toks.len() {
        if toks[i].1 == Tok::Ident("use".into()) {
            let mut j = i + 1;
            let Some((_, Tok::Ident(module))) = toks.get(j) else {
                i += 1;
                continue;
            };
            let module = module.clone();
            // Every identifier up to the `;` that is not followed by `::`, nor is `as`
            // or followed by `as`, is a name the root gets.
            while let Some((_, t)) = toks.get(j) {
                if *t == Tok::Punct(';') {
                    break;
                }
                if let Tok::Ident(name) = t {
                    let next = toks.get(j + 1).map(|(_, t)| t);
                    let is_last = !matches!(next, Some(Tok::Path))
                        && next != Some(&Tok::Ident("as".into()))
                        && name != "as";
                    if is_last {
                        names.insert(name.clone(), module.clone());
                    }
                }
                j += 1;
            }
            i = j;
        }
        i += 1;
    }
    names
}

/// The module path of a source file: `src/pool/growth.rs` → `[pool, growth]`,
/// `src/pool/mod.rs` → `[pool]`, `src/error.rs` → `[error]`.
fn module_path(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap_or(file);
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    if parts.last().is_some_and(|p| p == "mod" || p == "lib") {
        parts.pop();
    }
    parts
}

/// Every top-level module the code of `file` (module `base`) refers to, with the line.
fn references(base: &[String], file: &Path, root: &BTreeMap<String, String>) -> Vec<Reference> {
    let text = fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let toks = tokens(&text);
    // Inline `mod NAME {` blocks: (name, brace depth at which it closes).
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let mut out = Vec::new();
    let resolve = |name: &str| -> Option<String> {
        if FLOORS.contains(&name) || LEAVES.contains(&name) {
            Some(name.to_string())
        } else {
            root.get(name).cloned()
        }
    };
    for i in 0..toks.len() {
        let t = &toks[i].1;
        let prev_is_path = i > 0 && toks[i - 1].1 == Tok::Path;
        match t {
            Tok::Punct('{') => depth += 1,
            Tok::Punct('}') => {
                depth = depth.saturating_sub(1);
                if inline.last().is_some_and(|(_, d)| *d == depth) {
                    inline.pop();
                }
            }
            Tok::Ident(m) if m == "mod" => {
                if let (Some((_, Tok::Ident(name))), Some((_, Tok::Punct('{')))) =
                    (toks.get(i + 1), toks.get(i + 2))
                {
                    inline.push((name.clone(), depth));
                }
            }
            Tok::Ident(c)
                if c == "crate"
                    && !prev_is_path
                    && toks.get(i + 1).map(|(_, t)| t) == Some(&Tok::Path) =>
            {
                for (l, name) in first_segments(&toks, i + 2) {
                    if let Some(target) = resolve(&name) {
                        out.push(Reference { line: l, target });
                    }
                }
            }
            Tok::Ident(s) if s == "super" && !prev_is_path => {
                // Climb from the module the `super` is written in.
                let mut here: Vec<String> = base.to_vec();
                here.extend(inline.iter().map(|(n, _)| n.clone()));
                let mut j = i;
                while toks.get(j).map(|(_, t)| t) == Some(&Tok::Ident("super".into()))
                    && toks.get(j + 1).map(|(_, t)| t) == Some(&Tok::Path)
                {
                    here.pop();
                    j += 2;
                }
                if here.is_empty() {
                    for (l, name) in first_segments(&toks, j) {
                        if let Some(target) = resolve(&name) {
                            out.push(Reference { line: l, target });
                        }
                    }
                }
            }
            _ => {}
        }
    }
    out
}

/// The files that `files` (of `src/`) bring into the crate from outside `src/` (the
/// unit tests under `tests/unit/`), with their module paths: `#[path = "…"] mod NAME;`
/// in any of them, and `mod NAME;` in such a file named `mod.rs` (its `NAME.rs`).
fn included_from_outside(src: &Path, files: &[PathBuf]) -> BTreeMap<PathBuf, Vec<String>> {
    let mut found = BTreeMap::new();
    let mut todo: Vec<(PathBuf, Vec<String>)> = (files.iter())
        .map(|f| (f.clone(), module_path(src, f)))
        .collect();
    while let Some((file, module)) = todo.pop() {
        let text = fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let mut path = None;
        for line in text.lines().map(str::trim) {
            if let Some(p) = (line.strip_prefix("#[path = \"")).and_then(|l| l.strip_suffix("\"]"))
            {
                path = Some(p.to_string());
                continue;
            }
            if line.starts_with("#[") {
                continue;
            }
            let decl = (line.strip_prefix("pub(crate) "))
                .or_else(|| line.strip_prefix("pub(super) "))
                .unwrap_or(line);
            let name = decl.strip_prefix("mod ").and_then(|l| l.strip_suffix(';'));
            let target = match (name, path.take()) {
                (Some(_), Some(p)) => file.parent().unwrap().join(p),
                (Some(n), None) if found.contains_key(&file) && file.ends_with("mod.rs") => {
                    file.with_file_name(format!("{n}.rs"))
                }
                _ => continue,
            };
            let target = (target.canonicalize())
                .unwrap_or_else(|e| panic!("{}: {}: {e}", file.display(), target.display()));
            let mut m = module.clone();
            m.push(name.unwrap().to_string());
            found.insert(target.clone(), m.clone());
            todo.push((target, m));
        }
    }
    found
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

/// Whether code of top-level module `from` may refer to top-level module `to`.
fn allowed(from: &str, to: &str) -> Result<(), String> {
    let floor = |m: &str| FLOORS.iter().position(|f| *f == m);
    if from == to || LEAVES.contains(&to) && from != "core" {
        return Ok(());
    }
    match (floor(from), floor(to)) {
        (Some(f), Some(t)) if t < f => Ok(()),
        (Some(_), Some(_)) => Err(format!("`{from}` is below `{to}`")),
        (Some(_), None) => Err(format!("`core` imports no other module (`{to}`)")),
        (None, Some(_)) if LEAVES.contains(&from) => {
            if LEAF_MAY_IMPORT.contains(&to) {
                Ok(())
            } else {
                Err(format!(
                    "the shared leaf `{from}` imports no folder but `core`"
                ))
            }
        }
        _ => Err(format!(
            "`{from}` is neither a floor nor a shared leaf: add it to FLOORS or LEAVES here and to docs/ARCHITECTURE.md"
        )),
    }
}

#[test]
fn folders_import_only_the_floors_below_them() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let root = root_names(&fs::read_to_string(src.join("lib.rs")).unwrap());
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    // Every folder and top-level file of `src/` has a place.
    for f in &files {
        let m = module_path(&src, f);
        if let Some(top) = m.first() {
            assert!(
                FLOORS.contains(&top.as_str()) || LEAVES.contains(&top.as_str()),
                "{}: `{top}` is neither a floor nor a shared leaf: add it to FLOORS or LEAVES in tests/architecture.rs and to docs/ARCHITECTURE.md",
                f.display()
            );
        }
    }
    // The unit tests (`tests/unit/`, compiled into the library under `cfg(test)`) are
    // read as the modules they are; every file there is one of them.
    let unit = included_from_outside(&src, &files);
    let mut unit_files = Vec::new();
    rust_files(&src.with_file_name("tests").join("unit"), &mut unit_files);
    for f in &unit_files {
        assert!(
            unit.contains_key(&f.canonicalize().unwrap()),
            "{}: no `#[path]` in src/ includes it",
            f.display()
        );
    }
    let modules = (files.iter().map(|f| (f.clone(), module_path(&src, f)))).chain(unit);
    let mut edges: BTreeMap<(String, String), (PathBuf, usize)> = BTreeMap::new();
    let mut bad = Vec::new();
    for (f, m) in modules {
        let Some(from) = m.first().cloned() else {
            continue; // lib.rs
        };
        let f = &f;
        for r in references(&m, f, &root) {
            edges
                .entry((from.clone(), r.target.clone()))
                .or_insert((f.clone(), r.line));
            if let Err(why) = allowed(&from, &r.target) {
                bad.push((f.clone(), r.line, from.clone(), r.target.clone(), why));
            }
        }
    }
    let rel = |p: &Path| {
        p.strip_prefix(env!("CARGO_MANIFEST_DIR"))
            .unwrap_or(p)
            .display()
            .to_string()
    };
    let report: Vec<String> = bad
        .iter()
        .map(|(f, line, from, to, why)| {
            let cycle = match edges.get(&(to.clone(), from.clone())) {
                Some((g, l)) if from != to => {
                    format!("; a cycle: `{to}` imports `{from}` at {}:{l}", rel(g))
                }
                _ => String::new(),
            };
            format!("{}:{line}: `{from}` imports `{to}` ({why}){cycle}", rel(f))
        })
        .collect();
    assert!(
        report.is_empty(),
        "imports against the floors (core ← control ← backend ← group ← pool ← coll ← observe; docs/ARCHITECTURE.md):\n{}",
        report.join("\n")
    );
    // The test sees what it should: the pool does use the backend and the core.
    let seen: BTreeSet<_> = edges.keys().cloned().collect();
    for (a, b) in [
        ("pool", "backend"),
        ("pool", "core"),
        ("coll", "pool"),
        ("observe", "pool"),
    ] {
        assert!(
            seen.contains(&(a.to_string(), b.to_string())),
            "{a} → {b} not found: the reader is broken"
        );
    }
}

#[test]
fn the_reader_finds_paths_in_code_only() {
    let src = r#"
        use crate::pool::SymmPool; // crate::coll in a comment
        /* crate::observe */ let s = "crate::observe";
        use crate::{
            backend::X,
            group::{Y, Z},
        };
        mod tests {
            use super::super::coll::Q;
        }
        fn f<'a>(c: char) -> bool { c == '{' && crate::Error::x() }
    "#;
    let mut root = BTreeMap::new();
    root.insert("Error".to_string(), "error".to_string());
    let dir = std::env::temp_dir().join(format!("symmpool-arch-{}", std::process::id()));
    fs::create_dir_all(dir.join("pool")).unwrap();
    let path = dir.join("pool").join("x.rs");
    fs::write(&path, src).unwrap();
    let found: Vec<(usize, String)> = references(&module_path(&dir, &path), &path, &root)
        .into_iter()
        .map(|r| (r.line, r.target))
        .collect();
    fs::remove_dir_all(&dir).unwrap();
    assert_eq!(
        found,
        [
            (2, "pool".to_string()),
            (5, "backend".to_string()),
            (6, "group".to_string()),
            // `super::super` from `pool::x::tests` is `pool`: not a top-level path.
            (11, "error".to_string()),
        ]
    );
    assert!(allowed("pool", "coll").is_err());
    assert!(allowed("coll", "pool").is_ok());
    assert!(allowed("error", "core").is_ok());
    assert!(allowed("error", "pool").is_err());
    assert!(allowed("core", "error").is_err());
}

/// The folders whose crate-internal functions are the seams between floors: a deadline
/// crosses them as a `Deadline`, never as a `Duration` (the budget is fixed once, where
/// a public call starts, and every floor below spends what is left of it).
const DEADLINE_SEAMS: &[&str] = &["pool", "group", "coll", "backend"];

/// The `fn` signatures of `src` (tokens up to the body or `;`) that are seams: declared
/// `pub(crate)`, or declared in a trait. Returns (line, name, signature tokens).
fn seam_signatures(src: &str) -> Vec<(usize, String, Vec<Tok>)> {
    let toks = tokens(src);
    let (mut out, mut blocks, mut header_is_trait) = (Vec::new(), Vec::new(), false);
    let ident = |i: usize, s: &str| matches!(toks.get(i), Some((_, Tok::Ident(x))) if x == s);
    for i in 0..toks.len() {
        match &toks[i].1 {
            Tok::Ident(x) if x == "trait" => header_is_trait = true,
            Tok::Punct('{') => blocks.push(std::mem::take(&mut header_is_trait)),
            Tok::Punct('}') => {
                blocks.pop();
            }
            Tok::Punct(';') => header_is_trait = false,
            Tok::Ident(x) if x == "fn" => {
                // `pub(crate) [const|async|unsafe|extern]* fn`
                let mut v = i;
                while v > 0
                    && ["const", "async", "unsafe", "extern"]
                        .iter()
                        .any(|q| ident(v - 1, q))
                {
                    v -= 1;
                }
                let crate_visible = v >= 4
                    && ident(v - 4, "pub")
                    && toks[v - 3].1 == Tok::Punct('(')
                    && ident(v - 2, "crate")
                    && toks[v - 1].1 == Tok::Punct(')');
                let in_trait = blocks.last() == Some(&true);
                if !(crate_visible || in_trait) {
                    continue;
                }
                let Some((line, Tok::Ident(name))) = toks.get(i + 1).cloned() else {
                    continue;
                };
                let sig = toks[i..]
                    .iter()
                    .map(|(_, t)| t.clone())
                    .take_while(|t| *t != Tok::Punct('{') && *t != Tok::Punct(';'))
                    .collect();
                out.push((line, name, sig));
            }
            _ => {}
        }
    }
    out
}

#[test]
fn no_seam_between_the_floors_takes_a_duration() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let (mut seams, mut bad) = (0, Vec::new());
    for folder in DEADLINE_SEAMS {
        let mut files = Vec::new();
        rust_files(&src.join(folder), &mut files);
        for f in files {
            for (line, name, sig) in seam_signatures(&fs::read_to_string(&f).unwrap()) {
                seams += 1;
                if sig.contains(&Tok::Ident("Duration".into())) {
                    bad.push(format!("{}:{line}: fn {name}", f.display()));
                }
            }
        }
    }
    // The reader found the seams it is meant to judge (a broken reader finds none).
    assert!(seams > 100, "only {seams} seam functions found");
    assert!(
        bad.is_empty(),
        "these seams take a Duration; pass a Deadline (src/deadline.rs) instead:\n{}",
        bad.join("\n")
    );
}

#[test]
fn the_seam_reader_sees_crate_functions_and_trait_methods_only() {
    let src = "pub(crate) fn a(t: Duration) {}\n\
               pub(crate) const unsafe fn b() -> Duration { x }\n\
               pub fn public(t: Duration) {}\n\
               fn private(t: Duration) {}\n\
               pub trait Seam { fn c(&self, d: Deadline); fn e(&self) {} }\n\
               impl Seam for X { fn c(&self, d: Deadline) {} }\n\
               // pub(crate) fn commented(t: Duration) {}\n";
    let found: Vec<(String, bool)> = seam_signatures(src)
        .into_iter()
        .map(|(_, n, s)| (n, s.contains(&Tok::Ident("Duration".into()))))
        .collect();
    assert_eq!(
        found,
        [
            ("a".to_string(), true),
            ("b".to_string(), true),
            ("c".to_string(), false),
            ("e".to_string(), false),
        ]
    );
}

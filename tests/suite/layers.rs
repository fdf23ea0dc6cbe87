//! The layer order of /work/shared/DESIGN.md ("Layers", each depending only
//! on the ones above it), checked over the code of `src/`: every `crate::`
//! path outside comments and string literals names a top-level module, and a
//! module may name only modules of a lower layer (and itself). A new file or
//! module must get a place in [`LAYERS`] first.

use std::path::{Path, PathBuf};

/// Top-level modules of `src/` from the bottom up (DESIGN.md's order read
/// from the far end: a module may import the modules of earlier rows only).
/// Modules sharing a row are peers that must not import each other.
///
/// DESIGN places the crate-root files as follows: `error` (the one error
/// type every layer returns), `atomic_write` and `user_cache` (host file
/// helpers with no GPU or model knowledge, which the kernels' tuning cache
/// already needs) sit below everything; `pipeline_cache` is the device
/// layer's pipeline cache, below `device` which uses it; `ops` is the op
/// vocabulary "below both the kernels and the CPU twins" (`cpu`), which are
/// peers: neither imports the other.
const LAYERS: &[&[&str]] = &[
    &["error"],
    &["atomic_write"],
    &["user_cache"],
    &["pipeline_cache"],
    &["device"],
    &["ops"],
    &["kernels", "cpu"],
    &["graph"],
    &["optim"],
    &["nn"],
    &["models"],
    &["io"],
    &["parallel"],
    &["train", "infer"],
];

/// Imports that break the order and stay for now, as (file, imported
/// module, why). Keep it empty: an entry is a debt with its reason.
const ALLOWED: &[(&str, &str, &str)] = &[];

fn rank(module: &str) -> Option<usize> {
    LAYERS.iter().position(|row| row.contains(&module))
}

/// `text` with comments, string and char literals blanked to spaces (line
/// breaks kept, so line numbers hold): doc links and messages that name a
/// module are not imports.
fn code_only(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let blank = |c: char| if c == '\n' { '\n' } else { ' ' };
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                out.push(' ');
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            // Block comments nest in Rust.
            let mut depth = 0;
            loop {
                match (chars.get(i).copied(), chars.get(i + 1).copied()) {
                    (Some('/'), Some('*')) => {
                        depth += 1;
                        out.push_str("  ");
                        i += 2;
                    }
                    (Some('*'), Some('/')) => {
                        depth -= 1;
                        out.push_str("  ");
                        i += 2;
                        if depth == 0 {
                            break;
                        }
                    }
                    (Some(c), _) => {
                        out.push(blank(c));
                        i += 1;
                    }
                    (None, _) => break,
                }
            }
        } else if c == 'r' && (next == Some('"') || next == Some('#')) && raw_string_start(&chars, i) {
            // A raw string r"…" or r#"…"#: it ends at a quote and as many #.
            let hashes = chars[i + 1..].iter().take_while(|&&h| h == '#').count();
            if chars.get(i + 1 + hashes) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            let end: String = std::iter::once('"').chain(std::iter::repeat_n('#', hashes)).collect();
            let body_start = i + 2 + hashes;
            let rest: String = chars[body_start..].iter().collect();
            let body_len = rest
                .find(&end)
                .map_or(rest.chars().count(), |b| rest[..b].chars().count());
            let stop = (body_start + body_len + end.len()).min(chars.len());
            out.extend(chars[i..stop].iter().map(|&c| blank(c)));
            i = stop;
        } else if c == '"' {
            out.push(' ');
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                let skip = if chars[i] == '\\' { 2 } else { 1 };
                for &c in &chars[i..(i + skip).min(chars.len())] {
                    out.push(blank(c));
                }
                i += skip;
            }
            out.push(' ');
            i += 1;
        } else if c == '\'' && (next == Some('\\') || chars.get(i + 2) == Some(&'\'')) {
            // A char literal ('x', '\n', '\'', '\u{..}'); a lifetime has no
            // closing quote. An escape's closing quote comes after its second
            // character (which may itself be a quote).
            let close = match next {
                Some('\\') => chars
                    .iter()
                    .skip(i + 3)
                    .position(|&q| q == '\'')
                    .map_or(chars.len() - 1, |p| i + 3 + p),
                _ => i + 2,
            };
            out.extend(chars[i..=close].iter().map(|&c| blank(c)));
            i = close + 1;
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// Whether the `r` at `i` starts a raw string (`r"`, `r#"`, `br"`), not
/// an identifier ending in r.
fn raw_string_start(chars: &[char], i: usize) -> bool {
    let before = |k: usize| i.checked_sub(k).map(|j| chars[j]);
    !ident_char(before(1)) || (before(1) == Some('b') && !ident_char(before(2)))
}

fn ident_char(c: Option<char>) -> bool {
    c.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$')
}

/// Every top-level module a `crate::` path in `code` names, with its byte
/// offset: `crate::graph::X` gives `graph`; `crate::{graph::X, kernels}`
/// gives both.
fn crate_paths(code: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    let mut from = 0;
    while let Some(at) = code[from..].find("crate::").map(|p| p + from) {
        from = at + "crate::".len();
        // `$crate::` (macros) and `foo_crate::` are not this crate's paths.
        if ident_char(code[..at].chars().last()) {
            continue;
        }
        let rest = &code[from..];
        if rest.starts_with('{') {
            // A group: the first name of each item at the group's top level.
            let mut depth = 0;
            let mut item_start = true;
            for (k, ch) in rest.char_indices() {
                match ch {
                    '{' => {
                        depth += 1;
                        item_start = depth == 1;
                    }
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    ',' if depth == 1 => item_start = true,
                    c if item_start && depth == 1 && (c.is_alphabetic() || c == '_') => {
                        let name: String = rest[k..]
                            .chars()
                            .take_while(|&c| c.is_alphanumeric() || c == '_')
                            .collect();
                        found.push((from + k, name));
                        item_start = false;
                    }
                    _ => {}
                }
            }
        } else {
            let name: String = rest.chars().take_while(|&c| c.is_alphanumeric() || c == '_').collect();
            if !name.is_empty() {
                found.push((at, name));
            }
        }
    }
    found
}

/// The top-level module a file of `src/` belongs to (`src/graph/plan.rs`
/// and `src/graph.rs` give `graph`); `None` for the crate root.
fn top_module(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).ok()?;
    let first = rel.components().next()?.as_os_str().to_str()?;
    let name = first.strip_suffix(".rs").unwrap_or(first);
    (name != "lib").then(|| name.to_string())
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("src/ is readable")
        .map(|e| e.expect("a directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Every import in `src/` that points at its own layer or one above it, as
/// `file:line: module imports target`, the allow-list left out.
fn violations(src: &Path) -> Vec<String> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut found = Vec::new();
    for file in files {
        let Some(module) = top_module(src, &file) else { continue };
        let rel = file
            .strip_prefix(src.parent().unwrap_or(src))
            .unwrap_or(&file)
            .display()
            .to_string();
        let Some(own) = rank(&module) else {
            found.push(format!(
                "{rel}: module `{module}` has no place in LAYERS (tests/suite/layers.rs)"
            ));
            continue;
        };
        let code = code_only(&std::fs::read_to_string(&file).expect("a source file is readable"));
        for (offset, target) in crate_paths(&code) {
            if target == module || target == "self" || ALLOWED.iter().any(|&(f, t, _)| f == rel && t == target) {
                continue;
            }
            let line = code[..offset].matches('\n').count() + 1;
            match rank(&target) {
                Some(r) if r < own => {}
                Some(_) => found.push(format!(
                    "{rel}:{line}: `{module}` imports `{target}`, which is not below it"
                )),
                // Root items (`crate::Result`, re-exported in lib.rs) belong to no layer.
                None if !src.join(format!("{target}.rs")).exists() && !src.join(&target).is_dir() => {}
                None => found.push(format!(
                    "{rel}:{line}: `{target}` has no place in LAYERS (tests/suite/layers.rs)"
                )),
            }
        }
    }
    found
}

/// The library's `src/` (this suite is its own package under `tests/`).
fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../src")
}

#[test]
fn every_import_points_down_the_layers() {
    let src = src_dir();
    let found = violations(&src);
    assert!(
        found.is_empty(),
        "imports against DESIGN.md's layer order:\n{}",
        found.join("\n")
    );
}

#[test]
fn every_allowed_import_still_exists() {
    // A stale entry would hide the next real violation of that pair.
    let src = src_dir();
    for &(file, target, why) in ALLOWED {
        let text = std::fs::read_to_string(src.parent().unwrap_or(&src).join(file)).unwrap_or_default();
        let names: Vec<String> = crate_paths(&code_only(&text)).into_iter().map(|(_, t)| t).collect();
        assert!(
            names.iter().any(|t| t == target),
            "ALLOWED lists {file} → {target} ({why}), which it no longer imports"
        );
    }
}

#[test]
fn paths_in_comments_and_strings_are_not_imports() {
    let code = code_only(
        "/// [`crate::train`]\n// crate::infer\n/* crate::io /* nested */ crate::nn */\nlet s = \"crate::models\";\n\
         let r = r#\"crate::parallel\"#; let c = '\"'; let q = 'x';\nuse crate::graph::Graph;\n\
         use crate::{kernels::Kernels, ops::{A, B}};\n\
         fn f<'a>(x: &'a str) -> crate::error::Result<()> { $crate::nn::X }\n",
    );
    let names: Vec<(usize, String)> = crate_paths(&code);
    let lines: Vec<(usize, &str)> = names
        .iter()
        .map(|(o, n)| (code[..*o].matches('\n').count() + 1, n.as_str()))
        .collect();
    assert_eq!(lines, vec![(6, "graph"), (7, "kernels"), (7, "ops"), (8, "error")]);
}

#[test]
fn an_import_from_above_is_found() {
    // A throwaway tree: the graph naming the optimizer above it.
    let dir = std::env::temp_dir().join(format!("wgrad-layers-{}", std::process::id()));
    let src = dir.join("src");
    std::fs::create_dir_all(src.join("graph")).expect("a temporary directory");
    std::fs::write(
        src.join("graph").join("executor.rs"),
        "use crate::kernels::Kernels;\n/// [`crate::optim`]\nuse crate::optim::Optimizer;\n",
    )
    .expect("a temporary file");
    std::fs::write(src.join("optim.rs"), "use crate::graph::Graph;\n").expect("a temporary file");
    let found = violations(&src);
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(
        found,
        vec!["src/graph/executor.rs:3: `graph` imports `optim`, which is not below it".to_string()]
    );
}

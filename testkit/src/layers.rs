//! A crate's modules as floors. [`ModuleGraph::read`] reads every source file under a
//! crate's `src/` and records which modules each one names through `crate::` or `super::`
//! paths (`use` items and paths written inline alike; comments and `#[cfg(test)] mod`
//! blocks left out). [`ModuleGraph::upward_imports`] then lists every import from a module
//! to one on a higher floor, and [`ModuleGraph::largest_circle`] the largest set of modules
//! that import each other, directly or not.
//!
//! A crate's own test states its floors, from the bottom, as module path prefixes:
//!
//! ```
//! let floors: &[&[&str]] = &[&["error"], &["store", "limits"], &["api"]];
//! # let _ = floors;
//! ```
//!
//! A module's floor is the floor of the longest prefix that names it (`api::chat` is on the
//! floor of `api`); a module on no floor is reported, so a new module must be placed.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Which modules of one crate name which others.
#[derive(Debug, Default)]
pub struct ModuleGraph {
    /// Every module, by path from the crate root (`""` is the root, `a::b` a nested one).
    pub modules: BTreeSet<String>,
    /// Module → the modules it names (never itself).
    pub edges: BTreeMap<String, BTreeSet<String>>,
}

/// An import from a module to one on a higher floor.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Upward {
    pub from: String,
    pub to: String,
}

impl std::fmt::Display for Upward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} imports {}", self.from, self.to)
    }
}

impl ModuleGraph {
    /// Reads the crate whose sources are under `src` (its `lib.rs` or `main.rs` the root).
    pub fn read(src: &Path) -> std::io::Result<Self> {
        let mut files = Vec::new();
        collect(src, src, &mut files)?;
        let mut graph = ModuleGraph::default();
        let mut sources = Vec::new();
        for (module, path) in files {
            let text = std::fs::read_to_string(&path)?;
            graph.modules.insert(module.clone());
            sources.push((module, code_only(&text)));
        }
        // Names the root re-exports (`pub use engine::EngineHandle;`) resolve to their module.
        let root_reexports = sources
            .iter()
            .find(|(m, _)| m.is_empty())
            .map(|(_, code)| reexports(code, &graph.modules))
            .unwrap_or_default();
        for (module, code) in &sources {
            let mut named = BTreeSet::new();
            for path in paths_after(code, "crate::") {
                let segs: Vec<&str> = path.split("::").filter(|s| !s.is_empty()).collect();
                named.extend(graph.resolve(&segs, &root_reexports));
            }
            for path in paths_after(code, "super::") {
                let mut base: Vec<&str> = module.split("::").filter(|s| !s.is_empty()).collect();
                base.pop();
                let mut segs: Vec<&str> = path.split("::").filter(|s| !s.is_empty()).collect();
                while segs.first() == Some(&"super") {
                    segs.remove(0);
                    base.pop();
                }
                let full: Vec<&str> = base.iter().copied().chain(segs).collect();
                named.extend(graph.resolve(&full, &root_reexports));
            }
            named.remove(module);
            if !named.is_empty() {
                graph.edges.insert(module.clone(), named);
            }
        }
        Ok(graph)
    }

    /// The module a path from the crate root names: the longest module it starts with, or,
    /// for a name the root re-exports (`crate::EngineHandle`), that name's module.
    fn resolve(&self, segs: &[&str], root_reexports: &BTreeMap<String, String>) -> Option<String> {
        self.longest_module(segs)
            .filter(|m| !m.is_empty())
            .or_else(|| segs.first().and_then(|s| root_reexports.get(*s).cloned()))
    }

    /// The longest module path that `segs` starts with (`""`, the root, if none).
    fn longest_module(&self, segs: &[&str]) -> Option<String> {
        (0..=segs.len())
            .rev()
            .map(|n| segs[..n].join("::"))
            .find(|m| self.modules.contains(m))
    }

    /// The floor of `module` among `floors` (from the bottom), if any names it.
    pub fn floor_of(module: &str, floors: &[&[&str]]) -> Option<usize> {
        let mut best: Option<(usize, usize)> = None; // (prefix length, floor)
        for (floor, prefixes) in floors.iter().enumerate() {
            for p in prefixes.iter() {
                let hit = module == *p || module.starts_with(&format!("{p}::"));
                if hit && best.is_none_or(|(len, _)| p.len() > len) {
                    best = Some((p.len(), floor));
                }
            }
        }
        best.map(|(_, floor)| floor)
    }

    /// Modules (other than the root) on no floor.
    pub fn unplaced(&self, floors: &[&[&str]]) -> Vec<String> {
        self.modules
            .iter()
            .filter(|m| !m.is_empty() && Self::floor_of(m, floors).is_none())
            .cloned()
            .collect()
    }

    /// Every import from a module to one on a higher floor. The root only declares modules
    /// and re-exports: it is on no floor and imports nothing that counts.
    pub fn upward_imports(&self, floors: &[&[&str]]) -> Vec<Upward> {
        let mut out = Vec::new();
        for (from, tos) in &self.edges {
            let Some(f) = Self::floor_of(from, floors) else {
                continue;
            };
            for to in tos {
                if Self::floor_of(to, floors).is_some_and(|t| t > f) {
                    out.push(Upward {
                        from: from.clone(),
                        to: to.clone(),
                    });
                }
            }
        }
        out
    }

    /// The largest set of modules that import each other (a strongly connected component),
    /// sorted; the root is left out.
    pub fn largest_circle(&self) -> Vec<String> {
        let nodes: Vec<&String> = self.modules.iter().filter(|m| !m.is_empty()).collect();
        let index_of: BTreeMap<&str, usize> = nodes.iter().enumerate().map(|(i, m)| (m.as_str(), i)).collect();
        let succ: Vec<Vec<usize>> = nodes
            .iter()
            .map(|m| {
                self.edges
                    .get(*m)
                    .map(|tos| tos.iter().filter_map(|t| index_of.get(t.as_str()).copied()).collect())
                    .unwrap_or_default()
            })
            .collect();
        let mut best: Vec<String> = strongly_connected(&succ)
            .into_iter()
            .max_by_key(|c| c.len())
            .unwrap_or_default()
            .into_iter()
            .map(|i| nodes[i].clone())
            .collect();
        best.sort();
        best
    }
}

/// [`assert_floors`] on the crate whose manifest is in `manifest_dir` (its sources under
/// `src/`): what a crate's layering test calls with `env!("CARGO_MANIFEST_DIR")`.
pub fn assert_crate_floors(manifest_dir: &str, floors: &[&[&str]], debt: &[(&str, &str)], max_circle: usize) {
    let graph = ModuleGraph::read(&Path::new(manifest_dir).join("src"))
        .unwrap_or_else(|e| panic!("reading {manifest_dir}/src: {e}"));
    assert_floors(&graph, floors, &debt.iter().copied().collect(), max_circle);
}

/// The check a crate's layering test makes: no module on no floor, no upward import but
/// those in `debt` (and every one of those still there, so the list only shrinks), and no
/// circle larger than `max_circle`. Panics with every finding.
pub fn assert_floors(graph: &ModuleGraph, floors: &[&[&str]], debt: &BTreeSet<(&str, &str)>, max_circle: usize) {
    let mut problems = Vec::new();
    for m in graph.unplaced(floors) {
        problems.push(format!("module {m} is on no floor: add it to FLOORS"));
    }
    let upward = graph.upward_imports(floors);
    for u in &upward {
        if !debt.contains(&(u.from.as_str(), u.to.as_str())) {
            problems.push(format!(
                "upward import: {u} (a floor above its own); move the shared part down"
            ));
        }
    }
    for (from, to) in debt {
        if !upward.iter().any(|u| u.from == *from && u.to == *to) {
            problems.push(format!("{from} no longer imports {to} upward: remove it from DEBT"));
        }
    }
    let circle = graph.largest_circle();
    if circle.len() > max_circle {
        problems.push(format!(
            "{} modules import each other (at most {max_circle}): {}",
            circle.len(),
            circle.join(", ")
        ));
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// `(module path, file)` for every `.rs` file under `dir`.
fn collect(root: &Path, dir: &Path, out: &mut Vec<(String, std::path::PathBuf)>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            collect(root, &path, out)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            let rel = path.strip_prefix(root).unwrap_or(&path).with_extension("");
            let mut segs: Vec<String> = rel.iter().map(|s| s.to_string_lossy().into_owned()).collect();
            if matches!(segs.last().map(String::as_str), Some("mod" | "lib" | "main")) {
                segs.pop();
            }
            let module = segs.join("::");
            if module.is_empty() && out.iter().any(|(m, _): &(String, _)| m.is_empty()) {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!(
                        "{}: both lib.rs and main.rs; read one crate root at a time",
                        dir.display()
                    ),
                ));
            }
            out.push((module, path));
        }
    }
    Ok(())
}

/// The source with comments, string literals and character literals blanked (each of their
/// characters a space, newlines kept), and without `#[cfg(test)] mod … { … }` blocks: what is
/// left is code, so braces and paths can be read off it.
fn code_only(text: &str) -> String {
    let code = blank_literals_and_comments(text);
    let mut out = String::with_capacity(code.len());
    let mut rest = code.as_str();
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let after = &rest[at + "#[cfg(test)]".len()..];
        let Some(open) = inline_mod_body(after) else {
            rest = after;
            continue;
        };
        let mut depth = 0usize;
        let mut end = after.len();
        for (i, c) in after[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + i + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

/// Where the body of the inline module `text` starts with (`mod x {`, `pub(crate) mod x {`),
/// if it starts with one (not `mod x;`, not any other item).
fn inline_mod_body(text: &str) -> Option<usize> {
    let t = text.trim_start();
    let skipped = text.len() - t.len();
    let mut rest = t.strip_prefix("pub").unwrap_or(t);
    if rest.len() < t.len() {
        rest = rest.trim_start();
        if rest.starts_with('(') {
            rest = &rest[rest.find(')')? + 1..];
        }
        rest = rest.trim_start();
    }
    let rest = rest.strip_prefix("mod ")?;
    let brace = rest.find('{')?;
    if rest.find(';').is_some_and(|semi| semi < brace) {
        return None;
    }
    Some(skipped + (t.len() - rest.len()) + brace)
}

/// `text` with every comment (line, block, nested block) and every string, byte string, raw
/// string and character literal replaced by spaces (newlines kept). Lifetimes stay.
fn blank_literals_and_comments(text: &str) -> String {
    let c: Vec<char> = text.chars().collect();
    let mut out: Vec<char> = c.clone();
    let blank = |out: &mut Vec<char>, from: usize, to: usize| {
        for ch in &mut out[from..to.min(c.len())] {
            if *ch != '\n' {
                *ch = ' ';
            }
        }
    };
    let ident = |i: usize| i > 0 && (c[i - 1].is_alphanumeric() || c[i - 1] == '_');
    let mut i = 0;
    while i < c.len() {
        match c[i] {
            '/' if c.get(i + 1) == Some(&'/') => {
                let end = c[i..].iter().position(|&x| x == '\n').map_or(c.len(), |p| i + p);
                blank(&mut out, i, end);
                i = end;
            }
            '/' if c.get(i + 1) == Some(&'*') => {
                let (mut depth, mut j) = (0usize, i);
                while j < c.len() {
                    if c[j] == '/' && c.get(j + 1) == Some(&'*') {
                        depth += 1;
                        j += 2;
                    } else if c[j] == '*' && c.get(j + 1) == Some(&'/') {
                        depth -= 1;
                        j += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        j += 1;
                    }
                }
                blank(&mut out, i, j);
                i = j;
            }
            'r' | 'b' if !ident(i) && raw_string_start(&c, i).is_some() => {
                let (hashes, quote) = raw_string_start(&c, i).unwrap_or((0, i));
                let mut j = quote + 1;
                while j < c.len()
                    && !(c[j] == '"' && c[j + 1..].iter().take(hashes).filter(|&&x| x == '#').count() == hashes)
                {
                    j += 1;
                }
                let end = (j + 1 + hashes).min(c.len());
                blank(&mut out, i, end);
                i = end;
            }
            '"' => {
                let mut j = i + 1;
                while j < c.len() && c[j] != '"' {
                    j += if c[j] == '\\' { 2 } else { 1 };
                }
                let end = (j + 1).min(c.len());
                blank(&mut out, i, end);
                i = end;
            }
            '\'' => {
                // A character literal ('x', '\n', '\u{1F600}'), or a lifetime ('a), left alone.
                let end = if c.get(i + 1) == Some(&'\\') {
                    // The escaped character, then the closing quote ('\'' included).
                    let from = (i + 3).min(c.len());
                    c[from..].iter().position(|&x| x == '\'').map(|p| from + p + 1)
                } else if c.get(i + 2) == Some(&'\'') {
                    Some(i + 3)
                } else {
                    None
                };
                match end {
                    Some(end) => {
                        blank(&mut out, i, end);
                        i = end;
                    }
                    None => i += 1,
                }
            }
            _ => i += 1,
        }
    }
    out.into_iter().collect()
}

/// At `i`, a raw string's start (`r"`, `r#"`, `br##"`): its number of `#`s and where its
/// opening quote is.
fn raw_string_start(c: &[char], i: usize) -> Option<(usize, usize)> {
    let mut j = i;
    if c.get(j) == Some(&'b') {
        j += 1;
    }
    if c.get(j) != Some(&'r') {
        return None;
    }
    j += 1;
    let hashes = c[j..].iter().take_while(|&&x| x == '#').count();
    (c.get(j + hashes) == Some(&'"')).then_some((hashes, j + hashes))
}

/// Every path written after `prefix` (`crate::a::{b, c::d}` gives `a::b` and `a::c::d`).
fn paths_after(code: &str, prefix: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(i) = code[from..].find(prefix) {
        let start = from + i;
        from = start + prefix.len();
        let before = code[..start].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
            continue; // `xcrate::` or `a::super::`, not a path from here
        }
        let mut pos = from;
        let mut paths = Vec::new();
        tree(code.as_bytes(), &mut pos, String::new(), &mut paths);
        out.extend(paths.into_iter().map(|(path, _alias)| path));
    }
    out
}

/// Reads one use tree at `pos`: a path, then possibly `{ tree, tree, … }`; each leaf's path
/// with the name it is imported as when renamed (`a::B as C`).
fn tree(b: &[u8], pos: &mut usize, prefix: String, out: &mut Vec<(String, Option<String>)>) {
    let word = |pos: &mut usize| {
        let start = *pos;
        while *pos < b.len() && (b[*pos].is_ascii_alphanumeric() || b[*pos] == b'_' || b[*pos] == b':') {
            *pos += 1;
        }
        String::from_utf8_lossy(&b[start..*pos]).into_owned()
    };
    let path = format!("{prefix}{}", word(pos));
    if *pos < b.len() && b[*pos] == b'{' {
        *pos += 1;
        loop {
            while *pos < b.len() && matches!(b[*pos], b' ' | b'\n' | b'\t' | b'\r' | b',') {
                *pos += 1;
            }
            if *pos >= b.len() || b[*pos] == b'}' {
                *pos += 1;
                break;
            }
            let before = *pos;
            tree(b, pos, path.clone(), out);
            // Anything else up to the next item (a glob's `*`).
            while *pos < b.len() && !matches!(b[*pos], b',' | b'}') {
                *pos += 1;
            }
            if *pos == before {
                *pos += 1;
            }
        }
    } else {
        let mut alias = None;
        let rest = &b[*pos..];
        let trimmed = rest.iter().position(|c| !c.is_ascii_whitespace()).unwrap_or(rest.len());
        if rest[trimmed..].starts_with(b"as ") {
            let mut at = *pos + trimmed + 3;
            while at < b.len() && b[at].is_ascii_whitespace() {
                at += 1;
            }
            alias = Some(word(&mut at)).filter(|a| !a.is_empty());
            *pos = at;
        }
        out.push((path.trim_end_matches(':').to_string(), alias));
    }
}

/// Names the root makes available at `crate::Name` with `pub use` (or `pub(crate) use`),
/// under the name they are exported as, with their module. Globs name nothing here.
fn reexports(root: &str, modules: &BTreeSet<String>) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for item in root.split(';') {
        let item = item.trim();
        let Some(at) = item.find("use ") else { continue };
        let head = item[..at].trim();
        if !(head == "pub" || (head.starts_with("pub(") && head.ends_with(')'))) {
            continue;
        }
        let mut paths = Vec::new();
        let mut pos = 0;
        tree(
            item[at + 4..].trim_start().as_bytes(),
            &mut pos,
            String::new(),
            &mut paths,
        );
        for (path, alias) in paths {
            let segs: Vec<&str> = path.split("::").filter(|s| !s.is_empty()).collect();
            let Some((name, module)) = segs.split_last() else {
                continue;
            };
            let module = module.join("::");
            if !module.is_empty() && modules.contains(&module) {
                out.insert(alias.unwrap_or_else(|| name.to_string()), module);
            }
        }
    }
    out
}

/// Tarjan's strongly connected components of the graph `succ`.
fn strongly_connected(succ: &[Vec<usize>]) -> Vec<Vec<usize>> {
    struct State<'a> {
        succ: &'a [Vec<usize>],
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        stack: Vec<usize>,
        on_stack: Vec<bool>,
        next: usize,
        out: Vec<Vec<usize>>,
    }
    fn visit(s: &mut State, v: usize) {
        s.index[v] = Some(s.next);
        s.low[v] = s.next;
        s.next += 1;
        s.stack.push(v);
        s.on_stack[v] = true;
        for &w in &s.succ[v] {
            match s.index[w] {
                None => {
                    visit(s, w);
                    s.low[v] = s.low[v].min(s.low[w]);
                }
                Some(iw) if s.on_stack[w] => s.low[v] = s.low[v].min(iw),
                Some(_) => {}
            }
        }
        if Some(s.low[v]) == s.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack[w] = false;
                comp.push(w);
                if w == v {
                    break;
                }
            }
            s.out.push(comp);
        }
    }
    let n = succ.len();
    let mut s = State {
        succ,
        index: vec![None; n],
        low: vec![0; n],
        stack: Vec::new(),
        on_stack: vec![false; n],
        next: 0,
        out: Vec::new(),
    };
    for v in 0..n {
        if s.index[v].is_none() {
            visit(&mut s, v);
        }
    }
    s.out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn crate_of(files: &[(&str, &str)]) -> (ModuleGraph, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!("hearth-layers-{}-{}", std::process::id(), files.len()));
        let _ = std::fs::remove_dir_all(&dir);
        for (path, text) in files {
            let p = dir.join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        (ModuleGraph::read(&dir).unwrap(), dir)
    }

    /// The modules `m` names, in order.
    fn named(g: &ModuleGraph, m: &str) -> Vec<String> {
        g.edges.get(m).map(|n| n.iter().cloned().collect()).unwrap_or_default()
    }

    #[test]
    fn reads_use_trees_inline_paths_super_and_reexports() {
        let (g, dir) = crate_of(&[
            ("lib.rs", "pub mod a; pub mod b; pub mod c;\npub use c::Thing;\n"),
            (
                "a.rs",
                "use crate::{b::{X, Y as Z}, Thing};\n// use crate::nothing;\nfn f() { crate::c::g(); }\n",
            ),
            (
                "b/mod.rs",
                "pub mod inner;\n#[cfg(test)]\nmod tests { use crate::a; }\n",
            ),
            ("b/inner.rs", "use super::super::a::F;\nuse super::X;\n"),
            ("c.rs", "pub struct Thing; pub fn g() {}\n"),
        ]);
        let names = |m: &str| named(&g, m);
        assert_eq!(names("a"), ["b", "c"]);
        assert_eq!(names("b"), Vec::<String>::new(), "a test module's imports do not count");
        assert_eq!(names("b::inner"), ["a", "b"]);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn literals_comments_and_test_modules_are_not_code() {
        let (g, dir) = crate_of(&[
            ("lib.rs", "pub mod a; pub mod b; pub mod c; pub mod d;\npub use d::Thing as Renamed;\n"),
            (
                "a.rs",
                concat!(
                    "fn f() { let s = \"{ crate::b::X }\"; let r = r#\"crate::b \"{\"#; let c = '{'; let e = '\\''; }\n",
                    "/* crate::b /* nested */ crate::b */\n",
                    "fn g<'a>(x: &'a str) -> &'a str { x }\n",
                    "#[cfg(test)]\npub(crate) mod tests { use crate::b; const S: &str = \"}\"; }\n",
                    "fn h() { crate::c::go(); }\n",
                ),
            ),
            ("b.rs", "pub struct X;\n"),
            ("c/mod.rs", "pub fn go() {}\npub mod inner;\n"),
            ("c/inner.rs", "use super::super::Renamed;\n"),
            ("d.rs", "pub struct Thing;\n"),
        ]);
        let names = |m: &str| named(&g, m);
        assert_eq!(names("a"), ["c"], "only the path outside literals, comments and tests");
        assert_eq!(
            names("c::inner"),
            ["d"],
            "super:: up to the root, then a renamed re-export"
        );
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn an_upward_import_and_a_circle_are_found() {
        let (g, dir) = crate_of(&[
            ("lib.rs", "pub mod low; pub mod high; pub mod loose;\n"),
            ("low.rs", "use crate::high::H;\n"),
            ("high.rs", "use crate::low::L;\n"),
            ("loose.rs", "\n"),
        ]);
        let floors: &[&[&str]] = &[&["low"], &["high"]];
        let up = g.upward_imports(floors);
        assert_eq!(up.len(), 1);
        assert_eq!(up[0].to_string(), "low imports high");
        assert_eq!(g.largest_circle(), ["high", "low"]);
        assert_eq!(g.unplaced(floors), ["loose"]);
        let _ = std::fs::remove_dir_all(dir);
    }
}

#!/usr/bin/env python3
"""Fails on an import circle or an upward import between the modules of the workspace's crates.

ARCHITECTURE.md's rule ("Layers and imports"): the top-level modules of the pageserver library
are ranked in a table in ARCHITECTURE.md, and a module imports only modules of a lower layer;
in every crate of the workspace (each member's library and binaries), no two sibling modules
import each other, directly or through other siblings. An import from another crate is no
arrow: crates are ordered by Cargo, which refuses a circle between them.

What is read: each target's module tree, from its root file (`src/lib.rs`, `src/main.rs`,
`src/bin/*`, or the `path` of its `[lib]`/`[[bin]]` in Cargo.toml) through its `mod x;`
declarations (and their `#[path]`); an inline `mod x { }` is part of its file's module. Not
read, because tests may reach anywhere: items marked `#[cfg(test)]` and the modules they
declare, and test-only modules (`tests`, `*_tests`, or their files `tests.rs`, `*_tests.rs`);
integration tests and benchmarks are outside `src/`. A `.rs` file under a crate's `src/` that
no tree reaches fails the check (it would be a file the check claims to see and does not),
unless it is a test-only file or lies under a `tests/` folder.

An import is a path in a file, in a `use` item or inline, outside comments and literals, that
starts with `crate`, `super`, `self`, a child module, or a name one of the file's `use` items
binds. A path names the module that holds what it reaches, following re-exports: a `use` in
module `a` (any visibility, `as` aliases too) that binds `X` makes `a::X` a path to wherever
that `use` leads, through any number of hops, and a `use b::*` glob in `a` makes `a::X` a path
to `b::X` when `a` neither defines nor binds `X` itself. A path that leads out of the crate
makes no arrow. A file that imports its own ancestor or descendant makes no arrow (a parent and
its children are one unit). An arrow between two modules is counted between their ancestors
that are siblings: `crate::a::x` importing `crate::b::y` is an arrow a -> b, and
`crate::w::p` importing `crate::w::q::r` an arrow p -> q under `w`.

Usage: check_imports.py [--root DIR] [--graph]
`--root` is the workspace (its Cargo.toml, ARCHITECTURE.md and members); `--graph` prints
every arrow between siblings. Exit status: 0 when the workspace keeps the rule, 1 with one line
per violation otherwise.
"""

from __future__ import annotations

import argparse
import bisect
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The target whose top-level modules the layer table of ARCHITECTURE.md ranks.
LAYERED_CRATE = "pageserver"


# The characters a comment or a literal can begin with.
SPECIAL_CHARS = "/\"'br"
SPECIAL = re.compile(r"[/\"'br]")
RAW_STRING = re.compile(r'b?r(#*)"')
# A char literal ('a', '\n', '\u{1F}'), not a lifetime ('a).
CHAR_LITERAL = re.compile(r"'(\\u\{[0-9a-fA-F]+\}|\\.|[^\\'])'")


def strip_comments_and_strings(text: str) -> str:
    """Blanks out comments, string and char literals, keeping newlines (so lines stay put)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c not in SPECIAL_CHARS:
            # A run of characters that begin nothing below: kept as they are.
            m = SPECIAL.search(text, i)
            j = n if m is None else m.start()
            out.append(text[i:j])
            i = j
            continue
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            i = j
            continue
        if text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append("\n" * text.count("\n", i, j))
            i = j
            continue
        m = RAW_STRING.match(text, i)
        if m and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            end = '"' + m.group(1)
            j = text.find(end, m.end())
            j = n if j < 0 else j + len(end)
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j
            continue
        if c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j + 1
            continue
        if c == "'":
            # A char literal ('a', '\n', '\u{1F}'), not a lifetime ('a).
            m = CHAR_LITERAL.match(text, i)
            if m:
                out.append("' '")
                i = m.end()
                continue
        out.append(c)
        i += 1
    return "".join(out)


def drop_cfg_test_items(text: str) -> str:
    """Removes every item marked `#[cfg(test)]` (a `mod`, `use`, `fn` or `impl` with its body)."""
    while True:
        m = re.search(r"#\[cfg\(test\)\]", text)
        if not m:
            return text
        i = m.end()
        # The item ends at the first `;` before any `{`, or at the brace matching that `{`.
        j = i
        while j < len(text) and text[j] not in ";{":
            j += 1
        if j < len(text) and text[j] == "{":
            depth = 0
            while j < len(text):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        break
                j += 1
        text = text[: m.start()] + "\n" * text.count("\n", m.start(), j + 1) + text[j + 1 :]


def is_test_name(name: str) -> bool:
    """A test-only module (`tests`, `*_tests`) or its file (`tests.rs`, `*_tests.rs`)."""
    stem = name.removesuffix(".rs")
    return stem == "tests" or stem.endswith("_tests")


class Braces:
    """The brace depth at any offset of a text (comments and literals already blanked)."""

    def __init__(self, text: str):
        self.pos, self.depth = [], []
        d = 0
        for m in re.finditer(r"[{}]", text):
            d += 1 if m.group() == "{" else -1
            self.pos.append(m.start())
            self.depth.append(d)

    def at(self, offset: int) -> int:
        k = bisect.bisect_left(self.pos, offset)
        return self.depth[k - 1] if k else 0


def matching_brace(text: str, open_at: int) -> int:
    depth = 0
    for j in range(open_at, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return len(text)


@dataclass
class UseLeaf:
    """One leaf of a `use` tree: `segs` is the path, `name` what it binds (None: nothing, a
    glob or `as _`), `glob` whether it is `segs::*`."""

    segs: list[str]
    name: str | None
    glob: bool


def use_leaves(tree: str) -> list[UseLeaf]:
    """`a::{b as c, d::{self, *}}` -> a::b (binds c), a::d (binds d), a::d::* (a glob)."""
    tree = re.sub(r"\s+", " ", tree).strip()
    tree = re.sub(r"\s*::\s*", "::", tree).removeprefix("::")
    k = tree.find("{")
    if k < 0:
        alias = None
        m = re.fullmatch(r"(.*?) as (\w+)", tree)
        if m:
            tree, alias = m.group(1).strip(), m.group(2)
        segs = [s for s in tree.split("::") if s]
        if not segs:
            return []
        if segs[-1] == "*":
            return [UseLeaf(segs[:-1], None, True)]
        if segs[-1] == "self":
            segs = segs[:-1]
        if not segs:
            return []
        name = alias if alias is not None else segs[-1]
        return [UseLeaf(segs, None if name == "_" else name, False)]
    prefix, inner = tree[:k], tree[k + 1 : tree.rfind("}")]
    parts, level, start = [], 0, 0
    for q, ch in enumerate(inner):
        if ch == "{":
            level += 1
        elif ch == "}":
            level -= 1
        elif ch == "," and level == 0:
            parts.append(inner[start:q])
            start = q + 1
    parts.append(inner[start:])
    out = []
    for p in parts:
        p = p.strip()
        if p:
            out.extend(use_leaves(prefix + p))
    return out


USE = re.compile(r"\buse\s+([^;]+);")
MOD_DECL = re.compile(r"\bmod\s+(\w+)\s*;")
INLINE_MOD = re.compile(r"\bmod\s+\w+\s*\{")
PATH_ATTR = re.compile(r'#\[path\s*=\s*"([^"]+)"\]')
ITEM = re.compile(
    r"\b(?:fn|struct|enum|union|trait|type|mod)\s+(\w+)"
    r"|\bconst\s+(?!fn\b|unsafe\b|async\b|extern\b)(\w+)"
    r"|\bstatic\s+(?:mut\s+)?(\w+)"
    r"|\bmacro_rules!\s*(\w+)"
)
# A path of two or more segments, not preceded by `::` (then it is the tail of a longer one).
PATH = re.compile(r"(?<![\w:$])\$?(\w+(?:\s*::\s*\w+)+)")


@dataclass
class Module:
    path: tuple[str, ...]
    file: Path
    text: str  # comments, literals and test items blanked
    defines: set[str] = field(default_factory=set)
    binds: dict[str, list[str]] = field(default_factory=dict)
    globs: list[list[str]] = field(default_factory=list)


@dataclass
class Target:
    """One library or binary of a crate: its module tree."""

    label: str
    modules: dict[tuple[str, ...], Module] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def read_module_tree(target: Target, root_file: Path, workspace: Path, reached: set[Path]) -> None:
    """Reads the module tree from `root_file` into `target`; every file it declares (test
    modules too) goes into `reached`."""

    def visit(file: Path, path: tuple[str, ...], owns_dir: bool, test: bool) -> None:
        reached.add(file.resolve())
        raw = file.read_text()
        stripped = strip_comments_and_strings(raw)
        text = drop_cfg_test_items(stripped)
        if not test:
            target.modules[path] = Module(path, file, text)
        kept = Braces(text)
        kept_decls = {
            (text.count("\n", 0, m.start()), m.group(1)) for m in MOD_DECL.finditer(text) if kept.at(m.start()) == 0
        }
        raw_lines = raw.splitlines()
        braces = Braces(stripped)
        for m in MOD_DECL.finditer(stripped):
            if braces.at(m.start()) != 0:
                continue
            line, name = stripped.count("\n", 0, m.start()), m.group(1)
            # A `#[path = "..."]` among the attributes right above the declaration.
            explicit = None
            j = line - 1
            while j >= 0 and raw_lines[j].strip().startswith("#["):
                pm = PATH_ATTR.search(raw_lines[j])
                if pm:
                    explicit = pm.group(1)
                j -= 1
            m_attr = PATH_ATTR.search(raw_lines[line]) if line < len(raw_lines) else None
            if m_attr:
                explicit = m_attr.group(1)
            base = file.parent if owns_dir else file.parent / file.stem
            if explicit is not None:
                candidates = [file.parent / explicit]
            else:
                candidates = [base / f"{name}.rs", base / name / "mod.rs"]
            found = next((c for c in candidates if c.is_file()), None)
            if found is None:
                target.problems.append(
                    f"{file.relative_to(workspace)}: `mod {name};` names no file the check can find "
                    f"({', '.join(str(c.relative_to(workspace)) for c in candidates)})"
                )
                continue
            child_test = test or (line, name) not in kept_decls or is_test_name(name) or is_test_name(found.name)
            visit(found, path + (name,), found.name == "mod.rs", child_test)

    visit(root_file, (), True, False)
    for mod in target.modules.values():
        depth = Braces(mod.text)
        for m in ITEM.finditer(mod.text):
            if depth.at(m.start()) == 0:
                mod.defines.add(next(g for g in m.groups() if g))
        for m in USE.finditer(mod.text):
            if depth.at(m.start()) != 0:
                continue
            for leaf in use_leaves(m.group(1)):
                if leaf.glob:
                    mod.globs.append(leaf.segs)
                elif leaf.name is not None:
                    mod.binds[leaf.name] = leaf.segs


class Resolver:
    """Where a path leads within one target, following `use` bindings and globs."""

    LIMIT = 64  # hops, against a `use` that leads back to itself

    def __init__(self, target: Target):
        self.modules = target.modules

    def resolve(self, segs: list[str], here: tuple, local: dict | None = None, hops: int = 0, follow: bool = True):
        """The module holding what `segs` (a path written in module `here`, where `local` are
        the names the file's `use` items bind) reaches, and whether it reaches that module itself
        (every segment a module); None out of the crate. With `follow` false, the module the
        path names as written, without following other modules' re-exports."""
        if hops > self.LIMIT or not segs:
            return None
        first = segs[0]
        if first == "crate":
            return self.walk((), segs[1:], hops, follow)
        if first in ("self", "super"):
            base = here
            while segs and segs[0] in ("self", "super"):
                if segs[0] == "super":
                    if not base:
                        return None
                    base = base[:-1]
                segs = segs[1:]
            return self.walk(base, segs, hops, follow)
        if here + (first,) in self.modules:
            return self.walk(here + (first,), segs[1:], hops, follow)
        bound = (local or {}).get(first)
        if bound is None and here in self.modules:
            bound = self.modules[here].binds.get(first)
        if bound is not None and bound != [first]:
            return self.resolve(bound + segs[1:], here, None, hops + 1, follow)
        return None  # another crate, or a name this check does not know

    def walk(self, base: tuple, rest: list[str], hops: int, follow: bool = True):
        target = base
        for i, s in enumerate(rest):
            if target + (s,) in self.modules:
                target = target + (s,)
                continue
            mod = self.modules.get(target)
            if mod is None or not follow:
                return target, False
            if s in mod.binds:
                return self.resolve(mod.binds[s] + rest[i + 1 :], target, None, hops + 1)
            if s in mod.defines:
                return target, False
            for glob in mod.globs:
                source = self.resolve(glob, target, None, hops + 1)
                if source is None or not source[1]:
                    continue
                held = self.modules[source[0]]
                if s in held.binds or s in held.defines or source[0] + (s,) in self.modules:
                    return self.walk(source[0], rest[i:], hops + 1)
            return target, False
        return target, True


def inline_spans(text: str) -> list[tuple[int, int]]:
    return [(m.start(), matching_brace(text, m.end() - 1)) for m in INLINE_MOD.finditer(text)]


def arrows(target: Target, workspace: Path):
    """edges[parent][a][b] = [evidence]: module a imports module b, both children of parent."""
    resolver = Resolver(target)
    edges = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for here, mod in sorted(target.modules.items()):
        text = mod.text
        spans = inline_spans(text)
        local = dict(mod.binds)
        found = []  # (offset, written path as segments)
        for m in USE.finditer(text):
            for leaf in use_leaves(m.group(1)):
                found.append((m.start(), leaf.segs))
                if leaf.name is not None:
                    local.setdefault(leaf.name, leaf.segs)
        body = USE.sub(lambda m: " " * len(m.group()), text)
        for m in PATH.finditer(body):
            segs = re.split(r"\s*::\s*", m.group(1))
            found.append((m.start(), segs))
        for offset, segs in found:
            # `super` inside an inline `mod x { }` first leaves x.
            inner = sum(1 for a, b in spans if a < offset < b)
            while inner and segs and segs[0] == "super":
                segs, inner = ["self"] + segs[1:], inner - 1
            if segs[0] not in ("crate", "self", "super") and here + (segs[0],) not in target.modules:
                if segs[0] not in local:
                    continue
            r = resolver.resolve(segs, here, local)
            if r is None:
                continue
            to = r[0]
            k = 0
            while k < min(len(here), len(to)) and here[k] == to[k]:
                k += 1
            if k == len(here) or k == len(to):
                continue  # ancestor or descendant
            written = "::".join(segs)
            note = f"{mod.file.relative_to(workspace)}: {written}"
            direct = resolver.resolve(segs, here, local, follow=False)
            if direct is None or direct[0] != to:
                note += f" (re-exported from crate::{'::'.join(to)})"
            evidence = edges[here[:k]][here[k]][to[k]]
            if note not in evidence:
                evidence.append(note)
    return edges


def read_layers(architecture: Path) -> dict[str, int]:
    """The layer table of ARCHITECTURE.md: rows `| N | `a`, `b` |` under "Layers and imports"."""
    text = architecture.read_text()
    start = text.find("## Layers and imports")
    if start < 0:
        return {}
    layers = {}
    for line in text[start:].splitlines()[1:]:
        if line.startswith("## "):
            break
        m = re.match(r"\|\s*(\d+)\s*\|(.*)\|\s*$", line)
        if m:
            for name in re.findall(r"`(\w+)`", m.group(2)):
                layers[name] = int(m.group(1))
    return layers


def sccs(nodes, edges):
    """Tarjan's strongly connected components with more than one member."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def section_paths(cargo_toml: str, header: str) -> list[str]:
    """The `path = "..."` of each `[lib]` or `[[bin]]` section (header as written)."""
    out = []
    for block in re.split(r"(?m)^(?=\[)", cargo_toml):
        if block.startswith(header):
            m = re.search(r'(?m)^\s*path\s*=\s*"([^"]+)"', block)
            if m:
                out.append(m.group(1))
    return out


def targets_of(crate: Path) -> list[tuple[str, Path]]:
    """A crate's library and binaries: (label, root file)."""
    cargo = (crate / "Cargo.toml").read_text()
    out = []
    lib = section_paths(cargo, "[lib]")
    lib_root = crate / (lib[0] if lib else "src/lib.rs")
    if lib_root.is_file():
        out.append((crate.name, lib_root))
    bins = {crate / p for p in section_paths(cargo, "[[bin]]")}
    bins.add(crate / "src" / "main.rs")
    bins.update((crate / "src" / "bin").glob("*.rs"))
    bins.update((crate / "src" / "bin").glob("*/main.rs"))
    for b in sorted(p for p in bins if p.is_file()):
        name = b.parent.name if b.name == "main.rs" and b.parent.parent.name == "bin" else b.stem
        if b == crate / "src" / "main.rs":
            name = crate.name
        out.append((f"{crate.name} bin {name}", b))
    return out


def workspace_members(root: Path) -> list[Path]:
    """The `members` of the root Cargo.toml's `[workspace]` (globs expanded), or the root."""
    m = re.search(r"(?ms)^\[workspace\].*?^members\s*=\s*\[(.*?)\]", (root / "Cargo.toml").read_text())
    if not m:
        return [root]
    out = []
    for name in re.findall(r'"([^"]+)"', m.group(1)):
        out.extend(sorted(d for d in root.glob(name) if (d / "Cargo.toml").is_file()))
    return out


def circles(target: Target, edges) -> list[str]:
    out = []
    for parent, graph in sorted(edges.items()):
        nodes = set(graph) | {b for t in graph.values() for b in t}
        for comp in sccs(nodes, {a: set(t) for a, t in graph.items()}):
            where = "::".join(("crate",) + parent)
            detail = []
            for a in comp:
                for b in comp:
                    if b in graph.get(a, {}):
                        detail.append(f"{a} -> {b} ({graph[a][b][0]})")
            out.append(f"{target.label}: import circle under {where}: {' <-> '.join(comp)}: " + "; ".join(detail))
    return out


def layering(target: Target, edges, architecture: Path) -> list[str]:
    out = []
    layers = read_layers(architecture)
    top = {m[0] for m in target.modules if m}
    if not layers:
        return [f"{architecture.name}: no layer table under '## Layers and imports'"]
    for m in sorted(top - set(layers)):
        out.append(f"{target.label}: module `{m}` is in no layer of {architecture.name}")
    for m in sorted(set(layers) - top):
        out.append(f"{target.label}: layer table names `{m}`, which is no module of the crate")
    for a, targets in sorted(edges[()].items()):
        for b, evidence in sorted(targets.items()):
            if a in layers and b in layers and layers[b] >= layers[a]:
                kind = "sideways" if layers[b] == layers[a] else "upward"
                out.append(
                    f"{target.label}: {kind} import {a} (layer {layers[a]}) -> {b} (layer {layers[b]}): "
                    + "; ".join(evidence[:3])
                )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", type=Path, default=ROOT, help="the workspace (default: this repository)")
    ap.add_argument("--graph", action="store_true", help="print every arrow between siblings")
    args = ap.parse_args()
    root = args.root.resolve()

    problems, files, graph_lines = [], 0, []
    members = workspace_members(root)
    for crate in members:
        reached: set[Path] = set()
        for label, root_file in targets_of(crate):
            target = Target(label)
            read_module_tree(target, root_file, root, reached)
            edges = arrows(target, root)
            files += len(target.modules)
            problems += target.problems
            problems += circles(target, edges)
            if label == LAYERED_CRATE:
                problems += layering(target, edges, root / "ARCHITECTURE.md")
            for parent, graph in sorted(edges.items()):
                for a, tos in sorted(graph.items()):
                    for b, evidence in sorted(tos.items()):
                        where = "::".join(("crate",) + parent)
                        graph_lines.append(f"{label}: {where}: {a} -> {b}  [{evidence[0]}]")
        for f in sorted((crate / "src").rglob("*.rs")):
            rel = f.relative_to(crate / "src")
            if f.resolve() not in reached and not is_test_name(f.name) and "tests" not in rel.parts:
                problems.append(f"{f.relative_to(root)}: in no module tree (no `mod` declares it), so not checked")

    if args.graph:
        print("\n".join(graph_lines))
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(f"check_imports: {len(problems)} problem(s); the rule is in ARCHITECTURE.md", file=sys.stderr)
        return 1
    print(f"check_imports: {files} files in {len(members)} crates, no import circle, no upward import")
    return 0


if __name__ == "__main__":
    sys.exit(main())

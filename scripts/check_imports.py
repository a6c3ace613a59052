#!/usr/bin/env python3
"""Fails on an import circle or an upward import between the modules of a crate's `src/`.

ARCHITECTURE.md's rule ("Layers and imports"): the top-level modules of `pageserver/src` are
ranked in a table in ARCHITECTURE.md, and a module imports only modules of a lower layer; below
the top level, no two sibling modules import each other, directly or through other siblings.

An import is any path `crate::a::b`, `super::x` or `self::x` in a file, whether in a `use`
item or inline, outside comments, string literals and `#[cfg(test)]` items; test-only files
(`tests.rs`, `*_tests.rs`, anything under `tests/`) and the binaries (`bin/`) are not read,
because tests may reach anywhere and binaries sit above the library. A path names the deepest
module it reaches; a file that imports its own ancestor or descendant makes no edge (a parent
and its children are one unit). An edge between two modules is then counted between their
ancestors that are siblings: `crate::a::x` importing `crate::b::y` is an edge a -> b, and
`crate::w::p` importing `crate::w::q::r` an edge p -> q under `w`.

Usage: check_imports.py [--src DIR] [--architecture FILE] [--graph]
Exit status: 0 when the tree keeps the rule, 1 with one line per violation otherwise.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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


def module_of(path: Path, src: Path) -> tuple[str, ...]:
    rel = path.relative_to(src).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] in ("mod", "lib"):
        parts.pop()
    return tuple(parts)


def expand_use_tree(tree: str) -> list[str]:
    """`a::{b, c::{d, e}}` -> [`a::b`, `a::c::d`, `a::c::e`] (aliases and globs dropped)."""
    tree = re.sub(r"\s+as\s+\w+", "", tree)
    tree = re.sub(r"\s+", "", tree)
    k = tree.find("{")
    if k < 0:
        return [tree.removesuffix("::*")]
    # The outermost group: split its members at the commas not inside a nested group.
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
        if p:
            for sub in expand_use_tree(p):
                out.append(prefix + sub if sub != "self" else prefix.rstrip(":"))
    return out


def paths_in(text: str) -> list[str]:
    paths = []
    for m in re.finditer(r"\buse\s+([^;]+);", text):
        paths.extend(expand_use_tree(m.group(1)))
    body = re.sub(r"\buse\s+[^;]+;", "", text)
    paths.extend(re.findall(r"\b((?:crate|super|self)(?:::\w+)+)", body))
    return paths


def resolve(path: str, here: tuple[str, ...], modules: set) -> tuple | None:
    """The deepest module of `modules` a path reaches, or None for paths outside the crate."""
    segs = path.split("::")
    if segs[0] == "crate":
        base, rest = (), segs[1:]
    elif segs[0] in ("super", "self"):
        # In `a/b.rs` (module a::b) `self` is a::b and `super` is a; same for `a/b/mod.rs`.
        base = here
        while segs and segs[0] in ("super", "self"):
            if segs[0] == "super":
                base = base[:-1]
            segs = segs[1:]
        rest = segs
    else:
        return None
    target = base
    for s in rest:
        if target + (s,) in modules:
            target = target + (s,)
        else:
            break
    return target


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", type=Path, default=ROOT / "pageserver" / "src")
    ap.add_argument("--architecture", type=Path, default=ROOT / "ARCHITECTURE.md")
    ap.add_argument("--graph", action="store_true", help="print every edge between siblings")
    args = ap.parse_args()

    files = []
    for f in sorted(args.src.rglob("*.rs")):
        rel = f.relative_to(args.src)
        if rel.parts[0] in ("bin", "tests") or f.name == "tests.rs" or f.name.endswith("_tests.rs"):
            continue
        files.append(f)
    modules = {module_of(f, args.src) for f in files}
    # A module declared inline (`mod x {`) is part of its file's module.

    # edges[parent][a] = {b: [evidence]} for sibling modules a, b under parent.
    edges = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for f in files:
        here = module_of(f, args.src)
        text = drop_cfg_test_items(strip_comments_and_strings(f.read_text()))
        for p in paths_in(text):
            target = resolve(p, here, modules)
            if target is None:
                continue
            k = 0
            while k < min(len(here), len(target)) and here[k] == target[k]:
                k += 1
            if k == len(here) or k == len(target):
                continue  # ancestor or descendant
            parent, a, b = here[:k], here[k], target[k]
            edges[parent][a][b].append(f"{f.relative_to(args.src)}: {p}")

    problems = []
    layers = read_layers(args.architecture)
    top = {m[0] for m in modules if m}
    if not layers:
        problems.append(f"{args.architecture.name}: no layer table under '## Layers and imports'")
    else:
        for m in sorted(top - set(layers)):
            problems.append(f"module `{m}` is in no layer of {args.architecture.name}")
        for m in sorted(set(layers) - top):
            problems.append(f"layer table names `{m}`, which is no module of {args.src.name}/")
        for a, targets in sorted(edges[()].items()):
            for b, evidence in sorted(targets.items()):
                if a in layers and b in layers and layers[b] >= layers[a]:
                    kind = "sideways" if layers[b] == layers[a] else "upward"
                    problems.append(
                        f"{kind} import {a} (layer {layers[a]}) -> {b} (layer {layers[b]}): "
                        + "; ".join(evidence[:3])
                    )
    for parent, graph in sorted(edges.items()):
        nodes = set(graph) | {b for t in graph.values() for b in t}
        for comp in sccs(nodes, {a: set(t) for a, t in graph.items()}):
            where = "::".join(("crate",) + parent)
            detail = []
            for a in comp:
                for b in comp:
                    if b in graph.get(a, {}):
                        detail.append(f"{a} -> {b} ({graph[a][b][0]})")
            problems.append(f"import circle under {where}: {' <-> '.join(comp)}: " + "; ".join(detail))

    if args.graph:
        for parent, graph in sorted(edges.items()):
            for a, targets in sorted(graph.items()):
                for b, evidence in sorted(targets.items()):
                    print(f"{'::'.join(('crate',) + parent)}: {a} -> {b}  [{evidence[0]}]")
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(f"check_imports: {len(problems)} problem(s); the rule is in ARCHITECTURE.md", file=sys.stderr)
        return 1
    print(f"check_imports: {len(files)} files, no import circle, no upward import")
    return 0


if __name__ == "__main__":
    sys.exit(main())

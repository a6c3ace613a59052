"""Every dependency a crate of the workspace declares is used by that crate's code (a small
`cargo machete`): an unused crate costs build time and audit for nothing. Workspace-level
dependencies must be used by some member."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SECTIONS = ("dependencies", "dev-dependencies", "build-dependencies")


def crate_sources(crate_dir: Path) -> str:
    return "\n".join(p.read_text() for p in crate_dir.rglob("*.rs") if "target" not in p.parts)


def used(name: str, sources: str) -> bool:
    ident = name.replace("-", "_")
    # a path, a `use`, or a serde `with = "module"` attribute
    pattern = rf"\b{re.escape(ident)}::|\buse {re.escape(ident)}\b|with = \"{re.escape(ident)}\""
    return re.search(pattern, sources) is not None


def test_every_declared_dependency_is_used():
    workspace = tomllib.loads((REPO / "Cargo.toml").read_text())
    unused = []
    declared_by_members = set()
    for member in workspace["workspace"]["members"]:
        crate_dir = REPO / member
        manifest = tomllib.loads((crate_dir / "Cargo.toml").read_text())
        sources = crate_sources(crate_dir)
        for section in SECTIONS:
            for name in manifest.get(section, {}):
                declared_by_members.add(name)
                if not used(name, sources):
                    unused.append(f"{member}: [{section}] {name}")
        dev = set(manifest.get("dev-dependencies", {}))
        both = dev & set(manifest.get("dependencies", {}))
        unused += [f"{member}: {name} is both a dependency and a dev-dependency" for name in sorted(both)]
    for name in workspace["workspace"].get("dependencies", {}):
        if name not in declared_by_members:
            unused.append(f"[workspace.dependencies] {name} is used by no member")
    assert not unused, "\n".join(unused)

"""The repository's own documents: every `*.md` a file of the repo cites exists in the repo
(a reader cannot follow a reference to notes that were never committed), and every source path
the documents name (`dir/file.rs`, `.py`, `.sh`, in backquotes) is a file of the repo (a map
that names a module that does not exist, or no longer does, misleads its reader): in
ARCHITECTURE.md, README.md and everything under docs/, the design records of docs/rfcs/
included."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MD_REF = re.compile(r"[A-Za-z0-9_./-]*[A-Za-z0-9_-]+\.md\b")


def tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, timeout=30)
    if out.returncode == 0:
        return [REPO / name for name in out.stdout.decode().split("\0") if name]
    # not a git checkout (an exported tree): every file but build output and the venv
    return [p for p in REPO.rglob("*") if p.is_file() and not {"target", ".venv", ".git"} & set(p.parts)]


def test_every_cited_markdown_document_is_in_the_repo():
    missing = []
    for path in tracked_files():
        if path.suffix not in {".rs", ".md", ".py", ".toml", ".sh", ".txt"} and path.parent.name != "scripts":
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        for ref in set(MD_REF.findall(text)):
            if not ((REPO / ref).is_file() or (path.parent / ref).is_file()):
                missing.append(f"{path.relative_to(REPO)} cites {ref}")
    assert not missing, "\n".join(sorted(missing))


# A path in backquotes with at least one directory: `storage/index.rs`, `scripts/test.sh`.
SOURCE_REF = re.compile(r"`([A-Za-z0-9_./-]+/[A-Za-z0-9_.-]+\.(?:rs|py|sh))`")


def test_every_source_path_the_documents_name_exists():
    files = [str(p.relative_to(REPO)) for p in tracked_files()]
    docs = [REPO / "ARCHITECTURE.md", REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    missing = []
    for doc in docs:
        for ref in sorted(set(SOURCE_REF.findall(doc.read_text()))):
            # Paths are written from the repository's root or from a crate's or module's
            # directory named nearby (`storage/index.rs` for pageserver/src/storage/index.rs).
            if not any(f == ref or f.endswith("/" + ref) for f in files):
                missing.append(f"{doc.relative_to(REPO)} names {ref}")
    assert not missing, "\n".join(missing)

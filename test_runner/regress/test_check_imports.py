"""The import rule of ARCHITECTURE.md ("Layers and imports") and its check,
`scripts/check_imports.py`: the tree keeps the rule, and the check fails on each kind of
breach planted in a copy of the tree (a circle between siblings, an upward import, a module
missing from the layer table), while paths in comments, strings and tests are not imports."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "scripts" / "check_imports.py"


def check(src: Path, architecture: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(CHECK), "--src", str(src), "--architecture", str(architecture)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of `pageserver/src` and ARCHITECTURE.md to plant breaches in."""
    src = tmp_path / "src"
    shutil.copytree(REPO / "pageserver" / "src", src)
    architecture = tmp_path / "ARCHITECTURE.md"
    shutil.copy(REPO / "ARCHITECTURE.md", architecture)
    return src, architecture


def append(path: Path, text: str) -> None:
    path.write_text(path.read_text() + text)


def test_the_tree_keeps_the_rule():
    out = check(REPO / "pageserver" / "src", REPO / "ARCHITECTURE.md")
    assert out.returncode == 0, out.stderr


def test_a_circle_between_sibling_modules_fails(tree):
    src, architecture = tree
    # `pipeline` is below `process` in walredo; make it import `process` back.
    append(src / "walredo" / "pipeline.rs", "\n#[allow(unused_imports)]\nuse super::process::Process;\n")
    out = check(src, architecture)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "import circle under crate::walredo" in out.stderr, out.stderr
    assert "pipeline" in out.stderr and "process" in out.stderr, out.stderr


def test_a_circle_through_a_grouped_use_fails(tree):
    src, architecture = tree
    # A use tree, not a plain path: `writer` takes `io_choice`, so `io_choice` may not take `writer`.
    append(src / "page_service" / "io_choice.rs", "\n#[allow(unused_imports)]\nuse super::{proto, writer::Writer};\n")
    out = check(src, architecture)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "import circle under crate::page_service" in out.stderr, out.stderr


def test_an_upward_import_fails(tree):
    src, architecture = tree
    # storage (layer 2) reaching up to tenants (layer 6), inline rather than through `use`.
    append(src / "storage" / "format.rs", "\n#[allow(dead_code)]\nfn up(_: &crate::tenants::Tenants) {}\n")
    out = check(src, architecture)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "upward import storage (layer 2) -> tenants (layer 6)" in out.stderr, out.stderr


def test_an_import_within_one_layer_fails(tree):
    src, architecture = tree
    append(src / "http.rs", "\n#[allow(unused_imports)]\nuse crate::config::CONFIG_FILE_NAME;\n")
    out = check(src, architecture)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "sideways import http (layer 8) -> config (layer 8)" in out.stderr, out.stderr


def test_a_module_missing_from_the_layer_table_fails(tree):
    src, architecture = tree
    (src / "newcomer.rs").write_text("//! A module nobody ranked.\n")
    out = check(src, architecture)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "module `newcomer` is in no layer" in out.stderr, out.stderr


def test_paths_in_comments_strings_and_tests_are_not_imports(tree):
    src, architecture = tree
    append(
        src / "storage" / "format.rs",
        '\n// crate::server::run is above us\n'
        '/* crate::tenants::Tenants */\n'
        '#[allow(dead_code)]\nconst NOTE: &str = "crate::server::run";\n'
        "#[cfg(test)]\nmod planted {\n    #[allow(unused_imports)]\n    use crate::server::run;\n}\n",
    )
    (src / "storage" / "planted_tests.rs").write_text("use crate::server::run;\n")
    out = check(src, architecture)
    assert out.returncode == 0, out.stderr

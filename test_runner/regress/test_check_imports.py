"""The import rule of ARCHITECTURE.md ("Layers and imports") and its check,
`scripts/check_imports.py`: the workspace keeps the rule, and the check fails on each kind of
breach planted in a copy of the workspace's sources (a circle between siblings, also one made
through re-exports, one in another crate and one in a binary; an upward import; a module
missing from the layer table; a file no `mod` declares), while paths in comments, strings and
tests are not imports."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "scripts" / "check_imports.py"


def check(workspace: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(CHECK), "--root", str(workspace)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    """A copy of what the check reads, to plant breaches in: the workspace's Cargo.toml and
    ARCHITECTURE.md, and each member's Cargo.toml and `src/`."""
    root = tmp_path / "ws"
    root.mkdir()
    for name in ("Cargo.toml", "ARCHITECTURE.md"):
        shutil.copy(REPO / name, root / name)
    members = re.search(r"(?ms)^members\s*=\s*\[(.*?)\]", (REPO / "Cargo.toml").read_text())
    assert members, "no workspace members in Cargo.toml"
    for member in re.findall(r'"([^"]+)"', members.group(1)):
        (root / member).mkdir(parents=True)
        shutil.copy(REPO / member / "Cargo.toml", root / member / "Cargo.toml")
        shutil.copytree(REPO / member / "src", root / member / "src")
    return root


@pytest.fixture
def src(workspace: Path) -> Path:
    """The pageserver library's `src/` in the copy."""
    return workspace / "pageserver" / "src"


def append(path: Path, text: str) -> None:
    path.write_text(path.read_text() + text)


def test_the_workspace_keeps_the_rule():
    out = check(REPO)
    assert out.returncode == 0, out.stderr
    assert "in 4 crates" in out.stdout, out.stdout


def test_a_circle_between_sibling_modules_fails(workspace, src):
    # `pipeline` is below `process` in walredo; make it import `process` back.
    append(src / "walredo" / "pipeline.rs", "\n#[allow(unused_imports)]\nuse super::process::Process;\n")
    out = check(workspace)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "pageserver: import circle under crate::walredo" in out.stderr, out.stderr
    assert "pipeline" in out.stderr and "process" in out.stderr, out.stderr


def test_a_circle_through_a_grouped_use_fails(workspace, src):
    # A use tree, not a plain path: `writer` takes `io_choice`, so `io_choice` may not take `writer`.
    append(src / "page_service" / "io_choice.rs", "\n#[allow(unused_imports)]\nuse super::{proto, writer::Writer};\n")
    out = check(workspace)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "pageserver: import circle under crate::page_service" in out.stderr, out.stderr


def test_a_circle_through_re_exports_fails(workspace, src):
    # The circle storage had: `metrics` takes the block index through `layer`'s re-export of
    # `layer::block_index`, `layer` imports `segment`, and `segment` takes `StorageMetrics`
    # through the storage module's re-export of `metrics`. Written paths alone show no circle.
    append(src / "storage" / "metrics.rs", "\n#[allow(dead_code)]\nfn planted(_: &super::layer::BlockIndex) {}\n")
    out = check(workspace)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "pageserver: import circle under crate::storage: layer <-> metrics <-> segment" in out.stderr, out.stderr
    assert (
        "segment -> metrics (pageserver/src/storage/segment.rs: super::StorageMetrics"
        " (re-exported from crate::storage::metrics))" in out.stderr
    ), out.stderr


def test_a_circle_in_another_crate_through_a_glob_re_export_fails(workspace):
    pg15 = workspace / "walredo-proc" / "src" / "pg15"
    # `redo` dispatches to `heap`, which imports `bufpage`; `bufpage` taking `apply` from its
    # parent, which has it only through a glob of `redo`, closes a circle.
    append(pg15 / "mod.rs", "\npub use redo::*;\n")
    append(pg15 / "bufpage.rs", "\n#[allow(unused_imports)]\nuse super::apply;\n")
    out = check(workspace)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "walredo-proc: import circle under crate::pg15" in out.stderr, out.stderr
    assert (
        "bufpage -> redo (walredo-proc/src/pg15/bufpage.rs: super::apply (re-exported from crate::pg15::redo))"
        in out.stderr
    ), out.stderr


def test_a_circle_through_several_renaming_re_exports_fails(workspace):
    lib = workspace / "walredo-proc" / "src"
    # `pg15` imports `page`; `page` reaching `pg15::redo::apply` through two renaming hops (the
    # crate root, then `pg15`) is an arrow page -> pg15.
    append(lib / "lib.rs", "\npub use pg15::apply_pg15 as any_apply;\n")
    append(lib / "pg15" / "mod.rs", "\npub use self::redo::apply as apply_pg15;\n")
    append(lib / "page.rs", "\n#[allow(unused_imports)]\nuse crate::any_apply;\n")
    out = check(workspace)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "walredo-proc: import circle under crate: page <-> pg15" in out.stderr, out.stderr


def test_a_circle_in_a_binary_fails(workspace, src):
    # pagectl's `chain` imports `waldump`; `waldump` may not import `chain` back.
    append(src / "bin" / "pagectl" / "waldump.rs", "\n#[allow(unused_imports)]\nuse crate::chain;\n")
    out = check(workspace)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "pageserver bin pagectl: import circle under crate: chain <-> waldump" in out.stderr, out.stderr


def test_an_upward_import_fails(workspace, src):
    # storage (layer 2) reaching up to tenants (layer 6), inline rather than through `use`.
    append(src / "storage" / "format.rs", "\n#[allow(dead_code)]\nfn up(_: &crate::tenants::Tenants) {}\n")
    out = check(workspace)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "upward import storage (layer 2) -> tenants (layer 6)" in out.stderr, out.stderr


def test_an_import_within_one_layer_fails(workspace, src):
    append(src / "http.rs", "\n#[allow(unused_imports)]\nuse crate::config::CONFIG_FILE_NAME;\n")
    out = check(workspace)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "sideways import http (layer 8) -> config (layer 8)" in out.stderr, out.stderr


def test_a_path_that_leads_out_of_the_crate_is_no_arrow(workspace, src):
    # `storage::Lsn` is page_types::Lsn re-exported: storage naming it through `tenants` leads
    # to another crate, not up to `tenants`.
    append(src / "tenants.rs", "\npub use crate::storage::Lsn as TenantsLsn;\n")
    append(src / "storage" / "format.rs", "\n#[allow(dead_code)]\nfn lsn(_: crate::tenants::TenantsLsn) {}\n")
    out = check(workspace)
    assert out.returncode == 0, out.stderr


def test_a_module_missing_from_the_layer_table_fails(workspace, src):
    (src / "newcomer.rs").write_text("//! A module nobody ranked.\n")
    append(src / "lib.rs", "pub mod newcomer;\n")
    out = check(workspace)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "module `newcomer` is in no layer" in out.stderr, out.stderr


def test_a_file_no_module_declares_fails(workspace, src):
    (src / "storage" / "orphan.rs").write_text("//! Declared by no `mod`: the check would not read it.\n")
    out = check(workspace)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "pageserver/src/storage/orphan.rs: in no module tree" in out.stderr, out.stderr


def test_paths_in_comments_strings_and_tests_are_not_imports(workspace, src):
    append(
        src / "storage" / "format.rs",
        '\n// crate::server::run is above us\n'
        '/* crate::tenants::Tenants */\n'
        '#[allow(dead_code)]\nconst NOTE: &str = "crate::server::run";\n'
        "#[cfg(test)]\nmod planted {\n    #[allow(unused_imports)]\n    use crate::server::run;\n}\n",
    )
    (src / "storage" / "planted_tests.rs").write_text("use crate::server::run;\n")
    append(src / "storage" / "mod.rs", "\nmod planted_tests;\n")
    out = check(workspace)
    assert out.returncode == 0, out.stderr

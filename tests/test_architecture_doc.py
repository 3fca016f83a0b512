"""docs/architecture.md names every package and module of moec/, and names nothing that does not exist (issue 30)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
_PATH = re.compile(r"(?<![\w/.-])moec/[\w./-]*")


def named_paths(text: str) -> set[str]:
    """Every `moec/...` path written in the text, trailing sentence punctuation dropped, as `moec/a/b.py`
    for a file and `moec/a/` for a directory (however the text writes it)."""
    out = set()
    for m in _PATH.findall(text):
        p = m.rstrip(".")
        out.add(p if p.endswith(".py") or p.endswith("/") or not (ROOT / p).is_dir() else p + "/")
    return out


def tree_paths() -> set[str]:
    """Every .py module and every directory of moec/ (packages and data directories), caches excluded."""
    pkg = ROOT / "moec"
    out = {"moec/"}
    for p in pkg.rglob("*"):
        if "__pycache__" in p.parts:
            continue
        rel = p.relative_to(ROOT).as_posix()
        if p.is_dir():
            out.add(rel + "/")
        elif p.suffix == ".py":
            out.add(rel)
    return out


def test_every_named_module_exists():
    missing = sorted(p for p in named_paths(DOC.read_text()) if not (ROOT / p).exists())
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_every_module_is_named():
    unnamed = sorted(tree_paths() - named_paths(DOC.read_text()))
    assert not unnamed, f"docs/architecture.md does not name: {unnamed} (add a row to its module table)"


def test_the_checks_see_what_they_should():
    got = named_paths("`moec/runtime/kvtiered.py`, moec/cli/ and moec/hf. See moec/nothing.py; xmoec/errors.py")
    assert got == {"moec/runtime/kvtiered.py", "moec/cli/", "moec/hf/", "moec/nothing.py"}
    tree = tree_paths()
    assert {"moec/", "moec/registry.py", "moec/runtime/", "moec/runtime/model.py", "moec/builtin/demo-moe/"} <= tree
    assert not any("__pycache__" in p or p.endswith(".json") for p in tree)

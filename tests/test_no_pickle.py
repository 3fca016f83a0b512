"""No pickle is ever loaded (issue 19): checked on the source of the whole repository, every call at any depth.

A pickle runs code of the file's choosing when it is loaded, so a checkpoint, cache or data file that
travels between people must never be read by one: `torch.load` only with `weights_only=True` (tensors
and plain containers), no `pickle`/`dill`/`joblib` loads, no `numpy.load(..., allow_pickle=True)`, and
no `trust_remote_code=True` (a model directory's Python, run on load).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("moec", "benchmarks", "scripts", "tests")


def _dotted(node: ast.AST) -> str:
    """`torch.load` for the expression torch.load (names and attributes only; '' otherwise)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def _true(call: ast.Call, keyword: str) -> bool:
    return any(k.arg == keyword and isinstance(k.value, ast.Constant) and k.value.value is True for k in call.keywords)


def pickle_loads(source: str, filename: str = "<src>") -> list[str]:
    """'file:line: call' for every call in `source` that may unpickle or run a model's own code."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        bad = (name == "torch.load" and not _true(node, "weights_only")
               or name.split(".")[0] in ("pickle", "cPickle", "dill", "joblib", "cloudpickle", "_pickle")
               and name.rsplit(".", 1)[-1] in ("load", "loads", "Unpickler")
               or name in ("np.load", "numpy.load") and _true(node, "allow_pickle")
               or _true(node, "trust_remote_code"))
        if bad:
            found.append(f"{filename}:{node.lineno}: {ast.unparse(node)[:120]}")
    return found


@pytest.mark.parametrize("snippet", [
    "torch.load(f)", "torch.load(f, weights_only=False)", "pickle.loads(b)", "np.load(p, allow_pickle=True)",
    "AutoModel.from_pretrained(p, trust_remote_code=True)", "def f():\n    return dill.load(open(p, 'rb'))"])
def test_the_scan_sees_each_kind(snippet):
    assert pickle_loads(snippet), snippet


def test_the_scan_passes_safe_loads():
    assert not pickle_loads("torch.load(f, weights_only=True); np.load(p); json.load(f); safe_open(p, 'pt')")


def test_no_pickle_is_loaded_anywhere():
    found = [hit for d in SCANNED for f in sorted((ROOT / d).rglob("*.py"))
             for hit in pickle_loads(f.read_text(), str(f.relative_to(ROOT)))]
    assert not found, "\n".join(found)

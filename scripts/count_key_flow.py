"""Count how a recipe key flows through moec/ (issue 30, "one value, one place"): the files whose code refers
to it, the validations of it (an `if` on it that raises, an `assert` on it), and the places its default is
written. Comments and docstrings do not count (the source is read through its AST).

    python3 scripts/count_key_flow.py [--key window] [--default 128] [--root moec] [--packed DIR] [-v]

A reference is an attribute `.KEY`, a subscript `["KEY"]`, `.get("KEY", ...)`, a keyword `KEY=`, a parameter or
a name `KEY`, or a dict key / string "KEY". Files where the same word means something else are left out
(EXCLUDE: `moec eval --window` is the evaluation window, archspec's a model's sliding-attention window, not
the cache's).

`--packed DIR` also counts the places a packed checkpoint stores the key: every occurrence as a mapping key
in its JSON and YAML files (the manifest's per-tensor and per-shard entries left out: their `codec` and
`bits` are the tensor's own); those inside config.json's `quantization_config` are counted apart, as
mirrors (derived from the manifest in one function, never read back by moec).
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

EXCLUDE = {"window": ("cli/eval_cmd.py", "runtime/perplexity.py", "runtime/saved_logits.py",
                      "runtime/stream_eval.py", "hf/archspec.py")}  # archspec: a model's sliding-attention window


def _refers(node: ast.AST, key: str) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and n.attr == key:
            return True
        if isinstance(n, ast.Name) and n.id == key:
            return True
        if isinstance(n, ast.arg) and n.arg == key:
            return True
        if isinstance(n, ast.keyword) and n.arg == key:
            return True
        if isinstance(n, ast.Constant) and n.value == key:
            return True
    return False


def _is_default(node: ast.AST, key: str, default) -> bool:
    """A place where `default` is written as the key's value."""
    is_val = lambda v: isinstance(v, ast.Constant) and v.value == default and type(v.value) is type(default)  # noqa: E731
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == key:
        return node.value is not None and is_val(node.value)
    if isinstance(node, ast.Assign):
        return any(isinstance(t, (ast.Name, ast.Attribute)) and getattr(t, "id", getattr(t, "attr", None)) == key
                   for t in node.targets) and is_val(node.value)
    if isinstance(node, ast.keyword):
        return node.arg == key and is_val(node.value)
    if isinstance(node, ast.Dict):
        return any(isinstance(k, ast.Constant) and k.value == key and is_val(v)
                   for k, v in zip(node.keys, node.values, strict=True))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        return len(node.args) == 2 and isinstance(node.args[0], ast.Constant) and node.args[0].value == key \
            and is_val(node.args[1])
    return False


def _arg_defaults(fn: ast.FunctionDef | ast.AsyncFunctionDef, key: str, default) -> int:
    a = fn.args
    pos = a.posonlyargs + a.args
    pairs = list(zip(pos[len(pos) - len(a.defaults):], a.defaults, strict=True)) + \
        [(k, d) for k, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is not None]
    return sum(1 for arg, d in pairs if arg.arg == key and isinstance(d, ast.Constant) and d.value == default)


def count(root: Path, key: str, default) -> dict:
    files, validations, defaults = [], [], []
    skip = EXCLUDE.get(key, ())
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in skip:
            continue
        tree = ast.parse(path.read_text(), str(path))
        if not _refers(tree, key):
            continue
        files.append(rel)
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and _refers(node.test, key) \
                    and any(isinstance(n, ast.Raise) for s in node.body for n in ast.walk(s)):
                validations.append(f"{rel}:{node.lineno}")
            elif isinstance(node, ast.Assert) and _refers(node.test, key):
                validations.append(f"{rel}:{node.lineno}")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defaults += [f"{rel}:{node.lineno}"] * _arg_defaults(node, key, default)
            elif _is_default(node, key, default):
                defaults.append(f"{rel}:{node.lineno}")
    return {"files": files, "validations": validations, "defaults": defaults}


def _paths(x, key: str, at: str = "") -> list[str]:
    if isinstance(x, dict):
        return [p for k, v in x.items() for p in ([f"{at}{k}"] if k == key else []) + _paths(v, key, f"{at}{k}.")]
    if isinstance(x, list):
        return [p for v in x for p in _paths(v, key, at)]
    return []


def stores(packed: Path, key: str) -> dict:
    """{"stores": [file:path], "mirrors": [file:path]} of `key` in a packed checkpoint directory."""
    import yaml

    out = {"stores": [], "mirrors": []}
    for f in sorted(packed.iterdir()):
        if f.suffix == ".json" and f.name != "model.safetensors.index.json":
            data = json.loads(f.read_text())
        elif f.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(f.read_text())
        else:
            continue
        if f.name == "moec.json":
            data = {k: v for k, v in data.items() if k not in ("tensors", "shards")}
        for p in _paths(data, key):
            mirror = f.name == "config.json" and p.startswith("quantization_config.")
            out["mirrors" if mirror else "stores"].append(f"{f.name}:{p}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--key", default="window")
    ap.add_argument("--default", type=int, default=128)
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1] / "moec")
    ap.add_argument("--packed", type=Path, help="also count the stores of the key in this packed checkpoint")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args()
    c = count(a.root, a.key, a.default)
    line = (f"kv.{a.key}: {len(c['files'])} files, {len(c['validations'])} validations, "
            f"{len(c['defaults'])} defaults ({a.default})")
    if a.packed is not None:
        c |= stores(a.packed, a.key)
        line += f", stored {len(c['stores'])}x in {a.packed.name} (+ {len(c['mirrors'])} derived mirror)"
    print(line)
    if a.verbose:
        for what in ("files", "validations", "defaults", "stores", "mirrors"):
            if what in c:
                print(f"{what}:\n  " + "\n  ".join(c[what]))


if __name__ == "__main__":
    main()

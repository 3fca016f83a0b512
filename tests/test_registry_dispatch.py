"""The registry is the only dispatch: no module of moec/ compares a value against a registered codec name
(or a tuple, list or set holding one) outside that codec's own files and moec/registry.py.

A codec's own files: the modules whose file stem is the codec's family (`WeightCodecSpec.own` /
`KVCodecSpec.own`: the spec's `family`, else its name) or starts with the family and an underscore, in any
package: nuq-outlier (family nuq) owns moec/codecs/nuq.py, calibrate/nuq.py and runtime/nuq.py; latent-head and
latent-layer own codecs/latent.py, calibrate/latent.py, runtime/latent.py, kernels/latent_decode_attention.py;
hls, rtn, fp3 and fp8 (family hls: one fitter) own codecs/hls.py and calibrate/hls.py; vq owns codecs/vq.py and
calibrate/vq.py. Anything else reads the spec (its capabilities and hooks) instead.

What counts as a codec name in a comparison: a string constant, a tuple/list/set with one among its string
constants, and a name or attribute bound anywhere in moec/ to a codec-name string at module or class level
(`KEEP = "keep"` compared as `codec == KEEP`, `WeightCodec.FP8`). Dict lookups and registrations are not
comparisons.

Run as a script to print the count and each comparison:
    PYTHONPATH=$PWD python3 tests/test_registry_dispatch.py
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "moec"


def codec_families() -> dict[str, str]:
    """{registered codec name: family (the stem of its own files)}, built-in codecs and plugins."""
    from moec.registry import kv_codecs, weight_codecs

    return {n: s.own for table in (kv_codecs(), weight_codecs()) for n, s in table.items()}


def name_constants(files: list[Path], names: set[str]) -> dict[str, str]:
    """{identifier: codec name} of every module-level `IDENT = "<codec name>"` in the files, and
    {"Class.IDENT": codec name} of every such assignment in a class body."""
    out = {}
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        bodies = [("", tree.body)] + [(n.name + ".", n.body) for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
        for prefix, body in bodies:
            for node in body:
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                        and node.value.value in names:
                    out.update({prefix + t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    return out


def _values(node: ast.AST, consts: dict[str, str], names: set[str]) -> list[str]:
    """The codec names an operand of a comparison stands for."""
    if isinstance(node, ast.Constant):
        return [node.value] if isinstance(node.value, str) and node.value in names else []
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [v for e in node.elts for v in _values(e, consts, names)]
    if isinstance(node, ast.Name) and node.id in consts:
        return [consts[node.id]]
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
            and (key := f"{node.value.id}.{node.attr}") in consts:
        return [consts[key]]
    return []


def owns(path: Path, family: str) -> bool:
    stem = path.stem
    return stem == family or stem.startswith(family + "_")


def comparisons(root: Path, families: dict[str, str]) -> list[str]:
    """`file:line: comparison` for every comparison against a codec name outside that codec's own files."""
    files = sorted(root.rglob("*.py"))
    names = set(families)
    consts = name_constants(files, names)
    hits = []
    for path in files:
        if path.relative_to(root).as_posix() == "registry.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Compare):
                continue
            vals = [v for c in (node.left, *node.comparators) for v in _values(c, consts, names)]
            if vals and not all(owns(path, families[v]) for v in vals):
                hits.append(f"{root.name}/{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)[:100]}")
    return hits


def test_no_codec_name_comparisons_outside_a_codecs_own_files():
    hits = comparisons(PKG, codec_families())
    assert not hits, (f"{len(hits)} comparison(s) against codec names outside the codec's own files and "
                      f"moec/registry.py (read the spec instead: moec/registry.py):\n" + "\n".join(hits))


def test_the_checker_sees_names_constants_tuples_and_respects_own_files(tmp_path):
    root = tmp_path / "moec"
    (root / "formats").mkdir(parents=True)
    (root / "runtime").mkdir()
    (root / "formats" / "codecs.py").write_text('KEEP = "keep"\n\nclass WeightCodec:\n    VQ = "vq"\n')
    (root / "runtime" / "x.py").write_text(
        "from ..formats.codecs import KEEP, WeightCodec\n"
        "a = c == 'hls'\n"                 # 2: a constant
        "b = c in ('rtn', 'other')\n"      # 3: a tuple holding one
        "d = c != KEEP\n"                  # 4: a name bound to one
        "e = c == WeightCodec.VQ\n"        # 5: a class attribute bound to one
        "f = {'hls': 1}['hls']\n"          # a lookup, not a comparison
        "g = c == 'other'\n")
    (root / "runtime" / "hls.py").write_text("a = c in ('hls', 'rtn')\n")  # the hls family's own file
    (root / "runtime" / "nuq.py").write_text("a = c == 'hls'\n")  # another codec's file
    (root / "registry.py").write_text("a = c == 'vq'\n")
    fam = {"keep": "keep", "hls": "hls", "rtn": "hls", "vq": "vq", "nuq-outlier": "nuq"}
    got = [h.split(": ")[0] for h in comparisons(root, fam)]
    assert got == ["moec/runtime/nuq.py:1", "moec/runtime/x.py:2", "moec/runtime/x.py:3", "moec/runtime/x.py:4",
                   "moec/runtime/x.py:5"], got


if __name__ == "__main__":
    sys.path.insert(0, str(PKG.parent))
    found = comparisons(PKG, codec_families())
    print(len(found))
    print("\n".join(found))

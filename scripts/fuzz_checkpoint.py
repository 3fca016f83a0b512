"""Exploratory fuzz of packed-checkpoint loading (issue 19, item 1), the groundwork of its hypothesis test.

Packs two tiny random checkpoints (nuq-outlier KV; hls2 experts), then per case copies one, applies one
mutation (manifest field / tensor entry / kv section / shard entry / model_args with odd values, safetensors
header offsets / dtype / shape / length, truncation, a flipped bit, `../` shard paths, a shard symlinked
outside the directory, an unknown codec, bad shape or dtype strings), recomputes the shard hashes so the
mutation reaches the parsers, and loads it (load_model, the KV cache factory, one forward). Prints the
outcomes by (mutation, exception type): `ok`, the project's own UserError/FormatError, or anything else.

    python3 scripts/fuzz_checkpoint.py [N]        (N cases, default 300; ~0.3 s per case on 2 cores)

First run (1,200 cases, seed 0, tree 8dad232e): 372 loaded, 408 refused with the project's error, 420
escaped as other exceptions: SafetensorError 195 (truncated, bad header JSON/dtype/offsets, unwrapped),
TypeError 161 (manifest fields of the wrong type: shards entry not a dict, shard name not a str, kv
window a string), AssertionError 25 and ZeroDivisionError 1 (model_args checked by assert), RuntimeError
16 (model_args flags that change the parameter set), AttributeError 14 / KeyError 5 (missing or mistyped
top-level fields, a LUT codec without its parts), FileNotFoundError 3 (a tensor's `shard` of `../x`).
And two silent ones counted as `ok`: a shard symlinked to a file outside the checkpoint directory is
read (94 cases), and `../` in a tensor's shard name resolves outside it. An earlier unbounded run was
killed by the OOM killer: a declared dimension is allocated without a size check (hence RLIMIT_AS here).

Those are fixed; the property now lives in tests/formats/test_fuzz_checkpoint.py (hypothesis, the same
mutations and more), which CI runs. This script stays as the record of the first run.
"""
import collections
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402

from moec.calibrate.pack import pack_random  # noqa: E402
from moec.calibrate.recipe import load_recipe  # noqa: E402
from moec.errors import UserError  # noqa: E402
from moec.runtime.config import ModelArgs  # noqa: E402
from moec.runtime.loader import kv_cache_factory, load_model  # noqa: E402

ARGS = ModelArgs(arch="mixtral", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                 max_seq_len=128, n_experts=4, top_k=2, expert_dim=16, ffn_kinds=["moe", "moe"])
MANIFEST = "moec.json"
WEIRD = [None, -1, 0, 2**62, "x", "../x", "/etc/passwd", [], {}, 1.5, True, [2**40, 2**40], [-3], "kv-calib", "zip"]


def rehash(d: Path, m: dict) -> None:
    """Recompute each shard's sha256 and size so a mutation reaches the parsers, not just the hash check."""
    shards = m.get("shards")
    for f, meta in shards.items() if isinstance(shards, dict) else []:
        p = d / f if isinstance(f, str) else None
        if p is not None and p.is_file() and isinstance(meta, dict):
            b = p.read_bytes()
            meta["sha256"], meta["bytes"] = hashlib.sha256(b).hexdigest(), len(b)
    (d / MANIFEST).write_text(json.dumps(m))


def shard(d: Path) -> Path:
    return sorted(d.glob("*.safetensors"))[0]


def _header(d: Path, rng: random.Random) -> None:
    p = shard(d)
    b = bytearray(p.read_bytes())
    n = int.from_bytes(b[:8], "little")
    hdr = json.loads(b[8 : 8 + n])
    names = [k for k in hdr if k != "__metadata__"]
    name = rng.choice(names)
    what = rng.choice(["offsets", "dtype", "shape", "dup", "len"])
    if what == "len":
        b[:8] = rng.randint(0, 2**63).to_bytes(8, "little")
        p.write_bytes(bytes(b))
        return
    if what == "offsets":
        hdr[name]["data_offsets"] = [rng.randint(-5, 2**40), rng.randint(-5, 2**40)]
    elif what == "dtype":
        hdr[name]["dtype"] = rng.choice(["F99", "I3", "", "BOOL", "F8_E4M3"])
    elif what == "shape":
        hdr[name]["shape"] = rng.choice([[2**31, 2**31], [-1], [0], [3, 3, 3, 3, 3]])
    else:  # two tensors over the same bytes
        hdr[name]["data_offsets"] = hdr[rng.choice(names)]["data_offsets"]
    new = json.dumps(hdr).encode()
    p.write_bytes(len(new).to_bytes(8, "little") + new + bytes(b[8 + n :]))


def mutate(d: Path, rng: random.Random) -> str:
    m = json.loads((d / MANIFEST).read_text())
    kind = rng.choice(["field", "tensor", "kv", "shard", "header", "trunc", "flip", "traverse", "symlink", "codec",
                       "shape", "dtype", "args"])
    tensor = rng.choice(list(m["tensors"]))
    if kind == "field":
        k = rng.choice(list(m))
        if rng.random() < 0.7:
            m[k] = rng.choice(WEIRD)
        else:
            m.pop(k)
    elif kind == "tensor":
        e = m["tensors"][tensor]
        e[rng.choice(list(e) + ["param", "shard", "shape"])] = rng.choice(WEIRD)
    elif kind == "kv" and m.get("kv"):  # the section (shapes, tensors) or the recipe keys' home, recipe.kv
        home = m["kv"] if rng.random() < 0.5 else m["recipe"]["kv"]
        f = rng.choice(list(home) + ["codec", "bits", "n_layers", "window", "block", "sinks", "rope"])
        home[f] = rng.choice(WEIRD + [3, 64, 1024, "nuq-outlier", "rvq-tiered", "latent-layer"])
    elif kind == "shard":
        m["shards"][next(iter(m["shards"]))] = rng.choice(WEIRD)
    elif kind == "header":
        _header(d, rng)
    elif kind == "trunc":
        p = shard(d)
        b = p.read_bytes()
        p.write_bytes(b[: rng.randint(0, len(b) - 1)])
    elif kind == "flip":
        p = shard(d)
        b = bytearray(p.read_bytes())
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        p.write_bytes(bytes(b))
    elif kind == "traverse":
        f = next(iter(m["shards"]))
        m["shards"]["../" + f] = m["shards"].pop(f)
        for e in m["tensors"].values():
            e["shard"] = "../" + f
    elif kind == "symlink":  # the shard replaced by a link to a copy outside the checkpoint directory
        p = shard(d)
        outside = d.parent / ("outside-" + d.name)
        shutil.copy(p, outside)
        p.unlink()
        p.symlink_to(outside)
    elif kind == "codec":
        m["tensors"][tensor]["codec"] = rng.choice(["zip", "hls", "rtn", "fp8", "kv-calib", 7])
    elif kind == "shape":
        m["tensors"][tensor]["shape"] = rng.choice([[2**40], [1], [], [-1], "x"])
    elif kind == "dtype":
        m["tensors"][tensor]["dtype"] = rng.choice(["float99", "torch.float16", "", 3])
    elif kind == "args":
        m["model_args"][rng.choice(list(m["model_args"]))] = rng.choice(WEIRD + [10**9, 3])
    rehash(d, m)
    return kind


def main(n: int, seed: int = 0):
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))  # a huge declared shape: MemoryError, not the OOM killer
    rng = random.Random(seed)
    out: collections.Counter = collections.Counter()
    examples: dict = {}
    base = Path(tempfile.mkdtemp()) / "packed"
    pack_random(ARGS, "tiny", load_recipe("moec/recipes/ablations/kv-nuq2-outlier.yaml"), base)
    pack_random(ARGS, "tiny", load_recipe("moec/recipes/experts-hls2.yaml"), base.with_name("packed_hls"))
    for _ in range(n):
        src = base if rng.random() < 0.7 else base.with_name("packed_hls")
        d = Path(tempfile.mkdtemp()) / "ck"
        shutil.copytree(src, d)
        kind = mutate(d, rng)
        try:
            model, info = load_model(d)
            f = kv_cache_factory(info, model.args)
            if f is not None:
                c = f(model, 1, 64)
                model(torch.zeros(1, 40, dtype=torch.long), c, 0)
            out[(kind, "ok")] += 1
        except MemoryError:
            out[(kind, "MemoryError")] += 1
        except UserError:
            out[(kind, "UserError/FormatError")] += 1
        except Exception as e:
            key = (kind, type(e).__name__)
            out[key] += 1
            examples.setdefault(key, f"{e}"[:200] + " @ " + traceback.format_exc().strip().splitlines()[-3][:160])
        finally:
            shutil.rmtree(d.parent, ignore_errors=True)
    for k, v in sorted(out.items()):
        print(v, k)
    print("--- unexpected exception examples")
    for k, v in examples.items():
        print(k, v)
    shutil.rmtree(base.parent, ignore_errors=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 300)

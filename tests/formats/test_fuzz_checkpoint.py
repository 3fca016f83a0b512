"""Untrusted packed checkpoints (issue 19, item 1): a property-based fuzz of loading.

Hypothesis builds malicious checkpoints from three tiny packed ones (KV codecs nuq-outlier and
rvq-tiered, weight codecs hls, rtn and fp8, attention quantized in one) by one mutation each: manifest
fields of the wrong type or missing, huge or negative shapes and sizes, `../` and absolute shard
names, shards linked out of the directory, unregistered codecs, dropped or renamed codec parts, odd
model_args and KV sections, safetensors headers with offsets out of range or overlapping, unknown
dtypes or a bad length, truncated and flipped bytes. Every shard's sha256 and size are recomputed
afterwards, so the mutation reaches the parsers rather than stopping at the hash check.

Each case loads the checkpoint as `moec eval` does (load_model, the KV cache factory, a forward long
enough to push blocks out of the fp16 window, so the codec decodes its calibration). It must either
succeed or raise FormatError with a one-line message: no other exception, no hang (an alarm), no
allocation beyond a few GiB (RLIMIT_AS, lowered for the test only), and no file opened outside the
checkpoint directory (an audit hook on `open`; the Rust safetensors reader is not seen by it, but it
only opens shards that `verify` has hashed through Python's `open` first).

CI runs FUZZ_EXAMPLES = 2,000 derandomized examples (issue 19's bar; ~30 ms each); setting
MOEC_FUZZ_EXAMPLES=N runs N random ones instead. Run with `-s` to see the counts. The oversized-allocation
case runs in a subprocess under RLIMIT_AS (`test_terabyte_declarations_are_refused_without_allocating`).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moec.calibrate.pack import pack_random
from moec.calibrate.recipe import load_recipe, parse_recipe
from moec.errors import FormatError
from moec.runtime.config import ModelArgs
from moec.runtime.loader import kv_cache_factory, load_model

ROOT = Path(__file__).resolve().parents[2]
FUZZ_EXAMPLES = int(os.environ.get("MOEC_FUZZ_EXAMPLES", "2000"))
ARGS = ModelArgs(arch="mixtral", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                 max_seq_len=128, n_experts=4, top_k=2, expert_dim=16)
TOKENS = 40  # > sinks + window + block of the bases' KV sections: blocks leave the fp16 window
SMALL_KV = {"window": 16, "sinks": 4, "block": 8}
MANIFEST = "moec.json"
WEIRD = [None, -1, 0, 1, 3, 2**31, 2**62, 10**9, 1.5, 1e308, math.nan, True, "x", "", "../x", "/etc/passwd",
         [], {}, [2**40, 2**40], [-3], [0], "kv-calib", "zip", {"rope_type": "linear"}]


def _recipes() -> dict:
    nuq = load_recipe(ROOT / "moec/recipes/ablations/kv-nuq2-outlier.yaml").to_dict()
    nuq["kv"].update(SMALL_KV)
    rvq = load_recipe(ROOT / "moec/recipes/ablations/kv-rvq1.yaml").to_dict()
    rvq["kv"].update(SMALL_KV)
    return {
        "nuq": parse_recipe(nuq),
        "hls-fp8attn": parse_recipe({"name": "hls-fp8attn", "weights": [
            {"targets": ["experts"], "codec": "hls", "bits": 2},
            {"targets": ["attention"], "codec": "fp8", "bits": 8}]}),
        "rtn-rvq": parse_recipe({**rvq, "name": "rtn-rvq", "weights": [
            {"targets": ["experts"], "codec": "rtn", "bits": 3, "group_size": 16}]}),
    }


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fuzz-bases")
    for name, recipe in _recipes().items():
        pack_random(ARGS, "tiny", recipe, root / name)
    return {name: root / name for name in _recipes()}


# -- mutations -----------------------------------------------------------------------------------------

def _rehash(d: Path, m: dict) -> None:
    """Recompute each shard's sha256 and size, so the mutation reaches the parsers, not just the hash check."""
    shards = m.get("shards")
    for f, meta in shards.items() if isinstance(shards, dict) else []:
        p = d / f
        if isinstance(meta, dict) and "/" not in f and p.is_file():
            b = p.read_bytes()
            meta["sha256"], meta["bytes"] = hashlib.sha256(b).hexdigest(), len(b)
    (d / MANIFEST).write_text(json.dumps(m))


def _shard(d: Path) -> Path:
    return sorted(d.glob("*.safetensors"))[0]


def _mutate_header(d: Path, draw) -> str:
    p = _shard(d)
    b = bytearray(p.read_bytes())
    n = int.from_bytes(b[:8], "little")
    hdr = json.loads(b[8 : 8 + n])
    names = sorted(k for k in hdr if k != "__metadata__")
    name = draw(st.sampled_from(names))
    what = draw(st.sampled_from(["offsets", "dtype", "shape", "overlap", "length"]))
    if what == "length":
        b[:8] = draw(st.integers(0, 2**64 - 1)).to_bytes(8, "little")
        p.write_bytes(bytes(b))
        return "header-length"
    if what == "offsets":
        hdr[name]["data_offsets"] = [draw(st.integers(-5, 2**41)), draw(st.integers(-5, 2**41))]
    elif what == "dtype":
        hdr[name]["dtype"] = draw(st.sampled_from(["F99", "I3", "", "F8_E5M2", "F4", "U64", "BOOL"]))
    elif what == "shape":
        hdr[name]["shape"] = draw(st.sampled_from([[2**31, 2**31], [-1], [0], [3, 3, 3, 3, 3], [2**40]]))
    else:  # two tensors over the same bytes
        hdr[name]["data_offsets"] = hdr[draw(st.sampled_from(names))]["data_offsets"]
    new = json.dumps(hdr).encode()
    p.write_bytes(len(new).to_bytes(8, "little") + new + bytes(b[8 + n :]))
    return f"header-{what}"


def mutate(d: Path, draw) -> str:
    """One mutation of the checkpoint in `d` (hashes recomputed); returns its label."""
    m = json.loads((d / MANIFEST).read_text())
    weird = st.sampled_from(WEIRD)
    tensor = draw(st.sampled_from(sorted(m["tensors"])))
    quant = sorted(n for n, e in m["tensors"].items() if e["codec"] not in ("keep", "kv-calib"))
    kind = draw(st.sampled_from(["field", "tensor", "kv", "shard-entry", "shard-name", "symlink-out", "symlink-in",
                                 "header", "truncate", "flip", "codec", "part", "args"]))
    if kind == "field":
        key = draw(st.sampled_from(sorted(m)))
        if draw(st.booleans()):
            m[key] = draw(weird)
        else:
            del m[key]
    elif kind == "tensor":
        e = m["tensors"][tensor]
        e[draw(st.sampled_from(sorted({*e, "param", "param_shape", "group_size"})))] = draw(weird)
    elif kind == "kv":
        if not m.get("kv"):
            return "kv-none"
        recipe_kv = m["recipe"]["kv"]  # the recipe keys' one home (format 3); a key in both is refused
        keys = {*m["kv"], *recipe_kv, "bits", "window", "block", "sinks", "rope", "tensors"}
        key = draw(st.sampled_from(sorted(keys)))
        home = m["kv"] if key in m["kv"] or (key not in recipe_kv and draw(st.booleans())) else recipe_kv
        home[key] = draw(st.one_of(weird, st.sampled_from([3, 64, 1024, "nuq-outlier", "rvq-tiered", "latent-layer",
                                                           ["x"]])))
    elif kind == "shard-entry":
        m["shards"][draw(st.sampled_from(sorted(m["shards"])))] = draw(weird)
    elif kind == "shard-name":  # the shard's name (and every reference to it) made to leave the directory
        old = _shard(d).name
        new = draw(st.sampled_from(["../" + old, "/etc/passwd", "sub/" + old, "..", "", old + "\x00x"]))
        m["shards"][new] = m["shards"].pop(old)
        for e in m["tensors"].values():
            e["shard"] = new
    elif kind in ("symlink-out", "symlink-in"):  # the shard replaced by a link to a copy outside / inside
        p = _shard(d)
        target = d.parent / ("outside-" + p.name) if kind == "symlink-out" else d / ("inside-" + p.name)
        shutil.copy(p, target)
        p.unlink()
        p.symlink_to(target)
    elif kind == "header":
        kind = _mutate_header(d, draw)
    elif kind == "truncate":
        p = _shard(d)
        b = p.read_bytes()
        p.write_bytes(b[: draw(st.integers(0, len(b) - 1))])
    elif kind == "flip":
        p = _shard(d)
        b = bytearray(p.read_bytes())
        b[draw(st.integers(0, len(b) - 1))] ^= 1 << draw(st.integers(0, 7))
        p.write_bytes(bytes(b))
    elif kind == "codec":
        codecs = ["zip", "hls", "rtn", "fp3", "fp8", "keep", "kv-calib", 7]
        m["tensors"][tensor]["codec"] = draw(st.sampled_from(codecs))
    elif kind == "part":  # a part of a quantized matrix dropped or renamed (the entry and the manifest agree)
        if not quant:
            return "part-none"
        name = draw(st.sampled_from(quant))
        e = m["tensors"].pop(name)
        if draw(st.booleans()):
            m["tensors"][e["param"] + ".bogus"] = e  # not in the shard under that name either
    elif kind == "args":
        args = m["model_args"]
        args[draw(st.sampled_from(sorted({*args, "unknown_key"})))] = draw(weird)
    _rehash(d, m)
    return kind


# -- the property --------------------------------------------------------------------------------------

_OPENED: list[str] | None = None  # paths opened while a case loads (the audit hook appends; None: off)


def _audit(event: str, args) -> None:
    if event == "open" and _OPENED is not None and isinstance(args[0], str | bytes | os.PathLike):
        _OPENED.append(os.fsdecode(args[0]))


@contextlib.contextmanager
def _limits(extra_bytes: int, seconds: int):
    """RLIMIT_AS (soft) at the current size + extra_bytes, and an alarm per case; both restored after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    vm = int(next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith("VmSize"))
             .split()[1]) * 1024
    limit = vm + extra_bytes if hard == resource.RLIM_INFINITY else min(hard, vm + extra_bytes)

    def hang(signum, frame):
        raise TimeoutError(f"a case ran past {seconds} s")

    old = signal.signal(signal.SIGALRM, hang)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield lambda: signal.alarm(seconds)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def load_like_eval(d: Path) -> torch.Tensor:
    model, info = load_model(d)
    factory = kv_cache_factory(info, model.args)
    n = min(TOKENS, model.args.max_seq_len)  # `moec eval` refuses a window longer than the model takes
    tokens = torch.arange(n)[None] % model.args.vocab_size
    with torch.no_grad():
        if factory is None:
            return model(tokens)
        return model(tokens, factory(model, 1, n), 0)


def test_malicious_checkpoints_load_or_fail_cleanly(bases, tmp_path, capsys):
    global _OPENED
    sys.addaudithook(_audit)  # hooks cannot be removed: it records only while _OPENED is a list
    counts: collections.Counter = collections.Counter()
    refusals: collections.Counter = collections.Counter()

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize="MOEC_FUZZ_EXAMPLES" not in
              os.environ, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(st.data())
    def case(data):
        global _OPENED
        base = bases[data.draw(st.sampled_from(sorted(bases)), label="base")]
        work = tmp_path / f"case{counts['tried']}"
        d = work / "ck"
        shutil.copytree(base, d)
        try:
            kind = data.draw(st.just(mutate(d, data.draw)), label="mutation")
            counts["tried"] += 1
            _OPENED = []
            try:
                start_alarm()
                logits = load_like_eval(d)
                signal.alarm(0)
                counts["loaded"] += 1
                counts["reached the parsers"] += 1
                assert logits.shape[0] == 1 and logits.shape[2] == ARGS.vocab_size, (kind, logits.shape)
            except FormatError as e:
                signal.alarm(0)
                msg = str(e)
                assert msg and "\n" not in msg and len(msg) < 600, (kind, msg)
                counts["refused (FormatError)"] += 1
                if "sha256 mismatch" not in msg and "bytes, manifest says" not in msg:
                    counts["reached the parsers"] += 1
                refusals[kind] += 1
            finally:
                signal.alarm(0)
                opened, _OPENED = _OPENED, None
            inside, fuzz_root = d.resolve(), tmp_path.resolve()
            for p in opened:
                real = Path(os.path.realpath(p))
                assert fuzz_root not in real.parents or real == inside or inside in real.parents, \
                    f"{kind}: read {p} -> {real}, outside the checkpoint directory"
        finally:
            shutil.rmtree(work, ignore_errors=True)

    with _limits(extra_bytes=6 << 30, seconds=60) as start:
        start_alarm = start
        case()
    with capsys.disabled():
        print(f"\nfuzz: {dict(counts)}; refusals by mutation: {dict(sorted(refusals.items()))}")
    assert counts["tried"] == FUZZ_EXAMPLES or counts["tried"] >= FUZZ_EXAMPLES // 2, counts
    # the mutations reach the parsers (the rehash works), and both outcomes occur
    assert counts["reached the parsers"] >= 0.9 * counts["tried"], counts
    assert counts["loaded"] > 0 and counts["refused (FormatError)"] > 0, counts


# -- targeted cases --------------------------------------------------------------------------------------

def _edit(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    m = json.loads((dst / MANIFEST).read_text())
    edit(m, dst)
    _rehash(dst, m)
    return dst


def test_terabyte_declarations_are_refused_without_allocating(bases, tmp_path):
    """A manifest that declares a 1 TB tensor (its entry, its safetensors header, or model_args whose
    embedding is 1 TB), loaded in a subprocess limited to 4 GiB of address space: the clean error."""
    src = bases["nuq"]

    def entry(m, d):
        m["tensors"]["tok_embeddings.weight"]["shape"] = [2**33, 64]

    def header(m, d):
        p = _shard(d)
        b = p.read_bytes()
        n = int.from_bytes(b[:8], "little")
        hdr = json.loads(b[8 : 8 + n])
        start = hdr["tok_embeddings.weight"]["data_offsets"][0]
        hdr["tok_embeddings.weight"].update(shape=[2**33, 64], data_offsets=[start, start + 2**40])
        new = json.dumps(hdr).encode()
        p.write_bytes(len(new).to_bytes(8, "little") + new + b[8 + n :])
        m["tensors"]["tok_embeddings.weight"]["shape"] = [2**33, 64]

    def model_args(m, d):
        m["model_args"].update(vocab_size=2**30, dim=1024)  # 2^40 parameters

    def layers(m, d):
        m["model_args"].update(n_layers=10**9, ffn_kinds=[])

    dirs = [_edit(src, tmp_path / f.__name__, f) for f in (entry, header, model_args, layers)]
    code = textwrap.dedent("""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, resource.getrlimit(resource.RLIMIT_AS)[1]))
        from moec.errors import FormatError
        from moec.runtime.loader import load_model
        for d in sys.argv[1:]:
            try:
                load_model(d)
                print("loaded", d)
            except FormatError as e:
                print("FormatError", e)
    """)
    r = subprocess.run([sys.executable, "-c", code, *map(str, dirs)], capture_output=True, text=True, cwd=ROOT,
                       timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert len(lines) == 4 and all(ln.startswith("FormatError") for ln in lines), r.stdout
    assert "[8589934592, 64]" in lines[0] and "not a readable safetensors file" in lines[1], lines
    assert "'tok_embeddings.weight' has shape [64, 32], model_args needs [1073741824, 1024]" in lines[2], lines[2]
    assert "n_layers" in lines[3], lines[3]


def test_links_inside_the_directory_still_load(bases, tmp_path):
    """The symlink rule refuses links leading out, not links as such."""
    d = tmp_path / "ck"
    shutil.copytree(bases["hls-fp8attn"], d)
    p = _shard(d)
    p.rename(d / "real.bin")
    p.symlink_to("real.bin")
    assert load_like_eval(d).shape == (1, TOKENS, ARGS.vocab_size)
    out = tmp_path / "elsewhere.bin"
    (d / "real.bin").rename(out)
    p.unlink()
    p.symlink_to(out)
    with pytest.raises(FormatError, match="outside the checkpoint directory"):
        load_model(d)

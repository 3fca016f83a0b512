"""moec/runtime/retrieval.py (benchmarks/bench_retrieval.py's trials): the shared prefill equals the cache's
own, the trials put every needle in the compressed history, and the intervals are right."""

import random

import pytest
import torch

from moec.rotation import block_hadamard
from moec.runtime.kvcache import FP16Cache
from moec.runtime.kvtiered import tiered_cache_factory
from moec.runtime.loader import load_model
from moec.runtime.nuq import FIXED_LEVELS, NUQCenteredCodec, NUQOutlierCodec
from moec.runtime.retrieval import (
    NEW_TOKENS,
    QUESTION_MAX,
    RESERVE,
    TASKS,
    KeysValuesApart,
    PrefillRecorder,
    WorstTokensExact,
    answer,
    build,
    load_prefill,
    paired_diff,
    plan,
    wilson,
)
from tests.runtime.tiny_hf import make_tiny


def _codecs(args, rotated: bool, bits: int = 2):
    g = torch.Generator().manual_seed(bits)
    lev = torch.tensor(FIXED_LEVELS[bits])
    out = []
    for _ in range(args.n_layers):
        scale = torch.rand(args.n_kv_heads, args.head_dim, generator=g) + 0.5
        if rotated:
            out.append(NUQCenteredCodec(bits, args.head_dim, 8, lev, lev, scale, 0.0,
                                        k_center=torch.randn(args.n_kv_heads, args.head_dim, generator=g) * 0.1,
                                        rotation=block_hadamard(args.head_dim, seed=0),
                                        k_err2=torch.rand(args.n_kv_heads, args.head_dim, generator=g) * 0.01))
        else:
            out.append(NUQOutlierCodec(bits, args.head_dim, 8, lev, lev, scale, 0.05))
    return out


@pytest.mark.parametrize("kind", ["fp16", "nuq-outlier", "nuq-rotated", "k3v2"])
def test_shared_prefill_equals_the_caches_own(tmp_path, kind):
    """The recorded prefill handed to a cache (load_prefill) leaves it as its own prefill would: the
    question's logits and the greedy answer agree (tiny llama, 2 rows, windows short enough that most of the
    prompt is encoded)."""
    make_tiny("llama", tmp_path)
    model, _ = load_model(tmp_path)
    a = model.args
    kv = {"codec": "nuq-outlier", "bits": 2, "window": 8, "sinks": 2, "block": 8, "rope": "post"}
    if kind == "fp16":
        def factory(m, b, n):
            return FP16Cache(m.args, b, n, dtype=torch.float16)
    elif kind == "k3v2":
        codecs = [KeysValuesApart(k, v) for k, v in zip(_codecs(a, True, 3), _codecs(a, True, 2), strict=True)]
        factory = tiered_cache_factory(kv, codecs, use_kernel=False)
    else:
        factory = tiered_cache_factory(kv, _codecs(a, kind == "nuq-rotated"))
    g = torch.Generator().manual_seed(1)
    hay = torch.randint(0, a.vocab_size, (2, 53), generator=g)
    q = torch.randint(0, a.vocab_size, (2, 5), generator=g)
    n = hay.shape[1] + q.shape[1] + NEW_TOKENS
    with torch.no_grad():
        own = factory(model, 2, n)
        model(hay, own, 0)
        rec = PrefillRecorder()
        model(hay, rec, 0)
        shared = factory(model, 2, n)
        load_prefill(shared, rec, a.n_layers, a.n_heads)
        want = model(q, own, hay.shape[1])
        got = model(q, shared, hay.shape[1])
        # the same fp16 rounding of the window: equal up to summation order; rotated caches round k·R instead
        tol = 1e-5 if kind in ("fp16", "nuq-outlier") else 5e-3
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    own2, shared2 = factory(model, 2, n), factory(model, 2, n)
    with torch.no_grad():
        model(hay, own2, 0)
    load_prefill(shared2, rec, a.n_layers, a.n_heads)
    assert answer(model, shared2, q, hay.shape[1]) == answer(model, own2, q, hay.shape[1])


def test_mixed_codec_stores_keys_and_values_at_their_own_bits():
    """K3V2 stores 3-bit key codes and 2-bit value codes: more bytes than 2/2, fewer than 3/3."""
    make_args = type("A", (), {"n_layers": 1, "n_kv_heads": 2, "head_dim": 32})
    k3, v2 = _codecs(make_args, True, 3)[0], _codecs(make_args, True, 2)[0]
    mix = KeysValuesApart(k3, v2)
    x = torch.randn(1, 2, 8, 32)
    assert mix.encode(x, "k")["codes"].shape[-1] == k3.encode(x, "k")["codes"].shape[-1] == 12  # 32·3/8
    assert mix.encode(x, "v")["codes"].shape[-1] == v2.encode(x, "v")["codes"].shape[-1] == 8
    torch.testing.assert_close(mix.decode(mix.encode(x, "k"), "k"), k3.decode(k3.encode(x, "k"), "k"))


def test_worst_tokens_kept_exact_through_the_cache_fields():
    """WorstTokensExact restores, per block, the n tokens the inner codec reconstructs worst, bit for bit in
    fp16, and leaves every other token as the inner codec decodes it; decoding several blocks at once (as
    the cache does) scatters each block's rows into its own block."""
    from moec.runtime.kivi import KIVICodec
    from moec.runtime.kvtiered import alloc_fields

    torch.manual_seed(0)
    inner, blk = KIVICodec(2, 32, 32), 16
    codec = WorstTokensExact(inner, 2, 32)
    x = torch.randn(3, 2, blk, 32)  # 3 blocks of one row
    x[1, 0, 5] *= 30  # a token the 2-bit codec cannot follow
    f = codec.encode(x, "v")
    assert 5 in f["exact_idx"][1, 0, 0].tolist()
    buf = alloc_fields(codec.fields("v"), 1, 2, 3, blk, "cpu")  # the cache's buffers: blocks side by side
    for name, t in f.items():
        per = blk if codec.fields("v")[name][0] == "token" else 1
        buf[name][0] = t.transpose(0, 1).reshape(2, 3 * per, *t.shape[3:])
    y = codec.decode(buf, "v")[0].reshape(2, 3, blk, 32).transpose(0, 1)  # [block, K, N, d]
    base = inner.decode(inner.encode(x, "v"), "v")
    for b in range(3):
        for k in range(2):
            kept = set(f["exact_idx"][b, k, 0].tolist())
            for t in range(blk):
                want = x[b, k, t].half().float() if t in kept else base[b, k, t]
                torch.testing.assert_close(y[b, k, t], want)
    assert (y - x).abs()[1, 0, 5].max() < 1e-1 < (base - x).abs()[1, 0, 5].max()


@pytest.mark.parametrize("task", ["passkey", "needle"])
def test_every_needle_sits_in_the_compressed_history(task):
    from moec.calibrate.sources import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model("smollm2-135m"))  # the benchmark's model
    length, lo, guard = 1024, 64, 256
    for t in plan(task, 12, 0):
        hay, q, pos = build(tok, task, t, length, lo, guard)
        assert len(hay) == length - RESERVE and len(q) <= QUESTION_MAX
        for p, key, name in zip(pos, t["keys"], t["names"], strict=True):
            width = len(tok(TASKS[task]["needle"].format(key=key, name=name), add_special_tokens=False)["input_ids"])
            needle = tok.decode(hay[p: p + width])
            assert str(key) in needle.replace(" ", "") and (name is None or name in needle)
            assert lo <= p and p + width <= len(hay) - guard
    assert plan(task, 12, 0) == plan(task, 12, 0) and plan(task, 12, 0) != plan(task, 12, 1)


def test_wilson_interval():
    lo, hi = wilson(81, 263)  # Newcombe (1998), single proportion, method 3: 0.2553 to 0.3662
    assert abs(lo - 0.2553) < 1e-4 and abs(hi - 0.3662) < 1e-4
    assert wilson(0, 20)[0] == 0.0 and wilson(20, 20)[1] == 1.0


def test_paired_difference_interval():
    """Newcombe's paired interval: contains the estimate, mirrors when the arms swap, and covers the true
    difference about 95% of the time (seeded simulation of correlated pairs)."""
    a = [True] * 60 + [False] * 40
    b = [True] * 50 + [False] * 10 + [True] * 5 + [False] * 35
    d, lo, hi = paired_diff(a, b)
    assert lo < d < hi and abs(d - (-0.05)) < 1e-12
    d2, lo2, hi2 = paired_diff(b, a)
    assert abs(d2 + d) < 1e-12 and abs(lo2 + hi) < 1e-12 and abs(hi2 + lo) < 1e-12
    assert paired_diff([True] * 100, [False] * 100)[2] < -0.9
    rng = random.Random(0)
    covered, n_sim = 0, 400
    for _ in range(n_sim):
        xs, ys = [], []
        for _ in range(60):
            x = rng.random() < 0.85
            y = x if rng.random() < 0.7 else rng.random() < 0.6  # correlated, true p_y = 0.7·0.85 + 0.3·0.6
            xs.append(x)
            ys.append(y)
        _, lo, hi = paired_diff(xs, ys)
        covered += lo <= (0.7 * 0.85 + 0.3 * 0.6) - 0.85 <= hi
    assert covered / n_sim >= 0.92
